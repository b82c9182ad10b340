//! Private `redis-server` processes for tests, benches and examples.
//!
//! Each [`RedisServer`] runs on a free loopback port (never 6379 or any fixed
//! port), with no persistence, in its own temporary directory, and is killed
//! when dropped. The crate `redmutex-test-support` (never published),
//! shared by `tests/`, `benches/` and `examples/` as a dev-dependency, so it
//! is compiled once.

pub mod chaos;
mod counting;
mod deploy;
pub mod processes;
mod proxy;
pub mod tls;
#[allow(unused_imports)]
pub use counting::{Counting, allocations, in_use, trace as counting_trace};
pub use deploy::*;
#[allow(unused_imports)]
pub use proxy::*;

use redmutex::Lease;
use std::io::Read;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a fresh server may take to answer PING.
const READY_WITHIN: Duration = Duration::from_secs(10);
/// How many ports to try when another process grabs the one we picked.
const START_TRIES: u32 = 5;

/// The redis-server binary: `$REDIS_SERVER` or `redis-server` on the PATH.
pub fn redis_server_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("REDIS_SERVER") {
        return PathBuf::from(path);
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("redis-server"))
            .find(|candidate| candidate.is_file())
    });
    match found {
        Some(path) => path,
        None => panic!(
            "redis-server was not found on the PATH. These tests start private \
             redis-server processes (Redis 6.2 or newer, or Valkey). Install it with \
             `sudo apt-get install -y redis-server` (Debian/Ubuntu), \
             `brew install redis` (macOS), or point $REDIS_SERVER at the binary."
        ),
    }
}

/// The major version of [`redis_server_binary`] (see [`server_version`]).
pub fn server_major() -> u32 {
    server_version().0
}

/// The major and minor version of [`redis_server_binary`] (`redis-server
/// --version`, Valkey's too), read once; 7.0 when it cannot be read.
pub fn server_version() -> (u32, u32) {
    static VERSION: std::sync::OnceLock<(u32, u32)> = std::sync::OnceLock::new();
    *VERSION.get_or_init(|| {
        let out = Command::new(redis_server_binary())
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        // "Redis server v=6.2.16 sha=…" or "Valkey server v=8.0.1 …".
        let mut parts = out
            .split("v=")
            .nth(1)
            .unwrap_or_default()
            .split('.')
            .map(|p| p.parse::<u32>().ok());
        match (parts.next().flatten(), parts.next().flatten()) {
            (Some(major), Some(minor)) => (major, minor),
            _ => (7, 0),
        }
    })
}

/// A port nobody listens on right now (the OS picks it).
pub fn free_port() -> u16 {
    let listener =
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind an ephemeral loopback port");
    listener.local_addr().expect("local address").port()
}

/// A free port whose cluster bus port (it plus 10000, before Redis 7.0)
/// is free too.
pub fn free_port_with_bus() -> u16 {
    let mut port = free_port();
    for _ in 0..50 {
        let bus_free = port
            .checked_add(10_000)
            .is_some_and(|bus| TcpListener::bind((Ipv4Addr::LOCALHOST, bus)).is_ok());
        if bus_free {
            break;
        }
        port = free_port();
    }
    port
}

/// A free port that is not `taken` (two picks in a row can coincide).
pub fn free_port_other_than(taken: u16) -> u16 {
    let mut port = free_port();
    for _ in 0..START_TRIES {
        if port != taken {
            break;
        }
        port = free_port();
    }
    port
}

/// A private redis-server on 127.0.0.1.
pub struct RedisServer {
    port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
    extra: Vec<String>,
    /// A configuration file given first on the command line (sentinels
    /// need one they can rewrite).
    config: Option<PathBuf>,
}

impl RedisServer {
    /// Starts a server with the standard test settings.
    pub fn start() -> RedisServer {
        RedisServer::start_with(&[])
    }

    /// Starts a server with extra `--option value` arguments.
    pub fn start_with(extra: &[&str]) -> RedisServer {
        RedisServer::start_in(temp_dir(), None, extra)
    }

