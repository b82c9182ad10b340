//! A reply lost after Redis ran the command, for every operation the crate
//! sends: the fault-injecting proxy forwards the request, lets the server
//! run it, and cuts the connection before the reply gets back. The property
//! (see `src/policy.rs`): an operation whose reply was lost is applied at
//! most once, and its caller is told the truth.

use redmutex_test_support as support;

use std::time::{Duration, Instant};

use redis::Commands;
use redmutex::Lease;
use redmutex::{
    DistributedLock, LockClient, LockOptions, RedLock, ReentrantLock, Release, RwLock, Unlocked,
    WaitMode,
};
use support::{FaultProxy, RedisServer, exists, get, sha, wait_until};

const ACQUIRE: &str = include_str!("../lua/acquire.lua");
const RELEASE: &str = include_str!("../lua/release.lua");
const EXTEND: &str = include_str!("../lua/extend.lua");
const REENTRANT_ACQUIRE: &str = include_str!("../lua/reentrant_acquire.lua");
const REENTRANT_RELEASE: &str = include_str!("../lua/reentrant_release.lua");
const RW_ACQUIRE: &str = include_str!("../lua/rw_acquire.lua");
const RW_RELEASE: &str = include_str!("../lua/rw_release.lua");
const RW_EXTEND: &str = include_str!("../lua/rw_extend.lua");
const REENTRANT_EXTEND: &str = include_str!("../lua/reentrant_extend.lua");

/// A server with the scripts loaded, so a lost reply follows a command
/// that ran.
fn server() -> RedisServer {
    let server = RedisServer::start();
    support::load_scripts(&server);
    server
}

/// A client whose every connection goes through `proxy`.
fn client(proxy: &FaultProxy) -> LockClient {
    LockClient::open(&proxy.url()).expect("client")
}

fn options() -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_secs(5))
}

/// Case 1: the reentrant release's reply is lost. On main the resend
/// decremented the count twice: `inner.unlock()` said `Released` while
/// `outer` was alive, and another thread could take the lock.
#[test]
fn reentrant_release_applies_once_after_a_lost_reply() {
    let server = server();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy);
    let lock =
        ReentrantLock::with_options(&client, "acct", options().with_extra(Default::default()));
    let outer = lock.lock().expect("outer");
    let inner = lock.lock().expect("inner");
    proxy.lose_reply(&sha(REENTRANT_RELEASE), 1);
    assert_eq!(inner.unlock().expect("inner unlock"), Unlocked::StillHeld);
    assert_eq!(proxy.lost_replies(), 1, "the fault fired");
    assert!(exists(&server, "acct"), "outer still holds it");
    let other = {
        let client = client.clone();
        std::thread::spawn(move || {
            ReentrantLock::new(&client, "acct")
                .try_lock()
                .map(|g| g.is_some())
        })
        .join()
        .expect("thread")
    };
    assert!(!other.expect("try_lock"), "another thread must not get it");
    // The last release's reply lost too: the marker says it was done.
    proxy.lose_reply(&sha(REENTRANT_RELEASE), 1);
    assert_eq!(outer.unlock().expect("outer unlock"), Unlocked::Released);
    assert_eq!(proxy.lost_replies(), 2);
    assert!(!exists(&server, "acct"));
}

/// Case 1, acquiring: a resent reentrant acquire must not count the hold
/// twice (on main the key then outlived its holder by a whole ttl).
#[test]
fn reentrant_acquire_counts_once_after_a_lost_reply() {
    let server = server();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy);
    let lock =
        ReentrantLock::with_options(&client, "acct", options().with_extra(Default::default()));
    proxy.lose_reply(&sha(REENTRANT_ACQUIRE), 1);
    let guard = lock.lock().expect("lock");
    assert_eq!(proxy.lost_replies(), 1);
    assert_eq!(guard.depth(), 1);
    let fields: usize = server.conn().hlen("acct").expect("HLEN");
    assert_eq!(fields, 2, "owner + one hold");
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    assert!(!exists(&server, "acct"), "one release frees it");
}

