//! `WAIT` for replicas after an acquisition, shared by every lock type that
//! offers `min_replicas` (all but RedLock).
//!
//! `WAIT` counts the writes of the connection it is sent on, so it must go
//! on the connection that wrote the key: on a cluster, to the key's primary
//! (redis-rs would ask every primary of a keyless command), and redis-rs's
//! own reconnect-and-resend must not have slipped another connection in
//! between (compared by `CLIENT ID`).

use std::time::Duration;

use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};

use crate::conn::backend::Connection;
use crate::conn::stats::Stats;

/// On Redis Cluster: the id of the connection to `key`'s primary (`CLIENT
/// ID`), to compare after the `WAIT`. `None` elsewhere (no extra round
/// trip) and when `wanted` is off.
pub(crate) fn node_connection_id(
    con: &mut Connection,
    key: &str,
    wanted: bool,
) -> redis::RedisResult<Option<i64>> {
    if !wanted {
        return Ok(None);
    }
    let route = Route::with_key(key, SlotAddr::Master);
    let id = con.on_cluster(|cluster| {
        cluster.route(
            redis::cmd("CLIENT").arg("ID"),
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
        )
    });
    match id {
        Some(value) => Ok(Some(redis::from_redis_value(value?)?)),
        None => Ok(None),
    }
}

/// `WAIT wanted timeout` on the connection that just wrote `key`; how many
/// replicas acknowledged. `connection` is what [`node_connection_id`] said
/// before the write: when it differs now, the count is of another
/// connection's writes (none) and 0 is returned.
pub(crate) fn acknowledged(
    con: &mut Connection,
    stats: &Stats,
    key: &str,
    (wanted, timeout): (u32, Duration),
    connection: Option<i64>,
) -> redis::RedisResult<u32> {
    stats.commands(1);
    let mut wait = redis::cmd("WAIT");
    // Checked below the I/O timeout before anything was sent.
    wait.arg(wanted)
        .arg(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
    // The server holds WAIT up to `timeout` before it answers: the read
    // must wait that long on top of the I/O timeout.
    let acked: u32 = con.patient(timeout, |con| {
        let routed = con.on_cluster(|cluster| {
            let route = Route::with_key(key, SlotAddr::Master);
            cluster.route(
                &wait,
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
            )
        });
        match routed {
            Some(reply) => Ok(redis::from_redis_value(reply?)?),
            None => wait.query(con),
        }
    })?;
    if connection.is_some() && node_connection_id(con, key, true)? != connection {
        // redis-rs reconnected to the node in between and sent the command
        // again itself: this WAIT counted another connection's writes.
        return Ok(0);
    }
    Ok(acked)
}

/// After a grant written on `con`, with `wanted` replicas asked for
/// (`None`: nothing to do): `WAIT` for them on this connection and, when
/// fewer acknowledged, `give_back` the grant on it too; how many did then.
/// After a lost reply (`resend`) the grant was written by an earlier
/// connection, so `renew` writes it again here first (owner-checked, never
/// re-creating it) and the `WAIT` counts a write of it. `connection` is
/// [`node_connection_id`]'s answer before the grant. The callers count
/// their own commands; this counts the `WAIT`.
pub(crate) fn await_or_give_back(
    con: &mut Connection,
    stats: &Stats,
    key: &str,
    wanted: Option<(u32, Duration)>,
    (resend, connection): (bool, Option<i64>),
    renew: impl FnOnce(&mut Connection) -> redis::RedisResult<()>,
    give_back: impl FnOnce(&mut Connection) -> redis::RedisResult<()>,
) -> redis::RedisResult<Option<u32>> {
    let Some(wanted) = wanted else {
        return Ok(None);
    };
    if resend {
        renew(con)?;
    }
    let acked = acknowledged(con, stats, key, wanted, connection)?;
    if acked >= wanted.0 {
        return Ok(None);
    }
    give_back(con)?;
    Ok(Some(acked))
}
