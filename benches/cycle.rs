//! What one uncontended cycle costs the client, beside the hand-written
//! pair a user would write (`SET key token NX PX`, then a compare-and-delete
//! script, on a redis-rs connection of its own): cycles per second, heap
//! allocations per cycle (a counting global allocator), the process's CPU
//! per cycle (user + system, `getrusage`), the server's CPU per cycle
//! (`INFO cpu`), the part of it spent running the cycle's commands
//! (`INFO commandstats`) and the commands Redis ran per cycle (`INFO
//! stats`). Every row is run three times, interleaved with the
//! others, and the median printed.
//!
//! `cargo bench --bench cycle -- [CYCLES]` (default 20,000 per row and run).
//! `CYCLE_ONLY=ROW` runs one row (0: the pair, 1: lock + unlock, ...) alone,
//! for a profiler; `CYCLE_TRACE=ROW` prints where one cycle of it allocates.
//!
//! A private redis-server on a free loopback port; not a criterion bench:
//! allocations and CPU are counted over whole runs.

use redmutex_test_support as support;

use std::time::{Duration, Instant};

use redmutex::Lease;
use redmutex::{DistributedLock, LockClient, Semaphore};

#[global_allocator]
static ALLOCATOR: support::Counting = support::Counting;

/// The process's user + system CPU time so far.
fn cpu() -> Duration {
    // SAFETY: `usage` is a valid, writable rusage; the call fills it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF is always valid.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return Duration::ZERO;
    }
    let of = |t: libc::timeval| {
        Duration::from_secs(u64::try_from(t.tv_sec).unwrap_or(0))
            + Duration::from_micros(u64::try_from(t.tv_usec).unwrap_or(0))
    };
    of(usage.ru_utime) + of(usage.ru_stime)
}

/// The sum of `section`'s `INFO` fields in `names`; for a field holding
/// `k=v` pairs (`INFO commandstats`), of its `usec` pair.
fn info_sum(con: &mut redis::Connection, section: &str, names: &[&str]) -> f64 {
    let info: String = redis::cmd("INFO")
        .arg(section)
        .query(con)
        .unwrap_or_default();
    info.lines()
        .filter_map(|line| {
            let (name, value) = line.split_once(':')?;
            if !names.contains(&name) {
                return None;
            }
            let value = match value.split_once(',') {
                Some(_) => value.split(',').find_map(|f| f.strip_prefix("usec="))?,
                None => value,
            };
            value.trim().parse::<f64>().ok()
        })
        .sum()
}

/// The commands the server ran so far (`INFO stats`).
fn commands(con: &mut redis::Connection) -> u64 {
    info_sum(con, "stats", &["total_commands_processed"]) as u64
}

/// The microseconds the server spent running the commands these cycles
/// send (`INFO commandstats`): `SET`, `EVALSHA` and `EVAL`, a script's
/// inner calls included, its network and event loop not. (Inner calls
/// are counted under their own names too, so only these three are summed.)
fn in_commands(con: &mut redis::Connection) -> f64 {
    info_sum(
        con,
        "commandstats",
        &["cmdstat_set", "cmdstat_evalsha", "cmdstat_eval"],
    )
}

/// The server's CPU time so far (`INFO cpu`: user + system, main thread
/// and the rest).
fn server_cpu(con: &mut redis::Connection) -> f64 {
    info_sum(con, "cpu", &["used_cpu_sys", "used_cpu_user"])
}

type Outcome = Result<(), Box<dyn std::error::Error>>;
type Cycle<'a> = Box<dyn FnMut() -> Outcome + 'a>;

/// One run of `cycles` cycles: cycles/s, allocations, CPU µs and Redis
/// commands per cycle.
#[derive(Clone, Copy)]
struct Run {
    per_sec: f64,
    allocations: f64,
    cpu_us: f64,
    server_us: f64,
    in_commands_us: f64,
    commands: f64,
}

