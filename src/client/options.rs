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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WaitMode {
    /// Poll Redis with [`Backoff`] between attempts. Every waiting thread
    /// polls on its own; the fallback when pub/sub is unavailable.
    Spin,
    /// Queue locally and wake on release messages (the default):
    ///
    /// * threads of one [`LockClient`](crate::LockClient) waiting for the
    ///   same key queue in FIFO order (after a hold of under 20 µs, a
    ///   newcomer may take a lease handed to a waiter that has not woken up
    ///   yet, within 100 µs: see [`LockExtra::local_handoff`]), and only
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

/// The settings of one lock type: the core every type shares (public
/// fields, read as `lock.options().ttl`), and in [`Options::extra`] what
/// only that type can do. A setting a type cannot honour has no field and
/// no setter in its options, so it cannot be passed: a [`RwLock`](crate::RwLock)
/// takes no release method, a [`RedLock`](crate::RedLock) no fencing.
///
/// Each lock type has its own alias: [`LockOptions`] ([`DistributedLock`](crate::DistributedLock)),
/// [`SemaphoreOptions`], [`ReentrantOptions`], [`RwLockOptions`] and
/// [`RedLockOptions`]. Built with consuming setters (named as the fields),
/// or by assigning the fields; both are checked when a lock is taken, not
/// when set.
///
/// ```
/// use std::time::Duration;
/// use redmutex::{LockOptions, Release, RwLockOptions};
///
/// let options = LockOptions::default()
///     .ttl(Duration::from_secs(10))
///     .wait(Duration::from_secs(2))
///     .watchdog(true)
///     .release(Release::Watch);
/// assert_eq!(options.ttl, Duration::from_secs(10));
/// assert_eq!(options.extra.release, Release::Watch);
///
/// let mut rw = RwLockOptions::default().prefer_readers(true);
/// rw.wait = Duration::from_millis(500);
/// # let _ = rw;
/// ```
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options<X> {
    /// The lease: how long Redis keeps the lock if its holder never
    /// releases it (a crash, a partition, a pause). Whole milliseconds;
    /// between 1 ms and ten years, checked when a lock is taken. Defaults
    /// to 30 s.
    pub ttl: Duration,
    /// How long the blocking acquire (`lock`, `read`, `write`, `acquire`)
    /// waits for a held lock before it gives up with [`Error::Timeout`].
    /// Defaults to 10 s.
    pub wait: Duration,
    /// How waiting attempts are spaced. Defaults to [`Backoff::default`]:
    /// 2 ms doubling up to 64 ms, with full jitter.
    pub backoff: Backoff,
    /// How waiters learn the lock may be free. Defaults to
    /// [`WaitMode::Notify`].
    pub wait_mode: WaitMode,
    /// Keeps the lease alive while the guard lives: renewed (owner-checked,
    /// never re-creating an expired lease) every ttl/3, and the guard
    /// marked lost ([`Lease::is_lost`](crate::Lease::is_lost),
    /// [`Lease::loss_signal`](crate::Lease::loss_signal)) when a renewal
    /// finds it gone or taken, or its lease runs out by the local clock
    /// (send time + ttl − drift) with no successful renewal, whatever the
    /// renewal call is doing: the holder learns before Redis can give the
    /// key away. The client's watchdog thread renews the single-server
    /// types, many leases pipelined per round trip; a [`RedLock`](crate::RedLock)
    /// guard is renewed on a majority by a thread of its own. Defaults to
    /// `false`.
    pub watchdog: bool,
    /// With the watchdog, stops renewing once the lock has been held this
    /// long; the lease then runs out and the guard is marked lost.
    /// Defaults to `None` (renew for as long as the guard lives).
    pub max_hold: Option<Duration>,
    /// The `key_class` label of this lock's metrics (the `metrics`
    /// feature): a name for a group of keys chosen by the caller, such as
    /// `"reindex"` or `"exports"`. Never the key itself, so the number of
    /// time series stays what the caller makes it. Defaults to
    /// `"default"`.
    pub key_class: &'static str,
    /// What only this lock type offers ([`LockExtra`], [`SemaphoreExtra`],
    /// [`ReentrantExtra`], [`RwLockExtra`], [`RedLockExtra`]).
    pub extra: X,
}

impl<X: Default> Default for Options<X> {
    fn default() -> Self {
        Options {
            ttl: Duration::from_secs(30),
            wait: Duration::from_secs(10),
            backoff: Backoff::default(),
            wait_mode: WaitMode::Notify,
            watchdog: false,
            max_hold: None,
            key_class: DEFAULT_KEY_CLASS,
            extra: X::default(),
        }
    }
}

impl<X> Options<X> {
    /// Sets [`Options::ttl`].
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Sets [`Options::wait`].
    #[must_use]
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Sets [`Options::backoff`].
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Sets [`Options::wait_mode`].
    #[must_use]
    pub fn wait_mode(mut self, wait_mode: WaitMode) -> Self {
        self.wait_mode = wait_mode;
        self
    }

    /// Sets [`Options::watchdog`].
    #[must_use]
    pub fn watchdog(mut self, enabled: bool) -> Self {
        self.watchdog = enabled;
        self
    }

    /// Sets [`Options::max_hold`].
    #[must_use]
    pub fn max_hold(mut self, cap: Option<Duration>) -> Self {
        self.max_hold = cap;
        self
    }

    /// Sets [`Options::key_class`].
    #[must_use]
    pub fn key_class(mut self, class: &'static str) -> Self {
        self.key_class = class;
        self
    }

    /// These core settings with another lock type's extras, as the caller
    /// gives them (`options.with_extra(RedLockExtra::default())`): nothing
    /// of this type's extras is carried over. To carry a lock's fencing,
    /// `min_replicas` and handoff settings too, see
    /// [`LockOptions::for_semaphore`] and its siblings.
    pub fn with_extra<Y>(&self, extra: Y) -> Options<Y> {
        Options {
            ttl: self.ttl,
            wait: self.wait,
            backoff: self.backoff,
            wait_mode: self.wait_mode,
            watchdog: self.watchdog,
            max_hold: self.max_hold,
            key_class: self.key_class,
            extra,
        }
    }
}

/// A [`DistributedLock`](crate::DistributedLock)'s settings.
pub type LockOptions = Options<LockExtra>;
/// A [`Semaphore`](crate::Semaphore)'s settings.
pub type SemaphoreOptions = Options<SemaphoreExtra>;
/// A [`ReentrantLock`](crate::ReentrantLock)'s settings.
pub type ReentrantOptions = Options<ReentrantExtra>;
/// A [`RwLock`](crate::RwLock)'s settings.
pub type RwLockOptions = Options<RwLockExtra>;
/// A [`RedLock`](crate::RedLock)'s settings.
pub type RedLockOptions = Options<RedLockExtra>;
/// A [`MultiLock`](crate::MultiLock)'s settings.
pub type MultiLockOptions = Options<MultiLockExtra>;
/// A [`FairLock`](crate::FairLock)'s settings.
pub type FairLockOptions = Options<FairLockExtra>;

/// What only a [`DistributedLock`](crate::DistributedLock) has among its
/// [`LockOptions`]. These are also the client's defaults for the extras
/// of the other single-server types ([`LockClient::defaults`](crate::LockClient::defaults)).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockExtra {
    /// How guards release the lock in Redis. Defaults to [`Release::Lua`].
    pub release: Release,
    /// Whether a releasing holder hands its lease straight to a thread of
    /// the same [`LockClient`](crate::LockClient) queued for the key, with
    /// no Redis command and the same token, instead of releasing it in
    /// Redis. Only in [`WaitMode::Notify`], and only when the outermost
    /// guard goes. Bounded by [`LockExtra::handoff_budget`], so other
    /// processes still get their turn. After a hold shorter than a
    /// thread's wake-up (20 µs), a thread of a handle with handoff on that
    /// asks for the lock before the woken waiter has run takes the lease
    /// instead, but only in the first 100 µs after that waiter was handed
    /// a lease (eventual fairness, as in `parking_lot`): the waiter keeps
    /// its place, and longer holds keep the queue's strict order. `false`
    /// turns both off. Defaults to `true`.
    pub local_handoff: bool,
    /// How far a run of in-process handoffs may go before a real release
    /// in Redis, and how fresh a lease must be to be passed on without
    /// asking Redis. Defaults to [`HandoffBudget::default`].
    pub handoff_budget: HandoffBudget,
    /// Issues a fencing token with every acquisition: the acquire script
    /// increments a counter key in the lock key's hash slot
    /// (`{KEY}:fence`, or `{TAG}:fence:KEY` for a key with a `{TAG}`), in
    /// the same script as the `SET NX`, and
    /// [`Lease::fencing_token`](crate::Lease::fencing_token) returns it:
    /// strictly increasing for the key across all clients and processes.
    /// Every token is at least the server's clock in microseconds (`TIME`;
    /// the counter is raised to it and stored back), so a promoted replica
    /// or a restarted server whose counter lost its last increments still
    /// issues larger tokens than before, unless its clock is behind the old
    /// server's by more than the failover or restart took. Tokens are about
    /// 1.8 × 10^15 (below 2^53): compare them, do not count on their gaps.
    /// A fenced lease is never handed off between threads, since each
    /// holder must carry its own number. Defaults to `false`.
    pub fencing: bool,
    /// After each acquisition in Redis, waits (`WAIT n timeout`, on the
    /// connection that wrote the key) until `n` replicas have the key; when
    /// fewer acknowledge in time, releases it again and fails with
    /// [`Error::NotReplicated`], so a holder never believes in a lock that
    /// a failover to a replica would lose. Costs one more round trip (plus
    /// the replicas' delay) per acquisition. It narrows the failover
    /// hazard, it does not close it: Redis replication stays asynchronous,
    /// and a replica that acknowledged can still lose the key if it
    /// restarts without persistence. The timeout must be at least 1 ms and
    /// shorter than the client's I/O timeout
    /// ([`LockClient::timeout`](crate::LockClient::timeout)); other values
    /// make acquisitions fail with [`Error::InvalidArgument`] before
    /// anything is sent. If `WAIT` fails, the key is released again.
    /// Defaults to `None`.
    pub min_replicas: Option<(u32, Duration)>,
}

