//! One dedicated pub/sub connection and thread per `LockClient`, subscribed to
//! the release channels of keys that have local waiters.
//!
//! The connection is not pooled: a connection in subscribe mode cannot run
//! other commands, and a waiter must never hold a pooled connection the
//! releaser needs. It speaks just enough RESP itself (`resp.rs`) so that the
//! thread can block reading pushed messages while waiters write `SUBSCRIBE`
//! and `UNSUBSCRIBE` on a clone of the socket: no polling, and a
//! subscription is confirmed before the waiter's next attempt.
//!
//! When the connection fails, every waiting queue is woken (its head falls
//! back to backoff timing) and the thread reconnects and subscribes again.
//!
//! A half-open link (the peer gone without a reset, a partition, a proxy
//! that holds the socket) would look alive for ever to a reader that only
//! waits: after one timeout without a frame the thread sends `PING`, and
//! when a second timeout passes without any frame the link is declared
//! dead, so it is found within twice the client's I/O timeout. TCP
//! keepalive probes watch the socket as well. A channel the server refuses
//! (`-NOPERM`: an ACL user without it) is not asked for again on that
//! connection, and its waiters fall back to backoff timing at once.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
#[cfg(unix)]
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::queue::KeyQueue;
use crate::resp::{self, Frame};
use crate::stats::Stats;
use crate::worker::{STOP_WAIT, Worker};

/// The name the subscriber connection gives itself (`CLIENT SETNAME`).
pub(crate) const CONNECTION_NAME: &str = "redmutex-subscriber";
/// The subscriber thread's name (Linux keeps 15 bytes of it).
pub const THREAD_NAME: &str = "redmutex-sub";
const RECONNECT_MIN: Duration = Duration::from_millis(50);
const RECONNECT_MAX: Duration = Duration::from_secs(2);

/// Where and how to connect.
#[derive(Clone, Debug)]
enum Target {
    Tcp {
        host: String,
        port: u16,
    },
    #[cfg(unix)]
    Unix(std::path::PathBuf),
}

#[derive(Clone, Debug)]
pub(crate) struct Endpoint {
    target: Target,
    username: Option<String>,
    password: Option<String>,
}

impl Endpoint {
    /// `None` for addresses this connection cannot speak to (TLS): waiters
    /// then use backoff timing.
    fn of(client: &redis::Client) -> Option<Endpoint> {
        let info = client.get_connection_info();
        let target = match info.addr() {
            redis::ConnectionAddr::Tcp(host, port) => Target::Tcp {
                host: host.clone(),
                port: *port,
            },
            #[cfg(unix)]
            redis::ConnectionAddr::Unix(path) => Target::Unix(path.clone()),
            _ => return None,
        };
        let settings = info.redis_settings();
        Some(Endpoint {
            target,
            username: settings.username().map(str::to_owned),
            password: settings.password().map(str::to_owned),
        })
    }
}

/// Where the subscriber connects, asked again before every reconnection.
pub(crate) enum Source {
    /// Fixed servers, tried in turn: one node, or a cluster's seed nodes
    /// (a `PUBLISH` on any cluster node reaches subscribers on every node).
    Fixed(Vec<Endpoint>),
    /// The primary the sentinels name now, so the subscriber follows a
    /// failover. Asked with this module's own RESP and timeouts: a stalled
    /// sentinel must not stall the thread (nor the client's drop).
    Sentinel {
        sentinels: Vec<Endpoint>,
        master: String,
        username: Option<String>,
        password: Option<String>,
    },
}

