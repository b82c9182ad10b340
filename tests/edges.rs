//! The edges of the lock found by the fault model: untaken handoffs,
//! `min_replicas` input, handoffs to waiters with other options, a
//! `validity()` that must never wait on the network, and corrupt fencing
//! counters.

use redmutex_test_support as support;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use redis::Commands;
use redmutex::Lease;
use redmutex::{DistributedLock, Error, LockClient, LockOptions, ReentrantLock};
use support::{FaultProxy, RedisServer, exists, get};

/// Case 5: a waiter's deadline passes just as the holder hands it the
/// lease. On main the orphaned lease was released in Redis but the client
/// still recorded a local holder: `try_lock()` answered `None` without
/// asking Redis until the old lease's ttl ran out. Many rounds of the race,
/// with random timings; after each, Redis and the client must agree that
/// the lock is free.
#[test]
fn an_untaken_handoff_leaves_no_local_hold() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let client = server.lock_client();
    let options = LockOptions::default()
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_secs(5));
    let lock = DistributedLock::with_options(&client, "k", options);
    let mut dice = support::Dice(0x2545_F491_4F6C_DD1D);
    let mut micros = move |max: u64| dice.below(max);
    let handoffs_before = client.stats().handoffs;
    for round in 0..150 {
        let start = Arc::new(Barrier::new(2));
        let hold_for = Duration::from_micros(500 + micros(2500));
        let wait_for = Duration::from_micros(500 + micros(2500));
        let holder = {
            let (lock, start) = (lock.clone(), start.clone());
            std::thread::spawn(move || {
                let guard = lock.lock().expect("lock");
                start.wait();
                std::thread::sleep(hold_for);
                drop(guard);
            })
        };
        let waiter = {
            let (lock, start) = (lock.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                let got = lock.try_lock_for(wait_for).expect("try_lock_for");
                drop(got);
            })
        };
        holder.join().expect("holder");
        waiter.join().expect("waiter");
        assert!(!exists(&server, "k"), "round {round}: Redis still holds it");
        let commands = client.stats().commands;
        let guard = lock.try_lock().expect("try_lock");
        assert!(
            guard.is_some(),
            "round {round}: a stale local hold refused the lock"
        );
        assert!(
            client.stats().commands > commands,
            "round {round}: Redis was asked"
        );
        drop(guard);
    }
    assert!(
        client.stats().handoffs > handoffs_before,
        "the race took handoffs: {:?}",
        client.stats()
    );
}

/// Case 6: `min_replicas` timeouts are checked before anything is sent.
/// On main `WAIT n 0` blocked for ever, and a timeout at or above the read
/// timeout failed with the key left set for the whole ttl.
#[test]
fn min_replicas_timeouts_are_checked_before_anything_is_sent() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let client = server.lock_client();
    for timeout in [
        Duration::ZERO,
        Duration::from_micros(500),
        redmutex::DEFAULT_TIMEOUT,
        Duration::from_secs(60),
        Duration::MAX,
    ] {
        let lock = DistributedLock::with_options(
            &client,
            "m",
            LockOptions::default().min_replicas(1, timeout),
        );
        match lock.try_lock() {
            Err(Error::InvalidArgument(msg)) => assert!(msg.contains("min_replicas"), "{msg}"),
            other => panic!("{timeout:?}: expected InvalidArgument, got {other:?}"),
        }
    }
    let keys: i64 = redis::cmd("DBSIZE")
        .query(&mut server.conn())
        .expect("DBSIZE");
    assert_eq!(keys, 0, "nothing was written");
}

