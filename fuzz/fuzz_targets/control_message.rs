//! Arbitrary bytes on the control socket, as the host reads a producer's messages (and a producer the
//! host's): a length prefix, a bound, one postcard message and nothing after it. Decoding must end in a
//! message or a typed error, never a panic or an allocation past the bound.
#![no_main]

use pdhost_producer::protocol::{recv, FromProducer, ToProducer, MAX_FROM_PRODUCER};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = recv::<FromProducer>(data, MAX_FROM_PRODUCER);
    // The host's messages to a producer, under the same (smaller) bound.
    let _ = recv::<ToProducer>(data, MAX_FROM_PRODUCER);
    // A message that decodes is described in words without panicking.
    if let Ok(Some(m)) = recv::<FromProducer>(data, MAX_FROM_PRODUCER) {
        let _ = m.summary();
    }
});
