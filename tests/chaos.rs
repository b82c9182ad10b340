//! The chaos test: 4 processes x 4 threads on one fenced lock for about
//! 30 s (and on a semaphore of 3 permits for about 15 s), under random SIGSTOP/SIGCONT and SIGKILL of workers, CLIENT KILL,
//! DEBUG SLEEP, SCRIPT FLUSH and proxy faults (lost replies, resets,
//! latency, blackholes, stalled handshakes). See `tests/support/chaos.rs`
//! for what is checked; `cargo run --example chaos -- --secs 300` runs the
//! same for longer and prints the figures.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use support::chaos;

const ROLE: &str = "REDMUTEX_CHAOS_ROLE";

/// A worker process: this test binary run again with `ROLE` set.
#[test]
fn worker() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let mut parts = role.split(' ');
    let (Some(lock), Some(resource), Some(threads), Some(secs), Some(limit)) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        panic!("bad worker role {role:?}");
    };
    chaos::worker(
        lock,
        resource,
        threads.parse().expect("threads"),
        secs.parse().expect("secs"),
        limit.parse().expect("limit"),
    );
}

#[test]
fn chaos() {
    chaos_with(0, 25.0);
}

/// The same chaos on permits of a semaphore of 3: never more than 3 holders
/// that claim validity at once (recorded intervals, 4 processes x 4
/// threads, holders stopped past their lease and killed).
#[test]
fn semaphore_chaos() {
    chaos_with(3, 15.0);
}

fn chaos_with(limit: u32, secs: f64) {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let config = chaos::Config {
        limit,
        processes: 4,
        threads: 4,
        secs,
        seed: std::process::id() as u64,
    };
    let exe = std::env::current_exe().expect("test binary");
    let started = Instant::now();
    let report = chaos::run(&config, &|lock, resource, threads, secs, limit| {
        let mut command = Command::new(&exe);
        command
            .args(["--exact", "worker", "--nocapture", "--test-threads=1"])
            .env(ROLE, format!("{lock} {resource} {threads} {secs} {limit}"));
        command
    });
    let took = started.elapsed();
    println!("{}", chaos::render(&config, &report, took));
    let failures = report.failures();
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(report.acquisitions > 100, "{report:?}");
    assert!(took < Duration::from_secs(90));
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
