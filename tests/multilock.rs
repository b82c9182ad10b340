//! The multi-lock: a set of keys, all or none, as one lease; on one server,
//! on a cluster (one slot, and across slots), and through lost replies.

use redmutex_test_support as support;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use redis::Commands;
use redmutex::{
    DistributedLock, Error, Lease, LockClient, LossReason, MultiLock, MultiLockOptions, WaitMode,
};
use support::{FaultProxy, RedisCluster, RedisServer, sha, wait_until};

const MULTI_ACQUIRE: &str = include_str!("../lua/multi_acquire.lua");
const MULTI_RELEASE: &str = include_str!("../lua/multi_release.lua");

fn options() -> MultiLockOptions {
    MultiLockOptions::default()
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_secs(10))
}

fn value(server: &RedisServer, key: &str) -> Option<String> {
    server.conn().get(key).expect("GET")
}

#[test]
fn the_set_is_taken_whole_or_not_at_all() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let other = server.lock_client();
    let b = DistributedLock::new(&other, "b").lock().expect("b");
    let set = MultiLock::with_options(&client, ["c", "a", "b", "a"], options());
    assert_eq!(set.keys().collect::<Vec<_>>(), ["a", "b", "c"]);
    assert_eq!(set.parts(), 1);
    assert!(set.try_lock().expect("try").is_none(), "b is held");
    assert_eq!(value(&server, "a"), None, "nothing of the set was written");
    assert_eq!(value(&server, "c"), None);
    b.unlock().expect("unlock b");
    let guard = set.try_lock().expect("try").expect("free now");
    for key in ["a", "b", "c"] {
        assert_eq!(value(&server, key).as_deref(), Some(guard.token()), "{key}");
    }
    assert!(
        DistributedLock::new(&other, "c")
            .try_lock()
            .expect("try")
            .is_none(),
        "a plain lock on a key of the set is excluded"
    );
    assert!(guard.validity() > Duration::from_secs(9));
    assert!(guard.is_held().expect("is_held"));
    guard.unlock().expect("unlock");
    let left: u64 = redis::cmd("DBSIZE")
        .query(&mut server.conn())
        .expect("DBSIZE");
    let markers: Vec<String> = server.conn().keys("*released*").expect("KEYS");
    assert_eq!(
        left as usize,
        markers.len(),
        "only the release marker is left"
    );
}

#[test]
fn bad_sets_are_refused_before_anything_is_sent() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let empty: [&str; 0] = [];
    for (set, what) in [
        (MultiLock::new(&client, empty), "empty"),
        (MultiLock::new(&client, ["a", ""]), "an empty key"),
        (
            MultiLock::new(&client, (0..1001).map(|i| format!("k{i}"))),
            "too many keys",
        ),
        (
            MultiLock::with_options(&client, ["a"], options().ttl(Duration::ZERO)),
            "a zero ttl",
        ),
    ] {
        assert!(
            matches!(set.try_lock(), Err(Error::InvalidArgument(_))),
            "{what}"
        );
    }
    let size: u64 = redis::cmd("DBSIZE")
        .query(&mut server.conn())
        .expect("DBSIZE");
    assert_eq!(size, 0);
}

#[test]
fn a_key_of_another_type_is_refused_and_nothing_is_taken() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let _: () = server.conn().hset("h", "f", "v").expect("HSET");
    let set = MultiLock::with_options(&client, ["a", "h", "z"], options());
    assert!(matches!(set.try_lock(), Err(Error::WrongType { .. })));
    assert_eq!(value(&server, "a"), None);
    assert_eq!(value(&server, "z"), None);
}

#[test]
fn a_waiter_is_woken_by_the_release_of_any_key_of_its_set() {
    for mode in [WaitMode::Notify, WaitMode::Spin] {
        let server = RedisServer::start();
        let holder = server.lock_client();
        let client = server.lock_client();
        let held = DistributedLock::new(&holder, "y").lock().expect("y");
        let set = MultiLock::with_options(&client, ["x", "y"], options().wait_mode(mode));
        // The guard comes back to this thread (it is `Send`).
        let waiter = std::thread::spawn(move || set.lock());
        // The waiter is waiting (and, notified, subscribed) before the
        // release.
        assert!(wait_until(Duration::from_secs(5), || {
            mode == WaitMode::Spin || support::numsub(&server, &holder.release_channel("y")) > 0
        }));
        held.unlock().expect("unlock");
        let guard = waiter.join().expect("waiter").expect("the set");
        assert_eq!(
            value(&server, "x").as_deref(),
            Some(guard.token()),
            "{mode:?}"
        );
        assert_eq!(
            value(&server, "y").as_deref(),
            Some(guard.token()),
            "{mode:?}"
        );
    }
}

