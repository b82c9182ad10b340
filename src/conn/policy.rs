//! What the crate does when a reply does not come back: one table for every
//! request it sends, and the one loop that applies it.
//!
//! A request whose reply is lost (the connection reset, timed out or was
//! interrupted after the request was written) may or may not have run in
//! Redis. Resending it is right only if running it twice does what running
//! it once does. So every operation is one of:
//!
//! * **safe**: running it again changes nothing more (reads, `PEXPIRE` of
//!   our own key);
//! * **made safe**: the script recognises its own earlier effect and
//!   answers as the first run would have (the owner's token in the key, a
//!   per-hold field, a release marker);
//! * **never resent**: its outcome is reported as unknown
//!   ([`Error::OutcomeUnknown`]). No operation is in this class any more:
//!   on Redis Cluster, redis-rs itself resends a request after an I/O error
//!   (up to its retry count), so every request must be safe to send twice.
//!
//! The property the table keeps: *an operation whose reply was lost is
//! applied at most once, and its caller is told the truth*. A request
//! that may have been applied and whose outcome could not be learned within
//! the resend window is [`Error::OutcomeUnknown`]; an acquisition in that
//! state is also handed to the client's cleanup, which releases its token
//! (owner-checked) once Redis answers again (see [`crate::renew::watchdog`]).

use std::time::{Duration, Instant};

use redis::RedisResult;

use crate::conn::backend::{Backend, Connection, reply_lost};
use crate::conn::stats::Stats;
use crate::error::Error;

/// Every operation the crate sends, with its answer to "what if the reply
/// never comes back but Redis ran it?".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// `SET key token NX PX ttl GET` (and `WAIT` after it, or the read-only
    /// `PTTL` of a key held by another). *Made safe*: a
    /// resend that finds our own token in the key knows an earlier send set
    /// it; before `WAIT` it first writes on its new connection (an
    /// owner-checked `PEXPIRE`), since `WAIT` counts only that connection's
    /// writes.
    Acquire,
    /// `lua/acquire.lua` (fenced locks; every acquisition on a server
    /// before 7.0). *Made safe* the same
    /// way; the fencing counter is read back, not bumped again.
    AcquireScript,
    /// `lua/release.lua`, or the `WATCH` release. *Made safe*: a release
    /// that deletes our key leaves a marker `{key}:released:<token>` for a
    /// few timeouts; a resend that finds the key gone or taken reads it and
    /// answers "released".
    Release,
    /// `lua/extend.lua`, by a holder. *Safe*: an owner-checked `PEXPIRE`
    /// sets the same expiry again from a later moment (the local estimate
    /// keeps counting from the first send).
    Extend,
    /// The watchdog's pipelined `lua/extend.lua`. *Safe*, as `Extend`.
    Renew,
    /// `GET`, `HGET`, `PTTL`, `SCRIPT LOAD`: *safe*.
    Read,
    /// `lua/reentrant_acquire.lua`. *Made safe*: every hold is its own hash
    /// field, named by a fresh id; setting it again is no second hold.
    ReentrantAcquire,
    /// `lua/reentrant_release.lua`. *Made safe*: it deletes only this
    /// hold's field, and a release that deletes the key leaves a marker.
    ReentrantRelease,
    /// `lua/reentrant_extend.lua`: *safe*.
    ReentrantExtend,
    /// `lua/rw_acquire.lua`. *Made safe*: a resend that finds this token
    /// already reading or writing answers "acquired".
    RwAcquire,
    /// `lua/rw_release.lua`. *Made safe*: it removes only this holder's
    /// field, and leaves a marker when it did.
    RwRelease,
    /// `lua/rw_extend.lua`: *safe* (owner-checked, never re-creates a
    /// hold, never moves a deadline earlier).
    RwExtend,
    /// `lua/rw_downgrade.lua`. *Made safe*: a resend that finds this
    /// token reading and not writing answers "downgraded" and changes
    /// nothing.
    RwDowngrade,
    /// `lua/sem_acquire.lua`. *Made safe*: the permit id is chosen before
    /// the first send; a resend that finds its own permit answers
    /// "acquired" and takes no second one.
    SemAcquire,
    /// `lua/sem_release.lua`. *Made safe*: it removes only this permit's
    /// field (a second removal frees nothing) and leaves a marker.
    SemRelease,
    /// `lua/sem_extend.lua`: *safe* (never re-creates a permit).
    SemExtend,
    /// `lua/sem_set_limit.lua`: *safe* (sets the same limit again).
    SemSetLimit,
    /// `lua/multi_acquire.lua`. *Made safe*: a resend that finds a key of
    /// the set holding this acquisition's token counts it as taken (its
    /// fencing counter read back, not bumped again).
    MultiAcquire,
    /// `lua/multi_release.lua`. *Made safe*: it deletes only keys holding
    /// the token, and a release that deleted any leaves a marker with its
    /// answer for a resend to find.
    MultiRelease,
    /// `lua/multi_extend.lua`: *safe* (owner-checked `PEXPIRE`s, all or
    /// none, never re-creating a key).
    MultiExtend,
    /// `lua/fair_acquire.lua`. *Made safe*: a resend that finds the key
    /// holding this acquisition's token answers "acquired"; a queued
    /// waiter keeps its ticket.
    FairAcquire,
    /// `lua/fair_release.lua`. *Made safe* as `Release`: a marker when it
    /// deleted the key; leaving the queue twice removes nothing more.
    FairRelease,
    /// The cleanup of a lease nobody owns (an acquisition that failed after
    /// its request may have run): owner-checked releases. *Safe*.
    Cleanup,
    /// `lua/force_release.lua`
    /// ([`DistributedLock::force_release`](crate::DistributedLock::force_release)).
    /// *Made safe*: it records what it deleted in a marker named by a fresh
    /// request id before deleting; a resend answers from the marker and
    /// deletes nothing (a bare `GETDEL` sent twice would delete a lock
    /// somebody took in between).
    ForceRelease,
}

