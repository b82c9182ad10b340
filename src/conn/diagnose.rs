//! Why a connect failed, when the error tells more than its text says to
//! someone who has not met it before: each way a TLS handshake is refused
//! that rustls tells apart (the server's certificate, the server's alert
//! about ours, nothing in common), and the wrong URL scheme for a port.
//! Every path that opens a connection asks here: the pool's (redis-rs's
//! TLS, for one server, a Sentinel's sentinels and primary, every Cluster
//! node) and the subscriber's own TLS session, so one refusal reads the
//! same wherever it is met.
//!
//! The cause is read from the error's types: the `rustls::Error` inside
//! (redis-rs keeps it, behind an `Arc` and an `io::Error`), else the
//! `io::ErrorKind`. Text is read in one place only, where rustls wraps a
//! webpki error this crate does not depend on (see `server_certificate`).

use std::error::Error as StdError;
use std::io;

/// What to say when rustls refuses the server's certificate as a CA
/// certificate (webpki's `CaUsedAsEndEntity`): a self-signed certificate
/// made with `openssl req -x509` is marked `CA:TRUE`, and TLS does not
/// accept a CA as a server's own, whatever the client trusts.
#[cfg(feature = "tls-rustls")]
const CA_AS_SERVER_CERTIFICATE: &str = "the server presents a CA certificate \
     (CA:TRUE, as `openssl req -x509` makes) as its own, which TLS refuses even when it is \
     the CA given: give the server a certificate signed by that CA (see TLS in the guide's \
     deployments chapter) and keep the CA as tls_ca_file, --tls-ca";

/// Plain text to a TLS port: the server hangs up on the first command.
const PLAIN_TO_TLS: &str =
    "the server closed the connection at once: if this port speaks TLS, use a rediss:// URL";

/// TLS to a plain port: a Redis server reads the handshake as the start
/// of an inline command and waits for the rest of its line.
const TLS_TO_PLAIN: &str =
    "no TLS answer within the timeout: if this port speaks plain text, use a redis:// URL";

/// What a failed connect dialled.
pub(crate) struct Dialled<'a> {
    /// The host as the URL (or a sentinel, or a cluster's slot map) names
    /// it: what the server's certificate must name.
    #[cfg_attr(not(feature = "tls-rustls"), allow(dead_code))]
    pub(crate) host: &'a str,
    /// `rediss://`.
    pub(crate) tls: bool,
}

/// The cause of a failed connect, with its fix.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Cause {
    pub(crate) hint: String,
    /// The TLS layer refused the connection (a certificate, an alert,
    /// nothing in common): a setting to fix, not an outage to ride out.
    /// False for what is inferred from how the connection ended.
    pub(crate) refused: bool,
}

