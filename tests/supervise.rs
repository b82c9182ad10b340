//! `redmutex run` as a supervisor a shell user can trust: job control in
//! a real terminal (an interactive bash on a pseudo-terminal), a command
//! that changes its user when `redmutex` is killed, `nohup`, signals
//! ignored on entry, daemonizing commands, and the exit codes of each.
#![cfg(all(feature = "cli", target_os = "linux"))]

use redmutex_test_support as support;

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::Commands;
use redmutex::Lease;
use support::processes::{self, children_of, comm, gone, parent, pids, read_pid, state};
use support::{RedisServer, wait_until};

fn redmutex_path() -> PathBuf {
    assert_cmd::cargo::cargo_bin("redmutex")
}

fn held(server: &RedisServer, key: &str) -> Option<String> {
    server.conn().get(key).expect("GET")
}

/// SIGKILLs `redmutex` (`run`) and checks that process `pid` goes with it
/// within 5 s (killed at the end if not, so a failed test leaves nothing).
fn kill_and_expect_gone(run: &mut std::process::Child, pid: u32, what: &str) {
    assert!(support::signal(run.id(), "KILL"));
    let _ = run.wait();
    let killed = wait_until(Duration::from_secs(5), || gone(pid));
    if !killed {
        // SAFETY: kills the leftover (the test failed).
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    assert!(killed, "{what} {pid} outlived a killed redmutex");
}

/// Set to the steps this binary runs as a job-control test's command
/// (see [`command_steps`]).
const STEPS: &str = "REDMUTEX_TEST_STEPS";

/// The command line that runs this test binary as a command doing
/// `steps`: space-separated `pid:PATH` (write its pid), `sleep:MS`,
/// `count:PATH:N:MS` (append 0 to N-1 to PATH, a line every MS), `read:PATH`
/// (read a line of standard input, write `got LINE` to PATH), `touch:PATH`.
///
/// Not a shell script: a ^Z that lands while a shell is between `vfork`
/// and `exec` of a program such as `sleep` stops only the new child and
/// leaves the shell waiting uninterruptibly, so it never stops and neither
/// a shell nor `redmutex` sees a job to stop (the job neither runs nor
/// stops until continued). These tests press ^Z at moments of their
/// choosing, to test job control and not that window: their command is
/// one process that never forks.
fn steps_command(steps: &str) -> String {
    let exe = std::env::current_exe().expect("test binary");
    format!(
        "env {STEPS}='{steps}' {} --exact command_steps --nocapture --test-threads=1 --quiet",
        exe.display()
    )
}

/// [`steps_command`] as arguments, for a command started without a shell.
fn steps_args(steps: &str) -> Vec<String> {
    let exe = std::env::current_exe().expect("test binary");
    vec![
        "env".into(),
        format!("{STEPS}={steps}"),
        exe.display().to_string(),
        "--exact".into(),
        "command_steps".into(),
        "--nocapture".into(),
        "--test-threads=1".into(),
        "--quiet".into(),
    ]
}

/// Not a test: the command of [`steps_command`] when [`STEPS`] is set.
#[test]
fn command_steps() {
    let Ok(steps) = std::env::var(STEPS) else {
        return;
    };
    for step in steps.split(' ') {
        let parts: Vec<&str> = step.split(':').collect();
        match parts[..] {
            ["pid", path] => std::fs::write(path, std::process::id().to_string()).expect("pid"),
            ["sleep", ms] => std::thread::sleep(Duration::from_millis(ms.parse().expect("ms"))),
            ["count", path, n, ms] => {
                let pause = Duration::from_millis(ms.parse().expect("ms"));
                for i in 0..n.parse::<u32>().expect("n") {
                    let mut log = std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(path)
                        .expect("log");
                    writeln!(log, "{i}").expect("append");
                    std::thread::sleep(pause);
                }
            }
            ["read", path] => {
                let mut line = String::new();
                std::io::stdin().read_line(&mut line).expect("read");
                std::fs::write(path, format!("got {}", line.trim())).expect("answer");
            }
            ["touch", path] => std::fs::write(path, "").expect("touch"),
            // A process of its own session (as `setsid` starts one), not
            // waited for: it writes its pid to PATH.pid and counts into
            // PATH.
            ["helper", path, n, ms] => {
                let mut helper = Command::new(std::env::current_exe().expect("test binary"));
                helper
                    .args([
                        "--exact",
                        "command_steps",
                        "--nocapture",
                        "--test-threads=1",
                    ])
                    .arg("--quiet")
                    .env(STEPS, format!("pid:{path}.pid count:{path}:{n}:{ms}"))
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null());
                // SAFETY: setsid(2) between fork and exec.
                unsafe {
                    helper.pre_exec(|| {
                        libc::setsid();
                        Ok(())
                    });
                }
                // Not waited for: it outlives this process on purpose, and
                // its subreaper (`redmutex`'s reaper) reaps it.
                #[allow(clippy::zombie_processes)]
                helper.spawn().expect("helper");
            }
            // In a session of its own (as a daemon gone wrong), forks,
            // and the parent exits, for ever: a process whose pid is never
            // the same twice, ignoring SIGTERM; each writes its pid to
            // PATH.
            ["hop", path] => {
                let path = std::ffi::CString::new(path).expect("path");
                // SAFETY: setsid(2) and signal(2), then only fork, _exit,
                // open, write and close in the loop (async-signal-safe, as
                // a fork of a process with threads needs).
                // Its session's number first, for a test to end it by.
                std::fs::write(
                    format!("{}.sid", path.to_string_lossy()),
                    // SAFETY: setsid(2): a session and group of its own.
                    unsafe { libc::setsid() }.to_string(),
                )
                .expect("sid");
                // SAFETY: as above.
                unsafe {
                    libc::signal(libc::SIGTERM, libc::SIG_IGN);
                    loop {
                        if libc::fork() != 0 {
                            libc::_exit(0);
                        }
                        let fd = libc::open(
                            path.as_ptr(),
                            libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC,
                            0o644,
                        );
                        if fd >= 0 {
                            let mut digits = [0u8; 12];
                            let mut n = libc::getpid();
                            let mut at = digits.len();
                            while n > 0 && at > 0 {
                                at -= 1;
                                digits[at] = b'0' + (n % 10) as u8;
                                n /= 10;
                            }
                            libc::write(fd, digits[at..].as_ptr().cast(), digits.len() - at);
                            libc::close(fd);
                        }
                    }
                }
            }
            _ => panic!("unknown step {step:?}"),
        }
    }
}

