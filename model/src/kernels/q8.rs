//! Q8_0 weights and activations: integer dot products per 32-value block, in one fixed order.
//!
//! Each output of `fast` precision is computed the same way whatever the tile, batch or thread:
//! 1. per block, lane `l` (of 8) sums the four products of values `4l..4l + 4` in 32-bit integers
//!    (exact, so the order inside a block cannot matter);
//! 2. the lane's float accumulator takes `fma(xd * wd, lane as f32, acc)`, block after block;
//! 3. the lanes are summed in the fixed tree of [`super::dot`].

use super::dot::tree8;

/// Weights per Q8_0 block.
pub(crate) const QK: usize = 32;
const LANES: usize = 8;
/// Activation rows per tile.
const TILE_ROWS: usize = 4;
/// Weight rows per tile: 8 accumulators, 2 weight vectors and a few temporaries fit the AVX2 registers.
const TILE_COLS: usize = 2;

/// A matrix `[rows][cols]` quantized to Q8_0 blocks along `cols`: weights once at load, activations
/// once per linear layer call.
#[derive(Debug)]
pub struct Q8 {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    q: Vec<i8>,
    scales: Vec<f32>,
    /// Per block, `d * sum(q)`: the sum of its quantized values, which a weight block's offset (Q4_1,
    /// Q4_K, ...) multiplies ([`block_sum`]).
    sums: Vec<f32>,
}

impl Q8 {
    /// What the kernels read of it, as bytes: the values, then the scales (and, unread where a weight
    /// has no offset, the blocks' sums are left out).
    pub fn parts(&self) -> [&[u8]; 2] {
        [zerocopy::IntoBytes::as_bytes(&self.q[..]), zerocopy::IntoBytes::as_bytes(&self.scales[..])]
    }

    /// `rows x cols` zero values, scales and sums, for the quantization to fill.
    fn zeroed(rows: usize, cols: usize) -> Self {
        let len = rows * cols;
        Q8 { rows, cols, q: vec![0i8; len], scales: vec![0.0; len / QK], sums: vec![0.0; len / QK] }
    }

    /// Quantizes `w` (`rows x cols`, `cols` a multiple of 32); `None` otherwise. Per block:
    /// `d = max|w| / 127`, `q = round(w / d)` (never -128, which the AVX2 kernel relies on).
    pub fn new(w: &[f32], rows: usize, cols: usize) -> Option<Self> {
        if !cols.is_multiple_of(QK) || w.len() != rows * cols {
            return None;
        }
        let mut out = Q8::zeroed(rows, cols);
        out.quantize_into(0, w);
        Some(out)
    }

    /// [`Q8::new`] of a weight matrix, a panel of rows at a time (blocks are never materialised whole).
    pub fn of_weight(w: &super::Weight, rows: usize, cols: usize) -> Option<Self> {
        if !cols.is_multiple_of(QK) || w.len() != rows * cols {
            return None;
        }
        let mut out = Q8::zeroed(rows, cols);
        let per_panel = (1 << 16) / cols.max(1) + 1;
        let mut buf = Vec::new();
        for r0 in (0..rows).step_by(per_panel) {
            let r1 = (r0 + per_panel).min(rows);
            out.quantize_into(r0 * cols, w.rows(r0..r1, cols, &mut buf));
        }
        Some(out)
    }

