//! AVX2 twins of the portable dequantizer for the block types, value for value the same: every value is
//! the same operations on the same operands (a product and a sum are never fused), eight at a time. Each
//! block hands its vectors, in increasing position, to a consumer: a store ([`dequantize`]) or the
//! multiply-adds of a dot product ([`dot_rows`]), which then never round-trips the weights through memory.

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
/// their latency. The callers pass `H = 4 / R` (at least 1; 2 for one row of Q4_1): `2 * H * R`
/// accumulators of the 16 vector registers. One instance for every type, matching it at every block and reading one
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
fn rows_of<const R: usize, const T: u32, const H: usize>(x: [&[f32]; R], ws: &[u8], n: usize, out: &mut [[f32; R]]) {
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
        GgmlType::Q4_0 => q4_0(b, put),
        GgmlType::Q4_1 => q4_1(b, put),
        GgmlType::Q5_0 => q5_0(b, put),
        GgmlType::Q5_1 => q5_1(b, put),
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

/// The two f16s at `b[at..at + 4]` in lanes 0 and 1, widened by the CPU (as [`f16_at`], whose note
/// on the instructions holds here too).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_pair_at(b: &[u8], at: usize) -> __m128 {
    let bits = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let value: __m128;
    // SAFETY: F16C is enabled in every caller; the instructions touch only the two named registers.
    unsafe {
        std::arch::asm!(
            "vmovd {v}, {bits:e}",
            "vcvtph2ps {v}, {v}",
            bits = in(reg) bits,
            v = out(xmm_reg) value,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    value
}

/// `y = d * q`. (Its bytes are widened across lanes, each from memory: in-lane shuffles of the block
/// loaded into both halves of a register, as [`q5_0`] does, made Gemma 3's Q8_0 head 14% slower on a
/// Zen 3.)
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

/// Q4_0 (`y = d * (q - 8)`): 16 bytes of nibbles from byte 2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4_0(b: &[u8], put: &mut impl FnMut(usize, __m256)) {
    assert!(b.len() >= 18);
    // SAFETY: bytes 2..18 lie in the block (asserted).
    let qs = unsafe { _mm_loadu_si128(b.as_ptr().add(2).cast()) };
    let mask = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(qs, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), mask);
    small_values(b, put, [lo, hi], None, 8);
}

/// Q4_1 (`y = d * q + m`), as [`q4_0`] but with fewer instructions (what bounds `exact` at one
/// row): `d` and `m` widened together, and the nibbles placed in 32-bit lanes by an in-lane byte shuffle
/// of the block's 16 bytes, loaded into both halves, where [`q4_0`] widens them across lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4_1(b: &[u8], put: &mut impl FnMut(usize, __m256)) {
    assert!(b.len() >= 20);
    let dm = f16_pair_at(b, 0);
    let d = _mm256_broadcastss_ps(dm);
    let m = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dm), _mm256_set1_epi32(1));
    let qs = both_halves(b, 4);
    let mask = _mm256_set1_epi8(0x0F);
    let (lo, hi) = (_mm256_and_si256(qs, mask), _mm256_and_si256(_mm256_srli_epi16::<4>(qs), mask));
    // Written out, not a loop over the four: each call's position must be a constant (see `group`).
    let value = |v: __m256i| _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(v)), m);
    put(0, value(lows(lo, 0)));
    put(8, value(lows(lo, 8)));
    put(16, value(lows(hi, 0)));
    put(24, value(lows(hi, 8)));
}

/// Bytes `at..at + 8` of each 16-byte half, one into the top byte of each 32-bit lane (the others zero):
/// the lane is the byte's signed value times 2^24, exactly, which [`scaled`] multiplies by `d * 2^-24`.
/// With a half's 16 bytes in both halves of a register, `at` 0 gives values 0..8 of the 16, `at` 8
/// values 8..16: an in-lane shuffle, one instruction, where a widening across lanes costs more (the
/// Zen 3's `exact` at one row is bound by such instructions).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn tops(v: __m256i, at: i8) -> __m256i {
    #[rustfmt::skip]
    let mask = _mm256_setr_epi8(
        -1, -1, -1, at, -1, -1, -1, at + 1, -1, -1, -1, at + 2, -1, -1, -1, at + 3,
        -1, -1, -1, at + 4, -1, -1, -1, at + 5, -1, -1, -1, at + 6, -1, -1, -1, at + 7,
    );
    _mm256_shuffle_epi8(v, mask)
}

