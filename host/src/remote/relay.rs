//! The relay: `pdhost __relay --node HOST:PORT` plus a producer's own flags (`--backend NAME --config
//! JSON --parent-pid PID --fds ...`). The supervisor starts it exactly as it starts a local producer.
//!
//! It registers its mapping of the ring's data segment with NIXL, connects to the node, sends the
//! [`Hello`], and then for each prefill: reserves the slot (waiting for the host's grant as a producer
//! does), asks the node for the frame, waits for the node's reply and for the notification that follows
//! the frame's bytes, checks that the slot holds the announced frame, commits it and rings the host. The
//! host then checks the frame as it checks any producer's.
//!
//! Every failure of the link ends the relay after one [`FromProducer::Remote`] reply naming it; the
//! supervisor restarts it with backoff, at a new epoch.

use std::ffi::OsString;
use std::net::TcpStream;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use pdhost_nixl::{Endpoint, Runtime};
use pdhost_producer::protocol::{
    self, FrameNotice, FromProducer, Hello, PrefillCall, RemoteFailure, ToNode, ToProducer, LINK_VERSION,
};
use shm_format::{HeaderInfo, RingExpectation, HEADER_LEN};
use shm_ring::segment::memfd::MemfdSegment;
use shm_ring::RingWriter;

use super::NodeUrl;

/// How long the relay waits for the host to hand a slot back (as a local producer does).
const SLOT_WAIT: Duration = Duration::from_secs(30);
/// How long connecting to the node may take.
const CONNECT_WAIT: Duration = Duration::from_secs(10);
/// How long the relay waits for a frame's notification after the node said it was sent. The host's own
/// deadline for the request is usually shorter and ends the relay first.
const NOTICE_WAIT: Duration = Duration::from_secs(60);

/// The relay's command line.
#[derive(Debug)]
struct Args {
    node: String,
    backend: String,
    config: String,
    parent: Option<i32>,
    fds: [i32; 5],
}

fn parse(args: Vec<OsString>) -> Result<Args, String> {
    let mut it = args.into_iter().map(|a| a.to_string_lossy().into_owned());
    let (mut node, mut backend, mut config, mut parent, mut fds) = (None, None, "{}".to_string(), None, None);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag}: expected a value, found the end of the arguments"));
        match flag.as_str() {
            "--node" => node = Some(value()?),
            "--backend" => backend = Some(value()?),
            "--config" => config = value()?,
            "--parent-pid" => {
                let v = value()?;
                parent = Some(v.parse().map_err(|_| format!("--parent-pid: expected a pid, found {v:?}"))?);
            }
            "--fds" => fds = Some(pdhost_producer::parse_fds(&value()?)?),
            // The node confines its own producer; the relay runs no vendor code.
            "--sandbox" | "--memory-limit" => {
                value()?;
            }
            other => return Err(format!("unexpected argument {other:?}")),
        }
    }
    Ok(Args {
        node: node.ok_or("expected --node HOST:PORT, found none")?,
        backend: backend.ok_or("expected --backend NAME, found none")?,
        config,
        parent,
        fds: fds.ok_or("expected --fds, found none")?,
    })
}

/// Why the relay stops.
enum Stop {
    /// Start-up failed: sent as `StartFailed` at `stage`.
    Start(&'static str, String),
    /// A request could not be delivered: sent as `Remote`.
    Request(u64, RemoteFailure, String),
    /// The host went away or said to stop.
    Done,
}

/// Runs a relay; `args` excludes the program name and `__relay`.
pub fn main(args: Vec<OsString>) -> ExitCode {
    let args = match parse(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("pdhost relay: {e}");
            return ExitCode::from(2);
        }
    };
    pdhost_producer::confine(args.parent);
    let fds = match pdhost_producer::adopt_fds(args.fds) {
        Ok(fds) => fds,
        Err(e) => {
            eprintln!("pdhost relay: {e}");
            return ExitCode::from(2);
        }
    };
    let [control, data, to_host, from_host, socket] = fds;
    let socket = UnixStream::from(socket);
    let reply = match serve(&args, [control, data, to_host, from_host], &socket) {
        Stop::Done => return ExitCode::SUCCESS,
        Stop::Start(stage, message) => FromProducer::StartFailed { stage: stage.into(), status: 0, message },
        Stop::Request(request_id, failure, message) => FromProducer::Remote { request_id, failure, message },
    };
    if protocol::send(&socket, &reply).is_err() {
        // The host is gone: the reason goes to stderr, in words.
        match &reply {
            FromProducer::StartFailed { stage, message, .. } => eprintln!("pdhost relay: {stage}: {message}"),
            FromProducer::Remote { request_id, message, .. } => {
                eprintln!("pdhost relay: request {request_id}: {message}")
            }
            other => eprintln!("pdhost relay: {}", other.summary()),
        }
    }
    ExitCode::from(3)
}

/// The link to one node: its connection, the NIXL endpoint and the registered ring.
struct Link<'a> {
    node: &'a str,
    tcp: TcpStream,
    endpoint: &'a Endpoint,
    /// Notifications received and not yet looked at, oldest first.
    notices: std::cell::RefCell<std::collections::VecDeque<(String, Vec<u8>)>>,
}

