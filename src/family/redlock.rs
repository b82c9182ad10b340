//! `RedLock`: one lock over N independent Redis masters, granted by a
//! majority (the Redis documentation's distributed-lock page), with the
//! corrections careful
//! implementations made: a per-node timeout far below the ttl, parallel
//! requests, validity = ttl − elapsed − drift, and a failed attempt released
//! on every node, including those whose reply was late or lost.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use std::convert::Infallible;

use crate::client::LockClient;
use crate::client::holder::Redacted;
use crate::client::list::HeldLock;
use crate::client::options::{RedLockOptions, Release, WaitMode, ttl_millis};
use crate::client::release;
use crate::conn::policy::Op;
use crate::conn::stats::{LockKind, Tag};
use crate::error::{Error, LossReason};
use crate::lease::Lease as _;
use crate::lease::loss::{LossSignal, LossState};
use crate::lease::{drift, later};
use crate::renew::watchdog::OrphanKind;
use crate::script;
use crate::wait::acquire::{Attempt, Contender, Queued, Waiting, Within, acquire};
use crate::wait::queue::{Feed, Queues, Waker};

/// A lock held on a majority of N independent Redis masters (RedLock).
///
/// Each node is a [`LockClient`] of its own (its own pool and timeouts).
/// Acquiring sends `SET key token NX PX ttl` to every node in parallel and
/// succeeds only when a majority (N/2+1) granted it and time is left:
/// validity = ttl − elapsed − drift (1 % of ttl + 2 ms). A node that does
/// not answer within the node timeout (default 5 % of the ttl) counts as
/// failed. A round is decided as soon as its majority is; `extend` and
/// `unlock` return `Ok` as soon as a majority held our token, and
/// otherwise an answer that does not depend on which nodes answered first,
/// within the node timeout. A node that failed or was too slow is known down for a while
/// (250 ms, doubling up to 5 s) and not waited for; then one request probes
/// it. Nothing sent to a node outlives its caller unchecked: a request the
/// node's thread could not start in time is dropped unsent, a grant that
/// arrives after its round was lost is released by the node's thread at
/// once, and a request whose reply was lost (or a release for a node known
/// down) goes to the node's client's cleanup, which releases the key
/// (owner-checked) once the node answers.
///
/// What RedLock does not promise: it assumes bounded clock drift between the
/// nodes and no process pauses longer than the validity; a node that
/// restarts without persistence forgets the keys it granted, which can let
/// a second client gather a majority; and, like every lease, a holder paused
/// past its validity keeps acting. When correctness depends on the lock,
/// have the resource check fencing tokens.
///
/// ```no_run
/// # fn main() -> Result<(), redmutex::Error> {
/// use redmutex::{Lease, LockClient, RedLock};
/// let nodes = ["redis://a:6379/", "redis://b:6379/", "redis://c:6379/"]
///     .iter()
///     .map(|url| LockClient::open(url))
///     .collect::<Result<Vec<_>, _>>()?;
/// let lock = RedLock::new(nodes, "jobs:billing")?;
/// let guard = lock.lock()?; // Err(Error::Quorum { .. }) says who failed
/// // ... work well within guard.validity() ...
/// guard.unlock()?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct RedLock {
    nodes: Arc<Nodes>,
    key: String,
    options: RedLockOptions,
    /// The first node's client: a RedLock's stats are kept there.
    meter: LockClient,
}

/// One long-lived thread per node, so a round costs no thread start-ups,
/// and requests to one node run in order: a release queued after a late
/// acquire runs after it.
///
/// A node that failed or did not answer in time is *known down* for a
/// while (250 ms, doubling up to 5 s while it keeps failing): requests that
/// can wait for it (acquire, extend) are not queued for it at all, so no
/// caller waits on it and nothing piles up behind its timeouts to be
/// replayed when it heals; once the while is over, one request goes
/// through as a probe. A request that was queued but whose caller gave up
/// before the node's thread got to it is dropped unsent. What cannot be
/// dropped (a release) goes to the node's client's cleanup instead when
/// the node is known down, and is retried there until the node answers.
struct Nodes {
    nodes: Vec<Node>,
    /// Whether any node is a Redis Cluster (keys are then checked).
    cluster: bool,
    /// The threads of this process waiting for the lock through this
    /// handle (and its clones): one queue per key, its head woken by the
    /// release message of any node.
    queues: Queues<Infallible>,
}

struct Node {
    worker: Mutex<mpsc::Sender<Job>>,
    /// The node's client, for releases handed to its cleanup.
    client: LockClient,
    health: Arc<Health>,
}

type Job = Box<dyn FnOnce(&LockClient) + Send>;

/// Whether a node may be asked now (see [`Nodes`]).
#[derive(Default)]
struct Health {
    down: Mutex<Option<Down>>,
    /// When the node's thread started the request it is still on.
    busy_since: Mutex<Option<Instant>>,
}

struct Down {
    failures: u32,
    /// When the next request may go through as a probe.
    probe_at: Instant,
}

/// How long a node that failed is left alone, after `failures` failures
/// in a row: 250 ms, doubling, at most 5 s.
fn rest(failures: u32) -> Duration {
    Duration::from_millis(250)
        .saturating_mul(1u32 << failures.saturating_sub(1).min(5))
        .min(Duration::from_secs(5))
}

impl Health {
    /// Whether a request may be sent now: not while the node's thread has
    /// been on one request for longer than `patience` (a blackholed link:
    /// nothing queues behind it), and for a down node only when its rest
    /// is over (one request, the probe; it rests again meanwhile).
    fn admit(&self, now: Instant, patience: Duration) -> bool {
        if self
            .busy_since
            .lock()
            .is_some_and(|since| now.saturating_duration_since(since) > patience)
        {
            return false;
        }
        let mut down = self.down.lock();
        match down.as_mut() {
            None => true,
            Some(state) if now >= state.probe_at => {
                state.probe_at = later(now, rest(state.failures));
                true
            }
            Some(_) => false,
        }
    }

    fn failed(&self, now: Instant) {
        let mut down = self.down.lock();
        let failures = down.as_ref().map_or(0, |d| d.failures).saturating_add(1);
        *down = Some(Down {
            failures,
            probe_at: later(now, rest(failures)),
        });
    }

    fn answered(&self) {
        *self.down.lock() = None;
    }

    /// Known down and resting now: a queued release is handed to the
    /// cleanup instead of waiting on the link.
    fn resting(&self, now: Instant) -> bool {
        self.down.lock().as_ref().is_some_and(|d| now < d.probe_at)
    }

    fn busy(&self, since: Option<Instant>) {
        *self.busy_since.lock() = since;
    }

    /// Records what a request met: the node answered (whatever it said),
    /// or the network failed.
    fn record<T>(&self, result: &Result<T, Error>) {
        match result {
            Err(err) if err.is_connection() => self.failed(Instant::now()),
            _ => self.answered(),
        }
    }
}

/// One node's grant: `SET key token NX PX millis GET` (the key free, or
/// already ours: a resend after a lost reply), or on a server that
/// refuses it (Redis 6.x) the acquire script, which does the same in two
/// steps. `Ok(true)` when the key holds `token`.
fn grant(client: &LockClient, key: &str, token: &str, millis: u64) -> Result<bool, Error> {
    if client.set_get_allowed() {
        client.counters().commands(1);
        let previous: Result<Option<Vec<u8>>, Error> = client.run(Op::Acquire, key, |con, _| {
            script::wire::query(con, &script::set_nx_get(key, token, millis))
        });
        match previous.map_err(crate::error::known_refusal) {
            Ok(previous) => return Ok(previous.is_none_or(|v| v == token.as_bytes())),
            // Refused whole before it ran: nothing was set.
            Err(Error::Redis(err)) if crate::error::syntax_error(&err) => client.refuse_set_get(),
            Err(err) => return Err(err),
        }
    }
    client.counters().commands(1);
    let (acquired, _pttl, _fence, _holder): (i64, i64, u64, Option<String>) =
        client.run(Op::AcquireScript, key, |con, _| {
            script::ACQUIRE.key(key).arg(token).arg(millis).invoke(con)
        })?;
    Ok(acquired == 1)
}

/// Where the nodes' answers to one request arrive, as `(node, Sent)`.
type Results<T> = mpsc::Receiver<(usize, Sent<Result<T, Error>>)>;

/// What a node's thread did with a request.
enum Sent<T> {
    /// Not sent: its caller had given up before the thread got to it.
    Abandoned,
    Done(T),
}

impl Drop for Nodes {
    fn drop(&mut self) {
        // In a forked child the node threads do not exist, and a channel's
        // own lock may have been held by one of them at the fork: the
        // senders are left alone, as the rest of the parent's client is.
        if self.check_process().is_err() {
            for node in std::mem::take(&mut self.nodes) {
                std::mem::forget(node);
            }
        }
    }
}

