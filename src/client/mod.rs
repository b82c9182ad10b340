//! `LockClient`: the shared handle every lock of a program goes through,
//! how to build one for each deployment, the lock options, and the release
//! and marker machinery every lock type shares.
//!
//! Depends on `conn`, `notify`, `renew`, `wait` and `script`; knows no lock
//! type. A lock type keeps its per-client state (its wait queues, say) in
//! [`LockClient::local`], so adding a lock type never touches this module.
//!
//! Invariants: clones share one identity (pool, subscriber, watchdog,
//! reentrancy); building a client sends nothing; every deployment gets the
//! same bounded connect, handshake and I/O timeouts.

pub(crate) mod builder;
pub(crate) mod holder;
pub(crate) mod list;
pub(crate) mod options;
pub(crate) mod release;
pub(crate) mod replicas;

use std::any::Any;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};

use crate::client::holder::{Identity, ServerClock};
use crate::client::options::LockOptions;
use crate::conn::backend::{Backend, Connection, DRAIN_WAIT, Deployment};
use crate::conn::policy::{self, Op, Send};
use crate::conn::stats::{LockStats, Stats};
use crate::conn::worker::STOP_WAIT;
use crate::error::Error;
use crate::fork::Birth;
use crate::notify::subscriber::{Subscriber, Subscription};
use crate::notify::transport::Source;
use crate::renew::watchdog::{Orphan, OrphanKind, Watchdog};
use crate::script::names::Namespace;
use crate::wait::queue::{Feed, Waker};

/// Connect, read and write timeout of the pools built by [`LockClient::open`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest connection timeout accepted.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(3600);

/// Connections kept by the pools built by [`LockClient::open`] at most.
pub const DEFAULT_POOL_SIZE: u32 = 16;

/// How often a cluster connection retries a command the cluster could not
/// serve yet (`TRYAGAIN`, `CLUSTERDOWN`); the waits between grow from 10 ms.
pub(crate) const CLUSTER_RETRIES: u32 = 5;

static NEXT_CLIENT_ID: AtomicU64 = AtomicU64::new(1);

/// A cheap, clonable handle on a Redis connection pool and default
/// [`LockOptions`].
///
/// Clones share the pool and count as the same client for reentrancy: a
/// thread that holds a key through one clone re-enters it through another.
/// Two clients made by separate calls to [`LockClient::open`] or
/// [`LockClient::new`] are strangers to each other, like two processes.
///
/// ```no_run
/// use redmutex::Lease;
/// # fn main() -> Result<(), redmutex::Error> {
/// let client = redmutex::LockClient::open("redis://127.0.0.1:6379/")?;
/// let lock = redmutex::DistributedLock::new(&client, "jobs:nightly-report");
/// let guard = lock.lock()?;
/// // ... the critical section ...
/// guard.unlock()?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct LockClient {
    inner: Arc<Inner>,
    defaults: Arc<LockOptions>,
    /// What this handle writes about its holder into tokens: per handle
    /// like the defaults, so a clone can carry another label.
    holder: Arc<Identity>,
}

