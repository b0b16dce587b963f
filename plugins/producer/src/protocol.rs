//! Control messages between the host and a producer, over a Unix socket pair: a little-endian `u32`
//! length, then that many bytes of postcard. K/V never travels here; it goes through the ring.

use std::fmt;
use std::io::{Read, Write};

use pdhost_plugin_abi::{PdhostDtype, PdhostLayerKind, PdhostLayout};
use serde::{Deserialize, Serialize};
use shm_format::{words, Dtype, KvGeometry, LayerKv};

/// The largest host-to-producer message: a prefill request carries token ids (4 bytes each).
pub const MAX_TO_PRODUCER: u32 = 64 << 20;
/// The largest producer-to-host message the host accepts before allocating: a `Ready` for a model of tens
/// of thousands of layers, or a one-line error; anything larger is a protocol violation.
pub const MAX_FROM_PRODUCER: u32 = 4 << 20;

/// Host to producer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToProducer {
    /// Prefill tokens `start_pos..` of a request into one span.
    Prefill(PrefillCall),
    /// The request is over (finished, failed or cancelled): the backend may free its state. No reply.
    Release {
        /// The request.
        request_id: u64,
    },
    /// Close the backend and exit 0.
    Shutdown,
    // Last, so that the variants before keep their postcard tags.
    /// Several calls (of different requests) whose chunks the backend computes in one pass (ABI 1.3
    /// `stage`), each then written into a span of its own and replied to as [`ToProducer::Prefill`] is,
    /// in order. Sent only to a producer whose [`Described::batches`] is set.
    PrefillBatch(Vec<PrefillCall>),
}

/// One prefill: tokens `start_pos..` of a request, into one span.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillCall {
    /// The host's request id.
    pub request_id: u64,
    /// Position of the first token.
    pub start_pos: u64,
    /// Token ids.
    pub tokens: Vec<u32>,
    /// The tokens before `start_pos` when the request starts there (a prefix-cache hit: the host holds
    /// their K/V already); empty otherwise.
    pub context: Vec<u32>,
}

/// One layer as the backend described it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerDesc {
    /// `PdhostLayerKind` code.
    pub kind: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Sliding window.
    pub window: u32,
    /// Recurrent state elements.
    pub state_elems: u64,
}

impl LayerDesc {
    /// How a backend describes `layer` (the inverse of [`Described::geometry`]'s reading of one layer).
    pub fn of(layer: &LayerKv) -> Self {
        let none = LayerDesc { kind: 0, kv_heads: 0, head_dim: 0, window: 0, state_elems: 0 };
        match *layer {
            LayerKv::Full { kv_heads, head_dim } => {
                LayerDesc { kind: PdhostLayerKind::Full as u32, kv_heads, head_dim, ..none }
            }
            LayerKv::Sliding { window, kv_heads, head_dim } => {
                LayerDesc { kind: PdhostLayerKind::Sliding as u32, kv_heads, head_dim, window, ..none }
            }
            LayerKv::Recurrent { state_elems } => {
                LayerDesc { kind: PdhostLayerKind::Recurrent as u32, state_elems, ..none }
            }
        }
    }
}

/// What the backend said it emits.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Described {
    /// The backend's name.
    pub backend: String,
    /// The ABI minor version it was built against.
    pub abi_minor: u32,
    /// `PdhostLayout` code.
    pub layout: u32,
    /// `PdhostDtype` code.
    pub dtype: u32,
    /// The fingerprint the producer will put in every span (the backend's claim, or derived from `layers`).
    pub fingerprint: u64,
    /// Per model layer.
    pub layers: Vec<LayerDesc>,
    /// The model identity the backend reported (ABI 1.2), or `None`.
    pub identity: Option<String>,
    /// What it can do (ABI 1.2); all zero when it does not say.
    pub capabilities: CapabilitiesDesc,
    /// How its spans reach the host when it runs on another machine: the UCX transport of its node's
    /// WRITEs (`tcp/lo`), as UCX reported its own choice. `None` for a local producer, or where the
    /// node could not tell.
    pub transport: Option<String>,
    /// Whether it takes [`ToProducer::PrefillBatch`] and its backend computes a batch's chunks in one
    /// pass (the backend has ABI 1.3 `stage`).
    pub batches: bool,
}

