//! The deployment examples in `contrib/` (a systemd service and timer, a
//! cron file, a Kubernetes CronJob), checked and run as far as a machine
//! without those managers allows: the unit files verified by
//! `systemd-analyze`, each example's own command line run against a
//! private server the way its manager runs it, and the settings the docs
//! say matter checked against each other (the grace periods against
//! `--kill-after`).
#![cfg(feature = "cli")]

use redmutex_test_support as support;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use redis::Commands;
use support::processes::children_of;
use support::{RedisServer, wait_until};

fn contrib(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("contrib")
        .join(path)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).expect("a contrib file")
}

fn binary() -> PathBuf {
    assert_cmd::cargo::cargo_bin("redmutex")
}

fn held(server: &RedisServer, key: &str) -> Option<String> {
    server.conn().get(key).expect("GET")
}

/// The value of `--name VALUE` in a command line.
fn option<'a>(words: &[&'a str], name: &str) -> Option<&'a str> {
    words
        .iter()
        .position(|w| *w == name)
        .and_then(|i| words.get(i + 1))
        .copied()
}

fn duration(text: &str) -> Duration {
    humantime::parse_duration(text).expect("a duration")
}

/// A job script: appends "ran" to `log`, then sleeps `secs`.
fn job(dir: &Path, log: &Path, secs: &str) -> PathBuf {
    let path = dir.join("job.sh");
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\necho ran >> {}\nexec sleep {secs}\n",
            log.display()
        ),
    )
    .expect("write");
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    path
}

fn runs(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .count()
}

/// `[Section]` `Key=Value` settings of a unit file (the last one of a
/// key wins, as systemd reads them).
fn unit_settings(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#') && !l.starts_with('[') && l.contains('='))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

fn setting<'a>(settings: &'a [(String, String)], key: &str) -> Option<&'a str> {
    settings
        .iter()
        .rev()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// The service as systemd would run it: verified, then started (its
/// `ExecStart`, with SIGPIPE ignored as systemd leaves it), stopped as
/// `KillMode=mixed` stops it (SIGTERM to `redmutex` alone), within
/// `TimeoutStopSec`; a second host's start meanwhile exits 0 at once.
#[test]
fn the_systemd_service_verifies_and_runs_as_systemd_runs_it() {
    let unit = read(&contrib("systemd/nightly-report.service"));
    let settings = unit_settings(&unit);
    assert_eq!(setting(&settings, "KillMode"), Some("mixed"));
    assert_eq!(setting(&settings, "IgnoreSIGPIPE"), Some("yes"));
    let exec = setting(&settings, "ExecStart").expect("ExecStart");
    let words: Vec<&str> = exec.split_whitespace().collect();
    let kill_after = duration(option(&words, "--kill-after").expect("--kill-after"));
    let timeout = duration(setting(&settings, "TimeoutStopSec").expect("TimeoutStopSec"));
    assert!(
        timeout > kill_after,
        "systemd's SIGKILL must come after redmutex has ended the job itself"
    );

    let server = RedisServer::start();
    let dir = support::temp_dir();
    let log = dir.path().join("log");
    let script = job(dir.path(), &log, "60");
    let report = dir.path().join("outcome.json");
    // The unit with this machine's paths: the binary just built, the test's
    // job, a report under the test's directory.
    let local = unit
        .replace("/usr/bin/redmutex", &binary().display().to_string())
        .replace("/opt/jobs/nightly-report.sh", &script.display().to_string())
        .replace(
            "/run/nightly-report/outcome.json",
            &report.display().to_string(),
        );
    let units = dir.path().join("units");
    std::fs::create_dir_all(&units).expect("mkdir");
    std::fs::write(units.join("nightly-report.service"), &local).expect("write");
    std::fs::copy(
        contrib("systemd/nightly-report.timer"),
        units.join("nightly-report.timer"),
    )
    .expect("copy");
    if let Ok(out) = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(units.join("nightly-report.service"))
        .arg(units.join("nightly-report.timer"))
        .output()
    {
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{said}");
        assert!(said.trim().is_empty(), "systemd-analyze verify: {said}");
    }

    let local_settings = unit_settings(&local);
    let exec = setting(&local_settings, "ExecStart").expect("ExecStart");
    let words: Vec<String> = exec.split_whitespace().map(str::to_owned).collect();
    let environment: Vec<(String, String)> = local_settings
        .iter()
        .filter(|(k, _)| k == "Environment")
        .filter_map(|(_, v)| v.split_once('='))
        // This test's server, whatever the unit names.
        .map(|(k, v)| {
            let v = if k == "REDMUTEX_URL" {
                server.url()
            } else {
                v.to_owned()
            };
            (k.to_owned(), v)
        })
        .collect();
    let start = || {
        let mut command = Command::new(&words[0]);
        command
            .args(&words[1..])
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .envs(environment.iter().cloned())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: signal(2) between fork and exec: systemd's
        // IgnoreSIGPIPE=yes.
        unsafe {
            command.pre_exec(|| {
                libc::signal(libc::SIGPIPE, libc::SIG_IGN);
                Ok(())
            });
        }
        command.spawn().expect("ExecStart")
    };
    let mut first = start();
    assert!(wait_until(Duration::from_secs(10), || runs(&log) == 1));
    // Another host's timer fires meanwhile: it exits 0, silently.
    let second = start().wait_with_output().expect("second");
    assert_eq!(second.status.code(), Some(0));
    assert!(second.stdout.is_empty() && second.stderr.is_empty());
    assert_eq!(runs(&log), 1, "the job ran once");
    // `systemctl stop` with KillMode=mixed: SIGTERM to the main process.
    let stopped = Instant::now();
    assert!(support::signal(first.id(), "TERM"));
    let status = first.wait().expect("wait");
    assert!(
        stopped.elapsed() < timeout,
        "ended within TimeoutStopSec: {:?}",
        stopped.elapsed()
    );
    assert_eq!(
        status.code(),
        Some(128 + libc::SIGTERM),
        "the job's own end"
    );
    assert_eq!(held(&server, "nightly-report"), None, "released");
    let outcome: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).expect("report")).expect("JSON");
    assert_eq!(outcome["outcome"], "finished");
    assert_eq!(outcome["command_signal"], libc::SIGTERM);
}

