//! `redmutex status`: who holds a lock, and for how long.

#[allow(unused_imports)]
use super::*;

pub(super) fn status(cli: &Cli, args: &StatusArgs) -> Result<u8, Failure> {
    let client = client(cli)?;
    let held = holder(&client, &args.key)?;
    let fence_key = client.fence_key(&client.key(&args.key));
    let counter: Option<u64> = {
        let mut con = connection(&client)?;
        redis::cmd("GET")
            .arg(&fence_key)
            .query(&mut con)
            .map_err(|e| redis_failure(Error::Redis(e)))?
    };
    if args.json {
        let (token, ttl) = match &held {
            Some((token, pttl)) => (json_string(token), pttl.to_string()),
            None => ("null".into(), "null".into()),
        };
        println!(
            "{{\"key\":{},\"held\":{},\"token\":{token},\"ttl_ms\":{ttl},\"fencing_counter\":{}}}",
            json_string(&args.key),
            held.is_some(),
            counter.map_or("null".into(), |c| c.to_string()),
        );
    } else {
        match &held {
            Some((token, pttl)) => println!("{}: held by {token} ({})", args.key, ttl_text(*pttl)),
            None => println!("{}: free", args.key),
        }
        if let Some(counter) = counter {
            println!("fencing counter: {counter}");
        }
    }
    Ok(0)
}
