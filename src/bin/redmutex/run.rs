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
fn signal_group(pgid: u32, signal: i32) {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return;
    };
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
            let ours = (libc::isatty(libc::STDIN_FILENO) == 1
                && libc::tcgetpgrp(libc::STDIN_FILENO) == pgrp)
                .then_some(pgrp);
            let ttou = if ours.is_some() {
                libc::signal(libc::SIGTTOU, libc::SIG_IGN)
            } else {
                libc::SIG_DFL
            };
            Foreground { ours, ttou }
        }
    }

    fn give_back(&self) {
        if let Some(pgrp) = self.ours {
            // SAFETY: SIGTTOU is ignored since `ours`, so a background
            // group may set the terminal's group; then the disposition
            // found at start is put back.
            unsafe {
                libc::tcsetpgrp(libc::STDIN_FILENO, pgrp);
                libc::signal(libc::SIGTTOU, self.ttou);
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
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(err) => {
            foreground.give_back();
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
    let started = Instant::now();
    let pgid = child.id();
    let lost = guard.loss_signal();
    let mut ending = Ending::Running;
    let mut terminated_at: Option<Instant> = None;
    let mut killed = false;
    let mut stop_asked = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(err) => {
                signal_group(pgid, libc::SIGKILL);
                foreground.give_back();
                let _ = guard.unlock();
                return Err(fail(
                    EXIT_UNAVAILABLE,
                    format!("waiting for the command: {err}"),
                ));
            }
        }
        if let Some(signal) = forwarded.take() {
            verbose(cli, format_args!("passing signal {signal} to the command"));
            signal_group(pgid, signal);
            // Asked to stop: no --min-hold after the command ends.
            stop_asked = true;
        }
        let validity = guard.validity();
        // The lease is watched after --max-run fired too: a loss while the
        // command is being terminated ends it as fast as any loss does.
        if matches!(ending, Ending::Running | Ending::MaxRun) {
            let next = if let Some(reason) = lost.reason() {
                Ending::Lost(reason)
            } else if validity <= kill_after {
                Ending::LowValidity(validity)
            } else if matches!(ending, Ending::Running)
                && args.max_run.is_some_and(|d| started.elapsed() >= d)
            {
                Ending::MaxRun
            } else {
                Ending::Running
            };
            if !matches!(next, Ending::Running) {
                match &next {
                    Ending::Running => {}
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
                signal_group(pgid, libc::SIGTERM);
                // A loss after --max-run keeps the first SIGTERM's time:
                // its grace is the shorter one.
                terminated_at.get_or_insert_with(Instant::now);
                ending = next;
            }
        }
        // A lease running low: SIGKILL with a quarter of --kill-after left.
        // A lease already lost (validity reads zero): a quarter of it as
        // grace after the SIGTERM.
        let due = match (&ending, terminated_at) {
            (Ending::LowValidity(_), Some(at)) => {
                validity <= kill_after / 4 || at.elapsed() >= kill_after
            }
            (Ending::Lost(_), Some(at)) => at.elapsed() >= kill_after / 4,
            (Ending::MaxRun, Some(at)) => at.elapsed() >= kill_after,
            _ => false,
        };
        if due && !killed {
            eprintln!(
                "redmutex: the command is still running with {validity:?} of the lease left; killing it"
            );
            signal_group(pgid, libc::SIGKILL);
            killed = true;
        }
        // Wakes at once on a loss, else polls the child and signals.
        lost.wait_timeout(Duration::from_millis(25));
    };
    foreground.give_back();
    if !matches!(ending, Ending::Running) {
        // Whatever the command left in its group does not run on unlocked.
        signal_group(pgid, libc::SIGKILL);
    }
    if matches!(ending, Ending::Running | Ending::MaxRun) && !stop_asked {
        hold_at_least(cli, args, started, &lost, &forwarded);
    }
    if matches!(ending, Ending::Lost(_) | Ending::LowValidity(_)) {
        let _ = guard.unlock();
        return Ok(EXIT_LOST);
    }
    if matches!(ending, Ending::MaxRun) {
        let _ = guard.unlock();
        return Ok(EXIT_MAX_RUN);
    }
    match guard.unlock() {
        Ok(()) => verbose(cli, format_args!("released {what}")),
        Err(err) => say(cli, format_args!("releasing {what}: {err}")),
    }
    Ok(exit_code_of(status))
}

/// `--min-hold`: keeps the lock (the watchdog renewing it) until that long
/// after the command started; a signal or a loss ends the wait early.
fn hold_at_least(
    cli: &Cli,
    args: &RunArgs,
    started: Instant,
    lost: &redmutex::LossSignal,
    forwarded: &Forwarded,
) {
    let Some(until) = args.min_hold.and_then(|d| started.checked_add(d)) else {
        return;
    };
    if Instant::now() < until {
        verbose(
            cli,
            format_args!("holding the lock until --min-hold has passed"),
        );
    }
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() || lost.reason().is_some() {
            return;
        }
        if let Some(signal) = forwarded.take() {
            verbose(
                cli,
                format_args!("signal {signal}: releasing before --min-hold"),
            );
            return;
        }
        lost.wait_timeout(left.min(Duration::from_millis(100)));
    }
}
