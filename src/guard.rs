//! `LockGuard` and the lease its guards share.

use std::cell::Cell;
use std::fmt;
use std::rc::Rc;
use std::time::{Duration, Instant};

use crate::client::LockClient;
use crate::error::Error;
use crate::loss::{LossReason, LossSignal, LossState};
use crate::options::{HandoffBudget, LockOptions, Release, WaitMode, ttl_millis};
use crate::policy::Op;
use crate::queue::Handoff;
use crate::watchdog::{OrphanKind, WatchEntry};
use crate::{reentrancy, release, scripts};
use std::sync::Arc;

/// The safety margin taken off the local estimate of a lease: clocks drift,
/// and Redis expires keys on its own clock. 1 % of the ttl plus 2 ms, the
/// allowance the Redlock description uses.
pub(crate) fn drift(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

/// What is left of a lease that Redis was asked to expire `ttl` after
/// `sent` (the moment the request left, so Redis's own deadline is never
/// earlier), seen at `now`, minus the drift allowance.
pub(crate) fn remaining(sent: Instant, ttl: Duration, now: Instant) -> Duration {
    (sent + ttl)
        .saturating_duration_since(now)
        .saturating_sub(drift(ttl))
}

/// When a releasing holder may pass its lease to a queued thread instead of
/// releasing it in Redis.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HandoffPolicy {
    /// Queued waiters of this client watch this lease ([`WaitMode::Notify`]).
    pub(crate) queued: bool,
    pub(crate) enabled: bool,
    pub(crate) budget: HandoffBudget,
}

impl HandoffPolicy {
    pub(crate) fn of(options: &LockOptions) -> HandoffPolicy {
        HandoffPolicy {
            queued: options.wait_mode == WaitMode::Notify,
            enabled: options.wait_mode == WaitMode::Notify
                && options.local_handoff
                && !options.fencing
                && options.handoff_budget.max_handoffs > 0,
            budget: options.handoff_budget,
        }
    }
}

/// One acquisition in Redis: a key holding our token until it expires. The
/// guards of a reentrant hold share it through an `Rc`; when the last one
/// goes, it is released (or handed to a queued thread of the same client).
pub(crate) struct Lease {
    client: LockClient,
    key: String,
    token: String,
    release: Release,
    handoff: HandoffPolicy,
    /// Handoffs this token has been through so far.
    handoffs: u32,
    /// When this token was acquired in Redis.
    acquired_at: Instant,
    /// When the request that set the current expiry was sent.
    sent: Cell<Instant>,
    /// The ttl that request asked for.
    ttl: Cell<Duration>,
    released: Cell<bool>,
    /// The fencing token of this acquisition, when fencing is on.
    fence: Option<u64>,
    /// The watchdog's entry, when it renews this lease (it then owns the
    /// lease's timing).
    watch: Option<Arc<WatchEntry>>,
    loss: Arc<LossState>,
}

impl Lease {
    /// A lease just acquired in Redis by a request sent at `sent`.
    pub(crate) fn acquired(
        client: LockClient,
        key: String,
        token: String,
        options: &LockOptions,
        sent: Instant,
        ttl: Duration,
        fence: Option<u64>,
    ) -> Lease {
        client.counters().acquired();
        let handoff = HandoffPolicy::of(options);
        if handoff.queued {
            client.queues().hold(&key, &token, sent + ttl);
        }
        let watch = options.watchdog.then(|| {
            let cap = options.max_hold.and_then(|cap| sent.checked_add(cap));
            client.watchdog().watch(&key, &token, sent, ttl, cap)
        });
        let loss = watch
            .as_ref()
            .map_or_else(Arc::default, |entry| entry.loss.clone());
        Lease {
            client,
            key,
            token,
            release: options.release,
            handoff,
            handoffs: 0,
            acquired_at: sent,
            sent: Cell::new(sent),
            ttl: Cell::new(ttl),
            released: Cell::new(false),
            fence,
            watch,
            loss,
        }
    }

    /// A lease handed over by another thread of the same client.
    pub(crate) fn handed_over(
        client: LockClient,
        key: String,
        options: &LockOptions,
        handoff: Handoff,
    ) -> Lease {
        Lease {
            client,
            key,
            token: handoff.token,
            release: options.release,
            handoff: HandoffPolicy::of(options),
            handoffs: handoff.handoffs,
            acquired_at: handoff.acquired_at,
            sent: Cell::new(handoff.sent),
            ttl: Cell::new(handoff.ttl),
            released: Cell::new(false),
            fence: None,
            watch: handoff.watch,
            loss: handoff.loss,
        }
    }

