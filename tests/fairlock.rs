//! The fair lock: grants in the order waiters first asked Redis, across
//! clients; a dead waiter costs the queue at most its entry's ttl; only the
//! head is woken; lost replies recognised.

use redmutex_test_support as support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::Commands;
use redmutex::{DistributedLock, Error, FairLock, FairLockOptions, Lease, LockClient, LossReason};
use support::{FaultProxy, RedisServer, sha, wait_until};

fn options() -> FairLockOptions {
    FairLockOptions::default()
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_secs(20))
}

fn queue_len(server: &RedisServer, key: &str) -> u64 {
    server
        .conn()
        .zcard(format!("{{{key}}}:fairq"))
        .expect("ZCARD")
}

fn value(server: &RedisServer, key: &str) -> Option<String> {
    server.conn().get(key).expect("GET")
}

#[test]
fn waiters_are_served_in_the_order_they_asked() {
    let server = RedisServer::start();
    let holder = FairLock::with_options(&server.lock_client(), "turns", options())
        .lock()
        .expect("first");
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..5u64 {
        // Each on its own client (a process of its own, to Redis), and
        // queued before the next one starts.
        let client = server.lock_client();
        let order = order.clone();
        waiters.push(std::thread::spawn(move || -> Result<Option<u64>, Error> {
            let guard = FairLock::with_options(&client, "turns", options()).lock()?;
            order
                .lock()
                .map_err(|_| Error::InvalidArgument("poisoned".into()))?
                .push(i);
            let ticket = guard.ticket();
            guard.unlock()?;
            Ok(ticket)
        }));
        assert!(wait_until(Duration::from_secs(5), || {
            queue_len(&server, "turns") == i + 1
        }));
    }
    holder.unlock().expect("unlock");
    let mut tickets = Vec::new();
    for waiter in waiters {
        tickets.push(waiter.join().expect("waiter").expect("served"));
    }
    assert_eq!(*order.lock().expect("order"), [0, 1, 2, 3, 4]);
    assert!(tickets.iter().all(Option::is_some), "each one queued");
    assert!(tickets.windows(2).all(|w| w[0] < w[1]), "{tickets:?}");
    assert_eq!(queue_len(&server, "turns"), 0, "the queue is gone");
}

#[test]
fn nobody_takes_a_free_lock_while_others_wait_before_it() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = FairLock::with_options(&client, "door", options());
    // A waiter's place, as one leaves it (it then died: nobody renews it).
    let now: (u64, u64) = redis::cmd("TIME").query(&mut server.conn()).expect("TIME");
    let now_ms = now.0 * 1000 + now.1 / 1000;
    let _: () = server
        .conn()
        .zadd("{door}:fairq", "dead-waiter|h|1|p|0|", 1)
        .expect("ZADD");
    let _: () = server
        .conn()
        .zadd("{door}:fairexp", "dead-waiter|h|1|p|0|", now_ms + 600)
        .expect("ZADD");
    assert!(
        lock.try_lock().expect("try").is_none(),
        "a try does not jump the queue"
    );
    // A queued waiter gets it once the dead place lapses: at most its
    // entry's ttl after the waiter died.
    let started = Instant::now();
    let guard = lock
        .try_lock_for(Duration::from_secs(10))
        .expect("try")
        .expect("after the dead waiter's place lapsed");
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(300), "{waited:?}");
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    assert_eq!(value(&server, "door").as_deref(), Some(guard.token()));
    drop(guard);
    assert_eq!(queue_len(&server, "door"), 0);
}

#[test]
fn a_waiter_that_gives_up_leaves_the_queue() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = FairLock::with_options(&client, "gate", options());
    let held = lock.lock().expect("held");
    let other = FairLock::with_options(&server.lock_client(), "gate", options());
    assert!(
        other
            .try_lock_for(Duration::from_millis(200))
            .expect("try")
            .is_none()
    );
    assert_eq!(queue_len(&server, "gate"), 0, "it left its place");
    assert!(matches!(
        FairLock::with_options(
            &server.lock_client(),
            "gate",
            options().wait(Duration::ZERO)
        )
        .lock(),
        Err(Error::Timeout { .. })
    ));
    held.unlock().expect("unlock");
    let bad = FairLock::with_options(
        &client,
        "gate",
        options().entry_ttl(Duration::from_millis(10)),
    );
    assert!(matches!(bad.try_lock(), Err(Error::InvalidArgument(_))));
}

