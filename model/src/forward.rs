//! The forward pass: f32 activations on dequantized weights (`exact`) or Q8_0 products (`fast`).
//!
//! [`Model::forward_batch`] runs a batch of [`Segment`]s — each some tokens of one sequence at positions
//! `start..start + n`, over that sequence's [`PastKv`] — as one pass: every linear layer is one product
//! over all the batch's rows, so each weight is read once per step, while attention stays within each
//! segment. It returns each segment's K/V for every layer (so a producer can lay it out dense or
//! grouped, or the host can ingest it) and its logits. A sliding layer at position `p` sees exactly
//! `p - window + 1 ..= p`.
//!
//! A row's results do not depend on the rest of its batch nor on where its chunk starts: the kernels
//! compute every output in one fixed order ([`crate::kernels`]); each chunk's K/V is rounded to the
//! cache's element type ([`Model::kv_dtype`]) before anything attends to it, so a position reads the
//! same values whether it is in the current chunk or in the cache; and attention visits the visible
//! positions in order for each query row and head, whichever others share its task.

use std::borrow::Cow;
use std::ops::Range;

use half::{bf16, f16};
use rayon::prelude::*;
use shm_format::Dtype;

use crate::arch::{Arch, Attention, FastWeights, Model};
use crate::kernels::{Dot, Elem, Gate};

/// One run of past K/V: consecutive positions from `start`, each row `kv_heads * head_dim` values.
#[derive(Debug)]
pub struct Run<'a> {
    /// First position.
    pub start: u64,
    /// K rows, position-major.
    pub k: KvValues<'a>,
    /// V rows, position-major.
    pub v: KvValues<'a>,
}

/// A run's K or V values in the cache's own element type, borrowed from the cache where its memory
/// allows (attention widens 16-bit values to f32 in registers as it loads them, never into a copy).
/// Every run a [`PastKv`] gives has one element type.
#[derive(Debug)]
pub enum KvValues<'a> {
    /// f32.
    F32(Cow<'a, [f32]>),
    /// bfloat16.
    Bf16(Cow<'a, [bf16]>),
    /// IEEE half.
    F16(Cow<'a, [f16]>),
}

impl KvValues<'_> {
    /// The element type.
    pub fn dtype(&self) -> Dtype {
        match self {
            KvValues::F32(_) => Dtype::F32,
            KvValues::Bf16(_) => Dtype::Bf16,
            KvValues::F16(_) => Dtype::F16,
        }
    }

    /// How many values.
    pub fn len(&self) -> usize {
        match self {
            KvValues::F32(v) => v.len(),
            KvValues::Bf16(v) => v.len(),
            KvValues::F16(v) => v.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An element type a cache holds K/V in: its values in a [`KvValues`], and a chunk's values (already
/// rounded to it) narrowed to it, exactly.
trait CacheElem: Elem {
    /// The values, if they are of this type.
    fn of<'b>(values: &'b KvValues<'_>) -> Option<&'b [Self]>;
    /// `x`, a value of this type held as f32.
    fn narrow(x: f32) -> Self;
}

impl CacheElem for f32 {
    fn of<'b>(values: &'b KvValues<'_>) -> Option<&'b [f32]> {
        match values {
            KvValues::F32(v) => Some(v),
            _ => None,
        }
    }
    fn narrow(x: f32) -> f32 {
        x
    }
}

impl CacheElem for bf16 {
    fn of<'b>(values: &'b KvValues<'_>) -> Option<&'b [bf16]> {
        match values {
            KvValues::Bf16(v) => Some(v),
            _ => None,
        }
    }
    fn narrow(x: f32) -> bf16 {
        bf16::from_f32(x)
    }
}

impl CacheElem for f16 {
    fn of<'b>(values: &'b KvValues<'_>) -> Option<&'b [f16]> {
        match values {
            KvValues::F16(v) => Some(v),
            _ => None,
        }
    }
    fn narrow(x: f32) -> f16 {
        f16::from_f32(x)
    }
}

/// K/V of positions before a chunk.
pub trait PastKv: Sync {
    /// Consecutive runs covering exactly `positions` of `layer`, in order.
    fn runs(&self, layer: usize, positions: Range<u64>) -> Vec<Run<'_>>;
}

/// No earlier positions.
#[derive(Debug)]
pub struct NoPast;

impl PastKv for NoPast {
    fn runs(&self, _: usize, positions: Range<u64>) -> Vec<Run<'_>> {
        assert!(positions.is_empty(), "no past K/V for positions {positions:?}");
        Vec::new()
    }
}

/// Some tokens of one sequence, for [`Model::forward_batch`].
#[derive(Clone, Copy)]
pub struct Segment<'a> {
    /// The tokens, at least one.
    pub tokens: &'a [u32],
    /// Position of the first.
    pub start: u64,
    /// The sequence's K/V before `start`.
    pub past: &'a dyn PastKv,
    /// Logits of every token rather than of the last.
    pub all_logits: bool,
}

impl std::fmt::Debug for Segment<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment").field("tokens", &self.tokens.len()).field("start", &self.start).finish()
    }
}

