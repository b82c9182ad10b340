//! The connections a `LockClient` runs commands on, whatever the deployment
//! (one node, Redis Cluster, a primary found through Sentinel), and the
//! pools they come from.
//!
//! Pools this crate builds ([`Manager`]) keep three promises the plain
//! redis-rs pools do not:
//!
//! * **No hang on connect.** Connecting, the handshake (`HELLO`/`AUTH`,
//!   `SELECT`, `CLIENT SETINFO`) and the Sentinel lookup are all bounded by
//!   the client's timeout: a server that accepts and never answers fails
//!   the connection instead of blocking the pool's threads for ever.
//! * **No reuse after a lost reply.** A connection whose request went out
//!   and whose reply did not come back (timeout, reset, EOF, `EINTR`) may
//!   still receive that reply later; it is marked broken and the pool drops
//!   it, so no later user reads somebody else's reply.
//! * **No walk through dead connections.** When one connection finds the
//!   server gone (reset, EOF), every idle connection older than that is
//!   presumed dead too (a restart or a reset drops them all) and is
//!   discarded at checkout without a round trip, so the next attempt gets a
//!   fresh connection.
//!
//! Sockets are closed with `SO_LINGER 0` (reset, not a graceful close), so
//! the kernel never delivers a request after the caller has given up on it.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redis::cluster::{ClusterClient, ClusterConnection};
use redis::io::tcp::TcpSettings;
use redis::io::tcp::socket2::TcpKeepalive;
use redis::sentinel::LockedSentinelClient;
use redis::{Cmd, ConnectionLike, IntoConnectionInfo, RedisError, RedisResult, Value};
use scheduled_thread_pool::ScheduledThreadPool;

use crate::conn::fork::Birth;
use crate::conn::ledger::{Ledger, Owed, PlainWire};
use crate::error::Error;

/// Which kind of Redis deployment a [`LockClient`](crate::LockClient) talks to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Deployment {
    /// One Redis server (possibly with replicas it does not follow).
    Single,
    /// A Redis Cluster: commands are routed by the key's hash slot.
    Cluster,
    /// A primary found through Redis Sentinel, followed across failovers.
    Sentinel,
}

/// The threads every pool this crate builds shares for opening connections
/// in the background: a fixed number for the whole process, so that
/// clients come and go without leaving threads behind (r2d2 would start
/// three per pool, alive until its reaper's next tick). Made again in a
/// forked child, which has none of its parent's threads: a pool built
/// there on the parent's would never get a connection.
static POOL_THREADS: Mutex<Option<(Birth, Arc<ScheduledThreadPool>)>> = Mutex::new(None);

fn pool_threads() -> Arc<ScheduledThreadPool> {
    let mut threads = POOL_THREADS.lock();
    if let Some((birth, pool)) = &*threads
        && birth.is_current()
    {
        return pool.clone();
    }
    let fresh = Arc::new(
        ScheduledThreadPool::builder()
            .num_threads(2)
            .thread_name_pattern(POOL_THREAD_NAME)
            .build(),
    );
    if let Some((_, inherited)) = threads.replace((Birth::now(), fresh.clone())) {
        // The parent's threads do not exist here: never dropped, since a
        // drop would wait for them.
        std::mem::forget(inherited);
    }
    fresh
}

/// The name pattern of the shared pool threads.
pub(crate) const POOL_THREAD_NAME: &str = "redmutex-pool-{}";

/// Whether the request may have reached Redis while its reply never came
/// back: the connection went away, timed out or was interrupted. Such a
/// connection is never used again, and the operation is resent or reported
/// as of unknown outcome (see [`crate::conn::policy`]).
pub(crate) fn reply_lost(err: &RedisError) -> bool {
    err.is_io_error()
        || err.is_connection_dropped()
        || err.is_timeout()
        || err.is_unrecoverable_error()
}

/// TCP settings of the connections this crate opens: no Nagle delay,
/// keepalive probes so a dead peer is noticed on an idle connection, and an
/// abortive close (see the module docs).
pub(crate) fn tcp_settings(timeout: Duration) -> TcpSettings {
    TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive(timeout))
        .set_linger_time(Duration::ZERO)
}

/// Keepalive probes after `idle` without traffic, then every second, three
/// times: a vanished peer is found within `idle` + 3 s.
pub(crate) fn keepalive(idle: Duration) -> TcpKeepalive {
    let probes = TcpKeepalive::new()
        .with_time(idle.max(Duration::from_secs(1)))
        .with_interval(Duration::from_secs(1));
    #[cfg(any(target_os = "linux", target_os = "android", target_os = "macos"))]
    let probes = probes.with_retries(3);
    probes
}

