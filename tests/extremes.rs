//! Case 10: whatever durations and counts a caller passes, nothing panics:
//! every call gives a clear error or behaves correctly, within its bounds.
//! Once, a RedLock node timeout of `Duration::MAX`, an `RwLock` with a huge
//! `Backoff::max`, and a notify waiter whose holder's key had no expiry
//! with a huge backoff cap all panicked on overflow.

use redmutex_test_support as support;

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use redmutex::Lease;
use redmutex::{
    Backoff, DistributedLock, Error, LockClient, LockOptions, RedLock, ReentrantLock, Release,
    RwLock, WaitMode,
};
use support::RedisServer;

/// Durations at and around every edge the crate has.
fn duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        Just(Duration::ZERO),
        Just(Duration::from_nanos(1)),
        Just(Duration::from_micros(999)),
        Just(Duration::from_millis(1)),
        Just(Duration::from_secs(10 * 365 * 24 * 3600)),
        Just(Duration::from_secs(10 * 365 * 24 * 3600) + Duration::from_millis(1)),
        Just(Duration::from_secs(u64::MAX / 2)),
        Just(Duration::MAX),
        (0u64..5_000).prop_map(Duration::from_millis),
    ]
}

#[derive(Debug, Clone)]
struct Extremes {
    ttl: Duration,
    wait: Duration,
    initial: Duration,
    max: Duration,
    factor: u32,
    handoffs: u32,
    handoff_time: Duration,
    watchdog: bool,
    max_hold: Option<Duration>,
    fencing: bool,
    min_replicas: Option<(u32, Duration)>,
    spin: bool,
    watch_release: bool,
    node_timeout: Duration,
    extend: Duration,
    timeout: Duration,
}

fn extremes() -> impl Strategy<Value = Extremes> {
    (
        (duration(), duration(), duration(), duration(), any::<u32>()),
        (
            any::<u32>(),
            duration(),
            any::<bool>(),
            proptest::option::of(duration()),
        ),
        (
            any::<bool>(),
            proptest::option::of((0u32..3, duration())),
            any::<bool>(),
            any::<bool>(),
        ),
        (duration(), duration(), duration()),
    )
        .prop_map(
            |(
                (ttl, wait, initial, max, factor),
                (handoffs, handoff_time, watchdog, max_hold),
                (fencing, min_replicas, spin, watch_release),
                (node_timeout, extend, timeout),
            )| Extremes {
                ttl,
                wait,
                initial,
                max,
                factor,
                handoffs,
                handoff_time,
                watchdog,
                max_hold,
                fencing,
                min_replicas,
                spin,
                watch_release,
                node_timeout,
                extend,
                timeout,
            },
        )
}

impl Extremes {
    fn lease<X: Default>(&self) -> redmutex::Options<X> {
        redmutex::Options::default()
            .ttl(self.ttl)
            .wait(self.wait)
            .backoff(Backoff::new(self.initial, self.max, self.factor))
    }

    fn wait_mode(&self) -> WaitMode {
        if self.spin {
            WaitMode::Spin
        } else {
            WaitMode::Notify
        }
    }

    fn options(&self) -> LockOptions {
        let mut options = LockOptions::default()
            .ttl(self.ttl)
            .wait(self.wait)
            .backoff(Backoff::new(self.initial, self.max, self.factor))
            .handoff_budget(redmutex::HandoffBudget::new(
                self.handoffs,
                self.handoff_time,
            ))
            .watchdog(self.watchdog)
            .max_hold(self.max_hold)
            .fencing(self.fencing)
            .wait_mode(if self.spin {
                WaitMode::Spin
            } else {
                WaitMode::Notify
            })
            .release(if self.watch_release {
                Release::Watch
            } else {
                Release::Lua
            });
        if let Some((n, timeout)) = self.min_replicas {
            options = options.min_replicas(n, timeout);
        }
        options
    }
}