/// The K/V a chunk produced, per layer: `tokens x kv_heads x head_dim` f32, token-major.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChunkKv {
    /// First position.
    pub start: u64,
    /// Tokens.
    pub len: usize,
    /// Per layer.
    pub k: Vec<Vec<f32>>,
    /// Per layer.
    pub v: Vec<Vec<f32>>,
}

/// What [`Model::forward`] returns.
#[derive(Debug)]
pub struct Output {
    /// The chunk's K/V.
    pub kv: ChunkKv,
    /// Logits of the last position, or of every position (`tokens x vocab`) if asked.
    pub logits: Vec<f32>,
}

/// Rows of a pass from which its row-wise steps (norms, rotations, residual additions, activations) run
/// on the pool's threads: below it (a decode step's few rows) the hand-off costs more than the work. Run
/// on one thread, they were about 5% of a two-thread prefill's samples, while the other thread waited.
const PAR_ROWS: usize = 16;

/// `f(i, row)` for every row `i` of `x` (`width` values each): on the pool's threads from [`PAR_ROWS`]
/// rows on, every row whole on one thread, so no bit depends on which.
fn each_row(x: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    if x.len() >= PAR_ROWS * width {
        x.par_chunks_exact_mut(width).with_min_len(PAR_ROWS / 4).enumerate().for_each(|(i, row)| f(i, row));
    } else {
        x.chunks_exact_mut(width).enumerate().for_each(|(i, row)| f(i, row));
    }
}

/// `x`, each row RMS-normalized with weights `w`.
fn normed(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut h = vec![0f32; x.len()];
    each_row(&mut h, w.len(), |i, row| {
        row.copy_from_slice(&x[i * w.len()..(i + 1) * w.len()]);
        rms_norm(row, w, eps);
    });
    h
}

/// The residual addition `x += norm(y)` (or `x += y` without a norm), rows of `width` values, on the
/// pool's threads as [`each_row`].
fn add_normed(x: &mut [f32], mut y: Vec<f32>, width: usize, norm: Option<&[f32]>, eps: f32) {
    let add = |(row, y): (&mut [f32], &mut [f32])| {
        if let Some(w) = norm {
            rms_norm(y, w, eps);
        }
        row.iter_mut().zip(&*y).for_each(|(a, b)| *a += b);
    };
    if x.len() >= PAR_ROWS * width {
        x.par_chunks_exact_mut(width).zip(y.par_chunks_exact_mut(width)).with_min_len(PAR_ROWS / 4).for_each(add);
    } else {
        x.chunks_exact_mut(width).zip(y.chunks_exact_mut(width)).for_each(add);
    }
}

fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(w.len()) {
        let mean = row.iter().map(|v| v * v).sum::<f32>() / w.len() as f32;
        let r = 1.0 / (mean + eps).sqrt();
        for (v, &g) in row.iter_mut().zip(w) {
            *v = *v * r * g;
        }
    }
}

