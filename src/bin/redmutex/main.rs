//! `redmutex`: flock(1) for a fleet of machines.
//!
//! Exit codes (also in `--help` and docs/cli.md):
//!
//! | code | meaning |
//! |---|---|
//! | the command's | `run`: the command ran; its exit code (128+N if killed by signal N) |
//! | 0 | `status`, `release`: done |
//! | 1 | the lock is held elsewhere (`run` did not start the command; `release --token`: not that token's) |
//! | 2 | bad usage: unknown option, missing `--` or command, a ttl below 30ms |
//! | 3 | `list`: cut short by `--timeout` (what was found is printed) |
//! | 4 | `doctor`: a warning (the worst finding) |
//! | 5 | `doctor`: an error (the worst finding) |
//! | 65 | the key holds something that is not a lock of that kind (`EX_DATAERR`) |
//! | 69 | Redis unreachable or failing (`EX_UNAVAILABLE`) |
//! | 71 | `run`: the supervisor cannot guard the command (its watcher gone before it starts, its reaper killed); not run, or ended (`EX_OSERR`) |
//! | 75 | `run`: the lock was lost, or could not be renewed, while the command ran (or its job was stopped, or during `--min-hold`); it was terminated (`EX_TEMPFAIL`) |
//! | 124 | `run --max-run`: the command ran too long and was terminated |
//! | 128+N | `run`: signal N arrived while waiting for the lock; the command was not run |
//! | 126 | `run`: the command cannot be executed |
//! | 127 | `run`: the command was not found |

use std::ffi::OsString;
use std::fmt::Write as _;
use std::io::IsTerminal;
use std::process::{ExitCode, ExitStatus};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

mod doctor;
mod list;
mod output;
mod reaper;
mod release;
mod report;
mod run;
mod status;
mod supervise;

use clap::{Args, Parser, Subcommand};
use redmutex::{
    DistributedLock, Error, FairLock, HeldLock, Holder, LockClient, LockClientBuilder, LockOptions,
    MultiLock, Semaphore, WaitMode,
};

const EXIT_CONFLICT: u8 = 1;
const EXIT_USAGE: u8 = 2;
const EXIT_INCOMPLETE: u8 = 3;
const EXIT_DOCTOR_WARNING: u8 = 4;
const EXIT_DOCTOR_ERROR: u8 = 5;
const EXIT_DATAERR: u8 = 65;
const EXIT_UNAVAILABLE: u8 = 69;
const EXIT_OSERR: u8 = 71;
const EXIT_LOST: u8 = 75;
const EXIT_MAX_RUN: u8 = 124;
const EXIT_CANNOT_EXECUTE: u8 = 126;
const EXIT_NOT_FOUND: u8 = 127;

const AFTER_HELP: &str = "\
Environment (besides each option's [env: …]):
  REDMUTEX_PASSWORD  the password to log in with, instead of the URL's (kept
                     off the command line, where every user of the host sees it)

