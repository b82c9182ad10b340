//! The plain lock against a real redis-server: acquire, release, extend,
//! validity, waiting, bad input and broken servers.

use redmutex_test_support as support;

use std::time::{Duration, Instant};

use redis::Commands;
use redmutex::Lease;
use redmutex::{DistributedLock, Error, LockClient, LockOptions, LossReason, Release};
use support::{RedisServer, wait_until};

const RELEASES: [Release; 2] = [Release::Lua, Release::Watch];

fn opts(ttl_ms: u64) -> LockOptions {
    LockOptions::default().ttl(Duration::from_millis(ttl_ms))
}

fn get(con: &mut redis::Connection, key: &str) -> Option<String> {
    con.get(key).expect("GET")
}

fn pttl(con: &mut redis::Connection, key: &str) -> i64 {
    con.pttl(key).expect("PTTL")
}

#[test]
fn acquire_writes_token_with_ttl_and_release_deletes_it() {
    let server = RedisServer::start();
    let mut con = server.conn();
    let client = server.lock_client();
    for release in RELEASES {
        let lock = DistributedLock::with_options(&client, "job", opts(10_000).release(release));
        let guard = lock.lock().expect("lock");
        assert_eq!(guard.key(), "job");
        assert_eq!(guard.depth(), 1);
        assert!(uuid_like(guard.token()), "token {:?}", guard.token());
        assert_eq!(get(&mut con, "job").as_deref(), Some(guard.token()));
        let left = pttl(&mut con, "job");
        assert!(left > 10_000 - 50 && left <= 10_000, "PTTL {left}");
        assert!(guard.is_held().expect("is_held"));
        guard.unlock().expect("unlock");
        assert_eq!(
            get(&mut con, "job"),
            None,
            "{release:?} release deletes the key"
        );
    }
}

/// A 128-bit secret in base64url, then the holder metadata (five more
/// fields).
fn uuid_like(token: &str) -> bool {
    let secret = token.split('|').next().unwrap_or_default();
    secret.len() == 22
        && secret
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        && token.split('|').count() == 6
}

#[test]
fn every_acquisition_gets_a_fresh_token() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::new(&client, "fresh");
    let first = lock.lock().expect("lock").token().to_owned();
    let second = lock.lock().expect("lock").token().to_owned();
    assert_ne!(first, second);
}

#[test]
fn try_lock_is_exclusive_while_held() {
    let server = RedisServer::start();
    let a = server.lock_client();
    let b = server.lock_client();
    let held = DistributedLock::new(&a, "ex").try_lock().expect("try_lock");
    let held = held.expect("free lock is acquired");
    let other = DistributedLock::new(&b, "ex");
    assert!(other.try_lock().expect("try_lock").is_none());
    // Another thread of the same client is not the holder either.
    let a2 = a.clone();
    let from_thread = std::thread::spawn(move || {
        DistributedLock::new(&a2, "ex")
            .try_lock()
            .map(|g| g.is_some())
    })
    .join()
    .expect("thread");
    assert!(!from_thread.expect("try_lock"));
    drop(held);
    assert!(other.try_lock().expect("try_lock").is_some());
}

#[test]
fn release_never_deletes_another_owners_key() {
    let server = RedisServer::start();
    let mut con = server.conn();
    for release in RELEASES {
        let mine = server.lock_client();
        let theirs = server.lock_client();
        let guard = DistributedLock::with_options(&mine, "shared", opts(100).release(release))
            .lock()
            .expect("lock");
        assert!(wait_until(Duration::from_secs(2), || get(
            &mut con, "shared"
        )
        .is_none()));
        let their_guard = DistributedLock::new(&theirs, "shared")
            .lock()
            .expect("lock");
        let err = guard.unlock().expect_err("not ours any more");
        assert_eq!(
            err.not_held_reason(),
            Some(LossReason::OwnedByOther),
            "{release:?}"
        );
        assert!(err.is_not_held());
        assert_eq!(
            get(&mut con, "shared").as_deref(),
            Some(their_guard.token())
        );
        assert!(their_guard.is_held().expect("is_held"));
        their_guard.unlock().expect("their unlock");
    }
}

