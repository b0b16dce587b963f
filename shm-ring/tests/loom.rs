//! A `loom` model of the slot and generation protocol.
//!
//! The model runs the crate's own protocol functions over loom atomics, with the slot's frame as a
//! `loom::cell::UnsafeCell`: loom explores every interleaving and fails if the host could read the frame
//! while the producer writes it (a data race), or read a frame other than the one committed.

use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicU64;
use loom::sync::Arc;
use shm_ring::protocol::{self, SlotState, Word};
use std::sync::atomic::Ordering;

struct LoomWord(AtomicU64);

impl Word for LoomWord {
    fn load_acquire(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
    fn store_release(&self, value: u64) {
        self.0.store(value, Ordering::Release)
    }
}

/// One slot: the host's grant word, the producer's commit word, and a two-word frame
/// (generation, payload) that the producer writes non-atomically.
struct Slot {
    grant: LoomWord,
    commit: LoomWord,
    frame: UnsafeCell<(u64, u64)>,
}

impl Slot {
    fn new() -> Arc<Self> {
        // The host grants generation 1 before the producer starts.
        Arc::new(Slot {
            grant: LoomWord(AtomicU64::new(1)),
            commit: LoomWord(AtomicU64::new(0)),
            frame: UnsafeCell::new((0, 0)),
        })
    }
}

const ROUNDS: u64 = 2;

fn producer(slot: &Slot) {
    let mut last = 0;
    for round in 0..ROUNDS {
        let g = loop {
            if let Some(g) = protocol::producer_grant(&slot.grant, last) {
                break g;
            }
            loom::thread::yield_now();
        };
        assert_eq!(g, round + 1, "generations are granted in order");
        slot.frame.with_mut(|f| {
            // SAFETY: the slot is the producer's between grant and commit; loom checks exactly this claim.
            unsafe { *f = (g, 100 + round) }
        });
        protocol::producer_commit(&slot.commit, g);
        last = g;
    }
}

#[test]
fn host_reads_each_committed_frame_whole_and_race_free() {
    loom::model(|| {
        let slot = Slot::new();
        let p = {
            let slot = slot.clone();
            loom::thread::spawn(move || producer(&slot))
        };
        let mut generation = 1;
        for round in 0..ROUNDS {
            loop {
                match protocol::host_poll(&slot.commit, generation) {
                    SlotState::Committed => break,
                    SlotState::Pending => loom::thread::yield_now(),
                    SlotState::Invalid { found } => panic!("invalid commit {found}"),
                }
            }
            let frame = slot.frame.with(|f| {
                // SAFETY: the slot is the host's between commit and release; loom checks exactly this claim.
                unsafe { *f }
            });
            assert_eq!(frame, (generation, 100 + round), "the host sees exactly the committed frame");
            assert_eq!(protocol::host_recheck(&slot.commit, generation), Ok(()));
            generation = protocol::host_release(&slot.grant, generation);
        }
        p.join().unwrap();
    });
}

#[test]
fn a_producer_that_skips_a_generation_is_seen_as_invalid() {
    loom::model(|| {
        let slot = Slot::new();
        let p = {
            let slot = slot.clone();
            // A broken producer commits generation 3, which was never granted.
            loom::thread::spawn(move || protocol::producer_commit(&slot.commit, 3))
        };
        let state = protocol::host_poll(&slot.commit, 1);
        assert!(matches!(state, SlotState::Pending | SlotState::Invalid { found: 3 }), "{state:?}");
        p.join().unwrap();
        assert_eq!(protocol::host_poll(&slot.commit, 1), SlotState::Invalid { found: 3 });
    });
}
