//! Entry points for the fuzz targets in `fuzz/` that need a model's parts. They must never panic on
//! any input; the tests that run them on real tokenizers are in `tests/real_models.rs`, those of
//! [`hf_checkpoint`] below.

use std::path::Path;

use crate::arch::Model;
use crate::forward::NoPast;
use crate::tokenizer::Tokenizer;

/// Bytes as a Hugging Face checkpoint directory, written into `dir` (which exists): a little-endian
/// `u32` length, that many bytes as `config.json`, the rest as `model.safetensors`. Loading it gives a
/// model or an error, never a panic; a model that loads runs a forward pass of one token into one logit
/// per vocabulary entry (its config and its tensors agree, so the pass cannot index outside them).
/// Whether a model loaded.
pub fn hf_checkpoint(dir: &Path, data: &[u8]) -> bool {
    let Some((len, rest)) = data.split_first_chunk::<4>() else { return false };
    let Some((config, weights)) = rest.split_at_checked(u32::from_le_bytes(*len) as usize) else { return false };
    std::fs::write(dir.join("config.json"), config).expect("config.json written");
    std::fs::write(dir.join("model.safetensors"), weights).expect("model.safetensors written");
    let Ok(model) = Model::from_hf_dir(dir) else { return false };
    let out = model.forward(&[0], 0, &NoPast, false);
    assert_eq!(out.logits.len(), model.config.vocab, "one logit per vocabulary entry");
    true
}

