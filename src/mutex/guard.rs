//! `LockGuard`: the public face of a plain lock's lease.

use std::fmt;
use std::rc::Rc;
use std::time::Duration;

use crate::client::holder::Redacted;
use crate::client::options::Release;
use crate::error::Error;
use crate::lease::Lease as _;
use crate::lease::Unlocked;
use crate::lease::loss::LossSignal;
use crate::mutex::lease::Lease;

/// Proof that this thread holds a lock. Dropping it releases the lock
/// (best effort, errors logged); [`LockGuard::unlock`] releases and reports.
///
/// A drop writes the release behind where it can (the crate docs' failure
/// model says where): the owner-checked release is sent and the drop
/// returns without waiting for its reply, which the next request on that
/// connection reads with its own, in the same round trip. Call
/// [`LockGuard::unlock`] to know the outcome.
///
/// The guard owns what release needs (no lifetime ties it to the
/// [`DistributedLock`](crate::DistributedLock)). Guards of a reentrant hold
/// share one lease in Redis, released when the last of them goes, whatever
/// the order they are dropped in.
///
/// A guard is `!Send`: the reentrancy count lives in the acquiring thread.
///
/// ```compile_fail
/// fn assert_send<T: Send>() {}
/// assert_send::<redmutex::LockGuard>();
/// ```
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard {
    lease: Rc<Lease>,
    hold_count: u32,
}

impl LockGuard {
    pub(crate) fn new(lease: Rc<Lease>) -> LockGuard {
        let hold_count = u32::try_from(Rc::strong_count(&lease)).unwrap_or(u32::MAX);
        LockGuard { lease, hold_count }
    }

    /// The token this acquisition wrote into the key: a random secret and,
    /// unless turned off, the holder metadata ([`Holder::from_token`](crate::Holder::from_token));
    /// shared by the guards of a reentrant hold.
    pub fn token(&self) -> &str {
        &self.lease.token
    }

    /// This guard's depth in its thread's hold of the key: 1 for the
    /// guard that acquired in Redis, 2 for the first nested guard, and so
    /// on (as [`ReentrantGuard::depth`](crate::ReentrantGuard::depth)).
    pub fn depth(&self) -> u32 {
        self.hold_count
    }

    /// Like [`LockGuard::unlock`], with the given release method.
    ///
    /// # Errors
    ///
    /// As [`LockGuard::unlock`]; also [`Error::InvalidArgument`] for
    /// [`Release::Watch`] on a Redis Cluster client, refused before anything
    /// is sent (the guard is then dropped, which releases with the lock's
    /// own method, [`Release::Lua`] on a cluster).
    pub fn unlock_with(self, release: Release) -> Result<Unlocked, Error> {
        // A forked child's copy of its parent's guard, nested or not:
        // refused (its drop then leaves the parent's lease alone).
        self.lease.client.check_process()?;
        if Rc::strong_count(&self.lease) > 1 {
            // Only this guard's share is given up; but a hold found lost
            // is not "still held": its loss is the answer.
            if let Some(reason) = self.lease.loss_reason() {
                return Err(Error::not_held(&self.lease.key, reason));
            }
            return Ok(Unlocked::StillHeld);
        }
        // Refused before anything changes; the guard's drop then releases
        // with the lock's own method.
        self.lease.client.check_release(release)?;
        self.lease.release_now(release).map(|()| Unlocked::Released)
    }
}

