//! `fast` precision on the GGUF's own blocks: integer dot products of each weight block with the
//! activations quantized to 8 bits, with no re-quantized or f32 copy of any weight.
//!
//! Every 32 weights of every supported block type form one *chunk*: 32 small integers `v`, an integer
//! scale for each half of 16 (`isc`; 1 for the 32-value types), a float scale `d` and, for the types
//! with an offset (Q4_1, Q5_1, Q4_K, Q5_K), a float offset `m`, so that weight `k` is
//! `d * isc[k / 16] * v[k] + m`. Activations are [`Q8`] rows: per 32 values a scale `xd`, 32 integers
//! `q` (quantized once per input, shared by every product that reads it) and the sum `xs` of the 32
//! values before quantization, so the offset's term `m * xs` carries no quantization error (llama.cpp's
//! Q8_1 holds `xd * sum(q)`, the sum of the quantized values).
//!
//! Each output is computed in one fixed order, whatever the batch, tile or thread:
//! 1. per chunk, lane `l` (of 8) sums `isc * v[k] * q[k]` over `k` in `4l..4l + 4`, in 32-bit integers
//!    (exact, so no order inside a chunk can matter);
//! 2. chunk after chunk, `acc[l] = fma(d * xd, lane as f32, acc[l])` and, with an offset,
//!    `off = fma(m, xs, off)`;
//! 3. the output is `tree8(acc) + off` ([`super::dot::tree8`]).
//!
//! The AVX2 kernel unpacks each chunk in registers (`maddubs` of the 8-bit values, `madd` with the
//! integer scales: exactly the portable lanes, as no 16-bit pair can saturate: at most
//! `2 * 128 * 127`) and loads each weight chunk once for up to four activation rows. Where the CPU has
//! AVX-VNNI, one `vpdpbusd` gives the 32-value types' lanes (the same sums, never saturating). From
//! eight activation rows on (prefill), every 256-bit CPU runs it tiled instead: each weight row is
//! unpacked once per product into a panel, then met by the activations eight rows at a time
//! ([`avx2::tile`]), where the row kernel unpacked it again for every four rows.

use super::dot::tree8;
use super::q8::{Act, Q8, QK};
use crate::quant::{f16_at, scale_min_k4_int, GgmlType};

/// Whether `fast` computes on `ty`'s own blocks.
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

/// Whether `ty`'s weights carry an offset `m`.
#[inline(always)]
fn has_offset(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K)
}

/// Activation rows per call of a row kernel: each weight chunk is unpacked once for them all.
const ROWS: usize = 4;
/// Weight rows per call of a row kernel.
const ROWS_PER_CALL: usize = 32;
/// Weight rows of a tile of the AVX-512 tiled kernel (prefill).
const TILE_ROWS: usize = 2;
/// Activation pairs of a tile of the AVX-512 tiled kernel. Its 8 accumulators, the pairs' values and
/// scales and both weight rows' operands stay in registers; 4 x 4 and 3 x 4 tiles (16 and 12
/// accumulators) made LLVM spill accumulators and were slower on Gemma's shapes (Zen 5: 2 x 4 gave
/// 625-695 tokens/s of linear layers at 128 rows, 4 x 4 541-573, 3 x 4 497-527).
const TILE_PAIRS: usize = 4;
// A tile's rows are 8, one 256-bit vector of the offsets' terms.
const _: () = assert!(2 * TILE_PAIRS == 8);
/// From how many activation rows the AVX-512 kernel runs tiled: every weight row is unpacked once into a
/// panel for all of them, and each tile's activations stay in L1 while the panel's rows pass. Fewer
/// rows (a decode step) stream the weights instead, each chunk unpacked once per eight pairs.
const TILED_FROM: usize = 16;
/// Weight rows unpacked into a panel at a time.
const PANEL_ROWS: usize = 32;
/// From how many activation rows the 256-bit kernels run tiled ([`avx2::Panel`]): every weight row is
/// unpacked once into a panel for all of them, instead of once per [`ROWS`] rows.
const TILED_FROM_256: usize = 8;
/// Activation rows of a group of the 256-bit tiled kernel ([`Octets`]): 8 accumulators, and a weight
/// chunk's operands loaded once for all of them.
const OCTET: usize = 8;

/// One chunk of 32 weights, unpacked: weight `k` is `d * isc[k / 16] * v[k] + m`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Chunk {
    v: [i8; QK],
    isc: [i16; 2],
    d: f32,
    m: f32,
}

/// Chunk `c` of block `b` of `ty`: the definition every kernel follows.
fn chunk(ty: GgmlType, b: &[u8], c: usize) -> Chunk {
    let mut ch = Chunk { v: [0; QK], isc: [1; 2], d: f16_at(b, 0), m: 0.0 };
    if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
        ch.m = f16_at(b, 2);
    }
    match ty {
        GgmlType::Q8_0 => {
            for (v, &q) in ch.v.iter_mut().zip(&b[2..34]) {
                *v = q as i8;
            }
        }
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let (at, zero) = if ty == GgmlType::Q4_0 { (2, 8) } else { (4, 0) };
            for j in 0..16 {
                ch.v[j] = (b[at + j] & 0xF) as i8 - zero;
                ch.v[j + 16] = (b[at + j] >> 4) as i8 - zero;
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (at, zero) = if ty == GgmlType::Q5_0 { (6, 16) } else { (8, 0) };
            let qh = u32::from_le_bytes([b[at - 4], b[at - 3], b[at - 2], b[at - 1]]);
            for j in 0..16 {
                let (h0, h1) = (((qh >> j) & 1) as u8, ((qh >> (j + 16)) & 1) as u8);
                ch.v[j] = ((b[at + j] & 0xF) | (h0 << 4)) as i8 - zero;
                ch.v[j + 16] = ((b[at + j] >> 4) | (h1 << 4)) as i8 - zero;
            }
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            let (sc, mn) = scale_min_k4_int(c, &b[4..16]);
            ch.isc = [i16::from(sc); 2];
            // Exact: an f16 times an integer below 64.
            ch.m = -(f16_at(b, 2) * f32::from(mn));
            let five = ty == GgmlType::Q5K;
            let qs = if five { &b[48..176] } else { &b[16..144] };
            for l in 0..QK {
                let q = qs[32 * (c / 2) + l];
                let mut n = if c.is_multiple_of(2) { q & 0xF } else { q >> 4 };
                if five {
                    n |= ((b[16 + l] >> c) & 1) << 4;
                }
                ch.v[l] = n as i8;
            }
        }
        GgmlType::Q6K => {
            let (n, k) = (c / 4, c % 4);
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            ch.d = f16_at(b, 208);
            ch.isc = [i16::from(sc[8 * n + 2 * k] as i8), i16::from(sc[8 * n + 2 * k + 1] as i8)];
            for l in 0..QK {
                let low = ql[64 * n + 32 * (k % 2) + l];
                let low = if k < 2 { low & 0xF } else { low >> 4 };
                let high = (qh[32 * n + l] >> (2 * k)) & 3;
                ch.v[l] = (low | (high << 4)) as i8 - 32;
            }
        }
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => unreachable!("not a block type with integer values"),
    }
    ch
}

