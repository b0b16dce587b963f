//! The server's Prometheus metrics (`GET /metrics`, text format 0.0.4). Names start with `pdhost_`; each is
//! listed in `docs/serving.md`.

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::kv::GroupUsage;
use crate::supervisor;

/// Every metric, registered once.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    /// Requests by how they ended: `ok`, `cancelled`, `failed`, or the refusal's code.
    pub requests: IntCounterVec,
    /// Prefills by where they ran (`remote`, `local`, `fallback`) and producer.
    pub prefills: IntCounterVec,
    /// Time to first token, seconds.
    pub ttft: Histogram,
    /// Time between consecutive tokens of a request, seconds.
    pub inter_token: Histogram,
    /// Request latency from acceptance to its last token, seconds.
    pub e2e: Histogram,
    /// Requests admitted: prefilling or generating.
    pub running: IntGauge,
    /// Requests waiting in the queue.
    pub waiting: IntGauge,
    /// KV pages by group (`0 (sliding window 512)`, `1 (full attention)`) and state (`used`, `free`, and `cached`: held only
    /// by the prefix cache).
    pub kv_pages: IntGaugeVec,
    /// K/V bytes committed by prefill.
    pub kv_bytes: IntCounter,
    /// Producer spans accepted.
    pub spans_accepted: IntCounter,
    /// Producer spans rejected, by kind.
    pub spans_rejected: IntCounterVec,
    /// Producer processes started / restarted.
    pub producer_starts: IntCounterVec,
    /// Prompt tokens of the requests that drew a first token (prefilled or found in the prefix cache).
    pub prompt_tokens: IntCounter,
    /// Tokens drawn, counted as they are.
    pub generation_tokens: IntCounter,
    /// Tokens of prompts found in the prefix cache.
    pub prefix_hit_tokens: IntCounter,
    /// Chunks per batch given to a producer.
    pub prefill_batch: Histogram,
    /// Per producer: its counters as last seen.
    seen: std::sync::Arc<std::sync::Mutex<Vec<supervisor::Metrics>>>,
    /// Per KV group: its `used`, `free` and `cached` gauges, looked up once (every decode round sets
    /// them, and a lookup by label hashes and formats).
    kv_gauges: std::sync::Arc<std::sync::Mutex<Vec<[IntGauge; 3]>>>,
}

