//! The engine: prefill, ingest into the paged KV cache, decode reading K/V back from it.
//!
//! Every K/V byte the decoder reads goes through [`PagedKv`]: local prefill and every decode step produce
//! a span (one tensor set per group) that is validated and committed like a producer's, and attention
//! reads exactly the positions each layer sees through [`PagedKv::read`].

use std::borrow::Cow;
use std::hash::Hasher;
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use model::arch::Model;
use model::forward::{ChunkKv, KvValues, PastKv, Run, Segment};
use shm_format::{Dtype, EntryKind, Manifest};
use zerocopy::FromBytes;

use crate::kv::convert::convert;
use crate::kv::{IngestError, KvConfig, PagedKv, Rounding, SeqId};
use crate::supervisor::{PrefillCall, Producer, ProducerError, SpanTimes};
pub use logprobs::{TokenLogprob, MAX_TOP_LOGPROBS};
pub use sampler::Penalties;
use sampler::{Held, Sampler};

mod logprobs;
mod sampler;

const _: () = assert!(cfg!(target_endian = "little"), "spans are little-endian; the engine writes f32s as they lie");

/// Who prefills a request.
#[derive(Debug)]
pub enum PrefillBy<'a> {
    /// The host itself.
    Local,
    /// A supervised producer; on failure, `on_failure` decides.
    Remote {
        /// The producer.
        producer: &'a mut Producer,
        /// What a failed remote prefill does to the request.
        on_failure: OnFailure,
    },
    /// The host, in place of the producer `name`, which could not start: `error` is reported as the
    /// fallback reason (as [`PrefillBy::Remote`] reports a failed prefill), so a request that follows a
    /// failed start is told that failure, not the backoff after it.
    Unavailable {
        /// The producer's name.
        name: String,
        /// Why it could not start.
        error: ProducerError,
    },
}

/// What a failed remote prefill does to the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnFailure {
    /// Prefill locally instead; the request is not lost, and the reason is reported.
    Fallback,
    /// Fail the request with the producer's typed error.
    Fail,
}

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The host's own span did not fit its cache (capacity, sequence limits).
    #[error(transparent)]
    Ingest(#[from] IngestError),
    /// Remote prefill failed under [`OnFailure::Fail`].
    #[error("remote prefill failed ({kind}): {0}", kind = .0.kind())]
    Producer(Box<ProducerError>),
}

impl From<ProducerError> for EngineError {
    fn from(e: ProducerError) -> Self {
        EngineError::Producer(Box::new(e))
    }
}

/// What a prefill did.
#[derive(Debug, Default)]
struct Prefilled {
    forward: Duration,
    ingest: Duration,
    bytes: u64,
    spans: usize,
    report: PrefillReport,
}

/// Who will prefill a request: the producers' name, and how their K/V come to be (their backend and wire
/// dtype) when it can start a request past position 0 (ABI 1.1), so that a prefix-cache hit may go remote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Remote {
    /// The producers' name.
    pub name: String,
    /// `Some(the backend's rounding)` when prefix-cache hits may be prefilled remotely; `None` when the
    /// backend is not known yet or cannot take a request's context (then remote requests never hit).
    pub hits: Option<Rounding>,
    /// The most tokens the backend takes in one call (its capabilities), when it says: remote prefills
    /// are chunked to it.
    pub max_tokens: Option<u64>,
}

impl Remote {
    /// What `producer` is, as far as it is known now.
    pub fn of(producer: &Producer) -> Self {
        let hits = producer
            .wire_dtype()
            .filter(|_| producer.takes_context() == Some(true))
            .map(|dtype| Rounding::backend(producer.name(), dtype));
        Remote { name: producer.name().to_string(), hits, max_tokens: producer.max_tokens() }
    }

    /// What producers that may each take any request are together (`--producer A,B`): hits only when
    /// every one of them takes a request's context and is one backend with one wire dtype (a hit's K/V
    /// are keyed by who computed them and how they were rounded, and the rest of the prompt must come to
    /// be the same way, whichever producer takes it), chunks no longer than the smallest `max_tokens`,
    /// and their distinct names joined by commas. `None` when there are none.
    pub fn together(each: &[Remote]) -> Option<Remote> {
        let first = each.first()?;
        let hits = first.hits.filter(|&d| each.iter().all(|r| r.hits == Some(d)));
        let max_tokens = each.iter().filter_map(|r| r.max_tokens).min();
        let mut names: Vec<&str> = Vec::new();
        for r in each {
            if !names.contains(&r.name.as_str()) {
                names.push(&r.name);
            }
        }
        Some(Remote { name: names.join(","), hits, max_tokens })
    }
}

/// A prompt (less its last token, which the host runs) being prefilled into its sequence, chunk by
/// chunk: see [`Engine::begin`].
#[derive(Debug)]
pub struct Prefilling {
    seq: SeqId,
    request_id: u64,
    /// Tokens to prefill.
    len: usize,
    chunk: usize,
    /// The chunk as planned, before a backend's `max_tokens` cut it: what a fallback prefills in.
    planned: usize,
    /// Tokens prefilled, counting a prefix-cache hit.
    done: usize,
    /// Tokens shared from the prefix cache (the first chunk starts there).
    hit: usize,
    /// How the K/V of this prompt come to be (the backend's and its wire dtype, or the host's and the
    /// cache's when local): how the prefix cache keys its blocks. `None`: not looked up, not registered.
    rounding: Option<Rounding>,
    /// Whether the chunks so far came from the producer.
    remote: bool,
    prefilled: Prefilled,
    started: Instant,
}

impl Prefilling {
    fn new(seq: SeqId, request_id: u64, len: usize, chunk: usize, producer: Option<&str>) -> Self {
        // At most the whole prompt: a backend's `max_tokens` may be any u64, and `done + chunk` must not wrap.
        let chunk = if chunk == 0 { len.max(1) } else { chunk.min(len.max(1)) };
        let mut prefilled = Prefilled::default();
        // Nothing to prefill (a one-token prompt): no producer is asked, and none is named.
        prefilled.report.producer = producer.filter(|_| len > 0).map(str::to_string);
        let remote = producer.is_some() && len > 0;
        Prefilling {
            seq,
            request_id,
            len,
            chunk,
            planned: chunk,
            done: 0,
            hit: 0,
            rounding: None,
            remote,
            prefilled,
            started: Instant::now(),
        }
    }

    /// The next chunk as a producer call: the request's context rides along on the first chunk of a
    /// prefix-cache hit.
    pub fn next_call(&self, prompt: &[u32]) -> Option<PrefillCall> {
        let (start, tokens) = self.next_chunk(prompt)?;
        let context = if self.done == self.hit { prompt[..self.hit].to_vec() } else { Vec::new() };
        Some(PrefillCall { request_id: self.request_id, start_pos: start, tokens: tokens.to_vec(), context })
    }

