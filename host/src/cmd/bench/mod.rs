//! `pdhost bench ...`: whole-system throughput, each figure beside its physical reference.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use shm_format::ring::RingGeometry;
use shm_format::{Dtype, KvGeometry, LayerKv, Manifest};
use shm_ring::segment::memfd::MemfdSegment;
use shm_ring::segment::Segment;
use shm_ring::{create_ring, RingWriter};

use pdhost::kv::{IntoSequence, KvConfig, PagedKv, SeqId};
use shm_ring::HostRing;

use crate::cli::{Bench, BenchArgs, IngestBenchArgs, RingBenchArgs};
use crate::cmd::outln;
use pdhost::request::{self, Field, Invalid};

mod kernels;
mod mixed;
mod model_bench;
mod pd_bench;
mod peer;
mod serve_bench;
mod soak;

pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    // The workspace's crates unoptimised run 10-100x slower: said to a person at a terminal, as the
    // progress bars are (a script's stderr keeps only what it asked for).
    if cfg!(debug_assertions) && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        eprintln!("warning: a debug build (cargo without --release): these figures are not pdhost's speed");
    }
    match &args.which {
        Bench::Ring(a) => ring(a),
        Bench::Ingest(a) => ingest(a),
        Bench::Model(a) => model_bench::run(a),
        Bench::Kernels(a) => kernels::run(a),
        Bench::Pd(a) => pd_bench::run(a),
        Bench::Serve(a) => serve_bench::run(a),
        Bench::Soak(a) => soak::run(a),
    }
}

/// The model file of a known model, fetched first if needed (a progress bar unless `quiet`).
pub(crate) fn fetched(name: &str, quiet: bool) -> anyhow::Result<std::path::PathBuf> {
    // An unknown name is the user's `--model` (exit 2, naming the flag), not a failed fetch.
    if let Err(model::registry::FetchError::Unknown { expected, .. }) = model::registry::spec(name) {
        let field = pdhost::request::Field::Model;
        return Err(pdhost::request::Invalid::new(field, format!("one of {expected}"), format_args!("{name:?}")).into());
    }
    let mut bar = crate::cmd::models::Bar::new(quiet);
    let path = model::registry::fetch(name, &mut bar)?;
    bar.finish();
    Ok(path)
}

/// Each of a list flag's counts checked to be 1 to `max`, as `usize`.
fn counts(field: Field, values: &[u64], max: u64) -> Result<Vec<usize>, Invalid> {
    values.iter().map(|&v| request::check_count(field, v, 1, max).map(|v| v as usize)).collect()
}

/// A progress bar on a terminal, nothing otherwise (or with `--json`).
pub(crate) fn progress(len: u64, json: bool) -> ProgressBar {
    if json || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg:>24} [{bar:30}] {pos}/{len}").expect("template").progress_chars("=> "),
    );
    bar
}

