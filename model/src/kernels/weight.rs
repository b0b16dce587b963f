//! A linear layer's weight matrix as the model file holds it: f32 values, or a GGUF tensor's own blocks.
//!
//! Blocks are never materialised as an f32 matrix. A product dequantizes a panel of a few weight rows at
//! a time into a buffer that stays in cache, with the same [`dequantize`] every f32 copy came from, and
//! runs the f32 kernel over it; for a few activation rows (decode) it dequantizes each weight vector in
//! registers into the f32 kernel's own accumulators. The values, and so the bits, are those of the f32
//! matrix, while memory traffic is the blocks' (Q8_0: 34 bytes for 32 weights, not 128).

use std::borrow::Cow;
use std::ops::{Deref, Range};
use std::sync::Arc;

use crate::quant::{dequantize, f16_at, GgmlType};

use super::q8::QK;

/// The bytes of a tensor's blocks: owned, or a range of a model file's read-only mapping (no copy: the
/// pages are the file's, shared and reclaimable).
#[derive(Clone, Debug)]
pub enum BlockBytes {
    /// Owned bytes.
    Owned(Vec<u8>),
    /// `range` of `map`.
    Mapped {
        /// The mapping.
        map: Arc<memmap2::Mmap>,
        /// The tensor's bytes in it.
        range: Range<usize>,
    },
}

impl BlockBytes {
    /// Lets the kernel drop the pages of bytes `part` of a mapping from this process (they stay in the page cache, and a
    /// later read maps them again): for a tensor that `fast` has copied into another layout, whose pages
    /// would otherwise stay resident beside the copy. Owned bytes are left as they are.
    fn release(&self, part: Range<usize>) {
        if let BlockBytes::Mapped { map, range } = self {
            assert!(part.end <= range.len(), "a part of the bytes");
            // SAFETY: the mapping is private and read-only, so no page of it was ever written: a page
            // dropped here reads back as the same bytes of the file on its next access.
            let dropped = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, range.start + part.start, part.len())
            };
            // Advice only: where it is refused, the pages stay resident and nothing else changes.
            let _ = dropped;
        }
    }
}

impl BlockBytes {
    /// Maps the pages of bytes `part` of a mapping in at once, where each would otherwise fault on its
    /// first read (owned bytes are left as they are).
    fn populate(&self, part: Range<usize>) {
        if let BlockBytes::Mapped { map, range } = self {
            assert!(part.end <= range.len(), "a part of the bytes");
            // Advice only: where it is refused (a kernel before 5.14), the pages fault in as they are read.
            let _ = map.advise_range(memmap2::Advice::PopulateRead, range.start + part.start, part.len());
        }
    }
}

impl Deref for BlockBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            BlockBytes::Owned(v) => v,
            BlockBytes::Mapped { map, range } => &map[range.clone()],
        }
    }
}

/// A `[rows][cols]` weight matrix.
#[derive(Clone, Debug)]
pub enum Weight {
    /// f32 values, row-major.
    F32(Vec<f32>),
    /// Whole blocks of `ty`, row-major; each row is `cols / ty.block_elems()` blocks.
    Blocks {
        /// The block type.
        ty: GgmlType,
        /// The blocks.
        bytes: BlockBytes,
        /// Columns (elements per row).
        cols: usize,
    },
    /// Q8_0 rows interleaved sixteen at a time, for `fast`.
    Interleaved(Interleaved),
}

/// Weight rows interleaved per group of [`Interleaved`].
pub(crate) const GROUP: usize = 16;