/// The watcher process of the `redmutex` whose pid is `runner`.
fn watcher_of(runner: u32) -> Option<u32> {
    children_of(runner)
        .into_iter()
        .find(|pid| comm(*pid).as_deref() == Some("redmutex-watch"))
}

/// The pid of the `redmutex run` whose key is `key` (its command line),
/// not its watcher (a fork of it, with the same command line).
fn redmutex_of(key: &str) -> Option<u32> {
    let out = Command::new("pgrep")
        .args(["-f", &format!("redmutex .*run .*{key} --")])
        .output()
        .ok()?;
    let found: Vec<u32> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .filter(|pid: &u32| state(*pid).is_some_and(|s| s != 'Z'))
        .collect();
    found
        .iter()
        .copied()
        .find(|pid| parent(*pid).is_none_or(|p| !found.contains(&p)))
}

/// An interactive bash on a pseudo-terminal: what a user at a terminal
/// runs `redmutex` from, with job control.
struct Terminal {
    master: std::fs::File,
    shell: std::process::Child,
    output: Arc<Mutex<String>>,
}

impl Terminal {
    fn open(server: &RedisServer) -> Terminal {
        let mut shell = Command::new("bash");
        shell.args(["--norc", "--noprofile", "-i"]).env("PS1", "$ ");
        let terminal = Terminal::spawn(server, shell);
        assert!(terminal.expect("$ ", Duration::from_secs(10)), "no prompt");
        terminal
    }

    /// `program` as the session leader of a new pseudo-terminal, with no
    /// shell doing job control: what `ssh -t host CMD`, `docker run -it`
    /// and `kubectl exec -it` give a command.
    fn spawn(server: &RedisServer, mut shell: Command) -> Terminal {
        let (mut master, mut slave) = (0, 0);
        // SAFETY: openpty fills two descriptors; no name, termios or size.
        let rc = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(rc, 0, "openpty");
        // SAFETY: descriptors openpty just gave us.
        let (master, slave) =
            unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
        shell
            .env("REDMUTEX_URL", server.url())
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .stdin(Stdio::from(slave.try_clone().expect("dup")))
            .stdout(Stdio::from(slave.try_clone().expect("dup")))
            .stderr(Stdio::from(slave));
        // SAFETY: setsid and TIOCSCTTY between fork and exec make the
        // pseudo-terminal the shell's controlling terminal.
        unsafe {
            shell.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let shell = shell.spawn().expect("bash");
        let master = std::fs::File::from(master);
        let output = Arc::new(Mutex::new(String::new()));
        let mut reader = master.try_clone().expect("dup");
        let sink = output.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                if let Ok(mut out) = sink.lock() {
                    out.push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            }
        });
        Terminal {
            master,
            shell,
            output,
        }
    }

    fn send(&mut self, text: &str) {
        self.master.write_all(text.as_bytes()).expect("write");
    }

    /// Everything the terminal showed so far.
    fn shown(&self) -> String {
        self.output.lock().map(|o| o.clone()).unwrap_or_default()
    }

    /// Waits for `text` to be shown (anywhere in the output so far).
    fn expect(&self, text: &str, within: Duration) -> bool {
        wait_until(within, || self.shown().contains(text))
    }

    /// Once the job of `key` has ended: the exit code the shell saw.
    fn exit_code(&mut self, key: &str) -> Option<i32> {
        if !wait_until(Duration::from_secs(15), || redmutex_of(key).is_none()) {
            return None;
        }
        let marker = format!("rc-{}=", std::process::id());
        self.send(&format!("echo \"{marker}$?.\"\n"));
        let mut code = None;
        wait_until(Duration::from_secs(10), || {
            let shown = self.shown();
            // The echoed line, not the command typed (which has `$?`).
            code = shown
                .rsplit(marker.as_str())
                .next()
                .and_then(|rest| rest.split('.').next())
                .and_then(|n| n.trim().parse().ok());
            code.is_some()
        });
        code
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        // SAFETY: kills the shell's session group (its jobs have their own
        // groups: they are killed by the test's cleanup of its keys).
        unsafe { libc::kill(-(self.shell.id() as i32), libc::SIGKILL) };
        let _ = self.shell.kill();
        let _ = self.shell.wait();
    }
}

/// Kills what a failed test left: every `redmutex` of `key` and its
/// command's group.
fn clean_up(key: &str) {
    let _ = Command::new("pkill")
        .args(["-KILL", "-f", &format!("run .*{key} --")])
        .status();
}

/// ^Z in a real terminal stops the whole job (the command and
/// `redmutex`), the shell gets its prompt back and says so, and `fg`
/// resumes it; the command, which has the terminal, reads from it. On
/// main only the command stopped: `redmutex` kept renewing, the shell
/// never got its prompt back.
#[test]
fn ctrl_z_stops_the_whole_job_and_fg_resumes_it() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let pidfile = dir.path().join("pid");
    let answer = dir.path().join("answer");
    let key = format!("ctrlz-{}", std::process::id());
    let mut terminal = Terminal::open(&server);
    let line = format!(
        "{} run {key} -- sh -c 'echo $$ > {}; read x; echo \"got $x\" > {}'",
        redmutex_path().display(),
        pidfile.display(),
        answer.display()
    );
    terminal.send(&format!("{line}\n"));
    let started = wait_until(Duration::from_secs(10), || {
        read_pid(&pidfile).is_some() && held(&server, &key).is_some()
    });
    if !started {
        clean_up(&key);
        panic!("did not start: {}", terminal.shown());
    }
    let command = read_pid(&pidfile).expect("pid");
    let runner = redmutex_of(&key).expect("the redmutex process");
    terminal.send("\x1a");
    let stopped = terminal.expect("Stopped", Duration::from_secs(10))
        && wait_until(Duration::from_secs(5), || {
            state(command) == Some('T') && state(runner) == Some('T')
        });
    if !stopped {
        clean_up(&key);
        panic!(
            "the job did not stop as one: command {:?}, redmutex {:?}\n{}",
            state(command),
            state(runner),
            terminal.shown()
        );
    }
    assert!(held(&server, &key).is_some(), "still held while stopped");
    terminal.send("fg\n");
    // The command has the terminal again: it reads what is typed.
    std::thread::sleep(Duration::from_millis(300));
    terminal.send("hello\n");
    let code = terminal.exit_code(&key);
    if code != Some(0) {
        clean_up(&key);
        panic!("exit {code:?}: {}", terminal.shown());
    }
    assert_eq!(
        std::fs::read_to_string(&answer).expect("answer").trim(),
        "got hello"
    );
    assert_eq!(held(&server, &key), None);
}

