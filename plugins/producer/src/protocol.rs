//! Control messages between the host and a producer, over a Unix socket pair: a little-endian `u32`
//! length, then that many bytes of postcard. K/V never travels here; it goes through the ring.

use std::io::{Read, Write};

use pdhost_plugin_abi::{PdhostDtype, PdhostLayerKind, PdhostLayout};
use serde::{Deserialize, Serialize};
use shm_format::{Dtype, KvGeometry, LayerKv};

/// The largest host-to-producer message: a prefill request carries token ids (4 bytes each).
pub const MAX_TO_PRODUCER: u32 = 64 << 20;
/// The largest producer-to-host message the host accepts before allocating: a `Ready` for a model of tens
/// of thousands of layers, or a one-line error; anything larger is a protocol violation.
pub const MAX_FROM_PRODUCER: u32 = 4 << 20;

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

impl Described {
    /// The KV geometry the backend described: one layer per entry, every kind checked.
    pub fn geometry(&self) -> Result<KvGeometry, String> {
        let layer = |(i, l): (usize, &LayerDesc)| match l.kind {
            k if k == PdhostLayerKind::Full as u32 => Ok(LayerKv::Full { kv_heads: l.kv_heads, head_dim: l.head_dim }),
            k if k == PdhostLayerKind::Sliding as u32 => {
                Ok(LayerKv::Sliding { window: l.window, kv_heads: l.kv_heads, head_dim: l.head_dim })
            }
            k if k == PdhostLayerKind::Recurrent as u32 => Ok(LayerKv::Recurrent { state_elems: l.state_elems }),
            k => Err(format!("layer {i} kind: expected 0 (full), 1 (sliding) or 2 (recurrent), found {k}")),
        };
        Ok(KvGeometry { layers: self.layers.iter().enumerate().map(layer).collect::<Result<_, _>>()? })
    }

    /// The element type of the backend's spans.
    pub fn wire_dtype(&self) -> Result<Dtype, String> {
        match self.dtype {
            d if d == PdhostDtype::F32 as u32 => Ok(Dtype::F32),
            d if d == PdhostDtype::F16 as u32 => Ok(Dtype::F16),
            d if d == PdhostDtype::Bf16 as u32 => Ok(Dtype::Bf16),
            other => Err(format!("dtype: expected 0 (f32), 1 (f16) or 2 (bf16), found {other}")),
        }
    }

    /// `"dense"` or `"grouped"`.
    pub fn layout_name(&self) -> Result<&'static str, String> {
        match self.layout {
            l if l == PdhostLayout::Dense as u32 => Ok("dense"),
            l if l == PdhostLayout::Grouped as u32 => Ok("grouped"),
            other => Err(format!("layout: expected 0 (dense) or 1 (grouped), found {other}")),
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

/// Reads one message of at most `max` bytes: `Ok(None)` at a clean end of stream.
pub fn recv<T: for<'de> Deserialize<'de>>(mut from: impl Read, max: u32) -> std::io::Result<Option<T>> {
    let mut len = [0u8; 4];
    match from.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len);
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a message of {len} bytes (the limit is {max})"),
        ));
    }
    let mut bytes = vec![0u8; len as usize];
    from.read_exact(&mut bytes)?;
    postcard::from_bytes(&bytes)
        .map(Some)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("undecodable bytes ({e})")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_oversize_is_refused() {
        let m = ToProducer::Prefill { request_id: 7, start_pos: 3, tokens: vec![1, 2, 3] };
        let mut buf = Vec::new();
        send(&mut buf, &m).unwrap();
        assert_eq!(recv::<ToProducer>(&buf[..], MAX_TO_PRODUCER).unwrap(), Some(m));
        assert_eq!(recv::<ToProducer>(&[][..], MAX_TO_PRODUCER).unwrap(), None);
        let huge = (MAX_FROM_PRODUCER + 1).to_le_bytes();
        let err = recv::<FromProducer>(&huge[..], MAX_FROM_PRODUCER).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
        let garbage = [3u8, 0, 0, 0, 0xff, 0xff, 0xff];
        assert!(recv::<FromProducer>(&garbage[..], MAX_FROM_PRODUCER).is_err());
    }
}
