//! GGML tensor types and their dequantization to f32.
//!
//! Block layouts follow ggml's reference implementation (`ggml-quants.c`); unit tests check each against
//! vectors produced by the `gguf` Python package (`fixtures/reference/dequant_vectors.json`).

use half::{bf16, f16};

/// A GGML tensor element type this crate can read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 32 weights: f16 scale, 32 x i8.
    Q8_0,
    /// 32 weights: f16 scale, 32 x 4 bits, offset -8.
    Q4_0,
    /// 32 weights: f16 scale and min, 32 x 4 bits.
    Q4_1,
    /// 32 weights: f16 scale, 32 x 5 bits, offset -16.
    Q5_0,
    /// 32 weights: f16 scale and min, 32 x 5 bits.
    Q5_1,
    /// 256 weights in 8 sub-blocks of 32 with 6-bit scales and mins, 4-bit weights.
    Q4K,
    /// As Q4_K with a fifth bit per weight.
    Q5K,
    /// 256 weights in 16 sub-blocks of 16 with 8-bit scales, 6-bit weights.
    Q6K,
}

impl GgmlType {
    /// From ggml's type id; `None` for types this crate does not read.
    pub const fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::Bf16,
            _ => return None,
        })
    }

    /// ggml's name.
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Bf16 => "BF16",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
        }
    }

    /// Weights per block.
    pub const fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => 1,
            GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => 32,
            GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::Bf16 => 2,
            GgmlType::Q8_0 => 34,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
        }
    }

    /// Bytes for `elems` weights, or `None` if `elems` is not a whole number of blocks.
    pub fn bytes_for(self, elems: u64) -> Option<u64> {
        let be = self.block_elems() as u64;
        elems.is_multiple_of(be).then(|| elems / be).and_then(|blocks| blocks.checked_mul(self.block_bytes() as u64))
    }
}

#[inline(always)]
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Dequantizes `src` (whole blocks of `ty`) into `dst`, which holds exactly the blocks' weights.
///
/// Panics if the lengths disagree; callers size both from the tensor's validated shape.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2::supports(ty) && avx2::available() {
        let (be, bb) = (ty.block_elems(), ty.block_bytes());
        assert_eq!(src.len() % bb, 0);
        assert_eq!(
            src.len() / bb * be,
            dst.len(),
            "{} source of {} bytes for {} weights",
            ty.name(),
            src.len(),
            dst.len()
        );
        // SAFETY: AVX2, FMA and F16C are present (checked just above); the lengths are whole, matching
        // blocks.
        return unsafe { avx2::dequantize(ty, src, dst) };
    }
    dequantize_blocks(ty, src, dst)
}

