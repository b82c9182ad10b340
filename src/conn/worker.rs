//! Background threads a client starts, and stops within a bound.
//!
//! A client's threads may be inside a network call when the client is
//! dropped (a connect, a read waiting out its timeout, a DNS lookup). Drop
//! must not wait for that: it tells the thread to stop, waits a short
//! while for it to end, and otherwise leaves it to end on its own once the
//! call returns.

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How long dropping a client waits for each of its threads to end.
pub(crate) const STOP_WAIT: Duration = Duration::from_millis(100);

/// A named thread whose end can be awaited with a timeout.
pub(crate) struct Worker {
    handle: JoinHandle<()>,
    /// Disconnected when the thread's closure has returned or unwound.
    ended: mpsc::Receiver<()>,
}

impl Worker {
    pub(crate) fn spawn(
        name: &str,
        body: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<Worker> {
        let (alive, ended) = mpsc::channel::<()>();
        let handle = without_signals(|| {
            std::thread::Builder::new()
                .name(name.to_owned())
                .spawn(move || {
                    let _alive = alive;
                    body();
                })
        })?;
        Ok(Worker { handle, ended })
    }

    /// Waits at most `within` for the thread to end; joins it if it did.
    /// Returns whether it ended (otherwise it is left to end by itself).
    pub(crate) fn stop_within(self, within: Duration) -> bool {
        match self.ended.recv_timeout(within) {
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let _ = self.handle.join();
                true
            }
            Ok(()) | Err(mpsc::RecvTimeoutError::Timeout) => false,
        }
    }
}

/// Waits for `threads`, each told to stop at `told`, together: each at
/// most its own wait, counted from `told`, so the whole wait is the
/// longest of them, not their sum.
pub(crate) fn stop_all(
    told: std::time::Instant,
    threads: impl IntoIterator<Item = (Worker, Duration)>,
) {
    for (thread, wait) in threads {
        thread.stop_within(wait.saturating_sub(told.elapsed()));
    }
}

/// Runs `spawn`, which starts threads, with every asynchronous signal
/// blocked in the calling thread, then puts its mask back: the threads
/// start with those signals blocked (a new thread inherits its creator's
/// mask) and keep them so.
///
/// A signal sent to the process goes to any thread that does not block
/// it. Left unblocked in the crate's threads, a program's handler could run
/// on one of them, and a program that stops itself and learns from its
/// SIGCONT handler that it was continued (as `redmutex run` does) could see
/// its own thread resume before the handler ran elsewhere. Faults (SIGSEGV
/// and the like) are not blocked: they go to the faulting thread whatever
/// its mask, and blocking them is undefined.
pub(crate) fn without_signals<T>(spawn: impl FnOnce() -> T) -> T {
    #[cfg(unix)]
    {
        /// Puts the mask back, on a panic too.
        struct Restore(Option<libc::sigset_t>);
        impl Drop for Restore {
            fn drop(&mut self) {
                if let Some(old) = &self.0 {
                    // SAFETY: sets this thread's mask to one it had.
                    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, old, std::ptr::null_mut()) };
                }
            }
        }
        // SAFETY: sigset_t is plain data filled by sigfillset/sigdelset;
        // pthread_sigmask changes this thread's mask only.
        let _restore = unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            for fault in [
                libc::SIGSEGV,
                libc::SIGBUS,
                libc::SIGFPE,
                libc::SIGILL,
                libc::SIGTRAP,
                libc::SIGSYS,
            ] {
                libc::sigdelset(&mut all, fault);
            }
            let mut old: libc::sigset_t = std::mem::zeroed();
            let blocked = libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old) == 0;
            Restore(blocked.then_some(old))
        };
        spawn()
    }
    #[cfg(not(unix))]
    spawn()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// The mask of the calling thread, as `/proc/thread-self/status` shows it.
    #[cfg(target_os = "linux")]
    fn blocked_here() -> String {
        std::fs::read_to_string("/proc/thread-self/status")
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("SigBlk:"))
            .map(|m| m.trim().to_owned())
            .unwrap_or_default()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_crates_threads_block_signals_and_the_caller_keeps_its_mask() {
        let before = blocked_here();
        let (tx, rx) = mpsc::channel();
        let worker = Worker::spawn("masked", move || {
            let _ = tx.send(blocked_here());
        })
        .expect("spawn");
        let theirs = rx.recv_timeout(Duration::from_secs(5)).expect("mask");
        assert!(worker.stop_within(Duration::from_secs(5)));
        assert_eq!(blocked_here(), before, "the caller's mask changed");
        let mask = u64::from_str_radix(&theirs, 16).expect("a hex mask");
        let bit = |signal: i32| 1u64 << (signal - 1);
        for signal in [
            libc::SIGCONT,
            libc::SIGTSTP,
            libc::SIGINT,
            libc::SIGTERM,
            libc::SIGCHLD,
        ] {
            assert_ne!(
                mask & bit(signal),
                0,
                "signal {signal} not blocked: {theirs}"
            );
        }
        assert_eq!(mask & bit(libc::SIGSEGV), 0, "a fault blocked: {theirs}");
    }

    #[test]
    fn a_busy_thread_does_not_hold_up_the_stop() {
        let quick = Worker::spawn("quick", || {}).expect("spawn");
        assert!(quick.stop_within(Duration::from_secs(5)));
        let busy = Worker::spawn("busy", || std::thread::sleep(Duration::from_millis(500)))
            .expect("spawn");
        let started = Instant::now();
        assert!(!busy.stop_within(Duration::from_millis(20)));
        assert!(started.elapsed() < Duration::from_millis(400));
    }
}
