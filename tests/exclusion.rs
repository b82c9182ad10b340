//! Mutual exclusion, checked two ways: a deliberately non-atomic GET/SET
//! counter under the lock must come out exact, and recorded hold intervals
//! must not overlap. Across threads, across OS processes, and with a holder
//! process killed by SIGKILL.

use redmutex_test_support as support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::Commands;
use redmutex::Lease;
use redmutex::{DistributedLock, LockClient, LockOptions, Release};
use support::RedisServer;

/// Set in a child process of this test binary: which role to play.
const ROLE: &str = "REDMUTEX_TEST_ROLE";
const URL: &str = "REDMUTEX_TEST_URL";

fn options(release: Release) -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_secs(60))
        .release(release)
}

/// One critical section: a read-modify-write split over two round trips, so
/// any overlap of two holders loses an increment.
fn increment(con: &mut redis::Connection) {
    let value: Option<i64> = con.get("counter").expect("GET counter");
    let _: () = con
        .set("counter", value.unwrap_or(0) + 1)
        .expect("SET counter");
}

/// Runs `threads` workers, each taking the lock `iterations` times through
/// `clients[i % clients.len()]`. Returns the local hold intervals. With
/// `log`, each hold also appends "+id" and "-id" to the Redis list `events`,
/// an order that spans processes.
fn run_workers(
    url: &str,
    clients: &[LockClient],
    threads: usize,
    iterations: usize,
    release: Release,
    log: Option<&str>,
) -> Vec<(Instant, Instant)> {
    let intervals = Arc::new(Mutex::new(Vec::with_capacity(threads * iterations)));
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let lock =
                DistributedLock::with_options(&clients[i % clients.len()], "mx", options(release));
            let mut con = redis::Client::open(url)
                .expect("url")
                .get_connection()
                .expect("connection");
            let intervals = intervals.clone();
            let id = log.map(|prefix| format!("{prefix}.{i}"));
            std::thread::spawn(move || {
                for _ in 0..iterations {
                    let guard = lock.lock().expect("lock");
                    let entered = Instant::now();
                    if let Some(id) = &id {
                        let _: () = con.rpush("events", format!("+{id}")).expect("RPUSH");
                    }
                    increment(&mut con);
                    if let Some(id) = &id {
                        let _: () = con.rpush("events", format!("-{id}")).expect("RPUSH");
                    }
                    let left = Instant::now();
                    intervals.lock().expect("intervals").push((entered, left));
                    guard.unlock().expect("unlock");
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().expect("worker");
    }
    let mut intervals = std::mem::take(&mut *intervals.lock().expect("intervals"));
    intervals.sort();
    intervals
}

fn assert_disjoint(intervals: &[(Instant, Instant)]) {
    for pair in intervals.windows(2) {
        assert!(
            pair[1].0 >= pair[0].1,
            "two holders overlapped: {:?} started before the previous hold ended",
            pair[1].0
        );
    }
}

/// The Redis event log must read "+a -a +b -b …": each hold ends before the
/// next begins.
fn assert_alternating(events: &[String]) {
    for pair in events.chunks(2) {
        let [enter, leave] = pair else {
            panic!("an unmatched event: {pair:?}");
        };
        assert!(
            enter.starts_with('+') && leave.starts_with('-'),
            "{enter} then {leave}"
        );
        assert_eq!(
            enter[1..],
            leave[1..],
            "a hold was interleaved with another"
        );
    }
}

#[test]
fn eight_threads_over_two_clients() {
    let server = RedisServer::start();
    for release in [Release::Lua, Release::Watch] {
        let _: () = server.conn().del("counter").expect("DEL");
        let clients = [server.lock_client(), server.lock_client()];
        let intervals = run_workers(&server.url(), &clients, 8, 200, release, None);
        let counter: i64 = server.conn().get("counter").expect("GET");
        assert_eq!(
            counter, 1600,
            "{release:?}: lost increments mean overlapping holders"
        );
        assert_eq!(intervals.len(), 1600);
        assert_disjoint(&intervals);
    }
}

#[test]
fn two_processes() {
    if let Ok(role) = std::env::var(ROLE) {
        // Child: 4 threads, one client of its own, 200 iterations each.
        let url = std::env::var(URL).expect("url from the parent");
        let client = LockClient::open(&url).expect("client");
        let intervals = run_workers(&url, &[client], 4, 200, Release::Lua, Some(&role));
        assert_disjoint(&intervals);
        return;
    }
    let server = RedisServer::start();
    let exe = std::env::current_exe().expect("test binary");
    let mut children: Vec<_> = ["p1", "p2"]
        .iter()
        .map(|role| {
            Command::new(&exe)
                .args([
                    "two_processes",
                    "--exact",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(ROLE, role)
                .env(URL, server.url())
                .stdout(Stdio::null())
                .spawn()
                .expect("spawn a child")
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    for child in &mut children {
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait") {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("a child process did not finish in time");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(status.success(), "a child failed: {status}");
    }
    let mut con = server.conn();
    let counter: i64 = con.get("counter").expect("GET");
    assert_eq!(counter, 1600, "lost increments mean overlapping holders");
    let events: Vec<String> = con.lrange("events", 0, -1).expect("LRANGE");
    assert_eq!(events.len(), 3200);
    assert_alternating(&events);
    for process in ["p1", "p2"] {
        let holds = events
            .iter()
            .filter(|e| e[1..].starts_with(process))
            .count()
            / 2;
        assert_eq!(holds, 800, "{process} ran all its iterations");
    }
}

#[test]
fn a_sigkilled_holder_frees_the_lock_after_its_ttl() {
    let ttl = Duration::from_millis(1_000);
    if std::env::var(ROLE).as_deref() == Ok("holder") {
        let url = std::env::var(URL).expect("url from the parent");
        let client = LockClient::open(&url).expect("client");
        let lock =
            DistributedLock::with_options(&client, "killed", LockOptions::default().ttl(ttl));
        let guard = lock.lock().expect("lock");
        println!("ACQUIRED {}", guard.token());
        std::thread::sleep(Duration::from_secs(60)); // until killed
        return;
    }
    let server = RedisServer::start();
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "a_sigkilled_holder_frees_the_lock_after_its_ttl",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, "holder")
        .env(URL, server.url())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the holder");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // libtest may print "test name ... " on the same line first.
            if let Some((_, token)) = line.split_once("ACQUIRED ") {
                let _ = tx.send(token.trim().to_owned());
                return;
            }
        }
    });
    let token = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the holder acquired");
    // When Redis expires the key: its ttl as Redis counts it, read now.
    let pttl: i64 = redis::cmd("PTTL")
        .arg("killed")
        .query(&mut server.conn())
        .expect("PTTL");
    let expiry = Instant::now() + Duration::from_millis(u64::try_from(pttl).expect("a ttl"));
    child.kill().expect("SIGKILL the holder");
    child.wait().expect("reap");

    let other = server.lock_client();
    let lock = DistributedLock::with_options(
        &other,
        "killed",
        LockOptions::default().wait(Duration::from_secs(5)),
    );
    let held_by: Option<String> = server.conn().get("killed").expect("GET");
    assert_eq!(
        held_by.as_deref(),
        Some(token.as_str()),
        "the dead holder's key stays"
    );
    assert!(lock.try_lock().expect("try").is_none());
    let guard = lock.lock().expect("acquired once the lease ran out");
    let got = Instant::now();
    // Not before the ttl Redis gave it (PTTL is whole milliseconds), and
    // right after it: the waiter sleeps at most the holder's time left,
    // then asks; the slack of a deadline the crate computes
    // (tests/bounds.rs's SHORT_SLACK).
    eprintln!(
        "bound | a SIGKILLed holder's lock taken after its ttl | {:?} after the expiry | limit 0 .. 60ms",
        got.saturating_duration_since(expiry)
    );
    assert!(
        got + Duration::from_millis(2) >= expiry,
        "freed too early: {:?} before the expiry",
        expiry.saturating_duration_since(got)
    );
    assert!(
        got < expiry + Duration::from_millis(60),
        "freed too late: {:?} after the expiry",
        got.saturating_duration_since(expiry)
    );
    assert_ne!(guard.token(), token);
}

/// The request a lease is confirmed with before it is passed on (a whole
/// request: the scripts' own `GET`s never cross the wire).
const CHECK: &str = "*2\r\n$3\r\nGET\r\n";

/// Options for a lease passed along a chain of threads: a handoff budget
/// long enough for the holds here (the default's 10 ms would release in
/// Redis instead of handing on).
fn chain_options() -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_secs(5))
        .handoff_budget(redmutex::HandoffBudget::new(256, Duration::from_secs(10)))
}

