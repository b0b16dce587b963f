//! Model configuration and weights, from GGUF files or Hugging Face checkpoint directories.
//!
//! Weights are held as f32 row-major matrices `[out][in]` (PyTorch's `Linear.weight` layout; GGUF stores
//! the same thing with dims `[in, out]`). Conventions that differ between formats are normalised at load
//! time, so the forward pass has one code path:
//! - Gemma RMSNorm multiplies by `1 + w`: GGUF weights already include the `+ 1`, HF weights do not, so
//!   the HF loader adds it.
//! - Rotary embedding: Gemma rotates halves (NEOX) in both formats. llama.cpp's converter permutes Llama's
//!   Q/K rows so that adjacent pairs rotate; HF Llama rotates halves. [`Config::rope_adjacent`] records which.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use shm_format::{Dtype, KvGeometry, LayerKv};

use crate::gguf::{Gguf, GgufError};
use crate::kernels::{Exec, Interleaved, Precision, Weight, Q8};

/// The two architectures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Gemma 3 text.
    Gemma3,
    /// Llama.
    Llama,
}

/// The most layers a model may have (a count from a file past it is refused before anything is sized by
/// it).
pub const MAX_LAYERS: usize = 1 << 12;

/// Attention kind of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    /// Sees every earlier position.
    Full,
    /// Sees the last `window` positions, itself included.
    Sliding(u32),
}

/// Everything the forward pass needs to know besides the weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Architecture.
    pub arch: Arch,
    /// Vocabulary size.
    pub vocab: usize,
    /// Model width.
    pub hidden: usize,
    /// Feed-forward width.
    pub ffn: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Per layer.
    pub layers: Vec<Attention>,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Rope base of full-attention layers.
    pub rope_global: f32,
    /// Rope base of sliding layers.
    pub rope_local: f32,
    /// Whether rope rotates adjacent pairs (GGUF Llama) rather than halves.
    pub rope_adjacent: bool,
    /// Queries are scaled by `query_scale` (Gemma: `query_pre_attn_scalar^-1/2`, Llama: `head_dim^-1/2`).
    pub query_scale: f32,
    /// BOS id.
    pub bos: Option<u32>,
    /// EOS ids.
    pub eos: Vec<u32>,
    /// Positions the model was trained for (`context_length`, `max_position_embeddings`): prompt plus
    /// output tokens of one sequence may not exceed it.
    pub context: usize,
}

/// The context of a model whose metadata does not say (llama.cpp's default for such files).
pub const DEFAULT_CONTEXT: usize = 2048;

/// The tokens that end generation in a GGUF: its EOS, its end-of-turn and end-of-message tokens where it
/// names them, and for Gemma 3 `<end_of_turn>` (which Gemma 3's generation config lists beside EOS, and
/// llama.cpp ends on too; Gemma 3 270M's GGUF names only `<eos>`, so a chat reply ran to `max_tokens`).
fn gguf_eos(g: &Gguf, arch: Arch) -> Result<Vec<u32>, GgufError> {
    let mut eos = Vec::new();
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(id) = g.optional(key, Gguf::get_u64)?.and_then(|v| u32::try_from(v).ok()) {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
    }
    if arch == Arch::Gemma3 {
        let end_of_turn =
            g.get_strings("tokenizer.ggml.tokens").ok().and_then(|t| t.iter().position(|t| t == "<end_of_turn>"));
        if let Some(id) = end_of_turn.and_then(|i| u32::try_from(i).ok()).filter(|id| !eos.contains(id)) {
            eos.push(id);
        }
    }
    Ok(eos)
}

impl Config {
    /// The KV geometry (what the span fingerprint hashes).
    pub fn kv_geometry(&self) -> KvGeometry {
        let (kv_heads, head_dim) = (self.kv_heads as u32, self.head_dim as u32);
        KvGeometry {
            layers: self
                .layers
                .iter()
                .map(|a| match *a {
                    Attention::Full => LayerKv::Full { kv_heads, head_dim },
                    Attention::Sliding(window) => LayerKv::Sliding { window, kv_heads, head_dim },
                })
                .collect(),
        }
    }
}

/// One transformer layer's weights.
#[derive(Debug)]
pub struct LayerWeights {
    /// Pre-attention norm.
    pub attn_norm: Vec<f32>,
    /// `[heads * head_dim][hidden]`.
    pub wq: Weight,
    /// `[kv_heads * head_dim][hidden]`.
    pub wk: Weight,
    /// `[kv_heads * head_dim][hidden]`.
    pub wv: Weight,
    /// `[hidden][heads * head_dim]`.
    pub wo: Weight,
    /// Gemma: per-head query norm.
    pub q_norm: Option<Vec<f32>>,
    /// Gemma: per-head key norm.
    pub k_norm: Option<Vec<f32>>,
    /// Gemma: norm after attention.
    pub post_attn_norm: Option<Vec<f32>>,
    /// Pre-feed-forward norm.
    pub ffn_norm: Vec<f32>,
    /// Gemma: norm after the feed-forward.
    pub post_ffn_norm: Option<Vec<f32>>,
    /// `[ffn][hidden]`.
    pub gate: Weight,
    /// `[ffn][hidden]`.
    pub up: Weight,
    /// `[hidden][ffn]`.
    pub down: Weight,
}

