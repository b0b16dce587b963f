//! `pdhost bench serve`: the HTTP matrix. Prompt lengths x output lengths x concurrency x streamed or
//! not, against a `pdhost serve` this command starts (or `--url`), every response checked token for
//! token against a lone non-stream request for the same prompt sent in the same run.
//!
//! Each cell sends `repeats` timed batches of `concurrency` requests, one thread per request; a batch
//! waits for all of its requests before the next starts. Prompts are token ids cut from a fixture text to
//! the exact length, and decoding is greedy (or sampled with one seed, `--temperature`), so every
//! response of a cell must equal the reference.

use std::collections::{BTreeSet, VecDeque};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use model::arch::Config;
use model::gguf::Gguf;
use model::tokenizer::Tokenizer;
use pdhost::request::{self, Field, Invalid, Limits};
use serde_json::{json, Value};

use crate::cli::ServeBenchArgs;
use crate::cmd::outln;

/// The seed of every request when `--temperature` samples: the same draws alone or in a batch.
const SEED: u64 = 1;
const TEXT: &str = include_str!("../../../../fixtures/prompts/lgpl-650w.txt");

/// The context a started server gets unless told otherwise (as `pdhost serve`: the incident's deployment).
pub(super) const DEFAULT_CONTEXT: u64 = 9216;
pub(super) const DEFAULT_MODEL: &str = "gemma3-270m";
const MAX_CONCURRENCY: u64 = 64;
const MAX_REPEATS: u64 = 100;
/// The most output tokens a cell asks for (as the other benches' decode lengths).
const MAX_OUTPUT: u64 = 4096;
/// How long one request may take, queueing included (a long prompt behind three others on two cores).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(1800);
/// How long a started server may take to load the model and start its producer.
const START_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a started server may take to drain and exit after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// Problems (unequal or failed responses) described after the table; the counts cover all of them.
const MAX_PROBLEMS: usize = 8;

/// At least `len` token ids of the fixture text, repeated as needed (the first with the model's BOS).
pub(super) fn text_ids(tok: &Tokenizer, len: usize) -> Vec<u32> {
    let mut ids = tok.encode(TEXT, tok.add_bos());
    while ids.len() < len {
        ids.extend(tok.encode(TEXT, false));
    }
    ids
}

/// `value` inside `min..=max` for `field`, with `why` after the bound.
pub(super) fn count(field: Field, value: u64, min: u64, max: u64, why: &str) -> Result<u64, Invalid> {
    request::check_count(field, value, min, max).map_err(|e| Invalid { expected: format!("{}{why}", e.expected), ..e })
}

/// A non-empty list of counts, each inside `min..=max`.
fn counts(field: Field, values: &[u64], min: u64, max: u64, why: &str) -> Result<(), Invalid> {
    if values.is_empty() {
        return Err(Invalid::new(field, "at least one value", "none"));
    }
    values.iter().try_for_each(|&v| count(field, v, min, max, why).map(drop))
}

/// What the requests go to.
enum Target {
    /// A server this command started (stopped when dropped).
    Started(Server),
    /// A running server.
    Given(String),
}

impl Target {
    /// Why the started server is gone, when it is.
    fn gone(&mut self) -> Option<String> {
        match self {
            Target::Started(s) => s.gone(),
            Target::Given(_) => None,
        }
    }

    fn url(&self) -> &str {
        match self {
            Target::Started(s) => &s.url,
            Target::Given(url) => url,
        }
    }
}

