//! `ReentrantLock`: the hold count kept in Redis, in a hash whose field is
//! the owner (the article "Distributed locks by Redis", as Redisson does it).

use std::cell::{Cell, RefCell};
use std::convert::Infallible;
use std::marker::PhantomData;
use std::rc::Rc;

use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::client::LockClient;
use crate::client::holder::named_holder;
use crate::client::options::{ReentrantOptions, WaitMode, check_min_replicas, ttl_millis};
use crate::client::release;
use crate::client::replicas;
use crate::conn::backend::Connection;
use crate::conn::policy::Op;
use crate::conn::stats::{LockKind, Tag};
use crate::error::{Error, LossReason};
use crate::fork::Birth;
use crate::lease::loss::{LossSignal, LossState};
use crate::lease::{Unlocked, remaining};
use crate::renew::watchdog::{OrphanKind, Renewal, WatchEntry};
use crate::script;
use crate::wait::acquire::{Attempt, Contender, Queued, Waiting, Within, acquire, blocking};
use crate::wait::queue::Queues;

/// This process's part of every owner id: one UUID per process, so any
/// `LockClient` of a thread re-enters what the thread holds. Made again in
/// a forked child (see `conn/fork.rs`): a child with its parent's id would
/// re-enter, as its own, a lock its parent holds.
static PROCESS_ID: Mutex<Option<(Birth, Arc<str>)>> = Mutex::new(None);

/// Numbers threads in the order they first use a reentrant lock; never
/// reused within the process (a `ThreadId` has no stable numeric form).
static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static THREAD_NUMBER: u64 = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
}

thread_local! {
    /// This thread's copy of [`PROCESS_ID`]: the shared one is locked
    /// only on a thread's first call, and again after a fork.
    static PROCESS_ID_HERE: std::cell::RefCell<Option<(Birth, Arc<str>)>> =
        const { std::cell::RefCell::new(None) };
}

/// This process's id, made when first asked for in this process.
fn process_id() -> Arc<str> {
    let cached = PROCESS_ID_HERE
        .try_with(|here| {
            here.try_borrow().ok().and_then(|here| {
                here.as_ref()
                    .filter(|(birth, _)| birth.is_current())
                    .map(|(_, id)| id.clone())
            })
        })
        .ok()
        .flatten();
    if let Some(id) = cached {
        return id;
    }
    let id = {
        let mut shared = PROCESS_ID.lock();
        match &*shared {
            Some((birth, id)) if birth.is_current() => id.clone(),
            _ => {
                let fresh: Arc<str> = uuid::Uuid::new_v4().to_string().into();
                *shared = Some((Birth::now(), fresh.clone()));
                fresh
            }
        }
    };
    let _ = PROCESS_ID_HERE.try_with(|here| {
        if let Ok(mut here) = here.try_borrow_mut() {
            *here = Some((Birth::now(), id.clone()));
        }
    });
    id
}

/// One key this thread holds through live [`ReentrantGuard`]s of one
/// client.
struct Holding {
    client: u64,
    key: String,
    guards: u32,
    /// Shared by those guards: a loss one of them finds (its extension
    /// met another owner, or the key gone) is the hold's, so every guard
    /// of it reads it.
    loss: Arc<LossState>,
    /// Its live guards taken with the watchdog on.
    watchers: u32,
    /// The watchdog's entry renewing the hold, while a guard taken with the
    /// watchdog on lives.
    watch: Option<Arc<WatchEntry>>,
}

thread_local! {
    /// The keys this thread holds, and their guards: a thread re-entering
    /// a key it holds must never queue behind the key's waiters (the head
    /// would wait for a release this thread makes only after its own
    /// acquire returns).
    static HOLDING: RefCell<Vec<Holding>> = const { RefCell::new(Vec::new()) };
}

/// Whether this thread holds `key` through a live guard (of any client:
/// the owner id is the thread's, so a re-entry through another client
/// must not queue either).
fn holding(key: &str) -> bool {
    HOLDING
        .try_with(|held| {
            held.try_borrow()
                .is_ok_and(|held| held.iter().any(|h| h.key == key))
        })
        .unwrap_or(false)
}

