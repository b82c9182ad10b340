//! The reaper: the command's parent, a process of its own between
//! `redmutex` and the command (see `supervise.rs` for the three
//! processes and why).
//!
//! `redmutex` starts it by running its own executable again
//! (`/proc/self/exe __reap …`): a fresh process of one thread, so it may
//! do anything between its fork and the command's exec, which a fork of
//! `redmutex` (whose client runs threads) could not. It is a child
//! subreaper in the caller's process group; it starts the command, tells
//! `redmutex` its pid and, when it ends, how; it reaps what the command
//! leaves to it. When `redmutex` is gone without saying it is done, it
//! kills everything below it before it goes: nothing escapes it, as it
//! is the parent of every orphan below it.

use std::ffi::OsString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::process::{Command, ExitStatus};

use super::supervise::{self, MESSAGE, message, parse_message};

/// The argument that makes `redmutex` the reaper.
pub(super) const ARG: &str = "__reap";

/// The command started: its pid and start time.
const STARTED: u8 = b'S';
/// The command could not be started: the errno.
const FAILED: u8 = b'F';
/// The command ended: its raw wait status.
const EXITED: u8 = b'X';
/// (`redmutex` to the reaper) done: leave without killing anything.
const DONE: u8 = b'D';

/// How the command fared, as the reaper tells it.
pub(super) enum Report {
    /// Still running.
    Running,
    Exited(ExitStatus),
    /// The reaper is gone without saying how the command ended (killed).
    Gone,
}

/// `redmutex`'s side of the reaper.
pub(super) struct Reaper {
    child: std::process::Child,
    /// The reaper's reports (non-blocking).
    reports: OwnedFd,
    /// Ours alone: its end tells the reaper `redmutex` is gone.
    life: Option<OwnedFd>,
    /// The command's pid.
    pub(super) command: libc::pid_t,
    ended: bool,
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: a pipe into a two-element array; both ends are ours.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: descriptors pipe2 just gave us.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Why the command was not started.
pub(super) enum NotStarted {
    /// Exec (or a step before it) refused: the command's own failure.
    Exec(std::io::Error),
    /// The reaper could not be started, or died before it said: the
    /// supervisor's.
    Reaper(String),
}

impl Reaper {
    /// Starts the reaper, which starts `program` with `args` and the
    /// environment `configure` sets; returns once the command was started
    /// (its exec done) or refused.
    ///
    /// # Errors
    ///
    /// [`NotStarted`].
    pub(super) fn start(
        program: &std::ffi::OsStr,
        args: &[OsString],
        configure: impl FnOnce(&mut Command),
    ) -> Result<Reaper, NotStarted> {
        use std::os::unix::process::CommandExt;
        let setup = |err: std::io::Error| NotStarted::Reaper(format!("starting the reaper: {err}"));
        let (reports, report_end) = pipe().map_err(setup)?;
        let (life_end, life) = pipe().map_err(setup)?;
        let exe = if cfg!(target_os = "linux") {
            std::path::PathBuf::from("/proc/self/exe")
        } else {
            std::env::current_exe().map_err(setup)?
        };
        let mut command = Command::new(exe);
        command
            .arg0("redmutex-reap")
            .arg(ARG)
            .arg(report_end.as_raw_fd().to_string())
            .arg(life_end.as_raw_fd().to_string())
            .arg("--")
            .arg(program)
            .args(args);
        configure(&mut command);
        let (report_fd, life_fd) = (report_end.as_raw_fd(), life_end.as_raw_fd());
        let entry = supervise::entry_dispositions();
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            command.pre_exec(move || {
                // The reaper's two ends survive its exec (and no other
                // process gets them: close-on-exec everywhere else).
                for fd in [report_fd, life_fd] {
                    if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                // The reaper, and so the command, starts with every
                // signal as `redmutex` found it.
                supervise::restore_dispositions(entry);
                Ok(())
            });
        }
        let child = command.spawn().map_err(setup)?;
        drop((report_end, life_end));
        let mut reaper = Reaper {
            child,
            reports,
            life: Some(life),
            command: 0,
            ended: false,
        };
        // The first report: started or refused (the reaper's spawn waits
        // for the exec).
        match reaper.read_message(true) {
            Some((STARTED, pid, _)) => {
                reaper.command = libc::pid_t::try_from(pid).unwrap_or(0);
            }
            Some((FAILED, errno, _)) => {
                reaper.finish();
                let errno = i32::try_from(errno).unwrap_or(libc::EINVAL);
                return Err(NotStarted::Exec(std::io::Error::from_raw_os_error(errno)));
            }
            _ => {
                reaper.finish();
                return Err(NotStarted::Reaper(
                    "the reaper process ended before starting the command".into(),
                ));
            }
        }
        // From here reports are polled.
        // SAFETY: fcntl on our own descriptor.
        unsafe {
            let flags = libc::fcntl(reaper.reports.as_raw_fd(), libc::F_GETFL);
            libc::fcntl(
                reaper.reports.as_raw_fd(),
                libc::F_SETFL,
                flags | libc::O_NONBLOCK,
            );
        }
        Ok(reaper)
    }

