//! The watchdog: one background thread per `LockClient` that keeps watched
//! leases alive, renewing every lease at a third of its ttl, the renewals
//! due together pipelined in one round trip; and that cleans up after
//! failed acquisitions (orphans), releasing tokens that a request may have
//! set although its caller was told it failed.
//!
//! No lock is held across a round trip: the thread copies what it sends,
//! and applies the replies afterwards to the entries still watched. A
//! renewal in flight when its lease is released is harmless (owner-checked:
//! it finds the key gone or another owner's). A renewal call never lasts
//! longer than the shortest lease it renews has left (nor a round the
//! shortest renewal period; on Redis Cluster a round that opens a new
//! pooled connection can take a timeout more per silent seed: the bound
//! as docs/failure-model.md states it), and a watched lease
//! reads as lost from its local expiry on whatever the thread is doing
//! (see `loss.rs`), so the holder learns of a loss before another client
//! can take the key.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use redis::cluster_routing::Slot;

use crate::conn::backend::{Backend, Deployment};
use crate::conn::policy::{self, Op};
use crate::conn::stats::{Stats, Tag};
use crate::conn::worker::{STOP_WAIT, Worker};
use crate::error::{Error, LossReason};
use crate::lease::loss::LossState;
use crate::lease::{local_expiry, remaining};
use crate::script::{self, Unmarked};

/// The watchdog thread's name.
pub(crate) const THREAD_NAME: &str = "redmutex-dog";
/// How soon a renewal or cleanup that failed on the network is tried again.
const RETRY: Duration = Duration::from_millis(100);
/// The longest the thread sleeps without looking.
const IDLE: Duration = Duration::from_secs(1);
/// The first and the longest pause between two cleanups of one orphan.
const ORPHAN_FIRST_STEP: Duration = Duration::from_millis(50);
const ORPHAN_MAX_STEP: Duration = Duration::from_secs(1);

/// What a watched lease is in Redis, and so which script renews it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Renewal {
    /// A string key holding the token (`lua/extend.lua`).
    Plain,
    /// A semaphore permit: a field of the semaphore's hash named by the
    /// permit's id (`lua/sem_extend.lua`).
    Permit,
    /// A reentrant lock's hash, owned by the token (the owner id):
    /// `lua/reentrant_extend.lua`, which never shortens the key's expiry
    /// (another hold of the owner may need longer).
    Reentrant,
    /// One holder of a read-write lock: its own field, a reader's
    /// (`false`) or the writer's (`true`), by `lua/rw_extend.lua` (never
    /// an earlier deadline).
    Rw {
        /// The writer's hold.
        write: bool,
    },
    /// The keys of one slot's part of a multi-lock, each holding the
    /// token, renewed together (`lua/multi_extend.lua`: all or none, so a
    /// part with a key lost is lost whole). The entry's key is the first.
    /// Behind one pointer: every other lease's entry stays as small.
    Multi(Arc<MultiPart>),
}

/// One slot's part of a watched multi-lock.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct MultiPart {
    /// Every key of the part, in the set's order.
    pub(crate) keys: Arc<[Arc<str>]>,
    /// Which part of the set's lease this is: the set's parts share one
    /// loss state, which keeps each part's expiry.
    pub(crate) part: usize,
}

/// One watched lease.
pub(crate) struct WatchEntry {
    key: Arc<str>,
    token: Arc<str>,
    renewal: Renewal,
    /// The lock type and key class its renewals count for.
    tag: Tag,
    pub(crate) loss: Arc<LossState>,
    state: Mutex<EntryState>,
}

struct EntryState {
    stopped: bool,
    /// Its lease is being released: what a renewal in flight finds is no
    /// news of a holder (it may find the key this release deleted).
    ended: bool,
    /// When the request that set the current expiry was sent, and its ttl.
    sent: Instant,
    ttl: Duration,
    /// No renewal after this moment ([`LockOptions::max_hold`](crate::LockOptions::max_hold)).
    cap: Option<Instant>,
    /// Bumped by every renewal: a renewal that started before another
    /// ended cannot tell which of the two Redis ran last.
    generation: u64,
}

impl EntryState {
    fn end(&self) -> Instant {
        local_expiry(self.sent, self.ttl)
    }
}

impl Renewal {
    /// Which part of its lease's loss state an entry renewing this keeps.
    fn part(&self) -> usize {
        match self {
            Renewal::Multi(part) => part.part,
            _ => 0,
        }
    }
}

impl WatchEntry {
    /// Stops renewals; one in flight is ignored when it returns.
    pub(crate) fn stop(&self) {
        self.state.lock().stopped = true;
    }

    /// A renewal found the lease gone: lost, and renewals stop. (Also when
    /// they had stopped meanwhile: a lease passed to a holder that does
    /// not renew is just as lost; not once its release began.)
    fn lost(&self, reason: LossReason) {
        let mut state = self.state.lock();
        state.stopped = true;
        if !state.ended {
            self.loss.lose(reason);
        }
    }

    /// What the lease has left by the local clock, unless it is no longer
    /// renewed.
    fn left(&self) -> Option<Duration> {
        let state = self.state.lock();
        (!state.stopped).then(|| remaining(state.sent, state.ttl, Instant::now()))
    }

    /// The lease's current expiry by the local clock.
    pub(crate) fn lease(&self) -> (Instant, Duration) {
        let state = self.state.lock();
        (state.sent, state.ttl)
    }

