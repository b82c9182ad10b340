//! A fault-injecting TCP proxy between a client and a private
//! `redis-server`, for tests, benches and examples.
//!
//! It listens on a free loopback port and forwards every connection to the
//! server, one thread per direction, and on request: delays each direction,
//! blackholes (accepts and holds sockets, forwards nothing until healed),
//! stalls new connections (a server that accepts and never answers the
//! handshake), resets every connection, drops a request before it reaches
//! the server, or loses a reply: forwards the command, lets the server run
//! it, then cuts the connection before the reply reaches the client.
//!
//! Held bytes are delivered when a fault is healed, as TCP would after a
//! partition: a request held in a blackhole can still reach the server late.
//! Every thread ends when its sockets close, and dropping the proxy closes
//! them all.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often a held thread looks at the proxy's state again.
const POLL: Duration = Duration::from_millis(20);

/// A fault armed for the next requests whose bytes contain `pattern`.
struct Arm {
    pattern: Vec<u8>,
    /// Matching requests to let by before it fires.
    skip: u32,
    remaining: u32,
}

#[derive(Default)]
struct Faults {
    /// Added to every chunk going to the server / to the client.
    latency_up: Duration,
    latency_down: Duration,
    /// Forward nothing, in either direction, on any connection.
    blackhole: bool,
    /// Forward nothing on replication links (those that sent `PSYNC`).
    cut_replication: bool,
    /// New connections are accepted and held, not connected upstream.
    stall_new: bool,
    /// New connections are accepted and never served, even after this is
    /// turned off (a path that swallowed them).
    swallow_new: bool,
    lose_reply: Vec<Arm>,
    drop_request: Vec<Arm>,
    /// Patterns whose occurrences in requests are counted ([`FaultProxy::count`]).
    counted: Vec<(Vec<u8>, u64)>,
}

#[derive(Default)]
struct Counters {
    accepted: AtomicU64,
    lost_replies: AtomicU64,
    dropped_requests: AtomicU64,
    resets: AtomicU64,
}

struct Shared {
    faults: Mutex<Faults>,
    changed: Condvar,
    links: Mutex<Vec<Arc<Link>>>,
    stop: AtomicBool,
    counters: Counters,
    upstream: u16,
}

impl Shared {
    fn faults(&self) -> MutexGuard<'_, Faults> {
        self.faults.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until `held` is false for the current faults, the link closes
    /// or the proxy stops; false when it should give up.
    fn wait_while(&self, link: &Link, held: impl Fn(&Faults) -> bool) -> bool {
        let mut faults = self.faults();
        loop {
            if self.stop.load(Ordering::SeqCst) || link.closed.load(Ordering::SeqCst) {
                return false;
            }
            if !held(&faults) {
                return true;
            }
            faults = self
                .changed
                .wait_timeout(faults, POLL)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Takes one arm whose pattern occurs in `chunk`, if any.
    fn fire(arms: &mut Vec<Arm>, chunk: &[u8]) -> bool {
        let hit = arms
            .iter()
            .position(|arm| contains(chunk, &arm.pattern) && arm.remaining > 0);
        match hit {
            Some(i) if arms[i].skip > 0 => {
                arms[i].skip -= 1;
                false
            }
            Some(i) => {
                arms[i].remaining -= 1;
                if arms[i].remaining == 0 {
                    arms.remove(i);
                }
                true
            }
            None => false,
        }
    }
}

/// One proxied connection.
struct Link {
    client: TcpStream,
    server: Mutex<Option<TcpStream>>,
    closed: AtomicBool,
    /// A request of this link is to lose its reply: the next bytes from the
    /// server close the link instead of reaching the client.
    doomed: AtomicBool,
    /// A replica's link to its primary: it sent `PSYNC`.
    replication: AtomicBool,
}

impl Link {
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let _ = self.client.shutdown(Shutdown::Both);
        if let Some(server) = self
            .server
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            let _ = server.shutdown(Shutdown::Both);
        }
    }
}