/// As [`tops`], but each byte into the low byte of its lane: the lane is the byte's unsigned value.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn lows(v: __m256i, at: i8) -> __m256i {
    #[rustfmt::skip]
    let mask = _mm256_setr_epi8(
        at, -1, -1, -1, at + 1, -1, -1, -1, at + 2, -1, -1, -1, at + 3, -1, -1, -1,
        at + 4, -1, -1, -1, at + 5, -1, -1, -1, at + 6, -1, -1, -1, at + 7, -1, -1, -1,
    );
    _mm256_shuffle_epi8(v, mask)
}

/// Bytes `at..at + 16` of `b` (a panic where `b` is shorter) in both 128-bit halves of a register, for
/// [`lows`] and [`tops`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn both_halves(b: &[u8], at: usize) -> __m256i {
    let b = &b[at..at + 16];
    // SAFETY: the 16 bytes of `b`.
    _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(b.as_ptr().cast()) })
}

/// `v`'s 128-bit half `H` in both halves.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn both<const H: i32>(v: __m256i) -> __m256i {
    _mm256_permute2x128_si256::<H>(v, v)
}

/// `d * q` for lanes that hold `q * 2^24` ([`tops`]), given `d24 = d * 2^-24` (exact: a power of two,
/// and no f16 scale comes near f32's smallest normal): the same real product as `d * q`, so the same
/// rounding, the same bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scaled(d24: __m256, v: __m256i) -> __m256 {
    _mm256_mul_ps(d24, _mm256_cvtepi32_ps(v))
}

/// 2^-24, which takes a scale to [`scaled`]'s.
const TOP_SCALE: f32 = 1.0 / 16_777_216.0;

/// Q5_0 (`y = d * (q - 16)`): the fifth bits in the 32-bit word at byte 2, nibbles from byte 6; the
/// values 0..32 put in 32-bit lanes by in-lane shuffles ([`tops`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q5_0(b: &[u8], put: &mut impl FnMut(usize, __m256)) {
    assert!(b.len() >= 22);
    let d24 = _mm256_set1_ps(f16_at(b, 0) * TOP_SCALE);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = both_halves(b, 6);
    let mask = _mm256_set1_epi8(0x0F);
    // Byte `k` of each half: 16 where bit `k` (values 0..16) or bit `16 + k` (values 16..32) of `qh` is set.
    let bits = _mm256_set1_epi32(qh as i32);
    #[rustfmt::skip]
    let spread = |lo: i8| _mm256_setr_epi8(
        lo, lo, lo, lo, lo, lo, lo, lo, lo + 1, lo + 1, lo + 1, lo + 1, lo + 1, lo + 1, lo + 1, lo + 1,
        lo, lo, lo, lo, lo, lo, lo, lo, lo + 1, lo + 1, lo + 1, lo + 1, lo + 1, lo + 1, lo + 1, lo + 1,
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    let sixteens = |lo: i8| {
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(bits, spread(lo)), bit), bit);
        _mm256_and_si256(set, _mm256_set1_epi8(16))
    };
    let (s_lo, s_hi) = (sixteens(0), sixteens(2));
    let sixteen = _mm256_set1_epi8(16);
    let lo = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(qs, mask), s_lo), sixteen);
    let hi = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(qs), mask), s_hi), sixteen);
    // Written out: each call's position must be a constant (see `group`).
    put(0, scaled(d24, tops(lo, 0)));
    put(8, scaled(d24, tops(lo, 8)));
    put(16, scaled(d24, tops(hi, 0)));
    put(24, scaled(d24, tops(hi, 8)));
}