    /// Renewals stop at `cap` (a handed-over lease takes its receiver's
    /// cap).
    pub(crate) fn set_cap(&self, cap: Option<Instant>) {
        self.state.lock().cap = cap;
    }

    /// The renewal generation now: pass it to [`WatchEntry::renewed`]
    /// after a renewal sent from here.
    pub(crate) fn generation(&self) -> u64 {
        self.state.lock().generation
    }

    /// A renewal sent at `sent` for `ttl`, begun at `generation`,
    /// succeeded. When another renewal ended meanwhile, Redis may have run
    /// either last: the earlier of the two expiries is kept.
    pub(crate) fn renewed(&self, sent: Instant, ttl: Duration, generation: u64) {
        let mut state = self.state.lock();
        if state.stopped {
            return;
        }
        let later = local_expiry(sent, ttl) > state.end();
        if state.generation == generation || !later {
            state.sent = sent;
            state.ttl = ttl;
        }
        state.generation = state.generation.wrapping_add(1);
        if !self
            .loss
            .expire_part_at(self.renewal.part(), state.end(), LossReason::Unreachable)
        {
            state.stopped = true;
        }
    }
}

/// A lease nobody owns: an acquisition failed after its request may have
/// reached Redis, so the key may hold its token. Released (owner-checked)
/// again and again until no request of it can arrive any more.
pub(crate) struct Orphan {
    key: Arc<str>,
    /// The key's release channel, named by the client (its prefix).
    channel: Arc<str>,
    /// Announced with `SPUBLISH` ([`LockClient::sharded`](crate::LockClient)).
    sharded: bool,
    kind: OrphanKind,
    /// Cleanups go on until then: a request delayed on its way (by a proxy
    /// holding it, say) can still set the key until it arrives.
    until: Instant,
    /// How long `until` reaches past the last time Redis could not be
    /// reached (and past the first answer after that): a request held on
    /// an unreachable path arrives when the path heals, however long it
    /// stayed down, so the window is counted from then.
    window: Duration,
    /// Never watched past this, however long Redis stays unreachable.
    last: Instant,
    /// The last cleanup could not reach Redis.
    unreached: bool,
    next: Instant,
    step: Duration,
}

/// The longest an orphan is watched while its Redis stays unreachable.
const ORPHAN_MAX_LIFE: Duration = Duration::from_secs(600);
/// The most orphans a client watches at once; past it the oldest goes
/// (its key still expires by its ttl).
const MAX_ORPHANS: usize = 10_000;

/// What an orphan's request may have left in Redis.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum OrphanKind {
    /// A plain lock's token (`SET`, `lua/acquire.lua`).
    Plain { token: Arc<str> },
    /// A reentrant hold.
    Reentrant { owner: String, hold: String },
    /// A read-write lock token: a reader, the writer, or a waiting writer.
    Rw { token: String },
    /// A semaphore permit's id.
    Permit { id: Arc<str> },
}

impl Orphan {
    /// The same, its release announced with `SPUBLISH` when `sharded`.
    pub(crate) fn sharded(self, sharded: bool) -> Orphan {
        Orphan { sharded, ..self }
    }

    /// An orphan of `key` (whose releases are announced on `channel`),
    /// watched for `window` from now.
    pub(crate) fn new(
        key: impl Into<Arc<str>>,
        channel: impl Into<Arc<str>>,
        kind: OrphanKind,
        window: Duration,
    ) -> Orphan {
        let now = Instant::now();
        let last = now.checked_add(ORPHAN_MAX_LIFE).unwrap_or(now);
        Orphan {
            key: key.into(),
            channel: channel.into(),
            sharded: false,
            kind,
            until: now.checked_add(window).unwrap_or(now).min(last),
            window,
            last,
            unreached: false,
            next: now,
            step: ORPHAN_FIRST_STEP,
        }
    }

    /// Redis could not be reached (or just answered again after that):
    /// watched for a whole window from now.
    fn unreached(&mut self, now: Instant) {
        self.unreached = true;
        self.extend(now);
    }

    /// Redis answered the cleanup; after it could not be reached, what it
    /// held back may still come: a whole window from now.
    fn answered(&mut self, now: Instant) {
        if std::mem::take(&mut self.unreached) {
            self.extend(now);
        }
    }

    /// A cleanup round of it ended at `now`: the next one a step later,
    /// each step twice the last ([`ORPHAN_FIRST_STEP`] to
    /// [`ORPHAN_MAX_STEP`]).
    fn stepped(&mut self, now: Instant) {
        self.next = now + self.step;
        self.step = (self.step * 2).min(ORPHAN_MAX_STEP);
    }

    fn extend(&mut self, now: Instant) {
        let until = now.checked_add(self.window).unwrap_or(now).min(self.last);
        self.until = self.until.max(until);
    }
}

struct Registry {
    entries: Vec<Arc<WatchEntry>>,
    orphans: Vec<Orphan>,
    /// Orphans taken out for a cleanup round in progress.
    cleaning: usize,
    thread: Option<Worker>,
    shutdown: bool,
    /// When the client let go: the thread ends within one I/O timeout of
    /// it, its last cleanup round included.
    shutdown_at: Option<Instant>,
}

struct Shared {
    backend: Backend,
    stats: Arc<Stats>,
    registry: Mutex<Registry>,
    changed: Condvar,
    /// Releases written behind, checked when due ([`Cleanups::defer`]).
    /// A lock of its own, not the registry's: every such drop takes it.
    /// Taken after the registry's when both are held, never before.
    checks: Mutex<Checks>,
    /// On a cluster, the node each slot's renewals last went to (learned
    /// from the renewals themselves, see [`group_by_node`]).
    nodes: Mutex<HashMap<Slot, u64>>,
}

