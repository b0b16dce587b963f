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
    prefetch_lines(base.wrapping_add(at + PREFETCH_AHEAD), len);
}

/// Asks the CPU to bring the cache lines of the `len` bytes at `p` toward L1 (see [`prefetch`]): for
/// rows read in an order the hardware cannot guess, such as attention's K/V rows, one head's slice of
/// each token's row in pages of the cache.
#[inline(always)]
pub(crate) fn prefetch_lines(p: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for off in (0..len).step_by(64) {
        // SAFETY: a prefetch is a hint: it reads nothing into the program and never faults, whatever the
        // address (formed with wrapping arithmetic, which claims nothing about bounds).
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.wrapping_add(off).cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len);
}

/// Weights and bytes per block of the type with GGML id `T`, as constants of each instance.
#[cfg(target_arch = "x86_64")]
const fn geometry<const T: u32>() -> (usize, usize) {
    match GgmlType::from_id(T) {
        Some(ty) => (ty.block_elems(), ty.block_bytes()),
        None => panic!("a GGML type id"),
    }
}

/// AVX2 twins of the portable dequantizer for the block types, value for value the same: every value is
/// the same operations on the same operands (a product and a sum are never fused), eight at a time. Each
/// block hands its vectors, in increasing position, to a consumer: a store ([`dequantize`]) or the
/// multiply-adds of a dot product ([`dot_rows`]), which then never round-trips the weights through memory.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::GgmlType;

    /// Whether [`dequantize`] and [`dot_rows`] handle `ty`.
    pub(crate) fn supports(ty: GgmlType) -> bool {
        matches!(
            ty,
            GgmlType::Q8_0
                | GgmlType::Q4_0
                | GgmlType::Q4_1
                | GgmlType::Q5_0
                | GgmlType::Q5_1
                | GgmlType::Q4K
                | GgmlType::Q5K
                | GgmlType::Q6K
        )
    }

    /// Whether this CPU runs them (AVX2, FMA and F16C).
    pub(crate) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }

    /// Dequantizes whole blocks of a supported `ty`.
    ///
    /// # Safety
    ///
    /// [`available`], `src` is whole blocks and `dst` holds exactly their values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
        let (be, bb) = (ty.block_elems(), ty.block_bytes());
        for (b, y) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(be)) {
            block(ty, b, &mut |at, v| {
                assert!(at + 8 <= y.len());
                // SAFETY: in bounds (asserted); unaligned store.
                unsafe { _mm256_storeu_ps(y.as_mut_ptr().add(at), v) }
            });
        }
    }

    /// `x[r] . w` for each weight row `w` of `ty` blocks (`n` values, whole blocks) in `ws`, one row per
    /// element of `out`, as the f32 kernel (`kernels::dot`) computes it over the dequantized row: lane `l`
    /// of accumulator `v` takes, with fused multiply-adds in increasing position, the products at
    /// positions `k` with `k mod 16 == 8v + l`, and the lanes are then summed in its fixed order.
    ///
    /// One instance per block type (as the AVX-512 twin), whose `H` weight rows are read side by side,
    /// block by block: each output is two chains of multiply-adds, and `H * R` outputs in flight hide
    /// their latency. The callers pass `H = 4 / R` (at least 1): `2 * H * R` accumulators of the 16
    /// vector registers. One instance for every type, matching it at every block and reading one
    /// weight row at a time, took 33 ms for Gemma 3's head and one activation row; this takes 14-15 ms,
    /// the pace of its 178 MB from memory (Zen 3; on a streamed Q8_0 matrix, `H` = 4 alone was 10%
    /// faster than 1, and made no difference on matrices that fit in cache).
    ///
    /// # Safety
    ///
    /// [`available`], `ty` is [`supports`]ed, `ws` holds `out.len()` rows of whole blocks, and every `x[r]`
    /// holds at least `n` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot_rows<const R: usize, const H: usize>(
        ty: GgmlType,
        x: [&[f32]; R],
        ws: &[u8],
        n: usize,
        out: &mut [[f32; R]],
    ) {
        super::by_block_type!(ty, T => rows_of::<R, T, H>(x, ws, n, out))
    }

    /// [`dot_rows`] for the type with GGML id `T`: groups of `H` weight rows, then the rest one at a time.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn rows_of<const R: usize, const T: u32, const H: usize>(
        x: [&[f32]; R],
        ws: &[u8],
        n: usize,
        out: &mut [[f32; R]],
    ) {
        let (be, bb) = super::geometry::<T>();
        let row_bytes = n / be * bb;
        assert!(
            n.is_multiple_of(be) && ws.len() >= out.len() * row_bytes && x.iter().all(|x| x.len() >= n),
            "dot_rows operands"
        );
        let (whole, rest) = out.split_at_mut(out.len() / H * H);
        for (g, out) in whole.chunks_exact_mut(H).enumerate() {
            group::<R, T, H>(x, ws, g * H, n, out);
        }
        for (j, out) in rest.chunks_exact_mut(1).enumerate() {
            group::<R, T, 1>(x, ws, whole.len() + j, n, out);
        }
    }

    /// The `H` weight rows from row `j` of `ws`, into `out` (`H` rows).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn group<const R: usize, const T: u32, const H: usize>(
        x: [&[f32]; R],
        ws: &[u8],
        j: usize,
        n: usize,
        out: &mut [[f32; R]],
    ) {
        let ty = GgmlType::from_id(T).expect("a GGML type id");
        let (be, bb) = super::geometry::<T>();
        let row_bytes = n / be * bb;
        assert!(out.len() == H && ws.len() >= (j + H) * row_bytes && x.iter().all(|x| x.len() >= n), "group operands");
        let rows = ws[j * row_bytes..].as_ptr();
        let xs: [*const f32; R] = std::array::from_fn(|r| x[r].as_ptr());
        let mut acc = [[[_mm256_setzero_ps(); 2]; R]; H];
        for i in 0..n / be {
            let base = i * be;
            // The rows are read side by side: in the stream of rows, a step is every row's block.
            super::prefetch(ws.as_ptr(), j * row_bytes + i * H * bb, H * bb);
            for (h, acc) in acc.iter_mut().enumerate() {
                // SAFETY: block `i` of row `j + h` lies in `ws` (asserted), and `bb` is its length.
                let b = unsafe { std::slice::from_raw_parts(rows.add(h * row_bytes + i * bb), bb) };
                block(ty, b, &mut |at, wv| {
                    // Blocks are whole 16s, so the accumulator is fixed at each call site (a constant
                    // index keeps the accumulators in registers).
                    let v = usize::from(at % 16 == 8);
                    for r in 0..R {
                        // SAFETY: base + at + 8 <= n <= x[r].len() (asserted); unaligned load.
                        let xv = unsafe { _mm256_loadu_ps(xs[r].add(base + at)) };
                        acc[r][v] = _mm256_fmadd_ps(xv, wv, acc[r][v]);
                    }
                });
            }
        }
        for (sums, acc) in out.iter_mut().zip(&acc) {
            for r in 0..R {
                sums[r] = reduce(acc[r]);
            }
        }
    }

    /// [`crate::kernels::dot::reduce`] in registers: the two accumulators added lane by lane, then the
    /// high half onto the low, then pairs, the same sums in the same order (so the same bits). Through
    /// memory and the scalar order, LLVM transposed four rows' lanes: about 80 instructions per group of
    /// Gemma 3's head rows, against 320 for their 80 chunks.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn reduce(acc: [__m256; 2]) -> f32 {
        let s = _mm256_add_ps(acc[0], acc[1]);
        // Lanes l + (l + 4): s0 + s4, s1 + s5, s2 + s6, s3 + s7.
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
        // (s0 + s4) + (s2 + s6), (s1 + s5) + (s3 + s7).
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)))
    }

    /// One block of a supported `ty`, eight values at a time, in increasing position.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn block(ty: GgmlType, b: &[u8], put: &mut impl FnMut(usize, __m256)) {
        match ty {
            GgmlType::Q8_0 => q8_0(b, put),
            GgmlType::Q4_0 => q4(b, put, 2, None),
            GgmlType::Q4_1 => q4(b, put, 4, Some(f16_at(b, 2))),
            GgmlType::Q5_0 => q5(b, put, 6, None),
            GgmlType::Q5_1 => q5(b, put, 8, Some(f16_at(b, 2))),
            GgmlType::Q4K => q4_k(b, put, false),
            GgmlType::Q5K => q4_k(b, put, true),
            GgmlType::Q6K => q6_k(b, put),
            _ => unreachable!("supports() was checked"),
        }
    }

    /// The f16 at `b[at..at + 2]`, widened by the CPU (exact, as every f16 is an f32).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
        let bits = u32::from(u16::from_le_bytes([b[at], b[at + 1]]));
        let value: __m128;
        // Written out because the intrinsics' form, `_mm_cvtph_ps(_mm_cvtsi32_si128(..))`, is compiled
        // to a `vpinsrw` into whatever register is free, keeping its other lanes: the conversion then
        // waits on that register's last writer, often the previous block's arithmetic, and a kernel's
        // blocks run one after another instead of side by side (see `avx512::f16_splat` for what that
        // chain cost). `vmovd` from a general register writes the whole register.
        // SAFETY: F16C is enabled in every caller (this function's target features); the instructions
        // touch only the two named registers.
        unsafe {
            std::arch::asm!(
                "vmovd {v}, {bits:e}",
                "vcvtph2ps {v}, {v}",
                bits = in(reg) bits,
                v = out(xmm_reg) value,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        _mm_cvtss_f32(value)
    }

    /// 8 unsigned bytes of `v` (its low half, or with `high` its high half), as 32-bit lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn u8x8(v: __m128i, high: bool) -> __m256i {
        _mm256_cvtepu8_epi32(if high { _mm_srli_si128::<8>(v) } else { v })
    }

    /// `y = d * q`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn q8_0(b: &[u8], put: &mut impl FnMut(usize, __m256)) {
        assert!(b.len() >= 34);
        let d = _mm256_set1_ps(f16_at(b, 0));
        for i in 0..4 {
            // SAFETY: bytes 2 + 8i .. 10 + 8i lie in the block (asserted).
            let q = unsafe { _mm_loadl_epi64(b.as_ptr().add(2 + 8 * i).cast()) };
            put(8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
        }
    }

    /// Q4_0 (`y = d * (q - 8)`) and Q4_1 (`y = d * q + m`): 16 bytes of nibbles from byte `at`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn q4(b: &[u8], put: &mut impl FnMut(usize, __m256), at: usize, m: Option<f32>) {
        assert!(b.len() >= at + 16);
        // SAFETY: 16 bytes from `at` lie in the block (asserted).
        let qs = unsafe { _mm_loadu_si128(b.as_ptr().add(at).cast()) };
        let mask = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(qs, mask);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), mask);
        small_values(b, put, [lo, hi], m, 8);
    }

    /// Q5_0 (`y = d * (q - 16)`) and Q5_1 (`y = d * q + m`): the fifth bits in the 32-bit word at
    /// `at - 4`, nibbles from `at`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn q5(b: &[u8], put: &mut impl FnMut(usize, __m256), at: usize, m: Option<f32>) {
        assert!(b.len() >= at + 16);
        let qh = u32::from_le_bytes([b[at - 4], b[at - 3], b[at - 2], b[at - 1]]);
        // SAFETY: 16 bytes from `at` lie in the block (asserted).
        let qs = unsafe { _mm_loadu_si128(b.as_ptr().add(at).cast()) };
        let mask = _mm_set1_epi8(0x0F);
        let lo = _mm_or_si128(_mm_and_si128(qs, mask), sixteens(qh as u16));
        let hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16::<4>(qs), mask), sixteens((qh >> 16) as u16));
        small_values(b, put, [lo, hi], m, 16);
    }

    /// The 32 values of a Q4_0, Q4_1, Q5_0 or Q5_1 block (scale `d` at byte 0), given as unsigned bytes
    /// `q` (values 0..16, then 16..32): `d * (q - zero)` without an offset `m`, else `d * q + m`. The
    /// bytes are made signed (`q - zero`) 16 at a time, then widened 8 at a time: the same floats as
    /// `float(q) - zero`, as every operand is a small integer.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn small_values(b: &[u8], put: &mut impl FnMut(usize, __m256), q: [__m128i; 2], m: Option<f32>, zero: i8) {
        let d = _mm256_set1_ps(f16_at(b, 0));
        for (half, v) in [(0, q[0]), (16, q[1])] {
            let v = if m.is_none() { _mm_sub_epi8(v, _mm_set1_epi8(zero)) } else { v };
            for (i, v) in [(0, v), (8, _mm_srli_si128::<8>(v))] {
                let value = match m {
                    None => _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))),
                    Some(m) => {
                        _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))), _mm256_set1_ps(m))
                    }
                };
                put(half + i, value);
            }
        }
    }

    /// Byte `k` (of 16) is 16 where bit `k` of `bits` is set, else 0.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn sixteens(bits: u16) -> __m128i {
        let spread = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        let bytes = _mm_shuffle_epi8(_mm_cvtsi32_si128(i32::from(bits)), spread);
        let bit = _mm_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
        _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(bytes, bit), bit), _mm_set1_epi8(16))
    }

    /// Q4_K (`y = d * sc * q - dmin * m` per 32-value sub-block) and Q5_K (the same with a fifth bit).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn q4_k(b: &[u8], put: &mut impl FnMut(usize, __m256), five: bool) {
        assert!(b.len() >= if five { 176 } else { 144 });
        let (qh, qs) = if five { (&b[16..48], &b[48..176]) } else { (&b[0..0], &b[16..144]) };
        let mask = _mm_set1_epi8(0x0F);
        // `super::k_scales`'s products, with the block's two f16s widened once by the CPU (the portable
        // widening, eight times a block, made Q4_K the slowest type by half).
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let scales = |sub: usize| {
            let (sc, m) = super::scale_min_k4_int(sub, &b[4..16]);
            (d * f32::from(sc), dmin * f32::from(m))
        };
        for j in 0..4 {
            let [(d1, min1), (d2, min2)] = [scales(2 * j), scales(2 * j + 1)];
            // SAFETY: the sub-block's 32 bytes, inside the block (asserted).
            let q = unsafe {
                [_mm_loadu_si128(qs.as_ptr().add(32 * j).cast()), _mm_loadu_si128(qs.as_ptr().add(32 * j + 16).cast())]
            };
            // The low nibbles are values 64j .. 64j + 32, the high ones the next 32.
            for (sub, dd, mm, bit) in [(0, d1, min1, 2 * j), (32, d2, min2, 2 * j + 1)] {
                for (part, q) in q.iter().enumerate() {
                    let v =
                        if sub == 0 { _mm_and_si128(*q, mask) } else { _mm_and_si128(_mm_srli_epi16::<4>(*q), mask) };
                    for (at, high) in [(0, false), (8, true)] {
                        let mut n = u8x8(v, high);
                        let l0 = 16 * part + at;
                        if five {
                            // SAFETY: 8 of the 32 high-bit bytes (asserted block length).
                            let h = _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(qh.as_ptr().add(l0).cast()) });
                            let set = _mm256_and_si256(
                                _mm256_srlv_epi32(h, _mm256_set1_epi32(bit as i32)),
                                _mm256_set1_epi32(1),
                            );
                            n = _mm256_add_epi32(n, _mm256_slli_epi32::<4>(set));
                        }
                        let value =
                            _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(n)), _mm256_set1_ps(mm));
                        put(64 * j + sub + l0, value);
                    }
                }
            }
        }
    }

    /// The 6-bit values (0..64, before the offset of -32) of half `n` of a Q6_K block, as four vectors
    /// of 32 bytes: vector `k` holds values `128n + 32k .. 128n + 32k + 32`, in position order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn q6_k_values(b: &[u8], n: usize) -> [__m256i; 4] {
        assert!(b.len() >= 192 && n < 2);
        let m4 = _mm256_set1_epi8(0x0F);
        let m2 = _mm256_set1_epi8(0x03);
        // SAFETY: the low bits at 64n..64n + 64 and the high bits at 128 + 32n..160 + 32n lie in the block
        // (asserted).
        let (la, lb, h) = unsafe {
            (
                _mm256_loadu_si256(b.as_ptr().add(64 * n).cast()),
                _mm256_loadu_si256(b.as_ptr().add(64 * n + 32).cast()),
                _mm256_loadu_si256(b.as_ptr().add(128 + 32 * n).cast()),
            )
        };
        let high = [
            _mm256_and_si256(h, m2),
            _mm256_and_si256(_mm256_srli_epi16::<2>(h), m2),
            _mm256_and_si256(_mm256_srli_epi16::<4>(h), m2),
            _mm256_and_si256(_mm256_srli_epi16::<6>(h), m2),
        ];
        [
            _mm256_or_si256(_mm256_and_si256(la, m4), _mm256_slli_epi16::<4>(high[0])),
            _mm256_or_si256(_mm256_and_si256(lb, m4), _mm256_slli_epi16::<4>(high[1])),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(la), m4), _mm256_slli_epi16::<4>(high[2])),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(lb), m4), _mm256_slli_epi16::<4>(high[3])),
        ]
    }

    /// Q6_K: `y = (d * sc) * (q - 32)` per 16-value group.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn q6_k(b: &[u8], put: &mut impl FnMut(usize, __m256)) {
        assert!(b.len() >= 210);
        let d = f16_at(b, 208);
        let sc = &b[192..208];
        for n in 0..2 {
            let qs = q6_k_values(b, n);
            for (k, q) in qs.into_iter().enumerate() {
                let halves = [_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q)];
                for g in 0..4 {
                    let n32 = _mm256_sub_epi32(u8x8(halves[g / 2], g % 2 == 1), _mm256_set1_epi32(32));
                    let scale = d * f32::from(sc[8 * n + g / 2 + 2 * k] as i8);
                    put(128 * n + 32 * k + 8 * g, _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(n32)));
                }
            }
        }
    }
}

