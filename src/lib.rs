//! # redmutex
//!
//! A synchronous, blocking distributed lock on Redis, for threaded programs
//! and batch jobs that must not run twice at once across machines.
//!
//! ```no_run
//! use std::time::Duration;
//! use redmutex::{DistributedLock, Lease, LockClient, LockOptions};
//!
//! # fn main() -> Result<(), redmutex::Error> {
//! let client = LockClient::open("redis://127.0.0.1:6379/")?;
//! let lock = DistributedLock::with_options(
//!     &client,
//!     "jobs:nightly-report",
//!     LockOptions::default().ttl(Duration::from_secs(60)).wait(Duration::from_secs(5)),
//! );
//! let guard = lock.lock()?;            // Err(Error::Timeout { .. }) after 5 s
//! // ... work, shorter than the 60 s lease ...
//! assert!(guard.validity() > Duration::ZERO);
//! guard.unlock()?;                     // Err(Error::NotHeld { .. }) if the lease ran out
//! # Ok(())
//! # }
//! ```
//!
//! ## How it works
//!
//! * **Acquire**: `SET key token NX PX ttl GET`, one round trip, with a fresh
//!   token (a random secret and the [`Holder`] metadata). [`DistributedLock::lock`], [`DistributedLock::try_lock_for`]
//!   and [`DistributedLock::try_lock_until`] retry with exponential backoff and
//!   full jitter, never sleeping past the deadline, with one last attempt at it.
//! * **Release** is owner-checked, by [`Release::Lua`] (one `EVALSHA`,
//!   reloaded after `NOSCRIPT`) or [`Release::Watch`] (`WATCH`+`GET`, then
//!   `MULTI`/`DEL`/`EXEC`: two round trips, `UNWATCH` on every other path).
//!   Both report [`LossReason::Expired`] and [`LossReason::OwnedByOther`]
//!   apart and never delete a key they do not own.
//! * **Reentrancy** is per thread and per [`LockClient`]: a second acquire of
//!   a key the thread holds returns a nested guard without any Redis command;
//!   the lock is released in Redis when the last guard of the hold goes. So a
//!   [`LockGuard`] is `!Send`.
//! * **No hangs**: [`LockClient::open`]'s pool bounds connecting (the TCP
//!   connect and the handshake), waiting for a connection and every read
//!   and write by one timeout (2 s), and sends no `PING` per checkout.
//!
//! ## Waiting: notify (default) or spin
//!
//! [`WaitMode::Notify`] (the default):
//!
//! * **One Redis waiter per key per client.** Threads of one [`LockClient`]
//!   waiting for the same key queue locally in FIFO order; only the head of
//!   the queue talks to Redis, the others sleep and cost nothing.
//! * **Wake-up by pub/sub.** Releases publish on the key's channel
//!   (`redmutex:released:{<key or its hash tag>}…`). Each client keeps one
//!   dedicated subscriber connection and thread (started on first need),
//!   subscribed to the channels of keys it has waiters for. The head
//!   subscribes before each attempt, so a release right after a failed
//!   attempt is never missed; it then sleeps until a message, a handoff, or
//!   at most the holder's remaining ttl or the backoff step, so an expiry (no
//!   message) or a lost message costs little. While the subscriber
//!   connection is down, heads wait with backoff as in spin mode.
//! * **Bounded in-process handoff.** When a holder releases and a thread of
//!   the same client is queued for the key, the lease passes to it directly,
//!   same token: no Redis command while Redis confirmed it within the last
//!   millisecond, one `GET` otherwise (below). The new guard starts with at
//!   least half the ttl (the lease is extended first, owner-checked, when
//!   less is left).
//!   After a hold shorter than a thread's wake-up (20 µs), a thread that
//!   asks again before the woken waiter has run takes the lease instead,
//!   but only in the first 100 µs after that waiter was handed a lease
//!   (eventual fairness, as in `parking_lot`): a hot lock with a tiny
//!   critical section is not paid for with a context switch per
//!   acquisition, and holds longer than 20 µs keep the queue's strict
//!   order.
//!   A fairness budget (256 consecutive handoffs or 10 ms since the lease was
//!   taken in Redis, [`LockOptions::handoff_budget`]) then forces a real
//!   release, and when that release reached other clients' waiters, this
//!   client's head stands back for a moment so they get the turn.
//!   **Trade-off**: handoff makes a hot lock cheap and close to fair between
//!   the threads of a process (hundreds of thousands of acquisitions per
//!   second with tiny holds, a few Redis commands per hundred), at the price
//!   of making other processes wait up to one budget and the hold under
//!   way (the bound in `docs/failure-model.md`); `local_handoff(false)`
//!   turns it off, interception with it.
//!   Reentrant holds are unaffected: a handoff happens only when the
//!   outermost guard goes.
//!   A lease passed on is as fresh as an acquisition: when Redis last
//!   confirmed it (its acquisition, a renewal, an extension, a check) more
//!   than the budget's `max_age` ago (1 ms,
//!   [`HandoffBudget::max_age`]), the thread passing it asks Redis
//!   first (one read-only, owner-checked `GET`; for a semaphore permit, its
//!   place and the stored limit), and releases it instead, its `unlock()`
//!   reporting [`Error::NotHeld`], when Redis no longer holds it (deleted,
//!   expired early, lost in a restart or failover); the receiving call
//!   asks again before it returns when the lease grew older meanwhile, and
//!   asks Redis for the lock afresh when it is gone. A thread handed a
//!   lease therefore starts on one Redis vouched for at most `max_age` and
//!   one round trip earlier: the window for a second holder is the one an
//!   acquisition made that much earlier has (a `max_age` of zero confirms
//!   every handoff). A permit passes only to a handle opened with its
//!   limit, and not once a check finds the stored limit changed.
//!
//! ## Watchdog and fencing
//!
//! [`LockOptions::watchdog`] renews a lease every ttl/3 from one background
//! thread per client and tells the holder when it is lost
//! ([`LockGuard::is_lost`], [`LockGuard::loss_signal`]).
//! [`LockOptions::fencing`] gives every acquisition a strictly increasing
//! [`LockGuard::fencing_token`] for the protected resource to check: the
//! only way to make a lease safe against a holder that pauses past it.
//! Every token is at least the server's clock in microseconds (`TIME`), so
//! a failover or a restart that lost the counter's last increments still
//! gives larger tokens, unless the new server's clock is behind the old
//! one's by more than the failover took.
//!
//! ## The family
//!
//! * [`ReentrantLock`]: the hold count in a Redis hash (owner
//!   `<process uuid>:<thread id>`), visible in Redis, re-entered through any
//!   client of the thread.
//! * [`RwLock`]: many readers or one writer in one hash, each reader its own
//!   field and server-side deadline, writer preference.
//! * [`Semaphore`]: at most N [`Permit`]s at once, each a lease with its own
//!   server-clock deadline in one hash, the limit stored with them; a
//!   resent acquire finds its own permit, a duplicate release adds no
//!   capacity. Permits take the watchdog, fencing tokens and
//!   `min_replicas` like the lock ([`SemaphoreOptions`]).
//! * [`LockOptions::min_replicas`]: `WAIT` for replicas after acquiring, so a
//!   failover is less likely to forget a granted lock.
//! * [`RedLock`]: one lock over N independent masters, granted by a majority
//!   within a validity of ttl − elapsed − drift.
//!
//! ### Capabilities by lock type
//!
//! Every guard holds a lease through the [`Lease`] trait (`use
//! redmutex::Lease;`): code written against `impl Lease` works with any of
//! them. Every type is configured one way, by its own [`Options`] (the
//! same core for all, and in `extra` what only that type has: a setting a
//! type cannot honour cannot be passed). What each type offers (each ✓ is
//! exercised against a real Redis by `tests/capabilities.rs`):
//!
//! | | [`DistributedLock`] | [`ReentrantLock`] | [`RwLock`] (read / write) | [`Semaphore`] | [`RedLock`] |
//! |---|---|---|---|---|---|
//! | [`Lease`]: `validity` (zero once lost), `is_held` (asks Redis), `extend` (owner-checked), `is_lost`, `loss_signal`, `unlock` | ✓ | ✓ | ✓ (each holder its own deadline) | ✓ | ✓ (by majority) |
//! | watchdog, `max_hold` ([`Options::watchdog`]) | ✓ | ✓ (the owner's hash) | ✓ (each holder's field) | ✓ | ✓ (on a majority, a thread per guard) |
//! | [`Lease::fencing_token`] (one counter per key) | ✓ | ✓ (the owner's: drawn by its first fenced hold, carried by the others) | writer ✓, readers none | ✓ | no, by design (see the deployments chapter) |
//! | `min_replicas` | ✓ | ✓ | ✓ | ✓ | n/a |
//! | `status()`: who holds it, atomic | ✓ | ✓ | ✓ | ✓ (per permit, ids redacted) | ✓ (the majority's holder) |
//! | [`Error::Timeout`] names the holder | ✓ | ✓ | ✓ | ✓ (the permit that frees first) | – |
//! | a nested unlock says [`Unlocked::StillHeld`] | ✓ | ✓ | – | – | – |
//! | waits by notify (a local queue, woken by the release) | ✓ | ✓ | ✓ | ✓ | ✓ (any node's message) |
//! | handoff between threads of a client | ✓ | – | – | ✓ | – |
//!
//! ## Deployments
//!
//! The constructor picks the deployment; the lock types stay the same
//! ([`LockClient::deployment`] tells which). [`LockClient::builder`] covers
//! every deployment with every setting (timeout, pool size, notify on or
//! off, default options, and a [key prefix](LockClientBuilder::key_prefix)
//! that every key and channel of every lock type starts with, for ACL
//! users confined to `~prefix*`); [`LockClient::open`] is its short form
//! for one server:
//!
//! * [`LockClientBuilder::url`], or [`LockClient::open`]: one server.
//! * [`LockClientBuilder::sentinel`]: the primary Redis Sentinel names, found
//!   again on every new connection, so the client follows a failover (the
//!   subscriber connection too). Combine with [`LockOptions::min_replicas`].
//! * [`LockClientBuilder::cluster`]: Redis Cluster. Every script touches one
//!   slot (auxiliary keys carry the key's hash tag), redirections are
//!   followed, lost scripts are reloaded on every primary, `WAIT` goes to
//!   the key's primary. [`Release::Watch`] is refused there
//!   ([`Error::InvalidArgument`]): a redirection between `WATCH` and `EXEC`
//!   would make the delete unchecked. Release messages use sharded
//!   pub/sub (`SPUBLISH` in the key's slot, `SSUBSCRIBE` on the node that
//!   owns it; Redis 7.0+, `PUBLISH` before), so a release costs the nodes
//!   of other shards nothing.
//! * [`RedLock`] over N independent [`LockClient`]s of any kind.
//!
//! **TLS** (`rediss://`, the `tls-rustls` feature; `tls-rustls-webpki-roots`
//! for Mozilla's roots compiled in) covers every deployment and every
//! connection a client opens: the pool, the watchdog's renewals, the
//! subscriber connection (notify waiting stays notify waiting on TLS),
//! the sentinels and the primary they name, every Cluster node. A CA of
//! your own and a client certificate for mutual TLS go through
//! [`LockClientBuilder::tls_ca_file`] and
//! [`LockClientBuilder::tls_client_cert_files`], an ACL login through the
//! URL or [`LockClientBuilder::username`] and
//! [`LockClientBuilder::password`]. The handshake is bounded by the
//! client's timeout like the TCP connect.
//!
//! [`WaitMode::Spin`] polls Redis with exponential backoff and full jitter:
//! every waiter polls on its own, there is no ordering, and wake-up waits
//! for the backoff.
//!
//! ## Operating it
//!
//! [`LockClient::stats`] counts commands, Redis acquisitions, handoffs and
//! release messages, and per lock type ([`LockStats::kind`]) acquisitions,
//! timeouts, losses, renewals, errors by [`Error::kind`] and wait and hold
//! time [`Distribution`]s; the `metrics` feature reports the same through
//! the `metrics` facade, labelled by lock type and a caller-chosen
//! `key_class`. Every lease carries its [`Holder`] (host, pid, program,
//! label, acquisition time by the server's clock) inside its token,
//! written by the acquisition itself; [`LockClient::list`] shows every
//! held lock and semaphore under the client's prefix (kind, time left,
//! holders and who they are; never a token's secret), and a lock's
//! `status()` ([`DistributedLock::status`], [`ReentrantLock::status`],
//! [`RwLock::status`]) the same for one key, in one atomic read. A server that
//! refuses a command the crate needs gives [`Error::Unsupported`].
//!
//! ## Guarantees
//!
//! With one Redis server that keeps its data:
//!
//! * **Mutual exclusion while the lease lasts**: at most one token is in the
//!   key at a time, so two guards of different holds are never valid at once
//!   while both holders finish within their lease.
//! * **Owner-checked release and extension**: a guard never deletes or
//!   extends a key holding another owner's token, and says which case it met.
//! * **Crash safety**: a holder that dies frees the lock after at most the
//!   ttl.
//! * **Bounded calls**: every call returns within the wait plus one
//!   connect and the resend window (three I/O timeouts in all), on Redis
//!   Cluster too; an unreachable server is an error, never `Ok(None)`.
//! * **Isolation**: a connection is opened by the thread that needs it,
//!   within its call's wait, so a stalled server, cluster node or sentinel
//!   delays only the calls that go to it; the watchdog renews a cluster's
//!   leases per node, in parallel.
//! * **The truth after a lost reply**: a request whose reply was lost (the
//!   connection reset, timed out or was interrupted after Redis ran it) is
//!   applied at most once and answered as its first send would have been,
//!   or reported as [`Error::OutcomeUnknown`]. See below.
//! * **Handoffs as fresh as acquisitions**: a thread handed a lease by
//!   another thread of the client starts only on one Redis confirmed
//!   within the handoff budget's `max_age` (1 ms) and one round trip (see
//!   the handoff above); lock types refuse each other's keys
//!   ([`Error::WrongType`], nothing changed, no value of theirs named); a
//!   client, lock, guard or permit inherited through `fork()` is inert in
//!   the child: every call refuses ([`Error::InvalidArgument`]; build a
//!   new client there, whose reentrant owner id is its own), and nothing
//!   inherited is sent on, closed, shut down or joined, its drop included.
//!
//! ## Failure model
//!
//! * **Lost replies.** A connection whose reply was lost is closed, never
//!   reused. The request is sent again on a fresh connection (at most three
//!   sends, within twice the I/O timeout), and every request is safe to
//!   send twice: an acquisition recognises its own token, a release that
//!   deleted the key leaves a short marker (`{KEY}:released:<token>`, three
//!   timeouts), a [`ReentrantLock`] keeps one field per hold, an
//!   [`RwLock`] grant recognises its token, and
//!   [`DistributedLock::force_release`] records what it deleted under a
//!   request id. (On Redis Cluster redis-rs resends by itself, so nothing
//!   may rely on being sent once.)
//! * **Drop writes its release behind.** A [`LockGuard`] dropped without
//!   [`LockGuard::unlock`] sends its owner-checked release and returns; the
//!   next request on that pooled connection reads the reply with its own,
//!   in one round trip. A reply lost that way is logged as "release outcome
//!   unknown" and the token goes to the cleanup below; `NOSCRIPT` sends it
//!   again by `EVAL`; a failed write releases synchronously; a reply nobody
//!   reads within 20 ms has the client read its idle connections, and one
//!   still unread within three I/O timeouts (at least 1 s) has the cleanup
//!   release the token
//!   (owner-checked, so harmless if the release ran). Only with
//!   [`Release::Lua`], on a plain connection of the client's own pool that
//!   the server answered within the last 500 ms, while no thread of the
//!   client waits for the key and the key's last release by this client
//!   reached no subscriber (a notify-mode waiter elsewhere). A semaphore
//!   [`Permit`] dropped without [`Permit::release`] is written behind the
//!   same way. Otherwise (and on Cluster, with a pool you built, for the
//!   reentrant and read-write locks) drop releases synchronously.
//!   `unlock()` and [`Permit::release`] always do, and are the calls to
//!   make when the key (or the place) must be free when they return.
//! * **Failures leave nothing.** An acquisition whose request may have set
//!   the key but which returns an error, and a release that fails on the
//!   network, hand the token to the client's cleanup (on the watchdog
//!   thread), which releases it, owner-checked, as soon as Redis answers
//!   again. A lease lost by the local clock is still released on unlock.
//! * **Stalls and partitions.** Connects and handshakes are bounded; the
//!   subscriber pings a silent link and drops it after two timeouts; a
//!   watched lease reads as lost from its local expiry (send time + ttl −
//!   drift) whatever its renewal is doing, so the holder knows before Redis
//!   can give the key to anyone else; [`LockGuard::validity`] never waits
//!   on the network.
//! * **Resets** retire the pool's older idle connections without a round
//!   trip; **`EINTR`** (a caller stopped and continued mid-call) is a lost
//!   reply; **ACL users** without channel permissions release normally and
//!   wait by backoff; a **corrupt fencing counter** is
//!   [`Error::FenceCounter`], with nothing taken.
//! * **Threads.** A client starts a watchdog thread and a subscriber
//!   thread (one per node with waiters on Redis Cluster), each on first
//!   need, and nothing else: a connection is opened by the thread that
//!   needs it. A [`RedLock`] adds a thread per node, and one per guard
//!   held with the watchdog. Dropping the last clone tells them all to stop at once,
//!   reads the replies its idle connections still owe (releases written
//!   behind) within 250 ms in all, and waits for the threads together, at
//!   most 100 ms from when they were told: it returns within 100 ms, or
//!   250 ms when replies were owed, plus one I/O timeout when a cleanup
//!   round is pending; the threads end by themselves within one I/O
//!   timeout.
//!
//! `docs/failure-model.md` has the whole table, the bounds and the ACL
//! rule a lock user needs.
//!
//! ## Non-guarantees: it is a lease, not a mutex
//!
//! * If the holder runs longer than the ttl (a long pause, a stop-the-world
//!   GC, a swapped-out process, a slow network), the key expires and another
//!   client may acquire while the first still believes it holds the lock.
//!   [`LockGuard::validity`] tells the time left by the local clock;
//!   [`LockGuard::extend`] renews; [`LockGuard::is_held`] asks Redis. None of
//!   them can stop a paused process from acting late: protect the resource
//!   itself with a fencing token when correctness depends on it.
//! * **Replication is asynchronous**: after a failover to a replica that had
//!   not received the key (Sentinel, or a cluster shard), a second client can
//!   acquire the same lock. [`LockOptions::min_replicas`] narrows this
//!   window, it cannot close it.
//! * **Restarts without persistence** (`--save ''`, no AOF) forget every
//!   lock; with `appendfsync everysec` the last second can be lost.
//! * **Eviction**: under `maxmemory` with an `allkeys-*` policy Redis may
//!   evict a lock key; use `noeviction` or a `volatile-*` policy with care.
//!
//! ## Feature flags
//!
//! None is on by default.
//!
//! * `tls-rustls`: `rediss://` with rustls, trusting the system's root
//!   certificates unless a CA is given
//!   ([`LockClientBuilder::tls_ca_file`]).
//! * `tls-rustls-webpki-roots`: as `tls-rustls`, with Mozilla's roots
//!   compiled in, for containers without a CA bundle.
//! * `metrics`: the client's counters and histograms reported through the
//!   `metrics` facade.
//! * `cli`: the `redmutex` command-line tool (brings `tls-rustls`).
//!
//! ## Requirements
//!
//! Redis 6.2 or newer, or Valkey (the tested servers: the guide's
//! deployments chapter), Rust 1.95. Before Redis 7.0 an acquisition goes
//! by script (`SET … NX … GET` needs 7.0). The notify wait mode's
//! subscriber connection speaks plain TCP, TLS or a Unix socket (with `AUTH`
//! from the URL), so waiters are woken by release messages on all three.

