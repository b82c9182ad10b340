//! The `redmutex` command against a private redis-server.
#![cfg(feature = "cli")]

use redmutex_test_support as support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use assert_cmd::cargo::CommandCargoExt;
use redis::Commands;
use redmutex::Lease;
use support::processes::{gone, read_pid, wait_exit};
use support::{RedisServer, wait_until};

fn redmutex(server: &RedisServer) -> Command {
    let mut command = Command::cargo_bin("redmutex").expect("the redmutex binary");
    command.env("REDMUTEX_URL", server.url());
    command
}

fn held(server: &RedisServer, key: &str) -> Option<String> {
    server.conn().get(key).expect("GET")
}

#[test]
fn two_racing_runs_take_turns_and_no_wait_gives_up() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("log");
    let script = |name: &str| {
        format!(
            "echo {name} start >> {log}; sleep 1; echo {name} end >> {log}",
            log = log.display()
        )
    };
    let mut first = redmutex(&server)
        .args(["run", "job", "--", "sh", "-c", &script("first")])
        .spawn()
        .expect("first run");
    assert!(wait_until(Duration::from_secs(10), || held(&server, "job").is_some()));

    let marker = dir.path().join("no-wait-ran");
    let no_wait = redmutex(&server)
        .args(["run", "--no-wait", "job", "--", "touch"])
        .arg(&marker)
        .output()
        .expect("no-wait run");
    assert_eq!(no_wait.status.code(), Some(1), "flock's conflict code");
    assert!(!marker.exists(), "the command must not run");
    let stderr = String::from_utf8_lossy(&no_wait.stderr);
    assert!(stderr.contains("held by"), "{stderr}");

    let custom = redmutex(&server)
        .args([
            "run",
            "--no-wait",
            "--conflict-exit-code",
            "9",
            "job",
            "--",
            "true",
        ])
        .status()
        .expect("run");
    assert_eq!(custom.code(), Some(9));

    let second = redmutex(&server)
        .args([
            "run",
            "--wait",
            "20s",
            "job",
            "--",
            "sh",
            "-c",
            &script("second"),
        ])
        .status()
        .expect("second run");
    assert!(second.success());
    assert!(first.wait().expect("first").success());
    let lines: Vec<String> = std::fs::read_to_string(&log)
        .expect("log")
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(
        lines,
        ["first start", "first end", "second start", "second end"]
    );
    assert_eq!(held(&server, "job"), None, "released after the second run");
}

#[test]
fn the_childs_exit_code_and_environment_pass_through() {
    let server = RedisServer::start();
    let out = redmutex(&server)
        .args([
            "run",
            "--fencing",
            "env-job",
            "--",
            "sh",
            "-c",
            "echo \"$REDMUTEX_KEY $REDMUTEX_TOKEN $REDMUTEX_FENCING_TOKEN\"; exit 7",
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(7));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let fields: Vec<&str> = stdout.split_whitespace().collect();
    assert_eq!(fields.len(), 3, "{stdout}");
    assert_eq!(fields[0], "env-job");
    // A secret (128 bits, base64url), then the holder metadata: host, pid,
    // program, time, label.
    let token: Vec<&str> = fields[1].split('|').collect();
    assert_eq!(token.len(), 6, "{}", fields[1]);
    assert_eq!(token[0].len(), 22, "a 128-bit secret");
    assert_eq!(token[3], "sh", "the command is the program");
    let fence: u64 = fields[2].parse().expect("a fencing token");
    assert!(
        support::clock_floored(fence),
        "the first fencing token: {fence}"
    );
    // A permit is fenced the same way.
    let out = redmutex(&server)
        .args([
            "run",
            "--fencing",
            "--limit",
            "2",
            "env-sem",
            "--",
            "sh",
            "-c",
            "echo \"$REDMUTEX_FENCING_TOKEN\"",
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(0));
    let permit_fence: u64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("a permit's fencing token");
    assert!(support::clock_floored(permit_fence), "{permit_fence}");
    // A death by signal is reported the way shells do: 128 + N.
    let killed = redmutex(&server)
        .args(["run", "sig-job", "--", "sh", "-c", "kill -9 $$"])
        .status()
        .expect("run");
    assert_eq!(killed.code(), Some(128 + 9));
}

#[test]
fn a_lock_lost_mid_run_terminates_the_child_with_code_75() {
    let server = RedisServer::start();
    let started = Instant::now();
    let run = redmutex(&server)
        .args([
            "run",
            "--ttl",
            "900ms",
            "--kill-after",
            "2s",
            "lost",
            "--",
            "sleep",
            "30",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || held(
        &server, "lost"
    )
    .is_some()));
    let _: () = server
        .conn()
        .set("lost", "someone-else")
        .expect("overwrite the key");
    let out = run.wait_with_output().expect("run ends");
    assert_eq!(out.status.code(), Some(75));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("lost the lock"), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the child was not left running"
    );
    assert_eq!(
        held(&server, "lost").as_deref(),
        Some("someone-else"),
        "not touched"
    );
}

#[test]
fn sigterm_to_redmutex_ends_the_child_and_frees_the_key() {
    let server = RedisServer::start();
    let mut run = redmutex(&server)
        .args(["run", "term", "--", "sleep", "30"])
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || held(
        &server, "term"
    )
    .is_some()));
    signal(run.id(), "TERM");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = run.try_wait().expect("wait") {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "redmutex did not end"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        status.code(),
        Some(128 + 15),
        "the child died of the passed SIGTERM"
    );
    assert_eq!(held(&server, "term"), None, "the key is free");
}

#[test]
fn status_json_parses_and_release_is_owner_checked() {
    let server = RedisServer::start();
    let free = redmutex(&server)
        .args(["status", "--json", "st"])
        .output()
        .expect("status");
    assert!(free.status.success());
    let json: serde_json::Value = serde_json::from_slice(&free.stdout).expect("JSON");
    assert_eq!(json["key"], "st");
    assert_eq!(json["held"], false);

    let _: () = redis::cmd("SET")
        .arg("st")
        .arg("tok-123")
        .arg("PX")
        .arg(60_000)
        .query(&mut server.conn())
        .expect("SET");
    let out = redmutex(&server)
        .args(["status", "st", "--json", "--tokens"])
        .output()
        .expect("status");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json["held"], true);
    assert_eq!(json["token"], "tok-123");
    assert_eq!(json["holder"], serde_json::Value::Null, "no metadata");
    assert!(json["ttl_ms"].as_i64().expect("ttl") > 50_000);

    let wrong = redmutex(&server)
        .args(["release", "st", "--token", "not-it"])
        .status()
        .expect("release");
    assert_eq!(wrong.code(), Some(1));
    assert_eq!(
        held(&server, "st").as_deref(),
        Some("tok-123"),
        "nothing changed"
    );
    let right = redmutex(&server)
        .args(["release", "st", "--token", "tok-123"])
        .status()
        .expect("release");
    assert!(right.success());
    assert_eq!(held(&server, "st"), None);

    let _: () = server.conn().set("st", "stuck").expect("SET");
    let forced = redmutex(&server)
        .args(["release", "st", "--force"])
        .output()
        .expect("release --force");
    assert!(forced.status.success());
    let said = String::from_utf8_lossy(&forced.stdout);
    assert!(said.contains("deleted"), "{said}");
    assert!(!said.contains("stuck"), "the token is a secret: {said}");
    assert_eq!(held(&server, "st"), None);
}

