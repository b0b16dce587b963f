//! A GGUF reader: the file is memory-mapped, every length is bounded before use, and every tensor is
//! checked to lie inside the file, aligned, and its rows made of whole quantization blocks.
//!
//! The mapping is shared and read-only; pdhost never writes the file. A file truncated underneath a
//! mapping faults on access (SIGBUS), and one rewritten in place changes the weights under the identity
//! taken at load. Model files in pdhost's cache are written once, atomically renamed into place, and
//! never modified: a re-fetch renames a new file over the name, and the old mapping keeps the old inode.
//! A file the user names (`--model PATH.gguf`) is the user's to leave alone while pdhost runs: replace it
//! by renaming a new one over it, as the cache does, never by copying over it. Another process of the same user could still write it: a producer's
//! backend can only in its `open`, before its sandbox goes on (docs/plugin-abi.md, "The sandbox around
//! you"), where it holds the user's rights whatever the host maps. A model's weights keep the mapping alive ([`Gguf::tensor_shared`]) for as long as the
//! model lives, so the same holds for its whole life, not only while it loads.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use shm_format::words;

use crate::quant::{dequantize, GgmlType};

/// Most key/value pairs and tensors a file may declare.
const MAX_ENTRIES: u64 = 1 << 20;
/// Longest string (tokenizer vocabularies hold many short ones; chat templates a few KiB).
const MAX_STRING: u64 = 16 << 20;
/// Longest metadata array (vocabularies are around 262k entries).
const MAX_ARRAY: u64 = 1 << 24;
/// Highest tensor rank.
const MAX_DIMS: u32 = 4;

/// Why a GGUF file cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// Opening or mapping failed.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Not a GGUF file.
    #[error(
        "{path}: expected the GGUF magic \"GGUF\" at the start of a GGUF file, found a file starting with {}",
        words::bytes(found)
    )]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// The first bytes.
        found: Vec<u8>,
    },
    /// A version this reader does not know.
    #[error("{path}: expected GGUF version 2 or 3, found {found}")]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// The version.
        found: u32,
    },
    /// The file ends inside a structure.
    #[error("{path}: truncated reading {what} at offset {offset}: expected {needed} more bytes, found {left}")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// What was being read.
        what: String,
        /// Where.
        offset: u64,
        /// Bytes needed.
        needed: u64,
        /// Bytes left.
        left: u64,
    },
    /// A count or length above the reader's bounds.
    #[error("{path}: {what}: expected at most {max}, found {found}")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// What.
        what: String,
        /// The bound.
        max: u64,
        /// The value.
        found: u64,
    },
    /// Something structurally wrong with a key or tensor.
    #[error("{path}: {what}: expected {expected}, found {found}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The key or tensor.
        what: String,
        /// What was expected.
        expected: String,
        /// What was found.
        found: String,
    },
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Unsigned integer (u8, u16, u32, u64).
    U64(u64),
    /// Signed integer (i8, i16, i32, i64).
    I64(i64),
    /// Float (f32, f64).
    F64(f64),
    /// Boolean.
    Bool(bool),
    /// UTF-8 string.
    Str(String),
    /// Array.
    Array(Array),
}

impl Value {
    fn type_name(&self) -> &'static str {
        match self {
            Value::U64(_) => "an unsigned integer",
            Value::I64(_) => "a signed integer",
            Value::F64(_) => "a float",
            Value::Bool(_) => "a bool",
            Value::Str(_) => "a string",
            Value::Array(_) => "an array",
        }
    }

    /// The value in words for messages, never its whole contents (a vocabulary is a quarter million
    /// strings): `the unsigned integer 7`, `a string of 12 bytes`, `an array of 3 floats`.
    pub fn describe(&self) -> String {
        match self {
            Value::U64(v) => format!("the unsigned integer {v}"),
            Value::I64(v) => format!("the signed integer {v}"),
            Value::F64(v) => format!("the float {v}"),
            Value::Bool(v) => format!("the bool {v}"),
            Value::Str(s) if s.len() == 1 => "a string of 1 byte".to_string(),
            Value::Str(s) => format!("a string of {} bytes", s.len()),
            Value::Array(a) => a.describe(),
        }
    }
}

