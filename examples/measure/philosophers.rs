//! Dining philosophers: a multi-lock against the same sets taken as single
//! locks in sorted order.
//!
//! ```sh
//! cargo run --release --example philosophers -- \
//!     [--processes 5] [--threads 2] [--secs 60] [--max-hold-ms 5] \
//!     [--mode multi|sorted|both] [--cluster [--cross-slot]]
//! ```
//!
//! Five keys in a ring; worker `w` (of `processes × threads`, each process
//! a child of this program with its own `LockClient` per thread) takes the
//! 2 or 3 keys from `w mod 5` on (even workers 2, odd ones 3), holds them
//! for 0 to `--max-hold-ms` ms while it increments a counter per key with a
//! deliberately non-atomic `GET` and `SET`, and lets go; again until
//! `--secs` have passed. Meanwhile a sampler reads every key as fast as it
//! can (`MGET`, one atomic read) and counts the samples in which a worker
//! held some of its keys but not all ("partial"). Without `--url` it starts
//! a private redis-server (with `--cluster`, a private 3-primary cluster,
//! the keys sharing a slot unless `--cross-slot`).
//!
//! One Markdown row per mode: acquisitions/s (sets), the wait from the call
//! to holding the whole set (p50, p99, max), calls that returned without
//! the set within their 10 s wait ("stuck": a deadlock would show here),
//! samples with some worker's set held in part, out of all samples, and exclusion violations (counter
//! increments lost: the counters' sum in Redis against the increments the
//! workers made; must be 0).

use redmutex_test_support as support;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use redmutex::{DistributedLock, LockClient, LockOptions, MultiLock};

#[derive(Parser, Debug, Clone)]
#[command(about = "Dining philosophers: a multi-lock against sorted single locks")]
struct Args {
    /// Processes (this program re-run as children).
    #[arg(long, default_value_t = 5)]
    processes: usize,
    /// Worker threads per process.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Seconds each mode runs.
    #[arg(long, default_value_t = 60.0)]
    secs: f64,
    /// The longest hold, in milliseconds (each hold is 0 to this).
    #[arg(long, default_value_t = 5)]
    max_hold_ms: u64,
    /// Which way to take the sets; `both` prints a row for each.
    #[arg(long, value_enum, default_value_t = Mode::Both)]
    mode: Mode,
    /// Against a private 3-primary Redis Cluster.
    #[arg(long)]
    cluster: bool,
    /// On a cluster, keys in different slots (taken in slot order).
    #[arg(long)]
    cross_slot: bool,
    #[arg(long, hide = true)]
    child: bool,
    #[arg(long, hide = true)]
    url: Option<String>,
    #[arg(long, hide = true)]
    first_worker: Option<usize>,
    #[arg(long, hide = true)]
    child_mode: Option<Mode>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    Multi,
    Sorted,
    Both,
}

type Failure = Box<dyn std::error::Error>;

/// How long a call may wait before it counts as stuck.
const WAIT: Duration = Duration::from_secs(10);

fn keys(args: &Args) -> Vec<String> {
    (0..5)
        .map(|i| {
            if args.cluster && !args.cross_slot {
                format!("{{dp}}:f{i}")
            } else {
                format!("dp:f{i}")
            }
        })
        .collect()
}

/// A client of `url`: one server, or the comma-separated seeds of a
/// cluster.
fn open(url: &str, cluster: bool) -> Result<LockClient, redmutex::Error> {
    if cluster {
        LockClient::builder().cluster(url.split(',')).build()
    } else {
        LockClient::open(url)
    }
}

fn set_of(keys: &[String], worker: usize) -> Vec<String> {
    (0..2 + worker % 2)
        .filter_map(|i| keys.get((worker + i) % keys.len()).cloned())
        .collect()
}

