//! Paged KV tests: the incident's regressions, accounting, and property tests over random geometries.

use proptest::prelude::*;
use shm_format::{decode_frame, encode_frame, Dtype, EntryKind, FrameCoords, GroupKind, KvGeometry, LayerKv, Manifest};

use super::*;

/// Gemma3-1B's KV geometry: 26 layers, full attention at 5, 11, 17, 23, the rest sliding over 512 tokens.
fn gemma3_1b() -> KvGeometry {
    shm_format::testing::interleaved(26, 6, 512, 1, 256)
}

fn cache(geometry: KvGeometry, dtype: Dtype, page_size: u32, budget: u64) -> PagedKv {
    let mut config = KvConfig::new(geometry, dtype, budget);
    config.page_size = page_size;
    config.max_seqs = 2;
    PagedKv::new(config).unwrap()
}

/// A payload where every byte depends on its entry, so a byte landing in the wrong layer shows.
fn payload_for(m: &Manifest, seed: u8) -> Vec<u8> {
    let mut p = vec![0u8; m.payload_len() as usize];
    for e in &m.entries {
        let tag = (e.layer as u8).wrapping_mul(7).wrapping_add(e.kind as u8 * 3).wrapping_add(seed);
        for (i, b) in p[e.offset as usize..(e.offset + e.len) as usize].iter_mut().enumerate() {
            *b = tag.wrapping_add((i as u8).wrapping_mul(13));
        }
    }
    p
}

fn frame(m: &Manifest, payload: &[u8]) -> Vec<u8> {
    encode_frame(m, payload, FrameCoords::default())
}

/// The bytes of `layer`'s `kind` at `positions`, from a span.
fn rows(m: &Manifest, payload: &[u8], layer: u32, kind: EntryKind, positions: std::ops::Range<u64>) -> Vec<u8> {
    let e = m.entries.iter().find(|e| e.layer == layer && e.kind == kind).unwrap();
    let row = (e.len / m.tokens()) as usize;
    let a = e.offset as usize + (positions.start - m.token_start) as usize * row;
    let b = e.offset as usize + (positions.end - m.token_start) as usize * row;
    payload[a..b].to_vec()
}

fn ingest(kv: &mut PagedKv, seq: SeqId, m: &Manifest, payload: &[u8]) -> Result<(), IngestError> {
    let bytes = frame(m, payload);
    let span = decode_frame(&bytes).expect("a structurally valid span");
    kv.write_span(seq, &span)
}

/// Ingest must fail with `kind`, and leave the cache byte-identical.
fn rejected(kv: &mut PagedKv, seq: SeqId, m: &Manifest, payload: &[u8]) -> &'static str {
    let before = kv.state_hash();
    let err = ingest(kv, seq, m, payload).unwrap_err();
    assert_eq!(kv.state_hash(), before, "cache changed by rejected span: {err}");
    err.kind()
}

/// The state's hash covers every byte a read reaches and none that it does not: a span's bytes staged
/// and aborted (past the sequence's end in its last page, and in pages it had reserved) change nothing,
/// one readable byte changes it.
#[test]
fn the_state_hash_covers_what_reads_reach() {
    let g = gemma3_1b();
    let mut kv = cache(g.clone(), Dtype::Bf16, 64, 64 << 20);
    kv.add_sequence(SeqId(1), 7).unwrap();
    let m = Manifest::grouped(&g, 7, 0..100, Dtype::Bf16);
    ingest(&mut kv, SeqId(1), &m, &payload_for(&m, 1)).unwrap();
    let before = kv.state_hash();
    let next = Manifest::grouped(&g, 7, 100..200, Dtype::Bf16);
    let mut staged = kv.prepare(SeqId(1), &next).unwrap();
    kv.write_staged(&mut staged, 0, &payload_for(&next, 2));
    kv.abort(staged);
    assert_eq!(kv.state_hash(), before, "bytes no read reaches");

    let (group, slot) = (kv.places[5].group, kv.places[5].slot);
    let page = kv.seqs[&SeqId(1)].tables[group].pages[0];
    let at = kv.groups[group].row_offset(page, slot, true, 3, 64);
    kv.groups[group].pool[at] ^= 1;
    assert_ne!(kv.state_hash(), before, "a byte of layer 5's V at position 3");

    // A sliding group keeps pages below its window (a prefix hit reads them): their rows count too.
    let g = shm_format::testing::interleaved(4, 2, 8, 1, 8);
    let mut kv = cache(g.clone(), Dtype::Bf16, 4, 1 << 20);
    kv.add_sequence(SeqId(1), 7).unwrap();
    let m = Manifest::grouped(&g, 7, 0..19, Dtype::Bf16);
    ingest(&mut kv, SeqId(1), &m, &payload_for(&m, 1)).unwrap();
    assert_eq!(kv.read(SeqId(1), 0).unwrap().positions, 11..19, "the window");
    let table = &kv.seqs[&SeqId(1)].tables[kv.places[0].group];
    assert_eq!(table.first, 2, "pages from position 8 are kept");
    let before = kv.state_hash();
    let (group, slot) = (kv.places[0].group, kv.places[0].slot);
    let at = kv.groups[group].row_offset(table.pages[0], slot, false, 1, 4);
    kv.groups[group].pool[at] ^= 1;
    assert_ne!(kv.state_hash(), before, "a byte of layer 0's K at position 9, below the window");
}

