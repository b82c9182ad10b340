//! Servers that stall, links that go silent or are reset, latency and
//! partitions, forced through the fault-injecting proxy: every call stays
//! bounded, the pool recovers once the server heals, and a watched lease is
//! reported lost before anyone else can take the key.

use redmutex_test_support as support;

use std::time::{Duration, Instant};

use redis::Commands;
use redmutex::Lease;
use redmutex::{Backoff, DistributedLock, Error, LockClient, LockOptions, WaitMode};
use support::{FaultProxy, RedisServer, exists, get, numsub, wait_until};

/// A short I/O timeout keeps these tests quick; every bound below is
/// stated in multiples of it.
const T: Duration = Duration::from_millis(400);

fn client(proxy: &FaultProxy) -> LockClient {
    LockClient::builder()
        .url(proxy.url())
        .timeout(T)
        .build()
        .expect("client")
}

fn options() -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_secs(2))
}

/// Case 4: a server that accepts and never answers the handshake, on
/// connections that stay silent even after it heals (a path that swallowed
/// them). With r2d2 as the pool, its threads blocked for ever on them and the pool
/// stayed wedged after the heal; now every call fails within its timeouts
/// and the pool works again within one timeout and 250 ms of the heal (a
/// connect of the stall still under way gives up within a timeout; a
/// pause between two failed connects is at most 250 ms). The bound is
/// forced in `bounds.rs`.
#[test]
fn a_stalled_handshake_never_wedges_the_pool() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy);
    let lock = DistributedLock::with_options(&client, "s", options());
    proxy.swallow_new(true);
    for _ in 0..5 {
        let started = Instant::now();
        let err = lock.try_lock().expect_err("stalled");
        assert!(matches!(err, Error::Pool(_)), "{err}");
        assert!(
            started.elapsed() < T * 3,
            "bounded: {:?}",
            started.elapsed()
        );
    }
    proxy.swallow_new(false);
    let healed = Instant::now();
    let recovered = wait_until(T * 5, || matches!(lock.try_lock(), Ok(Some(_))));
    assert!(recovered, "the pool recovers after the heal");
    let took = healed.elapsed();
    assert!(
        took < T + Duration::from_millis(250) + Duration::from_millis(300),
        "recovered in {took:?}"
    );
}

/// A connection reset while Redis stays up: the idle pooled connections
/// are all dead; an operation retries on a fresh connection instead of
/// walking through them, and the next user gets a fresh one too.
#[test]
fn a_reset_retires_every_idle_connection() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy);
    warm_pool(&client, 8);
    assert!(proxy.connections() >= 8);
    proxy.reset_all();
    let lock = DistributedLock::with_options(&client, "r", options());
    let guard = lock.lock().expect("a fresh connection");
    guard.unlock().expect("unlock");
    assert!(client.stats().resends <= 1, "{:?}", client.stats());
}

/// Opens `n` pooled connections at once, then gives them back idle.
fn warm_pool(client: &LockClient, n: usize) {
    let held: Vec<_> = (0..n).map(|_| support::connection_of(client)).collect();
    for mut con in held {
        let _: String = redis::cmd("PING").query(&mut con).expect("PING");
    }
}

/// Case 13: all sixteen idle pooled connections reset while two leases
/// are watched. On main both leases expired (`Unreachable`): the watchdog
/// took one dead connection after another, 100 ms apart.
#[test]
fn watched_leases_survive_a_reset_of_every_pooled_connection() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    warm_pool(&client, 16);
    let ttl = Duration::from_millis(600);
    let (a, b) = (
        support::watched_lock(&client, "wa", ttl),
        support::watched_lock(&client, "wb", ttl),
    );
    proxy.reset_all();
    let renewals = client.stats().renewals;
    assert!(wait_until(Duration::from_secs(5), || client
        .stats()
        .renewals
        >= renewals + 6));
    assert!(
        !a.is_lost() && !b.is_lost(),
        "{:?} {:?}",
        a.loss_signal(),
        b.loss_signal()
    );
    assert_eq!(get(&server, "wa").as_deref(), Some(a.token()));
    assert_eq!(get(&server, "wb").as_deref(), Some(b.token()));
    a.unlock().expect("unlock");
    b.unlock().expect("unlock");
}

