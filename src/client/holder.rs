//! Who holds a lease: the holder metadata written into Redis with every
//! acquisition, in the same command, and read back by `status` and `list`.
//!
//! The metadata rides in the token itself: `SECRET|HOST|PID|PROGRAM|AT|LABEL`,
//! where `SECRET` is the random part (a UUID v4's 16 bytes as 22 characters
//! of unpadded base64url; a bare token is the UUID's usual 36-character
//! form). Every script compares
//! whole tokens, so owner checks, resends and markers work exactly as with a
//! bare secret, and no lock type needs another key, field or round trip.
//! Readers split the secret off ([`Holder::from_token`], `lua/inspect.lua`)
//! and never show it unless asked.
//!
//! `AT` is the acquisition time in milliseconds since the Unix epoch *by
//! the server's clock*, as estimated by the client: one `TIME` per client
//! (the first acquisition), then the monotonic clock from there, so a
//! holder whose wall clock is off by seconds still reports a time that the
//! server's (and `list`'s) arithmetic agrees with, to within half a round
//! trip. (A RedLock writes the holder's own clock: its nodes' clocks are
//! independent, and it must not wait on any one node.) Invariant: no field holds `|`, whitespace or a control character,
//! so a token splits into exactly six fields and passes through a shell
//! unquoted.

use std::cell::RefCell;
use std::fmt::Write;
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use crate::error::Error;

/// The longest label, host or program name kept, in bytes.
pub const MAX_FIELD: usize = 64;

/// How long a clock estimate that could not ask the server stands in
/// before the server is asked again.
const RETRY_TIME_AFTER: Duration = Duration::from_secs(60);

/// Who holds a lease, as its acquisition wrote it into Redis: read with
/// [`Holder::from_token`], or listed by
/// [`LockClient::list`](crate::LockClient::list) and
/// [`Semaphore::status`](crate::Semaphore::status) (which never return the
/// token's secret part).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Holder {
    /// The holder's host name (as `gethostname` gave it, `|`, whitespace
    /// and control characters replaced by `_`, at most 64 bytes).
    pub host: String,
    /// The holder's process id.
    pub pid: u32,
    /// The program: the executable's file name, or what the client was told
    /// ([`LockClientBuilder::program`](crate::LockClientBuilder::program);
    /// `redmutex run` gives the command's name).
    pub program: String,
    /// The caller's label, if any
    /// ([`LockClientBuilder::label`](crate::LockClientBuilder::label)).
    pub label: Option<String>,
    /// When the lease was acquired, by the server's clock as the holder
    /// estimated it (to within half a round trip); for a RedLock, whose
    /// nodes' clocks are independent, by the holder's own clock. A lock
    /// handed between threads of one process keeps the time of its
    /// acquisition in Redis.
    pub acquired_at: SystemTime,
}

impl Holder {
    /// The holder metadata carried by `token` (a guard's
    /// [`token()`](crate::LockGuard::token), a permit's id, or a value read
    /// from Redis), or `None` for a token without any (written by a client
    /// with [`LockClientBuilder::holder_metadata`](crate::LockClientBuilder::holder_metadata)
    /// off, or by an older version).
    pub fn from_token(token: &str) -> Option<Holder> {
        let mut fields = token.split('|');
        let secret = fields.next()?;
        if secret.is_empty() {
            return None;
        }
        Holder::from_fields(fields)
    }

    /// The metadata after the secret, as `lua/inspect.lua` returns it
    /// (starting with `|`).
    pub(crate) fn from_meta(meta: &str) -> Option<Holder> {
        Holder::from_fields(meta.strip_prefix('|')?.split('|'))
    }

