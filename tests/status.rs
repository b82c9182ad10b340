//! `status()` of the lock types: who holds a key, read in one step by the
//! server's clock, never a token's secret. Each case on a fresh server and
//! client.

use redmutex_test_support as support;

use std::time::Duration;

use redmutex::Lease;
use redmutex::{DistributedLock, Error, LockClient, LockKind, ReentrantLock, RwLock, Semaphore};
use support::{FaultProxy, RedisServer, get, sha};

const INSPECT: &str = include_str!("../lua/inspect.lua");

fn labelled(url: String) -> LockClient {
    LockClient::builder()
        .url(url)
        .label("status-7")
        .program("statusprog")
        .build()
        .expect("client")
}

/// What a status must never show: the part of a token before its first
/// `|`, for every string value and hash field the server holds.
fn secrets(server: &RedisServer) -> Vec<String> {
    let mut con = server.conn();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut con).expect("KEYS");
    let mut found = Vec::new();
    for key in keys {
        let kind: String = redis::cmd("TYPE").arg(&key).query(&mut con).expect("TYPE");
        let texts: Vec<String> = match kind.as_str() {
            "string" => vec![get(server, &key).unwrap_or_default()],
            "hash" => redis::cmd("HKEYS")
                .arg(&key)
                .query(&mut con)
                .expect("HKEYS"),
            _ => Vec::new(),
        };
        for text in texts {
            let text = text.trim_start_matches(['p', 'r', 'h', ':']);
            let secret = text.split('|').next().unwrap_or_default();
            if secret.len() >= 16 {
                found.push(secret.to_owned());
            }
        }
    }
    found
}

fn assert_no_secret(server: &RedisServer, shown: &str) {
    for secret in secrets(server) {
        assert!(!shown.contains(&secret), "{secret} in {shown}");
    }
}

#[test]
fn a_plain_lock_reports_its_holder_and_time_left() {
    let server = RedisServer::start();
    let client = labelled(server.url());
    let lock = DistributedLock::new(&client, "st:plain");
    assert_eq!(lock.status().expect("status"), None, "free");

    let guard = lock.lock().expect("lock");
    let held = lock.status().expect("status").expect("held");
    assert_eq!(held.kind, LockKind::Mutex);
    assert_eq!(held.key, "st:plain");
    assert_eq!(held.holders, 1);
    assert_eq!(held.limit, None);
    let left = held.remaining.expect("a ttl");
    assert!(
        left <= lock.options().ttl && left > lock.options().ttl / 2,
        "{left:?}"
    );
    let holder = held.held_by.first().expect("the holder");
    assert_eq!(holder.label.as_deref(), Some("status-7"));
    assert_eq!(holder.program, "statusprog");
    assert_eq!(holder.pid, std::process::id());
    assert_no_secret(&server, &format!("{held:?}"));

    guard.unlock().expect("unlock");
    assert_eq!(lock.status().expect("status"), None, "free again");
}

#[test]
fn a_reentrant_lock_reports_its_owners_holds() {
    let server = RedisServer::start();
    let client = labelled(server.url());
    let lock = ReentrantLock::new(&client, "st:reentrant");
    assert_eq!(lock.status().expect("status"), None);
    let outer = lock.lock().expect("lock");
    let inner = lock.lock().expect("again");
    let held = lock.status().expect("status").expect("held");
    assert_eq!(held.kind, LockKind::Reentrant);
    assert_eq!(held.holders, 2, "{held:?}");
    assert!(held.remaining.expect("a ttl") <= lock.options().ttl);
    assert_eq!(
        held.held_by
            .first()
            .and_then(|h| h.label.clone())
            .as_deref(),
        Some("status-7")
    );
    assert_no_secret(&server, &format!("{held:?}"));
    drop(inner);
    drop(outer);
    assert!(
        support::wait_until(Duration::from_secs(5), || {
            lock.status().expect("status").is_none()
        }),
        "released"
    );
}

