//! The watchdog (renewal, loss signal, hold cap) and fencing tokens.

use redmutex_test_support as support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use redis::Commands;
use redmutex::Lease;
use redmutex::{DistributedLock, Error, LockClient, LockOptions, LossReason};
use support::{RedisServer, wait_until};

const ROLE: &str = "REDMUTEX_TEST_ROLE";
const URL: &str = "REDMUTEX_TEST_URL";

fn watched(ttl_ms: u64) -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_millis(ttl_ms))
        .watchdog(true)
}

#[test]
fn the_watchdog_keeps_a_short_lease_alive_and_stops_at_release() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::with_options(&client, "dog", watched(500));
    let guard = lock.lock().expect("lock");
    let token = guard.token().to_owned();
    let started = Instant::now();
    let mut checks = 0;
    while started.elapsed() < Duration::from_millis(1_500) {
        let held: Option<String> = server.conn().get("dog").expect("GET");
        assert_eq!(
            held.as_deref(),
            Some(token.as_str()),
            "renewed past its 500 ms ttl"
        );
        assert!(guard.is_held().expect("is_held"));
        assert!(!guard.is_lost());
        assert!(guard.validity() > Duration::ZERO);
        checks += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(checks >= 10);
    assert!(client.stats().commands >= 4, "renewals were sent");
    guard.unlock().expect("unlock");
    let evalsha = server.command_calls("evalsha");
    let pexpire = server.command_calls("pexpire");
    // Two ttls of quiet: no renewal after the release.
    std::thread::sleep(Duration::from_millis(1_000));
    assert_eq!(
        server.command_calls("evalsha"),
        evalsha,
        "a renewal after unlock"
    );
    assert_eq!(server.command_calls("pexpire"), pexpire);
}

/// Renewals every ttl/3: a lease taken right after a renewal is found
/// lost by the next one, a third of the ttl (200 ms) later, not half of
/// it (300 ms) as a renewal at ttl/2 would.
#[test]
fn a_taken_lease_is_reported_lost_within_a_renewal_period() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let client = server.lock_client();
    let guard = DistributedLock::with_options(&client, "taken", watched(600))
        .lock()
        .expect("lock");
    let signal = guard.loss_signal();
    // Right after a renewal: the key's ttl goes back up.
    let pttl = || -> i64 { server.conn().pttl("taken").expect("PTTL") };
    let mut last = pttl();
    let renewed = wait_until(Duration::from_secs(2), || {
        let now = pttl();
        let up = now > last;
        last = now;
        up
    });
    assert!(renewed, "no renewal");
    let _: () = server.conn().set("taken", "someone-else").expect("SET");
    let overwritten = Instant::now();
    let reason = signal.wait_timeout(Duration::from_secs(3));
    assert_eq!(reason, Some(LossReason::OwnedByOther));
    // A renewal period, and the slack of a deadline the watchdog computes
    // (tests/bounds.rs's SHORT_SLACK): a renewal at ttl/2 would miss it.
    let (took, limit) = (overwritten.elapsed(), Duration::from_millis(200 + 60));
    eprintln!(
        "bound | a taken lease found lost (renewals every ttl/3) | {took:?} | limit {limit:?}"
    );
    assert!(took < limit, "noticed after {took:?}");
    assert!(guard.is_lost());
    assert_eq!(guard.validity(), Duration::ZERO);
    match guard.unlock() {
        Err(Error::NotHeld { reason, .. }) => assert_eq!(reason, LossReason::OwnedByOther),
        other => panic!("expected NotHeld, got {other:?}"),
    }
    let kept: Option<String> = server.conn().get("taken").expect("GET");
    assert_eq!(
        kept.as_deref(),
        Some("someone-else"),
        "the other owner's key is untouched"
    );
}

#[test]
fn a_restart_without_persistence_loses_the_lease_and_another_client_acquires() {
    let mut server = RedisServer::start();
    let client = server.lock_client();
    let guard = DistributedLock::with_options(&client, "restart", watched(600))
        .lock()
        .expect("lock");
    let signal = guard.loss_signal();
    server.restart();
    assert_eq!(
        signal.wait_timeout(Duration::from_secs(5)),
        Some(LossReason::Expired)
    );
    let other = server.lock_client();
    let theirs = DistributedLock::new(&other, "restart")
        .try_lock()
        .expect("try_lock");
    assert!(theirs.is_some(), "the lock is free for others");
    assert!(guard.unlock().expect_err("lost").is_not_held());
}

#[test]
fn a_hold_cap_stops_renewals() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let options = watched(300).max_hold(Some(Duration::from_millis(400)));
    let guard = DistributedLock::with_options(&client, "cap", options)
        .lock()
        .expect("lock");
    let reason = guard.loss_signal().wait_timeout(Duration::from_secs(5));
    assert_eq!(reason, Some(LossReason::MaxHold));
    assert!(wait_until(Duration::from_secs(2), || {
        let held: Option<String> = server.conn().get("cap").expect("GET");
        held.is_none()
    }));
}

