//! `fast` on matrices whose rows are interleaved sixteen at a time ([`Interleaved`]): the LM head (Q8_0,
//! the largest matrix of every model here) and the layers (Gemma 3's Q5_0, Q4_K and Q6_K, SmolLM2's
//! Q4_1).
//!
//! On the row-major blocks, each output's 8 lanes are a vector's worth of work for one weight row, so
//! every further activation row costs a conversion, a scale and a multiply-add per chunk and weight row
//! (the kernel that did this for a decode step, removed since, took about 4.6 vector operations per 32
//! weights and activation row). Here one 512-bit vector holds four columns of 16 weight rows, so an
//! activation row's four values, broadcast, meet 16 rows in one `vpdpbusd`: per chunk of 32 columns, 8
//! of them give the 16 rows' whole integer sums, and a conversion, a scale and one multiply-add (a second
//! for an offset) finish the chunk for all 16 (under one operation per 32 weights and activation row).
//! Unpacking a chunk is shared by every activation row of a pass.
//!
//! So the order is not the other layouts' ([`super`]): each output is
//! 1. per chunk ([`Chunk`]), `sum = isc[0] * sum((u[k] - o) * q[k]) + isc[1] * (the same over the last 16
//!    values)`, in 32-bit integers (exact, and exactly an f32: below `2^24`, at most `32 * 128 * 127`
//!    for Q8_0 and `2 * 16 * 32 * 127 * 128` for Q6_K);
//! 2. chunk after chunk, `acc = fma(d * xd, sum as f32, acc)` and `off = fma(m, xs, off)`, from zeros
//!    (`m = 0` for the types without an offset);
//! 3. the output is `acc + off`.
//!
//! Every kernel (portable, AVX2, AVX-512) computes exactly that for every row, whatever the batch, the
//! other rows or the thread, so the bits are the same everywhere.

use super::super::weight::{Interleaved, GROUP, Q4K_MINS, Q4K_SCALES, Q4K_VALUES, Q6K_HIGH, Q6K_LOW, Q6K_SCALES};
#[cfg(target_arch = "x86_64")]
use super::Kernel;
use super::{Acts, QK};
use crate::quant::GgmlType;

/// Activation rows per pass over a group's weights: each weight vector is loaded once for them all.
const PASS: usize = 4;