/// Opens a plain connection with `timeout` on the connect, the handshake
/// and every later read and write.
fn connect_plain(
    info: &redis::ConnectionInfo,
    timeout: Duration,
) -> RedisResult<redis::Connection> {
    let client = redis::Client::open(info.clone())?;
    // Nine tenths for the connect and the handshake: when they fail, the
    // pool (which waits one whole timeout) is still waiting and reports
    // why, instead of a bare "timed out waiting for connection".
    let connecting = timeout.saturating_sub(timeout / 10);
    let con = client
        .get_connection_with_timeout(connecting)
        .map_err(|err| explain(info.addr(), err))?;
    con.set_read_timeout(Some(timeout))?;
    con.set_write_timeout(Some(timeout))?;
    Ok(con)
}

/// Adds the likely cause to a failed connect when it is the usual TLS
/// mistake: plain text to a TLS port (the server hangs up on the first
/// command), TLS to a plain port, a certificate the CA did not sign, or a
/// server that wants a client certificate.
fn explain(addr: &redis::ConnectionAddr, err: RedisError) -> RedisError {
    let text = err.to_string();
    let lower = text.to_ascii_lowercase();
    let closed = [
        "reset by peer",
        "broken pipe",
        "end of file",
        "eof",
        "closed",
    ]
    .iter()
    .any(|s| lower.contains(s));
    let hint = match addr {
        redis::ConnectionAddr::Tcp(..) if closed => {
            "the server closed the connection at once: if this port speaks TLS, use a rediss:// URL"
        }
        redis::ConnectionAddr::TcpTls { .. }
            if lower.contains("corrupt message")
                || lower.contains("timed out")
                || lower.contains("temporarily unavailable") =>
        {
            "no TLS answer within the timeout: if this port speaks plain text, use a redis:// URL"
        }
        redis::ConnectionAddr::TcpTls { .. }
            if lower.contains("certificaterequired") || lower.contains("certificate required") =>
        {
            "the server requires a client certificate (tls_client_cert_files, --tls-cert)"
        }
        redis::ConnectionAddr::TcpTls { .. }
            if lower.contains("alert") && lower.contains("certificate") =>
        {
            "the server refused our client certificate: is it signed by a CA the server trusts?"
        }
        redis::ConnectionAddr::TcpTls { .. } if lower.contains("certificate") => {
            "the server's certificate was refused: give the CA that signed it (tls_ca_file, --tls-ca)"
        }
        redis::ConnectionAddr::TcpTls { .. } if closed => {
            "the server closed the TLS connection: does it require a client certificate (tls_client_cert_files, --tls-cert)?"
        }
        _ => return err,
    };
    RedisError::from((err.kind(), "cannot connect", format!("{text} ({hint})")))
}

/// What a pool of this crate connects to.
pub(crate) enum Target {
    Single(redis::ConnectionInfo),
    Cluster(ClusterClient),
    Sentinel(SentinelTarget),
}

/// A primary named by Sentinel, looked up again for every new connection.
pub(crate) struct SentinelTarget {
    pub(crate) sentinels: Vec<redis::ConnectionInfo>,
    pub(crate) master: String,
    pub(crate) primary: redis::RedisConnectionInfo,
    /// Where the next lookup starts, so a dead sentinel is not always
    /// asked first.
    next: AtomicUsize,
}

impl SentinelTarget {
    pub(crate) fn new(
        sentinels: Vec<redis::ConnectionInfo>,
        master: String,
        primary: redis::RedisConnectionInfo,
    ) -> SentinelTarget {
        SentinelTarget {
            sentinels,
            master,
            primary,
            next: AtomicUsize::new(0),
        }
    }

    /// Asks the sentinels in turn for the primary, connects to it and
    /// checks that it says it is one; every step bounded by `timeout`.
    fn connect(&self, timeout: Duration) -> RedisResult<redis::Connection> {
        let count = self.sentinels.len();
        let start = self.next.load(Ordering::Relaxed);
        let mut last = RedisError::from((redis::ErrorKind::Io, "no sentinel to ask"));
        for i in 0..count {
            let sentinel = &self.sentinels[(start + i) % count];
            let found = connect_plain(sentinel, timeout).and_then(|mut con| {
                redis::cmd("SENTINEL")
                    .arg("GET-MASTER-ADDR-BY-NAME")
                    .arg(&self.master)
                    .query::<Option<(String, u16)>>(&mut con)
            });
            let (host, port) = match found {
                Ok(Some(address)) => address,
                Ok(None) => {
                    last = RedisError::from((
                        redis::ErrorKind::Io,
                        "the sentinel knows no primary of that name",
                        self.master.clone(),
                    ));
                    continue;
                }
                Err(err) => {
                    last = err;
                    self.next.store((start + i + 1) % count, Ordering::Relaxed);
                    continue;
                }
            };
            // The primary is spoken to as the sentinel was: with TLS and
            // the same certificates when the sentinel URL is `rediss://`.
            let addr = match sentinel.addr() {
                redis::ConnectionAddr::TcpTls {
                    insecure,
                    tls_params,
                    ..
                } => redis::ConnectionAddr::TcpTls {
                    host,
                    port,
                    insecure: *insecure,
                    tls_params: tls_params.clone(),
                },
                _ => redis::ConnectionAddr::Tcp(host, port),
            };
            let info = addr
                .into_connection_info()?
                .set_redis_settings(self.primary.clone())
                .set_tcp_settings(tcp_settings(timeout));
            let mut con = match connect_plain(&info, timeout) {
                Ok(con) => con,
                Err(err) => {
                    last = err;
                    continue;
                }
            };
            // A sentinel can name a primary that was just demoted.
            match redis::cmd("ROLE").query::<Vec<Value>>(&mut con) {
                Ok(role) if matches!(role.first(), Some(Value::BulkString(name)) if name.as_slice() == b"master") =>
                {
                    return Ok(con);
                }
                Ok(_) => {
                    last = RedisError::from((
                        redis::ErrorKind::Io,
                        "the server the sentinel named is not a primary",
                    ))
                }
                // Ask the next sentinel.
                Err(err) => last = err,
            }
        }
        Err(last)
    }
}

