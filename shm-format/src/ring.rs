//! The layout of a ring: a host-owned control segment and a producer-written data segment.
//!
//! Pure arithmetic and constants; the mapping and the atomic accesses live in `pdhost-shm-ring`.
//!
//! ```text
//! control segment (host writes; the producer's mapping is read-only, enforced by F_SEAL_FUTURE_WRITE)
//!   0      ControlHeader (64 B): magic "PDRINGCT", version, slot_count, slot_stride, producer_epoch
//!   64     grant word of slot 0 (u64), padded to 64 B
//!   128    grant word of slot 1 ...
//!
//! data segment (the producer writes; the host's mapping is read-only)
//!   i * slot_stride + 0    commit word of slot i (u64), padded to 64 B
//!   i * slot_stride + 64   the frame (header, manifest, payload), at most slot_stride - 64 bytes
//! ```
//!
//! Protocol per slot, generations counting from 1: the host stores `grant = g` (Release). The producer,
//! seeing `grant == g > commit` (Acquire), writes the frame with `slot_generation = g`, then stores
//! `commit = g` (Release) and rings the host's doorbell. The host, seeing `commit == g` (Acquire), copies
//! the frame out, validates it, re-checks `commit == g`, and only then stores `grant = g + 1`, which hands
//! the slot back. Frame `n` of an epoch uses slot `n % slot_count`.

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::words;

/// Magic of the control segment.
pub const CONTROL_MAGIC: [u8; 8] = *b"PDRINGCT";
/// Ring layout major version; only goes up.
pub const RING_MAJOR: u16 = 1;
/// Ring layout minor version; only goes up.
pub const RING_MINOR: u16 = 0;
/// Every shared word sits alone in a cache line.
pub const WORD_STRIDE: u64 = 64;
/// Slots and segments are whole pages.
pub const PAGE: u64 = 4096;
/// Most slots a ring may have.
pub const MAX_SLOTS: u32 = 1024;
/// Largest slot stride (a frame of up to 16 GiB plus its commit line).
pub const MAX_SLOT_STRIDE: u64 = (1 << 34) + PAGE;

/// The first 64 bytes of the control segment.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct ControlHeader {
    /// [`CONTROL_MAGIC`].
    pub magic: [u8; 8],
    /// [`RING_MAJOR`].
    pub version_major: U16,
    /// [`RING_MINOR`].
    pub version_minor: U16,
    /// Number of slots.
    pub slot_count: U32,
    /// Bytes from one slot to the next in the data segment.
    pub slot_stride: U64,
    /// The epoch of the producer this ring was made for.
    pub producer_epoch: U64,
    /// Reserved, zero.
    pub reserved: [u8; 32],
}

const _: () = assert!(size_of::<ControlHeader>() == 64);

/// Why ring geometry is invalid.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RingLayoutError {
    /// Bad control magic.
    #[error("control segment magic: expected {}, found {}", words::bytes(&CONTROL_MAGIC), words::bytes(found))]
    BadMagic {
        /// What the segment holds.
        found: [u8; 8],
    },
    /// Unknown major version.
    #[error("ring layout major version: expected {RING_MAJOR}, found {found}")]
    UnsupportedMajorVersion {
        /// What the segment holds.
        found: u16,
    },
    /// Slot count outside `1..=MAX_SLOTS`.
    #[error("slot count: expected 1..={MAX_SLOTS}, found {found}")]
    BadSlotCount {
        /// Requested or found.
        found: u32,
    },
    /// Slot stride not a page multiple in range.
    #[error("slot stride: expected a multiple of {PAGE} in {PAGE}..={MAX_SLOT_STRIDE}, found {found}")]
    BadSlotStride {
        /// Requested or found.
        found: u64,
    },
}

/// The geometry of one ring. The host keeps its own copy and never re-reads it from shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingGeometry {
    slot_count: u32,
    slot_stride: u64,
}

impl RingGeometry {
    /// A ring of `slot_count` slots, each able to hold a frame of `frame_capacity` bytes.
    pub fn new(slot_count: u32, frame_capacity: u64) -> Result<Self, RingLayoutError> {
        let stride = frame_capacity
            .checked_add(WORD_STRIDE)
            .and_then(|n| n.checked_next_multiple_of(PAGE))
            .ok_or(RingLayoutError::BadSlotStride { found: u64::MAX })?;
        Self::from_parts(slot_count, stride)
    }