impl Default for LockExtra {
    fn default() -> Self {
        LockExtra {
            release: Release::Lua,
            local_handoff: true,
            handoff_budget: HandoffBudget::default(),
            fencing: false,
            min_replicas: None,
        }
    }
}

/// What only a [`Semaphore`](crate::Semaphore) has among its
/// [`SemaphoreOptions`]: as [`LockExtra`], without a release method
/// (permits are released by script). A permit given back while a thread
/// of the same client waits for one goes straight to it, within the
/// handoff budget (never for fenced or replicated permits, nor after
/// `set_permits` or `release_permit` on that client).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SemaphoreExtra {
    /// As [`LockExtra::local_handoff`], for permits. Defaults to `true`.
    pub local_handoff: bool,
    /// As [`LockExtra::handoff_budget`], for permits. Defaults to
    /// [`HandoffBudget::default`].
    pub handoff_budget: HandoffBudget,
    /// A fencing token for every permit, from the counter
    /// [`LockExtra::fencing`] describes (the semaphore key's):
    /// strictly increasing across all permits of the key. Defaults to
    /// `false`.
    pub fencing: bool,
    /// As [`LockExtra::min_replicas`], for each permit granted (a permit
    /// fewer replicas acknowledge is given back). Defaults to `None`.
    pub min_replicas: Option<(u32, Duration)>,
}

