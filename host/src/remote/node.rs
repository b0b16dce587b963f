//! The producer node: `pdhost producer-node`, on the prefill machine.
//!
//! Each connection is one relay's session, on a thread of its own. The session starts a producer
//! exactly as the host's supervisor does (same ABI, same sandbox, same deadlines), on a ring the node
//! creates at the epoch the relay's ring carries, with no restarts: a failure ends the session, and the
//! host's supervisor starts a new relay, which opens a new one. The ring's data segment is registered
//! with NIXL, so frames go from where the backend wrote them: for each prefill the node reads the
//! frame's header once and checks it, WRITEs the frame from its slot into the relay's slot with a
//! [`FrameNotice`] as the notification, waits for the transfer, hands the slot back and replies `Done`.
//! The payload is not copied or checksummed here: the host does both, as for any producer.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use pdhost_nixl::{Endpoint, ProtoLog, Registration, Runtime};
use pdhost_plugin_abi::PdhostStatus;
use pdhost_producer::protocol::{
    self, FrameNotice, FromProducer, Hello, LayerDesc, RemoteFailure, ToNode, LINK_VERSION,
};
use shm_format::ring::RingGeometry;
use shm_format::{HeaderInfo, KvGeometry};
use shm_ring::segment::memfd::MemfdSegment;
use shm_ring::segment::Segment;

use super::Fault;
use crate::supervisor::{Producer, ProducerError, ProducerSpec, RestartPolicy, Until};

/// How a node serves its sessions.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// The backend's name, which a relay's hello must name.
    pub name: String,
    /// Its library.
    pub backend: PathBuf,
    /// Keys merged over the configuration each relay sends (a model path on this machine, say).
    pub backend_config: serde_json::Map<String, serde_json::Value>,
    /// The program that runs producers (`pdhost`), and its arguments that select producer mode.
    pub program: PathBuf,
    /// Arguments before the producer's own.
    pub program_args: Vec<std::ffi::OsString>,
    /// The producers' seccomp filters.
    pub sandbox: bool,
    /// Their memory cap, in bytes.
    pub memory_limit: Option<u64>,
    /// Deadline for a producer's start and for each prefill.
    pub timeout: Duration,
    /// A fault to inject, for tests.
    pub fault: Option<Fault>,
    /// Where UCX reports the transports it chooses, if it does ([`ProtoLog::capture`]).
    pub protocols: Option<std::sync::Arc<ProtoLog>>,
}

/// Sessions served at once: each holds a producer and its model, so a node refuses more.
const MAX_SESSIONS: usize = 16;
/// How long a new connection has to say hello: one that says nothing does not hold a thread for ever.
const HELLO_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves relays on `listener` until the process ends: one thread per connection, up to
/// [`MAX_SESSIONS`] at once.
pub fn serve(listener: TcpListener, config: NodeConfig) -> std::io::Result<()> {
    let mut session = 0u64;
    let live = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for stream in listener.incoming() {
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("accepting a relay's connection: {e}");
                continue;
            }
        };
        session += 1;
        let config = config.clone();
        let peer = stream.peer_addr().map_or_else(|_| "?".to_string(), |a| a.to_string());
        if live.fetch_add(1, std::sync::atomic::Ordering::AcqRel) >= MAX_SESSIONS {
            live.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            tracing::warn!(session, %peer, "refused: {MAX_SESSIONS} sessions are live");
            let message = format!("sessions: expected at most {MAX_SESSIONS} at once, found them all live");
            let _ = refuse(&stream, "link", 0, message);
            continue;
        }
        let counted = std::sync::Arc::clone(&live);
        let spawned = std::thread::Builder::new().name(format!("session-{session}")).spawn(move || {
            // Counts the session out however it ends.
            struct Out(std::sync::Arc<std::sync::atomic::AtomicUsize>);
            impl Drop for Out {
                fn drop(&mut self) {
                    self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                }
            }
            let _out = Out(counted);
            tracing::info!(session, %peer, "relay connected");
            match run_session(&stream, &config, session) {
                Ok(()) => tracing::info!(session, %peer, "session over"),
                Err(e) => tracing::warn!(session, %peer, "session ended: {e}"),
            }
        });
        // No thread for it now (the process at its thread limit): this connection closes, and the node
        // goes on serving the others.
        if let Err(e) = spawned {
            live.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            tracing::warn!(session, "refused: no thread for the session: {e}");
        }
    }
    Ok(())
}

