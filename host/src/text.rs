//! Text as it streams: token ids in, the new complete text out, for the CLI and the server alike.

use model::tokenizer::Tokenizer;

/// Turns generated ids into text a piece at a time. A piece is held back while it ends inside a
/// multi-byte character (the decoder shows U+FFFD there), so no client ever sees half a character.
#[derive(Debug)]
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    ids: Vec<u32>,
    shown: String,
}

impl<'a> TextStream<'a> {
    /// A stream over `tokenizer`'s decoding.
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        TextStream { tokenizer, ids: Vec::new(), shown: String::new() }
    }

    /// Adds `id`; returns the text it completes (empty while a character is still partial).
    pub fn push(&mut self, id: u32) -> String {
        self.ids.push(id);
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
