//! `run --report FILE`: how a run ended, as JSON a scheduler or a wrapper
//! script reads instead of parsing messages.
//!
//! ```json
//! {"outcome":"lost","exit_code":75,"key":"nightly","reason":"…",
//!  "holder":null,"command_exit_code":null,"command_signal":15,
//!  "started_at_ms":…,"ended_at_ms":…,"fencing_token":null}
//! ```
//!
//! `outcome` is one of: `finished` (the command ran and exited; its code
//! is `command_exit_code`, or `command_signal`), `not_acquired` (held
//! elsewhere: `holder` says by whom), `lost` (the lease was lost or could
//! not be renewed, before, while or after the command ran: `reason`),
//! `max_run` (ended by `--max-run`), `signalled` (a signal arrived before
//! the command started), `not_started` (the command could not be
//! started: `reason`), `error` (Redis or the system failed: `reason`).
//! The file is written whole or not at all (a temporary file renamed).

use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Default)]
struct Report {
    outcome: Option<&'static str>,
    key: Option<String>,
    reason: Option<String>,
    holder: Option<String>,
    command_exit_code: Option<i32>,
    command_signal: Option<i32>,
    started: Option<SystemTime>,
    fencing_token: Option<u64>,
}

static REPORT: Mutex<Report> = Mutex::new(Report {
    outcome: None,
    key: None,
    reason: None,
    holder: None,
    command_exit_code: None,
    command_signal: None,
    started: None,
    fencing_token: None,
});

fn with(f: impl FnOnce(&mut Report)) {
    // A poisoned lock (a panic elsewhere) still holds a report to write.
    let mut report = REPORT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    f(&mut report);
}

/// How the run ended (the first word said wins: a later, more general
/// one does not overwrite it), and why.
pub(super) fn outcome(outcome: &'static str, reason: Option<String>) {
    with(|r| {
        if r.outcome.is_none() {
            r.outcome = Some(outcome);
            r.reason = reason;
        }
    });
}

pub(super) fn key(key: &str) {
    with(|r| r.key = Some(key.to_owned()));
}

pub(super) fn holder(holder: String) {
    with(|r| r.holder = Some(holder));
}

pub(super) fn started(fencing_token: Option<u64>) {
    with(|r| {
        r.started = Some(SystemTime::now());
        r.fencing_token = fencing_token;
    });
}

/// How the command itself ended.
pub(super) fn command(status: std::process::ExitStatus) {
    use std::os::unix::process::ExitStatusExt;
    with(|r| {
        r.command_exit_code = status.code();
        r.command_signal = status.signal();
    });
}

fn millis(at: SystemTime) -> u128 {
    at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis())
}

fn json(report: &Report, exit_code: u8, failure: Option<&str>) -> String {
    let text = |t: Option<&str>| t.map_or("null".into(), super::json_string);
    let number = |n: Option<i32>| n.map_or("null".into(), |n| n.to_string());
    let outcome = report.outcome.unwrap_or("error");
    let reason = report.reason.as_deref().or(failure);
    format!(
        "{{\"outcome\":\"{outcome}\",\"exit_code\":{exit_code},\"key\":{},\"reason\":{},\
         \"holder\":{},\"command_exit_code\":{},\"command_signal\":{},\
         \"started_at_ms\":{},\"ended_at_ms\":{},\"fencing_token\":{}}}\n",
        text(report.key.as_deref()),
        text(reason),
        text(report.holder.as_deref()),
        number(report.command_exit_code),
        number(report.command_signal),
        report
            .started
            .map_or("null".into(), |at| millis(at).to_string()),
        millis(SystemTime::now()),
        report
            .fencing_token
            .map_or("null".into(), |t| t.to_string()),
    )
}

/// Writes the report to `path`: a temporary file beside it, renamed over
/// it, so a reader never sees half of one.
///
/// # Errors
///
/// The file system's, as text.
pub(super) fn write(path: &Path, exit_code: u8, failure: Option<&str>) -> Result<(), String> {
    let body = {
        let report = REPORT
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        json(&report, exit_code, failure)
    };
    let name = path
        .file_name()
        .ok_or_else(|| format!("{}: not a file name", path.display()))?;
    // A new file of ours, never one found there: in a directory others
    // may write to, a name planted in advance (a symlink to a victim) is
    // refused by `create_new` (O_EXCL does not follow it), and the name
    // is not guessable (random).
    let mut last = None;
    for _ in 0..8 {
        let mut temporary = name.to_owned();
        temporary.push(format!(".{:016x}.tmp", random()));
        let temporary = path.with_file_name(temporary);
        let created = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temporary);
        let mut file = match created {
            Ok(file) => file,
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {
                last = Some(err);
                continue;
            }
            Err(err) => return Err(format!("writing the report {}: {err}", path.display())),
        };
        // `rename` replaces the name itself, a symlink found there too,
        // and never writes through it.
        let written = file
            .write_all(body.as_bytes())
            .and_then(|()| file.sync_all())
            .and_then(|()| std::fs::rename(&temporary, path));
        return written.map_err(|err| {
            let _ = std::fs::remove_file(&temporary);
            format!("writing the report {}: {err}", path.display())
        });
    }
    Err(format!(
        "writing the report {}: {}",
        path.display(),
        last.map_or_else(|| "no free name".into(), |e| e.to_string())
    ))
}

/// 64 random bits, from the kernel.
fn random() -> u64 {
    let mut bytes = [0u8; 8];
    // SAFETY: getrandom into a live buffer of that length.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != 8 {
        // Never short for 8 bytes once the pool is up; the nanoseconds
        // still make a name unlikely to be planted.
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        return u64::from(nanos) ^ u64::from(std::process::id());
    }
    u64::from_le_bytes(bytes)
}