#[test]
fn a_dense_26_layer_span_lands_each_layer_in_its_own_group_and_slot() {
    let g = gemma3_1b();
    let mut kv = cache(g.clone(), Dtype::Bf16, 64, 64 << 20);
    kv.add_sequence(SeqId(1), 7).unwrap();
    let m = Manifest::dense(&g, 7, 0..100, Dtype::Bf16).unwrap();
    let payload = payload_for(&m, 1);
    ingest(&mut kv, SeqId(1), &m, &payload).unwrap();
    assert_eq!(kv.group_of(5).unwrap().1, GroupKind::Full);
    assert_eq!(kv.group_of(4).unwrap().1, GroupKind::Sliding { window: 512 });
    for layer in 0..26 {
        let read = kv.read(SeqId(1), layer).unwrap();
        assert_eq!(read.positions, 0..100);
        let (k, v) = read.to_bytes();
        assert!(k == rows(&m, &payload, layer, EntryKind::K, 0..100), "layer {layer} K");
        assert!(v == rows(&m, &payload, layer, EntryKind::V, 0..100), "layer {layer} V");
    }
    let usage = kv.usage();
    assert_eq!(usage[0].layers.len(), 22);
    assert_eq!(usage[1].layers, vec![5, 11, 17, 23]);
    assert_eq!((usage[0].used, usage[1].used), (2, 2), "100 tokens in 64-token pages, per group");

    // The incident: the same 26-layer span sent to a 22-layer sliding receiver is rejected, not copied.
    let sliding_only = KvGeometry {
        layers: g
            .layers
            .iter()
            .copied()
            .filter(|l| l.heads().is_some() && !matches!(l, LayerKv::Full { .. }))
            .collect(),
    };
    assert_eq!(sliding_only.layers.len(), 22);
    let mut small = cache(sliding_only.clone(), Dtype::Bf16, 64, 64 << 20);
    small.add_sequence(SeqId(1), 7).unwrap();
    let mut wrong = m.clone();
    wrong.fingerprint = small.fingerprint();
    assert_eq!(rejected(&mut small, SeqId(1), &wrong, &payload), "layer_count_mismatch");
}

#[test]
fn chunked_prefill_with_noncontiguous_full_layers_reads_back() {
    let g = gemma3_1b();
    let mut kv = cache(g.clone(), Dtype::Bf16, 64, 64 << 20);
    kv.add_sequence(SeqId(3), 9).unwrap();
    let first = Manifest::grouped(&g, 9, 0..70, Dtype::Bf16);
    let second = Manifest::grouped(&g, 9, 70..135, Dtype::Bf16);
    let (p1, p2) = (payload_for(&first, 1), payload_for(&second, 2));
    ingest(&mut kv, SeqId(3), &first, &p1).unwrap();
    // Replaying the first chunk, or skipping ahead, is refused.
    assert_eq!(rejected(&mut kv, SeqId(3), &first, &p1), "token_offset_mismatch");
    ingest(&mut kv, SeqId(3), &second, &p2).unwrap();
    for layer in [5, 11, 17, 23, 0, 22] {
        let (k, v) = kv.read(SeqId(3), layer).unwrap().to_bytes();
        let mut want_k = rows(&first, &p1, layer, EntryKind::K, 0..70);
        want_k.extend(rows(&second, &p2, layer, EntryKind::K, 70..135));
        let mut want_v = rows(&first, &p1, layer, EntryKind::V, 0..70);
        want_v.extend(rows(&second, &p2, layer, EntryKind::V, 70..135));
        assert!(k == want_k && v == want_v, "layer {layer}");
    }
    assert_eq!(kv.seq_len(SeqId(3)), Some(135));
}

#[test]
fn every_receiver_mismatch_is_rejected_and_changes_nothing() {
    let g = gemma3_1b();
    let mut kv = cache(g.clone(), Dtype::Bf16, 64, 64 << 20);
    kv.add_sequence(SeqId(1), 7).unwrap();
    // Something already in the cache, so "unchanged" means something.
    let m = Manifest::grouped(&g, 7, 0..10, Dtype::Bf16);
    ingest(&mut kv, SeqId(1), &m, &payload_for(&m, 0)).unwrap();
    let next = Manifest::grouped(&g, 7, 10..20, Dtype::Bf16);
    let p = payload_for(&next, 3);

    let mut missing_group = next.clone();
    if let shm_format::Layout::Grouped { groups } = &mut missing_group.layout {
        groups.retain(|g| g.kind != GroupKind::Full);
    }
    missing_group.entries.retain(|e| e.layer % 6 != 5);
    assert_eq!(rejected(&mut kv, SeqId(1), &missing_group, &p), "missing_layer");

    // One malformed group among valid ones: the full group's head dim is 128, not 256.
    let mut bad_group = next.clone();
    let full: Vec<u32> = vec![5, 11, 17, 23];
    let mut offset = 0;
    for e in &mut bad_group.entries {
        if full.contains(&e.layer) {
            e.shape = vec![10, 2, 128];
        }
        e.offset = offset;
        offset += e.len;
    }
    assert_eq!(rejected(&mut kv, SeqId(1), &bad_group, &payload_for(&bad_group, 1)), "head_geometry_mismatch");

    let mut fingerprint = next.clone();
    fingerprint.fingerprint.0 ^= 1;
    assert_eq!(rejected(&mut kv, SeqId(1), &fingerprint, &p), "fingerprint_mismatch");

    let mut request = next.clone();
    request.request_id = 8;
    assert_eq!(rejected(&mut kv, SeqId(1), &request, &p), "request_mismatch");

    let mut kind = next.clone();
    if let shm_format::Layout::Grouped { groups } = &mut kind.layout {
        groups[1].kind = GroupKind::Sliding { window: 512 };
    }
    assert_eq!(rejected(&mut kv, SeqId(1), &kind, &p), "group_kind_mismatch");

    let gap = Manifest::grouped(&g, 7, 11..20, Dtype::Bf16);
    assert_eq!(rejected(&mut kv, SeqId(1), &gap, &payload_for(&gap, 0)), "token_offset_mismatch");

    // A larger model's span: layer 26 does not exist here.
    let mut bigger = g.clone();
    bigger.layers.push(LayerKv::Full { kv_heads: 1, head_dim: 256 });
    let mut extra = Manifest::grouped(&bigger, 7, 10..20, Dtype::Bf16);
    extra.fingerprint = kv.fingerprint();
    assert_eq!(rejected(&mut kv, SeqId(1), &extra, &payload_for(&extra, 0)), "unexpected_layer");

    assert_eq!(rejected(&mut kv, SeqId(2), &next, &p), "unknown_sequence");
}

