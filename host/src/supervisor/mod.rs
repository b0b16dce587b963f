//! The supervisor: one producer subprocess per backend, started with host-created sealed rings, watched
//! through a pidfd, given a deadline on every wait, killed when it breaks the protocol, and restarted with
//! backoff, at most so many times per window.
//!
//! A request's prefill goes: [`Producer::prefill`] sends the tokens over the control socket; the producer
//! has the backend write K/V into a ring slot and commits it; the reply names the frame; the host takes the
//! frame from the ring straight into the sequence's pages ([`IntoSequence`]), validating everything on the
//! way, and commits the span in one step or leaves the cache exactly as it was.

mod error;
mod process;
mod restarts;
#[cfg(test)]
mod tests;
mod until;

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pdhost_plugin_abi::PdhostStatus;
pub use pdhost_producer::protocol::PrefillCall;
use pdhost_producer::protocol::{self, BadDescription, Described, FromProducer, RecvError, RemoteFailure, ToProducer};
use rustix::event::{PollFd, PollFlags};
use shm_format::ring::RingGeometry;
use shm_format::{Dtype, Fingerprint, KvGeometry, LayerKv};
use shm_ring::segment::memfd::MemfdSegment;
use shm_ring::{create_ring, TakeError};

pub use self::error::ProducerError;
pub use self::process::harden_host;
use self::process::{
    config_with_shape, inheritable, log_output, peak_memory, signal_name, wait_readable, Ready, Running,
};
pub use self::restarts::RestartPolicy;
use self::restarts::{Refused, Restarts};
pub(crate) use self::until::Until;
use crate::kv::{IngestError, IntoSequence, PagedKv, SeqId};

/// Everything needed to start a producer.
#[derive(Clone, Debug)]
pub struct ProducerSpec {
    /// A name for messages and metrics (`rngd`, `gpu`, `faulty`, or the library's file name).
    pub name: String,
    /// The program that runs the producer, and the arguments that select it (`pdhost __producer`).
    pub program: PathBuf,
    /// Arguments before the producer's own.
    pub program_args: Vec<OsString>,
    /// The backend library.
    pub backend: PathBuf,
    /// The backend's configuration JSON.
    pub config: String,
    /// Ring slots.
    pub slots: u32,
    /// Largest frame a slot holds.
    pub slot_capacity: u64,
    /// Deadline for start-up (load, open, describe).
    pub start_timeout: Duration,
    /// Deadline for each prefill request.
    pub request_timeout: Duration,
    /// Restarts.
    pub restart: RestartPolicy,
    /// The producer's seccomp filters, on once its backend is open (`pdhost_producer::sandbox`).
    pub sandbox: bool,
    /// The producer's cap on private memory (`RLIMIT_DATA`), in bytes.
    pub memory_limit: Option<u64>,
    /// The identity of the model the host runs (`model::identity`): a backend that reports another is
    /// refused at the handshake. `None`: not checked.
    pub identity: Option<String>,
}

impl ProducerSpec {
    /// Ring bytes per slot for spans of up to `tokens` tokens of `geometry` in `dtype`, with room for the
    /// header and manifest.
    pub fn capacity_for(geometry: &KvGeometry, dtype: Dtype, tokens: u64) -> u64 {
        span_bytes(geometry, dtype, tokens.max(1)) + (256 << 10)
    }

    /// A spec no process is ever started from, for checking what a producer says against it (the
    /// handshake's checks in tests and fuzzing): named `name`, expecting model `identity`.
    pub(crate) fn unstarted(name: &str, identity: Option<String>) -> Self {
        ProducerSpec {
            name: name.into(),
            program: "/nonexistent".into(),
            program_args: Vec::new(),
            backend: "/nonexistent.so".into(),
            config: "{}".into(),
            slots: 2,
            slot_capacity: 1 << 20,
            start_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(1),
            restart: RestartPolicy::default(),
            sandbox: true,
            memory_limit: None,
            identity,
        }
    }
}

/// Payload bytes of a span of `tokens` tokens of `geometry` in `dtype` (K and V of every attention layer,
/// plus every recurrent state).
pub fn span_bytes(geometry: &KvGeometry, dtype: Dtype, tokens: u64) -> u64 {
    let elems: u64 = geometry
        .layers
        .iter()
        .map(|l| match *l {
            LayerKv::Full { kv_heads, head_dim } | LayerKv::Sliding { kv_heads, head_dim, .. } => {
                2 * u64::from(kv_heads) * u64::from(head_dim) * tokens
            }
            LayerKv::Recurrent { state_elems } => state_elems,
        })
        .sum();
    elems * dtype.size()
}

/// Per-producer counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Metrics {
    /// Spans validated and committed.
    pub spans_accepted: u64,
    /// Spans (or attempts) refused, by typed reason.
    pub spans_rejected: BTreeMap<&'static str, u64>,
    /// Producer processes started, the first included.
    pub starts: u64,
    /// Starts after a failure.
    pub restarts: u64,
    /// K/V payload bytes accepted.
    pub bytes: u64,
}

/// What one remote span cost, as measured on both sides.
#[derive(Clone, Copy, Debug, Default)]
pub struct SpanTimes {
    /// Inside the backend's `prefill` (compute and writing K/V into the slot).
    pub backend: Duration,
    /// The producer's framing: slot wait, header and manifest, checksum, commit.
    pub frame: Duration,
    /// Taking the frame from the ring into pages: copy, checksum, validation, commit.
    pub take: Duration,
    /// From sending the request to having the span: the rest is IPC and scheduling.
    pub round_trip: Duration,
    /// Payload bytes.
    pub bytes: u64,
    /// Prompt tokens the span carries: the call's, or the first `max_tokens` of them when the call asked
    /// the backend for more than it takes at once.
    pub tokens: u64,
}

impl SpanTimes {
    /// Round trip not accounted for by the backend, the framing or the take: request and reply IPC.
    pub fn ipc(&self) -> Duration {
        self.round_trip.saturating_sub(self.backend + self.frame + self.take)
    }
}