/// A dense span of `bytes` payload: 16 layers x 8 KV heads x 128 head dim in bf16 is 64 KiB per token.
/// The CMake options llama.cpp is built with for the benches' llama.cpp columns: every vector extension
/// this CPU has, named one by one instead of `-march=native`, and AMX off. On this project's machines the
/// kernel grants AMX tile data only on request, and llama.cpp built natively runs `tilezero` without
/// requesting it and dies of SIGILL in its first `llama_decode`; a peer that cannot run is no reference.
pub(crate) fn llama_cpp_cmake_options() -> Vec<String> {
    #[cfg(target_arch = "x86_64")]
    let has = |f: &str| match f {
        "AVX" => std::arch::is_x86_feature_detected!("avx"),
        "AVX2" => std::arch::is_x86_feature_detected!("avx2"),
        "FMA" => std::arch::is_x86_feature_detected!("fma"),
        "F16C" => std::arch::is_x86_feature_detected!("f16c"),
        "BMI2" => std::arch::is_x86_feature_detected!("bmi2"),
        "AVX_VNNI" => std::arch::is_x86_feature_detected!("avxvnni"),
        "AVX512" => std::arch::is_x86_feature_detected!("avx512f"),
        "AVX512_VBMI" => std::arch::is_x86_feature_detected!("avx512vbmi"),
        "AVX512_VNNI" => std::arch::is_x86_feature_detected!("avx512vnni"),
        "AVX512_BF16" => std::arch::is_x86_feature_detected!("avx512bf16"),
        _ => false,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let has = |_: &str| false;
    let mut options = vec!["-DGGML_NATIVE=OFF".to_string()];
    for f in ["AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX_VNNI", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"] {
        options.push(format!("-DGGML_{f}={}", if has(f) { "ON" } else { "OFF" }));
    }
    options.extend(["AMX_TILE", "AMX_INT8", "AMX_BF16"].map(|f| format!("-DGGML_{f}=OFF")));
    options
}

fn span_of(bytes: u64) -> anyhow::Result<Manifest> {
    const PER_TOKEN: u64 = 16 * 2 * 8 * 128 * 2;
    anyhow::ensure!(bytes.is_multiple_of(PER_TOKEN) && bytes > 0, "span size must be a positive multiple of 64 KiB");
    let geometry = KvGeometry { layers: vec![LayerKv::Full { kv_heads: 8, head_dim: 128 }; 16] };
    Ok(Manifest::dense(&geometry, 1, 0..bytes / PER_TOKEN, Dtype::Bf16).expect("uniform geometry"))
}

/// A one-slot ring with both ends in this process, plus the memcpy reference's source and destination: a
/// second read-only mapping of the data segment and a prefaulted buffer of the frame's size, so the
/// reference moves exactly the bytes the host moves, between the same kinds of memory.
struct Bench1 {
    geometry: RingGeometry,
    reader: HostRing,
    writer: RingWriter<MemfdSegment, MemfdSegment>,
    source: MemfdSegment,
    dest: Vec<u8>,
}

impl Bench1 {
    fn new(frame_capacity: u64) -> anyhow::Result<Self> {
        let geometry = RingGeometry::new(1, frame_capacity).context("ring geometry")?;
        let reader = create_ring("pdhost-bench", geometry, 1).context("creating the ring")?;
        let fds = reader.peer_fds().map(|fd| fd.try_clone_to_owned().expect("dup"));
        let writer = RingWriter::open(fds).context("mapping the producer end")?;
        let data_fd = reader.peer_fds()[1].try_clone_to_owned()?;
        let source = MemfdSegment::open("bench.data", data_fd, geometry.data_len(), false)?;
        let dest = shm_ring::prefaulted(geometry.frame_capacity() as usize);
        Ok(Bench1 { geometry, reader, writer, source, dest })
    }

    /// The memcpy reference: the frame's bytes from the shared mapping into the private buffer.
    fn memcpy(&mut self, frame_len: u64) -> Duration {
        let t = Instant::now();
        let at = self.geometry.frame_offset(0) as usize;
        // SAFETY: both ends of the ring are this thread's, and its writer is idle while the reference runs.
        unsafe { self.source.memcpy_out(at, &mut self.dest[..frame_len as usize]) };
        let d = t.elapsed();
        std::hint::black_box(&self.dest);
        d
    }
}

/// Ends the child started from `cmd` with `signal` when the thread that starts it ends: a bench stopped
/// by a signal (its destructors do not run) must not leave a server or a peer running. Start it from the
/// bench's main thread: the signal follows the spawning thread, not the process.
fn end_with_bench(cmd: &mut std::process::Command, signal: libc::c_int) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: the closure runs in the forked child before exec and makes only the async-signal-safe
    // system calls prctl, getppid and kill; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The bench may have died before the prctl: then nothing would ever send the signal.
            if libc::getppid() as u32 != parent {
                libc::kill(libc::getpid(), signal);
            }
            Ok(())
        });
    }
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// The median: the middle value, or the mean of the middle two.
fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    let n = v.len();
    if n.is_multiple_of(2) {
        (v[n / 2 - 1] + v[n / 2]) / 2
    } else {
        v[n / 2]
    }
}

