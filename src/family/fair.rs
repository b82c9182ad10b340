//! `FairLock`: a plain lock granted in the order its waiters first asked
//! Redis, across processes and machines.
//!
//! The lock key is a plain lock key (the token in a string), so its lease
//! is renewed, checked and fenced as a [`DistributedLock`](crate::DistributedLock)'s.
//! Beside it, in its slot, a queue of waiting tokens by ticket and each
//! waiter's deadline by the server's clock (`lua/fair_acquire.lua`). Every
//! waiting thread has its own place; a release wakes the head alone, on
//! that waiter's own channel (`lua/fair_release.lua`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::client::LockClient;
use crate::client::holder::{Redacted, named_holder};
use crate::client::options::{Backoff, FairLockOptions, MAX_TTL, WaitMode, ttl_millis};
use crate::client::release;
use crate::conn::policy::Op;
use crate::conn::stats::{LockKind, Tag};
use crate::error::{Error, LossReason};
use crate::lease::loss::{LossSignal, LossState};
use crate::lease::remaining;
use crate::renew::watchdog::{OrphanKind, Renewal, WatchEntry};
use crate::script;
use crate::wait::acquire::{Attempt, Contender, Queued, Waiting, Within, acquire, blocking};
use crate::wait::queue::Queues;

/// The shortest place in the queue a waiter may ask for: it must outlast
/// the wait for its subscription (200 ms, `wait::pacing`), a round trip
/// and a poll step.
const MIN_ENTRY_TTL: Duration = Duration::from_millis(500);

/// The fair locks' state in one client: a local queue per waiting
/// acquisition (each waits for its own turn in Redis's queue, never for
/// another thread of the client). Nothing is handed over.
#[derive(Default)]
struct Local {
    queues: Queues<Infallible>,
}

impl std::fmt::Debug for Local {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Local").finish_non_exhaustive()
    }
}

/// The names a fair lock derives from its key.
#[derive(Debug)]
struct Names {
    key: Arc<str>,
    queue: String,
    deadlines: String,
    /// A waiter's channel is this followed by its token's secret.
    channels: String,
    sharded: bool,
}

/// A lock granted in the order its waiters first asked Redis for it,
/// whatever process or machine they are on (Redisson's `RFairLock`, with
/// every waiter's place kept alive by the waiter itself).
///
/// Cheap to clone, `Send` and `Sync`; holds nothing in Redis until
/// acquired. The lock key is a plain lock key (a
/// [`DistributedLock`](crate::DistributedLock) on it excludes and is
/// excluded, but does not queue: it takes the key whenever it is free).
///
/// **Order.** A waiter refused by Redis takes a place in the key's queue
/// (a ticket: the server's clock in microseconds, strictly increasing), and
/// the key goes only to the queue's head, or to anyone while nobody waits.
/// Every waiting thread has its own place, so threads of one client are
/// served in queue order too. A `try_lock` never queues: it gets the key
/// only when it is free and nobody waits.
///
/// **Dead waiters.** A waiter renews its place with every attempt (at
/// least every third of [`FairLockExtra::entry_ttl`](crate::FairLockExtra::entry_ttl));
/// a place not renewed lapses at its deadline by the server's clock. So a
/// waiter that died (SIGKILL, a lost network, a long pause) holds the
/// queue up for at most its entry's ttl, then loses its place; one that
/// gives up leaves at once.
///
/// **Waking.** A release wakes the queue's head alone, on its own channel
/// (in [`WaitMode::Notify`], the default); the others ask again at their
/// backoff's pace (never slower than a third of the entry's ttl), which
/// keeps their place.
///
/// ```no_run
/// use redmutex::{FairLock, Lease};
///
/// # fn main() -> Result<(), redmutex::Error> {
/// let client = redmutex::LockClient::open("redis://127.0.0.1:6379/")?;
/// let printer = FairLock::new(&client, "printer");
/// let guard = printer.lock()?; // after everyone who asked before
/// guard.unlock()?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct FairLock {
    client: LockClient,
    local: Arc<Local>,
    names: Arc<Names>,
    options: FairLockOptions,
}