#[test]
fn dtype_conversion_widens_and_refuses_lossy_narrowing_when_disabled() {
    let g = KvGeometry { layers: vec![LayerKv::Full { kv_heads: 2, head_dim: 4 }; 2] };
    let mut config = KvConfig::new(g.clone(), Dtype::F32, 1 << 20);
    config.allow_lossy = false;
    let mut kv = PagedKv::new(config).unwrap();
    kv.add_sequence(SeqId(1), 1).unwrap();
    let m = Manifest::grouped(&g, 1, 0..3, Dtype::Bf16);
    let values: Vec<f32> = (0..m.payload_len() / 2).map(|i| i as f32 * 0.5 - 3.0).collect();
    let payload: Vec<u8> = values.iter().flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes()).collect();
    ingest(&mut kv, SeqId(1), &m, &payload).unwrap();
    let (k, _) = kv.read(SeqId(1), 1).unwrap().to_bytes();
    let e = m.entries.iter().find(|e| e.layer == 1 && e.kind == EntryKind::K).unwrap();
    let want: Vec<u8> = values[(e.offset / 2) as usize..((e.offset + e.len) / 2) as usize]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    assert_eq!(k, want, "bf16 widened to f32 exactly");

    let mut kv16 = PagedKv::new({
        let mut c = KvConfig::new(g.clone(), Dtype::Bf16, 1 << 20);
        c.allow_lossy = false;
        c
    })
    .unwrap();
    kv16.add_sequence(SeqId(1), 1).unwrap();
    let m32 = Manifest::grouped(&g, 1, 0..3, Dtype::F32);
    assert_eq!(rejected(&mut kv16, SeqId(1), &m32, &payload_for(&m32, 0)), "dtype_not_convertible");
}

/// Rejections name kinds, heads and sizes in words, never as `Debug` tuples or enums.
#[test]
fn receiver_mismatches_read_as_words() {
    let g = gemma3_1b();
    let mut kv = cache(g.clone(), Dtype::Bf16, 64, 64 << 20);
    kv.add_sequence(SeqId(1), 7).unwrap();
    let m = Manifest::grouped(&g, 7, 0..10, Dtype::Bf16);
    let text = |kv: &mut PagedKv, m: &Manifest| ingest(kv, SeqId(1), m, &payload_for(m, 0)).unwrap_err().to_string();

    let mut heads = m.clone();
    let mut offset = 0;
    for e in &mut heads.entries {
        if e.layer % 6 == 5 {
            e.shape = vec![10, 2, 128];
            e.len = 10 * 2 * 128 * 2;
        }
        e.offset = offset;
        offset += e.len;
    }
    assert_eq!(text(&mut kv, &heads), "layer 5 k: expected 1 KV head of size 256, found 2 KV heads of size 128");

    let mut kind = m.clone();
    if let shm_format::Layout::Grouped { groups } = &mut kind.layout {
        groups[1].kind = GroupKind::Sliding { window: 512 };
    }
    assert_eq!(
        text(&mut kv, &kind),
        "layer 5: expected a full attention group (the receiver's), found a sliding window 512 group (the span's)"
    );

    let mut missing = m.clone();
    if let shm_format::Layout::Grouped { groups } = &mut missing.layout {
        groups.retain(|g| g.kind != GroupKind::Full);
    }
    missing.entries.retain(|e| e.layer % 6 != 5);
    assert_eq!(text(&mut kv, &missing), "layer 5 (group 1, full attention): expected its k entry, found none");

    let small = KvGeometry { layers: vec![LayerKv::Full { kv_heads: 1, head_dim: 8 }] };
    let mut kv = cache(small.clone(), Dtype::F32, 4, 2 * 256);
    kv.add_sequence(SeqId(1), 1).unwrap();
    let long = Manifest::grouped(&small, 1, 0..9, Dtype::F32);
    assert_eq!(text(&mut kv, &long), "group 0 (full attention) capacity: expected 3 free pages, found 2");

    let mixed = KvGeometry {
        layers: vec![LayerKv::Full { kv_heads: 1, head_dim: 8 }, LayerKv::Full { kv_heads: 2, head_dim: 8 }],
    };
    let err = PagedKv::new(KvConfig::new(mixed, Dtype::F32, 1 << 20)).unwrap_err().to_string();
    assert_eq!(err, "group 0: expected every layer with 1 KV head of size 8, found layer 1 with 2 KV heads of size 8");

    // A recurrent group's page holds one state a layer: the layers' sizes must agree (with the largest
    // for all, a span of the right sizes was refused and pages were oversized).
    let states =
        KvGeometry { layers: vec![LayerKv::Recurrent { state_elems: 6 }, LayerKv::Recurrent { state_elems: 9 }] };
    let err = PagedKv::new(KvConfig::new(states, Dtype::F32, 1 << 20)).unwrap_err().to_string();
    assert_eq!(err, "group 0: expected every recurrent layer with a state of 6 elements, found layer 1 with 9");

    // A window of pages past 32 bits for the sequences asked: refused, not wrapped to a smaller pool.
    let wide = KvGeometry { layers: vec![LayerKv::Sliding { window: u32::MAX, kv_heads: 1, head_dim: 8 }] };
    let mut config = KvConfig::new(wide, Dtype::F32, u64::MAX);
    config.page_size = 1;
    config.max_seqs = 64;
    let err = PagedKv::new(config).unwrap_err();
    assert!(matches!(err, ConfigError::TooLarge { max_tokens: 4_294_967_295, max_seqs: 64 }), "{err}");
}

