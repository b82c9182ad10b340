//! `Semaphore`: at most N holders at once, each permit a lease of its own,
//! expiry and admission decided by the server's clock (issue 13).
//!
//! All state is one Redis hash: `limit` and one field `p:<id>` per permit
//! with its deadline. See `lua/sem_*.lua` for the scripts and why each is
//! safe to send twice.

use std::time::{Duration, Instant};

use crate::client::LockClient;
use crate::client::options::{Backoff, LeaseOptions, WaitMode, ttl_millis};
use crate::client::release;
use crate::conn::policy::Op;
use crate::error::{Error, NotHeldReason};
use crate::lease::remaining;
use crate::renew::watchdog::OrphanKind;
use crate::script;
use crate::wait::acquire::{Attempt, Contender, Queued, Waiting, Within, acquire, blocking};
use crate::wait::queue::Queues;
use std::convert::Infallible;
use std::sync::Arc;

/// The semaphore's state in one client: its wait queues. Nothing is handed
/// over between threads: each permit is its own lease in Redis.
#[derive(Default)]
struct Local {
    queues: Queues<Infallible>,
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
#[derive(Clone, Debug)]
pub struct Semaphore {
    client: LockClient,
    local: Arc<Local>,
    key: String,
    permits: u32,
    options: LeaseOptions,
    wait_mode: WaitMode,
}

impl Semaphore {
    /// A semaphore of `permits` on `key`, with the ttl, wait and backoff of
    /// the client's default options.
    pub fn new(client: &LockClient, key: impl Into<String>, permits: u32) -> Semaphore {
        Semaphore::with_options(client, key, permits, LeaseOptions::from(client.defaults()))
    }

    /// A semaphore of `permits` on `key` with the given options.
    pub fn with_options(
        client: &LockClient,
        key: impl Into<String>,
        permits: u32,
        options: LeaseOptions,
    ) -> Semaphore {
        Semaphore {
            client: client.clone(),
            local: client.local::<Local>(),
            key: client.names().own_key(key.into()),
            permits,
            options,
            wait_mode: WaitMode::Notify,
        }
    }

    /// How waiters learn a permit may be free. Defaults to
    /// [`WaitMode::Notify`].
    pub fn wait_mode(mut self, mode: WaitMode) -> Semaphore {
        self.wait_mode = mode;
        self
    }

    /// The key as it is in Redis, the client's key prefix included.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The number of permits this semaphore was opened with.
    pub fn permits(&self) -> u32 {
        self.permits
    }

    /// The lease length of each permit.
    pub fn ttl(&self) -> Duration {
        self.options.ttl
    }

    /// How long [`Semaphore::acquire`] waits.
    pub fn wait(&self) -> Duration {
        self.options.wait
    }

    /// How waiting attempts are spaced.
    pub fn backoff(&self) -> Backoff {
        self.options.backoff
    }

    /// Makes `permits` the semaphore's limit in Redis (and this handle's),
    /// for everyone: the explicit way to change it while permits are out,
    /// which opening the key with another number refuses. Permits already
    /// out stay out; a smaller limit admits nobody new until enough are
    /// released. With no permit out there is nothing to change: the next
    /// acquire sets its own limit. (It does not report the previous limit:
    /// after a lost reply, the resend would report its own.)
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
        let _previous: u32 = self.client.run(Op::SemSetLimit, &self.key, |con, _| {
            script::SEM_SET_LIMIT
                .key(&self.key)
                .arg(permits)
                .invoke(con)
        })?;
        self.permits = permits;
        Ok(())
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
        blocking(&self.key, self.options.wait, |within| self.take(within))
    }

    /// One attempt, no waiting.
    ///
    /// # Errors
    ///
    /// As [`Semaphore::acquire`], without the timeout.
    #[must_use = "the permit is released as soon as it is dropped"]
    pub fn try_acquire(&self) -> Result<Option<Permit>, Error> {
        self.take(Within::Once)
    }

    /// Waits up to `wait` for a permit.
    ///
    /// # Errors
    ///
    /// As [`Semaphore::try_acquire`].
    #[must_use = "the permit is released as soon as it is dropped"]
    pub fn try_acquire_for(&self, wait: Duration) -> Result<Option<Permit>, Error> {
        self.take(Within::For(wait))
    }

    /// Waits until `deadline` for a permit (at least one attempt).
    ///
    /// # Errors
    ///
    /// As [`Semaphore::try_acquire`].
    #[must_use = "the permit is released as soon as it is dropped"]
    pub fn try_acquire_until(&self, deadline: Instant) -> Result<Option<Permit>, Error> {
        self.take(Within::Until(deadline))
    }

    fn take(&self, within: Within) -> Result<Option<Permit>, Error> {
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
        self.client.check_key(&self.key)?;
        let deadline = within.deadline();
        let id = uuid::Uuid::new_v4().to_string();
        let mut contender = Take {
            semaphore: self,
            id: &id,
            millis,
        };
        let queue_key = format!("{}\u{0}sem", self.key);
        let subscribe = |waker| {
            self.client
                .subscribe(&self.client.release_channel(&self.key), waker)
        };
        let nothing = |never: Infallible| match never {};
        let waiting = match self.wait_mode {
            WaitMode::Spin => Waiting::Spin,
            WaitMode::Notify => Waiting::Queued(Queued {
                queues: &self.local.queues,
                key: &queue_key,
                takes_handoffs: false,
                // FIFO within the client: while the head waits, the
                // permits are all out, and a newcomer would only add a
                // request that fails.
                barge: false,
                on_orphan: &nothing,
                subscribe: &subscribe,
            }),
        };
        acquire(&mut contender, deadline, self.options.backoff, waiting)
    }
}

