//! Waiting for a held lock: exponential backoff with full jitter, clamped to
//! the caller's deadline, with one last attempt at the deadline.
//!
//! Time and randomness are injected so the arithmetic is unit tested without
//! Redis and without sleeping.

use std::cell::Cell;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, Instant};

/// Exponential backoff with full jitter between attempts to acquire a held
/// lock.
///
/// The n-th wait (counting from 0) is a uniformly random duration in
/// `[0, min(max, initial * factor^n)]` ("full jitter"), and is never longer
/// than the time left before the caller's deadline. The vocabulary follows
/// crossbeam's `Backoff`: a fresh sequence per wait, stepped by each snooze.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub(crate) initial: Duration,
    pub(crate) max: Duration,
    pub(crate) factor: u32,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial: Duration::from_millis(2),
            max: Duration::from_millis(64),
            factor: 2,
        }
    }
}

impl Backoff {
    /// A backoff starting at `initial` and growing by `factor` per attempt up
    /// to `max`.
    ///
    /// A `factor` of 0 is treated as 1 (constant backoff), and a `max` below
    /// `initial` as `initial`.
    pub fn new(initial: Duration, max: Duration, factor: u32) -> Self {
        Backoff {
            initial,
            max: max.max(initial),
            factor: factor.max(1),
        }
    }

    /// A constant upper bound: every wait is a random duration in `[0, delay]`.
    pub fn constant(delay: Duration) -> Self {
        Backoff::new(delay, delay, 1)
    }

    /// The first wait's upper bound. Defaults to 2 ms.
    pub fn initial(&self) -> Duration {
        self.initial
    }

    /// The cap on any wait's upper bound. Defaults to 64 ms.
    pub fn max(&self) -> Duration {
        self.max
    }

    /// The growth factor per attempt. Defaults to 2.
    pub fn factor(&self) -> u32 {
        self.factor
    }

    /// The upper bound of the `attempt`-th wait (counting from 0):
    /// `min(max, initial * factor^attempt)`, computed without overflow.
    pub(crate) fn ceiling(&self, attempt: u32) -> Duration {
        let mut ceiling = self.initial;
        for _ in 0..attempt {
            if ceiling >= self.max {
                break;
            }
            ceiling = ceiling.saturating_mul(self.factor);
        }
        ceiling.min(self.max)
    }
}

/// Where the retry loop reads the time and how it sleeps.
pub(crate) trait Clock {
    fn now(&self) -> Instant;
    fn sleep(&self, duration: Duration);
}

/// The real monotonic clock and `thread::sleep`.
pub(crate) struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn sleep(&self, duration: Duration) {
        if !duration.is_zero() {
            std::thread::sleep(duration);
        }
    }
}

/// Picks a duration uniformly in `[0, ceiling]`.
pub(crate) trait Jitter {
    fn below(&mut self, ceiling: Duration) -> Duration;
}

/// Full jitter from a per-thread xorshift generator. Lock waits need spread,
/// not cryptographic quality, so no RNG crate is pulled in.
pub(crate) struct ThreadJitter;

thread_local! {
    static XORSHIFT: Cell<u64> = Cell::new(seed());
}

fn seed() -> u64 {
    // RandomState is seeded from the OS per process and perturbed per call.
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u64(0x9E37_79B9_7F4A_7C15);
    hasher.finish() | 1
}

impl Jitter for ThreadJitter {
    fn below(&mut self, ceiling: Duration) -> Duration {
        let bound = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        if bound == 0 {
            return Duration::ZERO;
        }
        // try_with: this can run in a thread-local destructor (a guard
        // released while its thread ends), after the generator is gone;
        // any spread will do then.
        let random = XORSHIFT
            .try_with(|state| {
                let mut x = state.get();
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                state.set(x);
                x
            })
            .unwrap_or_else(|_| seed());
        Duration::from_nanos(random % bound.saturating_add(1).max(1))
    }
}

/// One wait's sequence of backoff steps (crossbeam's `Backoff` vocabulary:
/// each `snooze` steps the exponent).
pub(crate) struct Snoozer {
    backoff: Backoff,
    step: u32,
}