/// The rotation of position `pos` for heads of `d` values: `(sin, cos)` of each pair's angle, computed
/// once per position for all of its heads.
fn rope_angles(pos: u64, base: f32, d: usize, out: &mut Vec<(f32, f32)>) {
    out.clear();
    out.extend((0..d / 2).map(|i| {
        let inv = 1.0 / base.powf((2 * i) as f32 / d as f32);
        (pos as f32 * inv).sin_cos()
    }));
}

/// Rotates `x` (one head, `head_dim` values) by the angles of [`rope_angles`].
fn rope(x: &mut [f32], angles: &[(f32, f32)], adjacent: bool) {
    let d = x.len();
    for (i, &(sin, cos)) in angles.iter().enumerate() {
        let (a, b) = if adjacent { (2 * i, 2 * i + 1) } else { (i, i + d / 2) };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * cos - x1 * sin;
        x[b] = x1 * cos + x0 * sin;
    }
}

/// The nearest `dtype` value to `x` (ties to even), as f32.
pub fn round_to(dtype: Dtype, x: f32) -> f32 {
    match dtype {
        Dtype::F32 => x,
        Dtype::F16 => half::f16::from_f32(x).to_f32(),
        Dtype::Bf16 => half::bf16::from_f32(x).to_f32(),
    }
}

/// Consecutive rows of one segment per attention task: their queries share each K/V row loaded.
const ATTN_ROWS: usize = 4;

/// The K and V rows a segment's queries may see at one layer, from position `from` on: the past's, read
/// in place, then the chunk's, all in the past's element type.
struct Visible<'a, E> {
    from: u64,
    k: Vec<&'a [E]>,
    v: Vec<&'a [E]>,
}

impl<'a, E: CacheElem> Visible<'a, E> {
    /// The rows of `runs` (all of element type `E`), then those of the chunk (`k`, `v`), `row` values
    /// each.
    fn new(from: u64, runs: &'a [Run<'_>], k: &'a [E], v: &'a [E], row: usize) -> Self {
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        for run in runs {
            let of = |values| E::of(values).unwrap_or_else(|| panic!("past K/V runs of one element type"));
            ks.extend(of(&run.k).chunks_exact(row));
            vs.extend(of(&run.v).chunks_exact(row));
        }
        ks.extend(k.chunks_exact(row));
        vs.extend(v.chunks_exact(row));
        Visible { from, k: ks, v: vs }
    }
}

