//! The host end of a ring.

use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use shm_format::ring::RingGeometry;
use shm_format::words;
use shm_format::{
    decode_body, decode_manifest, verify_prefix, HeaderInfo, Manifest, RingExpectation, SpanError, SpanView, HEADER_LEN,
};
use zerocopy::IntoBytes;

use crate::copy::{copy_and_checksum, FrameCopier, CHUNK_SLACK, COPY_CHUNK};
use crate::doorbell::{wait, Doorbell, Woken};
use crate::protocol::{self, SlotState, Word};
use crate::segment::memfd::{MemfdSegment, SegmentError, Writer};
use crate::segment::{Segment, SharedWord};

/// Why the host could not take a span from a ring. Every variant but `Timeout` and `PeerExited` is a
/// protocol violation by the producer; after any error the reader is poisoned and the ring must be
/// replaced (the supervisor restarts the producer with a new epoch).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RingError {
    /// No frame was committed before the deadline.
    #[error("no span committed within {}: expected frame {sequence} in slot {slot}, found none", words::duration(*waited))]
    Timeout {
        /// How long the host waited.
        waited: Duration,
        /// The frame awaited.
        sequence: u64,
        /// Its slot.
        slot: u32,
    },
    /// The watched descriptor (the producer's pidfd) signalled while waiting, or the producer's end of
    /// the doorbell closed.
    #[error("the producer exited (or closed its end of the ring's doorbell) while the host awaited frame {sequence}")]
    PeerExited {
        /// The frame awaited.
        sequence: u64,
    },
    /// The commit word holds a generation the host never granted.
    #[error("slot {slot} commit word: expected generation {expected} or {}, found {found}", expected - 1)]
    InvalidCommit {
        /// Slot.
        slot: u32,
        /// Generation granted.
        expected: u64,
        /// What the word held.
        found: u64,
    },
    /// The frame is invalid.
    #[error("slot {slot}: {source}")]
    Span {
        /// Slot.
        slot: u32,
        /// Why.
        #[source]
        source: SpanError,
    },
    /// The producer rewrote the header after committing it (a double-fetch attack or bug).
    #[error(
        "slot {slot}: header changed after commit: expected the {HEADER_LEN} bytes read first, found different bytes"
    )]
    HeaderChangedAfterCommit {
        /// Slot.
        slot: u32,
    },
    /// The commit word changed while the host copied the frame.
    #[error("slot {slot}: commit word changed during the copy: expected {expected}, found {found}")]
    CommitChanged {
        /// Slot.
        slot: u32,
        /// Generation committed.
        expected: u64,
        /// What the word held after the copy.
        found: u64,
    },
    /// An earlier error poisoned this reader.
    #[error("ring is poisoned by an earlier protocol violation: expected a new ring, found the old one reused")]
    Poisoned,
    /// Waiting failed.
    #[error("waiting on the ring doorbell failed: {0}")]
    Io(#[from] std::io::Error),
}

impl RingError {
    /// A stable snake_case name, for metrics and JSON.
    pub fn kind(&self) -> &'static str {
        match self {
            RingError::Timeout { .. } => "timeout",
            RingError::PeerExited { .. } => "peer_exited",
            RingError::InvalidCommit { .. } => "invalid_commit",
            RingError::Span { source, .. } => source.kind(),
            RingError::HeaderChangedAfterCommit { .. } => "header_changed_after_commit",
            RingError::CommitChanged { .. } => "commit_changed",
            RingError::Poisoned => "poisoned",
            RingError::Io(_) => "io",
        }
    }
}

/// Where a frame's payload goes. The reader decides nothing about the payload itself: it hands the sink
/// the validated manifest before copying any payload byte, then the payload in order, straight from its
/// private copy, and finally commits or aborts.
pub trait SpanSink {
    /// What [`SpanSink::prepare`] reserved for this span.
    type Staged;
    /// Why the sink refused a span.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Checks the span against the receiver and reserves room for it. Nothing may change if this fails.
    fn prepare(&mut self, header: &HeaderInfo, manifest: &Manifest) -> Result<Self::Staged, Self::Error>;
    /// Receives the payload bytes at `offset..offset + bytes.len()`, in increasing, contiguous order.
    fn write(&mut self, staged: &mut Self::Staged, offset: u64, bytes: &[u8]);
    /// The checksum and the re-checks passed: make the span visible in one step.
    fn commit(&mut self, staged: Self::Staged);
    /// The frame turned out bad after `prepare`: undo the reservation.
    fn abort(&mut self, staged: Self::Staged);
}