    /// K/V bytes its prefill has committed so far.
    pub fn bytes(&self) -> u64 {
        self.prefilled.bytes
    }

    /// The request id its spans must carry.
    pub fn request_id(&self) -> u64 {
        self.request_id
    }

    /// Its sequence.
    pub fn seq(&self) -> SeqId {
        self.seq
    }

    /// Whether the next chunk goes to the producer (it has not failed, and a producer was given).
    pub fn is_remote(&self) -> bool {
        self.remote
    }

    /// The next chunk of `prompt` (the request's prompt, or just its head) to prefill: its first position
    /// and tokens; `None` when the prefill is complete.
    pub fn next_chunk<'p>(&self, prompt: &'p [u32]) -> Option<(u64, &'p [u32])> {
        (self.done < self.len).then(|| (self.done as u64, &prompt[self.done..(self.done + self.chunk).min(self.len)]))
    }

    /// Prefills the rest in pieces of at most `tokens` (0: as it was chunked). A prefill that fell back to
    /// the host runs between decode rounds, and every live stream waits for each piece; the bits are the
    /// same at any size.
    pub fn in_pieces_of(&mut self, tokens: usize) {
        if tokens > 0 {
            self.chunk = self.chunk.min(tokens);
            self.planned = self.planned.min(tokens);
        }
    }

    /// A remote chunk landed in the cache, costing `times`. A span shorter than the chunk asked for (the
    /// backend's `max_tokens`, learnt when its process started) makes the rest's chunks as short.
    pub fn remote_done(&mut self, times: SpanTimes) {
        let span = usize::try_from(times.tokens).unwrap_or(usize::MAX).min(self.len - self.done);
        if span < self.chunk && self.done + span < self.len {
            self.chunk = span.max(1);
        }
        self.done += span;
        let t = &mut self.prefilled.report.remote_times;
        t.backend += times.backend;
        t.frame += times.frame;
        t.take += times.take;
        t.round_trip += times.round_trip;
        t.bytes += times.bytes;
        t.tokens += times.tokens;
        self.prefilled.spans += 1;
        if self.done == self.len {
            let t = *t;
            self.prefilled.report.remote = true;
            (self.prefilled.forward, self.prefilled.ingest, self.prefilled.bytes) =
                (t.round_trip.saturating_sub(t.take), t.take, t.bytes);
        }
    }

    /// The reason a remote chunk failed, taken out of the report (when the request fails rather than
    /// falling back).
    pub fn take_fallback(&mut self) -> Option<ProducerError> {
        self.prefilled.report.fallback.take()
    }

    /// Notes which producer answered its last call (of several that might have), for the report.
    pub fn asked(&mut self, producer: &Producer) {
        self.prefilled.report.producer = Some(producer.name().to_string());
    }

    /// Notes the producer's layout, wire dtype and transport for the report.
    pub fn remote_by(&mut self, producer: &Producer) {
        self.prefilled.report.layout = producer.layout();
        self.prefilled.report.wire_dtype = producer.wire_dtype();
        self.prefilled.report.transport = producer.described().and_then(|d| d.transport.clone());
    }
}

/// How the prompt was prefilled.
#[derive(Debug, Default)]
pub struct PrefillReport {
    /// Whether the producer's spans are what the cache holds.
    pub remote: bool,
    /// Prompt tokens shared from the prefix cache (not prefilled).
    pub prefix_hit: u64,
    /// The producer's name, if one was asked.
    pub producer: Option<String>,
    /// `dense` or `grouped`: the producer's layout.
    pub layout: Option<&'static str>,
    /// The element type of the producer's spans.
    pub wire_dtype: Option<Dtype>,
    /// The UCX transport a producer on another machine sent its spans by (`tcp/lo`), as its node
    /// reported it.
    pub transport: Option<String>,
    /// Why the producer's prefill was replaced by a local one.
    pub fallback: Option<ProducerError>,
    /// Remote costs, summed over the spans.
    pub remote_times: SpanTimes,
}

/// How to sample.
#[derive(Clone, Copy, Debug)]
pub enum Sampling {
    /// Argmax, first index on ties.
    Greedy,
    /// Temperature sampling from a seeded generator, among the tokens that the top-k, min-p and nucleus
    /// (top-p) filters keep, applied in that order.
    Sample {
        /// Softmax temperature.
        temperature: f32,
        /// Only the `top_k` most likely tokens (0: no limit).
        top_k: u32,
        /// Only tokens at least `min_p` times as likely as the most likely one (0: no limit).
        min_p: f32,
        /// Nucleus mass (1: every token).
        top_p: f32,
        /// Seed.
        seed: u64,
    },
}

/// A generation request.
#[derive(Clone, Debug)]
pub struct Request {
    /// Prompt token ids (BOS included if wanted).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Prompt tokens per prefill span (0: the whole prompt in one span).
    pub prefill_chunk: usize,
    /// How to pick tokens.
    pub sampling: Sampling,
    /// What changes the logits before a token is picked.
    pub penalties: Penalties,
    /// Whether to report each generated token's log-probability ([`TokenLogprob`]), and then with how
    /// many of the most likely tokens at each step (0 to [`MAX_TOP_LOGPROBS`]).
    pub logprobs: Option<usize>,
    /// Whether an end-of-sequence token is emitted like any other, so that only `max_tokens` ends the
    /// sequence (a benchmark's fixed output length; vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// Tokens that end the sequence when drawn, as an end-of-sequence token does (included in the
    /// output), whatever `ignore_eos` says (vLLM's `stop_token_ids`).
    pub stop_ids: Vec<u32>,
    /// The fewest tokens generated before an end-of-sequence token or one of `stop_ids` may be drawn:
    /// until then their logits are taken as -inf (vLLM's `min_tokens`).
    pub min_tokens: usize,
}

impl Request {
    /// Greedy decoding of `prompt`, with nothing else asked: no penalties, no log-probabilities.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize, prefill_chunk: usize) -> Self {
        Request {
            prompt,
            max_tokens,
            prefill_chunk,
            sampling: Sampling::Greedy,
            penalties: Penalties::default(),
            logprobs: None,
            ignore_eos: false,
            stop_ids: Vec::new(),
            min_tokens: 0,
        }
    }
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An EOS token (included in the output).
    Eos,
    /// `max_tokens` reached.
    Length,
    /// The caller's `on_token` ended it (see [`Engine::generate_until`]).
    Stopped,
}

