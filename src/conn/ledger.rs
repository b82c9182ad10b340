//! The replies a connection owes: requests written behind (sent without
//! waiting for their reply), read by whoever uses the connection next, in
//! order, before its own, each handed to the request's owner.
//!
//! Kept apart from the connection it serves (anything that can send a
//! request and read the next reply, a [`Wire`]), so its rules are checked
//! on their own, over every interleaving of the threads that share a pool
//! of connections (`RUSTFLAGS="--cfg loom" cargo test --lib --release
//! model`). Invariants: every owed reply reaches its owner exactly once,
//! as its reply or as lost (never another request's reply, never twice);
//! a request's own reply is read only after every reply owed before it.

use std::sync::Arc;

use redis::{RedisError, RedisResult, Value};

/// A reply a connection still owes: its request was written behind (sent
/// without waiting, `Connection::write_behind`), and whoever uses the
/// connection next reads it, in order, before its own.
///
/// Held as an `Arc`, so one allocation can serve the connection that owes
/// the reply and whoever else watches for it (the deferred check of a
/// release written behind).
pub(crate) trait Owed: std::marker::Send + std::marker::Sync {
    /// The reply came (an error reply as [`Value::ServerError`]). Returns
    /// a request to write behind in its stead when the reply asks for it to
    /// be sent again (`NOSCRIPT`: a script missing from the cache).
    fn replied(self: Arc<Self>, reply: Value) -> Option<Rewrite>;

    /// The reply will never be read: the connection was lost or given up
    /// first, so whether the request ran is unknown.
    fn lost(self: Arc<Self>, err: &RedisError);
}

/// A request to write behind again, with what its reply is owed to.
pub(crate) struct Rewrite {
    pub(crate) request: Vec<u8>,
    pub(crate) owed: Arc<dyn Owed>,
}

/// At most this many replies are owed on one connection: writing behind on
/// a connection owing that many reads them first, so a thread dropping
/// thousands of guards in a row keeps memory (ours and the server's output
/// buffer) bounded.
pub(crate) const MAX_OWED: usize = 32;

/// What the ledger needs of a connection: to send a request, and to read
/// the next reply.
pub(crate) trait Wire {
    fn send(&mut self, request: &[u8]) -> RedisResult<()>;
    /// The next reply (not a RESP3 push, which is no reply).
    fn recv(&mut self) -> RedisResult<Value>;
}

/// A plain redis-rs connection as a [`Wire`].
pub(crate) struct PlainWire<'a>(pub(crate) &'a mut redis::Connection);

impl Wire for PlainWire<'_> {
    fn send(&mut self, request: &[u8]) -> RedisResult<()> {
        self.0.send_packed_command(request)
    }

    fn recv(&mut self) -> RedisResult<Value> {
        loop {
            match self.0.recv_response() {
                Ok(Value::Push { .. }) => continue,
                other => return other,
            }
        }
    }
}

/// The replies one connection owes, oldest first.
#[derive(Default)]
pub(crate) struct Ledger {
    owed: Vec<Arc<dyn Owed>>,
}

impl Ledger {
    pub(crate) fn is_empty(&self) -> bool {
        self.owed.is_empty()
    }

    /// Sends `request` and records that its reply is owed to `owed`. The
    /// ledger full ([`MAX_OWED`]) is read first. `Err` when the write (or
    /// that read) failed: `owed` comes back, nothing complete was written
    /// for it, and what else was owed is given up (the connection must
    /// not be used again).
    pub(crate) fn write_behind(
        &mut self,
        wire: &mut dyn Wire,
        request: &[u8],
        owed: Arc<dyn Owed>,
    ) -> Result<(), (Arc<dyn Owed>, RedisError)> {
        if self.owed.len() >= MAX_OWED
            && let Err(err) = self.settle(wire, 2)
        {
            self.give_up(&err);
            return Err((owed, err));
        }
        match wire.send(request) {
            Ok(()) => {
                self.owed.push(owed);
                Ok(())
            }
            Err(err) => {
                self.give_up(&err);
                Err((owed, err))
            }
        }
    }

    /// Sends `request` and reads first the replies owed, then its own: the
    /// request goes out before anything is read, so the owed replies and
    /// this one share a round trip (Redis answers in order). On a failure
    /// what is owed is given up: the connection must not be used again.
    pub(crate) fn after_owed(&mut self, wire: &mut dyn Wire, request: &[u8]) -> RedisResult<Value> {
        let result = wire
            .send(request)
            // One round only: a rewrite written now goes out after
            // `request`, so its reply comes after this request's and
            // stays owed.
            .and_then(|()| self.settle(wire, 1))
            .and_then(|()| wire.recv());
        if let Err(err) = &result {
            self.give_up(err);
        }
        result
    }

