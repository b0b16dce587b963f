//! `pdhost generate`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use model::arch::Model;
use model::gguf::Gguf;
use model::kernels::Precision;
use model::tokenizer::Tokenizer;
use pdhost::engine::{Engine, Finish, OnFailure, PrefillBy, PrefillReport, Request, Sampling};
use serde_json::json;
use shm_format::Dtype;

use crate::cli::GenerateArgs;

/// A loaded model, its tokenizer if it has one, its display name and the path a producer loads it from.
fn load(name: &str, quiet: bool) -> anyhow::Result<(Model, Option<Tokenizer>, String, PathBuf)> {
    let path = Path::new(name);
    if path.is_dir() {
        let model = Model::from_hf_dir(path)?;
        let json = path.join("tokenizer.json");
        let tokenizer = if json.is_file() { Some(Tokenizer::from_file(&json)?) } else { None };
        return Ok((model, tokenizer, path.display().to_string(), std::path::absolute(path)?));
    }
    let file = if path.extension().is_some_and(|e| e == "gguf") || path.is_file() {
        path.to_path_buf()
    } else {
        model::registry::spec(name)?;
        let mut bar = super::models::Bar::new(quiet);
        let file = model::registry::fetch(name, &mut bar)?;
        bar.finish();
        file
    };
    let spinner = super::models::Bar::new(quiet);
    spinner.spin(&format!("loading {}", file.display()));
    let gguf = Gguf::open(&file)?;
    let tokenizer = Tokenizer::from_gguf(&gguf).context("building the tokenizer")?;
    let model = Model::from_gguf(&gguf).context("loading the weights")?;
    spinner.finish();
    Ok((model, Some(tokenizer), name.to_string(), std::path::absolute(&file)?))
}

/// The cache dtype a `--kv-dtype` value (already checked by clap) names.
pub fn kv_dtype(name: &str) -> Dtype {
    match name {
        "bf16" => Dtype::Bf16,
        "f16" => Dtype::F16,
        _ => Dtype::F32,
    }
}

/// All cores.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