impl Nodes {
    /// Refuses nodes inherited through `fork()` (see
    /// `LockClient::check_process`): in a child their threads do not exist
    /// and their connections are the parent's.
    fn check_process(&self) -> Result<(), Error> {
        self.nodes
            .iter()
            .try_for_each(|node| node.client.check_process())
    }

    fn start(clients: Vec<LockClient>) -> Nodes {
        let cluster = clients
            .iter()
            .any(|c| c.deployment() == crate::conn::backend::Deployment::Cluster);
        let nodes = clients
            .into_iter()
            .map(|client| {
                let (tx, rx) = mpsc::channel::<Job>();
                let own = client.clone();
                let health = Arc::new(Health::default());
                let busy = health.clone();
                let spawned = crate::conn::worker::without_signals(|| {
                    std::thread::Builder::new()
                        .name("redmutex-redlock".into())
                        .spawn(move || {
                            // Ends when the last RedLock handle (the sender) goes.
                            while let Ok(job) = rx.recv() {
                                busy.busy(Some(Instant::now()));
                                // A job that panicked must not take the node's
                                // thread with it: the node would be lost for
                                // every later request.
                                let ran =
                                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                        job(&own)
                                    }));
                                busy.busy(None);
                                if ran.is_err() {
                                    log::error!("redmutex: a RedLock node request panicked");
                                }
                            }
                        })
                });
                if let Err(err) = spawned {
                    log::warn!("redmutex: cannot start a RedLock node thread: {err}");
                }
                Node {
                    worker: Mutex::new(tx),
                    client,
                    health,
                }
            })
            .collect();
        Nodes {
            nodes,
            cluster,
            queues: Queues::default(),
        }
    }

    fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Puts `job` on node `node`'s thread.
    fn queue(&self, node: usize, job: Job) {
        if let Some(target) = self.nodes.get(node)
            && target.worker.lock().send(job).is_err()
        {
            log::warn!("redmutex: RedLock node {node} thread is gone");
        }
    }

    /// Queues `op` on node `node`'s thread; its result goes to `tx` as
    /// `(node, Sent)`. Run only if the thread gets to it before `give_up`
    /// (`None`: always run). The node's health learns from the result.
    fn send<T: Send + 'static>(
        &self,
        node: usize,
        give_up: Option<Instant>,
        tx: &mpsc::Sender<(usize, Sent<Result<T, Error>>)>,
        op: impl FnOnce(&LockClient) -> Result<T, Error> + Send + 'static,
    ) {
        let Some(target) = self.nodes.get(node) else {
            return;
        };
        let (tx, health) = (tx.clone(), target.health.clone());
        self.queue(
            node,
            Box::new(move |client| {
                if give_up.is_some_and(|at| Instant::now() >= at) {
                    // The thread reached it too late: the node is slow.
                    health.failed(Instant::now());
                    let _ = tx.send((node, Sent::Abandoned));
                    return;
                }
                let result = op(client);
                health.record(&result);
                let _ = tx.send((node, Sent::Done(result)));
            }),
        );
    }

    /// Releases `token` on every node, owner-checked, and returns the
    /// results as they come. A node known down gets no request: its
    /// release goes straight to its client's cleanup (listed in the
    /// returned `Vec`), which retries until the node answers. A request
    /// that fails on the way goes there too.
    fn release_all(&self, key: &str, token: &str, patience: Duration) -> (Results<()>, Vec<usize>) {
        let (tx, rx) = mpsc::channel();
        let now = Instant::now();
        let mut deferred = Vec::new();
        for (node, target) in self.nodes.iter().enumerate() {
            if !target.health.admit(now, patience) {
                clean_up_later(&target.client, key, token);
                deferred.push(node);
                continue;
            }
            let (key, token, health) = (key.to_owned(), token.to_owned(), target.health.clone());
            self.send(node, None, &tx, move |client| {
                // Queued behind a request that found the node down: to the
                // cleanup, without waiting on the link again.
                if health.resting(Instant::now()) {
                    clean_up_later(client, &key, &token);
                    return Err(known_down());
                }
                release_one(client, &key, &token)
            });
        }
        (rx, deferred)
    }
}

/// Hands `token` on `key` to the node's client's cleanup, which releases
/// it (owner-checked) once the node answers.
fn clean_up_later(client: &LockClient, key: &str, token: &str) {
    client.orphan(
        key,
        OrphanKind::Plain {
            token: token.into(),
        },
    );
}

/// Undoes a grant of a round that was lost: an owner-checked release
/// announced on a channel nobody listens to (the key's own channel with a
/// suffix, in the same slot and under the same ACL pattern), never the
/// key's. Announced there, it would wake this handle's own head (which
/// subscribes on every node) and every other contender at once, who would
/// try again at once, fail against the same split, undo, and wake each
/// other again: a busy loop for as long as the holder holds a majority
/// but not every node. A grant is undone before anyone could have been
/// waiting for it; the others' next try is paced by their backoff.
fn undo_one(client: &LockClient, key: &str, token: &str) {
    let silent = format!("{}:undone", client.release_channel(key));
    let undone = release::release_on(client, key, &silent, token, Release::Lua);
    if let Err(err) = undone
        && err.may_leave_a_lease()
    {
        clean_up_later(client, key, token);
    }
}

/// One node's owner-checked release; a release that may not have run is
/// handed to the client's cleanup, which finishes it once the node answers.
fn release_one(client: &LockClient, key: &str, token: &str) -> Result<(), Error> {
    release::release(client, key, token, Release::Lua)
        .map(|_| ())
        .inspect_err(|err| {
            if err.may_leave_a_lease() {
                clean_up_later(client, key, token);
            }
        })
}

impl Nodes {
    /// Subscribes to `key`'s release channel on every node that has a
    /// subscriber, waking the queue's head with `waker`; `None` when none
    /// has.
    fn subscribe(&self, key: &str, waker: Waker) -> Option<Box<dyn Feed>> {
        let feeds: Vec<Box<dyn Feed>> = self
            .nodes
            .iter()
            .filter_map(|node| {
                node.client
                    .subscribe(&node.client.release_channel(key), waker.clone())
            })
            .collect();
        if feeds.is_empty() {
            return None;
        }
        Some(Box::new(AnyNode(feeds)))
    }
}

/// The release messages of every node: a release reaches each node it
/// releases, so one live subscription is enough to hear it.
struct AnyNode(Vec<Box<dyn Feed>>);

impl Feed for AnyNode {
    fn is_live(&self) -> bool {
        self.0.iter().any(|feed| feed.is_live())
    }

    fn wait_live(&self, until: Instant) -> bool {
        // Each node in turn for a share of what is left, until one is live
        // (bounded in rounds: a subscription that answers "not live" at
        // once must not make this spin).
        for _ in 0..50 {
            if self.is_live() {
                return true;
            }
            let now = Instant::now();
            let Some(left) = until.checked_duration_since(now) else {
                return false;
            };
            let share = (left / u32::try_from(self.0.len().max(1)).unwrap_or(u32::MAX))
                .max(Duration::from_millis(1));
            for feed in &self.0 {
                if feed.wait_live(later(Instant::now(), share).min(until)) {
                    return true;
                }
            }
        }
        self.is_live()
    }
}

impl std::fmt::Debug for Nodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} nodes", self.nodes.len())
    }
}

/// One acquisition round's outcome, decided once under its mutex: a node's
/// grant that arrives after the round was lost is undone by the node's own
/// thread at once, and one that arrives while it is open is recorded for
/// the caller, so no grant is ever left without someone to release it.
enum RoundState {
    Open,
    Won,
    Lost,
}

/// How a round's `Quorum` error names a node that refused: the lock is
/// another owner's there.
const HELD_ELSEWHERE: &str = "held by another owner";

/// How a round's `Quorum` error names a node whose answer was not waited
/// for: the others had already put the majority out of reach.
const NOT_AWAITED: &str = "not waited for: the majority was out of reach without it";

/// What one node said to one request.
enum Reply {
    Granted,
    Refused,
    Failed(String),
}

impl RedLock {
    /// A RedLock on `key` over `nodes`, with default options.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] without any node.
    pub fn new(nodes: Vec<LockClient>, key: impl Into<String>) -> Result<RedLock, Error> {
        RedLock::with_options(nodes, key, RedLockOptions::default())
    }

    /// A RedLock with the given options.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] without any node, or when the nodes'
    /// clients have different key prefixes.
    pub fn with_options(
        nodes: Vec<LockClient>,
        key: impl Into<String>,
        options: RedLockOptions,
    ) -> Result<RedLock, Error> {
        if nodes.is_empty() {
            return Err(Error::InvalidArgument(
                "RedLock needs at least one node".into(),
            ));
        }
        // One key on every node: the prefix must be one too.
        let prefix = nodes[0].key_prefix();
        if let Some(other) = nodes.iter().find(|node| node.key_prefix() != prefix) {
            return Err(Error::InvalidArgument(format!(
                "RedLock nodes must share one key prefix: {prefix:?} and {:?}",
                other.key_prefix()
            )));
        }
        let key = nodes[0].names().own_key(key.into());
        let meter = nodes[0].clone();
        Ok(RedLock {
            nodes: Arc::new(Nodes::start(nodes)),
            key,
            options,
            meter,
        })
    }