#[test]
fn expired_and_taken_are_reported_distinctly() {
    let server = RedisServer::start();
    let mut con = server.conn();
    let client = server.lock_client();
    for release in RELEASES {
        let guard = DistributedLock::with_options(&client, "exp", opts(50).release(release))
            .lock()
            .expect("lock");
        assert!(wait_until(Duration::from_secs(2), || get(&mut con, "exp").is_none()));
        assert_eq!(guard.validity(), Duration::ZERO);
        assert!(!guard.is_held().expect("is_held"));
        match guard.unlock() {
            Err(Error::NotHeld { key, reason }) => {
                assert_eq!(key, "exp");
                assert_eq!(reason, LossReason::Expired, "{release:?}");
            }
            other => panic!("expected NotHeld(Expired), got {other:?}"),
        }
        // unlock_with picks the method explicitly.
        let guard = DistributedLock::with_options(&client, "exp", opts(50))
            .lock()
            .expect("lock");
        let _: () = con.set("exp", "someone-else").expect("SET");
        let err = guard.unlock_with(release).expect_err("taken");
        assert_eq!(err.not_held_reason(), Some(LossReason::OwnedByOther));
        assert_eq!(get(&mut con, "exp").as_deref(), Some("someone-else"));
        let _: () = con.del("exp").expect("DEL");
    }
}

#[test]
fn extend_is_owner_checked_and_never_recreates() {
    let server = RedisServer::start();
    let mut con = server.conn();
    let client = server.lock_client();
    let lock = DistributedLock::with_options(&client, "ext", opts(1_000));

    let mut guard = lock.lock().expect("lock");
    guard.extend(Duration::from_secs(20)).expect("extend");
    let left = pttl(&mut con, "ext");
    assert!(left > 19_900 && left <= 20_000, "PTTL after extend {left}");
    assert!(guard.validity() > Duration::from_secs(19));
    // Shorter is allowed too: the lease becomes what was asked.
    guard.extend(Duration::from_millis(500)).expect("extend");
    assert!(pttl(&mut con, "ext") <= 500);
    assert!(matches!(
        guard.extend(Duration::ZERO),
        Err(Error::InvalidArgument(_))
    ));
    assert!(
        pttl(&mut con, "ext") > 0,
        "a rejected extend changes nothing"
    );

    // Expired: not re-created.
    assert!(wait_until(Duration::from_secs(3), || get(&mut con, "ext").is_none()));
    let err = guard.extend(Duration::from_secs(5)).expect_err("expired");
    assert_eq!(err.not_held_reason(), Some(LossReason::Expired));
    let exists: bool = con.exists("ext").expect("EXISTS");
    assert!(!exists, "extend must never re-create an expired lock");
    drop(guard);

    // Owned by another: its ttl untouched.
    let mut guard = lock.lock().expect("lock");
    let _: () = redis::cmd("SET")
        .arg("ext")
        .arg("other")
        .arg("PX")
        .arg(3_000)
        .query(&mut con)
        .expect("SET");
    let err = guard.extend(Duration::from_secs(60)).expect_err("taken");
    assert_eq!(err.not_held_reason(), Some(LossReason::OwnedByOther));
    assert!(pttl(&mut con, "ext") <= 3_000);
    assert_eq!(get(&mut con, "ext").as_deref(), Some("other"));
}

#[test]
fn validity_never_exceeds_what_redis_allows() {
    let server = RedisServer::start();
    let mut con = server.conn();
    let client = server.lock_client();
    let ttl = Duration::from_secs(10);
    let guard = DistributedLock::with_options(&client, "valid", LockOptions::default().ttl(ttl))
        .lock()
        .expect("lock");
    let left_in_redis = Duration::from_millis(pttl(&mut con, "valid") as u64);
    let validity = guard.validity();
    let drift = ttl / 100 + Duration::from_millis(2);
    assert!(
        validity + drift <= left_in_redis + Duration::from_millis(1),
        "validity {validity:?} + drift must stay within Redis's PTTL {left_in_redis:?}"
    );
    assert!(
        validity > ttl - drift - Duration::from_millis(100),
        "{validity:?}"
    );
    std::thread::sleep(Duration::from_millis(20));
    assert!(guard.validity() < validity, "validity counts down");
}