    /// Applies a receiver's options to a lease handed over to it: its
    /// watchdog setting (renewals start or stop; a cap counts from now) and
    /// its release method. The giver's options no longer apply.
    pub(crate) fn adopt(&mut self, options: &LockOptions) {
        let now = Instant::now();
        let cap = options.max_hold.and_then(|cap| now.checked_add(cap));
        match (&self.watch, options.watchdog) {
            (None, true) => {
                let entry = self.client.watchdog().watch(
                    &self.key,
                    &self.token,
                    self.sent.get(),
                    self.ttl.get(),
                    cap,
                );
                self.loss = entry.loss.clone();
                self.watch = Some(entry);
            }
            (Some(entry), false) => {
                let (sent, ttl) = entry.lease();
                self.client.watchdog().unwatch(entry);
                self.sent.set(sent);
                self.ttl.set(ttl);
                // Unwatched from here on: no local expiry in the signal,
                // but a loss already found stays found.
                let loss = Arc::new(LossState::default());
                if let Some(reason) = entry.loss.reason() {
                    loss.lose(reason);
                }
                self.loss = loss;
                self.watch = None;
            }
            (Some(entry), true) => entry.set_cap(cap),
            (None, false) => {}
        }
        self.release = options.release;
    }

    /// The request time and ttl that set the current expiry.
    fn timing(&self) -> (Instant, Duration) {
        match &self.watch {
            Some(entry) => entry.lease(),
            None => (self.sent.get(), self.ttl.get()),
        }
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.loss.reason().is_some()
    }

    pub(crate) fn is_released(&self) -> bool {
        self.released.get()
    }

    /// Marks the lease done without touching Redis (it was lost).
    pub(crate) fn abandon(&self) {
        if !self.released.replace(true) {
            reentrancy::leave(self.client.id(), &self.key, self);
            if let Some(entry) = &self.watch {
                self.client.watchdog().unwatch(entry);
            }
            if self.handoff.queued {
                self.client.queues().unhold(&self.key, &self.token);
                self.client.queues().released(&self.key, None);
            }
        }
    }

    pub(crate) fn validity(&self) -> Duration {
        if self.released.get() || self.is_lost() {
            return Duration::ZERO;
        }
        let (sent, ttl) = self.timing();
        remaining(sent, ttl, Instant::now())
    }

    /// Owner-checked PEXPIRE to `ttl` from now.
    pub(crate) fn extend(&self, ttl: Duration) -> Result<(), Error> {
        let millis = ttl_millis(ttl)?;
        let ttl = Duration::from_millis(millis);
        let (key, token) = (self.key.as_str(), self.token.as_str());
        let generation = self.watch.as_ref().map(|entry| entry.generation());
        let sent = Instant::now();
        self.client.counters().commands(1);
        let reply: i64 = self.client.run(Op::Extend, key, |con, _| {
            scripts::EXTEND.key(key).arg(token).arg(millis).invoke(con)
        })?;
        match scripts::owner_checked(reply) {
            Ok(()) => {
                // The watchdog's entry owns the timing of a watched lease.
                match &self.watch {
                    Some(entry) => entry.renewed(sent, ttl, generation.unwrap_or_default()),
                    None => {
                        self.sent.set(sent);
                        self.ttl.set(ttl);
                    }
                }
                if self.handoff.queued {
                    self.client.queues().hold(key, token, sent + ttl);
                }
                Ok(())
            }
            Err(reason) => {
                self.loss.lose(reason.into());
                Err(Error::not_held(key, reason))
            }
        }
    }

    /// Whether this release may pass the lease on instead (the budget counts
    /// the handoff about to happen). Called once `released` is set, so it
    /// reads the lease's time itself.
    fn may_hand_off(&self) -> bool {
        self.handoff.enabled
            && self.handoffs < self.handoff.budget.max_handoffs
            && self.acquired_at.elapsed() < self.handoff.budget.max_time
            && !self.is_lost()
            && {
                let (sent, ttl) = self.timing();
                !remaining(sent, ttl, Instant::now()).is_zero()
            }
    }

