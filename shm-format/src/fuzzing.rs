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
            let expect = RingExpectation { producer_epoch: 1, slot_generation: 1, sequence: 0, slot_capacity: 1 << 20 };
            let _ = expect.check(&info);
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
