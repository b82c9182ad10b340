//! The two owner-checked releases.
//!
//! Both answer the same way: released, or not held because the key is gone
//! (expired) or holds another owner's token. Neither ever deletes a key it
//! does not own. Both leave a marker when they delete, so a release sent
//! again after its reply was lost still answers "released" (see
//! `policy.rs`).

use std::cell::Cell;
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use redis::{ConnectionLike, RedisError, RedisResult, Value, pipe};

use crate::conn::backend::Connection;
use crate::conn::ledger::{Owed, Rewrite};
use crate::conn::policy::{Op, Replied, marker_ttl};
use crate::conn::stats::{Stats, Tag};
use crate::error::{Error, LossReason};
use crate::renew::watchdog::{Cleanups, Deferred, Pending};
use crate::script;
use crate::wait::backoff::{Jitter, ThreadJitter};

/// How many times the WATCH release starts over when `EXEC` aborts while the
/// key still holds our token. An abort means someone wrote the key between
/// our `WATCH` and `EXEC` without changing its value (a foreign `PEXPIRE`,
/// say); more than a few in a row is pathological.
pub(crate) const MAX_WATCH_ATTEMPTS: u32 = 16;

/// A release that took place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Released {
    /// This request deleted the key; the message reached that many
    /// subscribers (`None`: it could not be sent).
    Now(Option<u64>),
    /// An earlier send of this same request deleted it; its reply was lost.
    Earlier,
}

impl Released {
    /// Subscribers the release message reached, when it is known that it
    /// was sent.
    pub(crate) fn receivers(self) -> Option<u64> {
        match self {
            Released::Now(receivers) => receivers,
            Released::Earlier => None,
        }
    }
}

/// `Ok(Ok(_))` released; `Ok(Err(reason))` not ours; `Err` Redis failed.
pub(crate) type Outcome = Result<Released, LossReason>;

/// Where and how long a release leaves its marker.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Marker<'a> {
    pub(crate) key: Option<&'a str>,
    pub(crate) millis: u64,
}

/// Where a release is announced: the key's release channel, and whether
/// with `SPUBLISH` ([`LockClient::sharded`](crate::LockClient)).
#[derive(Clone, Copy)]
pub(crate) struct Announce<'a> {
    pub(crate) channel: &'a str,
    pub(crate) sharded: bool,
}

/// `EVALSHA lua/release.lua`: one round trip (two after a `NOSCRIPT`).
/// Sets `markerless` when the script could not read the marker (an ACL
/// refuses it).
pub(crate) fn release_lua(
    con: &mut Connection,
    stats: &Stats,
    key: &str,
    token: &str,
    announce: Announce<'_>,
    marker: Marker<'_>,
    markerless: &Cell<bool>,
) -> RedisResult<Outcome> {
    use script::wire::{Arg, present};
    stats.commands(1);
    let reply: i64 = script::wire::evalsha(
        con,
        &script::RELEASE,
        &present([Some(Arg::from(key)), marker.key.map(Arg::from)]),
        &present([
            Some(Arg::from(token)),
            Some(Arg::from(announce.channel)),
            Some(Arg::Int(marker.millis)),
            announce.sharded.then_some(Arg::from(script::SHARDED)),
        ]),
    )?;
    Ok(released(reply, markerless))
}

/// What `lua/release.lua`'s integer reply says (see its header).
pub(crate) fn released(reply: i64, markerless: &Cell<bool>) -> Outcome {
    match reply {
        1 => Ok(Released::Now(None)),
        2 => Ok(Released::Earlier),
        n if n >= 3 => Ok(Released::Now(u64::try_from(n - 3).ok())),
        other => Err(not_held(other, markerless)),
    }
}

/// The reason of a "not released" answer of the release scripts: 0 (or
/// -2) gone, -1 (or -3) another owner's; -2 and -3 also say the marker
/// could not be read, which `markerless` records.
pub(crate) fn not_held(reply: i64, markerless: &Cell<bool>) -> LossReason {
    if reply <= -2 {
        markerless.set(true);
    }
    match reply {
        0 | -2 => LossReason::Expired,
        _ => LossReason::OwnedByOther,
    }
}

