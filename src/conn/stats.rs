//! Counters of what a `LockClient` did, for reports and metrics.

use std::sync::atomic::{AtomicU64, Ordering};

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
}

impl Stats {
    pub(crate) fn renewal_batch(&self, renewals: u64) {
        self.commands(renewals);
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
        }
    }
}
