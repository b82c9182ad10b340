//! Local wait queues: threads of one `LockClient` waiting for the same key
//! line up in FIFO order, only the head talks to Redis, and a releasing
//! holder can hand its lease straight to the head.
//!
//! Generic over what is handed over (`G`, a gift): the queue moves it from
//! the releasing thread to the head and never looks inside. It knows nothing
//! of Redis or of the subscriber either: a subscription is kept as a
//! [`Feed`], and the subscriber wakes a queue through [`Waiter::waker`].

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::wait::sync::{Condvar, Mutex, now};

/// A subscription to the release messages of a key, kept by its queue
/// while anyone waits (the subscriber's handle, seen from here).
pub(crate) trait Feed: Send + Sync {
    /// Whether release messages are being delivered now.
    fn is_live(&self) -> bool;
    /// Waits until live, at most until `until`.
    fn wait_live(&self, until: Instant) -> bool;
}

/// Wakes a queue's head: what the subscriber calls on a release message or
/// a lost connection.
pub(crate) type Waker = Arc<dyn Fn() + Send + Sync>;

struct QueueState<G> {
    next_ticket: u64,
    /// FIFO; each waiter sleeps on its own condition variable, so an event
    /// wakes the one thread it concerns, not the whole queue.
    waiters: VecDeque<Slot<G>>,
    /// Bumped whenever the lock may have become free (a release message, a
    /// release in Redis by this client, a lost subscriber connection).
    wakeups: u64,
    /// Keeps the key's release channel subscribed while anyone waits. In an
    /// `Arc` so it can be asked about without holding the queue's lock.
    subscription: Option<Arc<dyn Feed>>,
    /// Waiters of other clients were told of this client's last release:
    /// the head lets them try first.
    yield_turn: bool,
}

impl<G> Default for QueueState<G> {
    fn default() -> Self {
        QueueState {
            next_ticket: 0,
            waiters: VecDeque::new(),
            wakeups: 0,
            subscription: None,
            yield_turn: false,
        }
    }
}

/// How long a head stands back after its own client's release reached
/// waiters of other clients, unless handed a lease sooner.
pub(crate) const YIELD: Duration = Duration::from_millis(5);

/// The longest a queued waiter sleeps without looking at the queue again.
const RECHECK: Duration = Duration::from_millis(50);

/// How long after a waiter was first handed a lease a newcomer may still
/// intercept one ([`Queues::intercept`]): eventual fairness, as in
/// parking_lot. Within it, a thread that releases and locks again goes on
/// without waiting for the woken thread to be scheduled; past it, the
/// lease stays with the waiter: interceptions happen only in this window,
/// and the waiter then waits at most for the hold under way.
pub(crate) const INTERCEPT_WINDOW: Duration = Duration::from_micros(100);

struct Slot<G> {
    ticket: u64,
    wake: Arc<Condvar>,
    /// Whether this waiter may be handed a lease: not when it needs what a
    /// handed-over lease cannot give (its own fencing token, a `WAIT` for
    /// replicas).
    takes_handoffs: bool,
    /// A lease handed to this waiter and not yet taken. Each waiter has its
    /// own, so a semaphore's permits released close together reach as many
    /// waiters (a lock has at most one lease to give).
    gift: Option<G>,
    /// This waiter took a gift and is about to leave: offer it no other.
    served: bool,
    /// When this waiter was first handed a lease since it last took one
    /// ([`INTERCEPT_WINDOW`]); `None` once it takes one.
    offered_since: Option<Instant>,
    /// Whether a newcomer may intercept the gift (its giver said so).
    interceptable: bool,
}

impl<G> QueueState<G> {
    fn head(&self) -> Option<u64> {
        self.waiters.front().map(|slot| slot.ticket)
    }

    /// The waiter that would be handed the next lease: the first in line
    /// without one, if it takes handoffs. Never one behind a waiter that
    /// refuses them, so nobody overtakes a waiter that has to ask Redis.
    fn next_receiver(&mut self) -> Option<&mut Slot<G>> {
        self.waiters
            .iter_mut()
            .find(|slot| slot.gift.is_none() && !slot.served)
            .filter(|slot| slot.takes_handoffs)
    }

    fn notify_head(&self) {
        if let Some(slot) = self.waiters.front() {
            slot.wake.notify_one();
        }
    }
}

/// The waiters of one key in one client.
pub(crate) struct KeyQueue<G> {
    state: Mutex<QueueState<G>>,
}

impl<G> KeyQueue<G> {
    /// The lock may be free: wake the head.
    pub(crate) fn wake(&self) {
        let mut state = self.state.lock();
        state.wakeups = state.wakeups.wrapping_add(1);
        state.notify_head();
    }
}

/// All queues of one client, by key, and which keys its threads hold.
pub(crate) struct Queues<G> {
    by_key: Mutex<HashMap<String, Arc<KeyQueue<G>>>>,
    /// Keys threads of this client hold, with the local end of each lease:
    /// while they fill the key's capacity, queued threads wait for a
    /// handoff or a release instead of asking Redis for what their own
    /// process holds. Also free keys' entries, kept empty for their next
    /// hold (`unhold`).
    held: Mutex<HashMap<String, Holds>>,
    /// Entries of `held` nobody holds (kept for the key's next hold), as
    /// counted under `held`'s lock.
    free: AtomicUsize,
}

/// How many holders a key admits at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Capacity {
    /// One: a lock.
    One,
    /// A semaphore's limit, as this client knows it: another client may
    /// change it in Redis.
    Limit(u32),
}