/// Case 2: a lost reply on `RwLock::write`'s grant. On main the resend was
/// refused by the writer's own hold: `Timeout`, and the hash held for the
/// whole ttl with no guard.
#[test]
fn rwlock_write_grant_is_recognised_after_a_lost_reply() {
    let server = server();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy);
    let lock = RwLock::with_options(&client, "catalog", options().with_extra(Default::default()));
    proxy.lose_reply(&sha(RW_ACQUIRE), 1);
    let started = Instant::now();
    let writer = lock.write().expect("write");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "no wait for itself"
    );
    assert_eq!(proxy.lost_replies(), 1);
    let held: Option<String> = server.conn().hget("catalog", "w").expect("HGET");
    assert_eq!(held.as_deref(), Some(writer.token()));
    proxy.lose_reply(&sha(RW_RELEASE), 1);
    writer.unlock().expect("unlock after a lost reply is Ok");
    assert_eq!(proxy.lost_replies(), 2);
    assert!(!exists(&server, "catalog"));
    // Readers too.
    proxy.lose_reply(&sha(RW_ACQUIRE), 1);
    let reader = lock.read().expect("read");
    assert_eq!(proxy.lost_replies(), 3);
    proxy.lose_reply(&sha(RW_RELEASE), 1);
    reader.unlock().expect("unlock");
    assert!(!exists(&server, "catalog"));
}

/// Case 3: a plain release whose reply is lost is `Ok`, not
/// `NotHeld { Expired }`; with both release methods.
#[test]
fn a_release_that_deleted_our_key_is_ok_after_a_lost_reply() {
    let server = server();
    let proxy = FaultProxy::to(&server);
    for (release, pattern) in [
        (Release::Lua, sha(RELEASE)),
        (Release::Watch, "MULTI".into()),
    ] {
        // Each case on its own client: nothing learnt from the other.
        let client = client(&proxy);
        let lock = DistributedLock::with_options(&client, "job", options().release(release));
        let guard = lock.lock().expect("lock");
        let lost = proxy.lost_replies();
        proxy.lose_reply(&pattern, 1);
        guard.unlock().expect("the release happened: Ok");
        assert_eq!(
            proxy.lost_replies(),
            lost + 1,
            "{release:?}: the fault fired"
        );
        assert!(!exists(&server, "job"));
        // And a release that really finds the lock gone still says so.
        let guard = lock.lock().expect("lock");
        let _: () = server.conn().del("job").expect("DEL");
        assert_eq!(
            guard.unlock().expect_err("gone").not_held_reason(),
            Some(redmutex::LossReason::Expired)
        );
    }
}

/// A lost reply on the acquisition itself: the caller holds a guard whose
/// token Redis has, acquired once; for the plain `SET`, the acquire script
/// and a fenced acquisition (the counter bumped once).
#[test]
fn acquisitions_are_recognised_after_a_lost_reply() {
    let server = server();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy);
    let plain = DistributedLock::with_options(&client, "a", options());
    proxy.lose_reply(&support::quick_acquire_pattern(), 1);
    let guard = plain.lock().expect("lock");
    assert_eq!(proxy.lost_replies(), 1);
    assert_eq!(get(&server, "a").as_deref(), Some(guard.token()));
    guard.unlock().expect("unlock");

    let fenced = DistributedLock::with_options(&client, "f", options().fencing(true));
    proxy.lose_reply(&sha(ACQUIRE), 1);
    let guard = fenced.lock().expect("lock");
    assert_eq!(proxy.lost_replies(), 2);
    assert_eq!(get(&server, "f").as_deref(), Some(guard.token()));
    let token = guard.fencing_token().expect("a token");
    assert!(support::clock_floored(token), "{token}");
    assert_eq!(
        get(&server, "{f}:fence"),
        Some(token.to_string()),
        "the counter was bumped once: the resend found its own token"
    );
    guard.unlock().expect("unlock");
    let again = fenced.lock().expect("lock");
    assert!(again.fencing_token().expect("a token") > token);
    again.unlock().expect("unlock");
    assert!(client.stats().resends >= 2, "{:?}", client.stats());
}