impl LockGuard {
    /// Turns this guard into a [`MovableGuard`]: the same lease (same
    /// token, expiry, watchdog, fencing token and loss signal), leaving this
    /// thread's holds, so it can be sent to another thread and released
    /// there. Nothing is sent to Redis.
    ///
    /// From then on the hold is no longer this thread's: a `lock()` of the
    /// same key on this thread waits for it like any other owner's (a
    /// movable hold is not reentrant, by construction).
    ///
    /// ```no_run
    /// use redmutex::{DistributedLock, Lease};
    ///
    /// # fn main() -> Result<(), redmutex::Error> {
    /// let client = redmutex::LockClient::open("redis://127.0.0.1:6379/")?;
    /// // The dispatcher takes the lock; a worker does the job and releases.
    /// let guard = DistributedLock::new(&client, "jobs:export").lock()?;
    /// let Ok(guard) = guard.into_movable() else {
    ///     unreachable!("not nested: this thread holds it once")
    /// };
    /// let worker = std::thread::spawn(move || {
    ///     // ... the job ...
    ///     guard.unlock()
    /// });
    /// # let _ = worker.join();
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// Gives the guard back when other guards of the same hold are alive
    /// on this thread (a nested hold cannot leave its thread), or when it
    /// was inherited through `fork()`.
    pub fn into_movable(self) -> Result<MovableGuard, LockGuard> {
        if Rc::strong_count(&self.lease) != 1 || self.lease.client.inherited() {
            return Err(self);
        }
        let LockGuard { lease, hold_count } = self;
        let (client_id, key, at) = (lease.client.id(), lease.key.clone(), Rc::as_ptr(&lease));
        match Rc::try_unwrap(lease) {
            Ok(lease) => {
                // Out of this thread's table: a later lock() here is a new
                // owner's, never a nested guard of a lease on another
                // thread.
                crate::mutex::holds::leave(client_id, &key, at);
                Ok(MovableGuard { lease })
            }
            Err(lease) => Err(LockGuard { lease, hold_count }),
        }
    }
}

/// A plain lock's lease that may go to another thread: made by
/// [`LockGuard::into_movable`]. The same lease contract as a
/// [`LockGuard`] ([`Lease`](crate::Lease)): dropping it releases the lock
/// (written behind where it can), [`MovableGuard::unlock`](crate::Lease::unlock)
/// releases and reports.
///
/// `Send` (a lease that left its thread's reentrancy table), not `Sync`:
///
/// ```
/// fn assert_send<T: Send>() {}
/// assert_send::<redmutex::MovableGuard>();
/// ```
///
/// ```compile_fail
/// fn assert_sync<T: Sync>() {}
/// assert_sync::<redmutex::MovableGuard>();
/// ```
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct MovableGuard {
    lease: Lease,
}

impl MovableGuard {
    /// The token the acquisition wrote into the key (as
    /// [`LockGuard::token`]).
    pub fn token(&self) -> &str {
        &self.lease.token
    }

    /// Like [`MovableGuard::unlock`](crate::Lease::unlock), with the given
    /// release method.
    ///
    /// # Errors
    ///
    /// As [`LockGuard::unlock_with`].
    pub fn unlock_with(self, release: Release) -> Result<Unlocked, Error> {
        self.lease.client.check_process()?;
        self.lease.client.check_release(release)?;
        self.lease.release_now(release).map(|()| Unlocked::Released)
    }
}

impl crate::lease::sealed::Sealed for MovableGuard {}

impl crate::lease::Lease for MovableGuard {
    /// The lock key.
    fn key(&self) -> &str {
        &self.lease.key
    }

    /// As [`LockGuard`]'s.
    fn validity(&self) -> Duration {
        self.lease.validity()
    }

    /// As [`LockGuard`]'s.
    fn is_lost(&self) -> bool {
        self.lease.is_lost()
    }

    /// As [`LockGuard`]'s.
    fn loss_signal(&self) -> LossSignal {
        LossSignal {
            state: self.lease.loss_state().clone(),
        }
    }

    fn fencing_token(&self) -> Option<u64> {
        self.lease.fence
    }

    /// Asks Redis whether the key still holds this guard's token.
    ///
    /// # Errors
    ///
    /// As [`LockGuard`]'s.
    fn is_held(&self) -> Result<bool, Error> {
        self.lease.held_in_redis()
    }

    /// As [`LockGuard`]'s: owner-checked, never re-creating the key.
    ///
    /// # Errors
    ///
    /// As [`LockGuard`]'s.
    fn extend(&mut self, ttl: Duration) -> Result<(), Error> {
        self.lease.extend(ttl)
    }

    /// Releases the lock with the lock's configured [`Release`] (or hands
    /// it to a waiting thread of the client, as a [`LockGuard`] does).
    ///
    /// # Errors
    ///
    /// As [`LockGuard`]'s.
    fn unlock(self) -> Result<Unlocked, Error> {
        let how = self.lease.release;
        self.unlock_with(how)
    }
}

impl fmt::Debug for MovableGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MovableGuard")
            .field("key", &self.key())
            // The token is a capability: only its public part is shown.
            .field("token", &Redacted(self.token()))
            .field("validity", &self.validity())
            .finish()
    }
}

impl crate::lease::sealed::Sealed for LockGuard {}

impl crate::lease::Lease for LockGuard {
    /// The lock key.
    fn key(&self) -> &str {
        &self.lease.key
    }