/// A producer's reply to [`Producer::submit`]: its span is committed in the ring, waiting for
/// [`Producer::take`].
#[derive(Debug)]
pub struct Pending {
    /// The request it answers.
    pub request_id: u64,
    /// Where its span must end: the asked chunk's start and the tokens sent.
    end: u64,
    /// Tokens sent: the call's, at most the backend's `max_tokens`.
    tokens: u64,
    sequence: u64,
    /// The epoch of the process that announced it: a restarted process's ring numbers its frames from 0
    /// again, so the sequence alone could match another process's frame.
    epoch: u64,
    backend_ns: u64,
    frame_ns: u64,
    started: Instant,
}

impl Pending {
    /// The ring sequence number of the frame the reply announced.
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// Nanoseconds inside the backend's `prefill`, and in the producer's framing, as it reported them.
    pub fn producer_ns(&self) -> (u64, u64) {
        (self.backend_ns, self.frame_ns)
    }
}

/// One supervised producer.
///
/// Start and use a `Producer` from one long-lived thread: the kernel's parent-death signal fires when the
/// *thread* that spawned the process exits, so a producer started from a short-lived thread would be
/// killed with it.
#[derive(Debug)]
pub struct Producer {
    spec: ProducerSpec,
    geometry: KvGeometry,
    running: Option<Running>,
    next_epoch: u64,
    metrics: Metrics,
    /// Backoff and the restart cap.
    restarts: Restarts,
    /// Set by a start failure that every start would repeat: its kind and text.
    start_refused: Option<(&'static str, String)>,
    /// Why the process stopped while calls of its batch were still awaited: what each of them fails with.
    broken: Option<String>,
    /// The last failure (its kind and text), which a request refused in the backoff after it is told.
    last_failure: Option<String>,
}

/// What the reply to a call sent must say.
#[derive(Debug)]
pub(crate) struct Awaited {
    request_id: u64,
    /// Where its span must end: the call's start and the tokens sent.
    end: u64,
    /// Tokens sent: the call's, at most the backend's `max_tokens`.
    tokens: u64,
}

impl Producer {
    /// A supervisor for producers of `spec`, serving a cache of `geometry`. Nothing starts until the first
    /// request (or [`Producer::start`]).
    pub fn new(spec: ProducerSpec, geometry: KvGeometry) -> Self {
        Producer {
            spec,
            geometry,
            running: None,
            next_epoch: 1,
            metrics: Metrics::default(),
            restarts: Restarts::default(),
            start_refused: None,
            broken: None,
            last_failure: None,
        }
    }

    /// Makes the next process start at `epoch` (and those after it count up from there): a producer node
    /// runs its ring at the epoch its host chose, so that frames carry the coordinates the host expects.
    pub fn set_next_epoch(&mut self, epoch: u64) {
        self.next_epoch = epoch;
    }

    /// Whether a request given now would be refused without a process being asked, and for how long:
    /// `Some(Some(wait))` while a restart waits out its backoff, `Some(None)` while it cannot start for
    /// good or for a while (its start was refused, or its restarts are at their limit), `None` when a
    /// request would be sent (to the running process, or to one started for it).
    pub fn refusing(&self, now: Instant) -> Option<Option<Duration>> {
        if self.start_refused.is_some() {
            return Some(None);
        }
        if self.running.is_some() {
            return None;
        }
        match self.restarts.would_refuse(&self.spec.restart, now)? {
            Refused::BackingOff { wait } => Some(Some(wait)),
            Refused::Limit { .. } => Some(None),
        }
    }

    /// What the running backend described.
    pub fn described(&self) -> Option<&Described> {
        self.running.as_ref().map(|r| &r.described)
    }

    /// The sequence number of the running process's next frame.
    pub fn next_sequence(&self) -> Option<u64> {
        self.running.as_ref().map(|r| r.ring.next_sequence())
    }

    /// Replaces the deadline of each prefill request.
    pub fn set_request_timeout(&mut self, timeout: Duration) {
        self.spec.request_timeout = timeout;
    }

    /// Replaces the restart policy (the restarts already counted stay counted).
    pub fn set_restart_policy(&mut self, policy: RestartPolicy) {
        self.spec.restart = policy;
    }

    /// The producer's name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// Counters so far.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The pid of the running process, if any.
    pub fn pid(&self) -> Option<u32> {
        self.running.as_ref().map(|r| r.child.id())
    }

    /// `"dense"` or `"grouped"`: what the running backend described.
    pub fn layout(&self) -> Option<&'static str> {
        self.running.as_ref().map(|r| r.described.layout_name().expect("checked at the handshake"))
    }

    /// The model identity the running backend reported (checked equal to the host's at the handshake).
    pub fn identity(&self) -> Option<&str> {
        self.running.as_ref().and_then(|r| r.described.identity.as_deref())
    }

    /// The element type of the running backend's spans.
    pub fn wire_dtype(&self) -> Option<Dtype> {
        self.running.as_ref().map(|r| r.described.wire_dtype().expect("checked at the handshake"))
    }

    /// Whether the running backend takes a request that starts past position 0 with its context (ABI 1.1:
    /// a prefix-cache hit, unless its capabilities say `PDHOST_CAP_NO_CONTEXT`); `None` before it runs.
    pub fn takes_context(&self) -> Option<bool> {
        self.running.as_ref().map(|r| {
            r.described.abi_minor >= 1 && r.described.capabilities.flags & pdhost_plugin_abi::PDHOST_CAP_NO_CONTEXT == 0
        })
    }

    /// Starts the producer now if it is not running (warm-up before the first request).
    pub fn start(&mut self) -> Result<(), ProducerError> {
        self.ensure_running().map(|_| ())
    }

