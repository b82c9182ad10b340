//! `redmutex run`: take the lock, run the command in its own process group
//! with signals forwarded, keep the lease, and end the command if it is lost.

#[allow(unused_imports)]
use super::*;

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
                    eprint!(
                        "\r\x1b[2K{} waiting {:.0}s for {key:?}: {held}",
                        frames[frame % frames.len()],
                        started.elapsed().as_secs_f64()
                    );
                    let _ = std::io::stderr().flush();
                    frame += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
                eprint!("\r\x1b[2K");
                let _ = std::io::stderr().flush();
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
            .map_err(|e| fail(EXIT_UNAVAILABLE, format!("cannot handle signals: {e}")))?;
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

/// The terminal's foreground group, handed to the command while it runs
/// when `redmutex` itself has it (so an interactive command can read the
/// terminal), and taken back after.
///
/// Meanwhile `redmutex` is a background group on that terminal: with
/// `stty tostop` its own writes to the terminal (a loss message) would stop
/// it with SIGTTOU, watchdog and all, while the command ran on. So it
/// ignores SIGTTOU until it has the terminal back; the command gets the
/// disposition `redmutex` found.
struct Foreground {
    /// Standard input is a terminal: `redmutex`'s group may be its
    /// foreground now or later (`fg`).
    tty: bool,
    /// `redmutex`'s group had the terminal at the start: the command gets
    /// it as it starts.
    ours: Option<libc::pid_t>,
    /// The SIGTTOU disposition found at start, restored in the command and
    /// at the end.
    ttou: libc::sighandler_t,
}

impl Foreground {
    fn ours() -> Foreground {
        // SAFETY: tcgetpgrp and getpgrp only read the process's state;
        // signal(2) swaps a disposition, put back in give_back.
        unsafe {
            let pgrp = libc::getpgrp();
            let tty = libc::isatty(libc::STDIN_FILENO) == 1;
            let ours = (tty && libc::tcgetpgrp(libc::STDIN_FILENO) == pgrp).then_some(pgrp);
            // On a terminal `redmutex` is a background group while the
            // command has it (or while the job runs after `bg`): ignored,
            // SIGTTOU neither stops it for a message nor refuses it the
            // terminal's foreground.
            let ttou = if tty {
                libc::signal(libc::SIGTTOU, libc::SIG_IGN)
            } else {
                libc::SIG_DFL
            };
            Foreground { tty, ours, ttou }
        }
    }

    /// At the end: the terminal back to `redmutex`'s group if the
    /// command's group (`command`, when it was started) has it, and the
    /// SIGTTOU disposition found at start.
    fn give_back(&self, command: Option<libc::pid_t>) {
        if !self.tty {
            return;
        }
        // SAFETY: SIGTTOU is ignored (see `ours`), so a background group
        // may set the terminal's group; then the disposition found at
        // start is put back.
        unsafe {
            let current = libc::tcgetpgrp(libc::STDIN_FILENO);
            if command.is_some_and(|pgid| current == pgid)
                || (command.is_none() && self.ours.is_some())
            {
                libc::tcsetpgrp(libc::STDIN_FILENO, libc::getpgrp());
            }
            libc::signal(libc::SIGTTOU, self.ttou);
        }
    }

    /// The command's group stopped with the terminal: back to ours, so the
    /// job stops as one and the shell can take it.
    fn take_back(&self, command: libc::pid_t) {
        if self.tty {
            // SAFETY: SIGTTOU is ignored (see `ours`); only when the
            // command's group has the terminal.
            unsafe {
                if libc::tcgetpgrp(libc::STDIN_FILENO) == command {
                    libc::tcsetpgrp(libc::STDIN_FILENO, libc::getpgrp());
                }
            }
        }
    }

    /// The job is in the terminal's foreground again (`fg`): the command's
    /// group gets the terminal, as at the start. In the background (`bg`)
    /// it does not: a read of the terminal stops it, and the job with it.
    fn hand_over(&self, command: libc::pid_t) {
        if self.tty {
            // SAFETY: SIGTTOU is ignored (see `ours`); only while our group
            // has the terminal.
            unsafe {
                if libc::tcgetpgrp(libc::STDIN_FILENO) == libc::getpgrp() {
                    libc::tcsetpgrp(libc::STDIN_FILENO, command);
                }
            }
        }
    }
}