/// A matrix of one of the 32-value block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) with its rows interleaved
/// [`GROUP`] at a time, the layout in which `fast`'s kernels meet four columns of 16 weight rows in one
/// 512-bit vector ([`super::native`]'s `interleaved`; llama.cpp repacks its weights likewise). Per group
/// and chunk of 32 columns, the same bytes as the 16 rows' blocks, regrouped:
/// - the 16 rows' f16 scales `d`, then (Q4_1, Q5_1) their f16 offsets `m`;
/// - (Q5_0, Q5_1) per lane `l` of 8 (columns `4l..4l + 4`), a 64-bit mask whose bit `4i + k` is row
///   `i`'s fifth bit of column `4l + k`;
/// - the values: for Q8_0, per lane and row its four values as unsigned bytes `v + 128`; for the 4- and
///   5-bit types, per lane `l` of 4 and row, its four bytes of nibbles `4l..4l + 4` as the block holds
///   them (the low nibbles columns `4l..4l + 4`, the high ones `16 + 4l..`).
///
/// Weight `k` of a row is `d * (u[k] - o) + m`, `u` the unsigned value and `o` the type's offset
/// ([`Interleaved::offset`]); the values are the blocks'.
#[derive(Clone, Debug)]
pub struct Interleaved {
    pub(crate) ty: GgmlType,
    pub(crate) bytes: Arc<memmap2::Mmap>,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl Interleaved {
    /// `w` interleaved, where it is blocks of a 32-value type in whole groups of rows (`None`
    /// otherwise). The groups are copied on the threads of the pool this runs in, and the source's
    /// mapped pages are then released (see [`BlockBytes`]), so the copy does not double the resident
    /// weights.
    pub fn of(w: &Weight) -> Option<Self> {
        use rayon::prelude::*;
        let Weight::Blocks { ty, bytes: src, cols } = w else { return None };
        let (ty, cols, chunks) = (*ty, *cols, *cols / QK);
        if !matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1) {
            return None;
        }
        let bb = ty.block_bytes();
        let row_bytes = chunks * bb;
        let rows = src.len() / row_bytes;
        if rows == 0 || !rows.is_multiple_of(GROUP) {
            return None;
        }
        let shape =
            Interleaved { ty, bytes: Arc::new(memmap2::MmapMut::map_anon(1).ok()?.make_read_only().ok()?), rows, cols };
        let (offset, fifth, at, cb) = (shape.has_offset(), shape.fifth(), shape.values_at(), shape.chunk_bytes());
        // Q8_0's values go in as unsigned bytes `v + 128`, the others' nibbles as they are.
        let (values, flip) = if ty == GgmlType::Q8_0 { (2..bb, 0x8080_8080) } else { (bb - 16..bb, 0) };
        // A group's 16 rows lie together in the blocks as in the copy, `group` bytes.
        let group = chunks * GROUP * bb;
        // Row after row of the group (each read in order), chunk after chunk of it.
        let copy = |g: usize, out: &mut [u8]| {
            let mut masks = vec![[0u64; QK / 4]; if fifth { chunks } else { 0 }];
            for i in 0..GROUP {
                let row = &src[(g * GROUP + i) * row_bytes..][..row_bytes];
                for ((c, block), out) in row.chunks_exact(bb).enumerate().zip(out.chunks_exact_mut(cb)) {
                    out[2 * i..2 * i + 2].copy_from_slice(&block[..2]);
                    if offset {
                        out[2 * GROUP + 2 * i..][..2].copy_from_slice(&block[2..4]);
                    }
                    let out = &mut out[at + 4 * i..];
                    for (l, four) in block[values.clone()].chunks_exact(4).enumerate() {
                        let four = u32::from_ne_bytes(four.try_into().expect("4 bytes")) ^ flip;
                        out[4 * l * GROUP..][..4].copy_from_slice(&four.to_ne_bytes());
                    }
                    if fifth {
                        let qh = u32::from_le_bytes(block[bb - 20..bb - 16].try_into().expect("4 bytes"));
                        for (l, mask) in masks[c].iter_mut().enumerate() {
                            *mask |= u64::from(qh >> (4 * l) & 0xF) << (4 * i);
                        }
                    }
                }
            }
            for (masks, out) in masks.iter().zip(out.chunks_exact_mut(cb)) {
                for (l, mask) in masks.iter().enumerate() {
                    out[at - 64 + 8 * l..][..8].copy_from_slice(&mask.to_le_bytes());
                }
            }
        };
        // The copy in its own mapping, in huge pages where the kernel gives them (a few hundred faults
        // for Gemma 3's head where 4 KiB pages took 45000, and as many fewer TLB entries for the
        // kernels that stream it), read-only once written.
        let mut bytes = memmap2::MmapMut::map_anon(src.len()).ok()?;
        // Advice only: without huge pages the copy is the same, in 4 KiB pages.
        let _ = bytes.advise(memmap2::Advice::HugePage);
        // In slabs of a few MiB, each slab's blocks mapped in at once before they are read and released
        // once copied: the copy and its source are never both resident whole (a 177 MiB head would
        // otherwise add as much to the peak).
        const SLAB: usize = 8 << 20;
        let per_slab = (SLAB / group).max(1);
        for (s, slab) in bytes.chunks_mut(per_slab * group).enumerate() {
            let part = s * per_slab * group..s * per_slab * group + slab.len();
            src.populate(part.clone());
            slab.par_chunks_mut(group).enumerate().for_each(|(j, out)| copy(s * per_slab + j, out));
            src.release(part);
        }
        Some(Interleaved { bytes: Arc::new(bytes.make_read_only().ok()?), ..shape })
    }

