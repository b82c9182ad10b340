//! The capability matrix of the crate docs ("Capabilities by lock type"),
//! cell by cell, against real Redis: every ✓ is exercised here and fails
//! the test if it does not work. Each cell runs on fresh servers and a
//! fresh client.

use redmutex_test_support as support;

use std::time::{Duration, Instant};

use redmutex::{
    DistributedLock, Error, FairLock, FairLockOptions, Lease, LockClient, LockKind, LockOptions,
    LossReason, MultiLock, MultiLockOptions, RedLock, ReentrantLock, RwLock, Semaphore,
    SemaphoreOptions, Unlocked,
};
use support::{RedisServer, numsub, wait_until};

/// The whole `Lease` contract, written once against the trait: held and
/// asked, extended, then broken in Redis by `break_it` and found lost by
/// every way the contract offers.
fn lease_contract<L: Lease>(mut lease: L, break_it: impl FnOnce()) {
    assert!(!lease.key().is_empty());
    assert!(
        lease.validity() > Duration::ZERO,
        "validity of a fresh lease"
    );
    assert!(!lease.is_lost());
    assert!(lease.is_held().expect("is_held"), "asks Redis: held");
    lease.extend(Duration::from_secs(40)).expect("extend");
    assert!(lease.validity() > Duration::from_secs(30), "extended");
    let signal = lease.loss_signal();
    assert_eq!(signal.reason(), None);

    break_it();
    assert!(!lease.is_held().expect("is_held"), "asks Redis: gone");
    let err = lease
        .extend(Duration::from_secs(40))
        .expect_err("never re-created");
    assert_eq!(err.not_held_reason(), Some(LossReason::Expired), "{err}");
    assert!(lease.is_lost(), "found lost");
    assert_eq!(lease.validity(), Duration::ZERO, "zero once lost");
    assert_eq!(
        signal.wait_timeout(Duration::from_secs(5)),
        Some(LossReason::Expired),
        "the signal fired"
    );
    let unlocked = lease.unlock();
    assert!(
        matches!(unlocked, Err(Error::NotHeld { .. })),
        "unlock of a lost lease: {unlocked:?}"
    );
}

fn delete<'a>(server: &'a RedisServer, key: &str) -> impl FnOnce() + 'a {
    let key = key.to_owned();
    move || {
        let _: () = redis::cmd("DEL")
            .arg(&key)
            .query(&mut server.conn())
            .expect("DEL");
    }
}

#[test]
fn the_lease_contract_holds_for_every_lock_type() {
    {
        let server = RedisServer::start();
        let client = server.lock_client();
        let guard = DistributedLock::new(&client, "cap:lock")
            .lock()
            .expect("lock");
        lease_contract(guard, delete(&server, "cap:lock"));
    }
    {
        let server = RedisServer::start();
        let client = server.lock_client();
        let guard = ReentrantLock::new(&client, "cap:reentrant")
            .lock()
            .expect("lock");
        lease_contract(guard, delete(&server, "cap:reentrant"));
    }
    {
        let server = RedisServer::start();
        let client = server.lock_client();
        let guard = RwLock::new(&client, "cap:read").read().expect("read");
        lease_contract(guard, delete(&server, "cap:read"));
    }
    {
        let server = RedisServer::start();
        let client = server.lock_client();
        let guard = RwLock::new(&client, "cap:write").write().expect("write");
        lease_contract(guard, delete(&server, "cap:write"));
    }
    {
        let server = RedisServer::start();
        let client = server.lock_client();
        let permit = Semaphore::new(&client, "cap:sem", 2)
            .acquire()
            .expect("permit");
        lease_contract(permit, delete(&server, "cap:sem"));
    }
    {
        // A plain lock's guard made movable keeps the whole contract, on
        // whichever thread it is.
        let server = RedisServer::start();
        let client = server.lock_client();
        let guard = DistributedLock::new(&client, "cap:movable")
            .lock()
            .expect("lock")
            .into_movable()
            .expect("movable");
        let server_ref = &server;
        std::thread::scope(|scope| {
            scope.spawn(move || lease_contract(guard, delete(server_ref, "cap:movable")));
        });
    }
    {
        // A set of keys is one lease: one key gone loses the set.
        let server = RedisServer::start();
        let client = server.lock_client();
        let guard = MultiLock::new(&client, ["cap:multi-a", "cap:multi-b"])
            .lock()
            .expect("lock");
        lease_contract(guard, delete(&server, "cap:multi-b"));
    }
    {
        let server = RedisServer::start();
        let client = server.lock_client();
        let guard = FairLock::new(&client, "cap:fair").lock().expect("lock");
        lease_contract(guard, delete(&server, "cap:fair"));
    }
    {
        let nodes = RedisServer::start_many(3);
        let clients: Vec<LockClient> = nodes.iter().map(RedisServer::lock_client).collect();
        let guard = RedLock::new(clients, "cap:redlock")
            .expect("redlock")
            .lock()
            .expect("lock");
        // Every node's grant landed (the round returned at a majority; a
        // slower node's request may still be on its way, and would land
        // after the deletion below).
        let token = guard.token().to_owned();
        assert!(wait_until(Duration::from_secs(10), || {
            nodes.iter().all(|node| {
                let value: Option<String> = redis::cmd("GET")
                    .arg("cap:redlock")
                    .query(&mut node.conn())
                    .expect("GET");
                value.as_deref() == Some(token.as_str())
            })
        }));
        // Gone on a majority: no majority can hold it.
        let (first, second) = (&nodes[0], &nodes[1]);
        lease_contract(guard, move || {
            delete(first, "cap:redlock")();
            delete(second, "cap:redlock")();
        });
    }
}

