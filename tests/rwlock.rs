//! The read-write lock: readers share, writers exclude, crashed readers
//! expire alone, writers are not starved, a reader releases only itself.

use redmutex_test_support as support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use redis::Commands;
use redmutex::Lease;
use redmutex::{Error, LossReason, RwLock};
use support::{RedisServer, wait_until};

fn fields(server: &RedisServer, key: &str) -> Vec<String> {
    let map: std::collections::HashMap<String, String> =
        server.conn().hgetall(key).expect("HGETALL");
    let mut names: Vec<String> = map.into_keys().collect();
    names.sort();
    names
}

#[test]
fn readers_overlap_and_writers_exclude_everything() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = RwLock::new(&client, "rw");
    let r1 = lock.read().expect("read");
    let r2 = lock.try_read().expect("try").expect("readers share");
    let r3 = lock.read().expect("read");
    assert!(
        lock.try_write().expect("try").is_none(),
        "a writer waits for readers"
    );
    assert_eq!(fields(&server, "rw").len(), 3, "one field per reader");
    drop((r1, r2));
    assert!(lock.try_write().expect("try").is_none());
    r3.unlock().expect("unlock");
    let w = lock.try_write().expect("try").expect("free now");
    assert!(w.is_write());
    assert!(
        lock.try_read().expect("try").is_none(),
        "the writer excludes readers"
    );
    assert!(lock.try_write().expect("try").is_none(), "and writers");
    w.unlock().expect("unlock");
    let exists: bool = server.conn().exists("rw").expect("EXISTS");
    assert!(!exists, "an empty lock leaves no key");
}

#[test]
fn a_crashed_reader_expires_alone() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let short = RwLock::with_options(
        &client,
        "crash",
        redmutex::Options::default().ttl(Duration::from_millis(300)),
    );
    let long = RwLock::with_options(
        &client,
        "crash",
        redmutex::Options::default().ttl(Duration::from_secs(30)),
    );
    let crashed = short.read().expect("read");
    let crashed_field = format!("r:{}", crashed.token());
    std::mem::forget(crashed); // dies without releasing
    let alive = long.read().expect("read");
    let alive_field = format!("r:{}", alive.token());
    assert!(wait_until(Duration::from_secs(3), || {
        let _ = long.try_write().expect("try"); // runs the purge
        !fields(&server, "crash").contains(&crashed_field)
    }));
    assert!(
        fields(&server, "crash").contains(&alive_field),
        "the live reader is untouched"
    );
    assert!(
        long.try_write().expect("try").is_none(),
        "still read-locked by the live reader"
    );
    alive.unlock().expect("unlock");
    assert!(long.try_write().expect("try").is_some());
}

#[test]
fn one_reader_cannot_release_another() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = RwLock::new(&client, "own");
    let a = lock.read().expect("a");
    let b = lock.read().expect("b");
    let b_field = format!("r:{}", b.token());
    a.unlock().expect("a releases itself");
    assert!(
        fields(&server, "own").contains(&b_field),
        "b's hold survives a's release"
    );
    assert!(lock.try_write().expect("try").is_none());
    // The release script driven by hand with a token that is not b's removes nothing.
    let removed: i64 = redis::Script::new(include_str!("../lua/rw_release.lua"))
        .key("own")
        .arg("not-b")
        .arg("r")
        .arg("ch")
        .invoke(&mut server.conn())
        .expect("EVAL");
    assert_eq!(removed, 0);
    assert!(fields(&server, "own").contains(&b_field));
    b.unlock().expect("b");
}

