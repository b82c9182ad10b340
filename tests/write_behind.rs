//! A guard dropped without `unlock()` writes its release behind: the
//! owner-checked release is sent and the drop returns; the reply is read by
//! the next request on that connection, in the same round trip. These tests
//! force every way that can go wrong through the fault proxy and check that
//! the lock is still released: the reply lost, the request lost, the script
//! cache flushed, a server that never answers, a process that exits right
//! after the drop.

use redmutex_test_support as support;

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use redmutex::Lease;
use redmutex::{DistributedLock, LockClient, LockKind, LockOptions, Release};
use support::{FaultProxy, RedisServer, exists, sha, wait_until};

const RELEASE: &str = include_str!("../lua/release.lua");
const ROLE: &str = "REDMUTEX_TEST_ROLE";
const URL: &str = "REDMUTEX_TEST_URL";

fn options() -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_secs(60))
        .wait(Duration::from_secs(5))
}

/// A client through `proxy` with a long I/O timeout, so a release that
/// waited for its reply would visibly wait.
fn client(proxy: &FaultProxy, timeout: Duration) -> LockClient {
    LockClient::builder()
        .url(proxy.url())
        .timeout(timeout)
        .build()
        .expect("client")
}

/// The first release of a client is synchronous (it learns that scripts
/// work); after it, drops write behind.
fn primed(lock: &DistributedLock) {
    lock.lock().expect("lock").unlock().expect("unlock");
}

/// A server with the scripts loaded (so a fault armed on the release hits
/// a command that ran), a proxy, a client through it, and a primed lock.
fn behind_a_proxy(key: &str) -> (RedisServer, FaultProxy, LockClient, DistributedLock) {
    let server = RedisServer::start();
    support::load_scripts(&server);
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy, Duration::from_secs(2));
    let lock = DistributedLock::with_options(&client, key, options());
    primed(&lock);
    (server, proxy, client, lock)
}

fn release_calls(server: &RedisServer) -> u64 {
    server.command_calls("evalsha") + server.command_calls("eval")
}

#[test]
fn a_dropped_guard_does_not_wait_for_the_reply() {
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy, Duration::from_secs(30));
    let lock = DistributedLock::with_options(&client, "wb:fast", options());
    primed(&lock);
    let (locked, go) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
    let dropped = Arc::new(AtomicBool::new(false));
    let thread = {
        let (dropped, lock) = (dropped.clone(), lock.clone());
        let (locked, go) = (locked.0, go.1);
        std::thread::spawn(move || {
            let guard = lock.lock().expect("lock");
            locked.send(()).expect("tell");
            go.recv().expect("go");
            drop(guard);
            dropped.store(true, Ordering::SeqCst);
        })
    };
    locked.1.recv().expect("locked");
    // Nothing gets through until healed: a release that waited for its
    // reply would wait for the 30 s timeout.
    proxy.blackhole(true);
    go.0.send(()).expect("go");
    assert!(
        wait_until(Duration::from_secs(10), || dropped.load(Ordering::SeqCst)),
        "the drop returned while the link was silent"
    );
    thread.join().expect("thread");
    assert!(exists(&server, "wb:fast"), "held back by the proxy so far");
    proxy.blackhole(false);
    assert!(
        wait_until(Duration::from_secs(10), || !exists(&server, "wb:fast")),
        "the release was on its way and ran once delivered"
    );
    // Its reply is read with the next request on the connection, which
    // works as usual.
    let again = lock.try_lock().expect("try_lock");
    assert!(again.is_some(), "free again");
}

