//! The chaos run shared by `tests/chaos.rs` and `examples/measure/chaos.rs`:
//! worker processes × threads take one lock (half of the threads fenced,
//! doing a read-modify-write on a protected resource that refuses stale
//! fencing tokens; the others hold only, handing their lease over between
//! them), while a controller stops, continues and kills workers and
//! injects the faults of the [`Deployment`] the lock lives on:
//!
//! * [`Deployment::Single`]: one server behind a fault proxy: `CLIENT
//!   KILL`, `DEBUG SLEEP`, `SCRIPT FLUSH`, lost replies, resets, latency,
//!   blackholes, stalled handshakes.
//! * [`Deployment::RedLock`]: 5 servers, each behind a proxy: 2 of them
//!   blackholed at once for seconds (a minority down), and lost replies,
//!   resets, latency, `DEBUG SLEEP`, stalled handshakes on single nodes.
//!   RedLock has no fencing tokens: its workers hold without the resource.
//! * [`Deployment::Cluster`]: 3 primaries with a replica each: the lock
//!   key's slot (with its fencing counter) migrated to another primary,
//!   `CLUSTER FAILOVER FORCE` of its primary, `CLIENT KILL` and `DEBUG
//!   SLEEP` on its primary, `SCRIPT FLUSH` on every node.
//! * [`Deployment::Sentinel`]: a primary and a replica behind proxies, 3
//!   sentinels: replication cut, writes made, the primary SIGKILLed and the
//!   replica promoted without them (increments of the fencing counter
//!   lost), and `CLIENT KILL`, `DEBUG SLEEP`, `SCRIPT FLUSH`, lost
//!   replies, resets and latency on the primary.
//!
//! With a limit N, the workers take permits of one semaphore instead
//! (fenced, half of them watched) and hold them for a moment. A quarter of
//! the threads end every hold by dropping it (the release written behind)
//! instead of `unlock()`.
//!
//! What it checks afterwards: no update was lost past fencing (the
//! resource's counter equals its accepted writes); no fencing token was
//! given out twice, and none was lower than one whose acquisition had
//! returned before it was asked for; no `MOVED`, `ASK` or `TRYAGAIN`
//! reached a caller; never more than one (or N) holds at once while their
//! holders still reported `validity() > 0`, except from the start of a
//! failover until a lease after it (a lock not yet replicated is lost
//! there and a second holder can take it: documented; fencing is the
//! answer); RedLock keeps its rate while a minority is blackholed and its
//! `unlock()` does not wait for them; every
//! worker that was never killed kept making progress; and nothing of the
//! crate is left (lock keys, subscriptions, connections; each worker checks
//! its threads before it exits).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redmutex::{DistributedLock, Error, LockClient, LockOptions, RedLock, RedLockGuard, Semaphore};

use super::{
    ClusterNode, Dice, FaultProxy, ProxiedSentinelSet, RedisCluster, RedisServer, SentinelSet,
    wait_until,
};
use redmutex::Lease;

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

/// The error kind of a redirection that reached a caller.
pub const RAW_REDIRECTION: &str = "raw-redirection";
/// A write given up as `OutcomeUnknown` because its slot kept moving.
pub const UNRESOLVED_REDIRECTION: &str = "redirection-outcome-unknown";

/// Marks an overlap that began inside a failover's window.
const IN_A_FAILOVER: &str = "inside a failover's window";

/// Marks an overlap that began while two data nodes were primaries.
const WITH_TWO_PRIMARIES: &str = "while two nodes were primaries";

/// The longest `unlock()` allowed while a minority of RedLock nodes is
/// unreachable: it returns at a majority, within the node timeout; this
/// leaves room for a loaded machine, and catches an unlock that waits
/// for the unreachable nodes' I/O timeouts (seconds).
const LONGEST_UNLOCK: Duration = Duration::from_secs(1);

/// The least time inside and outside the fault windows for their rates
/// to be compared.
const MIN_SAMPLE: Duration = Duration::from_secs(3);

/// Nanoseconds on the wall clock, comparable between processes.
fn wall() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// The kind of error a worker met, as the report counts it.
pub fn kind(err: &Error) -> &'static str {
    let redirection =
        |e: &redis::RedisError| matches!(e.code(), Some("MOVED" | "ASK" | "TRYAGAIN"));
    match err {
        Error::Redis(e) if redirection(e) => RAW_REDIRECTION,
        // A write whose slot kept moving past the resend bound: stated,
        // but the target is none of these either.
        Error::OutcomeUnknown { source, .. } if redirection(source) => UNRESOLVED_REDIRECTION,
        Error::Redis(e) if e.code() == Some("CLUSTERDOWN") => "cluster-down",
        Error::Timeout { .. } => "timeout",
        Error::NotHeld { .. } => "not-held",
        Error::OutcomeUnknown { .. } => "outcome-unknown",
        Error::Redis(_) => "redis",
        Error::Pool(_) => "pool",
        Error::WrongType { .. } => "wrong-type",
        Error::FenceCounter { .. } => "fence-counter",
        Error::NotReplicated { .. } => "not-replicated",
        Error::NoReplicas { .. } => "no-replicas",
        Error::Quorum { .. } => "quorum",
        Error::QuorumLost { .. } => "quorum-lost",
        Error::NodesUnreachable { .. } => "nodes-unreachable",
        _ => "other",
    }
}

/// What a worker thread holds.
enum Hold {
    Lock(redmutex::LockGuard),
    // Boxed: a permit is much larger than a guard.
    Permit(Box<redmutex::Permit>),
    RedLock(Box<RedLockGuard>),
}

impl Hold {
    fn validity(&self) -> Duration {
        match self {
            Hold::Lock(guard) => guard.validity(),
            Hold::Permit(permit) => permit.validity(),
            Hold::RedLock(guard) => guard.validity(),
        }
    }

    fn fencing_token(&self) -> Option<u64> {
        match self {
            Hold::Lock(guard) => guard.fencing_token(),
            Hold::Permit(permit) => permit.fencing_token(),
            Hold::RedLock(_) => None,
        }
    }

    fn unlock(self) -> Result<(), Error> {
        match self {
            Hold::Lock(guard) => guard.unlock().map(|_| ()),
            Hold::Permit(permit) => permit.release(),
            Hold::RedLock(guard) => guard.unlock().map(drop),
        }
    }
}

