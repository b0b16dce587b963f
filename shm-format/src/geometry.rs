//! The KV geometry of a model and its fingerprint.
//!
//! The fingerprint is a hash of exactly the fields that decide where KV bytes go: the number of layers and,
//! per layer, its attention kind, sliding window, KV heads and head dimension, or its recurrent state size.
//! Two models with the same fingerprint lay KV out identically; a span whose fingerprint differs from the
//! receiver's is rejected before any other check.

use std::fmt;

use serde::Serialize;

use crate::manifest::{Fingerprint, Group, GroupKind};
use crate::words;

/// Domain separator so the fingerprint can never collide with another use of XXH3 over postcard.
const FINGERPRINT_DOMAIN: &[u8] = b"pdhost.kv-geometry.v1\0";

/// The KV shape of one model layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum LayerKv {
    /// Full attention.
    Full {
        /// KV heads.
        kv_heads: u32,
        /// Head dimension.
        head_dim: u32,
    },
    /// Sliding-window attention.
    Sliding {
        /// Window in tokens.
        window: u32,
        /// KV heads.
        kv_heads: u32,
        /// Head dimension.
        head_dim: u32,
    },
    /// A recurrent layer with a fixed state of `state_elems` elements.
    Recurrent {
        /// Elements of state per sequence.
        state_elems: u64,
    },
}

impl LayerKv {
    /// The group kind this layer belongs to.
    pub fn group_kind(self) -> GroupKind {
        match self {
            LayerKv::Full { .. } => GroupKind::Full,
            LayerKv::Sliding { window, .. } => GroupKind::Sliding { window },
            LayerKv::Recurrent { .. } => GroupKind::Recurrent,
        }
    }

    /// `(kv_heads, head_dim)` of an attention layer.
    pub fn heads(self) -> Option<(u32, u32)> {
        match self {
            LayerKv::Full { kv_heads, head_dim } | LayerKv::Sliding { kv_heads, head_dim, .. } => {
                Some((kv_heads, head_dim))
            }
            LayerKv::Recurrent { .. } => None,
        }
    }
}

/// In words, for messages: `full attention with 1 KV head of size 256`, `sliding window 512 with 8 KV heads
/// of size 64`, `recurrent with a state of 4096 elements`.
impl fmt::Display for LayerKv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            LayerKv::Full { kv_heads, head_dim } | LayerKv::Sliding { kv_heads, head_dim, .. } => {
                write!(f, "{} with {}", self.group_kind(), words::kv_heads(kv_heads.into(), head_dim.into()))
            }
            LayerKv::Recurrent { state_elems } => write!(f, "recurrent with a state of {state_elems} elements"),
        }
    }
}

/// Most distinct layer shapes [`KvGeometry`]'s `Display` names before it counts the rest.
const MAX_SHAPES_NAMED: usize = 8;

/// The KV geometry of a whole model: one [`LayerKv`] per model layer, indexed by layer id.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct KvGeometry {
    /// Per layer, in model order.
    pub layers: Vec<LayerKv>,
}

impl KvGeometry {
    /// The fingerprint: XXH3-64 of a domain string and the postcard encoding of `layers`.
    pub fn fingerprint(&self) -> Fingerprint {
        let mut bytes = FINGERPRINT_DOMAIN.to_vec();
        bytes.extend(postcard::to_allocvec(&self.layers).expect("encoding into a Vec cannot fail"));
        Fingerprint(twox_hash::XxHash3_64::oneshot(&bytes))
    }

    /// The canonical grouping: all full layers form one group, sliding layers one group per distinct window,
    /// recurrent layers one group. Groups are ordered by their first layer; ids count from 0 in that order.
    pub fn groups(&self) -> Vec<Group> {
        let mut groups: Vec<Group> = Vec::new();
        for (layer, kv) in self.layers.iter().enumerate() {
            let kind = kv.group_kind();
            match groups.iter_mut().find(|g| g.kind == kind) {
                Some(g) => g.layers.push(layer as u32),
                None => groups.push(Group { id: groups.len() as u32, kind, layers: vec![layer as u32] }),
            }
        }
        groups
    }