    /// The options it is taken with (read as `lock.options().ttl`,
    /// `lock.options().extra.node_timeout`).
    pub fn options(&self) -> &RedLockOptions {
        &self.options
    }

    /// How long each node may take to answer: the options'
    /// [`RedLockExtra::node_timeout`](crate::RedLockExtra::node_timeout),
    /// or 5 % of the ttl; never more than the ttl.
    pub fn node_timeout(&self) -> Duration {
        self.node_timeout_within(self.options.ttl)
    }

    fn node_timeout_within(&self, ttl: Duration) -> Duration {
        self.options.extra.node_timeout.unwrap_or(ttl / 20).min(ttl)
    }

    /// The lock key as it is in Redis (the same on every node), the nodes'
    /// key prefix included.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Who holds the RedLock now: every node's `status()` read (one
    /// atomic read per node, in parallel, each at most the node timeout;
    /// never a token's secret), judged by the definition of holding a
    /// RedLock: `Some` when a majority of the nodes hold it for the same
    /// holder, with [`HeldLock::remaining`](crate::HeldLock::remaining)
    /// the time until fewer than a majority will (by each node's clock),
    /// and [`HeldLock::holders`](crate::HeldLock::holders) the nodes that
    /// hold it; `None` when no holder can have a majority (what a minority
    /// holds is a lost round's leftover, released or expiring). Changes
    /// nothing.
    ///
    /// # Errors
    ///
    /// [`Error::Quorum`] when too few nodes answered to tell (the nodes
    /// not heard from could make a majority); [`Error::InvalidArgument`]
    /// for an empty key, or a process forked since the lock was made.
    pub fn status(&self) -> Result<Option<HeldLock>, Error> {
        self.nodes.check_process()?;
        if self.key.is_empty() {
            return Err(Error::InvalidArgument(
                "the lock key must not be empty".into(),
            ));
        }
        let timeout = self.node_timeout();
        let started = Instant::now();
        let give_up = later(started, timeout);
        let (tx, rx) = mpsc::channel();
        let mut answers: Vec<Option<Result<Option<Seen>, Error>>> =
            (0..self.nodes.len()).map(|_| None).collect();
        for (node, target) in self.nodes.nodes.iter().enumerate() {
            if !target.health.admit(started, timeout) {
                answers[node] = Some(Err(known_down()));
                continue;
            }
            let key = self.key.clone();
            self.nodes.send(node, Some(give_up), &tx, move |client| {
                seen_on(client, &key)
            });
        }
        drop(tx);
        while answers.iter().any(Option::is_none) {
            let now = Instant::now();
            if now >= give_up {
                break;
            }
            match rx.recv_timeout(give_up - now) {
                Ok((node, sent)) => {
                    if let Some(slot) = answers.get_mut(node) {
                        *slot = Some(match sent {
                            Sent::Done(result) => result,
                            Sent::Abandoned => Err(no_answer(timeout)),
                        });
                    }
                }
                Err(_) => break,
            }
        }
        let answers: Vec<Result<Option<Seen>, Error>> = answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(no_answer(timeout))))
            .collect();
        judge_status(answers, self.quorum(), &self.key)
    }

    /// How many nodes must grant: N/2 + 1.
    pub fn quorum(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    /// Acquires, waiting up to the options' `wait`: by the options'
    /// [`WaitMode`] (woken by any node's release message in notify mode,
    /// the default; polling with backoff in spin mode).
    ///
    /// # Errors
    ///
    /// [`Error::Quorum`] when the last attempt did not gather a majority
    /// (how many granted and which nodes failed); [`Error::InvalidArgument`]
    /// for an empty key or a bad ttl.
    pub fn lock(&self) -> Result<RedLockGuard, Error> {
        let started = Instant::now();
        let mut rounds = Rounds {
            lock: self,
            last: None,
        };
        let subscribe = |waker| self.nodes.subscribe(&self.key, waker);
        let guard = acquire(
            &mut rounds,
            Within::For(self.options.wait).deadline(),
            self.options.backoff,
            self.waiting(&subscribe),
        )
        .and_then(|guard| {
            guard.ok_or_else(|| {
                rounds.last.unwrap_or_else(|| Error::Timeout {
                    holder: None,
                    key: self.key.clone(),
                    waited: started.elapsed(),
                })
            })
        });
        // The last round's `Quorum` with every node that did not grant it
        // held by another owner: held elsewhere, a timeout for the stats.
        let outcome = match &guard {
            Ok(_) => Ok(true),
            Err(Error::Quorum { failed, .. })
                if failed
                    .iter()
                    .all(|f| f.ends_with(HELD_ELSEWHERE) || f.ends_with(NOT_AWAITED)) =>
            {
                Ok(false)
            }
            Err(err) => Err(err),
        };
        self.meter
            .counters()
            .acquire_ended(self.tag(), started, outcome);
        guard
    }

    /// One attempt: `Ok(None)` when no majority granted it.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty key or a bad ttl.
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_lock(&self) -> Result<Option<RedLockGuard>, Error> {
        self.try_within(Within::Once)
    }

    /// Attempts until acquired or `wait` has passed.
    ///
    /// # Errors
    ///
    /// As [`RedLock::try_lock`].
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_lock_for(&self, wait: Duration) -> Result<Option<RedLockGuard>, Error> {
        self.try_within(Within::For(wait))
    }

    /// Attempts until acquired or `deadline` has passed.
    ///
    /// # Errors
    ///
    /// As [`RedLock::try_lock`].
    #[must_use = "the guard is the lock: dropping it at once releases the lock"]
    pub fn try_lock_until(&self, deadline: Instant) -> Result<Option<RedLockGuard>, Error> {
        self.try_within(Within::Until(deadline))
    }

    fn try_within(&self, within: Within) -> Result<Option<RedLockGuard>, Error> {
        let started = Instant::now();
        let mut rounds = Rounds {
            lock: self,
            last: None,
        };
        let subscribe = |waker| self.nodes.subscribe(&self.key, waker);
        let result = acquire(
            &mut rounds,
            within.deadline(),
            self.options.backoff,
            self.waiting(&subscribe),
        );
        self.meter
            .counters()
            .acquisition(self.tag(), started, result)
    }

    /// Waiting by notify: this handle's waiting threads line up in one
    /// queue per key, and the head sleeps until a release message from
    /// any node (every node's release publishes on the key's channel),
    /// never longer than the holder's time left or a backoff step.
    fn waiting<'a>(
        &'a self,
        subscribe: &'a dyn Fn(Waker) -> Option<Box<dyn Feed>>,
    ) -> Waiting<'a, Infallible> {
        if self.options.wait_mode == WaitMode::Spin {
            return Waiting::Spin;
        }
        Waiting::Queued(Queued {
            queues: &self.nodes.queues,
            key: &self.key,
            takes_handoffs: false,
            barge: false,
            intercepts: false,
            on_orphan: &|never: Infallible| match never {},
            subscribe,
        })
    }

    /// This lock's stats tag.
    fn tag(&self) -> Tag {
        Tag {
            kind: LockKind::RedLock,
            class: self.options.key_class,
        }
    }

    /// One round over all nodes. The outer error is the caller's mistake;
    /// the inner one a failed round.
    fn attempt(&self) -> Result<Result<RedLockGuard, Error>, Error> {
        self.nodes.check_process()?;
        if self.key.is_empty() {
            return Err(Error::InvalidArgument(
                "the lock key must not be empty".into(),
            ));
        }
        let millis = ttl_millis(self.options.ttl)?;
        crate::client::check_cluster_key(self.nodes.cluster, &self.key)?;
        let ttl = Duration::from_millis(millis);
        let timeout = self.node_timeout_within(ttl);
        let token = self.meter.new_token_local();
        let started = Instant::now();
        let give_up = later(started, timeout);
        let round = Arc::new(Mutex::new(RoundState::Open));
        let (tx, rx) = mpsc::channel::<(usize, Sent<Reply>)>();
        let mut answers: Vec<Option<Reply>> = (0..self.nodes.len()).map(|_| None).collect();
        let mut pending = Vec::new();
        for (node, target) in self.nodes.nodes.iter().enumerate() {
            if !target.health.admit(started, timeout) {
                answers[node] = Some(Reply::Failed(
                    "known down (it failed recently): not asked".into(),
                ));
                continue;
            }
            pending.push(node);
            let (key, sent_token, round, tx) =
                (self.key.clone(), token.clone(), round.clone(), tx.clone());
            let health = target.health.clone();
            let job: Job = Box::new(move |client| {
                if Instant::now() >= give_up {
                    // Its round is over: never sent, nothing to undo. The
                    // thread reached it too late: the node is slow.
                    health.failed(Instant::now());
                    let _ = tx.send((node, Sent::Abandoned));
                    return;
                }
                let granted = grant(client, &key, &sent_token, millis);
                health.record(&granted);
                let reply = match granted {
                    Ok(true) => Reply::Granted,
                    Ok(false) => Reply::Refused,
                    Err(err) => {
                        // It may have set the key: not counted, so released
                        // by the cleanup once the node answers, whatever
                        // the round's outcome.
                        if err.may_leave_a_lease() {
                            clean_up_later(client, &key, &sent_token);
                        }
                        Reply::Failed(err.to_string())
                    }
                };
                // Sent under the round's lock, so the caller either gets
                // this grant before it decides or the round is decided and
                // a lost round's grant is undone here.
                let state = round.lock();
                if matches!(reply, Reply::Granted) && matches!(*state, RoundState::Lost) {
                    drop(state);
                    undo_one(client, &key, &sent_token);
                    return;
                }
                let _ = tx.send((node, Sent::Done(reply)));
            });
            self.nodes.queue(node, job);
        }
        drop(tx);
        let quorum = self.quorum();
        let granted_count = |answers: &[Option<Reply>]| {
            answers
                .iter()
                .filter(|a| matches!(a, Some(Reply::Granted)))
                .count()
        };
        let take = |answers: &mut Vec<Option<Reply>>, (node, sent): (usize, Sent<Reply>)| {
            let reply = match sent {
                Sent::Done(reply) => reply,
                Sent::Abandoned => Reply::Failed(format!("not sent: no turn within {timeout:?}")),
            };
            if let Some(slot) = answers.get_mut(node) {
                *slot = Some(reply);
            }
        };
        // Until the majority is decided, one way or the other: a round
        // does not wait for nodes it no longer needs.
        loop {
            let granted = granted_count(&answers);
            let open = pending.iter().filter(|n| answers[**n].is_none()).count();
            if granted >= quorum || granted + open < quorum {
                break;
            }
            let now = Instant::now();
            if now >= give_up {
                break;
            }
            match rx.recv_timeout(give_up - now) {
                Ok(result) => take(&mut answers, result),
                Err(_) => break,
            }
        }
        let elapsed = started.elapsed();
        let validity = ttl.checked_sub(elapsed + drift(ttl));
        let won = granted_count(&answers) >= quorum && validity.is_some_and(|v| !v.is_zero());
        {
            let mut state = round.lock();
            *state = if won {
                RoundState::Won
            } else {
                RoundState::Lost
            };
            // Grants sent before the decision: counted for a won round,
            // released below for a lost one.
            while let Ok(result) = rx.try_recv() {
                take(&mut answers, result);
            }
        }
        let now = Instant::now();
        for node in &pending {
            // No answer in time (not merely none needed, once the majority
            // was decided): not asked again for a while.
            if answers[*node].is_none() && now >= give_up {
                self.nodes.nodes[*node].health.failed(now);
            }
        }
        let granted = granted_count(&answers);
        if won {
            // ttl − drift from the round's start, whatever came after.
            let valid_until = started + elapsed + validity.unwrap_or_default();
            let timing = Arc::new(Mutex::new(Timing {
                valid_until,
                ttl,
                generation: 0,
            }));
            let loss: Arc<LossState> = Arc::default();
            let renewer = self.options.watchdog.then(|| {
                Renewal {
                    meter: self.meter.clone(),
                    tag: self.tag(),
                    nodes: self.nodes.clone(),
                    key: self.key.clone(),
                    token: token.clone(),
                    timeout,
                    timing: timing.clone(),
                    loss: loss.clone(),
                    cap: self
                        .options
                        .max_hold
                        .and_then(|cap| started.checked_add(cap)),
                    stop: Arc::default(),
                }
                .start(started)
            });
            return Ok(Ok(RedLockGuard {
                nodes: self.nodes.clone(),
                key: self.key.clone(),
                token,
                timing,
                timeout,
                released: false,
                meter: self.meter.clone(),
                tag: self.tag(),
                held_since: Instant::now(),
                loss,
                renewer,
            }));
        }
        // A lost round: the nodes that granted are released now, in the
        // background (their threads are free); the ones still working
        // release their own grant when it comes.
        for (node, answer) in answers.iter().enumerate() {
            if matches!(answer, Some(Reply::Granted)) {
                let (key, sent_token) = (self.key.clone(), token.clone());
                self.nodes.queue(
                    node,
                    Box::new(move |client| undo_one(client, &key, &sent_token)),
                );
            }
        }
        let mut failed: Vec<String> = answers
            .iter()
            .enumerate()
            .filter_map(|(node, answer)| match answer {
                Some(Reply::Granted) => None,
                Some(Reply::Refused) => Some(format!("node {node}: {HELD_ELSEWHERE}")),
                Some(Reply::Failed(why)) => Some(format!("node {node}: {why}")),
                None if elapsed < timeout => Some(format!("node {node}: {NOT_AWAITED}")),
                None => Some(format!("node {node}: no answer within {timeout:?}")),
            })
            .collect();
        if granted >= quorum {
            failed.push(format!("the round took {elapsed:?} of the {ttl:?} ttl"));
        }
        Ok(Err(Error::Quorum {
            key: self.key.clone(),
            granted,
            needed: quorum,
            failed,
        }))
    }
}