fn seconds(name: &str, help: &str, start: f64) -> Histogram {
    let buckets = prometheus::exponential_buckets(start, 2.0, 16).expect("valid buckets");
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets)).expect("valid histogram")
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// A registry with every metric at zero.
    pub fn new() -> Self {
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
        };
        let m = Metrics {
            registry: Registry::new(),
            requests: counter_vec("pdhost_requests_total", "Requests by how they ended.", &["outcome"]),
            prefills: counter_vec("pdhost_prefills_total", "Prefills by where they ran.", &["where", "producer"]),
            ttft: seconds("pdhost_time_to_first_token_seconds", "Time to first token.", 0.001),
            inter_token: seconds("pdhost_inter_token_latency_seconds", "Time between tokens of a request.", 0.0005),
            e2e: seconds("pdhost_request_latency_seconds", "Time from acceptance to the last token.", 0.005),
            running: IntGauge::new("pdhost_requests_running", "Requests admitted: prefilling or generating.")
                .expect("valid"),
            waiting: IntGauge::new("pdhost_requests_waiting", "Requests waiting in the queue.").expect("valid"),
            kv_pages: IntGaugeVec::new(
                Opts::new("pdhost_kv_pages", "KV pages by group and state."),
                &["group", "state"],
            )
            .expect("valid"),
            kv_bytes: IntCounter::new("pdhost_kv_bytes_ingested_total", "K/V bytes committed by prefill.")
                .expect("valid"),
            spans_accepted: IntCounter::new("pdhost_spans_accepted_total", "Producer spans accepted.").expect("valid"),
            spans_rejected: counter_vec("pdhost_spans_rejected_total", "Producer spans rejected, by kind.", &["kind"]),
            producer_starts: counter_vec("pdhost_producer_starts_total", "Producer processes started.", &["kind"]),
            prompt_tokens: IntCounter::new(
                "pdhost_prompt_tokens_total",
                "Prompt tokens of requests that drew a first token.",
            )
            .expect("valid"),
            generation_tokens: IntCounter::new("pdhost_generation_tokens_total", "Tokens drawn.").expect("valid"),
            prefix_hit_tokens: IntCounter::new(
                "pdhost_prefix_cache_hit_tokens_total",
                "Prompt tokens found in the prefix cache.",
            )
            .expect("valid"),
            prefill_batch: Histogram::with_opts(
                HistogramOpts::new(
                    "pdhost_prefill_batch_calls",
                    "Chunks (of different requests) per batch given to a producer.",
                )
                .buckets(vec![1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0]),
            )
            .expect("valid histogram"),
            seen: Default::default(),
            kv_gauges: Default::default(),
        };
        // The outcomes every server has, at zero from the start: a `rate()` over a series that appears
        // only with its first request reads as no data, not as none.
        for outcome in ["ok", "cancelled", "failed"] {
            m.requests.with_label_values(&[outcome]);
        }
        let info = IntGauge::new("pdhost_info", "Always 1.").expect("valid");
        info.set(1);
        let all: [Box<dyn prometheus::core::Collector>; 17] = [
            Box::new(m.requests.clone()),
            Box::new(m.prefills.clone()),
            Box::new(m.ttft.clone()),
            Box::new(m.inter_token.clone()),
            Box::new(m.e2e.clone()),
            Box::new(m.running.clone()),
            Box::new(m.waiting.clone()),
            Box::new(m.kv_pages.clone()),
            Box::new(m.kv_bytes.clone()),
            Box::new(m.spans_accepted.clone()),
            Box::new(m.spans_rejected.clone()),
            Box::new(m.producer_starts.clone()),
            Box::new(m.prompt_tokens.clone()),
            Box::new(m.generation_tokens.clone()),
            Box::new(m.prefix_hit_tokens.clone()),
            Box::new(m.prefill_batch.clone()),
            Box::new(info),
        ];
        for c in all {
            m.registry.register(c).expect("unique names");
        }
        m
    }

    /// Sets the KV page gauges from the cache's accounting.
    pub fn kv_usage(&self, usage: &[GroupUsage]) {
        let mut gauges = self.kv_gauges.lock().unwrap_or_else(|e| e.into_inner());
        for (i, g) in usage.iter().enumerate().skip(gauges.len()) {
            let group = format!("{i} ({})", g.kind);
            gauges.push(
                ["used", "free", "cached"].map(|state| self.kv_pages.with_label_values(&[group.as_str(), state])),
            );
        }
        for (g, [used, free, cached]) in usage.iter().zip(gauges.iter()) {
            used.set(i64::from(g.used));
            free.set(i64::from(g.free));
            cached.set(i64::from(g.cached));
        }
    }

    /// Adds what a producer counted since the last call.
    pub fn producer(&self, index: usize, now: &supervisor::Metrics) {
        let mut all = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if all.len() <= index {
            all.resize_with(index + 1, Default::default);
        }
        let seen = &mut all[index];
        self.spans_accepted.inc_by(now.spans_accepted.saturating_sub(seen.spans_accepted));
        for (kind, &n) in &now.spans_rejected {
            let before = seen.spans_rejected.get(kind).copied().unwrap_or(0);
            self.spans_rejected.with_label_values(&[kind]).inc_by(n.saturating_sub(before));
        }
        let first = |m: &supervisor::Metrics| m.starts.saturating_sub(m.restarts);
        self.producer_starts.with_label_values(&["start"]).inc_by(first(now).saturating_sub(first(seen)));
        self.producer_starts.with_label_values(&["restart"]).inc_by(now.restarts.saturating_sub(seen.restarts));
        *seen = now.clone();
    }

    /// The text format.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}
