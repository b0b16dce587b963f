//! The conformance suite every backend passes: it starts and describes itself through a real producer,
//! prefills (whole and chunked) into spans the host accepts, and the K/V that lands in the cache equals
//! the same backend run in-process (and, for the model-backed backends, the host's own local prefill).

use std::path::Path;
use std::time::Duration;

use pdhost::engine::{OnFailure, PrefillBy};
use pdhost::supervisor::ProducerError;
use shm_format::{decode_frame, Dtype};

use super::*;

const PROMPT: [u32; 11] = [2, 100, 20, 30, 40, 7, 8, 9, 10, 77, 5];

/// Runs the suite for one backend; `local` also compares with the host's local prefill.
fn conform(model: &Path, backend: &str, library: PathBuf, config: serde_json::Value, dtype: Dtype, local: bool) {
    let _serial = serial();
    let mut e = engine(model, dtype);
    let mut p = producer(&e, library.clone(), config.clone(), Duration::from_secs(30));
    p.start().unwrap_or_else(|err| panic!("{backend}: start: {err}"));
    let expected_layout = p.layout().expect("described");
    for chunk in [0usize, 3, 4] {
        let (remote, report) = e
            .prefill(&PROMPT, chunk, PrefillBy::Remote { producer: &mut p, on_failure: OnFailure::Fail })
            .unwrap_or_else(|err| panic!("{backend} chunk {chunk}: {err}"));
        assert!(report.remote && report.fallback.is_none(), "{backend}: prefilled remotely");
        assert_eq!(report.layout, Some(expected_layout));

        // The same calls, in this process, into private buffers: the frames must decode, and their K/V
        // must be what the host's cache holds.
        let step = if chunk == 0 { PROMPT.len() } else { chunk };
        let calls: Vec<(u64, u64, Vec<u32>)> = PROMPT
            .chunks(step)
            .enumerate()
            .map(|(i, part)| (e.next_request_id(), (i * step) as u64, part.to_vec()))
            .collect();
        let (described, frames) =
            pdhost_producer::run_in_process(&library, &config.to_string(), &calls, 1 << 20).expect("in-process run");
        assert_eq!(described.fingerprint, e.kv.fingerprint().0, "{backend}: described fingerprint");
        let (inproc, _) = e.prefill(&[], 0, PrefillBy::Local).expect("empty sequence");
        for frame in &frames {
            let span = decode_frame(frame).unwrap_or_else(|err| panic!("{backend}: in-process frame: {err}"));
            // The sequence ids differ; the request id in the frame is the one the remote run used.
            let mut m = span.manifest.clone();
            m.request_id = inproc.0;
            let payload = &frame[frame.len() - span.payload.len()..];
            let mut staged = e.kv.prepare(inproc, &m).unwrap_or_else(|err| panic!("{backend}: in-process span: {err}"));
            e.kv.write_staged(&mut staged, 0, payload);
            e.kv.commit(staged);
        }
        assert!(kv_bytes(&e, remote) == kv_bytes(&e, inproc), "{backend} chunk {chunk}: ring K/V != in-process K/V");
        if local {
            let (mine, _) = e.prefill(&PROMPT, chunk, PrefillBy::Local).unwrap();
            assert!(kv_bytes(&e, remote) == kv_bytes(&e, mine), "{backend} chunk {chunk}: remote K/V != local K/V");
            e.release(mine);
        }
        e.release(remote);
        e.release(inproc);
    }
    assert_eq!(p.metrics().restarts, 0);
    let spans: usize = [PROMPT.len(), 3, 4].iter().map(|&c| PROMPT.len().div_ceil(c)).sum();
    assert_eq!(p.metrics().spans_accepted, spans as u64);
}

#[test]
fn rngd_conforms_dense_and_matches_local_prefill() {
    for dtype in [Dtype::F32, Dtype::Bf16] {
        for model in [gemma(), tiny("tiny_llama_4l")] {
            conform(&model, "rngd", builtin("rngd"), config(&model, dtype, serde_json::json!({})), dtype, true);
        }
    }
}

#[test]
fn gpu_conforms_grouped_and_matches_local_prefill() {
    for dtype in [Dtype::F32, Dtype::Bf16] {
        for model in [gemma(), tiny("tiny_llama_4l")] {
            conform(&model, "gpu", builtin("gpu"), config(&model, dtype, serde_json::json!({})), dtype, true);
        }
    }
}

