//! What keeps `redmutex run`'s command from running without a live lease,
//! whatever happens to `redmutex`: a watcher process that kills the
//! command's group (and the daemons it was told of) when `redmutex` dies,
//! by any signal, even when the command changed its user id; job control
//! (the command stopped and resumed with its shell job, its lease checked
//! before it runs again); signals ignored on entry left ignored; and the
//! processes a daemonizing command leaves behind.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::process::ExitStatus;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The signals ignored when `redmutex` started (bit N-1 for signal N),
/// read before the Rust runtime's own setup, which ignores SIGPIPE: a
/// service manager's `IgnoreSIGPIPE=yes` (systemd's default), `nohup`'s
/// SIGHUP, a script's background job's SIGINT and SIGQUIT.
static IGNORED_ON_ENTRY: AtomicU64 = AtomicU64::new(0);

/// Runs before `main` (and before the runtime's setup) from the ELF
/// initialisers.
#[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
#[used]
#[unsafe(link_section = ".init_array")]
static READ_DISPOSITIONS: extern "C" fn() = read_dispositions;

extern "C" fn read_dispositions() {
    let mut ignored = 0u64;
    for signal in 1..=LAST_SIGNAL {
        // SAFETY: reads a disposition into a zeroed struct; changes nothing.
        let is_ignored = unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(signal, std::ptr::null(), &mut old) == 0
                && old.sa_sigaction == libc::SIG_IGN
        };
        if is_ignored {
            ignored |= 1 << (signal - 1);
        }
    }
    IGNORED_ON_ENTRY.store(ignored, Ordering::SeqCst);
}

/// The highest signal number whose disposition is kept (the real-time
/// signals included).
const LAST_SIGNAL: i32 = 64;

/// Whether `signal` was ignored when `redmutex` started: such a signal is
/// left ignored, and not passed on, as a POSIX shell does, and the
/// command starts with it ignored.
pub(super) fn ignored_on_entry(signal: i32) -> bool {
    #[cfg(not(any(target_os = "linux", target_os = "android", target_os = "freebsd")))]
    {
        // No initialiser ran: read now (SIGPIPE then reads as the
        // runtime's, ignored, and is not trusted).
        static READ: std::sync::Once = std::sync::Once::new();
        READ.call_once(read_dispositions);
    }
    (1..=LAST_SIGNAL).contains(&signal)
        && IGNORED_ON_ENTRY.load(Ordering::SeqCst) & (1 << (signal - 1)) != 0
}

/// Between fork and exec of the command: every signal as `redmutex`
/// found it, ignored or default (a handler of `redmutex`'s, or the
/// runtime's ignored SIGPIPE, is not the command's). Async-signal-safe.
pub(super) fn restore_dispositions(ignored: u64) {
    for signal in 1..=LAST_SIGNAL {
        if signal == libc::SIGKILL || signal == libc::SIGSTOP {
            continue;
        }
        let action = if ignored & (1 << (signal - 1)) != 0 {
            libc::SIG_IGN
        } else {
            libc::SIG_DFL
        };
        // SAFETY: signal(2) is async-signal-safe; a number the kernel
        // does not know (or reserves) is refused, harmlessly.
        unsafe { libc::signal(signal, action) };
    }
}

/// The signals ignored on entry, as [`restore_dispositions`] takes them.
pub(super) fn entry_dispositions() -> u64 {
    // Forces the read on targets without the initialiser.
    let _ = ignored_on_entry(libc::SIGPIPE);
    IGNORED_ON_ENTRY.load(Ordering::SeqCst)
}

