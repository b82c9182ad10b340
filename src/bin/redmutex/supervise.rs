//! What keeps `redmutex run`'s command, and every process it starts, from
//! running without a live lease, whatever happens to `redmutex`.
//!
//! Three processes share the work (Linux; see docs/cli.md):
//!
//! * `redmutex` itself, in the caller's process group (the shell's job),
//!   is a *child subreaper*: every descendant it has stays its
//!   descendant, orphans included, so a walk of `/proc` from it finds
//!   them all; it signals them by that walk at the moment it acts,
//!   never from a list made earlier.
//! * the *reaper* (`redmutex-reap`, see `reaper.rs`), its child in the
//!   same process group and the command's parent, is a subreaper too: if
//!   `redmutex` dies, however it dies, the tree below the reaper is
//!   intact, and the reaper kills it. The command runs in the caller's
//!   process group, as under flock(1): a pipeline into a pager, ^Z and
//!   `fg` in a shell, and ^Z where no shell does job control (`ssh -t`,
//!   `docker run -it`) behave as they do without `redmutex`.
//! * the *watcher* (`redmutex-watch`), forked first, in a process group
//!   of its own so that nothing sent to the job stops it: a dead man's
//!   switch. `redmutex` tells it when the lease runs out after every
//!   renewal; past that moment (`redmutex` stopped with its job, by
//!   SIGSTOP, or hung) it kills everything below `redmutex` and the
//!   reaper.
//!
//! A process that changed its user may be beyond the signals of a
//! `redmutex` that is not root: the kernel forbids them.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::time::Duration;

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

/// A process found below a root.
pub(super) struct Found {
    pub(super) pid: libc::pid_t,
    pub(super) start: i64,
    pub(super) group: libc::pid_t,
    pub(super) session: libc::pid_t,
    /// `T` stopped, `t` traced.
    pub(super) state: char,
}

/// The live descendants of `roots` (Linux, from `/proc`), `except` those
/// named (looked through all the same: what they started is found), and
/// the exited children of this process found on the way (zombies to reap,
/// `except` those named).
pub(super) fn descendants(
    roots: &[libc::pid_t],
    except: &[libc::pid_t],
) -> (Vec<Found>, Vec<libc::pid_t>) {
    let (alive, zombies, _) = walk(roots, except);
    (alive, zombies)
}

/// [`descendants`], and the exited ones (zombies) below `roots` too: a
/// process that forks and exits in a loop is seen more often dead than
/// alive, and its zombies still name its group and session.
fn walk(
    roots: &[libc::pid_t],
    except: &[libc::pid_t],
) -> (Vec<Found>, Vec<libc::pid_t>, Vec<Found>) {
    let me = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    let mut alive = Vec::new();
    let mut zombies = Vec::new();
    let mut dead = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return (alive, zombies, dead);
    };
    // Every process we can read, by parent.
    let mut children: std::collections::HashMap<libc::pid_t, Vec<(libc::pid_t, Stat)>> =
        std::collections::HashMap::new();
    for pid in pids(entries) {
        if let Some(stat) = stat(pid) {
            children.entry(stat.parent).or_default().push((pid, stat));
        }
    }
    let mut frontier: Vec<libc::pid_t> = roots.to_vec();
    // Bounded: every parent's entry is taken once.
    while let Some(parent) = frontier.pop() {
        for (pid, stat) in children.remove(&parent).unwrap_or_default() {
            frontier.push(pid);
            if except.contains(&pid) {
                continue;
            }
            if stat.state == 'Z' {
                if parent == me {
                    zombies.push(pid);
                }
                dead.push(Found {
                    pid,
                    start: stat.start,
                    group: stat.group,
                    session: stat.session,
                    state: stat.state,
                });
            } else {
                alive.push(Found {
                    pid,
                    start: stat.start,
                    group: stat.group,
                    session: stat.session,
                    state: stat.state,
                });
            }
        }
    }
    (alive, zombies, dead)
}

/// How many times a SIGKILL or SIGSTOP looks again for processes forked
/// meanwhile (see [`signal_tree`]): a look finds nothing new after one or
/// two in practice.
const CONVERGE_ROUNDS: usize = 2_000;

/// How many looks a SIGSTOP takes at most (see [`signal_tree`]).
const STOP_ROUNDS: usize = 100;

