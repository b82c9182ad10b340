//! Every bound the failure model (docs/failure-model.md) states, forced with the worst
//! fault it lists and checked over ten runs: each test prints its worst
//! case beside its limit (`cargo test --test bounds -- --nocapture`).
//!
//! Limits are the documented bound plus a slack named in each test: what a
//! debug build on a loaded 2-core machine adds in scheduling, never a
//! multiple of the bound.

use redmutex_test_support as support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redmutex::Lease;
use redmutex::{
    Backoff, DistributedLock, LockClient, LockOptions, ReentrantLock, RwLock, Semaphore,
};
use support::{FaultProxy, RedisServer, wait_until};

/// The I/O timeout of most clients here.
const T: Duration = Duration::from_millis(200);
/// The I/O timeout where a bound missed by one timeout must stand out
/// from the slack: the lock calls, `list`.
const LONG_T: Duration = Duration::from_millis(500);
/// The wait of every lock call here.
const WAIT: Duration = Duration::from_millis(100);
/// Runs per bound.
const RUNS: usize = 10;
/// What scheduling adds on a loaded 2-core machine to a call that ends on
/// a socket timeout, in a debug build: used with `LONG_T` (or longer), so
/// a bound missed by one timeout cannot hide in it.
const SLACK: Duration = Duration::from_millis(300);

fn client(url: &str) -> LockClient {
    LockClient::builder()
        .url(url)
        .timeout(T)
        .build()
        .expect("client")
}

fn options() -> LockOptions {
    LockOptions::default().ttl(Duration::from_secs(10))
}

/// The worst of `times`, printed beside `limit` and checked against it.
fn check(bound: &str, times: &[Duration], limit: Duration) {
    let worst = times.iter().max().copied().unwrap_or_default();
    eprintln!(
        "bound | {bound} | worst {worst:?} over {} runs | limit {limit:?}",
        times.len()
    );
    assert!(
        times.len() >= RUNS && worst < limit,
        "{bound}: {times:?} against {limit:?}"
    );
}

/// One lock call or release of one lock type, made while its server is
/// blackholed (requests go out, nothing comes back) after a healthy cycle
/// put a connection in the pool.
type Call = fn(&LockClient, &str, &FaultProxy) -> Duration;

fn timed_blackholed(proxy: &FaultProxy, call: impl FnOnce()) -> Duration {
    proxy.blackhole(true);
    let started = Instant::now();
    call();
    let took = started.elapsed();
    proxy.heal();
    took
}

fn plain_lock(client: &LockClient, key: &str, proxy: &FaultProxy) -> Duration {
    let lock = DistributedLock::with_options(client, key, options());
    drop(lock.try_lock());
    timed_blackholed(proxy, || drop(lock.try_lock_for(WAIT)))
}

fn plain_unlock(client: &LockClient, key: &str, proxy: &FaultProxy) -> Duration {
    let lock = DistributedLock::with_options(client, key, options());
    let Ok(Some(guard)) = lock.try_lock_for(Duration::from_secs(5)) else {
        return Duration::MAX;
    };
    timed_blackholed(proxy, || drop(guard.unlock()))
}

fn reentrant_lock(client: &LockClient, key: &str, proxy: &FaultProxy) -> Duration {
    let lock = ReentrantLock::new(client, key);
    drop(lock.try_lock());
    timed_blackholed(proxy, || drop(lock.try_lock_for(WAIT)))
}

fn reentrant_unlock(client: &LockClient, key: &str, proxy: &FaultProxy) -> Duration {
    let lock = ReentrantLock::new(client, key);
    let Ok(Some(guard)) = lock.try_lock_for(Duration::from_secs(5)) else {
        return Duration::MAX;
    };
    timed_blackholed(proxy, || drop(guard.unlock()))
}

fn read_lock(client: &LockClient, key: &str, proxy: &FaultProxy) -> Duration {
    let lock = RwLock::new(client, key);
    drop(lock.try_read());
    timed_blackholed(proxy, || drop(lock.try_read_for(WAIT)))
}

/// The case the per-call bound once missed: a writer that waited leaves a
/// mark holding readers back, removed after its wait.
fn write_lock(client: &LockClient, key: &str, proxy: &FaultProxy) -> Duration {
    let lock = RwLock::new(client, key);
    drop(lock.try_write());
    timed_blackholed(proxy, || drop(lock.try_write_for(WAIT)))
}

fn rw_unlock(client: &LockClient, key: &str, proxy: &FaultProxy) -> Duration {
    let lock = RwLock::new(client, key);
    let Ok(Some(guard)) = lock.try_write_for(Duration::from_secs(5)) else {
        return Duration::MAX;
    };
    timed_blackholed(proxy, || drop(guard.unlock()))
}

fn acquire(client: &LockClient, key: &str, proxy: &FaultProxy) -> Duration {
    let semaphore = Semaphore::new(client, key, 2);
    drop(semaphore.try_acquire());
    timed_blackholed(proxy, || drop(semaphore.try_acquire_for(WAIT)))
}

fn release(client: &LockClient, key: &str, proxy: &FaultProxy) -> Duration {
    let semaphore = Semaphore::new(client, key, 2);
    let Ok(Some(permit)) = semaphore.try_acquire_for(Duration::from_secs(5)) else {
        return Duration::MAX;
    };
    timed_blackholed(proxy, || drop(permit.release()))
}