impl FairLock {
    /// A fair lock on `key` with the client's default options (their core
    /// and fencing: [`LockOptions::for_fair`](crate::LockOptions::for_fair)).
    pub fn new(client: &LockClient, key: impl Into<String>) -> FairLock {
        FairLock::with_options(client, key, client.defaults().for_fair())
    }

    /// A fair lock on `key` with the given options.
    pub fn with_options(
        client: &LockClient,
        key: impl Into<String>,
        options: FairLockOptions,
    ) -> FairLock {
        let key = client.names().own_key(key.into());
        let (queue, deadlines) = client.names().fair_keys(&key);
        let mut channels = client.release_channel(&key);
        let sharded = client.sharded(&channels);
        channels.push_str(":w:");
        FairLock {
            client: client.clone(),
            local: client.local::<Local>(),
            names: Arc::new(Names {
                key: key.into(),
                queue,
                deadlines,
                channels,
                sharded,
            }),
            options,
        }
    }

    /// The lock key as it is in Redis (the client's key prefix included).
    pub fn key(&self) -> &str {
        &self.names.key
    }

    /// Who holds the key now, read in one step as
    /// [`DistributedLock::status`](crate::DistributedLock::status) reads a
    /// plain lock (never a token's secret); `None` when it is free. The
    /// queue is not shown.
    ///
    /// # Errors
    ///
    /// As [`DistributedLock::status`](crate::DistributedLock::status).
    pub fn status(&self) -> Result<Option<crate::client::list::HeldLock>, Error> {
        if self.names.key.is_empty() {
            return Err(Error::InvalidArgument(
                "the lock key must not be empty".into(),
            ));
        }
        self.client.status_of(&self.names.key)
    }

    /// The options it is taken with (read as `lock.options().ttl`,
    /// `lock.options().extra.entry_ttl`).
    pub fn options(&self) -> &FairLockOptions {
        &self.options
    }

    /// Takes the lock in queue order, waiting up to the options' `wait`:
    /// woken when the lock is released while this waiter heads the queue
    /// (in [`WaitMode::Notify`]); never sleeping past the deadline, with
    /// one last attempt at it. A waiter that gives up leaves the queue.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when the lock did not come to it within the
    /// wait; [`Error::InvalidArgument`] for an empty key, a ttl under 1 ms
    /// or over ten years, or an entry ttl under 500 ms or over ten years
    /// (nothing is sent); [`Error::WrongType`] when the key (or its queue)
    /// holds another type; [`Error::FenceCounter`]; [`Error::Redis`],
    /// [`Error::Pool`] or [`Error::OutcomeUnknown`] (what the attempt may
    /// have taken is released in the background once Redis answers; a
    /// place it may have taken lapses within its entry ttl).
    pub fn lock(&self) -> Result<FairGuard, Error> {
        blocking(&self.names.key, self.options.wait, |within, seen| {
            self.acquire(within, seen)
        })
    }

    /// One attempt, which never queues: the lock when it is free and
    /// nobody waits for it, else `Ok(None)`.
    ///
    /// # Errors
    ///
    /// As [`FairLock::lock`], without [`Error::Timeout`].
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_lock(&self) -> Result<Option<FairGuard>, Error> {
        self.acquire(Within::Once, &mut None)
    }

    /// Waits in the queue until the lock comes or `wait` has passed
    /// (`Ok(None)`, having left the queue).
    ///
    /// # Errors
    ///
    /// As [`FairLock::lock`], without [`Error::Timeout`].
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_lock_for(&self, wait: Duration) -> Result<Option<FairGuard>, Error> {
        self.acquire(Within::For(wait), &mut None)
    }

    /// Waits in the queue until the lock comes or `deadline` has passed
    /// (at least one attempt, which does not queue for a deadline already
    /// past).
    ///
    /// # Errors
    ///
    /// As [`FairLock::lock`], without [`Error::Timeout`].
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_lock_until(&self, deadline: Instant) -> Result<Option<FairGuard>, Error> {
        self.acquire(Within::Until(deadline), &mut None)
    }