/// A release written behind, until its reply is read (by the next user of
/// its connection): the key, the token (or permit id), the channel, and
/// whether the reply came. Part of the reply's owner, which the deferred
/// check shares ([`Deferred`]).
pub(crate) struct Pending {
    pub(crate) key: Arc<str>,
    pub(crate) token: Arc<str>,
    pub(crate) channel: Arc<str>,
    /// A plain lock's token or a semaphore permit's id.
    pub(crate) what: Unmarked,
    settled: AtomicBool,
}

impl Pending {
    pub(crate) fn new(
        key: Arc<str>,
        token: Arc<str>,
        channel: Arc<str>,
        what: Unmarked,
    ) -> Pending {
        Pending {
            key,
            token,
            channel,
            what,
            settled: AtomicBool::new(false),
        }
    }

    /// Its reply was read (or given up and handed to the cleanup).
    pub(crate) fn settle(&self) {
        self.settled.store(true, Ordering::Release);
    }

    fn is_settled(&self) -> bool {
        self.settled.load(Ordering::Acquire)
    }

    /// Its token as an orphan, cleaned up for `window`.
    pub(crate) fn orphan(&self, window: Duration) -> Orphan {
        let kind = match self.what {
            Unmarked::Lock => OrphanKind::Plain {
                token: self.token.clone(),
            },
            Unmarked::Permit => OrphanKind::Permit {
                id: self.token.clone(),
            },
        };
        Orphan::new(self.key.clone(), self.channel.clone(), kind, window)
    }
}

/// What the deferred check of a release written behind holds: the reply's
/// owner itself (one allocation for both), seen through its [`Pending`].
pub(crate) trait Deferred: Send + Sync {
    fn pending(&self) -> &Pending;
}

/// The releases written behind being checked, and when the thread will
/// look at them next.
#[derive(Default)]
struct Checks {
    list: Vec<Check>,
    /// When the thread wakes by itself; `None` while it sleeps with no
    /// deadline (nothing to look at). A check due sooner wakes it.
    wake_at: Option<Instant>,
}

/// A release written behind, until its reply is read or it is handed to
/// the cleanup.
struct Check {
    deferred: Arc<dyn Deferred>,
    /// When to look at it next.
    due: Instant,
    /// Looked at once already: the idle connections were read.
    looked: bool,
    /// When the cleanup takes it over, should its reply still be unread.
    last: Instant,
}

/// What the due checks ask for.
#[derive(Default)]
struct DueChecks {
    /// Replies unread past [`CHECK_WINDOW`]'s resend window: released by
    /// the cleanup (their release may never have run; the cleanup's is
    /// owner-checked, so it is harmless if it did).
    orphans: Vec<Orphan>,
    /// Replies unread [`LOOK_AFTER`] after their write: the idle
    /// connections owing replies are to be read now.
    look: bool,
}

/// Takes out the checks that are due: those whose reply was read are
/// forgotten; a first look at an unread one asks for the idle connections
/// to be read (the client went quiet with a reply owed, a `NOSCRIPT` to
/// act on, say); one still unread at its last moment becomes an orphan.
fn due_checks(shared: &Shared, now: Instant) -> DueChecks {
    let mut due = DueChecks::default();
    shared.checks.lock().list.retain_mut(|check| {
        if check.deferred.pending().is_settled() {
            return false;
        }
        if check.due > now {
            return true;
        }
        if !check.looked {
            check.looked = true;
            check.due = check.last;
            due.look = true;
            return true;
        }
        log::debug!(
            "redmutex: the reply to the release of {:?} written behind was not read in time; \
             releasing it in the background",
            check.deferred.pending().key
        );
        due.orphans
            .push(check.deferred.pending().orphan(CHECK_WINDOW));
        false
    });
    due
}

/// How soon after a release is written behind its reply is looked for,
/// when nobody used its connection since: idle connections owing replies
/// are read then, so a reply that asks for something (`NOSCRIPT`: the
/// release sent again as `EVAL`) is acted on within this and a round trip
/// or two, not a resend window later.
pub(crate) const LOOK_AFTER: Duration = Duration::from_millis(20);

/// How long the cleanup of an unread release written behind goes on.
const CHECK_WINDOW: Duration = Duration::from_secs(1);

/// The client's watchdog: started on first use, stopped when dropped.
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
}

impl Watchdog {
    pub(crate) fn new(backend: Backend, stats: Arc<Stats>) -> Watchdog {
        Watchdog {
            shared: Arc::new(Shared {
                backend,
                stats,
                registry: Mutex::new(Registry {
                    entries: Vec::new(),
                    orphans: Vec::new(),
                    cleaning: 0,
                    thread: None,
                    shutdown: false,
                    shutdown_at: None,
                }),
                changed: Condvar::new(),
                checks: Mutex::default(),
                nodes: Mutex::default(),
            }),
        }
    }

