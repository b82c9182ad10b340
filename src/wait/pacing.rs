//! The pace of a queue head in notify mode: subscribed before each attempt,
//! then asleep until a wake-up, at most a backoff step or the holder's time
//! left; with no live subscription, jittered backoff as in spin mode.

use std::time::{Duration, Instant};

use crate::lease::{clamp, later};
use crate::wait::backoff::{Backoff, Snoozer, ThreadJitter};
use crate::wait::queue::{Feed, Waiter};

/// How long a head waits for its first subscription to be confirmed before
/// it falls back to backoff timing for this round.
const SUBSCRIBE_WAIT: Duration = Duration::from_millis(200);

/// The pace of a queue head in notify mode: subscribed before every
/// attempt, then asleep until a wake-up, at most a backoff step or the
/// holder's time left; with no live subscription, a jittered backoff step as
/// in spin mode.
pub(crate) struct HeadPacing {
    backoff: Backoff,
    step: u32,
    snoozer: Snoozer,
    live: bool,
}

impl HeadPacing {
    pub(crate) fn new(backoff: Backoff) -> HeadPacing {
        HeadPacing {
            backoff,
            step: 0,
            snoozer: Snoozer::new(backoff),
            live: false,
        }
    }

    /// Makes sure the release channel is subscribed before the attempt, so a
    /// release right after a failed attempt is announced; returns the
    /// wake-up count to wait on afterwards.
    pub(crate) fn before_attempt<G: Send + 'static>(
        &mut self,
        waiter: &Waiter<'_, G>,
        subscribe: impl FnOnce() -> Option<Box<dyn Feed>>,
        deadline: Option<Instant>,
    ) -> u64 {
        self.live = waiter.keep_subscribed(subscribe)
            || waiter.wait_subscribed(clamp(later(Instant::now(), SUBSCRIBE_WAIT), deadline));
        waiter.wakeups()
    }

    /// How long to sleep after a failed attempt; `left` is the holder's
    /// time left, when known.
    pub(crate) fn pause(&mut self, left: Option<Duration>) -> Duration {
        if !self.live {
            return self.snoozer.snooze(&mut ThreadJitter);
        }
        // A message wakes the head; this is only the safety net for an
        // expiry (no message) or a lost message.
        let ceiling = self.backoff.ceiling(self.step);
        self.step = self.step.saturating_add(1);
        left.map_or(ceiling, |left| {
            ceiling.min(left.saturating_add(Duration::from_millis(1)))
        })
    }
}
