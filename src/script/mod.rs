//! The Lua scripts, compiled in from `lua/` and sent with `EVALSHA`, and
//! the names derived from a lock key (`names`: channel, fence counter,
//! release markers).
//!
//! Depends on `conn` only. Invariant: every auxiliary key a script touches
//! carries the lock key's hash tag, so each script runs in one cluster slot.
//!
//! `redis::Script::invoke` tries `EVALSHA` and, when the server answers
//! `NOSCRIPT` (after `SCRIPT FLUSH` or a restart), loads the script and tries
//! again, so callers never see `NOSCRIPT`. Every script says in its header
//! whether it is safe to run twice (see `policy.rs`): all of them are.

use std::sync::LazyLock;

use redis::{Cmd, RedisResult, Script, Value};

use crate::conn::backend::Connection;
use crate::conn::stats::Stats;

pub(crate) mod names;

/// `lua/acquire.lua`: SET NX PX GET (the fence counter bumped first), or
/// the holder's PTTL. Returns `{1, 0, fence}` acquired or `{0, pttl, 0}`
/// held.
pub(crate) static ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/acquire.lua")));

/// `lua/release.lua`: owner-checked delete, marker and PUBLISH. Returns
/// one integer: `n + 3` released (the message reached `n` subscribers), 1
/// released (message not sent), 2 released by an earlier run, 0 gone, -1
/// other owner (-2, -3: the same, marker unreadable).
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(RELEASE_SOURCE));

/// The source of `lua/release.lua`, for an `EVAL` where `EVALSHA` cannot
/// be retried (a release written behind that met `NOSCRIPT`).
pub(crate) const RELEASE_SOURCE: &str = include_str!("../../lua/release.lua");

/// `lua/release.lua` without a marker, by hash (`EVAL` with the source when
/// `eval`): the owner-checked release of `token` from `key`, announced on
/// `channel`, for a caller who never sends it twice on its own (a drop
/// writing it behind, the cleanup of an orphan).
pub(crate) fn release_unmarked(key: &str, token: &str, channel: &str, eval: bool) -> Cmd {
    let mut cmd = if eval {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(RELEASE_SOURCE);
        cmd
    } else {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(RELEASE.get_hash());
        cmd
    };
    cmd.arg(1).arg(key).arg(token).arg(channel).arg(1);
    cmd
}

/// `lua/force_release.lua`: delete whatever the key holds, once per request.
/// Returns the token it held, or nil.
pub(crate) static FORCE_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/force_release.lua")));

/// `lua/extend.lua`: owner-checked PEXPIRE. Returns 1 extended, 0 gone, -1 other owner.
pub(crate) static EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/extend.lua")));

/// `lua/reentrant_acquire.lua`: adds this hold's field. Returns `{count, pttl}`.
pub(crate) static REENTRANT_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/reentrant_acquire.lua")));

/// `lua/reentrant_release.lua`: removes this hold's field, DEL when none is
/// left. Returns nil (not the owner), -1 gone, 0 still held, 1 released.
pub(crate) static REENTRANT_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/reentrant_release.lua")));

/// `lua/reentrant_extend.lua`: owner-checked PEXPIRE. Returns 1, 0 gone, -1 other owner.
pub(crate) static REENTRANT_EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/reentrant_extend.lua")));

/// `lua/rw_acquire.lua`: read or write acquire. Returns `{acquired, wait_ms}`.
pub(crate) static RW_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/rw_acquire.lua")));

/// `lua/rw_release.lua`: remove this holder's field(s). Returns 1, 0 gone,
/// -1 other writer.
pub(crate) static RW_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/rw_release.lua")));

/// `lua/sem_acquire.lua`: take a permit. Returns `{acquired, wait_ms,
/// fence}`; `LIMIT <n>` when live permits exist under another limit,
/// `FENCE ...` when the fencing counter cannot be incremented.
pub(crate) static SEM_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/sem_acquire.lua")));

/// `lua/sem_release.lua`: give this permit back. Returns `{1, receivers}`,
/// `{2, 0}` (an earlier run did), `{0, 0}` gone, `{-2, 0}` gone and the
/// marker unreadable.
pub(crate) static SEM_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/sem_release.lua")));

/// `lua/sem_extend.lua`: renew a permit still present. Returns 1 or 0.
pub(crate) static SEM_EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/sem_extend.lua")));

/// `lua/sem_status.lua`: the limit and the live permits. Returns `{limit,
/// id, ms, fence, ...}` (limit 0: no state; -1: not a semaphore).
pub(crate) static SEM_STATUS: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/sem_status.lua")));