impl Capacity {
    fn holders(self) -> usize {
        match self {
            Capacity::One => 1,
            Capacity::Limit(n) => usize::try_from(n.max(1)).unwrap_or(usize::MAX),
        }
    }
}

/// How many keys may keep an entry in [`Queues::hold`]'s table with no
/// lease held before all such entries are dropped.
const KEPT_EMPTY: usize = 256;

/// The leases of one key held by threads of one client.
struct Holds {
    capacity: Capacity,
    /// Token and local end of each lease (the token shared with the lease).
    by: Vec<(Arc<str>, Instant)>,
}

impl<G> Default for Queues<G> {
    fn default() -> Self {
        Queues {
            by_key: Mutex::default(),
            held: Mutex::default(),
            free: AtomicUsize::new(0),
        }
    }
}

/// What a waiter found when it looked at the queue.
pub(crate) enum Turn<G> {
    /// A releasing holder handed this waiter its lease.
    Gift(G),
    /// This waiter is at the front: its turn to ask Redis.
    Head,
    /// The deadline passed first.
    TimedOut,
}

impl<G: Send + 'static> Queues<G> {
    /// A thread of this client holds `key` under `token` until `until`
    /// (local clock); the key admits `capacity` holders at once.
    pub(crate) fn hold(&self, key: &str, token: &Arc<str>, until: Instant, capacity: Capacity) {
        let now = now();
        let mut held = self.held.lock();
        // Looked up before an entry is made: the key is copied only for a
        // key nobody of this client held.
        let holds = match held.get_mut(key) {
            Some(holds) => {
                if holds.by.is_empty() {
                    self.free.fetch_sub(1, Ordering::Relaxed);
                }
                holds
            }
            None => held.entry(key.to_owned()).or_insert_with(|| Holds {
                capacity,
                by: Vec::with_capacity(1),
            }),
        };
        holds.capacity = capacity;
        // Leases that ran out by the local clock go here, so the list stays
        // as long as the holders there are.
        holds
            .by
            .retain(|(held_by, end)| *end > now || held_by == token);
        match holds.by.iter_mut().find(|(held_by, _)| held_by == token) {
            Some(entry) => entry.1 = until,
            None => holds.by.push((token.clone(), until)),
        }
    }

    /// The hold of `key` under `token` is over (other holds of the key, under
    /// other tokens, stay).
    pub(crate) fn unhold(&self, key: &str, token: &str) {
        let mut held = self.held.lock();
        let Some(holds) = held.get_mut(key) else {
            return;
        };
        if holds.by.is_empty() {
            return;
        }
        holds.by.retain(|(held_by, _)| &**held_by != token);
        if !holds.by.is_empty() {
            return;
        }
        // An entry nobody holds is kept: the key's next hold (the common
        // case, one key locked again and again) then copies no key and
        // grows no list. An empty entry answers as an absent one (see
        // `held_until`, `has_limit`, `exclusive`). When more than
        // `KEPT_EMPTY` are kept, all are dropped at once: one step per entry
        // of the table (held ones too) under its lock, paid once per
        // `KEPT_EMPTY` releases of free keys.
        if self.free.fetch_add(1, Ordering::Relaxed) + 1 > KEPT_EMPTY {
            held.retain(|_, holds| !holds.by.is_empty());
            self.free.store(0, Ordering::Relaxed);
        }
    }

    /// While threads of this client fill `key`'s capacity now: until when
    /// (the first of their leases to end by the local clock).
    pub(crate) fn held_until(&self, key: &str) -> Option<Instant> {
        let now = now();
        let held = self.held.lock();
        let holds = held.get(key)?;
        let mut live = holds.by.iter().filter(|(_, end)| *end > now);
        let first = live.clone().map(|(_, end)| *end).min()?;
        (live.by_ref().count() >= holds.capacity.holders()).then_some(first)
    }

    /// Whether `key` is a semaphore's: its holds by this client's count say
    /// nothing of a limit changed elsewhere.
    pub(crate) fn has_limit(&self, key: &str) -> bool {
        self.held.lock().get(key).is_some_and(|holds| {
            !holds.by.is_empty() && matches!(holds.capacity, Capacity::Limit(_))
        })
    }

    /// Whether any thread of this client waits for `key`.
    pub(crate) fn has_waiters(&self, key: &str) -> bool {
        self.by_key.lock().contains_key(key)
    }

    /// Joins the back of `key`'s queue. A lease handed to this waiter that
    /// nobody can take when it leaves goes to `on_orphan`, to be released in
    /// Redis. A waiter that does not `take_handoffs` is never offered one.
    pub(crate) fn enqueue<'a>(
        &'a self,
        key: &str,
        takes_handoffs: bool,
        on_orphan: &'a dyn Fn(G),
    ) -> Waiter<'a, G> {
        let mut by_key = self.by_key.lock();
        let queue = by_key
            .entry(key.to_owned())
            .or_insert_with(|| {
                Arc::new(KeyQueue {
                    state: Mutex::new(QueueState::default()),
                })
            })
            .clone();
        let wake = Arc::new(Condvar::new());
        let ticket = {
            let mut state = queue.state.lock();
            let ticket = state.next_ticket;
            state.next_ticket += 1;
            state.waiters.push_back(Slot {
                ticket,
                wake: wake.clone(),
                takes_handoffs,
                gift: None,
                served: false,
                offered_since: None,
                interceptable: false,
            });
            ticket
        };
        Waiter {
            queues: self,
            key: key.to_owned(),
            queue,
            ticket,
            wake,
            on_orphan,
        }
    }

    /// Hands `lease` to the first waiter in `key`'s queue that has not been
    /// handed one yet, if it takes handoffs. Gives the lease back otherwise
    /// (nobody waits, everyone waiting has one, or the next in line must ask
    /// Redis itself). An `interceptable` lease may go to a newcomer instead
    /// ([`Queues::intercept`]).
    pub(crate) fn offer(&self, key: &str, lease: G, interceptable: bool) -> Result<(), G> {
        let queue = match self.by_key.lock().get(key) {
            Some(queue) => queue.clone(),
            None => return Err(lease),
        };
        // A lock has one lease: a second gift while one is pending would
        // make two holders here (a lease lost in Redis and taken again while
        // still valid by the local clock); it is released in Redis instead.
        let exclusive = self
            .held
            .lock()
            .get(key)
            .filter(|holds| !holds.by.is_empty())
            .is_none_or(|holds| holds.capacity == Capacity::One);
        let mut state = queue.state.lock();
        if exclusive && state.waiters.iter().any(|slot| slot.gift.is_some()) {
            return Err(lease);
        }
        match state.next_receiver() {
            Some(slot) => {
                slot.gift = Some(lease);
                slot.interceptable = interceptable;
                slot.offered_since.get_or_insert_with(now);
                slot.wake.notify_one();
                Ok(())
            }
            None => Err(lease),
        }
    }

    /// A newcomer to an exclusive `key` takes the lease handed to a waiter
    /// that has not taken it yet, if its giver made it interceptable and
    /// that waiter was first handed one less than [`INTERCEPT_WINDOW`] ago.
    /// A thread that releases and locks again then goes on at once instead
    /// of sleeping until the woken waiter is scheduled (a context switch
    /// per acquisition); the waiter, woken for nothing, waits for the next
    /// handoff, and once the window has passed no newcomer takes its lease.
    pub(crate) fn intercept(&self, key: &str) -> Option<G> {
        let queue = self.by_key.lock().get(key)?.clone();
        // A semaphore's permits each go to their own waiter. (Only locks'
        // queues intercept today; this keeps it true for any other.)
        let exclusive = self
            .held
            .lock()
            .get(key)
            .filter(|holds| !holds.by.is_empty())
            .is_none_or(|holds| holds.capacity == Capacity::One);
        if !exclusive {
            return None;
        }
        let mut state = queue.state.lock();
        let slot = state.waiters.iter_mut().find(|slot| slot.gift.is_some())?;
        let late = slot
            .offered_since
            .is_some_and(|since| now().saturating_duration_since(since) >= INTERCEPT_WINDOW);
        if late || !slot.interceptable {
            return None;
        }
        slot.gift.take()
    }

    /// This client released `key` in Redis (or tried to), and the release
    /// message reached `receivers` subscribers (`None`: no message was sent,
    /// or it is not known).
    ///
    /// When some of them are other clients' (other processes'), this
    /// client's head lets them have the next turn: it skips its next attempt
    /// for up to [`YIELD`], unless woken sooner. Otherwise the head is woken
    /// here if no message will reach it (none was sent, or no live
    /// subscription); with one, it learns from the message.
    pub(crate) fn released(&self, key: &str, receivers: Option<u64>) {
        let queue = self.by_key.lock().get(key).cloned();
        let Some(queue) = queue else {
            return;
        };
        // Asked without the queue's lock (the subscriber may be writing).
        let subscription = queue.state.lock().subscription.clone();
        let live = subscription.is_some_and(|s| s.is_live());
        let mut state = queue.state.lock();
        if receivers.is_some_and(|n| n.saturating_sub(u64::from(live)) > 0) {
            state.yield_turn = true;
        }
        if !live || receivers.is_none() {
            state.wakeups = state.wakeups.wrapping_add(1);
            state.notify_head();
        }
    }
}

