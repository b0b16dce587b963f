//! The two real models, fetched through pdhost's own model cache (never skipped: a missing model is
//! fetched, and a fetch that fails fails the test).

use std::path::PathBuf;
use std::sync::OnceLock;

use model::gguf::Gguf;
use model::registry;

fn fetched(name: &'static str) -> PathBuf {
    static GEMMA: OnceLock<PathBuf> = OnceLock::new();
    static SMOL: OnceLock<PathBuf> = OnceLock::new();
    let cell = if name == "gemma3-270m" { &GEMMA } else { &SMOL };
    cell.get_or_init(|| registry::fetch(name, &mut registry::Quiet).unwrap_or_else(|e| panic!("fetching {name}: {e}")))
        .clone()
}

fn reference() -> serde_json::Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/reference/dequant_vectors.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Whole tensors of both files dequantize to the reference's sums, at the reference's file offsets.
#[test]
fn whole_tensors_of_both_models_match_the_reference() {
    let reference = reference();
    for (file, name) in
        [("gemma-3-270m-q4_k_m.gguf", "gemma3-270m"), ("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m")]
    {
        let gguf = Gguf::open(&fetched(name)).unwrap();
        let mut checked = 0;
        for (key, v) in reference.as_object().unwrap() {
            let Some(tensor) = key.strip_prefix(&format!("{file}::")) else { continue };
            let info = gguf.tensor(tensor).unwrap();
            assert_eq!(info.offset, v["file_offset_abs"].as_u64().unwrap(), "{key} offset");
            let dims: Vec<u64> = v["ne"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
            assert_eq!(info.dims, dims, "{key} dims");
            let w = gguf.tensor_f32(tensor).unwrap();
            let row0: Vec<f32> =
                v["row0_first16"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
            assert_eq!(&w[..row0.len()], &row0[..], "{key} row 0");
            let sum: f64 = w.iter().map(|&x| f64::from(x)).sum();
            let want = v["sum"].as_f64().unwrap();
            assert!((sum - want).abs() <= 1e-3 * want.abs().max(1.0), "{key}: sum {sum}, reference {want}");
            checked += 1;
        }
        assert!(checked >= 2, "{file}: {checked} tensors checked");
    }
}

#[test]
fn metadata_describes_the_architectures() {
    let gemma = Gguf::open(&fetched("gemma3-270m")).unwrap();
    assert_eq!(gemma.get_str("general.architecture").unwrap(), "gemma3");
    assert_eq!(gemma.get_u64("gemma3.block_count").unwrap(), 18);
    assert_eq!(gemma.get_u64("gemma3.attention.sliding_window").unwrap(), 512);
    // Generation ends at `<eos>` and, as Gemma 3's generation config and llama.cpp have it, at
    // `<end_of_turn>` (the GGUF names only the first).
    assert_eq!(model::arch::Config::from_gguf(&gemma).unwrap().eos, [1, 106]);
    let smol = Gguf::open(&fetched("smollm2-135m")).unwrap();
    assert_eq!(smol.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(smol.get_u64("llama.block_count").unwrap(), 30);
    assert_eq!(model::arch::Config::from_gguf(&smol).unwrap().eos, [2]);
}

#[test]
fn a_corrupt_file_gets_an_error_naming_what_is_wrong() {
    let dir = std::env::temp_dir().join(format!("pdhost-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = std::fs::read(fetched("smollm2-135m")).unwrap();
    let cases: [(&str, Vec<u8>, &str); 3] = [
        ("magic", [b"GGUX".as_slice(), &good[4..]].concat(), "expected the GGUF magic"),
        ("truncated", good[..good.len() / 2].to_vec(), "data inside the"),
        ("header", good[..20].to_vec(), "truncated reading"),
    ];
    for (name, bytes, want) in cases {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        let err = Gguf::open(&path).unwrap_err().to_string();
        assert!(err.contains(want), "{name}: {err}");
        assert!(!err.contains('\n'));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn gguf_string(s: &str) -> Vec<u8> {
    [&(s.len() as u64).to_le_bytes()[..], s.as_bytes()].concat()
}

/// A metadata entry: key, GGUF type, value bytes.
fn entry(key: &str, ty: u32, value: &[u8]) -> Vec<u8> {
    [gguf_string(key), ty.to_le_bytes().to_vec(), value.to_vec()].concat()
}

/// A string entry that takes `added` bytes inserted before a GGUF's data to a multiple of its 32-byte
/// alignment, so that every tensor's data keeps its relative offset: 8 + 5 + 4 + 8 bytes and its text.
fn filler(added: usize) -> Vec<u8> {
    let text = (added + 25).next_multiple_of(32) - added - 25;
    let filler = entry("x.pad", 8, &gguf_string(&"p".repeat(text)));
    assert_eq!((added + filler.len()) % 32, 0);
    filler
}

/// `good` with `entries` (key, GGUF type, value bytes) put first among its metadata, and a [`filler`].
fn with_metadata(good: &[u8], entries: &[(&str, u32, Vec<u8>)]) -> Vec<u8> {
    let mut added: Vec<u8> = entries.iter().flat_map(|(k, ty, v)| entry(k, *ty, v)).collect();
    added.extend(filler(added.len()));
    let n_kv = u64::from_le_bytes(good[16..24].try_into().unwrap()) + entries.len() as u64 + 1;
    [&good[..16], &n_kv.to_le_bytes(), &added, &good[24..]].concat()
}

/// What the forward pass does not implement, or metadata it cannot trust, is refused at load by name,
/// not run as if absent: SmolLM2 with one key added before its own.
#[test]
fn metadata_the_model_cannot_honour_is_refused() {
    let dir = std::env::temp_dir().join(format!("pdhost-gguf-meta-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = std::fs::read(fetched("smollm2-135m")).unwrap();
    let load = |name: &str, entries: &[(&str, u32, Vec<u8>)]| {
        let path = dir.join(name);
        std::fs::write(&path, with_metadata(&good, entries)).unwrap();
        let result = Gguf::open(&path).map_err(model::arch::LoadError::from).and_then(|g| {
            let config = model::arch::Config::from_gguf(&g)?;
            model::tokenizer::Tokenizer::from_gguf(&g)?;
            model::arch::Model::from_gguf(&g).map(|_| config)
        });
        std::fs::remove_file(&path).unwrap();
        result.map_err(|e| e.to_string().replace(&path.display().to_string(), "FILE"))
    };
    // The padding alone changes nothing.
    assert_eq!(load("pad", &[]).unwrap().layers.len(), 30);
    let u32v = |v: u32| v.to_le_bytes().to_vec();
    for (name, entries, want) in [
        (
            "duplicate",
            vec![("llama.block_count", 4, u32v(2))],
            "FILE: metadata \"llama.block_count\": expected each key once, found it again",
        ),
        (
            "scaling",
            vec![("llama.rope.scaling.type", 8, gguf_string("linear"))],
            "FILE: llama.rope.scaling.type: expected none (pdhost implements no other), found \"linear\"",
        ),
        (
            "values of another width",
            vec![("llama.attention.value_length", 4, u32v(32))],
            "FILE: llama.attention.value_length: expected 64, the head size (pdhost implements no other), found 32",
        ),
        (
            "a width of the wrong type",
            vec![("llama.attention.key_length", 8, gguf_string("64"))],
            "FILE: llama.attention.key_length: expected an unsigned integer, found a string",
        ),
        (
            "a scaling factor of the wrong type",
            vec![("llama.rope.scaling.factor", 4, u32v(8))],
            "FILE: llama.rope.scaling.factor: expected a float, found an unsigned integer",
        ),
        (
            "an end token of the wrong type",
            vec![("tokenizer.ggml.eot_token_id", 8, gguf_string("2"))],
            "FILE: tokenizer.ggml.eot_token_id: expected an unsigned integer, found a string",
        ),
    ] {
        assert_eq!(load(name, &entries).unwrap_err(), want, "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A tensor the model would pass over (here a bias, which Llama's forward pass has none of) means a model
/// pdhost does not implement: refused by name at load.
#[test]
fn a_tensor_the_model_does_not_read_is_refused() {
    let path = fetched("smollm2-135m");
    let good = std::fs::read(&path).unwrap();
    let g = Gguf::open(&path).unwrap();
    // The first tensor's data starts the data section (relative offset 0), and its name starts the
    // tensor infos.
    let (first, data) = g.tensors.iter().map(|(n, t)| (n, t.offset as usize)).min_by_key(|&(_, at)| at).unwrap();
    let infos = find(&good[..data], &gguf_string(first)).unwrap();
    let rel = (good.len() - data).next_multiple_of(32) as u64;
    let info = [gguf_string("blk.0.attn_q.bias"), 1u32.to_le_bytes().to_vec(), 576u64.to_le_bytes().to_vec()].concat();
    let info = [info, 0u32.to_le_bytes().to_vec(), rel.to_le_bytes().to_vec()].concat();
    let filler = filler(info.len());
    let counts = |at: usize, by: u64| (u64::from_le_bytes(good[at..at + 8].try_into().unwrap()) + by).to_le_bytes();
    let mut bytes =
        [&good[..8], &counts(8, 1), &counts(16, 1), &filler, &good[24..infos], &info, &good[infos..]].concat();
    bytes.resize(data + filler.len() + info.len() + rel as usize + 576 * 4, 0);
    let bad = std::env::temp_dir().join(format!("pdhost-gguf-bias-{}", std::process::id()));
    std::fs::write(&bad, bytes).unwrap();
    let opened = Gguf::open(&bad).unwrap();
    assert_eq!(opened.tensors["blk.0.attn_q.bias"].elems(), 576);
    let err = model::arch::Model::from_gguf(&opened).err().unwrap().to_string();
    std::fs::remove_file(&bad).unwrap();
    assert!(
        err.ends_with(
            ": tensor \"blk.0.attn_q.bias\": expected only the tensors of a Llama model with 30 layers, found one pdhost \
             does not read"
        ),
        "{err}"
    );
}

/// Where `needle` last occurs in `haystack` (a tensor's info lies after the vocabulary).
fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).rposition(|w| w == needle)
}

/// Token ids equal Hugging Face's on every reference string, with and without BOS, and decode back.
#[test]
fn tokenizers_match_hugging_face_ids() {
    for (name, reference) in
        [("gemma3-270m", "tokenizer_gemma3_270m.json"), ("smollm2-135m", "tokenizer_smollm2_135m.json")]
    {
        let gguf = Gguf::open(&fetched(name)).unwrap();
        let tok = model::tokenizer::Tokenizer::from_gguf(&gguf).unwrap();
        let path = format!("{}/../fixtures/reference/{reference}", env!("CARGO_MANIFEST_DIR"));
        let cases: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
        };
        for case in cases["cases"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            assert_eq!(tok.encode(text, false), ids(&case["ids_plain"]), "{name} {text:?}");
            assert_eq!(tok.encode(text, tok.add_bos()), ids(&case["ids_with_bos"]), "{name} {text:?} with BOS");
            assert_eq!(tok.decode(&ids(&case["ids_plain"]), false), text, "{name} decode {text:?}");
            // Each token's own bytes (the API's log-probabilities name tokens by them), end to end, are
            // the text's.
            let bytes: Vec<u8> = ids(&case["ids_plain"]).iter().flat_map(|&id| tok.token_bytes(id)).collect();
            assert_eq!(bytes, text.as_bytes(), "{name} token bytes of {text:?}");
        }
        // A character past the vocabulary (Gemma's byte fallback) or made of several byte-level tokens
        // (SmolLM2): some token of it is part of a character, whose bytes stay as they are.
        let ids = tok.encode("\u{10FFFD}\u{1F9EC}", false);
        let parts: Vec<Vec<u8>> = ids.iter().map(|&id| tok.token_bytes(id)).collect();
        assert_eq!(parts.concat(), "\u{10FFFD}\u{1F9EC}".as_bytes(), "{name} {ids:?}");
        assert!(parts.iter().any(|p| std::str::from_utf8(p).is_err()), "{name}: {parts:?}");
    }
}

/// Text no reference covers (what the `tokenize` fuzz target starts from): control characters, lone
/// combining marks, special tokens' own text, long runs of spaces, newlines and digits, characters past
/// the vocabulary. Every one comes back from its tokens, byte for byte, but for the bytes SmolLM2's
/// vocabulary has no token for.
#[test]
fn any_text_comes_back_from_its_tokens() {
    let seeds = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/seeds/tokenize")).unwrap();
    let mut texts: Vec<String> =
        seeds.map(|e| String::from_utf8(std::fs::read(e.unwrap().path()).unwrap()).unwrap()).collect();
    assert!(texts.len() >= 8, "the seeds: {}", texts.len());
    texts.extend([" ".repeat(5000), "\n".repeat(3000), "9".repeat(2000), "\u{0301}".repeat(100)]);
    for name in ["gemma3-270m", "smollm2-135m"] {
        let tok = model::tokenizer::Tokenizer::from_gguf(&Gguf::open(&fetched(name)).unwrap()).unwrap();
        for text in &texts {
            model::fuzzing::tokenize(&tok, text);
        }
        // SmolLM2's vocabulary has no token for byte 0x16, and no unknown token: the byte is dropped, as
        // Hugging Face's tokenizer drops it. Gemma 3's byte fallback keeps it.
        let ids = tok.encode("a\u{16}b", false);
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| tok.token_bytes(id)).collect();
        let kept: &[u8] = if name == "gemma3-270m" { b"a\x16b" } else { b"ab" };
        assert_eq!(bytes, kept, "{name}");
        // SmolLM2 has none for 21 bytes: six control characters, and bytes no UTF-8 text holds but for
        // 0xF1 and 0xF2, which lead characters of the unassigned planes 4 to 11.
        let dropped: Vec<u8> = (0..=255).filter(|&b| tok.drops_byte(b)).collect();
        let smollm2 = [4, 6, 0x13, 0x14, 0x16, 0x1d, 0xc0, 0xc1, 0xf1, 0xf2, 0xf5, 0xf6, 0xf7, 0xf8, 0xf9]
            .into_iter()
            .chain(0xfa..=0xff)
            .collect::<Vec<u8>>();
        assert_eq!(dropped, if name == "gemma3-270m" { vec![] } else { smollm2 }, "{name}");
    }
}

/// The long reference prompts (past the sliding window) tokenize exactly as Hugging Face fed them.
#[test]
fn reference_prompts_tokenize_to_the_reference_prompt_ids() {
    let dir = format!("{}/../fixtures/reference", env!("CARGO_MANIFEST_DIR"));
    let prompts: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{dir}/prompts.json")).unwrap()).unwrap();
    for (name, greedy) in [("gemma3-270m", "greedy_gemma3_270m.json"), ("smollm2-135m", "greedy_smollm2_135m.json")] {
        let tok = model::tokenizer::Tokenizer::from_gguf(&Gguf::open(&fetched(name)).unwrap()).unwrap();
        let reference: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(format!("{dir}/{greedy}")).unwrap()).unwrap();
        for case in reference["cases"].as_array().unwrap() {
            let prompt = prompts.as_array().unwrap().iter().find(|p| p["name"] == case["name"]).unwrap();
            let want: Vec<u32> =
                case["prompt_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
            let got = tok.encode(prompt["text"].as_str().unwrap(), tok.add_bos());
            assert_eq!(got, want, "{name} {}", case["name"]);
        }
    }
}

/// Exact precision reproduces transformers' fp32 greedy continuations of both real models on the short
/// reference prompts, up to the first near-tie, with no paged cache in between. The long ones (past
/// Gemma's 512-token window) run through the whole host in `host/tests/generate.rs`.
#[test]
fn exact_greedy_matches_transformers_on_both_real_models() {
    use model::forward::{argmax, NoPast, VecKv};
    let dir = format!("{}/../fixtures/reference", env!("CARGO_MANIFEST_DIR"));
    for (name, greedy) in [("gemma3-270m", "greedy_gemma3_270m.json"), ("smollm2-135m", "greedy_smollm2_135m.json")] {
        let model = model::arch::Model::from_gguf(&Gguf::open(&fetched(name)).unwrap()).unwrap();
        let reference: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(format!("{dir}/{greedy}")).unwrap()).unwrap();
        for case in
            reference["cases"].as_array().unwrap().iter().filter(|c| c["prompt_ids"].as_array().unwrap().len() < 512)
        {
            let ids = |v: &serde_json::Value| -> Vec<u32> {
                v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
            };
            let (prompt, want) = (ids(&case["prompt_ids"]), ids(&case["output_ids"]));
            let margins: Vec<f64> = case["margins"].as_array().unwrap().iter().map(|m| m.as_f64().unwrap()).collect();
            let stop = margins.iter().position(|&m| m < 0.01).unwrap_or(want.len());
            let mut kv = VecKv::default();
            let out = model.forward(&prompt, 0, &NoPast, false);
            kv.append(&out.kv);
            let mut got = vec![argmax(&out.logits)];
            while got.len() < stop {
                let pos = (prompt.len() + got.len() - 1) as u64;
                let out = model.forward(&[*got.last().unwrap()], pos, &kv, false);
                kv.append(&out.kv);
                got.push(argmax(&out.logits));
            }
            assert_eq!(
                &got[..stop],
                &want[..stop],
                "{name} {}: ids up to the first near-tie (step {stop})",
                case["name"]
            );
        }
    }
}
