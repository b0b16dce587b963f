//! Two processes on loopback, over UCX's TCP transport (`UCX_TLS=tcp`, so that the network path is what
//! is tested, and `UCX_NET_DEVICES=lo`, so that it is loopback alone): a WRITE lands exactly where it was sent, before its notification, and a WRITE outside the
//! receiver's registration is refused and lands nothing.

#![cfg(feature = "nixl")]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use sha2::{Digest, Sha256};

const PEER: &str = env!("CARGO_BIN_EXE_pdhost-nixl-peer");

/// The runtime, fetched once into the project's cache (the peers find it there).
fn home() -> String {
    let home = model::registry::home();
    pdhost_nixl::Runtime::fetch(&home).expect("fetching the NIXL runtime");
    home.display().to_string()
}

fn peer(args: &[&str]) -> Child {
    Command::new(PEER)
        .args(args)
        .env("UCX_TLS", "tcp")
        .env("UCX_NET_DEVICES", "lo")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// Runs a receiver of `len` bytes and a sender of `send_len` bytes at `at`; returns both outputs.
fn transfer(len: usize, at: usize, send_len: usize, note: &str) -> (Vec<String>, Vec<String>) {
    let home = home();
    let mut receiver = peer(&["receive", &home, &len.to_string(), "5000"]);
    let mut lines = BufReader::new(receiver.stdout.take().unwrap()).lines().map_while(Result::ok);
    let port = lines.next().and_then(|l| l.strip_prefix("port ").map(str::to_string)).expect("the receiver's port");
    let sender = peer(&["send", &home, &port, &at.to_string(), &send_len.to_string(), note]);
    let sent = sender.wait_with_output().unwrap();
    assert!(sent.status.success(), "sender: {}", sent.status);
    let received = results(lines);
    assert!(receiver.wait().unwrap().success(), "receiver failed");
    (received, results(String::from_utf8_lossy(&sent.stdout).lines().map(str::to_string)))
}

/// A peer's result lines, without their prefix (UCX writes its log to standard output too).
fn results(lines: impl Iterator<Item = String>) -> Vec<String> {
    lines.filter_map(|l| l.strip_prefix("result: ").map(str::to_string)).collect()
}

/// The sha256 of `len` bytes that are zero but for a sender's pattern at `at..at + send_len`.
fn expected(len: usize, at: usize, send_len: usize) -> String {
    let mut bytes = vec![0u8; len];
    for i in 0..send_len {
        bytes[at + i] = (i * 7 % 251) as u8 + 1;
    }
    Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn a_write_lands_exactly_where_it_was_sent_before_its_notification() {
    let (len, at, send_len) = (8 << 20, (1 << 20) + 3, (4 << 20) + 5);
    let (received, sent) = transfer(len, at, send_len, "epoch 7 frame 0 slot 1");
    assert_eq!(sent, ["sent"]);
    assert_eq!(
        received,
        ["notification sender epoch 7 frame 0 slot 1".to_string(), format!("sha256 {}", expected(len, at, send_len))]
    );
}

#[test]
fn a_write_past_the_receivers_registration_is_refused_and_lands_nothing() {
    let len = 1 << 20;
    let (received, sent) = transfer(len, len - 10, 20, "past the end");
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert!(sent[0].starts_with("refused: NIXL "), "{sent:?}");
    assert_eq!(received, ["no notification".to_string(), format!("sha256 {}", expected(len, 0, 0))]);
}
