//! `MultiLock`: a set of keys taken together, all or none, as one lease.
//!
//! Each key of the set is a plain lock holding the set's one token, so a
//! [`DistributedLock`](crate::DistributedLock) on any key of the set
//! excludes (and is excluded by) the set, and `redmutex status` shows each
//! key as held. The keys of one hash slot (every key, outside a cluster)
//! are one *part*, taken, extended and released by one script: Redis never
//! holds part of a part. A set over several cluster slots is taken part by
//! part in ascending slot order, the same on every client, holding each
//! part while it waits for the next (so two sets cannot wait for each
//! other in a cycle), and rolled back when the last part cannot be had.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::client::LockClient;
use crate::client::holder::{Redacted, named_holder};
use crate::client::options::{MultiLockOptions, WaitMode, ttl_millis};
use crate::client::release;
use crate::conn::backend::Deployment;
use crate::conn::policy::Op;
use crate::conn::stats::{LockKind, Tag};
use crate::error::{Error, LossReason};
use crate::lease::loss::{LossSignal, LossState};
use crate::lease::remaining;
use crate::renew::watchdog::{MultiPart, OrphanKind, Renewal, WatchEntry};
use crate::script;
use crate::wait::acquire::{Attempt, Contender, Queued, Waiting, Within, acquire, blocking};
use crate::wait::queue::{Feed, Queues, Waker};

/// The most keys one set may have: a script's keys are its arguments,
/// and a set larger than this is better split by the caller.
pub(crate) const MAX_KEYS: usize = 1_000;

/// The multi-locks' state in one client: their local wait queues (one per
/// set), apart from every other lock type's. Nothing is handed over.
#[derive(Default)]
struct Local {
    queues: Queues<Infallible>,
}

impl std::fmt::Debug for Local {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Local").finish_non_exhaustive()
    }
}

/// The keys of one hash slot of a set (every key, outside a cluster).
#[derive(Debug)]
struct Part {
    /// In the set's order; never empty.
    keys: Arc<[Arc<str>]>,
    /// Each key's release channel, in the same order.
    channels: Box<[String]>,
    /// Each key's fencing counter, in the same order.
    counters: Box<[String]>,
    /// Whether releases announce with `SPUBLISH`.
    sharded: bool,
}

impl Part {
    fn first(&self) -> &str {
        self.keys.first().map_or("", |key| key)
    }

    /// Hands the part's keys to the client's cleanup (owner-checked
    /// releases of `token`, key by key, once Redis answers).
    fn orphan(&self, client: &LockClient, token: &Arc<str>) {
        for key in self.keys.iter() {
            client.orphan(
                key,
                OrphanKind::Plain {
                    token: token.clone(),
                },
            );
        }
    }
}

/// A set of keys locked together: all of them or none, as one lease.
///
/// Cheap to clone, `Send` and `Sync`; holds nothing in Redis until
/// acquired. Each key of the set is a plain lock key holding the set's
/// token, so a [`DistributedLock`](crate::DistributedLock) on one of them
/// and a multi-lock over a set containing it exclude each other.
///
/// **All or none.** On one server (and on Redis Cluster for keys that
/// share a hash slot, such as `{account}:a` and `{account}:b`) one script
/// takes every key or none (`lua/multi_acquire.lua`: one round trip
/// uncontended), and one script releases them: no reader of Redis ever
/// sees part of the set held. Across cluster slots the set is taken slot
/// by slot in ascending slot order (the same order on every client, so
/// two multi-locks over overlapping sets never wait for each other in a
/// cycle), each slot's keys at once, and what was taken is released
/// again when the rest cannot be had within the wait: there, a reader can
/// see the first slots held while the acquirer waits for the next.
///
/// The guard, [`MultiGuard`], is one lease over the whole set: its
/// validity is the set's, an extension renews every key or reports the
/// set lost, the watchdog renews it, and the release deletes every key
/// still holding the token (owner-checked).
///
/// Not reentrant: a thread that holds a key of the set (through any lock
/// of this crate) and asks for the set waits for itself until its wait
/// runs out.
///
/// ```no_run
/// use redmutex::{Lease, MultiLock};
///
/// # fn main() -> Result<(), redmutex::Error> {
/// let client = redmutex::LockClient::open("redis://127.0.0.1:6379/")?;
/// // Both accounts, or neither; the order they are named in is irrelevant.
/// let transfer = MultiLock::new(&client, ["accounts:17", "accounts:4"]);
/// let guard = transfer.lock()?;
/// // ... move the money ...
/// guard.unlock()?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct MultiLock {
    client: LockClient,
    local: Arc<Local>,
    /// The set in its order: by slot, then by key, on a cluster; by key
    /// elsewhere. Without repeats.
    keys: Arc<[Arc<str>]>,
    parts: Arc<[Part]>,
    /// The name of the set's local wait queue.
    queue: Arc<str>,
    options: MultiLockOptions,
}

