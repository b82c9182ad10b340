//! Replica acknowledgement (`LockOptions::min_replicas`) and the failover
//! hazard it narrows. Replicas are extra redis-server processes started with
//! `--replicaof`.

use redmutex_test_support as support;

use std::time::{Duration, Instant};

use redis::Commands;
use redmutex::Lease;
use redmutex::{DistributedLock, Error, LockClient, LockOptions};
use support::RedisServer;

#[test]
fn min_replicas_succeeds_with_a_live_replica_and_fails_clean_without() {
    let primary = RedisServer::start();
    let replica = RedisServer::start_replica_of(&primary);
    let client = primary.lock_client();
    let options = LockOptions::default().min_replicas(1, Duration::from_millis(500));
    let lock = DistributedLock::with_options(&client, "replicated", options);
    let guard = lock.lock().expect("acknowledged by the replica");
    let on_replica: Option<String> = replica.conn().get("replicated").expect("GET");
    assert_eq!(
        on_replica.as_deref(),
        Some(guard.token()),
        "the replica has it"
    );
    guard.unlock().expect("unlock");

    replica.signal("STOP");
    let short = DistributedLock::with_options(
        &client,
        "replicated",
        LockOptions::default().min_replicas(1, Duration::from_millis(100)),
    );
    let started = Instant::now();
    let result = short.lock();
    let took = started.elapsed();
    replica.signal("CONT");
    match result {
        Err(Error::NotReplicated { key, acked, wanted }) => {
            assert_eq!((key.as_str(), acked, wanted), ("replicated", 0, 1));
        }
        other => panic!("expected NotReplicated, got {other:?}"),
    }
    assert!(took < Duration::from_secs(2), "no retry loop: {took:?}");
    let left: bool = primary.conn().exists("replicated").expect("EXISTS");
    assert!(!left, "a lock that did not replicate is released again");
}

#[test]
fn noreplicas_is_a_clear_error_without_a_retry_storm() {
    let primary = RedisServer::start_with(&["--min-replicas-to-write", "1"]);
    let client = primary.lock_client();
    let lock = DistributedLock::with_options(
        &client,
        "guarded",
        LockOptions::default().wait(Duration::from_secs(5)),
    );
    let started = Instant::now();
    match lock.lock() {
        Err(err @ Error::NoReplicas { .. }) => {
            assert!(err.to_string().contains("min-replicas-to-write"), "{err}");
        }
        other => panic!("expected NoReplicas, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "gave up at once"
    );
    // The client's one TIME (holder metadata), and one attempt.
    assert_eq!(client.stats().commands, 2, "one attempt, no storm");
}

#[test]
fn failover_to_a_replica_without_the_key_hands_the_lock_out_twice() {
    // The documented hazard ("Redis-based distributed locks and their pitfalls", §2.4): the replica is promoted before
    // it has the key, while a client still talks to the old primary. With
    // min_replicas off both clients hold the lock; with it on, the write
    // that no replica acknowledged is refused.
    let primary = RedisServer::start();
    let replica = RedisServer::start_replica_of(&primary);
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query(&mut replica.conn())
        .expect("promote the replica");
    let a = primary.lock_client(); // has not noticed the failover
    let b = LockClient::open(&replica.url()).expect("client of the new primary");

    let first = DistributedLock::new(&a, "job")
        .lock()
        .expect("A acquires on the old primary");
    let second = DistributedLock::new(&b, "job")
        .try_lock()
        .expect("try_lock")
        .expect("HAZARD: B acquires the lock A believes it holds");
    assert!(first.validity() > Duration::ZERO && second.validity() > Duration::ZERO);
    assert_ne!(first.token(), second.token());
    drop(first);

    let careful = DistributedLock::with_options(
        &a,
        "job2",
        LockOptions::default().min_replicas(1, Duration::from_millis(100)),
    );
    match careful.lock() {
        Err(Error::NotReplicated {
            acked: 0,
            wanted: 1,
            ..
        }) => {}
        other => panic!("expected NotReplicated from the orphaned primary, got {other:?}"),
    }
    let left: bool = primary.conn().exists("job2").expect("EXISTS");
    assert!(!left);
}

/// A `WAIT` timeout just below the client's I/O timeout, on a slow link:
/// the server holds the WAIT for its whole timeout, and the reply crosses
/// the link after that. The read must wait for the server's wait *and* the
/// link, or a lock that was simply not replicated is reported as "outcome
/// unknown" (CI saw exactly that from a 1.95 s WAIT under a 2 s timeout on
/// a loaded machine).
#[test]
fn a_wait_close_to_the_io_timeout_is_not_a_lost_reply() {
    let server = RedisServer::start();
    let proxy = support::FaultProxy::to(&server);
    let client = LockClient::builder()
        .url(proxy.url())
        .timeout(Duration::from_millis(400))
        .build()
        .expect("client through the proxy");
    let lock = DistributedLock::with_options(
        &client,
        "slow-wait",
        LockOptions::default().min_replicas(1, Duration::from_millis(350)),
    );
    // Every reply arrives 100 ms late: 350 ms of WAIT plus 100 ms is past
    // the 400 ms timeout.
    proxy.set_latency(Duration::ZERO, Duration::from_millis(100));
    let result = lock.try_lock();
    proxy.set_latency(Duration::ZERO, Duration::ZERO);
    match result {
        Err(Error::NotReplicated { acked, wanted, .. }) => assert_eq!((acked, wanted), (0, 1)),
        other => panic!("expected NotReplicated, got {other:?}"),
    }
    let left: bool = server.conn().exists("slow-wait").expect("EXISTS");
    assert!(!left, "a lock that did not replicate is released again");
}
