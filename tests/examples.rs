//! The examples a user can copy (`examples/*.rs`; the measurement harnesses
//! in `examples/measure/` are not among them), run as a user would run
//! them: each against a private redis-server of its own named by
//! `REDMUTEX_URL`, ended within a deadline, with exit code 0 and the lines
//! that say it worked. And what makes them copyable: each names only
//! `redmutex` and std, calls no `unwrap()` or `expect()`, says in its
//! header how to run it, and `examples/README.md` lists it.
//!
//! The binaries are the ones `cargo build --examples` leaves in
//! `<target>/debug/examples/` (`scripts/test.sh` builds them first; `cargo
//! test` alone builds examples only as test harnesses, elsewhere).

use redmutex_test_support as support;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use support::RedisServer;

/// Every example in `examples/` itself, each a case below.
const COPYABLE: [&str; 6] = [
    "cache_rebuild",
    "cron_job",
    "demo",
    "fencing",
    "semaphore",
    "worker",
];

/// Longest any example may run, far above what each takes (a few seconds).
const DEADLINE: Duration = Duration::from_secs(60);

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Where `cargo build --examples` put `name`: beside this test's directory
/// (`<target>/<profile>/deps/`), in `<target>/<profile>/examples/`.
fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test binary lies in <target>/<profile>/deps");
    let binary = profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        binary.is_file(),
        "{} is missing: run `cargo build --all-features --examples` before this test \
         (scripts/test.sh does)",
        binary.display()
    );
    let source = manifest_dir().join("examples").join(format!("{name}.rs"));
    let modified = |path: &Path| {
        std::fs::metadata(path)
            .and_then(|m| m.modified())
            .expect("modification time")
    };
    assert!(
        modified(&binary) >= modified(&source),
        "{} is older than {}: run `cargo build --all-features --examples` again",
        binary.display(),
        source.display()
    );
    binary
}

/// What one run of an example left.
struct Run {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    took: Duration,
}

/// Runs example `name` against a fresh private server, killing it past
/// [`DEADLINE`]; it must succeed.
fn run(name: &str) -> Run {
    let server = RedisServer::start();
    let run = launch(name, Some(&server.url()));
    assert!(
        run.status.success(),
        "example {name} ended with {}\nstdout:\n{}\nstderr:\n{}",
        run.status,
        run.stdout,
        run.stderr
    );
    println!("{name} ran in {:.1?}:\n{}", run.took, run.stdout);
    run
}

/// Runs example `name` with `REDMUTEX_URL` set to `url` (unset for
/// `None`), killing it past [`DEADLINE`].
fn launch(name: &str, url: Option<&str>) -> Run {
    let binary = example_binary(name);
    let dir = support::temp_dir();
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let started = Instant::now();
    let mut command = Command::new(&binary);
    match url {
        Some(url) => command.env("REDMUTEX_URL", url),
        None => command.env_remove("REDMUTEX_URL"),
    };
    let mut child = command
        .stdin(Stdio::null())
        .stdout(File::create(&out).expect("stdout file"))
        .stderr(File::create(&err).expect("stderr file"))
        .spawn()
        .expect("start the example");
    let read = |path: &Path| std::fs::read_to_string(path).unwrap_or_default();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the example") {
            break status;
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "example {name} did not end within {DEADLINE:?}\nstdout:\n{}\nstderr:\n{}",
                read(&out),
                read(&err)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Run {
        status,
        stdout: read(&out),
        stderr: read(&err),
        took: started.elapsed(),
    }
}

/// Without `REDMUTEX_URL` an example refuses to start, naming the
/// variable: it never takes locks on a server nobody chose.
#[test]
fn without_redmutex_url_an_example_refuses_to_start() {
    for name in COPYABLE {
        let run = launch(name, None);
        assert!(!run.status.success(), "{name} ran without REDMUTEX_URL");
        assert!(
            run.stderr.contains("set REDMUTEX_URL"),
            "{name} says what is missing: {}",
            run.stderr
        );
    }
}

/// Asserts that `run`'s output holds each of `lines` (as parts of lines).
fn says(run: &Run, lines: &[&str]) {
    for line in lines {
        assert!(
            run.stdout.contains(line),
            "expected {line:?} in the output:\n{}\nstderr:\n{}",
            run.stdout,
            run.stderr
        );
    }
}

#[test]
fn worker_keeps_its_lease_past_the_ttl_and_stops_on_a_loss() {
    let run = run("worker");
    says(
        &run,
        &[
            "part 1: the job ran",
            "and released it",
            "its unlock(): lock \"examples:worker\" is not held by this owner",
        ],
    );
}

#[test]
fn cron_job_skips_while_another_holds_it_then_runs_fenced() {
    let run = run("cron_job");
    says(
        &run,
        &[
            "skipped: running elsewhere, held by cron_job on ",
            "[machine-b]",
            "ran the job: report written, stamped with fencing token ",
        ],
    );
}

#[test]
fn semaphore_never_lets_more_than_its_permits_work_at_once() {
    let run = run("semaphore");
    says(&run, &["(limit 3)", "permits out now: 0"]);
}

#[test]
fn cache_rebuild_readers_never_see_a_half_built_cache() {
    let run = run("cache_rebuild");
    says(
        &run,
        &[": 0 reads saw a half-built cache", "generation 5, 8 items"],
    );
}

#[test]
fn fencing_refuses_the_paused_holders_write() {
    let run = run("fencing");
    says(&run, &["accepted = true", "accepted = false"]);
}