/// A nested hold's unlock says "still held" the same way on both lock
/// types that nest.
#[test]
fn a_nested_unlock_says_still_held_on_every_type_that_nests() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::new(&client, "cap:nest-lock");
    let outer = lock.lock().expect("lock");
    let inner = lock.lock().expect("nested");
    assert_eq!(inner.unlock().expect("nested"), Unlocked::StillHeld);
    assert_eq!(outer.unlock().expect("last"), Unlocked::Released);

    let lock = ReentrantLock::new(&client, "cap:nest-reentrant");
    let outer = lock.lock().expect("lock");
    let inner = lock.lock().expect("nested");
    assert_eq!(inner.unlock().expect("nested"), Unlocked::StillHeld);
    assert_eq!(outer.unlock().expect("last"), Unlocked::Released);
}

/// `status()`: who holds the key, for the types that have it.
#[test]
fn status_reports_the_holder_for_every_type_that_has_it() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::new(&client, "cap:st-lock");
    let guard = lock.lock().expect("lock");
    let held = lock.status().expect("status").expect("held");
    assert_eq!(held.kind, LockKind::Mutex);
    guard.unlock().expect("unlock");

    let lock = ReentrantLock::new(&client, "cap:st-reentrant");
    let guard = lock.lock().expect("lock");
    let held = lock.status().expect("status").expect("held");
    assert_eq!(held.kind, LockKind::Reentrant);
    guard.unlock().expect("unlock");

    let lock = RwLock::new(&client, "cap:st-rw");
    let guard = lock.write().expect("write");
    let held = lock.status().expect("status").expect("held");
    assert_eq!(held.kind, LockKind::Write);
    guard.unlock().expect("unlock");

    let semaphore = Semaphore::new(&client, "cap:st-sem", 2);
    let permit = semaphore.acquire().expect("permit");
    let status = semaphore.status().expect("status");
    assert_eq!(status.in_use(), 1);
    permit.unlock().expect("unlock");

    // A RedLock: the holder a majority of its nodes share.
    let nodes = RedisServer::start_many(3);
    let proxy = support::FaultProxy::to(&nodes[2]);
    let clients = vec![
        nodes[0].lock_client(),
        nodes[1].lock_client(),
        LockClient::open(&proxy.url()).expect("client"),
    ];
    let redlock = RedLock::with_options(
        clients,
        "cap:st-red",
        redmutex::RedLockOptions::default().node_timeout(Duration::from_millis(300)),
    )
    .expect("redlock");
    assert_eq!(redlock.status().expect("status"), None, "free");
    let guard = redlock.lock().expect("lock");
    let held = redlock.status().expect("status").expect("held");
    assert_eq!((held.kind, held.holders), (LockKind::Mutex, 3));
    // A node's reply to the token's read lost: a read, asked again, and
    // the answer is the same.
    proxy.lose_reply("GET", 1);
    let held = redlock.status().expect("status").expect("held");
    assert_eq!(held.holders, 3, "a lost reply is asked again");
    assert!(proxy.lost_replies() >= 1, "the fault fired");
    assert_eq!(held.key, "cap:st-red");
    assert!(held.remaining.is_some_and(|r| r <= Duration::from_secs(30)));
    // One node silent: the two others still make the majority.
    proxy.blackhole(true);
    let held = redlock.status().expect("status").expect("held");
    assert_eq!(held.holders, 2);
    // And a node that lost it: no majority for anyone, unknown.
    let _: () = redis::cmd("DEL")
        .arg("cap:st-red")
        .query(&mut nodes[1].conn())
        .expect("DEL");
    let err = redlock
        .status()
        .expect_err("one holder, one free, one silent");
    assert!(
        matches!(
            err,
            Error::Quorum {
                granted: 1,
                needed: 2,
                ..
            }
        ),
        "{err}"
    );
    proxy.blackhole(false);
    drop(guard);
    assert!(wait_until(Duration::from_secs(5), || {
        redlock.status().is_ok_and(|held| held.is_none())
    }));
}

/// Every lock type's guard, taken with `options` (the core every type
/// shares) on fresh clients of `servers` (the first, or all three for the
/// RedLock), each on its own key: what the watchdog cells run against.
fn watched_guards(
    servers: &[RedisServer],
    options: redmutex::Options<()>,
    prefix: &str,
) -> Vec<(&'static str, String, Box<dyn Lease>)> {
    let client = servers[0].lock_client();
    let key = |kind: &str| format!("{prefix}-{kind}");
    let mut guards: Vec<(&'static str, String, Box<dyn Lease>)> = vec![
        (
            "lock",
            key("lock"),
            Box::new(
                DistributedLock::with_options(
                    &client,
                    key("lock"),
                    options.with_extra(Default::default()),
                )
                .lock()
                .expect("lock"),
            ),
        ),
        (
            "reentrant",
            key("reentrant"),
            Box::new(
                ReentrantLock::with_options(
                    &client,
                    key("reentrant"),
                    options.with_extra(Default::default()),
                )
                .lock()
                .expect("lock"),
            ),
        ),
        (
            "read",
            key("read"),
            Box::new(
                RwLock::with_options(&client, key("read"), options.with_extra(Default::default()))
                    .read()
                    .expect("read"),
            ),
        ),
        (
            "write",
            key("write"),
            Box::new(
                RwLock::with_options(
                    &client,
                    key("write"),
                    options.with_extra(Default::default()),
                )
                .write()
                .expect("write"),
            ),
        ),
        (
            "semaphore",
            key("semaphore"),
            Box::new(
                Semaphore::with_options(
                    &client,
                    key("semaphore"),
                    2,
                    options.with_extra(Default::default()),
                )
                .acquire()
                .expect("permit"),
            ),
        ),
        (
            "multi",
            key("multi"),
            Box::new(
                MultiLock::with_options(
                    &client,
                    [key("multi"), key("multi-other")],
                    options.with_extra(Default::default()),
                )
                .lock()
                .expect("lock"),
            ),
        ),
        (
            "fair",
            key("fair"),
            Box::new(
                FairLock::with_options(
                    &client,
                    key("fair"),
                    options.with_extra(Default::default()),
                )
                .lock()
                .expect("lock"),
            ),
        ),
        (
            "movable",
            key("movable"),
            Box::new(
                DistributedLock::with_options(
                    &client,
                    key("movable"),
                    options.with_extra(Default::default()),
                )
                .lock()
                .expect("lock")
                .into_movable()
                .expect("movable"),
            ),
        ),
    ];
    if servers.len() >= 3 {
        let nodes = servers.iter().map(RedisServer::lock_client).collect();
        let lock = RedLock::with_options(
            nodes,
            key("redlock"),
            options.with_extra(Default::default()),
        )
        .expect("redlock");
        guards.push((
            "redlock",
            key("redlock"),
            Box::new(lock.lock().expect("lock")),
        ));
    }
    guards
}