    fn io(&self, op: &'static str) -> impl Fn(std::io::Error) -> ProducerError + '_ {
        move |source| ProducerError::Io { name: self.spec.name.clone(), op, source }
    }

    /// The most tokens one prefill call may carry, as the running backend says (`None`: no limit, or not
    /// running).
    pub fn max_tokens(&self) -> Option<u64> {
        self.running.as_ref().map(|r| r.described.capabilities.max_tokens).filter(|&m| m > 0)
    }

    /// Whether the running process was asked for `request_id` and not told to release it, so that it may
    /// hold the K/V of the request's earlier chunks. A process started since never was.
    pub fn holds(&self, request_id: u64) -> bool {
        self.running.as_ref().is_some_and(|r| r.open_requests.contains(&request_id))
    }

    /// The error of a request whose earlier chunks the running process does not hold ([`Producer::holds`]).
    pub fn lost(&self, request_id: u64) -> ProducerError {
        let reason = match (&self.running, &self.last_failure) {
            (None, Some(failure)) => failure.clone(),
            (None, None) => "it is not running".into(),
            (Some(_), _) => "a process started since has none of them".into(),
        };
        ProducerError::Lost { name: self.spec.name.clone(), request_id, reason }
    }

    /// The request is over (finished, failed or cancelled): tells the backend, if this process prefilled
    /// any of it, so that it can free what it keeps. Costs one message and no wait.
    pub fn release(&mut self, request_id: u64) {
        let Some(running) = self.running.as_mut() else { return };
        if !running.open_requests.remove(&request_id) {
            return;
        }
        let message = ToProducer::Release { request_id };
        match protocol::send(Until::new(&running.socket, Instant::now() + SEND_WAIT), &message) {
            // One that stopped reading its socket goes, as one that stopped answering does.
            Err(e) if until::ran_out(&e) => {
                let _ = self.fail(ProducerError::Timeout {
                    name: self.spec.name.clone(),
                    waited: SEND_WAIT,
                    during: "sending a release",
                });
            }
            // A producer that went away is found out by the next request.
            Ok(()) | Err(_) => {}
        }
    }

    fn ensure_running(&mut self) -> Result<&mut Running, ProducerError> {
        if let Some((kind, reason)) = &self.start_refused {
            return Err(ProducerError::StartRefused { name: self.spec.name.clone(), kind, reason: reason.clone() });
        }
        if self.running.is_none() {
            match self.spawn() {
                Ok(running) => self.running = Some(running),
                Err(e) => {
                    if e.repeats_on_every_start() {
                        self.start_refused = Some((e.kind(), self.reason(&e)));
                    }
                    return Err(e);
                }
            }
        }
        Ok(self.running.as_mut().expect("just started"))
    }

    fn spawn(&mut self) -> Result<Running, ProducerError> {
        let name = self.spec.name.clone();
        match self.restarts.admit(&self.spec.restart, Instant::now()) {
            Ok(false) => {}
            Ok(true) => self.metrics.restarts += 1,
            // A request does not wait out the backoff: it is refused now (and falls back, or fails),
            // told what the backoff follows.
            Err(Refused::BackingOff { wait }) => {
                let after = self.last_failure.clone().unwrap_or_else(|| "unknown".into());
                return Err(ProducerError::BackingOff { name, wait, after });
            }
            Err(Refused::Limit { restarts, wait }) => {
                return Err(ProducerError::RestartLimit { name, restarts, window: self.spec.restart.window, wait })
            }
        }
        // Until it is ready, the process counts as failed (a crash while it starts makes the next start a
        // restart); a start that does not reach Ready is a failure, after which the next waits out the
        // backoff, as after a crash: a backend that times out in `open` is not started again at once by
        // every request.
        self.restarts.starting();
        let started = self.launch(name);
        match &started {
            Ok(_) => self.last_failure = None,
            Err(e) => {
                self.last_failure = Some(format!("{}: {}", e.kind(), self.reason(e)));
                self.restarts.failed(&self.spec.restart, Instant::now());
            }
        }
        started
    }

    /// `e`'s text without the "producer NAME: " it starts with.
    fn reason(&self, e: &ProducerError) -> String {
        let text = e.to_string();
        let prefix = format!("producer {}: ", self.spec.name);
        text.strip_prefix(&prefix).map_or(text.clone(), str::to_string)
    }

    /// Spawns the producer process over a new ring and waits for its `Ready` (bounded by the start
    /// timeout), checking what it describes against the host's model.
    fn launch(&mut self, name: String) -> Result<Running, ProducerError> {
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        let geometry = RingGeometry::new(self.spec.slots, self.spec.slot_capacity).map_err(|e| ProducerError::Io {
            name: name.clone(),
            op: "ring geometry",
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
        })?;
        let mut ring = create_ring(&format!("pdhost-{name}-e{epoch}"), geometry, epoch).map_err(|e| {
            ProducerError::Io { name: name.clone(), op: "creating the ring", source: std::io::Error::other(e) }
        })?;
        let (socket, child_socket) = UnixStream::pair().map_err(self.io("socketpair"))?;
        let [control, data, to_host, from_host] = ring.peer_fds();
        let passed = inheritable([control, data, to_host, from_host, child_socket.as_fd()])
            .map_err(self.io("duplicating the producer's descriptors"))?;
        let numbers: Vec<String> = passed.fds.iter().map(|fd| fd.as_raw_fd().to_string()).collect();
        let mut cmd = Command::new(&self.spec.program);
        cmd.args(&self.spec.program_args)
            .arg("--backend")
            .arg(&self.spec.backend)
            .arg("--config")
            .arg(config_with_shape(&self.spec.config, &self.geometry, self.max_span_tokens(), self.rope()))
            .arg("--parent-pid")
            .arg(std::process::id().to_string())
            .arg("--fds")
            .arg(numbers.join(","))
            .arg("--sandbox")
            .arg(if self.spec.sandbox { "on" } else { "off" })
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(bytes) = self.spec.memory_limit {
            cmd.arg("--memory-limit").arg(bytes.to_string());
        }
        self.metrics.starts += 1;
        let spawned = cmd.spawn();
        drop(passed);
        drop(child_socket);
        ring.handed_over();
        let mut child = spawned.map_err(|source| ProducerError::Spawn {
            name: name.clone(),
            program: self.spec.program.display().to_string(),
            source,
        })?;
        let (logging, last_lines) = log_output(&name, child.id(), child.stdout.take(), child.stderr.take());
        let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("a child pid is positive");
        let pidfd = match rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) {
            Ok(fd) => fd,
            Err(e) => {
                // With no pidfd to wait on with a deadline, the killed child is reaped by a thread of
                // its own, as `reap` does with one that will not die.
                let mut child = child;
                let _ = child.kill();
                reap_later(&name, child, None, logging);
                return Err(self.io("pidfd_open")(e.into()));
            }
        };
        let mut running = Running {
            child,
            pidfd,
            ring,
            socket,
            described: Described::default(),
            open_requests: Default::default(),
            awaiting: Default::default(),
            logging,
            last_lines,
        };
        let deadline = Instant::now() + self.spec.start_timeout;
        let message = match self.receive(&mut running, deadline, "starting") {
            Ok(m) => m,
            Err(e) => {
                self.reap(running);
                return Err(e);
            }
        };
        let described = match message {
            FromProducer::Ready(d) => d,
            FromProducer::StartFailed { stage, status, message } => {
                self.reap(running);
                return Err(ProducerError::StartFailed { name, stage, status, message });
            }
            other => {
                self.reap(running);
                return Err(ProducerError::Protocol {
                    name,
                    expected: "a Ready or StartFailed message".into(),
                    found: other.summary(),
                });
            }
        };
        if let Err(e) = self.check_described(&described) {
            self.reap(running);
            return Err(e);
        }
        let c = described.capabilities;
        if c != Default::default() {
            let bits = |mask: u32, names: &[&str]| {
                let named: Vec<&str> = (0..names.len()).filter(|&i| mask & 1 << i != 0).map(|i| names[i]).collect();
                if named.is_empty() {
                    "the described one".to_string()
                } else {
                    named.join(", ")
                }
            };
            let max = match c.max_tokens {
                0 => "no limit".to_string(),
                n => n.to_string(),
            };
            tracing::info!(
                producer = %name,
                "backend capabilities: dtypes {}; layouts {}; tokens per call {max}",
                bits(c.dtypes, &["f32", "f16", "bf16"]),
                bits(c.layouts, &["dense", "grouped"])
            );
        }
        running.described = described;
        Ok(running)
    }

