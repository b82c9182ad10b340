//! TLS end to end against a real redis-server with a TLS port: the pool,
//! the watchdog and the subscriber over `rediss://`, mutual TLS, ACL
//! logins, and every way a handshake is refused that the error tells apart
//! (the server's certificate: unknown CA, expired, not yet valid, another
//! name, a CA's, not for a server; ours, as the server's alert judges it:
//! none, another CA's, expired, not yet valid, not for a client; nothing in
//! common; the wrong scheme for the port; a server that never answers),
//! each on a fresh server and client, a clear error naming the cause and
//! the fix within the call's bound. Certificates are made at test time
//! (`support::tls`).
#![cfg(feature = "tls-rustls")]

use redmutex_test_support as support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use redis::Commands;
use redmutex::Lease;
use redmutex::{Backoff, DistributedLock, LockClient, LockOptions};
use support::tls::TlsServer;
use support::{FaultProxy, wait_until};

const ROLE: &str = "REDMUTEX_TEST_ROLE";
const URL: &str = "REDMUTEX_TEST_URL";
const CA: &str = "REDMUTEX_TEST_CA";

/// Subscribers of a key's release channel (no hash tag, no prefix).
fn subscribers(server: &TlsServer, key: &str) -> u64 {
    let reply: (String, u64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(format!("redmutex:released:{{{key}}}"))
        .query(&mut server.server.conn())
        .expect("PUBSUB NUMSUB");
    reply.1
}

/// Lets a waiter whose subscription is confirmed make its attempt after
/// subscribing and go to sleep, so the release reaches it by message.
fn let_the_waiter_settle() {
    std::thread::sleep(Duration::from_millis(200));
}

/// Acquired within `WOKEN` of the release by a waiter whose backoff step
/// is 10 s: only the release message explains it (or, on a machine so
/// slow the waiter had not yet made its attempt after subscribing, that
/// attempt).
const WOKEN: Duration = Duration::from_secs(2);

/// A waiter of `waiter` (a 10 s backoff step) queues for `key`; once
/// `subscribed()` says its subscription is live, `guard` is released and
/// the waiter must have the lock within [`WOKEN`]: by the message.
fn assert_woken_by_the_release(
    guard: redmutex::LockGuard,
    waiter: LockClient,
    key: &'static str,
    mut subscribed: impl FnMut() -> bool,
) {
    let options = LockOptions::default()
        .backoff(Backoff::constant(Duration::from_secs(10)))
        .wait(Duration::from_secs(20));
    let waiting = std::thread::spawn(move || {
        let acquired = DistributedLock::with_options(&waiter, key, options)
            .lock()
            .map(|g| g.unlock());
        (acquired.is_ok(), Instant::now())
    });
    assert!(
        wait_until(Duration::from_secs(10), &mut subscribed),
        "the waiter never subscribed"
    );
    let_the_waiter_settle();
    let released = Instant::now();
    guard.unlock().expect("unlock");
    let (acquired, at) = waiting.join().expect("waiter");
    assert!(acquired);
    assert!(
        at.duration_since(released) < WOKEN,
        "not woken by the message"
    );
}

/// The I/O timeout of the clients that meet a refusal.
const TIMEOUT: Duration = Duration::from_millis(500);

fn short(builder: redmutex::LockClientBuilder) -> LockClient {
    builder
        .timeout(TIMEOUT)
        .build()
        .expect("build a TLS client")
}

/// The bound of a call that cannot connect: one connect and the resend
/// window of three I/O timeouts (its wait is none: `try_lock`).
const REFUSED_WITHIN: Duration = Duration::from_millis(4 * 500);

/// A fresh client of `builder` is refused: `try_lock` fails within its
/// bound, as a connection error, sets nothing, and its message holds each
/// of `phrases` (the cause and the fix) and no key material. Returns the
/// message.
fn refused(server: &TlsServer, builder: redmutex::LockClientBuilder, phrases: &[&str]) -> String {
    let client = short(builder);
    let started = Instant::now();
    let err = DistributedLock::new(&client, "tls-refused")
        .try_lock()
        .expect_err("the handshake is refused");
    let took = started.elapsed();
    let text = err.to_string();
    eprintln!("error: {text}");
    assert!(err.is_connection(), "{err:?}");
    assert!(took < REFUSED_WITHIN, "took {took:?}: {text}");
    for phrase in phrases {
        assert!(text.contains(phrase), "no {phrase:?} in: {text}");
    }
    assert!(!text.contains("PRIVATE KEY"), "{text}");
    assert!(!support::exists(&server.server, "tls-refused"));
    text
}

#[test]
fn lock_and_unlock_over_tls() {
    let server = TlsServer::start(false);
    let client = server.builder().build().expect("TLS client");
    let guard = DistributedLock::new(&client, "tls-plain")
        .lock()
        .expect("lock over TLS");
    let held: Option<String> = server.server.conn().get("tls-plain").expect("GET");
    assert_eq!(held.as_deref(), Some(guard.token()));
    assert!(guard.is_held().expect("is_held over TLS"));
    guard.unlock().expect("unlock over TLS");
    assert!(!support::exists(&server.server, "tls-plain"));
    // Dropped guards are released too (written behind on the TLS link).
    drop(
        DistributedLock::new(&client, "tls-plain")
            .lock()
            .expect("again"),
    );
    let lock = DistributedLock::new(&client, "tls-plain");
    lock.lock()
        .expect("the dropped guard was released")
        .unlock()
        .expect("unlock");
}

#[test]
fn insecure_urls_skip_the_certificate_check() {
    let server = TlsServer::start(false);
    let url = format!("rediss://127.0.0.1:{}/#insecure", server.tls_port);
    let client = LockClient::open(&url).expect("an #insecure client");
    DistributedLock::new(&client, "tls-insecure")
        .lock()
        .expect("lock with #insecure")
        .unlock()
        .expect("unlock");
}

#[test]
fn a_waiter_in_another_process_wakes_on_the_release_message_over_tls() {
    if std::env::var(ROLE).as_deref() == Ok("waiter") {
        let url = std::env::var(URL).expect("url");
        let ca = std::env::var(CA).expect("ca");
        let client = LockClient::builder()
            .url(url)
            .tls_ca_file(ca)
            .build()
            .expect("client");
        // Only a release message explains a prompt acquisition.
        let options = LockOptions::default()
            .backoff(Backoff::constant(Duration::from_secs(10)))
            .wait(Duration::from_secs(30));
        let guard = DistributedLock::with_options(&client, "tls-wake", options)
            .lock()
            .expect("lock");
        println!("ACQUIRED {}", guard.token());
        guard.unlock().expect("unlock");
        return;
    }
    let server = TlsServer::start(false);
    let holder = server.builder().build().expect("holder");
    let guard = DistributedLock::new(&holder, "tls-wake")
        .lock()
        .expect("lock");
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "a_waiter_in_another_process_wakes_on_the_release_message_over_tls",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, "waiter")
        .env(URL, server.url())
        .env(CA, server.pki.ca())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the waiter");
    let stdout = child.stdout.take().expect("stdout");
    // Subscribed over TLS: the subscriber connection speaks TLS.
    assert!(
        wait_until(Duration::from_secs(10), || subscribers(&server, "tls-wake")
            >= 1),
        "the waiter's subscriber connection never subscribed over TLS"
    );
    let_the_waiter_settle();
    let released = Instant::now();
    guard.unlock().expect("unlock");
    let mut seen = None;
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        if seen.is_none() && line.contains("ACQUIRED ") {
            seen = Some((line, released.elapsed()));
        }
    }
    let (line, lag) = seen.expect("the waiter acquired");
    assert!(child.wait().expect("reap").success());
    // Its backoff is 10 s: only the message (or, had the release landed
    // between its subscription and its next attempt, that attempt) explains
    // this.
    assert!(line.contains('|'), "{line}");
    assert!(lag < WOKEN, "woke {lag:?} after the release");
}

