//! `redmutex doctor`: checks a deployment for what the failure model says
//! breaks locks (docs/failure-model.md, docs/operating.md), and says what
//! to change. Read-only: it sends `INFO`, `HELLO`, `ROLE`, `CONFIG GET`,
//! `COMMAND INFO`, `ACL WHOAMI`/`ACL DRYRUN`, `TIME`, `PING`, `CLUSTER
//! INFO`/`NODES` and `SENTINEL CKQUORUM`, never a write. What one of those
//! is refused is reported as unknown: a user allowed only what locks need
//! (the rule of docs/failure-model.md) is not a broken deployment.

#[allow(unused_imports)]
use super::*;

/// How bad a finding is; the worst decides the exit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Severity {
    Ok,
    Info,
    /// Not checked: the server refused what doctor asks (`INFO`, `CONFIG
    /// GET`, `ACL DRYRUN`, ...). Worse than info, so that a `worst` of
    /// unknown says something went unchecked, but never a finding against
    /// the deployment: exit 0.
    Unknown,
    Warning,
    Error,
}

impl Severity {
    fn name(self) -> &'static str {
        match self {
            Severity::Ok => "ok",
            Severity::Info => "info",
            Severity::Unknown => "unknown",
            Severity::Warning => "warning",
            Severity::Error => "error",
        }
    }

    /// 0 when nothing is worse than unknown, [`EXIT_DOCTOR_WARNING`] or
    /// [`EXIT_DOCTOR_ERROR`].
    fn exit_code(self) -> u8 {
        match self {
            Severity::Ok | Severity::Info | Severity::Unknown => 0,
            Severity::Warning => EXIT_DOCTOR_WARNING,
            Severity::Error => EXIT_DOCTOR_ERROR,
        }
    }
}

/// One finding: what was checked where, what was found, why it matters and
/// what to change.
struct Finding {
    check: &'static str,
    node: String,
    severity: Severity,
    found: String,
    why: &'static str,
    fix: String,
}

/// When the lock types send a command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum When {
    Always,
    /// Redis 6.2 and later (older servers lack it: the version finding
    /// says what that costs).
    Since62,
    /// On Redis Cluster.
    Cluster,
    /// On Redis Cluster 7.0 and later: sharded pub/sub.
    Sharded,
    /// Through Sentinel.
    Sentinel,
}

impl When {
    /// Whether the command is sent to `deployment` running `version`
    /// (major, minor; `None` when it could not be read: then only what
    /// every version is sent, so that an old server's missing command is
    /// not taken for a renamed one).
    fn applies(self, deployment: redmutex::Deployment, version: Option<(u32, u32)>) -> bool {
        let at_least = |wanted: (u32, u32)| version.is_some_and(|v| v >= wanted);
        match self {
            When::Always => true,
            When::Since62 => at_least((6, 2)),
            When::Cluster => deployment == redmutex::Deployment::Cluster,
            When::Sharded => deployment == redmutex::Deployment::Cluster && at_least((7, 0)),
            When::Sentinel => deployment == redmutex::Deployment::Sentinel,
        }
    }
}

/// A command the lock types send, named as an ACL rule names it
/// (`script|load`), with what fails without it and how badly.
struct Needed {
    name: &'static str,
    when: When,
    severity: Severity,
    breaks: &'static str,
}

const fn needed(name: &'static str, breaks: &'static str) -> Needed {
    Needed {
        name,
        when: When::Always,
        severity: Severity::Error,
        breaks,
    }
}

/// Every command the lock types send: their own and those their Lua
/// scripts call (`lua/*.lua`; the unit tests below keep this list and the
/// scripts, and this list and the rule of docs/failure-model.md, in step).
/// Both the `commands` check (renamed or disabled) and the `acl` check
/// (refused to the user) go through it.
const NEEDED: &[Needed] = &[
    needed("set", "cannot lock"),
    needed("get", "plain locks cannot be taken, renewed or released"),
    Needed {
        when: When::Since62,
        ..needed(
            "getdel",
            "force_release fails where release markers are refused",
        )
    },
    needed(
        "pttl",
        "cannot wait for a held lock; reentrant locks fail; read-write locks and semaphores cannot renew",
    ),
    needed(
        "pexpire",
        "cannot renew (extend, the watchdog, `redmutex run`) plain and reentrant locks; reentrant locks cannot be taken",
    ),
    needed(
        "pexpireat",
        "read-write locks and semaphores cannot be taken, renewed or released",
    ),
    needed("del", "cannot release"),
    needed(
        "exists",
        "reentrant locks and semaphores fail; a release cannot read its marker",
    ),
    needed(
        "hget",
        "reentrant locks, read-write locks and semaphores fail",
    ),
    needed(
        "hset",
        "reentrant locks, read-write locks and semaphores cannot be taken or renewed",
    ),
    needed(
        "hdel",
        "reentrant locks, read-write locks and semaphores cannot be released",
    ),
    needed("hlen", "reentrant locks and semaphores fail"),
    needed("mget", "a multi-lock cannot be checked (is_held)"),
    needed("zadd", "fair locks cannot queue"),
    needed("zrem", "fair locks cannot be taken or released"),
    needed("zrange", "fair locks cannot be taken or released"),
    needed(
        "zrangebyscore",
        "fair locks cannot be taken or released (dead waiters are not dropped)",
    ),
    needed("zscore", "fair locks cannot queue"),
    needed("zrank", "fair locks cannot queue"),
    needed("zcard", "fair locks cannot be taken or released"),
    needed(
        "hgetall",
        "read-write locks and semaphores fail; a held reentrant lock cannot be waited for",
    ),
    needed(
        "time",
        "read-write locks, semaphores and fencing tokens fail; holder metadata has no time",
    ),
    needed(
        "evalsha",
        "every lock type fails (its Lua scripts); only a plain lock's quick acquisition works",
    ),
    needed(
        "eval",
        "a release written behind by a dropped guard that meets a flushed script cache          is left to the cleanup (the key stays held a moment longer)",
    ),
    needed(
        "script|load",
        "the scripts cannot be loaded: after a restart or SCRIPT FLUSH every lock fails",
    ),
    needed("incr", "fencing tokens: a fenced lock or permit is refused"),
    needed(
        "decr",
        "fencing tokens: a counter found negative cannot be put back",
    ),
    needed(
        "psetex",
        "releases leave no marker (a release whose reply is lost says OutcomeUnknown); force_release falls back to GETDEL",
    ),
    needed(
        "publish",
        "releases are not announced: waiters poll instead of being woken",
    ),
    needed("subscribe", "waiters are not woken by releases: they poll"),
    needed("unsubscribe", "waiters stop waiting only by reconnecting"),
    needed("watch", "Release::Watch cannot release"),
    needed("unwatch", "Release::Watch cannot release"),
    needed("multi", "Release::Watch cannot release"),
    needed("exec", "Release::Watch cannot release"),
    needed("wait", "min_replicas fails"),
    needed(
        "ping",
        "cluster connections cannot be opened; the release subscriber's heartbeat fails",
    ),
    Needed {
        severity: Severity::Info,
        ..needed(
            "client|setname",
            "the release subscriber's connection stays unnamed (nothing fails)",
        )
    },
    Needed {
        when: When::Sharded,
        ..needed(
            "spublish",
            "releases are announced to the whole cluster (PUBLISH) instead of the key's shard",
        )
    },
    Needed {
        when: When::Sharded,
        ..needed(
            "ssubscribe",
            "waiters are not woken by releases on the cluster: they poll",
        )
    },
    Needed {
        when: When::Sharded,
        ..needed(
            "sunsubscribe",
            "waiters on the cluster stop waiting only by reconnecting",
        )
    },
    // Only `min_replicas` needs it, which the rule leaves optional.
    Needed {
        when: When::Cluster,
        severity: Severity::Warning,
        ..needed("client|id", "min_replicas on the cluster fails")
    },
    Needed {
        when: When::Sentinel,
        ..needed(
            "role",
            "no connection: a new one checks that the server the sentinels name is a primary",
        )
    },
];

