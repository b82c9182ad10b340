//! `redmutex release`: owner-checked with `--token` (a lock's token or a
//! permit's id), or forced.

#[allow(unused_imports)]
use super::*;

pub(super) fn release(cli: &Cli, args: &ReleaseArgs) -> Result<u8, Failure> {
    let client = client(cli)?;
    if args.force {
        if let Kind::Semaphore = kind(&client, &args.key)? {
            return Err(fail(
                EXIT_USAGE,
                format!(
                    "{:?} is a semaphore: --force deletes a lock only; give back one permit \
                     with --token ID (`redmutex status {}` lists the ids)",
                    args.key, args.key
                ),
            ));
        }
        // Safe to send twice (it records what it deleted); an outcome that
        // cannot be learned is reported as unknown (exit 69).
        let deleted = DistributedLock::new(&client, args.key.clone())
            .force_release()
            .map_err(redis_failure)?;
        match deleted {
            Some(token) => output::outln!(
                "{}: deleted, it was held by {} (token {})",
                args.key,
                who(&token),
                shown(cli, &token)
            ),
            None => output::outln!("{}: nothing to delete, it was free", args.key),
        }
        return Ok(0);
    }
    let from_file;
    let token = match (&args.token, &args.token_file) {
        (Some(token), _) => token.as_str(),
        (None, Some(path)) => {
            from_file = read_token(path)?;
            from_file.as_str()
        }
        (None, None) => return Err(fail(EXIT_USAGE, "--token or --token-file is needed")),
    };
    // A semaphore's permit is given back by its id; everything else goes
    // to the lock's owner-checked release, which says "not held" for a key
    // that is gone or another's.
    let released = match kind(&client, &args.key)? {
        Kind::Semaphore => Semaphore::new(&client, args.key.clone(), 1).release_permit(token),
        _ => DistributedLock::new(&client, args.key.clone()).release_token(token),
    };
    match released {
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

/// The token in `path` (`-`: standard input): its first line, without
/// the line's end. An empty one is refused before Redis is asked.
fn read_token(path: &std::path::Path) -> Result<String, Failure> {
    use std::io::Read;
    let mut text = String::new();
    let read = if path.as_os_str() == "-" {
        std::io::stdin()
            .lock()
            .take(64 * 1024)
            .read_to_string(&mut text)
    } else {
        std::fs::File::open(path).and_then(|f| f.take(64 * 1024).read_to_string(&mut text))
    };
    read.map_err(|err| {
        fail(
            EXIT_USAGE,
            format!("--token-file {}: {err}", path.display()),
        )
    })?;
    let token = text
        .lines()
        .next()
        .unwrap_or_default()
        .trim_end_matches('\r');
    if token.is_empty() {
        return Err(fail(
            EXIT_USAGE,
            format!("--token-file {}: no token in it", path.display()),
        ));
    }
    Ok(token.to_owned())
}