#[test]
fn the_next_lock_reads_the_owed_reply_and_takes_the_key() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::with_options(&client, "wb:loop", options());
    primed(&lock);
    let before = release_calls(&server);
    for _ in 0..50 {
        let guard = lock.try_lock().expect("try_lock");
        // The release written behind runs before the next SET on the same
        // connection: the key is always free again.
        assert!(guard.is_some(), "the previous drop's release ran first");
    }
    drop(lock.try_lock().expect("try_lock"));
    assert_eq!(release_calls(&server) - before, 51, "one release per drop");
    let stats = client.stats().kind(LockKind::Mutex);
    assert_eq!((stats.errors_total(), stats.losses), (0, 0), "{stats:?}");
    // The last release's reply is still owed; it is read when the client
    // goes, before its connections close.
    drop(lock);
    drop(client);
    assert!(!exists(&server, "wb:loop"));
}

#[test]
fn a_lost_reply_on_an_owed_release_leaves_nothing_behind() {
    let (server, proxy, client, lock) = behind_a_proxy("wb:lost");
    let guard = lock.lock().expect("lock");
    // The release runs in Redis, and the connection is cut before its
    // reply gets back.
    proxy.lose_reply(&sha(RELEASE), 1);
    drop(guard);
    assert!(wait_until(Duration::from_secs(10), || proxy.lost_replies() == 1));
    assert!(!exists(&server, "wb:lost"), "it ran");
    // The next request on that connection finds it gone (the owed reply is
    // logged as "release outcome unknown"), and is resent on a fresh one.
    let other = DistributedLock::with_options(&client, "wb:other", options());
    let held = other.lock().expect("lock on a fresh connection");
    held.unlock().expect("unlock");
    let again = lock.try_lock().expect("try_lock");
    assert!(again.is_some());
}

#[test]
fn a_lost_owed_release_is_sent_again_in_the_background() {
    let (server, proxy, client, lock) = behind_a_proxy("wb:dropped");
    let guard = lock.lock().expect("lock");
    // The release never reaches Redis: its connection is cut first.
    proxy.drop_request(&sha(RELEASE), 1);
    drop(guard);
    assert!(wait_until(Duration::from_secs(10), || {
        proxy.dropped_requests() == 1
    }));
    assert!(exists(&server, "wb:dropped"), "nothing ran yet");
    // The next user of the connection finds it gone: the release's outcome
    // is unknown, so the token goes to the cleanup, which releases it
    // (owner-checked) long before its 60 s ttl.
    let other = DistributedLock::with_options(&client, "wb:other", options());
    other.lock().expect("lock").unlock().expect("unlock");
    assert!(
        wait_until(Duration::from_secs(10), || !exists(&server, "wb:dropped")),
        "the cleanup released it"
    );
    assert!(wait_until(Duration::from_secs(10), || client
        .stats()
        .orphans_released
        >= 1));
}

#[test]
fn noscript_in_an_owed_reply_sends_the_release_again() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::with_options(&client, "wb:flushed", options());
    primed(&lock);
    let guard = lock.lock().expect("lock");
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut server.conn())
        .expect("SCRIPT FLUSH");
    drop(guard);
    // The EVALSHA met NOSCRIPT and did not run.
    assert!(exists(&server, "wb:flushed"));
    // The next request reads the NOSCRIPT and writes the release again, by
    // EVAL; the one after reads that reply.
    let other = DistributedLock::with_options(&client, "wb:other", options());
    other.lock().expect("lock").unlock().expect("unlock");
    assert!(
        wait_until(Duration::from_secs(10), || !exists(&server, "wb:flushed")),
        "the release was sent again"
    );
    assert!(server.command_calls("eval") >= 1, "by EVAL");
    assert!(lock.try_lock().expect("try_lock").is_some());
}

#[test]
fn a_release_nobody_reads_is_read_when_the_client_goes() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::with_options(&client, "wb:last", options());
    primed(&lock);
    drop(lock.lock().expect("lock"));
    let owed = release_calls(&server);
    drop(lock);
    drop(client);
    assert!(!exists(&server, "wb:last"));
    assert!(release_calls(&server) >= owed);
}

