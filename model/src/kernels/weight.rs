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

use crate::quant::{dequantize, GgmlType};

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
    }

    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Weight::F32(v) => v.len(),
            Weight::Blocks { ty, bytes, .. } => bytes.len() / ty.block_bytes() * ty.block_elems(),
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
        }
    }

    /// The element type as a name (`f32`, or the GGUF block type).
    pub fn kind(&self) -> &'static str {
        match self {
            Weight::F32(_) => "f32",
            Weight::Blocks { ty, .. } => ty.name(),
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
