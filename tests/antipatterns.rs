//! Executable documentation: the broken lock recipes of the articles
//! "Redis-based distributed locks and their pitfalls" (§3.3, §4.3, §4.4)
//! and the Jedis reentrancy article ("Redis series 13: distributed locks"),
//! each shown failing against a real
//! Redis with a paused or dead holder, next to this crate's operation that
//! does not fail the same way.
//!
//! A "paused holder" is a holder that stops between two of its steps (a GC
//! pause, a swapped-out process, a slow network) for longer than its lease.

use redmutex_test_support as support;

use std::time::Duration;

use redis::Commands;
use redmutex::Lease;
use redmutex::{DistributedLock, LockOptions, LossReason, Release};
use support::{RedisServer, wait_until};

const LEASE_MS: u64 = 100;

fn get(con: &mut redis::Connection, key: &str) -> Option<String> {
    con.get(key).expect("GET")
}

/// `SET key value NX PX ms`, the way every client below takes the lock by hand.
fn set_nx_px(con: &mut redis::Connection, key: &str, value: &str) -> bool {
    let reply: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg(value)
        .arg("NX")
        .arg("PX")
        .arg(LEASE_MS)
        .query(con)
        .expect("SET NX PX");
    reply.is_some()
}

/// The paused holder wakes up only after its lease is gone.
fn pause_until_expired(con: &mut redis::Connection, key: &str) {
    assert!(
        wait_until(Duration::from_secs(3), || get(con, key).is_none()),
        "the lease should have expired during the pause"
    );
}

#[test]
fn exists_then_set_lets_two_holders_in() {
    // The Jedis reentrancy article, "the simple idea": check with EXISTS, then SET. Two clients
    // interleave between the check and the write; both believe they hold it.
    let server = RedisServer::start();
    let (mut a, mut b) = (server.conn(), server.conn());
    let a_sees: bool = a.exists("job").expect("EXISTS");
    let b_sees: bool = b.exists("job").expect("EXISTS");
    let _: () = a.set("job", "1").expect("SET");
    let _: () = b.set("job", "1").expect("SET");
    assert!(
        !a_sees && !b_sees,
        "BROKEN: both saw it free and both 'acquired'"
    );

    // This crate: one atomic SET NX; of two contenders exactly one wins.
    let _: () = a.del("job").expect("DEL");
    let (ca, cb) = (server.lock_client(), server.lock_client());
    let first = DistributedLock::new(&ca, "job").try_lock().expect("try");
    let second = DistributedLock::new(&cb, "job").try_lock().expect("try");
    assert!(first.is_some() && second.is_none());
}

#[test]
fn setnx_then_expire_deadlocks_when_the_holder_dies_between() {
    // The pitfalls article §3.3 and the Jedis reentrancy article: SETNX, then EXPIRE as a second command. A
    // holder that dies between the two leaves a key that never expires.
    let server = RedisServer::start();
    let mut holder = server.conn();
    let acquired: bool = holder.set_nx("job", "holder").expect("SETNX");
    assert!(acquired);
    // ... the holder dies here, before `EXPIRE job 0.1`.
    drop(holder);
    let mut other = server.conn();
    let ttl: i64 = other.ttl("job").expect("TTL");
    assert_eq!(ttl, -1, "BROKEN: the lock key has no expiry at all");
    std::thread::sleep(Duration::from_millis(3 * LEASE_MS)); // far past the intended lease
    let taken: bool = other.set_nx("job", "other").expect("SETNX");
    assert!(
        !taken,
        "BROKEN: nobody can ever take the lock again (deadlock)"
    );

    // This crate: the expiry is part of the one SET that acquires, so a
    // holder that dies right after acquiring frees the lock after its ttl.
    let client = server.lock_client();
    let lock = DistributedLock::with_options(
        &client,
        "job2",
        LockOptions::default().ttl(Duration::from_millis(LEASE_MS)),
    );
    let guard = lock.lock().expect("lock");
    let pttl: i64 = other.pttl("job2").expect("PTTL");
    assert!(
        pttl > 0 && pttl <= LEASE_MS as i64,
        "expiry set atomically: {pttl}"
    );
    std::mem::forget(guard); // dies without releasing
    let stranger = server.lock_client();
    let later = DistributedLock::with_options(
        &stranger,
        "job2",
        LockOptions::default().wait(Duration::from_secs(3)),
    );
    assert!(later.lock().is_ok(), "freed by its ttl");
}

