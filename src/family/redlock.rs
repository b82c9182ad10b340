//! `RedLock`: one lock over N independent Redis masters, granted by a
//! majority (seeds 000 §2.5 and 002), with the corrections careful
//! implementations made: a per-node timeout far below the ttl, parallel
//! requests, validity = ttl − elapsed − drift, and a failed attempt released
//! on every node, including those whose reply was late or lost.

use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use std::convert::Infallible;

use crate::client::LockClient;
use crate::client::options::{Backoff, LeaseOptions, Release, ttl_millis};
use crate::client::release;
use crate::conn::policy::Op;
use crate::conn::stats::{LockKind, Tag};
use crate::error::{Error, NotHeldReason};
use crate::lease::{drift, later};
use crate::renew::watchdog::OrphanKind;
use crate::script;
use crate::wait::acquire::{Attempt, Contender, Waiting, Within, acquire};

/// A lock held on a majority of N independent Redis masters (RedLock).
///
/// Each node is a [`LockClient`] of its own (its own pool and timeouts).
/// Acquiring sends `SET key token NX PX ttl` to every node in parallel and
/// succeeds only when a majority (N/2+1) granted it and time is left:
/// validity = ttl − elapsed − drift (1 % of ttl + 2 ms). A node that does
/// not answer within the node timeout (default 5 % of the ttl) counts as
/// failed. After a failed attempt, and on release, every node is released
/// (owner-checked), also those whose reply came late or never: each node's
/// request thread releases its node once its own request is done, so a late
/// `SET` cannot outlive the release.
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
/// use redmutex::{LockClient, RedLock};
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
    options: LeaseOptions,
    node_timeout: Option<Duration>,
    /// The first node's client: a RedLock's stats are kept there.
    meter: LockClient,
}

/// One long-lived thread per node, so a round costs no thread start-ups,
/// and requests to one node run in order: a release queued after a late
/// acquire runs after it.
struct Nodes {
    workers: Vec<Mutex<mpsc::Sender<Job>>>,
    /// Whether any node is a Redis Cluster (keys are then checked).
    cluster: bool,
}

type Job = Box<dyn FnOnce(&LockClient) + Send>;

impl Nodes {
    fn start(clients: Vec<LockClient>) -> Nodes {
        let cluster = clients
            .iter()
            .any(|c| c.deployment() == crate::conn::backend::Deployment::Cluster);
        let workers = clients
            .into_iter()
            .map(|client| {
                let (tx, rx) = mpsc::channel::<Job>();
                let spawned = std::thread::Builder::new()
                    .name("redmutex-redlock".into())
                    .spawn(move || {
                        // Ends when the last RedLock handle (the sender) goes.
                        while let Ok(job) = rx.recv() {
                            job(&client);
                        }
                    });
                if let Err(err) = spawned {
                    log::warn!("redmutex: cannot start a RedLock node thread: {err}");
                }
                Mutex::new(tx)
            })
            .collect();
        Nodes { workers, cluster }
    }

    fn len(&self) -> usize {
        self.workers.len()
    }

    /// Runs `op` on every node's thread; results arrive on the receiver as
    /// `(node, result)`, in completion order.
    fn each<T: Send + 'static>(
        &self,
        op: impl Fn(&LockClient) -> T + Send + Sync + Clone + 'static,
    ) -> mpsc::Receiver<(usize, T)> {
        let (tx, rx) = mpsc::channel();
        for (node, worker) in self.workers.iter().enumerate() {
            let (tx, op) = (tx.clone(), op.clone());
            let job: Job = Box::new(move |client| {
                let _ = tx.send((node, op(client)));
            });
            if worker.lock().send(job).is_err() {
                log::warn!("redmutex: RedLock node {node} thread is gone");
            }
        }
        rx
    }

    /// Runs `op` on every node and waits (at most `within`) for all results;
    /// a node that did not answer gets `None`.
    fn all<T: Send + 'static>(
        &self,
        within: Duration,
        op: impl Fn(&LockClient) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<Option<T>> {
        let rx = self.each(op);
        let deadline = later(Instant::now(), within);
        let mut results: Vec<Option<T>> = (0..self.len()).map(|_| None).collect();
        let mut answered = 0;
        while answered < self.len() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            match rx.recv_timeout(deadline - now) {
                Ok((node, result)) => {
                    results[node] = Some(result);
                    answered += 1;
                }
                Err(_) => break,
            }
        }
        results
    }
}

impl std::fmt::Debug for Nodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} nodes", self.workers.len())
    }
}

/// How long release and extend wait for the nodes: beyond every node's own
/// connection timeouts.
const NODE_OP_WAIT: Duration = Duration::from_secs(5);

