//! A cache rebuilt under a read-write lock: many readers at once, one
//! rebuilder alone, and no reader ever sees a half-built cache.
//!
//! ```sh
//! REDMUTEX_URL=redis://HOST:PORT/ cargo run --example cache_rebuild
//! ```
//!
//! `REDMUTEX_URL` names the Redis server (required: the example takes
//! locks on no server by default). Needs `redmutex` and std alone: copy it into the
//! `src/main.rs` of a project with `redmutex = "0.1"` in its dependencies.
//! Ends by itself in about a second, with exit code 0 when every read saw
//! a whole cache.
//!
//! The cache is two Redis keys that must agree: a catalog (a list of
//! items) and its item count. A rebuild writes one, then the other; in
//! between, the two disagree. Readers take `read()` (any number at once)
//! and read both keys; the rebuilder takes `write()`, which waits for the
//! readers inside to leave and lets no new one in until it is done
//! (writers go first: a stream of readers cannot starve a rebuild). The
//! example fails if any read finds the two keys disagreeing.

use std::thread;
use std::time::Duration;

use redmutex::redis;
use redmutex::{Error, Lease, LockClient, RwLock, RwLockOptions};

const LOCK: &str = "examples:cache:catalog";
const ITEMS: &str = "examples:cache:catalog:items";
const COUNT: &str = "examples:cache:catalog:count";
const READERS: usize = 4;
const READS: usize = 40;
const REBUILDS: usize = 5;

/// Builds generation `generation` of the catalog (it has `generation + 3`
/// items) under the write lock.
fn rebuild(client: &LockClient, catalog: &RwLock, generation: usize) -> Result<(), Error> {
    let writer = catalog.write()?;
    let mut con = client.connection()?;
    let items: Vec<String> = (0..generation + 3)
        .map(|i| format!("g{generation}-item{i}"))
        .collect();
    redis::cmd("SET")
        .arg(ITEMS)
        .arg(items.join(","))
        .exec(&mut con)?;
    // The rest of the build. A reader that came in now, without the lock,
    // would find the new items beside the old count.
    thread::sleep(Duration::from_millis(20));
    redis::cmd("SET")
        .arg(COUNT)
        .arg(items.len())
        .exec(&mut con)?;
    writer.unlock()?;
    Ok(())
}

/// One read of the whole cache under the read lock: whether the two keys
/// agreed.
fn read(client: &LockClient, catalog: &RwLock) -> Result<bool, Error> {
    let reader = catalog.read()?;
    let mut con = client.connection()?;
    // Two separate reads on purpose (one MGET would be atomic by itself):
    // the lock is what keeps a rebuild from coming between them.
    let items: Option<String> = redis::cmd("GET").arg(ITEMS).query(&mut con)?;
    let count: Option<usize> = redis::cmd("GET").arg(COUNT).query(&mut con)?;
    reader.unlock()?;
    Ok(match (items, count) {
        (Some(items), Some(count)) => items.split(',').count() == count,
        _ => false,
    })
}

/// A reader thread: `READS` reads a few milliseconds apart; how many found
/// the keys disagreeing.
fn reader(client: &LockClient, catalog: &RwLock) -> Result<usize, Error> {
    let mut torn = 0;
    for _ in 0..READS {
        if !read(client, catalog)? {
            torn += 1;
        }
        thread::sleep(Duration::from_millis(5));
    }
    Ok(torn)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDMUTEX_URL")
        .map_err(|_| "set REDMUTEX_URL to the Redis server to use, e.g. redis://HOST:PORT/")?;
    let client = LockClient::open(&url)?;
    let catalog = RwLock::with_options(
        &client,
        LOCK,
        RwLockOptions::default().ttl(Duration::from_secs(10)),
    );

    rebuild(&client, &catalog, 0)?; // the first build, before anyone reads
    let (readers, rebuilder) = thread::scope(|scope| {
        let readers: Vec<_> = (0..READERS)
            .map(|_| scope.spawn(|| reader(&client, &catalog)))
            .collect();
        let rebuilder = scope.spawn(|| -> Result<(), Error> {
            for generation in 1..=REBUILDS {
                thread::sleep(Duration::from_millis(40));
                rebuild(&client, &catalog, generation)?;
            }
            Ok(())
        });
        let readers: Vec<_> = readers.into_iter().map(|r| r.join()).collect();
        (readers, rebuilder.join())
    });
    rebuilder.map_err(|_| "the rebuilder thread panicked")??;
    let mut torn = 0;
    for result in readers {
        torn += result.map_err(|_| "a reader thread panicked")??;
    }

    println!(
        "{READERS} readers x {READS} reads beside {REBUILDS} rebuilds: {torn} reads saw a half-built cache"
    );
    if torn > 0 {
        return Err(format!("{torn} reads saw the items and the count disagree").into());
    }
    let mut con = client.connection()?;
    let count: usize = redis::cmd("GET").arg(COUNT).query(&mut con)?;
    println!("the catalog now: generation {REBUILDS}, {count} items");
    Ok(())
}
