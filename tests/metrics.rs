//! `LockClient::stats()` per lock type (acquisitions, timeouts, handoffs,
//! losses, errors, wait and hold distributions) and, with the `metrics`
//! feature, the same events through the `metrics` facade.

use redmutex_test_support as support;

use std::time::Duration;

use redmutex::Lease;
use redmutex::{DistributedLock, LockKind, LockOptions, ReentrantLock, RwLock, Semaphore};
use support::RedisServer;

fn options() -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_millis(200))
        .key_class("jobs")
}

#[test]
fn stats_count_each_lock_type_apart_with_wait_and_hold_times() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::with_options(&client, "m", options());

    let guard = lock.lock().expect("lock");
    std::thread::sleep(Duration::from_millis(20));
    // Held by this guard: a second try from another thread finds it held.
    let busy = std::thread::scope(|s| {
        s.spawn(|| lock.try_lock().expect("try").is_none())
            .join()
            .expect("thread")
    });
    assert!(busy);
    guard.unlock().expect("unlock");

    // A lease gone behind the holder's back: one loss, when let go.
    let guard = lock.lock().expect("lock again");
    let _: () = redis::cmd("DEL")
        .arg("m")
        .query(&mut server.conn())
        .expect("DEL");
    assert!(guard.unlock().expect_err("gone").is_not_held());

    // Bad input: an error of its kind, nothing acquired.
    let empty = DistributedLock::with_options(&client, "", options());
    assert!(empty.try_lock().is_err());

    let stats = client.stats();
    let mutex = stats.kind(LockKind::Mutex);
    assert_eq!(mutex.acquired, 2, "{mutex:?}");
    assert_eq!(mutex.timeouts, 1, "the try that found it held");
    assert_eq!(mutex.losses, 1, "the deleted lease");
    assert_eq!(mutex.errors("invalid_argument"), 1);
    assert_eq!(mutex.errors_total(), 1, "a loss is not also an error");
    assert_eq!(mutex.wait.count, 2);
    assert_eq!(mutex.hold.count, 2);
    assert!(
        mutex.hold.max >= Duration::from_millis(20),
        "the first hold lasted 20 ms: {:?}",
        mutex.hold
    );
    assert!(mutex.hold.p50 <= mutex.hold.max);

    // Other lock types count apart.
    let lease = options().with_extra(Default::default());
    let reentrant = ReentrantLock::with_options(&client, "r", lease);
    drop(reentrant.lock().expect("reentrant"));
    let rw = RwLock::with_options(&client, "rw", lease.with_extra(Default::default()));
    drop(rw.read().expect("read"));
    drop(rw.write().expect("write"));
    let sem = Semaphore::with_options(
        &client,
        "s",
        2,
        lease.with_extra(redmutex::SemaphoreExtra::default()),
    );
    let permits = (sem.acquire().expect("one"), sem.acquire().expect("two"));
    assert!(sem.try_acquire().expect("try").is_none());
    drop(permits);

    let stats = client.stats();
    assert_eq!(
        stats.kind(LockKind::Mutex),
        mutex,
        "unchanged by the others"
    );
    for (kind, acquired, timeouts) in [
        (LockKind::Reentrant, 1, 0),
        (LockKind::Read, 1, 0),
        (LockKind::Write, 1, 0),
        (LockKind::Semaphore, 2, 1),
        (LockKind::RedLock, 0, 0),
    ] {
        let of = stats.kind(kind);
        assert_eq!(
            (of.acquired, of.timeouts, of.hold.count, of.losses),
            (acquired, timeouts, acquired, 0),
            "{kind:?}: {of:?}"
        );
    }
}

