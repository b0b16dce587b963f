//! Why a producer could not prefill a request, each reason with a stable kind for metrics and JSON.

use std::time::Duration;

use pdhost_plugin_abi::PdhostStatus;
use pdhost_producer::protocol::RemoteFailure;
use shm_format::words;
use shm_ring::RingError;

use crate::kv::IngestError;

/// Why a producer could not prefill a request. Each has a stable [`ProducerError::kind`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProducerError {
    /// The process could not be started.
    #[error("producer {name}: starting {program}: {source}")]
    Spawn {
        /// Producer.
        name: String,
        /// Program.
        program: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The producer reported a start-up failure (library, open, describe).
    #[error("producer {name}: {stage} failed: {message}")]
    StartFailed {
        /// Producer.
        name: String,
        /// `load`, `open`, `describe`, `capabilities`, `ring`.
        stage: String,
        /// The backend's status code, 0 when the producer failed on its own.
        status: u32,
        /// Its reason.
        message: String,
    },
    /// The backend loaded another model than the host's: same KV shape perhaps, but other weights,
    /// tokenizer or rope.
    #[error("producer {name}: describe: model identity: {what}: expected {expected}, found {found}")]
    IdentityMismatch {
        /// Producer.
        name: String,
        /// `weights`, `tokenizer`, `rope`, or `identity` (unreadable).
        what: &'static str,
        /// The host's.
        expected: String,
        /// The backend's.
        found: String,
    },
    /// An earlier start failed in a way every start would repeat (a bad config, a library without the
    /// entry symbol, another model): the producer is not started again.
    #[error("producer {name}: not started again, since every start would fail the same way: {reason}")]
    StartRefused {
        /// Producer.
        name: String,
        /// The first failure's kind.
        kind: &'static str,
        /// The first failure, in full.
        reason: String,
    },
    /// The backend describes a model the host does not run.
    #[error("producer {name}: describe: {what}: expected {expected}, found {found}")]
    DescribeMismatch {
        /// Producer.
        name: String,
        /// What differs: `layer 5`, `KV geometry`, `fingerprint`, `layout`, `dtype`.
        what: String,
        /// What the host runs.
        expected: String,
        /// What the backend described.
        found: String,
    },
    /// The process exited (crashed, was killed, or exited on its own) before answering.
    #[error("producer {name} exited {status} while {during}")]
    Exited {
        /// Producer.
        name: String,
        /// `with status N` or `by signal SIGNAME`.
        status: String,
        /// What the host was waiting for.
        during: &'static str,
    },
    /// The producer made a system call its sandbox forbids (`SIGSYS`): it was stopped on the spot.
    #[error(
        "producer {name} was stopped by its sandbox while {during}: the backend made a system call the \
         sandbox forbids (starting a process, signalling another one, the network, ...; see \
         docs/plugin-abi.md, or run it with --sandbox off)"
    )]
    Sandbox {
        /// Producer.
        name: String,
        /// What the host was waiting for.
        during: &'static str,
    },
    /// The producer died by a signal at its memory cap: its peak resident memory was near the cap, or its
    /// last words were an allocation failure.
    #[error(
        "producer {name} exited {status} while {during}, at its memory limit of {} MiB ({}peak resident {} MiB)",
        *limit >> 20,
        last_words.as_deref().map(|w| format!("{w:?}, ")).unwrap_or_default(),
        *peak >> 20
    )]
    MemoryLimit {
        /// Producer.
        name: String,
        /// `by SIGNAME`.
        status: String,
        /// What the host was waiting for.
        during: &'static str,
        /// Peak resident memory in bytes.
        peak: u64,
        /// The cap in bytes.
        limit: u64,
        /// The line of its stderr that named the failed allocation, if one did.
        last_words: Option<String>,
    },
    /// No answer before the deadline; the producer was killed.
    #[error("producer {name}: no answer within {} while {during}; killed it", words::duration(*waited))]
    Timeout {
        /// Producer.
        name: String,
        /// How long the host waited.
        waited: Duration,
        /// What the host was waiting for.
        during: &'static str,
    },
    /// The backend panicked inside `prefill` (the `PANIC` status): its state is unknown, so the producer
    /// was killed and the next request starts a new one.
    #[error("producer {name}: {message}; killed it (the next request starts another)")]
    Panicked {
        /// Producer.
        name: String,
        /// Its reason.
        message: String,
    },
    /// The backend returned OK but left a region unwritten, in whole or in part: nothing was committed,
    /// and the producer keeps running.
    #[error("producer {name}: {message}")]
    Unwritten {
        /// Producer.
        name: String,
        /// The layer, K or V, and the bytes.
        message: String,
    },
    /// The backend's prefill returned an error status.
    #[error("producer {name}: {message}")]
    Backend {
        /// Producer.
        name: String,
        /// The status name.
        status: String,
        /// Its reason.
        message: String,
    },
    /// The relay of a producer on another machine could not deliver the span (the connection, the node
    /// or the transfer failed, or a transfer broke the link's rules); the relay was killed.
    #[error("producer {name}: {message}")]
    Remote {
        /// Producer.
        name: String,
        /// What went wrong.
        failure: RemoteFailure,
        /// One line.
        message: String,
    },
    /// The ring or the frame broke the protocol; the producer was killed.
    #[error("producer {name}: {source}")]
    Ring {
        /// Producer.
        name: String,
        /// Why.
        #[source]
        source: RingError,
    },
    /// The span was well-formed but does not fit this request and cache; the producer was killed (kept,
    /// where the cache had no room or no such sequence: the host's state, not the producer's doing).
    #[error("producer {name}: span rejected: {source}")]
    Rejected {
        /// Producer.
        name: String,
        /// Why.
        #[source]
        source: IngestError,
    },
    /// The process stopped, on a failure of an earlier call of the same batch, before it answered this
    /// request's call.
    #[error("producer {name}: stopped before answering request {request_id} of its batch: {reason}")]
    BatchBroken {
        /// Producer.
        name: String,
        /// The request whose call went unanswered.
        request_id: u64,
        /// The failure that stopped it, as reported for its own request.
        reason: String,
    },
    /// The process that held the K/V of a request's earlier chunks is gone (it stopped, or was started
    /// again) before its next chunk, which no other process can continue.
    #[error("producer {name}: the process holding request {request_id}'s earlier chunks is gone: {reason}")]
    Lost {
        /// Producer.
        name: String,
        /// The request whose chunks were lost.
        request_id: u64,
        /// What ended the process, as far as the host knows.
        reason: String,
    },
    /// A control message that is not the protocol.
    #[error("producer {name}: control channel: expected {expected}, found {found}")]
    Protocol {
        /// Producer.
        name: String,
        /// What the host expected.
        expected: String,
        /// What arrived.
        found: String,
    },
    /// Too many restarts in the window; the producer stays down for now (for good with a cap of zero).
    #[error("producer {name}: {}", restart_limit_words(*restarts, *window, *wait))]
    RestartLimit {
        /// Producer.
        name: String,
        /// Restarts counted.
        restarts: u32,
        /// Window.
        window: Duration,
        /// Until the oldest restart leaves the window.
        wait: Duration,
    },
    /// The producer failed recently; it is not restarted before its backoff has passed.
    #[error("producer {name}: restarting in {} after a failure ({after}): not yet", words::duration(*wait))]
    BackingOff {
        /// Producer.
        name: String,
        /// Time left.
        wait: Duration,
        /// The failure it follows: its kind and text (`start_failed: loading ...: No such file`).
        after: String,
    },
    /// A system call on the host side failed.
    #[error("producer {name}: {op}: {source}")]
    Io {
        /// Producer.
        name: String,
        /// What failed.
        op: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

fn restart_limit_words(restarts: u32, window: Duration, wait: Duration) -> String {
    match restarts {
        0 => "failed, and restarts are off (a cap of 0 per window)".to_string(),
        n => format!(
            "{n} restarts within {}: not restarting before {} from now",
            words::duration(window),
            words::duration(wait)
        ),
    }
}

impl ProducerError {
    /// A stable snake_case name, for metrics and JSON: the ring's or the cache's own kind for rejected
    /// frames and spans (`checksum_mismatch`, `layer_count_mismatch`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            ProducerError::Spawn { .. } => "spawn_failed",
            ProducerError::StartFailed { .. } => "start_failed",
            ProducerError::DescribeMismatch { .. } => "describe_mismatch",
            ProducerError::IdentityMismatch { .. } => "identity_mismatch",
            ProducerError::StartRefused { kind, .. } => kind,
            ProducerError::Unwritten { .. } => "unwritten_region",
            ProducerError::Exited { .. } => "producer_exited",
            ProducerError::Sandbox { .. } => "sandbox_violation",
            ProducerError::MemoryLimit { .. } => "memory_limit",
            ProducerError::Timeout { .. } => "timeout",
            ProducerError::Panicked { .. } => "backend_panic",
            ProducerError::Backend { .. } => "backend_error",
            ProducerError::Remote { failure, .. } => failure.kind(),
            ProducerError::Ring { source, .. } => source.kind(),
            ProducerError::Rejected { source, .. } => source.kind(),
            ProducerError::BatchBroken { .. } => "batch_broken",
            ProducerError::Lost { .. } => "lost",
            ProducerError::Protocol { .. } => "protocol",
            ProducerError::RestartLimit { .. } => "restart_limit",
            ProducerError::BackingOff { .. } => "backing_off",
            ProducerError::Io { .. } => "io",
        }
    }
}

impl ProducerError {
    /// Whether every start of the same producer would fail the same way, so that restarting is pointless:
    /// a library that does not load as a backend, a config the backend refuses, a description or an
    /// identity the host does not run.
    pub fn repeats_on_every_start(&self) -> bool {
        let refused = |code: u32| {
            [PdhostStatus::BadConfig, PdhostStatus::Unsupported, PdhostStatus::InvalidArgument]
                .iter()
                .any(|&s| s as u32 == code)
        };
        match self {
            ProducerError::DescribeMismatch { .. } | ProducerError::IdentityMismatch { .. } => true,
            ProducerError::StartFailed { stage, status, .. } => match stage.as_str() {
                "load" => true,
                "open" | "describe" | "capabilities" => refused(*status) || *status == 0,
                _ => false,
            },
            _ => false,
        }
    }
}
