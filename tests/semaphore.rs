//! `Semaphore` (issue 13): at most N permits, the server's clock, the limit
//! stored with it, exactly once under lost replies.

use redmutex_test_support as support;

use std::time::{Duration, Instant};

use redis::Commands;
use redmutex::Lease;
use redmutex::{Error, LockClient, Semaphore, SemaphoreOptions};
use support::{FaultProxy, RedisServer, exists, sha, wait_until};

const SEM_ACQUIRE: &str = include_str!("../lua/sem_acquire.lua");
const SEM_RELEASE: &str = include_str!("../lua/sem_release.lua");

fn options() -> SemaphoreOptions {
    redmutex::Options::default()
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_secs(5))
}

#[test]
fn at_most_n_permits_and_a_release_lets_the_next_in() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let sem = Semaphore::with_options(&client, "exports", 3, options());
    let permits: Vec<_> = (0..3)
        .map(|_| sem.try_acquire().expect("try").expect("a permit"))
        .collect();
    assert!(
        sem.try_acquire().expect("try").is_none(),
        "a fourth is refused"
    );
    let len: usize = server.conn().hlen("exports").expect("HLEN");
    assert_eq!(len, 4, "three permits and the limit");
    let mut permits = permits.into_iter();
    let first = permits.next().expect("one");
    assert!(first.is_held().expect("is_held"));
    first.release().expect("release");
    let fourth = sem.try_acquire().expect("try").expect("a permit again");
    drop(fourth);
    drop(permits);
    // Dropped permits' releases are written behind: on their way.
    assert!(
        wait_until(Duration::from_secs(5), || !exists(&server, "exports")),
        "nothing outlives the last holder"
    );
}

#[test]
fn a_waiter_is_woken_by_a_release_in_another_client() {
    let server = RedisServer::start();
    let holder = server.lock_client();
    let waiter = server.lock_client();
    let one = Semaphore::with_options(&holder, "one", 1, options());
    let permit = one.acquire().expect("acquire");
    let waiting = std::thread::spawn({
        let sem = Semaphore::with_options(
            &waiter,
            "one",
            1,
            options().backoff(redmutex::Backoff::constant(Duration::from_secs(10))),
        );
        move || {
            let started = Instant::now();
            let permit = sem.acquire().expect("after the release");
            (started.elapsed(), permit.release())
        }
    });
    let channel = waiter.release_channel("one");
    assert!(wait_until(Duration::from_secs(5), || support::numsub(
        &server, &channel
    ) == 1));
    permit.release().expect("release");
    let (waited, released) = waiting.join().expect("waiter");
    released.expect("release");
    assert!(
        waited < Duration::from_secs(5),
        "woken, not polled: {waited:?}"
    );
}

#[test]
fn a_different_limit_is_a_clear_error_and_changes_nothing() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let three = Semaphore::with_options(&client, "gpu", 3, options());
    let permit = three.acquire().expect("acquire");
    let five = Semaphore::with_options(&client, "gpu", 5, options());
    match five.try_acquire() {
        Err(Error::InvalidArgument(message)) => assert!(message.contains('3'), "{message}"),
        other => panic!("expected a limit error, got {other:?}"),
    }
    let len: usize = server.conn().hlen("gpu").expect("HLEN");
    assert_eq!(len, 2, "nothing changed");
    // The explicit way: set_permits, for everyone.
    let mut five = five;
    five.set_permits(5).expect("set");
    assert!(matches!(
        three.try_acquire(),
        Err(Error::InvalidArgument(_))
    ));
    let second = five
        .try_acquire()
        .expect("try")
        .expect("under the new limit");
    drop(second);
    five.set_permits(3).expect("set back");
    permit.release().expect("release");
    // With no permit out, the new limit is taken.
    let five = Semaphore::with_options(&client, "gpu", 5, options());
    let permit = five.try_acquire().expect("try").expect("five now");
    let limit: String = server.conn().hget("gpu", "limit").expect("HGET");
    assert_eq!(limit, "5");
    drop(permit);
}

