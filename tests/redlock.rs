//! RedLock over independent masters: quorum over every subset of unavailable
//! nodes (go-redsync style), validity under latency, late replies, and
//! mutual exclusion while a node is killed and restarted.

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::Commands;
use redmutex::{Error, LeaseOptions, LockClient, RedLock};
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
        LeaseOptions::default().wait(Duration::from_millis(100)),
    )
    .expect("redlock");
    match lock.lock() {
        Err(Error::Quorum {
            granted,
            needed,
            failed,
            ..
        }) => {
            assert_eq!((granted, needed), (1, 2));
            assert_eq!(failed.len(), 2, "{failed:?}");
            assert!(failed.iter().any(|f| f.starts_with("node 1")), "{failed:?}");
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
    let nodes = RedisServer::start_many(3);
    let ttl = Duration::from_secs(2);
    let lock = RedLock::with_options(clients(&nodes), "stop", LeaseOptions::default().ttl(ttl))
        .expect("redlock")
        .node_timeout(Duration::from_millis(100));
    nodes[2].signal("STOP");
    let guard = lock.try_lock().expect("try").expect("2 of 3 answer");
    guard.unlock().expect_err("one node unreachable at release");
    nodes[1].signal("STOP");
    let started = Instant::now();
    assert!(
        lock.try_lock().expect("try").is_none(),
        "1 of 3 is no majority"
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "bounded by the node timeout"
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
    let nodes = RedisServer::start_many(3);
    let ttl = Duration::from_secs(2);
    let lock = RedLock::with_options(clients(&nodes), "slow", LeaseOptions::default().ttl(ttl))
        .expect("redlock")
        .node_timeout(Duration::from_secs(1));
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
        LeaseOptions::default().ttl(Duration::from_millis(300)),
    )
    .expect("redlock")
    .node_timeout(Duration::from_secs(2));
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
    let options = LeaseOptions::default()
        .ttl(Duration::from_secs(5))
        .wait(Duration::from_secs(30));
    let locks: Vec<RedLock> = (0..2)
        .map(|_| {
            RedLock::with_options(clients(&nodes), "mx", options)
                .expect("redlock")
                .node_timeout(Duration::from_millis(250))
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
