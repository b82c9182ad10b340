//! A semaphore limiting concurrent work: eight threads want to run an
//! export, at most three may run one at a time, across every process that
//! uses the same key.
//!
//! ```sh
//! REDMUTEX_URL=redis://HOST:PORT/ cargo run --example semaphore
//! ```
//!
//! `REDMUTEX_URL` names the Redis server (required: the example takes
//! locks on no server by default). Needs `redmutex` and std alone: copy it into the
//! `src/main.rs` of a project with `redmutex = "0.1"` in its dependencies.
//! Ends by itself in about half a second, with exit code 0 when no more
//! than three threads ever worked at once.
//!
//! Each thread takes a permit with `acquire()` (waiting, woken when one is
//! given back), works, and gives it back with `release()`. The example
//! counts the threads inside in the process, and fails if it ever saw more
//! than the permits allow. A permit is a lease like a lock's: when its
//! holder crashes it comes back after its ttl.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use redmutex::{Error, LockClient, Semaphore, SemaphoreOptions};

const KEY: &str = "examples:semaphore:exports";
const PERMITS: u32 = 3;
const THREADS: usize = 8;
const ROUNDS: usize = 3;
const WORK: Duration = Duration::from_millis(50);

/// Threads working now, and the most seen at once.
#[derive(Default)]
struct Count {
    inside: AtomicUsize,
    most: AtomicUsize,
}

/// One thread: `ROUNDS` exports, each under a permit.
fn exporter(exports: &Semaphore, count: &Count) -> Result<(), Error> {
    for _ in 0..ROUNDS {
        let permit = exports.acquire()?; // waits up to the options' wait
        let now = count.inside.fetch_add(1, Ordering::SeqCst) + 1;
        count.most.fetch_max(now, Ordering::SeqCst);
        thread::sleep(WORK); // the export
        count.inside.fetch_sub(1, Ordering::SeqCst);
        permit.release()?; // Err(NotHeld) had the permit's lease run out
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDMUTEX_URL")
        .map_err(|_| "set REDMUTEX_URL to the Redis server to use, e.g. redis://HOST:PORT/")?;
    let client = LockClient::open(&url)?;
    // Every process opening this key must name the same number of permits
    // (another is refused while permits are out; `set_permits` changes it).
    let exports = Semaphore::with_options(
        &client,
        KEY,
        PERMITS,
        SemaphoreOptions::default().ttl(Duration::from_secs(10)),
    );

    let count = Count::default();
    let started = Instant::now();
    let ended: Vec<_> = thread::scope(|scope| {
        let threads: Vec<_> = (0..THREADS)
            .map(|_| scope.spawn(|| exporter(&exports, &count)))
            .collect();
        threads.into_iter().map(|t| t.join()).collect()
    });
    for result in ended {
        result.map_err(|_| "an exporter thread panicked")??;
    }

    let most = count.most.load(Ordering::SeqCst);
    println!(
        "{THREADS} threads x {ROUNDS} exports of {WORK:?} in {:.2?}: at most {most} at once (limit {PERMITS})",
        started.elapsed()
    );
    let left = exports.status()?;
    println!("permits out now: {}", left.in_use());
    if most > PERMITS as usize {
        return Err(format!("{most} threads worked at once, over the limit of {PERMITS}").into());
    }
    Ok(())
}
