//! Crate-level tests: fixtures, every rejection kind, round trips and byte mutations.

use std::collections::BTreeSet;
use std::path::PathBuf;

use proptest::prelude::*;

use crate::testing::{fixtures, pattern};
use crate::*;

fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/spans")
}

/// The verdict file format: one line per fixture, `NAME valid` or `NAME rejected KIND`.
fn verdict_line(f: &testing::Fixture) -> String {
    match f.verdict {
        None => format!("{} valid", f.name),
        Some(kind) => format!("{} rejected {kind}", f.name),
    }
}

#[test]
fn every_fixture_decodes_to_its_verdict() {
    for f in fixtures() {
        let got = decode_frame(&f.bytes).err().map(|e| e.kind());
        assert_eq!(got, f.verdict, "fixture {}: {:?}", f.name, decode_frame(&f.bytes).err());
    }
}

/// The files in `fixtures/spans/` are exactly what the generator makes. Regenerate them with
/// `PDHOST_BLESS=1 cargo test -p pdhost-shm-format fixture_files`.
#[test]
fn fixture_files_are_current() {
    let dir = fixtures_dir();
    let all = fixtures();
    let verdicts: String = all.iter().map(|f| verdict_line(f) + "\n").collect();
    if std::env::var_os("PDHOST_BLESS").is_some() {
        std::fs::create_dir_all(&dir).unwrap();
        for old in std::fs::read_dir(&dir).unwrap() {
            let path = old.unwrap().path();
            if path.extension().is_some_and(|e| e == "span") {
                std::fs::remove_file(path).unwrap();
            }
        }
        for f in &all {
            std::fs::write(dir.join(&f.name), &f.bytes).unwrap();
        }
        std::fs::write(dir.join("verdicts.txt"), &verdicts).unwrap();
    }
    let on_disk = std::fs::read_to_string(dir.join("verdicts.txt")).expect("fixtures/spans/verdicts.txt");
    assert_eq!(on_disk, verdicts, "verdicts.txt is stale: rerun with PDHOST_BLESS=1");
    for f in &all {
        let bytes = std::fs::read(dir.join(&f.name)).unwrap_or_else(|e| panic!("{}: {e}", f.name));
        assert!(bytes == f.bytes, "{} is stale: rerun with PDHOST_BLESS=1", f.name);
    }
    let files = std::fs::read_dir(&dir)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "span"));
    assert_eq!(files.count(), all.len(), "stray .span files in fixtures/spans");
}

fn ring_rejections() -> Vec<SpanError> {
    let frame = encode_frame(&testing::valid_dense(), &[0; 192], FrameCoords::default());
    let info = parse_header_prefix(&frame).unwrap();
    let ok = RingExpectation { producer_epoch: 0, slot_generation: 0, sequence: 0, slot_capacity: info.frame_len };
    assert_eq!(ok.check(&info), Ok(()));
    [
        RingExpectation { producer_epoch: 3, ..ok },
        RingExpectation { slot_generation: 2, ..ok },
        RingExpectation { sequence: 1, ..ok },
        RingExpectation { slot_capacity: info.frame_len - 1, ..ok },
    ]
    .iter()
    .map(|e| e.check(&info).unwrap_err())
    .collect()
}

#[test]
fn ring_expectation_rejects_each_coordinate() {
    let kinds: Vec<_> = ring_rejections().iter().map(SpanError::kind).collect();
    assert_eq!(kinds, ["wrong_epoch", "stale_generation", "unexpected_sequence", "frame_exceeds_slot"]);
}

#[test]
fn every_rejection_kind_has_a_test() {
    let mut seen: BTreeSet<&str> = fixtures().iter().filter_map(|f| f.verdict).collect();
    seen.extend(ring_rejections().iter().map(SpanError::kind));
    let all: BTreeSet<&str> = ALL_KINDS.iter().copied().collect();
    assert_eq!(seen, all, "every SpanError kind needs a fixture or a ring test");
}

