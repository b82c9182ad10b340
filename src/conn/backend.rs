//! The connections a `LockClient` runs commands on, whatever the deployment
//! (one node, Redis Cluster, a primary found through Sentinel), and the
//! pools they come from.
//!
//! Pools this crate builds ([`Manager`] over [`crate::conn::pool`]) keep
//! four promises the plain redis-rs pools do not:
//!
//! * **No hang on connect.** Connecting, the handshake (`HELLO`/`AUTH`,
//!   `SELECT`, `CLIENT SETINFO`), the Sentinel lookup and a cluster node's
//!   first `PING` are all bounded by the client's timeout: a server that
//!   accepts and never answers fails the connection.
//! * **No harm to others.** A connection is opened by the thread that
//!   needs it, within its wait: a stalled server delays its own callers,
//!   never a connect to another server (no thread is shared between
//!   pools, and none is left trying when its caller has gone). On a
//!   cluster, a connection opens a seed (the one that answered last first)
//!   and each other node only when a request goes there ([`NodeLink`]): a
//!   stalled node delays the requests for its slots, not the others.
//! * **No reuse after a lost reply.** A connection whose request went out
//!   and whose reply did not come back (timeout, reset, EOF, `EINTR`) may
//!   still receive that reply later; it is marked broken and the pool drops
//!   it, so no later user reads somebody else's reply. On a cluster only
//!   that node's socket is closed (and opened again for a later request).
//! * **No walk through dead connections.** When one connection finds the
//!   server gone (reset, EOF), every idle connection older than that is
//!   presumed dead too (a restart or a reset drops them all) and is
//!   discarded at checkout without a round trip, so the next attempt gets a
//!   fresh connection.
//!
//! Sockets are closed with `SO_LINGER 0` (reset, not a graceful close), so
//! the kernel never delivers a request after the caller has given up on it.

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use crate::conn::ledger::{Ledger, Owed, PlainWire};
use crate::conn::pool::{self, Checked, Open, Opener, Pool};
use crate::error::{Error, PoolError};
use crate::fork::Birth;
use redis::cluster::{ClusterClient, ClusterConnection};
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, Slot, SlotAddr};
use redis::io::tcp::TcpSettings;
use redis::io::tcp::socket2::TcpKeepalive;
use redis::sentinel::LockedSentinelClient;
use redis::{Cmd, ConnectionLike, IntoConnectionInfo, RedisError, RedisResult, Value};

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

/// The library name a connection gives the server (`CLIENT SETINFO`), as
/// redis-rs gives it.
const LIB_NAME: &str = "redis-rs";

/// Opens a connection to `info` with the connect and its whole handshake
/// within `limit` (at least 1 ms).
///
/// redis-rs sets a connection up with a pipeline (`HELLO` or `AUTH`,
/// `SELECT`, two `CLIENT SETINFO`) and reads each reply with what was left
/// of its connect timeout after the TCP connect, reading on after a read
/// that timed out: a server that accepts and never answers would cost a
/// connect one timeout per reply. So redis-rs is left only what a
/// connection needs (`HELLO` or `AUTH`, `SELECT`), each reply within its
/// share of `limit` ([`handshake_share`]), and `CLIENT SETINFO` is sent
/// here after it, its replies read within what is left of `limit` (a
/// refusal ignored, as redis-rs ignores it: servers before 7.2 do not know
/// the command). Without `AUTH` or `SELECT`, the usual case, the connect
/// (a TLS handshake included) and the first reply have the whole `limit`.
fn open_within(info: &redis::ConnectionInfo, limit: Duration) -> RedisResult<redis::Connection> {
    let started = Instant::now();
    let limit = limit.max(Duration::from_millis(1));
    let settings = info.redis_settings();
    let needed = settings.clone().set_skip_set_lib_name();
    let share = handshake_share(&needed, limit);
    let client = redis::Client::open(info.clone().set_redis_settings(needed))?;
    let mut con = client.get_connection_with_timeout(share)?;
    if settings.skip_set_lib_name() {
        return Ok(con);
    }
    let deadline = started.checked_add(limit);
    let left = || deadline.map_or(limit, |at| at.saturating_duration_since(Instant::now()));
    if left().is_zero() {
        return Err(time_ran_out("before the connection was set up"));
    }
    // Both: redis-rs leaves none after its setup, and on TLS the first
    // write also reads (the handshake is completed then).
    con.set_read_timeout(Some(left()))?;
    con.set_write_timeout(Some(left()))?;
    let mut setinfo = redis::pipe();
    setinfo
        .cmd("CLIENT")
        .arg("SETINFO")
        .arg("LIB-NAME")
        .arg(settings.lib_name().unwrap_or(LIB_NAME));
    if let Some(version) = settings.lib_ver() {
        setinfo
            .cmd("CLIENT")
            .arg("SETINFO")
            .arg("LIB-VER")
            .arg(version);
    }
    // Each reply within what is left; a refusal is a reply like another.
    pipeline_each(
        &mut con,
        &setinfo.get_packed_pipeline(),
        setinfo.len(),
        &mut |con| {
            let left = left();
            if left.is_zero() {
                return Err(time_ran_out("while the connection was set up"));
            }
            con.set_read_timeout(Some(left))
        },
    )?;
    Ok(con)
}

/// What each reply redis-rs reads when it sets up a connection with
/// `settings` may take, so that all of them fit in `limit` (see
/// [`open_within`]): a server that answers sends them together (they are
/// pipelined), so the connect and the first reply must fit in one share.
/// (A server that refuses the username gets the pipeline again without it,
/// after that answer.)
fn handshake_share(settings: &redis::RedisConnectionInfo, limit: Duration) -> Duration {
    let replies = u32::from(settings.protocol().supports_resp3() || settings.password().is_some())
        + u32::from(settings.db() != 0)
        + if settings.skip_set_lib_name() { 0 } else { 2 };
    (limit / replies.max(1)).max(Duration::from_millis(1))
}

/// Opens a plain connection with at most `limit` (at least 1 ms) for the
/// connect and the handshake ([`open_within`]), and `timeout` on every
/// later read and write.
fn connect_plain(
    info: &redis::ConnectionInfo,
    timeout: Duration,
    limit: Duration,
) -> RedisResult<redis::Connection> {
    let con = open_within(info, limit).map_err(|err| explain(info.addr(), err, true))?;
    con.set_read_timeout(Some(timeout))?;
    con.set_write_timeout(Some(timeout))?;
    Ok(con)
}

