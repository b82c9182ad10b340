//! The two owner-checked releases.
//!
//! Both answer the same way: released, or not held because the key is gone
//! (expired) or holds another owner's token. Neither ever deletes a key it
//! does not own.

use redis::{ConnectionLike, RedisResult, pipe};

use crate::error::NotHeldReason;
use crate::scripts;
use crate::stats::Stats;

/// How many times the WATCH release starts over when `EXEC` aborts while the
/// key still holds our token. An abort means someone wrote the key between
/// our `WATCH` and `EXEC` without changing its value (a foreign `PEXPIRE`,
/// say); more than a few in a row is pathological.
pub(crate) const MAX_WATCH_ATTEMPTS: u32 = 16;

/// `Ok(Ok(n))` released, the release message reaching `n` subscribers;
/// `Ok(Err(reason))` not ours; `Err` Redis failed.
pub(crate) type Outcome = Result<u64, NotHeldReason>;

/// `EVALSHA lua/release.lua`: one round trip (two after a `NOSCRIPT`).
pub(crate) fn release_lua(
    con: &mut dyn ConnectionLike,
    stats: &Stats,
    key: &str,
    token: &str,
    channel: &str,
) -> RedisResult<Outcome> {
    stats.commands(1);
    let (reply, receivers): (i64, u64) = scripts::RELEASE
        .key(key)
        .arg(token)
        .arg(channel)
        .invoke(con)?;
    Ok(scripts::owner_checked(reply).map(|()| receivers))
}

/// `WATCH`+`GET`, then `MULTI`/`DEL`/`PUBLISH`/`EXEC`: two round trips.
///
/// Every path that does not end in `EXEC` (which clears the watch whether it
/// runs or aborts) sends `UNWATCH`, errors included, so the connection goes
/// back to the pool clean. An `UNWATCH` whose reply is lost has still been
/// written, and Redis runs it before anything the next user sends; one that
/// cannot be written marks the connection broken, and the pool drops it.
pub(crate) fn release_watch(
    con: &mut dyn ConnectionLike,
    stats: &Stats,
    key: &str,
    token: &str,
    channel: &str,
) -> RedisResult<Outcome> {
    for _ in 0..MAX_WATCH_ATTEMPTS {
        stats.commands(2);
        let watched: RedisResult<(Option<Vec<u8>>,)> = pipe()
            .cmd("WATCH")
            .arg(key)
            .ignore()
            .cmd("GET")
            .arg(key)
            .query(con);
        let current = match watched {
            Ok((current,)) => current,
            Err(err) => {
                unwatch(con, stats);
                return Err(err);
            }
        };
        match current {
            Some(value) if value == token.as_bytes() => {
                stats.commands(4);
                let executed: RedisResult<Option<(i64, u64)>> = pipe()
                    .atomic()
                    .cmd("DEL")
                    .arg(key)
                    .cmd("PUBLISH")
                    .arg(channel)
                    .arg("")
                    .query(con);
                match executed {
                    Ok(Some((_, receivers))) => return Ok(Ok(receivers)),
                    // EXEC aborted: the key was touched after WATCH. Look again.
                    Ok(None) => continue,
                    Err(err) => {
                        // EXEC normally clears the watch, but an error may
                        // mean it never ran; an extra UNWATCH is harmless.
                        unwatch(con, stats);
                        return Err(err);
                    }
                }
            }
            None => {
                unwatch(con, stats);
                return Ok(Err(NotHeldReason::Expired));
            }
            Some(_) => {
                unwatch(con, stats);
                return Ok(Err(NotHeldReason::OwnedByOther));
            }
        }
    }
    Err(redis::RedisError::from((
        redis::ErrorKind::Client,
        "WATCH release gave up: EXEC kept aborting while the key still held our token",
        format!("{MAX_WATCH_ATTEMPTS} attempts on {key:?}"),
    )))
}

fn unwatch(con: &mut dyn ConnectionLike, stats: &Stats) {
    stats.commands(1);
    if let Err(err) = redis::cmd("UNWATCH").exec(con) {
        log::debug!("redmutex: UNWATCH failed (the connection will be dropped if broken): {err}");
    }
}

/// Releases `key` in Redis if it holds `token`, and tells this client's own
/// queue (see [`Queues::released`](crate::queue::Queues::released)).
pub(crate) fn release(
    client: &crate::LockClient,
    key: &str,
    token: &str,
    how: crate::Release,
) -> Result<(), crate::Error> {
    let channel = crate::channel::release_channel(key);
    let stats = client.counters();
    let outcome = client.with_connection(key, |con| match how {
        crate::Release::Lua => release_lua(con, stats, key, token, &channel),
        crate::Release::Watch => release_watch(con, stats, key, token, &channel),
    });
    let receivers = match &outcome {
        Ok(Ok(receivers)) => *receivers,
        _ => 0,
    };
    client.queues().released(key, receivers);
    outcome?
        .map(|_| ())
        .map_err(|reason| crate::Error::not_held(key, reason))
}
