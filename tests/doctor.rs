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
    let out = Command::cargo_bin("redmutex")
        .expect("the redmutex binary")
        .args(global)
        .args(["doctor", "--json"])
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
    // ACL DRYRUN came with Redis 7.
    let acl = if support::server_major() >= 7 {
        "ok"
    } else {
        "info"
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