/// What clones of a client share.
struct Inner {
    /// Tells this client's holds apart from other clients' in the
    /// thread-local reentrancy table.
    id: u64,
    /// The parts that act when dropped (sockets, threads, the locks and
    /// waiters of the lock types) are `ManuallyDrop`: in a forked child,
    /// whose copy of them is its parent's, they are left alone (see
    /// `Drop for Inner`).
    backend: ManuallyDrop<Backend>,
    stats: Arc<Stats>,
    /// Each lock type's per-client state ([`LockClient::local`]).
    locals: ManuallyDrop<Mutex<Vec<Arc<dyn Any + std::marker::Send + Sync>>>>,
    /// Dropped after `locals`, whose queues hold its subscriptions.
    subscriber: ManuallyDrop<Subscriber>,
    watchdog: ManuallyDrop<Watchdog>,
    /// The server of a single-node client of [`LockClient::open`], and the
    /// plain pool [`LockClient::pool`] builds for it when asked.
    single: Option<redis::Client>,
    compat_pool: ManuallyDrop<OnceLock<r2d2::Pool<redis::Client>>>,
    /// The server refused a release marker (an ACL without the
    /// `{KEY}:released:*` keys): releases go without one from then on.
    markers_refused: AtomicBool,
    /// The server answered `SET … NX … GET` with a syntax error (Redis
    /// before 7.0): acquisitions go through the acquire script from then on.
    set_get_refused: AtomicBool,
    /// The key prefix, part of the client's identity like the pool.
    names: Namespace,
    /// The server's clock, for the acquisition time in holder metadata.
    clock: ServerClock,
    /// A release by script has worked on this client, so a dropped guard
    /// may write its release behind (see `release::release_behind`): the
    /// first release is always synchronous, and a server that refuses
    /// scripts turns writing behind off again.
    behind_ok: Arc<AtomicBool>,
    /// The process this client was built in: a forked child inherits a
    /// copy, whose locks are its parent's and whose connections carry its
    /// parent's traffic, so there it refuses everything.
    birth: Birth,
}

impl Inner {
    fn new(
        backend: Backend,
        notify: Option<Source>,
        single: Option<redis::Client>,
        names: Namespace,
    ) -> Inner {
        let stats = Arc::new(Stats::default());
        let watchdog = Watchdog::new(backend.clone(), stats.clone());
        Inner {
            watchdog: ManuallyDrop::new(watchdog),
            id: NEXT_CLIENT_ID.fetch_add(1, Ordering::Relaxed),
            subscriber: ManuallyDrop::new(Subscriber::new(
                notify,
                stats.clone(),
                backend.timeout(),
            )),
            backend: ManuallyDrop::new(backend),
            locals: ManuallyDrop::new(Mutex::new(Vec::new())),
            stats,
            single,
            compat_pool: ManuallyDrop::new(OnceLock::new()),
            markers_refused: AtomicBool::new(false),
            set_get_refused: AtomicBool::new(false),
            names,
            clock: ServerClock::default(),
            behind_ok: Arc::new(AtomicBool::new(false)),
            birth: Birth::now(),
        }
    }
}

impl Drop for Inner {
    /// The last clone of a client went: its threads are told to stop; the
    /// replies its idle connections still owe (releases written behind)
    /// are read, all within [`DRAIN_WAIT`]; the threads are waited for
    /// together, [`STOP_WAIT`] from when they were told (plus one I/O
    /// timeout when the watchdog has a last cleanup round to make); then
    /// the lock types' state, the subscriber, the watchdog and the pools
    /// go, in that order. So a drop takes at most `DRAIN_WAIT` (the larger
    /// of the two), plus one I/O timeout with a cleanup round pending.
    ///
    /// In a forked child nothing is done: its copy of the client is the
    /// parent's (the same sockets, threads that do not exist here, lock
    /// words a parent thread may have held at the fork), so nothing of it
    /// is closed, shut down, joined or locked; its memory stays until the
    /// child exits or execs (the sockets close on exec).
    fn drop(&mut self) {
        if !self.birth.is_current() {
            return;
        }
        let told = Instant::now();
        let threads: Vec<_> = self
            .subscriber
            .stop()
            .into_iter()
            .map(|thread| (thread, STOP_WAIT))
            .chain(self.watchdog.stop())
            .collect();
        // While the threads end: nobody else reads these replies now.
        self.backend.settle_idle(DRAIN_WAIT);
        crate::conn::worker::stop_all(told, threads);
        // SAFETY: each part is dropped once, here, and never used after
        // (`self` is being dropped).
        unsafe {
            ManuallyDrop::drop(&mut self.locals);
            ManuallyDrop::drop(&mut self.subscriber);
            ManuallyDrop::drop(&mut self.watchdog);
            ManuallyDrop::drop(&mut self.compat_pool);
            ManuallyDrop::drop(&mut self.backend);
        }
    }
}

