//! The fixed frame header: 64 bytes, `#[repr(C)]`, little-endian.
//!
//! The header is always decoded from a *private copy* of its bytes (a `[u8; 64]` the reader owns), never
//! from memory another process can still write. [`HeaderInfo::parse`] turns those bytes into the geometry
//! of the frame, computed with checked arithmetic.

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::error::SpanError;

/// `b"PDKVSPAN"` read as a little-endian `u64`.
pub const FRAME_MAGIC: [u8; 8] = *b"PDKVSPAN";

/// The major version of the frame format. A reader rejects any other major version.
///
/// Version constants only go up. A change that an older reader would misread bumps the major version.
pub const FORMAT_MAJOR: u16 = 1;
/// The minor version this code writes. Minor versions only append fields after the v1.0 header (see
/// `header_len`), which older readers skip; a reader accepts any minor version of its major.
pub const FORMAT_MINOR: u16 = 0;

/// Size of the v1.0 header in bytes.
pub const HEADER_LEN: usize = 64;
/// The largest `header_len` a reader accepts (room for appended fields in later minor versions).
pub const MAX_HEADER_LEN: u32 = 4096;
/// The largest manifest a reader accepts. A manifest for thousands of layers is a few tens of KiB.
pub const MAX_MANIFEST_LEN: u32 = 1 << 20;
/// The largest payload a reader accepts (16 GiB): far above any span one prefill produces, far below
/// anything that could overflow offset arithmetic.
pub const MAX_PAYLOAD_LEN: u64 = 1 << 34;
/// The payload starts at the first multiple of this many bytes after the manifest, so producers can
/// write tensors with vector-aligned stores. The padding bytes must be zero.
pub const PAYLOAD_ALIGN: u64 = 64;
/// Byte offset of the checksum field, which the checksum itself treats as zero.
pub const CHECKSUM_OFFSET: usize = 32;

/// Flags defined by v1.0. None are; every bit is reserved and must be zero.
pub const KNOWN_FLAGS: u32 = 0;

/// The frame header exactly as it lies in memory.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct FrameHeader {
    /// [`FRAME_MAGIC`].
    pub magic: [u8; 8],
    /// [`FORMAT_MAJOR`].
    pub version_major: U16,
    /// [`FORMAT_MINOR`] of the writer.
    pub version_minor: U16,
    /// Reserved, zero in v1.0.
    pub flags: U32,
    /// Length of the postcard manifest that follows the header.
    pub manifest_len: U32,
    /// Length of this header: 64 in v1.0; later minor versions may append fields.
    pub header_len: U32,
    /// Length of the payload.
    pub payload_len: U64,
    /// XXH3-64 (seed 0) of the whole frame with these 8 bytes taken as zero.
    pub checksum: U64,
    /// The epoch the host gave this producer process; it changes on every restart.
    pub producer_epoch: U64,
    /// The generation of the ring slot the host granted for this frame (0 in a file).
    pub slot_generation: U64,
    /// The producer's frame sequence number, counting from 0 per epoch.
    pub sequence: U64,
}

const _: () = assert!(size_of::<FrameHeader>() == HEADER_LEN);
// The largest frame a reader accepts is far from overflowing u64 (or usize on 64-bit hosts).
const _: () = assert!(
    (MAX_HEADER_LEN as u64 + MAX_MANIFEST_LEN as u64 + PAYLOAD_ALIGN).checked_add(MAX_PAYLOAD_LEN).is_some()
        && MAX_PAYLOAD_LEN < (1 << 40)
);
const _: () = assert!(std::mem::offset_of!(FrameHeader, checksum) == CHECKSUM_OFFSET);

impl FrameHeader {
    /// A v1.0 header with the given lengths and ring coordinates, checksum zero.
    pub fn new(manifest_len: u32, payload_len: u64, epoch: u64, generation: u64, sequence: u64) -> Self {
        FrameHeader {
            magic: FRAME_MAGIC,
            version_major: FORMAT_MAJOR.into(),
            version_minor: FORMAT_MINOR.into(),
            flags: 0.into(),
            manifest_len: manifest_len.into(),
            header_len: (HEADER_LEN as u32).into(),
            payload_len: payload_len.into(),
            checksum: 0.into(),
            producer_epoch: epoch.into(),
            slot_generation: generation.into(),
            sequence: sequence.into(),
        }
    }
}