/// Extend and the watchdog's renewals are safe to resend.
#[test]
fn extend_and_renewals_survive_lost_replies() {
    let server = server();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy);
    let lock = DistributedLock::with_options(&client, "e", options());
    let mut guard = lock.lock().expect("lock");
    proxy.lose_reply(&sha(EXTEND), 1);
    guard.extend(Duration::from_secs(60)).expect("extend");
    assert_eq!(proxy.lost_replies(), 1);
    let pttl: i64 = server.conn().pttl("e").expect("PTTL");
    assert!(pttl > 59_000, "{pttl}");
    guard.unlock().expect("unlock");

    let watched = DistributedLock::with_options(
        &client,
        "w",
        options().ttl(Duration::from_millis(600)).watchdog(true),
    );
    let guard = watched.lock().expect("lock");
    proxy.lose_reply(&sha(EXTEND), 2);
    let renewed = wait_until(Duration::from_secs(10), || {
        proxy.lost_replies() >= 3 && client.stats().renewals >= 4
    });
    assert!(renewed, "{:?}", client.stats());
    std::thread::sleep(Duration::from_millis(700));
    assert!(!guard.is_lost(), "renewals went on after the lost replies");
    assert_eq!(get(&server, "w").as_deref(), Some(guard.token()));
    guard.unlock().expect("unlock");
}

/// More lost replies than resends: the caller gets `OutcomeUnknown`, and
/// the token its request set is released in the background, so no lease of
/// ours outlives the error by more than the cleanup's first steps.
#[test]
fn an_acquisition_whose_outcome_is_unknown_leaves_no_lease() {
    let server = server();
    let proxy = FaultProxy::to(&server);
    for (name, pattern, lock) in [
        ("plain", support::quick_acquire_pattern(), options()),
        ("fenced", sha(ACQUIRE), options().fencing(true)),
    ] {
        // Each case on its own client: nothing learnt from the other.
        let client = client(&proxy);
        let key = format!("u-{name}");
        proxy.lose_reply(&pattern, 3);
        let err = DistributedLock::with_options(&client, key.clone(), lock)
            .try_lock()
            .expect_err("every reply lost");
        assert!(err.is_outcome_unknown(), "{name}: {err}");
        assert_eq!(proxy.armed(), 0, "{name}: sent three times");
        let gone = wait_until(Duration::from_secs(5), || !exists(&server, &key));
        assert!(gone, "{name}: the orphan lease was released");
        // Counted once the cleanup has its reply, which may come just
        // after the key is seen gone.
        assert!(
            wait_until(Duration::from_secs(5), || client.stats().orphans_released
                >= 1),
            "{name}: {:?}",
            client.stats()
        );
    }
    let client = client(&proxy);

    // The same for the reentrant and read-write locks.
    proxy.lose_reply(&sha(REENTRANT_ACQUIRE), 3);
    let err = ReentrantLock::new(&client, "u-re")
        .try_lock()
        .expect_err("lost");
    assert!(err.is_outcome_unknown(), "{err}");
    assert!(wait_until(Duration::from_secs(5), || !exists(
        &server, "u-re"
    )));
    proxy.lose_reply(&sha(RW_ACQUIRE), 3);
    let err = RwLock::new(&client, "u-rw").try_write().expect_err("lost");
    assert!(err.is_outcome_unknown(), "{err}");
    assert!(wait_until(Duration::from_secs(5), || !exists(
        &server, "u-rw"
    )));
}

/// Random numbers of lost replies on acquisitions and releases: after
/// each round either the caller held a guard whose token Redis had, or it
/// got an error and no lease of ours is left; nothing is ever held twice.
#[test]
fn random_lost_replies_never_leave_a_lease_or_lie() {
    let server = server();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy);
    let mut dice = support::Dice(0x9E37_79B9_7F4A_7C15);
    let mut next = move |n: u64| dice.below(n);
    let mut held = 0;
    for round in 0..40 {
        let mode = if next(2) == 0 {
            WaitMode::Spin
        } else {
            WaitMode::Notify
        };
        let lock = DistributedLock::with_options(
            &client,
            "r",
            options().wait_mode(mode).fencing(next(2) == 0),
        );
        proxy.heal();
        proxy.lose_reply(&support::quick_acquire_pattern(), next(4) as u32);
        proxy.lose_reply(&sha(ACQUIRE), next(4) as u32);
        match lock.try_lock() {
            Ok(Some(guard)) => {
                held += 1;
                assert_eq!(
                    get(&server, "r").as_deref(),
                    Some(guard.token()),
                    "round {round}"
                );
                proxy.heal();
                proxy.lose_reply(&sha(RELEASE), next(3) as u32);
                match guard.unlock() {
                    Ok(_) => assert!(!exists(&server, "r"), "round {round}"),
                    Err(err) => assert!(err.is_outcome_unknown(), "round {round}: {err}"),
                }
            }
            Ok(None) => panic!("round {round}: nobody else holds it"),
            Err(err) => assert!(err.is_outcome_unknown(), "round {round}: {err}"),
        }
        proxy.heal();
        let clean = wait_until(Duration::from_secs(5), || !exists(&server, "r"));
        assert!(clean, "round {round}: a lease of ours was left behind");
    }
    assert!(held > 10, "most rounds acquire: {held}");
}

