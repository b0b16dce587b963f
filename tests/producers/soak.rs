//! 200 requests through one supervised faulty producer, faults interleaved at random from a fixed seed:
//! every request completes (by fallback where its prefill failed) with the local output, and descriptors
//! and memory do not grow.

use std::time::Duration;

use pdhost::engine::{OnFailure, PrefillBy, Request};

use super::*;

#[test]
fn soak_200_requests_with_random_faults() {
    let _serial = serial();
    let dtype = Dtype::Bf16;
    let requests: Vec<Request> = (0..200u32)
        .map(|i| Request::greedy((0..5 + i % 11).map(|t| 2 + (t * 7 + i) % 250).collect(), 3, (i % 3) as usize * 3))
        .collect();
    let mut local = engine(&gemma(), dtype);
    let expected: Vec<Vec<u32>> = requests.iter().map(|r| local.generate(r, |_| {}).unwrap().output).collect();

    let mut e = engine(&gemma(), dtype);
    let before = snapshot();
    let faulty =
        config(&gemma(), dtype, serde_json::json!({"fault": "random", "seed": 7, "rate": 0.25, "delay_ms": 10_000}));
    // A deadline that `slow` (10 s) and `hang` pass, and that a healthy request on a loaded machine does not.
    let mut p = producer(&e, builtin("faulty"), faulty, Duration::from_millis(3000));
    let (mut remote, mut fallbacks) = (0, 0);
    let (mut fds_warm, mut rss_warm) = (0, 0);
    for (i, request) in requests.iter().enumerate() {
        let id = e.next_request_id();
        let gen = e
            .generate_with(request, PrefillBy::Remote { producer: &mut p, on_failure: OnFailure::Fallback }, |_| {})
            .unwrap_or_else(|err| panic!("request {i} must complete: {err}"));
        assert_eq!(gen.output, expected[i], "request {i} (id {id}): output equals local");
        match &gen.report.fallback {
            None => remote += 1,
            Some(reason) => {
                fallbacks += 1;
                assert!(!reason.to_string().is_empty() && !reason.to_string().contains('\n'));
                // A request right after a failure may find the producer backing off; any other fallback
                // must come from a fault injected into this very request.
                let mode = pdhost_backend_faulty::random_mode(7, 0.25, id);
                assert!(
                    mode.is_some() || reason.kind() == "backing_off",
                    "request {i}: fell back ({reason}) without an injected fault"
                );
            }
        }
        if i == 19 {
            (fds_warm, rss_warm) = (snapshot().fds.len(), rss());
        }
    }
    let (fds_end, rss_end) = (snapshot().fds.len(), rss());
    eprintln!(
        "soak: {remote} remote, {fallbacks} fallbacks, {} restarts; fds {fds_warm} -> {fds_end}; rss {} -> {} MiB",
        p.metrics().restarts,
        rss_warm >> 20,
        rss_end >> 20
    );
    assert!(fallbacks >= 20 && remote >= 100, "the seed interleaves faults and successes");
    assert_eq!(fds_end, fds_warm, "descriptors do not grow");
    assert!(rss_end < rss_warm + (32 << 20), "memory does not grow: {rss_warm} -> {rss_end} bytes");
    drop(p);
    assert_eq!(snapshot(), before, "nothing left behind after 200 requests");
}
