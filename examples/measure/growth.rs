//! How the crate's costs grow with what a program does, for every lock
//! type: hold 1, 100 or 10,000 at once (with the watchdog on; a RedLock,
//! over three private servers, at most 1,000: each watched guard has a
//! renewal thread of its own), and measure
//! the client's memory per held lock (every byte allocated and not freed
//! while taking them, counted by a wrapping allocator), Redis's memory per
//! key (`MEMORY USAGE`, the mean of up to 100 keys) and the renewals' round
//! trips per second (as the client counts them); then acquisitions per
//! second (lock + `unlock()`, default options) for 1, 8 and 64 threads of
//! one client over 1, 16 and 1,024 keys.
//!
//! `cargo run --release --example growth -- [--held 1,100,10000] [--threads 1,8,64] [--keys 1,16,1024] [--ttl-ms 3000] [--secs 3] [--url URL]`
//!
//! Keys are `redmutex-growth:*`; a private redis-server unless `--url`.

use redmutex_test_support as support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use redmutex::Lease;
use redmutex::{
    DistributedLock, LockClient, LockOptions, RedLock, ReentrantLock, RwLock, Semaphore,
};

#[global_allocator]
static ALLOCATOR: support::Counting = support::Counting;

#[derive(Parser)]
#[command(about = "Memory, renewals and throughput as locks, threads and keys grow")]
struct Args {
    /// Locks held at once; a row for each, per lock type.
    #[arg(long, default_value = "1,100,10000", value_delimiter = ',')]
    held: Vec<usize>,
    /// Threads of one client taking locks; a row for each.
    #[arg(long, default_value = "1,8,64", value_delimiter = ',')]
    threads: Vec<usize>,
    /// Keys those threads spread over (thread t takes key t, t+1, … mod K).
    #[arg(long, default_value = "1,16,1024", value_delimiter = ',')]
    keys: Vec<usize>,
    /// The held locks' ttl in milliseconds (renewed every ttl/3).
    #[arg(long, default_value_t = 3000)]
    ttl_ms: u64,
    /// Seconds each measurement lasts.
    #[arg(long, default_value_t = 3.0)]
    secs: f64,
    /// Redis server to use instead of a private one.
    #[arg(long)]
    url: Option<String>,
}

/// The lock types, as held in the first table.
#[derive(Clone, Copy)]
enum Kind {
    Lock,
    Reentrant,
    Read,
    Write,
    Permit,
    RedLock,
}

impl Kind {
    const ALL: [Kind; 6] = [
        Kind::Lock,
        Kind::Reentrant,
        Kind::Read,
        Kind::Write,
        Kind::Permit,
        Kind::RedLock,
    ];

    /// How many of it are held at most (a RedLock guard with the watchdog
    /// is a thread).
    fn most(self) -> usize {
        match self {
            Kind::RedLock => 1_000,
            _ => usize::MAX,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Lock => "`DistributedLock`",
            Kind::Reentrant => "`ReentrantLock`",
            Kind::Read => "`RwLock` read",
            Kind::Write => "`RwLock` write",
            Kind::Permit => "`Semaphore` permit (of 10)",
            Kind::RedLock => "`RedLock` (3 nodes)",
        }
    }
}

/// One held lock of any type, released when dropped.
enum Held {
    Lock(redmutex::LockGuard),
    Reentrant(redmutex::ReentrantGuard),
    Rw(redmutex::RwGuard),
    Permit(redmutex::Permit),
    RedLock(redmutex::RedLockGuard),
}

impl Held {
    /// Found lost by its watchdog.
    fn is_lost(&self) -> bool {
        match self {
            Held::Lock(guard) => guard.is_lost(),
            Held::Reentrant(guard) => guard.is_lost(),
            Held::Rw(guard) => guard.is_lost(),
            Held::Permit(permit) => permit.is_lost(),
            Held::RedLock(guard) => guard.is_lost(),
        }
    }

    fn release(self) -> Result<(), redmutex::Error> {
        match self {
            Held::Lock(guard) => guard.unlock().map(drop),
            Held::Reentrant(guard) => guard.unlock().map(drop),
            Held::Rw(guard) => guard.unlock().map(drop),
            Held::Permit(permit) => permit.release(),
            Held::RedLock(guard) => guard.unlock().map(drop),
        }
    }
}

/// A handle of `kind` on `key`, made and taken, with the watchdog on
/// (`nodes`: a RedLock's).
fn take(
    client: &LockClient,
    nodes: &[LockClient],
    kind: Kind,
    key: &str,
    ttl: Duration,
) -> Result<Held, redmutex::Error> {
    let watched = redmutex::Options::<()>::default().ttl(ttl).watchdog(true);
    Ok(match kind {
        Kind::Lock => Held::Lock(
            DistributedLock::with_options(
                client,
                key,
                LockOptions::default().ttl(ttl).watchdog(true),
            )
            .lock()?,
        ),
        Kind::Reentrant => Held::Reentrant(
            ReentrantLock::with_options(client, key, watched.with_extra(Default::default()))
                .lock()?,
        ),
        Kind::Read => Held::Rw(
            RwLock::with_options(client, key, watched.with_extra(Default::default())).read()?,
        ),
        Kind::Write => Held::Rw(
            RwLock::with_options(client, key, watched.with_extra(Default::default())).write()?,
        ),
        Kind::Permit => Held::Permit(
            Semaphore::with_options(client, key, 10, watched.with_extra(Default::default()))
                .acquire()?,
        ),
        Kind::RedLock => Held::RedLock(
            RedLock::with_options(nodes.to_vec(), key, watched.with_extra(Default::default()))?
                .lock()?,
        ),
    })
}