/// The r2d2 manager of the pools this crate builds (see the module docs).
pub(crate) struct Manager {
    target: Target,
    timeout: Duration,
    /// Bumped when a connection finds the server gone: idle connections
    /// opened before are presumed dead.
    epoch: Arc<AtomicU64>,
}

impl Manager {
    pub(crate) fn new(target: Target, timeout: Duration) -> Manager {
        Manager {
            target,
            timeout,
            epoch: Arc::new(AtomicU64::new(0)),
        }
    }

    fn deployment(&self) -> Deployment {
        match self.target {
            Target::Single(_) => Deployment::Single,
            Target::Cluster(_) => Deployment::Cluster,
            Target::Sentinel(_) => Deployment::Sentinel,
        }
    }
}

/// Requests are written behind only on a connection the server answered on
/// this recently. A write into a connection the server closed earlier (an
/// idle `timeout`, a restart) succeeds locally and is lost; a synchronous
/// request would see it and resend. Redis closes idle clients after whole
/// seconds, so a connection answered within this cannot have been closed
/// that way; a program that holds a lock longer releases synchronously,
/// which a batch job exiting right after its work wants anyway.
pub(crate) const FRESH_MILLIS: u64 = 500;

/// A monotonic clock in milliseconds, read on every reply (so it must cost
/// next to nothing): `CLOCK_MONOTONIC_COARSE` on Linux (a memory read in
/// the vDSO, a few milliseconds coarse, which the freshness rule does not
/// mind), the standard monotonic clock elsewhere.
fn coarse_millis() -> u64 {
    #[cfg(target_os = "linux")]
    {
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `now` is a valid, writable timespec; the call writes it
        // and reads nothing else.
        if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut now) } == 0 {
            let secs = u64::try_from(now.tv_sec).unwrap_or(0);
            let millis = u64::try_from(now.tv_nsec).unwrap_or(0) / 1_000_000;
            return secs.saturating_mul(1_000).saturating_add(millis);
        }
    }
    static START: LazyLock<Instant> = LazyLock::new(Instant::now);
    u64::try_from(START.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// A connection of a pool of this crate.
pub(crate) struct Link {
    kind: LinkKind,
    /// A reply may still be on its way: never hand this connection out again.
    broken: bool,
    epoch: u64,
    epochs: Arc<AtomicU64>,
    /// Replies to requests written behind, oldest first (plain links only).
    owed: Ledger,
    /// When the server last answered on this connection (or it was opened),
    /// by [`coarse_millis`].
    answered: u64,
    /// The process that opened it: a child forked since shares the socket,
    /// and must not read the parent's replies.
    pid: u32,
}

enum LinkKind {
    Plain(redis::Connection),
    Cluster(Box<ClusterConnection>),
    /// A connect the server refused for good (a wrong password, an unknown
    /// user, a database it does not have: [`crate::error::refusal`]), with
    /// what it said. Handed to the caller waiting for a connection like
    /// any other, so that caller learns it at once (r2d2 tells waiters of
    /// nothing else, and would retry a failed connect until their
    /// timeout); never used for a request, and dropped when checked in.
    Refused(String),
}

impl Link {
    /// The connection; `None` for a refused connect (never handed out).
    fn connection(&mut self) -> Option<&mut dyn ConnectionLike> {
        match &mut self.kind {
            LinkKind::Plain(con) => Some(con),
            LinkKind::Cluster(con) => Some(&mut **con),
            LinkKind::Refused(_) => None,
        }
    }

    fn connection_ref(&self) -> Option<&dyn ConnectionLike> {
        match &self.kind {
            LinkKind::Plain(con) => Some(con),
            LinkKind::Cluster(con) => Some(&**con),
            LinkKind::Refused(_) => None,
        }
    }

    /// Sends `request` and reads first the replies owed, then its own
    /// ([`Ledger::after_owed`]); a failure gives the link up.
    fn after_owed(&mut self, request: &[u8]) -> RedisResult<Value> {
        let LinkKind::Plain(con) = &mut self.kind else {
            return match self.connection() {
                Some(con) => con.req_packed_command(request),
                None => Err(refused_link()),
            };
        };
        let result = self.owed.after_owed(&mut PlainWire(con), request);
        if result.is_err() {
            self.broken = true;
        }
        result
    }

    /// Writes `request` behind ([`Ledger::write_behind`]); `None` for the
    /// error when the link cannot (not a plain connection).
    #[allow(clippy::type_complexity)]
    fn write_behind(
        &mut self,
        request: &[u8],
        owed: Box<dyn Owed>,
    ) -> Result<(), (Box<dyn Owed>, Option<RedisError>)> {
        let LinkKind::Plain(con) = &mut self.kind else {
            return Err((owed, None));
        };
        self.owed
            .write_behind(&mut PlainWire(con), request, owed)
            .map_err(|(owed, err)| (owed, Some(err)))
    }

    /// Reads the replies owed, in up to `rounds` rounds
    /// ([`Ledger::settle`]).
    fn settle_owed(&mut self, rounds: usize) -> RedisResult<()> {
        match &mut self.kind {
            LinkKind::Plain(con) => self.owed.settle(&mut PlainWire(con), rounds),
            _ if self.owed.is_empty() => Ok(()),
            _ => Err(not_plain()),
        }
    }

    /// Reads what this link owes (two rounds: a rewrite after `NOSCRIPT`
    /// too) with its timeouts cut to `limit`, then set back to `timeout`.
    /// A reply not there in time gives the link up.
    fn settle_within(&mut self, limit: Duration, timeout: Duration) {
        if self.set_timeouts(Some(limit.min(timeout))).is_err() {
            self.broken = true;
            return;
        }
        if let Err(err) = self.settle_owed(2) {
            self.give_up(err);
        }
        if !self.broken && self.set_timeouts(Some(timeout)).is_err() {
            self.broken = true;
        }
    }

    /// After a failed read or write the connection is never reused, and
    /// the replies it still owes are lost.
    fn give_up(&mut self, err: RedisError) -> RedisError {
        self.broken = true;
        self.owed.give_up(&err);
        err
    }

    fn set_timeouts(&self, timeout: Option<Duration>) -> RedisResult<()> {
        match &self.kind {
            LinkKind::Plain(con) => {
                con.set_read_timeout(timeout)?;
                con.set_write_timeout(timeout)
            }
            LinkKind::Cluster(con) => {
                con.set_read_timeout(timeout)?;
                con.set_write_timeout(timeout)
            }
            LinkKind::Refused(_) => Ok(()),
        }
    }
}

fn refused_link() -> RedisError {
    RedisError::from((
        redis::ErrorKind::Client,
        "a refused connect is no connection",
    ))
}

fn not_plain() -> RedisError {
    RedisError::from((
        redis::ErrorKind::Client,
        "replies are owed only on plain connections",
    ))
}

impl Drop for Link {
    /// The replies still owed are read (the first that does not come within
    /// `DRAIN_WAIT` gives up the others) before the connection closes: the requests were written, and reading their
    /// replies before the abortive close makes sure Redis got them, and
    /// tells their owners the outcome. On a broken link they are lost.
    fn drop(&mut self) {
        if self.owed.is_empty() {
            return;
        }
        if std::process::id() != self.pid {
            // A forked child: the replies are the parent's to read, and the
            // releases the parent's to settle.
            self.owed.forget();
            return;
        }
        if self.broken {
            let err = RedisError::from((
                redis::ErrorKind::Io,
                "the connection was closed after a lost reply",
            ));
            self.give_up(err);
            return;
        }
        // Bounded: a silent server must not hold up the client's drop (or
        // a checkout discarding this connection) for a timeout per reply.
        if let LinkKind::Plain(con) = &self.kind
            && con.set_read_timeout(Some(DRAIN_WAIT)).is_err()
        {
            self.give_up(RedisError::from((
                redis::ErrorKind::Io,
                "the connection could not be read before closing",
            )));
            return;
        }
        if let Err(err) = self.settle_owed(2) {
            self.give_up(err);
        }
    }
}

/// How long a connection being closed waits for each reply it still owes
/// (the first that does not come gives the others up).
const DRAIN_WAIT: Duration = Duration::from_millis(250);

impl Manager {
    fn open(&self) -> RedisResult<Link> {
        // Read first: a connection opened while the epoch moves is treated
        // as older, at worst discarded once.
        let epoch = self.epoch.load(Ordering::SeqCst);
        let kind = match &self.target {
            Target::Single(info) => LinkKind::Plain(connect_plain(info, self.timeout)?),
            Target::Cluster(client) => LinkKind::Cluster(Box::new(client.get_connection()?)),
            Target::Sentinel(target) => LinkKind::Plain(target.connect(self.timeout)?),
        };
        Ok(Link {
            kind,
            broken: false,
            epoch,
            epochs: self.epoch.clone(),
            owed: Ledger::default(),
            answered: coarse_millis(),
            pid: std::process::id(),
        })
    }
}

impl r2d2::ManageConnection for Manager {
    type Connection = Link;
    type Error = RedisError;

    fn connect(&self) -> RedisResult<Link> {
        match self.open() {
            Err(err) if crate::error::refusal(&err) => Ok(Link {
                kind: LinkKind::Refused(err.to_string()),
                // Never checked in again: dropped at once.
                broken: true,
                epoch: self.epoch.load(Ordering::SeqCst),
                epochs: self.epoch.clone(),
                owed: Ledger::default(),
                answered: coarse_millis(),
                pid: std::process::id(),
            }),
            other => other,
        }
    }

    /// No round trip: only the epoch is compared (see the module docs).
    fn is_valid(&self, link: &mut Link) -> RedisResult<()> {
        if link.epoch < self.epoch.load(Ordering::SeqCst) {
            // Presumed dead. The replies it owes are still read as it
            // closes (briefly: a dead one fails at once, a silent one
            // within `DRAIN_WAIT`), so releases that ran are not reported
            // lost.
            return Err(RedisError::from((
                redis::ErrorKind::Io,
                "an older connection, from before the server was found gone",
            )));
        }
        Ok(())
    }

    fn has_broken(&self, link: &mut Link) -> bool {
        link.broken || !link.connection_ref().is_some_and(|con| con.is_open())
    }
}

/// r2d2 logs every failed background connection attempt at error level,
/// again and again while a server is down; the caller already gets the
/// error, so these go to debug.
#[derive(Debug)]
struct QuietErrors;

impl r2d2::HandleError<RedisError> for QuietErrors {
    fn handle_error(&self, error: RedisError) {
        log::debug!("redmutex: opening a pooled connection failed: {error}");
    }
}

/// Which pool a client's connections come from.
#[derive(Clone)]
enum Pools {
    /// Built by this crate: see the module docs.
    Own(r2d2::Pool<Manager>, Deployment),
    /// Pools the caller built.
    Single(r2d2::Pool<redis::Client>),
    Cluster(r2d2::Pool<ClusterClient>),
    Sentinel(r2d2::Pool<LockedSentinelClient>),
}

/// The pool behind a client, and the I/O timeout its connections use.
#[derive(Clone)]
pub(crate) struct Backend {
    pools: Pools,
    timeout: Duration,
    /// How long opening one connection may take: one timeout, or for
    /// Sentinel one per sentinel asked plus one for the primary.
    connect_wait: Duration,
}

impl Backend {
    /// A pool of this crate: at most `size` connections, none opened ahead,
    /// `timeout` on connecting, on waiting for a connection, and on every
    /// read and write.
    pub(crate) fn own(target: Target, timeout: Duration, size: u32) -> Backend {
        let steps = match &target {
            Target::Sentinel(sentinel) => sentinel.sentinels.len().saturating_add(1),
            _ => 1,
        };
        let connect_wait = timeout.saturating_mul(u32::try_from(steps).unwrap_or(u32::MAX));
        let manager = Manager::new(target, timeout);
        let deployment = manager.deployment();
        let pool = r2d2::Pool::builder()
            .max_size(size)
            .min_idle(Some(0))
            // Costs no round trip: `is_valid` only compares epochs.
            .test_on_check_out(true)
            .connection_timeout(connect_wait)
            // No reaper: with the shared thread pool it would outlive the
            // pool as a job that fires for ever.
            .idle_timeout(None)
            .max_lifetime(None)
            .error_handler(Box::new(QuietErrors))
            .thread_pool(pool_threads())
            .build_unchecked(manager);
        Backend {
            pools: Pools::Own(pool, deployment),
            timeout,
            connect_wait,
        }
    }

    /// A plain pool the caller built. Its read timeout is unknown here;
    /// `timeout` is assumed for the resend window.
    pub(crate) fn single(pool: r2d2::Pool<redis::Client>, timeout: Duration) -> Backend {
        Backend {
            pools: Pools::Single(pool),
            timeout,
            connect_wait: timeout,
        }
    }

    pub(crate) fn cluster(pool: r2d2::Pool<ClusterClient>, timeout: Duration) -> Backend {
        Backend {
            pools: Pools::Cluster(pool),
            timeout,
            connect_wait: timeout,
        }
    }

    pub(crate) fn sentinel(pool: r2d2::Pool<LockedSentinelClient>, timeout: Duration) -> Backend {
        Backend {
            pools: Pools::Sentinel(pool),
            timeout,
            connect_wait: timeout,
        }
    }

    pub(crate) fn deployment(&self) -> Deployment {
        match &self.pools {
            Pools::Own(_, deployment) => *deployment,
            Pools::Single(_) => Deployment::Single,
            Pools::Cluster(_) => Deployment::Cluster,
            Pools::Sentinel(_) => Deployment::Sentinel,
        }
    }

    /// The I/O timeout of the connections (assumed for pools the caller
    /// built).
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// How long getting a connection may take when a new one must be
    /// opened.
    pub(crate) fn connect_wait(&self) -> Duration {
        self.connect_wait
    }

    /// Whether this pool's connections may write requests behind (see
    /// [`Connection::can_write_behind`]): this crate's own pool, not on a
    /// cluster. Asked before a connection is checked out for it.
    pub(crate) fn writes_behind(&self) -> bool {
        matches!(&self.pools, Pools::Own(_, deployment) if *deployment != Deployment::Cluster)
    }

    /// The caller's own single-node pool, if this client was made from one.
    pub(crate) fn user_pool(&self) -> Option<&r2d2::Pool<redis::Client>> {
        match &self.pools {
            Pools::Single(pool) => Some(pool),
            _ => None,
        }
    }

    /// A pooled connection, waiting at most `wait` (and never longer than
    /// the pool's own connection timeout).
    ///
    /// # Errors
    ///
    /// [`Error::Refused`] as soon as a connect of this crate's pool meets a
    /// definitive refusal (a wrong password, say: within one connect, not
    /// after the wait; r2d2 does not retry it); [`Error::Pool`] when the
    /// wait runs out.
    pub(crate) fn get(&self, wait: Duration) -> Result<Connection, Error> {
        let wait = wait.max(Duration::from_millis(1));
        let pooled = match &self.pools {
            Pools::Own(pool, _) => {
                let link = pool.get_timeout(wait.min(pool.connection_timeout()))?;
                // A connect refused for good came to this caller: said at
                // once (the link is dropped as it goes back).
                if let LinkKind::Refused(detail) = &link.kind {
                    return Err(Error::Refused {
                        detail: detail.clone(),
                    });
                }
                Pooled::Own(Box::new(link))
            }
            Pools::Single(pool) => {
                Pooled::Single(pool.get_timeout(wait.min(pool.connection_timeout()))?)
            }
            Pools::Cluster(pool) => Pooled::Cluster(Box::new(
                pool.get_timeout(wait.min(pool.connection_timeout()))?,
            )),
            Pools::Sentinel(pool) => {
                Pooled::Sentinel(pool.get_timeout(wait.min(pool.connection_timeout()))?)
            }
        };
        Ok(Connection {
            pooled,
            timeout: self.timeout,
            limit: self.timeout,
        })
    }

    /// Reads the replies the idle connections of this crate's pool owe
    /// (releases written behind, and what they lead to: an `EVAL` after
    /// `NOSCRIPT` is read in the same call), each within what is left of
    /// `budget` (a reply not there by then gives its connection up, and
    /// its owner hands the token to the cleanup). For a client gone quiet
    /// with replies owed: nobody else would read them. Returns how many
    /// connections owed replies.
    pub(crate) fn settle_idle(&self, budget: Duration) -> usize {
        let Pools::Own(pool, _) = &self.pools else {
            return 0;
        };
        // Held together while they are read: the pool hands out the most
        // recently returned first, so one at a time would come back each
        // time.
        let mut idle = Vec::new();
        let most = usize::try_from(pool.max_size()).unwrap_or(usize::MAX);
        while idle.len() < most {
            match pool.try_get() {
                Some(link) => idle.push(link),
                None => break,
            }
        }
        // Those owing nothing go back at once: nobody waits for them while
        // an owing one is read.
        idle.retain(|link| !link.owed.is_empty());
        let started = Instant::now();
        for link in &mut idle {
            let left = budget
                .saturating_sub(started.elapsed())
                .max(Duration::from_millis(1));
            link.settle_within(left, self.timeout);
        }
        idle.len()
    }

    pub(crate) fn state(&self) -> r2d2::State {
        match &self.pools {
            Pools::Own(pool, _) => pool.state(),
            Pools::Single(pool) => pool.state(),
            Pools::Cluster(pool) => pool.state(),
            Pools::Sentinel(pool) => pool.state(),
        }
    }
}

/// A connection checked out of a [`LockClient`](crate::LockClient)'s pool,
/// whatever the deployment; it goes back to the pool when dropped, unless a
/// reply was lost on it (it is then closed).
///
/// It implements [`redis::ConnectionLike`], so commands, pipelines and
/// scripts run on it as on a plain connection. On a cluster, each command
/// is routed by its first key (a pipeline by its first command's key) and
/// `MOVED`/`ASK` redirections are followed; commands without a key go to
/// any node.
pub struct Connection {
    pooled: Pooled,
    /// The client's I/O timeout.
    timeout: Duration,
    /// The read and write timeout in force now: the client's, or less inside
    /// [`Connection::within`], or more inside [`Connection::patient`].
    limit: Duration,
}

enum Pooled {
    // Boxed: a pooled cluster connection is much larger than the others.
    Own(Box<r2d2::PooledConnection<Manager>>),
    Single(r2d2::PooledConnection<redis::Client>),
    Cluster(Box<r2d2::PooledConnection<ClusterClient>>),
    Sentinel(r2d2::PooledConnection<LockedSentinelClient>),
}

impl Connection {
    /// The connection under this one; `None` only for a refused connect,
    /// which `Backend::get` never wraps in a `Connection`.
    fn inner(&mut self) -> Option<&mut dyn ConnectionLike> {
        match &mut self.pooled {
            Pooled::Own(link) => link.connection(),
            Pooled::Single(con) => Some(&mut **con),
            Pooled::Cluster(con) => Some(&mut ***con),
            Pooled::Sentinel(con) => Some(&mut **con),
        }
    }

    fn inner_ref(&self) -> Option<&dyn ConnectionLike> {
        match &self.pooled {
            Pooled::Own(link) => link.connection_ref(),
            Pooled::Single(con) => Some(&**con),
            Pooled::Cluster(con) => Some(&***con),
            Pooled::Sentinel(con) => Some(&**con),
        }
    }

    /// The cluster connection, when this is one.
    fn as_cluster(&mut self) -> Option<&mut ClusterConnection> {
        match &mut self.pooled {
            Pooled::Own(link) => match &mut link.kind {
                LinkKind::Cluster(con) => Some(&mut **con),
                LinkKind::Plain(_) | LinkKind::Refused(_) => None,
            },
            Pooled::Cluster(con) => Some(&mut ***con),
            _ => None,
        }
    }

    /// Runs `op` on the cluster connection, when this is one (cluster
    /// pipelines, commands routed to a chosen node), with its outcome
    /// noted like every other request's.
    pub(crate) fn on_cluster<T>(
        &mut self,
        op: impl FnOnce(&mut ClusterConnection) -> RedisResult<T>,
    ) -> Option<RedisResult<T>> {
        let result = op(self.as_cluster()?);
        Some(self.note(result))
    }

    /// Runs `op` with the read and write timeouts cut to `limit` (never
    /// raised above the connection's own), then puts them back. Only on
    /// connections of this crate's pools, whose timeouts are known; others
    /// run `op` with theirs.
    pub(crate) fn within<T>(
        &mut self,
        limit: Duration,
        op: impl FnOnce(&mut Connection) -> RedisResult<T>,
    ) -> RedisResult<T> {
        // A zero timeout means "none" to the socket layer: 1 ms at least.
        let limit = limit.clamp(Duration::from_millis(1), self.limit);
        self.timed(limit, op)
    }

    /// Runs `op`, a command the server itself holds for up to `held` before
    /// it answers (`WAIT`), with the timeouts in force raised by `held`,
    /// then puts them back: the I/O timeout bounds a silent link, not the
    /// wait the caller asked the server for. Without this, a `WAIT` close to
    /// the timeout loses its reply on a loaded machine, and the caller gets
    /// "outcome unknown" for a lock that was simply not replicated. The
    /// base is the client's timeout even inside [`Connection::within`]: a
    /// resend near the end of its window must still hear the server out.
    /// Only on connections of this crate's pools; a pool given to
    /// [`LockClient::new`](crate::LockClient::new) keeps its own timeouts.
    pub(crate) fn patient<T>(
        &mut self,
        held: Duration,
        op: impl FnOnce(&mut Connection) -> RedisResult<T>,
    ) -> RedisResult<T> {
        let limit = self.limit.max(self.timeout).saturating_add(held);
        self.timed(limit, op)
    }

    /// Runs `op` with the timeouts set to `limit`, then back to what they
    /// were. A connection whose timeouts cannot be set (either way) is not
    /// reused: a half-applied change (read set, write not; redis-rs's
    /// cluster connection keeps the new value for its next nodes) must not
    /// go back to the pool.
    fn timed<T>(
        &mut self,
        limit: Duration,
        op: impl FnOnce(&mut Connection) -> RedisResult<T>,
    ) -> RedisResult<T> {
        let before = self.limit;
        let change = limit != before;
        if change && let Pooled::Own(link) = &mut self.pooled {
            if let Err(err) = link.set_timeouts(Some(limit)) {
                link.broken = true;
                return Err(err);
            }
            self.limit = limit;
        }
        let result = op(self);
        if change && let Pooled::Own(link) = &mut self.pooled {
            self.limit = before;
            if !link.broken && link.set_timeouts(Some(before)).is_err() {
                link.broken = true;
            }
        }
        result
    }

    /// Looks at every reply: after a lost one the connection is broken, and
    /// a dropped one retires the pool's older idle connections.
    fn note<T>(&mut self, result: RedisResult<T>) -> RedisResult<T> {
        if result.is_ok()
            && let Pooled::Own(link) = &mut self.pooled
        {
            link.answered = coarse_millis();
        }
        if let Err(err) = &result
            && reply_lost(err)
            && let Pooled::Own(link) = &mut self.pooled
        {
            link.broken = true;
            if err.is_connection_dropped() {
                link.epochs.fetch_add(1, Ordering::SeqCst);
            }
        }
        result
    }

    /// The plain link of this crate's pool under this connection, when it
    /// owes replies (the only kind that can: see [`Connection::write_behind`]).
    fn owing(&mut self) -> Option<&mut Link> {
        match &mut self.pooled {
            Pooled::Own(link) if !link.owed.is_empty() => Some(&mut **link),
            _ => None,
        }
    }

    /// Whether requests can be written behind on this connection: a plain
    /// connection (one node or Sentinel) of this crate's pool. A cluster
    /// connection routes each request and cannot keep replies owed; a pool
    /// the caller built keeps no state of ours with its connections.
    pub(crate) fn can_write_behind(&self) -> bool {
        matches!(&self.pooled, Pooled::Own(link)
            if matches!(link.kind, LinkKind::Plain(_))
                && !link.broken
                && coarse_millis().saturating_sub(link.answered) < FRESH_MILLIS)
    }

    /// Writes `request` and returns without waiting for its reply: the
    /// connection goes back to the pool owing it, and whoever uses the
    /// connection next reads it first and hands it to `owed`, so the two
    /// requests share a round trip. The whole request has reached the
    /// socket when this returns `Ok`.
    ///
    /// # Errors
    ///
    /// `owed` back when nothing complete was written: the connection cannot
    /// write behind ([`Connection::can_write_behind`]), or the write failed
    /// (the connection is then closed, and a partial request never runs).
    /// The caller sends the request the usual way.
    pub(crate) fn write_behind(
        &mut self,
        request: &[u8],
        owed: Box<dyn Owed>,
    ) -> Result<(), Box<dyn Owed>> {
        if !self.can_write_behind() {
            return Err(owed);
        }
        let Pooled::Own(link) = &mut self.pooled else {
            return Err(owed);
        };
        match link.write_behind(request, owed) {
            Ok(()) => Ok(()),
            Err((owed, None)) => Err(owed),
            Err((owed, Some(err))) => {
                let _ = self.fail::<()>(err);
                Err(owed)
            }
        }
    }

    /// A failed read or write on a link of this crate's pool: the replies it
    /// owes are given up and the failure noted like any other.
    fn fail<T>(&mut self, err: RedisError) -> RedisResult<T> {
        let err = match &mut self.pooled {
            Pooled::Own(link) => link.give_up(err),
            _ => err,
        };
        self.note(Err(err))
    }

    /// Reads the replies this connection owes, before a request that cannot
    /// go ahead of them (a pipeline), or before it is handed to a caller's
    /// own commands.
    pub(crate) fn settle(&mut self) -> RedisResult<()> {
        if let Some(link) = self.owing()
            && let Err(err) = link.settle_owed(2)
        {
            return self.fail(err);
        }
        Ok(())
    }

    /// Whether a reply was lost on this connection (it will be closed).
    pub(crate) fn is_broken(&self) -> bool {
        match &self.pooled {
            Pooled::Own(link) => link.broken,
            _ => !self.inner_ref().is_some_and(|con| con.is_open()),
        }
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        let result = match self.owing() {
            Some(link) => link.after_owed(cmd),
            None => match self.inner() {
                Some(con) => con.req_packed_command(cmd),
                None => Err(refused_link()),
            },
        };
        self.note(result)
    }

    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        // Pipelines are rare on the hot path: the owed replies are read
        // first rather than interleaved with the pipeline's.
        self.settle()?;
        let result = match self.inner() {
            Some(con) => con.req_packed_commands(cmd, offset, count),
            None => Err(refused_link()),
        };
        self.note(result)
    }

    fn req_command(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        if cmd.is_no_response() {
            // Nothing will come back to read after the owed replies.
            self.settle()?;
        } else if let Some(link) = self.owing() {
            let result = link.after_owed(&cmd.get_packed_command());
            return self.note(result);
        }
        // The cluster connection routes by the parsed command here.
        let result = match self.inner() {
            Some(con) => con.req_command(cmd),
            None => Err(refused_link()),
        };
        self.note(result)
    }

    fn get_db(&self) -> i64 {
        self.inner_ref().map_or(0, |con| con.get_db())
    }

    fn supports_pipelining(&self) -> bool {
        self.inner_ref()
            .is_some_and(|con| con.supports_pipelining())
    }

    fn check_connection(&mut self) -> bool {
        self.settle().is_ok() && self.inner().is_some_and(|con| con.check_connection())
    }

    fn is_open(&self) -> bool {
        !self.is_broken() && self.inner_ref().is_some_and(|con| con.is_open())
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.pooled {
            Pooled::Own(link) => match link.kind {
                LinkKind::Plain(_) => "plain",
                LinkKind::Cluster(_) => "cluster",
                LinkKind::Refused(_) => "refused",
            },
            Pooled::Single(_) => "plain (caller's pool)",
            Pooled::Cluster(_) => "cluster (caller's pool)",
            Pooled::Sentinel(_) => "sentinel (caller's pool)",
        };
        f.debug_struct("Connection")
            .field("kind", &kind)
            .field("broken", &self.is_broken())
            .finish()
    }
}
