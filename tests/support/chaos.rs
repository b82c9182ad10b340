//! The chaos run shared by `tests/chaos.rs` and `examples/chaos.rs`:
//! worker processes × threads take one fenced lock through a
//! fault-injecting proxy and do a read-modify-write on a protected
//! resource that refuses stale fencing tokens, while a controller stops,
//! continues and kills workers, kills their connections, stalls Redis,
//! flushes its scripts and injects proxy faults. With a limit N, they take
//! permits of one semaphore instead (fenced, half of them watched) and
//! hold them for a moment.
//!
//! What it checks afterwards: no update was lost past fencing (the
//! resource's counter equals its accepted writes), never more than one
//! (or N) holds at once while their holders still reported
//! `validity() > 0`, every worker that was never killed kept making
//! progress, and nothing of the crate is left (lock key, subscriptions,
//! connections; each worker checks its threads before it exits).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redmutex::{DistributedLock, Error, LockClient, LockOptions, Semaphore, SemaphoreOptions};

use super::{Dice, FaultProxy, RedisServer, wait_until};

/// The lock every worker takes.
pub const KEY: &str = "chaos";
/// The lease: short, so stopped holders outlive it.
pub const TTL: Duration = Duration::from_millis(500);

/// The protected resource's read: refuses a token lower than the highest
/// it has seen (a read registers its token too, or a stale holder's write
/// could still land between a newer holder's read and write).
const RESOURCE_READ: &str = r"
local highest = tonumber(redis.call('GET', 'highest') or '0')
local token = tonumber(ARGV[1])
if token < highest then
  redis.call('INCR', 'rejected')
  return -1
end
redis.call('SET', 'highest', token)
return tonumber(redis.call('GET', 'counter') or '0')
";

/// The resource's write: counter = ARGV[2], if the token is not stale.
const RESOURCE_WRITE: &str = r"
local highest = tonumber(redis.call('GET', 'highest') or '0')
local token = tonumber(ARGV[1])
if token < highest then
  redis.call('INCR', 'rejected')
  return 0
end
redis.call('SET', 'highest', token)
redis.call('SET', 'counter', ARGV[2])
redis.call('INCR', 'accepted')
return 1
";

/// Nanoseconds on the wall clock, comparable between processes.
fn wall() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn kind(err: &Error) -> &'static str {
    match err {
        Error::Timeout { .. } => "timeout",
        Error::NotHeld { .. } => "not-held",
        Error::OutcomeUnknown { .. } => "outcome-unknown",
        Error::Redis(_) => "redis",
        Error::Pool(_) => "pool",
        Error::WrongType { .. } => "wrong-type",
        Error::FenceCounter { .. } => "fence-counter",
        _ => "other",
    }
}

/// What a worker thread holds.
enum Hold {
    Lock(redmutex::LockGuard),
    // Boxed: a permit is much larger than a guard.
    Permit(Box<redmutex::Permit>),
}

impl Hold {
    fn validity(&self) -> Duration {
        match self {
            Hold::Lock(guard) => guard.validity(),
            Hold::Permit(permit) => permit.validity(),
        }
    }

    fn fencing_token(&self) -> Option<u64> {
        match self {
            Hold::Lock(guard) => guard.fencing_token(),
            Hold::Permit(permit) => permit.fencing_token(),
        }
    }

    fn unlock(self) -> Result<(), Error> {
        match self {
            Hold::Lock(guard) => guard.unlock(),
            Hold::Permit(permit) => permit.release(),
        }
    }
}