/// Thread A of a client behind `proxy` holds a key with two threads of the
/// client queued behind it; the key is deleted and taken by another
/// client; `arm` runs; A lets go. A's lease was last confirmed in Redis
/// at its acquisition, long before: it is confirmed before anything is
/// passed on, so no waiter ever starts on it (they wait for the other
/// client's lock, in vain), and A's unlock says `NotHeld`.
fn never_passed_on_after_its_loss(
    server: &RedisServer,
    proxy: &support::FaultProxy,
    arm: impl Fn(),
) {
    let client = LockClient::open(&proxy.url()).expect("client");
    let options = chain_options();
    // Whether the waiters are queued when A lets go cannot be seen from
    // outside: tried until A asked Redis before passing the lease on (its
    // `GET`; with nobody queued, it releases by script instead).
    for attempt in 0..20 {
        let key = format!("passed:{attempt}");
        let lock = DistributedLock::with_options(&client, &key, options);
        let held = lock.lock().expect("A");
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    lock.try_lock_for(Duration::from_millis(500))
                        .map(|got| got.map(|guard| guard.token().to_owned()))
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));

        // The key deleted and taken elsewhere while A still holds it.
        let breaker = server.lock_client();
        let deleted = DistributedLock::new(&breaker, &key)
            .force_release()
            .expect("force_release");
        assert_eq!(deleted.as_deref(), Some(held.token()));
        let other = server.lock_client();
        let theirs = DistributedLock::new(&other, &key)
            .try_lock()
            .expect("try_lock")
            .expect("the second client takes it");

        proxy.heal();
        proxy.count(CHECK);
        arm();
        let unlocked = held.unlock();
        let asked = proxy.counted(CHECK) > 0;
        let got: Vec<_> = waiters
            .into_iter()
            .map(|waiter| waiter.join().expect("waiter"))
            .collect();
        assert!(
            got.iter().all(|got| matches!(got, Ok(None))),
            "a waiter started on a lease Redis had given to another client: {got:?}"
        );
        assert_eq!(
            support::get(server, &key).as_deref(),
            Some(theirs.token()),
            "the second client still holds it"
        );
        theirs.unlock().expect("theirs");
        assert!(
            matches!(
                unlocked,
                Err(redmutex::Error::NotHeld {
                    reason: redmutex::LossReason::OwnedByOther,
                    ..
                })
            ),
            "{unlocked:?}"
        );
        if asked {
            return;
        }
    }
    panic!("A never had a waiter to pass the lease to in 20 tries");
}

