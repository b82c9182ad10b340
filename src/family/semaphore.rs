//! `Semaphore`: at most N holders at once, each permit a lease of its own,
//! expiry and admission decided by the server's clock (issue 13).
//!
//! All state is one Redis hash: `limit` and one field `p:<id>` per permit
//! with its deadline. See `lua/sem_*.lua` for the scripts and why each is
//! safe to send twice.

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::client::LockClient;
use crate::client::holder::{Holder, Redacted, named_holder, redact};
use crate::client::options::{
    HandoffBudget, SemaphoreOptions, WaitMode, check_min_replicas, ttl_millis,
};
use crate::client::release::{Pass, Waited};
use crate::client::{release, replicas};
use crate::conn::backend::Connection;
use crate::conn::policy::Op;
use crate::conn::stats::{LockKind, Tag};
use crate::error::{Error, LossReason};
use crate::lease::Lease as _;
use crate::lease::loss::{LossSignal, LossState};
use crate::lease::remaining;
use crate::renew::watchdog::{OrphanKind, Renewal, WatchEntry};
use crate::script;
use crate::wait::acquire::{Attempt, Contender, Queued, Waiting, Within, acquire, blocking};
use crate::wait::queue::{Capacity, Queues};

/// The semaphore's state in one client: its wait queues, through which a
/// released permit can go straight to a queued thread of the same client.
#[derive(Default)]
struct Local {
    queues: Queues<PermitGift>,
    /// The keys whose last release by this client reached a subscriber
    /// (see [`Waited`]): their permits' drops release synchronously.
    waited: Arc<Waited>,
    /// Bumped by `set_permits` and `release_permit`: a permit taken under
    /// an earlier generation is given back in Redis, never passed on.
    generation: AtomicU64,
}

/// A permit passed from a releasing thread to a queued one of the same
/// client: the same id (so the same place in Redis), no command sent.
struct PermitGift {
    id: Arc<str>,
    /// When the request that set the current deadline was sent, and its ttl.
    sent: Instant,
    ttl: Duration,
    /// Consecutive handoffs so far, this one included.
    handoffs: u32,
    /// When this id was granted in Redis.
    acquired_at: Instant,
    watch: Option<Arc<WatchEntry>>,
    loss: Arc<LossState>,
    /// The generation the permit was taken under.
    generation: u64,
    /// When the newest request that found the permit in place in Redis was
    /// sent (its grant, a renewal, an extension, a check).
    confirmed: Instant,
    /// The limit it was granted under: only a handle opened with that
    /// limit may take it.
    limit: u32,
}

impl std::fmt::Debug for Local {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Local").finish_non_exhaustive()
    }
}

/// An expiring counting semaphore: at most `permits` holders at once,
/// across every client and process.
///
/// Each [`Permit`] is a lease with its own deadline, kept by the server's
/// clock (`TIME` inside the scripts, never a client timestamp): a crashed
/// holder's permit comes back by itself after its ttl. The limit is stored
/// with the semaphore: opening the same key with another `permits` while
/// permits are out is an error ([`Error::InvalidArgument`] naming both),
/// not a second semaphore. A permit id is chosen before the request is
/// sent, so a resend after a lost reply finds its own permit instead of
/// taking a second one; a release removes only its own permit, so a
/// duplicate or late release never adds capacity.
#[derive(Clone)]
pub struct Semaphore {
    client: LockClient,
    local: Arc<Local>,
    key: Arc<str>,
    /// The key's release channel, shared with each permit.
    channel: Arc<str>,
    /// The key of its wait queue in the client ([`queue_key`]), shared
    /// with each permit.
    queue_key: Arc<str>,
    permits: u32,
    options: SemaphoreOptions,
}

impl std::fmt::Debug for Semaphore {
    // The queue key is the key again (with a NUL inside): left out.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Semaphore")
            .field("client", &self.client)
            .field("local", &self.local)
            .field("key", &self.key)
            .field("channel", &self.channel)
            .field("permits", &self.permits)
            .field("options", &self.options)
            .finish()
    }
}

impl Semaphore {
    /// A semaphore of `permits` on `key`, with what applies to permits of
    /// the client's default options (all but the release method).
    pub fn new(client: &LockClient, key: impl Into<String>, permits: u32) -> Semaphore {
        Semaphore::with_options(client, key, permits, client.defaults().for_semaphore())
    }

    /// A semaphore of `permits` on `key` with the given options.
    pub fn with_options(
        client: &LockClient,
        key: impl Into<String>,
        permits: u32,
        options: SemaphoreOptions,
    ) -> Semaphore {
        let key: Arc<str> = client.names().own_key(key.into()).into();
        Semaphore {
            client: client.clone(),
            local: client.local::<Local>(),
            channel: client.release_channel(&key).into(),
            queue_key: queue_key(&key).into(),
            key,
            permits,
            options,
        }
    }

    /// The key as it is in Redis, the client's key prefix included.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The options its permits are taken with (read as
    /// `semaphore.options().ttl`, `semaphore.options().extra.fencing`).
    pub fn options(&self) -> &SemaphoreOptions {
        &self.options
    }

    /// The number of permits this semaphore was opened with.
    pub fn permits(&self) -> u32 {
        self.permits
    }