/// RedLock rounds, seen by the acquire loop; keeps the last failed round
/// to report it.
struct Rounds<'a> {
    lock: &'a RedLock,
    last: Option<Error>,
}

impl Contender for Rounds<'_> {
    type Won = RedLockGuard;
    type Gift = Infallible;

    fn attempt(&mut self, _quick: bool) -> Result<Attempt<RedLockGuard>, Error> {
        Ok(match self.lock.attempt()? {
            Ok(guard) => Attempt::Won(guard),
            Err(failure) => {
                self.last = Some(failure);
                Attempt::Held(None)
            }
        })
    }

    fn accept(&mut self, gift: Infallible) -> Result<Option<RedLockGuard>, Error> {
        match gift {}
    }
}

/// A RedLock held on a majority of nodes. Dropping it releases it on every
/// node (best effort); [`RedLockGuard::unlock`] reports.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct RedLockGuard {
    nodes: Arc<Nodes>,
    key: String,
    token: String,
    /// Until when the lock is valid by the local clock, and the ttl last
    /// set (shared with the renewal thread, when there is one).
    timing: Arc<Mutex<Timing>>,
    /// The node timeout: how long extend, unlock and drop wait at most.
    timeout: Duration,
    released: bool,
    /// Where the stats go (the first node's client), and as what.
    meter: LockClient,
    tag: Tag,
    /// When this hold began.
    held_since: Instant,
    /// Set when the nodes' answers to an extension, a renewal or
    /// `is_held` rule a majority out, or (renewed) from the validity's end
    /// when no renewal confirmed it.
    loss: Arc<LossState>,
    /// Stops the renewal thread, when the lock is renewed.
    renewer: Option<Arc<Stop>>,
}

/// A RedLock's validity by the local clock.
#[derive(Debug)]
struct Timing {
    valid_until: Instant,
    ttl: Duration,
    /// Bumped by every extension: one that began before another ended
    /// cannot tell which of the two the nodes ran last.
    generation: u64,
}

impl Timing {
    /// An extension begun at `generation` made the lock valid until
    /// `valid_until` for `ttl`; when another ended meanwhile, the earlier
    /// of the two is kept.
    fn extended(&mut self, valid_until: Instant, ttl: Duration, generation: u64) {
        if self.generation == generation || valid_until < self.valid_until {
            self.valid_until = valid_until;
            self.ttl = ttl;
        }
        self.generation = self.generation.wrapping_add(1);
    }
}

/// How a renewal thread is told its lock was released.
#[derive(Debug, Default)]
struct Stop {
    stopped: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

impl Stop {
    fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        let _held = self.lock.lock();
        self.wake.notify_all();
    }

    fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    /// Runs `f` unless stopped, under the lock a stop takes: what a
    /// renewal records cannot land after the release began.
    fn unless_stopped(&self, f: impl FnOnce()) -> bool {
        let _held = self.lock.lock();
        if self.is_stopped() {
            return false;
        }
        f();
        true
    }

    /// Sleeps until `until` or a stop; whether stopped.
    fn sleep_until(&self, until: Instant) -> bool {
        let mut held = self.lock.lock();
        while !self.is_stopped() && Instant::now() < until {
            let _ = self.wake.wait_until(&mut held, until);
        }
        self.is_stopped()
    }
}

/// How soon a renewal that did not reach a majority is tried again.
const RENEW_RETRY: Duration = Duration::from_millis(100);

