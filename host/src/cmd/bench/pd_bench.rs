//! `pdhost bench pd`: time to first token with prefill in a warm producer subprocess against prefill in
//! the host, on the same model, prompts and cache, in the same run; where PD's extra time goes; and
//! decode tokens/s after each (the same cache, so it must not differ).

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use model::arch::{Config, Model};
use model::gguf::Gguf;
use model::kernels::Precision;
use model::tokenizer::Tokenizer;
use pdhost::engine::{Engine, Generation, OnFailure, PrefillBy};
use pdhost::request::{self, Field, Invalid, Limits, RawRequest};
use serde_json::json;

use super::model_bench::median;
use crate::cli::{PdBenchArgs, PrecisionArg};
use crate::cmd::producer::{Choice, Ring};
use crate::cmd::{kv_error, outln};

const TEXT: &str = include_str!("../../../../fixtures/prompts/lgpl-650w.txt");

/// Medians over the iterations of one prompt length.
struct Row {
    tokens: u64,
    ttft_local: f64,
    ttft_pd: f64,
    local_forward: f64,
    local_ingest: f64,
    backend: f64,
    frame: f64,
    take: f64,
    ipc: f64,
    /// IPC and take together: the median of each run's sum (not the sum of their medians).
    transfer: f64,
    span_mib: f64,
    last_local: f64,
    last_pd: f64,
    decode_local: f64,
    decode_pd: f64,
    /// Whether every PD run decoded the local run's ids, and with bit-identical logits.
    same_ids: bool,
    same_logits: bool,
    /// The same backend over the memfd ring, beside a producer on another machine: its TTFT, and its
    /// IPC and take together.
    ring: Option<(f64, f64)>,
    /// A memcpy of the span's bytes between two warm buffers.
    memcpy: f64,
}

/// Milliseconds of one memcpy of `bytes` between two prefaulted buffers: the median of five.
fn memcpy_ms(bytes: usize) -> f64 {
    let src = shm_ring::prefaulted(bytes);
    let mut dst = shm_ring::prefaulted(bytes);
    median(
        (0..5)
            .map(|_| {
                let t = std::time::Instant::now();
                dst.copy_from_slice(std::hint::black_box(&src));
                std::hint::black_box(&mut dst);
                ms(t.elapsed())
            })
            .collect(),
    )
}