/// Gives every connection of [`LockClient::pool`]'s pool read and write
/// timeouts, so a stalled server turns into an error instead of a hung
/// caller.
#[derive(Debug)]
struct IoTimeouts(Duration);

impl r2d2::CustomizeConnection<redis::Connection, redis::RedisError> for IoTimeouts {
    fn on_acquire(&self, conn: &mut redis::Connection) -> Result<(), redis::RedisError> {
        conn.set_read_timeout(Some(self.0))?;
        conn.set_write_timeout(Some(self.0))
    }
}

impl LockClient {
    pub(crate) fn build(
        backend: Backend,
        notify: Option<Source>,
        single: Option<redis::Client>,
        names: Namespace,
    ) -> LockClient {
        LockClient {
            inner: Arc::new(Inner::new(backend, notify, single, names)),
            defaults: Arc::new(LockOptions::default()),
            holder: Arc::new(Identity::default()),
        }
    }

    /// Gives a client made by [`LockClient::new`] or
    /// [`LockClient::new_cluster`] the server address for its dedicated
    /// subscriber connection (normally the `redis::Client` the pool was
    /// built from; for a cluster, any node). The client keeps its identity:
    /// clones made before share the subscriber too. On a client that
    /// already has a subscriber connection (or has been told to, by an
    /// earlier call), it changes nothing. A `rediss://` client is spoken to
    /// with TLS trusting the system's roots (or none, with `#insecure`) and
    /// no client certificate: redis-rs does not hand out the certificates
    /// it was built with. For a private CA or mutual TLS, build the client
    /// with [`LockClient::builder`].
    pub fn with_notify_client(self, client: &redis::Client) -> LockClient {
        // A `rediss://` client gets the system's roots (or `#insecure`):
        // redis-rs does not hand out the certificates it was built with.
        #[cfg(feature = "tls-rustls")]
        let tls = match client.get_connection_info().addr() {
            redis::ConnectionAddr::TcpTls { .. } => {
                match crate::conn::tls::Tls::new(&Default::default()) {
                    Ok(tls) => Some(tls),
                    Err(err) => {
                        log::warn!("redmutex: no TLS for the subscriber connection: {err}");
                        None
                    }
                }
            }
            _ => None,
        };
        #[cfg(not(feature = "tls-rustls"))]
        let tls = None;
        // On a cluster, each channel on its slot's node ([`LockClient::sharded`]).
        let source = if self.deployment() == Deployment::Cluster {
            Source::cluster([client], tls.as_ref())
        } else {
            Source::servers([client], tls.as_ref())
        };
        match source {
            Some(source) => {
                if !self.inner.subscriber.set_source(source) {
                    log::debug!(
                        "redmutex: with_notify_client on a client that already has a \
                         subscriber connection: kept as it is"
                    );
                }
            }
            None => log::debug!("redmutex: no subscriber connection can speak to {client:?}"),
        }
        self
    }

    /// Sets the options that [`DistributedLock::new`](crate::DistributedLock::new)
    /// gives its locks. Defaults to [`LockOptions::default`]. The result is
    /// the same client (shared pool, queues and reentrancy), with other
    /// defaults.
    pub fn with_defaults(self, options: LockOptions) -> LockClient {
        LockClient {
            defaults: Arc::new(options),
            ..self
        }
    }

    /// Sets the label this client writes into the holder metadata of its
    /// leases ([`Holder::label`](crate::Holder::label)), as
    /// [`LockClientBuilder::label`](crate::LockClientBuilder::label) does.
    /// Defaults to none. The result is the same client (shared pool,
    /// queues and reentrancy) with another label, and with the metadata on.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty label, one longer than 64
    /// bytes, or one with `|`, whitespace or a control character.
    pub fn with_label(self, label: &str) -> Result<LockClient, Error> {
        let holder = Identity::new(true, self.holder.program().as_deref(), Some(label))?;
        Ok(LockClient {
            holder: Arc::new(holder),
            ..self
        })
    }