#[test]
fn a_writer_is_not_starved_by_overlapping_readers() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let stop = Arc::new(AtomicBool::new(false));
    let reading = Arc::new(AtomicU32::new(0));
    let readers: Vec<_> = (0..4)
        .map(|_| {
            let lock = RwLock::with_options(
                &client,
                "busy",
                redmutex::Options::default().wait(Duration::from_secs(20)),
            );
            let (stop, reading) = (stop.clone(), reading.clone());
            std::thread::spawn(move || {
                let mut rounds = 0u32;
                while !stop.load(Ordering::Relaxed) && rounds < 10_000 {
                    let guard = lock.read().expect("read");
                    reading.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(5));
                    reading.fetch_sub(1, Ordering::Relaxed);
                    drop(guard);
                    rounds += 1;
                }
            })
        })
        .collect();
    assert!(wait_until(Duration::from_secs(5), || reading
        .load(Ordering::Relaxed)
        >= 2));
    let writer = RwLock::with_options(
        &client,
        "busy",
        redmutex::Options::default().wait(Duration::from_secs(10)),
    );
    let started = Instant::now();
    let guard = writer
        .write()
        .expect("the writer gets in despite the readers");
    let waited = started.elapsed();
    assert_eq!(
        reading.load(Ordering::Relaxed),
        0,
        "no reader inside with the writer"
    );
    drop(guard);
    stop.store(true, Ordering::Relaxed);
    for reader in readers {
        reader.join().expect("reader");
    }
    assert!(waited < Duration::from_secs(3), "writer waited {waited:?}");
}

#[test]
fn an_expired_writer_reports_it_and_a_plain_key_is_refused() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = RwLock::with_options(
        &client,
        "w",
        redmutex::Options::default().ttl(Duration::from_millis(100)),
    );
    let guard = lock.write().expect("write");
    assert!(wait_until(Duration::from_secs(3), || {
        let exists: bool = server.conn().exists("w").expect("EXISTS");
        !exists
    }));
    match guard.unlock() {
        Err(Error::NotHeld { reason, .. }) => assert_eq!(reason, LossReason::Expired),
        other => panic!("expected NotHeld(Expired), got {other:?}"),
    }
    let _: () = server.conn().set("plain", "x").expect("SET");
    match RwLock::new(&client, "plain").try_read() {
        Err(Error::WrongType { key }) => assert_eq!(key, "plain"),
        other => panic!("expected WrongType, got {other:?}"),
    }
}

#[test]
fn a_waiting_writer_holds_new_readers_back_unless_readers_are_preferred() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = RwLock::new(&client, "pref");
    let reader = lock.read().expect("read");
    let writer_lock = lock.clone();
    let writer = std::thread::spawn(move || {
        writer_lock
            .try_write_for(Duration::from_secs(10))
            .map(|g| g.map(|g| g.is_write()))
    });
    assert!(wait_until(Duration::from_secs(5), || {
        fields(&server, "pref").iter().any(|f| f.starts_with("q:"))
    }));
    assert!(lock.try_read().expect("try").is_none(), "writer preference");
    let eager = RwLock::with_options(&client, "pref", lock.options().prefer_readers(true));
    let extra = eager.try_read().expect("try").expect("readers preferred");
    drop(extra);
    drop(reader);
    assert_eq!(writer.join().expect("writer").expect("write"), Some(true));
}

#[test]
fn a_waiting_writer_wakes_on_the_readers_release_message() {
    let server = RedisServer::start();
    let readers = server.lock_client();
    let writers = server.lock_client();
    let reader = RwLock::new(&readers, "wake").read().expect("read");
    let slow = RwLock::with_options(
        &writers,
        "wake",
        redmutex::Options::default()
            .backoff(redmutex::Backoff::constant(Duration::from_secs(10)))
            .wait(Duration::from_secs(30)),
    );
    let writer = std::thread::spawn(move || {
        let guard = slow.write();
        (Instant::now(), guard.map(|g| g.is_write()))
    });
    let channel = readers.release_channel("wake");
    assert!(wait_until(Duration::from_secs(10), || {
        let (_, n): (String, u64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&channel)
            .query(&mut server.conn())
            .expect("NUMSUB");
        n >= 1
    }));
    std::thread::sleep(Duration::from_millis(50));
    let released = Instant::now();
    reader.unlock().expect("unlock");
    let (acquired, got) = writer.join().expect("writer");
    assert!(got.expect("write"));
    let lag = acquired.saturating_duration_since(released);
    assert!(
        lag < Duration::from_secs(1),
        "woke {lag:?} after the release (backoff 10 s)"
    );
}

