//! A worker that holds a lock through a long job, kept alive by the
//! watchdog, and that stops as soon as it learns the lock is lost.
//!
//! ```sh
//! REDMUTEX_URL=redis://HOST:PORT/ cargo run --example worker
//! ```
//!
//! `REDMUTEX_URL` names the Redis server (required: the example takes
//! locks on no server by default). Needs `redmutex` and std alone: copy it into the
//! `src/main.rs` of a project with `redmutex = "0.1"` in its dependencies.
//! Ends by itself in about 4 s, with exit code 0 when both parts behaved.
//!
//! The lease is short (2 s) so that a crashed worker's lock frees soon;
//! the job is longer, and the watchdog renews the lease every ttl/3 for as
//! long as the guard lives. A lease can still be lost: Redis restarted
//! without persistence or failed over, an operator deleted the key, the
//! process was paused past its ttl. A worker that carries on after that
//! shares the resource with the next holder, so it looks at its loss
//! signal between steps and stops.
//!
//! Part 1 runs the job to its end, longer than the ttl, and releases.
//! Part 2 deletes the key behind the worker's back; the worker notices at
//! the watchdog's next renewal, stops, and its `unlock()` reports the loss.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use redmutex::redis;
use redmutex::{DistributedLock, Error, Lease, LockClient, LockOptions, LossReason};

const KEY: &str = "examples:worker";
const TTL: Duration = Duration::from_secs(2);
const STEP: Duration = Duration::from_millis(100);

/// How a job ended.
enum Ended {
    /// Every step done, and the lock released.
    Finished,
    /// The lease was found lost after `steps` steps: the job stopped there.
    /// `unlock` is what releasing said.
    Lost {
        steps: u32,
        reason: LossReason,
        unlock: Result<redmutex::Unlocked, Error>,
    },
}

/// The job: up to `steps` steps of work under the lock, with a look at the
/// loss signal before each. Tells `progress` after every step.
fn job(client: &LockClient, steps: u32, progress: &mpsc::Sender<u32>) -> Result<Ended, Error> {
    let lock =
        DistributedLock::with_options(client, KEY, LockOptions::default().ttl(TTL).watchdog(true));
    let guard = lock.lock()?;
    // A handle another thread could watch or block on as well.
    let lost = guard.loss_signal();
    for step in 0..steps {
        if let Some(reason) = lost.reason() {
            // The next holder may already be at work: a half-done step is
            // left for it to redo, not finished on a lock we no longer hold.
            return Ok(Ended::Lost {
                steps: step,
                reason,
                unlock: guard.unlock(),
            });
        }
        thread::sleep(STEP); // one step of the job
        // Nobody listening is fine: the progress report is for part 2 only.
        let _ = progress.send(step + 1);
    }
    guard.unlock()?;
    Ok(Ended::Finished)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDMUTEX_URL")
        .map_err(|_| "set REDMUTEX_URL to the Redis server to use, e.g. redis://HOST:PORT/")?;
    let client = LockClient::open(&url)?;

    // Part 1: 30 steps of 100 ms, half as long again as the ttl.
    let started = Instant::now();
    let (progress, _) = mpsc::channel();
    match job(&client, 30, &progress)? {
        Ended::Finished => println!(
            "part 1: the job ran {:.1?} on a {TTL:?} lease and released it; \
             the watchdog renewed it {} times",
            started.elapsed(),
            client.stats().renewals
        ),
        Ended::Lost { reason, .. } => {
            return Err(format!("part 1 lost its lease ({reason}) with nobody taking it").into());
        }
    }

    // Part 2: the same job, at most 10 s of steps, with the key pulled
    // away after its third step.
    let (progress, steps_done) = mpsc::channel();
    let client = &client;
    let (ended, deleted) = thread::scope(|scope| {
        let worker = scope.spawn(move || job(client, 100, &progress));
        let deleted = wait_for_steps(&steps_done, 3).and_then(|()| delete_behind_its_back(client));
        (worker.join(), deleted)
    });
    let ended = ended.map_err(|_| "the worker thread panicked")??;
    if deleted? != 1 {
        return Err("part 2: the key was not there to delete".into());
    }
    println!("part 2: deleted {KEY} behind the worker's back");
    match ended {
        Ended::Lost {
            steps,
            reason,
            unlock: Err(err @ Error::NotHeld { .. }),
        } => {
            println!("        the worker stopped after step {steps}: lost ({reason})");
            println!("        its unlock(): {err}");
            Ok(())
        }
        Ended::Lost { unlock, .. } => {
            Err(format!("part 2: unlock() after the loss said {unlock:?}").into())
        }
        Ended::Finished => Err("part 2: the worker never noticed the loss".into()),
    }
}

/// Waits for the worker's first `n` steps, at most 10 s each.
fn wait_for_steps(
    steps_done: &mpsc::Receiver<u32>,
    n: u32,
) -> Result<(), Box<dyn std::error::Error>> {
    for _ in 0..n {
        steps_done.recv_timeout(Duration::from_secs(10))?;
    }
    Ok(())
}

/// Simulates an operator deleting the key by hand (`redis-cli DEL
/// examples:worker`), as Redis losing it in a restart or a failover would:
/// nothing tells the worker's client. Returns how many keys went.
fn delete_behind_its_back(client: &LockClient) -> Result<i64, Box<dyn std::error::Error>> {
    let mut con = client.connection()?;
    Ok(redis::cmd("DEL").arg(KEY).query(&mut con)?)
}
