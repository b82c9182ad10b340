//! Holder metadata: every lock type writes who holds it (host, pid,
//! program, label, acquisition time by the server's clock) with the
//! acquisition itself, `list` and `status` read it back without the
//! token's secret, and a lost or refused `TIME` never costs the lock.

use redmutex_test_support as support;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redmutex::Lease;
use redmutex::{
    DistributedLock, Holder, LockClient, LockKind, RedLock, ReentrantLock, RwLock, Semaphore,
};
use support::{FaultProxy, RedisServer, get};

fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .expect("the host name")
        .trim()
        .to_owned()
}

fn server_ms(server: &RedisServer) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut server.conn()).expect("TIME");
    secs * 1000 + micros / 1000
}

fn ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .expect("after the epoch")
        .as_millis() as u64
}

fn labelled(server: &RedisServer) -> LockClient {
    LockClient::builder()
        .url(server.url())
        .label("batch-7")
        .program("nightly")
        .build()
        .expect("client")
}

fn check(holder: &Holder) {
    assert_eq!(holder.label.as_deref(), Some("batch-7"), "{holder:?}");
    assert_eq!(holder.program, "nightly");
    assert_eq!(holder.pid, std::process::id());
    assert_eq!(holder.host, host());
}

#[test]
fn a_plain_lock_writes_its_holder_in_the_acquisition_and_time_is_read_once() {
    let server = RedisServer::start();
    let client = labelled(&server);
    let before = server_ms(&server);
    let lock = DistributedLock::new(&client, "report");
    let guard = lock.lock().expect("lock");
    let after = server_ms(&server);
    assert_eq!(get(&server, "report").as_deref(), Some(guard.token()));
    let holder = Holder::from_token(guard.token()).expect("metadata");
    check(&holder);
    let at = ms(holder.acquired_at);
    // By the server's clock, within the rounding of a round trip.
    assert!(
        at + 5 >= before && at <= after + 5,
        "{at} not within the server's {before}..{after}"
    );
    guard.unlock().expect("unlock");
    // Ours (before, after) and the client's one.
    assert_eq!(server.command_calls("time"), 3);
    for _ in 0..20 {
        lock.lock().expect("again").unlock().expect("unlock");
    }
    assert_eq!(
        server.command_calls("time"),
        3,
        "one TIME per client, not one per acquisition"
    );
    // The acquisition itself is one command, as without metadata.
    let set = server.command_calls("set");
    lock.lock().expect("once more").unlock().expect("unlock");
    assert_eq!(server.command_calls("set") - set, 1);
}

#[test]
fn every_lock_type_says_who_holds_it_and_list_never_shows_a_secret() {
    let server = RedisServer::start();
    let client = labelled(&server);
    let plain = DistributedLock::new(&client, "jobs:plain")
        .lock()
        .expect("plain");
    let reentrant = ReentrantLock::new(&client, "jobs:re");
    let holds = (
        reentrant.lock().expect("hold"),
        reentrant.lock().expect("again"),
    );
    let rw = RwLock::new(&client, "jobs:rw");
    let readers = (rw.read().expect("read"), rw.read().expect("read"));
    let writer = RwLock::new(&client, "jobs:w").write().expect("write");
    let sem = Semaphore::new(&client, "jobs:sem", 3);
    let permits = (
        sem.acquire().expect("permit"),
        sem.acquire().expect("permit"),
    );
    for token in [
        plain.token(),
        readers.0.token(),
        writer.token(),
        permits.0.id(),
    ] {
        check(&Holder::from_token(token).expect("metadata"));
    }
    let status = sem.status().expect("status");
    for permit in status.holders() {
        check(&permit.holder().expect("a permit's holder"));
    }

    let listing = client
        .list("jobs:*", Duration::from_secs(10))
        .expect("list");
    assert!(listing.complete);
    let kinds: Vec<(LockKind, usize)> = listing
        .held
        .iter()
        .map(|h| (h.kind, h.held_by.len()))
        .collect();
    assert_eq!(
        kinds,
        [
            (LockKind::Mutex, 1),
            (LockKind::Reentrant, 2),
            (LockKind::Read, 2),
            (LockKind::Semaphore, 2),
            (LockKind::Write, 1),
        ]
    );
    for held in &listing.held {
        for holder in &held.held_by {
            check(holder);
            assert!(holder.acquired_at <= held.seen_at, "{held:?}");
        }
        let sorted = held
            .held_by
            .windows(2)
            .all(|w| w[0].acquired_at <= w[1].acquired_at);
        assert!(sorted, "oldest first: {held:?}");
    }
    let text = format!("{listing:?}");
    for token in [
        plain.token(),
        readers.0.token(),
        writer.token(),
        permits.0.id(),
    ] {
        let secret = token.split('|').next().expect("a secret");
        assert!(!text.contains(secret), "a secret in the listing");
    }
    assert!(
        !text.contains(holds.0.owner()),
        "an owner id in the listing"
    );
    drop((plain, holds, readers, writer, permits));

    // RedLock: each node's value carries the holder of the first client.
    let nodes = RedisServer::start_many(3);
    let clients: Vec<LockClient> = nodes.iter().map(labelled).collect();
    let red = RedLock::new(clients, "red").expect("redlock");
    let guard = red.lock().expect("redlock");
    check(&Holder::from_token(guard.token()).expect("metadata"));
    for node in &nodes {
        assert_eq!(get(node, "red").as_deref(), Some(guard.token()));
    }
}