    /// Starts renewing a lease acquired by a request sent at `sent`; `token`
    /// is a permit's id for [`Renewal::Permit`]. `loss` is the lease's own
    /// signal (kept by every holder it passes to): it now also reads as
    /// lost from the lease's local expiry on, which renewals move.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn watch(
        &self,
        renewal: Renewal,
        tag: Tag,
        key: &Arc<str>,
        token: &Arc<str>,
        sent: Instant,
        ttl: Duration,
        cap: Option<Instant>,
        loss: Arc<LossState>,
    ) -> Arc<WatchEntry> {
        let part = renewal.part();
        loss.expire_part_at(part, local_expiry(sent, ttl), LossReason::Unreachable);
        self.register(renewal, tag, key, token, sent, ttl, cap, loss)
    }

    #[allow(clippy::too_many_arguments)]
    fn register(
        &self,
        renewal: Renewal,
        tag: Tag,
        key: &Arc<str>,
        token: &Arc<str>,
        sent: Instant,
        ttl: Duration,
        cap: Option<Instant>,
        loss: Arc<LossState>,
    ) -> Arc<WatchEntry> {
        let entry = Arc::new(WatchEntry {
            key: key.clone(),
            token: token.clone(),
            renewal,
            tag,
            loss,
            state: Mutex::new(EntryState {
                stopped: false,
                ended: false,
                sent,
                ttl,
                cap,
                generation: 0,
            }),
        });
        let mut registry = self.shared.registry.lock();
        registry.entries.push(entry.clone());
        self.start(&mut registry);
        entry
    }

    /// [`Watchdog::unwatch`] for a lease being released: a renewal in
    /// flight that finds the key gone afterwards does not mark it lost.
    pub(crate) fn end(&self, entry: &Arc<WatchEntry>) {
        entry.state.lock().ended = true;
        self.unwatch(entry);
    }

    /// Stops renewing `entry` and forgets it. Its lease's signal keeps a
    /// local expiry already passed, and no other (see
    /// [`LossState::forget_deadline`]).
    pub(crate) fn unwatch(&self, entry: &Arc<WatchEntry>) {
        entry.stop();
        entry.loss.forget_deadline();
        self.shared
            .registry
            .lock()
            .entries
            .retain(|e| !Arc::ptr_eq(e, entry));
    }

    /// Releases what `orphan`'s request may have left, now and until its
    /// window ends.
    pub(crate) fn clean_up(&self, orphan: Orphan) {
        if !clean_up(&self.shared, orphan) {
            log::debug!("redmutex: the client is shutting down; a cleanup was not queued");
        }
    }

    /// A handle for cleanups that does not keep the watchdog (and so the
    /// pool) alive: for what a pooled connection carries with it.
    pub(crate) fn cleanups(&self) -> Cleanups {
        Cleanups(Arc::downgrade(&self.shared))
    }

    fn start(&self, registry: &mut Registry) {
        start(&self.shared, registry);
    }
}

/// See [`Watchdog::cleanups`].
#[derive(Clone)]
pub(crate) struct Cleanups(Weak<Shared>);

impl Cleanups {
    /// [`Watchdog::clean_up`]; `false` when the client is gone or shutting
    /// down (nothing will run it).
    pub(crate) fn clean_up(&self, orphan: Orphan) -> bool {
        self.0
            .upgrade()
            .is_some_and(|shared| clean_up(&shared, orphan))
    }

    /// Checks `deferred`: [`LOOK_AFTER`] from now, if its reply has not
    /// been read, the idle connections owing replies are read; `delay`
    /// from now, if it still has not, the cleanup releases its token. One
    /// short lock and one push per drop that writes behind; the thread is
    /// woken only when it would otherwise sleep past this check's first
    /// look (once per sleep: it then plans to wake for this one).
    pub(crate) fn defer(&self, deferred: Arc<dyn Deferred>, delay: Duration) -> bool {
        let Some(shared) = self.0.upgrade() else {
            return false;
        };
        let now = Instant::now();
        let due = now.checked_add(delay).unwrap_or(now);
        let look = now.checked_add(LOOK_AFTER).unwrap_or(due).min(due);
        let wake = {
            let mut checks = shared.checks.lock();
            checks.list.push(Check {
                deferred,
                due: look,
                looked: false,
                last: due,
            });
            let wake = checks.wake_at.is_none_or(|at| at > look);
            if wake {
                checks.wake_at = Some(look);
            }
            wake
        };
        if wake {
            let mut registry = shared.registry.lock();
            if registry.shutdown {
                return false;
            }
            start(&shared, &mut registry);
        }
        true
    }
}

fn clean_up(shared: &Arc<Shared>, orphan: Orphan) -> bool {
    let mut registry = shared.registry.lock();
    if registry.shutdown {
        return false;
    }
    // The same token handed over again soon after (a failed acquisition,
    // then its release): watched once, for the longer of the two windows.
    // Only the latest few are compared: this runs on every release to a
    // RedLock node that is down, while thousands may be pending.
    if let Some(known) = registry
        .orphans
        .iter_mut()
        .rev()
        .take(64)
        .find(|o| o.key == orphan.key && o.kind == orphan.kind)
    {
        known.until = known.until.max(orphan.until);
        return true;
    }
    if registry.orphans.len() >= MAX_ORPHANS {
        // The oldest tenth at once, so this stays cheap per release.
        registry.orphans.drain(..MAX_ORPHANS / 10);
        log::warn!(
            "redmutex: more than {MAX_ORPHANS} cleanups pending; the oldest {} are dropped (their keys expire by their ttl)",
            MAX_ORPHANS / 10
        );
    }
    registry.orphans.push(orphan);
    start(shared, &mut registry);
    true
}