/// `WATCH`+`GET`, then `MULTI`/`DEL`/`PUBLISH`/marker/`EXEC`: two round
/// trips.
///
/// Every path that does not end in `EXEC` (which clears the watch whether it
/// runs or aborts) sends `UNWATCH`, errors included, so the connection goes
/// back to the pool clean. An `UNWATCH` whose reply is lost has still been
/// written, and Redis runs it before anything the next user sends; one that
/// cannot be written marks the connection broken, and the pool drops it.
///
/// A user whose ACL refuses the channel or the marker key gets `EXECABORT`
/// for the whole transaction; the release then starts over with the `DEL`
/// alone, and `markerless` is set: a resend of it cannot count on a
/// marker.
pub(crate) fn release_watch(
    con: &mut dyn ConnectionLike,
    stats: &Stats,
    key: &str,
    token: &str,
    announce: Announce<'_>,
    marker: Marker<'_>,
    markerless: &Cell<bool>,
) -> RedisResult<Outcome> {
    let Announce { channel, sharded } = announce;
    // Both transactions are built before WATCH goes out: nothing but a
    // round trip lies between WATCH and EXEC.
    let transaction = |bare: bool| {
        let mut exec = pipe();
        exec.atomic().cmd("DEL").arg(key);
        if !bare {
            exec.cmd(if sharded { "SPUBLISH" } else { "PUBLISH" })
                .arg(channel)
                .arg("");
            if let Some(marker_key) = marker.key {
                exec.cmd("PSETEX")
                    .arg(marker_key)
                    .arg(marker.millis)
                    .arg("1")
                    .ignore();
            }
        }
        exec
    };
    let (full, plain) = (transaction(false), transaction(true));
    let mut watch = pipe();
    watch.cmd("WATCH").arg(key).ignore().cmd("GET").arg(key);
    watch.cmd("EXISTS").arg(marker.key.unwrap_or(key));
    let mut bare = false;
    let mut aborts = 0u32;
    for _ in 0..MAX_WATCH_ATTEMPTS {
        stats.commands(3);
        let watched: RedisResult<(Option<Vec<u8>>, bool)> = watch.query(con);
        let (current, marked) = match watched {
            Ok((current, marked)) => (current, marked && marker.key.is_some()),
            Err(err) => {
                unwatch(con, stats);
                return Err(err);
            }
        };
        match current {
            Some(value) if value == token.as_bytes() => {
                let exec = if bare { &plain } else { &full };
                stats.commands(3 + u64::from(!bare) * 2);
                let executed: RedisResult<Option<Vec<Value>>> = exec.query(con);
                match executed {
                    Ok(Some(replies)) => {
                        let receivers = match replies.get(1) {
                            Some(Value::Int(n)) => u64::try_from(*n).ok(),
                            _ => None,
                        };
                        return Ok(Ok(Released::Now(receivers)));
                    }
                    // EXEC aborted: the key was touched after WATCH. Look
                    // again after a short jittered pause (growing with the
                    // aborts), so a writer touching the key at a steady pace
                    // cannot keep hitting the same window.
                    Ok(None) => {
                        aborts = aborts.saturating_add(1);
                        let ceiling = Duration::from_micros(50).saturating_mul(aborts);
                        std::thread::sleep(ThreadJitter.below(ceiling));
                        continue;
                    }
                    Err(err) if !bare && err.code() == Some("EXECABORT") => {
                        // EXEC ran (and cleared the watch) but refused the
                        // queued PUBLISH or marker: an ACL. Again, bare.
                        bare = true;
                        markerless.set(true);
                        continue;
                    }
                    Err(err) => {
                        // EXEC normally clears the watch, but an error may
                        // mean it never ran; an extra UNWATCH is harmless.
                        unwatch(con, stats);
                        return Err(err);
                    }
                }
            }
            _ if marked => {
                unwatch(con, stats);
                return Ok(Ok(Released::Earlier));
            }
            None => {
                unwatch(con, stats);
                return Ok(Err(LossReason::Expired));
            }
            Some(_) => {
                unwatch(con, stats);
                return Ok(Err(LossReason::OwnedByOther));
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

/// The marker of a release of `key` by `id`, and how long it lives on
/// `client`'s deployment. Outside a cluster every key has one; on a
/// cluster only keys whose marker can share their slot (the others are
/// refused before anything is sent).
///
/// Named by the id's secret alone (a token's holder metadata follows a
/// `|`): as unique, and shorter to format, to send and to keep in Redis.
pub(crate) fn marker_of(
    client: &crate::client::LockClient,
    key: &str,
    id: &str,
) -> (MarkerName, u64) {
    let mut name = MARKER.try_with(Cell::take).unwrap_or_default();
    let written = write_marker(client, &mut name, key, id);
    (MarkerName { name, written }, marker_millis(client))
}

thread_local! {
    /// The buffer [`MarkerName`]s are written into: taken out while one is
    /// in use (a release inside another, a drop during a release, only
    /// allocates), given back when it goes.
    static MARKER: Cell<String> = const { Cell::new(String::new()) };
}

/// A release's marker name ([`marker_of`]), in a buffer the thread keeps:
/// a release costs no allocation for it.
pub(crate) struct MarkerName {
    name: String,
    written: bool,
}

impl MarkerName {
    /// The name; `None` when the release has no marker.
    pub(crate) fn as_deref(&self) -> Option<&str> {
        self.written.then_some(self.name.as_str())
    }

    pub(crate) fn is_none(&self) -> bool {
        !self.written
    }
}

impl Drop for MarkerName {
    fn drop(&mut self) {
        // A name grown past the usual (a key of kilobytes) is not kept.
        if self.name.capacity() <= script::wire::KEPT {
            let name = std::mem::take(&mut self.name);
            let _ = MARKER.try_with(|kept| kept.set(name));
        }
    }
}

/// How long a release's marker lives on `client` ([`marker_ttl`]).
pub(crate) fn marker_millis(client: &crate::client::LockClient) -> u64 {
    u64::try_from(marker_ttl(client.timeout()).as_millis()).unwrap_or(u64::MAX)
}

/// [`marker_of`]'s name written into `out` (its allocation kept by the
/// caller); false when there is none.
pub(crate) fn write_marker(
    client: &crate::client::LockClient,
    out: &mut String,
    key: &str,
    id: &str,
) -> bool {
    let id = id.split_once('|').map_or(id, |(secret, _)| secret);
    if !client.markers_allowed() {
        out.clear();
        return false;
    }
    let anywhere = client.deployment() != crate::conn::backend::Deployment::Cluster;
    client.names().write_marker(out, key, id, anywhere)
}

/// Runs a release script with its marker, and, when the server refuses the
/// marker key (`NOPERM`: Redis checks a script's keys before running it, so
/// nothing ran), once more without it; the client then stops asking for
/// markers.
pub(crate) fn with_marker<T>(
    client: &crate::client::LockClient,
    marker: Option<&str>,
    markerless: &Cell<bool>,
    mut invoke: impl FnMut(Option<&str>) -> RedisResult<T>,
) -> RedisResult<T> {
    match invoke(marker) {
        Err(err) if marker.is_some() && crate::error::refused_by_acl(&err) => {
            markerless.set(true);
            let retried = invoke(None);
            // The marker was what the ACL refused only when the same call
            // without it is not refused (a user barred from the key
            // itself keeps its markers for the keys it may use).
            if !retried.as_ref().is_err_and(crate::error::refused_by_acl) {
                client.refuse_markers();
            }
            retried
        }
        other => other,
    }
}

/// A "not held" answer to a resend whose earlier send may have released
/// the key without a marker to say so (no marker was written, or the
/// resend's reply came later than a marker lives, counted from the first
/// send) is not the truth: it is unknown.
pub(crate) fn check_resend<T>(
    key: &str,
    answer: Result<T, LossReason>,
    replied: Replied,
    has_marker: bool,
    marker_millis: u64,
) -> Result<Result<T, LossReason>, Error> {
    let late = !has_marker
        || u64::try_from(replied.after.as_millis()).unwrap_or(u64::MAX) >= marker_millis;
    match answer {
        Err(_) if replied.resend && late => Err(Error::OutcomeUnknown {
            key: key.to_owned(),
            operation: Op::Release.name(),
            source: redis::RedisError::from((
                redis::ErrorKind::Io,
                "an earlier send's reply was lost, and no marker can tell whether it released",
            )),
        }),
        answer => Ok(answer),
    }
}

/// Releases `key` in Redis if it holds `token`. `Ok` with how many
/// subscribers the release message reached (`None`: not known, or an
/// earlier send released it).
pub(crate) fn release(
    client: &crate::client::LockClient,
    key: &str,
    token: &str,
    how: crate::client::options::Release,
) -> Result<Option<u64>, Error> {
    release_on(
        client,
        key,
        &client.names().release_channel(key),
        token,
        how,
    )
}

/// [`release`] with the key's release `channel` named by the caller (a lock
/// handle keeps it).
pub(crate) fn release_on(
    client: &crate::client::LockClient,
    key: &str,
    channel: &str,
    token: &str,
    how: crate::client::options::Release,
) -> Result<Option<u64>, Error> {
    let released = release_as(client, key, channel, token, how);
    if how == crate::client::options::Release::Lua
        && matches!(&released, Ok(_) | Err(Error::NotHeld { .. }))
        && !client.behind_ok()
    {
        client.scripts_work(true);
    }
    // A server without scripts (SCRIPT or EVALSHA renamed away) still let
    // the plain `SET NX` take the lock: release it with WATCH/MULTI rather
    // than leave it for its ttl. Nothing ran (the command was refused), so
    // the second way is not a second release.
    match released {
        Err(Error::Unsupported { ref command, .. })
            if how == crate::client::options::Release::Lua
                && matches!(command.to_ascii_uppercase().as_str(), "SCRIPT" | "EVALSHA")
                && client
                    .check_release(crate::client::options::Release::Watch)
                    .is_ok() =>
        {
            release_as(
                client,
                key,
                channel,
                token,
                crate::client::options::Release::Watch,
            )
        }
        other => other,
    }
}

/// Whether a lease (or permit) may be passed to a waiting thread of the
/// client, as its giver found out.
pub(crate) enum Pass {
    /// Yes: Redis confirmed it within the handoff budget's `max_age`.
    Yes,
    /// No: the budget, nobody waiting, or Redis said it is gone (then the
    /// loss is recorded).
    No,
    /// Its confirmation could not be answered: nothing is known of it, and
    /// it goes to the client's cleanup rather than to another round trip.
    Unknown(Error),
}

/// Writes the owner-checked release of `key` behind (see
/// [`Connection::write_behind`](crate::conn::backend::Connection::write_behind)):
/// `lua/release.lua` (a permit's: `lua/sem_release.lua`) is sent, without
/// a marker, and this returns at once;
/// the reply is read by the next user of the connection, in the same round
/// trip as its own request, and handed to an [`OwedRelease`]. `true` when
/// the release was written; `false` when it must not or cannot be (the
/// key's last release by this client reached a subscriber, whose turn a
/// thread taking the key again right behind this release would skip; not
/// a plain connection of this crate's pool, scripts not known to work on
/// this client, no connection, or the write failed), and the caller
/// releases synchronously instead.
///
/// No marker: a marker tells a resend of this same request whether an
/// earlier send ran, and nobody awaits this one's answer. The owner-checked
/// releases that may follow it (the `EVAL` after `NOSCRIPT`, the cleanup
/// after a lost or missing reply) are safe to run after it: they find the
/// key gone or another owner's and change nothing.
pub(crate) fn release_behind(
    client: &crate::client::LockClient,
    release: Behind,
    tag: Tag,
    counted_lost: bool,
) -> bool {
    if release.waited.is_waited(&release.key) || !client.behind_ok() || !client.can_write_behind() {
        return false;
    }
    let Ok(mut con) = client.pooled() else {
        return false;
    };
    if !con.can_write_behind() {
        return false;
    }
    let cleanups = client.watchdog().cleanups();
    let window = marker_ttl(client.timeout());
    // One allocation: the connection owes its reply to it, and the
    // deferred check below watches the same one.
    let owed = Arc::new(OwedRelease {
        pending: Pending::new(release.key, release.token, release.channel, release.what),
        waited: release.waited,
        tag,
        counted_lost,
        stats: client.counters_handle(),
        cleanups: cleanups.clone(),
        cleanup_window: window,
        scripts_work: client.behind_flag(),
        rewritten: AtomicBool::new(false),
    });
    let pending = &owed.pending;
    // Never on a cluster (no writing behind there): `PUBLISH`. Encoded in
    // the thread's buffer.
    let request = script::release_unmarked(
        pending.what,
        &pending.key,
        &pending.token,
        &pending.channel,
        false,
        false,
    );
    let owes: Arc<dyn Owed> = owed.clone();
    if script::wire::with_packed(&request, |request| con.write_behind(request, owes)).is_err() {
        return false;
    }
    client.counters().commands(1);
    // Should the reply never be read (the connection left idle in the pool),
    // the cleanup releases the token itself once a resend window has
    // passed.
    if !cleanups.defer(owed, window) {
        log::debug!(
            "redmutex: the client is shutting down; a release written behind is not checked"
        );
    }
    true
}

/// What a release written behind names: shared with the lease (or the
/// permit), so writing it behind copies no string.
pub(crate) struct Behind {
    pub(crate) key: Arc<str>,
    /// The lock's token, or the permit's id.
    pub(crate) token: Arc<str>,
    pub(crate) channel: Arc<str>,
    /// A plain lock's release or a semaphore permit's.
    pub(crate) what: script::Unmarked,
    /// The client's [`Waited`] keys, told what the release reached.
    pub(crate) waited: Arc<Waited>,
}

/// The keys of one client whose last release by it reached a subscriber:
/// waiters of other clients, whose turn a thread taking the key again right
/// behind its release (as a release written behind lets it) would always
/// skip. A drop of such a key releases synchronously, until a release
/// reaches nobody again. Kept per client and key, not per lock handle, so
/// handles made per call learn from each other.
#[derive(Debug, Default)]
pub(crate) struct Waited(parking_lot::Mutex<HashSet<Arc<str>>>);

/// Past this many keys the set starts over: a pattern subscriber (a
/// monitor on `redmutex:released:*`) would otherwise add every key locked.
/// A key forgotten that way is found again by its next release.
const WAITED_MAX: usize = 4096;

impl Waited {
    pub(crate) fn is_waited(&self, key: &str) -> bool {
        let keys = self.0.lock();
        !keys.is_empty() && keys.contains(key)
    }

    /// `None` (not known: the channel refused by an ACL, say) changes
    /// nothing, so such a client is not kept from writing behind for good.
    pub(crate) fn reached(&self, key: &Arc<str>, receivers: Option<u64>) {
        match receivers {
            Some(0) => {
                let mut keys = self.0.lock();
                if !keys.is_empty() {
                    keys.remove(&**key);
                }
            }
            Some(_) => {
                let mut keys = self.0.lock();
                if keys.len() >= WAITED_MAX {
                    keys.clear();
                }
                keys.insert(key.clone());
            }
            None => {}
        }
    }
}

/// The reply a connection owes to a release written behind, and what to do
/// with it: nothing when it released; a log line and the loss counted when
/// the lease was already gone; the release sent again by `EVAL` after
/// `NOSCRIPT`; the token handed to the cleanup when the reply is lost or
/// the server refused (a demoted primary answering `READONLY`, say).
pub(crate) struct OwedRelease {
    /// Key, token and channel, and whether the reply was read: what the
    /// deferred check, which shares this, looks at.
    pending: Pending,
    waited: Arc<Waited>,
    tag: Tag,
    /// The lease was already counted as lost when it was dropped.
    counted_lost: bool,
    stats: Arc<Stats>,
    cleanups: Cleanups,
    cleanup_window: Duration,
    scripts_work: Arc<AtomicBool>,
    /// Already sent again as an `EVAL`, which cannot meet `NOSCRIPT`.
    rewritten: AtomicBool,
}

impl Deferred for OwedRelease {
    fn pending(&self) -> &Pending {
        &self.pending
    }
}

impl OwedRelease {
    fn clean_up(&self) {
        if !self
            .cleanups
            .clean_up(self.pending.orphan(self.cleanup_window))
        {
            log::debug!(
                "redmutex: the client is gone; {:?} expires after its ttl",
                self.pending.key
            );
        }
    }

    fn failed(&self, err: &Error) {
        if err.is_not_held() && self.counted_lost {
            return;
        }
        self.stats.hold_ended(self.tag, None, false, Err(err));
    }
}

impl Owed for OwedRelease {
    fn replied(self: Arc<Self>, reply: Value) -> Option<Rewrite> {
        let outcome = unmarked_outcome(self.pending.what, &reply);
        if outcome.is_some() {
            self.pending.settle();
        }
        match (outcome, reply) {
            (Some(Ok(done)), _) => {
                self.waited.reached(&self.pending.key, done.receivers());
                None
            }
            (Some(Err(reason)), _) => {
                let err = Error::not_held(&self.pending.key, reason);
                log::warn!("redmutex: releasing {:?} on drop: {err}", self.pending.key);
                self.failed(&err);
                None
            }
            (None, Value::ServerError(refused))
                if refused.code() == "NOSCRIPT" && !self.rewritten.load(Ordering::Relaxed) =>
            {
                // The script cache was flushed: the release did not run.
                // Sent again with the source, behind like the first. (One
                // owner at a time reads replies: the ledger of the one
                // connection that owes it.)
                self.rewritten.store(true, Ordering::Relaxed);
                let request = script::wire::with_packed(
                    &script::release_unmarked(
                        self.pending.what,
                        &self.pending.key,
                        &self.pending.token,
                        &self.pending.channel,
                        false,
                        true,
                    ),
                    <[u8]>::to_vec,
                );
                self.stats.commands(1);
                Some(Rewrite {
                    request,
                    owed: self,
                })
            }
            (None, reply) => {
                self.pending.settle();
                let err = match reply {
                    Value::ServerError(refused) => RedisError::from(refused),
                    other => RedisError::from((
                        redis::ErrorKind::Parse,
                        "unexpected reply to a release",
                        format!("{other:?}"),
                    )),
                };
                if err
                    .detail()
                    .is_some_and(|detail| detail.starts_with("unknown command '"))
                {
                    // No scripts here after all: later drops release
                    // synchronously, which can fall back to WATCH.
                    self.scripts_work.store(false, Ordering::Relaxed);
                }
                let err = Error::from_redis(&self.pending.key, err);
                log::warn!(
                    "redmutex: releasing {:?} on drop: {err}; releasing it again in the background",
                    self.pending.key
                );
                self.failed(&err);
                self.clean_up();
                None
            }
        }
    }

    fn lost(self: Arc<Self>, err: &RedisError) {
        self.pending.settle();
        log::warn!(
            "redmutex: releasing {:?} on drop: release outcome unknown, the connection was lost \
             before its reply ({err}); releasing it again in the background",
            self.pending.key
        );
        self.failed(&Error::OutcomeUnknown {
            key: self.pending.key.to_string(),
            operation: Op::Release.name(),
            source: err.clone(),
        });
        self.clean_up();
    }
}

/// What the reply of a release without a marker says (`None`: not a reply
/// of that script, an error say): `lua/release.lua`'s one integer, or
/// `lua/sem_release.lua`'s `{outcome, receivers}`.
fn unmarked_outcome(what: script::Unmarked, reply: &Value) -> Option<Outcome> {
    let markerless = Cell::new(false);
    match (what, reply) {
        (script::Unmarked::Lock, Value::Int(code)) => Some(released(*code, &markerless)),
        (script::Unmarked::Permit, Value::Array(items)) => match items.as_slice() {
            [Value::Int(1), Value::Int(receivers)] => {
                Some(Ok(Released::Now(u64::try_from(*receivers).ok())))
            }
            [Value::Int(1), _] => Some(Ok(Released::Now(None))),
            [Value::Int(2), _] => Some(Ok(Released::Earlier)),
            // Gone (the marker unreadable or not): the only "not held" a
            // permit has. Anything else is no reply of this script.
            [Value::Int(code @ (0 | -2)), _] => Some(Err(not_held(*code, &markerless))),
            _ => None,
        },
        _ => None,
    }
}

fn release_as(
    client: &crate::client::LockClient,
    key: &str,
    channel: &str,
    token: &str,
    how: crate::client::options::Release,
) -> Result<Option<u64>, Error> {
    let (marker_name, millis) = marker_of(client, key, token);
    let marker = Marker {
        key: marker_name.as_deref(),
        millis,
    };
    let stats = client.counters();
    let markerless = Cell::new(marker.key.is_none());
    let announce = Announce {
        channel,
        sharded: client.sharded(channel),
    };
    // A transaction with a command the server lacks fails whole:
    // `SPUBLISH` only where `SET NX GET` (7.0) works.
    let watch_announce = Announce {
        sharded: announce.sharded && client.set_get_allowed(),
        ..announce
    };
    let result = client.run(Op::Release, key, |con, send| {
        // Either way the marker goes again without it when an ACL refuses
        // it (the script's key, or the `WATCH` pipeline's `EXISTS`).
        let outcome = with_marker(client, marker.key, &markerless, |key_of_marker| {
            let marker = Marker {
                key: key_of_marker,
                ..marker
            };
            match how {
                crate::client::options::Release::Lua => {
                    release_lua(con, stats, key, token, announce, marker, &markerless)
                }
                crate::client::options::Release::Watch => {
                    release_watch(con, stats, key, token, watch_announce, marker, &markerless)
                }
            }
        })?;
        Ok((outcome, send.replied()))
    });
    let outcome = result.and_then(|(outcome, replied)| {
        check_resend(key, outcome, replied, !markerless.get(), millis)
    });
    outcome?
        .map(Released::receivers)
        .map_err(|reason| Error::not_held(key, reason))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn replied(resend: bool, after_ms: u64) -> Replied {
        Replied {
            resend,
            after: Duration::from_millis(after_ms),
        }
    }

    #[test]
    fn not_held_after_a_resend_is_believed_only_within_the_markers_life() {
        let gone: Result<(), LossReason> = Err(LossReason::Expired);
        // A first send: Redis's answer is the truth.
        assert!(matches!(
            check_resend("k", gone, replied(false, 9_999), true, 6_000),
            Ok(Err(_))
        ));
        // A resend whose reply came while the marker lived: no marker, so
        // the first send did not release it.
        assert!(matches!(
            check_resend("k", gone, replied(true, 5_999), true, 6_000),
            Ok(Err(_))
        ));
        // Later than a marker lives, or with no marker at all: unknown.
        let late = check_resend("k", gone, replied(true, 6_000), true, 6_000);
        assert!(matches!(late, Err(Error::OutcomeUnknown { .. })));
        let bare = check_resend("k", gone, replied(true, 10), false, 6_000);
        assert!(matches!(bare, Err(Error::OutcomeUnknown { .. })));
        // "Released" needs no marker to be believed.
        assert!(matches!(
            check_resend(
                "k",
                Ok::<_, LossReason>(()),
                replied(true, 99_999),
                false,
                1
            ),
            Ok(Ok(()))
        ));
    }
}