#[test]
fn unlock_and_watch_releases_stay_synchronous() {
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy, Duration::from_millis(500));
    let lock = DistributedLock::with_options(&client, "wb:sync", options());
    primed(&lock);
    // unlock() waits for and reports the answer: with the link silent it
    // cannot say "released".
    let guard = lock.lock().expect("lock");
    proxy.blackhole(true);
    let unlocked = guard.unlock();
    assert!(unlocked.is_err(), "{unlocked:?}");
    proxy.heal();
    assert!(wait_until(Duration::from_secs(10), || !exists(
        &server, "wb:sync"
    )));
    // A WATCH release is two round trips with a decision between them: a
    // drop runs it synchronously.
    let watch =
        DistributedLock::with_options(&client, "wb:watch", options().release(Release::Watch));
    let before = server.command_calls("watch");
    drop(watch.lock().expect("lock"));
    assert_eq!(server.command_calls("watch") - before, 1);
    assert!(
        !exists(&server, "wb:watch"),
        "released before drop returned"
    );
}

/// A process that exits right after a drop (no destructor runs) still
/// releases: the bytes left before the drop returned.
#[test]
fn a_process_exiting_right_after_a_drop_still_releases() {
    if std::env::var(ROLE).as_deref() == Ok("dropper") {
        let url = std::env::var(URL).expect("url from the parent");
        let client = LockClient::open(&url).expect("client");
        let lock = DistributedLock::with_options(&client, "wb:exit", options());
        primed(&lock);
        drop(lock.lock().expect("lock"));
        // SAFETY: `_exit` ends the process at once, running nothing else:
        // no destructor reads the owed reply.
        unsafe { libc::_exit(0) };
    }
    let server = RedisServer::start();
    let status = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "a_process_exiting_right_after_a_drop_still_releases",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, "dropper")
        .env(URL, server.url())
        .status()
        .expect("run the dropper");
    assert!(status.success(), "{status:?}");
    // Acquired with a 60 s ttl: gone at once only if the release ran.
    assert!(
        wait_until(Duration::from_secs(5), || !exists(&server, "wb:exit")),
        "released"
    );
    // The priming unlock (after a NOSCRIPT, perhaps) and the drop's.
    assert!(server.command_calls("evalsha") >= 2);
}

/// `NOSCRIPT` in an owed reply makes the release go again by `EVAL`, after
/// the request that read it: that request still gets its own reply. (A
/// second round of reading in the same request once handed it the `EVAL`'s
/// reply: an `RwLock` "acquired" that Redis never granted.)
#[test]
fn the_request_that_reads_a_noscript_gets_its_own_reply() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::with_options(&client, "wb:flush", options());
    primed(&lock);
    let rw = redmutex::RwLock::new(&client, "wb:rw");
    drop(rw.write().expect("load the rw scripts"));
    let guard = lock.lock().expect("lock");
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut server.conn())
        .expect("SCRIPT FLUSH");
    drop(guard);
    // The rw acquisition goes out on the connection owing the NOSCRIPT; it
    // meets NOSCRIPT itself, loads its script and sends again.
    let writer = rw.try_write().expect("try_write");
    assert!(writer.is_some(), "free");
    assert!(
        exists(&server, "wb:rw"),
        "granted in Redis, not only locally"
    );
    drop(writer);
    assert!(wait_until(Duration::from_secs(10), || !exists(
        &server, "wb:flush"
    )));
}

