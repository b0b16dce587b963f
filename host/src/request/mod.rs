//! One checked request: every parameter a user or a client gives is turned into a checked value here, or
//! into an [`Invalid`] that names the parameter, what was expected and what was found.
//!
//! `pdhost generate`, the benches and the server all go through these functions, so a bound exists once.
//! In the spirit of TGI's `validation.rs`: nothing downstream re-checks, and nothing downstream may be
//! reached with a value these functions did not pass.
//!
//! - [`Limits`]: what the model (and the operator's `--context`) allows, from metadata alone, before any
//!   weight is read.
//! - [`check_request`]: prompt ids, output length and sampling into an [`engine::Request`].
//! - [`check_threads`], [`check_page_size`], [`check_timeout`], [`check_count`]: the scalar flags.
//! - [`kv_budget`] and [`check_memory`]: the KV pool is sized from the checked request, and refused with
//!   the number of bytes when memory cannot hold it.
//! - [`input`]: the files and texts a request arrives in (prompt files, `--model` paths,
//!   `--backend-config`).
//!
//! Names: each [`Field`] has its command-line flag and its HTTP parameter name; an [`Invalid`] displays
//! with the flag, and [`Invalid::for_api`] gives the parameter's wording.

use std::fmt;
use std::time::Duration;

use model::arch::Config;
use shm_format::{Dtype, KvGeometry, LayerKv};

use crate::engine::{self, Sampling};

pub mod input;

/// A parameter of a request or of the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Field {
    /// The model.
    Model,
    /// Prompt text.
    Prompt,
    /// A file holding the prompt.
    PromptFile,
    /// Prompt token ids.
    PromptIds,
    /// Tokens to generate.
    MaxTokens,
    /// Tokens to generate, by the chat API's newer name.
    MaxCompletionTokens,
    /// Sampling temperature.
    Temperature,
    /// Nucleus mass.
    TopP,
    /// The most likely tokens to sample from.
    TopK,
    /// The least probability to sample, relative to the most likely token's.
    MinP,
    /// Tokens that end the output.
    StopTokenIds,
    /// The fewest tokens before an end.
    MinTokens,
    /// `presence_penalty`.
    PresencePenalty,
    /// `frequency_penalty`.
    FrequencyPenalty,
    /// `repetition_penalty`.
    RepetitionPenalty,
    /// `logit_bias`.
    LogitBias,
    /// Forward-pass threads.
    Threads,
    /// Tokens per KV page.
    PageSize,
    /// Prompt tokens per prefill span.
    PrefillChunk,
    /// Seconds a producer may take.
    ProducerTimeout,
    /// `--producer-memory`.
    ProducerMemory,
    /// JSON for the backend.
    BackendConfig,
    /// The producer.
    Producer,
    /// Prompt plus output tokens per sequence.
    Context,
    /// Element type of the KV cache.
    KvDtype,
    /// Bench: prompt lengths.
    Tokens,
    /// Bench: repetitions.
    Iters,
    /// Bench: span sizes.
    Sizes,
    /// Bench: prompt length.
    PromptTokens,
    /// Bench: tokens decoded.
    DecodeTokens,
    /// Serve: requests waiting.
    Queue,
    /// Serve: sequences live at once.
    Slots,
    /// Serve: producer processes.
    Producers,
    /// Serve: restarts per producer per minute.
    MaxRestarts,
    /// The producers' sandbox.
    Sandbox,
    /// What a failed remote prefill does.
    OnProducerFailure,
    /// Bench serve: prompt lengths.
    Inputs,
    /// Bench serve: output lengths.
    Outputs,
    /// Bench serve: requests in flight.
    Concurrency,
    /// Bench serve: timed batches per cell.
    Repeats,
    /// Bench serve: a running server.
    Url,
    /// Bench serve --mixed: streams decoding.
    Streams,
    /// Bench serve --mixed: long prompts at once.
    LongPrompts,
    /// Bench serve --mixed: tokens per long prompt.
    LongPrompt,
    /// Serve: seconds to finish in-flight requests.
    DrainTimeout,
    /// Serve: milliseconds a prompt waits for others arriving with it.
    BatchWait,
    /// Bench model: sequences decoded at once.
    Batch,
    /// Bench soak: requests sent.
    Requests,
    /// Bench soak: share of requests a producer fails.
    FaultRate,
    /// Bench soak: share of clients that disconnect.
    DisconnectRate,
    /// Bench soak: share of malformed requests.
    BadRate,
    /// Bench soak: seconds between producer kills.
    KillEvery,
    /// Check-backend: the largest relative L2 error of a layer's K/V.
    KvTolerance,
    /// Check-backend: the largest logit gap that counts as a near-tie.
    TieMargin,
    /// Producer node: the address to listen on.
    Listen,
    /// Producer node: the backend it runs.
    Backend,
    /// Check-backend: the backend checked (its positional argument).
    CheckedBackend,
    /// A chat completion's messages (their rendered prompt).
    Messages,
    /// Log-probabilities: a completion's count of alternatives.
    Logprobs,
    /// Log-probabilities: a chat completion's count of alternatives.
    TopLogprobs,
}

