//! `pdhost serve`: an OpenAI-compatible HTTP server over the engine. HTTP and JSON live here and nowhere
//! else (as rust-analyzer keeps LSP in one crate).
//!
//! - Requests are read field by field ([`api`]) and checked by [`crate::request`], the same checks the CLI
//!   uses; a refusal is a 4xx with an OpenAI error object naming the field.
//! - One long-lived engine thread ([`worker`]) owns the engine, its KV cache and the producer (spawned from
//!   that thread, whose lifetime its parent-death signal follows). Up to `--slots` sequences are live, each
//!   round stepping every one by a token; further requests wait in a FIFO queue of `--queue` places, and
//!   past that the answer is 503 with `Retry-After`.
//! - A client that goes away (a dropped connection, a closed stream) cancels its request: the engine stops
//!   after the next token and frees the sequence's pages.
//! - SIGTERM or SIGINT stops accepting (503), lets in-flight requests finish within the drain timeout,
//!   then stops the engine thread and its producer.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use model::chat::ChatTemplate;
use model::tokenizer::Tokenizer;
use serde_json::{json, Value};
use tokio_stream::{StreamExt, StreamMap};

use crate::engine::TokenLogprob;
use crate::request::{self, Limits};
use crate::text::Pending;

pub mod api;
pub mod metrics;
pub mod prefill;
pub mod worker;

use api::{ApiError, Completion, Detokenize, Prompt, Tokenize};
use worker::{Event, Job};

/// The largest request body.
pub const MAX_BODY: usize = 4 << 20;
/// How long an idle thread of the async runtime's blocking pool (which tokenizes text prompts) is kept.
pub const BLOCKING_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(2);

/// What the server is told at start.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The model's name, as `/v1/models` lists it and requests may name it.
    pub model: String,
    /// What requests may ask for.
    pub limits: Limits,
    /// Requests waiting beyond the one being generated.
    pub queue: usize,
    /// A Bearer token every `/v1/` request must carry.
    pub api_key: Option<String>,
    /// How long in-flight requests may take to finish after SIGTERM or SIGINT.
    pub drain_timeout: Duration,
    /// The model's chat template (`None`: `/v1/chat/completions` answers that there is none).
    pub chat: Option<Arc<ChatTemplate>>,
    /// Prompt tokens per prefill span (0: the whole prompt), as `--prefill-chunk`.
    pub prefill_chunk: usize,
    /// Web origins allowed to call the API from a browser, as `--allowed-origins` (`*`: any; none: no
    /// CORS headers).
    pub allowed_origins: Vec<String>,
}

/// Shared by every handler.
#[derive(Debug)]
struct App {
    config: ServeConfig,
    tokenizer: Arc<Tokenizer>,
    jobs: crossbeam_channel::Sender<Job>,
    engine: Arc<worker::EngineState>,
    draining: AtomicBool,
    /// Completion requests being answered ([`InFlight`]).
    in_flight: AtomicUsize,
    /// Bodies being parsed and tokenized at once, at most [`INTAKE`]: a 4 MiB body of token ids is
    /// about 160 MiB of parsed JSON, and a 4 MiB text a second or two of a core to tokenize, all before
    /// the queue's bound applies.
    intake: tokio::sync::Semaphore,
    next_id: AtomicU64,
    metrics: metrics::Metrics,
    /// When the server started (Unix seconds): the model's `created`.
    started: u64,
    /// Eight hex digits drawn at start, in every response's id.
    id_prefix: String,
}

/// A completion request being answered, from its acceptance to its last byte (a stream's task holds it).
/// A drain closes the listener only once none is left, so that meanwhile new requests hear 503.
struct InFlight(Arc<App>);

