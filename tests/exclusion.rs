//! Mutual exclusion, checked two ways: a deliberately non-atomic GET/SET
//! counter under the lock must come out exact, and recorded hold intervals
//! must not overlap. Across threads, across OS processes, and with a holder
//! process killed by SIGKILL.

use redmutex_test_support as support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::Commands;
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
    let acquired = Instant::now();
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
    let after = acquired.elapsed();
    assert!(
        after >= ttl - Duration::from_millis(300),
        "freed too early: {after:?}"
    );
    assert!(
        after <= ttl + Duration::from_millis(500),
        "freed too late: {after:?}"
    );
    assert_ne!(guard.token(), token);
}

/// On main a lease Redis no longer held was handed on locally: the key
/// deleted (another client's `force_release`) and taken by a second
/// client while thread A held it and thread W of the same client waited,
/// A's unlock handed it to W, and W's guard claimed nearly its whole ttl
/// (and `is_lost()` false) beside the second client: two holders, the
/// second made by the crate. A lease passed on is now checked in Redis:
/// W's guard reads as lost within a millisecond and a round trip, its
/// unlock says `NotHeld`, and it is not passed on again.
#[test]
fn a_lease_redis_no_longer_holds_is_found_lost_when_passed_on_and_passed_no_further() {
    let server = RedisServer::start();
    let client = server.lock_client();
    passed_on_after_its_loss(&server, &client, || {});
}

/// The same, with the reply to the lease's check in Redis (a `GET`) lost:
/// the check only reads, so it is sent again and still finds the loss.
#[test]
fn a_lost_reply_to_a_lease_check_is_sent_again() {
    let server = RedisServer::start();
    let proxy = support::FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    passed_on_after_its_loss(&server, &client, || {
        proxy.lose_reply("*2\r\n$3\r\nGET\r\n", 1);
    });
    assert!(proxy.lost_replies() >= 1, "the fault fired");
}

/// Options for a lease passed along a chain of threads: a handoff budget
/// long enough for the holds here (the default's 10 ms would release in
/// Redis instead of handing on).
fn chain_options() -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_secs(5))
        .handoff_budget(256, Duration::from_secs(10))
}

/// Thread A of `client` holds a key with two threads of the client queued
/// behind it; the key is deleted and taken by another client; `arm` runs;
/// A's unlock hands the lease on. The receiver must find it lost, say
/// `NotHeld` and pass it on no further.
fn passed_on_after_its_loss(server: &RedisServer, client: &LockClient, arm: impl Fn()) {
    let options = chain_options();
    // Whether the waiters are queued when A lets go cannot be seen from
    // outside: tried until A's unlock handed the lease on (almost always
    // the first time).
    for attempt in 0..20 {
        let key = format!("passed:{attempt}");
        let lock = DistributedLock::with_options(client, &key, options.clone());
        let held = lock.lock().expect("A");
        let (tx, rx) = std::sync::mpsc::channel();
        let waiters: Vec<_> = (0..2)
            .map(|n| {
                let lock = lock.clone();
                let tx = tx.clone();
                std::thread::spawn(move || {
                    let got = lock.try_lock_for(Duration::from_secs(2)).expect("wait");
                    let Some(guard) = got else {
                        let _ = tx.send((n, None));
                        return;
                    };
                    let lost = support::wait_until(Duration::from_secs(2), || guard.is_lost());
                    let validity = guard.validity();
                    let unlocked = guard.unlock();
                    let _ = tx.send((n, Some((lost, validity, unlocked))));
                })
            })
            .collect();
        drop(tx);
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

        // A knows nothing yet (nothing asked Redis since it acquired): its
        // unlock hands the lease on, if a waiter is queued.
        arm();
        let handed_on = held.unlock().is_ok();
        let outcomes: Vec<_> = rx.iter().collect();
        for waiter in waiters {
            waiter.join().expect("waiter");
        }
        let handed: Vec<_> = outcomes
            .iter()
            .filter_map(|(_, got)| got.as_ref())
            .collect();
        assert_eq!(
            support::get(server, &key).as_deref(),
            Some(theirs.token()),
            "the second client still holds it"
        );
        theirs.unlock().expect("theirs");
        if !handed_on {
            assert!(handed.is_empty(), "{outcomes:?}");
            continue;
        }
        assert_eq!(handed.len(), 1, "passed on once, not again: {outcomes:?}");
        let (lost, validity, unlocked) = handed[0];
        assert!(*lost, "the receiver's guard never read as lost");
        assert_eq!(*validity, Duration::ZERO);
        assert!(
            matches!(
                unlocked,
                Err(redmutex::Error::NotHeld {
                    reason: redmutex::NotHeldReason::OwnedByOther,
                    ..
                })
            ),
            "{unlocked:?}"
        );
        return;
    }
    panic!("A's unlock never handed the lease on in 20 tries");
}