    /// The descriptor its reports arrive on (readable when one is there,
    /// or when the reaper is gone), for `poll`, while the command runs.
    pub(super) fn reports_fd(&self) -> Option<RawFd> {
        (!self.ended).then(|| self.reports.as_raw_fd())
    }

    /// The reaper's pid (not the command's).
    pub(super) fn pid(&self) -> libc::pid_t {
        libc::pid_t::try_from(self.child.id()).unwrap_or(0)
    }

    /// One message; `None` at the pipe's end (or, not blocking, when none
    /// is there).
    fn read_message(&mut self, blocking: bool) -> Option<(u8, i64, i64)> {
        let mut buf = [0u8; MESSAGE];
        let mut read = 0;
        while read < MESSAGE {
            let rest = buf.get_mut(read..)?;
            // SAFETY: reads into a live buffer of that length.
            let n = unsafe {
                libc::read(
                    self.reports.as_raw_fd(),
                    rest.as_mut_ptr().cast(),
                    rest.len(),
                )
            };
            match n {
                0 => return None,
                n if n < 0 => {
                    let err = std::io::Error::last_os_error();
                    match err.kind() {
                        std::io::ErrorKind::Interrupted => {}
                        // Messages are written whole (17 bytes, under
                        // PIPE_BUF): none there, or a whole one.
                        std::io::ErrorKind::WouldBlock if !blocking && read == 0 => {
                            return Some((0, 0, 0));
                        }
                        std::io::ErrorKind::WouldBlock => {}
                        _ => return None,
                    }
                }
                n => read += usize::try_from(n).ok()?,
            }
        }
        Some(parse_message(&buf))
    }

    /// How the command fares, without waiting.
    pub(super) fn poll(&mut self) -> Report {
        if self.ended {
            return Report::Gone;
        }
        loop {
            match self.read_message(false) {
                Some((0, _, _)) => return Report::Running,
                Some((EXITED, status, _)) => {
                    use std::os::unix::process::ExitStatusExt;
                    self.ended = true;
                    return Report::Exited(ExitStatus::from_raw(
                        i32::try_from(status).unwrap_or(1),
                    ));
                }
                Some(_) => {}
                None => {
                    self.ended = true;
                    return Report::Gone;
                }
            }
        }
    }