/// A backend's capabilities, as `PdhostCapabilities` gives them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapabilitiesDesc {
    /// `PDHOST_CAP_*` bits.
    pub flags: u32,
    /// Bit per `PdhostDtype` it can emit; 0: the described one.
    pub dtypes: u32,
    /// Bit per `PdhostLayout`; 0: the described one.
    pub layouts: u32,
    /// Most tokens per prefill call; 0: no limit.
    pub max_tokens: u64,
}

/// The most K (or V) values one layer may hold per token: 2^20, 4 MiB of f32.
const MAX_HEAD_VALUES: u64 = 1 << 20;
/// The most values one recurrent layer's state may hold: 2^30, 4 GiB of f32.
const MAX_STATE_ELEMS: u64 = 1 << 30;

/// A field of a [`Described`] that names no known value: which field, what it may be, and what it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadDescription {
    /// The field: `layer 3 kind`, `dtype` or `layout`.
    pub what: String,
    /// The values it may hold.
    pub expected: &'static str,
    /// The value it holds.
    pub found: u64,
}

impl fmt::Display for BadDescription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: expected {}, found {}", self.what, self.expected, self.found)
    }
}

impl std::error::Error for BadDescription {}

impl Described {
    /// The KV geometry the backend described: one layer per entry, every kind checked.
    pub fn geometry(&self) -> Result<KvGeometry, BadDescription> {
        let layer = |(i, l): (usize, &LayerDesc)| {
            // Sizes any span's arithmetic can carry: past them a manifest's lengths would wrap.
            let per_token = u64::from(l.kv_heads) * u64::from(l.head_dim);
            let limits = [
                ("kv_heads x head_dim", per_token, MAX_HEAD_VALUES, "at most 2^20 values per token"),
                ("state_elems", l.state_elems, MAX_STATE_ELEMS, "at most 2^30 values"),
            ];
            for (what, found, max, expected) in limits {
                if found > max {
                    return Err(BadDescription { what: format!("layer {i} {what}"), expected, found });
                }
            }
            Self::layer(i, l)
        };
        Ok(KvGeometry { layers: self.layers.iter().enumerate().map(layer).collect::<Result<_, _>>()? })
    }

    fn layer(i: usize, l: &LayerDesc) -> Result<LayerKv, BadDescription> {
        // The sizes a layer of its kind cannot do without (a field left 0 by mistake is named here, not
        // later as a geometry that does not match the model's).
        let needed: &[(&str, u64)] = match l.kind {
            k if k == PdhostLayerKind::Full as u32 => {
                &[("kv_heads", l.kv_heads.into()), ("head_dim", l.head_dim.into())]
            }
            k if k == PdhostLayerKind::Sliding as u32 => {
                &[("kv_heads", l.kv_heads.into()), ("head_dim", l.head_dim.into()), ("window", l.window.into())]
            }
            k if k == PdhostLayerKind::Recurrent as u32 => &[("state_elems", l.state_elems)],
            _ => &[],
        };
        if let Some((what, found)) = needed.iter().find(|(_, v)| *v == 0) {
            return Err(BadDescription { what: format!("layer {i} {what}"), expected: "at least 1", found: *found });
        }
        match l.kind {
            k if k == PdhostLayerKind::Full as u32 => Ok(LayerKv::Full { kv_heads: l.kv_heads, head_dim: l.head_dim }),
            k if k == PdhostLayerKind::Sliding as u32 => {
                Ok(LayerKv::Sliding { window: l.window, kv_heads: l.kv_heads, head_dim: l.head_dim })
            }
            k if k == PdhostLayerKind::Recurrent as u32 => Ok(LayerKv::Recurrent { state_elems: l.state_elems }),
            found => Err(BadDescription {
                what: format!("layer {i} kind"),
                expected: "0 (full attention), 1 (sliding window) or 2 (recurrent)",
                found: found.into(),
            }),
        }
    }

    /// The element type of the backend's spans.
    pub fn wire_dtype(&self) -> Result<Dtype, BadDescription> {
        match self.dtype {
            d if d == PdhostDtype::F32 as u32 => Ok(Dtype::F32),
            d if d == PdhostDtype::F16 as u32 => Ok(Dtype::F16),
            d if d == PdhostDtype::Bf16 as u32 => Ok(Dtype::Bf16),
            found => Err(BadDescription {
                what: "dtype".into(),
                expected: "0 (f32), 1 (f16) or 2 (bf16)",
                found: found.into(),
            }),
        }
    }