impl Link<'_> {
    fn send(&self, message: &ToNode) -> std::io::Result<()> {
        protocol::send(&self.tcp, message)
    }

    /// The node's next message; a closed or broken connection and a malformed message are named.
    fn recv(&self, while_: &str) -> Result<FromProducer, (RemoteFailure, String)> {
        match protocol::recv::<FromProducer>(&self.tcp, protocol::MAX_FROM_NODE) {
            Ok(Some(m)) => Ok(m),
            Ok(None) => {
                Err((RemoteFailure::Connection, format!("node {} closed the connection while {while_}", self.node)))
            }
            Err(protocol::RecvError::Message(e)) => Err((RemoteFailure::Node, format!("node {}: {e}", self.node))),
            Err(e) => Err((RemoteFailure::Connection, format!("node {} while {while_}: {e}", self.node))),
        }
    }
}

fn serve(args: &Args, ring_fds: [OwnedFd; 4], socket: &UnixStream) -> Stop {
    let mut ring = match RingWriter::open(ring_fds) {
        Ok(r) => r,
        Err(e) => return Stop::Start("ring", e.to_string()),
    };
    if let Err(e) = Runtime::fetch(&model::registry::home()).and_then(|r| r.load()) {
        return Stop::Start("nixl", e.to_string());
    }
    let epoch = ring.epoch();
    let endpoint = match Endpoint::new(&format!("pdhost-relay-{}-e{epoch}", std::process::id())) {
        Ok(e) => e,
        Err(e) => return Stop::Start("nixl", e.to_string()),
    };
    let (base, len) = ring.data_region();
    // SAFETY: the data segment stays mapped, readable and writable, for as long as `ring` lives, which
    // outlives the registration (dropped first, at the end of this function). This process reads it only
    // through the segment's volatile copies (`SlotWriter::read_frame`) and the commit word's atomics.
    let registration = match unsafe { endpoint.register(base.as_ptr(), len) } {
        Ok(r) => r,
        Err(e) => return Stop::Start("nixl", e.to_string()),
    };
    let agent_metadata = match endpoint.metadata() {
        Ok(m) => m,
        Err(e) => return Stop::Start("nixl", e.to_string()),
    };
    let tcp = match NodeUrl::resolve(&args.node).and_then(|a| TcpStream::connect_timeout(&a, CONNECT_WAIT)) {
        Ok(t) => t,
        Err(e) => return Stop::Start("connect", format!("connecting to producer node {}: {e}", args.node)),
    };
    let _ = tcp.set_nodelay(true);
    let link = Link { node: &args.node, tcp, endpoint: &endpoint, notices: Default::default() };
    let geometry = ring.geometry();
    let hello = Hello {
        version: LINK_VERSION,
        backend: args.backend.clone(),
        config: args.config.clone(),
        epoch,
        slots: geometry.slot_count(),
        slot_capacity: geometry.frame_capacity(),
        agent_metadata,
        data_addr: registration.addr(),
        data_len: registration.len() as u64,
    };
    if let Err(e) = link.send(&ToNode::Hello(hello)) {
        return Stop::Start("connect", format!("sending the hello to producer node {}: {e}", args.node));
    }
    match link.recv("starting") {
        Ok(FromProducer::Ready(mut described)) => {
            // Calls reach the node one at a time: the host sends this relay no batches.
            described.batches = false;
            if protocol::send(socket, &FromProducer::Ready(described)).is_err() {
                return Stop::Done;
            }
        }
        // The node's own start-up failure, passed on as it is.
        Ok(failed @ FromProducer::StartFailed { .. }) => {
            let _ = protocol::send(socket, &failed);
            return Stop::Done;
        }
        Ok(other) => {
            return Stop::Start("connect", format!("expected a Ready message from the node, found {}", other.summary()))
        }
        Err((_, message)) => return Stop::Start("connect", message),
    }
    loop {
        let call = match protocol::recv::<ToProducer>(socket, protocol::MAX_TO_PRODUCER) {
            Ok(Some(ToProducer::Prefill(call))) => call,
            Ok(Some(ToProducer::Release { request_id })) => {
                // No reply is awaited: a broken connection is found out, and named, by the next request.
                let _ = link.send(&ToNode::Release { request_id });
                continue;
            }
            // Never sent to a relay (its Ready says it takes none): the host broke the protocol.
            Ok(Some(ToProducer::PrefillBatch(_))) | Ok(Some(ToProducer::Shutdown)) | Ok(None) | Err(_) => {
                let _ = link.send(&ToNode::Shutdown);
                return Stop::Done;
            }
        };
        let request_id = call.request_id;
        match deliver(&link, &mut ring, call) {
            Ok(reply) => {
                if protocol::send(socket, &reply).is_err() {
                    return Stop::Done;
                }
            }
            Err((failure, message)) => return Stop::Request(request_id, failure, message),
        }
    }
}