pub fn run(args: &ServeBenchArgs) -> anyhow::Result<ExitCode> {
    if args.mixed {
        return super::mixed::run(args);
    }
    // Everything that needs neither a model nor a server.
    let repeats = count(Field::Repeats, args.repeats, 1, MAX_REPEATS, "")?;
    counts(Field::Concurrency, &args.concurrency, 1, MAX_CONCURRENCY, "")?;
    counts(Field::Outputs, &args.outputs, 1, MAX_OUTPUT, "")?;
    if args.inputs.is_empty() {
        return Err(Invalid::new(Field::Inputs, "at least one value", "none").into());
    }
    let streams = args.stream.cells();
    let threads = request::check_threads(args.threads)?;
    if let Some(ms) = args.batch_wait {
        request::check_count(Field::BatchWait, ms, 0, crate::cmd::serve::MAX_BATCH_WAIT_MS)?;
    }
    request::input::check_backend_config(args.backend_config.as_deref(), &args.producer)?;
    request::check_sampling(&request::SamplingParams {
        temperature: Some(args.temperature),
        seed: SEED,
        ..Default::default()
    })?;
    if args.peer && args.temperature > 0.0 {
        // llama-server samples with its own generator: its text could not be compared, and greedy
        // decoding is what it is sent.
        let found = format!("{} with --peer", args.temperature);
        return Err(Invalid::new(Field::Temperature, "0 (greedy) with --peer", found).into());
    }
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(REQUEST_TIMEOUT))
        .max_idle_connections_per_host(MAX_CONCURRENCY as usize)
        .build()
        .into();

    // The model: named, or what the given server serves.
    let (name, served_context) = match &args.url {
        Some(url) => {
            let url = url.trim_end_matches('/');
            if !is_server_url(url) {
                return Err(Invalid::new(Field::Url, "http://HOST:PORT", request::shorten(url)).into());
            }
            let (id, context) = served_model(&agent, url)?;
            if let Some(m) = args.model.as_ref().filter(|m| **m != id) {
                return Err(
                    Invalid::new(Field::Model, format!("{id:?}, the model {url} serves"), format!("{m:?}")).into()
                );
            }
            (id, Some(context))
        }
        None => (args.model.clone().unwrap_or_else(|| DEFAULT_MODEL.to_string()), None),
    };
    match model::registry::spec(&name) {
        Ok(_) => {}
        Err(model::registry::FetchError::Unknown { expected, .. }) => {
            let what = if args.url.is_some() { "a served model among" } else { "one of" };
            return Err(Invalid::new(
                Field::Model,
                format!("{what} {expected} (prompts are tokenized with its tokenizer)"),
                format_args!("{name:?}"),
            )
            .into());
        }
        Err(e) => return Err(e.into()),
    }
    if args.url.is_none() {
        // What the started server would refuse, refused here: its error would come nested in ours.
        crate::cmd::serve::producer_processes(&args.producer, args.producers)?;
        check_producer(&args.producer)?;
    }
    let path = super::fetched(&name, args.json)?;
    let gguf = Gguf::open(&path)?;
    let config = Config::from_gguf(&gguf)?;
    let context = match served_context {
        Some(c) => c,
        None => args.context.unwrap_or(DEFAULT_CONTEXT.min(config.context as u64)),
    };
    let limits = Limits::serving(&name, &config, context)?;
    let context = limits.context as u64;
    if let Some(chunk) = args.prefill_chunk {
        request::check_count(Field::PrefillChunk, chunk, 0, context)?;
    }
    let longest_output = *args.outputs.iter().max().expect("checked non-empty");
    let why = if context - 1 < MAX_OUTPUT {
        format!(" (the {context}-token context less a prompt token)")
    } else {
        String::new()
    };
    counts(Field::Outputs, &args.outputs, 1, MAX_OUTPUT.min(context - 1), &why)?;
    let why = format!(" (the {context}-token context less the longest output)");
    counts(Field::Inputs, &args.inputs, 1, context - longest_output, &why)?;
    let dtype = args.kv_dtype.dtype();
    let max_concurrency = *args.concurrency.iter().max().expect("checked non-empty");
    // A slot for every request of the widest batch (as `--peer`'s llama-server gets), so a batch decodes
    // together.
    let slots = max_concurrency.max(4);
    if args.url.is_none() {
        // The server would refuse it too, but only after it had started.
        let budget = request::kv_budget(&config.kv_geometry(), dtype, 64, context, slots as u32)
            .context("the KV cache's size does not fit in 64 bits")?;
        request::check_memory(
            Field::Concurrency,
            &format!("the KV cache for {slots} slots x {context} tokens in {}", dtype.name()),
            budget,
        )?;
    }

    // Prompts: the fixture text, repeated as needed, cut to exact token counts.
    let tok = Tokenizer::from_gguf(&gguf)?;
    let text_ids = text_ids(&tok, *args.inputs.iter().max().expect("checked non-empty") as usize);
    drop(gguf);

    let cells_per_pair: u64 = args.concurrency.iter().map(|c| c * repeats).sum::<u64>() * streams.len() as u64;
    let pairs = (args.inputs.len() * args.outputs.len()) as u64;
    let bar = super::progress(pairs * (1 + cells_per_pair), args.json);
    let mut target = match &args.url {
        Some(url) => Target::Given(url.trim_end_matches('/').to_string()),
        None => {
            bar.set_message(format!("starting {name}"));
            let kv_dtype = clap::ValueEnum::to_possible_value(&args.kv_dtype).expect("not skipped");
            let precision = clap::ValueEnum::to_possible_value(&args.precision).expect("not skipped");
            let mut cmd = Command::new(std::env::current_exe().context("locating the pdhost executable")?);
            cmd.args(["serve", "--model", &name, "--host", "127.0.0.1", "--port", "0", "--producer", &args.producer])
                .args(["--context", &context.to_string(), "--kv-dtype", kv_dtype.get_name()])
                .args(["--precision", precision.get_name()])
                .args(["--prefix-cache", if args.prefix_cache == crate::cli::Switch::On { "on" } else { "off" }])
                // Every batch waits in the queue, not in a 503.
                .args(["--slots", &slots.to_string()])
                .args(["--queue", &max_concurrency.max(16).to_string()]);
            if let Some(t) = args.threads {
                cmd.args(["--threads", &t.to_string()]);
            }
            if let Some(chunk) = args.prefill_chunk {
                cmd.args(["--prefill-chunk", &chunk.to_string()]);
            }
            if let Some(ms) = args.batch_wait {
                cmd.args(["--batch-wait", &ms.to_string()]);
            }
            if let Some(n) = args.producers {
                cmd.args(["--producers", &n.to_string()]);
            }
            if let Some(config) = &args.backend_config {
                cmd.args(["--backend-config", config]);
            }
            Target::Started(Server::start(cmd)?)
        }
    };
    let url = target.url().to_string();

    let mut cells = Vec::new();
    let mut references = Vec::new();
    let mut died = None;
    'matrix: for &input in &args.inputs {
        for &output in &args.outputs {
            let prompt = &text_ids[..input as usize];
            let body = json!({"prompt": prompt, "max_tokens": output, "temperature": args.temperature, "seed": SEED});
            bar.set_message(format!("{input} in, {output} out: reference"));
            let reference = match send(&agent, &url, &body, false) {
                Ok(r) => r,
                Err(e) => {
                    let why = target.gone().map(|g| format!(" ({g})")).unwrap_or_default();
                    anyhow::bail!("the reference request ({input} tokens in, {output} out, sent alone): {e}{why}")
                }
            };
            bar.inc(1);
            references.push(((input, output), reference.text.clone()));
            for &concurrency in &args.concurrency {
                for &stream in streams {
                    bar.set_message(format!(
                        "{input} in, {output} out, x{concurrency}{}",
                        if stream { ", SSE" } else { "" }
                    ));
                    let mut cell = Cell { input, output, concurrency, stream, ..Cell::default() };
                    for _ in 0..repeats {
                        let t = Instant::now();
                        let results: Vec<Result<Response, String>> = std::thread::scope(|s| {
                            let handles: Vec<_> = (0..concurrency)
                                .map(|_| {
                                    s.spawn(|| {
                                        let r = send(&agent, &url, &body, stream);
                                        bar.inc(1);
                                        r
                                    })
                                })
                                .collect();
                            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("panicked".into()))).collect()
                        });
                        cell.wall += t.elapsed();
                        cell.batches += 1;
                        let (tokens, decoding) = decode_span(&results);
                        (cell.decode_tokens, cell.decode_time) =
                            (cell.decode_tokens + tokens, cell.decode_time + decoding);
                        for r in results {
                            cell.add(r, &reference);
                        }
                    }
                    if !args.json {
                        // A long matrix reports each cell as it ends, in case it is stopped early.
                        bar.suspend(|| eprintln!("{}", cell.progress_line()));
                    }
                    cells.push(cell);
                    died = target.gone();
                    if died.is_some() {
                        break 'matrix;
                    }
                }
            }
        }
    }
    bar.finish_and_clear();
    let server = match target {
        Target::Started(server) => {
            server.stop();
            "started"
        }
        Target::Given(_) => "given",
    };

    // The peer: the same cells against llama-server, after pdhost's server has stopped.
    let mut peer_cells = Vec::new();
    if args.peer && died.is_none() {
        let bin = super::peer::llama_server(args.json)?;
        let peer = super::peer::Peer::start(&bin, &path, slots, context, threads)?;
        let bar = super::progress(cells.len() as u64, args.json);
        let cache_prompt = args.prefix_cache == crate::cli::Switch::On;
        let mut warmed = Vec::new();
        for c in &cells {
            bar.set_message(format!("llama-server: {}", c.name()));
            let reference = references.iter().find(|(k, _)| *k == (c.input, c.output)).map_or("", |(_, t)| t.as_str());
            let prompt = &text_ids[..c.input as usize];
            // One untimed request per prompt and output length first, as pdhost's reference is.
            if !warmed.contains(&(c.input, c.output)) {
                let _ = super::peer::send(&agent, &peer.url, prompt, (c.output, false, cache_prompt));
                warmed.push((c.input, c.output));
            }
            let key = (c.input, c.output, c.concurrency, c.stream);
            peer_cells.push(super::peer::PeerCell::run(
                &agent,
                &peer.url,
                prompt,
                key,
                repeats,
                reference,
                cache_prompt,
            ));
            bar.inc(1);
        }
        bar.finish_and_clear();
    }

    let total = Totals::of(&cells);
    let producers: BTreeSet<&str> = cells.iter().flat_map(|c| c.producers.iter().map(String::as_str)).collect();
    let producers: Vec<&str> = producers.into_iter().collect();
    let problems: Vec<&String> = cells.iter().flat_map(|c| &c.problems).take(MAX_PROBLEMS).collect();
    if args.json {
        let cells: Vec<Value> = cells.iter().map(Cell::json).collect();
        let started = server == "started";
        outln!(
            "{}",
            json!({
                "bench": "serve", "model": name, "url": url, "server": server,
                "producer": if started { json!(args.producer) } else { Value::Null },
                "producers": args.producers,
                "backend_config": args.backend_config.as_deref().map(|c| serde_json::from_str::<Value>(c).unwrap_or(Value::Null)),
                "producers_seen": producers,
                "threads": if started { json!(threads) } else { Value::Null },
                "precision": if started { json!(args.precision.precision().name()) } else { Value::Null },
                "kv_dtype": if started { json!(dtype.name()) } else { Value::Null },
                "context": context, "prefill_chunk": args.prefill_chunk, "batch_wait_ms": args.batch_wait,
                "repeats": repeats,
                "temperature": args.temperature, "seed": if args.temperature > 0.0 { json!(SEED) } else { Value::Null },
                "cells": cells,
                "totals": total.json(), "summary": total.summary(), "problems": problems,
                "peer": if args.peer { json!({"server": "llama-server", "cells": peer_cells.iter().map(super::peer::PeerCell::json).collect::<Vec<_>>()}) } else { Value::Null },
            })
        )?;
    } else {
        let how = match server {
            "started" => format!(
                "a `pdhost serve` started for this run (--producer {}{}{}{}, {}, {} KV, {threads} thread(s), {context}-token context, {})",
                args.producer,
                args.producers.map(|n| format!(" --producers {n}")).unwrap_or_default(),
                args.batch_wait.map(|ms| format!(" --batch-wait {ms}")).unwrap_or_default(),
                args.backend_config.as_ref().map(|c| format!(" --backend-config '{c}'")).unwrap_or_default(),
                args.precision.precision().name(),
                dtype.name(),
                match args.prefill_chunk {
                    None => "its default spans".to_string(),
                    Some(0) => "whole-prompt spans".to_string(),
                    Some(n) => format!("{n}-token spans"),
                }
            ),
            _ => format!("the server at {url} ({context}-token context)"),
        };
        outln!(
            "{name} over HTTP, {how}; {repeats} timed batch(es) of `conc` concurrent requests per cell, {}; each \
             response checked against a lone non-stream request for the same prompt (prefill seen: {})",
            if args.temperature > 0.0 {
                format!("sampled at temperature {}, seed {SEED}", args.temperature)
            } else {
                "greedy".into()
            },
            producers.join(", ")
        )?;
        outln!(
            "{:>6} {:>5} {:>4} {:>3} | {:>4} {:>5} {:>6} {:>5} {:>5} {:>4} | {:>9} {:>9} | {:>8} {:>8} | {:>7} {:>7} {:>7}",
            "in",
            "out",
            "conc",
            "SSE",
            "reqs",
            "equal",
            "remote",
            "local",
            "fallb",
            "err",
            "TTFT p50",
            "TTFT p99",
            "ITL p50",
            "ITL p99",
            "tok/s/r",
            "tok/s",
            "dec t/s"
        )?;
        for c in &cells {
            let (ttft50, ttft99) = percentiles(&c.ttft_ms);
            let (itl50, itl99) = percentiles(&c.gaps_ms);
            let ms = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.1}ms"));
            let rate = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.1}"));
            outln!(
                "{:>6} {:>5} {:>4} {:>3} | {:>4} {:>5} {:>6} {:>5} {:>5} {:>4} | {:>9} {:>9} | {:>8} {:>8} | {:>7} {:>7} {:>7}",
                c.input,
                c.output,
                c.concurrency,
                if c.stream { "on" } else { "off" },
                c.counts.requests,
                c.counts.equal,
                c.counts.remote,
                c.counts.local,
                c.counts.fallback,
                c.counts.errors,
                ms(ttft50),
                ms(ttft99),
                ms(itl50),
                ms(itl99),
                rate(c.rate_per_request()),
                rate(c.rate_aggregate()),
                rate(c.decode_aggregate())
            )?;
        }
        outln!(
            "TTFT: SSE on, the client's time to the first chunk with text (queueing included); off, the server's \
             pdhost.ttft_ms (engine only). ITL: gaps between text chunks. tok/s/r: output tokens / request latency \
             (median); tok/s: all output tokens / the batches' wall time; dec t/s: decode alone, tokens after the \
             first / the time some request of the batch decoded (each request's pdhost.decode_ms, ending with its \
             response). fallb: local after a \
             failed remote prefill."
        )?;
        for p in &problems {
            outln!("  {p}")?;
        }
        outln!("{}", total.summary())?;
        if !peer_cells.is_empty() {
            peer_table(&cells, &peer_cells, threads)?;
        }
    }
    if let Some(why) = died {
        anyhow::bail!("the matrix stopped early: {why}");
    }
    Ok(if total.unequal + total.errors == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// pdhost beside llama-server, cell by cell: aggregate output tok/s and TTFT p50, and their ratios.
fn peer_table(cells: &[Cell], peer: &[super::peer::PeerCell], threads: usize) -> anyhow::Result<()> {
    outln!(
        "beside llama.cpp's llama-server (same GGUF, {threads} thread(s), -np {}): x = pdhost / llama-server \
         for tok/s, llama-server / pdhost for TTFT (above 1: pdhost better)",
        peer.iter().map(|c| c.concurrency).max().unwrap_or(1).max(4)
    )?;
    outln!(
        "{:>6} {:>5} {:>4} {:>3} | {:>8} {:>8} {:>6} | {:>9} {:>9} {:>6} | {:>9} {:>4}",
        "in",
        "out",
        "conc",
        "SSE",
        "pdhost",
        "llama",
        "x",
        "TTFT pd",
        "TTFT ll",
        "x",
        "same text",
        "err"
    )?;
    let f = |v: Option<f64>, unit: &str| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}{unit}"));
    for (c, p) in cells.iter().zip(peer) {
        let (pd_rate, ll_rate) = (c.rate_aggregate(), p.rate_aggregate());
        let (pd_ttft, ll_ttft) = (percentiles(&c.ttft_ms).0, percentiles(&p.ttft_ms).0);
        outln!(
            "{:>6} {:>5} {:>4} {:>3} | {:>8} {:>8} {:>6} | {:>9} {:>9} {:>6} | {:>9} {:>4}",
            c.input,
            c.output,
            c.concurrency,
            if c.stream { "on" } else { "off" },
            f(pd_rate, ""),
            f(ll_rate, ""),
            f(pd_rate.zip(ll_rate).map(|(a, b)| a / b), "x"),
            f(pd_ttft, "ms"),
            f(ll_ttft, "ms"),
            f(pd_ttft.zip(ll_ttft).map(|(a, b)| b / a), "x"),
            format!("{}/{}", p.same_text, p.requests),
            p.errors
        )?;
    }
    outln!(
        "TTFT off: the server's own figure (pdhost.ttft_ms; llama-server's timings.prompt_ms, prompt only); on: the \
         client's time to the first text chunk. same text: llama-server's output equal to pdhost's reference."
    )?;
    for p in peer.iter().flat_map(|c| &c.problems).take(MAX_PROBLEMS) {
        outln!("  {p}")?;
    }
    Ok(())
}