impl InFlight {
    fn new(app: &Arc<App>) -> InFlight {
        app.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(Arc::clone(app))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl App {
    /// A body's `model`, which must be this server's where it is named (an empty name is no name, as
    /// vLLM takes it).
    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model.filter(|m| !m.is_empty()) {
            Some(m) if m != self.config.model => {
                let mut e = ApiError::invalid("model", format_args!("{:?}", self.config.model), format_args!("{m:?}"));
                e.status = StatusCode::NOT_FOUND;
                e.code = Some("model_not_found");
                Err(e)
            }
            _ => Ok(()),
        }
    }

    /// The model as `/v1/models` lists it.
    fn model_object(&self) -> Value {
        let template = self.config.chat.as_ref().map(|t| t.source().name());
        json!({
            "id": self.config.model, "object": "model", "created": self.started, "owned_by": "pdhost",
            "max_model_len": self.config.limits.context, "chat_template": template,
        })
    }

    /// The chat template, for a request that renders messages (`messages`); a 400 when the model has
    /// none.
    fn chat_for(&self, messages: bool) -> Result<Option<Arc<ChatTemplate>>, ApiError> {
        match (messages, &self.config.chat) {
            (true, None) => Err(ApiError::invalid(
                "messages",
                "a model with a chat template",
                format_args!("{} without one", self.config.model),
            )),
            (_, chat) => Ok(chat.clone()),
        }
    }

    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.config.api_key else { return Ok(()) };
        // The scheme's name is case-insensitive (RFC 9110).
        let header = headers.get("authorization");
        let given = header
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, key)| key);
        if given.is_some_and(|given| same_key(given.as_bytes(), key.as_bytes())) {
            return Ok(());
        }
        let found = match (given, header) {
            (Some(_), _) => "another key",
            (None, Some(_)) => "another scheme",
            (None, None) => "none",
        };
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid_api_key",
            format!("authorization: expected `Bearer` and the server's API key, found {found}"),
        ))
    }

    fn unavailable(&self) -> Option<ApiError> {
        let (code, why) = if self.draining.load(Ordering::Acquire) {
            ("unavailable", "the server is shutting down")
        } else if self.engine.gone() {
            ("engine_stopped", "the engine has stopped; restart the server")
        } else if !self.engine.serving() {
            ("unavailable", "the model is still loading")
        } else {
            return None;
        };
        let mut e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", code, why);
        e.retry_after = Some(1);
        Some(e)
    }
}

/// A server bound to its address, with its engine thread running.
#[derive(Debug)]
pub struct Server {
    app: Arc<App>,
    listener: tokio::net::TcpListener,
    worker: std::thread::JoinHandle<()>,
    stop: Arc<AtomicBool>,
}

