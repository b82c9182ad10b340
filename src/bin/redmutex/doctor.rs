//! `redmutex doctor`: checks a deployment for what the failure model says
//! breaks locks (docs/failure-model.md, docs/operating.md), and says what
//! to change. Read-only: it sends `INFO`, `CONFIG GET`, `COMMAND INFO`,
//! `ACL WHOAMI`/`ACL DRYRUN`, `TIME`, `PING`, `CLUSTER INFO`/`NODES` and
//! `SENTINEL CKQUORUM`, never a write.

#[allow(unused_imports)]
use super::*;

/// How bad a finding is; the worst decides the exit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Severity {
    Ok,
    Info,
    Warning,
    Error,
}

impl Severity {
    fn name(self) -> &'static str {
        match self {
            Severity::Ok => "ok",
            Severity::Info => "info",
            Severity::Warning => "warning",
            Severity::Error => "error",
        }
    }

    /// 0 when nothing is worse than info, [`EXIT_DOCTOR_WARNING`] or
    /// [`EXIT_DOCTOR_ERROR`].
    fn exit_code(self) -> u8 {
        match self {
            Severity::Ok | Severity::Info => 0,
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
    fix: &'static str,
}

/// The commands the crate sends (the ACL rule of docs/failure-model.md),
/// each with what needs it.
const NEEDED: &[(&str, &str)] = &[
    ("SET", "every acquisition"),
    ("GET", "every lock type"),
    ("EVALSHA", "every lock type (Lua scripts)"),
    ("SCRIPT", "loading the scripts"),
    ("PTTL", "waiting for a holder's lease"),
    ("PEXPIRE", "the watchdog"),
    ("PUBLISH", "release messages"),
    ("SUBSCRIBE", "notify waiting"),
    ("WAIT", "min_replicas"),
    ("TIME", "holder metadata"),
    ("GETDEL", "force_release without release markers"),
    ("WATCH", "Release::Watch"),
];

pub(super) fn doctor(cli: &Cli, args: &DoctorArgs) -> Result<u8, Failure> {
    let client = client(cli)?;
    let mut findings = Vec::new();
    let target = redact_url(&cli.url);
    match client.deployment() {
        redmutex::Deployment::Cluster => cluster(cli, &client, &mut findings)?,
        redmutex::Deployment::Sentinel => {
            sentinels(cli, &mut findings);
            let mut con = connection(&client)?;
            server(&mut con, "primary", &mut findings);
        }
        _ => {
            let mut con = connection(&client)?;
            server(&mut con, "server", &mut findings);
        }
    }
    acl(&client, &mut findings);
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
                    json_string(f.fix)
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
            if f.severity >= Severity::Warning {
                output::outln!("{:<21} why: {}", "", f.why);
                output::outln!("{:<21} fix: {}", "", f.fix);
            }
        }
        output::outln!("worst: {} (exit {})", worst.name(), worst.exit_code());
    }
    Ok(worst.exit_code())
}