    /// Makes `permits` the semaphore's limit in Redis (and this handle's),
    /// for everyone: the explicit way to change it while permits are out,
    /// which opening the key with another number refuses. Permits already
    /// out stay out; a smaller limit admits nobody new until enough are
    /// released. With no permit out there is nothing to change: the next
    /// acquire sets its own limit. (It does not report the previous limit:
    /// after a lost reply, the resend would report its own.) A permit
    /// dropped a moment ago may still be out (its release written behind,
    /// see [`Permit`]); [`Permit::release`] returns once it is not.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for 0 permits or an empty key;
    /// [`Error::WrongType`]; [`Error::Redis`], [`Error::Pool`] or
    /// [`Error::OutcomeUnknown`].
    pub fn set_permits(&mut self, permits: u32) -> Result<(), Error> {
        if permits == 0 || self.key.is_empty() {
            return Err(Error::InvalidArgument(
                "a semaphore needs a key and at least 1 permit".into(),
            ));
        }
        self.client.check_key(&self.key)?;
        self.client.counters().commands(1);
        let changed: Result<u32, Error> = self.client.run(Op::SemSetLimit, &self.key, |con, _| {
            script::SEM_SET_LIMIT
                .key(&*self.key)
                .arg(permits)
                .invoke(con)
        });
        changed?;
        // Permits of this client taken before are not passed on any more:
        // a handoff would skip the new limit.
        self.local.generation.fetch_add(1, Ordering::Relaxed);
        self.permits = permits;
        Ok(())
    }

    /// What Redis holds for this semaphore now, by the server's clock: the
    /// stored limit and every permit within its deadline (its holder, its
    /// id redacted, time left and fencing token). One read, in one step;
    /// changes nothing.
    ///
    /// # Errors
    ///
    /// [`Error::WrongType`] when the key is not a semaphore (another lock
    /// type, or other data); [`Error::Redis`] or [`Error::Pool`].
    pub fn status(&self) -> Result<SemaphoreStatus, Error> {
        if self.key.is_empty() {
            return Err(Error::InvalidArgument(
                "the semaphore key must not be empty".into(),
            ));
        }
        self.client.check_key(&self.key)?;
        self.client.counters().commands(1);
        let reply: (i64, Vec<(String, u64, u64)>) =
            self.client.run(Op::Read, &self.key, |con, _| {
                script::SEM_STATUS.key(&*self.key).invoke(con)
            })?;
        SemaphoreStatus::parse(&self.key, reply)
    }

    /// Gives back the permit `id` (a [`Permit::id`], handed to another
    /// process, say): owner-checked like [`Permit::release`], so it removes
    /// that permit only and never adds capacity. The limit this handle was
    /// opened with plays no part.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] when the permit is gone (released or expired);
    /// [`Error::InvalidArgument`] for an empty key or id;
    /// [`Error::WrongType`]; [`Error::Redis`], [`Error::Pool`] or
    /// [`Error::OutcomeUnknown`].
    pub fn release_permit(&self, id: &str) -> Result<(), Error> {
        if self.key.is_empty() || id.is_empty() {
            return Err(Error::InvalidArgument(
                "releasing a permit needs the semaphore key and the permit id".into(),
            ));
        }
        self.client.check_key(&self.key)?;
        // A permit of this client with that id must not be passed on by
        // its holder afterwards (it would be held without a place in
        // Redis): permits taken before this are not handed off any more.
        self.local.generation.fetch_add(1, Ordering::Relaxed);
        // Nor counted as held here any more (before the release, as a
        // holder's own release does).
        self.local.queues.unhold(&self.queue_key, id);
        release_and_tell(
            &self.client,
            &self.local,
            &self.key,
            &self.channel,
            &self.queue_key,
            id,
            Duration::MAX,
        )
    }

    /// Takes a permit, waiting up to the options' `wait`.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] after the wait; [`Error::InvalidArgument`] for an
    /// empty key, 0 permits, a bad ttl, or a limit that differs from the
    /// one stored; [`Error::WrongType`]; [`Error::OutcomeUnknown`],
    /// [`Error::Redis`] or [`Error::Pool`].
    pub fn acquire(&self) -> Result<Permit, Error> {
        blocking(&self.key, self.options.wait, |within, seen| {
            self.take(within, seen)
        })
    }

    /// One attempt, no waiting.
    ///
    /// # Errors
    ///
    /// As [`Semaphore::acquire`], without the timeout.
    #[must_use = "the permit is released as soon as it is dropped"]
    pub fn try_acquire(&self) -> Result<Option<Permit>, Error> {
        self.take(Within::Once, &mut None)
    }

    /// Waits up to `wait` for a permit.
    ///
    /// # Errors
    ///
    /// As [`Semaphore::try_acquire`].
    #[must_use = "the permit is released as soon as it is dropped"]
    pub fn try_acquire_for(&self, wait: Duration) -> Result<Option<Permit>, Error> {
        self.take(Within::For(wait), &mut None)
    }

    /// Waits until `deadline` for a permit (at least one attempt).
    ///
    /// # Errors
    ///
    /// As [`Semaphore::try_acquire`].
    #[must_use = "the permit is released as soon as it is dropped"]
    pub fn try_acquire_until(&self, deadline: Instant) -> Result<Option<Permit>, Error> {
        self.take(Within::Until(deadline), &mut None)
    }

    /// Whether a released permit may go straight to a queued thread: with
    /// notify waiting, and not when each holder needs its own fencing token
    /// or its own replica acknowledgement.
    fn hands_off(&self) -> bool {
        self.options.wait_mode == WaitMode::Notify
            && self.options.extra.local_handoff
            && self.options.extra.handoff_budget.max_handoffs > 0
            && !self.options.extra.fencing
            && self.options.extra.min_replicas.is_none()
    }

    /// This semaphore's stats tag.
    fn tag(&self) -> Tag {
        Tag {
            kind: LockKind::Semaphore,
            class: self.options.key_class,
        }
    }

    /// `seen`: who held the permit that frees first when the last attempt
    /// was refused (its id, redacted).
    fn take(&self, within: Within, seen: &mut Option<String>) -> Result<Option<Permit>, Error> {
        let started = Instant::now();
        let result = self.take_inner(within, seen);
        self.client
            .counters()
            .acquisition(self.tag(), started, result)
    }