#[test]
fn try_lock_for_gives_up_at_its_deadline() {
    let server = RedisServer::start();
    let holder = server.lock_client();
    let waiter = server.lock_client();
    let _held = DistributedLock::new(&holder, "deadline")
        .lock()
        .expect("lock");
    let lock = DistributedLock::new(&waiter, "deadline");
    for wait in [Duration::from_millis(300), Duration::from_millis(700)] {
        let started = Instant::now();
        assert!(lock.try_lock_for(wait).expect("try_lock_for").is_none());
        let took = started.elapsed();
        assert!(
            took + Duration::from_millis(100) >= wait && took <= wait + Duration::from_millis(100),
            "try_lock_for({wait:?}) took {took:?}"
        );
    }
    let started = Instant::now();
    let deadline = started + Duration::from_millis(250);
    assert!(lock.try_lock_until(deadline).expect("until").is_none());
    let late = Instant::now().saturating_duration_since(deadline);
    assert!(
        late <= Duration::from_millis(100),
        "returned {late:?} after the deadline"
    );
    // A deadline already past still makes one attempt.
    assert!(lock.try_lock_until(started).expect("until").is_none());
    assert!(lock.try_lock_for(Duration::ZERO).expect("for").is_none());
}

#[test]
fn lock_times_out_with_the_time_waited() {
    let server = RedisServer::start();
    let holder = server.lock_client();
    let _held = DistributedLock::new(&holder, "busy").lock().expect("lock");
    let waiter = server.lock_client();
    let lock = DistributedLock::with_options(
        &waiter,
        "busy",
        LockOptions::default().wait(Duration::from_millis(200)),
    );
    match lock.lock() {
        Err(err @ Error::Timeout { .. }) => {
            assert!(err.is_timeout());
            let Error::Timeout {
                key,
                waited,
                holder,
            } = err
            else {
                unreachable!()
            };
            assert_eq!(key, "busy");
            assert!(holder.is_some(), "the refusals named the holder");
            // Its wait, then one last attempt at the deadline: not sooner,
            // and later only by that attempt's round trip and the slack of
            // a deadline the crate computes (tests/bounds.rs's SHORT_SLACK).
            let wait = Duration::from_millis(200);
            eprintln!(
                "bound | lock() timing out after its wait | {waited:?} | limit {wait:?} .. +60ms"
            );
            assert!(
                waited >= wait && waited < wait + Duration::from_millis(60),
                "{waited:?}"
            );
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
}

#[test]
fn a_blocked_waiter_acquires_promptly_after_release() {
    let server = RedisServer::start();
    let holder = server.lock_client();
    let waiter = server.lock_client();
    let guard = DistributedLock::new(&holder, "handoff")
        .lock()
        .expect("lock");
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        let lock = DistributedLock::with_options(
            &waiter,
            "handoff",
            LockOptions::default().wait(Duration::from_secs(10)),
        );
        tx.send(()).expect("send");
        let guard = lock.lock();
        (Instant::now(), guard.map(|g| g.token().to_owned()))
    });
    rx.recv().expect("waiter started");
    std::thread::sleep(Duration::from_millis(300)); // let the waiter's backoff reach its cap
    let released_at = Instant::now();
    guard.unlock().expect("unlock");
    let (acquired_at, token) = thread.join().expect("waiter thread");
    token.expect("waiter acquires");
    let lag = acquired_at.saturating_duration_since(released_at);
    // The backoff caps at 64 ms; allow for a loaded machine.
    assert!(
        lag < Duration::from_millis(500),
        "waiter took {lag:?} after release"
    );
}

#[test]
fn bad_input_is_rejected_and_changes_nothing() {
    let server = RedisServer::start();
    let mut con = server.conn();
    let client = server.lock_client();
    let before = server.command_calls("set");

    let empty = DistributedLock::new(&client, "");
    assert!(matches!(empty.lock(), Err(Error::InvalidArgument(_))));
    assert!(matches!(empty.try_lock(), Err(Error::InvalidArgument(_))));

    for ttl in [Duration::ZERO, Duration::from_micros(500)] {
        let lock = DistributedLock::with_options(&client, "k", LockOptions::default().ttl(ttl));
        let err = lock.try_lock().expect_err("ttl under 1 ms");
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains("ttl"), "{err}");
        assert!(matches!(lock.lock(), Err(Error::InvalidArgument(_))));
    }
    let far = DistributedLock::with_options(
        &client,
        "k",
        LockOptions::default().ttl(Duration::from_secs(400 * 365 * 24 * 3600)),
    );
    assert!(matches!(far.try_lock(), Err(Error::InvalidArgument(_))));

    assert_eq!(server.command_calls("set"), before, "nothing was sent");
    let size: u64 = redis::cmd("DBSIZE").query(&mut con).expect("DBSIZE");
    assert_eq!(size, 0);
}

