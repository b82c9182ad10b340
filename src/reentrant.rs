//! `ReentrantLock`: the hold count kept in Redis, in a hash whose field is
//! the owner (seed 001, as Redisson does it).

use std::marker::PhantomData;
use std::rc::Rc;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use crate::backoff::{SystemClock, ThreadJitter, retry_until};
use crate::client::LockClient;
use crate::error::{Error, NotHeldReason};
use crate::guard::remaining;
use crate::options::{LockOptions, ttl_millis};
use crate::scripts;

/// This process's part of every owner id: one UUID per process, so any
/// `LockClient` of a thread re-enters what the thread holds.
static PROCESS_ID: LazyLock<String> = LazyLock::new(|| uuid::Uuid::new_v4().to_string());

/// The owner id of the calling thread: `<process uuid>:<thread id>`.
fn current_owner() -> String {
    let thread = format!("{:?}", std::thread::current().id());
    let thread = thread.trim_start_matches("ThreadId(").trim_end_matches(')');
    format!("{}:{thread}", *PROCESS_ID)
}

/// A reentrant lock whose hold count lives in Redis: the key is a hash with
/// one field, the owner (`<process uuid>:<thread id>`), whose value is the
/// number of holds. Acquiring increments it and refreshes the lease;
/// releasing decrements it and deletes the key at zero.
///
/// Pick it over [`DistributedLock`](crate::DistributedLock)'s thread-local
/// reentrancy when the count must be visible in Redis (`HGETALL key` shows
/// who holds it and how deeply), or when a thread re-enters through another
/// [`LockClient`] (the owner id is per process and thread, not per client).
/// The price: every nested acquire and release is a round trip, where the
/// thread-local counter sends nothing. Waiting is by backoff polling
/// ([`WaitMode::Notify`](crate::WaitMode::Notify) and handoff do not apply).
///
/// ```no_run
/// # fn main() -> Result<(), redmutex::Error> {
/// let client = redmutex::LockClient::open("redis://127.0.0.1:6379/")?;
/// let lock = redmutex::ReentrantLock::new(&client, "accounts:42");
/// let outer = lock.lock()?;          // HINCRBY owner 1 -> 1
/// let inner = lock.lock()?;          // HINCRBY owner 1 -> 2, lease refreshed
/// assert_eq!(inner.hold_count(), 2);
/// assert_eq!(inner.unlock()?, redmutex::Unlocked::StillHeld);
/// assert_eq!(outer.unlock()?, redmutex::Unlocked::Released);
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct ReentrantLock {
    client: LockClient,
    key: String,
    options: LockOptions,
}

/// What a [`ReentrantGuard::unlock`] did in Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unlocked {
    /// The count dropped but other holds of this owner remain.
    StillHeld,
    /// The count reached zero and the key was deleted.
    Released,
}

impl ReentrantLock {
    /// A reentrant lock on `key` with the client's default options.
    pub fn new(client: &LockClient, key: impl Into<String>) -> ReentrantLock {
        ReentrantLock::with_options(client, key, client.defaults().clone())
    }

    /// A reentrant lock on `key`. Of the options, `ttl`, `wait` and
    /// `backoff` apply.
    pub fn with_options(
        client: &LockClient,
        key: impl Into<String>,
        options: LockOptions,
    ) -> ReentrantLock {
        ReentrantLock {
            client: client.clone(),
            key: key.into(),
            options,
        }
    }

    /// The lock key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Acquires, waiting up to the options' `wait`.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] after the wait; [`Error::InvalidArgument`] for an
    /// empty key or a bad ttl; [`Error::WrongType`] when the key is not a
    /// hash (a plain lock's key, say); [`Error::Redis`] or [`Error::Pool`].
    pub fn lock(&self) -> Result<ReentrantGuard, Error> {
        let started = Instant::now();
        self.acquire(started.checked_add(self.options.wait))?
            .ok_or_else(|| Error::Timeout {
                key: self.key.clone(),
                waited: started.elapsed(),
            })
    }

    /// One attempt: `Ok(None)` when another owner holds it.
    ///
    /// # Errors
    ///
    /// As [`ReentrantLock::lock`], without [`Error::Timeout`].
    pub fn try_lock(&self) -> Result<Option<ReentrantGuard>, Error> {
        self.acquire(Some(Instant::now()))
    }

    /// Attempts until acquired or `wait` has passed.
    ///
    /// # Errors
    ///
    /// As [`ReentrantLock::lock`], without [`Error::Timeout`].
    pub fn try_lock_for(&self, wait: Duration) -> Result<Option<ReentrantGuard>, Error> {
        self.acquire(Instant::now().checked_add(wait))
    }

    /// Attempts until acquired or `deadline` has passed.
    ///
    /// # Errors
    ///
    /// As [`ReentrantLock::lock`], without [`Error::Timeout`].
    pub fn try_lock_until(&self, deadline: Instant) -> Result<Option<ReentrantGuard>, Error> {
        self.acquire(Some(deadline))
    }

