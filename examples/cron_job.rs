//! A cron job that must not run twice at once: every machine's cron starts
//! it, the one that takes the lock runs it, the others find it held, say
//! who holds it and exit quietly with success.
//!
//! ```sh
//! REDMUTEX_URL=redis://HOST:PORT/ cargo run --example cron_job
//! ```
//!
//! `REDMUTEX_URL` names the Redis server (required: the example takes
//! locks on no server by default). Needs `redmutex` and std alone: copy it into the
//! `src/main.rs` of a project with `redmutex = "0.1"` in its dependencies.
//! Ends by itself in well under a second, with exit code 0.
//!
//! * `try_lock()`: one attempt, no waiting. A job that finds the lock held
//!   has nothing to do: someone else is doing the work.
//! * The ttl is longer than the job ever takes, so the lease does not run
//!   out under it; a job that crashes leaves the lock held until the ttl
//!   ends, and the next start after that runs.
//! * The fencing token: every acquisition gets a larger one than any
//!   before it. The job stamps its write with it, and the store refuses a
//!   write stamped lower than the last it took, so a run that overran its
//!   lease (paused, swapped out) cannot overwrite the work of the run that
//!   came after it.
//!
//! One run shows both paths with two clients standing in for two machines:
//! first machine B holds the lock and machine A's start skips; then B is
//! done and A's next start runs the job.

use std::error::Error as StdError;
use std::time::Duration;

use redmutex::redis;
use redmutex::{DistributedLock, Error, Lease, LockClient, LockOptions, LossReason};

const KEY: &str = "examples:cron:nightly-report";
/// The job's output: a hash with the report and the token it was written with.
const REPORT: &str = "examples:cron:report";

/// Longer than the job ever takes.
fn options() -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_secs(60))
        .fencing(true)
}

/// One start of the job, as cron makes it.
fn cron_start(client: &LockClient) -> Result<(), Box<dyn StdError>> {
    let lock = DistributedLock::with_options(client, KEY, options());
    let Some(guard) = lock.try_lock()? else {
        // A line for the log, then success: the job is not ours to run.
        match lock.status()? {
            Some(held) => {
                let who = match held.held_by.first() {
                    Some(holder) => holder.to_string(),
                    None => "a holder without metadata".to_owned(),
                };
                let left = held.remaining.unwrap_or_default();
                println!("skipped: running elsewhere, held by {who}, {left:.1?} left");
            }
            None => println!("skipped: it was running elsewhere and has just finished"),
        }
        return Ok(());
    };

    let token = guard
        .fencing_token()
        .ok_or("fencing is on, so every guard has a token")?;
    // ... the job's work ...
    let report = format!("nightly report, written under token {token}");
    let mut con = client.connection()?;
    if write_stamped(&mut con, token, &report)? {
        println!("ran the job: report written, stamped with fencing token {token}");
    } else {
        println!("ran the job: the store refused token {token}, a later run wrote first");
    }

    match guard.unlock() {
        Ok(_) => Ok(()),
        Err(Error::NotHeld {
            reason: reason @ (LossReason::Expired | LossReason::OwnedByOther),
            ..
        }) => {
            // The lease ran out under the job: another start may have run
            // at the same time. The fencing check kept the newer write;
            // anything else the job touched without a token needs a look.
            eprintln!("the job overran its lease ({reason}): another run may have overlapped");
            Err("lease lost during the job".into())
        }
        Err(other) => Err(other.into()),
    }
}

/// Writes the report unless one stamped with a higher token is already
/// there, in one script so nothing comes between the check and the write.
fn write_stamped(
    con: &mut redmutex::Connection,
    token: u64,
    report: &str,
) -> redis::RedisResult<bool> {
    let written: i64 = redis::Script::new(
        "local stamped = tonumber(redis.call('HGET', KEYS[1], 'token') or '0')
         if tonumber(ARGV[1]) < stamped then return 0 end
         redis.call('HSET', KEYS[1], 'token', ARGV[1], 'report', ARGV[2])
         return 1",
    )
    .key(REPORT)
    .arg(token)
    .arg(report)
    .invoke(con)?;
    Ok(written == 1)
}

fn main() -> Result<(), Box<dyn StdError>> {
    let url = std::env::var("REDMUTEX_URL")
        .map_err(|_| "set REDMUTEX_URL to the Redis server to use, e.g. redis://HOST:PORT/")?;
    // The label shows in `status()` and `redmutex status`: which machine holds it.
    let machine_a = LockClient::builder().url(&url).label("machine-a").build()?;
    let machine_b = LockClient::builder().url(&url).label("machine-b").build()?;

    // Machine B's cron started the job first; it is still running.
    let b_running = DistributedLock::with_options(&machine_b, KEY, options()).lock()?;
    print!("machine A starts the job: ");
    cron_start(&machine_a)?;

    b_running.unlock()?;
    print!("machine A starts it again: ");
    cron_start(&machine_a)?;
    Ok(())
}