/// A connection to one node of a cluster, for redis-rs's cluster
/// connection, that keeps the crate's bounds where redis-rs would not:
///
/// * the I/O timeout is in force from the moment it is open: redis-rs 1.8
///   leaves a new node connection without a read timeout for its first
///   `PING` (it sets its response timeout after that reply), so a node that
///   stalls right after the handshake would hold the thread as long as it
///   stalls;
/// * a request never outlives the calling [`Connection`]'s deadline
///   ([`Deadline`]): redis-rs retries a request that timed out, up to its
///   retry count, each try with a whole timeout of its own, and would reuse
///   the link whose reply was lost;
/// * it opens its node only when a request goes there: redis-rs connects
///   to every node of the slot map (and `PING`s each) when it opens a
///   cluster connection or refreshes its map, so one stalled node would
///   cost every new pooled link, whatever it was needed for, a timeout.
///   Only the seed a new cluster connection starts from is opened at once
///   (while [`Seeding`]), and redis-rs's `PING` right after connecting is
///   answered here for a node not open yet;
/// * once a reply was lost on it, the request it was lost in gets no
///   second try on it (every later try fails at once, as a timeout, so
///   redis-rs gives up and the crate's own resend policy decides); its
///   socket is closed, so no reply of that request can be read as
///   another's, and a later request opens the node again. One sick node
///   costs the pooled cluster link nothing on its other nodes.
pub(crate) struct NodeLink {
    /// `None` until a request needs the node, and after a lost reply.
    con: Option<redis::Connection>,
    client: redis::Client,
    /// The connect bound redis-rs gave (its connection timeout).
    connect_timeout: Option<Duration>,
    /// Its number for [`last_node`].
    number: u64,
    /// Its address for [`last_address`] (`None` for a Unix socket).
    address: Option<(Arc<str>, u16)>,
    /// The read timeout last asked for (by redis-rs or the crate), put
    /// back after a cut.
    read: std::cell::Cell<Option<Duration>>,
    /// The write timeout last asked for.
    write: std::cell::Cell<Option<Duration>>,
    /// The read and write timeouts are cut to a deadline now.
    cut: bool,
    /// The request ([`Deadline`]) a reply was lost in; 0 for one outside
    /// any request, after which the link is never used again.
    lost_in: Option<u64>,
    /// No request was made on it yet.
    fresh: bool,
}

std::thread_local! {
    /// The node this thread's last cluster request went to (a
    /// [`NodeLink`]'s number), 0 for none.
    static LAST_NODE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// When the calling thread's cluster request must be over
    /// ([`Deadline`]).
    static DEADLINE: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
    /// A pipeline's replies are kept as they came ([`ClusterOps::pipeline`]).
    static KEEP_REPLIES: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// The replies kept, refusals included.
    static KEPT: std::cell::RefCell<Option<Vec<Value>>> = const { std::cell::RefCell::new(None) };
    /// The request this thread is in ([`Deadline`]), 0 for none.
    static REQUEST: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// A cluster connection is being opened on this thread: node links
    /// connect at once, until one answers ([`Seeding`]).
    static SEEDING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// The node number of the seed that answered while [`SEEDING`].
    static SEED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// The address of the node this thread's last cluster request went to.
    static LAST_ADDRESS: std::cell::RefCell<Option<(Arc<str>, u16)>> =
        const { std::cell::RefCell::new(None) };
}

/// Where the calling thread's last request on one of this crate's cluster
/// connections went: the node that answered it, after any redirection
/// (the one to load a script on after its `NOSCRIPT`).
pub(crate) fn last_address() -> Option<RoutingInfo> {
    LAST_ADDRESS.with(|last| {
        last.borrow().as_ref().map(|(host, port)| {
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                host: host.to_string(),
                port: *port,
            })
        })
    })
}

/// Numbers nodes by address for [`last_node`]: the same address, the same
/// number, in every cluster connection of the process.
fn node_number(addr: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    addr.hash(&mut hasher);
    // 0 means "none".
    hasher.finish().max(1)
}

/// The node the calling thread's last request on one of this crate's
/// cluster connections went to, forgotten as it is read; `None` when there
/// was none (or on a cluster pool the caller built). What the watchdog
/// learns to group renewals by node from.
pub(crate) fn last_node() -> Option<u64> {
    let node = LAST_NODE.with(|last| last.replace(0));
    (node != 0).then_some(node)
}

/// While alive, every [`NodeLink`] request of this thread ends by `at`
/// (or an earlier deadline already set); the one before is put back when
/// it is dropped. The outermost one is also one request of the crate's,
/// numbered, however many tries redis-rs makes inside it: a node link
/// that lost a reply refuses the rest of that request only.
struct Deadline {
    before: Option<Instant>,
    /// It numbered the request (the outermost).
    outermost: bool,
}

/// Numbers the crate's requests on cluster connections (0 is none).
static NEXT_REQUEST: AtomicU64 = AtomicU64::new(1);

impl Deadline {
    fn at_most(at: Option<Instant>) -> Deadline {
        let before = DEADLINE.with(|deadline| deadline.get());
        let sooner = match (before, at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        DEADLINE.with(|deadline| deadline.set(sooner));
        Deadline {
            before,
            outermost: Deadline::number(),
        }
    }

    fn replacing(at: Option<Instant>) -> Deadline {
        let before = DEADLINE.with(|deadline| deadline.replace(at));
        Deadline {
            before,
            outermost: Deadline::number(),
        }
    }

    /// Numbers this thread's request unless it is in one already.
    fn number() -> bool {
        REQUEST.with(|request| {
            if request.get() != 0 {
                return false;
            }
            // Wraps after 2^64 requests, past any link's life; 0 skipped.
            let next = NEXT_REQUEST.fetch_add(1, Ordering::Relaxed).max(1);
            request.set(next);
            true
        })
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        DEADLINE.with(|deadline| deadline.set(self.before));
        if self.outermost {
            REQUEST.with(|request| request.set(0));
        }
    }
}

/// While alive, the calling thread opens a cluster connection: its node
/// links connect at once, until one answers (that seed is then remembered
/// in [`SEED`], and the links to the other nodes wait for a request).
struct Seeding;

impl Seeding {
    fn start() -> Seeding {
        SEEDING.with(|seeding| seeding.set(true));
        SEED.with(|seed| seed.set(0));
        Seeding
    }