/// `--producer` as `pdhost serve` takes it, checked before the server starts.
pub(super) fn check_producer(producer: &str) -> Result<(), Invalid> {
    match producer {
        "local" | "rngd" | "gpu" | "faulty" | "torch" => Ok(()),
        python if python.starts_with("py:") => Ok(()),
        remote if pdhost::remote::NodeUrl::parse(remote).is_some() => Ok(()),
        path if (path.ends_with(".so") || path.contains('/')) && std::path::Path::new(path).is_file() => Ok(()),
        other => Err(Invalid::new(
            Field::Producer,
            "local, rngd, gpu, faulty, torch, py:MODULE:CLASS, a PATH.so or nixl://HOST:PORT/NAME",
            format_args!("{other:?}"),
        )),
    }
}

/// Whether `url` is `http://HOST[:PORT]`, no more: the bench adds the paths (`/v1/models`, ...), so a
/// path or a query of the user's would be sent before them.
fn is_server_url(url: &str) -> bool {
    let Some(authority) = url.strip_prefix("http://") else { return false };
    if authority.is_empty() || authority.contains(['/', '?', '#', '@']) {
        return false;
    }
    // `host:port`, `[v6]:port`, or a host alone.
    let port = match authority.rsplit_once(':') {
        Some((host, port)) if !host.ends_with(':') && !port.contains(']') => Some(port),
        _ => None,
    };
    port.is_none_or(|p| p.parse::<u16>().is_ok_and(|p| p > 0))
}