impl Field {
    /// The command-line flag.
    pub fn flag(self) -> &'static str {
        match self {
            Field::Model => "--model",
            Field::Prompt => "--prompt",
            Field::PromptFile => "--prompt-file",
            Field::PromptIds => "--prompt-ids",
            Field::MaxTokens | Field::MaxCompletionTokens => "--max-tokens",
            Field::Temperature => "--temperature",
            Field::TopP => "--top-p",
            Field::TopK => "--top-k",
            Field::MinP => "--min-p",
            Field::StopTokenIds => "--stop-token-ids",
            Field::MinTokens => "--min-tokens",
            Field::PresencePenalty => "--presence-penalty",
            Field::FrequencyPenalty => "--frequency-penalty",
            Field::RepetitionPenalty => "--repetition-penalty",
            Field::LogitBias => "--logit-bias",
            Field::Threads => "--threads",
            Field::PageSize => "--page-size",
            Field::PrefillChunk => "--prefill-chunk",
            Field::ProducerTimeout => "--producer-timeout",
            Field::ProducerMemory => "--producer-memory",
            Field::BackendConfig => "--backend-config",
            Field::Producer => "--producer",
            Field::Context => "--context",
            Field::KvDtype => "--kv-dtype",
            Field::Tokens => "--tokens",
            Field::Iters => "--iters",
            Field::Sizes => "--sizes",
            Field::PromptTokens => "--prompt-tokens",
            Field::DecodeTokens => "--decode-tokens",
            Field::Queue => "--queue",
            Field::Slots => "--slots",
            Field::Producers => "--producers",
            Field::MaxRestarts => "--max-restarts",
            Field::Sandbox => "--sandbox",
            Field::OnProducerFailure => "--on-producer-failure",
            Field::Inputs => "--inputs",
            Field::Outputs => "--outputs",
            Field::Concurrency => "--concurrency",
            Field::Repeats => "--repeats",
            Field::Url => "--url",
            Field::Streams => "--streams",
            Field::LongPrompts => "--long-prompts",
            Field::LongPrompt => "--long-prompt",
            Field::DrainTimeout => "--drain-timeout",
            Field::BatchWait => "--batch-wait",
            Field::Batch => "--batch",
            Field::Requests => "--requests",
            Field::FaultRate => "--fault-rate",
            Field::DisconnectRate => "--disconnect-rate",
            Field::BadRate => "--bad-rate",
            Field::KillEvery => "--kill-every",
            Field::KvTolerance => "--kv-tolerance",
            Field::TieMargin => "--tie-margin",
            Field::Listen => "--listen",
            Field::Backend => "--backend",
            Field::CheckedBackend => "BACKEND",
            Field::Messages => "messages",
            Field::Logprobs => "--logprobs",
            Field::TopLogprobs => "--top-logprobs",
        }
    }

    /// The name of the parameter in an HTTP request body (OpenAI's where it has one).
    pub fn param(self) -> &'static str {
        match self {
            Field::Prompt | Field::PromptFile | Field::PromptIds => "prompt",
            Field::MaxTokens => "max_tokens",
            Field::MaxCompletionTokens => "max_completion_tokens",
            Field::TopP => "top_p",
            Field::TopK => "top_k",
            Field::MinP => "min_p",
            Field::StopTokenIds => "stop_token_ids",
            Field::MinTokens => "min_tokens",
            Field::PresencePenalty => "presence_penalty",
            Field::FrequencyPenalty => "frequency_penalty",
            Field::RepetitionPenalty => "repetition_penalty",
            Field::LogitBias => "logit_bias",
            Field::TopLogprobs => "top_logprobs",
            other => other.flag().trim_start_matches("--"),
        }
    }
}

