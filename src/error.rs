//! The crate's one error type.

use std::fmt;
use std::time::Duration;

/// Why a lock is not held (any more): what an owner-checked operation
/// found in Redis ([`Error::NotHeld`]), or why a held lease was found lost
/// ([`LossSignal`](crate::LossSignal), a guard's `is_lost()`). One type for
/// both: an `unlock()` after a loss Redis reported answers with the same
/// reason the loss signal gave.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LossReason {
    /// The key (or this holder's field) is gone: the lease ran out, or
    /// someone deleted it, and nobody holds it in our place.
    Expired,
    /// The key holds another owner's token: our lease ran out (or was
    /// broken) and another holder took the lock.
    OwnedByOther,
    /// Redis could not be reached until the lease ran out by the local
    /// clock (the watchdog's verdict).
    Unreachable,
    /// The cap set by [`LockOptions::max_hold`](crate::LockOptions::max_hold)
    /// stopped the renewals and the lease ran out.
    MaxHold,
    /// Read in a process forked since the lease was taken: the lease is
    /// its parent's, never this process's.
    Inherited,
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LossReason::Expired => "the lease ran out and the key is gone",
            LossReason::OwnedByOther => "the key now holds another owner's token",
            LossReason::Unreachable => "Redis stayed unreachable until the lease ran out",
            LossReason::MaxHold => "the hold-time cap stopped renewals and the lease ran out",
            LossReason::Inherited => "inherited through fork(): the lease is the parent process's",
        })
    }
}

