//! Decoding and structural validation of a frame held in private memory.

use std::collections::{BTreeMap, BTreeSet};

use crate::checksum::frame_checksum;
use crate::error::SpanError;
use crate::header::{HeaderInfo, HEADER_LEN};
use crate::manifest::{wire, Entry, EntryKind, Layout, Manifest, MAX_ENTRIES, MAX_RANK};
use crate::words;

/// A decoded, validated span whose bytes the reader owns.
#[derive(Clone, Debug)]
pub struct SpanView<'a> {
    /// The validated header.
    pub header: HeaderInfo,
    /// The validated manifest.
    pub manifest: Manifest,
    /// The payload; every entry of the manifest lies inside it.
    pub payload: &'a [u8],
}

impl SpanView<'_> {
    /// The bytes of one entry.
    pub fn entry_bytes(&self, entry: &Entry) -> &[u8] {
        // Validated: offset + len <= payload.len().
        &self.payload[entry.offset as usize..(entry.offset + entry.len) as usize]
    }
}

/// Decodes a whole frame (header, manifest, payload) from bytes the caller owns, such as a span file.
///
/// `bytes` must be exactly one frame: shorter is `Truncated`, longer is `TrailingBytes`.
pub fn decode_frame(bytes: &[u8]) -> Result<SpanView<'_>, SpanError> {
    let header = parse_header_prefix(bytes)?;
    check_frame_len(&header, bytes)?;
    decode_body(header, bytes, frame_checksum(bytes))
}

/// `frame` is exactly the `frame_len` bytes the header declares: shorter is `Truncated`, longer is
/// `TrailingBytes`.
fn check_frame_len(header: &HeaderInfo, frame: &[u8]) -> Result<(), SpanError> {
    let found = frame.len() as u64;
    if found < header.frame_len {
        return Err(SpanError::Truncated { expected: header.frame_len, found });
    }
    if found > header.frame_len {
        return Err(SpanError::TrailingBytes { expected: header.frame_len, found });
    }
    Ok(())
}

/// Parses the fixed header from the first 64 bytes of `bytes`.
pub fn parse_header_prefix(bytes: &[u8]) -> Result<HeaderInfo, SpanError> {
    let Some(prefix) = bytes.first_chunk::<HEADER_LEN>() else {
        return Err(SpanError::TruncatedHeader { expected: HEADER_LEN as u64, found: bytes.len() as u64 });
    };
    HeaderInfo::parse(prefix)
}

/// Validates a frame whose header has been parsed and whose checksum has been computed over exactly
/// `frame` — the ring reader computes it while copying. A `frame` that is not exactly `header.frame_len`
/// bytes is `Truncated` or `TrailingBytes`.
pub fn decode_body(header: HeaderInfo, frame: &[u8], computed_checksum: u64) -> Result<SpanView<'_>, SpanError> {
    check_frame_len(&header, frame)?;
    verify_prefix(&header, frame, computed_checksum)?;
    let manifest = decode_manifest(&frame[header.manifest_range()], header.payload_len)?;
    Ok(SpanView { header, manifest, payload: &frame[header.payload_offset as usize..] })
}

/// The frame-level checks besides the manifest: the checksum computed over the reader's copy equals the
/// header's, and the padding between manifest and payload is zero. `prefix` must hold at least the frame's
/// first `payload_offset` bytes; fewer is `Truncated`.
pub fn verify_prefix(header: &HeaderInfo, prefix: &[u8], computed_checksum: u64) -> Result<(), SpanError> {
    if computed_checksum != header.checksum {
        return Err(SpanError::ChecksumMismatch { expected: header.checksum, found: computed_checksum });
    }
    let manifest_end = header.manifest_range().end;
    let Some(padding) = prefix.get(manifest_end..header.payload_offset as usize) else {
        return Err(SpanError::Truncated { expected: header.payload_offset, found: prefix.len() as u64 });
    };
    if let Some(i) = padding.iter().position(|&b| b != 0) {
        return Err(SpanError::NonZeroPadding { offset: (manifest_end + i) as u64, found: padding[i] });
    }
    Ok(())
}

