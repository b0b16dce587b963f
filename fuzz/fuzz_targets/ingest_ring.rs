//! Arbitrary bytes as a producer's span in a real memfd ring slot, taken into a paged KV cache that holds
//! the sequence's first positions (`pdhost::fuzzing::ingest`): the take commits exactly what the same bytes
//! commit when decoded and checked in private memory, or fails and leaves the cache byte for byte as it
//! was.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    pdhost::fuzzing::ingest(data);
});