    /// `"dense"` or `"grouped"`.
    pub fn layout_name(&self) -> Result<&'static str, BadDescription> {
        match self.layout {
            l if l == PdhostLayout::Dense as u32 => Ok("dense"),
            l if l == PdhostLayout::Grouped as u32 => Ok("grouped"),
            found => {
                Err(BadDescription { what: "layout".into(), expected: "0 (dense) or 1 (grouped)", found: found.into() })
            }
        }
    }
}

/// Producer to host.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FromProducer {
    /// The backend is open and described; the producer serves requests.
    Ready(Described),
    /// Start-up failed; the producer exits after sending this.
    StartFailed {
        /// `load`, `open`, `describe` or `ring`.
        stage: String,
        /// The backend's `PdhostStatus` code when the backend failed, 0 when the producer did.
        status: u32,
        /// One line.
        message: String,
    },
    /// The span of a prefill is committed to the ring.
    Done {
        /// The request.
        request_id: u64,
        /// The ring sequence number of its frame.
        sequence: u64,
        /// Nanoseconds inside the backend's `prefill` (compute and writing the regions).
        backend_ns: u64,
        /// Nanoseconds the producer spent framing: slot wait, header and manifest, checksum, commit.
        frame_ns: u64,
    },
    /// The backend returned OK but left bytes of a region unwritten (or a region not taken): nothing was
    /// committed.
    Unwritten {
        /// The request.
        request_id: u64,
        /// One line naming the layer, K or V, and the bytes.
        message: String,
    },
    /// The backend failed; nothing was committed.
    Failed {
        /// The request.
        request_id: u64,
        /// `PdhostStatus` code (or another code the backend returned).
        status: u32,
        /// One line.
        message: String,
    },
    /// A relay for a producer on another machine could not deliver the span: nothing was committed, and
    /// the relay exits after sending this.
    Remote {
        /// The request.
        request_id: u64,
        /// What went wrong.
        failure: RemoteFailure,
        /// One line.
        message: String,
    },
}

/// Why a relay for a producer on another machine (issue 15) could not deliver a span.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RemoteFailure {
    /// The connection to the node could not be made, or it ended or broke.
    Connection,
    /// The node refused the session, or its own producer failed.
    Node,
    /// A notification arrived for the awaited slot, but the slot does not hold the frame it announced.
    NotificationWithoutData,
    /// A notification named another slot than the one awaited.
    WrongSlot,
    /// A notification carried another epoch than this relay's.
    StaleEpoch,
    /// The notification announced fewer bytes than the frame's header says it holds.
    Truncated,
    /// The transfer engine failed.
    Transfer,
}

impl RemoteFailure {
    /// A stable snake_case name, for metrics and JSON.
    pub fn kind(self) -> &'static str {
        match self {
            RemoteFailure::Connection => "remote_connection",
            RemoteFailure::Node => "remote_node",
            RemoteFailure::NotificationWithoutData => "notification_without_data",
            RemoteFailure::WrongSlot => "wrong_slot",
            RemoteFailure::StaleEpoch => "stale_epoch",
            RemoteFailure::Truncated => "truncated_transfer",
            RemoteFailure::Transfer => "transfer",
        }
    }
}

impl FromProducer {
    /// What this message is, in words, for protocol errors: `a Ready message`, `a Done reply for request
    /// 7 (frame 3)`. Only its kind and numbers: never a string the producer chose, which could be long or
    /// span lines.
    pub fn summary(&self) -> String {
        match self {
            FromProducer::Ready(_) => "a Ready message".to_string(),
            FromProducer::StartFailed { .. } => "a StartFailed message".to_string(),
            FromProducer::Done { request_id, sequence, .. } => {
                format!("a Done reply for request {request_id} (frame {sequence})")
            }
            FromProducer::Failed { request_id, status, .. } => {
                format!("a Failed reply for request {request_id} (status {status})")
            }
            FromProducer::Unwritten { request_id, .. } => format!("an Unwritten reply for request {request_id}"),
            FromProducer::Remote { request_id, failure, .. } => {
                format!("a Remote reply for request {request_id} ({})", failure.kind())
            }
        }
    }
}

