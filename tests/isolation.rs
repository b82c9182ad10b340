//! One sick server never harms the rest of the process: a server that
//! accepts connections and never answers (through the fault-injecting
//! proxy) is hammered by callers in one thread group while, in the same
//! process, clients of healthy servers lock and unlock, a RedLock with one
//! node of three stalled keeps its quorum, and a watched lease on a healthy
//! server whose links were reset keeps being renewed.

use redmutex_test_support as support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use redmutex::Lease;
use redmutex::{DistributedLock, LockClient, LockOptions, RedLock};
use support::{FaultProxy, RedisServer};

/// The I/O timeout of every client here.
const T: Duration = Duration::from_millis(400);

fn client(url: &str) -> LockClient {
    LockClient::builder()
        .url(url)
        .timeout(T)
        .build()
        .expect("client")
}

/// Callers of the stalled server, as many as it takes to fill any shared
/// connection-opening capacity, until `stop`.
fn hammer(url: String, stop: Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<()>> {
    let sick = client(&url);
    (0..6)
        .map(|i| {
            let (sick, stop) = (sick.clone(), stop.clone());
            std::thread::spawn(move || {
                let lock = DistributedLock::with_options(
                    &sick,
                    format!("sick-{i}"),
                    LockOptions::default().wait(Duration::from_millis(200)),
                );
                // Bounded: each call returns within its own bounds, and
                // the loop ends when the test does (or after 2,000 calls).
                for _ in 0..2_000 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let _ = lock.try_lock();
                }
            })
        })
        .collect()
}

#[test]
fn a_stalled_server_delays_nobody_else() {
    let _serial = support::serial();
    let sick_server = RedisServer::start();
    let sick = FaultProxy::to(&sick_server);
    sick.swallow_new(true);
    let stop = Arc::new(AtomicBool::new(false));
    let callers = hammer(sick.url(), stop.clone());
    // Let the stalled connects pile up.
    std::thread::sleep(T * 2);

    // A client of a healthy server, made after the stall began.
    let healthy = RedisServer::start();
    let fine = client(&healthy.url());
    let lock = DistributedLock::new(&fine, "fine");
    let mut slowest = Duration::ZERO;
    let mut failures = Vec::new();
    for _ in 0..50 {
        let started = Instant::now();
        match lock.try_lock() {
            Ok(Some(guard)) => {
                if let Err(err) = guard.unlock() {
                    failures.push(err.to_string());
                }
            }
            Ok(None) => failures.push("held".into()),
            Err(err) => failures.push(err.to_string()),
        }
        slowest = slowest.max(started.elapsed());
    }

    // A RedLock of three nodes, one of them the stalled server: the other
    // two are a quorum.
    let nodes = RedisServer::start_many(2);
    let mut clients: Vec<LockClient> = nodes.iter().map(|n| client(&n.url())).collect();
    clients.push(client(&sick.url()));
    let redlock = RedLock::with_options(
        clients,
        "quorum",
        redmutex::Options::default().ttl(Duration::from_secs(10)),
    )
    .expect("redlock");
    let mut redlock_failures = Vec::new();
    for _ in 0..5 {
        match redlock.try_lock() {
            Ok(Some(guard)) => {
                let _ = guard.unlock();
            }
            Ok(None) => redlock_failures.push("held".to_owned()),
            Err(err) => redlock_failures.push(err.to_string()),
        }
    }

    // A watched lease on a healthy server whose links are all reset: it is
    // renewed on fresh connections, opened while the stall goes on.
    let link = FaultProxy::to(&healthy);
    let watched_client = client(&link.url());
    let ttl = Duration::from_millis(1200);
    let guard = support::watched_lock(&watched_client, "watched", ttl);
    link.reset_all();
    let renewals_before = watched_client.stats().renewals;
    // Three ttls: with no renewal it would be lost in the first.
    let lost = support::wait_until(ttl * 3, || guard.is_lost());
    let renewed = watched_client
        .stats()
        .renewals
        .saturating_sub(renewals_before);

    stop.store(true, Ordering::Relaxed);
    for caller in callers {
        let _ = caller.join();
    }
    sick.swallow_new(false);

    assert!(
        failures.is_empty(),
        "the healthy client failed: {failures:?}"
    );
    // Its calls never waited for a connect of another client: each took
    // a round trip or two on loopback, far below one connect timeout.
    assert!(slowest < T / 2, "the healthy client waited {slowest:?}");
    assert!(
        redlock_failures.is_empty(),
        "the RedLock lost its quorum: {redlock_failures:?}"
    );
    assert!(
        !lost,
        "the watched lease was reported lost ({renewed} renewals)"
    );
    assert!(renewed >= 2, "renewed {renewed} times in three ttls");
    guard.unlock().expect("unlock");
}

