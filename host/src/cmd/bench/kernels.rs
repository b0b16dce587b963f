//! `pdhost bench kernels`: the linear layers of a decode step alone (every layer's seven products and
//! the output head, in the forward pass's order), for 1 and more rows at once, beside a memcpy of the
//! same weight bytes in the same run. It shows what `bench model`'s decode columns are made of: how
//! near the weights' memory traffic the kernels run, and how a batch shares each weight load. Each
//! product quantizes its own activations in `fast`, where the forward pass quantizes them once for q,
//! k and v and once for gate and up.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use model::arch::{Config, FastWeights, Model};
use model::gguf::Gguf;
use model::kernels::{Precision, Weight, Q8};
use pdhost::request::{self, Field};
use serde_json::json;

use crate::cli::KernelsBenchArgs;
use crate::cmd::outln;

/// The most rows `--batch` multiplies at once.
const MAX_BATCH: u64 = 64;
/// The most threads `--threads` asks for.
const MAX_THREADS: u64 = 64;
/// The most timed passes `--iters` asks for.
const MAX_ITERS: u64 = 1000;
/// The last-level cache assumed where the system does not say (`--cold`).
const DEFAULT_LLC: usize = 256 << 20;

/// `--cold`: a buffer of twice the last-level cache, read through before each timed pass so that the
/// pass finds none of its weights cached (read, not written: evicting clean lines writes nothing back
/// during the pass).
struct Evict(Vec<u8>);

impl Evict {
    fn new(cold: bool) -> Self {
        Evict(if cold { shm_ring::prefaulted(2 * last_level_cache().unwrap_or(DEFAULT_LLC)) } else { Vec::new() })
    }

    /// Reads one word of every cache line of the buffer (nothing when not `--cold`).
    fn run(&self) {
        let sum = self.0.chunks(64).fold(0u8, |acc, line| acc.wrapping_add(line[0]));
        std::hint::black_box(sum);
    }
}

/// The largest cache of CPU 0 as Linux describes it (`/sys/devices/system/cpu/cpu0/cache`), in bytes.
pub(super) fn last_level_cache() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| {
        let size = std::fs::read_to_string(e.ok()?.path().join("size")).ok()?;
        let size = size.trim();
        let (digits, unit) = size.split_at(size.find(|c: char| !c.is_ascii_digit()).unwrap_or(size.len()));
        let unit = match unit {
            "" => 1,
            "K" => 1 << 10,
            "M" => 1 << 20,
            "G" => 1 << 30,
            _ => return None,
        };
        digits.parse::<usize>().ok()?.checked_mul(unit)
    })
    .max()
}

/// One product of a pass: the weight, its Q8_0 copy in `fast` where it has one, and its shape.
struct Product<'a> {
    /// `q`, `k`, `v`, `o`, `gate`, `up`, `down` or `head`.
    kind: &'static str,
    weight: &'a Weight,
    q8: Option<&'a Q8>,
    n_in: usize,
    n_out: usize,
}

/// Every linear product of one decode step of `model`, in the forward pass's order.
fn products<'a>(model: &'a Model, config: &Config) -> Vec<Product<'a>> {
    let (hidden, qd, kvd) = (config.hidden, config.heads * config.head_dim, config.kv_heads * config.head_dim);
    let mut all = Vec::new();
    for (l, layer) in model.layers.iter().enumerate() {
        let q8 = |i: usize| model.q8.as_ref().and_then(|f| f.layers[l][i].as_ref());
        let shapes = [
            ("q", &layer.wq, hidden, qd),
            ("k", &layer.wk, hidden, kvd),
            ("v", &layer.wv, hidden, kvd),
            ("o", &layer.wo, qd, hidden),
            ("gate", &layer.gate, hidden, config.ffn),
            ("up", &layer.up, hidden, config.ffn),
            ("down", &layer.down, config.ffn, hidden),
        ];
        for (i, (kind, weight, n_in, n_out)) in shapes.into_iter().enumerate() {
            let weight = FastWeights::layer(model.q8.as_ref(), l, i, weight);
            all.push(Product { kind, weight, q8: q8(i), n_in, n_out });
        }
    }
    let head = FastWeights::head(model.q8.as_ref(), model.lm_head.as_ref().unwrap_or(&model.embed));
    let q8 = model.q8.as_ref().and_then(|f| f.head.as_ref());
    all.push(Product { kind: "head", weight: head, q8, n_in: hidden, n_out: config.vocab });
    all
}

