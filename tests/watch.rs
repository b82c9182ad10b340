//! WATCH hygiene: no release path hands a pooled connection back with a WATCH
//! on it. A leftover WATCH would make the next user's MULTI/EXEC abort when
//! the watched key changes.

use redmutex_test_support as support;

use std::time::Duration;

use redis::Commands;
use redmutex::Lease;
use redmutex::{DistributedLock, Error, LockOptions, LossReason, Release};
use support::RedisServer;

/// Changes `key` from outside, then runs a transaction on the client's one
/// pooled connection: `true` when EXEC ran, `false` when it aborted.
fn next_transaction_runs(server: &RedisServer, client: &redmutex::LockClient, key: &str) -> bool {
    let mut outside = server.conn();
    let _: () = outside.set(key, "touched").expect("SET");
    let _: () = outside.del(key).expect("DEL");
    let mut pooled = client
        .pool()
        .expect("a single-node client")
        .get()
        .expect("the pool's only connection");
    let executed: Option<(String,)> = redis::pipe()
        .atomic()
        .cmd("SET")
        .arg("unrelated")
        .arg("1")
        .query(&mut *pooled)
        .expect("MULTI/EXEC");
    executed.is_some()
}

#[test]
fn the_check_detects_a_leftover_watch() {
    // Control: a connection left with a WATCH does abort the next transaction,
    // so the assertions below can fail.
    let server = RedisServer::start();
    let client = server.lock_client_single();
    {
        let mut pooled = client
            .pool()
            .expect("a single-node client")
            .get()
            .expect("connection");
        let _: () = redis::cmd("WATCH")
            .arg("k")
            .query(&mut *pooled)
            .expect("WATCH");
    }
    assert!(!next_transaction_runs(&server, &client, "k"));
}

#[test]
fn every_watch_release_path_leaves_the_connection_clean() {
    let server = RedisServer::start();
    let mut con = server.conn();
    let client = server.lock_client_single();
    let lock = DistributedLock::with_options(
        &client,
        "w",
        LockOptions::default()
            .ttl(Duration::from_millis(10_000))
            .release(Release::Watch),
    );

    // Released.
    lock.lock().expect("lock").unlock().expect("unlock");
    assert!(
        next_transaction_runs(&server, &client, "w"),
        "after a release"
    );

    // Owned by another.
    let guard = lock.lock().expect("lock");
    let _: () = con.set("w", "other").expect("SET");
    let err = guard.unlock().expect_err("taken");
    assert_eq!(err.not_held_reason(), Some(LossReason::OwnedByOther));
    assert!(
        next_transaction_runs(&server, &client, "w"),
        "after owned-by-other"
    );

    // Expired.
    let guard = lock.lock().expect("lock");
    let _: () = con.del("w").expect("DEL");
    let err = guard.unlock().expect_err("gone");
    assert_eq!(err.not_held_reason(), Some(LossReason::Expired));
    assert!(
        next_transaction_runs(&server, &client, "w"),
        "after expired"
    );

    // An error from Redis mid-release (WRONGTYPE on the GET).
    let guard = lock.lock().expect("lock");
    let _: () = con.del("w").expect("DEL");
    let _: () = con.hset("w", "f", "v").expect("HSET");
    assert!(matches!(guard.unlock(), Err(Error::WrongType { .. })));
    let _: () = con.del("w").expect("DEL");
    assert!(
        next_transaction_runs(&server, &client, "w"),
        "after an error"
    );

    // Dropped, not unlocked.
    drop(lock.lock().expect("lock"));
    assert!(next_transaction_runs(&server, &client, "w"), "after a drop");
}

#[test]
fn watch_release_retries_when_exec_aborts_but_the_key_is_still_ours() {
    // A writer keeps touching the key's ttl (same value) from outside; EXEC
    // aborts whenever that lands between WATCH and EXEC, and the release
    // looks again and still succeeds.
    let server = RedisServer::start();
    let client = server.lock_client_single();
    let lock = DistributedLock::with_options(
        &client,
        "touchy",
        LockOptions::default().release(Release::Watch),
    );
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let toucher = {
        let stop = stop.clone();
        let mut con = server.conn();
        std::thread::spawn(move || {
            let mut touches = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && touches < 200_000 {
                let _: Result<i64, _> = con.pexpire("touchy", 30_000);
                touches += 1;
                // Slower than one WATCH..EXEC window (a round trip, longer
                // in a debug build), or every attempt would abort.
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let mut released = 0;
    for _ in 0..300 {
        let guard = lock.lock().expect("lock");
        match guard.unlock() {
            Ok(_) => released += 1,
            Err(err) => panic!("release failed: {err}"),
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    toucher.join().expect("toucher");
    assert_eq!(released, 300);
    // Every successful release ran one EXEC; the rest aborted and were retried.
    let aborted = server.command_calls("exec") - 300;
    assert!(
        aborted > 0,
        "the toucher never hit a WATCH window; the retry went untested"
    );
    eprintln!("{aborted} EXEC aborts retried over 300 releases");
    assert!(next_transaction_runs(&server, &client, "touchy"));
}
