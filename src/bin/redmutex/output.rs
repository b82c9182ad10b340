//! Where `redmutex` writes, so that no output it cannot write stops it.
//!
//! Messages go to standard error from a thread of their own, through a
//! bounded queue: the supervisor's loop never waits on a full pipe, a
//! stalled log collector, a terminal held by ^S or a reader that is gone.
//! A message that finds the queue full is dropped (and counted, said once
//! the writer catches up). On the way out `redmutex` waits a moment for
//! the queue to drain, never longer.
//!
//! Results go to standard output; one that cannot be written (a closed
//! pipe: `redmutex list | head`) is dropped and never a panic, and the
//! exit code stays what the command did.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Messages waiting for standard error before new ones are dropped.
const QUEUED: usize = 256;

/// How long `redmutex` waits on its way out for its messages to be
/// written: a stderr nobody reads costs an exit no more than this.
pub(super) const DRAIN: Duration = Duration::from_millis(500);

struct Queue {
    sender: SyncSender<Vec<u8>>,
    /// Sent and not yet written (or given up on).
    pending: Arc<AtomicUsize>,
    dropped: Arc<AtomicUsize>,
}

static QUEUE: OnceLock<Option<Queue>> = OnceLock::new();
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);

/// The writer, started on the first message (never before `run` forks its
/// watcher: nothing is written before that). `None` when no thread can be
/// started: messages are then written in place.
fn queue() -> Option<&'static Queue> {
    QUEUE
        .get_or_init(|| {
            let (sender, receiver) = sync_channel::<Vec<u8>>(QUEUED);
            let pending = Arc::new(AtomicUsize::new(0));
            let dropped = Arc::new(AtomicUsize::new(0));
            let (p, d) = (pending.clone(), dropped.clone());
            let started = with_signals_blocked(|| {
                std::thread::Builder::new()
                    .name("redmutex-stderr".into())
                    .spawn(move || write_out(&receiver, &p, &d))
            });
            started.ok().map(|_| Queue {
                sender,
                pending,
                dropped,
            })
        })
        .as_ref()
}

/// Runs `f` (which starts a thread) with every signal blocked, so the new
/// thread starts with them blocked: job control's handlers and the stop
/// they lead to must run on the main thread (see `supervise::JobControl`).
pub(super) fn with_signals_blocked<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: pthread_sigmask on this thread's own mask, put back after.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        let out = f();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        out
    }
}

fn write_out(receiver: &Receiver<Vec<u8>>, pending: &AtomicUsize, dropped: &AtomicUsize) {
    let mut stderr = std::io::stderr();
    // Ends when every sender is gone: never, the queue is static.
    for message in receiver {
        let lost = dropped.swap(0, Ordering::SeqCst);
        if lost > 0 {
            let _ = writeln!(
                stderr,
                "redmutex: ({lost} message(s) dropped: standard error was not being read)"
            );
        }
        // A failed write (stderr closed) is dropped: there is no one to
        // tell.
        let _ = stderr.write_all(&message);
        let _ = stderr.flush();
        pending.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Queues `bytes` for standard error, never waiting: dropped (and
/// counted) when the queue is full.
pub(super) fn to_stderr(bytes: Vec<u8>) {
    let Some(queue) = queue() else {
        let _ = std::io::stderr().write_all(&bytes);
        return;
    };
    queue.pending.fetch_add(1, Ordering::SeqCst);
    match queue.sender.try_send(bytes) {
        Ok(()) => {}
        Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
            queue.pending.fetch_sub(1, Ordering::SeqCst);
            queue.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Waits at most `within` for the queued messages to be written.
pub(super) fn drain(within: Duration) {
    let Some(queue) = QUEUE.get().and_then(Option::as_ref) else {
        return;
    };
    let until = Instant::now() + within;
    while queue.pending.load(Ordering::SeqCst) > 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Writes a line of results to standard output. Once a write failed (the
/// reader is gone), the rest is dropped: [`stdout_closed`] says so, for a
/// command that can stop early.
pub(super) fn line(text: std::fmt::Arguments<'_>) {
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut stdout = std::io::stdout().lock();
    if writeln!(stdout, "{text}").is_err() {
        STDOUT_CLOSED.store(true, Ordering::Relaxed);
    }
}

/// Whether standard output could not be written (its reader is gone).
pub(super) fn stdout_closed() -> bool {
    STDOUT_CLOSED.load(Ordering::Relaxed)
}

/// `println!` that never panics (see [`line`]).
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::output::line(format_args!($($arg)*))
    };
}
pub(super) use outln;