    fn tag(&self) -> Tag {
        Tag {
            kind: LockKind::Fair,
            class: self.options.key_class,
        }
    }

    /// A place in this lock's queue kept across waits: see
    /// [`FairWaiter`].
    pub fn waiter(&self) -> FairWaiter {
        FairWaiter {
            lock: self.clone(),
            place: Place::default(),
        }
    }

    fn acquire(
        &self,
        within: Within,
        seen: &mut Option<String>,
    ) -> Result<Option<FairGuard>, Error> {
        self.acquire_with(within, seen, None)
    }

    /// `kept`: a [`FairWaiter`]'s place (its token made here first, and
    /// its ticket), which the place keeps when the wait ends without the
    /// lock.
    fn acquire_with(
        &self,
        within: Within,
        seen: &mut Option<String>,
        kept: Option<&mut Place>,
    ) -> Result<Option<FairGuard>, Error> {
        let started = Instant::now();
        let result = self.acquire_inner(within, seen, kept);
        self.client
            .counters()
            .acquisition(self.tag(), started, result)
    }

    fn acquire_inner(
        &self,
        within: Within,
        seen: &mut Option<String>,
        mut kept: Option<&mut Place>,
    ) -> Result<Option<FairGuard>, Error> {
        let key: &str = &self.names.key;
        if key.is_empty() {
            return Err(Error::InvalidArgument(
                "the lock key must not be empty".into(),
            ));
        }
        let millis = ttl_millis(self.options.ttl)?;
        let entry_ttl = self.options.extra.entry_ttl;
        if !(MIN_ENTRY_TTL..=MAX_TTL).contains(&entry_ttl) {
            return Err(Error::InvalidArgument(format!(
                "a fair lock's entry ttl must be between 500 ms and ten years, not {entry_ttl:?}"
            )));
        }
        let entry_millis = ttl_millis(entry_ttl)?;
        self.client.check_key(key)?;
        let deadline = within.deadline();
        let keeps = kept.is_some();
        let token: Arc<str> = match kept.as_deref_mut() {
            Some(place) => self.client.token_once(&mut place.token, key)?,
            None => self.client.new_token(key)?.into(),
        };
        let secret = token.split('|').next().unwrap_or(&token);
        let channel = format!("{}{secret}", self.names.channels);
        let mut contender = Wait {
            lock: self,
            token: token.clone(),
            millis,
            entry_millis,
            // A kept place is renewed by every wait, however short.
            queues: keeps || deadline.is_none_or(|d| d > Instant::now()),
            ticket: kept.as_deref().and_then(|place| place.ticket),
            seen: None,
        };
        // A waiter asks again at least every third of its entry's ttl, so
        // only a waiter that stopped asking loses its place.
        let backoff = self.options.backoff;
        let backoff = Backoff::new(
            backoff.initial().min(entry_ttl / 3),
            backoff.max().min(entry_ttl / 3),
            backoff.factor(),
        );
        // Each acquisition waits on its own: its turn is its place in
        // Redis's queue, never another local thread's.
        let own = format!("\u{0}fair\u{0}{token}");
        let subscribe = |waker| self.client.subscribe(&channel, waker);
        let nothing = |never: Infallible| match never {};
        let waiting = match self.options.wait_mode {
            WaitMode::Spin => Waiting::Spin,
            WaitMode::Notify => Waiting::Queued(Queued {
                queues: &self.local.queues,
                key: &own,
                takes_handoffs: false,
                barge: true,
                intercepts: false,
                on_orphan: &nothing,
                subscribe: &subscribe,
            }),
        };
        let result = acquire(&mut contender, deadline, backoff, waiting);
        *seen = contender.seen.take();
        if let Some(place) = kept {
            place.ticket = contender.ticket;
        }
        if contender.queues && !keeps && !matches!(result, Ok(Some(_))) {
            // Gave up (or failed) with a place in the queue: leave it now,
            // within the call's own bound, or let it lapse within its
            // entry ttl (a waiter behind it waits that long at most).
            let bound = deadline.and_then(|d| d.checked_add(self.client.call_slack()));
            let left = bound.map_or(Duration::MAX, |b| {
                b.saturating_duration_since(Instant::now())
            });
            if result.is_ok() && !left.is_zero() {
                let _left = fair_release(&self.client, &self.names, &token, "q", left);
            }
        }
        result
    }
}

