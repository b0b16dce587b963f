//! Arbitrary conversations through both shipped models' chat templates (SmolLM2's from its GGUF, Gemma
//! 3's built-in one), as `/v1/chat/completions` renders them: any roles and contents give a prompt or a
//! typed error (the template's own `raise_exception`, or the engine's fuel), never a panic.
#![no_main]

use std::sync::OnceLock;

use model::chat::{ChatTemplate, Message, GEMMA3_TEMPLATE};

/// SmolLM2-135M-Instruct's template, as its GGUF carries it (fixtures/chat/chat_templates.json).
const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

fn templates() -> &'static [ChatTemplate; 2] {
    static T: OnceLock<[ChatTemplate; 2]> = OnceLock::new();
    T.get_or_init(|| {
        [
            ChatTemplate::from_source(SMOLLM2_TEMPLATE, Some("<|im_start|>"), Some("<|im_end|>")).expect("SmolLM2"),
            ChatTemplate::from_source(GEMMA3_TEMPLATE, Some("<bos>"), Some("<eos>")).expect("Gemma 3"),
        ]
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    // Messages separated by 0xFF bytes; each is `role 0xFE content`. The first byte picks the flag.
    let Some((&flags, rest)) = data.split_first() else { return };
    let messages: Vec<Message> = rest
        .split(|&b| b == 0xFF)
        .map(|m| {
            let (role, content) = match m.iter().position(|&b| b == 0xFE) {
                Some(i) => (&m[..i], &m[i + 1..]),
                None => (&b"user"[..], m),
            };
            Message::new(String::from_utf8_lossy(role), String::from_utf8_lossy(content))
        })
        .collect();
    for t in templates() {
        let _ = t.render(&messages, flags & 1 == 1);
    }
});