/// Everything that can go wrong taking, keeping or releasing a lock.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// [`DistributedLock::lock`](crate::DistributedLock::lock) (or another
    /// type's blocking acquire) waited its whole `wait` and the lock stayed
    /// held by someone else.
    #[error("timed out after {waited:?} waiting for lock {key:?}{}", held_by(holder.as_deref()))]
    Timeout {
        /// The lock key.
        key: String,
        /// How long the caller waited.
        waited: Duration,
        /// Who held it when the last attempt was refused, when the reply
        /// named a holder (no second request is made for it): the holder's
        /// token redacted, `…|HOST|PID|PROGRAM|AT_MS|LABEL`
        /// ([`redact`](crate::redact); read it with
        /// [`Holder::from_token`](crate::Holder::from_token)). A read-write
        /// lock names its writer, else a reader; a semaphore the permit
        /// that runs out first; a reentrant lock one of the owner's holds.
        /// `None` for a [`RedLock`](crate::RedLock), and when the holder's
        /// token carries no metadata.
        holder: Option<String>,
    },
    /// An owner-checked operation (release, extend) found the lock is no
    /// longer ours. Nothing was changed in Redis.
    #[error("lock {key:?} is not held by this owner: {reason}")]
    NotHeld {
        /// The lock key.
        key: String,
        /// What Redis answered: [`LossReason::Expired`] (the key or field
        /// gone) or [`LossReason::OwnedByOther`].
        reason: LossReason,
    },
    /// The caller passed something unusable (an empty key, a ttl under 1 ms,
    /// a URL that does not parse). Nothing was sent to Redis.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The key exists but holds another lock type's data, or other data
    /// (a [`DistributedLock`](crate::DistributedLock)'s key is a string; a
    /// [`ReentrantLock`](crate::ReentrantLock)'s, an
    /// [`RwLock`](crate::RwLock)'s and a
    /// [`Semaphore`](crate::Semaphore)'s are hashes, each with fields only
    /// it writes): another kind of lock, or other data, lives under that
    /// name. Every lock type's scripts refuse it before changing anything:
    /// nothing was changed in Redis.
    #[error(
        "key {key:?} holds a value of another type than this lock uses (WRONGTYPE): \
         another kind of lock or other data lives there; pick another key"
    )]
    WrongType {
        /// The lock key.
        key: String,
    },
    /// The lock was acquired but fewer replicas than
    /// [`LockOptions::min_replicas`](crate::LockOptions::min_replicas) asked
    /// for acknowledged it in time; it was released again.
    #[error(
        "lock {key:?} reached {acked} of the {wanted} replicas asked for in time; it was released again"
    )]
    NotReplicated {
        /// The lock key.
        key: String,
        /// Replicas that acknowledged the write.
        acked: u32,
        /// Replicas asked for.
        wanted: u32,
    },
    /// The primary refused the write (`NOREPLICAS`): it has fewer connected
    /// replicas than its `min-replicas-to-write`. Nothing was written; the
    /// attempt is not repeated.
    #[error(
        "the primary refuses writes to {key:?}: fewer replicas than its min-replicas-to-write (NOREPLICAS)"
    )]
    NoReplicas {
        /// The lock key.
        key: String,
    },
    /// A [`RedLock`](crate::RedLock) round did not gather a majority of the
    /// nodes in time (or took longer than the ttl). Every node was released.
    /// From [`RedLock::status`](crate::RedLock::status): too few nodes
    /// answered to tell who holds it (`granted`: the most nodes any one
    /// holder was found on).
    #[error("RedLock on {key:?}: {granted} of the {needed} nodes needed granted it; {}", failed.join("; "))]
    Quorum {
        /// The lock key.
        key: String,
        /// Nodes that granted.
        granted: usize,
        /// Nodes needed.
        needed: usize,
        /// What went wrong, per failed node.
        failed: Vec<String>,
    },
    /// [`RedLockGuard::extend`](crate::Lease::extend) (or
    /// [`RedLockGuard::is_held`](crate::Lease::is_held)) heard fewer
    /// than a majority of the nodes confirm our token in time, and too few
    /// answered "not ours" to rule a majority out: whether a majority
    /// still holds the lock is unknown. Stop the work it protects: the
    /// guard's validity is zero until a later extension a majority
    /// confirms (it is not marked lost, since it may still be held).
    #[error("RedLock on {key:?} may be lost: {extended} of the {needed} nodes needed confirmed it; {}", failed.join("; "))]
    QuorumLost {
        /// The lock key.
        key: String,
        /// Nodes that confirmed our token (extended the lease, or answered
        /// that they hold it).
        extended: usize,
        /// Nodes needed.
        needed: usize,
        /// What went wrong, per failed node.
        failed: Vec<String>,
    },
    /// [`RedLockGuard::unlock`](crate::Lease::unlock) released on
    /// fewer than a majority of the nodes in time, and too few answered
    /// "not ours" to rule a majority out: the nodes not heard from
    /// (unreachable, too slow, or refusing) decide whether it was held, and
    /// are released in the background as soon as they answer (or expire by
    /// the ttl). `failed` says what each node met.
    #[error("RedLock on {key:?}: released on {released} of {nodes} nodes; {}", failed.join("; "))]
    NodesUnreachable {
        /// The lock key.
        key: String,
        /// Nodes that released.
        released: usize,
        /// All nodes.
        nodes: usize,
        /// What went wrong, per failed node.
        failed: Vec<String>,
    },
    /// A request that changes the lock was sent, and no reply came back
    /// (the connection was reset, timed out or was interrupted) even after
    /// it was sent again within the resend window: it may or may not have
    /// been applied. A release in this state leaves the key to expire by
    /// its ttl at worst; an acquisition's token is released in the
    /// background once Redis answers again, so no lease of it outlives the
    /// error by more than a few I/O timeouts.
    #[error("the outcome of {operation} on {key:?} is unknown: no reply came back ({source})")]
    OutcomeUnknown {
        /// The lock key.
        key: String,
        /// What was being done: acquire, release, extend, renew, cleanup,
        /// force release, downgrade.
        operation: &'static str,
        /// The last connection error.
        #[source]
        source: redis::RedisError,
    },
    /// The key's fencing counter ([`LockClient::fence_key`](crate::LockClient::fence_key)) cannot be
    /// incremented: it holds a non-integer, another type, or `i64::MAX`, or
    /// the ACL user may not use it (`NOPERM`: the rule lacks the `{KEY}`
    /// keys). Checked before the lock is taken: nothing was changed.
    #[error("the fencing counter {counter:?} of lock {key:?} is unusable: {detail}")]
    FenceCounter {
        /// The lock key.
        key: String,
        /// The counter's key.
        counter: String,
        /// What Redis said about it.
        detail: String,
    },
    /// The server refuses a command the crate needs (renamed or disabled,
    /// as managed and proxy services do). The refused command did not run;
    /// a lock it was meant to take is not taken, and a lock taken before
    /// (a `WAIT` after the grant) is given back by the client's cleanup.
    #[error("the server refuses {command}, which {needed_by} needs ({detail})")]
    Unsupported {
        /// The command, as the server named it.
        command: String,
        /// What needs it, and what to do about it.
        needed_by: &'static str,
        /// What Redis said.
        detail: String,
    },
    /// The server refuses this client: a wrong password or an unknown
    /// user, a password it requires and none was given (`NOAUTH`), a
    /// database it does not have (`SELECT`). Definitive: sending again
    /// meets the same answer, so it is reported at the first connect that
    /// meets it, not after the pool's timeout. Nothing was sent for the
    /// lock. Fix the URL, the user or the password.
    #[error(
        "the server refuses this client: {detail} (check the URL's user, password and database number)"
    )]
    Refused {
        /// What the server said.
        detail: String,
    },
    /// Redis answered with an error, or the connection failed or timed out.
    #[error("redis error: {0}")]
    Redis(#[from] redis::RedisError),
    /// No connection could be had from the pool within its connection timeout
    /// (the server is unreachable, or the pool is exhausted).
    #[error("no Redis connection from the pool: {0}")]
    Pool(#[from] PoolError),
}

/// Why no connection could be had from a pool: the payload of
/// [`Error::Pool`].
///
/// Its message says what the last connection attempt met, when there was
/// one (`timed out waiting for connection: …`), so a log line names the
/// cause without a second look.
#[derive(Debug)]
pub struct PoolError {
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl PoolError {
    /// The crate's own pool gave up: `last` is what the last connect met.
    pub(crate) fn timed_out(last: Option<redis::RedisError>) -> PoolError {
        match last {
            Some(err) => PoolError {
                message: format!("timed out waiting for connection: {err}"),
                source: Some(Box::new(err)),
            },
            None => PoolError {
                message: "timed out waiting for connection".to_owned(),
                source: None,
            },
        }
    }
}

impl std::fmt::Display for PoolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PoolError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|err| err as &(dyn std::error::Error + 'static))
    }
}

/// A pool the caller built with r2d2 ([`crate::Pool`]) reports its own
/// timeouts; they become [`Error::Pool`] like the crate's own.
impl From<r2d2::Error> for PoolError {
    fn from(err: r2d2::Error) -> PoolError {
        PoolError {
            message: err.to_string(),
            source: Some(Box::new(err)),
        }
    }
}

impl From<r2d2::Error> for Error {
    fn from(err: r2d2::Error) -> Error {
        Error::Pool(PoolError::from(err))
    }
}

/// The end of a timeout's message: who held the lock, when known.
fn held_by(holder: Option<&str>) -> String {
    holder.map_or_else(String::new, |holder| format!(" (held by {holder})"))
}

impl Error {
    /// True for [`Error::Timeout`].
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. })
    }

    /// True for [`Error::NotHeld`], whatever the reason.
    pub fn is_not_held(&self) -> bool {
        matches!(self, Error::NotHeld { .. })
    }

    /// The reason of an [`Error::NotHeld`], `None` for every other error.
    pub fn not_held_reason(&self) -> Option<LossReason> {
        match self {
            Error::NotHeld { reason, .. } => Some(*reason),
            _ => None,
        }
    }

    /// True when the error came from reaching Redis, so that trying again
    /// later may succeed: no connection from the pool ([`Error::Pool`]), a
    /// lost reply ([`Error::OutcomeUnknown`]), and the [`Error::Redis`]
    /// errors of the link (I/O, timeout, refused or dropped connection) or
    /// of a server not ready yet (`LOADING`, `TRYAGAIN`, `CLUSTERDOWN`,
    /// `MASTERDOWN`). False for what a retry meets again: a server refusal
    /// (`NOPERM`, a script error, a wrong type), bad input, a lock state.
    pub fn is_connection(&self) -> bool {
        match self {
            Error::Pool(_) | Error::OutcomeUnknown { .. } => true,
            Error::Redis(err) => {
                err.is_io_error()
                    || err.is_timeout()
                    || err.is_connection_dropped()
                    || err.is_connection_refusal()
                    || matches!(
                        err.code(),
                        Some("LOADING" | "TRYAGAIN" | "CLUSTERDOWN" | "MASTERDOWN")
                    )
            }
            _ => false,
        }
    }

    /// A short stable name of this error's variant, for logs and metric
    /// labels: one of [`Error::KINDS`].
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Timeout { .. } => "timeout",
            Error::NotHeld { .. } => "not_held",
            Error::InvalidArgument(_) => "invalid_argument",
            Error::WrongType { .. } => "wrong_type",
            Error::NotReplicated { .. } => "not_replicated",
            Error::NoReplicas { .. } => "no_replicas",
            Error::Quorum { .. } => "quorum",
            Error::QuorumLost { .. } => "quorum_lost",
            Error::NodesUnreachable { .. } => "nodes_unreachable",
            Error::OutcomeUnknown { .. } => "outcome_unknown",
            Error::FenceCounter { .. } => "fence_counter",
            Error::Unsupported { .. } => "unsupported",
            Error::Refused { .. } => "refused",
            Error::Redis(_) => "redis",
            Error::Pool(_) => "pool",
        }
    }

    /// Every name [`Error::kind`] returns.
    pub const KINDS: [&'static str; 15] = [
        "timeout",
        "not_held",
        "invalid_argument",
        "wrong_type",
        "not_replicated",
        "no_replicas",
        "quorum",
        "quorum_lost",
        "nodes_unreachable",
        "outcome_unknown",
        "fence_counter",
        "unsupported",
        "refused",
        "redis",
        "pool",
    ];

    /// True for [`Error::OutcomeUnknown`]: the request may or may not have
    /// been applied.
    pub fn is_outcome_unknown(&self) -> bool {
        matches!(self, Error::OutcomeUnknown { .. })
    }

    /// A failed release that may have left the key held: its outcome is
    /// unknown, or it was never sent (no connection). Not a refusal Redis
    /// answered (an ACL, a wrong type), which a cleanup would meet again.
    pub(crate) fn may_leave_a_lease(&self) -> bool {
        matches!(self, Error::OutcomeUnknown { .. } | Error::Pool(_))
    }

    /// Maps a Redis error about `key`, turning WRONGTYPE (alone or inside a
    /// pipeline's errors) into [`Error::WrongType`] with the key's name.
    pub(crate) fn from_redis(key: &str, err: redis::RedisError) -> Error {
        let wrong_type = server_code(&err) == Some("WRONGTYPE")
            || err
                .clone()
                .into_server_errors()
                .is_some_and(|errors| errors.iter().any(|(_, error)| error.code() == "WRONGTYPE"));
        let no_replicas =
            err.code() == Some("NOREPLICAS") || err.to_string().contains("NOREPLICAS");
        if let Some(refused) = unsupported(&err) {
            return refused;
        }
        if refusal(&err) {
            return Error::Refused {
                detail: err.to_string(),
            };
        }
        if wrong_type {
            Error::WrongType {
                key: key.to_owned(),
            }
        } else if no_replicas {
            Error::NoReplicas {
                key: key.to_owned(),
            }
        } else {
            Error::Redis(err)
        }
    }

    pub(crate) fn not_held(key: &str, reason: LossReason) -> Error {
        Error::NotHeld {
            key: key.to_owned(),
            reason,
        }
    }
}

