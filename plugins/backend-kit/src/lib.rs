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
//! | `prefix_store_mib` | K/V of finished requests kept for prefix-cache hits, MiB | 256         |
//!
//! Unknown keys are ignored, so a backend can add its own (the faulty backend's `fault`), and one
//! `--backend-config` serves every backend of `--producer faulty,rngd` (the soak's servers).

use std::path::Path;

use model::arch::Model;
use model::forward::VecKv;
use model::gguf::Gguf;
use model::kernels::Precision;
use pdhost_plugin_abi::{
    BackendError, Capabilities, Description, PdhostDtype, PdhostLayer, PdhostLayerKind, PdhostLayout, PdhostStatus,
    Prefill, Writer,
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
    /// Earlier requests' K/V, newest last, within `store_bytes`: where a request that starts past
    /// position 0 (a prefix-cache hit on the host) finds its context's K/V.
    store: std::collections::VecDeque<Past>,
    store_bytes: usize,
    /// Context tokens found in the store, and computed because they were not.
    pub context_stats: ContextStats,
}

/// Where the context of requests that started past position 0 came from, in tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ContextStats {
    /// Found in the store of earlier requests' K/V.
    pub reused: u64,
    /// Computed (and not emitted).
    pub computed: u64,
}

/// K/V of the request in progress, already rounded through the wire dtype by the forward pass (no copy:
/// its vectors are moved in). The newest chunk is what the regions are written from.
#[derive(Debug)]
struct Past {
    request_id: u64,
    /// The tokens at positions `0..len`.
    tokens: Vec<u32>,
    kv: VecKv,
    /// Positions held.
    len: u64,
    /// The newest chunk's positions.
    newest: std::ops::Range<u64>,
}

/// A `BadConfig` refusal of `open`'s config.
pub fn bad_config(message: String) -> BackendError {
    BackendError::new(PdhostStatus::BadConfig, message)
}

