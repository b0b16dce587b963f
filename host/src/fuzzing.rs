//! Entry points for the fuzz targets in `fuzz/` that need the host's cache. They must never panic,
//! whatever the bytes; the unit tests below run them on the frames they start from.

use std::time::{Duration, Instant};

use shm_format::ring::RingGeometry;
use shm_format::testing::{interleaved, pattern};
use shm_format::{
    decode_frame, encode_frame, seal_frame, Dtype, FrameCoords, HeaderInfo, KvGeometry, Manifest, RingExpectation,
    HEADER_LEN,
};
use shm_ring::{create_ring, RingWriter};

use crate::kv::{IntoSequence, KvConfig, PagedKv, SeqId};

/// The request the spans must belong to.
const REQUEST: u64 = 7;
/// The sequence holds positions `0..HELD` before the fuzzed span arrives; the host asks for `HELD..END`.
const HELD: u64 = 12;
const END: u64 = 20;
/// Ring slot capacity: room for every frame the host would ask for here, and for a mutated one a few
/// times larger.
const SLOT: u64 = 64 << 10;
/// Where the ring coordinates lie in the header (epoch, generation, sequence): its last three words.
const COORDS: usize = HEADER_LEN - 24;

/// A small model with both kinds of attention group: 4 layers, every second one full, an 8-token window
/// (shorter than what the sequence holds, so the window drops pages), 2 KV heads of 8.
fn geometry() -> KvGeometry {
    interleaved(4, 2, 8, 2, 8)
}

/// The frames a producer of [`geometry`] would send for `HELD..END` of [`REQUEST`], dense and grouped, in
/// bf16 (the wire dtype the host expects), at all-zero ring coordinates.
pub fn ingest_seeds() -> Vec<Vec<u8>> {
    let g = geometry();
    let grouped = Manifest::grouped(&g, REQUEST, HELD..END, Dtype::Bf16);
    let dense = Manifest::dense(&g, REQUEST, HELD..END, Dtype::Bf16).expect("uniform heads");
    [grouped, dense]
        .iter()
        .enumerate()
        .map(|(i, m)| encode_frame(m, &pattern(m.payload_len(), i as u8 + 3), FrameCoords::default()))
        .collect()
}

/// A cache whose sequence holds `0..HELD` of [`REQUEST`], taken from a ring as a producer's span is.
fn cache_holding_a_prefix() -> PagedKv {
    let g = geometry();
    let mut config = KvConfig::new(g.clone(), Dtype::Bf16, 1 << 20);
    config.page_size = 4;
    let mut kv = PagedKv::new(config).expect("a small cache");
    kv.add_sequence(SeqId(1), REQUEST).expect("a new sequence");
    let first = Manifest::grouped(&g, REQUEST, 0..HELD, Dtype::Bf16);
    let frame = encode_frame(&first, &pattern(first.payload_len(), 1), FrameCoords::default());
    let span = decode_frame(&frame).expect("a valid frame");
    kv.write_span(SeqId(1), &span).expect("the first span fits");
    kv
}

