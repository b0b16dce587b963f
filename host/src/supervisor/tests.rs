use pdhost_producer::protocol::LayerDesc;

use super::*;

fn gemma3_270m(head_dim: u32) -> KvGeometry {
    shm_format::testing::interleaved(18, 6, 512, 1, head_dim)
}

/// What a backend describing `geometry` sends in its `Ready`.
fn described(geometry: &KvGeometry) -> Described {
    let layers = geometry.layers.iter().map(LayerDesc::of).collect();
    Described { layout: 1, dtype: 0, fingerprint: geometry.fingerprint().0, layers, ..Described::default() }
}

fn producer(geometry: KvGeometry) -> Producer {
    Producer::new(ProducerSpec::unstarted("faulty", None), geometry)
}

fn mismatch(ours: KvGeometry, d: &Described) -> String {
    let err = producer(ours).check_described(d).unwrap_err();
    assert_eq!(err.kind(), "describe_mismatch");
    err.to_string()
}

#[test]
fn a_describe_mismatch_names_what_differs_in_words() {
    let ours = gemma3_270m(256);
    assert!(producer(ours.clone()).check_described(&described(&ours)).is_ok());

    // A wrong head size alone: expected and found no longer read the same.
    assert_eq!(
        mismatch(ours.clone(), &described(&gemma3_270m(128))),
        "producer faulty: describe: layer 0: expected sliding window 512 with 1 KV head of size 256, \
         found sliding window 512 with 1 KV head of size 128 (17 more layers differ: 1-17)"
    );

    let fewer = shm_format::testing::interleaved(17, 6, 512, 1, 256);
    assert_eq!(
        mismatch(ours.clone(), &described(&fewer)),
        "producer faulty: describe: KV geometry: expected 18 layers: sliding window 512 (15 layers: 0-4, 6-10, \
         12-16; 1 KV head of size 256), full attention (3 layers: 5, 11, 17; 1 KV head of size 256), found 17 \
         layers: sliding window 512 (15 layers: 0-4, 6-10, 12-16; 1 KV head of size 256), full attention (2 \
         layers: 5, 11; 1 KV head of size 256)"
    );

    let mut kind = described(&ours);
    kind.layers[3].kind = 7;
    assert_eq!(
        mismatch(ours.clone(), &kind),
        "producer faulty: describe: layer 3 kind: expected 0 (full attention), 1 (sliding window) or 2 \
         (recurrent), found 7"
    );

    let mut fingerprint = described(&ours);
    fingerprint.fingerprint ^= 1;
    let text = mismatch(ours.clone(), &fingerprint);
    assert!(text.starts_with("producer faulty: describe: fingerprint: expected "), "{text}");

    let mut dtype = described(&ours);
    dtype.dtype = 9;
    assert_eq!(
        mismatch(ours, &dtype),
        "producer faulty: describe: dtype: expected 0 (f32), 1 (f16) or 2 (bf16), found 9"
    );
}

#[test]
fn the_config_carries_the_shape_and_the_user_overrides_it() {
    let geometry = gemma3_270m(256);
    let config = config_with_shape(r#"{"model": "m.gguf", "head_dim": 16}"#, &geometry, 4096, Some((1e6, 1e4)));
    let c: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert_eq!(c["num_layers"], 18);
    assert_eq!(c["layers"], "SSSSSFSSSSSFSSSSSF");
    assert_eq!(
        (c["kv_heads"].clone(), c["window"].clone(), c["max_tokens"].clone()),
        (1.into(), 512.into(), 4096.into())
    );
    assert_eq!(c["layer_shapes"][5], serde_json::json!(["full", 1, 256]));
    assert_eq!(c["layer_shapes"][0], serde_json::json!(["sliding", 1, 256, 512]));
    assert_eq!((c["model"].clone(), c["head_dim"].clone()), ("m.gguf".into(), 16.into()), "the user's keys win");
    // Not an object: passed on for the backend to refuse.
    assert_eq!((c["rope_theta"].as_f64(), c["rope_local_theta"].as_f64()), (Some(1e6), Some(1e4)));
    assert_eq!(config_with_shape("[1]", &geometry, 1, None), "[1]");
}

#[test]
fn the_host_is_not_dumpable_once_hardened() {
    harden_host().expect("PR_SET_DUMPABLE");
    // SAFETY: prctl with integer arguments.
    assert_eq!(unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) }, 0);
}

