//! How soon a lease passed between threads is found lost once Redis no
//! longer holds it.
//!
//! ```sh
//! cargo run --release --example handoff_loss -- [--threads 8] [--rounds 120] [--url URL]
//! ```
//!
//! Threads of one client take one key in a hot loop (lock, look at the
//! guard, unlock), so the lease passes from thread to thread without Redis.
//! Every 10–30 ms another client deletes the key and takes it for 20 ms in
//! one step (`SET … PX 20 GET`, as a `force_release` and a second holder
//! would): from then on, any guard of the first client is a second holder
//! until the crate finds the loss. The report gives, over every round that
//! took a held lease (not the key free between two of the chain's leases),
//! the time from the deletion to the first sign that the first client found
//! it lost (a thread's guard `is_lost()`, an `unlock()` that said
//! `NotHeld`, or a loss in the client's counters: a waiter handed the lease
//! that found it lost on taking it), next to a PING round trip: the bound
//! is 1 ms plus one round trip.

use redmutex_test_support as support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use parking_lot::Mutex;
use redmutex::{DistributedLock, LockClient, LockOptions};

#[derive(Parser, Debug)]
struct Args {
    /// Threads passing the lease around.
    #[arg(long, default_value_t = 8)]
    threads: usize,
    /// Deletions to measure.
    #[arg(long, default_value_t = 120)]
    rounds: usize,
    /// A server to use instead of a private one.
    #[arg(long)]
    url: Option<String>,
}

/// The deletion under way: when it happened, and when the first thread saw
/// its guard lost.
#[derive(Default)]
struct Round {
    deleted: Option<Instant>,
    seen: Option<Duration>,
}

/// Leases of the plain lock this client found lost so far.
fn lost(client: &LockClient) -> u64 {
    client.stats().kind(redmutex::LockKind::Mutex).losses
}

fn main() {
    let args = Args::parse();
    let (_server, url) = support::server_or(args.url.as_deref());
    let client = LockClient::open(&url).expect("client");
    let options = LockOptions::default()
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_secs(60));
    let lock = DistributedLock::with_options(&client, "handoff-loss", options);
    let round = Arc::new(Mutex::new(Round::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let seen = |round: &Mutex<Round>| {
        let mut round = round.lock();
        if let (Some(deleted), None) = (round.deleted, round.seen) {
            round.seen = Some(deleted.elapsed());
        }
    };
    let workers: Vec<_> = (0..args.threads)
        .map(|_| {
            let (lock, round, stop) = (lock.clone(), round.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut acquisitions = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let Ok(guard) = lock.lock() else { continue };
                    acquisitions += 1;
                    if guard.is_lost() {
                        seen(&round);
                    }
                    if guard.unlock().is_err_and(|err| err.is_not_held()) {
                        seen(&round);
                    }
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
    let mut took = Vec::new();
    let mut missed = 0;
    let mut free = 0;
    let started = Instant::now();
    for _ in 0..args.rounds {
        std::thread::sleep(Duration::from_millis(10 + dice.below(20)));
        // Deleted and taken in one step, as another client's lock would.
        let losses = lost(&client);
        *round.lock() = Round {
            deleted: Some(Instant::now()),
            seen: None,
        };
        let before: Option<String> = redis::cmd("SET")
            .arg("handoff-loss")
            .arg("intruder")
            .arg("PX")
            .arg(20)
            .arg("GET")
            .query(&mut intruder)
            .expect("SET");
        if before.is_none() {
            // Taken between two leases of the chain: nothing of the first
            // client's was lost.
            free += 1;
            std::thread::sleep(Duration::from_millis(40));
            continue;
        }
        // Held by the intruder for 20 ms; a loss is seen long before. A
        // thread may see it (its guard lost, its unlock refused), or only
        // the client's counters (a waiter handed the lease found it lost
        // on taking it, and waits on): whichever comes first.
        let until = Instant::now() + Duration::from_millis(40);
        while Instant::now() < until {
            if lost(&client) > losses {
                seen(&round);
                break;
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        match round.lock().seen {
            Some(after) => took.push(after),
            None => missed += 1,
        }
        std::thread::sleep(until.saturating_duration_since(Instant::now()));
    }
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let acquisitions: u64 = workers.into_iter().map(|w| w.join().expect("worker")).sum();
    took.sort();
    let at = |q: f64| {
        let i = ((took.len() as f64 - 1.0) * q).round() as usize;
        took.get(i).copied().unwrap_or_default()
    };
    let stats = client.stats();
    println!(
        "{} deletions during a hot chain ({} threads, {:.0} acquisitions/s, {:.4} lock commands per acquisition)",
        args.rounds,
        args.threads,
        acquisitions as f64 / elapsed.as_secs_f64(),
        stats.commands as f64 / acquisitions.max(1) as f64
    );
    println!("PING round trip: {ping:?}; the bound: 1 ms + one round trip");
    println!(
        "{} deletions of a held lease ({free} found the key free between two leases): \
         found lost after min {:?}, p50 {:?}, p90 {:?}, p99 {:?}, max {:?}; not seen within 40 ms: {missed}",
        took.len(),
        at(0.0),
        at(0.5),
        at(0.9),
        at(0.99),
        at(1.0)
    );
}