/// The model a running server serves and its context, from `GET /v1/models`.
fn served_model(agent: &ureq::Agent, url: &str) -> anyhow::Result<(String, u64)> {
    let mut r = agent.get(&format!("{url}/v1/models")).call().with_context(|| format!("--url: GET {url}/v1/models"))?;
    let status = r.status().as_u16();
    let v: Value = r.body_mut().read_json().with_context(|| format!("--url: GET {url}/v1/models: status {status}"))?;
    let m = &v["data"][0];
    match (m["id"].as_str(), m["max_model_len"].as_u64()) {
        (Some(id), Some(context)) if status == 200 => Ok((id.to_string(), context)),
        _ => anyhow::bail!(
            "--url: expected a pdhost server (GET /v1/models with an id and max_model_len), found status {status}: {}",
            request::shorten(&v.to_string())
        ),
    }
}

/// One response, read whole.
#[derive(Debug, Default)]
struct Response {
    text: String,
    output_ids: Value,
    logits: Value,
    prefill: String,
    producer: String,
    fallback: bool,
    /// Prompt tokens shared from the server's prefix cache.
    hit_tokens: u64,
    /// Stream: the client's time to the first chunk with text; otherwise the server's `pdhost.ttft_ms`.
    ttft_ms: Option<f64>,
    /// Stream: gaps between chunks with text.
    gaps_ms: Vec<f64>,
    /// From sending the request to its last byte.
    latency: Duration,
    /// When its last byte came.
    ended: Option<Instant>,
    /// The server's `pdhost.decode_ms`: from the first token to the last.
    decode_ms: Option<f64>,
}

