//! Case 14: the calling process is stopped and continued in the middle of a
//! call (a paused VM, a debugger, a stopped container). Linux then fails
//! the blocked read on a socket with a timeout with `EINTR`. On main 8 of
//! 8 `try_lock()` calls returned `Error::Redis("Interrupted system call")`
//! while Redis kept the lock under a token nobody owned. Now the call is
//! resent like one whose connection dropped, and the caller gets its lock.

use redmutex_test_support as support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use redmutex::Lease;
use redmutex::{DistributedLock, LockClient, LockOptions};
use support::{FaultProxy, RedisServer, exists, get};

const ROLE: &str = "REDMUTEX_SIGSTOP_ROLE";
const URL: &str = "REDMUTEX_SIGSTOP_URL";
const ROUNDS: usize = 8;

/// The child: takes the lock `ROUNDS` times, saying when each call starts
/// and how it ended, and releases when the parent says so.
#[test]
fn child() {
    if std::env::var_os(ROLE).is_none() {
        return;
    }
    let url = std::env::var(URL).expect("url");
    let client = LockClient::open(&url).expect("client");
    let lock = DistributedLock::with_options(&client, "stop", LockOptions::default());
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    for round in 0..ROUNDS {
        println!("@@ calling {round}");
        let _ = std::io::stdout().flush();
        match lock.try_lock() {
            Ok(Some(guard)) => {
                println!("@@ ok {round} {}", guard.token());
                let _ = std::io::stdout().flush();
                let _ = lines.next();
                let released = guard.unlock();
                println!("@@ released {round} {}", released.is_ok());
            }
            Ok(None) => println!("@@ held {round}"),
            Err(err) => println!("@@ error {round} {err}"),
        }
        let _ = std::io::stdout().flush();
    }
    println!("@@ resends {}", client.stats().resends);
}

fn signal(pid: u32, name: &str) {
    assert!(support::signal(pid, name), "kill -{name} {pid}");
}

#[test]
fn a_call_interrupted_by_sigstop_and_sigcont_is_resent() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    // Each call takes ~300 ms: time to stop the caller in the middle.
    proxy.set_latency(Duration::from_millis(150), Duration::from_millis(150));
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env(ROLE, "child")
        .env(URL, proxy.url())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the child");
    let pid = child.id();
    let mut stdin = child.stdin.take().expect("stdin");
    let stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let mut acquired = 0;
    let mut interrupted = 0;
    let mut resends: u64 = 0;
    for line in stdout.lines() {
        let line = line.expect("line");
        // The test harness may print on the same line first.
        let Some((_, said)) = line.split_once("@@") else {
            continue;
        };
        let words: Vec<&str> = said.split_whitespace().collect();
        match words.as_slice() {
            ["calling", _] => {
                // Stop it while its request is on the wire.
                std::thread::sleep(Duration::from_millis(100));
                signal(pid, "STOP");
                std::thread::sleep(Duration::from_millis(400));
                signal(pid, "CONT");
                interrupted += 1;
            }
            ["ok", round, token] => {
                acquired += 1;
                assert_eq!(
                    get(&server, "stop").as_deref(),
                    Some(*token),
                    "round {round}"
                );
                writeln!(stdin, "release").expect("tell the child");
            }
            ["released", round, ok] => {
                assert_eq!(*ok, "true", "round {round}");
                assert!(!exists(&server, "stop"), "round {round}");
            }
            ["error", round, ..] => panic!("round {round}: {line}"),
            ["held", round] => panic!("round {round}: nobody else holds it"),
            ["resends", n] => resends = n.parse().expect("a count"),
            _ => {}
        }
    }
    let status = child.wait().expect("child");
    assert!(status.success());
    assert_eq!(interrupted, ROUNDS);
    assert_eq!(acquired, ROUNDS, "every interrupted call got its lock");
    assert!(resends > 0, "the interruptions did hit calls in flight");
}
