//! Arbitrary bytes with a valid checksum into the span decoder: this reaches the manifest validator.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    shm_format::fuzzing::decode_resealed(data);
});
