//! `pdhost serve`.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use pdhost::engine::Engine;
use pdhost::request::input;
use pdhost::request::{self, Field, Limits};
use pdhost::server::worker::Loaded;
use pdhost::server::{ServeConfig, Server};
use pdhost::supervisor::RestartPolicy;

use super::generate::{chunking, Opened};
use crate::cli::{ServeArgs, Switch};

/// The context a server gives each request unless told otherwise (the incident's deployment).
const DEFAULT_CONTEXT: u64 = 9216;

/// The longest `--batch-wait`, in milliseconds.
pub const MAX_BATCH_WAIT_MS: u64 = 1000;

/// The most requests that may wait.
const MAX_QUEUE: u64 = 4096;

/// The most sequences live at once.
const MAX_SLOTS: u64 = 64;
/// Producer processes at most.
const MAX_PRODUCERS: u64 = 8;
/// Restarts per producer per minute at most.
const MAX_RESTARTS: u64 = 1000;

pub fn run(args: &ServeArgs) -> anyhow::Result<ExitCode> {
    // Everything that needs no model first.
    let threads = request::check_threads(args.threads)?;
    let timeout = request::check_timeout(Field::ProducerTimeout, args.producer_timeout)?;
    let drain_timeout = request::check_timeout(Field::DrainTimeout, args.drain_timeout)?;
    let queue = request::check_count(Field::Queue, args.queue, 1, MAX_QUEUE)? as usize;
    let batch_wait = std::time::Duration::from_millis(request::check_count(
        Field::BatchWait,
        args.batch_wait,
        0,
        MAX_BATCH_WAIT_MS,
    )?);
    let slots = request::check_count(Field::Slots, args.slots, 1, MAX_SLOTS)? as u32;
    let backend_config = input::check_backend_config(args.backend_config.as_deref(), &args.producer)?;
    let (backends, count) = producer_processes(&args.producer, args.producers)?;
    let max_restarts = request::check_count(Field::MaxRestarts, args.max_restarts, 0, MAX_RESTARTS)? as u32;
    let source = input::model_source(&args.model)?;
    let choice = super::producer::Choice {
        field: Field::Producer,
        producer: backends[0],
        backend_config,
        precision: args.precision,
        threads,
        timeout,
        sandbox: args.sandbox == Switch::On,
        memory_limit: super::producer::memory_limit(args.producer_memory)?,
        restart: RestartPolicy { max_restarts, ..RestartPolicy::default() },
    };
    // Each backend found once, before the model is fetched.
    let chosen = backends
        .iter()
        .map(|&producer| {
            let choice = super::producer::Choice { producer, ..choice.clone() };
            choice.backend().map(|backend| (choice, backend))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;

    let mut opened = Opened::open(&source, true)?;
    let context = args.context.unwrap_or(DEFAULT_CONTEXT.min(opened.config.context as u64));
    let limits = Limits::serving(&opened.name, &opened.config, context)?;
    let page_size = request::check_page_size(args.page_size, &limits)?;
    let dtype = args.kv_dtype.dtype();
    let prefix_cache = args.prefix_cache == crate::cli::Switch::On;
    let geometry = opened.config.kv_geometry();
    let max_len = limits.context as u64;
    let budget = request::kv_budget(&geometry, dtype, page_size, max_len, slots)
        .context("the KV cache's size does not fit in 64 bits")?;
    // Named by the flag the user gave: a default context is not what they would change.
    request::check_memory(
        if args.context.is_some() { Field::Context } else { Field::Slots },
        &format!("the KV cache for --slots {slots} x --context {max_len} tokens in {}", dtype.name()),
        budget,
    )?;
    let tokenizer = Arc::new(opened.tokenizer.take().ok_or_else(|| {
        request::Invalid::new(Field::Model, "a model with a tokenizer (requests carry text)", &opened.name)
    })?);
    // Spans from producers, and pieces the host prefills between decode rounds.
    if let Some(given) = args.prefill_chunk {
        request::check_count(Field::PrefillChunk, given, 0, max_len)?;
    }
    let (prefill_chunk, local_piece) = chunking(args.prefill_chunk, max_len);
    let (prefill_chunk, local_piece) = (prefill_chunk as usize, local_piece as usize);
    let chunk_tokens = if prefill_chunk == 0 { max_len as usize } else { prefill_chunk };
    let mut producers = Vec::new();
    let identity = if backends == ["local"] { None } else { Some(opened.identity()?) };
    for i in 0..count as usize {
        let Some(identity) = &identity else { break };
        // The backends take the processes in turn.
        let (choice, backend) = &chosen[i % chosen.len()];
        if let Some(backend) = backend {
            producers.push(choice.producer(
                backend,
                &opened.path,
                &opened.config,
                identity,
                dtype,
                super::producer::Ring::double(chunk_tokens),
            )?);
        }
    }
    let on_failure = args.on_producer_failure.policy();
    let chat = match opened.chat_template() {
        Some(Ok(t)) => Some(Arc::new(t)),
        Some(Err(e)) => {
            tracing::warn!("no chat completions: {e}");
            None
        }
        None => None,
    };
    let config = ServeConfig {
        model: opened.name.clone(),
        limits,
        queue,
        api_key: args.api_key.clone(),
        drain_timeout,
        chat,
        // Without producers, every prefill is the host's.
        prefill_chunk: if identity.is_none() { local_piece } else { prefill_chunk },
        allowed_origins: args.allowed_origins.clone(),
    };
    let addr = SocketAddr::new(args.host, args.port);
    let precision = args.precision.precision();

    // One thread runs the HTTP side, as one event loop does vLLM's API server: a request's work there is
    // parsing and a channel send per token, and the cores belong to the decode threads and the producers.
    // With two, each streamed token could wake the second, which then took a core from a decode step
    // whose other thread waited on it (`bench serve`, 128 in and out, decode at concurrency 4 in four
    // runs each, alternating, on the 2-core Zen 5: a mean of 180 -> 194 tokens/s whole, 176 -> 188
    // streamed).
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_keep_alive(pdhost::server::BLOCKING_KEEP_ALIVE)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        // Listened for from here, so that SIGTERM or SIGINT while the model loads ends the server as a
        // drain does (exit 0), not by the signal's default action.
        let mut stop = Stop::new();
        let (printed_tx, printed_rx) = std::sync::mpsc::channel::<SocketAddr>();
        let start: pdhost::server::worker::Start = Box::new(move || {
            let mut model = opened.load(true)?;
            model.configure(precision, threads);
            let mut engine = Engine::new(model, dtype, page_size, max_len, slots)?;
            // Each piece of a prefill that fell back to the host runs between two decode rounds, so it
            // bounds how long the live streams wait.
            engine.set_local_piece(local_piece);
            if prefix_cache {
                engine.kv.enable_prefix_cache();
            }
            let on_ready = Box::new(move || {
                if let Ok(addr) = printed_rx.recv() {
                    super::outln!("listening on http://{addr}").ok();
                }
            });
            Ok(Loaded {
                engine,
                producers,
                on_failure,
                slots: slots as usize,
                batch_tokens: chunk_tokens,
                batch_wait,
                on_ready,
            })
        });
        let server = Server::bind(addr, config, tokenizer, start)
            .await
            .with_context(|| format!("--host/--port: cannot listen on {addr}"))?;
        let local = server.local_addr()?;
        let _ = printed_tx.send(local);
        // Served from now on, `/health` answering 503 until the engine is ready; a signal before then ends
        // the process at once (there is nothing to drain), one after drains.
        let ready = server.ready();
        let (drain_tx, drain_rx) = tokio::sync::oneshot::channel::<()>();
        let mut running = tokio::spawn(server.run(async move {
            // Only a send drains: a sender dropped by the early return below leaves the task to be
            // dropped with the runtime (a drain would join the engine thread, still loading).
            if drain_rx.await.is_err() {
                std::future::pending::<()>().await;
            }
        }));
        tokio::select! {
            ready = ready => {
                if let Err(why) = ready {
                    anyhow::bail!("the engine did not start: {why}");
                }
            }
            () = stop.requested() => {
                tracing::info!("stopped before the engine was ready");
                return Ok(());
            }
        }
        tokio::select! {
            () = stop.requested() => {
                let _ = drain_tx.send(());
                running.await.context("the server's task")??;
            }
            // It ended by itself (its listener failed).
            ended = &mut running => ended.context("the server's task")??,
        }
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// The backends of `--producer`, and how many producer processes take them in turn (`--producers`: by
/// default one per backend).
pub(super) fn producer_processes(producer: &str, producers: Option<u64>) -> Result<(Vec<&str>, u64), request::Invalid> {
    let backends = backends(producer)?;
    let count = producers.unwrap_or(backends.len() as u64);
    let count = request::check_count(Field::Producers, count, backends.len() as u64, MAX_PRODUCERS)?;
    if backends == ["local"] && count > 1 {
        return Err(request::Invalid::new(
            Field::Producers,
            "1 with --producer local (prompts prefill in the server, between decode rounds)",
            count,
        ));
    }
    Ok((backends, count))
}

/// The backends of `--producer` (trimmed by the parser): one name, or several separated by commas (`local`
/// only alone).
fn backends(producer: &str) -> Result<Vec<&str>, request::Invalid> {
    let names: Vec<&str> = producer.split(',').collect();
    if names.iter().any(|n| n.is_empty()) {
        return Err(request::Invalid::new(
            Field::Producer,
            "backend names separated by commas, none of them empty",
            format_args!("{producer:?}"),
        ));
    }
    if names.len() as u64 > MAX_PRODUCERS {
        return Err(request::Invalid::new(
            Field::Producer,
            format!("at most {MAX_PRODUCERS} backends (one producer process each at least)"),
            format_args!("{} in {producer:?}", names.len()),
        ));
    }
    if names.len() > 1 && names.contains(&"local") {
        return Err(request::Invalid::new(
            Field::Producer,
            "one producer, or backends separated by commas (`local` alone)",
            format_args!("{producer:?}"),
        ));
    }
    Ok(names)
}

/// SIGTERM and SIGINT, caught from its creation on (inside the runtime).
struct Stop(Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>);

impl Stop {
    fn new() -> Self {
        use tokio::signal::unix::{signal, SignalKind};
        Stop(signal(SignalKind::terminate()).ok().zip(signal(SignalKind::interrupt()).ok()))
    }

    /// Until either signal arrives (for ever, where they could not be caught).
    async fn requested(&mut self) {
        let Some((term, int)) = &mut self.0 else {
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
}
