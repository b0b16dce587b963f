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

use crate::quant::{dequantize, f16_at, scale_min_k4_int, GgmlType};

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
        map: FileMap,
        /// The tensor's bytes in it.
        range: Range<usize>,
    },
}

/// A GGUF file's shared read-only mapping, made only by [`crate::gguf::Gguf`]: what
/// [`BlockBytes::release`] drops pages of must read back the same bytes from the file, which an
/// anonymous or copy-on-write mapping would not, so no code outside this crate can make one.
#[derive(Clone, Debug)]
pub struct FileMap(Arc<memmap2::Mmap>);

impl FileMap {
    /// `map` must be a shared read-only mapping of a file (`memmap2::Mmap::map`).
    pub(crate) fn of_file(map: Arc<memmap2::Mmap>) -> Self {
        FileMap(map)
    }
}

impl std::ops::Deref for FileMap {
    type Target = memmap2::Mmap;
    fn deref(&self) -> &memmap2::Mmap {
        &self.0
    }
}

impl BlockBytes {
    /// Lets the kernel drop the pages of bytes `part` of a mapping from this process (they stay in the
    /// page cache, and a later read maps them again): for a tensor that `fast` has copied into another
    /// layout, whose pages would otherwise stay resident beside the copy. Owned bytes are left as they are.
    fn release(&self, part: Range<usize>) {
        if let BlockBytes::Mapped { map, range } = self {
            assert!(part.end <= range.len(), "a part of the bytes");
            // SAFETY: the mapping is a file's, shared and read-only ([`FileMap`]: no anonymous or
            // copy-on-write one can be here), and never written through, so a page dropped here maps
            // again from the page cache with the same bytes on its next access, and every slice over it
            // reads what it read before (a file changed underneath would break every read of the mapping
            // alike; dropping pages adds no such case).
            let dropped = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, range.start + part.start, part.len())
            };
            // Advice only: where it is refused, the pages stay resident and nothing else changes.
            let _ = dropped;
        }
    }

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
    /// Blocks with their rows interleaved sixteen at a time, as `fast` multiplies them.
    Interleaved(Interleaved),
}

/// Weight rows interleaved per group of [`Interleaved`].
pub(crate) const GROUP: usize = 16;

/// A matrix of blocks with its rows interleaved [`GROUP`] at a time, the layout in which `fast`'s kernels
/// meet four columns of 16 weight rows in one 512-bit vector ([`super::native`]'s `interleaved`;
/// llama.cpp repacks its weights likewise). For the 32-value types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) and
/// Q4_K and Q6_K. Per group and *unit* (a block's columns: 32, or 256 for the K-quants), the 16 rows'
/// blocks regrouped:
/// - the 32-value types, per chunk of 32 columns (the same bytes as the blocks):
///   - the 16 rows' f16 scales `d`, then (Q4_1, Q5_1) their f16 offsets `m`;
///   - (Q5_0, Q5_1) per lane `l` of 8 (columns `4l..4l + 4`), a 64-bit mask whose bit `4i + k` is row
///     `i`'s fifth bit of column `4l + k`;
///   - the values: for Q8_0, per lane and row its four values as unsigned bytes `v + 128`; for the 4-
///     and 5-bit types, per lane `l` of 4 and row, its four bytes of nibbles `4l..4l + 4` as the block
///     holds them (the low nibbles columns `4l..4l + 4`, the high ones `16 + 4l..`);
/// - Q4_K, per block of 256 (64 bytes more than the blocks, 3%): the rows' f16 `d`, their f16 `dmin`;
///   per chunk the rows' 6-bit scales, then per chunk their 6-bit mins, a byte each; then per pair of
///   chunks `p` and lane `l`, each row's four bytes `32p + 4l..` of nibbles (the low ones chunk `2p`,
///   the high ones chunk `2p + 1`);
/// - Q6_K, per block of 256 (the same bytes): the rows' f16 `d`; per chunk, each row's scale of its
///   first 16 values, then of its last 16; the low four bits as the block holds them, per quarter `q` of
///   its 128 bytes and lane, each row's four bytes (the low nibbles chunks `4n + k`, `k < 2`, of half
///   `n = q / 2`, the high ones `4n + k + 2`); the high two bits likewise per half of its 64 bytes.
///
/// Weight `k` of a chunk of a row is `d * isc * (u[k] - o) + m` ([`Chunk`]), `u` the unsigned value,
/// `o` the type's offset ([`Layout::offset`]), `isc` the integer scale of the value's half (1 but
/// for the K-quants); the values are the blocks'.
#[derive(Clone, Debug)]
pub struct Interleaved {
    pub(crate) layout: Layout,
    pub(crate) bytes: Arc<memmap2::Mmap>,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

/// One chunk of 32 weights of a row of an [`Interleaved`] matrix: weight `k` is
/// `d * isc[k / 16] * (u[k] - o) + m`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Chunk {
    pub(crate) u: [u8; QK],
    pub(crate) isc: [i32; 2],
    pub(crate) d: f32,
    pub(crate) m: f32,
}