#[test]
fn the_watchdog_renews_over_tls() {
    let server = TlsServer::start(false);
    let client = server.builder().build().expect("client");
    let options = LockOptions::default()
        .ttl(Duration::from_millis(400))
        .watchdog(true);
    let guard = DistributedLock::with_options(&client, "tls-dog", options)
        .lock()
        .expect("lock");
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(1_200) {
        let held: Option<String> = server.server.conn().get("tls-dog").expect("GET");
        assert_eq!(held.as_deref(), Some(guard.token()), "renewed past its ttl");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(client.stats().renewals >= 2, "{:?}", client.stats());
    assert!(!guard.is_lost());
    guard.unlock().expect("unlock");
}

#[test]
fn a_server_certificate_from_an_unknown_ca_asks_for_the_ca() {
    let server = TlsServer::start(false);
    refused(
        &server,
        LockClient::builder()
            .url(server.url())
            .tls_ca_file(server.pki.other_ca()),
        &[
            "signed by a CA this client does not trust",
            "tls_ca_file, --tls-ca",
        ],
    );
}

/// The subscriber fails the same way as the pool and the client still goes
/// at once.
#[test]
fn a_client_refused_by_tls_is_dropped_at_once() {
    let server = TlsServer::start(false);
    let client = short(
        LockClient::builder()
            .url(server.url())
            .tls_ca_file(server.pki.other_ca()),
    );
    let _ = DistributedLock::new(&client, "tls-drop").try_lock();
    let dropped = Instant::now();
    drop(client);
    assert!(dropped.elapsed() < Duration::from_secs(3));
}

#[test]
fn an_expired_server_certificate_says_when_and_to_renew_it() {
    let server = TlsServer::start_with("expired-server", false, &[]);
    refused(
        &server,
        server.builder(),
        &[
            "the server's certificate expired at 2001-01-01 00:00:00 UTC",
            "this machine's clock says",
            "renew it on the server",
        ],
    );
}

#[test]
fn a_server_certificate_not_yet_valid_points_at_the_clocks() {
    let server = TlsServer::start_with("future-server", false, &[]);
    refused(
        &server,
        server.builder(),
        &[
            "the server's certificate is not valid before 2090-01-01 00:00:00 UTC",
            "set this machine's clock right",
        ],
    );
}

/// The certificate names `redis.example.com` and `192.0.2.7`; the client
/// dials 127.0.0.1, and is told which names to dial instead.
#[test]
fn a_server_certificate_for_another_name_lists_the_names_it_holds() {
    let server = TlsServer::start_with("wrong-name-server", false, &[]);
    refused(
        &server,
        server.builder(),
        &[
            "not valid for 127.0.0.1, the host dialled",
            "it names redis.example.com, 192.0.2.7",
            "dial one of those",
        ],
    );
}

#[test]
fn a_server_certificate_not_meant_for_a_server_says_so() {
    let server = TlsServer::start_with("client-only-server", false, &[]);
    refused(
        &server,
        server.builder(),
        &["not meant for a server", "serverAuth"],
    );
}

/// A self-signed server certificate marked `CA:TRUE` (what `openssl req
/// -x509` makes), given as the CA: TLS refuses a CA certificate as a
/// server's own whatever the client trusts, and the error says so and
/// what to do, instead of asking for the CA the user already gave. The
/// same server with a certificate that CA signed is accepted.
#[test]
fn a_ca_certificate_used_as_the_servers_own_is_explained() {
    let server = TlsServer::start_self_signed_ca();
    let text = refused(
        &server,
        LockClient::builder()
            .url(server.url())
            .tls_ca_file(server.pki.self_signed_ca()),
        &["presents a CA certificate", "signed by that CA"],
    );
    assert!(!text.contains("give the CA"), "{text}");

    let signed = TlsServer::start(false);
    let client = short(signed.builder());
    DistributedLock::new(&client, "tls-signed")
        .try_lock()
        .expect("a server certificate signed by the CA")
        .expect("free")
        .unlock()
        .expect("unlock");
}

#[test]
fn a_plain_url_on_the_tls_port_and_the_reverse_are_clear_errors() {
    let server = TlsServer::start(false);
    let plain_on_tls =
        short(LockClient::builder().url(format!("redis://127.0.0.1:{}/", server.tls_port)));
    let started = Instant::now();
    let err = DistributedLock::new(&plain_on_tls, "tls-scheme")
        .try_lock()
        .expect_err("plain text to a TLS port");
    assert!(started.elapsed() < REFUSED_WITHIN);
    let text = err.to_string();
    eprintln!("error: {text}");
    assert!(
        text.contains("if this port speaks TLS, use a rediss:// URL"),
        "the error points at TLS: {text}"
    );

    let tls_on_plain = short(
        LockClient::builder()
            .url(format!("rediss://127.0.0.1:{}/", server.server.port()))
            .tls_ca_file(server.pki.ca()),
    );
    let started = Instant::now();
    let err = DistributedLock::new(&tls_on_plain, "tls-scheme")
        .try_lock()
        .expect_err("TLS to a plain port");
    assert!(started.elapsed() < REFUSED_WITHIN);
    let text = err.to_string();
    eprintln!("error: {text}");
    assert!(
        text.contains("if this port speaks plain text, use a redis:// URL"),
        "the error points at plain text: {text}"
    );
    assert!(!support::exists(&server.server, "tls-scheme"));
}

#[test]
fn mutual_tls_needs_the_client_certificate() {
    let server = TlsServer::start(true);
    refused(
        &server,
        server.builder(),
        &[
            "the server requires a client certificate and this client sent none",
            "tls_client_cert_files, --tls-cert and --tls-key",
        ],
    );

    let with = server.builder_with_cert().build().expect("client");
    let guard = DistributedLock::new(&with, "tls-mutual")
        .lock()
        .expect("lock with a client certificate");
    // A second client with the certificate waits by notification.
    let waiter = server.builder_with_cert().build().expect("waiter");
    assert_woken_by_the_release(guard, waiter, "tls-mutual", || {
        subscribers(&server, "tls-mutual") >= 1
    });
}

/// A mutual-TLS server refuses the client's certificate `name`
/// ([`support::tls::Pki::client_pair`]) with an alert that says why.
fn client_certificate_refused(name: &str, phrases: &[&str]) {
    let server = TlsServer::start(true);
    let (cert, key) = server.pki.client_pair(name);
    refused(
        &server,
        server.builder().tls_client_cert_files(cert, key),
        phrases,
    );
}

#[test]
fn a_client_certificate_from_another_ca_is_refused_as_unknown_ca() {
    client_certificate_refused(
        "other-ca-client",
        &[
            "refused this client's certificate: no CA it trusts signed it (unknown_ca)",
            "tls-ca-cert-file",
            "--tls-cert",
        ],
    );
}

#[test]
fn an_expired_client_certificate_is_refused_as_expired() {
    client_certificate_refused(
        "expired-client",
        &[
            "refused this client's certificate as expired (certificate_expired)",
            "renew it",
            "--tls-cert",
        ],
    );
}

/// OpenSSL's alert for a client certificate not valid yet is the generic
/// bad_certificate: the message says what that covers.
#[test]
fn a_client_certificate_not_yet_valid_is_refused_as_bad() {
    client_certificate_refused(
        "future-client",
        &[
            "refused this client's certificate (bad_certificate: not valid yet",
            "clocks",
            "--tls-cert",
        ],
    );
}

#[test]
fn a_client_certificate_not_meant_for_a_client_is_refused_as_unsupported() {
    client_certificate_refused(
        "server-only-client",
        &[
            "not meant for a client (unsupported_certificate",
            "clientAuth",
            "--tls-cert",
        ],
    );
}

/// A server limited to TLS 1.2 with CBC ciphers, or to TLS 1.3 with CCM
/// suites: nothing rustls offers. OpenSSL says handshake_failure, as it
/// does to a TLS 1.2 client without the certificate it requires, so the
/// message names both.
#[test]
fn no_cipher_suite_in_common_names_the_server_settings() {
    for extra in [
        [
            "--tls-protocols",
            "TLSv1.2",
            "--tls-ciphers",
            "ECDHE-ECDSA-AES128-SHA",
        ],
        [
            "--tls-protocols",
            "TLSv1.3",
            "--tls-ciphersuites",
            "TLS_AES_128_CCM_SHA256",
        ],
    ] {
        let server = TlsServer::start_with("server", false, &extra);
        refused(
            &server,
            server.builder(),
            &[
                "no cipher suite in common",
                "tls-ciphers or tls-ciphersuites",
                "over TLS 1.2, it requires a client certificate",
            ],
        );
    }
}

/// TLS 1.2 has no certificate_required alert: OpenSSL refuses a client
/// without the certificate it requires with handshake_failure, and the
/// message names that cause beside the ciphers.
#[test]
fn a_tls12_server_requiring_a_client_certificate_is_named_too() {
    let server = TlsServer::start_with("server", true, &["--tls-protocols", "TLSv1.2"]);
    refused(
        &server,
        server.builder(),
        &[
            "over TLS 1.2, it requires a client certificate and got none",
            "tls_client_cert_files, --tls-cert and --tls-key",
        ],
    );
}

#[test]
fn no_protocol_version_in_common_names_tls_protocols() {
    let server = TlsServer::start_with("server", false, &["--tls-protocols", "TLSv1.1"]);
    refused(
        &server,
        server.builder(),
        &["no TLS version in common", "tls-protocols"],
    );
}

/// The same refusals through a Sentinel (the sentinel's connection) and a
/// Cluster seed (a node's connection): each path that opens a connection
/// names the cause. The servers are plain TLS servers: the refusal comes
/// before any Sentinel or Cluster command.
#[test]
fn sentinel_and_cluster_connections_name_the_cause_too() {
    let server = TlsServer::start_with("expired-server", false, &[]);
    refused(
        &server,
        LockClient::builder()
            .sentinel([server.url()], "redmutex-tls-primary")
            .tls_ca_file(server.pki.ca()),
        &["the server's certificate expired", "renew it on the server"],
    );
    let server = TlsServer::start(false);
    refused(
        &server,
        LockClient::builder()
            .cluster([server.url()])
            .tls_ca_file(server.pki.other_ca()),
        &[
            "signed by a CA this client does not trust",
            "tls_ca_file, --tls-ca",
        ],
    );
}

/// Every log record of this crate in this test binary (not rustls's own).
struct Captured(std::sync::Mutex<Vec<String>>);

impl log::Log for Captured {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.target().starts_with("redmutex")
    }
    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        if let Ok(mut lines) = self.0.lock() {
            lines.push(record.args().to_string());
        }
    }
    fn flush(&self) {}
}