#![warn(missing_docs)]

// The layers, lowest first; each may use only the layers before it in
// this list (checked by `tests/layers.rs`; see ARCHITECTURE.md):
//
// layers: error fork lease wait conn script notify renew client mutex family
mod client;
mod conn;
mod error;
mod family;
mod fork;
mod lease;
mod mutex;
mod notify;
mod renew;
mod script;
mod wait;

pub use client::builder::LockClientBuilder;
pub use client::holder::{Holder, redact};
pub use client::list::{HeldLock, Listing};
pub use client::options::{
    Backoff, HandoffBudget, LockExtra, LockOptions, Options, RedLockExtra, RedLockOptions,
    ReentrantExtra, ReentrantOptions, Release, RwLockExtra, RwLockOptions, SemaphoreExtra,
    SemaphoreOptions, WaitMode,
};
pub use client::{DEFAULT_POOL_SIZE, DEFAULT_TIMEOUT, LockClient, MAX_TIMEOUT};
pub use conn::backend::{Connection, Deployment};
pub use conn::histogram::Distribution;
pub use conn::stats::{KindStats, LockKind, LockStats};
pub use error::{Error, LossReason, PoolError};
pub use family::redlock::{RedLock, RedLockGuard};
pub use family::reentrant::{ReentrantGuard, ReentrantLock};
pub use family::rwlock::{RwGuard, RwLock};
pub use family::semaphore::{Permit, PermitHolder, Semaphore, SemaphoreStatus};
pub use lease::loss::LossSignal;
pub use lease::{Lease, Unlocked};
pub use mutex::DistributedLock;
pub use mutex::guard::LockGuard;