/// A thread's place in a key's queue. Dropping it leaves the queue: a gift
/// meant for it goes on to the next waiter, or, with nobody left, to
/// `on_orphan`.
pub(crate) struct Waiter<'a, G: Send + 'static> {
    queues: &'a Queues<G>,
    key: String,
    queue: Arc<KeyQueue<G>>,
    ticket: u64,
    wake: Arc<Condvar>,
    on_orphan: &'a dyn Fn(G),
}

impl<G: Send + 'static> Waiter<'_, G> {
    /// What wakes this queue's head; it does not keep the queue alive.
    pub(crate) fn waker(&self) -> Waker {
        let queue = Arc::downgrade(&self.queue);
        Arc::new(move || {
            if let Some(queue) = queue.upgrade() {
                queue.wake();
            }
        })
    }

    /// Waits until this waiter is given a lease, reaches the front, or
    /// `deadline` passes (`None`: no deadline).
    pub(crate) fn wait_turn(&self, deadline: Option<Instant>) -> Turn<G> {
        let mut state = self.queue.state.lock();
        still_waiting(&mut state, self.ticket);
        loop {
            if let Some(lease) = take_gift(&mut state, self.ticket) {
                return Turn::Gift(lease);
            }
            if state.head() == Some(self.ticket) {
                return Turn::Head;
            }
            let now = now();
            if deadline.is_some_and(|d| now >= d) {
                return Turn::TimedOut;
            }
            // A waiter that becomes head while its client holds the lock is
            // not woken (the handoff or release will be); the bounded sleep
            // covers a holder that vanishes without either.
            let until = now + RECHECK;
            self.wake
                .wait_until(&mut state, deadline.map_or(until, |d| d.min(until)));
        }
    }