#[test]
fn metadata_off_leaves_bare_tokens_and_reads_no_time() {
    let server = RedisServer::start();
    let client = LockClient::builder()
        .url(server.url())
        .holder_metadata(false)
        .build()
        .expect("client");
    let guard = DistributedLock::new(&client, "bare").lock().expect("lock");
    assert_eq!(guard.token().len(), 36, "a bare UUID");
    assert_eq!(Holder::from_token(guard.token()), None);
    assert_eq!(server.command_calls("time"), 0);
    let listing = client.list("*", Duration::from_secs(10)).expect("list");
    assert_eq!(listing.held.len(), 1);
    assert!(listing.held[0].held_by.is_empty());
    drop(guard);

    // A client over the caller's pool: labelled afterwards; a bad label
    // is refused before anything is sent.
    let pooled = server.lock_client_single();
    assert!(matches!(
        pooled.clone().with_label("two words"),
        Err(redmutex::Error::InvalidArgument(_))
    ));
    let pooled = pooled.with_label("from-pool").expect("a label");
    let guard = DistributedLock::new(&pooled, "pooled")
        .lock()
        .expect("lock");
    let holder = Holder::from_token(guard.token()).expect("metadata");
    assert_eq!(holder.label.as_deref(), Some("from-pool"));
    let off = pooled.with_holder_metadata(false);
    drop(guard);
    let guard = DistributedLock::new(&off, "pooled").lock().expect("lock");
    assert_eq!(Holder::from_token(guard.token()), None);
}

/// The reply to the client's one `TIME` is lost after the server ran it:
/// a read, resent on a fresh connection, so the lock is still taken with
/// the server's time, and nobody else gets it.
#[test]
fn a_lost_time_reply_is_resent_and_costs_neither_the_lock_nor_exclusion() {
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = LockClient::builder()
        .url(proxy.url())
        .label("lossy")
        .build()
        .expect("client");
    proxy.lose_reply("TIME", 1);
    let before = server_ms(&server);
    let guard = DistributedLock::new(&client, "lossy").lock().expect("lock");
    let after = server_ms(&server);
    assert_eq!(proxy.lost_replies(), 1, "the fault fired");
    assert_eq!(get(&server, "lossy").as_deref(), Some(guard.token()));
    let holder = Holder::from_token(guard.token()).expect("metadata");
    assert_eq!(holder.label.as_deref(), Some("lossy"));
    let at = ms(holder.acquired_at);
    assert!(
        at + 5 >= before && at <= after + 5,
        "the server's time after the resend: {at} vs {before}..{after}"
    );
    assert!(
        DistributedLock::new(&server.lock_client(), "lossy")
            .try_lock()
            .expect("try_lock")
            .is_none(),
        "one holder"
    );
    guard.unlock().expect("unlock");
}

/// A server that accepts connections and never answers, met by a client's
/// first acquisition: the `TIME` read fails within the usual bound, the
/// acquisition is not sent, and the call is a connection error.
#[test]
fn a_silent_server_fails_the_first_acquisition_within_its_bound() {
    const T: Duration = Duration::from_millis(300);
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = LockClient::builder()
        .url(proxy.url())
        .timeout(T)
        .build()
        .expect("client");
    proxy.swallow_new(true);
    let started = std::time::Instant::now();
    let err = DistributedLock::new(&client, "silent")
        .try_lock()
        .expect_err("nobody answers");
    assert!(err.is_connection(), "{err}");
    assert!(
        started.elapsed() < T * 4,
        "bounded: {:?}",
        started.elapsed()
    );
    assert_eq!(get(&server, "silent"), None, "nothing was sent");
    proxy.swallow_new(false);
    let guard = support::wait_until(Duration::from_secs(5), || {
        matches!(
            DistributedLock::new(&client, "silent").try_lock(),
            Ok(Some(_))
        )
    });
    assert!(guard, "works once the server answers");
}