impl MultiLock {
    /// A lock on every key of `keys` (a key named twice counts once), with
    /// the client's default options (their core and fencing:
    /// [`LockOptions::for_multi`](crate::LockOptions::for_multi)). The
    /// keys are checked when the lock is taken.
    pub fn new<I>(client: &LockClient, keys: I) -> MultiLock
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        MultiLock::with_options(client, keys, client.defaults().for_multi())
    }

    /// A lock on every key of `keys` with the given options.
    pub fn with_options<I>(client: &LockClient, keys: I, options: MultiLockOptions) -> MultiLock
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        let cluster = client.deployment() == Deployment::Cluster;
        let mut named: Vec<(u16, String)> = keys
            .into_iter()
            .map(|key| {
                let key = client.names().own_key(key.into());
                // Outside a cluster every key is in "slot 0": one part.
                let slot = if cluster {
                    script::names::slot(&key)
                } else {
                    0
                };
                (slot, key)
            })
            .collect();
        named.sort();
        named.dedup();
        let keys: Arc<[Arc<str>]> = named
            .iter()
            .map(|(_, key)| Arc::from(key.as_str()))
            .collect();
        let mut parts = Vec::new();
        let mut start = 0;
        while start < named.len() {
            let slot = named.get(start).map_or(0, |(slot, _)| *slot);
            let end = named
                .iter()
                .skip(start)
                .position(|(s, _)| *s != slot)
                .map_or(named.len(), |n| start + n);
            let part_keys: Arc<[Arc<str>]> = keys.get(start..end).unwrap_or_default().into();
            let channels: Box<[String]> = part_keys
                .iter()
                .map(|key| client.release_channel(key))
                .collect();
            let counters = part_keys.iter().map(|key| client.fence_key(key)).collect();
            let sharded = channels
                .first()
                .is_some_and(|channel| client.sharded(channel));
            parts.push(Part {
                keys: part_keys,
                channels,
                counters,
                sharded,
            });
            start = end;
        }
        let mut queue = String::from("\u{0}multi");
        for key in keys.iter() {
            queue.push('\u{0}');
            queue.push_str(key);
        }
        MultiLock {
            client: client.clone(),
            local: client.local::<Local>(),
            keys,
            parts: parts.into(),
            queue: queue.into(),
            options,
        }
    }

    /// The keys of the set as they are in Redis (the client's key prefix
    /// included), in the order they are taken: by hash slot, then by key,
    /// on Redis Cluster; by key elsewhere. Without repeats.
    pub fn keys(&self) -> impl ExactSizeIterator<Item = &str> {
        self.keys.iter().map(|key| &**key)
    }

    /// How many parts the set is taken in: one per hash slot on Redis
    /// Cluster, one elsewhere. With one part, the set is taken and
    /// released in one atomic step.
    pub fn parts(&self) -> usize {
        self.parts.len()
    }

    /// The options it is taken with (read as `lock.options().ttl`,
    /// `lock.options().extra.fencing`).
    pub fn options(&self) -> &MultiLockOptions {
        &self.options
    }

    /// Takes every key of the set, waiting up to the options' `wait`
    /// while any of them is held elsewhere: woken by a release of any key
    /// of the set in [`WaitMode::Notify`] (the default), polling with
    /// backoff in [`WaitMode::Spin`]; never sleeping past the deadline,
    /// with one last attempt at it.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when some key stayed held for the whole wait
    /// (nothing of the set is held then); [`Error::InvalidArgument`] for
    /// an empty set, an empty key, more than 1000 keys, a ttl under 1 ms or
    /// over ten years, or (on Redis Cluster) a key with `}` and no valid
    /// `{tag}` (nothing is sent); [`Error::WrongType`] when a key holds a
    /// non-string value (nothing is taken); [`Error::FenceCounter`] when a
    /// fencing counter cannot be incremented; [`Error::Redis`],
    /// [`Error::Pool`] or [`Error::OutcomeUnknown`] when Redis fails (what
    /// may have been taken is released in the background once Redis
    /// answers, or expires).
    pub fn lock(&self) -> Result<MultiGuard, Error> {
        let name = self.keys.first().map_or("", |key| &**key);
        blocking(name, self.options.wait, |within, seen| {
            self.acquire(within, seen)
        })
    }

    /// One attempt: `Ok(None)` when a key of the set is held elsewhere.
    ///
    /// # Errors
    ///
    /// As [`MultiLock::lock`], without [`Error::Timeout`].
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_lock(&self) -> Result<Option<MultiGuard>, Error> {
        self.acquire(Within::Once, &mut None)
    }

    /// Attempts until the set is had or `wait` has passed: `Ok(None)` when
    /// some key stayed held elsewhere.
    ///
    /// # Errors
    ///
    /// As [`MultiLock::lock`], without [`Error::Timeout`].
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_lock_for(&self, wait: Duration) -> Result<Option<MultiGuard>, Error> {
        self.acquire(Within::For(wait), &mut None)
    }

    /// Attempts until the set is had or `deadline` has passed (at least
    /// once, even for a deadline already past).
    ///
    /// # Errors
    ///
    /// As [`MultiLock::lock`], without [`Error::Timeout`].
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_lock_until(&self, deadline: Instant) -> Result<Option<MultiGuard>, Error> {
        self.acquire(Within::Until(deadline), &mut None)
    }

    fn tag(&self) -> Tag {
        Tag {
            kind: LockKind::Multi,
            class: self.options.key_class,
        }
    }

    fn acquire(
        &self,
        within: Within,
        seen: &mut Option<String>,
    ) -> Result<Option<MultiGuard>, Error> {
        let started = Instant::now();
        let result = self.acquire_inner(within, seen);
        self.client
            .counters()
            .acquisition(self.tag(), started, result)
    }

    /// Refuses what cannot be sent, before anything is.
    fn check(&self) -> Result<u64, Error> {
        if self.keys.is_empty() {
            return Err(Error::InvalidArgument(
                "a multi-lock needs at least one key".into(),
            ));
        }
        if self.keys.len() > MAX_KEYS {
            return Err(Error::InvalidArgument(format!(
                "a multi-lock takes at most {MAX_KEYS} keys, not {}",
                self.keys.len()
            )));
        }
        if self.keys.iter().any(|key| key.is_empty()) {
            return Err(Error::InvalidArgument(
                "the lock keys must not be empty".into(),
            ));
        }
        let millis = ttl_millis(self.options.ttl)?;
        for key in self.keys.iter() {
            self.client.check_key(key)?;
        }
        Ok(millis)
    }

    fn acquire_inner(
        &self,
        within: Within,
        seen: &mut Option<String>,
    ) -> Result<Option<MultiGuard>, Error> {
        let millis = self.check()?;
        let deadline = within.deadline();
        let mut contender = Take {
            lock: self,
            token: None,
            millis,
            held: Vec::with_capacity(self.parts.len()),
            seen: None,
        };
        // The head of a set's queue is woken by a release of any key of
        // the set: one subscription per key, live while all are.
        let subscribe = |waker: Waker| {
            let mut feeds = Vec::with_capacity(self.keys.len());
            for part in self.parts.iter() {
                for channel in part.channels.iter() {
                    feeds.push(self.client.subscribe(channel, waker.clone())?);
                }
            }
            Some(Box::new(AllFeeds(feeds)) as Box<dyn Feed>)
        };
        let nothing = |never: Infallible| match never {};
        let waiting = match self.options.wait_mode {
            WaitMode::Spin => Waiting::Spin,
            WaitMode::Notify => Waiting::Queued(Queued {
                queues: &self.local.queues,
                key: &self.queue,
                takes_handoffs: false,
                barge: false,
                intercepts: false,
                on_orphan: &nothing,
                subscribe: &subscribe,
            }),
        };
        let result = acquire(&mut contender, deadline, self.options.backoff, waiting);
        *seen = contender.seen.take();
        if !matches!(result, Ok(Some(_))) {
            // Gave up or failed with the first parts held (a set over
            // several slots): they go back, so nothing of the set stays.
            contender.roll_back();
        }
        result
    }

    /// One part: every key at once, or how long the first key held
    /// elsewhere has left.
    fn take_part(
        &self,
        part: &Part,
        token: &str,
        millis: u64,
        seen: &mut Option<String>,
    ) -> Result<Attempt<Taken>, Error> {
        let first = part.first();
        let fencing = self.options.extra.fencing;
        let sent = Instant::now();
        self.client.counters().commands(1);
        let reply = self.client.run(Op::MultiAcquire, first, |con, _| {
            let mut script = script::MULTI_ACQUIRE.prepare_invoke();
            for key in part.keys.iter() {
                script.key(&**key);
            }
            if fencing {
                for counter in part.counters.iter() {
                    script.key(counter);
                }
            }
            let reply: (i64, i64, i64, Option<String>, Vec<u64>) = script
                .arg(token)
                .arg(millis)
                .arg(part.keys.len())
                .arg(if fencing { "1" } else { "0" })
                .invoke(con)?;
            Ok(reply)
        });
        let counter = fencing.then(|| part.counters.first().map_or("", |c| c.as_str()));
        let (acquired, pttl, _index, holder, fences) = reply
            .map_err(|err| crate::mutex::fence_failure(first, counter, err))
            .inspect_err(|err| {
                if err.may_leave_a_lease() || err.is_connection() {
                    // The script may have run: its keys hold our token
                    // until the cleanup takes them out.
                    part.orphan(&self.client, &Arc::from(token));
                }
            })?;
        if acquired != 1 {
            // Who holds it, named from the reply; never kept whole.
            *seen = holder.as_deref().and_then(named_holder);
            return Ok(Attempt::Held(
                u64::try_from(pttl).ok().map(Duration::from_millis),
            ));
        }
        Ok(Attempt::Won(Taken {
            sent,
            fences: fencing.then_some(fences),
        }))
    }
}