    /// Read from Redis, so untrusted: only what a writer of this crate
    /// makes is accepted (text fields of at most [`MAX_FIELD`] bytes
    /// without whitespace or control characters, a time before the year
    /// 10000); anything else is no holder, never a panic later (a time
    /// formatter refusing year 10000, a control sequence reaching a
    /// terminal).
    fn from_fields<'a>(mut fields: impl Iterator<Item = &'a str>) -> Option<Holder> {
        let host = fields.next().filter(|f| readable(f))?;
        let pid = fields.next()?.parse().ok()?;
        let program = fields.next().filter(|f| readable(f))?;
        let at: u64 = fields.next()?.parse().ok()?;
        let label = fields.next().filter(|f| f.is_empty() || readable(f))?;
        if fields.next().is_some() || at > MAX_AT_MS {
            return None;
        }
        Some(Holder {
            host: host.to_owned(),
            pid,
            program: program.to_owned(),
            label: (!label.is_empty()).then(|| label.to_owned()),
            acquired_at: UNIX_EPOCH.checked_add(Duration::from_millis(at))?,
        })
    }
}

/// The last millisecond of the year 9999 (UTC): the latest acquisition
/// time a holder may claim. (Later ones are no time any formatter of RFC
/// 3339 can write.)
const MAX_AT_MS: u64 = 253_402_300_799_999;

/// A text field as a writer of this crate makes it.
fn readable(field: &str) -> bool {
    !field.is_empty()
        && field.len() <= MAX_FIELD
        && !field.chars().any(|c| c.is_whitespace() || c.is_control())
}

/// `token` as it may be shown: its public part (the holder metadata after
/// the secret, `…|HOST|PID|PROGRAM|AT|LABEL`), or `…` alone for a token
/// without metadata. A token is a capability (whoever has it can extend or
/// release the lease), so logs, `Debug` output and messages show this
/// instead; the text after the secret is shown only when it is readable
/// holder metadata.
///
/// ```
/// use redmutex::redact;
/// assert_eq!(redact("Zm9vYmFy|web-1|42|reindex|1795000000123|"), "…|web-1|42|reindex|1795000000123|");
/// assert_eq!(redact("0b5e8f6a-9d0c-4b1e-8a57-2f1d3c4b5a69"), "…");
/// assert_eq!(redact("secret|\u{1b}[2J|1|p|5|"), "…");
/// ```
pub fn redact(token: &str) -> String {
    match token.find('|') {
        Some(at) if Holder::from_token(token).is_some() => format!("…{}", &token[at..]),
        _ => "…".to_owned(),
    }
}

/// Who a refused attempt's reply named: `token` [`redact`]ed, when it
/// carries holder metadata this crate can read (`None` otherwise: a bare
/// `…` names nobody).
pub(crate) fn named_holder(token: &str) -> Option<String> {
    // One parse: `redact` shows only readable metadata, else a bare `…`.
    Some(redact(token)).filter(|redacted| redacted != "…")
}

/// `token` for a `Debug` implementation: [`redact`]ed.
pub(crate) struct Redacted<'a>(pub(crate) &'a str);

impl std::fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&redact(self.0))
    }
}

impl std::fmt::Display for Holder {
    /// `PROGRAM on HOST pid PID` and ` [LABEL]` when there is one.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} on {} pid {}", self.program, self.host, self.pid)?;
        if let Some(label) = &self.label {
            write!(f, " [{label}]")?;
        }
        Ok(())
    }
}

/// What a client writes about itself into its tokens.
#[derive(Clone, Debug)]
pub(crate) struct Identity {
    /// `None`: metadata off, tokens are bare secrets.
    fields: Option<Fields>,
}

#[derive(Clone, Debug)]
struct Fields {
    program: String,
    label: String,
}

impl Default for Identity {
    fn default() -> Self {
        Identity {
            fields: Some(Fields {
                program: PROGRAM.clone(),
                label: String::new(),
            }),
        }
    }
}