/// A lock call on a key held elsewhere until its deadline, whose last
/// attempt (at the deadline) must open a connection that stalls: the
/// pooled link was reset after the attempt before it, and new connections
/// get no answer. Spin waiting with a 10 s backoff: one attempt at once,
/// the last at the deadline (a jittered pause under the wait, rarely, adds
/// one between them, which meets the same fault).
fn held_then_stalled_connect(client: &LockClient, key: &str, proxy: &FaultProxy) -> Duration {
    let other = LockClient::builder()
        .url(proxy.url())
        .timeout(LONG_T)
        .build()
        .expect("client");
    let Ok(Some(held)) = DistributedLock::with_options(&other, key, options()).try_lock() else {
        return Duration::MAX;
    };
    let wait = Duration::from_millis(300);
    let lock = DistributedLock::with_options(
        client,
        key,
        options()
            .wait_mode(redmutex::WaitMode::Spin)
            .backoff(Backoff::constant(Duration::from_secs(10))),
    );
    proxy.count(key);
    let took = std::thread::scope(|scope| {
        let call = scope.spawn(|| {
            let started = Instant::now();
            let got = lock.try_lock_for(wait);
            assert!(!matches!(got, Ok(Some(_))), "{got:?}");
            started.elapsed()
        });
        // After the first attempt, well before the deadline.
        assert!(wait_until(wait / 2, || proxy.counted(key) >= 1));
        proxy.stall_new(true);
        proxy.reset_all();
        call.join().expect("call")
    });
    proxy.heal();
    drop(held);
    // The bound is WAIT's: stretched by the difference.
    took.saturating_sub(wait - WAIT)
}

/// A lock call on a client never used before: its first attempt also
/// reads the server's clock (`TIME`, once per client) before it sends
/// anything, on a server that accepts and never answers.
fn fresh_client_lock(client: &LockClient, key: &str, proxy: &FaultProxy) -> Duration {
    let lock = DistributedLock::with_options(client, key, options());
    timed_blackholed(proxy, || drop(lock.try_lock_for(WAIT)))
}

/// The same, the server slow rather than silent: every reply comes 40 % of
/// a timeout late (the handshake, `TIME`, the attempts), the key held
/// elsewhere.
fn fresh_client_slow_server(client: &LockClient, key: &str, proxy: &FaultProxy) -> Duration {
    let other = LockClient::builder()
        .url(proxy.url())
        .timeout(LONG_T)
        .build()
        .expect("client");
    let Ok(Some(held)) = DistributedLock::with_options(&other, key, options()).try_lock() else {
        return Duration::MAX;
    };
    let lock = DistributedLock::with_options(client, key, options());
    proxy.set_latency(Duration::ZERO, LONG_T * 2 / 5);
    let started = Instant::now();
    drop(lock.try_lock_for(WAIT));
    let took = started.elapsed();
    proxy.heal();
    drop(held);
    took
}

fn guard_extend(client: &LockClient, key: &str, proxy: &FaultProxy) -> Duration {
    let lock = DistributedLock::with_options(client, key, options());
    let Ok(Some(mut guard)) = lock.try_lock_for(Duration::from_secs(5)) else {
        return Duration::MAX;
    };
    let took = timed_blackholed(proxy, || drop(guard.extend(Duration::from_secs(10))));
    drop(guard);
    took
}

fn guard_is_held(client: &LockClient, key: &str, proxy: &FaultProxy) -> Duration {
    let lock = DistributedLock::with_options(client, key, options());
    let Ok(Some(guard)) = lock.try_lock_for(Duration::from_secs(5)) else {
        return Duration::MAX;
    };
    let took = timed_blackholed(proxy, || drop(guard.is_held()));
    drop(guard);
    took
}

fn force_release(client: &LockClient, key: &str, proxy: &FaultProxy) -> Duration {
    let lock = DistributedLock::with_options(client, key, options());
    drop(lock.try_lock());
    timed_blackholed(proxy, || drop(lock.force_release()))
}

fn semaphore_status(client: &LockClient, key: &str, proxy: &FaultProxy) -> Duration {
    let semaphore = Semaphore::new(client, key, 2);
    let Ok(Some(permit)) = semaphore.try_acquire_for(Duration::from_secs(5)) else {
        return Duration::MAX;
    };
    let took = timed_blackholed(proxy, || drop(semaphore.status()));
    drop(permit);
    took
}

