//! Per-lock settings: lease length, how long to wait, how to back off, how to release.

use std::time::Duration;

use crate::error::Error;
pub use crate::wait::backoff::Backoff;

/// The shortest lease Redis can express (`PX` takes whole milliseconds).
pub(crate) const MIN_TTL: Duration = Duration::from_millis(1);
/// The longest lease accepted: ten years, far below what overflows Redis's
/// millisecond clock arithmetic.
pub(crate) const MAX_TTL: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// How a lock is released in Redis. Both are owner-checked: neither ever
/// deletes a key that holds another owner's token.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Release {
    /// `EVALSHA` of `lua/release.lua`: compare and delete in one round trip.
    /// The script is loaded again transparently after `NOSCRIPT` (a
    /// `SCRIPT FLUSH` or a server restart).
    #[default]
    Lua,
    /// `WATCH`+`GET` in one round trip, then `MULTI`/`DEL`/`EXEC` in another:
    /// two round trips, for servers where scripting is disabled and for
    /// comparison. Retried while `EXEC` aborts and the key is still ours;
    /// every path that does not reach `EXEC` sends `UNWATCH`, so no pooled
    /// connection is handed back with a `WATCH` on it.
    Watch,
}

/// How a waiter learns that a held lock may be free.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WaitMode {
    /// Poll Redis with [`Backoff`] between attempts. Every waiting thread
    /// polls on its own; the fallback when pub/sub is unavailable.
    Spin,
    /// Queue locally and wake on release messages (the default):
    ///
    /// * threads of one [`LockClient`](crate::LockClient) waiting for the
    ///   same key queue in FIFO order (after a hold of under 20 µs, a
    ///   newcomer may take a lease handed to a waiter that has not woken up
    ///   yet, within 100 µs: see [`LockOptions::local_handoff`]), and only
    ///   the head of the queue talks to Redis;
    /// * releases publish on a channel derived from the key, and the client's
    ///   one subscriber connection wakes the head, in this process or another;
    /// * the head never waits longer than the holder's remaining ttl or the
    ///   backoff step, so a lock freed by expiry (no message) or a lost
    ///   message still costs little;
    /// * while the subscriber connection is down, heads wait like
    ///   [`WaitMode::Spin`].
    #[default]
    Notify,
}

/// The settings every lock type shares: the lease, the wait and the
/// spacing of attempts. What [`ReentrantLock`](crate::ReentrantLock),
/// [`RwLock`](crate::RwLock) and [`RedLock`](crate::RedLock) take; a
/// [`DistributedLock`](crate::DistributedLock) takes [`LockOptions`], which
/// adds what only it offers (release method, notify waiting, handoff,
/// watchdog, fencing, replica acknowledgement).
///
/// ```
/// use std::time::Duration;
/// use redmutex::LeaseOptions;
///
/// let options = LeaseOptions::default()
///     .ttl(Duration::from_secs(10))
///     .wait(Duration::from_secs(2));
/// # let _ = options;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseOptions {
    pub(crate) ttl: Duration,
    pub(crate) wait: Duration,
    pub(crate) backoff: Backoff,
    pub(crate) key_class: &'static str,
}

impl Default for LeaseOptions {
    fn default() -> Self {
        LeaseOptions {
            ttl: Duration::from_secs(30),
            wait: Duration::from_secs(10),
            backoff: Backoff::default(),
            key_class: DEFAULT_KEY_CLASS,
        }
    }
}

impl LeaseOptions {
    /// The lease: how long Redis keeps the lock if its holder never releases
    /// it (a crash, a partition, a pause). Whole milliseconds; between 1 ms
    /// and ten years, checked when a lock is taken. Defaults to 30 s.
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long the blocking acquire (`lock`, `read`, `write`) waits for a
    /// held lock before it gives up with [`Error::Timeout`]. Defaults to
    /// 10 s.
    #[must_use]
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// How waiting attempts are spaced. Defaults to [`Backoff::default`]:
    /// 2 ms doubling up to 64 ms, with full jitter.
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// The `key_class` label of this lock's metrics (the `metrics`
    /// feature): a name for a group of keys chosen by the caller, such as
    /// `"reindex"` or `"exports"`. Never the key itself, so the number of
    /// time series stays what the caller makes it. Defaults to `"default"`.
    #[must_use]
    pub fn key_class(mut self, class: &'static str) -> Self {
        self.key_class = class;
        self
    }
}