#[test]
fn demo_tours_the_lock() {
    let run = run("demo");
    says(
        &run,
        &[
            "re-entered on the same thread: depth 2",
            "counter = 800 (expected 800)",
            "3. late unlock: lock \"examples:demo:short\" is not held",
        ],
    );
}

/// The `.rs` files directly in `examples/`, by name.
fn examples_on_disk() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(manifest_dir().join("examples"))
        .expect("examples/")
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            Some(name.strip_suffix(".rs")?.to_owned())
        })
        .collect();
    names.sort();
    names
}

#[test]
fn every_example_in_examples_is_run_here() {
    assert_eq!(
        examples_on_disk(),
        COPYABLE,
        "a file directly in examples/ is copyable and run by this test; \
         measurement harnesses go to examples/measure/"
    );
}

/// The source of example `name`, without its comment lines.
fn code_of(source: &str) -> Vec<&str> {
    source
        .lines()
        .map(str::trim)
        .filter(|line| !line.starts_with("//"))
        .collect()
}

/// The crates and modules a `use` statement names (every identifier in
/// it, which is more than it brings in: enough to tell what a path may
/// start with).
fn names_in_use(statement: &str) -> Vec<&str> {
    statement
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|word| !word.is_empty())
        .collect()
}

/// Lowercase identifiers that start a path (`thread::spawn`,
/// `redis::cmd`): each must be a crate or module the file may name.
fn path_roots(line: &str) -> Vec<&str> {
    let bytes = line.as_bytes();
    let mut roots = Vec::new();
    let mut at = 0;
    while let Some(found) = line[at..].find("::") {
        let end = at + found;
        let start = line[..end]
            .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
            .map_or(0, |i| i + 1);
        let preceded_by_path = start >= 2 && &bytes[start - 2..start] == b"::";
        let word = &line[start..end];
        if !word.is_empty()
            && !preceded_by_path
            && word.starts_with(|c: char| c.is_ascii_lowercase())
        {
            roots.push(word);
        }
        at = end + 2;
    }
    roots
}

#[test]
fn copyable_examples_need_redmutex_and_std_alone() {
    for name in COPYABLE {
        let path = manifest_dir().join("examples").join(format!("{name}.rs"));
        let source = std::fs::read_to_string(&path).expect("the example's source");
        let code = code_of(&source);
        let mut allowed = vec!["std", "core", "alloc", "redmutex", "self", "super", "crate"];
        for line in &code {
            if let Some(statement) = line.strip_prefix("use ") {
                let root = names_in_use(statement).first().copied().unwrap_or("");
                assert!(
                    ["std", "core", "alloc", "redmutex"].contains(&root),
                    "{name}: `{line}` names a crate besides redmutex and std \
                     (redmutex re-exports redis: `use redmutex::redis;`)"
                );
                allowed.extend(names_in_use(statement));
            }
            assert!(!line.starts_with("extern crate"), "{name}: `{line}`");
        }
        for line in &code {
            for root in path_roots(line) {
                assert!(
                    allowed.contains(&root),
                    "{name}: `{line}` names `{root}::`, which is neither std nor redmutex \
                     nor brought in by a `use` of them"
                );
            }
            for forbidden in [".unwrap()", ".expect(", "redmutex_test_support"] {
                assert!(
                    !line.contains(forbidden),
                    "{name}: `{line}`: an example shows errors handled"
                );
            }
        }
    }
}

#[test]
fn copyable_examples_say_how_to_run_them_and_are_listed() {
    let listing = std::fs::read_to_string(manifest_dir().join("examples/README.md"))
        .expect("examples/README.md");
    for name in COPYABLE {
        let path = manifest_dir().join("examples").join(format!("{name}.rs"));
        let source = std::fs::read_to_string(&path).expect("the example's source");
        // The header's words, whatever the line breaks.
        let header: Vec<&str> = source
            .lines()
            .take_while(|line| line.starts_with("//!"))
            .flat_map(|line| line.trim_start_matches("//!").split_whitespace())
            .collect();
        let header = header.join(" ");
        let command = format!("--example {name} ");
        for wanted in [
            "REDMUTEX_URL=redis://",
            command.as_str(),
            "`REDMUTEX_URL` names the Redis server (required: the example takes locks on no server by default)",
            "`redmutex = \"0.1\"`",
        ] {
            assert!(
                header.contains(wanted),
                "{name}'s header comment lacks {wanted:?}"
            );
        }
        assert!(
            listing.contains(&format!("`{name}`")),
            "examples/README.md does not list {name}"
        );
    }
    assert!(
        listing.contains("measure/"),
        "examples/README.md names measure/"
    );
}

#[test]
fn every_measurement_harness_keeps_its_example_name() {
    let manifest = std::fs::read_to_string(manifest_dir().join("Cargo.toml")).expect("Cargo.toml");
    let measure = manifest_dir().join("examples/measure");
    let mut harnesses = 0;
    for entry in std::fs::read_dir(&measure)
        .expect("examples/measure/")
        .flatten()
    {
        let file = entry.file_name().into_string().expect("a UTF-8 name");
        let Some(name) = file.strip_suffix(".rs") else {
            continue;
        };
        let declared =
            format!("[[example]]\nname = \"{name}\"\npath = \"examples/measure/{file}\"\n");
        assert!(
            manifest.contains(&declared),
            "Cargo.toml lacks\n{declared}(so that `cargo run --example {name}` runs it)"
        );
        harnesses += 1;
    }
    assert!(harnesses > 0, "no harness found in {}", measure.display());
}
