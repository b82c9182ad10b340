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

use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, Slot, SlotAddr};

use crate::conn::backend::{ClusterOps, Connection, last_address, last_node, slot_of};
use crate::conn::stats::Stats;

pub(crate) mod names;
pub(crate) mod wire;

/// `lua/acquire.lua`: SET NX PX GET (the fence counter bumped first), or
/// the holder's PTTL. Returns `{1, 0, fence}` acquired or `{0, pttl, 0}`
/// held.
pub(crate) static ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/acquire.lua")));

/// `SET key token NX PX millis GET`: the quick acquisition (Redis 7.0 and
/// later; older servers refuse `NX` with `GET`, see `LockClient::refuse_set_get`).
/// Its reply is `nil` when it set the key, else the key's value: the token
/// itself after a resend whose first send set it.
pub(crate) fn set_nx_get<'a>(key: &'a str, token: &'a str, millis: u64) -> [wire::Arg<'a>; 7] {
    use wire::Arg;
    [
        Arg::from("SET"),
        Arg::from(key),
        Arg::from(token),
        Arg::from("NX"),
        Arg::from("PX"),
        Arg::Int(millis),
        Arg::from("GET"),
    ]
}

/// `lua/release.lua`: owner-checked delete, marker and PUBLISH. Returns
/// one integer: `n + 3` released (the message reached `n` subscribers), 1
/// released (message not sent), 2 released by an earlier run, 0 gone, -1
/// other owner (-2, -3: the same, marker unreadable).
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(RELEASE_SOURCE));

/// The source of `lua/release.lua`, for an `EVAL` where `EVALSHA` cannot
/// be retried (a release written behind that met `NOSCRIPT`).
pub(crate) const RELEASE_SOURCE: &str = include_str!("../../lua/release.lua");

/// Which owner-checked release a release without a marker sends: both
/// take the same arguments (the key; the token or permit id, the channel,
/// a marker life that no marker uses, the sharded flag).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unmarked {
    /// A plain lock's token: `lua/release.lua`, one integer in reply.
    Lock,
    /// A semaphore permit's id: `lua/sem_release.lua`, `{outcome, n}`.
    Permit,
}

/// `lua/release.lua` (or `lua/sem_release.lua`, see [`Unmarked`]) without
/// a marker, by hash (`EVAL` with the source when `eval`): the
/// owner-checked release of `token` from `key`, announced on `channel`,
/// for a caller who never sends it twice on its own (a drop writing it
/// behind, the cleanup of an orphan).
pub(crate) fn release_unmarked<'a>(
    what: Unmarked,
    key: &'a str,
    token: &'a str,
    channel: &'a str,
    sharded: bool,
    eval: bool,
) -> wire::Present<'a, 8> {
    use wire::Arg;
    let (call, script) = match (what, eval) {
        (Unmarked::Lock, true) => ("EVAL", RELEASE_SOURCE),
        (Unmarked::Lock, false) => ("EVALSHA", RELEASE.get_hash()),
        (Unmarked::Permit, true) => ("EVAL", SEM_RELEASE_SOURCE),
        (Unmarked::Permit, false) => ("EVALSHA", SEM_RELEASE.get_hash()),
    };
    wire::present([
        Some(Arg::from(call)),
        Some(Arg::from(script)),
        Some(Arg::Int(1)),
        Some(Arg::from(key)),
        Some(Arg::from(token)),
        Some(Arg::from(channel)),
        Some(Arg::Int(1)),
        sharded.then_some(Arg::from(SHARDED)),
    ])
}

/// The release scripts' last argument when the message goes out with
/// `SPUBLISH` (see [`LockClient::sharded`](crate::LockClient)).
pub(crate) const SHARDED: &str = "s";

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

/// `lua/rw_extend.lua`: renew one holder's field, owner-checked, never
/// earlier. Returns 1, 0 gone, -1 other writer.
pub(crate) static RW_EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/rw_extend.lua")));

/// `lua/rw_downgrade.lua`: turn this token's write hold into a read hold
/// in one step, owner-checked. Returns 1 (or already done), 0 gone, -1
/// other writer.
pub(crate) static RW_DOWNGRADE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/rw_downgrade.lua")));

/// `lua/sem_acquire.lua`: take a permit. Returns `{acquired, wait_ms,
/// fence}`; `LIMIT <n>` when live permits exist under another limit,
/// `FENCE ...` when the fencing counter cannot be incremented.
pub(crate) static SEM_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/sem_acquire.lua")));

/// `lua/sem_release.lua`: give this permit back. Returns `{1, receivers}`,
/// `{2, 0}` (an earlier run did), `{0, 0}` gone, `{-2, 0}` gone and the
/// marker unreadable.
pub(crate) static SEM_RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(SEM_RELEASE_SOURCE));

/// The source of `lua/sem_release.lua` (a permit's release written behind
/// that met `NOSCRIPT`).
pub(crate) const SEM_RELEASE_SOURCE: &str = include_str!("../../lua/sem_release.lua");

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

