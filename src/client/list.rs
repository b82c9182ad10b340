//! Listing what is held: `SCAN` (never `KEYS`) under the client's prefix,
//! on every primary of a cluster, and `lua/inspect.lua` per key found, in
//! pipelines; bounded in time and in rounds, and never reading a token.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::Value;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};

use crate::client::LockClient;
use crate::client::holder::Holder;
use crate::conn::backend::Connection;
use crate::conn::policy::Op;
use crate::conn::stats::LockKind;
use crate::error::Error;
use crate::script;
use crate::script::names::is_auxiliary;

/// How many keys one `SCAN` step asks for, and one pipeline inspects.
const BATCH: u64 = 500;
/// The most `SCAN` steps per node, whatever the time budget: a cursor that
/// never comes back to 0 (keys added as fast as they are scanned) ends.
const MAX_STEPS: u32 = 100_000;

/// One lock or semaphore held now, as [`LockClient::list`] or a lock's
/// `status()` ([`DistributedLock::status`](crate::DistributedLock::status))
/// found it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HeldLock {
    /// The key as the client names it (without the client's key prefix).
    pub key: String,
    /// The lock type: [`LockKind::Mutex`] (a plain lock, or a RedLock's
    /// key on one of its nodes), [`LockKind::Reentrant`],
    /// [`LockKind::Read`] (readers hold it), [`LockKind::Write`] or
    /// [`LockKind::Semaphore`].
    pub kind: LockKind,
    /// Time until it frees unless renewed, by the server's clock: the key's
    /// ttl, or a read-write lock's or semaphore's earliest holder deadline.
    /// `None` for a key without expiry.
    pub remaining: Option<Duration>,
    /// How many hold it: 1 for a plain lock or a writer, the owner's holds
    /// of a reentrant lock, the readers, or the permits out.
    pub holders: u32,
    /// A semaphore's limit.
    pub limit: Option<u32>,
    /// Who holds it, oldest acquisition first: the holder metadata of each
    /// holder whose token carries it (at most 16; see [`Holder`]). Never
    /// a token's secret part.
    pub held_by: Vec<Holder>,
    /// Holders (among the 16 read) whose token carries metadata this crate
    /// does not write (a field out of range, control characters): counted,
    /// never shown. `holders` less `held_by` and these is the holders
    /// whose token carries no metadata at all.
    pub unreadable: u32,
    /// The server's time when the key was read, to set against
    /// [`Holder::acquired_at`] (both by the server's clock).
    pub seen_at: SystemTime,
}

/// What [`LockClient::list`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Listing {
    /// Every held lock and semaphore found, sorted by key.
    pub held: Vec<HeldLock>,
    /// Keys `SCAN` returned under the pattern (auxiliary keys included).
    pub scanned: u64,
    /// False when the time budget ran out before every key was scanned.
    pub complete: bool,
}

impl LockClient {
    /// Every lock and semaphore held now whose name (without the client's
    /// prefix) matches the glob `pattern` (`*` for all): kind, time left,
    /// holders and who they are ([`HeldLock::held_by`]), never a token. Walks the keyspace with `SCAN` (never
    /// `KEYS`), on every primary of a cluster, for at most `budget`; a
    /// listing cut short says so ([`Listing::complete`]). The ACL user
    /// needs `+scan` besides the lock commands.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty pattern; [`Error::Redis`]
    /// or [`Error::Pool`] when a node cannot be read within the budget's
    /// time (a node still unanswered when the budget runs out gives an
    /// incomplete listing instead: every step, connect included, is cut to
    /// what is left of the budget).
    pub fn list(&self, pattern: &str, budget: Duration) -> Result<Listing, Error> {
        self.list_with(pattern, budget, &mut |_| {})
    }

