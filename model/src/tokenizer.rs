//! Tokenizers built from GGUF metadata, matching Hugging Face's ids.
//!
//! - `llama` (SentencePiece-style, Gemma): score-merged BPE. Special tokens (control and user-defined, e.g.
//!   whitespace runs and tags) are split out of the raw text first, longest match leftmost; each remaining
//!   fragment has spaces replaced by `▁` and is merged pair by pair, highest score first, ties leftmost;
//!   pieces that are not in the vocabulary fall back to `<0xXX>` byte tokens.
//! - `gpt2` (SmolLM2): special tokens first, then each digit on its own, then GPT-2's pre-tokenizer regex,
//!   byte-level mapping, and BPE by merge rank. No prefix space.

use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasher, RandomState};

use crate::gguf::{Array, Gguf, GgufError, Strings, Value};

/// A token's type, from `tokenizer.ggml.token_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

#[derive(Debug)]
enum Algorithm {
    /// Score per token.
    Spm { scores: Vec<f32> },
    /// Merge rank per (left, right) pair, and the GPT-2 pre-tokenizer.
    Gpt2 { ranks: HashMap<(u32, u32), u32>, pretokenizer: Box<regex::Regex> },
}

/// A tokenizer: built from GGUF metadata, or loaded from a Hugging Face `tokenizer.json`.
#[derive(Debug)]
pub enum Tokenizer {
    /// From GGUF metadata.
    Gguf(Box<GgufTokenizer>),
    /// From `tokenizer.json`, through the `tokenizers` crate.
    Hf {
        /// The tokenizer.
        inner: Box<tokenizers::Tokenizer>,
        /// Whether its post-processor adds BOS.
        add_bos: bool,
    },
}

/// [`Tokenizer::hf_stream`]'s decoder.
pub type HfDecodeStream<'a> = tokenizers::DecodeStream<
    'a,
    tokenizers::models::ModelWrapper,
    tokenizers::normalizers::NormalizerWrapper,
    tokenizers::pre_tokenizers::PreTokenizerWrapper,
    tokenizers::processors::PostProcessorWrapper,
    tokenizers::decoders::DecoderWrapper,
>;

/// Why `tokenizer.json` cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{path}: expected a Hugging Face tokenizer.json, found: {reason}")]
pub struct TokenizerError {
    /// The file.
    pub path: std::path::PathBuf,
    /// What the `tokenizers` crate said.
    pub reason: String,
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes.
    pub fn from_gguf(g: &Gguf) -> Result<Self, GgufError> {
        GgufTokenizer::from_gguf(g).map(|t| Tokenizer::Gguf(Box::new(t)))
    }