/// `bg` continues the job without the terminal: a command that reads it
/// is stopped by the terminal (SIGTTIN), the whole job with it, and `fg`
/// gives it the terminal back to read from. On main the command stopped
/// alone and never resumed.
#[test]
fn a_read_from_the_background_stops_the_job_and_fg_resumes_it() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let pidfile = dir.path().join("pid");
    let answer = dir.path().join("answer");
    let key = format!("bg-{}", std::process::id());
    let mut terminal = Terminal::open(&server);
    let line = format!(
        "{} run {key} -- {}",
        redmutex_path().display(),
        steps_command(&format!(
            "pid:{} sleep:500 read:{}",
            pidfile.display(),
            answer.display()
        ))
    );
    terminal.send(&format!("{line}\n"));
    if !wait_until(Duration::from_secs(10), || read_pid(&pidfile).is_some()) {
        clean_up(&key);
        panic!("did not start: {}", terminal.shown());
    }
    let command = read_pid(&pidfile).expect("pid");
    terminal.send("\x1a");
    if !terminal.expect("Stopped", Duration::from_secs(10)) {
        clean_up(&key);
        panic!("not stopped: {}", terminal.shown());
    }
    let stops = |t: &Terminal| t.shown().matches("Stopped").count();
    let first = stops(&terminal);
    // In the background the read stops it (SIGTTIN), and the job with it.
    terminal.send("bg\n");
    let runner = redmutex_of(&key).expect("the redmutex process");
    let stopped_again = wait_until(Duration::from_secs(10), || {
        state(command) == Some('T') && state(runner) == Some('T')
    });
    // The shell reports it at its next prompt.
    terminal.send("\n");
    if !stopped_again || !wait_until(Duration::from_secs(10), || stops(&terminal) > first) {
        clean_up(&key);
        panic!(
            "not stopped by the read: command {:?}, redmutex {:?}\n{}",
            state(command),
            state(runner),
            terminal.shown()
        );
    }
    terminal.send("fg\n");
    std::thread::sleep(Duration::from_millis(300));
    terminal.send("hello\n");
    let code = terminal.exit_code(&key);
    if code != Some(0) {
        clean_up(&key);
        panic!("exit {code:?}: {}", terminal.shown());
    }
    assert_eq!(
        std::fs::read_to_string(&answer).expect("answer").trim(),
        "got hello"
    );
}

/// Started in the background (`&`): a read of the terminal stops the job,
/// and `fg` gives the command the terminal it never had.
#[test]
fn a_job_started_in_the_background_gets_the_terminal_on_fg() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let answer = dir.path().join("answer");
    let key = format!("amp-{}", std::process::id());
    let mut terminal = Terminal::open(&server);
    let line = format!(
        "{} run {key} -- sh -c 'read x; echo \"got $x\" > {}' &",
        redmutex_path().display(),
        answer.display()
    );
    terminal.send(&format!("{line}\n"));
    let stopped = wait_until(Duration::from_secs(10), || {
        redmutex_of(&key).is_some_and(|pid| state(pid) == Some('T'))
    });
    if !stopped {
        clean_up(&key);
        panic!("the read did not stop the job: {}", terminal.shown());
    }
    terminal.send("fg\n");
    std::thread::sleep(Duration::from_millis(300));
    terminal.send("hello\n");
    let code = terminal.exit_code(&key);
    if code != Some(0) {
        clean_up(&key);
        panic!("exit {code:?}: {}", terminal.shown());
    }
    assert_eq!(
        std::fs::read_to_string(&answer).expect("answer").trim(),
        "got hello"
    );
}

/// A lease lost while the job was stopped (past its ttl, then taken by
/// another client): on `fg` the command is killed before it runs again,
/// and `redmutex` exits 75 saying why.
#[test]
fn a_lease_lost_while_stopped_kills_the_command_before_it_runs() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let pidfile = dir.path().join("pid");
    let ran = dir.path().join("ran");
    let key = format!("lost-stopped-{}", std::process::id());
    let mut terminal = Terminal::open(&server);
    let line = format!(
        "{} run --ttl 1s {key} -- {}",
        redmutex_path().display(),
        steps_command(&format!(
            "pid:{} sleep:1000 touch:{}",
            pidfile.display(),
            ran.display()
        ))
    );
    terminal.send(&format!("{line}\n"));
    if !wait_until(Duration::from_secs(10), || read_pid(&pidfile).is_some()) {
        clean_up(&key);
        panic!("did not start: {}", terminal.shown());
    }
    let command = read_pid(&pidfile).expect("pid");
    terminal.send("\x1a");
    if !terminal.expect("Stopped", Duration::from_secs(10)) {
        clean_up(&key);
        panic!("not stopped: {}", terminal.shown());
    }
    // Stopped past its lease; another client takes the lock.
    let other = server.lock_client();
    let theirs = redmutex::DistributedLock::new(&other, key.as_str())
        .try_lock_for(Duration::from_secs(10))
        .expect("try")
        .expect("the lease ran out while stopped");
    terminal.send("fg\n");
    let code = terminal.exit_code(&key);
    if code != Some(75) {
        clean_up(&key);
        panic!("exit {code:?}, not 75: {}", terminal.shown());
    }
    let shown = terminal.shown();
    assert!(
        shown.contains("while the job was stopped (it expired or was taken)"),
        "{shown}"
    );
    // Not blamed on Redis: the stop is what ran the lease out.
    assert!(!shown.contains("unreachable"), "{shown}");
    assert!(wait_until(Duration::from_secs(5), || gone(command)));
    assert!(!ran.exists(), "the command ran on after its lease was lost");
    assert_eq!(held(&server, &key).as_deref(), Some(theirs.token()));
    theirs.unlock().expect("theirs");
}

/// A command that stops itself with SIGSTOP to its own group while it
/// has the terminal (what editors such as nano do on ^Z): the whole job
/// stops, the shell gets its prompt back, and `fg` resumes it.
#[test]
fn a_command_stopping_itself_in_the_foreground_stops_the_job() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let done = dir.path().join("done");
    let key = format!("selfstop-{}", std::process::id());
    let mut terminal = Terminal::open(&server);
    let line = format!(
        "{} run {key} -- sh -c 'kill -STOP 0; touch {}'",
        redmutex_path().display(),
        done.display()
    );
    terminal.send(&format!("{line}\n"));
    if !terminal.expect("Stopped", Duration::from_secs(10)) {
        clean_up(&key);
        panic!("the job did not stop: {}", terminal.shown());
    }
    assert!(!done.exists());
    terminal.send("fg\n");
    let code = terminal.exit_code(&key);
    if code != Some(0) {
        clean_up(&key);
        panic!("exit {code:?}: {}", terminal.shown());
    }
    assert!(done.exists());
    assert_eq!(held(&server, &key), None);
}