/// The shared part of a [`LockOptions`]: its ttl, wait and backoff. The
/// options only a [`DistributedLock`](crate::DistributedLock) has are left
/// behind, on purpose and in plain sight.
impl From<&LockOptions> for LeaseOptions {
    fn from(options: &LockOptions) -> LeaseOptions {
        LeaseOptions {
            ttl: options.ttl,
            wait: options.wait,
            backoff: options.backoff,
            key_class: options.key_class,
        }
    }
}

/// Settings for a [`Semaphore`](crate::Semaphore): the shared lease
/// settings, and what a permit offers as a plain lock does (notify
/// waiting, the watchdog, fencing, replica acknowledgement). No release
/// method (permits are released by script). A permit given back while a
/// thread of the same client waits for one goes straight to it, with the
/// [`SemaphoreOptions::handoff_budget`] (never for fenced or replicated
/// permits, nor after `set_permits` or `release_permit` on that client).
///
/// ```
/// use std::time::Duration;
/// use redmutex::SemaphoreOptions;
///
/// let options = SemaphoreOptions::default()
///     .ttl(Duration::from_secs(10))
///     .watchdog(true)
///     .fencing(true);
/// # let _ = options;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SemaphoreOptions {
    pub(crate) ttl: Duration,
    pub(crate) wait: Duration,
    pub(crate) backoff: Backoff,
    pub(crate) wait_mode: WaitMode,
    pub(crate) watchdog: bool,
    pub(crate) max_hold: Option<Duration>,
    pub(crate) fencing: bool,
    pub(crate) min_replicas: Option<(u32, Duration)>,
    pub(crate) local_handoff: bool,
    pub(crate) handoff_budget: HandoffBudget,
    pub(crate) key_class: &'static str,
}

impl Default for SemaphoreOptions {
    fn default() -> Self {
        SemaphoreOptions::from(LeaseOptions::default())
    }
}

impl SemaphoreOptions {
    /// The `key_class` label of this lock's metrics (the `metrics`
    /// feature): a name for a group of keys chosen by the caller, such as
    /// `"reindex"` or `"exports"`. Never the key itself, so the number of
    /// time series stays what the caller makes it. Defaults to `"default"`.
    #[must_use]
    pub fn key_class(mut self, class: &'static str) -> Self {
        self.key_class = class;
        self
    }

    /// Each permit's lease: how long Redis keeps it if its holder never
    /// gives it back. Whole milliseconds, between 1 ms and ten years,
    /// checked when a permit is taken. Defaults to 30 s.
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long [`Semaphore::acquire`](crate::Semaphore::acquire) waits
    /// for a permit before it gives up with [`Error::Timeout`]. Defaults
    /// to 10 s.
    #[must_use]
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// How waiting attempts are spaced. Defaults to [`Backoff::default`].
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// How waiters learn a permit may be free. Defaults to
    /// [`WaitMode::Notify`].
    #[must_use]
    pub fn wait_mode(mut self, mode: WaitMode) -> Self {
        self.wait_mode = mode;
        self
    }

    /// Keeps each permit alive while it is held: the client's watchdog
    /// renews it every ttl/3 (only while it is still present: an expired
    /// permit is never re-created), pipelined with the client's other
    /// renewals, and marks it lost ([`Permit::is_lost`](crate::Lease::is_lost),
    /// [`Permit::loss_signal`](crate::Lease::loss_signal)) when a renewal
    /// finds it gone or its lease runs out by the local clock first.
    /// Defaults to `false`.
    #[must_use]
    pub fn watchdog(mut self, enabled: bool) -> Self {
        self.watchdog = enabled;
        self
    }

    /// With the watchdog, stops renewing a permit once it has been held
    /// this long; it then runs out and is marked lost. Defaults to `None`.
    #[must_use]
    pub fn max_hold(mut self, cap: Option<Duration>) -> Self {
        self.max_hold = cap;
        self
    }

