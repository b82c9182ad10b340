//! The chaos tests: 4 processes x 4 threads on one lock, half of them
//! fenced (and on a semaphore of 3 permits), a quarter releasing by drop
//! (the release written behind), under random SIGSTOP/SIGCONT and SIGKILL of
//! workers and the faults of each deployment: one server (`CLIENT KILL`,
//! `DEBUG SLEEP`, `SCRIPT FLUSH` and proxy faults: lost replies, resets,
//! latency, blackholes, stalled handshakes), RedLock over 5 nodes with 2
//! of them blackholed for seconds at a time, a Redis Cluster whose lock
//! slot migrates and fails over (`CLUSTER FAILOVER FORCE`), and a Sentinel
//! set whose primary is killed after its replication was cut (the
//! promoted replica misses the last fencing increments). See
//! `tests/support/chaos.rs` for what is checked; `cargo run --release
//! --example chaos -- --deployment cluster --secs 300` runs one for longer
//! and prints the figures.
//!
//! The runs take turns (`support::serial`): two at once would be eight
//! worker processes and up to ten servers on two cores.

use redmutex_test_support as support;

use std::process::Command;
use std::time::{Duration, Instant};

use support::chaos::{self, Deployment};

const ROLE: &str = "REDMUTEX_CHAOS_ROLE";

/// A worker process: this test binary run again with `ROLE` set.
#[test]
fn worker() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let mut parts = role.split(' ');
    let (Some(target), Some(resource), Some(threads), Some(secs), Some(limit)) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        panic!("bad worker role {role:?}");
    };
    chaos::worker(
        target,
        resource,
        threads.parse().expect("threads"),
        secs.parse().expect("secs"),
        limit.parse().expect("limit"),
    );
}

#[test]
fn chaos() {
    chaos_with(Deployment::Single, 0, 25.0, &[]);
}

/// The default test tier's chaos: the same on one server, 2 processes x 2
/// threads for 6 s.
#[test]
fn short_chaos() {
    chaos_in(
        chaos::Config {
            processes: 2,
            threads: 2,
            ..config(Deployment::Single, 0, 6.0)
        },
        &[],
    );
}

/// The same chaos on permits of a semaphore of 3: never more than 3 holders
/// that claim validity at once (recorded intervals, 4 processes x 4
/// threads, holders stopped past their lease and killed).
#[test]
fn semaphore_chaos() {
    chaos_with(Deployment::Single, 3, 15.0, &[]);
}

/// RedLock over 5 nodes, 2 of them blackholed for 1-3.5 s at a time: no
/// two holders at once, the lock keeps at least half its rate meanwhile,
/// and `unlock()` does not wait for the unreachable nodes.
#[test]
fn redlock_chaos() {
    let report = chaos_with(Deployment::RedLock, 0, 20.0, &["2 of 5 nodes blackholed"]);
    assert!(
        report.in_windows.0 > 0,
        "nothing acquired while 2 of 5 nodes were blackholed: {report:?}"
    );
}

/// A Cluster of 3 primaries with a replica each: the lock's slot migrates
/// and its primary is failed over by force under load; no raw redirection
/// reaches a caller and fencing tokens never repeat or go backwards.
#[test]
fn cluster_chaos() {
    chaos_with(
        Deployment::Cluster,
        0,
        15.0,
        &["lock slot migrated", "CLUSTER FAILOVER FORCE"],
    );
}

/// A Sentinel set whose primary is killed after its replication was cut:
/// the promoted replica misses fencing increments, and tokens still never
/// repeat or go backwards (the clock floor); no update is lost.
#[test]
fn sentinel_chaos() {
    chaos_with(
        Deployment::Sentinel,
        0,
        20.0,
        &["failover that lost fencing increments"],
    );
}

/// 4 processes x 4 threads on `deployment` for `secs`.
fn config(deployment: Deployment, limit: u32, secs: f64) -> chaos::Config {
    chaos::Config {
        deployment,
        min_replicas: false,
        limit,
        processes: 4,
        threads: 4,
        secs,
        seed: std::process::id() as u64,
    }
}

fn chaos_with(deployment: Deployment, limit: u32, secs: f64, faults: &[&str]) -> chaos::Report {
    chaos_in(config(deployment, limit, secs), faults)
}

