//! Redis ACL users: the rule docs/failure-model.md gives a lock user is enough for
//! every lock type, and a user without channel permissions (the Redis 7
//! default for new users) still releases, and waits by backoff.

use redmutex_test_support as support;

use std::time::{Duration, Instant};

use redmutex::Lease;
use redmutex::{
    Backoff, DistributedLock, LockClient, LockOptions, RedLock, ReentrantLock, Release, RwLock,
    Unlocked,
};
use support::{RedisServer, exists, secret, wait_until};

/// The documented rule for a user whose locks are named `locks:*`, word for
/// word (checked against docs/failure-model.md below).
const RULE: &str = "on >secret resetkeys ~locks:* ~{locks:* resetchannels &redmutex:released:* \
    -@all +set +get +getdel +pttl +eval +evalsha +script|load +wait +watch +unwatch +multi +exec \
    +subscribe +unsubscribe +ping +client|setname +role \
    +del +exists +pexpire +pexpireat +psetex +publish +incr +decr +time +hget +hset +hdel +hlen +hgetall +mget +zadd +zrem +zrange +zrangebyscore +zscore +zrank +zcard";

/// The documented rule for a client whose key prefix is `teamA:`: one key
/// pattern and one channel pattern cover everything the crate touches.
const PREFIX_RULE: &str = "on >secret resetkeys ~teamA:* resetchannels &teamA:* \
    -@all +set +get +getdel +pttl +eval +evalsha +script|load +wait +watch +unwatch +multi +exec \
    +subscribe +unsubscribe +ping +client|setname +role \
    +del +exists +pexpire +pexpireat +psetex +publish +incr +decr +time +hget +hset +hdel +hlen +hgetall +mget +zadd +zrem +zrange +zrangebyscore +zscore +zrank +zcard";

fn set_user(server: &RedisServer, name: &str, rule: &str) {
    let mut cmd = redis::cmd("ACL");
    cmd.arg("SETUSER").arg(name);
    for word in rule.split_whitespace() {
        cmd.arg(word);
    }
    let _: () = cmd.query(&mut server.conn()).expect("ACL SETUSER");
}

fn client_as(server: &RedisServer, user: &str) -> LockClient {
    let url = format!("redis://{user}:secret@127.0.0.1:{}/", server.port());
    LockClient::open(&url).expect("client")
}

/// The entries of `ACL LOG`: every command, key or channel the server
/// refused, including those the crate tolerates quietly (a marker or a
/// `PUBLISH` refused inside `redis.pcall`, a refused `SUBSCRIBE`).
fn acl_denials(server: &RedisServer) -> Vec<redis::Value> {
    redis::cmd("ACL")
        .arg("LOG")
        .query(&mut server.conn())
        .expect("ACL LOG")
}

#[test]
fn the_readme_gives_this_rule() {
    let readme = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/failure-model.md"
    ))
    .expect("docs/failure-model.md");
    let flat = readme.split_whitespace().collect::<Vec<_>>().join(" ");
    for rule in [RULE, PREFIX_RULE] {
        let rule = rule.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            flat.contains(&rule),
            "docs/failure-model.md must give the rule:\n{rule}"
        );
    }
}