/// Every subscription of a set's keys: live only while all are.
struct AllFeeds(Vec<Box<dyn Feed>>);

impl Feed for AllFeeds {
    fn is_live(&self) -> bool {
        self.0.iter().all(|feed| feed.is_live())
    }

    fn wait_live(&self, until: Instant) -> bool {
        self.0.iter().all(|feed| feed.wait_live(until))
    }
}

/// A part taken: when its request left, and its keys' fencing tokens.
struct Taken {
    sent: Instant,
    fences: Option<Vec<u64>>,
}

/// One acquisition of a [`MultiLock`], seen by the acquire loop: the parts
/// taken so far, in order.
struct Take<'a> {
    lock: &'a MultiLock,
    /// Made at the first attempt in Redis and kept for the others (a later
    /// attempt recognises keys an earlier one set).
    token: Option<Arc<str>>,
    millis: u64,
    held: Vec<Taken>,
    seen: Option<String>,
}

impl Take<'_> {
    /// Releases the parts taken (owner-checked); a part whose release
    /// fails goes to the cleanup.
    fn roll_back(&mut self) {
        let Some(token) = self.token.clone() else {
            return;
        };
        let held = std::mem::take(&mut self.held);
        for (part, _) in self.lock.parts.iter().zip(held) {
            if let Err(err) = release_part(&self.lock.client, part, &token)
                && !err.is_not_held()
            {
                part.orphan(&self.lock.client, &token);
            }
        }
    }
}