/// A loaded model.
#[derive(Debug)]
pub struct Model {
    /// Configuration.
    pub config: Config,
    /// `[vocab][hidden]`.
    pub embed: Weight,
    /// Per layer.
    pub layers: Vec<LayerWeights>,
    /// Final norm.
    pub final_norm: Vec<f32>,
    /// `[vocab][hidden]`, or `None` when tied to `embed`.
    pub lm_head: Option<Weight>,
    /// Where it came from.
    pub source: PathBuf,
    /// Which weights, tokenizer and rope it is ([`crate::identity`]).
    pub identity: crate::identity::ModelIdentity,
    /// Precision and threads of the forward pass.
    pub exec: Exec,
    /// Q8_0 copies of the linear weights not held as integer blocks, in `fast` precision.
    pub q8: Option<FastWeights>,
    /// `fast`'s copies while the model runs `exact`, kept so that configuring `fast` again does not make
    /// them again (`bench model` switches precision cell by cell).
    spare_fast: Option<FastWeights>,
    /// The element type of the K/V cache this model's K/V goes to (f32 unless set): every chunk's K/V is
    /// rounded to it as soon as it is computed, so a position attends to the same values whether it is
    /// in the chunk being run or read back from the cache, and prefill is chunk-invariant.
    pub kv_dtype: Dtype,
}

/// `fast` precision's Q8_0 copies of the linear weights that are not integer blocks (f32, f16, bf16);
/// `None` where `fast` computes on the weight's own blocks, or where its rows are not whole Q8_0 blocks
/// (then it computes in f32).
#[derive(Debug)]
pub struct FastWeights {
    /// Per layer: q, k, v, o, gate, up, down.
    pub layers: Vec<[Option<Q8>; 7]>,
    /// The output head.
    pub head: Option<Q8>,
    /// Per layer (q, k, v, o, gate, up, down), the matrices of the types [`Interleaved`] covers with
    /// their rows interleaved: what `fast` multiplies instead of their blocks.
    pub interleaved: Vec<[Option<Weight>; 7]>,
    /// The output head interleaved likewise (a tied embedding's lookups read it too).
    pub interleaved_head: Option<Weight>,
}

impl FastWeights {
    /// The weight `fast` multiplies as the output head: the interleaved copy where there is one.
    pub fn head<'a>(fast: Option<&'a FastWeights>, head: &'a Weight) -> &'a Weight {
        fast.and_then(|f| f.interleaved_head.as_ref()).unwrap_or(head)
    }

    /// The weight `fast` multiplies as matrix `i` (q, k, v, o, gate, up, down) of layer `l`, whose
    /// blocks are `w`.
    pub fn layer<'a>(fast: Option<&'a FastWeights>, l: usize, i: usize, w: &'a Weight) -> &'a Weight {
        fast.and_then(|f| f.interleaved[l][i].as_ref()).unwrap_or(w)
    }
}

