//! `RwLock`: many readers or one writer, all state in one hash (the
//! cluster variant of the article "Redis distributed read-write lock",
//! fixed so a reader can only release itself).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::client::LockClient;
use crate::client::holder::{Redacted, named_holder};
use crate::client::options::{MAX_TTL, RwLockOptions, WaitMode, check_min_replicas, ttl_millis};
use crate::client::release;
use crate::client::replicas;
use crate::conn::backend::Connection;
use crate::conn::policy::Op;
use crate::conn::stats::{LockKind, Tag};
use crate::error::{Error, LossReason};
use crate::lease::loss::{LossSignal, LossState};
use crate::lease::{local_expiry, remaining};
use crate::renew::watchdog::{OrphanKind, Renewal, WatchEntry};
use crate::script;
use crate::wait::acquire::{Attempt, Contender, Queued, Waiting, Within, acquire, blocking};
use crate::wait::queue::Queues;

/// The read-write lock's state in one client: its wait queues, apart from
/// plain locks of the same name. Nothing is ever handed over.
#[derive(Default)]
struct Local {
    queues: Queues<Infallible>,
}

impl std::fmt::Debug for Local {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Local").finish_non_exhaustive()
    }
}

/// A distributed read-write lock: any number of readers, or one writer.
///
/// Everything lives in one Redis hash (so it works on a cluster): the
/// writer's token and deadline, one field per reader with its own deadline,
/// and the writers waiting. Deadlines are decided inside the scripts by the
/// server's clock (`TIME`), never the clients'. Each holder removes only its
/// own field, so a reader can never release another reader, and a crashed
/// reader's field expires on its own without touching the others.
///
/// **Writer preference** by default: once a writer waits, new readers wait
/// too, so a stream of overlapping readers cannot starve writers;
/// [`RwLockExtra::prefer_readers`](crate::RwLockExtra::prefer_readers) lets readers in regardless. Releases publish
/// on the key's release channel; in [`WaitMode::Notify`] (the default)
/// waiting threads of a client queue up and the head sleeps until a release
/// message, never longer than the earliest holder deadline or a backoff
/// step; in [`WaitMode::Spin`] every waiter polls with backoff.
///
/// ```no_run
/// use redmutex::Lease;
///
/// # fn main() -> Result<(), redmutex::Error> {
/// let client = redmutex::LockClient::open("redis://127.0.0.1:6379/")?;
/// let catalog = redmutex::RwLock::new(&client, "catalog");
/// {
///     let _a = catalog.read()?;
///     let _b = catalog.read()?;              // readers share
///     assert!(catalog.try_write()?.is_none()); // a writer waits for them
/// }
/// let writer = catalog.write()?;
/// writer.unlock()?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct RwLock {
    client: LockClient,
    local: Arc<Local>,
    key: String,
    options: RwLockOptions,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Read,
    Write,
}

impl Mode {
    fn code(self) -> &'static str {
        match self {
            Mode::Read => "r",
            Mode::Write => "w",
        }
    }
}

impl RwLock {
    /// A read-write lock on `key` with the client's default options (their
    /// core: [`Options`](crate::Options)), writers preferred.
    pub fn new(client: &LockClient, key: impl Into<String>) -> RwLock {
        RwLock::with_options(client, key, client.defaults().for_rwlock())
    }

    /// A read-write lock on `key` with the given options. With
    /// [`WaitMode::Notify`], readers and writers of one client wait in one
    /// queue per key, and the head is woken by release messages.
    pub fn with_options(
        client: &LockClient,
        key: impl Into<String>,
        options: RwLockOptions,
    ) -> RwLock {
        RwLock {
            client: client.clone(),
            local: client.local::<Local>(),
            key: client.names().own_key(key.into()),
            options,
        }
    }

    /// The options it is taken with (read as `lock.options().ttl`,
    /// `lock.options().extra.prefer_readers`).
    pub fn options(&self) -> &RwLockOptions {
        &self.options
    }

    /// The lock key (a hash) as it is in Redis, the client's key prefix
    /// included.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Who holds the key now, by the server's clock, read in one step
    /// (`lua/inspect.lua`: one round trip, atomic, never a token's secret):
    /// the lock type found ([`LockKind::Read`](crate::LockKind::Read) while readers hold it, [`LockKind::Write`](crate::LockKind::Write) while a writer does), the time left, the readers (or 1 writer) and the
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

