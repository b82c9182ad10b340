//! The guide, chapter by chapter.
//!
//! For a user of the locks, in the order you need them:
//!
//! 1. [Using the locks](using): which type, which options, what happens
//!    when a lease is lost, which errors mean what.
//! 2. [Deployments](deployments): Sentinel, Redis Cluster, RedLock, TLS
//!    and authentication; the servers it is tested against.
//! 3. [The `redmutex` command](cli).
//! 4. [Operating it](operating): who holds what, holder metadata,
//!    metrics, managed and proxy Redis.
//! 5. [Guarantees and the failure model](failure_model): every fault,
//!    every bound, the ACL rules.
//! 6. [Performance](performance): what each call costs, and the commands
//!    that measure it.
//!
//! For a contributor: [How it works](internals), and `ARCHITECTURE.md`
//! and `CONTRIBUTING.md` in the repository.
//!
//! The chapters are the files of the repository's `docs/` folder. Their
//! Rust blocks are compiled as doc tests (not run: they need a server;
//! the repository's `examples/` are whole programs that `tests/examples.rs`
//! runs against one), but for the Prometheus exporter's in "Operating
//! it", which needs a crate this one does not depend on. Their links are
//! checked by rustdoc and `tests/docs.rs`.

#[doc = include_str!("../docs/using.md")]
pub mod using {}

#[doc = include_str!("../docs/deployments.md")]
pub mod deployments {}

#[doc = include_str!("../docs/cli.md")]
pub mod cli {}

#[doc = include_str!("../docs/operating.md")]
pub mod operating {}

#[doc = include_str!("../docs/failure-model.md")]
pub mod failure_model {}

#[doc = include_str!("../docs/performance.md")]
pub mod performance {}

#[doc = include_str!("../docs/internals.md")]
pub mod internals {}