/// The cause of `err`, a failed connect to `dialled`, and what to do about
/// it; `None` when the error tells nothing its own text does not (it is
/// then reported as it is).
pub(crate) fn cause(err: &(dyn StdError + 'static), dialled: &Dialled<'_>) -> Option<Cause> {
    #[cfg(feature = "tls-rustls")]
    if dialled.tls
        && let Some(refusal) = chain(err).find_map(|e| e.downcast_ref::<rustls::Error>())
    {
        return rustls_cause(refusal, dialled.host).map(|hint| Cause {
            hint,
            refused: true,
        });
    }
    let ended = |kinds: &[io::ErrorKind]| {
        chain(err)
            .filter_map(|e| e.downcast_ref::<io::Error>())
            .any(|e| kinds.contains(&e.kind()))
    };
    let hint = if dialled.tls {
        ended(&[io::ErrorKind::TimedOut, io::ErrorKind::WouldBlock]).then_some(TLS_TO_PLAIN)
    } else {
        ended(&[
            io::ErrorKind::ConnectionReset,
            io::ErrorKind::ConnectionAborted,
            io::ErrorKind::BrokenPipe,
            io::ErrorKind::UnexpectedEof,
        ])
        .then_some(PLAIN_TO_TLS)
    }?;
    Some(Cause {
        hint: hint.to_owned(),
        refused: false,
    })
}

/// `err` and what it wraps, looking inside what `source()` skips: an
/// `io::Error`'s payload (its `source()` is the payload's own source) and
/// the `Arc` redis-rs keeps its inner error in (whose `source()` is the
/// inner error's source, too). At most 16 links: a chain is short, and a
/// cycle must not hang a connect.
fn chain<'a>(
    err: &'a (dyn StdError + 'static),
) -> impl Iterator<Item = &'a (dyn StdError + 'static)> {
    std::iter::successors(Some(err), |&err| {
        if let Some(io) = err.downcast_ref::<io::Error>() {
            io.get_ref().map(|inner| inner as &(dyn StdError + 'static))
        } else if let Some(shared) =
            err.downcast_ref::<std::sync::Arc<dyn StdError + Send + Sync>>()
        {
            Some(&**shared as &(dyn StdError + 'static))
        } else {
            err.source()
        }
    })
    .take(16)
}

/// Each refusal rustls tells apart, with its fix; `None` for the rest,
/// whose own text is all there is to say.
#[cfg(feature = "tls-rustls")]
fn rustls_cause(err: &rustls::Error, host: &str) -> Option<String> {
    use rustls::{AlertDescription as Alert, Error, PeerIncompatible};

    const CLIENT_CERT: &str = "tls_client_cert_files, --tls-cert and --tls-key";
    const CIPHERS: &str = "rustls offers AES-GCM and ChaCha20-Poly1305 over TLS 1.2 and 1.3, \
         with ECDHE: widen the server's tls-ciphers or tls-ciphersuites";
    Some(match err {
        Error::InvalidCertificate(cert) => return server_certificate(cert, host),
        // What a server's alerts say about our certificate, as OpenSSL
        // (Redis) sends them.
        Error::AlertReceived(Alert::CertificateRequired) => format!(
            "the server requires a client certificate and this client sent none: give one \
             ({CLIENT_CERT})"
        ),
        Error::AlertReceived(Alert::UnknownCA) => format!(
            "the server refused this client's certificate: no CA it trusts signed it (unknown_ca): \
             give one signed by the CA of the server's tls-ca-cert-file ({CLIENT_CERT}), or add \
             its CA there"
        ),
        Error::AlertReceived(Alert::CertificateExpired) => format!(
            "the server refused this client's certificate as expired (certificate_expired): \
             renew it ({CLIENT_CERT}), or set the server's clock right if it is wrong"
        ),
        Error::AlertReceived(Alert::BadCertificate) => format!(
            "the server refused this client's certificate (bad_certificate: not valid yet, \
             untrusted, or with a key or signature too weak): check its dates against both \
             machines' clocks and its CA against the server's tls-ca-cert-file ({CLIENT_CERT})"
        ),
        Error::AlertReceived(Alert::UnsupportedCertificate) => format!(
            "the server refused this client's certificate as not meant for a client \
             (unsupported_certificate: its extendedKeyUsage lacks clientAuth): give one that \
             allows clientAuth ({CLIENT_CERT})"
        ),
        Error::AlertReceived(Alert::CertificateRevoked) => format!(
            "the server refused this client's certificate as revoked (certificate_revoked): \
             give another ({CLIENT_CERT})"
        ),
        Error::AlertReceived(Alert::CertificateUnknown) => format!(
            "the server refused this client's certificate (certificate_unknown): its log says \
             why ({CLIENT_CERT})"
        ),
        // OpenSSL answers "no cipher suite in common" with handshake_failure,
        // and a TLS 1.2 client that sent no certificate where one is
        // required the same way: the alert cannot tell them apart.
        Error::AlertReceived(Alert::HandshakeFailure) => format!(
            "the server refused the handshake: it has no cipher suite in common with this client \
             ({CIPHERS}), or, over TLS 1.2, it requires a client certificate and got none \
             ({CLIENT_CERT})"
        ),
        Error::AlertReceived(Alert::InsufficientSecurity) => {
            format!("the server finds this client's cipher suites too weak ({CIPHERS})")
        }
        // A server that allows only TLS 1.1 or older: OpenSSL alerts, a
        // server that answers in its own version is refused by rustls.
        Error::AlertReceived(Alert::ProtocolVersion)
        | Error::PeerIncompatible(PeerIncompatible::ServerDoesNotSupportTls12Or13) => {
            "no TLS version in common: this client (rustls) speaks TLS 1.2 and 1.3, the server \
             allows neither: add them to its tls-protocols (\"TLSv1.2 TLSv1.3\")"
                .to_owned()
        }
        // What arrives where a TLS record should is not TLS: a plain Redis
        // answering the handshake's bytes as an inline command (when they
        // hold a newline; otherwise it waits for one: `TLS_TO_PLAIN`).
        Error::InvalidMessage(_) => {
            "the server's answer is not TLS: if this port speaks plain text, use a redis:// URL"
                .to_owned()
        }
        _ => return None,
    })
}

/// Why rustls refused the server's certificate, and the fix.
#[cfg(feature = "tls-rustls")]
fn server_certificate(err: &rustls::CertificateError, host: &str) -> Option<String> {
    use rustls::CertificateError as Cert;

    const CA: &str = "tls_ca_file, --tls-ca";
    let now = |time: &rustls::pki_types::UnixTime| utc(time.as_secs());
    Some(match err {
        Cert::UnknownIssuer => format!(
            "the server's certificate is signed by a CA this client does not trust: give the CA \
             that signed it ({CA})"
        ),
        Cert::ExpiredContext { time, not_after } => format!(
            "the server's certificate expired at {} (this machine's clock says {}): renew it on \
             the server (its tls-cert-file), or set this machine's clock right",
            utc(not_after.as_secs()),
            now(time)
        ),
        Cert::Expired => "the server's certificate has expired: renew it on the server (its \
                          tls-cert-file), or set this machine's clock right"
            .to_owned(),
        Cert::NotValidYetContext { time, not_before } => format!(
            "the server's certificate is not valid before {} (this machine's clock says {}): set \
             this machine's clock right, or give the server a certificate valid now",
            utc(not_before.as_secs()),
            now(time)
        ),
        Cert::NotValidYet => "the server's certificate is not valid yet: set this machine's \
                              clock right, or give the server a certificate valid now"
            .to_owned(),
        Cert::NotValidForNameContext { presented, .. } if !presented.is_empty() => {
            let names: Vec<&str> = presented.iter().map(|name| bare_name(name)).collect();
            format!(
                "the server's certificate is not valid for {host}, the host dialled; it names {}: \
                 dial one of those, or give the server a certificate that names {host}",
                names.join(", ")
            )
        }
        Cert::NotValidForName | Cert::NotValidForNameContext { .. } => format!(
            "the server's certificate is not valid for {host}, the host dialled: dial a name it \
             holds in its subjectAltName, or give the server a certificate that names {host}"
        ),
        Cert::InvalidPurpose | Cert::InvalidPurposeContext { .. } => {
            "the server's certificate is not meant for a server (its extendedKeyUsage lacks \
             serverAuth): give the server one that allows serverAuth"
                .to_owned()
        }
        // rustls wraps webpki's error for a CA certificate presented as a
        // server's own in `Other`, a webpki type this crate does not
        // depend on (a second copy of webpki would not even match it):
        // its name is the one thing to go by.
        Cert::Other(other) if format!("{other:?}").contains("CaUsedAsEndEntity") => {
            CA_AS_SERVER_CERTIFICATE.to_owned()
        }
        _ => return None,
    })
}

/// A name as webpki lists the ones a certificate holds
/// (`DnsName("redis.internal")`, `IpAddress(10.0.0.5)`), as a URL holds it.
#[cfg(feature = "tls-rustls")]
fn bare_name(listed: &str) -> &str {
    listed
        .strip_prefix("DnsName(\"")
        .and_then(|rest| rest.strip_suffix("\")"))
        .or_else(|| {
            listed
                .strip_prefix("IpAddress(")
                .and_then(|rest| rest.strip_suffix(')'))
        })
        .unwrap_or(listed)
}

/// `secs` since the Unix epoch as a UTC date and time
/// (`2001-01-01 00:00:00 UTC`).
#[cfg(feature = "tls-rustls")]
fn utc(secs: u64) -> String {
    // Howard Hinnant's days-to-civil, for days since 1970-01-01.
    let days = secs / 86_400;
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    let rest = secs % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tls(host: &str) -> Dialled<'_> {
        Dialled { host, tls: true }
    }

    #[test]
    fn io_kinds_name_the_wrong_scheme() {
        let reset = io::Error::from(io::ErrorKind::ConnectionReset);
        let plain = Dialled {
            host: "h",
            tls: false,
        };
        let found = cause(&reset, &plain).expect("a cause");
        assert!(found.hint.contains("rediss://") && !found.refused);
        assert_eq!(cause(&reset, &tls("h")), None);
        let waited = io::Error::from(io::ErrorKind::WouldBlock);
        assert!(cause(&waited, &tls("h")).is_some_and(|c| c.hint.contains("redis://")));
        assert_eq!(cause(&waited, &plain), None);
        let refused = io::Error::from(io::ErrorKind::ConnectionRefused);
        assert_eq!(cause(&refused, &plain), None);
    }

    /// The kind is found however deep: the subscriber's reader wraps a
    /// redis-rs error (itself an `Arc` of an `io::Error`) in another
    /// `io::Error`.
    #[test]
    fn the_chain_is_followed_through_io_errors_and_redis_errors() {
        let inner = redis::RedisError::from(io::Error::from(io::ErrorKind::UnexpectedEof));
        let outer = io::Error::other(inner);
        let plain = Dialled {
            host: "h",
            tls: false,
        };
        assert!(cause(&outer, &plain).is_some());
    }

    #[cfg(feature = "tls-rustls")]
    #[test]
    fn rustls_refusals_are_read_from_their_types() {
        use rustls::{AlertDescription, CertificateError, Error};
        let wrapped = |err: Error| {
            io::Error::other(redis::RedisError::from(io::Error::new(
                io::ErrorKind::InvalidData,
                err,
            )))
        };
        let hint = |err: Error| cause(&wrapped(err), &tls("10.0.0.5")).map(|c| c.hint);
        assert!(
            hint(Error::InvalidCertificate(CertificateError::UnknownIssuer))
                .is_some_and(|h| h.contains("tls_ca_file"))
        );
        let names = hint(Error::InvalidCertificate(
            CertificateError::NotValidForNameContext {
                expected: rustls::pki_types::ServerName::try_from("10.0.0.5")
                    .expect("an address")
                    .to_owned(),
                presented: vec![
                    "DnsName(\"redis.internal\")".into(),
                    "IpAddress(10.0.0.6)".into(),
                ],
            },
        ))
        .expect("a cause");
        assert!(
            names.contains("not valid for 10.0.0.5") && names.contains("redis.internal, 10.0.0.6"),
            "{names}"
        );
        assert!(
            hint(Error::AlertReceived(AlertDescription::CertificateRequired))
                .is_some_and(|h| h.contains("--tls-cert"))
        );
        // A plain server's answer where a TLS record should be.
        assert!(
            hint(Error::InvalidMessage(
                rustls::InvalidMessage::InvalidContentType
            ))
            .is_some_and(|h| h.contains("use a redis:// URL"))
        );
        // Anything else is left to its own text.
        assert_eq!(hint(Error::DecryptError), None);
        assert_eq!(
            hint(Error::AlertReceived(AlertDescription::DecodeError)),
            None
        );
        // Over plain TCP, a rustls error is not ours to explain.
        let plain = Dialled {
            host: "h",
            tls: false,
        };
        assert_eq!(
            cause(
                &wrapped(Error::InvalidCertificate(CertificateError::UnknownIssuer)),
                &plain
            ),
            None
        );
    }

    #[cfg(feature = "tls-rustls")]
    #[test]
    fn dates_are_utc() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(978_307_200), "2001-01-01 00:00:00 UTC");
        assert_eq!(utc(951_825_600), "2000-02-29 12:00:00 UTC");
        assert_eq!(utc(4_102_444_799), "2099-12-31 23:59:59 UTC");
    }
}
