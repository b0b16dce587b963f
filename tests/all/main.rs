//! pdhost's integration tests, one binary (see `docs/ARCHITECTURE.md`, Testing).

mod ingest_ring;
mod ring_two_process;