static CAPTURED: Captured = Captured(std::sync::Mutex::new(Vec::new()));

fn captured() -> Vec<String> {
    // Installed once per binary; a second call finds it there.
    if log::set_logger(&CAPTURED).is_ok() {
        log::set_max_level(log::LevelFilter::Trace);
    }
    CAPTURED.0.lock().map(|l| l.clone()).unwrap_or_default()
}

/// The subscriber's own TLS session names the cause as the pool does,
/// in its log line: a certificate refused during the handshake (a
/// `rediss://` notify client trusts the built-in roots, which lack the
/// test CA), and a server's alert after it (a mutual-TLS server and a
/// notify client without a certificate: TLS 1.3 sends the alert after the
/// client's side of the handshake, so the first read meets it). The pool
/// has the right certificates: only the subscriber is refused, and the
/// waiter polls instead.
#[test]
fn the_subscribers_own_tls_names_the_cause_in_its_log() {
    let _ = captured();
    for (mutual, fragment, phrase) in [
        (false, "", "signed by a CA this client does not trust"),
        (
            true,
            "#insecure",
            "the server requires a client certificate and this client sent none",
        ),
    ] {
        let server = TlsServer::start(mutual);
        let notify =
            redis::Client::open(format!("rediss://127.0.0.1:{}/{fragment}", server.tls_port))
                .expect("a notify URL");
        let waiter = short(server.builder_with_cert().notify(false)).with_notify_client(&notify);
        let holder = short(server.builder_with_cert());
        let guard = DistributedLock::new(&holder, "tls-sub-refused")
            .lock()
            .expect("lock");
        let waited = DistributedLock::with_options(
            &waiter,
            "tls-sub-refused",
            LockOptions::default().wait(Duration::from_secs(1)),
        )
        .lock();
        assert!(matches!(waited, Err(ref e) if e.is_timeout()), "{waited:?}");
        let at = format!("subscriber cannot connect: 127.0.0.1:{}: ", server.tls_port);
        let mut lines = Vec::new();
        assert!(
            wait_until(Duration::from_secs(10), || {
                lines = captured();
                lines.iter().any(|l| l.contains(&at) && l.contains(phrase))
            }),
            "no {phrase:?} after {at:?} in the log: {lines:#?}"
        );
        guard.unlock().expect("unlock");
    }
}