    /// [`LockClient::list`], telling `progress` how many keys were scanned
    /// after every `SCAN` step (for a progress line).
    ///
    /// # Errors
    ///
    /// As [`LockClient::list`].
    pub fn list_with(
        &self,
        pattern: &str,
        budget: Duration,
        progress: &mut dyn FnMut(u64),
    ) -> Result<Listing, Error> {
        if pattern.is_empty() {
            return Err(Error::InvalidArgument(
                "the list pattern must not be empty (`*` lists everything)".into(),
            ));
        }
        // `None`: a budget too long to count; the step bound still holds.
        let deadline = Instant::now().checked_add(budget);
        let left = || {
            deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            })
        };
        let prefix = self.key_prefix();
        let matching = format!("{}{pattern}", glob_escape(prefix));
        let mut listing = Listing {
            complete: true,
            ..Listing::default()
        };
        // Every step is a read within what is left of the budget, resent on
        // a fresh connection after a lost reply (a SCAN step with the same
        // cursor answers the same way, or with keys seen again, which are
        // counted once). A step the budget cut short ends the listing, as
        // incomplete; any other failure is the caller's error.
        let cut_short = |err: Error| if left().is_zero() { Ok(()) } else { Err(err) };
        let nodes = match self.run_within(Op::Read, &matching, left(), |con, _| primaries(con)) {
            Ok(nodes) => nodes,
            Err(err) => {
                cut_short(err)?;
                listing.complete = false;
                return Ok(listing);
            }
        };
        // `None`: the connection's own server (single node, Sentinel).
        let targets: Vec<Option<(String, u16)>> = match nodes {
            Some(nodes) => nodes.into_iter().map(Some).collect(),
            None => vec![None],
        };
        'nodes: for node in &targets {
            let mut cursor: u64 = 0;
            for _ in 0..MAX_STEPS {
                if left().is_zero() {
                    listing.complete = false;
                    break 'nodes;
                }
                let step = self.run_within(Op::Read, &matching, left(), |con, _| {
                    scan(con, node.as_ref(), cursor, &matching)
                });
                let (next, mut keys) = match step {
                    Ok(step) => step,
                    Err(err) => {
                        cut_short(err)?;
                        listing.complete = false;
                        break 'nodes;
                    }
                };
                listing.scanned = listing.scanned.saturating_add(keys.len() as u64);
                keys.retain(|key| !is_auxiliary(key.strip_prefix(prefix).unwrap_or(key)));
                if let Err(err) = self.inspect(&keys, prefix, &mut listing.held, left()) {
                    cut_short(err)?;
                    listing.complete = false;
                    break 'nodes;
                }
                progress(listing.scanned);
                cursor = next;
                if cursor == 0 {
                    continue 'nodes;
                }
            }
            listing.complete = false;
        }
        listing.held.sort_by(|a, b| a.key.cmp(&b.key));
        // A key seen twice (SCAN may return one more than once) counts once.
        listing.held.dedup_by(|a, b| a.key == b.key);
        Ok(listing)
    }

    /// Inspects `keys` in one pipeline (split by node on a cluster).
    fn inspect(
        &self,
        keys: &[String],
        prefix: &str,
        held: &mut Vec<HeldLock>,
        budget: Duration,
    ) -> Result<(), Error> {
        if keys.is_empty() {
            return Ok(());
        }
        let calls: Vec<redis::Cmd> = keys
            .iter()
            .map(|key| {
                let mut cmd = redis::cmd("EVALSHA");
                cmd.arg(script::INSPECT.get_hash()).arg(1).arg(key);
                cmd
            })
            .collect();
        self.counters().commands(calls.len() as u64);
        let replies = self.run_within(Op::Read, &keys[0], budget, |con, _| {
            script::pipelined(con, &calls, &[&script::INSPECT], self.counters())
        });
        for (key, reply) in keys.iter().zip(replies?) {
            // A key that changed type or vanished meanwhile: skipped.
            if let Ok(value) = reply
                && let Some(Inspected::Held(lock)) = inspected(key, prefix, value)
            {
                held.push(lock);
            }
        }
        Ok(())
    }

    /// What `key` (a key in Redis, the prefix included) holds now, by
    /// `lua/inspect.lua`: one read, in one step. `None` when nothing holds
    /// it.
    ///
    /// # Errors
    ///
    /// [`Error::WrongType`] when the key holds data that is no lock of this
    /// crate; [`Error::Redis`] or [`Error::Pool`].
    pub(crate) fn status_of(&self, key: &str) -> Result<Option<HeldLock>, Error> {
        self.check_key(key)?;
        self.counters().commands(1);
        // A read: a lost reply is sent again on a fresh connection.
        let value: Value =
            self.run(Op::Read, key, |con, _| script::INSPECT.key(key).invoke(con))?;
        match inspected(key, self.key_prefix(), value) {
            Some(Inspected::Held(lock)) => Ok(Some(lock)),
            Some(Inspected::Free) => Ok(None),
            Some(Inspected::Other) => Err(Error::WrongType {
                key: key.to_owned(),
            }),
            None => Err(Error::Redis(redis::RedisError::from((
                redis::ErrorKind::Parse,
                "the status script answered in an unexpected shape",
            )))),
        }
    }
}

/// What `lua/inspect.lua` found under one key.
enum Inspected {
    Held(HeldLock),
    /// Nothing holds the key.
    Free,
    /// Data that is no lock of this crate.
    Other,
}