/// One worker process: `threads` threads loop for `secs` (taking permits
/// of a semaphore of `limit` when it is not 0), each printing a line per
/// hold (`H thread start end`: from acquisition to the last
/// moment it saw `validity() > 0`), then a summary per thread
/// (`S thread acquisitions`), errors (`E kind count`), the longest wait
/// (`W nanos`) and whether the crate's threads were gone after the client
/// was dropped (`T ok` or `T left ...`).
pub fn worker(lock_url: &str, resource_url: &str, threads: usize, secs: f64, limit: u32) {
    let client = LockClient::open(lock_url).expect("lock client");
    let resource = redis::Client::open(resource_url).expect("resource");
    let read = redis::Script::new(RESOURCE_READ);
    let write = redis::Script::new(RESOURCE_WRITE);
    let out = Arc::new(Mutex::new(std::io::stdout()));
    let errors: Arc<Mutex<BTreeMap<&'static str, u64>>> = Arc::default();
    let longest = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let options = LockOptions::default()
                .ttl(TTL)
                .wait(Duration::from_secs(5))
                .fencing(true)
                .watchdog(t % 2 == 1);
            let semaphore = (limit > 0).then(|| {
                // Half unfenced: their permits go straight to a queued
                // thread of the same process (handoff), the rest each get
                // a token of their own from Redis.
                Semaphore::with_options(
                    &client,
                    KEY,
                    limit,
                    SemaphoreOptions::from(&options).fencing(t % 2 == 0),
                )
            });
            let lock = DistributedLock::with_options(&client, KEY, options);
            let take = move || -> Result<Hold, Error> {
                match &semaphore {
                    Some(semaphore) => semaphore
                        .acquire()
                        .map(|permit| Hold::Permit(Box::new(permit))),
                    None => lock.lock().map(Hold::Lock),
                }
            };
            let (resource, read, write) = (resource.clone(), read.clone(), write.clone());
            let (out, errors, longest) = (out.clone(), errors.clone(), longest.clone());
            std::thread::spawn(move || {
                let mut con = resource.get_connection().expect("resource connection");
                let mut acquired = 0u64;
                let error = |err: &Error| {
                    *errors.lock().expect("errors").entry(kind(err)).or_default() += 1;
                    std::thread::sleep(Duration::from_millis(5));
                };
                while Instant::now() < deadline {
                    let asked = Instant::now();
                    let guard = match take() {
                        Ok(guard) => guard,
                        Err(err) => {
                            error(&err);
                            continue;
                        }
                    };
                    let started = wall();
                    acquired += 1;
                    let waited = u64::try_from(asked.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    longest.fetch_max(waited, Ordering::Relaxed);
                    let token = guard.fencing_token().unwrap_or(0);
                    let mut valid_at = None;
                    let check = |valid_at: &mut Option<u64>| {
                        // The time is taken before the check: the lease was
                        // valid at a moment no earlier than it.
                        let at = wall();
                        if !guard.validity().is_zero() {
                            *valid_at = Some(at);
                        }
                    };
                    check(&mut valid_at);
                    // Permit holders share the resource: fencing one
                    // against another would refuse the lawful ones. They
                    // hold for a moment.
                    let value: i64 = if limit > 0 {
                        std::thread::sleep(Duration::from_micros(wall() % 3000));
                        -1
                    } else {
                        read.arg(token).invoke(&mut con).expect("resource read")
                    };
                    if value >= 0 {
                        std::thread::sleep(Duration::from_micros(wall() % 3000));
                        check(&mut valid_at);
                        let _accepted: i64 = write
                            .arg(token)
                            .arg(value + 1)
                            .invoke(&mut con)
                            .expect("resource write");
                    }
                    check(&mut valid_at);
                    if let Some(end) = valid_at {
                        let line = format!("H {t} {started} {end}\n");
                        let _ = out.lock().expect("out").write_all(line.as_bytes());
                    }
                    if let Err(err) = guard.unlock() {
                        error(&err);
                    }
                }
                acquired
            })
        })
        .collect();
    let mut out = std::io::stdout();
    for (t, handle) in handles.into_iter().enumerate() {
        let acquired = handle.join().expect("worker thread");
        let _ = writeln!(out, "S {t} {acquired}");
    }
    for (kind, count) in errors.lock().expect("errors").iter() {
        let _ = writeln!(out, "E {kind} {count}");
    }
    let _ = writeln!(out, "W {}", longest.load(Ordering::Relaxed));
    drop(client);
    let ours = |name: &str| name.starts_with("redmutex-sub") || name.starts_with("redmutex-dog");
    let left = || -> Vec<String> {
        std::fs::read_dir("/proc/self/task")
            .map(|tasks| {
                tasks
                    .flatten()
                    .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
                    .map(|n| n.trim().to_owned())
                    .filter(|n| ours(n))
                    .collect()
            })
            .unwrap_or_default()
    };
    let clean = wait_until(redmutex::DEFAULT_TIMEOUT * 3, || left().is_empty());
    let _ = if clean {
        writeln!(out, "T ok")
    } else {
        writeln!(out, "T left {}", left().join(","))
    };
    let _ = out.flush();
}

/// How a chaos run is shaped.
#[derive(Clone, Debug)]
pub struct Config {
    /// 0: the lock; N: permits of a semaphore of N.
    pub limit: u32,
    pub processes: usize,
    pub threads: usize,
    pub secs: f64,
    pub seed: u64,
}