/// A managed Redis that refuses `TIME` (renamed away): plain locks work,
/// with the holder's own clock.
#[test]
fn a_server_without_time_still_locks() {
    let server = RedisServer::start_with(&["--rename-command", "TIME", ""]);
    let client = labelled(&server);
    let local = ms(SystemTime::now());
    let guard = DistributedLock::new(&client, "no-time")
        .lock()
        .expect("lock");
    let holder = Holder::from_token(guard.token()).expect("metadata");
    check(&holder);
    assert!(ms(holder.acquired_at) + 5 >= local);
    guard.unlock().expect("unlock");
}

/// Every log record of this test binary, to look for secrets in.
struct Captured(std::sync::Mutex<Vec<String>>);

impl log::Log for Captured {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        if let Ok(mut lines) = self.0.lock() {
            lines.push(record.args().to_string());
        }
    }
    fn flush(&self) {}
}

static CAPTURED: Captured = Captured(std::sync::Mutex::new(Vec::new()));

fn captured() -> Vec<String> {
    // Installed once per binary; a second call finds it there.
    if log::set_logger(&CAPTURED).is_ok() {
        log::set_max_level(log::LevelFilter::Trace);
    }
    CAPTURED.0.lock().map(|l| l.clone()).unwrap_or_default()
}

#[test]
fn no_secret_reaches_debug_output_or_the_logs() {
    let _ = captured();
    let server = RedisServer::start();
    let client = labelled(&server);
    let mut secrets = Vec::new();
    let mut shown = Vec::new();

    // Each guard is shown, then its key taken from under it, so dropping
    // it logs a warning naming the key and what went wrong.
    let guard = DistributedLock::new(&client, "s:plain")
        .lock()
        .expect("lock");
    secrets.push(support::secret(guard.token()).to_owned());
    shown.push(format!("{guard:?}"));
    let _: () = redis::cmd("DEL")
        .arg("s:plain")
        .query(&mut server.conn())
        .expect("DEL");
    drop(guard);

    let reentrant = ReentrantLock::new(&client, "s:reentrant")
        .lock()
        .expect("reentrant");
    let hash: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg("s:reentrant")
        .query(&mut server.conn())
        .expect("HGETALL");
    for (field, value) in &hash {
        match field.strip_prefix("h:") {
            Some(hold) => secrets.push(support::secret(hold).to_owned()),
            // The owner id, "<process uuid>:<thread>".
            None => secrets.push(value.split(':').next().unwrap_or(value).to_owned()),
        }
    }
    assert_eq!(secrets.len(), 3, "{hash:?}");
    shown.push(format!("{reentrant:?}"));
    let _: () = redis::cmd("DEL")
        .arg("s:reentrant")
        .query(&mut server.conn())
        .expect("DEL");
    drop(reentrant);

    let write = RwLock::new(&client, "s:rw").write().expect("write");
    secrets.push(support::secret(write.token()).to_owned());
    shown.push(format!("{write:?}"));
    let _: () = redis::cmd("DEL")
        .arg("s:rw")
        .query(&mut server.conn())
        .expect("DEL");
    drop(write);

    let permit = Semaphore::new(&client, "s:sem", 2)
        .acquire()
        .expect("permit");
    secrets.push(support::secret(permit.id()).to_owned());
    shown.push(format!("{permit:?}"));
    let status = Semaphore::new(&client, "s:sem", 2)
        .status()
        .expect("status");
    shown.push(format!("{status:?}"));
    let _: () = redis::cmd("DEL")
        .arg("s:sem")
        .query(&mut server.conn())
        .expect("DEL");
    drop(permit);

    let redlock = RedLock::new(vec![client.clone()], "s:red").expect("redlock");
    let red = redlock.lock().expect("redlock");
    secrets.push(support::secret(red.token()).to_owned());
    shown.push(format!("{red:?}"));
    let _: () = redis::cmd("DEL")
        .arg("s:red")
        .query(&mut server.conn())
        .expect("DEL");
    drop(red);

    let logs = captured();
    assert!(
        logs.iter().any(|line| line.contains("s:plain")),
        "the drop of a lost lock logs: {logs:?}"
    );
    for secret in &secrets {
        assert!(secret.len() >= 8, "{secret}");
        for text in shown.iter().chain(&logs) {
            assert!(!text.contains(secret.as_str()), "a secret in {text:?}");
        }
    }
    assert!(
        shown[0].contains("|nightly|"),
        "the public part: {}",
        shown[0]
    );
}