/// One more guard of `key` on this thread through `client`: the loss
/// state its hold shares, and, for a guard taken with the watchdog
/// (`watched`), the watchdog's entry renewing the hold (made by `start`,
/// with the hold's loss state, when no watched guard of the hold has one
/// yet); and an entry of a lost hold to stop.
fn hold_on(
    client: u64,
    key: &str,
    watched: bool,
    start: impl FnOnce(&Arc<LossState>) -> Arc<WatchEntry>,
) -> (
    Arc<LossState>,
    Option<Arc<WatchEntry>>,
    Option<Arc<WatchEntry>>,
) {
    let mut ended = None;
    let mut start = Some(start);
    let mut watch = |loss: &Arc<LossState>| start.take().map(|start| start(loss));
    let held = HOLDING.try_with(|held| {
        let Ok(mut held) = held.try_borrow_mut() else {
            return None;
        };
        if let Some(h) = held.iter_mut().find(|h| h.client == client && h.key == key) {
            // A hold already found lost starts afresh: this acquisition
            // was granted by Redis just now (and the lost hold's renewals
            // are over).
            if h.loss.reason().is_some() {
                h.loss = Arc::default();
                ended = h.watch.take();
            }
            h.guards = h.guards.saturating_add(1);
            if !watched {
                return Some((h.loss.clone(), None));
            }
            h.watchers = h.watchers.saturating_add(1);
            if h.watch.is_none() {
                h.watch = watch(&h.loss);
            }
            return Some((h.loss.clone(), h.watch.clone()));
        }
        let loss: Arc<LossState> = Arc::default();
        let entry = if watched { watch(&loss) } else { None };
        held.push(Holding {
            client,
            key: key.to_owned(),
            guards: 1,
            watchers: u32::from(watched),
            loss: loss.clone(),
            watch: entry.clone(),
        });
        Some((loss, entry))
    });
    match held {
        Ok(Some((loss, entry))) => (loss, entry, ended),
        // No thread-local table (a thread being torn down): a hold of its
        // own.
        _ => {
            let loss: Arc<LossState> = Arc::default();
            let entry = if watched { watch(&loss) } else { None };
            (loss, entry, ended)
        }
    }
}

/// What one guard fewer means for the hold's renewals.
enum Renewals {
    /// They go on (or there are none).
    Go,
    /// The last watched guard went, the hold lives on: renewals stop.
    Stop(Arc<WatchEntry>),
    /// The hold's last guard went: its release follows.
    End(Arc<WatchEntry>),
}

/// One guard of `key` through `client` fewer on this thread (`watched`:
/// one taken with the watchdog).
fn hold_off(client: u64, key: &str, watched: bool) -> Renewals {
    HOLDING
        .try_with(|held| {
            let Ok(mut held) = held.try_borrow_mut() else {
                return Renewals::Go;
            };
            let Some(at) = held.iter().position(|h| h.client == client && h.key == key) else {
                return Renewals::Go;
            };
            if held.get(at).is_some_and(|h| h.guards <= 1) {
                return match held.swap_remove(at).watch {
                    Some(entry) => Renewals::End(entry),
                    None => Renewals::Go,
                };
            }
            let Some(h) = held.get_mut(at) else {
                return Renewals::Go;
            };
            h.guards -= 1;
            if watched {
                h.watchers = h.watchers.saturating_sub(1);
                if h.watchers == 0
                    && let Some(entry) = h.watch.take()
                {
                    return Renewals::Stop(entry);
                }
            }
            Renewals::Go
        })
        .unwrap_or(Renewals::Go)
}

/// The reentrant lock's state in one client: its wait queues, apart from
/// plain locks of the same name. Nothing is ever handed over (a hold is
/// its owner thread's).
#[derive(Default)]
struct Local {
    queues: Queues<Infallible>,
}

impl std::fmt::Debug for Local {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Local").finish_non_exhaustive()
    }
}