#[test]
fn a_server_that_never_answers_the_handshake_fails_within_the_timeout() {
    let server = TlsServer::start(false);
    let proxy = FaultProxy::start(server.tls_port);
    proxy.swallow_new(true);
    let client = short(
        LockClient::builder()
            .url(format!("rediss://127.0.0.1:{}/", proxy.port()))
            .tls_ca_file(server.pki.ca()),
    );
    let started = Instant::now();
    let err = DistributedLock::new(&client, "tls-silent")
        .try_lock()
        .expect_err("no handshake answer");
    assert!(err.is_connection() || err.is_timeout(), "{err:?}");
    // Within the timeout (one connect's wait), and a slack below it.
    let (took, limit) = (started.elapsed(), TIMEOUT + Duration::from_millis(300));
    eprintln!("bound | a silent TLS handshake: the error | {took:?} | limit {limit:?}");
    assert!(took < limit, "{took:?}");
    let dropped = Instant::now();
    drop(client);
    assert!(dropped.elapsed() < Duration::from_secs(3));
}

#[test]
fn an_acl_user_logs_in_over_tls_from_the_builder() {
    let server = TlsServer::start(false);
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "app", "on", ">s3cret", "~*", "&*", "+@all"][..])
        .query(&mut server.server.conn())
        .expect("ACL SETUSER");
    let client = server
        .builder()
        .username("app")
        .password("s3cret")
        .build()
        .expect("client");
    assert!(!format!("{client:?}").contains("s3cret"));
    DistributedLock::new(&client, "tls-acl")
        .lock()
        .expect("lock as app")
        .unlock()
        .expect("unlock");
    let no_password = server.builder().username("app").build();
    assert!(
        matches!(no_password, Err(redmutex::Error::InvalidArgument(ref m)) if m.contains("password")),
        "a username alone would be dropped silently"
    );
    let wrong = short(server.builder().username("app").password("nope"));
    let err = DistributedLock::new(&wrong, "tls-acl")
        .try_lock()
        .expect_err("a wrong password");
    assert!(err.to_string().to_lowercase().contains("pass"), "{err}");
}