/// The renewal of one RedLock held with the watchdog: a thread of its own
/// that extends it on every node every ttl/3 and reports a loss by the
/// same rules as [`RedLockGuard::extend`](crate::Lease::extend). (The
/// client's watchdog renews leases of one deployment; a RedLock spans
/// several, and must hear a majority of them each time.)
struct Renewal {
    /// Where the renewals are counted (the first node's client), and as
    /// what.
    meter: LockClient,
    tag: Tag,
    nodes: Arc<Nodes>,
    key: String,
    token: String,
    timeout: Duration,
    timing: Arc<Mutex<Timing>>,
    loss: Arc<LossState>,
    cap: Option<Instant>,
    stop: Arc<Stop>,
}

impl Renewal {
    /// Starts the thread; the lock was acquired by a round begun at
    /// `started`. Without a thread (the system refused one) the lock is
    /// not renewed: it reads as lost from its validity's end.
    fn start(self, started: Instant) -> Arc<Stop> {
        let stop = self.stop.clone();
        let valid_until = self.timing.lock().valid_until;
        self.loss.expire_at(valid_until, LossReason::Unreachable);
        // Detached: it ends by itself within a node timeout of the stop.
        let spawned =
            crate::conn::worker::Worker::spawn("redmutex-renew", move || self.run(started));
        if let Err(err) = spawned {
            log::warn!("redmutex: cannot start a RedLock renewal thread: {err}");
        }
        stop
    }

    fn run(self, acquired: Instant) {
        let mut next = later(acquired, self.timing.lock().ttl / 3);
        loop {
            if self.stop.sleep_until(next) || self.loss.reason().is_some() {
                return;
            }
            let now = Instant::now();
            let (valid_until, ttl, generation) = {
                let timing = self.timing.lock();
                (timing.valid_until, timing.ttl, timing.generation)
            };
            if self.cap.is_some_and(|cap| now >= cap) {
                // No more renewals: the lock runs out, and says why.
                self.stop.unless_stopped(|| {
                    self.loss.expire_at(valid_until, LossReason::MaxHold);
                });
                return;
            }
            let started = Instant::now();
            let (verdict, _, _, validity) = extend_round(
                &self.nodes,
                &self.key,
                &self.token,
                self.timeout,
                ttl,
                started,
            );
            if self.stop.is_stopped() {
                // Released meanwhile: what this round found is no news.
                return;
            }
            let confirmed =
                matches!(verdict, Verdict::Confirmed) && validity.is_some_and(|v| !v.is_zero());
            let stats = self.meter.counters();
            stats.renewal_round(1);
            stats.renewals_of(self.tag, 1, u64::from(!confirmed));
            match (verdict, validity) {
                (Verdict::Confirmed, Some(validity)) if !validity.is_zero() => {
                    let until = later(started, validity);
                    let recorded = self.stop.unless_stopped(|| {
                        let mut timing = self.timing.lock();
                        timing.extended(until, ttl, generation);
                        self.loss
                            .expire_at(timing.valid_until, LossReason::Unreachable);
                    });
                    if !recorded {
                        return;
                    }
                    next = later(started, ttl / 3);
                }
                (Verdict::NotHeld(reason), _) => {
                    self.stop.unless_stopped(|| self.loss.lose(reason));
                    return;
                }
                // Not known: a majority may still hold it. Tried again
                // until the validity ends (the loss state then fires).
                _ => next = Instant::now() + RENEW_RETRY,
            }
        }
    }
}

/// What one node holds under the key: its status read, and the token
/// itself when it is a plain lock's (what tells two holders apart, whatever
/// their metadata; never shown).
struct Seen {
    held: HeldLock,
    token: Option<String>,
}

/// One node's answer to [`RedLock::status`]: its status read (atomic), and
/// for a plain lock the token, read next and kept only when it is still
/// the holder the status read named (else the answer is a failure: the key
/// changed between the two reads).
fn seen_on(client: &LockClient, key: &str) -> Result<Option<Seen>, Error> {
    let Some(held) = client.status_of(key)? else {
        return Ok(None);
    };
    if held.kind != LockKind::Mutex {
        return Ok(Some(Seen { held, token: None }));
    }
    client.counters().commands(1);
    let token: Option<String> = client.run(Op::Read, key, |con, _| {
        redis::cmd("GET").arg(key).query(con)
    })?;
    match token {
        Some(token)
            if crate::client::holder::Holder::from_token(&token).as_ref()
                == held.held_by.first() =>
        {
            Ok(Some(Seen {
                held,
                token: Some(token),
            }))
        }
        _ => Err(Error::Redis(redis::RedisError::from((
            redis::ErrorKind::Client,
            "the key changed between its two reads",
        )))),
    }
}

/// What the nodes' status reads say of the RedLock as a whole: the holder
/// a majority shares (the same token; for another type's data, the same
/// type and holders), or none when no holder can reach one, or unknown
/// when the nodes not heard from decide.
fn judge_status(
    answers: Vec<Result<Option<Seen>, Error>>,
    quorum: usize,
    key: &str,
) -> Result<Option<HeldLock>, Error> {
    let unanswered = answers.iter().filter(|a| a.is_err()).count();
    // Each holder seen, with the nodes that hold it.
    let mut groups: Vec<(&Seen, Vec<Option<Duration>>)> = Vec::new();
    for seen in answers.iter().filter_map(|a| a.as_ref().ok()).flatten() {
        let same = |other: &Seen| match (&other.token, &seen.token) {
            (Some(a), Some(b)) => a == b,
            (None, None) => {
                other.held.kind == seen.held.kind && other.held.held_by == seen.held.held_by
            }
            _ => false,
        };
        match groups.iter_mut().find(|(first, _)| same(first)) {
            Some((_, remaining)) => remaining.push(seen.held.remaining),
            None => groups.push((seen, vec![seen.held.remaining])),
        }
    }
    let largest = groups.iter().map(|(_, r)| r.len()).max().unwrap_or(0);
    if let Some((seen, mut remaining)) = groups.into_iter().find(|(_, r)| r.len() >= quorum) {
        // Held by a majority until the quorum-th longest lease ends (no
        // expiry, `None`, lasts longest).
        remaining.sort_by(|a, b| match (a, b) {
            (None, None) => std::cmp::Ordering::Equal,
            (None, Some(_)) => std::cmp::Ordering::Less,
            (Some(_), None) => std::cmp::Ordering::Greater,
            (Some(a), Some(b)) => b.cmp(a),
        });
        let holders = u32::try_from(remaining.len()).unwrap_or(u32::MAX);
        return Ok(Some(HeldLock {
            remaining: remaining.get(quorum.saturating_sub(1)).copied().flatten(),
            holders,
            ..seen.held.clone()
        }));
    }
    if largest + unanswered < quorum {
        return Ok(None);
    }
    Err(Error::Quorum {
        key: key.to_owned(),
        granted: largest,
        needed: quorum,
        failed: answers
            .iter()
            .enumerate()
            .filter_map(|(node, a)| a.as_ref().err().map(|err| format!("node {node}: {err}")))
            .collect(),
    })
}

/// One extension of `token` to `ttl` on every node not known down, in
/// parallel, begun at `started`: the verdict, the tally, each node's
/// answer, and the validity left (ttl − the round's duration − drift).
fn extend_round(
    nodes: &Arc<Nodes>,
    key: &str,
    token: &str,
    timeout: Duration,
    ttl: Duration,
    started: Instant,
) -> (Verdict, Tally, Vec<Result<(), Error>>, Option<Duration>) {
    // A ttl that came through ttl_millis: whole milliseconds, bounded.
    let millis = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
    let (tally, results) = ask_nodes(
        nodes,
        key,
        token,
        timeout,
        started,
        move |client, key, token| {
            client.counters().commands(1);
            let reply: i64 = client.run(Op::Extend, key, |con, _| {
                script::EXTEND.key(key).arg(token).arg(millis).invoke(con)
            })?;
            script::owner_checked(reply).map_err(|reason| Error::not_held(key, reason))
        },
    );
    let validity = ttl.checked_sub(started.elapsed() + drift(ttl));
    (tally.verdict(), tally, results, validity)
}

impl std::fmt::Debug for RedLockGuard {
    // The token is a capability: only its public part is shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedLockGuard")
            .field("key", &self.key)
            .field("token", &Redacted(&self.token))
            .field("nodes", &self.nodes)
            .field("validity", &self.validity())
            .finish_non_exhaustive()
    }
}

impl RedLockGuard {
    /// The token written on the nodes: a random secret and the holder
    /// metadata of the first node's client ([`Holder::from_token`](crate::Holder::from_token)).
    pub fn token(&self) -> &str {
        &self.token
    }

    fn release(&mut self) -> Result<(), Error> {
        self.released = true;
        // A forked child's copy: refused, nothing asked of any node (and
        // the renewal thread, the parent's, left alone).
        self.nodes.check_process()?;
        self.stop_renewing();
        let result = self.let_go();
        self.meter
            .counters()
            .release(self.tag, Some(self.held_since), false, result)
    }

