//! The pdhost library: what the `pdhost` binary is made of.
//!
//! - [`kv`]: the grouped paged KV cache and strict span ingest.
//! - [`engine`]: prefill, ingest and decode through the cache.
//! - [`request`]: every parameter a user or client gives, checked once, with typed refusals.
//! - [`server`]: `pdhost serve`, the OpenAI-compatible HTTP server (HTTP and JSON live only there).
//! - [`fuzzing`]: what the fuzz targets in `fuzz/` run against the cache.
//!
//! The wire format and the ring are re-exported as [`format`] and [`ring`]. The supervisor, models and
//! engine arrive with their issues (see `docs/ARCHITECTURE.md`).

pub mod engine;
pub mod fuzzing;
pub mod kv;
pub mod remote;
pub mod request;
pub mod server;
pub mod supervisor;
pub mod text;

pub use shm_format as format;
pub use shm_ring as ring;