#[test]
fn a_read_write_lock_reports_readers_or_its_writer() {
    let server = RedisServer::start();
    let client = labelled(server.url());
    let other = labelled(server.url());
    let lock = RwLock::new(&client, "st:rw");
    assert_eq!(lock.status().expect("status"), None);

    let first = lock.read().expect("read");
    let second = RwLock::new(&other, "st:rw").read().expect("read");
    let held = lock.status().expect("status").expect("held");
    assert_eq!(held.kind, LockKind::Read);
    assert_eq!(held.holders, 2, "{held:?}");
    assert_eq!(held.held_by.len(), 2);
    assert_no_secret(&server, &format!("{held:?}"));
    first.unlock().expect("unlock");
    second.unlock().expect("unlock");

    let writer = lock.write().expect("write");
    let held = lock.status().expect("status").expect("held");
    assert_eq!(held.kind, LockKind::Write);
    assert_eq!(held.holders, 1);
    assert!(held.remaining.expect("a deadline") <= lock.options().ttl);
    assert_no_secret(&server, &format!("{held:?}"));
    writer.unlock().expect("unlock");
    assert_eq!(lock.status().expect("status"), None);
}

#[test]
fn a_key_held_by_another_lock_type_is_reported_as_that_type() {
    let server = RedisServer::start();
    let client = labelled(server.url());
    let permit = Semaphore::new(&client, "st:shared", 3)
        .acquire()
        .expect("permit");
    for status in [
        DistributedLock::new(&client, "st:shared").status(),
        ReentrantLock::new(&client, "st:shared").status(),
        RwLock::new(&client, "st:shared").status(),
    ] {
        let held = status.expect("status").expect("held");
        assert_eq!(held.kind, LockKind::Semaphore);
        assert_eq!(held.limit, Some(3));
        assert_eq!(held.holders, 1);
        assert_no_secret(&server, &format!("{held:?}"));
    }
    permit.release().expect("release");
}

#[test]
fn data_that_is_no_lock_is_a_wrong_type_and_left_alone() {
    let server = RedisServer::start();
    let client = LockClient::open(&server.url()).expect("client");
    let mut con = server.conn();
    let _: () = redis::cmd("SET")
        .arg("st:number")
        .arg("42")
        .query(&mut con)
        .expect("SET");
    let _: () = redis::cmd("RPUSH")
        .arg("st:list")
        .arg("x")
        .query(&mut con)
        .expect("RPUSH");
    let _: () = redis::cmd("HSET")
        .arg("st:hash")
        .arg("name")
        .arg("value")
        .query(&mut con)
        .expect("HSET");
    let before: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut con).expect("KEYS");
    for key in ["st:number", "st:list", "st:hash"] {
        for status in [
            DistributedLock::new(&client, key).status(),
            ReentrantLock::new(&client, key).status(),
            RwLock::new(&client, key).status(),
        ] {
            assert!(
                matches!(status, Err(Error::WrongType { .. })),
                "{key}: {status:?}"
            );
        }
    }
    let mut after: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut con).expect("KEYS");
    let mut before = before;
    before.sort();
    after.sort();
    assert_eq!(before, after, "nothing written");
    assert_eq!(get(&server, "st:number").as_deref(), Some("42"));
    let empty = DistributedLock::new(&client, "").status();
    assert!(matches!(empty, Err(Error::InvalidArgument(_))), "{empty:?}");
}

#[test]
fn a_lost_reply_is_asked_again() {
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = labelled(proxy.url());
    let lock = DistributedLock::new(&client, "st:lossy");
    let guard = lock.lock().expect("lock");
    // The first status loads the script; the next one's reply is lost.
    assert!(lock.status().expect("status").is_some());
    proxy.lose_reply(&sha(INSPECT), 1);
    let held = lock.status().expect("asked again").expect("held");
    assert_eq!(proxy.lost_replies(), 1, "the fault fired");
    assert_eq!(held.kind, LockKind::Mutex);
    assert_eq!(
        held.held_by
            .first()
            .and_then(|h| h.label.clone())
            .as_deref(),
        Some("status-7")
    );
    guard.unlock().expect("unlock");
}

#[test]
fn a_flushed_script_cache_is_reloaded() {
    let server = RedisServer::start();
    let client = LockClient::open(&server.url()).expect("client");
    let lock = DistributedLock::new(&client, "st:flushed");
    let guard = lock.lock().expect("lock");
    assert!(lock.status().expect("status").is_some());
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut server.conn())
        .expect("FLUSH");
    assert!(lock.status().expect("after a flush").is_some());
    guard.unlock().expect("unlock");
}