#[test]
fn tls_settings_are_checked_when_the_client_is_built() {
    let server = TlsServer::start(false);
    let missing = LockClient::builder()
        .url(server.url())
        .tls_ca_file(server.pki.path("missing.pem"))
        .build();
    assert!(
        matches!(missing, Err(redmutex::Error::InvalidArgument(ref m)) if m.contains("missing.pem"))
    );
    let not_pem = LockClient::builder()
        .url(server.url())
        .tls_ca_pem("not a certificate")
        .build();
    assert!(matches!(not_pem, Err(redmutex::Error::InvalidArgument(_))));
    let plain_with_ca = LockClient::builder()
        .url(server.server.url())
        .tls_ca_file(server.pki.ca())
        .build();
    assert!(
        matches!(plain_with_ca, Err(redmutex::Error::InvalidArgument(ref m)) if m.contains("rediss://"))
    );
    let key_without_cert = LockClient::builder()
        .url(server.url())
        .tls_client_cert_files(server.pki.client_key(), server.pki.client_key())
        .build();
    assert!(matches!(
        key_without_cert,
        Err(redmutex::Error::InvalidArgument(_))
    ));
}

/// The `redmutex` command over TLS: flags, then the same through the
/// `REDMUTEX_TLS_*` environment, with mutual TLS and an ACL login.
#[cfg(feature = "cli")]
#[test]
fn the_cli_speaks_tls_with_flags_and_environment() {
    use assert_cmd::cargo::CommandCargoExt;
    let server = TlsServer::start(true);
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "ops", "on", ">pw", "~*", "&*", "+@all"][..])
        .query(&mut server.server.conn())
        .expect("ACL SETUSER");
    let redmutex = || {
        let mut command = Command::cargo_bin("redmutex").expect("the redmutex binary");
        command
            .env_remove("REDMUTEX_URL")
            .env_remove("REDMUTEX_PASSWORD");
        command
    };
    let path = |p: std::path::PathBuf| p.display().to_string();
    let flags = redmutex()
        .args(["--url", &server.url(), "--tls-ca", &path(server.pki.ca())])
        .args(["--tls-cert", &path(server.pki.client_cert())])
        .args(["--tls-key", &path(server.pki.client_key())])
        .args(["run", "--no-wait", "tls-cli", "--", "true"])
        .output()
        .expect("run over TLS");
    assert!(
        flags.status.success(),
        "{}",
        String::from_utf8_lossy(&flags.stderr)
    );
    let env = redmutex()
        .env("REDMUTEX_URL", server.url())
        .env("REDMUTEX_TLS_CA", server.pki.ca())
        .env("REDMUTEX_TLS_CERT", server.pki.client_cert())
        .env("REDMUTEX_TLS_KEY", server.pki.client_key())
        .env("REDMUTEX_USER", "ops")
        .env("REDMUTEX_PASSWORD", "pw")
        .args(["status", "tls-cli", "--json"])
        .output()
        .expect("status over TLS");
    assert!(
        env.status.success(),
        "{}",
        String::from_utf8_lossy(&env.stderr)
    );
    assert!(String::from_utf8_lossy(&env.stdout).contains("\"held\":false"));
    // A wrong CA: one line naming the certificate, the "unavailable" code.
    let wrong = redmutex()
        .args([
            "--url",
            &server.url(),
            "--tls-ca",
            &path(server.pki.other_ca()),
        ])
        .args(["status", "tls-cli"])
        .output()
        .expect("status with a wrong CA");
    let stderr = String::from_utf8_lossy(&wrong.stderr);
    assert_eq!(wrong.status.code(), Some(69), "{stderr}");
    assert!(
        stderr.contains("signed by a CA this client does not trust") && stderr.contains("--tls-ca"),
        "{stderr}"
    );
    // The password never shows on the command line nor in errors.
    let refused = redmutex()
        .env("REDMUTEX_URL", server.url())
        .env("REDMUTEX_TLS_CA", server.pki.ca())
        .env("REDMUTEX_TLS_CERT", server.pki.client_cert())
        .env("REDMUTEX_TLS_KEY", server.pki.client_key())
        .env("REDMUTEX_USER", "ops")
        .env("REDMUTEX_PASSWORD", "not-the-password")
        .args(["status", "tls-cli"])
        .output()
        .expect("status with a wrong password");
    assert!(!refused.status.success());
    assert!(!String::from_utf8_lossy(&refused.stderr).contains("not-the-password"));
}

