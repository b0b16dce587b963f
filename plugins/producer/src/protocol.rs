//! Control messages between the host and a producer, over a Unix socket pair: a little-endian `u32`
//! length, then that many bytes of postcard. K/V never travels here; it goes through the ring.

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

/// The largest message either side accepts. Prefill requests carry token ids (4 bytes each); replies are
/// a few hundred bytes.
pub const MAX_MESSAGE: u32 = 64 << 20;

/// Host to producer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToProducer {
    /// Prefill tokens `start_pos..` of a request into one span.
    Prefill {
        /// The host's request id.
        request_id: u64,
        /// Position of the first token.
        start_pos: u64,
        /// Token ids.
        tokens: Vec<u32>,
    },
    /// Close the backend and exit 0.
    Shutdown,
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
    /// The backend failed; nothing was committed.
    Failed {
        /// The request.
        request_id: u64,
        /// `PdhostStatus` code (or another code the backend returned).
        status: u32,
        /// One line.
        message: String,
    },
}

/// Writes one message.
pub fn send<T: Serialize>(mut to: impl Write, message: &T) -> std::io::Result<()> {
    let bytes = postcard::to_allocvec(message).map_err(std::io::Error::other)?;
    let mut buf = Vec::with_capacity(4 + bytes.len());
    buf.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    buf.extend_from_slice(&bytes);
    to.write_all(&buf)
}

/// Reads one message: `Ok(None)` at a clean end of stream.
pub fn recv<T: for<'de> Deserialize<'de>>(mut from: impl Read) -> std::io::Result<Option<T>> {
    let mut len = [0u8; 4];
    match from.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len);
    if len > MAX_MESSAGE {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("control message of {len} bytes: expected at most {MAX_MESSAGE}"),
        ));
    }
    let mut bytes = vec![0u8; len as usize];
    from.read_exact(&mut bytes)?;
    postcard::from_bytes(&bytes)
        .map(Some)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("control message: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_oversize_is_refused() {
        let m = ToProducer::Prefill { request_id: 7, start_pos: 3, tokens: vec![1, 2, 3] };
        let mut buf = Vec::new();
        send(&mut buf, &m).unwrap();
        assert_eq!(recv::<ToProducer>(&buf[..]).unwrap(), Some(m));
        assert_eq!(recv::<ToProducer>(&[][..]).unwrap(), None);
        let huge = (MAX_MESSAGE + 1).to_le_bytes();
        assert_eq!(recv::<ToProducer>(&huge[..]).unwrap_err().kind(), std::io::ErrorKind::InvalidData);
        let garbage = [3u8, 0, 0, 0, 0xff, 0xff, 0xff];
        assert!(recv::<FromProducer>(&garbage[..]).is_err());
    }
}