/// How a round's `Quorum` error names a node that refused: the lock is
/// another owner's there.
const HELD_ELSEWHERE: &str = "held by another owner";

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
        RedLock::with_options(nodes, key, LeaseOptions::default())
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
        options: LeaseOptions,
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
            node_timeout: None,
            meter,
        })
    }

    /// How long each node may take to answer. Defaults to 5 % of the ttl;
    /// never more than the ttl.
    pub fn node_timeout(mut self, timeout: Duration) -> RedLock {
        self.node_timeout = Some(timeout);
        self
    }

    /// The lock key as it is in Redis (the same on every node), the nodes'
    /// key prefix included.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The lease length ([`LeaseOptions::ttl`]).
    pub fn ttl(&self) -> Duration {
        self.options.ttl
    }

    /// How long the blocking acquire waits ([`LeaseOptions::wait`]).
    pub fn wait(&self) -> Duration {
        self.options.wait
    }

    /// How waiting attempts are spaced ([`LeaseOptions::backoff`]).
    pub fn backoff(&self) -> Backoff {
        self.options.backoff
    }

    /// How many nodes must grant: N/2 + 1.
    pub fn quorum(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    /// Acquires, retrying with backoff up to the options' `wait`.
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
        let guard = acquire(
            &mut rounds,
            Within::For(self.options.wait).deadline(),
            self.options.backoff,
            Waiting::Spin,
        )
        .and_then(|guard| {
            guard.ok_or_else(|| {
                rounds.last.unwrap_or_else(|| Error::Timeout {
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
                if failed.iter().all(|f| f.ends_with(HELD_ELSEWHERE)) =>
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
        let result = acquire(
            &mut rounds,
            within.deadline(),
            self.options.backoff,
            Waiting::Spin,
        );
        self.meter
            .counters()
            .acquisition(self.tag(), started, result)
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
        if self.key.is_empty() {
            return Err(Error::InvalidArgument(
                "the lock key must not be empty".into(),
            ));
        }
        let millis = ttl_millis(self.options.ttl)?;
        crate::client::check_cluster_key(self.nodes.cluster, &self.key)?;
        let ttl = Duration::from_millis(millis);
        let timeout = self.node_timeout.unwrap_or(ttl / 20).min(ttl);
        let token = self.meter.new_token_local();
        let started = Instant::now();
        let (key, sent_token) = (self.key.clone(), token.clone());
        let answers = self.nodes.all(timeout, move |client| {
            client.counters().commands(1);
            let previous: Result<Option<Vec<u8>>, Error> =
                client.run(Op::Acquire, &key, |con, _| {
                    redis::cmd("SET")
                        .arg(&key)
                        .arg(&sent_token)
                        .arg("NX")
                        .arg("PX")
                        .arg(millis)
                        .arg("GET")
                        .query(con)
                });
            match previous {
                Ok(None) => Reply::Granted,
                Ok(Some(v)) if v == sent_token.as_bytes() => Reply::Granted,
                Ok(Some(_)) => Reply::Refused,
                Err(err) => Reply::Failed(err.to_string()),
            }
        });
        let elapsed = started.elapsed();
        let granted = answers
            .iter()
            .filter(|a| matches!(a, Some(Reply::Granted)))
            .count();
        let validity = ttl.checked_sub(elapsed + drift(ttl));
        let won = granted >= self.quorum() && validity.is_some_and(|v| !v.is_zero());
        if won {
            return Ok(Ok(RedLockGuard {
                nodes: self.nodes.clone(),
                key: self.key.clone(),
                token,
                valid_until: Instant::now() + validity.unwrap_or_default(),
                ttl,
                released: false,
                meter: self.meter.clone(),
                tag: self.tag(),
                held_since: Instant::now(),
            }));
        }
        // Released on every node, in the background: each node's thread
        // runs the release after its own acquire, late or not.
        let (key, sent_token) = (self.key.clone(), token.clone());
        drop(self.nodes.each(move |client| {
            let released = release::release(client, &key, &sent_token, Release::Lua);
            if released.is_err_and(|err| err.may_leave_a_lease()) {
                // Unreachable now: released as soon as the node answers.
                client.orphan(
                    &key,
                    OrphanKind::Plain {
                        token: sent_token.as_str().into(),
                    },
                );
            }
        }));
        let failed: Vec<String> = answers
            .iter()
            .enumerate()
            .filter_map(|(node, answer)| match answer {
                Some(Reply::Granted) => None,
                Some(Reply::Refused) => Some(format!("node {node}: {HELD_ELSEWHERE}")),
                Some(Reply::Failed(why)) => Some(format!("node {node}: {why}")),
                None => Some(format!("node {node}: no answer within {timeout:?}")),
            })
            .collect();
        let mut failed = failed;
        if granted >= self.quorum() {
            failed.push(format!("the round took {elapsed:?} of the {ttl:?} ttl"));
        }
        Ok(Err(Error::Quorum {
            key: self.key.clone(),
            granted,
            needed: self.quorum(),
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
#[derive(Debug)]
pub struct RedLockGuard {
    nodes: Arc<Nodes>,
    key: String,
    token: String,
    valid_until: Instant,
    ttl: Duration,
    released: bool,
    /// Where the stats go (the first node's client), and as what.
    meter: LockClient,
    tag: Tag,
    /// When this hold began.
    held_since: Instant,
}

impl RedLockGuard {
    /// The lock key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The token written on the nodes: a random secret and the holder
    /// metadata of the first node's client ([`Holder::from_token`](crate::Holder::from_token)).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// What is left of the validity: ttl − the acquisition's duration −
    /// drift, counted down by the local clock.
    pub fn validity(&self) -> Duration {
        if self.released {
            return Duration::ZERO;
        }
        self.valid_until.saturating_duration_since(Instant::now())
    }

    /// Extends the lease to `ttl` on every node (owner-checked, in
    /// parallel); succeeds when a majority extended in time.
    ///
    /// # Errors
    ///
    /// [`Error::QuorumLost`] when fewer than a majority extended: the lock must
    /// be considered lost; [`Error::InvalidArgument`] for a bad ttl.
    pub fn extend(&mut self, ttl: Duration) -> Result<(), Error> {
        let millis = ttl_millis(ttl)?;
        let ttl = Duration::from_millis(millis);
        let started = Instant::now();
        let (key, token) = (self.key.clone(), self.token.clone());
        let results = settle(self.nodes.all(NODE_OP_WAIT, move |client| {
            client.counters().commands(1);
            let reply: i64 = client.run(Op::Extend, &key, |con, _| {
                script::EXTEND.key(&key).arg(&token).arg(millis).invoke(con)
            })?;
            script::owner_checked(reply).map_err(|reason| Error::not_held(&key, reason))
        }));
        let elapsed = started.elapsed();
        let extended = results.iter().filter(|r| r.is_ok()).count();
        let quorum = self.nodes.len() / 2 + 1;
        match ttl.checked_sub(elapsed + drift(ttl)) {
            Some(validity) if extended >= quorum && !validity.is_zero() => {
                self.valid_until = started + validity;
                self.ttl = ttl;
                Ok(())
            }
            _ => Err(Error::QuorumLost {
                key: self.key.clone(),
                extended,
                needed: quorum,
                failed: failures(&results),
            }),
        }
    }

    /// Releases on every node (owner-checked, in parallel).
    ///
    /// # Errors
    ///
    /// [`Error::NotHeld`] when no node still held our token (the lease had
    /// run out everywhere); [`Error::NodesUnreachable`] when some nodes
    /// could not be reached or refused (their keys expire by the ttl).
    pub fn unlock(mut self) -> Result<(), Error> {
        self.release()
    }

    fn release(&mut self) -> Result<(), Error> {
        self.released = true;
        let result = self.let_go();
        self.meter
            .counters()
            .release(self.tag, Some(self.held_since), false, result)
    }

    fn let_go(&mut self) -> Result<(), Error> {
        let (key, token) = (self.key.clone(), self.token.clone());
        let results = settle(self.nodes.all(NODE_OP_WAIT, move |client| {
            release::release(client, &key, &token, Release::Lua)
                .map(|_| ())
                .inspect_err(|err| {
                    if err.may_leave_a_lease() {
                        // Released on that node as soon as it answers.
                        client.orphan(
                            &key,
                            OrphanKind::Plain {
                                token: token.as_str().into(),
                            },
                        );
                    }
                })
        }));
        let released = results.iter().filter(|r| r.is_ok()).count();
        // Every failure but "not held" leaves a node's key in place: the
        // network (released in the background once the node answers) or a
        // refusal (an ACL, a demoted node) that the caller must hear of.
        let unreachable = results
            .iter()
            .filter(|r| matches!(r, Err(e) if !e.is_not_held()))
            .count();
        if unreachable > 0 {
            return Err(Error::NodesUnreachable {
                key: self.key.clone(),
                released,
                nodes: self.nodes.len(),
                failed: failures(&results),
            });
        }
        if released == 0 {
            return Err(Error::not_held(&self.key, NotHeldReason::Expired));
        }
        Ok(())
    }
}

/// A node that did not answer in time counts as a connection failure.
fn settle(results: Vec<Option<Result<(), Error>>>) -> Vec<Result<(), Error>> {
    results
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| {
                Err(Error::Redis(redis::RedisError::from((
                    redis::ErrorKind::Io,
                    "no answer from the node in time",
                ))))
            })
        })
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
        if !self.released
            && let Err(err) = self.release()
        {
            log::warn!("redmutex: releasing RedLock {:?} on drop: {err}", self.key);
        }
    }
}