impl Default for SemaphoreExtra {
    fn default() -> Self {
        SemaphoreExtra {
            local_handoff: true,
            handoff_budget: HandoffBudget::default(),
            fencing: false,
            min_replicas: None,
        }
    }
}

/// What only a [`ReentrantLock`](crate::ReentrantLock) has among its
/// [`ReentrantOptions`].
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReentrantExtra {
    /// A fencing token for the owner's first hold, from the counter
    /// [`LockExtra::fencing`] describes (the same one: `{KEY}:fence`),
    /// taken in the acquire script; nested holds carry the same token.
    /// Defaults to `false`.
    pub fencing: bool,
    /// As [`LockExtra::min_replicas`], for every hold taken in Redis
    /// (nested ones included: each writes the hash). Defaults to `None`.
    pub min_replicas: Option<(u32, Duration)>,
}

/// What only a [`RwLock`](crate::RwLock) has among its [`RwLockOptions`].
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RwLockExtra {
    /// Lets new readers in even while writers wait (writers may then wait
    /// as long as readers keep overlapping). Defaults to `false`: writer
    /// preference.
    pub prefer_readers: bool,
    /// A fencing token for every writer, from the counter
    /// [`LockExtra::fencing`] describes (the same one: `{KEY}:fence`),
    /// taken in the acquire script. Readers get none: they do not exclude
    /// each other, so a token would order nothing. Defaults to `false`.
    pub fencing: bool,
    /// As [`LockExtra::min_replicas`], for every read or write hold.
    /// Defaults to `None`.
    pub min_replicas: Option<(u32, Duration)>,
}