impl Source {
    /// `None` when no server can be spoken to (TLS only).
    pub(crate) fn servers<'a>(
        clients: impl IntoIterator<Item = &'a redis::Client>,
    ) -> Option<Source> {
        let endpoints: Vec<Endpoint> = clients.into_iter().filter_map(Endpoint::of).collect();
        (!endpoints.is_empty()).then_some(Source::Fixed(endpoints))
    }

    /// `None` when no sentinel can be spoken to (TLS only).
    pub(crate) fn sentinel<'a>(
        sentinels: impl IntoIterator<Item = &'a redis::Client>,
        master: &str,
        primary: &redis::RedisConnectionInfo,
    ) -> Option<Source> {
        let sentinels: Vec<Endpoint> = sentinels.into_iter().filter_map(Endpoint::of).collect();
        (!sentinels.is_empty()).then(|| Source::Sentinel {
            sentinels,
            master: master.to_owned(),
            username: primary.username().map(str::to_owned),
            password: primary.password().map(str::to_owned),
        })
    }

    /// The server for connection attempt number `attempt`.
    fn resolve(&self, attempt: usize, timeout: Duration) -> io::Result<Endpoint> {
        match self {
            Source::Fixed(endpoints) => endpoints
                .get(attempt % endpoints.len().max(1))
                .cloned()
                .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no server")),
            Source::Sentinel {
                sentinels,
                master,
                username,
                password,
            } => {
                let mut last = io::Error::new(io::ErrorKind::NotFound, "no sentinel");
                for i in 0..sentinels.len() {
                    let sentinel = &sentinels[(attempt + i) % sentinels.len()];
                    match ask_sentinel(sentinel, master, timeout) {
                        Ok((host, port)) => {
                            return Ok(Endpoint {
                                target: Target::Tcp { host, port },
                                username: username.clone(),
                                password: password.clone(),
                            });
                        }
                        Err(err) => last = err,
                    }
                }
                Err(last)
            }
        }
    }
}

/// `SENTINEL GET-MASTER-ADDR-BY-NAME master` on one sentinel.
fn ask_sentinel(sentinel: &Endpoint, master: &str, timeout: Duration) -> io::Result<(String, u16)> {
    let (mut reader, mut writer) = open(sentinel, timeout)?;
    resp::write_command(
        &mut writer,
        &[b"SENTINEL", b"GET-MASTER-ADDR-BY-NAME", master.as_bytes()],
    )?;
    let reply = resp::read_frame(&mut reader)?;
    writer.shutdown();
    if let Some(Frame::Array(Some(items))) = &reply
        && let [host, port] = items.as_slice()
        && let (Some(host), Some(port)) = (host.as_bytes(), port.as_bytes())
        && let Ok(port) = String::from_utf8_lossy(port).parse::<u16>()
    {
        return Ok((String::from_utf8_lossy(host).into_owned(), port));
    }
    Err(io::Error::other(format!(
        "the sentinel does not name a primary {master:?}: {reply:?}"
    )))
}

enum Stream {
    Tcp(TcpStream),
    #[cfg(unix)]
    Unix(UnixStream),
}

impl Stream {
    fn connect(target: &Target, timeout: Duration) -> io::Result<Stream> {
        match target {
            Target::Tcp { host, port } => {
                let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
                for addr in (host.as_str(), *port).to_socket_addrs()? {
                    match TcpStream::connect_timeout(&addr, timeout) {
                        Ok(stream) => {
                            stream.set_nodelay(true)?;
                            redis::io::tcp::socket2::SockRef::from(&stream)
                                .set_tcp_keepalive(&crate::backend::keepalive(timeout))?;
                            return Ok(Stream::Tcp(stream));
                        }
                        Err(err) => last = err,
                    }
                }
                Err(last)
            }
            #[cfg(unix)]
            Target::Unix(path) => Ok(Stream::Unix(UnixStream::connect(path)?)),
        }
    }

    fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            #[cfg(unix)]
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
            #[cfg(unix)]
            Stream::Unix(s) => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
        }
    }

    fn shutdown(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
            #[cfg(unix)]
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            #[cfg(unix)]
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            #[cfg(unix)]
            Stream::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            #[cfg(unix)]
            Stream::Unix(s) => s.flush(),
        }
    }
}

/// One channel's subscription state on the current connection.
struct Channel {
    /// Live `Subscription` handles.
    refs: usize,
    /// (UN)SUBSCRIBE commands written for it on this connection, and the
    /// replies read back; replies come in order, so `acked >= n` means the
    /// n-th command has taken effect.
    sent: u64,
    acked: u64,
    /// The `sent` count of the SUBSCRIBE that must be acknowledged before
    /// the channel is live; `None` while unsubscribed.
    subscribe_at: Option<u64>,
    queue: Weak<KeyQueue>,
}

impl Channel {
    fn is_live(&self) -> bool {
        self.subscribe_at.is_some_and(|at| self.acked >= at)
    }
}

/// A command written on the connection whose reply has not been read:
/// replies come in order, so an error reply belongs to the first.
enum Pending {
    Subscribe(String),
    Unsubscribe(String),
    Ping,
}

