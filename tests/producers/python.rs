//! Python backends (`plugins/python`, `--producer py:MODULE:CLASS`) through a real producer: one that
//! works, and one per way to fail, each a typed error with a correct fallback (tests/python holds them).

use std::time::Duration;

use pdhost::engine::{EngineError, OnFailure, PrefillBy, Request};

use super::*;

const PROMPT: [u32; 10] = [2, 100, 20, 30, 40, 7, 8, 9, 10, 11];

fn python(engine: &Engine, class: &str, timeout: Duration) -> Producer {
    let config = serde_json::json!({
        "python_module": "pdhost_test_backends",
        "python_class": class,
        "python_path": [root().join("tests/python")],
    });
    producer(engine, builtin("python"), config, timeout)
}

fn request() -> Request {
    Request::greedy(PROMPT.to_vec(), 4, 4)
}

#[test]
fn a_python_backend_writes_spans_in_place_whole_and_chunked() {
    let _serial = serial();
    let mut e = engine(&gemma(), Dtype::F32);
    let before = snapshot();
    for class in ["StandIn", "FillsFromThreads"] {
        let mut p = python(&e, class, Duration::from_secs(30));
        p.start().unwrap_or_else(|err| panic!("{class} start: {err}"));
        assert_eq!(p.layout(), Some("dense"));
        writes_in_place(&mut e, &mut p, class);
        drop(p);
        assert_eq!(snapshot(), before, "{class}: nothing leaked");
    }
}

fn writes_in_place(e: &mut Engine, p: &mut Producer, class: &str) {
    for chunk in [0, 3] {
        let (seq, report) = e
            .prefill(&PROMPT, chunk, PrefillBy::Remote { producer: p, on_failure: OnFailure::Fail })
            .unwrap_or_else(|err| panic!("{class}: {err}"));
        assert!(report.remote && report.fallback.is_none());
        // The stand-in's first value of layer 3 (full attention: every position is there), K, token 2
        // at position 0, head 0, dim 0.
        let (k, _) = e.kv.read(seq, 3).unwrap().to_bytes();
        let first = f32::from_le_bytes(k[..4].try_into().unwrap());
        let mut h: u64 = 1469598103934665603;
        for part in [3u64, 0, 2, 0, 0, 0] {
            h = (h ^ part).wrapping_mul(1099511628211);
        }
        assert_eq!(first, (h >> 40) as f32 / (1u32 << 23) as f32 - 1.0, "{class}: the bytes Python wrote landed");
        e.release(seq);
    }
    assert_eq!(p.metrics().spans_accepted, 1 + PROMPT.len().div_ceil(3) as u64, "{class}");
    assert_eq!(p.metrics().restarts, 0, "{class}");
    // The stand-in has no `takes_context`: its capabilities say so, and a prefix-cache hit's rest is
    // never sent to it (its requests take no hit and are prefilled from 0).
    assert_eq!(p.takes_context(), Some(false));
}

/// A class with `stage` gets a batch's calls at once: `StagesOnly` writes only what it staged, so three
/// calls sent as one batch all land (in the stand-in's values), and a call sent alone is refused.
#[test]
fn a_python_class_stages_a_batch() {
    let _serial = serial();
    let mut e = engine(&gemma(), Dtype::F32);
    let mut p = python(&e, "StagesOnly", Duration::from_secs(30));
    p.start().unwrap();
    assert!(p.described().unwrap().batches, "the python backend stages");
    let remote = pdhost::engine::Remote::of(&p);
    let prompts: Vec<Vec<u32>> = (0..3u32).map(|i| (0..5 + i).map(|t| 2 + t * 13 + i).collect()).collect();
    let reqs: Vec<Request> = prompts.iter().map(|pr| Request::greedy(pr.clone(), 1, 0)).collect();
    let mut pre: Vec<_> = reqs.iter().map(|r| e.begin(r, Some(&remote)).unwrap()).collect();
    let calls: Vec<_> = pre.iter().zip(&prompts).map(|(x, pr)| x.next_call(&pr[..pr.len() - 1]).unwrap()).collect();
    for (i, call) in calls.iter().enumerate() {
        let pending = if i == 0 { p.submit_batch(&calls) } else { p.next(call) };
        let times = p.take(pending.unwrap_or_else(|err| panic!("call {i}: {err}")), &mut e.kv, pre[i].seq()).unwrap();
        pre[i].remote_done(times);
    }
    assert_eq!(p.metrics().spans_accepted, 3);
    for x in pre {
        p.release(x.request_id());
        e.abandon(x);
    }
    let alone = e.prefill(&PROMPT, 0, PrefillBy::Remote { producer: &mut p, on_failure: OnFailure::Fail });
    let err = alone.map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("was not staged"), "{err}");
}