    /// Gives every permit a fencing token
    /// ([`Permit::fencing_token`](crate::Permit::fencing_token)) from one
    /// counter in the semaphore's hash slot (`{KEY}:fence`), incremented in
    /// the acquire script and raised to the server's clock in microseconds
    /// when below it: strictly increasing across all permits of the key,
    /// every client and process, and across a failover or restart that
    /// lost the counter (see [`LockOptions::fencing`](crate::LockOptions::fencing)).
    /// Defaults to `false`.
    #[must_use]
    pub fn fencing(mut self, enabled: bool) -> Self {
        self.fencing = enabled;
        self
    }

    /// After each permit is granted, waits (`WAIT n timeout`, on the
    /// connection that wrote it) until `n` replicas have it; when fewer
    /// acknowledge in time, gives it back and fails with
    /// [`Error::NotReplicated`]. `n == 0` turns it off; `timeout` must be
    /// at least 1 ms and shorter than the client's I/O timeout. As for
    /// [`LockOptions::min_replicas`], it narrows the failover hazard and
    /// does not close it. Defaults to `None`.
    #[must_use]
    pub fn min_replicas(mut self, n: u32, timeout: Duration) -> Self {
        self.min_replicas = (n > 0).then_some((n, timeout));
        self
    }

    /// Whether a permit given back while a thread of the same client waits
    /// goes straight to it (same id, no command), in notify mode. Defaults
    /// to `true`.
    #[must_use]
    pub fn local_handoff(mut self, enabled: bool) -> Self {
        self.local_handoff = enabled;
        self
    }

    /// How many times in a row, and for how long after it was granted in
    /// Redis, one permit may be passed on before it is given back in Redis
    /// (so waiters in other processes get their turn). Defaults to
    /// [`HandoffBudget::default`].
    #[must_use]
    pub fn handoff_budget(mut self, budget: HandoffBudget) -> Self {
        self.handoff_budget = budget;
        self
    }
}

/// The shared settings, with everything a permit adds off.
impl From<LeaseOptions> for SemaphoreOptions {
    fn from(lease: LeaseOptions) -> SemaphoreOptions {
        SemaphoreOptions {
            ttl: lease.ttl,
            wait: lease.wait,
            backoff: lease.backoff,
            wait_mode: WaitMode::Notify,
            watchdog: false,
            max_hold: None,
            fencing: false,
            min_replicas: None,
            local_handoff: true,
            handoff_budget: HandoffBudget::default(),
            key_class: lease.key_class,
        }
    }
}

/// Everything of a [`LockOptions`] a permit offers too (all but the release
/// method): a client's defaults apply to its
/// semaphores as to its locks.
impl From<&LockOptions> for SemaphoreOptions {
    fn from(options: &LockOptions) -> SemaphoreOptions {
        SemaphoreOptions {
            ttl: options.ttl,
            wait: options.wait,
            backoff: options.backoff,
            wait_mode: options.wait_mode,
            watchdog: options.watchdog,
            max_hold: options.max_hold,
            fencing: options.fencing,
            min_replicas: options.min_replicas,
            local_handoff: options.local_handoff,
            handoff_budget: options.handoff_budget,
            key_class: options.key_class,
        }
    }
}

/// Settings for a [`DistributedLock`](crate::DistributedLock).
///
/// Built with consuming setters:
///
/// ```
/// use std::time::Duration;
/// use redmutex::{LockOptions, Release};
///
/// let options = LockOptions::default()
///     .ttl(Duration::from_secs(10))
///     .wait(Duration::from_secs(2))
///     .release(Release::Watch);
/// # let _ = options;
/// ```
///
/// The lock made with them reads them back
/// ([`DistributedLock::ttl`](crate::DistributedLock::ttl) and the other
/// getters).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockOptions {
    pub(crate) ttl: Duration,
    pub(crate) wait: Duration,
    pub(crate) backoff: Backoff,
    pub(crate) release: Release,
    pub(crate) wait_mode: WaitMode,
    pub(crate) local_handoff: bool,
    pub(crate) handoff_budget: HandoffBudget,
    pub(crate) watchdog: bool,
    pub(crate) max_hold: Option<Duration>,
    pub(crate) fencing: bool,
    pub(crate) min_replicas: Option<(u32, Duration)>,
    pub(crate) key_class: &'static str,
}

