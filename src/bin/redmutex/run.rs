//! `redmutex run`: take the lock, run the command in its own process group
//! with signals forwarded, keep the lease, and end the command if it is lost.

#[allow(unused_imports)]
use super::*;
use redmutex::Lease;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Shows what `redmutex run` waits for, on a terminal only.
struct Spinner {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Spinner {
    fn start(cli: &Cli, client: &LockClient, key: &str, limit: Option<u32>) -> Spinner {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = (!cli.quiet && std::io::stderr().is_terminal()).then(|| {
            let (stop, client, key) = (stop.clone(), client.clone(), key.to_owned());
            std::thread::spawn(move || {
                let frames = ['⠋', '⠙', '⠹', '⠸', '⠼', '⠴', '⠦', '⠧', '⠇', '⠏'];
                let started = Instant::now();
                let mut frame = 0usize;
                let mut last_poll = None::<Instant>;
                let mut held = String::from("…");
                while !stop.load(Ordering::Relaxed) {
                    if last_poll.is_none_or(|t| t.elapsed() > Duration::from_millis(500)) {
                        held = match describe(&client, &key, limit) {
                            Ok(Some(who)) => who,
                            Ok(None) => "free, taking it".into(),
                            Err(_) => "Redis not answering".into(),
                        };
                        last_poll = Some(Instant::now());
                    }
                    // Queued, never waited for: a stalled terminal stops
                    // the spinner's frames, not the wait.
                    output::to_stderr(
                        format!(
                            "\r\x1b[2K{} waiting {:.0}s for {key:?}: {held}",
                            frames[frame % frames.len()],
                            started.elapsed().as_secs_f64()
                        )
                        .into_bytes(),
                    );
                    frame += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
                output::to_stderr(b"\r\x1b[2K".to_vec());
            })
        });
        Spinner { stop, thread }
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The signals `redmutex run` catches from the start: while it waits for
/// the lock they end the wait (nothing stays held), and while the command
/// runs they are passed on to the command's whole process group.
const FORWARDED: [i32; 4] = [
    signal_hook::consts::SIGHUP,
    signal_hook::consts::SIGINT,
    signal_hook::consts::SIGQUIT,
    signal_hook::consts::SIGTERM,
];

/// Signals received by `redmutex` itself, to pass on to the child.
struct Forwarded {
    pending: Arc<AtomicUsize>,
    last: Arc<AtomicUsize>,
}

impl Forwarded {
    fn install() -> Result<Forwarded, Failure> {
        let pending = Arc::new(AtomicUsize::new(0));
        let last = Arc::new(AtomicUsize::new(0));
        for signal in FORWARDED {
            // Ignored on entry (SIGHUP under `nohup`, SIGINT and SIGQUIT
            // in a script's background job): left ignored, and not passed
            // on (the command inherits the disposition).
            if supervise::ignored_on_entry(signal) {
                continue;
            }
            let (pending, last) = (pending.clone(), last.clone());
            // SAFETY: the handler only stores to atomics, which is
            // async-signal-safe.
            unsafe {
                signal_hook::low_level::register(signal, move || {
                    last.store(signal as usize, Ordering::SeqCst);
                    pending.fetch_add(1, Ordering::SeqCst);
                })
            }
            .map_err(|e| fail(EXIT_OSERR, format!("cannot handle signals: {e}")))?;
        }
        Ok(Forwarded { pending, last })
    }

    /// A signal received since the last call, if any.
    fn take(&self) -> Option<i32> {
        if self.pending.swap(0, Ordering::SeqCst) > 0 {
            Some(self.last.load(Ordering::SeqCst) as i32)
        } else {
            None
        }
    }
}

/// Signals the command's whole process group (its children included:
/// the grandchildren of `sh -c` go too).
fn signal_group(pgid: libc::pid_t, signal: i32) {
    // SAFETY: kill(2) on the process group of a child we spawned as its
    // leader; a group whose members are gone gets ESRCH, which is ignored.
    unsafe {
        libc::kill(-pgid, signal);
    }
}

/// The controlling terminal's foreground group, handed to the command
/// while it runs when `redmutex` itself has it (so an interactive command
/// can read the terminal), and taken back after.
///
/// The terminal is `/dev/tty`, not standard input: a job whose input is
/// redirected (`< file`) is still a job of that terminal, and a shell
/// gives it the terminal all the same.
///
/// Meanwhile `redmutex` is a background group on that terminal: with
/// `stty tostop` its own writes to the terminal (a loss message) would stop
/// it with SIGTTOU, watchdog and all, while the command ran on. So it
/// ignores SIGTTOU until it has the terminal back; the command gets the
/// disposition `redmutex` found.
struct Foreground {
    /// The controlling terminal, when there is one: `redmutex`'s group
    /// may be its foreground now or later (`fg`).
    tty: Option<OwnedFd>,
    /// `redmutex`'s group had the terminal at the start: the command gets
    /// it as it starts.
    ours: bool,
    /// The SIGTTOU disposition found at start, restored in the command and
    /// at the end.
    ttou: libc::sighandler_t,
}

impl Foreground {
    fn ours() -> Foreground {
        // SAFETY: opens the controlling terminal (ENXIO without one),
        // close-on-exec and without becoming anyone's controlling
        // terminal; tcgetpgrp and getpgrp only read; signal(2) swaps a
        // disposition, put back in give_back.
        unsafe {
            let fd = libc::open(
                c"/dev/tty".as_ptr(),
                libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOCTTY,
            );
            let tty = (fd >= 0).then(|| OwnedFd::from_raw_fd(fd));
            let ours = tty
                .as_ref()
                .is_some_and(|tty| libc::tcgetpgrp(tty.as_raw_fd()) == libc::getpgrp());
            // On a terminal `redmutex` is a background group while the
            // command has it (or while the job runs after `bg`): ignored,
            // SIGTTOU neither stops it for a message nor refuses it the
            // terminal's foreground.
            let ttou = if tty.is_some() {
                libc::signal(libc::SIGTTOU, libc::SIG_IGN)
            } else {
                libc::SIG_DFL
            };
            Foreground { tty, ours, ttou }
        }
    }

    fn fd(&self) -> Option<RawFd> {
        self.tty.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// At the end: the terminal back to `redmutex`'s group if the
    /// command's group (`command`, when it was started) has it, and the
    /// SIGTTOU disposition found at start.
    fn give_back(&self, command: Option<libc::pid_t>) {
        let Some(tty) = self.fd() else {
            return;
        };
        // SAFETY: SIGTTOU is ignored (see `ours`), so a background group
        // may set the terminal's group; then the disposition found at
        // start is put back.
        unsafe {
            let current = libc::tcgetpgrp(tty);
            if command.is_some_and(|pgid| current == pgid) || (command.is_none() && self.ours) {
                libc::tcsetpgrp(tty, libc::getpgrp());
            }
            libc::signal(libc::SIGTTOU, self.ttou);
        }
    }

    /// The command's group stopped with the terminal: back to ours, so the
    /// job stops as one and the shell can take it.
    fn take_back(&self, command: libc::pid_t) {
        if let Some(tty) = self.fd() {
            // SAFETY: SIGTTOU is ignored (see `ours`); only when the
            // command's group has the terminal.
            unsafe {
                if libc::tcgetpgrp(tty) == command {
                    libc::tcsetpgrp(tty, libc::getpgrp());
                }
            }
        }
    }

    /// Whether the command's group has the terminal's foreground.
    fn is_with(&self, command: libc::pid_t) -> bool {
        // SAFETY: tcgetpgrp only reads.
        self.fd()
            .is_some_and(|tty| unsafe { libc::tcgetpgrp(tty) } == command)
    }

    /// The job is in the terminal's foreground again (`fg`): the command's
    /// group gets the terminal, as at the start. In the background (`bg`)
    /// it does not: a read of the terminal stops it, and the job with it.
    fn hand_over(&self, command: libc::pid_t) {
        if let Some(tty) = self.fd() {
            // SAFETY: SIGTTOU is ignored (see `ours`); only while our group
            // has the terminal.
            unsafe {
                if libc::tcgetpgrp(tty) == libc::getpgrp() {
                    libc::tcsetpgrp(tty, command);
                }
            }
        }
    }
}

/// Signal dispositions and the mask `redmutex run` needs, set before
/// anything else (the command gets them as found: see
/// `supervise::restore_dispositions`).
struct Inherited;

impl Inherited {
    fn take() -> Inherited {
        // SAFETY: signal(2) and pthread_sigmask(3) on this process's own
        // dispositions and mask, before any thread is started.
        unsafe {
            // Ignored, the kernel would reap the command before `redmutex`
            // could learn how it ended.
            libc::signal(libc::SIGCHLD, libc::SIG_DFL);
            // Blocked on entry, job control and SIGCHLD would never reach
            // their handlers. (The command starts with an empty mask, as
            // every program the standard library spawns.)
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            for signal in [libc::SIGTSTP, libc::SIGTTIN, libc::SIGCONT, libc::SIGCHLD] {
                libc::sigaddset(&mut set, signal);
            }
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
            Inherited
        }
    }
}

/// Makes the command the leader of its own process group (so a signal
/// reaches everything it started) and names the group to the watcher
/// before the command runs, gives it the terminal when `redmutex` had it,
/// and on Linux has the kernel kill it if `redmutex` dies (it must not run
/// on without the lock's renewals).
fn isolate(
    command: &mut Command,
    foreground: &Foreground,
    inherited: &Inherited,
    watcher: Option<&supervise::Watcher>,
) {
    use std::os::unix::process::CommandExt;
    command.process_group(0);
    let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    let terminal = foreground.fd().filter(|_| foreground.ours);
    let _ = inherited;
    let entry = supervise::entry_dispositions();
    let watcher = watcher.and_then(supervise::Watcher::fd);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        command.pre_exec(move || {
            #[cfg(target_os = "linux")]
            {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // redmutex died before the prctl: do not run unprotected
                // (and no one is left to tell).
                if libc::getppid() != parent {
                    libc::_exit(EXIT_OSERR.into());
                }
            }
            let _ = parent;
            // The watcher knows the group before the command runs an
            // instruction of its own: no window where `redmutex` could die
            // and leave it unguarded. A watcher that is gone fails the
            // write with EPIPE, reported by `spawn` as the command not
            // started (SIGPIPE ignored for it: by default it would kill
            // this child silently, and the run would look like the
            // command's own death by SIGPIPE).
            if let Some(fd) = watcher {
                libc::signal(libc::SIGPIPE, libc::SIG_IGN);
                if supervise::write_all(fd, &supervise::group_message(libc::getpid())).is_err() {
                    return Err(std::io::Error::from_raw_os_error(WATCHER_GONE));
                }
            }
            if let Some(tty) = terminal {
                // SIGTTOU is ignored here (inherited): the call goes through.
                libc::tcsetpgrp(tty, libc::getpid());
            }
            // Last: every signal as `redmutex` found it (SIGTTOU, SIGCHLD
            // and SIGPIPE included).
            supervise::restore_dispositions(entry);
            Ok(())
        });
    }
}

/// Why the command could not be started, with its exit code: the watcher
/// gone (71, never the command's own result), a missing program (127), a
/// script whose `#!` interpreter is missing (126, as a shell says "bad
/// interpreter"), anything else exec refused (126).
fn not_started(program: &std::ffi::OsStr, err: &std::io::Error) -> Failure {
    let name = program.to_string_lossy();
    if err.raw_os_error() == Some(WATCHER_GONE) {
        return fail(
            EXIT_OSERR,
            format!(
                "the watcher process is gone: {name} was not started (it must not run \
                 unguarded); was it killed?"
            ),
        );
    }
    if err.kind() != std::io::ErrorKind::NotFound {
        return fail(
            EXIT_CANNOT_EXECUTE,
            format!("{name}: cannot execute: {err}"),
        );
    }
    // ENOENT from exec: the program, or the interpreter its `#!` names.
    match find_program(program) {
        Some(path) => {
            let interpreter = interpreter_of(&path).unwrap_or_else(|| "its interpreter".into());
            fail(
                EXIT_CANNOT_EXECUTE,
                format!(
                    "{name}: cannot execute: bad interpreter: {interpreter} not found \
                     (the #! line of {})",
                    path.display()
                ),
            )
        }
        None => fail(EXIT_NOT_FOUND, format!("{name}: command not found")),
    }
}

/// Where exec would find `program`: the path itself when it has a `/`,
/// else the first regular file of that name on `$PATH`.
fn find_program(program: &std::ffi::OsStr) -> Option<std::path::PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let is_file = |path: &std::path::Path| path.metadata().is_ok_and(|m| m.is_file());
    if program.as_bytes().contains(&b'/') {
        let path = std::path::PathBuf::from(program);
        return is_file(&path).then_some(path);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| is_file(candidate))
}

/// The interpreter a script's `#!` line names, if it has one.
fn interpreter_of(path: &std::path::Path) -> Option<String> {
    use std::io::Read;
    let mut head = [0u8; 256];
    let n = std::fs::File::open(path).ok()?.read(&mut head).ok()?;
    let line = head.get(..n)?.strip_prefix(b"#!")?;
    let line = line.split(|b| *b == b'\n').next()?;
    let text = String::from_utf8_lossy(line);
    text.split_whitespace().next().map(printable)
}

/// The error a command's `pre_exec` reports when the watcher is gone
/// (see `isolate`).
const WATCHER_GONE: i32 = libc::EPIPE;

/// The exit code of a run ended by `signal` before the command started.
fn signalled(signal: i32) -> u8 {
    128u8.wrapping_add(u8::try_from(signal).unwrap_or(0))
}

fn exit_code_of(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(signal)) => 128u8.wrapping_add(signal as u8),
        _ => 1,
    }
}

/// How long one slice of waiting for the lock lasts: a signal that
/// arrives while waiting is acted on within it.
const WAIT_SLICE: Duration = Duration::from_millis(250);

/// What `run` takes: the lock, or with `--limit` a permit of a semaphore.
enum Target {
    Lock(DistributedLock),
    Permit(Semaphore),
}

/// What `run` holds while the command runs.
enum Held {
    Lock(redmutex::LockGuard),
    // Boxed: a permit is much larger than a guard.
    Permit(Box<redmutex::Permit>),
}

impl Target {
    fn try_once(&self) -> Result<Option<Held>, Error> {
        Ok(match self {
            Target::Lock(lock) => lock.try_lock()?.map(Held::Lock),
            Target::Permit(semaphore) => semaphore
                .try_acquire()?
                .map(|permit| Held::Permit(Box::new(permit))),
        })
    }

