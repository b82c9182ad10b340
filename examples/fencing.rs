//! Fencing tokens: why a lease is not enough, and how a protected resource
//! turns a lease into safety (Kleppmann's "33/34" case).
//!
//! ```sh
//! REDMUTEX_URL=redis://HOST:PORT/ cargo run --example fencing
//! ```
//!
//! `REDMUTEX_URL` names the Redis server (required: the example takes
//! locks on no server by default). Needs `redmutex` and std alone: copy it into the
//! `src/main.rs` of a project with `redmutex = "0.1"` in its dependencies.
//! Ends by itself in under a second, with exit code 0 when the store
//! refused the stale write.
//!
//! Client A takes the lock (token "33"), then pauses longer than its lease
//! (a GC pause, a swapped-out process). The lease expires; client B takes
//! the lock (token "34") and writes. A wakes up, still believing it holds
//! the lock, and writes too. The storage remembers the highest token it
//! has accepted and refuses A's write, because A's is lower. (redmutex's
//! tokens are large numbers, at least the server's clock in microseconds;
//! only their order matters.)

use std::time::Duration;

use redmutex::redis;
use redmutex::{DistributedLock, Lease, LockClient, LockOptions};

const LOCK: &str = "examples:fencing:file";
const HIGHEST: &str = "examples:fencing:file:highest-token";
const DATA: &str = "examples:fencing:file:data";

/// The protected resource: a "file" that accepts a write only with a
/// fencing token at least as high as any it has seen. Here it lives in
/// Redis and checks atomically in a script; any store that can compare and
/// write atomically (a database row with a version column, an object store
/// with conditional writes) can do the same.
struct FencedStore {
    con: redmutex::Connection,
}

impl FencedStore {
    fn write(&mut self, token: u64, data: &str) -> redis::RedisResult<bool> {
        let accepted: i64 = redis::Script::new(
            "local highest = tonumber(redis.call('GET', KEYS[1]) or '0')
             if tonumber(ARGV[1]) < highest then return 0 end
             redis.call('SET', KEYS[1], ARGV[1])
             redis.call('SET', KEYS[2], ARGV[2])
             return 1",
        )
        .key(HIGHEST)
        .key(DATA)
        .arg(token)
        .arg(data)
        .invoke(&mut self.con)?;
        Ok(accepted == 1)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDMUTEX_URL")
        .map_err(|_| "set REDMUTEX_URL to the Redis server to use, e.g. redis://HOST:PORT/")?;
    let (a, b) = (LockClient::open(&url)?, LockClient::open(&url)?);
    let mut store = FencedStore {
        con: LockClient::open(&url)?.connection()?,
    };
    let options = LockOptions::default()
        .ttl(Duration::from_millis(200))
        .fencing(true);

    let guard_a = DistributedLock::with_options(&a, LOCK, options).lock()?;
    let token_a = guard_a.fencing_token().ok_or("fencing is on")?;
    println!("A acquires the lock, fencing token {token_a}, then pauses for 500 ms...");
    std::thread::sleep(Duration::from_millis(500)); // longer than the 200 ms lease

    let guard_b = DistributedLock::with_options(&b, LOCK, options).lock()?;
    let token_b = guard_b.fencing_token().ok_or("fencing is on")?;
    println!("the lease expired; B acquires the lock, fencing token {token_b}");
    println!(
        "B writes with {token_b}: accepted = {}",
        store.write(token_b, "B's data")?
    );

    let stale_accepted = store.write(token_a, "A's stale data")?;
    println!(
        "A wakes up, believes it still holds the lock (validity now {:?}), writes with {token_a}: accepted = {stale_accepted}",
        guard_a.validity(),
    );
    println!(
        "A's unlock: {:?}",
        guard_a.unlock().map_err(|e| e.to_string())
    );
    guard_b.unlock()?;
    if stale_accepted {
        return Err("the store took a write stamped with an older token".into());
    }
    Ok(())
}