#[test]
fn capacity_exhaustion_is_rejected_and_release_returns_every_page() {
    let g = KvGeometry { layers: vec![LayerKv::Full { kv_heads: 1, head_dim: 8 }; 2] };
    // 2 layers x 2 x 4 tokens x 8 x 4 bytes = 512 bytes a page: 10 pages.
    let mut kv = cache(g.clone(), Dtype::F32, 4, 10 * 512);
    assert_eq!(kv.usage()[0].total, 10);
    kv.add_sequence(SeqId(1), 1).unwrap();
    kv.add_sequence(SeqId(2), 2).unwrap();
    let a = Manifest::grouped(&g, 1, 0..30, Dtype::F32);
    ingest(&mut kv, SeqId(1), &a, &payload_for(&a, 0)).unwrap();
    assert_eq!((kv.usage()[0].used, kv.usage()[0].free), (8, 2));
    let b = Manifest::grouped(&g, 2, 0..9, Dtype::F32);
    assert_eq!(rejected(&mut kv, SeqId(2), &b, &payload_for(&b, 0)), "capacity_exhausted");
    // The other sequence is untouched and still reads back.
    let (k, _) = kv.read(SeqId(1), 0).unwrap().to_bytes();
    assert_eq!(k, rows(&a, &payload_for(&a, 0), 0, EntryKind::K, 0..30));
    kv.remove_sequence(SeqId(1)).unwrap();
    assert_eq!((kv.usage()[0].used, kv.usage()[0].free), (0, 10));
    ingest(&mut kv, SeqId(2), &b, &payload_for(&b, 0)).unwrap();
    assert_eq!(kv.usage()[0].used, 3);
}

#[test]
fn a_sliding_span_longer_than_the_window_keeps_only_the_tail() {
    let g = KvGeometry {
        layers: vec![
            LayerKv::Sliding { window: 8, kv_heads: 1, head_dim: 2 },
            LayerKv::Full { kv_heads: 1, head_dim: 2 },
        ],
    };
    let mut kv = cache(g.clone(), Dtype::F32, 4, 1 << 16);
    kv.add_sequence(SeqId(1), 1).unwrap();
    let m = Manifest::grouped(&g, 1, 0..30, Dtype::F32);
    let p = payload_for(&m, 5);
    ingest(&mut kv, SeqId(1), &m, &p).unwrap();
    let read = kv.read(SeqId(1), 0).unwrap();
    assert_eq!(read.positions, 22..30);
    let (k, v) = read.to_bytes();
    assert_eq!(k, rows(&m, &p, 0, EntryKind::K, 22..30));
    assert_eq!(v, rows(&m, &p, 0, EntryKind::V, 22..30));
    // Positions 20..30 in pages 5..7: 3 pages, not 8.
    assert_eq!(kv.usage()[0].used, 3);
    assert_eq!(kv.usage()[1].used, 8);
    // Decoding on one token at a time keeps the sliding group bounded by the window.
    for pos in 30..60 {
        let one = Manifest::grouped(&g, 1, pos..pos + 1, Dtype::F32);
        ingest(&mut kv, SeqId(1), &one, &payload_for(&one, pos as u8)).unwrap();
        assert!(kv.usage()[0].used <= 3, "window 8 in 4-token pages needs at most 3 pages");
    }
    let (k, _) = kv.read(SeqId(1), 0).unwrap().to_bytes();
    let want: Vec<u8> = (52..60)
        .flat_map(|pos| {
            let one = Manifest::grouped(&g, 1, pos..pos + 1, Dtype::F32);
            rows(&one, &payload_for(&one, pos as u8), 0, EntryKind::K, pos..pos + 1)
        })
        .collect();
    assert_eq!(k, want);
}

#[test]
fn recurrent_state_is_replaced_by_each_span() {
    let g = shm_format::testing::tiny_hybrid_geometry();
    let mut kv = cache(g.clone(), Dtype::F16, 4, 1 << 16);
    kv.add_sequence(SeqId(1), 1).unwrap();
    assert_eq!(kv.read_state(SeqId(1), 1).unwrap(), None);
    for (i, range) in [0..3u64, 3..5].into_iter().enumerate() {
        let m = Manifest::grouped(&g, 1, range, Dtype::F16);
        let p = payload_for(&m, i as u8);
        ingest(&mut kv, SeqId(1), &m, &p).unwrap();
        let e = m.entries.iter().find(|e| e.kind == EntryKind::State).unwrap();
        assert_eq!(kv.read_state(SeqId(1), 1).unwrap().unwrap(), &p[e.offset as usize..(e.offset + e.len) as usize]);
    }
    let recurrent = kv.usage().into_iter().find(|u| u.kind == GroupKind::Recurrent).unwrap();
    assert_eq!(recurrent.used, 1, "the old state's page went back");
    let mut wrong = Manifest::grouped(&g, 1, 5..6, Dtype::F16);
    for e in &mut wrong.entries {
        if e.kind == EntryKind::State {
            e.shape = vec![3];
            e.len = 3 * 2;
        }
    }
    assert_eq!(rejected(&mut kv, SeqId(1), &wrong, &payload_for(&wrong, 0)), "state_size_mismatch");
}

