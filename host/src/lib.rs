//! The pdhost library: what the `pdhost` binary is made of.
//!
//! For now it re-exports the wire format and the ring; the paged KV cache, ingest, supervisor and engine
//! arrive with their issues (see `docs/ARCHITECTURE.md`).

pub use shm_format as format;
pub use shm_ring as ring;
