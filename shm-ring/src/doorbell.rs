//! Wake-ups between the two ends of a ring: an eventfd per direction, and waits that always end.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Instant;

use rustix::event::{EventfdFlags, PollFd, PollFlags};

/// One direction of wake-ups: [`Doorbell::ring`] on one side, [`wait`] on the other.
#[derive(Debug)]
pub struct Doorbell(OwnedFd);

/// What ended a [`wait`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Woken {
    /// The doorbell rang.
    Rang,
    /// The extra descriptor (a pidfd, say) became readable or hung up.
    Other,
    /// The deadline passed.
    TimedOut,
}

impl Doorbell {
    /// A new non-blocking eventfd.
    pub fn new() -> std::io::Result<Self> {
        Ok(Doorbell(rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?))
    }

    /// Wraps a received eventfd.
    pub fn from_fd(fd: OwnedFd) -> Self {
        Doorbell(fd)
    }

    /// A second handle on the same eventfd (for an in-process peer).
    pub fn try_clone(&self) -> std::io::Result<Self> {
        Ok(Doorbell(self.0.try_clone()?))
    }

    /// The descriptor, to hand to the peer.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }

    /// Adds one to the counter, waking a waiter. A full counter (2^64 - 2 rings) only means the peer is
    /// already awake.
    pub fn ring(&self) {
        let _ = rustix::io::write(&self.0, &1u64.to_ne_bytes());
    }

    /// Clears pending rings.
    fn drain(&self) {
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&self.0, &mut buf);
    }
}

/// Waits until `bell` rings, `other` (if any) becomes readable, or `deadline` passes. A ring is consumed;
/// the caller then re-checks the shared words, since a ring only says "look again".
pub fn wait(bell: &Doorbell, other: Option<BorrowedFd<'_>>, deadline: Instant) -> std::io::Result<Woken> {
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Ok(Woken::TimedOut);
        }
        let left = deadline - now;
        let timeout =
            rustix::event::Timespec { tv_sec: left.as_secs() as i64, tv_nsec: i64::from(left.subsec_nanos()) };
        let mut fds = vec![PollFd::new(&bell.0, PollFlags::IN)];
        if let Some(fd) = other {
            fds.push(PollFd::from_borrowed_fd(fd, PollFlags::IN));
        }
        match rustix::event::poll(&mut fds, Some(&timeout)) {
            Ok(0) => continue, // re-check the deadline
            Ok(_) => {
                let rang = !fds[0].revents().is_empty();
                let other_ready = fds.get(1).is_some_and(|f| !f.revents().is_empty());
                if rang {
                    bell.drain();
                    return Ok(Woken::Rang);
                }
                if other_ready {
                    return Ok(Woken::Other);
                }
            }
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}
