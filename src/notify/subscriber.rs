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
//!
//! On Redis Cluster the releases announce with `SPUBLISH`, which stays in
//! the key's shard (a `PUBLISH` reaches every node of the cluster), and a
//! [`Router`] subscribes each channel with `SSUBSCRIBE` on the node that
//! owns its slot: one connection and thread per node with waiters. It
//! learns owners from the nodes themselves: a channel asked of the wrong
//! node is answered `MOVED` and subscribed again where that says; a
//! channel whose slot leaves its node (a migration, a failover) is
//! unsubscribed by the server and subscribed again, starting from the
//! seeds; a node whose connection fails has its channels moved the same
//! way. Meanwhile the channel is not live and its waiters use backoff
//! timing. A server without sharded pub/sub (before 7.0) refuses
//! `SSUBSCRIBE`: the client then subscribes with `SUBSCRIBE` on a seed,
//! and the release scripts fall back to `PUBLISH` the same way.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io;
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use redis::Value;

use crate::conn::stats::Stats;
use crate::conn::worker::{STOP_WAIT, Worker};
use crate::notify::transport::{Endpoint, Reader, Source, Stream, connect, left_of, write_command};
use redis::cluster_routing::Slot;

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

/// What the server said of a channel that the [`Router`] acts on, after the
/// connection's lock is let go.
enum Moved {
    /// `-MOVED slot host:port` to a `SSUBSCRIBE`: that node owns it.
    To(String, String),
    /// A `sunsubscribe` the client did not ask for: the channel's slot left
    /// this node.
    Away(String),
    /// `SSUBSCRIBE` is an unknown command here (a server before 7.0).
    Unsupported,
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

    fn subscribe(&mut self, name: &str, sharded: bool) {
        if self.writer.is_none() || self.denied.contains(name) {
            return; // subscribed on (re)connect; or refused on this one
        }
        let command: &[u8] = if sharded { b"SSUBSCRIBE" } else { b"SUBSCRIBE" };
        if self.write(&[command, name.as_bytes()])
            && let Some(channel) = self.channels.get_mut(name)
        {
            channel.sent += 1;
            channel.subscribe_at = Some(channel.sent);
            self.pending.push_back(Pending::Subscribe(name.to_owned()));
        }
    }