#[test]
fn the_guard_keeps_the_lease_contract() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let set = MultiLock::with_options(&client, ["p", "q"], options().fencing(true));
    let mut guard = set.lock().expect("lock");
    let first: Vec<(String, u64)> = guard
        .fencing_tokens()
        .expect("fenced")
        .map(|(k, f)| (k.to_owned(), f))
        .collect();
    assert_eq!(first.len(), 2);
    assert_eq!(guard.fencing_token(), Some(first[0].1));
    guard.extend(Duration::from_secs(20)).expect("extend");
    let pttl: i64 = server.conn().pttl("q").expect("PTTL");
    assert!(pttl > 10_000, "extended: {pttl}");
    guard.unlock().expect("unlock");
    // The keys' own counters: a plain lock on one fences after the set.
    let plain =
        DistributedLock::with_options(&client, "q", redmutex::LockOptions::default().fencing(true))
            .lock()
            .expect("q");
    assert!(plain.fencing_token().expect("fenced") > first[1].1);
    drop(plain);
    let again = set.lock().expect("again");
    for ((_, before), (_, after)) in first.iter().zip(again.fencing_tokens().expect("fenced")) {
        assert!(after > *before, "tokens increase per key");
    }
    // One key taken from outside: the whole set is lost.
    let _: () = server.conn().del("p").expect("DEL");
    let signal = again.loss_signal();
    assert!(!again.is_held().expect("is_held"));
    assert!(again.is_lost());
    assert_eq!(signal.reason(), Some(LossReason::Expired));
    assert!(matches!(again.unlock(), Err(Error::NotHeld { .. })));
    assert_eq!(value(&server, "q"), None, "the rest was released anyway");
}

#[test]
fn the_watchdog_renews_the_set_and_reports_its_loss() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let set = MultiLock::with_options(
        &client,
        ["w1", "w2", "w3"],
        options().ttl(Duration::from_millis(300)).watchdog(true),
    );
    let guard = set.lock().expect("lock");
    let started = Instant::now();
    // Alive for several ttls.
    assert!(wait_until(Duration::from_secs(5), || {
        started.elapsed() > Duration::from_millis(1200)
    }));
    for key in ["w1", "w2", "w3"] {
        assert_eq!(value(&server, key).as_deref(), Some(guard.token()), "{key}");
    }
    assert!(!guard.is_lost());
    assert!(guard.validity() > Duration::ZERO);
    let signal = guard.loss_signal();
    let _: () = server.conn().set("w2", "someone else").expect("SET");
    assert_eq!(
        signal.wait_timeout(Duration::from_secs(5)),
        Some(LossReason::OwnedByOther)
    );
    drop(guard);
    assert_eq!(value(&server, "w1"), None);
    assert_eq!(value(&server, "w2").as_deref(), Some("someone else"));
}

#[test]
fn a_guard_moves_to_another_thread() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let guard = MultiLock::with_options(&client, ["m1", "m2"], options())
        .lock()
        .expect("lock");
    let done = std::thread::spawn(move || guard.unlock().map(drop));
    done.join().expect("worker").expect("unlocked elsewhere");
    assert_eq!(value(&server, "m1"), None);
}

