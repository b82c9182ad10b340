//! `RedLock`: one lock over N independent Redis masters, granted by a
//! majority (seeds 000 §2.5 and 002), with the corrections careful
//! implementations made: a per-node timeout far below the ttl, parallel
//! requests, validity = ttl − elapsed − drift, and a failed attempt released
//! on every node, including those whose reply was late or lost.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::backoff::{SystemClock, ThreadJitter, retry_until};
use crate::client::LockClient;
use crate::error::{Error, NotHeldReason};
use crate::guard::drift;
use crate::options::{LockOptions, Release, ttl_millis};
use crate::{release, scripts};

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
    nodes: Vec<LockClient>,
    key: String,
    options: LockOptions,
    node_timeout: Option<Duration>,
}

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
        RedLock::with_options(nodes, key, LockOptions::default())
    }

    /// A RedLock with the given options (`ttl`, `wait`, `backoff` apply).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] without any node.
    pub fn with_options(
        nodes: Vec<LockClient>,
        key: impl Into<String>,
        options: LockOptions,
    ) -> Result<RedLock, Error> {
        if nodes.is_empty() {
            return Err(Error::InvalidArgument(
                "RedLock needs at least one node".into(),
            ));
        }
        Ok(RedLock {
            nodes,
            key: key.into(),
            options,
            node_timeout: None,
        })
    }

    /// How long each node may take to answer. Defaults to 5 % of the ttl.
    pub fn node_timeout(mut self, timeout: Duration) -> RedLock {
        self.node_timeout = Some(timeout);
        self
    }

    /// The lock key (the same on every node).
    pub fn key(&self) -> &str {
        &self.key
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
        let mut last = None;
        let guard = retry_until(
            &SystemClock,
            &mut ThreadJitter,
            self.options.backoff,
            started.checked_add(self.options.wait),
            || match self.attempt()? {
                Ok(guard) => Ok(Some(guard)),
                Err(failure) => {
                    last = Some(failure);
                    Ok::<_, Error>(None)
                }
            },
        )?;
        guard.ok_or_else(|| {
            last.unwrap_or_else(|| Error::Timeout {
                key: self.key.clone(),
                waited: started.elapsed(),
            })
        })
    }

    /// One attempt: `Ok(None)` when no majority granted it.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty key or a bad ttl.
    pub fn try_lock(&self) -> Result<Option<RedLockGuard>, Error> {
        Ok(self.attempt()?.ok())
    }

    /// Attempts until acquired or `wait` has passed.
    ///
    /// # Errors
    ///
    /// As [`RedLock::try_lock`].
    pub fn try_lock_for(&self, wait: Duration) -> Result<Option<RedLockGuard>, Error> {
        self.try_lock_until_opt(Instant::now().checked_add(wait))
    }

    /// Attempts until acquired or `deadline` has passed.
    ///
    /// # Errors
    ///
    /// As [`RedLock::try_lock`].
    pub fn try_lock_until(&self, deadline: Instant) -> Result<Option<RedLockGuard>, Error> {
        self.try_lock_until_opt(Some(deadline))
    }

    fn try_lock_until_opt(&self, deadline: Option<Instant>) -> Result<Option<RedLockGuard>, Error> {
        retry_until(
            &SystemClock,
            &mut ThreadJitter,
            self.options.backoff,
            deadline,
            || Ok(self.attempt()?.ok()),
        )
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
        let ttl = Duration::from_millis(millis);
        let timeout = self.node_timeout.unwrap_or(ttl / 20);
        let token = uuid::Uuid::new_v4().to_string();
        let started = Instant::now();
        let (replies, verdicts) = self.ask_all(
            &token,
            move |client: &LockClient, key: &str, token: &str| {
                client.counters().commands(1);
                let previous: Option<Vec<u8>> = client.with_connection(key, |con| {
                    redis::cmd("SET")
                        .arg(key)
                        .arg(token)
                        .arg("NX")
                        .arg("PX")
                        .arg(millis)
                        .arg("GET")
                        .query(con)
                })?;
                Ok(previous.is_none_or(|v| v == token.as_bytes()))
            },
        );
        let deadline = started + timeout;
        let mut answers: Vec<Option<Reply>> = (0..self.nodes.len()).map(|_| None).collect();
        while answers.iter().any(Option::is_none) {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            match replies.recv_timeout(deadline - now) {
                Ok((node, reply)) => answers[node] = Some(reply),
                Err(_) => break,
            }
        }
        let elapsed = started.elapsed();
        let granted = answers
            .iter()
            .filter(|a| matches!(a, Some(Reply::Granted)))
            .count();
        let validity = ttl.checked_sub(elapsed + drift(ttl));
        let won = granted >= self.quorum() && validity.is_some_and(|v| !v.is_zero());
        // Every node thread learns the verdict; on failure each releases its
        // node after its own request is done, late ones included.
        for verdict in verdicts {
            let _ = verdict.send(won);
        }
        if won {
            return Ok(Ok(RedLockGuard {
                nodes: self.nodes.clone(),
                key: self.key.clone(),
                token,
                valid_until: Instant::now() + validity.unwrap_or_default(),
                ttl,
                released: false,
            }));
        }
        let failed: Vec<String> = answers
            .iter()
            .enumerate()
            .filter_map(|(node, answer)| match answer {
                Some(Reply::Granted) => None,
                Some(Reply::Refused) => Some(format!("node {node}: held by another owner")),
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

    /// Runs `request` against every node in a thread of its own. Each thread
    /// reports its reply, then waits for the verdict: on `false` (or if the
    /// verdict never comes) it releases its node, owner-checked.
    fn ask_all<F>(
        &self,
        token: &str,
        request: F,
    ) -> (mpsc::Receiver<(usize, Reply)>, Vec<mpsc::Sender<bool>>)
    where
        F: Fn(&LockClient, &str, &str) -> Result<bool, Error> + Send + Clone + 'static,
    {
        let (reply_tx, reply_rx) = mpsc::channel();
        let mut verdicts = Vec::with_capacity(self.nodes.len());
        for (node, client) in self.nodes.iter().enumerate() {
            let (verdict_tx, verdict_rx) = mpsc::channel::<bool>();
            verdicts.push(verdict_tx);
            let (client, key, token, reply_tx, request) = (
                client.clone(),
                self.key.clone(),
                token.to_owned(),
                reply_tx.clone(),
                request.clone(),
            );
            std::thread::spawn(move || {
                let reply = match request(&client, &key, &token) {
                    Ok(true) => Reply::Granted,
                    Ok(false) => Reply::Refused,
                    Err(err) => Reply::Failed(err.to_string()),
                };
                let _ = reply_tx.send((node, reply));
                if !verdict_rx.recv().unwrap_or(false) {
                    let _ = release::release(&client, &key, &token, Release::Lua);
                }
            });
        }
        (reply_rx, verdicts)
    }
}

/// A RedLock held on a majority of nodes. Dropping it releases it on every
/// node (best effort); [`RedLockGuard::unlock`] reports.
#[must_use = "the lock is released as soon as the guard is dropped"]
#[derive(Debug)]
pub struct RedLockGuard {
    nodes: Vec<LockClient>,
    key: String,
    token: String,
    valid_until: Instant,
    ttl: Duration,
    released: bool,
}

impl RedLockGuard {
    /// The lock key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The token written on the nodes.
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
    /// [`Error::Quorum`] when fewer than a majority extended: the lock must
    /// be considered lost; [`Error::InvalidArgument`] for a bad ttl.
    pub fn extend(&mut self, ttl: Duration) -> Result<(), Error> {
        let millis = ttl_millis(ttl)?;
        let ttl = Duration::from_millis(millis);
        let started = Instant::now();
        let results = self.on_all_nodes(move |client, key, token| {
            client.counters().commands(1);
            let reply: i64 = client.with_connection(key, |con| {
                scripts::EXTEND.key(key).arg(token).arg(millis).invoke(con)
            })?;
            scripts::owner_checked(reply).map_err(|reason| Error::not_held(key, reason))
        });
        let elapsed = started.elapsed();
        let extended = results.iter().filter(|r| r.is_ok()).count();
        let quorum = self.nodes.len() / 2 + 1;
        match ttl.checked_sub(elapsed + drift(ttl)) {
            Some(validity) if extended >= quorum && !validity.is_zero() => {
                self.valid_until = started + validity;
                self.ttl = ttl;
                Ok(())
            }
            _ => Err(Error::Quorum {
                key: self.key.clone(),
                granted: extended,
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
    /// run out everywhere); [`Error::Quorum`] when some nodes could not be
    /// reached (their keys expire by the ttl).
    pub fn unlock(mut self) -> Result<(), Error> {
        self.release()
    }

    fn release(&mut self) -> Result<(), Error> {
        self.released = true;
        let results = self
            .on_all_nodes(|client, key, token| release::release(client, key, token, Release::Lua));
        let released = results.iter().filter(|r| r.is_ok()).count();
        let unreachable = results
            .iter()
            .filter(|r| matches!(r, Err(e) if e.is_connection()))
            .count();
        if unreachable > 0 {
            return Err(Error::Quorum {
                key: self.key.clone(),
                granted: released,
                needed: self.nodes.len(),
                failed: failures(&results),
            });
        }
        if released == 0 {
            return Err(Error::not_held(&self.key, NotHeldReason::Expired));
        }
        Ok(())
    }

    fn on_all_nodes(
        &self,
        op: impl Fn(&LockClient, &str, &str) -> Result<(), Error> + Sync,
    ) -> Vec<Result<(), Error>> {
        std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .nodes
                .iter()
                .map(|client| scope.spawn(|| op(client, &self.key, &self.token)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::InvalidArgument("a node thread panicked".into()))
                    })
                })
                .collect()
        })
    }
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
