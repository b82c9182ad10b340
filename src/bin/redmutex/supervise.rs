//! What keeps `redmutex run`'s command from running without a live lease,
//! whatever happens to `redmutex`: a watcher process that kills the
//! command's group (and the daemons it was told of) when `redmutex` dies,
//! by any signal, even when the command changed its user id; job control
//! (the command stopped and resumed with its shell job, its lease checked
//! before it runs again); signals ignored on entry left ignored; and the
//! processes a daemonizing command leaves behind.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::process::ExitStatus;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::{Duration, Instant};

/// Whether `signal` was ignored when `redmutex` started (`nohup` ignores
/// SIGHUP; a shell without job control starts background commands with
/// SIGINT and SIGQUIT ignored): such a signal is left ignored, and not
/// passed on, as a POSIX shell does.
pub(super) fn ignored_on_entry(signal: i32) -> bool {
    // SAFETY: reads the disposition into a zeroed struct; changes nothing.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(signal, std::ptr::null(), &mut old) == 0
            && old.sa_sigaction == libc::SIG_IGN
    }
}

/// A process of its own that outlives `redmutex` to kill the command's
/// group the moment `redmutex` is gone, however it went (even `SIGKILL`,
/// which no handler sees). The kernel's parent-death signal does not do
/// it alone: it is cleared when the command changes its user id (`gosu`,
/// `setpriv`, a setuid program). The watcher stays the invoking user, so
/// it may signal the command whenever the invoking user may (root may
/// signal anything; another user may not signal a command that became
/// someone else: the one limit, and the kernel's).
///
/// It learns of `redmutex`'s end by the end of a pipe only `redmutex`
/// holds (close-on-exec, so the command does not keep it open), and of
/// what to kill by messages on it. It ignores the terminal's signals and
/// holds none of the caller's files.
pub(super) struct Watcher {
    pipe: Option<OwnedFd>,
    pid: libc::pid_t,
}

const GROUP: u8 = b'G';
const PROCESS: u8 = b'P';
const DONE: u8 = b'D';

impl Watcher {
    /// Forks the watcher. Must run before `redmutex` starts any thread (a
    /// fork copies only the calling thread); the child then uses only
    /// async-signal-safe calls. `None` where it cannot be started: the
    /// parent-death signal still covers a command that keeps its user.
    pub(super) fn start() -> Option<Watcher> {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: a pipe into a two-element array.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return None;
        }
        let [read, write] = fds;
        // SAFETY: no other thread exists yet (see above); the child runs
        // `watch`, which only makes system calls, and never returns.
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
                })
            }
        }
    }

    pub(super) fn pid(&self) -> libc::pid_t {
        self.pid
    }

    fn send(&self, tag: u8, value: i32) {
        let Some(pipe) = &self.pipe else {
            return;
        };
        let mut message = [0u8; 5];
        message[0] = tag;
        message[1..].copy_from_slice(&value.to_le_bytes());
        let _ = write_all(std::os::fd::AsRawFd::as_raw_fd(pipe), &message);
    }

    /// Kill this process group if `redmutex` dies.
    pub(super) fn guard_group(&self, pgid: libc::pid_t) {
        self.send(GROUP, pgid);
    }

    /// Kill this process too (one that left the command's group: a
    /// daemon).
    pub(super) fn guard_process(&self, pid: libc::pid_t) {
        self.send(PROCESS, pid);
    }

    /// `redmutex` is done: the watcher ends without killing anything.
    pub(super) fn done(&mut self) {
        if self.pipe.is_some() {
            self.send(DONE, 0);
            self.pipe = None;
            let mut status = 0;
            // SAFETY: reaps our own child, which exits on `DONE` at once.
            unsafe { libc::waitpid(self.pid, &mut status, 0) };
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.done();
    }
}

fn write_all(fd: RawFd, mut bytes: &[u8]) -> Result<(), ()> {
    while !bytes.is_empty() {
        // SAFETY: writes from a live buffer of that length.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(());
        }
        bytes = bytes.get(usize::try_from(n).unwrap_or(0)..).unwrap_or(&[]);
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes; `Err` at the end of the pipe.
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
            n => read += usize::try_from(n).unwrap_or(0),
        }
    }
    Ok(())
}

/// The most processes outside the command's group the watcher keeps.
const MAX_WATCHED: usize = 256;

/// The watcher's whole life (see [`Watcher`]).
fn watch(read: RawFd) -> ! {
    // SAFETY: async-signal-safe calls only, in a process of one thread.
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
        ] {
            libc::signal(signal, libc::SIG_IGN);
        }
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
    let mut group: libc::pid_t = 0;
    let mut watched = [(0 as libc::pid_t, -1 as RawFd); MAX_WATCHED];
    let mut count = 0;
    let mut message = [0u8; 5];
    while read_exact(read, &mut message).is_ok() {
        let value = i32::from_le_bytes([message[1], message[2], message[3], message[4]]);
        match message[0] {
            GROUP => group = value,
            PROCESS if count < MAX_WATCHED => {
                watched[count] = (value, pidfd_open(value));
                count += 1;
            }
            // SAFETY: ends this process at once.
            DONE => unsafe { libc::_exit(0) },
            _ => {}
        }
    }
    // The pipe ended without `DONE`: `redmutex` is gone.
    // SAFETY: kill(2) of what `redmutex` named; a group or process already
    // gone gets ESRCH.
    unsafe {
        if group > 0 {
            libc::kill(-group, libc::SIGKILL);
        }
        for (pid, pidfd) in watched.iter().take(count) {
            if !pidfd_kill(*pidfd) && *pid > 0 {
                libc::kill(*pid, libc::SIGKILL);
            }
        }
        libc::_exit(0)
    }
}

