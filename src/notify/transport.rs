//! The subscriber's transport: where to connect (fixed servers, or the
//! primary the sentinels name now), a blocking socket split in a reading and
//! a writing half, and RESP through redis-rs's own parser and command
//! packing.
//!
//! Why a socket of our own rather than a `redis::Connection`: the
//! subscriber thread blocks reading pushed messages while waiters write
//! `SUBSCRIBE` and `UNSUBSCRIBE` on the other half, so a subscription is
//! confirmed before the waiter's next attempt without polling, and a
//! `redis::Connection` cannot be read and written from two threads at
//! once. Every step is bounded by the client's timeout: connect, `AUTH`,
//! the sentinel lookup, each write; reads wait one timeout, then the
//! subscriber's heartbeat speaks. Over TLS (`rediss://`) the same socket
//! carries one TLS session shared by the halves (`conn::tls`), with the
//! handshake bounded by the same timeout. A failed connect names the
//! server and, when the error tells it, the cause and its fix
//! (`conn::diagnose`), as the pool's connects do.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
#[cfg(unix)]
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use redis::{Parser, Value};

use crate::conn::backend::keepalive;
use crate::conn::diagnose;
#[cfg(feature = "tls-rustls")]
use crate::conn::tls::{Tls, TlsHalf, handshake};

/// The name the subscriber connection gives itself (`CLIENT SETNAME`).
pub(crate) const CONNECTION_NAME: &str = "redmutex-subscriber";

/// Where and how to connect.
#[derive(Clone, Debug)]
pub(crate) enum Target {
    Tcp {
        host: String,
        port: u16,
    },
    /// TCP with TLS; the configuration says whether the certificate is
    /// checked (`#insecure` or not).
    #[cfg(feature = "tls-rustls")]
    Tls {
        host: String,
        port: u16,
        config: std::sync::Arc<rustls::ClientConfig>,
    },
    #[cfg(unix)]
    Unix(std::path::PathBuf),
}

#[derive(Clone)]
pub(crate) struct Endpoint {
    target: Target,
    username: Option<String>,
    password: Option<String>,
}

impl std::fmt::Debug for Endpoint {
    // The password is a secret: only whether there is one is shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("target", &self.target)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl Endpoint {
    /// Its `host:port`, as a cluster names its nodes (`None` for a Unix
    /// socket).
    pub(crate) fn address(&self) -> Option<String> {
        match &self.target {
            Target::Tcp { host, port } => Some(format!("{host}:{port}")),
            #[cfg(feature = "tls-rustls")]
            Target::Tls { host, port, .. } => Some(format!("{host}:{port}")),
            #[cfg(unix)]
            Target::Unix(_) => None,
        }
    }

    /// Another node of the same cluster, spoken to as this one is (TLS and
    /// its checks, the credentials).
    pub(crate) fn at(&self, host: &str, port: u16) -> Endpoint {
        let target = match &self.target {
            #[cfg(feature = "tls-rustls")]
            Target::Tls { config, .. } => Target::Tls {
                host: host.to_owned(),
                port,
                config: config.clone(),
            },
            _ => Target::Tcp {
                host: host.to_owned(),
                port,
            },
        };
        Endpoint {
            target,
            username: self.username.clone(),
            password: self.password.clone(),
        }
    }
}

/// `err`, a failed connect to `target`, with the server's address in
/// front and, when the error tells them, its cause and fix
/// (`conn::diagnose`). A TLS refusal becomes `InvalidData`, which the
/// subscriber reports as a setting to fix rather than an outage.
fn explained(err: io::Error, target: &Target) -> io::Error {
    let (host, port, tls) = match target {
        Target::Tcp { host, port } => (host, *port, false),
        #[cfg(feature = "tls-rustls")]
        Target::Tls { host, port, .. } => (host, *port, true),
        #[cfg(unix)]
        Target::Unix(_) => return err,
    };
    match diagnose::cause(&err, &diagnose::Dialled { host, tls }) {
        Some(cause) => io::Error::new(
            if cause.refused {
                io::ErrorKind::InvalidData
            } else {
                err.kind()
            },
            format!("{host}:{port}: {err} ({})", cause.hint),
        ),
        None => io::Error::new(err.kind(), format!("{host}:{port}: {err}")),
    }
}

