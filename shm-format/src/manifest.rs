//! The span manifest: what a frame's payload holds, keyed by model layer id.
//!
//! On the wire the manifest is `postcard`. Enumerations travel as raw `u8` codes in private `wire` structs so
//! that an unknown code becomes a typed [`SpanError`] naming it, not an opaque deserialisation failure. The
//! public types here are the validated, typed form.

use serde::{Deserialize, Serialize};

use crate::error::SpanError;

/// Most entries a manifest may hold. These bounds are checked once postcard has decoded the manifest,
/// and what it allocated meanwhile is bounded by the manifest's own length (at most
/// [`crate::MAX_MANIFEST_LEN`] bytes, each decoding to a few dozen bytes of `Vec`s at most); nothing is
/// allocated from the declared counts beyond that.
pub const MAX_ENTRIES: usize = 1 << 16;
/// Most groups a grouped layout may declare.
pub const MAX_GROUPS: usize = 1 << 10;
/// Highest rank of an entry's shape.
pub const MAX_RANK: usize = 8;

/// Element type of every tensor in a span.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Dtype {
    /// IEEE binary32.
    F32 = 0,
    /// IEEE binary16.
    F16 = 1,
    /// bfloat16.
    Bf16 = 2,
}

impl Dtype {
    /// Bytes per element.
    pub const fn size(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }

    /// The lower-case name used in docs and JSON.
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        }
    }

    fn from_code(code: u8) -> Result<Self, SpanError> {
        match code {
            0 => Ok(Dtype::F32),
            1 => Ok(Dtype::F16),
            2 => Ok(Dtype::Bf16),
            found => Err(SpanError::UnknownDtype { found }),
        }
    }
}

/// What one entry holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum EntryKind {
    /// Attention keys, shape `[tokens, kv_heads, head_dim]`.
    K = 0,
    /// Attention values, shape `[tokens, kv_heads, head_dim]`.
    V = 1,
    /// Recurrent state of a layer after the span's last token; any shape.
    State = 2,
}

impl EntryKind {
    /// The name used in docs and JSON.
    pub const fn name(self) -> &'static str {
        match self {
            EntryKind::K => "k",
            EntryKind::V => "v",
            EntryKind::State => "state",
        }
    }

    fn from_code(layer: u32, code: u8) -> Result<Self, SpanError> {
        match code {
            0 => Ok(EntryKind::K),
            1 => Ok(EntryKind::V),
            2 => Ok(EntryKind::State),
            found => Err(SpanError::UnknownEntryKind { layer, found }),
        }
    }
}

impl std::fmt::Display for EntryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The attention kind of a group of layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GroupKind {
    /// Full (global) attention: every position sees all earlier ones.
    Full,
    /// Sliding-window attention: position `i` sees `i - window + 1 ..= i`.
    Sliding {
        /// Window in tokens, at least 1.
        window: u32,
    },
    /// Recurrent layers carrying a fixed-size state.
    Recurrent,
}

impl GroupKind {
    /// Whether layers of this kind carry K and V entries (rather than a state entry).
    pub const fn is_attention(self) -> bool {
        !matches!(self, GroupKind::Recurrent)
    }
}

/// In words, for messages: `full attention`, `sliding window 512`, `recurrent`.
impl std::fmt::Display for GroupKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GroupKind::Full => f.write_str("full attention"),
            GroupKind::Sliding { window } => write!(f, "sliding window {window}"),
            GroupKind::Recurrent => f.write_str("recurrent"),
        }
    }
}

/// One group of a grouped layout: the model layers whose tensors form one tensor set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    /// The producer's group id; unique within the manifest.
    pub id: u32,
    /// The attention kind.
    pub kind: GroupKind,
    /// Model layer ids, unique across all groups.
    pub layers: Vec<u32>,
}

/// How the payload is organised.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Layout {
    /// One tensor `[layer][k|v][token][kv_head][head_dim]` over all `num_layers` model layers: the K entry
    /// of layer `l` starts at `2 * l * S` and its V entry at `(2 * l + 1) * S`, with
    /// `S = tokens * kv_heads * head_dim * dtype size`.
    Dense {
        /// Every layer of the model, `0..num_layers`.
        num_layers: u32,
        /// KV heads of every layer.
        kv_heads: u32,
        /// Head dimension of every layer.
        head_dim: u32,
    },
    /// One tensor set per group.
    Grouped {
        /// The groups, in producer order.
        groups: Vec<Group>,
    },
}

impl Layout {
    /// `"dense"` or `"grouped"`.
    pub const fn name(&self) -> &'static str {
        match self {
            Layout::Dense { .. } => "dense",
            Layout::Grouped { .. } => "grouped",
        }
    }
}

/// One tensor in the payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The model layer id the tensor belongs to.
    pub layer: u32,
    /// What it holds.
    pub kind: EntryKind,
    /// Its shape, outermost first.
    pub shape: Vec<u64>,
    /// Byte offset from the start of the payload.
    pub offset: u64,
    /// Byte length; equals the product of `shape` times the dtype size.
    pub len: u64,
}

