//! A producer-side test process for the ring: started by the integration tests with the ring descriptors
//! at fds 3..=6 (see `pdhost_tests::pass_ring_fds`).
//!
//! Modes:
//! - `write COUNT`: writes COUNT spans (`pdhost_tests::span_for(i)`) and exits 0.
//! - `crash-mid-write`: reserves a slot, writes half a frame, and aborts without committing.
//! - `attack`: tries every way to resize or write the host's control segment, prints one line per attempt
//!   (`NAME refused ERRNO` or `NAME allowed`), and exits 0.

use std::time::{Duration, Instant};

use shm_ring::RingWriter;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // SAFETY: started by `pass_ring_fds`; nothing else has claimed fds 3..=6.
    let fds = unsafe { pdhost_tests::take_ring_fds() };
    let deadline = || Instant::now() + Duration::from_secs(20);
    match args.first().map(String::as_str) {
        Some("write") => {
            let count: u64 = args[1].parse().expect("count");
            let mut ring = RingWriter::open(fds).expect("open ring");
            for i in 0..count {
                let (manifest, payload) = pdhost_tests::span_for(i);
                ring.write_span(&manifest, deadline(), |p| p.copy_from_slice(&payload)).expect("write span");
            }
        }
        Some("crash-mid-write") => {
            let mut ring = RingWriter::open(fds).expect("open ring");
            let (manifest, _) = pdhost_tests::span_for(0);
            let mut slot = ring.reserve(deadline()).expect("reserve");
            let info = slot.write_prefix(&manifest.encode(), manifest.payload_len()).expect("prefix");
            let frame = slot.frame_mut();
            frame[info.payload_offset as usize..][..(manifest.payload_len() / 2) as usize].fill(0xAB);
            std::process::abort();
        }
        Some("attack") => attack(),
        other => panic!("unknown mode {other:?}"),
    }
}

fn report(name: &str, rc: i64) {
    if rc < 0 {
        let err = std::io::Error::last_os_error();
        println!("{name} refused {}", err.raw_os_error().unwrap_or(0));
    } else {
        println!("{name} allowed");
    }
}

fn attack() {
    let [control, data, _, _] = pdhost_tests::RING_FDS;
    // SAFETY: plain system calls on descriptors this process owns, with pointers to live locals; every
    // mapping made is unmapped before return.
    unsafe {
        let size = |fd| {
            let mut st: libc::stat = std::mem::zeroed();
            libc::fstat(fd, &mut st);
            st.st_size
        };
        let len = size(control) as usize;
        report("control-shrink", libc::ftruncate(control, 0).into());
        report("control-grow", libc::ftruncate(control, (len * 2) as i64).into());
        report("control-fallocate-grow", libc::fallocate(control, 0, len as i64, 4096).into());
        report("data-shrink", libc::ftruncate(data, 0).into());
        report("data-grow", libc::ftruncate(data, size(data) * 2).into());
        report("control-write", libc::write(control, b"x".as_ptr().cast(), 1) as i64);
        report("control-pwrite", libc::pwrite(control, b"x".as_ptr().cast(), 1, 64) as i64);
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        let p = libc::mmap(std::ptr::null_mut(), len, rw, libc::MAP_SHARED, control, 0);
        report("control-mmap-shared-rw", if p == libc::MAP_FAILED { -1 } else { 0 });
        let p = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, control, 0);
        assert!(p != libc::MAP_FAILED, "read-only mapping must work");
        report("control-mprotect-rw", libc::mprotect(p, len, rw).into());
        libc::munmap(p, len);
        let path = std::ffi::CString::new(format!("/proc/self/fd/{control}")).unwrap();
        let reopened = libc::open(path.as_ptr(), libc::O_RDWR);
        if reopened >= 0 {
            let p = libc::mmap(std::ptr::null_mut(), len, rw, libc::MAP_SHARED, reopened, 0);
            report("control-reopen-mmap-rw", if p == libc::MAP_FAILED { -1 } else { 0 });
            report("control-reopen-write", libc::write(reopened, b"x".as_ptr().cast(), 1) as i64);
            libc::close(reopened);
        } else {
            report("control-reopen-rdwr", -1);
        }
        report("control-add-seal", libc::fcntl(control, libc::F_ADD_SEALS, libc::F_SEAL_WRITE).into());
        report("data-add-seal", libc::fcntl(data, libc::F_ADD_SEALS, libc::F_SEAL_WRITE).into());
        // A private copy-on-write mapping may be written, but the writes never reach the host's pages.
        let p = libc::mmap(std::ptr::null_mut(), len, rw, libc::MAP_PRIVATE, control, 0);
        if p != libc::MAP_FAILED {
            std::ptr::write_bytes(p.cast::<u8>(), 0xEE, len);
            libc::munmap(p, len);
            println!("control-private-cow-write private");
        } else {
            report("control-private-cow-write", -1);
        }
    }
}
