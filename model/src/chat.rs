//! Chat templates: a conversation rendered to a prompt by the model's own Jinja template, as Hugging Face
//! transformers' `apply_chat_template` renders it.
//!
//! The template is the GGUF's `tokenizer.chat_template`, or, where the file carries none, the official template
//! of its architecture (llama.cpp and llama-server do the same; see [`builtin`]). It is rendered by `minijinja`,
//! configured as transformers configures Jinja2: `trim_blocks` and `lstrip_blocks`, loop controls, the variables
//! `messages`, `add_generation_prompt`, `bos_token` and `eos_token`, a `raise_exception(msg)` function, Python's
//! whitespace for the `trim` filter and `.strip()`, and Python's string and dict methods through
//! `minijinja-contrib`'s `pycompat`. transformers then encodes the text with `add_special_tokens=False`: the
//! template writes every special token itself (Gemma's begins with `{{ bos_token }}`), so [`ChatTemplate::encode`]
//! never adds BOS.
//!
//! Messages come from strangers, so what they can ask of a render is bounded: at most [`MAX_MESSAGES`] messages and
//! [`MAX_TEXT_BYTES`] bytes of message text in, at most [`MAX_TEXT_BYTES`] bytes rendered out, and at most
//! [`MAX_STEPS`] template instructions per render. Every refusal is a [`ChatError`] whose message is one line.
//! The template itself is the model file's code, run as transformers, vLLM and llama.cpp run it: the steps bound
//! its time, but not the memory of a string it builds inside the render (one that doubles a string forty times
//! in forty steps exhausts memory); a model file is trusted as far as its template.
//!
//! Not provided (neither shipped template uses them): tools, documents and content parts (a message's content is
//! one string), `tojson`, `strftime_now`, transformers' `{% generation %}` tag, and `sanitize_control_tokens`
//! (transformers' default leaves it off too: text in a message that spells a control token, like
//! `<end_of_turn>`, is encoded as that token).

use std::borrow::Cow;
use std::fmt;
use std::io;
use std::path::PathBuf;

use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind, State};

use crate::gguf::{Gguf, GgufError, Value as GgufValue};
use crate::tokenizer::Tokenizer;

/// The most messages one render takes.
pub const MAX_MESSAGES: usize = 4096;
/// The most bytes of message text (roles and contents) one render takes, and the most bytes it writes: the
/// bound `generate` puts on a prompt file.
pub const MAX_TEXT_BYTES: usize = 8 << 20;
/// The most bytes a template may have (the longest Hugging Face chat templates are a few tens of KiB).
pub const MAX_TEMPLATE_BYTES: usize = 1 << 20;
/// The most template instructions one render may run (about a third of a second). Gemma's template runs about 50
/// per message, so [`MAX_MESSAGES`] of them take about 200 000; this stops a template that loops over the messages
/// inside a loop over the messages.
pub const MAX_STEPS: u64 = 10_000_000;

/// The name the template has inside its environment (it shows in error messages: `(in chat_template:3)`).
const NAME: &str = "chat_template";

/// Gemma 3's chat template: the `chat_template` of the tokenizer_config.json of Google's Gemma 3
/// instruction-tuned checkpoints (`google/gemma-3-270m-it` and its larger siblings), copied exactly (1532 bytes,
/// sha256 `7de1c58e…8dd3c4`). Quoted from that file in ShishirPatil/gorilla
/// (`berkeley-function-call-leaderboard/bfcl_eval/model_handler/local_inference/gemma.py`) and checked byte for
/// byte against the template llama.cpp's converter wrote into `gemma-3-270m-it.gguf` (dumped in danbev/learning-ai's
/// notes on the Gemma 3 270M BOS issue). `fixtures/chat/make_fixture.py` holds the same text; the chat test checks
/// this constant against it.
///
/// A system message is folded into the first user turn (its content, untrimmed, then a blank line); roles must
/// alternate user/assistant after it; the assistant's role is written `model`; contents are trimmed.
pub const GEMMA3_TEMPLATE: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '

' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '

' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '
' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>
' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model
'}}
{%- endif -%}
"#;

/// The built-in templates, by GGUF `general.architecture`.
const BUILTIN: &[(&str, &str)] = &[("gemma3", GEMMA3_TEMPLATE)];

/// The built-in template for a GGUF architecture, for files that carry none in their metadata.
pub fn builtin(architecture: &str) -> Option<&'static str> {
    BUILTIN.iter().find(|(arch, _)| *arch == architecture).map(|(_, text)| *text)
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user` or `assistant` (the template decides what it accepts).
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A message.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message { role: role.into(), content: content.into() }
    }
}

/// Where a chat template came from (what `/v1/models` reports).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TemplateSource {
    /// The GGUF's `tokenizer.chat_template`.
    Metadata,
    /// pdhost's built-in template for this architecture (see [`builtin`]).
    Builtin(&'static str),
    /// Given by the caller ([`ChatTemplate::from_source`]).
    Supplied,
}

impl TemplateSource {
    /// A short, stable name: `metadata`, `builtin:gemma3` or `supplied`.
    pub fn name(&self) -> Cow<'static, str> {
        match self {
            TemplateSource::Metadata => "metadata".into(),
            TemplateSource::Builtin(arch) => format!("builtin:{arch}").into(),
            TemplateSource::Supplied => "supplied".into(),
        }
    }
}

impl fmt::Display for TemplateSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TemplateSource::Metadata => f.write_str("the GGUF's tokenizer.chat_template"),
            TemplateSource::Builtin(arch) => write!(f, "pdhost's built-in {arch} template"),
            TemplateSource::Supplied => f.write_str("the supplied template"),
        }
    }
}

/// Why a conversation cannot be rendered, or a template cannot be used. Every message is one line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChatError {
    /// The GGUF metadata the template needs is malformed.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// The file has no template in its metadata and pdhost has none for its architecture.
    #[error(
        "{path}: expected a chat template, in tokenizer.chat_template or built in for the architecture ({}), \
         found neither (general.architecture {architecture:?})",
        BUILTIN.iter().map(|(arch, _)| *arch).collect::<Vec<_>>().join(", ")
    )]
    NoTemplate {
        /// The file.
        path: PathBuf,
        /// Its `general.architecture`.
        architecture: String,
    },
    /// The template is longer than [`MAX_TEMPLATE_BYTES`].
    #[error("chat template ({template}): expected at most {limit} bytes, found {found}")]
    TemplateTooLarge {
        /// Where it came from.
        template: TemplateSource,
        /// The bound.
        limit: usize,
        /// Its length.
        found: usize,
    },
    /// The template does not compile.
    #[error("chat template ({template}): {detail}")]
    Syntax {
        /// Where it came from.
        template: TemplateSource,
        /// minijinja's message: what is wrong, and the line (`... (in chat_template:3)`).
        detail: String,
    },
    /// [`Turn::Continued`] with a last message that has no text, or whose text the template does not
    /// keep.
    #[error("messages: expected a last message whose text the chat template keeps, to continue it, found none")]
    NotContinuable,
    /// No messages, or more than [`MAX_MESSAGES`].
    #[error("messages: expected 1 to {limit} messages, found {found}")]
    MessageCount {
        /// The bound.
        limit: usize,
        /// How many were given.
        found: usize,
    },
    /// More than [`MAX_TEXT_BYTES`] of message text.
    #[error("messages: expected at most {limit} bytes of roles and contents, found {found}")]
    TooMuchText {
        /// The bound.
        limit: usize,
        /// How many were given.
        found: usize,
    },
    /// The rendered prompt would be longer than [`MAX_TEXT_BYTES`].
    #[error("chat template: expected a prompt of at most {limit} bytes, found a longer one")]
    PromptTooLong {
        /// The bound.
        limit: usize,
    },
    /// The render ran more than [`MAX_STEPS`] template instructions.
    #[error("chat template: expected to render in at most {limit} steps, found it needs more")]
    TooMuchWork {
        /// The bound.
        limit: u64,
    },
    /// The template called `raise_exception(message)`: it refuses these messages (Gemma's, when roles do not
    /// alternate).
    #[error("chat template refused the messages: {message}")]
    Raised {
        /// The template's message (on one line).
        message: String,
    },
    /// Rendering failed another way (an undefined value used wrongly, a type error).
    #[error("chat template ({template}): {detail}")]
    Render {
        /// Where it came from.
        template: TemplateSource,
        /// minijinja's message (on one line).
        detail: String,
    },
}

/// A compiled chat template and the special tokens it is given.
pub struct ChatTemplate {
    env: Environment<'static>,
    text: String,
    source: TemplateSource,
    bos: Option<String>,
    eos: Option<String>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// The template a GGUF file calls for: its `tokenizer.chat_template`, else the built-in one for its
    /// `general.architecture`. `bos_token` and `eos_token` are the texts of `tokenizer.ggml.bos_token_id` and
    /// `eos_token_id`.
    pub fn from_gguf(g: &Gguf) -> Result<Self, ChatError> {
        let (text, source) = match g.get("tokenizer.chat_template") {
            Ok(GgufValue::Str(text)) => (text.as_str(), TemplateSource::Metadata),
            Ok(other) => {
                return Err(GgufError::Invalid {
                    path: g.path().into(),
                    what: "tokenizer.chat_template".into(),
                    expected: "a string".into(),
                    found: other.describe(),
                }
                .into())
            }
            Err(_) => {
                let architecture = g.get_str("general.architecture")?;
                let (arch, text) = BUILTIN.iter().find(|(arch, _)| *arch == architecture).ok_or_else(|| {
                    ChatError::NoTemplate { path: g.path().into(), architecture: architecture.into() }
                })?;
                (*text, TemplateSource::Builtin(arch))
            }
        };
        let bos = token_text(g, "tokenizer.ggml.bos_token_id")?;
        let eos = token_text(g, "tokenizer.ggml.eos_token_id")?;
        Self::build(text, source, bos, eos)
    }

    /// A template given as text (tests, or a template file a user names), with the texts of the BOS and EOS
    /// tokens (`None`: the variable is undefined, which renders as nothing).
    pub fn from_source(text: &str, bos: Option<&str>, eos: Option<&str>) -> Result<Self, ChatError> {
        Self::build(text, TemplateSource::Supplied, bos.map(str::to_owned), eos.map(str::to_owned))
    }

    fn build(text: &str, source: TemplateSource, bos: Option<String>, eos: Option<String>) -> Result<Self, ChatError> {
        if text.len() > MAX_TEMPLATE_BYTES {
            return Err(ChatError::TemplateTooLarge { template: source, limit: MAX_TEMPLATE_BYTES, found: text.len() });
        }
        let mut env = Environment::new();
        // As transformers' `_compile_jinja_template`: an ImmutableSandboxedEnvironment with trim_blocks,
        // lstrip_blocks and the loopcontrols extension (minijinja's `loop_controls` feature), Jinja2's lenient
        // undefined values, and no trailing newline kept.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(MAX_STEPS));
        env.add_function("raise_exception", raise_exception);
        env.add_filter("trim", py_trim);
        env.set_unknown_method_callback(py_methods);
        env.add_template_owned(NAME, text.to_owned())
            .map_err(|e| ChatError::Syntax { template: source, detail: one_line(&e.to_string()) })?;
        Ok(ChatTemplate { env, text: text.to_owned(), source, bos, eos })
    }

    /// Where the template came from.
    pub fn source(&self) -> TemplateSource {
        self.source
    }

    /// The template's text.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The text given as `bos_token`.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos.as_deref()
    }

    /// The text given as `eos_token`.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos.as_deref()
    }

    /// Renders `messages`; with `add_generation_prompt`, the text ends with the header of the assistant's turn.
    /// Equal to transformers' `apply_chat_template(messages, add_generation_prompt=..., tokenize=False)`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String, ChatError> {
        if messages.is_empty() || messages.len() > MAX_MESSAGES {
            return Err(ChatError::MessageCount { limit: MAX_MESSAGES, found: messages.len() });
        }
        let text_bytes =
            messages.iter().fold(0usize, |n, m| n.saturating_add(m.role.len()).saturating_add(m.content.len()));
        if text_bytes > MAX_TEXT_BYTES {
            return Err(ChatError::TooMuchText { limit: MAX_TEXT_BYTES, found: text_bytes });
        }
        let messages: Value = messages
            .iter()
            .map(|m| {
                Value::from_iter([("role", Value::from(m.role.as_str())), ("content", Value::from(m.content.as_str()))])
            })
            .collect();
        let mut context = vec![("messages", messages), ("add_generation_prompt", Value::from(add_generation_prompt))];
        context.extend(self.bos.as_deref().map(|t| ("bos_token", Value::from(t))));
        context.extend(self.eos.as_deref().map(|t| ("eos_token", Value::from(t))));
        let context = Value::from_iter(context);

        let render_error =
            |detail: &Error| ChatError::Render { template: self.source, detail: one_line(&detail.to_string()) };
        let template = self.env.get_template(NAME).map_err(|e| render_error(&e))?;
        let mut out = Bounded { text: Vec::new(), limit: MAX_TEXT_BYTES, overflowed: false };
        match template.render_captured_to(context, &mut out) {
            Ok(_) => String::from_utf8(out.text).map_err(|e| ChatError::Render {
                template: self.source,
                detail: format!("expected UTF-8 output, found {e}"),
            }),
            Err(_) if out.overflowed => Err(ChatError::PromptTooLong { limit: MAX_TEXT_BYTES }),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(ChatError::TooMuchWork { limit: MAX_STEPS }),
            Err(e) => match raised(&e) {
                Some(message) => Err(ChatError::Raised { message: one_line(message) }),
                None => Err(render_error(&e)),
            },
        }
    }

    /// Renders `messages` to end as `turn` says: transformers' `apply_chat_template` with
    /// `add_generation_prompt` ([`Turn::Open`]) or without ([`Turn::Closed`]), or with
    /// `continue_final_message` ([`Turn::Continued`]: the text cut after the last message's content, as
    /// transformers cuts it, so that a reply continues that message).
    pub fn render_turn(&self, messages: &[Message], turn: Turn) -> Result<String, ChatError> {
        match turn {
            Turn::Open => self.render(messages, true),
            Turn::Closed => self.render(messages, false),
            Turn::Continued => {
                let text = self.render(messages, false)?;
                // Templates may trim a message (Gemma's does): its trimmed text is what is looked for.
                let last = messages.last().map_or("", |m| m.content.trim());
                match text.rfind(last) {
                    Some(at) if !last.is_empty() => Ok(text[..at + last.len()].to_string()),
                    _ => Err(ChatError::NotContinuable),
                }
            }
        }
    }

    /// Renders `messages` to end as `turn` says ([`ChatTemplate::render_turn`]) and encodes the text, as
    /// transformers' `apply_chat_template(messages, ..., tokenize=True)` does: with
    /// `add_special_tokens=False`, so no BOS is added (a template that wants BOS writes `{{ bos_token }}`, and the
    /// tokenizer turns that text into the BOS id).
    pub fn encode(&self, tok: &Tokenizer, messages: &[Message], turn: Turn) -> Result<Vec<u32>, ChatError> {
        let text = self.render_turn(messages, turn)?;
        Ok(tok.encode(&text, false))
    }
}

/// How a rendered conversation ends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Turn {
    /// With the assistant's turn opened after the last message (`add_generation_prompt`): a chat
    /// completion's prompt.
    #[default]
    Open,
    /// With the last message's turn closed.
    Closed,
    /// Inside the last message, its turn left open for the reply to continue it (vLLM's
    /// `continue_final_message`).
    Continued,
}

/// The text of the token whose id is at `key`; `None` when the file has no such key.
fn token_text(g: &Gguf, key: &str) -> Result<Option<String>, GgufError> {
    let Ok(id) = g.get_u64(key) else { return Ok(None) };
    let tokens = g.get_strings("tokenizer.ggml.tokens")?;
    match usize::try_from(id).ok().and_then(|i| tokens.get(i)) {
        Some(text) => Ok(Some(text.to_owned())),
        None => Err(GgufError::Invalid {
            path: g.path().into(),
            what: key.into(),
            expected: format!("a token id below {}", tokens.len()),
            found: id.to_string(),
        }),
    }
}

/// What `raise_exception` attaches to the error it returns, so that [`ChatTemplate::render`] can tell a template's
/// refusal from its other failures.
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// `raise_exception(message)`: transformers raises a `TemplateError` with `message`.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

/// The message of the `raise_exception` call behind `e`, if there is one.
fn raised(e: &Error) -> Option<&str> {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if let Some(Raised(message)) = c.downcast_ref::<Raised>() {
            return Some(message);
        }
        cause = c.source();
    }
    None
}

/// Whitespace as Python's `str.strip()` sees it: Rust's `char::is_whitespace` plus the four information separators
/// U+001C to U+001F.
fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Jinja2's `trim` filter (`str(value).strip(chars)`), with Python's whitespace; minijinja's own trims Rust's.
fn py_trim(value: &Value, chars: Option<String>) -> String {
    let text = value.as_str().map(Cow::Borrowed).unwrap_or_else(|| Cow::Owned(value.to_string()));
    match chars {
        Some(chars) => text.trim_matches(|c| chars.contains(c)).to_owned(),
        None => text.trim_matches(is_py_space).to_owned(),
    }
}

/// Python's methods on values (`.strip()`, `.startswith()`, `.items()`, ...) through minijinja-contrib's `pycompat`,
/// except that `strip`, `lstrip` and `rstrip` without arguments use Python's whitespace.
fn py_methods(state: &State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if let (Some(text), true) = (value.as_str(), args.is_empty()) {
        match method {
            "strip" => return Ok(Value::from(text.trim_matches(is_py_space))),
            "lstrip" => return Ok(Value::from(text.trim_start_matches(is_py_space))),
            "rstrip" => return Ok(Value::from(text.trim_end_matches(is_py_space))),
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// `text` on one line: line breaks and other control characters become spaces.
fn one_line(text: &str) -> String {
    text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect()
}

/// Collects rendered output and refuses to grow past `limit`.
struct Bounded {
    text: Vec<u8>,
    limit: usize,
    overflowed: bool,
}

impl io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.text.len().saturating_add(buf.len()) > self.limit {
            self.overflowed = true;
            return Err(io::Error::other("the rendered prompt is over the limit"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(content: &str) -> Message {
        Message::new("user", content)
    }

    fn supplied(text: &str) -> ChatTemplate {
        ChatTemplate::from_source(text, Some("<s>"), Some("</s>")).unwrap()
    }

    fn alternating(n: usize) -> Vec<Message> {
        (0..n).map(|i| Message::new(if i % 2 == 0 { "user" } else { "assistant" }, format!("turn {i}"))).collect()
    }

    #[test]
    fn raise_exception_is_a_typed_error_on_one_line() {
        let t = supplied("{% if messages[0].role != 'user' %}{{ raise_exception('only users\nfirst') }}{% endif %}ok");
        assert_eq!(t.render(&[user("hi")], false).unwrap(), "ok");
        let err = t.render(&[Message::new("system", "hi")], false).unwrap_err();
        let ChatError::Raised { message } = &err else { panic!("{err:?}") };
        assert_eq!(message, "only users first");
        assert_eq!(err.to_string(), "chat template refused the messages: only users first");
    }

    #[test]
    fn gemma_refuses_roles_that_do_not_alternate() {
        let t = ChatTemplate::from_source(GEMMA3_TEMPLATE, Some("<bos>"), Some("<eos>")).unwrap();
        let err = t.render(&[user("one"), user("two")], true).unwrap_err();
        assert!(
            matches!(&err, ChatError::Raised { message }
                if message == "Conversation roles must alternate user/assistant/user/assistant/..."),
            "{err:?}"
        );
    }

    /// `continue_final_message`: the prompt ends inside the last message, as transformers cuts it (after
    /// its trimmed text: Gemma's template trims it), never with its end of turn.
    #[test]
    fn a_continued_turn_ends_inside_the_last_message() {
        let t = ChatTemplate::from_source(GEMMA3_TEMPLATE, Some("<bos>"), Some("<eos>")).unwrap();
        let chat = [user("Write a haiku"), Message::new("assistant", "Autumn moon  ")];
        let text = t.render_turn(&chat, Turn::Continued).unwrap();
        assert_eq!(text, "<bos><start_of_turn>user\nWrite a haiku<end_of_turn>\n<start_of_turn>model\nAutumn moon");
        assert_eq!(t.render_turn(&chat, Turn::Closed).unwrap(), format!("{text}<end_of_turn>\n"));
        assert_eq!(t.render_turn(&chat[..1], Turn::Open).unwrap(), t.render(&chat[..1], true).unwrap());
        let empty = [user("Write a haiku"), Message::new("assistant", " ")];
        assert!(matches!(t.render_turn(&empty, Turn::Continued), Err(ChatError::NotContinuable)));
    }

    #[test]
    fn a_syntax_error_is_a_typed_error_naming_the_problem_and_line() {
        for (text, want) in [
            ("{{ bos_token }}\n{% for m in messages %}{{ m.content }}", "unexpected end of input"),
            ("{{ bos_token }}\n\n{{ messages[0].content }", "(in chat_template:3)"),
            ("{% if %}{% endif %}", "syntax error"),
        ] {
            let err = ChatTemplate::from_source(text, None, None).unwrap_err();
            let ChatError::Syntax { template: TemplateSource::Supplied, .. } = &err else { panic!("{err:?}") };
            let message = err.to_string();
            assert!(message.starts_with("chat template (the supplied template): syntax error: "), "{message}");
            assert!(message.contains(want), "{message}");
            assert!(!message.contains('\n'), "{message}");
        }
    }

    #[test]
    fn other_render_failures_are_typed_and_one_line() {
        let t = supplied("{{ messages[0].nothing.deeper }}");
        let err = t.render(&[user("hi")], false).unwrap_err();
        assert!(matches!(err, ChatError::Render { template: TemplateSource::Supplied, .. }), "{err:?}");
        assert!(!err.to_string().contains('\n'));
    }

    #[test]
    fn message_counts_outside_the_bounds_are_refused() {
        let t = supplied("{% for m in messages %}{{ m.content }}{% endfor %}");
        for n in [0, MAX_MESSAGES + 1] {
            let err = t.render(&vec![user("x"); n], false).unwrap_err();
            assert!(matches!(err, ChatError::MessageCount { limit: MAX_MESSAGES, found } if found == n), "{err:?}");
            assert_eq!(err.to_string(), format!("messages: expected 1 to 4096 messages, found {n}"));
        }
        assert_eq!(t.render(&vec![user("x"); MAX_MESSAGES], false).unwrap().len(), MAX_MESSAGES);
    }

    #[test]
    fn too_much_text_in_is_refused_before_rendering() {
        let t = supplied("{{ raise_exception('must not run') }}");
        let big = "x".repeat(MAX_TEXT_BYTES);
        let err = t.render(&[user(&big)], false).unwrap_err();
        assert!(
            matches!(err, ChatError::TooMuchText { limit: MAX_TEXT_BYTES, found } if found == MAX_TEXT_BYTES + 4),
            "{err:?}"
        );
    }

    #[test]
    fn a_prompt_that_would_grow_past_the_bound_is_refused() {
        let t = supplied("{% for i in range(100) %}{{ messages[0].content }}{% endfor %}");
        let err = t.render(&[user(&"y".repeat(100_000))], false).unwrap_err();
        assert!(matches!(err, ChatError::PromptTooLong { limit: MAX_TEXT_BYTES }), "{err:?}");
        assert_eq!(t.render(&[user("ab")], false).unwrap().len(), 200);
    }

    #[test]
    fn a_template_that_runs_too_long_is_stopped() {
        let t = supplied("{% for a in messages %}{% for b in messages %}{{ '' }}{% endfor %}{% endfor %}");
        let err = t.render(&vec![user("x"); MAX_MESSAGES], false).unwrap_err();
        assert!(matches!(err, ChatError::TooMuchWork { limit: MAX_STEPS }), "{err:?}");
    }

    #[test]
    fn gemma_renders_the_most_messages_well_inside_the_step_bound() {
        let t = ChatTemplate::from_source(GEMMA3_TEMPLATE, Some("<bos>"), Some("<eos>")).unwrap();
        let text = t.render(&alternating(MAX_MESSAGES), true).unwrap();
        assert!(text.starts_with("<bos><start_of_turn>user\nturn 0<end_of_turn>\n<start_of_turn>model\nturn 1"));
        assert!(text.ends_with("turn 4095<end_of_turn>\n<start_of_turn>model\n"));
    }

    #[test]
    fn the_variables_are_those_transformers_gives() {
        let t = supplied(concat!(
            "{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ messages | length }}|",
            "{{ messages[1]['role'] }}:{{ messages[1].content }}",
        ));
        assert_eq!(
            t.render(&[user("a"), Message::new("assistant", "b")], true).unwrap(),
            "<s>|</s>|True|2|assistant:b"
        );
        let bare =
            ChatTemplate::from_source("[{{ bos_token }}]{% if eos_token is defined %}eos{% endif %}", None, None)
                .unwrap();
        assert_eq!(bare.render(&[user("a")], false).unwrap(), "[]");
    }

    #[test]
    fn blocks_are_trimmed_as_transformers_trims_them() {
        let t =
            supplied("{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}\n");
        assert_eq!(t.render(&[user("a"), user("b")], false).unwrap(), "a\nb\n");
    }

    #[test]
    fn trim_and_strip_use_pythons_whitespace() {
        let t = supplied(
            "[{{ messages[0].content | trim }}][{{ messages[0].content.strip() }}][{{ messages[0].content.rstrip() }}]",
        );
        assert_eq!(t.render(&[user("\u{1f} \ta\u{3000}\n")], false).unwrap(), "[a][a][\u{1f} \ta]");
        let t = supplied("{{ messages[0].content | trim('xy') }}");
        assert_eq!(t.render(&[user("xyaxy")], false).unwrap(), "a");
    }

    #[test]
    fn python_string_methods_work() {
        let t = supplied(concat!(
            "{% if messages[0].content.startswith('/') %}{{ messages[0].content[1:].upper() }}{% endif %}",
            "{{ messages[0].content.split('/') | length }}",
        ));
        assert_eq!(t.render(&[user("/cmd")], false).unwrap(), "CMD2");
    }

    #[test]
    fn builtins_and_source_names() {
        assert_eq!(builtin("gemma3"), Some(GEMMA3_TEMPLATE));
        assert_eq!(builtin("llama"), None);
        assert_eq!(TemplateSource::Metadata.name(), "metadata");
        assert_eq!(TemplateSource::Builtin("gemma3").name(), "builtin:gemma3");
        assert_eq!(TemplateSource::Builtin("gemma3").to_string(), "pdhost's built-in gemma3 template");
        let t = supplied("x");
        assert_eq!(
            (t.source(), t.text(), t.bos_token(), t.eos_token()),
            (TemplateSource::Supplied, "x", Some("<s>"), Some("</s>"))
        );
    }

    #[test]
    fn an_oversized_template_is_refused() {
        let err = ChatTemplate::from_source(&" ".repeat(MAX_TEMPLATE_BYTES + 1), None, None).unwrap_err();
        assert!(matches!(err, ChatError::TemplateTooLarge { found, .. } if found == MAX_TEMPLATE_BYTES + 1), "{err:?}");
    }
}
