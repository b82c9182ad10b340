//! Talking to Redis: the pool and its connections for every deployment,
//! TLS settings and the TLS socket the subscriber shares between threads,
//! why a connect failed (each TLS refusal's cause and fix), the resend
//! policy that makes a lost reply safe, the command counters, and the
//! bounded background-thread helper.
//!
//! Below the watchdog, the subscriber and the client, which all need it; it
//! knows nothing of locks beyond the [`policy::Op`] table of what each
//! request may do when sent twice.
//!
//! Invariants: no call waits longer than its connect, handshake and I/O
//! timeouts; a connection whose reply was lost is never reused; an
//! operation is resent only as its `Op` allows.

pub(crate) mod backend;
pub(crate) mod diagnose;
pub(crate) mod histogram;
pub(crate) mod ledger;
pub(crate) mod policy;
pub(crate) mod pool;
pub(crate) mod stats;
pub(crate) mod tls;
pub(crate) mod worker;