    /// Releases, once: hands the lease to a queued thread of this client when
    /// allowed, else releases in Redis. Whatever the outcome the lease is
    /// done: a release that fails on the network is handed to the client's
    /// cleanup, which releases the key (owner-checked) once Redis answers.
    fn release_now(&self, how: Release) -> Result<(), Error> {
        if self.released.replace(true) {
            return Ok(());
        }
        reentrancy::leave(self.client.id(), &self.key, self);
        if self.may_hand_off() {
            let (sent, ttl) = self.timing();
            let handoff = Handoff {
                token: self.token.clone(),
                sent,
                ttl,
                handoffs: self.handoffs + 1,
                acquired_at: self.acquired_at,
                watch: self.watch.clone(),
                loss: self.loss.clone(),
            };
            if self.client.queues().offer(&self.key, handoff).is_ok() {
                self.client.counters().handoff();
                return Ok(());
            }
        }
        // No renewal starts from here on; one in flight is ignored.
        if let Some(entry) = &self.watch {
            self.client.watchdog().unwatch(entry);
        }
        // Unheld before the release, so a queued head woken by the release
        // message asks Redis instead of waiting for a handoff.
        if self.handoff.queued {
            self.client.queues().unhold(&self.key, &self.token);
        }
        // Redis said the key is gone or another's: nothing to release. (A
        // loss by the local clock, renewals failing or the hold cap, is
        // released all the same: Redis may still hold our token, and the
        // answer is Redis's.)
        if let Some(reason @ (LossReason::Expired | LossReason::OwnedByOther)) = self.loss.reason()
        {
            self.client.queues().released(&self.key, None);
            return Err(Error::not_held(&self.key, reason.not_held_reason()));
        }
        release::release(&self.client, &self.key, &self.token, how).inspect_err(|err| {
            if err.may_leave_a_lease() {
                self.client.orphan(
                    &self.key,
                    OrphanKind::Plain {
                        token: self.token.clone(),
                    },
                );
            }
        })
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.released.get() {
            return;
        }
        match self.release_now(self.release) {
            Ok(()) => {}
            Err(err) => log::warn!("redmutex: releasing {:?} on drop: {err}", self.key),
        }
    }
}

