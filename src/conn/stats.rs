//! Counters of what a `LockClient` did, for reports and metrics: totals
//! over the client, and per lock type the acquisitions, their outcomes and
//! the wait and hold times (lock-free, fixed memory). With the `metrics`
//! feature the same events also go to the `metrics` facade.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::conn::histogram::{Distribution, Histogram};
use crate::error::Error;

/// The lock types, as [`LockStats::kind`] and the `kind` metric label
/// name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LockKind {
    /// [`DistributedLock`](crate::DistributedLock).
    Mutex,
    /// [`ReentrantLock`](crate::ReentrantLock).
    Reentrant,
    /// [`RwLock::read`](crate::RwLock::read) and its `try_` forms.
    Read,
    /// [`RwLock::write`](crate::RwLock::write) and its `try_` forms.
    Write,
    /// [`RedLock`](crate::RedLock).
    RedLock,
    /// [`Semaphore`](crate::Semaphore) permits.
    Semaphore,
    /// [`MultiLock`](crate::MultiLock): a set of keys taken together.
    Multi,
    /// [`FairLock`](crate::FairLock): granted in queue order.
    Fair,
}

impl LockKind {
    /// Every lock type.
    pub const ALL: [LockKind; 8] = [
        LockKind::Mutex,
        LockKind::Reentrant,
        LockKind::Read,
        LockKind::Write,
        LockKind::RedLock,
        LockKind::Semaphore,
        LockKind::Multi,
        LockKind::Fair,
    ];

    /// The name used as the `kind` metric label: `mutex`, `reentrant`,
    /// `read`, `write`, `redlock`, `semaphore`, `multi` or `fair`.
    pub fn name(self) -> &'static str {
        match self {
            LockKind::Mutex => "mutex",
            LockKind::Reentrant => "reentrant",
            LockKind::Read => "read",
            LockKind::Write => "write",
            LockKind::RedLock => "redlock",
            LockKind::Semaphore => "semaphore",
            LockKind::Multi => "multi",
            LockKind::Fair => "fair",
        }
    }

    fn index(self) -> usize {
        match self {
            LockKind::Mutex => 0,
            LockKind::Reentrant => 1,
            LockKind::Read => 2,
            LockKind::Write => 3,
            LockKind::RedLock => 4,
            LockKind::Semaphore => 5,
            LockKind::Multi => 6,
            LockKind::Fair => 7,
        }
    }
}

/// What one lock type of a client did (see [`LockStats::kind`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct KindStats {
    /// Acquisitions that got the lock (from Redis or handed over).
    pub acquired: u64,
    /// Of those, the ones handed over by another thread of the client.
    pub handed_over: u64,
    /// Acquisitions that ended with the lock held elsewhere throughout:
    /// [`Error::Timeout`] from a blocking call, `Ok(None)` from a `try_`.
    pub timeouts: u64,
    /// Renewals sent for it (by the watchdog).
    pub renewals: u64,
    /// Renewals that failed: no answer, or an error reply (a renewal that
    /// found the lease gone is a loss instead).
    pub renewal_failures: u64,
    /// Leases found lost: gone from Redis or taken by another owner (by
    /// the watchdog, `extend` or the release), run out while Redis could
    /// not be reached, or ended by the hold cap.
    pub losses: u64,
    /// Time from the call to the lock, for acquisitions that got it.
    pub wait: Distribution,
    /// Time from getting the lock to letting go of it (released, handed
    /// on, or dropped); losses end a hold when it is let go, as well.
    pub hold: Distribution,
    /// For the acquisitions handed over: how long before the receiving
    /// call returned Redis had last confirmed the lease (owner-checked:
    /// its acquisition, a renewal, an extension, or the receiver's own
    /// check). At most the handoff budget's
    /// [`max_age`](crate::HandoffBudget::max_age), or one round trip when
    /// the receiver confirmed it.
    pub handoff_age: Distribution,
    errors: [u64; Error::KINDS.len()],
}