impl Contender for Take<'_> {
    type Won = MultiGuard;
    type Gift = Infallible;

    fn attempt(&mut self, _quick: bool) -> Result<Attempt<MultiGuard>, Error> {
        let lock = self.lock;
        let token = lock
            .client
            .token_once(&mut self.token, lock.keys.first().map_or("", |key| &**key))?;
        // Parts in order, keeping those taken: a set over several slots
        // waits for its next part holding the earlier ones, never the
        // other way round.
        while let Some(part) = lock.parts.get(self.held.len()) {
            match lock.take_part(part, &token, self.millis, &mut self.seen)? {
                Attempt::Won(taken) => self.held.push(taken),
                Attempt::Held(left) => return Ok(Attempt::Held(left)),
            }
        }
        let ttl = Duration::from_millis(self.millis);
        // The earlier parts were taken before the last one, maybe long
        // before (their wait): renewed now, so the set's lease is as fresh
        // as its last part's. A part that ran out meanwhile is lost: the
        // rest goes back and the attempt starts over.
        let last = self.held.len().saturating_sub(1);
        for (i, part) in lock.parts.iter().enumerate().take(last) {
            let sent = Instant::now();
            match extend_part(&lock.client, part, &token, self.millis) {
                Ok(()) => {
                    if let Some(taken) = self.held.get_mut(i) {
                        taken.sent = sent;
                    }
                }
                Err(err) if err.is_not_held() => {
                    self.roll_back();
                    // A fresh token for the next try: a part the roll-back
                    // could not release went to the cleanup, which keeps
                    // releasing this token for a while; a set taken with
                    // it again would be deleted under its guard (and the
                    // roll-back's markers would answer for its release).
                    self.token = None;
                    return Ok(Attempt::Held(Some(Duration::ZERO)));
                }
                Err(err) => return Err(err),
            }
        }
        let held = std::mem::take(&mut self.held);
        Ok(Attempt::Won(MultiGuard::new(lock, token, ttl, held)))
    }

    fn accept(&mut self, gift: Infallible) -> Result<Option<MultiGuard>, Error> {
        match gift {}
    }
}

