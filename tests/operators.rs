//! `redmutex` as operators run it: in pipelines whose ends are full or
//! closed, under service managers that leave signals ignored, with
//! scripts that read its outcome from a report, and with every option of
//! `run` honoured in every mode.
#![cfg(feature = "cli")]

use redmutex_test_support as support;

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use assert_cmd::cargo::CommandCargoExt;
use redis::Commands;
use redmutex::Lease;
use support::processes::{children_of, comm, gone, read_pid, wait_exit};
use support::{RedisServer, wait_until};

fn redmutex(server: &RedisServer) -> Command {
    let mut command = Command::cargo_bin("redmutex").expect("the redmutex binary");
    command.env("REDMUTEX_URL", server.url());
    command
}

fn held(server: &RedisServer, key: &str) -> Option<String> {
    server.conn().get(key).expect("GET")
}

/// A command whose standard error is a pipe nobody reads, filled by the
/// command itself before `redmutex` has anything to say (a pager that
/// stopped reading, a stalled log collector): `--max-run` still ends it
/// on time, and `redmutex` exits 124. On main the message written before
/// acting blocked the loop: the command ran on and `redmutex` never ended.
#[test]
fn a_full_stderr_does_not_stop_max_run() {
    let server = RedisServer::start();
    let mut run = redmutex(&server)
        .args([
            "run",
            "--max-run",
            "1s",
            "--kill-after",
            "1s",
            "full-stderr",
        ])
        .args(["--", "sh", "-c", "head -c 300000 /dev/zero >&2; sleep 60"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    let status = wait_exit(&mut run, Duration::from_secs(20));
    assert_eq!(status.code(), Some(124));
    assert_eq!(held(&server, "full-stderr"), None, "released");
}

/// The same full stderr, and the lease lost (another owner's token
/// written over it): the command is ended at once and `redmutex` exits 75;
/// nothing is renewed after.
#[test]
fn a_full_stderr_does_not_delay_a_loss() {
    let server = RedisServer::start();
    let dir = support::temp_dir();
    let pid_file = dir.path().join("pid");
    let script = format!(
        "echo $$ > {}; head -c 300000 /dev/zero >&2; sleep 60",
        pid_file.display()
    );
    let mut run = redmutex(&server)
        .args(["run", "--ttl", "3s", "full-loss", "--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || read_pid(&pid_file).is_some()));
    let command = read_pid(&pid_file).expect("pid");
    let _: () = server
        .conn()
        .set("full-loss", "another-owner")
        .expect("SET");
    let lost_at = Instant::now();
    let status = wait_exit(&mut run, Duration::from_secs(20));
    assert_eq!(status.code(), Some(75));
    assert!(gone(command), "the command was ended");
    // A third of the ttl finds the loss, a quarter of --kill-after is the
    // grace after the SIGTERM: well within the ttl.
    assert!(
        lost_at.elapsed() < Duration::from_secs(3),
        "{:?}",
        lost_at.elapsed()
    );
    assert_eq!(
        held(&server, "full-loss").as_deref(),
        Some("another-owner"),
        "the other owner's lock is left alone"
    );
}

/// Output into a closed pipe (`redmutex list | head`, `status | true`)
/// is dropped, never a panic (exit 101): each command exits with the code
/// its work earned. Standard error closed the same.
#[test]
fn a_closed_stdout_or_stderr_is_never_a_panic() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = redmutex::DistributedLock::new(&client, "piped");
    let guard = lock.lock().expect("lock");
    let cases: [(&[&str], i32); 5] = [
        (&["list"], 0),
        (&["status", "piped"], 0),
        (&["status", "piped", "--json"], 0),
        (&["release", "piped", "--token", "not-it"], 1),
        (&["release", "nothing-here", "--force"], 0),
    ];
    for (args, code) in cases {
        for closed in ["stdout", "stderr", "both"] {
            let mut command = redmutex(&server);
            command.args(args);
            if closed != "stderr" {
                command.stdout(Stdio::piped());
            }
            if closed != "stdout" {
                command.stderr(Stdio::piped());
            }
            let mut child = command.spawn().expect("spawn");
            // Closed before anything is written: every write fails.
            drop(child.stdout.take());
            drop(child.stderr.take());
            let status = wait_exit(&mut child, Duration::from_secs(20));
            assert_eq!(status.code(), Some(code), "{args:?} with {closed} closed");
        }
    }
    // doctor's code depends on the deployment; never a panic.
    let mut child = redmutex(&server)
        .arg("doctor")
        .stdout(Stdio::piped())
        .spawn()
        .expect("doctor");
    drop(child.stdout.take());
    let status = wait_exit(&mut child, Duration::from_secs(30));
    assert!(
        matches!(status.code(), Some(0 | 4 | 5)),
        "doctor into a closed pipe: {status:?}"
    );
    guard.unlock().expect("unlock");
}

/// The signals ignored in a process, from `/proc/PID/status` (`SigIgn`).
fn ignored_in(status: &str) -> u64 {
    status
        .lines()
        .find_map(|line| line.strip_prefix("SigIgn:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .expect("SigIgn")
}

/// Signals ignored on entry (systemd ignores SIGPIPE for every service;
/// `nohup` SIGHUP; a script's background job SIGINT and SIGQUIT) are
/// ignored in the command too, and nothing else is: on main SIGPIPE was
/// reset to its default for the command whatever it was on entry.
#[test]
fn signals_ignored_on_entry_stay_ignored_in_the_command() {
    let server = RedisServer::start();
    let bit = |signal: i32| 1u64 << (signal - 1);
    for ignored in [
        vec![],
        vec![libc::SIGPIPE],
        vec![libc::SIGPIPE, libc::SIGHUP, libc::SIGUSR1],
        vec![libc::SIGINT, libc::SIGQUIT],
        // Ignored, the kernel reaps children unasked: the command's end
        // must still be learned, and its own children are its business.
        vec![libc::SIGCHLD],
    ] {
        let mut command = redmutex(&server);
        command.args(["run", "dispositions", "--", "cat", "/proc/self/status"]);
        let to_ignore = ignored.clone();
        // SAFETY: signal(2) between fork and exec.
        unsafe {
            command.pre_exec(move || {
                for signal in &to_ignore {
                    libc::signal(*signal, libc::SIG_IGN);
                }
                Ok(())
            });
        }
        let out = command.output().expect("run");
        assert!(out.status.success(), "{out:?}");
        let mask = ignored_in(&String::from_utf8_lossy(&out.stdout));
        // What the command would have had without `redmutex`: the same
        // dispositions, started directly (whatever this test process
        // ignores itself included).
        let mut direct = Command::new("cat");
        direct.arg("/proc/self/status");
        let to_ignore = ignored.clone();
        // SAFETY: signal(2) between fork and exec.
        unsafe {
            direct.pre_exec(move || {
                for signal in &to_ignore {
                    libc::signal(*signal, libc::SIG_IGN);
                }
                Ok(())
            });
        }
        let direct = direct.output().expect("cat");
        let expected = ignored_in(&String::from_utf8_lossy(&direct.stdout));
        assert!(ignored.iter().all(|s| expected & bit(*s) != 0));
        assert_eq!(mask, expected, "ignored on entry: {ignored:?}");
    }
}

/// The watcher process gone before the command starts (killed while
/// `redmutex` waited for the lock): the command is not run unguarded, and
/// `redmutex` says why and exits 71. On main the command silently never ran
/// and the exit code was 141, as if it had died of SIGPIPE.
#[test]
fn a_gone_watcher_is_reported_and_the_command_not_run() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let guard = redmutex::DistributedLock::new(&client, "no-watcher")
        .lock()
        .expect("lock");
    let dir = support::temp_dir();
    let ran = dir.path().join("ran");
    let mut run = redmutex(&server)
        .args(["run", "--wait", "30s", "no-watcher", "--", "touch"])
        .arg(&ran)
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    let runner = run.id();
    let mut watcher = None;
    assert!(
        wait_until(Duration::from_secs(10), || {
            watcher = children_of(runner)
                .into_iter()
                .find(|pid| comm(*pid).as_deref() == Some("redmutex-watch"));
            watcher.is_some()
        }),
        "a watcher"
    );
    let watcher = watcher.expect("watcher");
    assert!(support::signal(watcher, "KILL"));
    assert!(wait_until(Duration::from_secs(5), || gone(watcher)));
    guard.unlock().expect("unlock");
    let status = wait_exit(&mut run, Duration::from_secs(20));
    let mut stderr = String::new();
    use std::io::Read;
    run.stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr)
        .expect("read");
    assert_eq!(status.code(), Some(71), "{stderr}");
    assert!(stderr.contains("watcher"), "{stderr}");
    assert!(!ran.exists(), "the command never ran");
    assert_eq!(held(&server, "no-watcher"), None, "released");
}

/// Each exit code means one thing: a script whose `#!` interpreter is
/// missing cannot be executed (126, saying so), not "command not found";
/// a key of another type is bad data (65), not "Redis unreachable" (69);
/// a ttl no renewal could keep is refused (2) before anything is taken.
#[test]
fn each_exit_code_means_one_thing() {
    let server = RedisServer::start();
    let dir = support::temp_dir();
    let script = dir.path().join("script");
    std::fs::write(&script, "#!/no/such/interpreter\necho hi\n").expect("write");
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let out = redmutex(&server)
        .args(["run", "interp", "--"])
        .arg(&script)
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(126), "{stderr}");
    assert!(
        stderr.contains("bad interpreter") && stderr.contains("/no/such/interpreter"),
        "{stderr}"
    );

    let _: () = server.conn().hset("a-hash", "f", "v").expect("HSET");
    let _: () = server.conn().rpush("a-list", "v").expect("RPUSH");
    for key in ["a-hash", "a-list"] {
        for args in [
            vec!["status", key],
            vec!["release", key, "--force"],
            vec!["run", "--no-wait", key, "--", "true"],
        ] {
            let out = redmutex(&server).args(&args).output().expect("run");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(65), "{args:?}: {stderr}");
        }
    }
    let list: Vec<String> = server.conn().lrange("a-list", 0, -1).expect("LRANGE");
    assert_eq!(list, ["v"], "nothing changed");

    for ttl in ["1ms", "29ms"] {
        let out = redmutex(&server)
            .args(["run", "--ttl", ttl, "short", "--", "true"])
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{ttl}: {stderr}");
        assert!(stderr.contains("at least 30ms"), "{stderr}");
    }
    assert_eq!(held(&server, "short"), None);
}

/// A run's report as parsed JSON.
fn report(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).expect("the report");
    serde_json::from_str(&text).expect("JSON")
}