/// What generation produced and how long it took.
#[derive(Debug)]
pub struct Generation {
    /// Generated ids.
    pub output: Vec<u32>,
    /// Why it stopped.
    pub finish: Finish,
    /// Prefill spans ingested.
    pub spans: usize,
    /// Bytes of K/V payload ingested by prefill.
    pub bytes: u64,
    /// Time in the forward pass of prefill.
    pub prefill: Duration,
    /// Time validating and copying prefill spans into the cache.
    pub ingest: Duration,
    /// Time to the first generated token.
    pub ttft: Duration,
    /// The host's forward step over the prompt's last token (part of `prefill` and `ttft`).
    pub last_token: Duration,
    /// Time decoding after the first token.
    pub decode: Duration,
    /// Who prefilled, and what it cost.
    pub report: PrefillReport,
    /// XXH3-64 of the bits of every logits vector a token was sampled from, in order: equal hashes mean
    /// bit-identical logits (how tests prove remote and local prefill compute the same thing).
    pub logits_hash: u64,
    /// Each output token's log-probability, where the request asked for them (else empty).
    pub logprobs: Vec<TokenLogprob>,
}

/// The engine for one model.
#[derive(Debug)]
pub struct Engine {
    /// The model.
    pub model: Model,
    /// The cache.
    pub kv: PagedKv,
    next_seq: u64,
    /// Prompt tokens per piece where the host prefills a prompt that was meant for a producer (see
    /// [`Engine::set_local_piece`]); 0: the producer's spans.
    local_piece: usize,
}

/// Past K/V of one sequence, read from the paged cache.
struct PagedPast<'a> {
    kv: &'a PagedKv,
    seq: SeqId,
}

impl PastKv for PagedPast<'_> {
    fn runs(&self, layer: usize, positions: std::ops::Range<u64>) -> Vec<Run<'_>> {
        if positions.is_empty() {
            return Vec::new();
        }
        let read = self.kv.read(self.seq, layer as u32).expect("a live sequence and a model layer");
        assert!(
            read.positions.start <= positions.start && positions.end <= read.positions.end,
            "layer {layer}: positions {positions:?} requested, {:?} held",
            read.positions
        );
        let dtype = read.dtype();
        let (heads, dim) = read.heads();
        let row = heads as usize * dim as usize;
        let bytes = row * dtype.size() as usize;
        let mut runs = Vec::new();
        for run in read.runs() {
            let a = run.start.max(positions.start);
            let b = (run.start + run.tokens as u64).min(positions.end);
            if a >= b {
                continue;
            }
            let (from, to) = ((a - run.start) as usize * bytes, (b - run.start) as usize * bytes);
            let (k, v) = (&run.k[from..to], &run.v[from..to]);
            runs.push(Run { start: a, k: values(dtype, k), v: values(dtype, v) });
        }
        runs
    }
}

/// `bytes` of the cache's `dtype` as values of that type: borrowed, as page pools are 4-byte aligned
/// and the cache little-endian; copied only if neither held.
fn values(dtype: Dtype, bytes: &[u8]) -> KvValues<'_> {
    use half::slice::HalfBitsSliceExt;
    use half::{bf16, f16};
    let native = cfg!(target_endian = "little");
    if dtype == Dtype::F32 {
        return KvValues::F32(match <[f32]>::ref_from_bytes(bytes) {
            Ok(v) if native => Cow::Borrowed(v),
            _ => Cow::Owned(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()),
        });
    }
    let bits: Cow<'_, [u16]> = match <[u16]>::ref_from_bytes(bytes) {
        Ok(v) if native => Cow::Borrowed(v),
        _ => Cow::Owned(bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect()),
    };
    match (dtype, bits) {
        (Dtype::Bf16, Cow::Borrowed(b)) => KvValues::Bf16(Cow::Borrowed(b.reinterpret_cast())),
        (Dtype::Bf16, Cow::Owned(b)) => KvValues::Bf16(b.into_iter().map(bf16::from_bits).collect()),
        (_, Cow::Borrowed(b)) => KvValues::F16(Cow::Borrowed(b.reinterpret_cast())),
        (_, Cow::Owned(b)) => KvValues::F16(b.into_iter().map(f16::from_bits).collect()),
    }
}

impl Engine {
    /// An engine whose cache holds `max_seqs` sequences of up to `max_tokens` tokens in `dtype`.
    pub fn new(
        mut model: Model,
        dtype: Dtype,
        page_size: u32,
        max_tokens: u64,
        max_seqs: u32,
    ) -> Result<Self, crate::kv::ConfigError> {
        let geometry = model.config.kv_geometry();
        let budget = crate::request::kv_budget(&geometry, dtype, page_size, max_tokens, max_seqs)
            .ok_or(crate::kv::ConfigError::TooLarge { max_tokens, max_seqs })?;
        let mut config = KvConfig::new(geometry, dtype, budget);
        config.page_size = page_size;
        config.max_seqs = max_seqs;
        let kv = PagedKv::new(config)?;
        // The model rounds each chunk's K/V to what this cache stores before attending to it.
        model.kv_dtype = dtype;
        Ok(Engine { kv, model, next_seq: 1, local_piece: 0 })
    }

    /// Where the host prefills a prompt that was meant for a producer (it failed, or could not start), it
    /// does so in pieces of at most `tokens` (0: in the producer's spans). A local forward pass holds its
    /// piece's activations and every layer's K/V until they are paged, so a span's size (2048 tokens by
    /// default) would raise the process's peak memory, and a server's live streams wait for each piece.
    /// The bits are the same at any size.
    pub fn set_local_piece(&mut self, tokens: usize) {
        self.local_piece = tokens;
    }

    /// Ingests a chunk's K/V into `seq` as a grouped span. Its entries (contiguous, in order) are written
    /// one at a time straight from the chunk, converted to the cache's dtype on the way: no whole span
    /// payload is built beside the chunk (for a 128-token SmolLM2 prompt that was 5.9 MB more at the
    /// process's peak).
    fn ingest(&mut self, seq: SeqId, request_id: u64, chunk: &ChunkKv) -> Result<u64, IngestError> {
        let geometry = self.kv.geometry().clone();
        let dtype = self.kv.dtype();
        let range = chunk.start..chunk.start + chunk.len as u64;
        let manifest = Manifest::grouped(&geometry, request_id, range, dtype);
        let mut staged = self.kv.prepare(seq, &manifest)?;
        let mut converted = Vec::new();
        for e in &manifest.entries {
            let src = match e.kind {
                EntryKind::K => &chunk.k[e.layer as usize],
                EntryKind::V => &chunk.v[e.layer as usize],
                EntryKind::State => unreachable!("no recurrent layers in these models"),
            };
            // Spans are little-endian, as this host is (asserted at the top): the f32s' bytes as they lie.
            let bytes = zerocopy::IntoBytes::as_bytes(src.as_slice());
            let bytes = if dtype == Dtype::F32 {
                bytes
            } else {
                converted.resize(e.len as usize, 0);
                convert(Dtype::F32, bytes, dtype, &mut converted);
                &converted[..]
            };
            self.kv.write_staged(&mut staged, e.offset, bytes);
        }
        self.kv.commit(staged);
        Ok(manifest.payload_len())
    }