    /// Starts a cluster-enabled node. Its bus port is picked afresh on
    /// every try, like the data port: another process can take either
    /// between the pick and the bind, and keeping one that was taken made
    /// every retry fail the same way.
    pub fn start_cluster_node(extra: &[&str]) -> RedisServer {
        let fixed: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        if server_major() < 7 {
            // No `cluster-port` before Redis 7.0: the bus is the data port
            // plus 10000, which must be free too.
            return RedisServer::start_tries_on(temp_dir(), None, free_port_with_bus, |_| {
                let mut args: Vec<String> = vec!["--cluster-enabled".into(), "yes".into()];
                args.extend(fixed.iter().cloned());
                args
            });
        }
        RedisServer::start_tries(temp_dir(), None, |port| {
            let bus = free_port_other_than(port);
            let mut args: Vec<String> = ["--cluster-enabled", "yes", "--cluster-port"]
                .iter()
                .map(|s| s.to_string())
                .collect();
            args.push(bus.to_string());
            args.extend(fixed.iter().cloned());
            args
        })
    }

    pub fn start_in(
        dir: tempfile::TempDir,
        config: Option<PathBuf>,
        extra: &[&str],
    ) -> RedisServer {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        RedisServer::start_tries(dir, config, |_| extra.clone())
    }

    /// Tries up to [`START_TRIES`] free ports; `extra_for(port)` gives the
    /// extra arguments for one try (ports they name must be fresh too).
    pub fn start_tries(
        dir: tempfile::TempDir,
        config: Option<PathBuf>,
        extra_for: impl FnMut(u16) -> Vec<String>,
    ) -> RedisServer {
        RedisServer::start_tries_on(dir, config, free_port, extra_for)
    }

