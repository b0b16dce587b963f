//! The AVX2 kernels: the row kernel for up to four activation rows (with AVX-VNNI where the CPU has it)
//! and the tiled one for prefill on 256-bit CPUs.

use std::arch::x86_64::*;

use super::{Act, GgmlType, QK};
use crate::quant::scale_min_k4_int;

pub(super) use crate::quant::avx2::available;
use crate::quant::avx2::f16_at as f16;

/// Whether this CPU has AVX-VNNI (`vpdpbusd` on 256-bit vectors).
pub(super) fn vnni() -> bool {
    std::arch::is_x86_feature_detected!("avxvnni")
}

/// Whether this CPU has AVX512-VNNI with VL (`vpdpbusd` on 256-bit vectors, EVEX-encoded), and the
/// AVX-512F those kernels are compiled for (each CPUID bit is reported on its own: a VM may mask one).
pub(super) fn vnni_vl() -> bool {
    std::arch::is_x86_feature_detected!("avx512vnni")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512f")
}

/// [`super::rows_portable`] with AVX2, the same bits.
///
/// # Safety
///
/// [`available`]; `ty` is [`super::supports`]ed, `w` holds `out.len()` rows of `n` values as whole
/// blocks, and every `x[r]` holds `n` values. With more than one row, `group` is their group's
/// interleaved operands.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows<const R: usize>(
    ty: GgmlType,
    x: [Act<'_>; R],
    group: super::Group<'_>,
    w: &[u8],
    n: usize,
    out: &mut [[f32; R]],
) {
    crate::quant::by_block_type!(ty, T => rows_of::<R, T>(x, group, w, n, out))
}