/// The client's TLS, when it has any (`rediss://` URLs).
#[cfg(feature = "tls-rustls")]
pub(crate) type TlsRef<'a> = Option<&'a Tls>;
/// Without the `tls-rustls` feature there is no TLS to pass.
#[cfg(not(feature = "tls-rustls"))]
pub(crate) type TlsRef<'a> = Option<&'a std::convert::Infallible>;

impl Endpoint {
    /// `None` for addresses this connection cannot speak to (a TLS address
    /// without the client's TLS, which the builder never leaves out):
    /// waiters then use backoff timing.
    fn of(client: &redis::Client, tls: TlsRef<'_>) -> Option<Endpoint> {
        let info = client.get_connection_info();
        let target = match info.addr() {
            redis::ConnectionAddr::Tcp(host, port) => Target::Tcp {
                host: host.clone(),
                port: *port,
            },
            #[cfg(feature = "tls-rustls")]
            redis::ConnectionAddr::TcpTls {
                host,
                port,
                insecure,
                ..
            } => Target::Tls {
                host: host.clone(),
                port: *port,
                config: tls?.config(*insecure),
            },
            #[cfg(unix)]
            redis::ConnectionAddr::Unix(path) => Target::Unix(path.clone()),
            _ => {
                let _ = tls;
                return None;
            }
        };
        let settings = info.redis_settings();
        Some(Endpoint {
            target,
            username: settings.username().map(str::to_owned),
            password: settings.password().map(str::to_owned),
        })
    }
}

/// Where the subscriber connects, asked again before every reconnection.
pub(crate) enum Source {
    /// Fixed servers, tried in turn: one node (or one node of a cluster:
    /// a `PUBLISH` on any cluster node reaches subscribers on every node).
    Fixed(Vec<Endpoint>),
    /// A Redis Cluster's seed nodes: channels are subscribed with
    /// `SSUBSCRIBE` on the node that owns their slot (see the subscriber).
    Cluster(Vec<Endpoint>),
    /// The primary the sentinels name now, so the subscriber follows a
    /// failover. Asked with this module's own RESP and timeouts: a stalled
    /// sentinel must not stall the thread (nor the client's drop).
    Sentinel {
        sentinels: Vec<Endpoint>,
        master: String,
        username: Option<String>,
        password: Option<String>,
        /// TLS to the primary, as to the sentinels.
        #[cfg(feature = "tls-rustls")]
        tls: Option<std::sync::Arc<rustls::ClientConfig>>,
    },
}