/// `lua/multi_release.lua` for one part: every key still holding `token`
/// deleted at once.
fn release_part(client: &LockClient, part: &Part, token: &str) -> Result<(), Error> {
    let first = part.first();
    let (marker, millis) = release::marker_of(client, first, token);
    let markerless = std::cell::Cell::new(marker.is_none());
    client.counters().commands(1);
    let ((code, index), send) = client.run(Op::MultiRelease, first, |con, send| {
        let reply: (i64, usize) =
            release::with_marker(client, marker.as_deref(), &markerless, |marker| {
                let mut script = script::MULTI_RELEASE.prepare_invoke();
                for key in part.keys.iter() {
                    script.key(&**key);
                }
                if let Some(marker) = marker {
                    script.key(marker);
                }
                script
                    .arg(token)
                    .arg(part.keys.len())
                    .arg(millis)
                    .arg(if part.sharded { "s" } else { "" });
                for channel in part.channels.iter() {
                    script.arg(channel);
                }
                script.invoke(con)
            })?;
        Ok((reply, send.replied()))
    })?;
    if code == 1 || code == 2 {
        return Ok(());
    }
    let key = index
        .checked_sub(1)
        .and_then(|i| part.keys.get(i))
        .map_or(first, |key| &**key);
    let reason = release::not_held(code, &markerless);
    // "Not held", answered to a resend, proves nothing without a marker.
    let answer = release::check_resend(key, Err::<(), _>(reason), send, !markerless.get(), millis)?;
    answer.map_err(|reason| Error::not_held(key, reason))
}