/// A release written behind that nobody reads (its connection left idle
/// in the pool) is checked by the cleanup once a resend window has passed:
/// here the script cache was flushed, so the release never ran.
#[test]
fn an_owed_release_nobody_reads_is_checked_in_the_background() {
    let server = RedisServer::start();
    let client = LockClient::builder()
        .url(server.url())
        .timeout(Duration::from_millis(500))
        .build()
        .expect("client");
    let lock = DistributedLock::with_options(&client, "wb:idle", options());
    primed(&lock);
    let guard = lock.lock().expect("lock");
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut server.conn())
        .expect("SCRIPT FLUSH");
    let dropped = std::time::Instant::now();
    drop(guard);
    assert!(exists(&server, "wb:idle"), "the EVALSHA met NOSCRIPT");
    // Nothing else uses the client: the idle connection is read 20 ms
    // after the write, and the NOSCRIPT acted on; at the latest the
    // deferred check (three timeouts, at least 1 s: 1.5 s here) finds the
    // reply unread and the cleanup releases the token at its first step.
    // The slack is that of a deadline the watchdog computes.
    let limit = Duration::from_millis(1500) + Duration::from_millis(60);
    assert!(
        wait_until(limit, || !exists(&server, "wb:idle")),
        "still held {:?} after the drop",
        dropped.elapsed()
    );
    eprintln!(
        "bound | an owed release nobody reads | worst {:?} over 1 run | limit {limit:?}",
        dropped.elapsed()
    );
}

