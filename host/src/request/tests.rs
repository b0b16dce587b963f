use super::input::{check_backend_config, model_source, read_prompt_file, ModelSource};
use super::*;

fn limits(vocab: usize, context: usize) -> Limits {
    Limits { model: "m".into(), vocab, context, operator_context: false, model_context: context }
}

fn raw(prompt: &[u32], max_tokens: u64) -> RawRequest {
    RawRequest { prompt: prompt.to_vec(), max_tokens, ..RawRequest::default() }
}

#[test]
fn prompt_and_output_must_fit_the_context_without_wrapping() {
    let l = limits(100, 32);
    assert!(check_request(&raw(&[1, 2], 30), &l).is_ok());
    let e = check_request(&raw(&[1, 2], 31), &l).unwrap_err();
    assert_eq!(e.field, Field::MaxTokens);
    assert_eq!(
        e.to_string(),
        "--max-tokens: expected at most 30 after a 2-token prompt (m's 32-token context), found 31"
    );
    let e = check_request(&raw(&[1, 2], u64::MAX), &l).unwrap_err();
    assert!(e.to_string().ends_with(&format!("found {}", u64::MAX)), "{e}");
    let e = check_request(&raw(&[1; 33], 0), &l).unwrap_err();
    assert_eq!(e.to_string(), "--prompt: expected at most 32 tokens (m's 32-token context), found 33 tokens");
}

#[test]
fn prompt_is_nonempty_and_inside_the_vocabulary() {
    let l = limits(100, 32);
    let e = check_request(&raw(&[], 4), &l).unwrap_err();
    assert_eq!(e.to_string(), "--prompt: expected at least one token, found an empty prompt");
    let mut r = raw(&[1, 100], 4);
    r.prompt_field = Some(Field::PromptIds);
    let e = check_request(&r, &l).unwrap_err();
    assert_eq!(
        e.to_string(),
        "--prompt-ids: expected token ids below m's vocabulary size 100, found 100 at position 1"
    );
    assert_eq!(e.for_api(), "prompt: expected token ids below m's vocabulary size 100, found 100 at position 1");
}

#[test]
fn operator_context_narrows_the_model_and_is_named() {
    let config = model::arch::Config {
        arch: model::arch::Arch::Llama,
        vocab: 10,
        hidden: 8,
        ffn: 8,
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
        layers: vec![model::arch::Attention::Full],
        eps: 1e-6,
        rope_global: 1e4,
        rope_local: 1e4,
        rope_adjacent: false,
        query_scale: 0.5,
        bos: None,
        eos: vec![],
        context: 64,
    };
    assert_eq!(Limits::new("m", &config, None).unwrap().context, 64);
    let l = Limits::new("m", &config, Some(16)).unwrap();
    let e = check_request(&raw(&[1; 10], 7), &l).unwrap_err();
    assert!(e.to_string().contains("the 16-token --context"), "{e}");
    assert_eq!(
        Limits::new("m", &config, Some(65)).unwrap_err().to_string(),
        "--context: expected 1 to 64 tokens (m's context), found 65"
    );
    assert!(Limits::new("m", &config, Some(0)).is_err());
}

#[test]
fn sampling_is_finite_and_in_range() {
    let with = |temperature: Option<f64>, top_p: Option<f64>, seed: u64| {
        check_sampling(&SamplingParams { temperature, top_p, seed, ..SamplingParams::default() })
    };
    for t in [f64::NAN, -0.5, f64::INFINITY, 1e38, 101.0] {
        let e = with(Some(t), None, 0).unwrap_err();
        assert_eq!(e.field, Field::Temperature, "{t}");
    }
    for p in [f64::NAN, 0.0, -1.0, 2.0, f64::INFINITY] {
        assert_eq!(with(Some(1.0), Some(p), 0).unwrap_err().field, Field::TopP, "{p}");
    }
    for min_p in [f64::NAN, -0.1, 1.5, f64::INFINITY] {
        let e = check_sampling(&SamplingParams { temperature: Some(1.0), min_p: Some(min_p), ..Default::default() });
        assert_eq!(
            e.unwrap_err().to_string(),
            format!("--min-p: expected a number from 0 (no limit) to 1, found {}", number(min_p))
        );
    }
    assert!(matches!(with(Some(0.0), Some(1.0), 0), Ok(Sampling::Greedy)));
    assert!(matches!(with(None, None, 0), Ok(Sampling::Greedy)));
    assert!(matches!(
        with(Some(0.7), Some(0.9), 3),
        Ok(Sampling::Sample { temperature, top_k: 0, min_p: 0.0, top_p, seed: 3 }) if temperature == 0.7 && top_p == 0.9
    ));
    let all = SamplingParams { temperature: Some(1.0), top_k: Some(1 << 40), min_p: Some(0.05), top_p: None, seed: 1 };
    assert!(matches!(
        check_sampling(&all),
        Ok(Sampling::Sample { top_k: u32::MAX, min_p, top_p: 1.0, .. }) if min_p == 0.05f32
    ));
}

