//! The OpenAI-compatible request bodies, read field by field so that every refusal names the field,
//! what was expected and what was found, and the error objects sent back.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use crate::request::{self, Field, Invalid, RawRequest, SamplingParams};

/// An error as OpenAI's API returns it: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// One line: what was expected and what was found.
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `server_error`, ...
    pub kind: &'static str,
    /// The body field at fault.
    pub param: Option<&'static str>,
    /// A stable code (`model_not_found`, `queue_full`, ...).
    pub code: Option<&'static str>,
    /// Seconds after which a retry may succeed.
    pub retry_after: Option<u32>,
    /// Whether the connection closes after the answer (`Connection: close`): a body refused unread.
    pub close: bool,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn invalid(param: &'static str, expected: impl std::fmt::Display, found: impl std::fmt::Display) -> Self {
        let found = request::shorten(&found.to_string());
        ApiError::bad_request(param, format!("{param}: expected {expected}, found {found}"))
    }

    /// A 400 about `messages` that the chat template refused. The template's own words (Gemma's
    /// "Conversation roles must alternate ...") are the answer, so more of them are kept than of a
    /// quoted input.
    pub fn refused_messages(e: &model::chat::ChatError) -> Self {
        let found = request::shorten_to(&e.to_string(), 240);
        ApiError::bad_request(
            "messages",
            format!("messages: expected messages the model's chat template accepts, found {found}"),
        )
    }

    /// A 400 about `param` with this message.
    pub fn bad_request(param: &'static str, message: String) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message,
            kind: "invalid_request_error",
            param: Some(param),
            code: None,
            retry_after: None,
            close: false,
        }
    }

    /// Any other status.
    pub fn new(status: StatusCode, kind: &'static str, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: Some(code),
            retry_after: None,
            close: false,
        }
    }

    /// The error object: the body of a response, or the data of a stream's last event.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl From<Invalid> for ApiError {
    fn from(e: Invalid) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: e.for_api(),
            kind: "invalid_request_error",
            param: Some(e.field.param()),
            code: None,
            retry_after: None,
            close: false,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            response.headers_mut().insert("retry-after", HeaderValue::from(s));
        }
        if self.close {
            response.headers_mut().insert(axum::http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}

/// What a JSON value is, in words.
fn kind(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) if s.len() == 1 => "a string of 1 byte".into(),
        Value::String(s) => format!("a string of {} bytes", s.len()),
        Value::Array(a) if a.len() == 1 => "an array of 1 item".into(),
        Value::Array(a) => format!("an array of {} items", a.len()),
        Value::Object(_) => "an object".into(),
    }
}

/// OpenAI fields this server does not implement, each with what leaves it off and what the refusal says
/// was expected. A body that turns one on is refused rather than answered as if it had not asked: a
/// client that sends `echo: true` and gets no prompt back has a wrong answer and no way to tell. Each
/// field's "off" value, or its absence or `null`, is accepted, as OpenAI's clients send them.
const UNSUPPORTED: &[Unsupported] = &[
    Unsupported { field: "echo", off: |v| v == &Value::Bool(false), expected: "false (the prompt is not echoed)" },
    // Where it equals `n` it chooses nothing, and is taken off before this table is read.
    Unsupported {
        field: "best_of",
        off: |v| whole(v) == Some(1),
        expected: "1 or n (every completion drawn is returned)",
    },
    Unsupported {
        field: "suffix",
        off: |v| v.as_str() == Some(""),
        expected: "an empty string (no insertion after the completion)",
    },
    Unsupported {
        field: "tools",
        off: |v| v.as_array().is_some_and(Vec::is_empty),
        expected: "an empty list (tool calls are not supported)",
    },
    Unsupported {
        field: "tool_choice",
        off: |v| matches!(v.as_str(), Some("none" | "auto")),
        expected: "\"none\" or \"auto\" (no tools)",
    },
    // The older function calling, and the audio and predicted outputs.
    Unsupported {
        field: "functions",
        off: |v| v.as_array().is_some_and(Vec::is_empty),
        expected: "an empty list (function calls are not supported)",
    },
    Unsupported {
        field: "function_call",
        off: |v| matches!(v.as_str(), Some("none" | "auto")),
        expected: "\"none\" or \"auto\" (no functions)",
    },
    Unsupported {
        field: "modalities",
        off: |v| v.as_array().is_some_and(|m| m.iter().all(|m| m == "text")),
        expected: "[\"text\"] (text output only)",
    },
    Unsupported { field: "audio", off: |_| false, expected: "none (text output only)" },
    Unsupported { field: "prediction", off: |_| false, expected: "none (no predicted outputs)" },
    Unsupported {
        field: "response_format",
        off: |v| v.get("type").and_then(Value::as_str) == Some("text"),
        expected: "{\"type\": \"text\"} (no constrained output)",
    },
];

/// A field of [`UNSUPPORTED`]: its name, whether a value leaves it off, and what a refusal says was expected.
struct Unsupported {
    field: &'static str,
    off: fn(&Value) -> bool,
    expected: &'static str,
}

/// `logit_bias`: an object of token ids, as strings (OpenAI's form), to biases.
fn logit_bias(m: &Map<String, Value>) -> Result<Vec<(u64, f64)>, ApiError> {
    const EXPECTED: &str = "an object of token ids (as strings) to numbers";
    match m.get("logit_bias") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Object(o)) => o
            .iter()
            .map(|(k, v)| match (k.parse::<u64>(), v.as_f64()) {
                (Ok(id), Some(b)) => Ok((id, b)),
                (Err(_), _) => Err(ApiError::invalid("logit_bias", EXPECTED, format_args!("the key {k:?}"))),
                (_, None) => Err(ApiError::invalid("logit_bias", EXPECTED, format_args!("{} for {k:?}", kind(v)))),
            })
            .collect(),
        Some(v) => Err(ApiError::invalid("logit_bias", EXPECTED, kind(v))),
    }
}

