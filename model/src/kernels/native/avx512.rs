//! The AVX-512 kernel: each vector holds one chunk's 8 lanes for two activation rows ([`Pairs`]), so
//! every lane is the lane the portable kernel computes for that row, accumulated in the same order.
//! Every type's lanes are one `vpdpbusd` of the activations plus 128 (unsigned) with the signed weight
//! values, started from `-128 * sum(v)` over the lane's four weights: exactly `sum(v * q)`, in 32 bits
//! that cannot overflow (at most `4 * 255 * 128`). The K-quants' integer scales multiply the lanes as
//! floats, which is exact (below `2^24`: at most `4 * 32 * 127 * 128`), so it is the portable
//! `isc * sum(v * q)`.

use std::arch::x86_64::*;

use super::{GgmlType, Pairs, QK, TILE_PAIRS, TILE_ROWS};

/// Activation pairs per call.
pub(super) const PAIRS: usize = 8;

/// Weight rows unpacked for the tiled kernel: per row and chunk its 32 values (signed bytes), the
/// bias `-128 * (the sum of each lane's four values)` that takes the activations' `+ 128` back out,
/// its scale `d`, its integer scales as floats and its offset `m`. The rows of a tile of
/// [`TILE_ROWS`] lie side by side, chunk after chunk ([`Panel::at`]), so one pointer walks a tile;
/// the rows are padded with zero rows to whole tiles.
#[derive(Debug, Default)]
pub(super) struct Panel {
    chunks: usize,
    scaled: bool,
    offset: bool,
    v: Vec<__m256i>,
    bias: Vec<__m256i>,
    d: Vec<f32>,
    isc: Vec<[f32; 2]>,
    m: Vec<f32>,
}

impl Panel {
    /// Where row `j`'s chunk `c` is, in a panel of rows of `chunks` chunks.
    #[inline(always)]
    fn at(chunks: usize, j: usize, c: usize) -> usize {
        ((j / TILE_ROWS) * chunks + c) * TILE_ROWS + j % TILE_ROWS
    }

    /// Unpacks the `rows` rows of `n` values of `w` (whole blocks of `ty`), replacing what it held.
    ///
    /// # Safety
    ///
    /// [`available`] and the AVX2 kernel's features; `ty` is [`super::supports`]ed.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn fill(&mut self, ty: GgmlType, w: &[u8], rows: usize, n: usize) {
        crate::quant::by_block_type!(ty, T => self.fill_of::<T>(w, rows, n))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    fn fill_of<const T: u32>(&mut self, w: &[u8], rows: usize, n: usize) {
        let ty = GgmlType::from_id(T).expect("a GGML type id");
        let (be, bb) = (ty.block_elems(), ty.block_bytes());
        let (per, blocks, chunks) = (be / QK, n / be, n / QK);
        assert!(n.is_multiple_of(be) && w.len() >= rows * blocks * bb, "panel operands");
        let len = rows.next_multiple_of(TILE_ROWS) * chunks;
        let zero = _mm256_setzero_si256();
        self.chunks = chunks;
        self.scaled = matches!(T, 12..=14);
        self.offset = super::has_offset(ty);
        for v in [&mut self.v, &mut self.bias] {
            v.clear();
            v.resize(len, zero);
        }
        for v in [&mut self.d, &mut self.m] {
            v.clear();
            v.resize(len, 0.0);
        }
        self.isc.clear();
        self.isc.resize(len, [0.0; 2]);
        let bias = _mm512_set1_epi8(-128);
        let zero = _mm512_setzero_si512();
        for (j, wr) in w.chunks_exact(blocks * bb).take(rows).enumerate() {
            for (i, b) in wr.chunks_exact(bb).enumerate() {
                super::avx2::unpack::<T>(b, &mut |c, v, isc, d, m| {
                    let at = Panel::at(chunks, j, i * per + c);
                    let sum = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, _mm512_castsi256_si512(v)));
                    self.v[at] = v;
                    self.bias[at] = _mm512_castsi512_si256(sum);
                    self.d[at] = d;
                    self.isc[at] = [f32::from(isc[0]), f32::from(isc[1])];
                    self.m[at] = m;
                });
            }
        }
    }
}

