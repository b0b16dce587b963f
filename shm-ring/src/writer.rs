//! The producer end of a ring.
//!
//! The producer trusts the host: it reads geometry from the control segment the host wrote. It maps the
//! control segment read-only (the seals allow nothing else) and the data segment writable.

use std::os::fd::OwnedFd;
use std::time::Instant;

use shm_format::ring::{ControlHeader, RingGeometry, RingLayoutError};
use shm_format::{seal_frame, write_prefix, FrameCoords, HeaderInfo, Manifest, SpanError};
use zerocopy::FromBytes;

use crate::doorbell::{wait, Doorbell, Woken};
use crate::protocol;
use crate::segment::memfd::{MemfdSegment, SegmentError};
use crate::segment::{Segment, SharedWord};

/// Why the producer could not write a span.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WriteError {
    /// The host did not hand the slot back before the deadline.
    #[error("slot {slot} not granted before the deadline: expected a generation above {last_commit}")]
    Timeout {
        /// Slot.
        slot: u32,
        /// The producer's last commit of it.
        last_commit: u64,
    },
    /// The control segment does not describe a ring this code knows.
    #[error("control segment: {0}")]
    Layout(#[from] RingLayoutError),
    /// A segment could not be mapped.
    #[error(transparent)]
    Segment(#[from] SegmentError),
    /// The span does not fit or does not encode.
    #[error(transparent)]
    Span(#[from] SpanError),
    /// Waiting failed.
    #[error("waiting on the ring doorbell failed: {0}")]
    Io(#[from] std::io::Error),
}

/// The producer end of one ring.
#[derive(Debug)]
pub struct RingWriter<C: Segment, D: Segment> {
    control: C,
    data: D,
    geometry: RingGeometry,
    epoch: u64,
    next_sequence: u64,
    /// The last generation this producer committed, per slot.
    committed: Vec<u64>,
    to_host: Doorbell,
    from_host: Doorbell,
}

impl RingWriter<MemfdSegment, MemfdSegment> {
    /// Maps a ring from the four descriptors the host handed over, in [`crate::RingReader::peer_fds`] order.
    pub fn open(fds: [OwnedFd; 4]) -> Result<Self, WriteError> {
        let [control_fd, data_fd, to_host, from_host] = fds;
        let control_len = rustix::fs::fstat(&control_fd).map_err(std::io::Error::from)?.st_size as u64;
        let control = MemfdSegment::open("control", control_fd, control_len, false)?;
        // The segment must hold what its header says it holds: a typed error here, not a panic at the
        // first slot past its end.
        let too_short =
            |expected: u64| SegmentError::SizeMismatch { name: "control".into(), expected, found: control_len };
        let mut header = [0u8; 64];
        if control_len < header.len() as u64 {
            return Err(too_short(header.len() as u64).into());
        }
        control.copy_out(0, &mut header);
        let header = ControlHeader::read_from_bytes(&header).expect("64 bytes");
        let (geometry, epoch) = RingGeometry::from_control(&header)?;
        if control_len < geometry.control_len() {
            return Err(too_short(geometry.control_len()).into());
        }
        let data = MemfdSegment::open("data", data_fd, geometry.data_len(), true)?;
        Ok(Self::new(control, data, geometry, epoch, Doorbell::from_fd(to_host)?, Doorbell::from_fd(from_host)?))
    }
}

impl<C: Segment, D: Segment> RingWriter<C, D> {
    /// A writer over mapped segments (the in-heap tests use this directly).
    pub fn new(
        control: C,
        data: D,
        geometry: RingGeometry,
        epoch: u64,
        to_host: Doorbell,
        from_host: Doorbell,
    ) -> Self {
        assert!(data.writable(), "the producer writes the data segment");
        RingWriter {
            committed: vec![0; geometry.slot_count() as usize],
            control,
            data,
            geometry,
            epoch,
            next_sequence: 0,
            to_host,
            from_host,
        }
    }

    /// The ring's geometry.
    pub fn geometry(&self) -> RingGeometry {
        self.geometry
    }

    /// The epoch the host gave this producer.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The data segment's mapping in this process, for a transfer engine that writes frames into it
    /// from another machine (a relay for a remote producer registers it with NIXL). Writes through the
    /// pointer are this producer's writes: the host validates whatever they leave.
    pub fn data_region(&self) -> (std::ptr::NonNull<u8>, usize) {
        (self.data.base(), self.data.len())
    }

    /// The sequence number of the next frame.
    pub fn next_sequence(&self) -> u64 {
        self.next_sequence
    }

    /// Waits until the slot of the next frame is granted, and returns a handle to write it.
    pub fn reserve(&mut self, deadline: Instant) -> Result<SlotWriter<'_, C, D>, WriteError> {
        let slot = self.geometry.slot_of(self.next_sequence);
        let last_commit = self.committed[slot as usize];
        let generation = loop {
            let grant = SharedWord::new(&self.control, self.geometry.grant_offset(slot) as usize);
            if let Some(g) = protocol::producer_grant(&grant, last_commit) {
                break g;
            }
            match wait(&self.from_host, None, deadline)? {
                Woken::Rang | Woken::Other => {}
                // The host is gone: no grant will come, so do not spin until the deadline.
                Woken::TimedOut | Woken::Closed => return Err(WriteError::Timeout { slot, last_commit }),
            }
        };
        Ok(SlotWriter { ring: self, slot, generation })
    }

    /// Writes one span: reserves a slot, writes header and manifest, lets `fill` write the payload in
    /// place, seals the checksum and commits.
    pub fn write_span(
        &mut self,
        manifest: &Manifest,
        deadline: Instant,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<HeaderInfo, WriteError> {
        let mut slot = self.reserve(deadline)?;
        let info = slot.write_prefix(&manifest.encode(), manifest.payload_len())?;
        let frame = slot.frame_mut();
        fill(&mut frame[info.payload_offset as usize..info.frame_len as usize]);
        seal_frame(&mut frame[..info.frame_len as usize]);
        slot.commit();
        Ok(info)
    }
}

/// A granted slot, ready to be written and committed.
#[derive(Debug)]
pub struct SlotWriter<'a, C: Segment, D: Segment> {
    ring: &'a mut RingWriter<C, D>,
    slot: u32,
    generation: u64,
}

impl<C: Segment, D: Segment> SlotWriter<'_, C, D> {
    /// The coordinates a frame in this slot must carry.
    pub fn coords(&self) -> FrameCoords {
        FrameCoords { epoch: self.ring.epoch, generation: self.generation, sequence: self.ring.next_sequence }
    }

    /// The slot's index.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The frame area of the slot.
    ///
    /// The producer owns this memory: the host maps it read-only and never writes it, so a unique
    /// reference to it is sound in this process. The host may read it at any time, even now; those
    /// reads are volatile and change nothing here, and what they see is the host's to validate.
    pub fn frame_mut(&mut self) -> &mut [u8] {
        let offset = self.ring.geometry.frame_offset(self.slot) as usize;
        let len = self.ring.geometry.frame_capacity() as usize;
        assert!(offset + len <= self.ring.data.len());
        // SAFETY: in bounds of the writable data mapping (checked above; `RingWriter::new` asserted it is
        // writable). Only this process writes a producer's data segment: the host maps it read-only and
        // the memfd is sealed against resizing, so nothing changes these bytes behind the slice (the
        // host's concurrent reads are volatile loads in another process and change nothing). A relay's
        // data segment is written by the network transport instead: a relay must never call this (nor
        // `write_span`), and reads its frames with `read_frame`. The slot is this producer's until it
        // commits, and the `&mut self` borrow makes the slice unique in this process.
        unsafe { std::slice::from_raw_parts_mut(self.ring.data.base().as_ptr().add(offset), len) }
    }

    /// Copies the frame area's bytes from `offset` into `dst` with volatile loads: how a relay reads what
    /// a transfer engine wrote into the slot on another process's behalf (it may write again at any time,
    /// so no reference over the slot is formed).
    pub fn read_frame(&self, offset: usize, dst: &mut [u8]) {
        let end = offset.checked_add(dst.len()).expect("frame range overflows");
        assert!(end as u64 <= self.ring.geometry.frame_capacity(), "read past the slot's frame area");
        self.ring.data.copy_out(self.ring.geometry.frame_offset(self.slot) as usize + offset, dst);
    }

    /// Writes header (with [`Self::coords`]) and manifest; returns where the payload goes.
    pub fn write_prefix(&mut self, manifest: &[u8], payload_len: u64) -> Result<HeaderInfo, SpanError> {
        let coords = self.coords();
        let info = write_prefix(self.frame_mut(), manifest, payload_len, coords)?;
        let capacity = self.ring.geometry.frame_capacity();
        if info.frame_len > capacity {
            return Err(SpanError::FrameExceedsSlot { capacity, found: info.frame_len });
        }
        Ok(info)
    }

    /// Publishes the slot (Release) and rings the host. Whatever the frame area holds is what the host
    /// will read.
    pub fn commit(self) {
        let offset = self.ring.geometry.commit_offset(self.slot) as usize;
        protocol::producer_commit(&SharedWord::new(&self.ring.data, offset), self.generation);
        self.ring.committed[self.slot as usize] = self.generation;
        self.ring.next_sequence += 1;
        self.ring.to_host.ring();
    }
}
