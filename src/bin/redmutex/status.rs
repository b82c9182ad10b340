//! `redmutex status`: who holds a lock (of any type), and for how long, by
//! the lock's own status read; for a semaphore, its limit and every
//! permit's holder and time left.

#[allow(unused_imports)]
use super::*;
use redmutex::LockKind;

pub(super) fn status(cli: &Cli, args: &StatusArgs) -> Result<u8, Failure> {
    let client = client(cli)?;
    let fence_key = client.fence_key(&client.key(&args.key));
    let counter = || -> Result<Option<u64>, Failure> {
        let mut con = connection(&client)?;
        redis::cmd("GET")
            .arg(&fence_key)
            .query(&mut con)
            .map_err(|e| redis_failure(Error::Redis(e)))
    };
    let counter_json = |counter: Option<u64>| counter.map_or("null".into(), |c| c.to_string());
    // Who holds it: one atomic read (`lua/inspect.lua`), never a secret.
    let held = match DistributedLock::new(&client, args.key.clone()).status() {
        Ok(held) => held,
        Err(Error::WrongType { key }) => {
            return Err(fail(
                EXIT_DATAERR,
                format!("{key:?} holds a value of another type: not a redmutex lock or semaphore"),
            ));
        }
        Err(err) => return Err(redis_failure(err)),
    };
    if held.as_ref().is_some_and(|h| h.kind == LockKind::Semaphore) {
        // The ids themselves only when asked for (each is the secret
        // `release --token` takes; the library's status read redacts them):
        // then the permits come from a read of the CLI's own, the server's
        // clock and the hash in one transaction, so every id shown is a
        // live permit's and the counts agree with the list.
        let view = if cli.tokens {
            let mut con = connection(&client)?;
            let ((secs, micros), fields): ((u64, u64), Vec<(String, String)>) = redis::pipe()
                .atomic()
                .cmd("TIME")
                .cmd("HGETALL")
                .arg(client.key(&args.key))
                .query(&mut con)
                .map_err(|e| redis_failure(Error::Redis(e)))?;
            permits_of(
                secs.saturating_mul(1000).saturating_add(micros / 1000),
                &fields,
            )
        } else {
            let status = Semaphore::new(&client, args.key.clone(), 1)
                .status()
                .map_err(redis_failure)?;
            Permits {
                limit: status.limit(),
                rows: status
                    .holders()
                    .iter()
                    .map(|h| PermitRow {
                        id: None,
                        holder: h.holder(),
                        remaining: h.remaining(),
                        fence: h.fencing_token(),
                    })
                    .collect(),
            }
        };
        let counter = counter()?;
        semaphore(args, &view, cli.tokens, counter, counter_json);
        return Ok(0);
    }
    // The token itself only when asked for (it is the secret
    // `release --token` takes): a read of its own, kept only while it is
    // still the holder the status read found.
    let token = match (&held, cli.tokens) {
        (Some(h), true) if h.kind == LockKind::Mutex => {
            let mut con = connection(&client)?;
            let token: Option<String> = redis::cmd("GET")
                .arg(client.key(&args.key))
                .query(&mut con)
                .ok()
                .flatten();
            token.filter(|t| Holder::from_token(t).as_ref() == h.held_by.first())
        }
        _ => None,
    };
    let counter = counter()?;
    let kind = |h: &HeldLock| match h.kind {
        LockKind::Reentrant => "reentrant",
        LockKind::Read => "read",
        LockKind::Write => "write",
        _ => "lock",
    };
    if args.json {
        let (kind, holder, holders, ttl) = match &held {
            Some(h) => (
                kind(h),
                holder_json(h.held_by.first()),
                h.holders.to_string(),
                h.remaining
                    .map_or("-1".into(), |left| left.as_millis().to_string()),
            ),
            None => ("lock", "null".into(), "0".into(), "null".into()),
        };
        let token = match (&token, cli.tokens) {
            (Some(token), true) => format!(",\"token\":{}", json_string(token)),
            (None, true) => ",\"token\":null".into(),
            (_, false) => String::new(),
        };
        output::outln!(
            "{{\"key\":{},\"kind\":\"{kind}\",\"held\":{},\"holder\":{holder},\"holders\":{holders}{token},\"ttl_ms\":{ttl},\"fencing_counter\":{}}}",
            json_string(&args.key),
            held.is_some(),
            counter_json(counter),
        );
    } else {
        match &held {
            Some(h) if h.kind == LockKind::Mutex => {
                output::outln!("{}: held by {} ({})", args.key, who_holds(h), left_text(h));
            }
            Some(h) if h.kind == LockKind::Read => {
                output::outln!(
                    "{}: read lock, {} readers ({})",
                    args.key,
                    h.holders,
                    left_text(h)
                );
                for holder in &h.held_by {
                    output::outln!("  {}", holder_text(holder));
                }
            }
            Some(h) => {
                let holds = if h.kind == LockKind::Reentrant {
                    format!(", {} holds", h.holders)
                } else {
                    String::new()
                };
                output::outln!(
                    "{}: {} lock held by {}{holds} ({})",
                    args.key,
                    kind(h),
                    who_holds(h),
                    left_text(h)
                );
            }
            None => output::outln!("{}: free", args.key),
        }
        if let Some(token) = &token {
            output::outln!("token: {}", printable(token));
        }
        if let Some(counter) = counter {
            output::outln!("fencing counter: {counter}");
        }
    }
    Ok(0)
}

