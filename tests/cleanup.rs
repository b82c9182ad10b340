//! After all guards and clients are dropped nothing of the crate is left:
//! no subscribed channel, no busy pooled connection, no thread. (A test
//! binary of its own, so no other test's threads are counted.)

use redmutex_test_support as support;

use std::time::Duration;

use redmutex::{DistributedLock, LockOptions};
use support::{RedisServer, wait_until};

fn channels(server: &RedisServer) -> Vec<String> {
    redis::cmd("PUBSUB")
        .arg("CHANNELS")
        .arg("redmutex:*")
        .query(&mut server.conn())
        .expect("PUBSUB CHANNELS")
}

/// Threads of this process named like the crate's subscriber thread.
fn subscriber_threads() -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0; // not Linux: nothing to count
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .filter(|name| name.trim() == "redmutex-sub")
        .count()
}

#[test]
fn nothing_is_left_after_guards_and_clients_are_dropped() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let options = LockOptions::default().wait(Duration::from_secs(10));
    // Contended keys, so waiters queue and subscribe.
    let holders: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|key| DistributedLock::new(&client, *key).lock().expect("lock"))
        .collect();
    let waiters: Vec<_> = ["a", "b", "c", "a", "b"]
        .iter()
        .map(|key| {
            let lock = DistributedLock::with_options(&client, *key, options);
            std::thread::spawn(move || lock.lock().map(|g| g.depth()))
        })
        .collect();
    // Waiters of the holders' own client wait for a handoff; the other
    // client's waiters subscribe to the release channels of "a" and "c".
    let other = server.lock_client();
    let remote: Vec<_> = ["a", "c"]
        .iter()
        .map(|key| {
            let lock = DistributedLock::with_options(&other, *key, options);
            std::thread::spawn(move || lock.lock().map(|g| g.depth()))
        })
        .collect();
    assert!(wait_until(Duration::from_secs(10), || channels(&server)
        .len()
        == 2));
    assert_eq!(
        subscriber_threads(),
        1,
        "one subscriber thread per subscribing client"
    );
    drop(holders);
    for waiter in waiters.into_iter().chain(remote) {
        assert_eq!(waiter.join().expect("waiter").expect("acquired"), 1);
    }
    assert!(
        wait_until(Duration::from_secs(10), || channels(&server).is_empty()),
        "channels left subscribed: {:?}",
        channels(&server)
    );
    for pool in [client.pool(), other.pool()] {
        let pool = pool.expect("single-node clients have a pool");
        let state = pool.state();
        assert_eq!(
            state.idle_connections, state.connections,
            "a connection is still out"
        );
    }
    drop(client);
    drop(other);
    assert!(
        wait_until(Duration::from_secs(10), || subscriber_threads() == 0),
        "{} subscriber threads still running",
        subscriber_threads()
    );
}