/// Case 8: a handoff respects the receiver's options. On main a
/// watchdog waiter received an unwatched lease (it then expired mid-work)
/// and a fenced waiter got no fencing token.
#[test]
fn a_handoff_takes_the_receivers_watchdog_and_never_reaches_a_fenced_waiter() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let client = server.lock_client();
    // A budget long enough that the giver may hand off after its hold.
    let plain = DistributedLock::with_options(
        &client,
        "h",
        LockOptions::default()
            .ttl(Duration::from_millis(800))
            .handoff_budget(redmutex::HandoffBudget::new(32, Duration::from_secs(10))),
    );
    let watched = DistributedLock::with_options(
        &client,
        "h",
        LockOptions::default()
            .ttl(Duration::from_millis(800))
            .watchdog(true)
            .wait(Duration::from_secs(5)),
    );
    // Whether the waiter is queued when the holder lets go cannot be seen
    // from outside: try until a handoff happened (almost always at once).
    let mut handed = false;
    for _ in 0..20 {
        let guard = plain.lock().expect("lock");
        let handoffs = client.stats().handoffs;
        let waiter = {
            let watched = watched.clone();
            std::thread::spawn(move || {
                let guard = watched.lock().expect("lock");
                // Longer than the ttl: only renewals keep it.
                std::thread::sleep(Duration::from_millis(1500));
                let kept = !guard.is_lost() && guard.is_held().expect("is_held");
                (kept, guard.unlock())
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        drop(guard);
        let (kept, unlocked) = waiter.join().expect("waiter");
        unlocked.expect("unlock");
        if client.stats().handoffs > handoffs {
            assert!(
                kept,
                "the receiver's watchdog renewed the handed-over lease"
            );
            handed = true;
            break;
        }
    }
    assert!(handed, "no handoff in 20 tries: {:?}", client.stats());

    // A fenced waiter: never handed a lease, it acquires with its own token.
    let fenced = DistributedLock::with_options(
        &client,
        "h",
        LockOptions::default()
            .fencing(true)
            .wait(Duration::from_secs(5)),
    );
    let mut last = 0;
    for _ in 1..=3 {
        let guard = plain.lock().expect("lock");
        let handoffs = client.stats().handoffs;
        let waiter = {
            let fenced = fenced.clone();
            std::thread::spawn(move || {
                let guard = fenced.lock().expect("lock");
                (guard.fencing_token(), guard.unlock())
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        drop(guard);
        let (token, unlocked) = waiter.join().expect("waiter");
        let token = token.expect("the fenced waiter has its own number");
        assert!(token > last, "{token} after {last}");
        last = token;
        assert_eq!(client.stats().handoffs, handoffs, "no handoff to it");
        unlocked.expect("unlock");
    }
}

/// Case 9: `validity()` (and `Debug`, and a reentrant `lock()`) never wait
/// on the network. On main the watchdog held the entry's mutex across a
/// renewal's round trip, and all of these waited for it.
#[test]
fn validity_never_waits_for_a_renewal_in_flight() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    let lock = DistributedLock::with_options(
        &client,
        "v",
        LockOptions::default()
            .ttl(Duration::from_secs(3))
            .watchdog(true),
    );
    let guard = lock.lock().expect("lock");
    let renewals = client.stats().renewal_round_trips;
    proxy.blackhole(true);
    // The next renewal goes out into the blackhole and waits there.
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    let mut nested = None;
    while started.elapsed() < Duration::from_millis(2500) {
        let call = Instant::now();
        let _ = guard.validity();
        let _ = format!("{guard:?}");
        if nested.is_none() {
            nested = Some(lock.lock().expect("re-enter"));
        }
        slowest = slowest.max(call.elapsed());
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        client.stats().renewal_round_trips > renewals,
        "a renewal was in flight: {:?}",
        client.stats()
    );
    assert!(
        slowest < Duration::from_millis(200),
        "a call waited {slowest:?}"
    );
    proxy.heal();
    drop(nested);
    drop(guard);
}

/// Case 15: a fencing counter that cannot be incremented (a hash, text,
/// `i64::MAX`, or a negative number, which would make tokens wrap). On main the key was set before `INCR` failed, so the caller
/// got an error and the lock stayed taken for the whole ttl; for a hash the
/// error blamed the lock key.
#[test]
fn a_corrupt_fence_counter_is_named_and_takes_nothing() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let client = server.lock_client();
    let mut con = server.conn();
    let counter = client.fence_key("f");
    let corrupt: [&dyn Fn(&mut redis::Connection); 5] = [
        &|con| con.hset::<_, _, _, ()>(&counter, "x", 1).expect("HSET"),
        &|con| con.set::<_, _, ()>(&counter, "abc").expect("SET"),
        &|con| con.set::<_, _, ()>(&counter, i64::MAX).expect("SET"),
        // The next token would be 2^53, past which Lua's numbers are not exact.
        &|con| {
            con.set::<_, _, ()>(&counter, (1i64 << 53) - 1)
                .expect("SET")
        },
        &|con| con.set::<_, _, ()>(&counter, -5).expect("SET"),
    ];
    for (case, corrupt) in corrupt.iter().enumerate() {
        let _: () = con.del(&counter).expect("DEL");
        corrupt(&mut con);
        let lock =
            DistributedLock::with_options(&client, "f", LockOptions::default().fencing(true));
        match lock.try_lock() {
            Err(Error::FenceCounter {
                key,
                counter: named,
                ..
            }) => {
                assert_eq!(key, "f");
                assert_eq!(named, counter, "case {case}");
            }
            other => panic!("case {case}: expected FenceCounter, got {other:?}"),
        }
        assert!(!exists(&server, "f"), "case {case}: the lock was not taken");
    }
    // Mended, it works again: the token is the server's clock in
    // microseconds when the counter is below it…
    let _: () = con.set(&counter, 41).expect("SET");
    let guard = DistributedLock::with_options(&client, "f", LockOptions::default().fencing(true))
        .lock()
        .expect("lock");
    let token = guard.fencing_token().expect("a token");
    assert!(support::clock_floored(token), "{token}");
    guard.unlock().expect("unlock");
    // …and the counter + 1 when the counter is ahead of the clock.
    let ahead: u64 = 8_000_000_000_000_000;
    let _: () = con.set(&counter, ahead).expect("SET");
    let guard = DistributedLock::with_options(&client, "f", LockOptions::default().fencing(true))
        .lock()
        .expect("lock");
    assert_eq!(guard.fencing_token(), Some(ahead + 1));
    guard.unlock().expect("unlock");
    assert_eq!(get(&server, "f"), None);
}

/// A reentrant acquisition whose holder is stuck keeps its own lease
/// only: other threads stay out, and `validity()` answers at once.
#[test]
fn reentrant_guards_answer_validity_without_the_network() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    let guard = ReentrantLock::new(&client, "rv").lock().expect("lock");
    proxy.blackhole(true);
    let started = Instant::now();
    assert!(!guard.validity().is_zero());
    assert!(started.elapsed() < Duration::from_millis(100));
    proxy.heal();
    drop(guard);
}

/// A lease found lost by the local clock only (every renewal's reply lost,
/// so the watchdog could not confirm it) may still be ours in Redis:
/// `unlock()` still sends the owner-checked release and reports Redis's
/// answer, instead of saying `Expired` and leaving the key held.
#[test]
fn a_lease_lost_by_the_local_clock_is_still_released() {
    let _serial = support::serial();
    let server = RedisServer::start();
    support::load_scripts(&server);
    let proxy = FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    let guard = DistributedLock::with_options(
        &client,
        "local",
        LockOptions::default()
            .ttl(Duration::from_millis(900))
            .watchdog(true),
    )
    .lock()
    .expect("lock");
    proxy.lose_reply(&support::sha(include_str!("../lua/extend.lua")), 10_000);
    let lost = guard.loss_signal();
    assert!(support::wait_until(Duration::from_secs(5), || lost.is_lost()));
    assert_eq!(lost.reason(), Some(redmutex::LossReason::Unreachable));
    proxy.heal();
    let ours = get(&server, "local").as_deref() == Some(guard.token());
    let result = guard.unlock();
    if ours {
        result.expect("the key was still ours: released");
    }
    assert!(!exists(&server, "local"), "nothing of ours is left");
}

/// Renewals are pipelined, and one key that now holds another type fails
/// only its own lease: the others in the batch go on being renewed.
#[test]
fn one_wrong_typed_key_fails_only_its_own_renewal() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let client = server.lock_client();
    let ttl = Duration::from_millis(600);
    let (a, b) = (
        support::watched_lock(&client, "ra", ttl),
        support::watched_lock(&client, "rb", ttl),
    );
    let mut con = server.conn();
    let _: () = con.del("rb").expect("DEL");
    let _: () = con.hset("rb", "someone", 1).expect("HSET");
    let lost = b.loss_signal();
    assert_eq!(
        lost.wait_timeout(Duration::from_secs(5)),
        Some(redmutex::LossReason::OwnedByOther)
    );
    let renewals = client.stats().renewals;
    assert!(support::wait_until(Duration::from_secs(5), || client
        .stats()
        .renewals
        > renewals + 2));
    assert!(
        !a.is_lost(),
        "the other lease of the batch is still renewed"
    );
    assert_eq!(get(&server, "ra").as_deref(), Some(a.token()));
    a.unlock().expect("unlock");
}

/// A key with a stray `}` on a single server: its releases still leave a
/// marker and still publish (with either release method).
#[test]
fn a_key_without_a_tag_still_gets_markers_and_messages() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let client = server.lock_client();
    for release in [redmutex::Release::Lua, redmutex::Release::Watch] {
        let lock =
            DistributedLock::with_options(&client, "a}b", LockOptions::default().release(release));
        let guard = lock.lock().expect("lock");
        let marker = format!("redmutex:released:a}}b:{}", support::secret(guard.token()));
        let published = server.command_calls("publish");
        guard.unlock().expect("unlock");
        assert!(exists(&server, &marker), "{release:?}: no marker");
        assert!(
            server.command_calls("publish") > published,
            "{release:?}: no release message"
        );
    }
}