/// Runs every call `RUNS` times, each kind on its own proxy and each run
/// on a fresh client (warmed by a healthy call first, nothing else learnt
/// from the run before), the kinds in parallel; the durations by kind.
fn measure(
    server: &RedisServer,
    timeout: Duration,
    calls: &[(&'static str, Call)],
) -> Vec<(&'static str, Vec<Duration>)> {
    let results = Arc::new(Mutex::new(Vec::new()));
    std::thread::scope(|scope| {
        for (name, call) in calls {
            let results = results.clone();
            scope.spawn(move || {
                let proxy = FaultProxy::to(server);
                let times: Vec<Duration> = (0..RUNS)
                    .map(|run| {
                        let client = LockClient::builder()
                            .url(proxy.url())
                            .timeout(timeout)
                            .build()
                            .expect("client");
                        call(&client, &format!("bound-{name}-{run}"), &proxy)
                    })
                    .collect();
                results.lock().expect("results").push((*name, times));
            });
        }
    });
    let mut results = std::mem::take(&mut *results.lock().expect("results"));
    results.sort_by_key(|(name, _)| *name);
    results
}

/// A lock call of every lock type: its wait, one connect and the resend
/// window (2T), however the server fails. Forced: a blackhole on a pooled
/// connection, so the first send loses its reply and every resend too;
/// for the plain lock also a last attempt (at the deadline of a key held
/// elsewhere) that must open a connection that stalls, and a client never
/// used before (its first attempt reads the server's clock first) on a
/// silent and on a slow server.
#[test]
fn a_lock_call_of_every_type_returns_within_its_wait_a_connect_and_the_resend_window() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let calls: [(&'static str, Call); 8] = [
        ("DistributedLock::try_lock_for", plain_lock),
        (
            "DistributedLock::try_lock_for, held, the last connect stalled",
            held_then_stalled_connect,
        ),
        (
            "DistributedLock::try_lock_for, a fresh client, silent server",
            fresh_client_lock,
        ),
        (
            "DistributedLock::try_lock_for, a fresh client, slow server",
            fresh_client_slow_server,
        ),
        ("ReentrantLock::try_lock_for", reentrant_lock),
        ("RwLock::try_read_for", read_lock),
        ("RwLock::try_write_for", write_lock),
        ("Semaphore::try_acquire_for", acquire),
    ];
    // With a timeout long enough that one more timeout (the writer's mark
    // once removed in a second resend window) cannot hide in the slack.
    for (name, times) in measure(&server, LONG_T, &calls) {
        check(name, &times, WAIT + LONG_T + LONG_T * 2 + SLACK);
    }
}

/// A release of every lock type, and every other call without a wait
/// (`extend`, `is_held`, `force_release`, `Semaphore::status`): one
/// connect and the resend window.
#[test]
fn a_release_of_every_type_returns_within_a_connect_and_the_resend_window() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let calls: [(&'static str, Call); 8] = [
        ("LockGuard::unlock", plain_unlock),
        ("ReentrantGuard::unlock", reentrant_unlock),
        ("RwGuard::unlock", rw_unlock),
        ("Permit::release", release),
        ("LockGuard::extend", guard_extend),
        ("LockGuard::is_held", guard_is_held),
        ("DistributedLock::force_release", force_release),
        ("Semaphore::status", semaphore_status),
    ];
    // With LONG_T: a release that overran by one timeout would stand out
    // from the slack.
    for (name, times) in measure(&server, LONG_T, &calls) {
        check(name, &times, LONG_T + LONG_T * 2 + SLACK);
    }
}

/// On Redis Cluster, a lock call on a key of a primary that stalls
/// (SIGSTOP, shorter than the cluster's node timeout) keeps the same bound:
/// redis-rs's own retries of a timed-out request stay within the call's
/// deadline.
#[test]
fn a_lock_call_on_a_stalled_cluster_primary_keeps_the_bound() {
    let _serial = support::serial();
    let cluster = support::RedisCluster::start_with_node_timeout(3, 0, 30_000);
    let keys = cluster.key_per_primary("bound");
    let client = LockClient::builder()
        .cluster(cluster.urls())
        .timeout(LONG_T)
        .build()
        .expect("client");
    let stalled = cluster.primary_for(&keys[1]);
    let mut times = Vec::new();
    for _ in 0..RUNS {
        let lock = DistributedLock::with_options(&client, keys[1].clone(), options());
        // A healthy cycle first: the pool holds a connection to every node.
        if let Ok(Some(guard)) = lock.try_lock() {
            let _ = guard.unlock();
        }
        stalled.signal("STOP");
        let started = Instant::now();
        let result = lock.try_lock_for(WAIT);
        times.push(started.elapsed());
        stalled.signal("CONT");
        assert!(result.is_err(), "{result:?}");
        // The other primaries answered meanwhile and still do.
        let other = DistributedLock::with_options(&client, keys[0].clone(), options());
        let guard = other.try_lock().expect("a healthy primary").expect("free");
        guard.unlock().expect("unlock");
    }
    check(
        "cluster try_lock_for, primary stalled",
        &times,
        WAIT + LONG_T + LONG_T * 2 + SLACK,
    );
}

/// The I/O timeout of the pool-after-a-heal test: long enough that the
/// 250 ms of its bound and the slack together stay under one timeout.
const HEAL_T: Duration = Duration::from_secs(1);

/// The pool after a stalled server heals: a call gets a connection within
/// T + 250 ms of the heal. Forced: a pool of one connection whose only slot
/// is held by a connect to the server stalled (accepted, never answered,
/// and silent even after the heal) that began just before the heal: a
/// call made at the heal waits for that connect to give up (T), then
/// opens its own. The connects of the stall are never waited for again.
#[test]
fn the_pool_works_again_within_a_timeout_and_250_ms_of_a_heal() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let mut times = Vec::new();
    for run in 0..RUNS {
        let proxy = FaultProxy::to(&server);
        let client = LockClient::builder()
            .url(proxy.url())
            .timeout(HEAL_T)
            .pool_size(1)
            .build()
            .expect("client");
        let lock = DistributedLock::with_options(&client, format!("bound-heal-{run}"), options());
        proxy.swallow_new(true);
        let healed = std::thread::scope(|scope| {
            let stalled = scope.spawn(|| assert!(lock.try_lock().is_err(), "stalled"));
            // Its connect is under way: the pool's one slot is taken.
            assert!(wait_until(HEAL_T, || proxy.accepted() >= 1));
            proxy.swallow_new(false);
            let healed = Instant::now();
            let back = wait_until(HEAL_T * 5, || match lock.try_lock() {
                Ok(Some(guard)) => guard.unlock().is_ok(),
                _ => false,
            });
            assert!(back, "the pool never recovered");
            let took = healed.elapsed();
            stalled.join().expect("stalled call");
            took
        });
        times.push(healed);
    }
    check(
        "pool after a heal",
        &times,
        HEAL_T + Duration::from_millis(250) + SLACK,
    );
}

/// A half-open subscriber link: a waiter whose release message cannot come
/// finds the link silent within 2T and falls back to polling; ten waiters,
/// each behind its own blackholed link, in parallel.
#[test]
fn a_half_open_subscriber_link_is_found_within_two_timeouts() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let holder = server.lock_client();
    let times = Arc::new(Mutex::new(Vec::new()));
    std::thread::scope(|scope| {
        for run in 0..RUNS {
            let (server, holder, times) = (&server, &holder, times.clone());
            scope.spawn(move || {
                let key = format!("bound-sub-{run}");
                let proxy = FaultProxy::to(server);
                // Commands go straight to Redis; only the subscriber's link
                // is proxied.
                let pool = redmutex::r2d2::Pool::builder()
                    .max_size(2)
                    .build(redis::Client::open(server.url()).expect("url"))
                    .expect("pool");
                let waiter = LockClient::new(pool)
                    .with_notify_client(&redis::Client::open(proxy.url()).expect("url"));
                let guard = DistributedLock::new(holder, key.as_str())
                    .lock()
                    .expect("lock");
                let channel = holder.release_channel(&key);
                let waiting = std::thread::spawn({
                    let (waiter, key) = (waiter.clone(), key.clone());
                    move || {
                        DistributedLock::with_options(
                            &waiter,
                            key,
                            LockOptions::default()
                                .wait(Duration::from_secs(30))
                                .backoff(Backoff::constant(Duration::from_secs(60))),
                        )
                        .lock()
                        .is_ok()
                    }
                });
                assert!(wait_until(Duration::from_secs(5), || support::numsub(
                    server, &channel
                ) >= 1));
                proxy.blackhole(true);
                let released = Instant::now();
                guard.unlock().expect("unlock");
                assert!(waiting.join().expect("waiter"));
                times.lock().expect("times").push(released.elapsed());
            });
        }
    });
    let times = std::mem::take(&mut *times.lock().expect("times"));
    // The subscriber's timeout is the default one (a client made from a
    // pool); after the link is found silent, the waiter polls at once.
    check(
        "half-open subscriber link (waiter woken)",
        &times,
        redmutex::DEFAULT_TIMEOUT * 2 + SLACK,
    );
}