/// The watchdog keeps a short lease held past its ttl on every lock type,
/// and reports its loss when the lock is taken away in Redis.
#[test]
fn the_watchdog_renews_and_reports_a_loss_on_every_type() {
    let servers = RedisServer::start_many(3);
    let ttl = Duration::from_millis(400);
    let options = redmutex::Options::<()>::default().ttl(ttl).watchdog(true);
    let guards = watched_guards(&servers, options, "cap:wd");
    let until = Instant::now() + ttl * 3;
    let mut checks = 0;
    while Instant::now() < until && checks < 1_000 {
        checks += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    for (kind, _, guard) in &guards {
        assert!(
            guard.is_held().expect("is_held"),
            "{kind}: renewed past its ttl"
        );
        assert!(!guard.is_lost(), "{kind}");
        assert!(guard.validity() > Duration::ZERO, "{kind}: valid");
    }
    // Taken away in Redis (on every node): the next renewal finds it gone.
    for (kind, key, guard) in &guards {
        let signal = guard.loss_signal();
        for server in &servers {
            delete(server, key)();
        }
        assert_eq!(
            signal.wait_timeout(Duration::from_secs(5)),
            Some(LossReason::Expired),
            "{kind}: a renewal found it gone"
        );
        assert!(guard.is_lost() && guard.validity().is_zero(), "{kind}");
    }
}

/// A renewal whose reply never comes back: the link to Redis goes silent
/// (the fault proxy swallows everything), and the holder learns of the
/// loss by its local clock, before Redis can give the key away.
#[test]
fn a_silent_link_is_a_loss_before_the_lease_ends_on_every_type() {
    let servers = RedisServer::start_many(3);
    let proxies: Vec<support::FaultProxy> = servers.iter().map(support::FaultProxy::to).collect();
    let ttl = Duration::from_millis(600);
    let options = redmutex::Options::<()>::default().ttl(ttl).watchdog(true);
    let client = LockClient::open(&proxies[0].url()).expect("client");
    let key = "cap:silent";
    let guards: Vec<(&str, Box<dyn Lease>)> = vec![
        (
            "reentrant",
            Box::new(
                ReentrantLock::with_options(
                    &client,
                    format!("{key}-re"),
                    options.with_extra(Default::default()),
                )
                .lock()
                .expect("lock"),
            ),
        ),
        (
            "write",
            Box::new(
                RwLock::with_options(
                    &client,
                    format!("{key}-w"),
                    options.with_extra(Default::default()),
                )
                .write()
                .expect("write"),
            ),
        ),
        (
            "read",
            Box::new(
                RwLock::with_options(
                    &client,
                    format!("{key}-r"),
                    options.with_extra(Default::default()),
                )
                .read()
                .expect("read"),
            ),
        ),
        (
            "multi",
            Box::new(
                MultiLock::with_options(
                    &client,
                    [format!("{key}-m1"), format!("{key}-m2")],
                    options.with_extra(Default::default()),
                )
                .lock()
                .expect("lock"),
            ),
        ),
        (
            "fair",
            Box::new(
                FairLock::with_options(
                    &client,
                    format!("{key}-fair"),
                    options.with_extra(Default::default()),
                )
                .lock()
                .expect("lock"),
            ),
        ),
        (
            "redlock",
            Box::new(
                RedLock::with_options(
                    proxies
                        .iter()
                        .map(|p| LockClient::open(&p.url()).expect("client"))
                        .collect(),
                    format!("{key}-rl"),
                    options.with_extra(Default::default()),
                )
                .expect("redlock")
                .lock()
                .expect("lock"),
            ),
        ),
    ];
    let taken = Instant::now();
    for proxy in &proxies {
        proxy.blackhole(true);
    }
    for (kind, guard) in &guards {
        let reason = guard.loss_signal().wait_timeout(Duration::from_secs(5));
        assert_eq!(reason, Some(LossReason::Unreachable), "{kind}");
        assert!(
            taken.elapsed() < ttl + Duration::from_millis(300),
            "{kind}: reported by the local clock, by the lease's end ({:?})",
            taken.elapsed()
        );
    }
    for proxy in &proxies {
        proxy.blackhole(false);
    }
}

/// Fencing tokens increase across acquisitions, where the type has them.
#[test]
fn fencing_tokens_increase_where_the_type_has_them() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock =
        DistributedLock::with_options(&client, "cap:f-lock", LockOptions::default().fencing(true));
    let first = lock.lock().expect("lock");
    let a = first.fencing_token().expect("a token");
    first.unlock().expect("unlock");
    let second = lock.lock().expect("lock");
    assert!(second.fencing_token().expect("a token") > a);
    second.unlock().expect("unlock");

    let semaphore = Semaphore::with_options(
        &client,
        "cap:f-sem",
        2,
        SemaphoreOptions::default().fencing(true),
    );
    let first = semaphore.acquire().expect("permit");
    let second = semaphore.acquire().expect("permit");
    assert!(second.fencing_token().expect("a token") > first.fencing_token().expect("a token"));
    first.unlock().expect("unlock");
    second.unlock().expect("unlock");

    // The reentrant lock's first hold draws from the same kind of counter;
    // nested holds carry its token.
    let reentrant = ReentrantLock::with_options(
        &client,
        "cap:f-re",
        redmutex::ReentrantOptions::default().fencing(true),
    );
    let outer = reentrant.lock().expect("lock");
    let inner = reentrant.lock().expect("nested");
    let a = outer.fencing_token().expect("a token");
    assert_eq!(inner.fencing_token(), Some(a), "a nested hold carries it");
    inner.unlock().expect("unlock");
    outer.unlock().expect("unlock");
    let again = reentrant.lock().expect("lock");
    assert!(again.fencing_token().expect("a token") > a);
    again.unlock().expect("unlock");

    // A read-write lock's writers get tokens; readers none.
    let rw = RwLock::with_options(
        &client,
        "cap:f-rw",
        redmutex::RwLockOptions::default().fencing(true),
    );
    let reader = rw.read().expect("read");
    assert_eq!(reader.fencing_token(), None, "readers order nothing");
    reader.unlock().expect("unlock");
    let first = rw.write().expect("write");
    let a = first.fencing_token().expect("a token");
    first.unlock().expect("unlock");
    let second = rw.write().expect("write");
    assert!(second.fencing_token().expect("a token") > a);
    second.unlock().expect("unlock");
    // A multi-lock: each key its own token, from the key's own counter.
    let set = MultiLock::with_options(
        &client,
        ["cap:f-lock", "cap:f-m"],
        MultiLockOptions::default().fencing(true),
    );
    let first = set.lock().expect("set");
    let tokens: Vec<(String, u64)> = first
        .fencing_tokens()
        .expect("tokens")
        .map(|(k, t)| (k.to_owned(), t))
        .collect();
    assert_eq!(tokens.len(), 2);
    first.unlock().expect("unlock");
    let plain = lock.lock().expect("lock");
    assert!(
        plain.fencing_token().expect("a token") > tokens[0].1,
        "the key's own counter"
    );
    plain.unlock().expect("unlock");
    // A fair lock: as the plain lock, one counter per key.
    let fair = FairLock::with_options(
        &client,
        "cap:f-fair",
        FairLockOptions::default().fencing(true),
    );
    let first = fair.lock().expect("lock");
    let f = first.fencing_token().expect("a token");
    first.unlock().expect("unlock");
    let second = fair.lock().expect("lock");
    assert!(second.fencing_token().expect("a token") > f);
    second.unlock().expect("unlock");
    let counter: u64 = redis::cmd("GET")
        .arg(client.fence_key("cap:f-rw"))
        .query(&mut server.conn())
        .expect("the counter");
    assert!(counter >= a);
}