/// One prefill through the node: the reply to send the host, or why the link failed.
fn deliver(
    link: &Link<'_>,
    ring: &mut RingWriter<MemfdSegment, MemfdSegment>,
    call: PrefillCall,
) -> Result<FromProducer, (RemoteFailure, String)> {
    let request_id = call.request_id;
    let epoch = ring.epoch();
    let capacity = ring.geometry().frame_capacity();
    let slot = match ring.reserve(Instant::now() + SLOT_WAIT) {
        Ok(s) => s,
        Err(e) => {
            // The host did not hand the slot back: its own fault, reported as a local producer would.
            return Ok(FromProducer::Failed {
                request_id,
                status: pdhost_plugin_abi::PdhostStatus::BackendError as u32,
                message: format!("relay: {e}"),
            });
        }
    };
    let coords = slot.coords();
    let index = slot.slot();
    let prefill = ToNode::Prefill { call, slot: index, generation: coords.generation, sequence: coords.sequence };
    link.send(&prefill).map_err(|e| (RemoteFailure::Connection, format!("node {}: {e}", link.node)))?;
    let reply = link.recv(&format!("prefilling request {request_id}"))?;
    match reply {
        FromProducer::Done { request_id: r, sequence, .. } if r == request_id && sequence == coords.sequence => {}
        FromProducer::Failed { request_id: r, .. } | FromProducer::Unwritten { request_id: r, .. }
            if r == request_id =>
        {
            // Nothing was sent: the slot stays this relay's, uncommitted, for the next frame.
            return Ok(reply);
        }
        FromProducer::Remote { request_id: r, failure, message } if r == request_id => {
            return Err((failure, format!("node {}: {message}", link.node)))
        }
        other => {
            return Err((
                RemoteFailure::Node,
                format!(
                    "node {}: expected a Done or Failed reply for request {request_id} (frame {}), found {}",
                    link.node,
                    coords.sequence,
                    other.summary()
                ),
            ))
        }
    }
    let notice = link.await_notice(coords.sequence)?;
    if notice.epoch != epoch {
        return Err((
            RemoteFailure::StaleEpoch,
            format!("frame notification: expected epoch {epoch}, found epoch {} (a stale frame)", notice.epoch),
        ));
    }
    if notice.sequence != coords.sequence {
        return Err((
            RemoteFailure::StaleEpoch,
            format!(
                "frame notification: expected frame {}, found frame {} (a stale frame)",
                coords.sequence, notice.sequence
            ),
        ));
    }
    if notice.slot != index {
        return Err((
            RemoteFailure::WrongSlot,
            format!(
                "frame notification for frame {}: expected slot {index}, found slot {}",
                coords.sequence, notice.slot
            ),
        ));
    }
    // The slot must hold the frame the notice announced: read its header once, here, as the host will.
    let mut header = [0u8; HEADER_LEN];
    slot.read_frame(0, &mut header);
    let expect = RingExpectation {
        producer_epoch: epoch,
        slot_generation: coords.generation,
        sequence: coords.sequence,
        slot_capacity: capacity,
    };
    let no_frame = |e| {
        (
            RemoteFailure::NotificationWithoutData,
            format!(
                "slot {index}: the notification for frame {} arrived, but the slot holds no such frame: {e}",
                coords.sequence
            ),
        )
    };
    let info = HeaderInfo::parse(&header).map_err(no_frame)?;
    if info.producer_epoch != epoch {
        return Err((
            RemoteFailure::StaleEpoch,
            format!(
                "slot {index}: expected frame {} of epoch {epoch}, found a frame of epoch {} (a stale frame)",
                coords.sequence, info.producer_epoch
            ),
        ));
    }
    expect.check(&info).map_err(no_frame)?;
    if notice.frame_len < info.frame_len {
        return Err((
            RemoteFailure::Truncated,
            format!(
                "slot {index}: frame {}: expected {} bytes written, as its header says, found {} announced",
                coords.sequence, info.frame_len, notice.frame_len
            ),
        ));
    }
    slot.commit();
    Ok(reply)
}

impl Link<'_> {
    /// Waits for the next frame notice. A notification that is not one is the node's error.
    fn await_notice(&self, sequence: u64) -> Result<FrameNotice, (RemoteFailure, String)> {
        let deadline = Instant::now() + NOTICE_WAIT;
        let mut pause = Duration::from_micros(20);
        let mut notices = self.notices.borrow_mut();
        loop {
            if let Some((sender, payload)) = notices.pop_front() {
                return FrameNotice::decode(&payload).ok_or_else(|| {
                    (
                        RemoteFailure::Node,
                        format!(
                            "node {} ({sender}): expected a frame notice, found a {}-byte notification that is \
                             not one",
                            self.node,
                            payload.len()
                        ),
                    )
                });
            }
            if Instant::now() > deadline {
                return Err((
                    RemoteFailure::Transfer,
                    format!(
                        "node {}: frame {sequence} sent, but no notification within {} s",
                        self.node,
                        NOTICE_WAIT.as_secs()
                    ),
                ));
            }
            notices.extend(self.endpoint.notifications().map_err(|e| (RemoteFailure::Transfer, e.to_string()))?);
            if notices.is_empty() {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(1));
            }
        }
    }
}
