//! The two owner-checked releases.
//!
//! Both answer the same way: released, or not held because the key is gone
//! (expired) or holds another owner's token. Neither ever deletes a key it
//! does not own.

use redis::{Connection, RedisResult, pipe};

use crate::error::NotHeldReason;
use crate::scripts;

/// How many times the WATCH release starts over when `EXEC` aborts while the
/// key still holds our token. An abort means someone wrote the key between
/// our `WATCH` and `EXEC` without changing its value (a foreign `PEXPIRE`,
/// say); more than a few in a row is pathological.
pub(crate) const MAX_WATCH_ATTEMPTS: u32 = 16;

/// `Ok(Ok(()))` released; `Ok(Err(reason))` not ours; `Err` Redis failed.
pub(crate) type Outcome = Result<(), NotHeldReason>;

/// `EVALSHA lua/release.lua`: one round trip (two after a `NOSCRIPT`).
pub(crate) fn release_lua(con: &mut Connection, key: &str, token: &str) -> RedisResult<Outcome> {
    let reply: i64 = scripts::RELEASE.key(key).arg(token).invoke(con)?;
    Ok(scripts::owner_checked(reply))
}

/// `WATCH`+`GET`, then `MULTI`/`DEL`/`EXEC`: two round trips.
///
/// Every path that does not end in `EXEC` (which clears the watch whether it
/// runs or aborts) sends `UNWATCH`, errors included, so the connection goes
/// back to the pool clean. An `UNWATCH` whose reply is lost has still been
/// written, and Redis runs it before anything the next user sends; one that
/// cannot be written marks the connection broken, and the pool drops it.
pub(crate) fn release_watch(con: &mut Connection, key: &str, token: &str) -> RedisResult<Outcome> {
    for _ in 0..MAX_WATCH_ATTEMPTS {
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
                unwatch(con);
                return Err(err);
            }
        };
        match current {
            Some(value) if value == token.as_bytes() => {
                let executed: RedisResult<Option<(i64,)>> =
                    pipe().atomic().cmd("DEL").arg(key).query(con);
                match executed {
                    Ok(Some(_)) => return Ok(Ok(())),
                    // EXEC aborted: the key was touched after WATCH. Look again.
                    Ok(None) => continue,
                    Err(err) => {
                        // EXEC normally clears the watch, but an error may
                        // mean it never ran; an extra UNWATCH is harmless.
                        unwatch(con);
                        return Err(err);
                    }
                }
            }
            None => {
                unwatch(con);
                return Ok(Err(NotHeldReason::Expired));
            }
            Some(_) => {
                unwatch(con);
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

fn unwatch(con: &mut Connection) {
    if let Err(err) = redis::cmd("UNWATCH").exec(con) {
        log::debug!("redmutex: UNWATCH failed (the connection will be dropped if broken): {err}");
    }
}
