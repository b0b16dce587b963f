//! The engine thread: owns the engine and its KV cache; admits accepted requests in arrival order while a
//! slot is free, has their prompts prefilled by the producers' waiter threads ([`super::prefill`]) or
//! locally a chunk per round, steps every live one a token per round in one batched pass, and streams
//! text back as it is generated.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use model::tokenizer::Tokenizer;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedSender;

use super::metrics::Metrics;
use crate::engine::{
    Engine, EngineError, Finish, Live, OnFailure, Prefilling, Remote, Request, Sampling, TokenLogprob,
};
use crate::supervisor::{Producer, ProducerError};
use crate::text::TextStream;

/// What the engine thread builds before it serves: the slow part (weights, producer start), so it runs
/// there while `/health` says 503.
pub type Start = Box<dyn FnOnce() -> anyhow::Result<Loaded> + Send>;

/// An engine ready to serve, and how it prefills.
pub struct Loaded {
    /// The engine, its cache sized for `slots` sequences of the context.
    pub engine: Engine,
    /// The producers that prefill (`--producers`), or none for local prefill.
    pub producers: Vec<Producer>,
    /// What a failed remote prefill does.
    pub on_failure: OnFailure,
    /// Sequences live at once (the engine's cache holds this many).
    pub slots: usize,
    /// Prompt tokens a producer is given at once: a batch of chunks of different requests, computed in
    /// one pass where its backend stages batches, holds at most this many (and one chunk at least).
    pub batch_tokens: usize,
    /// How long a new prompt waits for others to join its batch before it goes to a producer, while a
    /// slot is free for them (`--batch-wait`).
    pub batch_wait: Duration,
    /// Called once everything is up (the CLI prints `listening on ...`).
    pub on_ready: Box<dyn FnOnce() + Send>,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded").field("producers", &self.producers).field("on_failure", &self.on_failure).finish()
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
    /// The job of the same request and prompt whose prefilled K/V this one copies where it can
    /// (another choice of `n`): admitted while that one prefills, it waits, and goes live with it.
    pub follows: Option<u64>,
}

/// What a request hears from the engine.
#[derive(Debug)]
pub enum Event {
    /// New text, and the log-probabilities of the tokens it completes where the request asked for
    /// them (a token whose text is still held back comes with a later chunk).
    Text(String, Vec<TokenLogprob>),
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

/// Where the engine thread is: loading, serving, or gone (returned, or panicked), and why it did not
/// start when it did not.
#[derive(Debug)]
pub struct EngineState {
    /// `LOADING`, `SERVING` or `GONE`.
    stage: AtomicU8,
    /// Why it did not start, where it said.
    why: std::sync::OnceLock<String>,
    /// The free slots and the waiting requests, in one word ([`Places`]).
    places: AtomicUsize,
}

impl Default for EngineState {
    fn default() -> Self {
        EngineState {
            stage: AtomicU8::new(Self::LOADING),
            why: std::sync::OnceLock::new(),
            places: AtomicUsize::new(0),
        }
    }
}

impl EngineState {
    const LOADING: u8 = 0;
    const SERVING: u8 = 1;
    const GONE: u8 = 2;

    /// It serves requests.
    pub fn serving(&self) -> bool {
        self.stage.load(Ordering::Acquire) == Self::SERVING
    }

    /// It has ended: nothing will answer a request any more.
    pub fn gone(&self) -> bool {
        self.stage.load(Ordering::Acquire) == Self::GONE
    }

    /// Why it ended before serving, where it said.
    pub fn why_not_started(&self) -> Option<&str> {
        self.why.get().map(String::as_str)
    }

    /// It could not start, for `why` (`pdhost serve` ends with it as its error).
    fn not_started(&self, why: String) {
        let _ = self.why.set(why);
    }

    /// Requests accepted and not yet admitted or cancelled. A client that leaves while its request waits
    /// gives its place back within a round (the engine thread drops the request), not only when a slot
    /// comes free and the request reaches the head of the queue.
    pub fn waiting(&self) -> usize {
        Places(self.places.load(Ordering::Acquire)).waiting()
    }

    /// Takes places for `jobs` jobs (a request's choices), all or none, if they would wait behind at
    /// most `queue` others (`--queue`): at most `queue` plus the free slots are accepted and not yet
    /// admitted. The count and the free slots change together, in one word, so no job slips in between
    /// an admission's two updates.
    pub fn enqueue(&self, queue: usize, jobs: usize) -> bool {
        self.places
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
                let p = Places(p);
                (p.waiting() + jobs <= queue + p.free()).then(|| Places::of(p.free(), p.waiting() + jobs).0)
            })
            .is_ok()
    }

    /// Gives a place back: its request was cancelled, or could not be queued.
    pub fn unqueue(&self) {
        self.places(|free, waiting| (free, waiting - 1));
    }

    /// A request takes a free slot: one fewer waiting, one fewer free.
    fn admitted(&self) {
        self.places(|free, waiting| (free.saturating_sub(1), waiting - 1));
    }

    /// The free slots, as the engine thread counts them once a round.
    fn set_free(&self, free: usize) {
        self.places(|_, waiting| (free, waiting));
    }

    fn places(&self, f: impl Fn(usize, usize) -> (usize, usize)) {
        let _ = self.places.fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
            let (free, waiting) = f(Places(p).free(), Places(p).waiting());
            Some(Places::of(free, waiting).0)
        });
    }
}

