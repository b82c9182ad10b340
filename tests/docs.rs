//! The docs say what the code does.
//!
//! * Every link resolves: a link between chapters or to an item
//!   (`crate::guide::failure_model#bounds`) to a heading that exists; a
//!   link to docs.rs to a chapter, heading or public item of this crate, a
//!   link to a source file on docs.rs to a file the package ships; a
//!   relative link (only in files read in the repository) to a file and
//!   heading that exist. rustdoc (`-D warnings` in CI) checks the item
//!   paths themselves; it does not check `#fragments`, which is why this
//!   test exists. Links to other sites are not fetched (CI has no network).
//! * The CLI synopsis of the CLI chapter names the commands, options and
//!   arguments `redmutex --help` does, and every default the chapter
//!   states is the one `--help` shows.
//! * Every "Defaults to …" in the API docs is the value the code has.

use redmutex_test_support as support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use pulldown_cmark::{Event, Parser, Tag, TagEnd};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A heading's anchor as rustdoc makes it (and GitHub, for the ASCII text
/// the docs use): letters, digits, `-` and `_` kept (ASCII lowercased),
/// ASCII whitespace turned into `-`, everything else dropped.
fn slug(text: &str) -> String {
    text.chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '-' || c == '_' {
                Some(c.to_ascii_lowercase())
            } else if c.is_ascii_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

/// The anchors of a Markdown text's headings; a repeated heading gets
/// `-1`, `-2`, … as rustdoc and GitHub give it.
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    let mut heading: Option<String> = None;
    for event in Parser::new(markdown) {
        match event {
            Event::Start(Tag::Heading { .. }) => heading = Some(String::new()),
            Event::Text(t) | Event::Code(t) => {
                if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
            }
            Event::End(TagEnd::Heading(_)) => {
                if let Some(h) = heading.take() {
                    let base = slug(&h);
                    let n = seen.entry(base.clone()).or_insert(0);
                    out.insert(if *n == 0 {
                        base.clone()
                    } else {
                        format!("{base}-{n}")
                    });
                    *n += 1;
                }
            }
            _ => {}
        }
    }
    out
}

/// Every link and image target of a Markdown text.
fn links(markdown: &str) -> Vec<String> {
    Parser::new(markdown)
        .filter_map(|event| match event {
            Event::Start(Tag::Link { dest_url, .. } | Tag::Image { dest_url, .. }) => {
                Some(dest_url.to_string())
            }
            _ => None,
        })
        .collect()
}