#[test]
fn example_c_conforms() {
    let c = serde_json::json!({"layers": "SSSFSSSF", "kv_heads": 1, "head_dim": 16, "window": 8});
    let lib = PathBuf::from(env!("EXAMPLE_C_BACKEND"));
    conform(&gemma(), "example-c", lib, c, Dtype::F32, false);
}

#[test]
fn start_failures_are_typed_and_leave_nothing_behind() {
    let _serial = serial();
    let e = engine(&gemma(), Dtype::F32);
    let before = snapshot();
    let cases: Vec<(PathBuf, serde_json::Value, &str, &str)> = vec![
        (root().join("no-such-backend.so"), serde_json::json!({}), "start_failed", "load"),
        (builtin("rngd"), serde_json::json!({"model": "/nonexistent/model.gguf"}), "start_failed", "open"),
        (builtin("rngd"), config(&gemma(), Dtype::F32, serde_json::json!({"dtype": "f8"})), "start_failed", "dtype"),
        // A backend describing another model: four layers where the host has eight.
        (
            PathBuf::from(env!("EXAMPLE_C_BACKEND")),
            serde_json::json!({"layers": "SSSF", "kv_heads": 1, "head_dim": 16, "window": 8}),
            "describe_mismatch",
            "4 layers",
        ),
    ];
    for (library, config, kind, text) in cases {
        let mut p = producer(&e, library, config, Duration::from_secs(30));
        let err = p.start().expect_err("start must fail");
        assert_eq!(err.kind(), kind, "{err}");
        let line = err.to_string();
        assert!(line.contains(text) && !line.contains('\n'), "one line naming {text:?}: {line}");
        drop(p);
    }
    assert_eq!(snapshot(), before, "a failed start leaks nothing");
}

#[test]
fn a_backend_error_is_reported_and_the_producer_keeps_serving() {
    let _serial = serial();
    let mut e = engine(&gemma(), Dtype::F32);
    let mut p =
        producer(&e, builtin("gpu"), config(&gemma(), Dtype::F32, serde_json::json!({})), Duration::from_secs(30));
    p.start().unwrap();
    let pid = p.pid();
    // Token 999 is outside the 256-token vocabulary: the backend refuses, cleanly.
    let err = e
        .prefill(&[2, 999, 3], 0, PrefillBy::Remote { producer: &mut p, on_failure: OnFailure::Fail })
        .expect_err("the backend refuses the token");
    let pdhost::engine::EngineError::Producer(err) = err else { panic!("{err}") };
    assert!(matches!(*err, ProducerError::Backend { .. }), "{err}");
    assert!(err.to_string().contains("invalid_argument") && err.to_string().contains("999"), "{err}");
    assert_eq!(p.pid(), pid, "a backend error is not a protocol violation: no restart");
    let (seq, report) =
        e.prefill(&PROMPT, 0, PrefillBy::Remote { producer: &mut p, on_failure: OnFailure::Fail }).unwrap();
    assert!(report.remote);
    e.release(seq);
    assert_eq!(p.metrics().spans_rejected.get("backend_error"), Some(&1));
}

#[test]
fn producers_run_with_no_new_privs() {
    let _serial = serial();
    let e = engine(&gemma(), Dtype::Bf16);
    let mut p =
        producer(&e, builtin("rngd"), config(&gemma(), Dtype::Bf16, serde_json::json!({})), Duration::from_secs(30));
    p.start().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{}/status", p.pid().unwrap())).unwrap();
    assert!(
        status.lines().any(|l| l.starts_with("NoNewPrivs:") && l.ends_with('1')),
        "producers run with no_new_privs"
    );
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", p.pid().unwrap())).unwrap();
    assert!(maps.contains("libpdhost_backend_rngd.so"), "the producer loaded its backend");
}

/// A descriptor the host holds inheritable when a producer starts (another producer's ring, duplicated
/// for a spawn on another thread) does not reach the producer: it closes all it was not given.
#[test]
fn a_producer_holds_no_descriptor_it_was_not_given() {
    let _serial = serial();
    let e = engine(&gemma(), Dtype::Bf16);
    // SAFETY: dup of this process's stdin; the copy has no FD_CLOEXEC, so a spawn inherits it.
    let stray = unsafe { libc::dup(0) };
    assert!(stray > 2);
    let mut p =
        producer(&e, builtin("rngd"), config(&gemma(), Dtype::Bf16, serde_json::json!({})), Duration::from_secs(30));
    p.start().unwrap();
    let held: Vec<i32> = std::fs::read_dir(format!("/proc/{}/fd", p.pid().unwrap()))
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    // SAFETY: closes the duplicate made above.
    unsafe { libc::close(stray) };
    assert!(!held.contains(&stray), "the producer holds the host's stray descriptor {stray}: {held:?}");
}