/// A metadata array, held by element type. A vocabulary is a quarter million strings: they are kept end
/// to end in one buffer ([`Strings`]), not as a heap string and a 32-byte [`Value`] each (that was 25 MB
/// for Gemma 3's, more than its KV pool at a short prompt).
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    /// Unsigned integers (u8, u16, u32 or u64 elements).
    U64(Vec<u64>),
    /// Signed integers (i8, i16, i32 or i64 elements).
    I64(Vec<i64>),
    /// Floats (f32 or f64 elements).
    F64(Vec<f64>),
    /// Booleans.
    Bool(Vec<bool>),
    /// Strings.
    Str(Strings),
}

impl Array {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::Str(v) => v.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The array in words: `an array of 3 floats`, `an empty array`.
    pub fn describe(&self) -> String {
        let elements = match self {
            _ if self.is_empty() => return "an empty array".to_string(),
            Array::U64(_) => "unsigned integers",
            Array::I64(_) => "signed integers",
            Array::F64(_) => "floats",
            Array::Bool(_) => "bools",
            Array::Str(_) => "strings",
        };
        format!("an array of {} {elements}", self.len())
    }
}

/// Strings stored end to end in one buffer, with the end of each.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Strings {
    text: String,
    /// Where each string ends in `text` (a `u32`: the reader refuses arrays of more than 4 GiB of text).
    ends: Vec<u32>,
}

impl Strings {
    /// Number of strings.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// String `i`.
    pub fn get(&self, i: usize) -> Option<&str> {
        let end = *self.ends.get(i)? as usize;
        let start = i.checked_sub(1).map_or(0, |j| self.ends[j] as usize);
        Some(&self.text[start..end])
    }

    /// The strings in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        (0..self.len()).map(|i| self.get(i).expect("in range"))
    }

    /// Appends `s`; `false` (and nothing appended) when the text would pass 4 GiB.
    fn push(&mut self, s: &str) -> bool {
        let Some(end) = u32::try_from(self.text.len() + s.len()).ok() else { return false };
        self.text.push_str(s);
        self.ends.push(end);
        true
    }
}

impl std::fmt::Debug for Strings {
    /// Their count and size, not a vocabulary's quarter million strings.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Strings").field("len", &self.len()).field("bytes", &self.text.len()).finish()
    }
}

impl<'a> FromIterator<&'a str> for Strings {
    /// # Panics
    /// If the strings pass 4 GiB in all.
    fn from_iter<I: IntoIterator<Item = &'a str>>(iter: I) -> Self {
        let mut strings = Strings::default();
        for s in iter {
            assert!(strings.push(s), "strings of more than 4 GiB in all");
        }
        strings
    }
}

/// Where a tensor is and what it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// GGML dims, innermost first (`[cols, rows]` for a matrix).
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Absolute file offset of the data.
    pub offset: u64,
    /// Bytes of data.
    pub len: u64,
}