    /// Whether the weights carry an offset `m` (Q4_1, Q5_1).
    #[inline]
    pub(crate) fn has_offset(&self) -> bool {
        matches!(self.ty, GgmlType::Q4_1 | GgmlType::Q5_1)
    }

    /// Whether the values have a fifth bit (Q5_0, Q5_1).
    #[inline]
    pub(crate) fn fifth(&self) -> bool {
        matches!(self.ty, GgmlType::Q5_0 | GgmlType::Q5_1)
    }

    /// What the unsigned values are offset by: weight `k` is `d * (u[k] - o) + m`.
    #[inline]
    pub(crate) fn offset(&self) -> i32 {
        match self.ty {
            GgmlType::Q8_0 => 128,
            GgmlType::Q4_0 => 8,
            GgmlType::Q5_0 => 16,
            _ => 0,
        }
    }

    /// Where a group's chunk's fifth-bit masks end and its values start.
    #[inline]
    pub(crate) fn values_at(&self) -> usize {
        2 * GROUP * (1 + usize::from(self.has_offset())) + if self.fifth() { 64 } else { 0 }
    }

    /// Bytes of a group's chunk.
    #[inline]
    pub(crate) fn chunk_bytes(&self) -> usize {
        GROUP * self.ty.block_bytes()
    }

    /// Where group `g`'s chunk `c` starts.
    #[inline]
    pub(crate) fn at(&self, g: usize, c: usize) -> usize {
        (g * (self.cols / QK) + c) * self.chunk_bytes()
    }

    /// The unsigned value of row `i` (of its group), column `k` (of 32) in the group chunk `b`.
    #[inline]
    pub(crate) fn value(&self, b: &[u8], i: usize, k: usize) -> i32 {
        let at = self.values_at();
        if self.ty == GgmlType::Q8_0 {
            return i32::from(b[at + 4 * ((k / 4) * GROUP + i) + k % 4]);
        }
        let j = k % 16;
        let byte = b[at + 4 * ((j / 4) * GROUP + i) + j % 4];
        let nibble = if k < 16 { byte & 0xF } else { byte >> 4 };
        let bit = 4 * i + k % 4;
        let high = self.fifth() && b[at - 64 + 8 * (k / 4) + bit / 8] >> (bit % 8) & 1 == 1;
        i32::from(nibble) + if high { 16 } else { 0 }
    }

    /// Rows `rows`, dequantized into `out` (`rows.len() x cols`): the blocks' values.
    fn dequantize(&self, rows: Range<usize>, out: &mut [f32]) {
        let o = self.offset();
        for (j, out) in rows.zip(out.chunks_exact_mut(self.cols)) {
            let (g, i) = (j / GROUP, j % GROUP);
            for (c, out) in out.chunks_exact_mut(QK).enumerate() {
                let b = &self.bytes[self.at(g, c)..][..self.chunk_bytes()];
                let d = f16_at(b, 2 * i);
                let m = if self.has_offset() { f16_at(b, 2 * GROUP + 2 * i) } else { 0.0 };
                for (k, y) in out.iter_mut().enumerate() {
                    let v = (self.value(b, i, k) - o) as f32;
                    *y = if self.has_offset() { d * v + m } else { d * v };
                }
            }
        }
    }
}

impl From<Vec<f32>> for Weight {
    fn from(v: Vec<f32>) -> Self {
        Weight::F32(v)
    }
}

