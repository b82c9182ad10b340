//! The plain lock's lease: one acquisition in Redis, shared by the guards
//! of a reentrant hold, released (or handed to a queued thread of the same
//! client) when the last of them goes.

use std::cell::{Cell, OnceCell};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::client::LockClient;
use crate::client::options::{HandoffBudget, LockOptions, Release, WaitMode, ttl_millis};
use crate::client::release::{self, Pass, Waited};
use crate::conn::policy::Op;
use crate::conn::stats::{LockKind, Tag};
use crate::error::{Error, LossReason};
use crate::lease::loss::LossState;
use crate::lease::remaining;
use crate::mutex::holds;
use crate::renew::watchdog::{OrphanKind, Renewal, WatchEntry};
use crate::script;
use crate::wait::queue::{Capacity, Queues};

/// A hold shorter than this hands its lease over as interceptable
/// ([`Queues::intercept`](crate::wait::queue::Queues::intercept)): about
/// what waking a sleeping thread costs.
const SHORT_HOLD: Duration = Duration::from_micros(20);

/// Whether a hold that began at `held_since` (if known) and ends at `now`
/// hands its lease over as interceptable: shorter than [`SHORT_HOLD`].
fn interceptable(held_since: Option<Instant>, now: Instant) -> bool {
    held_since.is_some_and(|since| now.saturating_duration_since(since) < SHORT_HOLD)
}

/// A lease passed from a releasing holder to a waiter of the same client,
/// without Redis: the key keeps the same token and expiry.
pub(crate) struct Handoff {
    pub(crate) token: Arc<str>,
    /// When the request that set the current expiry was sent.
    pub(crate) sent: Instant,
    pub(crate) ttl: Duration,
    /// Consecutive handoffs so far, this one included.
    pub(crate) handoffs: u32,
    /// When this token was acquired in Redis.
    pub(crate) acquired_at: Instant,
    /// The watchdog entry renewing this lease, which goes along with it.
    pub(crate) watch: Option<Arc<WatchEntry>>,
    /// The lease's loss signal, which goes along with it.
    pub(crate) loss: Arc<LossState>,
    /// When the newest request that found the lease ours in Redis was sent
    /// (its acquisition, a renewal, an extension, a check).
    pub(crate) confirmed: Instant,
}

/// The plain lock's state in one client ([`LockClient::local`]): its wait
/// queues and which keys its threads hold.
#[derive(Default)]
pub(crate) struct Local {
    pub(crate) queues: Queues<Handoff>,
    /// The keys whose last release reached a subscriber (see [`Waited`]).
    pub(crate) waited: Arc<Waited>,
}

impl std::fmt::Debug for Local {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Local").finish_non_exhaustive()
    }
}

/// Releases `key` in Redis if it holds `token`, and tells this client what
/// the release reached: its queue of the key (see [`Queues::released`])
/// and its [`Waited`] keys.
pub(crate) fn release_and_tell(
    client: &LockClient,
    local: &Local,
    key: &Arc<str>,
    channel: &str,
    token: &str,
    how: Release,
) -> Result<(), Error> {
    let released = release::release_on(client, key, channel, token, how);
    let receivers = released.as_ref().ok().copied().flatten();
    local.waited.reached(key, receivers);
    local.queues.released(key, receivers);
    released.map(|_| ())
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
                && options.extra.local_handoff
                && !options.extra.fencing
                && options.extra.handoff_budget.max_handoffs > 0,
            budget: options.extra.handoff_budget,
        }
    }
}

/// One acquisition in Redis: a key holding our token until it expires. The
/// guards of a reentrant hold share it through an `Rc`; when the last one
/// goes, it is released (or handed to a queued thread of the same client).
pub(crate) struct Lease {
    pub(crate) client: LockClient,
    local: Arc<Local>,
    pub(crate) key: Arc<str>,
    pub(crate) token: Arc<str>,
    /// The key's release channel, named once by the lock handle.
    channel: Arc<str>,
    pub(crate) release: Release,
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
    pub(crate) fence: Option<u64>,
    /// The watchdog's entry, when it renews this lease (it then owns the
    /// lease's timing).
    watch: Option<Arc<WatchEntry>>,
    /// Made when first shared (a watchdog, a handoff, a loss signal) or
    /// set: a lease nobody else watches costs no allocation for it, and
    /// nobody can have found it lost before it exists.
    loss: OnceCell<Arc<LossState>>,
    /// When the newest request that found the lease ours in Redis was sent,
    /// but the watchdog's renewals (its entry keeps those).
    confirmed: Cell<Instant>,
    /// For the client's stats: the lock type and key class.
    tag: Tag,
    /// When this holder got the lease (acquired, or a handoff accepted);
    /// `None` while a handed-over lease is not yet accepted.
    held_since: Cell<Option<Instant>>,
}

