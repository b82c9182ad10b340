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
                EXIT_UNAVAILABLE,
                format!("{key:?} holds a value of another type: not a redmutex lock or semaphore"),
            ));
        }
        Err(err) => return Err(redis_failure(err)),
    };
    if held.as_ref().is_some_and(|h| h.kind == LockKind::Semaphore) {
        let status = Semaphore::new(&client, args.key.clone(), 1)
            .status()
            .map_err(redis_failure)?;
        // The ids themselves only when asked for (each is the secret
        // `release --token` takes; the status read redacts them): a read of
        // their own, matched to the permits the status read found.
        let ids: Vec<String> = if cli.tokens {
            let mut con = connection(&client)?;
            let fields: Vec<String> = redis::cmd("HKEYS")
                .arg(client.key(&args.key))
                .query(&mut con)
                .unwrap_or_default();
            fields
                .into_iter()
                .filter_map(|f| f.strip_prefix("p:").map(str::to_owned))
                .collect()
        } else {
            Vec::new()
        };
        let counter = counter()?;
        semaphore(
            args,
            &status,
            cli.tokens.then_some(ids),
            counter,
            counter_json,
        );
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
        println!(
            "{{\"key\":{},\"kind\":\"{kind}\",\"held\":{},\"holder\":{holder},\"holders\":{holders}{token},\"ttl_ms\":{ttl},\"fencing_counter\":{}}}",
            json_string(&args.key),
            held.is_some(),
            counter_json(counter),
        );
    } else {
        match &held {
            Some(h) if h.kind == LockKind::Mutex => {
                println!("{}: held by {} ({})", args.key, who_holds(h), left_text(h));
            }
            Some(h) if h.kind == LockKind::Read => {
                println!(
                    "{}: read lock, {} readers ({})",
                    args.key,
                    h.holders,
                    left_text(h)
                );
                for holder in &h.held_by {
                    println!("  {}", holder_text(holder));
                }
            }
            Some(h) => {
                let holds = if h.kind == LockKind::Reentrant {
                    format!(", {} holds", h.holders)
                } else {
                    String::new()
                };
                println!(
                    "{}: {} lock held by {}{holds} ({})",
                    args.key,
                    kind(h),
                    who_holds(h),
                    left_text(h)
                );
            }
            None => println!("{}: free", args.key),
        }
        if let Some(token) = &token {
            println!("token: {}", printable(token));
        }
        if let Some(counter) = counter {
            println!("fencing counter: {counter}");
        }
    }
    Ok(0)
}

fn semaphore(
    args: &StatusArgs,
    status: &redmutex::SemaphoreStatus,
    ids: Option<Vec<String>>,
    counter: Option<u64>,
    counter_json: impl Fn(Option<u64>) -> String,
) {
    let tokens = ids.is_some();
    let mut ids = ids.unwrap_or_default();
    // Each permit's id: the one whose redacted form the status read gave
    // (a permit given back in between has none).
    let mut id_of = |holder: &redmutex::PermitHolder| -> Option<String> {
        let at = ids
            .iter()
            .position(|id| redmutex::redact(id) == holder.id())?;
        Some(ids.swap_remove(at))
    };
    let limit = status.limit().unwrap_or_default();
    let available = status.available().unwrap_or_default();
    if args.json {
        let permits: Vec<String> = status
            .holders()
            .iter()
            .map(|h| {
                let id = match (tokens, id_of(h)) {
                    (true, Some(id)) => format!("\"id\":{},", json_string(&id)),
                    (true, None) => "\"id\":null,".to_owned(),
                    (false, _) => String::new(),
                };
                format!(
                    "{{{id}\"holder\":{},\"ttl_ms\":{},\"fencing_token\":{}}}",
                    holder_json(h.holder().as_ref()),
                    h.remaining().as_millis(),
                    h.fencing_token().map_or("null".into(), |t| t.to_string())
                )
            })
            .collect();
        println!(
            "{{\"key\":{},\"kind\":\"semaphore\",\"limit\":{limit},\"in_use\":{},\"available\":{available},\"permits\":[{}],\"fencing_counter\":{}}}",
            json_string(&args.key),
            status.in_use(),
            permits.join(","),
            counter_json(counter),
        );
        return;
    }
    println!(
        "{}: semaphore, {} of {limit} permits out, {available} available",
        args.key,
        status.in_use()
    );
    for holder in status.holders() {
        let fence = holder
            .fencing_token()
            .map_or(String::new(), |t| format!(", fencing token {t}"));
        let id = match id_of(holder) {
            Some(id) => format!(", id {}", printable(&id)),
            None => String::new(),
        };
        println!(
            "  {} ({:.1}s left{fence}{id})",
            holder
                .holder()
                .map_or_else(|| who(holder.id()), |h| holder_text(&h)),
            holder.remaining().as_secs_f64()
        );
    }
    if let Some(counter) = counter {
        println!("fencing counter: {counter}");
    }
}
