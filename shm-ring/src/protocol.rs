//! The slot protocol, written once over an abstract shared word so that the real ring and the `loom`
//! model in `tests/loom.rs` run the same code.
//!
//! Per slot there are two single-writer words: `grant`, written only by the host, and `commit`, written
//! only by the producer. Generations count from 1; a slot is the producer's while `grant > commit` and
//! the host's while `commit == grant`.

/// A shared 64-bit word, loaded with Acquire and stored with Release.
pub trait Word {
    /// Load with Acquire ordering.
    fn load_acquire(&self) -> u64;
    /// Store with Release ordering.
    fn store_release(&self, value: u64);
}

/// The host's view of a slot it awaits at generation `g`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// The producer has not committed generation `g` yet (`commit == g - 1`).
    Pending,
    /// The producer committed generation `g`; its writes before the commit are visible.
    Committed,
    /// The commit word holds neither `g - 1` nor `g`: the producer broke the protocol.
    Invalid {
        /// What the commit word held.
        found: u64,
    },
}

/// Host: what state the slot awaited at `generation` is in.
pub fn host_poll(commit: &impl Word, generation: u64) -> SlotState {
    match commit.load_acquire() {
        c if c == generation => SlotState::Committed,
        c if c.wrapping_add(1) == generation => SlotState::Pending,
        found => SlotState::Invalid { found },
    }
}

/// Host: after copying the frame out, the commit word must still say `generation`.
pub fn host_recheck(commit: &impl Word, generation: u64) -> Result<(), u64> {
    match commit.load_acquire() {
        c if c == generation => Ok(()),
        found => Err(found),
    }
}

/// Host: hands the slot back to the producer at the next generation, which it returns. Every read of
/// the frame must come before this call.
pub fn host_release(grant: &impl Word, generation: u64) -> u64 {
    let next = generation + 1;
    grant.store_release(next);
    next
}

/// Producer: the generation it may write the slot at, if the host has granted one it has not committed.
pub fn producer_grant(grant: &impl Word, last_commit: u64) -> Option<u64> {
    let g = grant.load_acquire();
    (g > last_commit).then_some(g)
}

/// Producer: publishes the frame written at `generation`. Every write of the frame must come before.
pub fn producer_commit(commit: &impl Word, generation: u64) {
    commit.store_release(generation);
}
