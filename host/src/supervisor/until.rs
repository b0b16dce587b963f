//! A stream with one deadline over a whole message: each read or write waits at most what is left of
//! it, so a peer that dribbles a message a byte at a time, or stops reading what it is sent, runs out of
//! time as a silent one does (a socket timeout alone bounds each call, not the message). The control
//! socket to a producer, and a producer node's connection while it waits for a relay's hello.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// A socket whose reads and writes take a timeout.
pub(crate) trait Timed
where
    for<'s> &'s Self: Read + Write,
{
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()>;
    fn set_write_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()>;
}

impl Timed for UnixStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        UnixStream::set_read_timeout(self, timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        UnixStream::set_write_timeout(self, timeout)
    }
}

impl Timed for TcpStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_write_timeout(self, timeout)
    }
}

/// `socket`, every read and write of it bounded by `deadline`.
pub(crate) struct Until<'a, S> {
    socket: &'a S,
    deadline: Instant,
}

impl<'a, S> Until<'a, S> {
    pub(crate) fn new(socket: &'a S, deadline: Instant) -> Self {
        Until { socket, deadline }
    }

    /// What is left of the deadline, or the error that says it passed.
    fn left(&self) -> std::io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        Ok(left)
    }
}

/// Whether `e` says an [`Until`]'s deadline passed.
pub(crate) fn ran_out(e: &std::io::Error) -> bool {
    matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
}

impl<S: Timed> Read for Until<'_, S>
where
    for<'s> &'s S: Read + Write,
{
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.socket.set_read_timeout(Some(self.left()?))?;
        (&mut &*self.socket).read(buf)
    }
}

impl<S: Timed> Write for Until<'_, S>
where
    for<'s> &'s S: Read + Write,
{
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.socket.set_write_timeout(Some(self.left()?))?;
        (&mut &*self.socket).write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
