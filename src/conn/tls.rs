//! TLS (`rediss://`): the settings a client is built with (CA, client
//! certificate), turned into redis-rs's certificates for the pool and into
//! a rustls configuration for the subscriber's own socket, and that socket:
//! one TLS session over one TCP stream, read by one thread and written by
//! others.
//!
//! Why the subscriber needs more than redis-rs's TLS: its thread blocks
//! reading pushed messages while waiters write `SUBSCRIBE` on the other half
//! of the socket (see `notify::transport`). A TLS session is one state
//! machine for both directions, so the halves share it behind a mutex that
//! is never held across a blocking read: the reader reads ciphertext from
//! its own clone of the TCP stream without the lock, then takes the lock
//! only to decrypt. A writer holds it while its record goes out, bounded by
//! the write timeout.
//!
//! Without the `tls-rustls` feature only the settings exist; `build()`
//! refuses them, and redis-rs refuses `rediss://` URLs.

use std::path::PathBuf;

use crate::error::Error;

/// A PEM blob given directly or as a file read when the client is built.
#[derive(Clone)]
pub(crate) enum Pem {
    Bytes(Vec<u8>),
    File(PathBuf),
}

impl Pem {
    #[cfg_attr(not(feature = "tls-rustls"), allow(dead_code))]
    fn load(&self, what: &str) -> Result<Vec<u8>, Error> {
        match self {
            Pem::Bytes(bytes) => Ok(bytes.clone()),
            Pem::File(path) => std::fs::read(path).map_err(|err| {
                Error::InvalidArgument(format!("cannot read the {what} {}: {err}", path.display()))
            }),
        }
    }

    fn describe(&self) -> String {
        match self {
            Pem::Bytes(bytes) => format!("{} bytes of PEM", bytes.len()),
            Pem::File(path) => path.display().to_string(),
        }
    }
}

/// The TLS settings of a builder: which CA to trust instead of the
/// system's roots, and the client certificate for mutual TLS.
#[derive(Clone, Default)]
pub(crate) struct TlsSettings {
    pub(crate) ca: Option<Pem>,
    /// Certificate chain and private key.
    pub(crate) client: Option<(Pem, Pem)>,
}

impl TlsSettings {
    pub(crate) fn is_set(&self) -> bool {
        self.ca.is_some() || self.client.is_some()
    }
}

impl std::fmt::Debug for TlsSettings {
    // The key is a secret: only where it comes from is shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsSettings")
            .field("ca", &self.ca.as_ref().map(Pem::describe))
            .field(
                "client_cert",
                &self.client.as_ref().map(|(cert, _)| cert.describe()),
            )
            .field("client_key", &self.client.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

#[cfg(feature = "tls-rustls")]
pub(crate) use imp::{Tls, TlsHalf, handshake};

#[cfg(feature = "tls-rustls")]
mod imp {
    use std::io::{self, Read, Write};
    use std::net::TcpStream;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use parking_lot::Mutex;
    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
    use rustls::{ClientConfig, ClientConnection, DigitallySignedStruct, RootCertStore};

    use super::TlsSettings;
    use crate::error::Error;

    /// A client's TLS, resolved once when it is built: a bad CA file or key
    /// is an error of `build()`, not of the first lock.
    pub(crate) struct Tls {
        certificates: redis::TlsCertificates,
        verified: Arc<ClientConfig>,
        unverified: Arc<ClientConfig>,
    }

    impl std::fmt::Debug for Tls {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Tls").finish_non_exhaustive()
        }
    }

    fn invalid(what: &str, err: impl std::fmt::Display) -> Error {
        Error::InvalidArgument(format!("TLS: {what}: {err}"))
    }

    impl Tls {
        pub(crate) fn new(settings: &TlsSettings) -> Result<Tls, Error> {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            // redis-rs builds its rustls configurations with the process's
            // default provider, which rustls can only guess when exactly
            // one provider feature is on in the whole program: name ring,
            // unless the program chose one already.
            if CryptoProvider::get_default().is_none() {
                let _ = rustls::crypto::ring::default_provider().install_default();
            }
            let ca = settings
                .ca
                .as_ref()
                .map(|pem| pem.load("CA file"))
                .transpose()?;
            let client = match &settings.client {
                Some((cert, key)) => {
                    Some((cert.load("client certificate")?, key.load("client key")?))
                }
                None => None,
            };
            let roots = match &ca {
                Some(pem) => {
                    let mut roots = RootCertStore::empty();
                    for cert in CertificateDer::pem_slice_iter(pem) {
                        let cert = cert.map_err(|e| invalid("the CA is not PEM", e))?;
                        roots
                            .add(cert)
                            .map_err(|e| invalid("the CA certificate is not usable", e))?;
                    }
                    if roots.is_empty() {
                        return Err(invalid("the CA", "it holds no certificate"));
                    }
                    roots
                }
                None => default_roots()?,
            };
            let identity = match &client {
                Some((cert, key)) => {
                    let chain = CertificateDer::pem_slice_iter(cert)
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| invalid("the client certificate is not PEM", e))?;
                    if chain.is_empty() {
                        return Err(invalid("the client certificate", "it holds none"));
                    }
                    let key = PrivateKeyDer::from_pem_slice(key)
                        .map_err(|e| invalid("the client key is not a PEM private key", e))?;
                    Some((chain, key))
                }
                None => None,
            };
            let builder = || {
                ClientConfig::builder_with_provider(provider.clone())
                    .with_safe_default_protocol_versions()
                    .map_err(|e| invalid("no protocol version", e))
            };
            let with_identity =
                |config: rustls::ConfigBuilder<ClientConfig, rustls::client::WantsClientCert>| {
                    match &identity {
                        Some((chain, key)) => config
                            .with_client_auth_cert(chain.clone(), key.clone_key())
                            .map_err(|e| invalid("the client certificate and key", e)),
                        None => Ok(config.with_no_client_auth()),
                    }
                };
            let verified = with_identity(builder()?.with_root_certificates(roots))?;
            let mut unverified = with_identity(
                builder()?
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(AnyCertificate(
                        provider.signature_verification_algorithms,
                    ))),
            )?;
            // As redis-rs does for `#insecure`: no name is checked, so none
            // is sent.
            unverified.enable_sni = false;
            Ok(Tls {
                certificates: redis::TlsCertificates {
                    client_tls: client.map(|(client_cert, client_key)| redis::ClientTlsConfig {
                        client_cert,
                        client_key,
                    }),
                    root_cert: ca,
                },
                verified: Arc::new(verified),
                unverified: Arc::new(unverified),
            })
        }