/// The config's `key` as `get` reads it: `None` when absent, refused (naming the key, what was expected
/// and what was found) when present as anything `get` does not take. A key given with the wrong type is
/// never read as absent (a number for `dtype` would otherwise silently mean the default).
pub fn config_key<'j, T>(
    json: &'j serde_json::Value,
    key: &str,
    expected: &str,
    get: impl Fn(&'j serde_json::Value) -> Option<T>,
) -> Result<Option<T>, BackendError> {
    match json.get(key) {
        None => Ok(None),
        Some(v) => get(v)
            .map(Some)
            .ok_or_else(|| bad_config(format!("config {key}: expected {expected}, found {}", short_json(v)))),
    }
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
        let string = |key, expected| config_key(&json, key, expected, serde_json::Value::as_str);
        let path = string("model", "a path as a string")?
            .ok_or_else(|| bad_config("config: expected a \"model\" path, found none".into()))?;
        let dtype = match string("dtype", "bf16, f16 or f32")? {
            None => default_dtype,
            Some(name) => dtype_named(name)
                .ok_or_else(|| bad_config(format!("config dtype: expected bf16, f16 or f32, found {name:?}")))?,
        };
        let precision = match string("precision", "exact or fast")? {
            None | Some("exact") => Precision::Exact,
            Some("fast") => Precision::Fast,
            Some(other) => {
                return Err(bad_config(format!("config precision: expected exact or fast, found {other:?}")))
            }
        };
        let max_threads = model::kernels::max_threads();
        let threads = config_key(&json, "threads", &format!("an integer from 1 to {max_threads} (4 per core)"), |t| {
            t.as_u64().filter(|t| (1..=max_threads as u64).contains(t)).map(|t| t as usize)
        })?
        .unwrap_or_else(model::kernels::available_cores);
        let store_mib = config_key(&json, "prefix_store_mib", "an integer from 0 to 1048576", |m| {
            m.as_u64().filter(|&m| m <= 1 << 20)
        })?
        .unwrap_or(256);
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
        // A producer prefills beside a host that decodes on the same cores: its threads sleep between
        // parallel regions (rayon's way) rather than wait awake, so that the host's, woken, run first.
        // A prefill's regions are long, so this costs it little.
        model.exec.set_awake(false);
        // Each chunk's K/V is rounded to the wire dtype as it is computed: what the host's cache of that
        // dtype will hold, so later chunks (and the host) attend to exactly the same values.
        model.kv_dtype = dtype;
        let geometry = model.config.kv_geometry();
        if layout == PdhostLayout::Dense && geometry.uniform_heads().is_none() {
            return Err(BackendError::new(PdhostStatus::Unsupported, "dense layout needs uniform attention heads"));
        }
        Ok(ModelBackend {
            model,
            geometry,
            layout,
            dtype,
            past: None,
            store: Default::default(),
            store_bytes: (store_mib as usize) << 20,
            context_stats: ContextStats::default(),
        })
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
            identity: Some(self.model.identity.to_string()),
        }
    }

    /// What `capabilities` returns: any wire dtype (the `dtype` key), this backend's layout, no token
    /// limit.
    pub fn capabilities(&self) -> Capabilities {
        Capabilities {
            dtypes: vec![PdhostDtype::F32, PdhostDtype::F16, PdhostDtype::Bf16],
            layouts: vec![self.layout],
            max_tokens: 0,
            refuses_context: false,
        }
    }

    /// The end of request `request_id`: if it is the request in progress, its K/V moves to the store of
    /// earlier requests (where a later prefix-cache hit may find it), so no later chunk can continue it.
    pub fn release(&mut self, request_id: u64) {
        if self.past.as_ref().is_some_and(|p| p.request_id == request_id) {
            let past = self.past.take().expect("checked");
            self.store.push_back(past);
            self.trim_store();
        }
    }

    /// Drops the oldest stored requests until the store fits its budget.
    fn trim_store(&mut self) {
        let bytes = |p: &Past| p.kv.k.iter().chain(&p.kv.v).map(|l| l.len() * 4).sum::<usize>();
        let mut total: usize = self.store.iter().map(bytes).sum();
        while total > self.store_bytes {
            let Some(oldest) = self.store.pop_front() else { break };
            total -= bytes(&oldest);
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
    /// [`ModelBackend::write_regions`] and [`ModelBackend::payload`] then write out.
    ///
    /// A call at position 0 starts a request; a later call continues the request in progress where it
    /// stopped, or starts one there with its `context` (the tokens before it, whose K/V the host already
    /// holds): their K/V come from the store of earlier requests as far as a stored prompt agrees, and the
    /// rest is computed without being emitted. Prefill is chunk-invariant, so the emitted K/V are the same
    /// bits either way.
    pub fn compute(&mut self, request: &Prefill<'_>) -> Result<(), BackendError> {
        let vocab = self.model.config.vocab;
        if let Some(&bad) = request.tokens.iter().chain(request.context).find(|&&t| t as usize >= vocab) {
            return Err(BackendError::new(
                PdhostStatus::InvalidArgument,
                format!("token id {bad}: expected ids below the vocabulary size {vocab}"),
            ));
        }
        let start = request.start_pos;
        let continues = matches!(&self.past, Some(p) if p.request_id == request.request_id && p.len == start);
        if !continues {
            if start != 0 && request.context.len() as u64 != start {
                return Err(BackendError::new(
                    PdhostStatus::InvalidArgument,
                    format!(
                        "request {} chunk at position {start}: expected the request in progress to continue \
                         there, or its {start} context tokens",
                        request.request_id
                    ),
                ));
            }
            let past = self.context_past(request.request_id, request.context);
            self.past = Some(past);
        }
        let past = self.past.as_mut().expect("set above");
        let out = self.model.forward(request.tokens, start, &past.kv, false);
        past.kv.append(&out.kv);
        past.tokens.extend_from_slice(request.tokens);
        past.len = start + request.tokens.len() as u64;
        past.newest = start..past.len;
        Ok(())
    }

    /// A new request's past holding `context`: the request in progress goes to the store, and the stored
    /// request agreeing longest with `context` (if any) gives its K/V up to there.
    fn context_past(&mut self, request_id: u64, context: &[u32]) -> Past {
        if let Some(old) = self.past.take() {
            self.store.push_back(old);
        }
        let common = |p: &Past| p.tokens.iter().zip(context).take_while(|(a, b)| a == b).count();
        let best = self.store.iter().enumerate().map(|(i, p)| (common(p), i)).max().filter(|&(n, _)| n > 0);
        let row = self.model.config.kv_heads * self.model.config.head_dim;
        let mut past = match best {
            Some((n, i)) => {
                let mut p = self.store.remove(i).expect("index in range");
                for layer in p.kv.k.iter_mut().chain(p.kv.v.iter_mut()) {
                    layer.truncate(n * row);
                }
                p.tokens.truncate(n);
                p.len = n as u64;
                p
            }
            None => {
                Past { request_id, tokens: Vec::new(), kv: VecKv { row, ..VecKv::default() }, len: 0, newest: 0..0 }
            }
        };
        past.request_id = request_id;
        self.context_stats.reused += past.len;
        let have = past.len as usize;
        if have < context.len() {
            let out = self.model.forward(&context[have..], past.len, &past.kv, false);
            past.kv.append(&out.kv);
            past.tokens.extend_from_slice(&context[have..]);
            past.len = context.len() as u64;
            self.context_stats.computed += (context.len() - have) as u64;
        }
        // The store keeps the newest requests that fit its budget.
        self.trim_store();
        past
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

    fn tiny() -> String {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/reference/tiny_gemma3_8l");
        format!(r#"{{"model":{dir:?},"threads":1}}"#)
    }

    fn newest(b: &ModelBackend) -> Vec<f32> {
        let past = b.past.as_ref().unwrap();
        let row = past.kv.row;
        let r = past.newest.start as usize * row..past.newest.end as usize * row;
        past.kv.k.iter().chain(&past.kv.v).flat_map(|l| l[r.clone()].to_vec()).collect()
    }

    #[test]
    fn a_request_that_starts_past_zero_takes_its_context_from_the_store_or_computes_it() {
        let prompt: Vec<u32> = (0..12).map(|i| 3 + i * 11).collect();
        let call = |request_id, start_pos, tokens, context| Prefill { request_id, start_pos, tokens, context };
        // The reference: the request chunked at 8, in a fresh backend.
        let mut fresh = ModelBackend::open(&tiny(), PdhostLayout::Grouped, Dtype::F32).unwrap();
        fresh.compute(&call(1, 0, &prompt[..8], &[])).unwrap();
        fresh.compute(&call(1, 8, &prompt[8..], &[])).unwrap();
        let want = newest(&fresh);

        let mut b = ModelBackend::open(&tiny(), PdhostLayout::Grouped, Dtype::F32).unwrap();
        // Without its context, a request cannot start past 0.
        let err = b.compute(&call(2, 8, &prompt[8..], &[])).unwrap_err();
        assert!(err.message.contains("expected the request in progress"), "{}", err.message);
        // Nothing stored: the context is computed.
        b.compute(&call(2, 8, &prompt[8..], &prompt[..8])).unwrap();
        assert_eq!(b.context_stats, ContextStats { reused: 0, computed: 8 });
        assert!(newest(&b) == want);
        // Request 2 is stored when request 3 starts: its first 8 tokens are reused.
        b.compute(&call(3, 8, &prompt[8..], &prompt[..8])).unwrap();
        assert_eq!(b.context_stats, ContextStats { reused: 8, computed: 8 });
        assert!(newest(&b) == want);
        // A context that agrees with the store for 5 tokens reuses 5 and computes 3.
        let mut other = prompt.clone();
        other[5] = 200;
        b.compute(&call(4, 8, &other[8..], &other[..8])).unwrap();
        assert_eq!(b.context_stats, ContextStats { reused: 13, computed: 11 });
        let mut fresh = ModelBackend::open(&tiny(), PdhostLayout::Grouped, Dtype::F32).unwrap();
        fresh.compute(&call(1, 0, &other[..8], &[])).unwrap();
        fresh.compute(&call(1, 8, &other[8..], &[])).unwrap();
        assert!(newest(&b) == newest(&fresh));
    }

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
