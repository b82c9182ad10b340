//! Which process this is: what `fork()` copies and must not be trusted in
//! the child.
//!
//! A forked child inherits a copy of everything in memory (statics, thread
//! locals of the forking thread, clients, their pools and guards) but none
//! of the parent's threads, and it shares the parent's sockets. Whatever
//! names "this process" (the reentrant lock's owner id, the token
//! generator's state) must therefore be made again in the child, and a
//! client made
//! in the parent must never act for the child: its locks are the parent's,
//! and its connections carry the parent's traffic.
//!
//! A `pthread_atfork` child handler bumps a generation (one atomic add,
//! async-signal-safe); a [`Birth`] records the generation and the process
//! id it was made in. Asking whether a birth is current is on every lock
//! call's path, so it reads the generation alone (an atomic load: the
//! process id is a system call on current C libraries); only where the
//! handler could not be registered is the process id compared instead.

use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static FORKS: AtomicU64 = AtomicU64::new(0);
static WATCH: Once = Once::new();
/// The handler is registered: the generation tells a fork.
static WATCHED: AtomicBool = AtomicBool::new(false);

#[cfg(unix)]
extern "C" fn forked() {
    // Async-signal-safe: one atomic add, no allocation, no lock.
    FORKS.fetch_add(1, Ordering::SeqCst);
}

/// Registers the fork handler, once per process (a child inherits the
/// registration).
fn watch() {
    WATCH.call_once(|| {
        #[cfg(unix)]
        {
            // SAFETY: registers a handler that only bumps an atomic; never
            // unregistered (the function lives as long as the process).
            let rc = unsafe { libc::pthread_atfork(None, None, Some(forked)) };
            WATCHED.store(rc == 0, Ordering::SeqCst);
            if rc != 0 {
                log::debug!(
                    "redmutex: pthread_atfork failed ({rc}); a fork is told by the process id alone"
                );
            }
        }
    });
}

/// The fork generation: bumped in every child forked since the handler was
/// registered (by the first call of this).
pub(crate) fn generation() -> u64 {
    watch();
    FORKS.load(Ordering::SeqCst)
}

/// The process something was made in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Birth {
    generation: u64,
    pid: u32,
}

impl Birth {
    /// This process, now.
    pub(crate) fn now() -> Birth {
        Birth {
            generation: generation(),
            pid: std::process::id(),
        }
    }

    /// This process, now, for a birth checked often and made often (a
    /// lease's loss state): the process id is read (a system call) only
    /// where the fork handler could not be registered, the only case
    /// [`Birth::is_current`] needs it; [`Birth::pid`] is then 0.
    pub(crate) fn quick() -> Birth {
        let generation = generation();
        Birth {
            generation,
            pid: if WATCHED.load(Ordering::Relaxed) {
                0
            } else {
                std::process::id()
            },
        }
    }

    /// Whether this is still the process it was made in (not a child
    /// forked since).
    pub(crate) fn is_current(&self) -> bool {
        self.generation == FORKS.load(Ordering::Acquire)
            && (WATCHED.load(Ordering::Relaxed) || self.pid == std::process::id())
    }

    /// The process id it was made in.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    #[test]
    fn a_forked_child_is_another_birth() {
        let birth = Birth::now();
        assert!(birth.is_current());
        // SAFETY: the child only reads two atomics and the pid, then exits
        // with _exit (no destructors, no other thread's state).
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork");
        if child == 0 {
            let code = if birth.is_current() || !Birth::now().is_current() {
                1
            } else {
                0
            };
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: reaps our own child.
        let reaped = unsafe { libc::waitpid(child, &mut status, 0) };
        assert_eq!(reaped, child);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        assert!(birth.is_current(), "the parent is still itself");
    }
}
