//! What a RedLock cycle costs next to a single-node lock, on private
//! redis-servers (loopback).
//!
//! `cargo run --release --example redlock -- [--rounds 2000]`

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use clap::Parser;
use redmutex::{DistributedLock, LockClient, RedLock};

#[derive(Parser)]
#[command(about = "RedLock acquire+release cost over 3 and 5 masters vs one node")]
struct Args {
    /// Acquire+release cycles per row.
    #[arg(long, default_value_t = 2000)]
    rounds: u32,
}

fn time(
    rounds: u32,
    mut cycle: impl FnMut() -> Result<(), redmutex::Error>,
) -> Result<Duration, redmutex::Error> {
    for _ in 0..rounds / 10 {
        cycle()?;
    }
    let started = Instant::now();
    for _ in 0..rounds {
        cycle()?;
    }
    Ok(started.elapsed() / rounds)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let servers = support::RedisServer::start_many(5);
    let clients: Vec<LockClient> = servers.iter().map(|s| s.lock_client()).collect();
    let ping = time(args.rounds, || {
        let mut con = clients[0].pool().get()?;
        redis::cmd("PING").exec(&mut *con)?;
        Ok(())
    })?;
    let single = DistributedLock::new(&clients[0], "bench:single");
    let one = time(args.rounds, || single.lock()?.unlock())?;
    println!("| lock | acquire+release | in PING round trips |");
    println!("|---|---|---|");
    println!("| PING | {ping:?} | 1.00 |");
    println!(
        "| single node | {one:?} | {:.2} |",
        one.as_secs_f64() / ping.as_secs_f64()
    );
    for n in [3, 5] {
        let lock = RedLock::new(clients[..n].to_vec(), format!("bench:redlock{n}"))?;
        let cycle = time(args.rounds, || lock.lock()?.unlock())?;
        println!(
            "| RedLock, {n} masters | {cycle:?} | {:.2} |",
            cycle.as_secs_f64() / ping.as_secs_f64()
        );
    }
    Ok(())
}
