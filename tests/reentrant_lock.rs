//! `ReentrantLock`: the holds in a Redis hash, as in the redis-cli
//! sessions of the article "Distributed locks by Redis" (one field per
//! hold instead of a counter).

use redmutex_test_support as support;

use std::time::Duration;

use redis::Commands;
use redmutex::Lease;
use redmutex::{DistributedLock, Error, LossReason, ReentrantLock, Unlocked};
use support::{RedisServer, wait_until};

/// The release script as the articles run it by hand, for a foreign owner.
fn release_as(con: &mut redis::Connection, key: &str, owner: &str) -> Option<i64> {
    redis::Script::new(include_str!("../lua/reentrant_release.lua"))
        .key(key)
        .arg(owner)
        .arg("some-hold")
        .arg(1000)
        .invoke(con)
        .expect("EVALSHA")
}

/// How many holds the hash records (one field per hold besides `owner`).
fn holds(con: &mut redis::Connection, key: &str) -> usize {
    let len: usize = con.hlen(key).expect("HLEN");
    len.saturating_sub(1)
}

#[test]
fn the_articles_session_count_three_foreign_release_three_releases() {
    let server = RedisServer::start();
    let mut con = server.conn();
    let client = server.lock_client();
    let lock = ReentrantLock::with_options(
        &client,
        "lock-key-1",
        redmutex::Options::default().ttl(Duration::from_secs(300)),
    );
    // Releasing a lock nobody holds: the key is gone.
    assert_eq!(release_as(&mut con, "lock-key-1", "thread-1"), Some(-1));

    let first = lock.lock().expect("lock");
    let second = lock.lock().expect("re-enter");
    let third = lock.lock().expect("re-enter");
    assert_eq!((first.depth(), second.depth(), third.depth()), (1, 2, 3));
    let owner: String = con.hget("lock-key-1", "owner").expect("HGET");
    assert_eq!(owner, first.owner());
    assert_eq!(holds(&mut con, "lock-key-1"), 3, "three hold fields");
    let field: String = con
        .hget("lock-key-1", format!("h:{}", third.hold_id()))
        .expect("HGET");
    assert_eq!(field, "1");
    let ttl: i64 = con.ttl("lock-key-1").expect("TTL");
    assert!(ttl > 290 && ttl <= 300, "TTL {ttl}");

    // A foreign owner's release: the articles' nil, nothing changes.
    assert_eq!(release_as(&mut con, "lock-key-1", "thread-2"), None);
    assert_eq!(holds(&mut con, "lock-key-1"), 3);

    assert_eq!(third.unlock().expect("1st release"), Unlocked::StillHeld);
    assert_eq!(second.unlock().expect("2nd release"), Unlocked::StillHeld);
    let exists: bool = con.exists("lock-key-1").expect("EXISTS");
    assert!(exists);
    assert_eq!(first.unlock().expect("3rd release"), Unlocked::Released);
    let exists: bool = con.exists("lock-key-1").expect("EXISTS");
    assert!(!exists, "three releases free it");
}

#[test]
fn other_threads_wait_and_other_clients_of_the_thread_reenter() {
    let server = RedisServer::start();
    let a = server.lock_client();
    let b = server.lock_client();
    let held = ReentrantLock::new(&a, "r").lock().expect("lock");
    // Another client, same thread: same owner, re-enters.
    let again = ReentrantLock::new(&b, "r")
        .try_lock()
        .expect("try")
        .expect("re-enters");
    assert_eq!(again.depth(), 2);
    assert_eq!(again.owner(), held.owner());
    // Another thread: another owner, refused.
    let c = a.clone();
    let other =
        std::thread::spawn(move || ReentrantLock::new(&c, "r").try_lock().map(|g| g.is_some()))
            .join()
            .expect("thread");
    assert!(!other.expect("try_lock"));
    // A foreign thread's guard cannot release ours: it can't even get one.
    drop(again);
    drop(held);
    let exists: bool = server.conn().exists("r").expect("EXISTS");
    assert!(!exists, "dropping the guards released both holds");
}

#[test]
fn reentry_refreshes_the_lease_and_expiry_is_reported() {
    let server = RedisServer::start();
    let mut con = server.conn();
    let client = server.lock_client();
    let lock = ReentrantLock::with_options(
        &client,
        "lease",
        redmutex::Options::default().ttl(Duration::from_millis(400)),
    );
    let outer = lock.lock().expect("lock");
    std::thread::sleep(Duration::from_millis(200));
    let inner = lock.lock().expect("re-enter");
    let pttl: i64 = con.pttl("lease").expect("PTTL");
    assert!(pttl > 300, "re-entry refreshed the lease: {pttl}");
    assert!(inner.is_held().expect("is_held"));
    drop(inner);
    assert!(wait_until(Duration::from_secs(3), || {
        let exists: bool = con.exists("lease").expect("EXISTS");
        !exists
    }));
    match outer.unlock() {
        Err(Error::NotHeld { reason, .. }) => assert_eq!(reason, LossReason::Expired),
        other => panic!("expected NotHeld(Expired), got {other:?}"),
    }
}