    /// The node number of the seed that answered, if one did.
    fn answered(&self) -> Option<u64> {
        let seed = SEED.with(|seed| seed.replace(0));
        (seed != 0).then_some(seed)
    }
}

impl Drop for Seeding {
    fn drop(&mut self) {
        SEEDING.with(|seeding| seeding.set(false));
    }
}

/// What is left of the calling thread's [`Deadline`], if one is set.
fn deadline_left() -> Option<Duration> {
    DEADLINE
        .with(|deadline| deadline.get())
        .map(|at| at.saturating_duration_since(Instant::now()))
}

fn time_ran_out(what: &str) -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("the call's time ran out {what}"),
    ))
}

impl NodeLink {
    /// Ready for one request: not after a lost reply, not past the
    /// deadline, and with the timeouts cut to what is left of it.
    fn ready(&mut self) -> RedisResult<&mut redis::Connection> {
        self.fresh = false;
        if let Some(lost_in) = self.lost_in {
            if lost_in == 0 || lost_in == REQUEST.with(|request| request.get()) {
                return Err(time_ran_out("after a lost reply on this node's link"));
            }
            // A later request: the node is opened again.
            self.lost_in = None;
        }
        LAST_NODE.with(|last| last.set(self.number));
        LAST_ADDRESS.with(|last| last.borrow_mut().clone_from(&self.address));
        let left = deadline_left();
        if left.is_some_and(|left| left.is_zero()) {
            return Err(time_ran_out("before a node was asked"));
        }
        if self.con.is_none() {
            let opened = self.open(left);
            self.con = Some(self.seen(opened)?);
            self.cut = false;
        }
        let read = self.read.get();
        let write = self.write.get();
        let (read, write, cut) = match left {
            Some(left) if read.is_none_or(|read| left < read) => (Some(left), Some(left), true),
            _ if self.cut => (read, write, false),
            _ => return self.connection(),
        };
        self.cut = cut;
        let result = self.connection().and_then(|con| {
            con.set_read_timeout(read)?;
            con.set_write_timeout(write)
        });
        self.seen(result)?;
        self.connection()
    }

    fn connection(&mut self) -> RedisResult<&mut redis::Connection> {
        self.con
            .as_mut()
            .ok_or_else(|| time_ran_out("after a lost reply on this node's link"))
    }

    /// Connects to the node within its connect bound and what is left of
    /// the request, with the timeouts asked for in force from the start.
    fn open(&self, left: Option<Duration>) -> RedisResult<redis::Connection> {
        let timeout = match (self.connect_timeout, left) {
            (Some(timeout), Some(left)) => Some(timeout.min(left)),
            (timeout, left) => timeout.or(left),
        };
        let con = match timeout {
            Some(timeout) => open_within(self.client.get_connection_info(), timeout),
            None => self.client.get_connection(),
        }
        .map_err(|err| explain(self.client.get_connection_info().addr(), err, false))?;
        con.set_read_timeout(self.read.get())?;
        con.set_write_timeout(self.write.get())?;
        Ok(con)
    }

    /// A lost reply closes the socket (no reply of this request can be read
    /// later as another's) and refuses the rest of the request.
    fn seen<T>(&mut self, result: RedisResult<T>) -> RedisResult<T> {
        if let Err(err) = &result
            && reply_lost(err)
        {
            self.con = None;
            self.lost_in = Some(REQUEST.with(|request| request.get()));
        }
        result
    }

    /// Whether `cmd` is redis-rs's `PING` right after connecting, on a link
    /// not open yet: answered here, the node is opened by the first request
    /// that needs it.
    fn greeted(&mut self, cmd: &Cmd) -> bool {
        let greeting = self.fresh
            && self.con.is_none()
            && cmd.args_iter().count() == 1
            && matches!(cmd.args_iter().next(), Some(redis::Arg::Simple(name)) if name.eq_ignore_ascii_case(b"PING"));
        self.fresh = false;
        greeting
    }
}

/// A pipeline of `count` commands on one connection: sent at once, the
/// replies read one by one, `before_read` called before each read (to cut
/// its timeout), stopping at the first read that fails. redis-rs's own
/// reads on after a failed one, each with a whole timeout again: a
/// pipeline of K commands to a server that stopped answering would take K
/// timeouts. Push messages between the replies (RESP3) are skipped.
fn pipeline_each(
    con: &mut redis::Connection,
    cmd: &[u8],
    count: usize,
    before_read: &mut dyn FnMut(&redis::Connection) -> RedisResult<()>,
) -> RedisResult<Vec<Value>> {
    con.send_packed_command(cmd)?;
    let mut replies = Vec::with_capacity(count);
    // Bounded: every pass reads one reply or fails, and push messages are
    // allowed as many again as there are replies, plus a few.
    let most = count.saturating_mul(2).saturating_add(16);
    for _ in 0..most {
        if replies.len() == count {
            return Ok(replies);
        }
        before_read(con)?;
        match con.recv_response()? {
            Value::Push { .. } => {}
            reply => replies.push(reply),
        }
    }
    if replies.len() == count {
        return Ok(replies);
    }
    Err(RedisError::from((
        redis::ErrorKind::Io,
        "a pipeline's replies did not come",
    )))
}

/// A cluster connection of this crate (see [`NodeLink`]).
pub(crate) type Cluster = ClusterConnection<NodeLink>;

/// What is asked of a cluster connection, this crate's or one of a pool
/// the caller built: a command routed as told, and anything a connection
/// does.
pub(crate) trait ClusterOps: ConnectionLike {
    fn route(&mut self, cmd: &Cmd, routing: RoutingInfo) -> RedisResult<Value>;

    /// A pipeline, sent to the node of its first command's key, each
    /// reply its own (a server's refusal included); `None` when this
    /// connection cannot (then send the commands one by one). redis-rs
    /// fails a whole cluster pipeline on the first refusal in it, and
    /// follows a `MOVED` in it by sending the whole pipeline to that node.
    fn pipeline(&mut self, packed: &[u8], count: usize) -> Option<RedisResult<Vec<Value>>>;