    fn try_for(&self, wait: Duration) -> Result<Option<Held>, Error> {
        Ok(match self {
            Target::Lock(lock) => lock.try_lock_for(wait)?.map(Held::Lock),
            Target::Permit(semaphore) => semaphore
                .try_acquire_for(wait)?
                .map(|permit| Held::Permit(Box::new(permit))),
        })
    }
}

impl Held {
    /// The lock's token, or the permit's id: what `release --token` takes.
    fn token(&self) -> &str {
        match self {
            Held::Lock(guard) => guard.token(),
            Held::Permit(permit) => permit.id(),
        }
    }

    fn fencing_token(&self) -> Option<u64> {
        match self {
            Held::Lock(guard) => guard.fencing_token(),
            Held::Permit(permit) => permit.fencing_token(),
        }
    }

    fn loss_signal(&self) -> redmutex::LossSignal {
        match self {
            Held::Lock(guard) => guard.loss_signal(),
            Held::Permit(permit) => permit.loss_signal(),
        }
    }

    fn validity(&self) -> Duration {
        match self {
            Held::Lock(guard) => guard.validity(),
            Held::Permit(permit) => permit.validity(),
        }
    }

    /// Whether Redis still holds it (owner-checked).
    fn is_held(&self) -> Result<bool, Error> {
        match self {
            Held::Lock(guard) => guard.is_held(),
            Held::Permit(permit) => permit.is_held(),
        }
    }