#[test]
fn waits_and_unexpected_replies_read_as_words() {
    let timeout =
        ProducerError::Timeout { name: "gpu".into(), waited: Duration::from_secs(120), during: "awaiting a prefill" };
    assert_eq!(timeout.to_string(), "producer gpu: no answer within 120 s while awaiting a prefill; killed it");
    let limit = ProducerError::RestartLimit {
        name: "gpu".into(),
        restarts: 10,
        window: Duration::from_secs(60),
        wait: Duration::from_millis(1500),
    };
    assert_eq!(limit.to_string(), "producer gpu: 10 restarts within 60 s: not restarting before 1.5 s from now");
    let off = ProducerError::RestartLimit {
        name: "gpu".into(),
        restarts: 0,
        window: Duration::from_secs(60),
        wait: Duration::from_secs(60),
    };
    assert_eq!(off.to_string(), "producer gpu: failed, and restarts are off (a cap of 0 per window)");
    let after = "exited: exited by SIGKILL (during a prefill)".to_string();
    let backing_off = ProducerError::BackingOff { name: "gpu".into(), wait: Duration::from_millis(50), after };
    assert_eq!(
        backing_off.to_string(),
        "producer gpu: restarting in 50 ms after a failure (exited: exited by SIGKILL (during a prefill)): not yet"
    );
    let reply = FromProducer::Done { request_id: 6, sequence: 0, backend_ns: 0, frame_ns: 0 };
    let protocol = ProducerError::Protocol {
        name: "gpu".into(),
        expected: "a Done or Failed reply for request 7".into(),
        found: reply.summary(),
    };
    assert_eq!(
        protocol.to_string(),
        "producer gpu: control channel: expected a Done or Failed reply for request 7, found a Done reply for \
         request 6 (frame 0)"
    );
}

#[test]
fn a_producers_text_reaches_errors_as_one_bounded_line() {
    let message = format!("line one\nline two\r\u{1b}[31mred{}", "x".repeat(5000));
    let FromProducer::Failed { message, .. } = tamed(FromProducer::Failed { request_id: 1, status: 4, message }) else {
        panic!("the same reply");
    };
    assert!(message.starts_with("line one line two  [31mred"), "{message}");
    assert!(!message.chars().any(char::is_control) && message.ends_with("... (5026 bytes)"), "{message}");
    assert!(message.chars().count() < MAX_PRODUCER_TEXT + 20);
}

/// A `Ready`'s model identity is the producer's text too: one that differs is named in one line.
#[test]
fn a_ready_identity_reaches_the_mismatch_as_one_line() {
    let ours = gemma3_270m(256);
    let mut spec_producer = producer(ours.clone());
    spec_producer.spec.identity = Some("weights:0123456789abcdef;tokenizer:fedcba9876543210;rope:10000/10".into());
    let mut d = described(&ours);
    d.identity = Some(format!("weights:0123456789abcdef;tokenizer:fedcba9876543210;rope:10\n{}", "9".repeat(5000)));
    let FromProducer::Ready(d) = tamed(FromProducer::Ready(d)) else { panic!("the same message") };
    let err = spec_producer.check_described(&d).unwrap_err().to_string();
    assert!(err.contains("identity"), "{err}");
    assert!(!err.chars().any(char::is_control) && err.len() < MAX_PRODUCER_TEXT + 200, "{err}");
}
