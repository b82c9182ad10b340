//! No secret in any text. A token's secret part, a permit id or a
//! reentrant owner is a capability: whoever reads it can release the lock
//! (`redmutex release --token`). The crate's errors and log lines name the
//! key and the lock type found there, never a value read from a key.
//!
//! Every lock type meets every other type's data under its key, on every
//! path that can meet it: an acquisition, a guard's extension, check and
//! release after its key was replaced, a release whose replies are lost
//! (an `OutcomeUnknown`, then the cleanup that finds the other data), a
//! watched lease whose renewal finds it, and the first reply of an
//! acquisition lost before the resend is refused. Each case on a fresh
//! client and a fresh server state. Every error's `Display` and `Debug`,
//! and every log line of the run (all levels), is searched for every
//! secret the server held in that case.

use redmutex_test_support as support;

use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use redmutex::Lease;
use redmutex::{DistributedLock, Error, LockClient, LockOptions, ReentrantLock, RwLock, Semaphore};
use support::{FaultProxy, RedisServer, wait_until};

/// Every log record of this binary, formatted.
struct Capture(Mutex<Vec<String>>);

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(format!("{} {}", record.level(), record.args()));
    }
    fn flush(&self) {}
}

fn logs() -> &'static Capture {
    static CAPTURE: OnceLock<&'static Capture> = OnceLock::new();
    CAPTURE.get_or_init(|| {
        let capture: &'static Capture = Box::leak(Box::new(Capture(Mutex::new(Vec::new()))));
        let _ = log::set_logger(capture);
        log::set_max_level(log::LevelFilter::Trace);
        capture
    })
}

/// A label that marks this run's holder metadata, a holder field.
const LABEL: &str = "lbl-secretive-7f3a9c";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Plain,
    Reentrant,
    Read,
    Write,
    Semaphore,
}

const KINDS: [Kind; 5] = [
    Kind::Plain,
    Kind::Reentrant,
    Kind::Read,
    Kind::Write,
    Kind::Semaphore,
];

/// A guard of any kind.
enum Held {
    Plain(redmutex::LockGuard),
    Reentrant(redmutex::ReentrantGuard),
    Rw(redmutex::RwGuard),
    Permit(redmutex::Permit),
}

/// Short waits, a short I/O timeout: the cases fail fast.
fn lease<X: Default>() -> redmutex::Options<X> {
    redmutex::Options::default()
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_millis(50))
}

fn client_of(url: &str) -> LockClient {
    LockClient::builder()
        .url(url)
        .timeout(Duration::from_millis(300))
        .label(LABEL)
        .build()
        .expect("client")
}

/// A watched lease's ttl: renewed every 300 ms.
const WATCHED_TTL: Duration = Duration::from_millis(900);

/// One attempt of `kind` on `key`, watched when asked.
fn take(kind: Kind, client: &LockClient, key: &str, watched: bool) -> Result<Option<Held>, Error> {
    Ok(match kind {
        Kind::Plain => {
            let options = LockOptions::default()
                .ttl(if watched {
                    WATCHED_TTL
                } else {
                    Duration::from_secs(30)
                })
                .watchdog(watched);
            DistributedLock::with_options(client, key, options)
                .try_lock()?
                .map(Held::Plain)
        }
        Kind::Reentrant => ReentrantLock::with_options(client, key, lease())
            .try_lock()?
            .map(Held::Reentrant),
        Kind::Read => RwLock::with_options(client, key, lease())
            .try_read()?
            .map(Held::Rw),
        Kind::Write => RwLock::with_options(client, key, lease())
            .try_write()?
            .map(Held::Rw),
        Kind::Semaphore => {
            let lease: redmutex::SemaphoreOptions = if watched {
                lease().ttl(WATCHED_TTL)
            } else {
                lease()
            };
            let options = lease
                .with_extra(redmutex::SemaphoreExtra::default())
                .watchdog(watched);
            Semaphore::with_options(client, key, 2, options)
                .try_acquire()?
                .map(Held::Permit)
        }
    })
}

impl Held {
    /// Every call a holder makes, each outcome kept.
    fn exercise(mut self, texts: &mut Vec<String>) {
        let ttl = Duration::from_secs(30);
        match &mut self {
            Held::Plain(guard) => {
                keep(texts, guard.is_held().map(|_| ()));
                keep(texts, guard.extend(ttl));
            }
            Held::Reentrant(guard) => {
                keep(texts, guard.is_held().map(|_| ()));
                keep(texts, guard.extend(ttl));
            }
            Held::Rw(guard) => {
                keep(texts, guard.is_held().map(|_| ()));
                keep(texts, guard.extend(ttl));
            }
            Held::Permit(permit) => {
                keep(texts, permit.is_held().map(|_| ()));
                keep(texts, permit.extend(ttl));
            }
        }
        self.unlock(texts);
    }

