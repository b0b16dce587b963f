//! What the `rngd`, `gpu` and `faulty` backends share: a real prefill with the `model` crate, per-request
//! past K/V for chunked prefill, and writing a chunk's K/V into the producer's regions in either layout.
//!
//! Configuration (JSON, from `open`):
//!
//! | key         | meaning                                                    | default          |
//! |-------------|------------------------------------------------------------|------------------|
//! | `model`     | a `.gguf` file or a Hugging Face checkpoint directory       | required         |
//! | `dtype`     | element type on the wire: `bf16`, `f16` or `f32`           | the backend's    |
//! | `precision` | `exact` or `fast` (see `pdhost generate --help`)           | `exact`          |
//! | `threads`   | threads for the forward pass                               | all cores        |
//!
//! Unknown keys are ignored, so a backend can add its own (the faulty backend's `fault`).

use std::path::Path;

use model::arch::Model;
use model::forward::{ChunkKv, VecKv};
use model::gguf::Gguf;
use model::kernels::Precision;
use pdhost_plugin_abi::{
    BackendError, Description, PdhostDtype, PdhostLayer, PdhostLayerKind, PdhostLayout, PdhostStatus, Prefill, Writer,
};
use shm_format::{Dtype, EntryKind, KvGeometry, LayerKv, Manifest};

/// A backend over a real model.
#[derive(Debug)]
pub struct ModelBackend {
    model: Model,
    geometry: KvGeometry,
    layout: PdhostLayout,
    dtype: Dtype,
    /// The request being prefilled and its K/V so far, rounded through the wire dtype exactly as the host
    /// will read it back, so that a chunk attends to what the host's cache holds.
    past: Option<(u64, VecKv)>,
}

fn bad_config(message: String) -> BackendError {
    BackendError::new(PdhostStatus::BadConfig, message)
}

/// Parses a dtype name.
pub fn dtype_named(name: &str) -> Option<Dtype> {
    match name {
        "f32" => Some(Dtype::F32),
        "f16" => Some(Dtype::F16),
        "bf16" => Some(Dtype::Bf16),
        _ => None,
    }
}

impl ModelBackend {
    /// Loads the model named by `config`, emitting `layout` in `default_dtype` unless `dtype` says otherwise.
    pub fn open(config: &str, layout: PdhostLayout, default_dtype: Dtype) -> Result<Self, BackendError> {
        let json: serde_json::Value =
            serde_json::from_str(config).map_err(|e| bad_config(format!("config: expected JSON, found {e}")))?;
        let path = json
            .get("model")
            .and_then(|m| m.as_str())
            .ok_or_else(|| bad_config("config: expected a \"model\" path, found none".into()))?;
        let dtype = match json.get("dtype").and_then(|d| d.as_str()) {
            None => default_dtype,
            Some(name) => dtype_named(name)
                .ok_or_else(|| bad_config(format!("config dtype: expected bf16, f16 or f32, found {name:?}")))?,
        };
        let precision = match json.get("precision").and_then(|p| p.as_str()) {
            None | Some("exact") => Precision::Exact,
            Some("fast") => Precision::Fast,
            Some(other) => {
                return Err(bad_config(format!("config precision: expected exact or fast, found {other:?}")))
            }
        };
        let threads = json
            .get("threads")
            .and_then(|t| t.as_u64())
            .map_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()), |t| t.max(1) as usize);
        let path = Path::new(path);
        let load_error = |e: &dyn std::fmt::Display| {
            BackendError::new(PdhostStatus::BackendError, format!("loading {}: {e}", path.display()))
        };
        let mut model = if path.is_dir() {
            Model::from_hf_dir(path).map_err(|e| load_error(&e))?
        } else {
            let gguf = Gguf::open(path).map_err(|e| load_error(&e))?;
            Model::from_gguf(&gguf).map_err(|e| load_error(&e))?
        };
        model.configure(precision, threads);
        let geometry = model.config.kv_geometry();
        if layout == PdhostLayout::Dense && geometry.uniform_heads().is_none() {
            return Err(BackendError::new(PdhostStatus::Unsupported, "dense layout needs uniform attention heads"));
        }
        Ok(ModelBackend { model, geometry, layout, dtype, past: None })
    }

    /// The model's KV geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// The wire dtype.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The layout.
    pub fn layout(&self) -> PdhostLayout {
        self.layout
    }

    /// The description `describe` returns.
    pub fn describe(&self) -> Description {
        Description {
            layout: self.layout,
            dtype: match self.dtype {
                Dtype::F32 => PdhostDtype::F32,
                Dtype::F16 => PdhostDtype::F16,
                Dtype::Bf16 => PdhostDtype::Bf16,
            },
            layers: self.geometry.layers.iter().map(|&l| layer_desc(l)).collect(),
            fingerprint: self.geometry.fingerprint().0,
        }
    }

    /// The manifest of a span of this backend's layout covering `request`.
    pub fn manifest(&self, request: &Prefill<'_>) -> Manifest {
        let tokens = request.start_pos..request.start_pos + request.tokens.len() as u64;
        match self.layout {
            PdhostLayout::Dense => Manifest::dense(&self.geometry, request.request_id, tokens, self.dtype)
                .expect("uniform heads checked at open"),
            PdhostLayout::Grouped => Manifest::grouped(&self.geometry, request.request_id, tokens, self.dtype),
        }
    }

    /// Runs the forward pass over the request's tokens and returns their K/V (already rounded through the
    /// wire dtype). A request starting at 0 replaces any earlier one; a later chunk must continue the
    /// request in progress exactly where it stopped.
    pub fn compute(&mut self, request: &Prefill<'_>) -> Result<ChunkKv, BackendError> {
        if let Some(&bad) = request.tokens.iter().find(|&&t| t as usize >= self.model.config.vocab) {
            return Err(BackendError::new(
                PdhostStatus::InvalidArgument,
                format!("token id {bad}: expected ids below the vocabulary size {}", self.model.config.vocab),
            ));
        }
        if request.start_pos == 0 {
            self.past = Some((request.request_id, VecKv::default()));
        }
        let held = match &self.past {
            Some((id, past)) if *id == request.request_id => past.k.first().map_or(0, |k| k.len() / past.row.max(1)),
            _ => usize::MAX,
        };
        if held as u64 != request.start_pos {
            return Err(BackendError::new(
                PdhostStatus::InvalidArgument,
                format!(
                    "request {} chunk at position {}: expected the request in progress to continue there",
                    request.request_id, request.start_pos
                ),
            ));
        }
        let (_, past) = self.past.as_mut().expect("checked above");
        let mut out = self.model.forward(request.tokens, request.start_pos, past, false);
        round_through(self.dtype, &mut out.kv);
        past.append(&out.kv);
        Ok(out.kv)
    }

    /// Writes `chunk` into the writer's regions, entry by entry in `manifest` order. With `limit`, stops
    /// after that many entries (for fault injection).
    pub fn write_regions(
        &self,
        manifest: &Manifest,
        chunk: &ChunkKv,
        writer: &mut Writer<'_>,
        limit: Option<usize>,
    ) -> Result<(), BackendError> {
        if writer.entries() as usize != manifest.entries.len() {
            return Err(BackendError::new(
                PdhostStatus::InvalidArgument,
                format!("writer: expected {} entries, found {}", manifest.entries.len(), writer.entries()),
            ));
        }
        for (i, e) in manifest.entries.iter().enumerate().take(limit.unwrap_or(usize::MAX)) {
            let region = writer.region(i as u32)?;
            if region.len() as u64 != e.len {
                return Err(BackendError::new(
                    PdhostStatus::WriterRefused,
                    format!("entry {i}: expected a region of {} bytes, found {}", e.len, region.len()),
                ));
            }
            encode_into(self.dtype, entry_values(chunk, e), region);
        }
        Ok(())
    }

    /// The whole payload of `chunk` for `manifest`, as bytes (for backends that write frames themselves).
    pub fn payload(&self, manifest: &Manifest, chunk: &ChunkKv) -> Vec<u8> {
        let mut payload = vec![0u8; manifest.payload_len() as usize];
        for e in &manifest.entries {
            encode_into(
                self.dtype,
                entry_values(chunk, e),
                &mut payload[e.offset as usize..(e.offset + e.len) as usize],
            );
        }
        payload
    }
}