#[test]
fn a_release_wakes_the_head_alone() {
    let server = RedisServer::start();
    let holder = FairLock::with_options(&server.lock_client(), "bell", options())
        .lock()
        .expect("held");
    let mut listener = redis::Client::open(server.url())
        .expect("client")
        .get_connection()
        .expect("connection");
    listener
        .set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    let mut pubsub = listener.as_pubsub();
    pubsub
        .psubscribe("redmutex:released:*")
        .expect("PSUBSCRIBE");
    let mut waiters = Vec::new();
    for i in 0..3u64 {
        let client = server.lock_client();
        waiters.push(std::thread::spawn(move || {
            let guard = FairLock::with_options(&client, "bell", options()).lock()?;
            // Held until the test has read the messages.
            std::thread::sleep(Duration::from_millis(100));
            guard.unlock()
        }));
        assert!(wait_until(Duration::from_secs(5), || {
            queue_len(&server, "bell") == i + 1
        }));
    }
    let queue: Vec<String> = server.conn().zrange("{bell}:fairq", 0, -1).expect("ZRANGE");
    let secrets: Vec<String> = queue
        .iter()
        .map(|t| t.split('|').next().unwrap_or_default().to_owned())
        .collect();
    holder.unlock().expect("unlock");
    // Every release tells one waiter, the head then, on its own channel;
    // the last release, with nobody waiting, tells nobody.
    let mut told = Vec::new();
    while told.len() < 4 {
        let Ok(message) = pubsub.get_message() else {
            break;
        };
        told.push(message.get_channel_name().to_owned());
    }
    for waiter in waiters {
        waiter.join().expect("waiter").expect("served");
    }
    assert_eq!(told.len(), 3, "{told:?}");
    for (channel, secret) in told.iter().zip(&secrets) {
        assert!(channel.ends_with(&format!(":w:{secret}")), "{channel}");
    }
}

#[test]
fn the_guard_keeps_the_lease_contract() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = FairLock::with_options(
        &client,
        "fenced",
        options()
            .fencing(true)
            .ttl(Duration::from_millis(300))
            .watchdog(true),
    );
    let guard = lock.lock().expect("lock");
    let fence = guard.fencing_token().expect("fenced");
    let started = Instant::now();
    assert!(wait_until(Duration::from_secs(5), || {
        started.elapsed() > Duration::from_millis(1200)
    }));
    assert!(guard.is_held().expect("renewed past its ttl"));
    assert!(guard.validity() > Duration::ZERO);
    // A plain lock on the same key is excluded, and fences after it.
    let plain = DistributedLock::with_options(
        &client,
        "fenced",
        redmutex::LockOptions::default().fencing(true),
    );
    assert!(plain.try_lock().expect("try").is_none());
    let signal = guard.loss_signal();
    let _: () = server.conn().set("fenced", "another").expect("SET");
    assert_eq!(
        signal.wait_timeout(Duration::from_secs(5)),
        Some(LossReason::OwnedByOther)
    );
    assert!(matches!(guard.unlock(), Err(Error::NotHeld { .. })));
    let _: () = server.conn().del("fenced").expect("DEL");
    let later = plain.lock().expect("plain");
    assert!(later.fencing_token().expect("fenced") > fence);
}

#[test]
fn lost_replies_are_recognised() {
    let server = RedisServer::start();
    support::load_scripts(&server);
    let proxy = FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    let lock = FairLock::with_options(&client, "lossy", options());
    proxy.lose_reply(&sha(include_str!("../lua/fair_acquire.lua")), 1);
    let guard = lock.lock().expect("the resend finds its own token");
    assert_eq!(proxy.lost_replies(), 1);
    assert_eq!(value(&server, "lossy").as_deref(), Some(guard.token()));
    proxy.lose_reply(&sha(include_str!("../lua/fair_release.lua")), 1);
    guard.unlock().expect("the resend answers from the marker");
    assert_eq!(proxy.lost_replies(), 2);
    assert_eq!(value(&server, "lossy"), None);
    // A waiter that gives up leaves its place even when the reply to its
    // leaving is lost (sent again: a place is removed once).
    let held = FairLock::with_options(&server.lock_client(), "lossy", options())
        .lock()
        .expect("held elsewhere");
    proxy.lose_reply(&sha(include_str!("../lua/fair_release.lua")), 1);
    assert!(
        lock.try_lock_for(Duration::from_millis(200))
            .expect("try")
            .is_none()
    );
    assert_eq!(proxy.lost_replies(), 3);
    assert_eq!(queue_len(&server, "lossy"), 0, "it left its place");
    held.unlock().expect("unlock");
}