/// Where a Q4_K unit's scales, mins and values start.
pub(crate) const Q4K_SCALES: usize = 4 * GROUP;
pub(crate) const Q4K_MINS: usize = Q4K_SCALES + 8 * GROUP;
pub(crate) const Q4K_VALUES: usize = Q4K_MINS + 8 * GROUP;
/// Where a Q6_K unit's scales, low bits and high bits start.
pub(crate) const Q6K_SCALES: usize = 2 * GROUP;
pub(crate) const Q6K_LOW: usize = Q6K_SCALES + 16 * GROUP;
pub(crate) const Q6K_HIGH: usize = Q6K_LOW + 128 * GROUP;

impl Interleaved {
    /// `w` interleaved, where it is blocks of an interleaved type in whole groups of rows (`None`
    /// otherwise). The groups are copied on the threads of the pool this runs in, and the source's
    /// mapped pages are then released (see [`BlockBytes`]), so the copy does not double the resident
    /// weights.
    pub fn of(w: &Weight) -> Option<Self> {
        use rayon::prelude::*;
        let Weight::Blocks { ty, bytes: src, cols } = w else { return None };
        let (ty, cols) = (*ty, *cols);
        // Every type `fast` computes on but Q5_K (in neither real model; its blocks stay row-major).
        if !super::native::supports(ty) || ty == GgmlType::Q5K {
            return None;
        }
        let (bb, units) = (ty.block_bytes(), cols / ty.block_elems());
        let row_bytes = units * bb;
        let rows = src.len() / row_bytes;
        if rows == 0 || !rows.is_multiple_of(GROUP) {
            return None;
        }
        let layout = Layout { ty };
        let ub = layout.unit_bytes();
        // A group's 16 rows lie together in the blocks, `from` bytes, and in the copy, `to`.
        let (from, to) = (units * GROUP * bb, units * ub);
        // Row after row of the group (each read in order), unit after unit of it.
        let copy = |g: usize, out: &mut [u8]| {
            for i in 0..GROUP {
                let row = &src[(g * GROUP + i) * row_bytes..][..row_bytes];
                for (block, out) in row.chunks_exact(bb).zip(out.chunks_exact_mut(ub)) {
                    layout.put(block, i, out);
                }
            }
        };
        // The copy in its own mapping, in huge pages where the kernel gives them (a few hundred faults
        // for Gemma 3's head where 4 KiB pages took 45000, and as many fewer TLB entries for the
        // kernels that stream it), read-only once written.
        let mut bytes = memmap2::MmapMut::map_anon(rows / GROUP * to).ok()?;
        // Advice only: without huge pages the copy is the same, in 4 KiB pages.
        let _ = bytes.advise(memmap2::Advice::HugePage);
        // In slabs of a few MiB, each slab's blocks mapped in at once before they are read and released
        // once copied: the copy and its source are never both resident whole (a 177 MiB head would
        // otherwise add as much to the peak).
        const SLAB: usize = 2 << 20;
        let per_slab = (SLAB / to).max(1);
        for (s, slab) in bytes.chunks_mut(per_slab * to).enumerate() {
            let part = s * per_slab * from..s * per_slab * from + slab.len() / to * from;
            src.populate(part.clone());
            slab.par_chunks_mut(to).enumerate().for_each(|(j, out)| copy(s * per_slab + j, out));
            src.release(part);
        }
        // And once more whole: pages mapped again after their slab's release (by the neighbouring
        // slabs' reads at their edges) were 8 MiB of SmolLM2's 94 after `configure`.
        src.release(0..src.len());
        Some(Interleaved { layout, bytes: Arc::new(bytes.make_read_only().ok()?), rows, cols })
    }