/// The products of the panel's rows `j0..j0 + TILE_ROWS` with the rows of pairs `p0..p0 +
/// TILE_PAIRS` of `x`: row `2 * (p0 + p) + h` in `out[j][2 * p + h]`, each computed exactly as
/// [`rows`] computes it (the same lanes, the same operations in the same order), with the offsets'
/// terms.
///
/// # Safety
///
/// [`available`] and the AVX2 kernel's features; the panel holds rows `j0..j0 + TILE_ROWS` (padding
/// included) of `x.chunks` chunks, `x` holds pairs `p0..p0 + TILE_PAIRS` (padding included).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn tile(panel: &Panel, j0: usize, x: &Pairs, p0: usize) -> [[f32; 2 * TILE_PAIRS]; TILE_ROWS] {
    if panel.scaled {
        tile_of::<true>(panel, j0, x, p0)
    } else {
        tile_of::<false>(panel, j0, x, p0)
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn tile_of<const SCALED: bool>(panel: &Panel, j0: usize, x: &Pairs, p0: usize) -> [[f32; 2 * TILE_PAIRS]; TILE_ROWS] {
    let chunks = panel.chunks;
    assert!(
        chunks == x.chunks
            && j0.is_multiple_of(TILE_ROWS)
            && p0.is_multiple_of(TILE_PAIRS)
            && x.s.len() >= chunks * x.stride
            && 2 * p0 + 8 <= x.stride,
        "tile operands"
    );
    // This tile's rows and pairs, chunk after chunk.
    let tile = Panel::at(chunks, j0, 0)..Panel::at(chunks, j0, chunks);
    let (v, bias, d, isc) =
        (&panel.v[tile.clone()], &panel.bias[tile.clone()], &panel.d[tile.clone()], &panel.isc[tile]);
    let xs = x.at(p0, 0);
    let (xq, xd) = (&x.q[xs * 2 * QK..][..chunks * TILE_PAIRS * 2 * QK], &x.d[xs * 16..][..chunks * TILE_PAIRS * 16]);
    let mut acc = [[_mm512_setzero_ps(); TILE_PAIRS]; TILE_ROWS];
    let rows = v
        .chunks_exact(TILE_ROWS)
        .zip(bias.chunks_exact(TILE_ROWS))
        .zip(d.chunks_exact(TILE_ROWS))
        .zip(isc.chunks_exact(TILE_ROWS));
    let pairs = xq.chunks_exact(TILE_PAIRS * 2 * QK).zip(xd.chunks_exact(TILE_PAIRS * 16));
    for ((((v, bias), d), isc), (xq, xd)) in rows.zip(pairs) {
        // SAFETY: `xq` holds TILE_PAIRS * 64 bytes and `xd` TILE_PAIRS * 16 floats; unaligned loads.
        let (q, xd): ([__m512i; TILE_PAIRS], [__m512; TILE_PAIRS]) = unsafe {
            (
                std::array::from_fn(|p| _mm512_loadu_si512(xq.as_ptr().add(p * 2 * QK).cast())),
                std::array::from_fn(|p| _mm512_loadu_ps(xd.as_ptr().add(p * 16))),
            )
        };
        for (j, acc) in acc.iter_mut().enumerate() {
            let (wv, wb, wd) = (_mm512_broadcast_i64x4(v[j]), _mm512_broadcast_i64x4(bias[j]), _mm512_set1_ps(d[j]));
            let sc = if SCALED {
                _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(isc[j][0]), _mm512_set1_ps(isc[j][1]))
            } else {
                _mm512_setzero_ps()
            };
            for (p, acc) in acc.iter_mut().enumerate() {
                let mut lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(wb, q[p], wv));
                if SCALED {
                    lanes = _mm512_mul_ps(lanes, sc);
                }
                *acc = _mm512_fmadd_ps(_mm512_mul_ps(wd, xd[p]), lanes, *acc);
            }
        }
    }
    let mut out = [[0f32; 2 * TILE_PAIRS]; TILE_ROWS];
    for (j, (out, acc)) in out.iter_mut().zip(&acc).enumerate() {
        // The offsets' terms, chunk after chunk, eight rows at once.
        let mut off = _mm256_setzero_ps();
        if panel.offset {
            let m = panel.m[Panel::at(chunks, j0, 0)..Panel::at(chunks, j0, chunks)].iter().skip(j).step_by(TILE_ROWS);
            for (c, &m) in m.enumerate() {
                // SAFETY: 8 floats from 2 * p0 within chunk c's `stride` (asserted above).
                let s = unsafe { _mm256_loadu_ps(x.s.as_ptr().add(c * x.stride + 2 * p0)) };
                off = _mm256_fmadd_ps(_mm256_set1_ps(m), s, off);
            }
        }
        let mut offs = [0f32; 8];
        // SAFETY: 8 floats; unaligned store.
        unsafe { _mm256_storeu_ps(offs.as_mut_ptr(), off) };
        for (p, acc) in acc.iter().enumerate() {
            out[2 * p..2 * p + 2].copy_from_slice(&pair_sums(*acc, &offs[2 * p..2 * p + 2]));
        }
    }
    out
}