/// Why a model cannot be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// The GGUF file is bad.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A checkpoint directory is bad.
    #[error("{path}: {what}: expected {expected}, found {found}")]
    Checkpoint {
        /// The file.
        path: PathBuf,
        /// The key or tensor.
        what: String,
        /// Expected.
        expected: String,
        /// Found.
        found: String,
    },
    /// Reading failed.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl Config {
    /// The configuration of a GGUF file (`gemma3` or `llama` architecture), from its metadata alone: cheap,
    /// so requests can be checked against the model's limits before any weight is read.
    pub fn from_gguf(g: &Gguf) -> Result<Self, LoadError> {
        let arch_name = g.get_str("general.architecture")?.to_string();
        let arch = match arch_name.as_str() {
            "gemma3" => Arch::Gemma3,
            "llama" => Arch::Llama,
            other => {
                return Err(GgufError::Invalid {
                    path: g.path().into(),
                    what: "general.architecture".into(),
                    expected: "gemma3 or llama".into(),
                    found: other.into(),
                }
                .into())
            }
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        let invalid = |what: &str, expected: &str, found: String| GgufError::Invalid {
            path: g.path().into(),
            what: what.into(),
            expected: expected.into(),
            found,
        };
        let n_layers = g.get_u64(&key("block_count"))?;
        if n_layers > MAX_LAYERS as u64 {
            return Err(
                invalid(&key("block_count"), &format!("at most {MAX_LAYERS} layers"), n_layers.to_string()).into()
            );
        }
        let n_layers = n_layers as usize;
        let hidden = g.get_u64(&key("embedding_length"))? as usize;
        let heads = g.get_u64(&key("attention.head_count"))? as usize;
        let kv_heads = g.get_u64(&key("attention.head_count_kv"))? as usize;
        let head_dim =
            g.optional(&key("attention.key_length"), Gguf::get_u64)?.map_or(hidden / heads.max(1), |v| v as usize);
        // What the forward pass does not implement is refused by name, not run as if absent (wrong logits
        // that still decode): partial or scaled rotations, values of another width than keys.
        let unsupported = |what: &str, expected: &str, found: String| {
            Err(LoadError::from(invalid(what, &format!("{expected} (pdhost implements no other)"), found)))
        };
        for (k, expected) in [("rope.dimension_count", head_dim), ("attention.value_length", head_dim)] {
            if let Some(v) = g.optional(&key(k), Gguf::get_u64)?.filter(|&v| v != expected as u64) {
                return unsupported(&key(k), &format!("{expected}, the head size"), v.to_string());
            }
        }
        if let Some(v) = g.optional(&key("rope.scaling.type"), Gguf::get_str)?.filter(|&v| v != "none") {
            return unsupported(&key("rope.scaling.type"), "none", format!("{v:?}"));
        }
        if let Some(v) = g.optional(&key("rope.scaling.factor"), Gguf::get_f64)?.filter(|&v| v != 0.0 && v != 1.0) {
            return unsupported(&key("rope.scaling.factor"), "1", v.to_string());
        }
        if g.tensors.contains_key("rope_freqs.weight") {
            return unsupported("rope_freqs.weight", "no per-frequency rope factors", "the tensor".into());
        }
        let embed_info = g.tensor("token_embd.weight")?;
        let [_, vocab] = embed_info.dims[..] else {
            let found = format!("{} dimensions", embed_info.dims.len());
            return Err(invalid("token_embd.weight", "2 dimensions (width, vocabulary)", found).into());
        };
        let vocab = usize::try_from(vocab).unwrap_or(usize::MAX);
        let rope_global = g.optional(&key("rope.freq_base"), Gguf::get_f64)?.unwrap_or(10_000.0) as f32;
        let (layers, rope_local, query_scale) = match arch {
            Arch::Gemma3 => {
                // llama.cpp's Gemma 3 conventions: every sixth layer is global, local layers use base 10000,
                // and queries are scaled by query_pre_attn_scalar^-1/2, which a GGUF does not carry: the head
                // size, but for the 62-layer 27B model, whose scalar is hidden / heads (168, heads of 128).
                // A window past u32 is no window at all; 0 is refused by `checked`.
                let window = u32::try_from(g.get_u64(&key("attention.sliding_window"))?).unwrap_or(u32::MAX);
                let layers = (0..n_layers)
                    .map(|l| if l % 6 == 5 { Attention::Full } else { Attention::Sliding(window) })
                    .collect();
                let scalar = if n_layers == 62 { hidden / heads.max(1) } else { head_dim };
                (layers, 10_000.0, (scalar as f32).powf(-0.5))
            }
            Arch::Llama => (vec![Attention::Full; n_layers], rope_global, (head_dim as f32).powf(-0.5)),
        };
        let config = Config {
            arch,
            vocab,
            hidden,
            ffn: g.get_u64(&key("feed_forward_length"))? as usize,
            heads,
            kv_heads,
            head_dim,
            layers,
            eps: g.get_f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
            rope_global,
            rope_local,
            rope_adjacent: arch == Arch::Llama,
            query_scale,
            context: g.optional(&key("context_length"), Gguf::get_u64)?.map_or(DEFAULT_CONTEXT, |v| v as usize),
            bos: g.optional("tokenizer.ggml.bos_token_id", Gguf::get_u64)?.map(saturate_id),
            eos: gguf_eos(g, arch)?,
        };
        config.checked(g.path())
    }

    /// The configuration of a Hugging Face checkpoint directory (its `config.json`, model type
    /// `gemma3_text` or `llama`), without reading any weight.
    pub fn from_hf_dir(dir: &Path) -> Result<Self, LoadError> {
        Self::from_hf(&HfConfig::read(dir)?)
    }

    /// [`Config::from_hf_dir`] of a `config.json` already read.
    fn from_hf(hf: &HfConfig) -> Result<Self, LoadError> {
        let (config_path, c) = (&hf.path, &hf.json);
        let bad = |what: &str, expected: &str, found: String| hf.bad(what, expected, found);
        let u =
            |k: &str| c[k].as_u64().map(|v| v as usize).ok_or_else(|| bad(k, "an unsigned integer", c[k].to_string()));
        let arch = match c["model_type"].as_str() {
            Some("gemma3_text") => Arch::Gemma3,
            Some("llama") => Arch::Llama,
            _ => return Err(bad("model_type", "gemma3_text or llama", c["model_type"].to_string())),
        };
        let (hidden, heads, n_layers) = (u("hidden_size")?, u("num_attention_heads")?, u("num_hidden_layers")?);
        if n_layers > MAX_LAYERS {
            return Err(bad("num_hidden_layers", &format!("at most {MAX_LAYERS}"), n_layers.to_string()));
        }
        let head_dim = c["head_dim"].as_u64().map(|v| v as usize).unwrap_or(hidden / heads.max(1));
        // What the forward pass does not implement is refused by name, not run as if absent (wrong logits
        // that still decode). A key that is absent or null is the default.
        let (act_key, act) = match arch {
            Arch::Gemma3 => ("hidden_activation", "gelu_pytorch_tanh"),
            Arch::Llama => ("hidden_act", "silu"),
        };
        let given = |k: &str| Some(&c[k]).filter(|v| !v.is_null());
        let refuse = |k: &str, expected: &str, found: &serde_json::Value| {
            Err(bad(k, &format!("{expected} (pdhost implements no other)"), found.to_string()))
        };
        if let Some(v) = given(act_key).filter(|&v| v != act) {
            return refuse(act_key, act, v);
        }
        for k in ["attention_bias", "mlp_bias", "use_bidirectional_attention"] {
            if let Some(v) = given(k).filter(|&v| v != false) {
                return refuse(k, "false", v);
            }
        }
        for k in ["rope_scaling", "attn_logit_softcapping", "final_logit_softcapping"] {
            if let Some(v) = given(k) {
                return refuse(k, "null", v);
            }
        }
        // `rope_parameters` is one set of parameters, or one per attention kind.
        let rope_types: Vec<(String, &serde_json::Value)> = match &c["rope_parameters"] {
            serde_json::Value::Object(m) if m.contains_key("rope_type") => {
                vec![("rope_parameters".into(), &c["rope_parameters"])]
            }
            serde_json::Value::Object(m) => m.iter().map(|(kind, v)| (format!("rope_parameters.{kind}"), v)).collect(),
            _ => Vec::new(),
        };
        for (at, v) in rope_types {
            if v["rope_type"].as_str().is_some_and(|t| t != "default") {
                return refuse(&format!("{at}.rope_type"), "default", &v["rope_type"]);
            }
        }
        let rope = |kind: &str| -> Option<f32> {
            c["rope_parameters"][kind]["rope_theta"]
                .as_f64()
                .or_else(|| c["rope_parameters"]["rope_theta"].as_f64())
                .or_else(|| c["rope_theta"].as_f64())
                .map(|v| v as f32)
        };
        let (layers, rope_global, rope_local, query_scale) = match arch {
            Arch::Gemma3 => {
                let window = u32::try_from(u("sliding_window")?).unwrap_or(u32::MAX);
                let types = c["layer_types"]
                    .as_array()
                    .ok_or_else(|| bad("layer_types", "a list", c["layer_types"].to_string()))?;
                let layers = types
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("full_attention") => Ok(Attention::Full),
                        Some("sliding_attention") => Ok(Attention::Sliding(window)),
                        _ => Err(bad("layer_types", "full_attention or sliding_attention", t.to_string())),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                if layers.len() != n_layers {
                    return Err(bad("layer_types", &format!("{n_layers} entries"), layers.len().to_string()));
                }
                let scalar = c["query_pre_attn_scalar"].as_f64().unwrap_or(head_dim as f64) as f32;
                (
                    layers,
                    rope("full_attention").unwrap_or(1_000_000.0),
                    rope("sliding_attention").unwrap_or(10_000.0),
                    scalar.powf(-0.5),
                )
            }
            Arch::Llama => {
                let base = rope("default").unwrap_or(10_000.0);
                (vec![Attention::Full; n_layers], base, base, (head_dim as f32).powf(-0.5))
            }
        };
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            match v {
                serde_json::Value::Array(a) => a.iter().filter_map(|x| x.as_u64()).map(saturate_id).collect(),
                v => v.as_u64().map(|x| vec![saturate_id(x)]).unwrap_or_default(),
            }
        };
        let config = Config {
            arch,
            vocab: u("vocab_size")?,
            hidden,
            ffn: u("intermediate_size")?,
            heads,
            kv_heads: c["num_key_value_heads"].as_u64().map(|v| v as usize).unwrap_or(heads),
            head_dim,
            layers,
            eps: c["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
            rope_global,
            rope_local,
            rope_adjacent: false,
            query_scale,
            context: c["max_position_embeddings"].as_u64().map_or(DEFAULT_CONTEXT, |v| v as usize),
            bos: c["bos_token_id"].as_u64().map(saturate_id),
            eos: ids(&c["eos_token_id"]),
        };
        config.checked(config_path)
    }

    /// Refuses a configuration the forward pass cannot run (zero or mismatched heads, an odd head size,
    /// no layers, no vocabulary or context), before anything divides by it.
    fn checked(self, path: &Path) -> Result<Self, LoadError> {
        let bad = |what: &str, expected: &str, found: String| LoadError::Checkpoint {
            path: path.into(),
            what: what.into(),
            expected: expected.into(),
            found,
        };
        if self.heads == 0
            || self.kv_heads == 0
            || !self.heads.is_multiple_of(self.kv_heads)
            || !self.head_dim.is_multiple_of(2)
            || self.head_dim == 0
        {
            return Err(bad(
                "attention heads",
                "query heads a nonzero multiple of KV heads, an even nonzero head size",
                format!("{} heads, {} KV heads, head size {}", self.heads, self.kv_heads, self.head_dim),
            ));
        }
        // Sizes whose products (a projection's, the embedding's) cannot wrap, far past any model this
        // runs: a config that asks for more is refused, not multiplied.
        let sizes = [
            ("width", self.hidden, 1 << 17),
            ("heads", self.heads, 1 << 12),
            ("KV heads", self.kv_heads, 1 << 12),
            ("head size", self.head_dim, 1 << 14),
            ("feed-forward width", self.ffn, 1 << 20),
            ("vocabulary", self.vocab, 1 << 24),
        ];
        for (what, size, max) in sizes {
            if size > max {
                return Err(bad(what, &format!("at most {max}"), size.to_string()));
            }
        }
        // Floats a forward pass divides by, takes roots or powers of: a NaN, zero or negative one gives NaN
        // logits, not an error.
        let floats = [
            ("norm epsilon", self.eps),
            ("rope base", self.rope_global),
            ("local rope base", self.rope_local),
            ("attention scale", self.query_scale),
        ];
        for (what, v) in floats {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(what, "a finite number above 0", v.to_string()));
            }
        }
        // Token ids the engine feeds or watches for.
        let ids = self.bos.iter().chain(&self.eos);
        if let Some(id) = ids.copied().find(|&id| id as usize >= self.vocab) {
            return Err(bad(
                "special token",
                &format!("an id below the vocabulary size {}", self.vocab),
                id.to_string(),
            ));
        }
        if self.layers.contains(&Attention::Sliding(0)) {
            return Err(bad("sliding window", "at least one position", "0".into()));
        }
        if self.layers.is_empty() || self.vocab == 0 || self.hidden == 0 || self.ffn == 0 || self.context == 0 {
            return Err(bad(
                "model size",
                "at least one layer, token, hidden unit, feed-forward unit and context position",
                format!(
                    "{} layers, vocabulary {}, width {}, feed-forward width {}, context {}",
                    self.layers.len(),
                    self.vocab,
                    self.hidden,
                    self.ffn,
                    self.context
                ),
            ));
        }
        Ok(self)
    }
}

