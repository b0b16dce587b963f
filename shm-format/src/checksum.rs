//! The frame checksum: XXH3-64, seed 0, over the whole frame with the 8 checksum bytes taken as zero.
//!
//! It guards against torn and corrupted writes (a producer killed mid-write, a stray store), not against a
//! malicious producer, who can always compute a valid checksum for garbage: that is what the structural
//! validation is for. `docs/decisions/0002-checksum-xxh3.md` records why XXH3 and not CRC-32C.

use std::hash::Hasher;

use twox_hash::XxHash3_64;

use crate::header::{CHECKSUM_OFFSET, HEADER_LEN};

/// Incremental checksum of one frame, fed the header first and then the rest of the frame in order.
#[derive(Clone)]
pub struct FrameHasher(Box<XxHash3_64>);

impl std::fmt::Debug for FrameHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameHasher").finish_non_exhaustive()
    }
}

impl FrameHasher {
    /// Starts a checksum with the fixed header; its checksum field is hashed as zero whatever it holds.
    pub fn new(header: &[u8; HEADER_LEN]) -> Self {
        let mut h = Box::new(XxHash3_64::with_seed(0));
        h.write(&header[..CHECKSUM_OFFSET]);
        h.write(&[0; 8]);
        h.write(&header[CHECKSUM_OFFSET + 8..]);
        FrameHasher(h)
    }

    /// Feeds the next bytes after the fixed header.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }

    /// The checksum.
    pub fn finish(&self) -> u64 {
        self.0.finish()
    }
}

/// The checksum of a whole frame held in one buffer (at least [`HEADER_LEN`] bytes).
pub fn frame_checksum(frame: &[u8]) -> u64 {
    let (header, rest) = frame.split_first_chunk::<HEADER_LEN>().expect("a frame holds a full header");
    let mut h = FrameHasher::new(header);
    h.update(rest);
    h.finish()
}

/// Computes the checksum of `frame` and stores it in its header. For writers.
pub fn seal_frame(frame: &mut [u8]) {
    let sum = frame_checksum(frame);
    frame[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 8].copy_from_slice(&sum.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_equals_one_shot_with_zeroed_field() {
        let mut frame: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        let with_garbage_field = frame_checksum(&frame);
        frame[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 8].fill(0);
        assert_eq!(with_garbage_field, XxHash3_64::oneshot(&frame));
        let mut h = FrameHasher::new(frame[..HEADER_LEN].try_into().unwrap());
        for chunk in frame[HEADER_LEN..].chunks(37) {
            h.update(chunk);
        }
        assert_eq!(h.finish(), with_garbage_field);
    }
}