/// The command names each refusal with its fix on one line and exits 69
/// ("Redis unreachable or failing"), the command not run; a CA file that
/// cannot be read is bad usage (2), before anything is sent. Each case on
/// a fresh server.
#[cfg(feature = "cli")]
#[test]
fn the_cli_names_a_tls_refusal_and_its_fix() {
    use assert_cmd::cargo::CommandCargoExt;
    let path = |p: std::path::PathBuf| p.display().to_string();
    let redmutex = |server: &TlsServer, flags: &[String], args: &[&str]| {
        let started = Instant::now();
        let output = Command::cargo_bin("redmutex")
            .expect("the redmutex binary")
            .env_remove("REDMUTEX_URL")
            .env_remove("REDMUTEX_PASSWORD")
            .args(["--url", &server.url()])
            .args(flags)
            .args(args)
            .output()
            .expect("run redmutex");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        eprintln!("stderr: {stderr}");
        (output.status.code(), stderr)
    };

    let expired = TlsServer::start_with("expired-server", false, &[]);
    let marker = expired.pki.path("ran");
    let (code, stderr) = redmutex(
        &expired,
        &["--tls-ca".into(), path(expired.pki.ca())],
        &[
            "run",
            "--no-wait",
            "tls-cli",
            "--",
            "touch",
            &path(marker.clone()),
        ],
    );
    assert_eq!(code, Some(69), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("the server's certificate expired at 2001-01-01")
            && stderr.contains("renew it on the server"),
        "{stderr}"
    );
    assert!(!marker.exists(), "the command ran");

    let mutual = TlsServer::start(true);
    let (cert, key) = mutual.pki.client_pair("other-ca-client");
    let (code, stderr) = redmutex(
        &mutual,
        &[
            "--tls-ca".into(),
            path(mutual.pki.ca()),
            "--tls-cert".into(),
            path(cert),
            "--tls-key".into(),
            path(key),
        ],
        &["status", "tls-cli"],
    );
    assert_eq!(code, Some(69), "{stderr}");
    assert!(
        stderr.contains("no CA it trusts signed it") && stderr.contains("--tls-cert"),
        "{stderr}"
    );
    assert!(!stderr.contains("PRIVATE KEY"), "{stderr}");

    let (code, stderr) = redmutex(
        &mutual,
        &["--tls-ca".into(), path(mutual.pki.path("missing.pem"))],
        &["status", "tls-cli"],
    );
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("missing.pem"), "{stderr}");
}