/// On f63675e a lease Redis no longer held was handed on locally: the key
/// deleted (another client's `force_release`) and taken by a second
/// client while thread A held it and thread W of the same client waited,
/// A's unlock handed it to W, and W's call returned with nearly the whole
/// ttl (and `is_lost()` false) beside the second client: two holders,
/// until a check in Redis found it lost a millisecond or more later. A
/// lease Redis last confirmed more than the handoff budget's `max_age` ago
/// is now confirmed before it is passed on: W never starts on it.
#[test]
fn a_lease_redis_no_longer_holds_is_never_handed_on() {
    let server = RedisServer::start();
    let proxy = support::FaultProxy::to(&server);
    never_passed_on_after_its_loss(&server, &proxy, || {});
}

/// The same, with the reply to that confirmation (a `GET`) lost: it only
/// reads, so it is sent again and still finds the loss.
#[test]
fn a_lost_reply_to_the_confirmation_before_a_handoff_is_sent_again() {
    let server = RedisServer::start();
    let proxy = support::FaultProxy::to(&server);
    never_passed_on_after_its_loss(&server, &proxy, || proxy.lose_reply(CHECK, 1));
    assert!(proxy.lost_replies() >= 1, "the fault fired");
}

/// With a handoff budget whose `max_age` is zero, every lease handed on is confirmed by its
/// receiver too, before its call returns: a `GET` by the thread passing it
/// on (so its unlock tells the truth) and one by the thread taking it (so
/// it starts on a lease Redis vouched for after it woke). The receiver's,
/// its reply lost, is sent again.
#[test]
fn a_receiver_confirms_a_lease_older_than_its_max_age() {
    let server = RedisServer::start();
    let proxy = support::FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    let chain = chain_options();
    let options = chain.handoff_budget(chain.extra.handoff_budget.with_max_age(Duration::ZERO));
    for attempt in 0..20 {
        let lock = DistributedLock::with_options(&client, format!("confirmed:{attempt}"), options);
        let held = lock.lock().expect("A");
        let token = held.token().to_owned();
        let waiter = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                let guard = lock.try_lock_for(Duration::from_secs(5)).expect("W")?;
                let got = guard.token().to_owned();
                guard.unlock().expect("W's unlock");
                Some(got)
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        proxy.heal();
        proxy.count(CHECK);
        let lost = proxy.lost_replies();
        // The second `GET` is the receiver's: its reply is lost once.
        proxy.lose_reply_after(CHECK, 1, 1);
        held.unlock().expect("A's unlock");
        let got = waiter.join().expect("waiter");
        if got.as_deref() != Some(token.as_str()) {
            // W was not queued yet: it acquired in Redis itself.
            continue;
        }
        assert_eq!(
            proxy.lost_replies(),
            lost + 1,
            "the receiver's reply was lost"
        );
        assert_eq!(
            proxy.counted(CHECK),
            3,
            "one check by the giver, one by the receiver, sent again"
        );
        return;
    }
    panic!("the lease was never handed on in 20 tries");
}