#[test]
fn extend_is_owner_checked_and_wrong_types_are_named() {
    let server = RedisServer::start();
    let mut con = server.conn();
    let client = server.lock_client();
    let mut guard = ReentrantLock::with_options(
        &client,
        "ext",
        redmutex::Options::default().ttl(Duration::from_secs(1)),
    )
    .lock()
    .expect("lock");
    guard.extend(Duration::from_secs(60)).expect("extend");
    let pttl: i64 = con.pttl("ext").expect("PTTL");
    assert!(pttl > 59_000);
    let _: () = con.del("ext").expect("DEL");
    let _: () = con
        .hset_multiple("ext", &[("owner", "someone:1"), ("h:x", "1")])
        .expect("HSET");
    let err = guard.extend(Duration::from_secs(60)).expect_err("taken");
    assert_eq!(err.not_held_reason(), Some(LossReason::OwnedByOther));
    assert_eq!(
        guard.unlock().expect_err("not ours").not_held_reason(),
        Some(LossReason::OwnedByOther)
    );
    let kept: i64 = con.hget("ext", "h:x").expect("HGET");
    assert_eq!(kept, 1, "the other owner's hold is untouched");

    // A plain lock's key is a string: not a reentrant lock.
    let plain = DistributedLock::new(&client, "plain").lock().expect("lock");
    match ReentrantLock::new(&client, "plain").try_lock() {
        Err(Error::WrongType { key }) => assert_eq!(key, "plain"),
        other => panic!("expected WrongType, got {other:?}"),
    }
    drop(plain);
}

#[test]
fn a_loss_an_extension_finds_is_reported() {
    let server = RedisServer::start();
    let mut con = server.conn();
    let client = server.lock_client();
    let lock = ReentrantLock::new(&client, "lost");
    let mut guard = lock.lock().expect("lock");
    let signal = guard.loss_signal();
    assert!(!guard.is_lost());
    assert!(signal.reason().is_none());
    let _: () = con.del("lost").expect("DEL");
    let err = guard.extend(Duration::from_secs(60)).expect_err("gone");
    assert_eq!(err.not_held_reason(), Some(LossReason::Expired));
    assert!(guard.is_lost());
    assert_eq!(guard.validity(), Duration::ZERO);
    assert_eq!(
        signal.wait_timeout(Duration::from_secs(1)),
        Some(redmutex::LossReason::Expired)
    );
    assert!(
        !con.exists::<_, bool>("lost").expect("EXISTS"),
        "not re-created"
    );
    drop(guard);

    // Taken by another owner: OwnedByOther.
    let mut guard = lock.lock().expect("lock");
    let _: () = con.del("lost").expect("DEL");
    let _: () = con
        .hset_multiple("lost", &[("owner", "someone:1"), ("h:x", "1")])
        .expect("HSET");
    let err = guard.extend(Duration::from_secs(60)).expect_err("taken");
    assert_eq!(err.not_held_reason(), Some(LossReason::OwnedByOther));
    assert_eq!(
        guard.loss_signal().reason(),
        Some(redmutex::LossReason::OwnedByOther)
    );
    drop(guard);
    let kept: i64 = con.hget("lost", "h:x").expect("HGET");
    assert_eq!(kept, 1, "the other owner's hold is untouched");
}

/// Waiting is by notify: a waiter of another client is woken by the
/// release message, long before its backoff step or the holder's ttl.
#[test]
fn a_waiter_is_woken_by_the_release_message() {
    let server = RedisServer::start();
    let holder_client = server.lock_client();
    let waiter_client = server.lock_client();
    let slow = redmutex::Options::default()
        .ttl(Duration::from_secs(30))
        .backoff(redmutex::Backoff::constant(Duration::from_secs(8)));
    let guard = ReentrantLock::with_options(&holder_client, "notified", slow)
        .lock()
        .expect("lock");
    let waiter = std::thread::spawn(move || {
        let lock = ReentrantLock::with_options(&waiter_client, "notified", slow);
        let started = std::time::Instant::now();
        let got = lock.try_lock_for(Duration::from_secs(20)).expect("wait");
        (got.map(|guard| guard.unlock()), started.elapsed())
    });
    // The waiter is subscribed once its first attempt was refused.
    assert!(wait_until(Duration::from_secs(5), || {
        support::numsub(&server, &holder_client.release_channel("notified")) > 0
    }));
    std::thread::sleep(Duration::from_millis(100));
    let released = std::time::Instant::now();
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    let (got, waited) = waiter.join().expect("waiter");
    assert!(matches!(got, Some(Ok(Unlocked::Released))), "{got:?}");
    let after = released.elapsed();
    assert!(
        after < Duration::from_secs(4),
        "woken {after:?} after the release (waited {waited:?}): by the message, not the 8 s backoff"
    );
}