    /// Tells the reaper `redmutex` is done (what is left below it is left
    /// alone) and reaps it.
    pub(super) fn finish(&mut self) {
        if let Some(life) = self.life.take() {
            let _ = supervise::write_all(life.as_raw_fd(), &message(DONE, 0, 0));
        }
        let _ = self.child.wait();
    }
}

/// The reaper's whole life (`redmutex __reap REPORT LIFE -- PROGRAM
/// ARGS…`): never returns.
pub(super) fn main(args: &[OsString]) -> ! {
    let fd = |i: usize| -> RawFd {
        args.get(i)
            .and_then(|a| a.to_str())
            .and_then(|a| a.parse().ok())
            .unwrap_or(-1)
    };
    let (report, life) = (fd(2), fd(3));
    let (Some(program), Some(rest)) = (args.get(5), args.get(6..)) else {
        // SAFETY: ends this process.
        unsafe { libc::_exit(super::EXIT_USAGE.into()) }
    };
    if report < 0 || life < 0 || args.get(4).is_none_or(|a| a != "--") {
        // SAFETY: ends this process.
        unsafe { libc::_exit(super::EXIT_USAGE.into()) }
    }
    // Whatever this process's start left: the dispositions `redmutex`
    // found, for the command.
    let entry = supervise::entry_dispositions();
    supervise::set_name(c"redmutex-reap");
    supervise::become_subreaper();
    supervise::ignore_job_signals();
    // SAFETY: signal(2) on this process's own disposition: with SIGCHLD
    // ignored (as it may have been on entry) the kernel would reap the
    // command before the reaper could learn how it ended.
    unsafe { libc::signal(libc::SIGCHLD, libc::SIG_DFL) };
    // SAFETY: fcntl on the two descriptors `redmutex` passed: not the
    // command's to inherit.
    unsafe {
        libc::fcntl(report, libc::F_SETFD, libc::FD_CLOEXEC);
        libc::fcntl(life, libc::F_SETFD, libc::FD_CLOEXEC);
    }
    let send = |tag: u8, a: i64, b: i64| supervise::write_all(report, &message(tag, a, b));
    let me = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    let mut command = Command::new(program);
    command.args(rest);
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            command.pre_exec(move || {
                #[cfg(target_os = "linux")]
                {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    // The reaper died before the prctl: do not run
                    // unguarded (and no one is left to tell).
                    if libc::getppid() != me {
                        libc::_exit(super::EXIT_OSERR.into());
                    }
                }
                // Last: every signal as `redmutex` found it.
                supervise::restore_dispositions(entry);
                Ok(())
            });
        }
    }
    let child = match command.spawn() {
        Ok(child) => child,
        Err(err) => {
            let _ = send(FAILED, i64::from(err.raw_os_error().unwrap_or(0)), 0);
            // SAFETY: ends this process.
            unsafe { libc::_exit(0) }
        }
    };
    let pid = libc::pid_t::try_from(child.id()).unwrap_or(0);
    let start = supervise::stat(pid).map_or(0, |s| s.start);
    let _ = send(STARTED, i64::from(pid), start);
    // The caller's files are the command's, not the reaper's to keep open
    // (a pipeline's reader waits for every writer).
    drop(child);
    supervise::null_stdio();
    supervise::close_other_fds(&[report, life]);
    let pidfd = supervise::pidfd_open(pid).ok();
    let mut running = true;
    loop {
        // The command's pidfd while it runs (readable for good once it
        // ended).
        let watched = pidfd
            .as_ref()
            .filter(|_| running)
            .map_or(-1, AsRawFd::as_raw_fd);
        let mut polls = [
            libc::pollfd {
                fd: life,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: watched,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // Woken by `redmutex`, by the command's end (its pidfd), or after
        // a while to reap orphans handed to us (without a pidfd: often,
        // for the command's end).
        let timeout = if pidfd.is_some() || !running { 200 } else { 20 };
        // SAFETY: polls descriptors of ours (a negative one is skipped).
        unsafe { libc::poll(polls.as_mut_ptr(), 2, timeout) };
        // Every child that ended: the command (told), and orphans.
        loop {
            let mut status = 0;
            // SAFETY: reaps a child of ours that ended, without waiting.
            let got = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if got <= 0 {
                break;
            }
            if got == pid && running {
                running = false;
                if send(EXITED, i64::from(status), 0).is_err() {
                    break;
                }
            }
        }
        if polls[0].revents != 0 {
            let mut byte = [0u8; MESSAGE];
            // SAFETY: reads into a live buffer.
            let n = unsafe { libc::read(life, byte.as_mut_ptr().cast(), byte.len()) };
            if n > 0 && byte[0] == DONE {
                // SAFETY: ends this process.
                unsafe { libc::_exit(0) }
            }
            if n == 0
                || (n < 0
                    && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted)
            {
                // `redmutex` is gone without saying it is done: nothing
                // below runs on without its lease.
                supervise::signal_tree(&[me], &[me], libc::SIGKILL, &|_| false);
                // SAFETY: ends this process.
                unsafe { libc::_exit(0) }
            }
        }
    }
}