/// RedLock over three nodes, one of them losing replies: acquired once per
/// node, released everywhere, `unlock()` Ok.
#[test]
fn redlock_survives_lost_replies_on_a_node() {
    let servers = RedisServer::start_many(3);
    servers.iter().for_each(support::load_scripts);
    let proxy = FaultProxy::to(&servers[0]);
    let nodes = vec![
        client(&proxy),
        servers[1].lock_client(),
        servers[2].lock_client(),
    ];
    let lock = RedLock::with_options(
        nodes,
        "rl",
        options()
            .with_extra(Default::default())
            .ttl(Duration::from_secs(10))
            .node_timeout(Duration::from_secs(2)),
    )
    .expect("redlock");
    proxy.lose_reply(&support::quick_acquire_pattern(), 1);
    let guard = lock.lock().expect("lock");
    // The round is decided at the majority: the proxied node's resend
    // (after its lost reply) may still be on its way.
    assert!(wait_until(Duration::from_secs(5), || proxy.lost_replies() == 1));
    for server in &servers {
        assert!(
            wait_until(Duration::from_secs(5), || get(server, "rl").as_deref()
                == Some(guard.token())),
            "acquired on every node"
        );
    }
    proxy.lose_reply(&sha(RELEASE), 1);
    guard.unlock().expect("unlock");
    // `unlock()` returned at the majority; the proxied node's release
    // (resent after its lost reply) finishes in the background.
    assert!(wait_until(Duration::from_secs(5), || proxy.lost_replies() == 2));
    for server in &servers {
        assert!(wait_until(Duration::from_secs(5), || !exists(server, "rl")));
    }
}

/// `min_replicas`: the `WAIT` reply lost. The resend finds its own token,
/// writes on its new connection so `WAIT` has something to wait for, and
/// the lock is granted once the replica has it.
#[test]
fn a_lost_wait_reply_is_resent_on_a_connection_that_wrote() {
    let primary = server();
    let replica = RedisServer::start_replica_of(&primary);
    let proxy = FaultProxy::to(&primary);
    let client = client(&proxy);
    let lock = DistributedLock::with_options(
        &client,
        "rep",
        options().min_replicas(1, Duration::from_millis(1000)),
    );
    proxy.lose_reply("WAIT", 1);
    let guard = lock.lock().expect("lock");
    assert_eq!(proxy.lost_replies(), 1);
    let on_replica = wait_until(Duration::from_secs(5), || {
        get(&replica, "rep").as_deref() == Some(guard.token())
    });
    assert!(on_replica);
    guard.unlock().expect("unlock");

    // Every WAIT reply lost: an error, and the key released again.
    proxy.lose_reply("WAIT", 3);
    let err = lock.try_lock().expect_err("lost");
    assert!(err.is_outcome_unknown(), "{err}");
    assert!(wait_until(Duration::from_secs(5), || !exists(
        &primary, "rep"
    )));
}

