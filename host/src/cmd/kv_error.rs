//! K/V error of a remote prefill against the host's own, layer by layer (`check-backend`, `bench pd`).

use pdhost::engine::Engine;
use pdhost::kv::SeqId;
use serde::Serialize;

use super::outln;

/// The K/V error of one layer against local prefill, over every prompt and chunking.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct LayerError {
    pub layer: u32,
    pub max_abs: f64,
    pub rel_l2: f64,
    pub min_cosine: f64,
}

/// Accumulates one layer's error over several comparisons.
#[derive(Debug, Default, Clone, Copy)]
pub struct ErrorSum {
    max_abs: f64,
    diff2: f64,
    ref2: f64,
    min_cosine: f64,
    compared: bool,
}

impl ErrorSum {
    pub fn add(&mut self, ours: &[f32], theirs: &[f32]) {
        let (mut dot, mut a2, mut b2) = (0f64, 0f64, 0f64);
        for (&a, &b) in ours.iter().zip(theirs) {
            let (a, b) = (f64::from(a), f64::from(b));
            self.max_abs = self.max_abs.max((a - b).abs());
            self.diff2 += (a - b) * (a - b);
            dot += a * b;
            a2 += a * a;
            b2 += b * b;
        }
        self.ref2 += a2;
        let cosine = if a2 == 0.0 && b2 == 0.0 {
            1.0
        } else {
            (dot / (a2.sqrt() * b2.sqrt()).max(f64::MIN_POSITIVE)).clamp(-1.0, 1.0)
        };
        self.min_cosine = if self.compared { self.min_cosine.min(cosine) } else { cosine };
        self.compared = true;
    }

    pub fn finish(&self, layer: u32) -> LayerError {
        let rel_l2 = if self.ref2 == 0.0 { self.diff2.sqrt() } else { (self.diff2 / self.ref2).sqrt() };
        LayerError { layer, max_abs: self.max_abs, rel_l2, min_cosine: self.min_cosine }
    }
}

/// A layer's K and V of `seq`, as f32 (a NaN makes every error NaN, which fails the tolerance).
fn layer_f32(engine: &Engine, seq: SeqId, layer: u32) -> (Vec<f32>, Vec<f32>) {
    let read = engine.kv.read(seq, layer).expect("every layer of a prefilled sequence reads");
    let dtype = read.dtype();
    let (k, v) = read.to_bytes();
    let convert = |bytes: &[u8]| {
        let mut out = vec![0f32; bytes.len() / dtype.size() as usize];
        pdhost::kv::convert::to_f32(dtype, bytes, &mut out);
        out
    };
    (convert(&k), convert(&v))
}

/// Adds every layer's error of `remote` against `local` (two sequences of the same prompt in `engine`)
/// to `sums`, one per layer.
pub fn accumulate(sums: &mut [ErrorSum], engine: &Engine, local: SeqId, remote: SeqId) {
    for (layer, sum) in sums.iter_mut().enumerate() {
        let (rk, rv) = layer_f32(engine, remote, layer as u32);
        let (lk, lv) = layer_f32(engine, local, layer as u32);
        sum.add(&lk, &rk);
        sum.add(&lv, &rv);
    }
}

/// Every layer's error of `remote` against `local`.
pub fn compare(engine: &Engine, local: SeqId, remote: SeqId) -> Vec<LayerError> {
    let mut sums = vec![ErrorSum::default(); engine.kv.geometry().layers.len()];
    accumulate(&mut sums, engine, local, remote);
    sums.iter().enumerate().map(|(l, s)| s.finish(l as u32)).collect()
}

/// The table of `layers`, each line after `indent`.
pub fn print_layer_errors(layers: &[LayerError], indent: &str) -> Result<(), super::StdoutError> {
    outln!("{indent}layer      max abs       rel L2   min cosine")?;
    for l in layers {
        outln!("{indent}{:>5} {:>12.2e} {:>12.2e} {:>12.8}", l.layer, l.max_abs, l.rel_l2, l.min_cosine)?;
    }
    Ok(())
}