    /// Quantizes `w`, whole blocks, into the values, scales and sums from element `at` on. Blocks are
    /// independent, so a few hundred at a time go to the threads of the pool this runs in (a prefill's
    /// activations; the bits are the same).
    fn quantize_into(&mut self, at: usize, w: &[f32]) {
        use rayon::prelude::*;
        const PER_TASK: usize = 256;
        let blocks = w.len() / QK;
        let (b0, b1) = (at / QK, at / QK + blocks);
        let q = &mut self.q[at..at + blocks * QK];
        let (scales, sums) = (&mut self.scales[b0..b1], &mut self.sums[b0..b1]);
        let task = |(((w, q), scales), sums): Task<'_>| {
            #[cfg(target_arch = "x86_64")]
            if super::dot::simd()
                && std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
            {
                // SAFETY: AVX2, FMA, AVX-512F and BW are present.
                unsafe { quantize_avx512(w, q, scales, sums) };
                return;
            }
            #[cfg(target_arch = "x86_64")]
            if super::dot::simd() && crate::quant::avx2::available() {
                // SAFETY: AVX2 is present.
                unsafe { quantize_avx2(w, q, scales, sums) };
                return;
            }
            quantize(w, q, scales, sums);
        };
        if blocks <= PER_TASK || rayon::current_num_threads() < 2 {
            task((((w, q), scales), sums));
            return;
        }
        w.par_chunks(PER_TASK * QK)
            .zip(q.par_chunks_mut(PER_TASK * QK))
            .zip(scales.par_chunks_mut(PER_TASK))
            .zip(sums.par_chunks_mut(PER_TASK))
            .for_each(task);
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.q.len() + (self.scales.len() + self.sums.len()) * 4
    }

    fn row(&self, r: usize) -> (&[i8], &[f32]) {
        let blocks = self.cols / QK;
        (&self.q[r * self.cols..(r + 1) * self.cols], &self.scales[r * blocks..(r + 1) * blocks])
    }

    /// Row `r` as the operand of a native block product.
    pub(crate) fn act(&self, r: usize) -> Act<'_> {
        let blocks = self.cols / QK;
        let (q, d) = self.row(r);
        Act { q, d, s: &self.sums[r * blocks..(r + 1) * blocks] }
    }
}

/// One task of [`Q8::quantize_into`]: values, and where their quantized values, scales and sums go.
type Task<'a> = (((&'a [f32], &'a mut [i8]), &'a mut [f32]), &'a mut [f32]);

/// [`Q8::new`]'s quantization of the whole blocks of `w` into `q`, their scales and sums. Per
/// block: `d = max|w| / 127`, `q = round(w / d)`, and the sum `d * sum(q)` of the quantized values (the
/// integer sum is exact, so one rounding: what [`block_sum`] gives).
#[inline(always)]
fn quantize(w: &[f32], q: &mut [i8], scales: &mut [f32], sums: &mut [f32]) {
    let blocks = w.chunks_exact(QK).zip(q.chunks_exact_mut(QK));
    for ((wb, qb), (scale, sum)) in blocks.zip(scales.iter_mut().zip(sums.iter_mut())) {
        // The largest magnitude, NaNs ignored (`f32::max`): the same whatever the grouping, so sixteen
        // lanes at a time.
        let mut lanes = [0f32; 16];
        for half in wb.chunks_exact(16) {
            for (m, v) in lanes.iter_mut().zip(half) {
                *m = m.max(v.abs());
            }
        }
        let amax = lanes.iter().fold(0f32, |m, &v| m.max(v));
        let (d, inv) = block_scale(amax);
        let mut total = 0i32;
        for (q, &v) in qb.iter_mut().zip(wb) {
            let r = round_half_away(v * inv);
            *q = r as i8;
            total += i32::from(*q);
        }
        *scale = d;
        *sum = block_sum(d, total);
    }
}

/// A block's sum as the offsets' terms take it: `d` times the sum of its quantized values (at most
/// `32 * 127` in magnitude, so exact as an f32), that is the sum of the values the products see.
///
/// Not the sum of the values before quantization. A weight `d_w * v + m` (Q4_1, Q5_1, the K-quants'
/// minimum) times activations `x` is `d_w * sum(v * x) + m * sum(x)`; with the quantized activations in the
/// first term and the exact sum in the second, each activation's rounding error is weighted by `d_w * v =
/// w - m` (of one sign, and as large as the block's range) instead of by `w` (centred on zero): twice
/// the error, and `fast` SmolLM2's (all Q4_1) first-step log-probabilities were 0.245 from `exact`'s
/// (RMS, the four reference prompts) where llama.cpp's, which takes this sum (its Q8_1), were 0.123.
#[inline(always)]
fn block_sum(d: f32, total: i32) -> f32 {
    d * total as f32
}