impl Weight {
    /// `bytes` of `ty` blocks, rows of `cols` elements: kept as blocks when every row is whole blocks of
    /// a quantized or 16-bit type, else dequantized to f32.
    pub fn from_blocks(ty: GgmlType, bytes: BlockBytes, cols: usize) -> Self {
        let be = ty.block_elems();
        if ty != GgmlType::F32 && cols > 0 && cols.is_multiple_of(be) && bytes.len().is_multiple_of(ty.block_bytes()) {
            return Weight::Blocks { ty, bytes, cols };
        }
        let mut out = vec![0f32; bytes.len() / ty.block_bytes() * be];
        dequantize(ty, &bytes, &mut out);
        Weight::F32(out)
    }

    /// Whether it is held as blocks of integer values, on which `fast` computes directly.
    pub fn integer_blocks(&self) -> bool {
        matches!(self, Weight::Blocks { ty, .. } if super::native::supports(*ty))
            || matches!(self, Weight::Interleaved(_))
    }

    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Weight::F32(v) => v.len(),
            Weight::Blocks { ty, bytes, .. } => bytes.len() / ty.block_bytes() * ty.block_elems(),
            Weight::Interleaved(m) => m.rows * m.cols,
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.as_bytes().len()
    }

    /// The bytes held, as the kernels read them.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Weight::F32(v) => zerocopy::IntoBytes::as_bytes(&v[..]),
            Weight::Blocks { bytes, .. } => bytes,
            Weight::Interleaved(m) => &m.bytes[..],
        }
    }

    /// The element type as a name (`f32`, or the GGUF block type).
    pub fn kind(&self) -> &'static str {
        match self {
            Weight::F32(_) => "f32",
            Weight::Blocks { ty, .. } => ty.name(),
            Weight::Interleaved(m) => m.ty.name(),
        }
    }

    /// Rows `rows` of a matrix of `cols` columns, as f32: borrowed when held as f32, else dequantized into
    /// `buf`.
    pub fn rows<'a>(&'a self, rows: std::ops::Range<usize>, cols: usize, buf: &'a mut Vec<f32>) -> &'a [f32] {
        match self {
            Weight::F32(v) => &v[rows.start * cols..rows.end * cols],
            Weight::Blocks { ty, bytes, cols: c } => {
                assert_eq!(*c, cols, "weight columns");
                let row_bytes = cols / ty.block_elems() * ty.block_bytes();
                buf.resize(rows.len() * cols, 0.0);
                dequantize(*ty, &bytes[rows.start * row_bytes..rows.end * row_bytes], buf);
                buf
            }
            Weight::Interleaved(m) => {
                assert_eq!(m.cols, cols, "weight columns");
                buf.resize(rows.len() * cols, 0.0);
                m.dequantize(rows, buf);
                buf
            }
        }
    }

    /// The whole matrix as f32 (a copy for blocks).
    pub fn to_f32(&self) -> Cow<'_, [f32]> {
        match self {
            Weight::F32(v) => Cow::Borrowed(v),
            Weight::Blocks { ty, bytes, .. } => {
                let mut out = vec![0f32; self.len()];
                dequantize(*ty, bytes, &mut out);
                Cow::Owned(out)
            }
            Weight::Interleaved(m) => {
                let mut out = vec![0f32; self.len()];
                m.dequantize(0..m.rows, &mut out);
                Cow::Owned(out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_blocks_are_the_f32_matrix_rows() {
        // Two rows of 64 Q8_0 weights: four blocks, scales 0.5 and 0.25.
        let mut bytes = Vec::new();
        for b in 0..4u8 {
            bytes.extend(half::f16::from_f32(if b % 2 == 0 { 0.5 } else { 0.25 }).to_bits().to_le_bytes());
            bytes.extend((0..32).map(|i| (i as i8 - 16 + b as i8) as u8));
        }
        let w = Weight::from_blocks(GgmlType::Q8_0, BlockBytes::Owned(bytes.clone()), 64);
        assert!(matches!(w, Weight::Blocks { .. }));
        let all = w.to_f32().into_owned();
        assert_eq!(all.len(), 128);
        let mut buf = Vec::new();
        assert_eq!(w.rows(1..2, 64, &mut buf), &all[64..]);
        // A row that is not whole blocks is kept as f32.
        assert!(matches!(Weight::from_blocks(GgmlType::Q8_0, BlockBytes::Owned(bytes), 48), Weight::F32(_)));
    }
}
