//! `pdhost check-backend`: the conformance kit for backend authors. It runs a backend through a real
//! producer against the host's own local prefill on the same model, and says, check by check, whether it
//! holds: start and handshake, spans accepted whole, chunked, batched (where the backend stages batches)
//! and after a context (a prefix-cache hit),
//! per-layer K/V error within a tolerance,
//! greedy agreement up to near-ties, behaviour at a deadline, and timings.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use model::forward::NoPast;
use pdhost::engine::{Engine, OnFailure, PrefillBy, Request};
use pdhost::request::{self, Field, Invalid};
use pdhost::supervisor::{Producer, RestartPolicy};
use serde::Serialize;
use shm_format::Dtype;

use super::generate::Opened;
use super::kv_error::{self, print_layer_errors, ErrorSum, LayerError};
use super::outln;
use crate::cli::{CheckBackendArgs, SkipCheck};

/// Prompt lengths the checks use: short, one past a power of two, and longer than a small window.
const PROMPT_LENS: [usize; 3] = [9, 33, 70];
/// The chunk size of the chunked runs (not a divisor of any prompt length, so the last chunk is short).
const CHUNK: usize = 7;

/// One check's outcome.
#[derive(Debug, Serialize)]
struct Check {
    name: &'static str,
    ok: bool,
    detail: String,
}

/// Deterministic prompts of the given lengths, inside the vocabulary, avoiding the lowest ids (special
/// tokens in both shipped models) where the vocabulary has more.
fn prompts(vocab: usize) -> Vec<Vec<u32>> {
    let low: usize = if vocab > 4 { 4 } else { 0 };
    let span = (vocab - low).max(1) as u64;
    PROMPT_LENS
        .iter()
        .enumerate()
        .map(|(p, &len)| {
            (0..len as u64).map(|i| (low as u64 + (i * 7919 + p as u64 * 104_729) % span) as u32).collect()
        })
        .collect()
}

#[derive(Debug, Serialize)]
struct Report {
    backend: String,
    model: String,
    ok: bool,
    checks: Vec<Check>,
    /// What `--skip` left out.
    skipped: Vec<SkipCheck>,
    /// The checks not skipped that did not run (all after `start` or `spans`, whichever failed).
    not_run: Vec<String>,
    layers: Vec<LayerError>,
}

