//! Producers in real subprocesses, backends as real dylibs: the conformance suite, every fault mode, and
//! a soak. Every test here holds [`serial`], because several compare this process's descriptors,
//! mappings and children before and after.

mod batch;
mod conformance;
mod faults;
mod python;
mod soak;

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use model::arch::Model;
use model::kernels::Precision;
use pdhost::engine::Engine;
use pdhost::kv::SeqId;
use pdhost::supervisor::{builtin_backend, Producer, ProducerSpec, RestartPolicy};
use shm_format::Dtype;

/// Each test producer's cap on private memory: the tiny checkpoints need far less, and the `eat_memory`
/// fault reaches it within its request timeout.
const MEMORY_LIMIT: u64 = 512 << 20;

/// One test at a time in this binary.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A tiny HF checkpoint from `fixtures/reference`.
fn tiny(name: &str) -> PathBuf {
    root().join("fixtures/reference").join(name).canonicalize().expect("fixture checkpoint")
}

/// The Gemma-3-shaped tiny checkpoint: 8 layers, sliding window 8 on layers 0-2 and 4-6, full on 3 and 7.
fn gemma() -> PathBuf {
    tiny("tiny_gemma3_8l")
}

/// An engine over a tiny checkpoint, single-threaded, exact arithmetic, with room for a few sequences.
fn engine(model: &std::path::Path, dtype: Dtype) -> Engine {
    let mut m = Model::from_hf_dir(model).expect("tiny checkpoint loads");
    m.configure(Precision::Exact, 1);
    Engine::new(m, dtype, 4, 96, 4).expect("engine")
}

/// A producer of a backend library, started by this package's `test-producer` binary, restarted without
/// backoff (so the request after a fault always finds a new producer) and `timeout` for start-up and each
/// request.
fn producer(engine: &Engine, backend: PathBuf, config: serde_json::Value, timeout: Duration) -> Producer {
    Producer::new(producer_spec(engine, backend, config, timeout), engine.kv.geometry().clone())
}

/// The spec [`producer`] starts.
fn producer_spec(engine: &Engine, backend: PathBuf, config: serde_json::Value, timeout: Duration) -> ProducerSpec {
    let name = backend.file_stem().unwrap().to_string_lossy().trim_start_matches("libpdhost_backend_").to_string();
    ProducerSpec {
        name,
        program: PathBuf::from(env!("CARGO_BIN_EXE_test-producer")),
        program_args: Vec::new(),
        backend,
        config: config.to_string(),
        slots: 2,
        slot_capacity: ProducerSpec::capacity_for(engine.kv.geometry(), Dtype::F32, 96),
        start_timeout: Duration::from_secs(30),
        request_timeout: timeout,
        restart: RestartPolicy {
            initial_backoff: Duration::ZERO,
            max_backoff: Duration::ZERO,
            max_restarts: 1000,
            window: Duration::from_secs(60),
        },
        sandbox: true,
        memory_limit: Some(MEMORY_LIMIT),
        identity: Some(engine.model.identity.to_string()),
    }
}

/// A built-in backend's library, configured for `model` and `dtype` plus `extra` keys.
fn builtin(name: &str) -> PathBuf {
    builtin_backend(name).expect("built-in backend library next to the test binary")
}

fn config(model: &std::path::Path, dtype: Dtype, extra: serde_json::Value) -> serde_json::Value {
    let mut c = serde_json::json!({"model": model, "dtype": dtype.name(), "precision": "exact", "threads": 1});
    c.as_object_mut().unwrap().extend(extra.as_object().cloned().unwrap_or_default());
    c
}

/// Every layer's K and V bytes (the positions each layer sees) for a sequence.
fn kv_bytes(engine: &Engine, seq: SeqId) -> Vec<(Vec<u8>, Vec<u8>)> {
    (0..engine.kv.geometry().layers.len() as u32).map(|l| engine.kv.read(seq, l).expect("layer").to_bytes()).collect()
}

/// What this process holds that a producer's life could leak.
#[derive(Debug, PartialEq, Eq)]
struct Snapshot {
    /// Targets of every open descriptor.
    fds: Vec<String>,
    /// Shared-memory mappings (memfds).
    memfd_maps: Vec<String>,
    /// Names in /dev/shm.
    dev_shm: Vec<String>,
    /// Child processes, zombies included.
    children: Vec<String>,
}

fn children() -> Vec<String> {
    let me = std::process::id().to_string();
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        // `pid (comm) state ppid ...`; comm may hold spaces, so split after the last ')'.
        let Some((head, rest)) = stat.rsplit_once(')') else { continue };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.get(1) == Some(&me.as_str()) {
            out.push(format!("{head}) {}", fields[0]));
        }
    }
    out.sort();
    out
}

fn snapshot() -> Snapshot {
    let mut fds: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|t| t.display().to_string())
        .collect();
    fds.sort();
    let memfd_maps = std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("memfd:"))
        .map(String::from)
        .collect();
    let mut dev_shm: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    dev_shm.sort();
    Snapshot { fds, memfd_maps, dev_shm, children: children() }
}

/// Resident memory of this process in bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    statm.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 4096
}