    /// Takes a read lock, waiting up to the options' `wait`.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`]; [`Error::InvalidArgument`] for an empty key or a
    /// bad ttl; [`Error::WrongType`] when the key is not a read-write
    /// lock (a string, another lock type's hash); [`Error::Redis`] or
    /// [`Error::Pool`].
    pub fn read(&self) -> Result<RwGuard, Error> {
        self.blocking(Mode::Read)
    }

    /// One attempt at a read lock.
    ///
    /// # Errors
    ///
    /// As [`RwLock::read`], without [`Error::Timeout`].
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_read(&self) -> Result<Option<RwGuard>, Error> {
        self.acquire(Mode::Read, Within::Once, &mut None)
    }

    /// Attempts a read lock until `wait` has passed.
    ///
    /// # Errors
    ///
    /// As [`RwLock::read`], without [`Error::Timeout`].
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_read_for(&self, wait: Duration) -> Result<Option<RwGuard>, Error> {
        self.acquire(Mode::Read, Within::For(wait), &mut None)
    }

    /// Attempts a read lock until `deadline` (at least one attempt, even
    /// with a deadline already past).
    ///
    /// # Errors
    ///
    /// As [`RwLock::read`], without [`Error::Timeout`].
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_read_until(&self, deadline: Instant) -> Result<Option<RwGuard>, Error> {
        self.acquire(Mode::Read, Within::Until(deadline), &mut None)
    }

    /// Takes the write lock, waiting up to the options' `wait`.
    ///
    /// # Errors
    ///
    /// As [`RwLock::read`].
    pub fn write(&self) -> Result<RwGuard, Error> {
        self.blocking(Mode::Write)
    }

    /// One attempt at the write lock (it does not make readers wait).
    ///
    /// # Errors
    ///
    /// As [`RwLock::read`], without [`Error::Timeout`].
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_write(&self) -> Result<Option<RwGuard>, Error> {
        self.acquire(Mode::Write, Within::Once, &mut None)
    }

    /// Attempts the write lock until `wait` has passed; while it waits, new
    /// readers wait too (unless [`RwLockExtra::prefer_readers`](crate::RwLockExtra::prefer_readers)).
    ///
    /// # Errors
    ///
    /// As [`RwLock::read`], without [`Error::Timeout`].
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_write_for(&self, wait: Duration) -> Result<Option<RwGuard>, Error> {
        self.acquire(Mode::Write, Within::For(wait), &mut None)
    }

    /// Attempts the write lock until `deadline` (at least one attempt, even
    /// with a deadline already past); while it waits, new readers wait too
    /// (unless [`RwLockExtra::prefer_readers`](crate::RwLockExtra::prefer_readers)).
    ///
    /// # Errors
    ///
    /// As [`RwLock::read`], without [`Error::Timeout`].
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_write_until(&self, deadline: Instant) -> Result<Option<RwGuard>, Error> {
        self.acquire(Mode::Write, Within::Until(deadline), &mut None)
    }

    fn blocking(&self, mode: Mode) -> Result<RwGuard, Error> {
        blocking(&self.key, self.options.wait, |within, seen| {
            self.acquire(mode, within, seen)
        })
    }

    /// The stats tag of this lock's reads or writes.
    fn tag(&self, mode: Mode) -> Tag {
        Tag {
            kind: match mode {
                Mode::Read => LockKind::Read,
                Mode::Write => LockKind::Write,
            },
            class: self.options.key_class,
        }
    }

    /// `seen`: who held it when the last attempt was refused (the
    /// writer's token, else a reader's, redacted), when the reply named
    /// one.
    fn acquire(
        &self,
        mode: Mode,
        within: Within,
        seen: &mut Option<String>,
    ) -> Result<Option<RwGuard>, Error> {
        let started = Instant::now();
        let result = self.acquire_inner(mode, within, seen);
        self.client
            .counters()
            .acquisition(self.tag(mode), started, result)
    }

