//! `pdhost generate --producer ...` as a user runs it: fault reasons in `--json`, `fail` as a one-line
//! error, clear errors for bad flags, and a producer that dies with its host.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const PDHOST: &str = env!("CARGO_BIN_EXE_pdhost");

fn tiny() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/reference/tiny_gemma3_8l").display().to_string()
}

fn generate(extra: &[&str]) -> Output {
    Command::new(PDHOST)
        .args(["generate", "--model", &tiny(), "--prompt-ids", "2,100,20,30,40,7", "--max-tokens", "4"])
        .args(extra)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_fault_is_reported_in_json_and_fallback_equals_local() {
    let local = json(&generate(&["--producer", "local", "--json"]));
    let out = json(&generate(&["--producer", "faulty", "--json", "--backend-config", r#"{"fault":"bad_checksum"}"#]));
    assert_eq!(out["output_ids"], local["output_ids"]);
    assert_eq!(out["prefill"]["where"], "local");
    assert_eq!(out["prefill"]["fallback_kind"], "checksum_mismatch");
    let reason = out["prefill"]["fallback_reason"].as_str().unwrap();
    assert!(reason.starts_with("checksum_mismatch: producer faulty"), "{reason}");
    assert_eq!(out["prefill"]["producer_metrics"]["spans_rejected"]["checksum_mismatch"], 1);

    // Without --json: the text, a warning naming the reason, and the summary line.
    let out = generate(&["--producer", "faulty", "--backend-config", r#"{"fault":"segv_mid","layout":"grouped"}"#]);
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("warning: remote prefill failed, prefilled locally instead: producer_exited"), "{err}");
    assert!(err.contains("SIGSEGV") && err.contains("prefill local"), "{err}");
}

/// A producer whose start fails in a way worth retrying (here `open` outlasts `--producer-timeout`) costs
/// the request its remote prefill, and the request is told that failure: not the backoff that follows it.
#[test]
fn a_failed_start_is_the_fallback_reason() {
    let local = json(&generate(&["--producer", "local", "--json"]));
    let out = json(&generate(&[
        "--producer",
        "faulty",
        "--producer-timeout",
        "1",
        "--json",
        "--backend-config",
        r#"{"open_delay_ms":3000}"#,
    ]));
    assert_eq!(out["output_ids"], local["output_ids"]);
    assert_eq!((&out["prefill"]["where"], &out["prefill"]["fallback_kind"]), (&"local".into(), &"timeout".into()));
    let reason = out["prefill"]["fallback_reason"].as_str().unwrap();
    assert!(reason.starts_with("timeout: producer faulty"), "{reason}");
}

#[test]
fn fail_policy_ends_the_request_with_one_line() {
    let out = generate(&[
        "--producer",
        "faulty",
        "--on-producer-failure",
        "fail",
        "--backend-config",
        r#"{"fault":"wrong_layer_count","layout":"grouped"}"#,
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("error: remote prefill failed (group_kind_mismatch): producer faulty"), "{err}");
}

#[test]
fn bad_producer_flags_get_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let text_so = dir.path().join("notes.so");
    std::fs::write(&text_so, "# not a library\n").unwrap();
    let text_so = text_so.to_str().unwrap();
    let not_elf = format!(
        "--producer: expected a backend library (an ELF shared object), found {text_so}: a file starting with \"# no\""
    );
    for (args, text) in [
        (&["--producer", text_so][..], not_elf.as_str()),
        (
            &["--backend-config", r#"{"precision":"bogus"}"#][..],
            r#"--backend-config: expected "precision" one of exact, fast, found "precision": "bogus""#,
        ),
        (&["--backend-config", r#"{"dtype":7}"#][..], r#"--backend-config: expected "dtype" one of f32, bf16, f16, found "dtype": 7"#),
        (
            &["--producer", "nosuch"][..],
            "--producer: expected local, rngd, gpu, faulty, torch, py:MODULE:CLASS, a PATH.so or nixl://HOST:PORT/NAME, found \"nosuch\"",
        ),
        (
            &["--producer", "py:no-module"][..],
            "--producer: expected py:MODULE:CLASS (a Python module path and a class in it), found \"py:no-module\"",
        ),
        (
            &["--producer", "/nonexistent/lib.so"][..],
            "expected a backend library file, found /nonexistent/lib.so: nothing there",
        ),
        (&["--backend-config", "{not json"][..], "--backend-config: expected a JSON object"),
        (&["--backend-config", "[1]"][..], "--backend-config: expected a JSON object, found an array"),
        (&["--producer-timeout", "0"][..], "--producer-timeout: expected seconds above 0 and at most 3600, found 0"),
    ] {
        let out = generate(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(text) && err.lines().count() == 1, "{args:?}: {err}");
    }
}

fn children_of(pid: u32) -> Vec<u32> {
    let children = pdhost_producer::procfs::children_of(pid as i32).unwrap();
    children.iter().map(|c| c.pid as u32).collect()
}

#[test]
fn a_producer_dies_with_its_host_and_the_host_never_maps_a_backend() {
    let mut host = Command::new(PDHOST)
        .args(["generate", "--model", &tiny(), "--prompt-ids", "2,100,20", "--producer", "faulty"])
        .args(["--backend-config", r#"{"fault":"hang"}"#, "--json"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let producer = loop {
        if let Some(&p) = children_of(host.id()).first() {
            // Wait until it has loaded its backend (it hangs inside prefill).
            let maps = std::fs::read_to_string(format!("/proc/{p}/maps")).unwrap_or_default();
            if maps.contains("libpdhost_backend_faulty.so") {
                break p;
            }
        }
        assert!(Instant::now() < deadline, "no producer appeared");
        std::thread::sleep(Duration::from_millis(20));
    };
    let host_maps = std::fs::read_to_string(format!("/proc/{}/maps", host.id())).unwrap();
    assert!(!host_maps.contains("libpdhost_backend_"), "the host maps no backend library");
    let status = std::fs::read_to_string(format!("/proc/{producer}/status")).unwrap();
    assert!(status.lines().any(|l| l.starts_with("NoNewPrivs:") && l.ends_with('1')));
    host.kill().unwrap();
    host.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::path::Path::new(&format!("/proc/{producer}")).exists() {
        // It is reparented on its parent's death and killed by PR_SET_PDEATHSIG; once reaped it is gone.
        let stat = std::fs::read_to_string(format!("/proc/{producer}/stat")).unwrap_or_default();
        if stat.rsplit_once(')').is_some_and(|(_, r)| r.trim_start().starts_with('Z')) {
            break;
        }
        assert!(Instant::now() < deadline, "producer {producer} outlived its host");
        std::thread::sleep(Duration::from_millis(20));
    }
}