/// The portable dequantizer: the definition of every value.
pub(crate) fn dequantize_blocks(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    let (be, bb) = (ty.block_elems(), ty.block_bytes());
    assert_eq!(src.len() / bb * be, dst.len(), "{} source of {} bytes for {} weights", ty.name(), src.len(), dst.len());
    assert_eq!(src.len() % bb, 0);
    for (b, y) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(be)) {
        match ty {
            GgmlType::F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            GgmlType::F16 => y[0] = f16_at(b, 0),
            GgmlType::Bf16 => y[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
            GgmlType::Q8_0 => {
                let d = f16_at(b, 0);
                for (y, &q) in y.iter_mut().zip(&b[2..34]) {
                    *y = d * f32::from(q as i8);
                }
            }
            GgmlType::Q4_0 => {
                let d = f16_at(b, 0);
                for j in 0..16 {
                    y[j] = d * (f32::from(b[2 + j] & 0xF) - 8.0);
                    y[j + 16] = d * (f32::from(b[2 + j] >> 4) - 8.0);
                }
            }
            GgmlType::Q4_1 => {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                for j in 0..16 {
                    y[j] = d * f32::from(b[4 + j] & 0xF) + m;
                    y[j + 16] = d * f32::from(b[4 + j] >> 4) + m;
                }
            }
            GgmlType::Q5_0 => {
                let d = f16_at(b, 0);
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                for j in 0..16 {
                    let h0 = ((qh >> j) << 4) & 0x10;
                    let h1 = (qh >> (j + 12)) & 0x10;
                    y[j] = d * ((u32::from(b[6 + j] & 0xF) | h0) as f32 - 16.0);
                    y[j + 16] = d * ((u32::from(b[6 + j] >> 4) | h1) as f32 - 16.0);
                }
            }
            GgmlType::Q5_1 => {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
                for j in 0..16 {
                    let h0 = ((qh >> j) << 4) & 0x10;
                    let h1 = (qh >> (j + 12)) & 0x10;
                    y[j] = d * (u32::from(b[8 + j] & 0xF) | h0) as f32 + m;
                    y[j + 16] = d * (u32::from(b[8 + j] >> 4) | h1) as f32 + m;
                }
            }
            GgmlType::Q4K => {
                let qs = &b[16..144];
                for j in 0..4 {
                    let [(d1, min1), (d2, min2)] = k_scales(b, j);
                    let q = &qs[32 * j..32 * j + 32];
                    for l in 0..32 {
                        y[64 * j + l] = d1 * f32::from(q[l] & 0xF) - min1;
                        y[64 * j + 32 + l] = d2 * f32::from(q[l] >> 4) - min2;
                    }
                }
            }
            GgmlType::Q5K => {
                let qh = &b[16..48];
                let qs = &b[48..176];
                for j in 0..4 {
                    let [(d1, min1), (d2, min2)] = k_scales(b, j);
                    let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
                    let q = &qs[32 * j..32 * j + 32];
                    for l in 0..32 {
                        let h1 = if qh[l] & u1 != 0 { 16.0 } else { 0.0 };
                        let h2 = if qh[l] & u2 != 0 { 16.0 } else { 0.0 };
                        y[64 * j + l] = d1 * (f32::from(q[l] & 0xF) + h1) - min1;
                        y[64 * j + 32 + l] = d2 * (f32::from(q[l] >> 4) + h2) - min2;
                    }
                }
            }
            GgmlType::Q6K => {
                let ql = &b[0..128];
                let qh = &b[128..192];
                let sc = &b[192..208];
                let d = f16_at(b, 208);
                for n in 0..2 {
                    let (ql, qh, sc, y) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..], &mut y[128 * n..]);
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        y[l] = d * f32::from(sc[is] as i8) * q1 as f32;
                        y[l + 32] = d * f32::from(sc[is + 2] as i8) * q2 as f32;
                        y[l + 64] = d * f32::from(sc[is + 4] as i8) * q3 as f32;
                        y[l + 96] = d * f32::from(sc[is + 6] as i8) * q4 as f32;
                    }
                }
            }
        }
    }
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K/Q5_K block.
#[inline(always)]
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    let (d, m) = scale_min_k4_int(j, q);
    (f32::from(d), f32::from(m))
}

