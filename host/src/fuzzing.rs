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
use crate::supervisor::{tamed, Producer, ProducerSpec, MAX_PRODUCER_TEXT};
use pdhost_producer::protocol::{recv, FromProducer, ToProducer, MAX_FROM_PRODUCER};

/// The request the spans must belong to.
const REQUEST: u64 = 7;
/// The sequence holds positions `0..HELD` before the fuzzed span arrives, its last page in part (pages of
/// 4): the host asks for `HELD..END`.
const HELD: u64 = 10;
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
/// Returns the cache's state hash after a span was taken, `None` when it was refused.
pub fn ingest(data: &[u8]) -> Option<u64> {
    let (&mode, rest) = data.split_first()?;
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

    let ring_geometry = RingGeometry::new(1, SLOT).expect("a ring geometry");
    let mut ring = create_ring("fuzz-ingest", ring_geometry, 5).expect("a memfd ring");
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
        slot_capacity: ring_geometry.frame_capacity(),
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
            let hash = kv.state_hash();
            assert_eq!(hash, private.state_hash(), "the ring committed other bytes than the frame's");
            Some(hash)
        }
        (Ok(None), _) => panic!("a committed slot was not seen"),
        (Err(e), Err(_)) => {
            assert_eq!(kv.state_hash(), before, "a rejected span ({e}) changed the cache");
            assert!(!e.to_string().contains('\n'), "one line: {e}");
            None
        }
        (Ok(Some(())), Err(why)) => panic!("the ring took a frame that fails in private memory ({why})"),
        (Err(e), Ok(())) => panic!("the ring refused a frame that passes in private memory: {e}"),
    }
}

/// The model identity the host holds in [`control_message`]'s handshake check.
const IDENTITY: &str = "weights:0123456789abcdef;tokenizer:fedcba9876543210;rope:1000000/10000";

/// Arbitrary bytes on the control socket, read as the host reads a producer's messages (a length prefix,
/// a bound, one postcard message) and as a producer reads the host's. A message from a producer is made
/// fit for the host's errors (`tamed`): its words are one line and bounded. A `Ready` goes through the
/// whole handshake check against the host's geometry and model identity: it passes only for exactly that
/// geometry and its fingerprint, and otherwise says why in one bounded line. Returns whether a `Ready`
/// passed (`None`: no `Ready`).
pub fn control_message(data: &[u8]) -> Option<bool> {
    let _ = recv::<ToProducer>(data, MAX_FROM_PRODUCER);
    let Ok(Some(message)) = recv::<FromProducer>(data, MAX_FROM_PRODUCER) else { return None };
    let message = tamed(message);
    // Every word of the producer's own: one line, of a bounded length (the cut says how long it was).
    let texts: Vec<&str> = match &message {
        FromProducer::Ready(d) => [Some(&d.backend), d.transport.as_ref(), d.identity.as_ref()]
            .into_iter()
            .flatten()
            .map(String::as_str)
            .collect(),
        FromProducer::StartFailed { stage, message, .. } => vec![stage, message],
        FromProducer::Unwritten { message, .. }
        | FromProducer::Failed { message, .. }
        | FromProducer::Remote { message, .. } => vec![message],
        FromProducer::Done { .. } => Vec::new(),
    };
    for text in texts {
        let fits = !text.chars().any(char::is_control) && text.chars().count() <= MAX_PRODUCER_TEXT + 32;
        assert!(fits, "a producer's text of {} chars reaches the host: {text:?}", text.chars().count());
    }
    let FromProducer::Ready(described) = message else { return None };
    let spec = ProducerSpec::unstarted("fuzz", Some(IDENTITY.into()));
    let ours = geometry();
    match Producer::new(spec, ours.clone()).check_described(&described) {
        Ok(()) => {
            assert_eq!(described.geometry().ok(), Some(ours.clone()), "a Ready of another geometry passed");
            assert_eq!(described.fingerprint, ours.fingerprint().0);
            Some(true)
        }
        Err(e) => {
            let text = e.to_string();
            assert!(!text.contains('\n') && text.len() <= 8192, "an error of {} bytes: {text:?}", text.len());
            Some(false)
        }
    }
}

/// One of each message, as the control socket carries them (`fuzz/seeds/control_message/`, named by
/// kind): a `Ready` of [`geometry`] that passes the handshake check, each reply, each of the host's
/// messages.
pub fn control_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use pdhost_producer::protocol::{send, PrefillCall, RemoteFailure};
    let framed = |m: &dyn Fn(&mut Vec<u8>) -> std::io::Result<()>| {
        let mut bytes = Vec::new();
        m(&mut bytes).expect("into memory");
        bytes
    };
    let text = "backend prefill: out of device memory".to_string();
    vec![
        ("ready", ready_message()),
        (
            "start-failed",
            framed(&|b| send(b, &FromProducer::StartFailed { stage: "open".into(), status: 3, message: text.clone() })),
        ),
        (
            "done",
            framed(&|b| {
                send(b, &FromProducer::Done { request_id: 7, sequence: 3, backend_ns: 1_500_000, frame_ns: 20_000 })
            }),
        ),
        ("unwritten", framed(&|b| send(b, &FromProducer::Unwritten { request_id: 7, message: text.clone() }))),
        ("failed", framed(&|b| send(b, &FromProducer::Failed { request_id: 7, status: 4, message: text.clone() }))),
        (
            "remote",
            framed(&|b| {
                send(
                    b,
                    &FromProducer::Remote { request_id: 7, failure: RemoteFailure::WrongSlot, message: text.clone() },
                )
            }),
        ),
        (
            "prefill",
            framed(&|b| {
                send(
                    b,
                    &ToProducer::Prefill(PrefillCall {
                        request_id: 7,
                        start_pos: 12,
                        tokens: vec![2, 100, 20, 30],
                        context: (0..12).collect(),
                    }),
                )
            }),
        ),
        ("release", framed(&|b| send(b, &ToProducer::Release { request_id: 7 }))),
        ("shutdown", framed(&|b| send(b, &ToProducer::Shutdown))),
    ]
}