/// Decodes a postcard manifest that must use every byte, then validates it against the payload length.
pub fn decode_manifest(bytes: &[u8], payload_len: u64) -> Result<Manifest, SpanError> {
    let (wire, rest) = postcard::take_from_bytes::<wire::Manifest>(bytes)
        .map_err(|e| SpanError::ManifestDecode { len: bytes.len() as u64, reason: words::postcard_failure(&e) })?;
    if !rest.is_empty() {
        return Err(SpanError::ManifestTrailingBytes {
            expected: (bytes.len() - rest.len()) as u64,
            found: bytes.len() as u64,
        });
    }
    let manifest = Manifest::try_from(wire)?;
    validate_manifest(&manifest, payload_len)?;
    Ok(manifest)
}

/// The rule for one layer of the layout: which entry kinds it must carry and, for dense, where.
#[derive(Clone, Copy)]
struct LayerRule {
    attention: bool,
}

/// Checks every cross-field rule of a manifest describing a payload of `payload_len` bytes.
pub fn validate_manifest(m: &Manifest, payload_len: u64) -> Result<(), SpanError> {
    if m.token_start >= m.token_end {
        return Err(SpanError::BadTokenRange { start: m.token_start, end: m.token_end });
    }
    let tokens = m.tokens();
    let esize = m.dtype.size();

    // 1. The layout: which layers exist and what each must carry.
    let rules = layout_rules(&m.layout)?;

    // 2. Each entry on its own: known layer, allowed kind, unique, shape, length, bounds.
    let mut seen = BTreeSet::new();
    for e in &m.entries {
        let Some(rule) = rules.get(&e.layer) else {
            return Err(SpanError::LayerNotInLayout { layer: e.layer, kind: e.kind, expected: describe(&m.layout) });
        };
        match (rule.attention, e.kind) {
            (true, EntryKind::K | EntryKind::V) | (false, EntryKind::State) => {}
            (true, found) => return Err(SpanError::WrongEntryKind { layer: e.layer, expected: "k and v", found }),
            (false, found) => return Err(SpanError::WrongEntryKind { layer: e.layer, expected: "state", found }),
        }
        if !seen.insert((e.layer, e.kind)) {
            return Err(SpanError::DuplicateEntry { layer: e.layer, kind: e.kind });
        }
        check_shape(e, tokens, esize, m.dtype.name())?;
        let in_bounds = e.offset.checked_add(e.len).is_some_and(|end| end <= payload_len);
        if !in_bounds {
            return Err(SpanError::EntryOutOfBounds {
                layer: e.layer,
                kind: e.kind,
                offset: e.offset,
                len: e.len,
                payload_len,
            });
        }
        if e.offset % esize != 0 {
            return Err(SpanError::MisalignedEntry {
                layer: e.layer,
                kind: e.kind,
                dtype: m.dtype.name(),
                size: esize,
                offset: e.offset,
            });
        }
    }

    // 3. Every layer of the layout carries all it must.
    for (&layer, rule) in &rules {
        let kinds: &[EntryKind] = if rule.attention { &[EntryKind::K, EntryKind::V] } else { &[EntryKind::State] };
        for &kind in kinds {
            if !seen.contains(&(layer, kind)) {
                return Err(SpanError::MissingEntry { layer, kind });
            }
        }
    }

    // 4. No two entries share a byte.
    let mut by_offset: Vec<&Entry> = m.entries.iter().collect();
    by_offset.sort_by_key(|e| (e.offset, e.len));
    for pair in by_offset.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        let a_end = a.offset + a.len; // in bounds, so no overflow
        if b.offset < a_end {
            return Err(SpanError::EntryOverlap {
                first_layer: a.layer,
                first_kind: a.kind,
                first_end: a_end,
                second_layer: b.layer,
                second_kind: b.kind,
                second_start: b.offset,
            });
        }
    }

    // 5. Dense: every entry sits exactly where `[layer][k|v][token][kv_head][head_dim]` puts it.
    if let Layout::Dense { num_layers, kv_heads, head_dim } = m.layout {
        let per = u128::from(tokens) * u128::from(kv_heads) * u128::from(head_dim) * u128::from(esize);
        let expected_total = per * 2 * u128::from(num_layers);
        if expected_total != u128::from(payload_len) {
            return Err(SpanError::DensePayloadLen { expected: expected_total, found: payload_len });
        }
        // `per * 2 * num_layers == payload_len`, so every offset below fits in u64.
        let per = per as u64;
        let expected_shape = vec![tokens, u64::from(kv_heads), u64::from(head_dim)];
        for e in &m.entries {
            let slot = 2 * u64::from(e.layer) + u64::from(e.kind == EntryKind::V);
            let expected_offset = slot * per;
            if e.offset != expected_offset || e.shape != expected_shape {
                return Err(SpanError::DenseEntryMisplaced {
                    layer: e.layer,
                    kind: e.kind,
                    expected_offset,
                    found_offset: e.offset,
                    expected_shape,
                    found_shape: e.shape.clone(),
                });
            }
        }
    }
    Ok(())
}

