//! `fast` precision on the GGUF's own blocks: integer dot products of each weight block with the
//! activations quantized to 8 bits, with no re-quantized or f32 copy of any weight.
//!
//! Most matrices are multiplied with their rows interleaved sixteen at a time ([`interleaved`], in the
//! order it defines): every matrix of the types it covers whose rows are whole groups, which is every
//! matrix of both real models. What follows is the row-major blocks' order and kernels, for the rest
//! (Q5_K, and row counts that are not whole groups).
//!
//! Every 32 weights of every supported block type form one *chunk*: 32 small integers `v`, an integer
//! scale for each half of 16 (`isc`; 1 for the 32-value types), a float scale `d` and, for the types
//! with an offset (Q4_1, Q5_1, Q4_K, Q5_K), a float offset `m`, so that weight `k` is
//! `d * isc[k / 16] * v[k] + m`. Activations are [`Q8`] rows: per 32 values a scale `xd`, 32 integers
//! `q` (quantized once per input, shared by every product that reads it) and the sum `xs = xd * sum(q)`
//! of the quantized values (llama.cpp's Q8_1 holds the same), so that every product is the weights'
//! with the quantized activations (see [`super::q8`]'s `block_sum` for why not the exact sum).
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
    /// Whether this CPU runs the AVX-512 kernels (so the interleaved ones too), for any row count.
    wide: bool,
    pairs: Option<Pairs>,
    /// The rows in groups for the 256-bit tiled kernel, where it runs (from [`TILED_FROM_256`] rows).
    octets: Option<Octets>,
    /// Where the 256-bit row kernel runs on more than one row: the rows in groups of [`ROWS`], their
    /// operands interleaved for it ([`Group`]).
    sums: Vec<f32>,
    scales: Vec<f32>,
    /// Every row's sums of the first and last 16 values of each chunk, for the interleaved kernels:
    /// made by the first task that needs them and shared by the input's other tasks and products.
    halves: std::sync::OnceLock<Vec<[i32; 2]>>,
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

    /// The rows of `q8` as they are, for the interleaved kernels alone ([`interleaved`]): none of the
    /// row-major kernels' layouts is made (a prefill's activations were laid out in pairs for nothing).
    pub(crate) fn rows_only(q8: &'a Q8, simd: bool) -> Self {
        Acts::bare(Kernel::best(simd), q8)
    }

    /// Every row's sums per chunk of its first and last 16 values, for the interleaved kernels: where
    /// their unsigned weights `u = v + o` meet the activations, the integer sums start from `-o` times
    /// these, so they come out as `sum(v * q)`. Made once per input, by the first caller; a product calls
    /// it before its parallel region, so that no task waits on another's (a thread that blocked on it
    /// was put to sleep and woken again, which cost more than the sums on a VM).
    pub(crate) fn halves(&self) -> &[[i32; 2]] {
        self.halves.get_or_init(|| {
            (0..self.q8.rows)
                .flat_map(|r| {
                    self.q8
                        .act(r)
                        .q
                        .chunks_exact(QK)
                        .map(|c| std::array::from_fn(|h| c[16 * h..16 * h + 16].iter().map(|&q| i32::from(q)).sum()))
                })
                .collect()
        })
    }

    /// The rows of `q8` for `kernel`, with none of the row-major kernels' layouts.
    fn bare(kernel: Kernel, q8: &'a Q8) -> Self {
        #[cfg(target_arch = "x86_64")]
        let wide = kernel == Kernel::Avx512;
        #[cfg(not(target_arch = "x86_64"))]
        let wide = false;
        Acts {
            q8,
            kernel,
            wide,
            pairs: None,
            octets: None,
            sums: Vec::new(),
            scales: Vec::new(),
            halves: Default::default(),
        }
    }

    fn with(kernel: Kernel, q8: &'a Q8) -> Self {
        let bare = Acts::bare(kernel, q8);
        // A single row would fill half of every vector of the pair kernel: the 256-bit kernels serve it
        // as well.
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
        Acts { kernel, pairs, octets, sums, scales, ..bare }
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
                        // SAFETY: as above, and AVX-512F, AVX512-VNNI and VL are present.
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

mod interleaved;
pub(crate) use interleaved::dots as interleaved_dots;

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(test)]
mod tests;