    fn acquire_inner(
        &self,
        mode: Mode,
        within: Within,
        seen: &mut Option<String>,
    ) -> Result<Option<RwGuard>, Error> {
        if self.key.is_empty() {
            return Err(Error::InvalidArgument(
                "the lock key must not be empty".into(),
            ));
        }
        let millis = ttl_millis(self.options.ttl)?;
        check_min_replicas(self.options.extra.min_replicas, self.client.timeout())?;
        self.client.check_key(&self.key)?;
        let deadline = within.deadline();
        let token = self.client.new_token(&self.key)?;
        let key = self.key.as_str();
        // A waiting writer stays registered a little longer than it sleeps
        // between attempts, so a writer that gives up or dies stops holding
        // readers back soon.
        let fourth = match mode {
            Mode::Read => u64::from(self.options.extra.prefer_readers),
            Mode::Write => u64::try_from(
                self.options
                    .backoff
                    .max()
                    .saturating_mul(2)
                    .saturating_add(Duration::from_millis(200))
                    .min(MAX_TTL)
                    .as_millis(),
            )
            .unwrap_or(u64::MAX),
        };
        let waiting_writer = mode == Mode::Write && deadline.is_none_or(|d| d > Instant::now());
        let mut contender = Grant {
            lock: self,
            token: &token,
            mode,
            millis,
            fourth: if waiting_writer || mode == Mode::Read {
                fourth
            } else {
                0
            },
            seen: None,
        };
        let queue_key = format!("{}\u{0}rw", self.key);
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
                // Readers share: a reader must not queue behind a reader.
                barge: true,
                intercepts: false,
                on_orphan: &nothing,
                subscribe: &subscribe,
            }),
        };
        let result = acquire(&mut contender, deadline, self.options.backoff, waiting);
        *seen = contender.seen.take();
        if waiting_writer && !matches!(result, Ok(Some(_))) {
            // Gave up (or failed): stop holding readers back, now or as soon
            // as Redis answers. Now only within the call's own bound (its
            // wait, one connect and one resend window): after a failure
            // (the server did not answer) or with no time left, the
            // watchdog's cleanup takes it out in the background.
            let bound = deadline.and_then(|d| d.checked_add(self.client.call_slack()));
            let left = bound.map_or(Duration::MAX, |b| {
                b.saturating_duration_since(Instant::now())
            });
            let removed = result.is_ok()
                && !left.is_zero()
                && release_field(&self.client, key, &token, "q", left).is_ok();
            if !removed {
                self.client.orphan(key, OrphanKind::Rw { token });
            }
        }
        result
    }
}

/// One acquisition of an [`RwLock`], seen by the acquire loop.
struct Grant<'a> {
    lock: &'a RwLock,
    token: &'a str,
    mode: Mode,
    millis: u64,
    /// The script's fourth argument: prefer readers (a read), or how long a
    /// waiting writer stays registered (0: not waiting).
    fourth: u64,
    /// Who held it when the last attempt was refused (redacted), when the
    /// reply named a holder.
    seen: Option<String>,
}