/// The owner id of the calling thread: `<process uuid>:<thread number>`.
fn current_owner() -> String {
    // In a thread-local destructor the number may be gone: a fresh one
    // still names no other live thread.
    let thread = THREAD_NUMBER
        .try_with(|n| *n)
        .unwrap_or_else(|_| NEXT_THREAD.fetch_add(1, Ordering::Relaxed));
    format!("{}:{thread}", process_id())
}

/// A reentrant lock whose holds live in Redis: the key is a hash whose
/// field `owner` names the holder (`<process uuid>:<thread id>`), with one
/// field `h:<hold id>` per hold. Acquiring adds this hold's field and
/// refreshes the lease; releasing removes it, and deletes the key when no
/// hold is left. (A field per hold rather than a counter: a request sent
/// again after its reply was lost cannot count a hold twice, nor release
/// one twice.)
///
/// Pick it over [`DistributedLock`](crate::DistributedLock)'s thread-local
/// reentrancy when the holds must be visible in Redis (`HGETALL key` shows
/// who holds it and how deeply), or when a thread re-enters through another
/// [`LockClient`] (the owner id is per process and thread, not per client).
/// The price: every nested acquire and release is a round trip, where the
/// thread-local counter sends nothing. Waiting is as the plain lock's in
/// [`WaitMode::Notify`](crate::WaitMode::Notify) (the client's default:
/// waiting threads of a client queue up, the head sleeps until the
/// release message that deleting the key publishes, never longer than the
/// holder's ttl or a backoff step), without handoff: a hold is its owner
/// thread's. A thread that holds the key re-enters at once, never behind
/// the queue.
///
/// ```no_run
/// use redmutex::Lease;
///
/// # fn main() -> Result<(), redmutex::Error> {
/// let client = redmutex::LockClient::open("redis://127.0.0.1:6379/")?;
/// let lock = redmutex::ReentrantLock::new(&client, "accounts:42");
/// let outer = lock.lock()?;          // HSET owner <id> h:<hold 1> 1
/// let inner = lock.lock()?;          // HSET h:<hold 2> 1, lease refreshed
/// assert_eq!(inner.depth(), 2);
/// assert_eq!(inner.unlock()?, redmutex::Unlocked::StillHeld);
/// assert_eq!(outer.unlock()?, redmutex::Unlocked::Released);
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct ReentrantLock {
    client: LockClient,
    local: Arc<Local>,
    key: String,
    options: ReentrantOptions,
}

impl ReentrantLock {
    /// A reentrant lock on `key` with the client's default options (their
    /// core: [`Options`](crate::Options)).
    pub fn new(client: &LockClient, key: impl Into<String>) -> ReentrantLock {
        ReentrantLock::with_options(client, key, client.defaults().for_reentrant())
    }

    /// A reentrant lock on `key` with the given options.
    pub fn with_options(
        client: &LockClient,
        key: impl Into<String>,
        options: ReentrantOptions,
    ) -> ReentrantLock {
        ReentrantLock {
            client: client.clone(),
            local: client.local::<Local>(),
            key: client.names().own_key(key.into()),
            options,
        }
    }

    /// The lock key (a hash) as it is in Redis, the client's key prefix
    /// included.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The options it is taken with (read as `lock.options().ttl`).
    pub fn options(&self) -> &ReentrantOptions {
        &self.options
    }

    /// Who holds the key now, by the server's clock, read in one step
    /// (`lua/inspect.lua`: one round trip, atomic, never a token's secret):
    /// the lock type found ([`LockKind::Reentrant`](crate::LockKind::Reentrant)), the time left, the owner's holds and the
    /// holders' metadata ([`Holder`](crate::Holder)). `None` when it is
    /// free. A key held by another lock type of this crate is reported as
    /// that type. Changes nothing; a lost reply is asked again.
    ///
    /// # Errors
    ///
    /// [`Error::WrongType`] when the key holds data that is no lock of
    /// this crate; [`Error::InvalidArgument`] for an empty key (or, on
    /// Redis Cluster, a key with `}` and no valid `{tag}`);
    /// [`Error::Redis`] or [`Error::Pool`].
    pub fn status(&self) -> Result<Option<crate::client::list::HeldLock>, Error> {
        if self.key.is_empty() {
            return Err(Error::InvalidArgument(
                "the lock key must not be empty".into(),
            ));
        }
        self.client.status_of(&self.key)
    }