impl Lease {
    /// A lease just acquired in Redis by a request sent at `sent`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn acquired(
        client: LockClient,
        local: Arc<Local>,
        key: Arc<str>,
        channel: Arc<str>,
        token: Arc<str>,
        options: &LockOptions,
        sent: Instant,
        ttl: Duration,
        fence: Option<u64>,
    ) -> Lease {
        client.counters().acquired();
        let handoff = HandoffPolicy::of(options);
        if handoff.queued {
            local.queues.hold(&key, &token, sent + ttl, Capacity::One);
        }
        let loss: OnceCell<Arc<LossState>> = OnceCell::new();
        let watch = options.watchdog.then(|| {
            let cap = options.max_hold.and_then(|cap| sent.checked_add(cap));
            client.watchdog().watch(
                Renewal::Plain,
                tag_of(options),
                &key,
                &token,
                sent,
                ttl,
                cap,
                loss.get_or_init(Arc::default).clone(),
            )
        });
        Lease {
            client,
            local,
            key,
            channel,
            token,
            release: options.extra.release,
            handoff,
            handoffs: 0,
            acquired_at: sent,
            sent: Cell::new(sent),
            ttl: Cell::new(ttl),
            released: Cell::new(false),
            fence,
            watch,
            loss,
            confirmed: Cell::new(sent),
            tag: tag_of(options),
            held_since: Cell::new(Some(Instant::now())),
        }
    }

    /// A lease handed over by another thread of the same client.
    pub(crate) fn handed_over(
        client: LockClient,
        local: Arc<Local>,
        key: Arc<str>,
        channel: Arc<str>,
        options: &LockOptions,
        handoff: Handoff,
    ) -> Lease {
        Lease {
            client,
            local,
            key,
            channel,
            token: handoff.token,
            release: options.extra.release,
            handoff: HandoffPolicy::of(options),
            handoffs: handoff.handoffs,
            acquired_at: handoff.acquired_at,
            sent: Cell::new(handoff.sent),
            ttl: Cell::new(handoff.ttl),
            released: Cell::new(false),
            fence: None,
            watch: handoff.watch,
            loss: OnceCell::from(handoff.loss),
            confirmed: Cell::new(handoff.confirmed),
            tag: tag_of(options),
            held_since: Cell::new(None),
        }
    }

    /// A handed-over lease was accepted: its hold begins now.
    pub(crate) fn accepted(&self) {
        self.held_since.set(Some(Instant::now()));
    }

    /// When the newest request that found the lease ours in Redis was sent:
    /// its acquisition, an extension, a check, or a renewal by the
    /// watchdog.
    pub(crate) fn confirmed(&self) -> Instant {
        let confirmed = self.confirmed.get();
        match &self.watch {
            Some(entry) => confirmed.max(entry.lease().0),
            None => confirmed,
        }
    }

    /// Asks Redis whether the key still holds our token (`GET`, read-only,
    /// sent again on a fresh connection after a lost reply): `Ok(true)`
    /// confirms the lease as of the request's sending; `Ok(false)` means
    /// Redis no longer holds it, and the lease is marked lost.
    ///
    /// # Errors
    ///
    /// What the request met when it could not be answered: nothing is
    /// known of the lease then, and the caller must not start on it.
    pub(crate) fn confirm(&self) -> Result<bool, Error> {
        let key: &str = &self.key;
        let sent = Instant::now();
        self.client.counters().commands(1);
        use script::wire::Arg;
        let held: Result<Option<Vec<u8>>, Error> = self.client.run(Op::Read, key, |con, _| {
            script::wire::query(con, &[Arg::from("GET"), Arg::from(key)])
        });
        let reason = match held {
            Ok(Some(value)) if value == self.token.as_bytes() => {
                self.confirmed.set(self.confirmed.get().max(sent));
                return Ok(true);
            }
            Ok(Some(_)) | Err(Error::WrongType { .. }) => LossReason::OwnedByOther,
            Ok(None) => LossReason::Expired,
            Err(err) => return Err(err),
        };
        self.loss_state().lose(reason);
        Ok(false)
    }

    /// Applies a receiver's options to a lease handed over to it: its
    /// watchdog setting (renewals start or stop; a cap counts from now) and
    /// its release method. The giver's options no longer apply. The loss
    /// signal stays the lease's own, shared with every holder it passed
    /// through and with its checks.
    pub(crate) fn adopt(&mut self, options: &LockOptions) {
        let now = Instant::now();
        let cap = options.max_hold.and_then(|cap| now.checked_add(cap));
        match (&self.watch, options.watchdog) {
            (None, true) => {
                let entry = self.client.watchdog().watch(
                    Renewal::Plain,
                    self.tag,
                    &self.key,
                    &self.token,
                    self.sent.get(),
                    self.ttl.get(),
                    cap,
                    self.loss_state().clone(),
                );
                self.watch = Some(entry);
            }
            (Some(entry), false) => {
                let (sent, ttl) = entry.lease();
                // Unwatched from here on: no local expiry in the signal,
                // but a loss already found stays found.
                self.client.watchdog().unwatch(entry);
                self.sent.set(sent);
                self.ttl.set(ttl);
                self.watch = None;
            }
            (Some(entry), true) => entry.set_cap(cap),
            (None, false) => {}
        }
        self.release = options.extra.release;
    }

    /// The request time and ttl that set the current expiry.
    fn timing(&self) -> (Instant, Duration) {
        match &self.watch {
            Some(entry) => entry.lease(),
            None => (self.sent.get(), self.ttl.get()),
        }
    }

    /// Found lost, or a forked child's copy (never the child's lease).
    pub(crate) fn is_lost(&self) -> bool {
        self.client.inherited() || self.loss.get().is_some_and(|loss| loss.reason().is_some())
    }

    /// Why the lease was found lost, if it was.
    pub(crate) fn loss_reason(&self) -> Option<LossReason> {
        self.loss.get().and_then(|loss| loss.reason())
    }

    /// The lease's loss state, made on first use.
    pub(crate) fn loss_state(&self) -> &Arc<LossState> {
        self.loss.get_or_init(Arc::default)
    }

    /// Whether the key holds this lease's token (`GET`, a read: a lost
    /// reply is asked again). Changes nothing.
    pub(crate) fn held_in_redis(&self) -> Result<bool, Error> {
        let key: &str = &self.key;
        self.client.counters().commands(1);
        let current: Option<Vec<u8>> = self.client.run(Op::Read, key, |con, _| {
            redis::cmd("GET").arg(key).query(con)
        })?;
        Ok(current.is_some_and(|v| v == self.token.as_bytes()))
    }

    pub(crate) fn is_released(&self) -> bool {
        self.released.get()
    }

    /// Marks the lease done without touching Redis (it was lost).
    pub(crate) fn abandon(&self) {
        if !self.released.replace(true) {
            self.client
                .counters()
                .hold_ended(self.tag, self.held_since.get(), true, Ok(()));
            holds::leave(self.client.id(), &self.key, self);
            if let Some(entry) = &self.watch {
                self.client.watchdog().unwatch(entry);
            }
            if self.handoff.queued {
                self.local.queues.unhold(&self.key, &self.token);
                self.local.queues.released(&self.key, None);
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
        // Before the watch entry's lock, which a parent thread may have
        // held at a fork.
        self.client.check_process()?;
        let millis = ttl_millis(ttl)?;
        let ttl = Duration::from_millis(millis);
        let (key, token): (&str, &str) = (&self.key, &self.token);
        let generation = self.watch.as_ref().map(|entry| entry.generation());
        let sent = Instant::now();
        self.client.counters().commands(1);
        let reply: i64 = self.client.run(Op::Extend, key, |con, _| {
            script::EXTEND.key(key).arg(token).arg(millis).invoke(con)
        })?;
        match script::owner_checked(reply) {
            Ok(()) => {
                // The watchdog's entry owns the timing of a watched lease.
                match &self.watch {
                    Some(entry) => entry.renewed(sent, ttl, generation.unwrap_or_default()),
                    None => {
                        self.sent.set(sent);
                        self.ttl.set(ttl);
                    }
                }
                self.confirmed.set(self.confirmed.get().max(sent));
                if self.handoff.queued {
                    self.local
                        .queues
                        .hold(key, &self.token, sent + ttl, Capacity::One);
                }
                Ok(())
            }
            Err(reason) => {
                self.loss_state().lose(reason);
                Err(Error::not_held(key, reason))
            }
        }
    }

    /// Whether this release may pass the lease on instead (the budget counts
    /// the handoff about to happen). Called once `released` is set, so it
    /// reads the lease's time itself.
    fn may_hand_off(&self) -> Pass {
        let allowed = self.handoff.enabled
            // Nobody to pass it to: no handoff built (and no loss state
            // made for it) only for the offer to find nobody.
            && self.local.queues.has_waiters(&self.key)
            && self.handoffs < self.handoff.budget.max_handoffs
            && self.acquired_at.elapsed() < self.handoff.budget.max_time
            && !self.is_lost()
            && {
                let (sent, ttl) = self.timing();
                !remaining(sent, ttl, Instant::now()).is_zero()
            };
        if !allowed {
            return Pass::No;
        }
        // Last, as it may cost a round trip: a lease Redis vouched for too
        // long ago is confirmed before it is passed on, so a lease Redis
        // lost is reported `NotHeld` instead (nothing left to release).
        if self.confirmed().elapsed() <= self.handoff.budget.max_age {
            return Pass::Yes;
        }
        match self.confirm() {
            Ok(true) => Pass::Yes,
            Ok(false) => Pass::No,
            Err(err) => Pass::Unknown(err),
        }
    }

    /// Gives the lease up, with nothing more sent, after a request about
    /// it could not be answered: Redis may still hold it, so its token goes
    /// to the client's cleanup, which releases it (owner-checked) once
    /// Redis answers. One round trip per call, not two: a call that could
    /// not check the lease does not also wait for a release.
    pub(crate) fn give_up(&self) {
        if self.released.replace(true) {
            return;
        }
        self.client
            .counters()
            .hold_ended(self.tag, self.held_since.get(), false, Ok(()));
        self.end_locally();
    }

    /// Everything of the lease outside Redis ends (its hold, its renewals,
    /// its place in the queue), and its token goes to the cleanup.
    fn end_locally(&self) {
        holds::leave(self.client.id(), &self.key, self);
        if let Some(entry) = &self.watch {
            self.client.watchdog().end(entry);
        }
        if self.handoff.queued {
            self.local.queues.unhold(&self.key, &self.token);
            self.local.queues.released(&self.key, None);
        }
        self.client.orphan(
            &self.key,
            OrphanKind::Plain {
                token: self.token.clone(),
            },
        );
    }

    /// Releases, once: hands the lease to a queued thread of this client when
    /// allowed, else releases in Redis. Whatever the outcome the lease is
    /// done: a release that fails on the network is handed to the client's
    /// cleanup, which releases the key (owner-checked) once Redis answers.
    pub(crate) fn release_now(&self, how: Release) -> Result<(), Error> {
        self.release_once(how, false)
    }

    /// [`Lease::release_now`] for a drop: a release in Redis is written
    /// behind when the connection allows it (`release::release_behind`),
    /// and its outcome, read later, is only logged.
    fn release_on_drop(&self) -> Result<(), Error> {
        self.release_once(self.release, true)
    }

    fn release_once(&self, how: Release, behind: bool) -> Result<(), Error> {
        if self.released.replace(true) {
            return Ok(());
        }
        // A forked child's copy of its parent's lease: refused before
        // anything is looked at (its queues' locks may have been held by a
        // parent thread at the fork) or sent.
        self.client.check_process()?;
        let result = self.let_go(how, behind);
        self.client
            .counters()
            .release(self.tag, self.held_since.get(), self.is_lost(), result)
    }

    fn let_go(&self, how: Release, behind: bool) -> Result<(), Error> {
        holds::leave(self.client.id(), &self.key, self);
        let pass = self.may_hand_off();
        if let Pass::Unknown(err) = pass {
            self.end_locally();
            return Err(err);
        }
        if let Pass::Yes = pass {
            let (sent, ttl) = self.timing();
            let handoff = Handoff {
                token: self.token.clone(),
                sent,
                ttl,
                handoffs: self.handoffs + 1,
                acquired_at: self.acquired_at,
                watch: self.watch.clone(),
                loss: self.loss_state().clone(),
                confirmed: self.confirmed(),
            };
            // Interceptable only after a hold shorter than a thread's wake-up:
            // waking a waiter would cost more than the hold. Longer holds
            // (a round trip in the critical section) keep the queue's
            // strict order, at no loss of throughput.
            let short = interceptable(self.held_since.get(), Instant::now());
            // Passed on without Redis: its receiver confirms it there first
            // when Redis vouched for it too long ago
            // (`DistributedLock::take_handoff`).
            if self.local.queues.offer(&self.key, handoff, short).is_ok() {
                self.client.counters().handoff();
                return Ok(());
            }
        }
        // No renewal starts from here on; one in flight is ignored, even
        // if it finds the key gone (this release may have gone first).
        if let Some(entry) = &self.watch {
            self.client.watchdog().end(entry);
        }
        // Unheld before the release, so a queued head woken by the release
        // message asks Redis instead of waiting for a handoff.
        if self.handoff.queued {
            self.local.queues.unhold(&self.key, &self.token);
        }
        // Redis said the key is gone or another's: nothing to release. (A
        // loss by the local clock, renewals failing or the hold cap, is
        // released all the same: Redis may still hold our token, and the
        // answer is Redis's.)
        if let Some(reason @ (LossReason::Expired | LossReason::OwnedByOther)) =
            self.loss.get().and_then(|loss| loss.reason())
        {
            self.local.queues.released(&self.key, None);
            return Err(Error::not_held(&self.key, reason));
        }
        // Written behind only with nobody known to wait: no thread of this
        // client queued for the key (a release that tells the queue when it
        // has run keeps the queue fair; `release_behind` checks for other
        // clients' waiters).
        if behind
            && how == Release::Lua
            && !self.local.queues.has_waiters(&self.key)
            && release::release_behind(
                &self.client,
                release::Behind {
                    key: self.key.clone(),
                    token: self.token.clone(),
                    channel: self.channel.clone(),
                    what: crate::script::Unmarked::Lock,
                    waited: self.local.waited.clone(),
                },
                self.tag,
                self.is_lost(),
            )
        {
            return Ok(());
        }
        release_and_tell(
            &self.client,
            &self.local,
            &self.key,
            &self.channel,
            &self.token,
            how,
        )
        .inspect_err(|err| {
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

/// A plain lock's stats tag.
pub(crate) fn tag_of(options: &LockOptions) -> Tag {
    Tag {
        kind: LockKind::Mutex,
        class: options.key_class,
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.released.get() {
            return;
        }
        // A forked child's copy of its parent's lease: nothing of it is the
        // child's to release, pass on or count (not even a lock to take:
        // a parent thread may have held one at the fork).
        if self.client.inherited() {
            self.released.set(true);
            return;
        }
        match self.release_on_drop() {
            Ok(()) => {}
            Err(err) => log::warn!("redmutex: releasing {:?} on drop: {err}", self.key),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Interceptable after a hold under 20 µs, never after a longer one or
    /// one whose start is unknown.
    #[test]
    fn a_hold_under_20_us_is_interceptable() {
        let since = Instant::now();
        let at = |micros| since + Duration::from_micros(micros);
        assert!(interceptable(Some(since), since));
        assert!(interceptable(Some(since), at(19)));
        assert!(!interceptable(Some(since), at(20)));
        assert!(!interceptable(Some(since), at(1_000)));
        assert!(!interceptable(None, since));
    }
}
