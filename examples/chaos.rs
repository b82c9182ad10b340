//! The chaos run of `tests/chaos.rs`, for as long as asked:
//!
//! ```sh
//! cargo run --release --example chaos -- --secs 300 [--processes 4] [--threads 4] [--seed N] [--limit N]
//! ```
//!
//! With `--limit N` the workers take permits of a semaphore of N instead
//! (the check: never more than N holders claiming validity at once).
//!
//! Worker processes (this program run again) × threads take one fenced lock
//! (ttl 500 ms) through a fault-injecting proxy in front of a private
//! redis-server and do a read-modify-write on a second server that refuses
//! stale fencing tokens, while the controller stops and continues workers
//! for longer than the lease, kills them (and starts new ones), kills
//! their connections (`CLIENT KILL`), stalls Redis (`DEBUG SLEEP`),
//! flushes its scripts, loses replies, resets connections, adds latency,
//! blackholes the link and stalls handshakes. It prints acquisitions,
//! fenced rejections, lost updates, overlaps of two holders that both
//! claimed validity, errors by kind and the longest wait, and exits 1 if a
//! property failed.

#[path = "../tests/support/mod.rs"]
mod support;

use std::process::{Command, ExitCode};
use std::time::Instant;

use clap::Parser;
use support::chaos;

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
    /// Take permits of a semaphore of N instead of the lock.
    #[arg(long, default_value_t = 0)]
    limit: u32,
    /// Internal: run as a worker: LOCK_URL RESOURCE_URL THREADS SECS LIMIT.
    #[arg(long, hide = true, num_args = 5)]
    worker: Option<Vec<String>>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(worker) = &args.worker {
        let threads = worker[2].parse().unwrap_or(4);
        let secs = worker[3].parse().unwrap_or(10.0);
        let limit = worker[4].parse().unwrap_or(0);
        chaos::worker(&worker[0], &worker[1], threads, secs, limit);
        return ExitCode::SUCCESS;
    }
    let config = chaos::Config {
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