    /// Acquires, waiting up to the options' `wait`.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] after the wait; [`Error::InvalidArgument`] for an
    /// empty key or a bad ttl; [`Error::WrongType`] when the key is not a
    /// reentrant lock (a plain lock's string, a read-write lock's or a
    /// semaphore's hash); [`Error::Redis`] or [`Error::Pool`].
    pub fn lock(&self) -> Result<ReentrantGuard, Error> {
        blocking(&self.key, self.options.wait, |within, seen| {
            self.acquire(within, seen)
        })
    }

    /// One attempt: `Ok(None)` when another owner holds it.
    ///
    /// # Errors
    ///
    /// As [`ReentrantLock::lock`], without [`Error::Timeout`].
    #[must_use = "the guard is the hold: dropping it at once releases it"]
    pub fn try_lock(&self) -> Result<Option<ReentrantGuard>, Error> {
        self.acquire(Within::Once, &mut None)
    }

    /// Attempts until acquired or `wait` has passed.
    ///
    /// # Errors
    ///
    /// As [`ReentrantLock::lock`], without [`Error::Timeout`].
    #[must_use = "the guard is the hold: dropping it at once releases it"]
    pub fn try_lock_for(&self, wait: Duration) -> Result<Option<ReentrantGuard>, Error> {
        self.acquire(Within::For(wait), &mut None)
    }

    /// Attempts until acquired or `deadline` has passed.
    ///
    /// # Errors
    ///
    /// As [`ReentrantLock::lock`], without [`Error::Timeout`].
    #[must_use = "the guard is the hold: dropping it at once releases it"]
    pub fn try_lock_until(&self, deadline: Instant) -> Result<Option<ReentrantGuard>, Error> {
        self.acquire(Within::Until(deadline), &mut None)
    }

    /// This lock's stats tag.
    fn tag(&self) -> Tag {
        Tag {
            kind: LockKind::Reentrant,
            class: self.options.key_class,
        }
    }

    /// `seen`: who held it when the last attempt was refused (a hold id
    /// of theirs, redacted), when the reply named one.
    fn acquire(
        &self,
        within: Within,
        seen: &mut Option<String>,
    ) -> Result<Option<ReentrantGuard>, Error> {
        let started = Instant::now();
        let result = self.acquire_inner(within, seen);
        self.client
            .counters()
            .acquisition(self.tag(), started, result)
    }

    fn acquire_inner(
        &self,
        within: Within,
        seen: &mut Option<String>,
    ) -> Result<Option<ReentrantGuard>, Error> {
        if self.key.is_empty() {
            return Err(Error::InvalidArgument(
                "the lock key must not be empty".into(),
            ));
        }
        let millis = ttl_millis(self.options.ttl)?;
        check_min_replicas(self.options.extra.min_replicas, self.client.timeout())?;
        self.client.check_key(&self.key)?;
        let owner = current_owner();
        let mut contender = Hold {
            lock: self,
            owner: &owner,
            millis,
            seen: None,
        };
        let queue_key = format!("{}\u{0}reentrant", self.key);
        // Named only when a head subscribes: the uncontended path allocates
        // no channel name.
        let subscribe = |waker| {
            self.client
                .subscribe(&self.client.release_channel(&self.key), waker)
        };
        let nothing = |never: Infallible| match never {};
        let waiting = match self.options.wait_mode {
            WaitMode::Spin => Waiting::Spin,
            WaitMode::Notify => Waiting::Queued(Queued {
                queues: &self.local.queues,
                key: &queue_key,
                takes_handoffs: false,
                // A thread that holds the key re-enters at once: queued
                // behind the key's waiters it would wait for itself.
                barge: holding(&self.key),
                intercepts: false,
                on_orphan: &nothing,
                subscribe: &subscribe,
            }),
        };
        let won = acquire(
            &mut contender,
            within.deadline(),
            self.options.backoff,
            waiting,
        );
        *seen = contender.seen.take();
        won
    }
}

