//! Matrix kernels: f32 GEMM for prefill, f32 and Q8_0 matrix-vector products for decode, split across a
//! thread pool by output rows (each output is computed by exactly one thread in a fixed order, so results
//! do not depend on the thread count).

use rayon::prelude::*;

/// Batches up to this many rows use the matrix-vector path.
pub const SMALL_BATCH: usize = 4;
/// Weights per Q8_0 block.
const QK: usize = 32;

/// How the forward pass computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// f32 arithmetic on dequantized weights.
    Exact,
    /// Decode steps use Q8_0 weights and activations with integer dot products; prefill stays f32.
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

/// A weight matrix `[rows][cols]` re-quantized to Q8_0 blocks along `cols`.
#[derive(Debug)]
pub struct Q8 {
    rows: usize,
    cols: usize,
    q: Vec<i8>,
    scales: Vec<f32>,
}

impl Q8 {
    /// Quantizes `w` (`rows x cols`, `cols` a multiple of 32); `None` otherwise.
    pub fn new(w: &[f32], rows: usize, cols: usize) -> Option<Self> {
        if cols % QK != 0 || w.len() != rows * cols {
            return None;
        }
        let (q, scales) = quantize(w);
        Some(Q8 { rows, cols, q, scales })
    }
}

/// Per 32-value block: `d = max|x| / 127`, `q = round(x / d)`.
fn quantize(x: &[f32]) -> (Vec<i8>, Vec<f32>) {
    let mut q = vec![0i8; x.len()];
    let mut scales = Vec::with_capacity(x.len() / QK);
    for (xb, qb) in x.chunks_exact(QK).zip(q.chunks_exact_mut(QK)) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = (v * inv).round() as i8;
        }
        scales.push(d);
    }
    (q, scales)
}

/// A dot product with 16 independent accumulators, so the compiler can keep them in vector registers.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..16 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}

fn dot_q8(xq: &[i8], xs: &[f32], wq: &[i8], ws: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (checked just above).
        return unsafe { dot_q8_avx2(xq, xs, wq, ws) };
    }
    dot_q8_scalar(xq, xs, wq, ws)
}

fn dot_q8_scalar(xq: &[i8], xs: &[f32], wq: &[i8], ws: &[f32]) -> f32 {
    let mut sum = 0f32;
    for (((xb, &xd), wb), &wd) in xq.chunks_exact(QK).zip(xs).zip(wq.chunks_exact(QK)).zip(ws) {
        let mut acc = 0i32;
        for k in 0..QK {
            acc += i32::from(xb[k]) * i32::from(wb[k]);
        }
        sum += xd * wd * acc as f32;
    }
    sum
}