/// A handle on `pid` that its number's reuse cannot fool (Linux 5.3+),
/// or -1.
fn pidfd_open(pid: libc::pid_t) -> RawFd {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: the pidfd_open system call with no flags.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        RawFd::try_from(fd).unwrap_or(-1)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = pid;
        -1
    }
}

/// SIGKILL through a pidfd; false when there is none or it failed.
fn pidfd_kill(pidfd: RawFd) -> bool {
    if pidfd < 0 {
        return false;
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: pidfd_send_signal with no siginfo and no flags.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                pidfd,
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            ) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
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

    /// Stops `redmutex`'s own process group (the shell's job: `redmutex`,
    /// and a script that runs it) with `signal`, as its default action
    /// would, and returns once continued. In an orphaned group the kernel
    /// drops the signal, as for any job, and this returns at once.
    pub(super) fn stop_job(&self, signal: i32) {
        // SAFETY: the default action for the signal while it is sent to our
        // own group, then the disposition found before (our handler, or
        // SIGTTOU's SIG_IGN while the command has the terminal).
        unsafe {
            let mut default: libc::sigaction = std::mem::zeroed();
            default.sa_sigaction = libc::SIG_DFL;
            libc::sigemptyset(&mut default.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(signal, &default, &mut old);
            libc::kill(0, signal);
            libc::sigaction(signal, &old, std::ptr::null_mut());
        }
        // This SIGCONT is the one that ended this stop.
        CONTINUED.store(false, Ordering::SeqCst);
        STOP.store(0, Ordering::SeqCst);
    }
}

/// What became of the command's process.
pub(super) enum Child {
    Running,
    Stopped(i32),
    Exited(ExitStatus),
}

/// Whether the command (process `pid`) exited or stopped, without
/// waiting.
///
/// # Errors
///
/// `waitpid`'s, other than an interrupt.
pub(super) fn poll(pid: libc::pid_t) -> std::io::Result<Child> {
    use std::os::unix::process::ExitStatusExt;
    loop {
        let mut status = 0;
        // SAFETY: waits for our own child, without blocking.
        let got = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG | libc::WUNTRACED) };
        if got == 0 {
            return Ok(Child::Running);
        }
        if got < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        return Ok(if libc::WIFSTOPPED(status) {
            Child::Stopped(libc::WSTOPSIG(status))
        } else {
            Child::Exited(ExitStatus::from_raw(status))
        });
    }
}

/// Stops the command's group: SIGTSTP (an interactive command puts the
/// terminal back first), then SIGSTOP if its leader has not stopped
/// within 300 ms (a command that ignores SIGTSTP must not run on while its
/// renewals are stopped). `Ok(Some(status))` when it exited meanwhile.
pub(super) fn stop_group(
    pgid: libc::pid_t,
    pid: libc::pid_t,
) -> std::io::Result<Option<ExitStatus>> {
    for (signal, within) in [
        (libc::SIGTSTP, Duration::from_millis(300)),
        (libc::SIGSTOP, Duration::from_secs(2)),
    ] {
        // SAFETY: kill(2) of the group of a child we spawned as its leader.
        unsafe { libc::kill(-pgid, signal) };
        let until = Instant::now() + within;
        while Instant::now() < until {
            match poll(pid)? {
                Child::Stopped(_) => return Ok(None),
                Child::Exited(status) => return Ok(Some(status)),
                Child::Running => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }
    Ok(None)
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

/// Every descendant of this process but `except` (the watcher), from
/// `/proc` (Linux).
pub(super) fn descendants(except: Option<libc::pid_t>) -> Vec<libc::pid_t> {
    let me = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    // (pid, parent) of every process we can read.
    let parents: Vec<(libc::pid_t, libc::pid_t)> = entries
        .flatten()
        .filter_map(|entry| {
            let pid: libc::pid_t = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            // The name is in parentheses and may hold anything: after the
            // last `)` come the state and the parent's pid.
            let after = stat.rsplit_once(')')?.1;
            let parent = after.split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, parent))
        })
        .collect();
    let mut found = Vec::new();
    let mut frontier = vec![me];
    while let Some(parent) = frontier.pop() {
        for (pid, of) in &parents {
            if *of == parent && Some(*pid) != except && !found.contains(pid) {
                found.push(*pid);
                frontier.push(*pid);
            }
        }
    }
    found
}

/// Reaps the descendants that exited and were handed to this process as
/// their subreaper (never `except`, the watcher, whose end is reaped
/// where it is awaited).
pub(super) fn reap_orphans(except: Option<libc::pid_t>) {
    for pid in descendants(except) {
        let mut status = 0;
        // SAFETY: reaps `pid` if it is our child and has exited; any other
        // gets ECHILD or 0, changing nothing.
        unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    }
}