/// Arbitrary bytes as the frame in a real memfd ring slot, taken into a cache that holds a sequence's
/// first positions, the host asking for the next ones. The input's first byte picks how the rest is
/// read: as a whole frame, or as `(offset, byte)` patches (three bytes each) to one of [`ingest_seeds`];
/// whether the ring coordinates of the slot are written into the header; and then whether the checksum
/// is resealed, which lets mutations reach the manifest and the cache's own checks.
///
/// Must hold: the take commits exactly what the same bytes, decoded in private memory and checked
/// against the same ring coordinates, geometry, request and range, commit into a second such cache; or it
/// fails with an error and the cache is byte for byte as before (its state hash), as is the second one.
/// Returns whether the span was taken.
pub fn ingest(data: &[u8]) -> bool {
    let Some((&mode, rest)) = data.split_first() else { return false };
    let mut frame = if mode & 1 == 0 {
        rest.to_vec()
    } else {
        let seeds = ingest_seeds();
        let mut frame = seeds[usize::from(mode >> 1 & 1)].clone();
        for patch in rest.chunks_exact(3) {
            let at = usize::from(u16::from_le_bytes([patch[0], patch[1]])) % frame.len();
            frame[at] = patch[2];
        }
        frame
    };

    let mut ring =
        create_ring("fuzz-ingest", RingGeometry::new(1, SLOT).expect("a ring geometry"), 5).expect("a memfd ring");
    let fds = ring.peer_fds().map(|fd| fd.try_clone_to_owned().expect("a descriptor"));
    let mut writer = RingWriter::open(fds).expect("the producer's side");
    let mut slot = writer.reserve(Instant::now() + Duration::from_secs(1)).expect("a free slot");
    let coords = slot.coords();
    if mode & 4 != 0 && frame.len() >= HEADER_LEN {
        for (i, word) in [coords.epoch, coords.generation, coords.sequence].into_iter().enumerate() {
            frame[COORDS + 8 * i..COORDS + 8 * (i + 1)].copy_from_slice(&word.to_le_bytes());
        }
        if mode & 8 == 0 {
            seal_frame(&mut frame);
        }
    }
    let dest = slot.frame_mut();
    let n = frame.len().min(dest.len());
    dest[..n].copy_from_slice(&frame[..n]);
    slot.commit();

    let mut kv = cache_holding_a_prefix();
    let before = kv.state_hash();
    let taken = ring.take_into(&mut IntoSequence { kv: &mut kv, seq: SeqId(1), end: END, dtype: Dtype::Bf16 });

    // The same bytes in private memory, checked as the ring and the host check them.
    let mut private = cache_holding_a_prefix();
    let expect = RingExpectation {
        producer_epoch: coords.epoch,
        slot_generation: coords.generation,
        sequence: coords.sequence,
        slot_capacity: SLOT,
    };
    let committed = (|| {
        let prefix = frame.first_chunk::<HEADER_LEN>().ok_or("short")?;
        let info = HeaderInfo::parse(prefix).map_err(|_| "header")?;
        expect.check(&info).map_err(|_| "coordinates")?;
        let bytes = frame.get(..usize::try_from(info.frame_len).map_err(|_| "length")?).ok_or("length")?;
        let span = decode_frame(bytes).map_err(|_| "frame")?;
        let mut staged =
            private.prepare_ending(SeqId(1), &span.manifest, END, Dtype::Bf16).map_err(|_| "the cache's checks")?;
        private.write_staged(&mut staged, 0, span.payload);
        private.commit(staged);
        Ok::<_, &str>(())
    })();

    match (taken, committed) {
        (Ok(Some(())), Ok(())) => {
            assert_eq!(kv.seq_len(SeqId(1)), Some(END));
            assert_eq!(kv.state_hash(), private.state_hash(), "the ring committed other bytes than the frame's");
            true
        }
        (Ok(None), _) => panic!("a committed slot was not seen"),
        (Err(e), Err(_)) => {
            assert_eq!(kv.state_hash(), before, "a rejected span ({e}) changed the cache");
            assert!(!e.to_string().contains('\n'), "one line: {e}");
            false
        }
        (Ok(Some(())), Err(why)) => panic!("the ring took a frame that fails in private memory ({why})"),
        (Err(e), Ok(())) => panic!("the ring refused a frame that passes in private memory: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seeds_are_taken_and_their_mutations_refused_without_a_trace() {
        for (i, seed) in ingest_seeds().iter().enumerate() {
            // As they are: other ring coordinates (all zero), refused.
            assert!(!ingest(&[[0u8].as_slice(), seed].concat()));
            // With the slot's coordinates: taken, as in private memory.
            assert!(ingest(&[[4u8].as_slice(), seed].concat()));
            assert!(ingest(&[5 | (i as u8) << 1]), "the seed unpatched");
            // One byte of the header, the manifest or the payload changed: refused at other coordinates;
            // at the slot's, resealed, the two paths must agree whatever it changed.
            for at in [0u16, 9, 20, 41, 70, 100, 400, 1000] {
                let [lo, hi] = at.to_le_bytes();
                assert!(!ingest(&[1 | (i as u8) << 1, lo, hi, 0xA5]), "patched at {at}");
                ingest(&[5 | (i as u8) << 1, lo, hi, 0xA5]);
                // Not resealed: the checksum fails, whatever byte changed (the first of the payload
                // only after its copy began).
                let changed = ingest_seeds()[i][usize::from(at)] != 0xA5;
                assert!(!changed || !ingest(&[13 | (i as u8) << 1, lo, hi, 0xA5]), "patched at {at}");
            }
        }
        assert!(!ingest(&[]));
        assert!(!ingest(&[4, 1, 2, 3]));
    }
}
