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

use crate::error::Error;
use loss::LossSignal;

/// Keeps [`Lease`] to the crate's own guards: its methods may grow.
pub(crate) mod sealed {
    pub trait Sealed {}
}

/// What every guard of the lock family offers: the lease it holds.
///
/// Implemented by [`LockGuard`](crate::LockGuard),
/// [`ReentrantGuard`](crate::ReentrantGuard), [`RwGuard`](crate::RwGuard),
/// [`Permit`](crate::Permit) and [`RedLockGuard`](crate::RedLockGuard), so
/// that code written against a lease (a worker loop that renews, checks
/// and releases) works with any lock type. Each implementation's own docs
/// say what its methods send. Sealed: only this crate implements it.
///
/// | | `validity` | `is_lost`, `loss_signal` | `is_held` | `extend` | `unlock` |
/// |---|---|---|---|---|---|
/// | what it is | the local estimate, zero once lost | a loss Redis (or the watchdog) reported | asks Redis, owner-checked | owner-checked, never re-creates | owner-checked release |
///
/// ```no_run
/// use std::time::Duration;
/// use redmutex::{Error, Lease};
///
/// /// Works while the lease lasts, renewing it, with any lock type.
/// fn work_under(mut lease: impl Lease, steps: u32) -> Result<(), Error> {
///     for _ in 0..steps {
///         if lease.is_lost() {
///             return Err(Error::InvalidArgument("the lease was lost".into()));
///         }
///         // ... one step of work ...
///         if lease.validity() < Duration::from_secs(5) {
///             lease.extend(Duration::from_secs(30))?;
///         }
///     }
///     lease.unlock().map(drop)
/// }
/// # fn main() -> Result<(), Error> {
/// let client = redmutex::LockClient::open("redis://127.0.0.1:6379/")?;
/// work_under(redmutex::DistributedLock::new(&client, "jobs:a").lock()?, 3)?;
/// work_under(redmutex::Semaphore::new(&client, "jobs:b", 2).acquire()?, 3)?;
/// work_under(redmutex::RwLock::new(&client, "jobs:c").write()?, 3)?;
/// # Ok(())
/// # }
/// ```
pub trait Lease: sealed::Sealed {
    /// The lock key, as it is in Redis (the client's key prefix included).
    fn key(&self) -> &str;

    /// The lease left by the local monotonic clock, minus a drift
    /// allowance, counted from when the acquiring (or last extending)
    /// request was sent, so never more than Redis allows; zero once
    /// released or lost. An estimate without a round trip;
    /// [`Lease::is_held`] asks Redis.
    fn validity(&self) -> Duration;

    /// Whether the lease was found lost: by an [`Lease::extend`] or
    /// [`Lease::is_held`] that Redis answered "not ours", or by the
    /// watchdog where the lock type has one. Always true in a process
    /// forked since the lease was taken.
    fn is_lost(&self) -> bool;

    /// A signal, usable from any thread and after the guard is gone, that
    /// fires when the lease is found lost.
    fn loss_signal(&self) -> LossSignal;

    /// The fencing token of this acquisition when the lock was taken with
    /// fencing on (strictly increasing for the key: see
    /// [`LockExtra::fencing`](crate::LockExtra::fencing)); `None`
    /// otherwise, and always for a [`RedLock`](crate::RedLock) (no counter
    /// of its nodes is monotonic across their failures: see the
    /// deployments chapter). Pass it to the protected resource with every
    /// write, and have the resource reject a write whose token is lower
    /// than the highest it has seen.
    fn fencing_token(&self) -> Option<u64>;

    /// Asks Redis whether it still holds this lease, owner-checked.
    /// Changes nothing.
    ///
    /// # Errors
    ///
    /// [`Error::Redis`] or [`Error::Pool`] when Redis cannot answer (a
    /// RedLock: [`Error::QuorumLost`] when its nodes' answers leave it
    /// unknown); [`Error::WrongType`] when the key holds another type's
    /// data; [`Error::InvalidArgument`] for a guard inherited through
    /// `fork()`.
    fn is_held(&self) -> Result<bool, Error>;

    /// Sets the lease to expire `ttl` from now, if Redis still holds it
    /// (owner-checked): an expired lease is never re-created. A lease found
    /// not held is lost from then on.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a ttl under 1 ms or over ten years
    /// (nothing is sent), or a guard inherited through `fork()`;
    /// [`Error::NotHeld`] when Redis no longer holds it; [`Error::Redis`],
    /// [`Error::Pool`], [`Error::WrongType`] or [`Error::OutcomeUnknown`]
    /// (a RedLock: [`Error::QuorumLost`]).
    fn extend(&mut self, ttl: Duration) -> Result<(), Error>;

    /// Releases the lease and reports the outcome: [`Unlocked::StillHeld`]
    /// when only a nested hold was given up (a lock type that nests),
    /// [`Unlocked::Released`] otherwise. Dropping the guard releases too,
    /// reporting nothing.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] when Redis no longer held it (nothing is
    /// deleted); [`Error::OutcomeUnknown`], [`Error::Redis`] or
    /// [`Error::Pool`] when Redis fails (the lease is then released in the
    /// background once Redis answers, or expires); [`Error::InvalidArgument`]
    /// for a guard inherited through `fork()`.
    fn unlock(self) -> Result<Unlocked, Error>
    where
        Self: Sized;
}

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