/// Standard input redirected (a script's way): ^Z stops the whole job,
/// the command with it. Stopped longer than the lease allows, the command
/// is killed while still stopped (nothing renews a stopped job's lease,
/// and a shell's `fg` continues the whole job at once); `fg` then finds
/// it gone and `redmutex` exits 75 saying why. It never ran again.
#[test]
fn ctrl_z_with_stdin_redirected_stops_the_command_too() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("log");
    let key = format!("ctrlz-redirected-{}", std::process::id());
    let mut terminal = Terminal::open(&server);
    let line = format!(
        "{} run --ttl 1s {key} -- {} < /dev/null",
        redmutex_path().display(),
        steps_command(&format!("count:{}:40:50", log.display()))
    );
    terminal.send(&format!("{line}\n"));
    if !wait_until(Duration::from_secs(10), || log.exists()) {
        clean_up(&key);
        panic!("did not start: {}", terminal.shown());
    }
    terminal.send("\x1a");
    if !terminal.expect("Stopped", Duration::from_secs(10)) {
        clean_up(&key);
        panic!("not stopped: {}", terminal.shown());
    }
    let lines = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .count()
    };
    // Let anything in flight land, then nothing more while stopped.
    std::thread::sleep(Duration::from_millis(200));
    let at_stop = lines();
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        lines(),
        at_stop,
        "the command ran while the job was stopped"
    );
    terminal.send("fg\n");
    let code = terminal.exit_code(&key);
    if code != Some(75) {
        clean_up(&key);
        panic!("exit {code:?}: {}", terminal.shown());
    }
    assert_eq!(
        lines(),
        at_stop,
        "the command ran again after its lease ran out"
    );
    assert!(at_stop < 40);
    let shown = terminal.shown();
    assert!(shown.contains("while the job was stopped"), "{shown}");
    assert_eq!(held(&server, &key), None);
}

/// `nohup redmutex run …`: SIGHUP was ignored on entry, so it stays
/// ignored and is not passed on; the command finishes. On main the
/// handler forwarded it and the command died (exit 129).
#[test]
fn nohup_keeps_sighup_ignored() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let finished = dir.path().join("finished");
    let ready = dir.path().join("ready");
    let mut run = Command::new("nohup")
        .arg(redmutex_path())
        .env("REDMUTEX_URL", server.url())
        .args(["run", "nohup-key", "--", "sh", "-c"])
        .arg(format!(
            "touch {}; sleep 1; echo finished > {}",
            ready.display(),
            finished.display()
        ))
        .current_dir(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nohup");
    assert!(wait_until(Duration::from_secs(10), || ready.exists()));
    assert!(support::signal(run.id(), "HUP"));
    let status = run.wait().expect("status");
    assert_eq!(status.code(), Some(0), "flock(1)'s answer under nohup");
    assert_eq!(
        std::fs::read_to_string(&finished).expect("finished").trim(),
        "finished"
    );
}

/// A script's background job starts with SIGINT and SIGQUIT ignored: they
/// stay ignored, and a ^C meant for the foreground does not end it.
#[test]
fn signals_ignored_on_entry_are_not_passed_on() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let ready = dir.path().join("ready");
    let mut command = Command::new(redmutex_path());
    command
        .env("REDMUTEX_URL", server.url())
        .args(["run", "ignored", "--", "sh", "-c"])
        .arg(format!("touch {}; sleep 1", ready.display()));
    // SAFETY: ignores two signals between fork and exec.
    unsafe {
        command.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_IGN);
            libc::signal(libc::SIGQUIT, libc::SIG_IGN);
            Ok(())
        });
    }
    let mut run = command.spawn().expect("run");
    assert!(wait_until(Duration::from_secs(10), || ready.exists()));
    assert!(support::signal(run.id(), "INT"));
    assert!(support::signal(run.id(), "QUIT"));
    let status = run.wait().expect("status");
    assert_eq!(status.code(), Some(0));
}