/// The process's threads of the crate that run per client.
fn client_threads() -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .filter(|name| {
            ["redmutex-dog", "redmutex-sub"]
                .iter()
                .any(|p| name.starts_with(p))
        })
        .count()
}

/// What scheduling adds to a wait that ends on a deadline the crate
/// computes (a condition variable's timeout, a budget cut into steps)
/// rather than on a socket's timeout: a fraction of the smallest bound it
/// serves (100 ms), so a thread waited for twice cannot pass.
const SHORT_SLACK: Duration = Duration::from_millis(60);

/// A thread of `client` waiting for `key`, held elsewhere: the client's
/// subscriber is connected and subscribed when this returns.
fn subscribed_waiter(
    server: &RedisServer,
    client: &LockClient,
    key: &str,
) -> std::thread::JoinHandle<()> {
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg("someone")
        .arg("PX")
        .arg(60_000)
        .query(&mut server.conn())
        .expect("SET");
    let waiter = {
        let lock = DistributedLock::with_options(
            client,
            key,
            options().backoff(Backoff::constant(Duration::from_secs(10))),
        );
        std::thread::spawn(move || {
            let _ = lock.try_lock_for(Duration::from_millis(300));
        })
    };
    let channel = client.release_channel(key);
    assert!(
        wait_until(Duration::from_secs(5), || support::numsub(server, &channel)
            >= 1),
        "the waiter never subscribed"
    );
    waiter
}

/// Drops `client` (its last clone) `RUNS` times as `setup` leaves it, and
/// checks the drop against `limit` and its threads' end against T after
/// it.
fn drops_within(
    bound: &str,
    limit: Duration,
    setup: impl Fn(&RedisServer, &FaultProxy, &LockClient, usize),
) {
    let _serial = support::serial();
    let server = RedisServer::start();
    assert!(
        wait_until(T * 10, || client_threads() == 0),
        "threads of earlier tests"
    );
    let mut drops = Vec::new();
    let mut ends = Vec::new();
    for run in 0..RUNS {
        let proxy = FaultProxy::to(&server);
        let client = client(&proxy.url());
        setup(&server, &proxy, &client, run);
        let started = Instant::now();
        drop(client);
        drops.push(started.elapsed());
        let dropped = Instant::now();
        assert!(wait_until(T * 10, || client_threads() == 0), "threads left");
        ends.push(dropped.elapsed());
        proxy.heal();
    }
    check(bound, &drops, limit + SHORT_SLACK);
    check(
        &format!("{bound}: its threads ending after it"),
        &ends,
        T + SLACK,
    );
}

/// Dropping a client whose subscriber is stuck in a handshake (the server
/// accepts and never answers) and whose watchdog waits: the threads are
/// told together and waited for together, 100 ms in all. On f63675e each
/// thread was waited for in turn (100 ms each, three threads).
#[test]
fn a_dropped_client_with_a_stuck_thread_returns_within_100_ms() {
    drops_within(
        "drop, a thread stuck",
        Duration::from_millis(100),
        |server, proxy, client, run| {
            // The watchdog started, and idle.
            support::watched_lock(
                client,
                &format!("drop-watched-{run}"),
                Duration::from_secs(9),
            )
            .unlock()
            .expect("unlock");
            let waiter = subscribed_waiter(server, client, &format!("drop-stuck-{run}"));
            waiter.join().expect("waiter");
            // The subscriber's link cut, and its reconnection stalled.
            proxy.stall_new(true);
            proxy.reset_all();
            std::thread::sleep(Duration::from_millis(50));
        },
    );
}

