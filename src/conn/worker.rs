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
        let handle = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                let _alive = alive;
                body();
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

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