    /// Loads a `tokenizer.json`.
    pub fn from_file(path: &std::path::Path) -> Result<Self, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| TokenizerError { path: path.into(), reason: e.to_string() })?;
        let add_bos = inner.encode("", true).map(|e| !e.get_ids().is_empty()).unwrap_or(false);
        Ok(Tokenizer::Hf { inner: Box::new(inner), add_bos })
    }

    /// The ids it may produce: the vocabulary and any added tokens.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Gguf(t) => t.vocab_size(),
            Tokenizer::Hf { inner, .. } => inner.get_vocab_size(true),
        }
    }

    /// Whether the model's tokenizer adds BOS (Gemma yes, SmolLM2 no).
    pub fn add_bos(&self) -> bool {
        match self {
            Tokenizer::Gguf(t) => t.add_bos,
            Tokenizer::Hf { add_bos, .. } => *add_bos,
        }
    }

    /// Encodes `text`, with BOS first when `with_bos` (and the model has one).
    pub fn encode(&self, text: &str, with_bos: bool) -> Vec<u32> {
        match self {
            Tokenizer::Gguf(t) => t.encode(text, with_bos),
            Tokenizer::Hf { inner, .. } => {
                inner.encode(text, with_bos).map(|e| e.get_ids().to_vec()).unwrap_or_default()
            }
        }
    }

    /// The text of `ids`; with `skip_special`, special tokens are left out.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        match self {
            Tokenizer::Gguf(t) => t.decode(ids, skip_special),
            Tokenizer::Hf { inner, .. } => inner.decode(ids, skip_special).unwrap_or_default(),
        }
    }

    /// The bytes `id` adds to [`Tokenizer::decode`]'s, where a text's bytes are its tokens' bytes end
    /// to end (a GGUF's vocabulary; `None` for a `tokenizer.json`, whose decoders may look across
    /// tokens). With `skip_special`, a special token adds nothing.
    pub fn piece_bytes(&self, id: u32, skip_special: bool) -> Option<Vec<u8>> {
        match self {
            Tokenizer::Gguf(t) => Some(t.decode_bytes(&[id], skip_special)),
            Tokenizer::Hf { .. } => None,
        }
    }

    /// A `tokenizer.json`'s incremental decoding (`None` for a GGUF's, whose pieces are
    /// [`Tokenizer::piece_bytes`]): the `tokenizers` crate's `DecodeStream`, which decodes each new id
    /// with the few before it that its decoder may look across, not the whole output.
    pub fn hf_stream(&self, skip_special: bool) -> Option<HfDecodeStream<'_>> {
        match self {
            Tokenizer::Gguf(_) => None,
            Tokenizer::Hf { inner, .. } => Some(inner.decode_stream(skip_special)),
        }
    }

    /// Whether byte `b`, where it must stand alone, becomes no token ([`GgufTokenizer::drops_byte`];
    /// never from a `tokenizer.json`, whose model is not looked into).
    pub fn drops_byte(&self, b: u8) -> bool {
        match self {
            Tokenizer::Gguf(t) => t.drops_byte(b),
            Tokenizer::Hf { .. } => false,
        }
    }

    /// Token `id`'s text in the vocabulary, as the model's files spell it (SentencePiece's `▁the`,
    /// GPT-2's `Ġthe`, `<0x0A>`), as transformers' `convert_ids_to_tokens` gives it; `None` for an id
    /// outside the vocabulary.
    pub fn token_text(&self, id: u32) -> Option<String> {
        match self {
            Tokenizer::Gguf(t) => t.vocab.text(id).map(str::to_string),
            Tokenizer::Hf { inner, .. } => inner.id_to_token(id),
        }
    }

    /// The bytes token `id` stands for (special tokens' text included): a byte-fallback or byte-level
    /// token may hold part of a character, which [`Tokenizer::decode`] would replace. (From a
    /// `tokenizer.json`, the decoded text's bytes.)
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        match self {
            Tokenizer::Gguf(t) => t.decode_bytes(&[id], false),
            Tokenizer::Hf { inner, .. } => inner.decode(&[id], false).unwrap_or_default().into_bytes(),
        }
    }
}

/// A vocabulary: token texts by id, and ids by text. Each text is held once, end to end with the others
/// ([`Strings`]); the index holds only ids, found by their text's hash. (A `Vec<String>` and a
/// `HashMap<String, u32>` held Gemma 3's 262144 tokens twice over, a heap string each: 23 MB.)
struct Vocab {
    texts: Strings,
    index: hashbrown::HashTable<u32>,
    hasher: RandomState,
}

impl Vocab {
    fn new(texts: Strings) -> Self {
        let hasher = RandomState::new();
        let mut index = hashbrown::HashTable::with_capacity(texts.len());
        let text_of = |id: u32| texts.get(id as usize).expect("an id in the table is a token");
        for (id, text) in texts.iter().enumerate() {
            let entry =
                index.entry(hasher.hash_one(text), |&other| text_of(other) == text, |&id| hasher.hash_one(text_of(id)));
            // Of tokens with equal texts the last wins, as in a map filled in id order.
            match entry {
                hashbrown::hash_table::Entry::Occupied(mut e) => *e.get_mut() = id as u32,
                hashbrown::hash_table::Entry::Vacant(e) => {
                    e.insert(id as u32);
                }
            }
        }
        Vocab { texts, index, hasher }
    }