    /// The backend must describe exactly the model the host's cache holds. A mismatch names the first thing
    /// that differs in words: the layer and both its shapes, or both whole geometries when the layer counts
    /// differ.
    pub(crate) fn check_described(&self, d: &Described) -> Result<(), ProducerError> {
        let mismatch = |what: String, expected: String, found: String| ProducerError::DescribeMismatch {
            name: self.spec.name.clone(),
            what,
            expected,
            found,
        };
        let described = |e: BadDescription| mismatch(e.what, e.expected.into(), e.found.to_string());
        let theirs = d.geometry().map_err(described)?;
        if let Some(m) = self.geometry.mismatch(&theirs) {
            return Err(mismatch(m.what, m.expected, m.found));
        }
        let ours = self.geometry.fingerprint();
        if d.fingerprint != ours.0 {
            return Err(mismatch("fingerprint".into(), ours.to_string(), Fingerprint(d.fingerprint).to_string()));
        }
        d.layout_name().map_err(described)?;
        d.wire_dtype().map_err(described)?;
        let Some(ours) = &self.spec.identity else { return Ok(()) };
        match &d.identity {
            None => {
                let why = match d.abi_minor {
                    0 | 1 => format!(" (it was built against ABI 1.{}, before identities)", d.abi_minor),
                    _ => String::new(),
                };
                tracing::warn!(
                    producer = %self.spec.name,
                    "the backend reports no model identity{why}: nothing proves it loaded the host's model \
                     ({ours})"
                )
            }
            Some(theirs) => {
                let parsed = model::identity::ModelIdentity::parse(ours).expect("the host's own identity parses");
                if let Some(m) = parsed.mismatch(theirs) {
                    return Err(ProducerError::IdentityMismatch {
                        name: self.spec.name.clone(),
                        what: m.what,
                        expected: m.expected,
                        found: m.found,
                    });
                }
            }
        }
        Ok(())
    }

    /// The global and local rope bases of the host's model, from its identity.
    fn rope(&self) -> Option<(f64, f64)> {
        let identity = model::identity::ModelIdentity::parse(self.spec.identity.as_deref()?)?;
        let (global, local) = identity.rope.split_once('/')?;
        Some((global.parse().ok()?, local.parse().ok()?))
    }

    /// The most tokens a span of this producer's slots can hold (f32 K/V, the widest wire dtype).
    fn max_span_tokens(&self) -> u64 {
        let per_token = span_bytes(&self.geometry, Dtype::F32, 1).max(1);
        self.spec.slot_capacity.saturating_sub(256 << 10) / per_token
    }

    /// Waits for one message from the producer until `deadline`. On a timeout the producer is killed.
    fn receive(
        &self,
        running: &mut Running,
        deadline: Instant,
        during: &'static str,
    ) -> Result<FromProducer, ProducerError> {
        let name = self.spec.name.clone();
        let started = Instant::now();
        match wait_readable(running.socket.as_fd(), running.pidfd.as_fd(), deadline).map_err(self.io("poll"))? {
            Ready::TimedOut => {
                return Err(ProducerError::Timeout { name, waited: started.elapsed(), during });
            }
            Ready::Exited => return Err(self.exited(running, during)),
            Ready::Socket => {}
        }
        // The deadline holds for the whole message, however it is dribbled.
        match protocol::recv::<FromProducer>(Until::new(&running.socket, deadline), protocol::MAX_FROM_PRODUCER) {
            Ok(Some(m)) => Ok(tamed(m)),
            Ok(None) => Err(self.exited(running, during)),
            Err(RecvError::Io(e)) if until::ran_out(&e) => {
                Err(ProducerError::Timeout { name, waited: started.elapsed(), during })
            }
            Err(RecvError::Message(e)) => {
                Err(ProducerError::Protocol { name, expected: e.expected(), found: e.found() })
            }
            Err(_) => Err(self.exited(running, during)),
        }
    }

