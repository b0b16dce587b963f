//! AVX-512 twins of [`super::avx2::dot_rows`]: each block is dequantized 16 values at a time, every value by the
//! same operations on the same operands as the portable dequantizer, and each 16 feed one vector of
//! multiply-adds whose lane `l` is lane `l % 8` of the AVX2 kernel's accumulator `l / 8`: the same bits.

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
pub(crate) unsafe fn dot_rows<const R: usize>(ty: GgmlType, x: [&[f32]; R], ws: &[u8], n: usize, out: &mut [[f32; R]]) {
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
        // SAFETY: block `i` of row `j + h` lies in `ws` (asserted), and `bb` is its length.
        let block_of = |h: usize| unsafe { std::slice::from_raw_parts(rows.add(h * row_bytes + i * bb), bb) };
        // Activations `base + at .. base + at + 16` of every row.
        let x_at = |at: usize| -> [__m512; R] {
            std::array::from_fn(|r| {
                // SAFETY: base + at + 16 <= n <= x[r].len() (asserted; `at` is a block's offset of 16
                // values); unaligned load.
                unsafe { _mm512_loadu_ps(xs[r].add(base + at)) }
            })
        };
        if be == 32 {
            // Every row's block in registers first (two vectors each), then each 16 activations loaded
            // once for all `H` rows: Gemma's head (Q8_0) for four activation rows took 18.1 ms against
            // 20.7 ms with the activations loaded again for every row (Zen 4).
            let mut w = [[_mm512_setzero_ps(); 2]; H];
            for (h, w) in w.iter_mut().enumerate() {
                block::<T>(block_of(h), &mut |at, wv| w[at / 16] = wv);
            }
            for p in 0..2 {
                let xv = x_at(16 * p);
                for (acc, w) in acc.iter_mut().zip(&w) {
                    for r in 0..R {
                        acc[r] = _mm512_fmadd_ps(xv[r], w[p], acc[r]);
                    }
                }
            }
        } else {
            // A 256-value block's sixteen vectors per row would not stay in registers (so held for
            // all rows at once, they made Gemma's layers slower): each is used as it comes.
            for (h, acc) in acc.iter_mut().enumerate() {
                block::<T>(block_of(h), &mut |at, wv| {
                    let xv = x_at(at);
                    for r in 0..R {
                        acc[r] = _mm512_fmadd_ps(xv[r], wv, acc[r]);
                    }
                });
            }
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

/// The quants `from` to `from + 15` as floats (exact), lane by lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
fn quants(from: f32) -> __m512 {
    _mm512_add_ps(
        _mm512_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0),
        _mm512_set1_ps(from),
    )
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
            // The block's 16 (32 with a fifth bit) possible values, each by the portable dequantizer's
            // operations on its quant: then every value is one lookup by its quant.
            let zero = _mm512_set1_ps(if five { 16.0 } else { 8.0 });
            let (low, high) = match m {
                None => (
                    _mm512_mul_ps(d, _mm512_sub_ps(quants(0.0), zero)),
                    _mm512_mul_ps(d, _mm512_sub_ps(quants(16.0), zero)),
                ),
                Some(m) => {
                    (_mm512_add_ps(_mm512_mul_ps(d, quants(0.0)), m), _mm512_add_ps(_mm512_mul_ps(d, quants(16.0)), m))
                }
            };
            // SAFETY: 16 bytes from `at` lie in the block (asserted).
            let qs = unsafe { _mm_loadu_si128(b.as_ptr().add(at).cast()) };
            let mask = _mm_set1_epi8(0x0F);
            let halves = [_mm_and_si128(qs, mask), _mm_and_si128(_mm_srli_epi16::<4>(qs), mask)];
            let qh = if five { u32::from_le_bytes([b[at - 4], b[at - 3], b[at - 2], b[at - 1]]) } else { 0 };
            for (h, v) in halves.into_iter().enumerate() {
                let q = _mm512_cvtepu8_epi32(v);
                let value = if five {
                    // Bit `16h + lane` of qh sets 16 in that lane: the 16 bits are a lane mask, and
                    // bit 4 of a lane's index picks `high`.
                    let q = _mm512_mask_or_epi32(q, (qh >> (16 * h)) as __mmask16, q, _mm512_set1_epi32(16));
                    _mm512_permutex2var_ps(low, q, high)
                } else {
                    _mm512_permutexvar_ps(q, low)
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
                    // Without a fifth bit a quant is 0 to 15: the sub-block's 16 values, each by the
                    // portable operations, and every value is one lookup by its quant.
                    let table = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dd), quants(0.0)), _mm512_set1_ps(mm));
                    for part in 0..2 {
                        // SAFETY: 16 of the sub-block's 32 bytes, inside the block (asserted).
                        let q = unsafe { _mm_loadu_si128(qs.as_ptr().add(32 * j + 16 * part).cast()) };
                        let v =
                            if sub == 0 { _mm_and_si128(q, mask) } else { _mm_and_si128(_mm_srli_epi16::<4>(q), mask) };
                        let mut n = _mm512_cvtepu8_epi32(v);
                        if !five {
                            put(64 * j + sub + 16 * part, _mm512_permutexvar_ps(n, table));
                            continue;
                        }
                        // SAFETY: 16 of the 32 high-bit bytes (asserted block length).
                        let h = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(qh.as_ptr().add(16 * part).cast()) });
                        let set =
                            _mm512_and_si512(_mm512_srlv_epi32(h, _mm512_set1_epi32(bit as i32)), _mm512_set1_epi32(1));
                        n = _mm512_add_epi32(n, _mm512_slli_epi32::<4>(set));
                        let value =
                            _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dd), _mm512_cvtepi32_ps(n)), _mm512_set1_ps(mm));
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
                        put(128 * n + 32 * k + 16 * g, _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(n32)));
                    }
                }
            }
        }
        _ => unreachable!("a supported type"),
    }
}
