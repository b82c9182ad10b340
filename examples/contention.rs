//! The contention report: how the lock behaves when many workers want it.
//!
//! ```sh
//! cargo run --release --example contention -- \
//!     [--threads N] [--processes P] [--keys K] [--secs S] \
//!     [--release lua|watch|both] [--url URL]
//! ```
//!
//! Without `--url` it starts a private redis-server on a free loopback port.
//! Every worker loops for `--secs`: lock one of the `--keys` keys, run a
//! deliberately non-atomic GET/SET increment of that key's counter, unlock.
//! With `--processes P` it runs P child processes of itself, each with
//! `--threads` threads and its own `LockClient`, against the same keys, and
//! sums their figures.
//!
//! It prints one Markdown table, one row per release method: acquisitions/s;
//! wait p50, p99 and max (from calling `lock()` to holding the guard);
//! acquisitions per worker, min and max; Redis commands per acquisition from
//! the `INFO commandstats` delta, in all and without the critical section's
//! own GET and SET; exclusion violations (increments lost to overlapping
//! holders, must be 0); and, measured in the same run, a PING round trip and
//! the uncontended acquire+release cycle as a multiple of it (the floor is 2).

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Parser, ValueEnum};
use redis::Commands;
use redmutex::{DistributedLock, LockClient, LockOptions, Release};

#[derive(Parser, Debug, Clone)]
#[command(about = "Contention report for redmutex: throughput, waits, fairness, Redis cost")]
struct Args {
    /// Worker threads per process.
    #[arg(long, default_value_t = 8)]
    threads: usize,
    /// Processes (this program re-run as children), each with --threads workers.
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// Lock keys the workers spread over (worker t takes key t, t+1, … mod K).
    #[arg(long, default_value_t = 1)]
    keys: usize,
    /// Seconds each run lasts.
    #[arg(long, default_value_t = 5.0)]
    secs: f64,
    /// Release method; `both` prints a row for each.
    #[arg(long, value_enum, default_value_t = ReleaseArg::Lua)]
    release: ReleaseArg,
    /// Redis server to use instead of a private one. Only keys under
    /// `redmutex-report:*` are written, and they are deleted afterwards.
    #[arg(long)]
    url: Option<String>,
    /// Internal: run as a child worker process.
    #[arg(long, hide = true)]
    child: bool,
    /// Internal: the wall-clock start time (ms since the epoch) for children.
    #[arg(long, hide = true)]
    start_at_ms: Option<u64>,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum ReleaseArg {
    Lua,
    Watch,
    Both,
}

impl ReleaseArg {
    fn methods(self) -> Vec<Release> {
        match self {
            ReleaseArg::Lua => vec![Release::Lua],
            ReleaseArg::Watch => vec![Release::Watch],
            ReleaseArg::Both => vec![Release::Lua, Release::Watch],
        }
    }

    fn of(release: Release) -> &'static str {
        match release {
            Release::Lua => "lua",
            Release::Watch => "watch",
        }
    }
}

const PREFIX: &str = "redmutex-report";

fn lock_key(k: usize) -> String {
    format!("{PREFIX}:lock:{k}")
}

fn counter_key(k: usize) -> String {
    format!("{PREFIX}:counter:{k}")
}

/// What one worker thread did.
#[derive(Default)]
struct Worker {
    acquisitions: u64,
    /// Lock waits in microseconds.
    waits_us: Vec<u64>,
}

type Failure = Box<dyn std::error::Error + Send + Sync>;

