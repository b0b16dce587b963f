//! pdhost's integration tests, one binary (see `docs/ARCHITECTURE.md`, Testing).

mod ring_two_process;