/// Proof that this thread holds a lock. Dropping it releases the lock
/// (best effort, errors logged); [`LockGuard::unlock`] releases and reports.
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

    /// The lock key.
    pub fn key(&self) -> &str {
        &self.lease.key
    }

    /// The random token (a UUID v4) this acquisition wrote into the key;
    /// shared by the guards of a reentrant hold.
    pub fn token(&self) -> &str {
        &self.lease.token
    }

    /// This guard's depth in a reentrant hold: 1 for the guard that acquired
    /// in Redis, 2 for the first nested guard, and so on.
    pub fn hold_count(&self) -> u32 {
        self.hold_count
    }

    /// The lease left by the local monotonic clock, minus a drift allowance
    /// (1 % of the ttl + 2 ms). Measured from when the acquiring (or last
    /// extending) request was sent, so it is never more than Redis allows.
    /// Zero once the lease has run out. This is an estimate without a round
    /// trip; [`LockGuard::is_held`] asks Redis.
    pub fn validity(&self) -> Duration {
        self.lease.validity()
    }

    /// The fencing token of this acquisition (strictly increasing for the
    /// key), when the lock was taken with
    /// [`LockOptions::fencing`](crate::LockOptions::fencing); `None`
    /// otherwise. Pass it to the protected resource with every write, and
    /// have the resource reject a write whose token is lower than the
    /// highest it has seen.
    pub fn fencing_token(&self) -> Option<u64> {
        self.lease.fence
    }

    /// Whether the lease was found lost: by the watchdog (key gone or taken,
    /// Redis unreachable until the lease ran out, hold cap reached) or by an
    /// [`LockGuard::extend`] that found it not held.
    pub fn is_lost(&self) -> bool {
        self.lease.is_lost()
    }

    /// A signal, usable from any thread and after the guard is gone, that
    /// fires when the lease is found lost.
    pub fn loss_signal(&self) -> LossSignal {
        LossSignal {
            state: self.lease.loss.clone(),
        }
    }

    /// Asks Redis whether the key still holds this guard's token.
    ///
    /// # Errors
    ///
    /// [`Error::Redis`] or [`Error::Pool`] when Redis cannot be asked;
    /// [`Error::WrongType`] when the key now holds a non-string value.
    pub fn is_held(&self) -> Result<bool, Error> {
        let key = self.key();
        self.lease.client.counters().commands(1);
        let current: Option<Vec<u8>> = self.lease.client.run(Op::Read, key, |con, _| {
            redis::cmd("GET").arg(key).query(con)
        })?;
        Ok(current.is_some_and(|v| v == self.token().as_bytes()))
    }

    /// Sets the lease to expire `ttl` from now, if the key still holds our
    /// token (`lua/extend.lua`: an owner-checked `PEXPIRE`). An expired lock
    /// is never re-created. Applies to the whole reentrant hold.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a ttl under 1 ms or over ten years
    /// (nothing is sent); [`Error::NotHeld`] with
    /// [`NotHeldReason::Expired`](crate::NotHeldReason::Expired) when the key is gone or
    /// [`NotHeldReason::OwnedByOther`](crate::NotHeldReason::OwnedByOther) when another owner holds it (nothing
    /// changes in Redis); [`Error::Redis`], [`Error::Pool`] or
    /// [`Error::WrongType`] when Redis fails.
    pub fn extend(&mut self, ttl: Duration) -> Result<(), Error> {
        self.lease.extend(ttl)
    }

    /// Releases the lock with the lock's configured [`Release`] and reports
    /// the outcome. A nested guard (other guards of the same hold still
    /// alive on this thread) only gives up its share: `Ok(())`, nothing
    /// sent; the last guard releases in Redis.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] when the lease had already run out
    /// ([`NotHeldReason::Expired`](crate::NotHeldReason::Expired)) or another owner holds the key
    /// ([`NotHeldReason::OwnedByOther`](crate::NotHeldReason::OwnedByOther)); nothing is deleted then.
    /// After Redis said the lease is gone or another's
    /// ([`LossReason::Expired`], [`LossReason::OwnedByOther`]) nothing is
    /// sent and that is reported; after a loss by the local clock
    /// ([`LossReason::Unreachable`], [`LossReason::MaxHold`]) the
    /// owner-checked release is still sent (Redis may still hold the key)
    /// and its answer reported.
    /// [`Error::OutcomeUnknown`], [`Error::Redis`] or [`Error::Pool`] when
    /// Redis fails; the key is then released in the background once Redis
    /// answers (or expires after its ttl).
    pub fn unlock(self) -> Result<(), Error> {
        let how = self.lease.release;
        self.unlock_with(how)
    }

    /// Like [`LockGuard::unlock`], with the given release method.
    ///
    /// # Errors
    ///
    /// As [`LockGuard::unlock`]; also [`Error::InvalidArgument`] for
    /// [`Release::Watch`] on a Redis Cluster client, refused before anything
    /// is sent (the guard is then dropped, which releases with the lock's
    /// own method, [`Release::Lua`] on a cluster).
    pub fn unlock_with(self, release: Release) -> Result<(), Error> {
        if Rc::strong_count(&self.lease) > 1 {
            return Ok(());
        }
        // Refused before anything changes; the guard's drop then releases
        // with the lock's own method.
        self.lease.client.check_release(release)?;
        self.lease.release_now(release)
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.key())
            .field("token", &self.token())
            .field("hold_count", &self.hold_count)
            .field("validity", &self.validity())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drift_is_one_percent_plus_two_ms() {
        assert_eq!(drift(Duration::from_secs(10)), Duration::from_millis(102));
        assert_eq!(drift(Duration::from_millis(100)), Duration::from_millis(3));
    }

    #[test]
    fn remaining_counts_from_the_send_time_minus_drift() {
        let sent = Instant::now();
        let ttl = Duration::from_secs(1);
        // 1000 - 12 (drift) - 300 elapsed
        assert_eq!(
            remaining(sent, ttl, sent + Duration::from_millis(300)),
            Duration::from_millis(688)
        );
        assert_eq!(remaining(sent, ttl, sent), Duration::from_millis(988));
        assert_eq!(
            remaining(sent, ttl, sent + Duration::from_millis(990)),
            Duration::ZERO
        );
        assert_eq!(
            remaining(sent, ttl, sent + Duration::from_secs(5)),
            Duration::ZERO
        );
    }
}