/// A process of its own that keeps the command from running without a
/// live lease when `redmutex` cannot: when `redmutex` is gone, however it
/// went (even `SIGKILL`, which no handler sees), it kills the command's
/// group and the processes it was told of; and it is a dead man's switch:
/// `redmutex` tells it the moment the lease runs out by the local clock
/// after every renewal, and past it (`redmutex` stopped by `SIGSTOP`, or
/// hung) it kills them too, or, while the job is stopped by job control,
/// keeps them stopped. The kernel's parent-death signal does not do it
/// alone: it is cleared when the command changes its user id (`gosu`,
/// `setpriv`, a setuid program). The watcher stays the invoking user, so
/// it may signal the command whenever the invoking user may (root may
/// signal anything; another user may not signal a command that became
/// someone else).
///
/// It learns of `redmutex`'s end by the end of a pipe only `redmutex`
/// holds (close-on-exec, so the command does not keep it open), and of
/// everything else by messages on it. It ignores the terminal's signals,
/// holds none of the caller's files, and is named `redmutex-watch` (so
/// `killall redmutex` leaves it be).
pub(super) struct Watcher {
    pipe: Option<OwnedFd>,
    pid: libc::pid_t,
    /// A message could not be sent: the watcher is gone.
    failed: std::cell::Cell<bool>,
}

/// Kill this process group (the command's) when the time comes; 0: none
/// (the command was reaped: its number may name another group).
const GROUP: u8 = b'G';
/// Kill this process too (one that left the command's group), named by
/// its pid and start time.
const PROCESS: u8 = b'P';
/// Forget that process (it is gone).
const FORGET: u8 = b'F';
/// The lease runs out then (monotonic nanoseconds; 0: no deadline).
const DEADLINE: u8 = b'L';
/// The job is stopped by job control: past the deadline, keep it
/// stopped rather than kill it (it may be taken again on `fg`).
const STOPPED: u8 = b'S';
/// The job runs again.
const RESUMED: u8 = b'R';
/// `redmutex` is done: leave without killing anything.
const DONE: u8 = b'D';

/// A tag and two numbers.
const MESSAGE: usize = 17;

/// The monotonic clock in nanoseconds: the same in every process of the
/// machine, so a deadline crosses the pipe as a number.
// `time_t` and `c_long` are i32 on some targets.
#[allow(clippy::useless_conversion)]
pub(super) fn monotonic_ns() -> i64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    i64::from(now.tv_sec)
        .saturating_mul(1_000_000_000)
        .saturating_add(i64::from(now.tv_nsec))
}

impl Watcher {
    /// Forks the watcher. Must run before `redmutex` starts any thread (a
    /// fork copies only the calling thread, and a lock another thread held
    /// would stay locked in the child); the child, a copy of a process of
    /// one thread, may then do anything. `None` where it cannot be
    /// started: the parent-death signal still covers a command that keeps
    /// its user.
    pub(super) fn start() -> Option<Watcher> {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: a pipe into a two-element array.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return None;
        }
        let [read, write] = fds;
        // SAFETY: no other thread exists yet (see above); the child runs
        // `watch`, which never returns.
        match unsafe { libc::fork() } {
            -1 => {
                // SAFETY: our own two descriptors.
                unsafe {
                    libc::close(read);
                    libc::close(write);
                }
                None
            }
            0 => {
                // SAFETY: the child's copy of the write end.
                unsafe { libc::close(write) };
                watch(read)
            }
            pid => {
                // SAFETY: the parent's copy of the read end; the write end
                // is ours alone from here on.
                unsafe { libc::close(read) };
                Some(Watcher {
                    pipe: Some(unsafe { OwnedFd::from_raw_fd(write) }),
                    pid,
                    failed: std::cell::Cell::new(false),
                })
            }
        }
    }

    pub(super) fn pid(&self) -> libc::pid_t {
        self.pid
    }

    /// The write end of the pipe: the command, between fork and exec,
    /// names its own group on it (so no window is left where `redmutex`
    /// could die with the command unguarded).
    pub(super) fn fd(&self) -> Option<RawFd> {
        self.pipe.as_ref().map(std::os::fd::AsRawFd::as_raw_fd)
    }

    fn send(&self, tag: u8, a: i64, b: i64) {
        if let Some(fd) = self.fd()
            && write_all(fd, &message(tag, a, b)).is_err()
        {
            self.failed.set(true);
        }
    }

    /// Whether a message could not be sent (the watcher was killed).
    pub(super) fn failed(&self) -> bool {
        self.failed.get()
    }

    /// The command was reaped: its group's number is no longer its own.
    pub(super) fn forget_group(&self) {
        self.send(GROUP, 0, 0);
    }

    /// Kill this process too (one that left the command's group).
    pub(super) fn guard_process(&self, process: &Tracked) {
        self.send(PROCESS, i64::from(process.pid), process.start);
    }

    /// That process is gone: not to be signalled any more.
    pub(super) fn forget_process(&self, pid: libc::pid_t) {
        self.send(FORGET, i64::from(pid), 0);
    }

    /// The lease runs out at `deadline` (see [`monotonic_ns`]); 0: no
    /// deadline.
    pub(super) fn deadline(&self, deadline: i64) {
        self.send(DEADLINE, deadline, 0);
    }

    /// The job is stopped by job control, or runs again.
    pub(super) fn stopped(&self, stopped: bool) {
        self.send(if stopped { STOPPED } else { RESUMED }, 0, 0);
    }

    /// `redmutex` is done: the watcher ends without killing anything.
    /// Only from the paths that end well: an unwinding panic closes the
    /// pipe without it, and the watcher kills the command.
    pub(super) fn done(&mut self) {
        if self.pipe.is_some() {
            self.send(DONE, 0, 0);
            self.pipe = None;
            let mut status = 0;
            // SAFETY: reaps our own child, which exits on `DONE` at once.
            unsafe { libc::waitpid(self.pid, &mut status, 0) };
        }
    }
}