/// A TCP proxy on a free loopback port in front of a server on
/// `127.0.0.1:upstream`; see the module docs for the faults.
pub struct FaultProxy {
    port: u16,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl FaultProxy {
    /// A proxy in front of `server`.
    pub fn to(server: &super::RedisServer) -> FaultProxy {
        FaultProxy::start(server.port())
    }

    /// A proxy in front of `127.0.0.1:upstream`.
    pub fn start(upstream: u16) -> FaultProxy {
        let listener =
            TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind the proxy's loopback port");
        let port = listener.local_addr().expect("proxy address").port();
        let shared = Arc::new(Shared {
            faults: Mutex::new(Faults::default()),
            changed: Condvar::new(),
            links: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            counters: Counters::default(),
            upstream,
        });
        let acceptor = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("proxy-accept".into())
                .spawn(move || accept_loop(listener, &shared))
                .expect("start the proxy")
        };
        FaultProxy {
            port,
            shared,
            acceptor: Some(acceptor),
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn update(&self, change: impl FnOnce(&mut Faults)) {
        change(&mut self.shared.faults());
        self.shared.changed.notify_all();
    }

    /// Delays every chunk by `up` on its way to the server and by `down` on
    /// its way back.
    pub fn set_latency(&self, up: Duration, down: Duration) {
        self.update(|f| {
            f.latency_up = up;
            f.latency_down = down;
        });
    }

    /// Accepts and holds every socket but forwards nothing, until turned
    /// off; what was held is then delivered.
    pub fn blackhole(&self, on: bool) {
        self.update(|f| f.blackhole = on);
    }

    /// Holds everything on replication links (a replica's connection
    /// through this proxy to its primary, known by its `PSYNC`) while on;
    /// clients' links go on working. Held bytes are delivered when turned
    /// off, unless [`FaultProxy::reset_replication`] closed the links first:
    /// then the replica never gets the writes made meanwhile.
    pub fn cut_replication(&self, on: bool) {
        self.update(|f| f.cut_replication = on);
    }

    /// Closes the replication links (see [`FaultProxy::cut_replication`]).
    pub fn reset_replication(&self) {
        let links: Vec<Arc<Link>> = self
            .links()
            .iter()
            .filter(|l| l.replication.load(Ordering::SeqCst))
            .cloned()
            .collect();
        for link in links {
            link.close();
        }
    }

    /// New connections are accepted but their handshake gets no answer
    /// (nothing is forwarded for them) until turned off. Existing ones go
    /// on working.
    pub fn stall_new(&self, on: bool) {
        self.update(|f| f.stall_new = on);
    }

    /// New connections are accepted and never answered, not even after
    /// this is turned off: they stay silent until closed, as on a path that
    /// swallowed them. Existing ones go on working.
    pub fn swallow_new(&self, on: bool) {
        self.update(|f| f.swallow_new = on);
    }

    /// The next `times` requests containing `pattern` reach the server, run,
    /// and their connection is cut before the reply gets back.
    pub fn lose_reply(&self, pattern: &str, times: u32) {
        self.lose_reply_after(pattern, 0, times);
    }

    /// As [`FaultProxy::lose_reply`], after letting the next `skip`
    /// requests containing `pattern` by unharmed.
    pub fn lose_reply_after(&self, pattern: &str, skip: u32, times: u32) {
        self.update(|f| {
            f.lose_reply.push(Arm {
                pattern: pattern.as_bytes().to_vec(),
                skip,
                remaining: times,
            })
        });
    }

    /// The next `times` requests containing `pattern` are dropped: their
    /// connection is cut before they reach the server.
    pub fn drop_request(&self, pattern: &str, times: u32) {
        self.update(|f| {
            f.drop_request.push(Arm {
                pattern: pattern.as_bytes().to_vec(),
                skip: 0,
                remaining: times,
            })
        });
    }

    /// Counts, from now on, the requests containing `pattern` that reach
    /// the proxy (each occurrence, so a pipeline counts each of its
    /// commands; a pattern split across two reads of the socket is missed,
    /// which a whole short request never is). Read with
    /// [`FaultProxy::counted`]; [`FaultProxy::heal`] forgets it.
    pub fn count(&self, pattern: &str) {
        self.update(|f| f.counted.push((pattern.as_bytes().to_vec(), 0)));
    }

    /// How many requests containing `pattern` came by since
    /// [`FaultProxy::count`] was called for it.
    pub fn counted(&self, pattern: &str) -> u64 {
        let f = self.shared.faults();
        f.counted
            .iter()
            .filter(|(counted, _)| counted.as_slice() == pattern.as_bytes())
            .map(|(_, seen)| *seen)
            .sum()
    }

    /// Arms not fired yet (lost replies and dropped requests).
    pub fn armed(&self) -> u32 {
        let f = self.shared.faults();
        f.lose_reply
            .iter()
            .chain(f.drop_request.iter())
            .map(|a| a.remaining)
            .sum()
    }

    /// Turns every fault off (held bytes are delivered) and disarms.
    pub fn heal(&self) {
        self.update(|f| *f = Faults::default());
    }

    /// Closes every current connection on both sides.
    pub fn reset_all(&self) {
        let links: Vec<Arc<Link>> = self.links().drain(..).collect();
        for link in links {
            link.close();
        }
        self.shared.counters.resets.fetch_add(1, Ordering::SeqCst);
    }

    fn links(&self) -> MutexGuard<'_, Vec<Arc<Link>>> {
        self.shared.links.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Connections open now.
    pub fn connections(&self) -> usize {
        let mut links = self.links();
        links.retain(|l| !l.closed.load(Ordering::SeqCst));
        links.len()
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.shared.counters.accepted.load(Ordering::SeqCst)
    }

    /// Replies lost so far.
    pub fn lost_replies(&self) -> u64 {
        self.shared.counters.lost_replies.load(Ordering::SeqCst)
    }

    /// Requests dropped so far.
    pub fn dropped_requests(&self) -> u64 {
        self.shared.counters.dropped_requests.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        // Wakes the blocking accept.
        let _ = TcpStream::connect((Ipv4Addr::LOCALHOST, self.port));
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        self.reset_all();
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

fn occurrences(haystack: &[u8], needle: &[u8]) -> u64 {
    if needle.is_empty() {
        return 0;
    }
    haystack
        .windows(needle.len())
        .filter(|w| *w == needle)
        .count() as u64
}

fn accept_loop(listener: TcpListener, shared: &Arc<Shared>) {
    for stream in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(client) = stream else { continue };
        let _ = client.set_nodelay(true);
        shared.counters.accepted.fetch_add(1, Ordering::SeqCst);
        let Ok(reader) = client.try_clone() else {
            continue;
        };
        let link = Arc::new(Link {
            client,
            server: Mutex::new(None),
            closed: AtomicBool::new(false),
            doomed: AtomicBool::new(false),
            replication: AtomicBool::new(false),
        });
        {
            let mut links = shared.links.lock().unwrap_or_else(|e| e.into_inner());
            links.retain(|l| !l.closed.load(Ordering::SeqCst));
            links.push(link.clone());
        }
        let shared = shared.clone();
        let _ = std::thread::Builder::new()
            .name("proxy-link".into())
            .spawn(move || serve(&shared, &link, reader));
    }
}

/// Connects `link` upstream once no stall holds it, then pumps both ways.
fn serve(shared: &Arc<Shared>, link: &Arc<Link>, client_reader: TcpStream) {
    if shared.faults().swallow_new {
        // Held until the client or the proxy gives up on it.
        let _ = shared.wait_while(link, |_| true);
        link.close();
        return;
    }
    if !shared.wait_while(link, |f| f.stall_new || f.blackhole) {
        link.close();
        return;
    }
    let server = match TcpStream::connect((Ipv4Addr::LOCALHOST, shared.upstream)) {
        Ok(server) => server,
        Err(_) => {
            link.close();
            return;
        }
    };
    let _ = server.set_nodelay(true);
    let Ok(server_reader) = server.try_clone() else {
        link.close();
        return;
    };
    *link.server.lock().unwrap_or_else(|e| e.into_inner()) = Some(server);
    if link.closed.load(Ordering::SeqCst) {
        link.close();
        return;
    }
    let up = {
        let (shared, link) = (shared.clone(), link.clone());
        std::thread::spawn(move || pump(&shared, &link, client_reader, Direction::Up))
    };
    pump(shared, link, server_reader, Direction::Down);
    let _ = up.join();
    link.close();
}

#[derive(Clone, Copy, PartialEq)]
enum Direction {
    /// Client to server.
    Up,
    /// Server to client.
    Down,
}

/// Reads `from` into a queue of timestamped chunks; a second thread
/// delivers each when its latency has passed and no fault holds it.
fn pump(shared: &Arc<Shared>, link: &Arc<Link>, mut from: TcpStream, direction: Direction) {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let writer = {
        let (shared, link) = (shared.clone(), link.clone());
        std::thread::spawn(move || deliver(&shared, &link, &rx, direction))
    };
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if direction == Direction::Up && contains(&buf[..n], b"PSYNC") {
                    link.replication.store(true, Ordering::SeqCst);
                }
                let latency = {
                    let f = shared.faults();
                    match direction {
                        Direction::Up => f.latency_up,
                        Direction::Down => f.latency_down,
                    }
                };
                if tx
                    .send((Instant::now() + latency, buf[..n].to_vec()))
                    .is_err()
                {
                    break;
                }
            }
        }
    }
    drop(tx);
    let _ = writer.join();
    link.close();
}