/// The version of the link between a relay and a producer node ([`ToNode::Hello`]): both must speak
/// the same.
pub const LINK_VERSION: u32 = 1;
/// The largest node-to-relay message: as from a local producer.
pub const MAX_FROM_NODE: u32 = MAX_FROM_PRODUCER;
/// The largest relay-to-node message: a prefill request, or a hello with the relay's transfer-engine
/// metadata.
pub const MAX_TO_NODE: u32 = MAX_TO_PRODUCER;
/// The largest hello a node reads: what a relay says before anything else, from a peer not yet known
/// (a backend config is at most 64 KiB, the transfer engine's metadata a few KiB).
pub const MAX_HELLO: u32 = 1 << 20;

/// A relay to a producer node on another machine, over TCP, framed as the local control messages are.
/// The node answers with [`FromProducer`] messages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToNode {
    /// The first message: the session.
    Hello(Hello),
    /// Prefill into the frame at `sequence`, which lands in `slot` at `generation` of the relay's ring.
    Prefill {
        /// The request.
        call: PrefillCall,
        /// The slot.
        slot: u32,
        /// The generation the host granted it.
        generation: u64,
        /// The frame's sequence number.
        sequence: u64,
    },
    /// As [`ToProducer::Release`].
    Release {
        /// The request.
        request_id: u64,
    },
    /// Close the session's producer and the connection.
    Shutdown,
}

impl Message for ToNode {
    const NAME: &'static str = "relay message";
}

/// What a node needs to serve one relay: the backend, its ring's shape and epoch, and where its frames
/// go.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// [`LINK_VERSION`].
    pub version: u32,
    /// The backend the host asked for; the node refuses another than its own.
    pub backend: String,
    /// The backend's configuration, shaped by the host (the node may override keys).
    pub config: String,
    /// The ring's epoch: the node's own ring runs at it, so frames carry the coordinates the host
    /// expects.
    pub epoch: u64,
    /// Ring slots.
    pub slots: u32,
    /// Largest frame a slot holds.
    pub slot_capacity: u64,
    /// The relay's transfer-engine metadata (NIXL's agent metadata).
    pub agent_metadata: Vec<u8>,
    /// Where the relay's ring data segment lies, as its transfers address it.
    pub data_addr: u64,
    /// Its length.
    pub data_len: u64,
}

/// The notification that follows a frame's bytes into a relay's slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FrameNotice {
    /// The session's epoch.
    pub epoch: u64,
    /// The frame's sequence number.
    pub sequence: u64,
    /// The slot written.
    pub slot: u32,
    /// Bytes written from the frame's start.
    pub frame_len: u64,
}

impl FrameNotice {
    /// Its bytes.
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).expect("a plain struct encodes")
    }

    /// Parses exactly one notice from `bytes`.
    pub fn decode(bytes: &[u8]) -> Option<FrameNotice> {
        match postcard::take_from_bytes(bytes) {
            Ok((notice, [])) => Some(notice),
            _ => None,
        }
    }
}

/// A control message type: what [`recv`] calls it when its bytes do not decode.
pub trait Message: Serialize + for<'de> Deserialize<'de> {
    /// In words: `host request`, `producer message`.
    const NAME: &'static str;
}

impl Message for ToProducer {
    const NAME: &'static str = "host request";
}

impl Message for FromProducer {
    const NAME: &'static str = "producer message";
}

/// A control message that breaks the framing: too long, not postcard of the expected type, or with bytes
/// after it. The channel is unusable after one.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MessageError {
    /// The length prefix is past the receiver's limit; nothing was allocated.
    TooLarge {
        /// The prefix.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// The bytes do not decode as the expected message type.
    Malformed {
        /// The message's length.
        len: u32,
        /// The type's [`Message::NAME`].
        message: &'static str,
        /// Why, in words (see [`shm_format::words::postcard_failure`]).
        reason: &'static str,
    },
    /// A message decodes from the start of the bytes, but bytes follow it.
    TrailingBytes {
        /// The message's length.
        len: u32,
        /// Bytes the decoded message used.
        used: u32,
        /// The type's [`Message::NAME`].
        message: &'static str,
    },
}

impl MessageError {
    /// What a well-formed message would have been.
    pub fn expected(&self) -> String {
        match self {
            MessageError::TooLarge { max, .. } => format!("a control message of at most {max} bytes"),
            MessageError::Malformed { message, .. } => format!("a postcard-encoded {message}"),
            MessageError::TrailingBytes { message, .. } => format!("a postcard-encoded {message} and nothing after it"),
        }
    }