/// The metrics label of locks whose options name no key class.
pub(crate) const DEFAULT_KEY_CLASS: &str = "default";

/// How long a lease may pass from thread to thread inside one process
/// before it must be released in Redis, so other processes get their turn,
/// and how fresh it must be to be passed on without asking Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandoffBudget {
    pub(crate) max_handoffs: u32,
    pub(crate) max_time: Duration,
    pub(crate) max_age: Duration,
}

/// How old Redis's newest confirmation of a lease may be for a thread to
/// take it over without asking Redis again.
pub(crate) const MAX_AGE: Duration = Duration::from_millis(1);

impl HandoffBudget {
    /// At most `max_handoffs` consecutive handoffs, and at most `max_time`
    /// since the lease was acquired in Redis; the default
    /// [`HandoffBudget::max_age`].
    pub fn new(max_handoffs: u32, max_time: Duration) -> HandoffBudget {
        HandoffBudget {
            max_handoffs,
            max_time,
            max_age: MAX_AGE,
        }
    }

    /// This budget with another [`HandoffBudget::max_age`].
    #[must_use]
    pub fn with_max_age(mut self, max_age: Duration) -> HandoffBudget {
        self.max_age = max_age;
        self
    }

    /// How long ago Redis may last have confirmed a lease (owner-checked:
    /// its acquisition, a renewal, an extension or a check) for a waiting
    /// thread to take it over as it is. When the confirmation is older,
    /// the receiving call confirms the lease in Redis before it returns
    /// (one round trip: `GET`, or the extension when less than half the
    /// ttl is left) and waits on, or asks Redis for the lock afresh, when
    /// Redis no longer holds it. So a thread handed a lease starts on one
    /// as fresh as an acquisition made this long before. `Duration::ZERO`
    /// confirms every handoff. Defaults to 1 ms.
    pub fn max_age(&self) -> Duration {
        self.max_age
    }

    /// Consecutive handoffs at most. Defaults to 256.
    pub fn max_handoffs(&self) -> u32 {
        self.max_handoffs
    }

    /// Time since the lease was acquired in Redis at most. Defaults to 10 ms.
    pub fn max_time(&self) -> Duration {
        self.max_time
    }
}

impl Default for HandoffBudget {
    fn default() -> Self {
        HandoffBudget {
            max_handoffs: 256,
            max_time: Duration::from_millis(10),
            max_age: MAX_AGE,
        }
    }
}

impl Default for LockOptions {
    fn default() -> Self {
        LockOptions {
            ttl: Duration::from_secs(30),
            wait: Duration::from_secs(10),
            backoff: Backoff::default(),
            release: Release::Lua,
            wait_mode: WaitMode::Notify,
            local_handoff: true,
            handoff_budget: HandoffBudget::default(),
            watchdog: false,
            max_hold: None,
            fencing: false,
            min_replicas: None,
            key_class: DEFAULT_KEY_CLASS,
        }
    }
}

impl LockOptions {
    /// The `key_class` label of this lock's metrics (the `metrics`
    /// feature): a name for a group of keys chosen by the caller, such as
    /// `"reindex"` or `"exports"`. Never the key itself, so the number of
    /// time series stays what the caller makes it. Defaults to `"default"`.
    #[must_use]
    pub fn key_class(mut self, class: &'static str) -> Self {
        self.key_class = class;
        self
    }

    /// The lease: how long Redis keeps the lock if its holder never releases
    /// it (a crash, a partition, a pause). Whole milliseconds; between 1 ms
    /// and ten years, checked when a lock is taken. Defaults to 30 s.
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long [`DistributedLock::lock`](crate::DistributedLock::lock) waits
    /// for a held lock before it gives up with [`Error::Timeout`]. Defaults
    /// to 10 s.
    #[must_use]
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// How waiting attempts are spaced. Defaults to [`Backoff::default`]:
    /// 2 ms doubling up to 64 ms, with full jitter.
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// How guards of this lock release it in Redis. Defaults to
    /// [`Release::Lua`].
    #[must_use]
    pub fn release(mut self, release: Release) -> Self {
        self.release = release;
        self
    }