#[test]
fn bad_input_is_refused_before_anything_is_sent() {
    let server = RedisServer::start();
    let client = server.lock_client();
    for sem in [
        Semaphore::new(&client, "z", 0),
        Semaphore::new(&client, "", 2),
        Semaphore::with_options(&client, "z", 2, options().ttl(Duration::ZERO)),
        Semaphore::with_options(&client, "z", 2, options().ttl(Duration::MAX)),
    ] {
        assert!(
            matches!(sem.try_acquire(), Err(Error::InvalidArgument(_))),
            "{sem:?}"
        );
    }
    assert!(!exists(&server, "z"));
    let _: () = server.conn().set("str", "x").expect("SET");
    let wrong = Semaphore::new(&client, "str", 2);
    assert!(matches!(wrong.try_acquire(), Err(Error::WrongType { .. })));
}

/// A resent acquire recognises its own permit: with N = 1, a lost reply
/// followed by the resend must not be refused by (or add to) itself.
#[test]
fn a_resent_acquire_takes_one_permit_not_two() {
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    let sem = Semaphore::with_options(&client, "once", 2, options());
    proxy.lose_reply(&sha(SEM_ACQUIRE), 1);
    let permit = sem
        .try_acquire()
        .expect("try")
        .expect("acquired on the resend");
    assert_eq!(proxy.lost_replies(), 1);
    let len: usize = server.conn().hlen("once").expect("HLEN");
    assert_eq!(len, 2, "one permit (and the limit), not two");
    // A lost reply on the release: Ok, and the capacity is back exactly once.
    proxy.lose_reply(&sha(SEM_RELEASE), 1);
    permit.release().expect("release after a lost reply is Ok");
    assert_eq!(proxy.lost_replies(), 2);
    assert!(!exists(&server, "once"));
}

/// A duplicate release never adds capacity: releasing an id twice (the
/// second a late copy) leaves the other holders' count as it was.
#[test]
fn a_duplicate_release_adds_no_capacity() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let sem = Semaphore::with_options(&client, "dup", 2, options());
    let a = sem.try_acquire().expect("try").expect("a");
    let b = sem.try_acquire().expect("try").expect("b");
    let a_id = a.id().to_owned();
    a.release().expect("release");
    let c = sem.try_acquire().expect("try").expect("c takes a's place");
    // A late copy of a's release arrives.
    let (again, _): (i64, i64) = redis::Script::new(SEM_RELEASE)
        .key("dup")
        .arg(&a_id)
        .arg("ch")
        .arg(1000)
        .invoke(&mut server.conn())
        .expect("release again");
    assert_eq!(again, 0, "nothing of a's is left");
    assert!(sem.try_acquire().expect("try").is_none(), "still full");
    drop((b, c));
}

/// A holder that never releases (a crash) gives its permit back after its
/// lease, by the server's clock.
#[test]
fn an_abandoned_permit_comes_back_after_its_lease() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let short = Semaphore::with_options(
        &client,
        "crash",
        1,
        options().ttl(Duration::from_millis(300)),
    );
    let permit = short.try_acquire().expect("try").expect("permit");
    std::mem::forget(permit);
    assert!(short.try_acquire().expect("try").is_none());
    let started = Instant::now();
    let next = short
        .try_acquire_for(Duration::from_secs(5))
        .expect("try")
        .expect("back after the lease");
    assert!(started.elapsed() < Duration::from_secs(5));
    let mut next = next;
    next.extend(Duration::from_secs(10))
        .expect("extend a live permit");
    assert!(next.validity() > Duration::from_secs(5));
    next.release().expect("release");
}

