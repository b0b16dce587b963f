//! The tiny random HF checkpoints against transformers' fp32 outputs.

use model::arch::Model;
use model::forward::{argmax, NoPast, VecKv};

fn dir(name: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/reference").join(name)
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Greedy decoding one token at a time through `VecKv`; compares with the reference up to the first step
/// whose top-2 margin is below 0.01 (a near-tie either side may break differently).
fn check(name: &str) {
    let model = Model::from_hf_dir(&dir(name)).unwrap();
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir(name).join("reference.json")).unwrap()).unwrap();
    for case in reference["cases"].as_array().unwrap() {
        let prompt = ids(&case["prompt_ids"]);
        let want = ids(&case["output_ids"]);
        let margins: Vec<f64> = case["margins"].as_array().unwrap().iter().map(|m| m.as_f64().unwrap()).collect();

        // Teacher-forced logits at the last four positions of prompt + reference output, within 1e-3.
        let full: Vec<u32> = prompt.iter().chain(&want).copied().collect();
        let out = model.forward(&full, 0, &NoPast, true);
        let vocab = model.config.vocab;
        let tail = case["teacher_forced_last4_logits"].as_array().unwrap();
        for (j, row) in tail.iter().enumerate() {
            let pos = full.len() - 4 + j;
            for (i, want) in row.as_array().unwrap().iter().enumerate() {
                let got = out.logits[pos * vocab + i];
                let want = want.as_f64().unwrap() as f32;
                assert!((got - want).abs() <= 1e-3, "{}: position {pos} logit {i}: {got} vs {want}", case["name"]);
            }
        }

        // Greedy generation, one decode step at a time over the cached K/V.
        let mut kv = VecKv::default();
        let out = model.forward(&prompt, 0, &NoPast, false);
        kv.append(&out.kv);
        let mut next = argmax(&out.logits);
        let mut got = vec![next];
        for step in 1..want.len() {
            let pos = (prompt.len() + step - 1) as u64;
            let out = model.forward(&[next], pos, &kv, false);
            kv.append(&out.kv);
            next = argmax(&out.logits);
            got.push(next);
        }
        let stop = margins.iter().position(|&m| m < 0.01).unwrap_or(want.len());
        assert_eq!(&got[..stop], &want[..stop], "{}: greedy ids up to the first near-tie (step {stop})", case["name"]);
    }
}

#[test]
fn tiny_gemma3_matches_transformers() {
    check("tiny_gemma3_8l");
}

#[test]
fn tiny_llama_matches_transformers() {
    check("tiny_llama_4l");
}

#[test]
fn a_checkpoint_whose_tensors_do_not_fit_its_config_is_refused_by_name() {
    let err = refusal("tiny_llama_4l", "\"intermediate_size\": 64", "\"intermediate_size\": 48", "ckpt");
    assert!(
        err.contains(
            "tensor model.layers.0.mlp.gate_proj.weight: expected shape [48, 32] for this config, found shape [64, 32]"
        ),
        "{err}"
    );
}

/// A checkpoint's tensors as `rewritten` edits them: name, type, shape, bytes.
type Tensors = Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>;

