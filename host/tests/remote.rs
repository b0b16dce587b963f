//! Producers on other machines (issue 15), over loopback with real processes: a `pdhost producer-node`
//! and a host whose relay reaches it over TCP and NIXL, with UCX held to its TCP transport on `lo`
//! (`UCX_TLS=tcp`, `UCX_NET_DEVICES=lo`), so that the network path is what is tested.
//!
//! Built only with the `nixl` feature: `cargo test -p pdhost --features nixl --test remote` (`.ci/run`
//! runs it).

#![cfg(feature = "nixl")]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

const PDHOST: &str = env!("CARGO_BIN_EXE_pdhost");

/// UCX on loopback TCP alone.
fn ucx(cmd: &mut Command) -> &mut Command {
    cmd.env("UCX_TLS", "tcp").env("UCX_NET_DEVICES", "lo").env("RUST_BACKTRACE", "0")
}

fn tiny(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/reference").join(name).display().to_string()
}

/// A child process killed and reaped when dropped.
struct KilledOnDrop(Child);

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A producer node on a free port; killed when dropped.
struct Node {
    child: Child,
    addr: String,
    /// Its threads with no session open (the main one, and the one that reads UCX's log).
    idle_threads: usize,
}

impl Node {
    fn start(backend: &str, extra: &[&str]) -> Node {
        Node::start_at("127.0.0.1:0", backend, extra)
    }

    fn start_at(listen: &str, backend: &str, extra: &[&str]) -> Node {
        let mut child = ucx(Command::new(PDHOST).args(["producer-node", "--listen", listen, "--backend", backend]))
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let addr = line
            .strip_prefix("listening on ")
            .and_then(|l| l.split_whitespace().next())
            .unwrap_or_else(|| panic!("expected `listening on ADDR`, found {line:?}"))
            .to_string();
        let mut node = Node { child, addr, idle_threads: 0 };
        node.idle_threads = node.footprint().1;
        node
    }

    fn url(&self, backend: &str) -> String {
        format!("nixl://{}/{backend}", self.addr)
    }

    /// Descriptors, threads and child processes of the node now.
    fn footprint(&self) -> (usize, usize, usize) {
        let proc = format!("/proc/{}", self.child.id());
        let count = |dir: &str| std::fs::read_dir(format!("{proc}/{dir}")).unwrap().count();
        let mut children = 0;
        for task in std::fs::read_dir(format!("{proc}/task")).unwrap() {
            let path = task.unwrap().path().join("children");
            children += std::fs::read_to_string(path).unwrap_or_default().split_whitespace().count();
        }
        (count("fd"), count("task"), children)
    }

    /// Ring segments still mapped in the node: each session maps one ring, whose data segment it
    /// registers with NIXL, and must unmap it when it ends.
    fn mapped_rings(&self) -> usize {
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", self.child.id())).unwrap();
        maps.lines().filter(|l| l.contains("memfd:pdhost-")).count()
    }