/// A place in a [`FairLock`]'s queue kept from one wait to the next, for a
/// caller that waits in slices (to look at a signal, a shutdown flag, a
/// progress display between them) without going to the back of the queue
/// each time. Made by [`FairLock::waiter`]; the place is taken by the first
/// wait and kept, renewed by each wait, until the lock comes (the next
/// wait then queues afresh) or the waiter is dropped, which leaves the
/// queue. Between waits the place lapses after the entry ttl
/// ([`FairLockExtra::entry_ttl`](crate::FairLockExtra::entry_ttl)) if no
/// wait renews it.
///
/// ```no_run
/// use std::time::Duration;
///
/// # fn main() -> Result<(), redmutex::Error> {
/// # let client = redmutex::LockClient::open("redis://127.0.0.1:6379/")?;
/// # let stop = std::sync::atomic::AtomicBool::new(false);
/// let lock = redmutex::FairLock::new(&client, "printer");
/// let mut waiter = lock.waiter();
/// let guard = loop {
///     if let Some(guard) = waiter.try_lock_for(Duration::from_millis(250))? {
///         break Some(guard);
///     }
///     if stop.load(std::sync::atomic::Ordering::Relaxed) {
///         break None; // dropping the waiter leaves the queue
///     }
/// };
/// # drop(guard);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct FairWaiter {
    lock: FairLock,
    place: Place,
}

/// A waiter's place: its token, once a wait made one, and its ticket, once
/// it queued.
#[derive(Debug, Default)]
struct Place {
    token: Option<Arc<str>>,
    ticket: Option<u64>,
}

impl FairWaiter {
    /// Waits in the queue, keeping the place, until the lock comes or
    /// `wait` has passed (`Ok(None)`: the place is kept for the next wait).
    ///
    /// # Errors
    ///
    /// As [`FairLock::lock`], without [`Error::Timeout`].
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_lock_for(&mut self, wait: Duration) -> Result<Option<FairGuard>, Error> {
        let result = self
            .lock
            .acquire_with(Within::For(wait), &mut None, Some(&mut self.place));
        match &result {
            Ok(None) => {}
            // The place became the lock: the next wait is a new one.
            Ok(Some(_)) => self.place = Place::default(),
            // The token may have gone to the client's cleanup, which
            // releases it (owner-checked) for a while yet: a lock taken
            // with it again would be deleted under its guard. The next
            // wait queues afresh; the old place lapses within its entry
            // ttl.
            Err(_) => self.place = Place::default(),
        }
        result
    }
}

impl Drop for FairWaiter {
    fn drop(&mut self) {
        // Leaves the queue within one timeout; failing that (Redis
        // unreachable, a forked child's copy), the place lapses within
        // its entry ttl.
        if let Some(token) = self.place.token.take()
            && !self.lock.client.inherited()
        {
            let budget = self.lock.client.timeout();
            if let Err(err) = fair_release(&self.lock.client, &self.lock.names, &token, "q", budget)
            {
                log::debug!(
                    "redmutex: leaving the queue of {:?}: {err}",
                    self.lock.names.key
                );
            }
        }
    }
}

/// One acquisition of a [`FairLock`], seen by the acquire loop.
struct Wait<'a> {
    lock: &'a FairLock,
    token: Arc<str>,
    millis: u64,
    entry_millis: u64,
    /// Whether a refused attempt takes a place in the queue.
    queues: bool,
    /// The place's ticket, once it has one.
    ticket: Option<u64>,
    seen: Option<String>,
}