/// One completion request: `Err` for a transport error, a status other than 200, an error event or a
/// response without its `pdhost` object.
fn send(agent: &ureq::Agent, url: &str, body: &Value, stream: bool) -> Result<Response, String> {
    let mut body = body.clone();
    if stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    let t = Instant::now();
    let mut r = agent.post(&format!("{url}/v1/completions")).send_json(&body).map_err(|e| e.to_string())?;
    let status = r.status().as_u16();
    if status != 200 {
        let text = r.body_mut().read_to_string().unwrap_or_default();
        let message = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or(text);
        return Err(format!("status {status}: {}", request::shorten(&message)));
    }
    let mut out = Response::default();
    let last = if stream {
        let mut last = None;
        let mut previous: Option<Instant> = None;
        let mut done = false;
        for line in BufReader::new(r.into_body().into_reader()).lines() {
            let line = line.map_err(|e| format!("reading the stream: {e}"))?;
            let Some(data) = line.strip_prefix("data:").map(str::trim_start) else { continue };
            if data == "[DONE]" {
                done = true;
                break;
            }
            let now = Instant::now();
            let mut v: Value = serde_json::from_str(data).map_err(|e| format!("an event that is not JSON ({e})"))?;
            if let Some(m) = v["error"]["message"].as_str() {
                return Err(format!("error event: {}", request::shorten(m)));
            }
            match v["choices"][0]["text"].as_str() {
                Some(text) if !text.is_empty() => {
                    match previous {
                        None => out.ttft_ms = Some(ms(now - t)),
                        Some(p) => out.gaps_ms.push(ms(now - p)),
                    }
                    previous = Some(now);
                    out.text.push_str(text);
                }
                _ => {}
            }
            if !v["pdhost"].is_null() {
                last = Some(v["pdhost"].take());
            }
        }
        if !done {
            return Err("the stream ended before [DONE]".into());
        }
        last.ok_or("the stream ended without a pdhost object")?
    } else {
        let mut v: Value = r.body_mut().read_json().map_err(|e| format!("reading the response: {e}"))?;
        out.text = v["choices"][0]["text"].as_str().ok_or("a response without choices[0].text")?.to_string();
        out.ttft_ms = v["pdhost"]["ttft_ms"].as_f64();
        v["pdhost"].take()
    };
    out.latency = t.elapsed();
    out.ended = Some(Instant::now());
    out.output_ids = last["output_ids"].clone();
    out.logits = last["logits_xxh3"].clone();
    if !out.output_ids.is_array() || !out.logits.is_string() {
        return Err(format!(
            "a pdhost object without output_ids and logits_xxh3: {}",
            request::shorten(&last.to_string())
        ));
    }
    out.prefill = last["prefill"].as_str().unwrap_or("?").to_string();
    out.producer = last["producer"].as_str().unwrap_or("?").to_string();
    out.fallback = !last["fallback_reason"].is_null();
    out.hit_tokens = last["prefix_hit_tokens"].as_u64().unwrap_or(0);
    out.decode_ms = last["decode_ms"].as_f64();
    Ok(out)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A batch's decoding: its answered requests' tokens after the first, and the length of the union of
/// their decode intervals, each the server's `decode_ms` ending when its response ended (a request's last
/// token is its response's end, give or take the HTTP write). Summing each request's own rate instead
/// counted requests that decoded one after another (more than `--slots`, or staggered prefills) as if
/// they had decoded together.
fn decode_span(results: &[Result<Response, String>]) -> (u64, Duration) {
    let mut tokens = 0;
    let mut spans: Vec<(Instant, Instant)> = Vec::new();
    for r in results.iter().flatten() {
        let n = r.output_ids.as_array().map_or(0, Vec::len) as u64;
        let (Some(ended), Some(d)) = (r.ended, r.decode_ms.filter(|&d| n > 1 && d > 0.0)) else { continue };
        tokens += n - 1;
        let d = Duration::from_secs_f64(d / 1e3);
        spans.push((ended.checked_sub(d).unwrap_or(ended), ended));
    }
    spans.sort();
    let mut union = Duration::ZERO;
    let mut current: Option<(Instant, Instant)> = None;
    for (start, end) in spans {
        current = match current {
            Some((s, e)) if start <= e => Some((s, e.max(end))),
            Some((s, e)) => {
                union += e - s;
                Some((start, end))
            }
            None => Some((start, end)),
        };
    }
    if let Some((s, e)) = current {
        union += e - s;
    }
    (tokens, union)
}

/// Nearest-rank p50 and p99.
pub(super) fn percentiles(v: &[f64]) -> (Option<f64>, Option<f64>) {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let at = |p: f64| (!v.is_empty()).then(|| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]);
    (at(0.50), at(0.99))
}