/// A resend answered with an error (here `OOM`: the server filled up
/// between the first send, which ran, and the resend): the first send may
/// have set the key, so the outcome is unknown, not a plain Redis error,
/// and the lease is cleaned up.
#[test]
fn an_error_answering_a_resend_is_an_unknown_outcome() {
    let server = server();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy);
    let lock = DistributedLock::with_options(&client, "oom", options());
    drop(lock.try_lock().expect("warm a connection"));
    // The first SET is held a moment on its way, so the watcher can fill
    // the server up before the resend.
    proxy.set_latency(Duration::from_millis(300), Duration::ZERO);
    proxy.lose_reply(&support::quick_acquire_pattern(), 1);
    let watcher = {
        let url = server.url();
        std::thread::spawn(move || {
            let mut con = redis::Client::open(url)
                .expect("url")
                .get_connection()
                .expect("connection");
            wait_until(Duration::from_secs(5), || {
                let set: Option<String> =
                    redis::cmd("GET").arg("oom").query(&mut con).ok().flatten();
                set.is_some()
                    && redis::cmd("CONFIG")
                        .arg("SET")
                        .arg("maxmemory")
                        .arg("1")
                        .query::<()>(&mut con)
                        .is_ok()
            })
        })
    };
    let result = lock.try_lock();
    assert!(watcher.join().expect("watcher"), "the first SET ran");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("0")
        .query(&mut server.conn())
        .expect("CONFIG SET");
    proxy.heal();
    if support::server_major() < 7 {
        // Before Redis 7.0 the quick path is the acquire script, which the
        // server refuses for memory only at a write: the resend writes
        // nothing, recognises the token the first send set, and the lock
        // is simply ours.
        let guard = result.expect("recognised").expect("ours");
        assert_eq!(get(&server, "oom").as_deref(), Some(guard.token()));
        guard.unlock().expect("unlock");
        return;
    }
    let err = result.map(|g| g.is_some()).expect_err("refused");
    assert!(err.is_outcome_unknown(), "{err}");
    assert!(
        wait_until(Duration::from_secs(5), || !exists(&server, "oom")),
        "the lease the first send set was released"
    );
}

/// A client dropped right after an acquisition of unknown outcome (a
/// program that exits on the error) still releases what the request may
/// have set: the watchdog thread makes one last cleanup round.
#[test]
fn a_client_dropped_after_an_unknown_acquisition_leaves_no_lease() {
    let server = server();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy);
    proxy.lose_reply(&support::quick_acquire_pattern(), 3);
    let err = DistributedLock::with_options(&client, "bye", options())
        .try_lock()
        .expect_err("lost");
    assert!(err.is_outcome_unknown(), "{err}");
    drop(client);
    assert!(
        wait_until(Duration::from_secs(3), || !exists(&server, "bye")),
        "the lease was left for its ttl"
    );
}

/// `force_release` whose reply is lost: the resend answers from the
/// request's marker what the first send deleted, and deletes nothing more
/// (here: not the lock another client took in between).
#[test]
fn a_force_release_sent_again_deletes_nothing_more() {
    let server = server();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy);
    let holder = server.lock_client();
    let guard = DistributedLock::new(&holder, "forced")
        .lock()
        .expect("lock");
    let token = guard.token().to_owned();
    std::mem::forget(guard);
    // The first send deletes the key and its reply is lost; before the
    // resend, another client takes the lock.
    let sha = sha(include_str!("../lua/force_release.lua"));
    proxy.set_latency(Duration::ZERO, Duration::from_millis(200));
    proxy.lose_reply(&sha, 1);
    let taker = {
        // Another client (the holder's leaked guard keeps a local hold).
        let other = server.lock_client();
        let server_url = server.url();
        std::thread::spawn(move || {
            let mut con = redis::Client::open(server_url)
                .expect("url")
                .get_connection()
                .expect("connection");
            wait_until(Duration::from_secs(5), || {
                !redis::cmd("EXISTS")
                    .arg("forced")
                    .query::<bool>(&mut con)
                    .unwrap_or(true)
            });
            DistributedLock::new(&other, "forced").lock().map(|g| {
                let token = g.token().to_owned();
                std::mem::forget(g);
                token
            })
        })
    };
    let forced = DistributedLock::new(&client, "forced")
        .force_release()
        .expect("force release");
    assert_eq!(proxy.lost_replies(), 1, "the fault fired");
    assert_eq!(
        forced.as_deref(),
        Some(token.as_str()),
        "what the first send deleted"
    );
    let new_token = taker
        .join()
        .expect("taker")
        .expect("the other client's lock");
    assert_eq!(
        get(&server, "forced").as_deref(),
        Some(new_token.as_str()),
        "the lock taken in between survives the resend"
    );
}