    fn take_inner(
        &self,
        within: Within,
        seen: &mut Option<String>,
    ) -> Result<Option<Permit>, Error> {
        if self.key.is_empty() {
            return Err(Error::InvalidArgument(
                "the semaphore key must not be empty".into(),
            ));
        }
        if self.permits == 0 {
            return Err(Error::InvalidArgument(
                "a semaphore needs at least 1 permit".into(),
            ));
        }
        let millis = ttl_millis(self.options.ttl)?;
        check_min_replicas(self.options.extra.min_replicas, self.client.timeout())?;
        self.client.check_key(&self.key)?;
        let deadline = within.deadline();
        let mut contender = Take {
            semaphore: self,
            id: None,
            millis,
            seen: None,
        };
        let queue_key = &self.queue_key;
        let subscribe = |waker| self.client.subscribe(&self.channel, waker);
        // A permit handed to this waiter after it gave up, with nobody left
        // to take it: given back like any other (passed on, or released).
        let release_orphan = |gift: PermitGift| {
            drop(Permit::handed_over(self, gift));
        };
        let waiting = match self.options.wait_mode {
            WaitMode::Spin => Waiting::Spin,
            WaitMode::Notify => Waiting::Queued(Queued {
                queues: &self.local.queues,
                key: queue_key,
                takes_handoffs: self.hands_off(),
                // FIFO within the client: while the head waits, the
                // permits are all out, and a newcomer would only add a
                // request that fails.
                barge: false,
                intercepts: false,
                on_orphan: &release_orphan,
                subscribe: &subscribe,
            }),
        };
        let won = acquire(&mut contender, deadline, self.options.backoff, waiting);
        *seen = contender.seen.take();
        won
    }
}

/// One acquisition of a permit, seen by the acquire loop.
struct Take<'a> {
    semaphore: &'a Semaphore,
    /// Made at the first attempt in Redis and kept for the others (so a
    /// later attempt finds a grant an earlier one made): a permit passed
    /// on by another thread of this client carries its own, so a waiter
    /// served that way never makes one.
    id: Option<Arc<str>>,
    millis: u64,
    /// Who held the permit that frees first when the last attempt was
    /// refused (its id, redacted).
    seen: Option<String>,
}

impl Take<'_> {
    /// With [`SemaphoreOptions::min_replicas`]: `WAIT` on the connection
    /// that wrote the permit (on a resend an earlier connection wrote it,
    /// so this one renews it first: a write for `WAIT` to count). When
    /// fewer replicas acknowledged in time, gives the permit back on the
    /// same connection and returns how many did.
    fn await_replicas(
        &self,
        con: &mut Connection,
        id: &str,
        resend: bool,
        connection: Option<i64>,
    ) -> redis::RedisResult<Option<u32>> {
        let semaphore = self.semaphore;
        let (client, key) = (&semaphore.client, &*semaphore.key);
        replicas::await_or_give_back(
            con,
            client.counters(),
            key,
            semaphore.options.extra.min_replicas,
            (resend, connection),
            |con| {
                client.counters().commands(1);
                let _renewed: i64 = script::SEM_EXTEND
                    .key(key)
                    .arg(id)
                    .arg(self.millis)
                    .invoke(con)?;
                Ok(())
            },
            |con| {
                client.counters().commands(1);
                let channel = client.release_channel(key);
                let mut release = script::SEM_RELEASE.key(key);
                release.arg(id).arg(&channel).arg(1);
                if client.sharded(&channel) {
                    release.arg(script::SHARDED);
                }
                let _released: (i64, u64) = release.invoke(con)?;
                Ok(())
            },
        )
    }
}