/// [`rows`] with AVX-VNNI, the same bits.
///
/// # Safety
///
/// As [`rows`], and [`vnni`].
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(super) unsafe fn rows_vnni<const R: usize>(
    ty: GgmlType,
    x: [Act<'_>; R],
    group: super::Group<'_>,
    w: &[u8],
    n: usize,
    out: &mut [[f32; R]],
) {
    crate::quant::by_block_type!(ty, T => rows_of_vnni::<R, T>(x, group, w, n, out))
}

/// [`rows`] with AVX512-VNNI's 256-bit `vpdpbusd`, the same bits.
///
/// # Safety
///
/// As [`rows`], and [`vnni_vl`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub(super) unsafe fn rows_vnni_vl<const R: usize>(
    ty: GgmlType,
    x: [Act<'_>; R],
    group: super::Group<'_>,
    w: &[u8],
    n: usize,
    out: &mut [[f32; R]],
) {
    crate::quant::by_block_type!(ty, T => rows_of_vnni_vl::<R, T>(x, group, w, n, out))
}

/// Defines the row kernel for the type with GGML id `T` with the given target features; with `vnni`
/// the 32-value types' lanes are one `vpdpbusd`, the intrinsic `$dp` (the same exact integer sums as
/// `maddubs` then `madd`, which never saturate here).
macro_rules! rows_of {
    ($name:ident, $features:literal, $vnni:literal, $dp:ident) => {
        #[inline]
        #[target_feature(enable = $features)]
        fn $name<const R: usize, const T: u32>(
            x: [Act<'_>; R],
            group: super::Group<'_>,
            w: &[u8],
            n: usize,
            out: &mut [[f32; R]],
        ) {
            let ty = GgmlType::from_id(T).expect("a GGML type id");
            let (be, bb) = (ty.block_elems(), ty.block_bytes());
            let (per, blocks) = (be / QK, n / be);
            let chunks = n / QK;
            // Several rows read their scales and sums interleaved (`super::Group`).
            let grouped = R > 1;
            let offset = super::has_offset(ty);
            assert!(
                n % be == 0
                    && w.len() >= out.len() * blocks * bb
                    && x.iter().all(|x| x.q.len() >= n && x.d.len() >= chunks && x.s.len() >= chunks)
                    && R <= super::ROWS
                    && (!grouped
                        || (group.sums.len() >= chunks * super::ROWS
                            && group.scales.len() >= 8 * chunks * super::ROWS)),
                "rows operands"
            );
            // Values 0..=63 are unsigned bytes for `maddubs`; signed ones go through `|v| * sign(q, v)`.
            let signed = matches!(T, 8 | 2 | 6 | 14);
            // The K-quants scale each 16 values by an integer of their own.
            let scaled = matches!(T, 12..=14);
            let ones = _mm256_set1_epi16(1);
            for (j, (res, wr)) in out.iter_mut().zip(w.chunks_exact(blocks * bb)).enumerate() {
                let mut acc = [_mm256_setzero_ps(); R];
                let mut off = [0f32; R];
                let mut off_lanes = _mm_setzero_ps();
                for (i, b) in wr.chunks_exact(bb).enumerate() {
                    crate::quant::prefetch(w.as_ptr(), (j * blocks + i) * bb, bb);
                    unpack::<T>(b, &mut |c, v, isc, d, m| {
                        let xi = i * per + c;
                        let isc = if scaled {
                            _mm256_set_m128i(_mm_set1_epi16(isc[1]), _mm_set1_epi16(isc[0]))
                        } else {
                            ones
                        };
                        let vabs = if signed { _mm256_sign_epi8(v, v) } else { v };
                        let dv = _mm256_set1_ps(d);
                        for r in 0..R {
                            // SAFETY: chunk xi < n / 32 of a row of n values (asserted above); unaligned
                            // load.
                            let q = unsafe { _mm256_loadu_si256(x[r].q.as_ptr().add(xi * QK).cast()) };
                            let q = if signed { _mm256_sign_epi8(q, v) } else { q };
                            // The `unsafe` is needed only where AVX-VNNI is not enabled (never run there).
                            #[allow(unused_unsafe)]
                            let lanes = if $vnni && !scaled {
                                // SAFETY: run only in the instances with `$dp`'s features enabled.
                                unsafe { $dp(_mm256_setzero_si256(), vabs, q) }
                            } else {
                                _mm256_madd_epi16(_mm256_maddubs_epi16(vabs, q), isc)
                            };
                            let lanes = _mm256_cvtepi32_ps(lanes);
                            let scale = if grouped {
                                let at = 8 * (xi * super::ROWS + r);
                                // SAFETY: chunk xi's 8 * ROWS scales lie in `group.scales` (asserted
                                // above), row r's 8 from `at`; unaligned load.
                                let xd = unsafe { _mm256_loadu_ps(group.scales.as_ptr().add(at)) };
                                _mm256_mul_ps(dv, xd)
                            } else {
                                // SAFETY: chunk xi < n / 32 (asserted above).
                                _mm256_set1_ps(d * unsafe { *x[r].d.get_unchecked(xi) })
                            };
                            acc[r] = _mm256_fmadd_ps(scale, lanes, acc[r]);
                            if offset && !grouped {
                                // SAFETY: as above.
                                off[r] = m.mul_add(unsafe { *x[r].s.get_unchecked(xi) }, off[r]);
                            }
                        }
                        if offset && grouped {
                            // SAFETY: chunk xi's ROWS sums lie in `group.sums` (asserted above);
                            // unaligned load.
                            let s = unsafe { _mm_loadu_ps(group.sums.as_ptr().add(xi * super::ROWS)) };
                            // Lane r: the same fused multiply-add as row r's scalar chain.
                            off_lanes = _mm_fmadd_ps(_mm_set1_ps(m), s, off_lanes);
                        }
                    });
                }
                if offset && grouped {
                    let mut lanes = [0f32; super::ROWS];
                    // SAFETY: ROWS = 4 f32s; unaligned store.
                    unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), off_lanes) };
                    off.copy_from_slice(&lanes[..R]);
                }
                for r in 0..R {
                    let mut lanes = [0f32; 8];
                    // SAFETY: 8 f32s; unaligned store.
                    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r]) };
                    res[r] = super::tree8(lanes) + off[r];
                }
            }
        }
    };
}
rows_of!(rows_of, "avx2,fma,f16c", false, _mm256_dpbusd_avx_epi32);
rows_of!(rows_of_vnni, "avx2,fma,f16c,avxvnni", true, _mm256_dpbusd_avx_epi32);
rows_of!(rows_of_vnni_vl, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni", true, _mm256_dpbusd_epi32);

/// Weight rows unpacked for the tiled kernel ([`tile`]), each chunk once: per row and chunk (row after
/// row), the 32 values' magnitudes and the values (whose signs `sign` moves onto the activations),
/// the integer scales as `madd`'s operand (the K-quants only), `d` and the offset `m`.
#[derive(Debug, Default)]
pub(super) struct Panel {
    chunks: usize,
    scaled: bool,
    offset: bool,
    abs: Vec<__m256i>,
    v: Vec<__m256i>,
    isc: Vec<__m256i>,
    d: Vec<f32>,
    m: Vec<f32>,
}

impl Panel {
    /// Unpacks the `rows` rows of `n` values of `w` (whole blocks of `ty`), replacing what it held.
    ///
    /// # Safety
    ///
    /// [`available`]; `ty` is [`super::supports`]ed.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn fill(&mut self, ty: GgmlType, w: &[u8], rows: usize, n: usize) {
        crate::quant::by_block_type!(ty, T => self.fill_of::<T>(w, rows, n))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn fill_of<const T: u32>(&mut self, w: &[u8], rows: usize, n: usize) {
        let ty = GgmlType::from_id(T).expect("a GGML type id");
        let (be, bb) = (ty.block_elems(), ty.block_bytes());
        let (per, blocks, chunks) = (be / QK, n / be, n / QK);
        assert!(n.is_multiple_of(be) && w.len() >= rows * blocks * bb, "panel operands");
        self.chunks = chunks;
        self.scaled = matches!(T, 12..=14);
        self.offset = super::has_offset(ty);
        let len = rows * chunks;
        for v in [&mut self.abs, &mut self.v] {
            v.clear();
            v.resize(len, _mm256_setzero_si256());
        }
        // The 32-value types' scales are 1: the tile takes a constant for them.
        self.isc.clear();
        if self.scaled {
            self.isc.resize(len, _mm256_setzero_si256());
        }
        for v in [&mut self.d, &mut self.m] {
            v.clear();
            v.resize(len, 0.0);
        }
        for (j, wr) in w.chunks_exact(blocks * bb).take(rows).enumerate() {
            for (i, b) in wr.chunks_exact(bb).enumerate() {
                unpack::<T>(b, &mut |c, v, isc, d, m| {
                    let at = j * chunks + i * per + c;
                    self.abs[at] = _mm256_sign_epi8(v, v);
                    self.v[at] = v;
                    if matches!(T, 12..=14) {
                        self.isc[at] = _mm256_set_m128i(_mm_set1_epi16(isc[1]), _mm_set1_epi16(isc[0]));
                    }
                    self.d[at] = d;
                    self.m[at] = m;
                });
            }
        }
    }
}

/// Panel row `j` against the `R` rows of group `g` of `x`: per chunk, every row's lanes from the
/// chunk's operands loaded once, in the order of [`rows`] (the same lanes, scales, multiply-adds and
/// offsets' terms, so the same bits).
///
/// # Safety
///
/// [`available`]; the panel holds row `j` of `x.chunks` chunks and group `g` holds `R` rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile<const R: usize>(panel: &Panel, j: usize, x: &super::Octets, g: usize) -> [f32; R] {
    match (panel.scaled, panel.offset) {
        (false, false) => tile_of::<R, false, false>(panel, j, x, g),
        (false, true) => tile_of::<R, false, true>(panel, j, x, g),
        (true, false) => tile_of::<R, true, false>(panel, j, x, g),
        (true, true) => tile_of::<R, true, true>(panel, j, x, g),
    }
}