        /// The same settings for redis-rs's connections.
        pub(crate) fn certificates(&self) -> redis::TlsCertificates {
            self.certificates.clone()
        }

        /// The configuration for a `rediss://` URL; `insecure` for one
        /// ending in `#insecure` (the server's certificate is not checked).
        pub(crate) fn config(&self, insecure: bool) -> Arc<ClientConfig> {
            if insecure {
                self.unverified.clone()
            } else {
                self.verified.clone()
            }
        }
    }

    /// The roots redis-rs trusts in the same build: Mozilla's compiled in
    /// with `tls-rustls-webpki-roots`, the system's otherwise.
    fn default_roots() -> Result<RootCertStore, Error> {
        let mut roots = RootCertStore::empty();
        #[cfg(feature = "tls-rustls-webpki-roots")]
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        #[cfg(not(feature = "tls-rustls-webpki-roots"))]
        {
            let found = rustls_native_certs::load_native_certs();
            if let Some(err) = found.errors.first() {
                return Err(invalid("cannot read the system's root certificates", err));
            }
            // Unusable entries in a system bundle are skipped, as
            // redis-rs's own loader would fail on none of them either.
            let _ = roots.add_parsable_certificates(found.certs);
        }
        Ok(roots)
    }

    /// `#insecure`: any certificate is accepted, but the handshake's
    /// signatures are still checked against it.
    #[derive(Debug)]
    struct AnyCertificate(WebPkiSupportedAlgorithms);

    impl ServerCertVerifier for AnyCertificate {
        fn verify_server_cert(
            &self,
            _end_entity: &CertificateDer<'_>,
            _intermediates: &[CertificateDer<'_>],
            _server_name: &ServerName<'_>,
            _ocsp: &[u8],
            _now: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            Ok(ServerCertVerified::assertion())
        }

        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0)
        }

        fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
            self.0.supported_schemes()
        }
    }

    /// One half of a TLS connection whose TCP stream is cloned between a
    /// reading thread and writing threads; see the module docs.
    pub(crate) struct TlsHalf {
        tcp: TcpStream,
        session: Arc<Mutex<ClientConnection>>,
        /// Decrypted bytes not yet handed out (the reading half only).
        plain: Vec<u8>,
        taken: usize,
        /// Ciphertext read buffer, made on the first read.
        raw: Vec<u8>,
        /// The peer closed (cleanly or not): hand out what is left, then 0.
        closed: bool,
    }

    /// The server's certificate or the handshake failed: say so in words
    /// that point at the usual causes.
    fn handshake_error(err: io::Error, host: &str, port: u16) -> io::Error {
        let hint = match err.kind() {
            io::ErrorKind::InvalidData if err.to_string().contains("corrupt message") => {
                " (the server does not speak TLS on this port: use redis://)"
            }
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => {
                " (the server closed the connection: does it require a client certificate?)"
            }
            _ => "",
        };
        io::Error::new(
            err.kind(),
            format!("TLS handshake with {host}:{port} failed: {err}{hint}"),
        )
    }

    /// Runs the TLS handshake on `tcp`, every read and write bounded by
    /// what is left of `timeout`, so a server that accepts and then says
    /// nothing (or drips) fails within it.
    pub(crate) fn handshake(
        mut tcp: TcpStream,
        config: Arc<ClientConfig>,
        host: &str,
        port: u16,
        timeout: Duration,
    ) -> io::Result<TlsHalf> {
        let name = ServerName::try_from(host.to_owned())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let mut session = ClientConnection::new(config, name).map_err(io::Error::other)?;
        let started = Instant::now();
        let fail = |err| handshake_error(err, host, port);
        while session.is_handshaking() || session.wants_write() {
            let left = timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Err(fail(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no answer within the timeout",
                )));
            }
            tcp.set_read_timeout(Some(left))?;
            tcp.set_write_timeout(Some(left))?;
            while session.wants_write() {
                session.write_tls(&mut tcp).map_err(fail)?;
            }
            if session.is_handshaking() && session.wants_read() {
                let read = session.read_tls(&mut tcp).map_err(fail)?;
                if read == 0 {
                    return Err(fail(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the server closed the connection",
                    )));
                }
                session
                    .process_new_packets()
                    .map_err(|e| fail(io::Error::new(io::ErrorKind::InvalidData, e)))?;
            }
        }
        Ok(TlsHalf {
            tcp,
            session: Arc::new(Mutex::new(session)),
            plain: Vec::new(),
            taken: 0,
            raw: Vec::new(),
            closed: false,
        })
    }

    impl TlsHalf {
        pub(crate) fn tcp(&self) -> &TcpStream {
            &self.tcp
        }

        pub(crate) fn try_clone(&self) -> io::Result<TlsHalf> {
            Ok(TlsHalf {
                tcp: self.tcp.try_clone()?,
                session: self.session.clone(),
                plain: Vec::new(),
                taken: 0,
                raw: Vec::new(),
                closed: false,
            })
        }

        /// Feeds `n` bytes of ciphertext from `raw` to the session and
        /// moves what it decrypts to `plain`.
        fn decrypt(&mut self, n: usize) -> io::Result<()> {
            let mut session = self.session.lock();
            let mut input = self.raw.get(..n).unwrap_or_default();
            loop {
                if !input.is_empty() {
                    session.read_tls(&mut input)?;
                }
                session
                    .process_new_packets()
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                // Drained after every record batch: rustls refuses more
                // ciphertext once 16 KiB of plaintext wait unread.
                match session.reader().read_to_end(&mut self.plain) {
                    Ok(_) => self.closed = true,
                    Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
                    Err(err) if err.kind() == io::ErrorKind::UnexpectedEof => self.closed = true,
                    Err(err) => return Err(err),
                }
                if input.is_empty() {
                    break;
                }
            }
            // A key update or an alert to answer.
            while session.wants_write() {
                session.write_tls(&mut self.tcp)?;
            }
            Ok(())
        }
    }

    impl Read for TlsHalf {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            // Bounded: each turn either returns or reads the socket, whose
            // read timeout ends the call; a peer that closes ends it too.
            loop {
                if self.taken < self.plain.len() {
                    let ready = self.plain.get(self.taken..).unwrap_or_default();
                    let n = ready.len().min(buf.len());
                    buf[..n].copy_from_slice(&ready[..n]);
                    self.taken += n;
                    if self.taken == self.plain.len() {
                        self.plain.clear();
                        self.taken = 0;
                    }
                    return Ok(n);
                }
                if self.closed || buf.is_empty() {
                    return Ok(0);
                }
                if self.raw.is_empty() {
                    self.raw = vec![0; 16 * 1024];
                }
                // The blocking read holds no lock, so writers go on.
                let n = self.tcp.read(&mut self.raw)?;
                if n == 0 {
                    self.closed = true;
                }
                self.decrypt(n)?;
            }
        }
    }

    impl Write for TlsHalf {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let mut session = self.session.lock();
            let n = session.writer().write(buf)?;
            while session.wants_write() {
                session.write_tls(&mut self.tcp)?;
            }
            Ok(n)
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
}