/// A command that changes its user (`setpriv`, like `gosu` or a setuid
/// program) loses the kernel's parent-death signal; when `redmutex` is
/// killed, its watcher process kills the command's group. On main the
/// command ran on, unrenewed, and a second run started beside it. Needs
/// root (to change user); skipped otherwise.
#[test]
fn a_command_that_changes_user_dies_with_redmutex() {
    // SAFETY: reads the effective user id.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: changing the command's user needs root");
        return;
    }
    let Ok(setpriv) = which("setpriv") else {
        eprintln!("skipped: no setpriv");
        return;
    };
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    // The command, as nobody, writes its pid here.
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .expect("chmod");
    let pidfile = dir.path().join("pid");
    let mut run = Command::new(redmutex_path())
        .env("REDMUTEX_URL", server.url())
        .args(["run", "--ttl", "2s", "setuid", "--"])
        .arg(setpriv)
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-c",
        ])
        .arg(format!("echo $$ > {}; exec sleep 300", pidfile.display()))
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || read_pid(&pidfile).is_some()));
    let command = read_pid(&pidfile).expect("pid");
    let uid = std::fs::read_to_string(format!("/proc/{command}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .unwrap_or_default()
        .to_owned();
    assert!(uid.contains("65534"), "the command changed user: {uid}");
    kill_and_expect_gone(&mut run, command, "the command");
}

/// `--daemon`: a command that forks a server away (a new session) and
/// exits keeps the lock while the server runs, renewed, and gives it up
/// when the server ends; without `--daemon` the lock goes with the
/// command, as docs/cli.md says. A loss ends the server too.
#[test]
fn daemon_keeps_the_lock_while_the_commands_daemon_runs() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let pidfile = dir.path().join("daemon");
    // The daemon: its own session (so not in the command's group),
    // running 2.5 s, its pid written down.
    let script = format!(
        "setsid sh -c 'echo $$ > {}; sleep 2.5' </dev/null >/dev/null 2>&1 & exit 0",
        pidfile.display()
    );
    let mut run = Command::new(redmutex_path())
        .env("REDMUTEX_URL", server.url())
        .args([
            "run",
            "--daemon",
            "--ttl",
            "1s",
            "daemon-key",
            "--",
            "sh",
            "-c",
        ])
        .arg(&script)
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || read_pid(&pidfile).is_some()));
    let daemon = read_pid(&pidfile).expect("pid");
    // The command itself is gone; the lock stays, past its 1 s ttl.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(!gone(daemon));
    assert!(held(&server, "daemon-key").is_some(), "kept for the daemon");
    let started = Instant::now();
    let status = run.wait().expect("status");
    assert_eq!(status.code(), Some(0));
    assert!(gone(daemon));
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "waited for it"
    );
    assert_eq!(held(&server, "daemon-key"), None);

    // A loss while only the daemon runs: the daemon is ended, exit 75.
    std::fs::remove_file(&pidfile).expect("rm");
    let mut run = Command::new(redmutex_path())
        .env("REDMUTEX_URL", server.url())
        .args(["run", "--daemon", "daemon-key", "--", "sh", "-c"])
        .arg(script.replace("sleep 2.5", "sleep 60"))
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || read_pid(&pidfile).is_some()));
    let daemon = read_pid(&pidfile).expect("pid");
    std::thread::sleep(Duration::from_millis(300));
    let _: () = server
        .conn()
        .set("daemon-key", "someone-else")
        .expect("SET");
    let status = run.wait().expect("status");
    let mut stderr = String::new();
    let _ = run
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr);
    assert_eq!(status.code(), Some(75), "{stderr}");
    assert!(
        wait_until(Duration::from_secs(5), || gone(daemon)),
        "the daemon ran on"
    );

    // Without --daemon: released when the command exits.
    std::fs::remove_file(&pidfile).expect("rm");
    let _: () = server.conn().del("daemon-key").expect("DEL");
    let status = Command::new(redmutex_path())
        .env("REDMUTEX_URL", server.url())
        .args(["run", "daemon-key", "--", "sh", "-c"])
        .arg(&script)
        .status()
        .expect("run");
    assert_eq!(status.code(), Some(0));
    assert_eq!(
        held(&server, "daemon-key"),
        None,
        "released with the command"
    );
    if let Some(daemon) = read_pid(&pidfile) {
        // SAFETY: ends the test's daemon.
        unsafe { libc::kill(daemon as i32, libc::SIGKILL) };
    }
}

/// A lease lost during `--min-hold` (after the command ended) exits 75,
/// not the command's code.
#[test]
fn a_loss_during_min_hold_exits_75() {
    let server = RedisServer::start();
    let mut run = Command::new(redmutex_path())
        .env("REDMUTEX_URL", server.url())
        .args([
            "run",
            "--ttl",
            "3s",
            "--min-hold",
            "10s",
            "min-hold",
            "--",
            "true",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || held(
        &server, "min-hold"
    )
    .is_some()));
    std::thread::sleep(Duration::from_millis(300));
    let _: () = server.conn().set("min-hold", "someone-else").expect("SET");
    let started = Instant::now();
    let status = run.wait().expect("status");
    let mut stderr = String::new();
    let _ = run
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr);
    assert_eq!(status.code(), Some(75), "{stderr}");
    assert!(stderr.contains("during --min-hold"), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(9),
        "not the whole --min-hold"
    );
}

/// `redmutex` stopped by SIGSTOP (not job control: its command runs on,
/// and no renewal is sent): the watcher kills the command before the
/// lease runs out in Redis, so no moment is seen where the key is gone and
/// the command still runs. On main the command ran on, unleased, until
/// `redmutex` was continued.
#[test]
fn a_stopped_redmutex_cannot_leave_its_command_running_past_the_lease() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let pidfile = dir.path().join("pid");
    let mut run = Command::new(redmutex_path())
        .env("REDMUTEX_URL", server.url())
        .args(["run", "--ttl", "2s", "sigstop", "--", "sh", "-c"])
        .arg(format!("echo $$ > {}; exec sleep 60", pidfile.display()))
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || read_pid(&pidfile).is_some()));
    let command = read_pid(&pidfile).expect("pid");
    assert!(support::signal(run.id(), "STOP"));
    // Until the key is gone: the command must be gone first.
    let mut overlap = false;
    let ended = wait_until(Duration::from_secs(10), || {
        let alive = !gone(command);
        let key = held(&server, "sigstop");
        overlap |= alive && key.is_none();
        key.is_none() && !alive
    });
    assert!(support::signal(run.id(), "CONT"));
    let status = run.wait().expect("status");
    let mut stderr = String::new();
    let _ = run
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr);
    if !gone(command) {
        // SAFETY: kills the leftover (the test failed).
        unsafe { libc::kill(command as i32, libc::SIGKILL) };
    }
    assert!(ended, "the command outlived the lease");
    assert!(!overlap, "the command ran on after the key expired");
    // Said, and not the command's 137.
    assert_eq!(status.code(), Some(75), "{stderr}");
    assert!(stderr.contains("watcher killed the command"), "{stderr}");
}

/// A lease of 60 ms (renewed every 20 ms) is supervised without the
/// watcher mistaking a healthy run for a stopped `redmutex`.
#[test]
fn a_very_short_ttl_runs_the_command_to_its_end() {
    let server = RedisServer::start();
    let out = Command::new(redmutex_path())
        .env("REDMUTEX_URL", server.url())
        .args(["run", "--ttl", "60ms", "short-ttl", "--", "sleep", "1.5"])
        .output()
        .expect("run");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A process the command moves out of its group (`setsid`, as
/// `timeout(1)` or a daemon does) is ended with the command on a loss,
/// without `--daemon`: it would otherwise run on beside the next holder.
#[test]
fn a_loss_ends_what_the_command_started_outside_its_group() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let pidfile = dir.path().join("escaped");
    let mut run = Command::new(redmutex_path())
        .env("REDMUTEX_URL", server.url())
        .args(["run", "--ttl", "3s", "escaped", "--", "sh", "-c"])
        .arg(format!(
            "setsid sh -c 'echo $$ > {}; exec sleep 300' & exec sleep 300",
            pidfile.display()
        ))
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || read_pid(&pidfile).is_some()));
    let escaped = read_pid(&pidfile).expect("pid");
    // Found by the next look at the command's descendants (once a second).
    std::thread::sleep(Duration::from_millis(1500));
    let _: () = server.conn().set("escaped", "someone-else").expect("SET");
    let status = run.wait().expect("status");
    let killed = wait_until(Duration::from_secs(5), || gone(escaped));
    if !killed {
        // SAFETY: kills the leftover (the test failed).
        unsafe { libc::kill(escaped as i32, libc::SIGKILL) };
    }
    assert_eq!(status.code(), Some(75));
    assert!(
        killed,
        "the process that left the group ran on after the loss"
    );
}

