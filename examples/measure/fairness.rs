//! Fairness across processes: a `FairLock` against the plain lock, and what
//! a waiter killed at the head of the queue costs.
//!
//! ```sh
//! cargo run --release --example fairness -- \
//!     [--processes 4] [--threads 2] [--secs 60] [--hold-ms 1] [--entry-ttl-ms 2000]
//! ```
//!
//! Without `--url` it starts a private redis-server. Every worker (each
//! process a child of this program, each thread with its own `LockClient`)
//! loops for `--secs`: take the one key, record the grant's place in the
//! global grant order (an `INCR` inside the critical section) and, for the
//! fair lock, the ticket it queued with, hold `--hold-ms`, release.
//!
//! One Markdown row per lock: acquisitions/s; the wait from the call to the
//! grant (p50, p99, max); the smallest worker's share of the grants against
//! an even share; Redis commands per acquisition (`INFO commandstats`
//! delta, scripts' inner calls included); and, for the fair lock,
//! inversions: grants, in grant order, whose ticket is below one granted
//! before them (a waiter served after one that queued later; must be 0).
//!
//! Then the dead head: a child process queues at the head of the queue
//! behind a held lock, with another waiter behind it; the child is
//! SIGKILLed, the lock released, and the time until the waiter behind gets
//! the lock is printed beside the entry ttl it is bounded by.

use redmutex_test_support as support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use redis::Commands;
use redmutex::{DistributedLock, FairLock, FairLockOptions, Lease, LockClient, LockOptions};

#[derive(Parser, Debug, Clone)]
#[command(about = "Fairness across processes: FairLock against the plain lock")]
struct Args {
    #[arg(long, default_value_t = 4)]
    processes: usize,
    #[arg(long, default_value_t = 2)]
    threads: usize,
    #[arg(long, default_value_t = 60.0)]
    secs: f64,
    #[arg(long, default_value_t = 1)]
    hold_ms: u64,
    #[arg(long, default_value_t = 2000)]
    entry_ttl_ms: u64,
    #[arg(long, hide = true)]
    child: Option<String>,
    #[arg(long, hide = true)]
    url: Option<String>,
}

type Failure = Box<dyn std::error::Error>;

const KEY: &str = "fairness";

fn fair_options(args: &Args) -> FairLockOptions {
    FairLockOptions::default()
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_secs(120))
        .entry_ttl(Duration::from_millis(args.entry_ttl_ms))
}

fn main() -> Result<(), Failure> {
    let args = Args::parse();
    if let Some(what) = &args.child {
        return child(&args, what);
    }
    let server = support::RedisServer::start();
    let url = match &args.url {
        Some(url) => url.clone(),
        None => server.url(),
    };
    println!(
        "{} processes × {} threads on one key, holds of {} ms, {} s per lock, entry ttl {} ms",
        args.processes, args.threads, args.hold_ms, args.secs, args.entry_ttl_ms
    );
    println!();
    println!(
        "| lock | acquisitions/s | wait p50 | wait p99 | wait max | smallest share | commands/acq. | inversions |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for what in ["fair", "plain"] {
        run(&args, &url, &server, what)?;
    }
    println!();
    dead_head(&args, &url)?;
    Ok(())
}