/// `--report FILE` says how each kind of run ended, in the words a
/// script acts on.
#[test]
fn the_report_says_how_the_run_ended() {
    let server = RedisServer::start();
    let dir = support::temp_dir();
    let file = |name: &str| dir.path().join(name);

    let out = redmutex(&server)
        .args(["run", "--fencing", "--report"])
        .arg(file("finished"))
        .args(["rep", "--", "sh", "-c", "exit 3"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(3));
    let r = report(&file("finished"));
    assert_eq!(r["outcome"], "finished");
    assert_eq!(r["exit_code"], 3);
    assert_eq!(r["command_exit_code"], 3);
    assert_eq!(r["key"], "rep");
    assert!(r["fencing_token"].as_u64().is_some(), "{r}");
    assert!(r["started_at_ms"].as_u64() <= r["ended_at_ms"].as_u64());

    let client = server.lock_client();
    let guard = redmutex::DistributedLock::new(&client, "rep")
        .lock()
        .expect("lock");
    let out = redmutex(&server)
        .args(["run", "--no-wait", "--quiet-if-held", "--report"])
        .arg(file("held"))
        .args(["rep", "--", "true"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(0));
    let r = report(&file("held"));
    assert_eq!(r["outcome"], "not_acquired");
    assert!(
        r["holder"].as_str().is_some_and(|h| h.contains("held by")),
        "{r}"
    );
    assert!(
        !r.to_string().contains(support::secret(guard.token())),
        "never the holder's secret"
    );
    guard.unlock().expect("unlock");

    let out = redmutex(&server)
        .args(["run", "--max-run", "200ms", "--report"])
        .arg(file("max-run"))
        .args(["rep", "--", "sleep", "30"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(124));
    let r = report(&file("max-run"));
    assert_eq!(r["outcome"], "max_run");
    assert_eq!(r["command_signal"], libc::SIGTERM);

    let out = redmutex(&server)
        .args(["run", "--report"])
        .arg(file("missing"))
        .args(["rep", "--", "/no/such/program"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(127));
    let r = report(&file("missing"));
    assert_eq!(r["outcome"], "not_started");
    assert!(
        r["reason"]
            .as_str()
            .is_some_and(|t| t.contains("not found"))
    );

    let mut run = redmutex(&server)
        .args(["run", "--ttl", "3s", "--report"])
        .arg(file("lost"))
        .args(["rep", "--", "sleep", "30"])
        .stderr(Stdio::null())
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || held(&server, "rep").is_some()));
    let _: () = server.conn().set("rep", "someone-else").expect("SET");
    let status = wait_exit(&mut run, Duration::from_secs(20));
    assert_eq!(status.code(), Some(75));
    let r = report(&file("lost"));
    assert_eq!(r["outcome"], "lost");
    assert!(r["reason"].as_str().is_some_and(|t| !t.is_empty()), "{r}");
    let _: () = server.conn().del("rep").expect("DEL");

    let port = support::free_port();
    let out = redmutex(&server)
        .args(["--url", &format!("redis://127.0.0.1:{port}"), "run"])
        .arg("--report")
        .arg(file("error"))
        .args(["rep", "--", "true"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(69));
    let r = report(&file("error"));
    assert_eq!(r["outcome"], "error");
    assert_eq!(r["exit_code"], 69);

    let out = redmutex(&server)
        .args([
            "run",
            "--report",
            "/no/such/dir/report",
            "rep",
            "--",
            "true",
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "refused before anything runs");
}

/// `release --token-file` takes the token from a file or standard input,
/// never from the command line other users can read.
#[test]
fn release_takes_the_token_from_a_file_or_stdin() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let dir = support::temp_dir();
    for from_stdin in [false, true] {
        let guard = redmutex::DistributedLock::new(&client, "by-file")
            .lock()
            .expect("lock");
        let path = dir.path().join("token");
        std::fs::write(&path, format!("{}\n", guard.token())).expect("write");
        let mut command = redmutex(&server);
        command.args(["release", "by-file", "--token-file"]);
        if from_stdin {
            command
                .arg("-")
                .stdin(std::fs::File::open(&path).expect("open"));
        } else {
            command.arg(&path);
        }
        let out = command.output().expect("release");
        assert_eq!(out.status.code(), Some(0), "{out:?}");
        assert_eq!(held(&server, "by-file"), None);
        std::mem::forget(guard);
    }
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "").expect("write");
    let out = redmutex(&server)
        .args(["release", "by-file", "--token-file"])
        .arg(&empty)
        .output()
        .expect("release");
    assert_eq!(out.status.code(), Some(2));
}

/// A process the command starts outside its group (`setsid`, as a job
/// that hands its partial work to a helper does) a moment before the
/// lease is lost is ended with the command, before `redmutex` exits 75.
/// On main such a process was known only from a look at `/proc` made at
/// most once a second, and ran on beside the next holder.
#[test]
fn a_helper_started_a_moment_before_a_loss_is_ended_too() {
    let server = RedisServer::start();
    let dir = support::temp_dir();
    for round in 0..3 {
        let helper_file = dir.path().join(format!("helper-{round}"));
        let key = format!("helper-{round}");
        let script = format!(
            "setsid sleep 300 & echo $! > {}; sleep 300",
            helper_file.display()
        );
        let mut run = redmutex(&server)
            .args(["run", "--ttl", "300ms", &key, "--", "sh", "-c", &script])
            .stderr(Stdio::null())
            .spawn()
            .expect("run");
        assert!(wait_until(Duration::from_secs(10), || read_pid(
            &helper_file
        )
        .is_some()));
        let helper = read_pid(&helper_file).expect("pid");
        let _: () = server.conn().set(&key, "someone-else").expect("SET");
        let status = wait_exit(&mut run, Duration::from_secs(20));
        assert_eq!(status.code(), Some(75));
        // Ended before `redmutex` exited: at most a zombie being reaped.
        assert!(
            wait_until(Duration::from_secs(2), || gone(helper)),
            "the helper ran on after the loss"
        );
    }
}

/// Every option of `run` honoured in every mode: plain, `--daemon`,
/// `--limit` and both. Each case is a `redmutex` process of its own.
#[test]
fn every_option_is_honoured_in_every_mode() {
    let server = RedisServer::start();
    let dir = support::temp_dir();
    let modes: [&[&str]; 4] = [
        &[],
        &["--daemon"],
        &["--limit", "2"],
        &["--limit", "2", "--daemon"],
    ];
    for (m, mode) in modes.iter().enumerate() {
        let key = |case: &str| format!("mode{m}-{case}");
        // --max-run: 124, with the command (or, with --daemon, the daemon
        // it left) still running.
        let script = if mode.contains(&"--daemon") {
            "sleep 30 & exit 0"
        } else {
            "sleep 30"
        };
        let out = redmutex(&server)
            .arg("run")
            .args(*mode)
            .args(["--max-run", "300ms", "--kill-after", "1s", &key("max-run")])
            .args(["--", "sh", "-c", script])
            .output()
            .expect("run");
        assert_eq!(out.status.code(), Some(124), "{mode:?} --max-run: {out:?}");

        // --min-hold: the lock is kept that long after a quick command.
        let started = Instant::now();
        let out = redmutex(&server)
            .arg("run")
            .args(*mode)
            .args(["--min-hold", "700ms", &key("min-hold"), "--", "true"])
            .output()
            .expect("run");
        assert_eq!(out.status.code(), Some(0), "{mode:?} --min-hold: {out:?}");
        assert!(started.elapsed() >= Duration::from_millis(700), "{mode:?}");

        // --fencing: the token reaches the command.
        let out = redmutex(&server)
            .arg("run")
            .args(*mode)
            .args(["--fencing", &key("fencing"), "--", "sh", "-c"])
            .arg("test -n \"$REDMUTEX_FENCING_TOKEN\"")
            .output()
            .expect("run");
        assert_eq!(out.status.code(), Some(0), "{mode:?} --fencing: {out:?}");

        // --label: the holder says it while the command runs.
        let check = format!(
            "redmutex_status=$(\"$REDMUTEX_BIN\" status {} --json); \
             case \"$redmutex_status\" in *nightly-42*) exit 0;; *) exit 9;; esac",
            key("label")
        );
        let out = redmutex(&server)
            .env("REDMUTEX_BIN", assert_cmd::cargo::cargo_bin("redmutex"))
            .arg("run")
            .args(*mode)
            .args([
                "--label",
                "nightly-42",
                &key("label"),
                "--",
                "sh",
                "-c",
                &check,
            ])
            .output()
            .expect("run");
        assert_eq!(out.status.code(), Some(0), "{mode:?} --label: {out:?}");

        // --report: written in every mode.
        let path = dir.path().join(key("report"));
        let out = redmutex(&server)
            .arg("run")
            .args(*mode)
            .arg("--report")
            .arg(&path)
            .args([&key("report"), "--", "true"])
            .output()
            .expect("run");
        assert_eq!(out.status.code(), Some(0), "{mode:?} --report: {out:?}");
        assert_eq!(report(&path)["outcome"], "finished", "{mode:?}");

        // --no-wait and --conflict-exit-code against a holder.
        let client = server.lock_client();
        let holder = if mode.contains(&"--limit") {
            let semaphore = redmutex::Semaphore::new(&client, key("busy"), 2);
            let permits = (
                semaphore.acquire().expect("permit"),
                semaphore.acquire().expect("permit"),
            );
            Box::new(permits) as Box<dyn std::any::Any>
        } else {
            Box::new(
                redmutex::DistributedLock::new(&client, key("busy"))
                    .lock()
                    .expect("lock"),
            )
        };
        let out = redmutex(&server)
            .arg("run")
            .args(*mode)
            .args([
                "--no-wait",
                "--conflict-exit-code",
                "7",
                &key("busy"),
                "--",
                "true",
            ])
            .output()
            .expect("run");
        assert_eq!(out.status.code(), Some(7), "{mode:?} --no-wait: {out:?}");
        drop(holder);
    }
}

/// The reaper (the command's parent) killed: `redmutex`, the parent of
/// every orphan it leaves, ends everything below it, releases the lock
/// and exits 71: the command's end cannot be learned, so it is not
/// reported as the command's own result.
#[test]
fn a_killed_reaper_ends_everything_and_exits_71() {
    let server = RedisServer::start();
    let dir = support::temp_dir();
    let helper_file = dir.path().join("helper");
    let command_file = dir.path().join("command");
    let script = format!(
        "setsid sleep 300 & echo $! > {}; echo $$ > {}; exec sleep 300",
        helper_file.display(),
        command_file.display()
    );
    let mut run = redmutex(&server)
        .args(["run", "reaper-killed", "--", "sh", "-c", &script])
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || read_pid(
        &command_file
    )
    .is_some()
        && read_pid(&helper_file).is_some()));
    let (command, helper) = (
        read_pid(&command_file).expect("pid"),
        read_pid(&helper_file).expect("pid"),
    );
    let reaper = children_of(run.id())
        .into_iter()
        .find(|pid| comm(*pid).as_deref() == Some("redmutex-reap"))
        .expect("a reaper");
    assert!(support::signal(reaper, "KILL"));
    let status = wait_exit(&mut run, Duration::from_secs(20));
    assert_eq!(status.code(), Some(71));
    assert!(wait_until(Duration::from_secs(5), || gone(command) && gone(helper)));
    assert_eq!(held(&server, "reaper-killed"), None, "released");
}