pub fn run(args: &CheckBackendArgs) -> anyhow::Result<ExitCode> {
    let threads = request::check_threads(args.threads)?;
    let timeout = request::check_timeout(Field::ProducerTimeout, args.producer_timeout)?;
    let backend_config = request::input::check_backend_config(args.backend_config.as_deref(), &args.backend)?;
    // `local` is no backend, and the producer's own list of choices would name it.
    let named = match args.backend.as_str() {
        "rngd" | "gpu" | "faulty" | "torch" => true,
        b => b.starts_with("py:") || b.starts_with("nixl://") || b.ends_with(".so") || b.contains('/'),
    };
    if !named {
        return Err(Invalid::new(
            Field::CheckedBackend,
            "a backend (rngd, gpu, faulty, torch, py:MODULE:CLASS, a PATH.so or nixl://HOST:PORT/NAME)",
            format_args!("{:?}", args.backend),
        )
        .into());
    }
    let positive = |field, v: f64| {
        if v.is_finite() && v >= 0.0 {
            Ok(v)
        } else {
            Err(Invalid::new(field, "a finite number of at least 0", format_args!("{v}")))
        }
    };
    let tolerance = positive(Field::KvTolerance, args.kv_tolerance)?;
    let tie_margin = positive(Field::TieMargin, args.tie_margin)?;
    let decode = request::check_count(Field::DecodeTokens, args.decode_tokens, 1, 256)? as usize;
    let source = request::input::model_source(&args.model)?;
    let choice = super::producer::Choice {
        field: Field::CheckedBackend,
        producer: &args.backend,
        backend_config,
        precision: args.precision,
        threads,
        timeout,
        sandbox: true,
        memory_limit: super::producer::memory_limit(None)?,
        restart: Default::default(),
    };
    let backend = choice.backend()?.context("expected a backend to check")?;
    let opened = Opened::open(&source, args.json)?;
    let longest = PROMPT_LENS.iter().max().copied().unwrap_or(1);
    let max_len = (longest + decode + 1) as u64;
    if opened.config.context < max_len as usize {
        return Err(Invalid::new(
            Field::Model,
            format!(
                "a model whose context holds {max_len} positions (the {longest}-token prompt and --decode-tokens \
                 {decode})"
            ),
            format_args!("{} of {}", opened.name, opened.config.context),
        )
        .into());
    }
    let mut model = opened.load(args.json)?;
    model.configure(args.precision.precision(), threads);
    let dtype = args.kv_dtype.dtype();
    let vocab = model.config.vocab;
    let prompts = prompts(vocab);
    let mut producer = choice.producer(
        &backend,
        &opened.path,
        &model.config,
        &model.identity,
        dtype,
        super::producer::Ring::double(longest),
    )?;
    producer.set_restart_policy(RestartPolicy {
        initial_backoff: Duration::ZERO,
        max_backoff: Duration::ZERO,
        ..RestartPolicy::default()
    });
    let mut engine = Engine::new(model, dtype, 16, max_len, 4)?;
    let runs = |check| !args.skip.contains(&check);
    let skippable = [SkipCheck::Kv, SkipCheck::Greedy, SkipCheck::Deadline, SkipCheck::Timings];
    let bar = super::bench::progress(2 + skippable.into_iter().filter(|&c| runs(c)).count() as u64, args.json);
    let mut checks = Vec::new();

    bar.set_message("start and handshake");
    let started = producer.start();
    checks.push(match &started {
        Ok(()) => Check { name: "start", ok: true, detail: described(&producer) },
        Err(e) => Check { name: "start", ok: false, detail: e.to_string() },
    });
    bar.inc(1);

    let mut layers = Vec::new();
    // The checks after `spans` ask the producer again: after a failed start, or spans that failed (a
    // producer that crashed or hung: each would wait out its own `--producer-timeout`), they are not run.
    let mut spans_ok = false;
    if started.is_ok() {
        bar.set_message("spans, whole and chunked");
        let (spans, errors) = spans_and_errors(&mut engine, &mut producer, &prompts);
        spans_ok = spans.ok;
        let sums = errors.unwrap_or_default();
        checks.push(spans);
        bar.inc(1);
        layers = sums.iter().enumerate().map(|(l, s)| s.finish(l as u32)).collect();
    }
    if spans_ok {
        if runs(SkipCheck::Kv) {
            checks.push(kv_check(&layers, tolerance));
            bar.inc(1);
        }
        if runs(SkipCheck::Greedy) {
            bar.set_message("greedy decode against local");
            checks.push(greedy(&mut engine, &mut producer, &prompts, decode, tie_margin));
            bar.inc(1);
        }
        if runs(SkipCheck::Deadline) {
            bar.set_message("deadline");
            checks.push(deadline(&mut engine, &mut producer, &prompts[0], timeout));
            bar.inc(1);
        }
        if runs(SkipCheck::Timings) {
            bar.set_message("timings");
            checks.push(timings(&mut engine, &mut producer, prompts.last().expect("three prompts")));
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    producer.shutdown();

    let mut skipped = args.skip.clone();
    skipped.sort_by_key(|c| *c as u8);
    skipped.dedup();
    let ok = checks.iter().all(|c| c.ok) && checks.len() + skipped.len() == 6;
    // A failed start leaves `spans` unrun, and no passed `spans` the checks after it (but those skipped).
    let mut not_run = Vec::new();
    if started.is_err() {
        not_run.push("spans".to_string());
    }
    if !spans_ok {
        not_run.extend(skippable.into_iter().filter(|&c| runs(c)).map(|c| format!("{c:?}").to_lowercase()));
    }
    let report = Report {
        backend: producer.name().to_string(),
        model: opened.name.clone(),
        ok,
        checks,
        skipped,
        not_run,
        layers,
    };
    if args.json {
        outln!("{}", serde_json::to_string(&report)?)?;
    } else {
        print_report(&report)?;
    }
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// What the running backend described, in words.
fn described(p: &Producer) -> String {
    let mut text = format!(
        "{} layout, {} on the wire",
        p.layout().unwrap_or("unknown"),
        p.wire_dtype().map_or("unknown", Dtype::name)
    );
    if let Some(max) = p.max_tokens() {
        text += &format!(", at most {max} tokens per call");
    }
    text += match p.identity() {
        Some(_) => ", model identity equal to the host's",
        None => ", no model identity (nothing proves which weights it loaded)",
    };
    text
}

/// Every prompt prefilled remotely whole and in chunks of [`CHUNK`], each compared layer by layer with the
/// host's local prefill at the same chunking; then, for a backend that takes a request's context (ABI
/// 1.1), each prompt's second half as a prefix-cache hit would send it ([`context_call`]).
fn spans_and_errors(
    engine: &mut Engine,
    producer: &mut Producer,
    prompts: &[Vec<u32>],
) -> (Check, Option<Vec<ErrorSum>>) {
    let mut sums = vec![ErrorSum::default(); engine.kv.geometry().layers.len()];
    let before = producer.metrics().spans_accepted;
    for prompt in prompts {
        for chunk in [0, CHUNK] {
            let by = PrefillBy::Remote { producer, on_failure: OnFailure::Fail };
            let remote = match engine.prefill(prompt, chunk, by) {
                Ok((seq, _)) => seq,
                Err(e) => {
                    let detail = format!("a {}-token prompt, chunk {chunk}: {e}", prompt.len());
                    return (Check { name: "spans", ok: false, detail }, None);
                }
            };
            let (local, _) = engine.prefill(prompt, chunk, PrefillBy::Local).expect("local prefill");
            kv_error::accumulate(&mut sums, engine, local, remote);
            engine.release(remote);
            engine.release(local);
        }
    }
    let batches = producer.described().is_some_and(|d| d.batches);
    if batches {
        if let Err(detail) = batch_calls(engine, producer, prompts, &mut sums) {
            return (Check { name: "spans", ok: false, detail }, None);
        }
    }
    let takes_context = producer.takes_context() == Some(true);
    if takes_context {
        for prompt in prompts {
            if let Err(detail) = context_call(engine, producer, prompt, &mut sums) {
                return (Check { name: "spans", ok: false, detail }, None);
            }
        }
    }
    let spans = producer.metrics().spans_accepted - before;
    let detail = format!(
        "{spans} spans accepted: prompts of {} tokens, whole, in chunks of {CHUNK}, {}, and {}",
        PROMPT_LENS.map(|l| l.to_string()).join(", "),
        if batches {
            "all three as one batch (the backend stages batches)"
        } else {
            "no batch (the backend does not stage them)"
        },
        if takes_context {
            "their second halves after the first as a context (a prefix-cache hit)"
        } else {
            "no call with a context (the backend refuses them: no prefix-cache hit goes to it)"
        }
    );
    (Check { name: "spans", ok: true, detail }, Some(sums))
}

/// What a server sends a backend that stages batches (ABI 1.3 `stage`): the prompts' first calls as one
/// batch, `stage` then a `prefill` for each, the spans streaming through a ring of two slots. Each span's
/// K/V are compared with the host's prefill of the same tokens alone.
fn batch_calls(
    engine: &mut Engine,
    producer: &mut Producer,
    prompts: &[Vec<u32>],
    sums: &mut [ErrorSum],
) -> Result<(), String> {
    let limit = producer.max_tokens().map_or(usize::MAX, |m| usize::try_from(m).unwrap_or(usize::MAX));
    let heads: Vec<&[u32]> = prompts.iter().map(|p| &p[..p.len().min(limit)]).collect();
    let seqs: Vec<_> =
        heads.iter().map(|_| engine.prefill(&[], 0, PrefillBy::Local).expect("an empty sequence").0).collect();
    let calls: Vec<_> = seqs
        .iter()
        .zip(&heads)
        .map(|(seq, head)| pdhost_producer::protocol::PrefillCall {
            request_id: seq.0,
            start_pos: 0,
            tokens: head.to_vec(),
            context: Vec::new(),
        })
        .collect();
    let mut taken = Ok(());
    for (i, call) in calls.iter().enumerate() {
        let pending = if i == 0 { producer.submit_batch(&calls) } else { producer.next(call) };
        let span = match pending {
            Ok(pending) => producer.take(pending, &mut engine.kv, seqs[i]),
            Err(e) => Err(e),
        };
        if let Err(e) = span {
            taken =
                Err(format!("a batch of {} prompts' calls, call {i} ({} tokens): {e}", calls.len(), call.tokens.len()));
            break;
        }
    }
    for (seq, head) in seqs.into_iter().zip(heads) {
        producer.release(seq.0);
        if taken.is_ok() {
            let (local, _) = engine.prefill(head, 0, PrefillBy::Local).expect("local prefill");
            kv_error::accumulate(sums, engine, local, seq);
            engine.release(local);
        }
        engine.release(seq);
    }
    taken
}

/// What a prefix-cache hit sends a backend: a new request that starts at the middle of `prompt`, with the
/// tokens before it as its context. The host holds those positions (its own prefill of the first half);
/// the backend must attend to them and write only the second half. Its K/V are compared with the host's
/// whole prefill of `prompt`.
fn context_call(
    engine: &mut Engine,
    producer: &mut Producer,
    prompt: &[u32],
    sums: &mut [ErrorSum],
) -> Result<(), String> {
    let start = prompt.len() / 2;
    let (seq, _) = engine.prefill(&prompt[..start], 0, PrefillBy::Local).expect("local prefill");
    // The sequence's id, which no call has carried to the producer (its prefill was local). The second
    // half goes in calls the supervisor cuts to the backend's `max_tokens`, the first carrying the context
    // and the rest continuing the request from where the last span ended, as the engine chunks a hit's
    // prefill.
    let mut taken = Ok(());
    let mut at = start;
    while at < prompt.len() {
        let call = pdhost_producer::protocol::PrefillCall {
            request_id: seq.0,
            start_pos: at as u64,
            tokens: prompt[at..].to_vec(),
            context: if at == start { prompt[..start].to_vec() } else { Vec::new() },
        };
        match producer.prefill(&mut engine.kv, seq, &call) {
            Ok(times) => at += usize::try_from(times.tokens).expect("at most the call's tokens"),
            Err(e) => {
                taken = Err(e);
                break;
            }
        }
    }
    producer.release(seq.0);
    if let Err(e) = taken {
        engine.release(seq);
        return Err(format!(
            "a {}-token prompt from position {start}, the {start} before it as its context: {e}",
            prompt.len()
        ));
    }
    let (local, _) = engine.prefill(prompt, 0, PrefillBy::Local).expect("local prefill");
    kv_error::accumulate(sums, engine, local, seq);
    engine.release(seq);
    engine.release(local);
    Ok(())
}

fn kv_check(layers: &[LayerError], tolerance: f64) -> Check {
    let worst = layers.iter().copied().max_by(|a, b| a.rel_l2.total_cmp(&b.rel_l2).then(a.layer.cmp(&b.layer)));
    match worst {
        None => Check { name: "kv", ok: false, detail: "no K/V compared (the spans check failed)".into() },
        Some(w) if w.rel_l2.is_nan() || w.rel_l2 > tolerance => Check {
            name: "kv",
            ok: false,
            detail: format!(
                "layer {}: K/V relative L2 error against local prefill: expected at most {tolerance}, found {:.3e} \
                 (max abs {:.3e}, min cosine {:.6})",
                w.layer, w.rel_l2, w.max_abs, w.min_cosine
            ),
        },
        Some(w) => Check {
            name: "kv",
            ok: true,
            detail: format!(
                "every layer within relative L2 {tolerance} of local prefill (worst: layer {}, {:.3e})",
                w.layer, w.rel_l2
            ),
        },
    }
}

/// Greedy decode after remote prefill against after local prefill: the ids must agree, or part at a
/// near-tie of the local logits (a gap of at most `margin` between the two chosen tokens).
fn greedy(engine: &mut Engine, producer: &mut Producer, prompts: &[Vec<u32>], decode: usize, margin: f64) -> Check {
    let (mut equal, mut ties) = (0, 0);
    for prompt in prompts {
        let req = Request::greedy(prompt.clone(), decode, 0);
        let remote =
            match engine.generate_with(&req, PrefillBy::Remote { producer, on_failure: OnFailure::Fail }, |_| {}) {
                Ok(g) => g.output,
                Err(e) => {
                    return Check { name: "greedy", ok: false, detail: format!("{}-token prompt: {e}", prompt.len()) }
                }
            };
        let local = engine.generate(&req, |_| {}).expect("local generation").output;
        let Some(at) = remote.iter().zip(&local).position(|(a, b)| a != b) else {
            equal += 1;
            continue;
        };
        // The local logits where the two part.
        let mut context = prompt.clone();
        context.extend_from_slice(&local[..at]);
        let logits = engine.model.forward(&context, 0, &NoPast, false).logits;
        let gap = f64::from(logits[local[at] as usize] - logits[remote[at] as usize]);
        if gap <= margin {
            ties += 1;
            continue;
        }
        return Check {
            name: "greedy",
            ok: false,
            detail: format!(
                "{}-token prompt, output token {at}: expected {} (as local prefill decodes), found {}; the local \
                 logits prefer it by {gap:.4}, more than the near-tie margin {margin}",
                prompt.len(),
                local[at],
                remote[at]
            ),
        };
    }
    Check {
        name: "greedy",
        ok: true,
        detail: format!(
            "{equal} of {} prompts decode {decode} identical tokens, {ties} part at a near-tie",
            prompts.len()
        ),
    }
}

/// A request under a deadline it cannot meet (1 µs: it passes before the reply can come) is killed with `timeout`, and a new producer serves the
/// next request: a backend whose `open` cannot run again after a kill (a lock left behind, a device not
/// released) fails here.
fn deadline(engine: &mut Engine, producer: &mut Producer, prompt: &[u32], timeout: Duration) -> Check {
    let starts = producer.metrics().starts;
    producer.set_request_timeout(Duration::from_micros(1));
    let short = engine.prefill(prompt, 0, PrefillBy::Remote { producer, on_failure: OnFailure::Fail });
    producer.set_request_timeout(timeout);
    let first = match short {
        Err(pdhost::engine::EngineError::Producer(e)) if e.kind() == "timeout" => "killed at a 1 µs deadline",
        other => {
            let found = match other {
                Ok((seq, _)) => {
                    engine.release(seq);
                    "a span".to_string()
                }
                Err(e) => e.to_string(),
            };
            let detail = format!("at a 1 µs deadline: expected a timeout, found {found}");
            return Check { name: "deadline", ok: false, detail };
        }
    };
    match engine.prefill(prompt, 0, PrefillBy::Remote { producer, on_failure: OnFailure::Fail }) {
        Ok((seq, _)) => {
            engine.release(seq);
            let restarted = producer.metrics().starts - starts;
            Check { name: "deadline", ok: true, detail: format!("{first}; {restarted} restart(s), then served") }
        }
        Err(e) => Check { name: "deadline", ok: false, detail: format!("{first}; the next request: {e}") },
    }
}

/// TTFT of the longest prompt, remote against local (informational: it fails only where the remote
/// prefill does).
fn timings(engine: &mut Engine, producer: &mut Producer, prompt: &[u32]) -> Check {
    let req = Request::greedy(prompt.to_vec(), 1, 0);
    let t = Instant::now();
    let remote = engine.generate_with(&req, PrefillBy::Remote { producer, on_failure: OnFailure::Fail }, |_| {});
    let remote_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let _ = engine.generate(&req, |_| {});
    let local_ms = t.elapsed().as_secs_f64() * 1e3;
    let detail = match &remote {
        Ok(g) => format!(
            "{}-token prompt: TTFT {remote_ms:.1} ms remote ({:.1} ms in the backend, {:.2} MiB of K/V) against \
             {local_ms:.1} ms local",
            prompt.len(),
            g.report.remote_times.backend.as_secs_f64() * 1e3,
            g.bytes as f64 / (1 << 20) as f64
        ),
        Err(e) => format!("remote prefill failed: {e}"),
    };
    // Informational, except that the remote prefill must work.
    Check { name: "timings", ok: remote.is_ok(), detail }
}

fn print_report(r: &Report) -> anyhow::Result<()> {
    outln!("check-backend {} on {}", r.backend, r.model)?;
    for c in &r.checks {
        outln!("  {} {:<8} {}", if c.ok { "PASS" } else { "FAIL" }, c.name, c.detail)?;
    }
    if !r.layers.is_empty() {
        outln!("  per-layer K/V error against local prefill:")?;
        print_layer_errors(&r.layers, "    ")?;
    }
    if !r.skipped.is_empty() {
        let names: Vec<String> = r.skipped.iter().map(|c| format!("{c:?}").to_lowercase()).collect();
        outln!("  skipped (--skip): {}", names.join(", "))?;
    }
    if !r.not_run.is_empty() {
        let after = if r.checks.iter().any(|c| c.name == "spans") { "spans" } else { "the start" };
        outln!("  not run ({after} failed): {}", r.not_run.join(", "))?;
    }
    let failed: Vec<&str> = r.checks.iter().filter(|c| !c.ok).map(|c| c.name).collect();
    if failed.is_empty() && r.ok {
        outln!("all {} checks pass", r.checks.len())?;
    } else if failed.is_empty() {
        outln!("FAIL: the checks after start did not run")?;
    } else {
        outln!("FAIL: {}", failed.join(", "))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn prompts_stay_inside_the_vocabulary() {
        for vocab in [1, 2, 4, 5, 49_152] {
            let ids = super::prompts(vocab);
            assert!(ids.iter().flatten().all(|&t| (t as usize) < vocab), "vocabulary of {vocab}");
            assert!(vocab <= 4 || ids.iter().flatten().all(|&t| t >= 4), "vocabulary of {vocab}: no special ids");
        }
    }
}