    /// How waiters learn the lock may be free. Defaults to
    /// [`WaitMode::Notify`].
    #[must_use]
    pub fn wait_mode(mut self, wait_mode: WaitMode) -> Self {
        self.wait_mode = wait_mode;
        self
    }

    /// Whether a releasing holder hands its lease straight to a thread of the
    /// same [`LockClient`](crate::LockClient) queued for the key, with no
    /// Redis command and the same token, instead of releasing it in Redis.
    /// Only in [`WaitMode::Notify`], and only when the outermost guard goes.
    /// Bounded by [`LockOptions::handoff_budget`], so other processes still
    /// get their turn. After a hold shorter than a thread's wake-up (20 µs),
    /// a thread of a handle with handoff on that asks for the lock before
    /// the woken waiter has run takes the lease instead, but only in the
    /// first 100 µs after that waiter was handed a lease (eventual
    /// fairness, as in `parking_lot`): the waiter keeps its place, and
    /// longer holds keep the queue's strict order. `false` turns both off.
    /// Defaults to `true`.
    #[must_use]
    pub fn local_handoff(mut self, enabled: bool) -> Self {
        self.local_handoff = enabled;
        self
    }

    /// Ends a run of in-process handoffs with a real release in Redis after
    /// `max_handoffs` consecutive handoffs or `max_time` since the lease was
    /// acquired in Redis, whichever comes first. Defaults to 256 handoffs or
    /// 10 ms. A budget of 0 handoffs disables handoff like
    /// `local_handoff(false)`.
    #[must_use]
    pub fn handoff_budget(mut self, max_handoffs: u32, max_time: Duration) -> Self {
        self.handoff_budget.max_handoffs = max_handoffs;
        self.handoff_budget.max_time = max_time;
        self
    }

    /// How long ago Redis may last have confirmed a lease for a queued
    /// thread to take it over without asking Redis again
    /// ([`HandoffBudget::max_age`]): a thread handed an older one
    /// confirms it first. `Duration::ZERO` confirms every handoff.
    /// Defaults to 1 ms.
    #[must_use]
    pub fn handoff_max_age(mut self, max_age: Duration) -> Self {
        self.handoff_budget.max_age = max_age;
        self
    }

    /// Keeps the lease alive while the guard lives: the client's watchdog
    /// thread renews it (owner-checked) every ttl/3, many held locks
    /// pipelined per round trip, and stops the moment the guard is released.
    /// When a renewal finds the key gone or taken, or the lease's local
    /// expiry (send time + ttl − drift) passes with no successful renewal
    /// (whatever the renewal call is doing: the holder learns before Redis
    /// can give the key away), the guard is marked lost
    /// ([`LockGuard::is_lost`](crate::Lease::is_lost),
    /// [`LockGuard::loss_signal`](crate::Lease::loss_signal)). Defaults
    /// to `false`.
    #[must_use]
    pub fn watchdog(mut self, enabled: bool) -> Self {
        self.watchdog = enabled;
        self
    }

    /// With the watchdog, stops renewing once the lock has been held this
    /// long; the lease then runs out and the guard is marked lost. Defaults
    /// to `None` (renew for as long as the guard lives).
    #[must_use]
    pub fn max_hold(mut self, cap: Option<Duration>) -> Self {
        self.max_hold = cap;
        self
    }

    /// Issues a fencing token with every acquisition: the acquire script
    /// increments a counter key in the lock key's hash slot
    /// (`{KEY}:fence`, or `{TAG}:fence:KEY` for a key with a `{TAG}`), in
    /// the same script as the `SET NX`, and
    /// [`LockGuard::fencing_token`](crate::LockGuard::fencing_token) returns
    /// it: strictly increasing for the key across all clients and processes.
    /// Every token is at least the server's clock in microseconds (`TIME`;
    /// the counter is raised to it and stored back), so a promoted replica
    /// or a restarted server whose counter lost its last increments still
    /// issues larger tokens than before, unless its clock is behind the old
    /// server's by more than the failover or restart took. Tokens are about
    /// 1.8 × 10^15 (below 2^53): compare them, do not count on their gaps.
    /// A fenced lease is never handed off between threads, since each
    /// holder must carry its own number. Defaults to `false`.
    #[must_use]
    pub fn fencing(mut self, enabled: bool) -> Self {
        self.fencing = enabled;
        self
    }