impl Contender for Take<'_> {
    type Won = Permit;
    type Gift = PermitGift;

    fn attempt(&mut self, _quick: bool) -> Result<Attempt<Permit>, Error> {
        let semaphore = self.semaphore;
        let id = &semaphore.client.token_once(&mut self.id, &semaphore.key)?;
        let options = &semaphore.options;
        let (client, key) = (&semaphore.client, &*semaphore.key);
        let fence_key = options.extra.fencing.then(|| client.fence_key(key));
        // Set once Redis granted the permit in this attempt: whatever fails
        // after that (the WAIT, say) leaves a permit to take out again.
        let granted = Cell::new(false);
        let sent = Instant::now();
        client.counters().commands(1);
        let reply = client.run(Op::SemAcquire, key, |con, send| {
            let connection =
                replicas::node_connection_id(con, key, options.extra.min_replicas.is_some())?;
            use script::wire::{Arg, present};
            let reply: (i64, i64, u64, Option<String>) = script::wire::evalsha(
                con,
                &script::SEM_ACQUIRE,
                &present([Some(Arg::from(key)), fence_key.as_deref().map(Arg::from)]),
                &[
                    Arg::from(&**id),
                    Arg::Int(u64::from(semaphore.permits)),
                    Arg::Int(self.millis),
                ],
            )?;
            if reply.0 != 1 {
                return Ok((reply, None));
            }
            granted.set(true);
            Ok((
                reply,
                self.await_replicas(con, id, send.resend, connection)?,
            ))
        });
        let reply =
            reply.map_err(|err| crate::mutex::fence_failure(key, fence_key.as_deref(), err));
        let ((acquired, wait_ms, fence, holder), short) = match reply {
            Ok(reply) => reply,
            Err(Error::Redis(err)) if err.code() == Some("LIMIT") => {
                return Err(Error::InvalidArgument(format!(
                    "the semaphore {key:?} has a limit of {} permits, not {}: open it with \
                     the stored limit, or change it with Semaphore::set_permits",
                    err.detail().unwrap_or("another number"),
                    semaphore.permits
                )));
            }
            Err(err) => {
                if granted.get() || err.is_outcome_unknown() {
                    // The permit may have been written: take it out again.
                    client.orphan(key, OrphanKind::Permit { id: id.clone() });
                }
                return Err(err);
            }
        };
        if let (Some(acked), Some((wanted, _))) = (short, options.extra.min_replicas) {
            return Err(Error::NotReplicated {
                key: key.to_owned(),
                acked,
                wanted,
            });
        }
        if acquired != 1 {
            // Who holds the permit that frees first, named from the reply;
            // never kept whole.
            self.seen = holder.as_deref().and_then(named_holder);
            return Ok(Attempt::Held(
                u64::try_from(wait_ms).ok().map(Duration::from_millis),
            ));
        }
        Ok(Attempt::Won(Permit::granted(
            semaphore,
            id,
            sent,
            Duration::from_millis(self.millis),
            options.extra.fencing.then_some(fence),
        )))
    }

    /// A permit another thread of this client passed on: kept as it is
    /// while Redis confirmed it within the handoff budget's `max_age` and at
    /// least half this semaphore's ttl is left. Otherwise it is confirmed
    /// in Redis before this call returns (`lua/sem_check.lua`, which also
    /// reads the stored limit: a handoff is an admission, which a limit
    /// changed elsewhere must decide), then renewed when less than half
    /// the ttl is left. `None` when it turns out lost, or the limit
    /// changed: the waiter goes on and asks Redis afresh (see
    /// `DistributedLock::take_handoff` for why).
    fn accept(&mut self, gift: PermitGift) -> Result<Option<Permit>, Error> {
        let mut permit = Permit::handed_over(self.semaphore, gift);
        if let Some(reason) = permit.loss.reason() {
            // Lost while it was being passed on: given back when Redis may
            // still have it (a loss by the local clock), and the waiter
            // goes on waiting.
            match reason {
                LossReason::Expired | LossReason::OwnedByOther => permit.abandon(),
                _ => drop(permit),
            }
            return Ok(None);
        }
        if permit.limit != self.semaphore.permits {
            // Granted under another limit: taking it would skip the check
            // Redis makes of ours. Passed on (to a waiter of its limit) or
            // given back; this waiter asks Redis itself.
            drop(permit);
            return Ok(None);
        }
        let max_age = self.semaphore.options.extra.handoff_budget.max_age;
        if permit.confirmed().elapsed() > max_age {
            // A read: a lost reply is sent again.
            match permit.confirm() {
                Ok(Check::Held) => {}
                Ok(Check::Lost) => {
                    permit.abandon();
                    return Ok(None);
                }
                Ok(Check::Relimited) => {
                    // In place, but admitted under a limit that is no
                    // longer the key's: never passed on; given back by
                    // the cleanup (this call makes one round trip, not
                    // two), and this waiter asks Redis itself.
                    permit.give_up();
                    return Ok(None);
                }
                Err(err) => {
                    // Nothing known: not passed on, and given back by the
                    // cleanup once Redis answers.
                    permit.give_up();
                    return Err(err);
                }
            }
        }
        let ttl = Duration::from_millis(self.millis);
        if permit.validity() < ttl / 2 {
            match permit.extend(ttl) {
                Ok(()) => {}
                Err(err) if err.is_not_held() => {
                    permit.abandon();
                    return Ok(None);
                }
                Err(err) => {
                    permit.give_up();
                    return Err(err);
                }
            }
        }
        let semaphore = self.semaphore;
        semaphore
            .client
            .counters()
            .handed_over(semaphore.tag(), permit.confirmed());
        permit.held_since = Some(Instant::now());
        Ok(Some(permit))
    }
}

/// What a check of a permit passed on found in Redis ([`Permit::confirm`]).
enum Check {
    /// In place under the limit it was granted with.
    Held,
    /// Gone (expired, released by id, the key deleted or replaced).
    Lost,
    /// In place, but the stored limit changed since it was granted.
    Relimited,
}

/// One permit of a [`Semaphore`]. Dropping it releases it (best effort);
/// [`Permit::release`] reports the outcome.
///
/// A drop writes its release behind when nobody is known to wait (as a
/// dropped [`LockGuard`](crate::LockGuard) does; see the crate docs): it
/// returns once the release is sent, and the permit stays out in Redis
/// until the release arrives, about one round trip. A request on another
/// connection right after the drop can still count it: a
/// [`Semaphore::try_acquire`] may find no room, [`Semaphore::status`] may
/// list it, and opening the key with another limit may still be refused
/// ([`Error::InvalidArgument`]). Call [`Permit::release`] when the place
/// must be free by the time the call returns.
#[must_use = "the permit is released as soon as it is dropped"]
pub struct Permit {
    client: LockClient,
    key: Arc<str>,
    id: Arc<str>,
    /// The key's release channel.
    channel: Arc<str>,
    /// When the request that set the current deadline was sent, and its
    /// ttl (the watchdog's entry owns them for a watched permit).
    sent: Instant,
    ttl: Duration,
    fence: Option<u64>,
    watch: Option<Arc<WatchEntry>>,
    loss: Arc<LossState>,
    released: bool,
    local: Arc<Local>,
    queue_key: Arc<str>,
    /// The handoff budget, when this permit may be passed on.
    handoff: Option<HandoffBudget>,
    handoffs: u32,
    acquired_at: Instant,
    /// The client's handoff generation when this permit was taken.
    generation: u64,
    /// When the newest request that found the permit in place in Redis
    /// was sent, but the watchdog's renewals (its entry keeps those).
    confirmed: Instant,
    /// Whether threads of this client queue for the key (notify waiting):
    /// then the permit counts in the client's holds of the key.
    queued: bool,
    /// The limit it was granted under (its granting handle's, as Redis
    /// checked it); only a handle opened with it may take it over.
    limit: u32,
    /// For the client's stats: the lock type and key class.
    tag: Tag,
    /// When this holder got the permit (granted, or a handoff accepted);
    /// `None` while a handed-over permit is not yet accepted.
    held_since: Option<Instant>,
}

