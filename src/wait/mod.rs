//! Waiting for a held lock: backoff, the local FIFO queue, the pace of its
//! head, and the one acquire loop every lock type goes through.
//!
//! Depends on `lease` (time arithmetic) and `error` only: it never talks to
//! Redis. Redis is reached through a lock type's [`acquire::Contender`],
//! and release messages through a [`queue::Feed`] and [`queue::Waker`]
//! given by the client.
//!
//! Invariants: every wait ends by the caller's deadline (with one last
//! attempt at it); a queued waiter that leaves passes a gift meant for it
//! on, or hands it back for release, so no lease is lost in a queue; only
//! the head of a queue talks to Redis.

pub(crate) mod acquire;
pub(crate) mod backoff;
pub(crate) mod pacing;
pub(crate) mod queue;
pub(crate) mod sync;