/// A token id from a file as a `u32`: one past `u32::MAX` becomes `u32::MAX`, which the vocabulary check
/// refuses, rather than wrapping to a real token.
fn saturate_id(id: u64) -> u32 {
    u32::try_from(id).unwrap_or(u32::MAX)
}

impl Model {
    /// Checks every weight's size against the configuration, so that a checkpoint whose tensors do not
    /// fit its config is an error naming the tensor, not a panic in the middle of a forward pass.
    fn checked(self) -> Result<Self, LoadError> {
        let c = &self.config;
        let (qd, kvd) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let bad = |what: String, expected: usize, found: usize| LoadError::Checkpoint {
            path: self.source.clone(),
            what,
            expected: format!("{expected} values for this config"),
            found: found.to_string(),
        };
        let check = |what: &str, len: usize, expected: usize| {
            if len == expected {
                Ok(())
            } else {
                Err(bad(what.to_string(), expected, len))
            }
        };
        if c.heads == 0 || c.kv_heads == 0 || !c.heads.is_multiple_of(c.kv_heads) || !c.head_dim.is_multiple_of(2) {
            return Err(LoadError::Checkpoint {
                path: self.source.clone(),
                what: "attention heads".into(),
                expected: "query heads a nonzero multiple of KV heads, an even head dim".into(),
                found: format!("{} heads, {} KV heads, head dim {}", c.heads, c.kv_heads, c.head_dim),
            });
        }
        // A matrix: its element count, and its row length where its blocks know it (a transposed
        // matrix has the right count and would fail mid-forward).
        let matrix = |what: &str, w: &Weight, rows: usize, cols: usize| {
            check(what, w.len(), rows * cols)?;
            match w.cols() {
                Some(found) if found != cols => Err(LoadError::Checkpoint {
                    path: self.source.clone(),
                    what: what.to_string(),
                    expected: format!("rows of {cols} values for this config"),
                    found: format!("rows of {found}"),
                }),
                _ => Ok(()),
            }
        };
        matrix("token embedding", &self.embed, c.vocab, c.hidden)?;
        check("final norm", self.final_norm.len(), c.hidden)?;
        if let Some(h) = &self.lm_head {
            matrix("output head", h, c.vocab, c.hidden)?;
        }
        if self.layers.len() != c.layers.len() {
            return Err(bad("layers".into(), c.layers.len(), self.layers.len()));
        }
        for (l, w) in self.layers.iter().enumerate() {
            let at = |name: &str| format!("layer {l} {name}");
            check(&at("attention norm"), w.attn_norm.len(), c.hidden)?;
            matrix(&at("q projection"), &w.wq, qd, c.hidden)?;
            matrix(&at("k projection"), &w.wk, kvd, c.hidden)?;
            matrix(&at("v projection"), &w.wv, kvd, c.hidden)?;
            matrix(&at("output projection"), &w.wo, c.hidden, qd)?;
            check(&at("feed-forward norm"), w.ffn_norm.len(), c.hidden)?;
            matrix(&at("gate projection"), &w.gate, c.ffn, c.hidden)?;
            matrix(&at("up projection"), &w.up, c.ffn, c.hidden)?;
            matrix(&at("down projection"), &w.down, c.hidden, c.ffn)?;
            for (name, norm, n) in [
                ("q norm", &w.q_norm, c.head_dim),
                ("k norm", &w.k_norm, c.head_dim),
                ("post-attention norm", &w.post_attn_norm, c.hidden),
                ("post-feed-forward norm", &w.post_ffn_norm, c.hidden),
            ] {
                if let Some(v) = norm {
                    check(&at(name), v.len(), n)?;
                }
            }
        }
        Ok(self)
    }