    /// After each acquisition in Redis, waits (`WAIT n timeout`, on the
    /// connection that wrote the key) until `n` replicas have the key; when
    /// fewer acknowledge in time, releases it again and fails with
    /// [`Error::NotReplicated`], so a holder never believes in a lock that a
    /// failover to a replica would lose. Costs one more round trip (plus the
    /// replicas' delay) per acquisition. `n == 0` turns it off. Defaults to
    /// `None`.
    ///
    /// It narrows the failover hazard, it does not close it: Redis
    /// replication stays asynchronous, and a replica that acknowledged can
    /// still lose the key if it restarts without persistence.
    ///
    /// `timeout` must be at least 1 ms and shorter than the client's I/O
    /// timeout ([`LockClient::timeout`](crate::LockClient::timeout)); other
    /// values make acquisitions fail with [`Error::InvalidArgument`] before
    /// anything is sent. If `WAIT` fails, the key is released again.
    #[must_use]
    pub fn min_replicas(mut self, n: u32, timeout: Duration) -> Self {
        self.min_replicas = (n > 0).then_some((n, timeout));
        self
    }
}

/// Checks [`LockOptions::min_replicas`]: a timeout of at least 1 ms (`WAIT
/// n 0` would block for ever) and shorter than the connection's I/O
/// timeout (a longer `WAIT` would time out the read and leave the key set
/// with nobody told).
pub(crate) fn check_min_replicas(
    min_replicas: Option<(u32, Duration)>,
    io_timeout: Duration,
) -> Result<(), Error> {
    let Some((_, timeout)) = min_replicas else {
        return Ok(());
    };
    if timeout < MIN_TTL || timeout >= io_timeout {
        return Err(Error::InvalidArgument(format!(
            "the min_replicas timeout must be at least 1 ms and shorter than the client's I/O \
             timeout ({io_timeout:?}), got {timeout:?}"
        )));
    }
    Ok(())
}

/// A validated lease length in whole milliseconds, as sent with `PX`.
pub(crate) fn ttl_millis(ttl: Duration) -> Result<u64, Error> {
    if ttl < MIN_TTL {
        return Err(Error::InvalidArgument(format!(
            "ttl must be at least 1 ms (Redis PX takes whole milliseconds), got {ttl:?}"
        )));
    }
    if ttl > MAX_TTL {
        return Err(Error::InvalidArgument(format!(
            "ttl must be at most ten years, got {ttl:?}"
        )));
    }
    // Bounded by MAX_TTL above, so the conversion cannot truncate.
    Ok(ttl.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn min_replicas_timeouts_are_checked() {
        let io = Duration::from_secs(2);
        let with = |t| LockOptions::default().min_replicas(1, t).min_replicas;
        assert!(check_min_replicas(None, io).is_ok());
        assert!(check_min_replicas(with(Duration::from_millis(500)), io).is_ok());
        for bad in [
            Duration::ZERO,
            Duration::from_micros(999),
            io,
            Duration::MAX,
        ] {
            assert!(check_min_replicas(with(bad), io).is_err(), "{bad:?}");
        }
        assert!(
            check_min_replicas(
                LockOptions::default()
                    .min_replicas(0, Duration::ZERO)
                    .min_replicas,
                io
            )
            .is_ok(),
            "n = 0 turns it off"
        );
    }

    #[test]
    fn ttl_bounds_are_checked() {
        assert!(ttl_millis(Duration::ZERO).is_err());
        assert!(ttl_millis(Duration::from_micros(999)).is_err());
        assert_eq!(ttl_millis(Duration::from_micros(1500)).ok(), Some(1));
        assert_eq!(ttl_millis(Duration::from_secs(30)).ok(), Some(30_000));
        assert!(ttl_millis(MAX_TTL + Duration::from_millis(1)).is_err());
    }
}