/// Every lock type, as far as taking a key, extending what it holds and
/// letting it go: so each can be tried on every other's data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Type {
    Plain,
    Reentrant,
    Read,
    Write,
    Semaphore,
}

const TYPES: [Type; 5] = [
    Type::Plain,
    Type::Reentrant,
    Type::Read,
    Type::Write,
    Type::Semaphore,
];

impl Type {
    /// Readers and writers keep one layout: each other's data is theirs.
    fn same_data(self, other: Type) -> bool {
        self == other
            || matches!(
                (self, other),
                (Type::Read, Type::Write) | (Type::Write, Type::Read)
            )
    }
}

#[derive(Debug)]
enum Held {
    Plain(redmutex::LockGuard),
    Reentrant(redmutex::ReentrantGuard),
    Rw(redmutex::RwGuard),
    Permit(redmutex::Permit),
}

impl Held {
    fn extend(&mut self, ttl: Duration) -> Option<Result<(), Error>> {
        Some(match self {
            Held::Plain(guard) => guard.extend(ttl),
            Held::Reentrant(guard) => guard.extend(ttl),
            Held::Permit(permit) => permit.extend(ttl),
            Held::Rw(_) => return None,
        })
    }

    fn unlock(self) -> Result<(), Error> {
        match self {
            Held::Plain(guard) => guard.unlock().map(|_| ()),
            Held::Reentrant(guard) => guard.unlock().map(|_| ()),
            Held::Rw(guard) => guard.unlock().map(|_| ()),
            Held::Permit(permit) => permit.release(),
        }
    }
}

