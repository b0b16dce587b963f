//! Building frames, for producers and tests. The host never encodes; it only decodes.

use zerocopy::IntoBytes;

use crate::checksum::seal_frame;
use crate::geometry::{KvGeometry, LayerKv};
use crate::header::{FrameHeader, HeaderInfo, HEADER_LEN, MAX_MANIFEST_LEN};
use crate::manifest::{Dtype, Entry, EntryKind, Layout, Manifest};
use crate::SpanError;

/// Where a frame's ring coordinates come from: the host's grant (epoch, generation) and the producer's
/// own counter (sequence). A span file uses zeros.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrameCoords {
    /// Producer epoch.
    pub epoch: u64,
    /// Granted slot generation.
    pub generation: u64,
    /// Sequence number.
    pub sequence: u64,
}

/// Writes header (checksum zero), manifest and zero padding to the front of `buf`, and returns the
/// parsed header, whose `payload_offset` says where the payload goes and `frame_len` how long the frame
/// is. The caller then writes the payload and calls [`seal_frame`] over `buf[..frame_len]`.
pub fn write_prefix(
    buf: &mut [u8],
    manifest: &[u8],
    payload_len: u64,
    coords: FrameCoords,
) -> Result<HeaderInfo, SpanError> {
    let manifest_len = u32::try_from(manifest.len()).unwrap_or(u32::MAX);
    if manifest_len > MAX_MANIFEST_LEN {
        return Err(SpanError::BadManifestLen { max: MAX_MANIFEST_LEN, found: manifest_len });
    }
    let header = FrameHeader::new(manifest_len, payload_len, coords.epoch, coords.generation, coords.sequence);
    let info = HeaderInfo::parse(header.as_bytes().try_into().expect("64 bytes"))?;
    if (buf.len() as u64) < info.payload_offset {
        return Err(SpanError::FrameExceedsSlot { capacity: buf.len() as u64, found: info.frame_len });
    }
    buf[..HEADER_LEN].copy_from_slice(header.as_bytes());
    let range = info.manifest_range();
    buf[range.clone()].copy_from_slice(manifest);
    buf[range.end..info.payload_offset as usize].fill(0);
    Ok(info)
}

/// Encodes a complete, sealed frame.
pub fn encode_frame(manifest: &Manifest, payload: &[u8], coords: FrameCoords) -> Vec<u8> {
    encode_raw(&manifest.encode(), payload, coords)
}

/// Encodes a complete, sealed frame around manifest bytes that need not be valid (for fault injection).
pub fn encode_raw(manifest: &[u8], payload: &[u8], coords: FrameCoords) -> Vec<u8> {
    let mut prefix = vec![0u8; HEADER_LEN + manifest.len() + 64];
    let info = write_prefix(&mut prefix, manifest, payload.len() as u64, coords).expect("manifest within bounds");
    let mut frame = Vec::with_capacity(info.frame_len as usize);
    frame.extend_from_slice(&prefix[..info.payload_offset as usize]);
    frame.extend_from_slice(payload);
    seal_frame(&mut frame);
    frame
}

impl Manifest {
    /// The dense manifest of a model whose layers all have the same attention heads: one tensor
    /// `[layer][k|v][token][kv_head][head_dim]`. `None` if the geometry has no uniform heads (a recurrent
    /// layer, or layers with different heads), which a dense span cannot describe.
    pub fn dense(
        geometry: &KvGeometry,
        request_id: u64,
        tokens: std::ops::Range<u64>,
        dtype: Dtype,
    ) -> Option<Manifest> {
        let (kv_heads, head_dim) = geometry.uniform_heads()?;
        let t = tokens.end.checked_sub(tokens.start)?;
        let shape = vec![t, u64::from(kv_heads), u64::from(head_dim)];
        let per = t * u64::from(kv_heads) * u64::from(head_dim) * dtype.size();
        let entries = (0..geometry.layers.len() as u32)
            .flat_map(|layer| [EntryKind::K, EntryKind::V].map(|kind| (layer, kind)))
            .enumerate()
            .map(|(i, (layer, kind))| Entry { layer, kind, shape: shape.clone(), offset: i as u64 * per, len: per })
            .collect();
        Some(Manifest {
            fingerprint: geometry.fingerprint(),
            request_id,
            token_start: tokens.start,
            token_end: tokens.end,
            dtype,
            layout: Layout::Dense { num_layers: geometry.layers.len() as u32, kv_heads, head_dim },
            entries,
        })
    }

    /// The grouped manifest: one tensor set per group of [`KvGeometry::groups`], laid out group after group;
    /// inside a group, layer after layer (in the group's order), K then V (or the state).
    pub fn grouped(geometry: &KvGeometry, request_id: u64, tokens: std::ops::Range<u64>, dtype: Dtype) -> Manifest {
        let t = tokens.end.saturating_sub(tokens.start);
        let groups = geometry.groups();
        let mut entries = Vec::new();
        let mut offset = 0;
        for g in &groups {
            for &layer in &g.layers {
                let (kinds, shape): (&[EntryKind], Vec<u64>) = match geometry.layers[layer as usize] {
                    LayerKv::Full { kv_heads, head_dim } | LayerKv::Sliding { kv_heads, head_dim, .. } => {
                        (&[EntryKind::K, EntryKind::V], vec![t, u64::from(kv_heads), u64::from(head_dim)])
                    }
                    LayerKv::Recurrent { state_elems } => (&[EntryKind::State], vec![state_elems]),
                };
                let len = shape.iter().product::<u64>() * dtype.size();
                for &kind in kinds {
                    entries.push(Entry { layer, kind, shape: shape.clone(), offset, len });
                    offset += len;
                }
            }
        }
        Manifest {
            fingerprint: geometry.fingerprint(),
            request_id,
            token_start: tokens.start,
            token_end: tokens.end,
            dtype,
            layout: Layout::Grouped { groups },
            entries,
        }
    }

    /// The payload length the entries need: the end of the last entry.
    pub fn payload_len(&self) -> u64 {
        self.entries.iter().map(|e| e.offset.saturating_add(e.len)).max().unwrap_or(0)
    }
}
