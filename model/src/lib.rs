//! Model loading, tokenizers and forward passes for pdhost.

pub mod quant;
