//! `redmutex doctor` against servers configured well and deliberately
//! badly, one of each kind of deployment.
#![cfg(feature = "cli")]

use redmutex_test_support as support;

use std::process::Command;

use assert_cmd::cargo::CommandCargoExt;
use support::{RedisCluster, RedisServer, SentinelSet};

/// `redmutex [global...] doctor --json`: its exit code and findings as
/// `(check, severity, found)`.
fn doctor(global: &[&str], env: &[(&str, &str)]) -> (i32, Vec<(String, String, String)>) {
    doctor_with(global, &[], env)
}

/// [`doctor`] with options of `doctor` itself.
fn doctor_with(
    global: &[&str],
    options: &[&str],
    env: &[(&str, &str)],
) -> (i32, Vec<(String, String, String)>) {
    let out = Command::cargo_bin("redmutex")
        .expect("the redmutex binary")
        .args(global)
        .args(["doctor", "--json"])
        .args(options)
        .envs(env.iter().copied())
        .output()
        .expect("run redmutex doctor");
    let text = String::from_utf8_lossy(&out.stdout);
    let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {text} {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let findings = json["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .map(|f| {
            let s = |k: &str| f[k].as_str().unwrap_or_default().to_owned();
            (s("check"), s("severity"), s("found"))
        })
        .collect();
    (out.status.code().unwrap_or(-1), findings)
}

/// What the first finding of `check` found.
fn found_of(findings: &[(String, String, String)], check: &str) -> String {
    findings
        .iter()
        .find(|(c, _, _)| c == check)
        .map(|(_, _, f)| f.clone())
        .unwrap_or_default()
}

/// The rule docs/failure-model.md gives a lock user whose locks are named
/// `locks:*` (password `secret`), word by word, read from the page.
fn documented_rule() -> Vec<String> {
    let page = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/failure-model.md"
    ))
    .expect("docs/failure-model.md");
    let line = page
        .lines()
        .find(|l| l.starts_with("ACL SETUSER locker "))
        .expect("docs/failure-model.md gives the rule");
    line.split_whitespace().skip(3).map(str::to_owned).collect()
}

/// The documented rule without `grant` (`+pexpire`).
fn documented_rule_without(grant: &str) -> Vec<String> {
    let rule = documented_rule();
    assert!(rule.iter().any(|w| w == grant), "{grant} is in the rule");
    rule.into_iter().filter(|w| w != grant).collect()
}

fn set_user(server: &RedisServer, name: &str, rule: &[String]) {
    let mut cmd = redis::cmd("ACL");
    cmd.arg("SETUSER").arg(name);
    for word in rule {
        cmd.arg(word);
    }
    let _: () = cmd.query(&mut server.conn()).expect("ACL SETUSER");
}

fn words(rule: &[&str]) -> Vec<String> {
    rule.iter().map(|w| (*w).to_owned()).collect()
}

/// Channel patterns (`&`, `resetchannels`) came with Redis 6.2: the
/// documented rule needs them.
fn channel_acls() -> bool {
    support::server_version() >= (6, 2)
}

fn severity_of<'a>(findings: &'a [(String, String, String)], check: &str) -> Vec<&'a str> {
    findings
        .iter()
        .filter(|(c, _, _)| c == check)
        .map(|(_, s, _)| s.as_str())
        .collect()
}

/// What the version finding says of the server under test: tested from
/// 7.0, acquisitions by script on 6.2, `GETDEL` missing before.
fn version_severity() -> (&'static str, i32) {
    match support::server_version() {
        (7.., _) => ("ok", 0),
        (6, 2..) => ("info", 0),
        _ => ("warning", 4),
    }
}