/// Where an ACL probe's word stands for a name derived from the sample
/// lock (see [`Names`]).
const LOCK: &str = "\u{0}lock";
const FENCE: &str = "\u{0}fence";
const MARKER: &str = "\u{0}marker";
const CHANNEL: &str = "\u{0}channel";

/// The servers the crate is tested against, as (Valkey?, major, minor):
/// the guide's deployments chapter, Servers (8.0-m01 reports 7.9).
const TESTED: &[(bool, u32, u32)] = &[
    (false, 7, 0),
    (false, 7, 2),
    (false, 7, 4),
    (false, 7, 9),
    (true, 7, 2),
    (true, 8, 0),
];

/// A script hash no script has: `EVALSHA` is checked for its keys, and a
/// dry run never runs it anyway.
const SHA: &str = "0000000000000000000000000000000000000000";

/// What the ACL check dry-runs: each command of [`NEEDED`] on the names it
/// is sent with, by the lock types or inside their scripts (a script's
/// `redis.call` is checked against the user's ACL like a command of its
/// own). Representative arguments: `ACL DRYRUN` checks the command, its
/// keys (read or write, as the command uses them) and its channels.
const PROBES: &[&[&str]] = &[
    &["SET", LOCK, "v", "NX", "PX", "30000", "GET"],
    &["SET", LOCK, "v", "PX", "30000"],
    &["GET", LOCK],
    &["GETDEL", LOCK],
    &["PTTL", LOCK],
    &["PEXPIRE", LOCK, "30000"],
    &["PEXPIREAT", LOCK, "4102444800000"],
    &["DEL", LOCK],
    &["EXISTS", LOCK],
    &["HGET", LOCK, "owner"],
    &["HSET", LOCK, "owner", "v"],
    &["HDEL", LOCK, "h:v"],
    &["HLEN", LOCK],
    &["HGETALL", LOCK],
    &["MGET", LOCK],
    // A fair lock's queue and deadlines are `{KEY}:…` names, as the
    // markers are.
    &["ZADD", MARKER, "1", "v"],
    &["ZREM", MARKER, "v"],
    &["ZRANGE", MARKER, "0", "0"],
    &["ZRANGEBYSCORE", MARKER, "-inf", "0"],
    &["ZSCORE", MARKER, "v"],
    &["ZRANK", MARKER, "v"],
    &["ZCARD", MARKER],
    &["DEL", MARKER],
    &["PEXPIREAT", MARKER, "4102444800000"],
    &["EVALSHA", SHA, "2", LOCK, FENCE],
    &["EVALSHA", SHA, "2", LOCK, MARKER],
    // A release written behind, sent again after `NOSCRIPT`: a dry run
    // never runs the script.
    &["EVAL", "return 1", "2", LOCK, MARKER],
    &["SCRIPT", "LOAD", "return 1"],
    &["TIME"],
    &["INCR", FENCE],
    &["DECR", FENCE],
    &["SET", FENCE, "1"],
    &["GET", FENCE],
    &["PSETEX", MARKER, "60000", "1"],
    &["EXISTS", MARKER],
    &["GET", MARKER],
    &["PUBLISH", CHANNEL, ""],
    &["SUBSCRIBE", CHANNEL],
    &["UNSUBSCRIBE", CHANNEL],
    &["SPUBLISH", CHANNEL, ""],
    &["SSUBSCRIBE", CHANNEL],
    &["SUNSUBSCRIBE", CHANNEL],
    &["WATCH", LOCK],
    &["UNWATCH"],
    &["MULTI"],
    &["EXEC"],
    &["WAIT", "0", "0"],
    &["PING"],
    &["CLIENT", "SETNAME", "redmutex"],
    &["CLIENT", "ID"],
    &["ROLE"],
];

/// The lock name the ACL check tries when `--key` names none.
const SAMPLE: &str = "redmutex-doctor-sample";

/// The name an ACL rule gives the command of `words` (`script|load`).
fn rule_name(words: &[&str]) -> String {
    let command = words.first().copied().unwrap_or_default().to_lowercase();
    match (command.as_str(), words.get(1)) {
        ("client" | "script", Some(sub)) => format!("{command}|{}", sub.to_lowercase()),
        _ => command,
    }
}

/// What `name` (as [`rule_name`] gives it) needs, from [`NEEDED`].
fn needed_for(name: &str) -> Option<&'static Needed> {
    NEEDED.iter().find(|n| n.name == name)
}

/// A command's name as the server shows it (`SCRIPT LOAD`).
fn shown_name(name: &str) -> String {
    name.to_uppercase().replace('|', " ")
}