/// A message to the watcher: a tag and two numbers.
fn message(tag: u8, a: i64, b: i64) -> [u8; MESSAGE] {
    let mut message = [0u8; MESSAGE];
    message[0] = tag;
    message[1..9].copy_from_slice(&a.to_le_bytes());
    message[9..].copy_from_slice(&b.to_le_bytes());
    message
}

/// The message the command sends from `pre_exec`: its own group.
pub(super) fn group_message(pgid: libc::pid_t) -> [u8; MESSAGE] {
    message(GROUP, i64::from(pgid), 0)
}

/// Writes all of `bytes` (async-signal-safe: the command's `pre_exec`
/// uses it).
pub(super) fn write_all(fd: RawFd, mut bytes: &[u8]) -> Result<(), ()> {
    while !bytes.is_empty() {
        // SAFETY: writes from a live buffer of that length.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(());
        }
        let n = usize::try_from(n).map_err(|_| ())?;
        bytes = bytes.get(n..).ok_or(())?;
    }
    Ok(())
}

fn read_exact(fd: RawFd, buf: &mut [u8]) -> Result<(), ()> {
    let mut read = 0;
    while read < buf.len() {
        let rest = buf.get_mut(read..).ok_or(())?;
        // SAFETY: reads into a live buffer of that length.
        let n = unsafe { libc::read(fd, rest.as_mut_ptr().cast(), rest.len()) };
        match n {
            0 => return Err(()),
            n if n < 0 => {
                if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                    return Err(());
                }
            }
            n => read += usize::try_from(n).map_err(|_| ())?,
        }
    }
    Ok(())
}

/// What `/proc/PID/stat` says of a process (Linux).
pub(super) struct Stat {
    pub(super) state: char,
    pub(super) parent: libc::pid_t,
    pub(super) group: libc::pid_t,
    /// When it started (clock ticks since boot): with the pid, a name no
    /// later process can have.
    pub(super) start: i64,
}

pub(super) fn stat(pid: libc::pid_t) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&text)
}

fn parse_stat(text: &str) -> Option<Stat> {
    // The name is in parentheses and may hold anything: the fields after
    // the last `)` start with the third (the state).
    let fields: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
    Some(Stat {
        state: fields.first()?.chars().next()?,
        parent: fields.get(1)?.parse().ok()?,
        group: fields.get(2)?.parse().ok()?,
        start: fields.get(19)?.parse().ok()?,
    })
}

