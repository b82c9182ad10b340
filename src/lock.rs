//! `DistributedLock`: one key, and the ways to acquire it.

use std::rc::Rc;
use std::time::{Duration, Instant};

use crate::backoff::{SystemClock, ThreadJitter, retry_until};
use crate::client::LockClient;
use crate::error::Error;
use crate::guard::{Lease, LockGuard};
use crate::options::{LockOptions, ttl_millis};
use crate::reentrancy;

/// A named lock in Redis: one key. Cheap to make and to clone, `Send` and
/// `Sync`; holds no connection and no state in Redis until acquired.
///
/// Acquiring sends `SET key token NX PX ttl GET` (one round trip, a fresh
/// UUID v4 token per acquisition; the `GET` makes a wrong-typed key an error
/// instead of a lock that is never free, and lets a reply lost on a dropped
/// connection be recognised on retry). Redis 7.0 or newer is required.
///
/// A thread that already holds the key through the same [`LockClient`] gets
/// a nested guard at once, with nothing sent to Redis.
///
/// Locks and clients go freely between threads; guards stay on theirs:
///
/// ```
/// fn assert_send_sync<T: Send + Sync>() {}
/// assert_send_sync::<redmutex::DistributedLock>();
/// assert_send_sync::<redmutex::LockClient>();
/// ```
#[derive(Clone, Debug)]
pub struct DistributedLock {
    client: LockClient,
    key: String,
    options: LockOptions,
}

impl DistributedLock {
    /// A lock on `key` with the client's default options.
    pub fn new(client: &LockClient, key: impl Into<String>) -> DistributedLock {
        DistributedLock::with_options(client, key, client.defaults().clone())
    }

    /// A lock on `key` with the given options.
    pub fn with_options(
        client: &LockClient,
        key: impl Into<String>,
        options: LockOptions,
    ) -> DistributedLock {
        DistributedLock {
            client: client.clone(),
            key: key.into(),
            options,
        }
    }

    /// The lock key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The options this lock acquires with.
    pub fn options(&self) -> &LockOptions {
        &self.options
    }

    /// Acquires the lock, waiting up to the options' `wait` while another
    /// owner holds it (exponential backoff with full jitter, never sleeping
    /// past the deadline, one last attempt at it).
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when the lock stayed held for the whole wait;
    /// [`Error::InvalidArgument`] for an empty key or a ttl under 1 ms
    /// (nothing is sent); [`Error::WrongType`] when the key holds a
    /// non-string value; [`Error::Redis`] or [`Error::Pool`] when Redis
    /// cannot be reached or fails (at once, not after the wait).
    pub fn lock(&self) -> Result<LockGuard, Error> {
        let started = Instant::now();
        let deadline = started.checked_add(self.options.wait);
        match self.acquire(deadline)? {
            Some(guard) => Ok(guard),
            None => Err(Error::Timeout {
                key: self.key.clone(),
                waited: started.elapsed(),
            }),
        }
    }

    /// One attempt: `Ok(None)` when another owner holds the lock.
    ///
    /// # Errors
    ///
    /// As [`DistributedLock::lock`], without [`Error::Timeout`].
    pub fn try_lock(&self) -> Result<Option<LockGuard>, Error> {
        self.acquire(Some(Instant::now()))
    }

    /// Attempts until the lock is had or `wait` has passed: `Ok(None)` when
    /// another owner held it throughout.
    ///
    /// # Errors
    ///
    /// As [`DistributedLock::lock`], without [`Error::Timeout`].
    pub fn try_lock_for(&self, wait: Duration) -> Result<Option<LockGuard>, Error> {
        self.acquire(Instant::now().checked_add(wait))
    }

    /// Attempts until the lock is had or `deadline` has passed (at least
    /// once, even for a deadline already past): `Ok(None)` when another
    /// owner held it throughout.
    ///
    /// # Errors
    ///
    /// As [`DistributedLock::lock`], without [`Error::Timeout`].
    pub fn try_lock_until(&self, deadline: Instant) -> Result<Option<LockGuard>, Error> {
        self.acquire(Some(deadline))
    }

    /// `deadline == None`: a wait so long that `Instant` cannot express its
    /// end, taken as no limit.
    fn acquire(&self, deadline: Option<Instant>) -> Result<Option<LockGuard>, Error> {
        if self.key.is_empty() {
            return Err(Error::InvalidArgument(
                "the lock key must not be empty".into(),
            ));
        }
        let millis = ttl_millis(self.options.ttl)?;
        if let Some(lease) = reentrancy::current(self.client.id(), &self.key) {
            return Ok(Some(LockGuard::new(lease)));
        }
        let token = uuid::Uuid::new_v4().to_string();
        let lease = retry_until(
            &SystemClock,
            &mut ThreadJitter,
            self.options.backoff,
            deadline,
            || self.set_nx(&token, millis),
        )?;
        Ok(lease.map(|lease| {
            reentrancy::enter(self.client.id(), &self.key, &lease);
            LockGuard::new(lease)
        }))
    }

    /// `SET key token NX PX millis GET`: `nil` means we set it; our own
    /// token means an earlier send of this very request set it and its reply
    /// was lost with a dropped connection.
    fn set_nx(&self, token: &str, millis: u64) -> Result<Option<Rc<Lease>>, Error> {
        let key = self.key.as_str();
        let sent = Instant::now();
        let previous: Option<Vec<u8>> = self.client.with_connection(key, |con| {
            redis::cmd("SET")
                .arg(key)
                .arg(token)
                .arg("NX")
                .arg("PX")
                .arg(millis)
                .arg("GET")
                .query(con)
        })?;
        let acquired = match previous {
            None => true,
            Some(holder) => holder == token.as_bytes(),
        };
        Ok(acquired.then(|| {
            Rc::new(Lease::new(
                self.client.clone(),
                self.key.clone(),
                token.to_owned(),
                self.options.release,
                sent,
                Duration::from_millis(millis),
            ))
        }))
    }
}