/// What only a [`RedLock`](crate::RedLock) has among its
/// [`RedLockOptions`].
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RedLockExtra {
    /// How long each node may take to answer one request. Defaults to
    /// `None`: 5 % of the ttl (never more than the ttl).
    pub node_timeout: Option<Duration>,
}

/// What only a [`MultiLock`](crate::MultiLock) has among its
/// [`MultiLockOptions`].
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MultiLockExtra {
    /// A fencing token for every key of the set, from each key's own
    /// counter (the one [`LockExtra::fencing`] describes), taken in the
    /// acquire script: a resource guarded by one key of the set checks
    /// that key's token ([`MultiGuard::fencing_tokens`](crate::MultiGuard::fencing_tokens)).
    /// Defaults to `false`.
    pub fencing: bool,
}

/// What only a [`FairLock`](crate::FairLock) has among its
/// [`FairLockOptions`].
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FairLockExtra {
    /// How long a waiter's place in the queue lives without a new attempt
    /// (by the server's clock). A waiter asks again at least every third of
    /// it, so only a waiter that stopped asking (killed, partitioned,
    /// paused) loses its place; it holds the queue up for at most this
    /// long. Between 500 ms and ten years, checked when the lock is taken.
    /// Defaults to 2 s.
    pub entry_ttl: Duration,
    /// A fencing token for every acquisition, from the key's counter (the
    /// one [`LockExtra::fencing`] describes). Defaults to `false`.
    pub fencing: bool,
}

impl Default for FairLockExtra {
    fn default() -> Self {
        FairLockExtra {
            entry_ttl: Duration::from_secs(2),
            fencing: false,
        }
    }
}

impl FairLockOptions {
    /// Sets [`FairLockExtra::entry_ttl`].
    #[must_use]
    pub fn entry_ttl(mut self, ttl: Duration) -> Self {
        self.extra.entry_ttl = ttl;
        self
    }

    /// Sets [`FairLockExtra::fencing`].
    #[must_use]
    pub fn fencing(mut self, enabled: bool) -> Self {
        self.extra.fencing = enabled;
        self
    }
}

impl MultiLockOptions {
    /// Sets [`MultiLockExtra::fencing`].
    #[must_use]
    pub fn fencing(mut self, enabled: bool) -> Self {
        self.extra.fencing = enabled;
        self
    }
}

impl LockOptions {
    /// Sets [`LockExtra::release`].
    #[must_use]
    pub fn release(mut self, release: Release) -> Self {
        self.extra.release = release;
        self
    }

    /// Sets [`LockExtra::local_handoff`].
    #[must_use]
    pub fn local_handoff(mut self, enabled: bool) -> Self {
        self.extra.local_handoff = enabled;
        self
    }

    /// Sets [`LockExtra::handoff_budget`].
    #[must_use]
    pub fn handoff_budget(mut self, budget: HandoffBudget) -> Self {
        self.extra.handoff_budget = budget;
        self
    }

    /// Sets [`LockExtra::fencing`].
    #[must_use]
    pub fn fencing(mut self, enabled: bool) -> Self {
        self.extra.fencing = enabled;
        self
    }

    /// Sets [`LockExtra::min_replicas`]: `n` replicas within `timeout`;
    /// `n == 0` turns it off.
    #[must_use]
    pub fn min_replicas(mut self, n: u32, timeout: Duration) -> Self {
        self.extra.min_replicas = (n > 0).then_some((n, timeout));
        self
    }
}

/// A lock's options as another single-server type's: the core, and every
/// extra that type has too. What each type's `new` makes of the client's
/// defaults ([`LockClient::defaults`](crate::LockClient::defaults)).
impl LockOptions {
    /// As a [`Semaphore`](crate::Semaphore)'s: everything but the release
    /// method (permits are released by script).
    pub fn for_semaphore(&self) -> SemaphoreOptions {
        self.with_extra(SemaphoreExtra {
            local_handoff: self.extra.local_handoff,
            handoff_budget: self.extra.handoff_budget,
            fencing: self.extra.fencing,
            min_replicas: self.extra.min_replicas,
        })
    }

