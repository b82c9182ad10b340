//! `redmutex`: flock(1) for a fleet of machines.
//!
//! Exit codes (also in `--help` and the README):
//!
//! | code | meaning |
//! |---|---|
//! | the command's | `run`: the command ran; its exit code (128+N if killed by signal N) |
//! | 0 | `status`, `release`: done |
//! | 1 | the lock is held elsewhere (`run` did not start the command; `release --token`: not that token's) |
//! | 2 | bad usage: unknown option, missing `--` or command, zero ttl |
//! | 69 | Redis unreachable or failing (`EX_UNAVAILABLE`) |
//! | 75 | `run`: the lock was lost, or could not be renewed, while the command ran; it was terminated (`EX_TEMPFAIL`) |
//! | 128+N | `run`: signal N arrived while waiting for the lock; the command was not run |
//! | 126 | `run`: the command cannot be executed |
//! | 127 | `run`: the command was not found |

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::process::{Command, ExitCode, ExitStatus};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use redmutex::{DistributedLock, Error, LockClient, LockOptions, WaitMode};

const EXIT_CONFLICT: u8 = 1;
const EXIT_USAGE: u8 = 2;
const EXIT_UNAVAILABLE: u8 = 69;
const EXIT_LOST: u8 = 75;
const EXIT_CANNOT_EXECUTE: u8 = 126;
const EXIT_NOT_FOUND: u8 = 127;

const AFTER_HELP: &str = "\
Exit codes:
  run      the command's own (128+N if killed by signal N)
  0        status/release: done
  1        the lock is held elsewhere: the command was not run (see --conflict-exit-code)
  2        bad usage
  69       Redis unreachable or failing
  75       the lock was lost, or could not be renewed, while the command ran; the
           command was terminated before the lease ran out
  128+N    signal N arrived while waiting for the lock: the command was not run
  126      the command cannot be executed
  127      the command was not found

Examples:
  redmutex run --no-wait nightly-report -- ./report.sh
  redmutex run --wait 5m --ttl 30s deploy:web -- ansible-playbook site.yml
  redmutex status nightly-report --json
  redmutex --cluster --url redis://10.0.0.1:7000,redis://10.0.0.2:7000 run job -- ./job.sh
  redmutex --sentinel mymaster --url redis://10.0.0.1:26379,redis://10.0.0.2:26379 status job
  redmutex release nightly-report --token 1f0c…";

#[derive(Parser)]
#[command(
    name = "redmutex",
    version,
    about = "flock(1) for a fleet: run a command only while holding a Redis lock",
    after_help = AFTER_HELP
)]
struct Cli {
    /// Redis server URL; with --cluster or --sentinel, a comma-separated
    /// list of cluster nodes or of sentinels.
    #[arg(
        long,
        env = "REDMUTEX_URL",
        default_value = "redis://127.0.0.1:6379",
        global = true
    )]
    url: String,
    /// The URLs are nodes of a Redis Cluster.
    #[arg(
        long,
        env = "REDMUTEX_CLUSTER",
        global = true,
        conflicts_with = "sentinel"
    )]
    cluster: bool,
    /// The URLs are sentinels; lock on the primary they name MASTER.
    #[arg(long, env = "REDMUTEX_SENTINEL", global = true, value_name = "MASTER")]
    sentinel: Option<String>,
    /// Say nothing but errors.
    #[arg(long, short, global = true, conflicts_with = "verbose")]
    quiet: bool,
    /// Say what is happening.
    #[arg(long, short, global = true)]
    verbose: bool,
    #[command(subcommand)]
    command: Sub,
}

#[derive(Subcommand)]
enum Sub {
    /// Acquire KEY, run CMD while holding it (lease kept alive), release it.
    Run(RunArgs),
    /// Show whether KEY is held, by whom and for how long.
    Status(StatusArgs),
    /// Release KEY: owner-checked with --token, or unconditionally with --force.
    Release(ReleaseArgs),
}

