//! The signal a holder gets when its lease is found lost.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::LossReason;
use crate::fork::Birth;

/// Whether a lease is lost. A watched lease also carries its local
/// expiry: once the clock passes it, the lease reads as lost whatever the
/// watchdog thread is doing (a renewal stuck in a partition cannot delay
/// the signal past the moment another client could take the key).
///
/// In a process forked since it was made, it reads as lost
/// ([`LossReason::Inherited`]) without taking its lock, which a thread of
/// the parent may have held at the fork, and records nothing.
pub(crate) struct LossState {
    inner: Mutex<Loss>,
    fired: Condvar,
    birth: Birth,
}

impl Default for LossState {
    fn default() -> LossState {
        LossState {
            inner: Mutex::default(),
            fired: Condvar::new(),
            birth: Birth::quick(),
        }
    }
}

#[derive(Default)]
struct Loss {
    reason: Option<LossReason>,
    /// The lease's local expiry (minus drift) and the reason a loss at that
    /// moment has: the earliest of `parts` when there are any.
    deadline: Option<(Instant, LossReason)>,
    /// A lease made of parts renewed apart (a multi-lock over several
    /// cluster slots): each part's local expiry. The lease is lost when
    /// the first of them passes, so a part whose renewals fail cannot
    /// hide behind another's success. `None` for a lease of one part (a
    /// pointer's room in every lease, not a list's).
    #[allow(clippy::type_complexity)]
    parts: Option<Box<Vec<Option<(Instant, LossReason)>>>>,
}

impl Loss {
    /// Records a passed deadline as the loss (first reason wins).
    fn settle(&mut self, now: Instant) -> bool {
        if self.reason.is_none()
            && let Some((deadline, reason)) = self.deadline
            && now >= deadline
        {
            self.reason = Some(reason);
            return true;
        }
        false
    }
}

impl Loss {
    /// Sets one part's expiry and recomputes the lease's. A lease of one
    /// part (part 0, no parts yet) keeps no list: the common case
    /// allocates nothing.
    fn set_part(&mut self, part: usize, deadline: Option<(Instant, LossReason)>) {
        if part == 0 && self.parts.is_none() {
            self.deadline = deadline;
            return;
        }
        let first = self.deadline;
        let parts = self.parts.get_or_insert_with(|| Box::new(vec![first]));
        if parts.len() <= part {
            parts.resize(part.saturating_add(1), None);
        }
        if let Some(slot) = parts.get_mut(part) {
            *slot = deadline;
        }
        self.deadline = parts.iter().flatten().min_by_key(|(at, _)| *at).copied();
    }
}

impl LossState {
    /// Records the loss (the first reason wins) and wakes every waiter.
    pub(crate) fn lose(&self, reason: LossReason) {
        if !self.birth.is_current() {
            return;
        }
        let mut loss = self.inner.lock();
        loss.settle(Instant::now());
        if loss.reason.is_none() {
            loss.reason = Some(reason);
        }
        self.fired.notify_all();
    }

    /// The loss, if any: recorded, or the local expiry has passed.
    pub(crate) fn reason(&self) -> Option<LossReason> {
        if !self.birth.is_current() {
            return Some(LossReason::Inherited);
        }
        let mut loss = self.inner.lock();
        if loss.settle(Instant::now()) {
            self.fired.notify_all();
        }
        loss.reason
    }

    /// Moves the local expiry to `deadline`, a loss then being `reason`.
    /// Returns false, changing nothing, when the lease is already lost
    /// (a loss, once seen, stays).
    pub(crate) fn expire_at(&self, deadline: Instant, reason: LossReason) -> bool {
        self.expire_part_at(0, deadline, reason)
    }

    /// [`LossState::expire_at`] for one `part` of a lease made of parts
    /// (see `Loss::parts`): the lease's expiry is the earliest part's.
    pub(crate) fn expire_part_at(
        &self,
        part: usize,
        deadline: Instant,
        reason: LossReason,
    ) -> bool {
        if !self.birth.is_current() {
            return false;
        }
        let mut loss = self.inner.lock();
        loss.settle(Instant::now());
        if loss.reason.is_some() {
            return false;
        }
        loss.set_part(part, Some((deadline, reason)));
        // Waiters sleep until the old deadline at most; they look again.
        self.fired.notify_all();
        true
    }

    /// The lease is no longer renewed: it carries no local expiry from
    /// here on (an unwatched lease is found lost only by what Redis says),
    /// but one already passed stays a loss.
    pub(crate) fn forget_deadline(&self) {
        if !self.birth.is_current() {
            return;
        }
        let mut loss = self.inner.lock();
        loss.settle(Instant::now());
        loss.deadline = None;
        loss.parts = None;
    }

