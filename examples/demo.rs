//! A tour of redmutex: taking, re-entering and releasing a lock, another
//! client refused, a lease that runs out, eight threads on one key, and
//! what one lock cycle costs next to the pair of commands a program would
//! write by hand.
//!
//! ```sh
//! REDMUTEX_URL=redis://HOST:PORT/ cargo run --release --example demo
//! ```
//!
//! `REDMUTEX_URL` names the Redis server (required: the example takes
//! locks on no server by default); `scripts/demo.sh` runs it against a private redis-server of
//! its own. Needs `redmutex` and std alone: copy it into the `src/main.rs`
//! of a project with `redmutex = "0.1"` in its dependencies. Ends by itself
//! in a few seconds, with exit code 0.

use std::hash::{BuildHasher, RandomState};
use std::sync::LazyLock;
use std::thread;
use std::time::{Duration, Instant};

use redmutex::redis;
use redmutex::{DistributedLock, Error, Lease, LockClient, LockOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDMUTEX_URL")
        .map_err(|_| "set REDMUTEX_URL to the Redis server to use, e.g. redis://HOST:PORT/")?;
    let client = LockClient::open(&url)?;
    let lock = DistributedLock::with_options(
        &client,
        "examples:demo:nightly-report",
        LockOptions::default()
            .ttl(Duration::from_secs(10))
            .wait(Duration::from_secs(2)),
    );

    // 1. Take it, look at it, re-enter it.
    let guard = lock.lock()?;
    println!(
        "1. acquired {:?}: token {}, validity {:?}",
        guard.key(),
        redmutex::redact(guard.token()),
        guard.validity()
    );
    let nested = lock.lock()?;
    println!("   re-entered on the same thread: depth {}", nested.depth());
    drop(nested);

    // 2. Another client (another process, as far as the lock knows) is refused.
    let stranger = LockClient::open(&url)?;
    let theirs = DistributedLock::new(&stranger, "examples:demo:nightly-report");
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
        "examples:demo:short",
        LockOptions::default().ttl(Duration::from_millis(50)),
    );
    let guard = short.lock()?;
    thread::sleep(Duration::from_millis(120));
    match guard.unlock() {
        Err(err @ Error::NotHeld { .. }) => println!("3. late unlock: {err}"),
        other => return Err(format!("3. a late unlock should say NotHeld: {other:?}").into()),
    }

    // 4. Eight threads, one key, a deliberately non-atomic counter.
    redis::cmd("DEL")
        .arg("examples:demo:counter")
        .exec(&mut client.connection()?)?;
    let started = Instant::now();
    let ended: Vec<_> = thread::scope(|scope| {
        let threads: Vec<_> = (0..8)
            .map(|_| scope.spawn(|| count_to_100(&client)))
            .collect();
        threads.into_iter().map(|t| t.join()).collect()
    });
    for result in ended {
        result.map_err(|_| "a counting thread panicked")??;
    }
    let n: i64 = redis::cmd("GET")
        .arg("examples:demo:counter")
        .query(&mut client.connection()?)?;
    println!(
        "4. 8 threads x 100 locked GET/SET increments: counter = {n} (expected 800) in {:?}",
        started.elapsed()
    );

    // 5. What a cycle costs next to what a program would write by hand:
    // `SET key token NX PX` and a compare-and-delete script, on a
    // connection of its own. Each measured three times, interleaved; the
    // median is shown.
    let rounds = 1_000;
    let mut raw = redis::Client::open(url.as_str())?.get_connection()?;
    let lock = DistributedLock::new(&client, "examples:demo:cycle");
    let mut pair = Vec::new();
    let mut unlocked = Vec::new();
    let mut dropped = Vec::new();
    for _ in 0..3 {
        pair.push(time(rounds, || {
            match hand_written_pair(&mut raw, "examples:demo:pair")? {
                true => Ok(()),
                false => Err("examples:demo:pair was held".into()),
            }
        })?);
        unlocked.push(time(rounds, || Ok(lock.lock()?.unlock().map(drop)?))?);
        dropped.push(time(rounds, || Ok(lock.lock().map(drop)?))?);
    }
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

/// One thread of part 4: 100 increments, each a GET and a SET under the
/// lock (without it, two threads would read the same value and one
/// increment would be lost).
fn count_to_100(client: &LockClient) -> Result<(), Error> {
    let lock = DistributedLock::new(client, "examples:demo:counter-lock");
    for _ in 0..100 {
        let _guard = lock.lock()?;
        let mut con = client.connection()?;
        let n: Option<i64> = redis::cmd("GET")
            .arg("examples:demo:counter")
            .query(&mut con)?;
        redis::cmd("SET")
            .arg("examples:demo:counter")
            .arg(n.unwrap_or(0) + 1)
            .exec(&mut con)?;
    }
    Ok(())
}

/// The release of a hand-written lock, made once (a `Script` hashes its
/// source when it is made).
static COMPARE_AND_DELETE: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
    )
});

/// One cycle of the lock a program without this crate would write: `SET
/// key token NX PX 30000` with a fresh token, then a compare-and-delete
/// script. The token here is 64 bits from std's randomly keyed hasher,
/// enough for a timing baseline with one holder; a real lock needs a
/// secret from a cryptographic generator (this crate's tokens carry 121
/// random bits). `false`
/// when the key was held.
fn hand_written_pair(con: &mut redis::Connection, key: &str) -> redis::RedisResult<bool> {
    let token = format!("{:016x}", RandomState::new().hash_one(Instant::now()));
    let set: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg(&token)
        .arg("NX")
        .arg("PX")
        .arg(30_000)
        .query(con)?;
    if set.is_none() {
        return Ok(false);
    }
    let _: i64 = COMPARE_AND_DELETE.key(key).arg(&token).invoke(con)?;
    Ok(true)
}

type Outcome = Result<(), Box<dyn std::error::Error>>;

/// The mean time of one `op` over `rounds`, after a tenth as many to warm up.
fn time(
    rounds: u32,
    mut op: impl FnMut() -> Outcome,
) -> Result<Duration, Box<dyn std::error::Error>> {
    for _ in 0..rounds / 10 {
        op()?;
    }
    let started = Instant::now();
    for _ in 0..rounds {
        op()?;
    }
    Ok(started.elapsed() / rounds)
}

/// The middle of `runs` (zero for none).
fn median(mut runs: Vec<Duration>) -> Duration {
    runs.sort();
    runs.get(runs.len() / 2).copied().unwrap_or_default()
}