/// A random model: 1 to 6 layers, each full, sliding (window 1..10) or recurrent.
/// One sliding layer (window 8) and one full-attention layer, two elements a row.
fn sliding_and_full() -> KvGeometry {
    KvGeometry {
        layers: vec![
            LayerKv::Sliding { window: 8, kv_heads: 1, head_dim: 2 },
            LayerKv::Full { kv_heads: 1, head_dim: 2 },
        ],
    }
}

/// Ingests positions `range` of `seq` in spans of `chunk` tokens whose bytes depend on `seed`.
fn ingest_chunks(kv: &mut PagedKv, seq: SeqId, request: u64, range: std::ops::Range<u64>, chunk: u64, seed: u8) {
    let g = kv.geometry().clone();
    let mut pos = range.start;
    while pos < range.end {
        let end = (pos + chunk).min(range.end);
        let m = Manifest::grouped(&g, request, pos..end, Dtype::F32);
        ingest(kv, seq, &m, &payload_for(&m, seed.wrapping_add(pos as u8))).unwrap();
        pos = end;
    }
}

fn layer_bytes(kv: &PagedKv, seq: SeqId, layer: u32) -> (std::ops::Range<u64>, Vec<u8>, Vec<u8>) {
    let read = kv.read(seq, layer).unwrap();
    let (k, v) = read.to_bytes();
    (read.positions, k, v)
}

/// A span that needs cached prefix pages takes them out of the prefix cache only at its commit. Aborted
/// (its checksum failed once its copy had begun), it leaves the cache exactly as it was, the prefix index,
/// the cached pages and their bytes included: a producer's bad frames cannot flush the prefix cache.
/// Committed, its bytes land in those pages (by way of the side buffer), the prefix they held is
/// forgotten, and a live sequence's bytes are untouched either way.
#[test]
fn a_span_takes_cached_pages_only_at_its_commit() {
    let g = sliding_and_full();
    let mut kv = cache(g.clone(), Dtype::F32, 4, 12 * 64 + 8 * 64);
    kv.enable_prefix_cache();
    let a: Vec<u32> = (0..16).collect();
    kv.add_sequence(SeqId(1), 1).unwrap();
    ingest_chunks(&mut kv, SeqId(1), 1, 0..16, 4, 1);
    kv.register_prefix(SeqId(1), &a, Rounding::host(Dtype::F32));
    kv.remove_sequence(SeqId(1)).unwrap();
    kv.add_sequence(SeqId(2), 2).unwrap();
    ingest_chunks(&mut kv, SeqId(2), 2, 0..8, 4, 7);
    let live = (layer_bytes(&kv, SeqId(2), 0), layer_bytes(&kv, SeqId(2), 1));
    let full = kv.usage()[1].clone();
    assert_eq!((full.used, full.cached, full.free), (2, 4, 2), "sequence 1's pages cached, 2 live, 2 free");

    // Six full pages: the two free ones, then the four cached ones, written and then aborted.
    kv.add_sequence(SeqId(3), 3).unwrap();
    let before = kv.state_hash();
    let m = Manifest::grouped(&g, 3, 0..24, Dtype::F32);
    let payload = payload_for(&m, 9);
    let mut staged = kv.prepare(SeqId(3), &m).unwrap();
    kv.write_staged(&mut staged, 0, &payload);
    kv.abort(staged);
    assert_eq!(kv.state_hash(), before, "the cached pages, their bytes and the prefix index as they were");
    let full = kv.usage()[1].clone();
    assert_eq!((full.used, full.cached, full.free), (2, 4, 2));

    // Committed, written in uneven pieces (runs cut across the side buffer and the pool).
    let mut staged = kv.prepare(SeqId(3), &m).unwrap();
    let mut at = 0;
    for piece in payload.chunks(52) {
        kv.write_staged(&mut staged, at, piece);
        at += piece.len() as u64;
    }
    kv.commit(staged);
    let full = kv.usage()[1].clone();
    assert_eq!((full.used, full.cached, full.free), (8, 0, 0), "the cached pages are sequence 3's now");
    let mut alone = cache(g.clone(), Dtype::F32, 4, 12 * 64 + 8 * 64);
    alone.add_sequence(SeqId(3), 3).unwrap();
    ingest(&mut alone, SeqId(3), &m, &payload).unwrap();
    for layer in 0..2 {
        assert_eq!(layer_bytes(&kv, SeqId(3), layer), layer_bytes(&alone, SeqId(3), layer), "layer {layer}");
    }
    kv.add_sequence(SeqId(4), 4).unwrap();
    assert_eq!(kv.attach_prefix(SeqId(4), &a, Rounding::host(Dtype::F32)).tokens, 0, "the prefix is forgotten");
    assert_eq!((layer_bytes(&kv, SeqId(2), 0), layer_bytes(&kv, SeqId(2), 1)), live);
}

