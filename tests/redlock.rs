//! RedLock over independent masters: quorum over every subset of unavailable
//! nodes (go-redsync style), validity under latency, late replies, and
//! mutual exclusion while a node is killed and restarted.

use redmutex_test_support as support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::Commands;
use redmutex::Lease;
use redmutex::{Error, LockClient, LossReason, RedLock};
use support::{RedisServer, wait_until};

fn clients(nodes: &[RedisServer]) -> Vec<LockClient> {
    nodes.iter().map(RedisServer::lock_client).collect()
}

fn value(node: &RedisServer, key: &str) -> Option<String> {
    node.conn().get(key).expect("GET")
}

#[test]
fn a_majority_is_needed_for_every_subset_of_taken_nodes() {
    for n in [3usize, 5] {
        let nodes = RedisServer::start_many(n);
        let lock = RedLock::new(clients(&nodes), "quorum").expect("redlock");
        assert_eq!(lock.quorum(), n / 2 + 1);
        for mask in 0u32..(1 << n) {
            let taken: Vec<usize> = (0..n).filter(|i| mask & (1 << i) != 0).collect();
            for &i in &taken {
                let _: () = redis::cmd("SET")
                    .arg("quorum")
                    .arg("foreign")
                    .arg("PX")
                    .arg(60_000)
                    .query(&mut nodes[i].conn())
                    .expect("SET");
            }
            let available = n - taken.len();
            let got = lock.try_lock().expect("try_lock");
            assert_eq!(
                got.is_some(),
                available > n / 2,
                "{n} nodes, taken {taken:?}"
            );
            match got {
                Some(guard) => {
                    assert!(guard.validity() > Duration::ZERO);
                    guard.unlock().expect("unlock");
                }
                None => {
                    // No node keeps our key: only foreign values or nothing.
                    assert!(wait_until(Duration::from_secs(2), || {
                        nodes.iter().all(|node| {
                            matches!(value(node, "quorum").as_deref(), None | Some("foreign"))
                        })
                    }));
                }
            }
            for node in &nodes {
                let _: () = node.conn().del("quorum").expect("DEL");
            }
        }
    }
}

#[test]
fn errors_say_how_many_granted_and_which_failed() {
    let nodes = RedisServer::start_many(3);
    for node in &nodes[1..] {
        let _: () = node.conn().set("who", "foreign").expect("SET");
    }
    let lock = RedLock::with_options(
        clients(&nodes),
        "who",
        redmutex::Options::default().wait(Duration::from_millis(100)),
    )
    .expect("redlock");
    match lock.lock() {
        Err(Error::Quorum {
            granted,
            needed,
            failed,
            ..
        }) => {
            // The round is decided once the majority is out of reach:
            // node 0's grant may come after that (and is released then).
            assert!(granted <= 1 && needed == 2, "{granted} of {needed}");
            assert_eq!(failed.len(), 3 - granted, "{failed:?}");
            for node in ["node 1", "node 2"] {
                assert!(
                    failed
                        .iter()
                        .any(|f| f.starts_with(node) && f.ends_with("held by another owner")),
                    "{failed:?}"
                );
            }
        }
        other => panic!("expected Quorum, got {other:?}"),
    }
    // Each node's thread releases it right after the verdict.
    assert!(
        wait_until(Duration::from_secs(2), || value(&nodes[0], "who").is_none()),
        "the node that granted was released"
    );
}