/// The geometry a host's shaped configuration carries (`layer_shapes`, docs/plugin-abi.md).
fn geometry_of(config: &serde_json::Map<String, serde_json::Value>) -> Result<KvGeometry, String> {
    let shapes = config
        .get("layer_shapes")
        .and_then(|v| v.as_array())
        .ok_or("expected the host's layer_shapes in the backend configuration, found none")?;
    let number = |v: &serde_json::Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
    let layers = shapes
        .iter()
        .map(|shape| {
            let s = shape.as_array().map(Vec::as_slice).unwrap_or_default();
            let (kind, heads, dim, window, state) = match s {
                [k, h, d] if k == "full" => (0, number(h), number(d), Some(0), Some(0)),
                [k, h, d, w] if k == "sliding" => (1, number(h), number(d), number(w), Some(0)),
                [k, e] if k == "recurrent" => (2, Some(0), Some(0), Some(0), e.as_u64()),
                _ => (u32::MAX, None, None, None, None),
            };
            match (heads, dim, window, state) {
                (Some(kv_heads), Some(head_dim), Some(window), Some(state_elems)) if kind != u32::MAX => {
                    Ok(LayerDesc { kind, kv_heads, head_dim, window, state_elems })
                }
                _ => Err(format!("layer_shapes: expected [\"full\"|\"sliding\"|\"recurrent\", ...], found {shape}")),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    protocol::Described { layers, ..Default::default() }.geometry().map_err(|e| e.to_string())
}

/// What ends a session.
#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("the relay's connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Refused(String),
}

/// Refuses a session at start: the relay passes the `StartFailed` to its host.
fn refuse(stream: &TcpStream, stage: &str, status: u32, message: String) -> SessionError {
    let _ =
        protocol::send(stream, &FromProducer::StartFailed { stage: stage.into(), status, message: message.clone() });
    SessionError::Refused(format!("{stage}: {message}"))
}

fn run_session(stream: &TcpStream, config: &NodeConfig, session: u64) -> Result<(), SessionError> {
    let _ = stream.set_nodelay(true);
    // A relay whose machine vanished sends no FIN: keepalive probes (after a minute idle, 3 of them 10 s
    // apart) and a bound on unacknowledged data end the session, its producer and its slot.
    let _ = rustix::net::sockopt::set_socket_keepalive(stream, true);
    let _ = rustix::net::sockopt::set_tcp_keepidle(stream, Duration::from_secs(60));
    let _ = rustix::net::sockopt::set_tcp_keepintvl(stream, Duration::from_secs(10));
    let _ = rustix::net::sockopt::set_tcp_keepcnt(stream, 3);
    let _ = rustix::net::sockopt::set_tcp_user_timeout(stream, 90_000);
    // The whole hello within HELLO_WAIT, however slowly it comes; after it, a relay may rightly be idle
    // between requests for long.
    let hello = protocol::recv::<ToNode>(Until::new(stream, Instant::now() + HELLO_WAIT), protocol::MAX_HELLO);
    stream.set_read_timeout(None)?;
    let hello = match hello {
        Ok(Some(ToNode::Hello(h))) => h,
        Ok(Some(_)) => return Err(refuse(stream, "link", 0, "expected a hello first, found another message".into())),
        Ok(None) => return Ok(()),
        Err(e) => return Err(refuse(stream, "link", 0, e.to_string())),
    };
    if hello.version != LINK_VERSION {
        let message = format!("link version: expected {LINK_VERSION}, found {}", hello.version);
        return Err(refuse(stream, "link", 0, message));
    }
    if hello.backend != config.name {
        let message = format!("backend: expected {} (what this node runs), found {}", config.name, hello.backend);
        return Err(refuse(stream, "load", PdhostStatus::BadConfig as u32, message));
    }
    let Ok(serde_json::Value::Object(mut backend_config)) = serde_json::from_str(&hello.config) else {
        return Err(refuse(stream, "link", 0, "config: expected a JSON object, found other text".into()));
    };
    let geometry = geometry_of(&backend_config).map_err(|e| refuse(stream, "link", 0, e))?;
    let ring =
        RingGeometry::new(hello.slots, hello.slot_capacity).map_err(|e| refuse(stream, "link", 0, e.to_string()))?;
    if ring.data_len() != hello.data_len {
        let message =
            format!("ring: expected {} data bytes for its geometry, found {}", ring.data_len(), hello.data_len);
        return Err(refuse(stream, "link", 0, message));
    }
    // Every WRITE lands at `data_addr` plus an offset inside the ring: checked once here.
    if hello.data_addr.checked_add(hello.data_len).is_none() {
        let message = format!(
            "ring: expected a data address whose {} bytes end below 2^64, found {:#x}",
            hello.data_len, hello.data_addr
        );
        return Err(refuse(stream, "link", 0, message));
    }
    // The node allocates and prefaults a session's ring itself, before its producer starts: a peer's hello
    // may ask for 1024 slots of 16 GiB. A ring is held to what the node lets one producer have
    // (`--producer-memory`, by default half of this machine's memory).
    if let Some(cap) = config.memory_limit.filter(|&cap| ring.data_len() > cap) {
        let message = format!(
            "ring: expected at most {cap} data bytes (the node's --producer-memory), found {}",
            ring.data_len()
        );
        return Err(refuse(stream, "link", 0, message));
    }
    backend_config.extend(config.backend_config.clone());
    let spec = ProducerSpec {
        name: config.name.clone(),
        program: config.program.clone(),
        program_args: config.program_args.clone(),
        backend: config.backend.clone(),
        config: serde_json::Value::Object(backend_config).to_string(),
        slots: hello.slots,
        slot_capacity: hello.slot_capacity,
        start_timeout: config.timeout,
        request_timeout: config.timeout,
        // A failure ends the session; the host starts a new one.
        restart: RestartPolicy { max_restarts: 0, ..RestartPolicy::default() },
        sandbox: config.sandbox,
        memory_limit: config.memory_limit,
        // The host checks the identity the backend reports, which reaches it in the Ready message.
        identity: None,
    };
    let mut producer = Producer::new(spec, geometry);
    // A stale frame is one that a producer of an earlier epoch wrote.
    let stale = config.fault == Some(Fault::StaleEpoch);
    producer.set_next_epoch(if stale { hello.epoch.wrapping_sub(1) } else { hello.epoch });
    if let Err(e) = producer.start() {
        let (stage, status, message) = match e {
            ProducerError::StartFailed { stage, status, message, .. } => (stage, status, message),
            other => ("start".to_string(), 0, other.to_string()),
        };
        return Err(refuse(stream, &stage, status, message));
    }
    let transfer = Transfer::new(&hello, ring, &producer, session).map_err(|e| refuse(stream, "nixl", 0, e))?;
    transfer.warm_up().map_err(|e| refuse(stream, "nixl", 0, e))?;
    let mut described = producer.described().expect("started").clone();
    described.transport = config.protocols.as_ref().and_then(|log| log.write_transport(&transfer.agent));
    let transport = described.transport.as_deref().unwrap_or("not reported (UCX_PROTO_INFO or UCX_LOG_FILE set)");
    tracing::info!(session, transport, "frames go by UCX");
    protocol::send(stream, &FromProducer::Ready(described))?;
    let served = serve_requests(stream, config, &mut producer, transfer);
    producer.shutdown();
    served
}

/// The node's side of the transfers of one session. Frames go from where the backend wrote them: the
/// producer's ring data segment is registered with NIXL, and each WRITE reads its slot in place.
struct Transfer {
    /// Declared (so dropped) before the mapping it names.
    frames: Registration,
    /// The node's own read-only mapping of the producer's ring data segment, which outlives the
    /// producer (a failed one is killed and its ring unmapped before the session ends). A session
    /// allows no restart, so its producer never moves to another ring.
    _mapping: MemfdSegment,
    endpoint: Endpoint,
    /// The endpoint's agent name, as UCX's reports name it.
    agent: String,
    peer: String,
    ring: RingGeometry,
    data_addr: u64,
}

impl Transfer {
    fn new(hello: &Hello, ring: RingGeometry, producer: &Producer, session: u64) -> Result<Transfer, String> {
        let runtime = Runtime::fetch(&model::registry::home()).map_err(|e| e.to_string())?;
        runtime.load().map_err(|e| e.to_string())?;
        let agent = format!("pdhost-node-{}-s{session}", std::process::id());
        let endpoint = Endpoint::new(&agent).map_err(|e| e.to_string())?;
        let mapping = producer.map_data_segment().map_err(|e| e.to_string())?;
        // SAFETY: `mapping` lives in this struct beside the registration and is dropped after it (field
        // order). It is read-only and only WRITEs read it: no peer gets this endpoint's metadata, and
        // this process forms no reference over it.
        let frames = unsafe { endpoint.register(mapping.base().as_ptr(), mapping.len()) }.map_err(|e| e.to_string())?;
        let peer = endpoint.add_peer(&hello.agent_metadata).map_err(|e| e.to_string())?;
        Ok(Transfer { frames, _mapping: mapping, endpoint, agent, peer, ring, data_addr: hello.data_addr })
    }
}

/// How long the node waits for one transfer to complete.
const TRANSFER_WAIT: Duration = Duration::from_secs(60);

fn serve_requests(
    stream: &TcpStream,
    config: &NodeConfig,
    producer: &mut Producer,
    transfer: Transfer,
) -> Result<(), SessionError> {
    let mut fault = config.fault;
    loop {
        let (call, slot, sequence) = match protocol::recv::<ToNode>(stream, protocol::MAX_TO_NODE) {
            Ok(Some(ToNode::Prefill { call, slot, generation: _, sequence })) => (call, slot, sequence),
            Ok(Some(ToNode::Release { request_id })) => {
                producer.release(request_id);
                continue;
            }
            Ok(Some(ToNode::Shutdown)) | Ok(None) => return Ok(()),
            Ok(Some(ToNode::Hello(_))) => return Err(SessionError::Refused("a second hello".into())),
            Err(e) => return Err(SessionError::Refused(e.to_string())),
        };
        let request_id = call.request_id;
        let broken = |message: String| {
            let _ = protocol::send(
                stream,
                &FromProducer::Remote { request_id, failure: RemoteFailure::Node, message: message.clone() },
            );
            SessionError::Refused(message)
        };
        if producer.next_sequence() != Some(sequence) || transfer.ring.slot_of(sequence) != slot {
            return Err(broken(format!(
                "frame: expected sequence {:?} in slot {}, found sequence {sequence} in slot {slot}",
                producer.next_sequence(),
                transfer.ring.slot_of(sequence)
            )));
        }
        let pending = match producer.submit(&call) {
            Ok(p) => p,
            // The backend said no, and keeps running: the host hears it as from a local producer.
            Err(ProducerError::Backend { status, message, .. }) => {
                let status = (0..).map_while(PdhostStatus::from_raw).find(|s| s.name() == status);
                let status = status.unwrap_or(PdhostStatus::BackendError) as u32;
                protocol::send(stream, &FromProducer::Failed { request_id, status, message })?;
                continue;
            }
            Err(ProducerError::Unwritten { message, .. }) => {
                protocol::send(stream, &FromProducer::Unwritten { request_id, message })?;
                continue;
            }
            Err(e) => return Err(broken(e.to_string())),
        };
        let (backend_ns, frame_ns) = pending.producer_ns();
        let injected = fault.take();
        if injected == Some(Fault::DropConnection) {
            return Err(SessionError::Refused("fault injected: connection dropped".into()));
        }
        let forwarded = producer.forward_frame(pending, |offset, info| transfer.send(offset, slot, info, injected));
        match forwarded {
            Ok(_) => {}
            Err(ProducerError::Remote { failure, message, .. }) => {
                let _ = protocol::send(stream, &FromProducer::Remote { request_id, failure, message: message.clone() });
                return Err(SessionError::Refused(message));
            }
            Err(e) => return Err(broken(e.to_string())),
        }
        protocol::send(stream, &FromProducer::Done { request_id, sequence, backend_ns, frame_ns })?;
    }
}

impl Transfer {
    /// A first WRITE, before the Ready reply: UCX connects and chooses its protocols now, not during the
    /// first prefill's transfer. It copies slot 0's header bytes over the relay's slot 0, which holds no
    /// frame yet (nothing is committed before the first prefill) and is read only after a notice.
    fn warm_up(&self) -> Result<(), String> {
        let (at, len) = (self.ring.frame_offset(0), shm_format::HEADER_LEN);
        let write = self.endpoint.write_silently(&self.peer, &self.frames, at as usize, self.data_addr + at, len);
        wait(write.map_err(|e| e.to_string())?, "the first WRITE, before any frame")
    }

    /// WRITEs the frame at `offset` in the producer's ring into the relay's `slot`, announced by a
    /// notice, and waits for the transfer (or does what `fault` says instead).
    fn send(&self, offset: u64, slot: u32, frame: &HeaderInfo, fault: Option<Fault>) -> Result<(), String> {
        let (mut slot_to, mut len) = (slot, frame.frame_len);
        match fault {
            Some(Fault::WrongSlot) => slot_to = (slot + 1) % self.ring.slot_count(),
            Some(Fault::Truncate) => len = frame.frame_len / 2,
            _ => {}
        }
        let notice =
            FrameNotice { epoch: frame.producer_epoch, sequence: frame.sequence, slot: slot_to, frame_len: len }
                .encode();
        let (at, remote) = (offset as usize, self.data_addr + self.ring.frame_offset(slot_to));
        let what = format!("frame {}", frame.sequence);
        let write = |at: usize, remote: u64, len: u64, notice: Option<&[u8]>| {
            match notice {
                Some(notice) => self.endpoint.write(&self.peer, &self.frames, at, remote, len as usize, notice),
                None => self.endpoint.write_silently(&self.peer, &self.frames, at, remote, len as usize),
            }
            .map_err(|e| e.to_string())
        };
        match fault {
            Some(Fault::NotificationOnly) => self.endpoint.notify(&self.peer, &notice).map_err(|e| e.to_string()),
            Some(Fault::NoNotification) => wait(write(at, remote, len, None)?, &what),
            Some(Fault::Corrupt) => {
                wait(write(at, remote, len, None)?, &what)?;
                wait(write(at, remote + len - 8, 8, Some(&notice))?, &what)
            }
            Some(Fault::Exit) => {
                let _in_flight = write(at, remote, len, Some(&notice))?;
                std::process::exit(9)
            }
            _ => wait(write(at, remote, len, Some(&notice))?, &what),
        }
    }
}

/// Waits for `transfer` (`what` it carries, for the error) to complete, within [`TRANSFER_WAIT`].
fn wait(transfer: pdhost_nixl::Transfer<'_>, what: impl std::fmt::Display) -> Result<(), String> {
    let deadline = Instant::now() + TRANSFER_WAIT;
    let mut pause = Duration::from_micros(20);
    while !transfer.done().map_err(|e| e.to_string())? {
        if Instant::now() > deadline {
            return Err(format!("{what}: the transfer did not complete within {} s", TRANSFER_WAIT.as_secs()));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(1));
    }
    Ok(())
}