/// A thread that holds the key re-enters at once, even while threads of
/// its client queue for the key.
#[test]
fn a_holder_re_enters_past_its_clients_queue() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = ReentrantLock::new(&client, "queued");
    let outer = lock.lock().expect("lock");
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let lock = lock.clone();
            std::thread::spawn(move || {
                lock.try_lock_for(Duration::from_secs(20))
                    .expect("wait")
                    .map(|guard| guard.unlock())
            })
        })
        .collect();
    assert!(wait_until(Duration::from_secs(5), || {
        support::numsub(&server, &client.release_channel("queued")) > 0
    }));
    std::thread::sleep(Duration::from_millis(50));
    let started = std::time::Instant::now();
    let inner = lock
        .try_lock_for(Duration::from_secs(5))
        .expect("re-enter")
        .expect("held by this thread");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "re-entered after {:?}",
        started.elapsed()
    );
    assert_eq!(inner.depth(), 2);
    assert_eq!(inner.unlock().expect("unlock"), Unlocked::StillHeld);
    assert_eq!(outer.unlock().expect("unlock"), Unlocked::Released);
    for waiter in waiters {
        let got = waiter.join().expect("waiter");
        assert!(matches!(got, Some(Ok(Unlocked::Released))), "{got:?}");
    }
}

/// A loss found through one guard of a thread's hold is the hold's: the
/// thread's other guards of the key read it too.
#[test]
fn a_loss_found_through_one_guard_is_every_guard_of_the_hold() {
    let server = RedisServer::start();
    let mut con = server.conn();
    let client = server.lock_client();
    let lock = ReentrantLock::with_options(
        &client,
        "shared-loss",
        redmutex::Options::default().ttl(Duration::from_secs(30)),
    );
    let outer = lock.lock().expect("lock");
    let mut inner = lock.lock().expect("again");
    let signal = outer.loss_signal();
    let _: () = con.del("shared-loss").expect("DEL");
    let _: () = con
        .hset_multiple("shared-loss", &[("owner", "someone:1"), ("h:x", "1")])
        .expect("HSET");
    let err = inner.extend(Duration::from_secs(30)).expect_err("taken");
    assert_eq!(err.not_held_reason(), Some(LossReason::OwnedByOther));
    assert!(outer.is_lost(), "the outer guard of the same hold");
    assert_eq!(outer.validity(), Duration::ZERO);
    assert_eq!(signal.reason(), Some(LossReason::OwnedByOther));
    drop(inner);
    drop(outer);
    let _: () = con.del("shared-loss").expect("DEL");
    // A fresh hold afterwards starts with no loss.
    let fresh = lock.lock().expect("lock");
    assert!(!fresh.is_lost());
    assert!(fresh.validity() > Duration::from_secs(20));
    assert_eq!(fresh.unlock().expect("unlock"), Unlocked::Released);
}

/// A guard found lost never answers "still held", even when a fresh hold
/// of the same owner (this thread) is in the hash.
#[test]
fn a_lost_guard_says_not_held_beside_a_fresh_hold() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = ReentrantLock::new(&client, "lost-then-fresh");
    let mut old = lock.lock().expect("lock");
    let _: () = server.conn().del("lost-then-fresh").expect("DEL");
    assert!(old.extend(Duration::from_secs(30)).is_err());
    assert!(old.is_lost());
    let fresh = lock.lock().expect("a fresh hold");
    assert!(
        !fresh.is_lost(),
        "the fresh hold does not share the old loss"
    );
    let unlocked = old.unlock();
    assert!(
        matches!(
            unlocked,
            Err(Error::NotHeld {
                reason: LossReason::Expired,
                ..
            })
        ),
        "{unlocked:?}"
    );
    assert!(
        fresh.is_held().expect("is_held"),
        "the fresh hold untouched"
    );
    assert_eq!(fresh.unlock().expect("unlock"), Unlocked::Released);
}