impl TensorInfo {
    /// Number of weights.
    pub fn elems(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// An open GGUF file.
#[derive(Debug)]
pub struct Gguf {
    path: PathBuf,
    map: std::sync::Arc<memmap2::Mmap>,
    /// GGUF version.
    pub version: u32,
    /// Metadata by key.
    pub metadata: BTreeMap<String, Value>,
    /// Tensors by name.
    pub tensors: BTreeMap<String, TensorInfo>,
}

struct Cursor<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        let left = (self.bytes.len() - self.at) as u64;
        if n > left {
            return Err(GgufError::Truncated {
                path: self.path.into(),
                what: what(),
                offset: self.at as u64,
                needed: n,
                left,
            });
        }
        let s = &self.bytes[self.at..self.at + n as usize];
        self.at += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        Ok(self.take(N as u64, what)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn bounded(&mut self, max: u64, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        let n = self.u64(what)?;
        if n > max {
            return Err(GgufError::TooLarge { path: self.path.into(), what: what(), max, found: n });
        }
        Ok(n)
    }

    fn str(&mut self, what: &dyn Fn() -> String) -> Result<&'a str, GgufError> {
        let n = self.bounded(MAX_STRING, what)?;
        let bytes = self.take(n, what)?;
        std::str::from_utf8(bytes).map_err(|e| GgufError::Invalid {
            path: self.path.into(),
            what: what(),
            expected: "UTF-8".into(),
            found: format!("invalid byte at {}", e.valid_up_to()),
        })
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        self.str(what).map(str::to_owned)
    }

    fn value(&mut self, ty: u32, key: &str) -> Result<Value, GgufError> {
        let what = || format!("metadata {key:?}");
        Ok(match ty {
            0 => Value::U64(u64::from(self.array::<1>(&what)?[0])),
            1 => Value::I64(i64::from(self.array::<1>(&what)?[0] as i8)),
            2 => Value::U64(u64::from(u16::from_le_bytes(self.array(&what)?))),
            3 => Value::I64(i64::from(i16::from_le_bytes(self.array(&what)?))),
            4 => Value::U64(u64::from(self.u32(&what)?)),
            5 => Value::I64(i64::from(i32::from_le_bytes(self.array(&what)?))),
            6 => Value::F64(f64::from(f32::from_le_bytes(self.array(&what)?))),
            7 => Value::Bool(self.array::<1>(&what)?[0] != 0),
            8 => Value::Str(self.string(&what)?),
            9 => Value::Array(self.elements(key)?),
            10 => Value::U64(self.u64(&what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            found => return Err(self.bad_type(key, found)),
        })
    }

    /// An array's element type, count and elements, each element read as [`Cursor::value`] reads a
    /// scalar of its type, into storage of its kind.
    fn elements(&mut self, key: &str) -> Result<Array, GgufError> {
        let what = || format!("metadata {key:?}");
        let elem = self.u32(&what)?;
        let n = self.bounded(MAX_ARRAY, &what)?;
        // A count is only a claim until its elements are read: reserve no more than a modest amount
        // up front.
        let reserve = n.min(1 << 16) as usize;
        macro_rules! read {
            ($variant:ident) => {{
                let mut items = Vec::with_capacity(reserve);
                for _ in 0..n {
                    match self.value(elem, key)? {
                        Value::$variant(v) => items.push(v),
                        _ => unreachable!("element type {elem} reads as one kind"),
                    }
                }
                Array::$variant(items)
            }};
        }
        Ok(match elem {
            0 | 2 | 4 | 10 => read!(U64),
            1 | 3 | 5 | 11 => read!(I64),
            6 | 12 => read!(F64),
            7 => read!(Bool),
            8 => {
                let mut strings = Strings { text: String::new(), ends: Vec::with_capacity(reserve) };
                for _ in 0..n {
                    let s = self.str(&what)?;
                    if !strings.push(s) {
                        return Err(GgufError::TooLarge {
                            path: self.path.into(),
                            what: format!("the text of metadata array {key:?}"),
                            max: u64::from(u32::MAX),
                            found: (strings.text.len() + s.len()) as u64,
                        });
                    }
                }
                Array::Str(strings)
            }
            found => return Err(self.bad_type(key, found)),
        })
    }

    fn bad_type(&self, key: &str, found: u32) -> GgufError {
        GgufError::Invalid {
            path: self.path.into(),
            what: format!("metadata {key:?}"),
            expected: "a value type 0..=12 (arrays not nested)".into(),
            found: format!("type {found}"),
        }
    }
}

impl Gguf {
    /// Opens, maps and validates a GGUF file.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |source| GgufError::Io { path: path.into(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: a shared, read-only mapping of the file. Its bytes are only as stable as the file: a
        // model in pdhost's cache is written once and renamed into place, never changed after; a file the
        // user names (`--model PATH`, a backend config's `model`) must not be changed or truncated while
        // pdhost runs (truncated, a read of it is SIGBUS; rewritten, the weights change under the
        // identity taken at load). The module docs and the README's `--model` say so.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let mut c = Cursor { path, bytes: &map, at: 0 };
        let magic = c.take(4, &|| "magic".into())?;
        if magic != b"GGUF" {
            return Err(GgufError::BadMagic { path: path.into(), found: magic.to_vec() });
        }
        let version = c.u32(&|| "version".into())?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion { path: path.into(), found: version });
        }
        let n_tensors = c.bounded(MAX_ENTRIES, &|| "tensor count".into())?;
        let n_kv = c.bounded(MAX_ENTRIES, &|| "metadata count".into())?;
        let mut metadata = BTreeMap::new();
        // Each item's errors say which of how many the header declares: a count too high shows as a read
        // past the last real item.
        for i in 0..n_kv {
            let key = c.string(&|| format!("metadata key {i} of the {n_kv} declared"))?;
            let ty = c.u32(&|| format!("type of metadata {key:?}"))?;
            let value = c.value(ty, &key)?;
            if metadata.contains_key(&key) {
                // Which one a reader took would decide the model (llama.cpp refuses them too).
                return Err(GgufError::Invalid {
                    path: path.into(),
                    what: format!("metadata {key:?}"),
                    expected: "each key once".into(),
                    found: "it again".into(),
                });
            }
            metadata.insert(key, value);
        }
        let mut infos = Vec::new();
        for i in 0..n_tensors {
            let name = c.string(&|| format!("tensor {i} of the {n_tensors} declared: its name"))?;
            let what = || format!("tensor {name:?}");
            let n_dims = c.u32(&what)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(GgufError::Invalid {
                    path: path.into(),
                    what: what(),
                    expected: format!("1..={MAX_DIMS} dimensions"),
                    found: n_dims.to_string(),
                });
            }
            let dims = (0..n_dims).map(|_| c.u64(&what)).collect::<Result<Vec<_>, _>>()?;
            let ty_id = c.u32(&what)?;
            let offset = c.u64(&what)?;
            infos.push((name, dims, ty_id, offset));
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(Value::U64(a)) if a.is_power_of_two() && *a <= 1 << 16 => *a,
            Some(v) => {
                return Err(GgufError::Invalid {
                    path: path.into(),
                    what: "general.alignment".into(),
                    expected: "a power of two up to 65536".into(),
                    found: v.describe(),
                })
            }
        };
        let data_start = (c.at as u64).next_multiple_of(alignment);
        let file_len = map.len() as u64;
        let mut tensors = BTreeMap::new();
        for (name, dims, ty_id, rel) in infos {
            let invalid = |expected: String, found: String| GgufError::Invalid {
                path: path.into(),
                what: format!("tensor {name:?}"),
                expected,
                found,
            };
            let ty = GgmlType::from_id(ty_id).ok_or_else(|| {
                invalid(
                    "a supported type (F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K)".into(),
                    format!("ggml type {ty_id}"),
                )
            })?;
            let elems = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).ok_or_else(|| {
                invalid("dimensions whose product fits 64 bits".into(), format!("dimensions {}", words::shape(&dims)))
            })?;
            // Blocks run along dimension 0, so each row of it is whole blocks, as ggml requires.
            let len = ty.bytes_for(elems).filter(|_| dims[0] % ty.block_elems() as u64 == 0).ok_or_else(|| {
                invalid(
                    format!("rows of whole {}-weight blocks of {}", ty.block_elems(), ty.name()),
                    format!("dimensions {}", words::shape(&dims)),
                )
            })?;
            if rel % alignment != 0 {
                return Err(invalid(format!("an offset aligned to {alignment}"), rel.to_string()));
            }
            let offset = data_start.checked_add(rel).filter(|o| o.checked_add(len).is_some_and(|end| end <= file_len));
            let Some(offset) = offset else {
                return Err(invalid(
                    format!("data inside the {file_len}-byte file"),
                    format!("{len} bytes at data offset {rel}"),
                ));
            };
            if tensors.insert(name.clone(), TensorInfo { dims, ty, offset, len }).is_some() {
                return Err(invalid("a unique name".into(), "a duplicate".into()));
            }
        }
        // Every tensor its own bytes: tensors that shared one region would let a small file ask the
        // loader for their f32 copies many times over (thousands of norms on one block of data).
        let mut spans: Vec<(u64, u64, &String)> =
            tensors.iter().map(|(n, t)| (t.offset - data_start, t.offset - data_start + t.len, n)).collect();
        spans.sort_unstable();
        if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
            return Err(GgufError::Invalid {
                path: path.into(),
                what: format!("tensor {:?}", w[1].2),
                expected: format!("data after tensor {:?}'s, which ends at data offset {}", w[0].2, w[0].1),
                found: format!("data from data offset {}", w[1].0),
            });
        }
        Ok(Gguf { path: path.into(), map: std::sync::Arc::new(map), version, metadata, tensors })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn invalid(&self, what: &str, expected: &str, found: String) -> GgufError {
        GgufError::Invalid { path: self.path.clone(), what: what.into(), expected: expected.into(), found }
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Result<&Value, GgufError> {
        self.metadata.get(key).ok_or_else(|| self.invalid(key, "a metadata key", "none".into()))
    }

    /// `get`'s value where the key is present (a value of the wrong type is its error), `None` where it is
    /// not: `get` is [`Gguf::get_u64`] or another typed getter.
    pub fn optional<'a, T>(
        &'a self,
        key: &str,
        get: impl FnOnce(&'a Self, &str) -> Result<T, GgufError>,
    ) -> Result<Option<T>, GgufError> {
        if self.metadata.contains_key(key) {
            get(self, key).map(Some)
        } else {
            Ok(None)
        }
    }

    /// An unsigned integer value.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        match self.get(key)? {
            Value::U64(v) => Ok(*v),
            Value::I64(v) if *v >= 0 => Ok(*v as u64),
            v => Err(self.invalid(key, "an unsigned integer", v.type_name().into())),
        }
    }

    /// A float value.
    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        match self.get(key)? {
            Value::F64(v) => Ok(*v),
            v => Err(self.invalid(key, "a float", v.type_name().into())),
        }
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.get(key)? {
            Value::Str(v) => Ok(v),
            v => Err(self.invalid(key, "a string", v.type_name().into())),
        }
    }

    /// An array value.
    pub fn get_array(&self, key: &str) -> Result<&Array, GgufError> {
        match self.get(key)? {
            Value::Array(v) => Ok(v),
            v => Err(self.invalid(key, "an array", v.type_name().into())),
        }
    }

    /// An array of strings.
    pub fn get_strings(&self, key: &str) -> Result<&Strings, GgufError> {
        match self.get_array(key)? {
            Array::Str(v) => Ok(v),
            a if a.is_empty() => Ok(const { &Strings { text: String::new(), ends: Vec::new() } }),
            a => Err(self.invalid(key, "an array of strings", a.describe())),
        }
    }

    /// A tensor's description.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensors
            .get(name)
            .ok_or_else(|| self.invalid(&format!("tensor {name:?}"), "a tensor of the model", "none".into()))
    }

    /// A tensor's raw bytes.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8], GgufError> {
        let t = self.tensor(name)?;
        // Bounds checked in `open`.
        Ok(&self.map[t.offset as usize..(t.offset + t.len) as usize])
    }

    /// The bytes of the tensor data from file offset `start` to `end` (every tensor's data lies inside
    /// the file, checked in `open`).
    pub fn data_bytes(&self, start: u64, end: u64) -> &[u8] {
        let end = (end as usize).min(self.map.len());
        &self.map[(start as usize).min(end)..end]
    }

    /// A tensor's raw bytes, shared with the mapping (which lives as long as any of them).
    pub fn tensor_shared(&self, name: &str) -> Result<crate::kernels::BlockBytes, GgufError> {
        let t = self.tensor(name)?;
        // Bounds checked in `open`.
        let range = t.offset as usize..(t.offset + t.len) as usize;
        Ok(crate::kernels::BlockBytes::Mapped { map: crate::kernels::FileMap::of_file(self.map.clone()), range })
    }

    /// A tensor dequantized to f32, in GGML order (innermost dimension fastest).
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let t = self.tensor(name)?;
        let mut out = vec![0f32; t.elems() as usize];
        dequantize(t.ty, self.tensor_bytes(name)?, &mut out);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open_result(name: &str, bytes: &[u8]) -> Result<Gguf, String> {
        let path = std::env::temp_dir().join(format!("pdhost-gguf-test-{}-{name}", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        let result = Gguf::open(&path).map_err(|e| e.to_string().replace(&path.display().to_string(), "FILE"));
        std::fs::remove_file(&path).unwrap();
        result
    }

    fn open(name: &str, bytes: &[u8]) -> String {
        open_result(name, bytes).unwrap_err()
    }

    /// A version-3 file with no tensors and the given (key, type, value bytes) entries.
    fn file_with(entries: &[(&str, u32, Vec<u8>)]) -> Vec<u8> {
        let mut file = b"GGUF".to_vec();
        file.extend(3u32.to_le_bytes());
        file.extend(0u64.to_le_bytes());
        file.extend((entries.len() as u64).to_le_bytes());
        for (key, ty, value) in entries {
            file.extend((key.len() as u64).to_le_bytes());
            file.extend(key.as_bytes());
            file.extend(ty.to_le_bytes());
            file.extend(value);
        }
        file
    }

    /// An array's bytes: element type, count, elements.
    fn array(elem: u32, n: u64, elements: &[u8]) -> Vec<u8> {
        [&elem.to_le_bytes()[..], &n.to_le_bytes(), elements].concat()
    }

    fn gguf_string(s: &str) -> Vec<u8> {
        [&(s.len() as u64).to_le_bytes()[..], s.as_bytes()].concat()
    }

    #[test]
    fn arrays_are_held_by_element_type_and_strings_end_to_end() {
        let words = ["<pad>", "", "\u{2581}the", "日本"];
        let file = file_with(&[
            ("words", 9, array(8, 4, &words.map(gguf_string).concat())),
            ("types", 9, array(5, 3, &[1i32, -2, 6].map(i32::to_le_bytes).concat())),
            ("scores", 9, array(6, 2, &[0.5f32, -1.25].map(f32::to_le_bytes).concat())),
            ("flags", 9, array(7, 2, &[1, 0])),
            ("none", 9, array(4, 0, &[])),
        ]);
        let g = open_result("arrays", &file).unwrap();
        let strings = g.get_strings("words").unwrap();
        assert_eq!(strings.iter().collect::<Vec<_>>(), words);
        assert_eq!((strings.len(), strings.get(3), strings.get(4)), (4, Some("日本"), None));
        assert_eq!(*strings, words.into_iter().collect::<Strings>());
        assert_eq!(format!("{strings:?}"), "Strings { len: 4, bytes: 17 }");
        assert_eq!(g.get_array("types").unwrap(), &Array::I64(vec![1, -2, 6]));
        assert_eq!(g.get_array("scores").unwrap(), &Array::F64(vec![0.5, -1.25]));
        assert_eq!(g.get_array("flags").unwrap(), &Array::Bool(vec![true, false]));
        // An empty array is an empty array of strings too (GGUF writers type empty arrays as they like).
        assert!(g.get_strings("none").unwrap().is_empty());
        let err = g.get_strings("types").unwrap_err().to_string();
        assert_eq!(
            err.replace(&g.path().display().to_string(), "FILE"),
            "FILE: types: expected an array of strings, found an array of 3 signed integers"
        );
    }

    #[test]
    fn arrays_in_arrays_and_bad_strings_in_arrays_are_refused() {
        let nested = file_with(&[("outer", 9, array(9, 1, &array(4, 0, &[])))]);
        assert_eq!(
            open("nested", &nested),
            "FILE: metadata \"outer\": expected a value type 0..=12 (arrays not nested), found type 9"
        );
        let bad_utf8 = file_with(&[(
            "words",
            9,
            array(8, 2, &[gguf_string("ok"), vec![2, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xfe]].concat()),
        )]);
        assert_eq!(open("utf8", &bad_utf8), "FILE: metadata \"words\": expected UTF-8, found invalid byte at 0");
        let short = file_with(&[("words", 9, array(8, 3, &gguf_string("only one")))]);
        assert!(
            open("short", &short).starts_with("FILE: truncated reading metadata \"words\""),
            "{}",
            open("short", &short)
        );
    }

    #[test]
    fn a_key_twice_and_an_optional_key_of_the_wrong_type_are_refused() {
        let twice = file_with(&[("k", 4, 7u32.to_le_bytes().to_vec()), ("k", 4, 8u32.to_le_bytes().to_vec())]);
        assert_eq!(open("twice", &twice), "FILE: metadata \"k\": expected each key once, found it again");
        let g = open_result("optional", &file_with(&[("k", 8, gguf_string("seven"))])).unwrap();
        assert_eq!(g.optional("absent", Gguf::get_u64).unwrap(), None);
        let err = g.optional("k", Gguf::get_u64).unwrap_err().to_string();
        assert_eq!(
            err.replace(&g.path().display().to_string(), "FILE"),
            "FILE: k: expected an unsigned integer, found a string"
        );
        assert_eq!(g.optional("k", Gguf::get_str).unwrap(), Some("seven"));
    }

    /// Blocks run along a tensor's first dimension: 64 Q8_0 weights as 4 rows of 16 are whole blocks in
    /// all, but no row is.
    #[test]
    fn rows_of_part_blocks_are_refused() {
        let tensor = |dims: &[u64]| {
            let mut file = b"GGUF".to_vec();
            file.extend(3u32.to_le_bytes());
            file.extend(1u64.to_le_bytes());
            file.extend(0u64.to_le_bytes());
            file.extend(gguf_string("w"));
            file.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| file.extend(d.to_le_bytes()));
            file.extend(8u32.to_le_bytes()); // Q8_0
            file.extend(0u64.to_le_bytes());
            file.resize(file.len().next_multiple_of(32) + 2 * 34, 0);
            file
        };
        assert!(open_result("rows", &tensor(&[32, 2])).is_ok());
        assert_eq!(
            open("part rows", &tensor(&[16, 4])),
            "FILE: tensor \"w\": expected rows of whole 32-weight blocks of Q8_0, found dimensions [16 x 4]"
        );
    }

    /// A version-3 file with no metadata and F32 tensors of 8 values at the given data offsets.
    fn file_with_tensors(offsets: &[u64]) -> Vec<u8> {
        let mut file = b"GGUF".to_vec();
        file.extend(3u32.to_le_bytes());
        file.extend((offsets.len() as u64).to_le_bytes());
        file.extend(0u64.to_le_bytes());
        for (i, &at) in offsets.iter().enumerate() {
            file.extend(gguf_string(&format!("t{i}")));
            file.extend(1u32.to_le_bytes());
            file.extend(8u64.to_le_bytes());
            file.extend(0u32.to_le_bytes());
            file.extend(at.to_le_bytes());
        }
        file.resize(file.len().next_multiple_of(32) + 128, 0);
        file
    }

    #[test]
    fn tensors_that_share_bytes_are_refused() {
        assert_eq!(open_result("apart", &file_with_tensors(&[0, 32, 64])).unwrap().tensors.len(), 3);
        assert_eq!(
            open("shared", &file_with_tensors(&[0, 64, 32, 64])),
            "FILE: tensor \"t3\": expected data after tensor \"t1\"'s, which ends at data offset 96, found data \
             from data offset 64"
        );
    }

    #[test]
    fn a_file_that_is_not_gguf_is_named_by_its_first_bytes() {
        assert_eq!(
            open("readme", b"# pdhost\n\nA host"),
            "FILE: expected the GGUF magic \"GGUF\" at the start of a GGUF file, found a file starting with \"# pd\""
        );
        assert_eq!(
            open("elf", b"\x7fELF\x02\x01\x01\x00"),
            "FILE: expected the GGUF magic \"GGUF\" at the start of a GGUF file, found a file starting with bytes \
             7f 45 4c 46 (\".ELF\")"
        );
    }

    #[test]
    fn a_bad_metadata_value_is_named_by_its_type_not_its_contents() {
        // Version 3, no tensors, one key: general.alignment = "x" (a string, not a power of two).
        let mut file = b"GGUF".to_vec();
        file.extend(3u32.to_le_bytes());
        file.extend(0u64.to_le_bytes());
        file.extend(1u64.to_le_bytes());
        let key = b"general.alignment";
        file.extend((key.len() as u64).to_le_bytes());
        file.extend(key);
        file.extend(8u32.to_le_bytes());
        file.extend(1u64.to_le_bytes());
        file.push(b'x');
        assert_eq!(
            open("alignment", &file),
            "FILE: general.alignment: expected a power of two up to 65536, found a string of 1 byte"
        );
        let array = Value::Array(Array::U64(vec![1, 7]));
        assert_eq!(array.describe(), "an array of 2 unsigned integers");
        assert_eq!(Value::U64(7).describe(), "the unsigned integer 7");
        assert_eq!(Value::Array(Array::Str(Strings::default())).describe(), "an empty array");
    }
}