/// The checksum bench's buffer "from memory": 256 MiB, or twice the last-level cache where that is
/// larger (this machine's L3 alone is 260 MB), so that its passes do not read from cache.
fn memory_bytes() -> u64 {
    kernels::last_level_cache().map_or(256 << 20, |llc| (2 * llc as u64).max(256 << 20))
}

/// Repetitions: 1 to `max`, or `default` when not given.
fn iters(given: Option<u64>, max: u64, default: impl FnOnce() -> u64) -> Result<u64, Invalid> {
    given.map_or_else(|| Ok(default()), |n| request::check_count(Field::Iters, n, 1, max))
}

/// The largest ring bench span.
const MAX_RING_MIB: u64 = 4096;

/// The longest ingest bench span.
const MAX_INGEST_TOKENS: u64 = 65536;

fn ring(args: &RingBenchArgs) -> anyhow::Result<ExitCode> {
    if args.sizes.is_empty() {
        return Err(Invalid::new(Field::Sizes, "at least one size", "none").into());
    }
    iters(args.iters, 10_000, || 5)?;
    for &mib in &args.sizes {
        request::check_count(Field::Sizes, mib, 1, MAX_RING_MIB)?;
        // The ring slot, the reader's private copy, the memcpy reference's buffer, and the checksum bench's.
        request::check_memory(
            Field::Sizes,
            &format!("a {mib} MiB ring and its copies"),
            ((3 * mib) << 20) + memory_bytes(),
        )?;
    }
    let mut rows = Vec::new();
    for &mib in &args.sizes {
        let bytes = mib << 20;
        let manifest = span_of(bytes)?;
        let iters = iters(args.iters, 10_000, || ((2u64 << 30) / bytes).clamp(5, 200))?;
        let bar = progress(iters, args.json);
        bar.set_message(format!("ring {mib} MiB"));

        let mut b = Bench1::new(bytes + (64 << 10))?;
        let mut first = true;
        let (mut ring_t, mut copy_t) = (Vec::new(), Vec::new());
        let mut frame_len = 0;
        // One more than timed: the first take sets up the reader's private buffer (touching a span's
        // worth of fresh pages), where the memcpy's buffer is prefaulted; neither first pass is timed.
        for i in 0..=iters {
            // Producer side, not measured: the payload stays in the slot between iterations, only the header
            // (new generation and sequence) and checksum are rewritten.
            b.writer.write_span(&manifest, deadline(), |p| {
                if first {
                    for (i, b) in p.iter_mut().enumerate() {
                        *b = (i as u8).wrapping_mul(31);
                    }
                }
            })?;
            first = false;

            let t = Instant::now();
            let span = b.reader.try_take()?.context("span committed")?;
            let took = t.elapsed();
            frame_len = span.header.frame_len;
            std::hint::black_box(span.payload.len());

            let copied = b.memcpy(frame_len);
            if i > 0 {
                ring_t.push(took);
                copy_t.push(copied);
                bar.inc(1);
            }
        }
        bar.finish_and_clear();
        let (ring_m, copy_m) = (median(ring_t), median(copy_t));
        rows.push((bytes, frame_len, iters, gbps(frame_len, ring_m), gbps(frame_len, copy_m)));
    }

    let checksums = checksum_rates(args.json);
    if args.json {
        let results: Vec<_> = rows
            .iter()
            .map(|&(span, frame, iters, ring, copy)| {
                json!({"span_bytes": span, "frame_bytes": frame, "iters": iters, "ring_gbps": ring, "memcpy_gbps": copy, "ratio": ring / copy})
            })
            .collect();
        let sums: Vec<_> = checksums
            .iter()
            .map(|(name, cached, mem)| json!({"algo": name, "l2_gbps": cached, "memory_gbps": mem}))
            .collect();
        outln!("{}", json!({"bench": "ring", "results": results, "checksum": sums}))?;
    } else {
        outln!(
            "ring -> private buffer: header check, copy with the xxh3 checksum fused into it, re-check, manifest validation"
        )?;
        outln!(
            "memcpy: the same frame bytes from the same shared mapping into a prefaulted buffer, same run (median)"
        )?;
        outln!("{:>10} {:>12} {:>12} {:>8} {:>6}", "span", "ring GB/s", "memcpy GB/s", "ratio", "iters")?;
        for (span, _, iters, ring, copy) in &rows {
            outln!("{:>6} MiB {ring:>12.2} {copy:>12.2} {:>7.2}x {iters:>6}", span >> 20, ring / copy)?;
        }
        outln!()?;
        let (chunk, memory) = (shm_ring::COPY_CHUNK >> 10, memory_bytes() >> 20);
        let (chunk, memory) = (format!("in L2 ({chunk} KiB)"), format!("from memory ({memory} MiB)"));
        outln!("checksum alone, single thread:  {chunk:>14} {memory:>16}")?;
        for (name, cached, mem) in &checksums {
            outln!("  {name:<30} {cached:>10.2} GB/s {mem:>11.2} GB/s")?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Throughput of the two checksum candidates, over a cache-resident chunk (as the ring uses them) and
/// over a buffer twice the last-level cache ([`memory_bytes`]).
fn checksum_rates(json: bool) -> Vec<(&'static str, f64, f64)> {
    let small: Vec<u8> = (0..shm_ring::COPY_CHUNK).map(|i| i as u8).collect();
    let big: Vec<u8> = (0..memory_bytes() as usize).map(|i| (i * 7) as u8).collect();
    let bar = progress(2, json);
    bar.set_message("checksums");
    type Hash = fn(&[u8]) -> u64;
    let algos: [(&str, Hash); 2] = [
        ("xxh3-64 (twox-hash)", twox_hash::XxHash3_64::oneshot),
        ("crc32c (crc32c, SSE4.2)", |b| u64::from(crc32c::crc32c(b))),
    ];
    let out = algos
        .iter()
        .map(|&(name, f)| {
            let rate = |buf: &[u8], reps: usize| {
                let times: Vec<Duration> = (0..reps)
                    .map(|_| {
                        let t = Instant::now();
                        std::hint::black_box(f(std::hint::black_box(buf)));
                        t.elapsed()
                    })
                    .collect();
                gbps(buf.len() as u64, median(times))
            };
            let r = (name, rate(&small, 2000), rate(&big, 5));
            bar.inc(1);
            r
        })
        .collect();
    bar.finish_and_clear();
    out
}

fn ingest(args: &IngestBenchArgs) -> anyhow::Result<ExitCode> {
    let gemma3 = |layers| shm_format::testing::interleaved(layers, 6, 512, 1, 256);
    let models = [("gemma3-270m", gemma3(18)), ("gemma3-1b", gemma3(26))];
    let dtypes = [Dtype::Bf16, Dtype::F32];
    if args.tokens.is_empty() {
        return Err(Invalid::new(Field::Tokens, "at least one span length", "none").into());
    }
    iters(args.iters, 1000, || 3)?;
    for &tokens in &args.tokens {
        request::check_count(Field::Tokens, tokens, 1, MAX_INGEST_TOKENS)?;
    }
    let max_tokens = *args.tokens.iter().max().expect("not empty");
    // The biggest span (Gemma3-1B, f32) in the ring, its memcpy copy, and the cache holding it.
    let biggest = Manifest::grouped(&models[1].1, 1, 0..max_tokens, Dtype::F32).payload_len();
    request::check_memory(Field::Tokens, &format!("{max_tokens}-token spans, their copies and a cache"), 3 * biggest)?;
    let cases = (models.len() * dtypes.len() * 2 * args.tokens.len()) as u64;
    let bar = progress(cases, args.json);
    let mut rows = Vec::new();
    for (name, geometry) in &models {
        for &dtype in &dtypes {
            // One ring and one cache per model and dtype, sized for the longest span.
            let biggest = Manifest::grouped(geometry, 1, 0..max_tokens, dtype);
            let mut b = Bench1::new(biggest.payload_len() + (1 << 20))?;
            let full_layers = geometry.layers.iter().filter(|l| matches!(l, LayerKv::Full { .. })).count() as u64;
            let budget = biggest.payload_len() / geometry.layers.len() as u64 * (full_layers + 1) + (512 << 20);
            let mut config = KvConfig::new(geometry.clone(), dtype, budget);
            config.max_seqs = 1;
            let mut kv = PagedKv::new(config).context("building the KV cache")?;
            for dense in [true, false] {
                for &tokens in &args.tokens {
                    bar.set_message(format!("{name} {tokens}"));
                    let manifest = if dense {
                        Manifest::dense(geometry, 1, 0..tokens, dtype).expect("uniform heads")
                    } else {
                        Manifest::grouped(geometry, 1, 0..tokens, dtype)
                    };
                    let bytes = manifest.payload_len();
                    let iters = iters(args.iters, 1000, || ((1u64 << 30) / bytes).clamp(3, 50))?;
                    let (mut ingest_t, mut copy_t) = (Vec::new(), Vec::new());
                    let mut frame_len = 0;
                    for i in 0..iters {
                        // Not measured: the producer's write and resetting the sequence.
                        let info = b.writer.write_span(&manifest, deadline(), |p| {
                            if i == 0 {
                                p.iter_mut().enumerate().for_each(|(j, x)| *x = (j as u8).wrapping_mul(31));
                            }
                        })?;
                        frame_len = info.frame_len;
                        let _ = kv.remove_sequence(SeqId(1));
                        kv.add_sequence(SeqId(1), 1)?;

                        let t = Instant::now();
                        b.reader
                            .take_into(&mut IntoSequence {
                                kv: &mut kv,
                                seq: SeqId(1),
                                end: manifest.token_end,
                                dtype: manifest.dtype,
                            })
                            .map_err(|e| anyhow::anyhow!("{e}"))?
                            .context("span committed")?;
                        ingest_t.push(t.elapsed());
                        copy_t.push(b.memcpy(frame_len));
                    }
                    anyhow::ensure!(kv.seq_len(SeqId(1)) == Some(tokens), "span not ingested");
                    let (ing, copy) = (gbps(frame_len, median(ingest_t)), gbps(frame_len, median(copy_t)));
                    rows.push((
                        *name,
                        if dense { "dense" } else { "grouped" },
                        dtype.name(),
                        tokens,
                        frame_len,
                        iters,
                        ing,
                        copy,
                    ));
                    bar.inc(1);
                }
            }
        }
    }
    bar.finish_and_clear();
    if args.json {
        let results: Vec<_> = rows
            .iter()
            .map(|&(model, layout, dtype, tokens, frame, iters, ing, copy)| {
                json!({"model": model, "layout": layout, "dtype": dtype, "tokens": tokens, "frame_bytes": frame,
                       "iters": iters, "ingest_gbps": ing, "memcpy_gbps": copy, "ratio": ing / copy})
            })
            .collect();
        outln!("{}", json!({"bench": "ingest", "threads": 1, "results": results}))?;
    } else {
        outln!("ring -> paged KV, one thread: header check, fused copy + checksum, manifest and receiver validation,")?;
        outln!("scatter into pages (sliding groups keep the window's tail), re-check, commit; memcpy: the same frame")?;
        outln!("bytes from the same shared mapping into a prefaulted buffer, same run (medians)")?;
        outln!(
            "{:<12} {:<8} {:<5} {:>6} {:>10} {:>11} {:>12} {:>7}",
            "model",
            "layout",
            "dtype",
            "tokens",
            "frame MiB",
            "ingest GB/s",
            "memcpy GB/s",
            "ratio"
        )?;
        for (model, layout, dtype, tokens, frame, _, ing, copy) in &rows {
            outln!(
                "{model:<12} {layout:<8} {dtype:<5} {tokens:>6} {:>10.1} {ing:>11.2} {copy:>12.2} {:>6.2}x",
                *frame as f64 / (1 << 20) as f64,
                ing / copy
            )?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