/// The two outputs of a pair's accumulator (each row's 8 lanes summed by [`super::tree8`]), plus
/// their offsets' terms `off`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn pair_sums(acc: __m512, off: &[f32]) -> [f32; 2] {
    let mut lanes = [0f32; 16];
    // SAFETY: 16 floats; unaligned store.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
    std::array::from_fn(|h| super::tree8(std::array::from_fn(|l| lanes[8 * h + l])) + off[h])
}

/// Whether this CPU runs it (AVX-512F, BW and VNNI, besides the AVX2 kernel's features).
pub(super) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vnni")
}

/// For each weight row of `w` (one per element of `out`), its products with the rows of pairs
/// `p0..p0 + P` of `x`: row `2 * (p0 + p) + h` in `out[j][2 * p + h]`.
///
/// # Safety
///
/// [`available`] and the AVX2 kernel's features; `ty` is [`super::supports`]ed, `w` holds
/// `out.len()` rows of `n` values as whole blocks, and `x` holds rows of `n` values with pairs
/// `p0..p0 + P`, `p0` a multiple of [`PAIRS`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn rows<const P: usize>(
    ty: GgmlType,
    x: &Pairs,
    p0: usize,
    w: &[u8],
    n: usize,
    out: &mut [[f32; 2 * PAIRS]],
) {
    crate::quant::by_block_type!(ty, T => rows_of::<P, T>(x, p0, w, n, out))
}

/// [`rows`] for the type with GGML id `T`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn rows_of<const P: usize, const T: u32>(x: &Pairs, p0: usize, w: &[u8], n: usize, out: &mut [[f32; 2 * PAIRS]]) {
    let ty = GgmlType::from_id(T).expect("a GGML type id");
    let (be, bb) = (ty.block_elems(), ty.block_bytes());
    let (blocks, chunks) = (n / be, n / QK);
    assert!(
        P <= PAIRS
            && n.is_multiple_of(be)
            && chunks == x.chunks
            && p0 + P <= x.pairs
            && p0.is_multiple_of(PAIRS)
            && 2 * p0 + 2 * PAIRS <= x.stride
            && x.q.len() >= x.pairs.next_multiple_of(TILE_PAIRS) * chunks * 2 * QK
            && x.d.len() >= x.pairs.next_multiple_of(TILE_PAIRS) * chunks * 16
            && x.s.len() >= chunks * x.stride
            && w.len() >= out.len() * blocks * bb,
        "rows operands"
    );
    // Two weight rows side by side, block by block: each output's lanes are one chain of
    // multiply-adds, and the chains of two rows keep twice as many in flight.
    let row_bytes = blocks * bb;
    let rows = out.len().min(w.len() / row_bytes.max(1));
    let (whole, rest) = out[..rows].split_at_mut(rows / 2 * 2);
    for (g, res) in whole.chunks_exact_mut(2).enumerate() {
        group::<P, T, 2>(x, p0, w, 2 * g, n, res);
    }
    for (k, res) in rest.chunks_exact_mut(1).enumerate() {
        group::<P, T, 1>(x, p0, w, whole.len() + k, n, res);
    }
}

