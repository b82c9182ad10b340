//! The pool of the clients this crate builds: connections opened in the
//! thread that needs one, by that thread, within its own wait.
//!
//! No thread of the pool's own, and none shared between pools: a server
//! that accepts and never answers delays only the callers that asked for
//! it, never a connect to another server (r2d2's background connects ran
//! on threads every pool shared, and a failed one was scheduled again for
//! as long as its pool lived). A caller whose wait runs out stops trying;
//! nothing it started goes on without it.
//!
//! Invariants: at most `max` connections exist, counting those being
//! opened; a connection the opener calls unusable is never handed out and
//! is dropped outside the pool's lock (dropping one may read replies it
//! owes, for a bounded time); every waiter is woken when a connection comes
//! back or a slot frees.

use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use redis::RedisError;

/// What opens and judges the connections of a [`Pool`].
pub(crate) trait Opener: Send + Sync + 'static {
    type Link: Send + 'static;

    /// Opens one connection, in at most `limit`.
    fn open(&self, limit: Duration) -> Result<Self::Link, Open>;

    /// Whether a connection may be handed out (again): not broken, not
    /// from before the server was found gone. No round trip.
    fn is_usable(&self, link: &mut Self::Link) -> bool;
}

/// Why a connect failed.
pub(crate) enum Open {
    /// The server refuses this client for good (a wrong password): said to
    /// the caller at once, never tried again.
    Refused(String),
    /// Anything else: tried again while the caller's wait lasts.
    Failed(RedisError),
}

/// Why [`Pool::get`] returned no connection.
pub(crate) enum Failure {
    Refused(String),
    /// The wait ran out; the last connect error, if a connect failed.
    TimedOut(Option<RedisError>),
}

struct State<L> {
    idle: Vec<L>,
    /// Connections that exist: idle, handed out, or being opened.
    count: usize,
}

/// A bounded pool of connections (see the module docs).
pub(crate) struct Pool<O: Opener> {
    opener: O,
    max: usize,
    state: Mutex<State<O::Link>>,
    /// Signalled when a connection comes back or a slot frees.
    freed: Condvar,
}

/// The first pause between two connects that failed, doubled each time up
/// to [`RETRY_MAX`]: a server restarting is found again within a pause,
/// and a dead one is not hammered.
const RETRY_FIRST: Duration = Duration::from_millis(10);
const RETRY_MAX: Duration = Duration::from_millis(250);

impl<O: Opener> Pool<O> {
    pub(crate) fn new(opener: O, max: usize) -> Arc<Pool<O>> {
        Arc::new(Pool {
            opener,
            max: max.max(1),
            state: Mutex::new(State {
                idle: Vec::new(),
                count: 0,
            }),
            freed: Condvar::new(),
        })
    }

    /// How many connections exist, and how many of them are idle.
    pub(crate) fn occupancy(&self) -> (usize, usize) {
        let state = self.state.lock();
        (state.count, state.idle.len())
    }