fn main() -> Result<(), Failure> {
    let args = Args::parse();
    if args.threads == 0
        || args.processes == 0
        || args.keys == 0
        || !args.secs.is_finite()
        || args.secs <= 0.0
    {
        return Err("--threads, --processes, --keys and --secs must be positive".into());
    }
    if args.child {
        return child(&args);
    }
    let private;
    let url = match &args.url {
        Some(url) => url.clone(),
        None => {
            private = support::RedisServer::start();
            private.url()
        }
    };
    let client = LockClient::open(&url)?;
    let mut admin = redis::Client::open(url.as_str())?.get_connection()?;

    println!(
        "{} process(es) x {} thread(s), {} key(s), {} s per run; Redis at {}\n",
        args.processes,
        args.threads,
        args.keys,
        args.secs,
        if args.url.is_some() {
            "--url"
        } else {
            "a private redis-server"
        }
    );
    println!(
        "| release | acq/s | wait p50 | wait p99 | wait max | acq/worker min–max | Redis cmds/acq (lock only) | violations | PING RTT | uncontended cycle |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut violations = 0;
    for release in args.release.methods() {
        let (ping, cycle) = uncontended(&client, release)?;

        reset(&mut admin, args.keys)?;
        let before = commandstats(&mut admin)?;
        let started = Instant::now();
        let workers = if args.processes == 1 {
            run_workers(&url, &args, release, SystemTime::now())?
        } else {
            run_children(&args, &url, release)?
        };
        let elapsed = started.elapsed();
        let after = commandstats(&mut admin)?;
        let counted: i64 = (0..args.keys)
            .map(|k| {
                admin
                    .get::<_, Option<i64>>(counter_key(k))
                    .map(|v| v.unwrap_or(0))
            })
            .sum::<Result<i64, _>>()?;
        reset(&mut admin, args.keys)?;

        let acquisitions: u64 = workers.iter().map(|w| w.acquisitions).sum();
        let mut waits: Vec<u64> = workers
            .iter()
            .flat_map(|w| w.waits_us.iter().copied())
            .collect();
        waits.sort_unstable();
        let commands = commands_between(&before, &after);
        let per_acq = commands as f64 / acquisitions.max(1) as f64;
        let min = workers.iter().map(|w| w.acquisitions).min().unwrap_or(0);
        let max = workers.iter().map(|w| w.acquisitions).max().unwrap_or(0);
        let secs = args.secs.min(elapsed.as_secs_f64());
        let lost = acquisitions as i64 - counted;
        violations += lost;
        println!(
            "| {} | {:.0} | {} | {} | {} | {}–{} | {:.2} ({:.2}) | {} | {} | {} = {:.2} PING |",
            ReleaseArg::of(release),
            acquisitions as f64 / secs,
            micros(percentile(&waits, 50)),
            micros(percentile(&waits, 99)),
            micros(waits.last().copied().unwrap_or(0)),
            min,
            max,
            per_acq,
            per_acq - 2.0,
            lost,
            micros(ping.as_micros() as u64),
            micros(cycle.as_micros() as u64),
            cycle.as_secs_f64() / ping.as_secs_f64(),
        );
        std::io::stdout().flush()?;
    }
    let _: () = admin.del(format!("{PREFIX}:uncontended"))?;
    println!(
        "\nRedis cmds/acq: INFO commandstats delta per acquisition, as Redis counts them: \
         commands a script runs count too (release.lua = EVALSHA + GET + DEL). \
         \"lock only\" leaves out the critical section's GET and SET."
    );
    if violations != 0 {
        return Err(format!("{violations} exclusion violations: holders overlapped").into());
    }
    Ok(())
}

/// A PING and an uncontended acquire+release, measured in alternating
/// blocks so drift on a shared machine hits both alike; the medians of the
/// blocks' means.
fn uncontended(client: &LockClient, release: Release) -> Result<(Duration, Duration), Failure> {
    const BLOCKS: usize = 21;
    const ROUNDS: u32 = 200;
    let lock = DistributedLock::with_options(
        client,
        format!("{PREFIX}:uncontended"),
        LockOptions::default().release(release),
    );
    let mut ping = |_: ()| -> Result<(), Failure> {
        let mut con = client.pool().get()?;
        redis::cmd("PING").exec(&mut *con)?;
        Ok(())
    };
    let mut cycle = |_: ()| -> Result<(), Failure> { Ok(lock.lock()?.unlock()?) };
    for _ in 0..ROUNDS {
        ping(())?;
        cycle(())?;
    }
    let (mut pings, mut cycles) = (Vec::new(), Vec::new());
    for _ in 0..BLOCKS {
        pings.push(mean_of(ROUNDS, &mut ping)?);
        cycles.push(mean_of(ROUNDS, &mut cycle)?);
    }
    pings.sort();
    cycles.sort();
    Ok((pings[BLOCKS / 2], cycles[BLOCKS / 2]))
}

fn mean_of(
    rounds: u32,
    op: &mut impl FnMut(()) -> Result<(), Failure>,
) -> Result<Duration, Failure> {
    let started = Instant::now();
    for _ in 0..rounds {
        op(())?;
    }
    Ok(started.elapsed() / rounds)
}

fn reset(admin: &mut redis::Connection, keys: usize) -> redis::RedisResult<()> {
    for k in 0..keys {
        let _: () = admin.del(&[lock_key(k), counter_key(k)])?;
    }
    Ok(())
}

/// Calls per command from `INFO commandstats`.
fn commandstats(admin: &mut redis::Connection) -> redis::RedisResult<HashMap<String, u64>> {
    let info: String = redis::cmd("INFO").arg("commandstats").query(admin)?;
    Ok(info
        .lines()
        .filter_map(|line| line.strip_prefix("cmdstat_"))
        .filter_map(|line| {
            let (name, rest) = line.split_once(":calls=")?;
            let calls = rest.split(',').next()?.parse().ok()?;
            Some((name.to_owned(), calls))
        })
        .collect())
}

/// Commands run between two snapshots, leaving out the report's own INFO and
/// connection set-up (HELLO, CLIENT SETINFO, SELECT).
fn commands_between(before: &HashMap<String, u64>, after: &HashMap<String, u64>) -> u64 {
    after
        .iter()
        .filter(|(name, _)| {
            !(name.as_str() == "info"
                || name.as_str() == "hello"
                || name.as_str() == "select"
                || name.starts_with("client"))
        })
        .map(|(name, calls)| calls - before.get(name).copied().unwrap_or(0))
        .sum()
}

fn percentile(sorted: &[u64], pct: usize) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[(sorted.len() * pct / 100).min(sorted.len() - 1)]
}