    /// Bytes of weights this model holds: matrices as its precision multiplies them (a GGUF's blocks
    /// are in its read-only mapping, paged in as they are used; `fast`'s interleaved copies stand for
    /// theirs, whose pages it releases), the embedding, norms, and `fast`'s Q8_0 copies.
    pub fn weight_bytes(&self) -> usize {
        let norms = |w: &LayerWeights| {
            [&w.q_norm, &w.k_norm, &w.post_attn_norm, &w.post_ffn_norm]
                .iter()
                .filter_map(|n| n.as_ref())
                .map(Vec::len)
                .sum::<usize>()
                + w.attn_norm.len()
                + w.ffn_norm.len()
        };
        let fast = self.q8.as_ref();
        let layers: usize = self
            .layers
            .iter()
            .enumerate()
            .map(|(l, w)| {
                [&w.wq, &w.wk, &w.wv, &w.wo, &w.gate, &w.up, &w.down]
                    .iter()
                    .enumerate()
                    .map(|(i, m)| FastWeights::layer(fast, l, i, m).bytes())
                    .sum::<usize>()
                    + 4 * norms(w)
            })
            .sum();
        let q8: usize = fast.map_or(0, |q| q.layers.iter().flatten().chain([&q.head]).flatten().map(Q8::bytes).sum());
        // The head and the embedding: a tied pair's interleaved copy stands for both (the embedding's
        // lookups read a few rows of the mapping, whose pages the copy released).
        let head_and_embed = match &self.lm_head {
            Some(h) => FastWeights::head(fast, h).bytes() + self.embed.bytes(),
            None => FastWeights::head(fast, &self.embed).bytes(),
        };
        head_and_embed + 4 * self.final_norm.len() + layers + q8
    }