/// Waiting by notify: a waiter of another client subscribes to the key's
/// release channel and is woken by the release, long before its 8 s
/// backoff step, for every type that waits by notify.
#[test]
fn every_type_that_waits_by_notify_is_woken_by_the_release() {
    let slow = redmutex::Options::default()
        .ttl(Duration::from_secs(30))
        .backoff(redmutex::Backoff::constant(Duration::from_secs(8)));
    type Hold = Box<dyn Fn(&LockClient) -> Box<dyn FnOnce()>>;
    type Wait = Box<dyn Fn(&LockClient) -> Box<dyn FnOnce() + Send>>;
    // For each type: take the lock on one client, and the waiter's call on
    // another (it returns once it held and released the lock).
    let cases: Vec<(&str, Hold, Wait)> = vec![
        (
            "lock",
            Box::new(move |c| {
                let g = DistributedLock::with_options(
                    c,
                    "n",
                    LockOptions::default().ttl(Duration::from_secs(30)),
                )
                .lock()
                .expect("lock");
                Box::new(move || {
                    g.unlock().expect("unlock");
                })
            }),
            Box::new(move |c| {
                let lock = DistributedLock::with_options(
                    c,
                    "n",
                    LockOptions::default()
                        .ttl(Duration::from_secs(30))
                        .backoff(redmutex::Backoff::constant(Duration::from_secs(8))),
                );
                Box::new(move || {
                    let g = lock.try_lock_for(Duration::from_secs(20)).expect("wait");
                    {
                        g.expect("woken").unlock().expect("unlock");
                    };
                })
            }),
        ),
        (
            "reentrant",
            Box::new(move |c| {
                let g = ReentrantLock::with_options(c, "n", slow)
                    .lock()
                    .expect("lock");
                Box::new(move || {
                    g.unlock().expect("unlock");
                })
            }),
            Box::new(move |c| {
                let lock = ReentrantLock::with_options(c, "n", slow);
                Box::new(move || {
                    let g = lock.try_lock_for(Duration::from_secs(20)).expect("wait");
                    {
                        g.expect("woken").unlock().expect("unlock");
                    };
                })
            }),
        ),
        (
            "read-write",
            Box::new(move |c| {
                let g = RwLock::with_options(c, "n", slow.with_extra(Default::default()))
                    .write()
                    .expect("write");
                Box::new(move || {
                    g.unlock().expect("unlock");
                })
            }),
            Box::new(move |c| {
                let lock = RwLock::with_options(c, "n", slow.with_extra(Default::default()));
                Box::new(move || {
                    let g = lock.try_read_for(Duration::from_secs(20)).expect("wait");
                    {
                        g.expect("woken").unlock().expect("unlock");
                    };
                })
            }),
        ),
        (
            "semaphore",
            Box::new(move |c| {
                let p = Semaphore::with_options(
                    c,
                    "n",
                    1,
                    slow.with_extra(redmutex::SemaphoreExtra::default()),
                )
                .acquire()
                .expect("permit");
                Box::new(move || {
                    p.unlock().expect("unlock");
                })
            }),
            Box::new(move |c| {
                let s = Semaphore::with_options(
                    c,
                    "n",
                    1,
                    slow.with_extra(redmutex::SemaphoreExtra::default()),
                );
                Box::new(move || {
                    let p = s.try_acquire_for(Duration::from_secs(20)).expect("wait");
                    {
                        p.expect("woken").unlock().expect("unlock");
                    };
                })
            }),
        ),
        (
            "multi",
            Box::new(move |c| {
                let g = DistributedLock::with_options(
                    c,
                    "n",
                    LockOptions::default().ttl(Duration::from_secs(30)),
                )
                .lock()
                .expect("lock");
                Box::new(move || {
                    g.unlock().expect("unlock");
                })
            }),
            Box::new(move |c| {
                let set = MultiLock::with_options(
                    c,
                    ["n", "n-other"],
                    slow.with_extra(Default::default()),
                );
                Box::new(move || {
                    let g = set.try_lock_for(Duration::from_secs(20)).expect("wait");
                    {
                        g.expect("woken").unlock().expect("unlock");
                    };
                })
            }),
        ),
    ];
    for (name, hold, wait) in cases {
        let server = RedisServer::start();
        let holder = server.lock_client();
        let waiter = server.lock_client();
        let release = hold(&holder);
        let call = wait(&waiter);
        let waiting = std::thread::spawn(move || {
            call();
            Instant::now()
        });
        assert!(
            wait_until(Duration::from_secs(5), || {
                numsub(&server, &holder.release_channel("n")) > 0
            }),
            "{name}: the waiter subscribed"
        );
        std::thread::sleep(Duration::from_millis(100));
        let released = Instant::now();
        release();
        let woken = waiting.join().expect("waiter");
        let after = woken.saturating_duration_since(released);
        assert!(
            after < Duration::from_secs(4),
            "{name}: woken {after:?} after the release, not by the 8 s backoff"
        );
    }
}