impl std::fmt::Debug for Permit {
    // Without the client's internals: what a log line needs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("key", &self.key)
            // The id is a capability: only its public part is shown.
            .field("id", &Redacted(&self.id))
            .field("fence", &self.fence)
            .field("watched", &self.watch.is_some())
            .field("lost", &self.is_lost())
            .field("released", &self.released)
            .finish()
    }
}

impl Permit {
    /// A permit just granted by a request sent at `sent`: a permit with no
    /// past, set up as a handed-over one is.
    fn granted(
        semaphore: &Semaphore,
        id: &Arc<str>,
        sent: Instant,
        ttl: Duration,
        fence: Option<u64>,
    ) -> Permit {
        semaphore.client.counters().acquired();
        let fresh = PermitGift {
            id: id.clone(),
            sent,
            ttl,
            handoffs: 0,
            acquired_at: sent,
            watch: None,
            loss: Arc::default(),
            generation: semaphore.local.generation.load(Ordering::Relaxed),
            confirmed: sent,
            limit: semaphore.permits,
        };
        let mut permit = Permit::handed_over(semaphore, fresh);
        permit.fence = fence;
        permit.held_since = Some(Instant::now());
        // While this client's threads hold every permit, its queued threads
        // wait for one of them instead of asking Redis. By the local clock
        // only: renewals by the watchdog do not move it, so a long hold
        // makes the head ask Redis again after a ttl, as without it.
        permit.count_held(sent, ttl);
        permit
    }

    /// A permit passed on by another thread of this client (or just
    /// granted), under the receiving semaphore's options: its watchdog
    /// setting (renewals start or stop; a cap counts from now) and whether
    /// it may be passed on.
    fn handed_over(semaphore: &Semaphore, gift: PermitGift) -> Permit {
        let client = &semaphore.client;
        let options = &semaphore.options;
        let now = Instant::now();
        let cap = options.max_hold.and_then(|cap| now.checked_add(cap));
        let (mut sent, mut ttl) = (gift.sent, gift.ttl);
        // The loss signal stays the permit's own, shared with every holder
        // it passed through and with its checks.
        let loss = gift.loss;
        let watch = match (gift.watch, options.watchdog) {
            (None, true) => Some(client.watchdog().watch(
                Renewal::Permit,
                semaphore.tag(),
                &semaphore.key,
                &gift.id,
                sent,
                ttl,
                cap,
                loss.clone(),
            )),
            (Some(entry), false) => {
                (sent, ttl) = entry.lease();
                // Unwatched from here on: a loss already found stays found.
                client.watchdog().unwatch(&entry);
                None
            }
            (Some(entry), true) => {
                entry.set_cap(cap);
                Some(entry)
            }
            (None, false) => None,
        };
        Permit {
            client: client.clone(),
            key: semaphore.key.clone(),
            id: gift.id,
            channel: semaphore.channel.clone(),
            sent,
            ttl,
            fence: None,
            watch,
            loss,
            released: false,
            local: semaphore.local.clone(),
            queue_key: semaphore.queue_key.clone(),
            handoff: semaphore
                .hands_off()
                .then_some(semaphore.options.extra.handoff_budget),
            handoffs: gift.handoffs,
            acquired_at: gift.acquired_at,
            generation: gift.generation,
            confirmed: gift.confirmed,
            queued: options.wait_mode == WaitMode::Notify,
            limit: gift.limit,
            tag: semaphore.tag(),
            held_since: None,
        }
    }

    /// When the newest request that found the permit in place in Redis was
    /// sent: its grant, an extension, a check, or a renewal by the
    /// watchdog.
    fn confirmed(&self) -> Instant {
        match &self.watch {
            Some(entry) => self.confirmed.max(entry.lease().0),
            None => self.confirmed,
        }
    }

    /// Asks Redis whether the permit is still in place and the stored
    /// limit still the one it was granted under (`lua/sem_check.lua`,
    /// read-only, sent again on a fresh connection after a lost reply).
    /// [`Check::Held`] confirms it as of the request's sending; a permit
    /// gone is marked lost.
    ///
    /// # Errors
    ///
    /// What the request met when it could not be answered: nothing is
    /// known of the permit then, and the caller must not start on it.
    fn confirm(&mut self) -> Result<Check, Error> {
        let sent = Instant::now();
        self.client.counters().commands(1);
        let checked: Result<(i64, i64), Error> = self.client.run(Op::Read, &self.key, |con, _| {
            script::SEM_CHECK.key(&*self.key).arg(&*self.id).invoke(con)
        });
        let (live, stored) = match checked {
            Ok(reply) => reply,
            // Another type's data under the key: the permit is gone, the
            // key another's (as a plain lock's check says).
            Err(Error::WrongType { .. }) => {
                self.loss.lose(LossReason::OwnedByOther);
                return Ok(Check::Lost);
            }
            Err(err) => return Err(err),
        };
        if live != 1 {
            self.loss.lose(LossReason::Expired);
            return Ok(Check::Lost);
        }
        self.confirmed = self.confirmed.max(sent);
        if u32::try_from(stored).ok() != Some(self.limit) {
            return Ok(Check::Relimited);
        }
        Ok(Check::Held)
    }

    /// Counts this permit among the client's holds of the key until the
    /// lease a request sent at `sent` for `ttl` gave it (local clock).
    fn count_held(&self, sent: Instant, ttl: Duration) {
        if self.queued {
            self.local.queues.hold(
                &self.queue_key,
                &self.id,
                sent + ttl,
                Capacity::Limit(self.limit),
            );
        }
    }