#[test]
fn stopped_nodes_time_out_and_keep_nothing() {
    // Timing-sensitive, or heavy (proxies, blackholes): one at a time.
    let _serial = support::serial();
    let nodes = RedisServer::start_many(3);
    let ttl = Duration::from_secs(2);
    let lock = RedLock::with_options(
        clients(&nodes),
        "stop",
        redmutex::Options::default()
            .ttl(ttl)
            .node_timeout(Duration::from_millis(100)),
    )
    .expect("redlock");
    // The node timeout and the slack of a deadline the crate computes
    // (tests/bounds.rs's SHORT_SLACK).
    let limit = Duration::from_millis(100) + Duration::from_millis(60);
    nodes[2].signal("STOP");
    let guard = lock.try_lock().expect("try").expect("2 of 3 answer");
    let started = Instant::now();
    guard
        .unlock()
        .expect("released on the majority: the stopped node is not waited for");
    let took = started.elapsed();
    assert!(
        took < limit,
        "unlock: {took:?}, bounded by the node timeout"
    );
    nodes[1].signal("STOP");
    let started = Instant::now();
    assert!(
        lock.try_lock().expect("try").is_none(),
        "1 of 3 is no majority"
    );
    let took = started.elapsed();
    assert!(
        took < limit,
        "try_lock: {took:?}, bounded by the node timeout"
    );
    nodes[1].signal("CONT");
    nodes[2].signal("CONT");
    // The stopped nodes ran the late SETs when resumed; their threads then
    // released them.
    assert!(wait_until(Duration::from_secs(5), || {
        nodes.iter().all(|node| value(node, "stop").is_none())
    }));
}

/// Blocks `node` for `secs` with DEBUG SLEEP, from a thread.
fn stall(node: &RedisServer, secs: f64) -> std::thread::JoinHandle<()> {
    let mut con = node.conn();
    std::thread::spawn(move || {
        let _: () = redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg(secs)
            .query(&mut con)
            .expect("DEBUG SLEEP");
    })
}

#[test]
fn validity_shrinks_with_node_latency_and_a_reply_slower_than_the_ttl_never_yields_a_guard() {
    // Timing-sensitive, or heavy (proxies, blackholes): one at a time.
    let _serial = support::serial();
    let nodes = RedisServer::start_many(3);
    let ttl = Duration::from_secs(2);
    let lock = RedLock::with_options(
        clients(&nodes),
        "slow",
        redmutex::Options::default()
            .ttl(ttl)
            .node_timeout(Duration::from_secs(1)),
    )
    .expect("redlock");
    let fast = lock.try_lock().expect("try").expect("acquired");
    let fast_validity = fast.validity();
    fast.unlock().expect("unlock");
    assert!(
        fast_validity > ttl - Duration::from_millis(100),
        "{fast_validity:?}"
    );

    let stalls = [stall(&nodes[0], 0.4), stall(&nodes[1], 0.4)];
    std::thread::sleep(Duration::from_millis(60)); // the stalls are under way
    let slow = lock
        .try_lock()
        .expect("try")
        .expect("acquired after the stall");
    let slow_validity = slow.validity();
    slow.unlock().expect("unlock");
    for s in stalls {
        s.join().expect("stall");
    }
    assert!(
        slow_validity + Duration::from_millis(250) <= ttl,
        "validity {slow_validity:?} should lose the 340 ms the majority took"
    );

    let short = RedLock::with_options(
        clients(&nodes),
        "slower",
        redmutex::Options::default()
            .ttl(Duration::from_millis(300))
            .node_timeout(Duration::from_secs(2)),
    )
    .expect("redlock");
    let stalls = [stall(&nodes[0], 0.8), stall(&nodes[1], 0.8)];
    std::thread::sleep(Duration::from_millis(60)); // the stalls are under way
    assert!(
        short.try_lock().expect("try").is_none(),
        "replies slower than the ttl yield no guard"
    );
    for s in stalls {
        s.join().expect("stall");
    }
    assert!(wait_until(Duration::from_secs(3), || {
        nodes.iter().all(|node| value(node, "slower").is_none())
    }));
}

