//! The one acquire loop: deadline handling, backoff, notify waiting and the
//! last attempt at the deadline, written once for every lock type.
//!
//! A lock type says how to make one attempt and how to take a lease handed
//! over by another thread ([`Contender`]); this loop decides when to make
//! them. It knows nothing of Redis: an attempt's reply is reduced to "won"
//! or "held, with this much time left".

use std::time::{Duration, Instant};

use crate::error::Error;
use crate::lease::{clamp, later};
use crate::wait::backoff::{Backoff, SystemClock, ThreadJitter, retry_until};
use crate::wait::pacing::HeadPacing;
use crate::wait::queue::{Feed, Queues, Turn, Waker, YIELD};

/// What one attempt found.
pub(crate) enum Attempt<W> {
    /// The lock is ours.
    Won(W),
    /// Another owner holds it, with this much lease left when Redis said so
    /// (`None`: not asked, or a key without expiry).
    Held(Option<Duration>),
}

/// One lock type, seen by the loop.
pub(crate) trait Contender {
    /// What a won attempt yields (a lease, a guard).
    type Won;
    /// What another thread of the same client can hand over.
    type Gift;

    /// One attempt. `quick`: the holder's remaining time is not needed (an
    /// uncontended first try, or spin mode), so the cheapest request will
    /// do.
    ///
    /// # Errors
    ///
    /// Whatever the attempt met; it ends the loop at once.
    fn attempt(&mut self, quick: bool) -> Result<Attempt<Self::Won>, Error>;

    /// Takes a lease another thread handed over: `Ok(None)` when it turned
    /// out lost (the waiter goes on waiting).
    ///
    /// # Errors
    ///
    /// As [`Contender::attempt`].
    fn accept(&mut self, gift: Self::Gift) -> Result<Option<Self::Won>, Error>;
}

/// How long a caller is willing to wait, as the public methods say it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Within {
    /// One attempt (`try_lock`).
    Once,
    /// Up to this long from now (`try_lock_for`, and `lock` with the
    /// options' wait).
    For(Duration),
    /// Up to this moment, at least one attempt (`try_lock_until`).
    Until(Instant),
}

impl Within {
    /// The deadline; `None` for a wait so long that `Instant` cannot express
    /// its end (a caller's `Duration::MAX`), taken as no limit.
    pub(crate) fn deadline(self) -> Option<Instant> {
        match self {
            Within::Once => Some(Instant::now()),
            Within::For(wait) => Instant::now().checked_add(wait),
            Within::Until(deadline) => Some(deadline),
        }
    }
}

/// `lock()`: waits up to `wait`, and turns "still held" into
/// [`Error::Timeout`], naming the holder `acquire` last saw (a redacted
/// token), if any.
///
/// # Errors
///
/// [`Error::Timeout`], or what `acquire` returned.
pub(crate) fn blocking<T>(
    key: &str,
    wait: Duration,
    acquire: impl FnOnce(Within, &mut Option<String>) -> Result<Option<T>, Error>,
) -> Result<T, Error> {
    let started = Instant::now();
    let mut holder = None;
    acquire(Within::For(wait), &mut holder)?.ok_or_else(|| Error::Timeout {
        key: key.to_owned(),
        waited: started.elapsed(),
        holder,
    })
}

/// Notify waiting: the threads of one client line up in a local queue, the
/// head subscribes to the key's release messages before each attempt and
/// sleeps until one (or a handoff, the holder's expiry, a backoff step).
pub(crate) struct Queued<'a, G: Send + 'static> {
    pub(crate) queues: &'a Queues<G>,
    /// The queue's name: the key, or the key and a lock kind.
    pub(crate) key: &'a str,
    /// Whether this waiter may be handed a lease.
    pub(crate) takes_handoffs: bool,
    /// Make the first attempt even while other threads of this client wait
    /// or hold: a lock that can be shared (readers) must not make a
    /// newcomer queue behind holders it could join.
    pub(crate) barge: bool,
    /// Take a lease just handed to a waiter that has not taken it yet,
    /// within [`INTERCEPT_WINDOW`](crate::wait::queue::INTERCEPT_WINDOW)
    /// ([`Queues::intercept`]): for an exclusive lock whose waiters take
    /// handoffs.
    pub(crate) intercepts: bool,
    /// Releases a lease handed to this waiter after it gave up, with nobody
    /// left to take it.
    pub(crate) on_orphan: &'a dyn Fn(G),
    /// Subscribes to the key's release messages, waking the queue with the
    /// given waker; `None` when the client has no subscriber.
    pub(crate) subscribe: &'a dyn Fn(Waker) -> Option<Box<dyn Feed>>,
}