/// A waiter of another client gets its turn: once a release reaches a
/// subscriber, the holder's drops release synchronously (a release
/// written behind lets the same thread take the key again before any
/// waiter elsewhere could).
#[test]
fn a_thread_dropping_in_a_loop_does_not_starve_other_clients() {
    let server = RedisServer::start();
    let looper = server.lock_client();
    let waiter = server.lock_client();
    let hot = DistributedLock::with_options(&looper, "wb:hot", options());
    primed(&hot);
    let got = Arc::new(AtomicBool::new(false));
    let thread = {
        let (got, waiter) = (got.clone(), waiter.clone());
        std::thread::spawn(move || {
            let lock = DistributedLock::with_options(
                &waiter,
                "wb:hot",
                options().wait(Duration::from_secs(20)),
            );
            let guard = lock.lock();
            got.store(guard.is_ok(), Ordering::SeqCst);
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut cycles = 0u32;
    while !got.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
        if let Some(guard) = hot.try_lock().expect("try_lock") {
            drop(guard);
            cycles += 1;
        }
    }
    thread.join().expect("waiter");
    assert!(
        got.load(Ordering::SeqCst),
        "the other client's waiter got it ({cycles} cycles)"
    );
}

fn markers(server: &RedisServer, key: &str) -> usize {
    let found: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{{{key}}}:released:*"))
        .query(&mut server.conn())
        .expect("KEYS");
    found.len()
}

/// Once a release reaches a subscriber (a waiter elsewhere), the lock's
/// drops release synchronously (the release leaves its marker before the
/// drop returns) until a release reaches nobody again; then they write
/// behind (no marker) once more.
#[test]
fn drops_release_synchronously_while_others_wait() {
    let server = RedisServer::start();
    let client = server.lock_client();
    // A handle per call, as in `DistributedLock::new(&client, key).lock()`:
    // what the last release found is kept per client and key, not per handle.
    let lock = || DistributedLock::with_options(&client, "wb:waited", options());
    let mut subscriber = server.conn();
    let _: () = redis::cmd("SUBSCRIBE")
        .arg(client.release_channel("wb:waited"))
        .query(&mut subscriber)
        .expect("SUBSCRIBE");
    primed(&lock());
    let after_unlock = markers(&server, "wb:waited");
    assert_eq!(after_unlock, 1, "unlock leaves its marker");
    drop(lock().lock().expect("lock"));
    assert_eq!(
        markers(&server, "wb:waited"),
        2,
        "a waiter was reached: released synchronously, marker and all"
    );
    drop(subscriber);
    assert!(wait_until(Duration::from_secs(10), || {
        support::numsub(&server, &client.release_channel("wb:waited")) == 0
    }));
    // A synchronous release that reaches nobody turns writing behind on.
    drop(lock().lock().expect("lock"));
    drop(lock().lock().expect("lock"));
    let before = markers(&server, "wb:waited");
    drop(lock().lock().expect("lock"));
    drop(lock().try_lock().expect("read the owed reply"));
    assert_eq!(
        markers(&server, "wb:waited"),
        before,
        "written behind: no marker"
    );
}

/// A connection handed to the caller owes nothing: a release written
/// behind on it is read first, so the caller's own transaction gets its
/// own replies only.
#[test]
fn a_connection_handed_out_owes_nothing() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = DistributedLock::with_options(&client, "wb:mine", options());
    primed(&lock);
    drop(lock.lock().expect("lock"));
    let mut con = client.connection().expect("connection");
    let replies: (String, Option<String>) = redis::pipe()
        .atomic()
        .cmd("SET")
        .arg("wb:plain")
        .arg("v")
        .cmd("GET")
        .arg("wb:plain")
        .query(&mut con)
        .expect("MULTI/EXEC");
    assert_eq!(replies, ("OK".to_owned(), Some("v".to_owned())));
    let single: String = redis::cmd("PING").query(&mut con).expect("PING");
    assert_eq!(single, "PONG");
    assert!(!exists(&server, "wb:mine"), "the owed release ran");
}

// A semaphore permit dropped without `release()` writes its release behind
// the same way: `lua/sem_release.lua` without a marker.

const SEM_RELEASE: &str = include_str!("../lua/sem_release.lua");

fn permit_calls(server: &RedisServer) -> u64 {
    server.command_calls("evalsha") + server.command_calls("eval")
}

/// A semaphore of one permit on `key` (so a permit still in Redis would
/// refuse the next), primed: its first release is synchronous.
fn semaphore(client: &LockClient, key: &str) -> redmutex::Semaphore {
    let semaphore =
        redmutex::Semaphore::with_options(client, key, 1, options().with_extra(Default::default()));
    semaphore
        .acquire()
        .expect("acquire")
        .release()
        .expect("release");
    semaphore
}

fn permits_in(server: &RedisServer, key: &str) -> usize {
    let fields: Vec<String> = redis::cmd("HKEYS")
        .arg(key)
        .query(&mut server.conn())
        .expect("HKEYS");
    fields.iter().filter(|f| f.starts_with("p:")).count()
}

#[test]
fn a_dropped_permit_does_not_wait_for_the_reply() {
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy, Duration::from_secs(30));
    let semaphore = semaphore(&client, "wbp:fast");
    let permit = semaphore.acquire().expect("acquire");
    // Nothing gets through until healed: a release that waited for its
    // reply would wait for the 30 s timeout.
    proxy.blackhole(true);
    let (done, dropped) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        drop(permit);
        done.send(()).expect("tell");
    });
    assert!(
        dropped.recv_timeout(Duration::from_secs(10)).is_ok(),
        "the drop returned while the link was silent"
    );
    thread.join().expect("thread");
    assert_eq!(permits_in(&server, "wbp:fast"), 1, "held back so far");
    proxy.blackhole(false);
    assert!(
        wait_until(Duration::from_secs(10), || permits_in(&server, "wbp:fast")
            == 0),
        "the release was on its way and ran once delivered"
    );
    assert!(semaphore.try_acquire().expect("try_acquire").is_some());
}

#[test]
fn dropped_permits_are_released_behind_one_script_each() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let semaphore = semaphore(&client, "wbp:loop");
    let before = permit_calls(&server);
    for _ in 0..50 {
        // The release written behind runs before the next acquisition on
        // the same connection: the one permit is always free again.
        let permit = semaphore.try_acquire().expect("try_acquire");
        assert!(permit.is_some(), "the previous drop's release ran first");
    }
    drop(semaphore.try_acquire().expect("try_acquire"));
    // 51 acquisitions and 51 releases, none of them sent twice.
    assert_eq!(permit_calls(&server) - before, 102);
    assert_eq!(
        markers(&server, "wbp:loop"),
        1,
        "only the priming release's"
    );
    let stats = client.stats().kind(LockKind::Semaphore);
    assert_eq!((stats.errors_total(), stats.losses), (0, 0), "{stats:?}");
    drop(semaphore);
    drop(client);
    assert!(!exists(&server, "wbp:loop"), "read when the client went");
}