fn main() -> Result<(), Failure> {
    let args = Args::parse();
    if args.child {
        return child(&args);
    }
    let (_server, _cluster, url) = if args.cluster {
        let cluster = support::RedisCluster::start(3, 0);
        let url = cluster.urls().join(",");
        (None, Some(cluster), url)
    } else {
        let server = support::RedisServer::start();
        let url = server.url();
        (Some(server), None, url)
    };
    let modes = match args.mode {
        Mode::Both => vec![Mode::Multi, Mode::Sorted],
        mode => vec![mode],
    };
    println!(
        "{} processes × {} threads, holds 0–{} ms, {} s per mode{}",
        args.processes,
        args.threads,
        args.max_hold_ms,
        args.secs,
        match (args.cluster, args.cross_slot) {
            (false, _) => ", one server",
            (true, false) => ", a 3-primary cluster, the keys in one slot",
            (true, true) => ", a 3-primary cluster, the keys across slots",
        }
    );
    println!();
    println!(
        "| mode | sets/s | wait p50 | wait p99 | wait max | stuck | partial samples | violations |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for mode in modes {
        run_mode(&args, &url, mode)?;
    }
    Ok(())
}

fn run_mode(args: &Args, url: &str, mode: Mode) -> Result<(), Failure> {
    let keys = keys(args);
    let client = open(url, args.cluster)?;
    let mut con = client.connection()?;
    for key in &keys {
        redis::cmd("DEL")
            .arg(format!("{key}:counter"))
            .exec(&mut con)?;
    }
    let exe = std::env::current_exe()?;
    let started = Instant::now();
    let mut children = Vec::new();
    for p in 0..args.processes {
        children.push(
            Command::new(&exe)
                .arg("--child")
                .args(["--url", url])
                .args(["--threads", &args.threads.to_string()])
                .args(["--secs", &args.secs.to_string()])
                .args(["--max-hold-ms", &args.max_hold_ms.to_string()])
                .args(["--first-worker", &(p * args.threads).to_string()])
                .args([
                    "--child-mode",
                    if mode == Mode::Multi {
                        "multi"
                    } else {
                        "sorted"
                    },
                ])
                .args(args.cluster.then_some("--cluster"))
                .args(args.cross_slot.then_some("--cross-slot"))
                .stdout(Stdio::piped())
                .spawn()?,
        );
    }
    // The sampler: every key read in one step, as fast as it goes.
    let workers = args.processes * args.threads;
    let expected: HashMap<String, usize> = (0..workers)
        .map(|w| (format!("w{w}"), set_of(&keys, w).len()))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        let keys = keys.clone();
        let cross_slot = args.cluster && args.cross_slot;
        let mut con = client.connection()?;
        std::thread::spawn(move || -> Result<(u64, u64), String> {
            let (mut samples, mut partial) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                let values: Vec<Option<String>> = if cross_slot {
                    // No one-step read across slots: key by key.
                    let mut values = Vec::new();
                    for key in &keys {
                        values.push(
                            redis::cmd("GET")
                                .arg(key)
                                .query(&mut con)
                                .map_err(|e| e.to_string())?,
                        );
                    }
                    values
                } else {
                    let mut mget = redis::cmd("MGET");
                    for key in &keys {
                        mget.arg(key);
                    }
                    mget.query(&mut con).map_err(|e| e.to_string())?
                };
                let mut held: HashMap<String, usize> = HashMap::new();
                for token in values.iter().flatten() {
                    let label = redmutex::Holder::from_token(token)
                        .and_then(|h| h.label)
                        .unwrap_or_default();
                    *held.entry(label).or_default() += 1;
                }
                samples += 1;
                partial += u64::from(held.iter().any(|(label, n)| expected.get(label) != Some(n)));
            }
            Ok((samples, partial))
        })
    };
    let (mut sets, mut stuck, mut increments, mut waits) = (0u64, 0u64, 0u64, Vec::new());
    for mut child in children {
        let stdout = child.stdout.take().ok_or("child stdout")?;
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            let mut fields = line.split_ascii_whitespace();
            if fields.next() == Some("worker") {
                let mut next = || -> Result<u64, Failure> {
                    Ok(fields.next().ok_or("short worker line")?.parse()?)
                };
                sets += next()?;
                stuck += next()?;
                increments += next()?;
                for wait in fields {
                    waits.push(wait.parse::<u64>()?);
                }
            }
        }
        if !child.wait()?.success() {
            return Err("a child failed".into());
        }
    }
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let (samples, partial) = sampler.join().map_err(|_| "sampler panicked")??;
    let mut counted = 0u64;
    for key in &keys {
        let n: Option<u64> = redis::cmd("GET")
            .arg(format!("{key}:counter"))
            .query(&mut con)?;
        counted += n.unwrap_or(0);
    }
    waits.sort_unstable();
    let at = |q: f64| {
        let i = ((waits.len() as f64 - 1.0) * q).round() as usize;
        waits.get(i).copied().unwrap_or(0)
    };
    let ms = |us: u64| format!("{:.2} ms", us as f64 / 1000.0);
    println!(
        "| {} | {:.0} | {} | {} | {} | {} | {} / {} | {} |",
        if mode == Mode::Multi {
            "MultiLock"
        } else {
            "single locks, sorted"
        },
        sets as f64 / elapsed.as_secs_f64(),
        ms(at(0.5)),
        ms(at(0.99)),
        ms(waits.last().copied().unwrap_or(0)),
        stuck,
        partial,
        samples,
        increments.abs_diff(counted),
    );
    Ok(())
}