/// The engine's free slots (high half) and the requests accepted but not yet admitted (low half), in
/// one word.
#[derive(Clone, Copy)]
struct Places(usize);

impl Places {
    const HALF: u32 = usize::BITS / 2;

    fn of(free: usize, waiting: usize) -> Self {
        Places((free << Self::HALF) | waiting)
    }

    fn free(self) -> usize {
        self.0 >> Self::HALF
    }

    fn waiting(self) -> usize {
        self.0 & ((1 << Self::HALF) - 1)
    }
}

/// Marks the engine gone when the thread ends, however it ends (a panic unwinds through it), and fails
/// the requests still queued: the server keeps the queue's sender, so they would wait for ever.
struct Gone(Arc<EngineState>, crossbeam_channel::Receiver<Job>);

impl Drop for Gone {
    fn drop(&mut self) {
        self.0.stage.store(EngineState::GONE, Ordering::Release);
        for job in self.1.try_iter() {
            let _ = job.events.send(Event::Failed("the engine stopped before this request ran".into()));
        }
    }
}

/// Starts the engine thread. It runs `start`, says it is serving in `state`, then serves `queue` until
/// every sender is gone or `stop` is set.
pub fn spawn(
    start: Start,
    queue: crossbeam_channel::Receiver<Job>,
    tokenizer: Arc<Tokenizer>,
    state: Arc<EngineState>,
    metrics: Metrics,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("pdhost-engine".into()).spawn(move || {
        let _gone = Gone(Arc::clone(&state), queue.clone());
        let mut loaded = match start() {
            Ok(loaded) => loaded,
            Err(e) => {
                state.not_started(format!("loading failed: {e:#}"));
                return;
            }
        };
        // The producers start here, on this long-lived thread: their parent-death signal follows the
        // thread that spawned them (a waiter thread, as long-lived, restarts them).
        let mut never = Vec::new();
        for (i, p) in loaded.producers.iter_mut().enumerate() {
            if let Err(e) = p.start() {
                tracing::warn!(
                    "producer {} #{i} did not start ({}): {e}; requests fall back or fail per request",
                    p.name(),
                    e.kind()
                );
                if e.repeats_on_every_start() {
                    never.push(e);
                }
            }
            metrics.producer(i, p.metrics());
        }
        // Not one producer can ever start (a library that is no backend, a config every backend refuses,
        // another model): a server whose every prefill would fall back, or fail, is a mistake in its
        // flags, and is refused as one rather than served.
        if let Some(e) = never.first().filter(|_| never.len() == loaded.producers.len()) {
            state.not_started(format!(
                "no producer can start, and none would on a later try ({e}): check --producer and \
                 --backend-config (--producer local prefills in the server)"
            ));
            return;
        }
        let remotes: Vec<Remote> = loaded.producers.iter().map(Remote::of).collect();
        let mut pool = match super::prefill::Pool::new(std::mem::take(&mut loaded.producers)) {
            Ok(pool) => pool,
            Err(e) => {
                state.not_started(format!("starting the prefill threads failed: {e}"));
                return;
            }
        };
        metrics.kv_usage(&loaded.engine.kv.usage());
        // Every slot is free before the first request is let in.
        state.set_free(loaded.slots);
        state.stage.store(EngineState::SERVING, Ordering::Release);
        (std::mem::replace(&mut loaded.on_ready, Box::new(|| {})))();
        let mut scheduler = Scheduler {
            state: &state,
            loaded: &mut loaded,
            pool: &mut pool,
            remote: Remote::together(&remotes),
            releases: vec![Vec::new(); remotes.len()],
            remotes,
            tokenizer: &tokenizer,
            metrics: &metrics,
            hold: None,
        };
        scheduler.run(&queue, &stop);
        // Producers at rest stop here; one still with its waiter stops when the waiter's reply finds
        // no one listening.
        drop(pool);
    })
}

/// A request between admission and its first token: its prompt being prefilled, chunk by chunk.
struct Admitting {
    job: Job,
    prefill: Prefilling,
    admitted: Instant,
    /// A producer is working on its current chunk.
    in_flight: bool,
    /// The producer its chunks so far went to, which keeps their K/V: its next chunk goes there too.
    producer: Option<usize>,
    /// Its prefill failed and may not fall back (`--on-producer-failure fail`).
    failed: Option<String>,
}

impl Admitting {
    /// The prompt less its last token: what is prefilled.
    fn head(&self) -> &[u32] {
        let prompt = &self.job.request.prompt;
        &prompt[..prompt.len() - 1]
    }
}