    /// Marks the permit done without touching Redis (it was lost).
    fn abandon(&mut self) {
        self.released = true;
        self.client
            .counters()
            .hold_ended(self.tag, self.held_since, true, Ok(()));
        self.local.queues.unhold(&self.queue_key, &self.id);
        if let Some(entry) = &self.watch {
            self.client.watchdog().unwatch(entry);
        }
        // A place is free by this client's count: the head asks Redis.
        self.local.queues.released(&self.queue_key, None);
    }

    /// Gives the permit up with nothing more sent: Redis may still have
    /// it, so its id goes to the client's cleanup, which gives it back
    /// (owner-checked) once Redis answers. For a call that already made
    /// its round trip about the permit.
    fn give_up(&mut self) {
        self.released = true;
        self.client
            .counters()
            .hold_ended(self.tag, self.held_since, false, Ok(()));
        self.end_locally();
    }

    /// Everything of the permit outside Redis ends (renewals, its count in
    /// the client's holds), and its id goes to the cleanup.
    fn end_locally(&self) {
        if let Some(entry) = &self.watch {
            self.client.watchdog().end(entry);
        }
        self.local.queues.unhold(&self.queue_key, &self.id);
        self.local.queues.released(&self.queue_key, None);
        self.client.orphan(
            &self.key,
            OrphanKind::Permit {
                id: self.id.clone(),
            },
        );
    }

    /// Whether giving this permit back may pass it to a queued thread of
    /// this client instead (the budget counts the handoff about to happen).
    fn may_hand_off(&mut self) -> Pass {
        let Some(budget) = self.handoff else {
            return Pass::No;
        };
        let allowed = self.generation == self.local.generation.load(Ordering::Relaxed)
            && self.handoffs < budget.max_handoffs
            && self.acquired_at.elapsed() < budget.max_time
            && !self.is_lost()
            && !self.timing_left().is_zero()
            && self.local.queues.has_waiters(&self.queue_key);
        if !allowed {
            return Pass::No;
        }
        // Last, as it may cost a round trip: a permit Redis vouched for too
        // long ago is confirmed first (a permit gone is reported `NotHeld`;
        // one admitted under a limit changed since is given back in Redis).
        if self.confirmed().elapsed() <= budget.max_age {
            return Pass::Yes;
        }
        match self.confirm() {
            Ok(Check::Held) => Pass::Yes,
            Ok(Check::Lost | Check::Relimited) => Pass::No,
            Err(err) => Pass::Unknown(err),
        }
    }

    /// The lease left by the local clock (released or not).
    fn timing_left(&self) -> Duration {
        let (sent, ttl) = match &self.watch {
            Some(entry) => entry.lease(),
            None => (self.sent, self.ttl),
        };
        remaining(sent, ttl, Instant::now())
    }

    /// This permit's id (its field in the hash; what `redmutex release
    /// KEY --token ID` takes): a random secret and the holder metadata
    /// ([`Holder::from_token`]).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Gives the permit back: removes only this permit.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] ([`LossReason::Expired`]) when the permit was
    /// already gone, or was found gone when it was about to be passed to a
    /// waiting thread (see [`HandoffBudget::max_age`](crate::HandoffBudget::max_age));
    /// [`Error::Redis`], [`Error::Pool`], [`Error::WrongType`] or
    /// [`Error::OutcomeUnknown`]; [`Error::InvalidArgument`] for a permit
    /// inherited through `fork()` (nothing is sent: it is the parent's).
    pub fn release(mut self) -> Result<(), Error> {
        self.give_back(false)
    }

    /// Gives the permit back once; `behind`: for a drop, whose release in
    /// Redis may be written behind (`release::release_behind`) and its
    /// outcome, read later, only logged.
    fn give_back(&mut self, behind: bool) -> Result<(), Error> {
        self.released = true;
        // A forked child's copy of its parent's permit: refused before
        // anything is looked at (its queues' locks may have been held by a
        // parent thread at the fork) or sent.
        self.client.check_process()?;
        let result = self.let_go(behind);
        let lost = self.is_lost();
        self.client
            .counters()
            .release(self.tag, self.held_since, lost, result)
    }

    fn let_go(&mut self, behind: bool) -> Result<(), Error> {
        let started = Instant::now();
        let pass = self.may_hand_off();
        if let Pass::Unknown(err) = pass {
            self.end_locally();
            return Err(err);
        }
        if let Pass::Yes = pass {
            let gift = PermitGift {
                id: self.id.clone(),
                sent: self.sent,
                ttl: self.ttl,
                handoffs: self.handoffs.saturating_add(1),
                acquired_at: self.acquired_at,
                watch: self.watch.clone(),
                loss: self.loss.clone(),
                generation: self.generation,
                confirmed: self.confirmed(),
                limit: self.limit,
            };
            // Passed on without Redis: its receiver confirms it there first
            // when Redis vouched for it too long ago (`Take::accept`).
            if self
                .local
                .queues
                .offer(&self.queue_key, gift, false)
                .is_ok()
            {
                self.client.counters().handoff();
                return Ok(());
            }
        }
        // No renewal starts from here on; one in flight is ignored, even
        // if it finds the key gone (this release may have gone first).
        if let Some(entry) = &self.watch {
            self.client.watchdog().end(entry);
        }
        // Before the release: once it is out, the wake-up it causes must
        // find the head free to ask Redis.
        self.local.queues.unhold(&self.queue_key, &self.id);
        // Redis said the permit is gone: nothing to give back. (A loss by
        // the local clock is released all the same: Redis may still have
        // it, and the answer is Redis's.)
        if let Some(reason @ (LossReason::Expired | LossReason::OwnedByOther)) = self.loss.reason()
        {
            self.local.queues.released(&self.queue_key, None);
            return Err(Error::not_held(&self.key, reason));
        }
        // Written behind, as a plain lock's drop is, only with nobody known
        // to wait: no thread of this client queued for a permit (the
        // release that tells the queue keeps it fair; `release_behind`
        // checks for other clients' waiters).
        if behind
            && !self.local.queues.has_waiters(&self.queue_key)
            && release::release_behind(
                &self.client,
                release::Behind {
                    key: self.key.clone(),
                    token: self.id.clone(),
                    channel: self.channel.clone(),
                    what: script::Unmarked::Permit,
                    waited: self.local.waited.clone(),
                },
                self.tag,
                self.is_lost(),
            )
        {
            return Ok(());
        }
        // Within what is left of the call's bound when a check of the
        // permit (`may_hand_off`) took part of it.
        release_and_tell(
            &self.client,
            &self.local,
            &self.key,
            &self.channel,
            &self.queue_key,
            &self.id,
            self.client
                .call_slack()
                .saturating_sub(started.elapsed())
                .max(Duration::from_millis(1)),
        )
    }
}