impl Contender for Grant<'_> {
    type Won = RwGuard;
    type Gift = Infallible;

    fn attempt(&mut self, _quick: bool) -> Result<Attempt<RwGuard>, Error> {
        let (client, key, token) = (&self.lock.client, self.lock.key.as_str(), self.token);
        let extra = &self.lock.options.extra;
        // Writers only: readers do not exclude each other.
        let fence_key = (extra.fencing && self.mode == Mode::Write).then(|| client.fence_key(key));
        // Set once Redis granted the hold in this attempt: whatever fails
        // after that (the WAIT, say) leaves a hold to take out again.
        let granted = std::cell::Cell::new(false);
        let sent = Instant::now();
        client.counters().commands(1);
        let reply = client.run(Op::RwAcquire, key, |con, send| {
            let connection = replicas::node_connection_id(con, key, extra.min_replicas.is_some())?;
            let mut script = script::RW_ACQUIRE.key(key);
            if let Some(fence_key) = &fence_key {
                script.key(fence_key);
            }
            let reply: (i64, i64, u64, Option<String>) = script
                .arg(token)
                .arg(self.mode.code())
                .arg(self.millis)
                .arg(self.fourth)
                .invoke(con)?;
            if reply.0 != 1 {
                return Ok((reply, None));
            }
            granted.set(true);
            Ok((reply, self.await_replicas(con, send.resend, connection)?))
        });
        let ((acquired, wait_ms, fence, holder), short) = reply
            .map_err(|err| crate::mutex::fence_failure(key, fence_key.as_deref(), err))
            .inspect_err(|err| {
                if granted.get() || err.is_outcome_unknown() {
                    // A grant (or a writer's place in line) may have been
                    // written: take every field of it out again.
                    client.orphan(
                        key,
                        OrphanKind::Rw {
                            token: token.to_owned(),
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
        if acquired != 1 {
            // Who holds it, named from the reply; never kept whole.
            self.seen = holder.as_deref().and_then(named_holder);
            return Ok(Attempt::Held(
                u64::try_from(wait_ms).ok().map(Duration::from_millis),
            ));
        }
        let ttl = Duration::from_millis(self.millis);
        let tag = self.lock.tag(self.mode);
        let loss: Arc<LossState> = Arc::default();
        let options = &self.lock.options;
        // Each holder is renewed on its own: its field's deadline, never
        // another reader's.
        let watch = options.watchdog.then(|| {
            let cap = options.max_hold.and_then(|cap| sent.checked_add(cap));
            client.watchdog().watch(
                Renewal::Rw {
                    write: self.mode == Mode::Write,
                },
                tag,
                &Arc::from(key),
                &Arc::from(token),
                sent,
                ttl,
                cap,
                loss.clone(),
            )
        });
        Ok(Attempt::Won(RwGuard {
            client: client.clone(),
            key: key.to_owned(),
            token: token.to_owned(),
            mode: self.mode,
            sent,
            ttl,
            released: false,
            unsettled: false,
            tag,
            held_since: Instant::now(),
            loss,
            watch,
            watched: options.watchdog,
            cap: options.max_hold.and_then(|cap| sent.checked_add(cap)),
            fence: fence_key.is_some().then_some(fence),
        }))
    }

    fn accept(&mut self, gift: Infallible) -> Result<Option<RwGuard>, Error> {
        match gift {}
    }
}

impl Grant<'_> {
    /// With [`RwLockExtra::min_replicas`](crate::RwLockExtra::min_replicas):
    /// `WAIT` on the connection that granted the hold; when fewer replicas
    /// acknowledged, the hold is released again on that connection and
    /// how many did is returned. After a lost reply (`resend`), the grant
    /// was written on another connection: this one renews the hold first
    /// (owner-checked, `lua/rw_extend.lua`), so the `WAIT` counts a write
    /// of the hold.
    fn await_replicas(
        &self,
        con: &mut Connection,
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
                let _renewed: i64 = script::RW_EXTEND
                    .key(key)
                    .arg(self.token)
                    .arg(self.mode.code())
                    .arg(self.millis)
                    .invoke(con)?;
                Ok(())
            },
            |con| {
                client.counters().commands(1);
                let channel = client.release_channel(key);
                let mut release = script::RW_RELEASE.key(key);
                release
                    .arg(self.token)
                    .arg(self.mode.code())
                    .arg(&channel)
                    .arg(1);
                if client.sharded(&channel) {
                    release.arg(script::SHARDED);
                }
                let _released: i64 = release.invoke(con)?;
                Ok(())
            },
        )
    }
}

/// Removes one holder's field (`r`, `w` or `q` for a waiting writer):
/// 1 released, 0 gone, -1 another writer holds the write lock. A release
/// sent again after a lost reply answers from its marker.
fn release_field(
    client: &LockClient,
    key: &str,
    token: &str,
    code: &str,
    budget: Duration,
) -> Result<i64, Error> {
    let channel = client.release_channel(key);
    let (marker, millis) = release::marker_of(client, key, token);
    client.counters().commands(1);
    let markerless = std::cell::Cell::new(marker.is_none());
    let (reply, send) = client.run_within(Op::RwRelease, key, budget, |con, send| {
        let reply: i64 = release::with_marker(client, marker.as_deref(), &markerless, |marker| {
            let mut script = script::RW_RELEASE.key(key);
            if let Some(marker) = marker {
                script.key(marker);
            }
            script.arg(token).arg(code).arg(&channel).arg(millis);
            if client.sharded(&channel) {
                script.arg(script::SHARDED);
            }
            script.invoke(con)
        })?;
        Ok((reply, send.replied()))
    })?;
    if reply != 1 && code != "q" {
        let reason = release::not_held(reply, &markerless);
        // "Not held", answered to a resend, proves nothing without a marker.
        let _answer =
            release::check_resend(key, Err::<(), _>(reason), send, !markerless.get(), millis)?;
    }
    // -2 and -3 are 0 and -1 whose marker could not be read.
    Ok(match reply {
        -2 => 0,
        -3 => -1,
        other => other,
    })
}

/// A read or write hold of an [`RwLock`]. Dropping it releases it (best
/// effort); [`RwGuard::unlock`](crate::Lease::unlock) reports the outcome.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct RwGuard {
    client: LockClient,
    key: String,
    token: String,
    mode: Mode,
    sent: Instant,
    ttl: Duration,
    released: bool,
    /// A downgrade's outcome is unknown: Redis holds either this writer's
    /// fields or its reader's, so the release removes every field of the
    /// token (`'x'`), and the hold is treated as neither a write nor a
    /// settled read until a downgrade sent again settles it.
    unsettled: bool,
    /// For the client's stats: the lock type and key class.
    tag: Tag,
    /// When this hold began.
    held_since: Instant,
    /// Set when Redis said the hold is gone (an extension or the
    /// watchdog's renewal), or, watched, from its local expiry on.
    loss: Arc<LossState>,
    /// The watchdog's entry, when it renews this hold (it then owns the
    /// hold's timing).
    watch: Option<Arc<WatchEntry>>,
    /// Whether the caller asked for the watchdog, and the renewals' cap
    /// (`max_hold`): what a downgrade needs to watch the read hold.
    watched: bool,
    cap: Option<Instant>,
    /// The writer's fencing token, when the lock fences.
    fence: Option<u64>,
}