    /// Blocks until the lease is found lost or `until` passes.
    fn wait_until(&self, until: Option<Instant>) -> Option<LossReason> {
        if !self.birth.is_current() {
            return Some(LossReason::Inherited);
        }
        let mut loss = self.inner.lock();
        loop {
            let now = Instant::now();
            if loss.settle(now) {
                self.fired.notify_all();
            }
            if let Some(lost) = loss.reason {
                return Some(lost);
            }
            if until.is_some_and(|until| now >= until) {
                return None;
            }
            let wake = match (until, loss.deadline) {
                (Some(until), Some((deadline, _))) => Some(until.min(deadline)),
                (Some(until), None) => Some(until),
                (None, Some((deadline, _))) => Some(deadline),
                (None, None) => None,
            };
            match wake {
                Some(wake) => {
                    self.fired.wait_until(&mut loss, wake);
                }
                None => self.fired.wait(&mut loss),
            }
        }
    }
}

/// Tells a holder, from any thread, that its lease was lost: poll it, or
/// block on it with a timeout, and abandon the work.
///
/// Cheap to clone, `Send` and `Sync`; it outlives the guard.
///
/// ```no_run
/// # fn main() -> Result<(), redmutex::Error> {
/// # let client = redmutex::LockClient::open("redis://127.0.0.1:6379/")?;
/// use std::time::Duration;
/// use redmutex::{DistributedLock, Lease, LockOptions};
///
/// let lock = DistributedLock::with_options(
///     &client,
///     "jobs:rebuild-index",
///     LockOptions::default().ttl(Duration::from_secs(10)).watchdog(true),
/// );
/// let guard = lock.lock()?;
/// let lost = guard.loss_signal();
/// let worker = std::thread::spawn(move || {
///     for _chunk in 0..1_000 {
///         if lost.is_lost() {
///             return Err("lock lost: stopping before the next write");
///         }
///         // ... one bounded step of work ...
///     }
///     Ok(())
/// });
/// let outcome = worker.join();
/// guard.unlock()?; // Err(NotHeld) if the lease was lost meanwhile
/// # let _ = outcome;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct LossSignal {
    pub(crate) state: Arc<LossState>,
}

impl LossSignal {
    /// Whether the lease was found lost.
    pub fn is_lost(&self) -> bool {
        self.state.reason().is_some()
    }

    /// Why the lease was lost, if it was.
    pub fn reason(&self) -> Option<LossReason> {
        self.state.reason()
    }

    /// Blocks until the lease is found lost or `timeout` passes; returns the
    /// reason, or `None` on timeout.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<LossReason> {
        self.state.wait_until(Instant::now().checked_add(timeout))
    }
}

impl fmt::Debug for LossSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LossSignal")
            .field("lost", &self.reason())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fires_once_and_wakes_waiters() {
        let signal = LossSignal {
            state: Arc::new(LossState::default()),
        };
        assert!(!signal.is_lost());
        assert_eq!(signal.wait_timeout(Duration::from_millis(10)), None);
        let waiter = {
            let signal = signal.clone();
            std::thread::spawn(move || signal.wait_timeout(Duration::from_secs(10)))
        };
        signal.state.lose(LossReason::OwnedByOther);
        signal.state.lose(LossReason::Expired);
        assert_eq!(waiter.join().ok().flatten(), Some(LossReason::OwnedByOther));
        assert_eq!(signal.reason(), Some(LossReason::OwnedByOther));
    }

    #[test]
    fn a_passed_local_expiry_is_a_loss_that_stays() {
        let state = Arc::new(LossState::default());
        let signal = LossSignal {
            state: state.clone(),
        };
        let soon = Instant::now() + Duration::from_millis(30);
        assert!(state.expire_at(soon, LossReason::Unreachable));
        assert!(!signal.is_lost());
        // Woken by the deadline itself, with nobody calling lose().
        assert_eq!(
            signal.wait_timeout(Duration::from_secs(10)),
            Some(LossReason::Unreachable)
        );
        assert!(Instant::now() >= soon);
        assert!(
            !state.expire_at(
                Instant::now() + Duration::from_secs(60),
                LossReason::Unreachable
            ),
            "a renewal after the loss does not bring the lease back"
        );
        assert_eq!(signal.reason(), Some(LossReason::Unreachable));
    }

    #[test]
    fn a_lease_of_parts_expires_with_its_earliest_part() {
        let state = LossState::default();
        let now = Instant::now();
        let (soon, late) = (
            now + Duration::from_millis(20),
            now + Duration::from_secs(60),
        );
        assert!(state.expire_part_at(0, late, LossReason::Unreachable));
        assert!(state.expire_part_at(1, soon, LossReason::Unreachable));
        // Part 0 renewed again: it must not push part 1's expiry away.
        assert!(state.expire_part_at(0, late, LossReason::Unreachable));
        let signal = LossSignal {
            state: Arc::new(state),
        };
        assert_eq!(
            signal.wait_timeout(Duration::from_secs(10)),
            Some(LossReason::Unreachable)
        );
        assert!(Instant::now() >= soon);
    }

    #[test]
    fn a_moved_expiry_keeps_the_lease() {
        let state = LossState::default();
        assert!(state.expire_at(
            Instant::now() + Duration::from_millis(20),
            LossReason::MaxHold
        ));
        assert!(state.expire_at(
            Instant::now() + Duration::from_secs(60),
            LossReason::MaxHold
        ));
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(state.reason(), None);
    }
}