/// Makes the command the leader of its own process group (so a signal
/// reaches everything it started), gives it the terminal when `redmutex`
/// had it, and on Linux has the kernel kill it if `redmutex` dies (it must
/// not run on without the lock's renewals).
fn isolate(command: &mut Command, foreground: &Foreground) {
    use std::os::unix::process::CommandExt;
    command.process_group(0);
    let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    let take_terminal = foreground.ours.is_some();
    let restore_ttou = foreground.tty;
    let ttou = foreground.ttou;
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        command.pre_exec(move || {
            #[cfg(target_os = "linux")]
            {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // redmutex died before the prctl: do not run unprotected.
                if libc::getppid() != parent {
                    libc::_exit(EXIT_UNAVAILABLE.into());
                }
            }
            let _ = parent;
            if take_terminal {
                // SIGTTOU is ignored here (inherited): the call goes through.
                libc::tcsetpgrp(libc::STDIN_FILENO, libc::getpid());
            }
            if restore_ttou {
                // The command gets the disposition `redmutex` found.
                libc::signal(libc::SIGTTOU, ttou);
            }
            Ok(())
        });
    }
}

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
            Held::Lock(guard) => guard.unlock(),
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
    // First, while `redmutex` has one thread: the process that kills the
    // command if `redmutex` dies (see `supervise::Watcher`).
    let watcher = supervise::Watcher::start();
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
            SemaphoreOptions::from(&options),
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
            return Ok(signalled(signal));
        }
    };
    let Some(guard) = acquired else {
        if args.quiet_if_held {
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
        return Ok(signalled(signal));
    }
    let foreground = Foreground::ours();
    isolate(&mut command, &foreground);
    // A daemon the command forks away stays a child of ours, to be seen
    // and ended (Linux).
    if args.daemon && !supervise::become_subreaper() {
        let _ = guard.unlock();
        return Err(fail(
            EXIT_UNAVAILABLE,
            "--daemon needs Linux (a child subreaper) to follow a command's daemons",
        ));
    }
    let child = match command.spawn() {
        Ok(child) => child,
        Err(err) => {
            foreground.give_back(None);
            let name = program.to_string_lossy();
            let _ = guard.unlock();
            return Err(match err.kind() {
                std::io::ErrorKind::NotFound => {
                    fail(EXIT_NOT_FOUND, format!("{name}: command not found"))
                }
                _ => fail(
                    EXIT_CANNOT_EXECUTE,
                    format!("{name}: cannot execute: {err}"),
                ),
            });
        }
    };
    let Ok(pid) = libc::pid_t::try_from(child.id()) else {
        return Err(fail(EXIT_UNAVAILABLE, "the command's pid is out of range"));
    };
    if let Some(watcher) = &watcher {
        watcher.guard_group(pid);
    }
    let mut job = Job {
        cli,
        args,
        what: &what,
        target: &target,
        pid,
        watcher: watcher.as_ref(),
        foreground: &foreground,
        forwarded: &forwarded,
        control: supervise::JobControl::install(),
        lost: guard.loss_signal(),
        guard,
        kill_after,
        ending: Ending::Running,
        terminated_at: None,
        killed: false,
        stop_asked: false,
        daemons: Vec::new(),
    };
    let started = Instant::now();
    let status = match job.supervise(started) {
        Ok(status) => status,
        Err(err) => {
            job.kill(libc::SIGKILL);
            foreground.give_back(Some(pid));
            let _ = job.guard.unlock();
            return Err(fail(
                EXIT_UNAVAILABLE,
                format!("waiting for the command: {err}"),
            ));
        }
    };
    foreground.give_back(Some(pid));
    if !matches!(job.ending, Ending::Running) {
        // Whatever the command left in its group does not run on unlocked.
        job.kill(libc::SIGKILL);
    } else if args.daemon {
        job.follow_daemons();
        if !matches!(job.ending, Ending::Running) {
            job.kill(libc::SIGKILL);
        }
    }
    if matches!(job.ending, Ending::Running | Ending::MaxRun)
        && !job.stop_asked
        && let Some(reason) = hold_at_least(cli, args, started, &job.lost, &forwarded)
    {
        eprintln!("redmutex: lost {what} during --min-hold ({reason})");
        let _ = job.guard.unlock();
        return Ok(EXIT_LOST);
    }
    match job.ending {
        Ending::Lost(_) | Ending::LowValidity(_) | Ending::LostWhileStopped => {
            let _ = job.guard.unlock();
            Ok(EXIT_LOST)
        }
        Ending::MaxRun => {
            let _ = job.guard.unlock();
            Ok(EXIT_MAX_RUN)
        }
        Ending::Running => {
            match job.guard.unlock() {
                Ok(()) => verbose(cli, format_args!("released {what}")),
                Err(err) => say(cli, format_args!("releasing {what}: {err}")),
            }
            Ok(exit_code_of(status))
        }
    }
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
    guard: Held,
    lost: redmutex::LossSignal,
    kill_after: Duration,
    ending: Ending,
    terminated_at: Option<Instant>,
    killed: bool,
    /// A signal was passed on: no --min-hold after the command ends.
    stop_asked: bool,
    /// Processes the command left outside its group (with --daemon).
    daemons: Vec<libc::pid_t>,
}

