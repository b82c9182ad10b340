//! How soon a waiter in another process takes a lock after its release, on
//! a 3-primary Redis Cluster started on loopback: the release message
//! (sharded pub/sub on Redis 7.0+) is all that wakes it, its backoff step
//! being 10 s.
//!
//! `cargo run --release --example wakeup -- [--rounds 50]`
//!
//! Prints the wake-up latency (from just before `unlock()` to the waiter
//! holding the lock, both stamped with the same machine's clock) p50, p99
//! and max, and the cluster bus messages the releases sent.

use redmutex_test_support as support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Parser;
use redmutex::Lease;
use redmutex::{Backoff, DistributedLock, LockClient, LockOptions};
use support::RedisCluster;

#[derive(Parser)]
#[command(about = "wake-up latency of a waiter in another process, on a Redis Cluster")]
struct Args {
    /// Releases measured.
    #[arg(long, default_value_t = 50)]
    rounds: u32,
    /// Run as the waiting process, for the cluster of these seed URLs
    /// (comma-separated): one key per line on stdin, one acquisition time
    /// per line on stdout.
    #[arg(long, hide = true)]
    waiter: Option<String>,
}

fn micros_now() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_micros())
}

fn options() -> LockOptions {
    LockOptions::default()
        .wait(Duration::from_secs(30))
        .backoff(Backoff::constant(Duration::from_secs(10)))
}

fn waiter(seeds: &str) -> Result<(), Box<dyn std::error::Error>> {
    let client = LockClient::builder()
        .cluster(seeds.split(',').map(str::to_owned).collect::<Vec<_>>())
        .build()?;
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    for key in stdin.lock().lines() {
        let key = key?;
        let guard = DistributedLock::with_options(&client, key, options()).lock()?;
        let at = micros_now();
        guard.unlock()?;
        writeln!(out, "{at}")?;
        out.flush()?;
    }
    Ok(())
}

/// Subscribers of `channel` on `node`, sharded or not.
fn subscribers(node: &support::RedisServer, channel: &str) -> u64 {
    support::shard_numsub(node, channel) + support::numsub(node, channel)
}

fn bus(cluster: &RedisCluster) -> u64 {
    cluster
        .nodes()
        .iter()
        .map(|node| {
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query(&mut node.conn())
                .unwrap_or_default();
            info.lines()
                .filter(|line| {
                    line.starts_with("cluster_stats_messages_publish_sent:")
                        || line.starts_with("cluster_stats_messages_publishshard_sent:")
                })
                .filter_map(|line| line.split(':').nth(1)?.trim().parse::<u64>().ok())
                .sum::<u64>()
        })
        .sum()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if let Some(seeds) = &args.waiter {
        return waiter(seeds);
    }
    let cluster = RedisCluster::start(3, 0);
    let holder = cluster.lock_client();
    let mut child = Command::new(std::env::current_exe()?)
        .arg("--waiter")
        .arg(cluster.urls().join(","))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut to_child = child.stdin.take().ok_or("no stdin")?;
    let mut from_child = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
    let keys = cluster.key_per_primary("wakeup");
    let before = bus(&cluster);
    let mut latencies = Vec::new();
    for round in 0..args.rounds {
        let key = &keys[round as usize % keys.len()];
        let guard = DistributedLock::with_options(&holder, key.as_str(), options()).lock()?;
        writeln!(to_child, "{key}")?;
        to_child.flush()?;
        let channel = holder.release_channel(key);
        let subscribed = support::wait_until(Duration::from_secs(10), || {
            cluster.nodes().iter().any(|n| subscribers(n, &channel) > 0)
        });
        if !subscribed {
            return Err(format!("the waiter never subscribed to {channel}").into());
        }
        // Past the waiter's first attempt: it is asleep on the message.
        std::thread::sleep(Duration::from_millis(20));
        let released = micros_now();
        guard.unlock()?;
        let taken: u128 = from_child.next().ok_or("the waiter ended")??.parse()?;
        latencies.push(taken.saturating_sub(released));
    }
    let messages = bus(&cluster).saturating_sub(before);
    drop(to_child);
    let _ = child.wait();
    latencies.sort_unstable();
    let at = |q: f64| {
        let index = ((latencies.len() as f64 - 1.0) * q).round() as usize;
        latencies.get(index).copied().unwrap_or(0)
    };
    println!(
        "wake-up of a waiter in another process, {} releases on 3 primaries: \
         p50 {} µs, p99 {} µs, max {} µs; cluster bus messages per release: {:.2}",
        latencies.len(),
        at(0.5),
        at(0.99),
        latencies.last().copied().unwrap_or(0),
        // Two releases a round: the holder's and the waiter's.
        messages as f64 / (2.0 * f64::from(args.rounds.max(1)))
    );
    Ok(())
}
