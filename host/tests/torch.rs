//! The `torch` producer: prefill by PyTorch and transformers, another numerical stack than the host's, in
//! an environment pdhost makes in its own cache on first use. Its K/V is close to the host's but not
//! equal; the host's greedy output on it must equal transformers' references up to near-ties, on both
//! real models and both tiny checkpoints, whole and chunked, beyond the sliding window. A checkpoint with
//! other weights of the same shape is refused at the handshake.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;

const PDHOST: &str = env!("CARGO_BIN_EXE_pdhost");

fn reference_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/reference")
}

fn json_file(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

fn pdhost(args: &[&str]) -> Output {
    Command::new(PDHOST).args(args).stdin(Stdio::null()).output().unwrap()
}

/// `generate --producer torch --json`, which must have prefilled remotely, in grouped spans.
fn torch_generate(model: &str, prompt: &[&str], max: usize, extra: &[&str]) -> Value {
    let max = max.to_string();
    let args = [&["generate", "--model", model, "--max-tokens", &max, "--json", "--producer", "torch"], prompt, extra];
    let out = pdhost(&args.concat());
    assert!(out.status.success(), "{model} {extra:?}: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let prefill = &v["prefill"];
    let what = format!("{model} {extra:?}: {prefill}");
    assert_eq!((&prefill["where"], &prefill["producer"]), (&"remote".into(), &"torch".into()), "{what}");
    assert_eq!((&prefill["layout"], &prefill["fallback_reason"]), (&"grouped".into(), &Value::Null), "{what}");
    v
}

/// Output ids equal the reference case's up to its first near-tie (a margin under 0.01, as the references'
/// README says: there fp32 rounding of either stack may pick the other token).
fn assert_agrees(case: &Value, got: &Value, what: &str) {
    let want = ids(&case["output_ids"]);
    let margins: Vec<f64> = case["margins"].as_array().unwrap().iter().map(|m| m.as_f64().unwrap()).collect();
    let stop = margins.iter().position(|&m| m < 0.01).unwrap_or(want.len());
    let got = ids(&got["output_ids"]);
    assert_eq!(&got[..stop.min(got.len())], &want[..stop], "{what}: {}", case["name"]);
}

/// A real model's reference case through torch, for each of `chunkings`: the output ids equal the
/// reference's up to its first near-tie, and a chunked run came in several spans.
fn real_model_case(model: &str, file: &str, case: &str, chunkings: &[&[&str]]) {
    let prompts = json_file(&reference_dir().join("prompts.json"));
    let text = prompts.as_array().unwrap().iter().find(|p| p["name"] == case).unwrap()["text"].as_str().unwrap();
    let reference = json_file(&reference_dir().join(file));
    let case = reference["cases"].as_array().unwrap().iter().find(|c| c["name"] == case).unwrap();
    let want = ids(&case["output_ids"]).len();
    for extra in chunkings {
        let v = torch_generate(model, &["--prompt", text], want, extra);
        assert_eq!(v["prompt_ids"], case["prompt_ids"], "{model}: prompt ids");
        if !extra.is_empty() {
            assert!(v["prefill"]["spans"].as_u64().unwrap() > 2, "{model} {extra:?}: {}", v["prefill"]);
        }
        assert_agrees(case, &v, &format!("{model} {extra:?}"));
    }
}

/// Gemma 3 270M (a GGUF, dequantized by transformers) on the 744-token prompt, longer than its 512-token
/// window: whole, and in 200-token spans at nonzero offsets (the backend continues its transformers cache
/// across chunks).
#[test]
fn gemma_through_torch_equals_the_reference_beyond_the_window() {
    real_model_case("gemma3-270m", "greedy_gemma3_270m.json", "lgpl_650w", &[&[], &["--prefill-chunk", "200"]]);
}

/// SmolLM2 (a GGUF Llama, whose K the backend permutes into the host's rope order) on the same prompt in
/// 256-token spans, and on a short one whole.
#[test]
fn smollm2_through_torch_equals_the_references_whole_and_chunked() {
    real_model_case("smollm2-135m", "greedy_smollm2_135m.json", "lgpl_650w", &[&["--prefill-chunk", "256"]]);
    real_model_case("smollm2-135m", "greedy_smollm2_135m.json", "short_recipe", &[&[]]);
}

/// The tiny checkpoints (a directory each, loaded as it is): Gemma 3's with an 8-token window on a
/// 30-token prompt, whole and chunked; Llama's on 20 tokens, chunked (whole Llama prompts are in the serve
/// test).
#[test]
fn the_tiny_checkpoints_through_torch_equal_the_references() {
    let runs: [(&str, &str, &[&[&str]]); 2] = [
        ("tiny_gemma3_8l", "tiny_gemma3_8l_30", &[&[], &["--prefill-chunk", "7"]]),
        ("tiny_llama_4l", "tiny_llama_4l_20", &[&["--prefill-chunk", "6"]]),
    ];
    for (name, case, chunkings) in runs {
        let dir = reference_dir().join(name);
        let reference = json_file(&dir.join("reference.json"));
        let case = reference["cases"].as_array().unwrap().iter().find(|c| c["name"] == case).unwrap();
        let prompt = ids(&case["prompt_ids"]).iter().map(u64::to_string).collect::<Vec<_>>().join(",");
        let want = ids(&case["output_ids"]).len();
        for extra in chunkings {
            let v = torch_generate(dir.to_str().unwrap(), &["--prompt-ids", &prompt], want, extra);
            assert_agrees(case, &v, &format!("{name} {extra:?}"));
        }
    }
}

/// A copy of a checkpoint with one weight changed has the same shape, so every geometry check passes; the
/// backend's model identity names other weights, and the host refuses it before any request.
#[test]
fn a_checkpoint_with_other_weights_is_refused_at_the_handshake() {
    let dir = std::env::temp_dir().join(format!("pdhost-torch-other-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let original = reference_dir().join("tiny_llama_4l");
    for name in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(original.join(name), dir.join(name)).unwrap();
    }
    let weights = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let last = bytes.len() - 2; // inside the last tensor's data: an f32's upper bits
    bytes[last] ^= 0x01;
    std::fs::write(&weights, bytes).unwrap();

    let config = serde_json::json!({"torch_model": dir}).to_string();
    let model = original.to_str().unwrap();
    let args = ["generate", "--model", model, "--prompt-ids", "1,12,168,176", "--max-tokens", "2", "--json"];
    let out = pdhost(&[&args[..], &["--producer", "torch", "--backend-config", &config]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let prefill = &v["prefill"];
    assert_eq!((&prefill["where"], &prefill["fallback_kind"]), (&"local".into(), &"identity_mismatch".into()), "{v}");
    let reason = prefill["fallback_reason"].as_str().unwrap();
    assert!(reason.contains("weights") && reason.contains("expected") && reason.contains("found"), "{reason}");
    assert_eq!(prefill["producer_metrics"]["starts"], 1, "refused once, not restarted: {prefill}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The conformance kit passes for torch: handshake, spans, K/V close to local prefill, greedy agreement,
/// a kill at a deadline and a restarted backend (which loads its model again).
#[test]
fn check_backend_passes_for_torch() {
    let model = reference_dir().join("tiny_gemma3_8l");
    let out = pdhost(&["check-backend", "torch", "--model", model.to_str().unwrap(), "--json"]);
    let report: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: stderr {}", String::from_utf8_lossy(&out.stderr)));
    for c in report["checks"].as_array().unwrap() {
        assert_eq!(c["ok"], true, "{}: {}", c["name"], c["detail"]);
    }
    assert!(out.status.success(), "{report}");
    let layers = report["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 8, "{report}");
    assert!(layers.iter().all(|l| l["rel_l2"].as_f64().unwrap() < 1e-4), "{report}");
}

/// `pdhost serve --producer torch` answers a completion with exactly what `generate --producer torch`
/// decodes for the same prompt: the same ids and bit-identical logits (the same K/V, from the same torch
/// at the same thread count), streamed or not, with two requests in flight at once; a prefix-cache hit
/// is prefilled by torch too. The real SmolLM2, whose GGUF K the backend permutes into the host's rope
/// order.
#[test]
fn serve_with_torch_equals_generate_with_torch() {
    use std::io::{BufRead, BufReader};

    // A served model needs a tokenizer (requests may carry text): the real SmolLM2, with token-id prompts.
    let model = "smollm2-135m";
    let prompts = [vec![1u64, 504, 3458, 282, 4649, 314, 2], vec![1, 1780, 253, 13660, 281, 5010, 30, 549, 4286, 314]];
    let torch_alone = |p: &[u64]| {
        let ids = p.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
        torch_generate(model, &["--prompt-ids", &ids], 12, &["--threads", "2"])
    };
    let alone: Vec<Value> = prompts.iter().map(|p| torch_alone(p)).collect();

    let child = Command::new(PDHOST)
        .args(["serve", "--model", model, "--port", "0", "--producer", "torch", "--threads", "2", "--slots", "2"])
        .args(["--prefix-cache", "on", "--page-size", "16"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    // Killed however the test ends, so that no server outlives it.
    let mut child = KilledOnDrop(child);
    BufReader::new(child.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let mut stderr = child.0.stderr.take().unwrap();
    let Some(url) = line.trim().strip_prefix("listening on ").map(str::to_string) else {
        let mut log = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut log);
        panic!("first line {line:?}; stderr {log}");
    };
    // Drained so that the server never blocks on a full pipe.
    std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(std::time::Duration::from_secs(120)))
        .build()
        .into();
    let answers: Vec<(Value, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let (agent, url) = (&agent, &url);
                s.spawn(move || {
                    let body = |stream: bool| {
                        serde_json::json!({"model": model, "prompt": p, "max_tokens": 12, "temperature": 0,
                                           "stream": stream})
                        .to_string()
                    };
                    let post = |stream: bool| {
                        let mut r = agent.post(&format!("{url}/v1/completions")).send(body(stream)).unwrap();
                        let status = r.status().as_u16();
                        let text = r.body_mut().read_to_string().unwrap();
                        assert_eq!(status, 200, "{text}");
                        text
                    };
                    let whole: Value = serde_json::from_str(&post(false)).unwrap();
                    let streamed = post(true);
                    let last = streamed
                        .lines()
                        .filter_map(|l| l.strip_prefix("data: "))
                        .filter(|d| *d != "[DONE]")
                        .map(|d| serde_json::from_str::<Value>(d).unwrap())
                        .rfind(|c| !c["pdhost"].is_null())
                        .unwrap_or_else(|| panic!("no chunk with a pdhost object: {streamed}"));
                    (whole["pdhost"].clone(), last["pdhost"].clone())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // A prefix-cache hit goes to torch too, with the prefix as context (the backend recomputes it): the
    // same 43-token prompt twice, the second time with two 16-token pages cached. Its K/V is computed in
    // other pieces than the first's, so only the ids must agree.
    let complete = |p: &[u64]| -> Value {
        let body = serde_json::json!({"model": model, "prompt": p, "max_tokens": 12, "temperature": 0});
        let mut r = agent.post(&format!("{url}/v1/completions")).send(body.to_string()).unwrap();
        let text = r.body_mut().read_to_string().unwrap();
        serde_json::from_str::<Value>(&text).unwrap()["pdhost"].clone()
    };
    let prompt: Vec<u64> = std::iter::once(1).chain(1000..1042).collect();
    let (cold, hit) = (complete(&prompt), complete(&prompt));
    drop(child);
    assert_eq!((&cold["prefix_hit_tokens"], &cold["prefill"]), (&0.into(), &"remote".into()), "{cold}");
    let what = (&hit["prefix_hit_tokens"], &hit["prefill"], &hit["producer"]);
    assert_eq!(what, (&32.into(), &"remote".into(), &"torch".into()), "{hit}");
    assert_eq!(hit["output_ids"], cold["output_ids"], "{hit}");
    for ((whole, streamed), reference) in answers.iter().zip(&alone) {
        for got in [whole, streamed] {
            assert_eq!(got["output_ids"], reference["output_ids"], "{got}");
            assert_eq!(got["logits_xxh3"], reference["logits_xxh3"], "logits bit-identical to generate: {got}");
            assert_eq!((&got["prefill"], &got["producer"]), (&"remote".into(), &"torch".into()), "{got}");
        }
    }
}

/// A child process killed and reaped when dropped.
struct KilledOnDrop(std::process::Child);

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