fn take(client: &LockClient, ty: Type, key: &str, ttl: Duration) -> Result<Option<Held>, Error> {
    let lease = redmutex::Options::default().ttl(ttl);
    Ok(match ty {
        Type::Plain => DistributedLock::with_options(client, key, LockOptions::default().ttl(ttl))
            .try_lock()?
            .map(Held::Plain),
        Type::Reentrant => ReentrantLock::with_options(client, key, lease)
            .try_lock()?
            .map(Held::Reentrant),
        Type::Read => {
            redmutex::RwLock::with_options(client, key, lease.with_extra(Default::default()))
                .try_read()?
                .map(Held::Rw)
        }
        Type::Write => {
            redmutex::RwLock::with_options(client, key, lease.with_extra(Default::default()))
                .try_write()?
                .map(Held::Rw)
        }
        Type::Semaphore => {
            redmutex::Semaphore::with_options(client, key, 3, lease.with_extra(Default::default()))
                .try_acquire()?
                .map(Held::Permit)
        }
    })
}

/// What a key holds (its content) and how long it has left.
fn snapshot(server: &RedisServer, key: &str) -> (Vec<u8>, i64) {
    let mut con = server.conn();
    let dump: Vec<u8> = redis::cmd("DUMP").arg(key).query(&mut con).expect("DUMP");
    let pttl: i64 = con.pttl(key).expect("PTTL");
    (dump, pttl)
}

