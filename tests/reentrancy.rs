//! Thread-local reentrancy: nested guards cost no Redis command, the lock is
//! released when the last guard of a hold goes, whatever the drop order.

use redmutex_test_support as support;

use std::time::Duration;

use redis::Commands;
use redmutex::Lease;
use redmutex::{DistributedLock, LockOptions};
use support::{RedisServer, wait_until};

fn get(server: &RedisServer, key: &str) -> Option<String> {
    server.conn().get(key).expect("GET")
}

/// Commands the lock itself sends (acquire and release).
fn lock_commands(server: &RedisServer) -> u64 {
    server.command_calls("set") + server.command_calls("evalsha") + server.command_calls("eval")
}

#[test]
fn nested_lock_is_immediate_and_sends_nothing() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::new(&client, "re");
    let outer = lock.lock().expect("outer");
    let sent = lock_commands(&server);
    let inner = lock.lock().expect("inner");
    let innermost = lock.try_lock().expect("try").expect("re-entered");
    let via_for = lock
        .try_lock_for(Duration::from_millis(10))
        .expect("for")
        .expect("re-entered");
    assert_eq!(lock_commands(&server), sent, "re-entry sends no command");
    assert_eq!(outer.depth(), 1);
    assert_eq!(inner.depth(), 2);
    assert_eq!(innermost.depth(), 3);
    assert_eq!(via_for.depth(), 4);
    assert_eq!(inner.token(), outer.token());
    drop(via_for);
    drop(innermost);
    drop(inner);
    assert_eq!(lock_commands(&server), sent, "inner releases send nothing");
    assert_eq!(get(&server, "re").as_deref(), Some(outer.token()));
    outer.unlock().expect("outer unlock");
    assert_eq!(
        get(&server, "re"),
        None,
        "the outermost guard releases in Redis"
    );
}

#[test]
fn clones_of_a_client_share_holds_but_other_clients_do_not() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let clone = client.clone();
    let stranger = server.lock_client();
    let guard = DistributedLock::new(&client, "who").lock().expect("lock");
    let nested = DistributedLock::new(&clone, "who")
        .try_lock()
        .expect("try")
        .expect("a clone re-enters");
    assert_eq!(nested.depth(), 2);
    // A client with other defaults is still the same client.
    let with_defaults = client
        .clone()
        .with_defaults(LockOptions::default().ttl(Duration::from_secs(1)));
    assert!(
        DistributedLock::new(&with_defaults, "who")
            .try_lock()
            .expect("try")
            .is_some()
    );
    // A separately opened client is a stranger, like another process.
    assert!(
        DistributedLock::new(&stranger, "who")
            .try_lock()
            .expect("try")
            .is_none()
    );
    // Other keys are independent.
    let other_key = DistributedLock::new(&client, "whom").lock().expect("lock");
    assert_eq!(other_key.depth(), 1);
    drop(nested);
    drop(guard);
    assert_eq!(get(&server, "who"), None);
}

#[test]
fn out_of_order_drops_keep_the_count() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::new(&client, "ooo");
    let outer = lock.lock().expect("outer");
    let token = outer.token().to_owned();
    let inner = lock.lock().expect("inner");
    drop(outer); // the outermost goes first
    assert_eq!(
        get(&server, "ooo").as_deref(),
        Some(token.as_str()),
        "still held"
    );
    assert!(inner.is_held().expect("is_held"));
    let again = lock.lock().expect("re-enter");
    assert_eq!(again.depth(), 2, "one live guard plus this one");
    assert_eq!(again.token(), token);
    assert_eq!(
        inner.unlock().expect("nested unlock gives up its share"),
        redmutex::Unlocked::StillHeld
    );
    assert_eq!(get(&server, "ooo").as_deref(), Some(token.as_str()));
    assert_eq!(
        again.unlock().expect("last guard releases"),
        redmutex::Unlocked::Released
    );
    assert_eq!(get(&server, "ooo"), None);
    let fresh = lock.lock().expect("fresh hold");
    assert_eq!(fresh.depth(), 1);
    assert_ne!(fresh.token(), token);
}

#[test]
fn other_threads_of_the_same_client_do_not_reenter() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let _guard = DistributedLock::new(&client, "thread")
        .lock()
        .expect("lock");
    let c = client.clone();
    let other = std::thread::spawn(move || {
        DistributedLock::new(&c, "thread")
            .try_lock()
            .map(|g| g.is_some())
    })
    .join()
    .expect("thread");
    assert!(!other.expect("try_lock"), "reentrancy is per thread");
}

#[test]
fn an_expired_hold_is_not_reentered() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::with_options(
        &client,
        "stale",
        LockOptions::default().ttl(Duration::from_millis(60)),
    );
    let old = lock.lock().expect("lock");
    assert!(wait_until(Duration::from_secs(2), || get(&server, "stale").is_none()));
    let fresh = lock.lock().expect("acquires anew");
    assert_eq!(fresh.depth(), 1);
    assert_ne!(fresh.token(), old.token());
    assert_eq!(get(&server, "stale").as_deref(), Some(fresh.token()));
    // Dropping the stale guard neither deletes the new lease nor forgets it.
    drop(old);
    assert_eq!(get(&server, "stale").as_deref(), Some(fresh.token()));
    let nested = lock
        .try_lock()
        .expect("try")
        .expect("re-enters the new lease");
    assert_eq!(nested.depth(), 2);
}

#[test]
fn extend_through_a_nested_guard_extends_the_hold() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::with_options(
        &client,
        "ext",
        LockOptions::default().ttl(Duration::from_millis(500)),
    );
    let outer = lock.lock().expect("outer");
    let mut inner = lock.lock().expect("inner");
    inner.extend(Duration::from_secs(30)).expect("extend");
    assert!(outer.validity() > Duration::from_secs(29), "shared lease");
    let pttl: i64 = server.conn().pttl("ext").expect("PTTL");
    assert!(pttl > 29_000);
}

/// A nested guard of a hold found lost does not say "still held": its
/// unlock answers with the loss.
#[test]
fn a_nested_unlock_after_a_loss_says_not_held() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let other = server.lock_client();
    let lock = DistributedLock::with_options(
        &client,
        "nested-lost",
        redmutex::LockOptions::default().ttl(Duration::from_secs(30)),
    );
    let outer = lock.lock().expect("lock");
    let mut inner = lock.lock().expect("nested");
    let _: () = redis::cmd("DEL")
        .arg("nested-lost")
        .query(&mut server.conn())
        .expect("DEL");
    let theirs = DistributedLock::new(&other, "nested-lost")
        .try_lock()
        .expect("try")
        .expect("free");
    let err = inner.extend(Duration::from_secs(30)).expect_err("lost");
    assert_eq!(
        err.not_held_reason(),
        Some(redmutex::LossReason::OwnedByOther)
    );
    let nested = inner.unlock();
    assert!(
        matches!(
            nested,
            Err(redmutex::Error::NotHeld {
                reason: redmutex::LossReason::OwnedByOther,
                ..
            })
        ),
        "{nested:?}"
    );
    assert!(outer.unlock().is_err(), "not ours any more");
    assert_eq!(
        theirs.unlock().expect("theirs"),
        redmutex::Unlocked::Released
    );
}