    /// What arrived instead.
    pub fn found(&self) -> String {
        match self {
            MessageError::TooLarge { len, .. } => format!("a length prefix of {len} bytes"),
            MessageError::Malformed { len, reason, .. } => {
                let s = if *len == 1 { "" } else { "s" };
                format!("{len} byte{s} that do not decode as one ({reason})")
            }
            MessageError::TrailingBytes { len, used, .. } => {
                format!("{len} bytes, of which {} follow a {used}-byte message", len - used)
            }
        }
    }
}

impl fmt::Display for MessageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed control message: expected {}, found {}", self.expected(), self.found())
    }
}

impl std::error::Error for MessageError {}

/// Why [`recv`] returned no message.
#[derive(Debug)]
#[non_exhaustive]
pub enum RecvError {
    /// Reading the socket failed, or it ended inside a message.
    Io(std::io::Error),
    /// The bytes broke the framing.
    Message(MessageError),
}

impl fmt::Display for RecvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecvError::Io(e) => write!(f, "reading a control message: {e}"),
            RecvError::Message(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for RecvError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RecvError::Io(e) => Some(e),
            RecvError::Message(e) => Some(e),
        }
    }
}

impl From<std::io::Error> for RecvError {
    fn from(e: std::io::Error) -> Self {
        RecvError::Io(e)
    }
}

/// Writes one message.
pub fn send<T: Serialize>(mut to: impl Write, message: &T) -> std::io::Result<()> {
    let bytes = postcard::to_allocvec(message).map_err(std::io::Error::other)?;
    let mut buf = Vec::with_capacity(4 + bytes.len());
    buf.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    buf.extend_from_slice(&bytes);
    to.write_all(&buf)
}

/// Reads one message of at most `max` bytes: `Ok(None)` at a clean end of stream. The message's bytes must
/// decode as exactly one `T`, with nothing left over.
pub fn recv<T: Message>(mut from: impl Read, max: u32) -> Result<Option<T>, RecvError> {
    let mut len = [0u8; 4];
    match from.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len);
    if len > max {
        return Err(RecvError::Message(MessageError::TooLarge { len, max }));
    }
    // Grown as the bytes arrive, not allocated from the length the peer claims: a peer that names the
    // largest length and sends one byte holds one byte's worth of memory, not `max`.
    let mut bytes = Vec::new();
    from.by_ref().take(u64::from(len)).read_to_end(&mut bytes)?;
    if bytes.len() < len as usize {
        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
    }
    decode(&bytes).map(Some).map_err(RecvError::Message)
}