impl Contender for Wait<'_> {
    type Won = FairGuard;
    type Gift = Infallible;

    fn attempt(&mut self, _quick: bool) -> Result<Attempt<FairGuard>, Error> {
        let lock = self.lock;
        let (client, names) = (&lock.client, &lock.names);
        let key: &str = &names.key;
        let fence_key = lock.options.extra.fencing.then(|| client.fence_key(key));
        let sent = Instant::now();
        client.counters().commands(1);
        let reply = client.run(Op::FairAcquire, key, |con, _| {
            let mut script = script::FAIR_ACQUIRE.key(key);
            script.key(&names.queue).key(&names.deadlines);
            if let Some(fence_key) = &fence_key {
                script.key(fence_key);
            }
            let reply: (i64, i64, i64, Option<String>, u64) = script
                .arg(&*self.token)
                .arg(self.millis)
                .arg(self.entry_millis)
                .arg(if self.queues { "1" } else { "0" })
                .invoke(con)?;
            Ok(reply)
        });
        let (acquired, pttl, position, holder, number) = reply
            .map_err(|err| crate::mutex::fence_failure(key, fence_key.as_deref(), err))
            .inspect_err(|err| {
                if err.may_leave_a_lease() || err.is_connection() {
                    client.orphan(
                        key,
                        OrphanKind::Plain {
                            token: self.token.clone(),
                        },
                    );
                }
            })?;
        if acquired == 1 {
            let fence = lock.options.extra.fencing.then_some(number);
            return Ok(Attempt::Won(FairGuard::new(
                lock,
                self.token.clone(),
                sent,
                self.millis,
                fence,
                self.ticket,
            )));
        }
        if number > 0 {
            // Its place now: a place that lapsed (the waiter stalled) is
            // taken again at the back, with a new ticket.
            self.ticket = Some(number);
        }
        self.seen = holder.as_deref().and_then(named_holder);
        // The head sleeps until woken (or the holder's expiry); the others
        // at their backoff's pace, which keeps their place.
        Ok(Attempt::Held(if position == 0 {
            u64::try_from(pttl).ok().map(Duration::from_millis)
        } else {
            None
        }))
    }

    fn accept(&mut self, gift: Infallible) -> Result<Option<FairGuard>, Error> {
        match gift {}
    }
}

/// `lua/fair_release.lua`: `code` `r` releases the lock, `q` leaves the
/// queue; the head is told either way when the lock is free.
fn fair_release(
    client: &LockClient,
    names: &Names,
    token: &str,
    code: &str,
    budget: Duration,
) -> Result<i64, Error> {
    let key: &str = &names.key;
    let (marker, millis) = release::marker_of(client, key, token);
    let markerless = std::cell::Cell::new(marker.is_none());
    client.counters().commands(1);
    let (reply, send) = client.run_within(Op::FairRelease, key, budget, |con, send| {
        let reply: i64 = release::with_marker(client, marker.as_deref(), &markerless, |marker| {
            let mut script = script::FAIR_RELEASE.key(key);
            script.key(&names.queue).key(&names.deadlines);
            if let Some(marker) = marker {
                script.key(marker);
            }
            script.arg(token).arg(code).arg(millis).arg(&names.channels);
            if names.sharded {
                script.arg(script::SHARDED);
            }
            script.invoke(con)
        })?;
        Ok((reply, send.replied()))
    })?;
    if code == "r" && reply != 1 && reply != 2 {
        let reason = release::not_held(reply, &markerless);
        // "Not held", answered to a resend, proves nothing without a marker.
        release::check_resend(key, Err::<(), _>(reason), send, !markerless.get(), millis)?
            .map_err(|reason| Error::not_held(key, reason))?;
    }
    Ok(reply)
}