#[test]
fn a_prefix_hit_shares_whole_pages_and_reads_back_the_first_sequences_bytes() {
    // 4-token pages of 64 bytes; 12 sliding pages, and 8 full ones.
    let mut kv = cache(sliding_and_full(), Dtype::F32, 4, 12 * 64 + 8 * 64);
    kv.enable_prefix_cache();
    let a: Vec<u32> = (0..19).collect();
    kv.add_sequence(SeqId(1), 1).unwrap();
    ingest_chunks(&mut kv, SeqId(1), 1, 0..19, 4, 1);
    let unregistered = kv.state_hash();
    kv.register_prefix(SeqId(1), &a, Rounding::host(Dtype::F32));
    assert_ne!(kv.state_hash(), unregistered, "the state's hash covers the prefix index");

    // Misses change nothing: other tokens in the first page, another rounding.
    kv.add_sequence(SeqId(2), 2).unwrap();
    let before = kv.state_hash();
    let mut other = a.clone();
    other[1] = 99;
    assert_eq!(kv.attach_prefix(SeqId(2), &other, Rounding::host(Dtype::F32)).tokens, 0);
    assert_eq!(kv.attach_prefix(SeqId(2), &a, Rounding::host(Dtype::Bf16)).tokens, 0);
    // The same tokens and dtype computed by a backend are other bytes than the host's: a miss.
    assert_eq!(kv.attach_prefix(SeqId(2), &a, Rounding::backend("torch", Dtype::F32)).tokens, 0);
    assert_eq!(kv.state_hash(), before);

    // Sixteen tokens agree: four whole pages. The sliding layer needs positions 8..16 of them, which
    // sequence 1 still holds.
    let mut b: Vec<u32> = a[..16].to_vec();
    b.extend([100, 101, 102, 103]);
    assert_eq!(kv.attach_prefix(SeqId(2), &b, Rounding::host(Dtype::F32)).tokens, 16);
    assert_eq!(kv.seq_len(SeqId(2)), Some(16));
    let (positions, k, v) = layer_bytes(&kv, SeqId(2), 1);
    assert_eq!(positions, 0..16);
    let (_, k1, v1) = layer_bytes(&kv, SeqId(1), 1);
    assert_eq!((&k[..], &v[..]), (&k1[..k.len()], &v1[..v.len()]), "full layer: sequence 1's bytes");
    let (positions, k, _) = layer_bytes(&kv, SeqId(2), 0);
    assert_eq!(positions, 8..16);
    let (positions1, k1, _) = layer_bytes(&kv, SeqId(1), 0);
    assert_eq!(positions1, 11..19);
    assert_eq!(k[3 * 8..], k1[..5 * 8], "sliding layer: positions 11..16 as sequence 1 holds them");
    // Shared pages are counted once: sequence 1's five full pages.
    assert_eq!(kv.usage()[1].used, 5);

    // The rest lands in new pages; sequence 1 does not notice.
    let seq1 = (layer_bytes(&kv, SeqId(1), 0), layer_bytes(&kv, SeqId(1), 1));
    ingest_chunks(&mut kv, SeqId(2), 2, 16..20, 4, 50);
    assert_eq!((layer_bytes(&kv, SeqId(1), 0), layer_bytes(&kv, SeqId(1), 1)), seq1);
    assert_eq!(kv.usage()[1].used, 6);

    // With both gone, the registered pages stay cached, and a third sequence hits them.
    kv.remove_sequence(SeqId(1)).unwrap();
    assert_eq!(kv.usage()[1].used, 5, "sequence 2 still holds the shared pages");
    kv.remove_sequence(SeqId(2)).unwrap();
    let usage = kv.usage();
    assert_eq!((usage[1].used, usage[1].cached, usage[1].free), (0, 4, 4));
    assert_eq!((usage[0].used, usage[0].cached), (0, 2));
    kv.add_sequence(SeqId(3), 3).unwrap();
    assert_eq!(kv.attach_prefix(SeqId(3), &b, Rounding::host(Dtype::F32)).tokens, 16);
    assert_eq!(layer_bytes(&kv, SeqId(3), 1).1, seq1.1 .1[..16 * 8]);
    kv.remove_sequence(SeqId(3)).unwrap();

    // A span that needs every page takes the cached ones, least recently released first: the prefix is
    // forgotten, never read half-overwritten.
    kv.add_sequence(SeqId(4), 4).unwrap();
    ingest_chunks(&mut kv, SeqId(4), 4, 0..32, 32, 9);
    assert_eq!((kv.usage()[1].used, kv.usage()[1].cached, kv.usage()[1].free), (8, 0, 0));
    kv.remove_sequence(SeqId(4)).unwrap();
    kv.add_sequence(SeqId(5), 5).unwrap();
    assert_eq!(kv.attach_prefix(SeqId(5), &b, Rounding::host(Dtype::F32)).tokens, 0);
    let usage = kv.usage();
    assert!(usage.iter().all(|u| u.used == 0 && u.free + u.cached == u.total), "{usage:?}");
}