#[test]
fn restarts_back_off_and_stop_at_the_cap() {
    let _serial = serial();
    let mut e = engine(&gemma(), Dtype::F32);
    let before = snapshot();
    let crash = config(&gemma(), Dtype::F32, serde_json::json!({"fault": "kill_before"}));
    let mut p = producer(&e, builtin("faulty"), crash, Duration::from_secs(30));
    // Two restarts a minute.
    p.set_restart_policy(pdhost::supervisor::RestartPolicy {
        max_restarts: 2,
        initial_backoff: Duration::from_millis(5),
        ..Default::default()
    });
    let mut kinds = Vec::new();
    for _ in 0..5 {
        // Past the backoff (5, 10, 20 ms), so that each request may start a producer.
        std::thread::sleep(Duration::from_millis(50));
        let err = e
            .prefill(&PROMPT, 0, PrefillBy::Remote { producer: &mut p, on_failure: OnFailure::Fail })
            .expect_err("every request crashes the producer");
        kinds.push(err.to_string());
    }
    // First start, two restarts: three crashes; then the cap refuses to start another.
    assert!(kinds[..3].iter().all(|k| k.contains("producer_exited") && k.contains("SIGKILL")), "{kinds:#?}");
    assert!(kinds[3..].iter().all(|k| k.contains("restart_limit") && k.contains("2 restarts")), "{kinds:#?}");
    let m = p.metrics();
    assert_eq!((m.starts, m.restarts), (3, 2));
    assert_eq!(m.spans_rejected.get("producer_exited"), Some(&3));
    assert_eq!(m.spans_rejected.get("restart_limit"), Some(&2));
    drop(p);
    assert_eq!(snapshot(), before);
}

#[test]
fn a_cap_of_zero_refuses_every_restart() {
    // `serve --max-restarts 0`, and every producer node: the first failure is the last start.
    let _serial = serial();
    let mut e = engine(&gemma(), Dtype::F32);
    let before = snapshot();
    let crash = config(&gemma(), Dtype::F32, serde_json::json!({"fault": "kill_before", "on_requests": [1]}));
    let mut p = producer(&e, builtin("faulty"), crash, Duration::from_secs(30));
    p.set_restart_policy(pdhost::supervisor::RestartPolicy {
        max_restarts: 0,
        initial_backoff: Duration::ZERO,
        ..Default::default()
    });
    let first = e
        .prefill(&PROMPT, 0, PrefillBy::Remote { producer: &mut p, on_failure: OnFailure::Fail })
        .expect_err("request 1 crashes the producer");
    assert!(first.to_string().contains("producer_exited"), "{first}");
    // Request 2 would succeed, but no restart is allowed: refused with the cap named, no process started.
    let second = e
        .prefill(&PROMPT, 0, PrefillBy::Remote { producer: &mut p, on_failure: OnFailure::Fail })
        .expect_err("no restart");
    assert!(
        second.to_string().contains("restart_limit") && second.to_string().contains("restarts are off"),
        "{second}"
    );
    assert_eq!((p.metrics().starts, p.metrics().restarts, p.pid()), (1, 0, None));
    drop(p);
    assert_eq!(snapshot(), before);
}