/// A process followed by pid and start time, with a pidfd where the
/// kernel gives one (Linux 5.3+): a signal through it, or after checking
/// the start time again, never reaches a later process that got its
/// number.
pub(super) struct Tracked {
    pub(super) pid: libc::pid_t,
    start: i64,
    pidfd: Option<OwnedFd>,
}

impl Tracked {
    /// `None` when the process is gone, or its number is another
    /// process's already.
    pub(super) fn open(pid: libc::pid_t, start: i64) -> Option<Tracked> {
        let pidfd = match pidfd_open(pid) {
            Ok(fd) => Some(fd),
            Err(err) if err.raw_os_error() == Some(libc::ESRCH) => return None,
            // No pidfds (an old kernel), or no descriptor left: the start
            // time is checked before every signal instead.
            Err(_) => None,
        };
        // Checked after the pidfd is open: it names that process for good.
        if stat(pid)?.start != start {
            return None;
        }
        Some(Tracked { pid, start, pidfd })
    }

    /// When it started (clock ticks since boot).
    pub(super) fn start(&self) -> i64 {
        self.start
    }

    pub(super) fn signal(&self, signal: i32) {
        #[cfg(target_os = "linux")]
        if let Some(pidfd) = &self.pidfd {
            // SAFETY: pidfd_send_signal with no siginfo and no flags; a
            // process gone since gets ESRCH, never another one.
            unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    std::os::fd::AsRawFd::as_raw_fd(pidfd),
                    signal,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                );
            }
            return;
        }
        if stat(self.pid).is_some_and(|s| s.start == self.start) {
            // SAFETY: kill(2) of the process just checked to be the one
            // named (the window until the signal is a few microseconds).
            unsafe { libc::kill(self.pid, signal) };
        }
    }
}

fn pidfd_open(pid: libc::pid_t) -> std::io::Result<OwnedFd> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: the pidfd_open system call with no flags; a descriptor
        // it returns is ours.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = RawFd::try_from(fd).map_err(|_| std::io::Error::from_raw_os_error(libc::EBADF))?;
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = pid;
        Err(std::io::Error::from_raw_os_error(libc::ENOSYS))
    }
}

/// How often a stopped job past its deadline is stopped again.
const RESTOP: i64 = 100_000_000;

/// What the watcher knows and does (see [`Watcher`]).
#[derive(Default)]
struct Guard {
    group: libc::pid_t,
    watched: Vec<Tracked>,
}

impl Guard {
    /// Every process named, with `signal`.
    fn signal(&self, signal: i32) {
        if self.group > 0 {
            // SAFETY: kill(2) of the group `redmutex` named, while its
            // leader is not reaped (`redmutex` says 0 before it reaps it);
            // a group already empty gets ESRCH.
            unsafe { libc::kill(-self.group, signal) };
        }
        for process in &self.watched {
            process.signal(signal);
        }
    }

    fn is_empty(&self) -> bool {
        self.group <= 0 && self.watched.is_empty()
    }
}

