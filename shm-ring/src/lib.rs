//! The shared-memory ring of pdhost: sealed memfd segments, pipe doorbells, and both ends of the slot
//! protocol laid out by [`shm_format::ring`].
//!
//! The host end is [`RingReader`]: it creates every segment, reads each shared header word once into a
//! private copy, validates it against geometry it keeps privately, copies the frame out, checksums the
//! copy, and re-checks the header and the commit word. [`RingReader::try_take`] hands the span on only
//! then; [`RingReader::take_into`] hands the validated manifest and each copied chunk of payload to a
//! [`SpanSink`] as they come, and commits or aborts it only then. The producer end is [`RingWriter`].
//! All access to shared bytes goes through [`segment::Segment`] (and the fused copy-and-checksum kernel,
//! within a range the segment checked), which never forms a Rust reference over memory the other side can
//! write and reads it only with volatile loads.

mod copy;
pub mod doorbell;
pub mod protocol;
mod reader;
pub mod segment;
#[cfg(test)]
mod tests;
mod writer;

pub use copy::{FrameCopier, CHUNK_SLACK, COPY_CHUNK};
pub use reader::{create_ring, prefaulted, AsFdSegment, HostRing, RingError, RingReader, SpanSink, TakeError};
pub use writer::{RingWriter, SlotWriter, WriteError};
