//! One dedicated pub/sub connection and thread per `LockClient`, subscribed to
//! the release channels of keys that have local waiters.
//!
//! The connection is not pooled: a connection in subscribe mode cannot run
//! other commands, and a waiter must never hold a pooled connection the
//! releaser needs. The thread blocks reading pushed messages while waiters
//! write `SUBSCRIBE` and `UNSUBSCRIBE` on the other half of the socket
//! (`transport.rs`): no polling, and a subscription is confirmed before the
//! waiter's next attempt.
//!
//! It wakes waiters through the [`Waker`] each subscription was made with,
//! never by knowing who waits. When the connection fails, every waker is
//! called (the waiting heads fall back to backoff timing) and the thread
//! reconnects and subscribes again.
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
use std::io;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use redis::Value;

use crate::conn::stats::Stats;
use crate::conn::worker::{STOP_WAIT, Worker};
use crate::notify::transport::{Reader, Source, Stream, connect, left_of, write_command};

/// Wakes the waiters of one channel: called on each release message, and
/// when the connection is lost.
pub(crate) type Waker = Arc<dyn Fn() + Send + Sync>;

/// The subscriber thread's name (Linux keeps 15 bytes of it).
pub(crate) const THREAD_NAME: &str = "redmutex-sub";
const RECONNECT_MIN: Duration = Duration::from_millis(50);
const RECONNECT_MAX: Duration = Duration::from_secs(2);

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
    /// The waker of the latest subscription to it.
    waker: Option<Waker>,
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
        match write_command(writer, args) {
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
    /// Set once, when the client knows where to connect (at build, or by
    /// `with_notify_client`).
    shared: OnceLock<Arc<Shared>>,
    stats: Arc<Stats>,
    timeout: Duration,
}

impl Subscriber {
    pub(crate) fn new(source: Option<Source>, stats: Arc<Stats>, timeout: Duration) -> Subscriber {
        let subscriber = Subscriber {
            shared: OnceLock::new(),
            stats,
            timeout,
        };
        if let Some(source) = source {
            subscriber.set_source(source);
        }
        subscriber
    }

    /// Tells a subscriber without a server where to connect; `false` (and
    /// nothing changes) when it has one.
    pub(crate) fn set_source(&self, source: Source) -> bool {
        self.shared
            .set(Arc::new(Shared {
                source,
                stats: self.stats.clone(),
                timeout: self.timeout,
                state: Mutex::new(State::default()),
                changed: Condvar::new(),
            }))
            .is_ok()
    }

    /// A handle that keeps `channel` subscribed while it lives, calling
    /// `waker` on each release message. `None` when this client has no
    /// subscriber (TLS, or a pool given without a `redis::Client`).
    pub(crate) fn subscribe(&self, channel: &str, waker: Waker) -> Option<Subscription> {
        let shared = self.shared.get()?;
        let mut state = shared.state.lock();
        if state.shutdown {
            return None;
        }
        let entry = state.channels.entry(channel.to_owned()).or_insert(Channel {
            refs: 0,
            sent: 0,
            acked: 0,
            subscribe_at: None,
            waker: None,
        });
        entry.refs += 1;
        entry.waker = Some(waker);
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
        let Some(shared) = self.shared.get() else {
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
        // The lookup and the connect within one timeout together: a
        // dropped client's thread ends within it, however the servers
        // stall.
        let started = Instant::now();
        let connected = shared
            .source
            .resolve(attempt, shared.timeout)
            .and_then(|endpoint| {
                connect(&endpoint, left_of(shared.timeout, started), shared.timeout)
            });
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
            // A refused certificate or a server that does not speak TLS is
            // a setting to fix, not an outage to ride out: say it loudly.
            Err(err) if err.kind() == std::io::ErrorKind::InvalidData => {
                log::warn!("redmutex: subscriber cannot connect: {err}; waiters poll with backoff")
            }
            Err(err) => log::debug!("redmutex: subscriber cannot connect: {err}"),
        }
        // The connection is gone: waiters fall back to backoff timing.
        let wakers: Vec<Waker> = {
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
                .filter_map(|c| c.waker.clone())
                .collect()
        };
        for wake in wakers {
            wake();
        }
        let mut state = shared.state.lock();
        if !state.shutdown {
            let _ = shared.changed.wait_for(&mut state, pause);
        }
        pause = (pause * 2).min(RECONNECT_MAX);
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
fn read_pushes(shared: &Shared, mut reader: Reader) {
    loop {
        let frame = match reader.read() {
            Ok(frame) => frame,
            // One timeout without a whole frame; a frame cut by it is kept
            // by the parser and finished on the next read.
            Err(err) if err.kind() == io::ErrorKind::TimedOut => {
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
        };
        let mut state = shared.state.lock();
        state.ping_unanswered = false;
        match frame {
            Value::Array(items) | Value::Push { data: items, .. } => {
                let (Some(Value::BulkString(kind)), Some(Value::BulkString(name))) =
                    (items.first(), items.get(1))
                else {
                    continue;
                };
                let name = String::from_utf8_lossy(name).into_owned();
                match kind.as_slice() {
                    b"message" => {
                        let waker = state.channels.get(&name).and_then(|c| c.waker.clone());
                        drop(state);
                        shared.stats.notification();
                        if let Some(wake) = waker {
                            wake();
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
            Value::SimpleString(_) | Value::Okay => {
                // +PONG, outside subscribe mode.
                state.pending.pop_front();
            }
            Value::ServerError(err) => match state.pending.pop_front() {
                Some(Pending::Subscribe(name)) => {
                    log::warn!(
                        "redmutex: the server refuses to subscribe to {name:?} ({err}); \
                         waiters of that lock poll with backoff instead (see the ACL rules in docs/failure-model.md)"
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
