//! `pdhost bench model`: tokens/s of the real models beside llama.cpp on the same files, same threads.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::Context;
use model::arch::{Config, Model};
use model::gguf::Gguf;
use model::kernels::Precision;
use model::tokenizer::Tokenizer;
use pdhost::engine::{Engine, Request};
use pdhost::request::{self, Field, Invalid, Limits, RawRequest};
use serde_json::json;

use crate::cli::ModelBenchArgs;
use crate::cmd::outln;

const SCRIPT: &str = include_str!("llama_cpp.py");
const TEXT: &str = "The history of the printing press begins in the fifteenth century, when movable type changed how \
                    books were made, how ideas travelled, and who could read them. ";

struct Row {
    model: &'static str,
    precision: &'static str,
    threads: usize,
    prompt: usize,
    batch: usize,
    prefill: f64,
    decode: f64,
    llama: Option<(f64, f64)>,
}

impl Row {
    /// This row's aggregate decode over the batch-1 row of its model, precision, threads and prompt, where
    /// `--batch` has one: what batching gains (the bar is 3x at 4).
    fn over_batch1(&self, rows: &[Row]) -> Option<f64> {
        rows.iter()
            .find(|o| {
                (o.model, o.precision, o.threads, o.prompt, o.batch)
                    == (self.model, self.precision, self.threads, self.prompt, 1)
            })
            .map(|o| self.decode / o.decode)
    }
}

/// How long a model took to load (and, in `fast`, to quantize), and the weights it holds.
struct Loaded {
    model: &'static str,
    precision: &'static str,
    load_ms: f64,
    weights_mib: f64,
}

/// The memory of one short `pdhost generate` of a model, in a process of its own.
struct Resident {
    model: &'static str,
    precision: &'static str,
    /// The GGUF file's size.
    gguf_mib: f64,
    /// The KV pool that `generate` preallocated for the prompt plus its output.
    kv_mib: f64,
    /// The process's resident memory once the weights and the KV pool were loaded (the bar).
    loaded_mib: f64,
    /// The process's peak resident memory.
    peak_mib: f64,
}