/// [`scale_min_k4`] as the integers they are.
#[inline(always)]
pub(crate) fn scale_min_k4_int(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// The float scales and minimums `(d * sc, dmin * m)` of sub-blocks `2j` and `2j + 1` of a Q4_K or Q5_K
/// block `b`: what every dequantizer multiplies and subtracts.
#[inline(always)]
pub(crate) fn k_scales(b: &[u8], j: usize) -> [(f32, f32); 2] {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    [2 * j, 2 * j + 1].map(|sub| {
        let (sc, m) = scale_min_k4(sub, &b[4..16]);
        (d * sc, dmin * m)
    })
}

/// Runs `$body` with `$t` a `const u32`, the GGML type id of `$ty`, one of the integer block types
/// (`avx2::supports`): the kernels are generic over the id, one instance per type, so each unpacks its
/// blocks without a branch on the type.
macro_rules! by_block_type {
    ($ty:expr, $t:ident => $body:expr) => {
        match $ty {
            $crate::quant::GgmlType::Q8_0 => {
                const $t: u32 = 8;
                $body
            }
            $crate::quant::GgmlType::Q4_0 => {
                const $t: u32 = 2;
                $body
            }
            $crate::quant::GgmlType::Q4_1 => {
                const $t: u32 = 3;
                $body
            }
            $crate::quant::GgmlType::Q5_0 => {
                const $t: u32 = 6;
                $body
            }
            $crate::quant::GgmlType::Q5_1 => {
                const $t: u32 = 7;
                $body
            }
            $crate::quant::GgmlType::Q4K => {
                const $t: u32 = 12;
                $body
            }
            $crate::quant::GgmlType::Q5K => {
                const $t: u32 = 13;
                $body
            }
            $crate::quant::GgmlType::Q6K => {
                const $t: u32 = 14;
                $body
            }
            _ => unreachable!("supports() was checked"),
        }
    };
}
pub(crate) use by_block_type;

/// How far ahead of the weight bytes a row kernel reads it asks the CPU to fetch them
/// ([`prefetch`]).
pub(crate) const PREFETCH_AHEAD: usize = 8192;

/// Asks the CPU to bring the cache lines of `len` bytes at `at + PREFETCH_AHEAD` bytes past `base` toward
/// L1. A decode step streams every weight from memory once, and a row kernel spends enough instructions
/// on each block that the hardware prefetcher alone leaves the stream at a third of the core's read
/// bandwidth: Gemma 3's 178 MB Q8_0 head took 29 ms to dequantize and multiply-add one row against,
/// 9 ms with lines asked for 1.3-4 KiB ahead, as fast as from L2 (a standalone copy of the kernel's loop
/// on the Zen 4 of 2026-12-02; in the kernels, 2 KiB did as well as 4 or better). On the Zen 5 of
/// 2026-12-03 the leaner kernels stream faster and want it farther ahead: the head for one row through
/// the Q8_0 quad kernel took 7.2-9.2 ms with 2 KiB, 6.8-7.8 with 4, 5.3-6.4 with 8 and 6.6-7.4 with 16
/// (a bare read of the same bytes: 5.0-5.8 ms; with no prefetch, 22 ms), and through `exact`'s kernel
/// 7.2-8.7 ms with 2 KiB and 5.6-7.7 with 8; products small enough for L2 did not move. Row kernels
/// call it with where they are in the stream of the rows they read in order, and how many bytes they
/// read per step. It changes no result.
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // only the x86-64 row kernels stream blocks
pub(crate) fn prefetch(base: *const u8, at: usize, len: usize) {
    prefetch_lines(base.wrapping_add(at + PREFETCH_AHEAD), len, Toward::L1);
}

/// Which cache a prefetch brings its lines to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Toward {
    /// L1 (`prefetcht0`): the weight streams of the row kernels ([`prefetch`]), which read each line
    /// once, soon. To L2 only, Gemma 3's `exact` pass of one row took 22.9 ms against 18.0-18.3 (`bench
    /// kernels --threads 1`, Zen 4, alternating builds).
    L1,
    /// L2 (`prefetcht1`): attention's K/V rows, asked for many rows ahead (`dot::ROWS_AHEAD`: 32 of
    /// Gemma 3's 1 KiB rows are L1 whole, so into L1 they likely evicted lines not yet read).
    /// Four sequences' scores and weighted sums at 330 positions (Gemma 3's shape, f32 rows from
    /// memory, one thread) took 5.9-6.0 ms asking for L1 and 3.5-3.7 ms asking for L2; a read of every
    /// line alone, 3.0-3.6 ms. And the interleaved `fast` kernels' weights (`AHEAD` in
    /// `kernels::native::interleaved`).
    L2,
}

/// Asks the CPU to bring the cache lines of the `len` bytes at `p` toward `to`: weights a fixed distance
/// ahead ([`prefetch`]), or rows read in an order the hardware cannot guess, such as attention's K/V
/// rows, one head's slice of each token's row in pages of the cache.
#[inline(always)]
pub(crate) fn prefetch_lines(p: *const u8, len: usize, to: Toward) {
    // A plain loop: `(0..len).step_by(64)` was 9% of a decode step of four SmolLM2 sequences, in the
    // attention kernels that ask for every K/V row (6% in the weighted sums, 3% in the scores).
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        let mut off = 0;
        while off < len {
            let line = p.wrapping_add(off).cast();
            // SAFETY: a prefetch is a hint: it reads nothing into the program and never faults, whatever
            // the address (formed with wrapping arithmetic, which claims nothing about bounds).
            unsafe {
                match to {
                    Toward::L1 => _mm_prefetch::<_MM_HINT_T0>(line),
                    Toward::L2 => _mm_prefetch::<_MM_HINT_T1>(line),
                }
            };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len, to);
}

/// Weights and bytes per block of the type with GGML id `T`, as constants of each instance.
#[cfg(target_arch = "x86_64")]
const fn geometry<const T: u32>() -> (usize, usize) {
    match GgmlType::from_id(T) {
        Some(ty) => (ty.block_elems(), ty.block_bytes()),
        None => panic!("a GGML type id"),
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;

#[cfg(test)]
mod tests;
