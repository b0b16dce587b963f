//! Producers on other machines (issue 15): spans carried over NIXL (UCX) and taken exactly as from a
//! local ring.
//!
//! ```text
//!  host machine                                        | prefill machine
//!  host ── ring (sealed memfds, pidfd) ── relay ═══ TCP control ═══ node ── its own ring ── producer
//!                                           ▲                        │         (same ABI, same sandbox)
//!                                           └──── NIXL WRITE + notification (frame bytes into the slot)
//! ```
//!
//! - The [`relay`] (`pdhost __relay`) stands where a local producer stands: the supervisor starts it
//!   with the same ring, socket, pidfd, deadlines and restarts. It registers its writable mapping of the
//!   ring's data segment with NIXL, forwards control messages to the node over TCP, and commits a slot
//!   when the notification for the frame it awaits arrives. The host maps the data segment read-only
//!   and takes every frame through the same checks as a local producer's, so what the remote writer
//!   puts in that segment is judged as a local producer's frame is. The host process never loads NIXL.
//! - Trust: the host process is protected from the node as from a local producer. The relay is not:
//!   over RDMA the NIC confines a WRITE to the registered segment, but UCX's TCP transport applies a
//!   WRITE by copying to whatever address the request names, so a node that runs a modified NIXL can
//!   write anywhere in the relay (which holds the ring and no cache; it is unsandboxed, as NIXL needs
//!   its sockets and threads). The node, in turn, serves whoever connects: no authentication, and keys
//!   of the backend config it does not pin come from the relay. Run nodes on a network whose peers you
//!   trust, and pin `model` (and a Python backend's keys) with the node's `--backend-config`.
//! - The [`node`] (`pdhost producer-node`) runs on the prefill machine. Per connection it starts a
//!   producer exactly as the host's supervisor does, on a ring of its own at the epoch the relay's ring
//!   carries, so that frames carry the coordinates the host expects. That ring's data segment is
//!   registered with NIXL: each frame goes from the slot the backend wrote it in (its header checked
//!   first) into the relay's slot, in one WRITE with a
//!   [`FrameNotice`](pdhost_producer::protocol::FrameNotice) as the notification.
//! - A failure of the link ends the relay with a typed [`RemoteFailure`]
//!   (pdhost_producer::protocol::RemoteFailure); the supervisor restarts it with backoff, at a new
//!   epoch, so that a late WRITE of the old session lands in memory nobody reads.

#[cfg(feature = "nixl")]
pub mod node;
#[cfg(feature = "nixl")]
pub mod relay;

use std::net::SocketAddr;

/// Where a `--producer nixl://HOST:PORT/NAME` points: the node's control address and the backend it
/// is asked to run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeUrl {
    /// `HOST:PORT`, as written.
    pub addr: String,
    /// The backend's name on the node.
    pub backend: String,
}

impl NodeUrl {
    /// The form of a node's URL, in words.
    pub const EXPECTED: &'static str = "nixl://HOST:PORT/NAME (a producer node's address and the backend it runs)";

    /// Parses `nixl://HOST:PORT/NAME`; `None` if `text` is not that.
    pub fn parse(text: &str) -> Option<NodeUrl> {
        let (addr, backend) = text.strip_prefix("nixl://")?.split_once('/')?;
        let (host, port) = addr.rsplit_once(':')?;
        let port_ok = port.parse::<u16>().is_ok_and(|p| p > 0);
        let name_ok = !backend.is_empty() && backend.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c));
        (!host.is_empty() && port_ok && name_ok)
            .then(|| NodeUrl { addr: addr.to_string(), backend: backend.to_string() })
    }

    /// The first address `addr` resolves to.
    pub fn resolve(addr: &str) -> std::io::Result<SocketAddr> {
        use std::net::ToSocketAddrs;
        addr.to_socket_addrs()?.next().ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, format!("{addr}: expected an address, found none"))
        })
    }
}

/// A fault the node injects on purpose, for the tests of the host's side of the link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Fault {
    /// Closes the connection instead of sending the first frame.
    DropConnection,
    /// Exits the whole node while the first frame's transfer is in flight.
    Exit,
    /// Writes the first frame but sends no notification.
    NoNotification,
    /// Sends the first frame's notification without writing its bytes.
    NotificationOnly,
    /// Writes the first frame into the next slot and says so (a ring of one slot, which `generate`
    /// gives a prompt of one span, has no other: the fault needs a prompt of two spans or more).
    WrongSlot,
    /// Runs the session's producer at the epoch before the session's, so that every frame it writes is
    /// stale: a late frame of an earlier producer.
    StaleEpoch,
    /// Writes and announces only the first half of the first frame.
    Truncate,
    /// Writes the first frame, then overwrites the last 8 bytes of its payload with its first 8 (the
    /// header's magic) in a second WRITE that carries the notification, as a bad link might.
    Corrupt,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_urls_parse_or_are_refused() {
        assert_eq!(
            NodeUrl::parse("nixl://127.0.0.1:7000/rngd"),
            Some(NodeUrl { addr: "127.0.0.1:7000".into(), backend: "rngd".into() })
        );
        for bad in ["rngd", "nixl://127.0.0.1/rngd", "nixl://127.0.0.1:0/rngd", "nixl://h:7000/", "nixl://:7000/rngd"] {
            assert_eq!(NodeUrl::parse(bad), None, "{bad}");
        }
    }
}