fn start(shared: &Arc<Shared>, registry: &mut Registry) {
    if registry.thread.is_none() && !registry.shutdown {
        let thread_shared = shared.clone();
        match Worker::spawn(THREAD_NAME, move || run(&thread_shared)) {
            Ok(worker) => registry.thread = Some(worker),
            Err(err) => log::warn!("redmutex: cannot start the watchdog thread: {err}"),
        }
    }
    shared.changed.notify_all();
}

impl Watchdog {
    /// Tells the thread to stop (after one last cleanup round when
    /// orphans are pending) and returns it with how long to wait for it:
    /// [`STOP_WAIT`], plus one I/O timeout for that round. `None` when it
    /// never started or was stopped already.
    pub(crate) fn stop(&self) -> Option<(Worker, Duration)> {
        let (thread, cleaning) = {
            let mut registry = self.shared.registry.lock();
            registry.shutdown = true;
            registry.shutdown_at = Some(Instant::now());
            self.shared.changed.notify_all();
            (
                registry.thread.take(),
                !registry.orphans.is_empty() || registry.cleaning > 0,
            )
        };
        // With failed acquisitions still to clean up, the thread makes one
        // last round (within one I/O timeout) before it ends: a program
        // that exits right after an error leaves no lease behind.
        let wait = if cleaning {
            STOP_WAIT.saturating_add(self.shared.backend.timeout())
        } else {
            STOP_WAIT
        };
        thread.map(|thread| (thread, wait))
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if let Some((thread, wait)) = self.stop() {
            thread.stop_within(wait);
        }
    }
}

/// The thread's last act at shutdown: one cleanup round for the orphans
/// still pending, within one I/O timeout of the client's letting go (a
/// renewal or cleanup under way then has already taken some of it).
fn finish(shared: &Shared, mut registry: parking_lot::MutexGuard<'_, Registry>) {
    let last: Vec<Orphan> = registry.orphans.drain(..).collect();
    let timeout = shared.backend.timeout();
    let budget = registry
        .shutdown_at
        .and_then(|at| at.checked_add(timeout))
        .map_or(timeout, |end| end.saturating_duration_since(Instant::now()));
    drop(registry);
    if !last.is_empty() && budget >= Duration::from_millis(1) {
        clean_orphans(shared, last, budget);
    }
}

fn run(shared: &Shared) {
    loop {
        let look;
        let (entries, orphans) = {
            let mut registry = shared.registry.lock();
            while registry.entries.is_empty() && registry.orphans.is_empty() && !registry.shutdown {
                let mut checks = shared.checks.lock();
                if !checks.list.is_empty() {
                    break;
                }
                // Asleep with no deadline: the next check wakes it.
                checks.wake_at = None;
                drop(checks);
                shared.changed.wait(&mut registry);
            }
            if registry.shutdown {
                return finish(shared, registry);
            }
            let now = Instant::now();
            let checked = due_checks(shared, now);
            look = checked.look;
            registry.orphans.extend(checked.orphans);
            let (due, later): (Vec<Orphan>, Vec<Orphan>) =
                registry.orphans.drain(..).partition(|o| o.next <= now);
            registry.orphans = later;
            registry.cleaning = due.len();
            (registry.entries.clone(), due)
        };
        let mut next = renew_due(shared, &entries);
        {
            // Let go during the renewals: the last round now, within what
            // is left of its timeout.
            let mut registry = shared.registry.lock();
            if registry.shutdown {
                registry.orphans.extend(orphans);
                return finish(shared, registry);
            }
        }
        if look {
            // After the renewals, and bounded like a cleanup round.
            let budget = entries
                .iter()
                .filter_map(|entry| entry.left())
                .min()
                .map_or(IDLE, |left| left / 4)
                .max(Duration::from_millis(10));
            shared.backend.settle_idle(budget);
        }
        if !orphans.is_empty() {
            let budget = next
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(10));
            let orphans = clean_orphans(shared, orphans, budget);
            let mut registry = shared.registry.lock();
            for orphan in &orphans {
                next = next.min(orphan.next);
            }
            registry.orphans.extend(orphans);
        }
        shared.registry.lock().cleaning = 0;
        let mut registry = shared.registry.lock();
        registry.entries.retain(|entry| !entry.state.lock().stopped);
        for orphan in &registry.orphans {
            next = next.min(orphan.next);
        }
        if registry.shutdown {
            return finish(shared, registry);
        }
        // Planned under the checks' lock and slept on under the registry's,
        // which a check that must wake the thread takes to notify: none is
        // missed between the two.
        let sleep_until = {
            let mut checks = shared.checks.lock();
            if let Some(due) = checks.list.iter().map(|check| check.due).min() {
                next = next.min(due);
            }
            let sleep_until = next.min(Instant::now() + IDLE);
            checks.wake_at = Some(sleep_until);
            sleep_until
        };
        shared.changed.wait_until(&mut registry, sleep_until);
    }
}

/// What one due renewal sends.
struct Due {
    entry: Arc<WatchEntry>,
    ttl: Duration,
    generation: u64,
    /// What the lease has left: the call must not outlast it.
    left: Duration,
    /// On a cluster, its key's slot.
    slot: Option<Slot>,
}

/// The most threads one renewal round uses on a cluster, its own included.
const MAX_GROUP_THREADS: usize = 8;