/// `try_read_until` and `try_write_until`, as the other lock types'
/// `_until`: at least one attempt with a deadline already past, and no
/// wait past the deadline while the other side holds the lock.
#[test]
fn until_deadlines_are_kept_for_reads_and_writes() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = RwLock::new(&client, "rw-until");
    let past = Instant::now();
    let reader = lock.try_read_until(past).expect("read").expect("free");
    let started = Instant::now();
    let deadline = started + Duration::from_millis(150);
    let write = lock.try_write_until(deadline).expect("write");
    assert!(write.is_none(), "a reader holds it");
    assert!(Instant::now() >= deadline);
    reader.unlock().expect("unlock");
    let writer = lock.try_write_until(past).expect("write").expect("free");
    assert!(lock.try_read_until(past).expect("read").is_none());
    writer.unlock().expect("unlock");
}

/// The server's deadline of `field` in the hash, in ms from now.
fn left_ms(server: &RedisServer, key: &str, field: &str) -> i64 {
    let mut con = server.conn();
    let deadline: Option<i64> = con.hget(key, field).expect("HGET");
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query(&mut con).expect("TIME");
    deadline.map_or(-1, |d| d - (secs * 1000 + micros / 1000))
}

fn reader_field(guard: &redmutex::RwGuard) -> String {
    format!("r:{}", guard.token())
}

#[test]
fn readers_and_the_writer_extend_their_own_hold_only() {
    let server = RedisServer::start();
    let client = redmutex::LockClient::open(&server.url()).expect("client");
    let options = redmutex::Options::default().ttl(Duration::from_secs(2));
    let lock = RwLock::with_options(&client, "rw:extend", options);
    let mut first = lock.read().expect("read");
    let second = lock.read().expect("read");
    first.extend(Duration::from_secs(60)).expect("extend");
    assert!(left_ms(&server, "rw:extend", &reader_field(&first)) > 50_000);
    assert!(
        left_ms(&server, "rw:extend", &reader_field(&second)) <= 2_000,
        "the other reader's deadline is its own"
    );
    let pttl: i64 = server.conn().pttl("rw:extend").expect("PTTL");
    assert!(
        pttl > 50_000,
        "the hash lives as long as its latest deadline: {pttl}"
    );
    assert!(first.validity() > Duration::from_secs(50));
    assert!(first.is_held().expect("is_held"));
    // Never earlier: a shorter ttl leaves the deadline where it is.
    first.extend(Duration::from_secs(1)).expect("extend");
    assert!(left_ms(&server, "rw:extend", &reader_field(&first)) > 50_000);
    assert!(first.validity() > Duration::from_secs(50));
    second.unlock().expect("unlock");
    first.unlock().expect("unlock");

    let mut writer = lock.write().expect("write");
    writer.extend(Duration::from_secs(60)).expect("extend");
    assert!(left_ms(&server, "rw:extend", "wexp") > 50_000);
    assert!(writer.is_held().expect("is_held"));
    assert!(!writer.is_lost());
    writer.unlock().expect("unlock");
    assert!(
        !server
            .conn()
            .exists::<_, bool>("rw:extend")
            .expect("EXISTS")
    );
}