    /// Turns the holder metadata of this client's leases on or off, as
    /// [`LockClientBuilder::holder_metadata`](crate::LockClientBuilder::holder_metadata)
    /// does. Defaults to on. Turning it on again starts from the
    /// executable's name and no label.
    pub fn with_holder_metadata(self, enabled: bool) -> LockClient {
        if enabled == self.holder.enabled() {
            return self;
        }
        let holder = if enabled {
            Identity::default()
        } else {
            Identity::off()
        };
        LockClient {
            holder: Arc::new(holder),
            ..self
        }
    }

    pub(crate) fn with_identity(self, holder: Identity) -> LockClient {
        LockClient {
            holder: Arc::new(holder),
            ..self
        }
    }

    /// A fresh token for an acquisition of `key`: a new secret and, unless
    /// turned off, the holder metadata with the server's time (read once
    /// per client: see `holder.rs`).
    ///
    /// # Errors
    ///
    /// A connection error when the client's first `TIME` cannot reach the
    /// server within one connect's wait: nothing was sent that changes
    /// Redis, and the acquisition would have met the same.
    pub(crate) fn new_token(&self, key: &str) -> Result<String, Error> {
        Ok(self.holder.token(self.acquisition_ms(key)?))
    }

    /// The token in `kept`, made there first ([`LockClient::new_token`],
    /// shared: one allocation) if none is yet: one token for every attempt
    /// of an acquisition, made only by the first that goes to Redis (a
    /// waiter served by a handoff takes the giver's).
    pub(crate) fn token_once(
        &self,
        kept: &mut Option<Arc<str>>,
        key: &str,
    ) -> Result<Arc<str>, Error> {
        if let Some(token) = kept {
            return Ok(token.clone());
        }
        let token = self.holder.token_shared(self.acquisition_ms(key)?);
        Ok(kept.insert(token).clone())
    }