/// Dropping a client whose threads are stuck in network calls (its
/// watchdog renewing through a blackhole, its subscriber's link silent)
/// with a failed release waiting for its cleanup: 100 ms for the threads
/// plus T for the watchdog's last cleanup round (a release written behind
/// and owed meanwhile is read within that).
#[test]
fn a_dropped_client_with_a_cleanup_pending_returns_within_100_ms_and_t() {
    drops_within(
        "drop, a cleanup pending",
        Duration::from_millis(100) + T,
        |server, proxy, client, run| {
            let key = format!("drop-cleanup-{run}");
            let guard = DistributedLock::with_options(
                client,
                key.as_str(),
                LockOptions::default()
                    .ttl(Duration::from_millis(600))
                    .watchdog(true),
            )
            .lock()
            .expect("lock");
            let waiter = subscribed_waiter(server, client, &format!("drop-held-{run}"));
            waiter.join().expect("waiter");
            proxy.blackhole(true);
            // Renewals are due every 200 ms: let one be under way.
            std::thread::sleep(Duration::from_millis(250));
            // Its release fails in the blackhole: the token goes to the
            // cleanup.
            let _ = guard.unlock();
        },
    );
}

/// Dropping a client whose idle connections owe replies to releases
/// written behind, from a server gone silent: they are read within 250 ms
/// in all, whatever the number of connections owing (on f63675e: 250 ms
/// for each).
#[test]
fn a_dropped_client_owing_replies_returns_within_250_ms() {
    drops_within(
        "drop, replies owed",
        Duration::from_millis(250),
        |_, proxy, client, run| {
            // The first release of a client is synchronous; later drops write
            // behind, here on three connections at once (three threads).
            let first = DistributedLock::new(client, format!("drop-owed-{run}-first"));
            first.lock().expect("lock").unlock().expect("unlock");
            std::thread::scope(|scope| {
                for n in 0..3 {
                    let lock = DistributedLock::new(client, format!("drop-owed-{run}-{n}"));
                    scope.spawn(move || {
                        let guard = lock.lock().expect("lock");
                        std::thread::sleep(Duration::from_millis(20));
                        proxy.blackhole(true);
                        drop(guard);
                    });
                }
            });
        },
    );
}

/// A dropped client whose subscriber is asking sentinels that all stall
/// (they accept and never answer): the whole lookup fits in one timeout,
/// so the thread ends within it, however many sentinels there are.
#[test]
fn a_dropped_clients_subscriber_asking_stalled_sentinels_ends_within_the_bound() {
    let _serial = support::serial();
    let set = support::SentinelSet::start();
    let proxies: Vec<FaultProxy> = set.sentinels.iter().map(FaultProxy::to).collect();
    let urls: Vec<String> = proxies.iter().map(FaultProxy::url).collect();
    let holder = set.primary.lock_client();
    assert!(
        wait_until(LONG_T * 10, || client_threads() == 0),
        "threads of earlier tests"
    );
    let mut ends = Vec::new();
    for run in 0..RUNS {
        let key = format!("bound-sentinels-{run}");
        let client = LockClient::builder()
            .sentinel(&urls, support::SentinelSet::MASTER)
            .sentinel_primary(redis::RedisConnectionInfo::default())
            .timeout(LONG_T)
            .build()
            .expect("client");
        // A connection to the primary in the pool, found while the
        // sentinels answered.
        let lock = DistributedLock::with_options(&client, key.as_str(), options());
        lock.try_lock()
            .expect("healthy")
            .expect("free")
            .unlock()
            .expect("unlock");
        let guard = DistributedLock::new(&holder, key.as_str())
            .lock()
            .expect("held");
        for proxy in &proxies {
            proxy.stall_new(true);
        }
        // A waiter subscribes: the subscriber looks the primary up through
        // the stalled sentinels while the waiter gives up.
        let waited = lock.try_lock_for(Duration::from_millis(300));
        assert!(matches!(waited, Ok(None)), "{waited:?}");
        drop(lock);
        drop(client);
        let dropped = Instant::now();
        assert!(
            wait_until(LONG_T * 10, || client_threads() == 0),
            "threads left"
        );
        ends.push(dropped.elapsed());
        for proxy in &proxies {
            proxy.stall_new(false);
        }
        guard.unlock().expect("unlock");
    }
    check(
        "a dropped client's subscriber, three sentinels stalled (threads ending)",
        &ends,
        LONG_T + SLACK,
    );
}

/// `list` against its budget: every step (a connect included) is cut to
/// what is left of it, so a blackholed server makes the call return
/// within its budget.
#[test]
fn list_returns_within_its_budget() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    // A step that overran the budget by its timeout would stand out.
    let client = LockClient::builder()
        .url(proxy.url())
        .timeout(LONG_T)
        .build()
        .expect("client");
    let budget = Duration::from_millis(150);
    let mut times = Vec::new();
    for run in 0..RUNS {
        let lock = DistributedLock::with_options(&client, format!("bound-list-{run}"), options());
        let guard = lock.lock().expect("lock");
        let listing = client
            .list("bound-list-*", Duration::from_secs(5))
            .expect("list");
        assert!(listing.complete && !listing.held.is_empty());
        let took = timed_blackholed(&proxy, || match client.list("bound-list-*", budget) {
            Ok(listing) => assert!(!listing.complete),
            Err(err) => assert!(err.is_connection(), "{err}"),
        });
        times.push(took);
        let _ = guard.unlock();
    }
    check("list", &times, budget + SHORT_SLACK);
}

