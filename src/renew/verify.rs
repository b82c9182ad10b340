//! Verification of leases passed between threads of one client.
//!
//! A lease handed from a releasing thread to a queued one (a lock's
//! handoff, a newcomer's interception, a semaphore permit passed on) costs
//! no Redis command: that is why a hot key reaches hundreds of thousands
//! of acquisitions a second. But nothing local can tell that Redis no
//! longer holds it: the key deleted (`force_release`, an operator), taken
//! after an early expiry, lost in a restart without persistence or in a
//! failover. Handed on regardless, it would make a second holder beside
//! the client that took the key in Redis, made by this crate.
//!
//! So every lease that has been handed on (a *chain*) is checked in Redis
//! while handoffs go on: each handoff asks for a check, and this client's
//! verifier thread sends it, owner-checked and read-only, [`MIN_GAP`] after
//! Redis last vouched for the lease (its acquisition, or the chain's last
//! check), or at once when that is past; checks due together go in one
//! pipeline. A chain that ends (released in Redis, whose owner-checked
//! release answers for it) before its check is due costs no check: a hot
//! chain of a few hundred handoffs in under a millisecond costs none. When Redis says the lease is not ours
//! any more, its loss signal fires: every holder sharing it reads as lost
//! (`is_lost()`, zero `validity()`), it is never handed on again, and its
//! release reports `NotHeld`. For a semaphore permit the check also reads
//! the stored limit: a limit changed elsewhere stops the permit's
//! handoffs (a handoff is an admission, which the new limit must decide).
//!
//! One exception: a lease handed on only once within [`YOUNG`] of its
//! acquisition waits until [`YOUNG`] after it for its first check. Such a
//! lease is no staler than a lease [`YOUNG`] into a single hold, which
//! nothing checks, and the slow chain the handoff budget makes (a hold of
//! a few milliseconds, one handoff, a second hold, then the release in
//! Redis) costs no command beyond its release: a check there cost one
//! `GET` per two acquisitions, half again the key's whole cost in Redis.
//! It is never passed on a second time unchecked: the thread about to do
//! so, when Redis vouched for it more than [`MIN_GAP`] ago, checks it on
//! its own thread first ([`Verifier::may_pass`], only with a waiter to
//! pass it to) and releases it in Redis instead when Redis says no.
//!
//! The bound: a chain is found lost within [`MIN_GAP`] + one round trip
//! after the first handoff that follows the loss (on a hot chain, after
//! the loss itself; a young chain handed on once: [`YOUNG`] after its
//! acquisition + one round trip, or at its release or its next handoff),
//! while the verifier's connection answers and its
//! thread gets a processor; or its release in Redis, the chain's end,
//! says so sooner. One client's checks go one pipeline at a time, so with
//! a round trip longer than [`MIN_GAP`] the bound is two round trips. A chain costs at most one command per [`MIN_GAP`], and
//! only while it is handed on; a lease that stays with one holder is
//! checked by nothing here (the watchdog's renewals, when on, are its
//! checks).
//!
//! A check sent twice, or late, is harmless: it only reads. A reply that
//! comes after the chain ended (released in Redis, abandoned) is ignored,
//! so a released lease never reads as lost.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::conn::backend::Backend;
use crate::conn::policy::{self, Op};
use crate::conn::stats::Stats;
use crate::conn::worker::{STOP_WAIT, Worker};
use crate::lease::loss::{LossReason, LossState};
use crate::script;

/// The verifier thread's name.
pub(crate) const THREAD_NAME: &str = "redmutex-check";

/// The least time between two checks of one chain.
pub(crate) const MIN_GAP: Duration = Duration::from_millis(1);

/// A lease handed on once this soon after its acquisition waits this long
/// from the acquisition for its first check (and is checked by the thread
/// passing it on before a second handoff): no staler than a lease this far into a
/// single hold, which nothing checks. Twice the default handoff budget, so
/// the common slow chain (one holder, one handoff, then the release in
/// Redis the budget asks for) costs no command beyond the release.
pub(crate) const YOUNG: Duration = Duration::from_millis(20);

/// What a chain is in Redis, and so how it is checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Probe {
    /// A string key holding the token (`GET`).
    Plain,
    /// A semaphore permit granted under this limit
    /// (`lua/sem_check.lua`).
    Permit { limit: u32 },
}

/// One lease as it passes between threads of a client: shared by every
/// holder along the way.
pub(crate) struct Chain {
    key: Arc<str>,
    /// The token, or the permit's id.
    token: Arc<str>,
    probe: Probe,
    /// The lease's own loss signal, which every holder reads.
    loss: Arc<LossState>,
    /// A check was asked for and not sent yet.
    requested: AtomicBool,
    /// Handed on once and never checked: its check is due [`YOUNG`] after
    /// the acquisition.
    young: AtomicBool,
    /// The stored limit differs from the permit's: no more handoffs.
    stale: AtomicBool,
    state: Mutex<ChainState>,
}