/// `--key-prefix` (or `REDMUTEX_KEY_PREFIX`) names every key: `run` takes
/// `PREFIX KEY`, `status` and `release` look there, and the unprefixed key
/// is another lock.
#[test]
fn the_key_prefix_names_every_key_the_cli_touches() {
    let server = RedisServer::start();
    let _: () = redis::cmd("SET")
        .arg("teamA:job")
        .arg("tok-9")
        .arg("PX")
        .arg(60_000)
        .query(&mut server.conn())
        .expect("SET");
    let busy = redmutex(&server)
        .args([
            "--key-prefix",
            "teamA:",
            "run",
            "--no-wait",
            "job",
            "--",
            "true",
        ])
        .status()
        .expect("run");
    assert_eq!(busy.code(), Some(1), "teamA:job is held");
    let other = redmutex(&server)
        .args(["run", "--no-wait", "job", "--", "true"])
        .status()
        .expect("run");
    assert!(other.success(), "job without the prefix is another lock");
    // The command's own `redmutex` calls name keys as its parent does.
    let inherited = redmutex(&server)
        .args(["--key-prefix", "teamA:", "run", "job2", "--", "sh", "-c"])
        .arg(r#"test "$REDMUTEX_KEY_PREFIX" = teamA: && "$BIN" status --json --tokens job2 | grep -qF -e "$REDMUTEX_TOKEN""#)
        .env("BIN", assert_cmd::cargo::cargo_bin("redmutex"))
        .status()
        .expect("run");
    assert!(inherited.success(), "the child sees the prefix and its key");
    let out = redmutex(&server)
        .env("REDMUTEX_KEY_PREFIX", "teamA:")
        .args(["status", "--json", "--tokens", "job"])
        .output()
        .expect("status");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json["token"], "tok-9");
    let released = redmutex(&server)
        .env("REDMUTEX_KEY_PREFIX", "teamA:")
        .args(["release", "job", "--token", "tok-9"])
        .status()
        .expect("release");
    assert!(released.success());
    assert_eq!(held(&server, "teamA:job"), None);
    let refused = redmutex(&server)
        .args(["--key-prefix", "{x}", "status", "job"])
        .output()
        .expect("status");
    assert_eq!(
        refused.status.code(),
        Some(2),
        "a bad prefix is a usage error"
    );
    assert!(String::from_utf8_lossy(&refused.stderr).contains("prefix"));
}

#[test]
fn bad_input_gets_one_line_and_a_documented_code() {
    let server = RedisServer::start();
    let cases: [(&[&str], i32); 4] = [
        (&["run", "k"], 2),                              // no -- and command
        (&["run", "--ttl", "0s", "k", "--", "true"], 2), // zero ttl
        (&["run", "--bogus", "k", "--", "true"], 2),     // unknown option
        (&["run", "k", "--", "/no/such/command"], 127),
    ];
    for (args, code) in cases {
        let out = redmutex(&server).args(args).output().expect("run");
        assert_eq!(out.status.code(), Some(code), "{args:?}");
        assert!(!out.stderr.is_empty(), "{args:?} says why");
    }
    assert_eq!(held(&server, "k"), None, "nothing is left held");
    let port = support::free_port();
    let out = redmutex(&server)
        .args([
            "--url",
            &format!("redis://127.0.0.1:{port}"),
            "run",
            "k",
            "--",
            "true",
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(69));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "one clear line: {stderr}");
}

#[test]
fn cluster_and_sentinel_deployments_are_chosen_by_flags() {
    let cluster = support::RedisCluster::start(3, 0);
    let nodes = cluster.urls().join(",");
    // Keys on every primary: the command follows the slots.
    for key in cluster.key_per_primary("cli") {
        let run = Command::cargo_bin("redmutex")
            .expect("the redmutex binary")
            .args(["--cluster", "--url", &nodes, "run", &key, "--"])
            .args(["sh", "-c", "echo \"$REDMUTEX_TOKEN\""])
            .output()
            .expect("run on the cluster");
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        assert!(!String::from_utf8_lossy(&run.stdout).trim().is_empty());
        let primary = cluster.primary_for(&key);
        let _: () = primary.conn().set_ex(&key, "someone", 60).expect("SET");
        let status = Command::cargo_bin("redmutex")
            .expect("the redmutex binary")
            .env("REDMUTEX_URL", &nodes)
            .env("REDMUTEX_CLUSTER", "true")
            .args(["status", "--json", "--tokens", &key])
            .output()
            .expect("status on the cluster");
        let json: serde_json::Value = serde_json::from_slice(&status.stdout).expect("JSON");
        assert_eq!(json["token"], "someone", "{key}");
    }

    // `list` on the cluster: a lock, permits and a reentrant hold on keys
    // of different primaries, found by SCAN on each.
    let client = cluster.lock_client();
    let keys = cluster.key_per_primary("ops");
    let sem = redmutex::Semaphore::new(&client, keys[1].clone(), 3);
    let reentrant = redmutex::ReentrantLock::new(&client, keys[2].clone());
    let held = (
        redmutex::DistributedLock::new(&client, keys[0].clone())
            .lock()
            .expect("lock"),
        sem.acquire().expect("permit"),
        sem.acquire().expect("permit"),
        reentrant.lock().expect("hold"),
        reentrant.lock().expect("hold again"),
    );
    let list = Command::cargo_bin("redmutex")
        .expect("the redmutex binary")
        .args(["--cluster", "--url", &nodes, "list", "ops*"])
        .output()
        .expect("list on the cluster");
    let table = String::from_utf8_lossy(&list.stdout);
    println!("redmutex --cluster list 'ops*':\n{table}");
    assert_eq!(list.status.code(), Some(0), "{list:?}");
    for (key, kind, holders) in [
        (&keys[0], "lock", "1"),
        (&keys[1], "semaphore", "2 of 3"),
        (&keys[2], "reentrant", "2"),
    ] {
        assert!(
            table.lines().any(|line| line.starts_with(key.as_str())
                && line.contains(kind)
                && line.contains(&format!(" {holders} "))
                && line.contains(&format!("pid {}", std::process::id()))),
            "{key} {kind} {holders}: {table}"
        );
    }
    drop(held);

    let set = support::SentinelSet::start();
    let sentinels = set.sentinel_urls().join(",");
    let run_via_sentinel = || {
        Command::cargo_bin("redmutex")
            .expect("the redmutex binary")
            .args(["--sentinel", support::SentinelSet::MASTER])
            .args(["--url", &sentinels])
            .args(["run", "--no-wait", "via-sentinel", "--", "true"])
            .status()
            .expect("run through sentinel")
    };
    assert!(run_via_sentinel().success());
    let _: () = set
        .primary
        .conn()
        .set("via-sentinel", "other")
        .expect("SET");
    assert_eq!(
        run_via_sentinel().code(),
        Some(1),
        "held on the primary the sentinels name"
    );
}

fn signal(pid: u32, name: &str) {
    assert!(support::signal(pid, name), "kill -{name} {pid}");
}

/// Case 18: a SIGTERM while `redmutex run` waits for the lock ends the wait
/// (128+15) and leaves nothing held. On main the handlers were installed
/// only after acquiring.
#[test]
fn a_signal_while_waiting_ends_the_wait_and_holds_nothing() {
    let server = RedisServer::start();
    let holder = server.lock_client();
    let guard = redmutex::DistributedLock::new(&holder, "wait")
        .lock()
        .expect("lock");
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = dir.path().join("ran");
    let mut run = redmutex(&server)
        .args(["run", "--wait", "60s", "wait", "--", "touch"])
        .arg(&marker)
        .spawn()
        .expect("run");
    let channel = holder.release_channel("wait");
    assert!(wait_until(Duration::from_secs(10), || support::numsub(
        &server, &channel
    ) == 1));
    signal(run.id(), "TERM");
    let status = wait_exit(&mut run, Duration::from_secs(5));
    assert_eq!(status.code(), Some(128 + 15));
    assert!(!marker.exists(), "the command did not run");
    assert_eq!(held(&server, "wait").as_deref(), Some(guard.token()));
    guard.unlock().expect("unlock");
    // Nothing of the CLI's is left to take the key.
    let again = redmutex::DistributedLock::new(&holder, "wait")
        .try_lock()
        .expect("try_lock");
    assert!(again.is_some());
}