impl std::fmt::Debug for RwGuard {
    // The token is a capability: only its public part is shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RwGuard")
            .field("key", &self.key)
            .field("token", &Redacted(&self.token))
            .field("mode", &self.mode)
            .field("unsettled", &self.unsettled)
            .field("released", &self.released)
            .finish_non_exhaustive()
    }
}

impl RwGuard {
    /// This holder's token (its own field in the hash): a random secret
    /// and the holder metadata ([`Holder::from_token`](crate::Holder::from_token)).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Whether this is the write lock: false once
    /// [`downgrade`](RwGuard::downgrade)d, and after a downgrade whose
    /// outcome is unknown (until a downgrade sent again settles it).
    pub fn is_write(&self) -> bool {
        self.mode == Mode::Write && !self.unsettled
    }

    /// What the release script removes: this holder's field, or after a
    /// downgrade whose outcome is unknown, every field of the token.
    fn code(&self) -> &'static str {
        if self.unsettled {
            "x"
        } else {
            self.mode.code()
        }
    }

    /// Turns this write hold into a read hold in one atomic step
    /// (`lua/rw_downgrade.lua`), owner-checked: the writer's fields go and
    /// this holder's reader field comes in the same script, so no other
    /// writer can take the lock in between. Waiting writers stay queued:
    /// with writer preference, new readers still wait behind them, while
    /// this holder reads at once. The read hold gets the hold's current
    /// lease (its ttl, or the last [`extend`](crate::Lease::extend)'s) from
    /// now by the server's clock; waiting readers are told.
    ///
    /// It changes the guard in place (`&mut self`) rather than consuming
    /// it, so that on an error the caller still has its guard, and whatever
    /// the hold then is, its release (or drop) takes it out.
    ///
    /// After it, [`is_write`](RwGuard::is_write) is false and
    /// [`fencing_token`](crate::Lease::fencing_token) is `None`: a reader
    /// orders nothing, and the writer's number must not pass writes made
    /// under a read hold. A watched guard's watchdog renews the reader's
    /// field from then on, with the same
    /// [`loss_signal`](crate::Lease::loss_signal).
    ///
    /// Safe to send twice: a resend after a lost reply finds this token
    /// reading and not writing, and answers "downgraded". When no reply
    /// comes back at all ([`Error::OutcomeUnknown`], or another error from
    /// Redis), the hold is either still the write hold or already the read
    /// hold: the guard then reports neither ([`is_write`](RwGuard::is_write)
    /// false, no fencing token, [`extend`](crate::Lease::extend) refused),
    /// its watchdog stops (the hold reads as lost from its local expiry),
    /// and its release removes every field of the token. Calling
    /// `downgrade` again settles it: it answers as the first run would
    /// have.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a read hold, or a guard inherited
    /// through `fork()` (nothing is sent, nothing changes);
    /// [`Error::NotHeld`] ([`LossReason::Expired`] when the write hold is
    /// gone, [`LossReason::OwnedByOther`] when another writer holds the
    /// lock), after which [`is_lost`](crate::Lease::is_lost) is true;
    /// [`Error::WrongType`] when the key is another type's, or
    /// [`Error::Pool`] (nothing changes: still the write hold);
    /// [`Error::OutcomeUnknown`] or [`Error::Redis`] (the outcome is
    /// unknown, as above).
    pub fn downgrade(&mut self) -> Result<(), Error> {
        self.client.check_process()?;
        if self.mode == Mode::Read {
            return Err(Error::InvalidArgument(
                "only a write hold can be downgraded; this is a read hold".into(),
            ));
        }
        if self.released {
            return Err(Error::not_held(&self.key, LossReason::Expired));
        }
        let (lease_sent, ttl) = self.timing();
        let millis = ttl_millis(ttl)?;
        // The write hold's renewals end before the request leaves: one
        // that runs after the downgrade finds no writer, which must not
        // read as a loss (an ended entry's renewal reports none).
        if let Some(entry) = self.watch.take() {
            self.client.watchdog().end(&entry);
        }
        let key = self.key.as_str();
        let channel = self.client.release_channel(key);
        let sharded = self.client.sharded(&channel);
        let sent = Instant::now();
        self.client.counters().commands(1);
        let result = self.client.run(Op::RwDowngrade, key, |con, _| {
            let mut script = script::RW_DOWNGRADE.key(key);
            script.arg(&self.token).arg(millis).arg(&channel);
            if sharded {
                script.arg(script::SHARDED);
            }
            script.invoke::<i64>(con)
        });
        match result {
            Ok(1) => {
                self.mode = Mode::Read;
                self.unsettled = false;
                self.fence = None;
                // The reader's deadline was set from a moment no earlier
                // than this send.
                self.sent = sent;
                self.ttl = ttl;
                self.watch = self.watch_as(false, sent, ttl);
                Ok(())
            }
            Ok(0) => {
                self.loss.lose(LossReason::Expired);
                Err(Error::not_held(key, LossReason::Expired))
            }
            Ok(_) => {
                self.loss.lose(LossReason::OwnedByOther);
                Err(Error::not_held(key, LossReason::OwnedByOther))
            }
            // Refused before anything ran (no connection, another type's
            // key): still the write hold (or, after an earlier unknown
            // outcome, still unsettled), renewed as before.
            Err(err @ (Error::Pool(_) | Error::WrongType { .. })) => {
                if !self.unsettled {
                    self.watch = self.watch_as(true, lease_sent, ttl);
                }
                Err(err)
            }
            // The script may have run (its reply lost, or an error inside
            // it): the hold is the writer's or already the reader's, and
            // no renewal can be sent without knowing which. The guard
            // claims neither: no writes under it (no fencing token), and
            // its release removes every field of the token. Its lease
            // counts from the earlier of the two deadlines, and a watched
            // hold reads as lost when that passes. A downgrade sent again
            // settles it (the script answers 1 for a reader).
            Err(err) => {
                self.unsettled = true;
                self.fence = None;
                self.sent = lease_sent;
                self.ttl = ttl;
                if self.watched {
                    self.loss
                        .expire_at(local_expiry(lease_sent, ttl), LossReason::Unreachable);
                }
                Err(err)
            }
        }
    }

    /// The watchdog's entry for this hold as the writer (`write`) or a
    /// reader, its lease set by a request sent at `sent` for `ttl`; `None`
    /// when the caller did not ask for the watchdog.
    fn watch_as(&self, write: bool, sent: Instant, ttl: Duration) -> Option<Arc<WatchEntry>> {
        self.watched.then(|| {
            self.client.watchdog().watch(
                Renewal::Rw { write },
                self.tag,
                &Arc::from(self.key.as_str()),
                &Arc::from(self.token.as_str()),
                sent,
                ttl,
                self.cap,
                self.loss.clone(),
            )
        })
    }

    /// When the request that set the hold's current deadline was sent, and
    /// its ttl.
    fn timing(&self) -> (Instant, Duration) {
        match &self.watch {
            Some(entry) => entry.lease(),
            None => (self.sent, self.ttl),
        }
    }

    fn release(&mut self) -> Result<(), Error> {
        self.released = true;
        // A forked child's copy of its parent's hold: refused, nothing sent
        // (and the watch entry, whose lock a parent thread may have held
        // at the fork, left alone).
        self.client.check_process()?;
        if let Some(entry) = &self.watch {
            self.client.watchdog().end(entry);
        }
        let result = self.let_go();
        self.client
            .counters()
            .release(self.tag, Some(self.held_since), false, result)
    }

    fn let_go(&mut self) -> Result<(), Error> {
        let released = release_field(
            &self.client,
            &self.key,
            &self.token,
            self.code(),
            Duration::MAX,
        )
        .inspect_err(|err| {
            if err.may_leave_a_lease() {
                // Released in the background once Redis answers.
                self.client.orphan(
                    &self.key,
                    OrphanKind::Rw {
                        token: self.token.clone(),
                    },
                );
            }
        })?;
        match released {
            1 => Ok(()),
            0 => Err(Error::not_held(&self.key, LossReason::Expired)),
            _ => Err(Error::not_held(&self.key, LossReason::OwnedByOther)),
        }
    }
}