#[test]
fn lost_replies_are_recognised() {
    let server = RedisServer::start();
    support::load_scripts(&server);
    let proxy = FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    let set = MultiLock::with_options(&client, ["l1", "l2"], options().fencing(true));
    proxy.lose_reply(&sha(MULTI_ACQUIRE), 1);
    let guard = set.lock().expect("the resend finds its own token");
    assert_eq!(proxy.lost_replies(), 1);
    assert_eq!(value(&server, "l1").as_deref(), Some(guard.token()));
    let fences: Vec<u64> = guard
        .fencing_tokens()
        .expect("fenced")
        .map(|(_, f)| f)
        .collect();
    let counter: Option<u64> = server
        .conn()
        .get(client.fence_key("l1"))
        .expect("GET counter");
    assert_eq!(Some(fences[0]), counter, "the counter was bumped once");
    // An extension whose reply is lost is sent again: the same expiry set
    // again, all or none.
    let mut guard = guard;
    proxy.lose_reply(&sha(include_str!("../lua/multi_extend.lua")), 1);
    guard
        .extend(Duration::from_secs(20))
        .expect("the resend extends");
    assert_eq!(proxy.lost_replies(), 2);
    let pttl: i64 = server.conn().pttl("l2").expect("PTTL");
    assert!(pttl > 10_000, "extended: {pttl}");
    proxy.lose_reply(&sha(MULTI_RELEASE), 1);
    guard.unlock().expect("the resend answers from the marker");
    assert_eq!(proxy.lost_replies(), 3);
    assert_eq!(value(&server, "l1"), None);
    assert_eq!(value(&server, "l2"), None);
    // A release whose replies are all lost: unknown, and the cleanup
    // takes the keys out once Redis answers.
    let guard = set.lock().expect("again");
    proxy.blackhole(true);
    let outcome = guard.unlock();
    assert!(outcome.is_err(), "{outcome:?}");
    proxy.blackhole(false);
    assert!(
        wait_until(Duration::from_secs(10), || value(&server, "l1").is_none()
            && value(&server, "l2").is_none()),
        "released in the background"
    );
}

#[test]
fn a_deadline_is_kept_while_a_key_stays_held() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let _held = DistributedLock::new(&server.lock_client(), "d2")
        .lock()
        .expect("held");
    let set = MultiLock::with_options(&client, ["d1", "d2"], options());
    let started = Instant::now();
    assert!(
        set.try_lock_for(Duration::from_millis(200))
            .expect("try")
            .is_none()
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(matches!(
        MultiLock::with_options(
            &client,
            ["d1", "d2"],
            options().wait(Duration::from_millis(50))
        )
        .lock(),
        Err(Error::Timeout { .. })
    ));
    assert_eq!(value(&server, "d1"), None);
}

/// Dining philosophers in short, with threads of separate clients: five
/// keys, each worker taking 2 or 3 neighbouring ones; a sampler reads every
/// key as fast as it can and finds no set held in part; every call returns
/// within its wait; a non-atomic counter per key loses no increment.
fn philosophers(client_of: impl Fn() -> LockClient, keys: [&str; 5], secs: u64) {
    let stop = Arc::new(AtomicBool::new(false));
    let increments = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..6usize)
        .map(|w| {
            let client = client_of().with_label(&format!("w{w}")).expect("label");
            let set: Vec<String> = (0..2 + w % 2)
                .map(|i| keys[(w + i) % 5].to_owned())
                .collect();
            let stop = stop.clone();
            let increments = increments.clone();
            std::thread::spawn(move || -> Result<(), String> {
                let mut con = client.connection().map_err(|e| e.to_string())?;
                let lock = MultiLock::with_options(&client, set.clone(), options());
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) && n < 100_000 {
                    let guard = lock.lock().map_err(|e| format!("no deadlock: {e}"))?;
                    for key in &set {
                        let counter = format!("{key}:counter");
                        let now: Option<u64> = redis::cmd("GET")
                            .arg(&counter)
                            .query(&mut con)
                            .map_err(|e| e.to_string())?;
                        redis::cmd("SET")
                            .arg(&counter)
                            .arg(now.unwrap_or(0) + 1)
                            .exec(&mut con)
                            .map_err(|e| e.to_string())?;
                        increments.fetch_add(1, Ordering::Relaxed);
                    }
                    guard.unlock().map_err(|e| e.to_string())?;
                    n += 1;
                }
                Ok(())
            })
        })
        .collect();
    let sampler_client = client_of();
    let expected: HashMap<String, usize> =
        (0..6usize).map(|w| (format!("w{w}"), 2 + w % 2)).collect();
    let mut con = sampler_client.connection().expect("sampler");
    let (mut samples, mut partial) = (0u64, 0u64);
    let until = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < until {
        let mut mget = redis::cmd("MGET");
        for key in keys {
            mget.arg(key);
        }
        let values: Vec<Option<String>> = mget.query(&mut con).expect("MGET");
        let mut held: HashMap<String, usize> = HashMap::new();
        for token in values.iter().flatten() {
            let label = redmutex::Holder::from_token(token)
                .and_then(|h| h.label)
                .unwrap_or_default();
            *held.entry(label).or_default() += 1;
        }
        samples += 1;
        partial += held
            .iter()
            .filter(|(label, n)| expected.get(*label) != Some(n))
            .count() as u64;
    }
    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        worker.join().expect("worker").expect("worker ran");
    }
    assert!(samples > 100, "the sampler ran: {samples}");
    assert_eq!(partial, 0, "no set was ever seen held in part");
    let mut counted = 0u64;
    for key in keys {
        let n: Option<u64> = redis::cmd("GET")
            .arg(format!("{key}:counter"))
            .query(&mut con)
            .expect("GET");
        counted += n.unwrap_or(0);
    }
    assert_eq!(
        counted,
        increments.load(Ordering::Relaxed),
        "no increment lost"
    );
}

