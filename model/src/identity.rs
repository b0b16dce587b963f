//! A model's identity: which weights, tokenizer and rope parameters a process loaded, so that a host and
//! a producer can prove at their handshake that they run the same model, not just one of the same shape.
//!
//! In text (what a backend reports through the ABI, `docs/plugin-abi.md`):
//! `weights:0123456789abcdef;tokenizer:0123456789abcdef;rope:1000000/10000`, where
//! - `weights` is the XXH3-64 (seed 0) of the weight bytes as stored: a GGUF's tensor data (from the first
//!   tensor's offset to the end of the last), or every `*.safetensors` file of a checkpoint directory,
//!   whole, in file-name order;
//! - `tokenizer` is the XXH3-64 of the tokenizer as stored: a GGUF's `tokenizer.ggml.tokens` joined by
//!   `\n`, or a checkpoint directory's `tokenizer.json` (0 when it has none);
//! - `rope` is the global and the local (sliding-layer) rope base, each as the shortest decimal that
//!   reads back as the same f32 (`1000000`, `10000`, `500000.5`).

use std::fmt;
use std::hash::Hasher;
use std::io::Read;
use std::path::Path;

use twox_hash::XxHash3_64;

/// See the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelIdentity {
    /// XXH3-64 of the weight bytes.
    pub weights: u64,
    /// XXH3-64 of the tokenizer.
    pub tokenizer: u64,
    /// `global/local` rope bases.
    pub rope: String,
}

/// Which part of two identities differs first, with both values, in words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentityMismatch {
    /// `weights`, `tokenizer`, `rope`, or `identity` when the text does not parse.
    pub what: &'static str,
    /// Ours.
    pub expected: String,
    /// Theirs.
    pub found: String,
}

impl ModelIdentity {
    /// The identity of a model whose rope bases are `global` and `local`.
    pub fn new(weights: u64, tokenizer: u64, global: f32, local: f32) -> Self {
        ModelIdentity { weights, tokenizer, rope: format!("{global}/{local}") }
    }

    /// Parses the text form.
    pub fn parse(text: &str) -> Option<Self> {
        let mut parts = text.split(';');
        let mut field = |name: &str| parts.next()?.strip_prefix(name)?.strip_prefix(':').map(str::to_string);
        let hex = |s: String| (s.len() == 16).then(|| u64::from_str_radix(&s, 16).ok()).flatten();
        let weights = hex(field("weights")?)?;
        let tokenizer = hex(field("tokenizer")?)?;
        let rope = field("rope")?;
        (parts.next().is_none() && !rope.is_empty()).then_some(ModelIdentity { weights, tokenizer, rope })
    }

    /// How `theirs` (the text a backend reported) differs from this identity, or `None` when it names
    /// the same model.
    pub fn mismatch(&self, theirs: &str) -> Option<IdentityMismatch> {
        let Some(found) = ModelIdentity::parse(theirs) else {
            let cut: String = theirs.chars().take(120).collect();
            return Some(IdentityMismatch {
                what: "its form",
                expected: "weights:HEX16;tokenizer:HEX16;rope:GLOBAL/LOCAL".into(),
                found: format!("{cut:?}"),
            });
        };
        let differs = |what, a: String, b: String| (a != b).then_some(IdentityMismatch { what, expected: a, found: b });
        differs("weights", format!("{:016x}", self.weights), format!("{:016x}", found.weights))
            .or_else(|| differs("tokenizer", format!("{:016x}", self.tokenizer), format!("{:016x}", found.tokenizer)))
            .or_else(|| differs("rope", self.rope.clone(), found.rope))
    }
}

impl fmt::Display for ModelIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "weights:{:016x};tokenizer:{:016x};rope:{}", self.weights, self.tokenizer, self.rope)
    }
}

/// XXH3-64 of `bytes`.
pub fn digest(bytes: &[u8]) -> u64 {
    let mut h = XxHash3_64::with_seed(0);
    h.write(bytes);
    h.finish()
}

/// XXH3-64 of the files at `paths`, read whole, one after another.
pub fn digest_files(paths: &[std::path::PathBuf]) -> std::io::Result<u64> {
    let mut h = XxHash3_64::with_seed(0);
    let mut buf = vec![0u8; 1 << 20];
    for path in paths {
        let mut file = std::fs::File::open(path)?;
        loop {
            match file.read(&mut buf)? {
                0 => break,
                n => h.write(&buf[..n]),
            }
        }
    }
    Ok(h.finish())
}

/// XXH3-64 of `dir/tokenizer.json`, or 0 when there is none.
pub fn digest_tokenizer_json(dir: &Path) -> std::io::Result<u64> {
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        return Ok(0);
    }
    digest_files(&[path])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_round_trip_and_name_what_differs() {
        let ours = ModelIdentity::new(0x0123_4567_89ab_cdef, 7, 1_000_000.0, 10_000.0);
        let text = ours.to_string();
        assert_eq!(text, "weights:0123456789abcdef;tokenizer:0000000000000007;rope:1000000/10000");
        assert_eq!(ModelIdentity::parse(&text), Some(ours.clone()));
        assert_eq!(ours.mismatch(&text), None);

        let other = ModelIdentity::new(1, 7, 1_000_000.0, 10_000.0).to_string();
        let m = ours.mismatch(&other).unwrap();
        assert_eq!(
            (m.what, m.expected.as_str(), m.found.as_str()),
            ("weights", "0123456789abcdef", "0000000000000001")
        );
        let rope = ModelIdentity::new(ours.weights, 7, 500_000.5, 10_000.0).to_string();
        let m = ours.mismatch(&rope).unwrap();
        assert_eq!((m.what, m.found.as_str()), ("rope", "500000.5/10000"));

        for bad in ["", "weights:12", "weights:0123456789abcdef;tokenizer:0000000000000007", &format!("{text};x")] {
            assert_eq!(ours.mismatch(bad).unwrap().what, "its form", "{bad:?}");
        }
    }
}