    /// Generates for one request with local prefill, calling `on_token` with each new id as it is produced.
    pub fn generate(&mut self, req: &Request, on_token: impl FnMut(u32)) -> Result<Generation, EngineError> {
        self.generate_with(req, PrefillBy::Local, on_token)
    }

    /// Generates for one request, prefilled by `by`.
    ///
    /// The prompt's last token is always run by the host, as the first decode step: its logits pick the
    /// first output token, so the host never takes logits from a producer, and local and remote prefill
    /// run exactly the same arithmetic.
    pub fn generate_with(
        &mut self,
        req: &Request,
        by: PrefillBy<'_>,
        mut on_token: impl FnMut(u32),
    ) -> Result<Generation, EngineError> {
        self.generate_until(req, by, |id| {
            on_token(id);
            ControlFlow::Continue(())
        })
    }

    /// [`Engine::generate_with`], where `on_token` may end the request after any token (a stop string
    /// matched, the client went away): generation then ends with [`Finish::Stopped`] and the sequence's
    /// pages are freed at once.
    pub fn generate_until(
        &mut self,
        req: &Request,
        by: PrefillBy<'_>,
        mut on_token: impl FnMut(u32) -> ControlFlow<()>,
    ) -> Result<Generation, EngineError> {
        let mut live = self.admit(req, by)?;
        loop {
            match self.step(&mut live) {
                Ok(Some(token)) => {
                    if on_token(token).is_break() {
                        live.finish = Some(Finish::Stopped);
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    let _ = self.kv.remove_sequence(live.seq);
                    return Err(e);
                }
            }
        }
        Ok(self.finish(live))
    }

    /// Adds a sequence and prefills all of `prompt` into it (in spans of `chunk` tokens; 0: one span),
    /// by `by`, and keeps it: for tests and tools that inspect the cache, or check that other sequences
    /// are untouched. Release it with [`Engine::release`].
    pub fn prefill(
        &mut self,
        prompt: &[u32],
        chunk: usize,
        by: PrefillBy<'_>,
    ) -> Result<(SeqId, PrefillReport), EngineError> {
        let seq = SeqId(self.next_seq);
        self.next_seq += 1;
        self.kv.add_sequence(seq, seq.0)?;
        match self.prefill_seq(seq, seq.0, prompt, chunk, by) {
            Ok(done) => Ok((seq, done.report)),
            Err(e) => {
                let _ = self.kv.remove_sequence(seq);
                Err(e)
            }
        }
    }

    /// The request id (and sequence id) the next request will get.
    pub fn next_request_id(&self) -> u64 {
        self.next_seq
    }

    /// Drops a sequence kept by [`Engine::prefill`].
    pub fn release(&mut self, seq: SeqId) {
        let _ = self.kv.remove_sequence(seq);
    }

    /// Prefills `prompt` into `seq`, remotely if `by` says so (falling back or failing as it says): the
    /// chunks of a [`Prefilling`] back to back.
    fn prefill_seq(
        &mut self,
        seq: SeqId,
        request_id: u64,
        prompt: &[u32],
        chunk: usize,
        by: PrefillBy<'_>,
    ) -> Result<Prefilled, EngineError> {
        let remote = match &by {
            PrefillBy::Remote { producer, .. } => Some(Remote::of(producer)),
            PrefillBy::Local | PrefillBy::Unavailable { .. } => None,
        };
        let mut p = self.open_prefill(seq, request_id, prompt, chunk, remote.as_ref());
        if let PrefillBy::Unavailable { name, error } = by {
            // As `Prefilling::new` names a producer: only where there is something to prefill.
            if !prompt.is_empty() {
                p.prefilled.report.producer = Some(name);
                p.prefilled.report.fallback = Some(error);
            }
            p.in_pieces_of(self.local_piece);
        } else if let PrefillBy::Remote { producer, on_failure } = by {
            while let Some(call) = p.next_call(prompt).filter(|_| p.is_remote()) {
                match producer.prefill(&mut self.kv, seq, &call) {
                    Ok(times) => {
                        p.remote_by(producer);
                        p.remote_done(times);
                    }
                    Err(e) => {
                        self.fall_back(&mut p, prompt, e);
                        if on_failure == OnFailure::Fail {
                            producer.release(request_id);
                            return Err(p.take_fallback().expect("just set").into());
                        }
                    }
                }
            }
            // No more calls for this request: the backend may free what it keeps of it.
            producer.release(request_id);
        }
        while let Some((start, part)) = p.next_chunk(prompt) {
            self.prefill_chunk(&mut p, start, part)?;
        }
        self.register_prefix(&p, prompt);
        Ok(p.prefilled)
    }

    /// The prefill of `head` into the empty `seq`, by `remote` or locally, starting after the longest
    /// prefix the cache can share (when the prefix cache is on).
    fn open_prefill(
        &mut self,
        seq: SeqId,
        request_id: u64,
        head: &[u32],
        chunk: usize,
        remote: Option<&Remote>,
    ) -> Prefilling {
        let chunk = match remote.and_then(|r| r.max_tokens) {
            Some(max) if chunk == 0 || chunk as u64 > max => usize::try_from(max).unwrap_or(usize::MAX),
            _ => chunk,
        };
        let mut p = Prefilling::new(seq, request_id, head.len(), chunk, remote.map(|r| r.name.as_str()));
        p.rounding = match remote {
            Some(r) => r.hits,
            None => Some(Rounding::host(self.kv.dtype())),
        };
        self.attach_prefix(&mut p, head);
        p
    }

    /// Shares the longest cached prefix of `head` into `p`'s empty sequence.
    fn attach_prefix(&mut self, p: &mut Prefilling, head: &[u32]) {
        let Some(rounding) = p.rounding.filter(|_| self.kv.prefix_cache()) else { return };
        let hit = self.kv.attach_prefix(p.seq, head, rounding).tokens as usize;
        (p.hit, p.done) = (hit, hit);
        p.prefilled.report.prefix_hit = hit as u64;
        if p.remote && hit == p.len {
            // Nothing is left to prefill: the cache holds the producer's K/V.
            p.remote = false;
            p.prefilled.report.remote = true;
        }
    }

    /// Registers the full pages of a complete prefill's prompt in the prefix cache, when every one of
    /// them came to be as its blocks are keyed: a producer's spans under its own rounding (none for a
    /// backend that takes no hit: its blocks would never be looked up), the host's under the cache's.
    fn register_prefix(&mut self, p: &Prefilling, head: &[u32]) {
        let report = &p.prefilled.report;
        let rounding = if report.remote { p.rounding } else { Some(Rounding::host(self.kv.dtype())) };
        if p.hit > 0 && rounding != p.rounding {
            return;
        }
        if let Some(rounding) = rounding {
            self.kv.register_prefix(p.seq, head, rounding);
        }
    }

    /// Runs one chunk of `p` locally and ingests its K/V.
    pub fn prefill_chunk(&mut self, p: &mut Prefilling, start: u64, part: &[u32]) -> Result<(), IngestError> {
        let t = Instant::now();
        let out = self.model.forward(part, start, &PagedPast { kv: &self.kv, seq: p.seq }, false);
        p.prefilled.forward += t.elapsed();
        let t = Instant::now();
        p.prefilled.bytes += self.ingest(p.seq, p.request_id, &out.kv)?;
        p.prefilled.ingest += t.elapsed();
        p.prefilled.spans += 1;
        p.done += part.len();
        Ok(())
    }

    /// A remote chunk of `p` (prefilling `head`) failed: its sequence starts over empty (spans of earlier
    /// chunks are committed, a prefix shared under the producer's rounding is let go), and the rest of
    /// `p` runs locally (in pieces of [`Engine::set_local_piece`]), after the longest prefix cached under
    /// the cache's own rounding, with `error` as the fallback reason.
    pub fn fall_back(&mut self, p: &mut Prefilling, head: &[u32], error: ProducerError) {
        let _ = self.kv.remove_sequence(p.seq);
        self.kv.add_sequence(p.seq, p.request_id).expect("the slot just freed");
        (p.done, p.hit) = (0, 0);
        p.remote = false;
        // In the pieces it was planned in, not a backend's `max_tokens`, and at most the host's own.
        p.chunk = p.planned;
        p.in_pieces_of(self.local_piece);
        // Nothing of the remote chunks counts any more: only who was asked, and why it failed.
        let producer = p.prefilled.report.producer.take();
        p.prefilled = Prefilled::default();
        p.prefilled.report.producer = producer;
        p.prefilled.report.fallback = Some(error);
        p.rounding = Some(Rounding::host(self.kv.dtype()));
        self.attach_prefix(p, head);
    }

    /// Opens a sequence for `req` and returns its prefill, to be run chunk by chunk by the caller
    /// ([`Prefilling::next_chunk`]: remotely through `producer`, [`Producer::take`] into [`Engine::kv`] and
    /// [`Prefilling::remote_done`], or locally with [`Engine::prefill_chunk`]), then made live with
    /// [`Engine::go_live`] or dropped with [`Engine::abandon`]. This is how the server interleaves prefill
    /// with decode rounds; [`Engine::admit`] runs the same steps back to back.
    pub fn begin(&mut self, req: &Request, remote: Option<&Remote>) -> Result<Prefilling, EngineError> {
        let seq = SeqId(self.next_seq);
        self.next_seq += 1;
        self.kv.add_sequence(seq, seq.0)?;
        let head = &req.prompt[..req.prompt.len().saturating_sub(1)];
        Ok(self.open_prefill(seq, seq.0, head, req.prefill_chunk, remote))
    }

    /// Drops a prefill that will not go live (its client left, or it failed): its pages are freed.
    pub fn abandon(&mut self, p: Prefilling) {
        let _ = self.kv.remove_sequence(p.seq);
    }

    /// Makes a prefilled `p` live. Its last prompt token has not run yet: the sequence's first
    /// [`Engine::step_many`] runs it in the same batched pass as the other live sequences' steps, and
    /// its logits choose the first output token (the server's decode rounds never stop for a lone
    /// pass over one new sequence's last token).
    pub fn go_live(&mut self, p: Prefilling, req: &Request) -> Live {
        self.register_prefix(&p, &req.prompt[..req.prompt.len() - 1]);
        Live::pending(p.seq, p.request_id, req, &self.model.config.eos, p.prefilled, p.started)
    }

    /// A sequence for `req`, whose prompt is `leader`'s, made live from a copy of `leader`'s prefilled
    /// K/V instead of a prefill of its own (another choice of the same request). `leader` has not
    /// stepped yet, so its cache holds exactly the prompt less its last token; the fork's report is
    /// `leader`'s, every prefilled token a prefix hit.
    pub fn fork(&mut self, leader: &Live, req: &Request, started: Instant) -> Result<Live, EngineError> {
        assert!(
            leader.output.is_empty() && leader.to_run.is_some() && req.prompt.len() == leader.prompt_len,
            "a fork's leader has not stepped, and its prompt is the fork's"
        );
        let seq = SeqId(self.next_seq);
        self.next_seq += 1;
        self.kv.fork(leader.seq, seq, seq.0)?;
        let l = &leader.report;
        let report = PrefillReport {
            remote: l.remote,
            prefix_hit: (req.prompt.len() - 1) as u64,
            producer: l.producer.clone(),
            layout: l.layout,
            wire_dtype: l.wire_dtype,
            transport: l.transport.clone(),
            ..PrefillReport::default()
        };
        let prefilled = Prefilled { report, ..Prefilled::default() };
        Ok(Live::pending(seq, seq.0, req, &self.model.config.eos, prefilled, started))
    }

    /// Adds a sequence for `req`, prefills its prompt (by `by`) and runs its last prompt token in the host,
    /// whose logits choose the first output token: a [`Live`] sequence ready for [`Engine::step`]. On
    /// failure the sequence is gone again.
    pub fn admit(&mut self, req: &Request, by: PrefillBy<'_>) -> Result<Live, EngineError> {
        let seq = SeqId(self.next_seq);
        self.next_seq += 1;
        let request_id = seq.0;
        self.kv.add_sequence(seq, request_id)?;
        match self.start(seq, request_id, req, by) {
            Ok(live) => Ok(live),
            Err(e) => {
                let _ = self.kv.remove_sequence(seq);
                Err(e)
            }
        }
    }

    fn start(&mut self, seq: SeqId, request_id: u64, req: &Request, by: PrefillBy<'_>) -> Result<Live, EngineError> {
        let started = Instant::now();
        let head = &req.prompt[..req.prompt.len() - 1];
        let prefilled = self.prefill_seq(seq, request_id, head, req.prefill_chunk, by)?;
        self.finish_start(seq, request_id, req, prefilled, started)
    }

    /// The host's step over the last prompt token of a prefilled sequence, at once: its logits choose
    /// the first output token, which the first [`Engine::step`] emits.
    fn finish_start(
        &mut self,
        seq: SeqId,
        request_id: u64,
        req: &Request,
        prefilled: Prefilled,
        started: Instant,
    ) -> Result<Live, EngineError> {
        let mut live = Live::pending(seq, request_id, req, &self.model.config.eos, prefilled, started);
        let ran = self.run(&mut [&mut live]).pop().expect("one result per sequence");
        ran.map(|()| live)
    }

    /// Emits `live`'s next token: first runs the token before it through the model and samples from its
    /// logits (the last emitted token, or the last prompt token of a sequence from [`Engine::go_live`];
    /// [`Engine::admit`] has run that one already). `None` once the sequence has ended (EOS, `max_tokens`); then
    /// [`Engine::finish`] it. A caller that stops after a token never pays for the step after it.
    pub fn step(&mut self, live: &mut Live) -> Result<Option<u32>, EngineError> {
        self.step_many(&mut [live]).pop().expect("one result per sequence")
    }

    /// [`Engine::step`] for every sequence in `lives` at once: the previous tokens of all of them go
    /// through the model as one batch (each weight read once for the whole batch), and each sequence
    /// gets exactly the logits it would get alone. One result per sequence, in order; a sequence whose
    /// step fails is left as it was and the others go on.
    pub fn step_many(&mut self, lives: &mut [&mut Live]) -> Vec<Result<Option<u32>, EngineError>> {
        let ran = self.run(lives);
        lives
            .iter_mut()
            .zip(ran)
            .map(|(live, ran)| ran.map(|()| if live.finish.is_none() { self.emit(live) } else { None }))
            .collect()
    }

    /// The model's part of [`Engine::step_many`]: every sequence's token to run (its last emitted one,
    /// or its last prompt token if it has just gone live) through the model as one batch, the K/V into
    /// the cache, then each sequence's next token drawn from its logits. A sequence whose K/V is refused
    /// is left as it was.
    fn run(&mut self, lives: &mut [&mut Live]) -> Vec<Result<(), EngineError>> {
        let mut results: Vec<Result<(), EngineError>> = (0..lives.len()).map(|_| Ok(())).collect();
        let to_run: Vec<(usize, u32)> = lives
            .iter_mut()
            .enumerate()
            .filter(|(_, l)| l.finish.is_none())
            .filter_map(|(i, l)| l.to_run.take().map(|t| (i, t)))
            .collect();
        if to_run.is_empty() {
            return results;
        }
        let tokens: Vec<[u32; 1]> = to_run.iter().map(|&(_, t)| [t]).collect();
        let pass = Instant::now();
        let outs = {
            let pasts: Vec<PagedPast<'_>> =
                to_run.iter().map(|&(i, _)| PagedPast { kv: &self.kv, seq: lives[i].seq }).collect();
            let segments: Vec<Segment<'_>> = to_run
                .iter()
                .zip(&tokens)
                .zip(&pasts)
                .map(|((&(i, _), tokens), past)| Segment {
                    tokens,
                    start: lives[i].position(),
                    past,
                    all_logits: false,
                })
                .collect();
            self.model.forward_batch(&segments)
        };
        let pass = pass.elapsed();
        // The K/V into the shared cache one sequence at a time; then each sequence's logits, a
        // vocabulary's worth each, hashed and sampled on the model's threads at once.
        let mut logits: Vec<Option<Vec<f32>>> = (0..lives.len()).map(|_| None).collect();
        for (&(i, token), out) in to_run.iter().zip(outs) {
            let live = &mut *lives[i];
            match self.ingest(live.seq, live.request_id, &out.kv) {
                Ok(_) => logits[i] = Some(out.logits),
                Err(e) => {
                    live.to_run = Some(token);
                    results[i] = Err(e.into());
                }
            }
        }
        let mut drawn: Vec<(&mut Live, Vec<f32>)> =
            lives.iter_mut().zip(logits).filter_map(|(live, l)| Some((&mut **live, l?))).collect();
        self.model.exec.each(&mut drawn, |(live, logits)| live.draw(logits, pass));
        results
    }

    /// Emits the sampled token, if any, and decides whether the sequence goes on.
    fn emit(&self, live: &mut Live) -> Option<u32> {
        let token = live.next.take()?;
        live.output.push(token);
        if (!live.ignore_eos && self.model.config.eos.contains(&token)) || live.stop_ids.contains(&token) {
            live.finish = Some(Finish::Eos);
        } else if live.output.len() >= live.max_tokens {
            live.finish = Some(Finish::Length);
        } else {
            live.to_run = Some(token);
        }
        Some(token)
    }

    /// Ends `live` (as it finished, or [`Finish::Stopped`] when it has not), frees its pages, and returns
    /// what it generated.
    pub fn finish(&mut self, live: Live) -> Generation {
        let _ = self.kv.remove_sequence(live.seq);
        let decode = if !live.output.is_empty() { live.decode_start.elapsed() } else { Duration::ZERO };
        let emitted = live.output.len();
        Generation {
            finish: live.finish.unwrap_or(Finish::Stopped),
            output: live.output,
            spans: live.spans,
            bytes: live.bytes,
            prefill: live.prefill,
            ingest: live.ingest,
            ttft: live.ttft,
            last_token: live.last_token,
            decode,
            report: live.report,
            logits_hash: live.hasher.finish(),
            logprobs: {
                // A token drawn but never emitted (the sequence ended first) has none.
                let mut lps = live.logprobs;
                lps.truncate(emitted);
                lps
            },
        }
    }
}

impl Live {
    /// A prefilled sequence whose last prompt token is still to run (`to_run`): the first pass over it
    /// draws its first output token (or, with `max_tokens` 0, ends it). `eos` is the model's.
    fn pending(
        seq: SeqId,
        request_id: u64,
        req: &Request,
        eos: &[u32],
        prefilled: Prefilled,
        started: Instant,
    ) -> Live {
        let Prefilled { forward, ingest, bytes, spans, report } = prefilled;
        // What `min_tokens` holds back: every token that would end the sequence.
        let ends: Vec<u32> = eos.iter().chain(&req.stop_ids).copied().collect();
        let held = Held { tokens: if req.min_tokens > 0 { ends } else { Vec::new() }, until: req.min_tokens };
        Live {
            seq,
            request_id,
            prompt_len: req.prompt.len(),
            max_tokens: req.max_tokens,
            ignore_eos: req.ignore_eos,
            stop_ids: req.stop_ids.clone(),
            sampler: Sampler::new(req.sampling, req.penalties.clone(), held, &req.prompt),
            hasher: twox_hash::XxHash3_64::with_seed(0),
            next: None,
            to_run: Some(*req.prompt.last().expect("a prompt has at least one token")),
            output: Vec::new(),
            top_logprobs: req.logprobs,
            logprobs: Vec::new(),
            finish: None,
            first_from: Some(started),
            spans,
            bytes,
            prefill: forward,
            ingest,
            ttft: Duration::ZERO,
            last_token: Duration::ZERO,
            decode_start: started,
            report,
        }
    }