/// A block's scale `d = max|w| / 127` and its inverse, by which the values are multiplied. A block
/// whose inverse would overflow (every value below about 4e-37, subnormal `d`) is all zeros: `d` and the
/// inverse 0. (Before, `1 / d` was infinite there and the values came out as garbage; a debug build
/// overflowed in the rounding.) Every value times the inverse is then at most 127 and some in magnitude,
/// or NaN (a NaN or infinite value).
#[inline(always)]
fn block_scale(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    if inv.is_finite() {
        (d, inv)
    } else {
        (0.0, 0.0)
    }
}

/// [`quantize`] with AVX-512 written out: the same operations on the same values, so the same bits
/// (`quantize_simd_equals_the_portable_quantizer` checks them, NaN, infinities and tiny values
/// included), a block at a time.
///
/// # Safety
///
/// The CPU supports AVX-512F and BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f,avx512bw")]
unsafe fn quantize_avx512(w: &[f32], q: &mut [i8], scales: &mut [f32], sums: &mut [f32]) {
    use std::arch::x86_64::*;
    let blocks = w.len() / QK;
    assert!(q.len() >= w.len() && scales.len() >= blocks && sums.len() >= blocks, "quantize operands");
    for b in 0..blocks {
        let at = b * QK;
        // SAFETY: 32 floats of block `b`; unaligned loads.
        let v = unsafe { [_mm512_loadu_ps(w.as_ptr().add(at)), _mm512_loadu_ps(w.as_ptr().add(at + 16))] };
        // `max` returns its second operand when either is NaN: a NaN value leaves the running maximum as
        // it was, as `f32::max` does in the portable fold.
        let lanes = v.iter().fold(_mm512_setzero_ps(), |m, &v| _mm512_max_ps(_mm512_abs_ps(v), m));
        let (d, inv) = block_scale(_mm512_reduce_max_ps(lanes));
        let inv = _mm512_set1_ps(inv);
        let mut total = 0i32;
        for (h, v) in v.into_iter().enumerate() {
            let x = _mm512_mul_ps(v, inv);
            // `x as i32`: truncation, and 0 for NaN ([`block_scale`] keeps every other `x` near 127 or
            // below, so nothing saturates).
            let whole = _mm512_cvttps_epi32(x);
            let whole = _mm512_mask_mov_epi32(whole, _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x), _mm512_setzero_si512());
            let frac = _mm512_sub_ps(x, _mm512_cvtepi32_ps(whole));
            let one = _mm512_set1_epi32(1);
            let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, _mm512_set1_ps(0.5));
            let down = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(frac, _mm512_set1_ps(-0.5));
            let rounded = _mm512_mask_add_epi32(whole, up, whole, one);
            let rounded = _mm512_mask_sub_epi32(rounded, down, rounded, one);
            // `as i8` keeps the low byte; the stored bytes' values summed, exactly, in 32 bits.
            let bytes = _mm512_cvtepi32_epi8(rounded);
            total += _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(bytes));
            // SAFETY: 16 bytes of block `b`'s 32; unaligned store.
            unsafe { _mm_storeu_si128(q.as_mut_ptr().add(at + 16 * h).cast(), bytes) };
        }
        scales[b] = d;
        sums[b] = block_sum(d, total);
    }
}