/// One permit as `status` shows it.
struct PermitRow {
    /// Its id, only with `--tokens`.
    id: Option<String>,
    holder: Option<Holder>,
    remaining: Duration,
    fence: Option<u64>,
}

/// A semaphore as `status` shows it.
struct Permits {
    limit: Option<u32>,
    /// Soonest to expire first.
    rows: Vec<PermitRow>,
}

/// The live permits of a semaphore's hash (`p:<id>` deadlines after
/// `now_ms` by the server's clock, `f:<id>` fencing tokens), read in one
/// transaction with the clock.
fn permits_of(now_ms: u64, fields: &[(String, String)]) -> Permits {
    let value = |name: &str| fields.iter().find(|(f, _)| f == name).map(|(_, v)| v);
    let mut rows: Vec<PermitRow> = fields
        .iter()
        .filter_map(|(field, deadline)| {
            let id = field.strip_prefix("p:")?;
            let deadline: u64 = deadline.parse().ok()?;
            let left = deadline.checked_sub(now_ms).filter(|left| *left > 0)?;
            Some(PermitRow {
                id: Some(id.to_owned()),
                holder: Holder::from_token(id),
                remaining: Duration::from_millis(left),
                fence: value(&format!("f:{id}")).and_then(|f| f.parse().ok()),
            })
        })
        .collect();
    rows.sort_by_key(|row| row.remaining);
    Permits {
        limit: value("limit").and_then(|l| l.parse().ok()),
        rows,
    }
}

fn semaphore(
    args: &StatusArgs,
    view: &Permits,
    tokens: bool,
    counter: Option<u64>,
    counter_json: impl Fn(Option<u64>) -> String,
) {
    let limit = view.limit.unwrap_or_default();
    let in_use = view.rows.len();
    let available = limit.saturating_sub(u32::try_from(in_use).unwrap_or(u32::MAX));
    if args.json {
        let permits: Vec<String> = view
            .rows
            .iter()
            .map(|row| {
                let id = match (tokens, &row.id) {
                    (true, Some(id)) => format!("\"id\":{},", json_string(id)),
                    (true, None) => "\"id\":null,".to_owned(),
                    (false, _) => String::new(),
                };
                format!(
                    "{{{id}\"holder\":{},\"ttl_ms\":{},\"fencing_token\":{}}}",
                    holder_json(row.holder.as_ref()),
                    row.remaining.as_millis(),
                    row.fence.map_or("null".into(), |t| t.to_string())
                )
            })
            .collect();
        output::outln!(
            "{{\"key\":{},\"kind\":\"semaphore\",\"limit\":{limit},\"in_use\":{in_use},\"available\":{available},\"permits\":[{}],\"fencing_counter\":{}}}",
            json_string(&args.key),
            permits.join(","),
            counter_json(counter),
        );
        return;
    }
    output::outln!(
        "{}: semaphore, {in_use} of {limit} permits out, {available} available",
        args.key,
    );
    for row in &view.rows {
        let fence = row
            .fence
            .map_or(String::new(), |t| format!(", fencing token {t}"));
        let id = match &row.id {
            Some(id) => format!(", id {}", printable(id)),
            None => String::new(),
        };
        output::outln!(
            "  {} ({:.1}s left{fence}{id})",
            match (&row.holder, &row.id) {
                (Some(holder), _) => holder_text(holder),
                (None, Some(id)) => who(id),
                (None, None) => "a holder without metadata".to_owned(),
            },
            row.remaining.as_secs_f64()
        );
    }
    if let Some(counter) = counter {
        output::outln!("fencing counter: {counter}");
    }
}