impl Server {
    /// Binds `addr` (port 0: any free port) and starts the engine thread with `start`, which loads the
    /// model and the producer there; `/health` answers 503 until it is done.
    pub async fn bind(
        addr: SocketAddr,
        config: ServeConfig,
        tokenizer: Arc<Tokenizer>,
        start: worker::Start,
    ) -> std::io::Result<Server> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        // Unbounded: the engine's count of places (`EngineState::enqueue`) bounds it to `--queue` plus
        // the free slots.
        let (jobs, queue) = crossbeam_channel::unbounded();
        let engine = Arc::new(worker::EngineState::default());
        let metrics = metrics::Metrics::new();
        let stop = Arc::new(AtomicBool::new(false));
        let worker = worker::spawn(
            start,
            queue,
            Arc::clone(&tokenizer),
            Arc::clone(&engine),
            metrics.clone(),
            Arc::clone(&stop),
        )?;
        let app = Arc::new(App {
            config,
            tokenizer,
            jobs,
            engine,
            draining: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            intake: tokio::sync::Semaphore::new(INTAKE),
            next_id: AtomicU64::new(1),
            metrics,
            started: unix_now(),
            id_prefix: format!("{:08x}", api::random_seed() as u32),
        });
        Ok(Server { app, listener, worker, stop })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Resolves once the engine thread has loaded everything and started its producers, or says why it
    /// did not (loading failed, or not one producer can ever start). It holds no borrow of the server, so
    /// the server can [`Server::run`] meanwhile (`/health` answering 503 until then).
    pub fn ready(&self) -> impl std::future::Future<Output = Result<(), String>> + Send + 'static {
        let engine = Arc::clone(&self.app.engine);
        async move {
            while !engine.serving() {
                if engine.gone() {
                    return Err(engine.why_not_started().unwrap_or("it stopped (see the log above)").to_string());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(())
        }
    }

    /// Serves until `shutdown` resolves, then drains: new requests get 503, in-flight ones get up to the
    /// drain timeout, and the engine thread and its producer are stopped.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
        let Server { app, listener, worker, stop } = self;
        let router = Router::new()
            .route("/health", get(health))
            .route("/metrics", get(metrics_text))
            .route("/v1/models", get(models))
            .route("/v1/models/{model}", get(model))
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/tokenize", post(tokenize))
            .route("/detokenize", post(detokenize))
            .fallback(no_route)
            .method_not_allowed_fallback(wrong_method)
            .layer(DefaultBodyLimit::max(MAX_BODY))
            .with_state(Arc::clone(&app));
        let router = match cors(&app.config.allowed_origins) {
            Some(layer) => router.layer(layer),
            None => router,
        };
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let signalled = {
            let app = Arc::clone(&app);
            async move {
                shutdown.await;
                app.draining.store(true, Ordering::Release);
                tracing::info!("draining: new requests get 503");
                let _ = stop_tx.send(true);
            }
        };
        let mut stop_wait = stop_rx.clone();
        let graceful = {
            let app = Arc::clone(&app);
            async move {
                let _ = stop_wait.wait_for(|s| *s).await;
                // The listener stays open while requests are in flight, so that new ones hear 503
                // rather than a refused connection; then it closes, and idle connections with it.
                while app.in_flight.load(Ordering::Acquire) > 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        let serve = serve_http(listener, router, graceful);
        let drain = app.config.drain_timeout;
        let mut deadline_rx = stop_rx;
        let deadline = async move {
            let _ = deadline_rx.wait_for(|s| *s).await;
            tokio::time::sleep(drain).await;
        };
        tokio::spawn(signalled);
        tokio::select! {
            r = serve => r?,
            () = deadline => tracing::warn!("drain timeout: ending in-flight requests"),
        }
        // No more jobs. The engine thread is told to stop (connections still open past the deadline would
        // keep the queue's sender alive): it ends what is still live and drops the producer, which kills
        // and reaps it.
        drop(app);
        stop.store(true, Ordering::Release);
        let _ = tokio::task::spawn_blocking(move || worker.join()).await;
        Ok(())
    }
}

/// How long a client may take to send a request's headers (and a keep-alive connection may stay idle).
pub const HEADER_WAIT: Duration = Duration::from_secs(30);
/// How long a request's body may pause between two of its pieces.
pub const BODY_WAIT: Duration = Duration::from_secs(30);
/// How long a request's whole body may take: a client that sends a byte a second never pauses.
pub const BODY_TOTAL: Duration = Duration::from_secs(60);
/// Request bodies parsed and tokenized at once ([`App::intake`]); the rest wait their turn, their bodies
/// read.
const INTAKE: usize = 2;

/// Serves HTTP/1 connections from `listener` with `router` until `stop` resolves, then lets the open
/// ones finish (a connection between requests closes at once). What `axum::serve` does, with a deadline
/// on each request's headers ([`HEADER_WAIT`]), which it leaves unset, and `TCP_NODELAY`.
async fn serve_http(
    listener: tokio::net::TcpListener,
    router: Router,
    stop: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(HEADER_WAIT);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut stop = std::pin::pin!(stop);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of descriptors, say: the connection waiting is not lost, try again shortly.
                Err(e) => {
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let connection = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        tokio::spawn(graceful.watch(connection));
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// A path no route serves: 404, in an error object as every other refusal.
async fn no_route(State(app): State<Arc<App>>, uri: axum::http::Uri) -> Response {
    let found = request::shorten(uri.path());
    let e = ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "not_found",
        format!(
            "path: expected /health, /metrics, /v1/models, /v1/completions, /v1/chat/completions, /tokenize or \
             /detokenize, found {found}"
        ),
    );
    refused(&app, e)
}

/// Whether a client's key is the server's, in a time that depends on their lengths alone: a comparison
/// that stopped at the first differing byte would tell a client, by its timing, how much of a guess was
/// right.
fn same_key(given: &[u8], key: &[u8]) -> bool {
    let differ = given.iter().zip(key).fold(0u8, |acc, (a, b)| acc | (a ^ b));
    // The fold is data-independent; keep the compiler from turning it back into an early exit.
    std::hint::black_box(differ) == 0 && given.len() == key.len()
}

/// A route asked with a method it does not take: 405, in an error object, with the `Allow` header
/// RFC 9110 asks for.
async fn wrong_method(State(app): State<Arc<App>>, method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let expected = match uri.path() {
        path if path == "/health" || path == "/metrics" || path.starts_with("/v1/models") => "GET",
        _ => "POST",
    };
    let e = ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method_not_allowed",
        format!("method: expected {expected} for {}, found {method}", request::shorten(uri.path())),
    );
    let mut response = refused(&app, e);
    response.headers_mut().insert(axum::http::header::ALLOW, axum::http::HeaderValue::from_static(expected));
    response
}

async fn health(State(app): State<Arc<App>>) -> Response {
    match app.unavailable() {
        Some(e) => (e.status, Json(json!({"status": e.message}))).into_response(),
        None => Json(json!({"status": "ok"})).into_response(),
    }
}

async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    app.metrics.waiting.set(app.engine.waiting() as i64);
    ([("content-type", "text/plain; version=0.0.4; charset=utf-8")], app.metrics.render()).into_response()
}

/// The CORS layer for `origins` (`--allowed-origins`), if any: browsers may then send a page's
/// requests (`GET` and `POST`, with a JSON body and a key) from those origins and read the answers;
/// their preflight `OPTIONS` requests are answered by the layer, before any route or key check.
fn cors(origins: &[String]) -> Option<tower_http::cors::CorsLayer> {
    use axum::http::{HeaderValue, Method};
    use tower_http::cors::{AllowOrigin, CorsLayer};
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        // `cli::origin` admitted only ASCII letters, digits and `:/.-[]`: every one a header value.
        AllowOrigin::list(origins.iter().map(|o| HeaderValue::from_str(o).expect("an origin is a header value")))
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST])
            // Whatever headers a page's client asks for (the OpenAI SDKs send `x-stainless-*`): no
            // credentials are allowed, so none of them carries a cookie.
            .allow_headers(tower_http::cors::AllowHeaders::mirror_request())
            .max_age(Duration::from_secs(600)),
    )
}