    /// Whether the head should let other clients' waiters have this turn
    /// (clears the flag).
    pub(crate) fn take_yield(&self) -> bool {
        std::mem::take(&mut self.queue.state.lock().yield_turn)
    }

    /// As the head standing back for other clients' waiters ([`YIELD`]):
    /// waits until a lease is handed over or `until`, whatever else wakes
    /// the queue meanwhile. The release that reached those waiters reaches
    /// this client's subscriber too, and its message, arriving during the
    /// yield, would otherwise end it at once: the head then raced the
    /// waiters it meant to let in, and took the lock for another run of
    /// handoffs as often as not.
    pub(crate) fn stand_back(&self, until: Instant) -> Option<G> {
        let mut state = self.queue.state.lock();
        still_waiting(&mut state, self.ticket);
        // Bounded by `until`: a wake-up without a gift waits again for
        // what is left of it.
        loop {
            if let Some(lease) = take_gift(&mut state, self.ticket) {
                return Some(lease);
            }
            if self.wake.wait_until(&mut state, until).timed_out() {
                return take_gift(&mut state, self.ticket);
            }
        }
    }

    /// The wake-up count now; pass it to [`Waiter::wait_release`] after an
    /// attempt so a release during the attempt is not missed.
    pub(crate) fn wakeups(&self) -> u64 {
        self.queue.state.lock().wakeups
    }

    /// As the head, after a failed attempt: waits until the lock may be free
    /// (a wake-up since `seen`), a lease is handed over, or `until`.
    pub(crate) fn wait_release(&self, seen: u64, until: Instant) -> Option<G> {
        let mut state = self.queue.state.lock();
        still_waiting(&mut state, self.ticket);
        loop {
            if let Some(lease) = take_gift(&mut state, self.ticket) {
                return Some(lease);
            }
            if state.wakeups != seen || self.wake.wait_until(&mut state, until).timed_out() {
                return take_gift(&mut state, self.ticket);
            }
        }
    }

    /// Gives the queue a subscription to keep while anyone waits, unless it
    /// has one; returns whether it is live. The subscriber is asked without
    /// the queue's lock held (it may be writing to its socket).
    pub(crate) fn keep_subscribed(
        &self,
        subscribe: impl FnOnce() -> Option<Box<dyn Feed>>,
    ) -> bool {
        let kept = self.queue.state.lock().subscription.clone();
        if let Some(subscription) = kept {
            return subscription.is_live();
        }
        let Some(subscription) = subscribe() else {
            return false;
        };
        let live = subscription.is_live();
        let mut state = self.queue.state.lock();
        if state.subscription.is_none() {
            state.subscription = Some(Arc::from(subscription));
        }
        live
    }

    /// The queue's subscription, waited on until live or `until`.
    pub(crate) fn wait_subscribed(&self, until: Instant) -> bool {
        let kept = self.queue.state.lock().subscription.clone();
        kept.is_some_and(|subscription| subscription.wait_live(until))
    }

    fn leave_inner(&mut self) -> Option<G> {
        let mut by_key = self.queues.by_key.lock();
        let mut state = self.queue.state.lock();
        let was_head = state.head() == Some(self.ticket);
        let mut left = None;
        if let Some(at) = state.waiters.iter().position(|s| s.ticket == self.ticket) {
            left = state.waiters.remove(at).and_then(|slot| slot.gift);
        }
        let mut orphan = None;
        // The new head needs waking when it inherits a gift, or when nobody
        // of this client holds the lock (its turn to ask Redis); while one
        // does, the coming handoff or release wakes it.
        if was_head && self.queues.held_until(&self.key).is_none() {
            state.notify_head();
        }
        if let Some(lease) = left {
            // The gift goes on to the next waiter without one only if it
            // takes handoffs; otherwise it is released in Redis, and the
            // release wakes that waiter.
            match state.next_receiver() {
                Some(slot) => {
                    slot.gift = Some(lease);
                    // Its giver's say is not known here: kept for the waiter.
                    slot.interceptable = false;
                    slot.offered_since.get_or_insert_with(now);
                    slot.wake.notify_one();
                }
                None => orphan = Some(lease),
            }
        }
        let subscription = if state.waiters.is_empty() {
            if by_key
                .get(&self.key)
                .is_some_and(|q| Arc::ptr_eq(q, &self.queue))
            {
                by_key.remove(&self.key);
            }
            state.subscription.take()
        } else {
            None
        };
        drop(state);
        drop(by_key);
        drop(subscription); // UNSUBSCRIBE, outside the locks
        orphan
    }
}

impl<G: Send + 'static> Drop for Waiter<'_, G> {
    fn drop(&mut self) {
        if let Some(orphan) = self.leave_inner() {
            (self.on_orphan)(orphan);
        }
    }
}

/// A waiter that took a gift waits again (the lease was found lost on the
/// way): it may be offered another.
fn still_waiting<G>(state: &mut QueueState<G>, ticket: u64) {
    if let Some(slot) = state.waiters.iter_mut().find(|slot| slot.ticket == ticket) {
        slot.served = false;
    }
}