    /// [`RedisServer::start_tries`] on ports `pick` gives.
    pub fn start_tries_on(
        dir: tempfile::TempDir,
        config: Option<PathBuf>,
        pick: fn() -> u16,
        mut extra_for: impl FnMut(u16) -> Vec<String>,
    ) -> RedisServer {
        let mut last_log = String::new();
        for _ in 0..START_TRIES {
            let port = pick();
            let extra = extra_for(port);
            match spawn(port, dir.path(), config.as_deref(), &extra) {
                Ok(child) => {
                    return RedisServer {
                        port,
                        child: Some(child),
                        dir,
                        extra,
                        config,
                    };
                }
                Err(log) => last_log = log,
            }
        }
        panic!("redis-server did not start after {START_TRIES} tries; last log:\n{last_log}");
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// A plain connection for setting up and inspecting state.
    pub fn conn(&self) -> redis::Connection {
        let client = redis::Client::open(self.url()).expect("parse test URL");
        let con = client
            .get_connection_with_timeout(Duration::from_secs(2))
            .expect("connect to the test redis-server");
        con.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("set read timeout");
        con
    }

    /// A lock client with its own pool, as `LockClient::open` builds it.
    pub fn lock_client(&self) -> redmutex::LockClient {
        redmutex::LockClient::open(&self.url()).expect("open a LockClient")
    }

    /// A lock client whose pool holds exactly one connection, so the next
    /// user gets the connection the last one returned.
    pub fn lock_client_single(&self) -> redmutex::LockClient {
        let client = redis::Client::open(self.url()).expect("parse test URL");
        let pool = redmutex::r2d2::Pool::builder()
            .max_size(1)
            .test_on_check_out(false)
            .connection_timeout(Duration::from_secs(2))
            .build(client)
            .expect("build a one-connection pool");
        redmutex::LockClient::new(pool)
    }

    /// The first field of `ROLE` (`master`, `slave`, `sentinel`), if the
    /// server answers.
    pub fn role(&self) -> Option<String> {
        let role: Vec<redis::Value> = self.try_query(&mut redis::cmd("ROLE"))?;
        match role.first()? {
            redis::Value::BulkString(name) => Some(String::from_utf8_lossy(name).into_owned()),
            _ => None,
        }
    }

    /// Runs `cmd` on a fresh connection with short timeouts; `None` when
    /// the server does not answer or refuses (for polling in `wait_until`).
    pub fn try_query<T: redis::FromRedisValue>(&self, cmd: &mut redis::Cmd) -> Option<T> {
        let client = redis::Client::open(self.url()).ok()?;
        let mut con = client
            .get_connection_with_timeout(Duration::from_millis(500))
            .ok()?;
        con.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        cmd.query(&mut con).ok()
    }

    /// Calls of one command so far, from `INFO commandstats`.
    pub fn command_calls(&self, command: &str) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut self.conn())
            .expect("INFO commandstats");
        parse_calls(&info, command)
    }

    /// Starts a replica of `primary` and waits until the primary sees it
    /// connected and in sync.
    pub fn start_replica_of(primary: &RedisServer) -> RedisServer {
        let port = primary.port.to_string();
        let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
        assert!(
            replica.synced(),
            "the replica did not sync with its primary"
        );
        replica
    }

    /// Waits (bounded) until this replica's link to its primary is up.
    pub fn synced(&self) -> bool {
        wait_until(READY_WITHIN, || {
            self.try_query::<String>(redis::cmd("INFO").arg("replication"))
                .is_some_and(|info| info.contains("master_link_status:up"))
        })
    }

    /// `n` independent masters (for RedLock).
    pub fn start_many(n: usize) -> Vec<RedisServer> {
        (0..n).map(|_| RedisServer::start()).collect()
    }

    /// Sends a signal (`STOP`, `CONT`, …) to the server process.
    pub fn signal(&self, name: &str) {
        let pid = self.pid().expect("a running server");
        assert!(signal(pid, name), "kill -{name} {pid}");
    }

    /// Kills the server (SIGKILL) and waits for it to go.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// As [`RedisServer::restart`], with other extra arguments from now on.
    pub fn restart_with(&mut self, extra: &[&str]) {
        self.extra = extra.iter().map(|s| s.to_string()).collect();
        self.restart();
    }

    /// Kills the server and starts a fresh one (no persistence: empty) on the
    /// same port.
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            match spawn(
                self.port,
                self.dir.path(),
                self.config.as_deref(),
                &self.extra,
            ) {
                Ok(child) => {
                    self.child = Some(child);
                    return;
                }
                Err(log) if Instant::now() > deadline => {
                    panic!("redis-server did not restart on port {}:\n{log}", self.port)
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn temp_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("redmutex-redis-")
        .tempdir()
        .expect("create a temporary directory")
}

/// Runs redis-server on `port` and waits until it answers PING.
fn spawn(port: u16, dir: &Path, config: Option<&Path>, extra: &[String]) -> Result<Child, String> {
    let log_path = dir.join("redis.log");
    let mut command = Command::new(redis_server_binary());
    command.args(config);
    let mut child = command
        .arg("--port")
        .arg(port.to_string())
        .args(["--bind", "127.0.0.1"])
        .args(["--save", ""])
        .args(["--appendonly", "no"])
        // Redis 7 refuses DEBUG unless enabled; older servers allow it and
        // know no such setting.
        .args(if server_major() >= 7 {
            &["--enable-debug-command", "local"][..]
        } else {
            &[]
        })
        .args(["--daemonize", "no"])
        .arg("--dir")
        .arg(dir)
        .arg("--logfile")
        .arg(&log_path)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {:?}: {e}", redis_server_binary()));
    let url = format!("redis://127.0.0.1:{port}/");
    let deadline = Instant::now() + READY_WITHIN;
    loop {
        if let Ok(Some(_status)) = child.try_wait() {
            let mut stderr = String::new();
            if let Some(mut pipe) = child.stderr.take() {
                let _ = pipe.read_to_string(&mut stderr);
            }
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            return Err(format!("{stderr}{log}"));
        }
        if ping(&url) {
            return Ok(child);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            return Err(format!("no PONG within {READY_WITHIN:?}\n{log}"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn ping(url: &str) -> bool {
    let Ok(client) = redis::Client::open(url) else {
        return false;
    };
    let Ok(mut con) = client.get_connection_with_timeout(Duration::from_millis(200)) else {
        return false;
    };
    redis::cmd("PING").query::<String>(&mut con).is_ok()
}

/// The server a tool talks to: `url` when given, else a private server,
/// returned too so it lives as long as the caller keeps it.
pub fn server_or(url: Option<&str>) -> (Option<RedisServer>, String) {
    match url {
        Some(url) => (None, url.to_owned()),
        None => {
            let server = RedisServer::start();
            let url = server.url();
            (Some(server), url)
        }
    }
}

/// The mean `MEMORY USAGE` of up to 100 of the `held` keys named
/// `{prefix}{i}` (i from 0), spread evenly over them.
pub fn memory_usage_mean(
    con: &mut redis::Connection,
    prefix: &str,
    held: usize,
) -> redis::RedisResult<f64> {
    let sample = held.clamp(1, 100);
    let step = (held / sample).max(1);
    let mut total = 0u64;
    for i in (0..held).step_by(step).take(sample) {
        let bytes: Option<u64> = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(format!("{prefix}{i}"))
            .arg("SAMPLES")
            .arg(0)
            .query(con)?;
        total += bytes.unwrap_or(0);
    }
    Ok(total as f64 / sample as f64)
}

/// Reads `cmdstat_<command>:calls=N,...` out of `INFO commandstats`.
pub fn parse_calls(info: &str, command: &str) -> u64 {
    let prefix = format!("cmdstat_{}:", command.to_ascii_lowercase());
    info.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').next())
        .and_then(|calls| calls.strip_prefix("calls="))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// All `cmdstat_*` call counts added up.
pub fn total_calls(info: &str) -> u64 {
    info.lines()
        .filter(|line| line.starts_with("cmdstat_"))
        .filter_map(|line| line.split_once(":calls="))
        .filter_map(|(_, rest)| rest.split(',').next())
        .filter_map(|n| n.parse::<u64>().ok())
        .sum()
}

/// Sends signal `name` (`STOP`, `KILL`, …) to process `pid`; whether it
/// was delivered.
pub fn signal(pid: u32, name: &str) -> bool {
    Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A small deterministic generator (xorshift) for tests' random choices:
/// the same seed, the same run.
pub struct Dice(pub u64);

impl Dice {
    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// Serializes the tests of one binary that assert time bounds, so that
/// they do not measure each other's load: `let _serial = support::serial();`
/// first thing in each.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A pooled connection of `client`, tried again for up to 10 s: for a
/// test's setup on a loaded machine, where a first connect through a proxy
/// can take longer than a short timeout.
pub fn connection_of(client: &redmutex::LockClient) -> redmutex::Connection {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match client.connection() {
            Ok(con) => return con,
            Err(err) if Instant::now() > deadline => panic!("no connection: {err}"),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Takes `key` through `client` with the watchdog on and a `ttl` lease.
pub fn watched_lock(
    client: &redmutex::LockClient,
    key: &str,
    ttl: Duration,
) -> redmutex::LockGuard {
    redmutex::DistributedLock::with_options(
        client,
        key,
        redmutex::LockOptions::default().ttl(ttl).watchdog(true),
    )
    .lock()
    .expect("lock")
}

/// A token's secret, which names its release markers (the holder metadata
/// after the first `|` is left out).
/// Whether a fencing token is at least a server clock reading in
/// microseconds (after 2020): tokens are floored by `TIME`.
pub fn clock_floored(token: u64) -> bool {
    token > 1_600_000_000_000_000
}

pub fn secret(token: &str) -> &str {
    token.split('|').next().unwrap_or(token)
}

/// The SHA1 a script is sent by (`EVALSHA`), for arming proxy faults on it.
pub fn sha(lua: &str) -> String {
    redis::Script::new(lua).get_hash().to_owned()
}

/// What to arm a proxy fault on to catch the plain lock's quick
/// acquisition: its `SET … NX … GET`, or on a server before Redis 7.0
/// (which refuses `NX` with `GET`) the acquire script the crate falls
/// back to.
pub fn quick_acquire_pattern() -> String {
    if server_major() >= 7 {
        "NX".to_owned()
    } else {
        sha(include_str!("../../lua/acquire.lua"))
    }
}

/// Every script of the crate, by file name.
pub const SCRIPTS: [(&str, &str); 23] = [
    ("inspect", include_str!("../../lua/inspect.lua")),
    ("sem_status", include_str!("../../lua/sem_status.lua")),
    ("sem_check", include_str!("../../lua/sem_check.lua")),
    ("sem_set_limit", include_str!("../../lua/sem_set_limit.lua")),
    ("sem_acquire", include_str!("../../lua/sem_acquire.lua")),
    ("sem_release", include_str!("../../lua/sem_release.lua")),
    ("sem_extend", include_str!("../../lua/sem_extend.lua")),
    ("force_release", include_str!("../../lua/force_release.lua")),
    ("acquire", include_str!("../../lua/acquire.lua")),
    ("release", include_str!("../../lua/release.lua")),
    ("extend", include_str!("../../lua/extend.lua")),
    (
        "reentrant_acquire",
        include_str!("../../lua/reentrant_acquire.lua"),
    ),
    (
        "reentrant_release",
        include_str!("../../lua/reentrant_release.lua"),
    ),
    (
        "reentrant_extend",
        include_str!("../../lua/reentrant_extend.lua"),
    ),
    ("rw_acquire", include_str!("../../lua/rw_acquire.lua")),
    ("rw_release", include_str!("../../lua/rw_release.lua")),
    ("rw_extend", include_str!("../../lua/rw_extend.lua")),
    ("rw_downgrade", include_str!("../../lua/rw_downgrade.lua")),
    ("multi_acquire", include_str!("../../lua/multi_acquire.lua")),
    ("multi_release", include_str!("../../lua/multi_release.lua")),
    ("multi_extend", include_str!("../../lua/multi_extend.lua")),
    ("fair_acquire", include_str!("../../lua/fair_acquire.lua")),
    ("fair_release", include_str!("../../lua/fair_release.lua")),
];

/// Loads every script on `server`, so that an `EVALSHA` runs at once
/// (a fault armed on it then hits a command that really ran, not a
/// `NOSCRIPT` answer).
pub fn load_scripts(server: &RedisServer) {
    let mut con = server.conn();
    for (_, lua) in SCRIPTS {
        let _: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(lua)
            .query(&mut con)
            .expect("SCRIPT LOAD");
    }
}

/// Whether `key` exists on `server`.
pub fn exists(server: &RedisServer, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query::<bool>(&mut server.conn())
        .expect("EXISTS")
}

/// The string value of `key` on `server`.
pub fn get(server: &RedisServer, key: &str) -> Option<String> {
    redis::cmd("GET")
        .arg(key)
        .query(&mut server.conn())
        .expect("GET")
}

/// Polls `condition` every 5 ms until it holds or `within` passes.
pub fn wait_until(within: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Subscribers of `channel` on `server` (`PUBSUB NUMSUB`).
pub fn numsub(server: &RedisServer, channel: &str) -> u64 {
    subscribers(server, "NUMSUB", channel)
}

/// Subscribers of the shard channel `channel` on `server` (`SSUBSCRIBE`,
/// Redis 7.0+; 0 on older servers).
pub fn shard_numsub(server: &RedisServer, channel: &str) -> u64 {
    subscribers(server, "SHARDNUMSUB", channel)
}

fn subscribers(server: &RedisServer, count: &str, channel: &str) -> u64 {
    let reply: (String, u64) = redis::cmd("PUBSUB")
        .arg(count)
        .arg(channel)
        .query(&mut server.conn())
        .unwrap_or_default();
    reply.1
}

/// One cycle of the lock a program without this crate would write, the
/// yardstick of the benches and the demo: `SET key token NX PX 30000` with
/// a fresh UUID, then a compare-and-delete script, on `con`. `false` when
/// the key was held.
pub fn hand_written_pair(con: &mut redis::Connection, key: &str) -> redis::RedisResult<bool> {
    static COMPARE_AND_DELETE: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(
        || {
            redis::Script::new(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
            )
        },
    );
    let token = uuid::Uuid::new_v4().to_string();
    let set: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg(&token)
        .arg("NX")
        .arg("PX")
        .arg(30_000)
        .query(con)?;
    if set.is_none() {
        return Ok(false);
    }
    let _: i64 = COMPARE_AND_DELETE.key(key).arg(&token).invoke(con)?;
    Ok(true)
}

/// Holds `key` through `holder` while a thread of `waiter` waits for it with
/// a 5 s backoff step; once `subscribed(channel)` says the waiter's
/// subscription reached Redis, releases. Returns how long the waiter waited,
/// which is short only when the release message woke it, after checking
/// that the waiter counted a release message.
pub fn release_wakes_waiter(
    holder: &redmutex::LockClient,
    waiter: &redmutex::LockClient,
    key: &str,
    mut subscribed: impl FnMut(&str) -> bool,
) -> Duration {
    use redmutex::{Backoff, DistributedLock, LockOptions};
    let options = || LockOptions::default().wait(Duration::from_secs(10));
    let guard = DistributedLock::with_options(holder, key, options())
        .lock()
        .expect("lock");
    let before = waiter.stats().notifications;
    let waiting = std::thread::spawn({
        let waiter = waiter.clone();
        let key = key.to_owned();
        let slow = options().backoff(Backoff::constant(Duration::from_secs(5)));
        move || {
            let started = Instant::now();
            let guard = DistributedLock::with_options(&waiter, key, slow)
                .lock()
                .expect("lock after the release");
            let waited = started.elapsed();
            guard.unlock().expect("unlock");
            waited
        }
    });
    let channel = waiter.release_channel(&waiter.key(key));
    let ready = wait_until(Duration::from_secs(10), || subscribed(&channel));
    assert!(ready, "the waiter subscribed to {channel}");
    guard.unlock().expect("unlock");
    let waited = waiting.join().expect("waiter");
    assert!(
        waiter.stats().notifications > before,
        "{:?}",
        waiter.stats()
    );
    waited
}