pub fn run(args: &GenerateArgs) -> anyhow::Result<ExitCode> {
    let t0 = Instant::now();
    let (mut model, tokenizer, model_name, model_path) = load(&args.model, args.json)?;
    let precision = if args.precision == "fast" { Precision::Fast } else { Precision::Exact };
    model.configure(precision, args.threads.unwrap_or_else(default_threads));
    let text = match (&args.prompt, &args.prompt_file) {
        (Some(text), _) => Some(text.clone()),
        (None, Some(path)) if path.as_os_str() == "-" => {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
                .context("--prompt-file -: expected UTF-8 text on standard input")?;
            Some(text)
        }
        (None, Some(path)) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("--prompt-file {}: expected a readable UTF-8 text file", path.display()))?,
        ),
        (None, None) => None,
    };
    let prompt = match (text, &args.prompt_ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) => {
            let tok = tokenizer.as_ref().with_context(|| {
                format!("model {model_name} has no tokenizer: expected --prompt-ids instead of a text prompt")
            })?;
            tok.encode(&text, tok.add_bos())
        }
        (None, None) => unreachable!("clap requires one"),
    };
    anyhow::ensure!(!prompt.is_empty(), "prompt: expected at least one token, found none");
    if let Some(&bad) = prompt.iter().find(|&&id| id as usize >= model.config.vocab) {
        anyhow::bail!("prompt id {bad}: expected ids below the vocabulary size {}", model.config.vocab);
    }
    let dtype = kv_dtype(&args.kv_dtype);
    let max_len = (prompt.len() + args.max_tokens) as u64;
    let geometry = model.config.kv_geometry();
    let chunk_tokens = if args.prefill_chunk == 0 { prompt.len() } else { args.prefill_chunk.min(prompt.len()) };
    let choice = super::producer::Choice {
        producer: &args.producer,
        backend_config: &args.backend_config,
        precision: &args.precision,
        threads: args.threads.unwrap_or_else(default_threads),
        timeout_s: args.producer_timeout,
    };
    let mut producer = choice.producer(&model_path, &geometry, dtype, chunk_tokens)?;
    let mut engine = Engine::new(model, dtype, args.page_size, max_len, 1)?;
    if let Some(p) = producer.as_mut() {
        // Start the producer (load its model) before the clock of the request starts; a start-up failure
        // is handled like any other on the request itself.
        let spinner = super::models::Bar::new(args.json);
        spinner.spin(&format!("starting producer {}", p.name()));
        let _ = p.start();
        spinner.finish();
    }
    let load_ms = t0.elapsed();
    let sampling = match args.temperature {
        Some(temperature) if temperature > 0.0 => Sampling::TopP { temperature, top_p: args.top_p, seed: args.seed },
        _ => Sampling::Greedy,
    };
    let request =
        Request { prompt: prompt.clone(), max_tokens: args.max_tokens, prefill_chunk: args.prefill_chunk, sampling };

    let mut stdout = std::io::stdout().lock();
    let mut shown = String::new();
    let mut so_far = Vec::new();
    let on_failure = if args.on_producer_failure == "fail" { OnFailure::Fail } else { OnFailure::Fallback };
    let by = match producer.as_mut() {
        Some(producer) => PrefillBy::Remote { producer, on_failure },
        None => PrefillBy::Local,
    };
    let gen = engine.generate_with(&request, by, |id| {
        if args.json {
            return;
        }
        if let Some(tok) = &tokenizer {
            so_far.push(id);
            let text = tok.decode(&so_far, true);
            // Print only what is new and complete (a multi-byte character may still be partial).
            if let Some(new) = text.strip_prefix(shown.as_str()) {
                if !new.ends_with('\u{FFFD}') {
                    let _ = write!(stdout, "{new}");
                    let _ = stdout.flush();
                    shown = text;
                }
            }
        }
    })?;
    let text = tokenizer.as_ref().map(|t| t.decode(&gen.output, true));
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let finish = match gen.finish {
        Finish::Eos => "eos",
        Finish::Length => "length",
    };
    let report = &gen.report;
    let where_ = if report.remote { "remote" } else { "local" };
    let fallback = report.fallback.as_ref().map(|e| format!("{}: {e}", e.kind()));
    let metrics = producer.as_ref().map(|p| {
        let m = p.metrics();
        json!({"spans_accepted": m.spans_accepted, "spans_rejected": m.spans_rejected, "starts": m.starts,
               "restarts": m.restarts, "bytes": m.bytes})
    });
    if args.json {
        let out = json!({
            "model": model_name,
            "prompt_ids": prompt,
            "output_ids": gen.output,
            "text": text,
            "finish_reason": finish,
            "logits_xxh3": format!("{:016x}", gen.logits_hash),
            "prefill": {"where": where_, "producer": report.producer.as_deref().unwrap_or("local"),
                        "layout": if report.remote { report.layout } else { None },
                        "wire_dtype": report.wire_dtype.filter(|_| report.remote).map(|d| d.name()),
                        "spans": gen.spans, "bytes": gen.bytes,
                        "fallback_reason": fallback,
                        "fallback_kind": report.fallback.as_ref().map(|e| e.kind()),
                        "producer_metrics": metrics},
            "timings_ms": {"load": ms(load_ms), "prefill": ms(gen.prefill), "ingest": ms(gen.ingest),
                           "decode": ms(gen.decode), "ttft": ms(gen.ttft),
                           "remote": {"backend": ms(report.remote_times.backend), "frame": ms(report.remote_times.frame),
                                      "take": ms(report.remote_times.take), "ipc": ms(report.remote_times.ipc())}},
        });
        writeln!(stdout, "{out}")?;
    } else {
        if tokenizer.is_none() {
            writeln!(stdout, "{:?}", gen.output)?;
        } else {
            writeln!(stdout)?;
        }
        stdout.flush()?;
        let decode_tps = (gen.output.len().saturating_sub(1)) as f64 / gen.decode.as_secs_f64().max(1e-9);
        let ingest_gbps = gen.bytes as f64 / gen.ingest.as_secs_f64().max(1e-9) / 1e9;
        if let Some(reason) = &fallback {
            eprintln!("warning: remote prefill failed, prefilled locally instead: {reason}");
        }
        let how = match (report.remote, report.layout) {
            (true, Some(layout)) => format!(
                "remote ({} producer, {layout} {} spans over shared memory)",
                where_producer(report),
                report.wire_dtype.map_or("?", |d| d.name())
            ),
            _ => "local (spans laid out by the host)".to_string(),
        };
        eprintln!(
            "prefill {how}: {} span(s), {:.1} MiB KV, ingest {ingest_gbps:.2} GB/s, TTFT {:.0} ms, decode {decode_tps:.1} tok/s, {} tokens ({finish})",
            gen.spans,
            gen.bytes as f64 / (1 << 20) as f64,
            ms(gen.ttft),
            gen.output.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn where_producer(report: &PrefillReport) -> &str {
    report.producer.as_deref().unwrap_or("local")
}