/// The same sums as [`dot_q8_scalar`], block by block, with AVX2: `|x| * sign(w, x)` pairs in 16 bits
/// (at most 2 * 127 * 127, no saturation: quantization never produces -128), then 32-bit sums. Integer
/// arithmetic is exact, so the result is bit-identical to the scalar path.
///
/// # Safety
///
/// The CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_q8_avx2(xq: &[i8], xs: &[f32], wq: &[i8], ws: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let ones = _mm256_set1_epi16(1);
    let mut sum = 0f32;
    for (((xb, &xd), wb), &wd) in xq.chunks_exact(QK).zip(xs).zip(wq.chunks_exact(QK)).zip(ws) {
        // SAFETY: both blocks are exactly 32 bytes (`chunks_exact(QK)`); unaligned loads.
        let (x, w) = unsafe { (_mm256_loadu_si256(xb.as_ptr().cast()), _mm256_loadu_si256(wb.as_ptr().cast())) };
        let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x));
        let quads = _mm256_madd_epi16(pairs, ones);
        let half = _mm_add_epi32(_mm256_castsi256_si128(quads), _mm256_extracti128_si256::<1>(quads));
        let two = _mm_add_epi32(half, _mm_shuffle_epi32::<0b01_00_11_10>(half));
        let one = _mm_add_epi32(two, _mm_shuffle_epi32::<0b10_11_00_01>(two));
        sum += xd * wd * _mm_cvtsi128_si32(one) as f32;
    }
    sum
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

    /// `x[t][n_in] * w[n_out][n_in]^T -> [t][n_out]`, using `q8` for small batches when given.
    pub fn matmul_t(&self, x: &[f32], w: &[f32], q8: Option<&Q8>, t: usize, n_in: usize, n_out: usize) -> Vec<f32> {
        assert_eq!(x.len(), t * n_in);
        assert_eq!(w.len(), n_out * n_in, "weight shape");
        let mut c = vec![0f32; t * n_out];
        // Rows of output per task: enough work to be worth a hand-off.
        let rows_per_task = (n_out / (4 * self.threads())).max(64);
        if t <= SMALL_BATCH {
            match q8.filter(|q| q.cols == n_in && q.rows == n_out) {
                Some(q8) => {
                    for (x, c) in x.chunks_exact(n_in).zip(c.chunks_exact_mut(n_out)) {
                        let (xq, xs) = quantize(x);
                        let blocks = n_in / QK;
                        self.pool.install(|| {
                            c.par_chunks_mut(rows_per_task).enumerate().for_each(|(task, c)| {
                                for (j, c) in c.iter_mut().enumerate() {
                                    let r = task * rows_per_task + j;
                                    *c = dot_q8(
                                        &xq,
                                        &xs,
                                        &q8.q[r * n_in..(r + 1) * n_in],
                                        &q8.scales[r * blocks..(r + 1) * blocks],
                                    );
                                }
                            })
                        });
                    }
                }
                None => {
                    // A packed GEMM would copy the whole weight matrix into panels for one row of output;
                    // reading each weight row once, straight from memory, is what bounds a matvec anyway.
                    for (x, c) in x.chunks_exact(n_in).zip(c.chunks_exact_mut(n_out)) {
                        self.pool.install(|| {
                            c.par_chunks_mut(rows_per_task).enumerate().for_each(|(task, c)| {
                                let w = &w[task * rows_per_task * n_in..];
                                for (c, w) in c.iter_mut().zip(w.chunks_exact(n_in)) {
                                    *c = dot(x, w);
                                }
                            })
                        });
                    }
                }
            }
            return c;
        }
        // Prefill: split the output columns (weight rows) across threads, one SGEMM each.
        let parts = self.threads().min(n_out.div_ceil(64)).max(1);
        let cols_per = n_out.div_ceil(parts);
        let c_addr = c.as_mut_ptr() as usize;
        self.pool.install(|| {
            (0..parts).into_par_iter().for_each(|p| {
                let j0 = p * cols_per;
                let n = cols_per.min(n_out.saturating_sub(j0));
                if n == 0 {
                    return;
                }
                // SAFETY: `x` is t x n_in row-major; the weight rows j0..j0+n are read as an n_in x n
                // matrix (element (k, j) at (j0 + j) * n_in + k); output columns j0..j0+n of the t x n_out
                // row-major `c` are written with row stride n_out. Each task writes a disjoint set of
                // columns of `c`, which outlives the scope, and nothing else touches `c` meanwhile.
                unsafe {
                    matrixmultiply::sgemm(
                        t,
                        n_in,
                        n,
                        1.0,
                        x.as_ptr(),
                        n_in as isize,
                        1,
                        w.as_ptr().add(j0 * n_in),
                        1,
                        n_in as isize,
                        0.0,
                        (c_addr as *mut f32).add(j0),
                        n_out as isize,
                        1,
                    );
                }
            })
        });
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

    #[test]
    fn the_simd_q8_dot_is_bit_identical_to_the_scalar_one() {
        let x: Vec<f32> = (0..640).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37).collect();
        let w: Vec<f32> = (0..640).map(|i| ((i * 53 % 97) as f32 - 48.0) * 1.9).collect();
        let ((xq, xs), (wq, ws)) = (quantize(&x), quantize(&w));
        assert!(xq.iter().chain(&wq).any(|&q| q == 127 || q == -127), "extremes exercised");
        assert_eq!(dot_q8(&xq, &xs, &wq, &ws).to_bits(), dot_q8_scalar(&xq, &xs, &wq, &ws).to_bits());
    }

    #[test]
    fn every_path_computes_the_same_product() {
        let (t, n_in, n_out) = (7, 96, 200);
        let x: Vec<f32> = (0..t * n_in).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let w: Vec<f32> = (0..n_out * n_in).map(|i| ((i * 53 % 97) as f32 - 48.0) / 60.0).collect();
        let naive: Vec<f32> = (0..t)
            .flat_map(|i| {
                let (x, w) = (&x, &w);
                (0..n_out).map(move |j| (0..n_in).map(|k| x[i * n_in + k] * w[j * n_in + k]).sum::<f32>())
            })
            .collect();
        let q8 = Q8::new(&w, n_out, n_in).unwrap();
        for threads in [1, 2, 3] {
            let exec = Exec::new(Precision::Exact, threads);
            let gemm = exec.matmul_t(&x, &w, None, t, n_in, n_out);
            let vec1: Vec<f32> =
                (0..t).flat_map(|i| exec.matmul_t(&x[i * n_in..(i + 1) * n_in], &w, None, 1, n_in, n_out)).collect();
            let quant: Vec<f32> = (0..t)
                .flat_map(|i| exec.matmul_t(&x[i * n_in..(i + 1) * n_in], &w, Some(&q8), 1, n_in, n_out))
                .collect();
            for i in 0..naive.len() {
                assert!((gemm[i] - naive[i]).abs() < 1e-3, "gemm {i}");
                assert!((vec1[i] - naive[i]).abs() < 1e-3, "matvec {i}");
                assert!(
                    (quant[i] - naive[i]).abs() < 0.05 * naive[i].abs().max(1.0),
                    "q8 {i}: {} vs {}",
                    quant[i],
                    naive[i]
                );
            }
        }
    }
}
