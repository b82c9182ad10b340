//! `LockClient`: the shared handle every lock of a program goes through.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::error::Error;
use crate::options::LockOptions;

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
}

struct Inner {
    /// Tells this client's holds apart from other clients' in the
    /// thread-local reentrancy table.
    id: u64,
    pool: r2d2::Pool<redis::Client>,
    defaults: LockOptions,
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
            .build_unchecked(client);
        Ok(LockClient::new(pool))
    }

    /// Wraps a pool you built, with default [`LockOptions`].
    ///
    /// Mind two pool settings: r2d2's default `test_on_check_out(true)`
    /// sends a `PING` per checkout, nearly halving lock throughput; and
    /// redis connections have no read timeout unless you set one (see
    /// r2d2's `connection_customizer`), so a stalled server would hang the
    /// caller.
    pub fn new(pool: r2d2::Pool<redis::Client>) -> LockClient {
        LockClient {
            inner: Arc::new(Inner {
                id: NEXT_CLIENT_ID.fetch_add(1, Ordering::Relaxed),
                pool,
                defaults: LockOptions::default(),
            }),
        }
    }

    /// Sets the options that [`DistributedLock::new`](crate::DistributedLock::new)
    /// gives its locks. Defaults to [`LockOptions::default`].
    pub fn with_defaults(self, options: LockOptions) -> LockClient {
        LockClient {
            inner: Arc::new(Inner {
                id: self.inner.id,
                pool: self.inner.pool.clone(),
                defaults: options,
            }),
        }
    }

    /// The options new locks of this client start from.
    pub fn defaults(&self) -> &LockOptions {
        &self.inner.defaults
    }

    /// The connection pool.
    pub fn pool(&self) -> &r2d2::Pool<redis::Client> {
        &self.inner.pool
    }

    pub(crate) fn id(&self) -> u64 {
        self.inner.id
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
            .field("defaults", &self.inner.defaults)
            .finish()
    }
}