    /// The position of the token it runs next: its last prompt token's, then each emitted token's.
    fn position(&self) -> u64 {
        (self.prompt_len + self.output.len() - 1) as u64
    }

    /// Takes the logits of a pass (of `pass`'s time) into the sequence's hash, and draws the next token
    /// from them. The pass over the last prompt token ends the time to the first token, and with
    /// `max_tokens` 0 the sequence.
    fn draw(&mut self, logits: &[f32], pass: Duration) {
        let first = self.first_from.take();
        if first.is_some() {
            self.last_token = pass;
            self.prefill += pass;
        }
        if first.is_some() && self.max_tokens == 0 {
            self.finish = Some(Finish::Length);
        } else {
            hash_logits(&mut self.hasher, logits);
            let next = self.sampler.next(logits);
            if let Some(top) = self.top_logprobs {
                self.logprobs.push(logprobs::of(logits, next, top));
            }
            self.next = Some(next);
        }
        if let Some(started) = first {
            self.ttft = started.elapsed();
            self.decode_start = Instant::now();
        }
    }
}

/// A sequence between [`Engine::admit`] and [`Engine::finish`]: its pages in the cache, its sampler and
/// what it has generated. Each is independent of every other, so sequences may be stepped in any
/// interleaving and each still computes exactly what it would alone.
pub struct Live {
    seq: SeqId,
    request_id: u64,
    prompt_len: usize,
    max_tokens: usize,
    /// Whether only `max_tokens` (or a stop id) ends it.
    ignore_eos: bool,
    /// Tokens that end it when drawn.
    stop_ids: Vec<u32>,
    /// Its sampling settings, generator and scratch space.
    sampler: Sampler,
    hasher: twox_hash::XxHash3_64,
    /// The token to emit at the next step.
    next: Option<u32>,
    /// The last emitted token, to run through the model at the next step.
    to_run: Option<u32>,
    output: Vec<u32>,
    /// Whether, and with how many alternatives, to report log-probabilities.
    top_logprobs: Option<usize>,
    /// The log-probability of each token drawn (`output`'s, and the next one's once drawn).
    logprobs: Vec<TokenLogprob>,
    finish: Option<Finish>,
    /// While its last prompt token has not run: when its request was admitted (its time to the first
    /// token ends when that pass is done).
    first_from: Option<Instant>,
    spans: usize,
    bytes: u64,
    prefill: Duration,
    ingest: Duration,
    ttft: Duration,
    last_token: Duration,
    decode_start: Instant,
    report: PrefillReport,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live")
            .field("seq", &self.seq)
            .field("prompt_len", &self.prompt_len)
            .field("output", &self.output.len())
            .field("finish", &self.finish)
            .finish_non_exhaustive()
    }
}