    /// Waits (up to 15 s, for a loaded machine) until the node's sessions are over: back to its idle
    /// threads, and no children left.
    fn settled(&self) -> (usize, usize, usize) {
        for _ in 0..600 {
            let f = self.footprint();
            if f.1 == self.idle_threads && f.2 == 0 {
                return f;
            }
            std::thread::sleep(std::time::Duration::from_millis(25));
        }
        self.footprint()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Relay processes of a node at `addr` (`pdhost __relay --node ADDR`) still running a moment after their
/// host exited: a host's relays end with it.
fn relays(addr: &str) -> usize {
    let count = || {
        let mut n = 0;
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
            n += usize::from(args.get(1) == Some(&&b"__relay"[..]) && args.contains(&addr.as_bytes()));
        }
        n
    };
    for _ in 0..100 {
        if count() == 0 {
            return 0;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    count()
}

fn run(model: &str, extra: &[&str]) -> Output {
    ucx(Command::new(PDHOST).args([
        "generate",
        "--model",
        model,
        "--prompt-ids",
        "2,10,20,30,40,50,60,70,80,90,100,110,120",
        "--max-tokens",
        "6",
        "--json",
    ]))
    .args(extra)
    .stdin(Stdio::null())
    .output()
    .unwrap()
}

fn generate(model: &str, extra: &[&str]) -> serde_json::Value {
    let out = run(model, extra);
    assert!(out.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn remote_prefill_equals_local_bit_for_bit_dense_grouped_and_chunked() {
    for (backend, layout) in [("rngd", "dense"), ("gpu", "grouped")] {
        let node = Node::start(backend, &[]);
        let before = node.footprint();
        let url = node.url(backend);
        for model in ["tiny_gemma3_8l", "tiny_llama_4l"] {
            let model = tiny(model);
            for chunking in [&[][..], &["--prefill-chunk", "4"], &["--prefill-chunk", "5", "--kv-dtype", "bf16"]] {
                let local = generate(&model, &[chunking, &["--producer", "local"]].concat());
                let remote =
                    generate(&model, &[chunking, &["--producer", &url, "--on-producer-failure", "fail"]].concat());
                let what = format!("{model} {backend} {chunking:?}");
                assert_eq!(remote["prefill"]["where"], "remote", "{what}");
                assert_eq!(remote["prefill"]["layout"], layout, "{what}");
                // As UCX reported its choice to the node: UCX_TLS=tcp on loopback.
                assert_eq!(remote["prefill"]["transport"], "tcp/lo", "{what}");
                assert_eq!(local["prefill"]["transport"], serde_json::Value::Null, "{what}");
                assert_eq!(remote["output_ids"], local["output_ids"], "{what}");
                assert_eq!(remote["logits_xxh3"], local["logits_xxh3"], "{what}: logits bit-identical to local");
                // Prefill covers all but the last prompt token, which the first decode step reads.
                let spans = if chunking.is_empty() { 1 } else { 12usize.div_ceil(chunking[1].parse().unwrap()) };
                assert_eq!(remote["prefill"]["spans"], spans, "{what}");
            }
        }
        // Every session ended whole: no producer left running, no descriptor or thread kept.
        let (fds, threads, children) = node.settled();
        assert_eq!((threads, children), (node.idle_threads, 0), "{backend}: the node's sessions are over");
        // One more than before the first session at most: UCX's log, which UCX opens once.
        assert!(fds <= before.0 + 1, "{backend}: descriptors {} before the sessions, {fds} after", before.0);
        assert_eq!(node.mapped_rings(), 0, "{backend}: a session's ring is still mapped (and registered)");
    }
}

/// Each failure of the link is refused with its own kind before anything lands: the request falls back
/// to local prefill and equals it, and the node is left as it was.
#[test]
fn every_link_failure_is_typed_and_lands_nothing() {
    let model = tiny("tiny_gemma3_8l");
    let local = generate(&model, &["--producer", "local"]);
    for (fault, kind) in [
        ("drop-connection", "remote_connection"),
        ("no-notification", "timeout"),
        ("notification-only", "notification_without_data"),
        ("wrong-slot", "wrong_slot"),
        ("stale-epoch", "stale_epoch"),
        ("truncate", "truncated_transfer"),
        ("corrupt", "checksum_mismatch"),
        ("exit", "remote_connection"),
    ] {
        let node = Node::start("rngd", &["--fault", fault]);
        let before = node.footprint();
        // Two spans, so that the ring has a second slot for `wrong-slot` to write into.
        let out =
            generate(&model, &["--producer", &node.url("rngd"), "--producer-timeout", "3", "--prefill-chunk", "6"]);
        assert_eq!(out["prefill"]["where"], "local", "{fault}");
        assert_eq!(out["prefill"]["fallback_kind"], kind, "{fault}: {}", out["prefill"]["fallback_reason"]);
        assert_eq!(out["output_ids"], local["output_ids"], "{fault}");
        assert_eq!(out["logits_xxh3"], local["logits_xxh3"], "{fault}");
        assert_eq!(relays(&node.addr), 0, "{fault}: a relay outlived its host");
        if fault != "exit" {
            let after = node.settled();
            assert_eq!((after.1, after.2), (node.idle_threads, 0), "{fault}: the session is over");
            assert!(after.0 <= before.0 + 1, "{fault}: descriptors {before:?} -> {after:?}");
            assert_eq!(node.mapped_rings(), 0, "{fault}: the session's ring is still mapped (and registered)");
        }
    }
}

#[test]
fn a_refused_or_absent_node_is_named() {
    let model = tiny("tiny_gemma3_8l");
    // The node runs rngd; the host asks for gpu.
    let node = Node::start("rngd", &[]);
    let out = run(&model, &["--producer", &node.url("gpu"), "--on-producer-failure", "fail"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("backend: expected rngd (what this node runs), found gpu"), "{err}");
    // Nobody listens there.
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let out = run(&model, &["--producer", &format!("nixl://{addr}/rngd"), "--on-producer-failure", "fail"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("connecting to producer node {addr}")), "{err}");
    // Not a URL.
    let out = run(&model, &["--producer", "nixl://nowhere/rngd"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--producer: expected nixl://HOST:PORT/NAME"), "{err}");
}

/// `pdhost serve` with a remote producer: answers equal `generate`'s; a node that dies costs one request
/// its remote prefill (it falls back), and once a node listens there again the server reconnects.
#[test]
fn serve_reconnects_to_a_node_that_comes_back() {
    // A model with a tokenizer, as the server needs, fetched through the project's own cache.
    let model = "smollm2-135m";
    let fetched = Command::new(PDHOST).args(["models", "fetch", model]).stdin(Stdio::null()).output().unwrap();
    assert!(fetched.status.success(), "{}", String::from_utf8_lossy(&fetched.stderr));
    let node = Node::start("rngd", &[]);
    let addr = node.addr.clone();
    let server = ucx(Command::new(PDHOST).args(["serve", "--model", model, "--port", "0", "--context", "256"]))
        .args(["--producer", &node.url("rngd"), "--slots", "2"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Killed however the test ends, so that no server outlives it.
    let mut server = KilledOnDrop(server);
    let mut line = String::new();
    BufReader::new(server.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let url = line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("{line:?}")).to_string();
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let complete = || -> serde_json::Value {
        let body = serde_json::json!({
            "model": model, "prompt": [2, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120],
            "max_tokens": 6, "temperature": 0
        });
        let mut r = agent.post(&format!("{url}/v1/completions")).send_json(&body).unwrap();
        assert_eq!(r.status().as_u16(), 200);
        r.body_mut().read_json::<serde_json::Value>().unwrap()["pdhost"].clone()
    };
    let local = generate(model, &["--producer", "local"]);
    let first = complete();
    assert_eq!((first["prefill"].as_str(), first["layout"].as_str()), (Some("remote"), Some("dense")), "{first}");
    assert_eq!(first["transport"], "tcp/lo", "{first}");
    assert_eq!((&first["output_ids"], &first["logits_xxh3"]), (&local["output_ids"], &local["logits_xxh3"]));
    drop(node);
    let lost = complete();
    assert_eq!(lost["prefill"], "local", "{lost}");
    assert!(lost["fallback_reason"].as_str().is_some_and(|r| r.starts_with("remote_connection:")), "{lost}");
    assert_eq!(lost["logits_xxh3"], local["logits_xxh3"]);
    let _back = Node::start_at(&addr, "rngd", &[]);
    // The supervisor restarts the relay after its backoff; until then requests fall back.
    let mut again = complete();
    for _ in 0..40 {
        if again["prefill"] == "remote" {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        again = complete();
    }
    assert_eq!(again["prefill"], "remote", "{again}");
    assert_eq!(again["logits_xxh3"], local["logits_xxh3"]);
    drop(server);
}

/// A peer that is not a relay holds nothing for long: a hello longer than a hello may be is refused at
/// once, and one dribbled a byte at a time is cut off when the hello's time is up (a read timeout alone
/// was renewed by every byte, and the whole claimed length was allocated up front: sixteen such peers
/// held every session and a GiB).
#[test]
fn a_peer_that_never_finishes_its_hello_is_dropped() {
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};
    let node = Node::start("rngd", &[]);
    let mut huge = std::net::TcpStream::connect(&node.addr).unwrap();
    huge.write_all(&(64u32 << 20).to_le_bytes()).unwrap();
    huge.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut answer = Vec::new();
    let _ = huge.read_to_end(&mut answer);
    assert!(String::from_utf8_lossy(&answer).contains("1048576"), "refused, naming the limit: {answer:?}");

    let mut slow = std::net::TcpStream::connect(&node.addr).unwrap();
    slow.write_all(&(1u32 << 20).to_le_bytes()).unwrap();
    let started = Instant::now();
    let cut = loop {
        std::thread::sleep(Duration::from_millis(500));
        if slow.write_all(&[0]).is_err() {
            break started.elapsed();
        }
        assert!(started.elapsed() < Duration::from_secs(30), "still connected after 30 s of a dribbled hello");
    };
    // The hello's 10 s, a write or two into the closed connection before it fails, and a slow machine.
    assert!(cut >= Duration::from_secs(9), "cut after {cut:?}");
    let (_, threads, children) = node.settled();
    assert_eq!((threads, children), (node.idle_threads, 0), "its session is over");
}

/// A hello that asks for a ring past the producers' memory cap (1024 slots of 16 GiB) is refused, naming
/// both sizes, before the node allocates any of it; the node serves the next relay.
#[test]
fn a_hello_asking_for_a_ring_past_the_memory_cap_is_refused() {
    use pdhost_producer::protocol::{send, FromProducer, Hello, ToNode, LINK_VERSION, MAX_FROM_NODE};
    use std::io::Read;
    let node = Node::start("rngd", &["--producer-memory", "4096"]);
    let ring = shm_format::ring::RingGeometry::new(1024, 16 << 30).unwrap();
    let hello = Hello {
        version: LINK_VERSION,
        backend: "rngd".into(),
        config: r#"{"layer_shapes": [["full", 1, 64]]}"#.into(),
        epoch: 1,
        slots: 1024,
        slot_capacity: 16 << 30,
        data_len: ring.data_len(),
        ..Hello::default()
    };
    let mut peer = std::net::TcpStream::connect(&node.addr).unwrap();
    send(&mut peer, &ToNode::Hello(hello)).unwrap();
    peer.set_read_timeout(Some(std::time::Duration::from_secs(20))).unwrap();
    let mut answer = Vec::new();
    let _ = peer.read_to_end(&mut answer);
    let Ok(Some(FromProducer::StartFailed { message, .. })) =
        pdhost_producer::protocol::recv::<FromProducer>(answer.as_slice(), MAX_FROM_NODE)
    else {
        panic!("a refusal: {answer:?}")
    };
    let want = format!("expected at most {} data bytes", 4096u64 << 20);
    assert!(message.contains(&want) && message.contains(&ring.data_len().to_string()), "{message}");
    let (_, threads, children) = node.settled();
    assert_eq!((threads, children), (node.idle_threads, 0), "its session is over");
    let out = generate(&tiny("tiny_gemma3_8l"), &["--producer", &node.url("rngd")]);
    assert_eq!(out["prefill"]["where"], "remote", "{out}");
}