#[test]
fn scalar_flags_have_bounds() {
    let max = model::kernels::max_threads() as u64;
    assert!(check_threads(Some(0)).is_err());
    assert!(check_threads(Some(max + 1)).is_err());
    assert_eq!(check_threads(Some(max)).unwrap(), max as usize);
    assert_eq!(check_threads(None).unwrap(), model::kernels::available_cores());
    let l = limits(10, 100);
    assert_eq!(check_page_size(Some(100), &l).unwrap(), 100);
    assert_eq!(
        check_page_size(Some(101), &l).unwrap_err().to_string(),
        "--page-size: expected 1 to 100 tokens, found 101"
    );
    assert!(check_page_size(Some(0), &l).is_err());
    assert!(check_page_size(Some(5000), &limits(10, 1 << 20)).is_err());
    // The default: 64, or a smaller model's whole context.
    assert_eq!(check_page_size(None, &l).unwrap(), 64);
    assert_eq!(check_page_size(None, &limits(10, 16)).unwrap(), 16);
    for s in [f64::NAN, 0.0, -1.0, 1e300, f64::INFINITY, 3601.0] {
        assert!(check_timeout(Field::ProducerTimeout, s).is_err(), "{s}");
    }
    assert_eq!(check_timeout(Field::ProducerTimeout, 0.5).unwrap(), Duration::from_millis(500));
}

#[test]
fn kv_budget_matches_what_the_cache_allocates_and_never_wraps() {
    let geometry = shm_format::testing::interleaved(6, 1, 8, 1, 16);
    for (page, len, seqs) in [(4u32, 40u64, 1u32), (16, 100, 3), (1, 7, 2)] {
        let budget = kv_budget(&geometry, Dtype::Bf16, page, len, seqs).unwrap();
        let mut config = crate::kv::KvConfig::new(geometry.clone(), Dtype::Bf16, budget);
        config.page_size = page;
        config.max_seqs = seqs;
        let mut kv = crate::kv::PagedKv::new(config).expect("the budget covers the bounded groups");
        // Every sequence fits at full length, whole or a token at a time.
        for s in 0..u64::from(seqs) {
            let seq = crate::kv::SeqId(s);
            kv.add_sequence(seq, s).unwrap();
            let step = if s % 2 == 0 { len } else { 1 };
            let mut at = 0;
            while at < len {
                let end = (at + step).min(len);
                let m = shm_format::Manifest::grouped(&geometry, s, at..end, Dtype::Bf16);
                let mut staged =
                    kv.prepare(seq, &m).unwrap_or_else(|e| panic!("page {page} len {len} seq {s} at {at}: {e}"));
                kv.write_staged(&mut staged, 0, &vec![0u8; m.payload_len() as usize]);
                kv.commit(staged);
                at = end;
            }
        }
    }
    assert_eq!(kv_budget(&geometry, Dtype::F32, 1, u64::MAX, 1), None);
    assert_eq!(kv_budget(&geometry, Dtype::F32, 64, u64::MAX - 1, u32::MAX), None);
}

#[test]
fn memory_check_names_the_need() {
    let e = check_memory(Field::MaxTokens, "the KV cache", u64::MAX / 2).unwrap_err();
    assert!(e.to_string().starts_with("--max-tokens: expected the KV cache to fit in "), "{e}");
    assert!(e.to_string().contains("GiB"), "{e}");
    assert!(check_memory(Field::MaxTokens, "the KV cache", 1 << 20).is_ok());
}

