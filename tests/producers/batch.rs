//! Batches: the chunks of several requests sent to one producer at once, computed in one pass by a
//! backend that stages them (ABI 1.3), and streamed through a ring with fewer slots than the batch.

use std::time::Duration;

use pdhost::engine::{Generation, Prefilling, Remote, Request};
use pdhost_producer::protocol::PrefillCall;

use super::*;

/// Three prompts of different lengths.
fn prompts() -> Vec<Vec<u32>> {
    [9u32, 13, 6]
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|t| 2 + (t * 31 + i as u32 * 57) % 200).collect())
        .collect()
}

fn request(prompt: &[u32]) -> Request {
    Request::greedy(prompt.to_vec(), 6, 0)
}

/// Each request's first call (its whole prompt, less the last token).
fn first_calls(pre: &[Prefilling], prompts: &[Vec<u32>]) -> Vec<PrefillCall> {
    pre.iter().zip(prompts).map(|(p, prompt)| p.next_call(&prompt[..prompt.len() - 1]).expect("a chunk")).collect()
}

/// Decodes a prefilled request to its end.
fn decode(e: &mut Engine, p: Prefilling, prompt: &[u32]) -> Generation {
    let mut live = e.go_live(p, &request(prompt));
    while e.step(&mut live).expect("a step").is_some() {}
    e.finish(live)
}

/// Three requests' chunks go to the producer as one batch, more than its ring's two slots: each span is
/// taken as its reply comes (the producer writes the third once the host took the first), the backend
/// computed the three in one pass, and every request decodes to exactly what it generates alone, its
/// logits bits included.
#[test]
fn a_batch_longer_than_the_ring_streams_through_it_and_changes_no_bit() {
    let _serial = serial();
    let model = gemma();
    let prompts = prompts();
    let want: Vec<Generation> =
        prompts.iter().map(|p| engine(&model, Dtype::F32).generate(&request(p), |_| {}).unwrap()).collect();
    let mut e = engine(&model, Dtype::F32);
    let mut p =
        producer(&e, builtin("rngd"), config(&model, Dtype::F32, serde_json::json!({})), Duration::from_secs(30));
    p.start().unwrap();
    assert!(p.described().unwrap().batches, "rngd stages batches");
    let remote = Remote::of(&p);
    let mut pre: Vec<Prefilling> = prompts.iter().map(|pr| e.begin(&request(pr), Some(&remote)).unwrap()).collect();
    let calls = first_calls(&pre, &prompts);
    for (i, call) in calls.iter().enumerate() {
        let pending = if i == 0 { p.submit_batch(&calls) } else { p.next(call) };
        let times = p.take(pending.unwrap_or_else(|e| panic!("call {i}: {e}")), &mut e.kv, pre[i].seq()).unwrap();
        pre[i].remote_by(&p);
        pre[i].remote_done(times);
    }
    for (i, (pre, prompt)) in pre.into_iter().zip(&prompts).enumerate() {
        assert!(pre.next_chunk(&prompt[..prompt.len() - 1]).is_none(), "request {i} prefilled whole");
        p.release(pre.request_id());
        let got = decode(&mut e, pre, prompt);
        assert!(got.report.remote, "request {i}");
        assert_eq!(got.output, want[i].output, "request {i}");
        assert_eq!(got.logits_hash, want[i].logits_hash, "request {i}: bit-identical logits");
    }
    assert_eq!(p.metrics().spans_accepted, 3);
    assert_eq!(p.metrics().starts, 1);
}

/// A producer that crashes on the second call of a batch fails that call, and the third, which it never
/// answered, with a reason naming the second's failure; the first's span is in the cache, the others'
/// sequences are as they were (empty), and the next request, on a restarted producer, succeeds.
#[test]
fn a_crash_inside_a_batch_fails_the_calls_it_left_unanswered() {
    let _serial = serial();
    let model = gemma();
    let prompts = prompts();
    let mut e = engine(&model, Dtype::F32);
    let first = e.next_request_id();
    let c = config(&model, Dtype::F32, serde_json::json!({"fault": "kill_before", "on_requests": [first + 1]}));
    let mut p = producer(&e, builtin("faulty"), c, Duration::from_secs(30));
    let remote = Remote { name: "faulty".into(), hits: None, max_tokens: None };
    let mut pre: Vec<Prefilling> = prompts.iter().map(|pr| e.begin(&request(pr), Some(&remote)).unwrap()).collect();
    let calls = first_calls(&pre, &prompts);
    let before = e.kv.state_hash();
    let pending = p.submit_batch(&calls).expect("the first call's span");
    let times = p.take(pending, &mut e.kv, pre[0].seq()).unwrap();
    pre[0].remote_done(times);
    assert_ne!(e.kv.state_hash(), before, "the first span is in the cache");
    let after_first = e.kv.state_hash();
    let second = p.next(&calls[1]).unwrap_err();
    assert_eq!(second.kind(), "producer_exited", "{second}");
    let third = p.next(&calls[2]).unwrap_err();
    assert_eq!(third.kind(), "batch_broken", "{third}");
    let text = third.to_string();
    assert!(text.contains(&format!("request {}", calls[2].request_id)) && text.contains("exited"), "{text}");
    assert_eq!(e.kv.state_hash(), after_first, "nothing of the unanswered calls landed");
    assert_eq!(p.metrics().spans_rejected.get("batch_broken"), Some(&1));
    // The next request starts a new process and is prefilled by it.
    let last = &prompts[2];
    let mut again = e.begin(&request(last), Some(&remote)).unwrap();
    let call = again.next_call(&last[..last.len() - 1]).unwrap();
    let times = p.prefill(&mut e.kv, again.seq(), &call).expect("a restarted producer prefills");
    again.remote_done(times);
    assert_eq!(p.metrics().restarts, 1);
}