/// Each failure: its kind, its text, whether the producer was replaced, and a fallback equal to local.
#[test]
fn python_failures_are_typed_and_fall_back() {
    let _serial = serial();
    let reference = engine(&gemma(), Dtype::F32).generate(&request(), |_| {}).unwrap().output;
    let cases: [(&str, &str, &str, u64); 8] = [
        ("Raises", "backend_error", "ValueError: the device is not there (at ", 0),
        // Its traceback's frames hold a region's view: dropped with the exception, not counted as kept.
        ("RaisesAfterWriting", "backend_error", "ValueError: failed after writing (at ", 0),
        ("Hangs", "timeout", "no answer within", 1),
        ("WrongShape", "describe_mismatch", "expected sliding window 8 with 1 KV head of size 16, found", 0),
        ("MissingWindow", "start_failed", "layer 0 (sliding): expected a \"window\", found none", 0),
        ("ShortWrite", "unwritten_region", "layer 7 V (entry 15 of 16) written only in part", 0),
        ("KeepsAView", "backend_panic", "view of region(s) 0 still alive", 1),
        // What `torch.frombuffer` keeps: the view object, its export released, the address taken.
        ("KeepsAnAddress", "backend_panic", "view of region(s) 0 still alive", 1),
    ];
    for (class, kind, text, restarts) in cases {
        let mut e = engine(&gemma(), Dtype::F32);
        let before = snapshot();
        let mut p = python(&e, class, Duration::from_millis(1500));
        let by = PrefillBy::Remote { producer: &mut p, on_failure: OnFailure::Fallback };
        let gen = e.generate_with(&request(), by, |_| {}).unwrap_or_else(|err| panic!("{class}: {err}"));
        let reason = gen.report.fallback.as_ref().unwrap_or_else(|| panic!("{class}: expected a fallback"));
        assert_eq!(reason.kind(), kind, "{class}: {reason}");
        assert!(reason.to_string().contains(text) && !reason.to_string().contains('\n'), "{class}: {reason}");
        assert_eq!(gen.output, reference, "{class}: the fallback equals local prefill");
        // With `fail`, the same reason ends the request.
        let by = PrefillBy::Remote { producer: &mut p, on_failure: OnFailure::Fail };
        match e.generate_with(&request(), by, |_| {}) {
            Err(EngineError::Producer(err)) => assert_eq!(err.kind(), kind, "{class}: {err}"),
            other => panic!("{class}: expected {kind}, found {:?}", other.map(|g| g.output)),
        }
        let m = p.metrics();
        assert_eq!(m.restarts.min(1), restarts, "{class}: restarts {}", m.restarts);
        if kind == "describe_mismatch" {
            assert_eq!(m.starts, 1, "{class}: not started again");
        }
        drop(p);
        assert_eq!(snapshot(), before, "{class}: nothing leaked");
    }
}

/// A class that keeps a region (a view's `.obj`) past its call and views it again in the next call (the
/// request's next chunk) gets a `BufferError` there: a region exports nothing once its call has returned
/// (it gave a new view of the old slot, which the host may be reading, or another call writing, by then).
#[test]
fn a_region_kept_past_its_call_gives_no_view_after_it() {
    let _serial = serial();
    let reference = engine(&gemma(), Dtype::F32).generate(&request(), |_| {}).unwrap().output;
    let mut e = engine(&gemma(), Dtype::F32);
    let mut p = python(&e, "KeepsTheRegion", Duration::from_secs(30));
    assert!(request().prefill_chunk < PROMPT.len() - 1, "more than one call");
    let gen = e
        .generate_with(&request(), PrefillBy::Remote { producer: &mut p, on_failure: OnFailure::Fallback }, |_| {})
        .unwrap();
    let reason = gen.report.fallback.expect("the second call views the first call's region");
    assert_eq!(reason.kind(), "backend_error", "{reason}");
    assert!(reason.to_string().contains("BufferError: a region is only valid during the prefill call"), "{reason}");
    assert_eq!(gen.output, reference, "the fallback equals local prefill");
}

#[test]
fn a_missing_python_class_is_a_config_error_that_is_not_retried() {
    let _serial = serial();
    let mut e = engine(&gemma(), Dtype::F32);
    let mut p = python(&e, "NoSuchClass", Duration::from_secs(30));
    let err = p.start().expect_err("no class");
    assert!(err.to_string().contains("bad_config: pdhost_test_backends: expected a class NoSuchClass"), "{err}");
    let again = e.prefill(&PROMPT, 0, PrefillBy::Remote { producer: &mut p, on_failure: OnFailure::Fail });
    assert!(matches!(again, Err(EngineError::Producer(ref e)) if e.kind() == "start_failed"));
    assert_eq!(p.metrics().starts, 1);
    // So is a config the class cannot use: its `open` raises `KeyError`, as it would on every start.
    let mut p = python(&e, "NeedsAKey", Duration::from_secs(30));
    let err = p.start().expect_err("no such key");
    assert!(err.to_string().contains("bad_config: open: KeyError: 'device_index'"), "{err}");
    let again = e.prefill(&PROMPT, 0, PrefillBy::Remote { producer: &mut p, on_failure: OnFailure::Fail });
    assert!(matches!(again, Err(EngineError::Producer(ref e)) if e.kind() == "start_failed"), "not retried");
    assert_eq!(p.metrics().starts, 1);
}