/// The doc comments of a Rust file (`//!` and `///`), as Markdown.
fn rustdoc_of(source: &str) -> String {
    source
        .lines()
        .filter_map(|line| {
            let line = line.trim_start();
            line.strip_prefix("//!")
                .or_else(|| line.strip_prefix("///"))
                .map(|rest| rest.strip_prefix(' ').unwrap_or(rest))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn crate_root_docs() -> String {
    let lib = read(&root().join("src/lib.rs"));
    lib.lines()
        .filter_map(|l| l.trim_start().strip_prefix("//!"))
        .map(|rest| rest.strip_prefix(' ').unwrap_or(rest))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The guide's chapters: module name → the file its docs are, read from
/// `src/guide.rs` (`#[doc = include_str!("../docs/X.md")]` then
/// `pub mod Y {}`).
fn chapters() -> BTreeMap<String, PathBuf> {
    let guide = read(&root().join("src/guide.rs"));
    let mut out = BTreeMap::new();
    let mut file: Option<String> = None;
    for line in guide.lines() {
        if let Some(rest) = line.strip_prefix("#[doc = include_str!(\"../") {
            file = rest.strip_suffix("\")]").map(str::to_owned);
        } else if let Some(rest) = line.strip_prefix("pub mod ") {
            let name = rest.trim_end_matches(" {}").trim();
            let file = file
                .take()
                .expect("an include_str! before each chapter module");
            out.insert(name.to_owned(), root().join(file));
        }
    }
    assert!(out.len() >= 6, "src/guide.rs has its chapters: {out:?}");
    out
}

/// Where a document is read: rendered by docs.rs or crates.io, where a
/// relative file link cannot resolve, or only in the repository.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Shown {
    Rendered,
    Repository,
}

struct Checker {
    chapters: BTreeMap<String, PathBuf>,
    anchors: BTreeMap<PathBuf, BTreeSet<String>>,
    api: String,
    shipped_excludes: Vec<String>,
    tracked: BTreeSet<String>,
    names: BTreeMap<String, BTreeSet<String>>,
}

impl Checker {
    fn new() -> Checker {
        let manifest = read(&root().join("Cargo.toml"));
        // `exclude = [".ci/"]`: what the package leaves out.
        let shipped_excludes = manifest
            .lines()
            .find_map(|l| l.strip_prefix("exclude = ["))
            .map(|list| {
                list.trim_end_matches(']')
                    .split(',')
                    .map(|s| s.trim().trim_matches('"').to_owned())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default();
        Checker {
            chapters: chapters(),
            anchors: BTreeMap::new(),
            api: read(&root().join("public-api.txt")),
            shipped_excludes,
            tracked: tracked_files(),
            names: api_names(),
        }
    }

    fn anchors_of(&mut self, path: &Path) -> BTreeSet<String> {
        if let Some(a) = self.anchors.get(path) {
            return a.clone();
        }
        let text = if path.extension().is_some_and(|e| e == "rs") {
            if path.ends_with("src/lib.rs") {
                crate_root_docs()
            } else {
                rustdoc_of(&read(path))
            }
        } else {
            read(path)
        };
        let a = anchors(&text);
        self.anchors.insert(path.to_owned(), a.clone());
        a
    }

    fn fragment(&mut self, target: &Path, fragment: &str) -> Result<(), String> {
        if fragment.is_empty() || self.anchors_of(target).contains(fragment) {
            Ok(())
        } else {
            Err(format!(
                "no heading with the anchor #{fragment} in {}",
                target.strip_prefix(root()).unwrap_or(target).display()
            ))
        }
    }

    /// A path into the crate's docs (`crate`, `crate::guide::cli`,
    /// `crate::DistributedLock`), with an optional fragment.
    fn crate_path(&mut self, path: &str, fragment: &str) -> Result<(), String> {
        if path == "crate" {
            return self.fragment(&root().join("src/lib.rs"), fragment);
        }
        if path == "crate::guide" {
            return self.fragment(&root().join("src/guide.rs"), fragment);
        }
        if let Some(chapter) = path.strip_prefix("crate::guide::") {
            let file = self
                .chapters
                .get(chapter)
                .cloned()
                .ok_or_else(|| format!("no chapter {chapter} in src/guide.rs"))?;
            return self.fragment(&file, fragment);
        }
        // The item is rustdoc's to check; its fragment (`#method.lock`) is
        // not, so it is checked here.
        match path.strip_prefix("crate::") {
            Some(item) if !item.contains("::") => item_fragment(&self.names, item, fragment),
            _ => Ok(()),
        }
    }

    fn docs_rs(&mut self, rest: &str, fragment: &str) -> Result<(), String> {
        // https://docs.rs/redmutex/latest/redmutex/<rest>
        let rest = rest.trim_end_matches("index.html").trim_end_matches('/');
        if rest.is_empty() {
            return self.crate_path("crate", fragment);
        }
        if rest == "guide" {
            return self.crate_path("crate::guide", fragment);
        }
        if let Some(chapter) = rest.strip_prefix("guide/") {
            return self.crate_path(&format!("crate::guide::{chapter}"), fragment);
        }
        // An item page: `struct.LockClient.html`, `enum.Error.html`, ...
        let (kind, name) = rest
            .strip_suffix(".html")
            .and_then(|page| page.split_once('.'))
            .ok_or_else(|| format!("not a page of this crate's docs: {rest}"))?;
        let kind = match kind {
            "constant" => "const",
            "trait" | "struct" | "enum" | "fn" | "type" => kind,
            _ => return Err(format!("not a page of this crate's docs: {rest}")),
        };
        let listed = format!("pub {kind} redmutex::{name}");
        if self.api.lines().any(|l| {
            l == listed
                || l.starts_with(&format!("{listed}<"))
                || l.starts_with(&format!("{listed}:"))
                || l.starts_with(&format!("{listed} "))
        }) {
            item_fragment(&self.names, name, fragment)
        } else {
            Err(format!("public-api.txt has no `{listed}`"))
        }
    }

    fn check(&mut self, from: &Path, shown: Shown, dest: &str) -> Result<(), String> {
        let (target, fragment) = dest.split_once('#').unwrap_or((dest, ""));
        // https://docs.rs/redmutex[/VERSION[/redmutex[/PAGE]]], any version.
        if let Some(rest) = target.strip_prefix("https://docs.rs/redmutex") {
            let rest = rest.trim_start_matches('/');
            let page = match rest.split_once('/') {
                None => "",
                Some((_version, after)) => match after.strip_prefix("redmutex") {
                    Some(page) => page.trim_start_matches('/'),
                    None => return Err(format!("not a page of this crate's docs: {target}")),
                },
            };
            return self.docs_rs(page, fragment);
        }
        if let Some(rest) = target.strip_prefix("https://docs.rs/crate/redmutex/") {
            let path = rest
                .split_once("/source/")
                .map(|(_, path)| path)
                .ok_or_else(|| format!("not a source address: {target}"))?;
            if self
                .shipped_excludes
                .iter()
                .any(|x| path.starts_with(x.as_str()))
            {
                return Err(format!("{path} is excluded from the package (Cargo.toml)"));
            }
            return if self.tracked.contains(path) {
                Ok(())
            } else {
                Err(format!("no file {path} under version control"))
            };
        }
        if target.starts_with("http://") {
            return Err("a plain-http link: use https".into());
        }
        if target.starts_with("https://") || target.starts_with("mailto:") {
            // Another site: not fetched here.
            return Ok(());
        }
        if target.is_empty() {
            // `#fragment` within the same page.
            return self.fragment(from, fragment);
        }
        if is_rust_path(target) {
            if shown == Shown::Repository {
                return Err(format!(
                    "{target} is an intra-doc link, which only rustdoc resolves: dead where this file is read"
                ));
            }
            if target == "crate" || target.starts_with("crate::") {
                return self.crate_path(target, fragment);
            }
            // Other intra-doc paths (`Self::…`, `Lease::unlock`) are rustdoc's.
            return Ok(());
        }
        if shown == Shown::Rendered {
            return Err(format!(
                "a relative link to {target} does not resolve on docs.rs or crates.io: \
                 link a chapter with crate::guide::…, or a file with its docs.rs source address"
            ));
        }
        let file = from.parent().unwrap_or(&root()).join(target);
        if !file.exists() {
            return Err(format!("no file {target}"));
        }
        if file.extension().is_some_and(|e| e == "md") {
            return self.fragment(&file, fragment);
        }
        Ok(())
    }
}

/// `crate`, `crate::guide::cli`, `Lease::unlock`, `Self::x`, `Error`:
/// what rustdoc reads as an intra-doc link. A file name has a `.`, a `/`
/// or a `-` (`LICENSE-MIT`).
fn is_rust_path(target: &str) -> bool {
    let target = target.trim_end_matches("()").trim_end_matches('!');
    !target.is_empty()
        && target.split("::").all(|part| {
            part.chars()
                .next()
                .is_some_and(|c| c.is_alphabetic() || c == '_')
                && part.chars().all(|c| c.is_alphanumeric() || c == '_')
        })
}

/// A fragment of an item's page, `method.lock`, `variant.Timeout`,
/// `structfield.ttl`: a member the item has in `public-api.txt`.
fn item_fragment(
    names: &BTreeMap<String, BTreeSet<String>>,
    item: &str,
    fragment: &str,
) -> Result<(), String> {
    if fragment.is_empty() {
        return Ok(());
    }
    let Some((_, member)) = fragment.split_once('.') else {
        // A heading of the item's own docs.
        return Ok(());
    };
    match names.get(item) {
        Some(known) if known.contains(member) => Ok(()),
        _ => Err(format!("{item} has no {member} for #{fragment}")),
    }
}

/// The files under version control: what the package can ship.
fn tracked_files() -> BTreeSet<String> {
    let out = std::process::Command::new("git")
        .args(["ls-files"])
        .current_dir(root())
        .output()
        .expect("git ls-files");
    assert!(out.status.success(), "git ls-files: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Every document a reader meets, and where they meet it.
fn documents() -> Vec<(PathBuf, Shown, String)> {
    let root = root();
    let mut out = Vec::new();
    for name in [
        "ARCHITECTURE.md",
        "CONTRIBUTING.md",
        "SECURITY.md",
        "CHANGELOG.md",
        "examples/README.md",
    ] {
        let path = root.join(name);
        if path.exists() {
            out.push((path.clone(), Shown::Repository, read(&path)));
        }
    }
    let readme = root.join("README.md");
    out.push((readme.clone(), Shown::Rendered, read(&readme)));
    for path in chapters().into_values() {
        let text = read(&path);
        out.push((path, Shown::Rendered, text));
    }
    for path in files_under("src", None).into_iter().filter(|p| is_rust(p)) {
        let text = rustdoc_of(&read(&path));
        out.push((path, Shown::Rendered, text));
    }
    out
}

/// Every file under `dir` (relative to the repository), `skip` and what
/// is under it left out.
fn files_under(dir: &str, skip: Option<&str>) -> Vec<PathBuf> {
    let skip = skip.map(|s| root().join(s));
    let mut out = Vec::new();
    let mut dirs = vec![root().join(dir)];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("an entry").path();
            if skip.as_ref().is_some_and(|s| path == *s) {
                continue;
            }
            if path.is_dir() {
                dirs.push(path);
            } else {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

fn is_rust(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "rs")
}

#[test]
fn every_link_resolves() {
    let mut checker = Checker::new();
    let mut broken = Vec::new();
    let mut count = 0;
    for (path, shown, text) in documents() {
        for dest in links(&text) {
            count += 1;
            if let Err(why) = checker.check(&path, shown, &dest) {
                broken.push(format!(
                    "{}: ({dest}) {why}",
                    path.strip_prefix(root()).unwrap_or(&path).display()
                ));
            }
        }
    }
    assert!(count > 100, "the docs have their links ({count} found)");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_link_checker_finds_what_it_must() {
    let mut checker = Checker::new();
    let here = root().join("docs/using.md");
    let ok = |c: &mut Checker, dest: &str, shown| c.check(&here, shown, dest);
    assert!(
        ok(
            &mut checker,
            "crate::guide::failure_model#bounds",
            Shown::Rendered
        )
        .is_ok()
    );
    assert!(
        ok(
            &mut checker,
            "crate::guide::failure_model#no-such-heading",
            Shown::Rendered
        )
        .is_err()
    );
    assert!(ok(&mut checker, "crate::guide::nowhere", Shown::Rendered).is_err());
    assert!(
        ok(
            &mut checker,
            "crate#capabilities-by-lock-type",
            Shown::Rendered
        )
        .is_ok()
    );
    assert!(ok(&mut checker, "crate#no-such-heading", Shown::Rendered).is_err());
    assert!(ok(&mut checker, "failure-model.md", Shown::Rendered).is_err());
    assert!(ok(&mut checker, "failure-model.md#bounds", Shown::Repository).is_ok());
    assert!(ok(&mut checker, "failure-model.md#nowhere", Shown::Repository).is_err());
    assert!(ok(&mut checker, "../lua/nowhere.lua", Shown::Repository).is_err());
    assert!(
        ok(
            &mut checker,
            "https://docs.rs/redmutex/latest/redmutex/guide/cli/index.html#under-a-service-manager",
            Shown::Rendered
        )
        .is_ok()
    );
    assert!(
        ok(
            &mut checker,
            "https://docs.rs/redmutex/latest/redmutex/guide/cli/index.html#nowhere",
            Shown::Rendered
        )
        .is_err()
    );
    assert!(
        ok(
            &mut checker,
            "https://docs.rs/redmutex/latest/redmutex/struct.DistributedLock.html",
            Shown::Rendered
        )
        .is_ok()
    );
    assert!(
        ok(
            &mut checker,
            "https://docs.rs/redmutex/latest/redmutex/struct.Nothing.html",
            Shown::Rendered
        )
        .is_err()
    );
    assert!(
        ok(
            &mut checker,
            "https://docs.rs/crate/redmutex/latest/source/lua/release.lua",
            Shown::Rendered
        )
        .is_ok()
    );
    assert!(
        ok(
            &mut checker,
            "https://docs.rs/crate/redmutex/latest/source/.ci/run",
            Shown::Rendered
        )
        .is_err()
    );
    assert!(ok(&mut checker, "http://example.com/", Shown::Rendered).is_err());
    assert!(
        ok(
            &mut checker,
            "crate::LockClient#method.open",
            Shown::Rendered
        )
        .is_ok()
    );
    assert!(
        ok(
            &mut checker,
            "crate::LockClient#method.nope",
            Shown::Rendered
        )
        .is_err()
    );
    assert!(
        ok(
            &mut checker,
            "https://docs.rs/redmutex/latest/redmutex/struct.LockClient.html#method.nope",
            Shown::Rendered
        )
        .is_err()
    );
    assert!(ok(&mut checker, "https://docs.rs/redmutex/", Shown::Rendered).is_ok());
    assert!(
        ok(
            &mut checker,
            "https://docs.rs/redmutex/0.1.0/redmutex/guide/cli/index.html#nowhere",
            Shown::Rendered
        )
        .is_err()
    );
    assert!(ok(&mut checker, "crate::Lease", Shown::Repository).is_err());
    assert!(ok(&mut checker, "LICENSE-NOPE", Shown::Repository).is_err());
    assert!(ok(&mut checker, "LICENSE-NOPE", Shown::Rendered).is_err());
    assert!(
        ok(
            &mut checker,
            "https://docs.rs/crate/redmutex/latest/source/target/debug/redmutex",
            Shown::Rendered
        )
        .is_err()
    );
    assert_eq!(
        slug("Waiting: notify (default) or spin"),
        "waiting-notify-default-or-spin"
    );
    assert_eq!(slug("The `redmutex` command"), "the-redmutex-command");
    assert_eq!(
        anchors("# A\n## A\n## B c"),
        ["a", "a-1", "b-c"].into_iter().map(String::from).collect()
    );
}

// ---- The CLI chapter against `redmutex --help` ---------------------------

#[cfg(feature = "cli")]
mod cli {
    use super::*;
    use assert_cmd::cargo::CommandCargoExt;
    use std::process::Command;

    fn help(args: &[&str]) -> String {
        let out = Command::cargo_bin("redmutex")
            .expect("the redmutex binary")
            .args(args)
            .arg("--help")
            .env_remove("REDMUTEX_URL")
            .output()
            .expect("redmutex --help");
        assert!(out.status.success(), "redmutex {args:?} --help: {out:?}");
        String::from_utf8(out.stdout).expect("UTF-8 help")
    }

    /// The lines of a help section (`Options:`, `Commands:`, `Arguments:`).
    fn section<'a>(help: &'a str, name: &str) -> Vec<&'a str> {
        help.lines()
            .skip_while(|l| *l != name)
            .skip(1)
            .take_while(|l| l.starts_with(' ') || l.is_empty())
            .filter(|l| !l.is_empty())
            .collect()
    }

    /// Each option's long name and its default, when it has one.
    fn options(help: &str) -> BTreeMap<String, Option<String>> {
        let lines = section(help, "Options:");
        let mut out = BTreeMap::new();
        for (i, line) in lines.iter().enumerate() {
            let trimmed = line.trim_start();
            if !trimmed.starts_with('-') {
                continue;
            }
            let Some(long) = trimmed
                .split([' ', ','])
                .find(|w| w.starts_with("--"))
                .map(str::to_owned)
            else {
                continue;
            };
            // The description: on this line, or the next (long help).
            let description = format!("{trimmed} {}", lines.get(i + 1).copied().unwrap_or(""));
            let default = description
                .split("[default: ")
                .nth(1)
                .and_then(|d| d.split(']').next())
                .map(str::to_owned);
            out.insert(long, default);
        }
        out
    }

    fn long_options(text: &str) -> BTreeSet<String> {
        text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
            .filter(|w| w.starts_with("--") && w.len() > 2)
            .map(str::to_owned)
            .collect()
    }

    fn chapter() -> String {
        read(&root().join("docs/cli.md"))
    }

    /// The chapter's synopsis: the first `text` block.
    fn synopsis() -> String {
        let chapter = chapter();
        let start = chapter.find("```text\n").expect("a synopsis block") + "```text\n".len();
        let end = chapter[start..].find("```").expect("its end") + start;
        chapter[start..end].to_owned()
    }

    const HELP_ONLY: [&str; 2] = ["--help", "--version"];

    #[test]
    fn the_synopsis_is_what_redmutex_help_says() {
        let top = help(&[]);
        let global: BTreeSet<String> = options(&top)
            .into_keys()
            .filter(|o| !HELP_ONLY.contains(&o.as_str()))
            .collect();
        let commands: BTreeSet<String> = section(&top, "Commands:")
            .iter()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|c| *c != "help")
            .map(str::to_owned)
            .collect();
        assert!(commands.len() >= 5, "{commands:?}");

        let synopsis = synopsis();
        // The lines before the first command are the global options; a
        // command's own start with two spaces and its name, and go on with
        // deeper-indented lines.
        let mut own: BTreeMap<String, String> = BTreeMap::new();
        let mut head = String::new();
        let mut current: Option<String> = None;
        for line in synopsis.lines() {
            let word = line.split_whitespace().next().unwrap_or("");
            if line.starts_with("  ") && !line.starts_with("   ") && commands.contains(word) {
                current = Some(word.to_owned());
                own.insert(word.to_owned(), line.to_owned());
            } else if let Some(c) = current.as_ref().filter(|_| line.starts_with("    ")) {
                let entry = own.entry(c.clone()).or_default();
                entry.push(' ');
                entry.push_str(line);
            } else {
                current = None;
                head.push_str(line);
                head.push('\n');
            }
        }
        let listed: BTreeSet<String> = own.keys().cloned().collect();
        assert_eq!(
            listed, commands,
            "the synopsis lists every command redmutex has, and no other"
        );
        assert_eq!(
            long_options(&head),
            global,
            "the synopsis's global options are redmutex --help's"
        );
        for command in &commands {
            let sub = help(&[command]);
            let mine: BTreeSet<String> = options(&sub)
                .into_keys()
                .filter(|o| !HELP_ONLY.contains(&o.as_str()) && !global.contains(o))
                .collect();
            let line = &own[command];
            assert_eq!(
                long_options(line),
                mine,
                "the synopsis of `{command}` has the options of `redmutex {command} --help`"
            );
            // The arguments of its usage line (`[KEY]`, `<CMD>...`).
            let usage = sub
                .lines()
                .find(|l| l.starts_with("Usage:"))
                .expect("a usage line");
            for word in usage.split_whitespace().skip(3) {
                let name = word.trim_matches(|c| "[]<>.".contains(c));
                if name.is_empty() || name == "OPTIONS" || name == "--" {
                    continue;
                }
                assert!(
                    line.split(|c: char| !c.is_ascii_alphanumeric())
                        .any(|w| w == name),
                    "the synopsis of `{command}` names its argument {name}: {line}"
                );
            }
        }
    }

    /// Every long option the CLI chapter, the README and `contrib/` give
    /// `redmutex` is one it has (a renamed option leaves no old name), and
    /// every `REDMUTEX_…` variable they name is one the code reads or sets.
    #[test]
    fn every_option_and_variable_the_docs_name_exists() {
        let top = help(&[]);
        let mut known: BTreeSet<String> = options(&top).into_keys().collect();
        for line in section(&top, "Commands:") {
            if let Some(command) = line.split_whitespace().next().filter(|c| *c != "help") {
                known.extend(options(&help(&[command])).into_keys());
            }
        }
        // Other programs' options, in the same files.
        const OTHERS: &[&str] = &[
            "--path",
            "--features",
            "--release",
            "--example",
            "--install",
            "--save",
            "--port",
            "--appendonly",
            "--cluster-enabled",
            "--replicaof",
            "--tls-port",
            "--tls-cert-file",
            "--tls-key-file",
            "--tls-ca-cert-file",
            "--tls-auth-clients",
            "--user-unit",
            "--now",
            "--no-block",
            "--dir",
            "--unixsocket",
            "--full",
            "--open",
            "--init",
        ];
        let mut files = vec![root().join("docs/cli.md"), root().join("README.md")];
        files.extend(files_under("contrib", None));
        let sources: String = files_under("src", None)
            .iter()
            .filter(|p| is_rust(p))
            .map(|p| read(p))
            .collect();
        let mut unknown = BTreeSet::new();
        for path in &files {
            let text = read(path);
            for option in long_options(&text) {
                let option = option.trim_end_matches('-').to_owned();
                if option.len() > 2
                    && !known.contains(&option)
                    && !OTHERS.contains(&option.as_str())
                {
                    unknown.insert(format!("{}: {option}", path.display()));
                }
            }
            for (at, _) in text.match_indices("REDMUTEX_") {
                let name: String = text[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                let name = name.trim_end_matches('_');
                if !sources.contains(&format!("\"{name}\"")) {
                    unknown.insert(format!("{}: ${name}", path.display()));
                }
            }
        }
        assert!(
            unknown.is_empty(),
            "named in the docs, unknown to redmutex:\n{}",
            unknown.iter().cloned().collect::<Vec<_>>().join("\n")
        );
        // The server a URL-less call reaches, as the chapter says it.
        let url = options(&top)
            .get("--url")
            .cloned()
            .flatten()
            .expect("--url has a default");
        assert!(
            chapter().contains(&format!("`{url}`")),
            "the CLI chapter names --url's default, {url}"
        );
    }

    /// What the chapter says a default is, after each "default `X`", is
    /// what `--help` says for the option (or argument) it is about: the
    /// last one named before it in the same sentence.
    #[test]
    fn every_default_the_chapter_states_is_the_one_redmutex_has() {
        let mut defaults: BTreeMap<String, String> = BTreeMap::new();
        let top = help(&[]);
        let commands: Vec<String> = section(&top, "Commands:")
            .iter()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|c| *c != "help")
            .map(str::to_owned)
            .collect();
        for command in std::iter::once(None).chain(commands.iter().map(Some)) {
            let text = match command {
                Some(c) => help(&[c.as_str()]),
                None => top.clone(),
            };
            for (option, default) in options(&text) {
                if let Some(d) = default {
                    defaults.insert(option, d);
                }
            }
            for line in section(&text, "Arguments:") {
                let name = line.split_whitespace().next().unwrap_or("");
                let name = name.trim_matches(|c| "[]<>.".contains(c));
                if let Some(d) = line
                    .split("[default: ")
                    .nth(1)
                    .and_then(|d| d.split(']').next())
                {
                    defaults.insert(name.to_owned(), d.to_owned());
                }
            }
        }
        assert!(defaults.len() >= 5, "{defaults:?}");
        let chapter = chapter().replace('\n', " ");
        let mut checked = 0;
        let mut rest = chapter.as_str();
        while let Some(at) = rest.find("default `") {
            let before = &rest[..at];
            let stated = rest[at + "default `".len()..]
                .split('`')
                .next()
                .unwrap_or("");
            let sentence = before.rsplit(['.', ';', ':']).next().unwrap_or(before);
            // Not a default of ours (systemd's `KillMode`).
            if !sentence.trim_end().ends_with("systemd's") {
                let subject = sentence
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                    .rfind(|w| {
                        (w.starts_with("--") && defaults.contains_key(*w))
                            || (w.len() > 2 && w.chars().all(|c| c.is_ascii_uppercase()) && defaults.contains_key(*w))
                    })
                    .unwrap_or_else(|| panic!("a default with no option named before it: …{sentence}default `{stated}`"));
                assert_eq!(
                    defaults[subject], stated,
                    "the CLI chapter says {subject} defaults to `{stated}`; redmutex --help says `{}`",
                    defaults[subject]
                );
                checked += 1;
            }
            rest = &rest[at + 1..];
        }
        assert!(
            checked >= 4,
            "the chapter's defaults were found ({checked})"
        );
    }
}

// ---- "Defaults to …" in the API docs -------------------------------------

/// Each item whose API docs say "Defaults to …": the file, the item's
/// name, and what the code has, as the values the sentence must state.
fn stated_defaults(client: &redmutex::LockClient) -> Vec<(&'static str, &'static str, Vec<Value>)> {
    use Value::*;
    use redmutex::{
        Backoff, DEFAULT_POOL_SIZE, DEFAULT_TIMEOUT, HandoffBudget, LockOptions, RedLockOptions,
        ReentrantOptions, RwLockOptions, SemaphoreOptions,
    };
    let lock = LockOptions::default();
    let sem = SemaphoreOptions::default();
    let re = ReentrantOptions::default();
    let rw = RwLockOptions::default();
    let red = RedLockOptions::default();
    let multi = redmutex::MultiLockOptions::default();
    let fair = redmutex::FairLockOptions::default();
    let budget = HandoffBudget::default();
    let backoff = Backoff::default();
    let o = "src/client/options.rs";
    let b = "src/client/builder.rs";
    let c = "src/client/mod.rs";
    vec![
        (o, "ttl", vec![Time(lock.ttl)]),
        (o, "wait", vec![Time(lock.wait)]),
        (
            o,
            "backoff",
            vec![
                Text("Backoff::default".into()),
                Time(backoff.initial()),
                Time(backoff.max()),
            ],
        ),
        (
            o,
            "wait_mode",
            vec![Text(format!("WaitMode::{:?}", lock.wait_mode))],
        ),
        (o, "watchdog", vec![Flag(lock.watchdog)]),
        (o, "max_hold", vec![Text(format!("{:?}", lock.max_hold))]),
        (o, "key_class", vec![Text(format!("{:?}", lock.key_class))]),
        (
            o,
            "release",
            vec![Text(format!("Release::{:?}", lock.extra.release))],
        ),
        (
            o,
            "local_handoff",
            vec![
                Flag(lock.extra.local_handoff),
                Flag(sem.extra.local_handoff),
            ],
        ),
        (
            o,
            "handoff_budget",
            vec![Text(same(
                lock.extra.handoff_budget == budget && sem.extra.handoff_budget == budget,
                "HandoffBudget::default",
            ))],
        ),
        (
            o,
            "fencing",
            vec![
                Flag(lock.extra.fencing),
                Flag(sem.extra.fencing),
                Flag(re.extra.fencing),
                Flag(rw.extra.fencing),
                Flag(multi.extra.fencing),
                Flag(fair.extra.fencing),
            ],
        ),
        (
            o,
            "min_replicas",
            vec![
                Text(format!("{:?}", lock.extra.min_replicas)),
                Text(format!("{:?}", sem.extra.min_replicas)),
                Text(format!("{:?}", re.extra.min_replicas)),
                Text(format!("{:?}", rw.extra.min_replicas)),
            ],
        ),
        (o, "prefer_readers", vec![Flag(rw.extra.prefer_readers)]),
        (o, "entry_ttl", vec![Time(fair.extra.entry_ttl)]),
        (
            o,
            "node_timeout",
            vec![Text(format!("{:?}", red.extra.node_timeout))],
        ),
        (o, "max_age", vec![Time(budget.max_age())]),
        (
            o,
            "max_handoffs",
            vec![Count(u64::from(budget.max_handoffs()))],
        ),
        (o, "max_time", vec![Time(budget.max_time())]),
        (
            "src/wait/backoff.rs",
            "initial",
            vec![Time(backoff.initial())],
        ),
        ("src/wait/backoff.rs", "max", vec![Time(backoff.max())]),
        (
            "src/wait/backoff.rs",
            "factor",
            vec![Count(u64::from(backoff.factor()))],
        ),
        (
            b,
            "timeout",
            vec![
                Text("DEFAULT_TIMEOUT".into()),
                Time(DEFAULT_TIMEOUT),
                Time(client.timeout()),
            ],
        ),
        (
            b,
            "pool_size",
            vec![
                Text("DEFAULT_POOL_SIZE".into()),
                Count(u64::from(DEFAULT_POOL_SIZE)),
            ],
        ),
        (
            b,
            "defaults",
            vec![Text(same(
                *client.defaults() == LockOptions::default(),
                "LockOptions::default",
            ))],
        ),
        (
            c,
            "with_defaults",
            vec![Text(same(
                *client.defaults() == LockOptions::default(),
                "LockOptions::default",
            ))],
        ),
        (
            b,
            "key_prefix",
            vec![Text(format!("{:?}", client.key_prefix()))],
        ),
        // Checked against a server below (`builder_defaults_are_what_a_client_does`).
        (b, "notify", vec![Flag(true)]),
        (b, "holder_metadata", vec![Flag(true)]),
        (c, "with_holder_metadata", vec![Text("on".into())]),
        (b, "program", vec![Text("argv[0]".into())]),
        (b, "label", vec![Text("none".into())]),
        (c, "with_label", vec![Text("none".into())]),
        (b, "username", vec![Text("default".into())]),
        (b, "password", vec![Text("none".into())]),
        (b, "tls_ca_pem", vec![Text("the system's roots".into())]),
        (b, "tls_client_cert_pem", vec![Text("none".into())]),
        (b, "sentinel_primary", {
            let primary = redis::RedisConnectionInfo::default();
            let login = primary.username().is_none() && primary.password().is_none();
            vec![
                Text(if login { "no login" } else { "a login" }.into()),
                Text(format!("database {}", primary.db())),
            ]
        }),
    ]
}

/// `name` when the code's value is the one `name` gives; otherwise a
/// text no sentence contains.
fn same(is: bool, name: &str) -> String {
    if is {
        name.to_owned()
    } else {
        format!("(not {name})")
    }
}

#[derive(Debug)]
enum Value {
    Time(Duration),
    Count(u64),
    Flag(bool),
    Text(String),
}

impl Value {
    /// How the docs write it.
    fn written(&self) -> String {
        match self {
            Value::Time(d) => {
                let ms = d.as_millis();
                if ms >= 1000 && ms % 1000 == 0 {
                    format!("{} s", ms / 1000)
                } else {
                    format!("{ms} ms")
                }
            }
            Value::Count(n) => n.to_string(),
            Value::Flag(b) => format!("`{b}`"),
            Value::Text(t) => t.clone(),
        }
    }
}

/// Whether `sentence` states `value`: a number not part of a longer one
/// ("1 ms" is not in "11 ms"), and of `true`/`false` the one said first.
fn mentions(sentence: &str, value: &Value) -> bool {
    let written = value.written();
    match value {
        Value::Flag(_) => {
            let first = ["`true`", "`false`"]
                .into_iter()
                .filter_map(|f| sentence.find(f).map(|at| (at, f)))
                .min();
            first.is_some_and(|(_, f)| f == written)
        }
        Value::Time(_) | Value::Count(_) => sentence.match_indices(&written).any(|(at, _)| {
            let before = sentence[..at].chars().next_back();
            let after = sentence[at + written.len()..].chars().next();
            !before.is_some_and(|c| c.is_ascii_digit() || c == '.')
                && !after.is_some_and(|c| c.is_ascii_alphanumeric())
        }),
        Value::Text(_) => sentence.contains(&written),
    }
}

/// Every "Defaults to …" sentence of the crate's API docs, with the name
/// of the item it documents: `(file, item, sentence)`.
fn defaults_in_docs() -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for path in files_under("src", Some("src/bin"))
        .into_iter()
        .filter(|p| is_rust(p))
    {
        let file = path
            .strip_prefix(root())
            .unwrap_or(&path)
            .display()
            .to_string();
        let lines: Vec<String> = read(&path).lines().map(str::to_owned).collect();
        let mut i = 0;
        while i < lines.len() {
            if !lines[i].trim_start().starts_with("///") {
                i += 1;
                continue;
            }
            let mut block = String::new();
            while i < lines.len() && lines[i].trim_start().starts_with("///") {
                block.push(' ');
                block.push_str(lines[i].trim_start().trim_start_matches("///").trim());
                i += 1;
            }
            // The item: the next line that is not an attribute.
            let item_line = lines[i..]
                .iter()
                .find(|l| !l.trim_start().starts_with("#["))
                .map(|l| l.trim().to_owned())
                .unwrap_or_default();
            let item = item_name(&item_line);
            let mut rest = block.as_str();
            while let Some(at) = rest.find("Defaults to ") {
                let tail = &rest[at + "Defaults to ".len()..];
                let end = tail.find(". ").map(|e| e + 1).unwrap_or(tail.len());
                out.push((file.clone(), item.clone(), tail[..end].to_owned()));
                rest = &tail[end..];
            }
        }
    }
    out
}

/// Defaults are stated once, in the API docs; the chapters, the README
/// and the other documents link there (the CLI chapter states the tool's,
/// checked above against `--help`). Caught: "defaults to …", and "default"
/// followed by a number ("default 16", "(default: 2 s)", "default `10s`").
#[test]
fn the_chapters_leave_defaults_to_the_api_docs() {
    let mut restated = Vec::new();
    let mut files: Vec<PathBuf> = chapters()
        .into_iter()
        .filter(|(name, _)| name != "cli")
        .map(|(_, path)| path)
        .collect();
    for name in [
        "README.md",
        "ARCHITECTURE.md",
        "CONTRIBUTING.md",
        "SECURITY.md",
        "CHANGELOG.md",
        "examples/README.md",
    ] {
        files.push(root().join(name));
    }
    for path in files.iter().filter(|p| p.exists()) {
        for (n, line) in read(path).lines().enumerate() {
            if states_a_default(line) {
                restated.push(format!("{}:{}: {line}", path.display(), n + 1));
            }
        }
    }
    assert!(
        restated.is_empty(),
        "a default restated outside the API docs:\n{}",
        restated.join("\n")
    );
}

/// "defaults to", or "default" then (after `s`, `to`, `is`, `:`, `,`,
/// spaces and backquotes) a digit.
fn states_a_default(line: &str) -> bool {
    let lower = line.to_lowercase();
    // Quoted, it names the phrase: `"Defaults to …"`.
    if lower
        .match_indices("defaults to")
        .any(|(at, _)| !lower[..at].ends_with('"'))
    {
        return true;
    }
    lower.match_indices("default").any(|(at, _)| {
        let rest = lower[at + "default".len()..].trim_start_matches('s');
        let rest = rest.trim_start_matches([' ', ':', ',', '`', '(']);
        let rest = rest
            .strip_prefix("to ")
            .or_else(|| rest.strip_prefix("is "))
            .unwrap_or(rest)
            .trim_start_matches([' ', '`']);
        rest.starts_with(|c: char| c.is_ascii_digit())
    })
}

#[test]
fn a_restated_default_is_recognised() {
    assert!(states_a_default(".pool_size(8) // default 16"));
    assert!(states_a_default("the timeout (default: 2 s)"));
    assert!(states_a_default("waits `--wait`, default `10s`"));
    assert!(states_a_default("It defaults to none."));
    assert!(!states_a_default("notify (the default) wakes waiters"));
    assert!(!states_a_default("with the default options, 3 runs"));
}

/// `pub fn timeout(mut self, …)` → `timeout`; `pub ttl: Duration,` → `ttl`.
fn item_name(line: &str) -> String {
    let line = line
        .trim_start_matches("pub(crate) ")
        .trim_start_matches("pub ");
    let line = line
        .strip_prefix("const fn ")
        .or_else(|| line.strip_prefix("fn "))
        .unwrap_or(line);
    line.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .next()
        .unwrap_or("")
        .to_owned()
}

#[test]
fn every_stated_default_is_the_codes() {
    // Built, never connected: the settings are read back, nothing sent.
    let client = redmutex::LockClient::builder()
        .url("redis://127.0.0.1:1/")
        .build()
        .expect("a client");
    let table = stated_defaults(&client);
    let found = defaults_in_docs();
    assert!(
        found.len() >= 30,
        "the API docs' defaults were found: {found:#?}"
    );
    let mut wrong = Vec::new();
    let mut used = BTreeSet::new();
    for (file, item, sentence) in &found {
        let Some((_, _, values)) = table.iter().find(|(f, i, _)| f == file && i == item) else {
            wrong.push(format!(
                "{file}: `{item}` says \"Defaults to {sentence}\", and tests/docs.rs does not know what the code has: add it to stated_defaults"
            ));
            continue;
        };
        used.insert((file.as_str(), item.as_str()));
        for value in values {
            let written = value.written();
            if !mentions(sentence, value) {
                wrong.push(format!(
                    "{file}: `{item}` says \"Defaults to {sentence}\", but the code has {written} ({value:?})"
                ));
            }
        }
    }
    for (file, item, _) in &table {
        if !used.contains(&(*file, *item)) {
            wrong.push(format!(
                "{file}: `{item}` no longer says what it defaults to (stated_defaults lists it)"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The builder defaults only a working client shows: notify waiting on,
/// holder metadata on with the program's name and no label, the `default`
/// user without a password.
#[test]
fn builder_defaults_are_what_a_client_does() {
    use redmutex::{DistributedLock, Holder, Lease, LockOptions};
    let server = support::RedisServer::start();
    let client = redmutex::LockClient::builder()
        .url(server.url())
        .build()
        .expect("a client");
    let holder = redmutex::LockClient::open(&server.url()).expect("a second client");

    // Holder metadata on; the program is the executable's file name.
    let lock = DistributedLock::new(&client, "docs:defaults");
    let guard = lock.lock().expect("lock");
    let who = Holder::from_token(guard.token()).expect("a token with holder metadata");
    let exe = std::env::current_exe().expect("current_exe");
    let program = exe
        .file_name()
        .and_then(|n| n.to_str())
        .expect("a file name");
    assert_eq!(who.program, program);
    assert_eq!(who.label, None);
    guard.unlock().expect("unlock");

    // Logged in as `default`, with no password.
    let mut con = client.connection().expect("a connection");
    let user: String = redis::cmd("ACL")
        .arg("WHOAMI")
        .query(&mut con)
        .expect("ACL WHOAMI");
    assert_eq!(user, "default");
    drop(con);

    // Notify waiting: a waiter of the default client is woken by the
    // release's message.
    let held = DistributedLock::new(&holder, "docs:notify")
        .lock()
        .expect("held");
    let waiter = DistributedLock::with_options(
        &client,
        "docs:notify",
        LockOptions::default().wait(Duration::from_secs(10)),
    );
    let before = client.stats().notifications;
    let waiting = std::thread::spawn(move || waiter.lock().map(|g| g.unlock()));
    // Subscribed before the release, so the message has someone to reach.
    assert!(support::wait_until(Duration::from_secs(5), || {
        let mut c = server.conn();
        let subs: Vec<redis::Value> = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(holder.release_channel(held.key()))
            .query(&mut c)
            .unwrap_or_default();
        matches!(subs.get(1), Some(redis::Value::Int(n)) if *n > 0)
    }));
    held.unlock().expect("unlock");
    let got = waiting.join().expect("the waiter");
    assert!(matches!(got, Ok(Ok(_))), "{got:?}");
    // The message may be read just after the waiter took the lock by a
    // poll of its own; it was sent to a subscribed client all the same.
    assert!(
        support::wait_until(Duration::from_secs(5), || client.stats().notifications
            > before),
        "woken by a release message"
    );
}

// ---- API names the docs mention ---------------------------------------------

/// What `Type::name` may name for each public type of `public-api.txt`:
/// its functions, fields, variants and constants, the `Lease` methods of a
/// guard, the methods of `Options<X>` for its aliases (`LockOptions`), and
/// the standard traits' (`default`, `clone`).
fn api_names() -> BTreeMap<String, BTreeSet<String>> {
    let api = read(&root().join("public-api.txt"));
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut names: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut aliases: Vec<(String, String)> = Vec::new();
    let mut leases: Vec<String> = Vec::new();
    for line in api.lines() {
        for kind in ["pub struct ", "pub enum ", "pub trait ", "pub type "] {
            if let Some(rest) = line
                .strip_prefix(kind)
                .and_then(|r| r.strip_prefix("redmutex::"))
            {
                let name = ident(rest);
                names.entry(name.clone()).or_default();
                if kind == "pub type " && rest.contains("= redmutex::Options<") {
                    aliases.push((name, "Options".into()));
                }
            }
        }
        if let Some(rest) = line.strip_prefix("impl redmutex::Lease for redmutex::") {
            leases.push(ident(rest));
        }
        // `pub fn redmutex::T::f(`, `pub fn redmutex::Options<X>::f(`,
        // `redmutex::T.field:`, `redmutex::T::Variant`, `pub const redmutex::T::C`.
        let body = line
            .trim_start_matches("pub fn ")
            .trim_start_matches("pub const ");
        if let Some(rest) = body.strip_prefix("redmutex::") {
            let owner = ident(rest);
            let after = &rest[owner.len()..];
            let after = match after.strip_prefix('<') {
                Some(generic) => generic.split_once(">::").map(|(_, a)| a).unwrap_or(""),
                None => after
                    .strip_prefix("::")
                    .or_else(|| after.strip_prefix('.'))
                    .unwrap_or(""),
            };
            let member = ident(after);
            if !member.is_empty() {
                names.entry(owner).or_default().insert(member);
            }
        }
    }
    let lease: BTreeSet<String> = names.get("Lease").cloned().unwrap_or_default();
    for guard in leases {
        names
            .entry(guard)
            .or_default()
            .extend(lease.iter().cloned());
    }
    for (alias, of) in aliases {
        let of = names.get(&of).cloned().unwrap_or_default();
        names.entry(alias).or_default().extend(of);
    }
    for set in names.values_mut() {
        set.extend(["default", "clone", "fmt", "eq", "from", "drop"].map(String::from));
    }
    names
}

/// A `Type::name` in the docs names something the crate has: an API
/// renamed or removed leaves no stale mention behind (`LockClient::open*`,
/// a getter that moved).
#[test]
fn every_api_name_the_docs_mention_exists() {
    let names = api_names();
    assert!(names.len() > 30, "public-api.txt read: {}", names.len());
    let mut stale = Vec::new();
    let mut seen = 0;
    // What a user reads: ARCHITECTURE.md and the docs of private items
    // name crate-internal methods on purpose.
    let user_docs = documents().into_iter().filter(|(path, _, _)| {
        let rel = path.strip_prefix(root()).unwrap_or(path);
        !(rel.starts_with("src") && rel != Path::new("src/lib.rs"))
            && rel != Path::new("ARCHITECTURE.md")
    });
    for (path, _, text) in user_docs {
        let text = if path.ends_with("src/lib.rs") {
            crate_root_docs()
        } else {
            text
        };
        // Code spans and code blocks alike: `LockClient::open`, `Error::Timeout { .. }`.
        let mut rest = text.as_str();
        while let Some(at) = rest.find("::") {
            let before = &rest[..at];
            let owner: String = before
                .chars()
                .rev()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            let preceded_by_path = before[..before.len() - owner.len()].ends_with("::");
            let member: String = rest[at + 2..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[at + 2..];
            // Only the crate's own types, named without a path before them
            // (`redis::Client::open` is redis-rs's).
            let Some(known) = names.get(&owner) else {
                continue;
            };
            if preceded_by_path || member.is_empty() {
                continue;
            }
            seen += 1;
            if !known.contains(&member) {
                stale.push(format!(
                    "{}: {owner}::{member}",
                    path.strip_prefix(root()).unwrap_or(&path).display()
                ));
            }
        }
    }
    assert!(seen > 100, "the docs' API names were found ({seen})");
    stale.sort();
    stale.dedup();
    assert!(
        stale.is_empty(),
        "the docs name what the crate does not have:\n{}",
        stale.join("\n")
    );
}

/// ARCHITECTURE.md's inventory of the threads the library starts names
/// each one its code starts, and no other.
#[test]
fn the_thread_inventory_is_the_codes() {
    let mut started = BTreeSet::new();
    // The CLI's threads are its own business.
    for path in files_under("src", Some("src/bin"))
        .into_iter()
        .filter(|p| is_rust(p))
    {
        for line in read(&path).lines() {
            let names_a_thread = line.contains("THREAD_NAME: &str")
                || line.contains(".name(\"")
                || line.contains("Worker::spawn(\"");
            if !names_a_thread {
                continue;
            }
            for (at, _) in line.match_indices("\"redmutex-") {
                let name: String = line[at + 1..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                    .collect();
                started.insert(name);
            }
        }
    }
    assert!(
        started.len() >= 4,
        "the library's thread names: {started:?}"
    );
    let architecture = read(&root().join("ARCHITECTURE.md"));
    let start = architecture
        .find("**Threads the crate starts.**")
        .expect("ARCHITECTURE.md has its thread inventory");
    let end = architecture[start..]
        .find("\n\n")
        .map_or(architecture.len(), |e| start + e);
    let inventory = &architecture[start..end];
    let named: BTreeSet<String> = inventory
        .match_indices("`redmutex-")
        .map(|(at, _)| {
            inventory[at + 1..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect()
        })
        .collect();
    assert_eq!(
        named, started,
        "ARCHITECTURE.md's threads are the ones the code starts"
    );
}