/// The acquire script answers a resend of its own grant before it judges
/// the hash (as the first run answered), and a stored limit that is not a
/// number binds nothing: it is replaced, not called "no limit".
#[test]
fn the_acquire_script_answers_a_resend_first_and_replaces_a_bad_limit() {
    let server = RedisServer::start();
    let mut con = server.conn();
    let far = 4_000_000_000_000u64;
    let _: () = con
        .hset_multiple("odd", &[("p:me", far.to_string()), ("f:me", "42".into())])
        .expect("HSET");
    let acquire = redis::Script::new(SEM_ACQUIRE);
    let resent: (i64, i64, i64, Option<String>) = acquire
        .key("odd")
        .arg("me")
        .arg(3)
        .arg(30_000)
        .invoke(&mut con)
        .expect("a resend is answered");
    assert_eq!(resent, (1, 0, 42, None));
    let other: redis::RedisResult<(i64, i64, i64, Option<String>)> = acquire
        .key("odd")
        .arg("you")
        .arg(3)
        .arg(30_000)
        .invoke(&mut con);
    assert!(
        other.as_ref().is_err_and(|e| e.code() == Some("WRONGTYPE")),
        "{other:?}"
    );
    let _: () = con.hset("bad", "limit", "abc").expect("HSET");
    let granted: (i64, i64, i64, Option<String>) = acquire
        .key("bad")
        .arg("me")
        .arg(3)
        .arg(30_000)
        .invoke(&mut con)
        .expect("granted");
    assert_eq!(granted.0, 1);
    let limit: String = con.hget("bad", "limit").expect("HGET");
    assert_eq!(limit, "3", "the caller's limit replaces it");
}

/// Thousands of expired permits (crashed holders, never released) are
/// purged by the next acquisition in one run, their fencing tokens with
/// them, however many there are (`HDEL` in slices: Lua's `unpack` is
/// bounded).
#[test]
fn thousands_of_expired_permits_are_purged_by_one_acquisition() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let mut con = server.conn();
    let mut fields: Vec<(String, String)> = vec![("limit".into(), "3".into())];
    for n in 0..2_500 {
        // A deadline of 1 ms after the epoch: long past.
        fields.push((format!("p:dead{n}"), "1".into()));
        fields.push((format!("f:dead{n}"), format!("{n}")));
    }
    let _: () = con.hset_multiple("purged", &fields).expect("HSET");
    let _: () = con.pexpire("purged", 60_000).expect("PEXPIRE");
    let semaphore = Semaphore::with_options(&client, "purged", 3, options());
    let permit = semaphore.try_acquire().expect("try").expect("free");
    let left: usize = con.hlen("purged").expect("HLEN");
    assert_eq!(left, 2, "the limit and the new permit only");
    permit.release().expect("release");
    assert!(!exists(&server, "purged"), "gone with its last permit");
}

/// The other commands a permit sends, each with its reply lost once: a
/// renewal (safe: sets the deadline again, never re-creates), a limit change
/// (sets the same limit again) and the holder check (a read).
#[test]
fn extend_set_permits_and_is_held_survive_a_lost_reply() {
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    let mut sem = Semaphore::with_options(&client, "lost", 2, options());
    let mut permit = sem.try_acquire().expect("try").expect("permit");
    // Loaded first, so the lost reply is the script's own, after it ran.
    permit.extend(Duration::from_secs(20)).expect("extend");
    sem.set_permits(2).expect("set");
    proxy.lose_reply(&sha(include_str!("../lua/sem_extend.lua")), 1);
    permit
        .extend(Duration::from_secs(20))
        .expect("extend after a lost reply");
    assert_eq!(proxy.lost_replies(), 1);
    proxy.lose_reply(&sha(include_str!("../lua/sem_set_limit.lua")), 1);
    sem.set_permits(4).expect("set after a lost reply");
    assert_eq!(proxy.lost_replies(), 2);
    let limit: String = server.conn().hget("lost", "limit").expect("HGET");
    assert_eq!(limit, "4");
    proxy.lose_reply("HGET", 1);
    assert!(permit.is_held().expect("is_held after a lost reply"));
    assert_eq!(proxy.lost_replies(), 3);
    permit.release().expect("release");
    assert!(!exists(&server, "lost"));
}