/// A fair lock's waiter is woken by the release on its own channel (the
/// head's), long before its 8 s backoff step.
#[test]
fn a_fair_waiter_is_woken_by_the_release() {
    let server = RedisServer::start();
    let slow = FairLockOptions::default()
        .ttl(Duration::from_secs(30))
        .backoff(redmutex::Backoff::constant(Duration::from_secs(8)))
        .entry_ttl(Duration::from_secs(60));
    let held = FairLock::with_options(&server.lock_client(), "nf", slow)
        .lock()
        .expect("lock");
    let waiter = FairLock::with_options(&server.lock_client(), "nf", slow);
    let waiting = std::thread::spawn(move || {
        let g = waiter.try_lock_for(Duration::from_secs(20)).expect("wait");
        g.expect("woken").unlock().expect("unlock");
        Instant::now()
    });
    assert!(
        wait_until(Duration::from_secs(5), || {
            let channels: Vec<String> = redis::cmd("PUBSUB")
                .arg("CHANNELS")
                .arg("redmutex:released:{nf}:w:*")
                .query(&mut server.conn())
                .expect("PUBSUB");
            channels.len() == 1
        }),
        "the waiter subscribed to its own channel"
    );
    std::thread::sleep(Duration::from_millis(100));
    let released = Instant::now();
    held.unlock().expect("unlock");
    let after = waiting
        .join()
        .expect("waiter")
        .saturating_duration_since(released);
    assert!(
        after < Duration::from_secs(4),
        "woken {after:?} after the release"
    );
}

/// RedLock waits by notify too: woken by the nodes' release message.
#[test]
fn a_redlock_waiter_is_woken_by_the_release() {
    let nodes = RedisServer::start_many(3);
    let clients = |nodes: &[RedisServer]| -> Vec<LockClient> {
        nodes.iter().map(RedisServer::lock_client).collect()
    };
    let slow = redmutex::Options::default()
        .ttl(Duration::from_secs(30))
        .backoff(redmutex::Backoff::constant(Duration::from_secs(8)));
    let holder = RedLock::with_options(clients(&nodes), "n", slow).expect("lock");
    let waiter = RedLock::with_options(clients(&nodes), "n", slow).expect("lock");
    let channel = nodes[0].lock_client().release_channel("n");
    let held = holder.lock().expect("lock");
    let waiting = std::thread::spawn(move || {
        let got = waiter.try_lock_for(Duration::from_secs(20)).expect("wait");
        let woken = Instant::now();
        if let Some(guard) = got {
            guard.unlock().expect("unlock");
        }
        woken
    });
    assert!(wait_until(Duration::from_secs(5), || {
        numsub(&nodes[0], &channel) > 0
    }));
    std::thread::sleep(Duration::from_millis(100));
    let released = Instant::now();
    held.unlock().expect("unlock");
    let after = waiting
        .join()
        .expect("waiter")
        .saturating_duration_since(released);
    assert!(
        after < Duration::from_secs(4),
        "woken {after:?} after the release"
    );
}

