//! Ring protocol tests over in-heap segments (threads) and real memfds (one process).

use std::cell::Cell;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use shm_format::ring::RingGeometry;
use shm_format::testing::{pattern, tiny_gemma_geometry};
use shm_format::{seal_frame, Dtype, Manifest};

use crate::doorbell::Doorbell;
use crate::segment::heap::{HeapSegment, HeapView};
use crate::segment::memfd::{MemfdSegment, Writer};
use crate::segment::Segment;
use crate::{create_ring, RingError, RingReader, RingWriter};

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

struct HeapRing {
    control: HeapSegment,
    data: HeapSegment,
    geometry: RingGeometry,
}

impl HeapRing {
    fn new(slots: u32, capacity: u64) -> Self {
        let geometry = RingGeometry::new(slots, capacity).unwrap();
        HeapRing {
            control: HeapSegment::new(geometry.control_len() as usize),
            data: HeapSegment::new(geometry.data_len() as usize),
            geometry,
        }
    }

    fn ends(&self, epoch: u64) -> (RingReader<HeapView<'_>, HeapView<'_>>, RingWriter<HeapView<'_>, HeapView<'_>>) {
        let ((up_ring, up_wait), (down_ring, down_wait)) = (Doorbell::pair().unwrap(), Doorbell::pair().unwrap());
        let reader =
            RingReader::new(self.control.view(true), self.data.view(false), self.geometry, epoch, up_wait, down_ring);
        let writer =
            RingWriter::new(self.control.view(false), self.data.view(true), self.geometry, epoch, up_ring, down_wait);
        (reader, writer)
    }
}

fn manifest(request: u64, start: u64, len: u64) -> Manifest {
    Manifest::grouped(&tiny_gemma_geometry(), request, start..start + len, Dtype::Bf16)
}

#[test]
fn spans_cross_the_ring_in_order_across_slot_reuse() {
    let ring = HeapRing::new(3, 64 << 10);
    let (mut reader, mut writer) = ring.ends(5);
    std::thread::scope(|s| {
        s.spawn(move || {
            for i in 0..20u64 {
                let m = manifest(i, i * 4, 1 + i % 7);
                writer.write_span(&m, soon(), |p| p.copy_from_slice(&pattern(p.len() as u64, i as u8))).unwrap();
            }
        });
        for i in 0..20u64 {
            let span = reader.take(soon(), None).unwrap();
            assert_eq!(span.manifest, manifest(i, i * 4, 1 + i % 7));
            assert_eq!(span.payload, &pattern(span.payload.len() as u64, i as u8)[..]);
            assert_eq!((span.header.sequence, span.header.producer_epoch), (i, 5));
            assert_eq!(span.header.slot_generation, 1 + i / 3);
        }
    });
}

#[test]
fn a_frame_longer_than_one_copy_chunk_checksums_correctly() {
    let ring = HeapRing::new(1, 3 << 20);
    let (mut reader, mut writer) = ring.ends(1);
    let m = Manifest::grouped(&tiny_gemma_geometry(), 1, 0..10_000, Dtype::F32);
    assert!(m.payload_len() > 2 * crate::COPY_CHUNK as u64);
    writer.write_span(&m, soon(), |p| p.copy_from_slice(&pattern(p.len() as u64, 9))).unwrap();
    let span = reader.try_take().unwrap().unwrap();
    assert_eq!(span.payload, &pattern(m.payload_len(), 9)[..]);
}