#[test]
fn the_readme_rule_runs_every_lock_type() {
    let server = RedisServer::start();
    set_user(&server, "locker", RULE);
    let client = client_as(&server, "locker");
    let options = LockOptions::default().wait(Duration::from_secs(5));
    for release in [Release::Lua, Release::Watch] {
        let lock = DistributedLock::with_options(&client, "locks:plain", options.release(release));
        let mut guard = lock.lock().expect("lock");
        guard.extend(Duration::from_secs(10)).expect("extend");
        assert!(guard.is_held().expect("is_held"));
        let marker = format!("{{locks:plain}}:released:{}", secret(guard.token()));
        guard.unlock().expect("unlock");
        // The rule lets the release leave its marker (written with pcall,
        // so a refusal would otherwise go unnoticed).
        assert!(exists(&server, &marker), "{release:?}: no release marker");
    }
    let fenced = DistributedLock::with_options(&client, "locks:fenced", options.fencing(true));
    let guard = fenced.lock().expect("fenced lock");
    assert!(guard.fencing_token().is_some_and(support::clock_floored));
    guard.unlock().expect("unlock");

    let watched = DistributedLock::with_options(
        &client,
        "locks:watched",
        options.ttl(Duration::from_millis(300)).watchdog(true),
    );
    let guard = watched.lock().expect("watched lock");
    let renewals = client.stats().renewals;
    assert!(wait_until(Duration::from_secs(5), || client
        .stats()
        .renewals
        > renewals + 2));
    assert!(!guard.is_lost());
    guard.unlock().expect("unlock");

    let reentrant = ReentrantLock::new(&client, "locks:reentrant");
    let outer = reentrant.lock().expect("reentrant");
    let inner = reentrant.lock().expect("re-enter");
    assert_eq!(inner.unlock().expect("inner"), Unlocked::StillHeld);
    assert_eq!(outer.unlock().expect("outer"), Unlocked::Released);

    let rw = RwLock::new(&client, "locks:rw");
    let reader = rw.read().expect("read");
    reader.unlock().expect("unlock");
    let writer = rw.write().expect("write");
    writer.unlock().expect("unlock");

    // A set of keys, fenced and watched, checked, released.
    let set = redmutex::MultiLock::with_options(
        &client,
        ["locks:m1", "locks:m2"],
        redmutex::MultiLockOptions::default()
            .fencing(true)
            .ttl(Duration::from_millis(300))
            .watchdog(true),
    );
    let mut guard = set.lock().expect("multi");
    assert!(guard.is_held().expect("is_held"));
    guard.extend(Duration::from_secs(5)).expect("extend");
    guard.unlock().expect("unlock");
    // A fair lock queues (a waiter behind a holder), and its release wakes
    // the head on the head's own channel.
    let fair = redmutex::FairLock::new(&client, "locks:fair");
    let held = fair.lock().expect("fair");
    let waiter = {
        let fair = redmutex::FairLock::new(&client_as(&server, "locker"), "locks:fair");
        std::thread::spawn(move || fair.lock().map(drop))
    };
    assert!(wait_until(Duration::from_secs(5), || {
        server
            .try_query::<u64>(redis::cmd("ZCARD").arg("{locks:fair}:fairq"))
            .is_some_and(|n| n == 1)
    }));
    held.unlock().expect("unlock");
    waiter.join().expect("waiter").expect("served");

    // Notify waiting: the waiter is woken by the release message.
    let holder = client_as(&server, "locker");
    let waited = support::release_wakes_waiter(&holder, &client, "locks:notify", |channel| {
        support::numsub(&server, channel) == 1
    });
    assert!(
        waited < Duration::from_secs(4),
        "woken, not polled: {waited:?}"
    );

    let forced = DistributedLock::new(&client, "locks:forced");
    let guard = forced.lock().expect("lock");
    let token = guard.token().to_owned();
    assert_eq!(forced.force_release().expect("force"), Some(token));
    drop(guard);
    for key in [
        "locks:plain",
        "locks:fenced",
        "locks:watched",
        "locks:rw",
        "locks:forced",
        "locks:m1",
        "locks:fair",
        "{locks:fair}:fairq",
    ] {
        assert!(!exists(&server, key), "{key}");
    }
}