/// [`quantize`] with AVX2 written out, as [`quantize_avx512`] (the same test checks both), a block
/// at a time. Without it a decode step of four SmolLM2 rows on a Zen 3 spent about 3% of its time
/// quantizing the activations in the portable code.
///
/// # Safety
///
/// The CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_avx2(w: &[f32], q: &mut [i8], scales: &mut [f32], sums: &mut [f32]) {
    use std::arch::x86_64::*;
    let blocks = w.len() / QK;
    assert!(q.len() >= w.len() && scales.len() >= blocks && sums.len() >= blocks, "quantize operands");
    let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    let (half, minus_half, one_byte) = (_mm256_set1_ps(0.5), _mm256_set1_ps(-0.5), _mm256_set1_epi32(0xFF));
    // The dwords of the two packs' bytes back in position order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for b in 0..blocks {
        let at = b * QK;
        // SAFETY: 32 floats of block `b`; unaligned loads.
        let v: [__m256; 4] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(w.as_ptr().add(at + 8 * i)) });
        // As in `quantize_avx512`: a NaN leaves the running maximum as it was.
        let lanes = v.iter().fold(_mm256_setzero_ps(), |m, &v| _mm256_max_ps(_mm256_and_ps(v, magnitude), m));
        let mut top = [0f32; 8];
        // SAFETY: 8 floats; unaligned store.
        unsafe { _mm256_storeu_ps(top.as_mut_ptr(), lanes) };
        let (d, inv) = block_scale(top.iter().fold(0f32, |m, &v| m.max(v)));
        let inv = _mm256_set1_ps(inv);
        let rounded = v.map(|v| {
            let x = _mm256_mul_ps(v, inv);
            // `x as i32`: truncation, and 0 for NaN.
            let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
            let whole = _mm256_andnot_si256(nan, _mm256_cvttps_epi32(x));
            let frac = _mm256_sub_ps(x, _mm256_cvtepi32_ps(whole));
            // The comparisons' all-ones lanes are -1: subtracting one rounds up, adding one down.
            let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half));
            let down = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(frac, minus_half));
            // `as i8`: the low byte, sign-extended.
            _mm256_srai_epi32::<24>(_mm256_slli_epi32::<24>(_mm256_add_epi32(_mm256_sub_epi32(whole, up), down)))
        });
        let mut total = [0i32; 8];
        let sum = _mm256_add_epi32(_mm256_add_epi32(rounded[0], rounded[1]), _mm256_add_epi32(rounded[2], rounded[3]));
        // SAFETY: 8 i32s; unaligned store.
        unsafe { _mm256_storeu_si256(total.as_mut_ptr().cast(), sum) };
        // The low bytes, packed without saturation (each at most 255 as unsigned).
        let low = rounded.map(|r| _mm256_and_si256(r, one_byte));
        let bytes = _mm256_packus_epi16(_mm256_packus_epi32(low[0], low[1]), _mm256_packus_epi32(low[2], low[3]));
        // SAFETY: the 32 bytes of block `b`; unaligned store.
        unsafe { _mm256_storeu_si256(q.as_mut_ptr().add(at).cast(), _mm256_permutevar8x32_epi32(bytes, order)) };
        scales[b] = d;
        sums[b] = block_sum(d, total.iter().sum());
    }
}

/// One quantized activation row: per block of 32, the values `q`, the scale `d` and the sum `s = d *
/// sum(q)` of the quantized values ([`block_sum`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Act<'a> {
    pub(crate) q: &'a [i8],
    pub(crate) d: &'a [f32],
    pub(crate) s: &'a [f32],
}

/// `x.round()` as an integer, for `|x| < 2^23`: inline and without branches (`f32::round` is a library
/// call on baseline x86-64, and a branch on the fraction mispredicts half the time). The fraction
/// `x - trunc(x)` is exact at these magnitudes.
#[inline(always)]
fn round_half_away(x: f32) -> i32 {
    let whole = x as i32;
    let frac = x - whole as f32;
    whole + i32::from(frac >= 0.5) - i32::from(frac <= -0.5)
}

type Row<'a> = (&'a [i8], &'a [f32]);

#[inline(always)]
fn tile_portable<const R: usize, const C: usize>(x: [Row<'_>; R], w: [Row<'_>; C]) -> [[f32; C]; R] {
    let mut acc = [[[0f32; LANES]; C]; R];
    let blocks = x[0].1.len();
    for b in 0..blocks {
        for c in 0..C {
            let wb = &w[c].0[b * QK..(b + 1) * QK];
            for r in 0..R {
                let xb = &x[r].0[b * QK..(b + 1) * QK];
                let d = x[r].1[b] * w[c].1[b];
                for (l, acc) in acc[r][c].iter_mut().enumerate() {
                    let lane: i32 = (4 * l..4 * l + 4).map(|k| i32::from(xb[k]) * i32::from(wb[k])).sum();
                    *acc = d.mul_add(lane as f32, *acc);
                }
            }
        }
    }
    let mut out = [[0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            out[r][c] = tree8(acc[r][c]);
        }
    }
    out
}