/// A parameter outside its bounds: which one, what was expected and what was found.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}: expected {expected}, found {found}", field.flag())]
pub struct Invalid {
    /// The parameter.
    pub field: Field,
    /// What it must be.
    pub expected: String,
    /// What it was (cut short when long: nothing a user sent is echoed whole).
    pub found: String,
}

impl Invalid {
    /// A refusal of `field`.
    pub fn new(field: Field, expected: impl Into<String>, found: impl fmt::Display) -> Self {
        Invalid { field, expected: expected.into(), found: shorten(&found.to_string()) }
    }

    /// The same refusal worded for an HTTP client: the body's parameter name instead of the flag.
    pub fn for_api(&self) -> String {
        format!("{}: expected {}, found {}", self.field.param(), self.expected, self.found)
    }
}

/// At most 80 characters of `text`, cut on a character boundary, with its full length when cut: what
/// a message quotes of a client's input.
pub fn shorten(text: &str) -> String {
    shorten_to(text, 80)
}

/// At most `max` characters of `text`, cut on a character boundary, with its full length when cut.
pub fn shorten_to(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((cut, _)) => format!("{}... ({} bytes)", &text[..cut], text.len()),
        None => text.to_string(),
    }
}

/// A float for a message: plain when short, in scientific notation when huge or tiny.
fn number(x: f64) -> String {
    if x.is_finite() && x != 0.0 && !(1e-4..1e9).contains(&x.abs()) {
        format!("{x:e}")
    } else {
        x.to_string()
    }
}

/// The longest page, in tokens: beyond it a page is larger than any useful sharing unit, and its pool a
/// waste of memory.
pub const MAX_PAGE_SIZE: u32 = 4096;
/// Tokens per KV page unless told otherwise (the incident's server ran 64), capped at the model's context.
pub const DEFAULT_PAGE_SIZE: u32 = 64;

/// The longest a producer may take to start or to answer one prefill.
pub const MAX_PRODUCER_TIMEOUT: Duration = Duration::from_secs(3600);

/// What a model and its operator allow a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The model's name, for messages.
    pub model: String,
    /// Token ids are below this.
    pub vocab: usize,
    /// Prompt plus output tokens of one sequence: the model's context, or the operator's smaller
    /// `--context`.
    pub context: usize,
    /// Whether the context is the operator's (`--context`) rather than the model's.
    pub operator_context: bool,
    /// The model's own context (what bounds page sizes, whatever `--context` says).
    pub model_context: usize,
}

impl Limits {
    /// The limits of a model with configuration `config`, optionally narrowed by an operator's
    /// `--context` (which may not exceed the model's).
    pub fn new(model: &str, config: &Config, context: Option<u64>) -> Result<Self, Invalid> {
        let mut limits = Limits {
            model: model.to_string(),
            vocab: config.vocab,
            context: config.context,
            operator_context: false,
            model_context: config.context,
        };
        if let Some(c) = context {
            if c == 0 || c > config.context as u64 {
                return Err(Invalid::new(
                    Field::Context,
                    format!("1 to {} tokens ({}'s context)", config.context, model),
                    c,
                ));
            }
            limits.context = c as usize;
            limits.operator_context = true;
        }
        Ok(limits)
    }

    /// [`Limits::new`] for a server, whose context must hold a prompt token and an output token: every
    /// request asks for one token at least.
    pub fn serving(model: &str, config: &Config, context: u64) -> Result<Self, Invalid> {
        if context == 1 && config.context > 1 {
            return Err(Invalid::new(
                Field::Context,
                format!("2 to {} tokens (a request's prompt token and output token at least)", config.context),
                context,
            ));
        }
        Limits::new(model, config, Some(context))
    }