#[derive(Args)]
struct RunArgs {
    /// Wait at most this long for the lock (e.g. 30s, 5m).
    #[arg(long, value_parser = parse_duration, default_value = "10s", conflicts_with = "no_wait")]
    wait: Duration,
    /// Do not wait: exit at once if the lock is held.
    #[arg(long)]
    no_wait: bool,
    /// The lease; renewed every third of it while CMD runs.
    #[arg(long, value_parser = parse_ttl, default_value = "30s")]
    ttl: Duration,
    /// Issue a fencing token and pass it to CMD in REDMUTEX_FENCING_TOKEN.
    #[arg(long)]
    fencing: bool,
    /// Exit code when the lock cannot be had in time.
    #[arg(long, default_value_t = EXIT_CONFLICT)]
    conflict_exit_code: u8,
    /// How much of the lease is left when CMD gets SIGTERM because
    /// renewals fail (at most a third of the ttl); it gets SIGKILL with a
    /// quarter of that left, so it is gone before the lease runs out and
    /// another holder can take the lock. A lease found lost ends CMD the
    /// same way at once.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    kill_after: Duration,
    /// The lock key.
    key: String,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<OsString>,
}

#[derive(Args)]
struct StatusArgs {
    /// The lock key.
    key: String,
    /// Print JSON: {"key", "held", "token", "ttl_ms", "fencing_counter"}.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ReleaseArgs {
    /// The lock key.
    key: String,
    /// Release only if the key holds this token.
    #[arg(long, required_unless_present = "force", conflicts_with = "force")]
    token: Option<String>,
    /// Delete the key whatever holds it, and print what was deleted.
    #[arg(long)]
    force: bool,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("{e} (try 30s, 5m, 1h)"))
}

fn parse_ttl(text: &str) -> Result<Duration, String> {
    let ttl = parse_duration(text)?;
    if ttl < Duration::from_millis(1) {
        return Err("the ttl must be at least 1ms".into());
    }
    Ok(ttl)
}

/// A one-line failure with its exit code.
struct Failure {
    code: u8,
    message: String,
}

fn fail(code: u8, message: impl Into<String>) -> Failure {
    Failure {
        code,
        message: message.into(),
    }
}

fn redis_failure(err: Error) -> Failure {
    match err {
        Error::InvalidArgument(msg) => fail(EXIT_USAGE, msg),
        other => fail(EXIT_UNAVAILABLE, other.to_string()),
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            let code = if err.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = err.print();
            return ExitCode::from(code);
        }
    };
    let outcome = match &cli.command {
        Sub::Run(args) => run(&cli, args),
        Sub::Status(args) => status(&cli, args),
        Sub::Release(args) => release(&cli, args),
    };
    match outcome {
        Ok(code) => ExitCode::from(code),
        Err(failure) => {
            eprintln!("redmutex: {}", failure.message);
            ExitCode::from(failure.code)
        }
    }
}

fn client(cli: &Cli) -> Result<LockClient, Failure> {
    let urls = || cli.url.split(',').map(str::trim).filter(|u| !u.is_empty());
    let client = if cli.cluster {
        LockClient::open_cluster(urls())
    } else if let Some(master) = &cli.sentinel {
        LockClient::open_sentinel(urls(), master)
    } else {
        LockClient::open(&cli.url)
    };
    client.map_err(redis_failure)
}

fn connection(client: &LockClient) -> Result<redmutex::Connection, Failure> {
    client.connection().map_err(redis_failure)
}

fn say(cli: &Cli, message: std::fmt::Arguments<'_>) {
    if !cli.quiet {
        eprintln!("redmutex: {message}");
    }
}

fn verbose(cli: &Cli, message: std::fmt::Arguments<'_>) {
    if cli.verbose {
        eprintln!("redmutex: {message}");
    }
}