fn deliver(
    shared: &Arc<Shared>,
    link: &Arc<Link>,
    chunks: &mpsc::Receiver<(Instant, Vec<u8>)>,
    direction: Direction,
) {
    while let Ok((due, chunk)) = chunks.recv() {
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        let replication = link.replication.load(Ordering::SeqCst);
        if !shared.wait_while(link, |f| f.blackhole || (f.cut_replication && replication)) {
            return;
        }
        let mut to = match direction {
            Direction::Up => {
                let (drop_it, lose_it) = {
                    let mut f = shared.faults();
                    for (pattern, seen) in &mut f.counted {
                        *seen += occurrences(&chunk, pattern);
                    }
                    let drop_it = Shared::fire(&mut f.drop_request, &chunk);
                    let lose_it = !drop_it && Shared::fire(&mut f.lose_reply, &chunk);
                    (drop_it, lose_it)
                };
                if drop_it {
                    shared
                        .counters
                        .dropped_requests
                        .fetch_add(1, Ordering::SeqCst);
                    link.close();
                    return;
                }
                if lose_it {
                    // Set before the request leaves, so the reply cannot
                    // slip through.
                    link.doomed.store(true, Ordering::SeqCst);
                }
                match link
                    .server
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_ref()
                    .and_then(|s| s.try_clone().ok())
                {
                    Some(server) => server,
                    None => return,
                }
            }
            Direction::Down => {
                if link.doomed.load(Ordering::SeqCst) {
                    // The server ran the request: its reply is here. Cut.
                    shared.counters.lost_replies.fetch_add(1, Ordering::SeqCst);
                    link.close();
                    return;
                }
                match link.client.try_clone() {
                    Ok(client) => client,
                    Err(_) => return,
                }
            }
        };
        if to.write_all(&chunk).is_err() {
            link.close();
            return;
        }
    }
}
