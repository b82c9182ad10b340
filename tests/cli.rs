//! The `redmutex` command against a private redis-server.
#![cfg(feature = "cli")]

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use assert_cmd::cargo::CommandCargoExt;
use redis::Commands;
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
    assert_eq!(fields[1].len(), 36, "a UUID token");
    assert_eq!(fields[2], "1", "the first fencing token");
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
    let killed = Command::new("kill")
        .args(["-TERM", &run.id().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
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
        .args(["status", "st", "--json"])
        .output()
        .expect("status");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json["held"], true);
    assert_eq!(json["token"], "tok-123");
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
    assert!(String::from_utf8_lossy(&forced.stdout).contains("stuck"));
    assert_eq!(held(&server, "st"), None);
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
            .args(["status", "--json", &key])
            .output()
            .expect("status on the cluster");
        let json: serde_json::Value = serde_json::from_slice(&status.stdout).expect("JSON");
        assert_eq!(json["token"], "someone", "{key}");
    }

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