/// A lease passes to a waiting thread of the same client without Redis,
/// where the type hands off (the plain lock and the semaphore): three
/// threads taking turns hand it over.
#[test]
fn a_release_hands_the_lease_to_a_waiting_thread_where_the_type_hands_off() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let turns = |take: std::sync::Arc<dyn Fn() -> Box<dyn Lease> + Send + Sync>| {
        let before = client.stats().handoffs;
        let threads: Vec<_> = (0..3)
            .map(|_| {
                let take = take.clone();
                std::thread::spawn(move || {
                    for _ in 0..30 {
                        let held = take();
                        std::thread::sleep(Duration::from_millis(2));
                        drop(held);
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().expect("thread");
        }
        client.stats().handoffs - before
    };
    let lock = DistributedLock::new(&client, "cap:h-lock");
    let handed = turns(std::sync::Arc::new(move || -> Box<dyn Lease> {
        Box::new(lock.lock().expect("lock"))
    }));
    assert!(handed > 0, "the plain lock: {handed} handoffs");
    let semaphore = Semaphore::new(&client, "cap:h-sem", 1);
    let handed = turns(std::sync::Arc::new(move || -> Box<dyn Lease> {
        Box::new(semaphore.acquire().expect("permit"))
    }));
    assert!(handed > 0, "the semaphore: {handed} handoffs");
}

/// The watchdog's `max_hold` stops renewals and the lease runs out, found
/// lost as `MaxHold`, on every lock type.
#[test]
fn max_hold_caps_the_renewals_on_every_type() {
    let servers = RedisServer::start_many(3);
    let ttl = Duration::from_millis(300);
    let options = redmutex::Options::<()>::default()
        .ttl(ttl)
        .watchdog(true)
        .max_hold(Some(Duration::from_millis(500)));
    let guards = watched_guards(&servers, options, "cap:m");
    for (kind, _, guard) in &guards {
        assert_eq!(
            guard.loss_signal().wait_timeout(Duration::from_secs(5)),
            Some(LossReason::MaxHold),
            "{kind}"
        );
        assert!(guard.is_lost(), "{kind}");
    }
}

/// `min_replicas`: the acquisition waits for a replica's acknowledgement,
/// where the type offers it.
#[test]
fn min_replicas_is_acknowledged_where_the_type_offers_it() {
    let primary = RedisServer::start();
    let replica = RedisServer::start_replica_of(&primary);
    let client = primary.lock_client();
    let wait = Duration::from_millis(500);
    let guard = DistributedLock::with_options(
        &client,
        "cap:r-lock",
        LockOptions::default().min_replicas(1, wait),
    )
    .lock()
    .expect("acknowledged");
    let on_replica: Option<String> = redis::cmd("GET")
        .arg("cap:r-lock")
        .query(&mut replica.conn())
        .expect("GET");
    assert!(on_replica.is_some(), "the replica has it");
    let permit = Semaphore::with_options(
        &client,
        "cap:r-sem",
        2,
        SemaphoreOptions::default().min_replicas(1, wait),
    )
    .acquire()
    .expect("acknowledged");
    let fields: Vec<String> = redis::cmd("HKEYS")
        .arg("cap:r-sem")
        .query(&mut replica.conn())
        .expect("HKEYS");
    assert!(fields.iter().any(|f| f.starts_with("p:")), "{fields:?}");
    guard.unlock().expect("unlock");
    permit.unlock().expect("unlock");

    let on_replica = |key: &str| -> Vec<String> {
        redis::cmd("HKEYS")
            .arg(key)
            .query(&mut replica.conn())
            .expect("HKEYS")
    };
    let reentrant = ReentrantLock::with_options(
        &client,
        "cap:r-re",
        redmutex::ReentrantOptions::default().min_replicas(1, wait),
    );
    let outer = reentrant.lock().expect("acknowledged");
    let inner = reentrant.lock().expect("a nested hold, acknowledged");
    assert_eq!(on_replica("cap:r-re").len(), 3, "owner and two holds");
    assert_eq!(inner.unlock().expect("unlock"), Unlocked::StillHeld);
    outer.unlock().expect("unlock");
    let rw = RwLock::with_options(
        &client,
        "cap:r-rw",
        redmutex::RwLockOptions::default().min_replicas(1, wait),
    );
    let reader = rw.read().expect("acknowledged");
    assert!(on_replica("cap:r-rw").iter().any(|f| f.starts_with("r:")));
    reader.unlock().expect("unlock");
    let writer = rw.write().expect("acknowledged");
    assert!(on_replica("cap:r-rw").iter().any(|f| f == "w"));
    writer.unlock().expect("unlock");

    // More replicas than there are: refused, and the hold taken out again.
    let short = Duration::from_millis(100);
    let err = ReentrantLock::with_options(
        &client,
        "cap:r-re2",
        redmutex::ReentrantOptions::default().min_replicas(2, short),
    )
    .lock()
    .expect_err("one replica of two");
    assert!(
        matches!(
            err,
            Error::NotReplicated {
                acked: 1,
                wanted: 2,
                ..
            }
        ),
        "{err}"
    );
    for mode in ["read", "write"] {
        let rw = RwLock::with_options(
            &client,
            "cap:r-rw2",
            redmutex::RwLockOptions::default().min_replicas(2, short),
        );
        let err = if mode == "read" {
            rw.read()
        } else {
            rw.write()
        }
        .expect_err("one replica of two");
        assert!(
            matches!(
                err,
                Error::NotReplicated {
                    acked: 1,
                    wanted: 2,
                    ..
                }
            ),
            "{mode}: {err}"
        );
    }
    let left: Vec<String> = redis::cmd("KEYS")
        .arg("cap:r-*2")
        .query(&mut primary.conn())
        .expect("KEYS");
    assert!(left.is_empty(), "nothing left behind: {left:?}");
}

/// A blocking acquire that times out names who held the lock, from the
/// refused attempts' own replies (never their secret), on every type
/// whose reply carries a holder.
#[test]
fn a_timeout_names_the_holder_on_every_type() {
    let server = RedisServer::start();
    let holder = LockClient::builder()
        .url(server.url())
        .label("nightly-7")
        .build()
        .expect("client");
    let waiter = server.lock_client();
    let short = redmutex::Options::<()>::default().wait(Duration::from_millis(50));
    let named = |kind: &str, err: Error, secret: &str| {
        let Error::Timeout { holder, .. } = &err else {
            panic!("{kind}: {err}");
        };
        let holder = holder
            .as_deref()
            .unwrap_or_else(|| panic!("{kind}: no holder named"));
        assert!(holder.starts_with("…|"), "{kind}: redacted: {holder}");
        assert!(!holder.contains(secret), "{kind}: a secret in {holder}");
        let parsed = redmutex::Holder::from_token(holder).expect("metadata");
        assert_eq!(parsed.label.as_deref(), Some("nightly-7"), "{kind}");
        assert!(err.to_string().contains("held by"), "{kind}: {err}");
    };
    let secret = |token: &str| token.split('|').next().unwrap_or_default().to_owned();
    for fenced in [false, true] {
        let options = LockOptions::default().fencing(fenced);
        let held = DistributedLock::with_options(&holder, "cap:t-lock", options)
            .lock()
            .expect("lock");
        let err = DistributedLock::with_options(
            &waiter,
            "cap:t-lock",
            short
                .with_extra(redmutex::LockExtra::default())
                .fencing(fenced),
        )
        .lock()
        .expect_err("held");
        named(
            if fenced { "fenced lock" } else { "lock" },
            err,
            &secret(held.token()),
        );
        // One attempt, the same round trip: a wait of zero.
        let once = DistributedLock::with_options(
            &waiter,
            "cap:t-lock",
            LockOptions::default().wait(Duration::ZERO).fencing(fenced),
        );
        let commands = waiter.stats().commands;
        named(
            "one attempt",
            once.lock().expect_err("held"),
            &secret(held.token()),
        );
        let sent = waiter.stats().commands - commands;
        assert!(sent <= 2, "one attempt: {sent} commands");
        held.unlock().expect("unlock");
    }
    // A reentrant lock re-enters on its owner's thread: held by another.
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let owner = holder.clone();
    let holding = std::thread::spawn(move || {
        let held = ReentrantLock::new(&owner, "cap:t-re").lock().expect("lock");
        held_tx.send(held.hold_id().to_owned()).expect("send");
        let _ = done_rx.recv_timeout(Duration::from_secs(30));
        held.unlock().expect("unlock");
    });
    let hold_id: String = held_rx.recv_timeout(Duration::from_secs(10)).expect("held");
    let err =
        ReentrantLock::with_options(&waiter, "cap:t-re", short.with_extra(Default::default()))
            .lock()
            .expect_err("held");
    named("reentrant", err, &secret(&hold_id));
    done_tx.send(()).expect("send");
    holding.join().expect("holder");
    let rw =
        |c: &LockClient| RwLock::with_options(c, "cap:t-rw", short.with_extra(Default::default()));
    let writer = rw(&holder).write().expect("write");
    named(
        "read",
        rw(&waiter).read().expect_err("held"),
        &secret(writer.token()),
    );
    writer.unlock().expect("unlock");
    let reader = rw(&holder).read().expect("read");
    named(
        "write",
        rw(&waiter).write().expect_err("held"),
        &secret(reader.token()),
    );
    reader.unlock().expect("unlock");
    let permit = Semaphore::new(&holder, "cap:t-sem", 1)
        .acquire()
        .expect("permit");
    let err = Semaphore::with_options(
        &waiter,
        "cap:t-sem",
        1,
        short.with_extra(Default::default()),
    )
    .acquire()
    .expect_err("held");
    named("semaphore", err, &secret(permit.id()));
    permit.unlock().expect("unlock");
    let held = DistributedLock::new(&holder, "cap:t-m2")
        .lock()
        .expect("lock");
    let err = MultiLock::with_options(
        &waiter,
        ["cap:t-m1", "cap:t-m2"],
        short.with_extra(Default::default()),
    )
    .lock()
    .expect_err("held");
    named("multi", err, &secret(held.token()));
    held.unlock().expect("unlock");
    let held = FairLock::new(&holder, "cap:t-fair").lock().expect("lock");
    let err = FairLock::with_options(&waiter, "cap:t-fair", short.with_extra(Default::default()))
        .lock()
        .expect_err("held");
    named("fair", err, &secret(held.token()));
    held.unlock().expect("unlock");
}

/// `RedLock::status` tells holders apart by their tokens, not their
/// metadata: two holders without metadata, each on one node of three
/// (a split round's leftovers), are no majority.
#[test]
fn a_redlock_status_tells_holders_apart_by_token() {
    let servers = RedisServer::start_many(3);
    let clients: Vec<LockClient> = servers.iter().map(RedisServer::lock_client).collect();
    let lock = RedLock::new(clients, "cap:rs-split").expect("redlock");
    for (server, token) in servers.iter().zip(["secretA", "secretB"]) {
        let _: () = redis::cmd("SET")
            .arg("cap:rs-split")
            .arg(token)
            .arg("PX")
            .arg(30_000)
            .query(&mut server.conn())
            .expect("SET");
    }
    assert_eq!(
        lock.status().expect("status"),
        None,
        "nobody has a majority"
    );
    // The same token on two of three: held.
    let _: () = redis::cmd("SET")
        .arg("cap:rs-split")
        .arg("secretA")
        .arg("PX")
        .arg(30_000)
        .query(&mut servers[2].conn())
        .expect("SET");
    let held = lock.status().expect("status").expect("a majority");
    assert_eq!(held.holders, 2);
}

/// A reentrant owner's fencing token is its own, whichever of its holds
/// asked first: an unfenced first hold, then a fenced nested one, draws a
/// token there (never another owner's, never 0), and later fenced holds
/// carry it.
#[test]
fn a_reentrant_owner_draws_its_own_token_when_a_nested_hold_first_asks() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let fenced = redmutex::ReentrantOptions::default().fencing(true);
    let other = client.clone();
    let earlier = std::thread::spawn(move || {
        let held = ReentrantLock::with_options(&other, "cap:ft", fenced)
            .lock()
            .expect("lock");
        let token = held.fencing_token().expect("a token");
        held.unlock().expect("unlock");
        token
    })
    .join()
    .expect("thread");
    let outer = ReentrantLock::new(&client, "cap:ft").lock().expect("outer");
    assert_eq!(outer.fencing_token(), None, "unfenced");
    let inner = ReentrantLock::with_options(&client, "cap:ft", fenced)
        .lock()
        .expect("inner");
    let own = inner.fencing_token().expect("a token");
    assert!(
        own > earlier,
        "{own} after {earlier}: its own, not the last owner's"
    );
    let innermost = ReentrantLock::with_options(&client, "cap:ft", fenced)
        .lock()
        .expect("innermost");
    assert_eq!(innermost.fencing_token(), Some(own), "carried");
    assert_eq!(innermost.depth(), 3, "the token's field is no hold");
    assert_eq!(innermost.unlock().expect("unlock"), Unlocked::StillHeld);
    assert_eq!(inner.unlock().expect("unlock"), Unlocked::StillHeld);
    assert_eq!(outer.unlock().expect("unlock"), Unlocked::Released);
    let left: bool = redis::cmd("EXISTS")
        .arg("cap:ft")
        .query(&mut server.conn())
        .expect("EXISTS");
    assert!(
        !left,
        "the last hold's release deletes the hash, token and all"
    );
}

/// A watched RedLock released in time is no loss: its signal stays quiet
/// past the lease it had.
#[test]
fn a_watched_redlock_released_in_time_is_no_loss() {
    let servers = RedisServer::start_many(3);
    let clients: Vec<LockClient> = servers.iter().map(RedisServer::lock_client).collect();
    let ttl = Duration::from_millis(600);
    let lock = RedLock::with_options(
        clients,
        "cap:rq",
        redmutex::RedLockOptions::default().ttl(ttl).watchdog(true),
    )
    .expect("redlock");
    let guard = lock.lock().expect("lock");
    let signal = guard.loss_signal();
    guard.unlock().expect("unlock");
    let dropped = lock.lock().expect("lock");
    let dropped_signal = dropped.loss_signal();
    drop(dropped);
    assert_eq!(signal.wait_timeout(ttl * 2), None, "unlocked");
    assert_eq!(
        dropped_signal.wait_timeout(Duration::from_millis(100)),
        None,
        "dropped"
    );
}

/// A reentrant hold is renewed while a guard that asked for the watchdog
/// lives, and not after: the outer guard without it runs out by its ttl
/// once the watched nested guard is gone.
#[test]
fn a_reentrant_hold_is_renewed_only_while_a_watched_guard_lives() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let ttl = Duration::from_millis(600);
    let plain = redmutex::ReentrantOptions::default().ttl(ttl);
    let outer = ReentrantLock::with_options(&client, "cap:rw-in", plain)
        .lock()
        .expect("outer");
    let inner = ReentrantLock::with_options(&client, "cap:rw-in", plain.watchdog(true))
        .lock()
        .expect("inner");
    let until = Instant::now() + ttl * 2;
    while Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        outer.is_held().expect("is_held"),
        "renewed while the watched guard lives"
    );
    drop(inner);
    assert!(
        wait_until(ttl * 3, || !outer.is_held().unwrap_or(true)),
        "runs out once no watched guard is left"
    );
    drop(outer);
}