/// Counts a refused request by its code, and answers with its error object.
fn refused(app: &App, e: ApiError) -> Response {
    let code = e.code.unwrap_or("invalid_request");
    // One line for it too, as for every request that ran (a burst of 4xx is otherwise invisible in the log).
    tracing::info!(status = e.status.as_u16(), code, param = e.param.unwrap_or("-"), "refused: {}", e.message);
    app.metrics.requests.with_label_values(&[code]).inc();
    e.into_response()
}

async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = app.authorize(&headers) {
        return refused(&app, e);
    }
    Json(json!({"object": "list", "data": [app.model_object()]})).into_response()
}

/// `GET /v1/models/{model}` (OpenAI's "retrieve model"): the model's object, or 404 for another name.
async fn model(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> Response {
    match app.authorize(&headers).and_then(|()| app.check_model(Some(&name))) {
        Ok(()) => Json(app.model_object()).into_response(),
        Err(e) => refused(&app, e),
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    completion(Arc::clone(&app), headers, body, Endpoint::Text).await.unwrap_or_else(|e| refused(&app, e))
}

async fn chat_completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    completion(Arc::clone(&app), headers, body, Endpoint::Chat).await.unwrap_or_else(|e| refused(&app, e))
}

/// Which API a request came in through: the shapes of its responses differ, nothing else does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Endpoint {
    /// `/v1/completions`.
    Text,
    /// `/v1/chat/completions`.
    Chat,
}