#[test]
fn a_lost_reply_on_an_owed_permit_release_leaves_nothing_behind() {
    let server = RedisServer::start();
    support::load_scripts(&server);
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy, Duration::from_secs(2));
    let semaphore = semaphore(&client, "wbp:lost");
    let permit = semaphore.acquire().expect("acquire");
    // The release runs in Redis, and the connection is cut before its
    // reply gets back.
    proxy.lose_reply(&sha(SEM_RELEASE), 1);
    drop(permit);
    assert!(wait_until(Duration::from_secs(10), || proxy.lost_replies() == 1));
    assert_eq!(permits_in(&server, "wbp:lost"), 0, "it ran");
    // The next request on that connection finds it gone and is resent on
    // a fresh one; the permit is free.
    assert!(semaphore.acquire().is_ok());
}

#[test]
fn a_lost_owed_permit_release_is_sent_again_in_the_background() {
    let server = RedisServer::start();
    support::load_scripts(&server);
    let proxy = FaultProxy::to(&server);
    let client = client(&proxy, Duration::from_secs(2));
    let semaphore = semaphore(&client, "wbp:dropped");
    let permit = semaphore.acquire().expect("acquire");
    // The release never reaches Redis: its connection is cut first.
    proxy.drop_request(&sha(SEM_RELEASE), 1);
    drop(permit);
    assert!(wait_until(Duration::from_secs(10), || {
        proxy.dropped_requests() == 1
    }));
    assert_eq!(permits_in(&server, "wbp:dropped"), 1, "nothing ran yet");
    // The next user of the connection finds it gone: the outcome is
    // unknown, so the permit goes to the cleanup, which releases it
    // (owner-checked) long before its 60 s ttl.
    let other = DistributedLock::with_options(&client, "wbp:other", options());
    other.lock().expect("lock").unlock().expect("unlock");
    assert!(
        wait_until(Duration::from_secs(10), || permits_in(
            &server,
            "wbp:dropped"
        ) == 0),
        "the cleanup released it"
    );
    assert!(wait_until(Duration::from_secs(10), || client
        .stats()
        .orphans_released
        >= 1));
    assert!(semaphore.try_acquire().expect("try_acquire").is_some());
}

#[test]
fn noscript_in_an_owed_permit_reply_sends_the_release_again() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let semaphore = semaphore(&client, "wbp:flushed");
    let permit = semaphore.acquire().expect("acquire");
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut server.conn())
        .expect("SCRIPT FLUSH");
    drop(permit);
    // The EVALSHA met NOSCRIPT and did not run.
    assert_eq!(permits_in(&server, "wbp:flushed"), 1);
    // The next request reads the NOSCRIPT and writes the release again,
    // by EVAL with the permit's script.
    let other = DistributedLock::with_options(&client, "wbp:other", options());
    other.lock().expect("lock").unlock().expect("unlock");
    assert!(
        wait_until(Duration::from_secs(10), || permits_in(
            &server,
            "wbp:flushed"
        ) == 0),
        "the release was sent again"
    );
    assert!(server.command_calls("eval") >= 1, "by EVAL");
    assert!(semaphore.try_acquire().expect("try_acquire").is_some());
}