    /// Where group `g`'s unit `u` starts.
    #[inline]
    pub(crate) fn at(&self, g: usize, u: usize) -> usize {
        (g * (self.cols / self.layout.ty.block_elems()) + u) * self.layout.unit_bytes()
    }

    /// Rows `rows`, dequantized into `out` (`rows.len() x cols`): the blocks' values (bit for bit for
    /// the 32-value types; the K-quants' products are formed as the chunks define them).
    fn dequantize(&self, rows: Range<usize>, out: &mut [f32]) {
        let (o, cpu) = (self.layout.offset(), self.layout.chunks_per_unit());
        for (j, out) in rows.zip(out.chunks_exact_mut(self.cols)) {
            let (g, i) = (j / GROUP, j % GROUP);
            for (c, out) in out.chunks_exact_mut(QK).enumerate() {
                let b = &self.bytes[self.at(g, c / cpu)..][..self.layout.unit_bytes()];
                let ch = self.layout.chunk(b, i, c % cpu);
                for (k, y) in out.iter_mut().enumerate() {
                    let v = (i32::from(ch.u[k]) - o) as f32;
                    let scaled = if cpu == 1 { ch.d * v } else { ch.d * ch.isc[k / 16] as f32 * v };
                    *y = if self.layout.has_offset() { scaled + ch.m } else { scaled };
                }
            }
        }
    }
}

/// What an [`Interleaved`] matrix's layout depends on alone: its block type.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    pub(crate) ty: GgmlType,
}

impl Layout {
    /// Puts `block` as row `i` of its group's unit `out`.
    fn put(&self, block: &[u8], i: usize, out: &mut [u8]) {
        let bb = block.len();
        // Four bytes of the block from `from` to where row `i`'s lane `l` of a section at `at` is.
        let four = |out: &mut [u8], at: usize, l: usize, from: usize, flip: u32| {
            let v = u32::from_ne_bytes(block[from..from + 4].try_into().expect("4 bytes")) ^ flip;
            out[at + 4 * (l * GROUP + i)..][..4].copy_from_slice(&v.to_ne_bytes());
        };
        match self.ty {
            GgmlType::Q4K => {
                out[2 * i..2 * i + 2].copy_from_slice(&block[..2]);
                out[2 * GROUP + 2 * i..][..2].copy_from_slice(&block[2..4]);
                for c in 0..8 {
                    let (sc, mn) = scale_min_k4_int(c, &block[4..16]);
                    out[Q4K_SCALES + c * GROUP + i] = sc;
                    out[Q4K_MINS + c * GROUP + i] = mn;
                }
                for p in 0..4 {
                    for l in 0..8 {
                        four(out, Q4K_VALUES + 512 * p, l, 16 + 32 * p + 4 * l, 0);
                    }
                }
            }
            GgmlType::Q6K => {
                out[2 * i..2 * i + 2].copy_from_slice(&block[208..210]);
                for (j, &sc) in block[192..208].iter().enumerate() {
                    out[Q6K_SCALES + j * GROUP + i] = sc;
                }
                for q in 0..4 {
                    for l in 0..8 {
                        four(out, Q6K_LOW + 512 * q, l, 32 * q + 4 * l, 0);
                    }
                }
                for n in 0..2 {
                    for l in 0..8 {
                        four(out, Q6K_HIGH + 512 * n, l, 128 + 32 * n + 4 * l, 0);
                    }
                }
            }
            ty => {
                let at = self.values_at();
                out[2 * i..2 * i + 2].copy_from_slice(&block[..2]);
                if self.has_offset() {
                    out[2 * GROUP + 2 * i..][..2].copy_from_slice(&block[2..4]);
                }
                // Q8_0's values go in as unsigned bytes `v + 128`, the others' nibbles as they are.
                let (values, flip) = if ty == GgmlType::Q8_0 { (2, 0x8080_8080) } else { (bb - 16, 0) };
                for l in 0..(bb - values) / 4 {
                    four(out, at, l, values + 4 * l, flip);
                }
                if self.fifth() {
                    let qh = u32::from_le_bytes(block[bb - 20..bb - 16].try_into().expect("4 bytes"));
                    for l in 0..QK / 4 {
                        let mask = &mut out[at - 64 + 8 * l..][..8];
                        let bits = u64::from_le_bytes(mask.try_into().expect("8 bytes"))
                            | u64::from(qh >> (4 * l) & 0xF) << (4 * i);
                        mask.copy_from_slice(&bits.to_le_bytes());
                    }
                }
            }
        }
    }