/// Case 18: on a loss the whole process group is ended, grandchildren of
/// `sh -c` included (on main only the direct child was signalled).
#[test]
fn a_loss_ends_the_commands_whole_process_group() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let pidfile = dir.path().join("grandchild");
    let script = format!("sleep 300 & echo $! > {}; wait", pidfile.display());
    let mut run = redmutex(&server)
        .args(["run", "--ttl", "900ms", "group", "--", "sh", "-c", &script])
        .stderr(Stdio::null())
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || read_pid(&pidfile).is_some()));
    let grandchild = read_pid(&pidfile).expect("pid");
    let _: () = server.conn().set("group", "someone-else").expect("SET");
    let status = wait_exit(&mut run, Duration::from_secs(10));
    assert_eq!(status.code(), Some(75));
    assert!(
        wait_until(Duration::from_secs(5), || gone(grandchild)),
        "the grandchild {grandchild} still runs"
    );
}

/// Case 18: SIGHUP (a closed terminal, a restart) is passed on to the
/// command's group like SIGINT and SIGTERM.
#[test]
fn sighup_is_passed_on_to_the_command() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("log");
    let ready = dir.path().join("ready");
    let script = format!(
        "trap 'echo hup >> {log}; exit 3' HUP; touch {ready}; sleep 30 & wait",
        log = log.display(),
        ready = ready.display()
    );
    let mut run = redmutex(&server)
        .args(["run", "hup", "--", "sh", "-c", &script])
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || ready.exists()));
    signal(run.id(), "HUP");
    let status = wait_exit(&mut run, Duration::from_secs(10));
    assert_eq!(status.code(), Some(3), "the command's own code");
    assert_eq!(std::fs::read_to_string(&log).expect("log").trim(), "hup");
    assert_eq!(held(&server, "hup"), None);
}

/// Case 18: if `redmutex` itself dies (SIGKILL: no handler runs), the
/// command does not run on without its lease's renewals (Linux: a
/// parent-death signal).
#[test]
fn the_command_does_not_outlive_redmutex() {
    if !cfg!(target_os = "linux") {
        return;
    }
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let pidfile = dir.path().join("child");
    let script = format!("echo $$ > {}; exec sleep 300", pidfile.display());
    let mut run = redmutex(&server)
        .args(["run", "orphan", "--", "sh", "-c", &script])
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || read_pid(&pidfile).is_some()));
    let child = read_pid(&pidfile).expect("pid");
    signal(run.id(), "KILL");
    let _ = wait_exit(&mut run, Duration::from_secs(5));
    assert!(
        wait_until(Duration::from_secs(5), || gone(child)),
        "the command {child} outlived redmutex"
    );
}

/// Case 18: when renewals fail (Redis behind a blackhole), the command is
/// terminated while `--kill-after` of the lease is left and killed with a
/// quarter of it left, so it is gone before another client can take the
/// lock; even a command that ignores SIGTERM.
#[test]
fn a_lease_that_cannot_be_renewed_ends_the_command_before_it_runs_out() {
    let server = RedisServer::start();
    let proxy = support::FaultProxy::to(&server);
    let dir = tempfile::tempdir().expect("tempdir");
    let pidfile = dir.path().join("child");
    let script = format!(
        "trap '' TERM; echo $$ > {}; sleep 100 & echo $! >> {}; wait",
        pidfile.display(),
        pidfile.display()
    );
    let mut run = Command::cargo_bin("redmutex")
        .expect("the redmutex binary")
        .env("REDMUTEX_URL", proxy.url())
        .args([
            "run",
            "--ttl",
            "3s",
            "--kill-after",
            "1s",
            "renew",
            "--",
            "sh",
            "-c",
            &script,
        ])
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    let pids = || -> Vec<u32> {
        std::fs::read_to_string(&pidfile)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    };
    assert!(wait_until(Duration::from_secs(10), || pids().len() == 2));
    let pids = pids();
    // Let one renewal through, then cut Redis off.
    std::thread::sleep(Duration::from_millis(1200));
    proxy.blackhole(true);
    let other = server.lock_client();
    let theirs = redmutex::DistributedLock::with_options(
        &other,
        "renew",
        redmutex::LockOptions::default()
            .wait_mode(redmutex::WaitMode::Spin)
            .backoff(redmutex::Backoff::constant(Duration::from_millis(5))),
    )
    .try_lock_for(Duration::from_secs(10))
    .expect("other client")
    .expect("the lease ran out");
    for pid in &pids {
        assert!(
            gone(*pid),
            "{pid} still ran when another client got the lock"
        );
    }
    drop(theirs);
    proxy.heal();
    let out = {
        let status = wait_exit(&mut run, Duration::from_secs(15));
        let mut stderr = String::new();
        use std::io::Read;
        run.stderr
            .take()
            .expect("stderr")
            .read_to_string(&mut stderr)
            .expect("read");
        (status, stderr)
    };
    assert_eq!(out.0.code(), Some(75), "{}", out.1);
    assert!(out.1.contains("cannot renew"), "{}", out.1);
}

/// With `stty tostop`, a background process that writes to the terminal
/// is stopped by SIGTTOU. While CMD has the terminal, `redmutex` is such a
/// process: its loss message must not stop it (and its watchdog) while CMD
/// runs on. Run under a pseudo-terminal (`script`), when there is one.
#[test]
fn a_loss_message_under_tostop_does_not_stop_redmutex() {
    let Ok(script) = which("script") else {
        return;
    };
    let server = RedisServer::start();
    let redmutex = assert_cmd::cargo::cargo_bin("redmutex");
    // The key names this run, so a failed run's processes can be found.
    let key = format!("tty-{}", std::process::id());
    let line = format!(
        "stty tostop; {} --url {} run --ttl 900ms {key} -- sleep 30",
        redmutex.display(),
        server.url()
    );
    use std::os::unix::process::CommandExt;
    let mut run = Command::new(script)
        .args(["-qec", &line, "/dev/null"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Its own group: a stopped redmutex and its command are killed
        // with it when the test fails.
        .process_group(0)
        .spawn()
        .expect("script");
    let group = run.id();
    let kill_group = || {
        signal_group(group, "KILL");
        // The pty's session is not script's group: find the run by its key.
        let _ = Command::new("pkill")
            .args(["-KILL", "-f", &format!("run --ttl 900ms {key}")])
            .status();
    };
    if !wait_until(Duration::from_secs(10), || held(&server, &key).is_some()) {
        kill_group();
        panic!("redmutex did not take the lock");
    }
    let _: () = server.conn().set(&key, "someone-else").expect("SET");
    let ended = wait_until(Duration::from_secs(10), || {
        matches!(run.try_wait(), Ok(Some(_)))
    });
    if !ended {
        kill_group();
        let _ = run.wait();
        panic!("redmutex was stopped by its own loss message and its command ran on");
    }
    let status = run.wait().expect("status");
    assert_eq!(status.code(), Some(75));
}

/// Signals a whole process group (and whatever `script` started in its
/// session, which stays in the group's session).
fn signal_group(pgid: u32, name: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{name}"))
        .arg("--")
        .arg(format!("-{pgid}"))
        .status();
}

fn which(name: &str) -> Result<std::path::PathBuf, ()> {
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join(name))
                .find(|candidate| candidate.is_file())
        })
        .ok_or(())
}

