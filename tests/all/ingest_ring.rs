//! Spans from a real memfd ring straight into the paged KV cache.

use std::time::{Duration, Instant};

use pdhost::kv::{IntoSequence, KvConfig, PagedKv, Rounding, SeqId};
use shm_format::ring::RingGeometry;
use shm_format::testing::pattern;
use shm_format::{encode_frame, Dtype, EntryKind, GroupKind, KvGeometry, Manifest};
use shm_ring::{create_ring, RingError, RingWriter, TakeError};

fn gemma_like() -> KvGeometry {
    shm_format::testing::interleaved(6, 3, 40, 2, 64)
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

#[test]
fn spans_go_from_the_ring_into_pages_and_a_bad_checksum_changes_nothing_visible() {
    let g = gemma_like();
    let mut kv = PagedKv::new(KvConfig::new(g.clone(), Dtype::Bf16, 16 << 20)).unwrap();
    kv.add_sequence(SeqId(1), 3).unwrap();
    // Spans larger than one copy chunk, so the sink sees several pieces.
    let geometry = RingGeometry::new(2, 4 << 20).unwrap();
    let mut ring = create_ring("ingest", geometry, 1).unwrap();
    let mut writer = RingWriter::open(ring.peer_fds().map(|fd| fd.try_clone_to_owned().unwrap())).unwrap();

    let first = Manifest::dense(&g, 3, 0..700, Dtype::Bf16).unwrap();
    assert!(first.payload_len() > 2 * shm_ring::COPY_CHUNK as u64);
    let p1 = pattern(first.payload_len(), 1);
    writer.write_span(&first, soon(), |p| p.copy_from_slice(&p1)).unwrap();
    ring.take_into(&mut IntoSequence { kv: &mut kv, seq: SeqId(1), end: 700, dtype: Dtype::Bf16 })
        .unwrap()
        .expect("committed");
    assert_eq!(kv.seq_len(SeqId(1)), Some(700));

    let full = kv.read(SeqId(1), 2).unwrap().to_bytes();
    let e = first.entries.iter().find(|e| e.layer == 2 && e.kind == EntryKind::K).unwrap();
    assert!(full.0 == p1[e.offset as usize..(e.offset + e.len) as usize], "full layer K through the ring");
    let sliding = kv.read(SeqId(1), 0).unwrap();
    assert_eq!(sliding.positions, 660..700);
    let usage = kv.usage();
    let before = kv.state_hash();

    // A frame whose payload is corrupted after sealing: the sink is prepared, sees the bytes, then aborts.
    let second = Manifest::grouped(&g, 3, 700..760, Dtype::Bf16);
    let mut slot = writer.reserve(soon()).unwrap();
    let mut frame = encode_frame(&second, &pattern(second.payload_len(), 2), slot.coords());
    *frame.last_mut().unwrap() ^= 0x40;
    slot.frame_mut()[..frame.len()].copy_from_slice(&frame);
    slot.commit();
    let err =
        ring.take_into(&mut IntoSequence { kv: &mut kv, seq: SeqId(1), end: 760, dtype: Dtype::Bf16 }).unwrap_err();
    assert!(
        matches!(&err, TakeError::Ring(RingError::Span { source, .. }) if source.kind() == "checksum_mismatch"),
        "{err}"
    );
    assert_eq!(kv.seq_len(SeqId(1)), Some(700));
    assert_eq!(kv.usage(), usage, "the reservation was returned");
    assert_eq!(kv.read(SeqId(1), 2).unwrap().to_bytes(), full);
    assert_eq!(kv.state_hash(), before, "all the cache holds is as it was");
}

#[test]
fn a_span_the_cache_refuses_is_skipped_and_the_ring_goes_on() {
    let g = gemma_like();
    let mut kv = PagedKv::new(KvConfig::new(g.clone(), Dtype::Bf16, 16 << 20)).unwrap();
    kv.add_sequence(SeqId(1), 3).unwrap();
    let mut ring = create_ring("refuse", RingGeometry::new(2, 1 << 20).unwrap(), 1).unwrap();
    let mut writer = RingWriter::open(ring.peer_fds().map(|fd| fd.try_clone_to_owned().unwrap())).unwrap();
    let wrong_request = Manifest::grouped(&g, 4, 0..10, Dtype::Bf16);
    let right = Manifest::grouped(&g, 3, 0..10, Dtype::Bf16);
    for m in [&wrong_request, &right] {
        writer.write_span(m, soon(), |p| p.fill(9)).unwrap();
    }
    let before = kv.state_hash();
    fn into(kv: &mut PagedKv, dtype: Dtype) -> IntoSequence<'_> {
        IntoSequence { kv, seq: SeqId(1), end: 10, dtype }
    }
    let err = ring.take_into(&mut into(&mut kv, Dtype::Bf16)).unwrap_err();
    assert!(matches!(&err, TakeError::Sink(e) if e.kind() == "request_mismatch"), "{err}");
    assert_eq!(kv.state_hash(), before);
    // A span in another dtype than its producer declared: one the cache could store, but whose K/V went
    // through another rounding than the one the prefix cache keys them by.
    let err = ring.take_into(&mut into(&mut kv, Dtype::F32)).unwrap_err();
    assert!(matches!(&err, TakeError::Sink(e) if e.kind() == "dtype_mismatch"), "{err}");
    assert!(err.to_string().contains("expected f32 (the wire dtype its producer declared), found bf16"), "{err}");
    assert_eq!(kv.state_hash(), before);
    writer.write_span(&right, soon(), |p| p.fill(9)).unwrap();
    ring.take_into(&mut into(&mut kv, Dtype::Bf16)).unwrap().expect("next frame");
    assert_eq!(kv.seq_len(SeqId(1)), Some(10));
}