#[test]
fn errors_name_expected_and_found() {
    for f in fixtures() {
        if let Err(e) = decode_frame(&f.bytes) {
            let msg = e.to_string();
            assert!(!msg.contains('\n'), "{}: one line: {msg}", f.name);
            assert!(msg.contains("expected"), "{}: names what was expected: {msg}", f.name);
        }
    }
}

/// Every single-bit flip, every truncation and an extension of each valid fixture is rejected, or accepted
/// with the same manifest and payload (never a panic).
#[test]
fn every_bit_flip_truncation_and_extension_is_rejected() {
    for f in fixtures().into_iter().filter(|f| f.verdict.is_none()) {
        let good = decode_frame(&f.bytes).unwrap();
        for bit in 0..f.bytes.len() * 8 {
            let mut b = f.bytes.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            if let Ok(span) = decode_frame(&b) {
                assert_eq!(
                    (span.manifest, span.payload),
                    (good.manifest.clone(), good.payload),
                    "{} bit {bit}",
                    f.name
                );
            }
        }
        for len in 0..f.bytes.len() {
            assert!(decode_frame(&f.bytes[..len]).is_err(), "{} truncated to {len}", f.name);
        }
        for extra in [1usize, 7, 64, 4096] {
            let mut b = f.bytes.clone();
            b.resize(b.len() + extra, 0);
            assert_eq!(decode_frame(&b).unwrap_err().kind(), "trailing_bytes");
        }
    }
}

/// The public halves of `decode_frame` that the ring reader calls on its own copy check their input's
/// length too: any other length is a typed error, never a slice panic (in release builds as in debug).
#[test]
fn decode_body_and_verify_prefix_refuse_a_wrong_length() {
    for f in fixtures().into_iter().filter(|f| f.verdict.is_none()) {
        let header = parse_header_prefix(&f.bytes).unwrap();
        let checksum = frame_checksum(&f.bytes);
        assert!(decode_body(header, &f.bytes, checksum).is_ok(), "{}", f.name);
        for len in [0, HEADER_LEN, header.payload_offset as usize - 1, f.bytes.len() - 1] {
            let e = decode_body(header, &f.bytes[..len], checksum).unwrap_err();
            assert_eq!(e, SpanError::Truncated { expected: header.frame_len, found: len as u64 }, "{}", f.name);
        }
        let longer = [&f.bytes[..], &[0u8; 8]].concat();
        assert_eq!(decode_body(header, &longer, checksum).unwrap_err().kind(), "trailing_bytes");
        let short = &f.bytes[..header.payload_offset as usize - 1];
        let e = verify_prefix(&header, short, checksum).unwrap_err();
        assert_eq!(e, SpanError::Truncated { expected: header.payload_offset, found: short.len() as u64 });
    }
}

fn arb_layer() -> impl Strategy<Value = LayerKv> {
    prop_oneof![
        (1u32..4, 1u32..6).prop_map(|(kv_heads, head_dim)| LayerKv::Full { kv_heads, head_dim }),
        (1u32..9, 1u32..4, 1u32..6).prop_map(|(window, kv_heads, head_dim)| LayerKv::Sliding {
            window,
            kv_heads,
            head_dim
        }),
        (1u64..20).prop_map(|state_elems| LayerKv::Recurrent { state_elems }),
    ]
}

fn arb_dtype() -> impl Strategy<Value = Dtype> {
    prop_oneof![Just(Dtype::F32), Just(Dtype::F16), Just(Dtype::Bf16)]
}

