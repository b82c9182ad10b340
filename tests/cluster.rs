//! The lock on Redis Cluster: 3 primaries (and replicas where a test needs
//! them) made by `redis-cli --cluster create` on free loopback ports.

use redmutex_test_support as support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::{Commands, ConnectionLike};
use redmutex::Lease;
use redmutex::{
    Deployment, DistributedLock, Error, LockClient, LockOptions, ReentrantLock, Release, RwLock,
    Semaphore,
};
use support::{RedisCluster, wait_until};

fn options() -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_secs(60))
}

/// Non-atomic read-modify-write of `counter` (same slot as its lock) over
/// two round trips: an overlap of two holders loses an increment.
fn increment(con: &mut dyn ConnectionLike, counter: &str) {
    let value: Option<i64> = redis::cmd("GET").arg(counter).query(con).expect("GET");
    redis::cmd("SET")
        .arg(counter)
        .arg(value.unwrap_or(0) + 1)
        .exec(con)
        .expect("SET");
}

#[test]
fn mutual_exclusion_on_keys_of_every_primary() {
    let cluster = RedisCluster::start(3, 0);
    let keys = cluster.key_per_primary("mx");
    let distinct: std::collections::HashSet<u16> =
        keys.iter().map(|k| cluster.primary_for(k).port()).collect();
    assert_eq!(distinct.len(), 3, "one key per primary: {keys:?}");
    let clients = [cluster.lock_client(), cluster.lock_client()];
    assert_eq!(clients[0].deployment(), Deployment::Cluster);
    let threads = 8;
    let rounds = 30;
    let intervals = Arc::new(Mutex::new(Vec::new()));
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let client = clients[i % 2].clone();
            let keys = keys.clone();
            let intervals = intervals.clone();
            std::thread::spawn(move || {
                let mut con = client.connection().expect("a cluster connection");
                for round in 0..rounds {
                    let key = &keys[(i + round) % keys.len()];
                    let lock = DistributedLock::with_options(&client, key.clone(), options());
                    let guard = lock.lock().expect("lock");
                    let start = Instant::now();
                    increment(&mut con, &format!("{{{key}}}:counter"));
                    intervals
                        .lock()
                        .expect("intervals")
                        .push((key.clone(), start, Instant::now()));
                    guard.unlock().expect("unlock");
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().expect("worker");
    }
    let mut con = clients[0].connection().expect("connection");
    let mut total = 0;
    for key in &keys {
        let count: i64 = redis::cmd("GET")
            .arg(format!("{{{key}}}:counter"))
            .query(&mut con)
            .expect("GET counter");
        total += count;
        let exists: bool = redis::cmd("EXISTS")
            .arg(key)
            .query(&mut con)
            .expect("EXISTS");
        assert!(!exists, "{key} was released");
    }
    assert_eq!(total, (threads * rounds) as i64, "no increment lost");
    let mut intervals = intervals.lock().expect("intervals").clone();
    intervals.sort();
    for pair in intervals.windows(2) {
        if pair[0].0 == pair[1].0 {
            assert!(pair[0].2 <= pair[1].1, "holds of {} overlap", pair[0].0);
        }
    }
}

#[test]
fn auxiliary_keys_land_in_the_key_slot() {
    let cluster = RedisCluster::start(3, 0);
    let names = cluster.lock_client();
    for key in [
        "plain",
        "jobs:nightly",
        "user:{42}:lock",
        "{a}{b}",
        "{a}}b",
        "é{ü}",
    ] {
        let slot = cluster.slot(key);
        assert_eq!(
            cluster.slot(&names.release_channel(key)),
            slot,
            "channel of {key}"
        );
        assert_eq!(cluster.slot(&names.fence_key(key)), slot, "fence of {key}");
    }
    // Fenced acquisitions run the two-key script: a CROSSSLOT error would
    // fail them.
    let client = cluster.lock_client();
    for key in cluster.key_per_primary("fenced") {
        let lock = DistributedLock::with_options(&client, key.clone(), options().fencing(true));
        let first = lock.lock().expect("fenced lock");
        let token = first.fencing_token().expect("a fencing token");
        first.unlock().expect("unlock");
        let second = lock.lock().expect("fenced lock again");
        let later = second.fencing_token().expect("token");
        assert!(later > token);
        second.unlock().expect("unlock");
        let primary = cluster.primary_for(&key);
        let fence: u64 = redis::cmd("GET")
            .arg(client.fence_key(&key))
            .query(&mut primary.conn())
            .expect("the counter is on the key's primary");
        assert_eq!(fence, later, "the counter holds the last token");
    }
}

#[test]
fn unfenceable_keys_and_the_watch_release_are_refused_before_anything_is_sent() {
    let cluster = RedisCluster::start(3, 0);
    let client = cluster.lock_client();
    let before = cluster.total_keys();

    // A key with '}' and no valid tag: no fencing counter or release
    // marker can share its slot, so every lock type refuses it.
    for fencing in [true, false] {
        let stray = DistributedLock::with_options(&client, "a}b", options().fencing(fencing));
        match stray.try_lock() {
            Err(Error::InvalidArgument(message)) => assert!(message.contains("tag"), "{message}"),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        assert!(matches!(
            stray.force_release(),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            stray.release_token("t"),
            Err(Error::InvalidArgument(_))
        ));
    }
    assert!(matches!(
        redmutex::ReentrantLock::new(&client, "a}b").try_lock(),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        redmutex::RwLock::new(&client, "a}b").try_write(),
        Err(Error::InvalidArgument(_))
    ));

    let watch = DistributedLock::with_options(&client, "w", options().release(Release::Watch));
    match watch.try_lock() {
        Err(Error::InvalidArgument(message)) => {
            assert!(message.contains("Release::Watch"), "{message}")
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    match watch.release_token("whatever") {
        Err(Error::InvalidArgument(_)) => {}
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert_eq!(cluster.total_keys(), before, "nothing was written");

    // A Lua-released guard asked to unlock with WATCH: refused, then
    // released by its drop with its own method.
    let lua = DistributedLock::with_options(&client, "w", options());
    let guard = lua.lock().expect("lock");
    match guard.unlock_with(Release::Watch) {
        Err(Error::InvalidArgument(_)) => {}
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert!(
        lua.try_lock().expect("try_lock").is_some(),
        "dropped guard released"
    );
}

#[test]
fn the_lock_survives_script_flush_on_every_node() {
    let cluster = RedisCluster::start(3, 0);
    let client = cluster.lock_client();
    let keys = cluster.key_per_primary("flush");
    let cycle = |fencing: bool| {
        for key in &keys {
            let lock =
                DistributedLock::with_options(&client, key.clone(), options().fencing(fencing));
            let guard = lock.lock().expect("lock");
            guard.unlock().expect("unlock");
        }
    };
    cycle(false);
    cycle(true);
    let flush_all = || {
        for node in cluster.nodes() {
            redis::cmd("SCRIPT")
                .arg("FLUSH")
                .exec(&mut node.conn())
                .expect("SCRIPT FLUSH");
        }
    };
    flush_all();
    cycle(false); // release script reloaded
    flush_all();
    cycle(true); // acquire script reloaded
    flush_all();
    // The watchdog's pipelined renewals reload too.
    let watched = DistributedLock::with_options(
        &client,
        keys[1].clone(),
        LockOptions::default()
            .ttl(Duration::from_millis(600))
            .watchdog(true),
    );
    let guard = watched.lock().expect("watched lock");
    let renewed = wait_until(Duration::from_secs(10), || client.stats().renewals >= 3);
    assert!(renewed, "renewals after SCRIPT FLUSH: {:?}", client.stats());
    assert!(guard.is_held().expect("is_held") && !guard.is_lost());
    guard.unlock().expect("unlock");
    for key in &keys {
        assert!(
            cluster
                .primary_for(key)
                .conn()
                .exists::<_, bool>(key)
                .is_ok_and(|e| !e)
        );
    }
}

#[test]
fn a_manual_failover_leaves_the_client_working() {
    let cluster = RedisCluster::start(3, 1);
    let client = cluster.lock_client();
    let keys = cluster.key_per_primary("fo");
    let mut before = Vec::new();
    for key in &keys {
        let guard = DistributedLock::with_options(&client, key.clone(), options().fencing(true))
            .lock()
            .expect("lock before");
        before.push(guard.fencing_token().expect("a token"));
        guard.unlock().expect("unlock before");
    }
    // Fail over the shard of the first key, with no lock held; FORCE does
    // not wait for the replica to catch up (fencing tokens must not go
    // backwards even if it had not).
    let old = cluster.primary_for_slot(cluster.slot(&keys[0]));
    let replica = cluster
        .replicas_of(&old.id)
        .into_iter()
        .next()
        .expect("the shard has a replica");
    redis::cmd("CLUSTER")
        .arg("FAILOVER")
        .arg("FORCE")
        .exec(&mut cluster.node(replica.port).conn())
        .expect("CLUSTER FAILOVER FORCE");
    let promoted = wait_until(Duration::from_secs(30), || {
        // Mid-failover a node may name no primary for the slot: not yet.
        cluster
            .try_primary_for_slot(cluster.slot(&keys[0]))
            .is_some_and(|primary| primary.port == replica.port)
    });
    assert!(promoted, "the replica took over: {:?}", cluster.topology());
    assert!(
        cluster.wait_settled(Duration::from_secs(30)),
        "cluster settled"
    );
    // The same client (its pooled connections still know the old primary)
    // follows the MOVED and keeps locking, the fenced script included.
    for (key, earlier) in keys.iter().zip(&before) {
        let lock = DistributedLock::with_options(&client, key.clone(), options().fencing(true));
        let guard = lock.lock().expect("lock after the failover");
        assert!(guard.is_held().expect("is_held"));
        let token = guard.fencing_token().expect("a token");
        assert!(token > *earlier, "{key}: {token} after {earlier}");
        guard.unlock().expect("unlock after the failover");
    }
    assert_eq!(cluster.primary_for(&keys[0]).port(), replica.port);
}

#[test]
fn min_replicas_waits_on_the_node_that_wrote_the_key() {
    let cluster = RedisCluster::start(3, 1);
    let client = cluster.lock_client();
    let key = cluster.key_per_primary("wait").remove(2);
    let replicated = options().min_replicas(1, Duration::from_millis(300));
    let lock = DistributedLock::with_options(&client, key.clone(), replicated);
    lock.lock()
        .expect("replicated lock")
        .unlock()
        .expect("unlock");
    // Stop the key's replica: WAIT there times out with 0, while WAIT on any
    // other node (no writes of ours) would answer at once.
    let primary = cluster.primary_for_slot(cluster.slot(&key));
    let replica = &cluster.replicas_of(&primary.id)[0];
    let stopped = cluster.node(replica.port);
    stopped.signal("STOP");
    let outcome = lock.try_lock();
    stopped.signal("CONT");
    match outcome {
        Err(Error::NotReplicated {
            acked: 0,
            wanted: 1,
            ..
        }) => {}
        other => panic!("expected NotReplicated, got {other:?}"),
    }
    let left: bool = cluster
        .primary_for(&key)
        .conn()
        .exists(&key)
        .expect("EXISTS");
    assert!(!left, "the unreplicated lock was released");

    // A permit the same way: WAIT on the key's primary, given back when
    // its replica is stopped.
    let semaphore = Semaphore::with_options(
        &client,
        format!("sem:{key}"),
        2,
        options()
            .with_extra(redmutex::SemaphoreExtra::default())
            .min_replicas(1, Duration::from_millis(300)),
    );
    let sem_key = semaphore.key().to_owned();
    let primary = cluster.primary_for_slot(cluster.slot(&sem_key));
    let replica = cluster.replicas_of(&primary.id)[0].port;
    semaphore
        .try_acquire()
        .expect("try")
        .expect("replicated permit")
        .release()
        .expect("release");
    let stopped = cluster.node(replica);
    stopped.signal("STOP");
    let outcome = semaphore.try_acquire();
    stopped.signal("CONT");
    assert!(
        matches!(outcome, Err(Error::NotReplicated { acked: 0, .. })),
        "{outcome:?}"
    );
    let left: bool = cluster
        .primary_for(&sem_key)
        .conn()
        .exists(&sem_key)
        .expect("EXISTS");
    assert!(!left, "the unreplicated permit was given back");
}

#[test]
fn waiters_on_another_client_are_woken_by_the_release_message() {
    let cluster = RedisCluster::start(3, 0);
    let key = cluster.key_per_primary("notify").remove(1);
    let owner = cluster.primary_for(&key).port();
    let waited = support::release_wakes_waiter(
        &cluster.lock_client(),
        &cluster.lock_client(),
        &key,
        |channel| {
            // Sharded on 7.0+: on the node that owns the key's slot, and
            // nowhere else.
            let sharded = cluster
                .nodes()
                .iter()
                .filter(|n| support::shard_numsub(n, channel) > 0)
                .map(|n| n.port())
                .collect::<Vec<_>>();
            let plain = cluster
                .nodes()
                .iter()
                .any(|n| support::numsub(n, channel) > 0);
            if support::server_major() >= 7 {
                assert!(!plain, "a SUBSCRIBE where SSUBSCRIBE was wanted");
                assert!(sharded.iter().all(|port| *port == owner), "{sharded:?}");
                !sharded.is_empty()
            } else {
                plain
            }
        },
    );
    assert!(
        waited < Duration::from_secs(5),
        "woken by the message: {waited:?}"
    );
}

#[test]
fn rwlock_reentrant_lock_and_semaphore_work_on_a_cluster() {
    let cluster = RedisCluster::start(3, 0);
    let client = cluster.lock_client();

    // `list` scans every primary: one held lock of each type on each.
    let keys = cluster.key_per_primary("listed");
    let mut held = Vec::new();
    for key in &keys {
        let plain = DistributedLock::new(&client, format!("l:{key}"));
        let reentrant = ReentrantLock::new(&client, format!("l:re:{key}"));
        let semaphore = Semaphore::new(&client, format!("l:sem:{key}"), 2);
        held.push((
            plain.lock().expect("plain"),
            reentrant.lock().expect("reentrant"),
            semaphore.acquire().expect("permit"),
        ));
    }
    let listing = client.list("l:*", Duration::from_secs(10)).expect("list");
    assert!(listing.complete);
    assert_eq!(listing.held.len(), 3 * keys.len(), "{listing:?}");
    for key in &keys {
        for (name, kind) in [
            (format!("l:{key}"), redmutex::LockKind::Mutex),
            (format!("l:re:{key}"), redmutex::LockKind::Reentrant),
            (format!("l:sem:{key}"), redmutex::LockKind::Semaphore),
        ] {
            assert!(
                listing.held.iter().any(|h| h.key == name && h.kind == kind),
                "{name} missing: {listing:?}"
            );
        }
    }
    drop(held);
    assert!(
        client
            .list("l:*", Duration::from_secs(10))
            .expect("list")
            .held
            .is_empty()
    );

    for key in cluster.key_per_primary("family") {
        let rw = RwLock::new(&client, format!("rw:{key}"));
        let r1 = rw.read().expect("read");
        let r2 = rw.read().expect("second reader");
        assert!(rw.try_write().expect("try_write").is_none());
        drop((r1, r2));
        rw.write().expect("write").unlock().expect("unlock");

        let reentrant = ReentrantLock::new(&client, format!("re:{key}"));
        let outer = reentrant.lock().expect("outer");
        let inner = reentrant.lock().expect("inner");
        assert_eq!(inner.depth(), 2);
        drop(inner);
        drop(outer);

        // A fenced, watched semaphore: its hash, fence counter and release
        // markers all in the key's slot (a cross-slot script would fail).
        let semaphore = Semaphore::with_options(
            &client,
            key.clone(),
            2,
            options()
                .with_extra(redmutex::SemaphoreExtra::default())
                .fencing(true)
                .watchdog(true),
        );
        let a = semaphore.acquire().expect("a");
        let b = semaphore.acquire().expect("b");
        assert!(semaphore.try_acquire().expect("try").is_none(), "full");
        assert!(b.fencing_token() > a.fencing_token());
        let status = semaphore.status().expect("status");
        assert_eq!((status.limit(), status.in_use()), (Some(2), 2));
        semaphore.release_permit(a.id()).expect("release by id");
        let c = semaphore.try_acquire().expect("try").expect("a's place");
        // a's own release now finds the marker its id left: nothing freed.
        drop(a);
        assert!(
            semaphore.try_acquire().expect("try").is_none(),
            "still full"
        );
        drop((b, c));
        let left: bool = cluster
            .primary_for(&key)
            .conn()
            .exists(&key)
            .expect("EXISTS");
        assert!(!left, "nothing outlives the last permit");
    }
}

#[test]
fn bad_cluster_urls_are_refused() {
    assert!(matches!(
        LockClient::builder().cluster(Vec::<String>::new()).build(),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        LockClient::builder().cluster(["not a url"]).build(),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        LockClient::builder()
            .cluster(["redis://127.0.0.1:1/"])
            .timeout(Duration::ZERO)
            .build(),
        Err(Error::InvalidArgument(_))
    ));
    // Nobody listening: an error within the timeouts, not a hang.
    let nobody = support::free_port();
    let client = LockClient::builder()
        .cluster([format!("redis://127.0.0.1:{nobody}/")])
        .timeout(Duration::from_millis(500))
        .build()
        .expect("the URL parses; nothing is contacted yet");
    let started = Instant::now();
    let outcome = DistributedLock::new(&client, "k").try_lock();
    assert!(outcome.is_err(), "{outcome:?}");
    // One connect's wait (one seed), and a slack below the timeout.
    let (took, limit) = (started.elapsed(), Duration::from_millis(800));
    eprintln!("bound | a cluster nobody listens on: the error | {took:?} | limit {limit:?}");
    assert!(took < limit, "{took:?}");
}

/// On a cluster, redis-rs resends a command by itself after a read timeout
/// (the policy above it never sees the first send). Here the key's primary
/// pauses writes longer than the client's timeout, so `force_release` is
/// sent twice: the second send must answer what the first deleted, not
/// "it was free" (a bare `GETDEL` would, and would delete a lock taken in
/// between).
#[test]
fn force_release_is_safe_against_redis_rs_resends() {
    let cluster = RedisCluster::start(3, 0);
    let holder = cluster.lock_client();
    let key = "{forced}:lock";
    let guard = DistributedLock::new(&holder, key).lock().expect("lock");
    let token = guard.token().to_owned();
    std::mem::forget(guard);
    let client = LockClient::builder()
        .cluster(cluster.urls())
        .timeout(Duration::from_millis(200))
        .build()
        .expect("client");
    let primary = cluster.primary_for(key);
    // The script on the node first: the paused send must be one that
    // deletes, not a `NOSCRIPT` (a request's redis-rs retries now stay
    // within its timeout, so a reload after the pause may not fit).
    DistributedLock::new(&client, "{forced}:other")
        .force_release()
        .expect("a free key");
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(350)
        .arg("WRITE")
        .query(&mut primary.conn())
        .expect("CLIENT PAUSE");
    let forced = DistributedLock::new(&client, key).force_release();
    let exists = || {
        redis::cmd("EXISTS")
            .arg(key)
            .query::<bool>(&mut primary.conn())
            .ok()
    };
    match forced {
        // Sent twice (the first reply lost to the pause), and told what
        // the first deleted, not "it was free".
        Ok(deleted) => {
            assert_eq!(deleted.as_deref(), Some(token.as_str()));
            assert_eq!(exists(), Some(false), "the key was deleted");
        }
        // Every send's connection closed before the pause ended: Redis
        // drops what a closed connection had not run yet, so the key may
        // still be there, the holder's. Said honestly.
        Err(err) => assert!(err.is_outcome_unknown(), "{err}"),
    }
    assert!(client.stats().resends >= 1, "{:?}", client.stats());
}

/// The lock key's slot (with its fencing counter) migrates back and forth
/// between two primaries while 4 threads lock and unlock it: no call fails
/// with a raw redirection (MOVED, ASK, TRYAGAIN), no two holders overlap,
/// and fencing tokens keep increasing. Before, 24 of such calls failed
/// (14 `Moved`, 10 `TryAgain`).
#[test]
fn the_lock_keys_slot_migrates_under_load_without_errors() {
    // Heavy (4 threads, ten migrations): one at a time with the others.
    let _serial = support::serial();
    let cluster = RedisCluster::start(3, 0);
    let key = "migrating";
    let slot = cluster.slot(key);
    let first = cluster.primary_for_slot(slot);
    let other = cluster
        .topology()
        .into_iter()
        .find(|n| n.primary && n.id != first.id)
        .expect("another primary");
    let clients = [cluster.lock_client(), cluster.lock_client()];
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let inside = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let client = clients[t % 2].clone();
            let (stop, inside) = (stop.clone(), inside.clone());
            std::thread::spawn(move || {
                let lock = DistributedLock::with_options(&client, key, options().fencing(true));
                let (mut acquired, mut errors, mut last) = (0u64, Vec::new(), 0u64);
                let mut rounds = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) && rounds < 100_000 {
                    rounds += 1;
                    match lock.lock() {
                        Ok(guard) => {
                            let before = inside.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            assert_eq!(before, 0, "two holders at once");
                            let token = guard.fencing_token().expect("a token");
                            assert!(token > last, "{token} after {last}");
                            last = token;
                            inside.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                            acquired += 1;
                            if let Err(err) = guard.unlock() {
                                errors.push(format!("unlock: {err}"));
                            }
                        }
                        Err(err) => errors.push(format!("lock: {err}")),
                    }
                }
                (acquired, errors)
            })
        })
        .collect();
    let mut moves = 0;
    let (mut from, mut to) = (first, other);
    for _ in 0..10 {
        cluster
            .migrate_slot(slot, &from, &to)
            .expect("migrate the slot");
        moves += 1;
        std::mem::swap(&mut from, &mut to);
        // A resharding moves a slot once; here it goes back and forth, with
        // a pause so the holders can finish (a release meets TRYAGAIN until
        // the migration of its slot completes, for at most twice the I/O
        // timeout).
        std::thread::sleep(Duration::from_millis(300));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut acquired = 0;
    let mut errors = Vec::new();
    for worker in workers {
        let (a, e) = worker.join().expect("worker");
        acquired += a;
        errors.extend(e);
    }
    assert_eq!(moves, 10);
    assert!(
        acquired > 100,
        "{acquired} acquisitions during the migrations"
    );
    assert!(
        errors.is_empty(),
        "{} errors, e.g. {:?}",
        errors.len(),
        errors.first()
    );
}

/// Release messages follow a slot to its new owner: a waiter subscribed
/// (`SSUBSCRIBE`) on the node that owns its key's slot is unsubscribed by
/// that node when the slot migrates away, subscribes again on the new
/// owner (after its `MOVED`), and is woken there by the release message.
/// Redis 7.0+ (sharded pub/sub); older servers use `SUBSCRIBE`, checked by
/// `waiters_on_another_client_are_woken_by_the_release_message`.
#[test]
fn release_messages_follow_a_migrated_slot_to_its_new_owner() {
    if support::server_major() < 7 {
        eprintln!("no sharded pub/sub before Redis 7.0: nothing to follow");
        return;
    }
    let _serial = support::serial();
    let cluster = RedisCluster::start(3, 0);
    let key = cluster.key_per_primary("follow").remove(0);
    let slot = cluster.slot(&key);
    let from = cluster.primary_for_slot(slot);
    let to = cluster
        .topology()
        .into_iter()
        .find(|n| n.primary && n.id != from.id)
        .expect("another primary");
    let (holder, waiter) = (cluster.lock_client(), cluster.lock_client());
    let options = || LockOptions::default().wait(Duration::from_secs(20));
    let guard = DistributedLock::with_options(&holder, key.as_str(), options())
        .lock()
        .expect("lock");
    let before = waiter.stats().notifications;
    let waiting = std::thread::spawn({
        let (waiter, key) = (waiter.clone(), key.clone());
        let slow = options().backoff(redmutex::Backoff::constant(Duration::from_secs(8)));
        move || {
            let lock = DistributedLock::with_options(&waiter, key, slow);
            let guard = lock.lock().expect("lock after the release");
            let at = Instant::now();
            guard.unlock().expect("unlock");
            at
        }
    });
    let channel = waiter.release_channel(&key);
    let on = |port: u16| support::shard_numsub(cluster.node(port), &channel);
    assert!(
        support::wait_until(Duration::from_secs(10), || on(from.port) > 0),
        "subscribed on the owner"
    );
    cluster.migrate_slot(slot, &from, &to).expect("migrate");
    assert!(
        support::wait_until(Duration::from_secs(10), || on(to.port) > 0
            && on(from.port) == 0),
        "the subscription followed the slot: {} on the old owner, {} on the new",
        on(from.port),
        on(to.port)
    );
    let released = Instant::now();
    guard.unlock().expect("unlock on the new owner");
    let taken = waiting.join().expect("waiter");
    let waited = taken.saturating_duration_since(released);
    assert!(
        waited < Duration::from_secs(4),
        "woken by the message on the new owner: {waited:?} after the release"
    );
    assert!(
        waiter.stats().notifications > before,
        "{:?}",
        waiter.stats()
    );
}

/// Cluster bus messages a node has sent, by type (`CLUSTER INFO`).
fn bus_sent(node: &support::RedisServer, kind: &str) -> u64 {
    let info: String = redis::cmd("CLUSTER")
        .arg("INFO")
        .query(&mut node.conn())
        .expect("CLUSTER INFO");
    let field = format!("cluster_stats_messages_{kind}_sent:");
    info.lines()
        .find_map(|line| line.strip_prefix(field.as_str()))
        .and_then(|count| count.trim().parse().ok())
        .unwrap_or(0)
}

/// A release message stays in its key's shard: with sharded pub/sub
/// (Redis 7.0+) a release sends no `PUBLISH` over the cluster bus (a
/// `PUBLISH` goes from the node it ran on to every other node), and with
/// no replicas, no shard message either. Prints the bus messages per
/// release.
#[test]
fn a_release_message_stays_in_its_shard() {
    let cluster = RedisCluster::start(3, 0);
    let client = cluster.lock_client();
    let keys = cluster.key_per_primary("shard");
    let sum = |kind: &str| {
        cluster
            .nodes()
            .iter()
            .map(|n| bus_sent(n, kind))
            .sum::<u64>()
    };
    let (publish, shard) = (sum("publish"), sum("publishshard"));
    let rounds = 30u64;
    for _ in 0..rounds {
        for key in &keys {
            let guard = DistributedLock::new(&client, key.as_str())
                .lock()
                .expect("lock");
            guard.unlock().expect("unlock");
        }
    }
    let releases = rounds * keys.len() as u64;
    let publish = sum("publish") - publish;
    let shard = sum("publishshard") - shard;
    eprintln!(
        "{releases} releases on {} primaries: {publish} PUBLISH and {shard} shard messages \
         on the cluster bus ({:.2} per release)",
        keys.len(),
        (publish + shard) as f64 / releases as f64
    );
    if support::server_major() >= 7 {
        assert_eq!(publish, 0, "releases announced with PUBLISH");
        assert_eq!(shard, 0, "shard messages without replicas");
    } else {
        assert!(publish >= releases, "{publish} for {releases} releases");
    }
}

/// Release messages follow a failover: the primary a waiter subscribed on
/// is killed, its replica takes over, and the subscription moves there
/// (the lost node's channels are asked for again until a node names the
/// new owner), where the release message wakes the waiter.
#[test]
fn release_messages_follow_a_failover_to_the_promoted_replica() {
    if support::server_major() < 7 {
        eprintln!("no sharded pub/sub before Redis 7.0: nothing to follow");
        return;
    }
    let _serial = support::serial();
    let cluster = RedisCluster::start(3, 1);
    let key = cluster.key_per_primary("failover").remove(1);
    let slot = cluster.slot(&key);
    let primary = cluster.primary_for_slot(slot);
    let (holder, waiter) = (cluster.lock_client(), cluster.lock_client());
    let options = || LockOptions::default().wait(Duration::from_secs(30));
    let guard = DistributedLock::with_options(
        &holder,
        key.as_str(),
        options().min_replicas(1, Duration::from_secs(1)),
    )
    .lock()
    .expect("lock, on the replica too");
    let before = waiter.stats().notifications;
    let waiting = std::thread::spawn({
        let (waiter, key) = (waiter.clone(), key.clone());
        let slow = options().backoff(redmutex::Backoff::constant(Duration::from_secs(10)));
        move || {
            let lock = DistributedLock::with_options(&waiter, key, slow);
            // A call that meets the killed node fails (its outcome
            // unknown): waited for again, as a program would, for as long
            // as a failover may take on a loaded machine.
            let mut errors = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(40);
            while Instant::now() < deadline {
                match lock.lock() {
                    Ok(guard) => {
                        let at = Instant::now();
                        guard.unlock().expect("unlock");
                        return (at, errors);
                    }
                    Err(err)
                        if err.is_connection() || matches!(err, Error::OutcomeUnknown { .. }) =>
                    {
                        errors.push(err.to_string());
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    Err(err) => panic!("lock after the release: {err}"),
                }
            }
            panic!("never taken: {errors:?}");
        }
    });
    let channel = waiter.release_channel(&key);
    let on = |port: u16| support::shard_numsub(cluster.node(port), &channel);
    assert!(
        support::wait_until(Duration::from_secs(10), || on(primary.port) > 0),
        "subscribed on the primary"
    );
    cluster.node(primary.port).signal("KILL");
    let promoted = support::wait_until(Duration::from_secs(20), || {
        cluster
            .try_primary_for_slot(slot)
            .is_some_and(|owner| owner.port != primary.port)
    });
    assert!(promoted, "a replica took the slot over");
    let owner = cluster.primary_for_slot(slot);
    assert!(
        support::wait_until(Duration::from_secs(20), || on(owner.port) > 0),
        "the subscription followed the slot to the promoted replica"
    );
    let released = Instant::now();
    guard.unlock().expect("unlock on the promoted replica");
    let (taken, errors) = waiting.join().expect("waiter");
    eprintln!("the waiter's failed calls during the failover: {errors:?}");
    let waited = taken.saturating_duration_since(released);
    assert!(
        waited < Duration::from_secs(5),
        "woken by the message on the promoted replica: {waited:?} after the release"
    );
    assert!(
        waiter.stats().notifications > before,
        "{:?}",
        waiter.stats()
    );
}