/// One acquisition of a permit, seen by the acquire loop.
struct Take<'a> {
    semaphore: &'a Semaphore,
    id: &'a str,
    millis: u64,
}

impl Contender for Take<'_> {
    type Won = Permit;
    type Gift = Infallible;

    fn attempt(&mut self, _quick: bool) -> Result<Attempt<Permit>, Error> {
        let semaphore = self.semaphore;
        let (client, key, id) = (&semaphore.client, semaphore.key.as_str(), self.id);
        let sent = Instant::now();
        client.counters().commands(1);
        let reply = client.run(Op::SemAcquire, key, |con, _| {
            script::SEM_ACQUIRE
                .key(key)
                .arg(id)
                .arg(semaphore.permits)
                .arg(self.millis)
                .invoke::<(i64, i64)>(con)
        });
        let (acquired, wait_ms) = match reply {
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
                if err.is_outcome_unknown() {
                    // The permit may have been written: take it out again.
                    client.orphan(key, OrphanKind::Permit { id: id.to_owned() });
                }
                return Err(err);
            }
        };
        if acquired != 1 {
            return Ok(Attempt::Held(
                u64::try_from(wait_ms).ok().map(Duration::from_millis),
            ));
        }
        Ok(Attempt::Won(Permit {
            client: client.clone(),
            key: key.to_owned(),
            id: id.to_owned(),
            sent,
            ttl: Duration::from_millis(self.millis),
            released: false,
        }))
    }

    fn accept(&mut self, gift: Infallible) -> Result<Option<Permit>, Error> {
        match gift {}
    }
}

/// One permit of a [`Semaphore`]. Dropping it releases it (best effort);
/// [`Permit::release`] reports the outcome.
#[must_use = "the permit is released as soon as it is dropped"]
#[derive(Debug)]
pub struct Permit {
    client: LockClient,
    key: String,
    id: String,
    sent: Instant,
    ttl: Duration,
    released: bool,
}

impl Permit {
    /// The semaphore's key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// This permit's id (its field in the hash).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The lease left by the local clock, minus the drift allowance.
    pub fn validity(&self) -> Duration {
        if self.released {
            return Duration::ZERO;
        }
        remaining(self.sent, self.ttl, Instant::now())
    }

    /// Renews this permit for `ttl` from now, only if it is still present
    /// (an expired permit is never re-created).
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] when the permit is gone; [`Error::InvalidArgument`]
    /// for a bad ttl; [`Error::Redis`], [`Error::Pool`] or
    /// [`Error::OutcomeUnknown`].
    pub fn extend(&mut self, ttl: Duration) -> Result<(), Error> {
        let millis = ttl_millis(ttl)?;
        let sent = Instant::now();
        self.client.counters().commands(1);
        let renewed: i64 = self.client.run(Op::SemExtend, &self.key, |con, _| {
            script::SEM_EXTEND
                .key(&self.key)
                .arg(&self.id)
                .arg(millis)
                .invoke(con)
        })?;
        if renewed != 1 {
            return Err(Error::not_held(&self.key, NotHeldReason::Expired));
        }
        self.sent = sent;
        self.ttl = ttl;
        Ok(())
    }

    /// Whether Redis still has this permit within its deadline.
    ///
    /// # Errors
    ///
    /// [`Error::Redis`] or [`Error::Pool`].
    pub fn is_held(&self) -> Result<bool, Error> {
        if self.released {
            return Ok(false);
        }
        let field = format!("p:{}", self.id);
        let (deadline, now): (Option<u64>, (u64, u64)) =
            self.client.run(Op::Read, &self.key, |con, _| {
                redis::pipe()
                    .cmd("HGET")
                    .arg(&self.key)
                    .arg(&field)
                    .cmd("TIME")
                    .query(con)
            })?;
        let now_ms = now.0.saturating_mul(1000).saturating_add(now.1 / 1000);
        Ok(deadline.is_some_and(|d| d > now_ms))
    }

    /// Gives the permit back: removes only this permit.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] ([`NotHeldReason::Expired`]) when the permit was
    /// already gone; [`Error::Redis`], [`Error::Pool`],
    /// [`Error::WrongType`] or [`Error::OutcomeUnknown`].
    pub fn release(mut self) -> Result<(), Error> {
        self.give_back()
    }

    fn give_back(&mut self) -> Result<(), Error> {
        self.released = true;
        let (client, key, id) = (&self.client, self.key.as_str(), self.id.as_str());
        let channel = client.release_channel(key);
        let (marker, millis) = release::marker_of(client, key, id);
        client.counters().commands(1);
        let markerless = std::cell::Cell::new(marker.is_none());
        let result = client.run(Op::SemRelease, key, |con, send| {
            let reply: i64 =
                release::with_marker(client, marker.as_deref(), &markerless, |marker| {
                    let mut script = script::SEM_RELEASE.key(key);
                    if let Some(marker) = marker {
                        script.key(marker);
                    }
                    script.arg(id).arg(&channel).arg(millis).invoke(con)
                })?;
            Ok((reply, send.replied()))
        });
        let (reply, replied) = result.inspect_err(|err| {
            if err.may_leave_a_lease() {
                client.orphan(key, OrphanKind::Permit { id: id.to_owned() });
            }
        })?;
        match reply {
            1 | 2 => Ok(()),
            other => {
                let reason = release::not_held(other, &markerless);
                // "Not held", answered to a resend, proves nothing without a
                // marker: an earlier copy may have released it.
                release::check_resend(
                    key,
                    Err::<(), _>(reason),
                    replied,
                    !markerless.get(),
                    millis,
                )?
                .map_err(|reason| Error::not_held(key, reason))
            }
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.released
            && let Err(err) = self.give_back()
        {
            log::warn!(
                "redmutex: dropping a permit of {:?} failed: {err}",
                self.key
            );
        }
    }
}