/// The watcher's whole life (see [`Watcher`]).
fn watch(read: RawFd) -> ! {
    // SAFETY: calls on this process's own state.
    unsafe {
        // Its own group: the terminal's ^C and ^Z are not for it.
        libc::setpgid(0, 0);
        for signal in [
            libc::SIGHUP,
            libc::SIGINT,
            libc::SIGQUIT,
            libc::SIGTERM,
            libc::SIGTSTP,
            libc::SIGTTIN,
            libc::SIGTTOU,
            libc::SIGPIPE,
            libc::SIGUSR1,
            libc::SIGUSR2,
            libc::SIGALRM,
        ] {
            libc::signal(signal, libc::SIG_IGN);
        }
        #[cfg(target_os = "linux")]
        libc::prctl(libc::PR_SET_NAME, c"redmutex-watch".as_ptr());
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            libc::dup2(null, 0);
            libc::dup2(null, 1);
            libc::dup2(null, 2);
            if null > 2 {
                libc::close(null);
            }
        }
    }
    let mut guard = Guard::default();
    let mut deadline: i64 = 0;
    let mut stopped = false;
    let mut message = [0u8; MESSAGE];
    loop {
        // Until the next message, or the deadline (while there is anything
        // to act on: a deadline passed before the group is named is acted
        // on once it is).
        let timeout = if deadline == 0 || guard.is_empty() {
            -1
        } else {
            let left_ms = deadline.saturating_sub(monotonic_ns()) / 1_000_000;
            i32::try_from(left_ms.max(0)).unwrap_or(i32::MAX)
        };
        let mut poll = libc::pollfd {
            fd: read,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polls one descriptor of ours.
        let ready = unsafe { libc::poll(&mut poll, 1, timeout) };
        if ready == 0 {
            // The lease ran out by the local clock and `redmutex` did not
            // move the deadline: it is stopped or hung. A job stopped by
            // job control is kept stopped (`fg` decides); anything else is
            // killed.
            if stopped {
                guard.signal(libc::SIGSTOP);
                deadline = monotonic_ns().saturating_add(RESTOP);
            } else {
                guard.signal(libc::SIGKILL);
                deadline = 0;
            }
            continue;
        }
        if ready < 0 {
            continue; // EINTR
        }
        if read_exact(read, &mut message).is_err() {
            break;
        }
        let mut a = [0u8; 8];
        a.copy_from_slice(&message[1..9]);
        let a = i64::from_le_bytes(a);
        let mut b = [0u8; 8];
        b.copy_from_slice(&message[9..]);
        let b = i64::from_le_bytes(b);
        let pid = libc::pid_t::try_from(a).unwrap_or(0);
        match message[0] {
            GROUP => guard.group = pid,
            PROCESS if pid > 0 && !guard.watched.iter().any(|p| p.pid == pid) => {
                if let Some(process) = Tracked::open(pid, b) {
                    guard.watched.push(process);
                }
            }
            FORGET => guard.watched.retain(|p| p.pid != pid),
            DEADLINE => deadline = a,
            STOPPED => stopped = true,
            RESUMED => stopped = false,
            // SAFETY: ends this process at once.
            DONE => unsafe { libc::_exit(0) },
            _ => {}
        }
    }
    // The pipe ended without `DONE`: `redmutex` is gone.
    guard.signal(libc::SIGKILL);
    // SAFETY: ends this process.
    unsafe { libc::_exit(0) }
}

/// The job-control signals `redmutex` received: a stop to pass on to its
/// whole job (its number), and a SIGCONT.
static STOP: AtomicI32 = AtomicI32::new(0);
static CONTINUED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop(signal: libc::c_int) {
    // Async-signal-safe: one atomic store.
    STOP.store(signal, Ordering::SeqCst);
}

extern "C" fn on_continue(_: libc::c_int) {
    CONTINUED.store(true, Ordering::SeqCst);
}

fn set_handler(signal: i32, handler: extern "C" fn(libc::c_int)) {
    // SAFETY: installs a handler that only stores to an atomic.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = handler as usize;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(signal, &action, std::ptr::null_mut());
    }
}

/// Job control for `redmutex run`: a ^Z (SIGTSTP), or a background read
/// of the terminal (SIGTTIN), stops the command and then `redmutex`'s own
/// group, so the shell sees its job stopped and gets its prompt back; a
/// SIGCONT (`fg`, `bg`) resumes `redmutex`, which checks the lease before
/// it lets the command run again.
pub(super) struct JobControl;

impl JobControl {
    /// Catches SIGTSTP and SIGTTIN (unless ignored on entry: job control
    /// is then off, as for any program) and SIGCONT.
    pub(super) fn install() -> JobControl {
        for signal in [libc::SIGTSTP, libc::SIGTTIN] {
            if !ignored_on_entry(signal) {
                set_handler(signal, on_stop);
            }
        }
        set_handler(libc::SIGCONT, on_continue);
        JobControl
    }

    /// A stop `redmutex` itself received (the terminal's ^Z while the
    /// command does not have the terminal, a `kill -TSTP`).
    pub(super) fn stop_asked(&self) -> Option<i32> {
        match STOP.swap(0, Ordering::SeqCst) {
            0 => None,
            signal => Some(signal),
        }
    }