/// A completion's `logprobs`: how many alternatives to report with each token's log-probability
/// (`null` or `false`: none reported). Bounds are checked with the rest of the request.
fn completion_logprobs(m: &Map<String, Value>) -> Result<Option<(Field, u64)>, ApiError> {
    match m.get("logprobs") {
        None | Some(Value::Null | Value::Bool(false)) => Ok(None),
        Some(_) => Ok(opt_u64(m, "logprobs")?.map(|n| (Field::Logprobs, n))),
    }
}

/// A chat completion's `logprobs` (a boolean) and `top_logprobs` (alternatives per token, which asks
/// for `logprobs`).
fn chat_logprobs(m: &Map<String, Value>) -> Result<Option<(Field, u64)>, ApiError> {
    let on = opt_bool(m, "logprobs")?;
    let top = opt_u64(m, "top_logprobs")?;
    match (on, top) {
        (false, Some(n)) if n > 0 => Err(ApiError::invalid("top_logprobs", "0 or null unless \"logprobs\" is true", n)),
        (false, _) => Ok(None),
        (true, top) => Ok(Some((Field::TopLogprobs, top.unwrap_or(0)))),
    }
}

/// The first field of [`UNSUPPORTED`] that `m` turns on, refused.
fn refuse_unsupported(m: &Map<String, Value>) -> Result<(), ApiError> {
    for u in UNSUPPORTED {
        match m.get(u.field) {
            None | Some(Value::Null) => {}
            Some(v) if (u.off)(v) => {}
            Some(v) => return Err(ApiError::invalid(u.field, u.expected, v)),
        }
    }
    Ok(())
}

/// The prompt of a completion: text to tokenize, ids, or a conversation to render with the chat template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
    /// Chat messages.
    Messages(Vec<model::chat::Message>),
}

/// A `POST /v1/completions` body, its fields typed and checked for type (bounds come from
/// [`request::check_request`] once the prompt is tokenized).
#[derive(Debug, Clone)]
pub struct Completion {
    /// The model asked for, if any.
    pub model: Option<String>,
    /// The prompts: one, or a completion's batch (OpenAI's array of strings or of id arrays).
    pub prompts: Vec<Prompt>,
    /// Completions per prompt (`n`): choice `i * n + j` is prompt `i`'s `j`-th, sampled with the seed
    /// plus `j` (as vLLM seeds a request's parallel samples).
    pub n: usize,
    /// Everything but the prompt ids.
    pub raw: RawRequest,
    /// Stop strings (at most 4).
    pub stop: Vec<String>,
    /// A chat request that gave no `max_tokens`: as many as the context leaves after the prompt, as
    /// OpenAI's chat API, vLLM and llama-server do (`raw.max_tokens` is set once the prompt is
    /// tokenized). Completions default to 16, as OpenAI's.
    pub to_context: bool,
    /// Which parameter gave `max_tokens`, for errors: `max_completion_tokens` where a chat request used
    /// that name.
    pub limit_field: Field,
    /// Server-sent events instead of one body.
    pub stream: bool,
    /// With `stream`: a last chunk carrying `usage`.
    pub include_usage: bool,
    /// Fields of the body this server neither reads nor refuses, in order (vLLM's `guided_regex`,
    /// say): left out of the reply's making, so the server warns and the `pdhost` object names them.
    pub ignored: Vec<String>,
    /// How the conversation's prompt ends (chat only): vLLM's `add_generation_prompt` (true by
    /// default) and `continue_final_message`.
    pub turn: model::chat::Turn,
}

/// The most ignored fields a reply names (a body may hold any number).
const MAX_IGNORED_NAMED: usize = 16;

/// The fields [`Completion::from_map`] reads (those of [`UNSUPPORTED`] are refused where they ask for
/// something), and those accepted with no effect on a reply: `user`, `metadata`, `store` and
/// `service_tier` are an account's bookkeeping, `parallel_tool_calls` means nothing without tools.
const READ: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "n",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_k",
    "min_p",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "ignore_eos",
    "stop_token_ids",
    "min_tokens",
    "max_tokens",
    "max_completion_tokens",
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
];

/// The most choices a request may ask for: its prompts times `n`.
pub const MAX_CHOICES: usize = 64;

/// The most stop strings. OpenAI allows 4 and vLLM any number; evaluation harnesses send a task's own
/// list (lm-evaluation-harness: its `until` strings and the end-of-sequence text, six for HumanEval), so
/// 4 refused their requests. Each is at most 256 bytes, so that a token's search stays short.
pub const MAX_STOP: usize = 32;

/// OpenAI's default `max_tokens` for completions.
pub const DEFAULT_MAX_TOKENS: u64 = 16;

fn obj(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(
            "body",
            "a JSON object",
            // serde_json says what it met and where: "EOF while parsing an object at line 1 column 1",
            // "recursion limit exceeded at ...".
            format_args!("invalid JSON ({e})"),
        )
    })?;
    match value {
        Value::Object(map) => Ok(map),
        other => Err(ApiError::invalid("body", "a JSON object", kind(&other))),
    }
}

fn opt_u64(m: &Map<String, Value>, key: &'static str) -> Result<Option<u64>, ApiError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match (whole(v), v) {
            (Some(i), _) if i >= 0 => Ok(Some(i as u64)),
            (Some(_), Value::Number(n)) => Err(ApiError::invalid(key, "a positive integer", n)),
            _ => Err(ApiError::invalid(key, "an integer", kind(v))),
        },
    }
}

/// A JSON integer, or a whole number written as a float (`16.0`, as some languages' JSON writers put
/// it, which vLLM takes) below 2^53 in magnitude, where a float still holds every integer.
fn whole(v: &Value) -> Option<i128> {
    let Value::Number(n) = v else { return None };
    n.as_u64()
        .map(i128::from)
        .or_else(|| n.as_i64().map(i128::from))
        .or_else(|| n.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 2f64.powi(53)).map(|f| f as i128))
}

