//! The hot path's commands written straight into RESP, in a buffer the
//! thread reuses: no `redis::Cmd` (two vectors), no packed copy of it, no
//! `String` per argument. redis-rs still sends the bytes and parses the
//! reply (`ConnectionLike::req_packed_command`); only the encoding is ours,
//! and it is the simplest part of the protocol: an array of bulk strings.
//!
//! On a cluster the same arguments become a `redis::Cmd`: the cluster
//! connection routes by the command it is given, and ours remembers the
//! slot of each for a `SCRIPT LOAD` after `NOSCRIPT` (see
//! `conn::backend`); a few allocations there are not worth a second routing
//! path.

use std::cell::Cell;
use std::io::Write as _;

use redis::{Cmd, ConnectionLike, FromRedisValue, RedisResult, Script};

use crate::conn::backend::Connection;

/// One argument of a command.
#[derive(Clone, Copy)]
pub(crate) enum Arg<'a> {
    /// Bytes as they are.
    Bytes(&'a [u8]),
    /// A decimal integer.
    Int(u64),
}

impl<'a> From<&'a str> for Arg<'a> {
    fn from(text: &'a str) -> Self {
        Arg::Bytes(text.as_bytes())
    }
}

impl From<u64> for Arg<'_> {
    fn from(n: u64) -> Self {
        Arg::Int(n)
    }
}

/// Up to `N` arguments with the absent ones (`None`) left out, in order: a
/// command's optional trailing arguments (a marker key, the sharded flag)
/// without index arithmetic at each caller. Derefs to the arguments.
pub(crate) struct Present<'a, const N: usize> {
    args: [Arg<'a>; N],
    len: usize,
}

