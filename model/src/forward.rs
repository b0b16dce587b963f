//! The forward pass in `exact` precision: f32 arithmetic on dequantized weights.
//!
//! [`Model::forward`] runs a chunk of tokens at positions `start..start + n` and returns the chunk's K/V for
//! every layer (so a producer can lay it out dense or grouped, or the host can ingest it) and the logits.
//! Earlier positions' K/V come from a [`PastKv`] — the host's paged cache in pdhost — and a sliding layer at
//! position `p` sees exactly `p - window + 1 ..= p`.

use std::ops::Range;

use rayon::prelude::*;

use crate::arch::{Arch, Attention, Model};
use crate::kernels::dot;

/// Receives one run of past K/V: `(first_position, k_rows, v_rows)`.
pub type RunSink<'a> = dyn FnMut(u64, &[f32], &[f32]) + 'a;

/// K/V of positions before the chunk.
pub trait PastKv {
    /// Calls `f(first_position, k_rows, v_rows)` for consecutive runs covering exactly `positions` of
    /// `layer`, in order; each row is `kv_heads * head_dim` f32 values.
    fn runs(&self, layer: usize, positions: Range<u64>, f: &mut RunSink<'_>);
}

/// No earlier positions.
#[derive(Debug)]
pub struct NoPast;

impl PastKv for NoPast {
    fn runs(&self, _: usize, positions: Range<u64>, _: &mut RunSink<'_>) {
        assert!(positions.is_empty(), "no past K/V for positions {positions:?}");
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

fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(w.len()) {
        let mean = row.iter().map(|v| v * v).sum::<f32>() / w.len() as f32;
        let r = 1.0 / (mean + eps).sqrt();
        for (v, &g) in row.iter_mut().zip(w) {
            *v = *v * r * g;
        }
    }
}

fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Rotates `x` (one head, `head_dim` values) for position `pos`.
fn rope(x: &mut [f32], pos: u64, base: f32, adjacent: bool) {
    let d = x.len();
    for i in 0..d / 2 {
        let inv = 1.0 / base.powf((2 * i) as f32 / d as f32);
        let angle = pos as f32 * inv;
        let (sin, cos) = angle.sin_cos();
        let (a, b) = if adjacent { (2 * i, 2 * i + 1) } else { (i, i + d / 2) };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * cos - x1 * sin;
        x[b] = x1 * cos + x0 * sin;
    }
}

impl Model {
    /// Runs `tokens` at positions `start..`, attending to `past` for earlier positions.
    pub fn forward(&self, tokens: &[u32], start: u64, past: &dyn PastKv, all_logits: bool) -> Output {
        let c = &self.config;
        let t = tokens.len();
        let (hd, kvd, qd) = (c.head_dim, c.kv_heads * c.head_dim, c.heads * c.head_dim);
        let group = c.heads / c.kv_heads;
        let mut x = vec![0f32; t * c.hidden];
        for (row, &tok) in x.chunks_exact_mut(c.hidden).zip(tokens) {
            let tok = tok as usize;
            assert!(tok < c.vocab, "token id {tok} outside the vocabulary of {}", c.vocab);
            row.copy_from_slice(&self.embed[tok * c.hidden..(tok + 1) * c.hidden]);
        }
        if c.arch == Arch::Gemma3 {
            let scale = (c.hidden as f32).sqrt();
            x.iter_mut().for_each(|v| *v *= scale);
        }
        let mut kv = ChunkKv { start, len: t, k: Vec::new(), v: Vec::new() };
        for (l, w) in self.layers.iter().enumerate() {
            let mut h = x.clone();
            rms_norm(&mut h, &w.attn_norm, c.eps);
            let lq = self.q8.as_ref().map(|q| &q.layers[l]);
            let q8 = |i: usize| lq.map(|q| &q[i]);
            let mut q = self.exec.matmul_t(&h, &w.wq, q8(0), t, c.hidden, qd);
            let mut k = self.exec.matmul_t(&h, &w.wk, q8(1), t, c.hidden, kvd);
            let v = self.exec.matmul_t(&h, &w.wv, q8(2), t, c.hidden, kvd);
            if let Some(qn) = &w.q_norm {
                rms_norm(&mut q, qn, c.eps);
            }
            if let Some(kn) = &w.k_norm {
                rms_norm(&mut k, kn, c.eps);
            }
            let base = match c.layers[l] {
                Attention::Full => c.rope_global,
                Attention::Sliding(_) => c.rope_local,
            };
            for i in 0..t {
                let pos = start + i as u64;
                for head in q[i * qd..(i + 1) * qd].chunks_exact_mut(hd) {
                    rope(head, pos, base, c.rope_adjacent);
                }
                for head in k[i * kvd..(i + 1) * kvd].chunks_exact_mut(hd) {
                    rope(head, pos, base, c.rope_adjacent);
                }
            }

            // The earliest position any query of the chunk sees, and the past rows it needs.
            let first_visible = |pos: u64| match c.layers[l] {
                Attention::Full => 0,
                Attention::Sliding(w) => (pos + 1).saturating_sub(u64::from(w)),
            };
            let past_from = first_visible(start).min(start);
            let (mut pk, mut pv) = (Vec::new(), Vec::new());
            past.runs(l, past_from..start, &mut |_, k, v| {
                pk.extend_from_slice(k);
                pv.extend_from_slice(v);
            });
            assert_eq!(pk.len() as u64, (start - past_from) * kvd as u64, "past K/V rows for layer {l}");

            let mut attn = vec![0f32; t * qd];
            let key_row = |p: u64, g: usize| -> (&[f32], &[f32]) {
                let (src_k, src_v, r) =
                    if p < start { (&pk, &pv, (p - past_from) as usize) } else { (&k, &v, (p - start) as usize) };
                let range = r * kvd + g * hd..r * kvd + (g + 1) * hd;
                (&src_k[range.clone()], &src_v[range])
            };
            self.exec.install(|| {
                attn.par_chunks_mut(qd).enumerate().for_each(|(i, out_row)| {
                    let pos = start + i as u64;
                    let lo = first_visible(pos);
                    let mut scores = Vec::with_capacity((pos - lo + 1) as usize);
                    for hq in 0..c.heads {
                        let g = hq / group;
                        let qv = &q[i * qd + hq * hd..i * qd + (hq + 1) * hd];
                        scores.clear();
                        for p in lo..=pos {
                            scores.push(dot(qv, key_row(p, g).0) * c.query_scale);
                        }
                        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let mut sum = 0.0;
                        for s in scores.iter_mut() {
                            *s = (*s - max).exp();
                            sum += *s;
                        }
                        let out = &mut out_row[hq * hd..(hq + 1) * hd];
                        for (j, p) in (lo..=pos).enumerate() {
                            let wgt = scores[j] / sum;
                            for (o, &vv) in out.iter_mut().zip(key_row(p, g).1) {
                                *o += wgt * vv;
                            }
                        }
                    }
                })
            });
            let mut o = self.exec.matmul_t(&attn, &w.wo, q8(3), t, qd, c.hidden);
            if let Some(n) = &w.post_attn_norm {
                rms_norm(&mut o, n, c.eps);
            }
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);

            let mut h = x.clone();
            rms_norm(&mut h, &w.ffn_norm, c.eps);
            let gate = self.exec.matmul_t(&h, &w.gate, q8(4), t, c.hidden, c.ffn);
            let up = self.exec.matmul_t(&h, &w.up, q8(5), t, c.hidden, c.ffn);
            let act: Vec<f32> = gate
                .iter()
                .zip(&up)
                .map(|(&g, &u)| match c.arch {
                    Arch::Gemma3 => gelu_tanh(g) * u,
                    Arch::Llama => silu(g) * u,
                })
                .collect();
            let mut down = self.exec.matmul_t(&act, &w.down, q8(6), t, c.ffn, c.hidden);
            if let Some(n) = &w.post_ffn_norm {
                rms_norm(&mut down, n, c.eps);
            }
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
            kv.k.push(k);
            kv.v.push(v);
        }
        rms_norm(&mut x, &self.final_norm, c.eps);
        let rows = if all_logits { &x[..] } else { &x[(t - 1) * c.hidden..] };
        let n = rows.len() / c.hidden;
        let head = self.lm_head.as_deref().unwrap_or(&self.embed);
        let head_q8 = self.q8.as_ref().map(|q| &q.head);
        Output { kv, logits: self.exec.matmul_t(rows, head, head_q8, n, c.hidden, c.vocab) }
    }
}

/// The index of the largest value (the first, on ties, as `torch.argmax`).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
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
    fn runs(&self, layer: usize, positions: Range<u64>, f: &mut RunSink<'_>) {
        if positions.is_empty() {
            return;
        }
        let (a, b) = (positions.start as usize * self.row, positions.end as usize * self.row);
        f(positions.start, &self.k[layer][a..b], &self.v[layer][a..b]);
    }
}