/// `lua/multi_extend.lua` for one part: every key renewed, or none and the
/// part is not held.
fn extend_part(client: &LockClient, part: &Part, token: &str, millis: u64) -> Result<(), Error> {
    let first = part.first();
    client.counters().commands(1);
    let renewed: i64 = client.run(Op::MultiExtend, first, |con, _| {
        let mut script = script::MULTI_EXTEND.prepare_invoke();
        for key in part.keys.iter() {
            script.key(&**key);
        }
        script.arg(token).arg(millis).invoke(con)
    })?;
    match renewed {
        1 => Ok(()),
        0 => Err(Error::not_held(first, LossReason::Expired)),
        _ => Err(Error::not_held(first, LossReason::OwnedByOther)),
    }
}

/// Proof that this client holds every key of a [`MultiLock`]'s set, as one
/// lease. Dropping it releases the set (best effort, errors logged);
/// [`MultiGuard::unlock`](crate::Lease::unlock) releases and reports.
///
/// `Send` and `Sync`: a multi-lock is not reentrant, so its guard may be
/// released by another thread than the one that took it.
///
/// ```
/// fn assert_send_sync<T: Send + Sync>() {}
/// assert_send_sync::<redmutex::MultiGuard>();
/// ```
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct MultiGuard {
    client: LockClient,
    keys: Arc<[Arc<str>]>,
    parts: Arc<[Part]>,
    token: Arc<str>,
    /// When the request that set the set's current expiry left (the
    /// earliest of its parts'), and its ttl; a watched set's entries own
    /// the timing instead.
    sent: Instant,
    ttl: Duration,
    released: bool,
    tag: Tag,
    held_since: Instant,
    loss: Arc<LossState>,
    /// One entry per part when the watchdog renews the set.
    watch: Vec<Arc<WatchEntry>>,
    /// Each key's fencing token, in the set's order, when it fences.
    fences: Option<Vec<(Arc<str>, u64)>>,
}

impl std::fmt::Debug for MultiGuard {
    // The token is a capability: only its public part is shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultiGuard")
            .field("keys", &self.keys)
            .field("token", &Redacted(&self.token))
            .field("released", &self.released)
            .finish_non_exhaustive()
    }
}

impl MultiGuard {
    fn new(lock: &MultiLock, token: Arc<str>, ttl: Duration, held: Vec<Taken>) -> MultiGuard {
        let sent = held
            .iter()
            .map(|taken| taken.sent)
            .min()
            .unwrap_or_else(Instant::now);
        let fences = lock.options.extra.fencing.then(|| {
            lock.parts
                .iter()
                .zip(&held)
                .flat_map(|(part, taken)| {
                    let fences = taken.fences.clone().unwrap_or_default();
                    part.keys.iter().cloned().zip(fences).collect::<Vec<_>>()
                })
                .collect()
        });
        let loss: Arc<LossState> = Arc::default();
        let tag = lock.tag();
        let options = &lock.options;
        let mut watch = Vec::new();
        if options.watchdog {
            let cap = options.max_hold.and_then(|cap| sent.checked_add(cap));
            for (i, (part, taken)) in lock.parts.iter().zip(&held).enumerate() {
                let first = part.keys.first().cloned().unwrap_or_else(|| Arc::from(""));
                watch.push(lock.client.watchdog().watch(
                    Renewal::Multi(Arc::new(MultiPart {
                        keys: part.keys.clone(),
                        part: i,
                    })),
                    tag,
                    &first,
                    &token,
                    taken.sent,
                    ttl,
                    cap,
                    loss.clone(),
                ));
            }
        }
        MultiGuard {
            client: lock.client.clone(),
            keys: lock.keys.clone(),
            parts: lock.parts.clone(),
            token,
            sent,
            ttl,
            released: false,
            tag,
            held_since: Instant::now(),
            loss,
            watch,
            fences,
        }
    }

    /// The token every key of the set holds: a random secret and the
    /// holder metadata ([`Holder::from_token`](crate::Holder::from_token)).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The keys of the set, in the order they were taken.
    pub fn keys(&self) -> impl ExactSizeIterator<Item = &str> {
        self.keys.iter().map(|key| &**key)
    }