/// One cell of the matrix.
#[derive(Debug, Default)]
struct Cell {
    input: u64,
    output: u64,
    concurrency: u64,
    stream: bool,
    counts: Totals,
    ttft_ms: Vec<f64>,
    gaps_ms: Vec<f64>,
    /// Per answered request: output tokens / latency.
    rates: Vec<f64>,
    /// Tokens after the first of every answered request, and the time some request of their batch was
    /// decoding, summed over the batches ([`decode_span`]).
    decode_tokens: u64,
    decode_time: Duration,
    /// Timed batches sent.
    batches: u64,
    output_tokens: u64,
    wall: Duration,
    producers: BTreeSet<String>,
    problems: Vec<String>,
}

impl Cell {
    fn name(&self) -> String {
        format!(
            "{} in, {} out, concurrency {}, {}",
            self.input,
            self.output,
            self.concurrency,
            if self.stream { "streamed" } else { "whole" }
        )
    }

    fn add(&mut self, r: Result<Response, String>, reference: &Response) {
        self.counts.requests += 1;
        let r = match r {
            Ok(r) => r,
            Err(e) => {
                self.counts.errors += 1;
                self.problems.push(format!("{}: request {} failed: {e}", self.name(), self.counts.requests));
                return;
            }
        };
        match r.prefill.as_str() {
            "remote" => self.counts.remote += 1,
            _ => self.counts.local += 1,
        }
        self.counts.fallback += u64::from(r.fallback);
        self.counts.hit_tokens += r.hit_tokens;
        self.producers.insert(format!("{} ({})", r.prefill, r.producer));
        self.ttft_ms.extend(r.ttft_ms);
        self.gaps_ms.extend(&r.gaps_ms);
        let tokens = r.output_ids.as_array().map_or(0, Vec::len) as u64;
        self.output_tokens += tokens;
        self.rates.push(tokens as f64 / r.latency.as_secs_f64().max(1e-9));
        let differs = if r.output_ids != reference.output_ids {
            Some(format!("output ids {} (reference {})", r.output_ids, reference.output_ids))
        } else if r.logits != reference.logits {
            Some(format!("logits_xxh3 {} (reference {})", r.logits, reference.logits))
        } else if r.text != reference.text {
            Some(format!("text {:?} (reference {:?})", request::shorten(&r.text), request::shorten(&reference.text)))
        } else {
            None
        };
        match differs {
            None => self.counts.equal += 1,
            Some(d) => {
                self.counts.unequal += 1;
                self.problems.push(format!("{}: request {} differs: {d}", self.name(), self.counts.requests));
            }
        }
    }