/// Who holds `key` and for how long, on a connection of `client`'s pool.
/// (Two commands, not a pipeline: a cluster connection cannot pipeline.)
fn holder(client: &LockClient, key: &str) -> Result<Option<(String, i64)>, Failure> {
    let mut con = connection(client)?;
    let token: Option<String> = redis::cmd("GET")
        .arg(key)
        .query(&mut con)
        .map_err(|e| match e.code() {
            Some("WRONGTYPE") => fail(
                EXIT_UNAVAILABLE,
                format!("{key:?} holds a non-string value: it is not a redmutex lock"),
            ),
            _ => redis_failure(Error::Redis(e)),
        })?;
    let Some(token) = token else {
        return Ok(None);
    };
    let pttl: i64 = redis::cmd("PTTL")
        .arg(key)
        .query(&mut con)
        .map_err(|e| redis_failure(Error::Redis(e)))?;
    // -2: released between the two commands.
    Ok((pttl != -2).then_some((token, pttl)))
}

fn short(token: &str) -> &str {
    token.get(..8).unwrap_or(token)
}

fn ttl_text(pttl: i64) -> String {
    if pttl < 0 {
        "no expiry".into()
    } else {
        format!("{:.1}s left", pttl as f64 / 1000.0)
    }
}

/// Shows what `redmutex run` waits for, on a terminal only.
struct Spinner {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Spinner {
    fn start(cli: &Cli, client: &LockClient, key: &str) -> Spinner {
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
                        held = match holder(&client, &key) {
                            Ok(Some((token, pttl))) => {
                                format!("held by {}… ({})", short(&token), ttl_text(pttl))
                            }
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

/// Takes the lock, waiting in slices so a signal ends the wait.
/// `Err(signal)` when one arrived; nothing is held then.
fn acquire(
    lock: &DistributedLock,
    args: &RunArgs,
    forwarded: &Forwarded,
) -> Result<Result<Option<redmutex::LockGuard>, Error>, i32> {
    if args.no_wait {
        let acquired = lock.try_lock();
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
        let acquired = lock.try_lock_for(slice);
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
}

fn run(cli: &Cli, args: &RunArgs) -> Result<u8, Failure> {
    if args.key.is_empty() {
        return Err(fail(EXIT_USAGE, "the lock key must not be empty"));
    }
    // Before anything is acquired: a SIGTERM while waiting or acquiring
    // must not leave the key held for its ttl.
    let forwarded = Forwarded::install()?;
    let client = client(cli)?;
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
    let lock = DistributedLock::with_options(&client, args.key.clone(), options);
    verbose(
        cli,
        format_args!("acquiring {:?} at {}", args.key, redact(&cli.url)),
    );
    let acquired = {
        let _spinner = (!args.no_wait).then(|| Spinner::start(cli, &client, &args.key));
        acquire(&lock, args, &forwarded)
    };
    let acquired = match acquired {
        Ok(acquired) => acquired.map_err(redis_failure)?,
        Err(signal) => {
            say(
                cli,
                format_args!(
                    "signal {signal} while waiting for {:?}; not running the command",
                    args.key
                ),
            );
            return Ok(signalled(signal));
        }
    };
    let Some(guard) = acquired else {
        let who = match holder(&client, &args.key) {
            Ok(Some((token, pttl))) => format!("held by {}… ({})", short(&token), ttl_text(pttl)),
            _ => "held".into(),
        };
        say(
            cli,
            format_args!("{:?} is {who}; not running the command", args.key),
        );
        return Ok(args.conflict_exit_code);
    };
    verbose(
        cli,
        format_args!("acquired {:?} with token {}", args.key, guard.token()),
    );

    let (program, rest) = args
        .command
        .split_first()
        .ok_or_else(|| fail(EXIT_USAGE, "no command given after --"))?;
    let mut command = Command::new(program);
    command
        .args(rest)
        .env("REDMUTEX_KEY", &args.key)
        .env("REDMUTEX_TOKEN", guard.token());
    if let Some(fence) = guard.fencing_token() {
        command.env("REDMUTEX_FENCING_TOKEN", fence.to_string());
    }
    // A signal that came while acquiring: the command is not started.
    if let Some(signal) = forwarded.take() {
        let _ = guard.unlock();
        say(
            cli,
            format_args!(
                "signal {signal} after acquiring {:?}; not running the command",
                args.key
            ),
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
    let pgid = child.id();
    let lost = guard.loss_signal();
    let mut ending = Ending::Running;
    let mut terminated_at: Option<Instant> = None;
    let mut killed = false;
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
        }
        let validity = guard.validity();
        if matches!(ending, Ending::Running) {
            if let Some(reason) = lost.reason() {
                ending = Ending::Lost(reason);
            } else if validity <= kill_after {
                ending = Ending::LowValidity(validity);
            }
            match &ending {
                Ending::Running => {}
                Ending::Lost(reason) => eprintln!(
                    "redmutex: lost the lock {:?} ({reason}); terminating the command",
                    args.key
                ),
                Ending::LowValidity(left) => eprintln!(
                    "redmutex: cannot renew the lock {:?} and {left:?} of it is left; \
                     terminating the command before it runs out",
                    args.key
                ),
            }
            if !matches!(ending, Ending::Running) {
                signal_group(pgid, libc::SIGTERM);
                terminated_at = Some(Instant::now());
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
        let _ = guard.unlock();
        return Ok(EXIT_LOST);
    }
    match guard.unlock() {
        Ok(()) => verbose(cli, format_args!("released {:?}", args.key)),
        Err(err) => say(cli, format_args!("releasing {:?}: {err}", args.key)),
    }
    Ok(exit_code_of(status))
}

fn status(cli: &Cli, args: &StatusArgs) -> Result<u8, Failure> {
    let client = client(cli)?;
    let held = holder(&client, &args.key)?;
    let fence_key = redmutex::fence_key(&args.key);
    let counter: Option<u64> = {
        let mut con = connection(&client)?;
        redis::cmd("GET")
            .arg(&fence_key)
            .query(&mut con)
            .map_err(|e| redis_failure(Error::Redis(e)))?
    };
    if args.json {
        let (token, ttl) = match &held {
            Some((token, pttl)) => (json_string(token), pttl.to_string()),
            None => ("null".into(), "null".into()),
        };
        println!(
            "{{\"key\":{},\"held\":{},\"token\":{token},\"ttl_ms\":{ttl},\"fencing_counter\":{}}}",
            json_string(&args.key),
            held.is_some(),
            counter.map_or("null".into(), |c| c.to_string()),
        );
    } else {
        match &held {
            Some((token, pttl)) => println!("{}: held by {token} ({})", args.key, ttl_text(*pttl)),
            None => println!("{}: free", args.key),
        }
        if let Some(counter) = counter {
            println!("fencing counter: {counter}");
        }
    }
    Ok(0)
}

fn release(cli: &Cli, args: &ReleaseArgs) -> Result<u8, Failure> {
    let client = client(cli)?;
    if args.force {
        // Safe to send twice (it records what it deleted); an outcome that
        // cannot be learned is reported as unknown (exit 69).
        let deleted = DistributedLock::new(&client, args.key.clone())
            .force_release()
            .map_err(redis_failure)?;
        match deleted {
            Some(token) => println!("{}: deleted, it was held by {token}", args.key),
            None => println!("{}: nothing to delete, it was free", args.key),
        }
        return Ok(0);
    }
    let token = args.token.as_deref().unwrap_or_default();
    match DistributedLock::new(&client, args.key.clone()).release_token(token) {
        Ok(()) => {
            say(cli, format_args!("released {:?}", args.key));
            Ok(0)
        }
        Err(err @ Error::NotHeld { .. }) => {
            say(cli, format_args!("{err}; nothing was changed"));
            Ok(EXIT_CONFLICT)
        }
        Err(err) => Err(redis_failure(err)),
    }
}

fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The URL (or comma-separated URLs) without passwords, for messages.
fn redact(urls: &str) -> String {
    let one = |url: &str| match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://…@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_owned(),
    };
    urls.split(',').map(one).collect::<Vec<_>>().join(",")
}