fn take_gift<G>(state: &mut QueueState<G>, ticket: u64) -> Option<G> {
    state
        .waiters
        .iter_mut()
        .find(|slot| slot.ticket == ticket)
        .and_then(|slot| {
            let gift = slot.gift.take();
            if gift.is_some() {
                slot.served = true;
                slot.offered_since = None;
            }
            gift
        })
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// The queue never looks inside a gift: a token will do.
    struct Handoff {
        token: String,
    }

    fn lease(token: &str) -> Handoff {
        Handoff {
            token: token.into(),
        }
    }

    fn now() -> Option<Instant> {
        Some(Instant::now())
    }

    /// `token` holds "k" for the next 5 s.
    fn hold_a_while(queues: &Queues<Handoff>, token: &str, capacity: Capacity) {
        queues.hold(
            "k",
            &Arc::from(token),
            Instant::now() + Duration::from_secs(5),
            capacity,
        );
    }

    #[test]
    fn only_the_first_in_line_is_head() {
        let queues = Queues::<Handoff>::default();
        let ignore = |_: Handoff| {};
        assert!(!queues.has_waiters("k"));
        let first = queues.enqueue("k", true, &ignore);
        let second = queues.enqueue("k", true, &ignore);
        assert!(queues.has_waiters("k"));
        assert!(matches!(first.wait_turn(now()), Turn::Head));
        assert!(matches!(second.wait_turn(now()), Turn::TimedOut));
        drop(first);
        assert!(matches!(second.wait_turn(now()), Turn::Head));
        drop(second);
        assert!(!queues.has_waiters("k"), "an empty queue is removed");
    }

    #[test]
    fn a_handoff_goes_to_the_head_and_on_when_it_leaves() {
        let queues = Queues::<Handoff>::default();
        let ignore = |_: Handoff| {};
        assert!(
            queues.offer("k", lease("t"), false).is_err(),
            "nobody waits"
        );
        let first = queues.enqueue("k", true, &ignore);
        let second = queues.enqueue("k", true, &ignore);
        assert!(
            queues.offer("k", lease("t1"), false).is_ok(),
            "the head takes it"
        );
        drop(first); // leaves without taking it
        match second.wait_turn(now()) {
            Turn::Gift(handoff) => assert_eq!(handoff.token, "t1"),
            _ => panic!("the next waiter inherits the gift"),
        }
    }

    #[test]
    fn leases_released_together_reach_as_many_waiters_in_order() {
        let queues = Queues::<Handoff>::default();
        // A semaphore's permits, all held by this client.
        let soon = Instant::now() + Duration::from_secs(5);
        for held in ["a", "b", "c"] {
            queues.hold("k", &Arc::from(held), soon, Capacity::Limit(3));
        }
        let orphans = RefCell::new(Vec::new());
        let collect = |h: Handoff| orphans.borrow_mut().push(h.token);
        let first = queues.enqueue("k", true, &collect);
        let second = queues.enqueue("k", true, &collect);
        assert!(queues.offer("k", lease("t1"), false).is_ok());
        assert!(
            queues.offer("k", lease("t2"), false).is_ok(),
            "the next in line"
        );
        assert!(
            queues.offer("k", lease("t3"), false).is_err(),
            "everyone waiting has one"
        );
        match first.wait_turn(now()) {
            Turn::Gift(handoff) => assert_eq!(handoff.token, "t1"),
            _ => panic!("the head's gift"),
        }
        assert!(
            queues.offer("k", lease("t3"), false).is_err(),
            "a waiter that took its gift is offered no other"
        );
        drop(first);
        drop(second); // leaves without taking t2: nobody is left
        assert_eq!(*orphans.borrow(), vec!["t2".to_string()]);
        assert!(!queues.has_waiters("k"));
    }

    #[test]
    fn a_waiter_whose_gift_was_lost_on_the_way_can_be_offered_another() {
        let queues = Queues::<Handoff>::default();
        let ignore = |_: Handoff| {};
        hold_a_while(&queues, "a", Capacity::Limit(3));
        let first = queues.enqueue("k", true, &ignore);
        let second = queues.enqueue("k", true, &ignore);
        assert!(queues.offer("k", lease("lost"), false).is_ok());
        assert!(matches!(first.wait_turn(now()), Turn::Gift(_)));
        // Found lost: the first waiter waits on, and is still first in line.
        assert!(
            first
                .wait_release(first.wakeups(), Instant::now())
                .is_none()
        );
        assert!(queues.offer("k", lease("next"), false).is_ok());
        match first.wait_turn(now()) {
            Turn::Gift(handoff) => assert_eq!(handoff.token, "next"),
            _ => panic!("the first in line gets the next one"),
        }
        drop(second);
    }

    #[test]
    fn a_lock_never_has_two_gifts_pending() {
        let queues = Queues::<Handoff>::default();
        let ignore = |_: Handoff| {};
        hold_a_while(&queues, "t", Capacity::One);
        let first = queues.enqueue("k", true, &ignore);
        let _second = queues.enqueue("k", true, &ignore);
        assert!(queues.offer("k", lease("t"), false).is_ok());
        assert!(
            queues.offer("k", lease("u"), false).is_err(),
            "released in Redis instead"
        );
        drop(first);
    }

    #[test]
    fn an_untaken_gift_never_passes_to_a_waiter_that_refuses_handoffs() {
        let queues = Queues::<Handoff>::default();
        let orphans = RefCell::new(Vec::new());
        let collect = |h: Handoff| orphans.borrow_mut().push(h.token);
        let plain = queues.enqueue("k", true, &collect);
        let fenced = queues.enqueue("k", false, &collect);
        assert!(
            queues.offer("k", lease("t"), false).is_ok(),
            "the plain head takes it"
        );
        drop(plain);
        assert!(
            !matches!(fenced.wait_turn(now()), Turn::Gift(_)),
            "a fenced waiter was handed a lease"
        );
        assert_eq!(*orphans.borrow(), vec!["t".to_string()], "released instead");
        assert!(
            queues.offer("k", lease("u"), false).is_err(),
            "nor offered one"
        );
    }

    #[test]
    fn a_newcomer_intercepts_a_handoff_only_within_the_window() {
        let queues = Queues::<Handoff>::default();
        let ignore = |_: Handoff| {};
        assert!(queues.intercept("k").is_none(), "nobody waits");
        let waiter = queues.enqueue("k", true, &ignore);
        assert!(queues.intercept("k").is_none(), "nothing handed over");
        assert!(queues.offer("k", lease("t0"), false).is_ok());
        assert!(queues.intercept("k").is_none(), "its giver said no");
        assert!(matches!(waiter.wait_turn(now()), Turn::Gift(h) if h.token == "t0"));
        drop(waiter);
        let waiter = queues.enqueue("k", true, &ignore);
        assert!(queues.offer("k", lease("t1"), true).is_ok());
        let taken = queues.intercept("k").map(|h| h.token);
        assert_eq!(taken.as_deref(), Some("t1"), "just handed over");
        assert!(
            !matches!(waiter.wait_turn(now()), Turn::Gift(_)),
            "the waiter's lease went to the newcomer"
        );
        // Past the window since the waiter was first handed one, the next
        // lease stays with it, however recent that lease is.
        std::thread::sleep(INTERCEPT_WINDOW + Duration::from_millis(1));
        assert!(queues.offer("k", lease("t2"), true).is_ok());
        assert!(queues.intercept("k").is_none(), "the window has passed");
        assert!(matches!(waiter.wait_turn(now()), Turn::Gift(h) if h.token == "t2"));
        // Taking one opens a new window for the next lease.
        assert!(
            queues.offer("k", lease("t3"), true).is_err(),
            "served: leaving"
        );
        let next = queues.enqueue("k", true, &ignore);
        assert!(queues.offer("k", lease("t3"), true).is_ok());
        assert!(queues.intercept("k").is_some(), "a fresh window");
        drop((waiter, next));
    }

    #[test]
    fn a_semaphores_permits_are_never_intercepted() {
        let queues = Queues::<Handoff>::default();
        let ignore = |_: Handoff| {};
        hold_a_while(&queues, "a", Capacity::Limit(2));
        let waiter = queues.enqueue("k", true, &ignore);
        assert!(queues.offer("k", lease("p"), true).is_ok());
        assert!(queues.intercept("k").is_none());
        assert!(matches!(waiter.wait_turn(now()), Turn::Gift(h) if h.token == "p"));
    }

    #[test]
    fn an_untaken_handoff_is_returned_for_release() {
        let queues = Queues::<Handoff>::default();
        let orphans = RefCell::new(Vec::new());
        let collect = |h: Handoff| orphans.borrow_mut().push(h.token);
        let only = queues.enqueue("k", true, &collect);
        assert!(queues.offer("k", lease("t"), false).is_ok(), "offered");
        drop(only);
        assert_eq!(*orphans.borrow(), vec!["t".to_string()]);
        assert!(!queues.has_waiters("k"));
    }

    /// Standing back for other clients' waiters lasts [`YIELD`] (5 ms),
    /// whatever else wakes the queue meanwhile (the release's own message
    /// reaching this client's subscriber), and ends early only when a lease
    /// is handed over.
    #[test]
    fn the_head_stands_back_for_its_yield_unless_handed_a_lease() {
        assert_eq!(YIELD, Duration::from_millis(5));
        let queues = Queues::<Handoff>::default();
        let ignore = |_: Handoff| {};
        let head = queues.enqueue("k", true, &ignore);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(1));
                // A wake-up of the queue, as a message brings.
                queues.released("k", None);
            });
            let started = Instant::now();
            assert!(head.stand_back(started + YIELD).is_none());
            assert!(started.elapsed() >= YIELD, "{:?}", started.elapsed());
        });
        let long = Duration::from_secs(5);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(1));
                assert!(queues.offer("k", lease("t"), false).is_ok());
            });
            let started = Instant::now();
            let gift = head.stand_back(started + long);
            assert!(matches!(gift, Some(h) if h.token == "t"));
            assert!(started.elapsed() < long, "ended by the handoff");
        });
    }

    #[test]
    fn a_release_that_reached_others_makes_the_head_yield() {
        let queues = Queues::<Handoff>::default();
        let ignore = |_: Handoff| {};
        let head = queues.enqueue("k", true, &ignore);
        let seen = head.wakeups();
        queues.released("k", Some(0));
        assert_ne!(head.wakeups(), seen, "no subscription: woken directly");
        assert!(!head.take_yield());
        let seen = head.wakeups();
        queues.released("k", None);
        assert_ne!(head.wakeups(), seen, "no message sent: woken directly");
        assert!(!head.take_yield());
        queues.released("k", Some(2));
        assert!(head.take_yield(), "other clients were told: stand back");
        assert!(!head.take_yield(), "once");
    }

    #[test]
    fn local_holds_expire_by_the_clock() {
        let queues = Queues::<Handoff>::default();
        hold_a_while(&queues, "t", Capacity::One);
        assert!(queues.held_until("k").is_some());
        queues.hold(
            "k",
            &Arc::from("t"),
            Instant::now() - Duration::from_millis(1),
            Capacity::One,
        );
        assert!(
            queues.held_until("k").is_none(),
            "a lapsed hold does not count"
        );
        hold_a_while(&queues, "t", Capacity::One);
        queues.unhold("k", "older");
        assert!(queues.held_until("k").is_some(), "another token's end");
        queues.unhold("k", "t");
        assert!(queues.held_until("k").is_none());
    }

    #[test]
    fn a_key_counts_as_held_while_its_capacity_is_filled() {
        let queues = Queues::<Handoff>::default();
        let soon = Instant::now() + Duration::from_secs(5);
        let later = soon + Duration::from_secs(5);
        queues.hold("k", &Arc::from("a"), later, Capacity::Limit(2));
        assert!(queues.held_until("k").is_none(), "one of two");
        queues.hold("k", &Arc::from("b"), soon, Capacity::Limit(2));
        assert_eq!(queues.held_until("k"), Some(soon), "the first to end");
        queues.hold(
            "k",
            &Arc::from("b"),
            Instant::now() - Duration::from_millis(1),
            Capacity::Limit(2),
        );
        assert!(queues.held_until("k").is_none(), "b lapsed");
        queues.hold("k", &Arc::from("c"), soon, Capacity::Limit(2));
        assert_eq!(queues.held_until("k"), Some(soon), "a and c");
        queues.unhold("k", "a");
        assert!(queues.held_until("k").is_none());
        queues.unhold("k", "c");
        assert!(!queues.has_limit("k"), "a free key's kept entry is no hold");
        assert!(queues.held_until("k").is_none());
    }

    #[test]
    fn free_keys_keep_their_entries_only_while_few() {
        let queues = Queues::<Handoff>::default();
        let soon = Instant::now() + Duration::from_secs(5);
        let token: Arc<str> = Arc::from("t");
        for n in 0..KEPT_EMPTY * 2 {
            let key = format!("k{n}");
            queues.hold(&key, &token, soon, Capacity::One);
            queues.unhold(&key, "t");
        }
        assert!(queues.held.lock().len() <= KEPT_EMPTY);
        // Held keys are never dropped, however many there are.
        for n in 0..KEPT_EMPTY * 2 {
            queues.hold(&format!("h{n}"), &token, soon, Capacity::One);
        }
        queues.unhold("k0", "t");
        assert!(
            (0..KEPT_EMPTY * 2).all(|n| queues.held_until(&format!("h{n}")).is_some()),
            "every held key is still held"
        );
    }
}

