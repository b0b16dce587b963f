//! `fast` on matrices of the 32-value block types whose rows are interleaved sixteen at a time
//! ([`Interleaved`]): the LM head (Q8_0, the largest matrix of every model here) and the layers of those
//! types (Gemma 3's Q5_0, SmolLM2's Q4_1).
//!
//! On the row-major blocks, each output's 8 lanes are a vector's worth of work for one weight row, so
//! every further activation row costs a conversion, a scale and a multiply-add per chunk and weight row
//! (the kernel that did this for a decode step, removed since, took about 4.6 vector operations per 32
//! weights and activation row). Here one 512-bit
//! vector holds four columns of 16 weight rows, so an activation row's four values, broadcast, meet 16
//! rows in one `vpdpbusd`: per chunk of 32 columns, 8 of them give the 16 rows' whole integer sums,
//! and a conversion, a scale and one multiply-add (a second for an offset) finish the chunk for all 16
//! (under one operation per 32 weights and activation row). Unpacking a chunk is shared by every
//! activation row of a pass.
//!
//! So the order is not the other layouts' ([`super`]): each output is
//! 1. per chunk, `sum((u[k] - o) * q[k])` over its 32 values, in 32-bit integers (exact, at most
//!    `32 * 128 * 127`, and exactly an f32 below `2^24`);
//! 2. chunk after chunk, `acc = fma(d * xd, sum as f32, acc)` and `off = fma(m, xs, off)`, from zeros
//!    (`m = 0` for the types without an offset);
//! 3. the output is `acc + off`.
//!
//! Every kernel (portable, AVX2, AVX-512) computes exactly that for every row, whatever the batch, the
//! other rows or the thread, so the bits are the same everywhere.

use super::super::weight::{Interleaved, GROUP};
#[cfg(target_arch = "x86_64")]
use super::Kernel;
use super::{Acts, QK};
use crate::quant::{f16_at, GgmlType};

/// Activation rows per pass over a group's weights: each weight vector is loaded once for them all.
const PASS: usize = 4;

/// `out[i][j] = x[i] . m[rows.start + j]` for every activation row of `x` and the weight rows `rows`
/// (whole groups of [`GROUP`]) of `m`, into `out` (`x.rows x rows.len()`).
pub(crate) fn dots(x: &Acts<'_>, m: &Interleaved, rows: std::ops::Range<usize>, out: &mut [f32]) {
    let xq = x.q8;
    let (n, t, width) = (xq.cols, xq.rows, rows.len());
    assert!(
        n == m.cols
            && rows.start.is_multiple_of(GROUP)
            && width.is_multiple_of(GROUP)
            && rows.end <= m.rows
            && out.len() == t * width,
        "interleaved dots shapes"
    );
    let chunks = n / QK;
    // Each activation row's `-o * sum(q)` per chunk: where the unsigned weights `u = v + o` meet the
    // activations, the integer sums start from it, so they come out as `sum(v * q)`.
    let o = m.offset();
    let bias: Vec<i32> = (0..t)
        .flat_map(|r| xq.act(r).q.chunks_exact(QK).map(|c| -o * c.iter().map(|&q| i32::from(q)).sum::<i32>()))
        .collect();
    let (g0, g1) = (rows.start / GROUP, rows.end / GROUP);
    for r0 in (0..t).step_by(PASS) {
        macro_rules! run {
            ($r:literal) => {{
                let acts: [Operands<'_>; $r] = std::array::from_fn(|i| {
                    let a = xq.act(r0 + i);
                    Operands { q: a.q, d: a.d, s: a.s, bias: &bias[(r0 + i) * chunks..(r0 + i + 1) * chunks] }
                });
                for g in g0..g1 {
                    let res = group(x, m, g, acts);
                    for (i, res) in res.iter().enumerate() {
                        let at = (r0 + i) * width + (g - g0) * GROUP;
                        out[at..at + GROUP].copy_from_slice(res);
                    }
                }
            }};
        }
        match t - r0 {
            1 => run!(1),
            2 => run!(2),
            3 => run!(3),
            _ => run!(4),
        }
    }
}

/// One activation row's operands: its values, per chunk its scale, its sum and its bias.
#[derive(Clone, Copy)]
struct Operands<'a> {
    q: &'a [i8],
    d: &'a [f32],
    s: &'a [f32],
    bias: &'a [i32],
}