impl Op {
    /// Whether it can change anything in Redis (a lost reply then leaves
    /// the outcome unknown).
    pub(crate) fn writes(self) -> bool {
        !matches!(self, Op::Read)
    }

    /// How the operation is named in errors.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::Acquire
            | Op::AcquireScript
            | Op::ReentrantAcquire
            | Op::RwAcquire
            | Op::SemAcquire
            | Op::MultiAcquire
            | Op::FairAcquire => "acquire",
            Op::Release
            | Op::ReentrantRelease
            | Op::RwRelease
            | Op::SemRelease
            | Op::MultiRelease
            | Op::FairRelease => "release",
            Op::Extend | Op::ReentrantExtend | Op::RwExtend | Op::SemExtend | Op::MultiExtend => {
                "extend"
            }
            Op::Renew => "renew",
            Op::RwDowngrade => "downgrade",
            Op::Read => "read",
            Op::Cleanup => "cleanup",
            Op::SemSetLimit => "set the limit",
            Op::ForceRelease => "force release",
        }
    }
}

/// One operation is sent at most this many times.
const MAX_SENDS: u32 = 3;

/// What a send knows about the sends before it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Send {
    /// An earlier send's reply was lost: this one repeats it.
    pub(crate) resend: bool,
    /// This send may repeat an earlier copy of the request, sent by this
    /// crate or, on Redis Cluster, by redis-rs on its own.
    maybe_resent: bool,
    /// When the first send left.
    pub(crate) first: Instant,
}

impl Send {
    /// Taken as soon as the reply is in: whether an earlier copy may have
    /// run, and how long after the first send the reply came (every copy
    /// ran no later than that).
    pub(crate) fn replied(self) -> Replied {
        Replied {
            resend: self.maybe_resent,
            after: self.first.elapsed(),
        }
    }
}

/// See [`Send::replied`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Replied {
    pub(crate) resend: bool,
    pub(crate) after: Duration,
}

/// Errors Redis gives for the request itself, which say nothing ran and
/// which a second send would meet again: a wrong type, an ACL refusal, a
/// bad fencing counter, too few replicas, a command the server does not
/// have.
pub(crate) fn refusal(err: &redis::RedisError) -> bool {
    matches!(
        err.code(),
        Some("WRONGTYPE" | "NOPERM" | "FENCE" | "NOREPLICAS")
    ) || crate::error::refusal(err)
        || err
            .detail()
            .is_some_and(|detail| detail.starts_with("unknown command '"))
}

/// The window in which an operation is resent: twice the I/O timeout from
/// its first send (an interrupted system call, a stopped process, starts it
/// again). Release markers outlive it (see [`marker_ttl`]).
pub(crate) fn resend_window(timeout: Duration) -> Duration {
    timeout.saturating_mul(2)
}