    /// Sets precision and thread count. `fast` quantizes the linear weights that are not integer blocks
    /// to Q8_0 and interleaves the others' rows, once per model: switched back to `exact`, the copies are
    /// kept aside for a later `fast`.
    pub fn configure(&mut self, precision: Precision, threads: usize) {
        self.exec = Exec::new(precision, threads);
        if let Some(fast) = self.q8.take() {
            self.spare_fast = Some(fast);
        }
        self.q8 = match precision {
            Precision::Exact => None,
            Precision::Fast if self.spare_fast.is_some() => self.spare_fast.take(),
            Precision::Fast => {
                let c = &self.config;
                let (qd, kvd) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
                let q = |w: &Weight, rows: usize, cols: usize| {
                    if w.integer_blocks() {
                        None
                    } else {
                        Q8::of_weight(w, rows, cols)
                    }
                };
                let layers = self
                    .layers
                    .iter()
                    .map(|l| {
                        [
                            q(&l.wq, qd, c.hidden),
                            q(&l.wk, kvd, c.hidden),
                            q(&l.wv, kvd, c.hidden),
                            q(&l.wo, c.hidden, qd),
                            q(&l.gate, c.ffn, c.hidden),
                            q(&l.up, c.ffn, c.hidden),
                            q(&l.down, c.hidden, c.ffn),
                        ]
                    })
                    .collect();
                let head_w = self.lm_head.as_ref().unwrap_or(&self.embed);
                let head = q(head_w, c.vocab, c.hidden);
                let interleave = |w: &Weight| Interleaved::of(w).map(Weight::Interleaved);
                let (interleaved, interleaved_head) = self.exec.install(|| {
                    let layers = self
                        .layers
                        .iter()
                        .map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down].map(interleave))
                        .collect();
                    (layers, interleave(head_w))
                });
                Some(FastWeights { layers, head, interleaved, interleaved_head })
            }
        };
    }

    /// Loads a GGUF file (`gemma3` or `llama` architecture): norms as f32, every matrix as the file's own
    /// blocks (see [`Weight`]).
    pub fn from_gguf(g: &Gguf) -> Result<Self, LoadError> {
        let config = Config::from_gguf(g)?;
        let n_layers = config.layers.len();
        // Every tensor the model reads, asked for or looked for: the file may hold no other.
        let read = std::cell::RefCell::new(std::collections::BTreeSet::new());
        let t = |name: &str| {
            read.borrow_mut().insert(name.to_string());
            g.tensor_f32(name)
        };
        let opt = |name: &str| g.tensors.contains_key(name).then(|| t(name)).transpose();
        let m = |name: &str| -> Result<Weight, GgufError> {
            read.borrow_mut().insert(name.to_string());
            let info = g.tensor(name)?;
            Ok(Weight::from_blocks(info.ty, g.tensor_shared(name)?, info.dims.first().copied().unwrap_or(0) as usize))
        };
        let opt_m = |name: &str| g.tensors.contains_key(name).then(|| m(name)).transpose();
        let mut layer_weights = Vec::with_capacity(n_layers);
        for l in 0..n_layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            layer_weights.push(LayerWeights {
                attn_norm: t(&n("attn_norm"))?,
                wq: m(&n("attn_q"))?,
                wk: m(&n("attn_k"))?,
                wv: m(&n("attn_v"))?,
                wo: m(&n("attn_output"))?,
                q_norm: opt(&n("attn_q_norm"))?,
                k_norm: opt(&n("attn_k_norm"))?,
                post_attn_norm: opt(&n("post_attention_norm"))?,
                ffn_norm: t(&n("ffn_norm"))?,
                post_ffn_norm: opt(&n("post_ffw_norm"))?,
                gate: m(&n("ffn_gate"))?,
                up: m(&n("ffn_up"))?,
                down: m(&n("ffn_down"))?,
            });
        }
        let (embed, final_norm, lm_head) = (m("token_embd.weight")?, t("output_norm.weight")?, opt_m("output.weight")?);
        // A tensor the model would pass over (a bias, another layer) means a model it does not implement.
        if let Some(name) = g.tensors.keys().find(|&n| !read.borrow().contains(n)) {
            return Err(GgufError::Invalid {
                path: g.path().into(),
                what: format!("tensor {name:?}"),
                expected: format!("only the tensors of a {:?} model with {n_layers} layers", config.arch),
                found: "one pdhost does not read".into(),
            }
            .into());
        }
        Model {
            embed,
            layers: layer_weights,
            final_norm,
            lm_head,
            identity: gguf_identity(g, &config)?,
            config,
            source: g.path().into(),
            exec: Exec::new(Precision::Exact, 1),
            q8: None,
            spare_fast: None,
            kv_dtype: Dtype::F32,
        }
        .checked()
    }

    /// Loads a Hugging Face checkpoint directory (`config.json` and `*.safetensors`) of model type
    /// `gemma3_text` or `llama`. Every tensor the model uses must have the shape the config gives it (a
    /// transposed matrix has the right element count and would multiply into wrong values); tensors it
    /// does not use are passed over, as checkpoints carry buffers such as `rotary_emb.inv_freq` (a GGUF's
    /// converter writes only what the model reads, so there an unused tensor is refused), whatever their
    /// type; each tensor it uses must be F32, BF16 or F16.
    pub fn from_hf_dir(dir: &Path) -> Result<Self, LoadError> {
        let hf = HfConfig::read(dir)?;
        let config = Config::from_hf(&hf)?;
        let c = &config;
        let (arch, n_layers) = (c.arch, c.layers.len());
        let (qd, kvd) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let mut t = HfTensors::load(dir)?;
        // Gemma's HF norms store w; the forward pass multiplies by the GGUF convention `1 + w`.
        let norm = |t: &mut HfTensors, name: &str, n: usize| -> Result<Vec<f32>, LoadError> {
            let w = t.take(name, &[n])?;
            Ok(if arch == Arch::Gemma3 { w.into_iter().map(|x| 1.0 + x).collect() } else { w })
        };
        let gemma_norm = |t: &mut HfTensors, name: &str, n: usize| -> Result<Option<Vec<f32>>, LoadError> {
            if arch == Arch::Gemma3 {
                norm(t, name, n).map(Some)
            } else {
                Ok(None)
            }
        };
        let mut layer_weights = Vec::with_capacity(n_layers);
        for l in 0..n_layers {
            let n = |s: &str| format!("model.layers.{l}.{s}.weight");
            let (ffn_norm, post_attn) = match arch {
                Arch::Gemma3 => (
                    norm(&mut t, &n("pre_feedforward_layernorm"), c.hidden)?,
                    gemma_norm(&mut t, &n("post_attention_layernorm"), c.hidden)?,
                ),
                Arch::Llama => (norm(&mut t, &n("post_attention_layernorm"), c.hidden)?, None),
            };
            layer_weights.push(LayerWeights {
                attn_norm: norm(&mut t, &n("input_layernorm"), c.hidden)?,
                wq: t.take(&n("self_attn.q_proj"), &[qd, c.hidden])?.into(),
                wk: t.take(&n("self_attn.k_proj"), &[kvd, c.hidden])?.into(),
                wv: t.take(&n("self_attn.v_proj"), &[kvd, c.hidden])?.into(),
                wo: t.take(&n("self_attn.o_proj"), &[c.hidden, qd])?.into(),
                q_norm: gemma_norm(&mut t, &n("self_attn.q_norm"), c.head_dim)?,
                k_norm: gemma_norm(&mut t, &n("self_attn.k_norm"), c.head_dim)?,
                post_attn_norm: post_attn,
                ffn_norm,
                post_ffn_norm: gemma_norm(&mut t, &n("post_feedforward_layernorm"), c.hidden)?,
                gate: t.take(&n("mlp.gate_proj"), &[c.ffn, c.hidden])?.into(),
                up: t.take(&n("mlp.up_proj"), &[c.ffn, c.hidden])?.into(),
                down: t.take(&n("mlp.down_proj"), &[c.hidden, c.ffn])?.into(),
            });
        }
        let embed = t.take("model.embed_tokens.weight", &[c.vocab, c.hidden])?.into();
        let final_norm = norm(&mut t, "model.norm.weight", c.hidden)?;
        // As transformers: a tied head is the embedding (an `lm_head.weight` beside it is passed over), and
        // an untied one must be in the checkpoint (before, a missing one silently became the embedding).
        let lm_head = match hf.tied(arch)? {
            true => None,
            false => Some(Weight::F32(t.take("lm_head.weight", &[c.vocab, c.hidden])?)),
        };
        Model {
            embed,
            layers: layer_weights,
            final_norm,
            lm_head,
            identity: hf_identity(dir, &config)?,
            config,
            source: dir.into(),
            exec: Exec::new(Precision::Exact, 1),
            q8: None,
            spare_fast: None,
            kv_dtype: Dtype::F32,
        }
        .checked()
    }
}

