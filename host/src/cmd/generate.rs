//! `pdhost generate`.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use model::arch::{Config, Model};
use model::gguf::Gguf;
use model::tokenizer::Tokenizer;
use pdhost::engine::{Engine, Finish, PrefillBy, PrefillReport};
use pdhost::request::input::{self, ModelSource};
use pdhost::request::{self, Field, Invalid, Limits, RawRequest};
use serde_json::json;

use super::{errln, StdoutError};
use crate::cli::{GenerateArgs, Switch};

/// `--prefill-chunk` of `generate` and `serve` when not given: tokens per span from a producer. A
/// producer's ring holds two spans of this many tokens, so it sets the shared memory a producer costs
/// (Gemma 3 270M, f32: 2 x 72 MiB, against 2 x 324 MiB for whole 9216-token prompts).
const DEFAULT_PREFILL_CHUNK: u64 = 2048;

/// Prompt tokens per piece of a prefill the host runs itself (`--producer local`, or a remote prefill
/// that fell back) when `--prefill-chunk` is not given; outputs are the same bits at any size.
/// - A piece's activations and K/V are its forward pass's working memory. `generate` of an 1826-token
///   prompt (SmolLM2, `exact`, two threads) peaked at 369 MiB as one piece and 235 MiB in pieces of 256
///   (the GGUF 94 MiB, the KV pool 84 MiB), in the same CPU time.
/// - In `serve`, every live stream waits while a piece runs, one piece a round: on two cores (Gemma 3
///   270M, `exact`) 256 tokens take about 0.45 s, where 2048 froze every stream for about 3.6 s.
const DEFAULT_LOCAL_PIECE: u64 = 256;

/// Tokens per span a producer is asked for and per piece the host prefills in, at most `context`: both
/// `--prefill-chunk` where it is given (`generate` and `serve` alike), the defaults above otherwise.
pub(super) fn chunking(given: Option<u64>, context: u64) -> (u64, u64) {
    match given {
        Some(given) => (given, given),
        None => (DEFAULT_PREFILL_CHUNK.min(context), DEFAULT_LOCAL_PIECE.min(context)),
    }
}

/// A model whose metadata and tokenizer are read and whose weights are not yet: requests are checked
/// against its limits before the slow part.
pub struct Opened {
    /// Its configuration, from metadata.
    pub config: Config,
    /// Its tokenizer, if it has one.
    pub tokenizer: Option<Tokenizer>,
    /// The name to show.
    pub name: String,
    /// The absolute path a producer loads it from.
    pub path: PathBuf,
    gguf: Option<Gguf>,
}

/// Refuses a tokenizer with ids past the model's vocabulary (every prompt would be checked against the
/// model's, and fail per request, not at load).
fn fits_vocab(tokenizer: &Tokenizer, config: &Config, path: &std::path::Path) -> anyhow::Result<()> {
    let n = tokenizer.vocab_size();
    anyhow::ensure!(
        n <= config.vocab,
        "{}: tokenizer: expected at most the model's {} tokens, found {n}",
        path.display(),
        config.vocab
    );
    Ok(())
}

impl Opened {
    /// Opens a model from where `--model` says it is, fetching a known model on first use.
    pub fn open(source: &ModelSource, quiet: bool) -> anyhow::Result<Self> {
        let (file, name) = match source {
            ModelSource::HfDir(dir) => {
                let config = Config::from_hf_dir(dir)?;
                let json = dir.join("tokenizer.json");
                // Absent: a model without a tokenizer (ids in, ids out); anything else there must be one.
                let tokenizer = if json.exists() { Some(Tokenizer::from_file(&json)?) } else { None };
                if let Some(t) = &tokenizer {
                    fits_vocab(t, &config, &json)?;
                }
                let name = dir.display().to_string();
                return Ok(Opened { config, tokenizer, name, path: std::path::absolute(dir)?, gguf: None });
            }
            ModelSource::Gguf(file) => (file.clone(), file.display().to_string()),
            ModelSource::Known(name) => {
                let mut bar = super::models::Bar::new(quiet);
                let file = model::registry::fetch(name, &mut bar)?;
                bar.finish();
                (file, name.clone())
            }
        };
        let gguf = Gguf::open(&file)?;
        let config = Config::from_gguf(&gguf)?;
        let tokenizer = Tokenizer::from_gguf(&gguf).context("building the tokenizer")?;
        fits_vocab(&tokenizer, &config, &file)?;
        Ok(Opened { config, tokenizer: Some(tokenizer), name, path: std::path::absolute(&file)?, gguf: Some(gguf) })
    }

