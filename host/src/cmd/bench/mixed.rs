//! `pdhost bench serve --mixed`: does prefill stall decode? `--streams` streams decode; once each has
//! started, `--long-prompts` long prompts arrive at once. The streams' inter-token latency while those
//! prompts prefill is set beside the same streams' alone, for the producer (prefill in its own process,
//! decode and prefill a core each) and for `--producer local` (prefill in the host, a 256-token chunk
//! between decode rounds), each in a `pdhost serve` started for it in this run. That ratio is the PD
//! benefit on this machine.

use std::io::{BufRead, BufReader};
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context;
use model::arch::Config;
use model::gguf::Gguf;
use model::tokenizer::Tokenizer;
use pdhost::request::{self, Field, Limits};
use serde_json::{json, Map, Value};

use super::serve_bench::{count, percentiles, text_ids, Server, DEFAULT_CONTEXT, DEFAULT_MODEL};
use crate::cli::ServeBenchArgs;
use crate::cmd::outln;

/// Prompt tokens of each stream.
const STREAM_PROMPT: usize = 32;
/// A stream's `max_tokens` at most (and within the context): it is cut off (its client disconnects) once
/// the measurement is over.
const STREAM_MAX_TOKENS: u64 = 4096;
/// Text chunks each stream must have received before the measurement starts.
const WARM_CHUNKS: usize = 4;
/// Text chunks per stream measured alone.
const ALONE_CHUNKS: usize = 64;
/// Prompt tokens per local prefill chunk (the contrast case interleaves them with decode rounds).
const LOCAL_CHUNK: u64 = 256;
const TIMEOUT: Duration = Duration::from_secs(1800);

/// Inter-token latencies of one phase.
#[derive(Debug, Default)]
struct Phase {
    gaps_ms: Vec<f64>,
    /// Streams that ended before the phase did (an error, or `max_tokens`).
    ended: usize,
    /// The long prompts' latencies and where each was prefilled.
    long_ms: Vec<f64>,
    long_where: Vec<String>,
    errors: Vec<String>,
}

impl Phase {
    fn json(&self) -> Value {
        let (p50, p99) = percentiles(&self.gaps_ms);
        json!({"itl_p50_ms": p50, "itl_p99_ms": p99, "gaps": self.gaps_ms.len(), "streams_ended_early": self.ended,
               "long_latency_ms": self.long_ms, "long_prefill": self.long_where, "errors": self.errors})
    }
}

/// One server's two phases.
#[derive(Debug)]
struct Row {
    producer: String,
    split: String,
    alone: Phase,
    during: Phase,
}

