//! `fork()`: a child gets a copy of its parent's memory (clients, guards,
//! thread-local holds, the reentrant owner id) but none of its threads.
//! The child's locks must be its own: a fresh client works there, and
//! nothing inherited acts at all. The tests of this binary run one at a
//! time (`support::serial`), so no other test's thread holds a lock of
//! the crate's statics at the moment of a fork.
#![cfg(unix)]

use redmutex_test_support as support;

use std::io::{BufRead, BufReader, Write};
use std::time::{Duration, Instant};

use redmutex::Lease;
use redmutex::{
    Backoff, DistributedLock, Error, LockClient, LockOptions, RedLock, ReentrantLock, RwLock,
    Semaphore, Unlocked,
};
use support::{RedisServer, get};

/// What the child checks; its exit code is the first that failed (0: none).
fn in_child(server: &RedisServer, inherited: &LockClient) -> i32 {
    // A fresh client: its own connection-opening threads and owner id.
    let fresh = match LockClient::open(&server.url()) {
        Ok(client) => client,
        Err(_) => return 10,
    };
    match ReentrantLock::new(&fresh, "fork:reentrant").try_lock() {
        Ok(None) => {}
        Ok(Some(_)) => return 11, // the parent's hold taken as the child's
        Err(_) => return 12,
    }
    // No connection for a client built in the child: 13.
    match DistributedLock::new(&fresh, "fork:child").lock() {
        Ok(guard) => {
            if guard.unlock().is_err() {
                return 13;
            }
        }
        Err(_) => return 13,
    }
    // The inherited client: never a nested guard of the parent's lease.
    match DistributedLock::new(inherited, "fork:plain").try_lock() {
        Err(Error::InvalidArgument(message)) if message.contains("fork") => {}
        Ok(Some(_)) => return 14,
        _ => return 15,
    }
    match ReentrantLock::new(inherited, "fork:reentrant").try_lock() {
        Err(Error::InvalidArgument(_)) => {}
        _ => return 16,
    }
    0
}

#[test]
fn a_forked_child_has_its_own_identity_and_threads_and_never_the_parents_locks() {
    let _serial = support::serial();
    let server = RedisServer::start();
    let client = server.lock_client();
    let plain = DistributedLock::new(&client, "fork:plain")
        .lock()
        .expect("plain");
    let reentrant = ReentrantLock::new(&client, "fork:reentrant")
        .lock()
        .expect("reentrant");
    let token = plain.token().to_owned();

    // SAFETY: the child uses the crate as a program would after fork (no
    // lock of the parent's threads is needed: the crate makes its own
    // threads again), and ends with _exit, running no destructor of the
    // parent's copy but the guard it drops on purpose.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork");
    if child == 0 {
        let mut code = in_child(&server, &client);
        // Dropping the inherited guards must change nothing in Redis.
        drop(plain);
        drop(reentrant);
        if code == 0 && get(&server, "fork:plain").as_deref() != Some(token.as_str()) {
            code = 17;
        }
        // SAFETY: ends the child without the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: reaps our own child.
    let reaped = unsafe { libc::waitpid(child, &mut status, 0) };
    assert_eq!(reaped, child);
    assert!(libc::WIFEXITED(status), "the child ended by a signal");
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "the child's first failed check"
    );

    assert_eq!(get(&server, "fork:plain").as_deref(), Some(token.as_str()));
    plain.unlock().expect("the parent's lock is still its own");
    assert!(matches!(reentrant.unlock(), Ok(Unlocked::Released)));
    assert!(
        !support::exists(&server, "fork:reentrant"),
        "released, not StillHeld"
    );
}

/// Waits for `child` to end, at most `within`: its wait status, or `None`
/// (it is then killed).
fn reap_within(child: libc::pid_t, within: Duration) -> Option<libc::c_int> {
    let deadline = Instant::now() + within;
    loop {
        let mut status = 0;
        // SAFETY: reaps our own child without blocking.
        let reaped = unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) };
        if reaped == child {
            return Some(status);
        }
        if Instant::now() >= deadline {
            // SAFETY: our own child, stuck.
            unsafe {
                libc::kill(child, libc::SIGKILL);
                libc::waitpid(child, &mut status, 0);
            }
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The server's connections: (address, name), by `CLIENT LIST`.
fn connections(server: &RedisServer) -> Vec<String> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut server.conn())
        .expect("CLIENT LIST");
    let mut addresses: Vec<String> = list
        .lines()
        .filter(|line| !line.contains("cmd=client|list") && !line.contains("cmd=monitor"))
        .filter_map(|line| {
            line.split_whitespace()
                .find_map(|field| field.strip_prefix("addr="))
                .map(str::to_owned)
        })
        .collect();
    addresses.sort();
    addresses
}