/// What a chaos run found.
#[derive(Debug, Default)]
pub struct Report {
    pub acquisitions: u64,
    pub accepted_writes: u64,
    pub counter: u64,
    pub fenced_rejections: u64,
    pub lost_updates: u64,
    pub overlaps: Vec<String>,
    /// The most holds that claimed validity at one moment.
    pub most_at_once: usize,
    pub errors: BTreeMap<String, u64>,
    pub longest_wait: Duration,
    /// Per worker process never killed: its threads' acquisitions.
    pub survivors: Vec<Vec<u64>>,
    pub faults: BTreeMap<&'static str, u64>,
    pub leftovers: Vec<String>,
    pub crashed: Vec<String>,
}

impl Report {
    /// Every property the run must keep, as failures.
    pub fn failures(&self) -> Vec<String> {
        let mut failures = Vec::new();
        if self.lost_updates > 0 {
            failures.push(format!("{} lost updates past fencing", self.lost_updates));
        }
        failures.extend(self.overlaps.iter().cloned());
        for (process, threads) in self.survivors.iter().enumerate() {
            if threads.contains(&0) {
                failures.push(format!(
                    "a thread of worker {process} made no progress: {threads:?}"
                ));
            }
        }
        failures.extend(self.leftovers.iter().cloned());
        failures.extend(self.crashed.iter().cloned());
        failures
    }
}

struct Worker {
    child: Child,
    reader: Option<std::thread::JoinHandle<Vec<String>>>,
    killed: bool,
    stopped: bool,
}

/// Signals a worker; one that already ended is no error here.
fn signal(pid: u32, name: &str) {
    let _ = super::signal(pid, name);
}