/// Hundreds of processes outside the command's group are all followed,
/// and all killed with a `redmutex` killed by SIGKILL.
#[test]
fn every_daemon_dies_with_a_killed_redmutex() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let pids = dir.path().join("pids");
    let mut run = Command::new(redmutex_path())
        .env("REDMUTEX_URL", server.url())
        .args(["run", "--ttl", "30s", "many-daemons", "--", "sh", "-c"])
        .arg(format!(
            "i=0; while [ $i -lt 300 ]; do setsid sleep 300 & echo $! >> {}; i=$((i+1)); done; exec sleep 300",
            pids.display()
        ))
        .spawn()
        .expect("run");
    let all = || -> Vec<u32> {
        std::fs::read_to_string(&pids)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    };
    assert!(wait_until(Duration::from_secs(20), || all().len() == 300));
    // Two looks at the descendants after the last one started.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(support::signal(run.id(), "KILL"));
    let _ = run.wait();
    let daemons = all();
    let killed = wait_until(Duration::from_secs(10), || daemons.iter().all(|p| gone(*p)));
    let left: Vec<u32> = daemons.iter().copied().filter(|p| !gone(*p)).collect();
    for pid in &left {
        // SAFETY: kills the leftovers (the test failed).
        unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
    }
    assert!(killed, "{} of 300 daemons outlived redmutex", left.len());
}

/// A command that stops without the terminal's job control (it sends
/// itself SIGSTOP) still takes a SIGTERM passed on by `redmutex`: the
/// group is continued after the signal, as a shell's `kill` does.
#[test]
fn sigterm_reaches_a_stopped_command() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let pidfile = dir.path().join("pid");
    let mut run = Command::new(redmutex_path())
        .env("REDMUTEX_URL", server.url())
        .args(["run", "stopped-term", "--", "sh", "-c"])
        .arg(format!(
            "echo $$ > {}; kill -STOP $$; exec sleep 300",
            pidfile.display()
        ))
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || read_pid(&pidfile).is_some()));
    let command = read_pid(&pidfile).expect("pid");
    assert!(wait_until(Duration::from_secs(5), || state(command) == Some('T')));
    assert!(support::signal(run.id(), "TERM"));
    let ended = wait_until(Duration::from_secs(5), || {
        matches!(run.try_wait(), Ok(Some(_)))
    });
    if !ended {
        let _ = run.kill();
        // SAFETY: kills the leftover (the test failed).
        unsafe { libc::kill(command as i32, libc::SIGKILL) };
    }
    assert!(ended, "a SIGTERM did not end a stopped command");
    assert!(gone(command));
    assert_eq!(held(&server, "stopped-term"), None);
}

/// The watcher is named `redmutex-watch`: `pkill -x redmutex` (or
/// `killall redmutex`) kills `redmutex` and leaves the watcher to end the
/// command, also one without the parent-death signal.
#[test]
fn killall_redmutex_leaves_the_watcher_to_end_the_command() {
    let Ok(setpriv) = which("setpriv") else {
        eprintln!("skipped: no setpriv");
        return;
    };
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let pidfile = dir.path().join("pid");
    let mut run = Command::new(redmutex_path())
        .env("REDMUTEX_URL", server.url())
        .args(["run", "killall-key", "--"])
        .arg(setpriv)
        .args(["--pdeathsig", "clear", "sh", "-c"])
        .arg(format!("echo $$ > {}; exec sleep 300", pidfile.display()))
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || read_pid(&pidfile).is_some()));
    let command = read_pid(&pidfile).expect("pid");
    let watcher = watcher_of(run.id()).expect("a watcher named redmutex-watch");
    // What `killall redmutex` does, kept to this run's two processes (the
    // other tests' are left alone): every one named exactly `redmutex`.
    for pid in [run.id(), watcher] {
        if std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .is_ok_and(|c| c.trim() == "redmutex")
        {
            assert!(support::signal(pid, "KILL"));
        }
    }
    let _ = run.wait();
    let killed = wait_until(Duration::from_secs(5), || gone(command));
    if !killed {
        // SAFETY: kills the leftover (the test failed).
        unsafe { libc::kill(command as i32, libc::SIGKILL) };
    }
    assert!(killed, "the command outlived a killall of redmutex");
}

/// After the command is reaped, its group's number may be another's: a
/// `redmutex` killed during `--min-hold` must not make the watcher kill
/// the group that number names now. Forces the number's reuse through
/// `/proc/sys/kernel/ns_last_pid`: root only, skipped otherwise.
#[test]
fn a_reused_group_number_is_never_killed() {
    // SAFETY: reads the effective user id.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: forcing a pid's reuse needs root");
        return;
    }
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let pidfile = dir.path().join("pid");
    let mut run = Command::new(redmutex_path())
        .env("REDMUTEX_URL", server.url())
        .args(["run", "--min-hold", "60s", "reused-group", "--", "sh", "-c"])
        .arg(format!("echo $$ > {}", pidfile.display()))
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || read_pid(&pidfile).is_some()));
    let command = read_pid(&pidfile).expect("pid");
    // Reaped: gone from /proc altogether (not a zombie).
    assert!(wait_until(Duration::from_secs(10), || state(command).is_none()));
    // The next process gets the command's number, as its own group.
    let stranger = {
        let mut stranger = None;
        for _ in 0..20 {
            if std::fs::write("/proc/sys/kernel/ns_last_pid", format!("{}", command - 1)).is_err() {
                break;
            }
            let mut child = Command::new("sleep");
            child.arg("300").process_group(0);
            let child = child.spawn().expect("sleep");
            if child.id() == command {
                stranger = Some(child);
                break;
            }
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
        stranger
    };
    let Some(mut stranger) = stranger else {
        let _ = run.kill();
        let _ = run.wait();
        eprintln!("skipped: could not give the command's number to another process");
        return;
    };
    let watcher = watcher_of(run.id()).expect("the watcher");
    assert!(support::signal(run.id(), "KILL"));
    let _ = run.wait();
    // The watcher, seeing its pipe end, kills what it still names, then
    // exits.
    assert!(wait_until(Duration::from_secs(5), || gone(watcher)));
    let survived = matches!(stranger.try_wait(), Ok(None));
    let _ = stranger.kill();
    let _ = stranger.wait();
    assert!(
        survived,
        "the watcher killed the group that reused the command's number"
    );
}