/// What a producer of [`geometry`] says when it is ready.
pub fn ready_message() -> Vec<u8> {
    let g = geometry();
    let layers = g.layers.iter().map(pdhost_producer::protocol::LayerDesc::of).collect();
    let described = pdhost_producer::protocol::Described {
        backend: "rngd".into(),
        abi_minor: 2,
        layout: 1,
        dtype: 2,
        fingerprint: g.fingerprint().0,
        layers,
        identity: Some(IDENTITY.into()),
        ..Default::default()
    };
    let mut bytes = Vec::new();
    pdhost_producer::protocol::send(&mut bytes, &FromProducer::Ready(described)).expect("into memory");
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seeds_are_taken_and_their_mutations_refused_without_a_trace() {
        for (i, seed) in ingest_seeds().iter().enumerate() {
            let patched = |mode: u8, at: usize, byte: u8| {
                let [lo, hi] = u16::try_from(at).expect("a small frame").to_le_bytes();
                ingest(&[mode | (i as u8) << 1, lo, hi, byte])
            };
            // As they are: at other ring coordinates (all zero), refused; at the slot's, taken, whole or
            // patched with the byte already there.
            assert_eq!(ingest(&[[0u8].as_slice(), seed].concat()), None);
            let taken = ingest(&[[4u8].as_slice(), seed].concat()).expect("taken");
            assert_eq!(ingest(&[5 | (i as u8) << 1]), Some(taken));
            assert_eq!(patched(5, 0, seed[0]), Some(taken));
            // The payload's last byte changed and resealed: taken, and the cache holds the change.
            let last = seed.len() - 1;
            let other = patched(5, last, !seed[last]).expect("a payload byte is the producer's to choose");
            assert_ne!(other, taken);
            // Not resealed: the checksum fails (the payload's after its copy began).
            assert_eq!(patched(13, last, !seed[last]), None);
            // Resealed, but the magic or the major version changed: refused.
            assert_eq!(patched(5, 0, b'X'), None);
            assert_eq!(patched(5, 8, 9), None);
            // Anywhere else, the two paths agree (asserted inside).
            for at in (0..seed.len()).step_by(7) {
                patched(5, at, 0xA5);
            }
        }
        assert_eq!(ingest(&[]), None);
        assert_eq!(ingest(&[4, 1, 2, 3]), None);
    }

    /// The checked-in seeds are these (`PDHOST_WRITE_SEEDS=1` writes them anew): patches of nothing to
    /// each frame, and each whole frame at the slot's coordinates.
    #[test]
    fn the_ingest_seeds_are_todays_frames() {
        let dir = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/seeds/ingest_ring"));
        let frames = ingest_seeds();
        let seeds = [
            ("grouped", vec![5]),
            ("dense", vec![7]),
            ("grouped-frame", [[4u8].as_slice(), &frames[0]].concat()),
            ("dense-frame", [[4u8].as_slice(), &frames[1]].concat()),
        ];
        for (name, bytes) in seeds {
            let path = dir.join(name);
            if std::env::var_os("PDHOST_WRITE_SEEDS").is_some() {
                std::fs::write(&path, &bytes).unwrap();
            }
            assert!(ingest(&bytes).is_some(), "{name} is taken");
            let checked_in = std::fs::read(&path).unwrap_or_default();
            assert!(checked_in == bytes, "{}: not today's frame (PDHOST_WRITE_SEEDS=1 writes it)", path.display());
        }
    }

    #[test]
    fn a_ready_message_passes_the_handshake_check_and_its_mutations_say_why_not() {
        let ready = ready_message();
        let Ok(Some(FromProducer::Ready(d))) = recv::<FromProducer>(ready.as_slice(), MAX_FROM_PRODUCER) else {
            panic!("a Ready message")
        };
        assert_eq!(d.geometry().ok(), Some(geometry()));
        assert_eq!(control_message(&ready), Some(true));
        let mut refused = 0;
        for at in 4..ready.len() {
            for flip in [1u8, 0x80] {
                let mut bytes = ready.clone();
                bytes[at] ^= flip;
                refused += usize::from(control_message(&bytes) == Some(false));
            }
        }
        assert!(refused > ready.len() / 2, "most mutations of a Ready are refused: {refused}");
    }

    /// The checked-in seeds are this protocol's messages (`PDHOST_WRITE_SEEDS=1` writes them anew).
    #[test]
    fn the_control_message_seeds_are_todays_messages() {
        let dir = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/seeds/control_message"));
        for (name, bytes) in control_seeds() {
            let path = dir.join(name);
            if std::env::var_os("PDHOST_WRITE_SEEDS").is_some() {
                std::fs::write(&path, &bytes).unwrap();
            }
            let decodes = recv::<FromProducer>(bytes.as_slice(), MAX_FROM_PRODUCER).is_ok_and(|m| m.is_some())
                || recv::<ToProducer>(bytes.as_slice(), MAX_FROM_PRODUCER).is_ok_and(|m| m.is_some());
            assert!(decodes, "{name}");
            let checked_in = std::fs::read(&path).unwrap_or_default();
            assert!(checked_in == bytes, "{}: not today's message (PDHOST_WRITE_SEEDS=1 writes it)", path.display());
        }
        assert_eq!(control_message(&std::fs::read(dir.join("ready")).unwrap()), Some(true));
    }
}