impl crate::lease::sealed::Sealed for Permit {}

impl crate::lease::Lease for Permit {
    /// The semaphore's key.
    fn key(&self) -> &str {
        &self.key
    }

    /// The lease left by the local clock, minus the drift allowance; zero
    /// once released or lost.
    fn validity(&self) -> Duration {
        if self.released || self.is_lost() {
            return Duration::ZERO;
        }
        self.timing_left()
    }

    /// Whether the permit was found lost: by the watchdog (gone from the
    /// hash, Redis unreachable until the lease ran out, hold cap reached)
    /// or by a [`Permit::extend`] that found it gone.
    fn is_lost(&self) -> bool {
        // A forked child's copy is never the child's permit.
        self.client.inherited() || self.loss.reason().is_some()
    }

    /// A signal, usable from any thread and after the permit is gone, that
    /// fires when the permit is found lost.
    fn loss_signal(&self) -> LossSignal {
        LossSignal {
            state: self.loss.clone(),
        }
    }

    fn fencing_token(&self) -> Option<u64> {
        self.fence
    }

    /// Whether Redis still has this permit within its deadline.
    ///
    /// # Errors
    ///
    /// [`Error::Redis`] or [`Error::Pool`].
    fn is_held(&self) -> Result<bool, Error> {
        if self.released {
            return Ok(false);
        }
        let field = format!("p:{}", self.id);
        let (deadline, now): (Option<u64>, (u64, u64)) =
            self.client.run(Op::Read, &self.key, |con, _| {
                redis::pipe()
                    .cmd("HGET")
                    .arg(&*self.key)
                    .arg(&field)
                    .cmd("TIME")
                    .query(con)
            })?;
        let now_ms = now.0.saturating_mul(1000).saturating_add(now.1 / 1000);
        Ok(deadline.is_some_and(|d| d > now_ms))
    }

    /// Renews this permit for `ttl` from now, only if it is still present
    /// (an expired permit is never re-created).
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] when the permit is gone; [`Error::InvalidArgument`]
    /// for a bad ttl; [`Error::Redis`], [`Error::Pool`] or
    /// [`Error::OutcomeUnknown`].
    fn extend(&mut self, ttl: Duration) -> Result<(), Error> {
        // Before the watch entry's lock, which a parent thread may have
        // held at a fork.
        self.client.check_process()?;
        let millis = ttl_millis(ttl)?;
        let ttl = Duration::from_millis(millis);
        let generation = self.watch.as_ref().map(|entry| entry.generation());
        let sent = Instant::now();
        self.client.counters().commands(1);
        let renewed: i64 = self.client.run(Op::SemExtend, &self.key, |con, _| {
            script::SEM_EXTEND
                .key(&*self.key)
                .arg(&*self.id)
                .arg(millis)
                .invoke(con)
        })?;
        if renewed != 1 {
            self.loss.lose(LossReason::Expired);
            return Err(Error::not_held(&self.key, LossReason::Expired));
        }
        // The watchdog's entry owns the timing of a watched permit.
        match &self.watch {
            Some(entry) => entry.renewed(sent, ttl, generation.unwrap_or_default()),
            None => {
                self.sent = sent;
                self.ttl = ttl;
            }
        }
        self.confirmed = self.confirmed.max(sent);
        self.count_held(sent, ttl);
        Ok(())
    }

    /// Gives the permit back, as [`Permit::release`] does:
    /// [`Unlocked::Released`](crate::Unlocked::Released) on success.
    fn unlock(mut self) -> Result<crate::lease::Unlocked, Error> {
        self.give_back(false)
            .map(|()| crate::lease::Unlocked::Released)
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        // A forked child's copy of its parent's permit: not the child's.
        if self.client.inherited() {
            self.released = true;
        }
        if !self.released
            && let Err(err) = self.give_back(true)
        {
            log::warn!(
                "redmutex: dropping a permit of {:?} failed: {err}",
                self.key
            );
        }
    }
}

/// The key of a semaphore's wait queue in the client, apart from a plain
/// lock's of the same name. One queue for every limit a handle may be
/// opened with: a waiter takes a permit handed over only if it was granted
/// under its own limit (`Take::accept`).
fn queue_key(key: &str) -> String {
    let mut queue = String::with_capacity(key.len() + 4);
    queue.push_str(key);
    queue.push_str("\u{0}sem");
    queue
}