Exit codes:
  run      the command's own (128+N if killed by signal N)
  0        status/release: done
  1        the lock is held elsewhere: the command was not run (see --conflict-exit-code)
  2        bad usage (a ttl below 30ms too)
  3        list: cut short by --timeout (what was found is printed)
  4, 5     doctor: the worst finding is a warning (4) or an error (5)
  65       the key holds something that is not a lock of that kind
  69       Redis unreachable or failing
  71       run: the supervisor cannot guard the command (its watcher gone
           before it starts, its reaper killed): not run, or ended
  75       the lock was lost, or could not be renewed, while the command ran (or
           while its job was stopped, or during --min-hold); the command was
           terminated before the lease ran out
  124      run --max-run: the command ran too long and was terminated
  128+N    signal N arrived while waiting for the lock: the command was not run
  126      the command cannot be executed (or its #! interpreter is missing)
  127      the command was not found

Examples:
  redmutex run --no-wait nightly-report -- ./report.sh
  redmutex run --wait 5m --ttl 30s deploy:web -- ansible-playbook site.yml
  redmutex run --limit 3 db-exports -- ./export.sh
  redmutex run --no-wait --quiet-if-held --min-hold 1m --max-run 50m -- ./hourly.sh
  redmutex status nightly-report --json
  redmutex list 'deploy:*' --json
  redmutex doctor
  redmutex --cluster --url redis://10.0.0.1:7000,redis://10.0.0.2:7000 run job -- ./job.sh
  redmutex --sentinel mymaster --url redis://10.0.0.1:26379,redis://10.0.0.2:26379 status job
  REDMUTEX_PASSWORD=… redmutex --url rediss://redis.example.com:6380 --user app --tls-ca ca.pem list
  redmutex run --report /var/lib/jobs/nightly.json nightly -- ./nightly.sh
  redmutex release nightly-report --token-file - <<<\"$REDMUTEX_TOKEN\"";

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
    /// A prefix for every key and channel (as the library's
    /// `LockClientBuilder::key_prefix`): KEY names the lock PREFIX+KEY.
    #[arg(
        long,
        env = "REDMUTEX_KEY_PREFIX",
        global = true,
        default_value = "",
        hide_default_value = true,
        value_name = "PREFIX"
    )]
    key_prefix: String,
    /// For rediss:// URLs: the CA certificate(s) (PEM) the server's
    /// certificate must chain to, instead of the system's roots.
    #[arg(long, env = "REDMUTEX_TLS_CA", global = true, value_name = "FILE")]
    tls_ca: Option<std::path::PathBuf>,
    /// For rediss:// URLs: a client certificate (PEM chain) for servers
    /// that require one (mutual TLS); needs --tls-key.
    #[arg(
        long,
        env = "REDMUTEX_TLS_CERT",
        global = true,
        value_name = "FILE",
        requires = "tls_key"
    )]
    tls_cert: Option<std::path::PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(
        long,
        env = "REDMUTEX_TLS_KEY",
        global = true,
        value_name = "FILE",
        requires = "tls_cert"
    )]
    tls_key: Option<std::path::PathBuf>,
    /// The ACL user to log in as (instead of the URL's); the password
    /// comes from $REDMUTEX_PASSWORD.
    #[arg(long, env = "REDMUTEX_USER", global = true, value_name = "USER")]
    user: Option<String>,
    /// Say nothing but errors.
    #[arg(long, short, global = true, conflicts_with = "verbose")]
    quiet: bool,
    /// Say what is happening.
    #[arg(long, short, global = true)]
    verbose: bool,
    /// Show whole tokens (permit ids), the secrets `release --token`
    /// takes, in every message and listing; hidden by default (only the
    /// holder metadata after the secret is shown), since whoever has one
    /// can extend or release the lock.
    #[arg(long, global = true)]
    tokens: bool,
    #[command(subcommand)]
    command: Sub,
}

#[derive(Subcommand)]
enum Sub {
    /// Acquire KEY, run CMD while holding it (lease kept alive), release it.
    Run(RunArgs),
    /// Show whether KEY is held, by whom and for how long (a semaphore:
    /// its limit, and each permit's holder and time left).
    Status(StatusArgs),
    /// Release KEY (or one permit of a semaphore): owner-checked with
    /// --token, or unconditionally with --force.
    Release(ReleaseArgs),
    /// List every held lock and semaphore (under the key prefix) whose name
    /// matches PATTERN: kind, time left, holders; never a token.
    List(ListArgs),
    /// Check the deployment for what breaks locks (eviction, persistence,
    /// replicas, missing commands, ACLs, clocks, latency) and say what to
    /// change; read-only.
    Doctor(DoctorArgs),
    /// Print the shell completion script for SHELL (bash, zsh or fish),
    /// e.g. `redmutex completions bash > /etc/bash_completion.d/redmutex`.
    Completions(CompletionsArgs),
    /// Write the man pages (redmutex.1 and one per command) into DIR.
    #[command(hide = true)]
    Man(ManArgs),
}

#[derive(Args)]
struct CompletionsArgs {
    /// The shell.
    #[arg(value_enum)]
    shell: clap_complete::Shell,
}

#[derive(Args)]
struct ManArgs {
    /// The directory to write the pages into (made if missing).
    #[arg(long, value_name = "DIR")]
    dir: std::path::PathBuf,
}

#[derive(Args)]
struct DoctorArgs {
    /// Print JSON: {"target", "worst", "findings": [{"check", "node",
    /// "severity", "found", "why", "fix"}]} ("severity": ok, info, unknown,
    /// warning or error; unknown: not checked, the server refused what
    /// doctor asks).
    #[arg(long)]
    json: bool,
    /// Check this ACL user's permissions instead of the logged-in user's
    /// (ACL DRYRUN, which the logged-in user must be allowed: an admin
    /// checking a lock user).
    #[arg(long, value_name = "USER")]
    acl_user: Option<String>,
    /// A lock name (under the key prefix) whose key, fencing counter,
    /// release markers and channel the ACL check tries [default:
    /// redmutex-doctor-sample].
    #[arg(long, value_name = "NAME")]
    key: Option<String>,
}