/// Runs the chaos: `spawn(lock_url, resource_url, threads, secs, limit)`
/// gives the command of one worker process (the test binary or the
/// example, run again in worker mode).
pub fn run(config: &Config, spawn: &dyn Fn(&str, &str, usize, f64, u32) -> Command) -> Report {
    let server = RedisServer::start();
    let resource = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let mut dice = Dice(config.seed | 1);
    let mut report = Report::default();
    let start_worker = |secs: f64| -> Worker {
        let mut child = spawn(
            &proxy.url(),
            &resource.url(),
            config.threads,
            secs,
            config.limit,
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn a worker");
        let stdout = child.stdout.take().expect("stdout");
        let reader = std::thread::spawn(move || {
            BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
                .collect::<Vec<String>>()
        });
        Worker {
            child,
            reader: Some(reader),
            killed: false,
            stopped: false,
        }
    };
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(config.secs);
    let mut workers: Vec<Worker> = (0..config.processes)
        .map(|_| start_worker(config.secs))
        .collect();
    let fault = |name: &'static str, report: &mut Report| {
        *report.faults.entry(name).or_default() += 1;
    };
    let (acquire_lua, release_lua) = if config.limit > 0 {
        (
            include_str!("../../lua/sem_acquire.lua"),
            include_str!("../../lua/sem_release.lua"),
        )
    } else {
        (
            include_str!("../../lua/acquire.lua"),
            include_str!("../../lua/release.lua"),
        )
    };
    let release_sha = redis::Script::new(release_lua).get_hash().to_owned();
    let acquire_sha = redis::Script::new(acquire_lua).get_hash().to_owned();
    // The controller: one fault every 100-400 ms.
    while Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100 + dice.below(300)));
        let left = until
            .saturating_duration_since(Instant::now())
            .as_secs_f64();
        match dice.below(100) {
            0..=24 => {
                // Stop a worker for 0.1-1.5 s: longer than the lease.
                let w = dice.below(workers.len() as u64) as usize;
                if !workers[w].killed {
                    let pid = workers[w].child.id();
                    signal(pid, "STOP");
                    workers[w].stopped = true;
                    std::thread::sleep(Duration::from_millis(100 + dice.below(1400)));
                    signal(pid, "CONT");
                    workers[w].stopped = false;
                    fault("SIGSTOP/SIGCONT", &mut report);
                }
            }
            25..=29 if left > 2.0 => {
                let w = dice.below(workers.len() as u64) as usize;
                if !workers[w].killed {
                    signal(workers[w].child.id(), "KILL");
                    workers[w].killed = true;
                    workers.push(start_worker(left));
                    fault("SIGKILL", &mut report);
                }
            }
            30..=41 => {
                let _: redis::RedisResult<()> = redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("TYPE")
                    .arg("normal")
                    .arg("SKIPME")
                    .arg("yes")
                    .query(&mut server.conn());
                fault("CLIENT KILL", &mut report);
            }
            42..=49 => {
                let _: redis::RedisResult<()> = redis::cmd("DEBUG")
                    .arg("SLEEP")
                    .arg(0.05 + dice.below(250) as f64 / 1000.0)
                    .query(&mut server.conn());
                fault("DEBUG SLEEP", &mut report);
            }
            50..=57 => {
                let _: redis::RedisResult<()> =
                    redis::cmd("SCRIPT").arg("FLUSH").query(&mut server.conn());
                fault("SCRIPT FLUSH", &mut report);
            }
            58..=71 => {
                let pattern = match dice.below(3) {
                    0 => "NX".to_owned(),
                    1 => acquire_sha.clone(),
                    _ => release_sha.clone(),
                };
                proxy.lose_reply(&pattern, 1 + dice.below(3) as u32);
                fault("lost reply", &mut report);
            }
            72..=79 => {
                proxy.reset_all();
                fault("connection reset", &mut report);
            }
            80..=87 => {
                proxy.set_latency(
                    Duration::from_millis(dice.below(40)),
                    Duration::from_millis(dice.below(40)),
                );
                std::thread::sleep(Duration::from_millis(200 + dice.below(500)));
                proxy.set_latency(Duration::ZERO, Duration::ZERO);
                fault("latency", &mut report);
            }
            88..=93 => {
                proxy.blackhole(true);
                std::thread::sleep(Duration::from_millis(100 + dice.below(900)));
                proxy.blackhole(false);
                fault("blackhole", &mut report);
            }
            _ => {
                proxy.stall_new(true);
                std::thread::sleep(Duration::from_millis(100 + dice.below(500)));
                proxy.stall_new(false);
                fault("stalled handshakes", &mut report);
            }
        }
    }
    proxy.heal();
    // Workers end by themselves; a stopped one is continued first.
    let mut holds: Vec<(u64, u64, String)> = Vec::new();
    for (w, worker) in workers.iter_mut().enumerate() {
        if worker.stopped {
            signal(worker.child.id(), "CONT");
        }
        let finished = wait_until(Duration::from_secs(30), || {
            matches!(worker.child.try_wait(), Ok(Some(_)))
        });
        if !finished {
            let _ = worker.child.kill();
            report.crashed.push(format!("worker {w} did not finish"));
        }
        let status = worker.child.wait().ok();
        let lines = worker
            .reader
            .take()
            .and_then(|r| r.join().ok())
            .unwrap_or_default();
        if !worker.killed && !status.is_some_and(|s| s.success()) {
            report
                .crashed
                .push(format!("worker {w} ended with {status:?}"));
        }
        let mut threads = Vec::new();
        let mut held = 0u64;
        for line in &lines {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["H", t, start, end] => {
                    held += 1;
                    if let (Ok(start), Ok(end)) = (start.parse(), end.parse()) {
                        holds.push((start, end, format!("worker {w} thread {t}")));
                    }
                }
                ["S", _, n] => threads.push(n.parse().unwrap_or(0)),
                ["E", kind, n] => {
                    *report.errors.entry((*kind).to_owned()).or_default() += n.parse().unwrap_or(0);
                }
                ["W", nanos] => {
                    let wait = Duration::from_nanos(nanos.parse().unwrap_or(0));
                    report.longest_wait = report.longest_wait.max(wait);
                }
                ["T", "left", names] => report
                    .leftovers
                    .push(format!("worker {w} left threads {names}")),
                _ => {}
            }
        }
        // A killed worker printed no summary: its holds count.
        report.acquisitions += if threads.is_empty() {
            held
        } else {
            threads.iter().sum::<u64>()
        };
        if !worker.killed {
            report.survivors.push(threads);
        }
    }
    let allowed = config.limit.max(1) as usize;
    let (most, excess) = most_at_once(&holds, allowed);
    report.most_at_once = most;
    report.overlaps.extend(excess);
    let mut con = resource.conn();
    let get = |con: &mut redis::Connection, key: &str| -> u64 {
        redis::cmd("GET")
            .arg(key)
            .query::<Option<u64>>(con)
            .ok()
            .flatten()
            .unwrap_or(0)
    };
    report.counter = get(&mut con, "counter");
    report.accepted_writes = get(&mut con, "accepted");
    report.fenced_rejections = get(&mut con, "rejected");
    report.lost_updates = report.accepted_writes.saturating_sub(report.counter);
    // Nothing of the crate left on the lock server: the lock key and the
    // release markers expire or are released, subscriptions and
    // connections are gone. (The fencing counter stays, by design.)
    let channel = redmutex::release_channel(KEY);
    let fence = redmutex::fence_key(KEY);
    let clean = wait_until(Duration::from_secs(15), || {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*")
            .query(&mut server.conn())
            .unwrap_or_default();
        let subscribers = super::numsub(&server, &channel);
        let clients: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query(&mut server.conn())
            .unwrap_or_default();
        keys.iter().all(|k| *k == fence) && subscribers == 0 && clients.lines().count() <= 1
    });
    if !clean {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*")
            .query(&mut server.conn())
            .unwrap_or_default();
        let clients: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query(&mut server.conn())
            .unwrap_or_default();
        report.leftovers.push(format!(
            "left on the lock server: keys {keys:?}, {} subscribers, clients:\n{clients}",
            super::numsub(&server, &channel)
        ));
    }
    drop(proxy);
    report
}