/// `lua/fair_acquire.lua`: the lock for the queue's head (or anyone, the
/// queue empty), else a place in the queue. Returns `{1, 0, 0, nil, fence}`
/// or `{0, pttl, position, holder, ticket}`.
pub(crate) static FAIR_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/fair_acquire.lua")));

/// `lua/fair_release.lua`: owner-checked release (or a waiter leaving the
/// queue) that wakes the queue's head alone. Returns as `lua/release.lua`
/// without the subscriber count.
pub(crate) static FAIR_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/fair_release.lua")));

/// `lua/multi_acquire.lua`: every key of one slot's part of a set, all or
/// none (fencing counters bumped first). Returns `{1, 0, 0, nil, fences}`
/// acquired or `{0, pttl, index, holder, {}}` held.
pub(crate) static MULTI_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/multi_acquire.lua")));

/// `lua/multi_release.lua`: owner-checked delete of every key of one slot's
/// part of a set, at once, with one marker. Returns `{code, index}`.
pub(crate) static MULTI_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/multi_release.lua")));

/// `lua/multi_extend.lua`: owner-checked `PEXPIRE` of every key of one
/// slot's part of a set, all or none. Answers as `lua/extend.lua`.
pub(crate) static MULTI_EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/multi_extend.lua")));

/// `lua/inspect.lua`: what one key holds, for listing. Returns `{kind,
/// ms, holders, limit}`, never a token.
pub(crate) static INSPECT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/inspect.lua")));

/// Reads the common reply of the owner-checked scripts.
pub(crate) fn owner_checked(reply: i64) -> Result<(), crate::error::LossReason> {
    match reply {
        1 => Ok(()),
        0 => Err(crate::error::LossReason::Expired),
        _ => Err(crate::error::LossReason::OwnedByOther),
    }
}

/// Sends `calls` (`EVALSHA`s of `scripts`) in one pipeline and returns
/// each call's own result: one refused call (a wrong type, an ACL) does not
/// fail the others. When the server lost a script (`NOSCRIPT` in any
/// reply), loads them all and sends the pipeline once more (every call
/// sent here is safe to run twice). A pipeline of `EVALSHA` does not
/// reload by itself as `Script::invoke` does. On a cluster, see
/// [`by_slot`].
pub(crate) fn pipelined(
    con: &mut Connection,
    calls: &[Cmd],
    scripts: &[&Script],
    stats: &Stats,
) -> RedisResult<Vec<RedisResult<Value>>> {
    if let Some(result) = con.on_cluster(|cluster| by_slot(cluster, calls, scripts, stats)) {
        return result;
    }
    let send = |con: &mut Connection| -> RedisResult<Vec<RedisResult<Value>>> {
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

/// [`pipelined`] on a cluster: one pipeline, which redis-rs sends to the
/// primary of its first call's slot. The calls whose slot that node does
/// not serve come back `MOVED` (a node checks a command's slot before it
/// runs it) and are sent again one by one, routed by redis-rs. A node that
/// lacks a script (`NOSCRIPT`) gets the scripts loaded on it alone, not on
/// every primary, and its calls are sent once more. Callers that group
/// their calls by node (the watchdog) pay one round trip. A node that does
/// not answer fails the whole call (the connection is then given up: a
/// reply may still come on it), and the calls not sent yet are not sent.
fn by_slot(
    cluster: &mut dyn ClusterOps,
    calls: &[Cmd],
    scripts: &[&Script],
    stats: &Stats,
) -> RedisResult<Vec<RedisResult<Value>>> {
    ROUTES.with(|routes| routes.borrow_mut().clear());
    let all: Vec<&Cmd> = calls.iter().collect();
    let sent = send_group(cluster, &all);
    // Where the pipeline went (its first call's node, for sure).
    let mut node = last_node().unwrap_or(0);
    let mut replies = match sent {
        Ok(replies) => replies,
        Err(err) => {
            note_routes(
                calls
                    .iter()
                    .enumerate()
                    .map(|(i, _)| if i == 0 { node } else { 0 }),
            );
            return Err(err);
        }
    };
    if replies
        .iter()
        .any(|reply| reply.as_ref().is_err_and(is_noscript))
    {
        let slot = calls.first().and_then(slot_of);
        if load_on(cluster, slot, scripts)? {
            stats.commands(scripts.len() as u64 + all.len() as u64);
            replies = send_group(cluster, &all)?;
            node = last_node().unwrap_or(0);
        }
    }
    let mut results = Vec::with_capacity(calls.len());
    let mut routes = Vec::with_capacity(calls.len());
    for (call, reply) in calls.iter().zip(replies) {
        let (reply, went) = match reply {
            // Not run where the pipeline went: sent alone, redis-rs
            // following the redirection or waiting out the cluster's
            // change within the call's deadline.
            Err(err) if err.code().is_some_and(|code| ALONE.contains(&code)) => {
                stats.commands(1);
                let mut reply = alone(cluster, call)?;
                if reply.as_ref().is_err_and(is_noscript)
                    && load_on(cluster, slot_of(call), scripts)?
                {
                    stats.commands(scripts.len() as u64 + 1);
                    reply = alone(cluster, call)?;
                }
                (reply, last_node().unwrap_or(0))
            }
            // On a cluster pool the caller built, the calls went one by
            // one to their own nodes: each loads on its own.
            Err(err) if is_noscript(&err) && !cluster.pipeline_capable() => {
                let reply = if load_on(cluster, slot_of(call), scripts)? {
                    stats.commands(scripts.len() as u64 + 1);
                    alone(cluster, call)?
                } else {
                    Err(err)
                };
                (reply, 0)
            }
            other => (other, node),
        };
        results.push(reply);
        routes.push(went);
    }
    note_routes(routes);
    Ok(results)
}

/// Refusals that say a call in a cluster pipeline did not run where the
/// pipeline went, or not yet: sent again alone. redis-rs follows or waits
/// these out for a call sent alone.
const ALONE: &[&str] = &[
    "MOVED",
    "ASK",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "READONLY",
    "LOADING",
    "MASTERDOWN",
];

std::thread_local! {
    /// The node each call of this thread's last [`by_slot`] went to (a
    /// node's number, 0 for not known).
    static ROUTES: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn note_routes(routes: impl IntoIterator<Item = u64>) {
    ROUTES.with(|kept| {
        let mut kept = kept.borrow_mut();
        kept.clear();
        kept.extend(routes);
    });
}

/// The nodes the calls of this thread's last pipelined call on a cluster
/// went to, in order (0: not known; empty: none, or not on a cluster of
/// this crate). After a failure, only the first call's node is known. What
/// the watchdog groups renewals by.
pub(crate) fn take_routes() -> Vec<u64> {
    ROUTES.with(|routes| std::mem::take(&mut *routes.borrow_mut()))
}

/// Loads `scripts` on the node that just said `NOSCRIPT` (the node the
/// thread's last request went to, after any redirection), or, on a
/// cluster pool the caller built, on the primary of `slot`; never on every
/// primary, one after another, as redis-rs would (however slow one is).
fn load_on(
    cluster: &mut dyn ClusterOps,
    slot: Option<Slot>,
    scripts: &[&Script],
) -> RedisResult<bool> {
    let node = match (last_address(), slot) {
        (Some(node), _) if cluster.pipeline_capable() => node,
        (_, Some(slot)) => RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
            Route::with_slot(slot, SlotAddr::Master),
        )),
        // Not a keyed call: where it went is not known.
        (_, None) => return Ok(false),
    };
    let mut on_node = OnNode {
        cluster: &mut *cluster,
        node,
    };
    for script in scripts {
        script.load(&mut on_node)?;
    }
    Ok(!scripts.is_empty())
}

/// Calls in one pipeline, routed by the first; each call's own result. `Err` when the
/// link failed.
fn send_group(
    cluster: &mut dyn ClusterOps,
    group: &[&Cmd],
) -> RedisResult<Vec<RedisResult<Value>>> {
    if let [call] = group {
        return Ok(vec![alone(cluster, call)?]);
    }
    let mut pipe = redis::pipe();
    for call in group {
        pipe.add_command((*call).clone());
    }
    let Some(values) = cluster.pipeline(&pipe.get_packed_pipeline(), group.len()) else {
        // A cluster connection of the caller's pool: one by one.
        return group.iter().map(|call| alone(cluster, call)).collect();
    };
    let values = values?;
    if values.len() != group.len() {
        return Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "a pipeline's replies are missing",
        )));
    }
    Ok(values.into_iter().map(Value::extract_error).collect())
}