    /// The producer is gone (or going): wait briefly for its exit status.
    fn exited(&self, running: &mut Running, during: &'static str) -> ProducerError {
        let name = self.spec.name.clone();
        let mut fds = [PollFd::from_borrowed_fd(running.pidfd.as_fd(), PollFlags::IN)];
        let ts = rustix::event::Timespec { tv_sec: 2, tv_nsec: 0 };
        let _ = rustix::event::poll(&mut fds, Some(&ts));
        // Read before the reap below: the peak memory of the exited process.
        let peak = peak_memory(running.pidfd.as_fd());
        let signal = match running.child.try_wait() {
            Ok(Some(s)) => match (s.code(), s.signal()) {
                (Some(code), _) => {
                    return ProducerError::Exited { name, status: format!("with status {code}"), during }
                }
                (None, Some(sig)) => sig,
                _ => return ProducerError::Exited { name, status: "with an unknown status".into(), during },
            },
            _ => return ProducerError::Exited { name, status: "(closed its control socket)".into(), during },
        };
        let status = format!("by {}", signal_name(signal));
        if signal == libc::SIGSYS && self.spec.sandbox {
            return ProducerError::Sandbox { name, during };
        }
        let Some(limit) = self.spec.memory_limit else { return ProducerError::Exited { name, status, during } };
        // An allocation refused at the cap aborts a Rust or C++ backend, which says so on stderr first
        // (read to its end: the process is gone, so its pipe is closed unless a process it started holds
        // it), or faults a C one; the kernel's OOM killer sends SIGKILL. Any of them with the peak near
        // the cap is the cap, and so is a last word about a failed allocation at any peak (one request
        // far past the cap leaves little resident).
        let _ = running.logging.recv_timeout(Duration::from_millis(500));
        let last_words = running.last_lines.allocation_failure();
        let peak = peak.unwrap_or(0);
        if peak >= limit / 4 * 3 || last_words.is_some() {
            ProducerError::MemoryLimit { name, status, during, peak, limit, last_words }
        } else {
            ProducerError::Exited { name, status, during }
        }
    }

    /// Kills (if needed) and reaps a process, and drops its ring. The caller (in `serve`, the engine
    /// thread, which decodes for every live request) waits at most [`REAP_WAIT`] twice.
    fn reap(&self, mut running: Running) {
        // SIGKILL, then wait: no zombie, and the ring (dropped with `running`) is unmapped and closed. A
        // killed process is usually gone within a few milliseconds; one that takes longer (a large address
        // space to tear down, or an uninterruptible sleep inside a driver or on a hung network mount) is
        // left to a thread of its own to reap, rather than hold every request behind it.
        let _ = running.child.kill();
        if !exited_within(running.pidfd.as_fd(), REAP_WAIT) {
            let Running { child, pidfd, logging, .. } = running;
            reap_later(&self.spec.name, child, Some(pidfd), logging);
            return;
        }
        let _ = running.child.wait();
        // Its pipes are closed now, unless a process it started holds them: wait a little for the
        // logging threads to log the last lines, so that they come before what the caller logs next
        // (the threads go on to the pipes' end either way).
        let _ = running.logging.recv_timeout(REAP_WAIT);
    }

    /// Counts a refused request by its reason.
    fn refuse(&mut self, error: ProducerError) -> ProducerError {
        *self.metrics.spans_rejected.entry(error.kind()).or_default() += 1;
        error
    }

    /// Records a failure: the request is counted as refused, the process is killed, and the next start is a
    /// restart after the backoff.
    fn fail(&mut self, error: ProducerError) -> ProducerError {
        let error = self.refuse(error);
        self.last_failure = Some(format!("{}: {}", error.kind(), self.reason(&error)));
        if let Some(running) = self.running.take() {
            self.reap(running);
        }
        self.restarts.failed(&self.spec.restart, Instant::now());
        error
    }

    /// Prefills `tokens` at `start_pos` of `request_id` in the producer and ingests the span into `seq`:
    /// [`Producer::submit`], then [`Producer::take`]. The span carries at most the backend's `max_tokens`
    /// of them ([`SpanTimes::tokens`]); the caller continues from its end.
    ///
    /// On any failure the span is not in the cache (the cache is exactly as before), the reason is
    /// counted, and a producer that broke the protocol, crashed or timed out is killed; the next call
    /// starts a new one (with backoff, within the restart cap).
    pub fn prefill(&mut self, kv: &mut PagedKv, seq: SeqId, call: &PrefillCall) -> Result<SpanTimes, ProducerError> {
        let pending = self.submit(call)?;
        self.take(pending, kv, seq)
    }

    /// Starts the producer if it is not running, sends it one prefill (cut to the first `max_tokens` of its
    /// tokens when the backend takes fewer at once: a call planned before this process said its limit)
    /// and waits (within the request timeout, watching its pidfd) for its reply. The span then waits in
    /// the ring, untouched, for [`Producer::take`]: this half touches no cache, so it may run on another
    /// thread than the one that owns the cache. Failures are counted and handled as in [`Producer::prefill`].
    pub fn submit(&mut self, call: &PrefillCall) -> Result<Pending, ProducerError> {
        self.submit_batch(std::slice::from_ref(call))
    }

    /// Takes the span that `pending`'s reply announced out of the ring into `seq`: the header read once and
    /// checked, the copy checksummed, then one commit. On failure the cache is as before and the producer
    /// is killed (the next submit restarts it), unless the host's own cache refused a well-formed span
    /// (no room, or no such sequence): the ring is back in step then, and the producer did nothing wrong.
    pub fn take(&mut self, pending: Pending, kv: &mut PagedKv, seq: SeqId) -> Result<SpanTimes, ProducerError> {
        match self.take_frame(pending, kv, seq) {
            Ok(times) => {
                self.accepted(times.bytes);
                Ok(times)
            }
            Err(
                e @ ProducerError::Rejected {
                    source: IngestError::CapacityExhausted { .. } | IngestError::UnknownSequence { .. },
                    ..
                },
            ) => Err(self.refuse(e)),
            Err(e) => Err(self.fail(e)),
        }
    }