/// A blackhole while releasing, by `unlock()` and by drop: bounded by the
/// resend window (twice the timeout, plus a connect), never a hang or a
/// panic; the outcome is reported as unknown and the key expires by ttl.
#[test]
fn a_blackhole_during_unlock_and_drop_is_bounded() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy);
    let lock = DistributedLock::with_options(&client, "b", options().ttl(Duration::from_secs(2)));
    let guard = lock.lock().expect("lock");
    proxy.blackhole(true);
    let started = Instant::now();
    let err = guard.unlock().expect_err("no answer");
    assert!(err.is_connection(), "{err}");
    assert!(
        started.elapsed() < T * 4,
        "unlock took {:?}",
        started.elapsed()
    );
    proxy.heal();
    // The held request reaches Redis late and releases.
    assert!(wait_until(Duration::from_secs(5), || !exists(&server, "b")));

    let guard = lock.lock().expect("lock");
    proxy.blackhole(true);
    let started = Instant::now();
    drop(guard);
    assert!(
        started.elapsed() < T * 4,
        "drop took {:?}",
        started.elapsed()
    );
    proxy.heal();
    assert!(wait_until(Duration::from_secs(5), || !exists(&server, "b")));
}

/// 50 ms each way: the local estimate never exceeds what Redis allows.
#[test]
fn validity_never_exceeds_pttl_under_latency() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    proxy.set_latency(Duration::from_millis(50), Duration::from_millis(50));
    let lock = DistributedLock::with_options(&client, "l", options().ttl(Duration::from_secs(5)));
    for _ in 0..5 {
        let guard = lock.lock().expect("lock");
        let validity = guard.validity();
        let pttl: i64 = server.conn().pttl("l").expect("PTTL");
        assert!(
            validity.as_millis() as i64 <= pttl,
            "validity {validity:?} > PTTL {pttl} ms"
        );
        guard.unlock().expect("unlock");
    }
}

/// Case 17: a `SET` that reaches Redis after its caller gave up (the proxy
/// holds it longer than the client's timeout). The caller gets an error,
/// and the lease its late request sets is released once it lands.
#[test]
fn a_late_acquisition_is_cleaned_up_after_the_error() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy);
    let lock = DistributedLock::with_options(&client, "late", options());
    // The client's one TIME (holder metadata) read before the latency, so
    // the slow request is the SET.
    lock.lock().expect("warm").unlock().expect("unlock");
    // One connection open before the latency: the first send goes out on
    // it (fresh connections' handshakes are as slow as the SET).
    warm_pool(&client, 1);
    proxy.set_latency(T + Duration::from_millis(300), Duration::ZERO);
    let started = Instant::now();
    let err = lock.try_lock().expect_err("too slow");
    assert!(err.is_outcome_unknown(), "{err}");
    proxy.set_latency(Duration::ZERO, Duration::ZERO);
    let errored = started.elapsed();
    // The held requests land, then the cleanup removes what they set.
    let landed = wait_until(Duration::from_secs(5), || exists(&server, "late"));
    let gone = wait_until(Duration::from_secs(10), || !exists(&server, "late"));
    assert!(gone, "the late lease was released");
    assert!(
        started.elapsed() < errored + Duration::from_secs(4),
        "gone {:?} after the error",
        started.elapsed() - errored
    );
    let _ = landed;
    // Counted once the cleanup has its reply, which may come just after
    // the key is seen gone.
    assert!(
        wait_until(Duration::from_secs(5), || client.stats().orphans_released
            >= 1),
        "{:?}",
        client.stats()
    );
}