/// Two different signals in a row (systemd's SIGTERM then SIGHUP with
/// `SendSIGHUP=yes`): both are passed on, not only the last.
#[test]
fn two_signals_in_a_row_are_both_passed_on() {
    let server = RedisServer::start();
    let dir = support::temp_dir();
    let (log, ready) = (dir.path().join("log"), dir.path().join("ready"));
    let script = format!(
        "trap 'echo TERM >> {log}' TERM; trap 'echo HUP >> {log}' HUP; touch {ready}; \
         i=0; while [ $i -lt 100 ]; do i=$((i+1)); sleep 0.05 & wait $!; done",
        log = log.display(),
        ready = ready.display()
    );
    let mut child = redmutex(&server)
        .args(["run", "two-signals", "--", "bash", "-c", &script])
        .process_group(0)
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || ready.exists()));
    assert!(support::signal(child.id(), "TERM"));
    assert!(support::signal(child.id(), "HUP"));
    let _ = wait_exit(&mut child, Duration::from_secs(20));
    let got = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        got.contains("TERM") && got.contains("HUP"),
        "the command got: {got:?}"
    );
}

/// ^C (SIGINT to `redmutex`, passed on, and the command dies of it):
/// `redmutex` dies of SIGINT too once done, as flock(1) does, so a shell
/// script that runs it stops there instead of going on (an exit code of
/// 130 tells a shell the signal was handled). The lock is released first.
#[test]
fn an_interrupted_run_dies_of_sigint() {
    let server = RedisServer::start();
    let dir = support::temp_dir();
    let ready = dir.path().join("ready");
    let mut child = redmutex(&server)
        .args(["run", "interrupted", "--", "sh", "-c"])
        .arg(format!("touch {}; exec sleep 30", ready.display()))
        .process_group(0)
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || ready.exists()));
    assert!(support::signal(child.id(), "INT"));
    let status = wait_exit(&mut child, Duration::from_secs(20));
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGINT), "{status:?}");
    assert_eq!(held(&server, "interrupted"), None, "released before");
}

/// `--report FILE` where FILE is a symlink someone planted: the symlink
/// is replaced, its target never written.
#[test]
fn the_report_never_writes_through_a_planted_symlink() {
    let server = RedisServer::start();
    let dir = support::temp_dir();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "precious").expect("write");
    let report = dir.path().join("report.json");
    std::os::unix::fs::symlink(&victim, &report).expect("symlink");
    let out = redmutex(&server)
        .args(["run", "--report"])
        .arg(&report)
        .args(["symlinked", "--", "true"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        std::fs::read_to_string(&victim).expect("victim"),
        "precious"
    );
    assert!(
        !std::fs::symlink_metadata(&report)
            .expect("report")
            .file_type()
            .is_symlink()
    );
    assert!(
        std::fs::read_to_string(&report)
            .expect("report")
            .contains("finished")
    );
}
