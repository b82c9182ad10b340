//! The lock through Redis Sentinel: a primary, a replica and three
//! sentinels on free loopback ports; the primary is killed and the client
//! follows the promoted replica.

use redmutex_test_support as support;

use std::time::{Duration, Instant};

use redmutex::Lease;
use redmutex::{Backoff, Deployment, DistributedLock, Error, LockClient, LockOptions, Semaphore};
use support::{RedisServer, SentinelSet, wait_until};

fn options() -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_secs(10))
}

/// [`support::release_wakes_waiter`], watching the primary the sentinels
/// name now.
fn release_wakes_waiter(
    set: &SentinelSet,
    holder: &LockClient,
    waiter: &LockClient,
    key: &str,
) -> Duration {
    let port = set.primary_port().expect("a primary");
    let primary = if port == set.primary.port() {
        &set.primary
    } else {
        &set.replica
    };
    support::release_wakes_waiter(holder, waiter, key, |channel| {
        support::numsub(primary, channel) > 0
    })
}

#[test]
fn the_client_follows_a_failover_after_the_primary_is_killed() {
    let mut set = SentinelSet::start();
    let client = set.lock_client();
    let waiter = set.lock_client();
    assert_eq!(client.deployment(), Deployment::Sentinel);
    let lock = DistributedLock::with_options(&client, "nightly", options());
    let guard = lock.lock().expect("lock on the first primary");
    assert!(guard.is_held().expect("is_held"));
    guard.unlock().expect("unlock");
    let waited = release_wakes_waiter(&set, &client, &waiter, "notify");
    assert!(
        waited < Duration::from_secs(5),
        "woken by the message: {waited:?}"
    );

    let old = set.primary.port();
    set.primary.kill();
    let promoted = wait_until(Duration::from_secs(60), || {
        set.primary_port() == Some(set.replica.port())
            && set.replica.role().as_deref() == Some("master")
    });
    assert!(
        promoted,
        "the sentinels promoted the replica (old primary {old})"
    );

    // The same client: its pooled connections to the dead primary fail, and
    // new ones go where the sentinels point.
    let guard = lock.lock().expect("lock on the promoted replica");
    assert!(guard.is_held().expect("is_held"));
    let value: Option<String> = redis::cmd("GET")
        .arg("nightly")
        .query(&mut set.replica.conn())
        .expect("GET on the new primary");
    assert_eq!(value.as_deref(), Some(guard.token()));
    guard.unlock().expect("unlock");

    // The subscriber connection asked the sentinels again too.
    let waited = release_wakes_waiter(&set, &client, &waiter, "notify");
    assert!(
        waited < Duration::from_secs(5),
        "woken by the message after the failover: {waited:?}"
    );

    // A semaphore on the promoted primary: a waiter in another client gets
    // the permit when it is given back (woken, not after the 30 s lease).
    let one = Semaphore::with_options(
        &client,
        "sem",
        1,
        options().with_extra(redmutex::SemaphoreExtra::default()),
    );
    let permit = one.acquire().expect("a permit on the promoted replica");
    let fields: usize = redis::cmd("HLEN")
        .arg("sem")
        .query(&mut set.replica.conn())
        .expect("HLEN on the new primary");
    assert_eq!(fields, 2, "the permit and the limit");
    let other = Semaphore::with_options(
        &waiter,
        "sem",
        1,
        options()
            .with_extra(redmutex::SemaphoreExtra::default())
            .backoff(Backoff::constant(Duration::from_secs(20))),
    );
    let waiting = std::thread::spawn(move || {
        let asked = Instant::now();
        let permit = other.try_acquire_for(Duration::from_secs(15));
        (permit.map(|p| p.is_some()), asked.elapsed())
    });
    let channel = waiter.release_channel("sem");
    assert!(wait_until(Duration::from_secs(5), || support::numsub(
        &set.replica,
        &channel
    ) > 0));
    permit.release().expect("release");
    let (got, waited) = waiting.join().expect("waiter");
    assert_eq!(got.ok(), Some(true));
    assert!(waited < Duration::from_secs(10), "woken: {waited:?}");
}

