//! `WaitMode::Notify`: local queues, pub/sub wake-up, in-process handoff.

use redmutex_test_support as support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use redis::Commands;
use redmutex::Lease;
use redmutex::{Backoff, DistributedLock, LockClient, LockOptions, WaitMode};
use support::{RedisServer, wait_until};

const ROLE: &str = "REDMUTEX_TEST_ROLE";
const URL: &str = "REDMUTEX_TEST_URL";

/// The release channel of a key without a hash tag (documented naming).
fn channel(key: &str) -> String {
    format!("redmutex:released:{{{key}}}")
}

fn subscribers(server: &RedisServer, key: &str) -> u64 {
    let reply: (String, u64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(channel(key))
        .query(&mut server.conn())
        .expect("PUBSUB NUMSUB");
    reply.1
}

/// A backoff so slow that only a release message (or the holder's expiry)
/// can explain a prompt acquisition.
fn slow_waiter() -> LockOptions {
    LockOptions::default()
        .backoff(Backoff::constant(Duration::from_secs(10)))
        .wait(Duration::from_secs(30))
}

#[test]
fn a_waiter_in_another_process_wakes_on_the_release_message() {
    if std::env::var(ROLE).as_deref() == Ok("waiter") {
        let url = std::env::var(URL).expect("url");
        let client = LockClient::open(&url).expect("client");
        let guard = DistributedLock::with_options(&client, "wake", slow_waiter())
            .lock()
            .expect("lock");
        println!("ACQUIRED {}", guard.token());
        return;
    }
    let server = RedisServer::start();
    let holder = server.lock_client();
    let guard = DistributedLock::new(&holder, "wake").lock().expect("lock");
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "a_waiter_in_another_process_wakes_on_the_release_message",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, "waiter")
        .env(URL, server.url())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the waiter");
    let stdout = child.stdout.take().expect("stdout");
    // The waiter is subscribed, so it is past its first attempt.
    assert!(wait_until(Duration::from_secs(10), || subscribers(
        &server, "wake"
    ) >= 1));
    std::thread::sleep(Duration::from_millis(50)); // let it settle into its wait
    let released = Instant::now();
    guard.unlock().expect("unlock");
    let mut seen = None;
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        if seen.is_none() && line.contains("ACQUIRED ") {
            seen = Some((line, released.elapsed()));
        }
    }
    let (line, lag) = seen.expect("the waiter acquired");
    assert!(child.wait().expect("reap").success());
    assert!(line.contains('-'), "{line}");
    // Its backoff is 10 s: only the message explains this.
    assert!(
        lag < Duration::from_millis(1_000),
        "woke {lag:?} after the release"
    );
}

#[test]
fn a_lock_freed_by_expiry_is_taken_without_a_message() {
    let server = RedisServer::start();
    let holder = server.lock_client();
    let ttl = Duration::from_millis(300);
    let guard = DistributedLock::with_options(&holder, "expiry", LockOptions::default().ttl(ttl))
        .lock()
        .expect("lock");
    // When Redis expires the key: its ttl as Redis counts it, read now.
    let pttl: i64 = server.conn().pttl("expiry").expect("PTTL");
    let expiry = Instant::now() + Duration::from_millis(u64::try_from(pttl).expect("a ttl"));
    std::mem::forget(guard); // never released, never announced
    let waiter = server.lock_client();
    let guard = DistributedLock::with_options(&waiter, "expiry", slow_waiter())
        .lock()
        .expect("acquired after the expiry");
    let got = Instant::now();
    // The head sleeps at most the holder's time left (its backoff step is
    // far longer): taken right at the expiry, not before (PTTL is whole
    // milliseconds), with the slack of a deadline the crate computes
    // (tests/bounds.rs's SHORT_SLACK).
    eprintln!(
        "bound | a lock freed by expiry taken without a message | {:?} after the expiry | limit 0 .. 60ms",
        got.saturating_duration_since(expiry)
    );
    assert!(
        got + Duration::from_millis(2) >= expiry,
        "taken before the expiry"
    );
    assert!(
        got < expiry + Duration::from_millis(60),
        "waited {:?} past the expiry: the PTTL bound failed",
        got.saturating_duration_since(expiry)
    );
    assert_eq!(
        waiter.stats().notifications,
        0,
        "no release message was sent"
    );
    drop(guard);
}