impl Live {
    /// Whether it has ended (EOS or `max_tokens`).
    pub fn is_done(&self) -> bool {
        self.finish.is_some()
    }

    /// Tokens generated so far.
    pub fn output(&self) -> &[u32] {
        &self.output
    }

    /// Time to its first token (prefill and the last prompt token).
    pub fn ttft(&self) -> Duration {
        self.ttft
    }

    /// Time in the forward pass of its prefill, the last prompt token included.
    pub fn prefill_time(&self) -> Duration {
        self.prefill
    }

    /// Time its prefill spent committing K/V into the paged cache (the last prompt token's not counted).
    pub fn ingest_time(&self) -> Duration {
        self.ingest
    }

    /// How its prompt was prefilled.
    pub fn report(&self) -> &PrefillReport {
        &self.report
    }

    /// The log-probabilities of the tokens emitted so far, where its request asked for them (else none).
    pub fn logprobs(&self) -> &[TokenLogprob] {
        &self.logprobs[..self.logprobs.len().min(self.output.len())]
    }
}

fn hash_logits(hasher: &mut twox_hash::XxHash3_64, logits: &[f32]) {
    hasher.write(zerocopy::IntoBytes::as_bytes(logits));
}

#[cfg(test)]
mod tests {
    use zerocopy::IntoBytes;

