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
    fn start(cli: &Cli, client: &LockClient, keys: &[String], limit: Option<u32>) -> Spinner {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = (!cli.quiet && std::io::stderr().is_terminal()).then(|| {
            let (stop, client, keys) = (stop.clone(), client.clone(), keys.to_vec());
            let key = keys.join(",");
            std::thread::spawn(move || {
                let frames = ['⠋', '⠙', '⠹', '⠸', '⠼', '⠴', '⠦', '⠧', '⠇', '⠏'];
                let started = Instant::now();
                let mut frame = 0usize;
                let mut last_poll = None::<Instant>;
                let mut held = String::from("…");
                while !stop.load(Ordering::Relaxed) {
                    if last_poll.is_none_or(|t| t.elapsed() > Duration::from_millis(500)) {
                        held = match describe_any(&client, &keys, limit) {
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

/// Why the command could not be started, with its exit code: a missing
/// program (127), a
/// script whose `#!` interpreter is missing (126, as a shell says "bad
/// interpreter"), anything else exec refused (126).
fn not_started(program: &std::ffi::OsStr, err: &std::io::Error) -> Failure {
    let name = program.to_string_lossy();
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

/// What `run` takes: the lock, with `--limit` a permit of a semaphore,
/// with `--fair` the lock in queue order, with `--keys` every key at once.
enum Target {
    Lock(DistributedLock),
    Permit(Semaphore),
    /// The waiter keeps its place in the queue across the wait's slices.
    Fair(FairLock, std::cell::RefCell<redmutex::FairWaiter>),
    Multi(MultiLock),
}

/// What `run` holds while the command runs.
enum Held {
    Lock(redmutex::LockGuard),
    // Boxed: a permit is much larger than a guard.
    Permit(Box<redmutex::Permit>),
    Fair(Box<redmutex::FairGuard>),
    Multi(Box<redmutex::MultiGuard>),
}

impl Target {
    fn try_once(&self) -> Result<Option<Held>, Error> {
        Ok(match self {
            Target::Lock(lock) => lock.try_lock()?.map(Held::Lock),
            Target::Permit(semaphore) => semaphore
                .try_acquire()?
                .map(|permit| Held::Permit(Box::new(permit))),
            Target::Fair(lock, _) => lock.try_lock()?.map(|g| Held::Fair(Box::new(g))),
            Target::Multi(lock) => lock.try_lock()?.map(|g| Held::Multi(Box::new(g))),
        })
    }

    fn try_for(&self, wait: Duration) -> Result<Option<Held>, Error> {
        Ok(match self {
            Target::Lock(lock) => lock.try_lock_for(wait)?.map(Held::Lock),
            Target::Permit(semaphore) => semaphore
                .try_acquire_for(wait)?
                .map(|permit| Held::Permit(Box::new(permit))),
            Target::Fair(_, waiter) => waiter
                .borrow_mut()
                .try_lock_for(wait)?
                .map(|g| Held::Fair(Box::new(g))),
            Target::Multi(lock) => lock.try_lock_for(wait)?.map(|g| Held::Multi(Box::new(g))),
        })
    }
}

impl Held {
    /// The lock's token, or the permit's id: what `release --token` takes.
    fn token(&self) -> &str {
        match self {
            Held::Lock(guard) => guard.token(),
            Held::Permit(permit) => permit.id(),
            Held::Fair(guard) => guard.token(),
            Held::Multi(guard) => guard.token(),
        }
    }

    /// Every key's fencing token, `KEY=TOKEN,…`, for a set of keys, the
    /// keys named as the command line names them (without `prefix`).
    fn fencing_tokens(&self, prefix: &str) -> Option<String> {
        let Held::Multi(guard) = self else {
            return None;
        };
        let tokens: Vec<String> = guard
            .fencing_tokens()?
            .map(|(key, token)| format!("{}={token}", key.strip_prefix(prefix).unwrap_or(key)))
            .collect();
        Some(tokens.join(","))
    }

    fn fencing_token(&self) -> Option<u64> {
        match self {
            Held::Lock(guard) => guard.fencing_token(),
            Held::Permit(permit) => permit.fencing_token(),
            Held::Fair(guard) => guard.fencing_token(),
            Held::Multi(guard) => guard.fencing_token(),
        }
    }

    fn loss_signal(&self) -> redmutex::LossSignal {
        match self {
            Held::Lock(guard) => guard.loss_signal(),
            Held::Permit(permit) => permit.loss_signal(),
            Held::Fair(guard) => guard.loss_signal(),
            Held::Multi(guard) => guard.loss_signal(),
        }
    }

    fn validity(&self) -> Duration {
        match self {
            Held::Lock(guard) => guard.validity(),
            Held::Permit(permit) => permit.validity(),
            Held::Fair(guard) => guard.validity(),
            Held::Multi(guard) => guard.validity(),
        }
    }

    fn unlock(self) -> Result<(), Error> {
        match self {
            Held::Lock(guard) => guard.unlock().map(|_| ()),
            Held::Permit(permit) => permit.release(),
            Held::Fair(guard) => guard.unlock().map(|_| ()),
            Held::Multi(guard) => guard.unlock().map(|_| ()),
        }
    }
}

/// Takes the lock (or a permit), waiting in slices so a signal ends the
/// wait. `Err(signal)` when one arrived; nothing is held then.
fn acquire(
    target: &Target,
    args: &RunArgs,
    forwarded: &supervise::Forwarded,
) -> Result<Result<Option<Held>, Error>, i32> {
    if args.no_wait {
        let acquired = target.try_once();
        return match forwarded.take().map(|f| f.signal) {
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
        if let Some(signal) = forwarded.take().map(|f| f.signal) {
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

/// A run ended by ^C (or ^\\) dies by that signal once everything is
/// done (the lock released, the report written), as flock(1) does, so a
/// shell running it from a script stops the script too: a shell takes an
/// exit code of 130 for a signal the command handled, and carries on.
/// Only when `redmutex` itself received the signal, and its exit code
/// says the signal ended the run.
pub(super) fn die_as_asked(code: u8) {
    for signal in [libc::SIGINT, libc::SIGQUIT] {
        if code == signalled(signal)
            && supervise::received(signal)
            && !supervise::ignored_on_entry(signal)
        {
            // SAFETY: the default action for the signal, then the signal
            // to this process: it ends here (or, were it blocked, the exit
            // code below says the same).
            unsafe {
                libc::signal(signal, libc::SIG_DFL);
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, signal);
                libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
                libc::raise(signal);
            }
        }
    }
}

/// The key of a run without one: the same for the same command line (and
/// `--limit`) on every host and version (FNV-1a, 64 bits, over the
/// arguments' bytes, each ended by a NUL). As with run-one, it is the
/// command line as typed: `./job.sh` in two directories is one key.
/// Who holds the first of `keys` that is held (named with its key when
/// there are several), `None` when all are free.
fn describe_any(
    client: &LockClient,
    keys: &[String],
    limit: Option<u32>,
) -> Result<Option<String>, Failure> {
    for key in keys {
        if let Some(who) = describe(client, key, limit)? {
            return Ok(Some(if keys.len() > 1 {
                format!("{key:?} {who}")
            } else {
                who
            }));
        }
    }
    Ok(None)
}

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
    Inherited::take();
    // First, while `redmutex` has one thread: the process that kills the
    // command if `redmutex` dies or stops renewing (see
    // `supervise::Watcher`).
    let mut watcher = supervise::Watcher::start();
    let outcome = run_watched(cli, args, watcher.as_ref());
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
    watcher: Option<&supervise::Watcher>,
) -> Result<u8, Failure> {
    if args.keys.iter().any(String::is_empty) {
        return Err(fail(EXIT_USAGE, "--keys: a key must not be empty"));
    }
    let key = match &args.key {
        Some(key) if key.is_empty() => {
            return Err(fail(EXIT_USAGE, "the lock key must not be empty"));
        }
        Some(key) => key.clone(),
        None if !args.keys.is_empty() => args.keys.join(","),
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
    let forwarded = supervise::Forwarded::install()
        .map_err(|e| fail(EXIT_OSERR, format!("cannot handle signals: {e}")))?;
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
        None if !args.keys.is_empty() => Target::Multi(MultiLock::with_options(
            &client,
            args.keys.iter().cloned(),
            options.for_multi(),
        )),
        None if args.fair => {
            let lock = FairLock::with_options(&client, key.clone(), options.for_fair());
            let waiter = std::cell::RefCell::new(lock.waiter());
            Target::Fair(lock, waiter)
        }
        None => Target::Lock(DistributedLock::with_options(&client, key.clone(), options)),
    };
    // The keys whose holders a message names: the set's, or the one key.
    let shown_keys: Vec<String> = match &target {
        Target::Multi(lock) => lock
            .keys()
            .map(|k| {
                k.strip_prefix(cli.key_prefix.as_str())
                    .unwrap_or(k)
                    .to_owned()
            })
            .collect(),
        _ => vec![key.clone()],
    };
    let what = match (args.limit, &target) {
        (Some(limit), _) => format!("a permit of {key:?} (limit {limit})"),
        (None, Target::Multi(_)) => format!("the keys {shown_keys:?}, all at once"),
        (None, Target::Fair(..)) => format!("the lock {key:?}, in queue order"),
        _ => format!("the lock {key:?}"),
    };
    verbose(
        cli,
        format_args!("acquiring {what} at {}", redact(&cli.url)),
    );
    // While waiting, ^Z stops `redmutex` by the default action (nothing
    // is held); the lease taken is checked after, before the command
    // starts.
    let acquired = {
        let _spinner =
            (!args.no_wait).then(|| Spinner::start(cli, &client, &shown_keys, args.limit));
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
                && let Ok(Some(who)) = describe_any(&client, &shown_keys, args.limit)
            {
                report::holder(who);
            }
            verbose(
                cli,
                format_args!("{key:?} is held elsewhere; not running the command"),
            );
            return Ok(0);
        }
        let who = match describe_any(&client, &shown_keys, args.limit) {
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

    let mut environment: Vec<(&str, OsString)> = vec![
        ("REDMUTEX_KEY", key.clone().into()),
        // A `redmutex` the command runs (a release by token, a nested run)
        // names keys as this one does.
        ("REDMUTEX_KEY_PREFIX", cli.key_prefix.clone().into()),
        ("REDMUTEX_TOKEN", guard.token().into()),
    ];
    if let Some(fence) = guard.fencing_token() {
        environment.push(("REDMUTEX_FENCING_TOKEN", fence.to_string().into()));
    }
    if let Some(fences) = guard.fencing_tokens(&cli.key_prefix) {
        environment.push(("REDMUTEX_FENCING_TOKENS", fences.into()));
    }
    // A signal that came while acquiring: the command is not started.
    if let Some(signal) = forwarded.take().map(|f| f.signal) {
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
    // Every process the command starts stays below `redmutex`, orphans
    // included, to be found and signalled with it (Linux).
    let follows = supervise::become_subreaper();
    if args.daemon && !follows {
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
        reaper: None,
        watcher,
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
        tick: (args.ttl / 10).clamp(Duration::from_millis(1), Duration::from_millis(25)),
        woken: None,
        warned_watcher: false,
    };
    job.woken = woken_on_loss(&job.lost);
    // The watcher's dead man's switch is armed before the command runs.
    job.tell_watcher(true);
    if watcher.is_some_and(supervise::Watcher::failed) {
        let _ = job.release();
        let failure = fail(
            EXIT_OSERR,
            format!(
                "the watcher process is gone: {} was not started (it must not run \
                 unguarded); was it killed?",
                program.to_string_lossy()
            ),
        );
        report::outcome("not_started", Some(failure.message.clone()));
        return Err(failure);
    }
    let reaper = match reaper::Reaper::start(program, rest, |command| {
        command.envs(environment);
    }) {
        Ok(reaper) => reaper,
        Err(err) => {
            let _ = job.release();
            let failure = match err {
                reaper::NotStarted::Exec(err) => not_started(program, &err),
                reaper::NotStarted::Reaper(why) => fail(EXIT_OSERR, why),
            };
            report::outcome("not_started", Some(failure.message.clone()));
            return Err(failure);
        }
    };
    if let Some(watcher) = watcher
        && let Some(stat) = supervise::stat(reaper.pid())
    {
        watcher.root(reaper.pid(), stat.start);
    }
    let pid = reaper.command;
    job.reaper = Some(reaper);
    let started = Instant::now();
    report::started(job.guard.as_ref().and_then(Held::fencing_token));
    verbose(cli, format_args!("the command runs as process {pid}"));
    let status = job.supervise(started);
    if status.is_some() && matches!(job.ending, Ending::Running) && args.daemon {
        job.follow_daemons(started);
    }
    if status.is_none() || !matches!(job.ending, Ending::Running) {
        // Whatever the command left, in the job or outside it, does not
        // run on unlocked.
        job.kill(libc::SIGKILL, false);
    }
    if let Some(watcher) = watcher {
        watcher.deadline(0);
    }
    if let Some(reaper) = &mut job.reaper {
        reaper.finish();
    }
    let Some(status) = status else {
        let _ = job.release();
        report::outcome(
            "error",
            Some("the reaper process was killed; the command was ended".into()),
        );
        return Err(fail(
            EXIT_OSERR,
            "the reaper process was killed: the command was ended, as its end could not \
             be learned",
        ));
    };
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

/// The command under way, and what `redmutex` does about it.
struct Job<'a> {
    cli: &'a Cli,
    args: &'a RunArgs,
    what: &'a str,
    /// The command's parent, and what it reports of the command.
    reaper: Option<reaper::Reaper>,
    watcher: Option<&'a supervise::Watcher>,
    forwarded: &'a supervise::Forwarded,
    control: supervise::JobControl,
    /// What is held, and its loss signal.
    guard: Option<Held>,
    lost: redmutex::LossSignal,
    kill_after: Duration,
    ending: Ending,
    terminated_at: Option<Instant>,
    killed: bool,
    /// A signal was passed on: no --min-hold after the command ends.
    stop_asked: bool,
    /// The job is stopped by job control and `redmutex` was not (a stop
    /// the kernel dropped): it resumes on the next SIGCONT.
    stopped: bool,
    /// The deadline last sent to the watcher (monotonic nanoseconds).
    told: i64,
    /// `redmutex` is its descendants' subreaper (Linux).
    follows: bool,
    /// How often the loop looks at the command and the lease: often
    /// enough for the shortest ttl to be supervised.
    tick: Duration,
    /// Readable once the lease is lost (see [`woken_on_loss`]).
    woken: Option<OwnedFd>,
    /// The watcher was found gone, and it was said.
    warned_watcher: bool,
}

/// How far the lease's deadline may move before the watcher is told: every
/// renewal moves it by a third of the ttl, far more than this.
const TELL_AFTER_NS: u64 = 1_000_000;

/// How often `--daemon` looks for the processes it follows.
const DAEMON_LOOK: Duration = Duration::from_millis(200);

/// How long the command's process group is given to stop on a ^Z of its
/// own (an interactive command puts the terminal back first) before what
/// has not stopped is stopped with SIGSTOP.
const STOP_GRACE: Duration = Duration::from_millis(300);

impl Job<'_> {
    /// What is left of the lease by the local clock.
    fn validity(&self) -> Duration {
        self.guard.as_ref().map_or(Duration::ZERO, Held::validity)
    }

    /// Releases what is held (owner-checked), if anything.
    fn release(&mut self) -> Result<(), Error> {
        self.guard.take().map_or(Ok(()), Held::unlock)
    }

    /// The processes not to signal: the watcher and the reaper (what they
    /// started is signalled all the same).
    fn helpers(&self) -> Vec<libc::pid_t> {
        let mut helpers = Vec::with_capacity(2);
        helpers.extend(self.watcher.map(supervise::Watcher::pid));
        helpers.extend(self.reaper.as_ref().map(reaper::Reaper::pid));
        helpers
    }

    /// Watches the command until it exits: `redmutex`'s stops (job
    /// control), the signals to pass on, the lease, `--max-run`. `None`
    /// when the reaper is gone without saying how the command ended.
    fn supervise(&mut self, started: Instant) -> Option<ExitStatus> {
        loop {
            match self.reaper.as_mut().map(reaper::Reaper::poll) {
                Some(reaper::Report::Exited(status)) => return Some(status),
                Some(reaper::Report::Gone) | None => return None,
                Some(reaper::Report::Running) => {}
            }
            if let Some(stop) = self.control.stop_asked() {
                self.suspend(&stop);
            }
            if self.control.continued() && self.stopped {
                // A job stopped whose own stop the kernel dropped,
                // continued.
                self.resume();
            }
            self.pass_on();
            self.watch_lease(Some(started));
            self.tell_watcher(false);
            // Wakes at once on a loss or a report (the command's end), else
            // looks at the signals every tick.
            self.wait(true);
        }
    }

    /// Waits at most a tick for a loss, or (with `reports`) a report of
    /// the reaper's.
    fn wait(&mut self, reports: bool) {
        let reports = if reports {
            self.reaper.as_ref().and_then(reaper::Reaper::reports_fd)
        } else {
            None
        };
        // Once lost, the loss is known: its descriptor stays readable, and
        // the loop goes on at its tick (the SIGKILL's grace) instead.
        let woken = self
            .woken
            .as_ref()
            .filter(|_| self.lost.reason().is_none())
            .map_or(-1, AsRawFd::as_raw_fd);
        let mut polls = [
            libc::pollfd {
                fd: woken,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: reports.unwrap_or(-1),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let timeout = i32::try_from(self.tick.as_millis()).unwrap_or(25).max(1);
        // SAFETY: polls descriptors of ours (a negative one is skipped).
        unsafe { libc::poll(polls.as_mut_ptr(), 2, timeout) };
    }

    /// Passes a signal `redmutex` received on: to every process of the
    /// command's, or, when the terminal sent it to the whole foreground
    /// group (^C), to those outside the job's group, which did not get it.
    /// A stopped job is continued to take it, as a shell's `kill` does,
    /// after the lease is checked.
    fn pass_on(&mut self) {
        let Some(forward) = self.forwarded.take() else {
            return;
        };
        let signal = forward.signal;
        verbose(
            self.cli,
            format_args!("passing signal {signal} to the command"),
        );
        self.kill(signal, forward.from_terminal);
        // Asked to stop: no --min-hold after the command ends.
        self.stop_asked = true;
        if self.stopped {
            self.resume();
        } else {
            // Stopped by someone else (`kill -STOP`): it could not act on
            // the signal otherwise.
            self.kill(libc::SIGCONT, false);
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

    /// Tells the watcher when the lease runs out by the local clock, less
    /// the SIGKILL's margin, whenever that moved (after a renewal): if
    /// `redmutex` stops telling it (stopped with its job, by SIGSTOP, or
    /// hung), the watcher ends the command then. Not after a loss:
    /// `redmutex` is ending the command itself, with the SIGTERM's grace,
    /// and the deadline last sent still bounds it.
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
                "the watcher process is gone: if redmutex is stopped now, nothing ends \
                 the command before the lease runs out"
            ));
        }
    }

    /// The lease, watched while the command (or its daemons) runs: a loss
    /// or a lease running low terminates the command, `--max-run` too,
    /// and a SIGKILL follows when it does not go in time.
    fn watch_lease(&mut self, started: Option<Instant>) {
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
                self.kill(libc::SIGTERM, false);
                // A stopped process must run to take its SIGTERM.
                self.kill(libc::SIGCONT, false);
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
            self.kill(libc::SIGKILL, false);
            self.killed = true;
        }
    }

    /// Signals every process of the command's: every descendant of
    /// `redmutex` but the watcher and the reaper, as found now (never as
    /// found before: a `setsid` or `timeout` helper started a moment ago
    /// is among them), the command itself included; with `outside_only`,
    /// only those outside `redmutex`'s process group (the terminal reached
    /// the rest). A SIGKILL or SIGSTOP is repeated until nothing new is
    /// found (see `supervise::signal_tree`).
    fn kill(&mut self, signal: i32, outside_only: bool) {
        // SAFETY: getpgrp only reads.
        let group = unsafe { libc::getpgrp() };
        let me = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
        supervise::signal_tree(&[me], &self.helpers(), signal, &|found| {
            outside_only && found.group == group
        });
    }

    /// A stop reached `redmutex` (the terminal's ^Z, a background read or
    /// write of it, a `kill -TSTP`): the whole job stops, as a shell's
    /// would, `redmutex` last, so the shell says so and gets its prompt
    /// back. When it is continued (`fg`, `bg`), the lease is checked
    /// before anything else is done.
    ///
    /// In an orphaned process group (no shell doing job control: `ssh -t`,
    /// `docker run -it`) the kernel dropped the terminal's stop for every
    /// process of the job: nothing stops, as under flock(1).
    fn suspend(&mut self, stop: &supervise::Stop) {
        if supervise::group_orphaned() {
            verbose(
                self.cli,
                format_args!("a stop with no shell to resume the job: running on, as flock does"),
            );
            return;
        }
        verbose(self.cli, format_args!("stopping the job"));
        // SAFETY: getpgrp only reads.
        let group = unsafe { libc::getpgrp() };
        if !stop.from_terminal {
            // Sent to `redmutex` alone: the job's processes first get the
            // stop the terminal would have sent them (an interactive one
            // puts the terminal back).
            self.kill(stop.signal, false);
        }
        // What is outside the job's group never got it: stopped now.
        self.kill(libc::SIGSTOP, true);
        // The job's group stops on its own; what has not within the grace
        // (a command that ignores SIGTSTP) is stopped: nothing of the
        // command's runs while the renewals are stopped.
        let me = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
        let helpers = self.helpers();
        let until = Instant::now() + STOP_GRACE;
        while Instant::now() < until {
            let (alive, _) = supervise::descendants(&[me], &helpers);
            if alive
                .iter()
                .all(|p| p.group != group || matches!(p.state, 'T' | 't'))
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.kill(libc::SIGSTOP, false);
        self.stopped = true;
        if self.control.stop_job(stop.signal) {
            self.resume();
        }
        // Else the kernel dropped `redmutex`'s own stop: the job stays
        // stopped for a SIGCONT to `redmutex`, the lease renewed.
    }

    /// After a stop: the job runs again only under a live lease. It is
    /// kept when the local clock gives it more than `--kill-after` (the
    /// watcher killed everything past the deadline while the job was
    /// stopped, and the watchdog checks it with Redis as always);
    /// otherwise everything is killed before it runs on.
    fn resume(&mut self) {
        self.stopped = false;
        // Why, in the words of a stop (the watchdog, stopped too, would
        // blame Redis for a lease that ran out while it could not run).
        let lost = match self.lost.reason() {
            Some(redmutex::LossReason::OwnedByOther) => Some("another owner took it"),
            Some(_) => Some("it expired or was taken"),
            None if self.validity() <= self.kill_after => Some("it ran out by the local clock"),
            None => None,
        };
        if let Some(reason) = lost {
            warn(format_args!(
                "lost {} while the job was stopped ({reason}); killing the command",
                self.what
            ));
            self.kill(libc::SIGKILL, false);
            self.killed = true;
            self.ending = Ending::LostWhileStopped;
            return;
        }
        // The new deadline first: the watcher must not act on the old one
        // once the job runs.
        self.tell_watcher(true);
        self.kill(libc::SIGCONT, false);
    }

    /// `--daemon`: the command exited; its lock is kept (renewed) while any
    /// process it started lives on, and ended with them on a loss.
    fn follow_daemons(&mut self, started: Instant) {
        // Killed, what is left goes within this (a process we may not
        // signal, one that changed user, is not waited for past it).
        let mut killed_at = None::<Instant>;
        let me = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
        let mut looked = None::<Instant>;
        // How many of the command's descendants were alive at the last look.
        let mut descendants = 0;
        loop {
            // A walk of /proc costs CPU with many processes: at most every
            // DAEMON_LOOK (the lease and the signals are looked at every
            // tick; a kill walks afresh anyway).
            if looked.is_none_or(|at| at.elapsed() >= DAEMON_LOOK) {
                looked = Some(Instant::now());
                let (alive, zombies) = supervise::descendants(&[me], &self.helpers());
                descendants = alive.len();
                for pid in zombies {
                    let mut status = 0;
                    // SAFETY: reaps `pid`, an exited child of ours (handed
                    // to us if the reaper was gone).
                    unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
                }
            }
            if descendants == 0 || !self.follows {
                return;
            }
            if self.killed {
                let at = *killed_at.get_or_insert_with(Instant::now);
                if at.elapsed() >= Duration::from_secs(5) {
                    return;
                }
                self.kill(libc::SIGKILL, false);
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
            if let Some(stop) = self.control.stop_asked() {
                self.suspend(&stop);
            }
            if self.control.continued() && self.stopped {
                self.resume();
            }
            self.pass_on();
            self.watch_lease(Some(started));
            self.tell_watcher(false);
            self.wait(false);
        }
    }
}

/// A descriptor that becomes readable when `lost` reports a loss, so the
/// supervisor's loop can wait on a loss and the reaper's reports at once.
/// A thread of its own waits for the loss (every signal blocked: they are
/// the main thread's); it is left to end with the process. `None` when
/// no pipe or thread can be had: the loop then looks every tick.
fn woken_on_loss(lost: &redmutex::LossSignal) -> Option<OwnedFd> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: a pipe into a two-element array; both ends are ours.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return None;
    }
    // SAFETY: descriptors pipe2 just gave us.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let lost = lost.clone();
    output::with_signals_blocked(|| {
        std::thread::Builder::new()
            .name("redmutex-loss".into())
            .spawn(move || {
                // Bounded by the process: it ends when `redmutex` does.
                while lost.wait_timeout(Duration::from_secs(3600)).is_none() {}
                let _ = supervise::write_all(write.as_raw_fd(), b"!");
            })
    })
    .ok()
    .map(|_| read)
}

/// `--min-hold`: keeps the lock (the watchdog renewing it) until that long
/// after the command started; a signal ends the wait early. Returns why
/// the lease was lost meanwhile, if it was.
fn hold_at_least(
    cli: &Cli,
    args: &RunArgs,
    started: Instant,
    lost: &redmutex::LossSignal,
    forwarded: &supervise::Forwarded,
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
        if let Some(forward) = forwarded.take() {
            verbose(
                cli,
                format_args!("signal {}: releasing before --min-hold", forward.signal),
            );
            return None;
        }
        // ^Z: nothing of the command runs; `redmutex` stops as asked.
        if let Some(stop) = control.stop_asked()
            && !supervise::group_orphaned()
        {
            control.stop_job(stop.signal);
        }
        lost.wait_timeout(left.min(Duration::from_millis(100)));
    }
}