/// A [`FairLock`] held: a plain lease on the key. Dropping it releases the
/// lock (waking the queue's head); [`FairGuard::unlock`](crate::Lease::unlock)
/// releases and reports.
///
/// `Send` and `Sync`: a fair lock is not reentrant.
///
/// ```
/// fn assert_send_sync<T: Send + Sync>() {}
/// assert_send_sync::<redmutex::FairGuard>();
/// ```
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct FairGuard {
    client: LockClient,
    names: Arc<Names>,
    token: Arc<str>,
    sent: Instant,
    ttl: Duration,
    released: bool,
    tag: Tag,
    held_since: Instant,
    loss: Arc<LossState>,
    watch: Option<Arc<WatchEntry>>,
    fence: Option<u64>,
    ticket: Option<u64>,
}

impl std::fmt::Debug for FairGuard {
    // The token is a capability: only its public part is shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FairGuard")
            .field("key", &self.names.key)
            .field("token", &Redacted(&self.token))
            .field("ticket", &self.ticket)
            .field("released", &self.released)
            .finish_non_exhaustive()
    }
}

impl FairGuard {
    fn new(
        lock: &FairLock,
        token: Arc<str>,
        sent: Instant,
        millis: u64,
        fence: Option<u64>,
        ticket: Option<u64>,
    ) -> FairGuard {
        let ttl = Duration::from_millis(millis);
        let loss: Arc<LossState> = Arc::default();
        let tag = lock.tag();
        let options = &lock.options;
        let watch = options.watchdog.then(|| {
            let cap = options.max_hold.and_then(|cap| sent.checked_add(cap));
            lock.client.watchdog().watch(
                Renewal::Plain,
                tag,
                &lock.names.key,
                &token,
                sent,
                ttl,
                cap,
                loss.clone(),
            )
        });
        FairGuard {
            client: lock.client.clone(),
            names: lock.names.clone(),
            token,
            sent,
            ttl,
            released: false,
            tag,
            held_since: Instant::now(),
            loss,
            watch,
            fence,
            ticket,
        }
    }

    /// The token the acquisition wrote into the key: a random secret and
    /// the holder metadata ([`Holder::from_token`](crate::Holder::from_token)).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The place this acquisition had in the queue when the lock came to
    /// it: its ticket (the server's clock in microseconds when it took the
    /// place, strictly increasing per queue; a [`FairWaiter`]'s place is
    /// one across its waits), or `None` when it got the lock without
    /// queueing. Grants go in ticket order.
    pub fn ticket(&self) -> Option<u64> {
        self.ticket
    }

    fn timing(&self) -> (Instant, Duration) {
        match &self.watch {
            Some(entry) => entry.lease(),
            None => (self.sent, self.ttl),
        }
    }

    fn release(&mut self) -> Result<(), Error> {
        self.released = true;
        // A forked child's copy of its parent's hold: refused, nothing sent.
        self.client.check_process()?;
        if let Some(entry) = &self.watch {
            self.client.watchdog().end(entry);
        }
        let lost = self.loss.reason().is_some();
        let result = fair_release(&self.client, &self.names, &self.token, "r", Duration::MAX)
            .map(drop)
            .inspect_err(|err| {
                if err.may_leave_a_lease() {
                    // Released in the background once Redis answers.
                    self.client.orphan(
                        &self.names.key,
                        OrphanKind::Plain {
                            token: self.token.clone(),
                        },
                    );
                }
            });
        self.client
            .counters()
            .release(self.tag, Some(self.held_since), lost, result)
    }
}

impl crate::lease::sealed::Sealed for FairGuard {}

impl crate::lease::Lease for FairGuard {
    /// The lock key.
    fn key(&self) -> &str {
        &self.names.key
    }

    /// The lease left by the local clock since the acquisition or last
    /// extension, minus the drift allowance; zero once released or lost.
    fn validity(&self) -> Duration {
        if self.released || self.is_lost() {
            return Duration::ZERO;
        }
        let (sent, ttl) = self.timing();
        remaining(sent, ttl, Instant::now())
    }