/// `run --limit N`: at most N commands at once under one key (the rest
/// wait, or with `--no-wait` exit 1 saying the semaphore is full);
/// `status` shows the limit and each permit (`--json` too); `release
/// --token ID` gives back one permit, owner-checked; a different limit or 0
/// is bad usage.
#[test]
fn run_with_a_limit_admits_n_at_once_and_status_and_release_know_permits() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = dir.path().join("gate");
    // Each command writes its permit id and waits for the gate file.
    let script = |name: &str| {
        format!(
            "echo $REDMUTEX_TOKEN > {dir}/{name}; \
             i=0; while [ ! -e {gate} ] && [ $i -lt 300 ]; do sleep 0.05; i=$((i+1)); done",
            dir = dir.path().display(),
            gate = gate.display()
        )
    };
    let mut runs: Vec<std::process::Child> = ["a", "b"]
        .iter()
        .map(|name| {
            redmutex(&server)
                .args(["run", "--limit", "2", "exports", "--", "sh", "-c"])
                .arg(script(name))
                .spawn()
                .expect("run")
        })
        .collect();
    let ids = || -> Vec<String> {
        ["a", "b"]
            .iter()
            .filter_map(|n| std::fs::read_to_string(dir.path().join(n)).ok())
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .collect()
    };
    assert!(wait_until(Duration::from_secs(10), || ids().len() == 2));

    let third = redmutex(&server)
        .args(["run", "--no-wait", "--limit", "2", "exports", "--", "true"])
        .output()
        .expect("third");
    assert_eq!(third.status.code(), Some(1), "full: not run");
    let stderr = String::from_utf8_lossy(&third.stderr);
    assert!(stderr.contains("2 of 2 permits"), "{stderr}");

    let other_limit = redmutex(&server)
        .args(["run", "--no-wait", "--limit", "5", "exports", "--", "true"])
        .output()
        .expect("other limit");
    assert_eq!(other_limit.status.code(), Some(2), "a different limit");
    assert!(String::from_utf8_lossy(&other_limit.stderr).contains("limit of 2"));
    let zero = redmutex(&server)
        .args(["run", "--limit", "0", "exports", "--", "true"])
        .output()
        .expect("zero");
    assert_eq!(zero.status.code(), Some(2));

    let hidden = redmutex(&server)
        .args(["status", "exports", "--json"])
        .output()
        .expect("status");
    let hidden: serde_json::Value = serde_json::from_slice(&hidden.stdout).expect("JSON");
    for permit in hidden["permits"].as_array().expect("permits") {
        assert!(
            permit.get("id").is_none(),
            "ids only with --tokens: {permit}"
        );
        assert_eq!(permit["holder"]["program"], "sh", "{permit}");
    }
    let out = redmutex(&server)
        .args(["status", "exports", "--json", "--tokens"])
        .output()
        .expect("status");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json["kind"], "semaphore");
    assert_eq!(json["limit"], 2);
    assert_eq!(json["in_use"], 2);
    assert_eq!(json["available"], 0);
    let mut listed: Vec<String> = json["permits"]
        .as_array()
        .expect("permits")
        .iter()
        .map(|p| {
            assert!(p["ttl_ms"].as_u64().expect("ttl") > 20_000);
            p["id"].as_str().expect("id").to_owned()
        })
        .collect();
    let mut expected = ids();
    listed.sort();
    expected.sort();
    assert_eq!(listed, expected, "REDMUTEX_TOKEN is the permit id");
    let text = redmutex(&server)
        .args(["status", "exports"])
        .output()
        .expect("status");
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("2 of 2 permits out"), "{text}");

    // Releasing one permit by id: the next run gets in while both commands
    // still run (the released one's command does not know).
    let wrong = redmutex(&server)
        .args(["release", "exports", "--token", "not-an-id"])
        .status()
        .expect("release");
    assert_eq!(wrong.code(), Some(1), "no such permit");
    let forced = redmutex(&server)
        .args(["release", "exports", "--force"])
        .output()
        .expect("force");
    assert_eq!(forced.status.code(), Some(2), "--force refuses a semaphore");
    let released = redmutex(&server)
        .args(["release", "exports", "--token", &expected[0]])
        .status()
        .expect("release");
    assert!(released.success());
    // Said twice: reported released again (its marker says so), and no
    // capacity added: exactly one permit is free.
    let again = redmutex(&server)
        .args(["release", "exports", "--token", &expected[0]])
        .status()
        .expect("release again");
    assert!(again.success(), "idempotent");
    let client = server.lock_client();
    let sem = redmutex::Semaphore::new(&client, "exports", 2);
    let fourth = sem.try_acquire().expect("try").expect("the freed permit");
    assert!(
        sem.try_acquire().expect("try").is_none(),
        "only one was freed"
    );
    drop(fourth);

    std::fs::write(&gate, "").expect("open the gate");
    for run in &mut runs {
        let status = wait_exit(run, Duration::from_secs(20));
        assert!(
            status.code() == Some(0) || status.code() == Some(75),
            "{status:?}"
        );
    }
    let left: bool = server.conn().exists("exports").expect("EXISTS");
    assert!(!left, "nothing outlives the last permit");
}

/// The cron habits: `--min-hold` keeps the lock after a short command,
/// `--quiet-if-held` exits 0 without a word when it is held, `--max-run`
/// ends a command that runs too long with 124: a command that ignores
/// SIGTERM is killed `--kill-after` later, and `redmutex` exits by
/// `--max-run` + `--kill-after` from the command's start (docs/cli.md).
#[test]
fn min_hold_quiet_if_held_and_max_run() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let done = dir.path().join("done");
    let mut first = redmutex(&server)
        .args(["run", "--min-hold", "6s", "cron", "--", "touch"])
        .arg(&done)
        .spawn()
        .expect("first run");
    assert!(wait_until(Duration::from_secs(10), || done.exists()));
    // The command is over; the lock is still held for the rest of 6 s.
    let ran = dir.path().join("ran");
    let conflict = redmutex(&server)
        .args(["run", "--no-wait", "cron", "--", "touch"])
        .arg(&ran)
        .output()
        .expect("run");
    assert_eq!(conflict.status.code(), Some(1), "held through --min-hold");
    let quiet = redmutex(&server)
        .args(["run", "--no-wait", "--quiet-if-held", "cron", "--", "touch"])
        .arg(&ran)
        .output()
        .expect("run");
    assert_eq!(quiet.status.code(), Some(0));
    assert!(
        quiet.stderr.is_empty(),
        "{:?}",
        String::from_utf8_lossy(&quiet.stderr)
    );
    assert!(!ran.exists(), "neither ran the command");
    let status = wait_exit(&mut first, Duration::from_secs(15));
    assert!(status.success());
    assert!(held(&server, "cron").is_none(), "released after --min-hold");

    let pid_file = dir.path().join("pid");
    let (max_run, kill_after) = (Duration::from_millis(300), Duration::from_secs(1));
    let mut long = redmutex(&server)
        .args([
            "run",
            "--max-run",
            "300ms",
            "--kill-after",
            "1s",
            "long",
            "--",
        ])
        // SIGTERM ignored (and so by the `sleep` it becomes): only SIGKILL
        // ends it.
        .args(["sh", "-c", "trap '' TERM; echo $$ > \"$0\"; exec sleep 30"])
        .arg(&pid_file)
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || read_pid(&pid_file).is_some()));
    // The command runs (its pid written): D counts from about here.
    let started = Instant::now();
    let status = wait_exit(&mut long, Duration::from_secs(25));
    let took = started.elapsed();
    assert_eq!(status.code(), Some(124), "{status:?}");
    // The slack: a debug build's scheduling on a loaded machine, and the
    // few milliseconds between the command's start and its pid file; far
    // below the second a SIGKILL missed (or sent twice as late) would add.
    let limit = max_run + kill_after + Duration::from_millis(300);
    eprintln!(
        "bound | --max-run 300ms --kill-after 1s, SIGTERM ignored (exit 124) | worst {took:?} over 1 run | limit {limit:?}"
    );
    assert!(
        took >= max_run + kill_after - Duration::from_millis(50) && took < limit,
        "exit 124 after {took:?}: SIGKILL --kill-after after SIGTERM"
    );
    let long = {
        use std::io::Read;
        let mut stderr = Vec::new();
        if let Some(mut pipe) = long.stderr.take() {
            let _ = pipe.read_to_end(&mut stderr);
        }
        std::process::Output {
            status,
            stdout: Vec::new(),
            stderr,
        }
    };
    let stderr = String::from_utf8_lossy(&long.stderr);
    assert!(stderr.contains("--max-run"), "{stderr}");
    assert!(held(&server, "long").is_none(), "released");
    let pid = read_pid(&pid_file).expect("the command's pid");
    assert!(
        wait_until(Duration::from_secs(5), || gone(pid)),
        "the command is gone"
    );

    let zero = redmutex(&server)
        .args(["run", "--max-run", "0s", "k", "--", "true"])
        .output()
        .expect("run");
    assert_eq!(zero.status.code(), Some(2));
}