#[test]
fn a_key_of_another_type_is_named_in_the_error() {
    let server = RedisServer::start();
    let mut con = server.conn();
    let client = server.lock_client();
    let _: () = con.hset("profile", "name", "ada").expect("HSET");
    let lock = DistributedLock::new(&client, "profile");
    for result in [lock.try_lock().map(|_| ()), lock.lock().map(|_| ())] {
        match result {
            Err(Error::WrongType { key }) => assert_eq!(key, "profile"),
            other => panic!("expected WrongType, got {other:?}"),
        }
    }
    let err = lock
        .try_lock_for(Duration::from_secs(5))
        .expect_err("WRONGTYPE");
    assert!(err.to_string().contains("profile"), "{err}");
    let name: String = con.hget("profile", "name").expect("HGET");
    assert_eq!(name, "ada", "the hash is untouched");

    // A lock key overwritten with a hash while held: release says so too.
    for release in RELEASES {
        let guard = DistributedLock::with_options(&client, "l", opts(10_000).release(release))
            .lock()
            .expect("lock");
        let _: () = con.del("l").expect("DEL");
        let _: () = con.hset("l", "f", "v").expect("HSET");
        match guard.unlock() {
            Err(Error::WrongType { key }) => assert_eq!(key, "l"),
            other => panic!("expected WrongType from {release:?}, got {other:?}"),
        }
        let kind: String = redis::cmd("TYPE").arg("l").query(&mut con).expect("TYPE");
        assert_eq!(kind, "hash");
        let _: () = con.del("l").expect("DEL");
    }
}