/// How far ahead of the group it reads a SIMD kernel asks for the weights' bytes, into L2 (groups and
/// their units lie in the order the kernels read them). The hardware's prefetchers alone left a decode
/// step waiting on its loads on a Sapphire Rapids VM: `bench kernels --threads 1`, Gemma 3 `fast`, the
/// whole pass of one row 19.8 -> 11.6-15.3 ms, of four rows 30.3 -> 14.8-18.9 (the head 19.0 ->
/// 9.5-12.4); the AVX2 kernel on the same CPU 27-28 -> 20-22 ms and 45-48 -> 34-35. 16 KiB ahead was
/// ahead of 8 and 4 KiB by less than the noise, 2 KiB behind. Into L2 (`prefetcht1`) rather than L1:
/// a real decode, whose weights come from memory (`bench kernels`' best pass finds them in L3), ran
/// 5-20% faster (Gemma 3 `fast`, `generate`, one thread 47-53 -> 52-56 tok/s, two 88-96 -> 95-99,
/// alternating; `bench model` one row 49-50 -> 61); into L1 the lines wait there, evicting ones not
/// yet read. `exact`'s row kernels, bound by their dequantization, gained nothing either way.
const AHEAD: usize = 16384;

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
    let halves = x.halves();
    let (g0, g1) = (rows.start / GROUP, rows.end / GROUP);
    for r0 in (0..t).step_by(PASS) {
        macro_rules! run {
            ($r:literal) => {{
                let acts: [Operands<'_>; $r] = std::array::from_fn(|i| {
                    let a = xq.act(r0 + i);
                    Operands { q: a.q, d: a.d, s: a.s, halves: &halves[(r0 + i) * chunks..(r0 + i + 1) * chunks] }
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

/// One activation row's operands: its values, and per chunk its scale, its sum (`d * sum(q)`) and the
/// integer sums of its halves.
#[derive(Clone, Copy)]
struct Operands<'a> {
    q: &'a [i8],
    d: &'a [f32],
    s: &'a [f32],
    halves: &'a [[i32; 2]],
}

/// Group `g`'s 16 outputs for each of the `R` activation rows, by the fastest kernel `x` runs.
#[inline]
fn group<const R: usize>(x: &Acts<'_>, m: &Interleaved, g: usize, acts: [Operands<'_>; R]) -> [[f32; GROUP]; R] {
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! by_type {
            ($kernel:ident) => {
                match m.layout.ty {
                    GgmlType::Q8_0 => $kernel::<R, 8>(m, g, acts),
                    GgmlType::Q4_0 => $kernel::<R, 2>(m, g, acts),
                    GgmlType::Q4_1 => $kernel::<R, 3>(m, g, acts),
                    GgmlType::Q5_0 => $kernel::<R, 6>(m, g, acts),
                    GgmlType::Q5_1 => $kernel::<R, 7>(m, g, acts),
                    GgmlType::Q4K => $kernel::<R, 12>(m, g, acts),
                    GgmlType::Q6K => $kernel::<R, 14>(m, g, acts),
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
    let (o, cpu) = (m.layout.offset(), m.layout.chunks_per_unit());
    for c in 0..m.cols / QK {
        let b = &m.bytes[m.at(g, c / cpu)..][..m.layout.unit_bytes()];
        for i in 0..GROUP {
            let ch = m.layout.chunk(b, i, c % cpu);
            for (r, a) in acts.iter().enumerate() {
                let q = &a.q[c * QK..(c + 1) * QK];
                let half = |h: usize| -> i32 {
                    (16 * h..16 * h + 16).map(|k| (i32::from(ch.u[k]) - o) * i32::from(q[k])).sum()
                };
                let sum = ch.isc[0] * half(0) + ch.isc[1] * half(1);
                acc[r][i] = (ch.d * a.d[c]).mul_add(sum as f32, acc[r][i]);
                if m.layout.has_offset() {
                    off[r][i] = ch.m.mul_add(a.s[c], off[r][i]);
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
        m.cols.is_multiple_of(m.layout.ty.block_elems())
            && m.at(g + 1, 0) <= m.bytes.len()
            && acts.iter().all(|a| {
                a.q.len() >= m.cols && a.d.len() >= chunks && a.s.len() >= chunks && a.halves.len() >= chunks
            }),
        "interleaved operands"
    );
    chunks
}

/// Asks for chunk `c` of group `g`'s share of its unit, [`AHEAD`] bytes on, into L2 (a hint: it reads nothing and
/// cannot fault, wherever that lands).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_ahead(m: &Interleaved, g: usize, c: usize) {
    let cpu = m.layout.chunks_per_unit();
    let step = m.layout.unit_bytes() / cpu;
    let at = m.at(g, c / cpu) + c % cpu * step + AHEAD;
    crate::quant::prefetch_lines(m.bytes.as_ptr().wrapping_add(at), step, crate::quant::Toward::L2);
}

/// Which of the kernels' cases the type with GGML id `T` takes.
#[cfg(target_arch = "x86_64")]
struct Form {
    /// Its unsigned values' offset.
    o: i32,
    /// Whether it has an offset `m` (negated for Q4_K, whose `m` is `-(dmin * min)`).
    offset: bool,
    /// Whether its chunks have integer scales (the K-quants), and one per half (Q6_K).
    scaled: bool,
    halves: bool,
    /// How many `maddubs` results the AVX2 kernel adds in 16 bits before one `madd` widens them: the
    /// most whose sum cannot pass `i16::MAX`, each pair at most `2 * max * 128` for values up to `max`
    /// (8 of 15, 4 of 31, 2 of 63; Q8_0's magnitudes, up to 128, fill a pair alone). An integer sum in
    /// any grouping is the same sum, so the bits do not change; the core does half the multiplies.
    run: usize,
}

#[cfg(target_arch = "x86_64")]
const fn form(t: u32) -> Form {
    match t {
        8 => Form { o: 128, offset: false, scaled: false, halves: false, run: 1 },
        2 => Form { o: 8, offset: false, scaled: false, halves: false, run: 8 },
        6 => Form { o: 16, offset: false, scaled: false, halves: false, run: 4 },
        3 => Form { o: 0, offset: true, scaled: false, halves: false, run: 8 },
        7 => Form { o: 0, offset: true, scaled: false, halves: false, run: 4 },
        12 => Form { o: 0, offset: true, scaled: true, halves: false, run: 8 },
        _ => Form { o: 32, offset: false, scaled: true, halves: true, run: 2 },
    }
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
    let f = const { form(T) };
    let (at, cpu) = (m.layout.values_at(), m.layout.chunks_per_unit());
    let (mut acc, mut off) = ([_mm512_setzero_ps(); R], [_mm512_setzero_ps(); R]);
    let (low, fifth, two) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x10), _mm512_set1_epi8(0x30));
    for c in 0..chunks {
        let cu = c % cpu;
        // SAFETY: the group's unit of chunk `c` lies in `m.bytes` (checked), and so does every row's
        // chunk `c` of its operands; unaligned loads.
        unsafe {
            let b = m.bytes.as_ptr().add(m.at(g, c / cpu));
            prefetch_ahead(m, g, c);
            let load = |at: usize| _mm512_loadu_si512(b.add(at).cast());
            // Sixteen bytes from `at` widened to 32 bits.
            let bytes16 = |at: usize| _mm_loadu_si128(b.add(at).cast());
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(b.cast()));
            let ms = if f.offset { _mm512_cvtph_ps(_mm256_loadu_si256(b.add(2 * GROUP).cast())) } else { d };
            // Q4_K's `dmin * min` (exact), subtracted below.
            let ms = if T == 12 {
                _mm512_mul_ps(ms, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes16(Q4K_MINS + cu * GROUP))))
            } else {
                ms
            };
            let u: [__m512i; QK / 4] = match T {
                8 => std::array::from_fn(|l| load(at + 64 * l)),
                12 => std::array::from_fn(|l| {
                    let v = load(Q4K_VALUES + 512 * (cu / 2) + 64 * l);
                    _mm512_and_si512(if cu % 2 == 0 { v } else { _mm512_srli_epi16::<4>(v) }, low)
                }),
                14 => std::array::from_fn(|l| {
                    let (n, k) = (cu / 4, cu % 4);
                    let v = load(Q6K_LOW + 512 * (2 * n + k % 2) + 64 * l);
                    let v = _mm512_and_si512(if k < 2 { v } else { _mm512_srli_epi16::<4>(v) }, low);
                    // Bits `2k, 2k + 1` of each byte to bits 4 and 5 (16-bit shifts: what crosses
                    // into a neighbouring byte is masked off).
                    let h = load(Q6K_HIGH + 512 * n + 64 * l);
                    let h = match k {
                        0 => _mm512_slli_epi16::<4>(h),
                        1 => _mm512_slli_epi16::<2>(h),
                        2 => h,
                        _ => _mm512_srli_epi16::<2>(h),
                    };
                    _mm512_or_si512(v, _mm512_and_si512(h, two))
                }),
                _ => {
                    let bytes: [__m512i; 4] = std::array::from_fn(|l| load(at + 64 * l));
                    std::array::from_fn(|l| {
                        let v = bytes[l % 4];
                        let v = _mm512_and_si512(if l < 4 { v } else { _mm512_srli_epi16::<4>(v) }, low);
                        if matches!(T, 6 | 7) {
                            let mask = b.add(at - 64 + 8 * l).cast::<u64>().read_unaligned();
                            _mm512_mask_add_epi8(v, u64::from_le(mask), v, fifth)
                        } else {
                            v
                        }
                    })
                }
            };
            // The integer scales: one per chunk (Q4_K), or per half (Q6_K, signed).
            let isc = match T {
                12 => [_mm512_cvtepu8_epi32(bytes16(Q4K_SCALES + cu * GROUP)); 2],
                14 => std::array::from_fn(|h| _mm512_cvtepi8_epi32(bytes16(Q6K_SCALES + (2 * cu + h) * GROUP))),
                _ => [_mm512_setzero_si512(); 2],
            };
            for (r, a) in acts.iter().enumerate() {
                let q = a.q.as_ptr().add(c * QK).cast::<i32>();
                let [h0, h1] = *a.halves.get_unchecked(c);
                let dp = |sum: __m512i, l: usize| {
                    _mm512_dpbusd_epi32(sum, u[l], _mm512_set1_epi32(q.add(l).read_unaligned()))
                };
                // Two chains of `vpdpbusd` per sum, not one of eight: integer sums in any order are the
                // same sum, and the core keeps twice as many in flight (`bench model`, SmolLM2 `fast`, four
                // rows: 251-300 -> 308-312 tok/s at one thread, 468-487 -> 536-565 at two).
                let zero = _mm512_setzero_si512();
                let sum = if f.halves {
                    let s0 = _mm512_add_epi32(
                        [0, 2].into_iter().fold(_mm512_set1_epi32(-f.o * h0), dp),
                        [1, 3].into_iter().fold(zero, dp),
                    );
                    let s1 = _mm512_add_epi32(
                        [4, 6].into_iter().fold(_mm512_set1_epi32(-f.o * h1), dp),
                        [5, 7].into_iter().fold(zero, dp),
                    );
                    _mm512_add_epi32(_mm512_mullo_epi32(s0, isc[0]), _mm512_mullo_epi32(s1, isc[1]))
                } else {
                    let s = _mm512_add_epi32(
                        [0, 2, 4, 6].into_iter().fold(_mm512_set1_epi32(-f.o * (h0 + h1)), dp),
                        [1, 3, 5, 7].into_iter().fold(zero, dp),
                    );
                    if f.scaled {
                        _mm512_mullo_epi32(s, isc[0])
                    } else {
                        s
                    }
                };
                let dd = _mm512_mul_ps(d, _mm512_set1_ps(*a.d.get_unchecked(c)));
                acc[r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(sum), acc[r]);
                let xs = _mm512_set1_ps(*a.s.get_unchecked(c));
                if T == 12 {
                    off[r] = _mm512_fnmadd_ps(ms, xs, off[r]);
                } else if f.offset {
                    off[r] = _mm512_fmadd_ps(ms, xs, off[r]);
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
/// of the unsigned values with the activations (at most 63, so no 16-bit pair can saturate), summed
/// [`Form::run`] at a time in 16 bits, then `madd` into 32 bits. Q8_0's values go in as magnitudes, the activations given their signs (at most
/// `2 * 128 * 127` a pair), from a bias of 0.
///
/// # Safety
///
/// AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2<const R: usize, const T: u32>(m: &Interleaved, g: usize, acts: [Operands<'_>; R]) -> [[f32; GROUP]; R] {
    use std::arch::x86_64::*;
    let chunks = check(m, g, &acts);
    let f = const { form(T) };
    let (at, cpu) = (m.layout.values_at(), m.layout.chunks_per_unit());
    let (flip, ones, low, fifth, two) = (
        _mm256_set1_epi8(-128),
        _mm256_set1_epi16(1),
        _mm256_set1_epi8(0x0F),
        _mm256_set1_epi8(0x10),
        _mm256_set1_epi8(0x30),
    );
    // Byte `j` of a vector takes bit `j % 8` of byte `j / 8` of a 32-bit mask.
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    );
    let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let zeros = [_mm256_setzero_ps(); R];
    // Chunk `c` of side `side` (eight of the group's rows) onto the sums `acc` and `off` of its rows.
    macro_rules! step {
        ($side:expr, $c:expr, $acc:ident, $off:ident) => {{
            let (side, c) = ($side, $c);
            let cu = c % cpu;
            // SAFETY: as in `avx512`: the unit's bytes and the rows' operands are in bounds (checked);
            // unaligned loads.
            unsafe {
                let b = m.bytes.as_ptr().add(m.at(g, c / cpu));
                // This side's eight rows of a 64-byte lane at `at`.
                let load = |at: usize| _mm256_loadu_si256(b.add(at + 32 * side).cast());
                // This side's eight bytes of a 16-row byte array at `at`, widened to 32 bits.
                let bytes8 = |at: usize| _mm_loadl_epi64(b.add(at + 8 * side).cast());
                let d = _mm256_cvtph_ps(_mm_loadu_si128(b.add(16 * side).cast()));
                let ms =
                    if f.offset { _mm256_cvtph_ps(_mm_loadu_si128(b.add(2 * GROUP + 16 * side).cast())) } else { d };
                let ms = if T == 12 {
                    _mm256_mul_ps(ms, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8(Q4K_MINS + cu * GROUP))))
                } else {
                    ms
                };
                let u: [__m256i; QK / 4] = match T {
                    8 => std::array::from_fn(|l| _mm256_xor_si256(load(at + 64 * l), flip)),
                    12 => std::array::from_fn(|l| {
                        let v = load(Q4K_VALUES + 512 * (cu / 2) + 64 * l);
                        _mm256_and_si256(if cu % 2 == 0 { v } else { _mm256_srli_epi16::<4>(v) }, low)
                    }),
                    14 => std::array::from_fn(|l| {
                        let (n, k) = (cu / 4, cu % 4);
                        let v = load(Q6K_LOW + 512 * (2 * n + k % 2) + 64 * l);
                        let v = _mm256_and_si256(if k < 2 { v } else { _mm256_srli_epi16::<4>(v) }, low);
                        let h = load(Q6K_HIGH + 512 * n + 64 * l);
                        let h = match k {
                            0 => _mm256_slli_epi16::<4>(h),
                            1 => _mm256_slli_epi16::<2>(h),
                            2 => h,
                            _ => _mm256_srli_epi16::<2>(h),
                        };
                        _mm256_or_si256(v, _mm256_and_si256(h, two))
                    }),
                    _ => {
                        let bytes: [__m256i; 4] = std::array::from_fn(|l| load(at + 64 * l));
                        std::array::from_fn(|l| {
                            let v = bytes[l % 4];
                            let v = _mm256_and_si256(if l < 4 { v } else { _mm256_srli_epi16::<4>(v) }, low);
                            if matches!(T, 6 | 7) {
                                // This side's 32 bits of lane `l`'s mask, one per byte.
                                let mask = b.add(at - 64 + 8 * l + 4 * side).cast::<i32>().read_unaligned();
                                let each = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(mask), spread), bits);
                                _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(each, bits), fifth))
                            } else {
                                v
                            }
                        })
                    }
                };
                let mag = if T == 8 { u.map(|v| _mm256_abs_epi8(v)) } else { u };
                let isc = match T {
                    12 => [_mm256_cvtepu8_epi32(bytes8(Q4K_SCALES + cu * GROUP)); 2],
                    14 => std::array::from_fn(|h| _mm256_cvtepi8_epi32(bytes8(Q6K_SCALES + (2 * cu + h) * GROUP))),
                    _ => [_mm256_setzero_si256(); 2],
                };
                for (r, a) in acts.iter().enumerate() {
                    let q = a.q.as_ptr().add(c * QK).cast::<i32>();
                    let [h0, h1] = *a.halves.get_unchecked(c);
                    // Lane `l`'s 16-bit pair sums.
                    macro_rules! pairs {
                        ($l:expr) => {{
                            let x = _mm256_set1_epi32(q.add($l).read_unaligned());
                            let x = if T == 8 { _mm256_sign_epi8(x, u[$l]) } else { x };
                            _mm256_maddubs_epi16(mag[$l], x)
                        }};
                    }
                    // Lanes `l..l + f.run` summed in 16 bits (a tree), then widened onto `sum` (a macro:
                    // a closure here was called, not inlined, and read `f.run` at run time).
                    macro_rules! dp {
                        ($sum:expr, $l:expr) => {{
                            let l = $l;
                            let t = match f.run {
                                1 => pairs!(l),
                                2 => _mm256_add_epi16(pairs!(l), pairs!(l + 1)),
                                4 => _mm256_add_epi16(
                                    _mm256_add_epi16(pairs!(l), pairs!(l + 1)),
                                    _mm256_add_epi16(pairs!(l + 2), pairs!(l + 3)),
                                ),
                                _ => _mm256_add_epi16(
                                    _mm256_add_epi16(
                                        _mm256_add_epi16(pairs!(l), pairs!(l + 1)),
                                        _mm256_add_epi16(pairs!(l + 2), pairs!(l + 3)),
                                    ),
                                    _mm256_add_epi16(
                                        _mm256_add_epi16(pairs!(l + 4), pairs!(l + 5)),
                                        _mm256_add_epi16(pairs!(l + 6), pairs!(l + 7)),
                                    ),
                                ),
                            };
                            _mm256_add_epi32($sum, _mm256_madd_epi16(t, ones))
                        }};
                    }
                    // Q8_0 multiplies signed values (its bias is 0); the others' unsigned ones start
                    // from theirs.
                    let o = if T == 8 { 0 } else { f.o };
                    let sum = if f.halves {
                        let s0 = (0..4 / f.run).fold(_mm256_set1_epi32(-o * h0), |s, i| dp!(s, i * f.run));
                        let s1 = (0..4 / f.run).fold(_mm256_set1_epi32(-o * h1), |s, i| dp!(s, 4 + i * f.run));
                        _mm256_add_epi32(_mm256_mullo_epi32(s0, isc[0]), _mm256_mullo_epi32(s1, isc[1]))
                    } else {
                        let s = (0..8 / f.run).fold(_mm256_set1_epi32(-o * (h0 + h1)), |s, i| dp!(s, i * f.run));
                        if f.scaled {
                            _mm256_mullo_epi32(s, isc[0])
                        } else {
                            s
                        }
                    };
                    let dd = _mm256_mul_ps(d, _mm256_set1_ps(*a.d.get_unchecked(c)));
                    $acc[r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sum), $acc[r]);
                    let xs = _mm256_set1_ps(*a.s.get_unchecked(c));
                    if T == 12 {
                        $off[r] = _mm256_fnmadd_ps(ms, xs, $off[r]);
                    } else if f.offset {
                        $off[r] = _mm256_fmadd_ps(ms, xs, $off[r]);
                    }
                }
            }
        }};
    }
    // Row sums `acc + off` of side `side` into `out`.
    let mut out = [[0f32; GROUP]; R];
    let mut put = |side: usize, acc: [__m256; R], off: [__m256; R]| {
        for (out, (acc, off)) in out.iter_mut().zip(acc.iter().zip(&off)) {
            // SAFETY: 8 floats of 16 from `8 * side`; unaligned store.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * side), _mm256_add_ps(*acc, *off)) };
        }
    };
    if R > 2 {
        // One side over every chunk, then the other: each line is read twice, the second time from L1 or
        // L2 (a group is a few KiB), but the `2 * R` sums of a pass stay in registers. Both sides at once
        // spilled them: `bench kernels --threads 1 --batch 4`, `fast`, on a Zen 3, the best of five runs,
        // Gemma 3's layers 11.2 -> 10.9 ms and head 20.8 -> 19.6, SmolLM2's layers 10.0 -> 9.1. With
        // one or two rows, which have the registers, this order was slower (one row: Gemma 3's head
        // 8.6 -> 11.1 ms).
        for side in 0..2 {
            let (mut acc, mut off) = (zeros, zeros);
            for c in 0..chunks {
                if side == 0 {
                    prefetch_ahead(m, g, c);
                }
                step!(side, c, acc, off);
            }
            put(side, acc, off);
        }
    } else {
        let (mut acc0, mut off0, mut acc1, mut off1) = (zeros, zeros, zeros, zeros);
        for c in 0..chunks {
            prefetch_ahead(m, g, c);
            step!(0, c, acc0, off0);
            step!(1, c, acc1, off1);
        }
        put(0, acc0, off0);
        put(1, acc1, off1);
    }
    out
}