/// A child: `--threads` workers, each with its own client labelled by its
/// worker number; one `worker SETS STUCK INCREMENTS WAIT_US...` line each.
fn child(args: &Args) -> Result<(), Failure> {
    let url = args.url.clone().ok_or("--child needs --url")?;
    let first = args.first_worker.ok_or("--child needs --first-worker")?;
    let multi = args.child_mode == Some(Mode::Multi);
    let keys = keys(args);
    let until = Instant::now() + Duration::from_secs_f64(args.secs);
    let max_hold = args.max_hold_ms;
    let cluster = args.cluster;
    let workers: Vec<_> = (0..args.threads)
        .map(|t| {
            let (url, keys) = (url.clone(), keys.clone());
            std::thread::spawn(move || -> Result<String, String> {
                let w = first + t;
                let client = open(&url, cluster)
                    .and_then(|c| c.with_label(&format!("w{w}")))
                    .map_err(|e| e.to_string())?;
                let mut con = client.connection().map_err(|e| e.to_string())?;
                let mut set = set_of(&keys, w);
                set.sort();
                let options = LockOptions::default()
                    .ttl(Duration::from_secs(10))
                    .wait(WAIT);
                let multi_lock = MultiLock::with_options(&client, set.clone(), options.for_multi());
                let singles: Vec<DistributedLock> = set
                    .iter()
                    .map(|key| DistributedLock::with_options(&client, key.clone(), options))
                    .collect();
                let mut random = u64::from(std::process::id()) << 8 | w as u64;
                let (mut sets, mut stuck, mut increments) = (0u64, 0u64, 0u64);
                let mut waits = Vec::new();
                while Instant::now() < until {
                    let asked = Instant::now();
                    // Held as one guard, or as a guard per key (taken in
                    // sorted order, released in reverse).
                    let held: Result<(Option<redmutex::MultiGuard>, Vec<redmutex::LockGuard>), _> =
                        if multi {
                            multi_lock.lock().map(|g| (Some(g), Vec::new()))
                        } else {
                            singles
                                .iter()
                                .map(DistributedLock::lock)
                                .collect::<Result<Vec<_>, _>>()
                                .map(|g| (None, g))
                        };
                    let (guard, mut guards) = match held {
                        Ok(held) => held,
                        Err(err) if err.is_timeout() => {
                            stuck += 1;
                            continue;
                        }
                        Err(err) => return Err(err.to_string()),
                    };
                    waits.push(asked.elapsed().as_micros() as u64);
                    for key in &set {
                        let counter = format!("{key}:counter");
                        let now: Option<u64> = redis::cmd("GET")
                            .arg(&counter)
                            .query(&mut con)
                            .map_err(|e| e.to_string())?;
                        redis::cmd("SET")
                            .arg(&counter)
                            .arg(now.unwrap_or(0) + 1)
                            .exec(&mut con)
                            .map_err(|e| e.to_string())?;
                        increments += 1;
                    }
                    // xorshift: a hold of 0..=max_hold ms.
                    random ^= random << 13;
                    random ^= random >> 7;
                    random ^= random << 17;
                    let hold_us = random % (max_hold * 1000 + 1);
                    std::thread::sleep(Duration::from_micros(hold_us));
                    if let Some(guard) = guard {
                        drop(guard);
                    }
                    while let Some(guard) = guards.pop() {
                        drop(guard);
                    }
                    sets += 1;
                }
                let mut line = format!("worker {sets} {stuck} {increments}");
                for wait in waits {
                    line.push(' ');
                    line.push_str(&wait.to_string());
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
