//! `redmutex release`: owner-checked with `--token`, or forced.

#[allow(unused_imports)]
use super::*;

pub(super) fn release(cli: &Cli, args: &ReleaseArgs) -> Result<u8, Failure> {
    let client = client(cli)?;
    if args.force {
        // Safe to send twice (it records what it deleted); an outcome that
        // cannot be learned is reported as unknown (exit 69).
        let deleted = DistributedLock::new(&client, args.key.clone())
            .force_release()
            .map_err(redis_failure)?;
        match deleted {
            Some(token) => println!("{}: deleted, it was held by {token}", args.key),
            None => println!("{}: nothing to delete, it was free", args.key),
        }
        return Ok(0);
    }
    let token = args.token.as_deref().unwrap_or_default();
    match DistributedLock::new(&client, args.key.clone()).release_token(token) {
        Ok(()) => {
            say(cli, format_args!("released {:?}", args.key));
            Ok(0)
        }
        Err(err @ Error::NotHeld { .. }) => {
            say(cli, format_args!("{err}; nothing was changed"));
            Ok(EXIT_CONFLICT)
        }
        Err(err) => Err(redis_failure(err)),
    }
}
