//! `pdhost generate` against transformers' references: every K/V byte goes through the paged cache.

use std::path::PathBuf;
use std::process::{Command, Stdio};

const PDHOST: &str = env!("CARGO_BIN_EXE_pdhost");

fn reference_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/reference")
}

fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

fn generate(model: &str, prompt: &[u64], max: usize, extra: &[&str]) -> serde_json::Value {
    let prompt = prompt.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let out = Command::new(PDHOST)
        .args(["generate", "--model", model, "--prompt-ids", &prompt, "--max-tokens", &max.to_string(), "--json"])
        .args(extra)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Checks output ids against a reference file up to each case's first near-tie, for several chunkings
/// and page sizes: the answer may not depend on how prefill is split into spans.
fn check(model: &str, reference: &str, cases: Option<&[&str]>, variants: &[&[&str]]) {
    let reference: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(reference).unwrap()).unwrap();
    for case in reference["cases"].as_array().unwrap() {
        if cases.is_some_and(|c| !c.contains(&case["name"].as_str().unwrap())) {
            continue;
        }
        let (prompt, want) = (ids(&case["prompt_ids"]), ids(&case["output_ids"]));
        let margins: Vec<f64> = case["margins"].as_array().unwrap().iter().map(|m| m.as_f64().unwrap()).collect();
        let stop = margins.iter().position(|&m| m < 0.01).unwrap_or(want.len());
        for extra in variants {
            let out = generate(model, &prompt, want.len(), extra);
            let got = ids(&out["output_ids"]);
            assert_eq!(&got[..stop.min(got.len())], &want[..stop], "{model} {} {extra:?}", case["name"]);
            assert_eq!(out["prefill"]["where"], "local");
            assert_eq!(ids(&out["prompt_ids"]), prompt);
        }
    }
}

#[test]
fn tiny_checkpoints_match_transformers_through_the_paged_cache() {
    for name in ["tiny_gemma3_8l", "tiny_llama_4l"] {
        let dir = reference_dir().join(name);
        check(
            dir.to_str().unwrap(),
            dir.join("reference.json").to_str().unwrap(),
            None,
            &[&[], &["--prefill-chunk", "5", "--page-size", "4"], &["--prefill-chunk", "1", "--page-size", "1"]],
        );
    }
}

/// A Gemma 3 270M prompt longer than the 512-token window, prefilled in spans with nonzero offsets: the
/// sliding groups keep only their window's pages, and the continuation equals transformers'.
#[test]
fn gemma3_past_the_sliding_window_matches_transformers() {
    let reference = reference_dir().join("greedy_gemma3_270m.json");
    check("gemma3-270m", reference.to_str().unwrap(), Some(&["lgpl_650w"]), &[&["--prefill-chunk", "200"]]);
}

#[test]
fn a_prompt_without_a_tokenizer_or_with_bad_ids_gets_a_clear_error() {
    let dir = reference_dir().join("tiny_llama_4l");
    let out =
        Command::new(PDHOST).args(["generate", "--model", dir.to_str().unwrap(), "--prompt", "hi"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("has no tokenizer: expected --prompt-ids"), "{err}");
    let out = Command::new(PDHOST)
        .args(["generate", "--model", dir.to_str().unwrap(), "--prompt-ids", "1,999"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("prompt id 999: expected ids below the vocabulary size 256"));
    let out = Command::new(PDHOST).args(["generate", "--prompt", "x", "--producer", "rngd"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "not built yet: a usage error");
}

#[test]
fn fast_precision_and_threads_run_and_report_the_same_prefill() {
    let dir = reference_dir().join("tiny_gemma3_8l");
    let dir = dir.to_str().unwrap();
    let exact = generate(dir, &[2, 86, 171, 181], 8, &["--threads", "1"]);
    let fast = generate(dir, &[2, 86, 171, 181], 8, &["--precision", "fast", "--threads", "2"]);
    assert_eq!(ids(&fast["output_ids"]).len(), 8);
    // Prefill is f32 in both precisions: the first token (from the prefill logits) agrees.
    assert_eq!(ids(&fast["output_ids"])[0], ids(&exact["output_ids"])[0]);
}