impl KindStats {
    /// Errors of acquisitions and releases of this lock type, of one
    /// [`Error::kind`] (a timeout counts in [`KindStats::timeouts`], a
    /// release that found the lease gone in [`KindStats::losses`]).
    pub fn errors(&self, kind: &str) -> u64 {
        Error::KINDS
            .iter()
            .position(|k| *k == kind)
            .map_or(0, |at| self.errors[at])
    }

    /// Errors of every kind.
    pub fn errors_total(&self) -> u64 {
        self.errors.iter().sum()
    }
}

/// A snapshot of a [`LockClient`](crate::LockClient)'s counters, summed over
/// its clones since it was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockStats {
    /// Redis commands the lock operations sent (each command of a pipeline
    /// or transaction counts; a script invocation counts once, whatever the
    /// script runs inside Redis).
    pub commands: u64,
    /// Locks acquired in Redis.
    pub acquired: u64,
    /// Locks passed from one thread to another inside this client without
    /// Redis ([`LockOptions::local_handoff`](crate::LockOptions::local_handoff)).
    pub handoffs: u64,
    /// Release messages received by the subscriber connection.
    pub notifications: u64,
    /// Lease renewals the watchdog sent.
    pub renewals: u64,
    /// Round trips those renewals took (renewals due together share one).
    pub renewal_round_trips: u64,
    /// Requests sent again on a fresh connection after their reply was
    /// lost (see the crate docs' failure model).
    pub resends: u64,
    /// Tokens of failed acquisitions released in the background, because
    /// their request may have set the key after all.
    pub orphans_released: u64,
    kinds: [KindStats; LockKind::ALL.len()],
}

impl LockStats {
    /// What the lock type `kind` did: acquisitions and their outcomes, wait
    /// and hold time distributions, renewals, losses and errors.
    pub fn kind(&self, kind: LockKind) -> KindStats {
        self.kinds[kind.index()]
    }
}

/// Per lock type, as recorded.
#[derive(Default)]
struct KindCounters {
    acquired: AtomicU64,
    handed_over: AtomicU64,
    timeouts: AtomicU64,
    renewals: AtomicU64,
    renewal_failures: AtomicU64,
    losses: AtomicU64,
    errors: [AtomicU64; Error::KINDS.len()],
    wait: Histogram,
    hold: Histogram,
    handoff_age: Histogram,
}

impl KindCounters {
    fn snapshot(&self) -> KindStats {
        KindStats {
            acquired: self.acquired.load(Ordering::Relaxed),
            handed_over: self.handed_over.load(Ordering::Relaxed),
            timeouts: self.timeouts.load(Ordering::Relaxed),
            renewals: self.renewals.load(Ordering::Relaxed),
            renewal_failures: self.renewal_failures.load(Ordering::Relaxed),
            losses: self.losses.load(Ordering::Relaxed),
            wait: self.wait.snapshot(),
            hold: self.hold.snapshot(),
            handoff_age: self.handoff_age.snapshot(),
            errors: std::array::from_fn(|i| self.errors[i].load(Ordering::Relaxed)),
        }
    }
}

/// Which lock a recorded event is about: its type and the caller's key
/// class (the `key_class` metric label; never the key itself, so the
/// number of label values stays the caller's choice).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tag {
    pub(crate) kind: LockKind,
    pub(crate) class: &'static str,
}

#[derive(Default)]
pub(crate) struct Stats {
    commands: AtomicU64,
    acquired: AtomicU64,
    handoffs: AtomicU64,
    notifications: AtomicU64,
    renewals: AtomicU64,
    renewal_round_trips: AtomicU64,
    resends: AtomicU64,
    orphans_released: AtomicU64,
    kinds: [KindCounters; LockKind::ALL.len()],
}