    fn context_name(&self) -> String {
        if self.operator_context {
            format!("the {}-token --context", self.context)
        } else {
            format!("{}'s {}-token context", self.model, self.context)
        }
    }
}

/// A request as given: ids already tokenized, everything else unchecked.
#[derive(Clone, Debug, Default)]
pub struct RawRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Which parameter the ids came from (for messages).
    pub prompt_field: Option<Field>,
    /// Tokens to generate at most.
    pub max_tokens: u64,
    /// The least `max_tokens` may be (0 for the command line, where it generates nothing; 1 for the API).
    pub min_max_tokens: u64,
    /// Sampling temperature, filters and seed.
    pub sampling: SamplingParams,
    /// Prompt tokens per prefill span (0: the whole prompt).
    pub prefill_chunk: u64,
    /// `presence_penalty` (`None`: 0).
    pub presence_penalty: Option<f64>,
    /// `frequency_penalty` (`None`: 0).
    pub frequency_penalty: Option<f64>,
    /// `repetition_penalty` (`None`: 1).
    pub repetition_penalty: Option<f64>,
    /// `logit_bias`: token id and bias, as given.
    pub logit_bias: Vec<(u64, f64)>,
    /// Log-probabilities wanted, with how many alternatives per token, and which field asked.
    pub logprobs: Option<(Field, u64)>,
    /// Go on past the model's end-of-sequence tokens, to `max_tokens` (vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// Tokens that end the output as an end-of-sequence token does (vLLM's `stop_token_ids`), as given.
    pub stop_token_ids: Vec<u64>,
    /// The fewest tokens before an end-of-sequence or stop token (vLLM's `min_tokens`; `None`: 0).
    pub min_tokens: Option<u64>,
}