/// How long a SIGKILL keeps looking for what is left (see
/// [`signal_tree`]); twice that at most while new processes appear.
const CONVERGE_WITHIN: Duration = Duration::from_millis(500);

/// Sends `signal` to every live descendant of `roots` (but `except`, and
/// those `skip` leaves out), each by pidfd or after checking its start
/// time, so no signal reaches a later process that reused a number.
/// Returns how many were signalled.
///
/// A SIGKILL or SIGSTOP is repeated until a look finds nothing new: a
/// process signalled may have forked just before the signal landed, and
/// its child is found by the next look. Once such a signal is delivered
/// the process forks no more (the kernel refuses a fork with a fatal
/// signal pending; a stopped process runs nothing), so the looks end;
/// they are bounded all the same. A SIGSTOP is checked by state: one
/// that is not stopped yet is signalled again.
pub(super) fn signal_tree(
    roots: &[libc::pid_t],
    except: &[libc::pid_t],
    signal: i32,
    skip: &dyn Fn(&Found) -> bool,
) -> usize {
    let repeat = signal == libc::SIGKILL || signal == libc::SIGSTOP;
    let mut signalled: Vec<(libc::pid_t, i64)> = Vec::new();
    let until = std::time::Instant::now() + CONVERGE_WITHIN;
    // SAFETY: getsid only reads.
    let session = unsafe { libc::getsid(0) };
    for round in 0..CONVERGE_ROUNDS {
        let (alive, _, dead) = walk(roots, except);
        let mut new = 0;
        let mut left = 0;
        if repeat {
            // Whole groups at once where that reaches only ours: a process
            // that forks and exits in a loop (its pid never the same
            // twice) stays in its group, and a group's signal reaches
            // every member, a child forked meanwhile too (the kernel adds
            // it under the lock the signal takes). Every member of a
            // session other than this process's that holds a descendant
            // is a descendant: a session is joined only by a fork from it
            // or made by setsid(2), so its leader was one of ours.
            let mut groups: Vec<libc::pid_t> = alive
                .iter()
                .chain(&dead)
                .filter(|p| p.session != session && p.group > 1 && !skip(p))
                .map(|p| p.group)
                .collect();
            groups.sort_unstable();
            groups.dedup();
            for group in groups {
                // SAFETY: kill(2) of a process group in a session made
                // below `roots` (see above); its number cannot be reused
                // while a member lives.
                unsafe { libc::kill(-group, signal) };
            }
        }
        for found in alive {
            if skip(&found) {
                continue;
            }
            left += 1;
            let seen = signalled.contains(&(found.pid, found.start));
            let done = if signal == libc::SIGSTOP {
                matches!(found.state, 'T' | 't')
            } else {
                seen
            };
            if done {
                continue;
            }
            if let Some(process) = Tracked::open(found.pid, found.start) {
                process.signal(signal);
            }
            if !seen {
                signalled.push((found.pid, found.start));
            }
            new += 1;
        }
        if !repeat || left == 0 {
            break;
        }
        // A SIGKILL: until nothing is left (a process that outruns the
        // walks by forking is chased), within a bound; a process the
        // kernel cannot end yet (in an uninterruptible wait) ends when it
        // leaves it. A SIGSTOP: until nothing new is running.
        let now = std::time::Instant::now();
        let done = if signal == libc::SIGSTOP {
            // A process in an uninterruptible wait (a shell's `vfork`
            // parent) stops when it leaves it: not waited for long.
            new == 0 || round >= STOP_ROUNDS
        } else {
            (new == 0 && now >= until) || now >= until + CONVERGE_WITHIN
        };
        if done {
            break;
        }
        // A signal is delivered when its target next runs: a moment.
        std::thread::sleep(Duration::from_micros(200));
    }
    signalled.len()
}

/// Whether this process's group is orphaned, as the kernel judges it for
/// job control: no member has a parent in another group of the same
/// session. A terminal's ^Z to an orphaned group stops none of its
/// members (the kernel drops the signal): so it is for the command, and
/// so `redmutex` takes it, as flock(1) does (`ssh -t host redmutex run`,
/// `docker run -it`, `kubectl exec -it`).
pub(super) fn group_orphaned() -> bool {
    // SAFETY: getpgrp and getsid only read.
    let (group, session) = unsafe { (libc::getpgrp(), libc::getsid(0)) };
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    for pid in pids(entries) {
        let Some(member) = stat(pid).filter(|s| s.group == group) else {
            continue;
        };
        if stat(member.parent).is_some_and(|p| p.group != group && p.session == session) {
            return false;
        }
    }
    true
}

