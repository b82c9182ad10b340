//! Managed-Redis honesty: a server that refuses a command the crate needs
//! (renamed away, as serverless and proxy services do) gives a clear
//! `Error::Unsupported` naming the command and what needs it, and leaves
//! nothing behind; without pub/sub, waiting falls back to backoff.

use redmutex_test_support as support;

use std::time::Duration;

use redmutex::Lease;
use redmutex::{DistributedLock, Error, LockOptions, Semaphore};
use support::{RedisServer, exists, wait_until};

#[test]
fn without_pub_sub_waiters_poll_and_releases_succeed() {
    let server = RedisServer::start_with(&[
        "--rename-command",
        "SUBSCRIBE",
        "",
        "--rename-command",
        "PUBLISH",
        "",
    ]);
    let holder = server.lock_client();
    let waiter = server.lock_client();
    let options = LockOptions::default().wait(Duration::from_secs(10));
    let guard = DistributedLock::with_options(&holder, "k", options)
        .lock()
        .expect("lock");
    let waiting = std::thread::spawn({
        let lock = DistributedLock::with_options(&waiter, "k", options);
        move || lock.lock().map(|guard| guard.unlock())
    });
    // Released only once the waiter has asked Redis again after its first
    // try: it is waiting, by polling.
    assert!(wait_until(Duration::from_secs(5), || waiter
        .stats()
        .commands
        >= 2));
    guard
        .unlock()
        .expect("a release without PUBLISH is still a release");
    waiting
        .join()
        .expect("waiter")
        .expect("the waiter got it by polling")
        .expect("unlock");
    assert_eq!(waiter.stats().notifications, 0, "no message could come");

    let sem = Semaphore::with_options(
        &holder,
        "s",
        1,
        options.with_extra(redmutex::SemaphoreExtra::default()),
    );
    let permit = sem.acquire().expect("permit");
    permit.release().expect("released without PUBLISH");
    assert!(!exists(&server, "s"));
}

#[test]
fn a_refused_wait_names_wait_and_min_replicas_and_leaves_nothing() {
    let server = RedisServer::start_with(&["--rename-command", "WAIT", ""]);
    let client = server.lock_client();
    let options = LockOptions::default().min_replicas(1, Duration::from_millis(50));
    let err = DistributedLock::with_options(&client, "k", options)
        .try_lock()
        .expect_err("WAIT refused");
    match &err {
        Error::Unsupported {
            command, needed_by, ..
        } => {
            assert!(command.eq_ignore_ascii_case("wait"), "{err}");
            assert!(needed_by.contains("min_replicas"), "{err}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(err.kind(), "unsupported");
    // Given back by the client's cleanup, in the background.
    assert!(
        wait_until(Duration::from_secs(5), || !exists(&server, "k")),
        "the lock was given back"
    );

    let sem = Semaphore::with_options(
        &client,
        "s",
        2,
        redmutex::SemaphoreOptions::default().min_replicas(1, Duration::from_millis(50)),
    );
    let err = sem.try_acquire().expect_err("WAIT refused");
    assert!(matches!(err, Error::Unsupported { .. }), "{err:?}");
    assert!(
        wait_until(Duration::from_secs(5), || !exists(&server, "s")),
        "the permit was given back"
    );
}

#[test]
fn a_server_without_scripts_is_told_apart_from_a_failing_one() {
    let server = RedisServer::start_with(&["--rename-command", "SCRIPT", ""]);
    let client = server.lock_client();
    let fenced = DistributedLock::with_options(&client, "k", LockOptions::default().fencing(true));
    let err = fenced.try_lock().expect_err("no scripts");
    match &err {
        Error::Unsupported {
            command, needed_by, ..
        } => {
            assert!(command.eq_ignore_ascii_case("script"), "{err}");
            assert!(needed_by.contains("Lua scripts"), "{err}");
        }
        other => panic!("{other:?}"),
    }
    assert!(!exists(&server, "k"), "nothing was set");
    assert!(!err.is_connection(), "no retry fixes it");

    // The plain lock's quick `SET NX` needs no script; its release falls
    // back to WATCH/MULTI instead of leaving the key for its ttl.
    let plain = DistributedLock::new(&client, "plain");
    let guard = plain.try_lock().expect("try").expect("SET NX");
    guard.unlock().expect("released without a script");
    assert!(!exists(&server, "plain"));
    drop(plain.try_lock().expect("try").expect("again"));
    assert!(!exists(&server, "plain"), "dropped: released the same way");
}