/// The cron file's line run as cron runs it (`/bin/sh -c`, the file's
/// own variables, no terminal) on two "hosts" at once: the job runs once,
/// and the other host says nothing (cron mails nothing) and exits 0; the
/// lock is kept for `--min-hold` after the job started.
#[test]
fn the_cron_line_runs_the_job_once_and_mails_nothing() {
    let text = read(&contrib("cron/redmutex.cron"));
    let mut variables: Vec<(String, String)> = Vec::new();
    let mut line = None;
    for l in text.lines().map(str::trim) {
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        let first = l.split_whitespace().next().unwrap_or_default();
        match first.split_once('=') {
            Some((name, value)) if !name.contains('*') => {
                variables.push((name.to_owned(), value.to_owned()));
            }
            _ => line = Some(l.to_owned()),
        }
    }
    let line = line.expect("a job line");
    // /etc/cron.d: five time fields, the user, then the command.
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(fields.get(5), Some(&"root"), "a cron.d line names its user");
    let command = fields[6..].join(" ");
    assert!(command.contains("--quiet-if-held") && command.contains("--no-wait"));
    let min_hold = duration(option(&fields, "--min-hold").expect("--min-hold"));
    assert!(
        min_hold >= Duration::from_secs(60),
        "covers clocks a minute apart"
    );

    let server = RedisServer::start();
    let dir = support::temp_dir();
    let log = dir.path().join("log");
    let script = job(dir.path(), &log, "1");
    // This machine's job and server; a `--min-hold` a test can wait for.
    let command = command
        .replace("/opt/jobs/hourly.sh", &script.display().to_string())
        .replace("--min-hold 2m", "--min-hold 3s");
    let bin_dir = binary().parent().expect("dir").to_path_buf();
    let host = || {
        let mut sh = Command::new("/bin/sh");
        sh.arg("-c").arg(&command).env_clear();
        for (name, value) in &variables {
            let value = match name.as_str() {
                "REDMUTEX_URL" => server.url(),
                "PATH" => format!("{}:{value}", bin_dir.display()),
                _ => value.clone(),
            };
            sh.env(name, value);
        }
        sh.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        sh.spawn().expect("sh")
    };
    let started = Instant::now();
    let a = host();
    assert!(wait_until(Duration::from_secs(10), || runs(&log) == 1));
    let b = host().wait_with_output().expect("b");
    let a = a.wait_with_output().expect("a");
    for out in [&a, &b] {
        assert_eq!(out.status.code(), Some(0), "{out:?}");
        assert!(
            out.stdout.is_empty() && out.stderr.is_empty(),
            "cron would mail: {out:?}"
        );
    }
    assert_eq!(runs(&log), 1, "the job ran once");
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "--min-hold kept it"
    );
    assert_eq!(
        held(&server, "hourly-report"),
        None,
        "released after --min-hold"
    );
}

