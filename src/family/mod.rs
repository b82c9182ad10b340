//! The rest of the lock family: [`reentrant::ReentrantLock`] (holds counted
//! in a Redis hash), [`rwlock::RwLock`] (readers and a writer in one hash),
//! [`semaphore::Semaphore`] (permits in one hash), [`fair::FairLock`] (a
//! plain key granted in queue order), [`multi::MultiLock`] (a
//! set of plain lock keys, all or none) and [`redlock::RedLock`] (a
//! majority of independent nodes).
//!
//! Each supplies the acquire loop (`wait::acquire`) with its one attempt
//! and owns its guard; they share the release and marker machinery of
//! `client::release`. Depends on `client`, `wait`, `renew`, `lease` and
//! `script`; nothing depends on it but the crate root.
//!
//! Invariants: every release is owner-checked and safe to send twice (one
//! hash field per hold or holder, a marker when the key is deleted); what a
//! failed request may have left goes to the client's cleanup.

pub(crate) mod fair;
pub(crate) mod multi;
pub(crate) mod redlock;
pub(crate) mod reentrant;
pub(crate) mod rwlock;
pub(crate) mod semaphore;