fn run(
    cycles: u32,
    admin: &mut redis::Connection,
    cycle: &mut dyn FnMut() -> Outcome,
) -> Result<Run, Box<dyn std::error::Error>> {
    for _ in 0..cycles / 10 {
        cycle()?;
    }
    let n = f64::from(cycles.max(1));
    let commands_before = commands(admin);
    let server_before = server_cpu(admin);
    let in_commands_before = in_commands(admin);
    let allocations = support::allocations();
    let cpu_before = cpu();
    let started = Instant::now();
    for _ in 0..cycles {
        cycle()?;
    }
    let elapsed = started.elapsed();
    let cpu_used = cpu().saturating_sub(cpu_before);
    let server_used = (server_cpu(admin) - server_before).max(0.0);
    let in_commands_used = (in_commands(admin) - in_commands_before).max(0.0);
    let allocated = support::allocations().saturating_sub(allocations);
    // The INFOs that read the counts are commands too: the one that read
    // the first count and the four after it.
    let ran = commands(admin)
        .saturating_sub(commands_before)
        .saturating_sub(5);
    Ok(Run {
        per_sec: n / elapsed.as_secs_f64().max(f64::MIN_POSITIVE),
        allocations: allocated as f64 / n,
        cpu_us: cpu_used.as_secs_f64() * 1e6 / n,
        server_us: server_used * 1e6 / n,
        in_commands_us: in_commands_used / n,
        commands: ran as f64 / n,
    })
}

fn median(runs: &[Run], field: impl Fn(&Run) -> f64) -> f64 {
    let mut values: Vec<f64> = runs.iter().map(field).collect();
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // `cargo bench` passes `--bench`; a number is the cycles per run.
    let cycles: u32 = std::env::args()
        .skip(1)
        .find_map(|arg| arg.parse().ok())
        .unwrap_or(20_000);
    let server = support::RedisServer::start();
    let url = server.url();
    let mut admin = server.conn();
    let client = LockClient::open(&url)?;
    let mut raw = redis::Client::open(url.as_str())?.get_connection()?;
    let lock = DistributedLock::new(&client, "bench:cycle");
    let semaphore = Semaphore::new(&client, "bench:sem", 1);
    let mut rows: Vec<(&str, Cycle)> = vec![
        (
            "hand-written pair (SET NX PX + compare-and-delete)",
            Box::new(
                || match support::hand_written_pair(&mut raw, "bench:pair")? {
                    true => Ok(()),
                    false => Err("bench:pair was held".into()),
                },
            ),
        ),
        (
            "lock() + unlock()",
            Box::new(|| lock.lock()?.unlock().map(drop).map_err(Into::into)),
        ),
        (
            "lock() + drop (release written behind)",
            Box::new(|| {
                drop(lock.lock()?);
                Ok(())
            }),
        ),
        (
            "Semaphore acquire() + release()",
            Box::new(|| Ok(semaphore.acquire()?.release()?)),
        ),
        (
            "Semaphore acquire() + drop",
            Box::new(|| {
                drop(semaphore.acquire()?);
                Ok(())
            }),
        ),
    ];
    // One row alone, for a profiler or `strace -c`.
    if let Ok(row) = std::env::var("CYCLE_ONLY") {
        let (_, cycle) = rows.get_mut(row.parse::<usize>()?).ok_or("no such row")?;
        for _ in 0..cycles {
            cycle()?;
        }
        return Ok(());
    }
    // Where one cycle of a row allocates, after a warm-up.
    if let Ok(row) = std::env::var("CYCLE_TRACE") {
        let (_, cycle) = rows.get_mut(row.parse::<usize>()?).ok_or("no such row")?;
        for _ in 0..100 {
            cycle()?;
        }
        support::counting_trace(true);
        let traced = cycle();
        support::counting_trace(false);
        return traced;
    }
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); rows.len()];
    for _ in 0..3 {
        for (row, (_, cycle)) in rows.iter_mut().enumerate() {
            let measured = run(cycles, &mut admin, cycle.as_mut())?;
            if let Some(kept) = runs.get_mut(row) {
                kept.push(measured);
            }
        }
    }
    let pair = runs
        .first()
        .map_or(1.0, |pair| median(pair, |r| r.per_sec))
        .max(f64::MIN_POSITIVE);
    println!(
        "| cycle ({cycles} per run, median of 3) | cycles/s | x pair | allocations | client CPU µs | Redis CPU µs | Redis µs in commands | Redis commands |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for ((name, _), runs) in rows.iter().zip(&runs) {
        let per_sec = median(runs, |r| r.per_sec);
        println!(
            "| {name} | {per_sec:.0} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} |",
            per_sec / pair,
            median(runs, |r| r.allocations),
            median(runs, |r| r.cpu_us),
            median(runs, |r| r.server_us),
            median(runs, |r| r.in_commands_us),
            median(runs, |r| r.commands),
        );
    }
    Ok(())
}