#[test]
fn min_replicas_is_met_through_sentinel() {
    let set = SentinelSet::start();
    let client = set.lock_client();
    let lock = DistributedLock::with_options(
        &client,
        "replicated",
        options().min_replicas(1, Duration::from_secs(1)),
    );
    let guard = lock.lock().expect("a replica acknowledged");
    let on_replica = wait_until(Duration::from_secs(5), || {
        redis::cmd("GET")
            .arg("replicated")
            .query::<Option<String>>(&mut set.replica.conn())
            .ok()
            .flatten()
            .as_deref()
            == Some(guard.token())
    });
    assert!(on_replica, "the replica has the key");
    guard.unlock().expect("unlock");

    // A permit: WAIT after the grant, on the primary the sentinels name.
    let semaphore = Semaphore::with_options(
        &client,
        "replicated-sem",
        2,
        options()
            .with_extra(redmutex::SemaphoreExtra::default())
            .fencing(true)
            .min_replicas(1, Duration::from_secs(1)),
    );
    let permit = semaphore.acquire().expect("a replica acknowledged");
    let field = format!("p:{}", permit.id());
    let deadline: Option<u64> = redis::cmd("HGET")
        .arg("replicated-sem")
        .arg(&field)
        .query(&mut set.replica.conn())
        .expect("HGET on the replica");
    assert!(deadline.is_some(), "acknowledged: the replica has it");
    assert!(permit.fencing_token().is_some_and(support::clock_floored));
    // `list` reads the primary the sentinels name.
    let listing = client.list("*", Duration::from_secs(10)).expect("list");
    assert!(listing.complete);
    assert_eq!(listing.held.len(), 1, "{listing:?}");
    assert_eq!(listing.held[0].key, "replicated-sem");
    assert_eq!(listing.held[0].limit, Some(2));
    permit.release().expect("release");
}

#[test]
fn bad_sentinel_input_gets_clear_errors() {
    assert!(matches!(
        LockClient::builder()
            .sentinel(Vec::<String>::new(), "m")
            .build(),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        LockClient::builder().sentinel(["::"], "m").build(),
        Err(Error::InvalidArgument(_))
    ));
    // Sentinels that do not know the name: an error within the timeout, not
    // a hang.
    let sentinel = RedisServer::start();
    let client = LockClient::builder()
        .sentinel([sentinel.url()], "nobody")
        .sentinel_primary(Default::default())
        .timeout(Duration::from_millis(500))
        .build()
        .expect("client");
    let started = Instant::now();
    let outcome = DistributedLock::new(&client, "k").try_lock();
    assert!(outcome.is_err(), "{outcome:?}");
    // One connect's wait (T per sentinel asked, one here, plus T), and a
    // slack below the timeout.
    let (took, limit) = (started.elapsed(), Duration::from_millis(1300));
    eprintln!("bound | sentinels without the name: the error | {took:?} | limit {limit:?}");
    assert!(took < limit, "{took:?}");
}

#[test]
fn a_manual_failover_with_the_old_primary_alive_is_followed() {
    let set = SentinelSet::start();
    let client = set.lock_client();
    let lock = DistributedLock::with_options(&client, "manual", options());
    // Several pooled connections to the first primary.
    let guards: Vec<_> = (0..4)
        .map(|i| {
            DistributedLock::with_options(&client, format!("warm{i}"), options())
                .lock()
                .expect("lock")
        })
        .collect();
    drop(guards);
    lock.lock()
        .expect("lock before")
        .unlock()
        .expect("unlock before");

    redis::cmd("SENTINEL")
        .arg("FAILOVER")
        .arg(SentinelSet::MASTER)
        .exec(&mut set.sentinels[0].conn())
        .expect("SENTINEL FAILOVER");
    let switched = wait_until(Duration::from_secs(60), || {
        set.primary_port() == Some(set.replica.port())
            && set.primary.role().as_deref() == Some("slave")
    });
    assert!(switched, "the sentinels switched primaries");

    // The old primary is alive and read-only now; Sentinel disconnected its
    // clients, so the pooled connections are replaced, not reused.
    let guard = lock.lock().expect("lock on the new primary");
    let on_new: Option<String> = redis::cmd("GET")
        .arg("manual")
        .query(&mut set.replica.conn())
        .expect("GET");
    assert_eq!(on_new.as_deref(), Some(guard.token()));
    guard.unlock().expect("unlock on the new primary");
    for i in 0..4 {
        DistributedLock::with_options(&client, format!("warm{i}"), options())
            .lock()
            .expect("every pooled connection works")
            .unlock()
            .expect("unlock");
    }
}

/// A stalled sentinel first in the list (it accepts and never answers):
/// its lookup gives up after the timeout and the next sentinel is asked,
/// so the client still locks, within one timeout more.
#[test]
fn a_stalled_sentinel_is_passed_over() {
    let set = SentinelSet::start();
    let proxy = support::FaultProxy::to(&set.sentinels[0]);
    proxy.stall_new(true);
    let mut urls = vec![proxy.url()];
    urls.extend(set.sentinel_urls().into_iter().skip(1));
    let timeout = Duration::from_millis(500);
    let client = LockClient::builder()
        .sentinel(urls, SentinelSet::MASTER)
        .sentinel_primary(redis::RedisConnectionInfo::default())
        .timeout(timeout)
        .build()
        .expect("client");
    let started = Instant::now();
    let guard = DistributedLock::with_options(&client, "passed", options())
        .lock()
        .expect("lock through the other sentinels");
    assert!(started.elapsed() < timeout * 4, "{:?}", started.elapsed());
    guard.unlock().expect("unlock");
}