/// A server's "unknown command" for a command the crate sent itself (one
/// renamed away or disabled) as [`Error::Unsupported`], naming what needs
/// it. The command was refused, so nothing ran. (A command refused inside
/// a script stays [`Error::Redis`]: the script may have written before it.)
/// Whether the server refused this client for good, at a connect or at its
/// first command: authentication (a wrong password, an unknown user, none
/// given where one is required), an ACL that refuses the connection, a
/// database number it does not have. Not what a retry can fix (an I/O
/// error, `LOADING`).
pub(crate) fn refusal(err: &redis::RedisError) -> bool {
    matches!(err.kind(), redis::ErrorKind::AuthenticationFailed)
        || matches!(err.code(), Some("NOAUTH" | "WRONGPASS"))
        || err
            .detail()
            .is_some_and(|detail| detail.contains("DB index is out of range"))
}

pub(crate) fn unsupported(err: &redis::RedisError) -> Option<Error> {
    // Redis echoes the first arguments of an unknown command: a lock key,
    // a marker named by a token's secret, a token. Never repeated.
    let detail = err.detail()?;
    let detail = detail
        .split_once(", with args beginning with")
        .map_or(detail, |(command, _)| command);
    let command = detail
        .strip_prefix("unknown command '")
        .and_then(|rest| rest.split('\'').next())?
        .to_owned();
    let needed_by = match command.to_ascii_uppercase().as_str() {
        "WAIT" => "min_replicas (turn it off for this server)",
        "GETDEL" => "force_release (GETDEL needs Redis 6.2 or newer)",
        "SCRIPT" | "EVAL" | "EVALSHA" => {
            "every lock type but the plain lock's quick path (they run Lua scripts)"
        }
        _ => {
            "redmutex (see the ACL rules in the failure model chapter of the guide, redmutex::guide::failure_model for the commands it uses)"
        }
    };
    Some(Error::Unsupported {
        command,
        needed_by,
        detail: detail.to_owned(),
    })
}

