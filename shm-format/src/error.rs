//! Every way a span can be rejected. Each variant names what was expected and what was found.

use crate::manifest::EntryKind;
use crate::words;

/// Why a span was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SpanError {
    /// Fewer bytes than the fixed header.
    #[error("span is truncated: expected at least {expected} header bytes, found {found}")]
    TruncatedHeader {
        /// Header length.
        expected: u64,
        /// Bytes available.
        found: u64,
    },
    /// The first 8 bytes are not the frame magic.
    #[error("bad magic: expected {}, found {}", words::bytes(expected), words::bytes(found))]
    BadMagic {
        /// `PDKVSPAN`.
        expected: [u8; 8],
        /// What the header holds.
        found: [u8; 8],
    },
    /// A major version this reader does not know.
    #[error("unsupported format major version: expected {expected}, found {found}")]
    UnsupportedMajorVersion {
        /// The reader's major version.
        expected: u16,
        /// The writer's.
        found: u16,
    },
    /// Reserved flag bits are set.
    #[error("unknown flags: expected only bits {known:#x}, found {found:#x}")]
    UnknownFlags {
        /// Bits this version defines.
        known: u32,
        /// Bits the header holds.
        found: u32,
    },
    /// `header_len` is not a multiple of 8 inside `[min, max]`.
    #[error("bad header length: expected a multiple of 8 in {min}..={max}, found {found}")]
    BadHeaderLen {
        /// 64.
        min: u32,
        /// The largest accepted.
        max: u32,
        /// What the header holds.
        found: u32,
    },
    /// `manifest_len` is zero or too large.
    #[error("bad manifest length: expected 1..={max} bytes, found {found}")]
    BadManifestLen {
        /// The largest accepted.
        max: u32,
        /// What the header holds.
        found: u32,
    },
    /// `payload_len` is too large.
    #[error("payload too large: expected at most {max} bytes, found {found}")]
    PayloadTooLarge {
        /// The largest accepted.
        max: u64,
        /// What the header holds.
        found: u64,
    },
    /// Fewer bytes than the header says the frame has.
    #[error("span is truncated: expected {expected} bytes, found {found}")]
    Truncated {
        /// Frame length from the header.
        expected: u64,
        /// Bytes available.
        found: u64,
    },
    /// More bytes than the header says the frame has.
    #[error("trailing bytes after the span: expected {expected} bytes, found {found}")]
    TrailingBytes {
        /// Frame length from the header.
        expected: u64,
        /// Bytes available.
        found: u64,
    },
    /// Padding between manifest and payload is not zero.
    #[error("padding byte at frame offset {offset} is nonzero: expected 0, found {found:#04x}")]
    NonZeroPadding {
        /// Frame offset of the first nonzero padding byte.
        offset: u64,
        /// Its value.
        found: u8,
    },
    /// The checksum over the copied frame differs from the header's.
    #[error(
        "checksum mismatch: expected {expected:#018x} (from the header), found {found:#018x} over the copied frame"
    )]
    ChecksumMismatch {
        /// What the header claims.
        expected: u64,
        /// What the reader computed on its private copy.
        found: u64,
    },
    /// The manifest is not valid postcard for this version.
    #[error(
        "manifest does not decode: expected a v1 postcard manifest, found {len} bytes that do not decode as one ({reason})"
    )]
    ManifestDecode {
        /// `manifest_len`.
        len: u64,
        /// Why, in words (see [`crate::words::postcard_failure`]).
        reason: &'static str,
    },
    /// The manifest decodes but leaves bytes unread.
    #[error("manifest has trailing bytes: expected {expected} bytes, found {found}")]
    ManifestTrailingBytes {
        /// Bytes the manifest used.
        expected: u64,
        /// `manifest_len`.
        found: u64,
    },
    /// A list is longer than the reader accepts.
    #[error("too many {what}: expected at most {max}, found {found}")]
    TooMany {
        /// What list.
        what: &'static str,
        /// The largest accepted.
        max: usize,
        /// Its length.
        found: usize,
    },
    /// Unknown dtype code.
    #[error("unknown dtype code: expected 0 (f32), 1 (f16) or 2 (bf16), found {found}")]
    UnknownDtype {
        /// The code.
        found: u8,
    },
    /// Unknown entry kind code.
    #[error("layer {layer}: unknown entry kind: expected 0 (k), 1 (v) or 2 (state), found {found}")]
    UnknownEntryKind {
        /// Layer of the entry.
        layer: u32,
        /// The code.
        found: u8,
    },
    /// Unknown group kind code.
    #[error("group {group}: unknown group kind: expected 0 (full), 1 (sliding) or 2 (recurrent), found {found}")]
    UnknownGroupKind {
        /// Group id.
        group: u32,
        /// The code.
        found: u8,
    },
    /// A sliding group with window 0.
    #[error("group {group}: expected a sliding window of at least 1 token, found 0")]
    ZeroWindow {
        /// Group id.
        group: u32,
    },
    /// `token_start >= token_end`.
    #[error("bad token range: expected start < end, found [{start}, {end})")]
    BadTokenRange {
        /// Start.
        start: u64,
        /// End.
        end: u64,
    },
    /// A dense layout with a zero dimension.
    #[error("dense layout has a zero dimension: expected nonzero layers, kv_heads and head_dim, found {num_layers}, {kv_heads}, {head_dim}")]
    EmptyDenseLayout {
        /// Layers.
        num_layers: u32,
        /// KV heads.
        kv_heads: u32,
        /// Head dim.
        head_dim: u32,
    },
    /// A grouped layout with no groups, or a group with no layers.
    #[error("grouped layout is empty: expected at least one group with at least one layer, found {what}")]
    EmptyGroup {
        /// What is empty.
        what: String,
    },
    /// Two groups share an id.
    #[error("duplicate group id {group}: expected each group id once")]
    DuplicateGroup {
        /// The id.
        group: u32,
    },
    /// A layer is listed in two groups, or twice in one.
    #[error("layer {layer} appears in groups more than once: expected each layer in exactly one group")]
    DuplicateLayer {
        /// The layer.
        layer: u32,
    },
    /// Two entries with the same layer and kind.
    #[error("duplicate entry for layer {layer} {kind}: expected one")]
    DuplicateEntry {
        /// Layer.
        layer: u32,
        /// Kind.
        kind: EntryKind,
    },
    /// An entry for a layer the layout does not have.
    #[error("entry for layer {layer} {kind}: expected a layer of the layout ({expected}), found none")]
    LayerNotInLayout {
        /// Layer.
        layer: u32,
        /// Kind.
        kind: EntryKind,
        /// What the layout allows.
        expected: String,
    },
    /// An entry kind the layer's group does not carry (state in an attention group, K/V in a recurrent one).
    #[error("layer {layer}: expected {expected} entries for its group, found a {found} entry")]
    WrongEntryKind {
        /// Layer.
        layer: u32,
        /// What its group carries.
        expected: &'static str,
        /// What was found.
        found: EntryKind,
    },
    /// A layer of the layout has no entry of a kind it must carry.
    #[error("layer {layer} has no {kind} entry: expected one")]
    MissingEntry {
        /// Layer.
        layer: u32,
        /// Kind.
        kind: EntryKind,
    },
    /// Shape rank is wrong.
    #[error("layer {layer} {kind}: expected rank {expected}, found shape {}", words::shape(found))]
    BadRank {
        /// Layer.
        layer: u32,
        /// Kind.
        kind: EntryKind,
        /// Expected rank (or max rank for state).
        expected: usize,
        /// The shape.
        found: Vec<u64>,
    },
    /// A K/V shape whose token dimension differs from the token range.
    #[error("layer {layer} {kind}: expected {expected} tokens (the span's range), found {found}")]
    TokenDimMismatch {
        /// Layer.
        layer: u32,
        /// Kind.
        kind: EntryKind,
        /// Tokens in the range.
        expected: u64,
        /// Shape's first dimension.
        found: u64,
    },
    /// A shape with a zero dimension.
    #[error("layer {layer} {kind}: expected every dimension >= 1, found shape {}", words::shape(shape))]
    ZeroDimension {
        /// Layer.
        layer: u32,
        /// Kind.
        kind: EntryKind,
        /// The shape.
        shape: Vec<u64>,
    },
    /// Shape does not multiply to the entry's byte length.
    #[error(
        "layer {layer} {kind}: expected {expected} bytes for shape {} in {dtype}, found len {found}",
        words::shape(shape)
    )]
    ShapeLenMismatch {
        /// Layer.
        layer: u32,
        /// Kind.
        kind: EntryKind,
        /// The shape.
        shape: Vec<u64>,
        /// Dtype name.
        dtype: &'static str,
        /// Product times dtype size, saturating at `u128::MAX`.
        expected: u128,
        /// The entry's len.
        found: u64,
    },
    /// An entry that does not lie inside the payload.
    #[error(
        "layer {layer} {kind}: expected bytes inside the {payload_len}-byte payload, found [{offset}, {offset}+{len})"
    )]
    EntryOutOfBounds {
        /// Layer.
        layer: u32,
        /// Kind.
        kind: EntryKind,
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Payload length.
        payload_len: u64,
    },
    /// An entry that does not start on a whole element: its values would straddle the dtype's boundaries.
    #[error("layer {layer} {kind}: expected an offset that is a multiple of {dtype}'s {size} bytes, found {offset}")]
    MisalignedEntry {
        /// Layer.
        layer: u32,
        /// Kind.
        kind: EntryKind,
        /// Dtype name.
        dtype: &'static str,
        /// The dtype's size in bytes.
        size: u64,
        /// The entry's offset.
        offset: u64,
    },
    /// Two entries share bytes.
    #[error("entries overlap: expected disjoint byte ranges, found layer {first_layer} {first_kind} ends at {first_end}, layer {second_layer} {second_kind} starts at {second_start}")]
    EntryOverlap {
        /// Earlier entry's layer.
        first_layer: u32,
        /// Earlier entry's kind.
        first_kind: EntryKind,
        /// Its end offset.
        first_end: u64,
        /// Later entry's layer.
        second_layer: u32,
        /// Later entry's kind.
        second_kind: EntryKind,
        /// Its start offset.
        second_start: u64,
    },
    /// A dense entry that is not where the dense layout puts it.
    #[error(
        "dense layer {layer} {kind}: expected shape {} at offset {expected_offset}, found {} at {found_offset}",
        words::shape(expected_shape),
        words::shape(found_shape)
    )]
    DenseEntryMisplaced {
        /// Layer.
        layer: u32,
        /// Kind.
        kind: EntryKind,
        /// Where the layout puts it.
        expected_offset: u64,
        /// Where the entry says it is.
        found_offset: u64,
        /// `[tokens, kv_heads, head_dim]`.
        expected_shape: Vec<u64>,
        /// The entry's shape.
        found_shape: Vec<u64>,
    },
    /// The payload is not exactly the tensor the dense layout describes.
    #[error("dense payload length: expected {expected} bytes, found {found}")]
    DensePayloadLen {
        /// `2 * layers * S`.
        expected: u128,
        /// `payload_len`.
        found: u64,
    },
    /// The frame's epoch is not the producer's current one.
    #[error("wrong producer epoch: expected {expected}, found {found}")]
    WrongEpoch {
        /// The epoch the host gave.
        expected: u64,
        /// The header's.
        found: u64,
    },
    /// The frame names a slot generation other than the one the host granted.
    #[error("stale slot generation: expected {expected}, found {found}")]
    StaleGeneration {
        /// Granted generation.
        expected: u64,
        /// The header's.
        found: u64,
    },
    /// A sequence number out of order: a replay or a gap.
    #[error("unexpected sequence number: expected {expected}, found {found}")]
    UnexpectedSequence {
        /// Next sequence.
        expected: u64,
        /// The header's.
        found: u64,
    },
    /// The header describes a frame longer than its ring slot.
    #[error("frame does not fit its slot: expected at most {capacity} bytes, found {found}")]
    FrameExceedsSlot {
        /// Slot capacity.
        capacity: u64,
        /// Frame length.
        found: u64,
    },
}

