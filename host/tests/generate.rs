//! `pdhost generate` against transformers' references: every K/V byte goes through the paged cache, and
//! prefill in the `rngd` (dense) and `gpu` (grouped) producer subprocesses gives exactly the output ids and
//! the bit-identical logits of `--producer local`.

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

/// Runs one generation with each producer and checks that the remote runs equal the local one: the same
/// output ids and bit-identical logits (the cache is f32 unless `extra` says otherwise), prefilled
/// remotely with the producer's layout. Returns the local run.
fn generate_everywhere(model: &str, prompt: &[u64], max: usize, extra: &[&str]) -> serde_json::Value {
    let local = generate(model, prompt, max, &[extra, &["--producer", "local"]].concat());
    assert_eq!(local["prefill"]["where"], "local");
    for (producer, layout) in [("rngd", "dense"), ("gpu", "grouped")] {
        let remote = generate(model, prompt, max, &[extra, &["--producer", producer]].concat());
        let what = format!("{model} {producer} {extra:?}");
        assert_eq!(remote["output_ids"], local["output_ids"], "{what}: output ids equal --producer local");
        assert_eq!(remote["logits_xxh3"], local["logits_xxh3"], "{what}: logits bit-identical to local");
        if prompt.len() > 1 {
            assert_eq!(remote["prefill"]["where"], "remote", "{what}");
            assert_eq!(remote["prefill"]["layout"], layout, "{what}");
            assert_eq!(remote["prefill"]["fallback_reason"], serde_json::Value::Null, "{what}");
        }
    }
    local
}

/// Checks output ids against a reference file up to each case's first near-tie, for several chunkings
/// and page sizes, through every producer: the answer may not depend on how prefill is split into spans
/// or who computes it.
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
            let out = generate_everywhere(model, &prompt, want.len(), extra);
            let got = ids(&out["output_ids"]);
            assert_eq!(&got[..stop.min(got.len())], &want[..stop], "{model} {} {extra:?}", case["name"]);
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

/// Both real models on every reference prompt, tokenized from text by pdhost (two prompts are longer than
/// Gemma's 512-token window; Gemma's are prefilled in 200-token spans at nonzero offsets, so its sliding
/// groups page through the window): output ids equal transformers' up to each case's first near-tie, and
/// on the 744-token prompt the `rngd` and `gpu` producers give exactly the local output ids and logits.
#[test]
fn both_real_models_match_transformers_on_every_reference_prompt() {
    let prompts: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(reference_dir().join("prompts.json")).unwrap()).unwrap();
    for (model, file, extra) in [
        ("gemma3-270m", "greedy_gemma3_270m.json", &["--prefill-chunk", "200"][..]),
        ("smollm2-135m", "greedy_smollm2_135m.json", &[][..]),
    ] {
        let reference: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(reference_dir().join(file)).unwrap()).unwrap();
        for case in reference["cases"].as_array().unwrap() {
            let text = prompts.as_array().unwrap().iter().find(|p| p["name"] == case["name"]).unwrap()["text"]
                .as_str()
                .unwrap();
            let want = ids(&case["output_ids"]);
            let margins: Vec<f64> = case["margins"].as_array().unwrap().iter().map(|m| m.as_f64().unwrap()).collect();
            let stop = margins.iter().position(|&m| m < 0.01).unwrap_or(want.len());
            let run = |producer: &str| {
                let max = want.len().to_string();
                let out = Command::new(PDHOST)
                    .args(["generate", "--model", model, "--prompt", text, "--max-tokens", &max, "--json"])
                    .args(["--producer", producer])
                    .args(extra)
                    .output()
                    .unwrap();
                assert!(out.status.success(), "{producer}: {}", String::from_utf8_lossy(&out.stderr));
                serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
            };
            let v = run("local");
            assert_eq!(ids(&v["prompt_ids"]), ids(&case["prompt_ids"]), "{model} {} prompt ids", case["name"]);
            let got = ids(&v["output_ids"]);
            assert_eq!(&got[..stop.min(got.len())], &want[..stop], "{model} {}", case["name"]);
            // Through the producers on the prompt that crashed a PD stack (744 tokens, past the window);
            // the short ones go through them bit for bit on the tiny checkpoints, the longest only locally.
            if case["name"] != "lgpl_650w" {
                continue;
            }
            for (producer, layout) in [("rngd", "dense"), ("gpu", "grouped")] {
                let r = run(producer);
                let what = format!("{model} {} {producer}", case["name"]);
                assert_eq!(
                    (&r["prefill"]["where"], &r["prefill"]["layout"]),
                    (&"remote".into(), &layout.into()),
                    "{what}"
                );
                assert_eq!(r["output_ids"], v["output_ids"], "{what}: output ids equal local");
                assert_eq!(r["logits_xxh3"], v["logits_xxh3"], "{what}: logits bit-identical to local");
            }
        }
    }
}