/// Renews the entries that are due; returns when to look again.
///
/// On one server, one pipeline. On a cluster, one pipeline per node, the
/// nodes in parallel ([`group_by_node`]), each within its own leases'
/// shortest time left: a node that stalls delays only its own leases'
/// renewals, and a failed node's renewals are tried again without the
/// others'. Whatever the deployment, a round lasts at most the shortest
/// renewal period among the watched leases (a third of the shortest ttl),
/// so a slow round never makes another lease miss its next renewal; a
/// renewal cut short is tried again (it is owner-checked and safe twice).
fn renew_due(shared: &Shared, entries: &[Arc<WatchEntry>]) -> Instant {
    let now = Instant::now();
    let mut next = now + IDLE;
    let mut due: Vec<Due> = Vec::new();
    let mut shortest_period = Duration::MAX;
    let cluster = shared.backend.deployment() == Deployment::Cluster;
    for entry in entries {
        let mut state = entry.state.lock();
        if state.stopped {
            continue;
        }
        if entry.loss.reason().is_some() {
            // Ran out while the last renewal was failing.
            state.stopped = true;
            continue;
        }
        let left = remaining(state.sent, state.ttl, now);
        if state.cap.is_some_and(|cap| now >= cap) {
            // No more renewals: the lease runs out, and says why.
            entry
                .loss
                .expire_part_at(entry.renewal.part(), state.end(), LossReason::MaxHold);
            next = next.min(state.end());
            continue;
        }
        let period = state.ttl / 3;
        shortest_period = shortest_period.min(period);
        let due_at = state.sent + period;
        // Renewals due soon ride along with those due now.
        if now + period / 8 >= due_at {
            due.push(Due {
                entry: entry.clone(),
                ttl: state.ttl,
                generation: state.generation,
                left,
                slot: cluster.then(|| Slot::for_key(&*entry.key)),
            });
        } else {
            next = next.min(due_at);
        }
    }
    if due.is_empty() {
        return next;
    }
    // The round ends within the shortest renewal period, however many
    // groups wait for a thread.
    let round_ends = Instant::now().checked_add(shortest_period);
    let mut groups = if cluster {
        group_by_node(shared, due)
    } else {
        vec![due]
    };
    if let [group] = groups.as_slice() {
        return next.min(renew_group(shared, group, round_ends, cluster));
    }
    // The most urgent first, should there be more groups than threads.
    groups.sort_by_key(|group| group.iter().map(|d| d.left).min());
    let taken = AtomicUsize::new(0);
    let soonest = Mutex::new(next);
    let work = || {
        // Bounded: each pass takes a group, and there are so many.
        while let Some(group) = groups.get(taken.fetch_add(1, Ordering::Relaxed)) {
            let at = renew_group(shared, group, round_ends, cluster);
            let mut soonest = soonest.lock();
            *soonest = (*soonest).min(at);
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..groups.len().min(MAX_GROUP_THREADS) {
            // Without a thread, the groups are renewed by those there are.
            let _ = crate::conn::worker::without_signals(|| {
                std::thread::Builder::new()
                    .name(THREAD_NAME.into())
                    .spawn_scoped(scope, work)
            });
        }
        work();
    });
    soonest.into_inner()
}

/// Due renewals on a cluster, grouped by the node their slot's renewals
/// last went to; a slot not seen yet is a group of its own. The grouping
/// is only a guess (a slot may have moved since): each command is still
/// routed by redis-rs by its key, and a pipeline that meets `MOVED` sends
/// that command alone.
fn group_by_node(shared: &Shared, due: Vec<Due>) -> Vec<Vec<Due>> {
    let nodes = shared.nodes.lock();
    let mut groups: Vec<(Result<u64, Slot>, Vec<Due>)> = Vec::new();
    for d in due {
        let Some(slot) = d.slot else {
            groups.push((Err(Slot::for_key("")), vec![d]));
            continue;
        };
        let by = nodes.get(&slot).copied().ok_or(slot);
        match groups.iter_mut().find(|(known, _)| *known == by) {
            Some((_, group)) => group.push(d),
            None => groups.push((by, vec![d])),
        }
    }
    groups.into_iter().map(|(_, group)| group).collect()
}

/// Renews one group in one pipeline, within its shortest lease's time
/// left and the round's end; returns when to look again for its leases.
fn renew_group(
    shared: &Shared,
    due: &[Due],
    round_ends: Option<Instant>,
    cluster: bool,
) -> Instant {
    let now = Instant::now();
    let mut next = now + IDLE;
    let Some(budget) = due.iter().map(|d| d.left).min() else {
        return next;
    };
    let budget = round_ends.map_or(budget, |end| budget.min(end.saturating_duration_since(now)));
    if budget.is_zero() {
        // The round is over: in the next one.
        return now + RETRY;
    }
    let sent = Instant::now();
    // Cleared: a pipeline never sent leaves nothing to learn from.
    let _ = script::take_routes();
    let result = renew(shared, due, budget);
    if cluster {
        // Where each renewal went, for the next round's grouping; after a
        // failure only the first (the pipeline went to its node), the
        // others grouped afresh, so a failed group is split.
        let routes = script::take_routes();
        let mut nodes = shared.nodes.lock();
        for (i, d) in due.iter().enumerate() {
            let Some(slot) = d.slot else { continue };
            match routes.get(i).copied().filter(|node| *node != 0) {
                Some(node) => {
                    nodes.insert(slot, node);
                }
                None if result.is_err() => {
                    nodes.remove(&slot);
                }
                None => {}
            }
        }
    }
    match result {
        Ok(replies) => {
            for (d, reply) in due.iter().zip(replies) {
                let reply = reply.and_then(|value| Ok(redis::from_redis_value::<i64>(value)?));
                let failed = u64::from(
                    reply
                        .as_ref()
                        .is_err_and(|err| err.code() != Some("WRONGTYPE")),
                );
                shared.stats.renewals_of(d.entry.tag, 1, failed);
                match reply {
                    Ok(reply) => match script::owner_checked(reply) {
                        Ok(()) => {
                            d.entry.renewed(sent, d.ttl, d.generation);
                            next = next.min(sent + d.ttl / 3);
                        }
                        Err(reason) => d.entry.lost(reason),
                    },
                    // This key alone holds something else now: taken.
                    Err(err) if crate::error::server_code(&err) == Some("WRONGTYPE") => {
                        d.entry.lost(LossReason::OwnedByOther);
                    }
                    Err(err) => {
                        log::warn!("redmutex: renewing {:?} failed: {err}", d.entry.key);
                        next = next.min(Instant::now() + RETRY);
                    }
                }
            }
        }
        Err(err) => {
            log::warn!("redmutex: watchdog renewal failed: {err}");
            for d in due {
                shared.stats.renewals_of(d.entry.tag, 1, 1);
            }
            next = next.min(Instant::now() + RETRY);
        }
    }
    next
}

