//! Helpers shared by the integration tests and their child processes.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

/// The descriptor numbers a child finds its ring at: control, data, to-host doorbell, from-host doorbell.
pub const RING_FDS: [RawFd; 4] = [3, 4, 5, 6];

/// Arranges for `fds` to appear in the child as [`RING_FDS`], without `O_CLOEXEC`.
pub fn pass_ring_fds(cmd: &mut Command, fds: [BorrowedFd<'_>; 4]) {
    let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    // SAFETY: the closure runs in the forked child before exec and only makes the async-signal-safe
    // system calls fcntl and dup2; it allocates nothing. Sources are first duplicated above the target
    // range so that a source equal to a later target is not clobbered; dup2 clears O_CLOEXEC on targets.
    unsafe {
        cmd.pre_exec(move || {
            let mut moved = [0; 4];
            for (i, &fd) in raw.iter().enumerate() {
                moved[i] = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 64);
                if moved[i] < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            for (i, &fd) in moved.iter().enumerate() {
                if libc::dup2(fd, RING_FDS[i]) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// In the child: takes ownership of the ring descriptors at [`RING_FDS`].
///
/// # Safety
///
/// Call once, in a process started with [`pass_ring_fds`], before anything else claims those numbers.
pub unsafe fn take_ring_fds() -> [OwnedFd; 4] {
    // SAFETY: the caller guarantees the descriptors are open and owned by nobody else.
    RING_FDS.map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The `i`-th span the ring child writes: alternating dense and grouped layouts, varying lengths and
/// offsets, with a payload that depends on `i`.
pub fn span_for(i: u64) -> (shm_format::Manifest, Vec<u8>) {
    use shm_format::testing::{pattern, tiny_dense_geometry, tiny_gemma_geometry};
    use shm_format::{Dtype, Manifest};
    let tokens = i * 16..i * 16 + 1 + i % 13;
    let manifest = if i.is_multiple_of(2) {
        Manifest::dense(&tiny_dense_geometry(), i, tokens, Dtype::Bf16).expect("uniform heads")
    } else {
        Manifest::grouped(&tiny_gemma_geometry(), i, tokens, Dtype::F32)
    };
    let payload = pattern(manifest.payload_len(), i as u8);
    (manifest, payload)
}

/// Waits for `child` to exit, for at most `timeout`, by polling its pidfd; kills it if it does not.
pub fn wait_with_deadline(
    child: &mut std::process::Child,
    pidfd: BorrowedFd<'_>,
    timeout: std::time::Duration,
) -> std::process::ExitStatus {
    let mut fds = [rustix::event::PollFd::from_borrowed_fd(pidfd, rustix::event::PollFlags::IN)];
    let ts = rustix::event::Timespec { tv_sec: timeout.as_secs() as i64, tv_nsec: i64::from(timeout.subsec_nanos()) };
    let ready = rustix::event::poll(&mut fds, Some(&ts)).expect("poll pidfd");
    if ready == 0 {
        let _ = child.kill();
        let _ = child.wait();
        panic!("child {} did not exit within {timeout:?}", child.id());
    }
    child.wait().expect("wait")
}

/// A pidfd for a child, for liveness polling.
pub fn pidfd(child: &std::process::Child) -> OwnedFd {
    let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("nonzero pid");
    rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).expect("pidfd_open")
}
