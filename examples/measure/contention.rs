//! The contention report: how the lock behaves when many workers want it.
//!
//! ```sh
//! cargo run --release --example contention -- \
//!     [--threads N] [--processes P] [--keys K] [--secs S] \
//!     [--release lua|watch|both] [--wait-mode spin|notify|both] [--no-handoff] \
//!     [--handoff-budget HANDOFFS/MS] [--work none|redis|sleep:MS] [--url URL] \
//!     [--limit N] [--no-holder-metadata]
//! ```
//!
//! With `--limit N` every wait mode also gets a semaphore row: the same
//! workers take permits of a [`Semaphore`](redmutex::Semaphore) of N per
//! key instead of the lock (the in-process check then counts more than N
//! holders at once as a violation, and "max holders" shows the most seen).
//!
//! Without `--url` it starts a private redis-server on a free loopback port.
//! Every worker loops for `--secs`: lock one of the `--keys` keys, do the
//! critical section's `--work`, unlock. `--work redis` (the default) is a
//! deliberately non-atomic GET/SET increment of the key's counter in Redis;
//! `none` does nothing but a process-local non-atomic increment; `sleep:MS`
//! sleeps. Every critical section also checks, in process, that no other
//! worker is inside. With `--processes P` it runs P child processes of
//! itself, each with `--threads` threads and its own `LockClient`, against
//! the same keys, and sums their figures.
//!
//! It prints one Markdown table, one row per wait mode and release method:
//! acquisitions/s; wait p50, p99 and max (from calling `lock()` to holding
//! the guard); acquisitions per worker (min–max and their ratio); with
//! several processes, the smallest process's share; lock commands per
//! acquisition as the clients sent them (`LockClient::stats`) and all Redis
//! commands per acquisition from the `INFO commandstats` delta (scripts'
//! inner calls and the critical section included); in-process handoffs per
//! acquisition; exclusion violations (must be 0); and, measured in the same
//! run, a PING round trip and two uncontended cycles as multiples of it:
//! lock + `unlock()` (the floor is 2: acquire, then release and wait for its
//! answer) and lock + drop (the floor is 1: the drop writes its release
//! behind, and the next lock's request carries it in the same round trip).

use redmutex_test_support as support;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Parser, ValueEnum};
use redis::Commands;
use redmutex::Lease;
use redmutex::{DistributedLock, LockClient, LockOptions, Release, Semaphore, WaitMode};

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
    /// Seconds each row's run lasts.
    #[arg(long, default_value_t = 5.0)]
    secs: f64,
    /// Release method; `both` prints a row for each.
    #[arg(long, value_enum, default_value_t = ReleaseArg::Lua)]
    release: ReleaseArg,
    /// How waiters wait; `both` prints a row for each.
    #[arg(long, value_enum, default_value_t = ModeArg::Both)]
    wait_mode: ModeArg,
    /// Turn off in-process handoff (notify mode).
    #[arg(long)]
    no_handoff: bool,
    /// The handoff budget as HANDOFFS/MS (notify mode).
    #[arg(long, default_value = "256/10", value_parser = parse_budget)]
    handoff_budget: (u32, u64),
    /// The handoff budget's max age, in microseconds: a lease Redis
    /// confirmed longer ago is confirmed again before it is passed on.
    #[arg(long, default_value_t = 1000)]
    handoff_max_age_us: u64,
    /// The critical section: none, redis (GET/SET counter) or sleep:MS.
    #[arg(long, default_value = "redis", value_parser = parse_work)]
    work: Work,
    /// Redis server to use instead of a private one. Only keys under
    /// `redmutex-report:*` are written, and they are deleted afterwards.
    #[arg(long)]
    url: Option<String>,
    /// Add a semaphore row per wait mode: permits of a semaphore of N.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    limit: Option<u32>,
    /// Tokens without holder metadata (bare UUIDs), to measure its cost.
    #[arg(long)]
    no_holder_metadata: bool,
    /// Internal: run as a child worker process.
    #[arg(long, hide = true)]
    child: bool,
    /// Internal: the child runs a semaphore row of this limit.
    #[arg(long, hide = true)]
    child_limit: Option<u32>,
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

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum ModeArg {
    Spin,
    Notify,
    Both,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Work {
    None,
    Redis,
    Sleep(Duration),
}

fn parse_work(text: &str) -> Result<Work, String> {
    match text {
        "none" => Ok(Work::None),
        "redis" => Ok(Work::Redis),
        _ => text
            .strip_prefix("sleep:")
            .and_then(|ms| ms.parse().ok())
            .map(|ms| Work::Sleep(Duration::from_millis(ms)))
            .ok_or_else(|| format!("--work wants none, redis or sleep:MS, got {text:?}")),
    }
}

fn parse_budget(text: &str) -> Result<(u32, u64), String> {
    text.split_once('/')
        .and_then(|(n, ms)| Some((n.parse().ok()?, ms.parse().ok()?)))
        .ok_or_else(|| format!("--handoff-budget wants HANDOFFS/MS, got {text:?}"))
}

fn work_name(work: Work) -> String {
    match work {
        Work::None => "none".into(),
        Work::Redis => "redis".into(),
        Work::Sleep(d) => format!("sleep:{}", d.as_millis()),
    }
}

fn releases(arg: ReleaseArg) -> Vec<Release> {
    match arg {
        ReleaseArg::Lua => vec![Release::Lua],
        ReleaseArg::Watch => vec![Release::Watch],
        ReleaseArg::Both => vec![Release::Lua, Release::Watch],
    }
}

fn modes(arg: ModeArg) -> Vec<WaitMode> {
    match arg {
        ModeArg::Spin => vec![WaitMode::Spin],
        ModeArg::Notify => vec![WaitMode::Notify],
        ModeArg::Both => vec![WaitMode::Spin, WaitMode::Notify],
    }
}

fn release_name(release: Release) -> &'static str {
    match release {
        Release::Watch => "watch",
        _ => "lua",
    }
}