    fn let_go(&mut self) -> Result<(), Error> {
        let started = Instant::now();
        let give_up = later(started, self.timeout);
        let (rx, deferred) = self.nodes.release_all(&self.key, &self.token, self.timeout);
        let mut results: Vec<Option<Result<(), Error>>> =
            (0..self.nodes.len()).map(|_| None).collect();
        for node in &deferred {
            results[*node] = Some(Err(known_down()));
        }
        let pending = self.nodes.len().saturating_sub(deferred.len());
        let tally = collect(&rx, &mut results, pending, give_up, self.timeout);
        let now = Instant::now();
        for (node, result) in results.iter().enumerate() {
            // Not heard from by the deadline (not merely not needed once a
            // majority answered).
            if result.is_none()
                && now >= give_up
                && let Some(target) = self.nodes.nodes.get(node)
            {
                // Its release goes on in the background; later requests
                // do not wait for it meanwhile.
                target.health.failed(now);
            }
        }
        let results = settle(results, self.timeout);
        match tally.verdict() {
            Verdict::Confirmed => {
                let rest = failures(&results);
                if !rest.is_empty() {
                    log::debug!(
                        "redmutex: RedLock {:?} released on a majority; the rest in the background: {}",
                        self.key,
                        rest.join("; ")
                    );
                }
                Ok(())
            }
            Verdict::NotHeld(reason) => Err(Error::not_held(&self.key, reason)),
            Verdict::Unknown => Err(Error::NodesUnreachable {
                key: self.key.clone(),
                released: tally.confirmed,
                nodes: self.nodes.len(),
                failed: failures(&results),
            }),
        }
    }
}

impl RedLockGuard {
    /// [`ask_nodes`] about this guard's key and token.
    fn ask_every_node(
        &self,
        started: Instant,
        ask: impl Fn(&LockClient, &str, &str) -> Result<(), Error> + Clone + Send + 'static,
    ) -> (Tally, Vec<Result<(), Error>>) {
        ask_nodes(
            &self.nodes,
            &self.key,
            &self.token,
            self.timeout,
            started,
            ask,
        )
    }

    /// Stops the renewals, if any, before the lock is let go: the lease's
    /// signal then keeps a local expiry already passed, and no other (a
    /// lock released in time is no loss).
    fn stop_renewing(&self) {
        if let Some(stop) = &self.renewer {
            stop.stop();
            self.loss.forget_deadline();
        }
    }
}

/// Sends `ask` (about `key` and `token`) to every node not known down, in
/// parallel, and collects the answers until the verdict is final or
/// `timeout` from `started` passed: the tally, and every node's answer
/// (none in time counts as a failure).
fn ask_nodes(
    nodes: &Arc<Nodes>,
    key: &str,
    token: &str,
    timeout: Duration,
    started: Instant,
    ask: impl Fn(&LockClient, &str, &str) -> Result<(), Error> + Clone + Send + 'static,
) -> (Tally, Vec<Result<(), Error>>) {
    let give_up = later(started, timeout);
    let (tx, rx) = mpsc::channel();
    let mut results: Vec<Option<Result<(), Error>>> = (0..nodes.len()).map(|_| None).collect();
    let mut pending = 0usize;
    for (node, target) in nodes.nodes.iter().enumerate() {
        if !target.health.admit(started, timeout) {
            results[node] = Some(Err(known_down()));
            continue;
        }
        pending += 1;
        let (key, token, ask) = (key.to_owned(), token.to_owned(), ask.clone());
        nodes.send(node, Some(give_up), &tx, move |client| {
            ask(client, &key, &token)
        });
    }
    drop(tx);
    let tally = collect(&rx, &mut results, pending, give_up, timeout);
    (tally, settle(results, timeout))
}

impl crate::lease::sealed::Sealed for RedLockGuard {}

impl crate::lease::Lease for RedLockGuard {
    /// The lock key.
    fn key(&self) -> &str {
        &self.key
    }

    /// What is left of the validity: ttl − the acquisition's (or last
    /// extension's) duration − drift, counted down by the local clock;
    /// zero once released or lost.
    fn validity(&self) -> Duration {
        if self.released || self.is_lost() {
            return Duration::ZERO;
        }
        self.timing
            .lock()
            .valid_until
            .saturating_duration_since(Instant::now())
    }

    /// Whether the lock was found lost: an extension or `is_held` heard so
    /// many nodes answer "not ours" that no majority can hold our token
    /// ([`LossReason::Expired`], or [`LossReason::OwnedByOther`] when one
    /// of them holds another owner's). An answer that leaves it unknown
    /// ([`Error::QuorumLost`]) is no loss: the validity is zero then, and a
    /// later extension a majority confirms restores it. Always true in a
    /// process forked since it was taken.
    fn is_lost(&self) -> bool {
        self.meter.inherited() || self.loss.reason().is_some()
    }

    /// A signal, usable from any thread and after the guard is gone, that
    /// fires when the lock is found lost.
    fn loss_signal(&self) -> LossSignal {
        LossSignal {
            state: self.loss.clone(),
        }
    }

    fn fencing_token(&self) -> Option<u64> {
        None
    }

    /// Asks every node (in parallel, each at most the node timeout, never a
    /// node known down) whether it holds our token, and answers from the
    /// definition of holding a RedLock: `true` when a majority holds it,
    /// `false` when so many nodes do not that no majority can (then the
    /// lock is lost: [`RedLockGuard::is_lost`]). Changes nothing on the
    /// nodes.
    ///
    /// # Errors
    ///
    /// [`Error::QuorumLost`] when neither is known (nodes unreachable, too
    /// slow or failing may hold it or not); [`Error::InvalidArgument`] for
    /// a guard inherited through `fork()` (nothing is asked).
    fn is_held(&self) -> Result<bool, Error> {
        self.nodes.check_process()?;
        if self.released {
            return Ok(false);
        }
        let (tally, results) = self.ask_every_node(Instant::now(), |client, key, token| {
            client.counters().commands(1);
            // A read: a lost reply is asked again.
            let value: Option<Vec<u8>> = client.run(Op::Read, key, |con, _| {
                redis::cmd("GET").arg(key).query(con)
            })?;
            match value {
                Some(value) if value == token.as_bytes() => Ok(()),
                Some(_) => Err(Error::not_held(key, LossReason::OwnedByOther)),
                None => Err(Error::not_held(key, LossReason::Expired)),
            }
        });
        match tally.verdict() {
            Verdict::Confirmed => Ok(true),
            Verdict::NotHeld(reason) => {
                self.loss.lose(reason);
                Ok(false)
            }
            Verdict::Unknown => Err(Error::QuorumLost {
                key: self.key.clone(),
                extended: tally.confirmed,
                needed: tally.quorum,
                failed: failures(&results),
            }),
        }
    }

    /// Extends the lease to `ttl` on every node (owner-checked, in
    /// parallel); succeeds as soon as a majority extended in time. Waits at
    /// most the node timeout, and never for a node known down (see
    /// [`RedLock`]): a request its node's thread could not start in time
    /// is dropped unsent. When no majority extended, the answer does not
    /// depend on which nodes answered first: every node is waited for
    /// (within the node timeout).
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] only when so many nodes answered that they do
    /// not hold our token that no majority can (more than the nodes a
    /// majority can do without): [`LossReason::OwnedByOther`] when one
    /// of them holds another owner's token, [`LossReason::Expired`]
    /// when none does; [`Error::QuorumLost`] when neither a majority
    /// extended in time nor is one ruled out (nodes unreachable, too slow
    /// or failing may still hold it), or the extension took the whole ttl:
    /// either way the lock must be considered lost, and its validity is
    /// zero until an extension a majority confirms (a `NotHeld` is a
    /// loss: `is_lost()` true from then on);
    /// [`Error::InvalidArgument`] for a bad ttl, and for a guard inherited
    /// through `fork()`.
    fn extend(&mut self, ttl: Duration) -> Result<(), Error> {
        self.nodes.check_process()?;
        let millis = ttl_millis(ttl)?;
        let ttl = Duration::from_millis(millis);
        let generation = self.timing.lock().generation;
        let started = Instant::now();
        let (verdict, tally, results, validity) = extend_round(
            &self.nodes,
            &self.key,
            &self.token,
            self.timeout,
            ttl,
            started,
        );
        if let (Verdict::Confirmed, Some(validity)) = (verdict, validity)
            && !validity.is_zero()
        {
            let mut timing = self.timing.lock();
            timing.extended(later(started, validity), ttl, generation);
            if self.renewer.is_some() {
                self.loss
                    .expire_at(timing.valid_until, LossReason::Unreachable);
            }
            return Ok(());
        }
        // Some nodes may have taken the new, shorter ttl: nothing is
        // promised any more.
        {
            let mut timing = self.timing.lock();
            timing.valid_until = Instant::now();
            timing.generation = timing.generation.wrapping_add(1);
        }
        match verdict {
            Verdict::NotHeld(reason) => {
                self.loss.lose(reason);
                Err(Error::not_held(&self.key, reason))
            }
            // Unknown is not lost: a majority may still hold our token (a
            // later extension may confirm it); the validity is zero.
            Verdict::Confirmed | Verdict::Unknown => Err(Error::QuorumLost {
                key: self.key.clone(),
                extended: tally.confirmed,
                needed: tally.quorum,
                failed: failures(&results),
            }),
        }
    }

    /// Releases on every node (owner-checked, in parallel), and returns as
    /// soon as a majority released our token: the lock is free for others
    /// then. Waits at most the node timeout, and never for a node known
    /// down; the nodes not heard from are released in the background (by
    /// their node thread, or their client's cleanup once they answer), and
    /// their keys expire by the ttl at worst. When no majority released,
    /// every node is waited for (within the node timeout), so the answer
    /// does not depend on which nodes answered first.
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] only when so many nodes answered that they do
    /// not hold our token that no majority can (more than the nodes a
    /// majority can do without): [`LossReason::OwnedByOther`] when one
    /// of them holds another owner's token (another client may hold the
    /// RedLock), [`LossReason::Expired`] when none does (the lease had
    /// run out); [`Error::NodesUnreachable`] when neither a majority
    /// released in time nor is one ruled out: the nodes not heard from
    /// (unreachable, too slow, failing) decide, and are released in the
    /// background (how many released, and what each failed node met);
    /// [`Error::InvalidArgument`] for a guard inherited through `fork()`.
    fn unlock(mut self) -> Result<crate::lease::Unlocked, Error> {
        self.release().map(|()| crate::lease::Unlocked::Released)
    }
}

