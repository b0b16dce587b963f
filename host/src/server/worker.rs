//! The engine thread: owns the engine, its KV cache and the producer; admits accepted requests in arrival
//! order while a slot is free, steps every live one a token per round, and streams text back as it is
//! generated.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use model::tokenizer::Tokenizer;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedSender;

use super::metrics::Metrics;
use crate::engine::{Engine, Finish, Live, OnFailure, PrefillBy, Request};
use crate::supervisor::Producer;
use crate::text::TextStream;

/// What the engine thread builds before it serves: the slow part (weights, producer start), so it runs
/// there while `/health` says 503.
pub type Start = Box<dyn FnOnce() -> anyhow::Result<Loaded> + Send>;

/// An engine ready to serve, and how it prefills.
pub struct Loaded {
    /// The engine, its cache sized for `slots` sequences of the context.
    pub engine: Engine,
    /// The producer that prefills, or `None` for local prefill.
    pub producer: Option<Producer>,
    /// What a failed remote prefill does.
    pub on_failure: OnFailure,
    /// Sequences live at once (the engine's cache holds this many).
    pub slots: usize,
    /// Called once everything is up (the CLI prints `listening on ...`).
    pub on_ready: Box<dyn FnOnce() + Send>,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded").field("producer", &self.producer).field("on_failure", &self.on_failure).finish()
    }
}

/// One accepted request.
#[derive(Debug)]
pub struct Job {
    /// The server's id for it (logs).
    pub id: u64,
    /// The checked request.
    pub request: Request,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Where its text and its end go; closed when the client went away.
    pub events: UnboundedSender<Event>,
    /// When the server accepted it (end-to-end latency counts from here).
    pub accepted: Instant,
}

/// What a request hears from the engine.
#[derive(Debug)]
pub enum Event {
    /// New text.
    Text(String),
    /// The end.
    Done(Done),
    /// The request failed (its one-line reason).
    Failed(String),
}

/// How a request ended.
#[derive(Debug)]
pub struct Done {
    /// OpenAI's `finish_reason`: `stop` or `length`.
    pub finish: &'static str,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// The `pdhost` object of the response: where prefill ran and what it cost.
    pub pdhost: Value,
}

/// Starts the engine thread. It runs `start`, sets `ready`, then serves `queue` until every sender is
/// gone or `stop` is set.
pub fn spawn(
    start: Start,
    queue: crossbeam_channel::Receiver<Job>,
    tokenizer: Arc<Tokenizer>,
    ready: Arc<AtomicBool>,
    metrics: Metrics,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("pdhost-engine".into()).spawn(move || {
        let mut loaded = match start() {
            Ok(loaded) => loaded,
            Err(e) => {
                tracing::error!("loading failed: {e:#}");
                return;
            }
        };
        // The producer starts here, on this long-lived thread: its parent-death signal follows the thread
        // that spawned it.
        if let Some(p) = loaded.producer.as_mut() {
            if let Err(e) = p.start() {
                tracing::warn!(
                    "producer {} did not start ({}): {e}; requests fall back or fail per request",
                    p.name(),
                    e.kind()
                );
            }
        }
        metrics.kv_usage(&loaded.engine.kv.usage());
        if let Some(p) = &loaded.producer {
            metrics.producer(p.metrics());
        }
        ready.store(true, Ordering::Release);
        (std::mem::replace(&mut loaded.on_ready, Box::new(|| {})))();
        schedule(&mut loaded, &tokenizer, &metrics, &queue, &stop);
    })
}