#[test]
fn sentinel_over_tls_finds_the_tls_primary_and_follows_a_failover() {
    let set = support::tls::TlsSentinelSet::start();
    assert_eq!(set.named_port(), Some(set.primary_tls));
    let holder = set.builder().build().expect("holder");
    let waiter = set.builder().build().expect("waiter");
    let guard = DistributedLock::new(&holder, "tls-sentinel")
        .lock()
        .expect("lock through TLS sentinels");
    let held: Option<String> = set.primary.conn().get("tls-sentinel").expect("GET");
    assert_eq!(held.as_deref(), Some(guard.token()));
    // The waiter's subscriber asked the sentinels over TLS, then
    // subscribed on the primary over TLS.
    assert_woken_by_the_release(guard, waiter, "tls-sentinel", || {
        let reply: Option<(String, u64)> = set.primary.try_query(
            redis::cmd("PUBSUB")
                .arg("NUMSUB")
                .arg("redmutex:released:{tls-sentinel}"),
        );
        reply.is_some_and(|r| r.1 >= 1)
    });

    let _: () = set.sentinels[0]
        .try_query(
            redis::cmd("SENTINEL")
                .arg("FAILOVER")
                .arg(support::tls::TlsSentinelSet::MASTER),
        )
        .expect("SENTINEL FAILOVER");
    assert!(
        wait_until(Duration::from_secs(60), || {
            set.named_port().is_some_and(|p| p != set.primary_tls)
                && set.primary.role().as_deref() == Some("slave")
        }),
        "no failover"
    );
    let after = DistributedLock::with_options(
        &holder,
        "tls-sentinel",
        LockOptions::default().wait(Duration::from_secs(20)),
    )
    .lock()
    .expect("lock on the promoted replica, over TLS");
    let held: Option<String> = set.replica.conn().get("tls-sentinel").expect("GET");
    assert_eq!(held.as_deref(), Some(after.token()));
    after.unlock().expect("unlock");
}

#[test]
fn a_cluster_over_tls_locks_on_every_primary_and_notifies() {
    let cluster = support::tls::TlsCluster::start();
    let client = cluster.builder().build().expect("cluster client");
    // Keys on every primary: found through CLUSTER SLOTS asked over TLS.
    let mut primaries = std::collections::HashSet::new();
    for i in 0..30 {
        let key = format!("tls-cluster-{i}");
        let guard = DistributedLock::new(&client, key.as_str())
            .lock()
            .expect("lock on a TLS cluster");
        let node = cluster.node_for(&key).expect("the key's node");
        let held: Option<String> = node.conn().get(&key).expect("GET");
        assert_eq!(held.as_deref(), Some(guard.token()));
        primaries.insert(node.port());
        guard.unlock().expect("unlock");
    }
    assert_eq!(primaries.len(), 3, "keys landed on every primary");
    // `#insecure` on the seed holds for the nodes found through it too.
    let insecure = LockClient::builder()
        .cluster([format!(
            "rediss://127.0.0.1:{}/#insecure",
            cluster.tls_ports[0]
        )])
        .build()
        .expect("an #insecure cluster client");
    for i in 0..30 {
        DistributedLock::new(&insecure, format!("tls-cluster-{i}"))
            .lock()
            .expect("lock on any primary without checking certificates")
            .unlock()
            .expect("unlock");
    }

    let waiter = cluster.builder().build().expect("waiter");
    let guard = DistributedLock::new(&client, "tls-cluster-wake")
        .lock()
        .expect("lock");
    assert_woken_by_the_release(guard, waiter, "tls-cluster-wake", || {
        // Sharded (`SSUBSCRIBE`, on the key's node) on Redis 7.0+.
        cluster.nodes.iter().any(|n| {
            ["SHARDNUMSUB", "NUMSUB"].iter().any(|kind| {
                let reply: Option<(String, u64)> = n.try_query(
                    redis::cmd("PUBSUB")
                        .arg(*kind)
                        .arg("redmutex:released:{tls-cluster-wake}"),
                );
                reply.is_some_and(|r| r.1 >= 1)
            })
        })
    });
}

/// A half-open TLS subscriber link (the proxy holds the socket and forwards
/// nothing): the heartbeat finds it silent within two timeouts, the
/// reconnection's handshake is bounded too, and the waiter asks Redis
/// instead of sleeping its 60 s backoff step.
#[test]
fn a_silent_tls_subscriber_link_is_detected() {
    let server = TlsServer::start(false);
    let proxy = FaultProxy::start(server.tls_port);
    let timeout = Duration::from_millis(500);
    // The pool goes straight to the server; only the subscriber is proxied
    // (a `rediss://` notify client: TLS with `#insecure`).
    let waiter_client = server
        .builder()
        .timeout(timeout)
        .notify(false)
        .build()
        .expect("client")
        .with_notify_client(
            &redis::Client::open(format!("rediss://127.0.0.1:{}/#insecure", proxy.port()))
                .expect("url"),
        );
    let holder = server.builder().build().expect("holder");
    let guard = DistributedLock::new(&holder, "tls-silent-sub")
        .lock()
        .expect("lock");
    let waiting = std::thread::spawn({
        let waiter_client = waiter_client.clone();
        move || {
            DistributedLock::with_options(
                &waiter_client,
                "tls-silent-sub",
                LockOptions::default()
                    .wait(Duration::from_secs(30))
                    .backoff(Backoff::constant(Duration::from_secs(60))),
            )
            .lock()
            .map(|g| g.token().to_owned())
        }
    });
    assert!(
        wait_until(Duration::from_secs(5), || subscribers(
            &server,
            "tls-silent-sub"
        ) == 1),
        "the TLS subscriber never subscribed through the proxy"
    );
    proxy.blackhole(true);
    let released = Instant::now();
    guard.unlock().expect("unlock");
    let got = waiting.join().expect("waiter");
    let waited = released.elapsed();
    assert!(got.is_ok(), "{got:?}");
    // Two timeouts (the link went silent at the subscription, before the
    // blackhole), then a request on the pool; a slack below the timeout.
    let bound = timeout * 2 + Duration::from_millis(300);
    eprintln!("bound | a silent TLS subscriber link | {waited:?} | limit {bound:?}");
    assert!(
        waited < bound,
        "the waiter slept {waited:?} after the release"
    );
    let dropped = Instant::now();
    drop(waiter_client);
    assert!(dropped.elapsed() < Duration::from_secs(3));
}