#[derive(Args)]
struct ListArgs {
    /// A glob over lock names (without the key prefix), as SCAN MATCH
    /// takes it.
    #[arg(default_value = "*")]
    pattern: String,
    /// Print JSON: [{"key", "kind", "ttl_ms", "holders", "limit"}, ...]
    /// ("kind": lock, reentrant, read, write or semaphore; "ttl_ms": null
    /// without expiry; "limit": null but for a semaphore).
    #[arg(long)]
    json: bool,
    /// Stop scanning after this long; a cut-short listing says so on
    /// stderr and exits 3.
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    timeout: Duration,
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
    /// Semaphore mode: hold one of N permits of KEY, so at most N commands
    /// run at once under KEY (each permit a lease of its own; REDMUTEX_TOKEN
    /// is the permit's id). Every run on KEY must give the same N.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    limit: Option<u32>,
    /// Hold every one of these keys (comma-separated), all or none: a
    /// multi-lock, never partly held, so runs over overlapping sets cannot
    /// deadlock. REDMUTEX_KEY is the keys as given here; with --fencing,
    /// REDMUTEX_FENCING_TOKENS is KEY=TOKEN for each, comma-separated, in
    /// the order taken. A key cannot contain a comma.
    #[arg(long, value_name = "KEYS", value_delimiter = ',', num_args = 1,
          conflicts_with_all = ["key", "limit", "fair"])]
    keys: Vec<String>,
    /// Take the lock in the order the waiters asked for it, across hosts
    /// (a fair lock: a waiter that dies loses its place within 2 s).
    #[arg(long, conflicts_with = "limit")]
    fair: bool,
    /// A label in the lock's holder metadata (shown by `status` and `list`),
    /// e.g. a job or deploy id; no `|`, whitespace or control characters.
    #[arg(long, env = "REDMUTEX_LABEL", value_name = "LABEL")]
    label: Option<String>,
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
    /// Keep the lock at least this long after the command started, even
    /// when it ends sooner (renewed meanwhile), so hosts whose cron clocks
    /// differ by less than this do not run the job twice.
    #[arg(long, value_parser = parse_duration, value_name = "D")]
    min_hold: Option<Duration>,
    /// When the lock is held elsewhere, exit 0 without a word (cron mails
    /// nothing): the job is already running somewhere.
    #[arg(long, conflicts_with = "conflict_exit_code")]
    quiet_if_held: bool,
    /// The command daemonizes (forks a server and exits): keep the lock,
    /// renewed, while any process it started is alive, and end them all
    /// if the lock is lost (Linux). Without it, the lock is released when
    /// the command itself exits, whatever it left running (flock(1) keeps
    /// it while a process holds the descriptor).
    #[arg(long)]
    daemon: bool,
    /// Terminate the command after this long (SIGTERM to its process
    /// group, SIGKILL after --kill-after), release, and exit 124.
    #[arg(long, value_parser = parse_duration, value_name = "D")]
    max_run: Option<Duration>,
    /// When the run ends, however it ends, write how to FILE as JSON:
    /// {"outcome", "exit_code", "key", "reason", "holder",
    /// "command_exit_code", "command_signal", "started_at_ms",
    /// "ended_at_ms", "fencing_token"} ("outcome": finished, not_acquired,
    /// lost, max_run, signalled, not_started or error). Written whole or
    /// not at all.
    #[arg(long, value_name = "FILE")]
    report: Option<std::path::PathBuf>,
    /// The lock key. Without it the key is derived from the command line
    /// (`run:` and a hash of CMD and its arguments), so the same command
    /// never runs twice at once; `-v` prints it.
    key: Option<String>,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<OsString>,
}

