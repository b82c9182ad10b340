//! A tour of redmutex against a private redis-server on a free loopback port.
//!
//! `cargo run --release --example demo` (or `scripts/demo.sh`, which installs
//! redis-server first when it is missing). With `--url URL` it uses your
//! server instead.

use redmutex_test_support as support;

use std::time::{Duration, Instant};

use redmutex::Lease;
use redmutex::{DistributedLock, Error, LockClient, LockOptions};

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    let private;
    let url = match args.iter().position(|a| a == "--url") {
        Some(i) => args.get(i + 1).cloned().unwrap_or_default(),
        None => {
            private = support::RedisServer::start();
            println!(
                "started a private redis-server on 127.0.0.1:{}",
                private.port()
            );
            private.url()
        }
    };

    let client = LockClient::open(&url)?;
    let lock = DistributedLock::with_options(
        &client,
        "demo:nightly-report",
        LockOptions::default()
            .ttl(Duration::from_secs(10))
            .wait(Duration::from_secs(2)),
    );

    // 1. Take it, look at it, re-enter it.
    let guard = lock.lock()?;
    println!(
        "1. acquired {:?}: token {}…, validity {:?}",
        guard.key(),
        &guard.token()[..8],
        guard.validity()
    );
    let nested = lock.lock()?;
    println!(
        "   re-entered on the same thread: hold_count {}",
        nested.depth()
    );
    drop(nested);

    // 2. Another client (another process, as far as the lock knows) is refused.
    let stranger = LockClient::open(&url)?;
    let theirs = DistributedLock::new(&stranger, "demo:nightly-report");
    println!(
        "2. another client's try_lock: {:?}",
        theirs.try_lock()?.map(|g| g.depth())
    );
    match theirs.try_lock_for(Duration::from_millis(200))? {
        None => println!("   ... and after waiting 200 ms: still held"),
        Some(_) => println!("   ... unexpectedly acquired"),
    }
    guard.unlock()?;
    println!("   released; now theirs: {}", theirs.try_lock()?.is_some());

    // 3. A lease that runs out is reported, not silently "released".
    let short = DistributedLock::with_options(
        &client,
        "demo:short",
        LockOptions::default().ttl(Duration::from_millis(50)),
    );
    let guard = short.lock()?;
    std::thread::sleep(Duration::from_millis(120));
    match guard.unlock() {
        Err(err @ Error::NotHeld { .. }) => println!("3. late unlock: {err}"),
        other => println!("3. late unlock: {other:?}"),
    }

    // 4. Eight threads, one key, a deliberately non-atomic counter.
    let mut con = client.pool()?.get()?;
    redis::cmd("DEL").arg("demo:counter").exec(&mut *con)?;
    drop(con);
    let started = Instant::now();
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let client = client.clone();
            std::thread::spawn(move || -> Result<(), Error> {
                let lock = DistributedLock::new(&client, "demo:counter-lock");
                for _ in 0..100 {
                    let _guard = lock.lock()?;
                    let mut con = client.pool()?.get()?;
                    let n: Option<i64> = redis::cmd("GET").arg("demo:counter").query(&mut *con)?;
                    redis::cmd("SET")
                        .arg("demo:counter")
                        .arg(n.unwrap_or(0) + 1)
                        .exec(&mut *con)?;
                }
                Ok(())
            })
        })
        .collect();
    for thread in threads {
        thread
            .join()
            .map_err(|_| Error::InvalidArgument("a worker panicked".into()))??;
    }
    let mut con = client.pool()?.get()?;
    let n: i64 = redis::cmd("GET").arg("demo:counter").query(&mut *con)?;
    println!(
        "4. 8 threads x 100 locked GET/SET increments: counter = {n} (expected 800) in {:?}",
        started.elapsed()
    );

    // 5. What a cycle costs next to what a user would write by hand: `SET
    // key token NX PX` and a compare-and-delete script, on a connection of
    // its own. Each measured three times, interleaved; the median is shown.
    let rounds = 2_000;
    let mut raw = redis::Client::open(url.as_str())?.get_connection()?;
    let lock = DistributedLock::new(&client, "demo:cycle");
    let mut pair = Vec::new();
    let mut unlocked = Vec::new();
    let mut dropped = Vec::new();
    for _ in 0..3 {
        pair.push(time(rounds, || {
            match support::hand_written_pair(&mut raw, "demo:pair")? {
                true => Ok(()),
                false => Err(Error::InvalidArgument("demo:pair was held".into())),
            }
        })?);
        unlocked.push(time(rounds, || lock.lock()?.unlock().map(drop))?);
        dropped.push(time(rounds, || lock.lock().map(drop))?);
    }
    let median = |mut runs: Vec<Duration>| {
        runs.sort();
        runs[runs.len() / 2]
    };
    let pair = median(pair);
    println!("5. one uncontended cycle, median of 3 x {rounds}:");
    println!("   hand-written SET NX PX + compare-and-delete: {pair:?}");
    for (what, cycle) in [
        ("lock() + unlock()", median(unlocked)),
        ("lock() + drop (release written behind)", median(dropped)),
    ] {
        println!(
            "   {what}: {cycle:?}, {:.2}x the hand-written pair's cycles/s",
            pair.as_secs_f64() / cycle.as_secs_f64()
        );
    }
    Ok(())
}

fn time(rounds: u32, mut op: impl FnMut() -> Result<(), Error>) -> Result<Duration, Error> {
    for _ in 0..rounds / 10 {
        op()?; // warm up
    }
    let started = Instant::now();
    for _ in 0..rounds {
        op()?;
    }
    Ok(started.elapsed() / rounds)
}