pub(super) fn doctor(cli: &Cli, args: &DoctorArgs) -> Result<u8, Failure> {
    let client = client(cli)?;
    let mut findings = Vec::new();
    let target = crate::redact(&cli.url);
    let deployment = client.deployment();
    match deployment {
        redmutex::Deployment::Cluster => cluster(cli, &client, &mut findings)?,
        redmutex::Deployment::Sentinel => {
            sentinels(cli, &mut findings);
            let mut con = connection(&client)?;
            server(&mut con, "primary", deployment, &mut findings);
        }
        _ => {
            let mut con = connection(&client)?;
            server(&mut con, "server", deployment, &mut findings);
        }
    }
    acl(cli, args, &client, &mut findings);
    let worst = findings
        .iter()
        .map(|f| f.severity)
        .max()
        .unwrap_or(Severity::Ok);
    if args.json {
        let items: Vec<String> = findings
            .iter()
            .map(|f| {
                format!(
                    "{{\"check\":{},\"node\":{},\"severity\":\"{}\",\"found\":{},\"why\":{},\"fix\":{}}}",
                    json_string(f.check),
                    json_string(&f.node),
                    f.severity.name(),
                    json_string(&f.found),
                    json_string(f.why),
                    json_string(&f.fix)
                )
            })
            .collect();
        output::outln!(
            "{{\"target\":{},\"worst\":\"{}\",\"findings\":[{}]}}",
            json_string(&target),
            worst.name(),
            items.join(",")
        );
    } else {
        output::outln!("redmutex doctor: {target}");
        for f in &findings {
            output::outln!(
                "{:<8} {:<12} {}: {}",
                f.severity.name(),
                f.check,
                f.node,
                printable(&f.found)
            );
            // What went unchecked says how to check it.
            if f.severity >= Severity::Warning || f.severity == Severity::Unknown {
                if !f.why.is_empty() {
                    output::outln!("{:<21} why: {}", "", f.why);
                }
                if !f.fix.is_empty() {
                    output::outln!("{:<21} fix: {}", "", printable(&f.fix));
                }
            }
        }
        output::outln!("worst: {} (exit {})", worst.name(), worst.exit_code());
    }
    Ok(worst.exit_code())
}

/// A field of an `INFO` reply.
fn field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines().find_map(|line| {
        line.strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(':'))
            .map(str::trim)
    })
}

/// `CONFIG GET name`, when the server lets us (managed services often
/// refuse `CONFIG`).
fn config(con: &mut dyn redis::ConnectionLike, name: &str) -> Option<String> {
    let pairs: Vec<String> = redis::cmd("CONFIG").arg("GET").arg(name).query(con).ok()?;
    pairs.get(1).cloned()
}

/// Whether the server answered `err` (a refusal: `NOPERM`, a renamed
/// command), rather than the link failing.
fn answered(err: &redis::RedisError) -> bool {
    matches!(
        err.kind(),
        redis::ErrorKind::Server(_) | redis::ErrorKind::Extension
    )
}

/// What checks that read `INFO` or `CONFIG` say when both are refused.
const READ_FIX: &str =
    "run doctor as a user allowed INFO and CONFIG GET (an admin), or check this by hand";

/// What `HELLO` (without arguments: the protocol stays as it is) says of
/// the server: its name, version and role. Every user may send `HELLO`,
/// so it tells the version to a user refused `INFO`.
struct Hello {
    server: String,
    version: String,
    role: String,
}

fn hello(con: &mut dyn redis::ConnectionLike) -> Option<Hello> {
    let reply: Vec<redis::Value> = redis::cmd("HELLO").query(con).ok()?;
    let text = |value: &redis::Value| redis::from_redis_value_ref::<String>(value).ok();
    let mut hello = Hello {
        server: String::new(),
        version: String::new(),
        role: String::new(),
    };
    for pair in reply.chunks(2) {
        let (Some(name), Some(value)) = (pair.first().and_then(text), pair.get(1).and_then(text))
        else {
            continue;
        };
        match name.as_str() {
            "server" => hello.server = value,
            "version" => hello.version = value,
            "role" => hello.role = value,
            _ => {}
        }
    }
    (!hello.version.is_empty()).then_some(hello)
}

/// The server's role and, for a primary, how many replicas it has, by
/// `ROLE` (allowed by the rule of docs/failure-model.md, for Sentinel).
fn role(con: &mut dyn redis::ConnectionLike) -> Option<(String, Option<usize>)> {
    let reply: Vec<redis::Value> = redis::cmd("ROLE").query(con).ok()?;
    let role = reply
        .first()
        .and_then(|v| redis::from_redis_value_ref::<String>(v).ok())?;
    let replicas = match reply.get(2) {
        Some(redis::Value::Array(replicas)) if role == "master" => Some(replicas.len()),
        _ => None,
    };
    Some((role, replicas))
}

