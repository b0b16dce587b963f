//! Matrix kernels for the forward pass: every output of a linear layer is one dot product in a fixed
//! order ([`dot`] for f32, [`q8`] for `fast`), computed by exactly one thread. Rows of a batch share
//! each weight load but never a reduction, so a row's bits do not depend on the batch size, the batch's
//! other rows, the prefill chunking or the thread count.

use rayon::prelude::*;

mod dot;
mod q8;

pub use dot::{dot, Dot};
pub use q8::Q8;

/// How the forward pass computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// f32 arithmetic on dequantized weights.
    Exact,
    /// Q8_0 weights and activations (quantized once per linear layer call) with integer dot products,
    /// in prefill and decode alike.
    Fast,
}

impl Precision {
    /// `"exact"` or `"fast"`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Exact => "exact",
            Precision::Fast => "fast",
        }
    }
}

/// The cores this process may run on (at least 1).
pub fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The most forward-pass threads anyone may ask for: four per core. More only adds contention, and a
/// pool of 100000 threads takes a minute to spawn before it aborts; the host checks requests against
/// this, and so does every built-in backend's configuration.
pub fn max_threads() -> usize {
    4 * available_cores()
}

/// Where the kernels run.
#[derive(Debug)]
pub struct Exec {
    /// Precision.
    pub precision: Precision,
    pool: rayon::ThreadPool,
}

impl Exec {
    /// `threads` worker threads (at least 1).
    pub fn new(precision: Precision, threads: usize) -> Self {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads.max(1)).build().expect("thread pool");
        Exec { precision, pool }
    }

    /// Worker threads.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// `x[t][n_in] * w[n_out][n_in]^T -> [t][n_out]`. With `q8` (the same weights quantized, in
    /// `fast` precision), the activations are quantized once here and every product is integer.
    pub fn matmul_t(&self, x: &[f32], w: &[f32], q8: Option<&Q8>, t: usize, n_in: usize, n_out: usize) -> Vec<f32> {
        assert_eq!(x.len(), t * n_in, "activation shape");
        assert_eq!(w.len(), n_out * n_in, "weight shape");
        let simd = dot::simd();
        let q8 = q8.filter(|q| q.cols == n_in && q.rows == n_out);
        let xq = q8.and_then(|_| Q8::new(x, t, n_in));
        // Weight rows per task: enough work to be worth a hand-off, and several tasks per thread when
        // there are rows enough. Which rows go together never changes a result.
        let per_task = (n_out / (4 * self.threads())).max(64).min(n_out.max(1));
        let tasks = n_out.div_ceil(per_task);
        let parts: Vec<Vec<f32>> = self.pool.install(|| {
            (0..tasks)
                .into_par_iter()
                .map(|task| {
                    let rows = task * per_task..((task + 1) * per_task).min(n_out);
                    let mut out = vec![0f32; t * rows.len()];
                    match (q8, &xq) {
                        (Some(w), Some(xq)) => q8::dots(simd, xq, w, rows, &mut out),
                        _ => dot::dots(simd, x, t, &w[rows.start * n_in..rows.end * n_in], n_in, &mut out),
                    }
                    out
                })
                .collect()
        });
        if tasks == 1 {
            return parts.into_iter().next().unwrap_or_default();
        }
        let mut c = vec![0f32; t * n_out];
        for (task, part) in parts.iter().enumerate() {
            let j0 = task * per_task;
            let width = part.len() / t.max(1);
            for (i, row) in part.chunks_exact(width.max(1)).enumerate() {
                c[i * n_out + j0..][..width].copy_from_slice(row);
            }
        }
        c
    }

    /// Runs `f` inside the pool, so rayon's parallel iterators in it use these threads.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows alone, rows in any batch, and any thread count give the same bits, in both precisions; the
    /// values are the product's.
    #[test]
    fn a_rows_product_is_the_same_in_any_batch_and_on_any_thread_count() {
        let (t, n_in, n_out) = (9, 96, 200);
        let x: Vec<f32> = (0..t * n_in).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let w: Vec<f32> = (0..n_out * n_in).map(|i| ((i * 53 % 97) as f32 - 48.0) / 60.0).collect();
        let naive: Vec<f32> = (0..t)
            .flat_map(|i| {
                let (x, w) = (&x, &w);
                (0..n_out).map(move |j| (0..n_in).map(|k| x[i * n_in + k] * w[j * n_in + k]).sum::<f32>())
            })
            .collect();
        let q8 = Q8::new(&w, n_out, n_in).unwrap();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for q in [None, Some(&q8)] {
            let reference = Exec::new(Precision::Exact, 1).matmul_t(&x, &w, q, t, n_in, n_out);
            for (i, (&got, &want)) in reference.iter().zip(&naive).enumerate() {
                let tolerance = if q.is_some() { 0.05 * want.abs().max(1.0) } else { 1e-3 };
                assert!((got - want).abs() < tolerance, "output {i}: {got} vs {want}");
            }
            for threads in [1, 2, 3] {
                let exec = Exec::new(Precision::Exact, threads);
                assert_eq!(bits(&exec.matmul_t(&x, &w, q, t, n_in, n_out)), bits(&reference), "{threads} threads");
                for (from, len) in [(0, 1), (4, 1), (2, 3), (1, 5), (0, 8)] {
                    let rows = &x[from * n_in..(from + len) * n_in];
                    let got = exec.matmul_t(rows, &w, q, len, n_in, n_out);
                    assert_eq!(bits(&got), bits(&reference[from * n_out..(from + len) * n_out]), "rows {from}+{len}");
                }
            }
        }
    }
}