#[derive(Args)]
struct StatusArgs {
    /// The lock key.
    key: String,
    /// Print JSON: {"key", "kind": "lock", "held", "holder", "ttl_ms",
    /// "fencing_counter"}, or for a semaphore {"key", "kind": "semaphore",
    /// "limit", "in_use", "available", "permits": [{"holder", "ttl_ms",
    /// "fencing_token"}], "fencing_counter"}; a holder is {"host", "pid",
    /// "program", "label", "acquired_at_ms"} or null. With --tokens, also
    /// "token" (a lock) and "id" (each permit).
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ReleaseArgs {
    /// The lock key.
    key: String,
    /// Release only if the key holds this token (for a semaphore: give
    /// back the permit with this id). On the command line every local
    /// user can read it (`ps`): --token-file keeps it off.
    #[arg(
        long,
        required_unless_present_any = ["force", "token_file"],
        conflicts_with_all = ["force", "token_file"],
        allow_hyphen_values = true
    )]
    token: Option<String>,
    /// As --token, read from FILE (`-`: standard input), its first line.
    #[arg(long, value_name = "FILE", conflicts_with = "force")]
    token_file: Option<std::path::PathBuf>,
    /// Delete the key whatever holds it, and print what was deleted.
    #[arg(long)]
    force: bool,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("{e} (try 30s, 5m, 1h)"))
}

/// The shortest lease `run` takes: renewed every third of it, with the
/// command ended when less than a third is left, a renewal's round trip
/// and the supervisor's look at it (every tenth of the ttl) must fit in a
/// third with room for one slow reply. Below this every run would end
/// 75, and blame Redis for it.
const MIN_RUN_TTL: Duration = Duration::from_millis(30);

fn parse_ttl(text: &str) -> Result<Duration, String> {
    let ttl = parse_duration(text)?;
    if ttl < MIN_RUN_TTL {
        return Err(format!(
            "the ttl must be at least {}ms: the lease is renewed every third of it, \
             and a renewal's round trip must fit in that with room to spare",
            MIN_RUN_TTL.as_millis()
        ));
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
        // Redis answered: the key is something else (another program's
        // key, a lock of another kind): not "Redis unreachable".
        err @ Error::WrongType { .. } => fail(EXIT_DATAERR, err.to_string()),
        other => fail(EXIT_UNAVAILABLE, other.to_string()),
    }
}

fn main() -> ExitCode {
    // `redmutex run`'s own reaper process (see `reaper.rs`), before any
    // parsing: its arguments are the command's.
    let args: Vec<OsString> = std::env::args_os().collect();
    if args.get(1).is_some_and(|a| a == reaper::ARG) {
        reaper::main(&args);
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            let code = if err.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = err.print();
            return ExitCode::from(code);
        }
    };
    let outcome = match &cli.command {
        Sub::Run(args) => run::run(&cli, args),
        Sub::Status(args) => status::status(&cli, args),
        Sub::Release(args) => release::release(&cli, args),
        Sub::List(args) => list::list(&cli, args),
        Sub::Doctor(args) => doctor::doctor(&cli, args),
        Sub::Completions(args) => Ok(completions(args)),
        Sub::Man(args) => man_pages(args),
    };
    let code = match outcome {
        Ok(code) => code,
        Err(failure) => {
            warn(format_args!("{}", failure.message));
            failure.code
        }
    };
    output::drain(output::DRAIN);
    if let Sub::Run(_) = &cli.command {
        run::die_as_asked(code);
    }
    ExitCode::from(code)
}

/// The completion script, generated from the same definition that parses
/// the arguments (so it cannot fall behind them).
fn completions(args: &CompletionsArgs) -> u8 {
    use clap::CommandFactory;
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut Cli::command(), "redmutex", &mut script);
    output::outln!("{}", String::from_utf8_lossy(&script).trim_end());
    0
}

/// `redmutex.1`, and `redmutex-COMMAND.1` for each command, from the
/// same definition that parses the arguments.
fn man_pages(args: &ManArgs) -> Result<u8, Failure> {
    use clap::CommandFactory;
    let failed = |err: std::io::Error| fail(EXIT_OSERR, format!("{}: {err}", args.dir.display()));
    std::fs::create_dir_all(&args.dir).map_err(failed)?;
    // One page per command, named as the command's display name
    // (`redmutex-run.1`); hidden commands get none.
    clap_mangen::generate_to(Cli::command(), &args.dir).map_err(failed)?;
    Ok(0)
}

fn client(cli: &Cli) -> Result<LockClient, Failure> {
    if let Err(std::env::VarError::NotUnicode(_)) = std::env::var("REDMUTEX_PASSWORD") {
        return Err(redis_failure(Error::InvalidArgument(
            "REDMUTEX_PASSWORD is not valid UTF-8".into(),
        )));
    }
    builder(cli).build().map_err(redis_failure)
}

