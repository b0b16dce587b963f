//! Arbitrary bytes on the control socket (`pdhost::fuzzing::control_message`), as the host reads a
//! producer's messages and a producer the host's: a length prefix, a bound, one postcard message and
//! nothing after it. Decoding ends in a message or a typed error, never a panic or an allocation past the
//! bound; a producer's words reach the host as one bounded line; a `Ready` passes the handshake check
//! only for the host's own geometry, and otherwise says why in one line.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    pdhost::fuzzing::control_message(data);
});