/// The engine thread's state.
///
/// Up to `slots` sequences are admitted at once. A round: take the producers' replies (each span taken
/// out of its ring into the cache, then the producer given the request's next chunk), give waiting
/// prefills to producers at rest, run one local chunk (`--producer local`, or a prefill that fell back),
/// make complete prefills live, then one batched step of every live sequence. Decode never waits for a
/// producer: only when nothing is live does the thread block, on new requests and replies at once. Each
/// sequence computes exactly what it would alone, whatever else is live.
struct Scheduler<'a, 't> {
    /// Where the queue's count lives.
    state: &'a EngineState,
    loaded: &'a mut Loaded,
    pool: &'a mut super::prefill::Pool,
    /// Each producer, by index, as far as it is known (what it said at its last reply).
    remotes: Vec<Remote>,
    /// What they are together, which is all a request can count on before a producer takes it: `None`
    /// without producers.
    remote: Option<Remote>,
    tokenizer: &'t Tokenizer,
    metrics: &'a Metrics,
    /// Until when new prompts wait for others to join them, to go to a producer in one batch.
    hold: Option<Instant>,
    /// Per producer, the requests whose prefill ended (cancelled, or failed) between two of their chunks
    /// there: released when the producer is next at hand, so that its backend frees their K/V.
    releases: Vec<Vec<u64>>,
}