/// A copy of checkpoint `model` in a scratch directory named by `tag`, its tensors changed by `edit`.
fn rewritten(model: &str, tag: &str, edit: impl FnOnce(&mut Tensors)) -> std::path::PathBuf {
    use safetensors::tensor::TensorView;
    let tmp = std::env::temp_dir().join(format!("pdhost-rewritten-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::copy(dir(model).join("config.json"), tmp.join("config.json")).unwrap();
    let bytes = std::fs::read(dir(model).join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Tensors =
        st.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView<'_>)> =
        tensors.iter().map(|(n, t, s, d)| (n.clone(), TensorView::new(*t, s.clone(), d).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &tmp.join("model.safetensors")).unwrap();
    tmp
}

/// A matrix stored transposed has every value and the right count: only its shape tells, and multiplied
/// as it lies it would give wrong logits, not an error. One of the tiny checkpoint's down projections
/// (32 x 64) is written back as its transpose (64 x 32).
#[test]
fn a_transposed_matrix_is_refused_by_its_shape() {
    let name = "model.layers.2.mlp.down_proj.weight";
    let tmp = rewritten("tiny_llama_4l", "transposed", |tensors| {
        let down = tensors.iter_mut().find(|(n, ..)| n == name).unwrap();
        let [rows, cols] = down.2[..] else { panic!("{name}: {:?}", down.2) };
        assert_ne!(rows, cols, "a square matrix would not show the transpose");
        let values: Vec<&[u8]> = down.3.chunks_exact(4).collect();
        let mut transposed = Vec::with_capacity(down.3.len());
        for c in 0..cols {
            for r in 0..rows {
                transposed.extend_from_slice(values[r * cols + c]);
            }
        }
        down.3 = transposed;
        down.2 = vec![cols, rows];
    });
    let err = Model::from_hf_dir(&tmp).unwrap_err().to_string();
    assert!(
        err.contains(&format!("tensor {name}: expected shape [32, 64] for this config, found shape [64, 32]")),
        "{err}"
    );
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// A tensor the model does not read passes whatever its type (checkpoints carry integer buffers such as
/// position ids); one it reads must be F32, BF16 or F16, and an untied output head must be there (it
/// used to become the embedding, silently).
#[test]
fn unread_tensors_of_any_type_pass_and_read_ones_must_be_floats() {
    use safetensors::Dtype;
    let ids = [1, 5, 9, 2];
    let want = Model::from_hf_dir(&dir("tiny_llama_4l")).unwrap().forward(&ids, 0, &NoPast, false).logits;
    let tmp = rewritten("tiny_llama_4l", "buffer", |t| {
        t.push((
            "model.rotary_emb.position_ids".into(),
            Dtype::I64,
            vec![1, 4],
            [0, 1, 2, 3].map(i64::to_le_bytes).concat(),
        ))
    });
    let got = Model::from_hf_dir(&tmp).unwrap().forward(&ids, 0, &NoPast, false).logits;
    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "an unread buffer changed the logits");
    std::fs::remove_dir_all(&tmp).unwrap();
    for (tag, edit, says) in [
        (
            "int-norm",
            Box::new(|t: &mut Tensors| t.iter_mut().find(|x| x.0 == "model.norm.weight").unwrap().1 = Dtype::I32)
                as Box<dyn FnOnce(&mut Tensors)>,
            "tensor model.norm.weight: expected F32, BF16 or F16, found I32",
        ),
        (
            "no-head",
            Box::new(|t: &mut Tensors| t.retain(|x| x.0 != "lm_head.weight")),
            "tensor lm_head.weight: expected present in the safetensors files, found none",
        ),
    ] {
        let tmp = rewritten("tiny_llama_4l", tag, edit);
        let err = Model::from_hf_dir(&tmp).unwrap_err().to_string();
        assert!(err.contains(says), "{tag}: {err}");
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}

/// The error of loading checkpoint `model` with `from` replaced by `to` in its config (which must
/// hold `from`); `tag` names its scratch directory.
fn refusal(model: &str, from: &str, to: &str, tag: &str) -> String {
    let base = std::fs::read_to_string(dir(model).join("config.json")).unwrap();
    let tmp = std::env::temp_dir().join(format!("pdhost-bad-config-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::copy(dir(model).join("model.safetensors"), tmp.join("model.safetensors")).unwrap();
    assert!(base.contains(from), "{from}");
    std::fs::write(tmp.join("config.json"), base.replace(from, to)).unwrap();
    let err = Model::from_hf_dir(&tmp).unwrap_err().to_string();
    std::fs::remove_dir_all(&tmp).unwrap();
    err
}

#[test]
fn a_config_that_would_panic_or_give_nan_is_refused_by_name() {
    for (i, (from, to, says)) in [
        ("\"intermediate_size\": 64", "\"intermediate_size\": 0", "feed-forward width 0"),
        ("\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": -1e-06", "norm epsilon: expected a finite number above 0"),
        ("\"rope_theta\": 10000.0", "\"rope_theta\": 0.0", "rope base: expected a finite number above 0, found 0"),
        ("\"eos_token_id\": 2", "\"eos_token_id\": 256", "special token: expected an id below the vocabulary size 256"),
        ("\"bos_token_id\": 1", "\"bos_token_id\": 4294967297", "found 4294967295"),
    ]
    .into_iter()
    .enumerate()
    {
        let err = refusal("tiny_llama_4l", from, to, &format!("nan-{i}"));
        assert!(err.contains(says), "{to}: {err}");
    }
}

/// What the forward pass does not implement (biases, another activation, scaled rotations, soft-capped
/// logits) is refused by name, not run as if absent.
#[test]
fn a_config_of_what_pdhost_does_not_implement_is_refused_by_name() {
    let cases = [
        ("tiny_llama_4l", "\"attention_bias\": false", "\"attention_bias\": true", "attention_bias: expected false"),
        ("tiny_llama_4l", "\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"", "hidden_act: expected silu"),
        (
            "tiny_llama_4l",
            "\"rope_type\": \"default\"",
            "\"rope_type\": \"llama3\"",
            "rope_parameters.rope_type: expected default (pdhost implements no other), found \"llama3\"",
        ),
        ("tiny_llama_4l", "\"use_cache\": true", "\"rope_scaling\": {\"factor\": 8.0}", "rope_scaling: expected null"),
        (
            "tiny_gemma3_8l",
            "\"final_logit_softcapping\": null",
            "\"final_logit_softcapping\": 30.0",
            "final_logit_softcapping: expected null (pdhost implements no other), found 30.0",
        ),
        (
            "tiny_gemma3_8l",
            "\"rope_type\": \"default\"",
            "\"rope_type\": \"linear\"",
            "rope_parameters.full_attention.rope_type: expected default",
        ),
    ];
    for (i, (model, from, to, says)) in cases.into_iter().enumerate() {
        let err = refusal(model, from, to, &format!("unimplemented-{i}"));
        assert!(err.contains(says), "{to}: {err}");
    }
}

#[test]
fn a_tensor_in_two_shards_is_refused_by_name() {
    let tmp = std::env::temp_dir().join(format!("pdhost-two-shards-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    for shard in ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"] {
        std::fs::copy(dir("tiny_llama_4l").join("model.safetensors"), tmp.join(shard)).unwrap();
    }
    std::fs::copy(dir("tiny_llama_4l").join("config.json"), tmp.join("config.json")).unwrap();
    let err = Model::from_hf_dir(&tmp).unwrap_err().to_string();
    assert!(
        err.contains("model-00002-of-00002.safetensors") && err.contains("found it in an earlier file too"),
        "{err}"
    );
    std::fs::remove_dir_all(&tmp).unwrap();
}