/// A lease a failed acquisition left: its request held on the way (by
/// latency longer than the timeout) lands after the caller got
/// `OutcomeUnknown`, and the client's cleanup releases it within the
/// cleanup step in progress when it lands (the first cleanup at the
/// error, then 50 ms, doubling to at most 1 s): each run's limit is when
/// that step ends, plus the slack of a deadline the watchdog computes.
#[test]
fn a_lease_a_failed_acquisition_left_is_released_within_a_cleanup_step() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let times = Arc::new(Mutex::new(Vec::new()));
    std::thread::scope(|scope| {
        for run in 0..RUNS {
            let (server, times) = (&server, times.clone());
            scope.spawn(move || {
                let key = format!("bound-late-{run}");
                let proxy = FaultProxy::to(server);
                let client = client(&proxy.url());
                let lock = DistributedLock::with_options(&client, key.as_str(), options());
                // Holder metadata read and a connection pooled before the
                // latency, so the slow request is the acquisition.
                lock.lock().expect("warm").unlock().expect("unlock");
                proxy.set_latency(T + Duration::from_millis(100), Duration::ZERO);
                let err = lock.try_lock().expect_err("too slow");
                assert!(err.is_outcome_unknown(), "{err}");
                let errored = Instant::now();
                proxy.set_latency(Duration::ZERO, Duration::ZERO);
                let mut landed = None;
                let gone = wait_until(Duration::from_secs(10), || {
                    let there = support::exists(server, &key);
                    if there && landed.is_none() {
                        landed = Some(Instant::now());
                    }
                    // Released before it was seen: the cleanup said so.
                    !there && (landed.is_some() || client.stats().orphans_released >= 1)
                });
                assert!(gone, "the late lease stays");
                // Unseen: landed and released within the first step.
                let since = landed.unwrap_or(errored);
                let step_ends = cleanup_after(since.saturating_duration_since(errored));
                times
                    .lock()
                    .expect("times")
                    .push((since.elapsed(), step_ends));
            });
        }
    });
    let times = std::mem::take(&mut *times.lock().expect("times"));
    let worst = times
        .iter()
        .max_by_key(|(took, limit)| took.saturating_sub(*limit))
        .copied()
        .unwrap_or_default();
    eprintln!(
        "bound | a lease a failed acquisition left (landing to release) | worst {:?} against its step's end {:?} over {} runs | limit that + {SHORT_SLACK:?}",
        worst.0,
        worst.1,
        times.len()
    );
    assert!(times.len() >= RUNS);
    for (took, limit) in &times {
        assert!(*took < *limit + SHORT_SLACK, "{times:?}");
    }
}

/// How long after `landed` (since the error) the cleanup step in progress
/// ends: cleanups at the error, then 50 ms later, each step twice the last
/// up to 1 s. Counted from the error as the test sees it, just after the
/// orphan was queued.
fn cleanup_after(landed: Duration) -> Duration {
    let mut at = Duration::ZERO;
    let mut step = Duration::from_millis(50);
    // Bounded: the steps reach any landing within the test's 10 s.
    for _ in 0..64 {
        at += step;
        if at >= landed {
            return at - landed;
        }
        step = (step * 2).min(Duration::from_secs(1));
    }
    Duration::ZERO
}

/// A lease passed between threads reaches a thread only confirmed by Redis
/// within the handoff budget's `max_age` and one round trip. Holds of
/// 30 ms with a `max_age` of 50 ms: the lease is 30 ms old at its first
/// handoff (passed on as it is), 60 ms old at its second (confirmed
/// first), so without the confirmations the age at a handoff would reach
/// 60 ms and more. `KindStats::handoff_age`, over every handoff, stays
/// under 50 ms plus a slack far below the 30 ms a missed confirmation
/// adds.
#[test]
fn a_lease_handed_on_is_never_older_than_its_max_age() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let client = server.lock_client();
    let max_age = Duration::from_millis(50);
    let options = LockOptions::default()
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_secs(10))
        .handoff_budget(
            redmutex::HandoffBudget::new(256, Duration::from_secs(10)).with_max_age(max_age),
        );
    let lock = DistributedLock::with_options(&client, "bound-age", options);
    std::thread::scope(|scope| {
        for _ in 0..3 {
            scope.spawn(|| {
                for _ in 0..8 {
                    let guard = lock.lock().expect("lock");
                    std::thread::sleep(Duration::from_millis(30));
                    guard.unlock().expect("unlock");
                }
            });
        }
    });
    let age = client.stats().kind(redmutex::LockKind::Mutex).handoff_age;
    assert!(age.count >= 10, "too few handoffs to tell: {age:?}");
    let limit = max_age + Duration::from_millis(10);
    eprintln!(
        "bound | age of the newest confirmation at a handoff | worst {:?} over {} handoffs | limit {limit:?}",
        age.max, age.count
    );
    assert!(age.max < limit, "{age:?} against {limit:?}");
}