impl Stats {
    pub(crate) fn renewal_batch(&self, renewals: u64) {
        self.commands(renewals);
        self.renewal_round(renewals);
    }
    /// A round of `renewals` whose commands were counted where they went
    /// (a RedLock's, on each node's client).
    pub(crate) fn renewal_round(&self, renewals: u64) {
        self.renewals.fetch_add(renewals, Ordering::Relaxed);
        self.renewal_round_trips.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn commands(&self, n: u64) {
        self.commands.fetch_add(n, Ordering::Relaxed);
    }
    pub(crate) fn acquired(&self) {
        self.acquired.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn handoff(&self) {
        self.handoffs.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn resend(&self) {
        self.commands(1);
        self.resends.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn orphan_released(&self) {
        self.orphans_released.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn notification(&self) {
        self.notifications.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn snapshot(&self) -> LockStats {
        LockStats {
            commands: self.commands.load(Ordering::Relaxed),
            acquired: self.acquired.load(Ordering::Relaxed),
            handoffs: self.handoffs.load(Ordering::Relaxed),
            notifications: self.notifications.load(Ordering::Relaxed),
            renewals: self.renewals.load(Ordering::Relaxed),
            renewal_round_trips: self.renewal_round_trips.load(Ordering::Relaxed),
            resends: self.resends.load(Ordering::Relaxed),
            orphans_released: self.orphans_released.load(Ordering::Relaxed),
            kinds: std::array::from_fn(|i| self.kinds[i].snapshot()),
        }
    }

    fn of(&self, kind: LockKind) -> &KindCounters {
        &self.kinds[kind.index()]
    }

    /// An acquisition call begun at `started` ended: with the lock
    /// (`Ok(true)`), with the lock held elsewhere throughout (`Ok(false)`),
    /// or with an error (a timeout counts as held throughout).
    pub(crate) fn acquire_ended(&self, tag: Tag, started: Instant, outcome: Result<bool, &Error>) {
        let waited = started.elapsed();
        let counters = self.of(tag.kind);
        let label = match outcome {
            Ok(true) => {
                counters.acquired.fetch_add(1, Ordering::Relaxed);
                counters.wait.record(waited);
                "acquired"
            }
            Ok(false) | Err(Error::Timeout { .. }) => {
                counters.timeouts.fetch_add(1, Ordering::Relaxed);
                "timeout"
            }
            Err(err) => {
                self.error(tag, err);
                "error"
            }
        };
        export::acquire_ended(tag, waited, label);
    }

    /// [`Stats::acquire_ended`] for an acquisition call's `result`, handed
    /// back.
    pub(crate) fn acquisition<T>(
        &self,
        tag: Tag,
        started: Instant,
        result: Result<Option<T>, Error>,
    ) -> Result<Option<T>, Error> {
        self.acquire_ended(tag, started, result.as_ref().map(Option::is_some));
        result
    }

    /// [`Stats::hold_ended`] for a release's `result`, handed back.
    pub(crate) fn release<T>(
        &self,
        tag: Tag,
        since: Option<Instant>,
        lost: bool,
        result: Result<T, Error>,
    ) -> Result<T, Error> {
        self.hold_ended(tag, since, lost, result.as_ref().map(|_| ()));
        result
    }

    /// The lock of this acquisition was handed over by another thread;
    /// Redis had last confirmed it at `confirmed`.
    pub(crate) fn handed_over(&self, tag: Tag, confirmed: Instant) {
        let kind = self.of(tag.kind);
        kind.handed_over.fetch_add(1, Ordering::Relaxed);
        kind.handoff_age.record(confirmed.elapsed());
        export::counter("redmutex_handoffs_total", tag);
    }

    /// A hold begun at `since` ended (released, handed on, or dropped):
    /// `lost` when the lease was found lost before, `result` what letting
    /// go of it said (a release that found it gone is a loss, not an
    /// error). Counts each lease's loss once, when it is let go.
    pub(crate) fn hold_ended(
        &self,
        tag: Tag,
        since: Option<Instant>,
        lost: bool,
        result: Result<(), &Error>,
    ) {
        // `None`: handed over but never taken (passed on, or released as an
        // orphan): nobody held it, so no hold time.
        if let Some(since) = since {
            let held = since.elapsed();
            self.of(tag.kind).hold.record(held);
            export::hold_ended(tag, held);
        }
        match result {
            Err(err) if err.is_not_held() => self.lost(tag),
            Err(err) => {
                if lost {
                    self.lost(tag);
                }
                self.error(tag, err);
            }
            Ok(()) if lost => self.lost(tag),
            Ok(()) => {}
        }
    }

    /// A call on a held lock (release, extend) failed.
    pub(crate) fn error(&self, tag: Tag, err: &Error) {
        if let Some(at) = Error::KINDS.iter().position(|k| *k == err.kind()) {
            self.of(tag.kind).errors[at].fetch_add(1, Ordering::Relaxed);
        }
        export::error(tag, err.kind());
    }

    fn lost(&self, tag: Tag) {
        self.of(tag.kind).losses.fetch_add(1, Ordering::Relaxed);
        export::counter("redmutex_losses_total", tag);
    }

    /// Renewals of one lock type: `sent` sent, `failed` of them failed.
    pub(crate) fn renewals_of(&self, tag: Tag, sent: u64, failed: u64) {
        let counters = self.of(tag.kind);
        counters.renewals.fetch_add(sent, Ordering::Relaxed);
        counters
            .renewal_failures
            .fetch_add(failed, Ordering::Relaxed);
        export::renewals(tag, sent, failed);
    }
}

/// The same events through the `metrics` facade (names and labels in the
/// "Metrics" section of docs/operating.md); nothing without the feature.
#[cfg(feature = "metrics")]
mod export {
    use super::Tag;
    use std::time::Duration;

    pub(super) fn acquire_ended(tag: Tag, waited: Duration, outcome: &'static str) {
        let labels = [
            ("kind", tag.kind.name()),
            ("key_class", tag.class),
            ("outcome", outcome),
        ];
        metrics::counter!("redmutex_acquisitions_total", &labels).increment(1);
        metrics::histogram!("redmutex_wait_seconds", &labels).record(waited.as_secs_f64());
    }

    pub(super) fn hold_ended(tag: Tag, held: Duration) {
        metrics::histogram!("redmutex_hold_seconds", "kind" => tag.kind.name(), "key_class" => tag.class)
            .record(held.as_secs_f64());
    }

    pub(super) fn counter(name: &'static str, tag: Tag) {
        metrics::counter!(name, "kind" => tag.kind.name(), "key_class" => tag.class).increment(1);
    }

    pub(super) fn error(tag: Tag, error: &'static str) {
        metrics::counter!(
            "redmutex_errors_total",
            "kind" => tag.kind.name(),
            "key_class" => tag.class,
            "error" => error
        )
        .increment(1);
    }

    pub(super) fn renewals(tag: Tag, sent: u64, failed: u64) {
        let labels = [("kind", tag.kind.name()), ("key_class", tag.class)];
        metrics::counter!("redmutex_renewals_total", &labels).increment(sent);
        if failed > 0 {
            metrics::counter!("redmutex_renewal_failures_total", &labels).increment(failed);
        }
    }
}

#[cfg(not(feature = "metrics"))]
mod export {
    use super::Tag;
    use std::time::Duration;

    pub(super) fn acquire_ended(_: Tag, _: Duration, _: &'static str) {}
    pub(super) fn hold_ended(_: Tag, _: Duration) {}
    pub(super) fn counter(_: &'static str, _: Tag) {}
    pub(super) fn error(_: Tag, _: &'static str) {}
    pub(super) fn renewals(_: Tag, _: u64, _: u64) {}
}