impl Job<'_> {
    /// Watches the command until it exits: its stops and `redmutex`'s
    /// (job control), the signals to pass on, the lease, `--max-run`.
    fn supervise(&mut self, started: Instant) -> std::io::Result<ExitStatus> {
        loop {
            match supervise::poll(self.pid)? {
                supervise::Child::Exited(status) => return Ok(status),
                // Stopped by the terminal (^Z while it has it, a read or
                // write from the background): the whole job stops.
                supervise::Child::Stopped(signal) => self.suspend(signal),
                supervise::Child::Running => {}
            }
            if let Some(signal) = self.control.stop_asked() {
                // ^Z sent to `redmutex` (the command did not have the
                // terminal), or a `kill -TSTP`: the command first.
                if let Some(status) = supervise::stop_group(self.pid, self.pid)? {
                    return Ok(status);
                }
                self.suspend(signal);
            }
            if self.control.continued() {
                // `fg` of a job that ran in the background: the terminal
                // goes on to the command.
                self.foreground.hand_over(self.pid);
            }
            if let Some(signal) = self.forwarded() {
                verbose(
                    self.cli,
                    format_args!("passing signal {signal} to the command"),
                );
                self.kill(signal);
                // Asked to stop: no --min-hold after the command ends.
                self.stop_asked = true;
            }
            self.watch_lease(Some(started));
            // Wakes at once on a loss, else polls the child and signals.
            self.lost.wait_timeout(Duration::from_millis(25));
        }
    }

    fn forwarded(&self) -> Option<i32> {
        self.forwarded.take()
    }

    /// The lease, watched while the command (or its daemons) runs: a loss
    /// or a lease running low terminates the command, `--max-run` too,
    /// and a SIGKILL follows when it does not go in time.
    fn watch_lease(&mut self, started: Option<Instant>) {
        let validity = self.guard.validity();
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
                    Ending::Running | Ending::LostWhileStopped => {}
                    Ending::MaxRun => {
                        eprintln!("redmutex: the command ran longer than --max-run; terminating it")
                    }
                    Ending::Lost(reason) => {
                        eprintln!("redmutex: lost {what} ({reason}); terminating the command")
                    }
                    Ending::LowValidity(left) => eprintln!(
                        "redmutex: cannot renew {what} and {left:?} of it is left; \
                         terminating the command before it runs out"
                    ),
                }
                self.kill(libc::SIGTERM);
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
            eprintln!(
                "redmutex: the command is still running with {validity:?} of the lease left; killing it"
            );
            self.kill(libc::SIGKILL);
            self.killed = true;
        }
    }

    /// Signals the command's whole process group (its children included:
    /// the grandchildren of `sh -c` go too), and the daemons it left.
    fn kill(&self, signal: i32) {
        signal_group(self.pid, signal);
        for daemon in &self.daemons {
            // SAFETY: kill(2) of a process the command started (our child
            // as its subreaper); one already gone gets ESRCH.
            unsafe { libc::kill(*daemon, signal) };
        }
    }

    /// The command is stopped: `redmutex`'s own job stops too, so the
    /// shell says so and gets its prompt back. When it is continued (`fg`,
    /// `bg`), the lease is checked before the command runs again.
    fn suspend(&mut self, signal: i32) {
        verbose(
            self.cli,
            format_args!("the command stopped; stopping the job"),
        );
        // The terminal back to our group while the command has it: the
        // shell takes it from there.
        self.foreground.take_back(self.pid);
        self.control.stop_job(signal);
        self.resume();
    }

    /// After a stop: the command runs again only under a live lease. One
    /// lost meanwhile (expired, taken, or run out by the local clock) is
    /// taken again when it can be (free, and no fencing token the command
    /// already has would be wrong); otherwise the command is killed before
    /// it runs another instruction.
    fn resume(&mut self) {
        let lost = self.lost.reason().or_else(|| match self.guard.is_held() {
            Ok(false) => Some(redmutex::LossReason::Expired),
            // Unreachable: not known lost; the renewals' bound applies.
            _ => None,
        });
        if let Some(reason) = lost {
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
                    let old = std::mem::replace(&mut self.guard, guard);
                    let _ = old.unlock();
                }
                None => {
                    eprintln!(
                        "redmutex: lost {} while the job was stopped ({reason}); killing the command",
                        self.what
                    );
                    // Still stopped: it never runs on the lost lease.
                    self.kill(libc::SIGKILL);
                    self.killed = true;
                    self.ending = Ending::LostWhileStopped;
                    return;
                }
            }
        }
        self.foreground.hand_over(self.pid);
        self.kill(libc::SIGCONT);
    }

    /// `--daemon`: the command exited; its lock is kept (renewed) while any
    /// process it started lives on, and ended with them on a loss.
    fn follow_daemons(&mut self) {
        let watcher = self.watcher.map(supervise::Watcher::pid);
        loop {
            supervise::reap_orphans(watcher);
            let alive = supervise::descendants(watcher);
            if alive.is_empty() {
                return;
            }
            for pid in &alive {
                if !self.daemons.contains(pid) {
                    verbose(
                        self.cli,
                        format_args!("keeping the lock while process {pid} runs"),
                    );
                    self.daemons.push(*pid);
                    if let Some(watcher) = self.watcher {
                        watcher.guard_process(*pid);
                    }
                }
            }
            if let Some(signal) = self.forwarded() {
                self.kill(signal);
                self.stop_asked = true;
            }
            self.watch_lease(None);
            self.lost.wait_timeout(Duration::from_millis(100));
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
        lost.wait_timeout(left.min(Duration::from_millis(100)));
    }
}