#[test]
fn mutual_exclusion_across_two_redlock_clients_while_a_node_restarts() {
    let mut nodes = RedisServer::start_many(3);
    let resource = RedisServer::start();
    let options = redmutex::Options::default()
        .ttl(Duration::from_secs(5))
        .wait(Duration::from_secs(30));
    let locks: Vec<RedLock> = (0..2)
        .map(|_| {
            RedLock::with_options(
                clients(&nodes),
                "mx",
                options.node_timeout(Duration::from_millis(250)),
            )
            .expect("redlock")
        })
        .collect();
    let intervals = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..8)
        .map(|i| {
            let lock = locks[i % 2].clone();
            let mut con = resource.conn();
            let intervals = intervals.clone();
            std::thread::spawn(move || {
                for _ in 0..40 {
                    let guard = lock.lock().expect("lock");
                    let entered = Instant::now();
                    let n: Option<i64> = con.get("counter").expect("GET");
                    let _: () = con.set("counter", n.unwrap_or(0) + 1).expect("SET");
                    intervals
                        .lock()
                        .expect("intervals")
                        .push((entered, Instant::now()));
                    guard.unlock().ok(); // a node may be down
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    nodes[1].restart(); // killed and back, empty
    for worker in workers {
        worker.join().expect("worker");
    }
    let n: i64 = resource.conn().get("counter").expect("GET");
    assert_eq!(n, 320, "lost increments mean overlapping holders");
    let mut intervals = std::mem::take(&mut *intervals.lock().expect("intervals"));
    intervals.sort();
    assert!(
        intervals.windows(2).all(|w| w[1].0 >= w[0].1),
        "holds overlapped"
    );
}

/// Five nodes, the last two behind proxies: clients for the three direct
/// ones and the two proxied ones.
fn five_with_two_proxied(
    nodes: &[RedisServer],
    proxies: &[support::FaultProxy],
) -> Vec<LockClient> {
    let mut clients: Vec<LockClient> = nodes[..3].iter().map(RedisServer::lock_client).collect();
    clients.extend(
        proxies
            .iter()
            .map(|p| LockClient::open(&p.url()).expect("proxied client")),
    );
    clients
}

/// With 2 of 5 nodes blackholed, every cycle still locks and `unlock()`
/// returns at the majority: it never waits for a node known down (before,
/// each unlock sat 1.8–3.8 s behind the blackholed nodes' timeouts). After
/// the heal nothing is left on any node.
#[test]
fn with_two_of_five_blackholed_unlock_returns_at_the_majority() {
    // Timing-sensitive, or heavy (proxies, blackholes): one at a time.
    let _serial = support::serial();
    let nodes = RedisServer::start_many(5);
    let proxies: Vec<support::FaultProxy> =
        nodes[3..].iter().map(support::FaultProxy::to).collect();
    let lock = RedLock::with_options(
        five_with_two_proxied(&nodes, &proxies),
        "minority",
        // Far longer than the wait below: a key left behind cannot pass by
        // merely expiring.
        redmutex::Options::default()
            .ttl(Duration::from_secs(120))
            .wait(Duration::from_secs(5))
            .node_timeout(Duration::from_millis(200)),
    )
    .expect("redlock");
    lock.lock()
        .expect("healthy")
        .unlock()
        .expect("healthy unlock");
    for proxy in &proxies {
        proxy.blackhole(true);
    }
    let mut slowest = [Duration::ZERO; 3];
    for _ in 0..20 {
        let guard = lock.lock().expect("3 of 5 grant");
        let started = Instant::now();
        guard.unlock().expect("released on the majority");
        slowest[0] = slowest[0].max(started.elapsed());
        let mut guard = lock.lock().expect("3 of 5 grant");
        let started = Instant::now();
        guard
            .extend(Duration::from_secs(120))
            .expect("extended on the majority");
        slowest[1] = slowest[1].max(started.elapsed());
        let started = Instant::now();
        drop(guard);
        slowest[2] = slowest[2].max(started.elapsed());
    }
    // One node timeout at most (not the nodes' 2 s timeouts), and the
    // slack of a deadline the crate computes (tests/bounds.rs's
    // SHORT_SLACK).
    let limit = Duration::from_millis(200) + Duration::from_millis(60);
    eprintln!(
        "bound | RedLock unlock, extend, drop, 2 of 5 blackholed | worst {slowest:?} | limit {limit:?}"
    );
    assert!(
        slowest.iter().all(|took| *took < limit),
        "unlock, extend, drop took {slowest:?}"
    );
    for proxy in &proxies {
        proxy.heal();
    }
    assert!(
        wait_until(Duration::from_secs(10), || nodes
            .iter()
            .all(|node| value(node, "minority").is_none())),
        "a key was left behind after the heal"
    );
}

/// With 3 of 5 nodes blackholed for longer than the cleanup's window (the
/// proxied clients' timeout is 200 ms, so the window is 1 s) no round
/// wins. Requests queued for the unreachable nodes are not replayed when
/// they heal: what was never sent stays unsent, and what was held on the
/// way and applied after the heal is undone as soon as the node answers
/// (the cleanup keeps watching while the node is unreachable). Before,
/// keys of long-failed rounds were found freshly set after the heal.
#[test]
fn requests_for_unreachable_nodes_are_not_applied_after_they_heal() {
    // Timing-sensitive, or heavy (proxies, blackholes): one at a time.
    let _serial = support::serial();
    let nodes = RedisServer::start_many(5);
    let proxies: Vec<support::FaultProxy> =
        nodes[2..].iter().map(support::FaultProxy::to).collect();
    let mut clients: Vec<LockClient> = nodes[..2].iter().map(RedisServer::lock_client).collect();
    clients.extend(proxies.iter().map(|p| {
        LockClient::builder()
            .url(p.url())
            .timeout(Duration::from_millis(200))
            .build()
            .expect("proxied client")
    }));
    let lock = RedLock::with_options(
        clients,
        "replayed",
        redmutex::Options::default()
            .ttl(Duration::from_secs(30))
            .node_timeout(Duration::from_millis(100)),
    )
    .expect("redlock");
    for proxy in &proxies {
        proxy.blackhole(true);
    }
    let started = Instant::now();
    let mut rounds = 0;
    while started.elapsed() < Duration::from_secs(6) && rounds < 400 {
        assert!(
            lock.try_lock().expect("try").is_none(),
            "2 of 5 is no majority"
        );
        rounds += 1;
        // Paced, so the partition outlasts the cleanup's window and the
        // nodes' probes (every 250 ms, doubling up to 5 s) leave a request
        // held on the way long before the heal.
        std::thread::sleep(Duration::from_millis(20));
    }
    for proxy in &proxies {
        proxy.heal();
    }
    // A request held on the way may land at the heal: it is undone, and
    // then the key stays gone (no queued request is replayed later). Clean
    // for 2 s in a row (twice the window), within 15 s.
    let healed = Instant::now();
    let mut dirty_at = healed;
    let mut settled = false;
    while healed.elapsed() < Duration::from_secs(15) {
        if nodes.iter().any(|node| value(node, "replayed").is_some()) {
            dirty_at = Instant::now();
        } else if dirty_at.elapsed() >= Duration::from_secs(2) {
            settled = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        settled,
        "a failed round's key was applied after the heal and left (last seen {:?} after the heal)",
        dirty_at.duration_since(healed)
    );
    assert!(rounds > 3, "{rounds}");
    // Requests for the unreachable nodes were not queued for them: each
    // got its first request and a probe now and then (250 ms, doubling),
    // not one per round replayed after the heal. Counted by the nodes:
    // only an acquisition sends `SET`.
    for node in &nodes[2..] {
        let sets = node.command_calls("set");
        assert!(
            sets <= 40,
            "{sets} acquisitions reached a node that was down for {rounds} rounds"
        );
    }
}

/// On main `unlock()` said `Ok(())` while another client held the RedLock:
/// A's key lived on on node 2 (its `SET` arrived late there), expired on
/// nodes 0 and 1, and client B took the RedLock on those two; A's unlock
/// heard node 2 release and one of B's nodes, and called that a release.
/// `Ok` now needs a majority that held our token, and the answer is the
/// same whichever nodes answer first.
#[test]
fn unlock_and_extend_tell_the_truth_when_another_client_holds_the_majority() {
    let nodes = RedisServer::start_many(3);
    let options = redmutex::Options::default().ttl(Duration::from_secs(30));
    let a = RedLock::with_options(clients(&nodes), "truth", options).expect("A");
    let b = RedLock::with_options(clients(&nodes), "truth", options).expect("B");
    for round in 0..3 {
        let mut held = a.lock().expect("A locks");
        // `lock()` returns at a majority: the third node's `SET` may still
        // be on its way, and would land after the deletion below.
        let token = held.token().to_owned();
        wait_until(Duration::from_secs(2), || {
            nodes
                .iter()
                .all(|node| value(node, "truth").as_deref() == Some(token.as_str()))
        });
        // A's key lives on on node 2 only; nodes 0 and 1 lose it.
        for node in &nodes[..2] {
            let _: () = node.conn().del("truth").expect("DEL");
        }
        let theirs = b.try_lock().expect("B tries").expect("B takes 0 and 1");
        assert_eq!(value(&nodes[2], "truth").as_deref(), Some(held.token()));
        let extended = held.extend(Duration::from_secs(30));
        assert!(
            matches!(
                extended,
                Err(Error::NotHeld {
                    reason: redmutex::LossReason::OwnedByOther,
                    ..
                })
            ),
            "round {round}: extend gave {extended:?}"
        );
        let unlocked = held.unlock();
        assert!(
            matches!(
                unlocked,
                Err(Error::NotHeld {
                    reason: redmutex::LossReason::OwnedByOther,
                    ..
                })
            ),
            "round {round}: unlock gave {unlocked:?}"
        );
        // Nothing of B's was touched; A's stray key on node 2 is gone.
        for node in &nodes[..2] {
            assert_eq!(value(node, "truth").as_deref(), Some(theirs.token()));
        }
        assert!(wait_until(Duration::from_secs(2), || value(
            &nodes[2], "truth"
        )
        .is_none()));
        theirs.unlock().expect("B unlocks");
    }
}

/// On f63675e: three nodes, another client's key on node 2, ours on nodes
/// 0 and 1, and node 1 answering after the node timeout. `extend()` and
/// `unlock()` said `NotHeld` (node 2's "not ours" counted toward "a
/// majority answered", node 1's late "ours" for nothing), and `extend`
/// zeroed the validity, while our token sat on a majority. One "not ours"
/// of three rules no majority out: the truth is unknown, and the answers
/// say so (`QuorumLost`, `NodesUnreachable`), never `NotHeld`.
#[test]
fn a_late_node_holding_our_token_makes_the_answer_unknown_not_not_held() {
    let nodes = RedisServer::start_many(3);
    let proxy = support::FaultProxy::to(&nodes[1]);
    let timeout = Duration::from_millis(200);
    let clients = vec![
        nodes[0].lock_client(),
        LockClient::open(&proxy.url()).expect("client"),
        nodes[2].lock_client(),
    ];
    let _: () = nodes[2]
        .conn()
        .set_ex("late", "someone else", 60)
        .expect("SET");
    let options = redmutex::Options::default().ttl(Duration::from_secs(30));
    let lock = RedLock::with_options(clients, "late", options.node_timeout(timeout)).expect("lock");
    let mut held = lock.lock().expect("a majority: nodes 0 and 1");
    let token = held.token().to_owned();
    // Node 1 answers, but only after the node timeout.
    proxy.set_latency(Duration::from_millis(400), Duration::ZERO);
    let extended = held.extend(Duration::from_secs(30));
    assert!(
        matches!(extended, Err(Error::QuorumLost { .. })),
        "extend gave {extended:?}"
    );
    // The late extension reached node 1: our token is still there.
    assert!(wait_until(Duration::from_secs(2), || {
        value(&nodes[1], "late").as_deref() == Some(token.as_str())
    }));
    assert_eq!(value(&nodes[0], "late").as_deref(), Some(token.as_str()));
    let unlocked = held.unlock();
    assert!(
        matches!(unlocked, Err(Error::NodesUnreachable { released: 1, .. })),
        "unlock gave {unlocked:?}"
    );
    proxy.heal();
    // Node 1's release, late, still comes (or its cleanup does).
    assert!(wait_until(Duration::from_secs(5), || value(
        &nodes[1], "late"
    )
    .is_none()));
    assert_eq!(value(&nodes[2], "late").as_deref(), Some("someone else"));
}

/// `is_held` answers from the definition (a majority holding our token),
/// and a loss it or an extension finds is reported by `is_lost` and the
/// loss signal.
#[test]
fn is_held_answers_from_a_majority_and_a_loss_is_reported() {
    let nodes = RedisServer::start_many(3);
    let proxy = support::FaultProxy::to(&nodes[2]);
    let clients = vec![
        nodes[0].lock_client(),
        nodes[1].lock_client(),
        LockClient::open(&proxy.url()).expect("client"),
    ];
    let timeout = Duration::from_millis(300);
    let lock = RedLock::with_options(
        clients,
        "asked",
        redmutex::RedLockOptions::default().node_timeout(timeout),
    )
    .expect("lock");
    let held = lock.lock().expect("lock");
    let signal = held.loss_signal();
    // Every node's grant landed (the round returned at a majority; a
    // slower node's grant landing after the deletion below would undo it).
    let token = held.token().to_owned();
    assert!(wait_until(Duration::from_secs(10), || {
        nodes
            .iter()
            .all(|node| value(node, "asked").as_deref() == Some(token.as_str()))
    }));
    assert!(held.is_held().expect("asked"));
    assert!(!held.is_lost());

    // Gone on one node: a majority still holds it.
    let _: () = nodes[0].conn().del("asked").expect("DEL");
    assert!(held.is_held().expect("asked"));
    // Gone on one, node 2 silent: neither a majority nor ruled out.
    proxy.blackhole(true);
    let asked = held.is_held();
    assert!(
        matches!(
            asked,
            Err(Error::QuorumLost {
                extended: 1,
                needed: 2,
                ..
            })
        ),
        "{asked:?}"
    );
    assert!(!held.is_lost(), "unknown is not a loss");
    proxy.blackhole(false);
    proxy.heal();
    // Another owner on node 1: no majority can hold ours.
    let _: () = nodes[1]
        .conn()
        .set_ex("asked", "someone else", 60)
        .expect("SET");
    assert!(wait_until(Duration::from_secs(5), || {
        held.is_held().is_ok_and(|held| !held)
    }));
    assert!(held.is_lost());
    assert_eq!(held.validity(), Duration::ZERO);
    assert_eq!(
        signal.wait_timeout(Duration::from_secs(1)),
        Some(LossReason::OwnedByOther)
    );
    assert_eq!(value(&nodes[1], "asked").as_deref(), Some("someone else"));
    drop(held);
}

/// An extension that cannot reach a majority leaves the truth unknown:
/// no loss, the validity zero, and an extension a majority confirms later
/// restores it.
#[test]
fn an_extension_that_cannot_reach_a_majority_is_unknown_not_lost() {
    let nodes = RedisServer::start_many(3);
    let proxies = [
        support::FaultProxy::to(&nodes[1]),
        support::FaultProxy::to(&nodes[2]),
    ];
    let clients = vec![
        nodes[0].lock_client(),
        LockClient::open(&proxies[0].url()).expect("client"),
        LockClient::open(&proxies[1].url()).expect("client"),
    ];
    let lock = RedLock::with_options(
        clients,
        "cut",
        redmutex::RedLockOptions::default().node_timeout(Duration::from_millis(200)),
    )
    .expect("lock");
    let mut held = lock.lock().expect("lock");
    let signal = held.loss_signal();
    for proxy in &proxies {
        proxy.blackhole(true);
    }
    let extended = held.extend(Duration::from_secs(30));
    assert!(
        matches!(extended, Err(Error::QuorumLost { .. })),
        "{extended:?}"
    );
    assert!(!held.is_lost(), "unknown is not a loss");
    assert_eq!(signal.reason(), None);
    assert_eq!(held.validity(), Duration::ZERO);
    for proxy in &proxies {
        proxy.blackhole(false);
        proxy.heal();
    }
    // The nodes answer again (once no longer known down): a majority
    // confirms the extension.
    assert!(wait_until(Duration::from_secs(10), || {
        held.extend(Duration::from_secs(30)).is_ok()
    }));
    assert!(held.validity() > Duration::from_secs(20));
    assert!(held.is_held().expect("asked"));
    assert!(!held.is_lost());
    assert_eq!(held.unlock().expect("unlock"), redmutex::Unlocked::Released);
}

/// Waiting is by notify: a waiter is woken by the release message of the
/// nodes, long before its 8 s backoff step or the holder's ttl.
#[test]
fn a_waiter_is_woken_by_the_release_message() {
    let nodes = RedisServer::start_many(3);
    let slow = redmutex::Options::default()
        .ttl(Duration::from_secs(30))
        .backoff(redmutex::Backoff::constant(Duration::from_secs(8)));
    let holder = RedLock::with_options(clients(&nodes), "woken", slow).expect("lock");
    let waiter = RedLock::with_options(clients(&nodes), "woken", slow).expect("lock");
    let channel = nodes[0].lock_client().release_channel("woken");
    let held = holder.lock().expect("lock");
    let waiting = std::thread::spawn(move || {
        let got = waiter.try_lock_for(Duration::from_secs(20)).expect("wait");
        let woken = Instant::now();
        got.map(|guard| guard.unlock().expect("unlock"));
        woken
    });
    assert!(
        wait_until(Duration::from_secs(5), || nodes
            .iter()
            .all(|node| support::numsub(node, &channel) > 0)),
        "the waiter subscribed on every node"
    );
    std::thread::sleep(Duration::from_millis(100));
    let released = Instant::now();
    assert_eq!(held.unlock().expect("unlock"), redmutex::Unlocked::Released);
    let woken = waiting.join().expect("waiter");
    let after = woken.saturating_duration_since(released);
    assert!(
        after < Duration::from_secs(4),
        "woken {after:?} after the release, not by the 8 s backoff"
    );
}

/// A round lost against a holder of a majority (nodes 0 and 1) undoes its
/// grant on node 2 without announcing it on the key's channel: announced,
/// it woke this very waiter (subscribed on every node) at once, in a busy
/// loop for as long as it waited.
#[test]
fn undoing_a_lost_rounds_grant_wakes_nobody() {
    let nodes = RedisServer::start_many(3);
    for node in &nodes[..2] {
        let _: () = node
            .conn()
            .set_ex("storm", "held elsewhere", 60)
            .expect("SET");
    }
    let options = redmutex::Options::default()
        .ttl(Duration::from_secs(30))
        .backoff(redmutex::Backoff::constant(Duration::from_secs(1)));
    let lock = RedLock::with_options(clients(&nodes), "storm", options).expect("lock");
    let before = nodes[2].command_calls("set") + nodes[2].command_calls("evalsha");
    let got = lock.try_lock_for(Duration::from_secs(3)).expect("wait");
    assert!(got.is_none(), "held elsewhere on a majority");
    let rounds = nodes[2].command_calls("set") + nodes[2].command_calls("evalsha") - before;
    // About one round per 1 s backoff step (each a grant and its undo).
    assert!(rounds <= 12, "{rounds} requests on node 2 in 3 s");
    assert_eq!(value(&nodes[2], "storm"), None, "every grant undone");
}