/// Model checking (`RUSTFLAGS="--cfg loom" cargo test --lib --release
/// model`): the queue's own code, over every interleaving of its threads
/// (up to a preemption bound), with loom's locks and a virtual clock.
/// Redis is a mutex-guarded slot here; the threads run the acquire loop's
/// steps as `wait/acquire.rs` does. A timed wait never times out under
/// loom, so a waiter only a timeout would wake is a deadlock: the check of
/// "no waiter sleeps while a gift waits for it".
#[cfg(all(loom, test))]
mod model {
    use super::*;
    use crate::wait::sync::check;
    use loom::sync::atomic::{AtomicUsize, Ordering};

    /// A lease, as the queue passes it: its token.
    struct Gift(Arc<str>);

    /// Redis, for one key: the tokens that hold it, at most `limit`.
    struct Redis {
        held: loom::sync::Mutex<Vec<Arc<str>>>,
        limit: usize,
    }

    impl Redis {
        fn try_take(&self, token: &str) -> Option<Gift> {
            let mut held = self.held.lock().unwrap();
            (held.len() < self.limit).then(|| {
                let token: Arc<str> = Arc::from(token);
                held.push(token.clone());
                Gift(token)
            })
        }

        fn give_back(&self, token: &str) {
            let mut held = self.held.lock().unwrap();
            let before = held.len();
            held.retain(|t| &**t != token);
            assert_eq!(
                held.len() + 1,
                before,
                "released a lease Redis did not hold"
            );
        }
    }