    /// Whether [`ClusterOps::pipeline`] works here, and the crate knows
    /// where each request went ([`last_node`], [`last_address`]).
    fn pipeline_capable(&self) -> bool;
}

impl ClusterOps for Cluster {
    fn route(&mut self, cmd: &Cmd, routing: RoutingInfo) -> RedisResult<Value> {
        self.route_command(cmd, routing)
    }

    fn pipeline_capable(&self) -> bool {
        true
    }

    fn pipeline(&mut self, packed: &[u8], count: usize) -> Option<RedisResult<Vec<Value>>> {
        KEPT.with(|kept| kept.borrow_mut().take());
        KEEP_REPLIES.with(|keep| keep.set(true));
        let result = self.req_packed_commands(packed, 0, count);
        KEEP_REPLIES.with(|keep| keep.set(false));
        let kept = KEPT.with(|kept| kept.borrow_mut().take());
        Some(match (result, kept) {
            (Ok(_), Some(replies)) => Ok(replies),
            (Ok(replies), None) => Ok(replies),
            (Err(err), _) => Err(err),
        })
    }
}

impl ClusterOps for ClusterConnection {
    fn route(&mut self, cmd: &Cmd, routing: RoutingInfo) -> RedisResult<Value> {
        self.route_command(cmd, routing)
    }

    fn pipeline(&mut self, _: &[u8], _: usize) -> Option<RedisResult<Vec<Value>>> {
        None
    }

    fn pipeline_capable(&self) -> bool {
        false
    }
}

impl redis::cluster::Connect for NodeLink {
    fn connect<T>(info: T, timeout: Option<Duration>) -> RedisResult<Self>
    where
        T: IntoConnectionInfo,
    {
        let info = info.into_connection_info()?;
        let client = redis::Client::open(info.clone())?;
        let address = match info.addr() {
            redis::ConnectionAddr::Tcp(host, port)
            | redis::ConnectionAddr::TcpTls { host, port, .. } => {
                Some((Arc::from(host.as_str()), *port))
            }
            _ => None,
        };
        let mut link = NodeLink {
            con: None,
            client,
            connect_timeout: timeout,
            number: node_number(&info.addr().to_string()),
            address,
            // The first reply too: redis-rs sets its own timeouts after it.
            read: std::cell::Cell::new(timeout),
            write: std::cell::Cell::new(timeout),
            cut: false,
            lost_in: None,
            fresh: true,
        };
        // A seed is connected to now, so redis-rs can go on to the next
        // when it does not answer; a node redis-rs connects to in the
        // middle of a request (after a reset, a redirection) within the
        // request's deadline.
        if SEEDING.with(|seeding| seeding.get()) {
            let left = deadline_left();
            if left.is_some_and(|left| left.is_zero()) {
                return Err(time_ran_out("before a node could be connected to"));
            }
            link.con = Some(link.open(left)?);
        }
        Ok(link)
    }

    fn send_packed_command(&mut self, cmd: &[u8]) -> RedisResult<()> {
        let result = self.ready()?.send_packed_command(cmd);
        self.seen(result)
    }

    fn set_write_timeout(&self, dur: Option<Duration>) -> RedisResult<()> {
        self.write.set(dur);
        match &self.con {
            Some(con) => con.set_write_timeout(dur),
            None => Ok(()),
        }
    }

    fn set_read_timeout(&self, dur: Option<Duration>) -> RedisResult<()> {
        self.read.set(dur);
        match &self.con {
            Some(con) => con.set_read_timeout(dur),
            None => Ok(()),
        }
    }

    fn recv_response(&mut self) -> RedisResult<Value> {
        let result = self.connection()?.recv_response();
        self.seen(result)
    }
}

impl ConnectionLike for NodeLink {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        let result = self.ready()?.req_packed_command(cmd);
        self.seen(result)
    }

    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        let number = self.number;
        let read = self.read.get();
        let con = self.ready()?;
        let result = if offset == 0 {
            let mut cut = |con: &redis::Connection| -> RedisResult<()> {
                LAST_NODE.with(|last| last.set(number));
                match deadline_left() {
                    Some(left) if left.is_zero() => {
                        Err(time_ran_out("while a pipeline's replies were read"))
                    }
                    Some(left) if read.is_none_or(|read| left < read) => {
                        con.set_read_timeout(Some(left))
                    }
                    _ => Ok(()),
                }
            };
            let result = pipeline_each(con, cmd, count, &mut cut);
            // Cut from here on: `ready` puts the timeouts back.
            self.cut = true;
            result
        } else {
            con.req_packed_commands(cmd, offset, count)
        };
        let result = self.seen(result);
        if !KEEP_REPLIES.with(|keep| keep.get()) {
            return result;
        }
        // Kept aside as they came; redis-rs gets them without refusals,
        // so it neither fails the whole pipeline nor follows a `MOVED` in
        // it with the whole pipeline.
        result.map(|replies| {
            let plain = replies
                .iter()
                .map(|reply| match reply {
                    Value::ServerError(_) => Value::Nil,
                    other => other.clone(),
                })
                .collect();
            KEPT.with(|kept| *kept.borrow_mut() = Some(replies));
            plain
        })
    }

    fn req_command(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        if self.greeted(cmd) {
            return Ok(Value::SimpleString("PONG".to_owned()));
        }
        let result = self.ready()?.req_command(cmd);
        let result = self.seen(result);
        // A seed that answered (not with an error: `LOADING`, `NOAUTH`):
        // the other nodes wait for a request.
        if SEEDING.with(|seeding| seeding.get())
            && matches!(&result, Ok(reply) if !matches!(reply, Value::ServerError(_)))
        {
            SEEDING.with(|seeding| seeding.set(false));
            SEED.with(|seed| seed.set(self.number));
        }
        result
    }

    fn get_db(&self) -> i64 {
        // A cluster has database 0 only.
        0
    }

    fn supports_pipelining(&self) -> bool {
        true
    }

    /// No round trip: redis-rs checks every node link this way when it
    /// refreshes its slot map, and a `PING` to a stalled node would cost
    /// that refresh a timeout. A link that lost a reply says no, so redis-rs
    /// replaces it by a fresh one (opened when a request needs it) rather
    /// than ask that node for the slot map; a link whose node went away
    /// otherwise fails its next request, which redis-rs answers by
    /// connecting again.
    fn check_connection(&mut self) -> bool {
        self.lost_in.is_none() && self.is_open()
    }

    fn is_open(&self) -> bool {
        self.lost_in != Some(0) && self.con.as_ref().is_none_or(ConnectionLike::is_open)
    }
}