struct ChainState {
    /// Released in Redis or abandoned: replies are no news any more.
    done: bool,
    /// When Redis last vouched for the lease: the request that acquired it
    /// left, or the last check did.
    vouched: Instant,
}

impl Chain {
    /// The chain of a lease whose acquisition (or last renewal) left at
    /// `vouched`, made at its first handoff: young, its first check due
    /// [`YOUNG`] after that (see the module).
    pub(crate) fn new(
        key: Arc<str>,
        token: Arc<str>,
        probe: Probe,
        loss: Arc<LossState>,
        vouched: Instant,
    ) -> Arc<Chain> {
        Arc::new(Chain {
            key,
            token,
            probe,
            loss,
            requested: AtomicBool::new(false),
            young: AtomicBool::new(true),
            stale: AtomicBool::new(false),
            state: Mutex::new(ChainState {
                done: false,
                vouched,
            }),
        })
    }

    /// When its next check is due.
    fn due(&self) -> Instant {
        let vouched = self.state.lock().vouched;
        let gap = if self.young.load(Ordering::Acquire) {
            YOUNG
        } else {
            MIN_GAP
        };
        vouched.checked_add(gap).unwrap_or(vouched)
    }

    /// Whether the lease may still be handed on, as far as checks tell:
    /// not found lost, and (a permit) under the limit it was granted
    /// with.
    pub(crate) fn may_pass(&self) -> bool {
        !self.stale.load(Ordering::Acquire) && self.loss.reason().is_none()
    }

    /// The chain ends: the lease is released in Redis (called before the
    /// release is sent) or given up. A check answered after this is not
    /// applied.
    pub(crate) fn end(&self) {
        self.state.lock().done = true;
    }

    /// What a check's reply says.
    fn apply(&self, reply: &redis::RedisResult<redis::Value>) {
        let verdict = match (self.probe, reply) {
            (Probe::Plain, Ok(redis::Value::BulkString(value))) => {
                (value.as_slice() != self.token.as_bytes()).then_some(LossReason::OwnedByOther)
            }
            (Probe::Plain, Ok(redis::Value::Nil)) => Some(LossReason::Expired),
            (Probe::Permit { limit }, Ok(value)) => {
                match redis::from_redis_value_ref::<(i64, i64)>(value) {
                    Ok((live, stored)) => {
                        if u32::try_from(stored).ok() != Some(limit) {
                            self.stale.store(true, Ordering::Release);
                        }
                        (live != 1).then_some(LossReason::Expired)
                    }
                    // Not what the script answers: no verdict.
                    Err(_) => None,
                }
            }
            // Another type's value, or another owner's data: taken.
            (_, Err(err)) if crate::error::server_code(err) == Some("WRONGTYPE") => {
                Some(LossReason::OwnedByOther)
            }
            // Failed on the way (or a reply of no known shape): no news;
            // the next handoff asks again.
            _ => None,
        };
        let Some(reason) = verdict else {
            return;
        };
        // Under the chain's lock: an end that came first wins.
        let state = self.state.lock();
        if !state.done {
            self.loss.lose(reason);
            log::debug!(
                "redmutex: a lease of {:?} passed between threads was found lost in Redis: {reason}",
                self.key
            );
        }
    }

    fn call(&self) -> redis::Cmd {
        match self.probe {
            Probe::Plain => {
                let mut cmd = redis::cmd("GET");
                cmd.arg(&*self.key);
                cmd
            }
            Probe::Permit { .. } => {
                let mut cmd = redis::cmd("EVALSHA");
                cmd.arg(script::SEM_CHECK.get_hash())
                    .arg(1)
                    .arg(&*self.key)
                    .arg(&*self.token);
                cmd
            }
        }
    }
}

/// A client's verifier: one thread, started at the first handoff, ended
/// with the client (bounded join).
pub(crate) struct Verifier {
    shared: Arc<Shared>,
}

struct Shared {
    backend: Backend,
    stats: Arc<Stats>,
    queue: Mutex<Queue>,
    wake: Condvar,
}

#[derive(Default)]
struct Queue {
    /// Chains asked to be checked, and when each is due.
    asked: Vec<(Instant, Arc<Chain>)>,
    /// When the thread wakes by itself; `None` while it sleeps with no
    /// deadline. A chain due sooner wakes it.
    wake_at: Option<Instant>,
    thread: Option<Worker>,
    shutdown: bool,
}