/// The connection pool type a [`LockClient`] is built on.
pub type Pool = r2d2::Pool<redis::Client>;

// Re-exported so users build pools and match errors with the same versions.
pub use r2d2;
pub use redis;

/// The README's examples, compiled as doc tests so they cannot rot.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// The guide's examples, compiled as doc tests.
#[doc = include_str!("../docs/guide.md")]
#[doc = include_str!("../docs/deployments.md")]
#[doc = include_str!("../docs/cli.md")]
#[doc = include_str!("../docs/operating.md")]
#[doc = include_str!("../docs/failure-model.md")]
#[doc = include_str!("../docs/performance.md")]
#[doc = include_str!("../docs/testing.md")]
#[cfg(doctest)]
pub struct GuideDoctests;

// The auto traits that are part of the contract, checked where the types
// are built (`public-api.txt` lists every public type's, as the compiler
// computes them). Handles, the client and its options cross threads; a
// permit, a read-write guard and a RedLock guard may be moved to and shared
// with another thread. `LockGuard` and `ReentrantGuard` are `!Send` on
// purpose (their holds are the thread's), shown by `compile_fail` examples
// on those types.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<LockClient>();
    send_sync::<LockClientBuilder>();
    send_sync::<DistributedLock>();
    send_sync::<ReentrantLock>();
    send_sync::<RwLock>();
    send_sync::<Semaphore>();
    send_sync::<RedLock>();
    send_sync::<Permit>();
    send_sync::<RwGuard>();
    send_sync::<RedLockGuard>();
    send_sync::<LossSignal>();
    send_sync::<LockOptions>();
    send_sync::<ReentrantOptions>();
    send_sync::<RwLockOptions>();
    send_sync::<RedLockOptions>();
    send_sync::<SemaphoreOptions>();
    send_sync::<Error>();
    // A checked-out connection may go to another thread (it is `!Sync`:
    // redis-rs's cluster connection keeps its state in `RefCell`s).
    const fn send<T: Send>() {}
    send::<Connection>();
};