/// Which deployment the lock lives on, and so which faults the
/// controller injects (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deployment {
    Single,
    RedLock,
    Cluster,
    Sentinel,
}

impl Deployment {
    pub const ALL: [Deployment; 4] = [
        Deployment::Single,
        Deployment::RedLock,
        Deployment::Cluster,
        Deployment::Sentinel,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Deployment::Single => "single",
            Deployment::RedLock => "redlock",
            Deployment::Cluster => "cluster",
            Deployment::Sentinel => "sentinel",
        }
    }

    pub fn parse(name: &str) -> Option<Deployment> {
        Deployment::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Whether its locks have fencing tokens (RedLock's do not).
    fn fenced(self) -> bool {
        self != Deployment::RedLock
    }
}

/// What a worker is told to lock on: `deployment[+mr]=url,url,...`
/// (`+mr`: with `min_replicas(1, 100 ms)`).
struct Target {
    deployment: Deployment,
    min_replicas: bool,
    urls: Vec<String>,
}

impl Target {
    fn to_arg(&self) -> String {
        format!(
            "{}{}={}",
            self.deployment.name(),
            if self.min_replicas { "+mr" } else { "" },
            self.urls.join(",")
        )
    }

    fn parse(arg: &str) -> Option<Target> {
        let (kind, urls) = arg.split_once('=')?;
        let (name, min_replicas) = match kind.strip_suffix("+mr") {
            Some(name) => (name, true),
            None => (kind, false),
        };
        Some(Target {
            deployment: Deployment::parse(name)?,
            min_replicas,
            urls: urls.split(',').map(str::to_owned).collect(),
        })
    }

    /// The lock clients: one, or one per RedLock node.
    fn clients(&self) -> Vec<LockClient> {
        match self.deployment {
            Deployment::Single => vec![LockClient::open(&self.urls[0]).expect("lock client")],
            Deployment::RedLock => self
                .urls
                .iter()
                .map(|url| LockClient::open(url).expect("RedLock node client"))
                .collect(),
            Deployment::Cluster => {
                vec![
                    LockClient::builder()
                        .cluster(&self.urls)
                        .build()
                        .expect("cluster lock client"),
                ]
            }
            Deployment::Sentinel => vec![
                LockClient::builder()
                    .sentinel(&self.urls, SentinelSet::MASTER)
                    .build()
                    .expect("sentinel lock client"),
            ],
        }
    }
}

/// How long a RedLock node may take: 10 % of the lease (the default 5 %
/// is 25 ms, which a loaded 2-core machine misses without any fault).
const NODE_TIMEOUT: Duration = Duration::from_millis(50);

/// One worker process: `threads` threads loop for `secs` (taking permits
/// of a semaphore of `limit` when it is not 0), each printing a line per
/// hold (`H thread asked acquired valid_until token unlocked unlock_nanos`:
/// wall nanoseconds when it asked, when it got it, and the last moment it
/// saw `validity() > 0`, 0 if never; the fencing token, 0 if none; when
/// it called `unlock()` and how long that took), then a summary per thread (`S thread acquisitions`),
/// errors (`E kind count`), the longest wait (`W nanos`) and whether the
/// crate's threads were gone after the client was dropped (`T ok` or `T
/// left ...`). `target` is what [`run`] gave (see `Target`).
pub fn worker(target: &str, resource_url: &str, threads: usize, secs: f64, limit: u32) {
    let target = Target::parse(target).expect("a chaos target");
    let clients = target.clients();
    let client = clients[0].clone();
    let redlock = (target.deployment == Deployment::RedLock).then(|| {
        let options = redmutex::Options::default()
            .ttl(TTL)
            .wait(Duration::from_secs(5));
        RedLock::with_options(clients.clone(), KEY, options.node_timeout(NODE_TIMEOUT))
            .expect("RedLock")
    });
    let fenced = limit == 0 && target.deployment.fenced();
    let resource = redis::Client::open(resource_url).expect("resource");
    let read = redis::Script::new(RESOURCE_READ);
    let write = redis::Script::new(RESOURCE_WRITE);
    let out = Arc::new(Mutex::new(std::io::stdout()));
    let errors: Arc<Mutex<BTreeMap<&'static str, u64>>> = Arc::default();
    let longest = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            // Half the lock's threads fenced, doing the read-modify-write;
            // the others hold only, and their leases pass between them by
            // handoff (a fenced lease never does). A watchdog on half of each.
            let fencing = t % 2 == 0;
            // A quarter (unfenced, unwatched) end their holds by drop: the
            // release written behind, its reply read by the next request.
            let by_drop = t % 4 == 3;
            let mut options = LockOptions::default()
                .ttl(TTL)
                .wait(Duration::from_secs(5))
                .fencing(fencing || limit > 0)
                .watchdog(t % 4 == 1 || t % 4 == 2);
            if target.min_replicas {
                options = options.min_replicas(1, Duration::from_millis(100));
            }
            let semaphore = (limit > 0).then(|| {
                // Half unfenced: their permits go straight to a queued
                // thread of the same process (handoff), the rest each get
                // a token of their own from Redis.
                Semaphore::with_options(
                    &client,
                    KEY,
                    limit,
                    options.for_semaphore().fencing(t % 2 == 0),
                )
            });
            let lock = DistributedLock::with_options(&client, KEY, options);
            let redlock = redlock.clone();
            let take = move || -> Result<Hold, Error> {
                match (&semaphore, &redlock) {
                    (Some(semaphore), _) => semaphore
                        .acquire()
                        .map(|permit| Hold::Permit(Box::new(permit))),
                    (None, Some(redlock)) => {
                        redlock.lock().map(|guard| Hold::RedLock(Box::new(guard)))
                    }
                    (None, None) => lock.lock().map(Hold::Lock),
                }
            };
            let fenced = fenced && fencing;
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
                    let asked_at = wall();
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
                    // against another would refuse the lawful ones. They,
                    // unfenced and RedLock holders (no tokens), hold for a
                    // moment.
                    let value: i64 = if fenced {
                        read.arg(token).invoke(&mut con).expect("resource read")
                    } else {
                        std::thread::sleep(Duration::from_micros(wall() % 3000));
                        -1
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
                    let unlocked_at = wall();
                    let unlocking = Instant::now();
                    if by_drop {
                        // Written behind: its outcome is only logged.
                        drop(guard);
                    } else if let Err(err) = guard.unlock() {
                        error(&err);
                    }
                    let unlock = unlocking.elapsed().as_nanos();
                    let line = format!(
                        "H {t} {asked_at} {started} {} {token} {unlocked_at} {unlock}\n",
                        valid_at.unwrap_or(0)
                    );
                    let _ = out.lock().expect("out").write_all(line.as_bytes());
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
    drop((client, clients, redlock));
    // Every thread a client starts.
    let ours = |name: &str| name.starts_with("redmutex-");
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
    pub deployment: Deployment,
    /// Lock with `min_replicas(1, 100 ms)` (Cluster and Sentinel).
    pub min_replicas: bool,
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
    /// From the start of each failover (Cluster, Sentinel) until a lease
    /// after the new primary was promoted: two holders at once are
    /// possible there (a lock not yet replicated is lost; documented),
    /// and only there.
    pub failovers: Vec<(u64, u64)>,
    /// Sentinel: each time two data nodes both said they were the primary
    /// (`ROLE`, polled on the nodes themselves), from when it was seen
    /// until it ended (wall nanoseconds). The controller never makes one
    /// (a killed primary comes back as a replica); Sentinel failing over a
    /// healthy primary on its own does (see `sentinel_config`). Two
    /// primaries are the deployment's split brain: no client can keep one
    /// holder then, so overlaps that begin in one (or a lease after) are
    /// allowed, as in a failover's window.
    pub two_primaries: Vec<(u64, u64)>,
    pub acquisitions: u64,
    pub accepted_writes: u64,
    pub counter: u64,
    pub fenced_rejections: u64,
    pub lost_updates: u64,
    /// Fencing tokens given out, and how many of them repeated one given
    /// before or were lower than one whose acquisition had returned before
    /// they were asked for.
    pub tokens: u64,
    pub tokens_repeated: u64,
    pub tokens_backwards: u64,
    pub token_failures: Vec<String>,
    pub overlaps: Vec<String>,
    /// The most holds that claimed validity at one moment.
    pub most_at_once: usize,
    pub errors: BTreeMap<String, u64>,
    pub longest_wait: Duration,
    /// Not counting an `unlock()` its process spent stopped.
    pub longest_unlock: Duration,
    /// The deployment's long fault (RedLock: 2 of 5 nodes blackholed), its
    /// windows in wall nanoseconds, and the acquisitions and longest
    /// `unlock()` begun inside and outside them.
    pub window: Option<&'static str>,
    pub windows: Vec<(u64, u64)>,
    pub in_windows: (u64, Duration, Duration),
    pub outside_windows: (u64, Duration, Duration),
    /// Per worker process never killed: its threads' acquisitions.
    pub survivors: Vec<Vec<u64>>,
    pub faults: BTreeMap<&'static str, u64>,
    /// Each fault as it was done (wall nanoseconds when it ended).
    pub fault_log: Vec<(u64, &'static str)>,
    /// Faults the controller could not inject (the deployment would not
    /// settle, a migration step was refused): not failures of the crate.
    pub fault_errors: Vec<String>,
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
        failures.extend(self.token_failures.iter().cloned());
        for kind in [RAW_REDIRECTION, UNRESOLVED_REDIRECTION] {
            if let Some(n) = self.errors.get(kind) {
                failures.push(format!("{n} MOVED/ASK/TRYAGAIN reached callers ({kind})"));
            }
        }
        // Only a failover may make two holders (and only on Cluster and
        // Sentinel, which do not promise otherwise), or two nodes that are
        // primaries at once (seen on the servers themselves: no client can
        // make one, so it is the deployment's split brain, which no lock
        // survives; the report counts them).
        failures.extend(
            self.overlaps
                .iter()
                .filter(|o| !o.contains(IN_A_FAILOVER) && !o.contains(WITH_TWO_PRIMARIES))
                .cloned(),
        );
        if let Some(window) = self.window {
            let (inside, outside) = (self.in_windows, self.outside_windows);
            let rate =
                |(n, time, _): (u64, Duration, Duration)| n as f64 / time.as_secs_f64().max(1e-9);
            // Only with seconds on both sides to compare: a short run may
            // have little time outside the windows.
            let sampled = inside.1 >= MIN_SAMPLE && outside.1 >= MIN_SAMPLE;
            if sampled && rate(inside) < 0.5 * rate(outside) {
                failures.push(format!(
                    "while {window}: {:.0} acquisitions/s, below half of {:.0}/s outside",
                    rate(inside),
                    rate(outside)
                ));
            }
            if inside.2 > LONGEST_UNLOCK {
                failures.push(format!(
                    "while {window}: an unlock() took {:?} (more than {LONGEST_UNLOCK:?}: it waited for unreachable nodes)",
                    inside.2
                ));
            }
        }
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

    fn fault(&mut self, name: &'static str) {
        *self.faults.entry(name).or_default() += 1;
        self.fault_log.push((wall(), name));
    }

    /// The last fault injected before `at` (wall nanoseconds), and how
    /// long before.
    fn fault_before(&self, at: u64) -> Option<(&'static str, Duration)> {
        self.fault_log
            .iter()
            .rev()
            .find(|(when, _)| *when <= at)
            .map(|(when, name)| (*name, Duration::from_nanos(at - when)))
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

/// Sends `cmd` to `server` on a fresh connection; a fault that does not
/// take (the server is busy failing over) is no error of the run.
fn send(server: &RedisServer, cmd: &mut redis::Cmd) {
    let _: Option<redis::Value> = server.try_query(cmd);
}

/// A fault made by a command to the server itself.
#[derive(Clone, Copy)]
enum ServerFault {
    /// `CLIENT KILL TYPE normal`: every client connection cut.
    ClientKill,
    /// `DEBUG SLEEP` 50-300 ms: below Cluster's node timeout and
    /// Sentinel's down-after (3 s), a stall, not a failover.
    DebugSleep,
    /// `SCRIPT FLUSH`: every script must be loaded again.
    ScriptFlush,
}

/// Makes `fault` on each of `servers` and counts it once.
fn server_fault(
    servers: &[&RedisServer],
    fault: ServerFault,
    dice: &mut Dice,
    report: &mut Report,
) {
    let (mut cmd, name) = match fault {
        ServerFault::ClientKill => {
            let mut cmd = redis::cmd("CLIENT");
            cmd.arg("KILL")
                .arg("TYPE")
                .arg("normal")
                .arg("SKIPME")
                .arg("yes");
            (cmd, "CLIENT KILL")
        }
        ServerFault::DebugSleep => {
            let mut cmd = redis::cmd("DEBUG");
            cmd.arg("SLEEP").arg(0.05 + dice.below(250) as f64 / 1000.0);
            (cmd, "DEBUG SLEEP")
        }
        ServerFault::ScriptFlush => (redis::cmd("SCRIPT").arg("FLUSH").clone(), "SCRIPT FLUSH"),
    };
    for server in servers {
        send(server, &mut cmd);
    }
    report.fault(name);
}

/// A fault held for a random while, then healed.
fn for_a_while(dice: &mut Dice, from_ms: u64, spread_ms: u64, on: impl Fn(bool)) {
    on(true);
    std::thread::sleep(Duration::from_millis(from_ms + dice.below(spread_ms)));
    on(false);
}

/// The proxy faults a client's link can meet, on `proxy`: lost replies of
/// the lock's commands, resets, latency, blackholes and stalled handshakes
/// (`roll` below 42).
fn proxy_fault(
    proxy: &FaultProxy,
    roll: u64,
    dice: &mut Dice,
    shas: &[String; 2],
    report: &mut Report,
) {
    match roll {
        0..=13 => {
            let pattern = match dice.below(3) {
                0 => "NX",
                1 => &shas[0],
                _ => &shas[1],
            };
            proxy.lose_reply(pattern, 1 + dice.below(3) as u32);
            report.fault("lost reply");
        }
        14..=21 => {
            proxy.reset_all();
            report.fault("connection reset");
        }
        22..=29 => {
            let (up, down) = (dice.below(40), dice.below(40));
            for_a_while(dice, 200, 500, |on| {
                let ms = |d| Duration::from_millis(if on { d } else { 0 });
                proxy.set_latency(ms(up), ms(down));
            });
            report.fault("latency");
        }
        30..=35 => {
            for_a_while(dice, 100, 900, |on| proxy.blackhole(on));
            report.fault("blackhole");
        }
        _ => {
            for_a_while(dice, 100, 500, |on| proxy.stall_new(on));
            report.fault("stalled handshakes");
        }
    }
}

/// The servers of one deployment and the faults it takes.
enum Deploy {
    Single {
        server: RedisServer,
        proxy: FaultProxy,
    },
    RedLock {
        nodes: Vec<RedisServer>,
        proxies: Vec<FaultProxy>,
    },
    Cluster {
        cluster: RedisCluster,
        slot: u16,
    },
    Sentinel {
        set: ProxiedSentinelSet,
        last_failover: Option<Instant>,
    },
}

/// A lease (and a margin for a loaded machine) after `at`: until then a
/// holder from before a failover may still claim validity.
fn after_a_lease(at: u64) -> u64 {
    let lease = u64::try_from((TTL + Duration::from_millis(500)).as_nanos()).unwrap_or(u64::MAX);
    at.saturating_add(lease)
}

/// How long Sentinel needs between two failovers of one primary: each
/// sentinel waits twice the failover timeout (5 s) after one it voted in.
const FAILOVER_SPACING: Duration = Duration::from_secs(12);

impl Deploy {
    fn start(deployment: Deployment) -> Deploy {
        match deployment {
            Deployment::Single => {
                let server = RedisServer::start();
                let proxy = FaultProxy::to(&server);
                Deploy::Single { server, proxy }
            }
            Deployment::RedLock => {
                let nodes = RedisServer::start_many(5);
                let proxies = nodes.iter().map(FaultProxy::to).collect();
                Deploy::RedLock { nodes, proxies }
            }
            Deployment::Cluster => {
                let cluster = RedisCluster::start(3, 1);
                let slot = cluster.slot(KEY);
                Deploy::Cluster { cluster, slot }
            }
            Deployment::Sentinel => Deploy::Sentinel {
                set: ProxiedSentinelSet::start(),
                last_failover: None,
            },
        }
    }

    fn target(&self, min_replicas: bool) -> Target {
        let (deployment, urls) = match self {
            Deploy::Single { proxy, .. } => (Deployment::Single, vec![proxy.url()]),
            Deploy::RedLock { proxies, .. } => (
                Deployment::RedLock,
                proxies.iter().map(FaultProxy::url).collect(),
            ),
            Deploy::Cluster { cluster, .. } => (Deployment::Cluster, cluster.urls()),
            Deploy::Sentinel { set, .. } => (Deployment::Sentinel, set.sentinel_urls()),
        };
        Target {
            deployment,
            min_replicas,
            urls,
        }
    }

    /// Injects one fault (`left`: seconds of chaos left).
    fn fault(&mut self, dice: &mut Dice, shas: &[String; 2], left: f64, report: &mut Report) {
        let mut roll = dice.below(100);
        // The deployment's own faults come first, so a short run has each.
        let first = |name| !report.faults.contains_key(name);
        match self {
            Deploy::RedLock { .. } if first("2 of 5 nodes blackholed") => roll = 0,
            Deploy::Cluster { .. } if first("lock slot migrated") => roll = 0,
            Deploy::Cluster { .. } if first("CLUSTER FAILOVER FORCE") => roll = 30,
            Deploy::Sentinel { .. } if first("failover losing writes") => roll = 0,
            _ => {}
        }
        match self {
            Deploy::Single { server, proxy } => match roll {
                0..=16 => server_fault(&[server], ServerFault::ClientKill, dice, report),
                17..=28 => server_fault(&[server], ServerFault::DebugSleep, dice, report),
                29..=40 => server_fault(&[server], ServerFault::ScriptFlush, dice, report),
                _ => proxy_fault(proxy, (roll - 41) * 42 / 59, dice, shas, report),
            },
            Deploy::RedLock { nodes, proxies } => {
                let one = dice.below(nodes.len() as u64) as usize;
                match roll {
                    0..=44 => {
                        // A minority, for seconds: the rate must hold up.
                        let first = dice.below(5) as usize;
                        let second = (first + 1 + dice.below(4) as usize) % 5;
                        let start = wall();
                        for_a_while(dice, 1000, 2500, |on| {
                            proxies[first].blackhole(on);
                            proxies[second].blackhole(on);
                        });
                        report.windows.push((start, wall()));
                        report.fault("2 of 5 nodes blackholed");
                    }
                    45..=54 => server_fault(&[&nodes[one]], ServerFault::DebugSleep, dice, report),
                    55..=59 => {
                        let all: Vec<&RedisServer> = nodes.iter().collect();
                        server_fault(&all, ServerFault::ScriptFlush, dice, report);
                    }
                    60..=64 => server_fault(&[&nodes[one]], ServerFault::ClientKill, dice, report),
                    // RedLock acquires with SET NX, never the acquire script:
                    // its lost replies are of that and of the release.
                    _ => {
                        let shas = [shas[1].clone(), shas[1].clone()];
                        proxy_fault(&proxies[one], (roll - 65) * 42 / 35, dice, &shas, report)
                    }
                }
            }
            Deploy::Cluster { cluster, slot } => {
                let slot = *slot;
                let Some(primary) = cluster.try_primary_for_slot(slot) else {
                    report
                        .fault_errors
                        .push("no primary known for the lock's slot".into());
                    return;
                };
                let server = cluster.node(primary.port);
                match roll {
                    0..=49 => {
                        if !cluster.wait_settled(Duration::from_secs(15)) {
                            report
                                .fault_errors
                                .push("the cluster did not settle".into());
                            return;
                        }
                        // Who serves the slot now that it settled.
                        let Some(primary) = cluster.try_primary_for_slot(slot) else {
                            report
                                .fault_errors
                                .push("no primary for the lock's slot".into());
                            return;
                        };
                        if roll < 30 {
                            let others: Vec<ClusterNode> = cluster
                                .topology()
                                .into_iter()
                                .filter(|n| n.primary && !n.slots.is_empty() && n.id != primary.id)
                                .collect();
                            let Some(to) =
                                others.get(dice.below(others.len().max(1) as u64) as usize)
                            else {
                                report.fault_errors.push("no other primary".into());
                                return;
                            };
                            match cluster.migrate_slot(slot, &primary, to) {
                                Ok(()) => report.fault("lock slot migrated"),
                                Err(e) => report.fault_errors.push(format!("migration: {e}")),
                            }
                        } else {
                            let Some(replica) = cluster.replicas_of(&primary.id).into_iter().next()
                            else {
                                report
                                    .fault_errors
                                    .push("the lock's primary has no replica".into());
                                return;
                            };
                            let began = wall();
                            send(
                                cluster.node(replica.port),
                                redis::cmd("CLUSTER").arg("FAILOVER").arg("FORCE"),
                            );
                            let promoted = wait_until(Duration::from_secs(15), || {
                                cluster
                                    .try_primary_for_slot(slot)
                                    .is_some_and(|p| p.port == replica.port)
                            });
                            report.failovers.push((began, after_a_lease(wall())));
                            if promoted {
                                report.fault("CLUSTER FAILOVER FORCE");
                            } else {
                                report.fault_errors.push(
                                    "CLUSTER FAILOVER FORCE did not promote the replica".into(),
                                );
                            }
                        }
                    }
                    50..=64 => server_fault(&[server], ServerFault::ClientKill, dice, report),
                    65..=79 => server_fault(&[server], ServerFault::DebugSleep, dice, report),
                    _ => {
                        let all: Vec<&RedisServer> = cluster.nodes().iter().collect();
                        server_fault(&all, ServerFault::ScriptFlush, dice, report);
                    }
                }
            }
            Deploy::Sentinel { set, last_failover } => {
                let Some(primary) = set.primary() else {
                    report
                        .fault_errors
                        .push("no sentinel names a primary".into());
                    return;
                };
                let spaced = last_failover.is_none_or(|at| at.elapsed() > FAILOVER_SPACING);
                match roll {
                    0..=29 if spaced && left > 5.0 => {
                        *last_failover = Some(Instant::now());
                        let cut = Duration::from_millis(100 + dice.below(500));
                        let counter = fence_key();
                        let began = wall();
                        let outcome = set.fail_over_losing_writes(cut, &counter);
                        report.failovers.push((began, after_a_lease(wall())));
                        match outcome {
                            Ok(lost) => {
                                report.fault("failover losing writes");
                                if lost.replication > 0 {
                                    report.fault("failover that lost writes");
                                }
                                if lost.counter {
                                    report.fault("failover that lost fencing increments");
                                }
                            }
                            Err(e) => report.fault_errors.push(format!("failover: {e}")),
                        }
                    }
                    0..=39 => server_fault(
                        &[&set.nodes[primary]],
                        ServerFault::ClientKill,
                        dice,
                        report,
                    ),
                    40..=54 => server_fault(
                        &[&set.nodes[primary]],
                        ServerFault::DebugSleep,
                        dice,
                        report,
                    ),
                    55..=64 => server_fault(
                        &[&set.nodes[primary]],
                        ServerFault::ScriptFlush,
                        dice,
                        report,
                    ),
                    // No blackholes or stalls: longer than down-after, they
                    // would be failovers the spacing does not allow.
                    _ => proxy_fault(
                        &set.proxies[primary],
                        (roll - 65) * 30 / 35,
                        dice,
                        shas,
                        report,
                    ),
                }
            }
        }
    }

    fn heal(&self) {
        match self {
            Deploy::Single { proxy, .. } => proxy.heal(),
            Deploy::RedLock { proxies, .. } => proxies.iter().for_each(FaultProxy::heal),
            Deploy::Cluster { .. } => {}
            Deploy::Sentinel { set, .. } => set.proxies.iter().for_each(FaultProxy::heal),
        }
    }

    /// Every server that must be left clean.
    fn servers(&self) -> Vec<&RedisServer> {
        match self {
            Deploy::Single { server, .. } => vec![server],
            Deploy::RedLock { nodes, .. } => nodes.iter().collect(),
            Deploy::Cluster { cluster, .. } => cluster.nodes().iter().collect(),
            Deploy::Sentinel { set, .. } => set.nodes.iter().collect(),
        }
    }
}

/// The fencing counter of [`KEY`] (a key without a hash tag), as
/// ARCHITECTURE.md names it: `{KEY}:fence`.
fn fence_key() -> String {
    format!("{{{KEY}}}:fence")
}

/// What of the crate is left on `server`, if anything: keys other than the
/// fencing counter (the lock key and release markers expire or are
/// released), subscriptions, connections (other than sentinels' and
/// replication links).
fn left_on(server: &RedisServer) -> Option<String> {
    let channel = format!("redmutex:released:{{{KEY}}}");
    let fence = fence_key();
    let silent = || Some(format!("{} did not answer", server.port()));
    let Some(keys) = server.try_query::<Vec<String>>(redis::cmd("KEYS").arg("*")) else {
        return silent();
    };
    let keys: Vec<String> = keys.into_iter().filter(|k| *k != fence).collect();
    let subscribers = super::numsub(server, &channel) + super::shard_numsub(server, &channel);
    let Some(clients) = server.try_query::<String>(redis::cmd("CLIENT").arg("LIST")) else {
        return silent();
    };
    // Not the crate's: sentinels, replication links (flags S and M), the
    // connection MIGRATE keeps to a target for 10 s, and this one.
    let clients: Vec<&str> = clients
        .lines()
        .filter(|c| {
            !c.contains("name=sentinel-")
                && !c.contains(" flags=S ")
                && !c.contains(" flags=M ")
                && !c.contains("cmd=restore-asking")
                // This one: `client|list` (`client` before Redis 7.0).
                && !c.contains("cmd=client|list")
                && !c.contains(" cmd=client ")
        })
        .collect();
    (!keys.is_empty() || subscribers > 0 || !clients.is_empty()).then(|| {
        format!(
            "left on {}: keys {keys:?}, {subscribers} subscribers, clients:\n{}",
            server.port(),
            clients.join("\n")
        )
    })
}

/// Polls `ROLE` on each data node of a Sentinel deployment (directly, not
/// through its proxy) and records when more than one says `master`.
struct PrimaryWatch {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(u64, u64)>>,
}

impl PrimaryWatch {
    fn start(ports: Vec<u16>) -> PrimaryWatch {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let is_primary = |port: u16| -> bool {
                let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}/")) else {
                    return false;
                };
                let Ok(mut con) = client.get_connection_with_timeout(Duration::from_millis(200))
                else {
                    return false;
                };
                if con
                    .set_read_timeout(Some(Duration::from_millis(500)))
                    .is_err()
                {
                    return false;
                }
                matches!(
                    redis::cmd("ROLE").query::<Vec<redis::Value>>(&mut con).as_deref(),
                    Ok([redis::Value::BulkString(role), ..]) if role.as_slice() == b"master"
                )
            };
            let mut windows: Vec<(u64, u64)> = Vec::new();
            let mut open: Option<u64> = None;
            while !stopped.load(Ordering::SeqCst) {
                let seen = wall();
                let primaries = ports.iter().filter(|p| is_primary(**p)).count();
                match (primaries > 1, open) {
                    (true, None) => open = Some(seen),
                    (false, Some(from)) => {
                        windows.push((from, seen));
                        open = None;
                    }
                    _ => {}
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            if let Some(from) = open {
                windows.push((from, wall()));
            }
            windows
        });
        PrimaryWatch { stop, thread }
    }

    /// Stops polling (its connections are closed by then); the windows
    /// with two primaries.
    fn stop(self) -> Vec<(u64, u64)> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.join().unwrap_or_default()
    }
}

/// Runs the chaos: `spawn(target, resource_url, threads, secs, limit)`
/// gives the command of one worker process (the test binary or the
/// example, run again in worker mode, which calls [`worker`]).
pub fn run(config: &Config, spawn: &dyn Fn(&str, &str, usize, f64, u32) -> Command) -> Report {
    assert!(
        config.limit == 0 || config.deployment != Deployment::RedLock,
        "RedLock has no semaphore"
    );
    let mut deploy = Deploy::start(config.deployment);
    let resource = RedisServer::start();
    let target = deploy.target(config.min_replicas).to_arg();
    let mut dice = Dice(config.seed | 1);
    let mut report = Report {
        window: (config.deployment == Deployment::RedLock).then_some("2 of 5 nodes blackholed"),
        ..Report::default()
    };
    let start_worker = |secs: f64| -> Worker {
        let mut child = spawn(&target, &resource.url(), config.threads, secs, config.limit)
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
    let shas = [
        redis::Script::new(acquire_lua).get_hash().to_owned(),
        redis::Script::new(release_lua).get_hash().to_owned(),
    ];
    let started = Instant::now();
    let chaos_began = wall();
    let until = started + Duration::from_secs_f64(config.secs);
    let watch = match &deploy {
        Deploy::Sentinel { set, .. } => Some(PrimaryWatch::start(
            set.nodes.iter().map(RedisServer::port).collect(),
        )),
        _ => None,
    };
    let mut workers: Vec<Worker> = (0..config.processes)
        .map(|_| start_worker(config.secs))
        .collect();
    // Which worker was stopped when (wall nanoseconds).
    let mut stops: Vec<(usize, u64, u64)> = Vec::new();
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
                    let from = wall();
                    signal(pid, "STOP");
                    workers[w].stopped = true;
                    std::thread::sleep(Duration::from_millis(100 + dice.below(1400)));
                    signal(pid, "CONT");
                    workers[w].stopped = false;
                    stops.push((w, from, wall()));
                    report.fault("SIGSTOP/SIGCONT");
                }
            }
            25..=29 if left > 2.0 => {
                let w = dice.below(workers.len() as u64) as usize;
                if !workers[w].killed {
                    signal(workers[w].child.id(), "KILL");
                    workers[w].killed = true;
                    workers.push(start_worker(left));
                    report.fault("SIGKILL");
                }
            }
            _ => deploy.fault(&mut dice, &shas, left, &mut report),
        }
    }
    let chaos_ended = wall();
    deploy.heal();
    // Workers end by themselves; a stopped one is continued first.
    let mut holds: Vec<Held> = Vec::new();
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
                ["H", t, numbers @ ..] => {
                    held += 1;
                    let n: Vec<u64> = numbers.iter().filter_map(|n| n.parse().ok()).collect();
                    if let [asked, acquired, valid_until, token, unlocked, took] = n[..] {
                        // An unlock() its process spent stopped says
                        // nothing about the crate.
                        let stopped = stops.iter().any(|(who, a, b)| {
                            *who == w && *a < unlocked.saturating_add(took) && unlocked < *b
                        });
                        holds.push(Held {
                            asked,
                            acquired,
                            valid_until,
                            token,
                            unlocked,
                            unlock: if stopped {
                                Duration::ZERO
                            } else {
                                Duration::from_nanos(took)
                            },
                            who: format!("worker {w} thread {t}"),
                        });
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
    if let Some(watch) = watch {
        report.two_primaries = watch.stop();
    }
    let allowed = config.limit.max(1) as usize;
    let valid: Vec<(u64, u64, String)> = holds
        .iter()
        .filter(|h| h.valid_until > 0)
        .map(|h| (h.acquired, h.valid_until, h.who.clone()))
        .collect();
    let (most, excess) = most_at_once(&valid, allowed);
    report.most_at_once = most;
    // Each with the fault that came last before it, and whether it began
    // inside a failover's window.
    let excess = excess.into_iter().map(|line| {
        let began: Option<u64> = line
            .split("held from ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok());
        let failover =
            began.is_some_and(|at| report.failovers.iter().any(|(a, b)| (*a..*b).contains(&at)));
        let line = if failover {
            format!("{line}; {IN_A_FAILOVER}")
        } else {
            line
        };
        let split = began.is_some_and(|at| {
            report
                .two_primaries
                .iter()
                .any(|(a, b)| (*a..after_a_lease(*b)).contains(&at))
        });
        let line = if split {
            format!("{line}; {WITH_TWO_PRIMARIES}")
        } else {
            line
        };
        match began.and_then(|at| report.fault_before(at)) {
            Some((fault, ago)) => format!("{line}; last fault before: {fault}, {ago:?} earlier"),
            None => line,
        }
    });
    let excess: Vec<String> = excess.collect();
    report.overlaps.extend(excess);
    check_tokens(&holds, &mut report);
    // The workers asked for the lock for `secs` from their start.
    let ran = u64::try_from(Duration::from_secs_f64(config.secs).as_nanos()).unwrap_or(u64::MAX);
    let span = (
        chaos_began,
        chaos_ended.min(chaos_began.saturating_add(ran)),
    );
    let stopped: Vec<(u64, u64)> = stops.iter().map(|(_, a, b)| (*a, *b)).collect();
    split_by_windows(&holds, span, &stopped, &mut report);
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
    // Nothing of the crate left on any server: the lock key and the
    // release markers expire or are released, subscriptions and
    // connections are gone. (The fencing counter stays, by design.)
    let servers = deploy.servers();
    let clean = wait_until(Duration::from_secs(15), || {
        servers.iter().all(|s| left_on(s).is_none())
    });
    if !clean {
        report
            .leftovers
            .extend(servers.iter().filter_map(|s| left_on(s)));
    }
    report
}

/// One hold as a worker reported it (wall nanoseconds).
#[derive(Clone, Debug, Default)]
pub struct Held {
    pub asked: u64,
    pub acquired: u64,
    /// The last moment its holder saw `validity() > 0`; 0 if never.
    pub valid_until: u64,
    /// 0 without one.
    pub token: u64,
    /// When its holder called `unlock()`.
    pub unlocked: u64,
    /// How long `unlock()` took; 0 when its process was stopped meanwhile.
    pub unlock: Duration,
    pub who: String,
}

/// Counts fencing tokens given twice, and tokens lower than one whose
/// acquisition had returned before theirs was asked for (those must be
/// larger: the counter only grows, and the clock floor keeps it growing
/// across a failover that lost increments).
pub fn check_tokens(holds: &[Held], report: &mut Report) {
    let mut fenced: Vec<&Held> = holds.iter().filter(|h| h.token > 0).collect();
    report.tokens = fenced.len() as u64;
    let mut seen: BTreeMap<u64, &str> = BTreeMap::new();
    for hold in &fenced {
        if let Some(first) = seen.insert(hold.token, &hold.who) {
            report.tokens_repeated += 1;
            if report.token_failures.len() < 10 {
                report.token_failures.push(format!(
                    "token {} given to {first} and again to {}",
                    hold.token, hold.who
                ));
            }
        }
    }
    // Walks the holds in the order they were asked for, with the largest
    // token among those acquired before.
    let mut by_acquired = fenced.clone();
    by_acquired.sort_by_key(|h| h.acquired);
    fenced.sort_by_key(|h| h.asked);
    let mut done = by_acquired.iter().peekable();
    let mut highest: Option<&Held> = None;
    for hold in fenced {
        while let Some(before) = done.next_if(|h| h.acquired < hold.asked) {
            if highest.is_none_or(|h| before.token > h.token) {
                highest = Some(before);
            }
        }
        if let Some(before) = highest.filter(|h| h.token > hold.token) {
            report.tokens_backwards += 1;
            if report.token_failures.len() < 10 {
                report.token_failures.push(format!(
                    "{} got token {} after {} had got {} (acquired {} µs before it asked)",
                    hold.who,
                    hold.token,
                    before.who,
                    before.token,
                    (hold.asked - before.acquired) / 1000
                ));
            }
        }
    }
    if report.tokens_repeated + report.tokens_backwards > report.token_failures.len() as u64 {
        report.token_failures.push(format!(
            "{} repeated and {} backward tokens in all",
            report.tokens_repeated, report.tokens_backwards
        ));
    }
}

/// Total length of the union of `intervals` within `span`.
fn covered(intervals: &[(u64, u64)], span: (u64, u64)) -> u64 {
    let mut clipped: Vec<(u64, u64)> = intervals
        .iter()
        .map(|(a, b)| ((*a).max(span.0), (*b).min(span.1)))
        .filter(|(a, b)| a < b)
        .collect();
    clipped.sort();
    let (mut total, mut reach) = (0u64, span.0);
    for (a, b) in clipped {
        let a = a.max(reach);
        if b > a {
            total += b - a;
            reach = b;
        }
    }
    total
}

/// Acquisitions, time and the longest `unlock()` inside the windows of
/// the deployment's long fault and outside them, within `span` (from the
/// controller's start, as long as the workers ran). A window counts until
/// a lease after its end (what it left behind is its cost); the outside
/// leaves out each worker stop and a lease after it, as a stopped holder
/// keeps everyone waiting (the controller makes one fault at a time, so
/// stops would all fall outside and lower that side's rate).
fn split_by_windows(holds: &[Held], span: (u64, u64), stops: &[(u64, u64)], report: &mut Report) {
    let ttl = u64::try_from(TTL.as_nanos()).unwrap_or(u64::MAX);
    let windows: Vec<(u64, u64)> = report
        .windows
        .iter()
        .map(|(a, b)| (*a, b.saturating_add(ttl)))
        .collect();
    let stops: Vec<(u64, u64)> = stops
        .iter()
        .map(|(a, b)| (*a, b.saturating_add(ttl)))
        .collect();
    let within = |list: &[(u64, u64)], at: u64| list.iter().any(|(a, b)| (*a..*b).contains(&at));
    let (mut i, mut o) = ((0u64, Duration::ZERO), (0u64, Duration::ZERO));
    for hold in holds {
        report.longest_unlock = report.longest_unlock.max(hold.unlock);
        if within(&windows, hold.unlocked) {
            i.1 = i.1.max(hold.unlock);
        } else if !within(&stops, hold.unlocked) {
            o.1 = o.1.max(hold.unlock);
        }
        if !(span.0..span.1).contains(&hold.acquired) {
            continue;
        }
        if within(&windows, hold.acquired) {
            i.0 += 1;
        } else if !within(&stops, hold.acquired) {
            o.0 += 1;
        }
    }
    let inside = covered(&windows, span);
    let both: Vec<(u64, u64)> = windows.iter().chain(stops.iter()).copied().collect();
    let outside = (span.1 - span.0).saturating_sub(covered(&both, span));
    report.in_windows = (i.0, Duration::from_nanos(inside), i.1);
    report.outside_windows = (o.0, Duration::from_nanos(outside), o.1);
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
    let joined = |items: Vec<String>| {
        if items.is_empty() {
            "none".to_owned()
        } else {
            items.join(", ")
        }
    };
    let errors = joined(
        report
            .errors
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect(),
    );
    let faults = joined(
        report
            .faults
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect(),
    );
    let survivors: Vec<u64> = report.survivors.iter().flatten().copied().collect();
    let (min, max) = (
        survivors.iter().min().copied().unwrap_or(0),
        survivors.iter().max().copied().unwrap_or(0),
    );
    let what = match (config.limit, config.deployment) {
        (0, Deployment::RedLock) => "one RedLock over 5 nodes".to_owned(),
        (0, _) => "one lock (half the threads fenced)".to_owned(),
        (n, _) => format!("a fenced semaphore of {n} permits"),
    };
    let replicas = if config.min_replicas {
        ", min_replicas(1, 100 ms)"
    } else {
        ""
    };
    out.push_str(&format!(
        "chaos on {}: {} processes x {} threads, {what} (ttl {:?}{replicas}), {:.0} s (took {:.1} s), seed {}\n\n",
        config.deployment.name(),
        config.processes,
        config.threads,
        TTL,
        config.secs,
        took.as_secs_f64(),
        config.seed
    ));
    out.push_str("| figure | value |\n|---|---|\n");
    let mut rows = vec![
        ("acquisitions", report.acquisitions.to_string()),
        (
            "accepted writes (= counter)",
            format!("{} ({})", report.accepted_writes, report.counter),
        ),
        ("fenced rejections", report.fenced_rejections.to_string()),
        ("lost updates", report.lost_updates.to_string()),
        (
            "fencing tokens: given, repeated, lower than an earlier one",
            format!(
                "{}, {}, {}",
                report.tokens, report.tokens_repeated, report.tokens_backwards
            ),
        ),
        (
            "holds begun with the limit's worth still valid (of them in a failover's window: allowed)",
            format!(
                "{} ({})",
                report.overlaps.len(),
                report
                    .overlaps
                    .iter()
                    .filter(|o| o.contains(IN_A_FAILOVER))
                    .count()
            ),
        ),
        (
            "times two data nodes were primaries at once (Sentinel)",
            report.two_primaries.len().to_string(),
        ),
        (
            "most valid holders at once",
            format!("{} (limit {})", report.most_at_once, config.limit.max(1)),
        ),
        ("errors by kind", errors),
        (
            "longest wait in lock()",
            format!("{:?}", report.longest_wait),
        ),
        (
            "longest unlock() (its process not stopped meanwhile)",
            format!("{:?}", report.longest_unlock),
        ),
        ("acquisitions per surviving thread", format!("{min}–{max}")),
    ];
    if let Some(window) = report.window {
        let rate = |(n, time, _): (u64, Duration, Duration)| {
            format!(
                "{:.0}/s ({n} in {:.1} s)",
                n as f64 / time.as_secs_f64().max(1e-9),
                time.as_secs_f64()
            )
        };
        rows.push((
            "acquisitions outside the windows below",
            rate(report.outside_windows),
        ));
        rows.push((window, rate(report.in_windows)));
        rows.push((
            "longest unlock() outside, inside",
            format!("{:?}, {:?}", report.outside_windows.2, report.in_windows.2),
        ));
    }
    {
        for (i, overlap) in report.overlaps.iter().take(5).enumerate() {
            let name = if i == 0 { "overlaps (first 5)" } else { "" };
            rows.push((name, overlap.clone()));
        }
    }
    rows.push(("faults injected", faults));
    rows.push((
        "faults that did not take",
        joined(report.fault_errors.clone()),
    ));
    rows.push((
        "left behind",
        if report.leftovers.is_empty() {
            "nothing".into()
        } else {
            report.leftovers.join("; ")
        },
    ));
    for (name, value) in rows {
        out.push_str(&format!("| {name} | {value} |\n"));
    }
    out
}