/// A segment's [`Visible`] rows, in its past's element type.
enum AnyVisible<'a> {
    F32(Visible<'a, f32>),
    Bf16(Visible<'a, bf16>),
    F16(Visible<'a, f16>),
}

/// A chunk's K and V narrowed to its past's 16-bit element type (exact: they are rounded to the
/// cache's type already), so that a segment's rows are of one type.
enum Narrowed {
    /// The past is f32, or there is none: the chunk's f32 rows are read as they are.
    No,
    Bf16(Vec<bf16>, Vec<bf16>),
    F16(Vec<f16>, Vec<f16>),
}

/// Where each row of a batch comes from.
struct Rows {
    /// Per row: its segment.
    segment: Vec<usize>,
    /// Per row: its position.
    pos: Vec<u64>,
    /// Per segment: its first row.
    first: Vec<usize>,
}

impl Rows {
    fn of(segments: &[Segment<'_>]) -> Self {
        let mut rows = Rows { segment: Vec::new(), pos: Vec::new(), first: Vec::new() };
        for (s, seg) in segments.iter().enumerate() {
            rows.first.push(rows.pos.len());
            for i in 0..seg.tokens.len() as u64 {
                rows.segment.push(s);
                rows.pos.push(seg.start + i);
            }
        }
        rows
    }
}

impl Model {
    /// Runs `tokens` at positions `start..`, attending to `past` for earlier positions.
    pub fn forward(&self, tokens: &[u32], start: u64, past: &dyn PastKv, all_logits: bool) -> Output {
        let mut out = self.forward_batch(&[Segment { tokens, start, past, all_logits }]);
        out.pop().expect("one output per segment")
    }

    /// Runs every segment in one pass (see the module documentation); one output per segment, in order.
    /// Each segment's output is bit for bit what [`Model::forward`] gives it alone.
    pub fn forward_batch(&self, segments: &[Segment<'_>]) -> Vec<Output> {
        // The whole pass runs on the pool, so its many products and attention layers hand work to the
        // pool's threads from inside it (cheap), not each from the caller's thread (a wake-up and a
        // context switch every time: 13% of a decode step with 1 thread), and the other threads stay
        // awake between them (`Exec::install_awake`).
        self.exec.install_awake(|| self.forward_in_pool(segments))
    }

    fn forward_in_pool(&self, segments: &[Segment<'_>]) -> Vec<Output> {
        let c = &self.config;
        let (hd, kvd, qd) = (c.head_dim, c.kv_heads * c.head_dim, c.heads * c.head_dim);
        assert!(segments.iter().all(|s| !s.tokens.is_empty()), "a segment has at least one token");
        let rows = Rows::of(segments);
        let t = rows.pos.len();
        let mut x = vec![0f32; t * c.hidden];
        let mut buf = Vec::new();
        // A tied embedding is read from `fast`'s interleaved copy of the head where there is one (the same
        // values), so the file's pages, released when it was made, stay out.
        let embed = if self.lm_head.is_none() { FastWeights::head(self.q8.as_ref(), &self.embed) } else { &self.embed };
        for (row, &tok) in x.chunks_exact_mut(c.hidden).zip(segments.iter().flat_map(|s| s.tokens)) {
            let tok = tok as usize;
            assert!(tok < c.vocab, "token id {tok} outside the vocabulary of {}", c.vocab);
            row.copy_from_slice(embed.rows(tok..tok + 1, c.hidden, &mut buf));
        }
        if c.arch == Arch::Gemma3 {
            let scale = (c.hidden as f32).sqrt();
            x.iter_mut().for_each(|v| *v *= scale);
        }
        let mut layers_kv = Vec::with_capacity(self.layers.len());
        // Per RoPE base (its bits): every row's rotation angles, `head_dim / 2` per row.
        let mut rotations: Vec<(u32, Vec<(f32, f32)>)> = Vec::new();
        for (l, w) in self.layers.iter().enumerate() {
            let h = normed(&x, &w.attn_norm, c.eps);
            let lq = self.q8.as_ref().map(|q| &q.layers[l]);
            let q8 = |i: usize| lq.and_then(|q| q[i].as_ref());
            // The matrix as `fast` multiplies it where it has another layout.
            let m = |i: usize, w| FastWeights::layer(self.q8.as_ref(), l, i, w);
            let [mut q, mut k, mut v] = self.exec.matmul_many(
                &h,
                [(m(0, &w.wq), q8(0), qd), (m(1, &w.wk), q8(1), kvd), (m(2, &w.wv), q8(2), kvd)],
                t,
                c.hidden,
            );
            if let Some(qn) = &w.q_norm {
                each_row(&mut q, qd, |_, row| rms_norm(row, qn, c.eps));
            }
            if let Some(kn) = &w.k_norm {
                each_row(&mut k, kvd, |_, row| rms_norm(row, kn, c.eps));
            }
            let base = match c.layers[l] {
                Attention::Full => c.rope_global,
                Attention::Sliding(_) => c.rope_local,
            };
            // Every row's angles for this base, computed by the first layer that uses it (a `powf` and a
            // `sin_cos` per pair, per row and per layer, were 1-2% of a prefill).
            let at = match rotations.iter().position(|(b, _)| *b == base.to_bits()) {
                Some(at) => at,
                None => {
                    let mut all = Vec::with_capacity(t * hd / 2);
                    let mut angles = Vec::with_capacity(hd / 2);
                    for &pos in &rows.pos {
                        rope_angles(pos, base, hd, &mut angles);
                        all.extend_from_slice(&angles);
                    }
                    rotations.push((base.to_bits(), all));
                    rotations.len() - 1
                }
            };
            let angles = &rotations[at].1;
            for (x, width) in [(&mut q, qd), (&mut k, kvd)] {
                each_row(x, width, |i, row| {
                    for head in row.chunks_exact_mut(hd) {
                        rope(head, &angles[i * hd / 2..(i + 1) * hd / 2], c.rope_adjacent);
                    }
                });
            }
            // From here on the chunk's K/V are what the cache will hold.
            if self.kv_dtype != Dtype::F32 {
                for x in [&mut k, &mut v] {
                    each_row(x, kvd, |_, row| row.iter_mut().for_each(|x| *x = round_to(self.kv_dtype, *x)));
                }
            }
            let attn = self.attention(l, segments, &rows, &q, &k, &v);
            let o = self.exec.matmul_t(&attn, m(3, &w.wo), q8(3), t, qd, c.hidden);
            add_normed(&mut x, o, c.hidden, w.post_attn_norm.as_deref(), c.eps);

            let h = normed(&x, &w.ffn_norm, c.eps);
            let [gate, up] =
                self.exec.matmul_many(&h, [(m(4, &w.gate), q8(4), c.ffn), (m(5, &w.up), q8(5), c.ffn)], t, c.hidden);
            let kind = match c.arch {
                Arch::Gemma3 => Gate::GeluTanh,
                Arch::Llama => Gate::Silu,
            };
            let mut act = vec![0f32; gate.len()];
            each_row(&mut act, c.ffn, |i, row| {
                let of = i * c.ffn..(i + 1) * c.ffn;
                crate::kernels::gated_into(kind, &gate[of.clone()], &up[of], row);
            });
            let down = self.exec.matmul_t(&act, m(6, &w.down), q8(6), t, c.ffn, c.hidden);
            add_normed(&mut x, down, c.hidden, w.post_ffn_norm.as_deref(), c.eps);
            layers_kv.push((k, v));
        }
        each_row(&mut x, c.hidden, |_, row| rms_norm(row, &self.final_norm, c.eps));

        // The rows whose logits are wanted, through the head in one product.
        let mut wanted = Vec::new();
        for (s, seg) in segments.iter().enumerate() {
            let end = rows.first[s] + seg.tokens.len();
            let from = if seg.all_logits { rows.first[s] } else { end - 1 };
            wanted.extend_from_slice(&x[from * c.hidden..end * c.hidden]);
        }
        let head = FastWeights::head(self.q8.as_ref(), self.lm_head.as_ref().unwrap_or(&self.embed));
        let head_q8 = self.q8.as_ref().and_then(|q| q.head.as_ref());
        let n = wanted.len() / c.hidden;
        let mut logits = self.exec.matmul_t_rows(&wanted, head, head_q8, n, c.hidden, c.vocab).into_iter();

        let mut outputs = Vec::with_capacity(segments.len());
        let single = segments.len() == 1;
        for (s, seg) in segments.iter().enumerate() {
            let len = seg.tokens.len();
            let rows_kv = rows.first[s] * kvd..(rows.first[s] + len) * kvd;
            let mut kv = ChunkKv { start: seg.start, len, k: Vec::new(), v: Vec::new() };
            for (k, v) in &mut layers_kv {
                if single {
                    kv.k.push(std::mem::take(k));
                    kv.v.push(std::mem::take(v));
                } else {
                    kv.k.push(k[rows_kv.clone()].to_vec());
                    kv.v.push(v[rows_kv.clone()].to_vec());
                }
            }
            let count = if seg.all_logits { len } else { 1 };
            let logits = match count {
                1 => logits.next().unwrap_or_default(),
                _ => {
                    let mut all = Vec::with_capacity(count * c.vocab);
                    logits.by_ref().take(count).for_each(|row| all.extend_from_slice(&row));
                    all
                }
            };
            outputs.push(Output { kv, logits });
        }
        outputs
    }

    /// Attention of layer `l` for every row of the batch: scores against every visible position in
    /// order, read in place from the past runs or the chunk.
    ///
    /// A task is up to [`ATTN_ROWS`] consecutive rows of one segment by the query heads of one K/V
    /// head (or part of them, where there would be fewer tasks than threads), so every K/V row loaded
    /// serves all of their queries. Each query's scores, softmax and weighted sum are the same
    /// operations in the same order as for that query alone: which queries share a task never
    /// changes a bit.
    fn attention(&self, l: usize, segments: &[Segment<'_>], rows: &Rows, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
        let c = &self.config;
        let (hd, kvd, qd) = (c.head_dim, c.kv_heads * c.head_dim, c.heads * c.head_dim);
        let group = c.heads / c.kv_heads;
        let first_visible = |pos: u64| match c.layers[l] {
            Attention::Full => 0,
            Attention::Sliding(w) => (pos + 1).saturating_sub(u64::from(w)),
        };
        // Per segment: the past runs it needs, its chunk's K/V in their element type, then an index of
        // its visible rows from `from` on.
        let pasts: Vec<(u64, Vec<Run<'_>>)> = segments
            .iter()
            .map(|s| {
                let from = first_visible(s.start).min(s.start);
                let runs = s.past.runs(l, from..s.start);
                let held: usize = runs.iter().map(|r| r.k.len()).sum();
                assert_eq!(held as u64, (s.start - from) * kvd as u64, "past K/V values of layer {l}");
                (from, runs)
            })
            .collect();
        let chunk = |s: usize| rows.first[s] * kvd..(rows.first[s] + segments[s].tokens.len()) * kvd;
        let narrowed: Vec<Narrowed> = pasts
            .iter()
            .enumerate()
            .map(|(s, (_, runs))| {
                fn narrow<E: CacheElem>(x: &[f32]) -> Vec<E> {
                    x.iter().map(|&x| E::narrow(x)).collect()
                }
                match runs.first().map(|r| r.k.dtype()) {
                    Some(Dtype::Bf16) => Narrowed::Bf16(narrow(&k[chunk(s)]), narrow(&v[chunk(s)])),
                    Some(Dtype::F16) => Narrowed::F16(narrow(&k[chunk(s)]), narrow(&v[chunk(s)])),
                    _ => Narrowed::No,
                }
            })
            .collect();
        let index: Vec<AnyVisible<'_>> = pasts
            .iter()
            .zip(&narrowed)
            .enumerate()
            .map(|(s, ((from, runs), narrowed))| match narrowed {
                Narrowed::No => AnyVisible::F32(Visible::new(*from, runs, &k[chunk(s)], &v[chunk(s)], kvd)),
                Narrowed::Bf16(k, v) => AnyVisible::Bf16(Visible::new(*from, runs, k, v, kvd)),
                Narrowed::F16(k, v) => AnyVisible::F16(Visible::new(*from, runs, k, v, kvd)),
            })
            .collect();
        let mut blocks = Vec::new();
        for (s, seg) in segments.iter().enumerate() {
            let first = rows.first[s];
            for b in (0..seg.tokens.len()).step_by(ATTN_ROWS) {
                blocks.push(first + b..first + (b + ATTN_ROWS).min(seg.tokens.len()));
            }
        }
        // Heads per task: a whole group, or the largest part of it that still gives every thread a
        // task (a decode step of one or two sequences).
        let threads = self.exec.threads();
        let per = (1..=group)
            .rev()
            .filter(|&d| group.is_multiple_of(d))
            .find(|d| blocks.len() * (c.heads / d) >= threads)
            .unwrap_or(1);
        let tasks: Vec<(usize, usize)> =
            (0..blocks.len()).flat_map(|b| (0..c.heads / per).map(move |h| (b, h * per))).collect();
        let dot = Dot::new();
        let parts: Vec<Vec<f32>> = self.exec.install(|| {
            tasks
                .par_iter()
                .map(|&(b, h0)| {
                    let block = blocks[b].clone();
                    let visible = &index[rows.segment[block.start]];
                    let from = match visible {
                        AnyVisible::F32(v) => v.from,
                        AnyVisible::Bf16(v) => v.from,
                        AnyVisible::F16(v) => v.from,
                    };
                    let span = |i: usize| {
                        let pos = rows.pos[i];
                        (first_visible(pos) - from) as usize..(pos - from) as usize + 1
                    };
                    let queries: Vec<&[f32]> = block
                        .clone()
                        .flat_map(|i| (h0..h0 + per).map(move |h| &q[i * qd + h * hd..i * qd + (h + 1) * hd]))
                        .collect();
                    let spans: Vec<Range<usize>> =
                        block.clone().flat_map(|i| std::iter::repeat_n(span(i), per)).collect();
                    let at = h0 / group * hd;
                    match visible {
                        AnyVisible::F32(v) => self.attend(dot, &queries, &spans, v, at),
                        AnyVisible::Bf16(v) => self.attend(dot, &queries, &spans, v, at),
                        AnyVisible::F16(v) => self.attend(dot, &queries, &spans, v, at),
                    }
                })
                .collect()
        });
        let mut attn = vec![0f32; rows.pos.len() * qd];
        for (&(b, h0), part) in tasks.iter().zip(&parts) {
            for (i, out) in blocks[b].clone().zip(part.chunks_exact(per * hd)) {
                attn[i * qd + h0 * hd..][..per * hd].copy_from_slice(out);
            }
        }
        attn
    }

    /// One attention task: each query's output (`queries.len() x head_dim`, in order) over the visible
    /// rows `spans[i]` of its own, the K/V head's values starting at column `at`. The spans are those of
    /// consecutive positions: their starts and their ends never decrease.
    fn attend<E: Elem>(
        &self,
        dot: Dot,
        queries: &[&[f32]],
        spans: &[Range<usize>],
        visible: &Visible<'_, E>,
        at: usize,
    ) -> Vec<f32> {
        let hd = self.config.head_dim;
        let (Some(first), Some(last)) = (spans.first(), spans.last()) else {
            return Vec::new();
        };
        // Scores against every row any of them sees; each then uses its own span of them.
        let union = first.start..last.end;
        let m = union.len();
        let mut scores = vec![0f32; queries.len() * m];
        dot.of_rows_multi(queries, &visible.k[union.clone()], at, &mut scores);
        for (s, span) in scores.chunks_exact_mut(m).zip(spans) {
            crate::kernels::softmax(&mut s[span.start - union.start..span.end - union.start], self.config.query_scale);
        }
        // The weighted sums, each query's rows in order: the rows before those that all of them see,
        // one query at a time; the shared rows, all at once; then the rows after them.
        let weights =
            |i: usize, rows: Range<usize>| &scores[i * m + rows.start - union.start..i * m + rows.end - union.start];
        let shared = last.start..first.end;
        let mut out = vec![0f32; queries.len() * hd];
        let (vs, mut outs): (&[&[E]], Vec<&mut [f32]>) = (&visible.v, out.chunks_exact_mut(hd).collect());
        if shared.is_empty() {
            for (i, (o, span)) in outs.iter_mut().zip(spans).enumerate() {
                dot.add_scaled_rows(o, weights(i, span.clone()), &vs[span.clone()], at);
            }
            return out;
        }
        for (i, (o, span)) in outs.iter_mut().zip(spans).enumerate() {
            dot.add_scaled_rows(o, weights(i, span.start..shared.start), &vs[span.start..shared.start], at);
        }
        let ws: Vec<&[f32]> = (0..queries.len()).map(|i| weights(i, shared.clone())).collect();
        dot.add_scaled_rows_multi(&mut outs, &ws, &vs[shared.clone()], at);
        for (i, (o, span)) in outs.iter_mut().zip(spans).enumerate() {
            dot.add_scaled_rows(o, weights(i, shared.end..span.end), &vs[shared.end..span.end], at);
        }
        out
    }
}

/// The index of the largest value (the first, on ties, as `torch.argmax`): the first index whose value
/// no later value exceeds, so NaNs are passed over (but a NaN first value is the answer, as nothing
/// compares greater than it).
///
/// The largest value first, in eight lanes that the compiler keeps in one vector, then the first index
/// holding it, eight values at a time: a greedy step over Gemma 3's 262144 logits took 0.2 ms as one
/// compare and branch per value, serial in every decode step of every sequence.
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 8;
    match logits.first() {
        None => return 0,
        Some(x) if x.is_nan() => return 0,
        Some(_) => {}
    }
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (m, &x) in lanes.iter_mut().zip(chunk) {
            *m = if x > *m { x } else { *m };
        }
    }
    let max = lanes.iter().chain(rest).fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    let at = logits
        .chunks(LANES)
        .position(|chunk| chunk.iter().fold(false, |hit, &x| hit | (x == max)))
        .map_or(0, |c| c * LANES + logits[c * LANES..].iter().position(|&x| x == max).unwrap_or(0));
    at as u32
}

/// Past K/V kept contiguously per layer: what the model crate's own tests and tools use. pdhost's host
/// reads from its paged cache instead.
#[derive(Debug, Default)]
pub struct VecKv {
    /// Per layer, every position's K row, token-major.
    pub k: Vec<Vec<f32>>,
    /// Same for V.
    pub v: Vec<Vec<f32>>,
    /// Row width (`kv_heads * head_dim`).
    pub row: usize,
}

impl VecKv {
    /// Appends a chunk's K/V.
    pub fn append(&mut self, chunk: &ChunkKv) {
        if self.k.is_empty() {
            self.k = vec![Vec::new(); chunk.k.len()];
            self.v = vec![Vec::new(); chunk.v.len()];
            self.row = chunk.k.first().map_or(0, |k| k.len() / chunk.len.max(1));
        }
        for l in 0..chunk.k.len() {
            self.k[l].extend_from_slice(&chunk.k[l]);
            self.v[l].extend_from_slice(&chunk.v[l]);
        }
    }
}

impl PastKv for VecKv {
    fn runs(&self, layer: usize, positions: Range<u64>) -> Vec<Run<'_>> {
        if positions.is_empty() {
            return Vec::new();
        }
        let (a, b) = (positions.start as usize * self.row, positions.end as usize * self.row);
        vec![Run {
            start: positions.start,
            k: KvValues::F32(Cow::Borrowed(&self.k[layer][a..b])),
            v: KvValues::F32(Cow::Borrowed(&self.v[layer][a..b])),
        }]
    }
}

#[cfg(test)]
mod tests {
    use super::argmax;

    /// What [`argmax`] computes, one compare per value.
    fn first_max(xs: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &x) in xs.iter().enumerate() {
            if x > xs[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_is_the_first_largest_value_with_nans_ties_and_signed_zeros() {
        let mut next = crate::testing::xorshift32(0x2545_f491);
        // Few distinct values, so that ties are common, and the special ones.
        let values = [-1.5, 0.0, -0.0, 2.0, 3.25, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 3.25];
        for len in (0..40).chain([257, 1000]) {
            for _ in 0..50 {
                let xs: Vec<f32> = (0..len).map(|_| values[next() as usize % values.len()]).collect();
                assert_eq!(argmax(&xs), first_max(&xs), "{xs:?}");
            }
        }
        assert_eq!(argmax(&[f32::NAN, 1.0, 2.0]), 0);
        assert_eq!(argmax(&[1.0, f32::NAN, 2.0, 2.0]), 2);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
    }
}