    /// `(kv_heads, head_dim)` if every layer is attention with the same heads: the condition for a dense span.
    pub fn uniform_heads(&self) -> Option<(u32, u32)> {
        let first = self.layers.first()?.heads()?;
        self.layers.iter().all(|l| l.heads() == Some(first)).then_some(first)
    }

    /// Where `found` differs from this geometry, in words, or `None` if it does not. The first differing
    /// layer is named with both its shapes, and the count and ids of the other differing layers follow; when
    /// the layer counts differ, both whole geometries are given.
    pub fn mismatch(&self, found: &KvGeometry) -> Option<GeometryMismatch> {
        if self.layers.len() != found.layers.len() {
            return Some(GeometryMismatch {
                what: "KV geometry".into(),
                expected: self.to_string(),
                found: found.to_string(),
            });
        }
        let differ: Vec<u32> =
            (0..self.layers.len()).filter(|&i| self.layers[i] != found.layers[i]).map(|i| i as u32).collect();
        let (&first, rest) = differ.split_first()?;
        let mut found_text = found.layers[first as usize].to_string();
        if !rest.is_empty() {
            let s = if rest.len() == 1 { "" } else { "s" };
            found_text += &format!(" ({} more layer{s} differ: {})", rest.len(), words::layers(rest));
        }
        Some(GeometryMismatch {
            what: format!("layer {first}"),
            expected: self.layers[first as usize].to_string(),
            found: found_text,
        })
    }
}

/// In words, for messages: the layer count, then each distinct layer shape with its layers, in order of
/// first appearance: `18 layers: sliding window 512 (15 layers: 0-4, 6-10, 12-16; 1 KV head of size 256),
/// full attention (3 layers: 5, 11, 17; 1 KV head of size 256)`.
impl fmt::Display for KvGeometry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.layers.len();
        write!(f, "{n} layer{}", if n == 1 { "" } else { "s" })?;
        // Each shape's layers, shapes in order of first appearance. Found through a map: a producer's
        // description of a million distinct layers is named in linear time, not in a million squared.
        let mut shapes: Vec<(LayerKv, Vec<u32>)> = Vec::new();
        let mut index: std::collections::HashMap<LayerKv, usize> = std::collections::HashMap::new();
        for (id, &kv) in self.layers.iter().enumerate() {
            let at = *index.entry(kv).or_insert_with(|| {
                shapes.push((kv, Vec::new()));
                shapes.len() - 1
            });
            shapes[at].1.push(id as u32);
        }
        for (i, (kv, ids)) in shapes.iter().take(MAX_SHAPES_NAMED).enumerate() {
            f.write_str(if i == 0 { ": " } else { ", " })?;
            let count = match ids.len() {
                1 => "1 layer".to_string(),
                n => format!("{n} layers"),
            };
            let size = match *kv {
                LayerKv::Full { kv_heads, head_dim } | LayerKv::Sliding { kv_heads, head_dim, .. } => {
                    words::kv_heads(kv_heads.into(), head_dim.into())
                }
                LayerKv::Recurrent { state_elems } => format!("a state of {state_elems} elements"),
            };
            write!(f, "{} ({count}: {}; {size})", kv.group_kind(), words::layers(ids))?;
        }
        if shapes.len() > MAX_SHAPES_NAMED {
            write!(f, ", plus {} more kinds of layer", shapes.len() - MAX_SHAPES_NAMED)?;
        }
        Ok(())
    }
}

/// How one KV geometry differs from another, in words: see [`KvGeometry::mismatch`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GeometryMismatch {
    /// What differs: `layer 5`, or `KV geometry` when the layer counts differ.
    pub what: String,
    /// What the expected geometry has there.
    pub expected: String,
    /// What the found geometry has there, with the other layers that differ.
    pub found: String,
}

