//! Prefill off the engine thread. Each producer has a long-lived waiter thread; the engine thread hands
//! it the producer and a batch of chunks (of different requests), the waiter sends them and waits
//! (deadline, pidfd) for the producer's reply to the first, and hands the producer back with it and the
//! rest of the batch. The engine thread then takes the span out of the ring into its cache between decode
//! rounds, so decode never waits for a producer, and hands the producer back to the waiter for the next
//! reply of the batch, until none is left. N producers prefill N batches at once. Ownership of each
//! `Producer` moves with the messages: no locks.

use crossbeam_channel::{Receiver, Sender};

use crate::kv::SeqId;
use crate::supervisor::{Pending, PrefillCall, Producer, ProducerError};

/// One chunk to prefill.
#[derive(Debug)]
pub struct Work {
    /// The sequence it is for (the engine thread's key).
    pub seq: SeqId,
    /// The request id, positions, tokens (and context) to prefill.
    pub call: PrefillCall,
}

/// What a waiter is handed with its producer.
#[derive(Debug)]
enum Order {
    /// Send these chunks, as one batch where there are several, and wait for the first's reply.
    Send(Vec<Work>),
    /// Wait for the reply to the first of these, the rest of a batch sent before.
    Await(Vec<Work>),
}

/// A waiter's answer: the producer back, and its reply for `seq`.
#[derive(Debug)]
pub struct Reply {
    /// Which producer.
    pub index: usize,
    /// The producer, to take the span with and to give out again.
    pub producer: Producer,
    /// The sequence the work was for.
    pub seq: SeqId,
    /// The reply: a span waiting in the ring, or why there is none.
    pub result: Result<Pending, ProducerError>,
    /// The calls of its batch still to be answered, in order: for [`Pool::await_rest`] once the span is
    /// taken.
    pub rest: Vec<Work>,
}

/// The producers and their waiters.
#[derive(Debug)]
pub struct Pool {
    /// Producers at rest, by index.
    idle: Vec<(usize, Producer)>,
    waiters: Vec<Sender<(Producer, Order)>>,
    replies: Receiver<Reply>,
    /// Keeps `replies` connected with no waiter (`--producer local`): a disconnected channel is always
    /// ready, and the engine thread's idle wait on it would spin.
    _replies_open: Sender<Reply>,
}