impl<'t> Scheduler<'_, 't> {
    fn run(&mut self, queue: &crossbeam_channel::Receiver<Job>, stop: &AtomicBool) {
        let mut live: Vec<Running<'t>> = Vec::new();
        let mut admitting: Vec<Admitting> = Vec::new();
        let mut arrived: std::collections::VecDeque<Job> = std::collections::VecDeque::new();
        let mut queue_open = true;
        loop {
            // Past the drain timeout: whatever is still live ends here (its client is told by the closing
            // connection), and the thread returns, dropping the producers.
            if stop.load(Ordering::Acquire) {
                for r in live.drain(..) {
                    let _ = self.loaded.engine.finish(r.live);
                }
                return;
            }
            // Everything queued comes here (at most `--queue`: the server counts them), and a request
            // whose client has left gives its place back now, not when it would reach a slot.
            arrived.extend(queue.try_iter());
            arrived.retain(|job| {
                let left = job.events.is_closed();
                if left {
                    self.state.unqueue();
                    self.metrics.requests.with_label_values(&["cancelled"]).inc();
                    tracing::info!(id = job.id, "cancelled while queued");
                }
                !left
            });
            // Admit in order while a slot is free. A job that follows one still prefilling keeps its slot
            // and waits for it (`settle`), and the jobs after it go on.
            let (mut at, mut kept) = (0, 0);
            while live.len() + admitting.len() + kept < self.loaded.slots && at < arrived.len() {
                if arrived[at].follows.is_some_and(|l| admitting.iter().any(|a| a.job.id == l)) {
                    (at, kept) = (at + 1, kept + 1);
                    continue;
                }
                let job = arrived.remove(at).expect("in range");
                self.state.admitted();
                if let Some(a) = self.admit(job) {
                    admitting.push(a);
                }
            }
            self.state.set_free(self.loaded.slots - live.len() - admitting.len());
            while let Ok(reply) = self.pool.replies().try_recv() {
                self.reply(&mut admitting, reply);
            }
            self.hold = self.holding(&admitting, live.len());
            self.dispatch(&mut admitting);
            self.local_chunk(&mut admitting);
            self.settle(&mut admitting, &mut live, &mut arrived);
            if !live.is_empty() {
                // While a producer prefills on the cores decode runs on, decode's threads sleep between
                // parallel regions, to be woken ahead of the producer's (`Exec::set_awake`).
                let shared = admitting.iter().any(|a| a.in_flight);
                self.loaded.engine.model.exec.set_awake(!shared);
                self.round(&mut live);
            }
            // Slots freed this round (a sequence ended, a prefill failed) are free now: published before
            // the thread may block below, or for up to its wait (100 ms) the queue would refuse requests
            // beside empty slots.
            self.state.set_free(self.loaded.slots - live.len() - admitting.len());
            self.metrics.running.set((live.len() + admitting.len()) as i64);
            self.metrics.kv_usage(&self.loaded.engine.kv.usage());
            if !live.is_empty() {
                continue;
            }
            // A local chunk to run goes on at once; a remote prefill waiting for a busy producer waits
            // below, for the reply that frees one (going round instead spun a core the producers need).
            if admitting.iter().any(|a| !a.in_flight && !a.prefill.is_remote()) {
                continue;
            }
            if !queue_open && admitting.is_empty() && arrived.is_empty() {
                return;
            }
            // Nothing to compute: wait for a request or a reply, looking at `stop` now and then (and at
            // the queued requests' clients: one that left is dropped on the next pass).
            let requests = if queue_open { queue.clone() } else { crossbeam_channel::never() };
            crossbeam_channel::select! {
                recv(requests) -> job => match job {
                    Ok(job) => arrived.push_back(job),
                    Err(_) => queue_open = false,
                },
                recv(self.pool.replies()) -> reply => {
                    if let Ok(reply) = reply {
                        self.reply(&mut admitting, reply);
                    }
                }
                default(self.hold.map_or(Duration::from_millis(100), |until| until.saturating_duration_since(Instant::now()))) => {}
            }
        }
    }

    /// Opens a sequence for a request (or answers it: cancelled while queued, or refused by the cache).
    fn admit(&mut self, job: Job) -> Option<Admitting> {
        let admitted = Instant::now();
        let (engine, remote) = (&mut self.loaded.engine, self.remote.as_ref());
        let prefill = opened(self.metrics, &job, || engine.begin(&job.request, remote))?;
        Some(Admitting { job, prefill, admitted, in_flight: false, producer: None, failed: None })
    }

    /// A producer's reply: its span taken into the cache, then the producer handed back for the next
    /// reply of its batch, or, its batch done, given the next batch of its own (the next chunks of its
    /// requests, for it keeps their K/V, and new ones), or at rest. A failure falls back to local
    /// prefill, or fails the request, as `--on-producer-failure` says.
    fn reply(&mut self, admitting: &mut [Admitting], reply: super::prefill::Reply) {
        let super::prefill::Reply { index, mut producer, seq, result, rest } = reply;
        let at = admitting.iter().position(|a| a.prefill.seq() == seq).expect("a prefill in flight stays admitted");
        let a = &mut admitting[at];
        let taken = result.and_then(|pending| producer.take(pending, &mut self.loaded.engine.kv, seq));
        self.metrics.producer(index, producer.metrics());
        // A producer that did not run at start-up, or came back restarted, says now what it is.
        // (Not from a producer that is not running: it would say nothing, and forget what it said.)
        let now = Remote::of(&producer);
        if producer.described().is_some() && self.remotes[index] != now {
            self.remotes[index] = now;
            self.remote = Remote::together(&self.remotes);
        }
        a.prefill.asked(&producer);
        a.in_flight = false;
        match taken {
            Ok(times) => {
                a.prefill.remote_by(&producer);
                a.prefill.remote_done(times);
                a.producer = Some(index);
                // A cancelled request's span was still taken, so the ring stays in step; it is dropped
                // with the sequence.
                if a.prefill.next_call(a.head()).is_none() || a.job.events.is_closed() {
                    // The request's last call to this producer (or it was cancelled).
                    producer.release(a.prefill.request_id());
                }
            }
            Err(e) => {
                producer.release(a.prefill.request_id());
                self.fall_back(a, e);
            }
        }
        let sent = if !rest.is_empty() {
            self.pool.await_rest(index, producer, rest)
        } else if self.owed(admitting, index, &mut producer) {
            // It stopped and waits out its backoff (or will not start again): new prompts go to a producer
            // that can take them now, or wait (`Pool::ready`), rather than being sent here to be refused.
            self.pool.rest(index, producer);
            Ok(())
        } else {
            let works = self.gather(admitting, index);
            if works.is_empty() {
                self.pool.rest(index, producer);
                Ok(())
            } else {
                Self::mark(admitting, &works, true);
                self.metrics.prefill_batch.observe(works.len() as f64);
                self.pool.resubmit(index, producer, works)
            }
        };
        if let Err(lost) = sent {
            // Its waiter is gone (the pool is stopping): the rest is prefilled here, not by another
            // producer, which has none of the requests' K/V.
            let name = self.remotes[index].name.clone();
            for work in lost {
                let Some(a) = admitting.iter_mut().find(|a| a.prefill.seq() == work.seq) else { continue };
                a.in_flight = false;
                let source = std::io::Error::other("its producer's waiter thread is gone");
                self.fall_back(a, ProducerError::Io { name: name.clone(), op: "prefill", source });
            }
        }
    }

    /// What is owed to producer `index`, at hand between batches: the releases of prefills that ended
    /// between its chunks, and the fallback of those it was on whose earlier chunks its process no longer
    /// holds (it stopped, or was started again: a new process would refuse the next chunk, or compute
    /// it without them). Returns whether it refuses work now (`Producer::refusing`).
    fn owed(&mut self, admitting: &mut [Admitting], index: usize, producer: &mut Producer) -> bool {
        for id in std::mem::take(&mut self.releases[index]) {
            producer.release(id);
        }
        for a in admitting.iter_mut() {
            let on = a.producer == Some(index) && !a.in_flight && a.failed.is_none() && a.prefill.is_remote();
            if on && !a.job.events.is_closed() && a.prefill.next_chunk(a.head()).is_some() {
                let id = a.prefill.request_id();
                if !producer.holds(id) {
                    self.fall_back(a, producer.lost(id));
                }
            }
        }
        producer.refusing(Instant::now()).is_some()
    }

    /// The next batch for producer `index`: the next chunks of the prefills it is on (it keeps their
    /// K/V), then the first chunks of waiting ones, in admission order, within [`Loaded::batch_tokens`]
    /// (one chunk at least).
    fn gather(&self, admitting: &[Admitting], index: usize) -> Vec<super::prefill::Work> {
        let waiting =
            |a: &&Admitting| !a.in_flight && a.failed.is_none() && a.prefill.is_remote() && !a.job.events.is_closed();
        let own = admitting.iter().filter(waiting).filter(|a| a.producer == Some(index));
        // New prompts wait a little for others to join them ([`hold_until`]).
        let held = self.hold.is_some_and(|until| Instant::now() < until);
        let new = admitting.iter().filter(waiting).filter(|a| a.producer.is_none() && !held);
        let mut works = Vec::new();
        let mut tokens = 0;
        for a in own.chain(new) {
            let Some(call) = a.prefill.next_call(a.head()) else { continue };
            if !works.is_empty() && tokens + call.tokens.len() > self.loaded.batch_tokens {
                break;
            }
            tokens += call.tokens.len();
            works.push(super::prefill::Work { seq: a.prefill.seq(), call });
        }
        works
    }

    /// Marks the requests of `works` in flight (or not, when a batch could not be sent after all).
    fn mark(admitting: &mut [Admitting], works: &[super::prefill::Work], in_flight: bool) {
        for a in admitting.iter_mut().filter(|a| works.iter().any(|w| w.seq == a.prefill.seq())) {
            a.in_flight = in_flight;
        }
    }

    /// `a`'s remote prefill failed with `e`: it goes on locally, in pieces, or fails (`--on-producer-failure
    /// fail`).
    fn fall_back(&mut self, a: &mut Admitting, e: ProducerError) {
        let head = &a.job.request.prompt[..a.job.request.prompt.len() - 1];
        self.loaded.engine.fall_back(&mut a.prefill, head, e);
        if self.loaded.on_failure == OnFailure::Fail {
            let e = a.prefill.take_fallback().expect("just set");
            a.failed = Some(EngineError::from(e).to_string());
        }
    }

    /// Until when prompts that have not gone to a producer wait for more ([`hold_until`]).
    fn holding(&self, admitting: &[Admitting], live: usize) -> Option<Instant> {
        let first = admitting
            .iter()
            .filter(|a| a.producer.is_none() && !a.in_flight && a.prefill.is_remote())
            .map(|a| a.admitted)
            .min();
        let free = live + admitting.len() < self.loaded.slots;
        hold_until(Instant::now(), first, free, self.loaded.batch_wait)
    }

    /// Gives each producer at rest that should take work its next batch ([`Scheduler::gather`]).
    fn dispatch(&mut self, admitting: &mut [Admitting]) {
        for index in self.pool.ready() {
            let Some((at, mut producer)) = self.pool.take_idle(index) else { continue };
            let refusing = self.owed(admitting, index, &mut producer);
            self.pool.put_back((at, producer), index);
            if refusing {
                continue;
            }
            let works = self.gather(admitting, index);
            if works.is_empty() {
                continue;
            }
            let count = works.len();
            Self::mark(admitting, &works, true);
            if let Err(works) = self.pool.submit(index, works) {
                Self::mark(admitting, &works, false);
                return;
            }
            self.metrics.prefill_batch.observe(count as f64);
        }
    }

    /// One chunk of the first prefill that runs locally, between decode rounds.
    fn local_chunk(&mut self, admitting: &mut [Admitting]) {
        let local = admitting.iter_mut().find(|a| {
            !a.in_flight
                && a.failed.is_none()
                && !a.prefill.is_remote()
                && !a.job.events.is_closed()
                && a.prefill.next_chunk(a.head()).is_some()
        });
        if let Some(a) = local {
            let (start, tokens) = a.prefill.next_chunk(a.head()).expect("checked");
            let tokens = tokens.to_vec();
            if let Err(e) = self.loaded.engine.prefill_chunk(&mut a.prefill, start, &tokens) {
                a.failed = Some(EngineError::from(e).to_string());
            }
        }
    }

    /// Ends what cannot go on (cancelled, failed) and makes complete prefills live.
    fn settle(
        &mut self,
        admitting: &mut Vec<Admitting>,
        live: &mut Vec<Running<'t>>,
        arrived: &mut std::collections::VecDeque<Job>,
    ) {
        let mut i = 0;
        while i < admitting.len() {
            let a = &admitting[i];
            let complete = a.prefill.next_chunk(a.head()).is_none();
            let cancelled = a.job.events.is_closed();
            if a.in_flight || !(complete || cancelled || a.failed.is_some()) {
                i += 1;
                continue;
            }
            let Admitting { job, prefill, admitted, failed, producer, .. } = admitting.remove(i);
            if let Some(p) = producer.filter(|_| !complete && prefill.is_remote()) {
                // Ended between two of its chunks at a producer, which keeps the K/V of the first.
                self.releases[p].push(prefill.request_id());
            }
            if cancelled || failed.is_some() {
                // Not running any more, and what its prefill committed counted, before its client hears.
                self.metrics.running.dec();
                self.metrics.kv_bytes.inc_by(prefill.bytes());
            }
            if cancelled {
                self.metrics.requests.with_label_values(&["cancelled"]).inc();
                tracing::info!(id = job.id, "cancelled during prefill");
                self.loaded.engine.abandon(prefill);
            } else if let Some(e) = failed {
                tracing::warn!(id = job.id, "failed: {e}");
                self.metrics.requests.with_label_values(&["failed"]).inc();
                self.loaded.engine.abandon(prefill);
                self.metrics.kv_usage(&self.loaded.engine.kv.usage());
                let _ = job.events.send(Event::Failed(e));
            } else {
                // Its last prompt token runs in the next round, batched with the others' steps.
                let l = self.loaded.engine.go_live(prefill, &job.request);
                // The jobs that follow it, where slots are free: live from copies of its K/V.
                while live.len() + admitting.len() + 1 < self.loaded.slots {
                    let follows = |f: &Job| f.follows == Some(job.id) && f.request.prompt == job.request.prompt;
                    let Some(at) = arrived.iter().position(follows) else { break };
                    let follower = arrived.remove(at).expect("in range");
                    self.state.admitted();
                    live.extend(self.follow(follower, &l));
                }
                live.push(Running::new(job, l, self.tokenizer, admitted));
            }
        }
    }

    /// Makes `job` live from a copy of `leader`'s K/V (or answers it: cancelled while queued, or
    /// refused by the cache).
    fn follow(&mut self, job: Job, leader: &Live) -> Option<Running<'t>> {
        let admitted = Instant::now();
        let engine = &mut self.loaded.engine;
        let l = opened(self.metrics, &job, || engine.fork(leader, &job.request, admitted))?;
        Some(Running::new(job, l, self.tokenizer, admitted))
    }

    /// One batched step of every live sequence, then each token on to its client.
    fn round(&mut self, live: &mut Vec<Running<'t>>) {
        let steps = self.loaded.engine.step_many(&mut live.iter_mut().map(|r| &mut r.live).collect::<Vec<_>>());
        let ended: Vec<bool> =
            live.iter_mut().zip(steps).map(|(r, step)| advance(self.metrics, r, step).is_break()).collect();
        for i in (0..live.len()).rev() {
            if ended[i] {
                let r = live.remove(i);
                end(self.loaded, self.metrics, r);
            }
        }
    }
}