impl Snoozer {
    pub(crate) fn new(backoff: Backoff) -> Self {
        Snoozer { backoff, step: 0 }
    }

    /// The next pause before the following attempt (before deadline
    /// clamping), stepping the exponent.
    pub(crate) fn snooze(&mut self, jitter: &mut impl Jitter) -> Duration {
        let ceiling = self.backoff.ceiling(self.step);
        self.step = self.step.saturating_add(1);
        jitter.below(ceiling)
    }
}

/// Calls `attempt` until it yields a value or the deadline has passed.
///
/// Between attempts it sleeps a backoff step, never past the deadline; after
/// a sleep that ends at the deadline it makes one last attempt. An error from
/// `attempt` ends the loop at once. `deadline == None` waits without limit.
pub(crate) fn retry_until<T, E>(
    clock: &impl Clock,
    jitter: &mut impl Jitter,
    backoff: Backoff,
    deadline: Option<Instant>,
    mut attempt: impl FnMut() -> Result<Option<T>, E>,
) -> Result<Option<T>, E> {
    let mut snoozer = Snoozer::new(backoff);
    loop {
        if let Some(value) = attempt()? {
            return Ok(Some(value));
        }
        let pause = snoozer.snooze(jitter);
        let pause = match deadline {
            Some(deadline) => {
                let now = clock.now();
                if now >= deadline {
                    return Ok(None);
                }
                pause.min(deadline - now)
            }
            None => pause,
        };
        clock.sleep(pause);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceiling_grows_then_caps() {
        let b = Backoff::new(Duration::from_millis(2), Duration::from_millis(20), 2);
        let got: Vec<u128> = (0..6).map(|n| b.ceiling(n).as_millis()).collect();
        assert_eq!(got, vec![2, 4, 8, 16, 20, 20]);
    }

    #[test]
    fn ceiling_never_overflows() {
        let b = Backoff::new(Duration::from_millis(1), Duration::MAX, u32::MAX);
        assert_eq!(b.ceiling(u32::MAX), Duration::MAX);
    }

    #[test]
    fn degenerate_backoff_is_normalised() {
        let b = Backoff::new(Duration::from_millis(5), Duration::from_millis(1), 0);
        assert_eq!(b.max(), Duration::from_millis(5));
        assert_eq!(b.factor(), 1);
        assert_eq!(b.ceiling(10), Duration::from_millis(5));
    }

    use std::cell::RefCell;

    /// A clock that only moves when slept on or told to.
    struct FakeClock {
        now: Cell<Instant>,
        sleeps: RefCell<Vec<Duration>>,
    }

    impl FakeClock {
        fn new() -> Self {
            FakeClock {
                now: Cell::new(Instant::now()),
                sleeps: RefCell::new(Vec::new()),
            }
        }
        fn advance(&self, d: Duration) {
            self.now.set(self.now.get() + d);
        }
    }

    impl Clock for FakeClock {
        fn now(&self) -> Instant {
            self.now.get()
        }
        fn sleep(&self, d: Duration) {
            self.sleeps.borrow_mut().push(d);
            self.advance(d);
        }
    }

    /// Always the top of the range, to make the sequence exact.
    struct MaxJitter;
    impl Jitter for MaxJitter {
        fn below(&mut self, ceiling: Duration) -> Duration {
            ceiling
        }
    }

    /// A fixed fraction of the range.
    struct Fraction(u32, u32);
    impl Jitter for Fraction {
        fn below(&mut self, ceiling: Duration) -> Duration {
            ceiling * self.0 / self.1
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn sleeps_ms(clock: &FakeClock) -> Vec<u128> {
        clock
            .sleeps
            .borrow()
            .iter()
            .map(|d| d.as_millis())
            .collect()
    }

    #[test]
    fn exact_sleep_sequence_clamped_to_deadline_with_last_attempt() {
        let clock = FakeClock::new();
        let start = clock.now();
        let deadline = start + ms(100);
        let mut attempts = Vec::new();
        let got: Result<Option<()>, ()> = retry_until(
            &clock,
            &mut MaxJitter,
            Backoff::new(ms(10), ms(40), 2),
            Some(deadline),
            || {
                attempts.push(clock.now() - start);
                Ok(None)
            },
        );
        assert_eq!(got, Ok(None));
        // 10 + 20 + 40 = 70, then 30 (clamped from 40) ends exactly at the deadline.
        assert_eq!(sleeps_ms(&clock), vec![10, 20, 40, 30]);
        let at: Vec<u128> = attempts.iter().map(|d| d.as_millis()).collect();
        assert_eq!(
            at,
            vec![0, 10, 30, 70, 100],
            "one last attempt at the deadline"
        );
        assert_eq!(clock.now(), deadline, "never sleeps past the deadline");
    }

    #[test]
    fn slow_attempts_eat_into_the_wait() {
        let clock = FakeClock::new();
        let start = clock.now();
        let deadline = start + ms(50);
        let mut calls = 0;
        let got: Result<Option<()>, ()> = retry_until(
            &clock,
            &mut Fraction(1, 2),
            Backoff::new(ms(8), ms(1000), 2),
            Some(deadline),
            || {
                calls += 1;
                clock.advance(ms(7)); // each round trip takes 7 ms
                Ok(None)
            },
        );
        assert_eq!(got, Ok(None));
        // attempt ends at 7, sleep 4 -> 11; attempt ends 18, sleep 8 -> 26;
        // attempt ends 33, sleep min(16, 17) -> 49; attempt ends 56 > deadline.
        assert_eq!(sleeps_ms(&clock), vec![4, 8, 16]);
        assert_eq!(calls, 4);
        assert!(clock.sleeps.borrow().iter().all(|d| *d <= ms(50)));
    }

    #[test]
    fn deadline_in_the_past_makes_exactly_one_attempt() {
        let clock = FakeClock::new();
        let deadline = clock.now();
        clock.advance(ms(5));
        let mut calls = 0;
        let got: Result<Option<()>, ()> = retry_until(
            &clock,
            &mut MaxJitter,
            Backoff::default(),
            Some(deadline),
            || {
                calls += 1;
                Ok(None)
            },
        );
        assert_eq!(got, Ok(None));
        assert_eq!(calls, 1);
        assert!(clock.sleeps.borrow().is_empty());
    }

    #[test]
    fn success_and_errors_end_the_loop_at_once() {
        let clock = FakeClock::new();
        let deadline = Some(clock.now() + ms(1000));
        let mut calls = 0;
        let got: Result<Option<u32>, ()> =
            retry_until(&clock, &mut MaxJitter, Backoff::default(), deadline, || {
                calls += 1;
                Ok(if calls == 3 { Some(7) } else { None })
            });
        assert_eq!(got, Ok(Some(7)));
        assert_eq!(sleeps_ms(&clock), vec![2, 4]);

        let clock = FakeClock::new();
        let got: Result<Option<u32>, &str> =
            retry_until(&clock, &mut MaxJitter, Backoff::default(), deadline, || {
                Err("boom")
            });
        assert_eq!(got, Err("boom"));
        assert!(clock.sleeps.borrow().is_empty());
    }

    #[test]
    fn no_deadline_keeps_going_with_capped_sleeps() {
        let clock = FakeClock::new();
        let mut calls = 0;
        let got: Result<Option<()>, ()> = retry_until(
            &clock,
            &mut MaxJitter,
            Backoff::new(ms(1), ms(4), 2),
            None,
            || {
                calls += 1;
                Ok(if calls == 6 { Some(()) } else { None })
            },
        );
        assert_eq!(got, Ok(Some(())));
        assert_eq!(sleeps_ms(&clock), vec![1, 2, 4, 4, 4]);
    }

    #[test]
    fn thread_jitter_stays_in_range_and_spreads() {
        let mut jitter = ThreadJitter;
        let ceiling = ms(10);
        let draws: Vec<Duration> = (0..1000).map(|_| jitter.below(ceiling)).collect();
        assert!(draws.iter().all(|d| *d <= ceiling));
        assert!(draws.iter().any(|d| *d < ms(3)));
        assert!(draws.iter().any(|d| *d > ms(7)));
        assert_eq!(jitter.below(Duration::ZERO), Duration::ZERO);
    }
}