/// Runs `threads` workers per client, `rounds` acquisitions each; returns
/// every hold interval and checks the Redis counter.
fn hammer(
    server: &RedisServer,
    clients: &[LockClient],
    threads: usize,
    rounds: usize,
    options: LockOptions,
) -> Vec<(Instant, Instant, usize)> {
    let intervals = Arc::new(Mutex::new(Vec::new()));
    let start = Arc::new(Barrier::new(clients.len() * threads));
    let handles: Vec<_> = clients
        .iter()
        .enumerate()
        .flat_map(|(c, client)| (0..threads).map(move |_| (c, client.clone())))
        .map(|(c, client)| {
            let lock = DistributedLock::with_options(&client, "hammer", options);
            let mut con = server.conn();
            let (intervals, start) = (intervals.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                for _ in 0..rounds {
                    let guard = lock.lock().expect("lock");
                    let entered = Instant::now();
                    let n: Option<i64> = con.get("hammer:n").expect("GET");
                    let _: () = con.set("hammer:n", n.unwrap_or(0) + 1).expect("SET");
                    intervals
                        .lock()
                        .expect("intervals")
                        .push((entered, Instant::now(), c));
                    guard.unlock().expect("unlock");
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().expect("worker");
    }
    let n: i64 = server.conn().get("hammer:n").expect("GET");
    assert_eq!(
        n as usize,
        clients.len() * threads * rounds,
        "lost increments"
    );
    let mut intervals = std::mem::take(&mut *intervals.lock().expect("intervals"));
    intervals.sort_by_key(|i| i.0);
    for pair in intervals.windows(2) {
        assert!(pair[1].0 >= pair[0].1, "two holders overlapped");
    }
    intervals
}

#[test]
fn waiters_of_two_clients_all_make_progress() {
    let server = RedisServer::start();
    let clients = [server.lock_client(), server.lock_client()];
    let options = LockOptions::default().wait(Duration::from_secs(30));
    let started = Instant::now();
    let intervals = hammer(&server, &clients, 4, 100, options);
    assert!(started.elapsed() < Duration::from_secs(30));
    // Neither client is starved: the other one's turn comes at least
    // after every two of its runs (a run: one acquisition in Redis and at
    // most 256 handoffs, or 10 ms). Counts per stretch are not even: a
    // client whose holds are short enough for interception passes more
    // leases in its 10 ms than one whose holds are not.
    let per_client = |c| intervals.iter().filter(|i| i.2 == c).count();
    assert_eq!(per_client(0), 400);
    assert_eq!(per_client(1), 400);
    let longest = intervals
        .chunk_by(|a, b| a.2 == b.2)
        .map(<[_]>::len)
        .max()
        .unwrap_or(0);
    assert!(
        longest <= 2 * 257,
        "one client held {longest} times in a row while the other waited"
    );
    for client in &clients {
        let stats = client.stats();
        assert!(stats.handoffs > 0, "{stats:?}");
        assert!(
            stats.handoffs <= 256 * stats.acquired,
            "the budget caps handoffs per acquisition: {stats:?}"
        );
    }
}

#[test]
fn a_handed_off_guard_starts_with_at_least_half_its_ttl() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let ttl = Duration::from_millis(200);
    let options = LockOptions::default()
        .ttl(ttl)
        .wait(Duration::from_secs(20))
        .handoff_budget(redmutex::HandoffBudget::new(
            10_000,
            Duration::from_secs(60),
        )); // long batches
    let validities = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..3)
        .map(|_| {
            let lock = DistributedLock::with_options(&client, "half", options);
            let mut con = server.conn();
            let validities = validities.clone();
            std::thread::spawn(move || {
                for _ in 0..40 {
                    let guard = lock.lock().expect("lock");
                    let at_start = guard.validity();
                    // PTTL first: a validity read after it can only be smaller.
                    let pttl: i64 = con.pttl("half").expect("PTTL");
                    let after = guard.validity();
                    validities.lock().expect("v").push((at_start, after, pttl));
                    std::thread::sleep(Duration::from_millis(3));
                    drop(guard);
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().expect("worker");
    }
    let stats = client.stats();
    assert!(stats.handoffs > 50, "{stats:?}");
    for (at_start, after, pttl) in validities.lock().expect("v").iter() {
        assert!(
            *at_start + Duration::from_millis(20) >= ttl / 2,
            "a new holder started with {at_start:?} of a {ttl:?} lease"
        );
        assert!(
            after.as_millis() as i64 <= *pttl + 1,
            "validity {after:?} beyond Redis's PTTL {pttl}"
        );
    }
}

#[test]
fn a_killed_subscriber_connection_does_not_strand_waiters() {
    let server = RedisServer::start();
    let holder = server.lock_client();
    let waiter = server.lock_client();
    let waiting = LockOptions::default()
        .backoff(Backoff::new(
            Duration::from_millis(20),
            Duration::from_millis(100),
            2,
        ))
        .wait(Duration::from_secs(10));
    for round in 0..2 {
        let guard = DistributedLock::new(&holder, "kill").lock().expect("lock");
        let (waiter, waiting) = (waiter.clone(), waiting);
        let thread = std::thread::spawn(move || {
            let guard = DistributedLock::with_options(&waiter, "kill", waiting).lock();
            (Instant::now(), guard.map(|g| g.depth()))
        });
        assert!(wait_until(Duration::from_secs(10), || subscribers(
            &server, "kill"
        ) >= 1));
        if round == 0 {
            let killed: i64 = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("TYPE")
                .arg("pubsub")
                .query(&mut server.conn())
                .expect("CLIENT KILL");
            assert!(killed >= 1);
        }
        std::thread::sleep(Duration::from_millis(30));
        let released = Instant::now();
        guard.unlock().expect("unlock");
        let (acquired_at, got) = thread.join().expect("waiter");
        assert_eq!(got.expect("the waiter acquires"), 1);
        let lag = acquired_at.saturating_duration_since(released);
        assert!(
            lag < Duration::from_secs(1),
            "round {round}: waited {lag:?} after release"
        );
    }
}

#[test]
fn a_client_without_a_subscriber_falls_back_to_backoff() {
    let server = RedisServer::start();
    let holder = server.lock_client();
    let pool = redmutex::r2d2::Pool::builder()
        .max_size(4)
        .test_on_check_out(false)
        .build(redis::Client::open(server.url()).expect("url"))
        .expect("pool");
    let waiter = LockClient::new(pool);
    let guard = DistributedLock::new(&holder, "nosub").lock().expect("lock");
    let w = waiter.clone();
    let thread = std::thread::spawn(move || {
        DistributedLock::with_options(
            &w,
            "nosub",
            LockOptions::default().wait(Duration::from_secs(10)),
        )
        .lock()
        .map(|g| g.depth())
    });
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(subscribers(&server, "nosub"), 0, "no subscriber connection");
    guard.unlock().expect("unlock");
    assert_eq!(thread.join().expect("waiter").expect("acquired"), 1);
}

#[test]
fn spin_mode_sends_no_release_subscriptions() {
    let server = RedisServer::start();
    let holder = server.lock_client();
    let waiter = server.lock_client();
    let guard = DistributedLock::new(&holder, "spin").lock().expect("lock");
    let w = waiter.clone();
    let thread = std::thread::spawn(move || {
        DistributedLock::with_options(
            &w,
            "spin",
            LockOptions::default()
                .wait_mode(WaitMode::Spin)
                .wait(Duration::from_secs(10)),
        )
        .lock()
        .map(|g| g.depth())
    });
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(subscribers(&server, "spin"), 0);
    guard.unlock().expect("unlock");
    assert_eq!(thread.join().expect("waiter").expect("acquired"), 1);
    assert_eq!(waiter.stats().handoffs, 0);
}

/// After holds too short to be worth a wake-up, a thread that locks again
/// at once may take the lease handed to a sleeping waiter, only within
/// 100 µs of that waiter's lease (eventual fairness). The lock stays exclusive, a
/// thread that locks now and then among four hot ones gets every turn it
/// asks for within `lock()`'s wait, and nearly every acquisition passes
/// inside the process, without Redis.
#[test]
fn hot_threads_with_tiny_holds_stay_exclusive_and_starve_no_one() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let server = RedisServer::start();
    let client = server.lock_client();
    let options = LockOptions::default().wait(Duration::from_secs(20));
    let inside = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let overlaps = Arc::new(AtomicU64::new(0));
    let enter = |inside: &AtomicBool, overlaps: &AtomicU64| {
        if inside.swap(true, Ordering::SeqCst) {
            overlaps.fetch_add(1, Ordering::SeqCst);
        }
        inside.store(false, Ordering::SeqCst);
    };
    let hot: Vec<_> = (0..4)
        .map(|_| {
            let lock = DistributedLock::with_options(&client, "hot", options);
            let (inside, stop, overlaps) = (inside.clone(), stop.clone(), overlaps.clone());
            std::thread::spawn(move || {
                let mut taken = 0u64;
                while !stop.load(Ordering::SeqCst) && taken < 2_000_000 {
                    let guard = lock.lock().expect("a hot thread locks");
                    enter(&inside, &overlaps);
                    guard.unlock().expect("and unlocks");
                    taken += 1;
                }
                taken
            })
        })
        .collect();
    let lock = DistributedLock::with_options(&client, "hot", options);
    let mut turns = 0;
    for _ in 0..200 {
        match lock.lock() {
            Ok(guard) => {
                enter(&inside, &overlaps);
                drop(guard);
                turns += 1;
            }
            Err(err) => {
                stop.store(true, Ordering::SeqCst);
                panic!("the occasional locker starved after {turns} turns: {err}");
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, Ordering::SeqCst);
    let taken: Vec<u64> = hot.into_iter().map(|h| h.join().expect("hot")).collect();
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "two holders at once");
    assert!(taken.iter().all(|n| *n > 0), "{taken:?}");
    let stats = client.stats();
    assert!(
        stats.handoffs > stats.acquired,
        "most acquisitions should pass inside the process: {stats:?}"
    );
}
