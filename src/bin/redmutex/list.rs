//! `redmutex list`: every held lock and semaphore under the prefix, by
//! `LockClient::list` (SCAN on every primary, never KEYS, never a token).

#[allow(unused_imports)]
use super::*;

use std::time::SystemTime;

use redmutex::{HeldLock, LockKind};

/// How long a listing runs before a terminal gets a progress line.
const PROGRESS_AFTER: Duration = Duration::from_secs(1);

pub(super) fn list(cli: &Cli, args: &ListArgs) -> Result<u8, Failure> {
    let client = client(cli)?;
    let started = Instant::now();
    let terminal = !cli.quiet && std::io::stderr().is_terminal();
    let mut shown = false;
    let mut progress = |scanned: u64| {
        if terminal && started.elapsed() >= PROGRESS_AFTER {
            output::to_stderr(format!("\r\x1b[2Kscanned {scanned} keys…").into_bytes());
            shown = true;
        }
    };
    let listing = client
        .list_with(&args.pattern, args.timeout, &mut progress)
        .map_err(redis_failure)?;
    if shown {
        output::to_stderr(b"\r\x1b[2K".to_vec());
    }
    if args.json {
        let items: Vec<String> = listing.held.iter().map(json_item).collect();
        output::outln!("[{}]", items.join(","));
    } else if listing.held.is_empty() {
        say(cli, format_args!("nothing held matches {:?}", args.pattern));
    } else {
        let width = listing
            .held
            .iter()
            .map(|h| h.key.len())
            .max()
            .unwrap_or(3)
            .max(3);
        output::outln!(
            "{:width$}  {:9}  {:>10}  {:>7}  {:>10}  HOLDER",
            "KEY",
            "KIND",
            "LEFT",
            "HOLDERS",
            "HELD"
        );
        for held in &listing.held {
            // The reader is gone (`redmutex list | head`): nothing more to
            // show anyone.
            if output::stdout_closed() {
                break;
            }
            let holders = match held.limit {
                Some(limit) => format!("{} of {limit}", held.holders),
                None => held.holders.to_string(),
            };
            // The oldest holder; the others are in --json.
            let (since, holder) = match held.held_by.first() {
                Some(first) => {
                    let more = held.holders.saturating_sub(1);
                    let more = if more > 0 && held.kind != LockKind::Reentrant {
                        format!(" (+{more} more)")
                    } else {
                        String::new()
                    };
                    (
                        held_for(held.seen_at, first.acquired_at),
                        format!("{first}{more}"),
                    )
                }
                None => ("-".into(), "-".into()),
            };
            output::outln!(
                "{:width$}  {:9}  {:>10}  {holders:>7}  {since:>10}  {holder}",
                held.key,
                kind_name(held.kind),
                left(held.remaining),
            );
        }
    }
    if !listing.complete {
        say(
            cli,
            format_args!(
                "stopped after {:?} ({} keys scanned): the listing is incomplete",
                args.timeout, listing.scanned
            ),
        );
        return Ok(EXIT_INCOMPLETE);
    }
    Ok(0)
}

fn kind_name(kind: LockKind) -> &'static str {
    match kind {
        LockKind::Mutex => "lock",
        other => other.name(),
    }
}

fn left(remaining: Option<Duration>) -> String {
    match remaining {
        Some(d) => format!("{:.1}s", d.as_secs_f64()),
        None => "no expiry".into(),
    }
}

/// How long ago `since` was at `now` (both by the server's clock).
fn held_for(now: SystemTime, since: SystemTime) -> String {
    let held = now.duration_since(since).unwrap_or_default();
    format!("{:.1}s", held.as_secs_f64())
}

fn json_item(held: &HeldLock) -> String {
    let ttl = held
        .remaining
        .map_or("null".into(), |d| d.as_millis().to_string());
    let limit = held.limit.map_or("null".into(), |l| l.to_string());
    let held_by: Vec<String> = held.held_by.iter().map(|h| holder_json(Some(h))).collect();
    format!(
        "{{\"key\":{},\"kind\":\"{}\",\"ttl_ms\":{ttl},\"holders\":{},\"limit\":{limit},\"held_by\":[{}]}}",
        json_string(&held.key),
        kind_name(held.kind),
        held.holders,
        held_by.join(",")
    )
}