/// On a cluster, a primary that stalls (SIGSTOP, shorter than the
/// cluster's node timeout so the cluster stays up) costs no lease on the
/// other primaries: renewals go per node, in parallel, each within its own
/// leases' time, and the one that lacks its scripts after `SCRIPT FLUSH`
/// has them loaded on it alone, not on the stalled node too.
#[test]
fn a_stalled_cluster_primary_costs_no_lease_on_the_others() {
    let _serial = support::serial();
    let cluster = support::RedisCluster::start_with_node_timeout(3, 0, 30_000);
    let keys = cluster.key_per_primary("iso");
    let client = LockClient::builder()
        .cluster(cluster.urls())
        .timeout(T)
        .build()
        .expect("client");
    // Idle links in the pool, opened while every node answered: the first
    // link opened while the first seed stalls pays that seed's timeout
    // (the documented connect bound on a cluster), which the renewal
    // groups of the healthy nodes should not need to pay.
    let warm: Vec<_> = (0..6).map(|_| support::connection_of(&client)).collect();
    drop(warm);
    let ttl = Duration::from_millis(1500);
    let guards: Vec<_> = keys
        .iter()
        .map(|key| support::watched_lock(&client, key, ttl))
        .collect();
    // A round of renewals first: where each slot's renewals go is learned.
    assert!(
        support::wait_until(ttl * 2, || client.stats().renewals >= 6),
        "{:?}",
        client.stats()
    );
    let healthy = cluster.primary_for(&keys[0]);
    let stalled = cluster.primary_for(&keys[1]);
    let third = cluster.primary_for(&keys[2]);
    let loads_elsewhere = third.command_calls("script|load");
    let loads_here = healthy.command_calls("script|load");
    redis::cmd("SCRIPT")
        .arg("FLUSH")
        .exec(&mut healthy.conn())
        .expect("SCRIPT FLUSH");
    stalled.signal("STOP");
    let renewals = client.stats().renewals;
    // Two ttls: with no renewal the healthy leases would be lost in one.
    let lost = support::wait_until(ttl * 2, || guards[0].is_lost() || guards[2].is_lost());
    let renewed = client.stats().renewals.saturating_sub(renewals);
    stalled.signal("CONT");
    assert!(
        !lost,
        "a lease on a healthy primary was reported lost ({renewed} renewals; {:?})",
        client.stats()
    );
    for (guard, key) in [(&guards[0], &keys[0]), (&guards[2], &keys[2])] {
        assert!(guard.is_held().expect("is_held"), "{key}");
    }
    // The scripts went back to the node that lost them, and nowhere else.
    assert!(healthy.command_calls("script|load") > loads_here);
    assert_eq!(third.command_calls("script|load"), loads_elsewhere);
    let mut guards = guards;
    for guard in guards.drain(..) {
        let _ = guard.unlock();
    }
}

/// Lets a stopped server go on when the test ends, however it ends.
struct Continue<'a>(&'a support::RedisServer);

impl Drop for Continue<'_> {
    fn drop(&mut self) {
        self.0.signal("CONT");
    }
}

/// Connections a server has accepted so far.
fn accepted(server: &support::RedisServer) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query(&mut server.conn())
        .expect("INFO stats");
    info.lines()
        .find_map(|line| line.strip_prefix("total_connections_received:"))
        .and_then(|count| count.trim().parse().ok())
        .expect("total_connections_received")
}

/// On a cluster, a new pooled link never waits for a stalled node: it is
/// opened from a seed that answers (once an opening has found the first
/// seed stalled, later ones start from the seed that answered) and opens
/// the other nodes only when a request goes to them; a reply lost on the
/// stalled node closes that node's socket only, and the same link goes on
/// serving the healthy primaries without connecting to them again.
#[test]
fn a_new_cluster_link_never_waits_for_a_stalled_node() {
    let _serial = support::serial();
    let cluster = support::RedisCluster::start_with_node_timeout(3, 0, 30_000);
    let keys = cluster.key_per_primary("fresh");
    let healthy = cluster.primary_for(&keys[0]);
    let stalled = cluster.primary_for(&keys[1]);
    // The stalled node is the first seed.
    let mut seeds = vec![stalled.url()];
    seeds.extend(
        cluster
            .urls()
            .into_iter()
            .filter(|url| *url != stalled.url()),
    );
    stalled.signal("STOP");
    let _continue = Continue(stalled);
    let client = LockClient::builder()
        .cluster(seeds)
        .timeout(T)
        .pool_size(8)
        .build()
        .expect("client");
    // The first opening tries the stalled seed: one timeout, then the next.
    let first = support::connection_of(&client);
    drop(first);
    // Every later opening starts from the seed that answered, and none
    // connects to the stalled node.
    let mut links = Vec::new();
    let mut slowest = Duration::ZERO;
    for _ in 0..6 {
        let started = Instant::now();
        links.push(client.connection().expect("a new link"));
        slowest = slowest.max(started.elapsed());
    }
    assert!(
        slowest < T / 2,
        "opening a link took {slowest:?} with one node stalled (timeout {T:?})"
    );
    drop(links);
    // Locks on the healthy primaries, each on a link that may be new.
    for key in [&keys[0], &keys[2]] {
        let lock = DistributedLock::new(&client, key.as_str());
        let started = Instant::now();
        let guard = lock.try_lock().expect("try_lock").expect("free");
        guard.unlock().expect("unlock");
        assert!(started.elapsed() < T / 2, "{key}: {:?}", started.elapsed());
    }
    // One link only from here on: a request to the stalled node loses its
    // reply on it; the link goes back to the pool and serves the healthy
    // primary without connecting to it again.
    let client = LockClient::builder()
        .cluster(cluster.urls())
        .timeout(T)
        .pool_size(1)
        .build()
        .expect("client");
    let get = |key: &str| {
        let mut con = support::connection_of(&client);
        redis::cmd("GET").arg(key).query::<Option<String>>(&mut con)
    };
    get(&keys[0]).expect("GET on a healthy primary");
    let before = accepted(healthy);
    let lost = get(&keys[1]);
    assert!(lost.is_err(), "GET on a stopped primary: {lost:?}");
    let started = Instant::now();
    get(&keys[0]).expect("GET on a healthy primary");
    assert!(started.elapsed() < T / 2, "{:?}", started.elapsed());
    // One more: the query's own connection.
    assert_eq!(
        accepted(healthy),
        before + 1,
        "the healthy primary was connected to again after a reply lost on another"
    );
}