/// One node's answer to an owner-checked release or extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    /// It held our token, and released or extended it.
    Confirmed,
    /// The key was gone.
    Expired,
    /// The key held another owner's token (or another type's data).
    Taken,
    /// No answer: unreachable, too slow, or an error reply.
    Failed,
}

impl Answer {
    fn of(result: &Result<(), Error>) -> Answer {
        match result {
            Ok(()) => Answer::Confirmed,
            Err(err) => match err.not_held_reason() {
                Some(LossReason::Expired) => Answer::Expired,
                Some(_) => Answer::Taken,
                None if matches!(err, Error::WrongType { .. }) => Answer::Taken,
                None => Answer::Failed,
            },
        }
    }
}

/// What the nodes' answers to a release or an extension say about the
/// lock as a whole, from the definition of holding a RedLock (our token on
/// a majority of all the nodes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    /// A majority answered that it held our token, and did as asked.
    Confirmed,
    /// So many nodes answered "not ours" (the key gone, or another
    /// owner's) that no majority can hold our token: another owner's token
    /// on any of them is `OwnedByOther`, else `Expired`.
    NotHeld(LossReason),
    /// Neither: the nodes not heard from (unreachable, too slow, an error
    /// reply) may or may not hold our token, and they decide.
    Unknown,
}

/// The answers so far to a request sent to `nodes` nodes, and the verdict
/// they give. Decided on every answer that can arrive, never on the order
/// they arrive in: the caller stops waiting only once the verdict is
/// [`Tally::is_final`], that is, no answer still to come could change it.
#[derive(Clone, Copy, Debug)]
struct Tally {
    nodes: usize,
    quorum: usize,
    confirmed: usize,
    expired: usize,
    taken: usize,
    /// Nodes whose answer may still come.
    pending: usize,
}

impl Tally {
    fn new(nodes: usize, pending: usize) -> Tally {
        Tally {
            nodes,
            quorum: nodes / 2 + 1,
            confirmed: 0,
            expired: 0,
            taken: 0,
            pending: pending.min(nodes),
        }
    }

    fn record(&mut self, answer: Answer) {
        self.pending = self.pending.saturating_sub(1);
        match answer {
            Answer::Confirmed => self.confirmed += 1,
            Answer::Expired => self.expired += 1,
            Answer::Taken => self.taken += 1,
            Answer::Failed => {}
        }
    }

    /// Nodes that answered "not ours".
    fn not_ours(&self) -> usize {
        self.expired + self.taken
    }

    /// How many "not ours" answers rule a majority out: more than the
    /// nodes a majority can do without.
    fn ruled_out(&self, not_ours: usize) -> bool {
        not_ours > self.nodes - self.quorum
    }

    fn verdict(&self) -> Verdict {
        if self.confirmed >= self.quorum {
            Verdict::Confirmed
        } else if self.ruled_out(self.not_ours()) {
            Verdict::NotHeld(if self.taken > 0 {
                LossReason::OwnedByOther
            } else {
                LossReason::Expired
            })
        } else {
            Verdict::Unknown
        }
    }

    /// Whether every way the pending answers could go gives the verdict
    /// there is now: nothing is pending; or a majority confirmed; or a
    /// majority is ruled out and another owner's token was heard (a later
    /// answer could only turn `Expired` into `OwnedByOther`); or the
    /// pending answers can neither make a majority confirm nor rule one
    /// out (the verdict stays unknown).
    fn is_final(&self) -> bool {
        self.pending == 0
            || self.confirmed >= self.quorum
            || (self.ruled_out(self.not_ours()) && self.taken > 0)
            || (self.confirmed + self.pending < self.quorum
                && !self.ruled_out(self.not_ours() + self.pending))
    }
}

/// Collects the nodes' answers to a release or an extension into
/// `results` until the verdict is final, or `give_up` passed; a request
/// dropped unsent counts as no answer in `timeout`. Returns the tally
/// (the nodes not heard from by then count as failed).
fn collect(
    rx: &Results<()>,
    results: &mut [Option<Result<(), Error>>],
    pending: usize,
    give_up: Instant,
    timeout: Duration,
) -> Tally {
    let mut tally = Tally::new(results.len(), pending);
    let mut take = |tally: &mut Tally, (node, sent): (usize, Sent<Result<(), Error>>)| {
        let result = match sent {
            Sent::Done(result) => result,
            Sent::Abandoned => Err(no_answer(timeout)),
        };
        tally.record(Answer::of(&result));
        if let Some(slot) = results.get_mut(node) {
            *slot = Some(result);
        }
    };
    while !tally.is_final() {
        let Some(left) = give_up.checked_duration_since(Instant::now()) else {
            break;
        };
        match rx.recv_timeout(left) {
            Ok(answer) => take(&mut tally, answer),
            Err(_) => break,
        }
    }
    // Answers that came in time but were not read by then (this thread
    // stopped, say) count too: what the nodes said is the answer, not
    // how soon this thread looked.
    while !tally.is_final() {
        match rx.try_recv() {
            Ok(answer) => take(&mut tally, answer),
            Err(_) => break,
        }
    }
    tally
}

/// A node not asked because it failed recently.
fn known_down() -> Error {
    Error::Redis(redis::RedisError::from((
        redis::ErrorKind::Io,
        "known down (it failed recently): not waited for; released in the background once it answers",
    )))
}

fn no_answer(timeout: Duration) -> Error {
    Error::Redis(redis::RedisError::from((
        redis::ErrorKind::Io,
        "no answer from the node in time",
        format!("within {timeout:?}"),
    )))
}

/// A node that did not answer in time counts as a connection failure.
fn settle(results: Vec<Option<Result<(), Error>>>, timeout: Duration) -> Vec<Result<(), Error>> {
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(no_answer(timeout))))
        .collect()
}

fn failures(results: &[Result<(), Error>]) -> Vec<String> {
    results
        .iter()
        .enumerate()
        .filter_map(|(node, r)| r.as_ref().err().map(|e| format!("node {node}: {e}")))
        .collect()
}

