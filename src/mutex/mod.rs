//! The plain lock: `DistributedLock` (one key, and the ways to acquire it),
//! its lease, its guard and the thread-local holds.
//!
//! Depends on `client`, `wait`, `renew`, `lease` and `script`. Supplies the
//! acquire loop with one attempt (`SET NX PX GET`, followed by `PTTL` when
//! it lost and the holder's time left is needed; `lua/acquire.lua` for a
//! fencing token, or on a server that refuses `NX` with `GET`) and with
//! handoffs taken from other threads of the same client.
//!
//! Invariants: a token is fresh per acquisition and never reused after a
//! release; at most one lease per client, thread and key is live in the
//! holds table; a lease is released exactly once, in Redis or by handing it
//! to a queued thread, and whatever Redis may still hold after a failure
//! goes to the client's cleanup.

pub(crate) mod guard;
pub(crate) mod holds;
pub(crate) mod lease;

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::client::LockClient;
use crate::client::holder::named_holder;
use crate::client::options::{LockOptions, WaitMode, check_min_replicas, ttl_millis};
use crate::client::{release, replicas};
use crate::conn::policy::Op;
use crate::error::Error;
use crate::mutex::guard::LockGuard;
use crate::mutex::lease::{Handoff, HandoffPolicy, Lease, Local, release_and_tell, tag_of};
use crate::renew::watchdog::OrphanKind;
use crate::script;
use crate::wait::acquire::{Attempt, Contender, Queued, Waiting, Within, acquire, blocking};

/// How long `force_release`'s marker lives: an hour.
const FORCE_MARKER_MILLIS: u64 = 3_600_000;

/// A named lock in Redis: one key. Cheap to make and to clone, `Send` and
/// `Sync`; holds no connection and no state in Redis until acquired.
///
/// Acquiring sends `SET key token NX PX ttl GET` (one round trip, a fresh
/// token per acquisition, a random secret followed by the holder metadata; the `GET` makes a wrong-typed key an error
/// instead of a lock that is never free, and lets a reply lost on a dropped
/// connection be recognised on retry). A server before Redis 7.0 refuses
/// `NX` with `GET`: from its first refusal on, the client acquires with a
/// script that does the same in two steps.
///
/// A thread that already holds the key through the same [`LockClient`] gets
/// a nested guard at once, with nothing sent to Redis.
///
/// Locks and clients go freely between threads; guards stay on theirs:
///
/// ```
/// fn assert_send_sync<T: Send + Sync>() {}
/// assert_send_sync::<redmutex::DistributedLock>();
/// assert_send_sync::<redmutex::LockClient>();
/// ```
#[derive(Clone, Debug)]
pub struct DistributedLock {
    client: LockClient,
    local: Arc<Local>,
    /// Shared with every lease of this lock (no copy per acquisition).
    key: Arc<str>,
    /// The key's release channel, named once, shared likewise.
    channel: Arc<str>,
    options: LockOptions,
}

impl DistributedLock {
    /// A lock on `key` with the client's default options.
    pub fn new(client: &LockClient, key: impl Into<String>) -> DistributedLock {
        DistributedLock::with_options(client, key, *client.defaults())
    }

    /// A lock on `key` with the given options.
    pub fn with_options(
        client: &LockClient,
        key: impl Into<String>,
        options: LockOptions,
    ) -> DistributedLock {
        let key: Arc<str> = client.names().own_key(key.into()).into();
        let local = client.local::<Local>();
        DistributedLock {
            client: client.clone(),
            channel: client.release_channel(&key).into(),
            local,
            key,
            options,
        }
    }