impl crate::lease::sealed::Sealed for RwGuard {}

impl crate::lease::Lease for RwGuard {
    /// The lock key.
    fn key(&self) -> &str {
        &self.key
    }

    /// The lease left by the local clock since this hold's acquisition or
    /// last [`RwGuard::extend`](crate::Lease::extend), minus the drift allowance; zero once
    /// released or lost.
    fn validity(&self) -> Duration {
        if self.released || self.is_lost() {
            return Duration::ZERO;
        }
        let (sent, ttl) = self.timing();
        remaining(sent, ttl, Instant::now())
    }

    /// Whether the hold was found lost: an [`RwGuard::extend`](crate::Lease::extend) or the
    /// watchdog found its field gone (the lease ran out) or, for the
    /// writer, another writer in its place; or, watched, its lease ran out
    /// by the local clock with no successful renewal. Always true in a
    /// process forked since it was taken.
    fn is_lost(&self) -> bool {
        self.client.inherited() || self.loss.reason().is_some()
    }

    /// A signal, usable from any thread and after the guard is gone, that
    /// fires when the hold is found lost.
    fn loss_signal(&self) -> LossSignal {
        LossSignal {
            state: self.loss.clone(),
        }
    }

    fn fencing_token(&self) -> Option<u64> {
        self.fence
    }

