//! Wake-ups between the two ends of a ring: a pipe per direction, and waits that always end.
//!
//! A pipe, not an eventfd: an eventfd is one open file description, shared by every process that holds
//! it, so its `O_NONBLOCK` is the producer's to clear as much as the host's. A producer that cleared it
//! and filled the counter (`2^64 - 2`) would make the host's next ring block forever, outside every
//! deadline. A pipe's two ends are two descriptions: each side sets the flags of its own end only.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Instant;

use rustix::event::{PollFd, PollFlags};
use rustix::pipe::PipeFlags;

/// One end of a direction of wake-ups: [`Doorbell::ring`] on the write end, [`wait`] on the read end.
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
    /// Every ringing end is closed: no ring will come (the peer is gone).
    Closed,
}

impl Doorbell {
    /// A new direction: its ringing end and its waiting end, both non-blocking.
    pub fn pair() -> std::io::Result<(Doorbell, Doorbell)> {
        let (read, write) = rustix::pipe::pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK)?;
        Ok((Doorbell(write), Doorbell(read)))
    }

    /// Wraps a received end. It is made non-blocking here: its description is this process's alone.
    pub fn from_fd(fd: OwnedFd) -> std::io::Result<Self> {
        let flags = rustix::fs::fcntl_getfl(&fd)?;
        rustix::fs::fcntl_setfl(&fd, flags | rustix::fs::OFlags::NONBLOCK)?;
        Ok(Doorbell(fd))
    }

    /// The descriptor, to hand to the peer.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }

    /// Writes one byte, waking a waiter. A full pipe (64 KiB of rings not yet waited for) only means the
    /// peer has rings pending; the write then fails at once and is dropped.
    pub fn ring(&self) {
        let _ = rustix::io::write(&self.0, &[1]);
    }

    /// Clears pending rings (the read end never blocks). At most 4096 reads of 256 bytes, a pipe of
    /// 1 MiB: a peer that refills the pipe as fast as it is read cannot hold a waiter here past its
    /// deadline (what is left only wakes the next wait early, which then looks again).
    fn drain(&self) {
        let mut buf = [0u8; 256];
        for _ in 0..4096 {
            match rustix::io::read(&self.0, &mut buf) {
                Ok(n) if n == buf.len() => {}
                _ => break,
            }
        }
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
                let bell_events = fds[0].revents();
                let other_ready = fds.get(1).is_some_and(|f| !f.revents().is_empty());
                if bell_events.contains(PollFlags::IN) {
                    bell.drain();
                    return Ok(Woken::Rang);
                }
                if other_ready {
                    return Ok(Woken::Other);
                }
                if !bell_events.is_empty() {
                    return Ok(Woken::Closed);
                }
            }
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a hostile producer can do to a descriptor it holds: clear `O_NONBLOCK`.
    fn made_blocking(fd: BorrowedFd<'_>) -> OwnedFd {
        let peer = fd.try_clone_to_owned().unwrap();
        let flags = rustix::fs::fcntl_getfl(&peer).unwrap();
        rustix::fs::fcntl_setfl(&peer, flags - rustix::fs::OFlags::NONBLOCK).unwrap();
        peer
    }

    /// The host's ends stay non-blocking whatever the producer does to its own: ringing a full pipe
    /// that nobody reads, and draining an empty one, both return at once (with an eventfd, one
    /// description for both processes, the first blocked forever).
    #[test]
    fn the_peer_cannot_make_the_hosts_ends_block() {
        let (to_peer, peer_waits) = Doorbell::pair().unwrap();
        let (peer_rings, from_peer) = Doorbell::pair().unwrap();
        let _peer = [made_blocking(peer_waits.fd()), made_blocking(peer_rings.fd())];
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // Far more rings than a pipe holds, none waited for.
            for _ in 0..(1 << 18) {
                to_peer.ring();
            }
            from_peer.drain();
            done.send(()).unwrap();
        });
        finished.recv_timeout(std::time::Duration::from_secs(20)).expect("a ring or a drain blocked");
    }

    /// A closed ringing end ends a wait at once, rather than spinning to the deadline.
    #[test]
    fn a_wait_ends_when_the_ringing_end_is_gone() {
        let (rings, waits) = Doorbell::pair().unwrap();
        drop(rings);
        let deadline = Instant::now() + std::time::Duration::from_secs(20);
        assert_eq!(wait(&waits, None, deadline).unwrap(), Woken::Closed);
    }
}
