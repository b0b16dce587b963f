//! Transfers for producers on other machines (issue 15), over NIXL with its UCX backend: the first
//! part of that path, built and tested on its own.
//!
//! - [`Runtime`]: NIXL's runtime libraries, from the `nixl-cu12` wheel on the Python package registry,
//!   pinned by sha256 and unpacked into `$PDHOST_HOME/nixl/` once, then loaded into the process that
//!   calls NIXL.
//! - [`Endpoint`]: one NIXL agent with a UCX backend: memory registration, the metadata two agents
//!   exchange, a WRITE into a peer's registered memory with a notification, and the notifications
//!   received.
//! - [`ProtoLog`]: which UCX transport a WRITE took, as UCX reports its own protocol selection.
//!
//! The host's relay and the producer node (`pdhost::remote`) are built on it; docs/notes/nixl-sys-1.5.md
//! says what was measured. The whole crate is behind the `nixl` feature, so the default build needs no
//! libclang.

#![cfg(feature = "nixl")]

mod endpoint;
mod runtime;
mod transports;

pub use endpoint::{Endpoint, NixlFailure, Registration, Transfer};
pub use runtime::{Runtime, RuntimeError, REQUIREMENT, WHEEL_SHA256};
pub use transports::ProtoLog;