/// Up to `slots` sequences live at once: admit from the queue (waiting only when nothing is live), then
/// one step of every live sequence in turn, so every stream advances a token per round. Each sequence
/// computes exactly what it would alone, whatever else is live.
fn schedule(
    loaded: &mut Loaded,
    tokenizer: &Tokenizer,
    metrics: &Metrics,
    queue: &crossbeam_channel::Receiver<Job>,
    stop: &AtomicBool,
) {
    let mut live: Vec<Running<'_>> = Vec::new();
    loop {
        // Past the drain timeout: whatever is still live ends here (its client is told by the closing
        // connection), and the thread returns, dropping the producer.
        if stop.load(Ordering::Acquire) {
            for r in live.drain(..) {
                let _ = loaded.engine.finish(r.live);
            }
            return;
        }
        while live.len() < loaded.slots {
            let job = if live.is_empty() {
                // Nothing live: wait for work, looking at `stop` now and then.
                match queue.recv_timeout(std::time::Duration::from_millis(100)) {
                    Ok(job) => job,
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) if !stop.load(Ordering::Acquire) => continue,
                    Err(_) => return,
                }
            } else {
                match queue.try_recv() {
                    Ok(job) => job,
                    Err(_) => break,
                }
            };
            if let Some(r) = admit(loaded, tokenizer, metrics, job) {
                live.push(r);
            }
            metrics.running.set(live.len() as i64);
        }
        let mut i = 0;
        while i < live.len() {
            match advance(loaded, metrics, &mut live[i]) {
                ControlFlow::Continue(()) => i += 1,
                ControlFlow::Break(()) => {
                    let r = live.swap_remove(i);
                    end(loaded, metrics, r);
                    metrics.running.set(live.len() as i64);
                }
            }
        }
        metrics.kv_usage(&loaded.engine.kv.usage());
        if let Some(p) = &loaded.producer {
            metrics.producer(p.metrics());
        }
    }
}

/// A live request: its engine sequence and its text so far.
struct Running<'t> {
    job: Job,
    live: Live,
    stream: TextStream<'t>,
    /// Bytes of text sent.
    sent: usize,
    last_token: Option<Instant>,
    stopped_by_string: bool,
    cancelled: bool,
    failed: Option<String>,
    admitted: Instant,
}

/// Prefills a request (by the producer, or locally) and makes it live; a failure answers it at once.
fn admit<'t>(loaded: &mut Loaded, tokenizer: &'t Tokenizer, metrics: &Metrics, job: Job) -> Option<Running<'t>> {
    if job.events.is_closed() {
        tracing::info!(id = job.id, "cancelled while queued");
        metrics.requests.with_label_values(&["cancelled"]).inc();
        return None;
    }
    let admitted = Instant::now();
    let by = match loaded.producer.as_mut() {
        Some(producer) => PrefillBy::Remote { producer, on_failure: loaded.on_failure },
        None => PrefillBy::Local,
    };
    match loaded.engine.admit(&job.request, by) {
        Ok(live) => Some(Running {
            job,
            live,
            stream: TextStream::new(tokenizer),
            sent: 0,
            last_token: None,
            stopped_by_string: false,
            cancelled: false,
            failed: None,
            admitted,
        }),
        Err(e) => {
            tracing::warn!(id = job.id, "failed: {e}");
            metrics.requests.with_label_values(&["failed"]).inc();
            let _ = job.events.send(Event::Failed(e.to_string()));
            None
        }
    }
}

/// One token of `r`, sent on as text; `Break` when it has ended (EOS, length, a stop string, its client
/// gone, an error).
fn advance(loaded: &mut Loaded, metrics: &Metrics, r: &mut Running<'_>) -> ControlFlow<()> {
    let id = match loaded.engine.step(&mut r.live) {
        Ok(Some(id)) => id,
        Ok(None) => return ControlFlow::Break(()),
        Err(e) => {
            r.failed = Some(e.to_string());
            return ControlFlow::Break(());
        }
    };
    let now = Instant::now();
    if let Some(t) = r.last_token.replace(now) {
        metrics.inter_token.observe((now - t).as_secs_f64());
    }
    r.stream.push(id);
    let text = r.stream.shown();
    let (end, stop) = safe_end(text, r.sent, &r.job.stop);
    if end > r.sent && r.job.events.send(Event::Text(text[r.sent..end].to_string())).is_err() {
        r.cancelled = true;
        return ControlFlow::Break(());
    }
    r.sent = end;
    if stop {
        r.stopped_by_string = true;
        return ControlFlow::Break(());
    }
    if r.job.events.is_closed() {
        r.cancelled = true;
        return ControlFlow::Break(());
    }
    if r.live.is_done() {
        return ControlFlow::Break(());
    }
    ControlFlow::Continue(())
}

