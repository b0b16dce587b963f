//! The gated activations of the feed-forward layers, `act(gate) * up`, with GELU (tanh form, Gemma) or
//! SiLU (Llama), vectorized.
//!
//! Both are written through one exponential ([`exp`]): `gelu_tanh(x) = 0.5 x (1 + tanh(y))` is
//! `x / (1 + exp(-2y))` (the same function, without the cancellation of `1 + tanh` for large negative
//! `y`), and `silu(x) = x / (1 + exp(-x))`. The exponential is a range reduction by `ln 2` and a
//! polynomial (Cephes' `expf` coefficients), every step an IEEE addition, multiplication, fused
//! multiply-add or division, so the AVX2 and AVX-512 kernels give the portable bits (tested), and a
//! value's bits never depend on which kernel or which batch computed it. A library `tanhf`/`expf` call
//! per value cost 10% of a Gemma prefill.
//!
//! Attention's softmax ([`softmax`]) goes through the same exponential, with its sum in one fixed order
//! of lanes: its bits are the same on every CPU and with every C library, where a libm `expf` per score
//! made them depend on the libm (and cost 7% of a SmolLM2 decode step at 800 positions).

use super::dot::Isa;

/// Which activation gates the feed-forward layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// GELU, tanh approximation (Gemma).
    GeluTanh,
    /// SiLU (Llama).
    Silu,
}

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` in two parts: the first exact in few bits, so `n * LN2_HI` is exact for the `n` used.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Adding then subtracting 1.5 * 2^23 rounds an `|x| < 2^22` to the nearest integer (ties to even).
const ROUND: f32 = 12_582_912.0;
const P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];
/// `exp` is clamped to `[exp(LO), exp(HI)]`: both ends normal, so `2^n` is one exponent field.
const LO: f32 = -87.0;
const HI: f32 = 88.0;
/// `sqrt(2 / pi)` and the cubic term's coefficient of the tanh form of GELU.
const GELU_C: f32 = 0.797_884_6;
const GELU_A: f32 = 0.044_715;

/// `e^z`, to within 2 units in the last place over the clamped range: the definition every kernel
/// follows. A NaN stays a NaN (`min`/`max` with the NaN second, as `clamp` does), though its payload
/// may differ between kernels.
#[inline(always)]
pub fn exp(z: f32) -> f32 {
    let z = z.clamp(LO, HI);
    let n = (z * LOG2E + ROUND) - ROUND;
    let r = n.mul_add(-LN2_HI, z);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = P[0];
    for c in &P[1..] {
        p = p.mul_add(r, *c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// Lanes of [`sum_exp`]'s sum.
const SUM_LANES: usize = 16;

/// `sum(e^(x - max))` over the values of `xs` that are not NaN, in f64, in one fixed order whatever the
/// kernel: lane `l` (of 16) adds the terms of `x[i]`, `i ≡ l (mod 16)`, in increasing `i`; then lanes `l`
/// and `l + 8`, the 8 sums as [`super::dot::tree8`] does, and the values past the last 16 one by one.
/// Each term is [`exp`] of an f32 difference, widened to f64 (exact), so the kernels give the portable
/// bits (tested). [`exp`] is clamped at `e^-87`: a value far below `max` adds about `1e-38`, not 0.
pub fn sum_exp(xs: &[f32], max: f32) -> f64 {
    sum_exp_with(Isa::best(super::dot::simd()), xs, max)
}

fn sum_exp_with(isa: Isa, xs: &[f32], max: f32) -> f64 {
    let term = |x: f32| if x.is_nan() { 0.0 } else { f64::from(exp(x - max)) };
    let (lanes, done) = match isa {
        Isa::Portable => {
            let mut lanes = [0f64; SUM_LANES];
            let chunks = xs.chunks_exact(SUM_LANES);
            for chunk in chunks {
                for (l, &x) in lanes.iter_mut().zip(chunk) {
                    *l += term(x);
                }
            }
            (lanes, xs.len() / SUM_LANES * SUM_LANES)
        }
        // SAFETY: `Isa::best` gives it only where AVX2 and FMA are present.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { simd::sum_exp_avx2(xs, max) },
        // SAFETY: `Isa::best` gives it only where AVX-512F is present.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { simd::sum_exp_avx512(xs, max) },
    };
    let s8: [f64; 8] = std::array::from_fn(|l| lanes[l] + lanes[l + 8]);
    let s4 = [s8[0] + s8[4], s8[1] + s8[5], s8[2] + s8[6], s8[3] + s8[7]];
    let mut sum = (s4[0] + s4[2]) + (s4[1] + s4[3]);
    for &x in &xs[done..] {
        sum += term(x);
    }
    sum
}

/// Lanes of [`softmax`]'s sum.
const SOFTMAX_LANES: usize = 16;

/// Attention's softmax of one query's scores, in place: each score is first multiplied by `scale`, then
/// `x[i] = e^(x[i] - max) / sum`, with `max` the largest scaled score (NaNs passed over) and [`exp`] the
/// exponential. The sum is in one fixed order whatever the kernel: lane `l` (of 16) adds the terms of
/// `x[i]`, `i ≡ l (mod 16)`, in increasing `i`, then lanes `l` and `l + 8` are added and the 8 sums
/// as [`super::dot::tree8`] does, then the terms past the last 16 one by one. So a query's weights
/// depend on its scores alone, not on the batch, the chunk or the CPU (tested: every kernel gives
/// the portable bits).
pub fn softmax(xs: &mut [f32], scale: f32) {
    softmax_with(Isa::best(super::dot::simd()), xs, scale)
}

fn softmax_with(isa: Isa, xs: &mut [f32], scale: f32) {
    let whole = xs.len() / SOFTMAX_LANES * SOFTMAX_LANES;
    let (head, tail) = xs.split_at_mut(whole);
    let mut max = match isa {
        Isa::Portable => {
            let mut max = f32::NEG_INFINITY;
            for x in head.iter_mut() {
                *x *= scale;
                max = max.max(*x);
            }
            max
        }
        // SAFETY: `Isa::best` gives it only where AVX2 and FMA are present; `head` is whole 16s.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { simd::scale_max_avx2(head, scale) },
        // SAFETY: `Isa::best` gives it only where AVX-512F is present; `head` is whole 16s.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { simd::scale_max_avx512(head, scale) },
    };
    for x in tail.iter_mut() {
        *x *= scale;
        max = max.max(*x);
    }
    let lanes = match isa {
        Isa::Portable => {
            let mut lanes = [0f32; SOFTMAX_LANES];
            for chunk in head.chunks_exact_mut(SOFTMAX_LANES) {
                for (l, x) in lanes.iter_mut().zip(chunk) {
                    *x = exp(*x - max);
                    *l += *x;
                }
            }
            lanes
        }
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { simd::exp_sum_avx2(head, max) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { simd::exp_sum_avx512(head, max) },
    };
    let mut sum = super::dot::tree8(std::array::from_fn(|l| lanes[l] + lanes[l + 8]));
    for x in tail.iter_mut() {
        *x = exp(*x - max);
        sum += *x;
    }
    match isa {
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { simd::divide_avx2(head, sum) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { simd::divide_avx512(head, sum) },
        Isa::Portable => head.iter_mut().for_each(|x| *x /= sum),
    }
    tail.iter_mut().for_each(|x| *x /= sum);
}

/// The activation of one gate value.
#[inline(always)]
pub fn activate(gate: Gate, x: f32) -> f32 {
    let z = match gate {
        Gate::GeluTanh => GELU_C * (x + GELU_A * x * x * x) * -2.0,
        Gate::Silu => -x,
    };
    x / (1.0 + exp(z))
}

/// `out[i] = activate(gate, g[i]) * u[i]` for every `i`. Each value's bits depend on nothing but its own
/// gate and up values, so any split of a long vector into parts gives the bits of the whole.
pub fn gated_into(gate: Gate, g: &[f32], u: &[f32], out: &mut [f32]) {
    gated_with(Isa::best(super::dot::simd()), gate, g, u, out)
}

fn gated_with(isa: Isa, gate: Gate, g: &[f32], u: &[f32], out: &mut [f32]) {
    assert!(g.len() == u.len() && u.len() == out.len(), "gate, up and output of unequal lengths");
    let done = match isa {
        Isa::Portable => 0,
        // SAFETY: `Isa::best` gives it only where AVX2 and FMA are present; the lengths are equal.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { simd::gated_avx2(gate, g, u, out) },
        // SAFETY: `Isa::best` gives it only where AVX-512F is present; the lengths are equal.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { simd::gated_avx512(gate, g, u, out) },
    };
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u).skip(done) {
        *o = activate(gate, g) * u;
    }
}

/// The kernels: [`exp`] and [`activate`] operation for operation, 8 or 16 values at a time. Each
/// returns how many leading values it wrote (whole vectors); the caller does the rest.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::{Gate, GELU_A, GELU_C, HI, LN2_HI, LN2_LO, LO, LOG2E, P, ROUND, SOFTMAX_LANES, SUM_LANES};

    /// [`super::exp`] of 8 values.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp8(z: __m256) -> __m256 {
        let s = _mm256_set1_ps;
        let z = _mm256_min_ps(s(HI), _mm256_max_ps(s(LO), z));
        let n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(z, s(LOG2E)), s(ROUND)), s(ROUND));
        let r = _mm256_fmadd_ps(n, s(-LN2_HI), z);
        let r = _mm256_fmadd_ps(n, s(-LN2_LO), r);
        let mut p = s(P[0]);
        for c in &P[1..] {
            p = _mm256_fmadd_ps(p, r, s(*c));
        }
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), s(1.0));
        let two_n = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        _mm256_mul_ps(y, _mm256_castsi256_ps(two_n))
    }

    /// [`super::exp`] of 16 values.
    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f")]
    fn exp16(z: __m512) -> __m512 {
        let s = _mm512_set1_ps;
        let z = _mm512_min_ps(s(HI), _mm512_max_ps(s(LO), z));
        let n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(z, s(LOG2E)), s(ROUND)), s(ROUND));
        let r = _mm512_fmadd_ps(n, s(-LN2_HI), z);
        let r = _mm512_fmadd_ps(n, s(-LN2_LO), r);
        let mut p = s(P[0]);
        for c in &P[1..] {
            p = _mm512_fmadd_ps(p, r, s(*c));
        }
        let y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), s(1.0));
        let two_n = _mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)));
        _mm512_mul_ps(y, _mm512_castsi512_ps(two_n))
    }

    /// [`super::sum_exp`]'s lanes with AVX2: each 16 values are two vectors of 8, each widened to two
    /// vectors of 4 f64 lanes; a NaN's term is zero. Returns the lanes and how many values they cover.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn sum_exp_avx2(xs: &[f32], max: f32) -> ([f64; SUM_LANES], usize) {
        let mut acc = [_mm256_setzero_pd(); 4];
        let whole = xs.len() / SUM_LANES * SUM_LANES;
        let m = _mm256_set1_ps(max);
        for i in (0..whole).step_by(SUM_LANES) {
            for h in 0..2 {
                // SAFETY: i + 16 <= whole <= xs.len(); unaligned load.
                let x = unsafe { _mm256_loadu_ps(xs.as_ptr().add(i + 8 * h)) };
                let e = _mm256_and_ps(exp8(_mm256_sub_ps(x, m)), _mm256_cmp_ps::<_CMP_ORD_Q>(x, x));
                acc[2 * h] = _mm256_add_pd(acc[2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
                acc[2 * h + 1] = _mm256_add_pd(acc[2 * h + 1], _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(e)));
            }
        }
        let mut lanes = [0f64; SUM_LANES];
        for (v, acc) in acc.iter().enumerate() {
            // SAFETY: 4 f64s; unaligned store.
            unsafe { _mm256_storeu_pd(lanes.as_mut_ptr().add(4 * v), *acc) };
        }
        (lanes, whole)
    }

    /// [`super::sum_exp`]'s lanes with AVX-512F: each 16 values are one vector, widened to two vectors
    /// of 8 f64 lanes; a NaN's term is zero. Returns the lanes and how many values they cover.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F (and AVX2, FMA).
    #[target_feature(enable = "avx2,fma,avx512f")]
    pub(super) unsafe fn sum_exp_avx512(xs: &[f32], max: f32) -> ([f64; SUM_LANES], usize) {
        let mut acc = [_mm512_setzero_pd(); 2];
        let whole = xs.len() / SUM_LANES * SUM_LANES;
        let m = _mm512_set1_ps(max);
        for i in (0..whole).step_by(SUM_LANES) {
            // SAFETY: i + 16 <= whole <= xs.len(); unaligned load.
            let x = unsafe { _mm512_loadu_ps(xs.as_ptr().add(i)) };
            let e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(x, x), exp16(_mm512_sub_ps(x, m)));
            acc[0] = _mm512_add_pd(acc[0], _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
            acc[1] = _mm512_add_pd(
                acc[1],
                _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(e)))),
            );
        }
        let mut lanes = [0f64; SUM_LANES];
        for (v, acc) in acc.iter().enumerate() {
            // SAFETY: 8 f64s; unaligned store.
            unsafe { _mm512_storeu_pd(lanes.as_mut_ptr().add(8 * v), *acc) };
        }
        (lanes, whole)
    }

    /// [`super::softmax`]'s first pass with AVX2: every value scaled in place; returns the largest (NaNs
    /// passed over: `max` keeps its second operand when the first is a NaN).
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA; `xs` is whole 16s.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scale_max_avx2(xs: &mut [f32], scale: f32) -> f32 {
        let (sc, mut m) = (_mm256_set1_ps(scale), _mm256_set1_ps(f32::NEG_INFINITY));
        for i in (0..xs.len()).step_by(8) {
            // SAFETY: i + 8 <= xs.len() (whole 16s); unaligned load and store.
            unsafe {
                let x = _mm256_mul_ps(_mm256_loadu_ps(xs.as_ptr().add(i)), sc);
                _mm256_storeu_ps(xs.as_mut_ptr().add(i), x);
                m = _mm256_max_ps(x, m);
            }
        }
        let mut lanes = [0f32; 8];
        // SAFETY: 8 f32s; unaligned store.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
        lanes.into_iter().fold(f32::NEG_INFINITY, f32::max)
    }

    /// [`scale_max_avx2`] with AVX-512F.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F (and AVX2, FMA); `xs` is whole 16s.
    #[target_feature(enable = "avx2,fma,avx512f")]
    pub(super) unsafe fn scale_max_avx512(xs: &mut [f32], scale: f32) -> f32 {
        let (sc, mut m) = (_mm512_set1_ps(scale), _mm512_set1_ps(f32::NEG_INFINITY));
        for i in (0..xs.len()).step_by(16) {
            // SAFETY: i + 16 <= xs.len() (whole 16s); unaligned load and store.
            unsafe {
                let x = _mm512_mul_ps(_mm512_loadu_ps(xs.as_ptr().add(i)), sc);
                _mm512_storeu_ps(xs.as_mut_ptr().add(i), x);
                m = _mm512_max_ps(x, m);
            }
        }
        _mm512_reduce_max_ps(m)
    }

    /// [`super::softmax`]'s exponentials with AVX2, in place; returns the 16 lanes of their sum (lanes
    /// `0..8` of each 16 in the first vector, `8..16` in the second).
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA; `xs` is whole 16s.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_sum_avx2(xs: &mut [f32], max: f32) -> [f32; SOFTMAX_LANES] {
        let (m, mut acc) = (_mm256_set1_ps(max), [_mm256_setzero_ps(); 2]);
        for i in (0..xs.len()).step_by(SOFTMAX_LANES) {
            for (h, acc) in acc.iter_mut().enumerate() {
                // SAFETY: i + 16 <= xs.len() (whole 16s); unaligned load and store.
                unsafe {
                    let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(xs.as_ptr().add(i + 8 * h)), m));
                    _mm256_storeu_ps(xs.as_mut_ptr().add(i + 8 * h), e);
                    *acc = _mm256_add_ps(*acc, e);
                }
            }
        }
        let mut lanes = [0f32; SOFTMAX_LANES];
        for (h, acc) in acc.iter().enumerate() {
            // SAFETY: 8 f32s; unaligned store.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr().add(8 * h), *acc) };
        }
        lanes
    }

    /// [`exp_sum_avx2`] with AVX-512F: one vector of the 16 lanes.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F (and AVX2, FMA); `xs` is whole 16s.
    #[target_feature(enable = "avx2,fma,avx512f")]
    pub(super) unsafe fn exp_sum_avx512(xs: &mut [f32], max: f32) -> [f32; SOFTMAX_LANES] {
        let (m, mut acc) = (_mm512_set1_ps(max), _mm512_setzero_ps());
        for i in (0..xs.len()).step_by(SOFTMAX_LANES) {
            // SAFETY: i + 16 <= xs.len() (whole 16s); unaligned load and store.
            unsafe {
                let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(xs.as_ptr().add(i)), m));
                _mm512_storeu_ps(xs.as_mut_ptr().add(i), e);
                acc = _mm512_add_ps(acc, e);
            }
        }
        let mut lanes = [0f32; SOFTMAX_LANES];
        // SAFETY: 16 f32s; unaligned store.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
        lanes
    }

    /// Every value divided by `sum` in place, with AVX2.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2; `xs` is whole 8s.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn divide_avx2(xs: &mut [f32], sum: f32) {
        let s = _mm256_set1_ps(sum);
        for i in (0..xs.len()).step_by(8) {
            // SAFETY: i + 8 <= xs.len() (whole 8s); unaligned load and store.
            unsafe { _mm256_storeu_ps(xs.as_mut_ptr().add(i), _mm256_div_ps(_mm256_loadu_ps(xs.as_ptr().add(i)), s)) };
        }
    }

    /// [`divide_avx2`] with AVX-512F.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F (and AVX2, FMA); `xs` is whole 16s.
    #[target_feature(enable = "avx2,fma,avx512f")]
    pub(super) unsafe fn divide_avx512(xs: &mut [f32], sum: f32) {
        let s = _mm512_set1_ps(sum);
        for i in (0..xs.len()).step_by(16) {
            // SAFETY: i + 16 <= xs.len() (whole 16s); unaligned load and store.
            unsafe { _mm512_storeu_ps(xs.as_mut_ptr().add(i), _mm512_div_ps(_mm512_loadu_ps(xs.as_ptr().add(i)), s)) };
        }
    }

    /// [`super::gated_into`] with AVX2.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA; `g`, `u` and `out` have the same length.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gated_avx2(gate: Gate, g: &[f32], u: &[f32], out: &mut [f32]) -> usize {
        let s = _mm256_set1_ps;
        let whole = g.len() / 8 * 8;
        for i in (0..whole).step_by(8) {
            // SAFETY: i + 8 <= the length of all three (the caller's contract); unaligned loads.
            let (x, up) = unsafe { (_mm256_loadu_ps(g.as_ptr().add(i)), _mm256_loadu_ps(u.as_ptr().add(i))) };
            let z = match gate {
                Gate::GeluTanh => {
                    let cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(s(GELU_A), x), x), x);
                    _mm256_mul_ps(_mm256_mul_ps(s(GELU_C), _mm256_add_ps(x, cube)), s(-2.0))
                }
                Gate::Silu => _mm256_xor_ps(x, s(-0.0)),
            };
            let act = _mm256_div_ps(x, _mm256_add_ps(s(1.0), exp8(z)));
            // SAFETY: as above; unaligned store.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(act, up)) };
        }
        whole
    }

    /// [`super::gated_into`] with AVX-512F.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F (and AVX2, FMA); `g`, `u` and `out` have the same length.
    #[target_feature(enable = "avx2,fma,avx512f")]
    pub(super) unsafe fn gated_avx512(gate: Gate, g: &[f32], u: &[f32], out: &mut [f32]) -> usize {
        let s = _mm512_set1_ps;
        let whole = g.len() / 16 * 16;
        for i in (0..whole).step_by(16) {
            // SAFETY: i + 16 <= the length of all three (the caller's contract); unaligned loads.
            let (x, up) = unsafe { (_mm512_loadu_ps(g.as_ptr().add(i)), _mm512_loadu_ps(u.as_ptr().add(i))) };
            let z = match gate {
                Gate::GeluTanh => {
                    let cube = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(s(GELU_A), x), x), x);
                    _mm512_mul_ps(_mm512_mul_ps(s(GELU_C), _mm512_add_ps(x, cube)), s(-2.0))
                }
                Gate::Silu => {
                    _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(i32::MIN)))
                }
            };
            let act = _mm512_div_ps(x, _mm512_add_ps(s(1.0), exp16(z)));
            // SAFETY: as above; unaligned store.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_mul_ps(act, up)) };
        }
        whole
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The polynomial exponential is within 2 units in the last place of the true value over the whole
    /// clamped range, and the activations within a few of their f64 values.
    #[test]
    fn exp_and_the_activations_are_accurate() {
        let ulps =
            |got: f32, want: f64| ((f64::from(got) - want) / (want.abs() * f64::from(f32::EPSILON)).max(1e-300)).abs();
        for i in -870_000..880_000 {
            let z = i as f32 * 1e-4;
            let u = ulps(exp(z), f64::from(z).exp());
            assert!(u <= 2.0, "exp({z}): {} ulps", u);
        }
        for i in -20_000..20_000 {
            let x = i as f32 * 1e-3;
            let xd = f64::from(x);
            // The exponential's argument `z` carries its own rounding, which `e^z` turns into a relative
            // error of about `|z|` units: the conditioning of the function in f32, not of the kernel.
            let z = f64::from(GELU_C) * (xd + f64::from(GELU_A) * xd * xd * xd) * 2.0;
            // `0.5 x (1 + tanh(z / 2))`, written without its cancellation in f64 too.
            let gelu = xd / (1.0 + (-z).exp());
            let silu = xd / (1.0 + (-xd).exp());
            for (got, want, z) in [(activate(Gate::GeluTanh, x), gelu, z), (activate(Gate::Silu, x), silu, xd)] {
                let tolerance = 4.0 * f64::from(f32::EPSILON) * (1.0 + z.abs()) * want.abs();
                assert!((f64::from(got) - want).abs() <= tolerance.max(1e-30), "{x}: {got} vs {want}");
            }
        }
        assert_eq!(activate(Gate::GeluTanh, 1e6), 1e6);
        assert!(activate(Gate::GeluTanh, -1e6).abs() < 1e-30, "the clamp leaves a vanishing value");
        assert!(activate(Gate::Silu, f32::NAN).is_nan());
    }

    /// The normaliser's sum: every kernel's bits are the portable ones (NaNs skipped, tails included),
    /// and within a few units in the last place of an f64 sum of f64 exponentials.
    #[test]
    fn sum_exp_is_one_fixed_sum_and_accurate() {
        for len in [0, 1, 15, 16, 17, 100, 1037, 262_144 + 5] {
            let mut xs: Vec<f32> = (0..len).map(|i| ((i * 7919 % 20011) as f32 - 10_000.0) * 1e-3).collect();
            for x in xs.iter_mut().step_by(97) {
                *x = f32::NAN;
            }
            let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let want = sum_exp_with(Isa::Portable, &xs, max);
            for isa in Isa::all() {
                assert_eq!(sum_exp_with(isa, &xs, max).to_bits(), want.to_bits(), "{len} values, {isa:?}");
            }
            let exact: f64 = xs.iter().filter(|x| !x.is_nan()).map(|&x| (f64::from(x) - f64::from(max)).exp()).sum();
            assert!((want - exact).abs() <= exact * 1e-6, "{len} values: {want} against {exact}");
        }
    }

    /// The softmax: every kernel's bits are the portable ones (tails and a NaN included), and each
    /// weight within a few units in the last place of an f64 softmax of the same scaled scores.
    #[test]
    fn softmax_is_one_fixed_order_and_accurate() {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for len in [0, 1, 7, 15, 16, 17, 64, 530, 1037, 9216] {
            let scores: Vec<f32> = (0..len).map(|i| ((i * 7919 % 20011) as f32 - 10_000.0) * 2e-3).collect();
            let scale = 0.125;
            let mut want = scores.clone();
            softmax_with(Isa::Portable, &mut want, scale);
            for isa in Isa::all() {
                let mut got = scores.clone();
                softmax_with(isa, &mut got, scale);
                assert_eq!(bits(&got), bits(&want), "{len} scores, {isa:?}");
            }
            let scaled: Vec<f64> = scores.iter().map(|&x| f64::from(x * scale)).collect();
            let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = scaled.iter().map(|x| (x - max).exp()).sum();
            for (got, x) in want.iter().zip(&scaled) {
                let exact = (x - max).exp() / sum;
                assert!((f64::from(*got) - exact).abs() <= 4.0 * f64::from(f32::EPSILON) * exact, "{got} vs {exact}");
            }
            if len > 0 {
                assert!((want.iter().map(|&w| f64::from(w)).sum::<f64>() - 1.0).abs() < 1e-5, "{len} weights sum to 1");
            }
        }
        let mut nan = vec![1.0, f32::NAN, 2.0];
        softmax(&mut nan, 1.0);
        assert!(nan.iter().all(|w| w.is_nan()), "a NaN score spoils the row, as it did with libm: {nan:?}");
    }

    /// Every kernel gives the portable bits, tails included.
    #[test]
    fn every_kernel_gives_the_portable_bits() {
        let g: Vec<f32> =
            (0..1037).map(|i| (i as f32 - 518.0) * 0.023 + if i % 13 == 0 { 40.0 } else { 0.0 }).collect();
        let u: Vec<f32> = (0..1037).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.03).collect();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let of = |isa, gate, g: &[f32], u: &[f32]| {
            let mut out = vec![0f32; g.len()];
            gated_with(isa, gate, g, u, &mut out);
            out
        };
        for gate in [Gate::GeluTanh, Gate::Silu] {
            let want = of(Isa::Portable, gate, &g, &u);
            for isa in Isa::all() {
                assert_eq!(bits(&of(isa, gate, &g, &u)), bits(&want), "{gate:?} {isa:?}");
                // In parts, as the forward pass computes it row by row.
                let parts: Vec<f32> = g.chunks(100).zip(u.chunks(100)).flat_map(|(g, u)| of(isa, gate, g, u)).collect();
                assert_eq!(bits(&parts), bits(&want), "{gate:?} {isa:?} in parts");
            }
        }
    }
}