#[test]
fn dining_philosophers_on_one_server() {
    let server = RedisServer::start();
    philosophers(|| server.lock_client(), ["f0", "f1", "f2", "f3", "f4"], 3);
}

#[test]
fn on_a_cluster_one_slot_is_atomic_and_several_slots_are_ordered() {
    let cluster = RedisCluster::start(3, 0);
    philosophers(
        || cluster.lock_client(),
        ["{t}f0", "{t}f1", "{t}f2", "{t}f3", "{t}f4"],
        2,
    );
    let client = cluster.lock_client();
    let keys = cluster.key_per_primary("x");
    let set = MultiLock::with_options(&client, keys.clone(), options());
    assert_eq!(set.parts(), 3, "{keys:?}");
    // The last part held elsewhere: the first ones are given back.
    let last = set.keys().last().expect("a key").to_owned();
    let held = DistributedLock::new(&cluster.lock_client(), last.clone())
        .lock()
        .expect("held");
    assert!(
        set.try_lock_for(Duration::from_millis(300))
            .expect("try")
            .is_none()
    );
    let mut con = client.connection().expect("connection");
    for key in set.keys().filter(|k| *k != last) {
        let v: Option<String> = redis::cmd("GET").arg(key).query(&mut con).expect("GET");
        assert_eq!(v, None, "{key} was rolled back");
    }
    drop(held);
    let guard = set.lock().expect("lock");
    for key in set.keys() {
        let v: Option<String> = redis::cmd("GET").arg(key).query(&mut con).expect("GET");
        assert_eq!(v.as_deref(), Some(guard.token()), "{key}");
    }
    drop(guard);
    // Overlapping sets over several slots, taken by many threads in
    // opposite naming orders: none waits for another in a cycle.
    let timeouts = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..4usize)
        .map(|w| {
            let client = cluster.lock_client();
            let mut set = keys.clone();
            if w % 2 == 1 {
                set.reverse();
            }
            set.truncate(2 + w % 2);
            let timeouts = timeouts.clone();
            std::thread::spawn(move || {
                let lock = MultiLock::with_options(&client, set, options());
                for _ in 0..40 {
                    match lock.lock() {
                        Ok(guard) => drop(guard),
                        Err(_) => {
                            timeouts.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().expect("worker");
    }
    assert_eq!(timeouts.load(Ordering::Relaxed), 0);
}

/// An extension to a shorter lease shortens the estimate too (the keys
/// expire as asked).
#[test]
fn a_shorter_extension_shortens_the_validity() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let set = MultiLock::with_options(&client, ["sa", "sb"], options());
    let mut guard = set.lock().expect("lock");
    guard.extend(Duration::from_millis(200)).expect("extend");
    assert!(
        guard.validity() <= Duration::from_millis(200),
        "{:?}",
        guard.validity()
    );
    assert!(wait_until(Duration::from_secs(5), || value(&server, "sa").is_none()));
    assert_eq!(guard.validity(), Duration::ZERO);
}