impl Source {
    /// `None` when no server can be spoken to.
    pub(crate) fn servers<'a>(
        clients: impl IntoIterator<Item = &'a redis::Client>,
        tls: TlsRef<'_>,
    ) -> Option<Source> {
        let endpoints: Vec<Endpoint> = clients
            .into_iter()
            .filter_map(|client| Endpoint::of(client, tls))
            .collect();
        (!endpoints.is_empty()).then_some(Source::Fixed(endpoints))
    }

    /// [`Source::servers`] for a cluster's seeds: `None` when no seed can
    /// be spoken to.
    pub(crate) fn cluster<'a>(
        seeds: impl IntoIterator<Item = &'a redis::Client>,
        tls: TlsRef<'_>,
    ) -> Option<Source> {
        match Source::servers(seeds, tls)? {
            Source::Fixed(endpoints) => Some(Source::Cluster(endpoints)),
            other => Some(other),
        }
    }

    /// `None` when no sentinel can be spoken to. The primary is spoken to
    /// with TLS when the first sentinel is (`rediss://`), with the same
    /// certificate checks.
    pub(crate) fn sentinel<'a>(
        sentinels: impl IntoIterator<Item = &'a redis::Client>,
        master: &str,
        primary: &redis::RedisConnectionInfo,
        tls: TlsRef<'_>,
    ) -> Option<Source> {
        let sentinels: Vec<Endpoint> = sentinels
            .into_iter()
            .filter_map(|client| Endpoint::of(client, tls))
            .collect();
        #[cfg(feature = "tls-rustls")]
        let primary_tls = match sentinels.first().map(|s| &s.target) {
            Some(Target::Tls { config, .. }) => Some(config.clone()),
            _ => None,
        };
        (!sentinels.is_empty()).then(|| Source::Sentinel {
            sentinels,
            master: master.to_owned(),
            username: primary.username().map(str::to_owned),
            password: primary.password().map(str::to_owned),
            #[cfg(feature = "tls-rustls")]
            tls: primary_tls,
        })
    }

    /// The server for connection attempt number `attempt`.
    pub(crate) fn resolve(&self, attempt: usize, timeout: Duration) -> io::Result<Endpoint> {
        match self {
            Source::Fixed(endpoints) | Source::Cluster(endpoints) => endpoints
                .get(attempt % endpoints.len().max(1))
                .cloned()
                .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no server")),
            Source::Sentinel {
                sentinels,
                master,
                username,
                password,
                #[cfg(feature = "tls-rustls")]
                tls,
            } => {
                let mut last = io::Error::new(io::ErrorKind::NotFound, "no sentinel");
                // The whole lookup within one timeout, however many
                // sentinels stall: a dropped client's subscriber ends
                // within it. The next attempt starts at the next sentinel.
                let started = Instant::now();
                for i in 0..sentinels.len() {
                    let left = timeout.saturating_sub(started.elapsed());
                    if left < Duration::from_millis(1) {
                        break;
                    }
                    let sentinel = &sentinels[(attempt + i) % sentinels.len()];
                    match ask_sentinel(sentinel, master, left) {
                        Ok((host, port)) => {
                            #[cfg(feature = "tls-rustls")]
                            let target = match tls {
                                Some(config) => Target::Tls {
                                    host,
                                    port,
                                    config: config.clone(),
                                },
                                None => Target::Tcp { host, port },
                            };
                            #[cfg(not(feature = "tls-rustls"))]
                            let target = Target::Tcp { host, port };
                            return Ok(Endpoint {
                                target,
                                username: username.clone(),
                                password: password.clone(),
                            });
                        }
                        Err(err) => last = err,
                    }
                }
                Err(last)
            }
        }
    }
}

/// What is left of `limit` since `started`, at least 1 ms (a zero timeout
/// means "none" to a socket).
pub(crate) fn left_of(limit: Duration, started: Instant) -> Duration {
    limit
        .saturating_sub(started.elapsed())
        .max(Duration::from_millis(1))
}

/// `SENTINEL GET-MASTER-ADDR-BY-NAME master` on one sentinel.
fn ask_sentinel(sentinel: &Endpoint, master: &str, timeout: Duration) -> io::Result<(String, u16)> {
    ask(sentinel, master, timeout).map_err(|err| explained(err, &sentinel.target))
}

fn ask(sentinel: &Endpoint, master: &str, timeout: Duration) -> io::Result<(String, u16)> {
    let started = Instant::now();
    let (mut reader, mut writer) = open(sentinel, timeout)?;
    // The connect and the reply within `timeout` together.
    let left = left_of(timeout, started);
    writer.set_timeouts(Some(left), Some(left))?;
    write_command(
        &mut writer,
        &[b"SENTINEL", b"GET-MASTER-ADDR-BY-NAME", master.as_bytes()],
    )?;
    let reply = reader.read()?;
    writer.shutdown();
    if let Value::Array(items) = &reply
        && let [Value::BulkString(host), port] = items.as_slice()
        && let Ok(port) = redis::from_redis_value::<u16>(port.clone())
    {
        return Ok((String::from_utf8_lossy(host).into_owned(), port));
    }
    Err(io::Error::other(format!(
        "the sentinel does not name a primary {master:?}: {reply:?}"
    )))
}

pub(crate) enum Stream {
    Tcp(TcpStream),
    #[cfg(feature = "tls-rustls")]
    Tls(TlsHalf),
    #[cfg(unix)]
    Unix(UnixStream),
}

/// A TCP connection with the subscriber's socket settings, `timeout` on the
/// connect.
fn connect_tcp(host: &str, port: u16, timeout: Duration) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
    for addr in (host, port).to_socket_addrs()? {
        match TcpStream::connect_timeout(&addr, timeout) {
            Ok(stream) => {
                stream.set_nodelay(true)?;
                redis::io::tcp::socket2::SockRef::from(&stream)
                    .set_tcp_keepalive(&keepalive(timeout))?;
                return Ok(stream);
            }
            Err(err) => last = err,
        }
    }
    Err(last)
}