/// Every check of one server (a single server, the primary Sentinel
/// names, or one primary of a cluster), into `findings`.
fn server(
    con: &mut dyn redis::ConnectionLike,
    node: &str,
    deployment: redmutex::Deployment,
    findings: &mut Vec<Finding>,
) {
    let mut add = |check, severity, found: String, why, fix: &str| {
        findings.push(Finding {
            check,
            node: node.to_owned(),
            severity,
            found,
            why,
            fix: fix.to_owned(),
        });
    };
    // A lock user need not be allowed INFO (the rule of
    // docs/failure-model.md is not): each check that reads it then says
    // what it could not see, and finds what it can elsewhere.
    let (info, refused) = match redis::cmd("INFO").query::<String>(con) {
        Ok(info) => (info, None),
        Err(err) if answered(&err) => (String::new(), Some(format!("INFO refused: {err}"))),
        Err(err) => {
            add(
                "server",
                Severity::Error,
                format!("INFO failed: {err}"),
                "nothing else can be checked",
                "check that the server answers (a firewall, a stalled server)",
            );
            return;
        }
    };
    let hello = if refused.is_some() { hello(con) } else { None };
    let unread = refused.as_deref().unwrap_or("not in INFO");

    // The server against the tested matrix.
    let (valkey, version) = match &hello {
        Some(hello) => (hello.server == "valkey", Some(hello.version.clone())),
        None => {
            let valkey = field(&info, "server_name") == Some("valkey");
            let version = field(&info, "valkey_version")
                .filter(|_| valkey)
                .or_else(|| field(&info, "redis_version"))
                .map(str::to_owned);
            (valkey, version)
        }
    };
    let parsed = version.as_deref().map(|version| {
        let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        (
            parts.next().unwrap_or(0),
            parts.next().unwrap_or(0),
            version,
        )
    });
    let kind = if valkey { "Valkey" } else { "Redis" };
    match parsed {
        None => add(
            "version",
            Severity::Unknown,
            format!("not readable ({unread})"),
            "",
            READ_FIX,
        ),
        Some((major, minor, version)) => {
            let found = format!("{kind} {version}");
            match (valkey, major, minor) {
                _ if TESTED.contains(&(valkey, major, minor)) => add(
                    "version",
                    Severity::Ok,
                    format!("{found}: tested (the guide's deployments chapter, Servers)"),
                    "",
                    "",
                ),
                (true, _, _) | (false, 7.., _) => add(
                    "version",
                    Severity::Info,
                    format!("{found}: not among the versions tested, expected to work"),
                    "the crate is tested against Redis 7.0, 7.2, 7.4 and 8.0-m01 and Valkey 7.2 and 8.0",
                    "",
                ),
                (false, 6, 2) => add(
                    "version",
                    Severity::Info,
                    format!("{found}: acquisitions go by script (SET NX GET needs 7.0)"),
                    "one more round trip once per client; the same guarantees",
                    "Redis 7 or newer when you can",
                ),
                (false, 6, _) => add(
                    "version",
                    Severity::Warning,
                    format!("{found}: before 6.2 GETDEL is missing"),
                    "force_release without release markers fails with Error::Unsupported",
                    "upgrade to Redis 6.2 or newer",
                ),
                _ => add(
                    "version",
                    Severity::Error,
                    format!("{found}: not supported"),
                    "the scripts and commands the locks use need Redis 6.0 or newer",
                    "upgrade to Redis 7 or newer, or Valkey",
                ),
            }
        }
    }
    // Valkey numbers its versions from 7.2 on: as new as Redis 7.2.
    let version = parsed.map(|(major, minor, _)| {
        if valkey {
            (major.max(7), minor)
        } else {
            (major, minor)
        }
    });

    // Commands refused or renamed away (managed services do both), the
    // scripts' included: a renamed HSET fails a script as surely as a
    // refused one.
    let mut needed: Vec<(String, &str)> = Vec::new();
    for need in NEEDED
        .iter()
        .filter(|n| n.when.applies(deployment, version))
    {
        let command = need
            .name
            .split('|')
            .next()
            .unwrap_or(need.name)
            .to_uppercase();
        if !needed.iter().any(|(name, _)| *name == command) {
            needed.push((command, need.breaks));
        }
    }
    let mut probe = redis::cmd("COMMAND");
    probe.arg("INFO");
    for (name, _) in &needed {
        probe.arg(name);
    }
    match probe.query::<Vec<redis::Value>>(con) {
        Ok(replies) => {
            let missing: Vec<String> = needed
                .iter()
                .zip(replies.iter().chain(std::iter::repeat(&redis::Value::Nil)))
                .filter(|(_, reply)| matches!(reply, redis::Value::Nil))
                .map(|((name, what), _)| format!("{name} ({what})"))
                .collect();
            if missing.is_empty() {
                add(
                    "commands",
                    Severity::Ok,
                    format!(
                        "all {} commands the locks send (their scripts' too) are there",
                        needed.len()
                    ),
                    "",
                    "",
                );
            } else {
                add(
                    "commands",
                    Severity::Error,
                    format!("missing (renamed or disabled): {}", missing.join(", ")),
                    "what needs them fails with Error::Unsupported (inside a script, with an unknown-command error)",
                    "enable the commands (rename-command, the service's command policy)",
                );
            }
        }
        Err(err) => add(
            "commands",
            Severity::Unknown,
            format!("COMMAND INFO refused ({err}): not checked"),
            "",
            "run doctor as a user allowed COMMAND INFO (an admin)",
        ),
    }

    // Eviction: a held lock is a key like any other.
    let maxmemory = config(con, "maxmemory");
    let policy = config(con, "maxmemory-policy")
        .or_else(|| field(&info, "maxmemory_policy").map(str::to_owned));
    let limited = maxmemory
        .as_deref()
        .or_else(|| field(&info, "maxmemory"))
        .is_some_and(|m| m != "0");
    match policy.as_deref() {
        Some("noeviction") => add(
            "eviction",
            Severity::Ok,
            "maxmemory-policy noeviction".into(),
            "",
            "",
        ),
        Some(p) if !limited => add(
            "eviction",
            Severity::Info,
            format!("maxmemory-policy {p}, but no maxmemory: nothing is evicted"),
            "",
            "",
        ),
        Some(p) if p.starts_with("allkeys") => add(
            "eviction",
            Severity::Error,
            format!("maxmemory-policy {p} with a memory limit"),
            "a full server evicts any key, a held lock too: two holders",
            "maxmemory-policy noeviction (a full server then refuses new locks instead)",
        ),
        Some(p) => add(
            "eviction",
            Severity::Warning,
            format!("maxmemory-policy {p} with a memory limit"),
            "lock keys have a time to live, so volatile policies may evict a held lock",
            "maxmemory-policy noeviction",
        ),
        None => add(
            "eviction",
            Severity::Unknown,
            format!("maxmemory-policy not readable (CONFIG GET refused; {unread}): not checked"),
            "",
            READ_FIX,
        ),
    }

    // Persistence: what a restart forgets.
    let aof = if refused.is_none() {
        Some(field(&info, "aof_enabled") == Some("1"))
    } else {
        config(con, "appendonly").map(|on| on == "yes")
    };
    let fsync = config(con, "appendfsync");
    let save = config(con, "save");
    let rdb = save.as_deref().is_some_and(|s| !s.trim().is_empty());
    match (aof, fsync.as_deref(), rdb) {
        (None, _, _) => add(
            "persistence",
            Severity::Unknown,
            format!("not readable (CONFIG GET refused; {unread}): not checked"),
            "",
            READ_FIX,
        ),
        (Some(true), Some("always"), _) => add(
            "persistence",
            Severity::Ok,
            "AOF with appendfsync always".into(),
            "",
            "",
        ),
        (Some(true), fsync, _) => add(
            "persistence",
            Severity::Info,
            format!("AOF with appendfsync {}", fsync.unwrap_or("unknown")),
            "a crash forgets the locks of the last second",
            "appendfsync always, or fencing tokens at the resource",
        ),
        (Some(false), _, true) => add(
            "persistence",
            Severity::Warning,
            "RDB snapshots only".into(),
            "a restart forgets every lock taken since the last snapshot; their holders go on",
            "appendonly yes (appendfsync always or everysec), and fencing tokens",
        ),
        (Some(false), _, false) if save.is_none() => add(
            "persistence",
            Severity::Warning,
            "no AOF; RDB settings not readable".into(),
            "a restart may forget held locks while their holders go on",
            "appendonly yes, and fencing tokens",
        ),
        (Some(false), _, false) => add(
            "persistence",
            Severity::Warning,
            "none (no AOF, no RDB snapshots)".into(),
            "a restart forgets every lock while their holders go on",
            "appendonly yes (or replicas and min_replicas), and fencing tokens",
        ),
    }

    // Replicas: failover and min_replicas.
    if refused.is_none() {
        let role = field(&info, "role").unwrap_or("unknown");
        let replicas: u32 = field(&info, "connected_slaves")
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        let lags: Vec<u64> = info
            .lines()
            .filter(|l| l.starts_with("slave") && l.contains("lag="))
            .filter_map(|l| {
                l.split(',')
                    .find_map(|kv| kv.strip_prefix("lag="))
                    .and_then(|n| n.parse().ok())
            })
            .collect();
        let worst_lag = lags.iter().copied().max().unwrap_or(0);
        if role != "master" {
            add(
                "replication",
                Severity::Error,
                format!("role {role}"),
                "a replica refuses the locks' writes",
                "point the client at the primary (or at the sentinels)",
            );
        } else if replicas == 0 {
            add(
                "replication",
                Severity::Info,
                "no replica".into(),
                "min_replicas can never be met, and a failover has nothing to promote",
                "add a replica if you use min_replicas or Sentinel",
            );
        } else if worst_lag > 1 {
            add(
                "replication",
                Severity::Warning,
                format!("{replicas} replica(s), the slowest {worst_lag} s behind"),
                "a failover now loses the locks of those seconds; min_replicas waits",
                "find what slows replication (network, disk, a busy replica)",
            );
        } else {
            add(
                "replication",
                Severity::Ok,
                format!("{replicas} replica(s), lag at most {worst_lag} s"),
                "",
                "",
            );
        }
    } else {
        // Without INFO: `ROLE` tells the role and the replicas (not their
        // lag), `HELLO` at least the role.
        let role = role(con).or_else(|| {
            hello
                .as_ref()
                .filter(|h| !h.role.is_empty())
                .map(|h| (h.role.clone(), None))
        });
        match role {
            Some((role, _)) if role != "master" => add(
                "replication",
                Severity::Error,
                format!("role {role}"),
                "a replica refuses the locks' writes",
                "point the client at the primary (or at the sentinels)",
            ),
            Some((_, Some(0))) => add(
                "replication",
                Severity::Info,
                "no replica".into(),
                "min_replicas can never be met, and a failover has nothing to promote",
                "add a replica if you use min_replicas or Sentinel",
            ),
            Some((_, Some(replicas))) => add(
                "replication",
                Severity::Unknown,
                format!("{replicas} replica(s); their lag not readable ({unread})"),
                "",
                READ_FIX,
            ),
            Some((_, None)) => add(
                "replication",
                Severity::Unknown,
                format!("a primary; its replicas not readable (ROLE and {unread})"),
                "",
                READ_FIX,
            ),
            None => add(
                "replication",
                Severity::Unknown,
                format!("role not readable (ROLE, HELLO and {unread})"),
                "",
                READ_FIX,
            ),
        }
    }

    // The clocks: leases do not depend on them, holder metadata does.
    match redis::cmd("TIME").query::<(u64, u64)>(con) {
        Ok((secs, micros)) => {
            // The reply is the network's: no overflow whatever it says.
            let server = Duration::from_secs(secs).saturating_add(Duration::from_micros(micros));
            let here = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            let (ahead, offset) = if server >= here {
                ("ahead of", server - here)
            } else {
                ("behind", here - server)
            };
            add(
                "clock",
                warning_above(offset, Duration::from_secs(60)),
                format!("the server's clock is {offset:.3?} {ahead} this machine's"),
                "holder metadata times are the server's; leases use no wall clock",
                "run NTP (chrony, systemd-timesyncd) on both",
            );
        }
        Err(err) => add(
            "clock",
            Severity::Unknown,
            format!("TIME refused ({err}): not checked"),
            "",
            "",
        ),
    }

    // Round trips, against the lease lengths that make sense.
    let mut times = Vec::new();
    let mut failed = None;
    for _ in 0..20 {
        let started = Instant::now();
        if let Err(err) = redis::cmd("PING").query::<String>(con) {
            failed = Some(err);
            break;
        }
        times.push(started.elapsed());
    }
    if !times.is_empty() {
        times.sort();
        let p50 = times[times.len() / 2];
        let p99 = times[times.len() - 1];
        add(
            "latency",
            warning_above(p99, Duration::from_millis(100)),
            format!(
                "PING p50 {p50:.1?}, p99 {p99:.1?} ({} round trips)",
                times.len()
            ),
            "every acquisition and renewal costs round trips; a ttl near them is lost",
            "a closer server, or a ttl of seconds at least",
        );
    } else if let Some(err) = failed {
        add(
            "latency",
            Severity::Unknown,
            format!("PING failed ({err}): not measured"),
            "",
            "",
        );
    }
}