    fn unlock(self) -> Result<(), Error> {
        match self {
            Held::Lock(guard) => guard.unlock().map(|_| ()),
            Held::Permit(permit) => permit.release(),
        }
    }
}

/// Takes the lock (or a permit), waiting in slices so a signal ends the
/// wait. `Err(signal)` when one arrived; nothing is held then.
fn acquire(
    target: &Target,
    args: &RunArgs,
    forwarded: &Forwarded,
) -> Result<Result<Option<Held>, Error>, i32> {
    if args.no_wait {
        let acquired = target.try_once();
        return match forwarded.take() {
            // A guard taken meanwhile is released when dropped here.
            Some(signal) => Err(signal),
            None => Ok(acquired),
        };
    }
    let deadline = Instant::now().checked_add(args.wait);
    loop {
        let slice = match deadline {
            Some(deadline) => deadline
                .saturating_duration_since(Instant::now())
                .min(WAIT_SLICE),
            None => WAIT_SLICE,
        };
        let acquired = target.try_for(slice);
        if let Some(signal) = forwarded.take() {
            return Err(signal);
        }
        match acquired {
            Ok(None) if deadline.is_none_or(|d| Instant::now() < d) => continue,
            other => return Ok(other),
        }
    }
}

/// Whether, and why, the command is being ended.
enum Ending {
    /// It runs under a lease that is being renewed.
    Running,
    /// Renewals failed and this much of the lease was left.
    LowValidity(Duration),
    /// The lease was found lost.
    Lost(redmutex::LossReason),
    /// The command ran longer than `--max-run`.
    MaxRun,
    /// The lease was found lost when the stopped job was continued, and
    /// could not be taken again: the command was killed still stopped.
    LostWhileStopped,
    /// The watcher killed the command: `redmutex` did not tell it of a
    /// renewal before the lease's local deadline.
    Overdue,
}

impl Ending {
    /// Why the lease was lost, in a few words (the run's report).
    fn reason(&self) -> String {
        match self {
            Ending::Running | Ending::MaxRun => String::new(),
            Ending::LowValidity(left) => {
                format!("it could not be renewed and {left:?} of it was left")
            }
            Ending::Lost(reason) => reason.to_string(),
            Ending::LostWhileStopped => {
                "it was lost while the job was stopped, and could not be taken again".into()
            }
            Ending::Overdue => "redmutex was stopped or hung past the lease, and its watcher \
                                killed the command"
                .into(),
        }
    }
}

/// The key of a run without one: the same for the same command line (and
/// `--limit`) on every host and version (FNV-1a, 64 bits, over the
/// arguments' bytes, each ended by a NUL). As with run-one, it is the
/// command line as typed: `./job.sh` in two directories is one key.
fn derived_key(command: &[OsString], limit: Option<u32>) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    // A semaphore's key apart from the lock's of the same command (one
    // would find the other's type in it).
    let kind = limit.map(|n| OsString::from(format!("--limit {n}")));
    for arg in kind.iter().chain(command) {
        for byte in arg.as_bytes().iter().chain(&[0]) {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("run:{hash:016x}")
}

pub(super) fn run(cli: &Cli, args: &RunArgs) -> Result<u8, Failure> {
    let inherited = Inherited::take();
    // First, while `redmutex` has one thread: the process that kills the
    // command if `redmutex` dies or stops renewing (see
    // `supervise::Watcher`).
    let mut watcher = supervise::Watcher::start();
    let outcome = run_watched(cli, args, &inherited, watcher.as_ref());
    // Every return ends well: the command exited (or was killed, or never
    // started). A panic does not come here: the watcher sees the pipe
    // close without `done` and kills the command.
    if let Some(watcher) = &mut watcher {
        watcher.done();
    }
    if let Some(path) = &args.report {
        let (code, failure) = match &outcome {
            Ok(code) => (*code, None),
            Err(failure) => (failure.code, Some(failure.message.as_str())),
        };
        if let Err(err) = report::write(path, code, failure) {
            warn(format_args!("{err}"));
        }
    }
    outcome
}

fn run_watched(
    cli: &Cli,
    args: &RunArgs,
    inherited: &Inherited,
    watcher: Option<&supervise::Watcher>,
) -> Result<u8, Failure> {
    let key = match &args.key {
        Some(key) if key.is_empty() => {
            return Err(fail(EXIT_USAGE, "the lock key must not be empty"));
        }
        Some(key) => key.clone(),
        None => {
            let key = derived_key(&args.command, args.limit);
            verbose(
                cli,
                format_args!("the key is {key:?} (derived from the command line)"),
            );
            key
        }
    };
    report::key(&key);
    if let Some(path) = &args.report {
        // Refused before anything is taken: a report that cannot be
        // written would leave its reader with nothing.
        let dir = match path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir,
            _ => std::path::Path::new("."),
        };
        if !dir.is_dir() || path.file_name().is_none() {
            return Err(fail(
                EXIT_USAGE,
                format!("--report {}: no such directory", path.display()),
            ));
        }
    }
    if args.max_run.is_some_and(|d| d.is_zero()) {
        return Err(fail(EXIT_USAGE, "--max-run must be longer than 0"));
    }
    for (name, d) in [("--min-hold", args.min_hold), ("--max-run", args.max_run)] {
        if d.is_some_and(|d| Instant::now().checked_add(d).is_none()) {
            return Err(fail(EXIT_USAGE, format!("{name} is too long")));
        }
    }
    // Before anything is acquired: a SIGTERM while waiting or acquiring
    // must not leave the key held for its ttl.
    let forwarded = Forwarded::install()?;
    let (program, rest) = args
        .command
        .split_first()
        .ok_or_else(|| fail(EXIT_USAGE, "no command given after --"))?;
    // The holder metadata names the command, not redmutex.
    let mut builder = builder(cli).program(
        std::path::Path::new(program)
            .file_name()
            .unwrap_or(program.as_os_str())
            .to_string_lossy(),
    );
    if let Some(label) = &args.label {
        builder = builder.label(label);
    }
    let client = builder.build().map_err(redis_failure)?;
    let options = LockOptions::default()
        .ttl(args.ttl)
        .wait(args.wait)
        .watchdog(true)
        .fencing(args.fencing)
        .wait_mode(WaitMode::Notify);
    let kill_after = args.kill_after.min(args.ttl / 3);
    if kill_after < args.kill_after {
        verbose(
            cli,
            format_args!("--kill-after is at most a third of the ttl: {kill_after:?}"),
        );
    }
    let target = match args.limit {
        Some(limit) => Target::Permit(Semaphore::with_options(
            &client,
            key.clone(),
            limit,
            options.for_semaphore(),
        )),
        None => Target::Lock(DistributedLock::with_options(&client, key.clone(), options)),
    };
    let what = match args.limit {
        Some(limit) => format!("a permit of {key:?} (limit {limit})"),
        None => format!("the lock {key:?}"),
    };
    verbose(
        cli,
        format_args!("acquiring {what} at {}", redact(&cli.url)),
    );
    // While waiting, ^Z stops `redmutex` by the default action (nothing
    // is held); the lease taken is checked after, before the command
    // starts.
    let acquired = {
        let _spinner = (!args.no_wait).then(|| Spinner::start(cli, &client, &key, args.limit));
        acquire(&target, args, &forwarded)
    };
    let acquired = match acquired {
        Ok(acquired) => acquired.map_err(redis_failure)?,
        Err(signal) => {
            say(
                cli,
                format_args!("signal {signal} while waiting for {key:?}; not running the command"),
            );
            report::outcome("signalled", Some(format!("signal {signal} while waiting")));
            return Ok(signalled(signal));
        }
    };
    let Some(guard) = acquired else {
        report::outcome("not_acquired", None);
        if args.quiet_if_held {
            if args.report.is_some()
                && let Ok(Some(who)) = describe(&client, &key, args.limit)
            {
                report::holder(who);
            }
            verbose(
                cli,
                format_args!("{key:?} is held elsewhere; not running the command"),
            );
            return Ok(0);
        }
        let who = match describe(&client, &key, args.limit) {
            Ok(Some(who)) => who,
            _ => "held".into(),
        };
        report::holder(who.clone());
        say(
            cli,
            format_args!("{key:?} is {who}; not running the command"),
        );
        return Ok(args.conflict_exit_code);
    };
    verbose(
        cli,
        format_args!("acquired {what} with token {}", shown(cli, guard.token())),
    );

    let mut command = Command::new(program);
    command
        .args(rest)
        .env("REDMUTEX_KEY", &key)
        // A `redmutex` the command runs (a release by token, a nested run)
        // names keys as this one does.
        .env("REDMUTEX_KEY_PREFIX", &cli.key_prefix)
        .env("REDMUTEX_TOKEN", guard.token());
    if let Some(fence) = guard.fencing_token() {
        command.env("REDMUTEX_FENCING_TOKEN", fence.to_string());
    }
    // A signal that came while acquiring: the command is not started.
    if let Some(signal) = forwarded.take() {
        let _ = guard.unlock();
        say(
            cli,
            format_args!("signal {signal} after acquiring {key:?}; not running the command"),
        );
        report::outcome(
            "signalled",
            Some(format!("signal {signal} while acquiring")),
        );
        return Ok(signalled(signal));
    }
    // From here a ^Z is job control's (the command is stopped with the
    // job); `redmutex` stopped before this point (or for longer than the
    // lease) finds out here.
    let control = supervise::JobControl::install();
    let lost_before = guard.loss_signal().reason();
    if lost_before.is_some() || guard.validity() <= kill_after {
        let _ = guard.unlock();
        let why = lost_before.map_or_else(|| "it ran low".to_owned(), |r| r.to_string());
        warn(format_args!(
            "lost {what} before the command started ({why}); not running it"
        ));
        report::outcome("lost", Some(format!("before the command started: {why}")));
        return Ok(EXIT_LOST);
    }
    let foreground = Foreground::ours();
    isolate(&mut command, &foreground, inherited, watcher);
    // A process the command starts outside its group (a daemon, a
    // `setsid` or `timeout` helper) stays a descendant of ours, to be seen
    // and ended with it (Linux).
    let follows = supervise::become_subreaper();
    if args.daemon && !follows {
        foreground.give_back(None);
        let _ = guard.unlock();
        return Err(fail(
            EXIT_OSERR,
            "--daemon needs Linux (a child subreaper) to follow a command's daemons",
        ));
    }
    let mut job = Job {
        cli,
        args,
        what: &what,
        target: &target,
        pid: 0,
        watcher,
        foreground: &foreground,
        forwarded: &forwarded,
        control,
        lost: guard.loss_signal(),
        guard: Some(guard),
        kill_after,
        ending: Ending::Running,
        terminated_at: None,
        killed: false,
        stop_asked: false,
        stopped: false,
        told: 0,
        follows,
        daemons: Vec::new(),
        descendants: 0,
        scanned: None,
        tick: (args.ttl / 10).clamp(Duration::from_millis(1), Duration::from_millis(25)),
        warned_watcher: false,
    };
    // The watcher's dead man's switch is armed before the command runs.
    job.tell_watcher(true);
    let child = match command.spawn() {
        Ok(child) => child,
        Err(err) => {
            // A child that failed in `pre_exec` named its group, and is
            // reaped already.
            if let Some(watcher) = watcher {
                watcher.forget_group();
                watcher.deadline(0);
            }
            foreground.give_back(None);
            let _ = job.release();
            let failure = not_started(program, &err);
            report::outcome("not_started", Some(failure.message.clone()));
            return Err(failure);
        }
    };
    let Ok(pid) = libc::pid_t::try_from(child.id()) else {
        // Unreachable on any kernel (pids fit an i32); the group is
        // unknown, so the watcher's parent-death signal is what is left.
        return Err(fail(EXIT_OSERR, "the command's pid is out of range"));
    };
    job.pid = pid;
    let started = Instant::now();
    report::started(job.guard.as_ref().and_then(Held::fencing_token));
    let supervised = job.supervise(started);
    foreground.give_back(Some(pid));
    if supervised.is_ok() && matches!(job.ending, Ending::Running) && args.daemon {
        job.follow_daemons(started);
    }
    if supervised.is_err() || !matches!(job.ending, Ending::Running) {
        // Whatever the command left in its group, or started outside it,
        // does not run on unlocked.
        job.kill(libc::SIGKILL);
    }
    // Reaped only now: until then the command's pid, and so its group's
    // number, cannot name another process's group. The watcher forgets the
    // group first, and what was followed outside it (left alone after a
    // normal end, killed above otherwise).
    if let Some(watcher) = watcher {
        watcher.forget_group();
        watcher.deadline(0);
        for process in &job.daemons {
            watcher.forget_process(process.pid);
        }
    }
    let status = supervise::reap(pid);
    let status = match (supervised, status) {
        (Ok(()), Ok(status)) => status,
        (Err(err), _) | (_, Err(err)) => {
            let _ = job.release();
            return Err(fail(EXIT_OSERR, format!("waiting for the command: {err}")));
        }
    };
    job.daemons.clear();
    report::command(status);
    // Killed by the watcher: `redmutex` was stopped (or hung) past the
    // lease's deadline by the local clock.
    if matches!(job.ending, Ending::Running) && job.overdue(status) {
        warn(format_args!(
            "redmutex could not renew {what} in time (it was stopped or hung) and \
             its watcher killed the command before the lease ran out"
        ));
        job.ending = Ending::Overdue;
    }
    if matches!(job.ending, Ending::Running | Ending::MaxRun)
        && !job.stop_asked
        && let Some(reason) = hold_at_least(cli, args, started, &job.lost, &forwarded, &job.control)
    {
        warn(format_args!("lost {what} during --min-hold ({reason})"));
        report::outcome("lost", Some(format!("during --min-hold: {reason}")));
        let _ = job.release();
        return Ok(EXIT_LOST);
    }
    match job.ending {
        Ending::Lost(_) | Ending::LowValidity(_) | Ending::LostWhileStopped | Ending::Overdue => {
            report::outcome("lost", Some(job.ending.reason()));
            let _ = job.release();
            Ok(EXIT_LOST)
        }
        Ending::MaxRun => {
            report::outcome("max_run", None);
            let _ = job.release();
            Ok(EXIT_MAX_RUN)
        }
        Ending::Running => {
            report::outcome("finished", None);
            match job.release() {
                Ok(()) => verbose(cli, format_args!("released {what}")),
                Err(err) => say(cli, format_args!("releasing {what}: {err}")),
            }
            Ok(exit_code_of(status))
        }
    }
}

/// Whether a stop is job control's (the terminal's ^Z, a read or write of
/// it from the background), which stops the whole job. A SIGSTOP sent to
/// the command alone (a debugger, `kill -STOP`) stops only it, as it
/// would without `redmutex`.
fn job_stop(signal: i32) -> bool {
    matches!(signal, libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU)
}

/// The command under way, and what `redmutex` does about it.
struct Job<'a> {
    cli: &'a Cli,
    args: &'a RunArgs,
    what: &'a str,
    target: &'a Target,
    /// The command's pid, and its process group's.
    pid: libc::pid_t,
    watcher: Option<&'a supervise::Watcher>,
    foreground: &'a Foreground,
    forwarded: &'a Forwarded,
    control: supervise::JobControl,
    /// What is held (taken again after a stop, when it was lost and
    /// could be), and its loss signal.
    guard: Option<Held>,
    lost: redmutex::LossSignal,
    kill_after: Duration,
    ending: Ending,
    terminated_at: Option<Instant>,
    killed: bool,
    /// A signal was passed on: no --min-hold after the command ends.
    stop_asked: bool,
    /// The job is stopped by job control and `redmutex` was not (its group
    /// is orphaned): it resumes on the next SIGCONT `redmutex` gets.
    stopped: bool,
    /// The deadline last sent to the watcher (monotonic nanoseconds).
    told: i64,
    /// `redmutex` is the command's descendants' subreaper, and looks for
    /// them (Linux).
    follows: bool,
    /// The processes the command started outside its group, as last found
    /// (its group is signalled as one).
    daemons: Vec<supervise::Tracked>,
    /// How many of the command's descendants were alive at the last look.
    descendants: usize,
    /// When the command's descendants were last looked for.
    scanned: Option<Instant>,
    /// How often the loop looks at the command and the lease: often
    /// enough for the shortest ttl to be supervised.
    tick: Duration,
    /// The watcher was found gone, and it was said.
    warned_watcher: bool,
}