#[test]
fn del_without_check_deletes_another_owners_lock() {
    // The pitfalls article §4.3: release with a bare DEL. A paused holder's late DEL
    // removes the lock a second client legitimately holds, and a third
    // client walks in beside the second.
    let server = RedisServer::start();
    let (mut a, mut b, mut c) = (server.conn(), server.conn(), server.conn());
    assert!(set_nx_px(&mut a, "job", "a"));
    pause_until_expired(&mut a, "job");
    assert!(
        set_nx_px(&mut b, "job", "b"),
        "b acquires after a's lease ran out"
    );
    let _: () = a.del("job").expect("a's late, unchecked DEL");
    assert!(
        set_nx_px(&mut c, "job", "c"),
        "BROKEN: c acquires while b still holds the lock"
    );

    // This crate: the late release is owner-checked and tells a what happened.
    let _: () = a.del("job").expect("DEL");
    let (ca, cb, cc) = (
        server.lock_client(),
        server.lock_client(),
        server.lock_client(),
    );
    let opts = LockOptions::default().ttl(Duration::from_millis(LEASE_MS));
    let a_guard = DistributedLock::with_options(&ca, "job", opts)
        .lock()
        .expect("a");
    pause_until_expired(&mut a, "job");
    let b_guard = DistributedLock::new(&cb, "job").lock().expect("b");
    let err = a_guard.unlock().expect_err("a no longer holds it");
    assert_eq!(err.not_held_reason(), Some(LossReason::OwnedByOther));
    assert_eq!(get(&mut a, "job").as_deref(), Some(b_guard.token()));
    assert!(
        DistributedLock::new(&cc, "job")
            .try_lock()
            .expect("try")
            .is_none()
    );
}

#[test]
fn get_then_del_deletes_another_owners_lock() {
    // The pitfalls article §4.4: check the token with GET, then DEL: two commands. The
    // holder pauses between them; its lease expires, b acquires, and a's DEL
    // deletes b's lock even though a checked.
    let server = RedisServer::start();
    let (mut a, mut b) = (server.conn(), server.conn());
    assert!(set_nx_px(&mut a, "job", "a"));
    let mine = get(&mut a, "job").as_deref() == Some("a");
    assert!(mine, "the check passes");
    pause_until_expired(&mut a, "job"); // paused between GET and DEL
    assert!(set_nx_px(&mut b, "job", "b"));
    let _: () = a.del("job").expect("DEL after the check");
    assert_eq!(
        get(&mut b, "job"),
        None,
        "BROKEN: b's lock was deleted by a"
    );

    // The WATCH/MULTI/EXEC form of the same check is safe: b's write to the
    // watched key makes a's EXEC abort.
    assert!(set_nx_px(&mut a, "job2", "a"));
    let _: () = redis::cmd("WATCH")
        .arg("job2")
        .query(&mut a)
        .expect("WATCH");
    assert_eq!(get(&mut a, "job2").as_deref(), Some("a"));
    pause_until_expired(&mut a, "job2");
    assert!(set_nx_px(&mut b, "job2", "b"));
    let executed: Option<(i64,)> = redis::pipe()
        .atomic()
        .del("job2")
        .query(&mut a)
        .expect("MULTI/DEL/EXEC");
    assert_eq!(executed, None, "EXEC aborted: nothing deleted");
    assert_eq!(get(&mut b, "job2").as_deref(), Some("b"));

    // This crate: both releases check and delete atomically.
    for release in [Release::Lua, Release::Watch] {
        let _: () = a.del("job3").expect("DEL");
        let (ca, cb) = (server.lock_client(), server.lock_client());
        let opts = LockOptions::default()
            .ttl(Duration::from_millis(LEASE_MS))
            .release(release);
        let a_guard = DistributedLock::with_options(&ca, "job3", opts)
            .lock()
            .expect("a");
        pause_until_expired(&mut a, "job3");
        let b_guard = DistributedLock::new(&cb, "job3").lock().expect("b");
        let err = a_guard.unlock().expect_err("not a's");
        assert_eq!(err.not_held_reason(), Some(LossReason::OwnedByOther));
        assert_eq!(
            get(&mut b, "job3").as_deref(),
            Some(b_guard.token()),
            "{release:?}"
        );
    }
}

#[test]
fn a_fixed_value_cannot_tell_owners_apart() {
    // The Jedis reentrancy article: every client writes the same value ("1"), so even an atomic
    // compare-and-delete cannot tell a's lock from b's.
    let server = RedisServer::start();
    let (mut a, mut b) = (server.conn(), server.conn());
    assert!(set_nx_px(&mut a, "job", "1"));
    pause_until_expired(&mut a, "job");
    assert!(set_nx_px(&mut b, "job", "1"));
    let deleted: i64 = redis::Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end",
    )
    .key("job")
    .arg("1")
    .invoke(&mut a)
    .expect("compare-and-delete");
    assert_eq!(deleted, 1, "BROKEN: a's release deleted b's lock");

    // This crate: a fresh random token per acquisition.
    let client = server.lock_client();
    let lock = DistributedLock::new(&client, "job2");
    let first = lock.lock().expect("lock");
    let token = first.token().to_owned();
    drop(first);
    assert_ne!(lock.lock().expect("lock").token(), token);
}