/// One pipeline of owner-checked renewals (`lua/extend.lua`, or the
/// permit's, reentrant lock's or read-write holder's script, by EVALSHA), within `budget`, resent
/// on a fresh connection after a lost reply. On a cluster, split by slot
/// ([`script::pipelined`]): one round trip per slot, all to one node when
/// the grouping was right.
fn renew(
    shared: &Shared,
    due: &[Due],
    budget: Duration,
) -> Result<Vec<redis::RedisResult<redis::Value>>, Error> {
    let calls: Vec<redis::Cmd> = due
        .iter()
        .map(|d| {
            // Every script answers as extend.lua does: 1 renewed, 0 gone,
            // -1 another owner's (a permit cannot be another's).
            let (script, code) = match &d.entry.renewal {
                Renewal::Plain => (&script::EXTEND, None),
                Renewal::Permit => (&script::SEM_EXTEND, None),
                Renewal::Reentrant => (&script::REENTRANT_EXTEND, None),
                Renewal::Rw { write } => (&script::RW_EXTEND, Some(if *write { "w" } else { "r" })),
                Renewal::Multi(_) => (&script::MULTI_EXTEND, None),
            };
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(script.get_hash());
            match &d.entry.renewal {
                Renewal::Multi(part) => {
                    cmd.arg(part.keys.len());
                    for key in part.keys.iter() {
                        cmd.arg(&**key);
                    }
                }
                _ => {
                    cmd.arg(1).arg(&*d.entry.key);
                }
            }
            cmd.arg(&*d.entry.token);
            if let Some(code) = code {
                cmd.arg(code);
            }
            cmd.arg(u64::try_from(d.ttl.as_millis()).unwrap_or(u64::MAX));
            cmd
        })
        .collect();
    let key = due.first().map_or("", |d| &*d.entry.key);
    shared.stats.renewal_batch(calls.len() as u64);
    policy::run_within(
        &shared.backend,
        &shared.stats,
        Op::Renew,
        key,
        budget,
        |con, _| {
            // The client is gone: a renewal sent again after a lost reply
            // (or not sent yet) is not worth the thread's outliving it by
            // a resend window; the lease runs out in Redis.
            if shared.registry.lock().shutdown {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::Client,
                    "the client was dropped",
                )));
            }
            script::pipelined(
                con,
                &calls,
                &[
                    &script::EXTEND,
                    &script::SEM_EXTEND,
                    &script::REENTRANT_EXTEND,
                    &script::RW_EXTEND,
                    &script::MULTI_EXTEND,
                ],
                &shared.stats,
            )
        },
    )
}

/// One round of cleanups, pipelined; returns the orphans to look at again.
fn clean_orphans(shared: &Shared, mut orphans: Vec<Orphan>, budget: Duration) -> Vec<Orphan> {
    let calls: Vec<redis::Cmd> = orphans.iter().map(cleanup_call).collect();
    let key = orphans.first().map_or("", |o| &*o.key);
    shared.stats.commands(calls.len() as u64);
    // Every script a cleanup may send: reloaded after a SCRIPT FLUSH.
    let scripts: [&redis::Script; 4] = [
        &script::RELEASE,
        &script::REENTRANT_RELEASE,
        &script::RW_RELEASE,
        &script::SEM_RELEASE,
    ];
    let result = policy::run_within(
        &shared.backend,
        &shared.stats,
        Op::Cleanup,
        key,
        budget,
        |con, send| {
            // After the client let go, no resend: the thread ends within
            // one timeout (the lease runs out in Redis at worst).
            if send.resend && shared.registry.lock().shutdown {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::Client,
                    "the client was dropped",
                )));
            }
            script::pipelined(con, &calls, &scripts, &shared.stats)
        },
    );
    let now = Instant::now();
    match result {
        Ok(replies) => {
            for (orphan, reply) in orphans.iter_mut().zip(replies) {
                if reply.is_ok() {
                    orphan.answered(now);
                }
                match reply {
                    Ok(reply) if cleaned(&reply) => {
                        shared.stats.orphan_released();
                        log::debug!("redmutex: released an orphan lease of {:?}", orphan.key);
                    }
                    Ok(_) => {}
                    // Refused for good (the key holds another type, an
                    // ACL): asking again would meet the same answer.
                    Err(err) if policy::refusal(&err) => {
                        log::warn!("redmutex: cannot clean up {:?}: {err}", orphan.key);
                        orphan.until = now;
                    }
                    Err(err) => {
                        if err.is_io_error() || err.is_timeout() || err.is_connection_dropped() {
                            orphan.unreached(now);
                        }
                        log::debug!("redmutex: cleanup of {:?} failed: {err}", orphan.key)
                    }
                }
            }
        }
        Err(err) => {
            // Redis out of reach (no connection, or the reply lost), not a
            // round cut short by its own budget.
            if matches!(err, Error::Pool(_) | Error::OutcomeUnknown { .. }) {
                for orphan in &mut orphans {
                    orphan.unreached(now);
                }
            }
            log::debug!("redmutex: orphan cleanup failed, trying again: {err}")
        }
    }
    for orphan in &mut orphans {
        orphan.stepped(now);
    }
    // Watched until the window ends, then forgotten.
    orphans.retain(|o| now < o.until);
    orphans
}