/// Group `g`'s 16 outputs for each of the `R` activation rows, by the fastest kernel `x` runs.
#[inline]
fn group<const R: usize>(x: &Acts<'_>, m: &Interleaved, g: usize, acts: [Operands<'_>; R]) -> [[f32; GROUP]; R] {
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! by_type {
            ($kernel:ident) => {
                match m.ty {
                    GgmlType::Q8_0 => $kernel::<R, 8>(m, g, acts),
                    GgmlType::Q4_0 => $kernel::<R, 2>(m, g, acts),
                    GgmlType::Q4_1 => $kernel::<R, 3>(m, g, acts),
                    GgmlType::Q5_0 => $kernel::<R, 6>(m, g, acts),
                    GgmlType::Q5_1 => $kernel::<R, 7>(m, g, acts),
                    _ => unreachable!("an interleaved type"),
                }
            };
        }
        if x.wide {
            // SAFETY: `x.wide` is set only where `Kernel::best` chose AVX-512 (AVX-512F, BW and VNNI, with
            // AVX2, FMA and F16C); `g` is a group of `m` (checked by `dots`) and every row's operands cover
            // `m.cols` values.
            return unsafe { by_type!(avx512) };
        }
        if x.kernel != Kernel::Portable {
            // SAFETY: every kernel but the portable one is chosen only where AVX2, FMA and F16C are
            // present; as above.
            return unsafe { by_type!(avx2) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
    portable(m, g, acts)
}

/// The definition (see the module's).
fn portable<const R: usize>(m: &Interleaved, g: usize, acts: [Operands<'_>; R]) -> [[f32; GROUP]; R] {
    let (mut acc, mut off) = ([[0f32; GROUP]; R], [[0f32; GROUP]; R]);
    let o = m.offset();
    for c in 0..m.cols / QK {
        let b = &m.bytes[m.at(g, c)..][..m.chunk_bytes()];
        for (r, a) in acts.iter().enumerate() {
            let q = &a.q[c * QK..(c + 1) * QK];
            for i in 0..GROUP {
                let sum: i32 = (0..QK).map(|k| (m.value(b, i, k) - o) * i32::from(q[k])).sum();
                acc[r][i] = (f16_at(b, 2 * i) * a.d[c]).mul_add(sum as f32, acc[r][i]);
                if m.has_offset() {
                    off[r][i] = f16_at(b, 2 * GROUP + 2 * i).mul_add(a.s[c], off[r][i]);
                }
            }
        }
    }
    std::array::from_fn(|r| std::array::from_fn(|i| acc[r][i] + off[r][i]))
}

/// Asserts what the SIMD kernels read of `m` and the operands; the chunks of a row.
#[cfg(target_arch = "x86_64")]
fn check<const R: usize>(m: &Interleaved, g: usize, acts: &[Operands<'_>; R]) -> usize {
    let chunks = m.cols / QK;
    assert!(
        m.at(g, chunks) <= m.bytes.len()
            && acts.iter().all(|a| {
                a.q.len() >= m.cols && a.d.len() >= chunks && a.s.len() >= chunks && a.bias.len() >= chunks
            }),
        "interleaved operands"
    );
    chunks
}

/// [`portable`] with AVX-512 for the type with GGML id `T`: per chunk, the group's 8 vectors of
/// unsigned values are unpacked once for the `R` activation rows, and each row's four values of a lane
/// go in broadcast.
///
/// # Safety
///
/// AVX-512F, BW and VNNI, AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn avx512<const R: usize, const T: u32>(
    m: &Interleaved,
    g: usize,
    acts: [Operands<'_>; R],
) -> [[f32; GROUP]; R] {
    use std::arch::x86_64::*;
    let chunks = check(m, g, &acts);
    let (offset, at) = (matches!(T, 3 | 7), m.values_at());
    let (mut acc, mut off) = ([_mm512_setzero_ps(); R], [_mm512_setzero_ps(); R]);
    let (low, fifth) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x10));
    for c in 0..chunks {
        // SAFETY: the chunk's bytes lie in `m.bytes` (checked), and so does every row's chunk `c` of
        // its operands; unaligned loads.
        unsafe {
            let block = m.bytes.as_ptr().add(m.at(g, c));
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(block.cast()));
            let ms = if offset { _mm512_cvtph_ps(_mm256_loadu_si256(block.add(2 * GROUP).cast())) } else { d };
            let vals = block.add(at);
            let u: [__m512i; QK / 4] = if T == 8 {
                std::array::from_fn(|l| _mm512_loadu_si512(vals.add(64 * l).cast()))
            } else {
                let bytes: [__m512i; 4] = std::array::from_fn(|l| _mm512_loadu_si512(vals.add(64 * l).cast()));
                std::array::from_fn(|l| {
                    let b = bytes[l % 4];
                    let u = _mm512_and_si512(if l < 4 { b } else { _mm512_srli_epi16::<4>(b) }, low);
                    if matches!(T, 6 | 7) {
                        let mask = vals.sub(64).add(8 * l).cast::<u64>().read_unaligned();
                        _mm512_mask_add_epi8(u, u64::from_le(mask), u, fifth)
                    } else {
                        u
                    }
                })
            };
            for (r, a) in acts.iter().enumerate() {
                let q = a.q.as_ptr().add(c * QK).cast::<i32>();
                let mut sum = _mm512_set1_epi32(*a.bias.get_unchecked(c));
                for (l, u) in u.iter().enumerate() {
                    sum = _mm512_dpbusd_epi32(sum, *u, _mm512_set1_epi32(q.add(l).read_unaligned()));
                }
                let dd = _mm512_mul_ps(d, _mm512_set1_ps(*a.d.get_unchecked(c)));
                acc[r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(sum), acc[r]);
                if offset {
                    off[r] = _mm512_fmadd_ps(ms, _mm512_set1_ps(*a.s.get_unchecked(c)), off[r]);
                }
            }
        }
    }
    std::array::from_fn(|r| {
        let mut out = [0f32; GROUP];
        // SAFETY: 16 floats; unaligned store.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), _mm512_add_ps(acc[r], off[r])) };
        out
    })
}

/// [`portable`] with AVX2 for the type with GGML id `T`, eight rows of the group per vector: `maddubs`
/// of the unsigned values with the activations (at most 31 for the 4- and 5-bit types, so no 16-bit pair
/// can saturate), then `madd` into 32 bits. Q8_0's values go in as magnitudes, the activations given
/// their signs (at most `2 * 128 * 127` a pair), from a bias of 0.
///
/// # Safety
///
/// AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2<const R: usize, const T: u32>(m: &Interleaved, g: usize, acts: [Operands<'_>; R]) -> [[f32; GROUP]; R] {
    use std::arch::x86_64::*;
    let chunks = check(m, g, &acts);
    let (offset, at) = (matches!(T, 3 | 7), m.values_at());
    let (mut acc, mut off) = ([[_mm256_setzero_ps(); 2]; R], [[_mm256_setzero_ps(); 2]; R]);
    let (flip, ones, low, fifth) =
        (_mm256_set1_epi8(-128), _mm256_set1_epi16(1), _mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x10));
    // Byte `j` of a vector takes bit `j % 8` of byte `j / 8` of a 32-bit mask.
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    );
    let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    for c in 0..chunks {
        for h in 0..2 {
            // SAFETY: as in `avx512`: the chunk's bytes and the rows' operands are in bounds (checked);
            // unaligned loads.
            unsafe {
                let block = m.bytes.as_ptr().add(m.at(g, c));
                let d = _mm256_cvtph_ps(_mm_loadu_si128(block.add(16 * h).cast()));
                let ms =
                    if offset { _mm256_cvtph_ps(_mm_loadu_si128(block.add(2 * GROUP + 16 * h).cast())) } else { d };
                let vals = block.add(at + 32 * h);
                let u: [__m256i; QK / 4] = if T == 8 {
                    std::array::from_fn(|l| _mm256_xor_si256(_mm256_loadu_si256(vals.add(64 * l).cast()), flip))
                } else {
                    let bytes: [__m256i; 4] = std::array::from_fn(|l| _mm256_loadu_si256(vals.add(64 * l).cast()));
                    std::array::from_fn(|l| {
                        let b = bytes[l % 4];
                        let u = _mm256_and_si256(if l < 4 { b } else { _mm256_srli_epi16::<4>(b) }, low);
                        if matches!(T, 6 | 7) {
                            // This half's 32 bits of lane `l`'s mask, one per byte.
                            let mask = block.add(at - 64 + 8 * l + 4 * h).cast::<i32>().read_unaligned();
                            let each = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(mask), spread), bits);
                            let set = _mm256_cmpeq_epi8(each, bits);
                            _mm256_or_si256(u, _mm256_and_si256(set, fifth))
                        } else {
                            u
                        }
                    })
                };
                let mag = if T == 8 { u.map(|v| _mm256_abs_epi8(v)) } else { u };
                for (r, a) in acts.iter().enumerate() {
                    let q = a.q.as_ptr().add(c * QK).cast::<i32>();
                    let mut sum =
                        if T == 8 { _mm256_setzero_si256() } else { _mm256_set1_epi32(*a.bias.get_unchecked(c)) };
                    for l in 0..QK / 4 {
                        let x = _mm256_set1_epi32(q.add(l).read_unaligned());
                        let x = if T == 8 { _mm256_sign_epi8(x, u[l]) } else { x };
                        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(mag[l], x), ones));
                    }
                    let dd = _mm256_mul_ps(d, _mm256_set1_ps(*a.d.get_unchecked(c)));
                    acc[r][h] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sum), acc[r][h]);
                    if offset {
                        off[r][h] = _mm256_fmadd_ps(ms, _mm256_set1_ps(*a.s.get_unchecked(c)), off[r][h]);
                    }
                }
            }
        }
    }
    std::array::from_fn(|r| {
        let mut out = [0f32; GROUP];
        // SAFETY: 8 floats each; unaligned stores.
        unsafe {
            _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(acc[r][0], off[r][0]));
            _mm256_storeu_ps(out.as_mut_ptr().add(8), _mm256_add_ps(acc[r][1], off[r][1]));
        }
        out
    })
}
