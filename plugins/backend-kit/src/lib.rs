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
//! | `threads`   | threads for the forward pass, 1 to 4 per core              | all cores        |
//!
//! Unknown keys are ignored, so a backend can add its own (the faulty backend's `fault`).

use std::path::Path;

use model::arch::Model;
use model::forward::VecKv;
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
    /// The request being prefilled and its K/V so far.
    past: Option<Past>,
}

/// K/V of the request in progress, already rounded through the wire dtype by the forward pass (no copy:
/// its vectors are moved in). The newest chunk is what the regions are written from.
#[derive(Debug)]
struct Past {
    request_id: u64,
    kv: VecKv,
    /// Positions held.
    len: u64,
    /// The newest chunk's positions.
    newest: std::ops::Range<u64>,
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
        let max_threads = model::kernels::max_threads();
        let threads = match json.get("threads") {
            None => model::kernels::available_cores(),
            Some(t) => {
                t.as_u64().filter(|t| (1..=max_threads as u64).contains(t)).map(|t| t as usize).ok_or_else(|| {
                    bad_config(format!(
                        "config threads: expected an integer from 1 to {max_threads} (4 per core), found {}",
                        short_json(t)
                    ))
                })?
            }
        };
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
        // Each chunk's K/V is rounded to the wire dtype as it is computed: what the host's cache of that
        // dtype will hold, so later chunks (and the host) attend to exactly the same values.
        model.kv_dtype = dtype;
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

    /// Runs the forward pass over the request's tokens and keeps their K/V as the newest chunk, which
    /// [`ModelBackend::write_regions`] and [`ModelBackend::payload`] then write out. A request starting at
    /// 0 replaces any earlier one; a later chunk must continue the request in progress where it stopped.
    pub fn compute(&mut self, request: &Prefill<'_>) -> Result<(), BackendError> {
        if let Some(&bad) = request.tokens.iter().find(|&&t| t as usize >= self.model.config.vocab) {
            return Err(BackendError::new(
                PdhostStatus::InvalidArgument,
                format!("token id {bad}: expected ids below the vocabulary size {}", self.model.config.vocab),
            ));
        }
        let end = request.start_pos + request.tokens.len() as u64;
        if request.start_pos == 0 {
            let out = self.model.forward(request.tokens, 0, &model::forward::NoPast, false);
            let row = self.model.config.kv_heads * self.model.config.head_dim;
            let kv = VecKv { k: out.kv.k, v: out.kv.v, row };
            self.past = Some(Past { request_id: request.request_id, kv, len: end, newest: 0..end });
            return Ok(());
        }
        let past = match &mut self.past {
            Some(p) if p.request_id == request.request_id && p.len == request.start_pos => p,
            _ => {
                return Err(BackendError::new(
                    PdhostStatus::InvalidArgument,
                    format!(
                        "request {} chunk at position {}: expected the request in progress to continue there",
                        request.request_id, request.start_pos
                    ),
                ))
            }
        };
        let out = self.model.forward(request.tokens, request.start_pos, &past.kv, false);
        past.kv.append(&out.kv);
        past.len = end;
        past.newest = request.start_pos..end;
        Ok(())
    }

    /// The newest chunk's values of one entry.
    fn newest<'a>(&'a self, e: &shm_format::Entry) -> &'a [f32] {
        let past = self.past.as_ref().expect("compute ran");
        let row = past.kv.row;
        let layer = match e.kind {
            EntryKind::K => &past.kv.k[e.layer as usize],
            EntryKind::V => &past.kv.v[e.layer as usize],
            EntryKind::State => unreachable!("these models have no recurrent layers"),
        };
        &layer[past.newest.start as usize * row..past.newest.end as usize * row]
    }

    /// Writes the newest chunk into the writer's regions, entry by entry in `manifest` order (encoding
    /// rounds to the wire dtype). With `limit`, stops after that many entries (for fault injection).
    pub fn write_regions(
        &self,
        manifest: &Manifest,
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
            encode_into(self.dtype, self.newest(e), region);
        }
        Ok(())
    }

    /// The newest chunk's whole payload for `manifest`, as bytes (for backends that write frames themselves).
    pub fn payload(&self, manifest: &Manifest) -> Vec<u8> {
        let mut payload = vec![0u8; manifest.payload_len() as usize];
        for e in &manifest.entries {
            encode_into(self.dtype, self.newest(e), &mut payload[e.offset as usize..(e.offset + e.len) as usize]);
        }
        payload
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

/// A JSON value for an error message: whole when short, cut (on a character boundary) when long, so a
/// hostile config is never echoed back in full.
fn short_json(v: &serde_json::Value) -> String {
    const MAX: usize = 40;
    let text = v.to_string();
    match text.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}... ({} bytes)", &text[..cut], text.len()),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_count_out_of_bounds_is_refused_before_the_model_loads() {
        let max = model::kernels::max_threads();
        for threads in
            ["0".to_string(), (max + 1).to_string(), "100000".into(), "-1".into(), "1.5".into(), "\"2\"".into()]
        {
            let config = format!(r#"{{"model":"/nonexistent","threads":{threads}}}"#);
            let err = ModelBackend::open(&config, PdhostLayout::Grouped, Dtype::F32).unwrap_err();
            assert!(err.message.contains(&format!("config threads: expected an integer from 1 to {max}")), "{threads}");
        }
        // In bounds, the next thing to fail is the missing model.
        let err = ModelBackend::open(r#"{"model":"/nonexistent","threads":1}"#, PdhostLayout::Grouped, Dtype::F32)
            .unwrap_err();
        assert!(err.message.contains("/nonexistent"), "{}", err.message);
    }
}