/// Without a key, the key comes from the command line: the same command
/// never runs twice at once, another one is not held back by it.
#[test]
fn a_run_without_a_key_derives_it_from_the_command_line() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let started = dir.path().join("started");
    let script = format!("echo $REDMUTEX_KEY > {}; sleep 3", started.display());
    let mut first = redmutex(&server)
        .args(["-v", "run", "--", "sh", "-c", &script])
        .stderr(Stdio::piped())
        .spawn()
        .expect("first run");
    assert!(wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(&started).is_ok_and(|k| k.ends_with('\n'))
    }));
    let key = std::fs::read_to_string(&started).expect("key");
    let key = key.trim();
    assert!(
        key.len() == 20
            && key.starts_with("run:")
            && key[4..].chars().all(|c| c.is_ascii_hexdigit()),
        "{key}"
    );
    assert!(held(&server, key).is_some());
    let same = redmutex(&server)
        .args(["run", "--no-wait", "--", "sh", "-c", &script])
        .output()
        .expect("run");
    assert_eq!(same.status.code(), Some(1), "the same command line");
    let other = redmutex(&server)
        .args(["run", "--no-wait", "--", "true"])
        .status()
        .expect("run");
    assert!(other.success(), "another command line");
    let status = wait_exit(&mut first, Duration::from_secs(15));
    assert!(status.success());
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut first.stderr.take().expect("stderr"), &mut stderr)
        .expect("read");
    assert!(
        stderr.contains(key) && stderr.contains("derived from the command line"),
        "{stderr}"
    );
}

/// `redmutex list`: every lock type under a pattern, with kind, time left
/// and holders; auxiliary keys (fencing counters, release markers) left
/// out; never a token; names shown without the key prefix.
#[test]
fn list_shows_every_lock_type_and_never_a_token() {
    use redmutex::{DistributedLock, LockOptions, ReentrantLock, RwLock, Semaphore};
    let server = RedisServer::start();
    let client = server.lock_client();
    let plain =
        DistributedLock::with_options(&client, "jobs:plain", LockOptions::default().fencing(true))
            .lock()
            .expect("plain");
    DistributedLock::new(&client, "jobs:gone")
        .lock()
        .expect("gone")
        .unlock()
        .expect("unlock");
    let reentrant = ReentrantLock::new(&client, "jobs:re");
    let holds = (
        reentrant.lock().expect("re 1"),
        reentrant.lock().expect("re 2"),
    );
    let rw = RwLock::new(&client, "jobs:rw");
    let readers = (rw.read().expect("read 1"), rw.read().expect("read 2"));
    let writer = RwLock::new(&client, "jobs:w").write().expect("write");
    let sem = Semaphore::new(&client, "jobs:sem", 3);
    let permits = (sem.acquire().expect("p1"), sem.acquire().expect("p2"));
    let _: () = server.conn().set("other", "x").expect("SET");
    // A forced release leaves a marker holding the deleted token: not a lock.
    let forced = DistributedLock::new(&client, "jobs:forced");
    std::mem::forget(forced.lock().expect("forced"));
    assert!(
        redmutex(&server)
            .args(["release", "jobs:forced", "--force"])
            .status()
            .expect("release --force")
            .success()
    );

    let out = redmutex(&server)
        .args(["list", "jobs:*", "--json"])
        .output()
        .expect("list");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let items: Vec<serde_json::Value> = serde_json::from_str(&stdout).expect("JSON");
    let seen: Vec<(String, String, u64, Option<u64>)> = items
        .iter()
        .map(|i| {
            (
                i["key"].as_str().expect("key").to_owned(),
                i["kind"].as_str().expect("kind").to_owned(),
                i["holders"].as_u64().expect("holders"),
                i["limit"].as_u64(),
            )
        })
        .collect();
    let want: Vec<(String, String, u64, Option<u64>)> = [
        ("jobs:plain", "lock", 1, None),
        ("jobs:re", "reentrant", 2, None),
        ("jobs:rw", "read", 2, None),
        ("jobs:sem", "semaphore", 2, Some(3)),
        ("jobs:w", "write", 1, None),
    ]
    .into_iter()
    .map(|(k, kind, n, l)| (k.to_owned(), kind.to_owned(), n, l))
    .collect();
    assert_eq!(seen, want, "{stdout}");
    for item in &items {
        let ttl = item["ttl_ms"].as_u64().expect("every one expires");
        assert!(ttl > 0 && ttl <= 30_000, "{item}");
    }
    // Who holds each: this process, by its holder metadata, never the
    // secret part of a token.
    for item in &items {
        let held_by = item["held_by"].as_array().expect("held_by");
        assert_eq!(
            held_by.len() as u64,
            item["holders"].as_u64().expect("holders"),
            "{item}"
        );
        for holder in held_by {
            assert_eq!(holder["pid"], std::process::id(), "{holder}");
            assert!(holder["acquired_at_ms"].as_u64().expect("at") > 1_700_000_000_000);
        }
    }
    for token in [
        plain.token(),
        holds.0.owner(),
        readers.0.token(),
        writer.token(),
        permits.0.id(),
    ] {
        let secret = token.split('|').next().expect("a secret");
        assert!(!stdout.contains(secret), "a token in the listing: {stdout}");
    }

    // The table, and names without the prefix.
    let out = redmutex(&server)
        .args(["--key-prefix", "jobs:", "list"])
        .output()
        .expect("list");
    assert_eq!(out.status.code(), Some(0));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("sem") && table.contains("2 of 3"), "{table}");
    let pid = format!("pid {}", std::process::id());
    assert_eq!(
        table.lines().filter(|l| l.contains(&pid)).count(),
        5,
        "a holder on every line: {table}"
    );
    assert!(!table.contains("jobs:"), "{table}");
    assert!(!table.contains("other"), "{table}");
    // Bounded in time: a budget spent before the first SCAN step says so.
    let cut = redmutex(&server)
        .args(["list", "--timeout", "0s"])
        .output()
        .expect("list");
    assert_eq!(cut.status.code(), Some(3), "{cut:?}");
    assert!(String::from_utf8_lossy(&cut.stderr).contains("incomplete"));
    drop((plain, holds, readers, writer, permits));
    // A drop writes its release behind: done once Redis has read it.
    let mut listed = String::new();
    assert!(
        wait_until(Duration::from_secs(10), || {
            let out = redmutex(&server)
                .args(["list", "jobs:*", "--json"])
                .output()
                .expect("list");
            listed = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            listed == "[]"
        }),
        "nothing listed once released: {listed}"
    );
}

