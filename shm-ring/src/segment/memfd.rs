//! Real shared memory: a sealed memfd, allocated and prefaulted before anyone else sees it.
//!
//! The host creates every segment. Both kinds are sealed against shrinking and growing (so a peer's
//! `ftruncate` cannot turn the host's accesses into SIGBUS) and against further sealing. The control
//! segment is also sealed with `F_SEAL_FUTURE_WRITE` *after* the host mapped it writable: the host's
//! mapping keeps working, but no new writable mapping, `write(2)` or `mprotect(PROT_WRITE)` can be made
//! through the descriptor, so a producer can only read it.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::{FallocateFlags, MemfdFlags, SealFlags};

use super::Segment;

/// Why a segment could not be created or mapped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SegmentError {
    /// A system call failed.
    #[error("{op} for segment {name} failed: {source}")]
    Os {
        /// What was being done.
        op: &'static str,
        /// The segment's name.
        name: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A received descriptor has the wrong size.
    #[error("segment {name}: expected {expected} bytes, found {found}")]
    SizeMismatch {
        /// The segment's name.
        name: String,
        /// The size the geometry needs.
        expected: u64,
        /// The descriptor's size.
        found: u64,
    },
    /// A received descriptor lacks a seal it must have.
    #[error("segment {name}: expected seals {}, found {}", seal_names(*expected), seal_names(*found))]
    MissingSeals {
        /// The segment's name.
        name: String,
        /// Seals required.
        expected: SealFlags,
        /// Seals present.
        found: SealFlags,
    },
}

/// Seals by their `fcntl` names, for messages: `F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW`, or `none`.
fn seal_names(seals: SealFlags) -> String {
    const NAMES: [(SealFlags, &str); 5] = [
        (SealFlags::SEAL, "F_SEAL_SEAL"),
        (SealFlags::SHRINK, "F_SEAL_SHRINK"),
        (SealFlags::GROW, "F_SEAL_GROW"),
        (SealFlags::WRITE, "F_SEAL_WRITE"),
        (SealFlags::FUTURE_WRITE, "F_SEAL_FUTURE_WRITE"),
    ];
    let mut names: Vec<String> =
        NAMES.iter().filter(|(flag, _)| seals.contains(*flag)).map(|(_, name)| (*name).to_string()).collect();
    let known = NAMES.iter().fold(SealFlags::empty(), |all, (flag, _)| all | *flag);
    let other = seals.bits() & !known.bits();
    if other != 0 {
        names.push(format!("unknown bits {other:#x}"));
    }
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join(" | ")
    }
}

/// Which side may write a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Writer {
    /// The host writes, the peer only reads (the control segment).
    Host,
    /// The peer writes, the host only reads (the data segment).
    Peer,
}

/// A mapped memfd.
#[derive(Debug)]
pub struct MemfdSegment {
    name: String,
    file: File,
    map: MmapRaw,
    writable: bool,
}

/// Seals every segment carries before a peer sees it.
pub const BASE_SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW).union(SealFlags::SEAL);

impl MemfdSegment {
    /// Host side: creates, allocates, prefaults, maps and seals a segment of `len` bytes. The host's
    /// mapping is writable for [`Writer::Host`] and read-only for [`Writer::Peer`].
    pub fn create(name: &str, len: usize, writer: Writer) -> Result<Self, SegmentError> {
        let os = |op| move |e: rustix::io::Errno| SegmentError::Os { op, name: name.to_string(), source: e.into() };
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(os("memfd_create"))?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(os("ftruncate"))?;
        // Allocate every page now, so neither side takes a fault that allocates, and a full tmpfs fails here
        // rather than as a SIGBUS in the middle of a copy.
        rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, len as u64).map_err(os("fallocate"))?;
        let file = File::from(fd);
        let writable = writer == Writer::Host;
        let map =
            map(&file, len, writable).map_err(|e| SegmentError::Os { op: "mmap", name: name.into(), source: e })?;
        let mut seals = BASE_SEALS;
        if writer == Writer::Host {
            // After our own writable mapping exists: it stays valid, new writable access is refused.
            seals |= SealFlags::FUTURE_WRITE;
        }
        rustix::fs::fcntl_add_seals(&file, seals).map_err(os("F_ADD_SEALS"))?;
        Ok(MemfdSegment { name: name.into(), file, map, writable })
    }

    /// Peer side: maps a received segment, checking its base seals, then its size. In that order: once
    /// sealed its size cannot change, so the size checked is the size mapped (no SIGBUS past a shrink).
    pub fn open(name: &str, fd: OwnedFd, expected_len: u64, writable: bool) -> Result<Self, SegmentError> {
        let os = |op| move |e: rustix::io::Errno| SegmentError::Os { op, name: name.to_string(), source: e.into() };
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(os("F_GET_SEALS"))?;
        if !seals.contains(BASE_SEALS) {
            return Err(SegmentError::MissingSeals { name: name.into(), expected: BASE_SEALS, found: seals });
        }
        let found = rustix::fs::fstat(&fd).map_err(os("fstat"))?.st_size as u64;
        if found != expected_len {
            return Err(SegmentError::SizeMismatch { name: name.into(), expected: expected_len, found });
        }
        let file = File::from(fd);
        let map = map(&file, expected_len as usize, writable).map_err(|e| SegmentError::Os {
            op: "mmap",
            name: name.into(),
            source: e,
        })?;
        Ok(MemfdSegment { name: name.into(), file, map, writable })
    }

    /// The descriptor, to hand to a peer.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// The segment's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The seals the descriptor carries.
    pub fn seals(&self) -> rustix::io::Result<SealFlags> {
        rustix::fs::fcntl_get_seals(&self.file)
    }
}

/// Maps `len` bytes shared, populating the page tables now (`MAP_POPULATE`) so the first copy takes no
/// faults.
fn map(file: &File, len: usize, writable: bool) -> std::io::Result<MmapRaw> {
    let mut opts = MmapOptions::new();
    opts.len(len).populate();
    if writable {
        opts.map_raw(file)
    } else {
        opts.map_raw_read_only(file)
    }
}

// SAFETY: `map` is a live mapping of exactly `len()` bytes owned by `self`, page-aligned (so 64-aligned),
// writable iff `writable` (mapped with PROT_WRITE only then).
unsafe impl Segment for MemfdSegment {
    fn base(&self) -> NonNull<u8> {
        NonNull::new(self.map.as_mut_ptr()).expect("mmap never returns null")
    }
    fn len(&self) -> usize {
        self.map.len()
    }
    fn writable(&self) -> bool {
        self.writable
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seals_are_named_as_fcntl_names_them() {
        assert_eq!(seal_names(BASE_SEALS), "F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW");
        assert_eq!(seal_names(SealFlags::empty()), "none");
        let e = SegmentError::MissingSeals {
            name: "pdhost-x-e1-data".into(),
            expected: BASE_SEALS,
            found: SealFlags::GROW,
        };
        assert_eq!(
            e.to_string(),
            "segment pdhost-x-e1-data: expected seals F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW, found F_SEAL_GROW"
        );
    }
}
