//! The engine thread: owns the engine, its KV cache and the producer, and runs accepted requests in
//! arrival order, streaming text back as it is generated.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use model::tokenizer::Tokenizer;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedSender;

use super::metrics::Metrics;
use crate::engine::{Engine, Finish, OnFailure, PrefillBy, Request};
use crate::supervisor::Producer;
use crate::text::TextStream;

/// What the engine thread builds before it serves: the slow part (weights, producer start), so it runs
/// there while `/health` says 503.
pub type Start = Box<dyn FnOnce() -> anyhow::Result<Loaded> + Send>;

/// An engine ready to serve, and how it prefills.
pub struct Loaded {
    /// The engine, its cache sized for one sequence of the context.
    pub engine: Engine,
    /// The producer that prefills, or `None` for local prefill.
    pub producer: Option<Producer>,
    /// What a failed remote prefill does.
    pub on_failure: OnFailure,
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
/// gone.
pub fn spawn(
    start: Start,
    queue: crossbeam_channel::Receiver<Job>,
    tokenizer: Arc<Tokenizer>,
    ready: Arc<AtomicBool>,
    metrics: Metrics,
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
        while let Ok(job) = queue.recv() {
            metrics.running.set(1);
            serve(&mut loaded, &tokenizer, &metrics, job);
            metrics.running.set(0);
            metrics.kv_usage(&loaded.engine.kv.usage());
            if let Some(p) = &loaded.producer {
                metrics.producer(p.metrics());
            }
        }
    })
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

fn serve(loaded: &mut Loaded, tokenizer: &Tokenizer, metrics: &Metrics, job: Job) {
    if job.events.is_closed() {
        tracing::info!(id = job.id, "cancelled while queued");
        metrics.requests.with_label_values(&["cancelled"]).inc();
        return;
    }
    let mut last_token: Option<Instant> = None;
    let t0 = Instant::now();
    let mut stream = TextStream::new(tokenizer);
    let mut sent = 0;
    let mut stopped_by_string = false;
    let mut cancelled = false;
    let events = &job.events;
    let by = match loaded.producer.as_mut() {
        Some(producer) => PrefillBy::Remote { producer, on_failure: loaded.on_failure },
        None => PrefillBy::Local,
    };
    let result = loaded.engine.generate_until(&job.request, by, |id| {
        let now = Instant::now();
        if let Some(t) = last_token.replace(now) {
            metrics.inter_token.observe((now - t).as_secs_f64());
        }
        stream.push(id);
        let text = stream.shown();
        let (end, stop) = safe_end(text, sent, &job.stop);
        if end > sent && events.send(Event::Text(text[sent..end].to_string())).is_err() {
            cancelled = true;
            return ControlFlow::Break(());
        }
        sent = end;
        if stop {
            stopped_by_string = true;
            return ControlFlow::Break(());
        }
        if events.is_closed() {
            cancelled = true;
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    });
    let elapsed = t0.elapsed();
    match result {
        Ok(gen) => {
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
                total_ms = format_args!("{:.1}", elapsed.as_secs_f64() * 1e3),
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
        Err(e) => {
            tracing::warn!(id = job.id, "failed: {e}");
            metrics.requests.with_label_values(&["failed"]).inc();
            let _ = events.send(Event::Failed(e.to_string()));
        }
    }
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