    /// Counts a span the host took (or a node passed on) whole: the producer is healthy again.
    fn accepted(&mut self, bytes: u64) {
        self.restarts.succeeded();
        self.metrics.spans_accepted += 1;
        self.metrics.bytes += bytes;
    }

    /// Sends `calls` (of different requests): one [`ToProducer::PrefillBatch`] where the process takes
    /// batches and there are several, one [`ToProducer::Prefill`] each otherwise (the process answers
    /// them in turn all the same). A call planned before this process said its limit (a restart, or a
    /// first start) is cut to it; the caller continues from the span's end. What each reply must answer
    /// waits in `running.awaiting`, oldest first.
    fn send_calls(&mut self, calls: &[PrefillCall], started: Instant) -> Result<(), ProducerError> {
        let name = self.spec.name.clone();
        let deadline = started + self.spec.request_timeout;
        let mut running = self.running.take().expect("ensured");
        let max = running.described.capabilities.max_tokens;
        let sent: Vec<PrefillCall> = calls
            .iter()
            .map(|call| {
                let mut sent = call.clone();
                if max > 0 && sent.tokens.len() as u64 > max {
                    sent.tokens.truncate(usize::try_from(max).expect("shorter than a Vec's length"));
                }
                running.open_requests.insert(call.request_id);
                let tokens = sent.tokens.len() as u64;
                running.awaiting.push_back(Awaited {
                    request_id: call.request_id,
                    end: call.start_pos + tokens,
                    tokens,
                });
                sent
            })
            .collect();
        let messages = if sent.len() > 1 && running.described.batches {
            vec![ToProducer::PrefillBatch(sent)]
        } else {
            sent.into_iter().map(ToProducer::Prefill).collect()
        };
        let mut result = Ok(());
        for message in &messages {
            match protocol::send(Until::new(&running.socket, deadline), message) {
                Ok(()) => {}
                Err(e) if until::ran_out(&e) => {
                    let waited = started.elapsed();
                    result = Err(ProducerError::Timeout { name: name.clone(), waited, during: "sending a request" });
                    break;
                }
                Err(_) => {
                    result = Err(self.exited(&mut running, "sending a request"));
                    break;
                }
            }
        }
        self.running = Some(running);
        result
    }

    /// Waits (until `started` plus the request timeout, watching the pidfd) for the reply to the oldest
    /// call sent, which must be `call`.
    fn await_reply(&mut self, call: &PrefillCall, started: Instant) -> Result<Pending, ProducerError> {
        let request_id = call.request_id;
        let name = self.spec.name.clone();
        let deadline = started + self.spec.request_timeout;
        let mut running = self.running.take().expect("ensured");
        let result = (|| {
            let Awaited { request_id: awaited, end, tokens } =
                running.awaiting.pop_front().ok_or_else(|| ProducerError::Protocol {
                    name: name.clone(),
                    expected: format!("a reply awaited for request {request_id}"),
                    found: "no call sent".into(),
                })?;
            if awaited != request_id {
                // The host's own bookkeeping, not the producer's doing.
                return Err(ProducerError::Protocol {
                    name: name.clone(),
                    expected: format!("the reply for request {request_id} next"),
                    found: format!("request {awaited}'s"),
                });
            }
            let reply = self.receive(&mut running, deadline, "awaiting a prefill")?;
            match reply {
                FromProducer::Done { request_id: r, sequence, backend_ns, frame_ns } if r == request_id => {
                    let epoch = running.ring.epoch();
                    Ok(Pending { request_id, end, tokens, sequence, epoch, backend_ns, frame_ns, started })
                }
                FromProducer::Unwritten { request_id: r, message } if r == request_id => {
                    Err(ProducerError::Unwritten { name: name.clone(), message })
                }
                FromProducer::Remote { request_id: r, failure, message } if r == request_id => {
                    Err(ProducerError::Remote { name: name.clone(), failure, message })
                }
                FromProducer::Failed { request_id: r, status: code, message } if r == request_id => {
                    match PdhostStatus::from_raw(code) {
                        Some(PdhostStatus::Panic) => Err(ProducerError::Panicked { name: name.clone(), message }),
                        status => {
                            let status = status.map_or_else(|| format!("status {code}"), |s| s.name().to_string());
                            Err(ProducerError::Backend { name: name.clone(), status, message })
                        }
                    }
                }
                other => Err(ProducerError::Protocol {
                    name: name.clone(),
                    expected: format!("a Done or Failed reply for request {request_id}"),
                    found: other.summary(),
                }),
            }
        })();
        self.running = Some(running);
        result
    }

    /// Sends the chunks of several requests (`calls`, each of another request) to the producer at once,
    /// started if it is not running, and waits for the reply to the first, as [`Producer::submit`] does
    /// for one; [`Producer::next`] then waits for each of the others, in order, after the span before it
    /// was taken (the ring may hold fewer spans than the batch). A producer whose backend computes
    /// batches (ABI 1.3 `stage`) computes them in one pass; another answers them one after another.
    ///
    /// A failure of one call that leaves the process running (its backend refused it) fails that call
    /// alone. One that stops the process fails every later call of the batch too, each with
    /// [`ProducerError::BatchBroken`] when [`Producer::next`] reaches it.
    pub fn submit_batch(&mut self, calls: &[PrefillCall]) -> Result<Pending, ProducerError> {
        let started = Instant::now();
        self.broken = None;
        match self.ensure_running() {
            Ok(_) => {}
            // No process was involved: count the refusal, but do not lengthen the backoff.
            Err(
                e @ (ProducerError::BackingOff { .. }
                | ProducerError::RestartLimit { .. }
                | ProducerError::StartRefused { .. }),
            ) => return Err(self.refuse(e)),
            Err(e) => return Err(self.fail(e)),
        }
        let result = self.send_calls(calls, started).and_then(|()| self.await_reply(&calls[0], started));
        self.settle_reply(result)
    }