/// Every command the server runs while it lives, with the address of the
/// connection that sent it (`MONITOR`).
struct Monitor {
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    stream: std::net::TcpStream,
}

impl Monitor {
    fn start(server: &RedisServer) -> Monitor {
        let mut stream =
            std::net::TcpStream::connect(("127.0.0.1", server.port())).expect("connect");
        stream
            .write_all(b"*1\r\n$7\r\nMONITOR\r\n")
            .expect("MONITOR");
        let mut reader = BufReader::new(stream.try_clone().expect("clone"));
        let mut ok = String::new();
        reader.read_line(&mut ok).expect("+OK");
        assert!(ok.starts_with("+OK"), "{ok}");
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = lines.clone();
        std::thread::spawn(move || {
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 0) {
                seen.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(line.trim_end().to_owned());
                line.clear();
            }
        });
        Monitor { lines, stream }
    }

    /// The commands seen so far, from now on counted afresh.
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.lines.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// What the child does with everything it inherited; its exit code is the
/// first check that failed (0: none). Nothing here may reach Redis, lock a
/// lock a parent thread may have held, or join a thread: each call must
/// refuse, or do nothing, at once.
fn inert_in_child(world: World) -> i32 {
    let refused = |result: Result<(), Error>| matches!(result, Err(Error::InvalidArgument(message)) if message.contains("fork"));
    let World {
        client,
        other,
        plain,
        nested,
        watched,
        reentrant,
        read,
        write,
        permit,
        redlock,
        connection,
        lock,
        semaphore,
    } = world;
    if !nested.validity().is_zero() || !nested.is_lost() || !watched.validity().is_zero() {
        return 20; // a lease that claims to be held in the child
    }
    // A loss signal of the parent's lease, its guard's Debug, an extension:
    // none waits for a lock of the parent's or claims the lease.
    let signal = watched.loss_signal();
    if signal.reason() != Some(redmutex::LossReason::Inherited)
        || signal.wait_timeout(Duration::from_secs(30)).is_none()
    {
        return 29;
    }
    let _ = format!("{watched:?} {nested:?} {client:?} {permit:?}");
    let mut watched = watched;
    if !matches!(
        watched.extend(Duration::from_secs(60)),
        Err(Error::InvalidArgument(_))
    ) {
        return 30;
    }
    // The checked-out connection: nothing goes out on the parent's socket.
    let mut connection = connection;
    if redis::cmd("PING").query::<String>(&mut connection).is_ok() {
        return 31;
    }
    // A lock handle made in the child from the inherited client refuses.
    if !matches!(
        DistributedLock::new(&client, "fork:new").try_lock(),
        Err(Error::InvalidArgument(_))
    ) {
        return 32;
    }
    if !refused(nested.unlock().map(drop)) {
        return 21; // a nested guard's share given up as if it were the child's
    }
    if !refused(plain.unlock().map(drop)) {
        return 22; // the parent's lease released, or handed to a parent thread
    }
    if !refused(watched.unlock().map(drop)) {
        return 23;
    }
    if !reentrant.validity().is_zero()
        || !reentrant.is_lost()
        || !matches!(reentrant.unlock(), Err(Error::InvalidArgument(_)))
    {
        return 24;
    }
    let mut write = write;
    if !read.validity().is_zero()
        || !read.is_lost()
        || read.is_held().is_ok()
        || !refused(write.extend(Duration::from_secs(60)))
        || !refused(write.downgrade())
        || !refused(read.unlock().map(drop))
        || !refused(write.unlock().map(drop))
    {
        return 25;
    }
    if !permit.validity().is_zero() || !permit.is_lost() || !refused(permit.release()) {
        return 26;
    }
    if !redlock.validity().is_zero()
        || !redlock.is_lost()
        || redlock.is_held().is_ok()
        || !refused(redlock.unlock().map(drop))
    {
        return 27;
    }
    if !matches!(lock.try_lock(), Err(Error::InvalidArgument(_)))
        || !matches!(semaphore.try_acquire(), Err(Error::InvalidArgument(_)))
        || !matches!(client.connection(), Err(Error::InvalidArgument(_)))
    {
        return 28;
    }
    // The drops: a checked-out connection, the handles, and the last
    // clone of a client whose subscriber and watchdog threads run in the
    // parent (and not here).
    drop(connection);
    drop((lock, semaphore));
    drop(client);
    drop(other);
    0
}