impl fmt::Display for GeometryMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: expected {}, found {}", self.what, self.expected, self.found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemma3_1b() -> KvGeometry {
        crate::testing::interleaved(26, 6, 512, 1, 256)
    }

    #[test]
    fn gemma3_groups_by_kind_keep_model_layer_ids() {
        let g = gemma3_1b().groups();
        assert_eq!(g.len(), 2);
        assert_eq!(g[0].kind, GroupKind::Sliding { window: 512 });
        assert_eq!(g[0].layers.len(), 22);
        assert_eq!(g[1].kind, GroupKind::Full);
        assert_eq!(g[1].layers, vec![5, 11, 17, 23]);
    }

    #[test]
    fn fingerprint_changes_with_any_geometry_field() {
        let base = gemma3_1b();
        let fp = base.fingerprint();
        let mut fewer = base.clone();
        fewer.layers.pop();
        let mut window = base.clone();
        window.layers[0] = LayerKv::Sliding { window: 511, kv_heads: 1, head_dim: 256 };
        let mut heads = base.clone();
        heads.layers[5] = LayerKv::Full { kv_heads: 2, head_dim: 256 };
        for other in [fewer, window, heads] {
            assert_ne!(other.fingerprint(), fp);
        }
        assert_eq!(gemma3_1b().fingerprint(), fp, "deterministic");
    }

    #[test]
    fn geometry_in_words_names_kinds_layers_and_heads() {
        let gemma3_270m = crate::testing::interleaved(18, 6, 512, 1, 256);
        assert_eq!(
            gemma3_270m.to_string(),
            "18 layers: sliding window 512 (15 layers: 0-4, 6-10, 12-16; 1 KV head of size 256), \
             full attention (3 layers: 5, 11, 17; 1 KV head of size 256)"
        );
        let hybrid = crate::testing::tiny_hybrid_geometry();
        assert!(hybrid.to_string().contains("recurrent (1 layer: 1; a state of 6 elements)"), "{hybrid}");
        assert_eq!(KvGeometry { layers: vec![] }.to_string(), "0 layers");
        let many = KvGeometry { layers: (1..=10).map(|h| LayerKv::Full { kv_heads: h, head_dim: 4 }).collect() };
        assert!(many.to_string().ends_with(", plus 2 more kinds of layer"), "{many}");
    }

    #[test]
    fn mismatch_names_the_first_differing_layer_then_the_rest() {
        let ours = crate::testing::interleaved(18, 6, 512, 1, 256);
        assert_eq!(ours.mismatch(&ours), None);

        let mut swapped = ours.clone();
        swapped.layers[5] = LayerKv::Sliding { window: 512, kv_heads: 1, head_dim: 256 };
        assert_eq!(
            ours.mismatch(&swapped).unwrap().to_string(),
            "layer 5: expected full attention with 1 KV head of size 256, \
             found sliding window 512 with 1 KV head of size 256"
        );

        // The wrong head size alone: the two sides no longer read the same.
        let narrower = crate::testing::interleaved(18, 6, 512, 1, 128);
        assert_eq!(
            ours.mismatch(&narrower).unwrap().to_string(),
            "layer 0: expected sliding window 512 with 1 KV head of size 256, \
             found sliding window 512 with 1 KV head of size 128 (17 more layers differ: 1-17)"
        );

        let fewer = crate::testing::interleaved(17, 6, 512, 1, 256);
        let m = ours.mismatch(&fewer).unwrap();
        assert_eq!(m.what, "KV geometry");
        assert!(m.expected.starts_with("18 layers: ") && m.found.starts_with("17 layers: "), "{m}");
        for text in [m.to_string(), ours.mismatch(&swapped).unwrap().to_string()] {
            assert!(!text.contains('{') && !text.contains('\n'), "{text}");
        }
    }

    /// A producer may describe any number of distinct layers (a 4 MiB `Ready` holds hundreds of
    /// thousands): naming them is one pass, and the text names eight kinds and counts the rest. (Grouped
    /// by a linear search, as it once was, this description took minutes to name.)
    #[test]
    fn a_geometry_of_many_distinct_layers_is_named_in_one_pass() {
        let many = KvGeometry { layers: (0..200_000).map(|n| LayerKv::Recurrent { state_elems: n + 1 }).collect() };
        let text = many.to_string();
        assert!(text.starts_with("200000 layers: recurrent (1 layer: 0; a state of 1 elements), "), "{text}");
        assert!(text.ends_with(", plus 199992 more kinds of layer"), "{text}");
    }
}