impl Identity {
    /// Metadata on or off, with a program name (`None`: the executable's;
    /// made fit like a system name, since it is only descriptive) and a
    /// label (`None`: none).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty or too long label, or one
    /// with `|`, whitespace or a control character.
    pub(crate) fn new(
        enabled: bool,
        program: Option<&str>,
        label: Option<&str>,
    ) -> Result<Identity, Error> {
        let program = match program {
            Some(program) => fit(program),
            None => PROGRAM.clone(),
        };
        let label = match label {
            Some(label) => check_field("label", label)?.to_owned(),
            None => String::new(),
        };
        Ok(Identity {
            fields: enabled.then_some(Fields { program, label }),
        })
    }

    /// Tokens without metadata.
    pub(crate) fn off() -> Identity {
        Identity { fields: None }
    }

    /// The program name written, when metadata is on.
    pub(crate) fn program(&self) -> Option<String> {
        self.fields.as_ref().map(|f| f.program.clone())
    }

    /// Whether tokens carry metadata (and so need the server's time).
    pub(crate) fn enabled(&self) -> bool {
        self.fields.is_some()
    }

    /// A fresh token: a new secret, and the metadata with `at_ms` (the
    /// server's time now) when on.
    pub(crate) fn token(&self, at_ms: u64) -> String {
        let mut token = String::new();
        self.write_token(at_ms, &mut token);
        token
    }

    /// [`Identity::token`], shared: written into a buffer this thread
    /// keeps, so the token costs one allocation, the shared copy's.
    pub(crate) fn token_shared(&self, at_ms: u64) -> Arc<str> {
        thread_local! {
            static BUFFER: RefCell<String> = const { RefCell::new(String::new()) };
        }
        BUFFER
            .try_with(|buffer| {
                let mut buffer = buffer.try_borrow_mut().ok()?;
                buffer.clear();
                self.write_token(at_ms, &mut buffer);
                Some(Arc::from(buffer.as_str()))
            })
            .ok()
            .flatten()
            .unwrap_or_else(|| Arc::from(self.token(at_ms)))
    }

    fn write_token(&self, at_ms: u64, out: &mut String) {
        let (secret, pid) = secret::fresh();
        let Some(f) = &self.fields else {
            let mut text = uuid::Uuid::encode_buffer();
            out.push_str(secret.hyphenated().encode_lower(&mut text));
            return;
        };
        // The UUID's bytes in 22 characters instead of 36: with the metadata
        // after it, the value stays in a smaller allocation in Redis (see
        // the memory figures in docs/performance.md). The first byte's top bit is cleared
        // so the token never starts with `-` (an option to a command line);
        // 121 random bits are left.
        let mut bytes = *secret.as_bytes();
        bytes[0] &= 0x7f;
        // The whole token at once: one allocation for a new `String`.
        out.reserve(22 + HOST.len() + f.program.len() + f.label.len() + 36);
        push_base64url(&bytes, out);
        {
            out.push('|');
            out.push_str(&HOST);
            // Writing a number into a String cannot fail.
            let _ = write!(out, "|{pid}|");
            out.push_str(&f.program);
            let _ = write!(out, "|{at_ms}|");
            out.push_str(&f.label);
        }
    }
}