/// The watchdog keeps a permit alive past its ttl, renewing it only while
/// it is present; a permit taken out of the hash is reported lost, and
/// released without a command (Redis already said it is gone).
#[test]
fn the_watchdog_renews_permits_and_reports_a_lost_one() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let sem = Semaphore::with_options(
        &client,
        "dog",
        2,
        options()
            .ttl(Duration::from_millis(600))
            .with_extra(redmutex::SemaphoreExtra::default())
            .watchdog(true),
    );
    assert!(sem.options().watchdog);
    let kept = sem.try_acquire().expect("try").expect("kept");
    let lost = sem.try_acquire().expect("try").expect("lost");
    let signal = lost.loss_signal();
    // The renewal script is reloaded after the server lost it.
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut server.conn())
        .expect("SCRIPT FLUSH");
    // Well past the ttl: both still there (renewed at ttl/3).
    std::thread::sleep(Duration::from_millis(1500));
    assert!(kept.is_held().expect("is_held"), "renewed past its ttl");
    assert!(!kept.is_lost() && !lost.is_lost());
    // Taken out behind the holder's back: the next renewal finds it gone
    // and does not put it back.
    let _: i64 = server
        .conn()
        .hdel("dog", format!("p:{}", lost.id()))
        .expect("HDEL");
    assert_eq!(
        signal.wait_timeout(Duration::from_secs(5)),
        Some(redmutex::LossReason::Expired)
    );
    assert!(lost.is_lost());
    assert_eq!(lost.validity(), Duration::ZERO);
    let field: Option<String> = server
        .conn()
        .hget("dog", format!("p:{}", lost.id()))
        .expect("HGET");
    assert_eq!(field, None, "a renewal never re-creates a permit");
    assert!(lost.release().expect_err("gone").is_not_held());
    assert!(kept.validity() > Duration::ZERO);
    kept.release().expect("release");
    assert!(!exists(&server, "dog"));
}

/// Fencing tokens: strictly increasing across permits and clients, the
/// same token for a resent acquire (lost reply), and a counter that cannot
/// be incremented refuses the permit and leaves nothing behind.
#[test]
fn permits_carry_increasing_fencing_tokens_even_across_a_lost_reply() {
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    let fenced = options()
        .with_extra(redmutex::SemaphoreExtra::default())
        .fencing(true);
    let sem = Semaphore::with_options(&client, "fenced", 3, fenced);
    let other = Semaphore::with_options(&server.lock_client(), "fenced", 3, fenced);
    let a = sem.try_acquire().expect("try").expect("a");
    let b = other.try_acquire().expect("try").expect("b");
    let (ta, tb) = (
        a.fencing_token().expect("a's"),
        b.fencing_token().expect("b's"),
    );
    assert!(tb > ta, "{tb} after {ta}");
    proxy.lose_reply(&sha(SEM_ACQUIRE), 1);
    let c = sem.try_acquire().expect("try").expect("c, on the resend");
    assert_eq!(proxy.lost_replies(), 1);
    let tc = c.fencing_token().expect("c's");
    assert!(tc > tb, "{tc} after {tb}");
    let counter: u64 = server.conn().get("{fenced}:fence").expect("GET");
    assert_eq!(counter, tc);
    drop((a, b, c));
    // Dropped permits' releases are written behind: on their way.
    assert!(
        wait_until(Duration::from_secs(5), || !exists(&server, "fenced")),
        "tokens leave with their permits"
    );
    assert!(exists(&server, "{fenced}:fence"), "the counter stays");
    // A counter that is not a number: a clear error, no permit.
    let _: () = server
        .conn()
        .set("{fenced}:fence", "not a number")
        .expect("SET");
    let err = sem.try_acquire().expect_err("unusable counter");
    assert!(matches!(err, Error::FenceCounter { .. }), "{err:?}");
    assert!(!exists(&server, "fenced"), "nothing granted");
    // Unfenced permits have no token.
    let plain = Semaphore::with_options(&client, "plain", 1, options());
    assert_eq!(
        plain
            .try_acquire()
            .expect("try")
            .expect("p")
            .fencing_token(),
        None
    );
}

