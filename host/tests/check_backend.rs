//! `pdhost check-backend` as a backend author runs it: it passes for the built-in backends, and fails,
//! naming the check and the reason, for a backend that writes short and for a stand-in that is no model.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const PDHOST: &str = env!("CARGO_BIN_EXE_pdhost");

fn tiny(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/reference").join(name)
}

fn check(args: &[&str]) -> (Output, serde_json::Value) {
    let out = Command::new(PDHOST).arg("check-backend").args(args).arg("--json").output().expect("run pdhost");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let report = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "{args:?}: expected one JSON object, found {stdout:?} ({e}); stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out, report)
}

/// The checks by name: (ok, detail).
fn checks(report: &serde_json::Value) -> Vec<(String, bool, String)> {
    report["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .map(|c| (c["name"].as_str().unwrap().into(), c["ok"].as_bool().unwrap(), c["detail"].as_str().unwrap().into()))
        .collect()
}

#[test]
fn the_built_in_backends_pass_every_check() {
    for (backend, model, dtype) in [("rngd", "tiny_gemma3_8l", "f32"), ("gpu", "tiny_llama_4l", "bf16")] {
        let model = tiny(model);
        let (out, report) =
            check(&[backend, "--model", model.to_str().unwrap(), "--kv-dtype", dtype, "--threads", "1"]);
        let names: Vec<String> = checks(&report)
            .into_iter()
            .map(|(n, ok, d)| {
                assert!(ok, "{backend}: {n}: {d}");
                // Both take a request's context, and were sent one; both stage batches, and were sent one.
                assert!(n != "spans" || (d.contains("as a context") && d.contains("as one batch")), "{backend}: {d}");
                n
            })
            .collect();
        assert_eq!(names, ["start", "spans", "kv", "greedy", "deadline", "timings"]);
        assert!(out.status.success() && report["ok"] == true, "{backend}: {report}");
        let layers = report["layers"].as_array().unwrap();
        assert!(!layers.is_empty() && layers.iter().all(|l| l["rel_l2"] == 0.0 && l["max_abs"] == 0.0), "{report}");
    }
}

#[test]
fn a_backend_that_writes_short_fails_the_spans_check() {
    let model = tiny("tiny_gemma3_8l");
    let config = r#"{"fault":"short_write"}"#;
    let (out, report) = check(&["faulty", "--model", model.to_str().unwrap(), "--backend-config", config]);
    assert_eq!(out.status.code(), Some(1), "{report}");
    let spans = checks(&report).into_iter().find(|(n, ..)| n == "spans").unwrap();
    assert!(!spans.1 && spans.2.contains("unwritten_region") && spans.2.contains("written only in part"), "{spans:?}");
    // The checks after it are not run against a producer whose spans failed, and are named.
    assert_eq!(checks(&report).len(), 2, "{report}");
    assert_eq!(report["not_run"], serde_json::json!(["kv", "greedy", "deadline", "timings"]), "{report}");
}

/// The C example is a stand-in, not a model: it starts, its spans are accepted and it survives a kill at a
/// deadline, but its K/V is not the model's, and the kit says so; with `--skip kv,greedy` it passes.
#[test]
fn the_c_example_conforms_but_is_no_model() {
    let dir = std::env::temp_dir().join(format!("pdhost-check-c-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lib = dir.join("libexample.so");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let status = Command::new("cc")
        .args(["-std=c11", "-O2", "-fPIC", "-shared", "-I"])
        .arg(root.join("plugins/abi/include"))
        .arg(root.join("plugins/example-c/example.c"))
        .arg("-o")
        .arg(&lib)
        .status()
        .expect("a C compiler");
    assert!(status.success());
    let model = tiny("tiny_gemma3_8l");
    let (out, report) = check(&[lib.to_str().unwrap(), "--model", model.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    for (name, ok, detail) in checks(&report) {
        match name.as_str() {
            "start" => assert!(ok && detail.contains("no model identity"), "{detail}"),
            "spans" => assert!(ok && detail.contains("no batch (the backend does not stage them)"), "{detail}"),
            "kv" => assert!(
                !ok && detail.contains("relative L2 error against local prefill: expected at most 0.01"),
                "{detail}"
            ),
            "greedy" => {}
            _ => assert!(ok, "{name}: {detail}"),
        }
    }
    // Its plumbing conforms: with the numeric checks skipped, everything else passes.
    let (out, report) = check(&[lib.to_str().unwrap(), "--model", model.to_str().unwrap(), "--skip", "kv,greedy"]);
    assert!(out.status.success() && report["ok"] == true, "{report}");
    let names: Vec<String> = checks(&report).into_iter().map(|(n, ..)| n).collect();
    assert_eq!(
        (names, &report["skipped"]),
        (
            vec!["start".into(), "spans".into(), "deadline".into(), "timings".into()],
            &serde_json::json!(["kv", "greedy"])
        )
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A backend that takes a prefix-cache hit's call but attends to the wrong context writes spans the host
/// accepts (nothing in a span can show which past its K/V attended to), and the `kv` check finds them
/// wrong.
#[test]
fn a_backend_that_forgets_its_context_fails_the_kv_check() {
    let model = tiny("tiny_gemma3_8l");
    let config = r#"{"forget_context":true}"#;
    let (out, report) = check(&["faulty", "--model", model.to_str().unwrap(), "--backend-config", config]);
    assert_eq!(out.status.code(), Some(1), "{report}");
    let checks = checks(&report);
    let find = |name: &str| checks.iter().find(|(n, ..)| n == name).unwrap_or_else(|| panic!("{name}: {report}"));
    let (_, ok, detail) = find("spans");
    assert!(*ok && detail.contains("as a context"), "{detail}");
    let (_, ok, detail) = find("kv");
    assert!(!*ok && detail.contains("relative L2 error against local prefill"), "{detail}");
}

/// A backend that takes at most 4 tokens a call gets every call within that, context calls included.
/// (`deadline` is left out: the first request after a restart goes out before the restarted producer has
/// said its limit, and is not chunked to it, a known gap in the engine.)
#[test]
fn a_backend_with_a_call_limit_gets_calls_within_it() {
    let model = tiny("tiny_gemma3_8l");
    let config = r#"{"call_limit":4}"#;
    let (out, report) =
        check(&["faulty", "--model", model.to_str().unwrap(), "--backend-config", config, "--skip", "deadline"]);
    assert!(out.status.success() && report["ok"] == true, "{report}");
    let spans = checks(&report).into_iter().find(|(n, ..)| n == "spans").expect("a spans check");
    assert!(spans.2.contains("as a context"), "{}", spans.2);
}

#[test]
fn a_bad_flag_is_a_usage_error() {
    let out = Command::new(PDHOST).args(["check-backend", "rngd", "--kv-tolerance", "-1"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--kv-tolerance: expected a finite number of at least 0, found -1"), "{err}");
}