/// A warning when `value` is above `limit`, else ok.
fn warning_above(value: Duration, limit: Duration) -> Severity {
    if value > limit {
        Severity::Warning
    } else {
        Severity::Ok
    }
}

/// A name the ACL check tries, derived from the sample lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Target {
    Lock,
    Fence,
    Marker,
    Channel,
}

/// The sample lock's key and the names the crate derives from it.
struct Names {
    lock: String,
    fence: String,
    marker: String,
    channel: String,
}

impl Names {
    fn of(client: &LockClient, name: &str) -> Names {
        let lock = client.key(name);
        Names {
            fence: client.fence_key(&lock),
            channel: client.release_channel(&lock),
            marker: marker_of(client.key_prefix(), &lock),
            lock,
        }
    }

    /// A probe's word, with a placeholder replaced by its name.
    fn fill(&self, word: &str) -> String {
        match placeholder(word) {
            Some(target) => self.name(target).to_owned(),
            None => word.to_owned(),
        }
    }

    fn name(&self, target: Target) -> &str {
        match target {
            Target::Lock => &self.lock,
            Target::Fence => &self.fence,
            Target::Marker => &self.marker,
            Target::Channel => &self.channel,
        }
    }

    /// Which of these a key named in a refusal is.
    fn key(&self, key: &str) -> Option<Target> {
        [Target::Lock, Target::Fence, Target::Marker]
            .into_iter()
            .find(|t| self.name(*t) == key)
    }
}

/// The name a probe's placeholder word stands for.
fn placeholder(word: &str) -> Option<Target> {
    match word {
        LOCK => Some(Target::Lock),
        FENCE => Some(Target::Fence),
        MARKER => Some(Target::Marker),
        CHANNEL => Some(Target::Channel),
        _ => None,
    }
}

/// A release marker of `key` (prefix included), as the crate names them
/// (`src/script/names.rs`, which the binary cannot reach): `{KEY}:released:ID`,
/// or `{TAG}:released:KEY:ID` for a key with a hash tag, after the prefix.
fn marker_of(prefix: &str, key: &str) -> String {
    let tag = key.find('{').and_then(|open| {
        let rest = &key[open + 1..];
        rest.find('}')
            .filter(|close| *close > 0)
            .map(|close| &rest[..close])
    });
    match tag {
        Some(tag) => format!("{prefix}{{{tag}}}:released:{key}:doctor"),
        None if key.contains('}') => format!("{prefix}redmutex:released:{key}:doctor"),
        None => format!("{prefix}{{{key}}}:released:doctor"),
    }
}

/// What an `ACL DRYRUN` refusal names: its reply ends "... to run the 'x'
/// command", "... to access the 'k' key" or "... the 'c' channel".
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    Command,
    Key(String),
    Channel,
    Other,
}

fn refusal(reason: &str) -> Refusal {
    let reason = reason.trim();
    let quoted = || {
        let (open, close) = (reason.find('\'')?, reason.rfind('\'')?);
        (open < close).then(|| reason[open + 1..close].to_owned())
    };
    if reason.ends_with("command") {
        Refusal::Command
    } else if reason.ends_with("channel") {
        Refusal::Channel
    } else if reason.ends_with("key") {
        Refusal::Key(quoted().unwrap_or_default())
    } else {
        Refusal::Other
    }
}

