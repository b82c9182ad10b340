//! Keeping leases alive, and cleaning up after failures: one background
//! thread per client (the watchdog) renews watched leases at a third of
//! their ttl, pipelined, and releases what failed acquisitions and
//! releases may have left in Redis (orphans).
//!
//! Depends on `lease` (timing, the loss signal), `conn` (the pool and the
//! resend policy) and `script`; never on a lock type: an orphan says which
//! release script undoes it ([`watchdog::OrphanKind`]).
//!
//! Invariants: no lock is held across a round trip; a watched lease reads
//! as lost from its local expiry whatever a renewal is doing; a renewal
//! never outlasts the lease it renews; an orphan is released owner-checked,
//! again and again until no request of it can still arrive.

pub(crate) mod watchdog;