/// Appends `bytes` in unpadded base64url (RFC 4648 §5): letters, digits,
/// `-` and `_`, none of them a separator of the token.
fn push_base64url(bytes: &[u8], out: &mut String) {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    for chunk in bytes.chunks(3) {
        let b = [
            chunk.first().copied().unwrap_or(0),
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        // A chunk of k bytes gives k + 1 characters.
        for i in 0..=chunk.len() {
            let index = (n >> (18 - 6 * i)) & 63;
            out.push(char::from(ALPHABET[index as usize]));
        }
    }
}

/// Token secrets without a system call per token, safe across `fork`.
///
/// Each thread draws from its own ChaCha12 generator seeded from the OS
/// (`getrandom`, once per thread), and caches the process id. A `fork`
/// copies both into the child, whose tokens would then repeat the
/// parent's: two holders of one lock. So a thread whose generator was
/// seeded in another process ([`Birth`], see `conn/fork.rs`) reseeds (and
/// reads its pid) before drawing.
mod secret {
    use std::cell::RefCell;

    use rand_chacha::ChaCha12Rng;
    use rand_chacha::rand_core::{RngCore, SeedableRng};
    use uuid::{Builder, Uuid};

    use crate::fork::Birth;

    thread_local! {
        /// The process it was seeded in, the generator.
        static DRAW: RefCell<Option<(Birth, ChaCha12Rng)>> = const { RefCell::new(None) };
    }

    /// A random UUID v4 and this process's id.
    pub(super) fn fresh() -> (Uuid, u32) {
        let drawn = DRAW.try_with(|cell| {
            let mut slot = cell.try_borrow_mut().ok()?;
            if !matches!(&*slot, Some((birth, _)) if birth.is_current()) {
                let rng = ChaCha12Rng::try_from_os_rng().ok()?;
                *slot = Some((Birth::now(), rng));
            }
            let (birth, rng) = slot.as_mut()?;
            let mut bytes = [0u8; 16];
            rng.fill_bytes(&mut bytes);
            Some((Builder::from_random_bytes(bytes).into_uuid(), birth.pid()))
        });
        // A thread being torn down, or no OS randomness to seed from: the
        // OS gives this one.
        drawn
            .ok()
            .flatten()
            .unwrap_or_else(|| (Uuid::new_v4(), std::process::id()))
    }

    #[cfg(all(test, unix))]
    mod tests {
        use super::*;

        #[test]
        fn secrets_are_v4_uuids_and_never_repeat() {
            let mut seen = std::collections::HashSet::new();
            for _ in 0..10_000 {
                let (secret, pid) = fresh();
                assert_eq!(secret.get_version_num(), 4);
                assert_eq!(pid, std::process::id());
                assert!(seen.insert(secret), "a repeated secret");
            }
        }

        /// Without the fork handler, the child's next secret is the
        /// parent's next one (the generator's state is copied).
        #[test]
        fn a_forked_child_draws_other_secrets_and_has_its_own_pid() {
            let _ = fresh();
            let mut fds = [0i32; 2];
            // SAFETY: a pipe into a two-element array.
            assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
            // SAFETY: the child only draws a secret, writes it and exits
            // with _exit (no destructors, no other thread's state).
            let child = unsafe { libc::fork() };
            assert!(child >= 0, "fork");
            if child == 0 {
                let (secret, pid) = fresh();
                let text = format!("{secret} {pid}");
                // SAFETY: writes the bytes of a live buffer, then exits.
                unsafe {
                    libc::write(fds[1], text.as_ptr().cast(), text.len());
                    libc::_exit(0);
                }
            }
            // SAFETY: closes our copy of the write end.
            unsafe { libc::close(fds[1]) };
            let (parent_secret, _) = fresh();
            let mut buf = [0u8; 128];
            // SAFETY: reads into a live buffer of that length.
            let n = unsafe { libc::read(fds[0], buf.as_mut_ptr().cast(), buf.len()) };
            let mut status = 0;
            // SAFETY: reaps our own child; closes our read end.
            unsafe {
                libc::waitpid(child, &mut status, 0);
                libc::close(fds[0]);
            }
            let text =
                String::from_utf8_lossy(&buf[..usize::try_from(n).unwrap_or(0)]).into_owned();
            let (secret, pid) = text.split_once(' ').expect("the child's answer");
            assert_ne!(
                secret,
                parent_secret.to_string(),
                "the child repeated the parent"
            );
            assert_eq!(pid, child.to_string(), "the child's own pid");
        }
    }
}

/// A label or program name as given, or why it cannot be one.
fn check_field<'a>(what: &str, value: &'a str) -> Result<&'a str, Error> {
    if value.is_empty() || value.len() > MAX_FIELD {
        return Err(Error::InvalidArgument(format!(
            "the {what} must be 1 to {MAX_FIELD} bytes long, got {}",
            value.len()
        )));
    }
    if value.chars().any(unfit) {
        return Err(Error::InvalidArgument(format!(
            "the {what} {value:?} may not hold '|', whitespace or control characters"
        )));
    }
    Ok(value)
}

