//! The signal a holder gets when its lease is found lost.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::NotHeldReason;

/// Why a lease was found lost.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LossReason {
    /// A renewal found the key gone: the lease had run out.
    Expired,
    /// A renewal found another owner's token in the key.
    OwnedByOther,
    /// Redis could not be reached until the lease ran out by the local clock.
    Unreachable,
    /// The cap set by [`LockOptions::max_hold`](crate::LockOptions::max_hold)
    /// stopped the renewals and the lease ran out.
    MaxHold,
}

impl LossReason {
    /// The [`NotHeldReason`] an unlock after this loss reports.
    pub fn not_held_reason(self) -> NotHeldReason {
        match self {
            LossReason::OwnedByOther => NotHeldReason::OwnedByOther,
            _ => NotHeldReason::Expired,
        }
    }
}

impl From<NotHeldReason> for LossReason {
    fn from(reason: NotHeldReason) -> LossReason {
        match reason {
            NotHeldReason::Expired => LossReason::Expired,
            NotHeldReason::OwnedByOther => LossReason::OwnedByOther,
        }
    }
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LossReason::Expired => "a renewal found the key gone",
            LossReason::OwnedByOther => "a renewal found another owner's token",
            LossReason::Unreachable => "Redis stayed unreachable until the lease ran out",
            LossReason::MaxHold => "the hold-time cap stopped renewals and the lease ran out",
        })
    }
}

#[derive(Default)]
pub(crate) struct LossState {
    reason: Mutex<Option<LossReason>>,
    fired: Condvar,
}

impl LossState {
    /// Records the loss (the first reason wins) and wakes every waiter.
    pub(crate) fn lose(&self, reason: LossReason) {
        let mut current = self.reason.lock();
        if current.is_none() {
            *current = Some(reason);
            self.fired.notify_all();
        }
    }

    pub(crate) fn reason(&self) -> Option<LossReason> {
        *self.reason.lock()
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
/// use redmutex::{DistributedLock, LockOptions};
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
        let until = Instant::now().checked_add(timeout);
        let mut reason = self.state.reason.lock();
        loop {
            if let Some(lost) = *reason {
                return Some(lost);
            }
            match until {
                Some(until) => {
                    if self.state.fired.wait_until(&mut reason, until).timed_out() {
                        return *reason;
                    }
                }
                None => self.state.fired.wait(&mut reason),
            }
        }
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
        assert_eq!(
            LossReason::Unreachable.not_held_reason(),
            NotHeldReason::Expired
        );
    }
}
