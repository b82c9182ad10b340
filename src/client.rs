//! `LockClient`: the shared handle every lock of a program goes through.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::error::Error;
use crate::options::LockOptions;
use crate::queue::Queues;
use crate::stats::{LockStats, Stats};
use crate::subscriber::Subscriber;
use crate::watchdog::Watchdog;

/// Connect, read and write timeout of the pools built by [`LockClient::open`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// Connections kept by the pools built by [`LockClient::open`] at most.
pub const DEFAULT_POOL_SIZE: u32 = 16;

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
    pool: r2d2::Pool<redis::Client>,
    stats: Arc<Stats>,
    queues: Queues,
    /// Dropped after `queues` (field order), which hold its subscriptions.
    subscriber: Subscriber,
    watchdog: Watchdog,
}

impl Inner {
    fn new(pool: r2d2::Pool<redis::Client>, notify: Option<&redis::Client>) -> Inner {
        let stats = Arc::new(Stats::default());
        let watchdog = Watchdog::new(pool.clone(), stats.clone());
        Inner {
            watchdog,
            id: NEXT_CLIENT_ID.fetch_add(1, Ordering::Relaxed),
            pool,
            subscriber: Subscriber::new(notify, stats.clone()),
            queues: Queues::default(),
            stats,
        }
    }
}

/// Gives every pooled connection read and write timeouts, so a stalled
/// server turns into an error instead of a hung caller.
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
    /// The pool does not send a `PING` on every checkout (that would cost a
    /// round trip per lock operation; broken connections are still dropped),
    /// opens connections lazily, keeps at most [`DEFAULT_POOL_SIZE`], and
    /// gives up on a connection after [`DEFAULT_TIMEOUT`]: getting one, and
    /// every read and write on it, so no lock call can hang on a dead or
    /// stalled server. The server is not contacted here; an unreachable one
    /// makes the first lock operation fail with [`Error::Pool`] within the
    /// timeout.
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
    /// is zero.
    pub fn open_with_timeout(url: &str, timeout: Duration) -> Result<LockClient, Error> {
        if timeout.is_zero() {
            return Err(Error::InvalidArgument(
                "the connection timeout must be longer than zero".into(),
            ));
        }
        // The URL may carry a password: the message does not repeat it.
        let client = redis::Client::open(url)
            .map_err(|e| Error::InvalidArgument(format!("cannot parse the Redis URL: {e}")))?;
        let pool = r2d2::Pool::builder()
            .max_size(DEFAULT_POOL_SIZE)
            .min_idle(Some(0))
            .test_on_check_out(false)
            .connection_timeout(timeout)
            .connection_customizer(Box::new(IoTimeouts(timeout)))
            .build_unchecked(client.clone());
        Ok(LockClient {
            inner: Arc::new(Inner::new(pool, Some(&client))),
            defaults: Arc::new(LockOptions::default()),
        })
    }

    /// Wraps a pool you built, with default [`LockOptions`].
    ///
    /// Mind two pool settings: r2d2's default `test_on_check_out(true)`
    /// sends a `PING` per checkout, nearly halving lock throughput; and
    /// redis connections have no read timeout unless you set one (see
    /// r2d2's `connection_customizer`), so a stalled server would hang the
    /// caller.
    ///
    /// A pool does not tell where its server is, so a client made here has
    /// no subscriber connection: waiters in [`WaitMode::Notify`](crate::WaitMode::Notify)
    /// still queue locally and take handoffs, but wait for remote releases
    /// with backoff timing. [`LockClient::with_notify_client`] adds one.
    pub fn new(pool: r2d2::Pool<redis::Client>) -> LockClient {
        LockClient {
            inner: Arc::new(Inner::new(pool, None)),
            defaults: Arc::new(LockOptions::default()),
        }
    }

    /// Gives a client made by [`LockClient::new`] the server address for its
    /// dedicated subscriber connection (normally the `redis::Client` the
    /// pool was built from). Call it before cloning the client: clones made
    /// earlier keep the old machinery and count as another client.
    pub fn with_notify_client(self, client: &redis::Client) -> LockClient {
        let pool = self.inner.pool.clone();
        LockClient {
            inner: Arc::new(Inner::new(pool, Some(client))),
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

    /// The connection pool.
    pub fn pool(&self) -> &r2d2::Pool<redis::Client> {
        &self.inner.pool
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

    /// Runs `op` on a pooled connection.
    ///
    /// A pooled connection can be stale (the server restarted, an idle
    /// connection was closed): when `op` fails because the connection
    /// dropped, it runs again on another connection, at most once per pool
    /// slot. Every operation passed here is safe to repeat. Other errors are
    /// returned as they are, WRONGTYPE named with `key`.
    pub(crate) fn with_connection<T>(
        &self,
        key: &str,
        mut op: impl FnMut(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Result<T, Error> {
        let retries = self.inner.pool.max_size();
        let mut attempt = 0;
        loop {
            let mut con = self.inner.pool.get()?;
            match op(&mut con) {
                Ok(value) => return Ok(value),
                Err(err) if err.is_connection_dropped() && attempt < retries => {
                    log::debug!("redmutex: retrying {key:?} on a fresh connection after: {err}");
                    attempt += 1;
                }
                Err(err) => return Err(Error::from_redis(key, err)),
            }
        }
    }
}

impl std::fmt::Debug for LockClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockClient")
            .field("id", &self.inner.id)
            .field("pool", &self.inner.pool.state())
            .field("defaults", &self.defaults)
            .finish()
    }
}