    /// A connection within `wait`: the most recently returned idle one, or
    /// a new one opened by this thread (each attempt within what is left of
    /// `wait` and `connect`, the bound of one connect), or one returned
    /// while waiting.
    pub(crate) fn get(
        self: &Arc<Self>,
        wait: Duration,
        connect: Duration,
    ) -> Result<Checked<O>, Failure> {
        let started = Instant::now();
        let left = || wait.saturating_sub(started.elapsed());
        let mut last: Option<RedisError> = None;
        let mut pause = RETRY_FIRST;
        let mut state = self.state.lock();
        // Bounded by `wait`: every pass either returns, opens (bounded),
        // or sleeps until `wait` runs out.
        loop {
            while let Some(mut link) = state.idle.pop() {
                if self.opener.is_usable(&mut link) {
                    return Ok(self.checked(link));
                }
                state.count = state.count.saturating_sub(1);
                drop(state);
                // A slot freed: another waiter may open with it.
                self.freed.notify_one();
                drop(link);
                state = self.state.lock();
            }
            let remaining = left();
            if remaining.is_zero() {
                return Err(Failure::TimedOut(last));
            }
            if state.count < self.max {
                state.count += 1;
                drop(state);
                // The slot is given back however the open ends, a panic
                // in it included.
                let slot = Slot { pool: self };
                let opened = self.opener.open(remaining.min(connect));
                match opened {
                    Ok(link) => {
                        std::mem::forget(slot);
                        return Ok(self.checked(link));
                    }
                    Err(failed) => {
                        drop(slot);
                        match failed {
                            Open::Refused(detail) => return Err(Failure::Refused(detail)),
                            Open::Failed(err) => last = Some(err),
                        }
                    }
                }
                // Again after a pause, unless the wait is over by then.
                let remaining = left();
                if remaining <= pause {
                    return Err(Failure::TimedOut(last));
                }
                state = self.state.lock();
                let until = Instant::now() + pause;
                // Woken early by a returned connection: taken at once.
                self.freed.wait_until(&mut state, until);
                pause = pause.saturating_mul(2).min(RETRY_MAX);
                continue;
            }
            // A wait too long to count is bounded by `left()` on the next
            // pass all the same.
            let timed_out = match started.checked_add(wait) {
                Some(until) => self.freed.wait_until(&mut state, until).timed_out(),
                None => {
                    self.freed.wait(&mut state);
                    false
                }
            };
            if timed_out && state.idle.is_empty() {
                return Err(Failure::TimedOut(last));
            }
        }
    }

    /// Every idle connection, handed out together (each goes back when
    /// dropped): for a look at all of them at once.
    pub(crate) fn take_idle(self: &Arc<Self>) -> Vec<Checked<O>> {
        let idle = std::mem::take(&mut self.state.lock().idle);
        idle.into_iter().map(|link| self.checked(link)).collect()
    }

    fn checked(self: &Arc<Self>, link: O::Link) -> Checked<O> {
        Checked {
            link: ManuallyDrop::new(link),
            pool: self.clone(),
        }
    }

    fn release_slot(&self) {
        let mut state = self.state.lock();
        state.count = state.count.saturating_sub(1);
        drop(state);
        self.freed.notify_one();
    }

    fn put(&self, mut link: O::Link) {
        if self.opener.is_usable(&mut link) {
            self.state.lock().idle.push(link);
            self.freed.notify_one();
        } else {
            self.release_slot();
            // Outside the lock: a drop may read owed replies.
            drop(link);
        }
    }
}

/// A slot taken for a connection being opened: given back when dropped.
struct Slot<'a, O: Opener> {
    pool: &'a Pool<O>,
}

impl<O: Opener> Drop for Slot<'_, O> {
    fn drop(&mut self) {
        self.pool.release_slot();
    }
}

/// A connection handed out by a [`Pool`]; back to it when dropped.
pub(crate) struct Checked<O: Opener> {
    link: ManuallyDrop<O::Link>,
    pool: Arc<Pool<O>>,
}

impl<O: Opener> std::ops::Deref for Checked<O> {
    type Target = O::Link;

    fn deref(&self) -> &O::Link {
        &self.link
    }
}

impl<O: Opener> std::ops::DerefMut for Checked<O> {
    fn deref_mut(&mut self) -> &mut O::Link {
        &mut self.link
    }
}