/// [`Present`] of `args`.
pub(crate) fn present<const N: usize>(args: [Option<Arg<'_>>; N]) -> Present<'_, N> {
    let mut kept = Present {
        args: [Arg::Int(0); N],
        len: 0,
    };
    for arg in args.into_iter().flatten() {
        if let Some(slot) = kept.args.get_mut(kept.len) {
            *slot = arg;
            kept.len += 1;
        }
    }
    kept
}

impl<'a, const N: usize> std::ops::Deref for Present<'a, N> {
    type Target = [Arg<'a>];

    fn deref(&self) -> &[Arg<'a>] {
        self.args.get(..self.len).unwrap_or_default()
    }
}

/// A buffer kept past this size is given back: one huge key must not pin
/// its memory on the thread for good.
pub(crate) const KEPT: usize = 64 * 1024;

thread_local! {
    static BUFFER: Cell<Vec<u8>> = const { Cell::new(Vec::new()) };
}

/// Runs `f` with `args` encoded as one RESP command. The thread's buffer is
/// taken out while `f` runs, so a command `f` itself sends (never done
/// today) would only cost an allocation, not a conflict.
pub(crate) fn with_packed<T>(args: &[Arg<'_>], f: impl FnOnce(&[u8]) -> T) -> T {
    let mut buffer = BUFFER.try_with(Cell::take).unwrap_or_default();
    buffer.clear();
    pack(&mut buffer, args);
    let result = f(&buffer);
    if buffer.capacity() <= KEPT {
        // A thread being torn down has no buffer to keep: dropped then.
        let _ = BUFFER.try_with(|kept| kept.set(buffer));
    }
    result
}

/// `args` as a RESP array of bulk strings, appended to `out`. Writing to a
/// `Vec` cannot fail; the results are ignored on that ground.
fn pack(out: &mut Vec<u8>, args: &[Arg<'_>]) {
    let _ = write!(out, "*{}\r\n", args.len());
    for arg in args {
        match *arg {
            Arg::Bytes(bytes) => bulk(out, bytes),
            Arg::Int(n) => {
                let mut digits = [0u8; 20];
                let mut cursor = std::io::Cursor::new(&mut digits[..]);
                let _ = write!(cursor, "{n}");
                let len = usize::try_from(cursor.position()).unwrap_or(0);
                bulk(out, digits.get(..len).unwrap_or_default());
            }
        }
    }
}

fn bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    let _ = write!(out, "${}\r\n", bytes.len());
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

/// `args` as a `redis::Cmd`, for a cluster connection (see the module),
/// or a caller that keeps the command.
pub(crate) fn command(args: &[Arg<'_>]) -> Cmd {
    let mut cmd = Cmd::with_capacity(args.len(), 0);
    for arg in args {
        match *arg {
            Arg::Bytes(bytes) => cmd.arg(bytes),
            Arg::Int(n) => cmd.arg(n),
        };
    }
    cmd
}

/// Sends the command `args` on `con` and converts its reply.
///
/// # Errors
///
/// What redis-rs reports: the connection's errors, a server error, a reply
/// of another type than `T`.
pub(crate) fn query<T: FromRedisValue>(con: &mut Connection, args: &[Arg<'_>]) -> RedisResult<T> {
    let reply = if con.is_cluster() {
        con.req_command(&command(args))?
    } else {
        with_packed(args, |bytes| con.req_packed_command(bytes))?
    };
    // A server's error comes back as a value: made an `Err` as
    // `redis::Cmd::query` makes it.
    Ok(T::from_redis_value(reply.extract_error()?)?)
}

/// `EVALSHA` of `script` with `keys` and `args` (at most [`MAX_ARGS`] of
/// both together), and after a `NOSCRIPT` (the server's cache flushed or a
/// restart) `SCRIPT LOAD` and `EVALSHA` again, as `redis::Script::invoke`
/// does (a few times, not once): a script sent this way must be safe to run
/// twice, as every script of this crate is (each says so in its header);
/// here it ran not at all the first time.
///
/// # Errors
///
/// As [`query`]; a script with more arguments than [`MAX_ARGS`] is refused
/// before anything is sent (a bug of this crate, never a caller's input).
pub(crate) fn evalsha<T: FromRedisValue>(
    con: &mut Connection,
    script: &Script,
    keys: &[Arg<'_>],
    args: &[Arg<'_>],
) -> RedisResult<T> {
    let mut all = [Arg::Int(0); MAX_ARGS + 3];
    let count = u64::try_from(keys.len()).unwrap_or(u64::MAX);
    let used = 3 + keys.len() + args.len();
    let Some(slots) = all.get_mut(..used) else {
        return Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "a script with too many arguments",
        )));
    };
    let (head, rest) = slots.split_at_mut(3);
    head.copy_from_slice(&[
        Arg::Bytes(b"EVALSHA"),
        Arg::Bytes(script.get_hash().as_bytes()),
        Arg::Int(count),
    ]);
    let (key_slots, arg_slots) = rest.split_at_mut(keys.len());
    key_slots.copy_from_slice(keys);
    arg_slots.copy_from_slice(args);
    let command = &*slots;
    // A `NOSCRIPT` ran nothing: load the script and send it again. Up to
    // ten times, for a script cache flushed again between the load and the
    // next send (a flush a moment after a restart, an operator's loop; the
    // write-behind test flushing every 40 ms met three in a row); the last
    // refusal is the caller's.
    let mut result = query(con, command);
    for _ in 0..10 {
        match result {
            Err(err)
                if err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                script.load(con)?;
                result = query(con, command);
            }
            done => return done,
        }
    }
    result
}

/// The most keys and arguments [`evalsha`] takes.
pub(crate) const MAX_ARGS: usize = 8;

#[cfg(test)]
mod tests {
    use super::*;

    fn packed(args: &[Arg<'_>]) -> Vec<u8> {
        with_packed(args, <[u8]>::to_vec)
    }

    #[test]
    fn packs_as_redis_rs_does() {
        let args = [
            Arg::from("SET"),
            Arg::from("k"),
            Arg::from("{k}:released:id"),
            Arg::Int(0),
            Arg::Int(u64::MAX),
            Arg::Bytes(b""),
        ];
        let mut cmd = redis::cmd("SET");
        cmd.arg("k")
            .arg("{k}:released:id")
            .arg(0u64)
            .arg(u64::MAX)
            .arg("");
        assert_eq!(packed(&args), cmd.get_packed_command());
        assert_eq!(
            command(&args).get_packed_command(),
            cmd.get_packed_command()
        );
    }

    /// What the thread's kept buffer shows, through `look`.
    fn kept<T>(look: impl FnOnce(&Vec<u8>) -> T) -> T {
        BUFFER.with(|cell| {
            let buffer = cell.take();
            let seen = look(&buffer);
            cell.set(buffer);
            seen
        })
    }

    #[test]
    fn the_buffer_is_reused_and_a_huge_one_given_back() {
        let _ = packed(&[Arg::from("PING")]);
        let before = kept(|buffer| buffer.as_ptr());
        let _ = packed(&[Arg::from("PING")]);
        assert_eq!(kept(|buffer| buffer.as_ptr()), before);
        let huge = vec![b'x'; KEPT + 1];
        let _ = packed(&[Arg::Bytes(&huge)]);
        assert_eq!(kept(Vec::capacity), 0);
    }

    #[test]
    fn absent_arguments_are_left_out_in_order() {
        let args = present([Some(Arg::from("a")), None, Some(Arg::Int(7)), None]);
        assert_eq!(packed(&args), packed(&[Arg::from("a"), Arg::Int(7)]));
        assert!(present::<2>([None, None]).is_empty());
    }
}