/// `x[r] . w` for one weight row `w` (whole blocks of `ty`, `n` values), portably.
fn row_portable<const R: usize>(ty: GgmlType, x: [Act<'_>; R], w: &[u8], n: usize) -> [f32; R] {
    let (be, bb) = (ty.block_elems(), ty.block_bytes());
    let per = be / QK;
    let offset = has_offset(ty);
    let mut acc = [[0f32; 8]; R];
    let mut off = [0f32; R];
    for (i, b) in w.chunks_exact(bb).take(n / be).enumerate() {
        for c in 0..per {
            let ch = chunk(ty, b, c);
            let xi = i * per + c;
            for r in 0..R {
                let q = &x[r].q[xi * QK..(xi + 1) * QK];
                let dd = ch.d * x[r].d[xi];
                for (l, acc) in acc[r].iter_mut().enumerate() {
                    let isc = i32::from(ch.isc[l / 4]);
                    let lane: i32 = (4 * l..4 * l + 4).map(|k| isc * (i32::from(ch.v[k]) * i32::from(q[k]))).sum();
                    *acc = dd.mul_add(lane as f32, *acc);
                }
                if offset {
                    off[r] = ch.m.mul_add(x[r].s[xi], off[r]);
                }
            }
        }
    }
    std::array::from_fn(|r| tree8(acc[r]) + off[r])
}

/// Quantized activations as the native kernels read them: the rows of a [`Q8`] and, where the AVX-512
/// kernel runs, the same rows laid out in pairs for it (made once per product, shared by its tasks).
#[derive(Debug)]
pub(crate) struct Acts<'a> {
    q8: &'a Q8,
    kernel: Kernel,
    /// Whether this CPU runs the AVX-512 kernels (so [`avx512::quads`] too), for any row count.
    wide: bool,
    pairs: Option<Pairs>,
    /// The rows in groups for the 256-bit tiled kernel, where it runs (from [`TILED_FROM_256`] rows).
    octets: Option<Octets>,
    /// Where the 256-bit row kernel runs on more than one row: the rows in groups of [`ROWS`], their
    /// operands interleaved for it ([`Group`]).
    sums: Vec<f32>,
    scales: Vec<f32>,
}

/// The per-chunk operands of a group of up to [`ROWS`] activation rows, interleaved for the 256-bit row
/// kernel (chunk, then row; a short last group padded with zeros), where it runs on more than one row.
/// The sums make a group's offsets' terms one vector multiply-add per chunk: as four scalar chains they
/// held four more registers through the loop and cost 9-14% of a four-row product of Q4_1 or Q4_K. Each
/// scale is stored eight times, so `d * xd` is one vector multiply with a memory operand, where a scalar
/// product and its broadcast were two operations: 5-15% of a four-row product of every block type (Zen 3).
/// Each lane computes what the scalar form did, so the bits are the same.
#[derive(Clone, Copy, Debug, Default)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Group<'a> {
    /// `ROWS` per chunk.
    sums: &'a [f32],
    /// `8 * ROWS` per chunk.
    scales: &'a [f32],
}

impl<'a> Acts<'a> {
    /// The rows of `q8`, for the fastest kernel this CPU runs (`simd` false: the portable one).
    pub(crate) fn new(q8: &'a Q8, simd: bool) -> Self {
        Acts::with(Kernel::best(simd), q8)
    }

    fn with(kernel: Kernel, q8: &'a Q8) -> Self {
        #[cfg(target_arch = "x86_64")]
        let wide = kernel == Kernel::Avx512;
        #[cfg(not(target_arch = "x86_64"))]
        let wide = false;
        // A single row would fill half of every vector of the pair kernel: the 256-bit kernels serve it
        // as well (but the 32-value types go to the quad kernel, two weight rows per vector, see `quads`).
        let kernel = if q8.rows < 2 { kernel.narrow() } else { kernel };
        #[cfg(target_arch = "x86_64")]
        let pairs = (kernel == Kernel::Avx512).then(|| Pairs::of(q8));
        #[cfg(not(target_arch = "x86_64"))]
        let pairs = None;
        #[cfg(target_arch = "x86_64")]
        let octets = (matches!(kernel, Kernel::Avx2 | Kernel::Vnni | Kernel::VnniVl) && q8.rows >= TILED_FROM_256)
            .then(|| Octets::of(q8));
        #[cfg(not(target_arch = "x86_64"))]
        let octets = None;
        let (mut sums, mut scales) = (Vec::new(), Vec::new());
        #[cfg(target_arch = "x86_64")]
        if matches!(kernel, Kernel::Avx2 | Kernel::Vnni | Kernel::VnniVl) && octets.is_none() && q8.rows > 1 {
            let chunks = q8.cols / QK;
            let slots = q8.rows.div_ceil(ROWS) * chunks * ROWS;
            (sums, scales) = (vec![0.0; slots], vec![0.0; 8 * slots]);
            for r in 0..q8.rows {
                let (g, i) = (r / ROWS, r % ROWS);
                let a = q8.act(r);
                for c in 0..chunks {
                    let at = (g * chunks + c) * ROWS + i;
                    sums[at] = a.s[c];
                    scales[8 * at..8 * (at + 1)].fill(a.d[c]);
                }
            }
        }
        Acts { q8, kernel, wide, pairs, octets, sums, scales }
    }