impl<O: Opener> Drop for Checked<O> {
    fn drop(&mut self) {
        // SAFETY: taken once, here, and never touched again.
        let link = unsafe { ManuallyDrop::take(&mut self.link) };
        self.pool.put(link);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Opens numbered links, failing or stalling as told.
    #[derive(Default)]
    struct Fake {
        opened: AtomicUsize,
        /// Connects that fail before one succeeds.
        failures: AtomicUsize,
        stall: Option<Duration>,
        refuse: bool,
    }

    struct FakeLink {
        broken: bool,
    }

    impl Opener for Fake {
        type Link = FakeLink;

        fn open(&self, limit: Duration) -> Result<FakeLink, Open> {
            if self.refuse {
                return Err(Open::Refused("WRONGPASS".into()));
            }
            if let Some(stall) = self.stall {
                std::thread::sleep(stall.min(limit));
                return Err(Open::Failed(RedisError::from((
                    redis::ErrorKind::Io,
                    "stalled",
                ))));
            }
            if self
                .failures
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(Open::Failed(RedisError::from((
                    redis::ErrorKind::Io,
                    "refused",
                ))));
            }
            self.opened.fetch_add(1, Ordering::SeqCst);
            Ok(FakeLink { broken: false })
        }

        fn is_usable(&self, link: &mut FakeLink) -> bool {
            !link.broken
        }
    }

    #[test]
    fn reuses_returned_links_and_replaces_broken_ones() {
        let pool = Pool::new(Fake::default(), 2);
        let wait = Duration::from_secs(1);
        drop(pool.get(wait, wait).ok().expect("first"));
        drop(pool.get(wait, wait).ok().expect("again"));
        assert_eq!(pool.opener.opened.load(Ordering::SeqCst), 1);
        let mut link = pool.get(wait, wait).ok().expect("third");
        link.broken = true;
        drop(link);
        assert_eq!(pool.occupancy(), (0, 0));
        drop(pool.get(wait, wait).ok().expect("fresh"));
        assert_eq!(pool.opener.opened.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_full_pool_hands_a_returned_link_to_its_waiter() {
        let pool = Pool::new(Fake::default(), 1);
        let wait = Duration::from_secs(5);
        let held = pool.get(wait, wait).ok().expect("the only one");
        let waiter = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.get(wait, wait).is_ok())
        };
        std::thread::sleep(Duration::from_millis(20));
        drop(held);
        assert!(waiter.join().expect("waiter"));
        assert_eq!(pool.opener.opened.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_full_pool_times_out() {
        let pool = Pool::new(Fake::default(), 1);
        let _held = pool.get(Duration::from_secs(1), Duration::from_secs(1));
        let started = Instant::now();
        let wait = Duration::from_millis(50);
        assert!(matches!(pool.get(wait, wait), Err(Failure::TimedOut(None))));
        assert!(started.elapsed() >= wait);
    }

    #[test]
    fn failed_connects_are_tried_again_within_the_wait() {
        let fake = Fake::default();
        fake.failures.store(3, Ordering::SeqCst);
        let pool = Pool::new(fake, 1);
        let wait = Duration::from_secs(2);
        assert!(pool.get(wait, wait).is_ok());
        // Not within a wait shorter than the first pause.
        let fake = Fake::default();
        fake.failures.store(3, Ordering::SeqCst);
        let pool = Pool::new(fake, 1);
        let wait = Duration::from_millis(5);
        assert!(matches!(
            pool.get(wait, wait),
            Err(Failure::TimedOut(Some(_)))
        ));
        // The failed connects gave their slots back.
        assert_eq!(pool.occupancy(), (0, 0));
    }

    #[test]
    fn a_refusal_is_said_at_once() {
        let pool = Pool::new(
            Fake {
                refuse: true,
                ..Fake::default()
            },
            1,
        );
        let wait = Duration::from_secs(5);
        let started = Instant::now();
        assert!(matches!(pool.get(wait, wait), Err(Failure::Refused(_))));
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(pool.occupancy(), (0, 0));
    }

    #[test]
    fn a_stalled_connect_is_bounded_by_the_wait() {
        let pool = Pool::new(
            Fake {
                stall: Some(Duration::from_secs(30)),
                ..Fake::default()
            },
            4,
        );
        let started = Instant::now();
        let wait = Duration::from_millis(100);
        assert!(matches!(
            pool.get(wait, Duration::from_secs(30)),
            Err(Failure::TimedOut(Some(_)))
        ));
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(pool.occupancy(), (0, 0));
    }
}