/// Q5_1 (`y = d * q + m`): the fifth bits in the 32-bit word at byte 4, nibbles from byte 8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q5_1(b: &[u8], put: &mut impl FnMut(usize, __m256)) {
    assert!(b.len() >= 24);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    // SAFETY: bytes 8..24 lie in the block (asserted).
    let qs = unsafe { _mm_loadu_si128(b.as_ptr().add(8).cast()) };
    let mask = _mm_set1_epi8(0x0F);
    let lo = _mm_or_si128(_mm_and_si128(qs, mask), sixteens(qh as u16));
    let hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16::<4>(qs), mask), sixteens((qh >> 16) as u16));
    small_values(b, put, [lo, hi], Some(f16_at(b, 2)), 16);
}

/// The 32 values of a Q4_0 or Q5_1 block (scale `d` at byte 0), given as unsigned bytes
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

/// Q4_K (`y = d * sc * q - dmin * m` per 32-value sub-block) and Q5_K (the same with a fifth bit):
/// each 16 bytes of nibbles (and of fifth bits) loaded into both halves of a register, and every value
/// put in its 32-bit lane by an in-lane shuffle ([`lows`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4_k(b: &[u8], put: &mut impl FnMut(usize, __m256), five: bool) {
    assert!(b.len() >= if five { 176 } else { 144 });
    let (qh, qs) = if five { (&b[16..48], &b[48..176]) } else { (&b[0..0], &b[16..144]) };
    let mask = _mm256_set1_epi8(0x0F);
    // `super::k_scales`'s products, with the block's two f16s widened once by the CPU (the portable
    // widening, eight times a block, made Q4_K the slowest type by half).
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = |sub: usize| {
        let (sc, m) = super::scale_min_k4_int(sub, &b[4..16]);
        (d * f32::from(sc), dmin * f32::from(m))
    };
    // Q5_K's fifth bits of values 16p .. 16p + 16 of every sub-block, bit `s` for sub-block `s`.
    let high = if five { [both_halves(qh, 0), both_halves(qh, 16)] } else { [_mm256_setzero_si256(); 2] };
    for j in 0..4 {
        let [(d1, min1), (d2, min2)] = [scales(2 * j), scales(2 * j + 1)];
        let q = [both_halves(qs, 32 * j), both_halves(qs, 32 * j + 16)];
        // The low nibbles are values 64j .. 64j + 32, the high ones the next 32.
        for (sub, dd, mm, bit) in [(0, d1, min1, 2 * j), (32, d2, min2, 2 * j + 1)] {
            let (dd, mm) = (_mm256_set1_ps(dd), _mm256_set1_ps(mm));
            for (part, q) in q.iter().enumerate() {
                let mut v = if sub == 0 {
                    _mm256_and_si256(*q, mask)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16::<4>(*q), mask)
                };
                if five {
                    // 16 where the value's fifth bit is set: `q + 16`, as the portable `q + 16 * bit`.
                    let bit = _mm256_set1_epi8((1u8 << bit) as i8);
                    let set = _mm256_cmpeq_epi8(_mm256_and_si256(high[part], bit), bit);
                    v = _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(16)));
                }
                let value = |n: __m256i| _mm256_sub_ps(_mm256_mul_ps(dd, _mm256_cvtepi32_ps(n)), mm);
                put(64 * j + sub + 16 * part, value(lows(v, 0)));
                put(64 * j + sub + 16 * part + 8, value(lows(v, 8)));
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
            // Signed bytes (`q - 32`), each 16-byte half in both halves of a register for `tops`.
            let q = _mm256_sub_epi8(q, _mm256_set1_epi8(32));
            let halves = [both::<0x00>(q), both::<0x11>(q)];
            for (h, half) in halves.into_iter().enumerate() {
                let scale = _mm256_set1_ps(d * f32::from(sc[8 * n + h + 2 * k] as i8) * TOP_SCALE);
                put(128 * n + 32 * k + 16 * h, scaled(scale, tops(half, 0)));
                put(128 * n + 32 * k + 16 * h + 8, scaled(scale, tops(half, 8)));
            }
        }
    }
}