#[test]
fn a_handoff_and_a_blocking_timeout_are_counted() {
    let server = RedisServer::start();
    let client = server.lock_client();
    // A budget the 50 ms holds below cannot run out of.
    let options =
        options().handoff_budget(redmutex::HandoffBudget::new(32, Duration::from_secs(10)));
    let lock = DistributedLock::with_options(&client, "h", options);
    // A lock() that times out counts as a timeout, not an error.
    let guard = lock.lock().expect("lock");
    let timed_out = std::thread::scope(|s| {
        s.spawn(|| lock.lock().expect_err("held").is_timeout())
            .join()
            .expect("thread")
    });
    assert!(timed_out);
    // Whether the waiter is queued when the holder lets go cannot be seen
    // from outside: try until a handoff happened (almost always at once).
    let waiting = DistributedLock::with_options(&client, "h", options.wait(Duration::from_secs(5)));
    drop(guard);
    let mut handed = false;
    for _ in 0..20 {
        let guard = lock.lock().expect("lock");
        let waiter = std::thread::spawn({
            let waiting = waiting.clone();
            move || drop(waiting.lock().expect("waiter"))
        });
        std::thread::sleep(Duration::from_millis(50));
        drop(guard);
        waiter.join().expect("waiter");
        if client.stats().kind(LockKind::Mutex).handed_over > 0 {
            handed = true;
            break;
        }
    }
    assert!(handed, "{:?}", client.stats());
    let mutex = client.stats().kind(LockKind::Mutex);
    assert_eq!(mutex.timeouts, 1);
    assert_eq!(mutex.errors_total(), 0);
    assert_eq!(mutex.handed_over, client.stats().handoffs);
}

#[test]
fn the_watchdog_counts_renewals_per_lock_type() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::with_options(
        &client,
        "w",
        options().ttl(Duration::from_millis(300)).watchdog(true),
    );
    let guard = lock.lock().expect("lock");
    assert!(support::wait_until(Duration::from_secs(5), || {
        client.stats().kind(LockKind::Mutex).renewals >= 2
    }));
    guard.unlock().expect("unlock");
    let stats = client.stats();
    assert_eq!(stats.kind(LockKind::Mutex).renewal_failures, 0);
    assert_eq!(stats.kind(LockKind::Semaphore).renewals, 0);
    assert!(stats.renewals >= stats.kind(LockKind::Mutex).renewals);
}

#[cfg(feature = "metrics")]
mod facade {
    use super::*;
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    /// The metrics this thread recorded: (name, sorted labels) → value.
    type Seen = Vec<(String, Vec<(String, String)>, DebugValue)>;

    fn record(f: impl FnOnce()) -> Seen {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, f);
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| {
                let key = key.key();
                let mut labels: Vec<(String, String)> = key
                    .labels()
                    .map(|l| (l.key().to_owned(), l.value().to_owned()))
                    .collect();
                labels.sort();
                (key.name().to_owned(), labels, value)
            })
            .collect()
    }

    fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut v: Vec<_> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        v.sort();
        v
    }

    fn find<'a>(seen: &'a Seen, name: &str, want: &[(&str, &str)]) -> Option<&'a DebugValue> {
        let want = labels(want);
        seen.iter()
            .find(|(n, l, _)| n == name && *l == want)
            .map(|(_, _, v)| v)
    }

    #[test]
    fn the_facade_gets_the_same_events_with_kind_and_key_class_labels() {
        let server = RedisServer::start();
        let client = server.lock_client();
        let lock = DistributedLock::with_options(&client, "f", options());
        let seen = record(|| {
            lock.lock().expect("lock").unlock().expect("unlock");
            drop(lock.lock().expect("lock"));
            let _ = DistributedLock::with_options(&client, "", options()).try_lock();
        });
        let acquired = [
            ("kind", "mutex"),
            ("key_class", "jobs"),
            ("outcome", "acquired"),
        ];
        assert!(
            matches!(
                find(&seen, "redmutex_acquisitions_total", &acquired),
                Some(DebugValue::Counter(2))
            ),
            "{seen:?}"
        );
        assert!(matches!(
            find(&seen, "redmutex_wait_seconds", &acquired),
            Some(DebugValue::Histogram(v)) if v.len() == 2
        ));
        assert!(matches!(
            find(&seen, "redmutex_hold_seconds", &[("kind", "mutex"), ("key_class", "jobs")]),
            Some(DebugValue::Histogram(v)) if v.len() == 2
        ));
        assert!(matches!(
            find(
                &seen,
                "redmutex_errors_total",
                &[
                    ("kind", "mutex"),
                    ("key_class", "jobs"),
                    ("error", "invalid_argument")
                ]
            ),
            Some(DebugValue::Counter(1))
        ));
        assert!(
            seen.iter()
                .all(|(_, l, _)| l.iter().all(|(k, _)| k != "key")),
            "never a per-key label"
        );
    }
}