    fn unlock(self, texts: &mut Vec<String>) {
        match self {
            Held::Plain(guard) => keep(texts, guard.unlock()),
            Held::Reentrant(guard) => keep(texts, guard.unlock().map(|_| ())),
            Held::Rw(guard) => keep(texts, guard.unlock()),
            Held::Permit(permit) => keep(texts, permit.release()),
        }
    }
}

/// Keeps an error's `Display` and `Debug`.
fn keep<T>(texts: &mut Vec<String>, result: Result<T, Error>) {
    if let Err(err) = result {
        texts.push(format!("{err}"));
        texts.push(format!("{err:?}"));
    }
}

/// Every secret the server holds now: each string value's and hash
/// field's and value's part before its first `|` (a token's secret, a
/// permit id's, an owner id), and the run's holder label.
fn secrets(server: &RedisServer) -> Vec<String> {
    let mut con = server.conn();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut con).expect("KEYS");
    // Holder fields: the label, and the program name every token of this
    // run carries (a token of a failed request is never in Redis).
    let mut found = vec![LABEL.to_owned()];
    if let Some(program) = std::env::current_exe().ok().and_then(|exe| {
        exe.file_name()
            .map(|name| name.to_string_lossy().into_owned())
    }) {
        found.push(program);
    }
    let mut add = |text: &str| {
        let text = ["p:", "r:", "q:", "f:"]
            .iter()
            .find_map(|prefix| text.strip_prefix(prefix))
            .unwrap_or(text);
        let secret = text.split('|').next().unwrap_or(text);
        if secret.len() >= 16 && !found.iter().any(|s| s == secret) {
            found.push(secret.to_owned());
        }
    };
    for key in keys {
        let kind: String = redis::cmd("TYPE").arg(&key).query(&mut con).expect("TYPE");
        match kind.as_str() {
            "string" => {
                let value: Vec<u8> = redis::cmd("GET").arg(&key).query(&mut con).expect("GET");
                add(&String::from_utf8_lossy(&value));
            }
            "hash" => {
                let pairs: Vec<(String, String)> = redis::cmd("HGETALL")
                    .arg(&key)
                    .query(&mut con)
                    .expect("HGETALL");
                for (field, value) in pairs {
                    add(&field);
                    add(&value);
                }
            }
            _ => {}
        }
    }
    found
}

/// No text of `texts`, nor any log line since `from`, holds a secret of
/// `known`.
fn assert_no_secret(case: &str, texts: &[String], from: usize, known: &[String]) {
    let lines = log_since(from);
    for text in texts.iter().chain(&lines) {
        for secret in known {
            assert!(
                !text.contains(secret.as_str()),
                "{case}: a secret ({secret}) in: {text}"
            );
        }
    }
}

fn log_since(from: usize) -> Vec<String> {
    logs()
        .0
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(from..)
        .map(<[String]>::to_vec)
        .unwrap_or_default()
}

fn log_mark() -> usize {
    logs().0.lock().unwrap_or_else(|e| e.into_inner()).len()
}

fn flush(server: &RedisServer) {
    let _: () = redis::cmd("FLUSHALL")
        .query(&mut server.conn())
        .expect("FLUSHALL");
}

/// What `owner` of `kind` leaves under `key`: its guard, kept alive.
fn place(kind: Kind, owner: &LockClient, key: &str) -> Held {
    take(kind, owner, key, false)
        .expect("the data")
        .expect("free")
}