fn unfit(c: char) -> bool {
    c == '|' || c.is_whitespace() || c.is_control()
}

/// What the system gives, made fit for a field: unfit characters replaced,
/// at most [`MAX_FIELD`] bytes (cut at a character boundary), never empty.
fn fit(raw: &str) -> String {
    let mut out = String::new();
    for c in raw.chars() {
        let c = if unfit(c) { '_' } else { c };
        if out.len() + c.len_utf8() > MAX_FIELD {
            break;
        }
        out.push(c);
    }
    if out.is_empty() {
        out.push('-');
    }
    out
}

static HOST: LazyLock<String> = LazyLock::new(|| fit(&host_name()));

static PROGRAM: LazyLock<String> = LazyLock::new(|| {
    let exe = std::env::args_os().next().unwrap_or_default();
    let name = std::path::Path::new(&exe)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    fit(&name)
});

#[cfg(unix)]
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at
    // most that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(not(unix))]
fn host_name() -> String {
    std::env::var("COMPUTERNAME").unwrap_or_default()
}

/// The server's clock as this client estimates it: one reading of `TIME`,
/// carried forward on the monotonic clock (immune to steps of the local
/// wall clock).
#[derive(Debug, Default)]
pub(crate) struct ServerClock {
    anchor: Mutex<Option<Anchor>>,
}

#[derive(Clone, Copy, Debug)]
struct Anchor {
    at: Instant,
    /// The server's time at `at`, in ms since the epoch.
    server_ms: u64,
    /// False: the server could not be asked, the local clock stands in.
    asked: bool,
}

impl ServerClock {
    /// The server's time now in ms since the epoch; `ask` reads the
    /// server's `TIME` (seconds, microseconds) when no reading is at hand.
    ///
    /// # Errors
    ///
    /// What `ask` failed with when the server could not be reached
    /// ([`Error::is_connection`]): the acquisition that needs the time
    /// would meet the same, and failing before it sends anything keeps
    /// Redis unchanged; `ask` takes at most one connect's wait, so with
    /// the attempt after it the call keeps its bound (one connect and one
    /// resend window past its wait). When the server answers but refuses `TIME`
    /// (renamed away, an ACL), the local wall clock stands in, and the
    /// server is asked again a minute later.
    pub(crate) fn now_ms(
        &self,
        ask: impl FnOnce() -> Result<(u64, u64), Error>,
    ) -> Result<u64, Error> {
        let now = Instant::now();
        let known = *self.anchor.lock();
        if let Some(a) = known
            && (a.asked || now.duration_since(a.at) < RETRY_TIME_AFTER)
        {
            return Ok(since(a, now));
        }
        let sent = Instant::now();
        let anchor = match ask() {
            Ok((secs, micros)) => {
                let received = Instant::now();
                // The reply was made somewhere between sending and
                // receiving: take the middle.
                let half = received.duration_since(sent) / 2;
                let server = secs.saturating_mul(1000).saturating_add(micros / 1000);
                Anchor {
                    at: received,
                    server_ms: server.saturating_add(millis(half)),
                    asked: true,
                }
            }
            Err(err) if err.is_connection() => return Err(err),
            Err(err) => {
                log::debug!(
                    "redmutex: the server refuses TIME ({err}); holder metadata uses the \
                     local clock for now"
                );
                Anchor {
                    at: Instant::now(),
                    server_ms: local_ms(),
                    asked: false,
                }
            }
        };
        *self.anchor.lock() = Some(anchor);
        Ok(since(anchor, Instant::now()))
    }
}