    fn rate_per_request(&self) -> Option<f64> {
        percentiles(&self.rates).0
    }

    fn rate_aggregate(&self) -> Option<f64> {
        (self.output_tokens > 0).then(|| self.output_tokens as f64 / self.wall.as_secs_f64().max(1e-9))
    }

    /// Aggregate decode throughput: tokens after the first over the time some request was decoding
    /// (what `llama-batched-bench` reports as S_TG: generation alone, prefill left out).
    fn decode_aggregate(&self) -> Option<f64> {
        (self.decode_tokens > 0 && !self.decode_time.is_zero())
            .then(|| self.decode_tokens as f64 / self.decode_time.as_secs_f64())
    }

    /// One line for the log while the matrix runs.
    fn progress_line(&self) -> String {
        let rate = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.1}"));
        format!(
            "{}: {}/{} equal, {} errors, {} tok/s, decode {} tok/s",
            self.name(),
            self.counts.equal,
            self.counts.requests,
            self.counts.errors,
            rate(self.rate_aggregate()),
            rate(self.decode_aggregate())
        )
    }

    fn json(&self) -> Value {
        let p = |v: &[f64]| {
            let (p50, p99) = percentiles(v);
            json!({"p50": p50, "p99": p99})
        };
        json!({
            "input_tokens": self.input, "output_tokens": self.output, "concurrency": self.concurrency,
            "stream": self.stream, "requests": self.counts.requests, "equal": self.counts.equal,
            "unequal": self.counts.unequal, "remote": self.counts.remote, "local": self.counts.local,
            "fallback": self.counts.fallback, "errors": self.counts.errors,
            "prefix_hit_tokens": self.counts.hit_tokens,
            "ttft_ms": p(&self.ttft_ms), "ttft_source": if self.stream { "client" } else { "server" },
            "itl_ms": if self.stream { p(&self.gaps_ms) } else { Value::Null },
            "tok_s_per_request": self.rate_per_request(), "tok_s_aggregate": self.rate_aggregate(),
            "decode_tok_s_aggregate": self.decode_aggregate(),
            "output_tokens_received": self.output_tokens, "wall_s": self.wall.as_secs_f64(),
        })
    }
}

/// How the requests of a cell, or of every cell, ended.
#[derive(Debug, Default)]
struct Totals {
    requests: u64,
    equal: u64,
    unequal: u64,
    remote: u64,
    local: u64,
    fallback: u64,
    errors: u64,
    /// Prompt tokens shared from the server's prefix cache.
    hit_tokens: u64,
}

impl Totals {
    fn of(cells: &[Cell]) -> Self {
        let mut t = Totals::default();
        for c in cells {
            let c = &c.counts;
            t.requests += c.requests;
            t.equal += c.equal;
            t.unequal += c.unequal;
            t.remote += c.remote;
            t.local += c.local;
            t.fallback += c.fallback;
            t.errors += c.errors;
            t.hit_tokens += c.hit_tokens;
        }
        t
    }

    fn summary(&self) -> String {
        let hits = if self.hit_tokens > 0 {
            format!(", {} prompt tokens from the prefix cache", self.hit_tokens)
        } else {
            String::new()
        };
        format!(
            "{}/{} responses equal, {} remote prefills, {} local ({} fallbacks), {} errors{hits}",
            self.equal, self.requests, self.remote, self.local, self.fallback, self.errors
        )
    }

    fn json(&self) -> Value {
        json!({"requests": self.requests, "equal": self.equal, "unequal": self.unequal, "remote": self.remote,
               "local": self.local, "fallback": self.fallback, "errors": self.errors,
               "prefix_hit_tokens": self.hit_tokens})
    }
}