/// GB/s of `mib` MiB in `ms` milliseconds.
fn gbs(mib: f64, ms: f64) -> f64 {
    mib * (1 << 20) as f64 / (ms * 1e6)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn decode_rate(g: &Generation) -> f64 {
    g.output.len().saturating_sub(1) as f64 / g.decode.as_secs_f64().max(1e-9)
}

pub fn run(args: &PdBenchArgs) -> anyhow::Result<ExitCode> {
    let iters = request::check_count(Field::Iters, args.iters, 1, 1000)?;
    let decode = request::check_count(Field::DecodeTokens, args.decode_tokens, 1, super::model_bench::MAX_DECODE)?;
    let threads = request::check_threads(args.threads)?;
    let choice = Choice {
        field: Field::Producer,
        producer: &args.producer,
        backend_config: serde_json::Map::new(),
        precision: PrecisionArg::Exact,
        threads,
        timeout: Duration::from_secs(600),
        sandbox: true,
        memory_limit: super::super::producer::memory_limit(None)?,
        restart: Default::default(),
    };
    let backend =
        choice.backend()?.context("--producer: expected a remote producer to compare with local, found local")?;
    // A producer on another machine runs beside the same backend over the memfd ring.
    let node = pdhost::remote::NodeUrl::parse(&args.producer);
    let ring = match &node {
        Some(node) => {
            let choice = Choice { producer: &node.backend, ..choice.clone() };
            let backend = choice.backend()?.context("the ring producer")?;
            Some((choice, backend))
        }
        None => None,
    };
    let path = super::fetched(&args.model, args.json)?;
    let gguf = Gguf::open(&path)?;
    let limits = Limits::new(&args.model, &Config::from_gguf(&gguf)?, None)?;
    let max_prompt = limits.context as u64 - decode - 1;
    if args.tokens.is_empty() {
        return Err(Invalid::new(Field::Tokens, "at least one prompt length", "none").into());
    }
    for &n in &args.tokens {
        // A prompt of one token has nothing to prefill before its last token, which the host runs.
        request::check_count(Field::Tokens, n, 2, max_prompt).map_err(|e| Invalid {
            expected: format!(
                "{} (a prompt with a token to prefill; {}'s context less the decoded tokens)",
                e.expected, args.model
            ),
            ..e
        })?;
    }
    let tok = Tokenizer::from_gguf(&gguf)?;
    let mut text_ids = tok.encode(TEXT, tok.add_bos());
    let longest = *args.tokens.iter().max().expect("non-empty") as usize;
    let spans = Ring::double(longest);
    while text_ids.len() < longest {
        text_ids.extend(tok.encode(TEXT, false));
    }
    let mut model = Model::from_gguf(&gguf).context("loading the weights")?;
    model.configure(Precision::Exact, threads);
    let dtype = args.kv_dtype.dtype();
    let absolute = std::path::absolute(&path)?;
    let mut producer = choice.producer(&backend, &absolute, &model.config, &model.identity, dtype, spans)?;
    let mut ring = match ring {
        Some((choice, backend)) => {
            Some(choice.producer(&backend, &absolute, &model.config, &model.identity, dtype, spans)?)
        }
        None => None,
    };
    // Two sequences: the per-layer error compares a remote and a local prefill side by side.
    let mut engine = Engine::new(model, dtype, 64, longest as u64 + decode + 1, 2)?;
    let bar = super::progress(args.tokens.len() as u64 * (iters + 1), args.json);
    bar.set_message(format!("starting {}", producer.name()));
    producer.start()?;
    if let Some(ring) = ring.as_mut() {
        ring.start()?;
    }
    let layout = producer.layout().unwrap_or("?");
    // The UCX transport of the node's WRITEs, as UCX reported its choice to the node.
    let transport = producer.described().and_then(|d| d.transport.clone());

    let mut rows = Vec::new();
    for &n in &args.tokens {
        let raw = RawRequest {
            prompt: text_ids[..n as usize].to_vec(),
            prompt_field: Some(Field::Tokens),
            max_tokens: decode + 1,
            ..RawRequest::default()
        };
        let request = request::check_request(&raw, &limits)?;
        let mut runs: Vec<(Generation, Generation)> = Vec::new();
        let mut ring_runs: Vec<Generation> = Vec::new();
        let (mut same_ids, mut same_logits) = (true, true);
        // The first pair warms caches, pages and the producer's pools; it is not counted.
        for i in 0..=iters {
            bar.set_message(format!("{n} tokens"));
            let local = engine.generate(&request, |_| {})?;
            let pd = engine.generate_with(
                &request,
                PrefillBy::Remote { producer: &mut producer, on_failure: OnFailure::Fail },
                |_| {},
            )?;
            // A producer on another numerical stack (torch) may part at a near-tie; the host's own backends
            // may not, and `generate`'s tests hold them to it. Here it is reported.
            same_ids &= pd.output == local.output;
            same_logits &= pd.logits_hash == local.logits_hash;
            if let Some(ring) = ring.as_mut() {
                let by_ring = engine.generate_with(
                    &request,
                    PrefillBy::Remote { producer: ring, on_failure: OnFailure::Fail },
                    |_| {},
                )?;
                if i > 0 {
                    ring_runs.push(by_ring);
                }
            }
            if i > 0 {
                runs.push((local, pd));
            }
            bar.inc(1);
        }
        let m = |f: &dyn Fn(&(Generation, Generation)) -> f64| median(runs.iter().map(f).collect());
        rows.push(Row {
            tokens: n,
            ttft_local: m(&|r| ms(r.0.ttft)),
            ttft_pd: m(&|r| ms(r.1.ttft)),
            local_forward: m(&|r| ms(r.0.prefill)),
            local_ingest: m(&|r| ms(r.0.ingest)),
            backend: m(&|r| ms(r.1.report.remote_times.backend)),
            frame: m(&|r| ms(r.1.report.remote_times.frame)),
            take: m(&|r| ms(r.1.report.remote_times.take)),
            ipc: m(&|r| ms(r.1.report.remote_times.ipc())),
            transfer: m(&|r| ms(r.1.report.remote_times.ipc() + r.1.report.remote_times.take)),
            span_mib: runs[0].1.bytes as f64 / (1 << 20) as f64,
            last_local: m(&|r| ms(r.0.last_token)),
            last_pd: m(&|r| ms(r.1.last_token)),
            decode_local: m(&|r| decode_rate(&r.0)),
            decode_pd: m(&|r| decode_rate(&r.1)),
            same_ids,
            same_logits,
            ring: (!ring_runs.is_empty()).then(|| {
                let m = |f: &dyn Fn(&Generation) -> f64| median(ring_runs.iter().map(f).collect());
                (m(&|g| ms(g.ttft)), m(&|g| ms(g.report.remote_times.ipc() + g.report.remote_times.take)))
            }),
            memcpy: memcpy_ms(runs[0].1.bytes as usize),
        });
    }
    // The K/V the producer sent against the host's own, layer by layer, for the longest prompt.
    bar.set_message("per-layer K/V error");
    let prompt = &text_ids[..longest];
    let (remote, _) =
        engine.prefill(prompt, 0, PrefillBy::Remote { producer: &mut producer, on_failure: OnFailure::Fail })?;
    let (local, _) = engine.prefill(prompt, 0, PrefillBy::Local)?;
    let layers = kv_error::compare(&engine, local, remote);
    engine.release(remote);
    engine.release(local);
    bar.finish_and_clear();
    let name = producer.name().to_string();
    drop(producer);
    drop(ring);
    // Where the span's bytes travel, and the transport's figures beside the ring's and memcpy's.
    let path = match (&node, &transport) {
        (Some(_), Some(transport)) => format!("NIXL, UCX over {transport}"),
        (Some(_), None) => "NIXL, UCX over a transport the node did not report".to_string(),
        (None, _) => "shared memory".to_string(),
    };
    let transfer = |r: &Row| {
        json!({"pd_gb_s": gbs(r.span_mib, r.transfer), "pd_ms": r.transfer,
               "ring_gb_s": r.ring.map(|(_, transfer)| gbs(r.span_mib, transfer)),
               "ring_ms": r.ring.map(|(_, transfer)| transfer),
               "ring_ttft_ms": r.ring.map(|(ttft, ..)| ttft),
               "ring_overhead_ms": r.ring.map(|(ttft, ..)| ttft - r.ttft_local),
               "memcpy_gb_s": gbs(r.span_mib, r.memcpy), "memcpy_ms": r.memcpy})
    };

    if args.json {
        let results: Vec<_> = rows
            .iter()
            .map(|r| {
                let overhead = r.ttft_pd - r.ttft_local;
                json!({"prompt_tokens": r.tokens, "ttft_local_ms": r.ttft_local, "ttft_pd_ms": r.ttft_pd,
                       "overhead_ms": overhead, "overhead_pct": 100.0 * overhead / r.ttft_local,
                       "local": {"forward_ms": r.local_forward, "ingest_ms": r.local_ingest,
                                 "last_token_ms": r.last_local},
                       "pd": {"request_ipc_ms": r.ipc, "backend_ms": r.backend, "span_write_ms": r.frame,
                              "transfer_ingest_ms": r.take, "span_mib": r.span_mib, "last_token_ms": r.last_pd},
                       "transfer": transfer(r),
                       "decode_tok_s_local": r.decode_local, "decode_tok_s_pd": r.decode_pd,
                       "ids_equal_local": r.same_ids, "logits_equal_local": r.same_logits})
            })
            .collect();
        outln!(
            "{}",
            json!({"bench": "pd", "model": args.model, "producer": name, "layout": layout, "kv_dtype": dtype.name(),
                   "span_path": path, "ucx_transport": transport,
                   "threads": threads, "iters": args.iters, "decode_tokens": args.decode_tokens, "results": results,
                   "kv_error": {"prompt_tokens": longest, "layers": layers}})
        )?;
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "{} prefill in the warm `{name}` producer ({layout} {} spans over {path}) vs in the host; {threads} \
         thread(s); median of {}; the last prompt token and {} decoded tokens run in the host either way",
        args.model,
        dtype.name(),
        args.iters,
        args.decode_tokens
    )?;
    outln!(
        "{:>6} {:>10} {:>10} {:>9} {:>7} | {:>8} {:>9} {:>10} {:>11} {:>8} | {:>15} | {:>9} {:>9}",
        "tokens",
        "TTFT local",
        "TTFT PD",
        "overhead",
        "%",
        "IPC",
        "backend",
        "span write",
        "xfer+ingest",
        "span MiB",
        "last tok loc/PD",
        "dec local",
        "dec PD"
    )?;
    for r in &rows {
        let overhead = r.ttft_pd - r.ttft_local;
        outln!(
            "{:>6} {:>8.1}ms {:>8.1}ms {:>7.2}ms {:>6.2}% | {:>6.2}ms {:>7.1}ms {:>8.2}ms {:>9.2}ms {:>8.2} | {:>6.1}/{:>6.1}ms | {:>7.1}/s {:>7.1}/s",
            r.tokens,
            r.ttft_local,
            r.ttft_pd,
            overhead,
            100.0 * overhead / r.ttft_local,
            r.ipc,
            r.backend,
            r.frame,
            r.take,
            r.span_mib,
            r.last_local,
            r.last_pd,
            r.decode_local,
            r.decode_pd
        )?;
    }
    outln!(
        "backend: the producer's forward pass and its writes into the ring slot; span write: header, manifest, \
         checksum and commit; xfer+ingest: the host's one pass that copies, checksums, validates and pages the \
         span (local prefill's own ingest: {}); last tok: the host's step over the last prompt token",
        rows.iter().map(|r| format!("{:.2}ms", r.local_ingest)).collect::<Vec<_>>().join(", ")
    )?;
    for r in &rows {
        let ring = r.ring.map_or_else(String::new, |(ttft, transfer)| {
            format!(
                ", the memfd ring {:.2} ms ({:.2} GB/s; its TTFT {ttft:.1} ms, overhead {:.2} ms)",
                transfer,
                gbs(r.span_mib, transfer),
                ttft - r.ttft_local
            )
        });
        outln!(
            "{} tokens, {:.2} MiB span: IPC+xfer+ingest {:.2} ms ({:.2} GB/s){ring}, memcpy {:.2} ms ({:.2} GB/s)",
            r.tokens,
            r.span_mib,
            r.transfer,
            gbs(r.span_mib, r.transfer),
            r.memcpy,
            gbs(r.span_mib, r.memcpy)
        )?;
    }
    if rows.iter().all(|r| r.same_ids && r.same_logits) {
        outln!("decode after PD gave local's ids and logits bits at every prompt length")?;
    }
    for r in rows.iter().filter(|r| !(r.same_ids && r.same_logits)) {
        let what = if r.same_ids {
            "local's ids, with other logits bits"
        } else {
            "other ids than local (a near-tie, or K/V that is wrong)"
        };
        outln!("{} tokens: decode after PD gave {what}", r.tokens)?;
    }
    outln!("per-layer K/V error of the `{name}` producer's prefill against the host's, {longest} tokens:")?;
    kv_error::print_layer_errors(&layers, "  ")?;
    Ok(ExitCode::SUCCESS)
}