impl Verifier {
    pub(crate) fn new(backend: Backend, stats: Arc<Stats>) -> Verifier {
        Verifier {
            shared: Arc::new(Shared {
                backend,
                stats,
                queue: Mutex::default(),
                wake: Condvar::new(),
            }),
        }
    }

    /// A handoff of `chain` happened: check it in Redis, [`MIN_GAP`] after
    /// Redis last vouched for it (at once when that is past), or [`YOUNG`]
    /// after for a young chain's first handoff; a second handoff of a young
    /// chain brings its check forward. One atomic load when a check is
    /// already asked for and the chain is not young (the common case on a
    /// hot chain); otherwise one short lock, and the thread woken only when
    /// it would sleep past this chain's check.
    pub(crate) fn verify(&self, chain: &Arc<Chain>) {
        if chain.requested.load(Ordering::Acquire) || chain.requested.swap(true, Ordering::AcqRel) {
            // A second handoff of a young chain: its check, asked for
            // [`YOUNG`] after the acquisition, is brought forward.
            if chain.young.load(Ordering::Acquire) && chain.young.swap(false, Ordering::AcqRel) {
                self.bring_forward(chain);
            }
            return;
        }
        let due = chain.due();
        let mut queue = self.shared.queue.lock();
        if queue.shutdown {
            return;
        }
        queue.asked.push((due, chain.clone()));
        let wake = queue.wake_at.is_none_or(|at| at > due);
        if wake {
            queue.wake_at = Some(due);
        }
        if queue.thread.is_none() {
            let shared = self.shared.clone();
            match Worker::spawn(THREAD_NAME, move || run(&shared)) {
                Ok(worker) => queue.thread = Some(worker),
                Err(err) => {
                    log::warn!("redmutex: cannot start the verifier thread: {err}");
                    queue.asked.clear();
                    chain.requested.store(false, Ordering::Release);
                    return;
                }
            }
        }
        if wake {
            self.shared.wake.notify_one();
        }
    }
}

impl Verifier {
    /// Whether a holder may pass `chain`'s lease on, checking it first, on
    /// the calling thread, when it is young (handed on once, never
    /// checked) and Redis vouched for it more than [`MIN_GAP`] ago: its
    /// queued check is not due before [`YOUNG`], and a lease lost meanwhile
    /// must not reach a second receiver unchecked. One read-only,
    /// owner-checked round trip (resent after a lost reply, like any
    /// read); a check that fails on the network says no (the lease is then
    /// released in Redis, whose owner-checked answer decides). Otherwise
    /// what the checks so far say ([`Chain::may_pass`]).
    pub(crate) fn may_pass(&self, chain: &Arc<Chain>) -> bool {
        if !chain.young.load(Ordering::Acquire) {
            return chain.may_pass();
        }
        let vouched = chain.state.lock().vouched;
        if vouched.elapsed() < MIN_GAP {
            return chain.may_pass();
        }
        let sent = Instant::now();
        if !check(&self.shared, std::slice::from_ref(chain)) || !chain.may_pass() {
            return false;
        }
        // Ours as of `sent`: checked, so no longer young.
        let mut state = chain.state.lock();
        state.vouched = state.vouched.max(sent);
        chain.young.store(false, Ordering::Release);
        true
    }

    /// Moves `chain`'s queued check to [`MIN_GAP`] after its vouching. Not
    /// queued any more (the thread took it meanwhile): nothing to do, its
    /// next request is due that soon anyway.
    fn bring_forward(&self, chain: &Arc<Chain>) {
        let due = chain.due();
        let mut queue = self.shared.queue.lock();
        let Some(entry) = queue
            .asked
            .iter_mut()
            .find(|(_, queued)| Arc::ptr_eq(queued, chain))
        else {
            return;
        };
        entry.0 = entry.0.min(due);
        if queue.wake_at.is_none_or(|at| at > due) {
            queue.wake_at = Some(due);
            self.shared.wake.notify_one();
        }
    }
}

impl Drop for Verifier {
    fn drop(&mut self) {
        let thread = {
            let mut queue = self.shared.queue.lock();
            queue.shutdown = true;
            self.shared.wake.notify_all();
            queue.thread.take()
        };
        if let Some(thread) = thread {
            thread.stop_within(STOP_WAIT);
        }
    }
}

