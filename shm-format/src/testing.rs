//! Span fixtures: small valid spans and one malformed span per rejection kind a file can show.
//!
//! `fixtures/spans/` holds these as files (checked by a test to be current) and they seed the fuzzer.
//! Ring-only rejections (epoch, generation, sequence, slot size) need a ring and are tested there.

use zerocopy::IntoBytes;

use crate::header::{FrameHeader, HEADER_LEN};
use crate::manifest::wire;
use crate::{
    encode_frame, encode_raw, seal_frame, Dtype, Entry, EntryKind, FrameCoords, Group, GroupKind, KvGeometry, LayerKv,
    Layout, Manifest,
};

/// One fixture: a file name, its bytes, and the verdict `inspect-span` must give: `None` for valid, or
/// the [`crate::SpanError::kind`] of the rejection.
#[derive(Clone, Debug)]
pub struct Fixture {
    /// File name, `*.span`.
    pub name: String,
    /// The frame bytes.
    pub bytes: Vec<u8>,
    /// `None` if valid, else the rejection kind.
    pub verdict: Option<&'static str>,
}

/// A small model with four identical full-attention layers.
pub fn tiny_dense_geometry() -> KvGeometry {
    KvGeometry { layers: vec![LayerKv::Full { kv_heads: 2, head_dim: 4 }; 4] }
}

/// Gemma 3's layer pattern: every `period`-th layer (`period - 1`, `2 * period - 1`, ...) full attention,
/// the rest sliding over `window` tokens, all with the same heads. Gemma 3 itself uses period 6, window 512,
/// one KV head of dimension 256 (`interleaved(26, 6, 512, 1, 256)` is Gemma3-1B).
pub fn interleaved(layers: u32, period: u32, window: u32, kv_heads: u32, head_dim: u32) -> KvGeometry {
    let layers = (0..layers)
        .map(|l| {
            if l % period == period - 1 {
                LayerKv::Full { kv_heads, head_dim }
            } else {
                LayerKv::Sliding { window, kv_heads, head_dim }
            }
        })
        .collect();
    KvGeometry { layers }
}

/// A small Gemma-3-like model: six layers, every third full, the rest sliding with window 4.
pub fn tiny_gemma_geometry() -> KvGeometry {
    interleaved(6, 3, 4, 1, 4)
}

/// A small hybrid model: attention, recurrent, attention.
pub fn tiny_hybrid_geometry() -> KvGeometry {
    KvGeometry {
        layers: vec![
            LayerKv::Full { kv_heads: 1, head_dim: 4 },
            LayerKv::Recurrent { state_elems: 6 },
            LayerKv::Full { kv_heads: 1, head_dim: 4 },
        ],
    }
}