/// `stop_token_ids` (vLLM's): token ids that end the reply as an end-of-sequence token does.
fn stop_token_ids(m: &Map<String, Value>) -> Result<Vec<u64>, ApiError> {
    const EXPECTED: &str = "an array of token ids";
    match m.get("stop_token_ids") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| match whole(v) {
                Some(id) if id >= 0 => Ok(u64::try_from(id).unwrap_or(u64::MAX)),
                _ => Err(ApiError::invalid("stop_token_ids", EXPECTED, format_args!("{} in it", kind(v)))),
            })
            .collect(),
        Some(v) => Err(ApiError::invalid("stop_token_ids", EXPECTED, kind(v))),
    }
}

/// `top_k` (vLLM's and llama-server's): the most likely tokens to sample from; 0, or vLLM's older -1,
/// for no limit.
fn top_k(m: &Map<String, Value>) -> Result<Option<u64>, ApiError> {
    const EXPECTED: &str = "a positive integer, or 0 or -1 for no limit";
    match m.get("top_k") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match whole(v) {
            Some(-1) => Ok(None),
            Some(k) if k >= 0 => Ok(Some(u64::try_from(k).unwrap_or(u64::MAX))),
            Some(_) => Err(ApiError::invalid("top_k", EXPECTED, v)),
            None => Err(ApiError::invalid("top_k", EXPECTED, kind(v))),
        },
    }
}

fn opt_f64(m: &Map<String, Value>, key: &'static str) -> Result<Option<f64>, ApiError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(v) => Err(ApiError::invalid(key, "a number", kind(v))),
    }
}

fn opt_bool(m: &Map<String, Value>, key: &'static str) -> Result<bool, ApiError> {
    bool_or(m, key, false)
}

/// A boolean field, `default` where it is absent or `null`.
fn bool_or(m: &Map<String, Value>, key: &'static str, default: bool) -> Result<bool, ApiError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ApiError::invalid(key, "a boolean", kind(v))),
    }
}

/// One chat message: `{"role": "...", "content": "..."}`, the content a string or text parts.
fn message(i: usize, v: &Value) -> Result<model::chat::Message, ApiError> {
    let Value::Object(m) = v else {
        return Err(ApiError::invalid(
            "messages",
            "objects with a role and a content",
            format_args!("{} at {i}", kind(v)),
        ));
    };
    let role = match m.get("role") {
        // OpenAI's newer name for the system prompt, which chat templates do not know (Gemma's refuses
        // the conversation): the system's turn, as llama.cpp's server reads it.
        Some(Value::String(r)) if r == "developer" => "system".to_string(),
        Some(Value::String(r)) if !r.is_empty() => r.clone(),
        other => {
            let found = other.map_or("none".to_string(), kind);
            return Err(ApiError::invalid(
                "messages",
                "a role string in every message",
                format_args!("{found} at {i}"),
            ));
        }
    };
    let content = match m.get("content") {
        // Only an assistant's turn may come without content (OpenAI's, beside tool calls); a user's or
        // a system's without it is a client's mistake, not an empty turn.
        None | Some(Value::Null) if role == "assistant" => String::new(),
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                "messages",
                "content in every message but an assistant's",
                format_args!("none in message {i} ({role})"),
            ))
        }
        Some(Value::String(c)) => c.clone(),
        // OpenAI's content parts: only text ones here.
        Some(Value::Array(parts)) => {
            // Joined by newlines, as vLLM joins them.
            let mut text = String::new();
            for (k, part) in parts.iter().enumerate() {
                match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => {
                        if k > 0 {
                            text.push('\n');
                        }
                        text.push_str(t)
                    }
                    (kind_of_part, _) => {
                        let found = match (kind_of_part, part.get("text")) {
                            (Some("text"), None) => "a text part without its \"text\"".to_string(),
                            (Some("text"), Some(t)) => format!("a text part whose \"text\" is {}", kind(t)),
                            (Some(other), _) => format!("a part of type {:?}", request::shorten_to(other, 32)),
                            (None, _) => "a part without a \"type\" string".to_string(),
                        };
                        return Err(ApiError::invalid(
                            "messages",
                            "content as a string or text parts ({\"type\": \"text\", \"text\": ...})",
                            format_args!("{found} (part {k} of message {i})"),
                        ));
                    }
                }
            }
            text
        }
        Some(v) => {
            return Err(ApiError::invalid(
                "messages",
                "content as a string or text parts",
                format_args!("{} at {i}", kind(v)),
            ))
        }
    };
    Ok(model::chat::Message::new(role, content))
}

/// A chat request's `messages`: 1 to [`model::chat::MAX_MESSAGES`] of them.
fn messages(v: Option<Value>) -> Result<Vec<model::chat::Message>, ApiError> {
    match v {
        Some(Value::Array(a)) if !a.is_empty() => {
            if a.len() > model::chat::MAX_MESSAGES {
                return Err(ApiError::invalid(
                    "messages",
                    format_args!("1 to {} messages", model::chat::MAX_MESSAGES),
                    a.len(),
                ));
            }
            a.iter().enumerate().map(|(i, v)| message(i, v)).collect()
        }
        Some(Value::Array(_)) => Err(ApiError::invalid("messages", "at least one message", "none")),
        None => Err(ApiError::invalid("messages", "an array of messages", "none")),
        Some(v) => Err(ApiError::invalid("messages", "an array of messages", kind(&v))),
    }
}

/// The `model` a body names, if any.
fn model_name(m: &Map<String, Value>) -> Result<Option<String>, ApiError> {
    match m.get("model") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(ApiError::invalid("model", "a string", kind(v))),
    }
}

