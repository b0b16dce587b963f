//! A real child process on the other end of a real memfd ring.

use std::os::fd::AsFd;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pdhost_tests::{pass_ring_fds, pidfd, span_for, wait_with_deadline};
use shm_format::ring::RingGeometry;
use shm_ring::segment::memfd::MemfdSegment;
use shm_ring::segment::Segment;
use shm_ring::{create_ring, HostRing, RingError};

const CHILD: &str = env!("CARGO_BIN_EXE_ring-child");

fn child(ring: &HostRing, args: &[&str]) -> Command {
    let mut cmd = Command::new(CHILD);
    cmd.args(args).stdin(Stdio::null());
    pass_ring_fds(&mut cmd, ring.peer_fds());
    cmd
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

#[test]
fn a_child_writes_spans_that_the_parent_validates_in_order() {
    let geometry = RingGeometry::new(4, 64 << 10).unwrap();
    let mut ring = create_ring("two-process", geometry, 7).unwrap();
    let mut proc = child(&ring, &["write", "100"]).spawn().unwrap();
    let pid = pidfd(&proc);
    for i in 0..100 {
        let span = ring.take(deadline(), Some(pid.as_fd())).unwrap_or_else(|e| panic!("span {i}: {e}"));
        let (manifest, payload) = span_for(i);
        assert_eq!(span.manifest, manifest, "span {i}");
        assert!(span.payload == payload, "span {i} payload");
        assert_eq!((span.header.producer_epoch, span.header.sequence), (7, i));
    }
    assert!(wait_with_deadline(&mut proc, pid.as_fd(), Duration::from_secs(20)).success());
}

#[test]
fn a_child_killed_mid_write_is_reported_as_exited_not_as_a_span() {
    let geometry = RingGeometry::new(2, 64 << 10).unwrap();
    let mut ring = create_ring("crash", geometry, 1).unwrap();
    let mut proc = child(&ring, &["crash-mid-write"]).stderr(Stdio::null()).spawn().unwrap();
    let pid = pidfd(&proc);
    let err = ring.take(deadline(), Some(pid.as_fd())).map(|_| ()).unwrap_err();
    assert!(matches!(err, RingError::PeerExited { sequence: 0 }), "{err}");
    assert!(!wait_with_deadline(&mut proc, pid.as_fd(), Duration::from_secs(20)).success());
    assert!(matches!(ring.try_take(), Err(RingError::Poisoned)));
}

#[test]
fn a_child_cannot_resize_or_write_the_control_segment() {
    let geometry = RingGeometry::new(2, 64 << 10).unwrap();
    let ring = create_ring("attack", geometry, 3).unwrap();
    let [control_fd, data_fd, ..] = ring.peer_fds();
    let control_len = geometry.control_len() as usize;
    let view = MemfdSegment::open("view", control_fd.try_clone_to_owned().unwrap(), control_len as u64, false).unwrap();
    let snapshot = |seg: &MemfdSegment| {
        let mut b = vec![0u8; control_len];
        seg.copy_out(0, &mut b);
        b
    };
    let before = snapshot(&view);

    let mut proc = child(&ring, &["attack"]).stdout(Stdio::piped()).spawn().unwrap();
    let pid = pidfd(&proc);
    let status = wait_with_deadline(&mut proc, pid.as_fd(), Duration::from_secs(20));
    let mut out = String::new();
    std::io::Read::read_to_string(&mut proc.stdout.take().unwrap(), &mut out).unwrap();
    assert!(status.success(), "attack child failed: {out}");

    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 14, "every attempt reports: {out}");
    for line in &lines {
        let ok = line.contains(" refused ") || *line == "control-private-cow-write private";
        assert!(ok, "the child got through: {line}\n{out}");
    }
    assert_eq!(snapshot(&view), before, "control segment bytes changed");
    let size = |fd| rustix::fs::fstat(fd).unwrap().st_size as u64;
    assert_eq!(size(control_fd), geometry.control_len());
    assert_eq!(size(data_fd), geometry.data_len());
}