#[test]
fn a_well_configured_server_passes() {
    let server = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let url = server.url();
    let (code, findings) = doctor(&["--url", &url], &[]);
    let (version, expected) = version_severity();
    assert_eq!(code, expected, "{findings:#?}");
    assert_eq!(
        severity_of(&findings, "version"),
        [version],
        "{findings:#?}"
    );
    for check in ["commands", "eviction", "persistence", "clock", "latency"] {
        assert_eq!(
            severity_of(&findings, check),
            ["ok"],
            "{check}: {findings:#?}"
        );
    }
    // ACL DRYRUN came with Redis 7: before, not checked.
    let acl = if support::server_major() >= 7 {
        "ok"
    } else {
        "unknown"
    };
    assert_eq!(severity_of(&findings, "acl"), [acl], "{findings:#?}");
    // No replica: said, not held against it.
    assert_eq!(severity_of(&findings, "replication"), ["info"]);
    // The text form says the same, with the exit code.
    let out = Command::cargo_bin("redmutex")
        .expect("binary")
        .args(["--url", &url, "doctor"])
        .output()
        .expect("run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("(exit {expected})")), "{text}");
}

#[test]
fn eviction_no_persistence_a_renamed_command_and_a_narrow_acl_are_found() {
    // A renamed command and channel ACLs checked by DRYRUN: Redis 7.
    let modern = support::server_major() >= 7;
    let mut settings = vec!["--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"];
    if modern {
        settings.extend(["--rename-command", "GETDEL", ""]);
    }
    let server = RedisServer::start_with(&settings);
    let url = server.url();
    let (code, findings) = if modern {
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg("narrow")
            .arg("on")
            .arg(">pw")
            .arg("~*")
            .arg("resetchannels")
            .arg("+@all")
            .query(&mut server.conn())
            .expect("ACL SETUSER");
        doctor(
            &["--url", &url, "--user", "narrow"],
            &[("REDMUTEX_PASSWORD", "pw")],
        )
    } else {
        doctor(&["--url", &url], &[])
    };
    assert_eq!(code, 5, "an error: {findings:#?}");
    assert_eq!(severity_of(&findings, "eviction"), ["error"]);
    assert_eq!(severity_of(&findings, "persistence"), ["warning"]);
    if !modern {
        return;
    }
    assert_eq!(severity_of(&findings, "commands"), ["error"]);
    let found = |check: &str| {
        findings
            .iter()
            .find(|(c, _, _)| c == check)
            .map(|(_, _, f)| f.clone())
            .unwrap_or_default()
    };
    assert!(found("commands").contains("GETDEL"), "{findings:#?}");
    // Without channels locks work and waiters poll: a warning naming both.
    assert_eq!(severity_of(&findings, "acl"), ["warning"]);
    assert!(
        found("acl").contains("PUBLISH") && found("acl").contains("SUBSCRIBE"),
        "{findings:#?}"
    );
    // Nothing was written.
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query(&mut server.conn())
        .expect("KEYS");
    assert!(keys.is_empty(), "{keys:?}");
}

#[test]
fn a_replica_is_an_error() {
    let primary = RedisServer::start();
    let replica = RedisServer::start_replica_of(&primary);
    let (code, findings) = doctor(&["--url", &replica.url()], &[]);
    assert_eq!(code, 5, "{findings:#?}");
    assert_eq!(severity_of(&findings, "replication"), ["error"]);
}

#[test]
fn a_cluster_is_checked_on_every_primary() {
    let cluster = RedisCluster::start(3, 0);
    let urls = cluster.urls().join(",");
    let (_, findings) = doctor(&["--cluster", "--url", &urls], &[]);
    assert_eq!(severity_of(&findings, "cluster"), ["ok"], "{findings:#?}");
    assert_eq!(severity_of(&findings, "version").len(), 3, "{findings:#?}");
    assert_eq!(severity_of(&findings, "eviction"), ["ok", "ok", "ok"]);
}

#[test]
fn sentinels_are_asked_for_their_quorum() {
    let set = SentinelSet::start();
    let urls = set.sentinel_urls().join(",");
    let (_, findings) = doctor(&["--sentinel", SentinelSet::MASTER, "--url", &urls], &[]);
    assert_eq!(
        severity_of(&findings, "sentinel"),
        ["ok", "ok", "ok"],
        "{findings:#?}"
    );
    assert_eq!(
        severity_of(&findings, "replication"),
        ["ok"],
        "{findings:#?}"
    );
}

#[test]
fn the_documented_rule_is_no_error_and_an_admin_finds_it_complete() {
    if !channel_acls() {
        return;
    }
    let server = RedisServer::start();
    set_user(&server, "locker", &documented_rule());
    let url = server.url();
    // As the lock user: INFO, CONFIG and ACL DRYRUN are refused to it,
    // which says nothing against the deployment.
    let (code, findings) = doctor(
        &["--url", &url, "--user", "locker"],
        &[("REDMUTEX_PASSWORD", "secret")],
    );
    assert_ne!(code, 5, "{findings:#?}");
    assert!(
        findings.iter().all(|(_, severity, _)| severity != "error"),
        "{findings:#?}"
    );
    for check in ["eviction", "persistence", "acl"] {
        assert_eq!(
            severity_of(&findings, check),
            ["unknown"],
            "{check}: {findings:#?}"
        );
    }
    // The lock user's own checks still run.
    assert_eq!(severity_of(&findings, "clock"), ["ok"], "{findings:#?}");
    assert_eq!(
        severity_of(&findings, "replication"),
        ["info"],
        "{findings:#?}"
    );
    if support::server_major() < 7 {
        return;
    }
    // ... and the finding says how an admin checks it.
    assert!(
        found_of(&findings, "acl").contains("--acl-user locker"),
        "{findings:#?}"
    );
    // An admin's check of the lock user, on one of its locks: every
    // command, the scripts' too, on its key, counter, markers and channel.
    let (code, findings) = doctor_with(
        &["--url", &url],
        &["--acl-user", "locker", "--key", "locks:doctor"],
        &[],
    );
    assert_ne!(code, 5, "{findings:#?}");
    assert_eq!(severity_of(&findings, "acl"), ["ok"], "{findings:#?}");
    assert!(
        found_of(&findings, "acl").contains("locks:doctor"),
        "{findings:#?}"
    );
    // The sample key is not one of its locks: not checked, not an error.
    let (_, findings) = doctor_with(&["--url", &url], &["--acl-user", "locker"], &[]);
    assert_eq!(severity_of(&findings, "acl"), ["unknown"], "{findings:#?}");
    assert!(found_of(&findings, "acl").contains("redmutex-doctor-sample"));
}

#[test]
fn a_user_who_cannot_renew_is_an_error_naming_pexpire() {
    if support::server_major() < 7 {
        return;
    }
    let server = RedisServer::start();
    set_user(&server, "locker", &documented_rule_without("+pexpire"));
    let url = server.url();
    let (code, findings) = doctor_with(
        &["--url", &url],
        &["--acl-user", "locker", "--key", "locks:doctor"],
        &[],
    );
    assert_eq!(code, 5, "{findings:#?}");
    assert_eq!(severity_of(&findings, "acl"), ["error"], "{findings:#?}");
    let acl = found_of(&findings, "acl");
    assert!(
        acl.contains("PEXPIRE refused") && acl.contains("renew"),
        "{acl}"
    );
    // Only a script sends PEXPIRE: a user allowed all else, checking
    // itself, is told too.
    set_user(
        &server,
        "renews-nothing",
        &words(&["on", ">secret", "~*", "&*", "+@all", "-pexpire"]),
    );
    let (code, findings) = doctor(
        &["--url", &url, "--user", "renews-nothing"],
        &[("REDMUTEX_PASSWORD", "secret")],
    );
    assert_eq!(code, 5, "{findings:#?}");
    assert_eq!(severity_of(&findings, "acl"), ["error"], "{findings:#?}");
    assert!(
        found_of(&findings, "acl").contains("PEXPIRE"),
        "{findings:#?}"
    );
}

#[test]
fn a_user_who_cannot_publish_is_an_error_naming_publish() {
    if support::server_major() < 7 {
        return;
    }
    let server = RedisServer::start();
    set_user(&server, "locker", &documented_rule_without("+publish"));
    let url = server.url();
    let (code, findings) = doctor_with(
        &["--url", &url],
        &["--acl-user", "locker", "--key", "locks:doctor"],
        &[],
    );
    assert_eq!(code, 5, "{findings:#?}");
    assert_eq!(severity_of(&findings, "acl"), ["error"], "{findings:#?}");
    assert!(
        found_of(&findings, "acl").contains("PUBLISH refused"),
        "{findings:#?}"
    );
    set_user(
        &server,
        "announces-nothing",
        &words(&["on", ">secret", "~*", "&*", "+@all", "-publish"]),
    );
    let (code, findings) = doctor(
        &["--url", &url, "--user", "announces-nothing"],
        &[("REDMUTEX_PASSWORD", "secret")],
    );
    assert_eq!(code, 5, "{findings:#?}");
    assert_eq!(severity_of(&findings, "acl"), ["error"], "{findings:#?}");
    assert!(
        found_of(&findings, "acl").contains("PUBLISH"),
        "{findings:#?}"
    );
}

#[test]
fn info_and_config_refused_are_unknown_not_errors() {
    let server = RedisServer::start();
    let mut rule = words(&["on", ">secret", "~*", "+@all", "-info", "-config"]);
    if channel_acls() {
        rule.push("allchannels".into());
    }
    set_user(&server, "no-info", &rule);
    let (code, findings) = doctor(
        &["--url", &server.url(), "--user", "no-info"],
        &[("REDMUTEX_PASSWORD", "secret")],
    );
    assert_ne!(code, 5, "{findings:#?}");
    assert!(
        findings.iter().all(|(_, severity, _)| severity != "error"),
        "{findings:#?}"
    );
    for check in ["eviction", "persistence"] {
        assert_eq!(
            severity_of(&findings, check),
            ["unknown"],
            "{check}: {findings:#?}"
        );
    }
    // What needs neither is checked as for anyone: ROLE tells the
    // replicas, and the ACL is its own to dry-run.
    assert_eq!(
        severity_of(&findings, "replication"),
        ["info"],
        "{findings:#?}"
    );
    for check in ["commands", "clock", "latency"] {
        assert_eq!(
            severity_of(&findings, check),
            ["ok"],
            "{check}: {findings:#?}"
        );
    }
    if support::server_major() >= 7 {
        assert_eq!(severity_of(&findings, "acl"), ["ok"], "{findings:#?}");
        assert_eq!(
            severity_of(&findings, "version"),
            ["ok"],
            "HELLO tells it: {findings:#?}"
        );
    }
}