/// Points this process's standard input, output and error at /dev/null.
pub(super) fn null_stdio() {
    // SAFETY: dup2 of /dev/null over this process's own 0, 1 and 2.
    unsafe {
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
}

/// Closes every descriptor of this process above 2 but `keep`: a helper
/// process holds none of the caller's files (a pipeline's reader waits
/// for every writer to close).
pub(super) fn close_other_fds(keep: &[RawFd]) {
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    // Read whole first: the directory's own descriptor is among them.
    let fds: Vec<RawFd> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    for fd in fds {
        if fd > 2 && !keep.contains(&fd) {
            // SAFETY: closes a descriptor of this process nothing here
            // uses (the directory's own is closed already: EBADF).
            unsafe { libc::close(fd) };
        }
    }
}

/// The pids in a listing of `/proc` (its other entries left out).
fn pids(entries: std::fs::ReadDir) -> impl Iterator<Item = libc::pid_t> {
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
}

/// Makes this process the parent of every orphaned descendant (Linux): a
/// process whose parent exits stays below it, and so is found.
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

/// Names this process in `ps` and `/proc/PID/comm` (so `killall
/// redmutex` leaves it be).
pub(super) fn set_name(name: &std::ffi::CStr) {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_NAME with a NUL-terminated name (cut at 15 bytes).
    unsafe {
        libc::prctl(libc::PR_SET_NAME, name.as_ptr());
    }
    #[cfg(not(target_os = "linux"))]
    let _ = name;
}

/// The signals a helper process (the watcher, the reaper) ignores: those
/// of the terminal and of a service manager's stop are for the job, not
/// for it; its end is decided by its pipe.
pub(super) fn ignore_job_signals() {
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
        // SAFETY: signal(2) on this process's own dispositions.
        unsafe { libc::signal(signal, libc::SIG_IGN) };
    }
}

/// The watcher: a process of its own, in a process group of its own,
/// that kills everything below `redmutex` and the reaper when `redmutex`
/// cannot keep the lease: when `redmutex` is gone (however it went, even
/// `SIGKILL`), and past the lease's deadline by the local clock, which
/// `redmutex` tells it after every renewal (`redmutex` stopped by
/// SIGSTOP or with its job, or hung). The kernel's parent-death signal
/// does not do it alone: it is cleared when the command changes its user
/// id (`gosu`, `setpriv`, a setuid program). The watcher stays the
/// invoking user, so it may signal the command whenever the invoking user
/// may.
///
/// It learns of `redmutex`'s end by the end of a pipe only `redmutex`
/// holds (close-on-exec, so nothing it starts keeps it open), and of
/// everything else by messages on it. It ignores the terminal's signals,
/// holds none of the caller's files, and is named `redmutex-watch` (so
/// `killall redmutex` leaves it be).
pub(super) struct Watcher {
    pipe: Option<OwnedFd>,
    pid: libc::pid_t,
    /// A message could not be sent: the watcher is gone.
    failed: std::cell::Cell<bool>,
}

/// The reaper is this process (pid, start time): its tree is killed with
/// `redmutex`'s, and the reaper itself is left to end on its own.
const ROOT: u8 = b'R';
/// The lease runs out then (monotonic nanoseconds; 0: no deadline).
const DEADLINE: u8 = b'L';
/// `redmutex` is done: leave without killing anything.
const DONE: u8 = b'D';