#[test]
fn run_label_names_the_holder_in_status_and_list_and_tokens_stay_hidden() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let started = dir.path().join("started");
    let mut run = redmutex(&server)
        .args(["run", "--label", "deploy-42", "labelled", "--", "sh", "-c"])
        .arg(format!("touch {}; sleep 30", started.display()))
        .spawn()
        .expect("run");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !started.exists() {
        assert!(Instant::now() < deadline, "the command never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    let token = held(&server, "labelled").expect("held");
    let secret = token.split('|').next().expect("a secret");

    let status = redmutex(&server)
        .args(["status", "labelled"])
        .output()
        .expect("status");
    let text = String::from_utf8_lossy(&status.stdout);
    let who = format!("sh on {} pid {} [deploy-42]", host(), run.id());
    assert!(text.contains(&who), "{text}");
    assert!(
        !text.contains(secret),
        "the token only with --tokens: {text}"
    );
    let shown = redmutex(&server)
        .args(["status", "labelled", "--tokens"])
        .output()
        .expect("status --tokens");
    assert!(String::from_utf8_lossy(&shown.stdout).contains(&token));

    let list = redmutex(&server)
        .args(["list", "--json"])
        .output()
        .expect("list");
    let items: serde_json::Value = serde_json::from_slice(&list.stdout).expect("JSON");
    let holder = &items[0]["held_by"][0];
    assert_eq!(holder["label"], "deploy-42", "{items}");
    assert_eq!(holder["program"], "sh");
    assert_eq!(holder["pid"], run.id());
    // Acquired by the server's clock: at most the server's time now.
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut server.conn()).expect("TIME");
    let now = secs * 1000 + micros / 1000;
    let at = holder["acquired_at_ms"].as_u64().expect("at");
    assert!(at <= now && now - at < 30_000, "{at} vs the server's {now}");

    signal(run.id(), "TERM");
    wait_exit(&mut run, Duration::from_secs(10));

    // A label that cannot be one: exit 2, nothing written.
    for bad in ["two words", "a|b", ""] {
        let out = redmutex(&server)
            .args(["run", "--label", bad, "bad-label", "--", "true"])
            .output()
            .expect("run");
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("label"));
    }
    assert_eq!(held(&server, "bad-label"), None);
}

/// This machine's host name as the holder metadata writes it.
fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .expect("the host name")
        .trim()
        .to_owned()
}

#[test]
fn a_holder_redis_hands_back_is_untrusted_input() {
    let server = RedisServer::start();
    let mut con = server.conn();
    // Past the year 9999, control characters, a pid out of range: none of
    // them a holder any writer makes, all of them shown, none a panic.
    for value in [
        "SECRETSECRET|host|1|prog|253402300800000|",
        "SECRETSECRET|ho\u{1b}[2Jst|1|prog|5|",
        "SECRETSECRET|host|99999999999|prog|5|",
        "SECRETSECRET|||||||||",
    ] {
        let _: () = con.set_ex("odd", value, 60).expect("SET");
        let status = redmutex(&server)
            .args(["status", "odd"])
            .output()
            .expect("status");
        let stdout = String::from_utf8_lossy(&status.stdout);
        assert_eq!(status.status.code(), Some(0), "{value:?}: {status:?}");
        assert!(stdout.contains("an unreadable holder"), "{stdout}");
        assert!(!stdout.contains("SECRETSECRET"), "{stdout}");
        let json = redmutex(&server)
            .args(["status", "odd", "--json"])
            .output()
            .expect("status --json");
        assert_eq!(json.status.code(), Some(0), "{value:?}: {json:?}");
        let run = redmutex(&server)
            .args(["run", "--no-wait", "odd", "--", "true"])
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(1), "{value:?}: {stderr}");
        assert!(stderr.contains("an unreadable holder"), "{stderr}");
        assert!(!stderr.contains('\u{1b}'), "{stderr:?}");
        let list = redmutex(&server).args(["list"]).output().expect("list");
        assert_eq!(list.status.code(), Some(0), "{value:?}: {list:?}");
    }
}

#[test]
fn tokens_are_shown_only_by_their_public_part_unless_asked() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("token");
    let run = redmutex(&server)
        .args(["-v", "run", "secrets", "--", "sh", "-c"])
        .arg(format!(
            "printf %s \"$REDMUTEX_TOKEN\" > {}",
            file.display()
        ))
        .output()
        .expect("run -v");
    assert!(run.status.success(), "{run:?}");
    let token = std::fs::read_to_string(&file).expect("the token");
    let secret = support::secret(&token);
    assert!(secret.len() >= 16, "{token}");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(said.contains("acquired"), "{said}");
    assert!(!said.contains(secret), "run -v printed the secret: {said}");

    // A lock held elsewhere, broken by force: what was deleted is named by
    // its holder, not by its secret.
    let mut con = server.conn();
    let _: () = con.set_ex("secrets", &token, 60).expect("SET");
    let forced = redmutex(&server)
        .args(["release", "secrets", "--force"])
        .output()
        .expect("release --force");
    let said = String::from_utf8_lossy(&forced.stdout);
    assert!(forced.status.success(), "{forced:?}");
    assert!(said.contains("deleted"), "{said}");
    assert!(
        !said.contains(secret),
        "release --force printed the secret: {said}"
    );
    for args in [&["status", "secrets"][..], &["status", "secrets", "--json"]] {
        let _: () = con.set_ex("secrets", &token, 60).expect("SET");
        let status = redmutex(&server).args(args).output().expect("status");
        let said = String::from_utf8_lossy(&status.stdout);
        assert!(!said.contains(secret), "{args:?}: {said}");
    }

    // Asked for: shown whole.
    let _: () = con.set_ex("secrets", &token, 60).expect("SET");
    let forced = redmutex(&server)
        .args(["--tokens", "release", "secrets", "--force"])
        .output()
        .expect("release --force --tokens");
    assert!(String::from_utf8_lossy(&forced.stdout).contains(&token));
    let run = redmutex(&server)
        .args(["-v", "--tokens", "run", "secrets", "--", "true"])
        .output()
        .expect("run -v --tokens");
    let said = String::from_utf8_lossy(&run.stderr);
    assert!(said.contains("with token "), "{said}");
    let shown = said
        .split("with token ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_default();
    assert!(
        shown.split('|').next().is_some_and(|s| s.len() >= 16),
        "{said}"
    );
}

/// `list --json` names at most 16 holders of a key, the oldest first,
/// and counts them all (docs/cli.md).
#[test]
fn list_names_at_most_16_holders_and_counts_them_all() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let semaphore = redmutex::Semaphore::new(&client, "many", 20);
    let permits: Vec<_> = (0..20)
        .map(|_| {
            let permit = semaphore.try_acquire().expect("acquire").expect("free");
            // Told apart by their acquisition times (ms).
            std::thread::sleep(Duration::from_millis(2));
            permit
        })
        .collect();
    let out = redmutex(&server)
        .args(["list", "many", "--json"])
        .output()
        .expect("list");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let held = &json[0];
    assert_eq!(held["holders"], 20, "{json}");
    let named = held["held_by"].as_array().expect("held_by");
    assert_eq!(named.len(), 16, "at most 16 named: {json}");
    drop(permits);
}