/// How a waiter waits between attempts.
pub(crate) enum Waiting<'a, G: Send + 'static> {
    /// Backoff with full jitter, every waiter on its own.
    Spin,
    /// In the client's local queue, woken by release messages.
    Queued(Queued<'a, G>),
}

/// Attempts until one wins or `deadline` passes (`None`: no limit): one
/// last attempt at the deadline, never a sleep past it, at least one
/// attempt. `Ok(None)` when the lock stayed held.
///
/// # Errors
///
/// The first error an attempt returns, at once.
pub(crate) fn acquire<C: Contender>(
    contender: &mut C,
    deadline: Option<Instant>,
    backoff: Backoff,
    waiting: Waiting<'_, C::Gift>,
) -> Result<Option<C::Won>, Error>
where
    C::Gift: Send + 'static,
{
    match waiting {
        Waiting::Spin => retry_until(&SystemClock, &mut ThreadJitter, backoff, deadline, || {
            Ok(match contender.attempt(true)? {
                Attempt::Won(won) => Some(won),
                Attempt::Held(_) => None,
            })
        }),
        Waiting::Queued(queued) => acquire_queued(contender, deadline, backoff, &queued),
    }
}

fn passed(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

/// [`Waiting::Queued`]: one quick attempt at once when no thread of this
/// client waits for the key or holds it (or always, for a lock that
/// `barge`s); otherwise, or when held, queue up.
fn acquire_queued<C: Contender>(
    contender: &mut C,
    deadline: Option<Instant>,
    backoff: Backoff,
    queued: &Queued<'_, C::Gift>,
) -> Result<Option<C::Won>, Error>
where
    C::Gift: Send + 'static,
{
    let queues = queued.queues;
    let key = queued.key;
    // Looked up once: the uncontended path pays for one lookup, not two.
    let waiters = queues.has_waiters(key);
    // Leases are only handed to waiters: without one, none to intercept.
    if queued.intercepts
        && waiters
        && let Some(gift) = queues.intercept(key)
        && let Some(won) = contender.accept(gift)?
    {
        return Ok(Some(won));
    }
    if queued.barge || (!waiters && queues.held_until(key).is_none()) {
        // The quick attempt: Redis does less for it, and an uncontended
        // lock needs no remaining time.
        if let Attempt::Won(won) = contender.attempt(true)? {
            return Ok(Some(won));
        }
        if passed(deadline) {
            return Ok(None);
        }
    }
    let waiter = queues.enqueue(key, queued.takes_handoffs, queued.on_orphan);
    let mut pacing = HeadPacing::new(backoff);
    loop {
        match waiter.wait_turn(deadline) {
            Turn::TimedOut => return Ok(None),
            Turn::Gift(gift) => {
                if let Some(won) = contender.accept(gift)? {
                    return Ok(Some(won));
                }
                continue;
            }
            Turn::Head => {}
        }
        // A thread of this client holds the lock: wait for its handoff or
        // release rather than ask Redis.
        let seen = waiter.wakeups();
        if let Some(held_until) = queues.held_until(key) {
            // A semaphore's permits all held here by this client's count:
            // still ask Redis now and then, at the backoff's slowest pace,
            // for a limit changed elsewhere (no message announces it).
            // Its count is only this client's view, so the last attempt at
            // the deadline goes to Redis too.
            let limited = queues.has_limit(key);
            let poll = limited.then(|| later(Instant::now(), backoff.max()));
            let until = poll.map_or(held_until, |poll| poll.min(held_until));
            if let Some(gift) = waiter.wait_release(seen, clamp(until, deadline))
                && let Some(won) = contender.accept(gift)?
            {
                return Ok(Some(won));
            }
            if passed(deadline) {
                if !limited {
                    return Ok(None);
                }
            } else if poll.is_none_or(|poll| Instant::now() < poll) {
                continue;
            }
        }
        // This client just released and other clients' waiters were told:
        // let them have this turn.
        if waiter.take_yield() {
            let until = clamp(Instant::now() + YIELD, deadline);
            if let Some(gift) = waiter.stand_back(until)
                && let Some(won) = contender.accept(gift)?
            {
                return Ok(Some(won));
            }
        }
        let seen = pacing.before_attempt(&waiter, || (queued.subscribe)(waiter.waker()), deadline);
        let left = match contender.attempt(false)? {
            Attempt::Won(won) => return Ok(Some(won)),
            Attempt::Held(left) => left,
        };
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            return Ok(None);
        }
        let until = clamp(later(now, pacing.pause(left)), deadline);
        if let Some(gift) = waiter.wait_release(seen, until)
            && let Some(won) = contender.accept(gift)?
        {
            return Ok(Some(won));
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::{Arc, Barrier};

    /// A lock held for a number of attempts, then free.
    struct Scripted {
        held_for: u32,
        attempts: u32,
        quick: u32,
    }

    impl Contender for Scripted {
        type Won = u32;
        type Gift = u32;
        fn attempt(&mut self, quick: bool) -> Result<Attempt<u32>, Error> {
            self.attempts += 1;
            self.quick += u32::from(quick);
            Ok(if self.attempts > self.held_for {
                Attempt::Won(self.attempts)
            } else {
                Attempt::Held(Some(Duration::from_millis(1)))
            })
        }
        fn accept(&mut self, gift: u32) -> Result<Option<u32>, Error> {
            Ok(Some(gift + 1000))
        }
    }

    fn scripted(held_for: u32) -> Scripted {
        Scripted {
            held_for,
            attempts: 0,
            quick: 0,
        }
    }

    fn no_feed(_: Waker) -> Option<Box<dyn Feed>> {
        None
    }

    #[test]
    fn within_makes_deadlines_without_overflow() {
        assert!(Within::Once.deadline().is_some());
        assert!(Within::For(Duration::MAX).deadline().is_none(), "no limit");
        let at = Instant::now();
        assert_eq!(Within::Until(at).deadline(), Some(at));
    }

    #[test]
    fn blocking_turns_still_held_into_a_timeout() {
        let got: Result<u32, Error> = blocking("k", Duration::ZERO, |_, _| Ok(None));
        assert!(matches!(got, Err(Error::Timeout { key, .. }) if key == "k"));
        let got: Result<u32, Error> = blocking("k", Duration::ZERO, |_, _| Ok(Some(7)));
        assert_eq!(got.ok(), Some(7));
    }

    #[test]
    fn spin_makes_one_quick_attempt_for_a_past_deadline() {
        let mut c = scripted(u32::MAX);
        let got = acquire(
            &mut c,
            Some(Instant::now()),
            Backoff::default(),
            Waiting::Spin,
        );
        assert!(matches!(got, Ok(None)));
        assert_eq!((c.attempts, c.quick), (1, 1));
    }

    #[test]
    fn queued_tries_quickly_first_then_as_head_with_the_time_left() {
        let queues = Queues::<u32>::default();
        let ignore = |_: u32| {};
        let mut c = scripted(2);
        let deadline = Instant::now().checked_add(Duration::from_secs(5));
        let got = acquire(
            &mut c,
            deadline,
            Backoff::constant(Duration::from_millis(1)),
            Waiting::Queued(Queued {
                queues: &queues,
                key: "k",
                takes_handoffs: true,
                barge: false,
                intercepts: false,
                on_orphan: &ignore,
                subscribe: &no_feed,
            }),
        );
        assert_eq!(got.ok().flatten(), Some(3));
        assert_eq!(c.quick, 1, "only the first attempt is the quick one");
        assert!(!queues.has_waiters("k"), "the waiter left its queue");
    }

    #[test]
    fn a_queued_waiter_takes_a_handoff_without_an_attempt() {
        let queues = Arc::new(Queues::<u32>::default());
        // A thread of this client holds the key: no quick attempt, and the
        // head waits for the handoff instead of asking Redis.
        queues.hold(
            "k",
            &Arc::from("t"),
            Instant::now() + Duration::from_secs(5),
            crate::wait::queue::Capacity::One,
        );
        let barrier = Arc::new(Barrier::new(2));
        let giver = {
            let (queues, barrier) = (queues.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let until = Instant::now() + Duration::from_secs(5);
                while Instant::now() < until {
                    if queues.offer("k", 7, false).is_ok() {
                        return true;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                false
            })
        };
        let ignore = |_: u32| {};
        let mut c = scripted(u32::MAX);
        barrier.wait();
        let got = acquire(
            &mut c,
            Instant::now().checked_add(Duration::from_secs(5)),
            Backoff::default(),
            Waiting::Queued(Queued {
                queues: &queues,
                key: "k",
                takes_handoffs: true,
                barge: false,
                intercepts: false,
                on_orphan: &ignore,
                subscribe: &no_feed,
            }),
        );
        assert_eq!(got.ok().flatten(), Some(1007));
        assert_eq!(c.attempts, 0, "no attempt while the holder is local");
        assert!(giver.join().unwrap_or(false));
    }
}