/// The same outputs as [`tile_portable`] with AVX2: `|x| * sign(w, x)` pairs in 16 bits (at most
/// 2 * 127 * 127: no saturation, as quantization never gives -128), then 32-bit sums of four, which
/// are exactly the portable lanes.
///
/// # Safety
///
/// The CPU supports AVX2 and FMA; every row has the same number of whole blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const R: usize, const C: usize>(x: [Row<'_>; R], w: [Row<'_>; C]) -> [[f32; C]; R] {
    use std::arch::x86_64::*;
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    let blocks = x[0].1.len();
    for b in 0..blocks {
        let mut wv = [_mm256_setzero_si256(); C];
        for c in 0..C {
            // SAFETY: block b of a row of `blocks` whole blocks; unaligned load of 32 bytes.
            wv[c] = unsafe { _mm256_loadu_si256(w[c].0.as_ptr().add(b * QK).cast()) };
        }
        for r in 0..R {
            // SAFETY: as above.
            let xv = unsafe { _mm256_loadu_si256(x[r].0.as_ptr().add(b * QK).cast()) };
            let xabs = _mm256_sign_epi8(xv, xv);
            for c in 0..C {
                let pairs = _mm256_maddubs_epi16(xabs, _mm256_sign_epi8(wv[c], xv));
                let lanes = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                let d = _mm256_set1_ps(x[r].1[b] * w[c].1[b]);
                acc[r][c] = _mm256_fmadd_ps(d, lanes, acc[r][c]);
            }
        }
    }
    let mut out = [[0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            let mut lanes = [0f32; LANES];
            // SAFETY: 8 f32s; unaligned store.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r][c]) };
            out[r][c] = tree8(lanes);
        }
    }
    out
}

#[inline(always)]
fn tile<const R: usize, const C: usize>(simd: bool, x: [Row<'_>; R], w: [Row<'_>; C]) -> [[f32; C]; R] {
    let blocks = x[0].1.len();
    assert!(
        x.iter().chain(&w).all(|(q, s)| s.len() == blocks && q.len() == blocks * QK),
        "Q8 operands of equal whole blocks"
    );
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when AVX2 and FMA are present; block counts asserted above.
        return unsafe { tile_avx2(x, w) };
    }
    let _ = simd;
    tile_portable(x, w)
}

