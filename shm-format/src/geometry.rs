//! The KV geometry of a model and its fingerprint.
//!
//! The fingerprint is a hash of exactly the fields that decide where KV bytes go: the number of layers and,
//! per layer, its attention kind, sliding window, KV heads and head dimension, or its recurrent state size.
//! Two models with the same fingerprint lay KV out identically; a span whose fingerprint differs from the
//! receiver's is rejected before any other check.

use serde::Serialize;

use crate::manifest::{Fingerprint, Group, GroupKind};

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
}
