//! The watchdog: one background thread per `LockClient` that keeps watched
//! leases alive, renewing every lease at a third of its ttl, the renewals
//! due together pipelined in one round trip.
//!
//! A renewal holds its entry's lock across the round trip, and release
//! takes the same lock to stop the entry before it sends anything: so no
//! renewal starts after a release begins, and none is in flight when the
//! release is sent.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::backend::Backend;
use crate::guard::remaining;
use crate::loss::{LossReason, LossState};
use crate::scripts;
use crate::stats::Stats;

/// The watchdog thread's name.
pub(crate) const THREAD_NAME: &str = "redmutex-dog";
/// How soon a renewal that failed on the network is tried again.
const RETRY: Duration = Duration::from_millis(100);
/// The longest the thread sleeps without looking.
const IDLE: Duration = Duration::from_secs(1);

/// One watched lease.
pub(crate) struct WatchEntry {
    key: String,
    token: String,
    pub(crate) loss: Arc<LossState>,
    state: Mutex<EntryState>,
}

struct EntryState {
    stopped: bool,
    /// When the request that set the current expiry was sent, and its ttl.
    sent: Instant,
    ttl: Duration,
    /// No renewal after this moment ([`LockOptions::max_hold`](crate::LockOptions::max_hold)).
    cap: Option<Instant>,
}

impl WatchEntry {
    /// Stops renewals, waiting for one in flight to finish.
    pub(crate) fn stop(&self) {
        self.state.lock().stopped = true;
    }

    /// The holder extended the lease itself.
    pub(crate) fn renewed(&self, sent: Instant, ttl: Duration) {
        let mut state = self.state.lock();
        state.sent = sent;
        state.ttl = ttl;
    }

    /// The lease's current expiry by the local clock.
    pub(crate) fn lease(&self) -> (Instant, Duration) {
        let state = self.state.lock();
        (state.sent, state.ttl)
    }
}

struct Registry {
    entries: Vec<Arc<WatchEntry>>,
    thread_started: bool,
    shutdown: bool,
}

struct Shared {
    backend: Backend,
    stats: Arc<Stats>,
    registry: Mutex<Registry>,
    changed: Condvar,
}

/// The client's watchdog: started on first use, stopped when dropped.
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Watchdog {
    pub(crate) fn new(backend: Backend, stats: Arc<Stats>) -> Watchdog {
        Watchdog {
            shared: Arc::new(Shared {
                backend,
                stats,
                registry: Mutex::new(Registry {
                    entries: Vec::new(),
                    thread_started: false,
                    shutdown: false,
                }),
                changed: Condvar::new(),
            }),
            thread: Mutex::new(None),
        }
    }

    /// Starts renewing a lease acquired by a request sent at `sent`.
    pub(crate) fn watch(
        &self,
        key: &str,
        token: &str,
        sent: Instant,
        ttl: Duration,
        cap: Option<Instant>,
    ) -> Arc<WatchEntry> {
        let entry = Arc::new(WatchEntry {
            key: key.to_owned(),
            token: token.to_owned(),
            loss: Arc::new(LossState::default()),
            state: Mutex::new(EntryState {
                stopped: false,
                sent,
                ttl,
                cap,
            }),
        });
        let mut registry = self.shared.registry.lock();
        registry.entries.push(entry.clone());
        if !registry.thread_started && !registry.shutdown {
            registry.thread_started = true;
            let shared = self.shared.clone();
            match std::thread::Builder::new()
                .name(THREAD_NAME.into())
                .spawn(move || run(&shared))
            {
                Ok(handle) => *self.thread.lock() = Some(handle),
                Err(err) => log::warn!("redmutex: cannot start the watchdog thread: {err}"),
            }
        }
        self.shared.changed.notify_all();
        entry
    }

    /// Stops renewing `entry` (waiting for a renewal in flight) and forgets it.
    pub(crate) fn unwatch(&self, entry: &Arc<WatchEntry>) {
        entry.stop();
        self.shared
            .registry
            .lock()
            .entries
            .retain(|e| !Arc::ptr_eq(e, entry));
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        {
            let mut registry = self.shared.registry.lock();
            registry.shutdown = true;
            self.shared.changed.notify_all();
        }
        if let Some(handle) = self.thread.lock().take() {
            let _ = handle.join();
        }
    }
}

