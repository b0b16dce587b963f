//! Arbitrary bytes as a GGUF model file: the reader, and what reads its metadata (the model's
//! configuration, tokenizer and chat template), must give an error, never a crash or an unbounded
//! allocation (libFuzzer's `-rss_limit_mb` and `-malloc_limit_mb` catch the latter).
#![no_main]

use std::io::Write;

use model::arch::Config;
use model::chat::ChatTemplate;
use model::gguf::Gguf;
use model::tokenizer::Tokenizer;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    // The reader maps a file: each input is written to one file per fuzzing process, in memory.
    let path = std::path::PathBuf::from(format!("/dev/shm/pdhost-fuzz-gguf-{}", std::process::id()));
    let mut file = std::fs::File::create(&path).expect("a file in /dev/shm");
    file.write_all(data).expect("written");
    drop(file);
    if let Ok(g) = Gguf::open(&path) {
        let _ = Config::from_gguf(&g);
        let _ = Tokenizer::from_gguf(&g);
        let _ = ChatTemplate::from_gguf(&g);
    }
    let _ = std::fs::remove_file(&path);
});