/// Every value [`SpanError::kind`] can return.
pub const ALL_KINDS: &[&str] = &[
    "truncated_header",
    "bad_magic",
    "unsupported_major_version",
    "unknown_flags",
    "bad_header_len",
    "bad_manifest_len",
    "payload_too_large",
    "truncated",
    "trailing_bytes",
    "nonzero_padding",
    "checksum_mismatch",
    "manifest_decode",
    "manifest_trailing_bytes",
    "too_many",
    "unknown_dtype",
    "unknown_entry_kind",
    "unknown_group_kind",
    "zero_window",
    "bad_token_range",
    "empty_dense_layout",
    "empty_group",
    "duplicate_group",
    "duplicate_layer",
    "duplicate_entry",
    "layer_not_in_layout",
    "wrong_entry_kind",
    "missing_entry",
    "bad_rank",
    "token_dim_mismatch",
    "zero_dimension",
    "shape_len_mismatch",
    "entry_out_of_bounds",
    "misaligned_entry",
    "entry_overlap",
    "dense_entry_misplaced",
    "dense_payload_len",
    "wrong_epoch",
    "stale_generation",
    "unexpected_sequence",
    "frame_exceeds_slot",
];

impl SpanError {
    /// A stable snake_case name for the rejection, used in JSON output, metrics and fixture verdicts.
    pub fn kind(&self) -> &'static str {
        match self {
            SpanError::TruncatedHeader { .. } => "truncated_header",
            SpanError::BadMagic { .. } => "bad_magic",
            SpanError::UnsupportedMajorVersion { .. } => "unsupported_major_version",
            SpanError::UnknownFlags { .. } => "unknown_flags",
            SpanError::BadHeaderLen { .. } => "bad_header_len",
            SpanError::BadManifestLen { .. } => "bad_manifest_len",
            SpanError::PayloadTooLarge { .. } => "payload_too_large",
            SpanError::Truncated { .. } => "truncated",
            SpanError::TrailingBytes { .. } => "trailing_bytes",
            SpanError::NonZeroPadding { .. } => "nonzero_padding",
            SpanError::ChecksumMismatch { .. } => "checksum_mismatch",
            SpanError::ManifestDecode { .. } => "manifest_decode",
            SpanError::ManifestTrailingBytes { .. } => "manifest_trailing_bytes",
            SpanError::TooMany { .. } => "too_many",
            SpanError::UnknownDtype { .. } => "unknown_dtype",
            SpanError::UnknownEntryKind { .. } => "unknown_entry_kind",
            SpanError::UnknownGroupKind { .. } => "unknown_group_kind",
            SpanError::ZeroWindow { .. } => "zero_window",
            SpanError::BadTokenRange { .. } => "bad_token_range",
            SpanError::EmptyDenseLayout { .. } => "empty_dense_layout",
            SpanError::EmptyGroup { .. } => "empty_group",
            SpanError::DuplicateGroup { .. } => "duplicate_group",
            SpanError::DuplicateLayer { .. } => "duplicate_layer",
            SpanError::DuplicateEntry { .. } => "duplicate_entry",
            SpanError::LayerNotInLayout { .. } => "layer_not_in_layout",
            SpanError::WrongEntryKind { .. } => "wrong_entry_kind",
            SpanError::MissingEntry { .. } => "missing_entry",
            SpanError::BadRank { .. } => "bad_rank",
            SpanError::TokenDimMismatch { .. } => "token_dim_mismatch",
            SpanError::ZeroDimension { .. } => "zero_dimension",
            SpanError::ShapeLenMismatch { .. } => "shape_len_mismatch",
            SpanError::EntryOutOfBounds { .. } => "entry_out_of_bounds",
            SpanError::MisalignedEntry { .. } => "misaligned_entry",
            SpanError::EntryOverlap { .. } => "entry_overlap",
            SpanError::DenseEntryMisplaced { .. } => "dense_entry_misplaced",
            SpanError::DensePayloadLen { .. } => "dense_payload_len",
            SpanError::WrongEpoch { .. } => "wrong_epoch",
            SpanError::StaleGeneration { .. } => "stale_generation",
            SpanError::UnexpectedSequence { .. } => "unexpected_sequence",
            SpanError::FrameExceedsSlot { .. } => "frame_exceeds_slot",
        }
    }
}