    /// Each key's fencing token, in the set's order, when the lock was
    /// taken with [`MultiLockExtra::fencing`](crate::MultiLockExtra::fencing):
    /// strictly increasing per key, from the key's own counter (the one a
    /// [`DistributedLock`](crate::DistributedLock) on that key fences
    /// with). A resource guarded by one key checks that key's token.
    /// `None` without fencing.
    pub fn fencing_tokens(&self) -> Option<impl ExactSizeIterator<Item = (&str, u64)>> {
        self.fences
            .as_ref()
            .map(|fences| fences.iter().map(|(key, fence)| (&**key, *fence)))
    }

    /// The local estimate's start and ttl: the earliest part's, watched or
    /// not.
    fn timing(&self) -> Option<(Instant, Duration)> {
        if self.watch.is_empty() {
            return Some((self.sent, self.ttl));
        }
        self.watch
            .iter()
            .map(|entry| entry.lease())
            .min_by_key(|(sent, ttl)| crate::lease::local_expiry(*sent, *ttl))
    }

    fn release(&mut self) -> Result<(), Error> {
        self.released = true;
        // A forked child's copy of its parent's set: refused, nothing sent.
        self.client.check_process()?;
        for entry in &self.watch {
            self.client.watchdog().end(entry);
        }
        let lost = self.loss.reason().is_some();
        let mut first_error = None;
        // Every part is released whatever another part answered: a part
        // lost or failing must not leave the others held.
        for part in self.parts.iter() {
            if let Err(err) = release_part(&self.client, part, &self.token) {
                if err.may_leave_a_lease() {
                    // Released in the background once Redis answers.
                    part.orphan(&self.client, &self.token);
                }
                first_error.get_or_insert(err);
            }
        }
        let result = first_error.map_or(Ok(()), Err);
        self.client
            .counters()
            .release(self.tag, Some(self.held_since), lost, result)
    }
}

impl crate::lease::sealed::Sealed for MultiGuard {}

impl crate::lease::Lease for MultiGuard {
    /// The first key of the set, in its order ([`MultiGuard::keys`] has
    /// them all).
    fn key(&self) -> &str {
        self.keys.first().map_or("", |key| key)
    }

    /// The set's lease left by the local clock, minus the drift
    /// allowance: counted from the earliest request that set a part's
    /// current expiry (the acquisition, an extension or a renewal), so
    /// never more than Redis allows any key of the set; zero once released
    /// or lost.
    fn validity(&self) -> Duration {
        if self.released || self.is_lost() {
            return Duration::ZERO;
        }
        self.timing().map_or(Duration::ZERO, |(sent, ttl)| {
            remaining(sent, ttl, Instant::now())
        })
    }

    /// Whether the set was found lost: an extension, [`MultiGuard::is_held`](crate::Lease::is_held)
    /// or the watchdog found a key of it gone or another owner's; or,
    /// watched, a part's lease ran out by the local clock with no
    /// successful renewal. Losing one key loses the set. Always true in a
    /// process forked since it was taken.
    fn is_lost(&self) -> bool {
        self.client.inherited() || self.loss.reason().is_some()
    }

    /// A signal, usable from any thread and after the guard is gone, that
    /// fires when the set is found lost.
    fn loss_signal(&self) -> LossSignal {
        LossSignal {
            state: self.loss.clone(),
        }
    }

    /// The fencing token of the set's first key (in its order) when the
    /// lock fences; each key's own is in [`MultiGuard::fencing_tokens`].
    fn fencing_token(&self) -> Option<u64> {
        self.fences
            .as_ref()
            .and_then(|fences| fences.first().map(|(_, fence)| *fence))
    }