/// How a conversation's prompt ends: vLLM's `add_generation_prompt` (true by default) and
/// `continue_final_message` (false), which cannot both be true.
fn turn(m: &Map<String, Value>) -> Result<model::chat::Turn, ApiError> {
    use model::chat::Turn;
    match (bool_or(m, "add_generation_prompt", true)?, opt_bool(m, "continue_final_message")?) {
        (true, true) => Err(ApiError::invalid(
            "continue_final_message",
            "it with add_generation_prompt false (a reply continues the last message, or opens a turn)",
            "both true",
        )),
        (_, true) => Ok(Turn::Continued),
        (true, false) => Ok(Turn::Open),
        (false, false) => Ok(Turn::Closed),
    }
}

/// A `POST /tokenize` body, as vLLM reads it: a `prompt` string, or chat `messages` rendered with the
/// model's template first.
#[derive(Debug, Clone)]
pub struct Tokenize {
    /// The model asked for, if any.
    pub model: Option<String>,
    /// [`Prompt::Text`] or [`Prompt::Messages`].
    pub input: Prompt,
    /// Whether the tokenizer adds its special tokens (BOS): by default, for a prompt, as a completion's
    /// prompt is encoded; not for messages, whose template writes its own (transformers'
    /// `apply_chat_template` default, and vLLM's).
    pub add_special_tokens: bool,
    /// For messages: how the prompt ends, as a chat completion's would ([`turn`]).
    pub turn: model::chat::Turn,
    /// Whether the answer also names each token's text in the vocabulary (`token_strs`).
    pub return_token_strs: bool,
}

impl Tokenize {
    /// Reads a `/tokenize` body; other fields are ignored, as vLLM's are.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let mut m = obj(body)?;
        let model = model_name(&m)?;
        let input = match (m.get("prompt"), m.contains_key("messages")) {
            (Some(_), true) => {
                return Err(ApiError::invalid("prompt", "a prompt or messages", "both"));
            }
            (None, true) => Prompt::Messages(messages(m.remove("messages"))?),
            (Some(Value::String(s)), false) => Prompt::Text(s.clone()),
            (Some(v), false) => return Err(ApiError::invalid("prompt", "a string", kind(v))),
            (None, false) => return Err(ApiError::invalid("prompt", "a string, or messages", "neither")),
        };
        let chat = matches!(input, Prompt::Messages(_));
        Ok(Tokenize {
            model,
            add_special_tokens: bool_or(&m, "add_special_tokens", !chat)?,
            turn: turn(&m)?,
            return_token_strs: opt_bool(&m, "return_token_strs")?,
            input,
        })
    }
}

/// A `POST /detokenize` body (vLLM's): token ids to turn back into text.
#[derive(Debug, Clone)]
pub struct Detokenize {
    /// The model asked for, if any.
    pub model: Option<String>,
    /// The ids, each below `vocab`.
    pub tokens: Vec<u32>,
}

impl Detokenize {
    /// Reads a `/detokenize` body for a vocabulary of `vocab` tokens.
    pub fn parse(body: &[u8], vocab: usize) -> Result<Self, ApiError> {
        let m = obj(body)?;
        let model = model_name(&m)?;
        let expected = || format!("an array of token ids below {vocab}");
        let tokens = match m.get("tokens") {
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    whole(v)
                        .and_then(|id| u32::try_from(id).ok())
                        .filter(|&id| (id as usize) < vocab)
                        .ok_or_else(|| ApiError::invalid("tokens", expected(), format_args!("{v} at position {i}")))
                })
                .collect::<Result<Vec<u32>, _>>()?,
            None => return Err(ApiError::invalid("tokens", expected(), "none")),
            Some(v) => return Err(ApiError::invalid("tokens", expected(), kind(v))),
        };
        Ok(Detokenize { model, tokens })
    }
}

impl Completion {
    /// Reads a `POST /v1/chat/completions` body: `messages` instead of `prompt`, the rest as a completion.
    pub fn parse_chat(body: &[u8]) -> Result<Self, ApiError> {
        let mut m = obj(body)?;
        let messages = messages(m.remove("messages"))?;
        let turn = turn(&m)?;
        m.remove("add_generation_prompt");
        m.remove("continue_final_message");
        if m.contains_key("prompt") {
            return Err(ApiError::invalid("prompt", "no prompt in a chat request (messages carry it)", "one"));
        }
        // `max_completion_tokens` is the newer name of `max_tokens`, and wins where both are set (as in
        // vLLM): a client that sends every field leaves the deprecated one `null`. Refusals name the one
        // given.
        let newer = opt_u64(&m, "max_completion_tokens")?;
        m.remove("max_completion_tokens");
        if let Some(n) = newer {
            m.insert("max_tokens".into(), n.into());
        }
        let mut c = Completion::from_map(m, Some(Prompt::Messages(messages)))?;
        if newer.is_some() {
            c.limit_field = Field::MaxCompletionTokens;
        }
        c.turn = turn;
        Ok(c)
    }