/// One call, routed by its key: its own result, `Err` outside only when
/// the link failed (a server's refusal is the call's result).
fn alone(cluster: &mut dyn ClusterOps, call: &Cmd) -> RedisResult<RedisResult<Value>> {
    match cluster.req_command(call) {
        Ok(value) => Ok(value.extract_error()),
        Err(err) if err.code().is_some() => Ok(Err(err)),
        Err(err) => Err(err),
    }
}

/// A cluster connection that sends every command to one node: for
/// `Script::load`, which redis-rs would otherwise send to every primary.
struct OnNode<'a> {
    cluster: &'a mut dyn ClusterOps,
    node: RoutingInfo,
}

impl redis::ConnectionLike for OnNode<'_> {
    fn req_packed_command(&mut self, _: &[u8]) -> RedisResult<Value> {
        Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "only whole commands are routed to one node",
        )))
    }

    fn req_packed_commands(&mut self, _: &[u8], _: usize, _: usize) -> RedisResult<Vec<Value>> {
        Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "only whole commands are routed to one node",
        )))
    }

    fn req_command(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        self.cluster.route(cmd, self.node.clone())
    }

    fn get_db(&self) -> i64 {
        0
    }

    fn check_connection(&mut self) -> bool {
        self.cluster.check_connection()
    }

    fn is_open(&self) -> bool {
        self.cluster.is_open()
    }
}

/// `NOSCRIPT`, alone or among a pipeline's errors.
pub(crate) fn is_noscript(err: &redis::RedisError) -> bool {
    err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
        || err
            .clone()
            .into_server_errors()
            .is_some_and(|errors| errors.iter().any(|(_, e)| e.code() == "NOSCRIPT"))
}