fn builder(cli: &Cli) -> LockClientBuilder {
    let urls = || cli.url.split(',').map(str::trim).filter(|u| !u.is_empty());
    let builder = if cli.cluster {
        LockClient::builder().cluster(urls())
    } else if let Some(master) = &cli.sentinel {
        LockClient::builder().sentinel(urls(), master)
    } else {
        LockClient::builder().url(&cli.url)
    };
    with_settings(cli, builder)
}

/// A client of the one server at `url`, with `cli`'s key prefix, TLS and
/// login.
fn builder_for(cli: &Cli, url: &str) -> LockClientBuilder {
    with_settings(cli, LockClient::builder().url(url))
}

fn with_settings(cli: &Cli, builder: LockClientBuilder) -> LockClientBuilder {
    let mut builder = builder.key_prefix(&cli.key_prefix);
    if let Some(ca) = &cli.tls_ca {
        builder = builder.tls_ca_file(ca);
    }
    if let (Some(cert), Some(key)) = (&cli.tls_cert, &cli.tls_key) {
        builder = builder.tls_client_cert_files(cert, key);
    }
    if let Some(user) = &cli.user {
        builder = builder.username(user);
    }
    // From the environment only: a command line is visible to every user
    // of the host.
    // An empty one counts as unset (an `export REDMUTEX_PASSWORD=` left
    // over); one that is not UTF-8 is refused in `client`.
    if let Ok(password) = std::env::var("REDMUTEX_PASSWORD")
        && !password.is_empty()
    {
        builder = builder.password(password);
    }
    builder
}

/// Who holds a token, in a few words: its holder metadata, never the
/// secret before it. The token was read from Redis, so anything may be in
/// it: what is not holder metadata as this crate writes it is shown as
/// unreadable, and nothing in it can make this panic.
fn who(token: &str) -> String {
    match Holder::from_token(token) {
        Some(holder) => holder_text(&holder),
        None if token.contains('|') => "an unreadable holder".into(),
        None => "a holder without metadata".into(),
    }
}

/// A holder in a few words: who, and since when.
fn holder_text(holder: &Holder) -> String {
    let mut text = format!("{holder}, since ");
    // The parser keeps times before the year 10000; should a formatter
    // still refuse one, it is said so, not a panic.
    if write!(
        text,
        "{}",
        humantime::format_rfc3339_seconds(holder.acquired_at)
    )
    .is_err()
    {
        text.push_str("an unreadable time");
    }
    text
}

/// Who holds a lock a status read found: its first holder, or what kind
/// of holder it is when none can be shown.
fn who_holds(held: &HeldLock) -> String {
    match held.held_by.first() {
        Some(holder) => holder_text(holder),
        None if held.unreadable > 0 => "an unreadable holder".into(),
        None => "a holder without metadata".into(),
    }
}

/// The time left of a lock a status read found.
fn left_text(held: &HeldLock) -> String {
    match held.remaining {
        Some(left) => format!("{:.1}s left", left.as_secs_f64()),
        None => "no expiry".into(),
    }
}

/// A token as a message may show it: whole with `--tokens` (control
/// characters escaped: it was read from Redis), else only its public part
/// ([`redmutex::redact`]).
fn shown(cli: &Cli, token: &str) -> String {
    if cli.tokens {
        printable(token)
    } else {
        redmutex::redact(token)
    }
}