/// AVX-512 twins of [`avx2::dot_rows`]: each block is dequantized 16 values at a time, every value by the
/// same operations on the same operands as the portable dequantizer, and each 16 feed one vector of
/// multiply-adds whose lane `l` is lane `l % 8` of the AVX2 kernel's accumulator `l / 8`: the same bits.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    use super::avx2::f16_at;
    use super::GgmlType;

    /// Whether this CPU runs [`dot_rows`] (AVX-512F besides AVX2, FMA and F16C).
    pub(crate) fn available() -> bool {
        super::avx2::available() && std::arch::is_x86_feature_detected!("avx512f")
    }

    /// [`super::avx2::dot_rows`] with AVX-512: the same lanes, summed in the same order.
    ///
    /// # Safety
    ///
    /// [`available`], `ty` is [`super::avx2::supports`]ed, `ws` holds `out.len()` rows of whole blocks,
    /// and every `x[r]` holds at least `n` values.
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    pub(crate) unsafe fn dot_rows<const R: usize>(
        ty: GgmlType,
        x: [&[f32]; R],
        ws: &[u8],
        n: usize,
        out: &mut [[f32; R]],
    ) {
        super::by_block_type!(ty, T => rows_of::<R, T>(x, ws, n, out))
    }

    /// [`dot_rows`] for the type with GGML id `T`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    fn rows_of<const R: usize, const T: u32>(x: [&[f32]; R], ws: &[u8], n: usize, out: &mut [[f32; R]]) {
        let ty = GgmlType::from_id(T).expect("a GGML type id");
        let (be, bb) = (ty.block_elems(), ty.block_bytes());
        let row_bytes = n / be * bb;
        assert!(
            n.is_multiple_of(be) && ws.len() >= out.len() * row_bytes && x.iter().all(|x| x.len() >= n),
            "dot_rows operands"
        );
        // Four weight rows at a time, block by block: each output is one chain of multiply-adds (one per
        // lane), and the chains of four rows in flight hide their latency. With two, one activation row
        // took Gemma's head (178 MB of Q8_0) in 13.3 ms, with four in 9.4-10 ms, and two rows 13 against
        // 16-17 ms (Zen 5); eight were slower than two (18-21 ms).
        let rows = out.len().min(ws.len() / row_bytes.max(1));
        groups::<R, T, 4>(x, ws, n, &mut out[..rows]);
    }

    /// [`rows_of`] by groups of `H` weight rows, then the rest one at a time.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    fn groups<const R: usize, const T: u32, const H: usize>(x: [&[f32]; R], ws: &[u8], n: usize, out: &mut [[f32; R]]) {
        let (whole, rest) = out.split_at_mut(out.len() / H * H);
        for (g, out) in whole.chunks_exact_mut(H).enumerate() {
            group::<R, T, H>(x, ws, g * H, n, out);
        }
        for (j, out) in rest.chunks_exact_mut(1).enumerate() {
            group::<R, T, 1>(x, ws, whole.len() + j, n, out);
        }
    }

    /// The `H` weight rows from row `j` of `ws`, into `out` (`H` rows).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    fn group<const R: usize, const T: u32, const H: usize>(
        x: [&[f32]; R],
        ws: &[u8],
        j: usize,
        n: usize,
        out: &mut [[f32; R]],
    ) {
        const { assert!(H * R <= 16, "a group's outputs are summed in one reduce16") };
        let (be, bb) = super::geometry::<T>();
        let row_bytes = n / be * bb;
        assert!(out.len() == H && ws.len() >= (j + H) * row_bytes && x.iter().all(|x| x.len() >= n), "group operands");
        let rows = ws[j * row_bytes..].as_ptr();
        let xs: [*const f32; R] = std::array::from_fn(|r| x[r].as_ptr());
        let mut acc = [[_mm512_setzero_ps(); R]; H];
        for i in 0..n / be {
            let base = i * be;
            // The rows are read side by side: in the stream of rows, a step is every row's block.
            super::prefetch(ws.as_ptr(), j * row_bytes + i * H * bb, H * bb);
            for (h, acc) in acc.iter_mut().enumerate() {
                // SAFETY: block `i` of row `j + h` lies in `ws` (asserted), and `bb` is its length.
                let b = unsafe { std::slice::from_raw_parts(rows.add(h * row_bytes + i * bb), bb) };
                block::<T>(b, &mut |at, wv| {
                    for r in 0..R {
                        // SAFETY: base + at + 16 <= n <= x[r].len() (asserted); unaligned load.
                        let xv = unsafe { _mm512_loadu_ps(xs[r].add(base + at)) };
                        acc[r] = _mm512_fmadd_ps(xv, wv, acc[r]);
                    }
                });
            }
        }
        // Lane `l` of an accumulator is lane `l % 8` of the AVX2 kernel's accumulator `l / 8`, so
        // `reduce16` sums each in the f32 kernel's order, all of the group's outputs at once.
        let mut v = [_mm512_setzero_ps(); 16];
        for (h, acc) in acc.iter().enumerate() {
            v[h * R..(h + 1) * R].copy_from_slice(acc);
        }
        // SAFETY: AVX-512F is enabled here.
        let sums = unsafe { crate::kernels::dot::reduce16(v) };
        for (h, out) in out.iter_mut().enumerate() {
            out.copy_from_slice(&sums[h * R..(h + 1) * R]);
        }
    }

    /// The f16 at `b[at..at + 2]` in all 16 lanes, widened by the CPU (exact, as every f16 is an f32).
    ///
    /// A broadcast load and one conversion, which write whole registers. The first form of this,
    /// `_mm512_set1_ps` of an intrinsics-written [`f16_at`], was compiled to a `vpinsrw` that kept the
    /// rest of whatever register was free, so each block's scale waited on the previous block's
    /// multiply: Gemma's `exact` head for four activation rows took 20.4 ms, and 14.4 ms without that
    /// chain (Zen 5).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    fn f16_splat(b: &[u8], at: usize) -> __m512 {
        let bits = u16::from_le_bytes([b[at], b[at + 1]]);
        _mm512_cvtph_ps(_mm256_set1_epi16(bits as i16))
    }

    /// One block of the type with GGML id `T`, 16 values at a time in increasing position.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    fn block<const T: u32>(b: &[u8], put: &mut impl FnMut(usize, __m512)) {
        match T {
            8 => {
                assert!(b.len() >= 34);
                let d = f16_splat(b, 0);
                for i in 0..2 {
                    // SAFETY: bytes 2 + 16i .. 18 + 16i lie in the block (asserted).
                    let q = unsafe { _mm_loadu_si128(b.as_ptr().add(2 + 16 * i).cast()) };
                    put(16 * i, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))));
                }
            }
            2 | 3 | 6 | 7 => {
                let five = matches!(T, 6 | 7);
                let at = match T {
                    2 => 2,
                    3 => 4,
                    6 => 6,
                    _ => 8,
                };
                assert!(b.len() >= at + 16);
                let d = f16_splat(b, 0);
                let m = if matches!(T, 3 | 7) { Some(f16_splat(b, 2)) } else { None };
                // SAFETY: 16 bytes from `at` lie in the block (asserted).
                let qs = unsafe { _mm_loadu_si128(b.as_ptr().add(at).cast()) };
                let mask = _mm_set1_epi8(0x0F);
                let halves = [_mm_and_si128(qs, mask), _mm_and_si128(_mm_srli_epi16::<4>(qs), mask)];
                let qh = if five { u32::from_le_bytes([b[at - 4], b[at - 3], b[at - 2], b[at - 1]]) } else { 0 };
                for (h, v) in halves.into_iter().enumerate() {
                    let mut q = _mm512_cvtepu8_epi32(v);
                    if five {
                        // Bit `16h + lane` of qh sets 16 in that lane: the 16 bits are a lane mask.
                        q = _mm512_mask_or_epi32(q, (qh >> (16 * h)) as __mmask16, q, _mm512_set1_epi32(16));
                    }
                    let q = _mm512_cvtepi32_ps(q);
                    let zero = _mm512_set1_ps(if five { 16.0 } else { 8.0 });
                    let value = match m {
                        None => _mm512_mul_ps(d, _mm512_sub_ps(q, zero)),
                        Some(m) => _mm512_add_ps(_mm512_mul_ps(d, q), m),
                    };
                    put(16 * h, value);
                }
            }
            12 | 13 => {
                let five = T == 13;
                assert!(b.len() >= if five { 176 } else { 144 });
                let (qh, qs) = if five { (&b[16..48], &b[48..176]) } else { (&b[0..0], &b[16..144]) };
                let mask = _mm_set1_epi8(0x0F);
                // `super::k_scales`'s products, with the block's two f16s widened once by the CPU.
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let scales = |sub: usize| {
                    let (sc, m) = super::scale_min_k4_int(sub, &b[4..16]);
                    (d * f32::from(sc), dmin * f32::from(m))
                };
                for j in 0..4 {
                    let [(d1, min1), (d2, min2)] = [scales(2 * j), scales(2 * j + 1)];
                    for (sub, dd, mm, bit) in [(0, d1, min1, 2 * j), (32, d2, min2, 2 * j + 1)] {
                        for part in 0..2 {
                            // SAFETY: 16 of the sub-block's 32 bytes, inside the block (asserted).
                            let q = unsafe { _mm_loadu_si128(qs.as_ptr().add(32 * j + 16 * part).cast()) };
                            let v = if sub == 0 {
                                _mm_and_si128(q, mask)
                            } else {
                                _mm_and_si128(_mm_srli_epi16::<4>(q), mask)
                            };
                            let mut n = _mm512_cvtepu8_epi32(v);
                            if five {
                                // SAFETY: 16 of the 32 high-bit bytes (asserted block length).
                                let h =
                                    _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(qh.as_ptr().add(16 * part).cast()) });
                                let set = _mm512_and_si512(
                                    _mm512_srlv_epi32(h, _mm512_set1_epi32(bit as i32)),
                                    _mm512_set1_epi32(1),
                                );
                                n = _mm512_add_epi32(n, _mm512_slli_epi32::<4>(set));
                            }
                            let value = _mm512_sub_ps(
                                _mm512_mul_ps(_mm512_set1_ps(dd), _mm512_cvtepi32_ps(n)),
                                _mm512_set1_ps(mm),
                            );
                            put(64 * j + sub + 16 * part, value);
                        }
                    }
                }
            }
            14 => {
                assert!(b.len() >= 210);
                let d = f16_at(b, 208);
                let sc = &b[192..208];
                for n in 0..2 {
                    let qs = super::avx2::q6_k_values(b, n);
                    for (k, q) in qs.into_iter().enumerate() {
                        let halves = [_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q)];
                        for (g, half) in halves.into_iter().enumerate() {
                            let n32 = _mm512_sub_epi32(_mm512_cvtepu8_epi32(half), _mm512_set1_epi32(32));
                            let scale = d * f32::from(sc[8 * n + g + 2 * k] as i8);
                            put(
                                128 * n + 32 * k + 16 * g,
                                _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(n32)),
                            );
                        }
                    }
                }
            }
            _ => unreachable!("a supported type"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference() -> serde_json::Value {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/reference/dequant_vectors.json");
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    fn floats(v: &serde_json::Value) -> Vec<f32> {
        v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
    }

    /// Every quantized tensor in the reference file: its first blocks dequantize to exactly the reference.
    #[test]
    fn first_blocks_match_the_gguf_reference_dequantizer() {
        let reference = reference();
        let mut types = std::collections::BTreeSet::new();
        for (name, v) in reference.as_object().unwrap() {
            let Some(id) = v.get("type_id") else { continue };
            let ty = GgmlType::from_id(id.as_u64().unwrap() as u32).unwrap();
            assert_eq!(ty.name(), v["ggml_type"].as_str().unwrap());
            assert_eq!(ty.block_bytes() as u64, v["block_bytes"].as_u64().unwrap());
            assert_eq!(ty.block_elems() as u64, v["block_elems"].as_u64().unwrap());
            let src = hex(v["first_blocks_hex"].as_str().unwrap());
            let want = floats(&v["first_blocks_dequant"]);
            let mut got = vec![0f32; want.len()];
            dequantize(ty, &src, &mut got);
            assert_eq!(got, want, "{name}");
            types.insert(ty.name());
        }
        assert_eq!(types.into_iter().collect::<Vec<_>>(), ["F32", "Q4_1", "Q4_K", "Q5_0", "Q6_K", "Q8_0"]);
    }

    #[test]
    fn f16_and_bf16_match_the_reference() {
        let reference = reference();
        for (key, ty) in [("synthetic::F16", GgmlType::F16), ("synthetic::BF16", GgmlType::Bf16)] {
            let v = &reference[key];
            let src = hex(v["hex"].as_str().unwrap());
            let want = floats(&v["values"]);
            let mut got = vec![0f32; want.len()];
            dequantize(ty, &src, &mut got);
            assert_eq!(got, want, "{key}");
        }
    }

    /// The AVX2 dequantizer gives every value of the portable one, bit for bit, on random blocks of every
    /// block type (scales random too: negative, tiny, large; never NaN or infinite).
    #[test]
    fn the_avx2_dequantizer_equals_the_portable_one_on_every_block_type() {
        let mut next = crate::testing::xorshift32(0x2545_F491);
        let types = [
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
            GgmlType::F16,
            GgmlType::Bf16,
        ];
        for ty in types {
            let blocks = 64;
            let mut src: Vec<u8> = (0..blocks * ty.block_bytes()).map(|_| next() as u8).collect();
            // Finite f16 scales wherever the type keeps them.
            let fields: &[usize] = match ty {
                GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => &[0],
                GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
                GgmlType::Q6K => &[208],
                _ => &[],
            };
            for b in src.chunks_exact_mut(ty.block_bytes()) {
                for &at in fields {
                    let v = f16::from_bits(next() as u16);
                    let v = if v.is_finite() { v } else { f16::from_f32(-0.75) };
                    b[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
                }
            }
            if ty == GgmlType::F16 || ty == GgmlType::Bf16 {
                for b in src.chunks_exact_mut(2) {
                    b[1] &= 0x3F; // small exponents: finite
                }
            }
            let n = blocks * ty.block_elems();
            let (mut portable, mut dispatched) = (vec![0f32; n], vec![0f32; n]);
            dequantize_blocks(ty, &src, &mut portable);
            dequantize(ty, &src, &mut dispatched);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&dispatched), bits(&portable), "{}", ty.name());
            #[cfg(target_arch = "x86_64")]
            if avx2::supports(ty) && avx2::available() {
                dot_rows_agree(ty, &src, &portable);
            }
        }
    }

    /// The AVX2 and AVX-512 row kernels give the f32 kernel's sums over the dequantized values: per lane,
    /// fused multiply-adds in increasing position, then the lanes in its fixed order.
    #[cfg(target_arch = "x86_64")]
    fn dot_rows_agree(ty: GgmlType, src: &[u8], values: &[f32]) {
        // Two weight rows of half the blocks each, repeated into six (a group of four, then two alone),
        // against three activation rows.
        let n = values.len() / 2;
        let order = [0, 1, 1, 0, 1, 0];
        let row_bytes = src.len() / 2;
        let ws: Vec<u8> = order.iter().flat_map(|&j| &src[j * row_bytes..(j + 1) * row_bytes]).copied().collect();
        let x: Vec<Vec<f32>> =
            (0..3).map(|r| (0..n).map(|i| ((i * 37 + r * 11) % 101) as f32 / 50.0 - 1.0).collect()).collect();
        let xs: [&[f32]; 3] = std::array::from_fn(|r| &x[r][..]);
        let want: Vec<[u32; 3]> = order
            .iter()
            .map(|&j| {
                std::array::from_fn(|r| {
                    let mut lanes = [[0f32; 8]; 2];
                    for k in 0..n {
                        let l = &mut lanes[(k % 16) / 8][k % 8];
                        *l = xs[r][k].mul_add(values[j * n + k], *l);
                    }
                    crate::kernels::dot::reduce(lanes).to_bits()
                })
            })
            .collect();
        let bits = |v: &[[f32; 3]]| v.iter().map(|s| s.map(f32::to_bits)).collect::<Vec<_>>();
        let mut got = [[0f32; 3]; 6];
        // SAFETY: AVX2, FMA and F16C (checked by the caller), a supported type, six rows of whole blocks.
        unsafe { avx2::dot_rows::<3, 1>(ty, xs, &ws, n, &mut got) };
        assert_eq!(bits(&got), want, "{} AVX2 rows one at a time", ty.name());
        let mut got = [[0f32; 3]; 6];
        // SAFETY: as above.
        unsafe { avx2::dot_rows::<3, 4>(ty, xs, &ws, n, &mut got) };
        assert_eq!(bits(&got), want, "{} AVX2 rows four side by side", ty.name());
        if avx512::available() {
            let mut got = [[0f32; 3]; 6];
            // SAFETY: as above, and AVX-512F (checked).
            unsafe { avx512::dot_rows::<3>(ty, xs, &ws, n, &mut got) };
            assert_eq!(bits(&got), want, "{} AVX-512 rows", ty.name());
        }
    }

    /// Types the reference file has no tensor of, checked against hand-computed blocks.
    #[test]
    fn q4_0_q5_1_and_q5_k_decode_hand_made_blocks() {
        // Q4_0: d = 0.5, nibbles j (low) and 15 - j (high).
        let mut b = f16::from_f32(0.5).to_bits().to_le_bytes().to_vec();
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut y = [0f32; 32];
        dequantize(GgmlType::Q4_0, &b, &mut y);
        for j in 0..16 {
            assert_eq!(y[j], 0.5 * (j as f32 - 8.0));
            assert_eq!(y[j + 16], 0.5 * (7.0 - j as f32));
        }
        // Q5_1: d = 2, m = -1, fifth bit set for weights 0 and 16 only.
        let mut b = f16::from_f32(2.0).to_bits().to_le_bytes().to_vec();
        b.extend(f16::from_f32(-1.0).to_bits().to_le_bytes());
        b.extend((1u32 | (1 << 16)).to_le_bytes());
        b.extend([0x21u8; 16]);
        let mut y = [0f32; 32];
        dequantize(GgmlType::Q5_1, &b, &mut y);
        assert_eq!((y[0], y[1], y[16], y[17]), (2.0 * 17.0 - 1.0, 2.0 - 1.0, 2.0 * 18.0 - 1.0, 4.0 - 1.0));
        // Q5_K: d = 1, dmin = 0, scales 1 for sub-blocks 0 and 1, high bits set for sub-block 0.
        let mut b = f16::from_f32(1.0).to_bits().to_le_bytes().to_vec();
        b.extend(f16::from_f32(0.0).to_bits().to_le_bytes());
        let mut scales = [0u8; 12];
        scales[0] = 1;
        scales[1] = 1;
        b.extend(scales);
        b.extend([1u8; 32]); // qh: bit 0 set -> +16 in sub-block 0
        b.extend([0x53u8; 128]); // low nibble 3, high nibble 5
        let mut y = [0f32; 256];
        dequantize(GgmlType::Q5K, &b, &mut y);
        assert_eq!((y[0], y[31], y[32], y[63], y[64]), (19.0, 19.0, 5.0, 5.0, 0.0));
    }
}
