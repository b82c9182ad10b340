//! How fresh a lease passed between threads is, while Redis loses it under
//! them.
//!
//! ```sh
//! cargo run --release --example handoff_loss -- [--threads 8] [--rounds 120] [--max-age-us 1000] [--url URL]
//! ```
//!
//! Threads of one client take one key in a hot loop (lock, look at the
//! guard, unlock), so the lease passes from thread to thread without Redis.
//! Every 10–30 ms another client deletes the key and takes it for 20 ms in
//! one step (`SET … PX 20 GET`, as a `force_release` and a second holder
//! would): from then on, a thread of the first client that starts on the
//! deleted lease is a second holder.
//!
//! The report gives, over every handoff of the run, how long before the
//! receiving call returned Redis had last confirmed the lease (the
//! client's `KindStats::handoff_age`: at most the handoff budget's
//! `max_age` plus one round trip, the request of a confirmation counting
//! from when it left), next to a PING round trip; and, for every deletion
//! of a held lease, the threads that still started on it and how long
//! after the deletion they did (at most the same bound: a lease confirmed
//! just before the deletion may still be handed on within `max_age`).

use redmutex_test_support as support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use parking_lot::Mutex;
use redmutex::Lease;
use redmutex::{DistributedLock, LockClient, LockKind, LockOptions};

#[derive(Parser, Debug)]
struct Args {
    /// Threads passing the lease around.
    #[arg(long, default_value_t = 8)]
    threads: usize,
    /// Deletions to force.
    #[arg(long, default_value_t = 120)]
    rounds: usize,
    /// The handoff budget's `max_age`, in microseconds.
    #[arg(long, default_value_t = 1000)]
    max_age_us: u64,
    /// A server to use instead of a private one.
    #[arg(long)]
    url: Option<String>,
}

/// Acquisitions made while a deletion is watched: when each call
/// returned, and the token it returned with.
type Starts = Vec<(Instant, Arc<str>)>;

fn main() {
    let args = Args::parse();
    let (_server, url) = support::server_or(args.url.as_deref());
    let client = LockClient::open(&url).expect("client");
    let max_age = Duration::from_micros(args.max_age_us);
    let options = LockOptions::default()
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_secs(60))
        .handoff_budget(redmutex::HandoffBudget::default().with_max_age(max_age));
    let lock = DistributedLock::with_options(&client, "handoff-loss", options);
    let watching = Arc::new(AtomicBool::new(false));
    let starts: Arc<Mutex<Starts>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..args.threads)
        .map(|_| {
            let (lock, watching, starts, stop) =
                (lock.clone(), watching.clone(), starts.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut acquisitions = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let Ok(guard) = lock.lock() else { continue };
                    let started = Instant::now();
                    acquisitions += 1;
                    if watching.load(Ordering::Relaxed) {
                        starts.lock().push((started, Arc::from(guard.token())));
                    }
                    let _ = guard.unlock();
                }
                acquisitions
            })
        })
        .collect();

    let mut intruder = redis::Client::open(url.as_str())
        .expect("url")
        .get_connection()
        .expect("intruder");
    let ping = {
        let started = Instant::now();
        for _ in 0..100 {
            let _: String = redis::cmd("PING").query(&mut intruder).expect("PING");
        }
        started.elapsed() / 100
    };
    let mut dice = support::Dice(0x9E37_79B9_7F4A_7C15);
    let mut held = 0;
    let mut free = 0;
    // How long after each deletion a thread still started on the deleted
    // lease (the worst per deletion), and how many did.
    let mut late: Vec<Duration> = Vec::new();
    let mut stale_starts = 0usize;
    let started = Instant::now();
    for _ in 0..args.rounds {
        std::thread::sleep(Duration::from_millis(10 + dice.below(20)));
        starts.lock().clear();
        watching.store(true, Ordering::Relaxed);
        // Deleted and taken in one step, as another client's lock would:
        // timed from before it was sent, so the delays below are upper
        // bounds.
        let deleted_at = Instant::now();
        let before: Option<String> = redis::cmd("SET")
            .arg("handoff-loss")
            .arg("intruder")
            .arg("PX")
            .arg(20)
            .arg("GET")
            .query(&mut intruder)
            .expect("SET");
        // Held by the intruder for 20 ms: every start on the deleted lease
        // comes well within that.
        std::thread::sleep(Duration::from_millis(40));
        watching.store(false, Ordering::Relaxed);
        let Some(deleted) = before else {
            // Taken between two leases of the chain: nothing of the first
            // client's was lost.
            free += 1;
            continue;
        };
        held += 1;
        let seen = std::mem::take(&mut *starts.lock());
        let after: Vec<Duration> = seen
            .iter()
            .filter(|(at, token)| **token == *deleted && *at > deleted_at)
            .map(|(at, _)| at.duration_since(deleted_at))
            .collect();
        stale_starts += after.len();
        late.push(after.into_iter().max().unwrap_or_default());
    }
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let acquisitions: u64 = workers.into_iter().map(|w| w.join().expect("worker")).sum();
    late.sort();
    let at = |q: f64| {
        let i = ((late.len() as f64 - 1.0) * q).round() as usize;
        late.get(i).copied().unwrap_or_default()
    };
    let stats = client.stats();
    let kind = stats.kind(LockKind::Mutex);
    let age = kind.handoff_age;
    println!(
        "{} deletions during a hot chain ({} threads, {:.0} acquisitions/s, {:.4} lock commands per acquisition, handoff max age {max_age:?})",
        args.rounds,
        args.threads,
        acquisitions as f64 / elapsed.as_secs_f64(),
        stats.commands as f64 / acquisitions.max(1) as f64
    );
    println!("PING round trip: {ping:?}; the bound: max age + one round trip");
    println!(
        "age of Redis's newest confirmation when a handed-over lease's call returned, over {} handoffs: p50 {:?}, p90 {:?}, p99 {:?}, max {:?}",
        age.count, age.p50, age.p90, age.p99, age.max
    );
    println!(
        "{held} deletions of a held lease ({free} found the key free between two leases): \
         {stale_starts} starts on the deleted lease after it; per deletion, the latest: p50 {:?}, p90 {:?}, p99 {:?}, max {:?}; losses found {}",
        at(0.5),
        at(0.9),
        at(0.99),
        at(1.0),
        kind.losses
    );
}