    /// The id of the token whose text is `text`.
    fn id(&self, text: &str) -> Option<u32> {
        self.index.find(self.hasher.hash_one(text), |&id| self.texts.get(id as usize) == Some(text)).copied()
    }

    /// The text of token `id`.
    fn text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize)
    }

    fn len(&self) -> usize {
        self.texts.len()
    }

    fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        self.texts.iter()
    }
}

impl std::fmt::Debug for Vocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocab").field("tokens", &self.len()).finish_non_exhaustive()
    }
}

/// A tokenizer built from GGUF metadata.
#[derive(Debug)]
pub struct GgufTokenizer {
    vocab: Vocab,
    kinds: Vec<Kind>,
    /// Special tokens matched in raw text, longest first.
    specials: Vec<(String, u32)>,
    /// Finds `specials` in a text (`None` when there are none).
    special_finder: Option<aho_corasick::AhoCorasick>,
    algorithm: Algorithm,
    /// BOS id, and whether `encode` adds it.
    pub bos: Option<u32>,
    /// Whether the model adds BOS.
    pub add_bos: bool,
    /// EOS id.
    pub eos: Option<u32>,
    /// Byte token ids, for byte fallback.
    byte_ids: [Option<u32>; 256],
    /// The first token of type unknown: what a byte without a token of its own becomes.
    unknown: Option<u32>,
}

/// GPT-2's pre-tokenizer pattern, `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`,
/// less its look-ahead alternative `\s+(?!\S)`, which [`gpt2_words`] does by hand: a backtracking engine
/// (fancy-regex) ran out of stack on a long run of spaces, and the client sends the text.
const GPT2_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

/// The words of GPT-2's pre-tokenizer in `text`, in order, each handed to `word`. The full pattern's
/// `\s+(?!\S)` takes a run of whitespace less its last character when something follows the run (which
/// then starts the next word: ` word`, or a lone `\n`), and the whole run at the end. Here `\s+` matches
/// the whole run (the alternatives before it cannot match whitespace alone), and a run of two or more
/// characters that something follows gives its last character back. Linear in `text`, in a regex engine
/// without backtracking.
fn gpt2_words(pattern: &regex::Regex, text: &str, mut word: impl FnMut(&str)) {
    let mut at = 0;
    while let Some(m) = pattern.find_at(text, at) {
        let mut end = m.end();
        let found = m.as_str();
        if end < text.len() && found.chars().all(char::is_whitespace) {
            let last = found.chars().next_back().map_or(0, char::len_utf8);
            if found.len() > last {
                end -= last;
            }
        }
        word(&text[m.start()..end]);
        at = end;
    }
}

