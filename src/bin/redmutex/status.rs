//! `redmutex status`: who holds a lock, and for how long; for a semaphore,
//! its limit and every permit's holder and time left.

#[allow(unused_imports)]
use super::*;

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
    match kind(&client, &args.key)? {
        Kind::Semaphore => {
            let status = Semaphore::new(&client, args.key.clone(), 1)
                .status()
                .map_err(redis_failure)?;
            let counter = counter()?;
            semaphore(cli, args, &status, counter, counter_json);
            return Ok(0);
        }
        Kind::Other(what) => {
            return Err(fail(
                EXIT_UNAVAILABLE,
                format!(
                    "{:?} holds a {what}: not a redmutex lock or semaphore",
                    client.key(&args.key)
                ),
            ));
        }
        Kind::Free | Kind::Lock => {}
    }
    let held = holder(&client, &args.key)?;
    let counter = counter()?;
    if args.json {
        let (holder, ttl) = match &held {
            Some((token, pttl)) => (
                holder_json(Holder::from_token(token).as_ref()),
                pttl.to_string(),
            ),
            None => ("null".into(), "null".into()),
        };
        let token = match (&held, cli.tokens) {
            (Some((token, _)), true) => format!(",\"token\":{}", json_string(token)),
            (None, true) => ",\"token\":null".into(),
            (_, false) => String::new(),
        };
        println!(
            "{{\"key\":{},\"kind\":\"lock\",\"held\":{},\"holder\":{holder}{token},\"ttl_ms\":{ttl},\"fencing_counter\":{}}}",
            json_string(&args.key),
            held.is_some(),
            counter_json(counter),
        );
    } else {
        match &held {
            Some((token, pttl)) => {
                println!("{}: held by {} ({})", args.key, who(token), ttl_text(*pttl));
                if cli.tokens {
                    println!("token: {}", printable(token));
                }
            }
            None => println!("{}: free", args.key),
        }
        if let Some(counter) = counter {
            println!("fencing counter: {counter}");
        }
    }
    Ok(0)
}

fn semaphore(
    cli: &Cli,
    args: &StatusArgs,
    status: &redmutex::SemaphoreStatus,
    counter: Option<u64>,
    counter_json: impl Fn(Option<u64>) -> String,
) {
    let limit = status.limit().unwrap_or_default();
    let available = status.available().unwrap_or_default();
    if args.json {
        let permits: Vec<String> = status
            .holders()
            .iter()
            .map(|h| {
                let id = if cli.tokens {
                    format!("\"id\":{},", json_string(h.id()))
                } else {
                    String::new()
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
        let id = if cli.tokens {
            format!(", id {}", printable(holder.id()))
        } else {
            String::new()
        };
        println!(
            "  {} ({:.1}s left{fence}{id})",
            who(holder.id()),
            holder.remaining().as_secs_f64()
        );
    }
    if let Some(counter) = counter {
        println!("fencing counter: {counter}");
    }
}