/// How long a release marker lives: longer than any resend can come after
/// the first send, so a resend within the window always finds it.
pub(crate) fn marker_ttl(timeout: Duration) -> Duration {
    timeout
        .saturating_mul(3)
        .clamp(Duration::from_secs(1), Duration::from_secs(24 * 3600))
}

/// Runs `send` on a pooled connection, following the table above: a send
/// whose reply was lost is repeated on a fresh connection, at most
/// [`MAX_SENDS`] times and only within the resend window, each resend's
/// read cut to what is left of it; then, for operations that write, the
/// result is [`Error::OutcomeUnknown`]. Errors Redis answered with are
/// returned at once (WRONGTYPE named with `key`).
pub(crate) fn run<T>(
    backend: &Backend,
    stats: &Stats,
    op: Op,
    key: &str,
    send: impl FnMut(&mut Connection, Send) -> RedisResult<T>,
) -> Result<T, Error> {
    run_within(backend, stats, op, key, Duration::MAX, send)
}

/// [`run`], all of it (waiting for connections, every send) within
/// `budget`: for the watchdog, whose renewal must not outlast the lease.
pub(crate) fn run_within<T>(
    backend: &Backend,
    stats: &Stats,
    op: Op,
    key: &str,
    budget: Duration,
    mut send: impl FnMut(&mut Connection, Send) -> RedisResult<T>,
) -> Result<T, Error> {
    let window = resend_window(backend.timeout());
    let cluster = backend.deployment() == crate::conn::backend::Deployment::Cluster;
    let started = Instant::now();
    let ends = started.checked_add(budget);
    let mut first: Option<Instant> = None;
    let mut window_start = started;
    let mut lost: Option<redis::RedisError> = None;
    let mut sends = 0u32;
    let mut moving = Moving::new(window);
    let mut redirected_before = false;
    // What the next step may take: the budget left, and for a resend the
    // resend window left.
    let left = |lost: bool, window_start: Instant| {
        let budget = ends.map_or(Duration::MAX, |e| {
            e.saturating_duration_since(Instant::now())
        });
        if lost {
            budget.min(window.saturating_sub(window_start.elapsed()))
        } else {
            budget
        }
    };
    while sends < MAX_SENDS {
        let wait = left(lost.is_some(), window_start);
        if wait.is_zero() {
            break;
        }
        let mut con = match backend.get(wait.min(backend.connect_wait())) {
            Ok(con) => con,
            // Nothing was sent yet: a plain pool error (or a refusal).
            Err(err) if lost.is_none() => return Err(err),
            Err(_) => break,
        };
        let now = Instant::now();
        let this = Send {
            resend: lost.is_some() || redirected_before,
            maybe_resent: lost.is_some() || cluster,
            first: *first.get_or_insert(now),
        };
        if this.resend {
            stats.resend();
        }
        let limit = left(lost.is_some(), window_start);
        sends += 1;
        match con.within(limit, |con| send(con, this)) {
            Ok(value) => return Ok(value),
            // The slot is moving (MOVED/ASK past redis-rs's own retries,
            // TRYAGAIN while a multi-key script's keys are split between
            // two nodes, CLUSTERDOWN during a failover): the command that
            // met it did not run. Asked again with backoff (redis-rs
            // refreshes its slot map on the way) until the slot settles,
            // within the budget and the resend window. What came before it
            // in this send (an acquire script before its `WAIT`), or an
            // earlier copy redis-rs sent, may have run: the next send is
            // a resend (every operation may be sent twice, see the table),
            // and when the slot keeps moving past the bound, an operation
            // that writes has an unknown outcome, as on any cluster error.
            Err(err) if cluster && crate::error::redirected(&err) => {
                let pause = moving.next().min(left(false, started));
                if pause.is_zero() {
                    let source = redis::RedisError::from((
                        err.kind(),
                        "the key's slot kept moving",
                        format!("for {:?}: {err}", started.elapsed()),
                    ));
                    if op.writes() {
                        return Err(Error::OutcomeUnknown {
                            key: key.to_owned(),
                            operation: op.name(),
                            source,
                        });
                    }
                    return Err(Error::Redis(source));
                }
                log::debug!("redmutex: {} of {key:?} met {err}; asking again", op.name());
                std::thread::sleep(pause);
                // Not a send whose reply was lost: the bound here is time.
                sends = sends.saturating_sub(1);
                redirected_before = true;
                continue;
            }
            Err(err) if reply_lost(&err) => {
                log::debug!(
                    "redmutex: {} of {key:?} lost its reply ({err}); sending it again",
                    op.name()
                );
                if interrupted(&err) {
                    // The process was stopped or signalled, not the server
                    // slow: the window starts again.
                    window_start = Instant::now();
                }
                // Every operation is resent (see the table): on Redis
                // Cluster redis-rs resends by itself, so none may rely on
                // being sent once.
                lost = Some(err);
            }
            // An earlier send may have run: whatever this one is told (OOM,
            // READONLY after a failover, a refusal), the outcome is unknown.
            // On a cluster an earlier copy may have run too (redis-rs
            // resends by itself), unless the error proves nothing did.
            // A command the server does not know never ran, on any send.
            Err(err) if crate::error::unsupported(&err).is_some() => {
                return Err(Error::from_redis(key, err));
            }
            Err(source) if op.writes() && (lost.is_some() || (cluster && !refusal(&source))) => {
                return Err(Error::OutcomeUnknown {
                    key: key.to_owned(),
                    operation: op.name(),
                    source,
                });
            }
            Err(err) => return Err(Error::from_redis(key, err)),
        }
    }
    match lost {
        Some(source) if op.writes() => Err(Error::OutcomeUnknown {
            key: key.to_owned(),
            operation: op.name(),
            source,
        }),
        Some(source) => Err(Error::Redis(source)),
        None => Err(Error::Redis(redis::RedisError::from((
            redis::ErrorKind::Io,
            "no time was left to send the request",
        )))),
    }
}