    /// Whether Redis still has this hold (this reader's field, or this
    /// writer's token) within its deadline, by the server's clock. Changes
    /// nothing.
    ///
    /// # Errors
    ///
    /// [`Error::WrongType`] when the key is not a hash; [`Error::Redis`]
    /// or [`Error::Pool`]; [`Error::InvalidArgument`] for a guard
    /// inherited through `fork()` (nothing is sent).
    fn is_held(&self) -> Result<bool, Error> {
        if self.released {
            return Ok(false);
        }
        let key = self.key.as_str();
        self.client.counters().commands(1);
        // A read: a lost reply is asked again. The writer's token and
        // deadline, or this reader's deadline, with the server's time.
        let (ours, deadline, now) = match self.mode {
            // After a downgrade of unknown outcome: the writer's hold or
            // the reader's, whichever Redis has.
            Mode::Write if self.unsettled => {
                let reader = format!("r:{}", self.token);
                let (owner, wexp, rexp, now): (
                    Option<String>,
                    Option<u64>,
                    Option<u64>,
                    (u64, u64),
                ) = self.client.run(Op::Read, key, |con, _| {
                    redis::pipe()
                        .cmd("HGET")
                        .arg(key)
                        .arg("w")
                        .cmd("HGET")
                        .arg(key)
                        .arg("wexp")
                        .cmd("HGET")
                        .arg(key)
                        .arg(&reader)
                        .cmd("TIME")
                        .query(con)
                })?;
                let writing = owner.as_deref() == Some(self.token.as_str());
                let deadline = if writing { wexp.max(rexp) } else { rexp };
                (true, deadline, now)
            }
            Mode::Write => {
                let (owner, deadline, now): (Option<String>, Option<u64>, (u64, u64)) =
                    self.client.run(Op::Read, key, |con, _| {
                        redis::pipe()
                            .cmd("HGET")
                            .arg(key)
                            .arg("w")
                            .cmd("HGET")
                            .arg(key)
                            .arg("wexp")
                            .cmd("TIME")
                            .query(con)
                    })?;
                (owner.as_deref() == Some(self.token.as_str()), deadline, now)
            }
            Mode::Read => {
                let reader = format!("r:{}", self.token);
                let (deadline, now): (Option<u64>, (u64, u64)) =
                    self.client.run(Op::Read, key, |con, _| {
                        redis::pipe()
                            .cmd("HGET")
                            .arg(key)
                            .arg(&reader)
                            .cmd("TIME")
                            .query(con)
                    })?;
                (true, deadline, now)
            }
        };
        let now_ms = now.0.saturating_mul(1000).saturating_add(now.1 / 1000);
        Ok(ours && deadline.is_some_and(|d| d > now_ms))
    }