#[test]
fn a_prompt_without_a_tokenizer_or_with_bad_ids_gets_a_clear_error() {
    let dir = reference_dir().join("tiny_llama_4l");
    let out =
        Command::new(PDHOST).args(["generate", "--model", dir.to_str().unwrap(), "--prompt", "hi"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--prompt: expected --prompt-ids (this model has no tokenizer)"), "{err}");
    let out = Command::new(PDHOST)
        .args(["generate", "--model", dir.to_str().unwrap(), "--prompt-ids", "1,999"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--prompt-ids: expected token ids below") && err.contains("vocabulary size 256, found 999"),
        "{err}"
    );
}

#[test]
fn fast_precision_and_threads_run_and_report_the_same_prefill() {
    let dir = reference_dir().join("tiny_gemma3_8l");
    let dir = dir.to_str().unwrap();
    let exact = generate_everywhere(dir, &[2, 86, 171, 181], 8, &["--threads", "1"]);
    let fast = generate_everywhere(dir, &[2, 86, 171, 181], 8, &["--precision", "fast", "--threads", "2"]);
    assert_eq!(ids(&fast["output_ids"]).len(), 8);
    // Prefill is f32 in both precisions: the first token (from the prefill logits) agrees.
    assert_eq!(ids(&fast["output_ids"])[0], ids(&exact["output_ids"])[0]);
    // The memory it reports: the KV pool preallocated for the prompt and 8 tokens, the resident memory
    // once it and the weights are loaded, above the pool, and a peak at least that.
    for v in [&exact, &fast] {
        let field = |key: &str| v["memory"][key].as_u64().unwrap_or_else(|| panic!("{key}: {}", v["memory"]));
        let (kv, loaded, peak) = (field("kv_pool_bytes"), field("rss_after_load_bytes"), field("peak_rss_bytes"));
        assert!(kv > 0 && loaded > kv && peak >= loaded, "{}", v["memory"]);
    }
}

/// A checkpoint directory with a `tokenizer.json` is tokenized through the `tokenizers` crate, BOS from its
/// post-processor; a broken one is named in the error.
#[test]
fn a_checkpoint_tokenizer_json_is_used_for_prompts() {
    let src = reference_dir().join("tiny_llama_4l");
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let mut vocab = serde_json::Map::new();
    vocab.insert("<unk>".into(), 0.into());
    vocab.insert("<s>".into(), 1.into());
    for (i, w) in ["hello", "world", "again"].iter().enumerate() {
        vocab.insert((*w).into(), (90 + 10 * i).into());
    }
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false,
                          "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let model = dir.path().to_str().unwrap();
    let out = Command::new(PDHOST)
        .args(["generate", "--model", model, "--prompt", "hello world again", "--max-tokens", "3", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(ids(&v["prompt_ids"]), [1, 90, 100, 110]);
    assert!(v["text"].is_string());

    std::fs::write(dir.path().join("tokenizer.json"), "{ not json").unwrap();
    let out = Command::new(PDHOST).args(["generate", "--model", model, "--prompt", "hello"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(err.contains("tokenizer.json: expected a Hugging Face tokenizer.json"), "{err}");
}

#[test]
fn sampling_is_reproducible_from_its_seed() {
    let dir = reference_dir().join("tiny_llama_4l");
    let dir = dir.to_str().unwrap();
    let run = |seed: &str| {
        ids(&generate(dir, &[1, 90, 169], 12, &["--temperature", "1.5", "--top-p", "0.9", "--seed", seed])
            ["output_ids"])
    };
    assert_eq!(run("7"), run("7"));
    let others: Vec<Vec<u64>> = ["1", "2", "3"].iter().map(|s| run(s)).collect();
    assert!(others.iter().any(|o| *o != run("7")), "different seeds give different samples");
    // With `--top-k 1` the sample is the greedy choice, whatever the seed and temperature.
    let greedy = ids(&generate(dir, &[1, 90, 169], 12, &[])["output_ids"]);
    for seed in ["1", "2"] {
        let top1 = generate(dir, &[1, 90, 169], 12, &["--temperature", "2", "--top-k", "1", "--seed", seed]);
        assert_eq!(ids(&top1["output_ids"]), greedy, "seed {seed}");
    }
    // `--stop-token-ids`: the output ends at the first of them, included.
    let stop = greedy[3];
    let at = greedy.iter().position(|&t| t == stop).unwrap();
    let stopped = generate(dir, &[1, 90, 169], 12, &["--stop-token-ids", &stop.to_string()]);
    assert_eq!((ids(&stopped["output_ids"]), stopped["finish_reason"].as_str()), (greedy[..=at].to_vec(), Some("eos")));
    let out = Command::new(PDHOST)
        .args(["generate", "--model", dir, "--prompt-ids", "1,90", "--max-tokens", "2", "--min-tokens", "3"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--min-tokens: expected at most the reply's token limit (2), found 3"), "{err}");
    let out = Command::new(PDHOST)
        .args(["generate", "--model", dir, "--prompt-ids", "1,90", "--temperature", "1", "--min-p", "1.5"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--min-p: expected a number from 0 (no limit) to 1, found 1.5"), "{err}");
}

#[test]
fn narrower_kv_dtypes_and_zero_tokens_work() {
    let dir = reference_dir().join("tiny_gemma3_8l");
    let dir = dir.to_str().unwrap();
    for dtype in ["bf16", "f16"] {
        let out = generate_everywhere(
            dir,
            &[2, 86, 171, 181],
            6,
            &["--kv-dtype", dtype, "--prefill-chunk", "2", "--page-size", "3"],
        );
        assert_eq!(ids(&out["output_ids"]).len(), 6, "{dtype}");
        assert!(out["prefill"]["bytes"].as_u64().unwrap() > 0);
    }
    let out = generate_everywhere(dir, &[2, 86], 0, &[]);
    assert!(ids(&out["output_ids"]).is_empty());
    assert_eq!(out["finish_reason"], "length");
}

/// Checkpoints of other depths and sliding patterns (the tiny Gemma 3 weights, re-configured): 3 to 8
/// layers, windows of 2 to 5 tokens, only sliding, only full, or mixed; prompts longer than the window,
/// whole and chunked. Both producers give exactly the local output ids and logits.
#[test]
fn any_depth_and_sliding_pattern_gives_the_same_output_through_both_producers() {
    let src = reference_dir().join("tiny_gemma3_8l");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    for (pattern, window) in [("FSS", 3), ("SFSFS", 2), ("SSSSSSSS", 4), ("FFFFFF", 4), ("SSFSSSF", 5)] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(src.join("model.safetensors"), dir.path().join("model.safetensors")).unwrap();
        let mut c = config.clone();
        let types: Vec<&str> =
            pattern.chars().map(|l| if l == 'S' { "sliding_attention" } else { "full_attention" }).collect();
        c["num_hidden_layers"] = pattern.len().into();
        c["layer_types"] = types.into();
        c["sliding_window"] = window.into();
        std::fs::write(dir.path().join("config.json"), c.to_string()).unwrap();
        let model = dir.path().to_str().unwrap();
        let prompt = [2, 86, 171, 181, 9, 45, 200, 13, 77, 150, 3, 99];
        for extra in [&[][..], &["--prefill-chunk", "3", "--page-size", "2"][..]] {
            let out = generate_everywhere(model, &prompt, 6, extra);
            assert_eq!(ids(&out["output_ids"]).len(), 6, "{pattern} {extra:?}");
        }
    }
}

/// Prefill is chunk-invariant: whole or in chunks, with an f32 or a bf16 cache, locally or in either
/// producer, the output ids and the logits bits are the same. The tiny Gemma 3's chunks cross its
/// 8-token window; Gemma 3 270M runs a real prompt. By default the host prefills in pieces of 256
/// tokens (also where a producer failed) and a producer in spans of up to 2048, with the whole prompt's
/// bits.
#[test]
fn every_chunking_gives_the_same_logits_bits() {
    let tiny = reference_dir().join("tiny_gemma3_8l");
    let tiny_prompt: Vec<u64> = (0..30).map(|i| (i * 37 + 5) % 256).collect();
    let real_prompt: Vec<u64> = (0..40).map(|i| 1000 + i * 997 % 50000).collect();
    for (model, prompt, chunks) in
        [(tiny.to_str().unwrap(), &tiny_prompt, &["1", "7", "9"][..]), ("gemma3-270m", &real_prompt, &["7"][..])]
    {
        for dtype in ["f32", "bf16"] {
            let whole = generate_everywhere(model, prompt, 4, &["--kv-dtype", dtype, "--prefill-chunk", "0"]);
            for chunk in chunks {
                let out = generate_everywhere(model, prompt, 4, &["--kv-dtype", dtype, "--prefill-chunk", chunk]);
                assert_eq!(out["output_ids"], whole["output_ids"], "{model} {dtype} chunks of {chunk}");
                assert_eq!(out["logits_xxh3"], whole["logits_xxh3"], "{model} {dtype} chunks of {chunk}: logits bits");
            }
        }
    }
    let long: Vec<u64> = (0..600).map(|i| (i * 37 + 5) % 256).collect();
    let tiny = tiny.to_str().unwrap();
    let whole = generate(tiny, &long, 2, &["--producer", "local", "--prefill-chunk", "0"]);
    // A producer's prefill that fails (a bad checksum on its span), or one that cannot start (its `open`
    // outlasts `--producer-timeout`), falls back to the host's pieces, not the producer's spans.
    let bad_span = ["--backend-config", r#"{"fault":"bad_checksum"}"#];
    let no_start = ["--producer-timeout", "1", "--backend-config", r#"{"open_delay_ms":3000}"#];
    for (producer, extra, spans) in
        [("local", &[][..], 3), ("rngd", &[][..], 1), ("faulty", &bad_span[..], 3), ("faulty", &no_start[..], 3)]
    {
        let v = generate(tiny, &long, 2, &[&["--producer", producer][..], extra].concat());
        // The last prompt token is the first decode step's: 599 tokens to prefill.
        assert_eq!(v["prefill"]["spans"], spans, "{producer} {extra:?}: {}", v["prefill"]);
        let fell_back = producer == "faulty";
        assert_eq!(v["prefill"]["fallback_reason"].is_string(), fell_back, "{producer} {extra:?}: {}", v["prefill"]);
        assert_eq!(v["logits_xxh3"], whole["logits_xxh3"], "{producer} {extra:?}: the whole prompt's logits bits");
    }
}