fn entry_values<'a>(chunk: &'a ChunkKv, e: &shm_format::Entry) -> &'a [f32] {
    match e.kind {
        EntryKind::K => &chunk.k[e.layer as usize],
        EntryKind::V => &chunk.v[e.layer as usize],
        EntryKind::State => unreachable!("these models have no recurrent layers"),
    }
}

/// The ABI description of one layer.
pub fn layer_desc(layer: LayerKv) -> PdhostLayer {
    match layer {
        LayerKv::Full { kv_heads, head_dim } => {
            PdhostLayer { kind: PdhostLayerKind::Full as u32, kv_heads, head_dim, window: 0, state_elems: 0 }
        }
        LayerKv::Sliding { window, kv_heads, head_dim } => {
            PdhostLayer { kind: PdhostLayerKind::Sliding as u32, kv_heads, head_dim, window, state_elems: 0 }
        }
        LayerKv::Recurrent { state_elems } => {
            PdhostLayer { kind: PdhostLayerKind::Recurrent as u32, kv_heads: 0, head_dim: 0, window: 0, state_elems }
        }
    }
}

/// Rounds every value to the nearest `dtype` value (ties to even), in place.
pub fn round_through(dtype: Dtype, kv: &mut ChunkKv) {
    let round: fn(f32) -> f32 = match dtype {
        Dtype::F32 => return,
        Dtype::F16 => |x| half::f16::from_f32(x).to_f32(),
        Dtype::Bf16 => |x| half::bf16::from_f32(x).to_f32(),
    };
    for x in kv.k.iter_mut().chain(kv.v.iter_mut()).flatten() {
        *x = round(*x);
    }
}

/// Writes `values` as little-endian `dtype` elements into `dst` (exactly `values.len() * size` bytes).
pub fn encode_into(dtype: Dtype, values: &[f32], dst: &mut [u8]) {
    let size = dtype.size() as usize;
    assert_eq!(dst.len(), values.len() * size, "region length");
    match dtype {
        Dtype::F32 => {
            for (d, v) in dst.chunks_exact_mut(4).zip(values) {
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
        Dtype::F16 => {
            for (d, v) in dst.chunks_exact_mut(2).zip(values) {
                d.copy_from_slice(&half::f16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
        Dtype::Bf16 => {
            for (d, v) in dst.chunks_exact_mut(2).zip(values) {
                d.copy_from_slice(&half::bf16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
    }
}