#[derive(Default)]
struct State {
    writer: Option<Stream>,
    /// The last connection attempt failed or the connection was lost:
    /// waiters do not wait for confirmations until it is back.
    failed: bool,
    channels: HashMap<String, Channel>,
    pending: VecDeque<Pending>,
    /// Channels the server refused on this connection (`-NOPERM`).
    denied: HashSet<String>,
    /// The heartbeat's `PING` went out and no frame has come since.
    ping_unanswered: bool,
    thread: Option<Worker>,
    thread_started: bool,
    shutdown: bool,
}

impl State {
    fn write(&mut self, args: &[&[u8]]) -> bool {
        let Some(writer) = self.writer.as_mut() else {
            return false;
        };
        match resp::write_command(writer, args) {
            Ok(()) => true,
            Err(err) => {
                log::warn!("redmutex: subscriber write failed, reconnecting: {err}");
                writer.shutdown(); // the reader notices and reconnects
                self.writer = None;
                false
            }
        }
    }

    fn subscribe(&mut self, name: &str) {
        if self.writer.is_none() || self.denied.contains(name) {
            return; // subscribed on (re)connect; or refused on this one
        }
        if self.write(&[b"SUBSCRIBE", name.as_bytes()])
            && let Some(channel) = self.channels.get_mut(name)
        {
            channel.sent += 1;
            channel.subscribe_at = Some(channel.sent);
            self.pending.push_back(Pending::Subscribe(name.to_owned()));
        }
    }

    fn unsubscribe(&mut self, name: &str) -> bool {
        let sent = self.write(&[b"UNSUBSCRIBE", name.as_bytes()]);
        if sent {
            self.pending
                .push_back(Pending::Unsubscribe(name.to_owned()));
        }
        sent
    }

    /// Whether release messages for `name` are being delivered now.
    fn is_live(&self, name: &str) -> bool {
        self.writer.is_some() && self.channels.get(name).is_some_and(Channel::is_live)
    }

    /// A reply to the oldest pending (UN)SUBSCRIBE arrived.
    fn acknowledge(&mut self, name: &str) {
        if let Some(channel) = self.channels.get_mut(name) {
            channel.acked += 1;
            if channel.refs == 0 && channel.acked >= channel.sent {
                self.channels.remove(name);
            }
        }
    }
}

struct Shared {
    source: Source,
    stats: Arc<Stats>,
    /// Connect, handshake and write timeout; also the heartbeat's period.
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

/// The client's subscriber: started on first use, stopped when dropped.
pub(crate) struct Subscriber {
    shared: Option<Arc<Shared>>,
}

impl Subscriber {
    pub(crate) fn new(source: Option<Source>, stats: Arc<Stats>, timeout: Duration) -> Subscriber {
        let shared = source.map(|source| {
            Arc::new(Shared {
                source,
                stats,
                timeout,
                state: Mutex::new(State::default()),
                changed: Condvar::new(),
            })
        });
        Subscriber { shared }
    }

    /// A handle that keeps `channel` subscribed while it lives, waking
    /// `queue` on each release message. `None` when this client has no
    /// subscriber (TLS, or a pool given without a `redis::Client`).
    pub(crate) fn subscribe(&self, channel: &str, queue: &Arc<KeyQueue>) -> Option<Subscription> {
        let shared = self.shared.as_ref()?;
        let mut state = shared.state.lock();
        if state.shutdown {
            return None;
        }
        let entry = state.channels.entry(channel.to_owned()).or_insert(Channel {
            refs: 0,
            sent: 0,
            acked: 0,
            subscribe_at: None,
            queue: Weak::new(),
        });
        entry.refs += 1;
        entry.queue = Arc::downgrade(queue);
        if entry.subscribe_at.is_none() {
            state.subscribe(channel);
        }
        if !state.thread_started {
            state.thread_started = true;
            let thread_shared = shared.clone();
            match Worker::spawn(THREAD_NAME, move || run(&thread_shared)) {
                Ok(worker) => state.thread = Some(worker),
                Err(err) => log::warn!("redmutex: cannot start the subscriber thread: {err}"),
            }
        }
        Some(Subscription {
            shared: shared.clone(),
            channel: channel.to_owned(),
        })
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        let Some(shared) = &self.shared else {
            return;
        };
        let thread = {
            let mut state = shared.state.lock();
            state.shutdown = true;
            if let Some(writer) = state.writer.take() {
                writer.shutdown();
            }
            shared.changed.notify_all();
            state.thread.take()
        };
        // The thread may be inside a connect or a sentinel lookup: it ends
        // by itself when that returns.
        if let Some(thread) = thread {
            thread.stop_within(STOP_WAIT);
        }
    }
}

/// Keeps a channel subscribed; unsubscribes when the last handle goes.
pub(crate) struct Subscription {
    shared: Arc<Shared>,
    channel: String,
}

impl Subscription {
    /// Whether release messages for the channel are being delivered now.
    pub(crate) fn is_live(&self) -> bool {
        self.shared.state.lock().is_live(&self.channel)
    }