/// `run` against a server that goes silent: SIGTERM with `--kill-after`
/// of the lease left, SIGKILL with a quarter of it left (docs/cli.md), for
/// a command that ignores SIGTERM; `--kill-after` longer than a third of
/// the ttl counts as a third. Returns when the command died, against the
/// lease's expiry in Redis (read on the server itself when the link was
/// cut, right after a renewal).
fn killed_before_expiry(server: &RedisServer, kill_after: &str, key: &str) -> Duration {
    let proxy = support::FaultProxy::to(server);
    let dir = tempfile::tempdir().expect("tempdir");
    let pid_file = dir.path().join("pid");
    let mut run = Command::cargo_bin("redmutex")
        .expect("the redmutex binary")
        .env("REDMUTEX_URL", proxy.url())
        .args(["run", "--ttl", "3s", "--kill-after", kill_after, key, "--"])
        .args(["sh", "-c", "trap '' TERM; echo $$ > \"$0\"; exec sleep 100"])
        .arg(&pid_file)
        .stderr(Stdio::null())
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || read_pid(&pid_file).is_some()));
    let pid = read_pid(&pid_file).expect("pid");
    let pttl = |server: &RedisServer| -> i64 { server.conn().pttl(key).expect("PTTL") };
    // A renewal (every second) puts the expiry back to 3 s: cut the link
    // right after one, so the lease has most of its ttl left.
    let first = pttl(server);
    assert!(
        wait_until(Duration::from_secs(5), || pttl(server) > first),
        "renewed"
    );
    proxy.blackhole(true);
    let cut = Instant::now();
    let expiry = cut + Duration::from_millis(u64::try_from(pttl(server)).expect("a ttl"));
    assert!(!gone(pid), "the command runs while the lease lasts");
    // Polled every millisecond, bounded by the lease's end and a second.
    let mut died = None;
    while Instant::now() < expiry + Duration::from_secs(1) {
        if gone(pid) {
            died = Some(Instant::now());
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let died = died.expect("killed before its lease ran out");
    proxy.heal();
    assert_eq!(
        wait_exit(&mut run, Duration::from_secs(15)).code(),
        Some(75)
    );
    expiry.saturating_duration_since(died)
}

#[test]
fn a_silent_server_gets_the_command_killed_with_a_quarter_of_kill_after_left() {
    let _serial = support::serial();
    let server = RedisServer::start();
    // `--kill-after 1s`, and `10s` taken as a third of the 3 s ttl.
    for (kill_after, key) in [("1s", "quarter"), ("10s", "clamped")] {
        let left = killed_before_expiry(&server, kill_after, key);
        // A quarter of 1 s, and what the local clock takes off the lease
        // (1 % of the ttl + 2 ms, and the renewal's round trip): SIGKILL
        // no later than that (60 ms of scheduling slack, far below the
        // 750 ms a SIGKILL at the SIGTERM's `--kill-after` would differ
        // by), and not at the SIGTERM already.
        let quarter = Duration::from_millis(250);
        eprintln!(
            "bound | run --kill-after {kill_after}: SIGKILL before the lease's end | {left:?} left | limit {quarter:?} - 60ms .. {quarter:?} + 150ms"
        );
        assert!(
            left + Duration::from_millis(60) > quarter
                && left < quarter + Duration::from_millis(150),
            "--kill-after {kill_after}: killed with {left:?} of the lease left"
        );
    }
}

/// `list` on a terminal shows a progress line once it has run for a
/// second, not before (docs/cli.md): a listing of 3,000 keys through a
/// link that delays every reply 200 ms takes several steps of a `SCAN`
/// and its inspection, 400 ms each, and the first line comes with the
/// first step that ends after the second. Run under a pseudo-terminal
/// (`script`), when there is one.
#[test]
fn list_shows_progress_on_a_terminal_after_a_second() {
    let Ok(script) = which("script") else {
        return;
    };
    let _serial = support::serial();
    let server = RedisServer::start();
    let mut pipe = redis::pipe();
    for n in 0..3_000 {
        pipe.set(format!("progress:{n}"), "x").ignore();
    }
    let _: () = pipe.query(&mut server.conn()).expect("SET");
    let proxy = support::FaultProxy::to(&server);
    proxy.set_latency(Duration::ZERO, Duration::from_millis(200));
    let line = format!(
        "{} --url {} list 'progress:*' --timeout 20s",
        assert_cmd::cargo::cargo_bin("redmutex").display(),
        proxy.url()
    );
    let started = Instant::now();
    let mut run = Command::new(script)
        .args(["-qfec", &line, "/dev/null"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("script");
    let mut output = run.stdout.take().expect("stdout");
    // Read as it comes: when the first progress line shows.
    let reader = std::thread::spawn(move || {
        use std::io::Read;
        let mut seen = Vec::new();
        let mut shown = None;
        let mut chunk = [0u8; 4096];
        // Bounded by the listing's end (EOF) and its 20 s budget.
        while let Ok(n) = output.read(&mut chunk) {
            if n == 0 {
                break;
            }
            seen.extend_from_slice(&chunk[..n]);
            if shown.is_none() && String::from_utf8_lossy(&seen).contains("scanned") {
                shown = Some(started.elapsed());
            }
        }
        (shown, String::from_utf8_lossy(&seen).into_owned())
    });
    let status = wait_exit(&mut run, Duration::from_secs(30));
    let (shown, seen) = reader.join().expect("reader");
    assert!(status.success(), "{status:?}: {seen}");
    let shown = shown.unwrap_or_else(|| panic!("no progress line: {seen}"));
    // Not before the second; by the first step that ends after it (two
    // replies, 400 ms), with 60 ms for scheduling.
    let limit = Duration::from_secs(1) + Duration::from_millis(400) + Duration::from_millis(60);
    eprintln!(
        "bound | list's progress line on a terminal | shown after {shown:?} | limit 1s .. {limit:?}"
    );
    assert!(
        shown >= Duration::from_secs(1) && shown < limit,
        "progress shown after {shown:?}: {seen}"
    );
}

/// `list` without `--timeout` stops after 30 s, says the listing is
/// incomplete and exits 3 (docs/cli.md): here 10,000 keys through a link
/// that delays every reply 900 ms (within the 2 s timeout), 40 s of steps.
#[test]
#[ignore = "30 s: run by the full tier only (scripts/test.sh --full)"]
fn list_stops_after_30_s_by_default() {
    let server = RedisServer::start();
    let mut pipe = redis::pipe();
    for n in 0..10_000 {
        pipe.set(format!("slow:{n}"), "x").ignore();
    }
    let _: () = pipe.query(&mut server.conn()).expect("SET");
    let proxy = support::FaultProxy::to(&server);
    proxy.set_latency(Duration::ZERO, Duration::from_millis(900));
    let started = Instant::now();
    let out = Command::cargo_bin("redmutex")
        .expect("the redmutex binary")
        .env("REDMUTEX_URL", proxy.url())
        .args(["list"])
        .output()
        .expect("list");
    let took = started.elapsed();
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("incomplete"));
    // The budget is cut into its steps, a connect included: the slack is
    // the process's start and exit in a debug build.
    let limit = Duration::from_secs(30) + Duration::from_millis(300);
    eprintln!("bound | list's default --timeout | {took:?} | limit 30s .. {limit:?}");
    assert!(
        took >= Duration::from_secs(30) && took < limit,
        "list ended after {took:?}"
    );
}

/// `status` reads any lock type through the library's status (one atomic
/// read, never a secret): a reentrant lock's holds, a read-write lock's
/// readers or writer.
#[test]
fn status_shows_every_lock_type() {
    let server = RedisServer::start();
    let client = redmutex::LockClient::builder()
        .url(server.url())
        .label("kinds-1")
        .build()
        .expect("client");
    let reentrant = redmutex::ReentrantLock::new(&client, "st-reentrant");
    let outer = reentrant.lock().expect("lock");
    let inner = reentrant.lock().expect("again");
    let out = redmutex(&server)
        .args(["status", "st-reentrant"])
        .output()
        .expect("status");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(text.contains("reentrant lock held by"), "{text}");
    assert!(
        text.contains("[kinds-1]") && text.contains("2 holds"),
        "{text}"
    );
    let json = redmutex(&server)
        .args(["status", "st-reentrant", "--json"])
        .output()
        .expect("status --json");
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).expect("JSON");
    assert_eq!(json["kind"], "reentrant");
    assert_eq!(json["holders"], 2);
    assert_eq!(json["holder"]["label"], "kinds-1");
    inner.unlock().expect("unlock");
    outer.unlock().expect("unlock");

    let rw = redmutex::RwLock::new(&client, "st-rw");
    let readers = [rw.read().expect("read"), rw.read().expect("read")];
    let out = redmutex(&server)
        .args(["status", "st-rw"])
        .output()
        .expect("status");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("read lock, 2 readers"), "{text}");
    for reader in readers {
        // No secret of any reader in what status printed.
        let secret = reader.token().split('|').next().expect("secret").to_owned();
        assert!(!text.contains(&secret), "{text}");
        reader.unlock().expect("unlock");
    }
    let writer = rw.write().expect("write");
    let json = redmutex(&server)
        .args(["status", "st-rw", "--json"])
        .output()
        .expect("status --json");
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).expect("JSON");
    assert_eq!(json["kind"], "write");
    assert_eq!(json["held"], true);
    writer.unlock().expect("unlock");
    let free = redmutex(&server)
        .args(["status", "st-rw"])
        .output()
        .expect("status");
    assert!(String::from_utf8_lossy(&free.stdout).contains("st-rw: free"));
}

