//! The KV span wire format of pdhost, and the layout of the shared-memory ring that carries it.
//!
//! A *frame* is a fixed 64-byte header ([`FrameHeader`]), a postcard [`Manifest`], zero padding to a
//! 64-byte boundary, and the payload. `docs/wire-format.md` is the normative specification; this crate is
//! its reference decoder. Everything here is pure: no I/O, no processes, no `unsafe`. Decoding works on
//! bytes the caller owns privately, and every rejection is a typed [`SpanError`].
//!
//! ```
//! use shm_format::{decode_frame, encode_frame, Dtype, FrameCoords, KvGeometry, LayerKv, Manifest};
//!
//! let geometry = KvGeometry { layers: vec![LayerKv::Full { kv_heads: 2, head_dim: 4 }; 3] };
//! let manifest = Manifest::dense(&geometry, 7, 0..5, Dtype::Bf16).unwrap();
//! let payload = vec![0u8; manifest.payload_len() as usize];
//! let frame = encode_frame(&manifest, &payload, FrameCoords::default());
//! let span = decode_frame(&frame).unwrap();
//! assert_eq!(span.manifest, manifest);
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod checksum;
mod decode;
mod encode;
mod error;
pub mod fuzzing;
mod geometry;
mod header;
mod manifest;
pub mod ring;
pub mod testing;
#[cfg(test)]
mod tests;
pub mod words;

pub use checksum::{frame_checksum, seal_frame, FrameHasher};
pub use decode::{
    decode_body, decode_frame, decode_manifest, parse_header_prefix, validate_manifest, verify_prefix, SpanView,
};
pub use encode::{encode_frame, encode_raw, write_prefix, FrameCoords};
pub use error::{SpanError, ALL_KINDS};
pub use geometry::{GeometryMismatch, KvGeometry, LayerKv};
pub use header::{
    FrameHeader, HeaderInfo, RingExpectation, CHECKSUM_OFFSET, FORMAT_MAJOR, FORMAT_MINOR, FRAME_MAGIC, HEADER_LEN,
    KNOWN_FLAGS, MAX_HEADER_LEN, MAX_MANIFEST_LEN, MAX_PAYLOAD_LEN, PAYLOAD_ALIGN,
};
pub use manifest::{
    Dtype, Entry, EntryKind, Fingerprint, Group, GroupKind, Layout, Manifest, MAX_ENTRIES, MAX_GROUPS, MAX_RANK,
};
