//! Arbitrary bytes into the span decoder: it must never panic, hang or accept what it cannot reproduce.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    shm_format::fuzzing::decode(data);
});