    fn unsubscribe(&mut self, name: &str, sharded: bool) -> bool {
        let command: &[u8] = if sharded {
            b"SUNSUBSCRIBE"
        } else {
            b"UNSUBSCRIBE"
        };
        let sent = self.write(&[command, name.as_bytes()]);
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
    /// One node of a cluster, for its [`Router`]: its channels go by
    /// `SSUBSCRIBE` rather than `SUBSCRIBE`.
    routed: Option<Routed>,
    stats: Arc<Stats>,
    /// Connect, handshake and write timeout; also the heartbeat's period.
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

/// What a cluster node's connection reports to.
struct Routed {
    router: Weak<Router>,
    /// The node's address, as the router names it.
    node: String,
}

impl Shared {
    fn new(
        source: Source,
        routed: Option<Routed>,
        stats: Arc<Stats>,
        timeout: Duration,
    ) -> Arc<Shared> {
        Arc::new(Shared {
            source,
            routed,
            stats,
            timeout,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        })
    }

    /// `SSUBSCRIBE`: a cluster node's connection.
    fn sharded(&self) -> bool {
        self.routed.is_some()
    }

    /// The router this node's connection reports to, while it lives.
    fn router(&self) -> Option<Arc<Router>> {
        self.routed.as_ref()?.router.upgrade()
    }

    /// The node's address, as the router names it ("" for a connection
    /// of its own).
    fn node(&self) -> &str {
        self.routed
            .as_ref()
            .map_or("", |routed| routed.node.as_str())
    }

    /// One more handle on `channel`, whose messages call `waker`; the
    /// thread is started on first use. `false` after shutdown.
    fn register(self: &Arc<Shared>, channel: &str, waker: Waker) -> bool {
        self.register_with(channel, waker, true)
    }

    /// [`Shared::register`]; when not `now`, the channel is asked for only
    /// at the connection's next retry of unsubscribed channels (a channel
    /// that keeps moving, see [`Router::moved`]).
    fn register_with(self: &Arc<Shared>, channel: &str, waker: Waker, now: bool) -> bool {
        let mut state = self.state.lock();
        if state.shutdown {
            return false;
        }
        // A node's thread that idles without channels looks again.
        self.changed.notify_all();
        let entry = state.channels.entry(channel.to_owned()).or_insert(Channel {
            refs: 0,
            sent: 0,
            acked: 0,
            subscribe_at: None,
            waker: None,
        });
        entry.refs += 1;
        entry.waker = Some(waker);
        if entry.subscribe_at.is_none() && now {
            state.subscribe(channel, self.sharded());
        }
        if !state.thread_started {
            state.thread_started = true;
            let thread_shared = self.clone();
            match Worker::spawn(THREAD_NAME, move || run(&thread_shared)) {
                Ok(worker) => state.thread = Some(worker),
                Err(err) => log::warn!("redmutex: cannot start the subscriber thread: {err}"),
            }
        }
        true
    }

    /// One handle on `channel` less; unsubscribed with the last.
    fn release(&self, channel: &str) {
        let mut state = self.state.lock();
        let Some(entry) = state.channels.get_mut(channel) else {
            return;
        };
        entry.refs = entry.refs.saturating_sub(1);
        if entry.refs > 0 {
            return;
        }
        let was_subscribed = entry.subscribe_at.take().is_some();
        // Kept while replies to it are owed: a re-registration must not
        // count them afresh (`acknowledge` removes it with the last).
        let owed = entry.acked < entry.sent;
        if was_subscribed && state.unsubscribe(channel, self.sharded()) {
            if let Some(entry) = state.channels.get_mut(channel) {
                entry.sent += 1;
            }
        } else if !owed || state.writer.is_none() {
            state.channels.remove(channel);
        }
    }

    /// The waker of the latest subscription to `channel`.
    fn set_waker(&self, channel: &str, waker: Waker) {
        if let Some(entry) = self.state.lock().channels.get_mut(channel) {
            entry.waker = Some(waker);
        }
    }

    /// Asks again for the channels wanted here but not subscribed (after a
    /// cluster error other than a redirection, or a channel parked because
    /// it kept moving): at most once per timeout.
    fn retry_unsubscribed(&self) {
        let mut state = self.state.lock();
        let names: Vec<String> = state
            .channels
            .iter()
            .filter(|(name, c)| {
                c.refs > 0 && c.subscribe_at.is_none() && !state.denied.contains(*name)
            })
            .map(|(name, _)| name.clone())
            .collect();
        for name in names {
            state.subscribe(&name, self.sharded());
        }
    }

    fn is_live(&self, channel: &str) -> bool {
        self.state.lock().is_live(channel)
    }

    /// Waits until `channel` is live, at most until `until`.
    fn wait_live(&self, channel: &str, until: Instant) -> Wait {
        let mut state = self.state.lock();
        loop {
            if state.is_live(channel) {
                return Wait::Live;
            }
            if state.shutdown || state.failed || state.denied.contains(channel) {
                return Wait::Never;
            }
            // Moved to another connection by the router: look it up again.
            if state.channels.get(channel).is_none_or(|c| c.refs == 0) {
                return Wait::Moved;
            }
            if self.changed.wait_until(&mut state, until).timed_out() {
                return Wait::TimedOut;
            }
        }
    }

    /// Stops the thread (within [`STOP_WAIT`], see [`Subscriber`]'s drop).
    fn shut_down(&self) -> Option<Worker> {
        let mut state = self.state.lock();
        state.shutdown = true;
        if let Some(writer) = state.writer.take() {
            writer.shutdown();
        }
        self.changed.notify_all();
        state.thread.take()
    }
}

/// How a wait for a live subscription ended.
#[derive(PartialEq)]
enum Wait {
    Live,
    /// Not on this connection now (lost, refused, shut down).
    Never,
    /// The channel left this connection (a cluster router moved it).
    Moved,
    TimedOut,
}

/// Where a client's subscriptions go.
enum Hub {
    /// One connection: a single server, a Sentinel's primary, or one node
    /// of a cluster named by `with_notify_client`.
    One(Arc<Shared>),
    /// A cluster: each channel on the node that owns its slot.
    Shards(Arc<Router>),
}

/// The client's subscriber: started on first use, stopped when dropped.
pub(crate) struct Subscriber {
    /// Set once, when the client knows where to connect (at build, or by
    /// `with_notify_client`).
    hub: OnceLock<Hub>,
    stats: Arc<Stats>,
    timeout: Duration,
}

impl Subscriber {
    pub(crate) fn new(source: Option<Source>, stats: Arc<Stats>, timeout: Duration) -> Subscriber {
        let subscriber = Subscriber {
            hub: OnceLock::new(),
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
        let hub = match source {
            Source::Cluster(seeds) => {
                Hub::Shards(Router::new(seeds, self.stats.clone(), self.timeout))
            }
            source => Hub::One(Shared::new(source, None, self.stats.clone(), self.timeout)),
        };
        self.hub.set(hub).is_ok()
    }

    /// A handle that keeps `channel` subscribed while it lives, calling
    /// `waker` on each release message. `None` when this client has no
    /// subscriber (TLS, or a pool given without a `redis::Client`).
    pub(crate) fn subscribe(&self, channel: &str, waker: Waker) -> Option<Subscription> {
        let via = match self.hub.get()? {
            Hub::One(shared) => {
                if !shared.register(channel, waker) {
                    return None;
                }
                Via::One(shared.clone())
            }
            Hub::Shards(router) => {
                if !router.register(channel, waker) {
                    return None;
                }
                Via::Routed(router.clone())
            }
        };
        Some(Subscription {
            via,
            channel: channel.to_owned(),
        })
    }
}

impl Subscriber {
    /// Tells every thread to stop and returns them, to be waited for
    /// (each at most [`STOP_WAIT`], all together); none the second time.
    pub(crate) fn stop(&self) -> Vec<Worker> {
        match self.hub.get() {
            None => Vec::new(),
            Some(Hub::One(shared)) => shared.shut_down().into_iter().collect(),
            Some(Hub::Shards(router)) => router.shut_down(),
        }
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        // Every thread told first, then all waited for together. A thread
        // may be inside a connect or a sentinel lookup: it ends by itself
        // when that returns.
        let told = std::time::Instant::now();
        let threads = self.stop().into_iter().map(|thread| (thread, STOP_WAIT));
        crate::conn::worker::stop_all(told, threads);
    }
}

enum Via {
    One(Arc<Shared>),
    Routed(Arc<Router>),
}

/// Keeps a channel subscribed; unsubscribes when the last handle goes.
pub(crate) struct Subscription {
    via: Via,
    channel: String,
}

impl Subscription {
    /// Whether release messages for the channel are being delivered now.
    pub(crate) fn is_live(&self) -> bool {
        match &self.via {
            Via::One(shared) => shared.is_live(&self.channel),
            Via::Routed(router) => router
                .home(&self.channel)
                .is_some_and(|shared| shared.is_live(&self.channel)),
        }
    }

    /// Waits until the subscription is live, at most until `until`.
    pub(crate) fn wait_live(&self, until: Instant) -> bool {
        match &self.via {
            Via::One(shared) => shared.wait_live(&self.channel, until) == Wait::Live,
            // Bounded: every pass waits a slice, or finds a new home (a
            // move is a server's reply, not a spin).
            Via::Routed(router) => {
                // Its home may change while it waits (a `MOVED`): looked
                // up again every slice. Bounded by `until`.
                loop {
                    let Some(shared) = router.home(&self.channel) else {
                        return false;
                    };
                    let slice = Instant::now()
                        .checked_add(ROUTED_SLICE)
                        .map_or(until, |end| end.min(until));
                    match shared.wait_live(&self.channel, slice) {
                        Wait::Live => return true,
                        Wait::Never => return false,
                        Wait::Moved => {}
                        Wait::TimedOut if Instant::now() >= until => return false,
                        Wait::TimedOut => {}
                    }
                }
            }
        }
    }
}

/// How long a routed subscription's wait looks at one home before it
/// looks its channel up again.
const ROUTED_SLICE: Duration = Duration::from_millis(50);

impl Drop for Subscription {
    fn drop(&mut self) {
        match &self.via {
            Via::One(shared) => shared.release(&self.channel),
            Via::Routed(router) => router.release(&self.channel),
        }
    }
}

/// A channel's place on a cluster.
struct Homed {
    /// The node it is subscribed on; `None`: the seeds' `SUBSCRIBE`
    /// connection (a channel outside its key's slot, or a server before
    /// 7.0).
    node: Option<String>,
    refs: usize,
    waker: Waker,
    /// When its current burst of moves began, and how many it counts.
    moved_at: Instant,
    moves: u32,
}

/// Moves of one channel within [`BURST`] past which the next is not asked
/// for at once but at its node's next retry (one timeout later): two nodes
/// that redirect to each other mid-migration cost a few round trips, not a
/// spin.
const BURST_MOVES: u32 = 8;
const BURST: Duration = Duration::from_secs(1);

#[derive(Default)]
struct Routes {
    /// Slot owners the nodes told (`MOVED`), forgotten when they change.
    owners: HashMap<Slot, String>,
    nodes: HashMap<String, Arc<Shared>>,
    channels: HashMap<String, Homed>,
    /// A node refused `SSUBSCRIBE` as unknown: the cluster's servers
    /// predate sharded pub/sub.
    unsupported: bool,
    shutdown: bool,
}

/// The subscriptions of a cluster client, each channel on the node that
/// owns its slot (see the module docs). Lock order: the routes, then a
/// connection's state; wakers are called with neither held.
pub(crate) struct Router {
    seeds: Vec<Endpoint>,
    stats: Arc<Stats>,
    timeout: Duration,
    /// `SUBSCRIBE` on the seeds.
    plain: Arc<Shared>,
    routes: Mutex<Routes>,
    me: Weak<Router>,
}

impl Router {
    fn new(seeds: Vec<Endpoint>, stats: Arc<Stats>, timeout: Duration) -> Arc<Router> {
        let plain = Shared::new(Source::Fixed(seeds.clone()), None, stats.clone(), timeout);
        Arc::new_cyclic(|me| Router {
            seeds,
            stats,
            timeout,
            plain,
            routes: Mutex::new(Routes::default()),
            me: me.clone(),
        })
    }

    fn register(&self, channel: &str, waker: Waker) -> bool {
        let mut routes = self.routes.lock();
        if routes.shutdown {
            return false;
        }
        if let Some(homed) = routes.channels.get_mut(channel) {
            homed.refs += 1;
            homed.waker = waker.clone();
            let node = homed.node.clone();
            // The node calls the latest subscription's waker, as a single
            // connection does.
            if let Some(shared) = self.connection(&routes, node.as_deref()) {
                shared.set_waker(channel, waker);
            }
            return true;
        }
        let (node, shared) = self.place(&mut routes, channel, None);
        if !shared.register(channel, waker.clone()) {
            return false;
        }
        routes.channels.insert(
            channel.to_owned(),
            Homed {
                node,
                refs: 1,
                waker,
                moved_at: Instant::now(),
                moves: 0,
            },
        );
        true
    }

    fn release(&self, channel: &str) {
        let mut routes = self.routes.lock();
        let Some(homed) = routes.channels.get_mut(channel) else {
            return;
        };
        homed.refs = homed.refs.saturating_sub(1);
        if homed.refs > 0 {
            return;
        }
        let node = routes.channels.remove(channel).and_then(|homed| homed.node);
        if let Some(shared) = self.connection(&routes, node.as_deref()) {
            shared.release(channel);
        }
    }

    /// The connection of `node` (`None`: the seeds' plain one).
    fn connection(&self, routes: &Routes, node: Option<&str>) -> Option<Arc<Shared>> {
        match node {
            Some(node) => routes.nodes.get(node).cloned(),
            None => Some(self.plain.clone()),
        }
    }

    /// The connection `channel` is subscribed on now.
    fn home(&self, channel: &str) -> Option<Arc<Shared>> {
        let routes = self.routes.lock();
        let node = routes.channels.get(channel)?.node.clone();
        self.connection(&routes, node.as_deref())
    }

    /// Where `channel` goes: the node its slot's owner is known to be, else
    /// the first seed other than `avoid`; the seeds' plain connection for a
    /// channel without a hash tag or on servers without sharded pub/sub.
    fn place(
        &self,
        routes: &mut Routes,
        channel: &str,
        avoid: Option<&str>,
    ) -> (Option<String>, Arc<Shared>) {
        if routes.unsupported || crate::script::names::hash_tag(channel).is_none() {
            return (None, self.plain.clone());
        }
        let known = routes
            .owners
            .get(&Slot::for_key(channel))
            .filter(|owner| Some(owner.as_str()) != avoid)
            .cloned();
        let seed = || {
            self.seeds
                .iter()
                .filter_map(|seed| seed.address().map(|address| (address, seed)))
                .find(|(address, _)| Some(address.as_str()) != avoid)
                .or_else(|| {
                    self.seeds
                        .iter()
                        .find_map(|seed| seed.address().map(|address| (address, seed)))
                })
        };
        let (address, endpoint) = match known {
            Some(owner) => {
                let endpoint = endpoint_at(&self.seeds, &owner);
                (owner, endpoint)
            }
            None => match seed() {
                Some((address, seed)) => (address, Some(seed.clone())),
                // Only Unix sockets: no cluster node can be named.
                None => return (None, self.plain.clone()),
            },
        };
        let Some(endpoint) = endpoint else {
            return (None, self.plain.clone());
        };
        let shared = routes
            .nodes
            .entry(address.clone())
            .or_insert_with(|| {
                Shared::new(
                    Source::Fixed(vec![endpoint]),
                    Some(Routed {
                        router: self.me.clone(),
                        node: address.clone(),
                    }),
                    self.stats.clone(),
                    self.timeout,
                )
            })
            .clone();
        (Some(address), shared)
    }

    /// What `node`'s connection said of a channel: move it, and wake its
    /// waiters (they use backoff timing until it is live again).
    fn moved(&self, node: &str, moved: Moved) {
        let wakers = {
            let mut routes = self.routes.lock();
            if routes.shutdown {
                return;
            }
            let channels: Vec<String> = match &moved {
                Moved::To(channel, owner) => {
                    routes
                        .owners
                        .insert(Slot::for_key(channel.as_str()), owner.clone());
                    vec![channel.clone()]
                }
                Moved::Away(channel) => {
                    let slot = Slot::for_key(channel.as_str());
                    if routes.owners.get(&slot).is_some_and(|owner| owner == node) {
                        routes.owners.remove(&slot);
                    }
                    vec![channel.clone()]
                }
                Moved::Unsupported => {
                    if !routes.unsupported {
                        log::info!(
                            "redmutex: the cluster has no sharded pub/sub (SSUBSCRIBE): \
                             release messages go by SUBSCRIBE"
                        );
                    }
                    routes.unsupported = true;
                    on_node(&routes, node)
                }
            };
            self.rehome(&mut routes, &channels, node, false)
        };
        for wake in wakers {
            wake();
        }
    }

    /// `node`'s connection failed: its channels go where their slots' owners
    /// are found now, starting from another seed (at the pace of that
    /// node's reconnections).
    fn node_failed(&self, node: &str) {
        let wakers = {
            let mut routes = self.routes.lock();
            if routes.shutdown {
                return;
            }
            routes.owners.retain(|_, owner| owner != node);
            let channels = on_node(&routes, node);
            self.rehome(&mut routes, &channels, node, true)
        };
        for wake in wakers {
            wake();
        }
    }

    /// Moves each of `channels` still on `from` to where [`Router::place`]
    /// says now, all under the routes' lock (so no registration or release
    /// interleaves), and returns their wakers: their waiters look again.
    fn rehome(
        &self,
        routes: &mut Routes,
        channels: &[String],
        from: &str,
        avoid: bool,
    ) -> Vec<Waker> {
        let mut wakers = Vec::new();
        let old = routes.nodes.get(from).cloned();
        for channel in channels {
            let Some(homed) = routes.channels.get_mut(channel) else {
                continue;
            };
            if homed.node.as_deref() != Some(from) {
                continue;
            }
            if homed.moved_at.elapsed() > BURST {
                homed.moved_at = Instant::now();
                homed.moves = 0;
            }
            homed.moves = homed.moves.saturating_add(1);
            let now = homed.moves <= BURST_MOVES;
            let waker = homed.waker.clone();
            let (node, new) = self.place(routes, channel, avoid.then_some(from));
            if let Some(homed) = routes.channels.get_mut(channel) {
                homed.node = node;
            }
            // The new home first, so a waiter that finds the channel gone
            // from the old one finds it there. On the same node again (no
            // other to try) the channel, no longer subscribed there, is
            // asked for once more.
            new.register_with(channel, waker.clone(), now);
            if let Some(old) = &old {
                old.release(channel);
                // A waiter waiting on the old connection looks again.
                old.changed.notify_all();
            }
            wakers.push(waker);
        }
        wakers
    }

    fn shut_down(&self) -> Vec<Worker> {
        let nodes: Vec<Arc<Shared>> = {
            let mut routes = self.routes.lock();
            routes.shutdown = true;
            routes.nodes.values().cloned().collect()
        };
        nodes
            .iter()
            .chain(std::iter::once(&self.plain))
            .filter_map(|shared| shared.shut_down())
            .collect()
    }
}

/// The channels homed on `node`.
fn on_node(routes: &Routes, node: &str) -> Vec<String> {
    routes
        .channels
        .iter()
        .filter(|(_, homed)| homed.node.as_deref() == Some(node))
        .map(|(channel, _)| channel.clone())
        .collect()
}

/// The endpoint of the node at `address` (`host:port`), spoken to as the
/// seeds are.
fn endpoint_at(seeds: &[Endpoint], address: &str) -> Option<Endpoint> {
    let (host, port) = address.rsplit_once(':')?;
    let port = port.parse().ok()?;
    Some(seeds.first()?.at(host, port))
}

/// The subscriber thread: connect, subscribe what is wanted, read pushes,
/// and on failure wake every waiter and start again, until shutdown.
fn run(shared: &Shared) {
    let mut pause = RECONNECT_MIN;
    let mut attempt = 0;
    loop {
        {
            let mut state = shared.state.lock();
            // A cluster node's connection without channels (all moved
            // away, say after it failed) is not opened again until one
            // comes back to it.
            while shared.sharded() && !state.shutdown && state.channels.is_empty() {
                let _ = shared.changed.wait_for(&mut state, shared.timeout);
            }
            if state.shutdown {
                return;
            }
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
                        state.subscribe(&name, shared.sharded());
                    }
                    shared.changed.notify_all();
                }
                // The pause starts again only after a connection the
                // server spoke on: one that closes at once (maxclients)
                // is retried at a growing pace.
                if read_pushes(shared, reader) {
                    pause = RECONNECT_MIN;
                }
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
        // A cluster node's channels go looking for their slots' owners
        // (a failover promoted another node), at this thread's pace.
        if let Some(router) = shared.router() {
            router.node_failed(shared.node());
        }
        // The whole pause, whatever else wakes the condition (a channel
        // registered here), unless the client is dropped.
        let until = Instant::now().checked_add(pause);
        let mut state = shared.state.lock();
        while let Some(until) = until
            && !state.shutdown
            && !shared.changed.wait_until(&mut state, until).timed_out()
        {}
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

/// Reads pushed frames until the connection ends or goes silent; whether
/// any came.
fn read_pushes(shared: &Shared, mut reader: Reader) -> bool {
    let mut spoke = false;
    let mut retried = Instant::now();
    loop {
        // A cluster node's channels not subscribed (a cluster error other
        // than a redirection, a channel that kept moving) are asked for
        // again once per timeout.
        if shared.sharded() && retried.elapsed() >= shared.timeout {
            retried = Instant::now();
            shared.retry_unsubscribed();
        }
        let frame = match reader.read() {
            Ok(frame) => {
                spoke = true;
                frame
            }
            // One timeout without a whole frame; a frame cut by it is kept
            // by the parser and finished on the next read.
            Err(err) if err.kind() == io::ErrorKind::TimedOut => {
                if heartbeat(shared) {
                    continue;
                }
                log::debug!("redmutex: subscriber link silent for two timeouts: reconnecting");
                return spoke;
            }
            Err(err) => {
                log::debug!("redmutex: subscriber connection ended: {err}");
                return spoke;
            }
        };
        let mut state = shared.state.lock();
        state.ping_unanswered = false;
        let mut moved = None;
        match frame {
            Value::Array(items) | Value::Push { data: items, .. } => {
                let (Some(Value::BulkString(kind)), Some(Value::BulkString(name))) =
                    (items.first(), items.get(1))
                else {
                    continue;
                };
                let name = String::from_utf8_lossy(name).into_owned();
                match kind.as_slice() {
                    b"message" | b"smessage" => {
                        let waker = state.channels.get(&name).and_then(|c| c.waker.clone());
                        drop(state);
                        shared.stats.notification();
                        if let Some(wake) = waker {
                            wake();
                        }
                        continue;
                    }
                    b"sunsubscribe"
                        if !matches!(state.pending.front(),
                            Some(Pending::Unsubscribe(asked)) if *asked == name) =>
                    {
                        // Not asked for: the channel's slot left this node
                        // (a migration, or the node became a replica).
                        if let Some(channel) = state.channels.get_mut(&name) {
                            channel.subscribe_at = None;
                        }
                        shared.changed.notify_all();
                        moved = Some(Moved::Away(name));
                    }
                    b"subscribe" | b"unsubscribe" | b"ssubscribe" | b"sunsubscribe" => {
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
                // A `MOVED` for another slot than this channel's answers
                // the `SUNSUBSCRIBE` before it, whose channel the server
                // had just unsubscribed by itself (a migration): that push
                // was taken for the reply. The channel's reply is still
                // to come.
                Some(Pending::Subscribe(name))
                    if shared.sharded()
                        && moved_slot(&err).is_some_and(|slot| {
                            Slot::new(slot) != Some(Slot::for_key(name.as_str()))
                        }) =>
                {
                    state.pending.push_front(Pending::Subscribe(name));
                }
                Some(Pending::Subscribe(name)) if shared.sharded() && moved_to(&err).is_some() => {
                    if let Some(channel) = state.channels.get_mut(&name) {
                        channel.subscribe_at = None;
                    }
                    state.acknowledge(&name);
                    shared.changed.notify_all();
                    let owner = moved_to(&err).unwrap_or_default();
                    moved = Some(Moved::To(name, owner_address(&owner, shared.node())));
                }
                // The slot is not served here right now (a failover, a
                // migration's `ASK`): not subscribed, and asked for again
                // at the next retry; waiters use backoff timing meanwhile.
                Some(Pending::Subscribe(name))
                    if shared.sharded()
                        && matches!(
                            err.code(),
                            "ASK" | "TRYAGAIN" | "CLUSTERDOWN" | "LOADING" | "MASTERDOWN"
                        ) =>
                {
                    if let Some(channel) = state.channels.get_mut(&name) {
                        channel.subscribe_at = None;
                    }
                    state.acknowledge(&name);
                    shared.changed.notify_all();
                }
                Some(Pending::Subscribe(name))
                    if shared.sharded()
                        && err
                            .details()
                            .is_some_and(|detail| detail.contains("unknown command")) =>
                {
                    if let Some(channel) = state.channels.get_mut(&name) {
                        channel.subscribe_at = None;
                    }
                    state.acknowledge(&name);
                    shared.changed.notify_all();
                    moved = Some(Moved::Unsupported);
                }
                Some(Pending::Subscribe(name)) => {
                    log::warn!(
                        "redmutex: the server refuses to subscribe to {name:?} ({err}); \
                         waiters of that lock poll with backoff instead (see the ACL rules in the failure model chapter of the guide, redmutex::guide::failure_model)"
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
        drop(state);
        if let Some(moved) = moved
            && let Some(router) = shared.router()
        {
            router.moved(shared.node(), moved);
        }
    }
}

/// The slot of a `MOVED` error (`MOVED slot host:port`).
fn moved_slot(err: &redis::ServerError) -> Option<u16> {
    if err.code() != "MOVED" {
        return None;
    }
    err.details()?.split_whitespace().next()?.parse().ok()
}

/// The `host:port` of a `MOVED` error (`MOVED slot host:port`).
fn moved_to(err: &redis::ServerError) -> Option<String> {
    if err.code() != "MOVED" {
        return None;
    }
    let detail = err.details()?;
    let address = detail.split_whitespace().nth(1)?;
    Some(address.to_owned())
}

/// A `MOVED` address as a node name: an empty host (a node that does not
/// know its own address) is the host of the node that said it.
fn owner_address(owner: &str, from: &str) -> String {
    match owner.strip_prefix(':') {
        Some(port) => {
            let host = from.rsplit_once(':').map_or("", |(host, _)| host);
            format!("{host}:{port}")
        }
        None => owner.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server_error(reply: &[u8]) -> redis::ServerError {
        match redis::parse_redis_value(reply) {
            Ok(Value::ServerError(err)) => err,
            other => panic!("not an error reply: {other:?}"),
        }
    }

    #[test]
    fn a_moved_reply_names_the_slot_and_the_owner() {
        let moved = server_error(b"-MOVED 3999 127.0.0.1:6381\r\n");
        assert_eq!(moved_slot(&moved), Some(3999));
        assert_eq!(moved_to(&moved).as_deref(), Some("127.0.0.1:6381"));
        let other = server_error(b"-CLUSTERDOWN Hash slot not served\r\n");
        assert_eq!(moved_slot(&other), None);
        assert_eq!(moved_to(&other), None);
        let garbled = server_error(b"-MOVED x\r\n");
        assert_eq!(moved_slot(&garbled), None);
        assert_eq!(moved_to(&garbled), None);
    }

    #[test]
    fn an_owner_without_a_host_is_on_the_host_that_said_it() {
        assert_eq!(owner_address(":7002", "10.0.0.5:7000"), "10.0.0.5:7002");
        assert_eq!(
            owner_address("10.0.0.6:7003", "10.0.0.5:7000"),
            "10.0.0.6:7003"
        );
        assert_eq!(owner_address(":7002", "[::1]:7000"), "[::1]:7002");
    }
}
