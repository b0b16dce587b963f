//! Matrix kernels for the forward pass: every output of a linear layer is one dot product in a fixed
//! order ([`dot`] for f32, [`q8`] for `fast`), computed by exactly one thread. Rows of a batch share
//! each weight load but never a reduction, so a row's bits do not depend on the batch size, the batch's
//! other rows, the prefill chunking or the thread count.

use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

mod act;
pub(crate) mod dot;
mod native;
mod q8;
mod weight;

pub use act::{gated_into, softmax, sum_exp, Gate};
pub use dot::{dot, Dot, Elem};
pub use q8::Q8;
use weight::GROUP;
pub use weight::{BlockBytes, FileMap, Interleaved, Weight};

/// How the forward pass computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// f32 arithmetic on dequantized weights.
    Exact,
    /// Activations quantized to 8 bits (once per linear layer call) and integer dot products, in
    /// prefill and decode alike: on the GGUF's own blocks where it holds integer blocks, on a Q8_0
    /// copy of the weights otherwise (f32, f16 or bf16 matrices).
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
    /// Whether [`Exec::install_awake`] keeps the other threads awake.
    awake: bool,
}

impl Exec {
    /// `threads` worker threads (at least 1).
    pub fn new(precision: Precision, threads: usize) -> Self {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads.max(1)).build().expect("thread pool");
        Exec { precision, pool, awake: true }
    }

    /// Whether [`Exec::install_awake`] keeps the pool's other threads awake (the default), or lets them
    /// sleep between parallel regions as rayon does. A process whose cores another busy process shares
    /// (a server while its producer prefills) should let them sleep: a thread woken from sleep runs ahead
    /// of the other process's threads, where one kept awake waits out their time slices. Bits never
    /// depend on it.
    pub fn set_awake(&mut self, awake: bool) {
        self.awake = awake;
    }

    /// Worker threads.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// `x[t][n_in] * w[n_out][n_in]^T -> [t][n_out]`. In `fast` precision, with integer blocks or `q8`
    /// (a Q8_0 copy of other weights), the activations are quantized once here and every product is
    /// integer ([`native`], [`q8`]). Otherwise weights held as blocks are dequantized a panel of rows at a
    /// time (see [`Weight`]): the same bits as f32.
    pub fn matmul_t(&self, x: &[f32], w: &Weight, q8: Option<&Q8>, t: usize, n_in: usize, n_out: usize) -> Vec<f32> {
        let [out] = self.matmul_many(x, [(w, q8, n_out)], t, n_in);
        out
    }

    /// [`Exec::matmul_t`] as one vector per row of `x`: the same bits, each written once (a decode
    /// step's logits, one row per sequence, without a copy of them all to split).
    pub fn matmul_t_rows(
        &self,
        x: &[f32],
        w: &Weight,
        q8: Option<&Q8>,
        t: usize,
        n_in: usize,
        n_out: usize,
    ) -> Vec<Vec<f32>> {
        let [out] = self.products(x, [(w, q8, n_out)], t, n_in, Layout::Rows);
        out
    }

    /// The products of the same activations `x` (`t x n_in`) with several weights `(w, q8, n_out)`, each
    /// as [`Exec::matmul_t`] computes it (the same bits), the activations quantized once for all of them.
    pub fn matmul_many<const N: usize>(
        &self,
        x: &[f32],
        ws: [(&Weight, Option<&Q8>, usize); N],
        t: usize,
        n_in: usize,
    ) -> [Vec<f32>; N] {
        self.products(x, ws, t, n_in, Layout::Flat).map(|mut v| v.pop().unwrap_or_default())
    }

    /// [`Exec::matmul_many`]'s products, each laid out as `layout` says.
    fn products<const N: usize>(
        &self,
        x: &[f32],
        ws: [(&Weight, Option<&Q8>, usize); N],
        t: usize,
        n_in: usize,
        layout: Layout,
    ) -> [Vec<Vec<f32>>; N] {
        assert_eq!(x.len(), t * n_in, "activation shape");
        let ws = ws.map(|(w, q8, n_out)| {
            assert_eq!(w.len(), n_out * n_in, "weight shape");
            let q8 = q8.filter(|q| q.cols == n_in && q.rows == n_out);
            let fast = self.precision == Precision::Fast;
            let native = match w {
                Weight::Blocks { ty, bytes, .. } if fast && native::supports(*ty) => {
                    Some(Native::Blocks(*ty, &bytes[..]))
                }
                Weight::Interleaved(m) if fast => Some(Native::Interleaved(m)),
                _ => None,
            };
            (w, q8, native, n_out)
        });
        let quantize = ws.iter().any(|(_, q8, native, _)| q8.is_some() || native.is_some());
        let xq = if quantize { Q8::new(x, t, n_in) } else { None };
        // The row-major kernels' layouts of the activations are made only where one of them runs.
        let row_major = ws.iter().any(|(_, _, native, _)| matches!(native, Some(Native::Blocks(..))));
        let acts = xq.as_ref().filter(|_| ws.iter().any(|(_, _, native, _)| native.is_some())).map(|xq| {
            if row_major {
                native::Acts::new(xq, dot::simd())
            } else {
                native::Acts::rows_only(xq, dot::simd())
            }
        });
        let simd = dot::simd();
        // Weight rows per task: enough work to be worth a hand-off, and several tasks per thread when
        // there are rows enough. Which rows go together never changes a result.
        // Interleaved weights go in whole groups of rows.
        let per_task = ws.map(|(_, _, native, n_out)| {
            let per = (n_out / (4 * self.threads())).max(64).min(n_out.max(1));
            match native {
                Some(Native::Interleaved(_)) => per.next_multiple_of(GROUP),
                _ => per,
            }
        });
        // Every product's tasks in one parallel region: a decode step of a small model is hundreds of
        // products of tens of microseconds each, and each region costs a hand-off to the other threads
        // and a wait for the last of them.
        let counts: [usize; N] = std::array::from_fn(|p| ws[p].3.div_ceil(per_task[p]));
        let tasks: Vec<(usize, std::ops::Range<usize>)> = (0..N)
            .flat_map(|p| {
                let (n_out, per) = (ws[p].3, per_task[p]);
                (0..counts[p]).map(move |k| (p, k * per..((k + 1) * per).min(n_out)))
            })
            .collect();
        // The outputs, allocated but not yet written: the tasks write each element once, in place (a
        // zeroing of them all, and a gather of the tasks' parts into them on one thread, cost 5% of a
        // prefill).
        let mut outs: [Vec<Vec<f32>>; N] = std::array::from_fn(|p| match layout {
            Layout::Flat => vec![Vec::with_capacity(t * ws[p].3)],
            Layout::Rows => (0..t).map(|_| Vec::with_capacity(ws[p].3)).collect(),
        });
        let dests: [Dest; N] = std::array::from_fn(|p| Dest {
            rows: match layout {
                Layout::Flat => (0..t).map(|i| outs[p][0].as_mut_ptr().wrapping_add(i * ws[p].3)).collect(),
                Layout::Rows => outs[p].iter_mut().map(Vec::as_mut_ptr).collect(),
            },
        });
        if let Some(acts) = &acts {
            if ws.iter().any(|(_, _, native, _)| matches!(native, Some(Native::Interleaved(_)))) {
                acts.halves();
            }
        }
        self.pool.install(|| {
            tasks.par_iter().for_each(|(p, rows)| {
                let (w, q8, native, _) = ws[*p];
                let rows = rows.clone();
                let width = rows.len();
                SCRATCH.with_borrow_mut(|scratch| {
                    // Every kernel writes each element of its output, so the scratch is never zeroed.
                    if scratch.len() < t * width {
                        scratch.resize(t * width, 0.0);
                    }
                    let out = &mut scratch[..t * width];
                    match (native.zip(acts.as_ref()), q8, xq.as_ref(), w) {
                        (Some((Native::Blocks(ty, bytes), acts)), _, _, _) => {
                            native::dots(acts, ty, bytes, rows.clone(), out)
                        }
                        (Some((Native::Interleaved(m), acts)), _, _, _) => {
                            native::interleaved_dots(acts, m, rows.clone(), out)
                        }
                        (_, Some(w), Some(xq), _) => q8::dots(simd, xq, w, rows.clone(), out),
                        (_, _, _, Weight::F32(w)) => {
                            dot::dots(simd, x, t, &w[rows.start * n_in..rows.end * n_in], n_in, out)
                        }
                        (_, _, _, w) => blocks(simd, x, t, w, rows.clone(), n_in, out),
                    }
                    for (i, part) in out.chunks_exact(width).enumerate() {
                        // SAFETY: row `i` of product `p` has room for its `n_out` columns (allocated
                        // above, alive until after this region); this task alone writes columns
                        // `rows`, which lie inside them.
                        unsafe { dests[*p].rows[i].add(rows.start).copy_from_nonoverlapping(part.as_ptr(), width) };
                    }
                    if scratch.capacity() > SCRATCH_KEPT {
                        *scratch = Vec::new();
                    }
                });
            })
        });
        for (p, out) in outs.iter_mut().enumerate() {
            let len = match layout {
                Layout::Flat => t * ws[p].3,
                Layout::Rows => ws[p].3,
            };
            for v in out.iter_mut() {
                // SAFETY: `len` is what each vector was allocated for above; the tasks of product `p`
                // cover its columns `0..n_out` between them, and each wrote its columns of every row, so
                // every element up to `len` is written (a task that panicked took the region, and this
                // function, with it).
                unsafe { v.set_len(len) };
            }
        }
        outs
    }

    /// Runs `f` inside the pool, so rayon's parallel iterators in it use these threads.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// [`Exec::install`], with the pool's other threads kept awake until `f` returns: between parallel
    /// regions each waits for the next by yielding (to the pool's work, then to the OS), where rayon
    /// puts it to sleep after a few dozen fruitless yields (about 10 µs on an idle core). A forward pass is about
    /// five regions a layer with serial work between them, and waking a sleeping thread is slow on a VM:
    /// on the 2-core VM of 2026-12-05, two threads took 20-60 µs more per region once the serial gap
    /// between regions reached 20 µs, and 2-4 µs kept awake. Which thread runs a task never changes a
    /// bit, so neither does this.
    pub fn install_awake<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        if self.threads() < 2 || !self.awake {
            return self.install(f);
        }
        /// Ends the waiting when `f` returns or unwinds (a waiter left spinning would hang the scope).
        struct Done<'a>(&'a AtomicBool);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Release);
            }
        }
        self.pool.install(|| {
            let done = AtomicBool::new(false);
            let runs_f = rayon::current_thread_index();
            let mut out = None;
            rayon::scope(|s| {
                // One waiter on every thread of the pool but this one: a broadcast job runs on the
                // thread it is given to, so the thread running `f` never spins in place of it.
                s.spawn_broadcast(|_, ctx| {
                    if Some(ctx.index()) == runs_f {
                        return;
                    }
                    while !done.load(Ordering::Acquire) {
                        if rayon::yield_now() != Some(rayon::Yield::Executed) {
                            std::thread::yield_now();
                        }
                    }
                });
                let _done = Done(&done);
                out = Some(f());
            });
            out.expect("`f` ran in the scope")
        })
    }

    /// Runs `f` on every item, on the pool's threads where there are several of both: for work per
    /// sequence that does not depend on the others (each item's result is the same whichever thread
    /// runs it).
    pub fn each<T: Send>(&self, items: &mut [T], f: impl Fn(&mut T) + Sync + Send) {
        if items.len() < 2 || self.threads() < 2 {
            items.iter_mut().for_each(f);
        } else {
            self.pool.install(|| items.par_iter_mut().with_max_len(1).for_each(f));
        }
    }
}

