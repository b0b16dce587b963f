//! When a failed producer may start again: a backoff that doubles with each failure in a row, and a cap on
//! restarts within a sliding window.
//!
//! [`Restarts`] keeps no clock of its own: every call is given `now`, so that its rules are tested by
//! stepping an `Instant` forward instead of sleeping (the supervisor passes `Instant::now()`).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// How often and how fast a failed producer is restarted.
#[derive(Clone, Copy, Debug)]
pub struct RestartPolicy {
    /// Wait before the first restart after a failure; doubles on each consecutive failure.
    pub initial_backoff: Duration,
    /// Longest wait.
    pub max_backoff: Duration,
    /// Most restarts within `window`; past that, requests fail with `restart_limit` until the window
    /// moves on.
    pub max_restarts: u32,
    /// The window.
    pub window: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
            max_restarts: 10,
            window: Duration::from_secs(60),
        }
    }
}

/// Why a start is refused now. Neither involves a process, so neither lengthens the backoff.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Refused {
    /// The last failure's backoff has `wait` left.
    BackingOff { wait: Duration },
    /// `restarts` restarts fill the window; the oldest leaves it in `wait`.
    Limit { restarts: u32, wait: Duration },
}

/// The restart state of one supervised producer.
#[derive(Debug, Default)]
pub(super) struct Restarts {
    /// Whether the last process failed (or has not yet said it is ready): the next start is a restart.
    failed: bool,
    /// The current backoff; zero after a success.
    backoff: Duration,
    /// No restart before this.
    not_before: Option<Instant>,
    /// Times of the restarts still inside the window, oldest first.
    recent: VecDeque<Instant>,
}

impl Restarts {
    /// Whether a process may start at `now`. A start after a failure is a restart: it is counted at `now`
    /// and `Ok(true)` is returned. The first start, and one after a success, is `Ok(false)`.
    pub(super) fn admit(&mut self, policy: &RestartPolicy, now: Instant) -> Result<bool, Refused> {
        if !self.failed {
            return Ok(false);
        }
        while self.recent.front().is_some_and(|&t| now.saturating_duration_since(t) > policy.window) {
            self.recent.pop_front();
        }
        if self.recent.len() as u32 >= policy.max_restarts {
            let wait = match self.recent.front() {
                Some(&oldest) => policy.window.saturating_sub(now.saturating_duration_since(oldest)),
                // A cap of zero: never restart.
                None => policy.window,
            };
            return Err(Refused::Limit { restarts: self.recent.len() as u32, wait });
        }
        if let Some(wait) = self.not_before.and_then(|t| t.checked_duration_since(now)).filter(|w| !w.is_zero()) {
            return Err(Refused::BackingOff { wait });
        }
        self.recent.push_back(now);
        Ok(true)
    }

    /// What [`Restarts::admit`] would answer at `now`, without counting anything.
    pub(super) fn would_refuse(&self, policy: &RestartPolicy, now: Instant) -> Option<Refused> {
        if !self.failed {
            return None;
        }
        let recent = self.recent.iter().filter(|&&t| now.saturating_duration_since(t) <= policy.window);
        let restarts = recent.count() as u32;
        if restarts >= policy.max_restarts {
            // The wait is not needed by the callers, only that it is the limit.
            return Some(Refused::Limit { restarts, wait: policy.window });
        }
        let wait = self.not_before.and_then(|t| t.checked_duration_since(now)).filter(|w| !w.is_zero())?;
        Some(Refused::BackingOff { wait })
    }

    /// A process is starting: until it is ready it counts as failed, so that a crash during start-up makes
    /// the next start a restart.
    pub(super) fn starting(&mut self) {
        self.failed = true;
    }

    /// The process failed at `now`: the next start waits out a backoff twice the last one (the initial one
    /// after a success), at most the policy's longest.
    pub(super) fn failed(&mut self, policy: &RestartPolicy, now: Instant) {
        self.failed = true;
        self.backoff =
            if self.backoff.is_zero() { policy.initial_backoff } else { (self.backoff * 2).min(policy.max_backoff) };
        self.not_before = Some(now + self.backoff);
    }

