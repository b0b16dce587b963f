//! A row's results depend on nothing but its own sequence: not on the chunks its prompt is cut into,
//! the other sequences of its batch, nor the thread count. Checked bit for bit on the tiny checkpoints
//! (Gemma 3 with an 8-token sliding window, and Llama) with f32, bf16 and f16 K/V: in `exact`, in `fast`
//! on their f32 weights (a Q8_0 copy), and in `fast` on the weights as blocks of Q8_0, Q4_1 and Q5_0
//! (rows interleaved, see `model::kernels::Interleaved`).

use std::borrow::Cow;
use std::ops::Range;

use half::{bf16, f16};
use model::arch::Model;
use model::forward::{round_to, ChunkKv, KvValues, NoPast, Output, PastKv, Run, Segment, VecKv};
use model::kernels::{BlockBytes, Precision, Weight};
use model::quant::GgmlType;
use shm_format::Dtype;

/// How a checkpoint is run: its precision, and the block type its matrices are first quantized to.
#[derive(Clone, Copy, Debug)]
struct Mode(Precision, Option<GgmlType>);

const MODES: [Mode; 5] = [
    Mode(Precision::Exact, None),
    Mode(Precision::Fast, None),
    Mode(Precision::Fast, Some(GgmlType::Q8_0)),
    Mode(Precision::Fast, Some(GgmlType::Q4_1)),
    Mode(Precision::Fast, Some(GgmlType::Q5_0)),
];

fn load(name: &str, Mode(precision, blocks): Mode, threads: usize, kv_dtype: Dtype) -> Model {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/reference").join(name);
    let mut model = Model::from_hf_dir(&dir).unwrap();
    if let Some(ty) = blocks {
        let c = &model.config;
        let (hidden, ffn, qd) = (c.hidden, c.ffn, c.heads * c.head_dim);
        let as_blocks =
            |w: &Weight, cols: usize| Weight::from_blocks(ty, BlockBytes::Owned(encode(&w.to_f32(), ty)), cols);
        for l in &mut model.layers {
            for (w, cols) in [(&mut l.wq, hidden), (&mut l.wk, hidden), (&mut l.wv, hidden), (&mut l.wo, qd)] {
                *w = as_blocks(w, cols);
            }
            for (w, cols) in [(&mut l.gate, hidden), (&mut l.up, hidden), (&mut l.down, ffn)] {
                *w = as_blocks(w, cols);
            }
        }
        model.embed = as_blocks(&model.embed, hidden);
        model.lm_head = model.lm_head.as_ref().map(|w| as_blocks(w, hidden));
    }
    model.configure(precision, threads);
    if blocks.is_some() && precision == Precision::Fast {
        let fast = model.q8.as_ref().expect("fast's weights");
        assert!(
            fast.interleaved.iter().flatten().chain([&fast.interleaved_head]).all(Option::is_some),
            "{name}: every matrix interleaved"
        );
    }
    model.kv_dtype = kv_dtype;
    model
}

/// `w` (whole blocks of 32 values) as GGUF blocks of `ty` (Q8_0, Q4_1 or Q5_0), rounded to nearest.
fn encode(w: &[f32], ty: GgmlType) -> Vec<u8> {
    let half = |v: f32| f16::from_f32(v).to_bits().to_le_bytes();
    let mut out = Vec::new();
    for b in w.chunks_exact(32) {
        let (min, max) = b.iter().fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let amax = min.abs().max(max.abs());
        let (d, zero, top) = match ty {
            GgmlType::Q8_0 => (amax / 127.0, 0.0, 127.0),
            GgmlType::Q4_1 => ((max - min) / 15.0, min, 15.0),
            _ => (amax / 15.0, -16.0 * amax / 15.0, 31.0),
        };
        let d = f16::from_f32(d).to_f32();
        let q: Vec<i32> =
            b.iter().map(|&v| if d > 0.0 { ((v - zero) / d).round().clamp(-top, top) as i32 } else { 0 }).collect();
        out.extend(half(d));
        match ty {
            GgmlType::Q8_0 => out.extend(q.iter().map(|&q| q as i8 as u8)),
            GgmlType::Q4_1 => {
                out.extend(half(min));
                out.extend((0..16).map(|j| (q[j] | q[j + 16] << 4) as u8));
            }
            _ => {
                let qh = (0..32).filter(|&j| q[j] & 16 != 0).fold(0u32, |h, j| h | 1 << j);
                out.extend(qh.to_le_bytes());
                out.extend((0..16).map(|j| (q[j] & 15 | (q[j + 16] & 15) << 4) as u8));
            }
        }
    }
    out
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 37 + seed * 101 + 5) % 256).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// Every position's K/V (all layers) and every position's logits, bits only.
fn fingerprint(kv: &VecKv, logits: &[Vec<f32>]) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    (kv.k.iter().chain(&kv.v).map(|l| bits(l)).collect(), logits.iter().map(|l| bits(l)).collect())
}