/// Why [`RingReader::take_into`] failed.
#[derive(Debug, thiserror::Error)]
pub enum TakeError<E: std::error::Error + 'static> {
    /// The ring or the frame is bad (the ring is poisoned).
    #[error(transparent)]
    Ring(#[from] RingError),
    /// The frame is well-formed and intact (checksum and re-checks passed) but the sink refused it (the
    /// ring moves on to the next frame).
    #[error(transparent)]
    Sink(E),
}

/// The host end of one ring: it owns the control segment (writable) and reads the data segment.
#[derive(Debug)]
pub struct RingReader<C: Segment, D: Segment> {
    control: C,
    data: D,
    geometry: RingGeometry,
    epoch: u64,
    next_sequence: u64,
    /// The generation the host granted per slot: private, never re-read from shared memory.
    granted: Vec<u64>,
    /// Where [`RingReader::try_take`] copies frames; allocated and prefaulted on first use (a reader that
    /// only feeds sinks never needs it), then reused.
    private: Vec<u8>,
    /// One chunk of a frame on its way to a sink; prefaulted, reused.
    staging: Vec<u8>,
    /// Rung by the producer after a commit.
    from_peer: Doorbell,
    /// Rung by the host after a release.
    to_peer: Doorbell,
    /// The producer's ends of the two doorbells (the one it rings, the one it waits on), held to hand
    /// over ([`RingReader::peer_fds`]); `None` for a ring whose peer is in this process.
    peer_bells: Option<[Doorbell; 2]>,
    poisoned: bool,
}

/// A ring the host created over sealed memfds.
pub type HostRing = RingReader<MemfdSegment, MemfdSegment>;

/// Creates the two sealed segments and the two doorbells of a ring for a producer of `epoch`, and
/// returns its host end. The descriptors to hand the producer come from [`RingReader::peer_fds`].
pub fn create_ring(name: &str, geometry: RingGeometry, epoch: u64) -> Result<HostRing, SegmentError> {
    let control = MemfdSegment::create(&format!("{name}.control"), geometry.control_len() as usize, Writer::Host)?;
    let data = MemfdSegment::create(&format!("{name}.data"), geometry.data_len() as usize, Writer::Peer)?;
    let bell =
        |name: &str| Doorbell::pair().map_err(|source| SegmentError::Os { op: "pipe", name: name.into(), source });
    let ((peer_rings, from_peer), (to_peer, peer_waits)) = (bell("from_peer")?, bell("to_peer")?);
    let mut reader = RingReader::new(control, data, geometry, epoch, from_peer, to_peer);
    reader.peer_bells = Some([peer_rings, peer_waits]);
    Ok(reader)
}

impl<C: Segment, D: Segment> RingReader<C, D> {
    /// Takes ownership of the segments, writes the control header and grants every slot generation 1.
    ///
    /// `control` must be writable by this process and `data` at least `geometry.data_len()` bytes.
    pub fn new(
        control: C,
        data: D,
        geometry: RingGeometry,
        epoch: u64,
        from_peer: Doorbell,
        to_peer: Doorbell,
    ) -> Self {
        assert!(control.len() as u64 >= geometry.control_len() && control.writable(), "control segment");
        assert!(data.len() as u64 >= geometry.data_len(), "data segment");
        control.copy_in(0, geometry.control_header(epoch).as_bytes());
        let reader = RingReader {
            granted: vec![1; geometry.slot_count() as usize],
            private: Vec::new(),
            staging: prefaulted(COPY_CHUNK + CHUNK_SLACK),
            control,
            data,
            geometry,
            epoch,
            next_sequence: 0,
            from_peer,
            to_peer,
            peer_bells: None,
            poisoned: false,
        };
        for slot in 0..geometry.slot_count() {
            reader.grant_word(slot).store_release(1);
        }
        reader
    }

    /// The ring's geometry.
    pub fn geometry(&self) -> RingGeometry {
        self.geometry
    }

    /// The producer epoch this ring was made for.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The sequence number of the next frame.
    pub fn next_sequence(&self) -> u64 {
        self.next_sequence
    }