impl Stream {
    fn connect(target: &Target, timeout: Duration) -> io::Result<Stream> {
        match target {
            Target::Tcp { host, port } => Ok(Stream::Tcp(connect_tcp(host, *port, timeout)?)),
            #[cfg(feature = "tls-rustls")]
            Target::Tls { host, port, config } => {
                let tcp = connect_tcp(host, *port, timeout)?;
                Ok(Stream::Tls(handshake(tcp, config.clone(), host, timeout)?))
            }
            #[cfg(unix)]
            Target::Unix(path) => Ok(Stream::Unix(UnixStream::connect(path)?)),
        }
    }

    fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            #[cfg(feature = "tls-rustls")]
            Stream::Tls(s) => Stream::Tls(s.try_clone()?),
            #[cfg(unix)]
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
            #[cfg(feature = "tls-rustls")]
            Stream::Tls(s) => {
                s.tcp().set_read_timeout(read)?;
                s.tcp().set_write_timeout(write)
            }
            #[cfg(unix)]
            Stream::Unix(s) => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
        }
    }

    pub(crate) fn shutdown(&self) {
        // On TLS too the TCP stream is shut, not the session: a blocked
        // reader must wake now, and nothing more is to be said.
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
            #[cfg(feature = "tls-rustls")]
            Stream::Tls(s) => s.tcp().shutdown(Shutdown::Both),
            #[cfg(unix)]
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            #[cfg(feature = "tls-rustls")]
            Stream::Tls(s) => s.read(buf),
            #[cfg(unix)]
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            #[cfg(feature = "tls-rustls")]
            Stream::Tls(s) => s.write(buf),
            #[cfg(unix)]
            Stream::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            #[cfg(feature = "tls-rustls")]
            Stream::Tls(s) => s.flush(),
            #[cfg(unix)]
            Stream::Unix(s) => s.flush(),
        }
    }
}

/// Writes one command, packed by redis-rs.
pub(crate) fn write_command(out: &mut impl Write, args: &[&[u8]]) -> io::Result<()> {
    let args: Vec<Vec<u8>> = args.iter().map(|arg| arg.to_vec()).collect();
    out.write_all(&redis::pack_command(&args))?;
    out.flush()
}

/// The reading half: the socket and redis-rs's incremental parser, which
/// keeps a frame cut by a read timeout and goes on with it on the next
/// read, so a timeout loses nothing.
pub(crate) struct Reader {
    stream: Restarting,
    parser: Parser,
}

/// Retries reads interrupted by a signal (`EINTR`): a socket with a read
/// timeout reports them even under `SA_RESTART`, and they are not a
/// failure of the link.
struct Restarting(Stream);

impl Read for Restarting {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.0.read(buf) {
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                other => return other,
            }
        }
    }
}

impl Reader {
    fn new(stream: Stream) -> Reader {
        Reader {
            stream: Restarting(stream),
            parser: Parser::new(),
        }
    }

    /// The next reply or pushed message. An error of kind `TimedOut` or
    /// `WouldBlock` means one timeout passed without a whole frame (nothing
    /// is lost); any other error ends the connection. A server error reply
    /// is `Ok(Value::ServerError(_))`.
    pub(crate) fn read(&mut self) -> io::Result<Value> {
        self.parser.parse_value(&mut self.stream).map_err(|err| {
            if err.is_timeout() {
                io::Error::new(io::ErrorKind::TimedOut, err)
            } else {
                io::Error::other(err)
            }
        })
    }
}

/// Connects with timeouts and authenticates; returns the reading and the
/// writing halves.
fn open(endpoint: &Endpoint, timeout: Duration) -> io::Result<(Reader, Stream)> {
    let started = Instant::now();
    let stream = Stream::connect(&endpoint.target, timeout)?;
    // The connect and the handshake within `timeout` together.
    let left = left_of(timeout, started);
    stream.set_timeouts(Some(left), Some(left))?;
    let mut writer = stream.try_clone()?;
    let mut reader = Reader::new(stream);
    if let Some(password) = &endpoint.password {
        let mut args: Vec<&[u8]> = vec![b"AUTH"];
        if let Some(user) = &endpoint.username {
            args.push(user.as_bytes());
        }
        args.push(password.as_bytes());
        write_command(&mut writer, &args)?;
        expect_ok(&mut reader, "AUTH")?;
    }
    Ok((reader, writer))
}