    /// The model's chat template (from its GGUF metadata, or built in for its architecture); `None` for
    /// a checkpoint directory.
    pub fn chat_template(&self) -> Option<Result<model::chat::ChatTemplate, model::chat::ChatError>> {
        self.gguf.as_ref().map(model::chat::ChatTemplate::from_gguf)
    }

    /// The model's identity (`model::identity`), without loading its weights.
    pub fn identity(&self) -> anyhow::Result<model::identity::ModelIdentity> {
        Ok(match &self.gguf {
            Some(gguf) => model::arch::gguf_identity(gguf, &self.config).context("hashing the weights")?,
            None => model::arch::hf_identity(&self.path, &self.config)?,
        })
    }

    /// Reads the weights (the slow part, with a spinner).
    pub fn load(&self, quiet: bool) -> anyhow::Result<Model> {
        let spinner = super::models::Bar::new(quiet);
        spinner.spin(&format!("loading {}", self.path.display()));
        let model = match &self.gguf {
            Some(gguf) => Model::from_gguf(gguf).context("loading the weights")?,
            None => Model::from_hf_dir(&self.path)?,
        };
        spinner.finish();
        Ok(model)
    }
}

/// The prompt text of `--prompt` or `--prompt-file`, checked (bounded, UTF-8, not empty); `None` with
/// `--prompt-ids`.
fn prompt_text(args: &GenerateArgs) -> Result<Option<(String, Field)>, Invalid> {
    match (&args.prompt, &args.prompt_file) {
        (Some(text), _) => {
            input::check_prompt_text(Field::Prompt, text)?;
            Ok(Some((text.clone(), Field::Prompt)))
        }
        (None, Some(path)) => Ok(Some((input::read_prompt_file(path)?, Field::PromptFile))),
        (None, None) => Ok(None),
    }
}

/// The sampling flags as a request gives them.
fn sampling_params(args: &GenerateArgs) -> request::SamplingParams {
    request::SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        min_p: args.min_p,
        top_p: Some(args.top_p),
        seed: args.seed,
    }
}