/// A tag and two numbers.
pub(super) const MESSAGE: usize = 17;

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
    /// started.
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
                // is ours alone from here on, and never blocks: a watcher
                // that stops reading (stopped by a debugger, a `pkill -STOP
                // -f` that matched it) must not stop `redmutex` with it. A
                // message that finds the pipe full is not sent, and the
                // watcher counts as failed.
                unsafe {
                    libc::close(read);
                    let flags = libc::fcntl(write, libc::F_GETFL);
                    libc::fcntl(write, libc::F_SETFL, flags | libc::O_NONBLOCK);
                }
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

    fn send(&self, tag: u8, a: i64, b: i64) {
        if let Some(fd) = self.pipe.as_ref().map(std::os::fd::AsRawFd::as_raw_fd)
            && write_all(fd, &message(tag, a, b)).is_err()
        {
            self.failed.set(true);
        }
    }

    /// Whether a message could not be sent (the watcher was killed).
    pub(super) fn failed(&self) -> bool {
        // SAFETY: waitpid of our own child, without waiting and without
        // reaping (WNOWAIT): it only asks whether it exited.
        let exited = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            libc::waitid(
                libc::P_PID,
                libc::id_t::try_from(self.pid).unwrap_or(0),
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            ) == 0
                && info.si_pid() != 0
        };
        exited || self.failed.get()
    }

    /// The reaper, whose tree is killed with `redmutex`'s.
    pub(super) fn root(&self, pid: libc::pid_t, start: i64) {
        self.send(ROOT, i64::from(pid), start);
    }

    /// The lease runs out at `deadline` (see [`monotonic_ns`]); 0: no
    /// deadline.
    pub(super) fn deadline(&self, deadline: i64) {
        self.send(DEADLINE, deadline, 0);
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

/// A message between processes: a tag and two numbers.
pub(super) fn message(tag: u8, a: i64, b: i64) -> [u8; MESSAGE] {
    let mut message = [0u8; MESSAGE];
    message[0] = tag;
    message[1..9].copy_from_slice(&a.to_le_bytes());
    message[9..].copy_from_slice(&b.to_le_bytes());
    message
}

/// A message's tag and two numbers.
pub(super) fn parse_message(message: &[u8; MESSAGE]) -> (u8, i64, i64) {
    let mut a = [0u8; 8];
    a.copy_from_slice(&message[1..9]);
    let mut b = [0u8; 8];
    b.copy_from_slice(&message[9..]);
    (message[0], i64::from_le_bytes(a), i64::from_le_bytes(b))
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
    pub(super) session: libc::pid_t,
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
        session: fields.get(3)?.parse().ok()?,
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

    /// Whether it still runs (a zombie does not).
    pub(super) fn is_alive(&self) -> bool {
        if let Some(pidfd) = &self.pidfd {
            let mut poll = libc::pollfd {
                fd: std::os::fd::AsRawFd::as_raw_fd(pidfd),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: polls one descriptor of ours without waiting; a
            // pidfd is readable once its process exited.
            return unsafe { libc::poll(&mut poll, 1, 0) } == 0;
        }
        stat(self.pid).is_some_and(|s| s.start == self.start && s.state != 'Z')
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

pub(super) fn pidfd_open(pid: libc::pid_t) -> std::io::Result<OwnedFd> {
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

/// The watcher's whole life (see [`Watcher`]).
fn watch(read: RawFd) -> ! {
    // SAFETY: calls on this process's own state.
    let parent = unsafe {
        // Its own group: nothing sent to the job (^Z, a SIGSTOP to its
        // group) reaches it.
        libc::setpgid(0, 0);
        libc::getppid()
    };
    ignore_job_signals();
    set_name(c"redmutex-watch");
    // The caller's files are not the watcher's to keep open.
    null_stdio();
    close_other_fds(&[read]);
    let me = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    // `redmutex`, followed by pidfd: once gone its number is not looked
    // through.
    let redmutex = stat(parent).and_then(|s| Tracked::open(parent, s.start));
    let mut reaper: Option<Tracked> = None;
    let mut deadline: i64 = 0;
    let mut message = [0u8; MESSAGE];
    let kill_all = |reaper: &Option<Tracked>| {
        let mut roots = Vec::new();
        roots.extend(redmutex.as_ref().filter(|p| p.is_alive()).map(|p| p.pid));
        roots.extend(reaper.as_ref().filter(|p| p.is_alive()).map(|p| p.pid));
        let mut except = vec![me];
        except.extend(reaper.as_ref().map(|p| p.pid));
        signal_tree(&roots, &except, libc::SIGKILL, &|_| false);
    };
    loop {
        // Until the next message, or the deadline.
        let timeout = if deadline == 0 {
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
            // move the deadline: it is stopped (alone or with its job) or
            // hung. Nothing of the command's runs on.
            kill_all(&reaper);
            deadline = 0;
            continue;
        }
        if ready < 0 {
            continue; // EINTR
        }
        if read_exact(read, &mut message).is_err() {
            break;
        }
        let (tag, a, b) = parse_message(&message);
        match tag {
            ROOT => {
                reaper = libc::pid_t::try_from(a)
                    .ok()
                    .and_then(|pid| Tracked::open(pid, b));
            }
            DEADLINE => deadline = a,
            // SAFETY: ends this process at once.
            DONE => unsafe { libc::_exit(0) },
            _ => {}
        }
    }
    // The pipe ended without `DONE`: `redmutex` is gone.
    kill_all(&reaper);
    // SAFETY: ends this process.
    unsafe { libc::_exit(0) }
}
/// The job-control signals `redmutex` received: a stop to pass on to its
/// whole job (its number), whether the terminal sent it, and a SIGCONT.
static STOP: AtomicI32 = AtomicI32::new(0);
static STOP_FROM_TERMINAL: AtomicBool = AtomicBool::new(false);
static CONTINUED: AtomicBool = AtomicBool::new(false);

/// Whether a signal came from the terminal (the kernel, on a key or a
/// background read or write), and so went to the terminal's whole
/// foreground group at once, not from kill(2) to `redmutex` alone.
///
/// # Safety
///
/// `info` is the siginfo the kernel passed to an SA_SIGINFO handler.
unsafe fn from_terminal(info: *const libc::siginfo_t) -> bool {
    // SAFETY: per the contract, a live siginfo (or null).
    !info.is_null() && unsafe { (*info).si_code } == libc::SI_KERNEL
}

extern "C" fn on_stop(signal: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Async-signal-safe: atomic stores.
    // SAFETY: the kernel's siginfo for this handler.
    STOP_FROM_TERMINAL.store(unsafe { from_terminal(info) }, Ordering::SeqCst);
    STOP.store(signal, Ordering::SeqCst);
}

extern "C" fn on_continue(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    CONTINUED.store(true, Ordering::SeqCst);
}

type Handler = extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void);

fn set_handler(signal: i32, handler: Handler) -> std::io::Result<()> {
    // SAFETY: installs a handler that only stores to atomics.
    let rc = unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = handler as usize;
        action.sa_flags = libc::SA_RESTART | libc::SA_SIGINFO;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(signal, &action, std::ptr::null_mut())
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A stop `redmutex` received: the signal, and whether the terminal sent
/// it to the whole foreground group (the command got it too).
pub(super) struct Stop {
    pub(super) signal: i32,
    pub(super) from_terminal: bool,
}

/// Job control for `redmutex run`: a ^Z (SIGTSTP), or a background read
/// or write of the terminal (SIGTTIN, SIGTTOU), reaches the command and
/// `redmutex` alike (one process group); `redmutex` then stops what the
/// terminal did not reach and itself, so the shell sees its job stopped
/// and gets its prompt back; a SIGCONT (`fg`, `bg`) resumes it, and it
/// checks the lease.
pub(super) struct JobControl;

impl JobControl {
    /// Catches SIGTSTP, SIGTTIN and SIGTTOU (unless ignored on entry: job
    /// control is then off, as for any program) and SIGCONT.
    ///
    /// `redmutex`'s own messages never stop it under `stty tostop`: they
    /// are written by a thread that blocks every signal, and a write with
    /// SIGTTOU blocked goes through.
    pub(super) fn install() -> JobControl {
        for signal in [libc::SIGTSTP, libc::SIGTTIN, libc::SIGTTOU] {
            if !ignored_on_entry(signal) {
                let _ = set_handler(signal, on_stop);
            }
        }
        let _ = set_handler(libc::SIGCONT, on_continue);
        JobControl
    }

    /// A stop `redmutex` received since the last call.
    pub(super) fn stop_asked(&self) -> Option<Stop> {
        match STOP.swap(0, Ordering::SeqCst) {
            0 => None,
            signal => Some(Stop {
                signal,
                from_terminal: STOP_FROM_TERMINAL.load(Ordering::SeqCst),
            }),
        }
    }

    /// A SIGCONT since the last call.
    pub(super) fn continued(&self) -> bool {
        CONTINUED.swap(false, Ordering::SeqCst)
    }

    /// Stops `redmutex`'s own process group (the shell's job: `redmutex`,
    /// the command, and a script that runs them) with `signal`, as its
    /// default action would, and returns once continued. In an orphaned
    /// group the kernel drops the signal, as for any job, and this returns
    /// at once.
    ///
    /// Returns whether a SIGCONT ended the stop.
    pub(super) fn stop_job(&self, signal: i32) -> bool {
        STOP.store(0, Ordering::SeqCst);
        CONTINUED.store(false, Ordering::SeqCst);
        // SAFETY: the default action for the signal while it is sent to our
        // own group, then our handler again.
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
            // crate starts its threads with signals blocked, and so does
            // the message writer). Were the SIGCONT taken by another
            // thread, this one could read the flag before the handler set
            // it, and take a stop for a dropped one.
            let continued = CONTINUED.swap(false, Ordering::SeqCst);
            libc::sigaction(signal, &old, std::ptr::null_mut());
            continued
        };
        STOP.store(0, Ordering::SeqCst);
        continued
    }
}

/// The signals `redmutex run` catches from the start: while it waits for
/// the lock they end the wait (nothing stays held), and while the command
/// runs they are passed on to what did not get them already.
pub(super) const FORWARDED: [i32; 4] = [libc::SIGHUP, libc::SIGINT, libc::SIGQUIT, libc::SIGTERM];

/// One bit per signal (N-1): received and not yet passed on; sent by the
/// terminal to the whole foreground group; ever received (see
/// [`received`]).
static FORWARD_PENDING: AtomicU64 = AtomicU64::new(0);
static FORWARD_FROM_TERMINAL: AtomicU64 = AtomicU64::new(0);
static FORWARD_RECEIVED: AtomicU64 = AtomicU64::new(0);

extern "C" fn on_forwarded(signal: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Async-signal-safe: atomic operations.
    let Some(bit) = u32::try_from(signal - 1)
        .ok()
        .and_then(|n| 1u64.checked_shl(n))
    else {
        return;
    };
    // A hangup's SIGHUP goes to the session leader alone (`ssh -t host
    // redmutex run`: `redmutex` is the leader): never taken as sent to the
    // whole group, or the command would never get it.
    // SAFETY: the kernel's siginfo for this handler.
    if signal != libc::SIGHUP && unsafe { from_terminal(info) } {
        FORWARD_FROM_TERMINAL.fetch_or(bit, Ordering::SeqCst);
    } else {
        FORWARD_FROM_TERMINAL.fetch_and(!bit, Ordering::SeqCst);
    }
    FORWARD_RECEIVED.fetch_or(bit, Ordering::SeqCst);
    FORWARD_PENDING.fetch_or(bit, Ordering::SeqCst);
}

/// Whether `redmutex` itself received `signal` (one of [`FORWARDED`]).
pub(super) fn received(signal: i32) -> bool {
    u32::try_from(signal - 1)
        .ok()
        .and_then(|n| 1u64.checked_shl(n))
        .is_some_and(|bit| FORWARD_RECEIVED.load(Ordering::SeqCst) & bit != 0)
}

/// A signal to pass on: its number, and whether the terminal sent it to
/// the whole foreground group (the command's process group got it).
pub(super) struct Forward {
    pub(super) signal: i32,
    pub(super) from_terminal: bool,
}

/// Signals received by `redmutex` itself, to pass on.
pub(super) struct Forwarded;

impl Forwarded {
    /// Catches [`FORWARDED`], but those ignored on entry (SIGHUP under
    /// `nohup`, SIGINT and SIGQUIT in a script's background job): they are
    /// left ignored, and not passed on (the command inherits the
    /// disposition).
    ///
    /// # Errors
    ///
    /// sigaction's.
    pub(super) fn install() -> std::io::Result<Forwarded> {
        for signal in FORWARDED {
            if !ignored_on_entry(signal) {
                set_handler(signal, on_forwarded)?;
            }
        }
        Ok(Forwarded)
    }

    /// A signal received and not yet taken, if any: each signal is kept
    /// apart (a SIGTERM and a SIGHUP in a row are both passed on).
    pub(super) fn take(&self) -> Option<Forward> {
        let pending = FORWARD_PENDING.load(Ordering::SeqCst);
        if pending == 0 {
            return None;
        }
        let bit = pending & pending.wrapping_neg();
        FORWARD_PENDING.fetch_and(!bit, Ordering::SeqCst);
        Some(Forward {
            signal: i32::try_from(bit.trailing_zeros()).unwrap_or(0) + 1,
            from_terminal: FORWARD_FROM_TERMINAL.load(Ordering::SeqCst) & bit != 0,
        })
    }
}