    /// Reads the replies owed, oldest first, and hands each to its owner,
    /// in up to `rounds` rounds. A rewrite (a resend after `NOSCRIPT`) is
    /// written behind again and owed in turn, read by the next round; it
    /// cannot ask for another (it is an `EVAL`), so two rounds settle
    /// everything when nothing else was written after the owed requests.
    /// On a failure, the entry being read and every one after it are lost;
    /// rewrites already written stay owed (the caller gives them up with
    /// the connection).
    pub(crate) fn settle(&mut self, wire: &mut dyn Wire, rounds: usize) -> RedisResult<()> {
        for _ in 0..rounds {
            if self.owed.is_empty() {
                break;
            }
            let mut owed = std::mem::take(&mut self.owed);
            let mut pending = owed.drain(..);
            while let Some(entry) = pending.next() {
                let failed = match wire.recv() {
                    Ok(reply) => match entry.replied(reply) {
                        Some(rewrite) => match wire.send(&rewrite.request) {
                            Ok(()) => {
                                self.owed.push(rewrite.owed);
                                None
                            }
                            Err(err) => {
                                rewrite.owed.lost(&err);
                                Some(err)
                            }
                        },
                        None => None,
                    },
                    Err(err) => {
                        entry.lost(&err);
                        Some(err)
                    }
                };
                if let Some(err) = failed {
                    for rest in pending.by_ref() {
                        rest.lost(&err);
                    }
                    return Err(err);
                }
            }
            drop(pending);
            // Keep the allocation for the next requests written behind.
            if self.owed.is_empty() {
                self.owed = owed;
            }
        }
        Ok(())
    }

    /// Every reply owed will never be read: each owner is told.
    pub(crate) fn give_up(&mut self, err: &RedisError) {
        for entry in self.owed.drain(..) {
            entry.lost(err);
        }
    }

    /// Forgets what is owed without telling anyone (a forked child: the
    /// replies are the parent's to read).
    pub(crate) fn forget(&mut self) {
        self.owed.clear();
    }
}

/// Model checking (`RUSTFLAGS="--cfg loom" cargo test --lib --release
/// model`): threads sharing a pool of connections write requests behind and
/// send their own, while the server's script cache may be flushed (a
/// `NOSCRIPT`, then the request sent again) and a connection may be cut.
/// Over every interleaving: each reply owed reaches its own owner exactly
/// once (its reply, never another's, or "lost"), and each request's caller
/// gets its own reply.
#[cfg(all(loom, test))]
mod model {
    use super::*;
    use crate::wait::sync::check;
    use loom::sync::atomic::{AtomicBool, Ordering};
    use loom::sync::{Arc, Mutex};
    use std::collections::VecDeque;

    /// The server: whether its script cache was flushed (an `EVALSHA` is
    /// then answered `NOSCRIPT`, an `EVAL` loads the script again).
    #[derive(Default)]
    struct Server {
        flushed: AtomicBool,
    }

    /// One connection to it: the replies on their way, in order; cut, it
    /// reads nothing more.
    struct Socket {
        server: Arc<Server>,
        replies: VecDeque<Value>,
        cut: bool,
    }