/// A lease about to be passed to a waiting thread whose confirmation in
/// Redis cannot be answered: the call that sent it returns within one
/// connect and the resend window (3T here), with the token handed to the
/// cleanup rather than a release sent after it (a second round trip).
/// Both sides: the thread letting go (its check fails: the server is
/// blackholed), and the thread taking the lease (its own check, with a
/// `max_age` of zero, loses every reply).
#[test]
fn a_handoff_whose_check_cannot_be_answered_costs_one_round_trip() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let long = |max_age: Duration| {
        LockOptions::default()
            .ttl(Duration::from_secs(30))
            .wait(Duration::from_secs(30))
            .handoff_budget(
                redmutex::HandoffBudget::new(256, Duration::from_secs(30)).with_max_age(max_age),
            )
    };
    let mut givers = Vec::new();
    let mut takers = Vec::new();
    for run in 0..RUNS {
        let proxy = FaultProxy::to(&server);
        let client = LockClient::builder()
            .url(proxy.url())
            .timeout(LONG_T)
            .build()
            .expect("client");
        // The giver's check fails.
        let key = format!("bound-give-{run}");
        let lock =
            DistributedLock::with_options(&client, key.as_str(), long(Duration::from_millis(1)));
        let held = lock.lock().expect("lock");
        let waiter = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                lock.try_lock_for(Duration::from_millis(300))
                    .map(|g| g.is_some())
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        proxy.blackhole(true);
        let started = Instant::now();
        let unlocked = held.unlock();
        givers.push(started.elapsed());
        assert!(
            matches!(&unlocked, Err(err) if err.is_connection()),
            "{unlocked:?}"
        );
        let _ = waiter.join();
        proxy.heal();
        // Released by the cleanup once Redis answers.
        assert!(
            wait_until(Duration::from_secs(10), || !support::exists(&server, &key)),
            "{key} left behind"
        );

        // The taker's check fails.
        let key = format!("bound-take-{run}");
        let lock = DistributedLock::with_options(&client, key.as_str(), long(Duration::ZERO));
        let held = lock.lock().expect("lock");
        let started = Arc::new(Mutex::new(None::<Instant>));
        let waiter = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                let got = lock.try_lock_for(Duration::from_millis(100));
                let ended = Instant::now();
                (got.map(|g| g.is_some()), ended)
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        // The giver's `GET` goes through; every later one loses its reply.
        proxy.lose_reply_after("*2\r\n$3\r\nGET\r\n", 1, 10);
        *started.lock().expect("started") = Some(Instant::now());
        held.unlock().expect("handed on");
        let (got, ended) = waiter.join().expect("waiter");
        let from = started.lock().expect("started").unwrap_or(ended);
        takers.push(ended.saturating_duration_since(from));
        assert!(matches!(&got, Err(err) if err.is_connection()), "{got:?}");
        proxy.heal();
        assert!(
            wait_until(Duration::from_secs(10), || !support::exists(&server, &key)),
            "{key} left behind"
        );
    }
    check(
        "unlock, the check before a handoff unanswered",
        &givers,
        LONG_T * 3 + SLACK,
    );
    check(
        "a taker's call, its check of the lease unanswered (from the handoff)",
        &takers,
        LONG_T * 3 + SLACK,
    );
}

/// A watchdog's renewal round never outlasts the shortest lease it renews
/// has left, nor the shortest renewal period (ttl/3) among the watched
/// leases. Forced: a watched lease (ttl 600 ms) on a blackholed server
/// with a 500 ms timeout, so a round that waited for its socket's timeout
/// would overrun by far more than the slack. Its first round (at ttl/3,
/// 400 ms left) is cut at the period, 200 ms; the next one (100 ms
/// later, under 100 ms left) at what the lease has left. Each round is
/// timed from the client's counters: it starts when `renewal_round_trips`
/// goes up, and ends when the lock type's `renewals` (counted as the
/// replies, or the failure, come back) catch up.
#[test]
fn a_watchdog_round_ends_within_the_lease_left_and_the_renewal_period() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let ttl = Duration::from_millis(600);
    let period = ttl / 3;
    // What the local clock takes off a lease (1 % of the ttl + 2 ms).
    let drift = ttl / 100 + Duration::from_millis(2);
    let mut rounds = Vec::new();
    let mut limits = Vec::new();
    for run in 0..RUNS {
        let proxy = FaultProxy::to(&server);
        let client = LockClient::builder()
            .url(proxy.url())
            .timeout(LONG_T)
            .build()
            .expect("client");
        let guard = support::watched_lock(&client, &format!("bound-renewal-{run}"), ttl);
        // After its request was sent: the lease has at most this much
        // left at any moment from now on.
        let acquired = Instant::now();
        proxy.blackhole(true);
        let counts = || {
            let stats = client.stats();
            (
                stats.renewal_round_trips,
                stats.kind(redmutex::LockKind::Mutex).renewals,
            )
        };
        let mut started: Option<Instant> = None;
        let deadline = acquired + ttl * 3;
        // Bounded by the deadline; polled every 1 ms so a round's start
        // and end are seen within it.
        while Instant::now() < deadline {
            let (begun, ended) = counts();
            match started {
                None if begun > ended => {
                    let now = Instant::now();
                    let left = (acquired + ttl)
                        .saturating_duration_since(now)
                        .saturating_sub(drift);
                    started = Some(now);
                    limits.push(left.min(period));
                }
                Some(at) if begun == ended => {
                    rounds.push(at.elapsed());
                    started = None;
                }
                _ => {}
            }
            if started.is_none() && guard.is_lost() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(guard.is_lost(), "the lease was not found lost");
        assert!(started.is_none(), "a renewal round still under way");
        proxy.heal();
    }
    let worst = rounds
        .iter()
        .zip(&limits)
        .max_by_key(|(took, limit)| took.saturating_sub(**limit))
        .map(|(took, limit)| (*took, *limit))
        .unwrap_or_default();
    eprintln!(
        "bound | a watchdog round (the lease left, at most ttl/3) | worst {:?} against {:?} over {} rounds ({:?}) | limit that + {SHORT_SLACK:?}",
        worst.0,
        worst.1,
        rounds.len(),
        rounds
    );
    assert!(rounds.len() >= RUNS * 2, "too few rounds: {rounds:?}");
    for (took, limit) in rounds.iter().zip(&limits) {
        assert!(
            *took < *limit + SHORT_SLACK,
            "a round took {took:?} against {limit:?}: {rounds:?} {limits:?}"
        );
    }
}