#[test]
fn a_redlock_over_tls_nodes_takes_a_majority() {
    let nodes: Vec<TlsServer> = (0..3).map(|_| TlsServer::start(false)).collect();
    let clients: Vec<LockClient> = nodes
        .iter()
        .map(|n| n.builder().build().expect("node client"))
        .collect();
    let lock = redmutex::RedLock::new(clients, "tls-redlock").expect("redlock");
    let guard = lock.lock().expect("lock a majority over TLS");
    let holding = nodes
        .iter()
        .filter(|n| support::exists(&n.server, "tls-redlock"))
        .count();
    assert!(holding >= 2, "held on {holding} of 3 TLS nodes");
    guard.unlock().expect("unlock");
    // `unlock()` returns at a majority: the last node's release may still
    // be on its way.
    assert!(
        wait_until(Duration::from_secs(5), || nodes
            .iter()
            .all(|n| !support::exists(&n.server, "tls-redlock"))),
        "released on every node"
    );
}

/// The ids of the connections named `redmutex-subscriber`.
fn subscriber_ids(server: &TlsServer) -> Vec<u64> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut server.server.conn())
        .expect("CLIENT LIST");
    list.lines()
        .filter(|line| line.contains("name=redmutex-subscriber"))
        .filter_map(|line| {
            line.split(' ')
                .find_map(|field| field.strip_prefix("id="))
                .and_then(|id| id.parse().ok())
        })
        .collect()
}

/// The TLS session is shared by the subscriber's reading thread and the
/// waiters writing `SUBSCRIBE`/`UNSUBSCRIBE`: under churn on several keys
/// from two clients, every acquisition is exclusive, waiters are woken by
/// messages, and neither subscriber connection is ever replaced (a
/// corrupted session would end it).
#[test]
fn the_shared_tls_session_survives_subscription_churn() {
    let server = TlsServer::start(false);
    let clients: Vec<LockClient> = (0..2)
        .map(|_| server.builder().build().expect("client"))
        .collect();
    // Each client's subscriber up before the churn starts.
    for (holder, waiter) in [(0, 1), (1, 0)] {
        let guard = DistributedLock::new(&clients[holder], "tls-churn-warm")
            .lock()
            .expect("warm");
        let waiter = clients[waiter].clone();
        let waiting = std::thread::spawn(move || {
            DistributedLock::new(&waiter, "tls-churn-warm")
                .lock()
                .map(|g| g.unlock())
        });
        assert!(wait_until(Duration::from_secs(10), || subscribers(
            &server,
            "tls-churn-warm"
        ) == 1));
        guard.unlock().expect("unlock");
        assert!(waiting.join().expect("warm waiter").is_ok());
    }
    let inside: std::sync::Arc<Vec<std::sync::atomic::AtomicU32>> = std::sync::Arc::new(
        (0..4)
            .map(|_| std::sync::atomic::AtomicU32::new(0))
            .collect(),
    );
    let before = {
        let mut ids = Vec::new();
        assert!(wait_until(Duration::from_secs(10), || {
            ids = subscriber_ids(&server);
            ids.len() == 2
        }));
        ids
    };
    let workers: Vec<_> = (0..8)
        .map(|t| {
            let client = clients[t % 2].clone();
            let inside = inside.clone();
            std::thread::spawn(move || {
                for i in 0..40 {
                    let k = (t + i) % 4;
                    let guard = DistributedLock::new(&client, format!("tls-churn-{k}"))
                        .lock()
                        .expect("lock under churn");
                    let before = inside[k].fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    assert_eq!(before, 0, "two holders of tls-churn-{k}");
                    std::thread::sleep(Duration::from_micros(200));
                    inside[k].fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    guard.unlock().expect("unlock under churn");
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().expect("worker");
    }
    let notified: u64 = clients.iter().map(|c| c.stats().notifications).sum();
    assert!(notified > 0, "no waiter was woken by a message");
    let mut after = subscriber_ids(&server);
    after.sort_unstable();
    let mut before = before;
    before.sort_unstable();
    assert_eq!(before, after, "a subscriber connection was replaced");
}
