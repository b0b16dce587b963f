//! Entry points for the fuzz targets in `fuzz/`. They must never panic, whatever the bytes.

use crate::{decode_frame, encode_frame, FrameCoords, HeaderInfo, RingExpectation, HEADER_LEN};

/// Decodes arbitrary bytes as a frame. If they decode, re-encoding the manifest and payload must give a
/// frame that decodes to the same thing (the decoder accepts nothing it cannot reproduce).
pub fn decode(data: &[u8]) {
    if let Ok(span) = decode_frame(data) {
        let h = &span.header;
        let coords = FrameCoords { epoch: h.producer_epoch, generation: h.slot_generation, sequence: h.sequence };
        let again = encode_frame(&span.manifest, span.payload, coords);
        let back = decode_frame(&again).expect("a re-encoded valid span decodes");
        assert_eq!(back.manifest, span.manifest);
        assert_eq!(back.payload, span.payload);
    }
    if let Some(prefix) = data.first_chunk::<HEADER_LEN>() {
        if let Ok(info) = HeaderInfo::parse(prefix) {
            // The ring's check against coordinates taken from the header itself passes exactly when the
            // frame fits the slot, and fails for any other epoch, generation or sequence.
            let expect = RingExpectation {
                producer_epoch: info.producer_epoch,
                slot_generation: info.slot_generation,
                sequence: info.sequence,
                slot_capacity: 1 << 20,
            };
            assert_eq!(expect.check(&info).is_ok(), info.frame_len <= expect.slot_capacity);
            for other in [
                RingExpectation { producer_epoch: info.producer_epoch.wrapping_add(1), ..expect },
                RingExpectation { slot_generation: info.slot_generation.wrapping_add(1), ..expect },
                RingExpectation { sequence: info.sequence.wrapping_add(1), ..expect },
            ] {
                assert!(other.check(&info).is_err(), "other ring coordinates must not pass");
            }
        }
    }
}

/// Reseals the checksum of arbitrary bytes before decoding them, so the fuzzer reaches the manifest
/// validator instead of stopping at the checksum almost every time.
pub fn decode_resealed(data: &[u8]) {
    let mut bytes = data.to_vec();
    if bytes.len() >= HEADER_LEN {
        crate::seal_frame(&mut bytes);
    }
    decode(&bytes);
}