/// The local wall clock, in ms since the epoch.
pub(crate) fn local_ms() -> u64 {
    millis(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default(),
    )
}

fn since(anchor: Anchor, now: Instant) -> u64 {
    anchor
        .server_ms
        .saturating_add(millis(now.saturating_duration_since(anchor.at)))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_carries_its_holder_and_splits_into_six_fields() {
        let id = Identity::new(true, Some("reindex"), Some("nightly")).expect("valid");
        let token = id.token(1_795_000_000_123);
        assert_eq!(token.split('|').count(), 6, "{token}");
        assert!(!token.chars().any(char::is_whitespace));
        let holder = Holder::from_token(&token).expect("metadata");
        assert_eq!(holder.program, "reindex");
        assert_eq!(holder.label.as_deref(), Some("nightly"));
        assert_eq!(holder.pid, std::process::id());
        assert_eq!(holder.host, *HOST);
        assert_eq!(
            holder.acquired_at,
            UNIX_EPOCH + Duration::from_millis(1_795_000_000_123)
        );
        let meta = &token[token.find('|').expect("a separator")..];
        assert_eq!(Holder::from_meta(meta), Some(holder));
        let plain = Identity::new(true, None, None).expect("defaults").token(5);
        assert_eq!(
            Holder::from_token(&plain).expect("metadata").label,
            None,
            "no label"
        );
    }

    #[test]
    fn base64url_matches_rfc_4648() {
        for (bytes, text) in [
            (&b""[..], ""),
            (b"f", "Zg"),
            (b"fo", "Zm8"),
            (b"foo", "Zm9v"),
            (b"foob", "Zm9vYg"),
            (b"\xfb\xff", "-_8"),
        ] {
            let mut out = String::new();
            push_base64url(bytes, &mut out);
            assert_eq!(out, text, "{bytes:?}");
        }
        let token = Identity::new(true, None, None).expect("on").token(5);
        let secret = token.split('|').next().expect("a secret");
        assert_eq!(secret.len(), 22, "{token}");
        // Unmasked, one token in 64 would start with `-`.
        let identity = Identity::new(true, None, None).expect("on");
        for _ in 0..1024 {
            let token = identity.token(5);
            assert!(!token.starts_with('-'), "{token}");
        }
        assert!(
            secret
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        );
    }

    #[test]
    fn tokens_without_metadata_have_no_holder() {
        let bare = Identity::new(false, None, None).expect("off").token(5);
        assert_eq!(bare.len(), 36);
        assert_eq!(Holder::from_token(&bare), None);
        for odd in [
            "",
            "|h|1|p|5|",
            "s|h|x|p|5|",
            "s|h|1|p|x|",
            "s|h|1|p|5",
            "s|h|1|p|5|l|more",
        ] {
            assert_eq!(Holder::from_token(odd), None, "{odd:?}");
        }
        assert_eq!(Holder::from_meta("h|1|p|5|l"), None, "no leading |");
    }

    #[test]
    fn only_what_a_writer_makes_is_a_holder() {
        assert!(Holder::from_token("s|h|1|p|253402300799999|").is_some());
        for odd in [
            "s|h|1|p|253402300800000|",
            "s|h|1|p|18446744073709551615|",
            "s|h|1|p|99999999999999999999999|",
            "s||1|p|5|",
            "s|h|1||5|",
            "s|h\u{1b}[2J|1|p|5|",
            "s|h|1|p q|5|",
            "s|h|1|p|5|l\n",
            "s|h|4294967296|p|5|",
            "s|h|-1|p|5|",
        ] {
            assert_eq!(Holder::from_token(odd), None, "{odd:?}");
            assert_eq!(redact(odd), "…", "{odd:?}");
        }
        let long = format!("s|{}|1|p|5|", "h".repeat(MAX_FIELD + 1));
        assert_eq!(Holder::from_token(&long), None);
    }

    proptest::proptest! {
        /// Whatever Redis hands back, reading it never panics, a holder
        /// read from it shows and formats, and the secret never shows.
        #[test]
        fn any_value_reads_without_panic(value in ".{0,200}", secret in "[A-Za-z0-9_-]{8,22}") {
            let token = format!("{secret}|{value}");
            if let Some(holder) = Holder::from_token(&token) {
                let _ = holder.to_string();
                proptest::prop_assert!(holder.acquired_at <= UNIX_EPOCH + Duration::from_millis(MAX_AT_MS));
            }
            let _ = Holder::from_meta(&value);
            let shown = redact(&token);
            proptest::prop_assert!(!shown.contains(&secret) || value.contains(&secret));
            proptest::prop_assert!(shown.starts_with('…'));
        }

        #[test]
        fn numbers_at_the_edges_read_without_panic(pid in proptest::num::u64::ANY, at in proptest::num::u64::ANY) {
            let token = format!("s|h|{pid}|p|{at}|l");
            match Holder::from_token(&token) {
                Some(holder) => {
                    proptest::prop_assert!(pid <= u64::from(u32::MAX) && at <= MAX_AT_MS);
                    proptest::prop_assert_eq!(u64::from(holder.pid), pid);
                }
                None => proptest::prop_assert!(pid > u64::from(u32::MAX) || at > MAX_AT_MS),
            }
        }
    }

    #[test]
    fn bad_labels_are_refused_and_system_names_made_fit() {
        for bad in ["", "a|b", "two words", "tab\t", "nl\n", &"x".repeat(65)] {
            assert!(
                matches!(
                    Identity::new(true, None, Some(bad)),
                    Err(Error::InvalidArgument(_))
                ),
                "{bad:?}"
            );
        }
        assert!(Identity::new(true, None, Some(&"é".repeat(32))).is_ok());
        assert_eq!(fit("web 3|x\n"), "web_3_x_");
        let odd = Identity::new(true, Some("my job|1"), None).expect("made fit");
        assert_eq!(odd.program().as_deref(), Some("my_job_1"));
        assert_eq!(fit(""), "-");
        assert_eq!(fit(&"é".repeat(40)).len(), 64);
    }

    #[test]
    fn the_server_clock_is_asked_once_and_carried_forward() {
        let clock = ServerClock::default();
        let mut asked = 0;
        let first = clock
            .now_ms(|| {
                asked += 1;
                Ok((1_000, 500_000))
            })
            .expect("read");
        assert!((1_000_500..1_010_000).contains(&first), "{first}");
        let second = clock
            .now_ms(|| {
                asked += 1;
                Ok((9, 0))
            })
            .expect("carried forward");
        assert_eq!(asked, 1, "one TIME per client");
        assert!(second >= first && second < 1_010_000, "{second}");
    }

    #[test]
    fn a_server_that_refuses_time_leaves_the_local_clock() {
        let clock = ServerClock::default();
        let local = local_ms();
        let refused = redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            "unknown command",
        ));
        let got = clock
            .now_ms(|| Err(Error::Redis(refused)))
            .expect("the local clock");
        assert!(got >= local && got < local + 60_000, "{got} vs {local}");
        let mut asked = false;
        let _ = clock.now_ms(|| {
            asked = true;
            Ok((1, 0))
        });
        assert!(!asked, "not asked again within a minute");
    }

    #[test]
    fn an_unreachable_server_fails_the_acquisition_before_it_sends() {
        let clock = ServerClock::default();
        let io = redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        let err = clock
            .now_ms(|| Err(Error::Redis(io)))
            .expect_err("unreachable");
        assert!(err.is_connection(), "{err}");
        let mut asked = false;
        let _ = clock.now_ms(|| {
            asked = true;
            Ok((1, 0))
        });
        assert!(asked, "asked again at the next acquisition");
    }
}