#[test]
fn a_failed_try_lock_starts_no_watchdog() {
    let server = RedisServer::start();
    let holder = server.lock_client();
    let _held = DistributedLock::new(&holder, "busy").lock().expect("lock");
    let client = server.lock_client();
    let lock = DistributedLock::with_options(&client, "busy", watched(300));
    assert!(lock.try_lock().expect("try").is_none());
    // A watchdog would have renewed something by now (every ttl/3 = 100 ms).
    std::thread::sleep(Duration::from_millis(350));
    // The client's one TIME (holder metadata), and the one attempt (before
    // Redis 7.0 the refused SET NX GET, then the acquire script, once per
    // client).
    let attempt = if support::server_major() >= 7 { 1 } else { 2 };
    assert_eq!(
        client.stats().commands,
        1 + attempt,
        "only the one attempt was sent"
    );
}

#[test]
fn fencing_tokens_strictly_increase_across_clients_and_processes() {
    if std::env::var(ROLE).as_deref() == Ok("fence") {
        let url = std::env::var(URL).expect("url");
        let client = LockClient::open(&url).expect("client");
        let lock =
            DistributedLock::with_options(&client, "fenced", LockOptions::default().fencing(true));
        for _ in 0..3 {
            let guard = lock.lock().expect("lock");
            println!("FENCE {}", guard.fencing_token().expect("fenced"));
        }
        return;
    }
    let server = RedisServer::start();
    let a = server.lock_client();
    let b = server.lock_client();
    let options = LockOptions::default().fencing(true);
    let mut tokens = Vec::new();
    for client in [&a, &b, &a, &a, &b] {
        let guard = DistributedLock::with_options(client, "fenced", options)
            .lock()
            .expect("lock");
        tokens.push(guard.fencing_token().expect("a fencing token"));
    }
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "fencing_tokens_strictly_increase_across_clients_and_processes",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, "fence")
        .env(URL, server.url())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        if let Some((_, n)) = line.split_once("FENCE ") {
            tokens.push(n.trim().parse().expect("a number"));
        }
    }
    assert!(child.wait().expect("reap").success());
    let guard = DistributedLock::with_options(&b, "fenced", options)
        .lock()
        .expect("lock");
    tokens.push(guard.fencing_token().expect("fenced"));
    assert_eq!(tokens.len(), 9);
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "not strictly increasing: {tokens:?}"
    );
    // Unfenced locks carry no token; the counter shares the key's slot.
    let plain = DistributedLock::new(&a, "plain").lock().expect("lock");
    assert_eq!(plain.fencing_token(), None);
    let counter: u64 = server.conn().get("{fenced}:fence").expect("GET");
    assert_eq!(counter, *tokens.last().expect("tokens"));
}

/// A store that remembers the highest fencing token it has seen and refuses
/// writes carrying a lower one (Kleppmann's example).
fn fenced_write(con: &mut redis::Connection, token: u64, value: &str) -> bool {
    redis::Script::new(
        "local seen = tonumber(redis.call('GET', KEYS[1]) or '0') \
         if tonumber(ARGV[1]) < seen then return 0 end \
         redis.call('SET', KEYS[1], ARGV[1]) redis.call('SET', KEYS[2], ARGV[2]) return 1",
    )
    .key("store:highest")
    .key("store:data")
    .arg(token)
    .arg(value)
    .invoke::<i64>(con)
    .expect("store")
        == 1
}

#[test]
fn a_paused_holders_late_write_is_rejected_by_its_stale_token() {
    let server = RedisServer::start();
    let (a, b) = (server.lock_client(), server.lock_client());
    let options = LockOptions::default()
        .ttl(Duration::from_millis(150))
        .fencing(true);
    let mut store = server.conn();
    let slow = DistributedLock::with_options(&a, "file", options)
        .lock()
        .expect("a");
    let token_33 = slow.fencing_token().expect("token");
    // a pauses (GC, swap…) past its lease; b acquires and writes.
    assert!(wait_until(Duration::from_secs(2), || {
        let held: Option<String> = server.conn().get("file").expect("GET");
        held.is_none()
    }));
    let fast = DistributedLock::with_options(&b, "file", options)
        .lock()
        .expect("b");
    let token_34 = fast.fencing_token().expect("token");
    assert!(token_34 > token_33);
    assert!(fenced_write(&mut store, token_34, "written by b"));
    // a wakes up and writes with its old token: refused.
    assert!(!fenced_write(&mut store, token_33, "late write by a"));
    let data: String = store.get("store:data").expect("GET");
    assert_eq!(data, "written by b");
}

#[test]
fn redis_unreachable_until_the_lease_runs_out_is_a_loss() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let guard = DistributedLock::with_options(&client, "stalled", watched(600))
        .lock()
        .expect("lock");
    let signal = guard.loss_signal();
    server.signal("STOP"); // connects succeed, replies never come
    let reason = signal.wait_timeout(Duration::from_secs(8));
    server.signal("CONT");
    assert_eq!(reason, Some(LossReason::Unreachable));
    assert!(guard.is_lost());
    // Lost by the local clock: Redis may still hold it (the renewals that
    // waited in the stopped server's socket ran on SIGCONT), so the
    // release is sent all the same and nothing of ours is left.
    match guard.unlock() {
        Ok(_) => {}
        Err(err) => assert!(err.is_not_held(), "{err}"),
    }
    let left: Option<String> = server.conn().get("stalled").expect("GET");
    assert_eq!(left, None);
}