/// `list`'s steps are reads: a lost reply to a `SCAN` step or to the
/// inspect script's pipeline is resent on a fresh connection, and the
/// listing is whole.
#[test]
fn a_listing_survives_lost_replies_to_its_scan_and_inspect_steps() {
    const INSPECT: &str = include_str!("../lua/inspect.lua");
    let server = server();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy);
    let guard = DistributedLock::with_options(&client, "listed", options())
        .lock()
        .expect("lock");
    for pattern in ["SCAN".to_string(), sha(INSPECT)] {
        let resends = client.stats().resends;
        proxy.lose_reply(&pattern, 1);
        let listing = client.list("*", Duration::from_secs(10)).expect("list");
        assert_eq!(proxy.armed(), 0, "{pattern}: the reply was lost");
        assert!(listing.complete);
        assert_eq!(listing.held.len(), 1, "{pattern}: {listing:?}");
        assert_eq!(listing.held[0].key, "listed");
        assert!(client.stats().resends > resends, "{pattern}: resent");
    }
    guard.unlock().expect("unlock");
}

/// A queued waiter's `SET NX PX GET` found the key held and the reply to
/// the `PTTL` after it was lost: both are sent again (the `SET` finds the
/// key still another's, the `PTTL` only reads), nothing in Redis changes,
/// and the waiter takes the lock once it is released.
#[test]
fn a_waiters_lost_pttl_reply_is_sent_again() {
    // Before 7.0 a waiter sends `lua/acquire.lua` instead (no `SET NX` with
    // `GET`, so no `PTTL` after it): its lost reply is covered above.
    if support::server_major() < 7 {
        return;
    }
    let server = server();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy);
    let holder = server.lock_client();
    let held = DistributedLock::with_options(&holder, "w", options())
        .lock()
        .expect("the holder");
    proxy.lose_reply("*2\r\n$4\r\nPTTL\r\n", 1);
    let lock = DistributedLock::with_options(&client, "w", options());
    let (token, stored) = std::thread::scope(|scope| {
        let waiter = scope.spawn(|| {
            let guard = lock.lock().expect("the waiter's lock");
            let stored = get(&server, "w");
            let token = guard.token().to_owned();
            guard.unlock().expect("the waiter's unlock");
            (token, stored)
        });
        assert!(
            wait_until(Duration::from_secs(5), || proxy.lost_replies() == 1),
            "the head waiter's PTTL reply was never lost"
        );
        assert_eq!(get(&server, "w").as_deref(), Some(held.token()));
        held.unlock().expect("the holder's unlock");
        waiter.join().expect("waiter")
    });
    assert_eq!(stored.as_deref(), Some(token.as_str()));
    assert!(client.stats().resends >= 1, "{:?}", client.stats());
}

/// A fenced writer's or first reentrant hold's grant whose reply is lost:
/// the resend recognises the grant and returns the token it drew, without
/// drawing another (the counter moved once).
#[test]
fn a_fenced_grant_is_recognised_with_its_token_after_a_lost_reply() {
    let server = server();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy);
    let rw = RwLock::with_options(
        &client,
        "fenced-rw",
        options()
            .with_extra(redmutex::RwLockExtra::default())
            .fencing(true),
    );
    proxy.lose_reply(&sha(RW_ACQUIRE), 1);
    let writer = rw.write().expect("write");
    assert_eq!(proxy.lost_replies(), 1);
    let counter: u64 = server
        .conn()
        .get(client.fence_key("fenced-rw"))
        .expect("the counter");
    assert_eq!(writer.fencing_token(), Some(counter), "the token it drew");
    writer.unlock().expect("unlock");

    let reentrant = ReentrantLock::with_options(
        &client,
        "fenced-re",
        options()
            .with_extra(redmutex::ReentrantExtra::default())
            .fencing(true),
    );
    proxy.lose_reply(&sha(REENTRANT_ACQUIRE), 1);
    let hold = reentrant.lock().expect("lock");
    assert_eq!(proxy.lost_replies(), 2);
    let counter: u64 = server
        .conn()
        .get(client.fence_key("fenced-re"))
        .expect("the counter");
    assert_eq!(hold.fencing_token(), Some(counter));
    assert_eq!(hold.depth(), 1, "one hold, counted once");
    hold.unlock().expect("unlock");
}