    /// The lease left by the local monotonic clock, minus a drift allowance
    /// (1 % of the ttl + 2 ms). Measured from when the acquiring (or last
    /// extending) request was sent, so it is never more than Redis allows.
    /// Zero once the lease has run out. This is an estimate without a round
    /// trip; [`LockGuard::is_held`] asks Redis.
    fn validity(&self) -> Duration {
        self.lease.validity()
    }

    /// Whether the lease was found lost: by the watchdog (key gone or taken,
    /// Redis unreachable until the lease ran out, hold cap reached) or by an
    /// [`LockGuard::extend`] that found it not held.
    fn is_lost(&self) -> bool {
        self.lease.is_lost()
    }

    /// A signal, usable from any thread and after the guard is gone, that
    /// fires when the lease is found lost.
    fn loss_signal(&self) -> LossSignal {
        LossSignal {
            state: self.lease.loss_state().clone(),
        }
    }

    fn fencing_token(&self) -> Option<u64> {
        self.lease.fence
    }

    /// Asks Redis whether the key still holds this guard's token.
    ///
    /// # Errors
    ///
    /// [`Error::Redis`] or [`Error::Pool`] when Redis cannot be asked;
    /// [`Error::WrongType`] when the key now holds a non-string value.
    fn is_held(&self) -> Result<bool, Error> {
        self.lease.held_in_redis()
    }

    /// Sets the lease to expire `ttl` from now, if the key still holds our
    /// token (`lua/extend.lua`: an owner-checked `PEXPIRE`). An expired lock
    /// is never re-created. Applies to the whole reentrant hold.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a ttl under 1 ms or over ten years
    /// (nothing is sent); [`Error::NotHeld`] with
    /// [`LossReason::Expired`](crate::LossReason::Expired) when the key is gone or
    /// [`LossReason::OwnedByOther`](crate::LossReason::OwnedByOther) when another owner holds it (nothing
    /// changes in Redis); [`Error::Redis`], [`Error::Pool`] or
    /// [`Error::WrongType`] when Redis fails.
    fn extend(&mut self, ttl: Duration) -> Result<(), Error> {
        self.lease.extend(ttl)
    }

    /// Releases the lock with the lock's configured [`Release`] and reports
    /// the outcome. A nested guard (other guards of the same hold still
    /// alive on this thread) only gives up its share:
    /// `Ok(`[`Unlocked::StillHeld`]`)`, nothing sent (or, once the hold
    /// was found lost, [`Error::NotHeld`] with the loss's reason); the last guard
    /// releases in Redis (or hands the lease to a waiting thread of the
    /// client): `Ok(`[`Unlocked::Released`]`)`.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] when the lease had already run out
    /// ([`LossReason::Expired`](crate::LossReason::Expired)) or another owner holds the key
    /// ([`LossReason::OwnedByOther`](crate::LossReason::OwnedByOther)); nothing is deleted then.
    /// After Redis said the lease is gone or another's
    /// ([`LossReason::Expired`](crate::LossReason::Expired), [`LossReason::OwnedByOther`](crate::LossReason::OwnedByOther)) nothing is
    /// sent and that is reported; after a loss by the local clock
    /// ([`LossReason::Unreachable`](crate::LossReason::Unreachable), [`LossReason::MaxHold`](crate::LossReason::MaxHold)) the
    /// owner-checked release is still sent (Redis may still hold the key)
    /// and its answer reported.
    /// [`Error::OutcomeUnknown`], [`Error::Redis`] or [`Error::Pool`] when
    /// Redis fails; the key is then released in the background once Redis
    /// answers (or expires after its ttl).
    /// [`Error::InvalidArgument`] for a guard inherited through `fork()`,
    /// nested or not (nothing is sent: the lease is the parent's). When
    /// the lease is about to go to a thread of the client waiting for it
    /// and Redis last confirmed it more than the handoff budget's
    /// [`max_age`](crate::HandoffBudget::max_age) ago, it is confirmed
    /// first: found gone, it is not passed on and this says
    /// [`Error::NotHeld`].
    fn unlock(self) -> Result<Unlocked, Error> {
        let how = self.lease.release;
        self.unlock_with(how)
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.key())
            // The token is a capability: only its public part is shown.
            .field("token", &Redacted(self.token()))
            .field("hold_count", &self.hold_count)
            .field("validity", &self.validity())
            .finish()
    }
}