/// [`rows_of`] for the `H` weight rows from row `j` of `w`, into `out` (`H` rows).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
fn group<const P: usize, const T: u32, const H: usize>(
    x: &Pairs,
    p0: usize,
    w: &[u8],
    j: usize,
    n: usize,
    out: &mut [[f32; 2 * PAIRS]],
) {
    let ty = GgmlType::from_id(T).expect("a GGML type id");
    let (be, bb) = (ty.block_elems(), ty.block_bytes());
    let (per, blocks) = (be / QK, n / be);
    let row_bytes = blocks * bb;
    assert!(out.len() == H && w.len() >= (j + H) * row_bytes, "group operands");
    let scaled = matches!(T, 12..=14);
    let offset = super::has_offset(ty);
    let zero = _mm512_setzero_si512();
    let bias = _mm512_set1_epi8(-128);
    let mut acc = [[_mm512_setzero_ps(); P]; H];
    let mut off = [_mm512_setzero_ps(); H];
    for i in 0..blocks {
        // The rows are read side by side: in the stream of rows, a step is every row's block.
        crate::quant::prefetch(w.as_ptr(), j * row_bytes + i * H * bb, H * bb);
        for h in 0..H {
            let b = &w[(j + h) * row_bytes + i * bb..][..bb];
            let (acc, off) = (&mut acc[h], &mut off[h]);
            super::avx2::unpack::<T>(b, &mut |c, v, isc, d, m| {
                let xi = i * per + c;
                let v = _mm512_broadcast_i64x4(v);
                // -128 * (the sum of each lane's four weights), for the bias of the activations.
                let start = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, v));
                let isc =
                    _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(f32::from(isc[0])), _mm512_set1_ps(f32::from(isc[1])));
                let d = _mm512_set1_ps(d);
                for (p, acc) in acc.iter_mut().enumerate() {
                    let at = x.at(p0 + p, xi);
                    // SAFETY: pair p0 + p < pairs and chunk xi < chunks (asserted by `rows_of`): 64
                    // bytes and 16 floats inside `q` and `d`; unaligned loads.
                    let (q, xd) = unsafe {
                        (
                            _mm512_loadu_si512(x.q.as_ptr().add(at * 2 * QK).cast()),
                            _mm512_loadu_ps(x.d.as_ptr().add(at * 16)),
                        )
                    };
                    let mut lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, q, v));
                    if scaled {
                        lanes = _mm512_mul_ps(lanes, isc);
                    }
                    *acc = _mm512_fmadd_ps(_mm512_mul_ps(d, xd), lanes, *acc);
                }
                if offset {
                    // SAFETY: 16 floats from 2 * p0 within chunk xi's `stride` (asserted by
                    // `rows_of`).
                    let s = unsafe { _mm512_loadu_ps(x.s.as_ptr().add(xi * x.stride + 2 * p0)) };
                    *off = _mm512_fmadd_ps(_mm512_set1_ps(m), s, *off);
                }
            });
        }
    }
    for ((res, acc), off) in out.iter_mut().zip(&acc).zip(&off) {
        let mut offs = [0f32; 2 * PAIRS];
        // SAFETY: 16 floats; unaligned store.
        unsafe { _mm512_storeu_ps(offs.as_mut_ptr(), *off) };
        for (p, acc) in acc.iter().enumerate() {
            res[2 * p..2 * p + 2].copy_from_slice(&pair_sums(*acc, &offs[2 * p..2 * p + 2]));
        }
    }
}
