//! What the watchdog costs: hold N locks with renewal on and count what it
//! sends, as the client counts it and as Redis does.
//!
//! `cargo run --release --example watchdog -- [--locks 1000] [--ttl-ms 3000] [--secs 9] [--url URL]`

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use clap::Parser;
use redmutex::{DistributedLock, LockClient, LockOptions};

#[derive(Parser)]
#[command(about = "Watchdog cost for many held locks")]
struct Args {
    /// Locks held at once.
    #[arg(long, default_value_t = 1000)]
    locks: usize,
    /// Their ttl in milliseconds (renewed every ttl/3).
    #[arg(long, default_value_t = 3000)]
    ttl_ms: u64,
    /// How long to hold them.
    #[arg(long, default_value_t = 9.0)]
    secs: f64,
    /// Redis server to use instead of a private one (keys redmutex-dog:*).
    #[arg(long)]
    url: Option<String>,
}

fn evalsha_calls(con: &mut redis::Connection) -> redis::RedisResult<u64> {
    let info: String = redis::cmd("INFO").arg("commandstats").query(con)?;
    Ok(info
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let (_private, url) = support::server_or(args.url.as_deref());
    let client = LockClient::open(&url)?;
    let mut admin = redis::Client::open(url.as_str())?.get_connection()?;
    let options = LockOptions::default()
        .ttl(Duration::from_millis(args.ttl_ms))
        .watchdog(true);
    let guards = (0..args.locks)
        .map(|i| {
            DistributedLock::with_options(&client, format!("redmutex-dog:{i}"), options.clone())
                .lock()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let before = (client.stats(), evalsha_calls(&mut admin)?);
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(args.secs));
    let secs = started.elapsed().as_secs_f64();
    let after = (client.stats(), evalsha_calls(&mut admin)?);
    let lost = guards.iter().filter(|g| g.is_lost()).count();
    let renewals = after.0.renewals - before.0.renewals;
    let trips = after.0.renewal_round_trips - before.0.renewal_round_trips;
    println!(
        "| locks held | ttl | renewals/s | round trips/s | renewals per round trip | EVALSHA/s (INFO) | lost |"
    );
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| {} | {} ms | {:.0} | {:.1} | {:.0} | {:.0} | {lost} |",
        args.locks,
        args.ttl_ms,
        renewals as f64 / secs,
        trips as f64 / secs,
        renewals as f64 / trips.max(1) as f64,
        (after.1 - before.1) as f64 / secs,
    );
    for guard in guards {
        guard.unlock()?;
    }
    if lost > 0 {
        return Err(format!("{lost} leases were lost").into());
    }
    Ok(())
}