    /// Reads a completion body. Unknown fields are ignored, as OpenAI's clients send extras; known ones
    /// this server does not implement are refused when set ([`UNSUPPORTED`]).
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        Completion::from_map(obj(body)?, None)
    }

    /// The fields both endpoints share; `prompt` from the body unless the caller has it already.
    fn from_map(mut m: Map<String, Value>, prompt: Option<Prompt>) -> Result<Self, ApiError> {
        let model = model_name(&m)?;
        let prompts = match prompt {
            Some(p) => vec![p],
            None => Self::prompts(&m)?,
        };
        let n = match opt_u64(&m, "n")? {
            None => 1,
            Some(n) if (1..=MAX_CHOICES as u64).contains(&n) && n as usize * prompts.len() <= MAX_CHOICES => n as usize,
            Some(n) if prompts.len() > 1 => {
                return Err(ApiError::invalid(
                    "n",
                    format_args!(
                        "at least 1 and at most {} for {} prompts ({MAX_CHOICES} choices a request)",
                        MAX_CHOICES / prompts.len(),
                        prompts.len()
                    ),
                    n,
                ))
            }
            Some(n) => return Err(ApiError::invalid("n", format_args!("1 to {MAX_CHOICES}"), n)),
        };
        // `best_of` equal to `n` draws no more than are returned (OpenAI's and vLLM's reading).
        if m.get("best_of").and_then(whole) == Some(n as i128) {
            m.remove("best_of");
        }
        refuse_unsupported(&m)?;
        let prompt = &prompts[0];
        let stop = match m.get("stop") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) if a.len() <= MAX_STOP && a.iter().all(Value::is_string) => {
                a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect()
            }
            Some(v) => return Err(ApiError::invalid("stop", format!("a string or up to {MAX_STOP} strings"), kind(v))),
        };
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop", "non-empty strings", "an empty string"));
        }
        if stop.iter().any(|s| s.len() > 256) {
            return Err(ApiError::invalid("stop", "strings of at most 256 bytes", "a longer one"));
        }
        let stream = opt_bool(&m, "stream")?;
        let include_usage = match m.get("stream_options") {
            None | Some(Value::Null) => false,
            Some(Value::Object(_)) if !stream => {
                return Err(ApiError::invalid("stream_options", "none unless \"stream\" is true", "an object"))
            }
            Some(Value::Object(o)) => opt_bool(o, "include_usage")?,
            Some(v) => return Err(ApiError::invalid("stream_options", "an object", kind(v))),
        };
        let logprobs = match prompt {
            Prompt::Messages(_) => chat_logprobs(&m)?,
            _ => completion_logprobs(&m)?,
        };
        let max_tokens = opt_u64(&m, "max_tokens")?;
        let to_context = max_tokens.is_none() && matches!(prompt, Prompt::Messages(_));
        let raw = RawRequest {
            prompt: Vec::new(),
            prompt_field: Some(match prompt {
                Prompt::Messages(_) => Field::Messages,
                _ => Field::Prompt,
            }),
            max_tokens: max_tokens.unwrap_or(DEFAULT_MAX_TOKENS),
            min_max_tokens: 1,
            sampling: SamplingParams {
                // OpenAI's defaults: temperature 1, top_p 1.
                temperature: Some(opt_f64(&m, "temperature")?.unwrap_or(1.0)),
                top_k: top_k(&m)?,
                min_p: opt_f64(&m, "min_p")?,
                top_p: Some(opt_f64(&m, "top_p")?.unwrap_or(1.0)),
                // No seed: a fresh one (vLLM and llama-server draw each unseeded request anew; with 0
                // every sampled reply to the same prompt was the same), which the `pdhost` object reports.
                seed: match m.get("seed") {
                    None | Some(Value::Null) => random_seed(),
                    // Negative seeds as their 64 bits (`-1` is `2^64 - 1`), as vLLM's do.
                    Some(v) => match whole(v) {
                        Some(seed) => seed as u64,
                        None => return Err(ApiError::invalid("seed", "an integer", kind(v))),
                    },
                },
            },
            prefill_chunk: 0,
            presence_penalty: opt_f64(&m, "presence_penalty")?,
            frequency_penalty: opt_f64(&m, "frequency_penalty")?,
            repetition_penalty: opt_f64(&m, "repetition_penalty")?,
            logit_bias: logit_bias(&m)?,
            logprobs,
            ignore_eos: opt_bool(&m, "ignore_eos")?,
            stop_token_ids: stop_token_ids(&m)?,
            min_tokens: opt_u64(&m, "min_tokens")?,
        };
        let ignored = m
            .keys()
            .filter(|k| !READ.contains(&k.as_str()) && !UNSUPPORTED.iter().any(|u| u.field == k.as_str()))
            .take(MAX_IGNORED_NAMED)
            .map(|k| crate::request::shorten_to(k, 64))
            .collect();
        Ok(Completion {
            model,
            prompts,
            n,
            raw,
            stop,
            limit_field: Field::MaxTokens,
            stream,
            include_usage,
            to_context,
            ignored,
            turn: model::chat::Turn::Open,
        })
    }

    /// `prompt`: a string or an array of token ids, or OpenAI's batch of them (an array of strings, or
    /// of id arrays), each a prompt of its own.
    fn prompts(m: &Map<String, Value>) -> Result<Vec<Prompt>, ApiError> {
        match m.get("prompt") {
            Some(Value::Array(a)) if a.first().is_some_and(|p| p.is_string() || p.is_array()) => {
                if a.len() > MAX_CHOICES {
                    return Err(ApiError::invalid("prompt", format_args!("at most {MAX_CHOICES} prompts"), a.len()));
                }
                a.iter()
                    .enumerate()
                    .map(|(i, p)| match p {
                        Value::String(_) | Value::Array(_) => Self::prompt(p, Some(i)),
                        p => Err(ApiError::invalid(
                            "prompt",
                            "an array of strings or of token id arrays",
                            format_args!("{} at position {i}", kind(p)),
                        )),
                    })
                    .collect()
            }
            None => Err(ApiError::invalid("prompt", "a string or an array of token ids", "none")),
            Some(p) => Ok(vec![Self::prompt(p, None)?]),
        }
    }

    /// One prompt: a string or an array of token ids (`at`: its place in a batch).
    fn prompt(p: &Value, at: Option<usize>) -> Result<Prompt, ApiError> {
        let which = at.map(|i| format!(" (prompt {i})")).unwrap_or_default();
        Ok(match p {
            Value::String(s) if s.is_empty() => {
                return Err(ApiError::invalid("prompt", "a non-empty prompt", format_args!("an empty string{which}")))
            }
            Value::String(s) => Prompt::Text(s.clone()),
            Value::Array(a) if a.iter().all(|v| v.is_number()) => {
                let ids = a
                    .iter()
                    .enumerate()
                    .map(|(i, v)| {
                        whole(v).and_then(|id| u32::try_from(id).ok()).ok_or_else(|| {
                            ApiError::invalid(
                                "prompt",
                                "token ids from 0 to 4294967295",
                                format_args!("{v} at position {i}{which}"),
                            )
                        })
                    })
                    .collect::<Result<Vec<u32>, _>>()?;
                Prompt::Ids(ids)
            }
            Value::Array(a) => {
                let (i, v) = a.iter().enumerate().find(|(_, v)| !v.is_number()).expect("not all numbers");
                return Err(ApiError::invalid(
                    "prompt",
                    "a string or an array of token ids",
                    format_args!("{} at position {i}{which}", kind(v)),
                ));
            }
            v => {
                return Err(ApiError::invalid(
                    "prompt",
                    "a string or an array of token ids",
                    format_args!("{}{which}", kind(v)),
                ))
            }
        })
    }
}