/// Adds the cause and its fix to a failed connect when the error tells it
/// (`conn::diagnose`): a TLS refusal, or the wrong URL scheme for the
/// port. The error keeps its kind, so it is retried or reported as before;
/// `address` puts the server's address in front, where redis-rs does not
/// (a cluster's error names each node it tried).
fn explain(addr: &redis::ConnectionAddr, err: RedisError, address: bool) -> RedisError {
    let (host, tls) = match addr {
        redis::ConnectionAddr::Tcp(host, _) => (host, false),
        redis::ConnectionAddr::TcpTls { host, .. } => (host, true),
        _ => return err,
    };
    let Some(cause) =
        crate::conn::diagnose::cause(&err, &crate::conn::diagnose::Dialled { host, tls })
    else {
        return err;
    };
    let detail = if address {
        format!("{addr}: {err} ({})", cause.hint)
    } else {
        format!("{err} ({})", cause.hint)
    };
    RedisError::from((err.kind(), "cannot connect", detail))
}

/// What a pool of this crate connects to.
pub(crate) enum Target {
    Single(redis::ConnectionInfo),
    Cluster(ClusterTarget),
    Sentinel(SentinelTarget),
}

/// A Redis Cluster, opened from its seeds: a new connection starts from
/// the seed that answered last, so a seed that stalls costs one opening
/// its timeout, not every one.
pub(crate) struct ClusterTarget {
    /// One client per seed, listing the seeds from that one on.
    clients: Vec<ClusterClient>,
    /// Each seed's node number ([`node_number`]), in the order given.
    seeds: Vec<u64>,
    /// The client to start from.
    first: AtomicUsize,
}

impl ClusterTarget {
    /// `build` makes a client of seeds in the order given.
    pub(crate) fn new<E>(
        seeds: Vec<redis::ConnectionInfo>,
        build: impl Fn(Vec<redis::ConnectionInfo>) -> Result<ClusterClient, E>,
    ) -> Result<ClusterTarget, E> {
        let count = seeds.len();
        let clients = (0..count)
            .map(|first| {
                build(
                    seeds
                        .iter()
                        .cycle()
                        .skip(first)
                        .take(count)
                        .cloned()
                        .collect(),
                )
            })
            .collect::<Result<Vec<_>, E>>()?;
        Ok(ClusterTarget {
            clients,
            seeds: seeds
                .iter()
                .map(|seed| node_number(&seed.addr().to_string()))
                .collect(),
            first: AtomicUsize::new(0),
        })
    }

