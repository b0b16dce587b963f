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
use model::forward::{Segment, VecKv};
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
    /// Requests being prefilled and their K/V so far, oldest first (at most [`MAX_OPEN`]).
    open: Vec<Past>,
    /// The request whose newest chunk [`ModelBackend::write_regions`] writes: the last computed.
    current: Option<u64>,
    /// Earlier requests' K/V, newest last, within `store_bytes`: where a request that starts past
    /// position 0 (a prefix-cache hit on the host) finds its context's K/V.
    store: std::collections::VecDeque<Past>,
    store_bytes: usize,
    /// Context tokens found in the store, and computed because they were not.
    pub context_stats: ContextStats,
    /// Forward passes run for chunks (staged or not).
    passes: u64,
}

/// Where the context of requests that started past position 0 came from, in tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ContextStats {
    /// Found in the store of earlier requests' K/V.
    pub reused: u64,
    /// Computed (and not emitted).
    pub computed: u64,
}

/// Tokens per forward pass of a chunk, whose size the host chose (up to 2048 by default): a pass holds
/// its tokens' activations beside their K/V. `rngd`'s producer process, one span of a 1940-token prompt
/// (`generate --producer rngd`, two threads), peaked at 403 MiB in one pass and 298-317 MiB in pieces
/// (SmolLM2), 514 and 433 MiB (Gemma 3); the K/V are the same bits.
const PIECE: usize = 256;

/// Requests in progress a backend keeps at most: past them the oldest goes to the store (a host releases
/// each request at its end, so only a host that stopped doing so reaches it).
const MAX_OPEN: usize = 64;

/// K/V of a request in progress, already rounded through the wire dtype by the forward pass (no copy:
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
    /// The newest chunk was computed by [`ModelBackend::stage`] and its `prefill` has not come yet.
    staged: bool,
}

impl Past {
    /// A request with nothing computed yet.
    fn new(request_id: u64, row: usize) -> Self {
        let kv = VecKv { row, ..VecKv::default() };
        Past { request_id, tokens: Vec::new(), kv, len: 0, newest: 0..0, staged: false }
    }

    /// Appends a chunk's tokens and K/V as the newest chunk.
    fn push(&mut self, tokens: &[u32], kv: model::forward::ChunkKv) {
        let start = self.len;
        self.append(tokens, &kv);
        self.newest = start..self.len;
    }

    /// Appends tokens and their K/V after those held.
    fn append(&mut self, tokens: &[u32], kv: &model::forward::ChunkKv) {
        self.kv.append(kv);
        self.tokens.extend_from_slice(tokens);
        self.len += tokens.len() as u64;
    }

    /// Runs the forward pass over `tokens` after those held, in pieces of at most [`PIECE`] tokens, and
    /// keeps their K/V as the newest chunk. Each piece attends to the pieces before it as to any past,
    /// so the K/V are the bits of one pass over all of `tokens` (prefill is chunk-invariant).
    fn compute(&mut self, model: &Model, tokens: &[u32]) {
        let start = self.len;
        for piece in tokens.chunks(PIECE) {
            let out = model.forward(piece, self.len, &self.kv, false);
            self.append(piece, &out.kv);
        }
        self.newest = start..self.len;
    }

    /// Forgets the newest chunk, computed ahead by `stage` for a call that came otherwise.
    fn unstage(&mut self) {
        let keep = self.newest.start as usize;
        for layer in self.kv.k.iter_mut().chain(self.kv.v.iter_mut()) {
            layer.truncate(keep * self.kv.row);
        }
        self.tokens.truncate(keep);
        self.len = self.newest.start;
        self.newest = self.len..self.len;
        self.staged = false;
    }
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
            open: Vec::new(),
            current: None,
            store: Default::default(),
            store_bytes: (store_mib as usize) << 20,
            context_stats: ContextStats::default(),
            passes: 0,
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

    /// The end of request `request_id`: if it is in progress, its K/V moves to the store of earlier
    /// requests (where a later prefix-cache hit may find it), so no later chunk can continue it.
    pub fn release(&mut self, request_id: u64) {
        if let Some(i) = self.open.iter().position(|p| p.request_id == request_id) {
            self.close(i);
            self.trim_store();
        }
    }