/// Case 11: a half-open subscriber link (the proxy holds the socket and
/// forwards nothing, so the release message never arrives). On main the
/// link counted as live and the waiter slept its whole backoff step (60 s
/// here). Now the subscriber finds the link silent within two timeouts,
/// wakes its waiters, and they ask Redis.
#[test]
fn a_silent_subscriber_link_is_detected() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    // Commands go straight to Redis; only the subscriber's link is proxied.
    let pool = redmutex::r2d2::Pool::builder()
        .max_size(4)
        .test_on_check_out(false)
        .connection_timeout(Duration::from_secs(2))
        .build(redis::Client::open(server.url()).expect("url"))
        .expect("pool");
    let waiter_client =
        LockClient::new(pool).with_notify_client(&redis::Client::open(proxy.url()).expect("url"));
    let holder = server.lock_client();
    let channel = holder.release_channel("h");
    let guard = DistributedLock::new(&holder, "h").lock().expect("lock");
    let waiting = std::thread::spawn({
        let waiter_client = waiter_client.clone();
        move || {
            DistributedLock::with_options(
                &waiter_client,
                "h",
                LockOptions::default()
                    .wait(Duration::from_secs(30))
                    .backoff(Backoff::constant(Duration::from_secs(60))),
            )
            .lock()
            .map(|g| g.token().to_owned())
        }
    });
    assert!(wait_until(Duration::from_secs(5), || numsub(
        &server, &channel
    ) == 1));
    proxy.blackhole(true);
    let released = Instant::now();
    guard.unlock().expect("unlock");
    let got = waiting.join().expect("waiter");
    let waited = released.elapsed();
    assert!(got.is_ok(), "{got:?}");
    let bound = redmutex::DEFAULT_TIMEOUT * 2 + Duration::from_secs(1);
    assert!(
        waited < bound,
        "the waiter slept {waited:?} after the release"
    );
}

/// Case 12: the holder's link is partitioned (ttl 1 s) while another
/// client waits on a healthy link. On main the second client acquired
/// 0.7-1.0 s into the partition and the holder's loss signal fired 1.3 s
/// after that. Now, in every one of ten runs, the holder's signal reads
/// lost by the time the other client holds the lock.
#[test]
fn the_loss_signal_fires_before_anyone_else_can_acquire() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let holder = LockClient::open(&proxy.url()).expect("client");
    let other = server.lock_client();
    let ttl = Duration::from_secs(1);
    for run in 0..10 {
        let key = format!("p{run}");
        let guard = DistributedLock::with_options(
            &holder,
            key.clone(),
            LockOptions::default().ttl(ttl).watchdog(true),
        )
        .lock()
        .expect("lock");
        let signal = guard.loss_signal();
        // A renewal or two first, then the partition.
        std::thread::sleep(Duration::from_millis(400));
        proxy.blackhole(true);
        let partitioned = Instant::now();
        let theirs = DistributedLock::with_options(
            &other,
            key.clone(),
            LockOptions::default()
                .ttl(Duration::from_secs(5))
                .wait_mode(WaitMode::Spin)
                .backoff(Backoff::constant(Duration::from_millis(2))),
        )
        .try_lock_for(Duration::from_secs(5))
        .expect("other client")
        .expect("acquired after the expiry");
        let acquired = partitioned.elapsed();
        assert!(
            signal.is_lost(),
            "run {run}: the other client acquired {acquired:?} into the partition \
             while the holder's signal was not fired"
        );
        assert!(guard.is_lost());
        assert!(guard.validity().is_zero());
        theirs.unlock().expect("unlock");
        proxy.heal();
        drop(guard);
    }
}