    /// Waits until the subscription is live, at most until `until`.
    pub(crate) fn wait_live(&self, until: Instant) -> bool {
        let mut state = self.shared.state.lock();
        loop {
            if state.is_live(&self.channel) {
                return true;
            }
            if state.shutdown
                || state.failed
                || state.denied.contains(&self.channel)
                || self
                    .shared
                    .changed
                    .wait_until(&mut state, until)
                    .timed_out()
            {
                return false;
            }
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut state = self.shared.state.lock();
        let Some(channel) = state.channels.get_mut(&self.channel) else {
            return;
        };
        channel.refs = channel.refs.saturating_sub(1);
        if channel.refs > 0 {
            return;
        }
        let was_subscribed = channel.subscribe_at.take().is_some();
        if was_subscribed && state.unsubscribe(&self.channel) {
            if let Some(channel) = state.channels.get_mut(&self.channel) {
                channel.sent += 1;
            }
        } else {
            state.channels.remove(&self.channel);
        }
    }
}

/// The subscriber thread: connect, subscribe what is wanted, read pushes,
/// and on failure wake every waiter and start again, until shutdown.
fn run(shared: &Shared) {
    let mut pause = RECONNECT_MIN;
    let mut attempt = 0;
    loop {
        if shared.state.lock().shutdown {
            return;
        }
        let connected = shared
            .source
            .resolve(attempt, shared.timeout)
            .and_then(|endpoint| connect(&endpoint, shared.timeout));
        attempt = attempt.wrapping_add(1);
        match connected {
            Ok((reader, writer)) => {
                pause = RECONNECT_MIN;
                // Reconnect to the same server first next time.
                attempt = attempt.wrapping_sub(1);
                {
                    let mut state = shared.state.lock();
                    if state.shutdown {
                        writer.shutdown();
                        return;
                    }
                    state.writer = Some(writer);
                    state.failed = false;
                    state.pending.clear();
                    state.denied.clear();
                    state.ping_unanswered = false;
                    state.channels.retain(|_, c| c.refs > 0);
                    let names: Vec<String> = state.channels.keys().cloned().collect();
                    for channel in state.channels.values_mut() {
                        channel.sent = 0;
                        channel.acked = 0;
                        channel.subscribe_at = None;
                    }
                    for name in names {
                        state.subscribe(&name);
                    }
                    shared.changed.notify_all();
                }
                read_pushes(shared, reader);
            }
            Err(err) => log::debug!("redmutex: subscriber cannot connect: {err}"),
        }
        // The connection is gone: waiters fall back to backoff timing.
        let queues: Vec<Arc<KeyQueue>> = {
            let mut state = shared.state.lock();
            if let Some(writer) = state.writer.take() {
                writer.shutdown();
            }
            state.failed = true;
            shared.changed.notify_all();
            if state.shutdown {
                return;
            }
            state
                .channels
                .values()
                .filter_map(|c| c.queue.upgrade())
                .collect()
        };
        for queue in queues {
            queue.wake();
        }
        let mut state = shared.state.lock();
        if !state.shutdown {
            let _ = shared.changed.wait_for(&mut state, pause);
        }
        pause = (pause * 2).min(RECONNECT_MAX);
    }
}

/// Connects with timeouts and authenticates; returns the reading and the
/// writing halves.
fn open(endpoint: &Endpoint, timeout: Duration) -> io::Result<(BufReader<Stream>, Stream)> {
    let stream = Stream::connect(&endpoint.target, timeout)?;
    stream.set_timeouts(Some(timeout), Some(timeout))?;
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    if let Some(password) = &endpoint.password {
        let mut args: Vec<&[u8]> = vec![b"AUTH"];
        if let Some(user) = &endpoint.username {
            args.push(user.as_bytes());
        }
        args.push(password.as_bytes());
        resp::write_command(&mut writer, &args)?;
        expect_ok(&mut reader, "AUTH")?;
    }
    Ok((reader, writer))
}

/// Connects, authenticates and names the connection; returns the reading
/// and the writing halves. From here on a read waits one timeout, then the
/// heartbeat speaks.
fn connect(endpoint: &Endpoint, timeout: Duration) -> io::Result<(BufReader<Stream>, Stream)> {
    let (mut reader, mut writer) = open(endpoint, timeout)?;
    resp::write_command(
        &mut writer,
        &[b"CLIENT", b"SETNAME", CONNECTION_NAME.as_bytes()],
    )?;
    // A name only helps operators; a user whose ACL refuses CLIENT still
    // gets release messages.
    if let Err(err) = expect_ok(&mut reader, "CLIENT SETNAME") {
        log::debug!("redmutex: the subscriber connection stays unnamed: {err}");
    }
    Ok((reader, writer))
}

fn expect_ok(reader: &mut BufReader<Stream>, what: &str) -> io::Result<()> {
    match resp::read_frame(reader)? {
        Some(Frame::Simple(_)) => Ok(()),
        Some(Frame::Error(err)) => Err(io::Error::other(format!("{what}: {err}"))),
        other => Err(io::Error::other(format!(
            "{what}: unexpected reply {other:?}"
        ))),
    }
}

/// One timeout passed without a frame: sends `PING`, or, when the last one
/// got no frame back either, declares the link dead (false).
fn heartbeat(shared: &Shared) -> bool {
    let mut state = shared.state.lock();
    if state.shutdown || state.ping_unanswered {
        return false;
    }
    if !state.write(&[b"PING"]) {
        return false;
    }
    state.pending.push_back(Pending::Ping);
    state.ping_unanswered = true;
    true
}

/// Reads pushed frames until the connection ends or goes silent.
fn read_pushes(shared: &Shared, mut reader: BufReader<Stream>) {
    loop {
        // Waits for the next frame without consuming anything, so a
        // timeout here loses nothing.
        match reader.fill_buf() {
            Ok([]) => return,
            Ok(_) => {}
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err)
                if matches!(
                    err.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                if heartbeat(shared) {
                    continue;
                }
                log::debug!("redmutex: subscriber link silent for two timeouts: reconnecting");
                return;
            }
            Err(err) => {
                log::debug!("redmutex: subscriber connection ended: {err}");
                return;
            }
        }
        let frame = match resp::read_frame(&mut reader) {
            Ok(Some(frame)) => frame,
            Ok(None) => return,
            Err(err) => {
                // A frame cut in the middle for a whole timeout, or garbage.
                log::debug!("redmutex: subscriber connection ended: {err}");
                return;
            }
        };
        let mut state = shared.state.lock();
        state.ping_unanswered = false;
        match frame {
            Frame::Array(Some(items)) => {
                let (Some(kind), Some(name)) = (
                    items.first().and_then(Frame::as_bytes),
                    items.get(1).and_then(Frame::as_bytes),
                ) else {
                    continue;
                };
                let name = String::from_utf8_lossy(name).into_owned();
                match kind {
                    b"message" => {
                        let queue = state.channels.get(&name).and_then(|c| c.queue.upgrade());
                        drop(state);
                        shared.stats.notification();
                        if let Some(queue) = queue {
                            queue.wake();
                        }
                    }
                    b"subscribe" | b"unsubscribe" => {
                        state.pending.pop_front();
                        state.acknowledge(&name);
                        shared.changed.notify_all();
                    }
                    b"pong" => {
                        state.pending.pop_front();
                    }
                    _ => {}
                }
            }
            Frame::Simple(_) => {
                // +PONG, outside subscribe mode.
                state.pending.pop_front();
            }
            Frame::Error(err) => match state.pending.pop_front() {
                Some(Pending::Subscribe(name)) => {
                    log::warn!(
                        "redmutex: the server refuses to subscribe to {name:?} ({err}); \
                         waiters of that lock poll with backoff instead (see the README's ACL rules)"
                    );
                    if let Some(channel) = state.channels.get_mut(&name) {
                        channel.subscribe_at = None;
                    }
                    state.acknowledge(&name);
                    state.denied.insert(name);
                    shared.changed.notify_all();
                }
                Some(Pending::Unsubscribe(name)) => {
                    state.acknowledge(&name);
                    shared.changed.notify_all();
                }
                Some(Pending::Ping) | None => {
                    log::debug!("redmutex: subscriber got an error reply: {err}");
                }
            },
            _ => {}
        }
    }
}