#[test]
fn an_extension_never_re_creates_a_hold_and_reports_the_loss() {
    let server = RedisServer::start();
    let client = redmutex::LockClient::open(&server.url()).expect("client");
    let lock = RwLock::new(&client, "rw:gone");
    let mut reader = lock.read().expect("read");
    let signal = reader.loss_signal();
    let field = reader_field(&reader);
    let _: () = server.conn().hdel("rw:gone", &field).expect("HDEL");
    assert!(!reader.is_held().expect("is_held"));
    let err = reader.extend(Duration::from_secs(30)).expect_err("gone");
    assert!(
        matches!(
            err,
            Error::NotHeld {
                reason: LossReason::Expired,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(reader.is_lost());
    assert_eq!(reader.validity(), Duration::ZERO);
    assert!(
        signal.wait_timeout(Duration::from_secs(1)).is_some(),
        "fired"
    );
    let fields: Vec<String> = server.conn().hkeys("rw:gone").expect("HKEYS");
    assert!(!fields.contains(&field), "not re-created: {fields:?}");
    drop(reader);

    // A writer whose token was replaced by another writer's.
    let mut writer = lock.write().expect("write");
    let _: () = server
        .conn()
        .hset("rw:gone", "w", "another-writer")
        .expect("HSET");
    assert!(!writer.is_held().expect("is_held"));
    let err = writer
        .extend(Duration::from_secs(30))
        .expect_err("replaced");
    assert!(
        matches!(
            err,
            Error::NotHeld {
                reason: LossReason::OwnedByOther,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(writer.is_lost());
    let owner: Option<String> = server.conn().hget("rw:gone", "w").expect("HGET");
    assert_eq!(owner.as_deref(), Some("another-writer"), "left alone");
}

#[test]
fn a_bad_ttl_or_another_types_key_changes_nothing() {
    let server = RedisServer::start();
    let client = redmutex::LockClient::open(&server.url()).expect("client");
    let lock = RwLock::new(&client, "rw:bad");
    let mut reader = lock.read().expect("read");
    let field = reader_field(&reader);
    let before = left_ms(&server, "rw:bad", &field);
    for ttl in [Duration::ZERO, Duration::MAX] {
        let err = reader.extend(ttl).expect_err("refused");
        assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    }
    assert!(left_ms(&server, "rw:bad", &field) <= before);
    assert!(!reader.is_lost());
    // The hash turned into another type's: refused, nothing written.
    let _: () = server.conn().hset("rw:bad", "limit", 3).expect("HSET");
    let err = reader.extend(Duration::from_secs(60)).expect_err("foreign");
    assert!(matches!(err, Error::WrongType { .. }), "{err:?}");
    assert!(!err.to_string().contains(reader.token()), "{err}");
    assert!(left_ms(&server, "rw:bad", &field) <= before);
    let _: () = server.conn().del("rw:bad").expect("DEL");
}

#[test]
fn an_extension_whose_reply_is_lost_is_sent_again() {
    let server = RedisServer::start();
    let proxy = support::FaultProxy::to(&server);
    let client = redmutex::LockClient::open(&proxy.url()).expect("client");
    let options = redmutex::Options::default().ttl(Duration::from_secs(2));
    let mut writer = RwLock::with_options(&client, "rw:lossy", options)
        .write()
        .expect("write");
    writer
        .extend(Duration::from_secs(20))
        .expect("loads the script");
    proxy.lose_reply(&support::sha(include_str!("../lua/rw_extend.lua")), 1);
    writer.extend(Duration::from_secs(60)).expect("sent again");
    assert_eq!(proxy.lost_replies(), 1, "the fault fired");
    assert!(left_ms(&server, "rw:lossy", "wexp") > 50_000);
    assert!(writer.validity() > Duration::from_secs(50));
    writer.unlock().expect("unlock");
}

/// A hash made persistent from outside keeps no expiry: an extension
/// never sets one from its own deadline alone, which could end another
/// reader's hold sooner.
#[test]
fn an_extension_never_cuts_another_readers_hold_through_the_hash_expiry() {
    let server = RedisServer::start();
    let client = redmutex::LockClient::open(&server.url()).expect("client");
    let short = RwLock::with_options(
        &client,
        "rw:persisted",
        redmutex::Options::default().ttl(Duration::from_millis(500)),
    );
    let long = RwLock::with_options(
        &client,
        "rw:persisted",
        redmutex::Options::default().ttl(Duration::from_secs(60)),
    );
    let mut first = short.read().expect("read");
    let second = long.read().expect("read");
    let _: () = redis::cmd("PERSIST")
        .arg("rw:persisted")
        .query(&mut server.conn())
        .expect("PERSIST");
    first.extend(Duration::from_millis(600)).expect("extend");
    let pttl: i64 = server.conn().pttl("rw:persisted").expect("PTTL");
    assert_eq!(pttl, -1, "no expiry set from one holder's deadline");
    assert!(left_ms(&server, "rw:persisted", &reader_field(&second)) > 50_000);
    assert!(second.is_held().expect("is_held"));
    first.unlock().expect("unlock");
    second.unlock().expect("unlock");
}

/// `is_held` is a read: its lost reply is asked again, for the writer and
/// for a reader.
#[test]
fn is_held_whose_reply_is_lost_is_asked_again() {
    let server = RedisServer::start();
    let proxy = support::FaultProxy::to(&server);
    let client = redmutex::LockClient::open(&proxy.url()).expect("client");
    let lock = RwLock::new(&client, "rw:asked");
    let writer = lock.write().expect("write");
    proxy.lose_reply("wexp", 1);
    assert!(writer.is_held().expect("asked again"));
    assert_eq!(proxy.lost_replies(), 1, "the fault fired");
    writer.unlock().expect("unlock");
    let reader = lock.read().expect("read");
    proxy.lose_reply(&reader_field(&reader), 1);
    assert!(reader.is_held().expect("asked again"));
    assert_eq!(proxy.lost_replies(), 2, "the fault fired");
    reader.unlock().expect("unlock");
}

/// The hash's fields and values.
fn hash(server: &RedisServer, key: &str) -> std::collections::HashMap<String, String> {
    server.conn().hgetall(key).expect("HGETALL")
}

/// A writer downgrades while another writer waits: at no moment is the
/// key without this holder (a sampler reads the hash throughout), no
/// writer gets in while the read hold lives, new readers still wait
/// behind the queued writer, and the writer gets the lock once the reader
/// lets go.
#[test]
fn a_downgrade_keeps_a_waiting_writer_out_until_the_reader_leaves() {
    let server = RedisServer::start();
    let (a_client, b_client) = (server.lock_client(), server.lock_client());
    let key = "rw:down";
    let mut a = RwLock::new(&a_client, key).write().expect("write");
    let token = a.token().to_owned();
    let reader = format!("r:{token}");
    let b_got = Arc::new(AtomicBool::new(false));
    let writer = {
        let lock = RwLock::with_options(
            &b_client,
            key,
            redmutex::Options::default().wait(Duration::from_secs(30)),
        );
        let b_got = b_got.clone();
        std::thread::spawn(move || {
            let guard = lock.write();
            b_got.store(true, Ordering::SeqCst);
            guard.map(|g| (g.is_write(), g.unlock().is_ok()))
        })
    };
    assert!(
        wait_until(Duration::from_secs(10), || {
            fields(&server, key).iter().any(|f| f.starts_with("q:"))
        }),
        "the second writer queues"
    );
    // Samples the hash until told to stop: each sample must show this
    // holder (as the writer or as its reader), and never its reader
    // alongside a writer.
    let stop = Arc::new(AtomicBool::new(false));
    let samples = Arc::new(AtomicU32::new(0));
    let sampler = {
        let (stop, samples) = (stop.clone(), samples.clone());
        let (token, reader) = (token.clone(), reader.clone());
        let mut con = server.conn();
        std::thread::spawn(move || {
            let mut bad = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(30);
            while !stop.load(Ordering::SeqCst) && Instant::now() < deadline {
                let map: std::collections::HashMap<String, String> =
                    con.hgetall(key).expect("HGETALL");
                let writing = map.get("w") == Some(&token);
                let reading = map.contains_key(&reader);
                if !writing && !reading {
                    bad.push(format!("holder absent: {map:?}"));
                }
                if reading && map.contains_key("w") {
                    bad.push(format!("a writer beside the reader: {map:?}"));
                }
                samples.fetch_add(1, Ordering::SeqCst);
            }
            bad
        })
    };
    assert!(wait_until(Duration::from_secs(5), || samples
        .load(Ordering::SeqCst)
        >= 20));
    a.downgrade().expect("downgrade");
    assert!(!a.is_write());
    assert_eq!(a.fencing_token(), None);
    assert!(a.is_held().expect("is_held"));
    let map = hash(&server, key);
    assert!(map.contains_key(&reader), "a reads now: {map:?}");
    assert!(
        !map.contains_key("w") && !map.contains_key("wexp"),
        "{map:?}"
    );
    assert!(
        map.keys().any(|f| f.starts_with("q:")),
        "the waiting writer stays queued: {map:?}"
    );
    let reading_from = samples.load(Ordering::SeqCst);
    // While a reads, the writer stays out (bounded look: the sampler
    // checks every sample meanwhile), and new readers wait behind it.
    assert!(
        !wait_until(Duration::from_millis(500), || b_got.load(Ordering::SeqCst)),
        "a writer got in beside the reader"
    );
    assert!(
        RwLock::new(&a_client, key)
            .try_read()
            .expect("try")
            .is_none(),
        "writer preference holds after the downgrade"
    );
    assert!(wait_until(Duration::from_secs(5), || samples
        .load(Ordering::SeqCst)
        >= reading_from + 20));
    stop.store(true, Ordering::SeqCst);
    let bad = sampler.join().expect("sampler");
    assert!(
        bad.is_empty(),
        "{} bad samples: {:?}",
        bad.len(),
        &bad[..bad.len().min(3)]
    );
    a.unlock().expect("unlock the read hold");
    let (is_write, unlocked) = writer
        .join()
        .expect("writer")
        .expect("the writer gets the lock once the reader leaves");
    assert!(is_write && unlocked);
    assert!(!support::exists(&server, key));
}

#[test]
fn a_downgrade_lets_other_readers_in() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = RwLock::new(&client, "rw:share");
    let mut writer = lock.write().expect("write");
    assert!(lock.try_read().expect("try").is_none());
    writer.downgrade().expect("downgrade");
    let other = lock.try_read().expect("try").expect("readers share now");
    assert!(
        lock.try_write().expect("try").is_none(),
        "two readers hold it"
    );
    assert!(left_ms(&server, "rw:share", &reader_field(&writer)) > 0);
    other.unlock().expect("unlock");
    writer.unlock().expect("unlock");
    assert!(!support::exists(&server, "rw:share"));
}

#[test]
fn a_downgrade_of_a_lost_write_hold_reports_the_loss() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = RwLock::new(&client, "rw:lost");
    let mut gone = lock.write().expect("write");
    let _: () = server.conn().del("rw:lost").expect("DEL");
    let err = gone.downgrade().expect_err("gone");
    assert_eq!(err.not_held_reason(), Some(LossReason::Expired), "{err:?}");
    assert!(gone.is_lost());
    assert!(!support::exists(&server, "rw:lost"), "nothing re-created");
    drop(gone);

    let mut replaced = lock.write().expect("write");
    let _: () = server
        .conn()
        .hset("rw:lost", "w", "another-writer")
        .expect("HSET");
    let err = replaced.downgrade().expect_err("replaced");
    assert_eq!(
        err.not_held_reason(),
        Some(LossReason::OwnedByOther),
        "{err:?}"
    );
    assert!(replaced.is_lost());
    let map = hash(&server, "rw:lost");
    assert_eq!(map.get("w").map(String::as_str), Some("another-writer"));
    assert!(!map.keys().any(|f| f.starts_with("r:")), "{map:?}");
}

#[test]
fn a_read_hold_cannot_be_downgraded() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let lock = RwLock::new(&client, "rw:reader");
    let mut reader = lock.read().expect("read");
    let before = hash(&server, "rw:reader");
    let err = reader.downgrade().expect_err("a reader");
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert_eq!(hash(&server, "rw:reader"), before, "nothing changed");
    assert!(!reader.is_lost());
    reader.unlock().expect("still held");
}

#[test]
fn a_watched_downgraded_hold_is_renewed_as_a_reader() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let ttl = Duration::from_millis(300);
    let lock = RwLock::with_options(
        &client,
        "rw:watched",
        redmutex::Options::default().ttl(ttl).watchdog(true),
    );
    let mut guard = lock.write().expect("write");
    guard.downgrade().expect("downgrade");
    let field = reader_field(&guard);
    let deadline = |server: &RedisServer| -> i64 {
        let value: Option<i64> = server.conn().hget("rw:watched", &field).expect("HGET");
        value.unwrap_or(0)
    };
    let first = deadline(&server);
    assert!(first > 0, "the reader's field is there");
    // Renewed well past several ttls, and never seen lost meanwhile.
    assert!(
        wait_until(Duration::from_secs(10), || {
            assert!(!guard.is_lost(), "lost while renewed");
            deadline(&server) > first + 4 * 300
        }),
        "the reader's deadline moves on"
    );
    assert!(left_ms(&server, "rw:watched", &field) > 0);
    let pttl: i64 = server.conn().pttl("rw:watched").expect("PTTL");
    assert!(pttl > 0, "the hash lives: {pttl}");
    assert!(!fields(&server, "rw:watched").contains(&"w".to_owned()));
    assert!(guard.validity() > Duration::ZERO);
    guard.unlock().expect("unlock");
    assert!(!support::exists(&server, "rw:watched"));
}

const RW_DOWNGRADE: &str = include_str!("../lua/rw_downgrade.lua");

/// The downgrade's reply is lost once: the resend answers "downgraded"
/// and changes nothing more.
#[test]
fn a_downgrade_whose_reply_is_lost_is_sent_again() {
    let server = RedisServer::start();
    support::load_scripts(&server);
    let proxy = support::FaultProxy::to(&server);
    let client = redmutex::LockClient::open(&proxy.url()).expect("client");
    let lock = RwLock::new(&client, "rw:lossy-down");
    let mut guard = lock.write().expect("write");
    proxy.lose_reply(&support::sha(RW_DOWNGRADE), 1);
    guard.downgrade().expect("sent again");
    assert_eq!(proxy.lost_replies(), 1, "the fault fired");
    assert!(!guard.is_write());
    let map = hash(&server, "rw:lossy-down");
    assert!(map.contains_key(&reader_field(&guard)), "{map:?}");
    assert!(!map.contains_key("w"), "{map:?}");
    guard.unlock().expect("unlock the read hold");
    assert!(!support::exists(&server, "rw:lossy-down"));
}

/// Every send of the downgrade loses its reply: the outcome is unknown.
/// The guard then claims neither hold; a downgrade sent again settles it,
/// and a release removes whatever the token holds.
#[test]
fn a_downgrade_of_unknown_outcome_is_settled_or_released_whole() {
    let server = RedisServer::start();
    support::load_scripts(&server);
    let proxy = support::FaultProxy::to(&server);
    let client = redmutex::LockClient::open(&proxy.url()).expect("client");
    let lock = RwLock::new(&client, "rw:unknown");

    let mut settled = lock.write().expect("write");
    proxy.lose_reply(&support::sha(RW_DOWNGRADE), 3);
    let err = settled.downgrade().expect_err("no reply");
    assert!(err.is_outcome_unknown(), "{err:?}");
    assert!(!settled.is_write());
    assert_eq!(settled.fencing_token(), None);
    assert!(settled.is_held().expect("held, one way or the other"));
    let err = settled
        .extend(Duration::from_secs(60))
        .expect_err("refused");
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    proxy.heal();
    settled.downgrade().expect("settled");
    assert!(!settled.is_write() && !settled.is_lost());
    let map = hash(&server, "rw:unknown");
    assert!(map.contains_key(&reader_field(&settled)), "{map:?}");
    assert!(!map.contains_key("w"), "{map:?}");
    settled.unlock().expect("unlock");
    assert!(!support::exists(&server, "rw:unknown"));

    let mut released = lock.write().expect("write");
    let token = released.token().to_owned();
    proxy.lose_reply(&support::sha(RW_DOWNGRADE), 3);
    let err = released.downgrade().expect_err("no reply");
    assert!(err.is_outcome_unknown(), "{err:?}");
    proxy.heal();
    released.unlock().expect("whatever it was, released");
    let map = hash(&server, "rw:unknown");
    assert!(
        !map.iter().any(|(k, v)| k.contains(&token) || v == &token),
        "no field of the token is left: {map:?}"
    );

    // The requests never reached Redis: still the write hold there, and
    // the release takes that out too.
    let mut unsent = lock.write().expect("write");
    proxy.drop_request(&support::sha(RW_DOWNGRADE), 3);
    let err = unsent.downgrade().expect_err("no reply");
    assert!(err.is_outcome_unknown(), "{err:?}");
    proxy.heal();
    assert_eq!(
        hash(&server, "rw:unknown").get("w"),
        Some(&unsent.token().to_owned())
    );
    assert!(!unsent.is_write(), "not claimed while unknown");
    assert!(unsent.is_held().expect("is_held"));
    unsent.unlock().expect("released");
    assert!(!support::exists(&server, "rw:unknown"));
}