/// Until when new prompts (the first of them admitted at `first`) wait, at `now`, for others to join
/// their batch: `wait` after the first, while a slot is `free` for another; `None` when they go now.
///
/// Requests sent together reach the engine thread apart (each is read, parsed and tokenized on its
/// own: 0.1-1 ms between four sent at once on a 2-core VM), and the first would go to an idle producer
/// alone, the rest after it; then the first decodes alone while they prefill, and they finish last.
/// Waiting a few milliseconds lets a burst prefill in one batch and decode together from its first
/// step, as Triton's dynamic batcher waits out its `max_queue_delay`. A lone request pays the wait.
fn hold_until(now: Instant, first: Option<Instant>, free: bool, wait: Duration) -> Option<Instant> {
    let until = first? + wait;
    (free && now < until).then_some(until)
}

/// A live request: its engine sequence and its text so far.
struct Running<'t> {
    job: Job,
    live: Live,
    stream: TextStream<'t>,
    /// Bytes of text sent.
    sent: usize,
    /// Tokens whose log-probabilities were sent.
    logprobs_sent: usize,
    /// Per token so far, the length of the shown text once it was pushed.
    ends: Vec<usize>,
    last_token: Option<Instant>,
    stopped_by_string: bool,
    cancelled: bool,
    failed: Option<String>,
    admitted: Instant,
}