/// The times of one pass's products, by kind in first-seen order.
fn by_kind(products: &[Product<'_>], times: &[Duration]) -> Vec<(&'static str, Duration)> {
    let mut kinds: Vec<(&'static str, Duration)> = Vec::new();
    for (p, &t) in products.iter().zip(times) {
        match kinds.iter_mut().find(|(k, _)| *k == p.kind) {
            Some((_, sum)) => *sum += t,
            None => kinds.push((p.kind, t)),
        }
    }
    kinds
}

/// One timed case.
struct Row {
    model: &'static str,
    precision: &'static str,
    threads: usize,
    batch: usize,
    /// The best pass: its total, and per kind.
    pass: Duration,
    kinds: Vec<(&'static str, Duration)>,
    /// The bytes a pass reads from its weights (each weight's own bytes, or its Q8_0 copy's in `fast`).
    weight_bytes: u64,
    /// The best memcpy of those bytes, weight by weight in the same order.
    memcpy: Duration,
}

impl Row {
    fn rows_per_s(&self) -> f64 {
        self.batch as f64 / self.pass.as_secs_f64()
    }
}

/// The best of `reps` passes over every product with `t` rows of activations, and each product's time in
/// that pass.
fn time_passes(
    model: &Model,
    products: &[Product<'_>],
    t: usize,
    reps: usize,
    evict: &Evict,
) -> (Duration, Vec<Duration>) {
    let widest = products.iter().map(|p| p.n_in).max().unwrap_or(0);
    let x: Vec<f32> = (0..t * widest).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
    let mut best = (Duration::MAX, Vec::new());
    // One pass untimed first: the pool's threads started, the weights' pages touched.
    for rep in 0..=reps {
        evict.run();
        let times: Vec<Duration> = model.exec.install(|| {
            products
                .iter()
                .map(|p| {
                    let start = Instant::now();
                    let y = model.exec.matmul_t(&x[..t * p.n_in], p.weight, p.q8, t, p.n_in, p.n_out);
                    let took = start.elapsed();
                    std::hint::black_box(y);
                    took
                })
                .collect()
        });
        let total = times.iter().sum();
        if rep > 0 && total < best.0 {
            best = (total, times);
        }
    }
    best
}

/// The bytes each product reads: its Q8_0 copy's values and scales in `fast` where it has one, else the
/// weight's own.
fn read_bytes<'a>(p: &Product<'a>, precision: Precision) -> Vec<&'a [u8]> {
    match (precision, p.q8) {
        (Precision::Fast, Some(q8)) => q8.parts().to_vec(),
        _ => vec![p.weight.as_bytes()],
    }
}

/// The best of `reps` memcpys of every product's bytes, in order, into prefaulted buffers, by `threads`
/// threads as the products are (each copies its share of every product's bytes), so that the reference
/// has the row's thread count.
fn time_memcpy(products: &[Product<'_>], precision: Precision, threads: usize, reps: usize, evict: &Evict) -> Duration {
    let sources: Vec<&[u8]> = products.iter().flat_map(|p| read_bytes(p, precision)).collect();
    let longest = sources.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut dests: Vec<Vec<u8>> = (0..threads).map(|_| shm_ring::prefaulted(longest.div_ceil(threads))).collect();
    let mut best = Duration::MAX;
    for rep in 0..=reps {
        evict.run();
        // The clock starts once every thread is up (the passes run on a pool that is already up).
        let ready = std::sync::Barrier::new(threads + 1);
        let mut start = Instant::now();
        std::thread::scope(|s| {
            for (t, dest) in dests.iter_mut().enumerate() {
                let (sources, ready) = (&sources, &ready);
                s.spawn(move || {
                    ready.wait();
                    for src in sources {
                        let share = src.len().div_ceil(threads);
                        let part = &src[(t * share).min(src.len())..((t + 1) * share).min(src.len())];
                        dest[..part.len()].copy_from_slice(part);
                        std::hint::black_box(&dest);
                    }
                });
            }
            ready.wait();
            start = Instant::now();
        });
        if rep > 0 {
            best = best.min(start.elapsed());
        }
    }
    best
}

pub fn run(args: &KernelsBenchArgs) -> anyhow::Result<ExitCode> {
    let batches = super::counts(Field::Batch, &args.batch, MAX_BATCH)?;
    let threads = super::counts(Field::Threads, &args.threads, MAX_THREADS.min(model::kernels::max_threads() as u64))?;
    let reps = request::check_count(Field::Iters, args.iters, 1, MAX_ITERS)? as usize;
    let evict = Evict::new(args.cold);
    let mut cases = Vec::new();
    for name in args.models.iter().map(|m| m.name()) {
        let path = super::fetched(name, args.json)?;
        cases.push((name, Gguf::open(&path)?));
    }
    let bar = super::progress((cases.len() * 2 * threads.len() * batches.len()) as u64, args.json);
    let mut rows = Vec::new();
    for (name, gguf) in &cases {
        let config = Config::from_gguf(gguf)?;
        let mut model = Model::from_gguf(gguf)?;
        for precision in [Precision::Exact, Precision::Fast] {
            for &thr in &threads {
                model.configure(precision, thr);
                let products = products(&model, &config);
                let weight_bytes = products.iter().flat_map(|p| read_bytes(p, precision)).map(|b| b.len() as u64).sum();
                let memcpy = time_memcpy(&products, precision, thr, reps, &evict);
                for &batch in &batches {
                    bar.set_message(format!("{name} {} {thr}t batch {batch}", precision.name()));
                    let (pass, times) = time_passes(&model, &products, batch, reps, &evict);
                    rows.push(Row {
                        model: name,
                        precision: precision.name(),
                        threads: thr,
                        batch,
                        kinds: by_kind(&products, &times),
                        pass,
                        weight_bytes,
                        memcpy,
                    });
                    bar.inc(1);
                }
            }
        }
    }
    bar.finish_and_clear();
    // Each row's rows/s over the same model, precision and threads at the smallest batch.
    let over_first = |r: &Row| {
        rows.iter()
            .filter(|o| o.model == r.model && o.precision == r.precision && o.threads == r.threads)
            .min_by_key(|o| o.batch)
            .map_or(f64::NAN, |o| r.rows_per_s() / o.rows_per_s())
    };
    let gbs = |bytes: u64, d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
    if args.json {
        let out: Vec<_> = rows
            .iter()
            .map(|r| {
                let kinds: serde_json::Map<String, serde_json::Value> =
                    r.kinds.iter().map(|(k, d)| (k.to_string(), json!(d.as_secs_f64() * 1e3))).collect();
                json!({"model": r.model, "precision": r.precision, "threads": r.threads, "batch": r.batch,
                       "pass_ms": r.pass.as_secs_f64() * 1e3, "by_kind_ms": kinds,
                       "rows_per_s": r.rows_per_s(), "rows_per_s_over_first_batch": over_first(r),
                       "weight_bytes": r.weight_bytes, "weights_gb_s": gbs(r.weight_bytes, r.pass),
                       "memcpy_ms": r.memcpy.as_secs_f64() * 1e3, "memcpy_gb_s": gbs(r.weight_bytes, r.memcpy)})
            })
            .collect();
        outln!(
            "{}",
            json!({"bench": "kernels", "batch": batches, "threads": threads, "reps": reps, "cold": args.cold, "results": out})
        )?;
        return Ok(ExitCode::SUCCESS);
    }
    let from = if args.cold { ", each from memory (the caches read over first)" } else { "" };
    outln!(
        "the linear products of one decode step (every layer's q, k, v, o, gate, up, down, then the head) for `batch` rows at once, best of {reps} passes{from}; memcpy: the same weight bytes, weight by weight, into a prefaulted buffer, same run"
    )?;
    outln!(
        "{:<13} {:<6} {:>3} {:>5} {:>9} {:>9} {:>9} {:>8} {:>9} {:>9} {:>7} {:>8}",
        "model",
        "prec",
        "thr",
        "batch",
        "pass ms",
        "layers ms",
        "head ms",
        "rows/s",
        "x batch1",
        "GB/s",
        "memcpy",
        "x memcpy"
    )?;
    for r in &rows {
        let head = r.kinds.iter().find(|(k, _)| *k == "head").map_or(Duration::ZERO, |(_, d)| *d);
        outln!(
            "{:<13} {:<6} {:>3} {:>5} {:>9.2} {:>9.2} {:>9.2} {:>8.1} {:>8.2}x {:>9.1} {:>7.1} {:>7.2}x",
            r.model,
            r.precision,
            r.threads,
            r.batch,
            r.pass.as_secs_f64() * 1e3,
            (r.pass - head).as_secs_f64() * 1e3,
            head.as_secs_f64() * 1e3,
            r.rows_per_s(),
            over_first(r),
            gbs(r.weight_bytes, r.pass),
            gbs(r.weight_bytes, r.memcpy),
            r.memcpy.as_secs_f64() / r.pass.as_secs_f64()
        )?;
    }
    outln!(
        "GB/s: the weight bytes a pass reads (a GGUF's own blocks; in `fast`, a Q8_0 copy where a weight is not integer blocks) over the pass's time; x memcpy: the memcpy's time over the pass's; x batch1: rows/s over the smallest batch's; the memcpy runs on the row's threads"
    )?;
    Ok(ExitCode::SUCCESS)
}