    /// Whether every key of the set still holds this set's token (`MGET`,
    /// one per part). Changes nothing in Redis; a set found not held is
    /// lost from then on.
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
        for part in self.parts.iter() {
            self.client.counters().commands(1);
            // A read: a lost reply is asked again.
            let values: Vec<Option<String>> =
                self.client.run(Op::Read, part.first(), |con, _| {
                    let mut mget = redis::cmd("MGET");
                    for key in part.keys.iter() {
                        mget.arg(&**key);
                    }
                    mget.query(con)
                })?;
            let mut reason = None;
            for value in &values {
                match value.as_deref() {
                    Some(token) if token == &*self.token => {}
                    Some(_) => reason = Some(LossReason::OwnedByOther),
                    None => {
                        reason.get_or_insert(LossReason::Expired);
                    }
                }
            }
            if values.len() != part.keys.len() {
                reason.get_or_insert(LossReason::Expired);
            }
            if let Some(reason) = reason {
                self.loss.lose(reason);
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Sets every key of the set to expire `ttl` from now, if every key
    /// still holds the set's token (`lua/multi_extend.lua`, one per part:
    /// owner-checked, all or none, never re-creating a key). A set with a
    /// key gone is not extended; it is lost.
    ///
    /// Safe to send twice: a resend sets the same lease again (the local
    /// estimate keeps counting from the first send).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a ttl under 1 ms or over ten years,
    /// or a guard inherited through `fork()` (nothing is sent);
    /// [`Error::NotHeld`] when a key is gone or another owner's, after
    /// which [`MultiGuard::is_lost`](crate::Lease::is_lost) is true (on a
    /// set over several slots, the parts before it were extended);
    /// [`Error::WrongType`], [`Error::Redis`], [`Error::Pool`] or
    /// [`Error::OutcomeUnknown`].
    fn extend(&mut self, ttl: Duration) -> Result<(), Error> {
        self.client.check_process()?;
        let millis = ttl_millis(ttl)?;
        if self.released {
            return Err(Error::not_held(
                crate::lease::Lease::key(self),
                LossReason::Expired,
            ));
        }
        let asked = Duration::from_millis(millis);
        let mut earliest: Option<Instant> = None;
        for (i, part) in self.parts.iter().enumerate() {
            let generation = self.watch.get(i).map(|entry| entry.generation());
            let sent = Instant::now();
            // `PEXPIRE` sets the expiry asked, shorter ones too: whatever
            // this part's request does (a lost reply included), the
            // estimate is at most what it may have set.
            if crate::lease::local_expiry(sent, asked)
                < crate::lease::local_expiry(self.sent, self.ttl)
            {
                self.sent = sent;
                self.ttl = asked;
            }
            match extend_part(&self.client, part, &self.token, millis) {
                Ok(()) => {}
                Err(err) => {
                    if let Error::NotHeld { reason, .. } = &err {
                        self.loss.lose(*reason);
                    }
                    return Err(err);
                }
            }
            if let Some(entry) = self.watch.get(i) {
                // The watchdog's entry owns the timing of a watched part.
                entry.renewed(sent, asked, generation.unwrap_or_default());
            }
            earliest.get_or_insert(sent);
        }
        // Every part now expires `asked` after its own request left: the
        // set, after the first one's.
        if let Some(sent) = earliest {
            self.sent = sent;
            self.ttl = asked;
        }
        Ok(())
    }

    /// Releases the set: every key still holding its token is deleted
    /// (owner-checked; one script per part, so a part is released at
    /// once), and waiters of each key are told.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] when a key of the set no longer held the token
    /// (the others were released); [`Error::OutcomeUnknown`],
    /// [`Error::Redis`] or [`Error::Pool`] when Redis fails (the set is
    /// then released in the background once Redis answers, or expires);
    /// [`Error::InvalidArgument`] for a guard inherited through `fork()`.
    fn unlock(mut self) -> Result<crate::lease::Unlocked, Error> {
        self.release().map(|()| crate::lease::Unlocked::Released)
    }
}

impl Drop for MultiGuard {
    fn drop(&mut self) {
        // A forked child's copy of its parent's set: not the child's.
        if self.client.inherited() {
            self.released = true;
        }
        if !self.released
            && let Err(err) = self.release()
        {
            log::warn!(
                "redmutex: releasing the multi-lock of {:?} on drop: {err}",
                self.keys
            );
        }
    }
}
