//! What a lease is, in time: the local estimate of how long a lease that
//! Redis expires on its own clock is still ours, and the signal that tells
//! a holder it is gone.
//!
//! The lowest layer of the crate: it knows nothing of Redis, connections or
//! lock types. Everything here is pure arithmetic on `Instant`s (unit tested
//! without Redis) or a condition variable.
//!
//! Invariant: a local estimate never exceeds what Redis allows. It counts
//! from the moment the request *left* (so Redis's own deadline is never
//! earlier) and takes off a drift allowance.

pub(crate) mod loss;

/// What an `unlock()` of a lock type that nests did: the answer of
/// [`LockGuard::unlock`](crate::LockGuard::unlock) (a nested guard of the
/// thread's hold) and [`ReentrantGuard::unlock`](crate::ReentrantGuard::unlock)
/// (a hold of the owner's in Redis).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unlocked {
    /// Only this guard's share was given up: other holds remain (another
    /// guard of the same hold on this thread, or other holds of this owner
    /// in Redis), and the lock stays held.
    StillHeld,
    /// The last hold: the lock was released in Redis (or handed on to a
    /// waiting thread of this client).
    Released,
}

use std::time::{Duration, Instant};

/// The safety margin taken off the local estimate of a lease: clocks drift,
/// and Redis expires keys on its own clock. 1 % of the ttl plus 2 ms, the
/// allowance the Redlock description uses.
pub(crate) fn drift(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

/// What is left of a lease that Redis was asked to expire `ttl` after
/// `sent` (the moment the request left, so Redis's own deadline is never
/// earlier), seen at `now`, minus the drift allowance.
pub(crate) fn remaining(sent: Instant, ttl: Duration, now: Instant) -> Duration {
    (sent + ttl)
        .saturating_duration_since(now)
        .saturating_sub(drift(ttl))
}

/// The moment a lease sent at `sent` for `ttl` has no validity left.
pub(crate) fn local_expiry(sent: Instant, ttl: Duration) -> Instant {
    sent + ttl.saturating_sub(drift(ttl))
}

/// `now + wait`, or a day from now when that cannot be expressed (a
/// caller's `Duration::MAX`): the sleeps that use it are bounded by a
/// deadline or looked at again.
pub(crate) fn later(now: Instant, wait: Duration) -> Instant {
    now.checked_add(wait)
        .unwrap_or_else(|| now + Duration::from_secs(24 * 3600))
}

/// `until`, or `deadline` if that comes first (`None`: no deadline).
pub(crate) fn clamp(until: Instant, deadline: Option<Instant>) -> Instant {
    deadline.map_or(until, |d| d.min(until))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drift_is_one_percent_plus_two_ms() {
        assert_eq!(drift(Duration::from_secs(10)), Duration::from_millis(102));
        assert_eq!(drift(Duration::from_millis(100)), Duration::from_millis(3));
    }

    #[test]
    fn remaining_counts_from_the_send_time_minus_drift() {
        let sent = Instant::now();
        let ttl = Duration::from_secs(1);
        // 1000 - 12 (drift) - 300 elapsed
        assert_eq!(
            remaining(sent, ttl, sent + Duration::from_millis(300)),
            Duration::from_millis(688)
        );
        assert_eq!(remaining(sent, ttl, sent), Duration::from_millis(988));
        assert_eq!(
            remaining(sent, ttl, sent + Duration::from_millis(990)),
            Duration::ZERO
        );
        assert_eq!(
            remaining(sent, ttl, sent + Duration::from_secs(5)),
            Duration::ZERO
        );
        assert_eq!(local_expiry(sent, ttl), sent + Duration::from_millis(988));
    }

    #[test]
    fn later_and_clamp_never_overflow() {
        let now = Instant::now();
        assert!(later(now, Duration::MAX) > now);
        let soon = now + Duration::from_millis(5);
        assert_eq!(clamp(later(now, Duration::MAX), Some(soon)), soon);
        assert_eq!(clamp(soon, None), soon);
    }
}