/// The URL(s) without a password.
fn redact_url(urls: &str) -> String {
    urls.split(',')
        .map(|url| match (url.find("://"), url.rfind('@')) {
            (Some(scheme), Some(at)) if at > scheme => {
                format!("{}://…@{}", &url[..scheme], &url[at + 1..])
            }
            _ => url.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(",")
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

/// Every check of one server (a single server, the primary Sentinel
/// names, or one primary of a cluster), into `findings`.
fn server(con: &mut dyn redis::ConnectionLike, node: &str, findings: &mut Vec<Finding>) {
    let mut add = |check, severity, found: String, why, fix| {
        findings.push(Finding {
            check,
            node: node.to_owned(),
            severity,
            found,
            why,
            fix,
        });
    };
    let info: String = match redis::cmd("INFO").query(con) {
        Ok(info) => info,
        Err(err) => {
            add(
                "server",
                Severity::Error,
                format!("INFO failed: {err}"),
                "nothing else can be checked",
                "allow INFO to this user, or check the server by hand",
            );
            return;
        }
    };

    // The server against the tested matrix.
    let valkey = field(&info, "server_name") == Some("valkey");
    let version = field(&info, "valkey_version")
        .filter(|_| valkey)
        .or_else(|| field(&info, "redis_version"))
        .unwrap_or("unknown")
        .to_owned();
    let major_minor: Vec<u32> = version
        .split('.')
        .take(2)
        .map(|p| p.parse().unwrap_or(0))
        .collect();
    let (major, minor) = (
        major_minor.first().copied().unwrap_or(0),
        major_minor.get(1).copied().unwrap_or(0),
    );
    let kind = if valkey { "Valkey" } else { "Redis" };
    let found = format!("{kind} {version}");
    match (valkey, major, minor) {
        (true, _, _) | (false, 7.., _) => add(
            "version",
            Severity::Ok,
            format!("{found}: tested (docs/deployments.md, Servers)"),
            "",
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

    // Commands refused or renamed away (managed services do both).
    // GETDEL came with 6.2: before, the version finding says so.
    let needed: Vec<&(&str, &str)> = NEEDED
        .iter()
        .filter(|(name, _)| *name != "GETDEL" || valkey || (major, minor) >= (6, 2))
        .collect();
    let mut probe = redis::cmd("COMMAND");
    probe.arg("INFO");
    for (name, _) in &needed {
        probe.arg(*name);
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
                    format!("all {} commands the locks send are there", needed.len()),
                    "",
                    "",
                );
            } else {
                add(
                    "commands",
                    Severity::Error,
                    format!("missing (renamed or disabled): {}", missing.join(", ")),
                    "what needs them fails with Error::Unsupported",
                    "enable the commands (rename-command, the service's command policy)",
                );
            }
        }
        Err(err) => add(
            "commands",
            Severity::Info,
            format!("COMMAND INFO refused ({err}): not checked"),
            "",
            "",
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
            Severity::Info,
            "maxmemory-policy not readable: not checked".into(),
            "",
            "",
        ),
    }

    // Persistence: what a restart forgets.
    let aof = field(&info, "aof_enabled") == Some("1");
    let fsync = config(con, "appendfsync");
    let save = config(con, "save");
    let rdb = save.as_deref().is_some_and(|s| !s.trim().is_empty());
    match (aof, fsync.as_deref(), rdb) {
        (true, Some("always"), _) => add(
            "persistence",
            Severity::Ok,
            "AOF with appendfsync always".into(),
            "",
            "",
        ),
        (true, fsync, _) => add(
            "persistence",
            Severity::Info,
            format!("AOF with appendfsync {}", fsync.unwrap_or("unknown")),
            "a crash forgets the locks of the last second",
            "appendfsync always, or fencing tokens at the resource",
        ),
        (false, _, true) => add(
            "persistence",
            Severity::Warning,
            "RDB snapshots only".into(),
            "a restart forgets every lock taken since the last snapshot; their holders go on",
            "appendonly yes (appendfsync always or everysec), and fencing tokens",
        ),
        (false, _, false) if save.is_none() => add(
            "persistence",
            Severity::Warning,
            "no AOF; RDB settings not readable".into(),
            "a restart may forget held locks while their holders go on",
            "appendonly yes, and fencing tokens",
        ),
        (false, _, false) => add(
            "persistence",
            Severity::Warning,
            "none (no AOF, no RDB snapshots)".into(),
            "a restart forgets every lock while their holders go on",
            "appendonly yes (or replicas and min_replicas), and fencing tokens",
        ),
    }

    // Replicas: failover and min_replicas.
    let role = field(&info, "role").unwrap_or("unknown");
    if role != "master" {
        add(
            "replication",
            Severity::Error,
            format!("role {role}"),
            "a replica refuses the locks' writes",
            "point the client at the primary (or at the sentinels)",
        );
    } else {
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
        if replicas == 0 {
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
    }

    // The clocks: leases do not depend on them, holder metadata does.
    if let Ok((secs, micros)) = redis::cmd("TIME").query::<(u64, u64)>(con) {
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

    // Round trips, against the lease lengths that make sense.
    let mut times = Vec::new();
    for _ in 0..20 {
        let started = Instant::now();
        if redis::cmd("PING").query::<String>(con).is_err() {
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

/// `ACL DRYRUN` (Redis 7) of what a lock sends, for a sample key and its
/// channel, as the current user.
fn acl(client: &LockClient, findings: &mut Vec<Finding>) {
    let Ok(mut con) = client.connection() else {
        return;
    };
    let mut add = |severity, found: String, why, fix| {
        findings.push(Finding {
            check: "acl",
            node: "server".into(),
            severity,
            found,
            why,
            fix,
        });
    };
    let user: String = match redis::cmd("ACL").arg("WHOAMI").query(&mut con) {
        Ok(user) => user,
        Err(err) => {
            add(
                Severity::Info,
                format!("ACL WHOAMI refused ({err}): not checked"),
                "",
                "",
            );
            return;
        }
    };
    let key = client.key("redmutex-doctor-sample");
    let channel = client.release_channel(&key);
    let fence = client.fence_key(&key);
    // The sample key has no hash tag: its markers are `{KEY}:released:*`.
    let marker = format!("{{{key}}}:released:doctor");
    let set = |parts: &[&str]| {
        parts
            .iter()
            .map(|p| (*p).to_owned())
            .collect::<Vec<String>>()
    };
    // On a cluster, releases are announced by sharded pub/sub (ACL DRYRUN
    // itself needs 7.0, as sharded pub/sub does).
    let (publish, subscribe) = if client.deployment() == redmutex::Deployment::Cluster {
        ("SPUBLISH", "SSUBSCRIBE")
    } else {
        ("PUBLISH", "SUBSCRIBE")
    };
    let probes: Vec<(Vec<String>, &str, Severity)> = vec![
        (
            set(&["SET", &key, "v", "NX", "PX", "1000"]),
            "taking a lock",
            Severity::Error,
        ),
        (
            set(&["EVALSHA", &"0".repeat(40), "1", &key]),
            "the scripts",
            Severity::Error,
        ),
        (
            set(&["PSETEX", &marker, "1000", "1"]),
            "release markers",
            Severity::Warning,
        ),
        (set(&["INCR", &fence]), "fencing tokens", Severity::Warning),
        (
            set(&[publish, &channel, "x"]),
            "release messages",
            Severity::Warning,
        ),
        (
            set(&[subscribe, &channel]),
            "notify waiting",
            Severity::Warning,
        ),
    ];
    let mut refused = Vec::new();
    let mut worst = Severity::Ok;
    for (command, what, severity) in &probes {
        let mut dry = redis::cmd("ACL");
        dry.arg("DRYRUN").arg(&user);
        for part in command {
            dry.arg(part);
        }
        let refusal = match dry.query::<String>(&mut con) {
            Ok(answer) if answer == "OK" => continue,
            // A refusal is a string saying why.
            Ok(answer) => answer,
            Err(err)
                if err
                    .to_string()
                    .to_lowercase()
                    .contains("unknown subcommand") =>
            {
                add(
                    Severity::Info,
                    format!(
                        "user {user}: ACL DRYRUN needs Redis 7; check the rule in docs/failure-model.md"
                    ),
                    "",
                    "",
                );
                return;
            }
            Err(err) => err.to_string(),
        };
        refused.push(format!("{} for {what} ({refusal})", command[0]));
        worst = worst.max(*severity);
    }
    if refused.is_empty() {
        add(
            Severity::Ok,
            format!("user {user} may take, fence, release and wait for {key:?}"),
            "",
            "",
        );
    } else {
        add(
            worst,
            format!("user {user} is refused: {}", refused.join("; ")),
            "locks fail with NOPERM (an error), or go without markers, fencing or release messages (a warning)",
            "grant the rule in docs/failure-model.md (ACL rules)",
        );
    }
}

/// A cluster: its state, then every check on each primary.
fn cluster(cli: &Cli, client: &LockClient, findings: &mut Vec<Finding>) -> Result<(), Failure> {
    let mut con = connection(client)?;
    let state: String = redis::cmd("CLUSTER")
        .arg("INFO")
        .query(&mut con)
        .map_err(|e| redis_failure(Error::Redis(e)))?;
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
        fix: "fix the cluster (redis-cli --cluster check)",
    });
    let nodes: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query(&mut con)
        .map_err(|e| redis_failure(Error::Redis(e)))?;
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
            Ok(mut node_con) => server(&mut node_con, address, findings),
            Err(err) => findings.push(Finding {
                check: "cluster",
                node: address.to_owned(),
                severity: Severity::Error,
                found: format!("primary unreachable: {err}"),
                why: "its slots' locks cannot be taken or released",
                fix: "bring the node back, or fail it over",
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
            Err(err) => (Severity::Error, err.to_string()),
        };
        findings.push(Finding {
            check: "sentinel",
            node: redact_url(url),
            severity,
            found,
            why: "without a quorum no failover happens: locks stop when the primary dies",
            fix: "run at least three sentinels that see each other and the primary",
        });
    }
}