/// A run of handoffs among one client's threads costs another client's
/// waiter at most the handoff budget (`max_time` since the lease was taken
/// in Redis), the hold under way when it runs out (1 ms here), and the
/// waiter's wake-up, for which the client's head stands back 5 ms after a
/// release that reached other clients (docs/failure-model.md's bounds).
/// With a budget of 200 ms, so a second run (a waiter that missed its
/// turn) would add far more than the slack; the handoff count is no limit
/// here. Counted from the waiter's subscription. The holds sleep, so the waiter's threads get a core at once: on
/// a saturated machine a wake-up can take longer than the 5 ms. On
/// 4922f52 the head's own release message ended its standing back at
/// once, and one wait in about fifteen took a second run.
#[test]
fn a_remote_waiter_behind_a_run_of_handoffs_waits_one_budget_a_hold_and_its_wake_up() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let local = server.lock_client();
    let remote = server.lock_client();
    let budget = Duration::from_millis(200);
    const HOLD: Duration = Duration::from_millis(1);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let lock = DistributedLock::with_options(
                &local,
                "budget",
                LockOptions::default()
                    .handoff_budget(redmutex::HandoffBudget::new(u32::MAX, budget)),
            );
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut rounds = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) && rounds < 100_000_000 {
                    let guard = lock.lock().expect("lock");
                    std::thread::sleep(HOLD);
                    drop(guard);
                    rounds += 1;
                }
                rounds
            })
        })
        .collect();
    assert!(wait_until(Duration::from_secs(5), || local
        .stats()
        .handoffs
        > 100));
    let channel = remote.release_channel("budget");
    let mut waits = Vec::new();
    for _ in 0..5 {
        let lock = DistributedLock::with_options(
            &remote,
            "budget",
            LockOptions::default().wait(Duration::from_secs(10)),
        );
        // The wait counts from the remote waiter's subscription (the local
        // head's is the other one): a run that ends before it cannot
        // announce its end to the waiter, and the next run is no miss.
        let got = std::sync::atomic::AtomicBool::new(false);
        let (guard, subscribed) = std::thread::scope(|scope| {
            let watcher = scope.spawn(|| {
                let mut con = server.conn();
                let mut subscribed = None;
                // Bounded: 10 s of 1 ms polls at most, and over once the
                // waiter has the lock (at its first attempt, unsubscribed).
                for _ in 0..10_000 {
                    if got.load(std::sync::atomic::Ordering::SeqCst) {
                        break;
                    }
                    let reply: (String, u64) = redis::cmd("PUBSUB")
                        .arg("NUMSUB")
                        .arg(&channel)
                        .query(&mut con)
                        .expect("NUMSUB");
                    if reply.1 >= 2 {
                        subscribed = Some(Instant::now());
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                subscribed
            });
            let guard = lock.lock().expect("the remote waiter gets its turn");
            let took = Instant::now();
            got.store(true, std::sync::atomic::Ordering::SeqCst);
            (guard, watcher.join().expect("watcher").map(|at| took - at))
        });
        waits.push(subscribed.unwrap_or_default());
        drop(guard);
        // The local threads take it back: a new run.
        let acquired = local.stats().acquired;
        assert!(wait_until(Duration::from_secs(5), || local
            .stats()
            .acquired
            > acquired));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let rounds: u64 = workers.into_iter().map(|w| w.join().expect("worker")).sum();
    let stats = local.stats();
    assert!(stats.handoffs > 0 && rounds > 0);
    // The budget, the hold under way, the yield (its 5 ms), and a slack for
    // the waiter's own steps (its quick attempt, subscription and wake-up)
    // on a loaded 2-core machine: far below the 200 ms a second run adds.
    let limit = budget + HOLD + Duration::from_millis(5) + Duration::from_millis(60);
    let worst = waits.iter().max().copied().unwrap_or_default();
    eprintln!(
        "bound | a remote waiter behind a run of handoffs | worst {worst:?} over {} waits | limit {limit:?}",
        waits.len()
    );
    assert!(worst < limit, "remote waits {waits:?} against {limit:?}");
}

/// A release written behind that met `NOSCRIPT` on a client that then
/// went quiet once stayed unread until the deferred check, three I/O
/// timeouts later (6 s by default), while other processes waited for the
/// key. The idle connections owing replies are read 20 ms after the write:
/// the `NOSCRIPT` is acted on (the release sent again by `EVAL`) within
/// 20 ms and a round trip or two. With a 10 s I/O timeout the old check
/// would come after 30 s; the limit here is 20 ms and the slack of a
/// deadline the watchdog computes (60 ms, the round trips and the 5 ms
/// polls of the check included).
#[test]
fn noscript_on_a_quiet_client_is_acted_on_within_20_ms_and_a_round_trip() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let client = LockClient::builder()
        .url(server.url())
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client");
    let lock = DistributedLock::with_options(&client, "wb:quiet", options());
    // The first release of a client is synchronous: later drops write
    // behind.
    lock.lock().expect("lock").unlock().expect("unlock");
    let mut took = Vec::new();
    for round in 0..5 {
        let guard = lock.lock().expect("lock");
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query(&mut server.conn())
            .expect("SCRIPT FLUSH");
        let dropped = std::time::Instant::now();
        drop(guard);
        assert!(
            wait_until(Duration::from_secs(2), || !support::exists(
                &server, "wb:quiet"
            )),
            "round {round}: still held 2 s after the drop"
        );
        took.push(dropped.elapsed());
    }
    assert!(server.command_calls("eval") >= 5, "sent again by EVAL");
    let limit = Duration::from_millis(20) + SHORT_SLACK;
    let worst = took.iter().max().copied().unwrap_or_default();
    eprintln!(
        "bound | NOSCRIPT on a quiet client | worst {worst:?} over {} runs | limit {limit:?}",
        took.len()
    );
    assert!(worst < limit, "released after the drop: {took:?}");
}