/// What `open` opened for `job`, counted as running; `None` where `job` is answered instead: its client
/// left while it was queued, or `open` failed (the cache refused it).
fn opened<T>(metrics: &Metrics, job: &Job, open: impl FnOnce() -> Result<T, EngineError>) -> Option<T> {
    if job.events.is_closed() {
        metrics.requests.with_label_values(&["cancelled"]).inc();
        tracing::info!(id = job.id, "cancelled while queued");
        return None;
    }
    match open() {
        Ok(opened) => {
            metrics.running.inc();
            Some(opened)
        }
        Err(e) => {
            tracing::warn!(id = job.id, "failed: {e}");
            metrics.requests.with_label_values(&["failed"]).inc();
            let _ = job.events.send(Event::Failed(e.to_string()));
            None
        }
    }
}

impl<'t> Running<'t> {
    /// A live sequence with nothing sent yet.
    fn new(job: Job, live: Live, tokenizer: &'t Tokenizer, admitted: Instant) -> Self {
        Running {
            job,
            live,
            stream: TextStream::new(tokenizer),
            sent: 0,
            logprobs_sent: 0,
            ends: Vec::new(),
            last_token: None,
            stopped_by_string: false,
            cancelled: false,
            failed: None,
            admitted,
        }
    }
}

/// `r`'s step: its token sent on as text; `Break` when it has ended (EOS, length, a stop string, its
/// client gone, an error).
fn advance(metrics: &Metrics, r: &mut Running<'_>, step: Result<Option<u32>, EngineError>) -> ControlFlow<()> {
    let id = match step {
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
    } else {
        metrics.prompt_tokens.inc_by(r.job.request.prompt.len() as u64);
    }
    metrics.generation_tokens.inc();
    r.stream.push(id);
    let text = r.stream.shown();
    r.ends.push(text.len());
    // Before `min_tokens` are out, no stop string ends the text either (as vLLM has it): one ends it
    // only where it ends in the text of that token or a later one. What could grow into one is held
    // back all the same.
    let floor = match r.job.request.min_tokens {
        0 | 1 => 0,
        m => r.ends.get(m - 2).copied().unwrap_or(usize::MAX),
    };
    let (end, stop) = safe_end(text, r.sent, &r.job.stop, floor);
    if end > r.sent {
        // The log-probabilities of the tokens this text completes; a token whose text is still held
        // back (it may become a stop string) goes with the chunk that sends it.
        let lps = r.live.logprobs();
        let ready = r.ends.partition_point(|&e| e <= end).min(lps.len()).max(r.logprobs_sent);
        let logprobs = lps[r.logprobs_sent..ready].to_vec();
        r.logprobs_sent = ready;
        if r.job.events.send(Event::Text(text[r.sent..end].to_string(), logprobs)).is_err() {
            r.cancelled = true;
            return ControlFlow::Break(());
        }
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
/// string; and whether a stop string that ends past byte `floor` ends it.
fn safe_end(text: &str, sent: usize, stop: &[String], floor: usize) -> (usize, bool) {
    // A stop string anywhere in the unsent part (or straddling its start) ends the text there.
    let longest = stop.iter().map(String::len).max().unwrap_or(0);
    let mut from = sent.saturating_sub(longest);
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    // Every occurrence, overlapping ones too (`match_indices` skips them: in "aaa", "aa" at 1 after 0),
    // for one that ends before the floor may overlap the first that ends past it.
    let first = |s: &String| {
        let mut at = from;
        while let Some(i) = text[at..].find(s.as_str()) {
            if at + i + s.len() > floor {
                return Some(at + i);
            }
            at += i + text[at + i..].chars().next().map_or(1, char::len_utf8);
        }
        None
    };
    if let Some(at) = stop.iter().filter_map(first).min() {
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
    let Running { job, live, stream, sent, logprobs_sent, stopped_by_string, cancelled, failed, admitted, .. } = r;
    let gen = loaded.engine.finish(live);
    // Its pages and its slot are free now, and what its prefill committed counted, before its client
    // hears of it (a client that reads `/metrics` once it has its answer sees it gone).
    metrics.kv_usage(&loaded.engine.kv.usage());
    metrics.running.dec();
    metrics.kv_bytes.inc_by(gen.bytes);
    let events = &job.events;
    if let Some(e) = failed {
        tracing::warn!(id = job.id, "failed: {e}");
        metrics.requests.with_label_values(&["failed"]).inc();
        let _ = events.send(Event::Failed(e));
        return;
    }
    if cancelled {
        // Counted before it is logged, so that whoever reads the log line finds it counted.
        metrics.requests.with_label_values(&["cancelled"]).inc();
        tracing::info!(
            id = job.id,
            prompt = job.request.prompt.len(),
            output = gen.output.len(),
            "cancelled by its client"
        );
        return;
    }
    // What is left once nothing can grow into a stop string any more, and the log-probabilities of
    // every token not yet reported (a stop string's own tokens included: they were generated).
    let rest =
        if stopped_by_string { String::new() } else { stream.text().get(sent..).unwrap_or_default().to_string() };
    let logprobs = gen.logprobs.get(logprobs_sent..).unwrap_or_default().to_vec();
    if !rest.is_empty() || !logprobs.is_empty() {
        let _ = events.send(Event::Text(rest, logprobs));
    }
    // A stop string completed by the last token allowed is still a stop (the engine, which does not see
    // stop strings, says length).
    let finish = match gen.finish {
        _ if stopped_by_string => "stop",
        Finish::Length => "length",
        Finish::Eos | Finish::Stopped => "stop",
    };
    let report = &gen.report;
    let where_ = if report.remote { "remote" } else { "local" };
    let decode_tps = gen.output.len().saturating_sub(1) as f64 / gen.decode.as_secs_f64().max(1e-9);
    // From acceptance to admission: the wait for a slot, which `ttft` (from admission, as in `generate`)
    // leaves out and the TTFT histogram counts.
    let queued = admitted.saturating_duration_since(job.accepted);
    let pdhost = json!({
        "prefill": where_,
        "producer": report.producer.as_deref().unwrap_or("local"),
        "layout": if report.remote { report.layout } else { None },
        "wire_dtype": report.wire_dtype.filter(|_| report.remote).map(|d| d.name()),
        "transport": report.transport.as_deref().filter(|_| report.remote),
        "spans": gen.spans, "bytes": gen.bytes,
        "prefix_hit_tokens": report.prefix_hit,
        "fallback_reason": report.fallback.as_ref().map(|e| format!("{}: {e}", e.kind())),
        "queue_ms": queued.as_secs_f64() * 1e3,
        "ttft_ms": gen.ttft.as_secs_f64() * 1e3,
        "decode_ms": gen.decode.as_secs_f64() * 1e3,
        "logits_xxh3": format!("{:016x}", gen.logits_hash),
        "output_ids": gen.output,
        // The sampling seed (drawn where the request named none), so that the reply can be had again.
        "seed": match job.request.sampling {
            Sampling::Sample { seed, .. } => Some(seed),
            Sampling::Greedy => None,
        },
    });
    // The metrics first: a client that reads `/metrics` once it has its answer, or once the request is
    // logged, sees it counted.
    metrics.requests.with_label_values(&["ok"]).inc();
    let how = if report.fallback.is_some() { "fallback" } else { where_ };
    metrics.prefills.with_label_values(&[how, report.producer.as_deref().unwrap_or("local")]).inc();
    metrics.prefix_hit_tokens.inc_by(report.prefix_hit);
    metrics.ttft.observe((queued + gen.ttft).as_secs_f64());
    metrics.e2e.observe(job.accepted.elapsed().as_secs_f64());
    tracing::info!(
        id = job.id,
        prompt = job.request.prompt.len(),
        output = gen.output.len(),
        prefill = where_,
        prefix_hit = report.prefix_hit,
        queue_ms = format_args!("{:.1}", queued.as_secs_f64() * 1e3),
        ttft_ms = format_args!("{:.1}", gen.ttft.as_secs_f64() * 1e3),
        tok_s = format_args!("{decode_tps:.1}"),
        finish,
        total_ms = format_args!("{:.1}", job.accepted.elapsed().as_secs_f64() * 1e3),
        fallback = report.fallback.as_ref().map_or("-", |e| e.kind()),
        "request"
    );
    let _ = events.send(Event::Done(Done { finish, completion_tokens: gen.output.len(), pdhost }));
}

#[cfg(test)]
mod tests {
    use super::{hold_until, safe_end, Duration, Instant};

    /// New prompts wait only while a slot is free for another, and at most the wait after the first of
    /// them; with no wait, or nothing waiting, they go at once.
    #[test]
    fn new_prompts_wait_for_others_only_with_room_for_them() {
        let t0 = Instant::now();
        let wait = Duration::from_millis(3);
        let at = |us| t0 + Duration::from_micros(us);
        assert_eq!(hold_until(at(500), Some(t0), true, wait), Some(at(3000)));
        assert_eq!(hold_until(at(500), Some(t0), false, wait), None, "no slot for another");
        assert_eq!(hold_until(at(3000), Some(t0), true, wait), None, "at most the wait");
        assert_eq!(hold_until(at(500), Some(t0), true, Duration::ZERO), None, "--batch-wait 0");
        assert_eq!(hold_until(at(500), None, true, wait), None, "no prompt waiting");
    }

    #[test]
    fn text_is_held_back_only_while_it_could_become_a_stop_string() {
        let stop = vec!["\n\n".to_string(), "END".to_string()];
        assert_eq!(safe_end("hello", 0, &stop, 0), (3, false));
        assert_eq!(safe_end("hello wor", 3, &stop, 0), (7, false));
        assert_eq!(safe_end("hello\n\nmore", 3, &stop, 0), (5, true));
        assert_eq!(safe_end("abEN", 2, &stop, 0), (2, false));
        assert_eq!(safe_end("abEND", 2, &stop, 0), (2, true));
        assert_eq!(safe_end("héllo", 0, &[], 0), (6, false));
        assert_eq!(safe_end("é", 0, &["xé".to_string()], 0), (0, false));
    }

    /// With `min_tokens`, a stop string ends the text only where it ends past the floor (the text
    /// before the min_tokens-th token): one completed earlier is text like any other, and never the
    /// end of a reply that then shows it.
    #[test]
    fn a_stop_string_before_min_tokens_is_text() {
        let dot = vec![".".to_string()];
        // " Paris" "." "\n" with min_tokens 3: the "." came second, so the reply goes on.
        assert_eq!(safe_end(" Paris.", 6, &dot, usize::MAX), (7, false));
        assert_eq!(safe_end(" Paris.\n", 7, &dot, 7), (8, false));
        assert_eq!(safe_end(" Paris.\nIt.", 8, &dot, 7), (10, true), "a later one ends it");
        // What could become a stop string is held back before min_tokens too, so that one the
        // min_tokens-th token completes is cut whole.
        let ab = vec!["ab".to_string()];
        assert_eq!(safe_end("xa", 0, &ab, usize::MAX), (1, false));
        assert_eq!(safe_end("xab", 1, &ab, 2), (1, true));
        // One that ends before the floor does not hide an overlapping one that ends past it.
        let aa = vec!["aa".to_string()];
        assert_eq!(safe_end("aaa", 2, &aa, 2), (2, true));
    }
}