/// A deterministic payload of `len` bytes.
pub fn pattern(len: u64, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn frame(m: &Manifest) -> Vec<u8> {
    frame_with_payload(m, &pattern(m.payload_len(), m.request_id as u8))
}

fn frame_with_payload(m: &Manifest, payload: &[u8]) -> Vec<u8> {
    encode_frame(m, payload, FrameCoords::default())
}

/// Encodes a manifest after a wire-level edit (for codes the typed manifest cannot hold).
fn frame_wire(m: &Manifest, edit: impl FnOnce(&mut wire::Manifest)) -> Vec<u8> {
    let mut w = wire::Manifest::from(m);
    edit(&mut w);
    let bytes = postcard::to_allocvec(&w).expect("encode");
    encode_raw(&bytes, &pattern(m.payload_len(), 0), FrameCoords::default())
}

/// Rewrites header fields of a sealed frame, optionally resealing the checksum.
fn edit_header(mut bytes: Vec<u8>, reseal: bool, edit: impl FnOnce(&mut FrameHeader)) -> Vec<u8> {
    let mut h = zerocopy::FromBytes::read_from_bytes(&bytes[..HEADER_LEN]).expect("64 bytes");
    edit(&mut h);
    bytes[..HEADER_LEN].copy_from_slice(FrameHeader::as_bytes(&h));
    if reseal {
        seal_frame(&mut bytes);
    }
    bytes
}

fn with(m: &Manifest, edit: impl FnOnce(&mut Manifest)) -> Manifest {
    let mut m = m.clone();
    edit(&mut m);
    m
}

/// The valid dense span every dense fixture starts from: 4 layers, tokens `[0, 3)`, bf16.
pub fn valid_dense() -> Manifest {
    Manifest::dense(&tiny_dense_geometry(), 7, 0..3, Dtype::Bf16).expect("uniform heads")
}

/// The valid grouped span: the Gemma-like model at a nonzero offset, tokens `[8, 11)`, f32.
pub fn valid_grouped() -> Manifest {
    Manifest::grouped(&tiny_gemma_geometry(), 8, 8..11, Dtype::F32)
}

/// Every fixture.
pub fn fixtures() -> Vec<Fixture> {
    let dense = valid_dense();
    let grouped = valid_grouped();
    let hybrid = Manifest::grouped(&tiny_hybrid_geometry(), 9, 0..2, Dtype::F16);
    let dense_bytes = frame(&dense);
    let n = dense_bytes.len();

    let mut out: Vec<(&str, Vec<u8>, Option<&'static str>)> = vec![
        ("valid-dense-bf16", dense_bytes.clone(), None),
        ("valid-grouped-f32", frame(&grouped), None),
        ("valid-grouped-recurrent-f16", frame(&hybrid), None),
        ("truncated-header", dense_bytes[..40].to_vec(), Some("truncated_header")),
        ("bad-magic", edit_header(dense_bytes.clone(), true, |h| h.magic = *b"PDKVSPAM"), Some("bad_magic")),
        (
            "major-version-2",
            edit_header(dense_bytes.clone(), true, |h| h.version_major = 2.into()),
            Some("unsupported_major_version"),
        ),
        ("unknown-flags", edit_header(dense_bytes.clone(), true, |h| h.flags = 1.into()), Some("unknown_flags")),
        (
            "bad-header-len",
            edit_header(dense_bytes.clone(), true, |h| h.header_len = 60.into()),
            Some("bad_header_len"),
        ),
        (
            "zero-manifest-len",
            edit_header(dense_bytes.clone(), true, |h| h.manifest_len = 0.into()),
            Some("bad_manifest_len"),
        ),
        (
            "payload-len-overflow",
            edit_header(dense_bytes.clone(), false, |h| h.payload_len = u64::MAX.into()),
            Some("payload_too_large"),
        ),
        ("truncated-payload", dense_bytes[..n - 1].to_vec(), Some("truncated")),
        ("trailing-byte", [dense_bytes.as_slice(), &[0]].concat(), Some("trailing_bytes")),
        ("nonzero-padding", nonzero_padding(&dense), Some("nonzero_padding")),
        ("flipped-payload-bit", flip(&dense_bytes, n - 5, 0x10), Some("checksum_mismatch")),
        ("flipped-checksum-bit", flip(&dense_bytes, crate::CHECKSUM_OFFSET, 0x01), Some("checksum_mismatch")),
        ("garbage-manifest", encode_raw(&[0xff; 10], &[0; 16], FrameCoords::default()), Some("manifest_decode")),
        ("manifest-trailing-byte", manifest_trailing_byte(&dense), Some("manifest_trailing_bytes")),
        ("too-many-groups", frame(&too_many_groups()), Some("too_many")),
        ("unknown-dtype", frame_wire(&dense, |w| w.dtype = 9), Some("unknown_dtype")),
        ("unknown-entry-kind", frame_wire(&dense, |w| w.entries[3].kind = 7), Some("unknown_entry_kind")),
        (
            "unknown-group-kind",
            frame_wire(&grouped, |w| match &mut w.layout {
                wire::Layout::Grouped { groups } => groups[1].kind = 5,
                wire::Layout::Dense { .. } => unreachable!(),
            }),
            Some("unknown_group_kind"),
        ),
        (
            "zero-window",
            frame_wire(&grouped, |w| match &mut w.layout {
                wire::Layout::Grouped { groups } => groups[0].window = 0,
                wire::Layout::Dense { .. } => unreachable!(),
            }),
            Some("zero_window"),
        ),
        ("empty-token-range", frame(&with(&dense, |m| m.token_end = m.token_start)), Some("bad_token_range")),
        (
            "dense-zero-heads",
            frame(&with(&dense, |m| {
                m.layout = Layout::Dense { num_layers: 4, kv_heads: 0, head_dim: 4 };
            })),
            Some("empty_dense_layout"),
        ),
        (
            "no-groups",
            frame(&with(&grouped, |m| {
                m.layout = Layout::Grouped { groups: vec![] };
                m.entries.clear();
            })),
            Some("empty_group"),
        ),
        ("duplicate-group-id", frame(&with(&grouped, |m| groups_mut(m)[1].id = 0)), Some("duplicate_group")),
        ("layer-in-two-groups", frame(&with(&grouped, |m| groups_mut(m)[1].layers.push(0))), Some("duplicate_layer")),
        (
            "duplicate-entry",
            frame(&with(&dense, |m| {
                let mut e = m.entries[0].clone();
                e.offset = m.entries[1].offset;
                m.entries[1] = e;
            })),
            Some("duplicate_entry"),
        ),
        (
            "dense-layer-26-of-26",
            frame(&with(&dense, |m| m.entries.last_mut().expect("entries").layer = 4)),
            Some("layer_not_in_layout"),
        ),
        (
            "state-in-attention-group",
            frame(&with(&grouped, |m| m.entries[0].kind = EntryKind::State)),
            Some("wrong_entry_kind"),
        ),
        (
            "grouped-missing-v",
            frame(&with(&grouped, |m| {
                m.entries.retain(|e| !(e.layer == 5 && e.kind == EntryKind::V));
            })),
            Some("missing_entry"),
        ),
        ("rank-2-k", frame(&with(&dense, |m| m.entries[0].shape = vec![3, 8])), Some("bad_rank")),
        (
            "zero-head-dim",
            frame(&with(&grouped, |m| {
                m.entries[0].shape = vec![3, 1, 0];
                m.entries[0].len = 0;
            })),
            Some("zero_dimension"),
        ),
        (
            "token-dim-mismatch",
            frame(&with(&grouped, |m| {
                m.entries[0].shape = vec![2, 2, 4];
            })),
            Some("token_dim_mismatch"),
        ),
        ("shape-len-mismatch", frame(&with(&grouped, |m| m.entries[0].len += 2)), Some("shape_len_mismatch")),
        (
            "entry-out-of-bounds",
            frame_with_payload(
                &with(&grouped, |m| m.entries[0].offset = u64::MAX - 8),
                &pattern(grouped.payload_len(), 1),
            ),
            Some("entry_out_of_bounds"),
        ),
        (
            "entry-misaligned",
            frame_with_payload(
                &with(&grouped, |m| m.entries.last_mut().expect("entries").offset += 1),
                &pattern(grouped.payload_len() + 1, 1),
            ),
            Some("misaligned_entry"),
        ),
        (
            "entries-overlap",
            frame_with_payload(&with(&grouped, |m| m.entries[1].offset = 8), &pattern(grouped.payload_len(), 1)),
            Some("entry_overlap"),
        ),
        (
            "dense-k-v-swapped",
            frame(&with(&dense, |m| {
                let (k, v) = (m.entries[0].offset, m.entries[1].offset);
                m.entries[0].offset = v;
                m.entries[1].offset = k;
            })),
            Some("dense_entry_misplaced"),
        ),
        (
            "dense-extra-payload-byte",
            frame_with_payload(&dense, &pattern(dense.payload_len() + 1, 2)),
            Some("dense_payload_len"),
        ),
    ];
    out.sort_by(|a, b| a.0.cmp(b.0));
    out.into_iter().map(|(name, bytes, verdict)| Fixture { name: format!("{name}.span"), bytes, verdict }).collect()
}

fn groups_mut(m: &mut Manifest) -> &mut Vec<Group> {
    match &mut m.layout {
        Layout::Grouped { groups } => groups,
        Layout::Dense { .. } => panic!("not grouped"),
    }
}

fn flip(bytes: &[u8], at: usize, mask: u8) -> Vec<u8> {
    let mut b = bytes.to_vec();
    b[at] ^= mask;
    b
}

fn nonzero_padding(m: &Manifest) -> Vec<u8> {
    // Pad the manifest to one byte short of a 64-byte boundary so the frame surely has padding.
    let mut bytes = frame(m);
    let info = crate::parse_header_prefix(&bytes).expect("valid");
    let range = info.manifest_range();
    assert!(info.payload_offset as usize > range.end, "the fixture manifest leaves padding");
    bytes[range.end] = 0xA5;
    seal_frame(&mut bytes);
    bytes
}

fn manifest_trailing_byte(m: &Manifest) -> Vec<u8> {
    let mut manifest = m.encode();
    manifest.push(0);
    encode_raw(&manifest, &pattern(m.payload_len(), 0), FrameCoords::default())
}

fn too_many_groups() -> Manifest {
    let groups: Vec<Group> = (0..crate::MAX_GROUPS as u32 + 1)
        .map(|id| Group { id, kind: GroupKind::Recurrent, layers: vec![id] })
        .collect();
    let entries = (0..groups.len() as u32)
        .map(|layer| Entry { layer, kind: EntryKind::State, shape: vec![1], offset: u64::from(layer) * 4, len: 4 })
        .collect();
    Manifest {
        fingerprint: crate::Fingerprint(1),
        request_id: 1,
        token_start: 0,
        token_end: 1,
        dtype: Dtype::F32,
        layout: Layout::Grouped { groups },
        entries,
    }
}