/// A past held in a 16-bit type, as the host's paged cache holds it: attention reads its values in
/// place, widening them as it loads them.
struct NarrowKv<E: Clone + 'static> {
    k: Vec<Vec<E>>,
    v: Vec<Vec<E>>,
    row: usize,
    values: for<'a> fn(Cow<'a, [E]>) -> KvValues<'a>,
}

impl<E: Clone + Sync> PastKv for NarrowKv<E> {
    fn runs(&self, layer: usize, positions: Range<u64>) -> Vec<Run<'_>> {
        if positions.is_empty() {
            return Vec::new();
        }
        let (a, b) = (positions.start as usize * self.row, positions.end as usize * self.row);
        let (k, v) = (Cow::Borrowed(&self.k[layer][a..b]), Cow::Borrowed(&self.v[layer][a..b]));
        vec![Run { start: positions.start, k: (self.values)(k), v: (self.values)(v) }]
    }
}

/// `kv`'s values (already rounded to `dtype`) in `dtype` itself, or as they are for f32.
fn held_as(kv: &VecKv, dtype: Dtype) -> Box<dyn PastKv + '_> {
    fn narrow<E: Clone>(kv: &VecKv, to: fn(f32) -> E, values: for<'a> fn(Cow<'a, [E]>) -> KvValues<'a>) -> NarrowKv<E> {
        let of = |layers: &[Vec<f32>]| layers.iter().map(|l| l.iter().map(|&x| to(x)).collect()).collect();
        NarrowKv { k: of(&kv.k), v: of(&kv.v), row: kv.row, values }
    }
    // The closures make the variants' constructors generic over the lifetime, as `values` needs.
    #[allow(clippy::redundant_closure)]
    match dtype {
        Dtype::F32 => Box::new(VecKv { k: kv.k.clone(), v: kv.v.clone(), row: kv.row }),
        Dtype::Bf16 => Box::new(narrow(kv, bf16::from_f32, |v| KvValues::Bf16(v))),
        Dtype::F16 => Box::new(narrow(kv, f16::from_f32, |v| KvValues::F16(v))),
    }
}

/// Prefills `prompt` in pieces of `chunk` into a cache that stores `model.kv_dtype` values, keeping the
/// logits of every position.
fn chunked(model: &Model, prompt: &[u32], chunk: usize) -> (VecKv, Vec<Vec<f32>>) {
    let mut kv = VecKv::default();
    let mut logits = Vec::new();
    for (i, part) in prompt.chunks(chunk).enumerate() {
        let mut out = model.forward(part, (i * chunk) as u64, &*held_as(&kv, model.kv_dtype), true);
        // What a cache of that dtype holds.
        for x in out.kv.k.iter_mut().chain(out.kv.v.iter_mut()).flatten() {
            *x = round_to(model.kv_dtype, *x);
        }
        kv.append(&out.kv);
        logits.extend(out.logits.chunks_exact(model.config.vocab).map(<[f32]>::to_vec));
    }
    (kv, logits)
}

const MODELS: [&str; 2] = ["tiny_gemma3_8l", "tiny_llama_4l"];

#[test]
fn prefill_gives_the_same_bits_at_every_chunking() {
    for name in MODELS {
        for mode in MODES {
            for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
                let model = load(name, mode, 2, dtype);
                let p = prompt(29, 1);
                let (kv, logits) = chunked(&model, &p, p.len());
                let whole = fingerprint(&kv, &logits);
                for chunk in [1, 3, 7, 8, 16] {
                    let (kv, logits) = chunked(&model, &p, chunk);
                    assert!(
                        fingerprint(&kv, &logits) == whole,
                        "{name} {mode:?} {dtype:?}: chunks of {chunk} differ from whole prefill"
                    );
                }
            }
        }
    }
}

