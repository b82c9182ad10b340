//! RedLock over 5 private redis-servers, 2 of them behind fault proxies:
//! how fast it locks and unlocks while healthy, while those 2 are
//! blackholed (a minority unreachable), and after they heal.
//!
//! `cargo run --release --example redlock_faults -- [--secs 30] [--threads 2]`
//!
//! Prints, per phase: acquisitions per second, the longest `unlock()`, and
//! the p99 of `unlock()`; then the keys left on any node after the heal.

use redmutex_test_support as support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use redmutex::Lease;
use redmutex::{LockClient, RedLock};
use support::{FaultProxy, RedisServer, wait_until};

#[derive(Parser)]
#[command(about = "RedLock with 2 of 5 nodes blackholed")]
struct Args {
    /// Seconds per phase (healthy, 2 blackholed, healed).
    #[arg(long, default_value_t = 30)]
    secs: u64,
    /// Threads locking and unlocking, each with its own RedLock handle.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// The node timeout (ms).
    #[arg(long, default_value_t = 50)]
    node_timeout_ms: u64,
}

/// One phase: every thread locks, unlocks, again, for `secs`.
fn phase(locks: &[RedLock], secs: u64) -> (u64, Vec<Duration>) {
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = locks
        .iter()
        .cloned()
        .map(|lock| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut acquired = 0u64;
                let mut unlocks = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(Some(guard)) = lock.try_lock_for(Duration::from_millis(500)) {
                        acquired += 1;
                        let started = Instant::now();
                        let _ = guard.unlock();
                        unlocks.push(started.elapsed());
                    }
                }
                (acquired, unlocks)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(secs));
    stop.store(true, Ordering::Relaxed);
    let mut total = 0;
    let mut unlocks = Vec::new();
    for worker in workers {
        if let Ok((acquired, times)) = worker.join() {
            total += acquired;
            unlocks.extend(times);
        }
    }
    unlocks.sort();
    (total, unlocks)
}

fn main() {
    let args = Args::parse();
    let nodes = RedisServer::start_many(5);
    let proxies: Vec<FaultProxy> = nodes[3..].iter().map(FaultProxy::to).collect();
    let clients = || -> Vec<LockClient> {
        let mut clients: Vec<LockClient> =
            nodes[..3].iter().map(RedisServer::lock_client).collect();
        clients.extend(
            proxies
                .iter()
                .map(|p| LockClient::open(&p.url()).expect("proxied client")),
        );
        clients
    };
    let locks: Vec<RedLock> = (0..args.threads.max(1))
        .map(|_| {
            RedLock::with_options(
                clients(),
                "faults",
                redmutex::Options::default()
                    .ttl(Duration::from_secs(10))
                    .wait(Duration::from_secs(5))
                    .node_timeout(Duration::from_millis(args.node_timeout_ms)),
            )
            .expect("redlock")
        })
        .collect();
    println!(
        "| phase | acq/s | longest unlock() | p99 unlock() | unlocks |\n|---|---|---|---|---|"
    );
    let report = |name: &str, (acquired, unlocks): (u64, Vec<Duration>)| {
        let p99 = unlocks
            .get(unlocks.len().saturating_mul(99) / 100)
            .copied()
            .unwrap_or_default();
        println!(
            "| {name} | {:.1} | {:?} | {:?} | {} |",
            acquired as f64 / args.secs as f64,
            unlocks.last().copied().unwrap_or_default(),
            p99,
            unlocks.len()
        );
    };
    report("healthy", phase(&locks, args.secs));
    for proxy in &proxies {
        proxy.blackhole(true);
    }
    report("2 of 5 blackholed", phase(&locks, args.secs));
    for proxy in &proxies {
        proxy.heal();
    }
    report("healed", phase(&locks, args.secs));
    let clean = wait_until(Duration::from_secs(15), || {
        nodes
            .iter()
            .all(|n| n.try_query::<Option<String>>(redis::cmd("GET").arg("faults")) == Some(None))
    });
    println!(
        "\nkeys left after the heal: {}",
        if clean {
            "none"
        } else {
            "some (see the nodes)"
        }
    );
}