/// A fresh seed: the hash of nothing under std's random SipHash keys (drawn from the OS once per
/// thread, and stepped for every `RandomState`).
pub(crate) fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // Below 2^53, so that a client whose JSON numbers are doubles (JavaScript's) can send it back as
    // it came.
    std::collections::hash_map::RandomState::new().build_hasher().finish() >> 11
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str) -> String {
        Completion::parse(body.as_bytes()).unwrap_err().message
    }

    #[test]
    fn a_template_refusal_is_quoted_whole() {
        let gemma =
            model::chat::ChatTemplate::from_source(model::chat::GEMMA3_TEMPLATE, Some("<bos>"), Some("<eos>")).unwrap();
        let user = |text: &str| model::chat::Message::new("user", text);
        let e = gemma.render(&[user("one"), user("two")], true).unwrap_err();
        let err = ApiError::refused_messages(&e);
        assert_eq!((err.status, err.param), (StatusCode::BAD_REQUEST, Some("messages")));
        assert_eq!(
            err.message,
            "messages: expected messages the model's chat template accepts, found chat template refused the \
             messages: Conversation roles must alternate user/assistant/user/assistant/..."
        );
    }

    /// `/tokenize` adds the tokenizer's special tokens to a prompt and not to messages unless told, and
    /// opens the assistant's turn unless told; `null` is the default.
    #[test]
    fn tokenize_bodies_take_vllms_defaults() {
        use model::chat::Turn;
        let t = Tokenize::parse(br#"{"prompt":"hi","add_generation_prompt":null}"#).unwrap();
        assert_eq!(t.input, Prompt::Text("hi".into()));
        assert!(t.add_special_tokens && t.turn == Turn::Open && !t.return_token_strs);
        let t = Tokenize::parse(br#"{"messages":[{"role":"user","content":"hi"}],"return_token_strs":true}"#).unwrap();
        assert!(matches!(t.input, Prompt::Messages(ref m) if m.len() == 1));
        assert!(!t.add_special_tokens && t.turn == Turn::Open && t.return_token_strs);
        let t = Tokenize::parse(br#"{"prompt":"","add_special_tokens":false,"add_generation_prompt":false}"#).unwrap();
        assert!(!t.add_special_tokens && t.turn == Turn::Closed);
        let user = r#""messages":[{"role":"user","content":"hi"}]"#;
        let turn = |extra: &str| Completion::parse_chat(format!("{{{user}{extra}}}").as_bytes()).map(|c| c.turn);
        assert_eq!(turn("").unwrap(), Turn::Open);
        assert_eq!(turn(r#","add_generation_prompt":false"#).unwrap(), Turn::Closed);
        let continued = turn(r#","add_generation_prompt":false,"continue_final_message":true"#).unwrap();
        assert_eq!(continued, Turn::Continued);
        let both = turn(r#","continue_final_message":true"#).unwrap_err();
        assert!(both.message.starts_with("continue_final_message: expected it with add_generation_prompt false"));
        let read = Completion::parse_chat(format!("{{{user},\"continue_final_message\":false}}").as_bytes());
        assert!(read.unwrap().ignored.is_empty(), "read, not ignored");
        let e = Tokenize::parse(br#"{"messages":[]}"#).unwrap_err();
        assert_eq!(e.message, "messages: expected at least one message, found none");
        let e = Tokenize::parse(br#"{"prompt":"x","add_special_tokens":1}"#).unwrap_err();
        assert_eq!(e.message, "add_special_tokens: expected a boolean, found the number 1");
        assert_eq!(Detokenize::parse(br#"{"tokens":[0, 2.0]}"#, 3).unwrap().tokens, [0, 2]);
        let e = Detokenize::parse(br#"{"tokens":[0, -1]}"#, 3).unwrap_err();
        assert_eq!(e.message, "tokens: expected an array of token ids below 3, found -1 at position 1");
        let e = Detokenize::parse(b"{}", 3).unwrap_err();
        assert_eq!(e.message, "tokens: expected an array of token ids below 3, found none");
    }

    #[test]
    fn fields_are_read_with_their_types_and_named_when_wrong() {
        let c = Completion::parse(br#"{"prompt":"hi","max_tokens":3,"stop":["\n"],"stream":true,"stream_options":{"include_usage":true},"user":"x"}"#).unwrap();
        assert_eq!(c.prompts[0], Prompt::Text("hi".into()));
        assert_eq!((c.raw.max_tokens, c.stream, c.include_usage), (3, true, true));
        assert_eq!(c.stop, vec!["\n".to_string()]);
        let c = Completion::parse(br#"{"prompt":[1,2,3]}"#).unwrap();
        assert_eq!(c.prompts[0], Prompt::Ids(vec![1, 2, 3]));
        assert_eq!(c.raw.max_tokens, DEFAULT_MAX_TOKENS);

        assert_eq!(
            err("{"),
            "body: expected a JSON object, found invalid JSON (EOF while parsing an object at line 1 column 1)"
        );
        let deep = format!("{}{}", "[".repeat(1000), "]".repeat(1000));
        assert!(err(&deep).contains("(recursion limit exceeded at line 1 column 128)"), "{}", err(&deep));
        assert_eq!(err("[1]"), "body: expected a JSON object, found an array of 1 item");
        assert_eq!(err(r#"{"prompt":""}"#), "prompt: expected a non-empty prompt, found an empty string");
        assert_eq!(err(r#"{}"#), "prompt: expected a string or an array of token ids, found none");
        assert_eq!(
            err(r#"{"prompt":[1,"b"]}"#),
            "prompt: expected a string or an array of token ids, found a string of 1 byte at position 1"
        );
        // A batch: each string or id array a prompt of its own; a nested batch is not a prompt.
        let batch = |b: &str| Completion::parse(b.as_bytes()).unwrap().prompts;
        assert_eq!(batch(r#"{"prompt":["hi"]}"#), [Prompt::Text("hi".into())]);
        assert_eq!(batch(r#"{"prompt":["a",[1,2]]}"#), [Prompt::Text("a".into()), Prompt::Ids(vec![1, 2])]);
        assert_eq!(
            err(r#"{"prompt":[[1],[[1]]]}"#),
            "prompt: expected a string or an array of token ids, found an array of 1 item at position 0 (prompt 1)"
        );
        assert_eq!(
            err(r#"{"prompt":["a",7]}"#),
            "prompt: expected an array of strings or of token id arrays, found the number 7 at position 1"
        );
        assert_eq!(err(r#"{"prompt":[""]}"#), "prompt: expected a non-empty prompt, found an empty string (prompt 0)");
        assert_eq!(
            err(r#"{"prompt":[1,-2]}"#),
            "prompt: expected token ids from 0 to 4294967295, found -2 at position 1"
        );
        assert_eq!(
            err(r#"{"prompt":"x","max_tokens":"3"}"#),
            "max_tokens: expected an integer, found a string of 1 byte"
        );
        assert_eq!(err(r#"{"prompt":"x","max_tokens":-1}"#), "max_tokens: expected a positive integer, found -1");
        assert_eq!(Completion::parse(br#"{"prompt":"x","n":3}"#).unwrap().n, 3);
        assert_eq!(err(r#"{"prompt":"x","n":0}"#), "n: expected 1 to 64, found 0");
        assert_eq!(
            err(r#"{"prompt":["x","y","z"],"n":22}"#),
            "n: expected at least 1 and at most 21 for 3 prompts (64 choices a request), found 22"
        );
        let six = Completion::parse(br#"{"prompt":"x","stop":["a","b","c","d","e","f"]}"#).unwrap();
        assert_eq!(six.stop.len(), 6, "more than OpenAI's 4, as vLLM and evaluation harnesses have it");
        let many = format!(r#"{{"prompt":"x","stop":{}}}"#, json!(vec!["a"; 33]));
        assert!(err(&many).starts_with("stop: expected a string or up to 32"), "{}", err(&many));
        assert_eq!(
            err(r#"{"prompt":"x","temperature":"hot"}"#),
            "temperature: expected a number, found a string of 3 bytes"
        );
        assert_eq!(err(r#"{"prompt":"x","stream":1}"#), "stream: expected a boolean, found the number 1");
        // Usage chunks come only in a stream (OpenAI and vLLM refuse the options without one).
        assert_eq!(
            err(r#"{"prompt":"x","stream_options":{"include_usage":true}}"#),
            "stream_options: expected none unless \"stream\" is true, found an object"
        );
        // A whole number written as a float is that number; a fraction is not.
        assert_eq!(Completion::parse(br#"{"prompt":"x","max_tokens":16.0}"#).unwrap().raw.max_tokens, 16);
        assert_eq!(err(r#"{"prompt":"x","max_tokens":1.5}"#), "max_tokens: expected an integer, found the number 1.5");
        // So in every integer field: a seed (negative ones too), token ids, `best_of`.
        let seed = |b: &str| Completion::parse(b.as_bytes()).unwrap().raw.sampling.seed;
        assert_eq!(seed(r#"{"prompt":"x","seed":42.0}"#), 42);
        assert_eq!(seed(r#"{"prompt":"x","seed":-1}"#), u64::MAX);
        assert_eq!(seed(r#"{"prompt":"x","seed":-2.0}"#), u64::MAX - 1);
        assert_eq!(err(r#"{"prompt":"x","seed":0.5}"#), "seed: expected an integer, found the number 0.5");
        // vLLM's and llama-server's filters: `top_k` 0 or vLLM's older -1 is no limit.
        let sampling = |b: &str| Completion::parse(b.as_bytes()).unwrap().raw.sampling;
        assert_eq!(sampling(r#"{"prompt":"x","top_k":64,"min_p":0.05}"#).top_k, Some(64));
        assert_eq!(sampling(r#"{"prompt":"x","top_k":64,"min_p":0.05}"#).min_p, Some(0.05));
        assert_eq!(sampling(r#"{"prompt":"x","top_k":-1}"#).top_k, None);
        assert_eq!(sampling(r#"{"prompt":"x","top_k":0}"#).top_k, Some(0));
        assert_eq!(
            err(r#"{"prompt":"x","top_k":-2}"#),
            "top_k: expected a positive integer, or 0 or -1 for no limit, found -2"
        );
        assert_eq!(
            err(r#"{"prompt":"x","top_k":"8"}"#),
            "top_k: expected a positive integer, or 0 or -1 for no limit, found a string of 1 byte"
        );
        let Prompt::Ids(ids) = Completion::parse(br#"{"prompt":[1.0,2]}"#).unwrap().prompts.remove(0) else {
            panic!("ids")
        };
        assert_eq!(ids, [1, 2]);
        assert!(Completion::parse(br#"{"prompt":"x","best_of":1.0}"#).is_ok());
        assert_eq!(Completion::parse(br#"{"prompt":"x","n":3,"best_of":3}"#).unwrap().n, 3);
        assert_eq!(
            err(r#"{"prompt":"x","n":2,"best_of":3}"#),
            "best_of: expected 1 or n (every completion drawn is returned), found 3"
        );
        // The older function calling and the audio outputs are refused, not ignored.
        for (field, value) in
            [("functions", r#"[{"name":"f"}]"#), ("function_call", r#"{"name":"f"}"#), ("audio", "{}")]
        {
            let body = format!(r#"{{"prompt":"x","{field}":{value}}}"#);
            assert!(err(&body).starts_with(&format!("{field}: expected")), "{field}: {}", err(&body));
        }
        assert!(Completion::parse(br#"{"prompt":"x","functions":[],"modalities":["text"]}"#).is_ok());
        // What no field of this server reads is named, not silently dropped; bookkeeping is not.
        let c = Completion::parse(br#"{"prompt":"x","user":"u","guided_regex":"a+","min_tokens":3,"beam":1}"#);
        assert_eq!(c.unwrap().ignored, ["guided_regex", "beam"], "in the order of the body");
        let c = Completion::parse(br#"{"prompt":"x","stop_token_ids":[2,7.0],"min_tokens":3}"#).unwrap();
        assert_eq!((c.raw.stop_token_ids, c.raw.min_tokens), (vec![2, 7], Some(3)));
        assert_eq!(
            err(r#"{"prompt":"x","stop_token_ids":[2,-1]}"#),
            "stop_token_ids: expected an array of token ids, found the number -1 in it"
        );
        assert_eq!(
            err(r#"{"prompt":"x","stop_token_ids":2}"#),
            "stop_token_ids: expected an array of token ids, found the number 2"
        );
    }

    #[test]
    fn chat_messages_are_read_with_text_parts_and_named_when_wrong() {
        // Text parts of one message are joined by newlines, as vLLM joins them.
        let c = Completion::parse_chat(
            br#"{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"Hi"},{"type":"text","text":"!"}]}],"max_completion_tokens":5}"#,
        )
        .unwrap();
        let Prompt::Messages(m) = &c.prompts[0] else { panic!("messages") };
        assert_eq!((m[0].role.as_str(), m[1].content.as_str(), c.raw.max_tokens), ("system", "Hi\n!", 5));
        assert!(!c.to_context);
        // The newer name wins over the deprecated one, also where a client sends that one as `null`.
        let user = r#""messages":[{"role":"user","content":"x"}]"#;
        for both in [r#""max_tokens":null,"max_completion_tokens":5"#, r#""max_tokens":40,"max_completion_tokens":5"#] {
            let c = Completion::parse_chat(format!("{{{user},{both}}}").as_bytes()).unwrap();
            assert_eq!((c.raw.max_tokens, c.to_context), (5, false), "{both}");
        }
        // A refusal names the field the client sent.
        let bad = Completion::parse_chat(format!(r#"{{{user},"max_completion_tokens":-1}}"#).as_bytes()).unwrap_err();
        assert_eq!(bad.message, "max_completion_tokens: expected a positive integer, found -1");
        let c = Completion::parse_chat(format!(r#"{{{user},"max_completion_tokens":7}}"#).as_bytes()).unwrap();
        assert_eq!(c.limit_field, Field::MaxCompletionTokens);
        // No limit given: a chat reply runs to the context (set once the prompt is tokenized), not to the
        // legacy completions' 16.
        for none in ["", r#","max_tokens":null"#, r#","max_completion_tokens":null"#] {
            assert!(Completion::parse_chat(format!("{{{user}{none}}}").as_bytes()).unwrap().to_context, "{none}");
        }
        assert!(!Completion::parse(br#"{"prompt":"x"}"#).unwrap().to_context);
        let chat_err = |b: &str| Completion::parse_chat(b.as_bytes()).unwrap_err().message;
        assert_eq!(chat_err(r#"{"messages":[]}"#), "messages: expected at least one message, found none");
        assert_eq!(chat_err(r#"{}"#), "messages: expected an array of messages, found none");
        assert_eq!(
            chat_err(r#"{"messages":[{"content":"x"}]}"#),
            "messages: expected a role string in every message, found none at 0"
        );
        // A part that cannot be read is named by what is wrong with it, and where it is.
        let parts = |p: &str| {
            chat_err(&format!(r#"{{"messages":[{{"role":"user","content":[{{"type":"text","text":"a"}},{p}]}}]}}"#))
        };
        let expected = r#"messages: expected content as a string or text parts ({"type": "text", "text": ...}), found"#;
        for (part, found) in [
            (r#"{"type":"image_url"}"#, r#"a part of type "image_url""#),
            (r#"{"type":"text"}"#, r#"a text part without its "text""#),
            (r#"{"type":"text","text":7}"#, r#"a text part whose "text" is the number 7"#),
            (r#"{"text":"b"}"#, r#"a part without a "type" string"#),
        ] {
            assert_eq!(parts(part), format!("{expected} {found} (part 1 of message 0)"));
        }
        assert_eq!(
            chat_err(r#"{"messages":[{"role":"user"}]}"#),
            "messages: expected content in every message but an assistant's, found none in message 0 (user)"
        );
        let c = Completion::parse_chat(
            br#"{"messages":[{"role":"user","content":"a"},{"role":"assistant","content":null}]}"#,
        );
        let Prompt::Messages(m) = c.unwrap().prompts.remove(0) else { panic!("messages") };
        assert_eq!(m[1].content, "");
        let c = Completion::parse_chat(br#"{"messages":[{"role":"developer","content":"Be brief."}]}"#);
        let Prompt::Messages(m) = c.unwrap().prompts.remove(0) else { panic!("messages") };
        assert_eq!((m[0].role.as_str(), m[0].content.as_str()), ("system", "Be brief."));
        assert_eq!(
            chat_err(r#"{"messages":["hi"]}"#),
            "messages: expected objects with a role and a content, found a string of 2 bytes at 0"
        );
    }
}