impl Drop for RedLockGuard {
    fn drop(&mut self) {
        // A forked child's copy of its parent's RedLock: not the child's.
        if self.meter.inherited() {
            self.released = true;
        }
        if !self.released
            && let Err(err) = self.release()
        {
            log::warn!("redmutex: releasing RedLock {:?} on drop: {err}", self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A node that keeps failing is left alone 250 ms, then twice as long
    /// after each failure, at most 5 s (docs/deployments.md).
    #[test]
    fn a_failed_node_rests_250_ms_doubling_to_5_s() {
        let ms: Vec<u128> = (1..=8).map(|n| rest(n).as_millis()).collect();
        assert_eq!(ms, vec![250, 500, 1000, 2000, 4000, 5000, 5000, 5000]);
        assert_eq!(rest(u32::MAX), Duration::from_secs(5));
        let health = Health {
            down: Mutex::new(None),
            busy_since: Mutex::new(None),
        };
        let now = Instant::now();
        let patience = Duration::from_secs(1);
        assert!(health.admit(now, patience), "healthy");
        health.failed(now);
        assert!(health.resting(now + Duration::from_millis(249)));
        assert!(!health.admit(now + Duration::from_millis(249), patience));
        // The probe after 250 ms; the node rests again while it is out.
        let probe = now + Duration::from_millis(250);
        assert!(health.admit(probe, patience), "probed after its rest");
        assert!(!health.admit(probe, patience), "one probe");
        health.failed(probe);
        assert!(health.resting(probe + Duration::from_millis(499)));
        assert!(!health.resting(probe + Duration::from_millis(500)));
        health.answered();
        assert!(health.admit(probe, patience), "up again");
    }

    /// A node may take 5 % of the ttl to answer unless set otherwise
    /// (never more than the ttl).
    #[test]
    fn the_node_timeout_is_5_percent_of_the_ttl_by_default() {
        let node = || LockClient::open("redis://127.0.0.1:1/").expect("client");
        let options = RedLockOptions::default().ttl(Duration::from_secs(10));
        let lock =
            RedLock::with_options(vec![node(), node(), node()], "k", options).expect("redlock");
        assert_eq!(lock.node_timeout(), Duration::from_millis(500));
        let lock = RedLock::with_options(
            vec![node(), node(), node()],
            "k",
            options.node_timeout(Duration::from_secs(60)),
        )
        .expect("redlock");
        assert_eq!(
            lock.node_timeout(),
            Duration::from_secs(10),
            "at most the ttl"
        );
        let lock = RedLock::with_options(
            vec![node(), node(), node()],
            "k",
            RedLockOptions::default().ttl(Duration::from_millis(200)),
        )
        .expect("redlock");
        assert_eq!(lock.node_timeout(), Duration::from_millis(10));
    }

    /// What one node holds when a release or an extension reaches it.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Truth {
        /// Our token.
        Ours,
        /// Nothing: it never had our token, or lost it.
        Gone,
        /// Another owner's token.
        Theirs,
    }

    /// The definition of the answers, written from the node's truths alone
    /// (not from [`Tally`]): `heard[i]` says whether node i's answer came in
    /// time. The lock is held when our token is on a majority of all the
    /// nodes. `Confirmed` only when a majority was heard holding it;
    /// `NotHeld` only when so many were heard not holding it that no
    /// majority can (more than the nodes a majority can do without), and
    /// `OwnedByOther` when one of those held another owner's token;
    /// otherwise unknown.
    fn oracle(truths: &[Truth], heard: &[bool]) -> Verdict {
        let n = truths.len();
        let majority = n / 2 + 1;
        let heard_as = |want: &dyn Fn(Truth) -> bool| {
            truths
                .iter()
                .zip(heard)
                .filter(|(truth, heard)| **heard && want(**truth))
                .count()
        };
        let holding = heard_as(&|t| t == Truth::Ours);
        let not_holding = heard_as(&|t| t != Truth::Ours);
        if holding >= majority {
            Verdict::Confirmed
        } else if n - not_holding < majority {
            Verdict::NotHeld(if heard_as(&|t| t == Truth::Theirs) > 0 {
                LossReason::OwnedByOther
            } else {
                LossReason::Expired
            })
        } else {
            Verdict::Unknown
        }
    }

    fn answer_of(truth: Truth) -> Answer {
        match truth {
            Truth::Ours => Answer::Confirmed,
            Truth::Gone => Answer::Expired,
            Truth::Theirs => Answer::Taken,
        }
    }

    fn truth() -> impl Strategy<Value = Truth> {
        prop_oneof![Just(Truth::Ours), Just(Truth::Gone), Just(Truth::Theirs)]
    }

    /// One node as the caller sees it: asked or known down (not asked),
    /// what it holds, whether it fails (an error reply: no answer), and
    /// when its answer arrives on a fake clock (`None`: never; at or after
    /// the node timeout: late).
    fn node() -> impl Strategy<Value = (bool, Truth, bool, Option<u32>)> {
        (
            proptest::bool::weighted(0.9),
            truth(),
            proptest::bool::weighted(0.1),
            proptest::option::of(0u32..100),
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        /// The loop in `collect`, run against simulated nodes on a fake
        /// clock with the node timeout at 60: whatever the nodes hold, when
        /// (and whether) they answer and the order of answers arriving
        /// together, the verdict is the definition's over the answers
        /// heard in time; and it never contradicts what the nodes hold: no
        /// `Confirmed` unless a majority holds our token, no `NotHeld` while
        /// a majority does (late answers, known-down nodes and failing ones
        /// included).
        #[test]
        fn the_verdict_is_the_definitions_whatever_the_order_and_timing(
            nodes in proptest::collection::vec(node(), 1..8),
            shuffle in proptest::collection::vec(any::<u32>(), 8),
        ) {
            let give_up = 60u32;
            let n = nodes.len();
            let asked = nodes.iter().filter(|(asked, ..)| *asked).count();
            // Arrivals in time order, ties broken by the shuffle.
            let mut arrivals: Vec<(u32, u32, usize)> = nodes
                .iter()
                .enumerate()
                .filter_map(|(i, (asked, _, _, at))| {
                    let at = (*at)?;
                    asked.then_some((at, shuffle[i % shuffle.len()], i))
                })
                .collect();
            arrivals.sort_by_key(|(at, tie, _)| (*at, *tie));

            let mut tally = Tally::new(n, asked);
            for (at, _, i) in &arrivals {
                if tally.is_final() || *at >= give_up {
                    break;
                }
                let (_, truth, fails, _) = nodes[*i];
                tally.record(if fails { Answer::Failed } else { answer_of(truth) });
            }
            let truths: Vec<Truth> = nodes.iter().map(|(_, truth, _, _)| *truth).collect();
            let heard: Vec<bool> = nodes
                .iter()
                .map(|(asked, _, fails, at)| *asked && !*fails && at.is_some_and(|at| at < give_up))
                .collect();
            let verdict = tally.verdict();
            prop_assert_eq!(verdict, oracle(&truths, &heard));
            let holding = truths.iter().filter(|t| **t == Truth::Ours).count();
            let majority = n / 2 + 1;
            if verdict == Verdict::Confirmed {
                prop_assert!(holding >= majority);
            }
            if matches!(verdict, Verdict::NotHeld(_)) {
                prop_assert!(holding < majority, "NotHeld while a majority holds our token");
            }
        }

        /// A verdict called final stays: no answer still to come changes it.
        #[test]
        fn a_final_verdict_stays(
            truths in proptest::collection::vec(truth(), 1..8),
            heard in proptest::collection::vec(any::<bool>(), 8),
            later in proptest::collection::vec(any::<bool>(), 8),
        ) {
            let n = truths.len();
            let mut tally = Tally::new(n, n);
            let mut rest = Vec::new();
            for (i, truth) in truths.iter().enumerate() {
                if heard[i] {
                    tally.record(answer_of(*truth));
                } else {
                    rest.push((i, *truth));
                }
            }
            if tally.is_final() {
                let verdict = tally.verdict();
                let mut after = tally;
                for (i, truth) in rest {
                    after.record(if later[i] { answer_of(truth) } else { Answer::Failed });
                    prop_assert_eq!(after.verdict(), verdict);
                }
            }
        }
    }

    fn tally_of(n: usize, answers: &[Answer]) -> Tally {
        let mut tally = Tally::new(n, n);
        for answer in answers {
            tally.record(*answer);
        }
        tally
    }

    /// On f63675e: three nodes, another client's token on node 2, ours on
    /// nodes 0 and 1, node 1's answer late. `unlock()` and `extend()` said
    /// `NotHeld` (node 2 counted toward "a majority answered", node 1 for
    /// nothing) while our token sat on a majority. One "not ours" out of
    /// three rules no majority out: unknown.
    #[test]
    fn a_late_node_holding_our_token_is_not_counted_as_not_held() {
        let tally = tally_of(3, &[Answer::Confirmed, Answer::Failed, Answer::Taken]);
        assert!(tally.is_final());
        assert_eq!(tally.verdict(), Verdict::Unknown);
        // The same with node 0 never having had it (expired there).
        let tally = tally_of(3, &[Answer::Expired, Answer::Failed, Answer::Confirmed]);
        assert_eq!(tally.verdict(), Verdict::Unknown);
        // Two "not ours" of three: no majority can hold it.
        let tally = tally_of(3, &[Answer::Expired, Answer::Taken, Answer::Failed]);
        assert_eq!(tally.verdict(), Verdict::NotHeld(LossReason::OwnedByOther));
    }

    #[test]
    fn the_case_of_a_late_node_and_another_owner() {
        // A's key lived on on node 2 (its SET arrived late), expired on
        // nodes 0 and 1, and client B took them: A's unlock hears node 2
        // release and one of B's nodes first.
        let mut tally = Tally::new(3, 3);
        tally.record(Answer::Confirmed);
        tally.record(Answer::Taken);
        assert!(!tally.is_final(), "the third node could still confirm");
        tally.record(Answer::Taken);
        assert!(tally.is_final());
        assert_eq!(tally.verdict(), Verdict::NotHeld(LossReason::OwnedByOther));
        // Heard in the other order: the same.
        let mut tally = Tally::new(3, 3);
        tally.record(Answer::Taken);
        tally.record(Answer::Taken);
        assert!(tally.is_final(), "no majority can confirm any more");
        assert_eq!(tally.verdict(), Verdict::NotHeld(LossReason::OwnedByOther));
    }
}