/// Decodes exactly one `T` from all of `bytes`.
fn decode<T: Message>(bytes: &[u8]) -> Result<T, MessageError> {
    let len = bytes.len() as u32;
    let (message, rest) = postcard::take_from_bytes::<T>(bytes).map_err(|e| MessageError::Malformed {
        len,
        message: T::NAME,
        reason: words::postcard_failure(&e),
    })?;
    if !rest.is_empty() {
        return Err(MessageError::TrailingBytes { len, used: len - rest.len() as u32, message: T::NAME });
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(body: &[u8]) -> Vec<u8> {
        [&(body.len() as u32).to_le_bytes()[..], body].concat()
    }

    #[test]
    fn messages_round_trip_and_oversize_is_refused() {
        let m = ToProducer::Prefill(PrefillCall {
            request_id: 7,
            start_pos: 3,
            tokens: vec![1, 2, 3],
            context: vec![4, 5, 6],
        });
        let mut buf = Vec::new();
        send(&mut buf, &m).unwrap();
        assert_eq!(recv::<ToProducer>(&buf[..], MAX_TO_PRODUCER).unwrap(), Some(m));
        assert_eq!(recv::<ToProducer>(&[][..], MAX_TO_PRODUCER).unwrap(), None);
        let huge = (MAX_FROM_PRODUCER + 1).to_le_bytes();
        let err = recv::<FromProducer>(&huge[..], MAX_FROM_PRODUCER).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "malformed control message: expected a control message of at most {MAX_FROM_PRODUCER} bytes, \
                 found a length prefix of {} bytes",
                MAX_FROM_PRODUCER + 1
            )
        );
        // The socket ends inside a message: an I/O error, not a malformed message.
        assert!(matches!(recv::<FromProducer>(&framed(&[0, 1])[..5], MAX_FROM_PRODUCER), Err(RecvError::Io(_))));
    }

    /// What the faulty backend's `garbage_reply` writes: postcard's own wording never reaches a message.
    #[test]
    fn garbage_is_named_in_words() {
        let err = recv::<FromProducer>(&framed(&[0xff; 4])[..], MAX_FROM_PRODUCER).unwrap_err();
        let RecvError::Message(e) = &err else { panic!("{err}") };
        assert_eq!(e.expected(), "a postcard-encoded producer message");
        assert_eq!(e.found(), "4 bytes that do not decode as one (they end inside a value)");
        assert_eq!(
            err.to_string(),
            "malformed control message: expected a postcard-encoded producer message, \
             found 4 bytes that do not decode as one (they end inside a value)"
        );
        // A variant index past the enum's: serde's check, in words too.
        let err = recv::<ToProducer>(&framed(&[9])[..], MAX_TO_PRODUCER).unwrap_err().to_string();
        assert!(
            err.ends_with("found 1 byte that do not decode as one (a value the message type does not allow)"),
            "{err}"
        );
        assert!(!err.contains("Hit the end") && !err.contains("{"), "{err}");
    }

    #[test]
    fn bytes_after_a_message_are_refused() {
        let mut body = postcard::to_allocvec(&ToProducer::Shutdown).unwrap();
        assert_eq!(recv::<ToProducer>(&framed(&body)[..], MAX_TO_PRODUCER).unwrap(), Some(ToProducer::Shutdown));
        body.extend_from_slice(&[0, 0]);
        let err = recv::<ToProducer>(&framed(&body)[..], MAX_TO_PRODUCER).unwrap_err();
        let RecvError::Message(e) = &err else { panic!("{err}") };
        assert_eq!(*e, MessageError::TrailingBytes { len: 3, used: 1, message: "host request" });
        assert_eq!(
            err.to_string(),
            "malformed control message: expected a postcard-encoded host request and nothing after it, \
             found 3 bytes, of which 2 follow a 1-byte message"
        );
    }

    #[test]
    fn replies_and_descriptions_are_named_in_words() {
        let done = FromProducer::Done { request_id: 7, sequence: 3, backend_ns: 1, frame_ns: 2 };
        assert_eq!(done.summary(), "a Done reply for request 7 (frame 3)");
        assert_eq!(FromProducer::Ready(Described::default()).summary(), "a Ready message");
        let bad = Described {
            layers: vec![LayerDesc { kind: 7, kv_heads: 1, head_dim: 4, window: 0, state_elems: 0 }],
            dtype: 9,
            layout: 5,
            ..Described::default()
        };
        assert_eq!(
            bad.geometry().unwrap_err().to_string(),
            "layer 0 kind: expected 0 (full attention), 1 (sliding window) or 2 (recurrent), found 7"
        );
        assert_eq!(bad.wire_dtype().unwrap_err().to_string(), "dtype: expected 0 (f32), 1 (f16) or 2 (bf16), found 9");
        assert_eq!(bad.layout_name().unwrap_err().to_string(), "layout: expected 0 (dense) or 1 (grouped), found 5");
        // A size a layer of its kind needs, left 0.
        let layer = |kind, kv_heads, window, state_elems| Described {
            layers: vec![
                LayerDesc { kind: PdhostLayerKind::Full as u32, kv_heads: 1, head_dim: 4, window: 0, state_elems: 0 },
                LayerDesc { kind, kv_heads, head_dim: 4, window, state_elems },
            ],
            ..Described::default()
        };
        for (d, what) in [
            (layer(PdhostLayerKind::Full as u32, 0, 0, 0), "layer 1 kv_heads"),
            (layer(PdhostLayerKind::Sliding as u32, 1, 0, 0), "layer 1 window"),
            (layer(PdhostLayerKind::Recurrent as u32, 0, 0, 0), "layer 1 state_elems"),
        ] {
            assert_eq!(d.geometry().unwrap_err().to_string(), format!("{what}: expected at least 1, found 0"));
        }
        assert!(layer(PdhostLayerKind::Sliding as u32, 1, 8, 0).geometry().is_ok());
        assert!(layer(PdhostLayerKind::Recurrent as u32, 0, 0, 16).geometry().is_ok());
    }
}