/// `min_replicas`: with a replica the permit is granted after `WAIT`;
/// without one it is given back and the caller told, and nothing is left.
#[test]
fn min_replicas_gives_an_unreplicated_permit_back() {
    let primary = RedisServer::start();
    let client = primary.lock_client();
    let wanting = options()
        .with_extra(redmutex::SemaphoreExtra::default())
        .min_replicas(1, Duration::from_millis(200));
    let sem = Semaphore::with_options(&client, "replicated", 2, wanting);
    let err = sem.try_acquire().expect_err("no replica");
    assert!(
        matches!(
            err,
            Error::NotReplicated {
                acked: 0,
                wanted: 1,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(!exists(&primary, "replicated"), "given back");
    let replica = RedisServer::start_replica_of(&primary);
    // Once the replica has synced, WAIT counts it.
    let mut granted = None;
    assert!(wait_until(Duration::from_secs(10), || {
        granted = sem.try_acquire().ok().flatten();
        granted.is_some()
    }));
    let permit = granted.expect("replicated");
    assert!(wait_until(Duration::from_secs(5), || {
        replica
            .try_query::<Option<String>>(
                redis::cmd("HGET")
                    .arg("replicated")
                    .arg(format!("p:{}", permit.id())),
            )
            .flatten()
            .is_some()
    }));
    // A timeout the client cannot hear out: refused before anything is sent.
    let absurd = Semaphore::with_options(
        &client,
        "replicated",
        2,
        options()
            .with_extra(redmutex::SemaphoreExtra::default())
            .min_replicas(1, Duration::from_secs(3600)),
    );
    assert!(matches!(
        absurd.try_acquire(),
        Err(Error::InvalidArgument(_))
    ));
    permit.release().expect("release");
}

/// A permit given back while a thread of the same client waits goes
/// straight to it: the same id, no command to Redis, and the waiter holds
/// a live permit (renewed first when less than half its ttl is left).
#[test]
fn a_released_permit_goes_straight_to_a_waiting_thread_of_the_same_client() {
    let server = RedisServer::start();
    let client = server.lock_client();
    // A budget that a loaded machine cannot run out of between the grant
    // and the release.
    let sem = Semaphore::with_options(
        &client,
        "handoff",
        1,
        options()
            .with_extra(redmutex::SemaphoreExtra::default())
            .handoff_budget(redmutex::HandoffBudget::new(4, Duration::from_secs(60))),
    );
    // While its own threads hold every permit, a queued waiter waits for
    // them without a word to Redis, so when it is queued cannot be seen
    // from outside: try until a handoff happened (almost always at once).
    let mut handed = false;
    for _ in 0..20 {
        let permit = sem.acquire().expect("first");
        let id = permit.id().to_owned();
        let before = client.stats();
        let waiter = std::thread::spawn({
            let sem = sem.clone();
            move || {
                let permit = sem
                    .try_acquire_for(Duration::from_secs(10))
                    .expect("try")
                    .expect("handed over or granted");
                (permit.id().to_owned(), permit.validity(), permit.is_held())
            }
        });
        std::thread::sleep(Duration::from_millis(50));
        permit.release().expect("release");
        let (got, validity, held) = waiter.join().expect("waiter");
        let after = client.stats();
        assert!(held.expect("is_held"), "a live permit in Redis");
        if after.handoffs > before.handoffs {
            assert_eq!(after.handoffs - before.handoffs, 1);
            assert_eq!(got, id, "the same permit, passed on");
            assert!(validity > Duration::from_secs(20), "{validity:?}");
            handed = true;
            break;
        }
    }
    assert!(handed, "no handoff in 20 tries: {:?}", client.stats());
    // The waiter's permit was released when its thread ended: nothing left.
    assert!(wait_until(Duration::from_secs(5), || !exists(
        &server, "handoff"
    )));
}

/// A hash of another lock type (a reentrant or read-write lock) is never
/// taken for a semaphore: acquire and set_permits refuse it and leave every
/// field as it was.
#[test]
fn another_lock_types_hash_is_refused_and_left_alone() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let _: () = redis::cmd("HSET")
        .arg("other")
        .arg("owner")
        .arg("someone")
        .arg("h:1")
        .arg("1")
        .query(&mut server.conn())
        .expect("HSET");
    let mut sem = Semaphore::with_options(&client, "other", 2, options());
    let err = sem.try_acquire().expect_err("not a semaphore");
    assert!(matches!(err, Error::WrongType { .. }), "{err:?}");
    let err = sem.set_permits(3).expect_err("not a semaphore");
    assert!(matches!(err, Error::WrongType { .. }), "{err:?}");
    assert!(matches!(sem.status(), Err(Error::WrongType { .. })));
    let fields: std::collections::HashMap<String, String> =
        server.conn().hgetall("other").expect("HGETALL");
    assert_eq!(fields.len(), 2, "untouched: {fields:?}");
}

/// The watchdog's pipelined permit renewal with its reply lost, twice: it
/// is resent on a fresh connection (setting the deadline again is safe),
/// the permit stays held and is not reported lost; and the status read with
/// its reply lost is resent and answers.
#[test]
fn a_lost_reply_to_a_permit_renewal_or_status_read_is_resent() {
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    let sem = Semaphore::with_options(
        &client,
        "renewed",
        2,
        options()
            .ttl(Duration::from_millis(900))
            .with_extra(redmutex::SemaphoreExtra::default())
            .watchdog(true),
    );
    let permit = sem.try_acquire().expect("try").expect("permit");
    let field = format!("p:{}", permit.id());
    let deadline = || -> u64 {
        server
            .conn()
            .hget::<_, _, Option<u64>>("renewed", &field)
            .expect("HGET")
            .unwrap_or(0)
    };
    let first = deadline();
    proxy.lose_reply(&sha(include_str!("../lua/sem_extend.lua")), 2);
    // Both lost replies spent, and renewals go on past them.
    assert!(wait_until(Duration::from_secs(10), || proxy.lost_replies() >= 2));
    let after_losses = deadline();
    assert!(wait_until(Duration::from_secs(5), || deadline() > after_losses));
    assert!(deadline() > first);
    assert!(!permit.is_lost(), "a lost renewal reply is no loss");
    assert!(permit.is_held().expect("is_held"));

    proxy.lose_reply(&sha(include_str!("../lua/sem_status.lua")), 1);
    let lost_before = proxy.lost_replies();
    // The first call may load the script; the lost reply is an EVALSHA's.
    let mut status = None;
    for _ in 0..3 {
        status = Some(sem.status().expect("status after a lost reply"));
        if proxy.lost_replies() > lost_before {
            break;
        }
    }
    assert!(proxy.lost_replies() > lost_before, "a reply was lost");
    let status = status.expect("status");
    assert_eq!(status.limit(), Some(2));
    assert_eq!(status.holders().len(), 1);
    assert_eq!(status.holders()[0].id(), redmutex::redact(permit.id()));
    let secret = permit.id().split('|').next().expect("a secret");
    assert!(
        !status.holders()[0].id().contains(secret),
        "the status never carries a permit's secret"
    );
    permit.release().expect("release");
    assert!(!exists(&server, "renewed"));
}

/// While this client's own threads hold every permit, its queued waiters
/// wait for them instead of asking Redis; they must still see a release
/// that is not handed over (fenced permits), a permit whose lease ran out
/// under a holder that kept it, and a limit raised by another client.
/// Each case would leave the waiter waiting for the 30 s lease without it.
#[test]
fn waiters_behind_their_own_clients_permits_see_releases_expiries_and_a_raised_limit() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let waits = |sem: &Semaphore| {
        let sem = sem.clone();
        std::thread::spawn(move || {
            sem.try_acquire_for(Duration::from_secs(10))
                .expect("try")
                .map(|permit| permit.id().to_owned())
        })
    };

    // Fenced: never handed over, released in Redis.
    let fenced = Semaphore::with_options(
        &client,
        "fenced",
        2,
        options()
            .with_extra(redmutex::SemaphoreExtra::default())
            .fencing(true),
    );
    let (a, b) = (fenced.acquire().expect("a"), fenced.acquire().expect("b"));
    let before = client.stats().commands;
    let waiter = waits(&fenced);
    // Queued: its head has asked Redis (the poll behind its own client's
    // permits) at least once.
    assert!(wait_until(Duration::from_secs(5), || {
        client.stats().commands > before
    }));
    let a_id = a.id().to_owned();
    a.release().expect("release");
    let got = waiter
        .join()
        .expect("waiter")
        .expect("woken by the release");
    assert_ne!(got, a_id, "its own permit, with its own token");
    drop(b);

    // A lease that ran out while its holder kept the `Permit`.
    let short = Semaphore::with_options(
        &client,
        "short",
        1,
        options().ttl(Duration::from_millis(300)),
    );
    let kept = short.acquire().expect("kept");
    let waiter = waits(&short);
    let got = waiter.join().expect("waiter").expect("after the lease");
    assert_ne!(got, kept.id(), "a permit of its own");
    drop(kept);

    // A limit raised by another client: this client's semaphore of 1 no
    // longer matches what Redis stores, which its waiter learns from Redis
    // (a clear error) instead of waiting for the lease behind `held`.
    let one = Semaphore::with_options(&client, "raised", 1, options());
    let held = one.acquire().expect("held");
    let waiter = {
        let one = one.clone();
        std::thread::spawn(move || {
            one.try_acquire_for(Duration::from_secs(10))
                .map(|p| p.is_some())
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    let other = server.lock_client();
    let mut raising = Semaphore::with_options(&other, "raised", 1, options());
    raising.set_permits(2).expect("set_permits");
    let got = waiter.join().expect("waiter");
    assert!(
        matches!(&got, Err(Error::InvalidArgument(msg)) if msg.contains("limit of 2")),
        "{got:?}"
    );
    assert!(held.is_held().expect("is_held"));
}

/// This client's count of its own permits is a hint, never the last word:
/// a `try_acquire` asks Redis even when the client believes it holds them
/// all (a permit given back by id, or gone from Redis behind its holder).
#[test]
fn a_try_asks_redis_even_when_the_client_counts_every_permit_as_its_own() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let sem = Semaphore::with_options(&client, "hint", 2, options());
    let a = sem.acquire().expect("a");
    let b = sem.acquire().expect("b");
    assert!(sem.try_acquire().expect("try").is_none(), "full");
    sem.release_permit(a.id()).expect("release by id");
    let c = sem.try_acquire().expect("try").expect("a's place");
    // Every permit removed behind their holders' backs.
    let _: () = redis::cmd("DEL")
        .arg("hint")
        .query(&mut server.conn())
        .expect("DEL");
    let d = sem.try_acquire().expect("try").expect("free in Redis");
    let e = sem
        .try_acquire_for(Duration::from_millis(20))
        .expect("try_for")
        .expect("free in Redis, asked at the deadline");
    drop((a, b, c, d, e));
}

/// Options whose handoff budget outlasts the holds in these tests.
fn passing() -> SemaphoreOptions {
    options()
        .with_extra(redmutex::SemaphoreExtra::default())
        .handoff_budget(redmutex::HandoffBudget::new(256, Duration::from_secs(10)))
}

/// On main a permit released by a `Semaphore` of 5 went to a queued thread
/// of the same client calling a `Semaphore` of 1 on the same key: four
/// such threads held "one" permit each at once, where Redis refuses the
/// limit-1 handle ("has a limit of 5 permits, not 1"). A permit now passes
/// only to a handle opened with the limit it was granted under.
#[test]
fn a_permit_passes_only_to_a_handle_of_its_limit() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let server = RedisServer::start();
    let client = server.lock_client();
    let five = Semaphore::with_options(&client, "sem:limits", 5, passing());
    let held: Vec<_> = (0..5)
        .map(|_| five.try_acquire().expect("try").expect("a permit"))
        .collect();
    let inside = std::sync::Arc::new(AtomicUsize::new(0));
    let most = std::sync::Arc::new(AtomicUsize::new(0));
    let small: Vec<_> = (0..4)
        .map(|_| {
            let one = Semaphore::with_options(&client, "sem:limits", 1, passing());
            let (inside, most) = (inside.clone(), most.clone());
            std::thread::spawn(move || match one.try_acquire_for(Duration::from_secs(2)) {
                Ok(Some(permit)) => {
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(300));
                    inside.fetch_sub(1, Ordering::SeqCst);
                    drop(permit);
                    "permit".to_owned()
                }
                Ok(None) => "none".to_owned(),
                Err(err) => err.to_string(),
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    for permit in held {
        permit.release().expect("release");
        std::thread::sleep(Duration::from_millis(20));
    }
    let outcomes: Vec<String> = small
        .into_iter()
        .map(|t| t.join().expect("thread"))
        .collect();
    assert!(
        most.load(Ordering::SeqCst) <= 1,
        "a semaphore of 1 had {} holders at once: {outcomes:?}",
        most.load(Ordering::SeqCst)
    );
}

/// On main a limit lowered by another client was ignored by the permits
/// this client passed between its threads for up to a whole handoff
/// budget. A permit Redis last confirmed more than the budget's `max_age`
/// ago is checked before it is passed on (`lua/sem_check.lua`, which reads
/// the stored limit too): once the limit differs, the permit is given back
/// in Redis instead, and the waiters ask under the new limit (no room:
/// two of three are still out where the limit is now one).
#[test]
fn a_limit_lowered_elsewhere_stops_handoffs() {
    let server = RedisServer::start();
    let proxy = support::FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    let elsewhere = server.lock_client();
    let check = support::sha(include_str!("../lua/sem_check.lua"));
    // Waiters that do not ask Redis on their own while the test runs
    // (a semaphore's head polls at the backoff's ceiling).
    let patient = passing().backoff(redmutex::Backoff::constant(Duration::from_secs(10)));
    // Whether the waiters are queued when the first permit goes cannot be
    // seen from outside: tried until the check before a handoff went out.
    for attempt in 0..20 {
        let key = format!("sem:lowered:{attempt}");
        let three = Semaphore::with_options(&client, &key, 3, patient);
        let mut held: Vec<_> = (0..3)
            .map(|_| three.try_acquire().expect("try").expect("a permit"))
            .collect();
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let three = three.clone();
                std::thread::spawn(move || {
                    matches!(
                        three.try_acquire_for(Duration::from_millis(500)),
                        Ok(Some(_))
                    )
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        Semaphore::new(&elsewhere, &key, 3)
            .set_permits(1)
            .expect("the limit lowered elsewhere");
        proxy.heal();
        proxy.count(&check);
        let handoffs = client.stats().handoffs;
        held.pop()
            .map(|permit| permit.release())
            .transpose()
            .expect("release");
        let got = waiters
            .into_iter()
            .map(|w| w.join().expect("waiter"))
            .filter(|got| *got)
            .count();
        let checked = proxy.counted(&check) > 0;
        drop(held);
        assert_eq!(
            client.stats().handoffs,
            handoffs,
            "a permit admitted under the old limit was passed on"
        );
        assert_eq!(got, 0, "admitted beyond the new limit of 1 (2 still out)");
        if checked {
            return;
        }
    }
    panic!("no permit was about to be handed on in 20 tries");
}

/// A permit released by id elsewhere (an operator's `redmutex release
/// --token`) while its holder still runs, its place taken by another
/// client: the holder's release finds it gone before passing it on,
/// says `NotHeld`, and no waiter starts on it (a second holder of a
/// semaphore of one). On f63675e the waiter got it, and the check that
/// found it lost came a millisecond or more later.
#[test]
fn a_permit_gone_in_redis_is_never_passed_on() {
    let server = RedisServer::start();
    let proxy = support::FaultProxy::to(&server);
    let client = LockClient::open(&proxy.url()).expect("client");
    let elsewhere = server.lock_client();
    let check = support::sha(include_str!("../lua/sem_check.lua"));
    for attempt in 0..20 {
        let key = format!("sem:gone:{attempt}");
        let one = Semaphore::with_options(&client, &key, 1, passing());
        let permit = one.try_acquire().expect("try").expect("the permit");
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let one = one.clone();
                std::thread::spawn(move || {
                    one.try_acquire_for(Duration::from_millis(500))
                        .map(|got| got.map(|permit| permit.id().to_owned()))
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        let theirs = Semaphore::new(&elsewhere, &key, 1);
        theirs
            .release_permit(permit.id())
            .expect("released by id elsewhere");
        let taken = theirs.try_acquire().expect("try").expect("the freed place");
        proxy.heal();
        proxy.count(&check);
        let released = permit.release();
        let got: Vec<_> = waiters
            .into_iter()
            .map(|w| w.join().expect("waiter"))
            .collect();
        assert!(
            got.iter().all(|got| matches!(got, Ok(None))),
            "a second holder of a semaphore of one: {got:?}"
        );
        assert!(
            matches!(released, Err(Error::NotHeld { .. })),
            "{released:?}"
        );
        taken.release().expect("theirs");
        if proxy.counted(&check) > 0 {
            return;
        }
    }
    panic!("no permit was about to be handed on in 20 tries");
}