impl Endpoint {
    /// A response's id: the server's random prefix (so that ids do not repeat from one run to the next)
    /// and the request's number (the log's `id`).
    fn id(self, prefix: &str, n: u64) -> String {
        match self {
            Endpoint::Text => format!("cmpl-{prefix}-{n}"),
            Endpoint::Chat => format!("chatcmpl-{prefix}-{n}"),
        }
    }

    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Endpoint::Text, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    /// The choice of a whole response (`logprobs` from [`Endpoint::logprobs`], or null).
    fn choice(self, index: usize, text: &str, finish: &str, logprobs: Value) -> Value {
        match self {
            Endpoint::Text => json!({"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}),
            Endpoint::Chat => json!({"index": index, "message": {"role": "assistant", "content": text},
                                     "finish_reason": finish, "logprobs": logprobs}),
        }
    }

    /// The choice of a stream chunk: new text, or the end.
    fn delta(self, index: usize, text: &str, first: bool, finish: Option<&str>, logprobs: Value) -> Value {
        match self {
            Endpoint::Text => json!({"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}),
            Endpoint::Chat => {
                let delta = match (first, finish) {
                    (_, Some(_)) => json!({}),
                    (true, None) => json!({"role": "assistant", "content": text}),
                    (false, None) => json!({"content": text}),
                };
                json!({"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs})
            }
        }
    }

    /// Tokens' log-probabilities in this API's shape: a completion's `tokens`, `token_logprobs`,
    /// `top_logprobs` (token text to log-probability) and `text_offset` (characters from the start of
    /// the completion, `offset` on), or a chat completion's `content` of `{token, logprob, bytes,
    /// top_logprobs}`. A token that is not whole UTF-8 characters is named `bytes:\xNN...`, as
    /// OpenAI names it.
    fn logprobs(self, tokenizer: &Tokenizer, lps: &[TokenLogprob], offset: &mut TextOffset) -> Value {
        let named = |id: u32| {
            let bytes = tokenizer.token_bytes(id);
            let name = match std::str::from_utf8(&bytes) {
                Ok(s) => s.to_string(),
                Err(_) => format!("bytes:{}", bytes.iter().map(|b| format!("\\x{b:02x}")).collect::<String>()),
            };
            (name, bytes)
        };
        match self {
            Endpoint::Text => {
                let (mut tokens, mut offsets, mut tops) = (Vec::new(), Vec::new(), Vec::new());
                for t in lps {
                    let (name, _) = named(t.token);
                    offsets.push(offset.push(tokenizer, t.token));
                    let mut top = serde_json::Map::new();
                    for &(id, lp) in &t.top {
                        // Two ids of one text: the likelier one's figure.
                        top.entry(named(id).0).or_insert(json!(lp));
                    }
                    // The chosen token too, where it is not among the likeliest (a sampled or biased
                    // one): OpenAI's legacy API "will always return the logprob of the sampled token,
                    // so there may be up to logprobs+1 elements", as vLLM does.
                    top.entry(name.clone()).or_insert(json!(t.logprob));
                    tops.push(Value::Object(top));
                    tokens.push(name);
                }
                json!({"tokens": tokens, "token_logprobs": lps.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                       "top_logprobs": tops, "text_offset": offsets})
            }
            Endpoint::Chat => {
                let entry = |id: u32, lp: f32| {
                    let (name, bytes) = named(id);
                    json!({"token": name, "logprob": lp, "bytes": bytes})
                };
                let content: Vec<Value> = lps
                    .iter()
                    .map(|t| {
                        let mut v = entry(t.token, t.logprob);
                        v["top_logprobs"] = t.top.iter().map(|&(id, lp)| entry(id, lp)).collect::<Vec<_>>().into();
                        v
                    })
                    .collect();
                json!({"content": content, "refusal": null})
            }
        }
    }
}

/// Where each token of a completion starts in its text, in characters (a completion's `text_offset`):
/// the characters the text has before the token's bytes, a character that the token ends (a
/// byte-fallback token's, or a byte-level one's) counted from the token that began it.
#[derive(Debug, Default)]
struct TextOffset {
    /// Characters of the text before the bytes still pending.
    chars: usize,
    /// Bytes of the tokens since the last whole character, held back as `TextStream` holds them.
    pending: Pending,
}

impl TextOffset {
    /// Token `id`'s offset; then its bytes join the text.
    fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> usize {
        let at = self.chars;
        let bytes = tokenizer.piece_bytes(id, true).unwrap_or_else(|| tokenizer.decode(&[id], true).into_bytes());
        if let Some(text) = self.pending.push(&bytes) {
            self.chars += text.chars().count();
        }
        at
    }
}

/// A request's body, at most [`MAX_BODY`] bytes of JSON: a declared length over that is refused before
/// a byte is read, a longer one as it grows past it (413, and the connection closed: a client still
/// sending would otherwise never read the answer), another content type (415: a browser sends
/// `text/plain` across origins without asking, so any page could use a server without a key), one that
/// pauses [`BODY_WAIT`] or takes [`BODY_TOTAL`] (408), one the server's drain overtakes (503), and one
/// the connection broke off or garbled (a chunk size that is no number, fewer bytes than declared) as
/// what it is (400).
async fn read_body(app: &App, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    if let Some(kind) = headers.get(axum::http::header::CONTENT_TYPE) {
        let text = String::from_utf8_lossy(kind.as_bytes());
        let media = text.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
        if media != "application/json" && !media.ends_with("+json") {
            let e = ApiError::invalid("content-type", "application/json (or none)", format_args!("{text:?}"));
            return Err(ApiError { status: StatusCode::UNSUPPORTED_MEDIA_TYPE, ..e });
        }
    }
    let too_large = |found: String| ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        close: true,
        ..ApiError::invalid("body", format_args!("at most {} MiB of JSON", MAX_BODY >> 20), found)
    };
    let declared = headers.get("content-length").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if let Some(n) = declared.filter(|&n| n > MAX_BODY as u64) {
        return Err(too_large(format!("{n} bytes")));
    }
    let timeout = |expected: String, read: usize, then: &str| ApiError {
        status: StatusCode::REQUEST_TIMEOUT,
        code: Some("request_timeout"),
        ..ApiError::invalid("body", expected, format_args!("{read} bytes, {then}"))
    };
    let mut stream = body.into_data_stream();
    let mut read = Vec::with_capacity(declared.unwrap_or(0) as usize);
    let (started, mut last) = (Instant::now(), Instant::now());
    loop {
        // A second at a time, so that a pause, the whole body's deadline and a drain are all noticed.
        let next = tokio::time::timeout(Duration::from_secs(1), stream.next()).await;
        if let Some(e) = app.unavailable() {
            return Err(e);
        }
        if started.elapsed() >= BODY_TOTAL {
            let expected = format!("the whole body within {} s", BODY_TOTAL.as_secs());
            return Err(timeout(expected, read.len(), "and more to come"));
        }
        let Ok(next) = next else {
            if last.elapsed() >= BODY_WAIT {
                let expected = format!("the rest of the body within {} s", BODY_WAIT.as_secs());
                return Err(timeout(expected, read.len(), "then nothing"));
            }
            continue;
        };
        last = Instant::now();
        let Some(chunk) = next else { break };
        let chunk = chunk.map_err(|e| {
            // hyper's words and their cause: "error reading a body from connection: end of file before
            // message length reached".
            let mut why = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                why = format!("{why}: {s}");
                source = s.source();
            }
            let found = request::shorten_to(&format!("a broken one after {} bytes ({why})", read.len()), 240);
            ApiError::bad_request("body", format!("body: expected a whole HTTP body, found {found}"))
        })?;
        if read.len() + chunk.len() > MAX_BODY {
            return Err(too_large("more".to_string()));
        }
        read.extend_from_slice(&chunk);
    }
    Ok(read.into())
}

/// `POST /tokenize` (vLLM's): a prompt's ids, or a conversation's as its chat completion would see
/// them, with their count and the server's context; nothing is queued. It answers while the model
/// loads too: the tokenizer is ready first.
async fn tokenize(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let answer = async {
        app.authorize(&headers)?;
        let t = Tokenize::parse(&read_body(&app, &headers, body).await?)?;
        app.check_model(t.model.as_deref())?;
        let chat = app.chat_for(matches!(t.input, Prompt::Messages(_)))?;
        let tokenizer = Arc::clone(&app.tokenizer);
        let t = tokio::task::spawn_blocking(move || {
            // The special tokens the model's tokenizer adds: BOS, where it adds one.
            let specials = t.add_special_tokens && tokenizer.add_bos();
            let ids = match &t.input {
                Prompt::Messages(messages) => {
                    let text = chat
                        .expect("checked above")
                        .render_turn(messages, t.turn)
                        .map_err(|e| ApiError::refused_messages(&e))?;
                    tokenizer.encode(&text, specials)
                }
                Prompt::Text(text) => tokenizer.encode(text, specials),
                Prompt::Ids(ids) => ids.clone(),
            };
            let strs = t
                .return_token_strs
                .then(|| ids.iter().map(|&id| tokenizer.token_text(id).unwrap_or_default()).collect::<Vec<_>>());
            Ok::<_, ApiError>((ids, strs))
        });
        let (ids, strs) = t.await.map_err(tokenizer_failed)??;
        Ok::<_, ApiError>(Json(json!({
            "count": ids.len(), "max_model_len": app.config.limits.context, "tokens": ids, "token_strs": strs,
        })))
    };
    answer.await.map_or_else(|e| refused(&app, e), IntoResponse::into_response)
}

/// The answer for a tokenizing thread that panicked.
fn tokenizer_failed(e: tokio::task::JoinError) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "tokenizer", e.to_string())
}

/// `POST /detokenize` (vLLM's): the text of token ids, special tokens' text included.
async fn detokenize(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let answer = async {
        app.authorize(&headers)?;
        let d = Detokenize::parse(&read_body(&app, &headers, body).await?, app.config.limits.vocab)?;
        app.check_model(d.model.as_deref())?;
        let tokenizer = Arc::clone(&app.tokenizer);
        let text =
            tokio::task::spawn_blocking(move || tokenizer.decode(&d.tokens, false)).await.map_err(tokenizer_failed)?;
        Ok::<_, ApiError>(Json(json!({ "prompt": text })))
    };
    answer.await.map_or_else(|e| refused(&app, e), IntoResponse::into_response)
}

async fn completion(app: Arc<App>, headers: HeaderMap, body: Body, endpoint: Endpoint) -> Result<Response, ApiError> {
    app.authorize(&headers)?;
    if let Some(e) = app.unavailable() {
        return Err(e);
    }
    let in_flight = InFlight::new(&app);
    let body = read_body(&app, &headers, body).await?;
    // Parsing and tokenizing a few MiB takes a while: a few bodies at a time ([`App::intake`]), and not
    // on the async threads, which carry every stream's tokens.
    let intake = app.intake.acquire().await.expect("the semaphore is never closed");
    let mut c = tokio::task::spawn_blocking(move || match endpoint {
        Endpoint::Text => Completion::parse(&body),
        Endpoint::Chat => Completion::parse_chat(&body),
    })
    .await
    .map_err(tokenizer_failed)??;
    let chat = app.chat_for(endpoint == Endpoint::Chat)?;
    app.check_model(c.model.as_deref())?;
    let tokenizer = Arc::clone(&app.tokenizer);
    let prompts = std::mem::take(&mut c.prompts);
    let turn = c.turn;
    let prompts = tokio::task::spawn_blocking(move || {
        let tokenized = prompts.into_iter().map(|prompt| match prompt {
            Prompt::Ids(ids) => Ok(ids),
            Prompt::Text(text) => Ok(tokenizer.encode(&text, tokenizer.add_bos())),
            Prompt::Messages(messages) => chat
                .as_ref()
                .expect("checked above")
                .encode(&tokenizer, &messages, turn)
                .map_err(|e| ApiError::refused_messages(&e)),
        });
        tokenized.collect::<Result<Vec<Vec<u32>>, ApiError>>()
    })
    .await
    .map_err(tokenizer_failed)??;
    drop(intake);
    let choices = prompts.len() * c.n;
    if choices > app.config.queue {
        let param = if prompts.len() > 1 { "prompt" } else { "n" };
        return Err(ApiError::invalid(
            param,
            format_args!("at most {} choices a request (the server's --queue)", app.config.queue),
            format_args!("{} prompt(s) times n {}", prompts.len(), c.n),
        ));
    }
    // Each prompt's choices, checked as requests of their own: the same prompt, seeds counted up.
    c.raw.prefill_chunk = app.config.prefill_chunk as u64;
    let seed = c.raw.sampling.seed;
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let mut requests = Vec::with_capacity(choices);
    let batch = prompts.len() > 1;
    for (i, ids) in prompts.into_iter().enumerate() {
        c.raw.prompt = ids;
        if c.to_context {
            // A reply of at least one token, so that a conversation that fills the context is refused
            // naming its length, not a `max_tokens` the client never sent.
            let context = app.config.limits.context as u64;
            let room = context.saturating_sub(c.raw.prompt.len() as u64);
            if room == 0 {
                return Err(ApiError::invalid(
                    "messages",
                    format!("a conversation shorter than the {context}-token context (room for a reply)"),
                    format_args!("{} tokens", c.raw.prompt.len()),
                ));
            }
            c.raw.max_tokens = room;
        }
        for j in 0..c.n {
            c.raw.sampling.seed = seed.wrapping_add(j as u64);
            let checked = request::check_request(&c.raw, &app.config.limits).map_err(|mut e| {
                if e.field == request::Field::MaxTokens {
                    e.field = c.limit_field;
                }
                let mut e = ApiError::from(e);
                if batch {
                    e.message.push_str(&format!(" (prompt {i})"));
                }
                e
            })?;
            requests.push(checked);
        }
    }
    let id = app.next_id.fetch_add(choices as u64, Ordering::Relaxed);
    if !c.ignored.is_empty() {
        tracing::warn!(id, "request fields ignored (no field of this server reads them): {}", c.ignored.join(", "));
    }
    if !app.engine.enqueue(app.config.queue, choices) {
        let why = format!("queue: expected at most {} waiting requests, found it full", app.config.queue);
        let mut e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "queue_full", why);
        e.retry_after = Some(1);
        return Err(e);
    }
    // Each choice is a job of its own, its events merged here by choice index.
    let mut events = StreamMap::new();
    let accepted = std::time::Instant::now();
    for (i, request) in requests.into_iter().enumerate() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        // A prompt's later choices copy its first one's prefill where they can.
        let follows = (i % c.n != 0).then(|| id + (i - i % c.n) as u64);
        let job = Job { id: id + i as u64, request, stop: c.stop.clone(), events: tx, accepted, follows };
        if app.jobs.try_send(job).is_err() {
            // Disconnected (the channel is unbounded): the engine thread is gone. The places of the
            // jobs not sent are given back (the engine never saw them).
            for _ in i..choices {
                app.engine.unqueue();
            }
            let mut e = ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "engine_stopped",
                "the engine has stopped",
            );
            e.retry_after = Some(1);
            return Err(e);
        }
        events.insert(i, tokio_stream::wrappers::UnboundedReceiverStream::new(rx));
    }
    let cmpl = endpoint.id(&app.id_prefix, id);
    // OpenAI's header, which its clients keep as the request's id.
    let request_id = axum::http::HeaderValue::from_str(&cmpl).ok();
    let with_id = |mut response: Response| {
        if let Some(v) = request_id.clone() {
            response.headers_mut().insert("x-request-id", v);
        }
        response
    };
    let created = unix_now();
    let model = app.config.model.clone();
    let wants_logprobs = c.raw.logprobs.is_some();
    let tokenizer = Arc::clone(&app.tokenizer);
    // The `pdhost` object of the answer, naming the body's fields that nothing read.
    let ignored = std::mem::take(&mut c.ignored);
    let pdhost = move |mut pdhost: Value| {
        if !ignored.is_empty() {
            pdhost["ignored_fields"] = json!(ignored);
        }
        pdhost
    };
    let engine_stopped = "the engine stopped before this request finished";
    if !c.stream {
        let mut answers: Vec<(String, Vec<TokenLogprob>, Option<worker::Done>)> =
            (0..choices).map(|_| Default::default()).collect();
        while let Some((i, event)) = events.next().await {
            match event {
                Event::Text(t, lps) => {
                    answers[i].0.push_str(&t);
                    answers[i].1.extend(lps);
                }
                Event::Done(done) => answers[i].2 = Some(done),
                Event::Failed(message) => {
                    // The engine counted it (`failed`); a refusal's count is for what the handler
                    // refuses. The other choices are cancelled as `events` drops.
                    let e =
                        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "generation_failed", message);
                    return Ok(e.into_response());
                }
            }
        }
        let (mut list, mut objects, mut completion_tokens) = (Vec::new(), Vec::new(), 0);
        for (i, (text, logprobs, done)) in answers.into_iter().enumerate() {
            // Every stream ended without its end: the engine stopped (a drain past `--drain-timeout`).
            let done = done.ok_or_else(|| {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "engine_stopped", engine_stopped)
            })?;
            let logprobs = if wants_logprobs {
                endpoint.logprobs(&tokenizer, &logprobs, &mut TextOffset::default())
            } else {
                Value::Null
            };
            list.push(endpoint.choice(i, &text, done.finish, logprobs));
            objects.push(done.pdhost);
            completion_tokens += done.completion_tokens;
        }
        // One choice's own object, or each choice's under `choices`.
        let object = if objects.len() == 1 { objects.remove(0) } else { json!({ "choices": objects }) };
        let body = json!({
            "id": cmpl, "object": endpoint.object(false), "created": created, "model": model,
            "choices": list, "usage": usage(prompt_tokens, completion_tokens), "pdhost": pdhost(object),
        });
        return Ok(with_id(Json(body).into_response()));
    }
    // Streaming: a task turns engine events into SSE chunks. When the client goes away, the SSE stream
    // and its channel are dropped; the task sees that at once (queued or prefilling, with nothing sent
    // yet, as well as mid-stream), drops `events`, and the engine cancels the request's jobs.
    let (sse_tx, sse_rx) = tokio::sync::mpsc::channel::<Result<SseEvent, Infallible>>(64);
    let include_usage = c.include_usage;
    tokio::spawn(async move {
        let _in_flight = in_flight;
        // Per choice: whether no text was sent yet (a chat stream's first chunk says the role), where
        // its text stands (logprobs' offsets), and whether it ended.
        let mut state: Vec<(bool, TextOffset, bool)> =
            (0..choices).map(|_| (true, TextOffset::default(), false)).collect();
        let mut completion_tokens = 0;
        let mut head = json!({"id": cmpl, "object": endpoint.object(true), "created": created, "model": model});
        if include_usage {
            // OpenAI's: every chunk carries `usage`, null but in the last.
            head["usage"] = Value::Null;
        }
        let chunk = |choice: Value| {
            let mut v = head.clone();
            v["choices"] = json!([choice]);
            v
        };
        let sse = |v: Value| Ok(SseEvent::default().data(v.to_string()));
        let done_event = || Ok(SseEvent::default().data("[DONE]"));
        loop {
            let event = tokio::select! {
                event = events.next() => event,
                () = sse_tx.closed() => break,
            };
            let Some((i, event)) = event else {
                if state.iter().any(|s| !s.2) {
                    // The engine dropped a job without an answer (it stopped: a drain past
                    // `--drain-timeout`): the client is told, as a non-streaming request is, not left
                    // with a stream that ends as if complete.
                    let _ = sse_tx.send(Ok(error_event("engine_stopped", engine_stopped))).await;
                } else if include_usage {
                    let mut last = head.clone();
                    last["choices"] = json!([]);
                    last["usage"] = usage(prompt_tokens, completion_tokens);
                    let _ = sse_tx.send(sse(last)).await;
                }
                let _ = sse_tx.send(done_event()).await;
                break;
            };
            let (first, offset, ended) = &mut state[i];
            let sent = match event {
                Event::Text(t, lps) => {
                    let logprobs =
                        if wants_logprobs { endpoint.logprobs(&tokenizer, &lps, offset) } else { Value::Null };
                    sse_tx.send(sse(chunk(endpoint.delta(i, &t, std::mem::take(first), None, logprobs)))).await
                }
                Event::Done(done) => {
                    if *first && endpoint == Endpoint::Chat {
                        // No text came (EOS or a stop string first): the role is still said once.
                        let _ = sse_tx.send(sse(chunk(endpoint.delta(i, "", true, None, Value::Null)))).await;
                    }
                    *ended = true;
                    completion_tokens += done.completion_tokens;
                    let mut last = chunk(endpoint.delta(i, "", false, Some(done.finish), Value::Null));
                    last["pdhost"] = pdhost(done.pdhost);
                    sse_tx.send(sse(last)).await
                }
                Event::Failed(message) => {
                    let _ = sse_tx.send(Ok(error_event("generation_failed", &message))).await;
                    let _ = sse_tx.send(done_event()).await;
                    break;
                }
            };
            if sent.is_err() {
                break;
            }
        }
    });
    let sse = Sse::new(tokio_stream::wrappers::ReceiverStream::new(sse_rx)).keep_alive(KeepAlive::default());
    Ok(with_id(sse.into_response()))
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// An SSE event carrying an OpenAI-style server error, for a stream that cannot go on.
fn error_event(code: &'static str, message: &str) -> SseEvent {
    let e = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", code, message);
    SseEvent::default().data(e.body().to_string())
}