    /// The acquisition time a token carries: the server's clock (one
    /// `TIME` per client), or 0 without metadata.
    fn acquisition_ms(&self, key: &str) -> Result<u64, Error> {
        if !self.holder.enabled() {
            return Ok(0);
        }
        self.inner.clock.now_ms(|| {
            self.inner.stats.commands(1);
            // A read, resent on a fresh connection after a lost reply, but
            // all within one connect's wait: the attempt it precedes takes
            // up to a connect and the resend window of its own, and a
            // call's bound has room for one connect more, not for a
            // second resend window (on a fresh client, whose first
            // attempt reads the clock).
            self.run_within(
                Op::Read,
                key,
                self.inner.backend.connect_wait(),
                |con, _| {
                    let time = redis::cmd("TIME");
                    // On a cluster, the key's own node: redis-rs sends a
                    // keyless command to any node, maybe one that stalls.
                    let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
                        Route::with_key(key, SlotAddr::Master),
                    ));
                    match con.on_cluster(|cluster| cluster.route(&time, route)) {
                        Some(reply) => Ok(redis::from_redis_value(reply?)?),
                        None => time.query::<(u64, u64)>(con),
                    }
                },
            )
        })
    }

    /// A fresh token with the holder's own clock for the acquisition time:
    /// for a RedLock, whose nodes' clocks are independent (none is "the
    /// server's"), and which must not wait on any one node, down or not.
    pub(crate) fn new_token_local(&self) -> String {
        self.holder.token(crate::client::holder::local_ms())
    }

    /// The options new locks of this client start from.
    pub fn defaults(&self) -> &LockOptions {
        &self.defaults
    }

    /// What this client (all its clones) has done so far: commands sent,
    /// locks acquired in Redis, in-process handoffs, release messages.
    pub fn stats(&self) -> LockStats {
        self.inner.stats.snapshot()
    }

    /// Which kind of deployment this client talks to.
    pub fn deployment(&self) -> Deployment {
        self.inner.backend.deployment()
    }

    /// Whether releases announce on `channel` with `SPUBLISH` (and waiters
    /// `SSUBSCRIBE`): on Redis Cluster, for a channel in its key's slot
    /// (every channel but those of keys with a stray `}`), so the message
    /// stays in the key's shard instead of reaching every node. The
    /// release scripts fall back to `PUBLISH` on a server without it
    /// (before 7.0), as the subscriber does to `SUBSCRIBE`.
    pub(crate) fn sharded(&self, channel: &str) -> bool {
        self.deployment() == Deployment::Cluster
            && crate::script::names::hash_tag(channel).is_some()
    }

    /// A plain connection pool to the server of a single-node client: the
    /// pool given to [`LockClient::new`], or, for a client of
    /// [`LockClient::open`], a pool built on first call with the same size
    /// and I/O timeouts.
    ///
    /// The locks do not use that second pool: theirs also bounds the
    /// handshake of new connections and never reuses a connection whose
    /// reply was lost, which a `Pool<redis::Client>` cannot. Prefer
    /// [`LockClient::connection`] for commands of your own.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] on a cluster or sentinel client, which has
    /// no such pool: use [`LockClient::connection`] (any deployment); and
    /// for a client inherited through `fork()`, whose pool holds its
    /// parent's sockets.
    pub fn pool(&self) -> Result<&r2d2::Pool<redis::Client>, Error> {
        self.check_process()?;
        if let Some(pool) = self.inner.backend.user_pool() {
            return Ok(pool);
        }
        match &self.inner.single {
            Some(client) => Ok(self.inner.compat_pool.get_or_init(|| {
                let timeout = self.inner.backend.timeout();
                r2d2::Pool::builder()
                    .max_size(DEFAULT_POOL_SIZE)
                    .min_idle(Some(0))
                    .test_on_check_out(false)
                    .connection_timeout(timeout)
                    .connection_customizer(Box::new(IoTimeouts(timeout)))
                    .build_unchecked(client.clone())
            })),
            None => Err(Error::InvalidArgument(format!(
                "LockClient::pool() is for single-node clients; this is a {:?} client \
                 (use LockClient::connection())",
                self.deployment()
            ))),
        }
    }

    /// A connection from this client's pool, for commands of your own next
    /// to the locks, whatever the deployment.
    ///
    /// # Errors
    ///
    /// [`Error::Pool`] when no connection can be had within the pool's
    /// connection timeout; [`Error::InvalidArgument`] for a client
    /// inherited through `fork()` (a child builds its own).
    pub fn connection(&self) -> Result<Connection, Error> {
        self.check_process()?;
        // Handed out owing nothing: a release written behind on it would
        // otherwise be read (or sent again, after NOSCRIPT) in the middle
        // of the caller's own commands, a MULTI say.
        let mut last = None;
        for _ in 0..2 {
            let mut con = self.inner.backend.get(self.inner.backend.connect_wait())?;
            match con.settle() {
                Ok(()) => return Ok(con),
                Err(err) => last = Some(err),
            }
        }
        Err(last.map_or_else(
            || {
                Error::Redis(redis::RedisError::from((
                    redis::ErrorKind::Io,
                    "no connection",
                )))
            },
            Error::Redis,
        ))
    }

    /// The I/O timeout of this client's connections ([`DEFAULT_TIMEOUT`]
    /// assumed for a pool given to [`LockClient::new`]).
    pub fn timeout(&self) -> Duration {
        self.inner.backend.timeout()
    }

    /// The prefix of every key and channel this client's locks touch
    /// ([`LockClientBuilder::key_prefix`](crate::LockClientBuilder::key_prefix));
    /// empty when none was set.
    pub fn key_prefix(&self) -> &str {
        self.inner.names.prefix()
    }

    /// The key in Redis of the lock named `name`: the key prefix followed
    /// by `name`. What [`DistributedLock::key`](crate::DistributedLock::key)
    /// returns for a lock made with `name`.
    pub fn key(&self, name: &str) -> String {
        self.inner.names.key(name)
    }

    /// The fencing counter of `key`, a key in Redis as
    /// [`LockClient::key`] gives it, in the key's hash slot: `{KEY}:fence`,
    /// or `{TAG}:fence:KEY` when the key has a `{TAG}` hash tag, with the
    /// key prefix in front when there is one.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), redmutex::Error> {
    /// let client = redmutex::LockClient::open("redis://127.0.0.1:6379/")?;
    /// assert_eq!(client.fence_key("jobs:nightly"), "{jobs:nightly}:fence");
    /// # Ok(())
    /// # }
    /// ```
    pub fn fence_key(&self, key: &str) -> String {
        self.inner.names.fence_key(key)
    }

    /// The pub/sub channel the releases of `key` (a key in Redis, as
    /// [`LockClient::key`] gives it) are published on:
    /// `redmutex:released:{KEY}`, or `redmutex:released:{TAG}:KEY` when the
    /// key has a `{TAG}` hash tag (so the channel maps to the key's cluster
    /// slot), with the key prefix in front when there is one.
    pub fn release_channel(&self, key: &str) -> String {
        self.inner.names.release_channel(key)
    }

    pub(crate) fn names(&self) -> &Namespace {
        &self.inner.names
    }

    pub(crate) fn id(&self) -> u64 {
        self.inner.id
    }

    pub(crate) fn counters(&self) -> &Stats {
        &self.inner.stats
    }

    /// This client's instance of a lock type's per-client state, made on
    /// first use and shared by all clones.
    pub(crate) fn local<T: Any + std::marker::Send + Sync + Default>(&self) -> Arc<T> {
        if self.inherited() {
            // A forked child's handle: a state of its own, shared with
            // nobody (every call through the client refuses there anyway),
            // and the parent's lock, which a parent thread may have held at
            // the fork, is not taken.
            return Arc::new(T::default());
        }
        let mut locals = self.inner.locals.lock();
        for local in locals.iter() {
            if let Ok(found) = local.clone().downcast::<T>() {
                return found;
            }
        }
        let made = Arc::new(T::default());
        locals.push(made.clone());
        made
    }

    /// Keeps `channel` subscribed while the returned feed lives, calling
    /// `waker` on each release message. `None` when this client has no
    /// subscriber connection.
    pub(crate) fn subscribe(&self, channel: &str, waker: Waker) -> Option<Box<dyn Feed>> {
        let subscription = self.inner.subscriber.subscribe(channel, waker)?;
        Some(Box::new(subscription))
    }

    pub(crate) fn watchdog(&self) -> &Watchdog {
        &self.inner.watchdog
    }

    /// The counters, for what outlives this call (a reply owed on a
    /// connection).
    pub(crate) fn counters_handle(&self) -> Arc<Stats> {
        self.inner.stats.clone()
    }

    /// Whether this client's pool can write requests behind at all (its
    /// own pool, not a cluster).
    pub(crate) fn can_write_behind(&self) -> bool {
        self.inner.backend.writes_behind()
    }

    /// A pooled connection, for a request written behind.
    pub(crate) fn pooled(&self) -> Result<Connection, Error> {
        self.check_process()?;
        self.inner.backend.get(self.inner.backend.connect_wait())
    }

    /// Whether a dropped guard may write its release behind (see
    /// the client's `behind_ok`).
    pub(crate) fn behind_ok(&self) -> bool {
        self.inner.behind_ok.load(Ordering::Relaxed)
    }

    /// A release by script worked (`true`) or was refused (`false`).
    pub(crate) fn scripts_work(&self, work: bool) {
        self.inner.behind_ok.store(work, Ordering::Relaxed);
    }

    /// The client's flag for [`LockClient::behind_ok`], for what outlives
    /// this call.
    pub(crate) fn behind_flag(&self) -> Arc<AtomicBool> {
        self.inner.behind_ok.clone()
    }

    /// Refuses what cannot work safely on this deployment, before anything
    /// is sent: the WATCH release on a cluster.
    pub(crate) fn check_release(&self, how: crate::client::options::Release) -> Result<(), Error> {
        if how == crate::client::options::Release::Watch && self.deployment() == Deployment::Cluster
        {
            return Err(Error::InvalidArgument(
                "Release::Watch is not available on Redis Cluster: WATCH lives on one \
                 connection to one node, and a MOVED/ASK redirection between WATCH and EXEC \
                 would run the DEL on a node where nothing is watched; use Release::Lua"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Refuses, on Redis Cluster, a key whose auxiliary keys (fencing
    /// counter, release markers) could not share its hash slot: one with a
    /// `}` and no valid `{tag}`. Without markers a release sent twice (and
    /// redis-rs resends on a cluster by itself) could not tell the truth.
    pub(crate) fn check_key(&self, key: &str) -> Result<(), Error> {
        self.check_process()?;
        check_cluster_key(self.deployment() == Deployment::Cluster, key)
    }

    /// Whether this client was built in another process than this one (a
    /// forked child's copy of its parent's).
    pub(crate) fn inherited(&self) -> bool {
        !self.inner.birth.is_current()
    }

    /// Refuses a client inherited through `fork()`: in the child, the
    /// parent's holds (thread-local tables, queues, guards) would pass for
    /// the child's own, and its pooled connections are the parent's
    /// sockets. Checked before anything is sent and before the holds are
    /// looked at, so an inherited guard's drop changes nothing in Redis.
    pub(crate) fn check_process(&self) -> Result<(), Error> {
        if self.inner.birth.is_current() {
            return Ok(());
        }
        Err(crate::conn::backend::inherited(self.inner.birth))
    }

    /// Runs one operation on a pooled connection, resent or reported
    /// according to the idempotency table in `policy.rs`.
    pub(crate) fn run<T>(
        &self,
        op: Op,
        key: &str,
        send: impl FnMut(&mut Connection, Send) -> redis::RedisResult<T>,
    ) -> Result<T, Error> {
        self.check_process()?;
        policy::run(&self.inner.backend, &self.inner.stats, op, key, send)
    }

    /// [`LockClient::run`] within `budget` in all.
    pub(crate) fn run_within<T>(
        &self,
        op: Op,
        key: &str,
        budget: Duration,
        send: impl FnMut(&mut Connection, Send) -> redis::RedisResult<T>,
    ) -> Result<T, Error> {
        self.check_process()?;
        policy::run_within(
            &self.inner.backend,
            &self.inner.stats,
            op,
            key,
            budget,
            send,
        )
    }

    /// How long past its wait a call may last: one connect and one resend
    /// window (the failure model's per-call bound).
    pub(crate) fn call_slack(&self) -> Duration {
        self.inner
            .backend
            .connect_wait()
            .saturating_add(policy::resend_window(self.timeout()))
    }

    /// Whether releases may leave markers (the server has not refused one).
    pub(crate) fn markers_allowed(&self) -> bool {
        !self.inner.markers_refused.load(Ordering::Relaxed)
    }

    /// Whether the plain `SET … NX … GET` may be sent (the server has not
    /// refused it).
    pub(crate) fn set_get_allowed(&self) -> bool {
        !self.inner.set_get_refused.load(Ordering::Relaxed)
    }

    /// The server refused `SET … NX … GET` (Redis 6.2 takes `NX` or `GET`,
    /// not both; 7.0 takes both): from now on acquisitions run the acquire
    /// script, which does the same in two steps.
    pub(crate) fn refuse_set_get(&self) {
        if !self.inner.set_get_refused.swap(true, Ordering::Relaxed) {
            log::info!(
                "redmutex: the server does not take SET NX GET (Redis before 7.0);                  acquiring by script"
            );
        }
    }

    /// The server refused a marker key (`NOPERM`): from now on releases
    /// go without, and a release sent again after a lost reply says its
    /// outcome is unknown where a marker would have told.
    pub(crate) fn refuse_markers(&self) {
        if !self.inner.markers_refused.swap(true, Ordering::Relaxed) {
            log::warn!(
                "redmutex: the server refuses the release markers ({{KEY}}:released:*; \
                 see the ACL rules in the failure model chapter of the guide, redmutex::guide::failure_model); releasing without them"
            );
        }
    }

    /// Hands a lease nobody owns to the cleanup: an acquisition failed
    /// after its request may have set the key.
    pub(crate) fn orphan(&self, key: &str, kind: OrphanKind) {
        // Long enough for a request held on its way (by a proxy, say) to
        // arrive, and beyond any resend of it.
        let window = policy::marker_ttl(self.timeout());
        log::debug!("redmutex: releasing what a failed acquisition of {key:?} may have left");
        let channel = self.inner.names.release_channel(key);
        let sharded = self.sharded(&channel);
        self.inner
            .watchdog
            .clean_up(Orphan::new(key, channel, kind, window).sharded(sharded));
    }
}

impl std::fmt::Debug for LockClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockClient")
            .field("id", &self.inner.id)
            .field("deployment", &self.deployment())
            .field("key_prefix", &self.key_prefix())
            // Not in a forked child: the pool's lock is the parent's.
            .field(
                "pool",
                &(!self.inherited()).then(|| self.inner.backend.occupancy()),
            )
            .field("defaults", &self.defaults)
            .finish()
    }
}

impl Feed for Subscription {
    fn is_live(&self) -> bool {
        Subscription::is_live(self)
    }

    fn wait_live(&self, until: Instant) -> bool {
        Subscription::wait_live(self, until)
    }
}

/// [`LockClient::check_key`] for a key used on a cluster (`cluster`), or
/// on RedLock nodes one of which is a cluster.
pub(crate) fn check_cluster_key(cluster: bool, key: &str) -> Result<(), Error> {
    if cluster && !crate::script::names::same_slot_fence(key) {
        return Err(Error::InvalidArgument(format!(
            "cannot lock {key:?} on Redis Cluster: a key with '}}' and no valid {{tag}} \
             cannot have its fencing counter and release markers in its hash slot; \
             give it a tag, e.g. \"{{name}}:lock\""
        )));
    }
    Ok(())
}

pub(crate) fn check_timeout(timeout: Duration) -> Result<(), Error> {
    if timeout < Duration::from_millis(1) || timeout > MAX_TIMEOUT {
        return Err(Error::InvalidArgument(format!(
            "the connection timeout must be between 1 ms and {MAX_TIMEOUT:?}, got {timeout:?}"
        )));
    }
    Ok(())
}

/// The URL may carry a password: the message does not repeat it.
pub(crate) fn parse_url(url: &str) -> Result<redis::Client, Error> {
    redis::Client::open(url).map_err(|e| {
        let hint = if cfg!(feature = "tls-rustls") || !url.starts_with("rediss") {
            ""
        } else {
            " (rediss:// needs redmutex's `tls-rustls` cargo feature)"
        };
        Error::InvalidArgument(format!("cannot parse the Redis URL: {e}{hint}"))
    })
}

pub(crate) fn parse_urls<S: AsRef<str>>(
    urls: impl IntoIterator<Item = S>,
) -> Result<Vec<redis::Client>, Error> {
    let clients = urls
        .into_iter()
        .map(|url| parse_url(url.as_ref()))
        .collect::<Result<Vec<_>, _>>()?;
    if clients.is_empty() {
        return Err(Error::InvalidArgument("no server URL given".into()));
    }
    Ok(clients)
}