/// A permit dropped after it was lost in Redis (its field deleted by hand)
/// frees nothing: the release written behind finds it gone (the holder who
/// took its place keeps theirs), and the loss is counted.
#[test]
fn an_owed_permit_release_that_finds_it_gone_frees_nothing() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let semaphore = semaphore(&client, "wbp:gone");
    let permit = semaphore.acquire().expect("acquire");
    let field = format!("p:{}", permit.id());
    let _: () = redis::cmd("HDEL")
        .arg("wbp:gone")
        .arg(&field)
        .query(&mut server.conn())
        .expect("HDEL");
    // Another holder takes the place the lost permit had.
    let other_client = server.lock_client();
    let other = redmutex::Semaphore::with_options(
        &other_client,
        "wbp:gone",
        1,
        options().with_extra(Default::default()),
    );
    let theirs = other.try_acquire().expect("try_acquire").expect("free");
    drop(permit);
    // The next request reads the owed reply ("not held").
    drop(semaphore.try_acquire().expect("try_acquire"));
    assert_eq!(permits_in(&server, "wbp:gone"), 1, "theirs is kept");
    assert!(
        wait_until(Duration::from_secs(10), || {
            client.stats().kind(LockKind::Semaphore).losses >= 1
        }),
        "counted as lost"
    );
    theirs.release().expect("theirs is still held");
}

/// Once a permit's release reaches a subscriber (a waiter elsewhere),
/// drops release synchronously (leaving their marker) until a release
/// reaches nobody again; then they write behind once more.
#[test]
fn permit_drops_release_synchronously_while_others_wait() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let semaphore = semaphore(&client, "wbp:waited");
    let mut subscriber = server.conn();
    let _: () = redis::cmd("SUBSCRIBE")
        .arg(client.release_channel("wbp:waited"))
        .query(&mut subscriber)
        .expect("SUBSCRIBE");
    // The first drop writes behind and learns the release reached someone.
    drop(semaphore.acquire().expect("acquire"));
    drop(semaphore.try_acquire().expect("read the owed reply"));
    let before = markers(&server, "wbp:waited");
    drop(semaphore.acquire().expect("acquire"));
    assert_eq!(
        markers(&server, "wbp:waited"),
        before + 1,
        "a waiter was reached: released synchronously, marker and all"
    );
    drop(subscriber);
    assert!(wait_until(Duration::from_secs(10), || {
        support::numsub(&server, &client.release_channel("wbp:waited")) == 0
    }));
    // A synchronous release that reaches nobody turns writing behind on.
    drop(semaphore.acquire().expect("acquire"));
    drop(semaphore.acquire().expect("acquire"));
    let before = markers(&server, "wbp:waited");
    drop(semaphore.acquire().expect("acquire"));
    drop(semaphore.try_acquire().expect("read the owed reply"));
    assert_eq!(
        markers(&server, "wbp:waited"),
        before,
        "written behind: no marker"
    );
}