    /// The lock key as it is in Redis: the client's
    /// [key prefix](crate::LockClientBuilder::key_prefix), if any, followed
    /// by the name given to [`DistributedLock::new`].
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The options this lock acquires with (read as
    /// `lock.options().ttl`, `lock.options().extra.fencing`).
    pub fn options(&self) -> &LockOptions {
        &self.options
    }

    /// Acquires the lock, waiting up to the options' `wait` while another
    /// owner holds it: by the options' [`WaitMode`](crate::WaitMode)
    /// (woken by the release in notify mode, the default; polling with
    /// backoff in spin mode), never sleeping past the deadline, with one
    /// last attempt at it.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when the lock stayed held for the whole wait;
    /// [`Error::Redis`] or [`Error::OutcomeUnknown`] also when a lease
    /// another thread of this client handed over could not be confirmed
    /// in Redis (its token then goes to the client's cleanup);
    /// [`Error::InvalidArgument`] for an empty key or a ttl under 1 ms
    /// (nothing is sent); [`Error::WrongType`] when the key holds a
    /// non-string value; [`Error::Redis`] or [`Error::Pool`] when Redis
    /// cannot be reached or fails (at once, not after the wait).
    pub fn lock(&self) -> Result<LockGuard, Error> {
        blocking(&self.key, self.options.wait, |within, seen| {
            self.acquire(within, seen)
        })
    }

    /// One attempt: `Ok(None)` when another owner holds the lock. To learn
    /// who, in the same round trip: one attempt through
    /// [`DistributedLock::lock`] with a `wait` of zero, whose
    /// [`Error::Timeout`] names the holder the refusal named.
    ///
    /// # Errors
    ///
    /// As [`DistributedLock::lock`], without [`Error::Timeout`].
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_lock(&self) -> Result<Option<LockGuard>, Error> {
        self.acquire(Within::Once, &mut None)
    }

    /// Attempts until the lock is had or `wait` has passed: `Ok(None)` when
    /// another owner held it throughout.
    ///
    /// # Errors
    ///
    /// As [`DistributedLock::lock`], without [`Error::Timeout`].
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_lock_for(&self, wait: Duration) -> Result<Option<LockGuard>, Error> {
        self.acquire(Within::For(wait), &mut None)
    }

    /// Attempts until the lock is had or `deadline` has passed (at least
    /// once, even for a deadline already past): `Ok(None)` when another
    /// owner held it throughout.
    ///
    /// # Errors
    ///
    /// As [`DistributedLock::lock`], without [`Error::Timeout`].
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_lock_until(&self, deadline: Instant) -> Result<Option<LockGuard>, Error> {
        self.acquire(Within::Until(deadline), &mut None)
    }

    /// Releases the lock held under `token` (owner-checked), for tools and
    /// operators who know the token but hold no guard: `redmutex release
    /// --token`, or a child process of `redmutex run` that got it in
    /// `REDMUTEX_TOKEN`. Nothing is deleted unless the key holds `token`.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] when the key is gone or holds another token;
    /// [`Error::InvalidArgument`] for an empty key or token; [`Error::Redis`],
    /// [`Error::Pool`] or [`Error::WrongType`].
    pub fn release_token(&self, token: &str) -> Result<(), Error> {
        if self.key.is_empty() || token.is_empty() {
            return Err(Error::InvalidArgument(
                "the lock key and the token must not be empty".into(),
            ));
        }
        self.client.check_release(self.options.extra.release)?;
        self.client.check_key(&self.key)?;
        // A token of a thread of this client: its queued threads must not
        // wait for a handoff of a lock released under it (before the
        // release, so the wake-up it causes finds the head free to ask).
        self.local.queues.unhold(&self.key, token);
        release_and_tell(
            &self.client,
            &self.local,
            &self.key,
            &self.channel,
            token,
            self.options.extra.release,
        )
    }

    /// Who holds the key now, by the server's clock, read in one step
    /// (`lua/inspect.lua`: one round trip, atomic, never a token's secret):
    /// the lock type found ([`LockKind::Mutex`](crate::LockKind::Mutex) for a plain lock), the time left, how many hold it and
    /// the holders' metadata ([`Holder`](crate::Holder)). `None` when it
    /// is free. A key held by another lock type of this crate is reported
    /// as that type. Changes nothing; a lost reply is asked again.
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

    /// Deletes the key whatever it holds, for operators breaking a lock
    /// whose holder is known to be gone (`redmutex release --force`), and
    /// returns the token that was in it (`None`: it was free). Not
    /// owner-checked: a holder that is still alive loses its lock without
    /// being told, until its next extend or release.
    ///
    /// Safe to send twice (`lua/force_release.lua` records what it deleted
    /// under a fresh request id before deleting): a resend after a lost
    /// reply answers what the first send deleted and never deletes a lock
    /// somebody took in between.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty key (or, on Redis Cluster, a
    /// key with `}` and no valid `{tag}`); [`Error::WrongType`] when the key
    /// is not a plain lock; [`Error::OutcomeUnknown`], [`Error::Redis`] or
    /// [`Error::Pool`].
    pub fn force_release(&self) -> Result<Option<String>, Error> {
        if self.key.is_empty() {
            return Err(Error::InvalidArgument(
                "the lock key must not be empty".into(),
            ));
        }
        self.client.check_key(&self.key)?;
        let key: &str = &self.key;
        let request = uuid::Uuid::new_v4().to_string();
        let marker = self.client.names().marker_anywhere(key, &request);
        // Long-lived (an operator's rare act): on a cluster redis-rs may
        // deliver a copy of the request much later than the first, and the
        // copy must still find the marker rather than delete a new lock.
        let millis = FORCE_MARKER_MILLIS;
        let cluster = self.client.deployment() == crate::conn::backend::Deployment::Cluster;
        // Without its marker (an ACL without the `{KEY}:released:*` keys) a
        // force release is a bare GETDEL, which must not run twice (the
        // second could delete a lock taken in between): sent once, and
        // never on a cluster, where redis-rs may send it again by itself.
        let markerless = std::cell::Cell::new(!self.client.markers_allowed());
        let unsent = std::cell::Cell::new(false);
        self.client.counters().commands(1);
        let token: Option<String> = self.client.run(Op::ForceRelease, key, |con, send| {
            if !markerless.get() {
                match script::FORCE_RELEASE
                    .key(key)
                    .key(&marker)
                    .arg(millis)
                    .invoke(con)
                {
                    // The marker, or the key itself: the GETDEL below
                    // tells which.
                    Err(err) if crate::error::server_code(&err) == Some("NOPERM") => {
                        markerless.set(true)
                    }
                    other => return other,
                }
            }
            if cluster || send.resend {
                unsent.set(true);
                return Ok(None);
            }
            self.client.counters().commands(1);
            let deleted: Option<String> = redis::cmd("GETDEL").arg(key).query(con)?;
            // The key was allowed: the markers were what the ACL refused.
            self.client.refuse_markers();
            Ok(deleted)
        })?;
        if unsent.get() {
            return Err(if cluster {
                Error::Unsupported {
                    command: "the key or its {KEY}:released:* marker (NOPERM)".into(),
                    needed_by: "force_release on Redis Cluster (only its marker makes a request \
                                redis-rs may send twice safe; see the ACL rules in the failure model chapter of the guide, redmutex::guide::failure_model)",
                    detail: format!("no marker can be written for {key:?}"),
                }
            } else {
                Error::OutcomeUnknown {
                    key: key.to_owned(),
                    operation: Op::ForceRelease.name(),
                    source: redis::RedisError::from((
                        redis::ErrorKind::Io,
                        "the reply to a force release without a marker was lost; it is not sent \
                         twice",
                    )),
                }
            });
        }
        if let Some(token) = &token {
            self.local.queues.unhold(key, token);
        }
        self.local.queues.released(key, None);
        Ok(token)
    }

    /// `seen`: who held it when the last attempt was refused, when the
    /// reply named a holder (their token, redacted).
    fn acquire(
        &self,
        within: Within,
        seen: &mut Option<String>,
    ) -> Result<Option<LockGuard>, Error> {
        let started = Instant::now();
        let result = self.acquire_inner(within, seen);
        self.client
            .counters()
            .acquisition(tag_of(&self.options), started, result)
    }

    fn acquire_inner(
        &self,
        within: Within,
        seen: &mut Option<String>,
    ) -> Result<Option<LockGuard>, Error> {
        if self.key.is_empty() {
            return Err(Error::InvalidArgument(
                "the lock key must not be empty".into(),
            ));
        }
        let millis = ttl_millis(self.options.ttl)?;
        check_min_replicas(self.options.extra.min_replicas, self.client.timeout())?;
        self.client.check_release(self.options.extra.release)?;
        self.client.check_key(&self.key)?;
        // A lease whose time is up is not re-entered: a new one is acquired
        // (and replaces it in the table).
        if let Some(lease) = holds::current::<Lease>(self.client.id(), &self.key)
            && !lease.is_released()
            && !lease.validity().is_zero()
        {
            return Ok(Some(LockGuard::new(lease)));
        }
        let deadline = within.deadline();
        let mut contender = Plain {
            lock: self,
            token: None,
            millis,
            seen: None,
        };
        // A lease handed to this waiter after it gave up, with nobody left
        // to take it: released like any other (passed on, or unheld and
        // released in Redis), so no local hold outlives it.
        let release_orphan = |orphan: Handoff| {
            drop(Lease::handed_over(
                self.client.clone(),
                self.local.clone(),
                self.key.clone(),
                self.channel.clone(),
                &self.options,
                orphan,
            ));
        };
        // Named once per lock handle, like the releases' messages.
        let subscribe = |waker| self.client.subscribe(&self.channel, waker);
        let waiting = match self.options.wait_mode {
            WaitMode::Spin => Waiting::Spin,
            WaitMode::Notify => Waiting::Queued(Queued {
                queues: &self.local.queues,
                key: &self.key,
                // A handed-over lease has the giver's token: no fencing
                // token of its own, and no WAIT for replicas of it.
                takes_handoffs: !self.options.extra.fencing
                    && self.options.extra.min_replicas.is_none(),
                barge: false,
                // The same leases a handoff would give this thread, and only
                // with handoffs on for this handle (`local_handoff(false)`
                // turns both off).
                intercepts: HandoffPolicy::of(&self.options).enabled
                    && self.options.extra.min_replicas.is_none(),
                on_orphan: &release_orphan,
                subscribe: &subscribe,
            }),
        };
        let lease = acquire(&mut contender, deadline, self.options.backoff, waiting);
        *seen = contender.seen.take();
        let lease = lease?;
        Ok(lease.map(|lease| {
            holds::enter(self.client.id(), &self.key, &lease);
            LockGuard::new(lease)
        }))
    }

    /// `SET key token NX PX millis GET`: `nil` means we set it; our own
    /// token means an earlier send of this very request set it and its reply
    /// was lost. With `pttl`, a key held by another is followed by its
    /// `PTTL` (a second round trip, only when the first did not win: a
    /// waiter that must not sleep past the holder's expiry learns it for
    /// two commands where `lua/acquire.lua` costs three, and one when the
    /// key is free, as it is for a waiter woken by a release).
    fn set_nx(
        &self,
        shared: &Arc<str>,
        millis: u64,
        pttl: bool,
        seen: &mut Option<String>,
    ) -> Result<Attempt<Rc<Lease>>, Error> {
        let (key, token): (&str, &str) = (&self.key, shared);
        let sent = Instant::now();
        self.client.counters().commands(1);
        let set = Cell::new(false);
        let result = self.client.run(Op::Acquire, key, |con, send| {
            let connection = self.node_connection_id(con)?;
            use script::wire::Arg;
            let previous: Option<Vec<u8>> =
                script::wire::query(con, &script::set_nx_get(key, token, millis))?;
            let acquired = match &previous {
                None => true,
                Some(holder) => holder == token.as_bytes(),
            };
            if !acquired {
                // Who holds it, named from the reply itself; never kept
                // whole (the token's secret releases the lock).
                *seen = previous.and_then(|holder| named_holder(&String::from_utf8_lossy(&holder)));
                // Read-only: safe to send again with the rest of a resend.
                let left = if pttl {
                    self.client.counters().commands(1);
                    let left: i64 = script::wire::query(con, &[Arg::from("PTTL"), Arg::from(key)])?;
                    Some(left)
                } else {
                    None
                };
                return Ok((false, left, None));
            }
            set.set(true);
            Ok((
                true,
                None,
                self.await_replicas(con, token, millis, send.resend, connection)?,
            ))
        });
        let result = result.map_err(crate::error::known_refusal);
        let (acquired, left, short) = self.settle(result, token, &set)?;
        self.check_replicated(short)?;
        Ok(if acquired {
            Attempt::Won(self.new_lease(shared, sent, millis, None))
        } else {
            // -1: a key without expiry (not ours), wait for a message; -2:
            // gone since the `SET`, ask again after the shortest pause.
            Attempt::Held(left.and_then(|left| match left {
                -2 => Some(Duration::ZERO),
                left => u64::try_from(left).ok().map(Duration::from_millis),
            }))
        })
    }

    /// What a failed acquisition may have left: a key holding our token,
    /// set by a request whose reply was lost or followed by a failed
    /// `WAIT`. Handed to the client's cleanup, which releases it
    /// (owner-checked) as soon as Redis answers.
    fn settle<T>(
        &self,
        result: Result<T, Error>,
        token: &str,
        set: &Cell<bool>,
    ) -> Result<T, Error> {
        result.inspect_err(|err| {
            if set.get() || err.is_outcome_unknown() {
                self.client.orphan(
                    &self.key,
                    OrphanKind::Plain {
                        token: token.into(),
                    },
                );
            }
        })
    }

    /// With [`LockOptions::min_replicas`]: `WAIT` on the connection that
    /// wrote the key (WAIT counts that connection's writes only; on a
    /// resend, the key was written by an earlier connection, so this one
    /// writes first: an owner-checked `PEXPIRE`, which replicates after the
    /// `SET`). When fewer replicas acknowledged in time, releases the key
    /// again (owner-checked, same connection) and returns how many did.
    fn await_replicas(
        &self,
        con: &mut crate::conn::backend::Connection,
        token: &str,
        millis: u64,
        resend: bool,
        connection: Option<i64>,
    ) -> redis::RedisResult<Option<u32>> {
        replicas::await_or_give_back(
            con,
            self.client.counters(),
            &self.key,
            self.options.extra.min_replicas,
            (resend, connection),
            |con| {
                self.client.counters().commands(1);
                let _extended: i64 = script::EXTEND
                    .key(&*self.key)
                    .arg(token)
                    .arg(millis)
                    .invoke(con)?;
                Ok(())
            },
            |con| {
                let channel = self.client.release_channel(&self.key);
                let (marker, marker_millis) = release::marker_of(&self.client, &self.key, token);
                // The key was written by this very connection a moment ago;
                // whatever the outcome (released, or expired already),
                // nothing stays ours.
                let _outcome = release::release_lua(
                    con,
                    self.client.counters(),
                    &self.key,
                    token,
                    release::Announce {
                        channel: &channel,
                        sharded: self.client.sharded(&channel),
                    },
                    release::Marker {
                        key: marker.as_deref(),
                        millis: marker_millis,
                    },
                    &std::cell::Cell::new(false),
                )?;
                Ok(())
            },
        )
    }

    /// On Redis Cluster with [`LockOptions::min_replicas`]: the id of the
    /// connection to the key's primary, to compare after the `WAIT`.
    fn node_connection_id(
        &self,
        con: &mut crate::conn::backend::Connection,
    ) -> redis::RedisResult<Option<i64>> {
        replicas::node_connection_id(con, &self.key, self.options.extra.min_replicas.is_some())
    }

    fn check_replicated(&self, short: Option<u32>) -> Result<(), Error> {
        match (short, self.options.extra.min_replicas) {
            (Some(acked), Some((wanted, _))) => Err(Error::NotReplicated {
                key: self.key.to_string(),
                acked,
                wanted,
            }),
            _ => Ok(()),
        }
    }

    fn new_lease(
        &self,
        token: &Arc<str>,
        sent: Instant,
        millis: u64,
        fence: Option<u64>,
    ) -> Rc<Lease> {
        Rc::new(Lease::acquired(
            self.client.clone(),
            self.local.clone(),
            self.key.clone(),
            self.channel.clone(),
            token.clone(),
            &self.options,
            sent,
            Duration::from_millis(millis),
            fence,
        ))
    }

    /// `lua/acquire.lua`: the lease, or how long the holder has left.
    fn attempt(
        &self,
        shared: &Arc<str>,
        millis: u64,
        seen: &mut Option<String>,
    ) -> Result<Attempt<Rc<Lease>>, Error> {
        let (key, token): (&str, &str) = (&self.key, shared);
        let sent = Instant::now();
        self.client.counters().commands(1);
        let fence_key = self
            .options
            .extra
            .fencing
            .then(|| self.client.fence_key(key));
        let set = Cell::new(false);
        let result = self.client.run(Op::AcquireScript, key, |con, send| {
            let connection = self.node_connection_id(con)?;
            let mut script = script::ACQUIRE.key(key);
            if let Some(fence_key) = &fence_key {
                script.key(fence_key);
            }
            let reply: (i64, i64, u64, Option<String>) =
                script.arg(token).arg(millis).invoke(con)?;
            if reply.0 != 1 {
                return Ok((reply, None));
            }
            set.set(true);
            Ok((
                reply,
                self.await_replicas(con, token, millis, send.resend, connection)?,
            ))
        });
        let result = result.map_err(|err| fence_failure(key, fence_key.as_deref(), err));
        let ((acquired, pttl, fence, holder), short) = self.settle(result, token, &set)?;
        self.check_replicated(short)?;
        Ok(if acquired == 1 {
            let fence = self.options.extra.fencing.then_some(fence);
            Attempt::Won(self.new_lease(shared, sent, millis, fence))
        } else {
            // Who holds it, named from the reply; never kept whole.
            *seen = holder.as_deref().and_then(named_holder);
            // -1: a key without expiry (not ours); wait for a message.
            Attempt::Held(u64::try_from(pttl).ok().map(Duration::from_millis))
        })
    }

    /// Takes a lease another thread of this client handed over: same token,
    /// no Redis command while Redis confirmed it within the handoff
    /// budget's `max_age` and at least half this lock's ttl is left.
    /// Otherwise it is confirmed in Redis before this call returns: extended
    /// (owner-checked) when less than half the ttl is left, else checked
    /// with a `GET`. `Ok(None)` when it turns out lost: the waiter goes on
    /// and asks Redis for the lock afresh.
    ///
    /// This is where a handed-over lease becomes as fresh as an
    /// acquisition: without it a thread could start on a lease Redis gave
    /// to another client long ago (the key deleted by an operator, expired
    /// early, lost in a restart), for as long as the lease went from
    /// thread to thread.
    fn take_handoff(&self, handoff: Handoff, millis: u64) -> Result<Option<Rc<Lease>>, Error> {
        let mut lease = Lease::handed_over(
            self.client.clone(),
            self.local.clone(),
            self.key.clone(),
            self.channel.clone(),
            &self.options,
            handoff,
        );
        // The receiver's own options decide renewal and the hold cap.
        lease.adopt(&self.options);
        if lease.is_lost() {
            // Lost while it was being passed on: released (if Redis may
            // still hold it) and the waiter goes on waiting.
            drop(lease);
            return Ok(None);
        }
        let lease = Rc::new(lease);
        let ttl = Duration::from_millis(millis);
        // At most one round trip: an extension (which confirms it too) when
        // less than half the ttl is left, else a check when it is older
        // than `max_age`, followed by an extension only when the check
        // itself left less than half.
        let stale = lease.confirmed().elapsed() > self.options.extra.handoff_budget.max_age;
        let mut confirmed = true;
        if stale && lease.validity() >= ttl / 2 {
            // A read: a lost reply is sent again.
            match lease.confirm() {
                Ok(held) => confirmed = held,
                Err(err) => {
                    // Nothing known: not passed on, not released here (a
                    // second round trip); the cleanup releases it.
                    lease.give_up();
                    return Err(err);
                }
            }
        }
        if confirmed && lease.validity() < ttl / 2 {
            match lease.extend(ttl) {
                Ok(()) => {}
                Err(err) if err.is_not_held() => confirmed = false,
                Err(err) => {
                    lease.give_up();
                    return Err(err);
                }
            }
        }
        if !confirmed {
            lease.abandon();
            return Ok(None);
        }
        self.client
            .counters()
            .handed_over(tag_of(&self.options), lease.confirmed());
        lease.accepted();
        Ok(Some(lease))
    }
}

/// What a fenced acquisition's error means: `FENCE` from the script (the
/// counter cannot be incremented) or an ACL refusal of the counter is
/// [`Error::FenceCounter`]; anything else is passed on.
pub(crate) fn fence_failure(key: &str, counter: Option<&str>, err: Error) -> Error {
    match (err, counter) {
        (Error::Redis(err), Some(counter)) if err.code() == Some("FENCE") => Error::FenceCounter {
            key: key.to_owned(),
            counter: counter.to_owned(),
            detail: err.detail().unwrap_or("unusable").to_owned(),
        },
        (Error::Redis(err), Some(counter)) if crate::error::server_code(&err) == Some("NOPERM") => {
            fence_refused(key, counter)
        }
        (err, _) => err,
    }
}

/// A fenced acquisition the ACL refused: the user may use the lock's key
/// (a plain lock works) but not its fencing counter, outside the key's
/// pattern unless the rule has the `{KEY}` keys. Nothing was taken.
pub(crate) fn fence_refused(key: &str, counter: &str) -> Error {
    Error::FenceCounter {
        key: key.to_owned(),
        counter: counter.to_owned(),
        detail: "NOPERM: the ACL user may not use it; fencing needs the {KEY}:fence keys \
                 (see the ACL rules in the failure model chapter of the guide, redmutex::guide::failure_model)"
            .to_owned(),
    }
}

/// One acquisition of a [`DistributedLock`], seen by the acquire loop.
struct Plain<'a> {
    lock: &'a DistributedLock,
    /// Made at the first attempt in Redis and kept for the others (so a
    /// later attempt recognises a key an earlier one set): a lease handed
    /// over by another thread of this client carries its own, so a waiter
    /// served that way never makes one.
    token: Option<Arc<str>>,
    millis: u64,
    /// Who held the key when the last attempt was refused (their token,
    /// redacted), when the reply said.
    seen: Option<String>,
}

impl Contender for Plain<'_> {
    type Won = Rc<Lease>;
    type Gift = Handoff;

    /// The plain `SET` (Redis does less for it than for the script),
    /// followed by a `PTTL` when it did not win and the waiter needs the
    /// holder's time left (not `quick`), unless a fencing token is needed.
    fn attempt(&mut self, quick: bool) -> Result<Attempt<Rc<Lease>>, Error> {
        let token = self
            .lock
            .client
            .token_once(&mut self.token, &self.lock.key)?;
        if !self.lock.options.extra.fencing && self.lock.client.set_get_allowed() {
            match self
                .lock
                .set_nx(&token, self.millis, !quick, &mut self.seen)
            {
                // Refused whole before it ran (Redis 6.x): nothing was set,
                // so the script may be sent instead, now and from now on.
                Err(Error::Redis(err)) if crate::error::syntax_error(&err) => {
                    self.lock.client.refuse_set_get();
                }
                done => return done,
            }
        }
        self.lock.attempt(&token, self.millis, &mut self.seen)
    }

    fn accept(&mut self, gift: Handoff) -> Result<Option<Rc<Lease>>, Error> {
        self.lock.take_handoff(gift, self.millis)
    }
}