/// `text` with control characters escaped (`\u{1b}`), so a value read
/// from Redis cannot drive the terminal.
fn printable(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// A holder as JSON: {"host", "pid", "program", "label", "acquired_at_ms"},
/// or `null`.
fn holder_json(holder: Option<&Holder>) -> String {
    let Some(h) = holder else {
        return "null".into();
    };
    let at = h
        .acquired_at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    format!(
        "{{\"host\":{},\"pid\":{},\"program\":{},\"label\":{},\"acquired_at_ms\":{at}}}",
        json_string(&h.host),
        h.pid,
        json_string(&h.program),
        h.label.as_deref().map_or("null".into(), json_string),
    )
}

fn connection(client: &LockClient) -> Result<redmutex::Connection, Failure> {
    client.connection().map_err(redis_failure)
}

/// A message on standard error, always, never waiting for it to be
/// written (see [`output`]): a stderr that is a full pipe, a stalled
/// terminal or closed delays nothing `redmutex run` does.
fn warn(message: std::fmt::Arguments<'_>) {
    output::to_stderr(format!("redmutex: {message}\n").into_bytes());
}

fn say(cli: &Cli, message: std::fmt::Arguments<'_>) {
    if !cli.quiet {
        warn(message);
    }
}

fn verbose(cli: &Cli, message: std::fmt::Arguments<'_>) {
    if cli.verbose {
        warn(message);
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
    urls.split(',')
        .map(redmutex::redact_url)
        .collect::<Vec<_>>()
        .join(",")
}

/// What KEY is in Redis, as `release` needs to know.
enum Kind {
    /// Nothing there.
    Free,
    /// A string: a plain lock.
    Lock,
    /// A hash with a limit: a semaphore.
    Semaphore,
    /// Something else (a reentrant or read-write lock, another program's
    /// key).
    Other,
}

/// Asked with the commands the ACL rules (docs/failure-model.md) allow (no `TYPE`): a
/// `GET`, and for a non-string the semaphore's status script.
fn kind(client: &LockClient, name: &str) -> Result<Kind, Failure> {
    let key = client.key(name);
    let mut con = connection(client)?;
    let value: Result<Option<Vec<u8>>, _> = redis::cmd("GET").arg(&key).query(&mut con);
    match value {
        Ok(Some(_)) => return Ok(Kind::Lock),
        Ok(None) => return Ok(Kind::Free),
        Err(e) if e.code() == Some("WRONGTYPE") => {}
        Err(e) => return Err(redis_failure(Error::Redis(e))),
    }
    match Semaphore::new(client, name, 1).status() {
        Ok(status) if status.limit().is_some() => Ok(Kind::Semaphore),
        // Gone in between.
        Ok(_) => Ok(Kind::Free),
        Err(Error::InvalidArgument(_) | Error::WrongType { .. }) => Ok(Kind::Other),
        Err(err) => Err(redis_failure(err)),
    }
}

/// Who holds KEY, in a few words for a waiting or refused `run`: the lock's
/// holder, or with `limit` how many permits are out. `None` when free.
fn describe(
    client: &LockClient,
    name: &str,
    limit: Option<u32>,
) -> Result<Option<String>, Failure> {
    if limit.is_none() {
        // One atomic read (the lock's status), never a token's secret.
        return match DistributedLock::new(client, name).status() {
            Ok(held) => {
                Ok(held.map(|held| format!("held by {} ({})", who_holds(&held), left_text(&held))))
            }
            Err(Error::WrongType { key }) => Err(fail(
                EXIT_DATAERR,
                format!("{key:?} holds a value of another type: it is not a redmutex lock"),
            )),
            Err(err) => Err(redis_failure(err)),
        };
    }
    let status = Semaphore::new(client, name, 1)
        .status()
        .map_err(redis_failure)?;
    let Some(first) = status.holders().first() else {
        return Ok(None);
    };
    Ok(Some(format!(
        "{} of {} permits out (the first lease ends in {:.1}s unless renewed)",
        status.in_use(),
        status.limit().unwrap_or_default(),
        first.remaining().as_secs_f64()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever a key holds, the CLI shows it without panicking and
        /// without the token's secret, and its JSON stays JSON.
        #[test]
        fn any_value_is_shown_without_a_panic_or_its_secret(
            secret in "[A-Za-z0-9_-]{16,22}",
            rest in ".{0,120}",
            at in proptest::num::u64::ANY,
        ) {
            for token in [
                format!("{secret}|{rest}"),
                format!("{secret}|host|1|prog|{at}|"),
                secret.clone(),
            ] {
                let shown = who(&token);
                prop_assert!(!shown.contains(&secret));
                let escape = shown.contains('\u{1b}');
                prop_assert!(!escape, "a control sequence shown");
                let json = holder_json(Holder::from_token(&token).as_ref());
                prop_assert!(serde_json::from_str::<serde_json::Value>(&json).is_ok(), "{}", json);
            }
        }
    }

    #[test]
    fn a_holder_past_the_year_9999_is_unreadable_not_a_panic() {
        assert_eq!(
            who("SECRET|host|1|prog|253402300800000|"),
            "an unreadable holder"
        );
        assert!(who("SECRET|host|1|prog|253402300799999|").contains("9999-12-31"));
        assert_eq!(
            who("0b5e8f6a-9d0c-4b1e-8a57-2f1d3c4b5a69"),
            "a holder without metadata"
        );
    }
}
