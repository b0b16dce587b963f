//! `pdhost bench serve`: the HTTP matrix against a server it starts itself, every response equal to its
//! reference, and a flag out of bounds refused in one line before anything starts.

use std::process::{Command, Stdio};

use serde_json::Value;

const PDHOST: &str = env!("CARGO_BIN_EXE_pdhost");
const MODEL: &str = "smollm2-135m";

fn fetched(name: &str) {
    let out = Command::new(PDHOST).args(["models", "fetch", name]).stdin(Stdio::null()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

fn bench(extra: &[&str]) -> std::process::Output {
    Command::new(PDHOST).args(["bench", "serve", "--model", MODEL]).args(extra).stdin(Stdio::null()).output().unwrap()
}

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("expected a count, found {v}"))
}

#[test]
fn every_cell_of_the_matrix_equals_its_reference() {
    fetched(MODEL);
    let out = bench(&[
        "--inputs",
        "16,64",
        "--outputs",
        "4",
        "--concurrency",
        "1,2",
        "--repeats",
        "1",
        "--stream",
        "both",
        "--json",
        "--context",
        "512",
        "--threads",
        "2",
        // The 64-token prompts prefill in spans of 24: several per request, each answer still equal.
        "--prefill-chunk",
        "24",
        // Sampled, with one seed: every answer still equals its reference, alone or beside another.
        "--temperature",
        "0.9",
        // Two producers of one thread: a batch of two prefills at once.
        "--producers",
        "2",
        "--backend-config",
        r#"{"threads":1}"#,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "status {}, stderr {stderr}", out.status);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("{e}: stdout {}, stderr {stderr}", String::from_utf8_lossy(&out.stdout));
    });
    assert_eq!(v["bench"], "serve");
    assert_eq!(v["prefill_chunk"], 24);
    assert_eq!((n(&v["producers"]), &v["backend_config"]), (2, &serde_json::json!({"threads": 1})));
    assert_eq!((v["temperature"].as_f64(), v["seed"].as_u64()), (Some(0.9), Some(1)));
    assert_eq!((v["model"].as_str(), v["server"].as_str(), n(&v["context"])), (Some(MODEL), Some("started"), 512));

    // 2 inputs x 1 output x 2 concurrencies x 2 stream modes, each cell 1 batch of `concurrency` requests.
    let cells = v["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 8, "{v}");
    let mut seen = std::collections::BTreeSet::new();
    for c in cells {
        let requests = n(&c["requests"]);
        assert_eq!(requests, n(&c["concurrency"]), "{c}");
        assert_eq!((n(&c["equal"]), n(&c["unequal"]), n(&c["errors"])), (requests, 0, 0), "{c}");
        assert_eq!(n(&c["remote"]) + n(&c["local"]), requests, "{c}");
        assert_eq!(n(&c["remote"]), requests, "rngd prefills every prompt: {c}");
        assert_eq!(n(&c["fallback"]), 0, "{c}");
        assert!(n(&c["output_tokens_received"]) <= 4 * requests, "{c}");
        assert!(c["ttft_ms"]["p50"].as_f64().unwrap() > 0.0, "{c}");
        assert!(c["ttft_ms"]["p99"].as_f64().unwrap() >= c["ttft_ms"]["p50"].as_f64().unwrap(), "{c}");
        assert!(c["tok_s_aggregate"].as_f64().unwrap() > 0.0, "{c}");
        if n(&c["output_tokens"]) > 1 {
            assert!(c["decode_tok_s_aggregate"].as_f64().unwrap() > 0.0, "{c}");
        }
        let stream = c["stream"].as_bool().unwrap();
        assert_eq!(c["itl_ms"].is_null(), !stream, "inter-token latency is measured on streams only: {c}");
        assert_eq!(c["ttft_source"], if stream { "client" } else { "server" });
        seen.insert((n(&c["input_tokens"]), n(&c["output_tokens"]), n(&c["concurrency"]), stream));
    }
    assert_eq!(seen.len(), 8, "every cell once: {seen:?}");

    // The totals add the cells up, and the summary line says the same numbers.
    let t = &v["totals"];
    let sum = |key: &str| cells.iter().map(|c| n(&c[key])).sum::<u64>();
    for key in ["requests", "equal", "unequal", "remote", "local", "fallback", "errors"] {
        assert_eq!(n(&t[key]), sum(key), "totals.{key}: {v}");
    }
    assert_eq!(n(&t["requests"]), 12);
    assert!(n(&t["remote"]) > 0);
    assert_eq!(
        v["summary"],
        format!(
            "{}/{} responses equal, {} remote prefills, {} local ({} fallbacks), {} errors",
            n(&t["equal"]),
            n(&t["requests"]),
            n(&t["remote"]),
            n(&t["local"]),
            n(&t["fallback"]),
            n(&t["errors"])
        )
    );
    assert_eq!(v["summary"], "12/12 responses equal, 12 remote prefills, 0 local (0 fallbacks), 0 errors");
    assert_eq!(v["problems"], serde_json::json!([]));
}

#[test]
fn a_flag_out_of_bounds_is_one_line_and_exit_2() {
    fetched(MODEL);
    for (args, says) in [
        (&["--concurrency", "1,0"][..], "error: --concurrency: expected 1 to 64, found 0"),
        (&["--repeats", "101"][..], "error: --repeats: expected 1 to 100, found 101"),
        (
            &["--context", "512", "--inputs", "16,500", "--outputs", "4,32"][..],
            "error: --inputs: expected 1 to 480 (the 512-token context less the longest output), found 500",
        ),
        (&["--url", "localhost:8080"][..], "error: --url: expected http://HOST:PORT, found localhost:8080"),
    ] {
        let out = bench(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end(), says, "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

/// `--mixed` runs its two servers (the producer's and local prefill) and reports, for each, the streams'
/// inter-token latency alone and while long prompts prefill where it says they did.
#[test]
fn mixed_measures_streams_beside_long_prompts_for_both_prefill_sites() {
    fetched(MODEL);
    let out = bench(&[
        "--mixed",
        "--streams",
        "1",
        "--long-prompts",
        "1",
        "--long-prompt",
        "300",
        "--context",
        "512",
        "--threads",
        "2",
        "--json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "status {}, stderr {stderr}", out.status);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: stderr {stderr}"));
    assert_eq!(v["bench"], "serve-mixed");
    let rows = v["rows"].as_array().unwrap();
    let producers: Vec<&str> = rows.iter().map(|r| r["producer"].as_str().unwrap()).collect();
    assert_eq!(producers, ["rngd", "local"], "{v}");
    for (r, site) in rows.iter().zip(["remote", "local"]) {
        assert_eq!(r["during"]["long_prefill"], serde_json::json!([site]), "{r}");
        assert!(n(&r["alone"]["gaps"]) > 0, "{r}");
        assert!(r["alone"]["itl_p99_ms"].as_f64().is_some(), "{r}");
        assert!(
            r["alone"]["errors"].as_array().unwrap().is_empty() && r["during"]["errors"].as_array().unwrap().is_empty(),
            "{r}"
        );
    }
}

/// A bench that is killed (its destructors never run) still takes the server it started down with it:
/// the server gets SIGTERM from the kernel, drains, and stops its producer.
#[test]
fn a_killed_bench_leaves_no_server_running() {
    fetched(MODEL);
    let mut bench = Command::new(PDHOST)
        .args(["bench", "serve", "--model", MODEL, "--inputs", "16", "--outputs", "64", "--concurrency", "1"])
        .args(["--repeats", "100", "--stream", "off", "--context", "512", "--threads", "1"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let children = |pid: i32| pdhost_producer::procfs::children_of(pid).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    // The server, once it has started its producer.
    let (server, producers) = loop {
        if let Some(server) = children(bench.id() as i32).first() {
            let producers: Vec<i32> = children(server.pid).iter().map(|c| c.pid).collect();
            if !producers.is_empty() {
                break (server.pid, producers);
            }
        }
        assert!(std::time::Instant::now() < deadline, "no server with a producer under the bench");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    bench.kill().unwrap();
    bench.wait().unwrap();
    // Whoever adopts them reaps them; a zombie waiting for that is gone too.
    for pid in std::iter::once(server).chain(producers) {
        while pdhost_producer::procfs::state(pid).is_some_and(|s| s != 'Z') {
            assert!(std::time::Instant::now() < deadline, "process {pid} still runs after its bench was killed");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}
