//! Release messages: one dedicated pub/sub connection and thread per
//! client, subscribed to the release channels of keys that have waiters.
//!
//! `transport` owns the socket (where to connect, Sentinel lookup, RESP
//! through redis-rs's parser); `subscriber` owns the bookkeeping (which
//! channels are wanted, confirmed, refused) and the thread. Depends on
//! `conn` (socket settings, counters, the bounded worker) only: waiters are
//! woken through the callback each subscription carries, so this module
//! knows nothing of queues or locks.
//!
//! Invariants: a subscription reads as live only once the server confirmed
//! it on the current connection; a lost connection wakes every waiter; a
//! silent link is dropped within two timeouts.

pub(crate) mod subscriber;
pub(crate) mod transport;