#[test]
fn a_request_during_the_backoff_is_refused_at_once() {
    let _serial = serial();
    let mut e = engine(&gemma(), Dtype::F32);
    let crash = config(&gemma(), Dtype::F32, serde_json::json!({"fault": "kill_before", "on_requests": [1]}));
    let mut p = producer(&e, builtin("faulty"), crash, Duration::from_secs(30));
    p.set_restart_policy(pdhost::supervisor::RestartPolicy {
        initial_backoff: Duration::from_secs(600),
        ..Default::default()
    });
    fn by(producer: &mut pdhost::supervisor::Producer) -> PrefillBy<'_> {
        PrefillBy::Remote { producer, on_failure: OnFailure::Fail }
    }
    let first = e.prefill(&PROMPT, 0, by(&mut p)).expect_err("request 1 crashes the producer");
    assert!(first.to_string().contains("producer_exited"), "{first}");
    // Request 2 would succeed, but the producer may not restart for ten minutes: refused now, no process.
    let second = e.prefill(&PROMPT, 0, by(&mut p)).expect_err("backing off");
    assert!(second.to_string().contains("backing_off"), "{second}");
    assert_eq!((p.metrics().starts, p.pid()), (1, None));
    // Fallback completes the same request locally instead.
    let (seq, report) =
        e.prefill(&PROMPT, 0, PrefillBy::Remote { producer: &mut p, on_failure: OnFailure::Fallback }).unwrap();
    assert_eq!(report.fallback.as_ref().map(|f| f.kind()), Some("backing_off"));
    e.release(seq);
}

/// A start that does not reach Ready (here a backend whose `open` outlasts the start timeout) is a
/// failure like a crash: the next start waits out the backoff, so requests during it are refused at once
/// rather than each waiting out another slow start.
#[test]
fn a_start_that_times_out_backs_off_before_the_next() {
    let _serial = serial();
    let e = engine(&gemma(), Dtype::F32);
    let before = snapshot();
    let slow = config(&gemma(), Dtype::F32, serde_json::json!({"open_delay_ms": 5000}));
    let mut spec = producer_spec(&e, builtin("faulty"), slow, Duration::from_secs(30));
    spec.start_timeout = Duration::from_millis(300);
    spec.restart.initial_backoff = Duration::from_secs(600);
    spec.restart.max_backoff = Duration::from_secs(600);
    let mut p = Producer::new(spec, e.kv.geometry().clone());
    let first = p.start().expect_err("open outlasts the start timeout");
    assert_eq!(first.kind(), "timeout", "{first}");
    let second = p.start().expect_err("backing off");
    assert_eq!(second.kind(), "backing_off", "{second}");
    assert_eq!((p.metrics().starts, p.pid()), (1, None));
    drop(p);
    assert_eq!(snapshot(), before);
}

#[test]
fn a_prefix_cache_hit_prefills_only_the_rest_and_changes_no_bit() {
    use pdhost::engine::Request;
    let _serial = serial();
    let model = gemma();
    // B shares A's first 16 tokens: four 4-token pages. The tiny model's window is 8, so chunked
    // prefill keeps the sliding pages B needs (positions 8..16).
    let a: Vec<u32> = (0..17).map(|i| 2 + (i * 37 % 200)).collect();
    let mut b = a[..16].to_vec();
    b.extend([9, 8, 7, 6, 5]);
    let req = |prompt: &[u32]| Request::greedy(prompt.to_vec(), 6, 4);
    // The reference: B alone, without a prefix cache.
    let want = engine(&model, Dtype::F32).generate(&req(&b), |_| {}).unwrap();
    assert_eq!(want.spans, 5);
    let rngd = || config(&model, Dtype::F32, serde_json::json!({}));
    // Local; remote where the producer still has A's K/V; remote where a new producer computes B's
    // context itself.
    for case in ["local", "remote", "remote, new producer"] {
        let mut e = engine(&model, Dtype::F32);
        e.kv.enable_prefix_cache();
        let mut p = producer(&e, builtin("rngd"), rngd(), Duration::from_secs(30));
        p.start().unwrap();
        let remote = case != "local";
        let run = |e: &mut Engine, p: &mut pdhost::supervisor::Producer, prompt: &[u32]| {
            let by =
                if remote { PrefillBy::Remote { producer: p, on_failure: OnFailure::Fail } } else { PrefillBy::Local };
            e.generate_with(&req(prompt), by, |_| {}).unwrap_or_else(|err| panic!("{case}: {err}"))
        };
        let first = run(&mut e, &mut p, &a);
        assert_eq!(first.report.prefix_hit, 0, "{case}: nothing cached yet");
        if case == "remote, new producer" {
            drop(p);
            p = producer(&e, builtin("rngd"), rngd(), Duration::from_secs(30));
            p.start().unwrap();
        }
        let got = run(&mut e, &mut p, &b);
        assert_eq!(got.report.prefix_hit, 16, "{case}");
        assert_eq!(got.report.remote, remote, "{case}");
        assert_eq!(got.spans, 1, "{case}: only positions 16..20 are prefilled");
        assert_eq!(got.bytes * 5, want.bytes, "{case}: one chunk of the five");
        assert_eq!(got.output, want.output, "{case}");
        assert_eq!(got.logits_hash, want.logits_hash, "{case}: bit-identical logits");
    }
}

