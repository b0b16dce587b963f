//! A row's results depend on nothing but its own sequence: not on the chunks its prompt is cut into,
//! the other sequences of its batch, nor the thread count. Checked bit for bit on the tiny checkpoints
//! (Gemma 3 with an 8-token sliding window, and Llama) with f32, bf16 and f16 K/V.

use std::borrow::Cow;
use std::ops::Range;

use half::{bf16, f16};
use model::arch::Model;
use model::forward::{round_to, ChunkKv, KvValues, NoPast, Output, PastKv, Run, Segment, VecKv};
use model::kernels::Precision;
use shm_format::Dtype;

fn load(name: &str, precision: Precision, threads: usize, kv_dtype: Dtype) -> Model {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/reference").join(name);
    let mut model = Model::from_hf_dir(&dir).unwrap();
    model.configure(precision, threads);
    model.kv_dtype = kv_dtype;
    model
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
        for precision in [Precision::Exact, Precision::Fast] {
            for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
                let model = load(name, precision, 2, dtype);
                let p = prompt(29, 1);
                let (kv, logits) = chunked(&model, &p, p.len());
                let whole = fingerprint(&kv, &logits);
                for chunk in [1, 3, 7, 8, 16] {
                    let (kv, logits) = chunked(&model, &p, chunk);
                    assert!(
                        fingerprint(&kv, &logits) == whole,
                        "{name} {precision:?} {dtype:?}: chunks of {chunk} differ from whole prefill"
                    );
                }
            }
        }
    }
}

#[test]
fn a_batch_computes_each_sequence_as_it_would_alone() {
    for name in MODELS {
        for precision in [Precision::Exact, Precision::Fast] {
            let model = load(name, precision, 2, Dtype::Bf16);
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
                        assert_eq!(bits(&out.logits), bits(&alone[i].logits), "{name} {precision:?}: logits of {i}");
                        assert_eq!(same_kv(&out.kv), same_kv(&alone[i].kv), "{name} {precision:?}: K/V of {i}");
                    }
                    let solo = model.forward(&extra, 0, &NoPast, true);
                    assert_eq!(bits(&outs[len].logits), bits(&solo.logits), "{name} {precision:?}: the prefill rider");
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
        for precision in [Precision::Exact, Precision::Fast] {
            let p = prompt(23, 5);
            let runs: Vec<_> = [1, 2, 3]
                .into_iter()
                .map(|threads| {
                    let (kv, logits) = chunked(&load(name, precision, threads, Dtype::F32), &p, 10);
                    fingerprint(&kv, &logits)
                })
                .collect();
            assert!(runs[0] == runs[1] && runs[1] == runs[2], "{name} {precision:?}: threads change the bits");
        }
    }
}