/// [`tile`] for a panel of integer scales (`SCALED`) and offsets (`OFFSET`) or not.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn tile_of<const R: usize, const SCALED: bool, const OFFSET: bool>(
    panel: &Panel,
    j: usize,
    x: &super::Octets,
    g: usize,
) -> [f32; R] {
    let chunks = panel.chunks;
    let (q, xd, xs) = x.group(g);
    assert!(
        chunks == x.chunks
            && x.width(g) == R
            && panel.d.len() >= (j + 1) * chunks
            && q.len() == R * chunks * QK
            && xd.len() == 8 * R * chunks
            && xs.len() == R * chunks,
        "tile operands"
    );
    let row = j * chunks..(j + 1) * chunks;
    let (abs, v, isc, d, m) = (
        &panel.abs[row.clone()],
        &panel.v[row.clone()],
        if SCALED { &panel.isc[row.clone()] } else { &[][..] },
        &panel.d[row.clone()],
        &panel.m[row],
    );
    let mut acc = [_mm256_setzero_ps(); R];
    let mut off = [0f32; R];
    let ones = _mm256_set1_epi16(1);
    let rows = q.chunks_exact(R * QK).zip(xd.chunks_exact(8 * R)).zip(xs.chunks_exact(R));
    for (c, ((q, xd), xs)) in rows.enumerate() {
        let (abs, v, d) = (abs[c], v[c], _mm256_set1_ps(d[c]));
        let isc = if SCALED { isc[c] } else { ones };
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: row r's 32 values of this chunk lie in `q` (R * 32 bytes), and its scale 8 times
            // in `xd`; unaligned loads.
            let (q, xd) =
                unsafe { (_mm256_loadu_si256(q.as_ptr().add(r * QK).cast()), _mm256_loadu_ps(xd.as_ptr().add(8 * r))) };
            let lanes = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(abs, _mm256_sign_epi8(q, v)), isc));
            *acc = _mm256_fmadd_ps(_mm256_mul_ps(d, xd), lanes, *acc);
        }
        if OFFSET {
            // Every row's chain, chunk after chunk (eight rows: one vector multiply-add).
            for (off, &s) in off.iter_mut().zip(xs) {
                *off = m[c].mul_add(s, *off);
            }
        }
    }
    std::array::from_fn(|r| {
        let mut lanes = [0f32; 8];
        // SAFETY: 8 f32s; unaligned store.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r]) };
        super::tree8(lanes) + off[r]
    })
}