/// Encodes `text` without BOS, and as prompts are (BOS as the model says). The tokens' bytes end to end
/// are what each character alone encodes to, end to end; and that is the character's bytes, or its bytes
/// less those the tokenizer drops ([`Tokenizer::drops_byte`]: a byte-level vocabulary without one of the
/// 256 byte characters and without an unknown token, as SmolLM2's, drops that byte, as Hugging Face's BPE
/// does), or, for SentencePiece's space mark U+2581, a space. Where the bytes are the text's, decoding
/// the ids gives the text back. A prompt is BOS and then the same ids.
pub fn tokenize(tok: &Tokenizer, text: &str) {
    let bytes_of = |ids: &[u32]| ids.iter().flat_map(|&id| tok.token_bytes(id)).collect::<Vec<u8>>();
    let plain = tok.encode(text, false);
    let bytes = bytes_of(&plain);
    let mut each = Vec::with_capacity(text.len());
    let mut buf = [0u8; 4];
    for c in text.chars() {
        let alone = bytes_of(&tok.encode(c.encode_utf8(&mut buf), false));
        let of_c = c.encode_utf8(&mut buf).as_bytes();
        let kept: Vec<u8> = of_c.iter().copied().filter(|&b| !tok.drops_byte(b)).collect();
        // SentencePiece writes a space as U+2581, so a U+2581 of the text's own reads back as a space.
        let escaped_space = c == '\u{2581}' && alone == b" ";
        assert!(
            escaped_space || alone == of_c || alone == kept,
            "{c:?} alone encodes to other bytes than its own (less those without a token): {alone:?}"
        );
        each.extend(alone);
    }
    assert!(bytes == each, "the tokens' bytes are not the text's: {text:?} -> {plain:?}");
    if bytes == text.as_bytes() {
        assert_eq!(tok.decode(&plain, false), text, "decoding {plain:?}");
    }
    let prompt = tok.encode(text, tok.add_bos());
    let skip = usize::from(tok.add_bos());
    assert_eq!(prompt.get(skip..), Some(plain.as_slice()), "BOS as the model says, then the same ids: {text:?}");
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use safetensors::tensor::{Dtype, TensorView};

    /// A checkpoint of one architecture, small enough to mutate quickly: `config.json` and every tensor
    /// the model reads (f32 values of a fixed pseudo-random sequence), in [`super::hf_checkpoint`]'s
    /// framing.
    fn checkpoint(gemma: bool) -> Vec<u8> {
        let (vocab, hidden, heads, kv_heads, head_dim, ffn, layers) = (16, 8, 2, 1, 4, 16, 2);
        let config = if gemma {
            serde_json::json!({
                "model_type": "gemma3_text", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": ffn,
                "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
                "num_hidden_layers": layers, "sliding_window": 4,
                "layer_types": ["sliding_attention", "full_attention"], "rms_norm_eps": 1e-6,
                "bos_token_id": 2, "eos_token_id": [1, 3], "max_position_embeddings": 64
            })
        } else {
            serde_json::json!({
                "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": ffn,
                "num_attention_heads": heads, "num_key_value_heads": kv_heads, "num_hidden_layers": layers,
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2,
                "max_position_embeddings": 64, "tie_word_embeddings": true
            })
        };
        let (qd, kvd) = (heads * head_dim, kv_heads * head_dim);
        let mut shapes: Vec<(String, Vec<usize>)> =
            vec![("model.embed_tokens.weight".into(), vec![vocab, hidden]), ("model.norm.weight".into(), vec![hidden])];
        for l in 0..layers {
            let n = |s: &str| format!("model.layers.{l}.{s}.weight");
            shapes.extend([
                (n("input_layernorm"), vec![hidden]),
                (n("self_attn.q_proj"), vec![qd, hidden]),
                (n("self_attn.k_proj"), vec![kvd, hidden]),
                (n("self_attn.v_proj"), vec![kvd, hidden]),
                (n("self_attn.o_proj"), vec![hidden, qd]),
                (n("post_attention_layernorm"), vec![hidden]),
                (n("mlp.gate_proj"), vec![ffn, hidden]),
                (n("mlp.up_proj"), vec![ffn, hidden]),
                (n("mlp.down_proj"), vec![hidden, ffn]),
            ]);
            if gemma {
                shapes.extend([
                    (n("self_attn.q_norm"), vec![head_dim]),
                    (n("self_attn.k_norm"), vec![head_dim]),
                    (n("pre_feedforward_layernorm"), vec![hidden]),
                    (n("post_feedforward_layernorm"), vec![hidden]),
                ]);
            }
        }
        let mut next = crate::testing::xorshift32(7);
        let data: Vec<Vec<u8>> = shapes
            .iter()
            .map(|(_, shape)| {
                let count: usize = shape.iter().product();
                (0..count).flat_map(|_| ((next() % 2001) as f32 / 1000.0 - 1.0).to_le_bytes()).collect()
            })
            .collect();
        let views = shapes
            .iter()
            .zip(&data)
            .map(|((name, shape), data)| (name.clone(), TensorView::new(Dtype::F32, shape.clone(), data).unwrap()));
        let weights = safetensors::serialize(views, None).unwrap();
        let config = serde_json::to_vec_pretty(&config).unwrap();
        let mut out = (config.len() as u32).to_le_bytes().to_vec();
        out.extend(config);
        out.extend(weights);
        out
    }

    /// The fuzz target's seeds (`fuzz/seeds/hf_checkpoint/`) are today's checkpoints, and each loads and
    /// runs; cut short or with a config that no longer fits, they are refused without a panic.
    /// `PDHOST_WRITE_SEEDS=1` writes them.
    #[test]
    fn hf_checkpoint_seeds_load_and_their_damaged_copies_are_refused() {
        let seeds = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/seeds/hf_checkpoint"));
        let dir = std::env::temp_dir().join(format!("pdhost-hf-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, gemma) in [("llama-2l", false), ("gemma3-2l", true)] {
            let seed = checkpoint(gemma);
            if std::env::var_os("PDHOST_WRITE_SEEDS").is_some() {
                std::fs::create_dir_all(seeds).unwrap();
                std::fs::write(seeds.join(name), &seed).unwrap();
            }
            assert_eq!(
                std::fs::read(seeds.join(name)).ok().as_ref(),
                Some(&seed),
                "{name}: PDHOST_WRITE_SEEDS=1 rewrites it"
            );
            assert!(super::hf_checkpoint(&dir, &seed), "{name} loads");
            for cut in [0, 3, 4, 40, seed.len() / 2, seed.len() - 1] {
                assert!(!super::hf_checkpoint(&dir, &seed[..cut]), "{name} cut to {cut} bytes");
            }
            // The same tensors under a config one unit wider: every shape disagrees.
            let len = u32::from_le_bytes(seed[..4].try_into().unwrap()) as usize;
            let config = std::str::from_utf8(&seed[4..4 + len]).unwrap();
            let wider = config.replacen("\"hidden_size\": 8", "\"hidden_size\": 9", 1);
            assert_ne!(wider, config);
            let framed = [&(wider.len() as u32).to_le_bytes()[..], wider.as_bytes(), &seed[4 + len..]].concat();
            assert!(!super::hf_checkpoint(&dir, &framed), "{name} with a wider config");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
