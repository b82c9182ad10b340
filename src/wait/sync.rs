//! The locks, condition variables and clock the local queue uses: those of
//! `parking_lot` and the standard library, or, when the crate's unit tests
//! are built with `--cfg loom`, loom's models of them and a virtual clock,
//! so the queue's own code is model-checked over every interleaving of its
//! threads (`wait/queue.rs`, `mod model`).
//!
//! Under loom a timed wait never times out (it waits for a notification, as
//! loom's own `wait_timeout` does): a waiter that only a timeout would
//! wake is reported as a deadlock, which is how a lost wake-up shows. The
//! clock stands still unless a model moves it ([`advance`]).

#[cfg(not(all(loom, test)))]
mod real {
    use std::time::Instant;

    pub(crate) use parking_lot::{Condvar, Mutex};

    /// Now, by the monotonic clock.
    pub(crate) fn now() -> Instant {
        Instant::now()
    }
}

#[cfg(not(all(loom, test)))]
pub(crate) use real::*;

#[cfg(all(loom, test))]
mod model {
    use std::ops::{Deref, DerefMut};
    use std::sync::OnceLock;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    /// A `parking_lot`-shaped mutex over loom's.
    pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

    impl<T: Default> Default for Mutex<T> {
        fn default() -> Self {
            Mutex::new(T::default())
        }
    }

    /// Its guard; `None` only while a condition variable waits with it.
    pub(crate) struct MutexGuard<'a, T>(Option<loom::sync::MutexGuard<'a, T>>);

    impl<T> Mutex<T> {
        pub(crate) fn new(value: T) -> Mutex<T> {
            Mutex(loom::sync::Mutex::new(value))
        }

        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            MutexGuard(Some(self.0.lock().unwrap_or_else(|e| e.into_inner())))
        }
    }

    impl<T> Deref for MutexGuard<'_, T> {
        type Target = T;
        fn deref(&self) -> &T {
            self.0.as_deref().expect("the guard is held")
        }
    }

    impl<T> DerefMut for MutexGuard<'_, T> {
        fn deref_mut(&mut self) -> &mut T {
            self.0.as_deref_mut().expect("the guard is held")
        }
    }

    /// A `parking_lot`-shaped condition variable over loom's.
    pub(crate) struct Condvar(loom::sync::Condvar);

    /// What a wait returned: never a timeout under loom.
    pub(crate) struct WaitResult;

    impl WaitResult {
        pub(crate) fn timed_out(&self) -> bool {
            false
        }
    }

    impl Condvar {
        pub(crate) fn new() -> Condvar {
            Condvar(loom::sync::Condvar::new())
        }

        pub(crate) fn notify_one(&self) {
            self.0.notify_one();
        }

        /// Waits for a notification; the deadline plays no part.
        pub(crate) fn wait_until<T>(
            &self,
            guard: &mut MutexGuard<'_, T>,
            _until: Instant,
        ) -> WaitResult {
            if let Some(held) = guard.0.take() {
                guard.0 = Some(self.0.wait(held).unwrap_or_else(|e| e.into_inner()));
            }
            WaitResult
        }
    }

    loom::lazy_static! {
        /// Virtual microseconds since the model began.
        static ref CLOCK: loom::sync::atomic::AtomicU64 = loom::sync::atomic::AtomicU64::new(0);
    }

    fn base() -> Instant {
        static BASE: OnceLock<Instant> = OnceLock::new();
        *BASE.get_or_init(Instant::now)
    }

    /// Now, by the virtual clock.
    pub(crate) fn now() -> Instant {
        base() + Duration::from_micros(CLOCK.load(Ordering::SeqCst))
    }

    /// Runs `model` over the interleavings loom explores, up to
    /// `preemptions` preemptions (as tokio's loom tests bound theirs), and
    /// returns how many executions were checked.
    pub(crate) fn check(preemptions: usize, model: impl Fn() + Sync + Send + 'static) -> usize {
        // Counted outside loom (not a modelled object), per call.
        let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = runs.clone();
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(preemptions);
        builder.check(move || {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            model();
        });
        runs.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Moves the virtual clock on (a model thread's step).
    pub(crate) fn advance(by: Duration) {
        let micros = u64::try_from(by.as_micros()).unwrap_or(u64::MAX);
        CLOCK.fetch_add(micros, Ordering::SeqCst);
    }
}

#[cfg(all(loom, test))]
pub(crate) use model::*;