/// How far the lease's deadline may move before the watcher is told: every
/// renewal moves it by a third of the ttl, far more than this.
const TELL_AFTER_NS: u64 = 1_000_000;

/// How many times a SIGKILL or SIGSTOP looks for processes forked
/// meanwhile (see `Job::kill`): each look ends with nothing new in one or
/// two in practice.
const CONVERGE_ROUNDS: usize = 100;

/// How often the command's descendants are looked for.
const SCAN_EVERY: Duration = Duration::from_secs(1);

impl Job<'_> {
    /// What is left of the lease by the local clock.
    fn validity(&self) -> Duration {
        self.guard.as_ref().map_or(Duration::ZERO, Held::validity)
    }

    /// Releases what is held (owner-checked), if anything.
    fn release(&mut self) -> Result<(), Error> {
        self.guard.take().map_or(Ok(()), Held::unlock)
    }

    /// Watches the command until it exits (it is not reaped: see
    /// `supervise::reap`): its stops and `redmutex`'s (job control), the
    /// signals to pass on, the lease, `--max-run`.
    fn supervise(&mut self, started: Instant) -> std::io::Result<()> {
        loop {
            match supervise::poll(self.pid)? {
                supervise::Child::Exited => return Ok(()),
                // Stopped by the terminal (^Z while it has it, a read or
                // write from the background), or stopping itself in the
                // terminal's foreground (an editor's ^Z is a SIGSTOP to
                // its own group): the whole job stops, as a shell's would.
                supervise::Child::Stopped(signal)
                    if job_stop(signal) || self.foreground.is_with(self.pid) =>
                {
                    self.suspend(signal);
                }
                supervise::Child::Stopped(_) | supervise::Child::Running => {}
            }
            if let Some(signal) = self.control.stop_asked() {
                // ^Z sent to `redmutex` (the command did not have the
                // terminal), or a `kill -TSTP`: the command first.
                if supervise::stop_group(self.pid, self.pid)? {
                    return Ok(());
                }
                self.suspend(signal);
            }
            if self.control.continued() {
                if self.stopped {
                    // A job stopped in an orphaned group, continued.
                    self.resume();
                } else {
                    // `fg` of a job that ran in the background: the
                    // terminal goes on to the command.
                    self.foreground.hand_over(self.pid);
                }
            }
            self.pass_on();
            self.watch_lease(Some(started));
            self.tell_watcher(false);
            self.scan(false);
            // Wakes at once on a loss, else polls the child and signals.
            self.lost.wait_timeout(self.tick);
        }
    }

    /// Passes a signal `redmutex` received on to the command's group (and
    /// what it started outside it). A stopped job is continued to take it,
    /// as a shell's `kill` does, after the lease is checked.
    fn pass_on(&mut self) {
        let Some(signal) = self.forwarded() else {
            return;
        };
        verbose(
            self.cli,
            format_args!("passing signal {signal} to the command"),
        );
        self.kill(signal);
        // Asked to stop: no --min-hold after the command ends.
        self.stop_asked = true;
        if self.stopped {
            self.resume();
        } else {
            // Stopped by someone else (`kill -STOP`): it could not act on
            // the signal otherwise.
            self.kill(libc::SIGCONT);
        }
    }

    /// Whether the command ended by a SIGKILL from the watcher: the
    /// deadline last told had passed.
    fn overdue(&self, status: ExitStatus) -> bool {
        use std::os::unix::process::ExitStatusExt;
        self.watcher.is_some()
            && self.told != 0
            && status.signal() == Some(libc::SIGKILL)
            && supervise::monotonic_ns() >= self.told
    }

    fn forwarded(&self) -> Option<i32> {
        self.forwarded.take()
    }

    /// Tells the watcher when the lease runs out by the local clock, less
    /// the SIGKILL's margin, whenever that moved (after a renewal): if
    /// `redmutex` stops telling it (stopped by SIGSTOP, hung), the watcher
    /// ends the command then. Not after a loss: `redmutex` is ending the
    /// command itself, with the SIGTERM's grace, and the deadline last sent
    /// still bounds it.
    fn tell_watcher(&mut self, force: bool) {
        let Some(watcher) = self.watcher else {
            return;
        };
        if self.lost.reason().is_some() {
            return;
        }
        let left = self.validity().saturating_sub(self.kill_after / 4);
        let left = i64::try_from(left.as_nanos()).unwrap_or(i64::MAX);
        // Never 0, which means "no deadline".
        let deadline = supervise::monotonic_ns().saturating_add(left).max(1);
        if force || deadline.abs_diff(self.told) > TELL_AFTER_NS {
            watcher.deadline(deadline);
            self.told = deadline;
        }
        if watcher.failed() && !self.warned_watcher {
            self.warned_watcher = true;
            warn(format_args!(
                "the watcher process is gone: if redmutex is killed or stopped now, \
                 only the parent-death signal ends the command"
            ));
        }
    }

    /// The lease, watched while the command (or its daemons) runs: a loss
    /// or a lease running low terminates the command, `--max-run` too,
    /// and a SIGKILL follows when it does not go in time.
    fn watch_lease(&mut self, started: Option<Instant>) {
        // The job was stopped and a SIGCONT is on its way to `resume`,
        // which decides on the lease: acting here first would race with it
        // (the stop `stop_job` sends itself can land after it returned, and
        // the SIGCONT then finds this loop looking at a lease that ran out
        // while stopped). A job continued by someone else is watched as
        // usual.
        if self.stopped && self.control.continue_pending() {
            return;
        }
        let validity = self.validity();
        // The lease is watched after --max-run fired too: a loss while the
        // command is being terminated ends it as fast as any loss does.
        if matches!(self.ending, Ending::Running | Ending::MaxRun) {
            let next = if let Some(reason) = self.lost.reason() {
                Ending::Lost(reason)
            } else if validity <= self.kill_after {
                Ending::LowValidity(validity)
            } else if matches!(self.ending, Ending::Running)
                && started.is_some_and(|at| self.args.max_run.is_some_and(|d| at.elapsed() >= d))
            {
                Ending::MaxRun
            } else {
                Ending::Running
            };
            if !matches!(next, Ending::Running) {
                let what = self.what;
                match &next {
                    Ending::Running | Ending::LostWhileStopped | Ending::Overdue => {}
                    Ending::MaxRun => warn(format_args!(
                        "the command ran longer than --max-run; terminating it"
                    )),
                    Ending::Lost(reason) => warn(format_args!(
                        "lost {what} ({reason}); terminating the command"
                    )),
                    Ending::LowValidity(left) => warn(format_args!(
                        "cannot renew {what} and {left:?} of it is left; \
                         terminating the command before it runs out"
                    )),
                }
                self.kill(libc::SIGTERM);
                // A stopped job must run to take its SIGTERM.
                self.kill(libc::SIGCONT);
                // A loss after --max-run keeps the first SIGTERM's time:
                // its grace is the shorter one.
                self.terminated_at.get_or_insert_with(Instant::now);
                self.ending = next;
            }
        }
        // A lease running low: SIGKILL with a quarter of --kill-after left.
        // A lease already lost (validity reads zero): a quarter of it as
        // grace after the SIGTERM.
        let kill_after = self.kill_after;
        let due = match (&self.ending, self.terminated_at) {
            (Ending::LowValidity(_), Some(at)) => {
                validity <= kill_after / 4 || at.elapsed() >= kill_after
            }
            (Ending::Lost(_), Some(at)) => at.elapsed() >= kill_after / 4,
            (Ending::MaxRun, Some(at)) => at.elapsed() >= kill_after,
            _ => false,
        };
        if due && !self.killed {
            warn(format_args!(
                "the command is still running with {validity:?} of the lease left; killing it"
            ));
            self.kill(libc::SIGKILL);
            self.killed = true;
        }
    }

    /// Signals the command's whole process group (its children included:
    /// the grandchildren of `sh -c` go too), and every process it started
    /// outside it, as found now: the descendants are looked for again at
    /// every signal, never taken from the last periodic look (a `setsid`
    /// or `timeout` helper started a moment ago is among them). As their
    /// subreaper, `redmutex` is an ancestor of every one of them while it
    /// lives, orphans included (Linux).
    ///
    /// A SIGKILL or SIGSTOP is repeated until a look finds nothing new to
    /// signal: a process signalled may have forked just before the signal
    /// landed, and its child is found by the next look. Once one of those
    /// signals is delivered no process forks again (the kernel refuses a
    /// fork with a fatal signal pending; a stopped process runs nothing),
    /// so the looks end; they are bounded all the same.
    fn kill(&mut self, signal: i32) {
        signal_group(self.pid, signal);
        self.scan(true);
        for process in &self.daemons {
            process.signal(signal);
        }
        if !(signal == libc::SIGKILL || signal == libc::SIGSTOP) || !self.follows {
            return;
        }
        let mut signalled: Vec<(libc::pid_t, i64)> =
            self.daemons.iter().map(|p| (p.pid, p.start())).collect();
        let mut except = vec![self.pid];
        except.extend(self.watcher.map(supervise::Watcher::pid));
        for _ in 0..CONVERGE_ROUNDS {
            let found = supervise::Descendants::scan(&except);
            let mut new = 0;
            for (pid, start, group, state) in found.alive {
                let done = match signal {
                    // Stopped (or being traced): nothing more to do.
                    libc::SIGSTOP => matches!(state, 'T' | 't'),
                    _ => signalled.contains(&(pid, start)),
                };
                // Members of the command's group got the group's signal;
                // a SIGSTOP is checked on them all the same.
                if done || (group == self.pid && signal == libc::SIGKILL) {
                    continue;
                }
                if let Some(process) = supervise::Tracked::open(pid, start) {
                    process.signal(signal);
                }
                signalled.push((pid, start));
                new += 1;
            }
            if new == 0 {
                break;
            }
            // A signal is delivered when its target next runs: a moment.
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// The command is stopped: the rest of its job too (a read from the
    /// background stops only the reader), then `redmutex`'s own group, so
    /// the shell says so and gets its prompt back. When it is continued
    /// (`fg`, `bg`), the lease is checked before the command runs again.
    fn suspend(&mut self, signal: i32) {
        verbose(
            self.cli,
            format_args!("the command stopped; stopping the job"),
        );
        self.kill(libc::SIGSTOP);
        // The terminal back to our group while the command has it: the
        // shell takes it from there.
        self.foreground.take_back(self.pid);
        // Past the deadline the watcher keeps the job stopped rather than
        // killing it: `fg` decides.
        if let Some(watcher) = self.watcher {
            watcher.stopped(true);
        }
        self.stopped = true;
        if self.control.stop_job(signal) {
            self.resume();
        }
        // Else `redmutex`'s group is orphaned and the kernel dropped its
        // stop: `redmutex` runs on, the lease renewed, and the job waits
        // stopped for a SIGCONT to `redmutex`.
    }

    /// After a stop: the command runs again only under a live lease. The
    /// lease is kept when Redis still holds it and the local clock gives it
    /// more than `--kill-after`; one lost meanwhile (expired, taken, run
    /// out by the local clock, or about to: the watchdog was stopped too)
    /// is released if still ours and taken again when it can be (free,
    /// and no fencing token the command already has would be wrong);
    /// otherwise the command is killed before it runs another
    /// instruction.
    fn resume(&mut self) {
        self.stopped = false;
        let held = self.guard.as_ref().map_or(Ok(false), Held::is_held);
        // Why, in the words of a stop (the watchdog, stopped too, would
        // blame Redis for a lease that ran out while it could not run).
        let lost = match (self.lost.reason(), held) {
            (Some(redmutex::LossReason::OwnedByOther), _) => Some("another owner took it"),
            // Ours (or Redis cannot say, and the renewals' bound still
            // holds) with time left: kept.
            (None, Ok(true) | Err(_)) if self.validity() > self.kill_after => None,
            (_, Ok(true)) => Some("it ran out by the local clock"),
            (_, Ok(false)) => Some("it expired or was taken"),
            (_, Err(_)) => Some("Redis could not be asked about it"),
        };
        if let Some(reason) = lost {
            if !self.args.fencing {
                // Still ours in Redis: freed, to be taken afresh (with a
                // watchdog of its own) below.
                let _ = self.release();
            }
            let again = if self.args.fencing {
                None
            } else {
                self.target.try_once().ok().flatten()
            };
            match again {
                Some(guard) => {
                    say(
                        self.cli,
                        format_args!(
                            "{} was lost while the job was stopped ({reason}); taken again \
                             (REDMUTEX_TOKEN now names the old token)",
                            self.what
                        ),
                    );
                    self.lost = guard.loss_signal();
                    // Fencing off: nothing of the old one to keep.
                    let _ = self.release();
                    self.guard = Some(guard);
                }
                None => {
                    warn(format_args!(
                        "lost {} while the job was stopped ({reason}); killing the command",
                        self.what
                    ));
                    // Still stopped: it never runs on the lost lease.
                    self.kill(libc::SIGKILL);
                    self.killed = true;
                    self.ending = Ending::LostWhileStopped;
                    return;
                }
            }
        }
        // The new deadline first: the watcher must not act on the old one
        // once the job runs.
        self.tell_watcher(true);
        if let Some(watcher) = self.watcher {
            watcher.stopped(false);
        }
        self.foreground.hand_over(self.pid);
        self.kill(libc::SIGCONT);
    }

    /// The command's descendants, looked for again (at most once a second
    /// unless `now`; Linux): those outside its group are followed by
    /// pidfd (and named to the watcher), those gone forgotten, and orphans
    /// handed to us reaped.
    fn scan(&mut self, now: bool) {
        if !self.follows || (!now && self.scanned.is_some_and(|at| at.elapsed() < SCAN_EVERY)) {
            return;
        }
        self.scanned = Some(Instant::now());
        // The command's own process is awaited (and reaped) apart; the
        // watcher is not the command's.
        let mut except = vec![self.pid];
        except.extend(self.watcher.map(supervise::Watcher::pid));
        let found = supervise::Descendants::scan(&except);
        self.descendants = found.alive.len();
        let outside: Vec<(libc::pid_t, i64)> = found
            .alive
            .iter()
            .filter(|(_, _, group, _)| *group != self.pid)
            .map(|(pid, start, _, _)| (*pid, *start))
            .collect();
        let watcher = self.watcher;
        self.daemons.retain(|process| {
            let alive = outside.iter().any(|(pid, _)| *pid == process.pid);
            if !alive && let Some(watcher) = watcher {
                watcher.forget_process(process.pid);
            }
            alive
        });
        for (pid, start) in outside {
            if self.daemons.iter().any(|process| process.pid == pid) {
                continue;
            }
            let Some(process) = supervise::Tracked::open(pid, start) else {
                continue;
            };
            verbose(
                self.cli,
                format_args!("following process {pid}, started by the command outside its group"),
            );
            if let Some(watcher) = self.watcher {
                watcher.guard_process(&process);
            }
            self.daemons.push(process);
        }
        // After the watcher forgot them: a pid reaped may be reused.
        found.reap();
    }

    /// `--daemon`: the command exited; its lock is kept (renewed) while any
    /// process it started lives on, and ended with them on a loss.
    fn follow_daemons(&mut self, started: Instant) {
        // Killed, what is left goes within this (a process we may not
        // signal, one that changed user, is not waited for past it).
        let mut killed_at = None::<Instant>;
        loop {
            self.scan(true);
            if self.descendants == 0 {
                return;
            }
            if self.killed {
                let at = *killed_at.get_or_insert_with(Instant::now);
                if at.elapsed() >= Duration::from_secs(5) {
                    return;
                }
                self.kill(libc::SIGKILL);
                self.lost.wait_timeout(Duration::from_millis(100));
                continue;
            }
            if let Some(signal) = self.control.stop_asked() {
                self.suspend(signal);
            }
            if self.control.continued() && self.stopped {
                self.resume();
            }
            self.pass_on();
            self.watch_lease(Some(started));
            self.tell_watcher(false);
            self.lost
                .wait_timeout(self.tick.max(Duration::from_millis(1)));
        }
    }
}

/// `--min-hold`: keeps the lock (the watchdog renewing it) until that long
/// after the command started; a signal ends the wait early. Returns why
/// the lease was lost meanwhile, if it was.
fn hold_at_least(
    cli: &Cli,
    args: &RunArgs,
    started: Instant,
    lost: &redmutex::LossSignal,
    forwarded: &Forwarded,
    control: &supervise::JobControl,
) -> Option<redmutex::LossReason> {
    let until = args.min_hold.and_then(|d| started.checked_add(d))?;
    if Instant::now() < until {
        verbose(
            cli,
            format_args!("holding the lock until --min-hold has passed"),
        );
    }
    loop {
        if let Some(reason) = lost.reason() {
            return Some(reason);
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        if let Some(signal) = forwarded.take() {
            verbose(
                cli,
                format_args!("signal {signal}: releasing before --min-hold"),
            );
            return None;
        }
        // ^Z: nothing of the command runs; `redmutex` stops as asked.
        if let Some(signal) = control.stop_asked() {
            control.stop_job(signal);
        }
        lost.wait_timeout(left.min(Duration::from_millis(100)));
    }
}
