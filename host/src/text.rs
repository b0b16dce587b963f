//! Text as it streams: token ids in, the new complete text out, for the CLI and the server alike.

use model::tokenizer::Tokenizer;

/// Turns generated ids into text a piece at a time. A piece is held back while it ends inside a
/// multi-byte character (the decoder shows U+FFFD there), so no client ever sees half a character.
///
/// Where the tokenizer's text is its tokens' bytes end to end (a GGUF's), each id costs the decoding
/// of the bytes not yet shown ([`Pending`]). Otherwise (a `tokenizer.json`, whose
/// decoders may look across tokens) every id decodes the whole output again, which at 8192 tokens
/// costs about half a millisecond a token.
#[derive(Debug)]
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    ids: Vec<u32>,
    /// The bytes of the ids pushed since the last piece shown (GGUF vocabularies only).
    pending: Pending,
    shown: String,
}

impl<'a> TextStream<'a> {
    /// A stream over `tokenizer`'s decoding.
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        TextStream { tokenizer, ids: Vec::new(), pending: Pending::default(), shown: String::new() }
    }

    /// Adds `id`; returns the text it completes (empty while a character is still partial).
    pub fn push(&mut self, id: u32) -> String {
        self.ids.push(id);
        if let Some(bytes) = self.tokenizer.piece_bytes(id, true) {
            let Some(new) = self.pending.push(&bytes) else { return String::new() };
            self.shown.push_str(&new);
            return new;
        }
        let text = self.tokenizer.decode(&self.ids, true);
        match text.strip_prefix(self.shown.as_str()) {
            Some(new) if !new.ends_with('\u{FFFD}') => {
                let new = new.to_string();
                self.shown = text;
                new
            }
            _ => String::new(),
        }
    }

    /// Everything shown so far.
    pub fn shown(&self) -> &str {
        &self.shown
    }

    /// The whole text of every id pushed, partial characters included.
    pub fn text(&self) -> String {
        self.tokenizer.decode(&self.ids, true)
    }
}

/// Bytes of text not yet whole characters: each piece's bytes join them, and what they decode to comes
/// out once it no longer ends in U+FFFD (the decoder's mark of a character cut short). What came out
/// ended with a whole character, after which UTF-8 decodes afresh, so the pieces that come out are the
/// whole text's decoding cut up.
#[derive(Debug, Default)]
pub struct Pending(Vec<u8>);

impl Pending {
    /// Adds `bytes`; the text they complete, or `None` while a character is still partial.
    pub fn push(&mut self, bytes: &[u8]) -> Option<String> {
        self.0.extend_from_slice(bytes);
        let text = String::from_utf8_lossy(&self.0);
        if text.ends_with('\u{FFFD}') {
            return None;
        }
        let text = text.into_owned();
        self.0.clear();
        Some(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::registry;

    /// What every id gave before the stream decoded only its pending bytes: the whole output decoded
    /// again, less what was shown, held back while it ends in U+FFFD.
    fn whole_decodes(tokenizer: &Tokenizer, ids: &[u32]) -> Vec<String> {
        let mut shown = String::new();
        (1..=ids.len())
            .map(|n| {
                let text = tokenizer.decode(&ids[..n], true);
                match text.strip_prefix(shown.as_str()) {
                    Some(new) if !new.ends_with('\u{FFFD}') => {
                        let new = new.to_string();
                        shown = text;
                        new
                    }
                    _ => String::new(),
                }
            })
            .collect()
    }

    /// On both real models' vocabularies, the pieces are those of decoding the whole output at every
    /// id, through characters split across byte tokens, bytes that never make a character, special
    /// tokens and ids drawn at random.
    #[test]
    fn pieces_are_those_of_the_whole_text_decoded_at_every_id() {
        for name in ["gemma3-270m", "smollm2-135m"] {
            let path = registry::fetch(name, &mut registry::Quiet).unwrap_or_else(|e| panic!("fetching {name}: {e}"));
            let gguf = model::gguf::Gguf::open(&path).unwrap();
            let tokenizer = Tokenizer::from_gguf(&gguf).unwrap();
            let vocab = model::arch::Config::from_gguf(&gguf).unwrap().vocab as u32;
            // Ids that stand for one byte of a multi-byte character, or for none.
            let high: Vec<u32> =
                (0..vocab).filter(|&id| matches!(tokenizer.token_bytes(id)[..], [b] if b >= 0x80)).collect();
            assert!(high.len() >= 64, "{name}: {} single high-byte tokens", high.len());
            let mut ids = tokenizer.encode("naïve café 日本語 🦀 — ✓ done. ", true);
            let mut state = 0x9e37_79b9_7f4a_7c15u64;
            for _ in 0..600 {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let r = (state >> 33) as u32;
                ids.push(if r.is_multiple_of(3) { high[(r / 3) as usize % high.len()] } else { r % vocab });
            }
            let mut stream = TextStream::new(&tokenizer);
            let pieces: Vec<String> = ids.iter().map(|&id| stream.push(id)).collect();
            assert_eq!(pieces, whole_decodes(&tokenizer, &ids), "{name}");
            assert!(pieces.iter().filter(|p| p.is_empty()).count() > 10, "{name}: some pieces were held back");
            let whole = tokenizer.decode(&ids, true);
            assert!(whole.starts_with(stream.shown()) && stream.text() == whole, "{name}");
        }
    }
}
