//! The chaos run of `tests/chaos.rs`, for as long as asked:
//!
//! ```sh
//! cargo run --release --example chaos -- --secs 300 [--deployment single|redlock|cluster|sentinel]
//!     [--min-replicas] [--processes 4] [--threads 4] [--seed N] [--limit N]
//! ```
//!
//! With `--limit N` the workers take permits of a semaphore of N instead
//! (the check: never more than N holders claiming validity at once).
//!
//! Worker processes (this program run again) × threads take one lock (ttl
//! 500 ms); the fenced half do a read-modify-write on a second server that
//! refuses stale fencing tokens, the other half hand the lease to each
//! other, while the controller stops and continues workers
//! for longer than the lease, kills them (and starts new ones), and injects
//! the deployment's faults:
//!
//! * `single` (default): one redis-server behind a fault proxy: `CLIENT
//!   KILL`, `DEBUG SLEEP`, `SCRIPT FLUSH`, lost replies, resets, latency,
//!   blackholes, stalled handshakes.
//! * `redlock`: 5 redis-servers behind proxies; 2 of them blackholed for
//!   1-3.5 s at a time, and the single-node faults on one node. It prints
//!   the acquisition rate and longest `unlock()` inside and outside those
//!   windows. (No fencing tokens on RedLock: holders only hold.)
//! * `cluster`: 3 primaries with a replica each: the lock's slot (with its
//!   fencing counter) migrated to another primary, `CLUSTER FAILOVER
//!   FORCE` of its primary, `CLIENT KILL`, `DEBUG SLEEP`, `SCRIPT FLUSH`.
//! * `sentinel`: a primary and a replica behind proxies and 3 sentinels:
//!   replication cut, the primary SIGKILLed and the replica promoted
//!   without the last writes (fencing increments lost), and the
//!   single-node faults on the primary.
//!
//! It prints acquisitions, fenced rejections, lost updates, fencing tokens
//! repeated or lower than an earlier one, overlaps of two holders that both
//! claimed validity (allowed only from a failover's start until a lease
//! after it, on Cluster and Sentinel, where a lock not yet replicated is
//! lost), errors by kind (a redirection reaching a caller is a failure),
//! the longest wait and `unlock()`, and exits 1 if a property failed.

use redmutex_test_support as support;

use std::process::{Command, ExitCode};
use std::time::Instant;

use clap::Parser;
use support::chaos::{self, Deployment};

#[derive(Parser, Debug)]
#[command(about = "redmutex under faults: exclusion, fencing and cleanup, measured")]
struct Args {
    /// How long the chaos lasts.
    #[arg(long, default_value_t = 60.0)]
    secs: f64,
    /// Worker processes.
    #[arg(long, default_value_t = 4)]
    processes: usize,
    /// Threads per worker process.
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Seed of the controller's choices (default: the process id).
    #[arg(long)]
    seed: Option<u64>,
    /// Take permits of a semaphore of N instead of the lock (not on redlock).
    #[arg(long, default_value_t = 0)]
    limit: u32,
    /// Where the lock lives: single, redlock, cluster or sentinel.
    #[arg(long, default_value = "single", value_parser = parse_deployment)]
    deployment: Deployment,
    /// Lock with `min_replicas(1, 100 ms)` (cluster and sentinel).
    #[arg(long)]
    min_replicas: bool,
    /// Internal: run as a worker: TARGET RESOURCE_URL THREADS SECS LIMIT.
    #[arg(long, hide = true, num_args = 5)]
    worker: Option<Vec<String>>,
}

fn parse_deployment(name: &str) -> Result<Deployment, String> {
    Deployment::parse(name)
        .ok_or_else(|| format!("{name:?}: expected single, redlock, cluster or sentinel"))
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.limit > 0 && args.deployment == Deployment::RedLock {
        eprintln!("chaos: --limit takes a semaphore, and RedLock has none");
        return ExitCode::FAILURE;
    }
    if args.min_replicas && !matches!(args.deployment, Deployment::Cluster | Deployment::Sentinel) {
        eprintln!("chaos: --min-replicas needs replicas: --deployment cluster or sentinel");
        return ExitCode::FAILURE;
    }
    if let Some(worker) = &args.worker {
        let threads = worker[2].parse().unwrap_or(4);
        let secs = worker[3].parse().unwrap_or(10.0);
        let limit = worker[4].parse().unwrap_or(0);
        chaos::worker(&worker[0], &worker[1], threads, secs, limit);
        return ExitCode::SUCCESS;
    }
    let config = chaos::Config {
        deployment: args.deployment,
        min_replicas: args.min_replicas,
        limit: args.limit,
        processes: args.processes.max(1),
        threads: args.threads.max(1),
        secs: args.secs,
        seed: args.seed.unwrap_or(u64::from(std::process::id())),
    };
    let Ok(exe) = std::env::current_exe() else {
        eprintln!("chaos: cannot find this program to run workers");
        return ExitCode::FAILURE;
    };
    let started = Instant::now();
    let report = chaos::run(&config, &|lock, resource, threads, secs, limit| {
        let mut command = Command::new(&exe);
        command.arg("--worker").args([
            lock,
            resource,
            &threads.to_string(),
            &secs.to_string(),
            &limit.to_string(),
        ]);
        command
    });
    println!("{}", chaos::render(&config, &report, started.elapsed()));
    let failures = report.failures();
    if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        for failure in failures {
            eprintln!("FAILED: {failure}");
        }
        ExitCode::FAILURE
    }
}