    /// The interleaved operands of the group of [`ROWS`] rows from row `r0` (empty where there are none).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn group(&self, r0: usize) -> Group<'_> {
        let len = self.q8.cols / QK * ROWS;
        let g = r0 / ROWS;
        Group {
            sums: self.sums.get(g * len..(g + 1) * len).unwrap_or_default(),
            scales: self.scales.get(8 * g * len..8 * (g + 1) * len).unwrap_or_default(),
        }
    }
}

/// Activation rows in groups of [`OCTET`] (the last group holds the rest), as the 256-bit tiled kernel
/// reads them: per group and chunk, each row's 32 values, then each row's scale eight times (a vector:
/// `d * xd` is then one vector multiply, where a broadcast of a scalar product cost an operation more),
/// so that one pointer walks a group chunk after chunk; the rows' sums likewise.
#[derive(Debug)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Octets {
    rows: usize,
    chunks: usize,
    q: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
}

impl Octets {
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn of(x: &Q8) -> Self {
        let (t, chunks) = (x.rows, x.cols / QK);
        let mut out = Octets {
            rows: t,
            chunks,
            q: vec![0; t * chunks * QK],
            d: vec![0.0; 8 * t * chunks],
            s: vec![0.0; t * chunks],
        };
        for r in 0..t {
            let (g, i) = (r / OCTET, r % OCTET);
            let width = out.width(g);
            let a = x.act(r);
            for c in 0..chunks {
                let at = g * OCTET * chunks + c * width + i;
                out.q[at * QK..(at + 1) * QK].copy_from_slice(&a.q[c * QK..(c + 1) * QK]);
                out.d[8 * at..8 * (at + 1)].fill(a.d[c]);
                out.s[at] = a.s[c];
            }
        }
        out
    }

    /// Rows in group `g`.
    #[inline]
    fn width(&self, g: usize) -> usize {
        OCTET.min(self.rows - g * OCTET)
    }

    /// Group `g`'s values, scales and sums.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    #[inline]
    fn group(&self, g: usize) -> (&[i8], &[f32], &[f32]) {
        let (from, len) = (g * OCTET * self.chunks, self.width(g) * self.chunks);
        (&self.q[from * QK..(from + len) * QK], &self.d[8 * from..8 * (from + len)], &self.s[from..from + len])
    }
}

/// Activation rows in pairs, as the AVX-512 kernels read them. Per pair and chunk: 64 bytes, the two
/// rows' 32 values each plus 128 (unsigned bytes, for `vpdpbusd`), and 16 scales, 8 copies of each row's,
/// the pairs of a tile of [`TILE_PAIRS`] side by side chunk after chunk ([`Pairs::at`]). Per chunk: every
/// row's sum, side by side (the rows padded to a multiple of 16). An odd last row is paired with a row
/// of zeros, and the pairs are padded with zero pairs to whole tiles.
#[derive(Debug)]
struct Pairs {
    pairs: usize,
    chunks: usize,
    /// Floats per chunk in `s`.
    stride: usize,
    q: Vec<u8>,
    d: Vec<f32>,
    s: Vec<f32>,
}

impl Pairs {
    fn of(x: &Q8) -> Self {
        let (t, chunks) = (x.rows, x.cols / QK);
        let pairs = t.div_ceil(2);
        // Storage for whole tiles of pairs (the tiled kernel reads them), the extra ones zero; the
        // tiled kernel reads the sums of 8 rows from a tile's first.
        let padded = pairs.next_multiple_of(TILE_PAIRS);
        let stride = (2 * padded + 8).next_multiple_of(16);
        let mut out = Pairs {
            pairs,
            chunks,
            stride,
            q: vec![0x80; padded * chunks * 2 * QK],
            d: vec![0.0; padded * chunks * 16],
            s: vec![0.0; chunks * stride],
        };
        for r in 0..t {
            let a = x.act(r);
            let (p, half) = (r / 2, r % 2);
            for c in 0..chunks {
                let at = out.at(p, c);
                let q = &mut out.q[at * 2 * QK + half * QK..][..QK];
                for (dst, &v) in q.iter_mut().zip(&a.q[c * QK..(c + 1) * QK]) {
                    *dst = (v as u8) ^ 0x80;
                }
                out.d[at * 16 + half * 8..][..8].fill(a.d[c]);
                out.s[c * stride + r] = a.s[c];
            }
        }
        out
    }

    /// Where pair `p`'s chunk `c` is, in 64-byte values and 16-float scales.
    #[inline(always)]
    fn at(&self, p: usize, c: usize) -> usize {
        ((p / TILE_PAIRS) * self.chunks + c) * TILE_PAIRS + p % TILE_PAIRS
    }
}