/// A stalled server (DEBUG SLEEP) during an acquisition: bounded by the
/// resend window, and whatever the stalled request did is cleaned up.
#[test]
fn a_stalled_server_bounds_the_call_and_leaves_no_lease() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let client = LockClient::builder()
        .url(server.url())
        .timeout(T)
        .build()
        .expect("client");
    let lock = DistributedLock::with_options(&client, "z", options());
    let sleeper = {
        let url = server.url();
        std::thread::spawn(move || {
            let mut con = redis::Client::open(url)
                .expect("url")
                .get_connection()
                .expect("connection");
            let _: redis::RedisResult<()> =
                redis::cmd("DEBUG").arg("SLEEP").arg(1.5).query(&mut con);
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    let result = lock.try_lock();
    let took = started.elapsed();
    assert!(took < T * 4, "took {took:?}");
    sleeper.join().expect("sleeper");
    match result {
        Ok(Some(guard)) => drop(guard.unlock().expect("unlock")),
        Ok(None) => panic!("nobody holds it"),
        Err(err) => {
            assert!(err.is_connection(), "{err}");
            assert!(wait_until(Duration::from_secs(5), || !exists(&server, "z")));
        }
    }
    let _: () = server.conn().del("z").expect("DEL");
}

/// Case 4 for Sentinel: a sentinel that accepts and never answers. The
/// lookup is bounded by the timeout; with every sentinel stalled the call
/// fails within its timeouts, and dropping the client does not wait for
/// the subscriber's lookup.
#[test]
fn a_stalled_sentinel_never_hangs_a_call_or_a_drop() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    proxy.stall_new(true);
    let client = LockClient::builder()
        .sentinel([proxy.url()], "nobody")
        .sentinel_primary(redis::RedisConnectionInfo::default())
        .timeout(T)
        .build()
        .expect("client");
    let lock = DistributedLock::with_options(&client, "s", options());
    for _ in 0..3 {
        let started = Instant::now();
        let err = lock.try_lock().expect_err("stalled");
        assert!(err.is_connection(), "{err}");
        assert!(
            started.elapsed() < T * 3,
            "bounded: {:?}",
            started.elapsed()
        );
    }
    let started = Instant::now();
    drop(lock);
    drop(client);
    assert!(started.elapsed() < Duration::from_millis(500));
}

/// A RedLock node that cannot be reached at release time: `unlock()` says
/// so, and that node's key is released in the background once it answers.
#[test]
fn a_redlock_release_that_misses_a_node_is_finished_later() {
    let _serial = support::serial();
    let servers = RedisServer::start_many(3);
    let proxy = FaultProxy::to(&servers[0]);
    let nodes = vec![
        client(&proxy),
        servers[1].lock_client(),
        servers[2].lock_client(),
    ];
    let lock = redmutex::RedLock::with_options(
        nodes,
        "rl",
        options()
            .with_extra(Default::default())
            .node_timeout(Duration::from_secs(1)),
    )
    .expect("redlock");
    let guard = lock.lock().expect("lock");
    // Every node has the key before the blackhole (the round returned at
    // the majority).
    assert!(wait_until(Duration::from_secs(5), || exists(
        &servers[0],
        "rl"
    )));
    proxy.blackhole(true);
    guard
        .unlock()
        .expect("released on the majority; the unreachable node is not waited for");
    assert!(
        exists(&servers[0], "rl"),
        "still set on the unreachable node"
    );
    proxy.heal();
    assert!(
        wait_until(Duration::from_secs(10), || !exists(&servers[0], "rl")),
        "released on the node once it answered"
    );
}

/// A release that failed (Redis cut off) is still to be cleaned up when
/// the client is dropped, and Redis answers again only a moment later:
/// drop waits (one I/O timeout at most) for the cleanup, so the key is
/// gone when it returns. (Whether the watchdog thread has already taken
/// the cleanup into a round when drop comes is up to the scheduler; both
/// are waited for.)
#[test]
fn a_drop_waits_for_the_cleanup_round_in_progress() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy);
    // The watchdog thread already runs (a watched lease started it), so
    // it takes the orphan into a round at once.
    DistributedLock::with_options(&client, "warm", options().watchdog(true))
        .lock()
        .expect("lock")
        .unlock()
        .expect("unlock");
    let guard = DistributedLock::with_options(&client, "round", options())
        .lock()
        .expect("lock");
    proxy.blackhole(true);
    let err = guard.unlock().expect_err("cut off");
    assert!(err.is_connection(), "{err}");
    // The cleanup thread is now at it, through the blackhole; the heal
    // comes while the client is being dropped.
    let healer = {
        let proxy = std::sync::Arc::new(proxy);
        let healing = proxy.clone();
        (
            proxy,
            std::thread::spawn(move || {
                // Past the 100 ms a drop waits for an idle thread, within
                // the one timeout it waits for a cleanup round.
                std::thread::sleep(Duration::from_millis(300));
                healing.heal();
            }),
        )
    };
    drop(client);
    // Checked the moment drop returns: the round had to end first.
    let left = exists(&server, "round");
    healer.1.join().expect("healer");
    assert!(!left, "drop returned with the key left behind");
}