fn mode_name(mode: WaitMode) -> &'static str {
    match mode {
        WaitMode::Spin => "spin",
        _ => "notify",
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

/// What one process did.
#[derive(Default)]
struct Process {
    workers: Vec<Worker>,
    /// Lock commands its client sent.
    commands: u64,
    handoffs: u64,
    /// In-process exclusion violations: overlaps seen (more holders than
    /// the limit), plus increments of the process-local counter that were
    /// lost (lock rows).
    violations: u64,
    /// The most holders of one key seen at once in this process.
    most_inside: u32,
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
    let (_private, url) = support::server_or(args.url.as_deref());
    let client = LockClient::open(&url)?.with_holder_metadata(!args.no_holder_metadata);
    let mut admin = redis::Client::open(url.as_str())?.get_connection()?;

    println!(
        "{} process(es) x {} thread(s), {} key(s), work {}, {} s per row, {}; Redis at {}\n",
        args.processes,
        args.threads,
        args.keys,
        work_name(args.work),
        args.secs,
        if args.no_handoff {
            "no handoff".to_owned()
        } else {
            format!(
                "handoff budget {} handoffs/{} ms",
                args.handoff_budget.0, args.handoff_budget.1
            )
        },
        if args.url.is_some() {
            "--url"
        } else {
            "a private redis-server"
        }
    );
    println!(
        "| wait mode | release | acq/s | wait p50 | wait p99 | wait max | acq/worker min–max (ratio) | smallest process share | lock cmds/acq | Redis cmds/acq | handoffs/acq | max holders | violations | PING RTT | acq per PING RTT | uncontended lock + unlock() | uncontended lock + drop | hand-written SET NX PX + EVALSHA |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut violations = 0;
    let mut rows: Vec<(WaitMode, Release, Option<u32>)> = Vec::new();
    for mode in modes(args.wait_mode) {
        for release in releases(args.release) {
            rows.push((mode, release, None));
        }
        if let Some(limit) = args.limit {
            rows.push((mode, Release::Lua, Some(limit)));
        }
    }
    for (mode, release, limit) in rows {
        let Cycles {
            ping,
            cycle,
            dropped,
            pair,
        } = uncontended(&client, mode, release, limit)?;

        reset(&mut admin, args.keys)?;
        let before = commandstats(&mut admin)?;
        let started = Instant::now();
        let processes = if args.processes == 1 {
            vec![run_process(
                &url,
                &args,
                mode,
                release,
                limit,
                SystemTime::now(),
            )?]
        } else {
            run_children(&args, &url, mode, release, limit)?
        };
        let elapsed = started.elapsed();
        let after = commandstats(&mut admin)?;
        let counted: u64 = (0..args.keys)
            .map(|k| {
                admin
                    .get::<_, Option<u64>>(counter_key(k))
                    .map(|v| v.unwrap_or(0))
            })
            .sum::<Result<u64, _>>()?;
        reset(&mut admin, args.keys)?;

        let workers: Vec<&Worker> = processes.iter().flat_map(|p| &p.workers).collect();
        let acquisitions: u64 = workers.iter().map(|w| w.acquisitions).sum();
        let per_acq = |n: u64| n as f64 / acquisitions.max(1) as f64;
        let mut waits: Vec<u64> = workers
            .iter()
            .flat_map(|w| w.waits_us.iter().copied())
            .collect();
        waits.sort_unstable();
        let min = workers.iter().map(|w| w.acquisitions).min().unwrap_or(0);
        let max = workers.iter().map(|w| w.acquisitions).max().unwrap_or(0);
        let share = if processes.len() > 1 {
            let smallest = processes
                .iter()
                .map(|p| p.workers.iter().map(|w| w.acquisitions).sum::<u64>())
                .min()
                .unwrap_or(0);
            format!("{:.0} %", 100.0 * per_acq(smallest))
        } else {
            "–".into()
        };
        // Permit holders share the counter: their lost updates are
        // expected, not a violation.
        let lost_in_redis = if args.work == Work::Redis && limit.is_none() {
            acquisitions.saturating_sub(counted)
        } else {
            0
        };
        let row_violations = lost_in_redis + processes.iter().map(|p| p.violations).sum::<u64>();
        violations += row_violations;
        let secs = args.secs.min(elapsed.as_secs_f64());
        let kind = match limit {
            Some(limit) => format!("semaphore of {limit}"),
            None => release_name(release).to_owned(),
        };
        println!(
            "| {} | {} | {:.0} | {} | {} | {} | {}–{} ({:.2}) | {} | {:.3} | {:.2} | {:.2} | {} | {} | {} | {:.2} | {} = {:.2} PING | {} = {:.2} PING | {} = {:.2} PING |",
            mode_name(mode),
            kind,
            acquisitions as f64 / secs,
            micros(percentile(&waits, 50)),
            micros(percentile(&waits, 99)),
            micros(waits.last().copied().unwrap_or(0)),
            min,
            max,
            min as f64 / max.max(1) as f64,
            share,
            per_acq(processes.iter().map(|p| p.commands).sum()),
            per_acq(commands_between(&before, &after)),
            per_acq(processes.iter().map(|p| p.handoffs).sum()),
            processes.iter().map(|p| p.most_inside).max().unwrap_or(0),
            row_violations,
            micros(ping.as_micros() as u64),
            acquisitions as f64 / secs * ping.as_secs_f64(),
            micros(cycle.as_micros() as u64),
            cycle.as_secs_f64() / ping.as_secs_f64(),
            micros(dropped.as_micros() as u64),
            dropped.as_secs_f64() / ping.as_secs_f64(),
            micros(pair.as_micros() as u64),
            pair.as_secs_f64() / ping.as_secs_f64(),
        );
        std::io::stdout().flush()?;
    }
    let _: () = admin.del(format!("{PREFIX}:uncontended"))?;
    println!(
        "\nlock cmds/acq: commands the lock sent per acquisition (LockClient::stats; a script \
         counts once). Redis cmds/acq: the INFO commandstats delta per acquisition, as Redis \
         counts it: a script's inner calls count too (release.lua = EVALSHA + GET + DEL + \
         PUBLISH), and so does the critical section (GET + SET with --work redis)."
    );
    if violations != 0 {
        return Err(format!("{violations} exclusion violations: holders overlapped").into());
    }
    Ok(())
}

/// What [`uncontended`] measures.
struct Cycles {
    ping: Duration,
    cycle: Duration,
    dropped: Duration,
    /// The peer: what a program without this crate would write.
    pair: Duration,
}

/// A compare-and-delete, the release a hand-written lock sends.
const COMPARE_AND_DELETE: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";

/// A PING, an uncontended lock + `unlock()`, an uncontended lock + drop
/// (the release written behind, its reply read with the next lock's), and
/// the hand-written pair (`SET NX PX` with a UUID, then `EVALSHA` of a
/// compare-and-delete, on the same kind of pooled connection), measured in
/// alternating blocks so drift on a shared machine hits them alike; the
/// medians of the blocks' means.
fn uncontended(
    client: &LockClient,
    mode: WaitMode,
    release: Release,
    limit: Option<u32>,
) -> Result<Cycles, Failure> {
    const BLOCKS: usize = 21;
    const ROUNDS: u32 = 200;
    let options = LockOptions::default().wait_mode(mode).release(release);
    let key = format!("{PREFIX}:uncontended");
    let lock = DistributedLock::with_options(client, key.clone(), options);
    let semaphore = limit.map(|limit| {
        Semaphore::with_options(
            client,
            key.clone(),
            limit,
            options.with_extra(redmutex::SemaphoreExtra::default()),
        )
    });
    let mut ping = |_: ()| -> Result<(), Failure> {
        let mut con = client.pool()?.get()?;
        redis::cmd("PING").exec(&mut *con)?;
        Ok(())
    };
    let mut cycle = |_: ()| -> Result<(), Failure> {
        match &semaphore {
            Some(semaphore) => Ok(semaphore.acquire()?.release()?),
            None => Ok(lock.lock()?.unlock().map(drop)?),
        }
    };
    let mut dropped = |_: ()| -> Result<(), Failure> {
        match &semaphore {
            Some(semaphore) => drop(semaphore.acquire()?),
            None => drop(lock.lock()?),
        }
        Ok(())
    };
    let cad = redis::Script::new(COMPARE_AND_DELETE);
    let peer_key = format!("{PREFIX}:peer");
    let mut pair = |_: ()| -> Result<(), Failure> {
        let token = uuid::Uuid::new_v4().to_string();
        // One pooled connection per operation, as a lock library does.
        let taken: bool = redis::cmd("SET")
            .arg(&peer_key)
            .arg(&token)
            .arg("NX")
            .arg("PX")
            .arg(30_000)
            .query::<Option<String>>(&mut *client.pool()?.get()?)?
            .is_some();
        let mut con = client.pool()?.get()?;
        let released: i64 = cad.key(&peer_key).arg(&token).invoke(&mut *con)?;
        if !taken || released != 1 {
            return Err("the hand-written pair did not take and release its key".into());
        }
        Ok(())
    };
    for _ in 0..ROUNDS {
        ping(())?;
        cycle(())?;
        dropped(())?;
        pair(())?;
    }
    let (mut pings, mut cycles, mut drops, mut pairs) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..BLOCKS {
        pings.push(mean_of(ROUNDS, &mut ping)?);
        cycles.push(mean_of(ROUNDS, &mut cycle)?);
        drops.push(mean_of(ROUNDS, &mut dropped)?);
        pairs.push(mean_of(ROUNDS, &mut pair)?);
    }
    // The last drop's reply is read here, not left to the next row.
    lock.lock()?.unlock()?;
    for blocks in [&mut pings, &mut cycles, &mut drops, &mut pairs] {
        blocks.sort();
    }
    Ok(Cycles {
        ping: pings[BLOCKS / 2],
        cycle: cycles[BLOCKS / 2],
        dropped: drops[BLOCKS / 2],
        pair: pairs[BLOCKS / 2],
    })
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
/// connection set-up (HELLO, CLIENT SETINFO/SETNAME, SELECT, AUTH).
fn commands_between(before: &HashMap<String, u64>, after: &HashMap<String, u64>) -> u64 {
    after
        .iter()
        .filter(|(name, _)| {
            !matches!(name.as_str(), "info" | "hello" | "select" | "auth")
                && !name.starts_with("client")
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

/// In-process exclusion checks for one key: who is inside, and a counter
/// incremented without atomicity.
#[derive(Default)]
struct Local {
    inside: AtomicU32,
    most: AtomicU32,
    overlaps: AtomicU64,
    counter: AtomicU64,
}

impl Local {
    /// One more holder; more than `allowed` inside is an overlap.
    fn enter(&self, allowed: u32) {
        let inside = self.inside.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(inside, Ordering::Relaxed);
        if inside > allowed {
            self.overlaps.fetch_add(1, Ordering::Relaxed);
        }
        // Deliberately a load and a store: overlapping holders lose updates.
        let value = self.counter.load(Ordering::Relaxed);
        std::hint::spin_loop();
        self.counter.store(value + 1, Ordering::Relaxed);
    }

    fn leave(&self) {
        self.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Runs this process's workers: `--threads` threads sharing one client, each
/// with its own connection for the counter, from `start` for `--secs`.
fn run_process(
    url: &str,
    args: &Args,
    mode: WaitMode,
    release: Release,
    limit: Option<u32>,
    start: SystemTime,
) -> Result<Process, Failure> {
    let client = LockClient::open(url)?.with_holder_metadata(!args.no_holder_metadata);
    let run_for = Duration::from_secs_f64(args.secs);
    let locals: Arc<Vec<Local>> = Arc::new((0..args.keys).map(|_| Local::default()).collect());
    let options = LockOptions::default()
        .ttl(Duration::from_secs(10))
        .wait(run_for + Duration::from_secs(10))
        .release(release)
        .wait_mode(mode)
        .local_handoff(!args.no_handoff)
        .handoff_budget(
            redmutex::HandoffBudget::new(
                args.handoff_budget.0,
                Duration::from_millis(args.handoff_budget.1),
            )
            .with_max_age(Duration::from_micros(args.handoff_max_age_us)),
        );
    let handles: Vec<_> = (0..args.threads)
        .map(|t| {
            let locks: Vec<_> = (0..args.keys)
                .map(|k| DistributedLock::with_options(&client, lock_key(k), options))
                .collect();
            let semaphores: Vec<_> = match limit {
                Some(limit) => (0..args.keys)
                    .map(|k| {
                        Semaphore::with_options(
                            &client,
                            lock_key(k),
                            limit,
                            options.for_semaphore(),
                        )
                    })
                    .collect(),
                None => Vec::new(),
            };
            let allowed = limit.unwrap_or(1);
            let (url, keys, work, locals) = (url.to_owned(), args.keys, args.work, locals.clone());
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
                    let held = match semaphores.get(k) {
                        Some(semaphore) => Held::Permit(Box::new(semaphore.acquire()?)),
                        None => Held::Lock(locks[k].lock()?),
                    };
                    worker.waits_us.push(asked.elapsed().as_micros() as u64);
                    locals[k].enter(allowed);
                    match work {
                        Work::None => {}
                        Work::Redis => {
                            let value: Option<i64> = con.get(counter_key(k))?;
                            let _: () = con.set(counter_key(k), value.unwrap_or(0) + 1)?;
                        }
                        Work::Sleep(d) => std::thread::sleep(d),
                    }
                    locals[k].leave();
                    match held {
                        Held::Permit(permit) => permit.release()?,
                        Held::Lock(guard) => drop(guard.unlock()?),
                    }
                    worker.acquisitions += 1;
                }
                Ok(worker)
            })
        })
        .collect();
    let workers = handles
        .into_iter()
        .map(|h| h.join().map_err(|_| Failure::from("a worker panicked"))?)
        .collect::<Result<Vec<Worker>, Failure>>()?;
    let acquisitions: u64 = workers.iter().map(|w| w.acquisitions).sum();
    let counted: u64 = locals
        .iter()
        .map(|l| l.counter.load(Ordering::Relaxed))
        .sum();
    let overlaps: u64 = locals
        .iter()
        .map(|l| l.overlaps.load(Ordering::Relaxed))
        .sum();
    let most_inside = locals
        .iter()
        .map(|l| l.most.load(Ordering::Relaxed))
        .max()
        .unwrap_or(0);
    let stats = client.stats();
    // Permit holders share the local counter too: only a lock loses none.
    let lost = if limit.is_none() {
        acquisitions.saturating_sub(counted)
    } else {
        0
    };
    Ok(Process {
        workers,
        commands: stats.commands,
        handoffs: stats.handoffs,
        violations: overlaps + lost,
        most_inside,
    })
}

/// What a worker holds in its critical section.
enum Held {
    Lock(redmutex::LockGuard),
    // Boxed: a permit is much larger than a guard.
    Permit(Box<redmutex::Permit>),
}

/// Child mode: run the workers, print one `worker` line per thread and one
/// `process` line.
fn child(args: &Args) -> Result<(), Failure> {
    let url = args.url.clone().ok_or("--child needs --url")?;
    let start =
        UNIX_EPOCH + Duration::from_millis(args.start_at_ms.ok_or("--child needs --start-at-ms")?);
    let release = match args.release {
        ReleaseArg::Watch => Release::Watch,
        _ => Release::Lua,
    };
    let mode = match args.wait_mode {
        ModeArg::Spin => WaitMode::Spin,
        _ => WaitMode::Notify,
    };
    let process = run_process(&url, args, mode, release, args.child_limit, start)?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    writeln!(
        out,
        "process {} {} {} {}",
        process.commands, process.handoffs, process.violations, process.most_inside
    )?;
    for worker in process.workers {
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
/// at the same wall-clock moment, and gathers what they did.
fn run_children(
    args: &Args,
    url: &str,
    mode: WaitMode,
    release: Release,
    limit: Option<u32>,
) -> Result<Vec<Process>, Failure> {
    let start_at = SystemTime::now() + Duration::from_millis(500 + 100 * args.processes as u64);
    let start_at_ms = start_at.duration_since(UNIX_EPOCH)?.as_millis() as u64;
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for _ in 0..args.processes {
        let mut command = Command::new(&exe);
        command
            .arg("--child")
            .args(["--url", url])
            .args(["--threads", &args.threads.to_string()])
            .args(["--keys", &args.keys.to_string()])
            .args(["--secs", &args.secs.to_string()])
            .args(["--release", release_name(release)])
            .args(["--wait-mode", mode_name(mode)])
            .args(["--work", &work_name(args.work)])
            .args([
                "--handoff-budget",
                &format!("{}/{}", args.handoff_budget.0, args.handoff_budget.1),
            ])
            .args(["--handoff-max-age-us", &args.handoff_max_age_us.to_string()])
            .args(["--start-at-ms", &start_at_ms.to_string()])
            .stdout(Stdio::piped());
        if args.no_handoff {
            command.arg("--no-handoff");
        }
        if args.no_holder_metadata {
            command.arg("--no-holder-metadata");
        }
        if let Some(limit) = limit {
            command.args(["--child-limit", &limit.to_string()]);
        }
        children.push(command.spawn()?);
    }
    let mut processes = Vec::new();
    for mut child in children {
        let stdout = child.stdout.take().ok_or("child stdout")?;
        let mut process = Process::default();
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            let mut fields = line.split_ascii_whitespace();
            match fields.next() {
                Some("process") => {
                    let mut next = || -> Result<u64, Failure> {
                        Ok(fields.next().ok_or("short process line")?.parse()?)
                    };
                    process.commands = next()?;
                    process.handoffs = next()?;
                    process.violations = next()?;
                    process.most_inside = u32::try_from(next()?)?;
                }
                Some("worker") => {
                    let acquisitions = fields.next().ok_or("short worker line")?.parse()?;
                    let waits_us = fields.map(str::parse).collect::<Result<Vec<u64>, _>>()?;
                    process.workers.push(Worker {
                        acquisitions,
                        waits_us,
                    });
                }
                _ => {}
            }
        }
        let status = child.wait()?;
        if !status.success() {
            return Err(format!("a child process failed: {status}").into());
        }
        processes.push(process);
    }
    Ok(processes)
}