/// `out[i][j] = x[i] . w[rows.start + j]` for every activation row of `x` and the weight rows `rows` of
/// `w` (rows of `n` values as whole blocks of a [`supports`]ed `ty`), into `out` (`x.rows x rows.len()`).
/// One weight row at a time (streaming; see `dot`), its chunks unpacked once per group of activation
/// rows.
pub(crate) fn dots(x: &Acts<'_>, ty: GgmlType, w: &[u8], rows: std::ops::Range<usize>, out: &mut [f32]) {
    let xq = x.q8;
    let (n, t, width) = (xq.cols, xq.rows, rows.len());
    let (be, bb) = (ty.block_elems(), ty.block_bytes());
    let row_bytes = n / be * bb;
    assert!(
        supports(ty) && n % be == 0 && w.len() >= rows.end * row_bytes && out.len() == t * width,
        "native dots shapes"
    );
    let w = &w[rows.start * row_bytes..rows.end * row_bytes];
    #[cfg(target_arch = "x86_64")]
    if quad_bias(ty).is_some() && x.wide && t <= QUAD_ACTS && width >= 4 {
        quads(x, ty, w, width, out);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(pairs) = x.pairs.as_ref().filter(|_| t >= TILED_FROM) {
        let mut panel = avx512::Panel::default();
        for j0 in (0..width).step_by(PANEL_ROWS) {
            let nj = PANEL_ROWS.min(width - j0);
            // SAFETY: `pairs` exists only where `Kernel::best` chose AVX-512 (AVX-512F, BW and VNNI
            // present, with AVX2, FMA and F16C); `ty` is supported and `w` holds `nj` rows of whole
            // blocks from row `j0`.
            unsafe { panel.fill(ty, &w[j0 * row_bytes..(j0 + nj) * row_bytes], nj, n) };
            for p0 in (0..pairs.pairs).step_by(TILE_PAIRS) {
                for jt in (0..nj).step_by(TILE_ROWS) {
                    // SAFETY: as above; the panel holds rows `jt..jt + TILE_ROWS` (padded), `pairs` the
                    // pairs `p0..p0 + TILE_PAIRS` (padded) of rows of `n` values.
                    let res = unsafe { avx512::tile(&panel, jt, pairs, p0) };
                    for (j, res) in res.iter().enumerate().take(nj - jt) {
                        for (i, v) in res.iter().enumerate().take(t.saturating_sub(2 * p0)) {
                            out[(2 * p0 + i) * width + j0 + jt + j] = *v;
                        }
                    }
                }
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(octets) = &x.octets {
        let mut panel = avx2::Panel::default();
        for j0 in (0..width).step_by(PANEL_ROWS) {
            let nj = PANEL_ROWS.min(width - j0);
            // SAFETY: `octets` exists only where `Kernel::best` chose a 256-bit kernel (AVX2, FMA and F16C
            // present); `ty` is supported and `w` holds `nj` rows of whole blocks from row `j0`.
            unsafe { panel.fill(ty, &w[j0 * row_bytes..(j0 + nj) * row_bytes], nj, n) };
            for g in 0..t.div_ceil(OCTET) {
                macro_rules! run {
                    ($r:literal) => {
                        for j in 0..nj {
                            // SAFETY: as above; the panel holds row `j` of `octets.chunks` chunks and
                            // group `g` holds `$r` rows.
                            let res = unsafe { avx2::tile::<$r>(&panel, j, octets, g) };
                            for (i, v) in res.iter().enumerate() {
                                out[(g * OCTET + i) * width + j0 + j] = *v;
                            }
                        }
                    };
                }
                match octets.width(g) {
                    1 => run!(1),
                    2 => run!(2),
                    3 => run!(3),
                    4 => run!(4),
                    5 => run!(5),
                    6 => run!(6),
                    7 => run!(7),
                    _ => run!(8),
                }
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(pairs) = &x.pairs {
        for j0 in (0..width).step_by(ROWS_PER_CALL) {
            let nj = ROWS_PER_CALL.min(width - j0);
            let w = &w[j0 * row_bytes..(j0 + nj) * row_bytes];
            for p0 in (0..pairs.pairs).step_by(avx512::PAIRS) {
                let mut res = [[0f32; 2 * avx512::PAIRS]; ROWS_PER_CALL];
                let res = &mut res[..nj];
                macro_rules! run {
                    ($p:literal) => {
                        // SAFETY: `pairs` exists only where `Kernel::best` chose AVX-512 (AVX-512F, BW
                        // and VNNI present, with AVX2, FMA and F16C); `ty` is supported, `w` is
                        // `res.len()` rows of whole blocks and `pairs` holds rows of `n` values from
                        // pair `p0` on, `p0` a multiple of `PAIRS`.
                        unsafe { avx512::rows::<$p>(ty, pairs, p0, w, n, res) }
                    };
                }
                match pairs.pairs - p0 {
                    1 => run!(1),
                    2 => run!(2),
                    3 => run!(3),
                    4 => run!(4),
                    5 => run!(5),
                    6 => run!(6),
                    7 => run!(7),
                    _ => run!(8),
                }
                for (j, res) in res.iter().enumerate() {
                    for (i, v) in res.iter().enumerate().take(t.saturating_sub(2 * p0)) {
                        out[(2 * p0 + i) * width + j0 + j] = *v;
                    }
                }
            }
        }
        return;
    }
    // A few dozen weight rows at a time (a few KiB, kept in L1 while every group of four activation rows
    // passes over them), each call's checks amortised over them.
    for j0 in (0..width).step_by(ROWS_PER_CALL) {
        let nj = ROWS_PER_CALL.min(width - j0);
        let w = &w[j0 * row_bytes..(j0 + nj) * row_bytes];
        for r0 in (0..t).step_by(ROWS) {
            macro_rules! run {
                ($r:literal) => {{
                    let acts: [Act<'_>; $r] = std::array::from_fn(|i| xq.act(r0 + i));
                    let mut res = [[0f32; $r]; ROWS_PER_CALL];
                    let res = &mut res[..nj];
                    match x.kernel {
                        Kernel::Portable => rows_portable::<$r>(ty, acts, w, n, res),
                        // SAFETY: `Kernel::best` chose it only where AVX2, FMA and F16C are present; `ty`
                        // is supported, `w` is `res.len()` rows of whole blocks and each activation row
                        // holds `n` values.
                        #[cfg(target_arch = "x86_64")]
                        Kernel::Avx2 => unsafe { avx2::rows::<$r>(ty, acts, x.group(r0), w, n, res) },
                        // SAFETY: as above, and AVX-VNNI is present.
                        #[cfg(target_arch = "x86_64")]
                        Kernel::Vnni => unsafe { avx2::rows_vnni::<$r>(ty, acts, x.group(r0), w, n, res) },
                        // SAFETY: as above, and AVX512-VNNI and VL are present.
                        #[cfg(target_arch = "x86_64")]
                        Kernel::VnniVl => unsafe { avx2::rows_vnni_vl::<$r>(ty, acts, x.group(r0), w, n, res) },
                        #[cfg(target_arch = "x86_64")]
                        Kernel::Avx512 => unreachable!("the AVX-512 kernel runs on pairs"),
                    }
                    for (j, res) in res.iter().enumerate() {
                        for (i, v) in res.iter().enumerate() {
                            out[(r0 + i) * width + j0 + j] = *v;
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
}

/// Activation rows up to which the 32-value block types go through [`avx512::quads`] (a decode step).
#[cfg(target_arch = "x86_64")]
const QUAD_ACTS: usize = 4;

/// For the block types [`avx512::quads`] computes (those whose blocks are one chunk of 32 values), what
/// their values `v` are offset by to be unsigned bytes `v + o`, which `vpdpbusd` takes: Q8_0's `-128..128`
/// flipped, the other types' nibbles (and fifth bits) as they are stored.
#[cfg(target_arch = "x86_64")]
fn quad_bias(ty: GgmlType) -> Option<i32> {
    match ty {
        GgmlType::Q8_0 => Some(128),
        GgmlType::Q4_0 => Some(8),
        GgmlType::Q5_0 => Some(16),
        GgmlType::Q4_1 | GgmlType::Q5_1 => Some(0),
        _ => None,
    }
}

/// [`dots`] for weights of a [`quad_bias`] type (`width` rows in `w`) and at most [`QUAD_ACTS`]
/// activation rows, on a CPU with the AVX-512 kernels: four weight rows at a time by
/// [`avx512::quads`], the last `width % 4` rows by the other kernels.
#[cfg(target_arch = "x86_64")]
fn quads(x: &Acts<'_>, ty: GgmlType, w: &[u8], width: usize, out: &mut [f32]) {
    let xq = x.q8;
    let (n, t) = (xq.cols, xq.rows);
    let row_bytes = n / QK * ty.block_bytes();
    let o = quad_bias(ty).expect("a type with a quad kernel");
    // Each lane's `-o * (the sum of its four activation values)`: the weights go in as unsigned bytes,
    // `v + o`, so the lanes start from this to come out as `sum(v * q)`.
    let bias: Vec<[i32; 8]> = (0..t)
        .flat_map(|r| xq.act(r).q.chunks_exact(QK).map(|c| std::array::from_fn(|l| -o * four_sum(&c[4 * l..]))))
        .collect();
    let whole = width / 4 * 4;
    for j0 in (0..whole).step_by(ROWS_PER_CALL) {
        let nj = ROWS_PER_CALL.min(whole - j0);
        let w = &w[j0 * row_bytes..(j0 + nj) * row_bytes];
        macro_rules! run {
            ($r:literal) => {{
                let acts: [Act<'_>; $r] = std::array::from_fn(|i| xq.act(i));
                let bias: [&[[i32; 8]]; $r] = std::array::from_fn(|i| &bias[i * (n / QK)..(i + 1) * (n / QK)]);
                let mut res = [[0f32; $r]; ROWS_PER_CALL];
                let res = &mut res[..nj];
                // SAFETY: `x.wide` is set only where `Kernel::best` chose AVX-512 (AVX-512F, BW and VNNI
                // present, with AVX2, FMA and F16C); `ty` has a quad kernel, `w` is `nj` (a multiple of 4)
                // rows of `n` values as whole blocks, and every activation row and its biases cover `n`
                // values.
                unsafe { avx512::quads::<$r>(ty, acts, bias, w, n, res) };
                for (j, res) in res.iter().enumerate() {
                    for (i, v) in res.iter().enumerate() {
                        out[i * width + j0 + j] = *v;
                    }
                }
            }};
        }
        match t {
            1 => run!(1),
            2 => run!(2),
            3 => run!(3),
            _ => run!(4),
        }
    }
    if whole < width {
        let mut rest = vec![0f32; t * (width - whole)];
        dots(x, ty, w, whole..width, &mut rest);
        for (i, row) in rest.chunks_exact(width - whole).enumerate() {
            out[i * width + whole..(i + 1) * width].copy_from_slice(row);
        }
    }
}

/// The sum of the first four values.
#[cfg(target_arch = "x86_64")]
fn four_sum(q: &[i8]) -> i32 {
    q[..4].iter().map(|&v| i32::from(v)).sum()
}

/// Which instructions compute the integer lanes: the bits are the same whichever runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Portable,
    /// AVX2: `maddubs` then `madd`.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX2 with AVX-VNNI: one `vpdpbusd` for the 32-value types (the K-quants' 16-value scales keep
    /// `maddubs`/`madd`).
    #[cfg(target_arch = "x86_64")]
    Vnni,
    /// [`Kernel::Vnni`] with AVX-512 VNNI's `vpdpbusd` on 256-bit vectors (EVEX: AVX512-VNNI and VL), for
    /// the CPUs that have it without AVX-VNNI (Zen 4, Ice Lake): the same instruction.
    #[cfg(target_arch = "x86_64")]
    VnniVl,
    /// AVX-512 with VNNI: two activation rows per vector ([`Pairs`]), every type's lanes one
    /// `vpdpbusd`.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Kernel {
    /// The fastest this CPU runs (`simd` false: the portable one).
    fn best(simd: bool) -> Self {
        #[cfg(target_arch = "x86_64")]
        if simd && avx2::available() {
            if avx512::available() {
                return Kernel::Avx512;
            }
            return Kernel::best_256();
        }
        let _ = simd;
        Kernel::Portable
    }

    /// The fastest 256-bit kernel of a CPU with AVX2.
    #[cfg(target_arch = "x86_64")]
    fn best_256() -> Self {
        if avx2::vnni() {
            Kernel::Vnni
        } else if avx2::vnni_vl() {
            Kernel::VnniVl
        } else {
            Kernel::Avx2
        }
    }

    /// The fastest 256-bit kernel where this is the AVX-512 one.
    fn narrow(self) -> Self {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => Kernel::best_256(),
            other => other,
        }
    }
}

/// [`row_portable`] for each of the consecutive weight rows in `w`, one per element of `out`.
fn rows_portable<const R: usize>(ty: GgmlType, x: [Act<'_>; R], w: &[u8], n: usize, out: &mut [[f32; R]]) {
    let row_bytes = n / ty.block_elems() * ty.block_bytes();
    for (res, wr) in out.iter_mut().zip(w.chunks_exact(row_bytes)) {
        *res = row_portable(ty, x, wr, n);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Act, GgmlType, QK};
    use crate::quant::scale_min_k4_int;

    pub(super) use crate::quant::avx2::available;
    use crate::quant::avx2::f16_at as f16;

    /// Whether this CPU has AVX-VNNI (`vpdpbusd` on 256-bit vectors).
    pub(super) fn vnni() -> bool {
        std::arch::is_x86_feature_detected!("avxvnni")
    }

    /// Whether this CPU has AVX512-VNNI with VL (`vpdpbusd` on 256-bit vectors, EVEX-encoded).
    pub(super) fn vnni_vl() -> bool {
        std::arch::is_x86_feature_detected!("avx512vnni") && std::arch::is_x86_feature_detected!("avx512vl")
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
                                    // SAFETY: chunk xi's 8 * ROWS scales lie in `group.scales` (asserted
                                    // above), row r's 8 from `8 * (xi * ROWS + r)`; unaligned load.
                                    let xd = unsafe {
                                        _mm256_loadu_ps(group.scales.as_ptr().add(8 * (xi * super::ROWS + r)))
                                    };
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
                let (q, xd) = unsafe {
                    (_mm256_loadu_si256(q.as_ptr().add(r * QK).cast()), _mm256_loadu_ps(xd.as_ptr().add(8 * r)))
                };
                let lanes =
                    _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(abs, _mm256_sign_epi8(q, v)), isc));
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
                            let bit = _mm256_and_si256(
                                _mm256_srl_epi16(qh, _mm_cvtsi32_si128(c as i32)),
                                _mm256_set1_epi8(1),
                            );
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
}

/// The AVX-512 kernel: each vector holds one chunk's 8 lanes for two activation rows ([`Pairs`]), so
/// every lane is the lane the portable kernel computes for that row, accumulated in the same order.
/// Every type's lanes are one `vpdpbusd` of the activations plus 128 (unsigned) with the signed weight
/// values, started from `-128 * sum(v)` over the lane's four weights: exactly `sum(v * q)`, in 32 bits
/// that cannot overflow (at most `4 * 255 * 128`). The K-quants' integer scales multiply the lanes as
/// floats, which is exact (below `2^24`: at most `4 * 32 * 127 * 128`), so it is the portable
/// `isc * sum(v * q)`.
#[cfg(target_arch = "x86_64")]
mod avx512 {
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
    fn tile_of<const SCALED: bool>(
        panel: &Panel,
        j0: usize,
        x: &Pairs,
        p0: usize,
    ) -> [[f32; 2 * TILE_PAIRS]; TILE_ROWS] {
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
        let (xq, xd) =
            (&x.q[xs * 2 * QK..][..chunks * TILE_PAIRS * 2 * QK], &x.d[xs * 16..][..chunks * TILE_PAIRS * 16]);
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
                let (wv, wb, wd) =
                    (_mm512_broadcast_i64x4(v[j]), _mm512_broadcast_i64x4(bias[j]), _mm512_set1_ps(d[j]));
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
                let m =
                    panel.m[Panel::at(chunks, j0, 0)..Panel::at(chunks, j0, chunks)].iter().skip(j).step_by(TILE_ROWS);
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

    /// `x[r] . w` for weight rows four at a time (`out.len()` of them, a multiple of 4) of a type whose
    /// blocks are one chunk of 32 values ([`super::quad_bias`]), for `R` activation rows: two weight rows
    /// per vector, each row's 8 lanes where the portable kernel has them, accumulated chunk after chunk
    /// with the same multiply-adds. The four rows' values are unpacked once for all `R` activation rows,
    /// as unsigned bytes `v + o`, the operand `vpdpbusd` takes unsigned, against the signed activations;
    /// the lanes start from `bias`, the activations' `-o * (the sum of each lane's four values)` (made
    /// once per product), so each is exactly `sum(v * q)`, in 32 bits that cannot overflow (at most
    /// `4 * 255 * 128` either way). The four blocks' scales (and offsets) are widened together and
    /// multiplied by each activation row's, one product per output as the portable kernel forms it.
    ///
    /// Against the pair kernel, which unpacks each weight chunk once per activation pair and forms its
    /// bias from the weights, this cut Gemma 3's head (262144 x 640 Q8_0) for one activation row from
    /// the 256-bit kernel's 19 instructions per block to about 6, and for four rows from 26 to about 13.
    ///
    /// # Safety
    ///
    /// [`available`] and the AVX2 kernel's features; `ty` has a quad kernel, `w` holds `out.len()` rows
    /// of `n` values as whole blocks, and every `x[r]` and `bias[r]` cover `n` values.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn quads<const R: usize>(
        ty: GgmlType,
        x: [super::Act<'_>; R],
        bias: [&[[i32; 8]]; R],
        w: &[u8],
        n: usize,
        out: &mut [[f32; R]],
    ) {
        match ty {
            GgmlType::Q8_0 => quads_of::<R, 8>(x, bias, w, n, out),
            GgmlType::Q4_0 => quads_of::<R, 2>(x, bias, w, n, out),
            GgmlType::Q4_1 => quads_of::<R, 3>(x, bias, w, n, out),
            GgmlType::Q5_0 => quads_of::<R, 6>(x, bias, w, n, out),
            GgmlType::Q5_1 => quads_of::<R, 7>(x, bias, w, n, out),
            _ => unreachable!("a type with a quad kernel"),
        }
    }

    /// [`quads`] for the type with GGML id `T`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    fn quads_of<const R: usize, const T: u32>(
        x: [super::Act<'_>; R],
        bias: [&[[i32; 8]]; R],
        w: &[u8],
        n: usize,
        out: &mut [[f32; R]],
    ) {
        let ty = GgmlType::from_id(T).expect("a GGML type id");
        let bb = ty.block_bytes();
        let chunks = n / QK;
        let row_bytes = chunks * bb;
        assert!(
            ty.block_elems() == QK
                && n.is_multiple_of(QK)
                && out.len().is_multiple_of(4)
                && w.len() >= out.len() * row_bytes
                && x.iter().all(|x| x.q.len() >= n && x.d.len() >= chunks && x.s.len() >= chunks)
                && bias.iter().all(|b| b.len() >= chunks),
            "quads operands"
        );
        let offset = super::has_offset(ty);
        // Lanes 0-7 take the first row's scale of a pair, lanes 8-15 the second's.
        let firsts = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        let seconds = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        for (g, out) in out.chunks_exact_mut(4).enumerate() {
            let rows = w[4 * g * row_bytes..].as_ptr();
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            let mut off = [_mm_setzero_ps(); R];
            for i in 0..chunks {
                // The rows are read side by side: in the stream of rows, a step is every row's block.
                crate::quant::prefetch(w.as_ptr(), 4 * g * row_bytes + i * 4 * bb, 4 * bb);
                // SAFETY: block `i` of rows `4g..4g + 4` lies in `w` (asserted), `bb` bytes from each of
                // these. (Plain pointers and no closures: a closure is not compiled with this function's
                // target features, and was a call per block.)
                let blocks = unsafe {
                    let at = rows.add(i * bb);
                    [at, at.add(row_bytes), at.add(2 * row_bytes), at.add(3 * row_bytes)]
                };
                // SAFETY: as above; `bb` is the type's block length.
                let pair = unsafe { [pair_values::<T>(blocks[0], blocks[1]), pair_values::<T>(blocks[2], blocks[3])] };
                // SAFETY: as above: the scale's 2 bytes at 0, the offset's at 2 where there is one.
                let (scales, ms) =
                    unsafe { (f16x4(blocks, 0), if offset { f16x4(blocks, 2) } else { _mm_setzero_ps() }) };
                for r in 0..R {
                    // SAFETY: chunk i < n / 32 of a row of n values and of its biases (asserted);
                    // unaligned loads.
                    let (q, start, xd, xs) = unsafe {
                        (
                            _mm512_broadcast_i64x4(_mm256_loadu_si256(x[r].q.as_ptr().add(i * QK).cast())),
                            _mm512_broadcast_i64x4(_mm256_loadu_si256(bias[r].as_ptr().add(i).cast())),
                            *x[r].d.get_unchecked(i),
                            *x[r].s.get_unchecked(i),
                        )
                    };
                    // Each row's scale times the activations': the portable kernel's `d * xd`.
                    let dd = _mm512_castps128_ps512(_mm_mul_ps(scales, _mm_set1_ps(xd)));
                    for (k, idx) in [firsts, seconds].into_iter().enumerate() {
                        let lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, pair[k], q));
                        acc[r][k] = _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, dd), lanes, acc[r][k]);
                    }
                    if offset {
                        // The portable kernel's `m * s + off`, for the four rows at once.
                        off[r] = _mm_fmadd_ps(ms, _mm_set1_ps(xs), off[r]);
                    }
                }
            }
            for (r, (acc, off)) in acc.iter().zip(&off).enumerate() {
                let mut offs = [0f32; 4];
                // SAFETY: 4 floats; unaligned store.
                unsafe { _mm_storeu_ps(offs.as_mut_ptr(), *off) };
                for (k, acc) in acc.iter().enumerate() {
                    let mut lanes = [0f32; 16];
                    // SAFETY: 16 floats; unaligned store.
                    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *acc) };
                    for h in 0..2 {
                        let lanes = std::array::from_fn(|l| lanes[8 * h + l]);
                        out[2 * k + h][r] = super::tree8(lanes) + offs[2 * k + h];
                    }
                }
            }
        }
    }

    /// The f16s at byte `at` of the four blocks, widened by the CPU (exact).
    ///
    /// # Safety
    ///
    /// Each block holds 2 bytes from `at`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn f16x4(blocks: [*const u8; 4], at: usize) -> __m128 {
        // SAFETY: 2 bytes from `at` in each block (the caller's contract); unaligned reads.
        let [a, b, c, d] = unsafe {
            [
                blocks[0].add(at).cast::<i16>().read_unaligned(),
                blocks[1].add(at).cast::<i16>().read_unaligned(),
                blocks[2].add(at).cast::<i16>().read_unaligned(),
                blocks[3].add(at).cast::<i16>().read_unaligned(),
            ]
        };
        let [a, b, c, d] = [i16::from_le(a), i16::from_le(b), i16::from_le(c), i16::from_le(d)];
        _mm_cvtph_ps(_mm_setr_epi16(a, b, c, d, 0, 0, 0, 0))
    }

    /// The 32 values of blocks `a` and `b` of the type with GGML id `T` as unsigned bytes `v + o`
    /// ([`super::quad_bias`]), `a`'s in bytes 0-31 and `b`'s in 32-63, in position order.
    ///
    /// # Safety
    ///
    /// `a` and `b` each point to a whole block of the type.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn pair_values<const T: u32>(a: *const u8, b: *const u8) -> __m512i {
        if T == 8 {
            // SAFETY: bytes 2..34 of each block (the caller's contract); unaligned loads.
            let (va, vb) = unsafe { (_mm256_loadu_si256(a.add(2).cast()), _mm256_loadu_si256(b.add(2).cast())) };
            return _mm512_xor_si512(_mm512_inserti64x4::<1>(_mm512_castsi256_si512(va), vb), _mm512_set1_epi8(-128));
        }
        // Where the nibbles start: after the scale, the offset and the fifth bits.
        let at = match T {
            2 => 2,
            3 => 4,
            6 => 6,
            _ => 8,
        };
        // SAFETY: 16 bytes of nibble pairs from `at` in each block (the caller's contract); unaligned
        // loads.
        let (qa, qb) = unsafe { (_mm_loadu_si128(a.add(at).cast()), _mm_loadu_si128(b.add(at).cast())) };
        // 128-bit lanes: a's bytes, a's again, b's, b's; the low nibbles of the first of each, the high
        // nibbles of the second (positions 0-15, then 16-31).
        let both = _mm512_castsi256_si512(_mm256_set_m128i(qb, qa));
        let twice = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), both);
        let highs = _mm512_mask_blend_epi64(0b1100_1100, twice, _mm512_srli_epi16::<4>(twice));
        let values = _mm512_and_si512(highs, _mm512_set1_epi8(0x0F));
        if matches!(T, 6 | 7) {
            // Bit `k` of a block's `qh` (the 4 bytes before the nibbles) is position `k`'s fifth bit (16):
            // a byte mask of both blocks.
            // SAFETY: as above; unaligned reads.
            let (ha, hb) =
                unsafe { (a.add(at - 4).cast::<u32>().read_unaligned(), b.add(at - 4).cast::<u32>().read_unaligned()) };
            let mask = u64::from(u32::from_le(ha)) | u64::from(u32::from_le(hb)) << 32;
            return _mm512_mask_add_epi8(values, mask, values, _mm512_set1_epi8(16));
        }
        values
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
                    let isc = _mm512_mask_blend_ps(
                        0xF0F0,
                        _mm512_set1_ps(f32::from(isc[0])),
                        _mm512_set1_ps(f32::from(isc[1])),
                    );
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize_blocks;

    const TYPES: [GgmlType; 8] = [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];

    /// Every kernel this CPU runs.
    fn kernels() -> Vec<Kernel> {
        let mut all = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        if avx2::available() {
            all.push(Kernel::Avx2);
            if avx2::vnni() {
                all.push(Kernel::Vnni);
            }
            if avx2::vnni_vl() {
                all.push(Kernel::VnniVl);
            }
            if avx512::available() {
                all.push(Kernel::Avx512);
            }
        }
        all
    }

    /// Every chunk is the block's dequantized values, up to the rounding of `d * isc * v + m`.
    #[test]
    fn chunks_are_the_dequantized_weights() {
        for (i, ty) in TYPES.into_iter().enumerate() {
            let bytes = super::super::tests::random_blocks(ty, 4 * ty.block_elems(), i as u32);
            let mut want = vec![0f32; 4 * ty.block_elems()];
            dequantize_blocks(ty, &bytes, &mut want);
            for (bi, b) in bytes.chunks_exact(ty.block_bytes()).enumerate() {
                for c in 0..ty.block_elems() / QK {
                    let ch = chunk(ty, b, c);
                    for k in 0..QK {
                        let got = ch.d * f32::from(ch.isc[k / 16]) * f32::from(ch.v[k]) + ch.m;
                        let want = want[bi * ty.block_elems() + c * QK + k];
                        assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "{} chunk {c} value {k}", ty.name());
                    }
                }
            }
        }
    }

    /// Every SIMD kernel gives the portable kernel's bits for every block type, batch and weight row
    /// (the tiled AVX-512 kernel from [`TILED_FROM`] rows on, the tiled 256-bit one from
    /// [`TILED_FROM_256`] with whole and partial groups of rows, with partial tiles of pairs and of weight
    /// rows; the quad kernel of the 32-value types up to [`QUAD_ACTS`] rows, with weight rows left
    /// over), and the products are the dequantized weights' within the activations' quantization.
    #[test]
    fn simd_equals_portable_on_every_block_type_in_any_batch() {
        let (n, rows, t) = (512, 37, 39);
        let x: Vec<f32> = (0..t * n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let xq = Q8::new(&x, t, n).unwrap();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for (i, ty) in TYPES.into_iter().enumerate() {
            let w = super::super::tests::random_blocks(ty, rows * n, 7 + i as u32);
            let mut f = vec![0f32; rows * n];
            dequantize_blocks(ty, &w, &mut f);
            let mut portable = vec![0f32; t * rows];
            dots(&Acts::new(&xq, false), ty, &w, 0..rows, &mut portable);
            for r in 0..t {
                for j in 0..rows {
                    let exact: f32 = (0..n).map(|k| x[r * n + k] * f[j * n + k]).sum();
                    let scale: f32 = (0..n).map(|k| (x[r * n + k] * f[j * n + k]).abs()).sum();
                    let got = portable[r * rows + j];
                    assert!((got - exact).abs() <= 0.02 * scale + 1e-4, "{}: {got} vs {exact}", ty.name());
                }
            }
            for kernel in kernels() {
                let mut all = vec![0f32; t * rows];
                dots(&Acts::with(kernel, &xq), ty, &w, 0..rows, &mut all);
                assert_eq!(bits(&all), bits(&portable), "{} {kernel:?}, every row", ty.name());
                let lens = [(0, 1), (3, 1), (1, 2), (2, 3), (0, 4), (1, 6), (0, 7), (3, 16), (1, 17), (6, 33)];
                // Every width of the 256-bit tiled kernel's last group (8 + 2 ..= 8 + 6).
                let groups = [(2, 10), (1, 11), (0, 12), (0, 13), (4, 14)];
                for (from, len) in lens.into_iter().chain(groups) {
                    let xs = Q8::new(&x[from * n..(from + len) * n], len, n).unwrap();
                    // Three weight rows: a pair of them side by side, then one alone.
                    let mut got = vec![0f32; len * 3];
                    dots(&Acts::with(kernel, &xs), ty, &w, 3..6, &mut got);
                    let want: Vec<f32> =
                        (from..from + len).flat_map(|r| portable[r * rows + 3..r * rows + 6].to_vec()).collect();
                    assert_eq!(bits(&got), bits(&want), "{} {kernel:?} rows {from}+{len}", ty.name());
                }
                // A decode step's rows against many weight rows: Q8_0's quad kernel, then its last rows
                // by the others.
                for (from, len) in [(0, 1), (5, 2), (2, 3), (9, 4)] {
                    let xs = Q8::new(&x[from * n..(from + len) * n], len, n).unwrap();
                    for js in [0..rows, 2..rows, 4..12] {
                        let mut got = vec![0f32; len * js.len()];
                        dots(&Acts::with(kernel, &xs), ty, &w, js.clone(), &mut got);
                        let want: Vec<f32> = (from..from + len)
                            .flat_map(|r| portable[r * rows + js.start..r * rows + js.end].to_vec())
                            .collect();
                        assert_eq!(bits(&got), bits(&want), "{} {kernel:?} rows {from}+{len}, {js:?}", ty.name());
                    }
                }
            }
        }
    }
}