proptest! {
    #[test]
    fn grouped_spans_round_trip(
        layers in prop::collection::vec(arb_layer(), 1..12),
        start in 0u64..5000,
        len in 1u64..20,
        dtype in arb_dtype(),
        request in any::<u64>(),
        coords in any::<(u64, u64, u64)>(),
    ) {
        let g = KvGeometry { layers };
        let m = Manifest::grouped(&g, request, start..start + len, dtype);
        let payload = pattern(m.payload_len(), 3);
        let coords = FrameCoords { epoch: coords.0, generation: coords.1, sequence: coords.2 };
        let frame = encode_frame(&m, &payload, coords);
        let span = decode_frame(&frame).unwrap();
        prop_assert_eq!(&span.manifest, &m);
        prop_assert_eq!(span.payload, &payload[..]);
        prop_assert_eq!((span.header.producer_epoch, span.header.slot_generation, span.header.sequence),
            (coords.epoch, coords.generation, coords.sequence));
        for e in &m.entries {
            prop_assert_eq!(span.entry_bytes(e), &payload[e.offset as usize..(e.offset + e.len) as usize]);
        }
    }

    #[test]
    fn dense_spans_round_trip(
        num_layers in 1usize..30,
        kv_heads in 1u32..4,
        head_dim in 1u32..9,
        start in 0u64..5000,
        len in 1u64..10,
        dtype in arb_dtype(),
    ) {
        let g = KvGeometry { layers: vec![LayerKv::Full { kv_heads, head_dim }; num_layers] };
        let m = Manifest::dense(&g, 1, start..start + len, dtype).unwrap();
        let payload = pattern(m.payload_len(), 5);
        let frame = encode_frame(&m, &payload, FrameCoords::default());
        let span = decode_frame(&frame).unwrap();
        prop_assert_eq!(&span.manifest, &m);
        prop_assert_eq!(span.payload, &payload[..]);
    }

    /// Arbitrary byte edits anywhere in a valid frame: rejected or unchanged, never a panic.
    #[test]
    fn random_edits_never_panic(
        which in 0usize..3,
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let valid: Vec<_> = fixtures().into_iter().filter(|f| f.verdict.is_none()).collect();
        let f = &valid[which % valid.len()];
        let good = decode_frame(&f.bytes).unwrap();
        let mut b = f.bytes.clone();
        for (at, v) in edits {
            let i = at.index(b.len());
            b[i] = v;
        }
        if truncate {
            b.truncate(cut.index(b.len()));
        }
        if let Ok(span) = decode_frame(&b) {
            prop_assert_eq!(span.manifest, good.manifest.clone());
            prop_assert_eq!(span.payload, good.payload);
        }
    }

    /// Any bytes at all: the decoder returns, and what it accepts round-trips.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        fuzzing::decode(&bytes);
    }
}

/// Messages show no `Debug` structures and no decoder internals: magics as text (or hex), shapes as
/// `[3 x 2 x 4]`, postcard failures in words.
#[test]
fn errors_read_as_words() {
    for f in fixtures() {
        if let Err(e) = decode_frame(&f.bytes) {
            let msg = e.to_string();
            for debug in ["{", "Some(", "Hit the end", ", 2, 4]"] {
                assert!(!msg.contains(debug), "{}: {msg}", f.name);
            }
        }
    }
    let text = |name: &str| {
        let f = fixtures().into_iter().find(|f| f.name.starts_with(name)).unwrap();
        decode_frame(&f.bytes).unwrap_err().to_string()
    };
    assert_eq!(text("bad-magic"), "bad magic: expected \"PDKVSPAN\", found \"PDKVSPAM\"");
    assert_eq!(
        text("garbage-manifest"),
        "manifest does not decode: expected a v1 postcard manifest, found 10 bytes that do not decode as one \
         (an integer longer than its type)"
    );
    assert_eq!(text("rank-2-k"), "layer 0 k: expected rank 3, found shape [3 x 8]");
    let unprintable = SpanError::BadMagic { expected: *b"PDKVSPAN", found: [0x7f, b'E', b'L', b'F', 2, 1, 1, 0] };
    assert_eq!(
        unprintable.to_string(),
        "bad magic: expected \"PDKVSPAN\", found bytes 7f 45 4c 46 02 01 01 00 (\".ELF....\")"
    );
}
