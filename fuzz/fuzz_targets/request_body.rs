//! Arbitrary bytes as the body of `POST /v1/completions` and `POST /v1/chat/completions`: each is a
//! request or an OpenAI-style client error (4xx) whose message is one line, never a panic.
#![no_main]

use pdhost::server::api::Completion;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    for parsed in [Completion::parse(data), Completion::parse_chat(data)] {
        if let Err(e) = parsed {
            assert!(e.status.is_client_error(), "status {} for a body", e.status);
            assert!(!e.message.is_empty() && !e.message.contains('\n'), "message {:?}", e.message);
        }
    }
});