/// The user `cli` logs in as: `--user`, else the first URL's, else
/// `default`.
fn login_user(cli: &Cli) -> String {
    if let Some(user) = &cli.user {
        return user.clone();
    }
    let url = cli.url.split(',').next().unwrap_or_default().trim();
    url.find("://")
        .map(|scheme| &url[scheme + 3..])
        .and_then(|rest| rest.split('/').next())
        .and_then(|authority| authority.rfind('@').map(|at| &authority[..at]))
        .and_then(|credentials| credentials.split(':').next())
        .filter(|user| !user.is_empty())
        .map_or_else(|| "default".to_owned(), str::to_owned)
}

/// `ACL DRYRUN` (Redis 7) of every command the lock types send, their
/// scripts' `redis.call`s included, on a sample lock's key, fencing
/// counter, release marker and channel, for the logged-in user (or
/// `--acl-user`). Nothing is run: a dry run only asks the ACL.
fn acl(cli: &Cli, args: &DoctorArgs, client: &LockClient, findings: &mut Vec<Finding>) {
    let mut add = |severity, found: String, why, fix: String| {
        findings.push(Finding {
            check: "acl",
            node: "server".into(),
            severity,
            found,
            why,
            fix,
        });
    };
    let mut con = match client.connection() {
        Ok(con) => con,
        Err(err) => {
            add(
                Severity::Unknown,
                format!("no connection to check the ACL on: {err}"),
                "",
                String::new(),
            );
            return;
        }
    };
    // A lock user is refused ACL WHOAMI as it is ACL DRYRUN: the name it
    // logged in with is the one to check.
    let user = match &args.acl_user {
        Some(user) => user.clone(),
        None => redis::cmd("ACL")
            .arg("WHOAMI")
            .query::<String>(&mut con)
            .unwrap_or_else(|_| login_user(cli)),
    };
    let names = Names::of(client, args.key.as_deref().unwrap_or(SAMPLE));
    let deployment = client.deployment();
    let how_to = || {
        let key = args.key.as_deref().unwrap_or("LOCK");
        format!(
            "check it as a user allowed ACL DRYRUN (an admin), with the same --url and \
             --key-prefix: redmutex --user ADMIN doctor --acl-user {user} --key {key} \
             (LOCK: one of its lock names)"
        )
    };

    let mut missing: Vec<&'static Needed> = Vec::new();
    let mut refused: Vec<(Target, Vec<String>)> = Vec::new();
    let mut unchecked: Vec<String> = Vec::new();
    let mut checked: Vec<String> = Vec::new();
    for words in PROBES {
        let name = rule_name(words);
        let Some(need) = needed_for(&name) else {
            continue;
        };
        // ACL DRYRUN came with 7.0: a server that answers it has what 7.0
        // has.
        if !need.when.applies(deployment, Some((7, 0))) {
            continue;
        }
        if !checked.contains(&name) {
            checked.push(name.clone());
        }
        let mut dry = redis::cmd("ACL");
        dry.arg("DRYRUN").arg(&user);
        for word in *words {
            dry.arg(names.fill(word));
        }
        match dry.query::<String>(&mut con) {
            Ok(answer) if answer == "OK" => {}
            // A refusal is a string saying why.
            Ok(reason) => {
                let target = match refusal(&reason) {
                    Refusal::Command => {
                        if !missing.iter().any(|m| m.name == need.name) {
                            missing.push(need);
                        }
                        continue;
                    }
                    Refusal::Channel => Target::Channel,
                    Refusal::Key(key) => names
                        .key(&key)
                        .or_else(|| words.iter().find_map(|w| placeholder(w)))
                        .unwrap_or(Target::Lock),
                    Refusal::Other => {
                        unchecked.push(format!("{} ({reason})", shown_name(&name)));
                        continue;
                    }
                };
                let shown = shown_name(&name);
                match refused.iter_mut().find(|(t, _)| *t == target) {
                    Some((_, commands)) if !commands.contains(&shown) => commands.push(shown),
                    Some(_) => {}
                    None => refused.push((target, vec![shown])),
                }
            }
            Err(err) => {
                let text = err.to_string();
                let lower = text.to_lowercase();
                let about_dryrun = if lower.contains("unknown subcommand") {
                    Some((
                        format!("user {user}: not checked, ACL DRYRUN needs Redis 7"),
                        "compare its rule with the ACL rules of the guide: https://docs.rs/redmutex/latest/redmutex/guide/failure_model/index.html#acl-rules".to_owned(),
                    ))
                } else if no_permission(&err) {
                    let who = if args.acl_user.is_some() {
                        "the logged-in user"
                    } else {
                        "it"
                    };
                    Some((
                        format!(
                            "user {user}: not checked, {who} may not run ACL DRYRUN \
                             (the documented ACL rule does not allow it); \
                             an admin can, with --acl-user {user}"
                        ),
                        how_to(),
                    ))
                } else if lower.contains("user '") {
                    Some((
                        format!("user {user}: not checked ({text})"),
                        "name an existing user with --acl-user".to_owned(),
                    ))
                } else if !answered(&err) {
                    Some((
                        format!("user {user}: the check was cut short ({text})"),
                        String::new(),
                    ))
                } else {
                    None
                };
                if let Some((found, fix)) = about_dryrun {
                    add(Severity::Unknown, found, "", fix);
                    return;
                }
                // A command the server does not know (renamed or
                // disabled): the commands check reports it.
                unchecked.push(format!("{} ({text})", shown_name(&name)));
            }
        }
    }

    let mut parts = Vec::new();
    let mut worst = Severity::Ok;
    for need in &missing {
        parts.push(format!(
            "{}: {} refused",
            need.breaks,
            shown_name(need.name)
        ));
        worst = worst.max(need.severity);
    }
    refused.sort();
    // The sample key stands for the user's locks only when they may use
    // it: refused, it says nothing about them.
    let sample_refused =
        args.key.is_none() && refused.iter().any(|(target, _)| *target == Target::Lock);
    if sample_refused {
        parts.push(format!(
            "the sample key {:?} is refused, so keys and channels were not checked",
            names.lock
        ));
        worst = worst.max(Severity::Unknown);
    } else {
        for (target, commands) in &refused {
            let (severity, what) = match target {
                Target::Lock => (Severity::Error, "no lock on this key can be taken"),
                Target::Fence => (
                    Severity::Warning,
                    "fencing tokens fail (a fenced lock or permit is refused)",
                ),
                Target::Marker => (
                    Severity::Warning,
                    "releases leave no marker (a release whose reply is lost says OutcomeUnknown; force_release is a bare GETDEL)",
                ),
                Target::Channel => (
                    Severity::Warning,
                    "releases are not announced (waiters poll instead of being woken)",
                ),
            };
            parts.push(format!(
                "{what}: {} on {:?} refused",
                commands.join(", "),
                names.name(*target)
            ));
            worst = worst.max(severity);
        }
    }
    for command in &unchecked {
        parts.push(format!("not checked: {command}"));
        worst = worst.max(Severity::Unknown);
    }

    if parts.is_empty() {
        add(
            Severity::Ok,
            format!(
                "user {user} may send all {} commands the locks send (their scripts' too) \
                 to {:?}, its fencing counter, release markers and channel",
                checked.len(),
                names.lock
            ),
            "",
            String::new(),
        );
        return;
    }
    let mut fix = Vec::new();
    if !missing.is_empty() {
        let grants: Vec<String> = missing.iter().map(|n| format!("+{}", n.name)).collect();
        fix.push(format!("ACL SETUSER {user} {}", grants.join(" ")));
    }
    if !sample_refused {
        for (target, _) in &refused {
            fix.push(
                match target {
                    Target::Lock => "a key pattern for its locks (~locks:*)",
                    Target::Fence | Target::Marker => {
                        "a key pattern for its locks' {KEY}:* keys (~{locks:* beside ~locks:*)"
                    }
                    Target::Channel => {
                        "a channel pattern for the release channels (&redmutex:released:*)"
                    }
                }
                .to_owned(),
            );
        }
        fix.dedup();
    }
    if !fix.is_empty() {
        fix.push(
            "the whole rule, and the one for a key prefix: https://docs.rs/redmutex/latest/redmutex/guide/failure_model/index.html#acl-rules"
                .to_owned(),
        );
    }
    if sample_refused {
        fix.push("name one of the user's locks with --key to check its keys".to_owned());
    }
    let fails = !missing.is_empty() || refused.iter().any(|(t, _)| *t == Target::Lock);
    let why = if worst < Severity::Warning {
        ""
    } else if fails {
        "what needs a refused command or key fails with NOPERM, inside the scripts too \
         (a renewal refused ends `redmutex run` with 75)"
    } else {
        "locks work, without what the refused names carry (fencing tokens, release markers, release messages)"
    };
    add(
        worst,
        format!("user {user}: {}", parts.join("; ")),
        why,
        fix.join("; "),
    );
}

