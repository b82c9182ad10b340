//! What holding many locks costs: hold N locks with the watchdog on and
//! measure the client's memory per held lock (every byte allocated and not
//! freed, counted by a wrapping allocator), Redis's memory per lock key
//! (`MEMORY USAGE`), and what the renewals send (as the client counts them
//! and as Redis does).
//!
//! `cargo run --release --example watchdog -- [--locks 1,100,1000,10000] [--ttl-ms 3000] [--secs 9] [--url URL]`

use redmutex_test_support as support;

use std::time::{Duration, Instant};

use clap::Parser;
use redmutex::Lease;
use redmutex::{DistributedLock, LockClient, LockOptions};

#[global_allocator]
static ALLOCATOR: support::Counting = support::Counting;

#[derive(Parser)]
#[command(about = "Watchdog and memory cost of many held locks")]
struct Args {
    /// Locks held at once; a comma-separated list prints a row for each.
    #[arg(long, default_value = "1000", value_delimiter = ',')]
    locks: Vec<usize>,
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
    Ok(support::parse_calls(&info, "evalsha"))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let (_private, url) = support::server_or(args.url.as_deref());
    let client = LockClient::open(&url)?;
    let mut admin = redis::Client::open(url.as_str())?.get_connection()?;
    let options = LockOptions::default()
        .ttl(Duration::from_millis(args.ttl_ms))
        .watchdog(true);
    // Warm up: the pool's connections, the watchdog thread, the scripts.
    for i in 0..64 {
        DistributedLock::with_options(&client, format!("redmutex-dog:warm:{i}"), options)
            .lock()?
            .unlock()?;
    }
    println!(
        "| locks held | ttl | client memory per held lock | Redis memory per lock key | renewals/s | round trips/s | renewals per round trip | round trips/s per 1,000 locks | EVALSHA/s (INFO) | lost |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut lost_total = 0;
    for &n in &args.locks {
        let locks: Vec<DistributedLock> = (0..n)
            .map(|i| DistributedLock::with_options(&client, format!("redmutex-dog:{i}"), options))
            .collect();
        let empty = support::in_use();
        let guards = locks
            .iter()
            .map(DistributedLock::lock)
            .collect::<Result<Vec<_>, _>>()?;
        let per_lock = (support::in_use() - empty) as f64 / n.max(1) as f64;
        let per_key = support::memory_usage_mean(&mut admin, "redmutex-dog:", n)?;
        let before = (client.stats(), evalsha_calls(&mut admin)?);
        let started = Instant::now();
        std::thread::sleep(Duration::from_secs_f64(args.secs));
        let secs = started.elapsed().as_secs_f64();
        let after = (client.stats(), evalsha_calls(&mut admin)?);
        let lost = guards.iter().filter(|g| g.is_lost()).count();
        let renewals = after.0.renewals - before.0.renewals;
        let trips = after.0.renewal_round_trips - before.0.renewal_round_trips;
        println!(
            "| {n} | {} ms | {per_lock:.0} B | {per_key:.0} B | {:.0} | {:.1} | {:.0} | {:.2} | {:.0} | {lost} |",
            args.ttl_ms,
            renewals as f64 / secs,
            trips as f64 / secs,
            renewals as f64 / trips.max(1) as f64,
            trips as f64 / secs / (n as f64 / 1000.0),
            (after.1 - before.1) as f64 / secs,
        );
        for guard in guards {
            guard.unlock()?;
        }
        lost_total += lost;
    }
    // What one uncontended cycle allocates, the client's default options.
    let lock = DistributedLock::new(&client, "redmutex-dog:cycle");
    let per_cycle = |cycle: &dyn Fn() -> Result<(), redmutex::Error>| {
        const CYCLES: u64 = 1000;
        let before = support::allocations();
        for _ in 0..CYCLES {
            cycle()?;
        }
        Ok::<f64, redmutex::Error>((support::allocations() - before) as f64 / CYCLES as f64)
    };
    let unlocked = per_cycle(&|| lock.lock()?.unlock().map(drop))?;
    let dropped = per_cycle(&|| lock.lock().map(drop))?;
    lock.lock()?.unlock()?;
    println!(
        "\nallocations per uncontended cycle: lock + unlock() {unlocked:.1}, lock + drop {dropped:.1}"
    );
    if lost_total > 0 {
        return Err(format!("{lost_total} leases were lost").into());
    }
    Ok(())
}
