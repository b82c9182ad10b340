//! What an uncontended acquire+release costs on each deployment the crate
//! supports, on private redis-server processes (loopback): one node, a
//! primary found through Sentinel, a 3-primary Redis Cluster, and RedLock
//! over 3 and 5 independent masters.
//!
//! `cargo run --release --example deployments -- [--rounds 2000]`

use redmutex_test_support as support;

use std::time::{Duration, Instant};

use clap::Parser;
use redmutex::Lease;
use redmutex::{DistributedLock, LockClient, RedLock};
use support::{RedisCluster, RedisServer, SentinelSet};

#[derive(Parser)]
#[command(about = "acquire+release cost: single node, Sentinel, Cluster, RedLock 3 and 5")]
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
    let servers = RedisServer::start_many(5);
    let clients: Vec<LockClient> = servers.iter().map(|s| s.lock_client()).collect();
    let sentinels = SentinelSet::start();
    let cluster = RedisCluster::start(3, 0);

    let ping = time(args.rounds, || {
        redis::cmd("PING").exec(&mut clients[0].connection()?)?;
        Ok(())
    })?;
    let row = |name: &str, cycle: Duration| {
        println!(
            "| {name} | {cycle:.1?} | {:.2} |",
            cycle.as_secs_f64() / ping.as_secs_f64()
        );
    };
    println!("| lock | acquire+release | in PING round trips |");
    println!("|---|---|---|");
    row("PING (one node)", ping);

    let single = DistributedLock::new(&clients[0], "bench:single");
    row(
        "single node",
        time(args.rounds, || single.lock()?.unlock().map(drop))?,
    );

    let via_sentinel = DistributedLock::new(&sentinels.lock_client(), "bench:sentinel");
    row(
        "primary via Sentinel",
        time(args.rounds, || via_sentinel.lock()?.unlock().map(drop))?,
    );

    let cluster_client = cluster.lock_client();
    let keys = cluster.key_per_primary("bench:cluster");
    let locks: Vec<DistributedLock> = keys
        .iter()
        .map(|key| DistributedLock::new(&cluster_client, key.clone()))
        .collect();
    let mut next = 0;
    row(
        "Redis Cluster, 3 primaries",
        time(args.rounds, || {
            next = (next + 1) % locks.len();
            locks[next].lock()?.unlock().map(drop)
        })?,
    );

    for n in [3, 5] {
        let lock = RedLock::new(clients[..n].to_vec(), format!("bench:redlock{n}"))?;
        let cycle = time(args.rounds, || lock.lock()?.unlock().map(drop))?;
        row(&format!("RedLock, {n} masters"), cycle);
    }
    Ok(())
}