/// Whether `err` is the server's `NOPERM`: the doctor's user may not ask.
fn no_permission(err: &redis::RedisError) -> bool {
    err.code() == Some("NOPERM")
}

/// A cluster: its state, then every check on each primary.
fn cluster(cli: &Cli, client: &LockClient, findings: &mut Vec<Finding>) -> Result<(), Failure> {
    let mut con = connection(client)?;
    let refused = |findings: &mut Vec<Finding>, what: &str, err: &redis::RedisError| {
        findings.push(Finding {
            check: "cluster",
            node: "cluster".into(),
            severity: Severity::Unknown,
            found: format!("{what} refused ({err}): the cluster and its primaries not checked"),
            why: "",
            fix: "run doctor as a user allowed CLUSTER INFO and CLUSTER NODES (an admin)".into(),
        });
    };
    let state: String = match redis::cmd("CLUSTER").arg("INFO").query(&mut con) {
        Ok(state) => state,
        Err(err) if answered(&err) => {
            refused(findings, "CLUSTER INFO", &err);
            return Ok(());
        }
        Err(err) => return Err(redis_failure(Error::Redis(err))),
    };
    let ok = field(&state, "cluster_state") == Some("ok");
    findings.push(Finding {
        check: "cluster",
        node: "cluster".into(),
        severity: if ok { Severity::Ok } else { Severity::Error },
        found: format!(
            "cluster_state {}, {} slots served",
            field(&state, "cluster_state").unwrap_or("unknown"),
            field(&state, "cluster_slots_ok").unwrap_or("?")
        ),
        why: "keys of unserved slots cannot be locked",
        fix: "fix the cluster (redis-cli --cluster check)".into(),
    });
    let nodes: String = match redis::cmd("CLUSTER").arg("NODES").query(&mut con) {
        Ok(nodes) => nodes,
        Err(err) if answered(&err) => {
            refused(findings, "CLUSTER NODES", &err);
            return Ok(());
        }
        Err(err) => return Err(redis_failure(Error::Redis(err))),
    };
    let scheme = if cli.url.trim_start().starts_with("rediss://") {
        "rediss"
    } else {
        "redis"
    };
    for line in nodes.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let (Some(address), Some(flags)) = (fields.get(1), fields.get(2)) else {
            continue;
        };
        if !flags.contains("master") || flags.contains("fail") {
            continue;
        }
        let address = address.split('@').next().unwrap_or(address);
        let node = builder_for(cli, &format!("{scheme}://{address}/"))
            .build()
            .and_then(|c| c.connection());
        match node {
            Ok(mut node_con) => server(
                &mut node_con,
                address,
                redmutex::Deployment::Cluster,
                findings,
            ),
            Err(err) => findings.push(Finding {
                check: "cluster",
                node: address.to_owned(),
                severity: Severity::Error,
                found: format!("primary unreachable: {err}"),
                why: "its slots' locks cannot be taken or released",
                fix: "bring the node back, or fail it over".into(),
            }),
        }
    }
    Ok(())
}