/// The resident memory of `pdhost generate` of `prompt` plus `decode` tokens of `model` in `precision`
/// (local prefill, 2 threads) after load and at its peak, and the KV pool it preallocated, in MiB, as the
/// process reports them in its `--json` (`memory.rss_after_load_bytes`, `memory.peak_rss_bytes`,
/// `memory.kv_pool_bytes`).
fn generate_memory_mib(
    model: &str,
    precision: &str,
    kv_dtype: &str,
    prompt: &[u32],
    decode: u64,
) -> anyhow::Result<(f64, f64, f64)> {
    let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let out = Command::new(std::env::current_exe().context("locating the pdhost executable")?)
        .args(["generate", "--model", model, "--producer", "local", "--precision", precision, "--threads", "2"])
        .args(["--max-tokens", &decode.to_string(), "--prompt-ids", &ids.join(","), "--kv-dtype", kv_dtype, "--json"])
        .stdin(std::process::Stdio::null())
        .output()
        .context("running `pdhost generate`")?;
    let said = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(
        out.status.success(),
        "`pdhost generate --model {model}` failed: {}",
        said.lines().last().unwrap_or("no output")
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("`pdhost generate --json`'s output")?;
    let mib = |key: &str| {
        v["memory"][key]
            .as_u64()
            .map(|b| b as f64 / (1 << 20) as f64)
            .with_context(|| format!("`pdhost generate --json`: expected memory.{key}, found {}", v["memory"]))
    };
    Ok((mib("rss_after_load_bytes")?, mib("peak_rss_bytes")?, mib("kv_pool_bytes")?))
}

/// The median of `xs` (the mean of the middle two of an even count; NaN of none). `bench pd` uses it too.
pub(super) fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// [`run_batch`] after one untimed prefill of `req` (the warm-up llama.cpp's side gets too).
fn run_cell(engine: &mut Engine, req: &Request, batch: usize) -> anyhow::Result<(f64, f64)> {
    let warm = engine.admit(req, pdhost::engine::PrefillBy::Local)?;
    engine.finish(warm);
    run_batch(engine, req, batch)
}

/// Prefills `batch` copies of `req` (the first one's prefill timed), then decodes all of them together,
/// one batched step at a time: prefill tok/s of one prompt, aggregate decode tok/s.
fn run_batch(engine: &mut Engine, req: &Request, batch: usize) -> anyhow::Result<(f64, f64)> {
    let mut lives = Vec::with_capacity(batch);
    let mut prefill = 0.0;
    for i in 0..batch {
        let live = engine.admit(req, pdhost::engine::PrefillBy::Local)?;
        if i == 0 {
            // The forward passes and the commits into the paged cache, as llama.cpp's prefill time
            // includes its own K/V writes.
            prefill = req.prompt.len() as f64 / (live.prefill_time() + live.ingest_time()).as_secs_f64();
        }
        lives.push(live);
    }
    // The first token of each comes from its prefill; what follows is decode. Its first step, the first
    // forward pass of this batch's shape, is not timed, as llama.cpp's is not (`llama_cpp.py`): both
    // sides time `decode_tokens` steps.
    for _ in 0..2 {
        let mut refs: Vec<&mut pdhost::engine::Live> = lives.iter_mut().collect();
        for r in engine.step_many(&mut refs) {
            r?;
        }
    }
    let t = std::time::Instant::now();
    let mut decoded = 0usize;
    loop {
        let mut refs: Vec<&mut pdhost::engine::Live> = lives.iter_mut().collect();
        let mut any = false;
        for r in engine.step_many(&mut refs) {
            if r?.is_some() {
                decoded += 1;
                any = true;
            }
        }
        if !any {
            break;
        }
    }
    let decode = decoded as f64 / t.elapsed().as_secs_f64();
    for live in lives {
        engine.finish(live);
    }
    Ok((prefill, decode))
}

/// One bench model, opened and with its prompts checked against its limits.
struct Case {
    name: &'static str,
    path: PathBuf,
    gguf: Gguf,
    /// One per `--prompt-tokens`.
    requests: Vec<Request>,
}

/// Every model's request, checked before anything slow runs. Each `--prompt-tokens` is checked against
/// the smallest context of the models asked for, which the refusal names.
fn cases(args: &ModelBenchArgs) -> anyhow::Result<Vec<Case>> {
    let decode = request::check_count(Field::DecodeTokens, args.decode_tokens, 1, MAX_DECODE)?;
    let mut opened = Vec::new();
    for name in args.models.iter().map(|m| m.name()) {
        let path = super::fetched(name, args.json)?;
        let gguf = Gguf::open(&path)?;
        let limits = Limits::new(name, &Config::from_gguf(&gguf)?, None)?;
        opened.push((name, path, gguf, limits));
    }
    let Some((smallest, max_prompt)) =
        opened.iter().map(|(name, .., limits)| (*name, limits.context as u64 - decode - 2)).min_by_key(|c| c.1)
    else {
        return Ok(Vec::new());
    };
    for &tokens in &args.prompt_tokens {
        request::check_count(Field::PromptTokens, tokens, 1, max_prompt).map_err(|e| Invalid {
            expected: format!("{} ({smallest}'s context less the decoded tokens)", e.expected),
            ..e
        })?;
    }
    let mut cases = Vec::new();
    for (name, path, gguf, limits) in opened {
        let tok = Tokenizer::from_gguf(&gguf)?;
        let mut requests = Vec::new();
        for &prompt_tokens in &args.prompt_tokens {
            let mut prompt = tok.encode(&TEXT.repeat(1 + prompt_tokens as usize / 20), tok.add_bos());
            prompt.truncate(prompt_tokens as usize);
            let raw = RawRequest {
                prompt,
                prompt_field: Some(Field::PromptTokens),
                // The first token from the prefill, one untimed step, then `decode` timed ones, never
                // cut short by an end-of-sequence token (llama.cpp's side decodes them all too).
                max_tokens: decode + 2,
                ignore_eos: true,
                ..RawRequest::default()
            };
            requests.push(request::check_request(&raw, &limits)?);
        }
        cases.push(Case { name, path, requests, gguf });
    }
    Ok(cases)
}

/// The most tokens a bench decodes.
pub(super) const MAX_DECODE: u64 = 4096;
/// The most sequences `--batch` decodes at once.
const MAX_BATCH: u64 = 16;
/// The most timed runs of a case.
const MAX_REPEATS: u64 = 20;

pub fn run(args: &ModelBenchArgs) -> anyhow::Result<ExitCode> {
    let batches = super::counts(Field::Batch, &args.batch, MAX_BATCH)?;
    let repeats = request::check_count(Field::Repeats, args.repeats, 1, MAX_REPEATS)?;
    let threads = super::counts(Field::Threads, &args.threads, model::kernels::max_threads() as u64)?;
    let precisions: Vec<Precision> = args.precision.iter().map(|p| p.precision()).collect();
    let cases = cases(args)?;
    let kv_name = args.kv_dtype.dtype().name();
    let llama_site = if args.no_llama_cpp { None } else { Some(llama_cpp_python(args.json)?) };
    let per_case = precisions.len() * threads.len() * batches.len() * args.prompt_tokens.len();
    let bar = super::progress(repeats * (cases.len() * per_case) as u64, args.json);
    let (mut rows, mut loads, mut residents) = (Vec::new(), Vec::new(), Vec::new());
    for case in &cases {
        let name = case.name;
        for &precision in &precisions {
            let t = std::time::Instant::now();
            let mut model = Model::from_gguf(&case.gguf)?;
            model.configure(precision, 1);
            loads.push(Loaded {
                model: name,
                precision: precision.name(),
                load_ms: t.elapsed().as_secs_f64() * 1e3,
                weights_mib: model.weight_bytes() as f64 / (1 << 20) as f64,
            });
            drop(model);
            bar.set_message(format!("{name} {}: the memory of a short generate", precision.name()));
            let (loaded_mib, peak_mib, kv_mib) =
                generate_memory_mib(name, precision.name(), kv_name, &case.requests[0].prompt, args.decode_tokens)?;
            residents.push(Resident {
                model: name,
                precision: precision.name(),
                gguf_mib: std::fs::metadata(&case.path).context("the GGUF's size")?.len() as f64 / (1 << 20) as f64,
                kv_mib,
                loaded_mib,
                peak_mib,
            });
        }
        let mut model = Model::from_gguf(&case.gguf)?;
        for &threads in &threads {
            for request in &case.requests {
                let prompt = &request.prompt;
                // Per repeat, llama.cpp's run, then each of pdhost's cells: both sides' samples of a
                // repeat are taken within a minute of each other, as this machine's speed drifts.
                let cells: Vec<(Precision, usize)> =
                    precisions.iter().flat_map(|&p| batches.iter().map(move |&b| (p, b))).collect();
                let mut ours = vec![(Vec::new(), Vec::new()); cells.len()];
                let mut theirs: Vec<(f64, Vec<(usize, f64)>)> = Vec::new();
                for rep in 0..repeats {
                    if let Some(site) = &llama_site {
                        bar.set_message(format!(
                            "{name} llama.cpp {threads}t {} tokens, run {}",
                            prompt.len(),
                            rep + 1
                        ));
                        theirs.push(llama_cpp(site, &case.path, threads, args.decode_tokens, &batches, prompt)?);
                    }
                    for (&(precision, batch), (prefills, decodes)) in cells.iter().zip(&mut ours) {
                        bar.set_message(format!(
                            "{name} {} {threads}t {} tokens batch {batch}, run {}",
                            precision.name(),
                            prompt.len(),
                            rep + 1
                        ));
                        model.configure(precision, threads);
                        let max_len = (prompt.len() + request.max_tokens) as u64;
                        let mut engine = Engine::new(model, args.kv_dtype.dtype(), 64, max_len, batch as u32)?;
                        let result = run_cell(&mut engine, request, batch);
                        model = engine.model;
                        let (prefill, decode) = result?;
                        prefills.push(prefill);
                        decodes.push(decode);
                        bar.inc(1);
                    }
                }
                let llama_prefill = median(theirs.iter().map(|(p, _)| *p).collect());
                for (&(precision, batch), (prefills, decodes)) in cells.iter().zip(ours) {
                    let llama_decode = median(
                        theirs
                            .iter()
                            .flat_map(|(_, d)| d.iter().filter(|(b, _)| *b == batch).map(|(_, d)| *d))
                            .collect(),
                    );
                    rows.push(Row {
                        model: name,
                        precision: precision.name(),
                        threads,
                        prompt: prompt.len(),
                        batch,
                        prefill: median(prefills),
                        decode: median(decodes),
                        llama: llama_site.is_some().then_some((llama_prefill, llama_decode)),
                    });
                }
            }
        }
    }
    bar.finish_and_clear();
    if args.json {
        let out: Vec<_> = rows
            .iter()
            .map(|r| {
                json!({"model": r.model, "precision": r.precision, "threads": r.threads,
                       "prompt_tokens": r.prompt, "batch": r.batch,
                       "prefill_tok_s": r.prefill, "decode_tok_s": r.decode,
                       "decode_over_batch1": r.over_batch1(&rows),
                       "llama_cpp_prefill_tok_s": r.llama.map(|l| l.0),
                       "llama_cpp_decode_tok_s": r.llama.map(|l| l.1)})
            })
            .collect();
        let loads: Vec<_> = loads
            .iter()
            .map(|l| json!({"model": l.model, "precision": l.precision, "load_ms": l.load_ms, "weights_mib": l.weights_mib}))
            .collect();
        let residents: Vec<_> = residents
            .iter()
            .map(|r| {
                json!({"model": r.model, "precision": r.precision, "gguf_mib": r.gguf_mib, "kv_pool_mib": r.kv_mib,
                       "rss_after_load_mib": r.loaded_mib, "generate_peak_rss_mib": r.peak_mib})
            })
            .collect();
        outln!(
            "{}",
            json!({"bench": "model", "models": cases.iter().map(|c| c.name).collect::<Vec<_>>(),
                   "precisions": precisions.iter().map(|p| p.name()).collect::<Vec<_>>(), "threads": threads,
                   "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
                   "batch": batches, "repeats": repeats, "kv_dtype": kv_name, "loads": loads, "resident": residents, "results": out})
        )?;
    } else {
        outln!(
            "prefill of a prompt and greedy decode of {} tokens by `batch` sequences at once through the paged KV cache ({kv_name} KV; llama.cpp's is f16), the median of {repeats} run(s), each after a warm-up prefill; llama.cpp on the same GGUF, same threads, timed the same way, its runs interleaved with pdhost's",
            args.decode_tokens
        )?;
        for l in &loads {
            let held = if l.precision == Precision::Fast.name() {
                "the blocks' rows interleaved into the process's memory, at one thread"
            } else {
                "a GGUF's blocks stay in its mapping"
            };
            outln!(
                "{:<13} {:<6} loaded in {:.0} ms, {:.0} MiB of weights ({held})",
                l.model,
                l.precision,
                l.load_ms,
                l.weights_mib
            )?;
        }
        for r in &residents {
            outln!(
                "{:<13} {:<6} RSS of a `generate` of the first prompt after load {:.0} MiB ({:.2}x its GGUF {:.0} MiB + its KV pool {:.1} MiB), at its peak {:.0} MiB ({:.2}x)",
                r.model,
                r.precision,
                r.loaded_mib,
                r.loaded_mib / (r.gguf_mib + r.kv_mib),
                r.gguf_mib,
                r.kv_mib,
                r.peak_mib,
                r.peak_mib / (r.gguf_mib + r.kv_mib)
            )?;
        }
        outln!(
            "{:<13} {:<6} {:>3} {:>6} {:>5} {:>12} {:>12} {:>14} {:>14} {:>8} {:>8} {:>8}",
            "model",
            "prec",
            "thr",
            "prompt",
            "batch",
            "prefill t/s",
            "decode t/s",
            "llama.cpp pre",
            "llama.cpp dec",
            "pre x",
            "dec x",
            "x batch1"
        )?;
        for r in &rows {
            // A skipped peer (--no-llama-cpp) shows `-`, never NaN.
            let cell = |f: &dyn Fn((f64, f64)) -> String| r.llama.map_or_else(|| "-".to_string(), f);
            outln!(
                "{:<13} {:<6} {:>3} {:>6} {:>5} {:>12.1} {:>12.1} {:>14} {:>14} {:>8} {:>8} {:>8}",
                r.model,
                r.precision,
                r.threads,
                r.prompt,
                r.batch,
                r.prefill,
                r.decode,
                cell(&|(lp, _)| format!("{lp:.1}")),
                cell(&|(_, ld)| format!("{ld:.1}")),
                cell(&|(lp, _)| format!("{:.2}x", r.prefill / lp)),
                cell(&|(_, ld)| format!("{:.2}x", r.decode / ld)),
                r.over_batch1(&rows).map_or_else(|| "-".to_string(), |x| format!("{x:.2}x")),
            )?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Installs llama-cpp-python (which builds llama.cpp from source, with
/// [`super::llama_cpp_cmake_options`]) into the pdhost home once.
fn llama_cpp_python(quiet: bool) -> anyhow::Result<PathBuf> {
    // Not `llama-cpp-python`, where earlier versions installed a native build that uses AMX.
    let site = model::registry::home().join("llama-cpp-python-noamx");
    if site.join("llama_cpp").is_dir() {
        return Ok(site);
    }
    let bar = super::progress(1, quiet);
    bar.set_message("building llama.cpp (pip install llama-cpp-python, several minutes, once)");
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    let out = Command::new("python3")
        .args(["-m", "pip", "install", "--disable-pip-version-check", "--quiet", "--target"])
        .arg(&site)
        .arg("llama-cpp-python")
        .env("CMAKE_ARGS", super::llama_cpp_cmake_options().join(" "))
        .output()
        .context("running python3 -m pip")?;
    bar.finish_and_clear();
    anyhow::ensure!(
        out.status.success(),
        "pip install llama-cpp-python failed: {}",
        String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("no output")
    );
    Ok(site)
}

fn llama_cpp(
    site: &Path,
    gguf: &Path,
    threads: usize,
    decode: u64,
    batches: &[usize],
    prompt: &[u32],
) -> anyhow::Result<(f64, Vec<(usize, f64)>)> {
    let ids = prompt.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let batch_list = batches.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let out = Command::new("python3")
        .args(["-c", SCRIPT])
        .arg(gguf)
        .arg(threads.to_string())
        .arg(decode.to_string())
        .arg(batch_list)
        .arg(ids)
        .env("PYTHONPATH", site)
        .output()
        .context("running llama-cpp-python")?;
    anyhow::ensure!(
        out.status.success(),
        "llama.cpp run failed: {}",
        String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("llama.cpp output")?;
    let decode = batches.iter().map(|b| (*b, v["decode_tok_s"][b.to_string()].as_f64().unwrap_or(f64::NAN))).collect();
    Ok((v["prefill_tok_s"].as_f64().unwrap_or(f64::NAN), decode))
}

#[cfg(test)]
mod tests {
    use super::Row;

    #[test]
    fn batch_rows_are_set_beside_their_own_batch_1() {
        let row = |precision, threads, batch, decode| Row {
            model: "m",
            precision,
            threads,
            prompt: 128,
            batch,
            prefill: 1.0,
            decode,
            llama: None,
        };
        let rows =
            [row("fast", 1, 1, 50.0), row("fast", 2, 1, 80.0), row("fast", 1, 4, 150.0), row("exact", 1, 4, 90.0)];
        assert_eq!(rows[0].over_batch1(&rows), Some(1.0));
        assert_eq!(rows[2].over_batch1(&rows), Some(3.0));
        // No batch-1 row of its precision: nothing to set it beside.
        assert_eq!(rows[3].over_batch1(&rows), None);
    }
}