    fn io_error() -> RedisError {
        RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset))
    }

    impl Wire for Socket {
        fn send(&mut self, request: &[u8]) -> RedisResult<()> {
            let (kind, id) = request.split_at(1);
            let reply = match kind {
                // EVALSHA of the release script.
                b"R" if self.server.flushed.load(Ordering::SeqCst) => {
                    redis::parse_redis_value(b"-NOSCRIPT No matching script.\r\n")
                        .expect("a RESP error")
                }
                // EVAL loads it again.
                b"E" => {
                    self.server.flushed.store(false, Ordering::SeqCst);
                    Value::BulkString(id.to_vec())
                }
                _ => Value::BulkString(id.to_vec()),
            };
            self.replies.push_back(reply);
            Ok(())
        }

        fn recv(&mut self) -> RedisResult<Value> {
            if self.cut {
                return Err(io_error());
            }
            self.replies.pop_front().ok_or_else(io_error)
        }
    }

    /// A connection of the pool: its socket and what it owes.
    struct Link {
        socket: Socket,
        ledger: Ledger,
        broken: bool,
    }

    /// What became of each request written behind: (its id, the reply
    /// it got, or `None`: lost).
    type Outcomes = Arc<Mutex<Vec<(u8, Option<Vec<u8>>)>>>;

    /// An owner of a reply owed: a release by id.
    struct Release {
        id: u8,
        outcomes: Outcomes,
    }

    /// How many `NOSCRIPT` rewrites and losses the executions went
    /// through, over all of them (outside loom's model): the checks must
    /// have met the paths they are about.
    static REWRITES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    static LOSSES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    impl Owed for Release {
        fn replied(self: std::sync::Arc<Self>, reply: Value) -> Option<Rewrite> {
            match reply {
                Value::ServerError(err) if err.code() == "NOSCRIPT" => {
                    REWRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    Some(Rewrite {
                        request: vec![b'E', self.id],
                        owed: self,
                    })
                }
                Value::BulkString(bytes) => {
                    self.outcomes.lock().unwrap().push((self.id, Some(bytes)));
                    None
                }
                other => panic!("release {} got {other:?}", self.id),
            }
        }

        fn lost(self: std::sync::Arc<Self>, _err: &RedisError) {
            LOSSES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.outcomes.lock().unwrap().push((self.id, None));
        }
    }

    struct World {
        server: Arc<Server>,
        pool: Mutex<Vec<Link>>,
        outcomes: Outcomes,
    }

    impl World {
        fn new() -> Arc<World> {
            Arc::new(World {
                server: Arc::default(),
                pool: Mutex::new(Vec::new()),
                outcomes: Arc::default(),
            })
        }

        fn checkout(&self) -> Link {
            self.pool.lock().unwrap().pop().unwrap_or_else(|| Link {
                socket: Socket {
                    server: self.server.clone(),
                    replies: VecDeque::new(),
                    cut: false,
                },
                ledger: Ledger::default(),
                broken: false,
            })
        }

        fn checkin(&self, link: Link) {
            if !link.broken {
                self.pool.lock().unwrap().push(link);
            }
        }

        /// A drop writing its release `id` behind.
        fn release_behind(&self, id: u8) {
            let mut link = self.checkout();
            let owed = std::sync::Arc::new(Release {
                id,
                outcomes: self.outcomes.clone(),
            });
            if let Err((owed, err)) = link
                .ledger
                .write_behind(&mut link.socket, &[b'R', id], owed)
            {
                link.broken = true;
                owed.lost(&err);
            }
            self.checkin(link);
        }

        /// A request `id` sent after whatever the connection owes: its
        /// caller must get its own reply.
        fn request(&self, id: u8) {
            let mut link = self.checkout();
            match link.ledger.after_owed(&mut link.socket, &[b'Q', id]) {
                Ok(Value::BulkString(bytes)) => assert_eq!(bytes, vec![id], "another's reply"),
                Ok(other) => panic!("request {id} got {other:?}"),
                Err(_) => link.broken = true,
            }
            self.checkin(link);
        }

        /// The pool closing: each connection reads what it owes (two
        /// rounds), or gives it up.
        fn close(&self) {
            for mut link in self.pool.lock().unwrap().drain(..) {
                if let Err(err) = link.ledger.settle(&mut link.socket, 2) {
                    link.ledger.give_up(&err);
                }
                assert!(link.ledger.is_empty(), "a reply still owed after closing");
            }
        }

        /// Every release written behind has exactly one outcome: its own
        /// reply, or lost.
        fn settled(&self, ids: &[u8]) {
            let outcomes = self.outcomes.lock().unwrap();
            for id in ids {
                let mine: Vec<_> = outcomes.iter().filter(|(of, _)| of == id).collect();
                assert_eq!(mine.len(), 1, "release {id}: {mine:?}");
                if let Some(reply) = &mine[0].1 {
                    assert_eq!(reply, &vec![*id], "release {id} got another's reply");
                }
            }
            assert_eq!(outcomes.len(), ids.len(), "{outcomes:?}");
        }
    }

    /// Three threads on one pool, the script cache flushed at any moment.
    #[test]
    fn model_every_owed_reply_reaches_its_owner_once() {
        let runs = check(3, || {
            let world = World::new();
            let a = {
                let world = world.clone();
                loom::thread::spawn(move || {
                    world.release_behind(1);
                    world.request(2);
                })
            };
            let b = {
                let world = world.clone();
                loom::thread::spawn(move || {
                    world.release_behind(3);
                    world.release_behind(4);
                })
            };
            world.server.flushed.store(true, Ordering::SeqCst);
            world.request(5);
            a.join().unwrap();
            b.join().unwrap();
            world.close();
            world.settled(&[1, 3, 4]);
        });
        println!("owed replies, 3 threads: {runs} executions checked");
        assert!(
            REWRITES.load(std::sync::atomic::Ordering::Relaxed) > 0,
            "no NOSCRIPT met"
        );
    }

    /// A connection cut while it owes replies: each owner is told "lost"
    /// once, and no request gets a reply that was not its own.
    #[test]
    fn model_a_cut_connection_loses_each_owed_reply_once() {
        let runs = check(3, || {
            let world = World::new();
            let a = {
                let world = world.clone();
                loom::thread::spawn(move || {
                    world.release_behind(1);
                    world.release_behind(2);
                })
            };
            let cutter = {
                let world = world.clone();
                loom::thread::spawn(move || {
                    // The server hangs up on whatever idle connection there is.
                    if let Some(link) = world.pool.lock().unwrap().last_mut() {
                        link.socket.cut = true;
                    }
                })
            };
            world.request(3);
            a.join().unwrap();
            cutter.join().unwrap();
            world.close();
            world.settled(&[1, 2]);
        });
        println!("owed replies, a cut connection: {runs} executions checked");
        assert!(
            LOSSES.load(std::sync::atomic::Ordering::Relaxed) > 0,
            "no loss met"
        );
    }
}