/// Connects, authenticates and names the connection, all within `limit`;
/// returns the reading and the writing halves. From here on a read waits
/// one `timeout`, then the heartbeat speaks.
pub(crate) fn connect(
    endpoint: &Endpoint,
    limit: Duration,
    timeout: Duration,
) -> io::Result<(Reader, Stream)> {
    named(endpoint, limit, timeout).map_err(|err| explained(err, &endpoint.target))
}

fn named(endpoint: &Endpoint, limit: Duration, timeout: Duration) -> io::Result<(Reader, Stream)> {
    let started = Instant::now();
    let (mut reader, mut writer) = open(endpoint, limit)?;
    // A server that stalls after accepting holds the thread (and a dropped
    // client's end) no longer than `limit`.
    let left = left_of(limit, started);
    writer.set_timeouts(Some(left), Some(left))?;
    write_command(
        &mut writer,
        &[b"CLIENT", b"SETNAME", CONNECTION_NAME.as_bytes()],
    )?;
    // A name only helps operators; a user whose ACL refuses CLIENT still
    // gets release messages. A server that does not answer, or a link that
    // fails (a TLS 1.3 server refuses a client's certificate only after
    // the client's side of the handshake, so this is the first read to
    // meet its alert), is no use.
    match reader.read()? {
        Value::Okay | Value::SimpleString(_) => {}
        Value::ServerError(err) => {
            log::debug!("redmutex: the subscriber connection stays unnamed: {err}");
        }
        other => {
            log::debug!("redmutex: the subscriber connection stays unnamed: {other:?}");
        }
    }
    writer.set_timeouts(Some(timeout), Some(timeout))?;
    Ok((reader, writer))
}

fn expect_ok(reader: &mut Reader, what: &str) -> io::Result<()> {
    match reader.read()? {
        Value::Okay | Value::SimpleString(_) => Ok(()),
        Value::ServerError(err) => Err(io::Error::other(format!("{what}: {err}"))),
        other => Err(io::Error::other(format!(
            "{what}: unexpected reply {other:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// Hands out the bytes in the given chunks, with a timeout between
    /// chunks, as a socket with a read timeout does.
    struct Chunks(VecDeque<Option<&'static [u8]>>);

    impl Read for Chunks {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            match self.0.pop_front() {
                Some(Some(chunk)) => {
                    buf[..chunk.len()].copy_from_slice(chunk);
                    Ok(chunk.len())
                }
                Some(None) => Err(io::Error::new(io::ErrorKind::WouldBlock, "timeout")),
                None => Ok(0),
            }
        }
    }

    #[test]
    fn a_frame_cut_by_a_timeout_is_finished_on_the_next_read() {
        let mut parser = Parser::new();
        let mut input = Chunks(VecDeque::from([
            Some(&b"*3\r\n$7\r\nmessage\r\n$2\r"[..]),
            None,
            Some(&b"\nch\r\n$1\r\n1\r\n+PONG\r\n"[..]),
        ]));
        let first = parser.parse_value(&mut input);
        assert!(
            first.is_err_and(|err| err.is_timeout()),
            "the cut is a timeout"
        );
        let message = parser.parse_value(&mut input).ok();
        assert_eq!(
            message,
            Some(Value::Array(vec![
                Value::BulkString(b"message".to_vec()),
                Value::BulkString(b"ch".to_vec()),
                Value::BulkString(b"1".to_vec()),
            ]))
        );
        let pong = parser.parse_value(&mut input).ok();
        assert_eq!(pong, Some(Value::SimpleString("PONG".into())));
    }

    #[test]
    fn commands_are_packed_as_resp_arrays() {
        let mut out = Vec::new();
        assert!(write_command(&mut out, &[b"SUBSCRIBE", b"ch"]).is_ok());
        assert_eq!(out, b"*2\r\n$9\r\nSUBSCRIBE\r\n$2\r\nch\r\n");
    }
}