/// The most holds (start, end, who) that overlap at one moment, and a line
/// for each hold that began while `allowed` others were still valid. A
/// hold ending at the very moment another starts does not overlap it.
pub fn most_at_once(holds: &[(u64, u64, String)], allowed: usize) -> (usize, Vec<String>) {
    let mut holds: Vec<&(u64, u64, String)> = holds.iter().collect();
    holds.sort();
    // Ends of the holds still open, earliest first.
    let mut open: Vec<&(u64, u64, String)> = Vec::new();
    let mut most = 0;
    let mut excess = Vec::new();
    for hold in holds {
        open.retain(|other| other.1 > hold.0);
        if open.len() >= allowed {
            let others: Vec<String> = open
                .iter()
                .map(|o| {
                    format!(
                        "{} (valid until {}, {} µs on)",
                        o.2,
                        o.1,
                        (o.1 - hold.0) / 1000
                    )
                })
                .collect();
            excess.push(format!(
                "{} held from {} while {} others still claimed validity: {}",
                hold.2,
                hold.0,
                open.len(),
                others.join(", ")
            ));
        }
        open.push(hold);
        most = most.max(open.len());
    }
    (most, excess)
}

/// The report as Markdown, for the example and the test's log.
pub fn render(config: &Config, report: &Report, took: Duration) -> String {
    let mut out = String::new();
    let errors: Vec<String> = report
        .errors
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    let faults: Vec<String> = report
        .faults
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    let survivors: Vec<u64> = report.survivors.iter().flatten().copied().collect();
    let (min, max) = (
        survivors.iter().min().copied().unwrap_or(0),
        survivors.iter().max().copied().unwrap_or(0),
    );
    let what = if config.limit > 0 {
        format!("a fenced semaphore of {} permits", config.limit)
    } else {
        "one fenced lock".to_owned()
    };
    out.push_str(&format!(
        "chaos: {} processes x {} threads, {what} (ttl {:?}), {:.0} s (took {:.1} s), seed {}\n\n",
        config.processes,
        config.threads,
        TTL,
        config.secs,
        took.as_secs_f64(),
        config.seed
    ));
    out.push_str("| figure | value |\n|---|---|\n");
    for (name, value) in [
        ("acquisitions", report.acquisitions.to_string()),
        (
            "accepted writes (= counter)",
            format!("{} ({})", report.accepted_writes, report.counter),
        ),
        ("fenced rejections", report.fenced_rejections.to_string()),
        ("lost updates", report.lost_updates.to_string()),
        (
            "holds begun with the limit's worth still valid",
            report.overlaps.len().to_string(),
        ),
        (
            "most valid holders at once",
            format!("{} (limit {})", report.most_at_once, config.limit.max(1)),
        ),
        (
            "errors by kind",
            if errors.is_empty() {
                "none".into()
            } else {
                errors.join(", ")
            },
        ),
        (
            "longest wait in lock()",
            format!("{:?}", report.longest_wait),
        ),
        ("acquisitions per surviving thread", format!("{min}–{max}")),
        ("faults injected", faults.join(", ")),
        (
            "left behind",
            if report.leftovers.is_empty() {
                "nothing".into()
            } else {
                report.leftovers.join("; ")
            },
        ),
    ] {
        out.push_str(&format!("| {name} | {value} |\n"));
    }
    out
}