    /// A SIGCONT since the last call.
    pub(super) fn continued(&self) -> bool {
        CONTINUED.swap(false, Ordering::SeqCst)
    }

    /// A SIGCONT came that [`JobControl::continued`] has not reported yet.
    pub(super) fn continue_pending(&self) -> bool {
        CONTINUED.load(Ordering::SeqCst)
    }

    /// Stops `redmutex`'s own process group (the shell's job: `redmutex`,
    /// and a script that runs it) with `signal`, as its default action
    /// would, and returns once continued. In an orphaned group the kernel
    /// drops the signal, as for any job, and this returns at once.
    ///
    /// Returns whether a SIGCONT ended the stop; `false` when the kernel
    /// dropped the signal (an orphaned group): the job is not continued
    /// then, and waits for a SIGCONT like a stopped one.
    pub(super) fn stop_job(&self, signal: i32) -> bool {
        STOP.store(0, Ordering::SeqCst);
        CONTINUED.store(false, Ordering::SeqCst);
        // SAFETY: the default action for the signal while it is sent to our
        // own group, then the disposition found before (our handler, or
        // SIGTTOU's SIG_IGN while the command has the terminal).
        let continued = unsafe {
            let mut default: libc::sigaction = std::mem::zeroed();
            default.sa_sigaction = libc::SIG_DFL;
            libc::sigemptyset(&mut default.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(signal, &default, &mut old);
            libc::kill(0, signal);
            // Stopped here until continued (its handler sets the flag).
            // Both the stop and the SIGCONT's handler run on this thread
            // before kill(2) returns: every other thread blocks them (the
            // crate starts its threads with signals blocked; the spinner
            // ended before the command started). Were the SIGCONT taken
            // by another thread, this one could read the flag before the
            // handler set it, and take a stop for a dropped one.
            let continued = CONTINUED.swap(false, Ordering::SeqCst);
            libc::sigaction(signal, &old, std::ptr::null_mut());
            continued
        };
        STOP.store(0, Ordering::SeqCst);
        continued
    }
}

/// What became of the command's process.
pub(super) enum Child {
    Running,
    /// Stopped by this signal (the stop consumed: reported once).
    Stopped(i32),
    /// Exited, not reaped yet: until [`reap`], its pid, and so its process
    /// group's number, cannot be given to another process, and signals
    /// sent to the group cannot reach a stranger.
    Exited,
}

/// Whether the command (process `pid`) exited or stopped, without
/// waiting and without reaping it.
///
/// # Errors
///
/// `waitid`'s, other than an interrupt.
pub(super) fn poll(pid: libc::pid_t) -> std::io::Result<Child> {
    let Ok(id) = libc::id_t::try_from(pid) else {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    };
    // An exit, left for `reap`.
    if let Some(info) = wait_info(id, libc::WEXITED | libc::WNOWAIT)? {
        let _ = info;
        return Ok(Child::Exited);
    }
    // A stop, consumed (it does not reap an exit). A child that exited
    // since the first call has no stop to report: ECHILD.
    Ok(match wait_info(id, libc::WSTOPPED) {
        // SAFETY: the kernel filled `si_status` for a stopped child.
        Ok(Some(info)) => Child::Stopped(unsafe { info.si_status() }),
        Ok(None) => Child::Running,
        Err(err) if err.raw_os_error() == Some(libc::ECHILD) => Child::Exited,
        Err(err) => return Err(err),
    })
}

/// `waitid(P_PID, id, flags | WNOHANG)`: the child's state change, if any.
fn wait_info(id: libc::id_t, flags: i32) -> std::io::Result<Option<libc::siginfo_t>> {
    loop {
        // SAFETY: a zeroed siginfo the kernel fills; si_pid stays 0 when
        // nothing changed.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let rc = unsafe { libc::waitid(libc::P_PID, id, &mut info, flags | libc::WNOHANG) };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        // SAFETY: si_pid is set by waitid when a child changed state.
        return Ok((unsafe { info.si_pid() } != 0).then_some(info));
    }
}

/// Reaps the command (after it exited, and after every signal to its
/// group is sent) and returns how it ended.
///
/// # Errors
///
/// `waitpid`'s, other than an interrupt.
pub(super) fn reap(pid: libc::pid_t) -> std::io::Result<ExitStatus> {
    use std::os::unix::process::ExitStatusExt;
    loop {
        let mut status = 0;
        // SAFETY: waits for our own child.
        let got = unsafe { libc::waitpid(pid, &mut status, 0) };
        if got < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        return Ok(ExitStatus::from_raw(status));
    }
}

/// Stops the command's group: SIGTSTP (an interactive command puts the
/// terminal back first), then SIGSTOP if its leader has not stopped
/// within 300 ms (a command that ignores SIGTSTP must not run on while its
/// renewals are stopped). `Ok(true)` when it exited meanwhile.
pub(super) fn stop_group(pgid: libc::pid_t, pid: libc::pid_t) -> std::io::Result<bool> {
    if stat(pid).is_some_and(|s| s.state == 'T') {
        // Stopped already (its stop reported before): the rest of the
        // group too, and nothing to wait for.
        // SAFETY: kill(2) of the group of a child we spawned as its leader.
        unsafe { libc::kill(-pgid, libc::SIGSTOP) };
        return Ok(false);
    }
    for (signal, within) in [
        (libc::SIGTSTP, Duration::from_millis(300)),
        (libc::SIGSTOP, Duration::from_secs(2)),
    ] {
        // SAFETY: kill(2) of the group of a child we spawned as its leader.
        unsafe { libc::kill(-pgid, signal) };
        let until = Instant::now() + within;
        while Instant::now() < until {
            match poll(pid)? {
                Child::Stopped(_) => return Ok(false),
                Child::Exited => return Ok(true),
                Child::Running => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }
    Ok(false)
}

/// Makes `redmutex` the parent of every orphaned descendant (Linux): a
/// daemon that forks away and exits its parent stays its child, and so
/// is seen and can be ended.
pub(super) fn become_subreaper() -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sets a flag of this process.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// The descendants of this process (Linux, from `/proc`), but `except`
/// (the watcher; what it started is looked through all the same).
pub(super) struct Descendants {
    /// Running (or stopped): pid, start time, process group and state
    /// (`T` stopped).
    pub(super) alive: Vec<(libc::pid_t, i64, libc::pid_t, char)>,
    /// Exited children of ours, handed to us as their subreaper, to reap.
    zombies: Vec<libc::pid_t>,
}

impl Descendants {
    pub(super) fn scan(except: &[libc::pid_t]) -> Descendants {
        let me = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
        let mut found = Descendants {
            alive: Vec::new(),
            zombies: Vec::new(),
        };
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return found;
        };
        // Every process we can read, by parent.
        let mut children: std::collections::HashMap<libc::pid_t, Vec<(libc::pid_t, Stat)>> =
            std::collections::HashMap::new();
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|name| name.parse::<libc::pid_t>().ok())
            else {
                continue;
            };
            if let Some(stat) = stat(pid) {
                children.entry(stat.parent).or_default().push((pid, stat));
            }
        }
        let mut frontier = vec![me];
        // Bounded: every pid is looked at once (a parent's entry is taken).
        while let Some(parent) = frontier.pop() {
            for (pid, stat) in children.remove(&parent).unwrap_or_default() {
                frontier.push(pid);
                if except.contains(&pid) {
                    continue;
                }
                if stat.state == 'Z' {
                    if parent == me {
                        found.zombies.push(pid);
                    }
                } else {
                    found.alive.push((pid, stat.start, stat.group, stat.state));
                }
            }
        }
        found
    }

    /// Reaps the exited children found (handed to us as their subreaper).
    pub(super) fn reap(&self) {
        for pid in &self.zombies {
            let mut status = 0;
            // SAFETY: reaps `pid`, an exited child of ours.
            unsafe { libc::waitpid(*pid, &mut status, libc::WNOHANG) };
        }
    }
}