/// The error's code, also for an error raised inside a script: Redis
/// before 7.0 wraps those as `ERR Error running script (call to f_…):
/// @user_script:N: CODE message`.
pub(crate) fn server_code(err: &redis::RedisError) -> Option<&str> {
    let code = err.code()?;
    if code != "ERR" {
        return Some(code);
    }
    let inner = err
        .detail()
        .filter(|detail| detail.starts_with("Error running script"))
        .and_then(|detail| detail.split(": ").nth(2))
        .and_then(|message| message.split(' ').next())
        .filter(|word| !word.is_empty() && word.bytes().all(|b| b.is_ascii_uppercase()));
    Some(inner.unwrap_or(code))
}

/// The server's ACL refused the request (`NOPERM`), alone or as one reply
/// of a pipeline or transaction.
pub(crate) fn refused_by_acl(err: &redis::RedisError) -> bool {
    server_code(err) == Some("NOPERM")
        || err
            .clone()
            .into_server_errors()
            .is_some_and(|errors| errors.iter().any(|(_, error)| error.code() == "NOPERM"))
}

/// The server's "syntax error": a command it parsed and refused whole,
/// such as `SET … NX … GET` before Redis 7.0. Nothing ran.
pub(crate) fn syntax_error(err: &redis::RedisError) -> bool {
    err.code() == Some("ERR") && err.detail().is_some_and(|d| d.starts_with("syntax error"))
}

/// A syntax error answering a resend is known too: every send of that same
/// request met the same refusal, so none of them ran. (Otherwise a
/// resend's error leaves the first send's outcome unknown.)
pub(crate) fn known_refusal(err: Error) -> Error {
    match err {
        Error::OutcomeUnknown { source, .. } if syntax_error(&source) => Error::Redis(source),
        other => other,
    }
}

/// A cluster's answer that the key's slot is moving or unserved right now:
/// the command did not run. `NOSCRIPT` too: it reaches the caller only
/// when the script was just loaded where the call went and the call, sent
/// again, met a node without it (the slot moved in between).
pub(crate) fn redirected(err: &redis::RedisError) -> bool {
    matches!(
        err.code(),
        Some("MOVED" | "ASK" | "TRYAGAIN" | "CLUSTERDOWN" | "NOSCRIPT")
    )
}