fn run(args: &Args, url: &str, server: &support::RedisServer, what: &str) -> Result<(), Failure> {
    let mut con = server.conn();
    let _: () = con.del("fairness:grants")?;
    let before = support::total_calls(
        &redis::cmd("INFO")
            .arg("commandstats")
            .query::<String>(&mut con)?,
    );
    let exe = std::env::current_exe()?;
    let started = Instant::now();
    let children: Vec<_> = (0..args.processes)
        .map(|_| {
            Command::new(&exe)
                .args(["--child", what, "--url", url])
                .args(["--threads", &args.threads.to_string()])
                .args(["--secs", &args.secs.to_string()])
                .args(["--hold-ms", &args.hold_ms.to_string()])
                .args(["--entry-ttl-ms", &args.entry_ttl_ms.to_string()])
                .stdout(Stdio::piped())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    // (grant order, ticket, wait µs) of every grant; grants per worker.
    let mut grants: Vec<(u64, u64, u64)> = Vec::new();
    let mut per_worker: Vec<u64> = Vec::new();
    for mut child in children {
        let stdout = child.stdout.take().ok_or("child stdout")?;
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            let mut fields = line.split_ascii_whitespace();
            if fields.next() != Some("worker") {
                continue;
            }
            let mut n = 0;
            for grant in fields {
                let mut parts = grant.split(',');
                let mut next =
                    || -> Result<u64, Failure> { Ok(parts.next().ok_or("short grant")?.parse()?) };
                grants.push((next()?, next()?, next()?));
                n += 1;
            }
            per_worker.push(n);
        }
        if !child.wait()?.success() {
            return Err("a child failed".into());
        }
    }
    let elapsed = started.elapsed();
    let after = support::total_calls(
        &redis::cmd("INFO")
            .arg("commandstats")
            .query::<String>(&mut con)?,
    );
    grants.sort_unstable();
    let mut inversions = 0u64;
    let mut highest = 0u64;
    for (_, ticket, _) in &grants {
        if *ticket > 0 {
            if *ticket < highest {
                inversions += 1;
            }
            highest = highest.max(*ticket);
        }
    }
    let mut waits: Vec<u64> = grants.iter().map(|(_, _, wait)| *wait).collect();
    waits.sort_unstable();
    let at = |q: f64| {
        let i = ((waits.len() as f64 - 1.0) * q).round() as usize;
        waits.get(i).copied().unwrap_or(0)
    };
    let ms = |us: u64| format!("{:.1} ms", us as f64 / 1000.0);
    let total = grants.len() as u64;
    let even = total as f64 / per_worker.len().max(1) as f64;
    let smallest = per_worker.iter().min().copied().unwrap_or(0);
    println!(
        "| {} | {:.0} | {} | {} | {} | {:.2} | {:.1} | {} |",
        if what == "fair" {
            "FairLock"
        } else {
            "DistributedLock (notify)"
        },
        total as f64 / elapsed.as_secs_f64(),
        ms(at(0.5)),
        ms(at(0.99)),
        ms(waits.last().copied().unwrap_or(0)),
        smallest as f64 / even,
        (after - before) as f64 / total.max(1) as f64,
        if what == "fair" {
            inversions.to_string()
        } else {
            "n/a".to_owned()
        },
    );
    Ok(())
}

/// The dead head: the lock held here, a child queued at the head (it
/// prints `queued` once it has a place), a waiter of this process behind
/// it; the child killed, the lock released, the waiter's wait for it
/// measured.
fn dead_head(args: &Args, url: &str) -> Result<(), Failure> {
    let client = LockClient::open(url)?;
    let lock = FairLock::with_options(&client, "deadhead", fair_options(args));
    let held = lock.lock()?;
    let exe = std::env::current_exe()?;
    let mut head = Command::new(&exe)
        .args(["--child", "head", "--url", url])
        .args(["--entry-ttl-ms", &args.entry_ttl_ms.to_string()])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut lines = BufReader::new(head.stdout.take().ok_or("child stdout")?).lines();
    if lines.next().transpose()?.as_deref() != Some("queued") {
        return Err("the head did not queue".into());
    }
    let behind = {
        let client = LockClient::open(url)?;
        let options = fair_options(args);
        std::thread::spawn(move || -> Result<Instant, redmutex::Error> {
            let guard = FairLock::with_options(&client, "deadhead", options).lock()?;
            let at = Instant::now();
            guard.unlock()?;
            Ok(at)
        })
    };
    let mut con = client.connection()?;
    let queued = Instant::now();
    while redis::cmd("ZCARD")
        .arg("{deadhead}:fairq")
        .query::<u64>(&mut con)?
        < 2
    {
        if queued.elapsed() > Duration::from_secs(10) {
            return Err("the second waiter did not queue".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    head.kill()?;
    head.wait()?;
    let released = Instant::now();
    held.unlock()?;
    let got = behind.join().map_err(|_| "waiter panicked")??;
    println!(
        "A waiter SIGKILLed at the head: the one behind it got the lock {:.0} ms after the release (entry ttl {} ms).",
        got.duration_since(released).as_secs_f64() * 1000.0,
        args.entry_ttl_ms
    );
    Ok(())
}

fn child(args: &Args, what: &str) -> Result<(), Failure> {
    let url = args.url.clone().ok_or("--child needs --url")?;
    if what == "head" {
        // Queue, say so, and wait to be killed.
        let client = LockClient::open(&url)?;
        let lock = FairLock::with_options(&client, "deadhead", fair_options(args));
        let mut out = std::io::stdout();
        let waiter = std::thread::spawn(move || lock.lock().map(drop));
        let mut con = client.connection()?;
        while redis::cmd("ZCARD")
            .arg("{deadhead}:fairq")
            .query::<u64>(&mut con)?
            < 1
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        writeln!(out, "queued")?;
        out.flush()?;
        let _ = waiter.join();
        return Ok(());
    }
    let until = Instant::now() + Duration::from_secs_f64(args.secs);
    let hold = Duration::from_millis(args.hold_ms);
    let fair = what == "fair";
    let options = fair_options(args);
    let workers: Vec<_> = (0..args.threads)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || -> Result<String, String> {
                let client = LockClient::open(&url).map_err(|e| e.to_string())?;
                let mut con = client.connection().map_err(|e| e.to_string())?;
                let fair_lock = FairLock::with_options(&client, KEY, options);
                let plain = DistributedLock::with_options(
                    &client,
                    KEY,
                    LockOptions::default()
                        .ttl(Duration::from_secs(10))
                        .wait(Duration::from_secs(120)),
                );
                let mut line = String::from("worker");
                while Instant::now() < until {
                    let asked = Instant::now();
                    let (ticket, guard): (u64, Box<dyn FnOnce() -> Result<(), redmutex::Error>>) =
                        if fair {
                            let guard = fair_lock.lock().map_err(|e| e.to_string())?;
                            (
                                guard.ticket().unwrap_or(0),
                                Box::new(move || guard.unlock().map(drop)),
                            )
                        } else {
                            let guard = plain.lock().map_err(|e| e.to_string())?;
                            (0, Box::new(move || guard.unlock().map(drop)))
                        };
                    let wait = asked.elapsed().as_micros();
                    let order: u64 = redis::cmd("INCR")
                        .arg("fairness:grants")
                        .query(&mut con)
                        .map_err(|e| e.to_string())?;
                    std::thread::sleep(hold);
                    guard().map_err(|e| e.to_string())?;
                    line.push_str(&format!(" {order},{ticket},{wait}"));
                }
                Ok(line)
            })
        })
        .collect();
    let mut out = std::io::stdout().lock();
    for worker in workers {
        let line = worker.join().map_err(|_| "worker panicked")??;
        writeln!(out, "{line}")?;
    }
    Ok(())
}
