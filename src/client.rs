//! `LockClient`: the shared handle every lock of a program goes through.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use redis::cluster::ClusterClient;
use redis::sentinel::LockedSentinelClient;

use crate::backend::{Backend, Connection, Deployment, SentinelTarget, Target, tcp_settings};
use crate::error::Error;
use crate::options::LockOptions;
use crate::policy::{self, Op, Send};
use crate::queue::Queues;
use crate::stats::{LockStats, Stats};
use crate::subscriber::{Source, Subscriber};
use crate::watchdog::{Orphan, OrphanKind, Watchdog};

/// Connect, read and write timeout of the pools built by [`LockClient::open`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest connection timeout accepted.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(3600);

/// Connections kept by the pools built by [`LockClient::open`] at most.
pub const DEFAULT_POOL_SIZE: u32 = 16;

/// How often a cluster connection retries a command the cluster could not
/// serve yet (`TRYAGAIN`, `CLUSTERDOWN`); the waits between grow from 10 ms.
const CLUSTER_RETRIES: u32 = 5;

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
}

/// What clones of a client share.
struct Inner {
    /// Tells this client's holds apart from other clients' in the
    /// thread-local reentrancy table.
    id: u64,
    backend: Backend,
    stats: Arc<Stats>,
    queues: Queues,
    /// Dropped after `queues` (field order), which hold its subscriptions.
    subscriber: Subscriber,
    watchdog: Watchdog,
    /// The server of a single-node client of [`LockClient::open`], and the
    /// plain pool [`LockClient::pool`] builds for it when asked.
    single: Option<redis::Client>,
    compat_pool: OnceLock<r2d2::Pool<redis::Client>>,
    /// The server refused a release marker (an ACL without the
    /// `{KEY}:released:*` keys): releases go without one from then on.
    markers_refused: AtomicBool,
}

