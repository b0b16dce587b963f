//! Entry points for the fuzz targets in `fuzz/` that need a model's parts. They must never panic on
//! any input; the tests that run them on real tokenizers are in `tests/real_models.rs`.

use crate::tokenizer::Tokenizer;

/// Encodes `text` without BOS, and as prompts are (BOS as the model says). The tokens' bytes end to end
/// are what each character alone encodes to, end to end; and that is the character's bytes, or its bytes
/// less those the tokenizer drops ([`Tokenizer::drops_byte`]: a byte-level vocabulary without one of the
/// 256 byte characters and without an unknown token, as SmolLM2's, drops that byte, as Hugging Face's BPE
/// does), or, for SentencePiece's space mark U+2581, a space. Where the bytes are the text's, decoding
/// the ids gives the text back. A prompt is BOS and then the same ids.
pub fn tokenize(tok: &Tokenizer, text: &str) {
    let bytes_of = |ids: &[u32]| ids.iter().flat_map(|&id| tok.token_bytes(id)).collect::<Vec<u8>>();
    let plain = tok.encode(text, false);
    let bytes = bytes_of(&plain);
    let mut each = Vec::with_capacity(text.len());
    let mut buf = [0u8; 4];
    for c in text.chars() {
        let alone = bytes_of(&tok.encode(c.encode_utf8(&mut buf), false));
        let of_c = c.encode_utf8(&mut buf).as_bytes();
        let kept: Vec<u8> = of_c.iter().copied().filter(|&b| !tok.drops_byte(b)).collect();
        // SentencePiece writes a space as U+2581, so a U+2581 of the text's own reads back as a space.
        let escaped_space = c == '\u{2581}' && alone == b" ";
        assert!(
            escaped_space || alone == of_c || alone == kept,
            "{c:?} alone encodes to other bytes than its own (less those without a token): {alone:?}"
        );
        each.extend(alone);
    }
    assert!(bytes == each, "the tokens' bytes are not the text's: {text:?} -> {plain:?}");
    if bytes == text.as_bytes() {
        assert_eq!(tok.decode(&plain, false), text, "decoding {plain:?}");
    }
    let prompt = tok.encode(text, tok.add_bos());
    let skip = usize::from(tok.add_bos());
    assert_eq!(prompt.get(skip..), Some(plain.as_slice()), "BOS as the model says, then the same ids: {text:?}");
}
