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

    /// Runs the TLS handshake on `tcp`, every read and write bounded by
    /// what is left of `timeout`, so a server that accepts and then says
    /// nothing (or drips) fails within it. A server's verdict on the
    /// client's certificate comes after the client's side of a TLS 1.3
    /// handshake is done: it is met by the first read after this returns.
    pub(crate) fn handshake(
        mut tcp: TcpStream,
        config: Arc<ClientConfig>,
        host: &str,
        timeout: Duration,
    ) -> io::Result<TlsHalf> {
        let name = ServerName::try_from(host.to_owned())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let mut session = ClientConnection::new(config, name).map_err(io::Error::other)?;
        let started = Instant::now();
        while session.is_handshaking() || session.wants_write() {
            let left = timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no answer to the TLS handshake within the timeout",
                ));
            }
            tcp.set_read_timeout(Some(left))?;
            tcp.set_write_timeout(Some(left))?;
            while session.wants_write() {
                session.write_tls(&mut tcp)?;
            }
            if session.is_handshaking() && !session.wants_read() && !session.wants_write() {
                return Err(io::Error::other("the TLS handshake stalled"));
            }
            if session.is_handshaking() && session.wants_read() {
                let read = session.read_tls(&mut tcp)?;
                if read == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the server closed the connection during the TLS handshake",
                    ));
                }
                // The rustls error as it is: its type says why
                // (`conn::diagnose`).
                session
                    .process_new_packets()
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
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
                // Bounded: each turn consumes input, or ends the loop when
                // rustls takes no more (after `close_notify` it reads
                // nothing, and whatever follows is ignored).
                if !input.is_empty() && session.read_tls(&mut input)? == 0 {
                    self.closed = true;
                    break;
                }
                if let Err(err) = session.process_new_packets() {
                    // Tell the server why (the alert rustls queued), if the
                    // socket still takes it; the connection ends either way.
                    let _ = flush_tls(&mut session, &mut self.tcp);
                    return Err(io::Error::new(io::ErrorKind::InvalidData, err));
                }
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
            flush_tls(&mut session, &mut self.tcp)
        }
    }

    /// Writes every TLS record the session has queued. A send interrupted
    /// by a signal is sent again here: the records are already encrypted,
    /// so a caller retrying the whole write would encrypt its bytes twice.
    fn flush_tls(session: &mut ClientConnection, tcp: &mut TcpStream) -> io::Result<()> {
        while session.wants_write() {
            match session.write_tls(tcp) {
                Ok(_) => {}
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(err),
            }
        }
        Ok(())
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
            // Once rustls took the bytes they are sent or the connection
            // fails: an error here ends it (the subscriber reconnects), so
            // nothing is written twice.
            flush_tls(&mut session, &mut self.tcp)?;
            Ok(n)
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
}

/// The shared session against a real rustls server on a loopback socket:
/// what a Redis server never does on its own (more than 16 KiB of
/// plaintext in one burst, a key update, bytes after `close_notify`).
#[cfg(all(test, feature = "tls-rustls"))]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::{Arc, mpsc};
    use std::time::Duration;

    use rustls::pki_types::PrivateKeyDer;
    use rustls::pki_types::pem::PemObject;

    use super::{Pem, Tls, TlsHalf, TlsSettings, handshake};

    const WAIT: Duration = Duration::from_secs(5);

    /// A server thread running `serve` on the accepted TLS stream, and
    /// the client's halves (reader, writer) after the handshake.
    fn pair(
        serve: impl FnOnce(&mut rustls::StreamOwned<rustls::ServerConnection, TcpStream>)
        + Send
        + 'static,
    ) -> (TlsHalf, TlsHalf, std::thread::JoinHandle<()>) {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            PrivateKeyDer::from_pem_slice(key.serialize_pem().as_bytes()).expect("key pem"),
        )
        .expect("server config");
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let server = std::thread::spawn(move || {
            let (tcp, _) = listener.accept().expect("accept");
            tcp.set_read_timeout(Some(WAIT)).expect("timeout");
            let session = rustls::ServerConnection::new(Arc::new(config)).expect("session");
            let mut stream = rustls::StreamOwned::new(session, tcp);
            while stream.conn.is_handshaking() {
                stream
                    .conn
                    .complete_io(&mut stream.sock)
                    .expect("server handshake");
            }
            serve(&mut stream);
        });
        let tls = Tls::new(&TlsSettings {
            ca: Some(Pem::Bytes(cert.pem().into_bytes())),
            client: None,
        })
        .expect("client TLS");
        let tcp = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let reader = handshake(tcp, tls.config(false), "127.0.0.1", WAIT).expect("handshake");
        reader.tcp().set_read_timeout(Some(WAIT)).expect("timeout");
        let writer = reader.try_clone().expect("clone");
        (reader, writer, server)
    }

    /// Reads until `want` bytes or the end, on another thread, so a reader
    /// that spins fails the test instead of hanging it.
    fn read_all(mut reader: TlsHalf, want: usize) -> (Vec<u8>, TlsHalf) {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            while got.len() < want {
                match reader.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
            let _ = tx.send((got, reader));
        });
        rx.recv_timeout(WAIT * 2)
            .expect("the reader returned in time")
    }

    #[test]
    fn a_burst_larger_than_rustls_plaintext_limit_arrives_whole() {
        let burst: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let sent = burst.clone();
        let (reader, _writer, server) = pair(move |stream| {
            stream.write_all(&sent).expect("send");
            stream.flush().expect("flush");
            let mut ack = [0u8; 2];
            let _ = stream.read_exact(&mut ack);
        });
        let (got, _reader) = read_all(reader, burst.len());
        assert_eq!(got, burst);
        drop(_writer);
        drop(_reader);
        server.join().expect("server");
    }

    #[test]
    fn a_key_update_is_answered_and_both_directions_go_on() {
        let (reader, mut writer, server) = pair(|stream| {
            stream.write_all(b"before").expect("send");
            stream.flush().expect("flush");
            stream.conn.refresh_traffic_keys().expect("key update");
            stream.write_all(b"after").expect("send");
            stream.flush().expect("flush");
            let mut question = [0u8; 8];
            stream
                .read_exact(&mut question)
                .expect("the client's bytes");
            assert_eq!(&question, b"question");
            stream.write_all(b"answer").expect("send");
            stream.flush().expect("flush");
        });
        let (got, reader) = read_all(reader, 11);
        assert_eq!(got, b"beforeafter");
        writer
            .write_all(b"question")
            .expect("write after the key update");
        let (got, _reader) = read_all(reader, 6);
        assert_eq!(got, b"answer");
        server.join().expect("server");
    }

    #[test]
    fn bytes_after_close_notify_end_the_stream_without_spinning() {
        let (reader, _writer, server) = pair(|stream| {
            // One write: the data, the close and garbage after it, so the
            // client reads them in one go.
            // More than rustls takes per `read_tls` (4 KiB) on both sides
            // of the close, so some calls see only what follows it.
            stream.conn.writer().write_all(&[b'w'; 9000]).expect("send");
            stream.conn.send_close_notify();
            let mut burst = Vec::new();
            while stream.conn.wants_write() {
                stream.conn.write_tls(&mut burst).expect("encrypt");
            }
            burst.extend_from_slice(&[0x17; 9000]);
            stream.sock.write_all(&burst).expect("one burst");
        });
        let (got, mut reader) = read_all(reader, usize::MAX);
        assert_eq!(got, vec![b'w'; 9000]);
        let mut buf = [0u8; 16];
        assert_eq!(reader.read(&mut buf).expect("the end"), 0);
        server.join().expect("server");
    }
}