/// A fingerprint of the KV geometry of a model: see [`crate::fingerprint`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Fingerprint(pub u64);

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// A decoded and structurally validated manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    /// Fingerprint of the producer's model KV geometry.
    pub fingerprint: Fingerprint,
    /// The request this span belongs to.
    pub request_id: u64,
    /// First token position covered, inclusive.
    pub token_start: u64,
    /// Last token position covered, exclusive.
    pub token_end: u64,
    /// Element type of every tensor.
    pub dtype: Dtype,
    /// How the payload is organised.
    pub layout: Layout,
    /// The tensors, in payload order or not: order carries no meaning.
    pub entries: Vec<Entry>,
}

impl Manifest {
    /// Number of tokens covered.
    pub fn tokens(&self) -> u64 {
        self.token_end - self.token_start
    }

    /// Encodes the manifest as postcard. Fails only if the manifest exceeds [`crate::MAX_MANIFEST_LEN`].
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(&wire::Manifest::from(self)).expect("encoding into a Vec cannot fail")
    }
}

/// The postcard shapes. Field order is the wire order; any change here is a new major version, because a
/// reader rejects manifest bytes it does not consume.
pub(crate) mod wire {
    use serde::{Deserialize, Serialize};

    #[derive(Serialize, Deserialize, Debug)]
    pub(crate) struct Manifest {
        pub fingerprint: u64,
        pub request_id: u64,
        pub token_start: u64,
        pub token_end: u64,
        pub dtype: u8,
        pub layout: Layout,
        pub entries: Vec<Entry>,
    }

    #[derive(Serialize, Deserialize, Debug)]
    pub(crate) enum Layout {
        Dense { num_layers: u32, kv_heads: u32, head_dim: u32 },
        Grouped { groups: Vec<Group> },
    }

    /// `kind`: 0 full, 1 sliding (uses `window`), 2 recurrent.
    #[derive(Serialize, Deserialize, Debug)]
    pub(crate) struct Group {
        pub id: u32,
        pub kind: u8,
        pub window: u32,
        pub layers: Vec<u32>,
    }

    #[derive(Serialize, Deserialize, Debug)]
    pub(crate) struct Entry {
        pub layer: u32,
        pub kind: u8,
        pub shape: Vec<u64>,
        pub offset: u64,
        pub len: u64,
    }

    impl From<&super::Manifest> for Manifest {
        fn from(m: &super::Manifest) -> Self {
            Manifest {
                fingerprint: m.fingerprint.0,
                request_id: m.request_id,
                token_start: m.token_start,
                token_end: m.token_end,
                dtype: m.dtype as u8,
                layout: match &m.layout {
                    super::Layout::Dense { num_layers, kv_heads, head_dim } => {
                        Layout::Dense { num_layers: *num_layers, kv_heads: *kv_heads, head_dim: *head_dim }
                    }
                    super::Layout::Grouped { groups } => Layout::Grouped {
                        groups: groups
                            .iter()
                            .map(|g| {
                                let (kind, window) = match g.kind {
                                    super::GroupKind::Full => (0, 0),
                                    super::GroupKind::Sliding { window } => (1, window),
                                    super::GroupKind::Recurrent => (2, 0),
                                };
                                Group { id: g.id, kind, window, layers: g.layers.clone() }
                            })
                            .collect(),
                    },
                },
                entries: m
                    .entries
                    .iter()
                    .map(|e| Entry {
                        layer: e.layer,
                        kind: e.kind as u8,
                        shape: e.shape.clone(),
                        offset: e.offset,
                        len: e.len,
                    })
                    .collect(),
            }
        }
    }
}

impl TryFrom<wire::Manifest> for Manifest {
    type Error = SpanError;

    /// Maps codes to types. Cross-field rules are checked afterwards by [`crate::validate_manifest`].
    fn try_from(w: wire::Manifest) -> Result<Self, SpanError> {
        let layout = match w.layout {
            wire::Layout::Dense { num_layers, kv_heads, head_dim } => Layout::Dense { num_layers, kv_heads, head_dim },
            wire::Layout::Grouped { groups } => {
                if groups.len() > MAX_GROUPS {
                    return Err(SpanError::TooMany { what: "groups", max: MAX_GROUPS, found: groups.len() });
                }
                let groups = groups
                    .into_iter()
                    .map(|g| {
                        let kind = match (g.kind, g.window) {
                            (0, _) => GroupKind::Full,
                            (1, 0) => return Err(SpanError::ZeroWindow { group: g.id }),
                            (1, window) => GroupKind::Sliding { window },
                            (2, _) => GroupKind::Recurrent,
                            (found, _) => return Err(SpanError::UnknownGroupKind { group: g.id, found }),
                        };
                        Ok(Group { id: g.id, kind, layers: g.layers })
                    })
                    .collect::<Result<_, _>>()?;
                Layout::Grouped { groups }
            }
        };
        if w.entries.len() > MAX_ENTRIES {
            return Err(SpanError::TooMany { what: "entries", max: MAX_ENTRIES, found: w.entries.len() });
        }
        let entries = w
            .entries
            .into_iter()
            .map(|e| {
                Ok(Entry {
                    layer: e.layer,
                    kind: EntryKind::from_code(e.layer, e.kind)?,
                    shape: e.shape,
                    offset: e.offset,
                    len: e.len,
                })
            })
            .collect::<Result<_, SpanError>>()?;
        Ok(Manifest {
            fingerprint: Fingerprint(w.fingerprint),
            request_id: w.request_id,
            token_start: w.token_start,
            token_end: w.token_end,
            dtype: Dtype::from_code(w.dtype)?,
            layout,
            entries,
        })
    }
}