/// With the prefix cache on and too few free pages, a span from the ring needs cached prefix pages. A
/// frame whose payload turns out corrupt (after the cache had begun to receive it) must not cost the
/// prefix cache those pages: the cache is as it was, and the prefix still hits. A good frame after it
/// takes them, and its bytes read back.
#[test]
fn a_bad_frame_costs_the_prefix_cache_nothing() {
    let g = gemma_like();
    let mut config = KvConfig::new(g.clone(), Dtype::Bf16, 2 << 20);
    config.max_seqs = 2;
    let mut kv = PagedKv::new(config).unwrap();
    kv.enable_prefix_cache();
    let page = u64::from(kv.page_size());
    let full = |kv: &PagedKv| kv.usage().into_iter().find(|u| u.kind == GroupKind::Full).unwrap();
    let mut ring = create_ring("prefix", RingGeometry::new(2, 4 << 20).unwrap(), 1).unwrap();
    let mut writer = RingWriter::open(ring.peer_fds().map(|fd| fd.try_clone_to_owned().unwrap())).unwrap();
    let rounding = Rounding::host(Dtype::Bf16);

    // Sequence 1 fills all full pages but one, and leaves them to the prefix cache.
    let cached = u64::from(full(&kv).total) - 1;
    let prompt: Vec<u32> = (0..(cached * page) as u32).collect();
    kv.add_sequence(SeqId(1), 1).unwrap();
    let m = Manifest::grouped(&g, 1, 0..prompt.len() as u64, Dtype::Bf16);
    writer.write_span(&m, soon(), |p| p.copy_from_slice(&pattern(m.payload_len(), 1))).unwrap();
    let end = prompt.len() as u64;
    ring.take_into(&mut IntoSequence { kv: &mut kv, seq: SeqId(1), end, dtype: Dtype::Bf16 }).unwrap().unwrap();
    kv.register_prefix(SeqId(1), &prompt, rounding);
    kv.remove_sequence(SeqId(1)).unwrap();
    assert_eq!((full(&kv).cached, full(&kv).free), (cached as u32, 1));

    // Sequence 2's span needs four full pages: the free one and three cached ones.
    kv.add_sequence(SeqId(2), 2).unwrap();
    let before = kv.state_hash();
    let span = Manifest::grouped(&g, 2, 0..4 * page, Dtype::Bf16);
    let payload = pattern(span.payload_len(), 2);
    let mut slot = writer.reserve(soon()).unwrap();
    let mut frame = encode_frame(&span, &payload, slot.coords());
    *frame.last_mut().unwrap() ^= 0x40;
    slot.frame_mut()[..frame.len()].copy_from_slice(&frame);
    slot.commit();
    fn into(kv: &mut PagedKv, end: u64) -> IntoSequence<'_> {
        IntoSequence { kv, seq: SeqId(2), end, dtype: Dtype::Bf16 }
    }
    let err = ring.take_into(&mut into(&mut kv, 4 * page)).unwrap_err();
    assert!(matches!(&err, TakeError::Ring(RingError::Span { source, .. }) if source.kind() == "checksum_mismatch"));
    assert_eq!(kv.state_hash(), before, "the cached pages, their bytes and the prefix index as they were");
    kv.add_sequence(SeqId(3), 3).unwrap();
    assert_eq!(kv.attach_prefix(SeqId(3), &prompt, rounding).tokens, prompt.len() as u64, "the whole prefix hits");
    kv.remove_sequence(SeqId(3)).unwrap();

    // The ring is poisoned by the bad frame; a new one (a restarted producer's) brings the good span.
    let mut ring = create_ring("prefix", RingGeometry::new(2, 4 << 20).unwrap(), 2).unwrap();
    let mut writer = RingWriter::open(ring.peer_fds().map(|fd| fd.try_clone_to_owned().unwrap())).unwrap();
    writer.write_span(&span, soon(), |p| p.copy_from_slice(&payload)).unwrap();
    ring.take_into(&mut into(&mut kv, 4 * page)).unwrap().expect("committed");
    assert_eq!((full(&kv).cached, full(&kv).free), (cached as u32 - 3, 0));
    let e = span.entries.iter().find(|e| e.layer == 2 && e.kind == EntryKind::K).unwrap();
    let read = kv.read(SeqId(2), 2).unwrap().to_bytes();
    assert!(read.0 == payload[e.offset as usize..(e.offset + e.len) as usize], "full layer K through the ring");
    // Three of the prefix's pages were taken: a new request finds less of it.
    kv.add_sequence(SeqId(4), 4).unwrap();
    assert!(kv.attach_prefix(SeqId(4), &prompt, rounding).tokens <= (cached - 3) * page);
}