/// Checks a request against the model's limits: a non-empty prompt of ids inside the vocabulary, prompt
/// plus output inside the context (checked arithmetic), sampling parameters that mean something.
pub fn check_request(raw: &RawRequest, limits: &Limits) -> Result<engine::Request, Invalid> {
    let prompt_field = raw.prompt_field.unwrap_or(Field::Prompt);
    if raw.prompt.is_empty() {
        return Err(Invalid::new(prompt_field, "at least one token", "an empty prompt"));
    }
    if let Some((i, &id)) = raw.prompt.iter().enumerate().find(|&(_, &id)| id as usize >= limits.vocab) {
        return Err(Invalid::new(
            prompt_field,
            format!("token ids below {}'s vocabulary size {}", limits.model, limits.vocab),
            format_args!("{id} at position {i}"),
        ));
    }
    let prompt_len = raw.prompt.len() as u64;
    let context = limits.context as u64;
    // The prompt must leave room for its own last position; output tokens come after it.
    if prompt_len > context {
        return Err(Invalid::new(
            prompt_field,
            format!("at most {} tokens ({})", context, limits.context_name()),
            format_args!("{prompt_len} tokens"),
        ));
    }
    if raw.max_tokens < raw.min_max_tokens {
        return Err(Invalid::new(Field::MaxTokens, format!("at least {}", raw.min_max_tokens), raw.max_tokens));
    }
    let room = context - prompt_len;
    match prompt_len.checked_add(raw.max_tokens) {
        Some(total) if total <= context => {}
        _ => {
            return Err(Invalid::new(
                Field::MaxTokens,
                format!("at most {room} after a {prompt_len}-token prompt ({})", limits.context_name()),
                raw.max_tokens,
            ))
        }
    }
    if raw.prefill_chunk > context {
        return Err(Invalid::new(
            Field::PrefillChunk,
            format!("0 (the whole prompt) or 1 to {context} tokens"),
            raw.prefill_chunk,
        ));
    }
    let sampling = check_sampling(&raw.sampling)?;
    let penalties = check_penalties(raw, limits)?;
    let logprobs = match raw.logprobs {
        None => None,
        Some((_, n)) if n <= engine::MAX_TOP_LOGPROBS as u64 => Some(n as usize),
        Some((field, n)) => {
            return Err(Invalid::new(field, format!("0 to {} alternatives per token", engine::MAX_TOP_LOGPROBS), n))
        }
    };
    if raw.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(Invalid::new(
            Field::StopTokenIds,
            format!("at most {MAX_STOP_TOKEN_IDS} token ids"),
            raw.stop_token_ids.len(),
        ));
    }
    let stop_ids = raw
        .stop_token_ids
        .iter()
        .map(|&id| match u32::try_from(id) {
            Ok(id) if (id as usize) < limits.vocab => Ok(id),
            _ => Err(Invalid::new(
                Field::StopTokenIds,
                format!("token ids below {}'s vocabulary size {}", limits.model, limits.vocab),
                id,
            )),
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let min_tokens = raw.min_tokens.unwrap_or(0);
    if min_tokens > raw.max_tokens {
        return Err(Invalid::new(
            Field::MinTokens,
            format!("at most the reply's token limit ({})", raw.max_tokens),
            min_tokens,
        ));
    }
    Ok(engine::Request {
        prompt: raw.prompt.clone(),
        max_tokens: raw.max_tokens as usize,
        prefill_chunk: raw.prefill_chunk as usize,
        sampling,
        penalties,
        logprobs,
        ignore_eos: raw.ignore_eos,
        stop_ids,
        min_tokens: min_tokens as usize,
    })
}

/// The most `stop_token_ids` a request may give.
pub const MAX_STOP_TOKEN_IDS: usize = 64;

/// The least repetition penalty. A positive logit is divided by it: 1e-300 became 0 as an f32, and
/// every repeated token's logit infinite (transformers and vLLM only ask for a number above 0).
pub const MIN_REPETITION_PENALTY: f64 = 0.01;

/// The most tokens `logit_bias` may name (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;

/// Presence and frequency penalties from -2 to 2 (OpenAI's range), a repetition penalty from
/// [`MIN_REPETITION_PENALTY`] to 10, and up to [`MAX_LOGIT_BIAS`] biases from -100 to 100 on distinct tokens inside the vocabulary.
pub fn check_penalties(raw: &RawRequest, limits: &Limits) -> Result<engine::Penalties, Invalid> {
    let within = |field: Field, v: Option<f64>, default: f64| match v {
        None => Ok(default as f32),
        Some(v) if v.is_finite() && (-2.0..=2.0).contains(&v) => Ok(v as f32),
        Some(v) => Err(Invalid::new(field, "a number from -2 to 2", number(v))),
    };
    let presence = within(Field::PresencePenalty, raw.presence_penalty, 0.0)?;
    let frequency = within(Field::FrequencyPenalty, raw.frequency_penalty, 0.0)?;
    let repetition = match raw.repetition_penalty {
        None => 1.0,
        Some(r) if (MIN_REPETITION_PENALTY..=10.0).contains(&r) => r as f32,
        Some(r) => {
            return Err(Invalid::new(
                Field::RepetitionPenalty,
                format!("a number from {MIN_REPETITION_PENALTY} to 10 (1: off)"),
                number(r),
            ))
        }
    };
    if raw.logit_bias.len() > MAX_LOGIT_BIAS {
        return Err(Invalid::new(
            Field::LogitBias,
            format!("at most {MAX_LOGIT_BIAS} tokens"),
            format_args!("{} tokens", raw.logit_bias.len()),
        ));
    }
    let mut bias = Vec::with_capacity(raw.logit_bias.len());
    for &(token, b) in &raw.logit_bias {
        if token >= limits.vocab as u64 {
            return Err(Invalid::new(
                Field::LogitBias,
                format!("token ids below {}'s vocabulary size {}", limits.model, limits.vocab),
                token,
            ));
        }
        if !(b.is_finite() && (-100.0..=100.0).contains(&b)) {
            return Err(Invalid::new(
                Field::LogitBias,
                "biases from -100 to 100",
                format_args!("{} for token {token}", number(b)),
            ));
        }
        if bias.iter().any(|&(t, _)| u64::from(t) == token) {
            return Err(Invalid::new(Field::LogitBias, "each token once", format_args!("token {token} twice")));
        }
        bias.push((token as u32, b as f32));
    }
    Ok(engine::Penalties { presence, frequency, repetition, bias })
}

/// How a request samples, as given.
#[derive(Clone, Copy, Debug, Default)]
pub struct SamplingParams {
    /// Temperature (`None` or 0: greedy, and the rest unused).
    pub temperature: Option<f64>,
    /// Only the `top_k` most likely tokens (`None` or 0: no limit; more than the vocabulary is all of it).
    pub top_k: Option<u64>,
    /// Only tokens at least `min_p` times as likely as the most likely one (`None` or 0: no limit).
    pub min_p: Option<f64>,
    /// Nucleus mass (`None`: 1).
    pub top_p: Option<f64>,
    /// Seed.
    pub seed: u64,
}

/// Temperature finite and at least 0 (0 is greedy), top-p in (0, 1], min-p in [0, 1].
pub fn check_sampling(p: &SamplingParams) -> Result<Sampling, Invalid> {
    // Above this, softmax of f32 logits is uniform to the last bit: sampling ignores the model.
    const MAX_TEMPERATURE: f64 = 100.0;
    if let Some(t) = p.temperature {
        if !(t.is_finite() && (0.0..=MAX_TEMPERATURE).contains(&t)) {
            return Err(Invalid::new(
                Field::Temperature,
                format!("a number from 0 (greedy) to {MAX_TEMPERATURE}"),
                number(t),
            ));
        }
    }
    if let Some(top_p) = p.top_p {
        if !(top_p.is_finite() && top_p > 0.0 && top_p <= 1.0) {
            return Err(Invalid::new(Field::TopP, "a number above 0 and at most 1", number(top_p)));
        }
    }
    if let Some(min_p) = p.min_p {
        if !(0.0..=1.0).contains(&min_p) {
            return Err(Invalid::new(Field::MinP, "a number from 0 (no limit) to 1", number(min_p)));
        }
    }
    Ok(match p.temperature {
        Some(t) if t > 0.0 => Sampling::Sample {
            temperature: t as f32,
            top_k: p.top_k.map_or(0, |k| u32::try_from(k).unwrap_or(u32::MAX)),
            min_p: p.min_p.unwrap_or(0.0) as f32,
            top_p: p.top_p.unwrap_or(1.0) as f32,
            seed: p.seed,
        },
        _ => Sampling::Greedy,
    })
}

/// Forward-pass threads: 1 to four per core (`None`: one per core).
pub fn check_threads(threads: Option<u64>) -> Result<usize, Invalid> {
    let max = model::kernels::max_threads();
    match threads {
        None => Ok(model::kernels::available_cores()),
        Some(t) if (1..=max as u64).contains(&t) => Ok(t as usize),
        Some(t) => Err(Invalid::new(
            Field::Threads,
            format!("1 to {max} (4 per core; {} cores here)", model::kernels::available_cores()),
            t,
        )),
    }
}

/// Tokens per KV page: 1 to the smaller of [`MAX_PAGE_SIZE`] and the model's context; `None` gives
/// [`DEFAULT_PAGE_SIZE`], or the context when that is smaller.
pub fn check_page_size(page_size: Option<u64>, limits: &Limits) -> Result<u32, Invalid> {
    let max = MAX_PAGE_SIZE.min(limits.model_context.min(u32::MAX as usize) as u32);
    let page_size = page_size.unwrap_or(u64::from(DEFAULT_PAGE_SIZE.min(max)));
    if (1..=u64::from(max)).contains(&page_size) {
        Ok(page_size as u32)
    } else {
        Err(Invalid::new(Field::PageSize, format!("1 to {max} tokens"), page_size))
    }
}

/// Seconds as a deadline: finite, above 0 and at most [`MAX_PRODUCER_TIMEOUT`].
pub fn check_timeout(field: Field, seconds: f64) -> Result<Duration, Invalid> {
    let max = MAX_PRODUCER_TIMEOUT.as_secs_f64();
    if seconds.is_finite() && seconds > 0.0 && seconds <= max {
        Ok(Duration::from_secs_f64(seconds))
    } else {
        Err(Invalid::new(field, format!("seconds above 0 and at most {max}"), number(seconds)))
    }
}

/// A count inside `min..=max`.
pub fn check_count(field: Field, value: u64, min: u64, max: u64) -> Result<u64, Invalid> {
    if (min..=max).contains(&value) {
        Ok(value)
    } else {
        Err(Invalid::new(field, format!("{min} to {max}"), value))
    }
}

/// Bytes the paged KV cache preallocates for `max_seqs` sequences of up to `max_len` tokens, laid out as
/// [`crate::kv::PagedKv::new`] lays its pools out: the sliding groups' bounded pools, then a page per
/// `page_size` tokens (plus one) of every full-attention layer. `None` when it does not fit in 64 bits.
pub fn kv_budget(geometry: &KvGeometry, dtype: Dtype, page_size: u32, max_len: u64, max_seqs: u32) -> Option<u64> {
    let page = u64::from(page_size.max(1));
    let seqs = u64::from(max_seqs);
    let mut bytes = 0u64;
    for layer in &geometry.layers {
        let row = match *layer {
            LayerKv::Full { kv_heads, head_dim } | LayerKv::Sliding { kv_heads, head_dim, .. } => {
                2 * u64::from(kv_heads).checked_mul(u64::from(head_dim))?.checked_mul(dtype.size())?
            }
            LayerKv::Recurrent { state_elems } => state_elems.checked_mul(dtype.size())?,
        };
        let pages = match *layer {
            LayerKv::Full { .. } => max_len.div_ceil(page).checked_add(1)?.checked_mul(seqs)?,
            LayerKv::Sliding { window, .. } => seqs.checked_mul(2 * (u64::from(window).div_ceil(page) + 1))?,
            LayerKv::Recurrent { .. } => {
                bytes = bytes.checked_add(row.checked_mul(2 * seqs)?)?;
                continue;
            }
        };
        bytes = bytes.checked_add(pages.checked_mul(page)?.checked_mul(row)?)?;
    }
    Some(bytes)
}

/// This process's peak resident memory so far (`VmHWM`), or `None` where `/proc` does not say. Read from
/// the process itself: a parent's accounting of a child (`wait4`) also counts the parent's own memory at
/// the child's start, which the child's address space copied or shared until it ran this program.
pub fn peak_rss_bytes() -> Option<u64> {
    own_status_bytes("VmHWM:")
}

/// This process's resident memory now (`VmRSS`), or `None` where `/proc` does not say.
pub fn rss_bytes() -> Option<u64> {
    own_status_bytes("VmRSS:")
}

/// The field `key` (in KiB) of this process's `/proc/self/status`, in bytes.
fn own_status_bytes(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    kib_field(&status, key).map(|k| k.saturating_mul(1024))
}

/// Memory that a new allocation may take now: the smaller of what the kernel calls available and what
/// is left under this process's address-space limit (`ulimit -v`).
pub fn memory_headroom() -> (u64, &'static str) {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let available = kib_field(&meminfo, "MemAvailable:").map_or(u64::MAX, |k| k.saturating_mul(1024));
    let mut headroom = (available, "available memory");
    let limit = rustix::process::getrlimit(rustix::process::Resource::As).current;
    if let Some(limit) = limit {
        let used = own_status_bytes("VmSize:").unwrap_or(0);
        let left = limit.saturating_sub(used);
        if left < headroom.0 {
            headroom = (left, "address space left under the process's limit");
        }
    }
    headroom
}

fn kib_field(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// Refuses to preallocate `bytes` for `what` when memory cannot hold them, saying how much and why;
/// `field` is the parameter that made it that large.
pub fn check_memory(field: Field, what: &str, bytes: u64) -> Result<(), Invalid> {
    let (headroom, which) = memory_headroom();
    // Leave a quarter for everything else the process still allocates (activations, buffers).
    let allowed = headroom / 4 * 3;
    if bytes <= allowed {
        return Ok(());
    }
    Err(Invalid::new(
        field,
        format!("{what} to fit in {} ({which})", gib(allowed)),
        format_args!("it needs {}", gib(bytes)),
    ))
}

/// Bytes in GiB for messages.
pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / f64::from(1u32 << 30))
}

#[cfg(test)]
mod tests;
