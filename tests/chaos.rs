//! The chaos test: 4 processes x 4 threads on one fenced lock for about
//! 30 s, under random SIGSTOP/SIGCONT and SIGKILL of workers, CLIENT KILL,
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
    let (Some(lock), Some(resource), Some(threads), Some(secs)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        panic!("bad worker role {role:?}");
    };
    chaos::worker(
        lock,
        resource,
        threads.parse().expect("threads"),
        secs.parse().expect("secs"),
    );
}

#[test]
fn chaos() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let config = chaos::Config {
        processes: 4,
        threads: 4,
        secs: 25.0,
        seed: std::process::id() as u64,
    };
    let exe = std::env::current_exe().expect("test binary");
    let started = Instant::now();
    let report = chaos::run(&config, &|lock, resource, threads, secs| {
        let mut command = Command::new(&exe);
        command
            .args(["--exact", "worker", "--nocapture", "--test-threads=1"])
            .env(ROLE, format!("{lock} {resource} {threads} {secs}"));
        command
    });
    let took = started.elapsed();
    println!("{}", chaos::render(&config, &report, took));
    let failures = report.failures();
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(report.acquisitions > 100, "{report:?}");
    assert!(took < Duration::from_secs(90));
}