fn micros(us: u64) -> String {
    if us < 1_000 {
        format!("{us} µs")
    } else {
        format!("{:.1} ms", us as f64 / 1_000.0)
    }
}

/// Runs this process's workers: `--threads` threads sharing one client, each
/// with its own connection for the counter, from `start` for `--secs`.
fn run_workers(
    url: &str,
    args: &Args,
    release: Release,
    start: SystemTime,
) -> Result<Vec<Worker>, Failure> {
    let client = LockClient::open(url)?;
    let run_for = Duration::from_secs_f64(args.secs);
    let handles: Vec<_> = (0..args.threads)
        .map(|t| {
            let locks: Vec<_> = (0..args.keys)
                .map(|k| {
                    DistributedLock::with_options(
                        &client,
                        lock_key(k),
                        LockOptions::default()
                            .ttl(Duration::from_secs(10))
                            .wait(run_for + Duration::from_secs(10))
                            .release(release),
                    )
                })
                .collect();
            let url = url.to_owned();
            let keys = args.keys;
            std::thread::spawn(move || -> Result<Worker, Failure> {
                let mut con = redis::Client::open(url.as_str())?.get_connection()?;
                if let Ok(until_start) = start.duration_since(SystemTime::now()) {
                    std::thread::sleep(until_start);
                }
                let end = Instant::now() + run_for;
                let mut worker = Worker::default();
                let mut i = t;
                while Instant::now() < end {
                    let k = i % keys;
                    i += 1;
                    let asked = Instant::now();
                    let guard = locks[k].lock()?;
                    worker.waits_us.push(asked.elapsed().as_micros() as u64);
                    let value: Option<i64> = con.get(counter_key(k))?;
                    let _: () = con.set(counter_key(k), value.unwrap_or(0) + 1)?;
                    guard.unlock()?;
                    worker.acquisitions += 1;
                }
                Ok(worker)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().map_err(|_| Failure::from("a worker panicked"))?)
        .collect()
}

/// Child mode: run the workers, print one `worker` line per thread.
fn child(args: &Args) -> Result<(), Failure> {
    let url = args.url.clone().ok_or("--child needs --url")?;
    let start =
        UNIX_EPOCH + Duration::from_millis(args.start_at_ms.ok_or("--child needs --start-at-ms")?);
    let release = match args.release {
        ReleaseArg::Watch => Release::Watch,
        _ => Release::Lua,
    };
    let workers = run_workers(&url, args, release, start)?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for worker in workers {
        write!(out, "worker {}", worker.acquisitions)?;
        for wait in worker.waits_us {
            write!(out, " {wait}")?;
        }
        writeln!(out)?;
    }
    out.flush()?;
    Ok(())
}

/// Runs `--processes` children of this program against `url`, all starting
/// at the same wall-clock moment, and gathers their workers.
fn run_children(args: &Args, url: &str, release: Release) -> Result<Vec<Worker>, Failure> {
    let start_at = SystemTime::now() + Duration::from_millis(500 + 100 * args.processes as u64);
    let start_at_ms = start_at.duration_since(UNIX_EPOCH)?.as_millis() as u64;
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for _ in 0..args.processes {
        children.push(
            Command::new(&exe)
                .arg("--child")
                .args(["--url", url])
                .args(["--threads", &args.threads.to_string()])
                .args(["--keys", &args.keys.to_string()])
                .args(["--secs", &args.secs.to_string()])
                .args(["--release", ReleaseArg::of(release)])
                .args(["--start-at-ms", &start_at_ms.to_string()])
                .stdout(Stdio::piped())
                .spawn()?,
        );
    }
    let mut workers = Vec::new();
    for mut child in children {
        let stdout = child.stdout.take().ok_or("child stdout")?;
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            let mut fields = line.split_ascii_whitespace();
            if fields.next() != Some("worker") {
                continue;
            }
            let acquisitions = fields.next().ok_or("worker line")?.parse()?;
            let waits_us = fields.map(str::parse).collect::<Result<Vec<u64>, _>>()?;
            workers.push(Worker {
                acquisitions,
                waits_us,
            });
        }
        let status = child.wait()?;
        if !status.success() {
            return Err(format!("a child process failed: {status}").into());
        }
    }
    Ok(workers)
}