    /// One client's state, shared by its threads.
    struct World {
        queues: Queues<Gift>,
        redis: Redis,
        capacity: Capacity,
        /// Holders inside the critical section now, and the most seen.
        inside: AtomicUsize,
        most: AtomicUsize,
    }

    const K: &str = "k";

    fn far() -> Instant {
        now() + Duration::from_secs(3600)
    }

    impl World {
        fn new(capacity: Capacity) -> Arc<World> {
            Arc::new(World {
                queues: Queues::default(),
                redis: Redis {
                    held: loom::sync::Mutex::new(Vec::new()),
                    limit: capacity.holders(),
                },
                capacity,
                inside: AtomicUsize::new(0),
                most: AtomicUsize::new(0),
            })
        }

        fn exclusive(&self) -> bool {
            self.capacity == Capacity::One
        }

        /// What the acquire loop does, step for step, for one thread.
        fn acquire(&self, me: &str, orphan: &dyn Fn(Gift)) -> Gift {
            let queues = &self.queues;
            if self.exclusive()
                && queues.has_waiters(K)
                && let Some(gift) = queues.intercept(K)
            {
                return gift;
            }
            if !queues.has_waiters(K)
                && queues.held_until(K).is_none()
                && let Some(gift) = self.taken(me)
            {
                return gift;
            }
            let waiter = queues.enqueue(K, true, orphan);
            loop {
                match waiter.wait_turn(None) {
                    Turn::Gift(gift) => return gift,
                    Turn::TimedOut => unreachable!("no deadline"),
                    Turn::Head => {}
                }
                let seen = waiter.wakeups();
                if queues.held_until(K).is_some() {
                    if let Some(gift) = waiter.wait_release(seen, far()) {
                        return gift;
                    }
                    continue;
                }
                if let Some(gift) = self.taken(me) {
                    return gift;
                }
                if let Some(gift) = waiter.wait_release(seen, far()) {
                    return gift;
                }
            }
        }