    /// Moves the request in progress at `i` to the store (without what `stage` computed ahead for it).
    fn close(&mut self, i: usize) {
        let mut past = self.open.remove(i);
        if past.staged {
            past.unstage();
        }
        self.store.push_back(past);
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
    /// bits either way. A chunk [`ModelBackend::stage`] computed for this very call is not computed again.
    pub fn compute(&mut self, request: &Prefill<'_>) -> Result<(), BackendError> {
        self.check_tokens(request)?;
        let start = request.start_pos;
        let id = request.request_id;
        if let Some(past) = self.open.iter_mut().find(|p| p.request_id == id && p.staged) {
            let staged = past.newest.start == start && past.tokens[start as usize..] == *request.tokens;
            past.staged = false;
            if staged {
                self.current = Some(id);
                return Ok(());
            }
            past.unstage();
        }
        let i = match self.open.iter().position(|p| p.request_id == id && p.len == start) {
            Some(i) => i,
            None => {
                if start != 0 && request.context.len() as u64 != start {
                    return Err(BackendError::new(
                        PdhostStatus::InvalidArgument,
                        format!(
                            "request {id} chunk at position {start}: expected the request in progress to continue \
                             there, or its {start} context tokens"
                        ),
                    ));
                }
                let past = self.context_past(id, request.context);
                self.open.push(past);
                self.open.len() - 1
            }
        };
        self.open[i].compute(&self.model, request.tokens);
        self.passes += 1;
        self.current = Some(id);
        Ok(())
    }

    /// Computes the chunks of several requests in one forward pass (ABI 1.3 `stage`), each kept for the
    /// `prefill` of the same call ([`ModelBackend::compute`] finds it). Only calls that continue a
    /// request in progress, or start one at position 0, are staged, once per request; the rest (a
    /// context to find or compute first) are left to their own `prefill`. Each chunk's K/V are the bits
    /// its `prefill` alone would compute ([`Model::forward_batch`]).
    pub fn stage(&mut self, requests: &[Prefill<'_>]) -> Result<(), BackendError> {
        for r in requests {
            self.check_tokens(r)?;
        }
        let mut taken: Vec<(Past, &[u32])> = Vec::new();
        for r in requests {
            let (id, start) = (r.request_id, r.start_pos);
            if taken.iter().any(|(p, _)| p.request_id == id) {
                continue;
            }
            let past = match self.open.iter().position(|p| p.request_id == id) {
                Some(i) if self.open[i].len == start && !self.open[i].staged => self.open.remove(i),
                Some(_) => continue,
                None if start == 0 => Past::new(id, self.row()),
                None => continue,
            };
            taken.push((past, r.tokens));
        }
        if taken.is_empty() {
            return Ok(());
        }
        let segments: Vec<Segment<'_>> =
            taken.iter().map(|(p, tokens)| Segment { tokens, start: p.len, past: &p.kv, all_logits: false }).collect();
        let outs = self.model.forward_batch(&segments);
        self.passes += 1;
        for ((mut past, tokens), out) in taken.into_iter().zip(outs) {
            past.push(tokens, out.kv);
            past.staged = true;
            self.open.push(past);
        }
        self.trim_open();
        Ok(())
    }

    /// Refuses token ids outside the vocabulary.
    fn check_tokens(&self, request: &Prefill<'_>) -> Result<(), BackendError> {
        let vocab = self.model.config.vocab;
        match request.tokens.iter().chain(request.context).find(|&&t| t as usize >= vocab) {
            Some(&bad) => Err(BackendError::new(
                PdhostStatus::InvalidArgument,
                format!("token id {bad}: expected ids below the vocabulary size {vocab}"),
            )),
            None => Ok(()),
        }
    }

    /// K/V values per token per layer.
    fn row(&self) -> usize {
        self.model.config.kv_heads * self.model.config.head_dim
    }

    /// Moves the oldest requests in progress past [`MAX_OPEN`] to the store.
    fn trim_open(&mut self) {
        while self.open.len() > MAX_OPEN {
            self.close(0);
        }
        self.trim_store();
    }

    /// A new request's past holding `context`: the stored request agreeing longest with `context` (if
    /// any) gives its K/V up to there. A request in progress with the same id (started again) goes to the
    /// store first, as do the oldest past [`MAX_OPEN`].
    fn context_past(&mut self, request_id: u64, context: &[u32]) -> Past {
        if let Some(i) = self.open.iter().position(|p| p.request_id == request_id) {
            self.close(i);
        }
        while self.open.len() >= MAX_OPEN {
            self.close(0);
        }
        let common = |p: &Past| p.tokens.iter().zip(context).take_while(|(a, b)| a == b).count();
        let best = self.store.iter().enumerate().map(|(i, p)| (common(p), i)).max().filter(|&(n, _)| n > 0);
        let row = self.row();
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
            None => Past::new(request_id, row),
        };
        past.request_id = request_id;
        self.context_stats.reused += past.len;
        let have = past.len as usize;
        if have < context.len() {
            past.compute(&self.model, &context[have..]);
            self.context_stats.computed += (context.len() - have) as u64;
        }
        // The store keeps the newest requests that fit its budget.
        self.trim_store();
        past
    }

    /// The newest chunk's values of one entry, of the request computed last.
    fn newest<'a>(&'a self, e: &shm_format::Entry) -> &'a [f32] {
        let past = self.open.iter().find(|p| Some(p.request_id) == self.current).expect("compute ran");
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
        let past = b.open.iter().find(|p| Some(p.request_id) == b.current).unwrap();
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
        // Request 2 is stored when it is released: its first 8 tokens are reused.
        b.compute(&call(3, 8, &prompt[8..], &prompt[..8])).unwrap();
        assert_eq!(b.context_stats, ContextStats { reused: 0, computed: 16 }, "request 2 still in progress");
        b.release(2);
        b.release(3);
        b.compute(&call(5, 8, &prompt[8..], &prompt[..8])).unwrap();
        assert_eq!(b.context_stats, ContextStats { reused: 8, computed: 16 });
        assert!(newest(&b) == want);
        b.release(5);
        // A context that agrees with the store for 5 tokens reuses 5 and computes 3.
        let mut other = prompt.clone();
        other[5] = 200;
        b.compute(&call(4, 8, &other[8..], &other[..8])).unwrap();
        assert_eq!(b.context_stats, ContextStats { reused: 13, computed: 19 });
        let mut fresh = ModelBackend::open(&tiny(), PdhostLayout::Grouped, Dtype::F32).unwrap();
        fresh.compute(&call(1, 0, &other[..8], &[])).unwrap();
        fresh.compute(&call(1, 8, &other[8..], &[])).unwrap();
        assert!(newest(&b) == newest(&fresh));
    }

    /// Chunks staged together are the bits each computes alone, and `prefill` does not compute them again;
    /// a call that differs from what was staged computes its own chunk, with the staged one forgotten.
    #[test]
    fn staged_chunks_are_what_each_computes_alone() {
        let prompt = |seed: u32| -> Vec<u32> { (0..11).map(|i| 3 + (i * 7 + seed * 13) % 200).collect() };
        let (p1, p2, p3) = (prompt(1), prompt(2), prompt(3));
        let call = |request_id, start_pos, tokens| Prefill { request_id, start_pos, tokens, context: &[] };
        let alone = |calls: &[Prefill<'_>]| {
            let mut b = ModelBackend::open(&tiny(), PdhostLayout::Grouped, Dtype::F32).unwrap();
            calls.iter().map(|c| b.compute(c).map(|()| newest(&b)).unwrap()).last().unwrap()
        };
        let want1 = alone(&[call(1, 0, &p1[..4]), call(1, 4, &p1[4..])]);
        let want2 = alone(&[call(2, 0, &p2)]);
        let want3 = alone(&[call(3, 0, &p3[..6])]);

        let mut b = ModelBackend::open(&tiny(), PdhostLayout::Grouped, Dtype::F32).unwrap();
        b.compute(&call(1, 0, &p1[..4])).unwrap();
        // Request 1 continues, 2 and 3 start; 2 twice in one stage is staged once.
        let batch = [call(1, 4, &p1[4..]), call(2, 0, &p2), call(2, 0, &p2[..3]), call(3, 0, &p3[..6])];
        b.stage(&batch).unwrap();
        assert_eq!(b.open.iter().filter(|p| p.staged).count(), 3);
        assert_eq!(b.passes, 2);
        b.compute(&batch[0]).unwrap();
        assert!(newest(&b) == want1, "request 1's staged chunk");
        b.compute(&batch[1]).unwrap();
        assert!(newest(&b) == want2, "request 2's staged chunk");
        assert_eq!(b.passes, 2, "staged chunks are not computed again");
        // Request 3 comes with fewer tokens than were staged: its chunk is computed again, as asked.
        b.compute(&call(3, 0, &p3[..5])).unwrap();
        assert!(newest(&b) == alone(&[call(3, 0, &p3[..5])]));
        assert!(newest(&b) != want3);
        assert_eq!(b.open.iter().filter(|p| p.staged).count(), 0);
        // A staged chunk whose prefill never came is not in the store when its request is released.
        b.stage(&[call(1, 11, &p1[..2])]).unwrap();
        b.release(1);
        let stored = b.store.iter().find(|p| p.request_id == 1).unwrap();
        assert_eq!((stored.len, stored.tokens.len()), (11, 11));
        assert_eq!(stored.kv.k[0].len(), 11 * stored.kv.row);
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