    fn acquire(&self, deadline: Option<Instant>) -> Result<Option<ReentrantGuard>, Error> {
        if self.key.is_empty() {
            return Err(Error::InvalidArgument(
                "the lock key must not be empty".into(),
            ));
        }
        let millis = ttl_millis(self.options.ttl)?;
        let owner = current_owner();
        let key = self.key.as_str();
        retry_until(
            &SystemClock,
            &mut ThreadJitter,
            self.options.backoff,
            deadline,
            || {
                let sent = Instant::now();
                self.client.counters().commands(1);
                let (count, _pttl): (u32, i64) = self.client.with_connection(key, |con| {
                    scripts::REENTRANT_ACQUIRE
                        .key(key)
                        .arg(&owner)
                        .arg(millis)
                        .invoke(con)
                })?;
                Ok((count > 0).then(|| ReentrantGuard {
                    client: self.client.clone(),
                    key: self.key.clone(),
                    owner: owner.clone(),
                    hold_count: count,
                    sent,
                    ttl: Duration::from_millis(millis),
                    released: false,
                    _thread_bound: PhantomData,
                }))
            },
        )
    }
}

/// One hold of a [`ReentrantLock`]. Dropping it releases that hold (best
/// effort); [`ReentrantGuard::unlock`] reports what happened. `!Send`: the
/// owner id names the acquiring thread.
///
/// ```compile_fail
/// fn assert_send<T: Send>() {}
/// assert_send::<redmutex::ReentrantGuard>();
/// ```
#[must_use = "the hold is released as soon as the guard is dropped"]
#[derive(Debug)]
pub struct ReentrantGuard {
    client: LockClient,
    key: String,
    owner: String,
    hold_count: u32,
    sent: Instant,
    ttl: Duration,
    released: bool,
    _thread_bound: PhantomData<Rc<()>>,
}

impl ReentrantGuard {
    /// The lock key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The owner id, the hash field: `<process uuid>:<thread id>`.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The owner's hold count in Redis right after this acquisition.
    pub fn hold_count(&self) -> u32 {
        self.hold_count
    }

    /// The lease left by the local clock since this guard's acquisition or
    /// extension, minus the drift allowance. Later re-entries refresh the
    /// lease in Redis, so this is a lower bound.
    pub fn validity(&self) -> Duration {
        if self.released {
            return Duration::ZERO;
        }
        remaining(self.sent, self.ttl, Instant::now())
    }

    /// Asks Redis whether this owner still holds the lock.
    ///
    /// # Errors
    ///
    /// [`Error::Redis`], [`Error::Pool`] or [`Error::WrongType`].
    pub fn is_held(&self) -> Result<bool, Error> {
        let key = self.key.as_str();
        self.client.counters().commands(1);
        self.client.with_connection(key, |con| {
            redis::cmd("HEXISTS").arg(key).arg(&self.owner).query(con)
        })
    }

    /// Sets the lease to `ttl` from now if this owner still holds the lock.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a bad ttl; [`Error::NotHeld`] when the
    /// key is gone or another owner holds it; [`Error::Redis`],
    /// [`Error::Pool`] or [`Error::WrongType`].
    pub fn extend(&mut self, ttl: Duration) -> Result<(), Error> {
        let millis = ttl_millis(ttl)?;
        let key = self.key.as_str();
        let sent = Instant::now();
        self.client.counters().commands(1);
        let reply: i64 = self.client.with_connection(key, |con| {
            scripts::REENTRANT_EXTEND
                .key(key)
                .arg(&self.owner)
                .arg(millis)
                .invoke(con)
        })?;
        scripts::owner_checked(reply).map_err(|reason| Error::not_held(key, reason))?;
        self.sent = sent;
        self.ttl = Duration::from_millis(millis);
        Ok(())
    }

    /// Releases this hold: decrements the owner's count, deleting the key at
    /// zero.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] with [`NotHeldReason::OwnedByOther`] when the hash
    /// belongs to another owner (the articles' `nil`), or
    /// [`NotHeldReason::Expired`] when the key is gone; [`Error::Redis`],
    /// [`Error::Pool`] or [`Error::WrongType`].
    pub fn unlock(mut self) -> Result<Unlocked, Error> {
        self.release()
    }

    fn release(&mut self) -> Result<Unlocked, Error> {
        self.released = true;
        let key = self.key.as_str();
        self.client.counters().commands(1);
        let reply: Option<i64> = self.client.with_connection(key, |con| {
            scripts::REENTRANT_RELEASE
                .key(key)
                .arg(&self.owner)
                .invoke(con)
        })?;
        match reply {
            Some(1) => Ok(Unlocked::Released),
            Some(0) => Ok(Unlocked::StillHeld),
            Some(_) => Err(Error::not_held(key, NotHeldReason::Expired)),
            None => Err(Error::not_held(key, NotHeldReason::OwnedByOther)),
        }
    }
}

impl Drop for ReentrantGuard {
    fn drop(&mut self) {
        if !self.released
            && let Err(err) = self.release()
        {
            log::warn!(
                "redmutex: releasing reentrant hold of {:?} on drop: {err}",
                self.key
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_ids_name_process_and_thread() {
        let here = current_owner();
        let (process, thread) = here.rsplit_once(':').expect("process:thread");
        assert_eq!(process, PROCESS_ID.as_str());
        assert!(thread.parse::<u64>().is_ok(), "{thread}");
        let there = std::thread::spawn(current_owner).join().expect("thread");
        assert_ne!(here, there);
        assert!(there.starts_with(process));
    }
}