    /// The process did its work: the backoff starts over. Restarts already counted stay in the window.
    pub(super) fn succeeded(&mut self) {
        self.failed = false;
        self.backoff = Duration::ZERO;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn policy() -> RestartPolicy {
        RestartPolicy { initial_backoff: 10 * MS, max_backoff: 35 * MS, max_restarts: 3, window: 1000 * MS }
    }

    #[test]
    fn the_backoff_doubles_up_to_its_cap_and_starts_over_after_a_success() {
        let (p, t0) = (policy(), Instant::now());
        let mut r = Restarts::default();
        assert_eq!(r.admit(&p, t0), Ok(false), "the first start is not a restart");
        r.starting();
        r.failed(&p, t0);
        assert_eq!(r.admit(&p, t0 + 4 * MS), Err(Refused::BackingOff { wait: 6 * MS }));
        assert_eq!(r.admit(&p, t0 + 10 * MS), Ok(true), "the backoff has passed exactly");
        r.failed(&p, t0 + 10 * MS);
        assert_eq!(r.admit(&p, t0 + 10 * MS), Err(Refused::BackingOff { wait: 20 * MS }));
        r.failed(&p, t0 + 10 * MS);
        assert_eq!(r.admit(&p, t0 + 10 * MS), Err(Refused::BackingOff { wait: 35 * MS }), "40 ms, capped");
        assert_eq!(r.admit(&p, t0 + 45 * MS), Ok(true));
        r.succeeded();
        assert_eq!(r.admit(&p, t0 + 45 * MS), Ok(false), "a healthy producer starts at once");
        r.failed(&p, t0 + 50 * MS);
        assert_eq!(r.admit(&p, t0 + 50 * MS), Err(Refused::BackingOff { wait: 10 * MS }), "from the start");
    }

    #[test]
    fn the_window_caps_restarts_until_the_oldest_leaves_it() {
        let (p, t0) = (policy(), Instant::now());
        let mut r = Restarts::default();
        r.starting();
        // Three restarts at 40, 140 and 240 ms, each after a failure whose backoff has passed.
        for i in 0..3u32 {
            let failure = t0 + i * 100 * MS;
            r.failed(&p, failure);
            assert_eq!(r.admit(&p, failure + 40 * MS), Ok(true), "restart {i}");
        }
        r.failed(&p, t0 + 300 * MS);
        // The fourth is refused until the first (at 40 ms) is more than a window old.
        assert_eq!(r.admit(&p, t0 + 400 * MS), Err(Refused::Limit { restarts: 3, wait: 640 * MS }));
        assert_eq!(r.admit(&p, t0 + 1040 * MS), Err(Refused::Limit { restarts: 3, wait: Duration::ZERO }));
        assert_eq!(r.admit(&p, t0 + 1041 * MS), Ok(true));
    }

    /// `would_refuse` answers as `admit` would, with the same kind of refusal, and counts nothing.
    #[test]
    fn would_refuse_foresees_admit_without_counting() {
        let (p, t0) = (policy(), Instant::now());
        let mut r = Restarts::default();
        assert_eq!(r.would_refuse(&p, t0), None, "a first start");
        r.starting();
        for i in 0..5u32 {
            let failure = t0 + i * 100 * MS;
            r.failed(&p, failure);
            for at in [failure, failure + 5 * MS, failure + 40 * MS] {
                let foreseen = r.would_refuse(&p, at);
                let again = r.would_refuse(&p, at);
                assert_eq!(foreseen, again, "nothing counted");
                match (foreseen, r.admit(&p, at)) {
                    (None, Ok(_)) => break,
                    (Some(Refused::BackingOff { wait }), Err(Refused::BackingOff { wait: w })) => assert_eq!(wait, w),
                    (Some(Refused::Limit { restarts, .. }), Err(Refused::Limit { restarts: n, .. })) => {
                        assert_eq!(restarts, n)
                    }
                    (foreseen, admitted) => panic!("at {i}: foreseen {foreseen:?}, admit {admitted:?}"),
                }
            }
        }
    }

    #[test]
    fn a_cap_of_zero_never_restarts() {
        let (p, t0) = (RestartPolicy { max_restarts: 0, ..policy() }, Instant::now());
        let mut r = Restarts::default();
        assert_eq!(r.admit(&p, t0), Ok(false));
        r.starting();
        r.failed(&p, t0);
        assert_eq!(r.admit(&p, t0 + 5000 * MS), Err(Refused::Limit { restarts: 0, wait: p.window }));
    }
}