/// `out[i][j] = xq[i] . w[j]` for the `t` quantized activation rows and every weight row of `w` in
/// `rows`, into `out` (`t x rows.len()`).
pub(crate) fn dots(simd: bool, xq: &Q8, w: &Q8, rows: std::ops::Range<usize>, out: &mut [f32]) {
    let (t, cols) = (xq.rows, rows.len());
    assert!(xq.cols == w.cols && rows.end <= w.rows && out.len() == t * cols, "Q8 dots shapes");
    // As in the f32 kernel: few rows stream one weight row at a time, many share wider tiles.
    let tile_cols = if t <= TILE_ROWS { 1 } else { TILE_COLS };
    for c0 in (0..cols).step_by(tile_cols) {
        let nc = tile_cols.min(cols - c0);
        for r0 in (0..t).step_by(TILE_ROWS) {
            let nr = TILE_ROWS.min(t - r0);
            macro_rules! run {
                ($r:literal, $c:literal) => {{
                    let res = tile::<$r, $c>(
                        simd,
                        std::array::from_fn(|i| xq.row(r0 + i)),
                        std::array::from_fn(|j| w.row(rows.start + c0 + j)),
                    );
                    for (i, res) in res.iter().enumerate() {
                        out[(r0 + i) * cols + c0..][..$c].copy_from_slice(res);
                    }
                }};
            }
            match (nr, nc) {
                (4, 2) => run!(4, 2),
                (4, _) => run!(4, 1),
                (3, 2) => run!(3, 2),
                (3, _) => run!(3, 1),
                (2, 2) => run!(2, 2),
                (2, _) => run!(2, 1),
                (_, 2) => run!(1, 2),
                _ => run!(1, 1),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_kernels_and_every_tile_give_the_same_bits() {
        let (t, rows, cols) = (7, 5, 640);
        let x: Vec<f32> = (0..t * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37).collect();
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 53 % 97) as f32 - 48.0) * 1.9).collect();
        let (xq, wq) = (Q8::new(&x, t, cols).unwrap(), Q8::new(&w, rows, cols).unwrap());
        assert!(xq.q.iter().chain(&wq.q).any(|&q| q == 127 || q == -127), "extremes exercised");
        let mut alone = vec![0f32; t * rows];
        for i in 0..t {
            for j in 0..rows {
                alone[i * rows + j] = tile_portable::<1, 1>([xq.row(i)], [wq.row(j)])[0][0];
            }
        }
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for simd_on in [false, super::super::dot::simd()] {
            let mut out = vec![0f32; t * rows];
            dots(simd_on, &xq, &wq, 0..rows, &mut out);
            assert_eq!(bits(&out), bits(&alone), "simd {simd_on}");
            let mut some = vec![0f32; t * 2];
            dots(simd_on, &xq, &wq, 3..5, &mut some);
            let expect: Vec<f32> = (0..t).flat_map(|i| alone[i * rows + 3..i * rows + 5].to_vec()).collect();
            assert_eq!(bits(&some), bits(&expect));
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn quantize_simd_equals_the_portable_quantizer() {
        let avx512 = crate::kernels::dot::simd()
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw");
        let avx2 = crate::kernels::dot::simd() && crate::quant::avx2::available();
        let mut next = crate::testing::xorshift32(0x9E37_79B9);
        // Whole groups and a tail (13 blocks), values of every size, with NaN, infinities, zeros,
        // negative zero, a block of subnormal values and one of halves among them.
        for blocks in [1, 8, 13, 16, 21] {
            let mut w: Vec<f32> = (0..blocks * QK)
                .map(|_| {
                    let r = next();
                    f32::from_bits(r & 0x3FFF_FFFF | (r & 1) << 31) * if r.is_multiple_of(3) { 1e-30 } else { 1.0 }
                })
                .collect();
            w[3] = f32::NAN;
            w[20] = -0.0;
            if blocks > 4 {
                w[40] = f32::INFINITY;
                w[96..128].fill(1e-40);
                w[128..160].fill(0.0);
                // A block whose scale is 1: every other value is a half, rounded away from zero.
                w[160] = 127.0;
                for (i, v) in w[161..192].iter_mut().enumerate() {
                    *v = (i as f32 * 4.0 + 0.5) * if i % 2 == 0 { 1.0 } else { -1.0 };
                }
            }
            let n = blocks * QK;
            let (mut q0, mut d0, mut s0) = (vec![0i8; n], vec![0f32; blocks], vec![0f32; blocks]);
            let (mut q1, mut d1, mut s1) = (vec![0i8; n], vec![0f32; blocks], vec![0f32; blocks]);
            quantize(&w, &mut q0, &mut d0, &mut s0);
            if blocks > 4 {
                // A block of subnormal values is zeros, like the block of zeros after it.
                assert_eq!((d0[3], &q0[96..128]), (0.0, &[0i8; 32][..]));
            }
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            // Without an instruction set its quantizer never runs; the portable one is what does.
            for (name, present) in [("AVX-512", avx512), ("AVX2", avx2)] {
                if !present {
                    continue;
                }
                // SAFETY: the instruction set is present (checked above).
                unsafe {
                    if name == "AVX2" {
                        quantize_avx2(&w, &mut q1, &mut d1, &mut s1);
                    } else {
                        quantize_avx512(&w, &mut q1, &mut d1, &mut s1);
                    }
                }
                assert_eq!(q1, q0, "{name}, {blocks} blocks: values");
                assert_eq!(bits(&d1), bits(&d0), "{name}, {blocks} blocks: scales");
                assert_eq!(bits(&s1), bits(&s0), "{name}, {blocks} blocks: sums");
            }
        }
    }

    #[test]
    fn inline_rounding_is_round() {
        let cases = (-300_000..300_000).map(|i| i as f32 / 2347.0);
        for x in cases.chain([0.5f32, -0.5, 1.5, -1.5, 126.5, -126.5, 0.499_999_97, -0.499_999_97, 127.0, -127.0]) {
            assert_eq!(round_half_away(x), x.round() as i32, "{x}");
        }
    }
}