fn run(shared: &Shared) {
    loop {
        let entries = {
            let mut registry = shared.registry.lock();
            while registry.entries.is_empty() && !registry.shutdown {
                shared.changed.wait(&mut registry);
            }
            if registry.shutdown {
                return;
            }
            registry.entries.clone()
        };
        let next = renew_due(shared, &entries);
        let mut registry = shared.registry.lock();
        registry.entries.retain(|entry| !entry.state.lock().stopped);
        if registry.shutdown {
            return;
        }
        let sleep_until = next.min(Instant::now() + IDLE);
        shared.changed.wait_until(&mut registry, sleep_until);
    }
}

/// Renews the entries that are due, in one pipeline; returns when to look
/// again.
fn renew_due(shared: &Shared, entries: &[Arc<WatchEntry>]) -> Instant {
    let now = Instant::now();
    let mut next = now + IDLE;
    let mut due: Vec<(&WatchEntry, MutexGuard<'_, EntryState>)> = Vec::new();
    for entry in entries {
        let mut state = entry.state.lock();
        if state.stopped {
            continue;
        }
        let left = remaining(state.sent, state.ttl, now);
        if state.cap.is_some_and(|cap| now >= cap) {
            if left.is_zero() {
                entry.loss.lose(LossReason::MaxHold);
                state.stopped = true;
            } else {
                next = next.min(now + left);
            }
            continue;
        }
        let period = state.ttl / 3;
        let due_at = state.sent + period;
        // Renewals due soon ride along with those due now.
        if now + period / 8 >= due_at {
            due.push((entry, state));
        } else {
            next = next.min(due_at);
        }
    }
    if due.is_empty() {
        return next;
    }
    let sent = Instant::now();
    match renew(shared, &due) {
        Ok(replies) => {
            for ((entry, state), reply) in due.iter_mut().zip(replies) {
                match scripts::owner_checked(reply) {
                    Ok(()) => {
                        state.sent = sent;
                        next = next.min(sent + state.ttl / 3);
                    }
                    Err(reason) => {
                        entry.loss.lose(reason.into());
                        state.stopped = true;
                    }
                }
            }
        }
        Err(err) => {
            log::warn!("redmutex: watchdog renewal failed: {err}");
            let now = Instant::now();
            for (entry, state) in due.iter_mut() {
                let wrong_type = matches!(
                    crate::Error::from_redis(&entry.key, err.clone()),
                    crate::Error::WrongType { .. }
                );
                if wrong_type {
                    entry.loss.lose(LossReason::OwnedByOther);
                    state.stopped = true;
                } else if remaining(state.sent, state.ttl, now).is_zero() {
                    entry.loss.lose(LossReason::Unreachable);
                    state.stopped = true;
                }
            }
            next = next.min(now + RETRY);
        }
    }
    next
}

/// One pipeline of owner-checked PEXPIREs (`lua/extend.lua` by EVALSHA),
/// loading the script once if the server lost it. On a cluster, redis-rs
/// splits the pipeline by node: one round trip per node that holds a due
/// lease.
fn renew(
    shared: &Shared,
    due: &[(&WatchEntry, MutexGuard<'_, EntryState>)],
) -> redis::RedisResult<Vec<i64>> {
    let mut con = shared.backend.get().map_err(|err| {
        redis::RedisError::from((
            redis::ErrorKind::Io,
            "no connection for the watchdog",
            err.to_string(),
        ))
    })?;
    // A cluster connection cannot pipeline; redis-rs's cluster pipeline
    // splits the batch per node instead.
    let cluster = con.as_cluster().is_some();
    let mut pipe = redis::pipe();
    let mut cluster_pipe = redis::cluster::cluster_pipe();
    for (entry, state) in due {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(scripts::EXTEND.get_hash())
            .arg(1)
            .arg(&entry.key)
            .arg(&entry.token)
            .arg(state.ttl.as_millis() as u64);
        if cluster {
            cluster_pipe.add_command(cmd);
        } else {
            pipe.add_command(cmd);
        }
    }
    let send = |con: &mut crate::Connection| match con.as_cluster() {
        Some(cluster) => cluster_pipe.query(cluster),
        None => pipe.query(con),
    };
    shared.stats.renewal_batch(due.len() as u64);
    match send(&mut con) {
        Err(err) if is_noscript(&err) => {
            // On a cluster, SCRIPT LOAD goes to every primary.
            scripts::EXTEND.load(&mut con)?;
            shared.stats.commands(1);
            shared.stats.renewal_batch(due.len() as u64);
            send(&mut con)
        }
        other => other,
    }
}

fn is_noscript(err: &redis::RedisError) -> bool {
    err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
        || err
            .clone()
            .into_server_errors()
            .is_some_and(|errors| errors.iter().any(|(_, e)| e.code() == "NOSCRIPT"))
}