impl Inner {
    fn new(backend: Backend, notify: Option<Source>, single: Option<redis::Client>) -> Inner {
        let stats = Arc::new(Stats::default());
        let watchdog = Watchdog::new(backend.clone(), stats.clone());
        Inner {
            watchdog,
            id: NEXT_CLIENT_ID.fetch_add(1, Ordering::Relaxed),
            subscriber: Subscriber::new(notify, stats.clone(), backend.timeout()),
            backend,
            queues: Queues::default(),
            stats,
            single,
            compat_pool: OnceLock::new(),
            markers_refused: AtomicBool::new(false),
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
    /// Builds a client with its own connection pool for the server at `url`
    /// (`redis://[user:password@]host:port[/db]`).
    ///
    /// The pool opens connections lazily and keeps at most
    /// [`DEFAULT_POOL_SIZE`]. [`DEFAULT_TIMEOUT`] bounds everything that
    /// touches the network: connecting (the TCP connect and the handshake),
    /// waiting for a pooled connection, and every read and write; so no lock
    /// call can hang on a dead or stalled server, and the pool is usable
    /// again within one timeout after the server heals. A connection whose
    /// reply was lost is closed, never reused (a late reply cannot reach the
    /// next user), and when one connection finds the server gone the pool's
    /// older idle connections are discarded too, without a round trip. No
    /// `PING` is sent per checkout. The server is not contacted here; an
    /// unreachable one makes the first lock operation fail with
    /// [`Error::Pool`] within the timeout.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the URL does not parse.
    pub fn open(url: &str) -> Result<LockClient, Error> {
        LockClient::open_with_timeout(url, DEFAULT_TIMEOUT)
    }

    /// Like [`LockClient::open`], with `timeout` instead of
    /// [`DEFAULT_TIMEOUT`] for getting a connection and for every read and
    /// write.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the URL does not parse or `timeout`
    /// is zero or above [`MAX_TIMEOUT`].
    pub fn open_with_timeout(url: &str, timeout: Duration) -> Result<LockClient, Error> {
        check_timeout(timeout)?;
        let client = parse_url(url)?;
        let info = client
            .get_connection_info()
            .clone()
            .set_tcp_settings(tcp_settings(timeout));
        let backend = Backend::own(Target::Single(info), timeout, DEFAULT_POOL_SIZE);
        Ok(LockClient::build(
            backend,
            Source::servers([&client]),
            Some(client),
        ))
    }

    /// Builds a client for a Redis Cluster, given the addresses of some of
    /// its nodes (`redis://host:port`, any of them; the others are found
    /// through `CLUSTER SLOTS`).
    ///
    /// Everything the crate sends touches one hash slot: a lock key's
    /// fencing counter and release channel carry the key's hash tag (see
    /// [`fence_key`](crate::fence_key)), scripts are routed by their first
    /// key, `MOVED` and `ASK` redirections are followed, and a script the
    /// node lost (`NOSCRIPT` after a failover, a resharding or a
    /// `SCRIPT FLUSH`) is loaded on every primary and run again.
    ///
    /// What differs from a single node:
    ///
    /// * [`Release::Watch`](crate::Release::Watch) is refused with
    ///   [`Error::InvalidArgument`]: a `WATCH` lives on one connection to one
    ///   node, and a redirection between `WATCH` and `EXEC` would run the
    ///   `DEL` on a node where nothing is watched, unchecked.
    /// * Release messages go out with classic `PUBLISH`, which the cluster
    ///   bus carries to every node; the subscriber connection stays on one
    ///   node (the first seed it reaches), so notify waiting works as on one
    ///   server, at the price of that broadcast on each release.
    /// * With [`LockOptions::fencing`](crate::LockOptions::fencing), a key
    ///   that contains `}` without a valid `{tag}` is refused: no counter key
    ///   can share its slot.
    ///
    /// Pool and timeouts as in [`LockClient::open`]; each pooled connection
    /// keeps one connection per node it has talked to. Cluster-level retries
    /// (`TRYAGAIN`, `CLUSTERDOWN` during a failover) are few and short, so a
    /// call fails within a few timeouts instead of riding out a long outage.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when there is no URL, one does not parse,
    /// or `timeout` is zero.
    pub fn open_cluster<S: AsRef<str>>(
        urls: impl IntoIterator<Item = S>,
    ) -> Result<LockClient, Error> {
        LockClient::open_cluster_with_timeout(urls, DEFAULT_TIMEOUT)
    }

    /// Like [`LockClient::open_cluster`], with `timeout` instead of
    /// [`DEFAULT_TIMEOUT`].
    ///
    /// # Errors
    ///
    /// As [`LockClient::open_cluster`].
    pub fn open_cluster_with_timeout<S: AsRef<str>>(
        urls: impl IntoIterator<Item = S>,
        timeout: Duration,
    ) -> Result<LockClient, Error> {
        check_timeout(timeout)?;
        let seeds = parse_urls(urls)?;
        let cluster = ClusterClient::builder(
            seeds
                .iter()
                .map(redis::Client::get_connection_info)
                .cloned(),
        )
        .connection_timeout(timeout)
        .response_timeout(timeout)
        .tcp_settings(tcp_settings(timeout))
        // redis-rs waits at least 1.28 s per retry by default, up to 16
        // times: a lock call must fail sooner than that.
        .retries(CLUSTER_RETRIES)
        .min_retry_wait(10)
        .max_retry_wait(500)
        .build()
        .map_err(|e| Error::InvalidArgument(format!("cannot use the cluster URLs: {e}")))?;
        let backend = Backend::own(Target::Cluster(cluster), timeout, DEFAULT_POOL_SIZE);
        Ok(LockClient::build(backend, Source::servers(&seeds), None))
    }

    /// Builds a client for the primary that Redis Sentinel names
    /// `master_name`, given the addresses of some sentinels
    /// (`redis://host:port`).
    ///
    /// Every new connection asks the sentinels for the current primary and
    /// checks its `ROLE`, so after a failover the client reaches the
    /// promoted replica: connections to the old primary break (Sentinel
    /// disconnects the clients of a demoted primary), the failed call is
    /// retried on a fresh connection, and the subscriber connection asks the
    /// sentinels again too.
    ///
    /// **The failover hazard.** Replication is asynchronous: a lock written
    /// to the old primary just before it died may never reach the replica
    /// that is promoted, and then a second owner gets the same lock. Set
    /// [`LockOptions::min_replicas`](crate::LockOptions::min_replicas) so an
    /// acquisition only counts once a replica has the key, and use
    /// [`fencing`](crate::LockOptions::fencing) tokens where a double owner
    /// would do damage.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when there is no sentinel URL or one does
    /// not parse.
    pub fn open_sentinel<S: AsRef<str>>(
        sentinels: impl IntoIterator<Item = S>,
        master_name: &str,
    ) -> Result<LockClient, Error> {
        LockClient::open_sentinel_with(
            sentinels,
            master_name,
            redis::RedisConnectionInfo::default(),
            DEFAULT_TIMEOUT,
        )
    }

    /// Like [`LockClient::open_sentinel`], with how to log in to the primary
    /// (its username, password, database, protocol) and `timeout` instead of
    /// [`DEFAULT_TIMEOUT`]. The sentinels' own credentials go in their URLs.
    /// For TLS to the primary, build a pool over [`LockedSentinelClient`]
    /// and use [`LockClient::new_sentinel`].
    ///
    /// # Errors
    ///
    /// As [`LockClient::open_sentinel`]; also when `timeout` is zero.
    pub fn open_sentinel_with<S: AsRef<str>>(
        sentinels: impl IntoIterator<Item = S>,
        master_name: &str,
        primary: redis::RedisConnectionInfo,
        timeout: Duration,
    ) -> Result<LockClient, Error> {
        check_timeout(timeout)?;
        let seeds = parse_urls(sentinels)?;
        if master_name.is_empty() {
            return Err(Error::InvalidArgument(
                "the name of the primary must not be empty".into(),
            ));
        }
        let infos: Vec<redis::ConnectionInfo> = seeds
            .iter()
            .map(|client| {
                client
                    .get_connection_info()
                    .clone()
                    .set_tcp_settings(tcp_settings(timeout))
            })
            .collect();
        let target = SentinelTarget::new(infos, master_name.to_owned(), primary.clone());
        let backend = Backend::own(Target::Sentinel(target), timeout, DEFAULT_POOL_SIZE);
        Ok(LockClient::build(
            backend,
            Source::sentinel(&seeds, master_name, &primary),
            None,
        ))
    }

    fn build(
        backend: Backend,
        notify: Option<Source>,
        single: Option<redis::Client>,
    ) -> LockClient {
        LockClient {
            inner: Arc::new(Inner::new(backend, notify, single)),
            defaults: Arc::new(LockOptions::default()),
        }
    }

    /// Wraps a pool you built, with default [`LockOptions`].
    ///
    /// Mind three pool settings: r2d2's default `test_on_check_out(true)`
    /// sends a `PING` per checkout, nearly halving lock throughput; redis
    /// connections have no read timeout unless you set one (see r2d2's
    /// `connection_customizer`), so a stalled server would hang the caller;
    /// and redis-rs opens pooled connections without a connect or
    /// handshake timeout, so a server that accepts and never answers blocks
    /// r2d2's threads. Prefer [`LockClient::open_with_timeout`], whose pool
    /// has none of these problems. The resend window and release markers
    /// (see the crate docs' failure model) assume [`DEFAULT_TIMEOUT`] for a
    /// pool given here.
    ///
    /// A pool does not tell where its server is, so a client made here has
    /// no subscriber connection: waiters in [`WaitMode::Notify`](crate::WaitMode::Notify)
    /// still queue locally and take handoffs, but wait for remote releases
    /// with backoff timing. [`LockClient::with_notify_client`] adds one.
    pub fn new(pool: r2d2::Pool<redis::Client>) -> LockClient {
        LockClient::build(Backend::single(pool, DEFAULT_TIMEOUT), None, None)
    }

    /// Wraps a Redis Cluster pool you built; see [`LockClient::open_cluster`]
    /// for what differs on a cluster, and [`LockClient::new`] for the pool
    /// settings to mind. Without [`LockClient::with_notify_client`] (any one
    /// node will do), remote releases are waited for with backoff timing.
    pub fn new_cluster(pool: r2d2::Pool<ClusterClient>) -> LockClient {
        LockClient::build(Backend::cluster(pool, DEFAULT_TIMEOUT), None, None)
    }

    /// Wraps a pool over [`LockedSentinelClient`] you built; see
    /// [`LockClient::open_sentinel`] for the failover behaviour and hazard,
    /// and [`LockClient::new`] for the pool settings to mind. Remote
    /// releases are waited for with backoff timing (the subscriber
    /// connection of [`LockClient::open_sentinel`] needs the sentinels'
    /// addresses, which the pool does not tell).
    pub fn new_sentinel(pool: r2d2::Pool<LockedSentinelClient>) -> LockClient {
        LockClient::build(Backend::sentinel(pool, DEFAULT_TIMEOUT), None, None)
    }

    /// Gives a client made by [`LockClient::new`] or
    /// [`LockClient::new_cluster`] the server address for its dedicated
    /// subscriber connection (normally the `redis::Client` the pool was
    /// built from; for a cluster, any node). Call it before cloning the
    /// client: clones made earlier keep the old machinery and count as
    /// another client.
    pub fn with_notify_client(self, client: &redis::Client) -> LockClient {
        LockClient {
            inner: Arc::new(Inner::new(
                self.inner.backend.clone(),
                Source::servers([client]),
                self.inner.single.clone(),
            )),
            defaults: self.defaults,
        }
    }

    /// Sets the options that [`DistributedLock::new`](crate::DistributedLock::new)
    /// gives its locks. Defaults to [`LockOptions::default`]. The result is
    /// the same client (shared pool, queues and reentrancy), with other
    /// defaults.
    pub fn with_defaults(self, options: LockOptions) -> LockClient {
        LockClient {
            inner: self.inner,
            defaults: Arc::new(options),
        }
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
    /// # Panics
    ///
    /// On a cluster or sentinel client, which has no such pool: use
    /// [`LockClient::connection`] (any deployment), or match on
    /// [`LockClient::deployment`] first.
    pub fn pool(&self) -> &r2d2::Pool<redis::Client> {
        if let Some(pool) = self.inner.backend.user_pool() {
            return pool;
        }
        match &self.inner.single {
            Some(client) => self.inner.compat_pool.get_or_init(|| {
                let timeout = self.inner.backend.timeout();
                r2d2::Pool::builder()
                    .max_size(DEFAULT_POOL_SIZE)
                    .min_idle(Some(0))
                    .test_on_check_out(false)
                    .connection_timeout(timeout)
                    .connection_customizer(Box::new(IoTimeouts(timeout)))
                    .build_unchecked(client.clone())
            }),
            None => panic!(
                "LockClient::pool() is for single-node clients; this is a {:?} client \
                 (use LockClient::connection())",
                self.deployment()
            ),
        }
    }

    /// A connection from this client's pool, for commands of your own next
    /// to the locks, whatever the deployment.
    ///
    /// # Errors
    ///
    /// [`Error::Pool`] when no connection can be had within the pool's
    /// connection timeout.
    pub fn connection(&self) -> Result<Connection, Error> {
        Ok(self.inner.backend.get(self.inner.backend.connect_wait())?)
    }

    /// The I/O timeout of this client's connections ([`DEFAULT_TIMEOUT`]
    /// assumed for a pool given to [`LockClient::new`]).
    pub fn timeout(&self) -> Duration {
        self.inner.backend.timeout()
    }

    pub(crate) fn id(&self) -> u64 {
        self.inner.id
    }

    pub(crate) fn counters(&self) -> &Stats {
        &self.inner.stats
    }

    pub(crate) fn queues(&self) -> &Queues {
        &self.inner.queues
    }

    pub(crate) fn subscriber(&self) -> &Subscriber {
        &self.inner.subscriber
    }

    pub(crate) fn watchdog(&self) -> &Watchdog {
        &self.inner.watchdog
    }

    /// Refuses what cannot work safely on this deployment, before anything
    /// is sent: the WATCH release on a cluster.
    pub(crate) fn check_release(&self, how: crate::Release) -> Result<(), Error> {
        if how == crate::Release::Watch && self.deployment() == Deployment::Cluster {
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
        check_cluster_key(self.deployment() == Deployment::Cluster, key)
    }

    /// Runs one operation on a pooled connection, resent or reported
    /// according to the idempotency table in `policy.rs`.
    pub(crate) fn run<T>(
        &self,
        op: Op,
        key: &str,
        send: impl FnMut(&mut Connection, Send) -> redis::RedisResult<T>,
    ) -> Result<T, Error> {
        policy::run(&self.inner.backend, &self.inner.stats, op, key, send)
    }

    /// Whether releases may leave markers (the server has not refused one).
    pub(crate) fn markers_allowed(&self) -> bool {
        !self.inner.markers_refused.load(Ordering::Relaxed)
    }

    /// The server refused a marker key (`NOPERM`): from now on releases
    /// go without, and a release sent again after a lost reply says its
    /// outcome is unknown where a marker would have told.
    pub(crate) fn refuse_markers(&self) {
        if !self.inner.markers_refused.swap(true, Ordering::Relaxed) {
            log::warn!(
                "redmutex: the server refuses the release markers ({{KEY}}:released:*; \
                 see the README's ACL rules); releasing without them"
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
        self.inner.watchdog.clean_up(Orphan::new(key, kind, window));
    }
}

impl std::fmt::Debug for LockClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockClient")
            .field("id", &self.inner.id)
            .field("deployment", &self.deployment())
            .field("pool", &self.inner.backend.state())
            .field("defaults", &self.defaults)
            .finish()
    }
}

/// [`LockClient::check_key`] for a key used on a cluster (`cluster`), or
/// on RedLock nodes one of which is a cluster.
pub(crate) fn check_cluster_key(cluster: bool, key: &str) -> Result<(), Error> {
    if cluster && !crate::channel::same_slot_fence(key) {
        return Err(Error::InvalidArgument(format!(
            "cannot lock {key:?} on Redis Cluster: a key with '}}' and no valid {{tag}} \
             cannot have its fencing counter and release markers in its hash slot; \
             give it a tag, e.g. \"{{name}}:lock\""
        )));
    }
    Ok(())
}

fn check_timeout(timeout: Duration) -> Result<(), Error> {
    if timeout < Duration::from_millis(1) || timeout > MAX_TIMEOUT {
        return Err(Error::InvalidArgument(format!(
            "the connection timeout must be between 1 ms and {MAX_TIMEOUT:?}, got {timeout:?}"
        )));
    }
    Ok(())
}

/// The URL may carry a password: the message does not repeat it.
fn parse_url(url: &str) -> Result<redis::Client, Error> {
    redis::Client::open(url)
        .map_err(|e| Error::InvalidArgument(format!("cannot parse the Redis URL: {e}")))
}

fn parse_urls<S: AsRef<str>>(
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