/// Where the text may be sent up to: everything, or all but a tail that could still grow into a stop
/// string.
fn safe_end(text: &str, sent: usize, stop: &[String]) -> (usize, bool) {
    // A stop string anywhere in the unsent part (or straddling its start) ends the text there.
    let longest = stop.iter().map(String::len).max().unwrap_or(0);
    let mut from = sent.saturating_sub(longest);
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    if let Some(at) = stop.iter().filter_map(|s| text[from..].find(s.as_str()).map(|i| from + i)).min() {
        return (at.max(sent), true);
    }
    let mut end = text.len().saturating_sub(longest.saturating_sub(1)).max(sent);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    (end.max(sent), false)
}

/// Frees an ended request's pages and answers it (unless its client is gone).
fn end(loaded: &mut Loaded, metrics: &Metrics, r: Running<'_>) {
    let Running { job, live, stream, sent, stopped_by_string, cancelled, failed, admitted, .. } = r;
    let gen = loaded.engine.finish(live);
    let events = &job.events;
    if let Some(e) = failed {
        tracing::warn!(id = job.id, "failed: {e}");
        metrics.requests.with_label_values(&["failed"]).inc();
        let _ = events.send(Event::Failed(e));
        return;
    }
    if cancelled {
        tracing::info!(
            id = job.id,
            prompt = job.request.prompt.len(),
            output = gen.output.len(),
            "cancelled by its client"
        );
        metrics.requests.with_label_values(&["cancelled"]).inc();
        return;
    }
    // What is left once nothing can grow into a stop string any more.
    if !stopped_by_string {
        let text = stream.text();
        if text.len() > sent {
            let _ = events.send(Event::Text(text[sent..].to_string()));
        }
    }
    let finish = match gen.finish {
        Finish::Length => "length",
        Finish::Eos | Finish::Stopped => "stop",
    };
    let report = &gen.report;
    let where_ = if report.remote { "remote" } else { "local" };
    let decode_tps = gen.output.len().saturating_sub(1) as f64 / gen.decode.as_secs_f64().max(1e-9);
    tracing::info!(
        id = job.id,
        prompt = job.request.prompt.len(),
        output = gen.output.len(),
        prefill = where_,
        ttft_ms = format_args!("{:.1}", gen.ttft.as_secs_f64() * 1e3),
        tok_s = format_args!("{decode_tps:.1}"),
        finish,
        total_ms = format_args!("{:.1}", admitted.elapsed().as_secs_f64() * 1e3),
        "request"
    );
    let pdhost = json!({
        "prefill": where_,
        "producer": report.producer.as_deref().unwrap_or("local"),
        "layout": if report.remote { report.layout } else { None },
        "wire_dtype": report.wire_dtype.filter(|_| report.remote).map(|d| d.name()),
        "spans": gen.spans, "bytes": gen.bytes,
        "fallback_reason": report.fallback.as_ref().map(|e| format!("{}: {e}", e.kind())),
        "ttft_ms": gen.ttft.as_secs_f64() * 1e3,
        "logits_xxh3": format!("{:016x}", gen.logits_hash),
        "output_ids": gen.output,
    });
    let _ = events.send(Event::Done(Done { finish, completion_tokens: gen.output.len(), pdhost }));
    metrics.requests.with_label_values(&["ok"]).inc();
    let how = if report.fallback.is_some() { "fallback" } else { where_ };
    metrics.prefills.with_label_values(&[how, report.producer.as_deref().unwrap_or("local")]).inc();
    metrics.kv_bytes.inc_by(gen.bytes);
    metrics.ttft.observe(gen.ttft.as_secs_f64());
    metrics.e2e.observe(job.accepted.elapsed().as_secs_f64());
}

#[cfg(test)]
mod tests {
    use super::safe_end;

    #[test]
    fn text_is_held_back_only_while_it_could_become_a_stop_string() {
        let stop = vec!["\n\n".to_string(), "END".to_string()];
        assert_eq!(safe_end("hello", 0, &stop), (3, false));
        assert_eq!(safe_end("hello wor", 3, &stop), (7, false));
        assert_eq!(safe_end("hello\n\nmore", 3, &stop), (5, true));
        assert_eq!(safe_end("abEN", 2, &stop), (2, false));
        assert_eq!(safe_end("abEND", 2, &stop), (2, true));
        assert_eq!(safe_end("héllo", 0, &[]), (6, false));
        assert_eq!(safe_end("é", 0, &["xé".to_string()]), (0, false));
    }
}