/// Nothing changed: the same content, and no expiry moved (the holder's is
/// 60 s, what the other type asks for is 5 s).
fn unchanged(server: &RedisServer, key: &str, before: &(Vec<u8>, i64), what: &str) {
    let after = snapshot(server, key);
    assert_eq!(after.0, before.0, "{what}: the content changed");
    assert!(
        after.1 > 50_000 && after.1 <= before.1,
        "{what}: the expiry moved from {} to {} ms",
        before.1,
        after.1
    );
}

/// On main the read-write lock deleted a reentrant lock's owner and holds
/// and took the key, and a semaphore's limit (refusing every later caller
/// of the semaphore); the reentrant lock waited out a read-write lock as
/// "held". Every lock type's scripts now refuse another's data, changing
/// nothing, for every pair and every operation.
#[test]
fn lock_types_never_touch_each_others_state() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let long = Duration::from_secs(60);
    let short = Duration::from_secs(5);
    let mut n = 0;
    for holder in TYPES {
        for other in TYPES.into_iter().filter(|t| !holder.same_data(*t)) {
            n += 1;
            let key = format!("types:{n}");
            let what = format!("{other:?} on {holder:?}'s data");

            // Taking it.
            let held = take(&client, holder, &key, long)
                .expect("the holder")
                .expect("free");
            let before = snapshot(&server, &key);
            match take(&client, other, &key, short) {
                Err(Error::WrongType { .. }) => {}
                Ok(Some(_)) => panic!("{what}: taken"),
                other => panic!("{what}: {other:?} instead of WrongType"),
            }
            unchanged(&server, &key, &before, &what);
            held.unlock().expect("the holder lets go");

            // Extending and letting go of a hold whose key another type
            // took meanwhile.
            let mut stale = take(&client, other, &key, short)
                .expect("the other type")
                .expect("free");
            let _: () = server.conn().del(&key).expect("DEL");
            let held = take(&client, holder, &key, long)
                .expect("the holder")
                .expect("free");
            let before = snapshot(&server, &key);
            if let Some(extended) = stale.extend(short) {
                assert!(
                    matches!(extended, Err(Error::WrongType { .. })),
                    "{what}: extend gave {extended:?}"
                );
                unchanged(&server, &key, &before, &format!("{what}, extend"));
            }
            let released = stale.unlock();
            assert!(
                matches!(released, Err(Error::WrongType { .. })),
                "{what}: unlock gave {released:?}"
            );
            unchanged(&server, &key, &before, &format!("{what}, unlock"));
            held.unlock().expect("the holder lets go");
        }
    }
    assert_eq!(n, 18, "every pair of types with different data");
}

/// On main a nested reentrant hold with a shorter ttl (or its `extend`)
/// set the key's expiry with a plain PEXPIRE: the outer hold's lease was
/// cut to the inner one's, and another owner took the key while the
/// outer guard still claimed 29 s of validity.
#[test]
fn a_nested_reentrant_hold_never_shortens_the_lock() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let long = redmutex::Options::default().ttl(Duration::from_secs(30));
    let short = redmutex::Options::default().ttl(Duration::from_millis(300));
    let outer = ReentrantLock::with_options(&client, "nested", long)
        .lock()
        .expect("outer");
    let mut inner = ReentrantLock::with_options(&client, "nested", short)
        .lock()
        .expect("inner");
    assert_eq!(inner.depth(), 2);
    inner.extend(Duration::from_millis(300)).expect("extend");
    let pttl: i64 = server.conn().pttl("nested").expect("PTTL");
    assert!(pttl > 29_000, "the expiry moved to {pttl} ms");
    inner.unlock().expect("inner");
    std::thread::sleep(Duration::from_millis(600));
    let other = LockClient::open(&server.url()).expect("another client");
    let taken = std::thread::spawn(move || {
        ReentrantLock::new(&other, "nested")
            .try_lock()
            .map(|held| held.is_some())
    })
    .join()
    .expect("the other thread");
    assert!(matches!(taken, Ok(false)), "another owner got {taken:?}");
    assert!(outer.validity() > Duration::from_secs(28));
    assert!(outer.is_held().expect("asked"));
    outer.unlock().expect("outer");
}