fn layout_rules(layout: &Layout) -> Result<BTreeMap<u32, LayerRule>, SpanError> {
    let mut rules = BTreeMap::new();
    match layout {
        &Layout::Dense { num_layers, kv_heads, head_dim } => {
            if num_layers == 0 || kv_heads == 0 || head_dim == 0 {
                return Err(SpanError::EmptyDenseLayout { num_layers, kv_heads, head_dim });
            }
            // Two entries per layer, so more layers than MAX_ENTRIES / 2 cannot be described.
            if num_layers as usize > MAX_ENTRIES / 2 {
                return Err(SpanError::TooMany {
                    what: "dense layers",
                    max: MAX_ENTRIES / 2,
                    found: num_layers as usize,
                });
            }
            rules.extend((0..num_layers).map(|l| (l, LayerRule { attention: true })));
        }
        Layout::Grouped { groups } => {
            if groups.is_empty() {
                return Err(SpanError::EmptyGroup { what: "no groups".into() });
            }
            let listed: usize = groups.iter().map(|g| g.layers.len()).sum();
            if listed > MAX_ENTRIES {
                return Err(SpanError::TooMany { what: "layers in groups", max: MAX_ENTRIES, found: listed });
            }
            let mut ids = BTreeSet::new();
            for g in groups {
                if !ids.insert(g.id) {
                    return Err(SpanError::DuplicateGroup { group: g.id });
                }
                if g.layers.is_empty() {
                    return Err(SpanError::EmptyGroup { what: format!("group {} with no layers", g.id) });
                }
                let rule = LayerRule { attention: g.kind.is_attention() };
                for &layer in &g.layers {
                    if rules.insert(layer, rule).is_some() {
                        return Err(SpanError::DuplicateLayer { layer });
                    }
                }
            }
        }
    }
    Ok(rules)
}

fn check_shape(e: &Entry, tokens: u64, esize: u64, dtype: &'static str) -> Result<(), SpanError> {
    let rank_ok = match e.kind {
        EntryKind::K | EntryKind::V => e.shape.len() == 3,
        EntryKind::State => (1..=MAX_RANK).contains(&e.shape.len()),
    };
    if !rank_ok {
        let expected = if e.kind == EntryKind::State { MAX_RANK } else { 3 };
        return Err(SpanError::BadRank { layer: e.layer, kind: e.kind, expected, found: e.shape.clone() });
    }
    if e.shape.contains(&0) {
        return Err(SpanError::ZeroDimension { layer: e.layer, kind: e.kind, shape: e.shape.clone() });
    }
    if e.kind != EntryKind::State && e.shape[0] != tokens {
        return Err(SpanError::TokenDimMismatch { layer: e.layer, kind: e.kind, expected: tokens, found: e.shape[0] });
    }
    let expected = e.shape.iter().fold(u128::from(esize), |acc, &d| acc.saturating_mul(u128::from(d)));
    if expected != u128::from(e.len) {
        return Err(SpanError::ShapeLenMismatch {
            layer: e.layer,
            kind: e.kind,
            shape: e.shape.clone(),
            dtype,
            expected,
            found: e.len,
        });
    }
    Ok(())
}

fn describe(layout: &Layout) -> String {
    match layout {
        Layout::Dense { num_layers, .. } => format!("dense layers 0..{num_layers}"),
        Layout::Grouped { groups } => {
            let ids: Vec<String> = groups
                .iter()
                .map(|g| format!("group {} ({}): layers {}", g.id, g.kind, words::layers(&g.layers)))
                .collect();
            ids.join("; ")
        }
    }
}