/// The identity of a GGUF model: its tensor data, its token strings, its rope bases.
pub fn gguf_identity(g: &Gguf, config: &Config) -> Result<crate::identity::ModelIdentity, GgufError> {
    let start = g.tensors.values().map(|t| t.offset).min().unwrap_or(0);
    let end = g.tensors.values().map(|t| t.offset + t.len).max().unwrap_or(0);
    let weights = crate::identity::digest(g.data_bytes(start, end));
    let tokens: Vec<&str> = g.get_strings("tokenizer.ggml.tokens").map(|a| a.iter().collect()).unwrap_or_default();
    let tokenizer = crate::identity::digest(tokens.join("\n").as_bytes());
    Ok(crate::identity::ModelIdentity::new(weights, tokenizer, config.rope_global, config.rope_local))
}

/// The identity of a checkpoint directory: its safetensors files, its `tokenizer.json`, its rope bases.
pub fn hf_identity(dir: &Path, config: &Config) -> Result<crate::identity::ModelIdentity, LoadError> {
    let io = |source| LoadError::Io { path: dir.into(), source };
    let weights = crate::identity::digest_files(&safetensors_files(dir)?).map_err(io)?;
    let tokenizer = crate::identity::digest_tokenizer_json(dir).map_err(io)?;
    Ok(crate::identity::ModelIdentity::new(weights, tokenizer, config.rope_global, config.rope_local))
}