/// A weight `fast` computes on with [`native`]'s kernels.
#[derive(Clone, Copy)]
enum Native<'a> {
    /// The blocks of a [`native::supports`]ed type.
    Blocks(crate::quant::GgmlType, &'a [u8]),
    /// Rows of a `fast` integer block type interleaved sixteen at a time ([`weight::Interleaved`]).
    Interleaved(&'a weight::Interleaved),
}

/// How [`Exec::products`] lays out each product's `t x n_out` outputs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// One vector, row after row.
    Flat,
    /// One vector per row.
    Rows,
}

/// Where a product's outputs go: row `i`'s `n_out` columns from `rows[i]`, in memory that outlives the
/// parallel region and that each task writes its own columns of.
struct Dest {
    rows: Vec<*mut f32>,
}

// SAFETY: the tasks write through the pointers to disjoint columns only, each element once, while the
// vectors they point into are neither read nor moved.
unsafe impl Sync for Dest {}

/// The most scratch a pool thread keeps between products, in floats (4 MiB: a task's outputs for a few
/// thousand prompt tokens). What a longer prefill's task needs beyond it is freed after the task, so a
/// server that once prefilled a long prompt does not keep that much per thread.
const SCRATCH_KEPT: usize = 1 << 20;

thread_local! {
    /// A task's outputs before they go to their place in the product's (each kernel writes every one).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Weight rows per call of a row kernel over blocks.
const ROWS_PER_CALL: usize = 32;

/// [`dot::dots`] over weight rows `rows` held as blocks, into `out` (`t x rows.len()`). A few rows (decode)
/// read each weight row straight from its blocks, dequantized in registers into the f32 kernel's own
/// accumulators and summed in its order ([`crate::quant::avx2::dot_rows`], or its AVX-512 twin);
/// otherwise see [`panels`]. The bits are the same either way.
fn blocks(simd: bool, x: &[f32], t: usize, w: &Weight, rows: std::ops::Range<usize>, n: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if let Weight::Blocks { ty, bytes, .. } = w {
        use crate::quant::avx2;
        if simd && t <= dot::TILE_ROWS && avx2::supports(*ty) && n.is_multiple_of(ty.block_elems()) && avx2::available()
        {
            let row_bytes = n / ty.block_elems() * ty.block_bytes();
            let (width, ws) = (rows.len(), &bytes[rows.start * row_bytes..rows.end * row_bytes]);
            let wide = crate::quant::avx512::available();
            macro_rules! run {
                ($r:literal, $h:literal) => {{
                    let xs: [&[f32]; $r] = std::array::from_fn(|i| &x[i * n..(i + 1) * n]);
                    // A few dozen weight rows per call: the call's checks are amortised.
                    let mut sums = [[0f32; $r]; ROWS_PER_CALL];
                    for j0 in (0..width).step_by(ROWS_PER_CALL) {
                        let sums = &mut sums[..ROWS_PER_CALL.min(width - j0)];
                        let ws = &ws[j0 * row_bytes..(j0 + sums.len()) * row_bytes];
                        if wide {
                            // SAFETY: AVX-512F, AVX2, FMA and F16C are present (checked), `ty` is
                            // supported, `ws` is `sums.len()` rows of whole blocks and every activation
                            // row holds `n` values.
                            unsafe { crate::quant::avx512::dot_rows::<$r>(*ty, xs, ws, n, sums) };
                        } else {
                            // SAFETY: AVX2, FMA and F16C are present (checked), and as above.
                            unsafe { avx2::dot_rows::<$r, $h>(*ty, xs, ws, n, sums) };
                        }
                        for (j, sums) in sums.iter().enumerate() {
                            for (i, sum) in sums.iter().enumerate() {
                                out[i * width + j0 + j] = *sum;
                            }
                        }
                    }
                }};
            }
            // The AVX2 kernel's weight rows side by side: as many as keep 8 of its accumulators busy;
            // for one row of Q4_1, whose blocks each hold an offset and its shuffles in registers too,
            // two (SmolLM2's layers, all Q4_1, one thread on a Zen 3: 10.9 ms a pass against 11.9 with
            // four; Gemma 3's Q8_0 head is 3-6% slower with two).
            match t {
                1 if *ty == crate::quant::GgmlType::Q4_1 => run!(1, 2),
                1 => run!(1, 4),
                2 => run!(2, 2),
                3 => run!(3, 1),
                _ => run!(4, 1),
            }
            return;
        }
    }
    panels(simd, x, t, w, rows, n, out)
}

/// [`dot::dots`] over weight rows held as blocks: a panel of rows at a time is dequantized into a buffer
/// that stays in L2 while every activation row passes it, so the activations are read once per panel.
/// A panel of 256 KiB (100 rows of 640 weights, 32 of 2048), against 32 KiB before, read a 512-token
/// prompt's activations an eighth as often (the down projection's, 4 MiB, from L3): `exact` prefill
/// 8-24% faster at 512 tokens, 2-12% at 128 (`bench model --prompt-tokens 128,512`, both models, one and
/// two threads, alternating builds on the 2-core VM of 2026-12-05). The panel never changes a bit: each
/// output is the same fixed-order dot product whatever rows share its pass.
fn panels(simd: bool, x: &[f32], t: usize, w: &Weight, rows: std::ops::Range<usize>, n: usize, out: &mut [f32]) {
    const PANEL_ELEMS: usize = 65536;
    let per_panel = (PANEL_ELEMS / n.max(1)).max(1);
    let width = rows.len();
    let (mut buf, mut part) = (Vec::new(), Vec::new());
    for p0 in rows.clone().step_by(per_panel) {
        let p1 = (p0 + per_panel).min(rows.end);
        let panel = w.rows(p0..p1, n, &mut buf);
        part.clear();
        part.resize(t * (p1 - p0), 0.0);
        dot::dots(simd, x, t, panel, n, &mut part);
        for (i, row) in part.chunks_exact(p1 - p0).enumerate() {
            out[i * width + (p0 - rows.start)..][..p1 - p0].copy_from_slice(row);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `install_awake` returns what `f` returns, its parallel work runs on the pool's threads, and a
    /// panic in `f` reaches the caller instead of leaving the waiters spinning (the scope would never
    /// end).
    #[test]
    fn install_awake_returns_f_and_a_panic_in_f_ends_the_waiting() {
        for threads in [1, 2, 3] {
            let exec = Exec::new(Precision::Exact, threads);
            let (sum, used) = exec.install_awake(|| {
                let used = std::sync::Mutex::new(std::collections::BTreeSet::new());
                let sum: u64 = (0..10_000usize)
                    .into_par_iter()
                    .with_max_len(1)
                    .map(|i| {
                        used.lock().unwrap().insert(rayon::current_thread_index());
                        i as u64
                    })
                    .sum();
                (sum, used.into_inner().unwrap())
            });
            assert_eq!(sum, 10_000 * 9_999 / 2);
            assert!(used.iter().all(Option::is_some) && !used.is_empty(), "{used:?}");
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                exec.install_awake(|| -> u32 { panic!("inside the pass") })
            }));
            assert!(caught.is_err(), "{threads} thread(s)");
            // The pool still works after it.
            assert_eq!(exec.install_awake(|| 7), 7);
        }
    }

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
        let w = Weight::F32(w);
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

    /// Pseudo-random whole blocks of `ty` for `elems` weights, with finite, moderate scales.
    pub(super) fn random_blocks(ty: crate::quant::GgmlType, elems: usize, seed: u32) -> Vec<u8> {
        use crate::quant::GgmlType as T;
        let mut next = crate::testing::xorshift32(seed.wrapping_mul(2_654_435_761).wrapping_add(1));
        let f16 = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
        let (be, bb) = (ty.block_elems(), ty.block_bytes());
        let mut out = Vec::new();
        for _ in 0..elems / be {
            let mut b: Vec<u8> = (0..bb).map(|_| next() as u8).collect();
            let scale = |n: u32| (n % 1000) as f32 / 20_000.0 + 1e-3;
            match ty {
                T::F16 => b.copy_from_slice(&f16((next() % 2000) as f32 / 1000.0 - 1.0)),
                T::Bf16 => b.copy_from_slice(
                    &half::bf16::from_f32((next() % 2000) as f32 / 1000.0 - 1.0).to_bits().to_le_bytes(),
                ),
                T::Q8_0 | T::Q4_0 | T::Q5_0 => b[..2].copy_from_slice(&f16(scale(next()))),
                T::Q4_1 | T::Q5_1 | T::Q4K | T::Q5K => {
                    b[..2].copy_from_slice(&f16(scale(next())));
                    b[2..4].copy_from_slice(&f16(scale(next())));
                }
                T::Q6K => b[208..210].copy_from_slice(&f16(scale(next()))),
                T::F32 => b.copy_from_slice(&((next() % 2000) as f32 / 1000.0 - 1.0).to_le_bytes()),
            }
            out.extend(b);
        }
        out
    }

    /// Weights held as blocks of every GGUF type give the bits of the same weights dequantized to f32,
    /// in any batch and on any thread count.
    #[test]
    fn block_weights_give_the_bits_of_their_f32_values() {
        use crate::quant::GgmlType as T;
        let (n_in, n_out) = (512, 67);
        let x: Vec<f32> = (0..8 * n_in).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for (i, ty) in [T::F16, T::Bf16, T::Q8_0, T::Q4_0, T::Q4_1, T::Q5_0, T::Q5_1, T::Q4K, T::Q5K, T::Q6K]
            .into_iter()
            .enumerate()
        {
            let w = Weight::from_blocks(ty, BlockBytes::Owned(random_blocks(ty, n_out * n_in, i as u32)), n_in);
            assert!(matches!(w, Weight::Blocks { .. }), "{}", ty.name());
            let f = Weight::F32(w.to_f32().into_owned());
            assert!(f.to_f32().iter().all(|v| v.is_finite()));
            for threads in [1, 2, 3] {
                let exec = Exec::new(Precision::Exact, threads);
                for t in [1, 2, 3, 4, 8] {
                    let x = &x[..t * n_in];
                    let want = exec.matmul_t(x, &f, None, t, n_in, n_out);
                    assert_eq!(bits(&exec.matmul_t(x, &w, None, t, n_in, n_out)), bits(&want), "{}", ty.name());
                }
            }
        }
    }

    /// `fast` on integer blocks: each row's bits are the same alone or in any batch, on any thread
    /// count, and no Q8_0 copy of the weights is involved.
    #[test]
    fn fast_products_on_blocks_are_the_same_in_any_batch_and_on_any_thread_count() {
        use crate::quant::GgmlType as T;
        let (n_in, n_out) = (512, 131);
        let x: Vec<f32> = (0..8 * n_in).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for (i, ty) in [T::Q8_0, T::Q4_0, T::Q4_1, T::Q5_0, T::Q5_1, T::Q4K, T::Q5K, T::Q6K].into_iter().enumerate() {
            let w = Weight::from_blocks(ty, BlockBytes::Owned(random_blocks(ty, n_out * n_in, 40 + i as u32)), n_in);
            assert!(w.integer_blocks(), "{}", ty.name());
            let reference = Exec::new(Precision::Fast, 1).matmul_t(&x, &w, None, 8, n_in, n_out);
            let exact = Exec::new(Precision::Exact, 1).matmul_t(&x, &w, None, 8, n_in, n_out);
            assert_ne!(bits(&reference), bits(&exact), "{}: fast computes on its own path", ty.name());
            for threads in [1, 2, 3] {
                let exec = Exec::new(Precision::Fast, threads);
                for (from, len) in [(0, 1), (5, 1), (2, 3), (1, 4), (3, 5), (0, 8)] {
                    let got = exec.matmul_t(&x[from * n_in..(from + len) * n_in], &w, None, len, n_in, n_out);
                    let want = &reference[from * n_out..(from + len) * n_out];
                    assert_eq!(bits(&got), bits(want), "{} rows {from}+{len}, {threads} threads", ty.name());
                }
            }
        }
    }
}