/// Every chunk of one block of the type with GGML id `T`, in order: `put(c, v, isc, d, m)` with the
/// 32 values as signed bytes in position order and the integer scales of values 0..16 and 16..32,
/// as [`super::chunk`] defines them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn unpack<const T: u32>(b: &[u8], put: &mut impl FnMut(usize, __m256i, [i16; 2], f32, f32)) {
    let ones = [1, 1];
    match T {
        8 => {
            assert!(b.len() >= 34);
            // SAFETY: bytes 2..34 of the block (asserted).
            let v = unsafe { _mm256_loadu_si256(b.as_ptr().add(2).cast()) };
            put(0, v, ones, f16(b, 0), 0.0);
        }
        2 | 3 => {
            let at = if T == 2 { 2 } else { 4 };
            assert!(b.len() >= at + 16);
            // SAFETY: 16 bytes from `at`, inside the block (asserted).
            let v = nibbles(unsafe { _mm_loadu_si128(b.as_ptr().add(at).cast()) });
            if T == 2 {
                put(0, _mm256_sub_epi8(v, _mm256_set1_epi8(8)), ones, f16(b, 0), 0.0);
            } else {
                put(0, v, ones, f16(b, 0), f16(b, 2));
            }
        }
        6 | 7 => {
            let at = if T == 6 { 6 } else { 8 };
            assert!(b.len() >= at + 16);
            let qh = u32::from_le_bytes([b[at - 4], b[at - 3], b[at - 2], b[at - 1]]);
            // SAFETY: 16 bytes from `at`, inside the block (asserted).
            let v = nibbles(unsafe { _mm_loadu_si128(b.as_ptr().add(at).cast()) });
            let v = _mm256_or_si256(v, fifth_bits(qh));
            if T == 6 {
                put(0, _mm256_sub_epi8(v, _mm256_set1_epi8(16)), ones, f16(b, 0), 0.0);
            } else {
                put(0, v, ones, f16(b, 0), f16(b, 2));
            }
        }
        12 | 13 => {
            let five = T == 13;
            assert!(b.len() >= if five { 176 } else { 144 });
            let (d, dmin) = (f16(b, 0), f16(b, 2));
            let qs = if five { 48 } else { 16 };
            let m4 = _mm256_set1_epi8(0x0F);
            // SAFETY: bytes 16..48 of a Q5_K block (asserted).
            let qh = if five { unsafe { _mm256_loadu_si256(b.as_ptr().add(16).cast()) } } else { m4 };
            for j in 0..4 {
                // SAFETY: 32 bytes of the block's values (asserted).
                let q = unsafe { _mm256_loadu_si256(b.as_ptr().add(qs + 32 * j).cast()) };
                for (c, mut v) in
                    [(2 * j, _mm256_and_si256(q, m4)), (2 * j + 1, _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4))]
                {
                    if five {
                        let bit =
                            _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(c as i32)), _mm256_set1_epi8(1));
                        v = _mm256_or_si256(v, _mm256_slli_epi16::<4>(bit));
                    }
                    let (sc, mn) = scale_min_k4_int(c, &b[4..16]);
                    put(c, v, [i16::from(sc); 2], d, -(dmin * f32::from(mn)));
                }
            }
        }
        14 => {
            assert!(b.len() >= 210);
            let d = f16(b, 208);
            let sc = &b[192..208];
            let m32 = _mm256_set1_epi8(32);
            for n in 0..2 {
                let qs = crate::quant::avx2::q6_k_values(b, n);
                for (k, q) in qs.into_iter().enumerate() {
                    let isc = [i16::from(sc[8 * n + 2 * k] as i8), i16::from(sc[8 * n + 2 * k + 1] as i8)];
                    put(4 * n + k, _mm256_sub_epi8(q, m32), isc, d, 0.0);
                }
            }
        }
        _ => unreachable!("a supported type"),
    }
}

/// 16 bytes of nibble pairs as 32 values: the low nibbles first, then the high ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibbles(q: __m128i) -> __m256i {
    let m4 = _mm_set1_epi8(0x0F);
    _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(q), m4), _mm_and_si128(q, m4))
}

/// Byte `k` is 16 where bit `k` of `qh` is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fifth_bits(qh: u32) -> __m256i {
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), spread);
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(16))
}