/// Waits a renewal period and a half: the watchdog's round that forgets
/// released leases has run, and a RedLock's renewal threads have ended.
fn settle(ttl: Duration) {
    std::thread::sleep(ttl / 2);
}

/// Acquisitions per second of `threads` threads over `keys` keys.
fn throughput(
    client: &LockClient,
    threads: usize,
    keys: usize,
    secs: f64,
) -> Result<f64, Box<dyn std::error::Error>> {
    let locks: Vec<DistributedLock> = (0..keys.max(1))
        .map(|k| DistributedLock::new(client, format!("redmutex-growth:hot:{keys}:{k}")))
        .collect();
    let stop = AtomicBool::new(false);
    let acquired = AtomicU64::new(0);
    let failed: Result<(), redmutex::Error> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (locks, stop, acquired) = (&locks, &stop, &acquired);
                scope.spawn(move || -> Result<(), redmutex::Error> {
                    let mut next = t;
                    while !stop.load(Ordering::Relaxed) {
                        if let Some(lock) = locks.get(next % locks.len()) {
                            lock.lock()?.unlock()?;
                        }
                        acquired.fetch_add(1, Ordering::Relaxed);
                        next = next.wrapping_add(1);
                    }
                    Ok(())
                })
            })
            .collect();
        let started = Instant::now();
        std::thread::sleep(Duration::from_secs_f64(secs));
        stop.store(true, Ordering::Relaxed);
        let elapsed = started.elapsed();
        let mut result = Ok(());
        for worker in workers {
            match worker.join() {
                Ok(Ok(())) => {}
                Ok(Err(err)) => result = Err(err),
                Err(_) => {
                    result = Err(redmutex::Error::InvalidArgument("a worker panicked".into()))
                }
            }
        }
        // Counted over the measured time; the last cycles after `stop`
        // finish within a round trip.
        acquired.store(
            (acquired.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64()) as u64,
            Ordering::Relaxed,
        );
        result
    });
    failed?;
    Ok(acquired.load(Ordering::Relaxed) as f64)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let (_private, url) = support::server_or(args.url.as_deref());
    let client = LockClient::open(&url)?;
    // A RedLock's nodes: independent servers of their own.
    let red_servers = support::RedisServer::start_many(3);
    let nodes: Vec<LockClient> = red_servers
        .iter()
        .map(support::RedisServer::lock_client)
        .collect();
    let mut admin = redis::Client::open(url.as_str())?.get_connection()?;
    let mut red_admin = red_servers[0].conn();
    let ttl = Duration::from_millis(args.ttl_ms);
    // Warm up: the pool's connections, the watchdog thread, the scripts.
    for kind in Kind::ALL {
        for i in 0..16 {
            take(
                &client,
                &nodes,
                kind,
                &format!("redmutex-growth:warm:{i}"),
                ttl,
            )?
            .release()?;
        }
    }
    settle(ttl);
    println!(
        "| lock type | held | client memory per held lock | Redis memory per key | renewal round trips/s | renewals/s | lost |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut lost_total = 0;
    for kind in Kind::ALL {
        for &n in &args.held {
            if n > kind.most() {
                println!(
                    "| {} | {n} | not run: a thread per watched guard | | | |",
                    kind.name()
                );
                continue;
            }
            // A RedLock's keys and renewals are on its nodes.
            let (stats_of, admin_of) = match kind {
                Kind::RedLock => (&nodes[0], &mut red_admin),
                _ => (&client, &mut admin),
            };
            let prefix = format!("redmutex-growth:held:{n}:");
            let empty = support::in_use();
            let held = (0..n)
                .map(|i| take(&client, &nodes, kind, &format!("{prefix}{i}"), ttl))
                .collect::<Result<Vec<_>, _>>()?;
            let per_lock = (support::in_use() - empty) as f64 / n.max(1) as f64;
            let per_key = support::memory_usage_mean(admin_of, &prefix, n)?;
            let before = stats_of.stats();
            let started = Instant::now();
            std::thread::sleep(Duration::from_secs_f64(args.secs));
            let secs = started.elapsed().as_secs_f64();
            let after = stats_of.stats();
            let lost = held.iter().filter(|h| h.is_lost()).count();
            let renewals = format!(
                "{:.1} | {:.0}",
                (after.renewal_round_trips - before.renewal_round_trips) as f64 / secs,
                (after.renewals - before.renewals) as f64 / secs,
            );
            println!(
                "| {} | {n} | {per_lock:.0} B | {per_key:.0} B | {renewals} | {lost} |",
                kind.name(),
            );
            for h in held {
                h.release()?;
            }
            lost_total += lost;
            // What the background threads free after the release (watch
            // entries, a RedLock's renewal threads) is freed before the
            // next row counts.
            settle(ttl);
        }
    }
    println!();
    print!("| `DistributedLock` lock + `unlock()`, acquisitions/s |");
    for &keys in &args.keys {
        print!(" {keys} key{} |", if keys == 1 { "" } else { "s" });
    }
    println!();
    println!("|---|{}", "---|".repeat(args.keys.len()));
    for &threads in &args.threads {
        print!(
            "| {threads} thread{} |",
            if threads == 1 { "" } else { "s" }
        );
        for &keys in &args.keys {
            print!(" {:.0} |", throughput(&client, threads, keys, args.secs)?);
        }
        println!();
    }
    if lost_total > 0 {
        return Err(format!("{lost_total} leases were lost").into());
    }
    Ok(())
}