fn chaos_in(config: chaos::Config, faults: &[&str]) -> chaos::Report {
    if std::env::var_os(ROLE).is_some() {
        return chaos::Report::default();
    }
    let _serial = support::serial();
    let exe = std::env::current_exe().expect("test binary");
    let started = Instant::now();
    let report = chaos::run(&config, &|target, resource, threads, secs, limit| {
        let mut command = Command::new(&exe);
        command
            .args(["--exact", "worker", "--nocapture", "--test-threads=1"])
            .env(
                ROLE,
                format!("{target} {resource} {threads} {secs} {limit}"),
            );
        command
    });
    let took = started.elapsed();
    println!("{}", chaos::render(&config, &report, took));
    let failures = report.failures();
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(report.acquisitions > 100, "{report:?}");
    for fault in faults {
        assert!(
            report.faults.get(fault).is_some_and(|n| *n > 0),
            "no {fault:?} was injected: {report:?}"
        );
    }
    assert!(took < Duration::from_secs(120), "took {took:?}");
    report
}

/// The interval check itself: it counts holds valid at one moment and
/// flags the one that begins while the limit's worth are still valid.
#[test]
fn the_interval_check_counts_holders_at_once() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let hold = |start, end, who: &str| (start, end, who.to_owned());
    let holds = vec![
        hold(0, 10, "a"),
        hold(2, 12, "b"),
        hold(4, 6, "c"),
        hold(10, 20, "d"), // a ends as d begins: no overlap
    ];
    assert_eq!(chaos::most_at_once(&holds, 3), (3, vec![]));
    let (most, excess) = chaos::most_at_once(&holds, 2);
    assert_eq!(most, 3);
    assert_eq!(excess.len(), 1, "{excess:?}");
    assert!(excess[0].starts_with("c held from 4"), "{excess:?}");
    let (most, excess) = chaos::most_at_once(&holds[..1], 1);
    assert_eq!((most, excess.len()), (1, 0));
}

/// The token check itself: a token given twice, and one lower than a
/// token whose acquisition returned before it was asked for, are found;
/// tokens of overlapping acquisitions may come in either order.
#[test]
fn the_token_check_finds_repeated_and_backward_tokens() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let hold = |asked, acquired, token, who: &str| chaos::Held {
        asked,
        acquired,
        token,
        who: who.to_owned(),
        ..chaos::Held::default()
    };
    let mut report = chaos::Report::default();
    chaos::check_tokens(
        &[
            hold(0, 10, 5, "a"),
            hold(5, 12, 4, "b"), // asked before a returned: either order
            hold(20, 30, 6, "c"),
            hold(31, 40, 0, "unfenced"),
        ],
        &mut report,
    );
    assert_eq!(
        (
            report.tokens,
            report.tokens_repeated,
            report.tokens_backwards
        ),
        (3, 0, 0)
    );
    let mut report = chaos::Report::default();
    chaos::check_tokens(
        &[
            hold(0, 10, 5, "a"),
            hold(11, 20, 5, "b"), // repeated
            hold(21, 30, 3, "c"), // lower than a's and b's
        ],
        &mut report,
    );
    assert_eq!((report.tokens_repeated, report.tokens_backwards), (1, 1));
    assert_eq!(report.failures().len(), 2, "{:?}", report.failures());
}

/// A redirection is counted as one whether it reaches the caller raw or
/// inside an unknown outcome (a write whose slot kept moving).
#[test]
fn redirections_that_reach_callers_are_counted() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let reply = |text: &str| -> redis::RedisError {
        match redis::parse_redis_value(text.as_bytes()).and_then(|v| v.extract_error()) {
            Err(err) => err,
            Ok(value) => panic!("{text:?} parsed as {value:?}"),
        }
    };
    let raw = redmutex::Error::Redis(reply("-MOVED 1 127.0.0.1:1\r\n"));
    assert_eq!(chaos::kind(&raw), chaos::RAW_REDIRECTION);
    let wrapped = redmutex::Error::OutcomeUnknown {
        key: "k".into(),
        operation: "acquire",
        source: reply("-TRYAGAIN Multiple keys request during rehashing of slot\r\n"),
    };
    assert_eq!(chaos::kind(&wrapped), chaos::UNRESOLVED_REDIRECTION);
    let other = redmutex::Error::Redis(reply("-ERR nope\r\n"));
    assert_eq!(chaos::kind(&other), "redis");
}