    /// Whether the lease was found lost: by an extension,
    /// [`FairGuard::is_held`](crate::Lease::is_held) or the watchdog; or,
    /// watched, its lease ran out by the local clock with no successful
    /// renewal. Always true in a process forked since it was taken.
    fn is_lost(&self) -> bool {
        self.client.inherited() || self.loss.reason().is_some()
    }

    /// A signal, usable from any thread and after the guard is gone, that
    /// fires when the lease is found lost.
    fn loss_signal(&self) -> LossSignal {
        LossSignal {
            state: self.loss.clone(),
        }
    }

    fn fencing_token(&self) -> Option<u64> {
        self.fence
    }

    /// Asks Redis whether the key still holds this guard's token (`GET`).
    /// A lease found not held is lost from then on.
    ///
    /// # Errors
    ///
    /// [`Error::Redis`] or [`Error::Pool`]; [`Error::InvalidArgument`] for
    /// a guard inherited through `fork()` (nothing is sent).
    fn is_held(&self) -> Result<bool, Error> {
        self.client.check_process()?;
        if self.released {
            return Ok(false);
        }
        let key: &str = &self.names.key;
        self.client.counters().commands(1);
        let current: Option<Vec<u8>> = self.client.run(Op::Read, key, |con, _| {
            redis::cmd("GET").arg(key).query(con)
        })?;
        let held = current.as_deref() == Some(self.token.as_bytes());
        if !held {
            self.loss.lose(if current.is_none() {
                LossReason::Expired
            } else {
                LossReason::OwnedByOther
            });
        }
        Ok(held)
    }

    /// Sets the lease to expire `ttl` from now, if the key still holds our
    /// token (`lua/extend.lua`: owner-checked, never re-creating the key).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a ttl under 1 ms or over ten years,
    /// or a guard inherited through `fork()` (nothing is sent);
    /// [`Error::NotHeld`], after which [`FairGuard::is_lost`](crate::Lease::is_lost)
    /// is true; [`Error::WrongType`], [`Error::Redis`], [`Error::Pool`]
    /// or [`Error::OutcomeUnknown`].
    fn extend(&mut self, ttl: Duration) -> Result<(), Error> {
        self.client.check_process()?;
        let millis = ttl_millis(ttl)?;
        let key: &str = &self.names.key;
        if self.released {
            return Err(Error::not_held(key, LossReason::Expired));
        }
        let generation = self.watch.as_ref().map(|entry| entry.generation());
        let sent = Instant::now();
        self.client.counters().commands(1);
        let extended: i64 = self.client.run(Op::Extend, key, |con, _| {
            script::EXTEND
                .key(key)
                .arg(&*self.token)
                .arg(millis)
                .invoke(con)
        })?;
        let reason = match extended {
            1 => None,
            0 => Some(LossReason::Expired),
            _ => Some(LossReason::OwnedByOther),
        };
        if let Some(reason) = reason {
            self.loss.lose(reason);
            return Err(Error::not_held(key, reason));
        }
        let asked = Duration::from_millis(millis);
        if let Some(entry) = &self.watch {
            entry.renewed(sent, asked, generation.unwrap_or_default());
        } else {
            self.sent = sent;
            self.ttl = asked;
        }
        Ok(())
    }

    /// Releases the lock (owner-checked) and wakes the queue's head.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] when the key no longer held the token (nothing
    /// is deleted); [`Error::OutcomeUnknown`], [`Error::Redis`] or
    /// [`Error::Pool`] when Redis fails (the lock is then released in the
    /// background once Redis answers, or expires);
    /// [`Error::InvalidArgument`] for a guard inherited through `fork()`.
    fn unlock(mut self) -> Result<crate::lease::Unlocked, Error> {
        self.release().map(|()| crate::lease::Unlocked::Released)
    }
}

impl Drop for FairGuard {
    fn drop(&mut self) {
        // A forked child's copy of its parent's hold: not the child's.
        if self.client.inherited() {
            self.released = true;
        }
        if !self.released
            && let Err(err) = self.release()
        {
            log::warn!(
                "redmutex: releasing the fair lock of {:?} on drop: {err}",
                self.names.key
            );
        }
    }
}
