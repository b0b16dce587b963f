//! One side of a NIXL transfer between two processes, for the crate's loopback tests.
//!
//! `pdhost-nixl-peer receive HOME LEN TIMEOUT_MS`: registers LEN zeroed bytes, prints `port P`, sends a
//! connecting sender its metadata and the memory's address, waits for one notification, then prints
//! `result: notification <sender> <payload>` (or `result: no notification`) and
//! `result: sha256 <hex of the LEN bytes>`.
//!
//! `pdhost-nixl-peer send HOME PORT AT LEN NOTE`: writes LEN bytes of a fixed pattern (`pattern`) at AT in
//! the receiver's memory with NOTE as the notification; prints `result: sent` or `result: refused: <why>`.
//!
//! UCX logs to standard output too, hence the `result: ` prefix.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use pdhost_nixl::{Endpoint, Runtime};
use sha2::{Digest, Sha256};

/// Byte `i` of what a sender writes.
fn pattern(i: usize) -> u8 {
    (i * 7 % 251) as u8 + 1
}

/// `len` bytes of private anonymous memory, zeroed by the kernel.
fn mapped(len: usize) -> *mut u8 {
    // SAFETY: a fresh private anonymous mapping; checked below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert!(p != libc::MAP_FAILED, "mmap of {len} bytes failed");
    p.cast()
}

fn arg<T: std::str::FromStr>(args: &[String], i: usize) -> T {
    args.get(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("argument {i}: expected a value, found {:?}", args.get(i)))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let runtime = Runtime::fetch(Path::new(&args[2])).expect("the NIXL runtime");
    runtime.load().expect("loading the NIXL runtime");
    match args[1].as_str() {
        "receive" => receive(arg(&args, 3), Duration::from_millis(arg(&args, 4))),
        "send" => send(arg(&args, 3), arg(&args, 4), arg(&args, 5), &args[6]),
        other => panic!("expected receive or send, found {other}"),
    }
}

fn receive(len: usize, timeout: Duration) -> ExitCode {
    let endpoint = Endpoint::new("receiver").expect("endpoint");
    let memory = mapped(len);
    // SAFETY: `memory` is this process's own mapping, never unmapped, and read below only with volatile
    // loads once the notification (or the deadline) has come.
    let registration = unsafe { endpoint.register(memory, len) }.expect("register");
    let metadata = endpoint.metadata().expect("metadata");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    println!("port {}", listener.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let (mut socket, _) = listener.accept().unwrap();
    socket.write_all(&(metadata.len() as u64).to_le_bytes()).unwrap();
    socket.write_all(&metadata).unwrap();
    socket.write_all(&registration.addr().to_le_bytes()).unwrap();
    let deadline = Instant::now() + timeout;
    let mut got = None;
    while got.is_none() && Instant::now() < deadline {
        got = endpoint.notifications().expect("notifications").into_iter().next();
        std::thread::sleep(Duration::from_millis(1));
    }
    match got {
        Some((sender, payload)) => println!("result: notification {sender} {}", String::from_utf8_lossy(&payload)),
        None => println!("result: no notification"),
    }
    let mut sha = Sha256::new();
    for i in 0..len {
        // SAFETY: within the mapping; a volatile load, as of memory a peer may write.
        sha.update([unsafe { memory.add(i).read_volatile() }]);
    }
    println!("result: sha256 {}", sha.finalize().iter().map(|b| format!("{b:02x}")).collect::<String>());
    drop(registration);
    ExitCode::SUCCESS
}

fn send(port: u16, at: u64, len: usize, note: &str) -> ExitCode {
    let endpoint = Endpoint::new("sender").expect("endpoint");
    let memory = mapped(len);
    for i in 0..len {
        // SAFETY: within this process's own mapping, before it is registered.
        unsafe { memory.add(i).write(pattern(i)) };
    }
    // SAFETY: this process's own mapping, never unmapped; nothing else writes it.
    let registration = unsafe { endpoint.register(memory, len) }.expect("register");
    let mut socket = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut word = [0u8; 8];
    socket.read_exact(&mut word).unwrap();
    let mut metadata = vec![0u8; u64::from_le_bytes(word) as usize];
    socket.read_exact(&mut metadata).unwrap();
    socket.read_exact(&mut word).unwrap();
    let base = u64::from_le_bytes(word);
    let peer = endpoint.add_peer(&metadata).expect("peer metadata");
    let transfer = match endpoint.write(&peer, &registration, 0, base + at, len, note.as_bytes()) {
        Ok(t) => t,
        Err(e) => {
            println!("result: refused: {e}");
            return ExitCode::SUCCESS;
        }
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match transfer.done() {
            Ok(true) => break,
            Ok(false) if Instant::now() < deadline => std::thread::sleep(Duration::from_micros(100)),
            Ok(false) => {
                println!("result: refused: not done after 30 s");
                return ExitCode::FAILURE;
            }
            Err(e) => {
                println!("result: refused: {e}");
                return ExitCode::SUCCESS;
            }
        }
    }
    println!("result: sent");
    ExitCode::SUCCESS
}