/// One acquisition of a [`ReentrantLock`], seen by the acquire loop.
struct Hold<'a> {
    lock: &'a ReentrantLock,
    owner: &'a str,
    millis: u64,
    /// Who held the key when the last attempt was refused (a hold id of
    /// theirs, redacted), when the reply named one.
    seen: Option<String>,
}

impl Contender for Hold<'_> {
    type Won = ReentrantGuard;
    type Gift = Infallible;

    fn attempt(&mut self, _quick: bool) -> Result<Attempt<ReentrantGuard>, Error> {
        let (client, key, owner, millis) = (
            &self.lock.client,
            self.lock.key.as_str(),
            self.owner,
            self.millis,
        );
        // A fresh hold id per attempt: a resend of this request recognises
        // its own field, never another hold's.
        let hold = client.new_token(key)?;
        let extra = &self.lock.options.extra;
        let fence_key = extra.fencing.then(|| client.fence_key(key));
        // Set once Redis granted the hold in this attempt: whatever fails
        // after that (the WAIT, say) leaves a hold to take out again.
        let granted = Cell::new(false);
        let sent = Instant::now();
        client.counters().commands(1);
        let acquired = client.run(Op::ReentrantAcquire, key, |con, send| {
            let connection = replicas::node_connection_id(con, key, extra.min_replicas.is_some())?;
            let mut script = script::REENTRANT_ACQUIRE.key(key);
            if let Some(fence_key) = &fence_key {
                script.key(fence_key);
            }
            let reply: (u32, i64, u64, Option<String>) =
                script.arg(owner).arg(millis).arg(&hold).invoke(con)?;
            if reply.0 == 0 {
                return Ok((reply, None));
            }
            granted.set(true);
            Ok((
                reply,
                self.await_replicas(con, &hold, send.resend, connection)?,
            ))
        });
        let ((count, pttl, fence, holder), short) = acquired
            .map_err(|err| crate::mutex::fence_failure(key, fence_key.as_deref(), err))
            .inspect_err(|err| {
                if granted.get() || err.is_outcome_unknown() {
                    // The hold may have been added: take it out again.
                    client.orphan(
                        key,
                        OrphanKind::Reentrant {
                            owner: owner.to_owned(),
                            hold: hold.clone(),
                        },
                    );
                }
            })?;
        if let (Some(acked), Some((wanted, _))) = (short, extra.min_replicas) {
            return Err(Error::NotReplicated {
                key: key.to_owned(),
                acked,
                wanted,
            });
        }
        if count == 0 {
            // Who holds it, named from the reply; never kept whole.
            self.seen = holder.as_deref().and_then(named_holder);
            return Ok(Attempt::Held(
                u64::try_from(pttl).ok().map(Duration::from_millis),
            ));
        }
        let ttl = Duration::from_millis(millis);
        let tag = self.lock.tag();
        let options = &self.lock.options;
        // One watch entry per hold (this thread's guards of the key through
        // this client): it renews the owner's hash, which every hold of the
        // owner shares.
        let (loss, watch, ended) = hold_on(client.id(), key, options.watchdog, |loss| {
            let cap = options.max_hold.and_then(|cap| sent.checked_add(cap));
            client.watchdog().watch(
                Renewal::Reentrant,
                tag,
                &Arc::from(key),
                &Arc::from(owner),
                sent,
                ttl,
                cap,
                loss.clone(),
            )
        });
        if let Some(entry) = ended {
            client.watchdog().unwatch(&entry);
        }
        Ok(Attempt::Won(ReentrantGuard {
            client: client.clone(),
            key: key.to_owned(),
            owner: owner.to_owned(),
            hold,
            hold_count: count,
            sent,
            ttl,
            released: false,
            tag,
            held_since: Instant::now(),
            loss,
            watch,
            fence: fence_key.is_some().then_some(fence),
            _thread_bound: PhantomData,
        }))
    }

    fn accept(&mut self, gift: Infallible) -> Result<Option<ReentrantGuard>, Error> {
        match gift {}
    }
}

