//! Fencing tokens: why a lease is not enough, and how a protected resource
//! turns a lease into safety (Kleppmann's "33/34" case).
//!
//! `cargo run --example fencing` (starts a private redis-server).
//!
//! Client A takes the lock (token "33"), then pauses longer than its lease
//! (a GC pause, a swapped-out process). The lease expires; client B takes
//! the lock (token "34") and writes. A wakes up, still believing it holds
//! the lock, and writes too. The storage remembers the highest token it
//! has accepted and refuses A's write, because A's is lower. (redmutex's
//! tokens are large numbers, at least the server's clock in microseconds;
//! only their order matters.)

use redmutex_test_support as support;

use std::time::Duration;

use redmutex::Lease;
use redmutex::{DistributedLock, LockClient, LockOptions};

/// The protected resource: a "file" that accepts a write only with a
/// fencing token at least as high as any it has seen. Here it lives in
/// Redis and checks atomically in a script; any store that can compare and
/// write atomically (a database row with a version column, an object store
/// with conditional writes) can do the same.
struct FencedStore {
    con: redis::Connection,
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
        .key("file:highest-token")
        .key("file:data")
        .arg(token)
        .arg(data)
        .invoke(&mut self.con)?;
        Ok(accepted == 1)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = support::RedisServer::start();
    let (a, b) = (
        LockClient::open(&server.url())?,
        LockClient::open(&server.url())?,
    );
    let mut store = FencedStore {
        con: redis::Client::open(server.url())?.get_connection()?,
    };
    let options = LockOptions::default()
        .ttl(Duration::from_millis(200))
        .fencing(true);

    let guard_a = DistributedLock::with_options(&a, "file", options).lock()?;
    let token_a = guard_a.fencing_token().ok_or("fencing is on")?;
    println!("A acquires the lock, fencing token {token_a}, then pauses for 500 ms...");
    std::thread::sleep(Duration::from_millis(500)); // longer than the 200 ms lease

    let guard_b = DistributedLock::with_options(&b, "file", options).lock()?;
    let token_b = guard_b.fencing_token().ok_or("fencing is on")?;
    println!("the lease expired; B acquires the lock, fencing token {token_b}");
    println!(
        "B writes with {token_b}: accepted = {}",
        store.write(token_b, "B's data")?
    );

    println!(
        "A wakes up, believes it still holds the lock (validity now {:?}), writes with {token_a}: accepted = {}",
        guard_a.validity(),
        store.write(token_a, "A's stale data")?
    );
    println!(
        "A's unlock: {:?}",
        guard_a.unlock().map_err(|e| e.to_string())
    );
    guard_b.unlock()?;
    Ok(())
}