#[test]
fn a_url_that_does_not_parse_is_invalid_argument() {
    for url in ["", "http://127.0.0.1/", "redis://127.0.0.1:notaport/"] {
        match LockClient::open(url) {
            Err(Error::InvalidArgument(msg)) => assert!(msg.contains("URL"), "{msg}"),
            other => panic!("{url:?}: expected InvalidArgument, got {other:?}"),
        }
    }
    assert!(matches!(
        LockClient::builder()
            .url("redis://127.0.0.1:1/")
            .timeout(Duration::ZERO)
            .build(),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn an_unreachable_server_is_an_error_within_the_timeout() {
    let port = support::free_port(); // nothing listens here
    let client = LockClient::builder()
        .url(format!("redis://127.0.0.1:{port}/"))
        .timeout(Duration::from_millis(500))
        .build()
        .expect("open does not connect");
    let lock = DistributedLock::new(&client, "nowhere");
    for attempt in [
        Box::new(|| lock.try_lock().map(|g| g.is_some())) as Box<dyn Fn() -> _>,
        Box::new(|| lock.lock().map(|_| true)),
        Box::new(|| {
            lock.try_lock_for(Duration::from_secs(5))
                .map(|g| g.is_some())
        }),
    ] {
        let started = Instant::now();
        let result = attempt();
        let took = started.elapsed();
        match result {
            Err(err) => {
                assert!(err.is_connection(), "{err}");
                assert!(!err.is_timeout(), "not a lock timeout: {err}");
            }
            Ok(got) => panic!("an unreachable server gave Ok({got})"),
        }
        // Within the timeout (one connect's wait: the pool tries again
        // after a refused connect until it runs out), and a slack for
        // scheduling below the timeout.
        let limit = Duration::from_millis(500) + Duration::from_millis(300);
        eprintln!("bound | an unreachable server's error | {took:?} | limit {limit:?}");
        assert!(took < limit, "took {took:?}");
    }
}

#[test]
fn lua_release_survives_script_flush_and_restart() {
    let mut server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::new(&client, "flush");

    lock.lock()
        .expect("lock")
        .unlock()
        .expect("loads the script");
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut server.conn())
        .expect("SCRIPT FLUSH");
    let mut guard = lock.lock().expect("lock");
    guard
        .extend(Duration::from_secs(5))
        .expect("extend after flush");
    guard.unlock().expect("release after flush");
    assert_eq!(get(&mut server.conn(), "flush"), None);

    // A restart empties the script cache and leaves the pool's connections stale.
    let held = lock.lock().expect("lock");
    drop(held);
    server.restart();
    let guard = lock
        .lock()
        .expect("lock after restart, on a fresh connection");
    guard.unlock().expect("release after restart");
    assert_eq!(get(&mut server.conn(), "flush"), None);
}

#[test]
fn a_guard_released_during_panic_unwind() {
    let server = RedisServer::start();
    let mut con = server.conn();
    let client = server.lock_client();
    let c = client.clone();
    let result = std::thread::spawn(move || {
        let _guard = DistributedLock::new(&c, "unwind").lock().expect("lock");
        panic!("the critical section fails");
    })
    .join();
    assert!(result.is_err(), "the thread panicked");
    assert_eq!(
        get(&mut con, "unwind"),
        None,
        "the guard released while unwinding"
    );
    assert!(
        DistributedLock::new(&client, "unwind")
            .try_lock()
            .expect("try")
            .is_some()
    );
}

#[test]
fn a_forgotten_guard_frees_the_lock_after_its_ttl() {
    let server = RedisServer::start();
    let mut con = server.conn();
    let a = server.lock_client();
    let b = server.lock_client();
    let ttl = Duration::from_millis(400);
    let guard = DistributedLock::with_options(&a, "crash", LockOptions::default().ttl(ttl))
        .lock()
        .expect("lock");
    let acquired = Instant::now();
    std::mem::forget(guard); // a holder that never releases
    let other = DistributedLock::with_options(
        &b,
        "crash",
        LockOptions::default().wait(Duration::from_secs(5)),
    );
    assert!(other.try_lock().expect("try").is_none());
    let guard = other.lock().expect("acquired after the ttl");
    let after = acquired.elapsed();
    assert!(
        after >= ttl - Duration::from_millis(50),
        "freed too early: {after:?}"
    );
    assert!(
        after < ttl + Duration::from_millis(400),
        "freed too late: {after:?}"
    );
    assert_eq!(get(&mut con, "crash").as_deref(), Some(guard.token()));
    // The forgetting thread itself acquires anew rather than re-entering the dead lease.
    drop(guard);
    let again = DistributedLock::new(&a, "crash").lock().expect("lock");
    assert_eq!(again.depth(), 1);
}

/// Settings are read back from the built lock (getters without `get_`), and
/// the lock family's `new` takes the shared part of the client's defaults.
#[test]
fn locks_read_their_settings_back() {
    use redmutex::{HandoffBudget, RedLock, ReentrantLock, Release, RwLock, WaitMode};
    let server = RedisServer::start();
    let defaults = LockOptions::default()
        .ttl(Duration::from_secs(7))
        .wait(Duration::from_secs(3))
        .wait_mode(WaitMode::Spin);
    let client = server.lock_client().with_defaults(defaults);
    let lock = DistributedLock::with_options(
        &client,
        "settings",
        defaults
            .release(Release::Watch)
            .fencing(true)
            .watchdog(true)
            .max_hold(Some(Duration::from_secs(60)))
            .handoff_budget(redmutex::HandoffBudget::new(4, Duration::from_millis(2)))
            .min_replicas(1, Duration::from_millis(50)),
    );
    assert_eq!(lock.options().ttl, Duration::from_secs(7));
    assert_eq!(lock.options().wait, Duration::from_secs(3));
    assert_eq!(lock.options().wait_mode, WaitMode::Spin);
    assert_eq!(lock.options().extra.release, Release::Watch);
    assert!(lock.options().extra.fencing && lock.options().watchdog);
    assert_eq!(lock.options().max_hold, Some(Duration::from_secs(60)));
    assert_eq!(
        lock.options().extra.handoff_budget,
        HandoffBudget::new(4, Duration::from_millis(2))
    );
    assert_eq!(
        lock.options().extra.min_replicas,
        Some((1, Duration::from_millis(50)))
    );

    let rw = RwLock::new(&client, "rw-settings");
    assert_eq!(
        (rw.options().ttl, rw.options().wait),
        (Duration::from_secs(7), Duration::from_secs(3))
    );
    assert!(!rw.options().extra.prefer_readers);
    let reentrant = ReentrantLock::new(&client, "re-settings");
    assert_eq!(reentrant.options().ttl, Duration::from_secs(7));
    let lease = defaults.with_extra(Default::default());
    assert_eq!(
        lease,
        redmutex::Options::default()
            .ttl(Duration::from_secs(7))
            .wait(Duration::from_secs(3))
            .wait_mode(WaitMode::Spin)
    );
    let redlock = RedLock::with_options(vec![client], "rl-settings", lease).expect("one node");
    assert_eq!(redlock.options().backoff, redmutex::Backoff::default());
    assert_eq!(redlock.options().wait, Duration::from_secs(3));
}