impl Hold<'_> {
    /// With [`ReentrantExtra::min_replicas`](crate::ReentrantExtra::min_replicas):
    /// `WAIT` on the connection that added the hold; when fewer replicas
    /// acknowledged, this hold is released again on that connection and
    /// how many did is returned. After a lost reply (`resend`), the hold
    /// was written on another connection: this one renews the lease first
    /// (owner-checked, `lua/reentrant_extend.lua`), so the `WAIT` counts a
    /// write of it.
    fn await_replicas(
        &self,
        con: &mut Connection,
        hold: &str,
        resend: bool,
        connection: Option<i64>,
    ) -> redis::RedisResult<Option<u32>> {
        let (client, key) = (&self.lock.client, self.lock.key.as_str());
        replicas::await_or_give_back(
            con,
            client.counters(),
            key,
            self.lock.options.extra.min_replicas,
            (resend, connection),
            |con| {
                client.counters().commands(1);
                let _renewed: i64 = script::REENTRANT_EXTEND
                    .key(key)
                    .arg(self.owner)
                    .arg(self.millis)
                    .invoke(con)?;
                Ok(())
            },
            |con| {
                client.counters().commands(1);
                let channel = client.release_channel(key);
                let mut release = script::REENTRANT_RELEASE.key(key);
                release.arg(self.owner).arg(hold).arg(1).arg(&channel);
                if client.sharded(&channel) {
                    release.arg(script::SHARDED);
                }
                let _released: Option<i64> = release.invoke(con)?;
                Ok(())
            },
        )
    }
}

/// One hold of a [`ReentrantLock`]. Dropping it releases that hold (best
/// effort); [`ReentrantGuard::unlock`](crate::Lease::unlock) reports what happened. `!Send`: the
/// owner id names the acquiring thread.
///
/// ```compile_fail
/// fn assert_send<T: Send>() {}
/// assert_send::<redmutex::ReentrantGuard>();
/// ```
#[must_use = "the hold is released as soon as the guard is dropped"]
pub struct ReentrantGuard {
    client: LockClient,
    key: String,
    owner: String,
    /// This hold's own field, `h:<hold>`.
    hold: String,
    hold_count: u32,
    sent: Instant,
    ttl: Duration,
    released: bool,
    /// For the client's stats: the lock type and key class.
    tag: Tag,
    /// When this hold began.
    held_since: Instant,
    /// Set when Redis said the lock is gone or another owner's (an
    /// extension through any guard of this thread's hold): shared by the
    /// thread's guards of the key on this client.
    loss: Arc<LossState>,
    /// The watchdog's entry renewing the hold, when it is watched (shared
    /// by the hold's guards; it then owns the lease's timing).
    watch: Option<Arc<WatchEntry>>,
    /// The owner's fencing token (its first hold's), when the lock fences.
    fence: Option<u64>,
    _thread_bound: PhantomData<Rc<()>>,
}

impl std::fmt::Debug for ReentrantGuard {
    // The owner id and the hold id release the hold: neither is shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReentrantGuard")
            .field("key", &self.key)
            .field("hold_count", &self.hold_count)
            .field("released", &self.released)
            .finish_non_exhaustive()
    }
}

impl ReentrantGuard {
    /// The owner id, the hash field: `<process uuid>:<thread id>`.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// This hold's id: its field in the hash is `h:<id>`.
    pub fn hold_id(&self) -> &str {
        &self.hold
    }

    /// This guard's depth in its owner's hold: the owner's number of holds
    /// in Redis right after this acquisition (1 for the first, 2 for the
    /// first nested one, and so on; holds of the same thread through other
    /// clients count too, as the owner is the thread).
    pub fn depth(&self) -> u32 {
        self.hold_count
    }