    /// Sets this hold's deadline to `ttl` from now by the server's clock
    /// (`lua/rw_extend.lua`), if Redis still has it: owner-checked, it
    /// never re-creates a hold that ran out and never moves a deadline
    /// earlier (a `ttl` shorter than what is left changes nothing). The
    /// hash's own expiry follows its latest deadline.
    ///
    /// Safe to send twice: a resend after a lost reply finds the same
    /// hold and sets a deadline no earlier (the local estimate keeps
    /// counting from the first send).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a ttl under 1 ms or over ten years,
    /// a guard inherited through `fork()`, or one whose
    /// [`downgrade`](RwGuard::downgrade) has an unknown outcome (nothing is
    /// sent: downgrade again to settle it);
    /// [`Error::NotHeld`] ([`LossReason::Expired`] when its field is
    /// gone, [`LossReason::OwnedByOther`] when another writer holds the
    /// write lock), after which [`RwGuard::is_lost`](crate::Lease::is_lost) is true;
    /// [`Error::WrongType`] when the key is another type's (nothing
    /// changes); [`Error::Redis`], [`Error::Pool`] or
    /// [`Error::OutcomeUnknown`].
    fn extend(&mut self, ttl: Duration) -> Result<(), Error> {
        self.client.check_process()?;
        let millis = ttl_millis(ttl)?;
        if self.released {
            return Err(Error::not_held(&self.key, LossReason::Expired));
        }
        if self.unsettled {
            // Which field to renew is not known: renewing the writer's
            // would call a done downgrade a loss.
            return Err(Error::InvalidArgument(
                "a downgrade's outcome is unknown: downgrade again to settle it, or unlock".into(),
            ));
        }
        let key = self.key.as_str();
        let generation = self.watch.as_ref().map(|entry| entry.generation());
        let sent = Instant::now();
        self.client.counters().commands(1);
        let renewed: i64 = self.client.run(Op::RwExtend, key, |con, _| {
            script::RW_EXTEND
                .key(key)
                .arg(&self.token)
                .arg(self.mode.code())
                .arg(millis)
                .invoke(con)
        })?;
        match renewed {
            1 => {
                let asked = Duration::from_millis(millis);
                if let Some(entry) = &self.watch {
                    // The watchdog's entry owns the timing of a watched
                    // hold (it keeps the earlier expiry when a renewal
                    // raced this one: an underestimate).
                    entry.renewed(sent, asked, generation.unwrap_or_default());
                    return Ok(());
                }
                // The deadline in Redis is the later of the two: so is
                // the local estimate.
                if remaining(sent, asked, sent) >= remaining(self.sent, self.ttl, sent) {
                    self.sent = sent;
                    self.ttl = asked;
                }
                Ok(())
            }
            0 => {
                self.loss.lose(LossReason::Expired);
                Err(Error::not_held(key, LossReason::Expired))
            }
            _ => {
                self.loss.lose(LossReason::OwnedByOther);
                Err(Error::not_held(key, LossReason::OwnedByOther))
            }
        }
    }

    /// Releases this hold: removes only this holder's field.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] ([`LossReason::Expired`] when its field is
    /// gone, [`LossReason::OwnedByOther`] when another writer holds the
    /// write lock); [`Error::Redis`], [`Error::Pool`] or [`Error::WrongType`];
    /// [`Error::InvalidArgument`] for a guard inherited through `fork()`
    /// (nothing is sent: the hold is the parent's).
    fn unlock(mut self) -> Result<crate::lease::Unlocked, Error> {
        self.release().map(|()| crate::lease::Unlocked::Released)
    }
}

impl Drop for RwGuard {
    fn drop(&mut self) {
        // A forked child's copy of its parent's hold: not the child's.
        if self.client.inherited() {
            self.released = true;
        }
        if !self.released
            && let Err(err) = self.release()
        {
            log::warn!(
                "redmutex: releasing read-write hold of {:?} on drop: {err}",
                self.key
            );
        }
    }
}