    /// Waits for the reply to `call`, the next call of the batch [`Producer::submit_batch`] sent, once
    /// the span before it was taken. Failures are handled as in [`Producer::submit`].
    pub fn next(&mut self, call: &PrefillCall) -> Result<Pending, ProducerError> {
        let started = Instant::now();
        let awaited = self.running.as_ref().and_then(|r| r.awaiting.front()).map(|a| a.request_id);
        if awaited != Some(call.request_id) {
            let name = self.spec.name.clone();
            let reason = self.broken.clone().unwrap_or_else(|| "its batch was not sent".into());
            return Err(self.refuse(ProducerError::BatchBroken { name, request_id: call.request_id, reason }));
        }
        let result = self.await_reply(call, started);
        self.settle_reply(result)
    }

    /// Counts a reply's failure, stopping the process where the failure says it must go; one that stops
    /// it while calls of its batch are still awaited is kept, for them.
    fn settle_reply(&mut self, result: Result<Pending, ProducerError>) -> Result<Pending, ProducerError> {
        match result {
            Ok(pending) => Ok(pending),
            // A backend that says it failed broke no rule: it keeps running. One that panicked may have
            // left anything behind in its process, so that process goes (`Panicked` falls through).
            Err(e @ (ProducerError::Backend { .. } | ProducerError::Unwritten { .. })) => Err(self.refuse(e)),
            Err(e) => {
                if self.running.as_ref().is_some_and(|r| !r.awaiting.is_empty()) {
                    self.broken = Some(e.to_string());
                }
                Err(self.fail(e))
            }
        }
    }

    fn take_frame(&mut self, pending: Pending, kv: &mut PagedKv, seq: SeqId) -> Result<SpanTimes, ProducerError> {
        let name = self.spec.name.clone();
        let running = announcer(&name, self.running.as_mut(), &pending)?;
        let sequence = pending.sequence;
        let t = Instant::now();
        let before = kv.seq_len(seq).unwrap_or(0);
        let wire = running.described.wire_dtype().expect("checked at the handshake");
        let taken = running.ring.take_into(&mut IntoSequence { kv, seq, end: pending.end, dtype: wire });
        let take = t.elapsed();
        match taken {
            Ok(Some(())) => {}
            Ok(None) => {
                return Err(ProducerError::Protocol {
                    name,
                    expected: format!("frame {sequence} committed before the reply"),
                    found: "no commit".into(),
                })
            }
            Err(TakeError::Ring(source)) => return Err(ProducerError::Ring { name, source }),
            Err(TakeError::Sink(source)) => return Err(ProducerError::Rejected { name, source }),
        }
        let bytes = span_bytes(&self.geometry, wire, kv.seq_len(seq).unwrap_or(0) - before);
        Ok(SpanTimes {
            backend: Duration::from_nanos(pending.backend_ns),
            frame: Duration::from_nanos(pending.frame_ns),
            take,
            round_trip: pending.started.elapsed(),
            bytes,
            tokens: pending.tokens,
        })
    }

    /// A mapping of the running process's ring data segment of the caller's own, read-only, which
    /// outlives the process and its ring: what a producer node registers with NIXL to send frames from,
    /// at the offsets [`Producer::forward_frame`] gives. A new process gets a new ring.
    pub fn map_data_segment(&self) -> Result<MemfdSegment, ProducerError> {
        let running = self.running.as_ref().ok_or_else(|| ProducerError::Protocol {
            name: self.spec.name.clone(),
            expected: "a running process".into(),
            found: "none".into(),
        })?;
        let fd = running.ring.data_fd().try_clone_to_owned().map_err(self.io("duplicating the ring's data segment"))?;
        let len = running.ring.geometry().data_len();
        MemfdSegment::open(&format!("pdhost-{}.data", self.spec.name), fd, len, false).map_err(|e| ProducerError::Io {
            name: self.spec.name.clone(),
            op: "mapping the ring's data segment",
            source: std::io::Error::other(e),
        })
    }

    /// Passes the frame that `pending`'s reply announced on where it lies: its header read once and
    /// checked, then `send(offset, header)` with its offset in the data segment
    /// ([`Producer::map_data_segment`]), then the re-checks, then the slot handed back (see
    /// [`shm_ring::RingReader::forward_frame`]). What a producer node does with each frame; the host
    /// that receives it checks the rest. Returns the frame's header and its slot. On failure the producer is killed, as after a failed take; a failed `send` is a
    /// [`RemoteFailure::Transfer`].
    pub fn forward_frame(
        &mut self,
        pending: Pending,
        send: impl FnOnce(u64, &shm_format::HeaderInfo) -> Result<(), String>,
    ) -> Result<(shm_format::HeaderInfo, u32), ProducerError> {
        let name = self.spec.name.clone();
        let forwarded = match announcer(&name, self.running.as_mut(), &pending) {
            Err(e) => Err(e),
            Ok(running) => match running.ring.forward_frame(|offset, info| send(offset, info).map_err(Sent)) {
                Ok(Some(forwarded)) => Ok(forwarded),
                Ok(None) => Err(ProducerError::Protocol {
                    name,
                    expected: format!("frame {} committed before the reply", pending.sequence),
                    found: "no commit".into(),
                }),
                Err(TakeError::Ring(source)) => Err(ProducerError::Ring { name, source }),
                Err(TakeError::Sink(Sent(message))) => {
                    Err(ProducerError::Remote { name, failure: RemoteFailure::Transfer, message })
                }
            },
        };
        match forwarded {
            Ok((info, slot)) => {
                self.accepted(info.payload_len);
                Ok((info, slot))
            }
            Err(e) => Err(self.fail(e)),
        }
    }

    /// Asks the producer to exit, waits briefly, then kills and reaps it.
    pub fn shutdown(&mut self) {
        if let Some(running) = self.running.take() {
            if protocol::send(Until::new(&running.socket, Instant::now() + SEND_WAIT), &ToProducer::Shutdown).is_ok() {
                let mut fds = [PollFd::from_borrowed_fd(running.pidfd.as_fd(), PollFlags::IN)];
                let ts = rustix::event::Timespec { tv_sec: 2, tv_nsec: 0 };
                let _ = rustix::event::poll(&mut fds, Some(&ts));
            }
            self.reap(running);
        }
    }
}

