//! Arbitrary text through both real models' tokenizers (`model::fuzzing::tokenize`): the tokens' bytes end
//! to end are the text's and decoding gives it back, never a panic. The models come from pdhost's model
//! cache, fetched on first use as the tests fetch them.
#![no_main]

use std::sync::OnceLock;

use model::gguf::Gguf;
use model::registry;
use model::tokenizer::Tokenizer;

fn tokenizers() -> &'static [Tokenizer] {
    static ALL: OnceLock<Vec<Tokenizer>> = OnceLock::new();
    ALL.get_or_init(|| {
        ["gemma3-270m", "smollm2-135m"]
            .into_iter()
            .map(|name| {
                let path = registry::fetch(name, &mut registry::Quiet).unwrap_or_else(|e| panic!("fetching {name}: {e}"));
                Tokenizer::from_gguf(&Gguf::open(&path).expect("a cached model opens")).expect("its tokenizer")
            })
            .collect()
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        for tok in tokenizers() {
            model::fuzzing::tokenize(tok, text);
        }
    }
});