    /// When the request that set the lease's current expiry was sent (as
    /// far as this guard knows), and its ttl.
    fn timing(&self) -> (Instant, Duration) {
        match &self.watch {
            Some(entry) => entry.lease(),
            None => (self.sent, self.ttl),
        }
    }

    fn release(&mut self) -> Result<Unlocked, Error> {
        self.released = true;
        let renewals = hold_off(self.client.id(), &self.key, self.watch.is_some());
        // A forked child's copy of its parent's hold: refused, nothing sent
        // (and the watch entry, whose lock a parent thread may have held
        // at the fork, left alone).
        self.client.check_process()?;
        match renewals {
            // Before the release: a renewal in flight that finds the key
            // deleted is then no loss.
            Renewals::End(entry) => self.client.watchdog().end(&entry),
            // The hold goes on unrenewed: its other guards asked for none.
            Renewals::Stop(entry) => self.client.watchdog().unwatch(&entry),
            Renewals::Go => {}
        }
        let result = self.let_go();
        self.client
            .counters()
            .release(self.tag, Some(self.held_since), false, result)
    }

    fn let_go(&mut self) -> Result<Unlocked, Error> {
        let key = self.key.as_str();
        // Redis said this hold is gone or another owner's (through this
        // guard or another of the thread's hold): nothing to release, and
        // never "still held" (a fresh hold of the same owner may be in
        // the hash, which would answer so).
        // A loss by the local clock (Redis unreachable until the lease ran
        // out, the hold cap) is not Redis's word: the owner-checked release
        // is still sent, as Redis may still hold the hash.
        if let Some(reason @ (LossReason::Expired | LossReason::OwnedByOther)) = self.loss.reason()
        {
            return Err(Error::not_held(key, reason));
        }
        let (marker, millis) = release::marker_of(&self.client, key, &self.hold);
        // Waiters of every client learn of the key's deletion from it.
        let channel = self.client.release_channel(key);
        let sharded = self.client.sharded(&channel);
        self.client.counters().commands(1);
        let markerless = Cell::new(marker.is_none());
        let (reply, send) = self
            .client
            .run(Op::ReentrantRelease, key, |con, send| {
                let reply: Option<i64> =
                    release::with_marker(&self.client, marker.as_deref(), &markerless, |marker| {
                        let mut script = script::REENTRANT_RELEASE.key(key);
                        if let Some(marker) = marker {
                            script.key(marker);
                        }
                        script
                            .arg(&self.owner)
                            .arg(&self.hold)
                            .arg(millis)
                            .arg(&channel);
                        if sharded {
                            script.arg(script::SHARDED);
                        }
                        script.invoke(con)
                    })?;
                Ok((reply, send.replied()))
            })
            .inspect_err(|err| {
                if err.may_leave_a_lease() {
                    // Released in the background once Redis answers.
                    self.client.orphan(
                        key,
                        OrphanKind::Reentrant {
                            owner: self.owner.clone(),
                            hold: self.hold.clone(),
                        },
                    );
                }
            })?;
        let answer = match reply {
            Some(1) => Ok(Unlocked::Released),
            Some(0) => Ok(Unlocked::StillHeld),
            // -1 gone; -2 gone, -3 another owner's, the marker unreadable.
            Some(code @ (-3 | -2)) => Err(release::not_held(code, &markerless)),
            Some(_) => Err(LossReason::Expired),
            None => Err(LossReason::OwnedByOther),
        };
        release::check_resend(key, answer, send, !markerless.get(), millis)?
            .map_err(|reason| Error::not_held(key, reason))
    }
}

impl crate::lease::sealed::Sealed for ReentrantGuard {}

impl crate::lease::Lease for ReentrantGuard {
    /// The lock key.
    fn key(&self) -> &str {
        &self.key
    }