#[test]
fn a_sliding_window_that_no_longer_holds_a_prefix_limits_the_hit() {
    let mut kv = cache(sliding_and_full(), Dtype::F32, 4, 1 << 16);
    kv.enable_prefix_cache();
    let a: Vec<u32> = (0..22).collect();
    // One span over 22 tokens: the sliding layer is written only for the pages its window still sees,
    // positions 12..22 (whole pages from 22 - 8 = 14 down).
    kv.add_sequence(SeqId(1), 1).unwrap();
    ingest_chunks(&mut kv, SeqId(1), 1, 0..22, 22, 1);
    kv.register_prefix(SeqId(1), &a, Rounding::host(Dtype::F32));
    kv.add_sequence(SeqId(2), 2).unwrap();
    // 16 tokens would need positions 8..16 in the sliding layer, which were never written: no hit.
    assert_eq!(kv.attach_prefix(SeqId(2), &a[..16], Rounding::host(Dtype::F32)).tokens, 0);
    // 20 tokens need 12..20: held.
    assert_eq!(kv.attach_prefix(SeqId(2), &a, Rounding::host(Dtype::F32)).tokens, 20);
    let (positions, k, _) = layer_bytes(&kv, SeqId(2), 0);
    assert_eq!(positions, 12..20);
    let (positions1, k1, _) = layer_bytes(&kv, SeqId(1), 0);
    assert_eq!(positions1, 14..22);
    assert_eq!(k[2 * 8..], k1[..6 * 8]);
    let m = Manifest::grouped(&sliding_and_full(), 1, 0..22, Dtype::F32);
    assert_eq!(k[..2 * 8], rows(&m, &payload_for(&m, 1), 0, EntryKind::K, 12..14), "the page's head was written");
}

/// A window the page size does not divide: the sliding group keeps the window of the last whole page's
/// end, so that the prompt's whole pages are a hit (they kept only the window of the end, and no hit
/// was possible at all).
#[test]
fn a_window_that_pages_do_not_divide_still_holds_the_whole_pages_prefix() {
    let g = KvGeometry {
        layers: vec![
            LayerKv::Sliding { window: 6, kv_heads: 2, head_dim: 1 },
            LayerKv::Full { kv_heads: 2, head_dim: 1 },
        ],
    };
    let mut kv = cache(g.clone(), Dtype::F32, 4, 1 << 16);
    kv.enable_prefix_cache();
    let a: Vec<u32> = (0..23).collect();
    kv.add_sequence(SeqId(1), 1).unwrap();
    ingest_chunks(&mut kv, SeqId(1), 1, 0..23, 5, 1);
    kv.register_prefix(SeqId(1), &a, Rounding::host(Dtype::F32));
    assert_eq!(layer_bytes(&kv, SeqId(1), 0).0, 17..23, "the window as the sequence sees it");
    kv.add_sequence(SeqId(2), 2).unwrap();
    // A hit of 20 needs positions 14..20 of the sliding layer: held.
    assert_eq!(kv.attach_prefix(SeqId(2), &a, Rounding::host(Dtype::F32)).tokens, 20);
    let (positions, k, _) = layer_bytes(&kv, SeqId(2), 0);
    assert_eq!(positions, 14..20);
    let written: Vec<u8> = (0..23u64)
        .step_by(5)
        .flat_map(|at| {
            let chunk = Manifest::grouped(&g, 1, at..(at + 5).min(23), Dtype::F32);
            let payload = payload_for(&chunk, 1u8.wrapping_add(at as u8));
            let lo = at.max(14);
            let hi = (at + 5).min(20);
            if lo < hi {
                rows(&chunk, &payload, 0, EntryKind::K, lo..hi)
            } else {
                Vec::new()
            }
        })
        .collect();
    assert_eq!(k, written, "sequence 1's K of positions 14..20");
}

#[test]
fn models_with_recurrent_state_never_hit() {
    let g = shm_format::testing::tiny_hybrid_geometry();
    let mut kv = cache(g.clone(), Dtype::F32, 4, 1 << 20);
    kv.enable_prefix_cache();
    let a: Vec<u32> = (0..8).collect();
    kv.add_sequence(SeqId(1), 1).unwrap();
    ingest_chunks(&mut kv, SeqId(1), 1, 0..8, 8, 1);
    kv.register_prefix(SeqId(1), &a, Rounding::host(Dtype::F32));
    kv.add_sequence(SeqId(2), 2).unwrap();
    assert_eq!(kv.attach_prefix(SeqId(2), &a, Rounding::host(Dtype::F32)).tokens, 0);
}