/// A check of a lease in Redis, as the verifier sends it (a whole request:
/// the scripts' own `GET`s never cross the wire).
const CHECK: &str = "*2\r\n$3\r\nGET\r\n";

/// The slow chain: A holds a few milliseconds, hands the lease to W, W
/// holds a few more and releases it in Redis within 20 ms of A's
/// acquisition. W's release
/// answers for the lease: no check is sent. (Each check would cost a
/// command per two acquisitions on a key held this way by two threads.)
/// Tried until one round was fast enough to count (a loaded machine may
/// take longer than 20 ms for a round).
#[test]
fn a_lease_handed_on_once_while_young_costs_no_check() {
    let server = RedisServer::start();
    let proxy = support::FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    let lock = DistributedLock::new(&client, "young:once");
    for _ in 0..50 {
        proxy.heal();
        proxy.lose_reply(CHECK, 1);
        let started = Instant::now();
        let held = lock.lock().expect("A");
        let token = held.token().to_owned();
        let waiter = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                let guard = lock.try_lock_for(Duration::from_secs(2)).expect("W");
                let passed = guard.as_ref().map(|g| g.token().to_owned());
                if let Some(guard) = guard {
                    // A slow hold: long enough for a check due at once to
                    // go out before the release.
                    std::thread::sleep(Duration::from_millis(5));
                    guard.unlock().expect("W's unlock");
                }
                (passed, Instant::now())
            })
        };
        std::thread::sleep(Duration::from_millis(3));
        held.unlock().expect("A's unlock");
        let (passed, done) = waiter.join().expect("waiter");
        let fast = done.duration_since(started) < Duration::from_millis(15);
        if passed.as_deref() != Some(token.as_str()) || !fast {
            continue;
        }
        // Past the young window: a check still queued would have gone out.
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(proxy.armed(), 1, "a young lease handed on once was checked");
        return;
    }
    panic!("no round handed the lease on within 15 ms in 50 tries");
}