    /// A cluster connection: a seed connected to and asked for the slot
    /// map, the other nodes opened when a request needs them
    /// ([`NodeLink`]).
    fn connect(&self) -> RedisResult<Cluster> {
        let first = self.first.load(Ordering::Relaxed);
        let Some(client) = self.clients.get(first).or(self.clients.first()) else {
            return Err(RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "no cluster node to connect to",
            )));
        };
        let seeding = Seeding::start();
        let result = client.get_generic_connection::<NodeLink>();
        if let Some(seed) = seeding
            .answered()
            .and_then(|number| self.seeds.iter().position(|seed| *seed == number))
        {
            self.first.store(seed, Ordering::Relaxed);
        }
        result
    }
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
    /// checks that it says it is one; every step bounded by `timeout`, and
    /// all of it by `limit`.
    fn connect(&self, timeout: Duration, limit: Duration) -> RedisResult<redis::Connection> {
        let started = Instant::now();
        let left = || limit.saturating_sub(started.elapsed());
        let count = self.sentinels.len();
        let start = self.next.load(Ordering::Relaxed);
        let mut last = RedisError::from((redis::ErrorKind::Io, "no sentinel to ask"));
        for i in 0..count {
            if left().is_zero() {
                break;
            }
            let sentinel = &self.sentinels[(start + i) % count];
            let step = left().min(timeout);
            let found = connect_plain(sentinel, step, step).and_then(|mut con| {
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
            let mut con = match connect_plain(&info, timeout, left().min(timeout)) {
                Ok(con) => con,
                Err(err) => {
                    last = err;
                    continue;
                }
            };
            // A sentinel can name a primary that was just demoted. Its
            // reply within what is left.
            if con
                .set_read_timeout(Some(left().clamp(Duration::from_millis(1), timeout)))
                .is_err()
            {
                continue;
            }
            let role = redis::cmd("ROLE").query::<Vec<Value>>(&mut con);
            con.set_read_timeout(Some(timeout))?;
            match role {
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

/// What opens and judges the connections of the pools this crate builds
/// (see the module docs).
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
    Cluster(Box<Cluster>),
}

impl Link {
    fn connection(&mut self) -> &mut dyn ConnectionLike {
        match &mut self.kind {
            LinkKind::Plain(con) => con,
            LinkKind::Cluster(con) => &mut **con,
        }
    }

    fn connection_ref(&self) -> &dyn ConnectionLike {
        match &self.kind {
            LinkKind::Plain(con) => con,
            LinkKind::Cluster(con) => &**con,
        }
    }

    /// Sends `request` and reads first the replies owed, then its own
    /// ([`Ledger::after_owed`]); a failure gives the link up.
    fn after_owed(&mut self, request: &[u8]) -> RedisResult<Value> {
        let LinkKind::Plain(con) = &mut self.kind else {
            return self.connection().req_packed_command(request);
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
        owed: Arc<dyn Owed>,
    ) -> Result<(), (Arc<dyn Owed>, Option<RedisError>)> {
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
        }
    }
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
/// (the first that does not come gives the others up); also what a
/// client's drop waits in all for the replies its idle connections owe.
pub(crate) const DRAIN_WAIT: Duration = Duration::from_millis(250);

impl Manager {
    fn open_link(&self, limit: Duration) -> RedisResult<Link> {
        // Read first: a connection opened while the epoch moves is treated
        // as older, at worst discarded once.
        let epoch = self.epoch.load(Ordering::SeqCst);
        let kind = match &self.target {
            Target::Single(info) => {
                LinkKind::Plain(connect_plain(info, self.timeout, limit.min(self.timeout))?)
            }
            // Bounded per seed tried by the client's timeout (a connect
            // and a first reply each, see `NodeLink`), not by `limit`: a
            // limit shorter than that would end every connect at the first
            // seed when it is silent, and the next seed would never be
            // tried. So a caller with less time left (a watchdog round)
            // can overrun it by a timeout per silent seed (a documented
            // exception to its bound). The other nodes are opened by the
            // requests that go to them.
            Target::Cluster(target) => LinkKind::Cluster(Box::new(target.connect()?)),
            Target::Sentinel(target) => LinkKind::Plain(target.connect(self.timeout, limit)?),
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

impl Opener for Manager {
    type Link = Link;

    fn open(&self, limit: Duration) -> Result<Link, Open> {
        self.open_link(limit).map_err(|err| {
            if crate::error::refusal(&err) {
                Open::Refused(err.to_string())
            } else {
                log::debug!("redmutex: opening a connection failed: {err}");
                Open::Failed(err)
            }
        })
    }

    /// No round trip: a link that lost a reply, or is older than the last
    /// time a connection found the server gone, is not handed out again.
    /// The replies such a link owes are still read as it closes (briefly:
    /// a dead one fails at once, a silent one within `DRAIN_WAIT`), so
    /// releases that ran are not reported lost.
    fn is_usable(&self, link: &mut Link) -> bool {
        !link.broken
            && link.epoch >= self.epoch.load(Ordering::SeqCst)
            && link.connection_ref().is_open()
    }
}

/// Which pool a client's connections come from.
#[derive(Clone)]
enum Pools {
    /// Built by this crate: see the module docs.
    Own(Arc<Pool<Manager>>, Deployment),
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
    /// The process the pool was made in: a forked child shares its
    /// sockets, and gets none of them.
    birth: Birth,
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
        let pool = Pool::new(manager, usize::try_from(size).unwrap_or(usize::MAX));
        Backend {
            pools: Pools::Own(pool, deployment),
            timeout,
            connect_wait,
            birth: Birth::now(),
        }
    }

    /// A plain pool the caller built. Its read timeout is unknown here;
    /// `timeout` is assumed for the resend window.
    pub(crate) fn single(pool: r2d2::Pool<redis::Client>, timeout: Duration) -> Backend {
        Backend {
            pools: Pools::Single(pool),
            timeout,
            connect_wait: timeout,
            birth: Birth::now(),
        }
    }

    pub(crate) fn cluster(pool: r2d2::Pool<ClusterClient>, timeout: Duration) -> Backend {
        Backend {
            pools: Pools::Cluster(pool),
            timeout,
            connect_wait: timeout,
            birth: Birth::now(),
        }
    }

    pub(crate) fn sentinel(pool: r2d2::Pool<LockedSentinelClient>, timeout: Duration) -> Backend {
        Backend {
            pools: Pools::Sentinel(pool),
            timeout,
            connect_wait: timeout,
            birth: Birth::now(),
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
        // Every request of the crate, from any thread, gets its connection
        // here: in a forked child none of the parent's sockets is ever
        // written or read (its pool, its locks and waiters are copies of
        // the parent's; their lock words may even be held by a parent
        // thread that does not exist here).
        if !self.birth.is_current() {
            return Err(inherited(self.birth));
        }
        let wait = wait.max(Duration::from_millis(1));
        let pooled = match &self.pools {
            Pools::Own(pool, _) => {
                let link = pool
                    .get(wait.min(self.connect_wait), self.connect_wait)
                    .map_err(|failure| match failure {
                        pool::Failure::Refused(detail) => Error::Refused { detail },
                        pool::Failure::TimedOut(last) => Error::Pool(PoolError::timed_out(last)),
                    })?;
                Pooled::Own(link)
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
            pooled: ManuallyDrop::new(pooled),
            timeout: self.timeout,
            limit: self.timeout,
            slot: None,
            birth: self.birth,
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
        // Held together while they are read.
        let mut idle = pool.take_idle();
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

    /// How many connections the pool holds, and how many of them are
    /// idle.
    pub(crate) fn occupancy(&self) -> (u32, u32) {
        let from = |state: r2d2::State| (state.connections, state.idle_connections);
        match &self.pools {
            Pools::Own(pool, _) => {
                let (all, idle) = pool.occupancy();
                (
                    u32::try_from(all).unwrap_or(u32::MAX),
                    u32::try_from(idle).unwrap_or(u32::MAX),
                )
            }
            Pools::Single(pool) => from(pool.state()),
            Pools::Cluster(pool) => from(pool.state()),
            Pools::Sentinel(pool) => from(pool.state()),
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
    /// Given back to its pool on drop, but in a forked child (see
    /// [`Connection`]'s `Drop`).
    pooled: ManuallyDrop<Pooled>,
    /// The client's I/O timeout.
    timeout: Duration,
    /// The read and write timeout in force now: the client's, or less inside
    /// [`Connection::within`], or more inside [`Connection::patient`].
    limit: Duration,
    /// On a cluster, the slot of the last command sent to one: where a
    /// script it lacked is loaded.
    slot: Option<Slot>,
    /// The process its pool was made in.
    birth: Birth,
}

impl Drop for Connection {
    fn drop(&mut self) {
        // A forked child's copy of a connection its parent had checked
        // out: neither closed (the socket is the parent's too) nor given
        // back to the pool (whose lock a parent thread may have held at the
        // fork): left alone, as the parent's.
        if self.birth.is_current() {
            // SAFETY: `pooled` is dropped once, here, and never used after.
            unsafe { ManuallyDrop::drop(&mut self.pooled) };
        }
    }
}

/// The error of every call through a client inherited through `fork()`.
pub(crate) fn inherited(birth: Birth) -> Error {
    Error::InvalidArgument(format!(
        "this LockClient was built in process {} and inherited through fork(): a forked \
         child builds its own client (LockClient::open, LockClient::builder); the \
         parent's locks are never the child's",
        birth.pid()
    ))
}

/// A command's arguments, up to the fourth.
fn leading_args(cmd: &Cmd) -> [&[u8]; 4] {
    let mut out: [&[u8]; 4] = [&[]; 4];
    for (place, arg) in out.iter_mut().zip(cmd.args_iter()) {
        if let redis::Arg::Simple(bytes) = arg {
            *place = bytes;
        }
    }
    out
}

/// Whether `cmd` is `SCRIPT LOAD`.
fn is_script_load(cmd: &Cmd) -> bool {
    let [name, sub, ..] = leading_args(cmd);
    name.eq_ignore_ascii_case(b"SCRIPT") && sub.eq_ignore_ascii_case(b"LOAD")
}

/// Commands the crate sends whose first argument is their only key.
const KEY_FIRST: &[&[u8]] = &[
    b"GET", b"SET", b"HGET", b"HGETALL", b"PTTL", b"PSETEX", b"PEXPIRE", b"GETDEL", b"EXISTS",
    b"DEL", b"WATCH", b"TYPE", b"ZSCORE", b"ZRANGE", b"ZCARD", b"LLEN",
];

/// The slot of the key a command is routed by, for the commands the crate
/// sends with one (a script's first key, or a one-key command's key).
/// `None` for the others, which redis-rs routes by itself.
pub(crate) fn slot_of(cmd: &Cmd) -> Option<Slot> {
    let [name, first, numkeys, script_key] = leading_args(cmd);
    let script = [
        &b"EVALSHA"[..],
        b"EVAL",
        b"EVALSHA_RO",
        b"EVAL_RO",
        b"FCALL",
        b"FCALL_RO",
    ]
    .iter()
    .any(|known| name.eq_ignore_ascii_case(known));
    if script {
        let keyed = !numkeys.is_empty() && numkeys != b"0";
        return keyed.then(|| Slot::for_key(script_key));
    }
    let keyed = !first.is_empty()
        && KEY_FIRST
            .iter()
            .any(|known| name.eq_ignore_ascii_case(known));
    keyed.then(|| Slot::for_key(first))
}

enum Pooled {
    // Not boxed: the common case, handed out for every request (an
    // allocation each time otherwise). A pooled cluster connection of a
    // caller's pool is much larger than the others: boxed.
    Own(Checked<Manager>),
    Single(r2d2::PooledConnection<redis::Client>),
    Cluster(Box<r2d2::PooledConnection<ClusterClient>>),
    Sentinel(r2d2::PooledConnection<LockedSentinelClient>),
}

impl Connection {
    /// The connection under this one.
    fn inner(&mut self) -> &mut dyn ConnectionLike {
        match &mut *self.pooled {
            Pooled::Own(link) => link.connection(),
            Pooled::Single(con) => &mut **con,
            Pooled::Cluster(con) => &mut ***con,
            Pooled::Sentinel(con) => &mut **con,
        }
    }

    fn inner_ref(&self) -> &dyn ConnectionLike {
        match &*self.pooled {
            Pooled::Own(link) => link.connection_ref(),
            Pooled::Single(con) => &**con,
            Pooled::Cluster(con) => &***con,
            Pooled::Sentinel(con) => &**con,
        }
    }

    /// On this crate's cluster connection, a [`Deadline`] one timeout in
    /// force from now: a request there lasts no longer than one on a
    /// single node (redis-rs would retry a timed-out request up to its
    /// retry count, each with a whole timeout).
    fn deadline(&self) -> Option<Deadline> {
        self.own_cluster()
            .then(|| Deadline::at_most(Instant::now().checked_add(self.limit)))
    }

    /// [`Connection::deadline`], in place of any deadline set before.
    fn deadline_replacing(&self) -> Option<Deadline> {
        self.own_cluster()
            .then(|| Deadline::replacing(Instant::now().checked_add(self.limit)))
    }

    /// Whether this is a cluster connection, which routes each command
    /// by its parsed arguments.
    pub(crate) fn is_cluster(&self) -> bool {
        self.own_cluster() || matches!(*self.pooled, Pooled::Cluster(_))
    }

    fn own_cluster(&self) -> bool {
        matches!(&*self.pooled, Pooled::Own(link) if matches!(link.kind, LinkKind::Cluster(_)))
    }

    /// The cluster connection, when this is one.
    fn as_cluster(&mut self) -> Option<&mut dyn ClusterOps> {
        match &mut *self.pooled {
            Pooled::Own(link) => match &mut link.kind {
                LinkKind::Cluster(con) => Some(&mut **con),
                LinkKind::Plain(_) => None,
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
        op: impl FnOnce(&mut dyn ClusterOps) -> RedisResult<T>,
    ) -> Option<RedisResult<T>> {
        let _deadline = self.deadline();
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
        if change && let Pooled::Own(link) = &mut *self.pooled {
            if let Err(err) = link.set_timeouts(Some(limit)) {
                link.broken = true;
                return Err(err);
            }
            self.limit = limit;
        }
        // All of `op` on a cluster, however many requests and redis-rs
        // retries it takes; a raised limit (`patient`) raises it too, or a
        // `WAIT` inside a resend would be cut to the resend's deadline.
        let deadline = if limit > before {
            self.deadline_replacing()
        } else {
            self.deadline()
        };
        let result = op(self);
        drop(deadline);
        if change && let Pooled::Own(link) = &mut *self.pooled {
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
            && let Pooled::Own(link) = &mut *self.pooled
        {
            link.answered = coarse_millis();
        }
        if let Err(err) = &result
            && reply_lost(err)
            && let Pooled::Own(link) = &mut *self.pooled
        {
            match link.kind {
                LinkKind::Plain(_) => {
                    link.broken = true;
                    if err.is_connection_dropped() {
                        link.epochs.fetch_add(1, Ordering::SeqCst);
                    }
                }
                // A node gone (refused, reset, closed) may have been failed
                // over, and redis-rs learns a new slot map only from a
                // `MOVED`, which a dead node never sends: the next cluster
                // connection asks a seed for it. A node that only stalls
                // (timeouts) costs the link nothing: the node link that
                // lost the reply closed its socket and opens it again for
                // a later request ([`NodeLink`]), and the links to the
                // other nodes stay.
                LinkKind::Cluster(_) if err.is_connection_dropped() => link.broken = true,
                LinkKind::Cluster(_) => {}
            }
        }
        result
    }

    /// The plain link of this crate's pool under this connection, when it
    /// owes replies (the only kind that can: see [`Connection::write_behind`]).
    fn owing(&mut self) -> Option<&mut Link> {
        match &mut *self.pooled {
            Pooled::Own(link) if !link.owed.is_empty() => Some(&mut **link),
            _ => None,
        }
    }

    /// Whether requests can be written behind on this connection: a plain
    /// connection (one node or Sentinel) of this crate's pool. A cluster
    /// connection routes each request and cannot keep replies owed; a pool
    /// the caller built keeps no state of ours with its connections.
    pub(crate) fn can_write_behind(&self) -> bool {
        matches!(&*self.pooled, Pooled::Own(link)
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
        owed: Arc<dyn Owed>,
    ) -> Result<(), Arc<dyn Owed>> {
        if !self.can_write_behind() {
            return Err(owed);
        }
        let Pooled::Own(link) = &mut *self.pooled else {
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
        let err = match &mut *self.pooled {
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
        match &*self.pooled {
            Pooled::Own(link) => link.broken,
            _ => !self.inner_ref().is_open(),
        }
    }
}

/// The error of a request on a connection inherited through `fork()`: its
/// socket is the parent's, and a request there would cross replies with
/// the parent's own.
fn forked() -> RedisError {
    RedisError::from((
        redis::ErrorKind::Client,
        "this connection was checked out in the parent process and inherited through fork(); \
         a forked child builds its own client",
    ))
}

impl ConnectionLike for Connection {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        if !self.birth.is_current() {
            return Err(forked());
        }
        let _deadline = self.deadline();
        let result = match self.owing() {
            Some(link) => link.after_owed(cmd),
            None => self.inner().req_packed_command(cmd),
        };
        self.note(result)
    }

    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        if !self.birth.is_current() {
            return Err(forked());
        }
        // Pipelines are rare on the hot path: the owed replies are read
        // first rather than interleaved with the pipeline's.
        self.settle()?;
        let _deadline = self.deadline();
        let limit = self.limit;
        let result = match &mut *self.pooled {
            // The whole pipeline within the link's timeout, each read cut
            // to what is left of it, then the timeout put back.
            Pooled::Own(link) if offset == 0 => match &mut link.kind {
                LinkKind::Plain(con) => {
                    let ends = Instant::now().checked_add(limit);
                    let mut cut = |con: &redis::Connection| -> RedisResult<()> {
                        let left =
                            ends.map_or(limit, |e| e.saturating_duration_since(Instant::now()));
                        if left.is_zero() {
                            return Err(time_ran_out("while a pipeline's replies were read"));
                        }
                        con.set_read_timeout(Some(left))
                    };
                    let result = pipeline_each(con, cmd, count, &mut cut);
                    match con.set_read_timeout(Some(limit)) {
                        Ok(()) => result,
                        Err(err) => result.and(Err(err)),
                    }
                }
                LinkKind::Cluster(con) => con.req_packed_commands(cmd, offset, count),
            },
            _ => self.inner().req_packed_commands(cmd, offset, count),
        };
        self.note(result)
    }

    fn req_command(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        if !self.birth.is_current() {
            return Err(forked());
        }
        if cmd.is_no_response() {
            // Nothing will come back to read after the owed replies.
            self.settle()?;
        } else if let Some(link) = self.owing() {
            let result = link.after_owed(&cmd.get_packed_command());
            return self.note(result);
        }
        // The cluster connection routes by the parsed command here, but for
        // a `SCRIPT LOAD` (a script the node just said it lacks, which
        // redis-rs would load on every primary, one after another): only on
        // the node the last command went to.
        let cluster = self.own_cluster() || matches!(*self.pooled, Pooled::Cluster(_));
        let load_on = if cluster && is_script_load(cmd) {
            let by_address = if self.own_cluster() {
                last_address()
            } else {
                None
            };
            by_address.or_else(|| {
                self.slot.map(|slot| {
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::with_slot(
                        slot,
                        SlotAddr::Master,
                    )))
                })
            })
        } else {
            None
        };
        let _deadline = self.deadline();
        let result = match (load_on, self.as_cluster()) {
            (Some(node), Some(cluster)) => cluster.route(cmd, node),
            (_, cluster) => {
                if cluster.is_some()
                    && let Some(slot) = slot_of(cmd)
                {
                    self.slot = Some(slot);
                }
                self.inner().req_command(cmd)
            }
        };
        self.note(result)
    }

    fn get_db(&self) -> i64 {
        self.inner_ref().get_db()
    }

    fn supports_pipelining(&self) -> bool {
        self.inner_ref().supports_pipelining()
    }

    fn check_connection(&mut self) -> bool {
        self.birth.is_current() && self.settle().is_ok() && self.inner().check_connection()
    }

    fn is_open(&self) -> bool {
        self.birth.is_current() && !self.is_broken() && self.inner_ref().is_open()
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &*self.pooled {
            Pooled::Own(link) => match link.kind {
                LinkKind::Plain(_) => "plain",
                LinkKind::Cluster(_) => "cluster",
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The connect timeout given to redis-rs times the replies its setup
    /// reads stays within the limit: one share per reply. `open_within`
    /// leaves it no `CLIENT SETINFO`, so without `AUTH` or `SELECT` the
    /// share is the whole limit.
    #[test]
    fn a_handshake_fits_in_its_limit_whatever_it_sends() {
        let limit = Duration::from_millis(900);
        let plain = redis::RedisConnectionInfo::default();
        assert_eq!(handshake_share(&plain, limit), limit / 2, "two SETINFO");
        let auth = plain.clone().set_password("p").set_db(3);
        assert_eq!(handshake_share(&auth, limit), limit / 4);
        assert_eq!(
            handshake_share(&auth.set_skip_set_lib_name(), limit),
            limit / 2
        );
        let bare = plain.set_skip_set_lib_name();
        assert_eq!(handshake_share(&bare, limit), limit);
        assert_eq!(
            handshake_share(&bare, Duration::ZERO),
            Duration::from_millis(1)
        );
    }
}