impl GgufTokenizer {
    /// Builds the tokenizer a GGUF file describes.
    pub fn from_gguf(g: &Gguf) -> Result<Self, GgufError> {
        let model = g.get_str("tokenizer.ggml.model")?.to_string();
        let bad = |what: &str, expected: &str, found: String| GgufError::Invalid {
            path: g.path().into(),
            what: what.into(),
            expected: expected.into(),
            found,
        };
        let vocab = Vocab::new(g.get_strings("tokenizer.ggml.tokens")?.clone());
        let kind = |i: usize, v: i128| match v {
            1 => Ok(Kind::Normal),
            2 => Ok(Kind::Unknown),
            3 => Ok(Kind::Control),
            4 => Ok(Kind::UserDefined),
            5 => Ok(Kind::Unused),
            6 => Ok(Kind::Byte),
            v => Err(bad("tokenizer.ggml.token_type", "types 1..=6", format!("the integer {v} at entry {i}"))),
        };
        let kinds: Vec<Kind> = match g.optional("tokenizer.ggml.token_type", Gguf::get_array)? {
            Some(Array::I64(types)) => {
                types.iter().enumerate().map(|(i, &v)| kind(i, v.into())).collect::<Result<_, _>>()?
            }
            Some(Array::U64(types)) => {
                types.iter().enumerate().map(|(i, &v)| kind(i, v.into())).collect::<Result<_, _>>()?
            }
            Some(a) if a.is_empty() => Vec::new(),
            Some(a) => return Err(bad("tokenizer.ggml.token_type", "an array of integers", a.describe())),
            None => vec![Kind::Normal; vocab.len()],
        };
        if kinds.len() != vocab.len() {
            return Err(bad("tokenizer.ggml.token_type", &format!("{} entries", vocab.len()), kinds.len().to_string()));
        }
        let mut specials: Vec<(String, u32)> = vocab
            .iter()
            .zip(&kinds)
            .enumerate()
            .filter(|(_, (t, k))| matches!(k, Kind::Control | Kind::UserDefined) && !t.is_empty())
            .map(|(i, (t, _))| (t.to_owned(), i as u32))
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let special_finder = if specials.is_empty() {
            None
        } else {
            let finder = aho_corasick::AhoCorasick::builder()
                .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                .build(specials.iter().map(|(s, _)| s))
                .map_err(|e| bad("tokenizer special tokens", "a set small enough to search", e.to_string()))?;
            Some(finder)
        };
        let mut byte_ids = [None; 256];
        for (i, (t, k)) in vocab.iter().zip(&kinds).enumerate() {
            if *k == Kind::Byte {
                if let Some(b) =
                    t.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')).and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    byte_ids[b as usize] = Some(i as u32);
                }
            }
        }
        let unknown = kinds.iter().position(|k| *k == Kind::Unknown).map(|i| i as u32);
        let algorithm = match model.as_str() {
            "llama" => {
                let scores = match g.get_array("tokenizer.ggml.scores")? {
                    Array::F64(scores) => scores.iter().map(|&x| x as f32).collect(),
                    a if a.is_empty() => Vec::new(),
                    a => return Err(bad("tokenizer.ggml.scores", "an array of floats", a.describe())),
                };
                if scores.len() != vocab.len() {
                    return Err(bad(
                        "tokenizer.ggml.scores",
                        &format!("{} entries", vocab.len()),
                        scores.len().to_string(),
                    ));
                }
                Algorithm::Spm { scores }
            }
            "gpt2" => {
                let mut ranks = HashMap::new();
                for (rank, m) in g.get_strings("tokenizer.ggml.merges")?.iter().enumerate() {
                    let (l, r) =
                        m.split_once(' ').ok_or_else(|| bad("tokenizer.ggml.merges", "\"left right\"", m.into()))?;
                    // A merge counts only where both sides and their join are tokens, so merging never
                    // leaves the vocabulary.
                    let joined = vocab.id(&[l, r].concat()).is_some();
                    if let (Some(l), Some(r), true) = (vocab.id(l), vocab.id(r), joined) {
                        ranks.insert((l, r), rank as u32);
                    }
                }
                let pretokenizer = Box::new(regex::Regex::new(GPT2_PATTERN).expect("valid pattern"));
                Algorithm::Gpt2 { ranks, pretokenizer }
            }
            other => return Err(bad("tokenizer.ggml.model", "\"llama\" or \"gpt2\"", other.into())),
        };
        let get_id =
            |key: &str| g.optional(key, Gguf::get_u64).map(|id| id.map(|v| u32::try_from(v).unwrap_or(u32::MAX)));
        let add_bos = matches!(g.get("tokenizer.ggml.add_bos_token"), Ok(Value::Bool(true)));
        Ok(GgufTokenizer {
            bos: get_id("tokenizer.ggml.bos_token_id")?,
            eos: get_id("tokenizer.ggml.eos_token_id")?,
            add_bos,
            vocab,
            kinds,
            specials,
            special_finder,
            algorithm,
            byte_ids,
            unknown,
        })
    }

    /// Whether byte `b`, where it must stand alone (a byte-level vocabulary's every byte; a byte
    /// SentencePiece falls back to), becomes no token: the vocabulary has none for it, and no unknown
    /// token. Hugging Face's tokenizers drop such a byte too.
    pub fn drops_byte(&self, b: u8) -> bool {
        let token = match self.algorithm {
            Algorithm::Spm { .. } => self.byte_ids[usize::from(b)],
            Algorithm::Gpt2 { .. } => self.vocab.id(byte_to_char(b).encode_utf8(&mut [0; 4])),
        };
        token.is_none() && self.unknown.is_none()
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// Encodes `text`, with BOS first when `with_bos` and the model has one.
    pub fn encode(&self, text: &str, with_bos: bool) -> Vec<u32> {
        let mut out = Vec::new();
        if with_bos {
            out.extend(self.bos);
        }
        // Split out special tokens: the leftmost match, and at it the longest special token (ties to the
        // lowest id: the patterns are sorted that way). One pass over the text, whatever the number of
        // specials.
        let mut plain_start = 0;
        if let Some(finder) = &self.special_finder {
            for m in finder.find_iter(text) {
                self.encode_plain(&text[plain_start..m.start()], &mut out);
                out.push(self.specials[m.pattern().as_usize()].1);
                plain_start = m.end();
            }
        }
        self.encode_plain(&text[plain_start..], &mut out);
        out
    }

    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        match &self.algorithm {
            Algorithm::Spm { scores } => self.spm(&text.replace(' ', "\u{2581}"), scores, out),
            Algorithm::Gpt2 { ranks, pretokenizer } => {
                // Each digit is a piece of its own; the GPT-2 pattern splits what lies between.
                let mut start = 0;
                let mut pieces = Vec::new();
                for (i, c) in text.char_indices() {
                    // As the HF `Digits(individual_digits)` pre-tokenizer: every numeric char alone.
                    if c.is_numeric() {
                        pieces.push(&text[start..i]);
                        pieces.push(&text[i..i + c.len_utf8()]);
                        start = i + c.len_utf8();
                    }
                }
                pieces.push(&text[start..]);
                for piece in pieces.into_iter().filter(|p| !p.is_empty()) {
                    gpt2_words(pretokenizer, piece, |word| self.gpt2_word(word, ranks, out));
                }
            }
        }
    }

    /// Score-merged BPE over the characters of `text`.
    fn spm(&self, text: &str, scores: &[f32], out: &mut Vec<u32>) {
        // Symbols are the characters; `len == 0` marks a symbol merged into its left neighbour.
        let mut syms: Vec<(usize, usize)> = text.char_indices().map(|(i, c)| (i, c.len_utf8())).collect();
        let n = syms.len();
        let mut prev: Vec<Option<usize>> = (0..n).map(|i| i.checked_sub(1)).collect();
        let mut next: Vec<Option<usize>> = (0..n).map(|i| (i + 1 < n).then_some(i + 1)).collect();
        // Max-heap on (score, -left): highest score first, ties to the leftmost pair.
        #[derive(PartialEq)]
        struct Bigram {
            score: f32,
            left: usize,
            right: usize,
            len: usize,
        }
        impl Eq for Bigram {}
        impl Ord for Bigram {
            fn cmp(&self, o: &Self) -> std::cmp::Ordering {
                self.score.total_cmp(&o.score).then(o.left.cmp(&self.left))
            }
        }
        impl PartialOrd for Bigram {
            fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(o))
            }
        }
        let mut heap = BinaryHeap::new();
        let push = |heap: &mut BinaryHeap<Bigram>, syms: &[(usize, usize)], l: usize, r: usize| {
            let (start, len) = (syms[l].0, syms[l].1 + syms[r].1);
            if let Some(id) = self.vocab.id(&text[start..start + len]) {
                heap.push(Bigram { score: scores[id as usize], left: l, right: r, len });
            }
        };
        for i in 1..n {
            push(&mut heap, &syms, i - 1, i);
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (b.left, b.right);
            // Stale if either side changed since the pair was queued.
            if syms[l].1 == 0 || syms[r].1 == 0 || syms[l].1 + syms[r].1 != b.len {
                continue;
            }
            syms[l].1 = b.len;
            syms[r].1 = 0;
            next[l] = next[r];
            if let Some(nr) = next[r] {
                prev[nr] = Some(l);
            }
            if let Some(p) = prev[l] {
                push(&mut heap, &syms, p, l);
            }
            if let Some(nx) = next[l] {
                push(&mut heap, &syms, l, nx);
            }
        }
        let mut i = Some(0).filter(|_| n > 0);
        while let Some(s) = i {
            let piece = &text[syms[s].0..syms[s].0 + syms[s].1];
            match self.vocab.id(piece) {
                Some(id) => out.push(id),
                None => self.bytes_fallback(piece, out),
            }
            i = next[s];
        }
    }

    fn bytes_fallback(&self, piece: &str, out: &mut Vec<u32>) {
        for b in piece.bytes() {
            match self.byte_ids[b as usize] {
                Some(id) => out.push(id),
                None => out.extend(self.unknown),
            }
        }
    }

    /// Byte-level BPE of one pre-tokenized word.
    fn gpt2_word(&self, word: &str, ranks: &HashMap<(u32, u32), u32>, out: &mut Vec<u32>) {
        let mapped: String = word.bytes().map(byte_to_char).collect();
        let mut parts: Vec<u32> = Vec::with_capacity(mapped.len());
        for (i, c) in mapped.char_indices() {
            match self.vocab.id(&mapped[i..i + c.len_utf8()]) {
                Some(id) => parts.push(id),
                // A vocabulary without this byte's character: its unknown token, if it has one.
                None => parts.extend(self.unknown),
            }
        }
        // Merge the lowest-ranked adjacent pair, the leftmost of equals, until none is ranked. The
        // pairs wait in a heap by (rank, left slot) over a linked list of slots, so a long word costs
        // O(n log n), not a rescan per merge (a 40,000-character word took 11 s). An entry is current
        // when both its slots still hold the ids it was made for: a slot's id only ever grows into a
        // longer token, so it never holds an old id again.
        let n = parts.len();
        let mut next: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut alive = vec![true; n];
        let mut heap = std::collections::BinaryHeap::new();
        let push = |heap: &mut std::collections::BinaryHeap<_>, l: usize, a: u32, b: u32| {
            if let Some(&rank) = ranks.get(&(a, b)) {
                heap.push(std::cmp::Reverse((rank, l, a, b)));
            }
        };
        for l in 1..n {
            push(&mut heap, l - 1, parts[l - 1], parts[l]);
        }
        while let Some(std::cmp::Reverse((_, l, a, b))) = heap.pop() {
            let r = next[l];
            if !alive[l] || r >= n || parts[l] != a || parts[r] != b {
                continue;
            }
            let text = |id: u32| self.vocab.text(id).expect("ids come from the vocabulary");
            let merged = [text(a), text(b)].concat();
            parts[l] = self.vocab.id(&merged).expect("a ranked merge's join is a token");
            alive[r] = false;
            next[l] = next[r];
            if next[l] < n {
                prev[next[l]] = l;
            }
            if prev[l] < n {
                push(&mut heap, prev[l], parts[prev[l]], parts[l]);
            }
            if next[l] < n {
                push(&mut heap, l, parts[l], parts[next[l]]);
            }
        }
        out.extend(parts.iter().zip(&alive).filter(|(_, &alive)| alive).map(|(&id, _)| id));
    }

    /// The text of `ids`. With `skip_special`, control tokens are left out.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids, skip_special)).into_owned()
    }

    /// The bytes of `ids`, which need not be whole UTF-8 characters.
    pub fn decode_bytes(&self, ids: &[u32], skip_special: bool) -> Vec<u8> {
        let mut bytes = Vec::new();
        for &id in ids {
            let Some(t) = self.vocab.text(id) else { continue };
            let kind = self.kinds[id as usize];
            if skip_special && kind == Kind::Control {
                continue;
            }
            match (&self.algorithm, kind) {
                (_, Kind::Byte) => {
                    if let Some(b) = t
                        .strip_prefix("<0x")
                        .and_then(|h| h.strip_suffix('>'))
                        .and_then(|h| u8::from_str_radix(h, 16).ok())
                    {
                        bytes.push(b);
                    }
                }
                (Algorithm::Spm { .. }, _) => bytes.extend(t.replace('\u{2581}', " ").bytes()),
                (Algorithm::Gpt2 { .. }, Kind::Control | Kind::UserDefined) => bytes.extend(t.bytes()),
                (Algorithm::Gpt2 { .. }, _) => bytes.extend(t.chars().filter_map(char_to_byte)),
            }
        }
        bytes
    }
}

