//! Prefill off the engine thread. Each producer has a long-lived waiter thread; the engine thread hands
//! it the producer and one chunk, the waiter sends the request and waits (deadline, pidfd) for the
//! producer's reply, and hands the producer back with it. The engine thread then takes the span out of
//! the ring into its cache between decode rounds, so decode never waits for a producer, and N producers
//! prefill N prompts at once. Ownership of each `Producer` moves with the messages: no locks.

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
}

/// The producers and their waiters.
#[derive(Debug)]
pub struct Pool {
    /// Producers at rest, by index.
    idle: Vec<(usize, Producer)>,
    waiters: Vec<Sender<(Producer, Work)>>,
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
            let (tx, rx) = crossbeam_channel::bounded::<(Producer, Work)>(1);
            let reply_tx = reply_tx.clone();
            // Long-lived: a producer this thread restarts gets its parent-death signal from it.
            std::thread::Builder::new().name(format!("pdhost-prefill-{index}")).spawn(move || {
                for (mut producer, work) in rx {
                    // A panic here would lose the reply, and with it the request's slot and this
                    // producer for good: it becomes the request's failure instead, and the producer,
                    // left mid-exchange, is stopped (the next request starts a new one).
                    let submitted =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| producer.submit(&work.call)));
                    let result = submitted.unwrap_or_else(|_| {
                        producer.shutdown();
                        Err(ProducerError::Io {
                            name: producer.name().to_string(),
                            op: "prefill",
                            source: std::io::Error::other("the host's side of the exchange panicked"),
                        })
                    });
                    if reply_tx.send(Reply { index, producer, seq: work.seq, result }).is_err() {
                        return;
                    }
                }
            })?;
            waiters.push(tx);
        }
        Ok(Pool { idle: producers.into_iter().enumerate().collect(), waiters, replies, _replies_open: reply_tx })
    }

    /// Gives `work` to a producer at rest; `Err(work)` when it should wait.
    ///
    /// The producer at rest that went idle last is taken, of those that would take a request now. One
    /// that would refuse it without a process being asked (waiting out a restart's backoff, or unable to
    /// start) is passed over: its refusal is not this request's failure, and it would come back at once,
    /// first in line for every request after, while a healthy producer sat idle. The work waits while
    /// another producer is busy or one is backing off; only when every producer refuses for good (its
    /// start refused, its restarts at their limit) does it go to one of them, whose refusal the request
    /// then falls back or fails on.
    pub fn submit(&mut self, work: Work) -> Result<(), Work> {
        let now = std::time::Instant::now();
        let ready = self.idle.iter().rposition(|(_, p)| p.refusing(now).is_none());
        let at = match ready {
            Some(at) => at,
            None if self.idle.len() < self.waiters.len() => return Err(work),
            None if self.idle.iter().any(|(_, p)| matches!(p.refusing(now), Some(Some(_)))) => return Err(work),
            None => self.idle.len() - 1,
        };
        let (index, producer) = self.idle.remove(at);
        match self.waiters[index].send((producer, work)) {
            Ok(()) => Ok(()),
            Err(crossbeam_channel::SendError((producer, work))) => {
                self.idle.insert(at, (index, producer));
                Err(work)
            }
        }
    }

    /// Where replies arrive.
    pub fn replies(&self) -> &Receiver<Reply> {
        &self.replies
    }

    /// A producer is back from its reply, at rest again.
    pub fn rest(&mut self, index: usize, producer: Producer) {
        self.idle.push((index, producer));
    }

    /// Hands a producer back out for the next chunk of the prefill it is on (a backend keeps the K/V of
    /// the request in progress, so every chunk of a request goes to the same producer). On `Err` the
    /// producer is at rest again and the work was not sent.
    pub fn resubmit(&mut self, index: usize, producer: Producer, work: Work) -> Result<(), Work> {
        self.waiters[index].send((producer, work)).map_err(|crossbeam_channel::SendError((producer, work))| {
            self.rest(index, producer);
            work
        })
    }
}