/// `min_replicas` on a read-write and a reentrant lock: the `WAIT` reply
/// lost. The resend renews the hold on its new connection, so `WAIT` has a
/// write to wait for, and the hold is granted once the replica has it;
/// every reply lost is an unknown outcome that leaves nothing behind.
#[test]
fn a_lost_wait_reply_is_resent_for_the_lock_family() {
    let primary = server();
    let replica = RedisServer::start_replica_of(&primary);
    let proxy = FaultProxy::to(&primary);
    let client = client(&proxy);
    let wait = Duration::from_millis(1000);
    let rw = RwLock::with_options(
        &client,
        "rep-rw",
        options()
            .with_extra(redmutex::RwLockExtra::default())
            .min_replicas(1, wait),
    );
    let reentrant = ReentrantLock::with_options(
        &client,
        "rep-re",
        options()
            .with_extra(redmutex::ReentrantExtra::default())
            .min_replicas(1, wait),
    );
    let on_replica = |key: &str| -> bool {
        let fields: Vec<String> = replica.conn().hkeys(key).unwrap_or_default();
        !fields.is_empty()
    };
    proxy.lose_reply("WAIT", 1);
    let writer = rw.write().expect("write");
    assert_eq!(proxy.lost_replies(), 1);
    assert!(wait_until(Duration::from_secs(5), || on_replica("rep-rw")));
    writer.unlock().expect("unlock");
    proxy.lose_reply("WAIT", 1);
    let hold = reentrant.lock().expect("lock");
    assert_eq!(proxy.lost_replies(), 2);
    assert!(wait_until(Duration::from_secs(5), || on_replica("rep-re")));
    hold.unlock().expect("unlock");

    proxy.lose_reply("WAIT", 3);
    let err = rw.try_write().expect_err("lost");
    assert!(err.is_outcome_unknown(), "{err}");
    proxy.lose_reply("WAIT", 3);
    let err = reentrant.try_lock().expect_err("lost");
    assert!(err.is_outcome_unknown(), "{err}");
    assert!(wait_until(Duration::from_secs(5), || {
        !exists(&primary, "rep-rw") && !exists(&primary, "rep-re")
    }));
}

/// The watchdog's renewals of a read-write and a reentrant hold are safe
/// to resend: replies lost, the holds stay renewed and never read as lost.
#[test]
fn family_renewals_survive_lost_replies() {
    let server = server();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy);
    let watched = options().ttl(Duration::from_millis(600)).watchdog(true);
    let writer = RwLock::with_options(&client, "wr", watched.with_extra(Default::default()))
        .write()
        .expect("write");
    let hold = ReentrantLock::with_options(&client, "wre", watched.with_extra(Default::default()))
        .lock()
        .expect("lock");
    proxy.lose_reply(&sha(RW_EXTEND), 2);
    proxy.lose_reply(&sha(REENTRANT_EXTEND), 2);
    let renewed = wait_until(Duration::from_secs(10), || {
        proxy.lost_replies() >= 4 && client.stats().renewals >= 8
    });
    assert!(renewed, "{:?}", client.stats());
    let until = Instant::now() + Duration::from_millis(700);
    while Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!writer.is_lost() && !hold.is_lost(), "renewed on");
    assert!(writer.is_held().expect("is_held") && hold.is_held().expect("is_held"));
    writer.unlock().expect("unlock");
    hold.unlock().expect("unlock");
}

/// Every script of `lua/` is in the list the tests load before arming a
/// lost reply on it: a script not loaded would meet the fault as a
/// `NOSCRIPT` answer, not as a command that ran.
#[test]
fn every_script_is_loaded_before_a_fault_is_armed_on_it() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/lua");
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .expect("lua/")
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            name.strip_suffix(".lua").map(str::to_owned)
        })
        .collect();
    files.sort();
    let mut listed: Vec<String> = support::SCRIPTS
        .iter()
        .map(|(name, _)| (*name).to_owned())
        .collect();
    listed.sort();
    assert_eq!(files, listed);
}