    use super::*;

    /// What [`values`] gives, widened, whether it borrows or (for bytes at an odd address) copies.
    fn widened(values: &KvValues<'_>) -> Vec<u32> {
        match values {
            KvValues::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
            KvValues::Bf16(v) => v.iter().map(|x| x.to_f32().to_bits()).collect(),
            KvValues::F16(v) => v.iter().map(|x| x.to_f32().to_bits()).collect(),
        }
    }

    #[test]
    fn cache_bytes_are_read_as_their_values_in_place_or_copied() {
        let xs = [1.5f32, -0.0, 3.0e-5, -1024.25, 0.1];
        let f32_bytes: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
        for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            let len = xs.len() * dtype.size() as usize;
            // 4-byte aligned storage, as a page pool's: values at its start are borrowed, values one
            // byte on are copied.
            let (mut at_start, mut one_on) = (vec![0u32; len.div_ceil(4)], vec![0u32; len.div_ceil(4) + 1]);
            let (at_start, one_on) = (&mut at_start.as_mut_bytes()[..len], &mut one_on.as_mut_bytes()[1..=len]);
            convert(Dtype::F32, &f32_bytes, dtype, at_start);
            convert(Dtype::F32, &f32_bytes, dtype, one_on);
            let want: Vec<u32> = xs.iter().map(|&x| model::forward::round_to(dtype, x).to_bits()).collect();
            let (aligned, odd) = (values(dtype, at_start), values(dtype, one_on));
            assert!(borrowed(&aligned) && !borrowed(&odd), "{dtype:?}: borrowed in place, copied one byte on");
            for v in [&aligned, &odd] {
                assert_eq!(v.dtype(), dtype);
                assert_eq!(widened(v), want, "{dtype:?}");
            }
        }
    }

    /// A backend may say any `max_tokens` (a Python one, 2^64 - 1 for "no limit"): the chunk is at most
    /// the prompt, so the next chunk after a prefix hit does not wrap (it panicked the engine thread).
    #[test]
    fn a_huge_chunk_is_the_rest_of_the_prompt() {
        let mut p = Prefilling::new(SeqId(1), 1, 10, usize::MAX, Some("py"));
        p.done = 5;
        let prompt: Vec<u32> = (0..10).collect();
        assert_eq!(p.next_chunk(&prompt), Some((5, &prompt[5..])));
    }

    #[test]
    fn producers_together_promise_only_what_each_of_them_does() {
        let r = |name: &str, hits: Option<Dtype>, max_tokens| Remote {
            name: name.into(),
            hits: hits.map(|d| Rounding::backend(name, d)),
            max_tokens,
        };
        assert_eq!(Remote::together(&[]), None);
        let one = r("rngd", Some(Dtype::Bf16), Some(512));
        assert_eq!(Remote::together(std::slice::from_ref(&one)), Some(one.clone()));
        // Two of one backend are that backend.
        assert_eq!(Remote::together(&[one.clone(), one.clone()]), Some(one.clone()));
        // Another wire dtype, or one that takes no context, or one not known yet: no hits for anyone,
        // whichever producer would take the request; chunks fit the smallest.
        for other in [r("gpu", Some(Dtype::F32), None), r("gpu", None, Some(256)), r("py", None, None)] {
            let both = Remote::together(&[one.clone(), other.clone(), one.clone()]).expect("two producers");
            assert_eq!(both.hits, None, "{other:?}");
            assert_eq!(both.max_tokens, Some(other.max_tokens.unwrap_or(512).min(512)), "{other:?}");
            assert_eq!(both.name, format!("rngd,{}", other.name));
        }
        // Another backend, even at the same wire dtype, computes other K/V: no hits either.
        let other = Remote::together(&[one.clone(), r("gpu", Some(Dtype::Bf16), None)]).expect("two producers");
        assert_eq!((other.hits, other.max_tokens), (None, Some(512)));
    }

    /// A sequence made live by `go_live` runs its last prompt token in its first step, batched with
    /// another sequence's decode step: both end exactly as each does alone through `admit` (ids and
    /// logits hash), and `ignore_eos` runs to `max_tokens`.
    #[test]
    fn a_sequence_that_goes_live_runs_its_last_prompt_token_in_the_batch_and_equals_admit() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/reference/tiny_gemma3_8l");
        let engine = || {
            let mut m = Model::from_hf_dir(&dir).expect("tiny checkpoint loads");
            m.configure(model::kernels::Precision::Exact, 1);
            Engine::new(m, Dtype::F32, 4, 64, 2).expect("engine")
        };
        let first = Request::greedy((1..12).collect(), 8, 0);
        let second = Request { ignore_eos: true, ..Request::greedy((20..33).collect(), 12, 5) };
        let alone = |req: &Request| {
            let mut e = engine();
            let mut live = e.admit(req, PrefillBy::Local).expect("admitted");
            while e.step(&mut live).expect("a step").is_some() {}
            let g = e.finish(live);
            (g.output, g.logits_hash)
        };
        let (want1, want2) = (alone(&first), alone(&second));
        assert_eq!(want2.0.len(), 12, "ignore_eos: only max_tokens ends it");

        let mut e = engine();
        let mut one = e.admit(&first, PrefillBy::Local).expect("admitted");
        let mut out1 = Vec::new();
        out1.extend(e.step(&mut one).expect("a step"));
        // The second request prefills chunk by chunk, then goes live with its last prompt token to run.
        let mut p = e.begin(&second, None).expect("begun");
        let head = &second.prompt[..second.prompt.len() - 1];
        while let Some((start, part)) = p.next_chunk(head) {
            let part = part.to_vec();
            e.prefill_chunk(&mut p, start, &part).expect("a chunk");
        }
        let mut two = e.go_live(p, &second);
        assert!(two.output().is_empty() && two.ttft().is_zero(), "nothing run yet");
        let mut out2 = Vec::new();
        while !(one.is_done() && two.is_done()) {
            let steps = e.step_many(&mut [&mut one, &mut two]);
            let [s1, s2] = <[_; 2]>::try_from(steps).expect("two results");
            out1.extend(s1.expect("a step"));
            out2.extend(s2.expect("a step"));
            assert!(!two.ttft().is_zero(), "its first step ends its time to the first token");
        }
        let (g1, g2) = (e.finish(one), e.finish(two));
        assert_eq!((&g1.output, g1.logits_hash), (&want1.0, want1.1));
        assert_eq!((&g2.output, g2.logits_hash), (&want2.0, want2.1));
        assert_eq!((out1, out2), (want1.0, want2.0));
    }

    /// A stop id ends a sequence where it is drawn, included, as an end-of-sequence token does, also
    /// under `ignore_eos`; `min_tokens` holds back every token that would end it until that many are out.
    #[test]
    fn stop_ids_end_a_sequence_and_min_tokens_holds_them_back() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/reference/tiny_gemma3_8l");
        let mut m = Model::from_hf_dir(&dir).expect("tiny checkpoint loads");
        m.configure(model::kernels::Precision::Exact, 1);
        let mut e = Engine::new(m, Dtype::F32, 4, 64, 2).expect("engine");
        let mut run = |req: &Request| e.generate(req, |_| {}).expect("generated");
        // A random checkpoint repeats one token; a presence penalty makes every drawn token new.
        let free = Request {
            ignore_eos: true,
            penalties: Penalties { presence: 100.0, ..Penalties::default() },
            ..Request::greedy((20..33).collect(), 12, 0)
        };
        let all = run(&free).output;
        // A token first drawn at step 4 or later, as the stop id.
        let (at, &stop) = all.iter().enumerate().skip(3).find(|&(i, t)| !all[..i].contains(t)).expect("a new token");
        let stopped = run(&Request { stop_ids: vec![stop], ..free.clone() });
        assert_eq!((stopped.finish, &stopped.output[..]), (Finish::Eos, &all[..=at]));
        // Held back until `at + 2` tokens are out: the sequence goes on past where it stopped.
        let held = run(&Request { stop_ids: vec![stop], min_tokens: at + 2, ..free.clone() });
        assert!(!held.output[..at + 2].contains(&stop), "{:?}", held.output);
        assert!(held.output.len() > at + 1, "{:?}", held.output);
        assert_eq!(held.output[..at], all[..at], "the same before the held token's step");
    }

    fn borrowed(values: &KvValues<'_>) -> bool {
        match values {
            KvValues::F32(v) => matches!(v, Cow::Borrowed(_)),
            KvValues::Bf16(v) => matches!(v, Cow::Borrowed(_)),
            KvValues::F16(v) => matches!(v, Cow::Borrowed(_)),
        }
    }
}