pub fn run(args: &GenerateArgs) -> anyhow::Result<ExitCode> {
    let t0 = Instant::now();
    // Everything that needs no model first, so a bad flag is refused at once.
    let threads = request::check_threads(args.threads)?;
    let timeout = request::check_timeout(Field::ProducerTimeout, args.producer_timeout)?;
    let backend_config = input::check_backend_config(args.backend_config.as_deref(), &args.producer)?;
    request::check_sampling(&sampling_params(args))?;
    let source = input::model_source(&args.model)?;
    let text = prompt_text(args)?;
    let choice = super::producer::Choice {
        field: Field::Producer,
        producer: &args.producer,
        backend_config,
        precision: args.precision,
        threads,
        timeout,
        sandbox: args.sandbox == Switch::On,
        memory_limit: super::producer::memory_limit(args.producer_memory)?,
        restart: Default::default(),
    };
    let backend = choice.backend()?;

    // The model's metadata: its limits, then the request checked against them.
    let opened = Opened::open(&source, args.json)?;
    let limits = Limits::new(&opened.name, &opened.config, args.context)?;
    let page_size = request::check_page_size(args.page_size, &limits)?;
    let (prompt, prompt_field) = match (text, &args.prompt_ids) {
        (_, Some(ids)) => (ids.clone(), Field::PromptIds),
        (Some((text, field)), None) => {
            let tok = opened.tokenizer.as_ref().ok_or_else(|| {
                Invalid::new(
                    field,
                    "--prompt-ids (this model has no tokenizer)",
                    format_args!("a text prompt for {}", opened.name),
                )
            })?;
            (tok.encode(&text, tok.add_bos()), field)
        }
        (None, None) => unreachable!("clap requires one"),
    };
    // Spans from a producer, and pieces where the host prefills (a fallback's too).
    let (spans, pieces) = chunking(args.prefill_chunk, limits.context as u64);
    let raw = RawRequest {
        prompt,
        prompt_field: Some(prompt_field),
        max_tokens: args.max_tokens,
        min_max_tokens: 0,
        sampling: sampling_params(args),
        prefill_chunk: if backend.is_some() { spans } else { pieces },
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        repetition_penalty: args.repetition_penalty,
        logit_bias: args.logit_bias.clone().map(|b| b.0).unwrap_or_default(),
        logprobs: args.logprobs.map(|n| (Field::Logprobs, n)),
        ignore_eos: args.ignore_eos,
        stop_token_ids: args.stop_token_ids.iter().flatten().map(|&id| u64::from(id)).collect(),
        min_tokens: args.min_tokens,
    };
    let request = request::check_request(&raw, &limits)?;
    let prompt = request.prompt.clone();
    let dtype = args.kv_dtype.dtype();
    // Checked: prompt + max_tokens <= context.
    let max_len = prompt.len() as u64 + args.max_tokens;
    let geometry = opened.config.kv_geometry();
    let budget = request::kv_budget(&geometry, dtype, page_size, max_len, 1)
        .ok_or_else(|| Invalid::new(Field::PageSize, "a KV cache whose size fits in 64 bits", page_size))?;
    request::check_memory(Field::MaxTokens, &format!("the KV cache for {max_len} tokens in {}", dtype.name()), budget)?;

    let mut model = opened.load(args.json)?;
    model.configure(args.precision.precision(), threads);
    let tokenizer = opened.tokenizer;
    let model_name = opened.name;
    let chunk_tokens = if request.prefill_chunk == 0 { prompt.len() } else { request.prefill_chunk.min(prompt.len()) };
    // A prompt of one span (the last token is the host's) needs one slot: the other would be shared
    // memory the host maps and faults in for nothing (84 MB for 1826 tokens of SmolLM2 in f32).
    let ring = match prompt.len().saturating_sub(1) > chunk_tokens {
        true => super::producer::Ring::double(chunk_tokens),
        false => super::producer::Ring { span_tokens: chunk_tokens, slots: 1 },
    };
    let mut producer =
        backend.map(|b| choice.producer(&b, &opened.path, &opened.config, &model.identity, dtype, ring)).transpose()?;
    let mut engine = Engine::new(model, dtype, page_size, max_len, 1)?;
    // A prefill that falls back to the host runs in its pieces, as `serve`'s does.
    engine.set_local_piece(pieces as usize);
    let mut unstarted = None;
    if let Some(p) = producer.as_mut() {
        // Start the producer (load its model) before the clock of the request starts; a start-up failure
        // is handled like any other on the request itself, falling back or failing. Under `fail` it ends
        // the request here, even one with nothing to prefill (a one-token prompt), which would otherwise
        // never ask the producer and succeed as if it were fine.
        let spinner = super::models::Bar::new(args.json);
        spinner.spin(&format!("starting producer {}", p.name()));
        let started = p.start();
        spinner.finish();
        match (started, args.on_producer_failure.policy()) {
            (Ok(_), _) => {}
            (Err(e), pdhost::engine::OnFailure::Fail) => return Err(pdhost::engine::EngineError::from(e).into()),
            // The request falls back, told this failure (asking the producer now would only meet the
            // backoff that follows it).
            (Err(e), pdhost::engine::OnFailure::Fallback) => unstarted = Some((p.name().to_string(), e)),
        }
    }
    let load_ms = t0.elapsed();
    // Loaded: the weights, the KV pool (prefaulted) and a started producer's ring, before any prefill.
    let loaded_rss = request::rss_bytes();

    let mut stdout = std::io::stdout().lock();
    let mut stream = tokenizer.as_ref().map(pdhost::text::TextStream::new);
    // A closed stdout stops the printing, not the request; it is reported (quietly) at the end.
    let mut write_error: Option<std::io::Error> = None;
    let on_failure = args.on_producer_failure.policy();
    let by = match (producer.as_mut(), unstarted) {
        (_, Some((name, error))) => PrefillBy::Unavailable { name, error },
        (Some(producer), None) => PrefillBy::Remote { producer, on_failure },
        (None, None) => PrefillBy::Local,
    };
    let gen = engine.generate_with(&request, by, |id| {
        if args.json {
            return;
        }
        if let (Some(stream), None) = (stream.as_mut(), &write_error) {
            // Print only what is new and complete (a multi-byte character may still be partial).
            let new = stream.push(id);
            if !new.is_empty() {
                if let Err(e) = write!(stdout, "{new}").and_then(|()| stdout.flush()) {
                    write_error = Some(e);
                }
            }
        }
    })?;
    if let Some(e) = write_error {
        return Err(StdoutError(e).into());
    }
    let text = tokenizer.as_ref().map(|t| t.decode(&gen.output, true));
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let finish = match gen.finish {
        Finish::Eos => "eos",
        Finish::Length => "length",
        Finish::Stopped => "stop",
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
        let mut out = json!({
            "model": model_name,
            "prompt_ids": prompt,
            "output_ids": gen.output,
            "text": text,
            "finish_reason": finish,
            "logits_xxh3": format!("{:016x}", gen.logits_hash),
            "prefill": {"where": where_, "producer": report.producer.as_deref().unwrap_or("local"),
                        "layout": if report.remote { report.layout } else { None },
                        "wire_dtype": report.wire_dtype.filter(|_| report.remote).map(|d| d.name()),
                        "transport": report.transport.as_deref().filter(|_| report.remote),
                        "spans": gen.spans, "bytes": gen.bytes,
                        "fallback_reason": fallback,
                        "fallback_kind": report.fallback.as_ref().map(|e| e.kind()),
                        "producer_metrics": metrics},
            "timings_ms": {"load": ms(load_ms), "prefill": ms(gen.prefill), "ingest": ms(gen.ingest),
                           "decode": ms(gen.decode), "ttft": ms(gen.ttft),
                           "remote": {"backend": ms(report.remote_times.backend), "frame": ms(report.remote_times.frame),
                                      "take": ms(report.remote_times.take), "ipc": ms(report.remote_times.ipc())}},
            "memory": {"kv_pool_bytes": budget, "rss_after_load_bytes": loaded_rss,
                       "peak_rss_bytes": request::peak_rss_bytes()},
        });
        if args.logprobs.is_some() {
            out["logprobs"] = gen
                .logprobs
                .iter()
                .map(|t| json!({"id": t.token, "logprob": t.logprob, "top": t.top}))
                .collect::<Vec<_>>()
                .into();
        }
        writeln!(stdout, "{out}").map_err(StdoutError)?;
    } else {
        match (&stream, &text) {
            (None, _) | (_, None) => writeln!(stdout, "{:?}", gen.output).map_err(StdoutError)?,
            // What the stream held back as an unfinished character is printed as `--json` has it (a
            // replacement character), not dropped.
            (Some(stream), Some(text)) => {
                let tail = text.strip_prefix(stream.shown()).unwrap_or_default();
                writeln!(stdout, "{tail}").map_err(StdoutError)?
            }
        }
        stdout.flush().map_err(StdoutError)?;
        let decode_tps = (gen.output.len().saturating_sub(1)) as f64 / gen.decode.as_secs_f64().max(1e-9);
        let ingest_gbps = gen.bytes as f64 / gen.ingest.as_secs_f64().max(1e-9) / 1e9;
        if let Some(reason) = &fallback {
            errln!("warning: remote prefill failed, prefilled locally instead: {reason}");
        }
        let how = match (report.remote, report.layout) {
            (true, Some(layout)) => format!(
                "remote ({} producer, {layout} {} spans over shared memory)",
                where_producer(report),
                report.wire_dtype.map_or("?", |d| d.name())
            ),
            _ => "local (spans laid out by the host)".to_string(),
        };
        errln!(
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