impl Pool {
    /// Starts one waiter thread per producer.
    pub fn new(producers: Vec<Producer>) -> std::io::Result<Self> {
        let (reply_tx, replies) = crossbeam_channel::unbounded();
        let mut waiters = Vec::new();
        for index in 0..producers.len() {
            let (tx, rx) = crossbeam_channel::bounded::<(Producer, Order)>(1);
            let reply_tx = reply_tx.clone();
            // Long-lived: a producer this thread restarts gets its parent-death signal from it.
            std::thread::Builder::new().name(format!("pdhost-prefill-{index}")).spawn(move || {
                for (mut producer, order) in rx {
                    let (mut works, sent) = match order {
                        Order::Send(works) => (works, true),
                        Order::Await(works) => (works, false),
                    };
                    let calls: Vec<_> = if sent { works.iter().map(|w| w.call.clone()).collect() } else { Vec::new() };
                    let first = works.remove(0);
                    // A panic here would lose the reply, and with it the request's slot and this
                    // producer for good: it becomes the request's failure instead, and the producer,
                    // left mid-exchange, is stopped (the next request starts a new one; the rest of
                    // its batch then fails at once, as after any stop).
                    let replied = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        if calls.is_empty() {
                            producer.next(&first.call)
                        } else {
                            producer.submit_batch(&calls)
                        }
                    }));
                    let result = replied.unwrap_or_else(|_| {
                        producer.shutdown();
                        Err(ProducerError::Io {
                            name: producer.name().to_string(),
                            op: "prefill",
                            source: std::io::Error::other("the host's side of the exchange panicked"),
                        })
                    });
                    if reply_tx.send(Reply { index, producer, seq: first.seq, result, rest: works }).is_err() {
                        return;
                    }
                }
            })?;
            waiters.push(tx);
        }
        Ok(Pool { idle: producers.into_iter().enumerate().collect(), waiters, replies, _replies_open: reply_tx })
    }

    /// The producers at rest that should be given work now, by index, most wanted first.
    ///
    /// Those that would take a request now, the one that went idle last first. One that would refuse
    /// it without a process being asked (waiting out a restart's backoff, or unable to start) is passed
    /// over: its refusal is not a request's failure, and it would come back at once, first in line for
    /// every request after, while a healthy producer sat idle. Work waits while another producer is busy
    /// or one is backing off; only when every producer refuses for good (its start refused, its restarts
    /// at their limit) is one of them offered, whose refusal the requests then fall back or fail on.
    pub fn ready(&self) -> Vec<usize> {
        let now = std::time::Instant::now();
        let ready: Vec<usize> =
            self.idle.iter().rev().filter(|(_, p)| p.refusing(now).is_none()).map(|&(i, _)| i).collect();
        let waiting = self.idle.len() < self.waiters.len()
            || self.idle.iter().any(|(_, p)| matches!(p.refusing(now), Some(Some(_))));
        match self.idle.last() {
            Some(&(last, _)) if ready.is_empty() && !waiting => vec![last],
            _ => ready,
        }
    }

    /// Gives `works` (at least one; chunks of different requests) to producer `index`, at rest, as one
    /// batch. On `Err` the producer is still at rest and nothing was sent.
    pub fn submit(&mut self, index: usize, works: Vec<Work>) -> Result<(), Vec<Work>> {
        assert!(!works.is_empty(), "a batch holds a chunk at least");
        let Some(at) = self.idle.iter().position(|&(i, _)| i == index) else { return Err(works) };
        let (_, producer) = self.idle.remove(at);
        self.send(index, producer, Order::Send(works))
    }

    /// Takes producer `index` from rest for a moment, with its place among those at rest
    /// ([`Pool::put_back`]).
    pub fn take_idle(&mut self, index: usize) -> Option<(usize, Producer)> {
        let at = self.idle.iter().position(|&(i, _)| i == index)?;
        Some((at, self.idle.remove(at).1))
    }

    /// Puts back what [`Pool::take_idle`] took, where it was.
    pub fn put_back(&mut self, (at, producer): (usize, Producer), index: usize) {
        self.idle.insert(at, (index, producer));
    }

    /// Where replies arrive.
    pub fn replies(&self) -> &Receiver<Reply> {
        &self.replies
    }

    /// A producer is back from its reply, at rest again.
    pub fn rest(&mut self, index: usize, producer: Producer) {
        self.idle.push((index, producer));
    }

    /// Hands a producer back out for a batch of its own (the next chunks of prefills it is on: a backend
    /// keeps the K/V of its requests in progress, so every chunk of a request goes to the same producer),
    /// straight from its reply. On `Err` the producer is at rest again and nothing was sent.
    pub fn resubmit(&mut self, index: usize, producer: Producer, works: Vec<Work>) -> Result<(), Vec<Work>> {
        self.send(index, producer, Order::Send(works))
    }

    /// Hands a producer back to its waiter for the reply to the first of `rest` (a batch's calls still
    /// unanswered), once the span before it was taken. On `Err` the producer is at rest again.
    pub fn await_rest(&mut self, index: usize, producer: Producer, rest: Vec<Work>) -> Result<(), Vec<Work>> {
        self.send(index, producer, Order::Await(rest))
    }

    fn send(&mut self, index: usize, producer: Producer, order: Order) -> Result<(), Vec<Work>> {
        self.waiters[index].send((producer, order)).map_err(|crossbeam_channel::SendError((producer, order))| {
            self.rest(index, producer);
            match order {
                Order::Send(works) | Order::Await(works) => works,
            }
        })
    }
}