/// [`release_id`] within `budget` (all of it: connect and resends), then
/// this client told what it reached: the head of its queue at once (or,
/// when other clients' waiters heard the message too, after them), and
/// its [`Waited`] keys.
fn release_and_tell(
    client: &LockClient,
    local: &Local,
    key: &Arc<str>,
    channel: &str,
    queue_key: &str,
    id: &str,
    budget: Duration,
) -> Result<(), Error> {
    let released = release_id(client, key, channel, id, budget);
    let receivers = released.as_ref().ok().copied().flatten();
    local.waited.reached(key, receivers);
    local.queues.released(queue_key, receivers);
    released.map(|_| ())
}

/// The owner-checked release of permit `id` (`lua/sem_release.lua`, with
/// a marker so a resend after a lost reply can tell "released by my first
/// copy" from "gone"). A failure that may leave the permit in Redis hands
/// it to the client's cleanup. `Some(n)`: released now, the message
/// reached n subscribers.
fn release_id(
    client: &LockClient,
    key: &str,
    channel: &str,
    id: &str,
    budget: Duration,
) -> Result<Option<u64>, Error> {
    let (marker, millis) = release::marker_of(client, key, id);
    client.counters().commands(1);
    let markerless = std::cell::Cell::new(marker.is_none());
    let result = client.run_within(Op::SemRelease, key, budget, |con, send| {
        let reply: (i64, u64) =
            release::with_marker(client, marker.as_deref(), &markerless, |marker| {
                use script::wire::{Arg, present};
                script::wire::evalsha(
                    con,
                    &script::SEM_RELEASE,
                    &present([Some(Arg::from(key)), marker.map(Arg::from)]),
                    &present([
                        Some(Arg::from(id)),
                        Some(Arg::from(channel)),
                        Some(Arg::Int(millis)),
                        client
                            .sharded(channel)
                            .then_some(Arg::from(script::SHARDED)),
                    ]),
                )
            })?;
        Ok((reply, send.replied()))
    });
    let (reply, replied) = result.inspect_err(|err| {
        if err.may_leave_a_lease() {
            client.orphan(key, OrphanKind::Permit { id: Arc::from(id) });
        }
    })?;
    // The script ran: later drops may write their release behind (as a
    // plain lock's first release teaches its client).
    if !client.behind_ok() {
        client.scripts_work(true);
    }
    match reply {
        (1, receivers) => Ok(Some(receivers)),
        (2, _) => Ok(None),
        (other, _) => {
            let reason = release::not_held(other, &markerless);
            // "Not held", answered to a resend, proves nothing without a
            // marker: an earlier copy may have released it.
            release::check_resend(
                key,
                Err::<Option<u64>, _>(reason),
                replied,
                !markerless.get(),
                millis,
            )?
            .map_err(|reason| Error::not_held(key, reason))
        }
    }
}

/// A semaphore as Redis holds it now ([`Semaphore::status`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SemaphoreStatus {
    limit: Option<u32>,
    holders: Vec<PermitHolder>,
}

/// One live permit, as [`Semaphore::status`] saw it.
#[derive(Clone, PartialEq, Eq)]
pub struct PermitHolder {
    /// Redacted: the secret part of an id releases the permit.
    id: String,
    holder: Option<Holder>,
    remaining: Duration,
    fencing_token: Option<u64>,
}

impl SemaphoreStatus {
    /// The stored limit; `None` when nothing is stored (no permit out: the
    /// next acquire sets its own).
    pub fn limit(&self) -> Option<u32> {
        self.limit
    }

    /// The permits within their deadline, soonest to expire first.
    pub fn holders(&self) -> &[PermitHolder] {
        &self.holders
    }

    /// How many permits are out.
    pub fn in_use(&self) -> usize {
        self.holders.len()
    }

    /// How many more could be taken now under the stored limit (0 when a
    /// smaller limit was set while more were out); `None` without a stored
    /// limit.
    pub fn available(&self) -> Option<u32> {
        let used = u32::try_from(self.holders.len()).unwrap_or(u32::MAX);
        self.limit.map(|limit| limit.saturating_sub(used))
    }

    /// From `lua/sem_status.lua`'s reply (a limit of -1: a hash that is
    /// not a semaphore).
    fn parse(
        key: &str,
        (limit, live): (i64, Vec<(String, u64, u64)>),
    ) -> Result<SemaphoreStatus, Error> {
        let limit = match limit {
            0 => None,
            // -1: a hash without a limit; anything else out of range was
            // not written by a semaphore either.
            n => Some(u32::try_from(n).map_err(|_| Error::WrongType {
                key: key.to_owned(),
            })?),
        };
        let mut holders: Vec<PermitHolder> = live
            .into_iter()
            .map(|(id, ms, fence)| PermitHolder {
                id: redact(&id),
                holder: Holder::from_token(&id),
                remaining: Duration::from_millis(ms),
                fencing_token: (fence > 0).then_some(fence),
            })
            .collect();
        holders.sort_by_key(|h| h.remaining);
        Ok(SemaphoreStatus { limit, holders })
    }
}

impl std::fmt::Debug for PermitHolder {
    // The id is kept redacted already.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PermitHolder")
            .field("id", &self.id)
            .field("remaining", &self.remaining)
            .field("fencing_token", &self.fencing_token)
            .finish()
    }
}

impl PermitHolder {
    /// The permit's id ([`Permit::id`]) redacted: its secret part, which
    /// would release the permit, replaced by `…`
    /// ([`redact`](crate::redact)); the holder metadata after it.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Its time left by the server's clock when it was read.
    pub fn remaining(&self) -> Duration {
        self.remaining
    }

    /// Its fencing token, when it has one.
    pub fn fencing_token(&self) -> Option<u64> {
        self.fencing_token
    }

    /// Who holds it: the holder metadata its id carries (`None` for an id
    /// without, see [`Holder::from_token`]).
    pub fn holder(&self) -> Option<Holder> {
        self.holder.clone()
    }
}