/// Acquisitions on another type's data, plainly and with their first
/// reply lost (the resend meets the data). Also the calls that name a
/// holder: a release by token or permit id, a force release, a status.
#[test]
fn an_acquisition_on_another_types_data_names_no_secret() {
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    support::load_scripts(&server);
    logs();
    for theirs in KINDS {
        for ours in KINDS {
            if theirs == ours
                || matches!(
                    (theirs, ours),
                    (Kind::Read | Kind::Write, Kind::Read | Kind::Write)
                )
            {
                continue;
            }
            for lost in [false, true] {
                flush(&server);
                support::load_scripts(&server);
                let case = format!("{ours:?} on {theirs:?}'s data, first reply lost: {lost}");
                let mark = log_mark();
                let owner = client_of(&server.url());
                let _data = place(theirs, &owner, "k");
                let known = secrets(&server);
                let client = client_of(&proxy.url());
                if lost {
                    // Every request of the acquisition: whichever it sends.
                    proxy.lose_reply("$1\r\nk\r\n", 1);
                }
                let mut texts = Vec::new();
                keep(
                    &mut texts,
                    take(ours, &client, "k", false)
                        .map(|held| held.map(|h| h.unlock(&mut Vec::new()))),
                );
                proxy.heal();
                keep(
                    &mut texts,
                    DistributedLock::new(&client, "k").release_token("not-a-token-of-anyone"),
                );
                keep(
                    &mut texts,
                    Semaphore::new(&client, "k", 2).release_permit("not-a-permit-of-anyone"),
                );
                keep(&mut texts, Semaphore::new(&client, "k", 2).status());
                keep(
                    &mut texts,
                    DistributedLock::new(&client, "k").force_release(),
                );
                assert!(!texts.is_empty(), "{case}: no error at all");
                drop(client);
                assert_no_secret(&case, &texts, mark, &known);
            }
        }
    }
}

/// A guard whose key was replaced by another type's data: its extension,
/// check and release; then the same with every reply of the release lost
/// (`OutcomeUnknown`, and the cleanup that later meets the data); and a
/// watched lease whose renewal meets it.
#[test]
fn a_guard_meeting_another_types_data_names_no_secret() {
    let server = RedisServer::start();
    let proxy = FaultProxy::to(&server);
    logs();
    for ours in KINDS {
        for theirs in KINDS {
            for path in ["calls", "lost release", "watched"] {
                if path == "watched" && !matches!(ours, Kind::Plain | Kind::Semaphore) {
                    continue;
                }
                flush(&server);
                let case = format!("{ours:?} meeting {theirs:?}'s data: {path}");
                let mark = log_mark();
                let client = client_of(&proxy.url());
                let held = take(ours, &client, "k", path == "watched")
                    .expect("ours")
                    .expect("free");
                let mut known = secrets(&server);
                let _: () = redis::cmd("DEL")
                    .arg("k")
                    .query(&mut server.conn())
                    .expect("DEL");
                let owner = client_of(&server.url());
                let _data = place(theirs, &owner, "k");
                known.extend(secrets(&server));
                let mut texts = Vec::new();
                match path {
                    "calls" => held.exercise(&mut texts),
                    "lost release" => {
                        // Lost on every resend too: the outcome is unknown,
                        // and the release goes to the cleanup.
                        proxy.lose_reply("$1\r\nk\r\n", 50);
                        held.unlock(&mut texts);
                        proxy.heal();
                        // The cleanup meets the other data and gives up on
                        // it (it tries for three I/O timeouts): its log
                        // lines are read below.
                        let cleaned = client.stats().orphans_released;
                        wait_until(Duration::from_secs(2), || {
                            client.stats().orphans_released > cleaned
                                || log_since(mark).iter().any(|line| line.contains("clean up"))
                        });
                    }
                    _ => {
                        // The watchdog renews at a third of the ttl: made
                        // short, its renewal meets the data at once.
                        let lost = wait_until(Duration::from_secs(15), || match &held {
                            Held::Plain(guard) => guard.is_lost(),
                            Held::Permit(permit) => permit.is_lost(),
                            _ => true,
                        });
                        let _ = lost;
                        held.unlock(&mut texts);
                    }
                }
                drop(client);
                assert_no_secret(&case, &texts, mark, &known);
            }
        }
    }
}

/// A server whose scripts are disabled (`rename-command EVALSHA ""`, as
/// some managed services do): Redis's "unknown command" echoes the first
/// arguments, among them the release marker, named by the token's secret.
/// The error of the release that meets it, and every log line, name the
/// command, never the arguments.
#[test]
fn an_unknown_command_echoing_its_arguments_names_no_secret() {
    let server = RedisServer::start_with(&["--rename-command", "EVALSHA", ""]);
    logs();
    let mark = log_mark();
    let client = client_of(&server.url());
    let mut texts = Vec::new();
    let guard = DistributedLock::new(&client, "k")
        .try_lock()
        .expect("SET NX GET needs no script")
        .expect("free");
    let known = secrets(&server);
    keep(&mut texts, guard.unlock());
    keep(
        &mut texts,
        take(Kind::Semaphore, &client, "s", false).map(|_| ()),
    );
    assert!(
        texts.iter().any(|text| text.contains("EVALSHA")),
        "the refusal names the command: {texts:?}"
    );
    drop(client);
    assert_no_secret("scripts disabled", &texts, mark, &known);
}