fn run(shared: &Shared) {
    let mut due: Vec<Arc<Chain>> = Vec::new();
    loop {
        due.clear();
        {
            let mut queue = shared.queue.lock();
            loop {
                if queue.shutdown {
                    return;
                }
                let now = Instant::now();
                let mut soonest: Option<Instant> = None;
                queue.asked.retain(|(at, chain)| {
                    if *at > now {
                        soonest = Some(soonest.map_or(*at, |s| s.min(*at)));
                        return true;
                    }
                    due.push(chain.clone());
                    false
                });
                if !due.is_empty() {
                    break;
                }
                // Planned and slept on under the queue's lock, which a
                // chain due sooner takes to wake it: none is missed.
                queue.wake_at = soonest;
                match soonest {
                    Some(at) => {
                        shared.wake.wait_until(&mut queue, at);
                    }
                    None => shared.wake.wait(&mut queue),
                }
            }
        }
        let now = Instant::now();
        // Asked again from here on: a handoff during this round queues the
        // chain for the next. A chain that ended meanwhile needs no check:
        // its release in Redis answered for it.
        due.retain(|chain| {
            chain.young.store(false, Ordering::Release);
            chain.requested.store(false, Ordering::Release);
            let mut state = chain.state.lock();
            state.vouched = now;
            !state.done
        });
        if !due.is_empty() {
            check(shared, &due);
        }
    }
}

/// One pipeline of checks, within one I/O timeout; sent again on a fresh
/// connection after a lost reply (they only read).
/// Checks `due` in one pipeline and applies each reply; true when every
/// check was answered (with a verdict or "still ours").
fn check(shared: &Shared, due: &[Arc<Chain>]) -> bool {
    let calls: Vec<redis::Cmd> = due.iter().map(|chain| chain.call()).collect();
    let key = due.first().map_or("", |chain| &*chain.key);
    shared.stats.commands(calls.len() as u64);
    let replies = policy::run_within(
        &shared.backend,
        &shared.stats,
        Op::Read,
        key,
        shared.backend.timeout(),
        |con, _| script::pipelined(con, &calls, &[&script::SEM_CHECK], &shared.stats),
    );
    match replies {
        Ok(replies) => {
            let answered = replies.len() == due.len() && replies.iter().all(Result::is_ok);
            for (chain, reply) in due.iter().zip(replies) {
                chain.apply(&reply);
            }
            answered
        }
        Err(err) => {
            log::debug!("redmutex: checking leases passed between threads failed: {err}");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(probe: Probe) -> Arc<Chain> {
        Chain::new(
            Arc::from("k"),
            Arc::from("mine"),
            probe,
            Arc::new(LossState::default()),
            Instant::now(),
        )
    }

    fn bulk(text: &str) -> redis::RedisResult<redis::Value> {
        Ok(redis::Value::BulkString(text.as_bytes().to_vec()))
    }

    #[test]
    fn a_plain_check_reads_our_token_or_a_loss() {
        let ours = chain(Probe::Plain);
        ours.apply(&bulk("mine"));
        assert!(ours.may_pass());
        let taken = chain(Probe::Plain);
        taken.apply(&bulk("theirs"));
        assert_eq!(taken.loss.reason(), Some(LossReason::OwnedByOther));
        assert!(!taken.may_pass());
        let gone = chain(Probe::Plain);
        gone.apply(&Ok(redis::Value::Nil));
        assert_eq!(gone.loss.reason(), Some(LossReason::Expired));
        let failed = chain(Probe::Plain);
        failed.apply(&Err(redis::RedisError::from(std::io::Error::from(
            std::io::ErrorKind::TimedOut,
        ))));
        assert!(failed.may_pass(), "no news is not a loss");
    }

    #[test]
    fn a_young_chain_is_checked_later_until_handed_on_again() {
        let young = chain(Probe::Plain);
        let vouched = young.state.lock().vouched;
        assert_eq!(young.due(), vouched + YOUNG);
        // What a second handoff (or a check) does.
        young.young.store(false, Ordering::Release);
        assert_eq!(young.due(), vouched + MIN_GAP);
    }

    #[test]
    fn a_reply_after_the_chain_ended_is_no_news() {
        let released = chain(Probe::Plain);
        released.end();
        released.apply(&Ok(redis::Value::Nil));
        assert_eq!(released.loss.reason(), None);
    }

    #[test]
    fn a_permit_check_reads_its_place_and_the_limit() {
        let reply = |live: i64, limit: i64| {
            Ok(redis::Value::Array(vec![
                redis::Value::Int(live),
                redis::Value::Int(limit),
            ]))
        };
        let fine = chain(Probe::Permit { limit: 3 });
        fine.apply(&reply(1, 3));
        assert!(fine.may_pass());
        let lowered = chain(Probe::Permit { limit: 3 });
        lowered.apply(&reply(1, 1));
        assert!(!lowered.may_pass(), "a limit changed elsewhere");
        assert_eq!(lowered.loss.reason(), None, "the permit itself is fine");
        let gone = chain(Probe::Permit { limit: 3 });
        gone.apply(&reply(0, 3));
        assert_eq!(gone.loss.reason(), Some(LossReason::Expired));
        let garbage = chain(Probe::Permit { limit: 3 });
        garbage.apply(&bulk("what"));
        assert!(garbage.may_pass());
    }
}
