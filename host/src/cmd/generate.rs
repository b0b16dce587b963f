//! `pdhost generate`.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use model::arch::Model;
use model::gguf::Gguf;
use model::kernels::Precision;
use model::tokenizer::Tokenizer;
use pdhost::engine::{Engine, Finish, Request, Sampling};
use serde_json::json;
use shm_format::Dtype;

use crate::cli::GenerateArgs;

/// A loaded model and its tokenizer, if it has one.
fn load(name: &str, quiet: bool) -> anyhow::Result<(Model, Option<Tokenizer>, String)> {
    let path = Path::new(name);
    if path.is_dir() {
        let model = Model::from_hf_dir(path)?;
        let json = path.join("tokenizer.json");
        let tokenizer = if json.is_file() { Some(Tokenizer::from_file(&json)?) } else { None };
        return Ok((model, tokenizer, path.display().to_string()));
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
    Ok((model, Some(tokenizer), name.to_string()))
}

/// All cores.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

pub fn run(args: &GenerateArgs) -> anyhow::Result<ExitCode> {
    let t0 = Instant::now();
    let (mut model, tokenizer, model_name) = load(&args.model, args.json)?;
    let precision = if args.precision == "fast" { Precision::Fast } else { Precision::Exact };
    model.configure(precision, args.threads.unwrap_or_else(default_threads));
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) => {
            let tok = tokenizer.as_ref().with_context(|| {
                format!("model {model_name} has no tokenizer: expected --prompt-ids instead of --prompt")
            })?;
            tok.encode(text, tok.add_bos())
        }
        (None, None) => unreachable!("clap requires one"),
    };
    anyhow::ensure!(!prompt.is_empty(), "prompt: expected at least one token, found none");
    if let Some(&bad) = prompt.iter().find(|&&id| id as usize >= model.config.vocab) {
        anyhow::bail!("prompt id {bad}: expected ids below the vocabulary size {}", model.config.vocab);
    }
    let dtype = match args.kv_dtype.as_str() {
        "bf16" => Dtype::Bf16,
        "f16" => Dtype::F16,
        _ => Dtype::F32,
    };
    let max_len = (prompt.len() + args.max_tokens) as u64;
    let mut engine = Engine::new(model, dtype, args.page_size, max_len, 1)?;
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
    let gen = engine.generate(&request, |id| {
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
    if args.json {
        let out = json!({
            "model": model_name,
            "prompt_ids": prompt,
            "output_ids": gen.output,
            "text": text,
            "finish_reason": finish,
            "prefill": {"where": "local", "producer": "local", "layout": null, "spans": gen.spans,
                        "bytes": gen.bytes, "fallback_reason": null},
            "timings_ms": {"load": ms(load_ms), "prefill": ms(gen.prefill), "ingest": ms(gen.ingest),
                           "decode": ms(gen.decode), "ttft": ms(gen.ttft)},
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
        eprintln!(
            "prefill local: {} span(s) laid out by the host, {:.1} MiB KV, ingest {ingest_gbps:.2} GB/s, TTFT {:.0} ms, decode {decode_tps:.1} tok/s, {} tokens ({finish})",
            gen.spans,
            gen.bytes as f64 / (1 << 20) as f64,
            ms(gen.ttft),
            gen.output.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}