/// The CronJob's container command run as its pod runs it: `redmutex` as
/// PID 1 of a PID namespace of its own (as root, with `unshare`; else as
/// an ordinary process), ended as the kubelet ends a pod (SIGTERM to PID
/// 1), well within `terminationGracePeriodSeconds`.
#[test]
fn the_cronjob_command_runs_as_a_pods_pid_1() {
    let text = read(&contrib("kubernetes/cronjob.yaml"));
    let grace: u64 = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("terminationGracePeriodSeconds:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("terminationGracePeriodSeconds");
    // A flow sequence of quoted strings: JSON.
    let command: Vec<String> = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("command:"))
        .and_then(|v| serde_json::from_str(v.trim()).ok())
        .expect("command: [...]");
    assert!(text.contains("concurrencyPolicy: Forbid"));
    let words: Vec<&str> = command.iter().map(String::as_str).collect();
    let kill_after = duration(option(&words, "--kill-after").expect("--kill-after"));
    assert!(
        Duration::from_secs(grace) > kill_after,
        "the kubelet's SIGKILL must come after redmutex has ended the job"
    );

    let server = RedisServer::start();
    let dir = support::temp_dir();
    let log = dir.path().join("log");
    let script = job(dir.path(), &log, "60");
    let mut argv: Vec<String> = command
        .iter()
        .map(|w| {
            if w == "/opt/jobs/nightly-report.sh" {
                script.display().to_string()
            } else if w == "redmutex" {
                binary().display().to_string()
            } else {
                w.clone()
            }
        })
        .collect();
    // SAFETY: geteuid only reads.
    let root = unsafe { libc::geteuid() } == 0;
    let unshare = root
        && Command::new("unshare")
            .args(["--pid", "--fork", "--mount-proc", "true"])
            .status()
            .is_ok_and(|s| s.success());
    if unshare {
        let mut wrapped: Vec<String> =
            ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
                .iter()
                .map(|s| (*s).to_owned())
                .collect();
        wrapped.append(&mut argv);
        argv = wrapped;
    }
    let mut pod = Command::new(&argv[0])
        .args(&argv[1..])
        .env("REDMUTEX_URL", server.url())
        .stdin(Stdio::null())
        .spawn()
        .expect("the container's command");
    assert!(wait_until(Duration::from_secs(10), || runs(&log) == 1));
    // PID 1 of the pod: `redmutex` itself, or the child `unshare` forked.
    let pid1 = if unshare {
        let mut found = None;
        wait_until(Duration::from_secs(5), || {
            found = children_of(pod.id()).into_iter().next();
            found.is_some()
        });
        let pid = found.expect("the namespace's PID 1");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
        assert!(
            status
                .lines()
                .any(|l| l.starts_with("NSpid:") && l.trim_end().ends_with("\t1")),
            "PID 1 in its namespace: {status}"
        );
        pid
    } else {
        pod.id()
    };
    let stopped = Instant::now();
    assert!(support::signal(pid1, "TERM"));
    let status = pod.wait().expect("wait");
    assert!(
        stopped.elapsed() < Duration::from_secs(grace),
        "{:?}",
        stopped.elapsed()
    );
    assert_eq!(
        status.code(),
        Some(128 + libc::SIGTERM),
        "the job's own end"
    );
    assert_eq!(held(&server, "nightly-report"), None, "released");
}