/// The same young chain handed on a second time: its check is not skipped
/// (brought forward to 1 ms after the acquisition, `verify.rs`) and goes
/// out while the second receiver holds the lease.
#[test]
fn a_lease_handed_on_twice_while_young_is_checked() {
    let server = RedisServer::start();
    let proxy = support::FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    let options = chain_options();
    let lock = DistributedLock::with_options(&client, "young:twice", options);
    for _ in 0..20 {
        proxy.heal();
        proxy.lose_reply(CHECK, 1);
        let held = lock.lock().expect("A");
        let token = held.token().to_owned();
        let order = AtomicUsize::new(0);
        // (handed the lease, nth receiver, the check went out while held)
        let received: Vec<(bool, usize, bool)> = std::thread::scope(|scope| {
            let waiters: Vec<_> = (0..2)
                .map(|_| {
                    scope.spawn(|| {
                        let guard = lock.try_lock_for(Duration::from_secs(2)).expect("W")?;
                        let handed = guard.token() == token;
                        let nth = order.fetch_add(1, Ordering::SeqCst);
                        let checked = handed
                            && nth == 1
                            && support::wait_until(Duration::from_secs(2), || proxy.armed() == 0);
                        guard.unlock().expect("W's unlock");
                        Some((handed, nth, checked))
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(3));
            held.unlock().expect("A's unlock");
            waiters
                .into_iter()
                .filter_map(|waiter| waiter.join().expect("waiter"))
                .collect()
        });
        if received.len() != 2 || !received.iter().all(|(handed, _, _)| *handed) {
            continue;
        }
        let second = received.iter().find(|(_, nth, _)| *nth == 1);
        assert!(
            second.is_some_and(|(_, _, checked)| *checked),
            "a young lease handed on twice was never checked: {received:?}"
        );
        return;
    }
    panic!("the lease was never handed on twice in 20 tries");
}

/// A young lease lost in Redis while its first receiver holds it (its
/// check not due yet) is not passed on a second time: the receiver checks
/// it in Redis before passing it on, finds it another's, and its unlock
/// says `NotHeld`; the next waiter never gets it.
#[test]
fn a_young_lease_lost_is_not_passed_on_a_second_time() {
    let server = RedisServer::start();
    let client = server.lock_client();
    young_and_lost(&server, &client, || {}, || true);
}

/// The same, with the reply to the receiver's own check lost: a read, sent
/// again, and it still finds the loss before passing the lease on.
#[test]
fn a_lost_reply_to_a_check_before_passing_on_is_sent_again() {
    let server = RedisServer::start();
    let proxy = support::FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    young_and_lost(
        &server,
        &client,
        || {
            proxy.heal();
            proxy.lose_reply(CHECK, 1);
        },
        || proxy.lost_replies() >= 1,
    );
}

/// A holds a young lease with two threads queued; the key is deleted and
/// taken by another client; `arm` runs and A hands the lease on. Tried
/// until A handed it on and `fired` says the round counts.
fn young_and_lost(
    server: &RedisServer,
    client: &LockClient,
    arm: impl Fn(),
    fired: impl Fn() -> bool,
) {
    let options = chain_options();
    for attempt in 0..20 {
        let key = format!("young:lost:{attempt}");
        let lock = DistributedLock::with_options(client, &key, options.clone());
        let held = lock.lock().expect("A");
        let token = held.token().to_owned();
        let order = AtomicUsize::new(0);
        // (nth receiver, its token, its unlock's outcome)
        type Received = (usize, String, Result<(), redmutex::Error>);
        let (received, theirs): (Vec<Received>, _) = std::thread::scope(|scope| {
            let waiters: Vec<_> = (0..2)
                .map(|_| {
                    scope.spawn(|| {
                        let guard = lock.try_lock_for(Duration::from_millis(300)).expect("W")?;
                        let nth = order.fetch_add(1, Ordering::SeqCst);
                        let got = guard.token().to_owned();
                        std::thread::sleep(Duration::from_millis(2));
                        Some((nth, got, guard.unlock()))
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(3));
            // Deleted and taken by another client while A holds it.
            let breaker = server.lock_client();
            DistributedLock::new(&breaker, &key)
                .force_release()
                .expect("force_release");
            let other = server.lock_client();
            let theirs = DistributedLock::new(&other, &key)
                .try_lock()
                .expect("try_lock")
                .expect("the other client takes it");
            arm();
            let _ = held.unlock();
            let received = waiters
                .into_iter()
                .filter_map(|waiter| waiter.join().expect("waiter"))
                .collect();
            (received, theirs)
        });
        assert_eq!(
            support::get(server, &key).as_deref(),
            Some(theirs.token()),
            "the other client still holds it"
        );
        theirs.unlock().expect("theirs");
        let passed: Vec<_> = received
            .iter()
            .filter(|(_, got, _)| *got == token)
            .collect();
        if passed.is_empty() || !fired() {
            // A's unlock did not hand it on (no waiter queued yet), or the
            // fault this round was armed for did not fire.
            continue;
        }
        assert_eq!(passed.len(), 1, "passed on twice: {received:?}");
        assert!(
            matches!(passed[0].2, Err(redmutex::Error::NotHeld { .. })),
            "{received:?}"
        );
        return;
    }
    panic!("A's unlock never handed the lease on (with the fault fired) in 20 tries");
}
