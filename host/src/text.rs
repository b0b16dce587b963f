//! Text as it streams: token ids in, the new complete text out, for the CLI and the server alike.

use model::tokenizer::Tokenizer;

/// Turns generated ids into text a piece at a time. A piece is held back while it ends inside a
/// multi-byte character (the decoder shows U+FFFD there), so no client ever sees half a character.
///
/// Where the tokenizer's text is its tokens' bytes end to end (a GGUF's), each id costs the decoding
/// of the bytes not yet shown ([`Pending`]). A `tokenizer.json`, whose decoders may look across
/// tokens, decodes each id with the few before it (`tokenizers`' `DecodeStream`); where that finds the
/// text before it changed (a decoder no window can follow), every id from then on decodes the whole
/// output again.
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    ids: Vec<u32>,
    /// The bytes of the ids pushed since the last piece shown (GGUF vocabularies only).
    pending: Pending,
    /// A `tokenizer.json`'s incremental decoder, until it fails.
    hf: Option<model::tokenizer::HfDecodeStream<'a>>,
    shown: String,
}

impl std::fmt::Debug for TextStream<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextStream").field("ids", &self.ids.len()).field("shown", &self.shown.len()).finish()
    }
}

impl<'a> TextStream<'a> {
    /// A stream over `tokenizer`'s decoding.
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        let hf = tokenizer.hf_stream(true);
        TextStream { tokenizer, ids: Vec::new(), pending: Pending::default(), hf, shown: String::new() }
    }

    /// Adds `id`; returns the text it completes (empty while a character is still partial).
    pub fn push(&mut self, id: u32) -> String {
        self.ids.push(id);
        if let Some(bytes) = self.tokenizer.piece_bytes(id, true) {
            let Some(new) = self.pending.push(&bytes) else { return String::new() };
            self.shown.push_str(&new);
            return new;
        }
        if let Some(hf) = &mut self.hf {
            match hf.step(id) {
                Ok(Some(new)) => {
                    self.shown.push_str(&new);
                    return new;
                }
                Ok(None) => return String::new(),
                Err(_) => self.hf = None,
            }
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

    /// A `tokenizer.json` of Llama 2's kind: SentencePiece pieces (`▁` for a space, stripped at the
    /// start of the text) and byte-fallback tokens, whose decoder looks across tokens.
    fn llama_style_tokenizer_json() -> Tokenizer {
        let mut vocab = serde_json::Map::new();
        for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
            vocab.insert((*t).into(), i.into());
        }
        for b in 0..256 {
            vocab.insert(format!("<0x{b:02X}>"), (3 + b).into());
        }
        for (i, t) in ["▁", "▁hello", "▁world", "lo", "é", "▁naïve", "!", "▁▁", "日本"].iter().enumerate()
        {
            vocab.insert((*t).into(), (259 + i).into());
        }
        let special = |id: usize, content: &str| {
            serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                               "rstrip": false, "normalized": false, "special": true})
        };
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                      "vocab": vocab, "merges": []}
        });
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, json.to_string()).unwrap();
        Tokenizer::from_file(&path).unwrap()
    }

    /// A `tokenizer.json` streams, a window of ids at a time, the pieces of decoding the whole output at
    /// every id: through its first space stripped, characters split across byte tokens and special
    /// tokens. Bytes that never make a character can change the text before them (the byte-fallback
    /// decoder turns a whole run of byte tokens into U+FFFD where any of it is not UTF-8): the window
    /// gives up there, and the pieces are still those of the whole text.
    #[test]
    fn a_tokenizer_json_streams_the_pieces_of_the_whole_text() {
        let tokenizer = llama_style_tokenizer_json();
        let byte = |b: u32| 3 + b;
        // Pieces, specials, and characters of two and three byte tokens (é, €).
        let units: Vec<Vec<u32>> = (259..268)
            .chain(1..3)
            .map(|id| vec![id])
            .chain([vec![byte(0xC3), byte(0xA9)], vec![byte(0xE2), byte(0x82), byte(0xAC)], vec![byte(b'x' as u32)]])
            .collect();
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: usize| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as usize % n
        };
        let whole: Vec<u32> = (0..300).flat_map(|_| units[next(units.len())].clone()).collect();
        let stray: Vec<u32> = (0..300).map(|_| next(268) as u32).collect();
        for (ids, window_holds) in [(&whole[..], true), (&whole[1..], true), (&stray[..], false)] {
            let mut stream = TextStream::new(&tokenizer);
            let pieces: Vec<String> = ids.iter().map(|&id| stream.push(id)).collect();
            assert_eq!(pieces, whole_decodes(&tokenizer, ids));
            assert_eq!(stream.hf.is_some(), window_holds);
            assert!(!window_holds || tokenizer.decode(ids, true) == stream.shown());
        }
        assert!(whole_decodes(&tokenizer, &whole).concat().contains('€'), "a character of three byte tokens");
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