#[test]
fn nothing_committed_times_out_with_the_awaited_frame() {
    let ring = HeapRing::new(2, 4096);
    let (mut reader, _writer) = ring.ends(1);
    assert!(reader.try_take().unwrap().is_none());
    let err = reader.take(Instant::now() + Duration::from_millis(20), None).unwrap_err();
    assert!(matches!(err, RingError::Timeout { sequence: 0, slot: 0, .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.starts_with("no span committed within ")
            && [" ms: ", " s: "].iter().any(|unit| text.contains(&format!("{unit}expected frame 0"))),
        "{text}"
    );
}

/// Writes a frame with `edit` applied to the sealed bytes, commits it, and returns the reader's verdict.
fn take_after(edit: impl FnOnce(&mut Vec<u8>, shm_format::FrameCoords)) -> String {
    let ring = HeapRing::new(2, 64 << 10);
    let (mut reader, mut writer) = ring.ends(3);
    let m = manifest(1, 0, 2);
    let mut slot = writer.reserve(soon()).unwrap();
    let mut frame = shm_format::encode_frame(&m, &pattern(m.payload_len(), 0), slot.coords());
    edit(&mut frame, slot.coords());
    slot.frame_mut()[..frame.len()].copy_from_slice(&frame);
    slot.commit();
    let err = reader.try_take().map(|_| ()).unwrap_err();
    // Poisoned from now on.
    assert!(matches!(reader.try_take(), Err(RingError::Poisoned)));
    err.kind().to_string()
}

fn set_u64(frame: &mut [u8], at: usize, v: u64) {
    frame[at..at + 8].copy_from_slice(&v.to_le_bytes());
    seal_frame(frame);
}

#[test]
fn ring_coordinates_are_checked_against_private_state() {
    assert_eq!(take_after(|f, c| set_u64(f, 40, c.epoch + 1)), "wrong_epoch");
    assert_eq!(take_after(|f, c| set_u64(f, 48, c.generation - 1)), "stale_generation");
    assert_eq!(take_after(|f, c| set_u64(f, 56, c.sequence + 1)), "unexpected_sequence");
    assert_eq!(take_after(|f, _| set_u64(f, 24, 1 << 20)), "frame_exceeds_slot");
    assert_eq!(take_after(|f, _| *f.last_mut().unwrap() ^= 1), "checksum_mismatch");
    assert_eq!(take_after(|f, _| f[0] = b'X'), "bad_magic");
}

/// A sink that refuses every span (as a cache without room would), counting what it was asked.
struct Refusing(usize);

#[derive(Debug, thiserror::Error)]
#[error("refused")]
struct Refused;

impl crate::SpanSink for Refusing {
    type Staged = ();
    type Error = Refused;
    fn prepare(&mut self, _: &shm_format::HeaderInfo, _: &Manifest) -> Result<(), Refused> {
        self.0 += 1;
        Err(Refused)
    }
    fn write(&mut self, (): &mut (), _: u64, _: &[u8]) {
        unreachable!("nothing is written for a refused span")
    }
    fn commit(&mut self, (): ()) {
        unreachable!("a refused span is never committed")
    }
    fn abort(&mut self, (): ()) {
        unreachable!("a refused span has nothing to undo")
    }
}

/// A sound frame the sink refuses hands its slot back and the ring goes on; a corrupt one that the sink
/// would refuse as well is reported as corrupt (the whole frame is checked before a refusal is), and
/// poisons the ring.
#[test]
fn a_refused_frame_is_reported_as_corrupt_when_it_is() {
    let ring = HeapRing::new(1, 64 << 10);
    let (mut reader, mut writer) = ring.ends(1);
    let m = manifest(1, 0, 2);
    for corrupt in [false, true] {
        let mut slot = writer.reserve(soon()).unwrap();
        let mut frame = shm_format::encode_frame(&m, &pattern(m.payload_len(), 0), slot.coords());
        if corrupt {
            *frame.last_mut().unwrap() ^= 1;
        }
        slot.frame_mut()[..frame.len()].copy_from_slice(&frame);
        slot.commit();
        let mut sink = Refusing(0);
        let verdict = match reader.take_into(&mut sink) {
            Err(crate::TakeError::Sink(Refused)) => "refused".to_string(),
            Err(crate::TakeError::Ring(e)) => e.kind().to_string(),
            Ok(found) => panic!("taken: {found:?}"),
        };
        assert_eq!(sink.0, 1, "the sink was asked");
        assert_eq!(verdict, if corrupt { "checksum_mismatch" } else { "refused" });
    }
    assert!(matches!(reader.try_take(), Err(RingError::Poisoned)), "poisoned by the corrupt frame");
}

#[test]
fn a_replayed_frame_is_rejected() {
    let ring = HeapRing::new(1, 64 << 10);
    let (mut reader, mut writer) = ring.ends(1);
    let m = manifest(1, 0, 2);
    writer.write_span(&m, soon(), |p| p.fill(1)).unwrap();
    reader.try_take().unwrap().unwrap();
    // The producer commits the next generation with the old frame left in place (sequence 0 again).
    let slot = writer.reserve(soon()).unwrap();
    assert_eq!(slot.coords().generation, 2);
    slot.commit();
    let err = reader.try_take().map(|_| ()).unwrap_err();
    assert_eq!(err.kind(), "stale_generation", "{err}");
}

#[test]
fn a_commit_word_the_host_never_granted_is_rejected() {
    let ring = HeapRing::new(1, 4096);
    let (mut reader, _writer) = ring.ends(1);
    ring.data.store_release(ring.geometry.commit_offset(0) as usize, 77);
    let err = reader.try_take().map(|_| ()).unwrap_err();
    assert!(matches!(err, RingError::InvalidCommit { slot: 0, expected: 1, found: 77 }), "{err}");
}

/// A data segment that lets a test act as a malicious producer between the host's reads.
struct Tamper<'a> {
    inner: HeapView<'a>,
    writable: HeapView<'a>,
    copies: Cell<usize>,
    /// Runs after the host's first copy (the header), with the writable view.
    act: Box<dyn Fn(&HeapView<'a>)>,
}

// SAFETY: only used on one thread in these tests; delegating to a valid segment.
unsafe impl Send for Tamper<'_> {}

// SAFETY: delegates to `inner`, which upholds the contract.
unsafe impl Segment for Tamper<'_> {
    fn base(&self) -> NonNull<u8> {
        self.inner.base()
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn writable(&self) -> bool {
        false
    }
    fn copy_out(&self, offset: usize, dst: &mut [u8]) {
        self.inner.copy_out(offset, dst);
        self.copies.set(self.copies.get() + 1);
        if self.copies.get() == 1 {
            (self.act)(&self.writable);
        }
    }
}

fn tampered(act: impl Fn(&HeapView<'_>, &RingGeometry) + 'static) -> String {
    let ring = HeapRing::new(1, 64 << 10);
    let geometry = ring.geometry;
    let ((up_ring, up_wait), (down_ring, down_wait)) = (Doorbell::pair().unwrap(), Doorbell::pair().unwrap());
    let data = Tamper {
        inner: ring.data.view(false),
        writable: ring.data.view(true),
        copies: Cell::new(0),
        act: Box::new(move |v: &HeapView<'_>| act(v, &geometry)),
    };
    let mut reader = RingReader::new(ring.control.view(true), data, geometry, 1, up_wait, down_ring);
    let mut writer = RingWriter::new(ring.control.view(false), ring.data.view(true), geometry, 1, up_ring, down_wait);
    let m = manifest(1, 0, 2);
    writer.write_span(&m, soon(), |p| p.fill(3)).unwrap();
    let verdict = reader.try_take().map(|_| ()).unwrap_err().kind().to_string();
    verdict
}

#[test]
fn a_header_rewritten_after_commit_is_caught_by_the_second_read() {
    // Double fetch: the producer grows payload_len after the host read the header. The host works from
    // its private copy, and its re-read of the header sees the change.
    let verdict = tampered(|v, g| {
        let at = g.frame_offset(0) as usize + 24;
        v.copy_in(at, &(1u64 << 30).to_le_bytes());
    });
    assert_eq!(verdict, "header_changed_after_commit");
}

#[test]
fn a_commit_word_moved_during_the_copy_is_caught() {
    let verdict = tampered(|v, g| v.store_release(g.commit_offset(0) as usize, 2));
    assert_eq!(verdict, "commit_changed");
}

#[test]
fn payload_bytes_changed_during_the_copy_fail_the_checksum_or_are_copied_whole() {
    // A write into the payload after the header copy lands before the payload copy: the copy then holds
    // bytes that do not match the checksum the producer sealed.
    let verdict = tampered(|v, g| v.copy_in(g.frame_offset(0) as usize + 150, &[0xEE; 16]));
    assert_eq!(verdict, "checksum_mismatch");
}

#[test]
fn memfd_segments_are_sealed_and_the_control_segment_refuses_new_writers() {
    use rustix::fs::SealFlags;
    let control = MemfdSegment::create("t.control", 8192, Writer::Host).unwrap();
    let data = MemfdSegment::create("t.data", 8192, Writer::Peer).unwrap();
    let seals = control.seals().unwrap();
    assert!(seals.contains(SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL | SealFlags::FUTURE_WRITE));
    assert!(data.seals().unwrap().contains(SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL));
    // The host's own mapping still writes.
    control.store_release(64, 42);
    assert_eq!(control.load_acquire(64), 42);
    // Nobody can resize either, or get a writable mapping of the control segment.
    assert!(rustix::fs::ftruncate(control.fd(), 4096).is_err());
    assert!(rustix::fs::ftruncate(data.fd(), 1 << 20).is_err());
    assert!(rustix::io::write(control.fd(), b"x").is_err());
    let fd = control.fd().try_clone_to_owned().unwrap();
    assert!(MemfdSegment::open("again", fd, 8192, true).is_err(), "writable map of control");
    let fd = control.fd().try_clone_to_owned().unwrap();
    let ro = MemfdSegment::open("again", fd, 8192, false).unwrap();
    assert_eq!(ro.load_acquire(64), 42);
}

#[test]
fn a_memfd_ring_round_trips_in_one_process() {
    let geometry = RingGeometry::new(2, 1 << 20).unwrap();
    let mut reader = create_ring("t", geometry, 4).unwrap();
    let fds = reader.peer_fds().map(|fd| fd.try_clone_to_owned().unwrap());
    let mut writer = RingWriter::open(fds).unwrap();
    assert_eq!((writer.geometry(), writer.epoch()), (geometry, 4));
    let m = manifest(9, 100, 5);
    writer.write_span(&m, soon(), |p| p.copy_from_slice(&pattern(p.len() as u64, 1))).unwrap();
    let span = reader.take(soon(), None).unwrap();
    assert_eq!(span.manifest, m);
}

#[test]
fn a_forwarded_frame_is_taken_whole_by_the_next_ring_and_its_slot_comes_back() {
    let (near, far) = (HeapRing::new(2, 64 << 10), HeapRing::new(2, 64 << 10));
    let (mut node, mut producer) = near.ends(3);
    let (mut host, mut relay) = far.ends(3);
    let (base, len) = (near.data.base(), near.data.len());
    // More frames than slots: each forward must hand its slot back.
    for i in 0..5u64 {
        let m = manifest(i, i * 4, 1 + i);
        producer.write_span(&m, soon(), |p| p.copy_from_slice(&pattern(p.len() as u64, i as u8))).unwrap();
        let mut slot = relay.reserve(soon()).unwrap();
        let (info, _) = node
            .forward_frame(|offset, info| {
                assert!(offset + info.frame_len <= len as u64);
                // SAFETY: in bounds (above), and nothing writes the near ring while this runs.
                let frame =
                    unsafe { std::slice::from_raw_parts(base.as_ptr().add(offset as usize), info.frame_len as usize) };
                slot.frame_mut()[..frame.len()].copy_from_slice(frame);
                Ok::<(), std::io::Error>(())
            })
            .unwrap()
            .unwrap();
        assert_eq!(info.sequence, i);
        slot.commit();
        let span = host.try_take().unwrap().unwrap();
        assert_eq!(span.manifest, m);
        assert_eq!(span.payload, &pattern(m.payload_len(), i as u8)[..]);
    }
}

#[test]
fn a_forward_that_fails_poisons_the_ring() {
    let ring = HeapRing::new(2, 64 << 10);
    let (mut node, mut producer) = ring.ends(1);
    assert!(node.forward_frame(|_, _| Ok::<(), std::io::Error>(())).unwrap().is_none(), "nothing committed yet");
    let m = manifest(1, 0, 3);
    producer.write_span(&m, soon(), |p| p.fill(7)).unwrap();
    let failed = node.forward_frame(|_, _| Err(std::io::Error::other("the transfer broke")));
    assert!(matches!(failed, Err(crate::TakeError::Sink(_))), "{failed:?}");
    assert!(matches!(node.poll_next(), Err(RingError::Poisoned)));
}