    /// The lease left by the local clock since this guard's acquisition or
    /// extension, minus the drift allowance; zero once released or lost.
    /// Later re-entries refresh the lease in Redis, so this is a lower
    /// bound.
    fn validity(&self) -> Duration {
        if self.released || self.is_lost() {
            return Duration::ZERO;
        }
        let (sent, ttl) = self.timing();
        remaining(sent, ttl, Instant::now())
    }

    /// Whether the lock was found lost: an extension through this guard or
    /// another guard of the thread's hold (same key, same client) found
    /// the key gone (the lease ran out) or held by another owner. Always
    /// true in a process forked since it was taken.
    fn is_lost(&self) -> bool {
        self.client.inherited() || self.loss.reason().is_some()
    }

    /// A signal, usable from any thread and after the guard is gone, that
    /// fires when the lock is found lost through this guard.
    fn loss_signal(&self) -> LossSignal {
        LossSignal {
            state: self.loss.clone(),
        }
    }

    fn fencing_token(&self) -> Option<u64> {
        self.fence
    }

    /// Asks Redis whether this owner still holds the lock.
    ///
    /// # Errors
    ///
    /// [`Error::Redis`], [`Error::Pool`] or [`Error::WrongType`].
    fn is_held(&self) -> Result<bool, Error> {
        let key = self.key.as_str();
        self.client.counters().commands(1);
        let owner: Option<String> = self.client.run(Op::Read, key, |con, _| {
            redis::cmd("HGET").arg(key).arg("owner").query(con)
        })?;
        Ok(owner.as_deref() == Some(self.owner.as_str()))
    }

    /// Sets the lease to `ttl` from now if this owner still holds the lock.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a bad ttl; [`Error::NotHeld`] when the
    /// key is gone or another owner holds it (then [`ReentrantGuard::is_lost`](crate::Lease::is_lost)
    /// is true and its loss signal fires); [`Error::Redis`],
    /// [`Error::Pool`] or [`Error::WrongType`].
    fn extend(&mut self, ttl: Duration) -> Result<(), Error> {
        self.client.check_process()?;
        let millis = ttl_millis(ttl)?;
        let key = self.key.as_str();
        let generation = self.watch.as_ref().map(|entry| entry.generation());
        let sent = Instant::now();
        self.client.counters().commands(1);
        let reply: i64 = self.client.run(Op::ReentrantExtend, key, |con, _| {
            script::REENTRANT_EXTEND
                .key(key)
                .arg(&self.owner)
                .arg(millis)
                .invoke(con)
        })?;
        script::owner_checked(reply).map_err(|reason| {
            self.loss.lose(reason);
            Error::not_held(key, reason)
        })?;
        let ttl = Duration::from_millis(millis);
        match &self.watch {
            // The watchdog's entry owns the timing of a watched hold.
            Some(entry) => entry.renewed(sent, ttl, generation.unwrap_or_default()),
            None => {
                self.sent = sent;
                self.ttl = ttl;
            }
        }
        Ok(())
    }

    /// Releases this hold: removes its field, deleting the key when no hold
    /// is left.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] with [`LossReason::OwnedByOther`] when the hash
    /// belongs to another owner (the articles' `nil`), or
    /// [`LossReason::Expired`] when the key is gone;
    /// [`Error::OutcomeUnknown`] when no reply came back even after resends
    /// (the hold may or may not be released; the key expires by its ttl);
    /// [`Error::Redis`], [`Error::Pool`] or [`Error::WrongType`];
    /// [`Error::InvalidArgument`] for a guard inherited through `fork()`
    /// (nothing is sent: the hold is the parent's).
    fn unlock(mut self) -> Result<Unlocked, Error> {
        self.release()
    }
}

impl Drop for ReentrantGuard {
    fn drop(&mut self) {
        // A forked child's copy of its parent's hold: not the child's.
        if self.client.inherited() {
            self.released = true;
        }
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
        assert_eq!(process, &*process_id());
        assert!(thread.parse::<u64>().is_ok(), "{thread}");
        let there = std::thread::spawn(current_owner).join().expect("thread");
        assert_ne!(here, there);
        assert!(there.starts_with(process));
    }
}