#[test]
fn prompt_files_are_regular_bounded_utf8_and_nonempty() {
    let dir = tempfile::tempdir().unwrap();
    let ok = dir.path().join("ok.txt");
    std::fs::write(&ok, "hello").unwrap();
    assert_eq!(read_prompt_file(&ok).unwrap(), "hello");
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    assert!(read_prompt_file(&empty).unwrap_err().to_string().contains("an empty one"));
    let latin1 = dir.path().join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9").unwrap();
    assert_eq!(
        read_prompt_file(&latin1).unwrap_err().to_string(),
        format!("--prompt-file: expected UTF-8 text, found {}: a byte that is not UTF-8 at offset 3", latin1.display())
    );
    let big = dir.path().join("big.txt");
    std::fs::write(&big, vec![b'a'; input::MAX_PROMPT_BYTES as usize + 1]).unwrap();
    assert!(read_prompt_file(&big).unwrap_err().to_string().contains("at most 8 MiB"));
    assert!(read_prompt_file(Path::new("/dev/zero")).unwrap_err().to_string().ends_with("/dev/zero: a device"));
    assert!(read_prompt_file(dir.path()).unwrap_err().to_string().ends_with("a directory"));
    let e = read_prompt_file(&dir.path().join("missing")).unwrap_err().to_string();
    assert!(e.ends_with("missing: nothing there"), "{e}");
    // /proc files report size 0 and hold text: read them, bounded, not by their reported size.
    assert!(read_prompt_file(Path::new("/proc/self/status")).unwrap().contains("Name:"));
}

use std::path::Path;

#[test]
fn model_argument_says_what_it_found() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(model_source("gemma3-270m").unwrap(), ModelSource::Known("gemma3-270m".into()));
    let readme = dir.path().join("README.md");
    std::fs::write(&readme, "# pdhost").unwrap();
    assert!(model_source(readme.to_str().unwrap()).unwrap_err().to_string().ends_with("a file starting with \"# pd\""));
    let gguf = dir.path().join("m.gguf");
    std::fs::write(&gguf, b"GGUF\x03\x00").unwrap();
    assert_eq!(model_source(gguf.to_str().unwrap()).unwrap(), ModelSource::Gguf(gguf.clone()));
    assert!(model_source(dir.path().to_str().unwrap())
        .unwrap_err()
        .to_string()
        .ends_with("a directory without config.json"));
    assert!(model_source("/dev/null").unwrap_err().to_string().ends_with("/dev/null: a device"));
    let e = model_source("no-such-model").unwrap_err().to_string();
    assert!(e.contains("neither a known name nor a file") && e.contains("gemma3-270m"), "{e}");
    let loop_ = dir.path().join("loop");
    std::os::unix::fs::symlink(&loop_, &loop_).unwrap();
    let e = model_source(loop_.to_str().unwrap()).unwrap_err().to_string();
    assert!(e.contains("symbolic links"), "{e}");
    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert!(model_source(empty.to_str().unwrap()).unwrap_err().to_string().ends_with("empty.gguf: an empty file"));
    assert!(model_source("").is_err());
}

#[test]
fn backend_config_is_bounded_never_echoed_and_refused_for_local() {
    assert!(check_backend_config(None, "local").unwrap().is_empty());
    assert!(check_backend_config(Some("{}"), "local").unwrap_err().to_string().contains("with the local producer"));
    let deep = format!("{}{}", "[".repeat(20_000), "]".repeat(20_000));
    let e = check_backend_config(Some(&deep), "rngd").unwrap_err().to_string();
    assert!(e.len() < 200 && e.contains("nesting 20000 deep"), "{e}");
    let big = format!("{{\"a\":\"{}\"}}", "x".repeat(100_000));
    assert!(check_backend_config(Some(&big), "rngd").unwrap_err().to_string().len() < 200);
    assert!(check_backend_config(Some("[1]"), "rngd").unwrap_err().to_string().ends_with("found an array"));
    assert!(check_backend_config(Some("{\"threads\":100000}"), "rngd").is_err());
    assert!(check_backend_config(Some("{\"threads\":0}"), "rngd").is_err());
    assert!(check_backend_config(Some("{\"threads\":\"2\"}"), "rngd").is_err());
    // The other keys the host gives every backend hold what it would give.
    assert_eq!(check_backend_config(Some(r#"{"precision":"fast","dtype":"bf16"}"#), "rngd").unwrap().len(), 2);
    for bad in [r#"{"precision":"Fast"}"#, r#"{"precision":null}"#, r#"{"dtype":"float32"}"#, r#"{"dtype":16}"#] {
        let e = check_backend_config(Some(bad), "rngd").unwrap_err().to_string();
        assert!(e.contains("one of") && e.lines().count() == 1, "{bad}: {e}");
    }
    assert_eq!(check_backend_config(Some("{\"threads\":1,\"fault\":\"hang\"}"), "faulty").unwrap().len(), 2);
    let e = check_backend_config(Some("{nope"), "rngd").unwrap_err().to_string();
    assert!(
        e.starts_with(
            "--backend-config: expected a JSON object, found invalid JSON (key must be a string at line 1 column 2)"
        ),
        "{e}"
    );
}