/// `status --tokens` on a semaphore shows the ids of its live permits
/// only, read with the server's clock in one transaction: never an expired
/// permit's id that is still in the hash, whatever the ids carry.
#[test]
fn status_tokens_shows_live_permit_ids_only() {
    let server = RedisServer::start();
    let client = redmutex::LockClient::builder()
        .url(server.url())
        .holder_metadata(false)
        .build()
        .expect("client");
    let permits = |ttl| {
        redmutex::Semaphore::with_options(
            &client,
            "ids",
            2,
            redmutex::SemaphoreOptions::default().ttl(ttl),
        )
    };
    let expired = permits(Duration::from_millis(100))
        .acquire()
        .expect("permit");
    let expired_id = expired.id().to_owned();
    std::mem::forget(expired);
    let live = permits(Duration::from_secs(30)).acquire().expect("permit");
    // Past the first permit's deadline; nothing has purged it yet.
    let deadline = Instant::now() + Duration::from_millis(300);
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = redmutex(&server)
        .args(["--tokens", "status", "ids", "--json"])
        .output()
        .expect("status");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let ids: Vec<&str> = json["permits"]
        .as_array()
        .expect("permits")
        .iter()
        .filter_map(|p| p["id"].as_str())
        .collect();
    assert_eq!(ids, [live.id()], "expired {expired_id} is not shown");
    assert_eq!(json["in_use"], 1);
    drop(live);
}

/// `run --keys`: every key at once, or none; the command learns the keys
/// and each key's fencing token.
#[test]
fn run_with_keys_takes_the_set_whole_or_not_at_all() {
    let server = RedisServer::start();
    let out = redmutex(&server)
        .args([
            "run",
            "--fencing",
            "--keys",
            "acct:b,acct:a",
            "--",
            "sh",
            "-c",
            "echo \"$REDMUTEX_KEY\"; echo \"$REDMUTEX_FENCING_TOKENS\"; echo \"$REDMUTEX_TOKEN\"",
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.first(), Some(&"acct:b,acct:a"), "{stdout}");
    let fences: Vec<&str> = lines
        .get(1)
        .copied()
        .unwrap_or_default()
        .split(',')
        .collect();
    assert_eq!(fences.len(), 2, "{stdout}");
    assert!(fences[0].starts_with("acct:a="), "{stdout}");
    assert!(fences[1].starts_with("acct:b="), "{stdout}");
    assert_eq!(held(&server, "acct:a"), None, "released after the command");
    // With a key prefix the command names the keys as it was given them.
    let out = redmutex(&server)
        .args([
            "--key-prefix",
            "p:",
            "run",
            "--fencing",
            "--keys",
            "x,y",
            "--",
            "sh",
            "-c",
            "echo \"$REDMUTEX_FENCING_TOKENS\"",
        ])
        .output()
        .expect("run");
    let tokens = String::from_utf8_lossy(&out.stdout);
    assert!(
        tokens.starts_with("x=") && tokens.contains(",y="),
        "{tokens}"
    );
    // One key of the set held elsewhere: nothing is taken, exit 1.
    let client = server.lock_client();
    let other = redmutex::DistributedLock::new(&client, "acct:c")
        .lock()
        .expect("lock");
    let refused = redmutex(&server)
        .args(["run", "--no-wait", "--keys", "acct:b,acct:c", "--", "true"])
        .output()
        .expect("run");
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("acct:c"),
        "names the held key: {refused:?}"
    );
    assert_eq!(
        held(&server, "acct:b"),
        None,
        "nothing of the set was taken"
    );
    other.unlock().expect("unlock");
    for bad in [
        vec!["run", "--keys", "a,b", "k", "--", "true"],
        vec!["run", "--keys", "a,b", "--limit", "2", "--", "true"],
        vec!["run", "--keys", "a,,b", "--", "true"],
        vec!["run", "--fair", "--limit", "2", "k", "--", "true"],
    ] {
        let out = redmutex(&server).args(&bad).output().expect("run");
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {out:?}");
    }
}

/// `run --fair`: a waiter SIGKILLed at the head of the queue costs the
/// next one at most its place's ttl (2 s), not its wait.
#[test]
fn a_fair_run_killed_at_the_head_of_the_queue_drops_out() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let holder = redmutex::FairLock::new(&client, "turn")
        .lock()
        .expect("lock");
    let queue =
        |server: &RedisServer| -> u64 { server.conn().zcard("{turn}:fairq").expect("ZCARD") };
    let mut head = redmutex(&server)
        .args(["run", "--fair", "--wait", "60s", "turn", "--", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || queue(&server) == 1));
    let behind = {
        let lock = redmutex::FairLock::with_options(
            &server.lock_client(),
            "turn",
            redmutex::FairLockOptions::default().wait(Duration::from_secs(30)),
        );
        std::thread::spawn(move || lock.lock().map(|guard| guard.ticket()))
    };
    assert!(wait_until(Duration::from_secs(10), || queue(&server) == 2));
    head.kill().expect("SIGKILL");
    let _ = head.wait();
    let released = Instant::now();
    holder.unlock().expect("unlock");
    let ticket = behind.join().expect("waiter").expect("served");
    assert!(ticket.is_some(), "it queued");
    let waited = released.elapsed();
    assert!(
        waited < Duration::from_secs(5),
        "the dead head's place lapsed within its ttl: {waited:?}"
    );
    // And a fair run that is not killed takes its turn.
    let out = redmutex(&server)
        .args(["run", "--fair", "turn", "--", "true"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
}
