//! Processes as `/proc` shows them (Linux): what the CLI's supervisor
//! tests look at to tell whether a command, a helper or a daemon still
//! runs, and who started whom.

use std::path::Path;
use std::time::{Duration, Instant};

/// The fields of `/proc/PID/stat` after the name (the name is in
/// parentheses and may hold anything): the state first, then the parent.
fn fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(
        stat.rsplit_once(')')?
            .1
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
    )
}

/// A process's state letter (`T` stopped, `Z` zombie), or `None` once
/// it is gone.
pub fn state(pid: u32) -> Option<char> {
    fields(pid)?.first()?.chars().next()
}

/// Whether process `pid` is gone (a zombie waiting to be reaped counts as
/// gone: it runs nothing).
pub fn gone(pid: u32) -> bool {
    matches!(state(pid), None | Some('Z'))
}

/// A process's parent.
pub fn parent(pid: u32) -> Option<u32> {
    fields(pid)?.get(1)?.parse().ok()
}

/// A process's session.
pub fn session(pid: u32) -> Option<u32> {
    fields(pid)?.get(3)?.parse().ok()
}

/// Every process's pid.
pub fn pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

/// The processes whose parent is `pid`.
pub fn children_of(pid: u32) -> Vec<u32> {
    pids()
        .into_iter()
        .filter(|child| parent(*child) == Some(pid))
        .collect()
}

/// A process's name (`/proc/PID/comm`).
pub fn comm(pid: u32) -> Option<String> {
    Some(
        std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .ok()?
            .trim()
            .to_owned(),
    )
}

/// The pid a command wrote to `path`, once it has.
pub fn read_pid(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Waits for `child` to end, at most `within`; kills it and fails if it
/// does not (so a failed test leaves nothing running).
pub fn wait_exit(child: &mut std::process::Child, within: Duration) -> std::process::ExitStatus {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        if started.elapsed() >= within {
            let _ = child.kill();
            let _ = child.wait();
            panic!("did not end within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