    /// Whether the weights carry an offset `m` (Q4_1, Q5_1, Q4_K).
    #[inline]
    pub(crate) fn has_offset(&self) -> bool {
        matches!(self.ty, GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K)
    }

    /// Whether the values have a fifth bit in masks (Q5_0, Q5_1).
    #[inline]
    pub(crate) fn fifth(&self) -> bool {
        matches!(self.ty, GgmlType::Q5_0 | GgmlType::Q5_1)
    }

    /// What the unsigned values are offset by.
    #[inline]
    pub(crate) fn offset(&self) -> i32 {
        match self.ty {
            GgmlType::Q8_0 => 128,
            GgmlType::Q4_0 => 8,
            GgmlType::Q5_0 => 16,
            GgmlType::Q6K => 32,
            _ => 0,
        }
    }

    /// Where a 32-value type's unit's fifth-bit masks end and its values start.
    #[inline]
    pub(crate) fn values_at(&self) -> usize {
        2 * GROUP * (1 + usize::from(self.has_offset())) + if self.fifth() { 64 } else { 0 }
    }

    /// Chunks of 32 columns per unit.
    #[inline]
    pub(crate) fn chunks_per_unit(&self) -> usize {
        self.ty.block_elems() / QK
    }

    /// Bytes of a group's unit.
    #[inline]
    pub(crate) fn unit_bytes(&self) -> usize {
        match self.ty {
            GgmlType::Q4K => Q4K_VALUES + 2048,
            ty => GROUP * ty.block_bytes(),
        }
    }

    /// Row `i`'s chunk `c` (of its unit) in the group unit `b`: the definition every kernel follows.
    pub(crate) fn chunk(&self, b: &[u8], i: usize, c: usize) -> Chunk {
        let four = |at: usize, k: usize| b[at + 4 * ((k / 4) * GROUP + i) + k % 4];
        let mut ch = Chunk { u: [0; QK], isc: [1; 2], d: f16_at(b, 2 * i), m: 0.0 };
        match self.ty {
            GgmlType::Q4K => {
                let sc = i32::from(b[Q4K_SCALES + c * GROUP + i]);
                ch.isc = [sc; 2];
                // Exact: an f16 times an integer below 64.
                ch.m = -(f16_at(b, 2 * GROUP + 2 * i) * f32::from(b[Q4K_MINS + c * GROUP + i]));
                for (k, u) in ch.u.iter_mut().enumerate() {
                    let byte = four(Q4K_VALUES + 512 * (c / 2), k);
                    *u = if c.is_multiple_of(2) { byte & 0xF } else { byte >> 4 };
                }
            }
            GgmlType::Q6K => {
                let (n, k4) = (c / 4, c % 4);
                ch.isc = std::array::from_fn(|h| i32::from(b[Q6K_SCALES + (2 * c + h) * GROUP + i] as i8));
                for (k, u) in ch.u.iter_mut().enumerate() {
                    let low = four(Q6K_LOW + 512 * (2 * n + k4 % 2), k);
                    let low = if k4 < 2 { low & 0xF } else { low >> 4 };
                    let high = four(Q6K_HIGH + 512 * n, k) >> (2 * k4) & 3;
                    *u = low | high << 4;
                }
            }
            ty => {
                if self.has_offset() {
                    ch.m = f16_at(b, 2 * GROUP + 2 * i);
                }
                let at = self.values_at();
                for (k, u) in ch.u.iter_mut().enumerate() {
                    if ty == GgmlType::Q8_0 {
                        *u = four(at, k);
                        continue;
                    }
                    let byte = four(at, k % 16);
                    let nibble = if k < 16 { byte & 0xF } else { byte >> 4 };
                    let bit = 4 * i + k % 4;
                    let high = self.fifth() && b[at - 64 + 8 * (k / 4) + bit / 8] >> (bit % 8) & 1 == 1;
                    *u = nibble + if high { 16 } else { 0 };
                }
            }
        }
        ch
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

    /// Elements per row, where it is held as rows of blocks (an f32 matrix does not know its shape).
    pub fn cols(&self) -> Option<usize> {
        match self {
            Weight::F32(_) => None,
            Weight::Blocks { cols, .. } => Some(*cols),
            Weight::Interleaved(m) => Some(m.cols),
        }
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
            Weight::Interleaved(m) => m.layout.ty.name(),
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