/// The host passes the model's shape in the backend's config: the C example, which reads its layers,
/// heads, head size and window from there, opens with no config of its own and conforms.
#[test]
fn open_carries_the_shape() {
    let _serial = serial();
    let mut e = engine(&gemma(), Dtype::F32);
    let mut p = producer(&e, PathBuf::from(env!("EXAMPLE_C_BACKEND")), serde_json::json!({}), Duration::from_secs(30));
    p.start().unwrap_or_else(|err| panic!("the host's shape keys are enough to open: {err}"));
    let (seq, report) =
        e.prefill(&PROMPT, 4, PrefillBy::Remote { producer: &mut p, on_failure: OnFailure::Fail }).unwrap();
    assert!(report.remote && report.fallback.is_none());
    e.release(seq);
    assert_eq!(p.metrics().spans_accepted, PROMPT.len().div_ceil(4) as u64);
}

/// A start-up failure that every start would repeat is not retried: the second request is refused at
/// once, naming the first failure, and no second process is started.
#[test]
fn no_restart_follows_a_failure_that_every_start_repeats() {
    let _serial = serial();
    let mut e = engine(&gemma(), Dtype::F32);
    let cases: Vec<(PathBuf, serde_json::Value, &str)> = vec![
        (
            PathBuf::from(env!("EXAMPLE_C_BACKEND")),
            serde_json::json!({"layers": "SSSF", "kv_heads": 1, "head_dim": 16, "window": 8}),
            "describe_mismatch",
        ),
        (builtin("rngd"), config(&gemma(), Dtype::F32, serde_json::json!({"dtype": "f8"})), "start_failed"),
        (root().join("no-such-backend.so"), serde_json::json!({}), "start_failed"),
    ];
    for (library, config, kind) in cases {
        let mut p = producer(&e, library, config, Duration::from_secs(30));
        let first = p.start().expect_err("the start fails");
        assert_eq!(first.kind(), kind, "{first}");
        for _ in 0..2 {
            let err = e
                .prefill(&PROMPT, 0, PrefillBy::Remote { producer: &mut p, on_failure: OnFailure::Fail })
                .expect_err("refused");
            let pdhost::engine::EngineError::Producer(err) = err else { panic!("{err}") };
            assert!(matches!(*err, ProducerError::StartRefused { .. }), "{err}");
            assert_eq!(err.kind(), kind, "the first failure's kind");
            let reason = first.to_string().split_once(": ").unwrap().1.to_string();
            assert!(err.to_string().contains(&reason), "names the first failure: {err}");
        }
        assert_eq!((p.metrics().starts, p.metrics().restarts), (1, 0), "{kind}: one start, no restart");
    }
    // A failure that may pass (the backend could not load its model) is still retried.
    let mut p =
        producer(&e, builtin("rngd"), serde_json::json!({"model": "/nonexistent/model.gguf"}), Duration::from_secs(30));
    assert_eq!(p.start().expect_err("no model").kind(), "start_failed");
    assert_eq!(p.start().expect_err("still no model").kind(), "start_failed");
    assert_eq!(p.metrics().starts, 2);
}