/// Everything of the parent's the child is given.
struct World {
    client: LockClient,
    /// A client with no clone on another thread: its last clone is
    /// dropped in the child.
    other: LockClient,
    plain: redmutex::LockGuard,
    nested: redmutex::LockGuard,
    watched: redmutex::LockGuard,
    reentrant: redmutex::ReentrantGuard,
    read: redmutex::RwGuard,
    write: redmutex::RwGuard,
    permit: redmutex::Permit,
    redlock: redmutex::RedLockGuard,
    connection: redmutex::Connection,
    lock: DistributedLock,
    semaphore: Semaphore,
}

/// On f63675e an inherited guard's `unlock()` in a forked child answered
/// `Ok(())` (the lease "handed" to a parent thread queued in the copied
/// memory) after sending a `GET` on one of the parent's pooled sockets,
/// and dropping the child's copy of a client shut down the parent's
/// subscriber connection. Here the child is given every kind of object
/// alive: guards of every lock type (held, nested, watched), a thread of
/// the client queued for a lease a guard holds, a thread waiting on a key
/// held elsewhere (the subscriber connected), a release written behind
/// whose reply is still owed, a checked-out connection, lock handles and
/// clients. The parent then checks, by `MONITOR` and `CLIENT LIST`, that
/// the child sent nothing on any of its connections and closed none, and
/// that everything still works in the parent.
#[test]
fn everything_inherited_through_fork_is_inert_in_the_child() {
    let _serial = support::serial();
    let server = RedisServer::start();
    // Quiet while the child runs: no heartbeat (it speaks after a silent
    // timeout), no renewal (at a third of the ttl), no waiter polling.
    let quiet = |builder: redmutex::LockClientBuilder| {
        builder
            .url(server.url())
            .timeout(Duration::from_secs(30))
            .build()
            .expect("client")
    };
    let client = quiet(LockClient::builder());
    let other = quiet(LockClient::builder());
    let elsewhere = server.lock_client();
    // A handoff budget longer than the test: a lease is passed on after
    // holds of any length.
    let long = LockOptions::default()
        .ttl(Duration::from_secs(60))
        .wait(Duration::from_secs(20))
        .backoff(Backoff::constant(Duration::from_secs(30)))
        .handoff_budget(redmutex::HandoffBudget::new(256, Duration::from_secs(60)));
    let lease = redmutex::Options::default().ttl(Duration::from_secs(60));

    // A release written behind on `other`, its reply not read yet: the
    // first release of a client is synchronous, the next drop writes
    // behind.
    let owed = DistributedLock::with_options(&other, "fork:owed", long);
    owed.lock().expect("lock").unlock().expect("unlock");
    drop(owed.lock().expect("lock"));
    drop(owed);

    // `other`'s subscriber connected (a waiter woken by a release message
    // came and went), with no clone of `other` left on another thread.
    let sub = DistributedLock::with_options(&other, "fork:sub", long);
    let held_elsewhere = DistributedLock::new(&elsewhere, "fork:sub")
        .lock()
        .expect("held elsewhere");
    let woken = std::thread::spawn(move || sub.lock().map(|guard| guard.unlock()));
    assert!(support::wait_until(Duration::from_secs(10), || {
        support::numsub(&server, &other.release_channel("fork:sub")) >= 1
    }));
    held_elsewhere.unlock().expect("unlock");
    woken
        .join()
        .expect("woken")
        .expect("the waiter got it")
        .expect("and released it");

    // `plain` handed over from another thread, some milliseconds ago.
    let lock = DistributedLock::with_options(&client, "fork:plain", long);
    let (taken_tx, taken) = std::sync::mpsc::channel();
    let giver = {
        let lock = lock.clone();
        std::thread::spawn(move || {
            let guard = lock.lock().expect("giver");
            let _ = taken_tx.send(());
            std::thread::sleep(Duration::from_millis(100));
            guard.unlock()
        })
    };
    taken.recv().expect("the giver took it");
    let plain = lock.lock().expect("plain");
    giver.join().expect("giver").expect("handed on");
    std::thread::sleep(Duration::from_millis(5));
    let nested = lock.lock().expect("nested");
    // Queued behind `plain` in this client: a handoff would go to it.
    let queued = {
        let lock = lock.clone();
        std::thread::spawn(move || lock.lock().map(|guard| guard.unlock()))
    };
    // Waiting on a key held by another client: subscribed, asleep.
    let theirs = DistributedLock::new(&elsewhere, "fork:theirs")
        .lock()
        .expect("theirs");
    let subscribed = {
        let lock = DistributedLock::with_options(&client, "fork:theirs", long);
        std::thread::spawn(move || lock.lock().map(|guard| guard.unlock()))
    };
    let watched = DistributedLock::with_options(&other, "fork:watched", long.watchdog(true))
        .lock()
        .expect("watched");
    let reentrant = ReentrantLock::with_options(&client, "fork:reentrant", lease)
        .lock()
        .expect("reentrant");
    let read = RwLock::with_options(&client, "fork:read", lease.with_extra(Default::default()))
        .read()
        .expect("read");
    let write = RwLock::with_options(&client, "fork:write", lease.with_extra(Default::default()))
        .write()
        .expect("write");
    let semaphore = Semaphore::with_options(
        &client,
        "fork:sem",
        2,
        lease.with_extra(redmutex::SemaphoreExtra::default()),
    );
    let permit = semaphore.acquire().expect("permit");
    let redlock = RedLock::with_options(
        vec![client.clone()],
        "fork:redlock",
        lease.with_extra(Default::default()),
    )
    .expect("redlock")
    .lock()
    .expect("redlock guard");
    let connection = client.connection().expect("connection");
    // Both waiters asleep, and the subscriber's subscription confirmed.
    assert!(support::wait_until(Duration::from_secs(10), || {
        support::numsub(&server, &client.release_channel("fork:theirs")) >= 1
    }));
    std::thread::sleep(Duration::from_millis(200));

    let before = connections(&server);
    let monitor = Monitor::start(&server);
    // The monitor sees a parent connection's command, by its address.
    let mut connection = connection;
    let _: String = redis::cmd("ECHO")
        .arg("fork-probe")
        .query(&mut connection)
        .expect("ECHO");
    assert!(support::wait_until(Duration::from_secs(5), || {
        monitor
            .lines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|line| {
                line.contains("fork-probe")
                    && before.iter().any(|address| line.contains(address.as_str()))
            })
    }));
    monitor.take();
    let world = World {
        client: client.clone(),
        other,
        plain,
        nested,
        watched,
        reentrant,
        read,
        write,
        permit,
        redlock,
        connection,
        lock: lock.clone(),
        semaphore: semaphore.clone(),
    };
    // SAFETY: the child only uses what it inherited through the crate's
    // API (which must refuse or do nothing there), and ends with _exit.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork");
    if child == 0 {
        let code = inert_in_child(world);
        // SAFETY: ends the child without the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    let status = reap_within(child, Duration::from_secs(10));
    let status = status.expect("the child hung (a lock or a join of the parent's)");
    assert!(libc::WIFEXITED(status), "the child ended by a signal");
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "the child's first failed check"
    );
    // MONITOR shows each command when it runs: give a late one time.
    std::thread::sleep(Duration::from_millis(200));
    let sent: Vec<String> = monitor
        .take()
        .into_iter()
        .filter(|line| before.iter().any(|address| line.contains(address.as_str())))
        .collect();
    assert!(
        sent.is_empty(),
        "the child sent on the parent's connections: {sent:?}"
    );
    assert_eq!(
        connections(&server),
        before,
        "a connection of the parent's closed"
    );
    drop(monitor);

    // Everything still the parent's, and working.
    let World {
        client: _,
        other,
        plain,
        nested,
        watched,
        reentrant,
        read,
        write,
        permit,
        redlock,
        connection,
        lock: _,
        semaphore: _,
    } = world;
    drop(connection);
    nested.unlock().expect("nested");
    plain.unlock().expect("plain: handed to the queued thread");
    queued
        .join()
        .expect("queued")
        .expect("the queued thread got the lease")
        .expect("and released it");
    theirs.unlock().expect("theirs");
    // Woken by the release message (the subscriber's connection works),
    // not by its 30 s backoff.
    let woken = Instant::now();
    subscribed
        .join()
        .expect("subscribed")
        .expect("the waiter got the lock")
        .expect("and released it");
    assert!(
        woken.elapsed() < Duration::from_secs(10),
        "{:?}",
        woken.elapsed()
    );
    watched.unlock().expect("watched");
    assert!(matches!(reentrant.unlock(), Ok(Unlocked::Released)));
    read.unlock().expect("read");
    write.unlock().expect("write");
    permit.release().expect("permit");
    redlock.unlock().expect("redlock");
    drop(other);
    for key in [
        "fork:owed",
        "fork:sub",
        "fork:plain",
        "fork:theirs",
        "fork:watched",
        "fork:reentrant",
        "fork:read",
        "fork:write",
        "fork:sem",
        "fork:redlock",
    ] {
        assert!(
            support::wait_until(Duration::from_secs(5), || !support::exists(&server, key)),
            "{key} left behind"
        );
    }
}