        /// Taken in Redis: counted among this client's holds.
        fn taken(&self, me: &str) -> Option<Gift> {
            let gift = self.redis.try_take(me)?;
            self.queues.hold(K, &gift.0, far(), self.capacity);
            Some(gift)
        }

        /// What a release does: passed on, or given back in Redis.
        fn release(&self, gift: Gift, interceptable: bool) {
            if let Err(gift) = self.queues.offer(K, gift, interceptable) {
                self.give_back(gift);
            }
        }

        /// Given back in Redis (a release, or a gift nobody took).
        fn give_back(&self, gift: Gift) {
            self.queues.unhold(K, &gift.0);
            self.redis.give_back(&gift.0);
            self.queues.released(K, None);
        }

        fn hold(&self, limit: usize) {
            let inside = self.inside.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(inside, Ordering::SeqCst);
            assert!(
                inside <= limit,
                "{inside} holders of a key that admits {limit}"
            );
            loom::thread::yield_now();
            self.inside.fetch_sub(1, Ordering::SeqCst);
        }

        /// A thread that takes the lease once, holds it, lets it go.
        fn worker(self: &Arc<World>, me: &'static str, interceptable: bool) {
            let world = self.clone();
            let orphan = move |gift: Gift| world.give_back(gift);
            let gift = self.acquire(me, &orphan);
            self.hold(self.capacity.holders());
            self.release(gift, interceptable);
        }

        /// A thread that queues and gives up at once (its deadline passed):
        /// a gift handed to it meanwhile must go on or back to Redis.
        fn leaver(self: &Arc<World>) {
            let world = self.clone();
            let orphan = move |gift: Gift| world.give_back(gift);
            let waiter = self.queues.enqueue(K, true, &orphan);
            loom::thread::yield_now();
            drop(waiter);
        }

        /// Afterwards: every lease back in Redis, no hold or waiter left.
        fn settled(&self) {
            assert!(
                self.redis.held.lock().unwrap().is_empty(),
                "a lease never given back"
            );
            // Entries of free keys are kept (empty) for their next hold.
            assert!(
                self.queues
                    .held
                    .lock()
                    .values()
                    .all(|holds| holds.by.is_empty()),
                "a local hold left behind"
            );
            assert!(!self.queues.has_waiters(K), "a waiter left in the queue");
            assert_eq!(self.inside.load(Ordering::SeqCst), 0);
        }
    }

    fn report(name: &str, runs: usize) {
        println!("{name}: {runs} executions checked");
    }

    /// Three threads of one client take a lock: never two holders, every
    /// lease given back or passed on exactly once, no waiter left asleep
    /// with a gift, whatever the interleaving (interception included).
    #[test]
    fn model_a_lock_never_has_two_local_holders_and_loses_no_gift() {
        let runs = check(3, || {
            let world = World::new(Capacity::One);
            let threads: Vec<_> = [("a", true), ("b", false)]
                .into_iter()
                .map(|(me, interceptable)| {
                    let world = world.clone();
                    loom::thread::spawn(move || world.worker(me, interceptable))
                })
                .collect();
            world.worker("c", true);
            for thread in threads {
                thread.join().unwrap();
            }
            world.settled();
        });
        report("lock, 3 threads", runs);
    }

    /// A waiter that leaves (its deadline passed) while leases are handed
    /// around: its gift goes to the next waiter or back to Redis.
    #[test]
    fn model_a_waiter_leaving_passes_its_gift_on() {
        let runs = check(3, || {
            let world = World::new(Capacity::One);
            let leaver = {
                let world = world.clone();
                loom::thread::spawn(move || world.leaver())
            };
            let other = {
                let world = world.clone();
                loom::thread::spawn(move || world.worker("b", false))
            };
            world.worker("a", true);
            leaver.join().unwrap();
            other.join().unwrap();
            world.settled();
        });
        report("lock with a waiter leaving", runs);
    }

    /// The interception window passing while a gift waits: whether a
    /// newcomer takes it or its waiter does, one holder at a time.
    #[test]
    fn model_interception_either_side_of_its_window() {
        let runs = check(3, || {
            let world = World::new(Capacity::One);
            let clock = loom::thread::spawn(|| {
                crate::wait::sync::advance(INTERCEPT_WINDOW + Duration::from_micros(1));
            });
            let other = {
                let world = world.clone();
                loom::thread::spawn(move || world.worker("b", true))
            };
            world.worker("a", true);
            clock.join().unwrap();
            other.join().unwrap();
            world.settled();
        });
        report("lock with the clock moving", runs);
    }

    /// A semaphore of 2 and three threads: never more than 2 holders,
    /// permits passed on or given back, none lost.
    #[test]
    fn model_a_semaphore_never_exceeds_its_limit() {
        let runs = check(2, || {
            let world = World::new(Capacity::Limit(2));
            let threads: Vec<_> = ["a", "b"]
                .into_iter()
                .map(|me| {
                    let world = world.clone();
                    loom::thread::spawn(move || world.worker(me, false))
                })
                .collect();
            world.worker("c", false);
            for thread in threads {
                thread.join().unwrap();
            }
            world.settled();
        });
        report("semaphore of 2, 3 threads", runs);
    }
}