/// A `pdhost serve` child: its URL once it printed it, and the tail of its log for when it fails.
pub(super) struct Server {
    child: Child,
    pub(super) url: String,
    log: Arc<Mutex<VecDeque<String>>>,
    /// Disconnected once the log's reader has read its last line.
    log_closed: std::sync::mpsc::Receiver<()>,
}

impl Server {
    pub(super) fn start(mut cmd: Command) -> anyhow::Result<Self> {
        // SIGTERM, so that it drains and stops its producers as it does for [`Server::stop`].
        super::end_with_bench(&mut cmd, libc::SIGTERM);
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting `pdhost serve`")?;
        let log = Arc::new(Mutex::new(VecDeque::new()));
        let stderr = child.stderr.take().expect("piped");
        let sink = Arc::clone(&log);
        let (log_done, log_closed) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut log = sink.lock().unwrap_or_else(|e| e.into_inner());
                if log.len() == 64 {
                    log.pop_front();
                }
                log.push_back(line);
            }
            drop(log_done);
        });
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // Read to the end: a server that wrote to a closed pipe would fail.
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut server = Server { child, url: String::new(), log, log_closed };
        let line = match rx.recv_timeout(START_TIMEOUT) {
            Ok(line) => line,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                anyhow::bail!(
                    "`pdhost serve` was not ready after {} s: {}",
                    START_TIMEOUT.as_secs(),
                    server.last_error()
                )
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                let _ = server.child.wait();
                anyhow::bail!("`pdhost serve` exited before it was ready: {}", server.gone().unwrap_or_default())
            }
        };
        server.url = line
            .strip_prefix("listening on ")
            .with_context(|| format!("`pdhost serve`: expected \"listening on URL\", found {line:?}"))?
            .to_string();
        Ok(server)
    }

    /// Its exit status and last error line once it has exited.
    fn gone(&mut self) -> Option<String> {
        let status = self.child.try_wait().ok().flatten()?;
        // The log's last lines, unless a leftover process still holds its stderr.
        let _ = self.log_closed.recv_timeout(Duration::from_secs(2));
        Some(format!("`pdhost serve` {status}: {}", self.last_error()))
    }

    /// The server's last error line, or its last line.
    fn last_error(&self) -> String {
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        log.iter()
            .rev()
            .find(|l| l.contains("error"))
            .or(log.back())
            .cloned()
            .unwrap_or_else(|| "no output".to_string())
    }

    /// SIGTERM (it drains and stops its producers), then SIGKILL after [`STOP_TIMEOUT`].
    pub(super) fn stop(mut self) {
        let _ = self.terminate();
    }

    /// The server's process id.
    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, and how it exited: `Ok` with its status when it exited within [`STOP_TIMEOUT`], else it is
    /// killed and `Err` says so.
    pub(super) fn drain(mut self) -> Result<std::process::ExitStatus, String> {
        self.terminate().ok_or_else(|| format!("still running {} s after SIGTERM; killed it", STOP_TIMEOUT.as_secs()))
    }

    /// SIGTERM, then SIGKILL after [`STOP_TIMEOUT`]: its exit status if it exited by itself (or had
    /// already), `None` if it was killed. Dropping it afterwards does nothing more.
    fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        if let Ok(Some(status)) = self.child.try_wait() {
            return Some(status);
        }
        let _ =
            rustix::process::kill_process(rustix::process::Pid::from_child(&self.child), rustix::process::Signal::TERM);
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        None
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.terminate();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_url_is_a_scheme_a_host_and_a_port() {
        for good in ["http://127.0.0.1:8080", "http://localhost", "http://[::1]:9", "http://h:65535"] {
            assert!(is_server_url(good), "{good}");
        }
        for bad in [
            "https://h:1",
            "http://",
            "http://h:1/v1",
            "http://h:1?x=1",
            "http://h:99999",
            "http://h:0",
            "http://h:",
            "http://u@h:1",
            "notaurl",
        ] {
            assert!(!is_server_url(bad), "{bad}");
        }
    }

    fn decoded(tokens: usize, ended: Instant, decode_ms: f64) -> Result<Response, String> {
        Ok(Response {
            output_ids: json!(vec![0; tokens]),
            ended: Some(ended),
            decode_ms: Some(decode_ms),
            ..Response::default()
        })
    }

    /// Two requests that decoded one after the other take the time of both, not of one; two that decoded
    /// together take the time of one; a failed or one-token request adds nothing.
    #[test]
    fn a_batch_decodes_for_the_union_of_its_requests_decode_times() {
        let t = Instant::now() + Duration::from_secs(10);
        let apart = [decoded(11, t, 1000.0), decoded(11, t + Duration::from_secs(1), 1000.0)];
        assert_eq!(decode_span(&apart), (20, Duration::from_secs(2)));
        let together = [decoded(11, t, 1000.0), decoded(11, t + Duration::from_millis(500), 1000.0)];
        assert_eq!(decode_span(&together), (20, Duration::from_millis(1500)));
        let others = [decoded(11, t, 1000.0), decoded(1, t, 5.0), Err("refused".into())];
        assert_eq!(decode_span(&others), (10, Duration::from_secs(1)));
    }
}