/// `lua/sem_check.lua`: whether a permit is in place, and the stored
/// limit. Returns `{live, limit}`; reads only.
pub(crate) static SEM_CHECK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/sem_check.lua")));

/// `lua/sem_set_limit.lua`: change a semaphore's limit. Returns the
/// previous one (0: no state).
pub(crate) static SEM_SET_LIMIT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/sem_set_limit.lua")));

/// `lua/inspect.lua`: what one key holds, for listing. Returns `{kind,
/// ms, holders, limit}`, never a token.
pub(crate) static INSPECT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/inspect.lua")));

/// Reads the common reply of the owner-checked scripts.
pub(crate) fn owner_checked(reply: i64) -> Result<(), crate::error::NotHeldReason> {
    match reply {
        1 => Ok(()),
        0 => Err(crate::error::NotHeldReason::Expired),
        _ => Err(crate::error::NotHeldReason::OwnedByOther),
    }
}

/// Sends `calls` (`EVALSHA`s of `scripts`) in one pipeline and returns
/// each call's own result: one refused call (a wrong type, an ACL) does not
/// fail the others. When the server lost a script (`NOSCRIPT` in any
/// reply), loads them all and sends the pipeline once more (every call
/// sent here is safe to run twice). A pipeline of `EVALSHA` does not
/// reload by itself as `Script::invoke` does. On a cluster, redis-rs splits
/// it by node and `SCRIPT LOAD` goes to every primary.
pub(crate) fn pipelined(
    con: &mut Connection,
    calls: &[Cmd],
    scripts: &[&Script],
    stats: &Stats,
) -> RedisResult<Vec<RedisResult<Value>>> {
    let send = |con: &mut Connection| -> RedisResult<Vec<RedisResult<Value>>> {
        if let Some(result) = con.on_cluster(|cluster| cluster_each(cluster, calls)) {
            return result;
        }
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for call in calls {
            pipe.add_command(call.clone());
        }
        pipe.query(con)
    };
    let replies = send(con)?;
    if replies
        .iter()
        .any(|reply| reply.as_ref().is_err_and(is_noscript))
    {
        for script in scripts {
            script.load(con)?;
        }
        stats.commands(scripts.len() as u64 + calls.len() as u64);
        return send(con);
    }
    Ok(replies)
}

/// A cluster pipeline, each call's own result. redis-rs's cluster pipeline
/// cannot return errors one by one: when some calls are refused, it names
/// them, and the others are sent once more (safe: see [`pipelined`]) for
/// their replies.
fn cluster_each(
    cluster: &mut redis::cluster::ClusterConnection,
    calls: &[Cmd],
) -> RedisResult<Vec<RedisResult<Value>>> {
    let run = |cluster: &mut redis::cluster::ClusterConnection, calls: &[&Cmd]| {
        let mut pipe = redis::cluster::cluster_pipe();
        for call in calls {
            pipe.add_command((*call).clone());
        }
        pipe.query::<Vec<Value>>(cluster)
    };
    let all: Vec<&Cmd> = calls.iter().collect();
    let err = match run(cluster, &all) {
        Ok(values) => return Ok(values.into_iter().map(Ok).collect()),
        Err(err) => err,
    };
    let Some(refused) = err.clone().into_server_errors() else {
        return Err(err);
    };
    let mut results: Vec<Option<RedisResult<Value>>> = calls.iter().map(|_| None).collect();
    for (index, error) in refused.iter() {
        if let Some(slot) = results.get_mut(*index) {
            *slot = Some(Err(redis::RedisError::from(error.clone())));
        }
    }
    let rest: Vec<&Cmd> = all
        .iter()
        .zip(&results)
        .filter(|(_, result)| result.is_none())
        .map(|(call, _)| *call)
        .collect();
    let mut values = if rest.is_empty() {
        Vec::new()
    } else {
        run(cluster, &rest)?
    }
    .into_iter();
    Ok(results
        .into_iter()
        .map(|result| match result {
            Some(result) => result,
            None => values.next().map(Ok).unwrap_or_else(|| {
                Err(redis::RedisError::from((
                    redis::ErrorKind::Client,
                    "a reply is missing",
                )))
            }),
        })
        .collect())
}

/// `NOSCRIPT`, alone or among a pipeline's errors.
pub(crate) fn is_noscript(err: &redis::RedisError) -> bool {
    err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
        || err
            .clone()
            .into_server_errors()
            .is_some_and(|errors| errors.iter().any(|(_, e)| e.code() == "NOSCRIPT"))
}
