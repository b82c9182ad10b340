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
//! ## The guide
//!
//! For a user of the locks, in the order you need them:
//!
//! * [Using the locks](guide::using): which type, which options, what
//!   happens when a lease is lost, which errors mean what.
//! * [Deployments](guide::deployments): Sentinel, Redis Cluster, RedLock,
//!   TLS and authentication, and the servers it is tested against.
//! * [The `redmutex` command](guide::cli): a command run under a lock on
//!   every machine of a fleet.
//! * [Operating it](guide::operating): who holds what, holder metadata,
//!   metrics, managed and proxy Redis.
//! * [Guarantees and the failure model](guide::failure_model): every
//!   fault, what the crate does and what the caller sees; every bound; the
//!   ACL rules.
//! * [Performance](guide::performance): what each call costs, with the
//!   commands that measure it.
//!
//! For a contributor: [How it works](guide::internals) (handoff,
//! interception, the release written behind, the ledger of owed replies,
//! the watchdog, fencing), and `ARCHITECTURE.md` in the repository.
//!
//! The examples in the repository's `examples/` folder depend on this
//! crate alone and read the server's URL from `REDMUTEX_URL`.
//!
//! ## The lock types
//!
//! | type | for |
//! |---|---|
//! | [`DistributedLock`] | one holder at a time; the [`LockGuard`] releases on drop, [`unlock`](Lease::unlock) reports |
//! | [`ReentrantLock`] | the same thread (through any client) may take it again; the holds are counted in Redis |
//! | [`RwLock`] | many readers or one writer, writers not starved; a writer may [downgrade](RwGuard::downgrade) to a reader |
//! | [`Semaphore`] | at most N holders at once |
//! | [`MultiLock`] | several keys, all or none, without deadlock |
//! | [`FairLock`] | one holder at a time, granted in the order the waiters asked, across processes |
//! | [`RedLock`] | a majority of independent Redis masters |
//!
//! A [`LockGuard`] stays on its thread (its reentrancy lives there);
//! [`LockGuard::into_movable`] makes it a [`MovableGuard`] another thread
//! may finish and release.
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
//! | | [`DistributedLock`] | [`ReentrantLock`] | [`RwLock`] (read / write) | [`Semaphore`] | [`MultiLock`] | [`FairLock`] | [`RedLock`] |
//! |---|---|---|---|---|---|---|---|
//! | [`Lease`]: `validity` (zero once lost), `is_held` (asks Redis), `extend` (owner-checked), `is_lost`, `loss_signal`, `unlock` | ✓ | ✓ | ✓ (each holder its own deadline) | ✓ | ✓ (the set is one lease: one key lost loses it) | ✓ | ✓ (by majority) |
//! | watchdog, `max_hold` ([`Options::watchdog`]) | ✓ | ✓ (the owner's hash) | ✓ (each holder's field) | ✓ | ✓ (each slot's keys at once) | ✓ | ✓ (on a majority, a thread per guard) |
//! | [`Lease::fencing_token`] (one counter per key) | ✓ | ✓ (the owner's: drawn by its first fenced hold, carried by the others) | writer ✓, readers none | ✓ | ✓ (one per key: [`MultiGuard::fencing_tokens`]) | ✓ | no, by design ([why](guide::deployments#redlock-over-independent-masters)) |
//! | `min_replicas` | ✓ | ✓ | ✓ | ✓ | – | – | n/a |
//! | `status()`: who holds it, atomic | ✓ | ✓ | ✓ | ✓ (per permit, ids redacted) | – (each key's, by [`DistributedLock::status`]) | ✓ | ✓ (the majority's holder) |
//! | [`Error::Timeout`] names the holder | ✓ | ✓ | ✓ | ✓ (the permit that frees first) | ✓ (of the first key held) | ✓ | – |
//! | a nested unlock says [`Unlocked::StillHeld`] | ✓ | ✓ | – | – | – | – | – |
//! | waits by notify (a local queue, woken by the release) | ✓ | ✓ | ✓ | ✓ | ✓ (any key's release) | ✓ (the queue's head alone) | ✓ (any node's message) |
//! | handoff between threads of a client | ✓ | – | – | ✓ | – | – | – |
//! | the guard is `Send` | with [`LockGuard::into_movable`] | – | ✓ | ✓ | ✓ | ✓ | ✓ |
//!
//! The constructor of the [`LockClient`] picks the deployment (one server,
//! Sentinel, Cluster; [`LockClient::builder`] covers them all); the lock
//! types stay the same on each.
//!
//! ## What it guarantees, and what it does not
//!
//! A lock in Redis is a **lease**: it keeps its promise only while every
//! holder finishes within its ttl. With one Redis server that keeps its
//! data:
//!
//! * **Mutual exclusion while the lease lasts**: at most one token is in the
//!   key at a time, so two guards of different holds are never valid at
//!   once while both holders finish within their lease.
//! * **Owner-checked release and extension**: a guard never deletes or
//!   extends a key holding another owner's token, and says which case it
//!   met ([`LossReason::Expired`] or [`LossReason::OwnedByOther`]).
//! * **Crash safety**: a holder that dies frees the lock after at most the
//!   ttl.
//! * **Bounded calls**: every call returns within its wait plus a bound
//!   that depends on the deployment (the
//!   [bounds](guide::failure_model#bounds)); an unreachable server is an
//!   error, never `Ok(None)`.
//! * **Isolation**: a stalled server, cluster node or sentinel delays only
//!   the calls that go to it.
//! * **The truth after a lost reply**: a request whose reply was lost is
//!   applied at most once and answered as its first send would have been,
//!   or reported as [`Error::OutcomeUnknown`].
//! * **Handoffs as fresh as acquisitions**: a thread handed a lease by
//!   another thread of its client starts only on one Redis confirmed
//!   moments before ([how fresh](guide::internals#a-lease-passed-on-is-as-fresh-as-an-acquisition)).
//! * **Fork**: a client, lock, guard or permit inherited through `fork()`
//!   is inert in the child: every call refuses
//!   ([`Error::InvalidArgument`]; build a new client there), and nothing
//!   inherited is sent on, closed or joined, its drop included.
//!
//! It does **not** protect against:
//!
//! * **A holder running past its ttl** (a long pause, a stop-the-world GC,
//!   a swapped-out process, a slow network): the key expires and another
//!   client may acquire while the first still believes it holds the lock.
//!   [`Lease::validity`] tells the time left by the local clock,
//!   [`Lease::extend`] renews, the watchdog renews in the background and
//!   reports a loss; none of them can stop a paused process from acting
//!   late. Protect the resource itself with a
//!   [fencing token](guide::using#fencing-tokens) when correctness depends
//!   on it (Kleppmann, "How to do distributed locking").
//! * **Asynchronous replication**: after a failover to a replica that had
//!   not received the key (Sentinel, a cluster shard), a second client can
//!   acquire the same lock. [`LockOptions::min_replicas`] narrows this
//!   window; it cannot close it.
//! * **Restarts without persistence** (`--save ''`, no AOF), which forget
//!   every lock, and **eviction** under `maxmemory` with an `allkeys-*`
//!   policy, which can remove a lock key.
//!
//! The [failure model](guide::failure_model) lists every fault, what the
//! crate does and what the caller sees.
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
//! ## Requirements and platforms
//!
//! * **Servers**: Redis 6.0 or newer, or Valkey 7.2 or newer; the versions
//!   tested are listed in [Servers](guide::deployments#servers).
//! * **Rust**: the `rust-version` of `Cargo.toml`.
//! * **Platforms**: tested on Linux (x86_64) only; that is where CI runs.
//!   The library has other paths where it uses something Linux-specific
//!   (the standard monotonic clock where Linux reads
//!   `CLOCK_MONOTONIC_COARSE`; on a system without Unix signals or sockets,
//!   no signal masking and no Unix-socket subscriber), and detects a
//!   `fork()` with `pthread_atfork`, which every Unix has. Those paths are
//!   neither built nor tested here, so macOS, the BSDs and Windows are
//!   expected to need work and are not promised. The `redmutex run`
//!   supervisor needs Linux: child subreapers (`PR_SET_CHILD_SUBREAPER`),
//!   pidfds (Linux 5.3) and `/proc` are how it keeps every process of the
//!   command under the lease.

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