/// Case 7: a user without channel permissions. On main `release.lua`
/// deleted the key and then failed on `PUBLISH`, so every `unlock()`
/// returned an error although the lock was released; and each queue head
/// waited 200 ms for a `SUBSCRIBE` the server had refused.
#[test]
fn a_user_without_channels_releases_and_waits_by_backoff() {
    let server = RedisServer::start();
    let rule = RULE.replace("&redmutex:released:*", "");
    set_user(&server, "nochan", &rule);
    let client = client_as(&server, "nochan");
    for release in [Release::Lua, Release::Watch] {
        let lock = DistributedLock::with_options(
            &client,
            "locks:n",
            LockOptions::default().release(release),
        );
        lock.lock()
            .expect("lock")
            .unlock()
            .expect("released, not an error");
        assert!(!exists(&server, "locks:n"), "{release:?}");
    }
    let rw = RwLock::new(&client, "locks:rw");
    rw.write().expect("write").unlock().expect("released");

    let holder = server.lock_client();
    let guard = DistributedLock::new(&holder, "locks:w")
        .lock()
        .expect("lock");
    let waiter = {
        let client = client.clone();
        std::thread::spawn(move || {
            let started = Instant::now();
            let commands = client.stats().commands;
            let guard = DistributedLock::with_options(
                &client,
                "locks:w",
                LockOptions::default()
                    .wait(Duration::from_secs(10))
                    .backoff(Backoff::constant(Duration::from_millis(10))),
            )
            .lock()
            .expect("lock");
            let attempts = client.stats().commands - commands;
            drop(guard);
            (attempts, started.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(600));
    drop(guard);
    let (attempts, waited) = waiter.join().expect("waiter");
    // At the backoff's pace: ~10 ms apart, not 200 ms apart.
    assert!(attempts >= 15, "{attempts} attempts in {waited:?}");
}

/// The WATCH release for a user without channel permissions falls back to
/// a transaction without `PUBLISH` and without a marker; when that one's
/// reply is lost, the resend cannot count on a marker: it must not say
/// "not held" for a release that happened (it says Ok or unknown).
#[test]
fn a_bare_watch_release_whose_reply_is_lost_does_not_lie() {
    let server = RedisServer::start();
    let rule = RULE.replace("&redmutex:released:*", "");
    set_user(&server, "nochan", &rule);
    let proxy = support::FaultProxy::to(&server);
    let url = format!("redis://nochan:secret@127.0.0.1:{}/", proxy.port());
    let client = LockClient::open(&url).expect("client");
    let lock = DistributedLock::with_options(
        &client,
        "locks:w",
        LockOptions::default().release(Release::Watch),
    );
    let guard = lock.lock().expect("lock");
    // The bare transaction: MULTI, DEL locks:w, EXEC, with no PUBLISH.
    proxy.lose_reply("$7\r\nlocks:w\r\n*1\r\n$4\r\nEXEC", 1);
    let result = guard.unlock();
    assert_eq!(proxy.lost_replies(), 1, "the fault fired");
    assert!(!exists(&server, "locks:w"), "the release deleted the key");
    match result {
        Ok(_) => {}
        Err(err) => assert!(err.is_outcome_unknown(), "told {err}"),
    }
}

/// A user who may write lock keys but not their markers (`~locks:*`
/// without `~{locks:*`): releases still work (the marker is written with
/// pcall), and a release whose reply is lost, sent again, cannot read a
/// marker: it says the outcome is unknown, never "not held".
#[test]
fn a_release_whose_marker_cannot_be_read_does_not_claim_not_held() {
    let server = RedisServer::start();
    support::load_scripts(&server);
    let rule = RULE.replace("~{locks:*", "");
    set_user(&server, "nomarks", &rule);
    let proxy = support::FaultProxy::to(&server);
    let url = format!("redis://nomarks:secret@127.0.0.1:{}/", proxy.port());
    let client = LockClient::open(&url).expect("client");
    let lock = DistributedLock::new(&client, "locks:m");
    lock.lock()
        .expect("lock")
        .unlock()
        .expect("a plain release works");
    let guard = lock.lock().expect("lock");
    proxy.lose_reply(&support::sha(include_str!("../lua/release.lua")), 1);
    let result = guard.unlock();
    assert_eq!(proxy.lost_replies(), 1, "the fault fired");
    assert!(!exists(&server, "locks:m"), "the first send released it");
    match result {
        Ok(_) => panic!("no marker could say so"),
        Err(err) => assert!(err.is_outcome_unknown(), "told {err}"),
    }
}

/// Issue 14's namespace: with `key_prefix("teamA:")`, a user confined to
/// `~teamA:*` and `&teamA:*` runs every lock type, fencing, the watchdog,
/// notify waiting, force release and RedLock, and the server refuses
/// nothing (its `ACL LOG` stays empty: a marker or a `PUBLISH` refused
/// inside `redis.pcall` would otherwise pass unnoticed), and every key left
/// behind starts with the prefix.
#[test]
fn a_key_prefix_confines_every_lock_type_to_one_acl_pattern() {
    let server = RedisServer::start();
    set_user(&server, "team", PREFIX_RULE);
    let _: () = redis::cmd("ACL")
        .arg("LOG")
        .arg("RESET")
        .query(&mut server.conn())
        .expect("ACL LOG RESET");
    let url = format!("redis://team:secret@127.0.0.1:{}/", server.port());
    let open = || {
        LockClient::builder()
            .url(&url)
            .key_prefix("teamA:")
            .build()
            .expect("client")
    };
    let client = open();
    assert_eq!(client.key("plain"), "teamA:plain");
    // An empty name is refused as without a prefix, not the bare prefix.
    assert!(matches!(
        DistributedLock::new(&client, "").try_lock(),
        Err(redmutex::Error::InvalidArgument(_))
    ));
    let options = LockOptions::default().wait(Duration::from_secs(5));
    for release in [Release::Lua, Release::Watch] {
        let lock = DistributedLock::with_options(&client, "plain", options.release(release));
        assert_eq!(lock.key(), "teamA:plain");
        let mut guard = lock.lock().expect("lock");
        assert!(exists(&server, "teamA:plain"));
        guard.extend(Duration::from_secs(10)).expect("extend");
        assert!(guard.is_held().expect("is_held"));
        let marker = format!("teamA:{{teamA:plain}}:released:{}", secret(guard.token()));
        guard.unlock().expect("unlock");
        assert!(exists(&server, &marker), "{release:?}: no marker {marker}");
    }
    let fenced = DistributedLock::with_options(&client, "fenced", options.fencing(true));
    let guard = fenced.lock().expect("fenced lock");
    assert!(guard.fencing_token().is_some_and(support::clock_floored));
    assert!(exists(&server, &client.fence_key(fenced.key())));
    assert_eq!(client.fence_key(fenced.key()), "teamA:{teamA:fenced}:fence");
    guard.unlock().expect("unlock");

    let watched = DistributedLock::with_options(
        &client,
        "watched",
        options.ttl(Duration::from_millis(300)).watchdog(true),
    );
    let guard = watched.lock().expect("watched lock");
    let renewals = client.stats().renewals;
    assert!(wait_until(Duration::from_secs(5), || client
        .stats()
        .renewals
        > renewals + 2));
    assert!(!guard.is_lost());
    guard.unlock().expect("unlock");

    let reentrant = ReentrantLock::new(&client, "reentrant");
    let outer = reentrant.lock().expect("reentrant");
    assert!(exists(&server, "teamA:reentrant"));
    let inner = reentrant.lock().expect("re-enter");
    assert_eq!(inner.unlock().expect("inner"), Unlocked::StillHeld);
    assert_eq!(outer.unlock().expect("outer"), Unlocked::Released);

    let rw = RwLock::new(&client, "rw");
    let reader = rw.read().expect("read");
    assert!(exists(&server, "teamA:rw"));
    reader.unlock().expect("unlock");
    let writer = rw.write().expect("write");
    writer.unlock().expect("unlock");

    // Notify waiting on the prefixed channel, across two clients.
    let holder = open();
    let waited = support::release_wakes_waiter(&holder, &client, "notify", |channel| {
        assert!(channel.starts_with("teamA:"), "{channel}");
        support::numsub(&server, channel) == 1
    });
    assert!(
        waited < Duration::from_secs(4),
        "woken, not polled: {waited:?}"
    );

    let forced = DistributedLock::new(&client, "forced");
    let guard = forced.lock().expect("lock");
    let token = guard.token().to_owned();
    assert_eq!(forced.force_release().expect("force"), Some(token));
    drop(guard);

    let redlock = RedLock::new(vec![client.clone(), open(), open()], "red").expect("nodes");
    assert_eq!(redlock.key(), "teamA:red");
    let guard = redlock.lock().expect("redlock");
    assert!(exists(&server, "teamA:red"));
    guard.unlock().expect("unlock");

    let mut semaphore = redmutex::Semaphore::new(&client, "sem", 2);
    let mut permit = semaphore.acquire().expect("permit");
    assert!(exists(&server, "teamA:sem"));
    permit.extend(Duration::from_secs(10)).expect("extend");
    assert!(permit.is_held().expect("is_held"));
    semaphore.set_permits(3).expect("set_permits");
    permit.release().expect("release");

    let denials = acl_denials(&server);
    assert!(denials.is_empty(), "the server refused: {denials:?}");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query(&mut server.conn())
        .expect("KEYS (a test server)");
    assert!(!keys.is_empty(), "markers and the fence counter remain");
    for key in keys {
        assert!(key.starts_with("teamA:"), "{key} is outside the namespace");
    }
}

/// RedLock nodes must agree on the key: one prefix for all of them.
#[test]
fn redlock_nodes_with_different_prefixes_are_refused() {
    let server = RedisServer::start();
    let with = |prefix: &str| {
        LockClient::builder()
            .url(server.url())
            .key_prefix(prefix)
            .build()
            .expect("client")
    };
    let result = RedLock::new(vec![with("a:"), with("b:")], "k");
    assert!(
        matches!(result, Err(redmutex::Error::InvalidArgument(_))),
        "{result:?}"
    );
}

/// On main a wrong password waited out the pool's timeout (2 s) and came
/// back as `Error::Pool("timed out waiting for connection: …")`. A
/// definitive refusal is its own error, known after one connect.
#[test]
fn definitive_refusals_fail_fast_with_their_own_error() {
    let server = RedisServer::start();
    set_user(&server, "locker", "on >pw ~* &* +@all");
    // From here on the default user needs a password too.
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("secret")
        .query(&mut server.conn())
        .expect("CONFIG SET");
    let mut admin = redis::Client::open(format!("redis://:secret@127.0.0.1:{}/", server.port()))
        .expect("url")
        .get_connection()
        .expect("admin");
    let port = server.port();
    for (what, url) in [
        (
            "a wrong password",
            format!("redis://:wrong@127.0.0.1:{port}/"),
        ),
        (
            "an unknown user",
            format!("redis://nobody:pw@127.0.0.1:{port}/"),
        ),
        (
            "a user's wrong password",
            format!("redis://locker:wrong@127.0.0.1:{port}/"),
        ),
        ("no password (NOAUTH)", format!("redis://127.0.0.1:{port}/")),
        (
            "a database it does not have",
            format!("redis://:secret@127.0.0.1:{port}/99"),
        ),
    ] {
        let client = LockClient::open(&url).expect("client");
        for attempt in 0..2 {
            let started = Instant::now();
            let got = DistributedLock::new(&client, "locks:refused").try_lock();
            let took = started.elapsed();
            assert!(
                matches!(got, Err(redmutex::Error::Refused { .. })),
                "{what}, attempt {attempt}: {got:?}"
            );
            // One connect and one round trip, well within the pool's
            // timeout (2 s) it used to wait out.
            assert!(took < Duration::from_secs(1), "{what}: {took:?}");
            if let Err(err) = got {
                assert!(!err.is_connection(), "{what}: a retry cannot fix it");
                assert_eq!(err.kind(), "refused");
            }
        }
    }
    let left: bool = redis::cmd("EXISTS")
        .arg("locks:refused")
        .query(&mut admin)
        .expect("EXISTS");
    assert!(!left, "nothing was taken");
    // The right password still works on the same server.
    let client = LockClient::open(&format!("redis://:secret@127.0.0.1:{port}/")).expect("client");
    DistributedLock::new(&client, "locks:fine")
        .lock()
        .expect("lock")
        .unlock()
        .expect("unlock");
}

/// One lock type's round as a documented user makes it: take it, use what
/// the type offers (extend, re-enter, renew), let it go. `Err` is the first
/// error met; the key it names must then hold nothing of ours.
fn round(client: &LockClient, kind: &str, key: &str) -> Result<(), redmutex::Error> {
    let options = LockOptions::default().wait(Duration::from_secs(2));
    let lease = redmutex::Options::default().wait(Duration::from_secs(2));
    match kind {
        "lock (Lua)" | "lock (WATCH)" => {
            let release = if kind == "lock (Lua)" {
                Release::Lua
            } else {
                Release::Watch
            };
            let lock = DistributedLock::with_options(client, key, options.release(release));
            let mut guard = lock.lock()?;
            guard.extend(Duration::from_secs(10))?;
            assert!(guard.is_held()?);
            assert!(lock.status()?.is_some());
            guard.unlock()?;
            // And once more by drop (written behind after the first).
            drop(lock.lock()?);
        }
        "fenced lock" => {
            let guard = DistributedLock::with_options(client, key, options.fencing(true)).lock()?;
            assert!(guard.fencing_token().is_some());
            guard.unlock()?;
        }
        "watched lock" => {
            let guard = DistributedLock::with_options(
                client,
                key,
                options.ttl(Duration::from_millis(300)).watchdog(true),
            )
            .lock()?;
            let renewals = client.stats().renewals;
            assert!(wait_until(Duration::from_secs(5), || {
                client.stats().renewals > renewals + 1
            }));
            assert!(!guard.is_lost(), "renewals refused");
            guard.unlock()?;
        }
        "fenced reentrant" | "watched reentrant" => {
            let fenced = kind.starts_with("fenced");
            let lock = ReentrantLock::with_options(
                client,
                key,
                lease
                    .ttl(Duration::from_millis(if fenced { 30_000 } else { 300 }))
                    .watchdog(!fenced)
                    .with_extra(redmutex::ReentrantExtra::default())
                    .fencing(fenced),
            );
            let guard = lock.lock()?;
            assert_eq!(guard.fencing_token().is_some(), fenced);
            let nested = lock.lock()?;
            assert_eq!(nested.fencing_token(), guard.fencing_token());
            watched_for_a_while(client, &guard, !fenced);
            nested.unlock()?;
            guard.unlock()?;
        }
        "fenced write" | "watched read" | "watched write" => {
            let fenced = kind.starts_with("fenced");
            let lock = RwLock::with_options(
                client,
                key,
                lease
                    .ttl(Duration::from_millis(if fenced { 30_000 } else { 300 }))
                    .watchdog(!fenced)
                    .with_extra(redmutex::RwLockExtra::default())
                    .fencing(fenced),
            );
            let guard = if kind.ends_with("read") {
                lock.read()?
            } else {
                lock.write()?
            };
            assert_eq!(guard.fencing_token().is_some(), fenced);
            watched_for_a_while(client, &guard, !fenced);
            guard.unlock()?;
        }
        "watched RedLock" => {
            let lock = RedLock::with_options(
                vec![client.clone()],
                key,
                lease
                    .ttl(Duration::from_millis(300))
                    .watchdog(true)
                    .with_extra(Default::default()),
            )?;
            let guard = lock.lock()?;
            // Its renewals are its own thread's: past three ttls, still
            // held and not lost.
            let until = Instant::now() + Duration::from_millis(900);
            while Instant::now() < until {
                std::thread::sleep(Duration::from_millis(50));
            }
            assert!(!guard.is_lost(), "renewals refused");
            assert!(guard.is_held()?);
            guard.unlock()?;
        }
        "reentrant" => {
            let lock = ReentrantLock::with_options(client, key, lease);
            let outer = lock.lock()?;
            let mut inner = lock.lock()?;
            assert_eq!(lock.status()?.map(|held| held.holders), Some(2));
            inner.extend(Duration::from_secs(10))?;
            inner.unlock()?;
            outer.unlock()?;
        }
        "read" | "write" => {
            let lock = RwLock::with_options(client, key, lease.with_extra(Default::default()));
            let mut guard = if kind == "read" {
                lock.read()?
            } else {
                lock.write()?
            };
            assert!(lock.status()?.is_some());
            guard.extend(Duration::from_secs(10))?;
            assert!(guard.is_held()?);
            guard.unlock()?;
        }
        "semaphore" | "fenced semaphore" => {
            let options = lease
                .with_extra(redmutex::SemaphoreExtra::default())
                .fencing(kind != "semaphore");
            let mut permit =
                redmutex::Semaphore::with_options(client, key, 2, options).acquire()?;
            permit.extend(Duration::from_secs(10))?;
            permit.release()?;
        }
        "RedLock" => {
            let lock = RedLock::with_options(
                vec![client.clone()],
                key,
                lease.with_extra(Default::default()),
            )?;
            let mut guard = lock.lock()?;
            guard.extend(Duration::from_secs(10))?;
            guard.unlock()?;
        }
        "force release" => {
            let lock = DistributedLock::with_options(client, key, options);
            let guard = lock.lock()?;
            lock.force_release()?;
            drop(guard);
        }
        other => unreachable!("{other}"),
    }
    Ok(())
}

/// With `watched`, waits for two renewals of the client's watchdog and
/// checks they were not refused.
fn watched_for_a_while(client: &LockClient, guard: &dyn redmutex::Lease, watched: bool) {
    if !watched {
        return;
    }
    let renewals = client.stats().renewals;
    assert!(wait_until(Duration::from_secs(5), || {
        client.stats().renewals > renewals + 1
    }));
    assert!(!guard.is_lost(), "renewals refused");
}

/// Every configuration the failure model documents, every lock type and both
/// release mechanisms. What works must work; what a configuration cannot
/// serve (fencing without the `{locks:*` keys) must be refused at the
/// first call with an error that says so, never a lock left held for its
/// ttl, never a pool timeout or an unknown outcome.
#[test]
fn every_documented_acl_configuration_with_every_lock_type() {
    let server = RedisServer::start();
    const KINDS: [&str; 17] = [
        "lock (Lua)",
        "lock (WATCH)",
        "fenced lock",
        "watched lock",
        "reentrant",
        "fenced reentrant",
        "watched reentrant",
        "read",
        "write",
        "fenced write",
        "watched read",
        "watched write",
        "semaphore",
        "fenced semaphore",
        "RedLock",
        "watched RedLock",
        "force release",
    ];
    let configurations: [(&str, String, Option<&str>); 4] = [
        ("the full rule", RULE.to_owned(), None),
        (
            "without the {locks:* keys",
            RULE.replace("~{locks:*", ""),
            None,
        ),
        (
            "without channels",
            RULE.replace("&redmutex:released:*", ""),
            None,
        ),
        ("the key prefix", PREFIX_RULE.to_owned(), Some("teamA:")),
    ];
    for (n, (_, rule, _)) in configurations.iter().enumerate() {
        set_user(&server, &format!("user{n}"), rule);
    }
    // Every case on its own: a fresh client (nothing learnt from an earlier
    // case: refused markers, a server without `SET NX GET`, scripts known
    // to work), an empty script cache, its own key, in an order of its own
    // each run (the seed is printed, to replay one).
    let mut cases: Vec<(usize, usize)> = (0..configurations.len())
        .flat_map(|n| (0..KINDS.len()).map(move |i| (n, i)))
        .collect();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64 | 1);
    println!("case order seed: {seed}");
    let mut dice = support::Dice(seed);
    for i in (1..cases.len()).rev() {
        let j = dice.below(i as u64 + 1) as usize;
        cases.swap(i, j);
    }
    let mut table = Vec::new();
    for (n, i) in cases {
        let (name, _, prefix) = &configurations[n];
        let kind = KINDS[i];
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query(&mut server.conn())
            .expect("SCRIPT FLUSH");
        let url = format!("redis://user{n}:secret@127.0.0.1:{}/", server.port());
        let mut builder = LockClient::builder().url(&url);
        if let Some(prefix) = prefix {
            builder = builder.key_prefix(*prefix);
        }
        let client = builder.build().expect("client");
        {
            let name_of_key = format!("locks:m{n}:{i}");
            let key = client.key(&name_of_key);
            let started = Instant::now();
            let outcome = round(&client, kind, &name_of_key);
            let took = started.elapsed();
            let fencing = kind.starts_with("fenced");
            let cannot_serve = *name == "without the {locks:* keys" && fencing;
            match &outcome {
                Ok(()) => assert!(!cannot_serve, "{name}, {kind}: fencing without its counter"),
                Err(err) => {
                    assert!(cannot_serve, "{name}, {kind}: {err}");
                    // Refused at once and said why, not a timeout.
                    assert!(
                        !err.is_connection() && !err.is_timeout() && !err.is_outcome_unknown(),
                        "{name}, {kind}: {err}"
                    );
                    assert!(took < Duration::from_secs(2), "{name}, {kind}: {took:?}");
                    assert!(
                        matches!(err, redmutex::Error::FenceCounter { detail, .. } if detail.contains("NOPERM")),
                        "{name}, {kind}: not named as the counter's ACL: {err}"
                    );
                }
            }
            // Nothing of ours is left holding the key.
            assert!(
                wait_until(Duration::from_secs(2), || !exists(&server, &key)),
                "{name}, {kind}: {key} still held"
            );
            table.push(format!(
                "{name} | {kind} | {}",
                match &outcome {
                    Ok(()) => "works".to_owned(),
                    Err(err) => format!("refused: {err}"),
                }
            ));
        }
    }
    println!("{}", table.join("\n"));
}

/// Without its marker a force release is a bare `GETDEL`, which must not
/// run twice: a lost reply is `OutcomeUnknown`, and the request is not
/// sent again (a second `GETDEL` could delete a lock taken in between).
#[test]
fn a_force_release_without_its_marker_is_sent_once() {
    let server = RedisServer::start();
    let rule = RULE.replace("~{locks:*", "");
    set_user(&server, "nomarks", &rule);
    let proxy = support::FaultProxy::to(&server);
    let url = format!("redis://nomarks:secret@127.0.0.1:{}/", proxy.port());
    let client = LockClient::open(&url).expect("client");
    let lock = DistributedLock::new(&client, "locks:f");
    // Held elsewhere; the first force release learns that markers are
    // refused and deletes it with GETDEL.
    let _: () = redis::cmd("SET")
        .arg("locks:f")
        .arg("someone")
        .query(&mut server.conn())
        .expect("SET");
    assert_eq!(
        lock.force_release().expect("force").as_deref(),
        Some("someone")
    );
    let _: () = redis::cmd("SET")
        .arg("locks:f")
        .arg("another")
        .query(&mut server.conn())
        .expect("SET");
    let getdels = server.command_calls("getdel");
    proxy.lose_reply("GETDEL", 1);
    let result = lock.force_release();
    assert_eq!(proxy.lost_replies(), 1, "the fault fired");
    assert!(
        matches!(&result, Err(err) if err.is_outcome_unknown()),
        "{result:?}"
    );
    assert_eq!(server.command_calls("getdel"), getdels + 1, "sent once");
    assert!(!exists(&server, "locks:f"), "the one send deleted it");
}

/// A dropped guard's release is written behind by `EVALSHA`; after a
/// `SCRIPT FLUSH` its owed `NOSCRIPT` is answered by sending the release
/// again as `EVAL` with the script's source. The documented rule must allow
/// that `EVAL`: the key is freed by it, and the server refuses nothing.
#[test]
fn the_documented_rule_allows_a_release_written_behind_after_a_script_flush() {
    let server = RedisServer::start();
    set_user(&server, "locker", RULE);
    let client = client_as(&server, "locker");
    let options = LockOptions::default()
        .ttl(Duration::from_secs(60))
        .wait(Duration::from_secs(5));
    let lock = DistributedLock::with_options(&client, "locks:behind", options);
    // One synchronous release first: writing behind starts once scripts
    // are known to work.
    lock.lock().expect("lock").unlock().expect("unlock");
    let guard = lock.lock().expect("lock");
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut server.conn())
        .expect("SCRIPT FLUSH");
    let _: () = redis::cmd("ACL")
        .arg("LOG")
        .arg("RESET")
        .query(&mut server.conn())
        .expect("ACL LOG RESET");
    let evals = server.command_calls("eval");
    drop(guard);
    // The next request reads the NOSCRIPT and sends the release again.
    let other = DistributedLock::with_options(&client, "locks:other", options);
    other.lock().expect("lock").unlock().expect("unlock");
    assert!(
        wait_until(Duration::from_secs(10), || !exists(&server, "locks:behind")),
        "the release was sent again"
    );
    assert!(server.command_calls("eval") > evals, "by EVAL");
    let denied = acl_denials(&server);
    assert!(denied.is_empty(), "the server refused: {denied:?}");
}