/// Waits for the killed `child` on a thread of its own (then drops `keep`: its logging threads' signal),
/// where waiting here could block without a deadline. With its pidfd, one still there after
/// [`STUCK_WAIT`] is named in a warning.
fn reap_later<K: Send + 'static>(
    name: &str,
    mut child: std::process::Child,
    pidfd: Option<rustix::fd::OwnedFd>,
    keep: K,
) {
    let producer = name.to_string();
    let reaper = std::thread::Builder::new().name("pdhost-reaper".into()).spawn(move || {
        if pidfd.is_some_and(|fd| !exited_within(fd.as_fd(), STUCK_WAIT)) {
            tracing::warn!(
                %producer,
                "killed, and not gone after {} s (an uninterruptible sleep?): reaped when it goes",
                STUCK_WAIT.as_secs()
            );
        }
        let _ = child.wait();
        drop(keep);
    });
    if reaper.is_err() {
        tracing::warn!(producer = %name, "no thread to reap it: it stays a zombie");
    }
}

/// Whether the process of pidfd `fd` has exited, or does within `wait`.
fn exited_within(fd: rustix::fd::BorrowedFd<'_>, wait: Duration) -> bool {
    let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
    let ts = rustix::event::Timespec { tv_sec: wait.as_secs() as i64, tv_nsec: wait.subsec_nanos().into() };
    matches!(rustix::event::poll(&mut fds, Some(&ts)), Ok(n) if n > 0)
}

/// How long a killed producer, and then its logging threads, are waited for by the thread that killed
/// it, before a thread of its own is left to reap it: the engine thread of `serve` decodes meanwhile.
const REAP_WAIT: Duration = Duration::from_millis(100);

/// How long the reaping thread waits before it warns that a killed producer is still there.
const STUCK_WAIT: Duration = Duration::from_secs(5);

/// The most characters of a producer's text (an error message, a stage, a name) that reach the host's
/// errors.
pub(crate) const MAX_PRODUCER_TEXT: usize = 1024;

/// `message` with the text a producer chose made fit for a one-line error: control characters (a
/// newline, a carriage return, a terminal escape) as spaces, and at most [`MAX_PRODUCER_TEXT`]
/// characters, its length said where cut. The producer's own cleaning runs in the process the
/// host does not trust.
pub(crate) fn tamed(message: FromProducer) -> FromProducer {
    let line = |text: String| -> String {
        let text: String = text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
        crate::request::shorten_to(&text, MAX_PRODUCER_TEXT)
    };
    match message {
        FromProducer::Ready(mut d) => {
            d.backend = line(d.backend);
            d.transport = d.transport.map(line);
            // Compared with the host's own, and named when it differs (a real one is short and printable:
            // one cut or cleaned here differed anyway).
            d.identity = d.identity.map(line);
            FromProducer::Ready(d)
        }
        FromProducer::StartFailed { stage, status, message } => {
            FromProducer::StartFailed { stage: line(stage), status, message: line(message) }
        }
        FromProducer::Unwritten { request_id, message } => {
            FromProducer::Unwritten { request_id, message: line(message) }
        }
        FromProducer::Failed { request_id, status, message } => {
            FromProducer::Failed { request_id, status, message: line(message) }
        }
        FromProducer::Remote { request_id, failure, message } => {
            FromProducer::Remote { request_id, failure, message: line(message) }
        }
        done @ FromProducer::Done { .. } => done,
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A built-in backend's library was not found.
#[derive(Debug, thiserror::Error)]
#[error(
    "backend {name}: expected {file} in {}, found none (build the workspace with the profile that built \
     pdhost, `cargo build --release --workspace`, or set PDHOST_PLUGIN_DIR to the directory that holds it)",
    .looked.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
)]
pub struct MissingBackend {
    /// The backend's name.
    pub name: String,
    /// The library's file name.
    pub file: String,
    /// The directories searched, in order.
    pub looked: Vec<PathBuf>,
}

/// Where the libraries of the built-in backends live: `$PDHOST_PLUGIN_DIR`, else next to the running
/// executable or in its `deps/` (where cargo puts a dependency's cdylib).
pub fn builtin_backend(name: &str) -> Result<PathBuf, MissingBackend> {
    let file = format!("libpdhost_backend_{name}.so");
    let mut dirs = Vec::new();
    if let Some(dir) = std::env::var_os("PDHOST_PLUGIN_DIR") {
        dirs.push(PathBuf::from(dir));
    }
    if let Some(exe_dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf)) {
        dirs.push(exe_dir.join("deps"));
        dirs.push(exe_dir.clone());
        if let Some(up) = exe_dir.parent() {
            dirs.push(up.join("deps"));
        }
    }
    match dirs.iter().map(|d| d.join(&file)).find(|p| p.is_file()) {
        Some(path) => Ok(path),
        None => Err(MissingBackend { name: name.to_string(), file, looked: dirs }),
    }
}

/// The running process whose reply announced `pending`'s frame, that frame being its ring's next: not a
/// process started since (whose ring numbers frames from 0 again), nor a frame out of turn.
fn announcer<'r>(
    name: &str,
    running: Option<&'r mut Running>,
    pending: &Pending,
) -> Result<&'r mut Running, ProducerError> {
    let protocol = |expected: String, found: String| ProducerError::Protocol { name: name.into(), expected, found };
    let expected = || format!("the process of epoch {} that announced frame {}", pending.epoch, pending.sequence);
    let running = running.ok_or_else(|| protocol(expected(), "no running process".into()))?;
    if running.ring.epoch() != pending.epoch {
        return Err(protocol(expected(), format!("a process of epoch {}", running.ring.epoch())));
    }
    if pending.sequence != running.ring.next_sequence() {
        let next = running.ring.next_sequence();
        return Err(protocol(format!("frame {next}"), format!("frame {}", pending.sequence)));
    }
    Ok(running)
}

/// Why a forwarded frame's transfer failed, as the ring's sink error.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Sent(String);

/// How long a message the host sends without waiting for an answer (a release, a shutdown) may take to
/// go out: a producer that stopped reading its socket has that long before it counts as hung.
const SEND_WAIT: Duration = Duration::from_secs(1);
