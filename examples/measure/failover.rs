//! A Sentinel failover under a locking loop: a primary, a replica and three
//! sentinels on private loopback ports; one thread takes and releases a lock
//! every few milliseconds through `LockClient::builder().sentinel(..)` while the
//! primary is killed with SIGKILL. Prints when locking stopped and resumed,
//! and what the failed calls said.
//!
//! `cargo run --release --example failover -- [--after-ms 500]`

use redmutex_test_support as support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use redmutex::Lease;
use redmutex::{DistributedLock, LockOptions};
use support::SentinelSet;

#[derive(Parser)]
#[command(about = "kill a Sentinel-watched primary under a locking loop")]
struct Args {
    /// How long to lock before killing the primary.
    #[arg(long, default_value_t = 500)]
    after_ms: u64,
    /// Give up waiting for locking to resume after this many seconds.
    #[arg(long, default_value_t = 60)]
    limit_secs: u64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let mut set = SentinelSet::start();
    println!(
        "primary 127.0.0.1:{}, replica 127.0.0.1:{}, sentinels {:?} (down-after 3 s)",
        set.primary.port(),
        set.replica.port(),
        set.sentinel_urls()
    );
    let client = set.lock_client();
    let lock = DistributedLock::with_options(
        &client,
        "failover-demo",
        LockOptions::default().wait(Duration::from_millis(200)),
    );
    let killed = Arc::new(AtomicBool::new(false));
    let worker = std::thread::spawn({
        let killed = killed.clone();
        let limit = Duration::from_secs(args.limit_secs);
        move || {
            let started = Instant::now();
            let mut ok_before = 0u64;
            let mut last_ok = None;
            let mut errors: BTreeMap<String, u64> = BTreeMap::new();
            while started.elapsed() < limit {
                let outcome = lock.lock().and_then(|guard| guard.unlock());
                let after_kill = killed.load(Ordering::SeqCst);
                match outcome {
                    Ok(_) if !after_kill => {
                        ok_before += 1;
                        last_ok = Some(Instant::now());
                    }
                    Ok(_) => return (ok_before, last_ok, Some(Instant::now()), errors),
                    Err(err) => {
                        let kind = err.to_string().chars().take(160).collect();
                        *errors.entry(kind).or_default() += 1;
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            (ok_before, last_ok, None, errors)
        }
    });
    std::thread::sleep(Duration::from_millis(args.after_ms));
    let kill_at = Instant::now();
    killed.store(true, Ordering::SeqCst);
    set.primary.kill();
    let (ok_before, _last_ok, resumed, errors) = worker.join().map_err(|_| "worker panicked")?;
    println!("{ok_before} lock cycles before SIGKILL of the primary");
    match resumed {
        Some(at) => println!(
            "locking resumed {:.2?} after the kill, on the promoted replica 127.0.0.1:{}",
            at.duration_since(kill_at),
            set.primary_port().map_or("?".into(), |p| p.to_string())
        ),
        None => println!("locking did not resume within {} s", args.limit_secs),
    }
    for (error, count) in &errors {
        println!("  {count:>4} × {error}");
    }
    if resumed.is_none() {
        return Err("no failover".into());
    }
    Ok(())
}