/// The queue beside a fair lock is no lock of its own: `list` shows the
/// key, held as a plain lock, and not its queue; `status` names the holder.
#[test]
fn a_listing_shows_the_lock_and_not_its_queue() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = FairLock::with_options(&client, "listed", options());
    let held = lock.lock().expect("lock");
    let waiter = {
        let lock = FairLock::with_options(&server.lock_client(), "listed", options());
        std::thread::spawn(move || lock.lock().map(drop))
    };
    assert!(wait_until(Duration::from_secs(5), || queue_len(
        &server, "listed"
    ) == 1));
    let listing = client.list("*", Duration::from_secs(10)).expect("list");
    let keys: Vec<&str> = listing.held.iter().map(|h| h.key.as_str()).collect();
    assert_eq!(keys, ["listed"], "{keys:?}");
    let status = lock.status().expect("status").expect("held");
    assert_eq!(status.holders, 1);
    held.unlock().expect("unlock");
    waiter.join().expect("waiter").expect("served");
}

/// A waiter whose wait failed (every reply lost) does not take the lock
/// again with the token the client's cleanup is releasing: the lock it
/// takes next stays its own through the cleanup's whole window.
#[test]
fn a_waiter_starts_afresh_after_a_failed_wait() {
    let server = RedisServer::start();
    support::load_scripts(&server);
    let proxy = FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    let lock = FairLock::with_options(&client, "fw", options().wait(Duration::from_secs(5)));
    let mut waiter = lock.waiter();
    proxy.lose_reply(&sha(include_str!("../lua/fair_acquire.lua")), 3);
    let failed = waiter.try_lock_for(Duration::from_millis(500));
    assert!(failed.is_err(), "{failed:?}");
    let guard = waiter
        .try_lock_for(Duration::from_secs(2))
        .expect("second wait")
        .expect("free");
    // The cleanup of the failed wait's token runs for three timeouts (at
    // least 1 s) after it: the key must stay this guard's throughout.
    let until = Instant::now() + Duration::from_millis(2500);
    while Instant::now() < until {
        assert_eq!(value(&server, "fw").as_deref(), Some(guard.token()));
        std::thread::sleep(Duration::from_millis(50));
    }
    guard.unlock().expect("unlock");
}

/// A waiter's place is one across its waits: the same ticket, renewed by
/// every wait, a wait of zero included.
#[test]
fn a_waiter_keeps_one_place_across_its_waits() {
    let server = RedisServer::start();
    let held = FairLock::with_options(&server.lock_client(), "slices", options())
        .lock()
        .expect("lock");
    let lock = FairLock::with_options(
        &server.lock_client(),
        "slices",
        options().entry_ttl(Duration::from_millis(600)),
    );
    let mut waiter = lock.waiter();
    let score = |server: &RedisServer| -> Option<f64> {
        let queue: Vec<(String, f64)> = server
            .conn()
            .zrange_withscores("{slices}:fairq", 0, -1)
            .expect("ZRANGE");
        assert!(queue.len() <= 1, "{queue:?}");
        queue.first().map(|(_, ticket)| *ticket)
    };
    assert!(
        waiter
            .try_lock_for(Duration::from_millis(100))
            .expect("wait")
            .is_none()
    );
    let ticket = score(&server).expect("queued");
    // Longer than its entry ttl in all, in waits of zero.
    let until = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < until {
        assert!(waiter.try_lock_for(Duration::ZERO).expect("wait").is_none());
        assert_eq!(score(&server), Some(ticket), "the same place");
        std::thread::sleep(Duration::from_millis(100));
    }
    held.unlock().expect("unlock");
    let guard = waiter
        .try_lock_for(Duration::from_secs(5))
        .expect("wait")
        .expect("its turn");
    assert_eq!(
        guard.ticket().map(|t| t as f64),
        Some(ticket),
        "its one place"
    );
    drop(waiter);
    guard.unlock().expect("unlock");
}