    fn grant_word(&self, slot: u32) -> SharedWord<'_, C> {
        SharedWord::new(&self.control, self.geometry.grant_offset(slot) as usize)
    }

    fn commit_word(&self, slot: u32) -> SharedWord<'_, D> {
        SharedWord::new(&self.data, self.geometry.commit_offset(slot) as usize)
    }

    /// Waits until the next frame is committed, then takes it (see [`RingReader::try_take`]).
    ///
    /// `watch`, if given, is polled alongside the doorbell: when it becomes readable (a pidfd does when the
    /// process exits) the wait ends with [`RingError::PeerExited`].
    pub fn take(&mut self, deadline: Instant, watch: Option<BorrowedFd<'_>>) -> Result<SpanView<'_>, RingError> {
        let started = Instant::now();
        loop {
            // The commit word is read once: `take_committed` does not poll again (a producer flipping
            // the word back between two reads would otherwise make a committed frame vanish).
            if self.poll_next()? {
                return self.take_committed();
            }
            match wait(&self.from_peer, watch, deadline)? {
                Woken::Rang => {}
                Woken::Other | Woken::Closed => {
                    // The producer may have committed just before it exited: take what is there.
                    if self.poll_next()? {
                        return self.take_committed();
                    }
                    self.poisoned = true;
                    return Err(RingError::PeerExited { sequence: self.next_sequence });
                }
                Woken::TimedOut => {
                    return Err(RingError::Timeout {
                        waited: started.elapsed(),
                        sequence: self.next_sequence,
                        slot: self.geometry.slot_of(self.next_sequence),
                    })
                }
            }
        }
    }

    /// Whether the next frame is committed.
    pub fn poll_next(&mut self) -> Result<bool, RingError> {
        if self.poisoned {
            return Err(RingError::Poisoned);
        }
        let slot = self.geometry.slot_of(self.next_sequence);
        let generation = self.granted[slot as usize];
        match protocol::host_poll(&self.commit_word(slot), generation) {
            SlotState::Pending => Ok(false),
            SlotState::Committed => Ok(true),
            SlotState::Invalid { found } => {
                self.poisoned = true;
                Err(RingError::InvalidCommit { slot, expected: generation, found })
            }
        }
    }

    /// Takes the next frame if it is committed: `Ok(None)` if not yet.
    ///
    /// The steps, in order: read the header once into a private copy; validate it against the private
    /// geometry and expectations; copy the frame out, checksumming the copy as it is made;
    /// re-read the header and re-check the commit word; hand the slot back; validate the manifest on the
    /// private copy. The returned span borrows the private copy, which the next call overwrites.
    pub fn try_take(&mut self) -> Result<Option<SpanView<'_>>, RingError> {
        if !self.poll_next()? {
            return Ok(None);
        }
        self.take_committed().map(Some)
    }

    /// [`RingReader::try_take`] of the next frame, whose commit word [`RingReader::poll_next`] has just
    /// read as committed (the copy re-checks it).
    fn take_committed(&mut self) -> Result<SpanView<'_>, RingError> {
        let slot = self.geometry.slot_of(self.next_sequence);
        match self.copy_out(slot) {
            Ok((info, checksum)) => {
                self.release(slot);
                let frame = &self.private[..info.frame_len as usize];
                match decode_body(info, frame, checksum) {
                    Ok(span) => Ok(span),
                    Err(source) => {
                        self.poisoned = true;
                        Err(RingError::Span { slot, source })
                    }
                }
            }
            Err(e) => {
                self.poisoned = true;
                Err(e)
            }
        }
    }

    /// Takes the next frame into `sink` if it is committed (`Ok(None)` if not yet): the same checks and
    /// order as [`RingReader::try_take`], but the payload goes to the sink chunk by chunk while each chunk
    /// is still in cache, instead of into one private frame buffer first.
    pub fn take_into<K: SpanSink>(&mut self, sink: &mut K) -> Result<Option<()>, TakeError<K::Error>> {
        if !self.poll_next()? {
            return Ok(None);
        }
        let slot = self.geometry.slot_of(self.next_sequence);
        let result = self.copy_into(slot, sink);
        match result {
            Ok(()) => Ok(Some(())),
            Err(TakeError::Sink(e)) => {
                // Well-formed but refused: hand the slot back and move on.
                self.release(slot);
                Err(TakeError::Sink(e))
            }
            Err(e) => {
                self.poisoned = true;
                Err(e)
            }
        }
    }

    /// Passes the next frame on where it lies, if it is committed (`Ok(None)` if not yet): the header
    /// read once and checked as [`RingReader::try_take`] checks it, then `send(offset, info)` with the
    /// frame's offset in the data segment, then the re-checks (header unchanged, commit word still the
    /// grant), then the slot handed back. Returns the frame's header and its slot.
    ///
    /// The payload is neither copied nor checksummed here: the frame goes to a reader that does both
    /// (a producer node forwards frames to a host that takes them with [`RingReader::try_take`]'s
    /// checks). A producer that rewrites the frame while `send` reads it is caught there. Any error
    /// poisons the ring, since the frame may be half sent.
    pub fn forward_frame<E: std::error::Error + 'static>(
        &mut self,
        send: impl FnOnce(u64, &HeaderInfo) -> Result<(), E>,
    ) -> Result<Option<(HeaderInfo, u32)>, TakeError<E>> {
        if !self.poll_next()? {
            return Ok(None);
        }
        let slot = self.geometry.slot_of(self.next_sequence);
        let sent = self.read_header(slot).map_err(TakeError::Ring).and_then(|(header, info)| {
            send(self.geometry.frame_offset(slot), &info).map_err(TakeError::Sink)?;
            self.recheck(slot, &header)?;
            Ok(info)
        });
        match sent {
            Ok(info) => {
                self.release(slot);
                Ok(Some((info, slot)))
            }
            Err(e) => {
                self.poisoned = true;
                Err(e)
            }
        }
    }

    fn release(&mut self, slot: u32) {
        let generation = self.granted[slot as usize];
        self.granted[slot as usize] = protocol::host_release(&self.grant_word(slot), generation);
        self.next_sequence += 1;
        self.to_peer.ring();
    }

    /// Reads and checks the header of the committed frame in `slot`.
    fn read_header(&self, slot: u32) -> Result<([u8; HEADER_LEN], HeaderInfo), RingError> {
        let base = self.geometry.frame_offset(slot) as usize;
        let mut header = [0u8; HEADER_LEN];
        self.data.copy_out(base, &mut header);
        let span_err = |source| RingError::Span { slot, source };
        let info = HeaderInfo::parse(&header).map_err(span_err)?;
        let expect = RingExpectation {
            producer_epoch: self.epoch,
            slot_generation: self.granted[slot as usize],
            sequence: self.next_sequence,
            slot_capacity: self.geometry.frame_capacity(),
        };
        expect.check(&info).map_err(span_err)?;
        Ok((header, info))
    }

    /// The re-checks after the copy: the header unchanged, the commit word still the granted generation.
    fn recheck(&self, slot: u32, header: &[u8; HEADER_LEN]) -> Result<(), RingError> {
        // The copy's loads complete before the re-check's (a seqlock's read side): without the fence a
        // weakly ordered CPU (aarch64) could read the header and commit word again before the last of
        // the payload, and pass a frame rewritten during the copy. x86-64 keeps loads in order anyway.
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        let generation = self.granted[slot as usize];
        let mut again = [0u8; HEADER_LEN];
        self.data.copy_out(self.geometry.frame_offset(slot) as usize, &mut again);
        if &again != header {
            return Err(RingError::HeaderChangedAfterCommit { slot });
        }
        protocol::host_recheck(&self.commit_word(slot), generation).map_err(|found| RingError::CommitChanged {
            slot,
            expected: generation,
            found,
        })
    }

    fn copy_into<K: SpanSink>(&mut self, slot: u32, sink: &mut K) -> Result<(), TakeError<K::Error>> {
        let (header, info) = self.read_header(slot)?;
        let base = self.geometry.frame_offset(slot) as usize;
        let span_err = |source| RingError::Span { slot, source };
        let payload_offset = info.payload_offset as usize;
        let mut copier = FrameCopier::new(&self.data, base, &header, info.frame_len as usize).prefetching();
        // Header and manifest collect in `prefix` (they may span chunks); payload bytes go to the sink.
        let mut prefix = Vec::with_capacity(payload_offset);
        let (mut staged, mut refused) = (None, None);
        let mut staging = std::mem::take(&mut self.staging);
        while copier.next_len() > 0 {
            let n = copier.next_len();
            let range = copier.copy_next(&mut staging[..n]);
            let chunk = &staging[..n];
            if range.start < payload_offset {
                let upto = payload_offset.min(range.end);
                prefix.extend_from_slice(&chunk[..upto - range.start]);
                if upto == payload_offset {
                    // The manifest is whole: validate it on the private copy, then let the sink decide.
                    let manifest =
                        match decode_manifest(&prefix[info.manifest_range()], info.payload_len).map_err(span_err) {
                            Ok(m) => m,
                            Err(e) => {
                                self.staging = staging;
                                return Err(e.into());
                            }
                        };
                    // A refusal is reported only once the whole frame is checked: a frame that is also
                    // corrupt, or changed under the copy, is that (and poisons the ring), not a span the
                    // receiver happened to refuse first.
                    match sink.prepare(&info, &manifest) {
                        Ok(s) => staged = Some(s),
                        Err(e) => refused = Some(e),
                    }
                }
            }
            if range.end > payload_offset {
                let from = range.start.max(payload_offset);
                if let Some(staged) = staged.as_mut() {
                    sink.write(staged, (from - payload_offset) as u64, &chunk[from - range.start..]);
                }
            }
        }
        self.staging = staging;
        let checksum = copier.finish();
        let checked =
            self.recheck(slot, &header).and_then(|()| verify_prefix(&info, &prefix, checksum).map_err(span_err));
        match (checked, staged, refused) {
            (Err(e), staged, _) => {
                if let Some(staged) = staged {
                    sink.abort(staged);
                }
                Err(e.into())
            }
            (Ok(()), _, Some(refusal)) => Err(TakeError::Sink(refusal)),
            (Ok(()), Some(staged), None) => {
                self.release(slot);
                sink.commit(staged);
                Ok(())
            }
            (Ok(()), None, None) => unreachable!("the manifest is whole before the payload's end"),
        }
    }

    /// Copies the committed frame in `slot` into the private buffer and returns its header and the
    /// checksum of the copy.
    fn copy_out(&mut self, slot: u32) -> Result<(HeaderInfo, u64), RingError> {
        let (header, info) = self.read_header(slot)?;
        let base = self.geometry.frame_offset(slot) as usize;
        if self.private.is_empty() {
            self.private = prefaulted(self.geometry.frame_capacity() as usize);
        }
        // `frame_len <= frame_capacity == private.len()` by the header check.
        let len = info.frame_len as usize;
        let checksum = copy_and_checksum(&self.data, base, &header, &mut self.private[..len]);
        self.recheck(slot, &header)?;
        Ok((info, checksum))
    }

    /// The descriptors a producer needs, in the order [`crate::RingWriter::open`] takes them:
    /// control, data, the doorbell end it rings, the doorbell end it waits on.
    ///
    /// # Panics
    ///
    /// For a ring not made by [`create_ring`] (whose peer ends are in this process already).
    pub fn peer_fds(&self) -> [BorrowedFd<'_>; 4]
    where
        C: AsFdSegment,
        D: AsFdSegment,
    {
        let [rings, waits] =
            self.peer_bells.as_ref().expect("a ring made by create_ring, its doorbells not handed over");
        [self.control.segment_fd(), self.data.segment_fd(), rings.fd(), waits.fd()]
    }

    /// Closes this process's copies of the producer's doorbell ends, once the producer holds its own:
    /// then a producer that exits closes the last end it rang, and [`RingReader::take`] hears it.
    /// [`RingReader::peer_fds`] panics after this.
    pub fn handed_over(&mut self) {
        self.peer_bells = None;
    }

    /// The data segment's descriptor (a read-only mapping of it for a relay).
    pub fn data_fd(&self) -> BorrowedFd<'_>
    where
        D: AsFdSegment,
    {
        self.data.segment_fd()
    }
}

/// A segment backed by a descriptor that can be handed to another process.
pub trait AsFdSegment {
    /// The descriptor.
    fn segment_fd(&self) -> BorrowedFd<'_>;
}

impl AsFdSegment for MemfdSegment {
    fn segment_fd(&self) -> BorrowedFd<'_> {
        self.fd()
    }
}

/// A zeroed buffer whose every page has been written, so that copying into it takes no page faults.
pub fn prefaulted(len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    // `vec!` of zeros maps the shared zero page lazily; writing one byte per page makes each page private
    // now instead of on the first copy. `black_box` keeps the stores.
    for i in (0..len).step_by(4096) {
        v[i] = 1;
    }
    std::hint::black_box(&mut v).fill(0);
    v
}