    fn from_parts(slot_count: u32, slot_stride: u64) -> Result<Self, RingLayoutError> {
        if slot_count == 0 || slot_count > MAX_SLOTS {
            return Err(RingLayoutError::BadSlotCount { found: slot_count });
        }
        if slot_stride == 0 || !slot_stride.is_multiple_of(PAGE) || slot_stride > MAX_SLOT_STRIDE {
            return Err(RingLayoutError::BadSlotStride { found: slot_stride });
        }
        Ok(RingGeometry { slot_count, slot_stride })
    }

    /// Reads the geometry back from a control header (the producer's side).
    pub fn from_control(header: &ControlHeader) -> Result<(Self, u64), RingLayoutError> {
        if header.magic != CONTROL_MAGIC {
            return Err(RingLayoutError::BadMagic { found: header.magic });
        }
        if header.version_major.get() != RING_MAJOR {
            return Err(RingLayoutError::UnsupportedMajorVersion { found: header.version_major.get() });
        }
        let geometry = Self::from_parts(header.slot_count.get(), header.slot_stride.get())?;
        Ok((geometry, header.producer_epoch.get()))
    }

    /// The control header describing this ring for a producer of `epoch`.
    pub fn control_header(&self, epoch: u64) -> ControlHeader {
        ControlHeader {
            magic: CONTROL_MAGIC,
            version_major: RING_MAJOR.into(),
            version_minor: RING_MINOR.into(),
            slot_count: self.slot_count.into(),
            slot_stride: self.slot_stride.into(),
            producer_epoch: epoch.into(),
            reserved: [0; 32],
        }
    }

    /// Number of slots.
    pub fn slot_count(&self) -> u32 {
        self.slot_count
    }

    /// Bytes between slots.
    pub fn slot_stride(&self) -> u64 {
        self.slot_stride
    }

    /// Largest frame a slot holds.
    pub fn frame_capacity(&self) -> u64 {
        self.slot_stride - WORD_STRIDE
    }

    /// Length of the control segment: the header line plus one line per slot, in whole pages.
    pub fn control_len(&self) -> u64 {
        (WORD_STRIDE * (1 + u64::from(self.slot_count))).next_multiple_of(PAGE)
    }

    /// Length of the data segment.
    pub fn data_len(&self) -> u64 {
        // slot_count <= 1024 and slot_stride <= 2^34 + 4096: under 2^45.
        u64::from(self.slot_count) * self.slot_stride
    }

    /// The slot frame number `sequence` uses.
    pub fn slot_of(&self, sequence: u64) -> u32 {
        (sequence % u64::from(self.slot_count)) as u32
    }

    /// Offset of slot `slot`'s grant word in the control segment.
    pub fn grant_offset(&self, slot: u32) -> u64 {
        assert!(slot < self.slot_count, "slot {slot} out of range");
        WORD_STRIDE * (1 + u64::from(slot))
    }

    /// Offset of slot `slot`'s commit word in the data segment.
    pub fn commit_offset(&self, slot: u32) -> u64 {
        assert!(slot < self.slot_count, "slot {slot} out of range");
        u64::from(slot) * self.slot_stride
    }

    /// Offset of slot `slot`'s frame in the data segment.
    pub fn frame_offset(&self, slot: u32) -> u64 {
        self.commit_offset(slot) + WORD_STRIDE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_round_trips_through_the_control_header() {
        let g = RingGeometry::new(4, 1 << 20).unwrap();
        assert_eq!(g.slot_stride() % PAGE, 0);
        assert!(g.frame_capacity() >= 1 << 20);
        let (back, epoch) = RingGeometry::from_control(&g.control_header(9)).unwrap();
        assert_eq!((back, epoch), (g, 9));
        assert_eq!(g.data_len(), 4 * g.slot_stride());
        assert_eq!(g.frame_offset(1) % 64, 0);
    }

    #[test]
    fn bad_geometry_is_rejected() {
        assert_eq!(RingGeometry::new(0, 10), Err(RingLayoutError::BadSlotCount { found: 0 }));
        assert!(RingGeometry::new(1, u64::MAX).is_err());
        let mut h = RingGeometry::new(1, 10).unwrap().control_header(0);
        h.slot_stride = 4097.into();
        assert_eq!(RingGeometry::from_control(&h), Err(RingLayoutError::BadSlotStride { found: 4097 }));
        h.magic = *b"XXXXXXXX";
        assert!(matches!(RingGeometry::from_control(&h), Err(RingLayoutError::BadMagic { .. })));
    }
}