/// A backend that loaded other weights of exactly the same shape (one byte of one tensor differs) is
/// refused at the handshake, naming both identities, and not restarted.
#[test]
fn a_backend_with_other_weights_of_the_same_shape_is_refused() {
    let _serial = serial();
    let e = engine(&gemma(), Dtype::F32);
    let dir = std::env::temp_dir().join(format!("pdhost-other-weights-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(gemma()).unwrap().flatten() {
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    let weights = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    std::fs::write(&weights, bytes).unwrap();

    let mut p = producer(&e, builtin("rngd"), config(&dir, Dtype::F32, serde_json::json!({})), Duration::from_secs(30));
    let err = p.start().expect_err("other weights");
    assert_eq!(err.kind(), "identity_mismatch", "{err}");
    let ours = format!("{:016x}", e.model.identity.weights);
    let text = err.to_string();
    assert!(text.contains("model identity: weights: expected ") && text.contains(&ours), "{text}");
    assert_eq!(p.start().expect_err("not restarted").kind(), "identity_mismatch");
    assert_eq!(p.metrics().starts, 1);
    // The same files, unchanged: accepted.
    let mut same =
        producer(&e, builtin("rngd"), config(&gemma(), Dtype::F32, serde_json::json!({})), Duration::from_secs(30));
    same.start().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The end-of-request entry: once the host releases a request, the backend no longer holds its K/V, so a
/// chunk continuing it is refused; before the release the same chunk continues it.
#[test]
fn the_end_of_request_entry_is_called() {
    let _serial = serial();
    let mut e = engine(&gemma(), Dtype::F32);
    let mut p =
        producer(&e, builtin("rngd"), config(&gemma(), Dtype::F32, serde_json::json!({})), Duration::from_secs(30));
    let call = |seq: pdhost::kv::SeqId, start: usize, end: usize| pdhost::supervisor::PrefillCall {
        request_id: seq.0,
        start_pos: start as u64,
        tokens: PROMPT[start..end].to_vec(),
        context: Vec::new(),
    };
    // Not released: the second chunk continues the first.
    let (kept, _) = e.prefill(&[], 0, PrefillBy::Local).unwrap();
    p.prefill(&mut e.kv, kept, &call(kept, 0, 4)).unwrap();
    p.prefill(&mut e.kv, kept, &call(kept, 4, 8)).expect("the backend still holds the request");
    // Released after its first chunk: the backend has let it go.
    let (released, _) = e.prefill(&[], 0, PrefillBy::Local).unwrap();
    p.prefill(&mut e.kv, released, &call(released, 0, 4)).unwrap();
    p.release(released.0);
    let err = p.prefill(&mut e.kv, released, &call(released, 4, 8)).expect_err("released");
    assert!(matches!(err, ProducerError::Backend { .. }), "{err}");
    assert!(err.to_string().contains("expected the request in progress"), "{err}");
    assert_eq!(p.metrics().restarts, 0);
}

/// A reply is taken only from the process that sent it: after a restart, whose ring numbers its frames
/// from 0 again, the old reply (frame 0 of the old ring) is refused rather than matched to the new ring's
/// frame 0, and the cache is unchanged.
#[test]
fn a_reply_from_a_process_since_restarted_is_refused() {
    let _serial = serial();
    let mut e = engine(&gemma(), Dtype::F32);
    let mut p =
        producer(&e, builtin("rngd"), config(&gemma(), Dtype::F32, serde_json::json!({})), Duration::from_secs(30));
    let (seq, _) = e.prefill(&[], 0, PrefillBy::Local).unwrap();
    let call = pdhost::supervisor::PrefillCall {
        request_id: seq.0,
        start_pos: 0,
        tokens: PROMPT[..4].to_vec(),
        context: Vec::new(),
    };
    let stale = p.submit(&call).unwrap();
    p.shutdown();
    p.start().unwrap();
    let fresh = p.submit(&call).unwrap();
    assert_eq!(stale.sequence(), fresh.sequence(), "both rings' first frame");
    let before = e.kv.state_hash();
    let err = p.take(stale, &mut e.kv, seq).expect_err("a reply of the old process");
    assert!(matches!(err, ProducerError::Protocol { .. }), "{err}");
    assert!(err.to_string().contains("the process of epoch"), "{err}");
    assert_eq!(e.kv.state_hash(), before);
}

/// A backend that takes at most 4 tokens per call says so in its capabilities, and the host chunks a
/// prompt asked for in one span to fit.
#[test]
fn the_host_chunks_to_the_backends_capability() {
    let _serial = serial();
    let mut e = engine(&gemma(), Dtype::Bf16);
    let c = config(&gemma(), Dtype::Bf16, serde_json::json!({"call_limit": 4}));
    let mut p = producer(&e, builtin("faulty"), c, Duration::from_secs(30));
    p.start().unwrap();
    assert_eq!(p.max_tokens(), Some(4));
    let (seq, report) =
        e.prefill(&PROMPT, 0, PrefillBy::Remote { producer: &mut p, on_failure: OnFailure::Fail }).unwrap();
    assert!(report.remote && report.fallback.is_none());
    assert_eq!(p.metrics().spans_accepted, PROMPT.len().div_ceil(4) as u64, "spans of at most 4 tokens");
    e.release(seq);
}