/// Reads `lua/inspect.lua`'s reply for `key`; `None` for a reply of
/// another shape.
fn inspected(key: &str, prefix: &str, value: Value) -> Option<Inspected> {
    let fields = redis::from_redis_value::<Vec<Value>>(value).ok()?;
    let mut fields = fields.into_iter();
    let (kind, ms, holders, limit) = (
        fields.next()?,
        fields.next()?,
        fields.next()?,
        fields.next()?,
    );
    let (Ok(kind), Ok(ms), Ok(holders), Ok(limit)) = (
        redis::from_redis_value::<String>(kind),
        redis::from_redis_value::<i64>(ms),
        redis::from_redis_value::<i64>(holders),
        redis::from_redis_value::<i64>(limit),
    ) else {
        return None;
    };
    let kind = match kind.as_str() {
        "lock" => LockKind::Mutex,
        "reentrant" => LockKind::Reentrant,
        "read" => LockKind::Read,
        "write" => LockKind::Write,
        "semaphore" => LockKind::Semaphore,
        "" => return Some(Inspected::Free),
        _ => return Some(Inspected::Other),
    };
    let now = fields
        .next()
        .and_then(|v| redis::from_redis_value::<u64>(v).ok())
        .unwrap_or_default();
    let mut held_by: Vec<Holder> = Vec::new();
    let mut unreadable = 0u32;
    for meta in fields.filter_map(|v| redis::from_redis_value::<String>(v).ok()) {
        match Holder::from_meta(&meta) {
            Some(holder) => held_by.push(holder),
            None => unreadable = unreadable.saturating_add(1),
        }
    }
    held_by.sort_by_key(|h| h.acquired_at);
    Some(Inspected::Held(HeldLock {
        key: key.strip_prefix(prefix).unwrap_or(key).to_owned(),
        kind,
        remaining: u64::try_from(ms).ok().map(Duration::from_millis),
        holders: u32::try_from(holders).unwrap_or(u32::MAX),
        limit: (kind == LockKind::Semaphore).then(|| u32::try_from(limit).unwrap_or(0)),
        held_by,
        unreadable,
        seen_at: UNIX_EPOCH
            .checked_add(Duration::from_millis(now))
            .unwrap_or(UNIX_EPOCH),
    }))
}

/// One `SCAN` step on `node` (or the connection's own server).
fn scan(
    con: &mut Connection,
    node: Option<&(String, u16)>,
    cursor: u64,
    matching: &str,
) -> redis::RedisResult<(u64, Vec<String>)> {
    let mut cmd = redis::cmd("SCAN");
    cmd.arg(cursor)
        .arg("MATCH")
        .arg(matching)
        .arg("COUNT")
        .arg(BATCH);
    let reply: Value = match node {
        Some((host, port)) => {
            let routed = con.on_cluster(|cluster| {
                cluster.route(
                    &cmd,
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                        host: host.clone(),
                        port: *port,
                    }),
                )
            });
            match routed {
                Some(reply) => reply?,
                None => cmd.query(con)?,
            }
        }
        None => cmd.query(con)?,
    };
    let (next, keys): (String, Vec<String>) = redis::from_redis_value(reply)?;
    let next = next.parse::<u64>().map_err(|_| {
        redis::RedisError::from((
            redis::ErrorKind::Parse,
            "SCAN returned a cursor that is not a number",
        ))
    })?;
    Ok((next, keys))
}

/// The primaries of a cluster (`CLUSTER SLOTS`), or `None` elsewhere.
fn primaries(con: &mut Connection) -> redis::RedisResult<Option<Vec<(String, u16)>>> {
    let slots = con.on_cluster(|cluster| {
        cluster.route(
            redis::cmd("CLUSTER").arg("SLOTS"),
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
        )
    });
    let Some(slots) = slots else {
        return Ok(None);
    };
    // [[start, end, [host, port, id, ...], replicas...], ...]
    let ranges: Vec<Vec<Value>> = redis::from_redis_value(slots?)?;
    let mut nodes: Vec<(String, u16)> = Vec::new();
    for range in ranges {
        let Some(primary) = range.into_iter().nth(2) else {
            continue;
        };
        let Ok(fields) = redis::from_redis_value::<Vec<Value>>(primary) else {
            continue;
        };
        let mut fields = fields.into_iter();
        let (Some(host), Some(port)) = (fields.next(), fields.next()) else {
            continue;
        };
        let (Ok(host), Ok(port)) = (
            redis::from_redis_value::<String>(host),
            redis::from_redis_value::<u16>(port),
        ) else {
            continue;
        };
        if !nodes.contains(&(host.clone(), port)) {
            nodes.push((host, port));
        }
    }
    Ok(Some(nodes))
}

/// `text` matched literally by a `SCAN MATCH` glob.
fn glob_escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_is_matched_literally() {
        assert_eq!(glob_escape("team*A:"), "team\\*A:");
        assert_eq!(glob_escape("a[1]?\\"), "a\\[1\\]\\?\\\\");
        assert_eq!(glob_escape("plain:"), "plain:");
    }
}