/// Two threads of one client drop permits of a semaphore of two in a loop
/// (nobody waits, so every drop may write behind) while the link loses
/// the releases' replies, loses the releases themselves, resets every
/// connection, and the script cache is flushed. Every worker keeps finding
/// a place (a permit never outlives its drop by more than the cleanup's
/// round), no error but the link's reaches the callers, and once the
/// client is gone nothing is left in Redis.
#[test]
fn permits_dropped_under_faults_leave_nothing_and_never_block() {
    let server = RedisServer::start();
    support::load_scripts(&server);
    let proxy = Arc::new(FaultProxy::to(&server));
    let client = client(&proxy, Duration::from_secs(1));
    let semaphore = redmutex::Semaphore::with_options(
        &client,
        "wbp:faults",
        2,
        options()
            .wait(Duration::from_secs(20))
            .with_extra(Default::default()),
    );
    semaphore
        .acquire()
        .expect("acquire")
        .release()
        .expect("prime");
    let done = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let (semaphore, done) = (semaphore.clone(), done.clone());
            std::thread::spawn(move || {
                let mut taken = 0u32;
                for _ in 0..200_000 {
                    if done.load(Ordering::SeqCst) {
                        break;
                    }
                    match semaphore.acquire() {
                        Ok(permit) => {
                            taken += 1;
                            drop(permit);
                        }
                        // A reset or a lost reply can fail one attempt;
                        // the next one must still find a place.
                        Err(err) if err.is_connection() => {}
                        Err(err) => panic!("acquire: {err}"),
                    }
                }
                taken
            })
        })
        .collect();
    // Each fault once in every 40 ms, 25 rounds.
    let mut admin = server.conn();
    for round in 0..100u32 {
        match round % 4 {
            0 => proxy.lose_reply(&sha(SEM_RELEASE), 1),
            1 => proxy.drop_request(&sha(SEM_RELEASE), 1),
            2 => proxy.reset_all(),
            _ => {
                let _: redis::RedisResult<()> = redis::cmd("SCRIPT").arg("FLUSH").query(&mut admin);
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    done.store(true, Ordering::SeqCst);
    let taken: Vec<u32> = workers
        .into_iter()
        .map(|w| w.join().expect("worker"))
        .collect();
    println!(
        "permits taken {taken:?}; {} replies lost, {} requests dropped",
        proxy.lost_replies(),
        proxy.dropped_requests()
    );
    assert!(
        proxy.lost_replies() >= 1 && proxy.dropped_requests() >= 1,
        "the faults met releases: {} replies lost, {} requests dropped",
        proxy.lost_replies(),
        proxy.dropped_requests()
    );
    assert!(
        taken.iter().all(|t| *t >= 50),
        "every worker kept finding a place: {taken:?}"
    );
    proxy.heal();
    drop(semaphore);
    drop(client);
    assert!(
        wait_until(Duration::from_secs(20), || !exists(&server, "wbp:faults")),
        "nothing left once the client is gone"
    );
}

/// Drops write behind only on a connection the server answered within the
/// last 500 ms: a lock held 400 ms is released behind (the drop returns
/// at once on a silent link), one held 600 ms synchronously (the drop
/// waits for its reply on the silent link, a timeout at least).
#[test]
fn a_drop_writes_behind_only_on_a_connection_answered_within_500_ms() {
    let timeout = Duration::from_secs(1);
    for (hold, behind) in [(400, true), (600, false)] {
        let server = RedisServer::start();
        let proxy = FaultProxy::to(&server);
        let client = client(&proxy, timeout);
        let lock = DistributedLock::with_options(&client, "wb:fresh", options());
        primed(&lock);
        let guard = lock.lock().expect("lock");
        std::thread::sleep(Duration::from_millis(hold));
        proxy.blackhole(true);
        let started = std::time::Instant::now();
        drop(guard);
        let took = started.elapsed();
        proxy.heal();
        if behind {
            assert!(took < timeout / 2, "held {hold} ms: the drop took {took:?}");
        } else {
            assert!(took >= timeout, "held {hold} ms: the drop took {took:?}");
        }
    }
}

/// At most 32 replies are owed on one connection: 33 drops in a row on a
/// client with one connection write the first 32 behind, and the 33rd
/// reads the oldest reply first (here, on a silent link, it waits for it
/// a timeout), so memory stays bounded however many guards go at once.
#[test]
fn the_33rd_release_written_behind_on_one_connection_reads_the_first_reply() {
    let timeout = Duration::from_secs(1);
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = LockClient::builder()
        .url(proxy.url())
        .timeout(timeout)
        .pool_size(1)
        .build()
        .expect("client");
    primed(&DistributedLock::with_options(
        &client,
        "wb:owed-first",
        options(),
    ));
    let guards: Vec<_> = (0..33)
        .map(|n| {
            DistributedLock::with_options(&client, format!("wb:owed-{n}"), options())
                .lock()
                .expect("lock")
        })
        .collect();
    proxy.blackhole(true);
    let mut took = Vec::new();
    for guard in guards {
        let started = std::time::Instant::now();
        drop(guard);
        took.push(started.elapsed());
    }
    proxy.heal();
    let (first, last) = took.split_at(32);
    assert!(
        first.iter().all(|took| *took < timeout / 2),
        "written behind: {first:?}"
    );
    assert!(last[0] >= timeout, "the 33rd read a reply first: {last:?}");
}