/// A timeout names a holder only when the holder's token says who: a
/// token without metadata names nobody.
#[test]
fn a_timeout_names_nobody_for_a_token_without_metadata() {
    let server = RedisServer::start();
    let holder = LockClient::builder()
        .url(server.url())
        .holder_metadata(false)
        .build()
        .expect("client");
    let _held = DistributedLock::new(&holder, "cap:tn")
        .lock()
        .expect("lock");
    let err = DistributedLock::with_options(
        &server.lock_client(),
        "cap:tn",
        LockOptions::default().wait(Duration::from_millis(50)),
    )
    .lock()
    .expect_err("held");
    assert!(
        matches!(&err, Error::Timeout { holder: None, .. }),
        "{err:?}"
    );
}

/// Which guards may go to another thread: checked by the compiler. (The
/// ones that may not, `LockGuard` and `ReentrantGuard`, have `compile_fail`
/// examples in their docs; `public-api.txt` lists every guard's auto
/// traits.)
#[test]
fn the_guards_that_move_are_send() {
    fn send<T: Send>() {}
    send::<redmutex::MovableGuard>();
    send::<redmutex::RwGuard>();
    send::<redmutex::Permit>();
    send::<redmutex::MultiGuard>();
    send::<redmutex::FairGuard>();
    send::<redmutex::RedLockGuard>();
}