/// GPT-2's reversible byte-to-printable-character map.
fn byte_to_char(b: u8) -> char {
    let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable {
        char::from(b)
    } else {
        // The 68 other bytes, in order, map to U+0100 and up.
        let rank = (0..b).filter(|&x| !matches!(x, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)).count() as u32;
        char::from_u32(0x100 + rank).expect("valid")
    }
}

fn char_to_byte(c: char) -> Option<u8> {
    (0..=255u8).find(|&b| byte_to_char(b) == c)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pre-tokenizer's words are those of GPT-2's whole pattern, look-ahead and all, run by a
    /// backtracking engine: on runs of spaces, tabs and newlines before and after every kind of
    /// character, and on text drawn at random from those pieces.
    #[test]
    fn gpt2_words_are_those_of_the_pattern_with_its_look_ahead() {
        let full =
            fancy_regex::Regex::new(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
                .unwrap();
        let ours = regex::Regex::new(GPT2_PATTERN).unwrap();
        let words = |text: &str| {
            let mut v = Vec::new();
            gpt2_words(&ours, text, |w| v.push(w.to_string()));
            v
        };
        let expected =
            |text: &str| -> Vec<String> { full.find_iter(text).map(|m| m.unwrap().as_str().to_string()).collect() };
        let bits = [
            " ", "  ", "   ", "\n", "\n\n", " \n", "\n ", "\t", "\u{a0}", "\u{3000}", "a", "word", "Été", "日本", "42",
            "٣", "!", "...", "'s", "'ll", "'", "🦀", "-", "x\n",
        ];
        let mut cases: Vec<String> = Vec::new();
        for a in bits {
            for b in bits {
                cases.push(format!("{a}{b}"));
                for c in [" ", "  ", "\n", "x", " y", "!"] {
                    cases.push(format!("{a}{b}{c}"));
                }
            }
        }
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..2000 {
            let mut text = String::new();
            for _ in 0..12 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                text.push_str(bits[(state % bits.len() as u64) as usize]);
            }
            cases.push(text);
        }
        for text in &cases {
            assert_eq!(words(text), expected(text), "{text:?}");
        }
        // Where the backtracking engine failed (its stack), every character is still in a word.
        let spaces = " ".repeat(1 << 20) + "x";
        assert_eq!(words(&spaces), [" ".repeat((1 << 20) - 1), " x".to_string()]);
    }

    #[test]
    fn the_vocabulary_finds_every_text_and_of_equal_texts_the_last() {
        let vocab = Vocab::new(["a", "b", "a", "", "ab", "\u{2581}日本"].into_iter().collect());
        let found: Vec<_> = ["a", "b", "", "ab", "\u{2581}日本", "c", "abc"].map(|t| vocab.id(t)).into();
        assert_eq!(found, [Some(2), Some(1), Some(3), Some(4), Some(5), None, None]);
        assert_eq!((vocab.len(), vocab.text(4), vocab.text(6)), (6, Some("ab"), None));
        assert_eq!(format!("{vocab:?}"), "Vocab { tokens: 6, .. }");
    }
}
