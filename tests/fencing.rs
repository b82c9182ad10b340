//! Fencing tokens never go backwards, even across a failover that lost the
//! counter's last increments: every token is at least the server's clock in
//! microseconds (`TIME`), so the promoted server's first token is above
//! every token the old primary gave out, as long as its clock is not behind
//! the old primary's by more than the failover took.

use redmutex_test_support as support;

use std::time::Duration;

use redmutex::Lease;
use redmutex::{DistributedLock, LockClient, LockOptions, Semaphore, SemaphoreOptions};
use support::{RedisServer, SentinelSet, clock_floored, wait_until};

fn fenced() -> LockOptions {
    LockOptions::default().fencing(true)
}

/// Tokens from `count` acquisitions of `key` through `client`.
fn tokens(client: &LockClient, key: &str, count: usize) -> Vec<u64> {
    (0..count)
        .map(|_| {
            let guard = DistributedLock::with_options(client, key, fenced())
                .lock()
                .expect("fenced lock");
            let token = guard.fencing_token().expect("a token");
            guard.unlock().expect("unlock");
            token
        })
        .collect()
}

/// A replica cut off from its primary (`REPLICAOF NO ONE`) before the
/// primary gave out more tokens: its counter is behind, as a promoted
/// replica's is after an asynchronous failover. Its tokens still go up.
#[test]
fn a_promoted_replica_behind_on_the_counter_still_issues_larger_tokens() {
    let primary = RedisServer::start();
    let replica = RedisServer::start_replica_of(&primary);
    let old = primary.lock_client();
    let mut issued = tokens(&old, "job", 3);
    let counter = old.fence_key("job");
    assert!(
        wait_until(Duration::from_secs(10), || {
            replica.try_query::<Option<u64>>(redis::cmd("GET").arg(&counter))
                == Some(issued.last().copied())
        }),
        "the replica has the counter so far"
    );
    let _: () = replica
        .try_query(redis::cmd("REPLICAOF").arg("NO").arg("ONE"))
        .expect("REPLICAOF NO ONE");
    // Increments the promoted server never sees.
    issued.extend(tokens(&old, "job", 5));
    let behind: Option<u64> = replica.try_query(redis::cmd("GET").arg(&counter));
    assert!(
        behind < issued.last().copied(),
        "the cut lost increments: {behind:?} vs {issued:?}"
    );
    let new = replica.lock_client();
    issued.extend(tokens(&new, "job", 3));
    assert!(issued.iter().all(|t| clock_floored(*t)), "{issued:?}");
    assert!(
        issued.windows(2).all(|w| w[0] < w[1]),
        "a token went backwards across the promotion: {issued:?}"
    );
    // Fenced permits take the same floor.
    let options = SemaphoreOptions::default().fencing(true);
    let before = Semaphore::with_options(&old, "pool", 2, options)
        .acquire()
        .expect("permit on the old primary");
    let after = Semaphore::with_options(&new, "pool", 2, options)
        .acquire()
        .expect("permit on the promoted one");
    assert!(after.fencing_token() > before.fencing_token());
}

/// A Sentinel failover after the primary gave out tokens its replica
/// never received (the replication link blackholed, then cut, then the
/// primary killed): the client follows the failover and its next token is
/// above every earlier one.
#[test]
fn a_sentinel_failover_that_loses_increments_never_repeats_a_token() {
    let (mut set, link) = SentinelSet::start_with_replication_proxy();
    let client = set.lock_client();
    let mut issued = tokens(&client, "nightly", 3);
    let counter = client.fence_key("nightly");
    assert!(
        wait_until(Duration::from_secs(10), || {
            set.replica
                .try_query::<Option<u64>>(redis::cmd("GET").arg(&counter))
                == Some(issued.last().copied())
        }),
        "the replica has the counter so far"
    );
    link.blackhole(true);
    issued.extend(tokens(&client, "nightly", 5));
    // What the link held is thrown away, and the primary dies.
    link.reset_all();
    set.primary.kill();
    let promoted = wait_until(Duration::from_secs(60), || {
        set.primary_port() == Some(set.replica.port())
            && set.replica.role().as_deref() == Some("master")
    });
    assert!(promoted, "the sentinels promoted the replica");
    let behind: Option<u64> = set.replica.try_query(redis::cmd("GET").arg(&counter));
    assert!(
        behind < issued.last().copied(),
        "the failover lost increments: {behind:?} vs {issued:?}"
    );
    let after =
        DistributedLock::with_options(&client, "nightly", fenced().wait(Duration::from_secs(30)))
            .lock()
            .expect("lock on the promoted replica");
    issued.push(after.fencing_token().expect("a token"));
    after.unlock().expect("unlock");
    issued.extend(tokens(&client, "nightly", 2));
    assert!(
        issued.windows(2).all(|w| w[0] < w[1]),
        "a token repeated or went backwards across the failover: {issued:?}"
    );
}
