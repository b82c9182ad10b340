//! A plain lock's guard made movable: the same lease, out of its thread's
//! holds, released from another thread.

use redmutex_test_support as support;

use std::time::{Duration, Instant};

use redis::Commands;
use redmutex::{DistributedLock, Lease, LockOptions, LossReason};
use support::{RedisServer, wait_until};

fn value(server: &RedisServer, key: &str) -> Option<String> {
    server.conn().get(key).expect("GET")
}

#[test]
fn a_movable_guard_is_released_by_another_thread() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::new(&client, "job");
    let guard = lock.lock().expect("lock");
    let token = guard.token().to_owned();
    let moved = guard.into_movable().expect("not nested");
    assert_eq!(moved.token(), token, "the same lease");
    // Not this thread's any more: no nested guard, the key is another
    // owner's to it.
    assert!(lock.try_lock().expect("try").is_none());
    let worker = std::thread::spawn(move || {
        assert!(moved.is_held().expect("is_held"));
        moved.unlock()
    });
    worker.join().expect("worker").expect("released there");
    assert_eq!(value(&server, "job"), None);
    // And the thread can take it again afresh.
    let again = lock.try_lock().expect("try").expect("free");
    assert_ne!(again.token(), token);
}

#[test]
fn a_nested_hold_stays_on_its_thread() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::new(&client, "nested");
    let outer = lock.lock().expect("lock");
    let inner = lock.lock().expect("nested");
    let inner = match inner.into_movable() {
        Ok(_) => panic!("a nested guard must not move"),
        Err(inner) => inner,
    };
    assert_eq!(inner.depth(), 2);
    drop(inner);
    let moved = outer.into_movable().expect("alone now");
    std::thread::spawn(move || drop(moved))
        .join()
        .expect("dropped elsewhere");
    assert!(wait_until(Duration::from_secs(5), || value(
        &server, "nested"
    )
    .is_none()));
}

#[test]
fn a_moved_lease_keeps_its_watchdog_and_loss_signal() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::with_options(
        &client,
        "watched",
        LockOptions::default()
            .ttl(Duration::from_millis(300))
            .watchdog(true),
    );
    let moved = lock.lock().expect("lock").into_movable().expect("movable");
    let worker = std::thread::spawn(move || {
        let started = Instant::now();
        // Renewed past several ttls, on whichever thread it lives.
        let alive = wait_until(Duration::from_secs(5), || {
            started.elapsed() > Duration::from_millis(1200)
        }) && !moved.is_lost()
            && moved.is_held().unwrap_or(false);
        (alive, moved)
    });
    let (alive, moved) = worker.join().expect("worker");
    assert!(alive);
    let signal = moved.loss_signal();
    let _: () = server.conn().set("watched", "another").expect("SET");
    assert_eq!(
        signal.wait_timeout(Duration::from_secs(5)),
        Some(LossReason::OwnedByOther)
    );
    assert!(moved.unlock().is_err());
}

#[test]
fn a_moved_lease_is_handed_to_a_waiting_thread_of_its_client() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::new(&client, "queue");
    let moved = lock.lock().expect("lock").into_movable().expect("movable");
    let waiter = {
        let lock = lock.clone();
        std::thread::spawn(move || lock.lock().map(|guard| guard.token().to_owned()))
    };
    // The waiter queues behind this client's own hold (no Redis command
    // while it waits); whenever it got there, the release from another
    // thread reaches it: as a handoff of the same lease, or in Redis.
    let releaser = std::thread::spawn(move || moved.unlock());
    releaser.join().expect("releaser").expect("released");
    let token = waiter.join().expect("waiter").expect("got it");
    assert!(!token.is_empty());
    assert!(
        wait_until(Duration::from_secs(5), || value(&server, "queue").is_none()),
        "and released it"
    );
}
