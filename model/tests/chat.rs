//! Chat templates of the two real models against Hugging Face transformers' `apply_chat_template`
//! (`fixtures/chat/chat_templates.json`, made by `fixtures/chat/make_fixture.py`). The models are fetched through
//! pdhost's own cache, never skipped.

use std::path::{Path, PathBuf};

use model::chat::{self, ChatError, ChatTemplate, Message, TemplateSource, Turn};
use model::gguf::Gguf;
use model::registry;
use model::tokenizer::Tokenizer;
use serde_json::Value;

fn fetched(name: &str) -> PathBuf {
    registry::fetch(name, &mut registry::Quiet).unwrap_or_else(|e| panic!("fetching {name}: {e}"))
}

fn fixture() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/chat/chat_templates.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn model_fixture(name: &str) -> Value {
    let fixture = fixture();
    let models = fixture["models"].as_array().unwrap();
    models.iter().find(|m| m["model"] == name).unwrap_or_else(|| panic!("{name} is not in the fixture")).clone()
}

fn messages(case: &Value) -> Vec<Message> {
    case["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect()
}

/// Every fixture case of `name` renders to transformers' text and encodes to its ids (or is refused with the
/// template's own message where transformers' Jinja raised).
fn check_model(name: &str, source: TemplateSource) {
    let fixture = model_fixture(name);
    let gguf = Gguf::open(&fetched(name)).unwrap();
    let template = ChatTemplate::from_gguf(&gguf).unwrap();
    let tok = Tokenizer::from_gguf(&gguf).unwrap();
    assert_eq!(template.source(), source, "{name}");
    assert_eq!(template.text(), fixture["chat_template"].as_str().unwrap(), "{name}: template text");
    assert_eq!(template.bos_token(), fixture["bos_token"].as_str(), "{name}: bos_token");
    assert_eq!(template.eos_token(), fixture["eos_token"].as_str(), "{name}: eos_token");
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 10, "{name}: {} cases", cases.len());
    for case in cases {
        let what = format!("{name} case {}", case["name"]);
        let messages = messages(case);
        let add_generation_prompt = case["add_generation_prompt"].as_bool().unwrap();
        let turn = if add_generation_prompt { Turn::Open } else { Turn::Closed };
        if let Some(want) = case["error"].as_str() {
            for err in [
                template.render(&messages, add_generation_prompt).unwrap_err(),
                template.encode(&tok, &messages, turn).unwrap_err(),
            ] {
                assert!(matches!(&err, ChatError::Raised { message } if message == want), "{what}: {err:?}");
            }
            continue;
        }
        let text = template.render(&messages, add_generation_prompt).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(text, case["text"].as_str().unwrap(), "{what}: text");
        let ids = template.encode(&tok, &messages, turn).unwrap();
        let want: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(ids, want, "{what}: ids");
    }
}

#[test]
fn smollm2_renders_its_metadata_template_as_transformers_does() {
    check_model("smollm2-135m", TemplateSource::Metadata);
}

#[test]
fn gemma3_renders_the_builtin_template_as_transformers_does() {
    check_model("gemma3-270m", TemplateSource::Builtin("gemma3"));
    // The GGUF starts the prompt with BOS by itself; the ids hold it exactly once.
    let gguf = Gguf::open(&fetched("gemma3-270m")).unwrap();
    let tok = Tokenizer::from_gguf(&gguf).unwrap();
    let ids = ChatTemplate::from_gguf(&gguf).unwrap().encode(&tok, &[Message::new("user", "Hi")], Turn::Open).unwrap();
    assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 1, "{ids:?}");
    assert_eq!(ids[0], 2);
}

#[test]
fn the_builtin_gemma3_template_is_the_one_the_fixture_was_made_with() {
    assert_eq!(chat::GEMMA3_TEMPLATE, model_fixture("gemma3-270m")["chat_template"].as_str().unwrap());
    assert_eq!(chat::builtin("gemma3"), Some(chat::GEMMA3_TEMPLATE));
}

/// A GGUF file holding only `metadata` (string values or u32s), in a fresh temporary directory.
fn tiny_gguf(dir: &Path, name: &str, metadata: &[(&str, Result<&str, u32>)]) -> PathBuf {
    let mut bytes = b"GGUF".to_vec();
    bytes.extend(3u32.to_le_bytes());
    bytes.extend(0u64.to_le_bytes());
    bytes.extend((metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        bytes.extend((key.len() as u64).to_le_bytes());
        bytes.extend(key.as_bytes());
        match value {
            Ok(s) => {
                bytes.extend(8u32.to_le_bytes());
                bytes.extend((s.len() as u64).to_le_bytes());
                bytes.extend(s.as_bytes());
            }
            Err(n) => {
                bytes.extend(4u32.to_le_bytes());
                bytes.extend(n.to_le_bytes());
            }
        }
    }
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn a_file_with_no_template_and_an_unknown_architecture_gets_an_error_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_gguf(dir.path(), "mamba.gguf", &[("general.architecture", Ok("mamba"))]);
    let err = ChatTemplate::from_gguf(&Gguf::open(&path).unwrap()).unwrap_err();
    assert!(matches!(&err, ChatError::NoTemplate { architecture, .. } if architecture == "mamba"), "{err:?}");
    let message = err.to_string();
    assert!(
        message.ends_with(
            "expected a chat template, in tokenizer.chat_template or built in for the architecture (gemma3), \
             found neither (general.architecture \"mamba\")"
        ),
        "{message}"
    );
}

#[test]
fn metadata_templates_win_and_their_faults_are_typed() {
    let dir = tempfile::tempdir().unwrap();
    let own = tiny_gguf(
        dir.path(),
        "own.gguf",
        &[("general.architecture", Ok("gemma3")), ("tokenizer.chat_template", Ok("{{ messages[0].content }}!"))],
    );
    let t = ChatTemplate::from_gguf(&Gguf::open(&own).unwrap()).unwrap();
    assert_eq!(t.source(), TemplateSource::Metadata);
    assert_eq!(t.bos_token(), None);
    assert_eq!(t.render(&[Message::new("user", "hi")], true).unwrap(), "hi!");

    let broken = tiny_gguf(
        dir.path(),
        "broken.gguf",
        &[("general.architecture", Ok("llama")), ("tokenizer.chat_template", Ok("{% for m in messages %}"))],
    );
    let err = ChatTemplate::from_gguf(&Gguf::open(&broken).unwrap()).unwrap_err();
    assert!(matches!(err, ChatError::Syntax { template: TemplateSource::Metadata, .. }), "{err:?}");
    assert!(err.to_string().starts_with("chat template (the GGUF's tokenizer.chat_template): syntax error:"), "{err}");

    let number = tiny_gguf(
        dir.path(),
        "number.gguf",
        &[("general.architecture", Ok("llama")), ("tokenizer.chat_template", Err(7))],
    );
    let err = ChatTemplate::from_gguf(&Gguf::open(&number).unwrap()).unwrap_err();
    assert!(err.to_string().contains("tokenizer.chat_template: expected a string, found"), "{err}");
}