    /// As a [`ReentrantLock`](crate::ReentrantLock)'s: the core, fencing
    /// and `min_replicas` (no release method, no handoff).
    pub fn for_reentrant(&self) -> ReentrantOptions {
        self.with_extra(ReentrantExtra {
            fencing: self.extra.fencing,
            min_replicas: self.extra.min_replicas,
        })
    }

    /// As a [`FairLock`](crate::FairLock)'s: the core and fencing, with
    /// the default entry ttl (no release method, no handoff, no
    /// `min_replicas`).
    pub fn for_fair(&self) -> FairLockOptions {
        self.with_extra(FairLockExtra {
            fencing: self.extra.fencing,
            ..FairLockExtra::default()
        })
    }

    /// As a [`MultiLock`](crate::MultiLock)'s: the core and fencing (no
    /// release method, no handoff, no `min_replicas`).
    pub fn for_multi(&self) -> MultiLockOptions {
        self.with_extra(MultiLockExtra {
            fencing: self.extra.fencing,
        })
    }

    /// As a [`RwLock`](crate::RwLock)'s: the core, fencing and
    /// `min_replicas`, writers preferred (no release method, no handoff).
    pub fn for_rwlock(&self) -> RwLockOptions {
        self.with_extra(RwLockExtra {
            prefer_readers: false,
            fencing: self.extra.fencing,
            min_replicas: self.extra.min_replicas,
        })
    }
}

impl SemaphoreOptions {
    /// Sets [`SemaphoreExtra::local_handoff`].
    #[must_use]
    pub fn local_handoff(mut self, enabled: bool) -> Self {
        self.extra.local_handoff = enabled;
        self
    }

    /// Sets [`SemaphoreExtra::handoff_budget`].
    #[must_use]
    pub fn handoff_budget(mut self, budget: HandoffBudget) -> Self {
        self.extra.handoff_budget = budget;
        self
    }

    /// Sets [`SemaphoreExtra::fencing`].
    #[must_use]
    pub fn fencing(mut self, enabled: bool) -> Self {
        self.extra.fencing = enabled;
        self
    }

    /// Sets [`SemaphoreExtra::min_replicas`]: `n` replicas within
    /// `timeout`; `n == 0` turns it off.
    #[must_use]
    pub fn min_replicas(mut self, n: u32, timeout: Duration) -> Self {
        self.extra.min_replicas = (n > 0).then_some((n, timeout));
        self
    }
}

impl ReentrantOptions {
    /// Sets [`ReentrantExtra::fencing`].
    #[must_use]
    pub fn fencing(mut self, enabled: bool) -> Self {
        self.extra.fencing = enabled;
        self
    }

    /// Sets [`ReentrantExtra::min_replicas`]: `n` replicas within
    /// `timeout`; `n == 0` turns it off.
    #[must_use]
    pub fn min_replicas(mut self, n: u32, timeout: Duration) -> Self {
        self.extra.min_replicas = (n > 0).then_some((n, timeout));
        self
    }
}

impl RwLockOptions {
    /// Sets [`RwLockExtra::prefer_readers`].
    #[must_use]
    pub fn prefer_readers(mut self, prefer: bool) -> Self {
        self.extra.prefer_readers = prefer;
        self
    }

    /// Sets [`RwLockExtra::fencing`].
    #[must_use]
    pub fn fencing(mut self, enabled: bool) -> Self {
        self.extra.fencing = enabled;
        self
    }

    /// Sets [`RwLockExtra::min_replicas`]: `n` replicas within `timeout`;
    /// `n == 0` turns it off.
    #[must_use]
    pub fn min_replicas(mut self, n: u32, timeout: Duration) -> Self {
        self.extra.min_replicas = (n > 0).then_some((n, timeout));
        self
    }
}

impl RedLockOptions {
    /// Sets [`RedLockExtra::node_timeout`].
    #[must_use]
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        self.extra.node_timeout = Some(timeout);
        self
    }
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

/// Checks [`LockExtra::min_replicas`]: a timeout of at least 1 ms (`WAIT
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
        let with = |t| LockOptions::default().min_replicas(1, t).extra.min_replicas;
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
                    .extra
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