pub fn run(args: &ServeBenchArgs) -> anyhow::Result<ExitCode> {
    let streams = count(Field::Streams, args.streams, 1, 16, "")? as usize;
    let n_long = count(Field::LongPrompts, args.long_prompts, 1, 8, "")? as usize;
    let threads = request::check_threads(args.threads)?;
    super::serve_bench::check_producer(&args.producer)?;
    let name = args.model.clone().unwrap_or_else(|| DEFAULT_MODEL.to_string());
    let path = super::fetched(&name, args.json)?;
    let gguf = Gguf::open(&path)?;
    let config = Config::from_gguf(&gguf)?;
    let context = args.context.unwrap_or(DEFAULT_CONTEXT.min(config.context as u64));
    let limits = Limits::new(&name, &config, Some(context))?;
    let context = limits.context as u64;
    // Each stream's prompt and at least one token must fit, before the servers start (a short context
    // failed late, naming a flag the user never gave).
    if context <= STREAM_PROMPT as u64 {
        let expected = format!("more than {STREAM_PROMPT} tokens with --mixed (each stream's prompt)");
        return Err(request::Invalid::new(Field::Context, expected, context).into());
    }
    // The servers would refuse a cache too large for memory, but only once started.
    let slots = streams + n_long;
    let budget = request::kv_budget(&config.kv_geometry(), args.kv_dtype.dtype(), 64, context, slots as u32)
        .context("the KV cache's size does not fit in 64 bits")?;
    request::check_memory(
        Field::Context,
        &format!("the KV cache for {slots} slots (--streams and --long-prompts) x {context} tokens"),
        budget,
    )?;
    let why = format!(" (the {context}-token context less the one token each long prompt asks for)");
    let long = count(Field::LongPrompt, args.long_prompt, 1, context - 1, &why)? as usize;
    let tok = Tokenizer::from_gguf(&gguf)?;
    let ids = text_ids(&tok, long + STREAM_PROMPT * streams);
    drop(gguf);
    // The streams never draw an end-of-sequence token: past one they would go on (`ignore_eos`) with
    // text-less special tokens, two steps between text chunks, and before it they would end early.
    let no_eos: Map<String, Value> = config.eos.iter().map(|id| (id.to_string(), json!(-100))).collect();

    let kv_dtype = clap::ValueEnum::to_possible_value(&args.kv_dtype).expect("not skipped");
    let precision = clap::ValueEnum::to_possible_value(&args.precision).expect("not skipped");
    let prefix_cache = if args.prefix_cache == crate::cli::Switch::On { "on" } else { "off" };
    let mut producers = vec![args.producer.as_str()];
    if args.producer != "local" {
        producers.push("local");
    }
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(TIMEOUT))
        .max_idle_connections_per_host(32)
        .build()
        .into();
    let bar = super::progress(2 * producers.len() as u64, args.json);
    let mut rows = Vec::new();
    for producer in producers {
        let mut cmd = Command::new(std::env::current_exe().context("locating the pdhost executable")?);
        cmd.args(["serve", "--model", &name, "--host", "127.0.0.1", "--port", "0", "--producer", producer])
            .args(["--context", &context.to_string(), "--kv-dtype", kv_dtype.get_name()])
            .args(["--precision", precision.get_name(), "--prefix-cache", prefix_cache])
            .args(["--slots", &slots.to_string(), "--queue", "16"]);
        let split = if producer == "local" {
            let chunk = LOCAL_CHUNK.min(context);
            cmd.args(["--threads", &threads.to_string(), "--prefill-chunk", &chunk.to_string()]);
            format!("host: decode and prefill on {threads} thread(s), prefill in {chunk}-token chunks")
        } else {
            // Decode and prefill a share of the cores each (one each on two cores).
            let decode = (threads / 2).max(1);
            let prefill = threads.saturating_sub(decode).max(1);
            cmd.args(["--threads", &decode.to_string(), "--backend-config", &json!({"threads": prefill}).to_string()]);
            format!("host decode {decode} thread(s), producer prefill {prefill}")
        };
        bar.set_message(format!("{producer}: starting"));
        let server = Server::start(cmd)?;
        bar.set_message(format!("{producer}: streams alone"));
        let max_tokens = STREAM_MAX_TOKENS.min(context - STREAM_PROMPT as u64);
        let alone = phase(&agent, &server.url, &ids, (streams, max_tokens, &no_eos), None);
        bar.inc(1);
        bar.set_message(format!("{producer}: streams while {n_long} x {long}-token prompts prefill"));
        let during = phase(&agent, &server.url, &ids, (streams, max_tokens, &no_eos), Some((&ids[..long], n_long)));
        bar.inc(1);
        server.stop();
        rows.push(Row { producer: producer.to_string(), split, alone, during });
    }
    bar.finish_and_clear();

    let ratio = |r: &Row| {
        let (_, a) = percentiles(&r.alone.gaps_ms);
        let (_, d) = percentiles(&r.during.gaps_ms);
        a.zip(d).map(|(a, d)| d / a)
    };
    let errors: usize = rows.iter().map(|r| r.alone.errors.len() + r.during.errors.len()).sum();
    if args.json {
        let rows: Vec<Value> = rows
            .iter()
            .map(|r| {
                json!({"producer": r.producer, "split": r.split, "alone": r.alone.json(), "during": r.during.json(),
                       "p99_ratio": ratio(r)})
            })
            .collect();
        outln!(
            "{}",
            json!({"bench": "serve-mixed", "model": name, "context": context, "precision": precision.get_name(),
                   "kv_dtype": kv_dtype.get_name(), "prefix_cache": prefix_cache, "streams": streams,
                   "long_prompts": n_long, "long_prompt_tokens": long, "threads": threads, "rows": rows})
        )?;
    } else {
        outln!(
            "{name}: {streams} stream(s) decoding, alone and while {n_long} prompt(s) of {long} tokens prefill \
             (sent at once, 1 output token each); a `pdhost serve` per row, {threads} thread(s) in all"
        )?;
        outln!(
            "{:<8} {:>10} {:>10} {:>12} {:>12} {:>8} {:>10} {:>8}  split",
            "producer",
            "alone p50",
            "alone p99",
            "during p50",
            "during p99",
            "p99 x",
            "long p50",
            "prefill"
        )?;
        for r in &rows {
            let f = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}ms"));
            let (a50, a99) = percentiles(&r.alone.gaps_ms);
            let (d50, d99) = percentiles(&r.during.gaps_ms);
            let (l50, _) = percentiles(&r.during.long_ms);
            let mut wheres = r.during.long_where.clone();
            wheres.dedup();
            outln!(
                "{:<8} {:>10} {:>10} {:>12} {:>12} {:>8} {:>10} {:>8}  {}",
                r.producer,
                f(a50),
                f(a99),
                f(d50),
                f(d99),
                ratio(r).map_or_else(|| "-".to_string(), |x| format!("{x:.2}x")),
                f(l50),
                wheres.join("/"),
                r.split
            )?;
        }
        outln!(
            "ITL: gaps between a stream's text chunks, alone over {ALONE_CHUNKS} chunks per stream, during from the \
             long prompts' sending to their last answer. p99 x: during / alone."
        )?;
        for r in &rows {
            for e in r.alone.errors.iter().chain(&r.during.errors) {
                outln!("{}: {e}", r.producer)?;
            }
            if r.during.ended > 0 {
                outln!("{}: {} stream(s) ended before the long prompts were answered", r.producer, r.during.ended)?;
            }
        }
    }
    Ok(if errors == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Runs `streams` streams; with `long`, sends its prompts once every stream has started and measures
/// until they are answered, otherwise measures [`ALONE_CHUNKS`] chunks per stream. The streams' clients
/// then disconnect (which cancels them).
fn phase(
    agent: &ureq::Agent,
    url: &str,
    ids: &[u32],
    (streams, max_tokens, no_eos): (usize, u64, &Map<String, Value>),
    long: Option<(&[u32], usize)>,
) -> Phase {
    let stop = AtomicBool::new(false);
    let chunks: Vec<Mutex<Vec<Instant>>> = (0..streams).map(|_| Mutex::new(Vec::new())).collect();
    let ended: Vec<AtomicBool> = (0..streams).map(|_| AtomicBool::new(false)).collect();
    let errors = Mutex::new(Vec::new());
    let long_body = long.map(|(prompt, _)| json!({"prompt": prompt, "max_tokens": 1, "temperature": 0}));
    let mut out = Phase::default();
    std::thread::scope(|s| {
        for i in 0..streams {
            let (stop, chunks, ended, errors) = (&stop, &chunks[i], &ended[i], &errors);
            // A different prompt per stream, sampled with a fixed seed, so that no stream is a copy.
            let prompt = &ids[ids.len() - STREAM_PROMPT * (i + 1)..ids.len() - STREAM_PROMPT * i];
            // A stream that ended early would leave the rest of the long prompts' prefill unmeasured.
            let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": i,
                              "stream": true, "ignore_eos": true, "logit_bias": no_eos});
            s.spawn(move || {
                if let Err(e) = stream(agent, url, &body, stop, chunks) {
                    errors.lock().unwrap_or_else(|e| e.into_inner()).push(format!("stream {i}: {e}"));
                }
                ended.store(true, Ordering::Release);
            });
        }
        let started = |n: usize| {
            (0..streams).all(|i| ended[i].load(Ordering::Acquire) || chunks[i].lock().map_or(true, |c| c.len() >= n))
        };
        while !started(WARM_CHUNKS) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let from = Instant::now();
        match long {
            Some((_, n)) => {
                let body = long_body.as_ref().expect("with long prompts");
                let answers: Vec<_> = (0..n)
                    .map(|_| {
                        s.spawn(|| {
                            let t = Instant::now();
                            let r = post(agent, url, body);
                            (t.elapsed(), r)
                        })
                    })
                    .collect();
                for a in answers {
                    match a.join() {
                        Ok((t, Ok(v))) => {
                            out.long_ms.push(t.as_secs_f64() * 1e3);
                            out.long_where.push(v["pdhost"]["prefill"].as_str().unwrap_or("?").to_string());
                        }
                        Ok((_, Err(e))) => out.errors.push(format!("long prompt: {e}")),
                        Err(_) => out.errors.push("long prompt: panicked".into()),
                    }
                }
            }
            None => {
                while !started(WARM_CHUNKS + ALONE_CHUNKS) {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
        let to = Instant::now();
        out.ended = ended.iter().filter(|e| e.load(Ordering::Acquire)).count();
        stop.store(true, Ordering::Release);
        for c in &chunks {
            let c = c.lock().unwrap_or_else(|e| e.into_inner());
            for w in c.windows(2) {
                if w[1] > from && w[1] <= to {
                    out.gaps_ms.push((w[1] - w[0]).as_secs_f64() * 1e3);
                }
            }
        }
    });
    out.errors.extend(errors.into_inner().unwrap_or_else(|e| e.into_inner()));
    out
}

/// Reads a stream, noting when each chunk with text arrives, until it ends or `stop` is set.
fn stream(
    agent: &ureq::Agent,
    url: &str,
    body: &Value,
    stop: &AtomicBool,
    chunks: &Mutex<Vec<Instant>>,
) -> Result<(), String> {
    let mut r = agent.post(&format!("{url}/v1/completions")).send_json(body).map_err(|e| e.to_string())?;
    if r.status().as_u16() != 200 {
        let text = r.body_mut().read_to_string().unwrap_or_default();
        return Err(format!("status {}: {}", r.status().as_u16(), request::shorten(&text)));
    }
    for line in BufReader::new(r.into_body().into_reader()).lines() {
        if stop.load(Ordering::Acquire) {
            return Ok(());
        }
        let line = line.map_err(|e| format!("reading the stream: {e}"))?;
        let Some(data) = line.strip_prefix("data:").map(str::trim_start) else { continue };
        if data == "[DONE]" {
            return Ok(());
        }
        let v: Value = serde_json::from_str(data).map_err(|e| format!("an event that is not JSON ({e})"))?;
        if let Some(m) = v["error"]["message"].as_str() {
            return Err(format!("error event: {}", request::shorten(m)));
        }
        if v["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()) {
            chunks.lock().unwrap_or_else(|e| e.into_inner()).push(Instant::now());
        }
    }
    Ok(())
}

fn post(agent: &ureq::Agent, url: &str, body: &Value) -> Result<Value, String> {
    let mut r = agent.post(&format!("{url}/v1/completions")).send_json(body).map_err(|e| e.to_string())?;
    let status = r.status().as_u16();
    let v: Value = r.body_mut().read_json().map_err(|e| format!("reading the response: {e}"))?;
    if status != 200 {
        return Err(format!("status {status}: {}", request::shorten(&v.to_string())));
    }
    Ok(v)
}
