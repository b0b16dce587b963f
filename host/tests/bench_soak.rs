//! `pdhost bench soak`, the bounded version: 100 requests through a server whose `faulty` producer fails
//! a quarter of its prefills at random beside a real `rngd` one, with producers killed and stopped from
//! outside, disconnecting clients and malformed requests. Nothing is lost, every completed response equals its reference, the
//! resources stay flat, and the SIGTERM drain leaves nothing behind.

use std::process::{Command, Stdio};

use serde_json::Value;

const PDHOST: &str = env!("CARGO_BIN_EXE_pdhost");

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("expected a count, found {v}"))
}

#[test]
fn a_hundred_requests_under_faults_lose_nothing() {
    let out = Command::new(PDHOST)
        .args(["bench", "soak", "--requests", "100", "--concurrency", "8", "--max-tokens", "8"])
        .args(["--kill-every", "4", "--threads", "2", "--json"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: stdout {}, stderr {stderr}", String::from_utf8_lossy(&out.stdout)));
    assert!(out.status.success(), "status {}: {v:#}", out.status);
    assert_eq!(v["ok"], true, "{v:#}");
    assert_eq!((n(&v["lost"]), n(&v["server_lost"]), n(&v["unequal"])), (0, 0, 0), "{v:#}");
    // The mix is a function of the seed: some of every kind.
    assert!(n(&v["completed"]) >= 50 && n(&v["cancelled"]) > 0, "{v:#}");
    assert!(n(&v["bad"]["rejected"]) > 0 && n(&v["bad"]["answered_otherwise"]) == 0, "{v:#}");
    assert!(n(&v["prefill"]["remote"]) > 0, "some prefills ran in the producers: {v:#}");
    assert!(v["server"]["producer_restarts"].as_f64().is_some_and(|r| r > 0.0), "{v:#}");
    assert_eq!(n(&v["external"]["sigstop"]), 1, "{v:#}");
    assert_eq!(v["resources"]["flat"], true, "{v:#}");
    assert_eq!((v["drain"]["ok"].as_bool(), n(&v["drain"]["producers_left"])), (Some(true), 0), "{v:#}");
}