/// Each sentinel: reachable, and agreeing that the master can be failed
/// over (`SENTINEL CKQUORUM`).
fn sentinels(cli: &Cli, findings: &mut Vec<Finding>) {
    let Some(master) = &cli.sentinel else {
        return;
    };
    for url in cli.url.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let reply = redis::Client::open(url).and_then(|c| {
            let mut con = c.get_connection_with_timeout(Duration::from_secs(2))?;
            con.set_read_timeout(Some(Duration::from_secs(2)))?;
            redis::cmd("SENTINEL")
                .arg("CKQUORUM")
                .arg(master)
                .query::<String>(&mut con)
        });
        let (severity, found) = match reply {
            Ok(text) => (Severity::Ok, text),
            Err(err) if no_permission(&err) => (
                Severity::Unknown,
                format!("SENTINEL CKQUORUM refused ({err}): not checked"),
            ),
            Err(err) => (Severity::Error, err.to_string()),
        };
        let (why, fix) = if severity == Severity::Unknown {
            (
                "",
                "give the sentinel URLs a user allowed SENTINEL CKQUORUM",
            )
        } else {
            (
                "without a quorum no failover happens: locks stop when the primary dies",
                "run at least three sentinels that see each other and the primary",
            )
        };
        findings.push(Finding {
            check: "sentinel",
            node: crate::redact(url),
            severity,
            found,
            why,
            fix: fix.into(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A script's calls: the command each `redis.call`/`redis.pcall`
    /// names, and what its first argument is (`KEYS[1]`, `KEYS[2]`,
    /// `ARGV[n]`, or nothing).
    fn calls(script: &str) -> Vec<(String, String)> {
        let mut found = Vec::new();
        for opening in ["redis.call(", "redis.pcall("] {
            for (at, _) in script.match_indices(opening) {
                let rest = script[at + opening.len()..].trim_start();
                let quote = rest.chars().next().filter(|c| *c == '\'' || *c == '"');
                let Some(quote) = quote else {
                    panic!("a call whose command is not a literal: {rest:.40}");
                };
                let rest = &rest[1..];
                let end = rest.find(quote).expect("a closed literal");
                let command = rest[..end].to_lowercase();
                let after = rest[end + 1..].trim_start();
                let first = after
                    .strip_prefix(',')
                    .map(|args| {
                        args.trim_start()
                            .split([',', ')'])
                            .next()
                            .unwrap_or_default()
                            .trim()
                            .to_owned()
                    })
                    .unwrap_or_default();
                found.push((command, first));
            }
        }
        found
    }

    /// What a script's key `name` (`KEYS[2]`, or a local the script
    /// names its keys by) is, from its header: a fencing counter, a
    /// marker, or a fair lock's queue or deadlines (`{KEY}:…` names, as
    /// the markers, which the probes stand them for).
    fn named_key(script: &str, name: &str) -> Option<Target> {
        match name {
            "KEYS[1]" | "KEYS[i]" => return Some(Target::Lock),
            "counter" => return Some(Target::Fence),
            "marker" => return Some(Target::Marker),
            "channel" => return Some(Target::Channel),
            _ => {}
        }
        let line = script
            .lines()
            .find(|l| l.starts_with(&format!("-- {name}")))?;
        if line.contains("fenc") {
            Some(Target::Fence)
        } else if line.contains("marker") || line.contains("queue") || line.contains("deadline") {
            Some(Target::Marker)
        } else {
            None
        }
    }

    fn probed(command: &str, target: Option<Target>) -> bool {
        PROBES.iter().any(|words| {
            rule_name(words) == command
                && match target {
                    // The key a command is sent with is its first argument.
                    Some(target) => words.get(1).and_then(|w| placeholder(w)) == Some(target),
                    None => words.len() == 1,
                }
        })
    }

    /// Every `redis.call`/`redis.pcall` in every script of `lua/` (read
    /// from the directory, so a new script is covered too) is dry-run by
    /// the ACL check on the name it is called with.
    #[test]
    fn every_call_of_every_script_is_checked() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/lua");
        let mut scripts = 0;
        let mut seen = 0;
        for entry in std::fs::read_dir(dir).expect("lua/") {
            let path = entry.expect("an entry").path();
            if path.extension().is_none_or(|e| e != "lua") {
                continue;
            }
            scripts += 1;
            let script = std::fs::read_to_string(&path).expect("a script");
            for (command, first) in calls(&script) {
                seen += 1;
                let target = match first.as_str() {
                    "" => None,
                    argv if argv.starts_with("ARGV[") => Some(Target::Channel),
                    key => Some(named_key(&script, key).unwrap_or_else(|| {
                        panic!(
                            "{path:?}: {command} on {key}: which name is that? (its header \
                             says neither fence, marker, queue nor deadline)"
                        )
                    })),
                };
                assert!(
                    needed_for(&command).is_some(),
                    "{path:?} calls {command}, which NEEDED lacks"
                );
                assert!(
                    probed(&command, target),
                    "{path:?} calls {command} on {target:?}, which no probe tries"
                );
            }
        }
        assert!(
            scripts >= 23 && seen >= 150,
            "{scripts} scripts, {seen} calls"
        );
    }

    #[test]
    fn every_probe_is_a_needed_command_and_every_needed_command_is_probed() {
        for words in PROBES {
            assert!(needed_for(&rule_name(words)).is_some(), "{words:?}");
        }
        for need in NEEDED {
            assert!(
                PROBES.iter().any(|words| rule_name(words) == need.name),
                "{} is never dry-run",
                need.name
            );
        }
    }

    /// The rule of docs/failure-model.md grants exactly the commands the
    /// check asks for on a single server or through Sentinel; the
    /// cluster's are the additions that page names.
    #[test]
    fn the_documented_rule_grants_what_is_checked() {
        let page = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/docs/failure-model.md"
        ))
        .expect("docs/failure-model.md");
        let rule = page
            .lines()
            .find(|l| l.starts_with("ACL SETUSER locker "))
            .expect("the rule");
        let granted: Vec<&str> = rule
            .split_whitespace()
            .filter_map(|w| w.strip_prefix('+'))
            .collect();
        for need in NEEDED {
            let in_rule = granted.contains(&need.name);
            match need.when {
                When::Always | When::Since62 | When::Sentinel => {
                    assert!(in_rule, "the rule lacks +{}", need.name)
                }
                When::Cluster | When::Sharded => assert!(
                    !in_rule && page.contains(&format!("+{}", need.name)),
                    "+{} is a documented addition for clusters",
                    need.name
                ),
            }
        }
        for grant in granted {
            assert!(
                needed_for(grant).is_some(),
                "+{grant} is granted, never checked"
            );
        }
    }

    #[test]
    fn markers_are_named_as_the_crate_names_them() {
        for prefix in ["", "teamA:"] {
            let client = LockClient::builder()
                .url("redis://127.0.0.1:1/")
                .key_prefix(prefix)
                .build()
                .expect("a client (not connected)");
            for name in ["job", "locks:x", "user:{42}:lock", "odd}key"] {
                let key = client.key(name);
                // Markers and fencing counters are named alike: `:fence`
                // where a marker has `:released` and its id.
                let expected = format!(
                    "{}:doctor",
                    client.fence_key(&key).replacen(":fence", ":released", 1)
                );
                assert_eq!(marker_of(prefix, &key), expected, "{prefix}{name}");
            }
        }
    }

    #[test]
    fn refusals_are_told_apart() {
        assert_eq!(
            refusal("This user has no permissions to run the 'pexpire' command"),
            Refusal::Command
        );
        assert_eq!(
            refusal("User locker has no permissions to access the 'a key' key"),
            Refusal::Key("a key".into())
        );
        assert_eq!(
            refusal("This user has no permissions to access the 'redmutex:x' channel"),
            Refusal::Channel
        );
        assert_eq!(refusal("something else"), Refusal::Other);
        assert_eq!(rule_name(&["SCRIPT", "LOAD", "x"]), "script|load");
        assert_eq!(shown_name("client|setname"), "CLIENT SETNAME");
    }

    #[test]
    fn unknown_is_worse_than_info_and_exits_0() {
        assert!(Severity::Info < Severity::Unknown && Severity::Unknown < Severity::Warning);
        assert_eq!(Severity::Unknown.exit_code(), 0);
        assert_eq!(Severity::Unknown.name(), "unknown");
    }
}