/// An error a caller can act on for bad input, or nothing.
fn clear<T: std::fmt::Debug>(what: &str, result: Result<T, Error>) -> Option<T> {
    match result {
        Ok(value) => Some(value),
        Err(Error::InvalidArgument(_)) => None,
        // No replica answers a WAIT here.
        Err(Error::NotReplicated { .. }) => None,
        // A 1 ms lease is gone before it can be extended or released, and
        // a wait shorter than a millisecond can end before a lease does.
        Err(Error::NotHeld { .. } | Error::Timeout { .. }) => None,
        Err(other) => panic!("{what}: {other}"),
    }
}

/// A short wait for the cases where the key is held: the call must still
/// return by its deadline.
const SHORT: Duration = Duration::from_millis(15);

fn exercise(server: &RedisServer, client: &LockClient, case: u64, x: &Extremes) {
    let key = format!("x{case}");
    let lock = DistributedLock::with_options(client, key.clone(), x.options());
    // Free key: every way of taking it returns at once, whatever the wait.
    if let Some(Some(mut guard)) = clear("try_lock", lock.try_lock()) {
        assert!(guard.validity() <= x.ttl);
        // Held by us on this thread: a nested guard, no wait. (A lease with
        // no validity left is not re-entered; then the wait is kept short,
        // or a 10-year backoff step would be honoured.)
        let nested_wait = if guard.validity() > Duration::from_millis(200) {
            x.wait
        } else {
            SHORT
        };
        drop(clear("nested", lock.try_lock_for(nested_wait)));
        let _ = clear("extend", guard.extend(x.extend));
        let _ = guard.loss_signal().wait_timeout(Duration::from_millis(1));
        // Held: another thread waits at most SHORT, with these options.
        let other = {
            let lock = lock.clone();
            std::thread::spawn(move || clear("held", lock.try_lock_for(SHORT)).map(|g| g.is_some()))
        };
        let took = other.join().expect("no panic");
        // A lease is exclusive while it lasts: both valid at once is a bug.
        assert!(
            took != Some(true) || guard.validity().is_zero(),
            "another thread acquired while the guard claims validity"
        );
        let _ = guard.unlock();
    }
    // Free again (a 1 ms lease may linger a moment): the extreme wait and
    // backoff meet a free key, and lock() returns at once.
    assert!(support::wait_until(Duration::from_secs(5), || {
        !support::exists(server, &key)
    }));
    if let Some(guard) = clear("lock", lock.lock()) {
        drop(guard);
    }
    // A holder whose key has no expiry: the waiter's pause must not overflow.
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("someone")
        .query(&mut server.conn())
        .expect("SET");
    assert!(matches!(
        lock.try_lock_for(SHORT),
        Ok(None) | Err(Error::InvalidArgument(_))
    ));
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query(&mut server.conn())
        .expect("DEL");

    let rw = RwLock::with_options(
        client,
        format!("rw{case}"),
        x.lease().wait_mode(x.wait_mode()),
    );
    if let Some(Some(reader)) = clear("try_read", rw.try_read()) {
        let writer = clear("try_write_for", rw.try_write_for(SHORT)).flatten();
        assert!(
            writer.is_none() || reader.validity().is_zero(),
            "a writer got in while the reader claims validity"
        );
        drop(reader);
    }
    let reentrant = ReentrantLock::with_options(client, format!("re{case}"), x.lease());
    if let Some(Some(guard)) = clear("reentrant", reentrant.try_lock_for(SHORT)) {
        drop(guard);
    }
    let redlock = RedLock::with_options(
        vec![client.clone()],
        format!("rl{case}"),
        x.lease().node_timeout(x.node_timeout),
    )
    .expect("one node");
    if let Some(Some(guard)) = clear("redlock", redlock.try_lock()) {
        drop(guard);
    }
    let _ = clear(
        "builder().timeout()",
        LockClient::builder()
            .url(server.url())
            .timeout(x.timeout)
            .build(),
    );
}

#[test]
fn extreme_options_never_panic() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let mut runner = TestRunner::new(Config {
        cases: 96,
        failure_persistence: None,
        ..Config::default()
    });
    let case = std::sync::atomic::AtomicU64::new(0);
    let outcome = runner.run(&extremes(), |x| {
        let case = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        exercise(&server, &client, case, &x);
        Ok(())
    });
    if let Err(failure) = outcome {
        panic!("{failure}");
    }
}