/// What a structurally valid header says about the frame behind it. Every offset here has been computed
/// with checked arithmetic and bounded by the `MAX_*` constants, so it cannot overflow later sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeaderInfo {
    /// Writer's minor version.
    pub version_minor: u16,
    /// Header length (>= 64).
    pub header_len: u64,
    /// Manifest length.
    pub manifest_len: u64,
    /// Offset of the payload from the start of the frame.
    pub payload_offset: u64,
    /// Payload length.
    pub payload_len: u64,
    /// `payload_offset + payload_len`: the exact length of the frame.
    pub frame_len: u64,
    /// The checksum the header claims.
    pub checksum: u64,
    /// Producer epoch.
    pub producer_epoch: u64,
    /// Slot generation.
    pub slot_generation: u64,
    /// Sequence number.
    pub sequence: u64,
}

impl HeaderInfo {
    /// Validates the fixed header fields. `bytes` is the reader's private copy of the first 64 bytes.
    pub fn parse(bytes: &[u8; HEADER_LEN]) -> Result<Self, SpanError> {
        let h = FrameHeader::read_from_bytes(bytes).expect("64 bytes always decode as FrameHeader");
        if h.magic != FRAME_MAGIC {
            return Err(SpanError::BadMagic { expected: FRAME_MAGIC, found: h.magic });
        }
        if h.version_major.get() != FORMAT_MAJOR {
            return Err(SpanError::UnsupportedMajorVersion { expected: FORMAT_MAJOR, found: h.version_major.get() });
        }
        let flags = h.flags.get();
        if flags & !KNOWN_FLAGS != 0 {
            return Err(SpanError::UnknownFlags { known: KNOWN_FLAGS, found: flags });
        }
        let header_len = h.header_len.get();
        if header_len < HEADER_LEN as u32 || header_len > MAX_HEADER_LEN || header_len % 8 != 0 {
            return Err(SpanError::BadHeaderLen { min: HEADER_LEN as u32, max: MAX_HEADER_LEN, found: header_len });
        }
        let manifest_len = h.manifest_len.get();
        if manifest_len == 0 || manifest_len > MAX_MANIFEST_LEN {
            return Err(SpanError::BadManifestLen { max: MAX_MANIFEST_LEN, found: manifest_len });
        }
        let payload_len = h.payload_len.get();
        if payload_len > MAX_PAYLOAD_LEN {
            return Err(SpanError::PayloadTooLarge { max: MAX_PAYLOAD_LEN, found: payload_len });
        }
        // No sum below can overflow: the bounds just checked keep it under 2^35 (asserted at compile time).
        let payload_offset = (u64::from(header_len) + u64::from(manifest_len)).next_multiple_of(PAYLOAD_ALIGN);
        let frame_len = payload_offset + payload_len;
        Ok(HeaderInfo {
            version_minor: h.version_minor.get(),
            header_len: u64::from(header_len),
            manifest_len: u64::from(manifest_len),
            payload_offset,
            payload_len,
            frame_len,
            checksum: h.checksum.get(),
            producer_epoch: h.producer_epoch.get(),
            slot_generation: h.slot_generation.get(),
            sequence: h.sequence.get(),
        })
    }

    /// The manifest's byte range inside the frame.
    pub fn manifest_range(&self) -> std::ops::Range<usize> {
        // Both bounds are < 2^21 (checked in `parse`).
        self.header_len as usize..(self.header_len + self.manifest_len) as usize
    }
}

/// The ring coordinates a host expects of the next frame, from geometry it keeps privately.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingExpectation {
    /// The epoch the host gave the producer.
    pub producer_epoch: u64,
    /// The generation the host granted for the slot.
    pub slot_generation: u64,
    /// The next sequence number.
    pub sequence: u64,
    /// The slot's capacity in bytes: a frame may not be longer.
    pub slot_capacity: u64,
}

impl RingExpectation {
    /// Checks a parsed header against what the host expects. Pure: the host's ring reader calls it on its
    /// private header copy before it copies a single payload byte.
    pub fn check(&self, info: &HeaderInfo) -> Result<(), SpanError> {
        if info.producer_epoch != self.producer_epoch {
            return Err(SpanError::WrongEpoch { expected: self.producer_epoch, found: info.producer_epoch });
        }
        if info.slot_generation != self.slot_generation {
            return Err(SpanError::StaleGeneration { expected: self.slot_generation, found: info.slot_generation });
        }
        if info.sequence != self.sequence {
            return Err(SpanError::UnexpectedSequence { expected: self.sequence, found: info.sequence });
        }
        if info.frame_len > self.slot_capacity {
            return Err(SpanError::FrameExceedsSlot { capacity: self.slot_capacity, found: info.frame_len });
        }
        Ok(())
    }
}