/// The owner-checked release of what an orphan's request may have left,
/// without a marker (nobody awaits its answer).
fn cleanup_call(orphan: &Orphan) -> redis::Cmd {
    let channel = &*orphan.channel;
    let unmarked = |what, token: &str| {
        script::wire::command(&script::release_unmarked(
            what,
            &orphan.key,
            token,
            channel,
            orphan.sharded,
            false,
        ))
    };
    match &orphan.kind {
        OrphanKind::Plain { token } => unmarked(Unmarked::Lock, token),
        OrphanKind::Permit { id } => unmarked(Unmarked::Permit, id),
        OrphanKind::Reentrant { owner, hold } => {
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(script::REENTRANT_RELEASE.get_hash())
                .arg(1)
                .arg(&*orphan.key)
                .arg(owner)
                .arg(hold)
                .arg(1)
                .arg(channel);
            if orphan.sharded {
                cmd.arg(script::SHARDED);
            }
            cmd
        }
        OrphanKind::Rw { token } => {
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(script::RW_RELEASE.get_hash())
                .arg(1)
                .arg(&*orphan.key)
                .arg(token)
                .arg("x")
                .arg(channel)
                .arg(1);
            if orphan.sharded {
                cmd.arg(script::SHARDED);
            }
            cmd
        }
    }
}

/// Whether a cleanup's reply says it removed something: 1 (or, from
/// `lua/release.lua`, n + 3), alone or first.
fn cleaned(reply: &redis::Value) -> bool {
    let first = match reply {
        redis::Value::Array(items) => items.first(),
        other => Some(other),
    };
    // 1 from every release script; `lua/release.lua` also answers n + 3
    // for a release whose message reached n subscribers.
    matches!(first, Some(redis::Value::Int(n)) if *n == 1 || *n >= 3)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::policy::marker_ttl;

    fn orphan(window: Duration) -> Orphan {
        let token: Arc<str> = Arc::from("t");
        Orphan::new("k", "c", OrphanKind::Plain { token }, window)
    }

    /// The cleanup steps of one orphan: at once, then 50 ms, doubling to
    /// 1 s (docs/failure-model.md's bounds).
    #[test]
    fn cleanups_step_from_50_ms_doubling_to_1_s() {
        let mut o = orphan(Duration::from_secs(1));
        let start = Instant::now();
        assert!(o.next <= start, "the first cleanup at once");
        let mut now = start;
        let mut steps = Vec::new();
        for _ in 0..8 {
            o.stepped(now);
            steps.push(o.next - now);
            now = o.next;
        }
        let ms: Vec<u128> = steps.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, vec![50, 100, 200, 400, 800, 1000, 1000, 1000]);
    }

    /// An orphan is cleaned up for the marker's life (three timeouts, at
    /// least 1 s, at most 24 h) after the error, a whole window again after
    /// a cleanup that could not reach Redis and after the first answer
    /// that follows, and never past 600 s from the error.
    #[test]
    fn an_orphan_is_watched_for_its_window_renewed_while_redis_is_out_of_reach() {
        assert_eq!(
            marker_ttl(Duration::from_millis(200)),
            Duration::from_secs(1)
        );
        assert_eq!(marker_ttl(Duration::from_secs(2)), Duration::from_secs(6));
        assert_eq!(
            marker_ttl(Duration::from_secs(3600)),
            Duration::from_secs(3 * 3600)
        );
        assert_eq!(
            marker_ttl(Duration::from_secs(40_000)),
            Duration::from_secs(24 * 3600)
        );
        let window = marker_ttl(Duration::from_secs(2));
        let mut o = orphan(window);
        let created = o.until - window;
        // Answered with nothing unreached before: the window stays.
        o.answered(created + Duration::from_secs(5));
        assert_eq!(o.until, created + window);
        // Out of reach at 5 s: a whole window from then.
        let at = created + Duration::from_secs(5);
        o.unreached(at);
        assert_eq!(o.until, at + window);
        // The first answer after it, at 9 s: a whole window from then; the
        // next answer changes nothing.
        let answered = created + Duration::from_secs(9);
        o.answered(answered);
        assert_eq!(o.until, answered + window);
        o.answered(answered + Duration::from_secs(1));
        assert_eq!(o.until, answered + window);
        // Never past 600 s from the error, however long Redis stays away.
        o.unreached(created + Duration::from_secs(598));
        assert_eq!(o.until, created + ORPHAN_MAX_LIFE);
    }
}