fn arb_geometry() -> impl Strategy<Value = KvGeometry> {
    let layer = prop_oneof![
        Just(LayerKv::Full { kv_heads: 2, head_dim: 3 }),
        (1u32..10).prop_map(|window| LayerKv::Sliding { window, kv_heads: 2, head_dim: 3 }),
        Just(LayerKv::Recurrent { state_elems: 5 }),
    ];
    prop::collection::vec(layer, 1..7).prop_map(|layers| KvGeometry { layers })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Random geometries, page sizes and chunkings: every layer reads back exactly the positions it sees,
    /// with the bytes written for them; corrupted spans are refused and change nothing.
    #[test]
    fn random_chunked_spans_read_back_and_corruptions_change_nothing(
        geometry in arb_geometry(),
        page_size in 1u32..6,
        chunks in prop::collection::vec(1u64..12, 1..6),
        dense in any::<bool>(),
        corruption in 0usize..6,
    ) {
        let mut kv = cache(geometry.clone(), Dtype::F32, page_size, 1 << 20);
        kv.add_sequence(SeqId(1), 5).unwrap();
        // Expected K/V rows per attention layer, by position; the last state per recurrent layer.
        let row = 2 * 3 * 4;
        let mut want: Vec<(Vec<u8>, Vec<u8>)> = vec![(Vec::new(), Vec::new()); geometry.layers.len()];
        let mut state: Vec<Option<Vec<u8>>> = vec![None; geometry.layers.len()];
        let mut pos = 0;
        for (i, len) in chunks.into_iter().enumerate() {
            let range = pos..pos + len;
            let m = match Manifest::dense(&geometry, 5, range.clone(), Dtype::F32) {
                Some(m) if dense => m,
                _ => Manifest::grouped(&geometry, 5, range.clone(), Dtype::F32),
            };
            let p = payload_for(&m, i as u8);

            // A corrupted copy first: refused, cache unchanged.
            let mut bad = m.clone();
            match corruption {
                0 => bad.fingerprint.0 ^= 1,
                1 => bad.request_id += 1,
                2 => { bad.token_start += 1; bad.token_end += 1; }
                3 => bad.entries.retain(|e| e.layer != 0),
                4 => if let shm_format::Layout::Dense { num_layers, .. } = &mut bad.layout { *num_layers += 1 } else { bad.entries.pop(); },
                // Capacity: a real span far longer than the pools. Only full attention grows with the span:
                // sliding groups keep the window's tail and recurrent groups one state.
                _ if geometry.layers.iter().any(|l| matches!(l, LayerKv::Full { .. })) => {
                    bad = Manifest::grouped(&geometry, 5, pos..pos + 100_000, Dtype::F32);
                }
                _ => bad.fingerprint.0 ^= 2,
            }
            let before = kv.state_hash();
            let bad_frame = frame(&bad, &payload_for(&bad, 0));
            // A span the format refuses never reaches the cache; one it accepts, the cache must refuse.
            if let Ok(span) = decode_frame(&bad_frame) {
                prop_assert!(kv.write_span(SeqId(1), &span).is_err());
            }
            prop_assert_eq!(kv.state_hash(), before);

            ingest(&mut kv, SeqId(1), &m, &p).unwrap();
            for (layer, kvg) in geometry.layers.iter().enumerate() {
                let layer32 = layer as u32;
                if kvg.heads().is_some() {
                    want[layer].0.extend(rows(&m, &p, layer32, EntryKind::K, range.clone()));
                    want[layer].1.extend(rows(&m, &p, layer32, EntryKind::V, range.clone()));
                } else {
                    let e = m.entries.iter().find(|e| e.layer == layer32).unwrap();
                    state[layer] = Some(p[e.offset as usize..(e.offset + e.len) as usize].to_vec());
                }
            }
            pos += len;
            for (layer, kvg) in geometry.layers.iter().enumerate() {
                if kvg.heads().is_some() {
                    let read = kv.read(SeqId(1), layer as u32).unwrap();
                    let from = read.positions.start as usize * row;
                    let (k, v) = read.to_bytes();
                    prop_assert_eq!(&k[..], &want[layer].0[from..]);
                    prop_assert_eq!(&v[..], &want[layer].1[from..]);
                } else {
                    prop_assert_eq!(kv.read_state(SeqId(1), layer as u32).unwrap().map(<[u8]>::to_vec), state[layer].clone());
                }
            }
        }
        kv.remove_sequence(SeqId(1)).unwrap();
        prop_assert!(kv.usage().iter().all(|u| u.used == 0 && u.free == u.total));
    }
}

/// A fork reads back what its source holds; each then writes its own tokens without touching the
/// other's, the partly filled last pages copied and the rest shared; with both gone every page is free.
#[test]
fn a_fork_reads_as_its_source_and_each_writes_alone() {
    // 4-token pages of 64 bytes; 12 sliding pages, and 8 full ones.
    let mut kv = cache(sliding_and_full(), Dtype::F32, 4, 12 * 64 + 8 * 64);
    kv.add_sequence(SeqId(1), 1).unwrap();
    ingest_chunks(&mut kv, SeqId(1), 1, 0..18, 5, 1);
    let before = kv.usage();
    assert_eq!(kv.fork(SeqId(1), SeqId(1), 2), Err(IngestError::SequenceExists { seq: SeqId(1) }));
    assert_eq!(kv.fork(SeqId(9), SeqId(2), 2), Err(IngestError::UnknownSequence { seq: SeqId(9) }));
    kv.fork(SeqId(1), SeqId(2), 2).unwrap();
    assert_eq!(kv.seq_len(SeqId(2)), Some(18));
    let held = |kv: &PagedKv, seq| (layer_bytes(kv, seq, 0), layer_bytes(kv, seq, 1));
    assert_eq!(held(&kv, SeqId(2)), held(&kv, SeqId(1)));
    // Only each group's partly filled last page is new (positions 16..18 of 16..20).
    let after = kv.usage();
    assert_eq!((after[0].used, after[1].used), (before[0].used + 1, before[1].used + 1));

    // Each writes its own next tokens; the other reads as before.
    let (one, two) = (held(&kv, SeqId(1)), held(&kv, SeqId(2)));
    ingest_chunks(&mut kv, SeqId(2), 2, 18..23, 1, 77);
    assert_eq!(held(&kv, SeqId(1)), one, "the fork's writes stay its own");
    ingest_chunks(&mut kv, SeqId(1), 1, 18..21, 1, 5);
    let (_, k2, _) = layer_bytes(&kv, SeqId(2), 1);
    assert_eq!(k2[..18 * 8], two.1 .1[..], "the source's writes stay its own");
    assert_ne!(layer_bytes(&kv, SeqId(1), 1).1[18 * 8..21 * 8], k2[18 * 8..21 * 8]);

    kv.remove_sequence(SeqId(1)).unwrap();
    kv.remove_sequence(SeqId(2)).unwrap();
    assert!(kv.usage().iter().all(|u| u.used == 0 && u.free == u.total), "{:?}", kv.usage());
}