/// Pauses between attempts while a slot moves: 10 ms, doubling to 200 ms,
/// for at most `bound` in all.
struct Moving {
    started: Instant,
    bound: Duration,
    step: Duration,
}

impl Moving {
    fn new(bound: Duration) -> Moving {
        Moving {
            started: Instant::now(),
            bound,
            step: Duration::from_millis(10),
        }
    }

    /// The next pause; zero once `bound` is spent.
    fn next(&mut self) -> Duration {
        let left = self.bound.saturating_sub(self.started.elapsed());
        let pause = self.step.min(left);
        self.step = (self.step * 2).min(Duration::from_millis(200));
        pause
    }
}

/// `EINTR`: a read or write interrupted by a signal (after `SIGSTOP` and
/// `SIGCONT`, on a socket with a timeout, Linux does not restart it).
/// redis-rs keeps the `io::Error` out of reach, so it is known by its text:
/// the OS's (`EINTR`) or the standard library's for that kind.
fn interrupted(err: &redis::RedisError) -> bool {
    err.is_io_error() && {
        let text = err.to_string();
        text.contains("Interrupted system call") || text.contains("operation interrupted")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_outlive_the_resend_window() {
        for secs in [0, 1, 2, 30, 3600] {
            let timeout = Duration::from_secs(secs);
            assert!(marker_ttl(timeout) > resend_window(timeout), "{timeout:?}");
        }
        assert_eq!(resend_window(Duration::MAX), Duration::MAX);
        assert!(marker_ttl(Duration::MAX) <= Duration::from_secs(24 * 3600));
    }

    #[test]
    fn a_moving_slot_is_asked_again_with_growing_pauses_within_a_bound() {
        let mut moving = Moving::new(Duration::from_secs(3600));
        let pauses: Vec<u64> = (0..7).map(|_| moving.next().as_millis() as u64).collect();
        assert_eq!(pauses, [10, 20, 40, 80, 160, 200, 200]);
        assert_eq!(Moving::new(Duration::ZERO).next(), Duration::ZERO);
        let moved = redis::RedisError::from((redis::ErrorKind::Io, "not a redirection"));
        assert!(!crate::error::redirected(&moved));
    }

    #[test]
    fn reads_change_nothing() {
        assert!(!Op::Read.writes());
        assert!(Op::Cleanup.writes());
    }

    #[test]
    fn an_interrupted_call_is_recognised() {
        let err = redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::Interrupted));
        assert!(interrupted(&err));
        assert!(reply_lost(&err));
        let timeout = redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert!(!interrupted(&timeout));
        assert!(reply_lost(&timeout));
    }
}