#[test]
fn a_batch_computes_each_sequence_as_it_would_alone() {
    for name in MODELS {
        for mode in MODES {
            let model = load(name, mode, 2, Dtype::Bf16);
            // Three sequences with different histories, stepped at different positions.
            let prompts = [prompt(5, 2), prompt(19, 3), prompt(11, 4)];
            let kvs: Vec<VecKv> = prompts.iter().map(|p| chunked(&model, p, p.len()).0).collect();
            let pasts: Vec<Box<dyn PastKv>> = kvs.iter().map(|kv| held_as(kv, model.kv_dtype)).collect();
            let next = [[7u32], [200], [31]];
            let alone: Vec<Output> =
                (0..3).map(|i| model.forward(&next[i], prompts[i].len() as u64, &*pasts[i], false)).collect();
            let segments: Vec<Segment<'_>> = (0..3)
                .map(|i| Segment {
                    tokens: &next[i],
                    start: prompts[i].len() as u64,
                    past: &*pasts[i],
                    all_logits: false,
                })
                .collect();
            // Every order and every sub-batch, plus a prefill chunk riding along.
            let extra = prompt(6, 9);
            for order in [[0, 1, 2], [2, 0, 1], [1, 2, 0]] {
                for len in 1..=3 {
                    let mut batch: Vec<Segment<'_>> = order[..len].iter().map(|&i| segments[i]).collect();
                    batch.push(Segment { tokens: &extra, start: 0, past: &NoPast, all_logits: true });
                    let outs = model.forward_batch(&batch);
                    for (&i, out) in order[..len].iter().zip(&outs) {
                        assert_eq!(bits(&out.logits), bits(&alone[i].logits), "{name} {mode:?}: logits of {i}");
                        assert_eq!(same_kv(&out.kv), same_kv(&alone[i].kv), "{name} {mode:?}: K/V of {i}");
                    }
                    let solo = model.forward(&extra, 0, &NoPast, true);
                    assert_eq!(bits(&outs[len].logits), bits(&solo.logits), "{name} {mode:?}: the prefill rider");
                }
            }
        }
    }
}

fn same_kv(kv: &ChunkKv) -> Vec<Vec<u32>> {
    kv.k.iter().chain(&kv.v).map(|l| bits(l)).collect()
}

#[test]
fn the_thread_count_changes_no_bit() {
    for name in MODELS {
        for mode in MODES {
            let p = prompt(23, 5);
            let runs: Vec<_> = [1, 2, 3]
                .into_iter()
                .map(|threads| {
                    let (kv, logits) = chunked(&load(name, mode, threads, Dtype::F32), &p, 10);
                    fingerprint(&kv, &logits)
                })
                .collect();
            assert!(runs[0] == runs[1] && runs[1] == runs[2], "{name} {mode:?}: threads change the bits");
        }
    }
}

#[test]
fn switching_precision_and_back_changes_no_bit() {
    for name in MODELS {
        let p = prompt(13, 6);
        let run = |model: &Model| {
            let (kv, logits) = chunked(model, &p, p.len());
            fingerprint(&kv, &logits)
        };
        let (fast, exact) = (Mode(Precision::Fast, Some(GgmlType::Q4_1)), Mode(Precision::Exact, Some(GgmlType::Q4_1)));
        let (fresh_fast, fresh_exact) = (run(&load(name, fast, 2, Dtype::F32)), run(&load(name, exact, 2, Dtype::F32)));
        assert!(fresh_fast != fresh_exact, "{name}: the precisions differ");
        // `fast`'s copies are kept aside while the model runs `exact`, and used again.
        let mut model = load(name, fast, 2, Dtype::F32);
        model.configure(Precision::Exact, 1);
        assert!(run(&model) == fresh_exact, "{name}: exact after fast");
        model.configure(Precision::Fast, 3);
        assert!(model.q8.as_ref().is_some_and(|f| f.interleaved_head.is_some()), "{name}: fast's copies back");
        assert!(run(&model) == fresh_fast, "{name}: fast after exact");
    }
}