/// A command that drops the kernel's parent-death signal (`setpriv
/// --pdeathsig clear`, as a change of user does) is still killed with a
/// `redmutex` killed by SIGKILL: by the watcher. Runs without root.
#[test]
fn a_command_without_the_parent_death_signal_dies_with_redmutex() {
    let Ok(setpriv) = which("setpriv") else {
        eprintln!("skipped: no setpriv");
        return;
    };
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let pidfile = dir.path().join("pid");
    let mut run = Command::new(redmutex_path())
        .env("REDMUTEX_URL", server.url())
        .args(["run", "--ttl", "30s", "pdeathsig", "--"])
        .arg(setpriv)
        .args(["--pdeathsig", "clear", "sh", "-c"])
        .arg(format!("echo $$ > {}; exec sleep 300", pidfile.display()))
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || read_pid(&pidfile).is_some()));
    let command = read_pid(&pidfile).expect("pid");
    kill_and_expect_gone(&mut run, command, "the command");
}

/// `--daemon`: a process the command starts in a session of its own while
/// it runs is followed from then on: a `redmutex` killed by SIGKILL takes
/// it down too (by the watcher), not only the command's group.
#[test]
fn a_daemon_started_during_the_run_dies_with_a_killed_redmutex() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let pidfile = dir.path().join("daemon");
    let script = format!(
        "setsid sh -c 'echo $$ > {}; exec sleep 300' </dev/null >/dev/null 2>&1 & exec sleep 300",
        pidfile.display()
    );
    let mut run = Command::new(redmutex_path())
        .env("REDMUTEX_URL", server.url())
        .args([
            "run",
            "--daemon",
            "--ttl",
            "30s",
            "daemon-during",
            "--",
            "sh",
            "-c",
        ])
        .arg(&script)
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || read_pid(&pidfile).is_some()));
    let daemon = read_pid(&pidfile).expect("pid");
    // Found by the next look at the command's descendants (once a second).
    std::thread::sleep(Duration::from_millis(2500));
    kill_and_expect_gone(&mut run, daemon, "the daemon");
}

fn which(name: &str) -> Result<PathBuf, ()> {
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join(name))
                .find(|candidate| candidate.is_file())
        })
        .ok_or(())
}

/// The lines in a log a `count` step writes.
fn lines(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .count()
}

/// `redmutex run … | pager`: the command runs in the job's own process
/// group, as under flock(1), so a pager that reads the terminal in the same
/// pipeline is in the foreground and pages. On main the command was given
/// the terminal's foreground, the pager became a background reader, and
/// the job showed "Stopped" at once and again on every `fg`.
#[test]
fn a_pipeline_into_a_pager_pages() {
    let server = RedisServer::start();
    let key = format!("pager-{}", std::process::id());
    let mut terminal = Terminal::open(&server);
    // A pager's shape: it reads the terminal for its keys, and its input
    // from the pipe.
    let pager = "sh -c 'read key < /dev/tty; cat; echo \"paged after $key.\"'";
    terminal.send(&format!(
        "{} run {key} -- sh -c \"printf 'first\\nsecond\\n'; sleep 1.5\" | {pager}\n",
        redmutex_path().display()
    ));
    std::thread::sleep(Duration::from_millis(300));
    terminal.send("space\n");
    let paged = terminal.expect("paged after space.", Duration::from_secs(10));
    let shown = terminal.shown();
    clean_up(&key);
    assert!(paged, "{shown}");
    assert!(!shown.contains("Stopped"), "{shown}");
    assert!(shown.contains("second"), "{shown}");
    assert_eq!(held(&server, &key), None);
}

/// ^Z where no shell does job control (`ssh -t host redmutex run …`,
/// `docker run -it`, `kubectl exec -it`: `redmutex` is the session leader
/// of its terminal): the kernel drops the stop for the command, and
/// `redmutex` runs on as flock(1) does; the command finishes. On main the
/// command stayed stopped under a renewed lock until ^C.
#[test]
fn ctrl_z_without_a_job_control_shell_runs_on() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("log");
    let key = format!("no-job-control-{}", std::process::id());
    for leader in ["redmutex", "sh"] {
        let _ = std::fs::remove_file(&log);
        let steps = steps_command(&format!("count:{}:30:50", log.display()));
        let line = format!("{} run {key} -- {steps}", redmutex_path().display());
        let program = if leader == "redmutex" {
            // As `ssh -t host 'exec redmutex run …'`.
            let mut program = Command::new("sh");
            program.args(["-c", &format!("exec {line}")]);
            program
        } else {
            // As `ssh -t host 'redmutex run …; echo done'`.
            let mut program = Command::new("sh");
            program.args(["-c", &format!("{line}; echo \"exited $?.\"")]);
            program
        };
        let mut terminal = Terminal::spawn(&server, program);
        if !wait_until(Duration::from_secs(10), || lines(&log) > 0) {
            clean_up(&key);
            panic!("did not start: {}", terminal.shown());
        }
        terminal.send("\x1a");
        std::thread::sleep(Duration::from_millis(300));
        let at_stop = lines(&log);
        let ran_on = wait_until(Duration::from_secs(10), || lines(&log) >= 30);
        let shown = terminal.shown();
        if !ran_on {
            clean_up(&key);
            panic!("{leader}: the command stopped at {at_stop} lines: {shown}");
        }
        if leader == "sh" {
            assert!(
                terminal.expect("exited 0.", Duration::from_secs(10)),
                "{}",
                terminal.shown()
            );
        }
        assert!(
            wait_until(Duration::from_secs(10), || held(&server, &key).is_none()),
            "{leader}: released"
        );
        let _ = terminal.shell.wait();
    }
}