/// The `*.safetensors` files of `dir`, in name order (at least one).
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|source| LoadError::Io { path: dir.into(), source })?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(LoadError::Checkpoint {
            path: dir.into(),
            what: "weights".into(),
            expected: "at least one *.safetensors file".into(),
            found: "none".into(),
        });
    }
    Ok(files)
}

/// A checkpoint directory's `config.json`, read and parsed once for the configuration and the weights.
struct HfConfig {
    path: PathBuf,
    json: serde_json::Value,
}

impl HfConfig {
    fn read(dir: &Path) -> Result<Self, LoadError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| LoadError::Io { path: path.clone(), source })?;
        let json = serde_json::from_str(&text).map_err(|e| LoadError::Checkpoint {
            path: path.clone(),
            what: "its text".into(),
            expected: "JSON".into(),
            found: e.to_string(),
        })?;
        Ok(HfConfig { path, json })
    }

    /// Its key `what` is not what the loader expected.
    fn bad(&self, what: &str, expected: &str, found: String) -> LoadError {
        LoadError::Checkpoint { path: self.path.clone(), what: what.into(), expected: expected.into(), found }
    }

    /// Whether the checkpoint ties its output head to the embedding: `tie_word_embeddings`, or when
    /// absent the model type's default in transformers (Gemma 3's text model ties, Llama does not).
    fn tied(&self, arch: Arch) -> Result<bool, LoadError> {
        match &self.json["tie_word_embeddings"] {
            serde_json::Value::Null => Ok(arch == Arch::Gemma3),
            serde_json::Value::Bool(tied) => Ok(*tied),
            other => Err(self.bad("tie_word_embeddings", "true or false", other.to_string())),
        }
    }
}

/// Every tensor of a checkpoint directory's `*.safetensors` files, as f32 (or why not) with its shape,
/// each taken once by the model that uses it (so no tensor is held twice while the model is built).
struct HfTensors {
    dir: PathBuf,
    /// By name: the shape, and the values.
    tensors: HashMap<String, (Vec<usize>, HfValues)>,
}

/// A tensor's values widened to f32, or why they cannot be (a type the model could not read, reported
/// only if the model reads that tensor: checkpoints carry integer buffers too).
type HfValues = Result<Vec<f32>, LoadError>;

impl HfTensors {
    /// Reads every `*.safetensors` file of `dir`: each is mapped and its tensors widened to f32, each
    /// tensor's pages dropped from the process once copied, so a load holds the f32 values and one
    /// tensor's pages of the files.
    fn load(dir: &Path) -> Result<Self, LoadError> {
        let mut tensors = HashMap::new();
        for path in safetensors_files(dir)? {
            let io = |source| LoadError::Io { path: path.clone(), source };
            let file = std::fs::File::open(&path).map_err(io)?;
            // SAFETY: a shared, read-only mapping of the file, read only while this function runs (the
            // values are copied out as f32). As for a GGUF (`Gguf::open`), a checkpoint must not be
            // truncated or rewritten while pdhost loads it.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
            let st = safetensors::SafeTensors::deserialize(&map).map_err(|e| LoadError::Checkpoint {
                path: path.clone(),
                what: "safetensors header".into(),
                expected: "a valid safetensors file".into(),
                found: e.to_string(),
            })?;
            for (name, view) in st.tensors() {
                let data = view.data();
                let values: HfValues = match view.dtype() {
                    safetensors::Dtype::F32 => {
                        Ok(data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
                    }
                    safetensors::Dtype::BF16 => {
                        Ok(data.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect())
                    }
                    safetensors::Dtype::F16 => {
                        Ok(data.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect())
                    }
                    other => Err(LoadError::Checkpoint {
                        path: path.clone(),
                        what: format!("tensor {name}"),
                        expected: "F32, BF16 or F16".into(),
                        found: other.to_string(),
                    }),
                };
                // SAFETY: as `BlockBytes::release`: the mapping is a file's, shared, read-only and never
                // written through, so a dropped page maps again with the same bytes if it is read again.
                // Advice only: refused, the pages stay resident until the map is dropped.
                let _ = unsafe {
                    map.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        data.as_ptr() as usize - map.as_ptr() as usize,
                        data.len(),
                    )
                };
                // Shards each hold their own tensors: a second copy of one would silently replace the first.
                if tensors.insert(name.clone(), (view.shape().to_vec(), values)).is_some() {
                    return Err(LoadError::Checkpoint {
                        path: path.clone(),
                        what: format!("tensor {name}"),
                        expected: "one safetensors file of the directory holding it".into(),
                        found: "it in an earlier file too".into(),
                    });
                }
            }
        }
        Ok(HfTensors { dir: dir.into(), tensors })
    }

    /// Takes the tensor `name`, which must have the shape `shape`.
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        let bad = |expected: String, found: String| LoadError::Checkpoint {
            path: self.dir.clone(),
            what: format!("tensor {name}"),
            expected,
            found,
        };
        match self.tensors.remove(name) {
            None => Err(bad("present in the safetensors files".into(), "none".into())),
            Some((found, _)) if found != shape => {
                Err(bad(format!("shape {shape:?} for this config"), format!("shape {found:?}")))
            }
            Some((_, values)) => values,
        }
    }
}
