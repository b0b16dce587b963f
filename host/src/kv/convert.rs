//! Element type conversion between span and cache dtypes.

use half::{bf16, f16};
use shm_format::Dtype;

/// Whether a span of `from` may land in a cache of `to`: always for the same type or a widening to f32;
/// narrowing (to bf16 or f16, or between them) only when the cache allows lossy conversion.
pub fn convertible(from: Dtype, to: Dtype, allow_lossy: bool) -> bool {
    from == to || to == Dtype::F32 || allow_lossy
}

/// Bytes of `to` that `src_len` bytes of `from` become.
pub fn converted_len(from: Dtype, to: Dtype, src_len: usize) -> usize {
    src_len / from.size() as usize * to.size() as usize
}

fn f32_le(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn f16_le(b: &[u8]) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

fn bf16_le(b: &[u8]) -> f32 {
    bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// Runs `$body` with `$values` bound to an iterator over the little-endian elements of `$from` in `$src`,
/// widened to f32 (exact: every dtype here fits in f32). One expansion per dtype, so the loops are
/// monomorphised and the element conversions inline instead of costing a call each.
macro_rules! widened {
    ($from:expr, $src:expr, |$values:ident| $body:expr) => {
        match $from {
            Dtype::F32 => {
                let $values = $src.chunks_exact(4).map(f32_le);
                $body
            }
            Dtype::F16 => {
                let $values = $src.chunks_exact(2).map(f16_le);
                $body
            }
            Dtype::Bf16 => {
                let $values = $src.chunks_exact(2).map(bf16_le);
                $body
            }
        }
    };
}

/// Widens little-endian elements of `from` in `src` into `dst` (decode widens every past row each step).
pub fn to_f32(from: Dtype, src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len() * from.size() as usize);
    widened!(from, src, |values| dst.iter_mut().zip(values).for_each(|(d, v)| *d = v))
}

/// Converts little-endian elements of `from` in `src` into `to` in `dst` (exactly `converted_len` bytes).
/// Narrowing rounds to nearest, ties to even.
pub fn convert(from: Dtype, src: &[u8], to: Dtype, dst: &mut [u8]) {
    debug_assert_eq!(dst.len(), converted_len(from, to, src.len()));
    if from == to {
        dst.copy_from_slice(src);
        return;
    }
    widened!(from, src, |values| store(to, values, dst))
}

fn store(to: Dtype, values: impl Iterator<Item = f32>, dst: &mut [u8]) {
    match to {
        Dtype::F32 => values.zip(dst.chunks_exact_mut(4)).for_each(|(v, d)| d.copy_from_slice(&v.to_le_bytes())),
        Dtype::F16 => values
            .zip(dst.chunks_exact_mut(2))
            .for_each(|(v, d)| d.copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes())),
        Dtype::Bf16 => values
            .zip(dst.chunks_exact_mut(2))
            .for_each(|(v, d)| d.copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widening_is_exact_and_narrowing_rounds() {
        let x = bf16::from_f32(1.5).to_bits().to_le_bytes();
        let mut out = [0u8; 4];
        convert(Dtype::Bf16, &x, Dtype::F32, &mut out);
        assert_eq!(f32::from_le_bytes(out), 1.5);
        let mut back = [0u8; 2];
        convert(Dtype::F32, &(1.0f32 + 1.0 / 512.0).to_le_bytes(), Dtype::Bf16, &mut back);
        assert_eq!(bf16::from_bits(u16::from_le_bytes(back)).to_f32(), 1.0, "ties to even");
        assert!(convertible(Dtype::F16, Dtype::F32, false));
        assert!(!convertible(Dtype::F32, Dtype::Bf16, false));
        assert!(convertible(Dtype::F32, Dtype::Bf16, true));
    }
}