/// A process the command started outside the job's process group (a new
/// session, as `setsid` makes) a moment before ^Z stops with the job, and
/// runs again on `fg`. On main it was known only from a look at `/proc`
/// made at most once a second, and ran on while the shell showed the job
/// stopped, past the lease.
#[test]
fn ctrl_z_stops_a_process_started_outside_the_group_a_moment_before() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let helper_log = dir.path().join("helper");
    let log = dir.path().join("log");
    let key = format!("ctrlz-helper-{}", std::process::id());
    let mut terminal = Terminal::open(&server);
    let line = format!(
        "{} run --ttl 30s {key} -- {}",
        redmutex_path().display(),
        steps_command(&format!(
            "helper:{}:60:25 count:{}:40:50",
            helper_log.display(),
            log.display()
        ))
    );
    terminal.send(&format!("{line}\n"));
    if !wait_until(Duration::from_secs(10), || lines(&helper_log) > 0) {
        clean_up(&key);
        panic!("did not start: {}", terminal.shown());
    }
    terminal.send("\x1a");
    if !terminal.expect("Stopped", Duration::from_secs(10)) {
        clean_up(&key);
        panic!("not stopped: {}", terminal.shown());
    }
    std::thread::sleep(Duration::from_millis(200));
    let at_stop = lines(&helper_log);
    std::thread::sleep(Duration::from_millis(1000));
    let after = lines(&helper_log);
    let helper = read_pid(&dir.path().join("helper.pid"));
    if after != at_stop {
        clean_up(&key);
        if let Some(pid) = helper {
            // SAFETY: kill(2) of the helper this test started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        panic!("the helper ran on while the job was stopped: {at_stop} then {after}");
    }
    terminal.send("fg\n");
    let code = terminal.exit_code(&key);
    if code != Some(0) {
        clean_up(&key);
        panic!("exit {code:?}: {}", terminal.shown());
    }
    assert_eq!(lines(&log), 40);
    assert!(
        lines(&helper_log) > at_stop,
        "the helper runs again after fg"
    );
}

/// `redmutex` killed (SIGKILL: no handler runs) a moment after the
/// command started a process in a new session: the reaper, the command's
/// parent and the parent of every orphan below it, kills it too. On main
/// only the command's group and the processes a once-a-second look had
/// found were killed.
#[test]
fn a_killed_redmutex_takes_a_helper_started_a_moment_before_with_it() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    for round in 0..3 {
        let helper = dir.path().join(format!("helper-{round}"));
        let key = format!("killed-helper-{}-{round}", std::process::id());
        let mut run = Command::new(redmutex_path())
            .env("REDMUTEX_URL", server.url())
            .args(["run", "--ttl", "30s", &key, "--"])
            .args(steps_args(&format!(
                "helper:{}:100000:20 sleep:60000",
                helper.display()
            )))
            .spawn()
            .expect("run");
        let pid_file = dir.path().join(format!("helper-{round}.pid"));
        if !wait_until(Duration::from_secs(10), || read_pid(&pid_file).is_some()) {
            let _ = run.kill();
            panic!("no helper");
        }
        let pid = read_pid(&pid_file).expect("pid");
        let _ = run.kill();
        let _ = run.wait();
        let gone_in_time = wait_until(Duration::from_secs(5), || gone(pid));
        if !gone_in_time {
            // SAFETY: kill(2) of the helper this test started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        assert!(gone_in_time, "the helper outlived a killed redmutex");
    }
}

/// A terminal whose output is held by ^S (XOFF): every write to it
/// blocks, `redmutex`'s messages too. `--max-run` still ends the command
/// on time and `redmutex` exits (its message waits for ^Q), instead of
/// blocking in the write before it acts, as on main.
#[test]
fn a_terminal_held_by_ctrl_s_does_not_stop_max_run() {
    let server = RedisServer::start();
    let key = format!("ctrl-s-{}", std::process::id());
    let mut terminal = Terminal::open(&server);
    terminal.send("stty ixon\n");
    let line = format!(
        "{} run --max-run 1s --kill-after 1s {key} -- sh -c 'while :; do echo tick; sleep 0.01; done'",
        redmutex_path().display()
    );
    terminal.send(&format!("{line}\n"));
    if !terminal.expect("tick", Duration::from_secs(10)) {
        clean_up(&key);
        panic!("did not start: {}", terminal.shown());
    }
    // Output held: the command blocks in its writes, and so would any
    // message of `redmutex`'s.
    terminal.send("\x13");
    let runner = redmutex_of(&key);
    let ended = wait_until(Duration::from_secs(10), || redmutex_of(&key).is_none());
    terminal.send("\x11");
    if !ended {
        clean_up(&key);
        panic!("redmutex {runner:?} still runs with the terminal held");
    }
    let code = terminal.exit_code(&key);
    assert_eq!(code, Some(124), "{}", terminal.shown());
    assert!(
        terminal.expect("--max-run", Duration::from_secs(5)),
        "the message, once released"
    );
    assert_eq!(held(&server, &key), None);
}

/// A process that left the job (a session of its own) and forks and
/// exits in a loop (a new pid every moment, SIGTERM ignored) is ended all
/// the same when the lease is lost: its process group, every member of
/// which is the command's, is killed at once, and the walks go on until
/// nothing is left. Found by review: each walk found a new pid, and it ran
/// on after `redmutex` exited 75.
#[test]
fn a_process_that_forks_away_from_every_kill_is_ended() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("hop");
    let key = format!("hopper-{}", std::process::id());
    let mut run = Command::new(redmutex_path())
        .env("REDMUTEX_URL", server.url())
        .args(["run", "--ttl", "3s", "--kill-after", "1s", &key, "--"])
        .args(["sh", "-c"])
        .arg(format!(
            "{} & sleep 100",
            steps_command(&format!("hop:{}", file.display()))
        ))
        // Nothing the hopper could hold open for this test's harness.
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("run");
    assert!(wait_until(Duration::from_secs(10), || file.exists()));
    let _: () = server.conn().del(&key).expect("DEL");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = run.try_wait().expect("wait") {
            break status;
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = run.kill();
            panic!("redmutex did not end");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(75));
    // Nothing of its session runs: looked at twice, 300 ms apart (a
    // process in it is alive, not a zombie).
    let session = std::fs::read_to_string(dir.path().join("hop.sid"))
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
        .filter(|g| *g > 1);
    let running = || {
        session.is_some_and(|sid| {
            pids()
                .into_iter()
                .any(|pid| processes::session(pid) == u32::try_from(sid).ok() && !gone(pid))
        })
    };
    let first = running();
    std::thread::sleep(Duration::from_millis(300));
    let second = running();
    if let Some(group) = session {
        // SAFETY: kill(2) of the group of the hopper this test started
        // (its session's one group): nothing of it outlives the test.
        unsafe { libc::kill(-group, libc::SIGKILL) };
    }
    assert!(session.is_some(), "the hopper named its session");
    assert!(
        !first && !second,
        "a process of the hopper's session ran on after the loss"
    );
}