pub mod guide;

pub use client::builder::{LockClientBuilder, redact_url};
pub use client::holder::{Holder, redact};
pub use client::list::{HeldLock, Listing};
pub use client::options::{
    Backoff, FairLockExtra, FairLockOptions, HandoffBudget, LockExtra, LockOptions, MultiLockExtra,
    MultiLockOptions, Options, RedLockExtra, RedLockOptions, ReentrantExtra, ReentrantOptions,
    Release, RwLockExtra, RwLockOptions, SemaphoreExtra, SemaphoreOptions, WaitMode,
};
pub use client::{DEFAULT_POOL_SIZE, DEFAULT_TIMEOUT, LockClient, MAX_TIMEOUT};
pub use conn::backend::{Connection, Deployment};
pub use conn::histogram::Distribution;
pub use conn::stats::{KindStats, LockKind, LockStats};
pub use error::{Error, LossReason, PoolError};
pub use family::fair::{FairGuard, FairLock, FairWaiter};
pub use family::multi::{MultiGuard, MultiLock};
pub use family::redlock::{RedLock, RedLockGuard};
pub use family::reentrant::{ReentrantGuard, ReentrantLock};
pub use family::rwlock::{RwGuard, RwLock};
pub use family::semaphore::{Permit, PermitHolder, Semaphore, SemaphoreStatus};
pub use lease::loss::LossSignal;
pub use lease::{Lease, Unlocked};
pub use mutex::DistributedLock;
pub use mutex::guard::{LockGuard, MovableGuard};

/// The connection pool type a [`LockClient`] is built on.
pub type Pool = r2d2::Pool<redis::Client>;

// Re-exported so users build pools and match errors with the same versions.
pub use r2d2;
pub use redis;

/// The README's examples, compiled as doc tests so they cannot rot.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

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
