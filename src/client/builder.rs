//! Every way to make a [`LockClient`]: [`LockClientBuilder`] for any
//! deployment with every setting, its short form [`LockClient::open`], and
//! the wrappers of pools built by the caller (`new*`).

use std::path::PathBuf;
use std::time::Duration;

use redis::cluster::ClusterClient;
use redis::sentinel::LockedSentinelClient;

use crate::client::holder::Identity;
use crate::client::options::LockOptions;
use crate::client::{
    CLUSTER_RETRIES, DEFAULT_POOL_SIZE, DEFAULT_TIMEOUT, LockClient, check_timeout, parse_url,
    parse_urls,
};
use crate::conn::backend::{Backend, ClusterTarget, SentinelTarget, Target, tcp_settings};
#[cfg(feature = "tls-rustls")]
use crate::conn::tls::Tls;
use crate::conn::tls::{Pem, TlsSettings};
use crate::error::Error;
use crate::notify::transport::{Source, TlsRef};
use crate::script::names::Namespace;

impl LockClient {
    /// A builder for any deployment (one server, Redis Cluster, Redis
    /// Sentinel), with every setting; [`LockClient::open`] is its short
    /// form for one server with the defaults.
    pub fn builder() -> LockClientBuilder {
        LockClientBuilder::default()
    }

    /// Builds a client with its own connection pool for the server at `url`
    /// (`redis://[user:password@]host:port[/db]`).
    ///
    /// The pool opens connections lazily and keeps at most
    /// [`DEFAULT_POOL_SIZE`]. [`DEFAULT_TIMEOUT`] bounds everything that
    /// touches the network: connecting (the TCP connect and the handshake),
    /// waiting for a pooled connection, and every read and write; so no lock
    /// call can hang on a dead or stalled server, and the pool is usable
    /// again soon after the server heals (the
    /// [bounds](crate::guide::failure_model#bounds)). A connection whose
    /// reply was lost is closed, never reused (a late reply cannot reach the
    /// next user), and when one connection finds the server gone the pool's
    /// older idle connections are discarded too, without a round trip. No
    /// `PING` is sent per checkout. The server is not contacted here; an
    /// unreachable one makes the first lock operation fail with
    /// [`Error::Pool`] within the timeout (one connect: the
    /// [bounds](crate::guide::failure_model#bounds)).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the URL does not parse.
    pub fn open(url: &str) -> Result<LockClient, Error> {
        LockClient::builder().url(url).build()
    }

    /// Wraps a pool you built, with default [`LockOptions`].
    ///
    /// Mind three pool settings: r2d2's default `test_on_check_out(true)`
    /// sends a `PING` per checkout, nearly halving lock throughput; redis
    /// connections have no read timeout unless you set one (see r2d2's
    /// `connection_customizer`), so a stalled server would hang the caller;
    /// and redis-rs opens pooled connections without a connect or
    /// handshake timeout, so a server that accepts and never answers blocks
    /// r2d2's threads. Prefer [`LockClient::builder`], whose pool
    /// has none of these problems. The resend window and release markers
    /// (see the crate docs' failure model) assume [`DEFAULT_TIMEOUT`] for a
    /// pool given here.
    ///
    /// A pool does not tell where its server is, so a client made here has
    /// no subscriber connection: waiters in [`WaitMode::Notify`](crate::WaitMode::Notify)
    /// still queue locally and take handoffs, but wait for remote releases
    /// with backoff timing. [`LockClient::with_notify_client`] adds one.
    pub fn new(pool: r2d2::Pool<redis::Client>) -> LockClient {
        LockClient::build(
            Backend::single(pool, DEFAULT_TIMEOUT),
            None,
            None,
            Namespace::default(),
        )
    }

    /// Wraps a Redis Cluster pool you built; see [`LockClientBuilder::cluster`]
    /// for what differs on a cluster, and [`LockClient::new`] for the pool
    /// settings to mind. Without [`LockClient::with_notify_client`] (any one
    /// node will do), remote releases are waited for with backoff timing.
    pub fn new_cluster(pool: r2d2::Pool<ClusterClient>) -> LockClient {
        LockClient::build(
            Backend::cluster(pool, DEFAULT_TIMEOUT),
            None,
            None,
            Namespace::default(),
        )
    }

    /// Wraps a pool over [`LockedSentinelClient`] you built; see
    /// [`LockClientBuilder::sentinel`] for the failover behaviour and hazard,
    /// and [`LockClient::new`] for the pool settings to mind. Remote
    /// releases are waited for with backoff timing (the subscriber
    /// connection of [`LockClientBuilder::sentinel`] needs the sentinels'
    /// addresses, which the pool does not tell).
    pub fn new_sentinel(pool: r2d2::Pool<LockedSentinelClient>) -> LockClient {
        LockClient::build(
            Backend::sentinel(pool, DEFAULT_TIMEOUT),
            None,
            None,
            Namespace::default(),
        )
    }
}

/// Where the client's Redis is. Its `Debug` shows the URLs without their
/// logins and query strings, which may carry a password.
#[derive(Clone)]
enum Servers {
    None,
    Single(String),
    Cluster(Vec<String>),
    Sentinel {
        sentinels: Vec<String>,
        master: String,
    },
}

impl std::fmt::Debug for Servers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls = |list: &[String]| list.iter().map(|u| redact_url(u)).collect::<Vec<_>>();
        match self {
            Servers::None => f.write_str("None"),
            Servers::Single(url) => f.debug_tuple("Single").field(&redact_url(url)).finish(),
            Servers::Cluster(nodes) => f.debug_tuple("Cluster").field(&urls(nodes)).finish(),
            Servers::Sentinel { sentinels, master } => f
                .debug_struct("Sentinel")
                .field("sentinels", &urls(sentinels))
                .field("master", master)
                .finish(),
        }
    }
}

/// A Redis URL as it may be shown in a message or a log: its login
/// (`user:password@`) and its query string (`?pass=…` on a Unix socket's
/// URL) replaced by `<redacted>`. What a [`LockClientBuilder`]'s `Debug`
/// shows, and the `redmutex` command's messages.
///
/// ```
/// use redmutex::redact_url;
/// assert_eq!(redact_url("redis://app:pw@10.0.0.1:6379/2"), "redis://<redacted>@10.0.0.1:6379/2");
/// assert_eq!(redact_url("redis+unix:///run/redis.sock?pass=pw"), "redis+unix:///run/redis.sock?<redacted>");
/// assert_eq!(redact_url("rediss://10.0.0.1:6380"), "rediss://10.0.0.1:6380");
/// ```
pub fn redact_url(url: &str) -> String {
    let (url, query) = match url.split_once('?') {
        Some((url, _)) => (url, "?<redacted>"),
        None => (url, ""),
    };
    let shown = match url.split_once("://") {
        Some((scheme, rest)) => {
            // The authority ends at the first `/`; a login is before its last `@`.
            let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            match authority.rfind('@') {
                Some(at) => format!("{scheme}://<redacted>@{}{path}", &authority[at + 1..]),
                None => format!("{scheme}://{rest}"),
            }
        }
        None => url.to_owned(),
    };
    format!("{shown}{query}")
}

/// Builds a [`LockClient`]: the deployment (one server, Redis Cluster or
/// Redis Sentinel), the timeouts, the pool size, notify waiting and the
/// options new locks start from. Made by [`LockClient::builder`]; nothing
/// is sent to Redis until the first lock operation.
///
/// ```no_run
/// # fn main() -> Result<(), redmutex::Error> {
/// use std::time::Duration;
/// let client = redmutex::LockClient::builder()
///     .sentinel(["redis://10.0.0.1:26379", "redis://10.0.0.2:26379"], "locks")
///     .timeout(Duration::from_millis(500))
///     .pool_size(8)
///     .build()?;
/// # Ok(())
/// # }
/// ```
#[must_use = "a builder does nothing until build() is called"]
#[derive(Clone, Debug)]
pub struct LockClientBuilder {
    servers: Servers,
    primary: redis::RedisConnectionInfo,
    timeout: Duration,
    pool_size: u32,
    notify: bool,
    defaults: LockOptions,
    key_prefix: String,
    holder_metadata: bool,
    program: Option<String>,
    label: Option<String>,
    tls: TlsSettings,
    username: Option<String>,
    password: Option<Password>,
}

/// A password that never shows in `Debug` output.
#[derive(Clone)]
struct Password(String);

impl std::fmt::Debug for Password {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl Default for LockClientBuilder {
    fn default() -> Self {
        LockClientBuilder {
            servers: Servers::None,
            primary: redis::RedisConnectionInfo::default(),
            timeout: DEFAULT_TIMEOUT,
            pool_size: DEFAULT_POOL_SIZE,
            notify: true,
            defaults: LockOptions::default(),
            key_prefix: String::new(),
            holder_metadata: true,
            program: None,
            label: None,
            tls: TlsSettings::default(),
            username: None,
            password: None,
        }
    }
}

impl LockClientBuilder {
    /// One Redis server at `url` (`redis://[user:password@]host:port[/db]`,
    /// or `redis+unix:///path`). See [`LockClient::open`].
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.servers = Servers::Single(url.into());
        self
    }

    /// A Redis Cluster, given some of its nodes (`redis://host:port`, any
    /// of them; the others are found through `CLUSTER SLOTS`).
    ///
    /// Everything the crate sends touches one hash slot: a lock key's
    /// fencing counter and release channel carry the key's hash tag (see
    /// [`LockClient::fence_key`](crate::LockClient::fence_key)), scripts are routed by their first
    /// key, `MOVED` and `ASK` redirections are followed, and a script the
    /// node lost (`NOSCRIPT` after a failover, a resharding or a
    /// `SCRIPT FLUSH`) is loaded on every primary and run again.
    ///
    /// What differs from a single node:
    ///
    /// * [`Release::Watch`](crate::client::options::Release::Watch) is refused with
    ///   [`Error::InvalidArgument`]: a `WATCH` lives on one connection to one
    ///   node, and a redirection between `WATCH` and `EXEC` would run the
    ///   `DEL` on a node where nothing is watched, unchecked.
    /// * Release messages go out with classic `PUBLISH`, which the cluster
    ///   bus carries to every node; the subscriber connection stays on one
    ///   node (the first seed it reaches), so notify waiting works as on one
    ///   server, at the price of that broadcast on each release.
    /// * With [`LockOptions::fencing`](crate::LockOptions::fencing), a key
    ///   that contains `}` without a valid `{tag}` is refused: no counter key
    ///   can share its slot.
    ///
    /// Pool and timeouts as for one server; each pooled connection
    /// keeps one connection per node it has talked to. A slot that is
    /// moving (`MOVED`/`ASK` past redis-rs's own retries, `TRYAGAIN` during
    /// a migration, `CLUSTERDOWN` during a failover) is asked again, as a
    /// resend, with backoff for up to twice the I/O timeout; after that
    /// the call fails with [`Error::OutcomeUnknown`] (writes) or
    /// [`Error::Redis`] (reads).
    ///
    /// [`LockClientBuilder::build`] fails with [`Error::InvalidArgument`]
    /// when there is no URL or one does not parse.
    pub fn cluster<S: AsRef<str>>(mut self, urls: impl IntoIterator<Item = S>) -> Self {
        self.servers = Servers::Cluster(urls.into_iter().map(|u| u.as_ref().to_owned()).collect());
        self
    }

    /// The primary that Redis Sentinel names `master`, given some sentinels
    /// (`redis://host:port`, with their own credentials in the URL; with
    /// `rediss://` the primary is spoken to with TLS too). How to log in
    /// to the primary: [`LockClientBuilder::sentinel_primary`].
    ///
    /// Every new connection asks the sentinels for the current primary and
    /// checks its `ROLE`, so after a failover the client reaches the
    /// promoted replica: connections to the old primary break (Sentinel
    /// disconnects the clients of a demoted primary), the failed call is
    /// retried on a fresh connection, and the subscriber connection asks the
    /// sentinels again too.
    ///
    /// **The failover hazard.** Replication is asynchronous: a lock written
    /// to the old primary just before it died may never reach the replica
    /// that is promoted, and then a second owner gets the same lock. Set
    /// [`LockOptions::min_replicas`](crate::LockOptions::min_replicas) so an
    /// acquisition only counts once a replica has the key, and use
    /// [`fencing`](crate::LockOptions::fencing) tokens where a double owner
    /// would do damage.
    ///
    /// [`LockClientBuilder::build`] fails with [`Error::InvalidArgument`]
    /// when there is no sentinel URL or one does not parse.
    pub fn sentinel<S: AsRef<str>>(
        mut self,
        sentinels: impl IntoIterator<Item = S>,
        master: impl Into<String>,
    ) -> Self {
        self.servers = Servers::Sentinel {
            sentinels: sentinels
                .into_iter()
                .map(|u| u.as_ref().to_owned())
                .collect(),
            master: master.into(),
        };
        self
    }

    /// How to log in to the primary a sentinel names (username, password,
    /// database, protocol). Defaults to no login and database 0. Ignored
    /// for the other deployments, whose URLs carry it.
    pub fn sentinel_primary(mut self, primary: redis::RedisConnectionInfo) -> Self {
        self.primary = primary;
        self
    }

    /// Bounds connecting (TCP connect and handshake), waiting for a pooled
    /// connection and every read and write. Defaults to
    /// [`DEFAULT_TIMEOUT`] (2 s); between 1 ms and [`MAX_TIMEOUT`](crate::MAX_TIMEOUT).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The most connections the pool keeps. Defaults to
    /// [`DEFAULT_POOL_SIZE`] (16); at least 1.
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size;
        self
    }

    /// Whether the client keeps a subscriber connection for
    /// [`WaitMode::Notify`](crate::WaitMode::Notify) (waiters are woken by
    /// release messages). Defaults to `true`; without it, waiters still
    /// queue locally and take handoffs, but wait for other processes'
    /// releases with backoff timing, and the client starts no subscriber
    /// thread.
    pub fn notify(mut self, enabled: bool) -> Self {
        self.notify = enabled;
        self
    }

    /// The options [`DistributedLock::new`](crate::DistributedLock::new)
    /// gives its locks ([`ReentrantLock::new`](crate::ReentrantLock::new)
    /// and [`RwLock::new`](crate::RwLock::new) take their ttl, wait and
    /// backoff, and the RwLock its wait mode; a RedLock spans clients and
    /// takes its own). Defaults to [`LockOptions::default`].
    pub fn defaults(mut self, options: LockOptions) -> Self {
        self.defaults = options;
        self
    }

    /// A prefix for every key and pub/sub channel the client's locks touch:
    /// the lock named `K` is the key `PREFIX K`, and its fencing counter,
    /// release markers and release channel all start with `PREFIX` too, so
    /// an ACL user limited to `~PREFIX*` and `&PREFIX*` can use every lock
    /// type (the [ACL rules](crate::guide::failure_model#acl-rules)).
    /// Defaults to none (`""`). It may
    /// not contain `{` or `}`, which would move keys to another cluster
    /// slot. [`DistributedLock::key`](crate::DistributedLock::key) and the
    /// guards' `key()` give the key with its prefix, as it is in Redis.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// Whether each lease says who holds it: host, process id, program,
    /// label and acquisition time (by the server's clock) are written into
    /// Redis with the token, in the same command as the acquisition, and
    /// read back by [`Holder::from_token`](crate::Holder::from_token),
    /// [`LockClient::list`] and `redmutex list`/`status`. Defaults to
    /// `true`. Off, tokens are bare UUIDs (smaller, by
    /// [what the metadata costs](crate::guide::operating#holder-metadata);
    /// nothing about the host in the keyspace; no `TIME` read on the
    /// client's first acquisition).
    pub fn holder_metadata(mut self, enabled: bool) -> Self {
        self.holder_metadata = enabled;
        self
    }

    /// The program name in the holder metadata. Defaults to the file name
    /// of the executable (`argv[0]`). Made fit for a field: `|`,
    /// whitespace and control characters become `_`, and it is cut at 64
    /// bytes.
    pub fn program(mut self, program: impl Into<String>) -> Self {
        self.program = Some(program.into());
        self
    }

    /// A label in the holder metadata, for operators to tell holders apart
    /// (a job name, a deploy id). Defaults to none. At most 64 bytes,
    /// without `|`, whitespace or control characters.
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }

    /// The CA certificates (PEM, one or more) that a `rediss://` server's
    /// certificate must chain to, instead of the system's root certificates
    /// (or Mozilla's, with the `tls-rustls-webpki-roots` feature). Defaults
    /// to none: the system's roots. For every connection of the client: the
    /// pool, the subscriber, a Sentinel's primary, every Cluster node.
    /// Needs the `tls-rustls` feature.
    pub fn tls_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls.ca = Some(Pem::Bytes(pem.into()));
        self
    }

    /// As [`tls_ca_pem`](Self::tls_ca_pem), read from a file when the
    /// client is built.
    pub fn tls_ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.tls.ca = Some(Pem::File(path.into()));
        self
    }

    /// A client certificate (PEM chain, the client's own first) and its
    /// private key (PEM: PKCS#8, PKCS#1 or SEC1), for servers that require
    /// one (`tls-auth-clients yes`, mutual TLS). Defaults to none. Needs
    /// the `tls-rustls` feature.
    pub fn tls_client_cert_pem(
        mut self,
        cert_chain: impl Into<Vec<u8>>,
        key: impl Into<Vec<u8>>,
    ) -> Self {
        self.tls.client = Some((Pem::Bytes(cert_chain.into()), Pem::Bytes(key.into())));
        self
    }

    /// As [`tls_client_cert_pem`](Self::tls_client_cert_pem), read from
    /// files when the client is built.
    pub fn tls_client_cert_files(
        mut self,
        cert_chain: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
    ) -> Self {
        self.tls.client = Some((Pem::File(cert_chain.into()), Pem::File(key.into())));
        self
    }

    /// The ACL user to log in as, instead of the one in the URLs (for
    /// Sentinel: on the primary; the sentinels' own go in their URLs).
    /// Needs [`password`](Self::password): `build()` refuses a username
    /// without one. Defaults to the URL's, or `default`.
    pub fn username(mut self, username: impl Into<String>) -> Self {
        self.username = Some(username.into());
        self
    }

    /// The password to log in with, instead of the one in the URLs (for
    /// Sentinel: on the primary). Kept out of `Debug` output. Defaults to
    /// the URL's, or none.
    pub fn password(mut self, password: impl Into<String>) -> Self {
        self.password = Some(Password(password.into()));
        self
    }

    /// The login settings with this builder's username and password put in.
    /// A username without any password is refused: redis-rs logs in only
    /// with a password, so it would be dropped without a word.
    fn login(
        &self,
        settings: &redis::RedisConnectionInfo,
    ) -> Result<redis::RedisConnectionInfo, Error> {
        let mut settings = settings.clone();
        if let Some(username) = &self.username {
            settings = settings.set_username(username);
        }
        if let Some(Password(password)) = &self.password {
            settings = settings.set_password(password);
        }
        if self.username.is_some() && settings.password().is_none() {
            return Err(Error::InvalidArgument(
                "a username needs a password (Redis logs in with AUTH user password)".into(),
            ));
        }
        Ok(settings)
    }

    /// A parsed URL with the TLS certificates and the login put in.
    fn prepare(
        &self,
        client: &redis::Client,
        tls: TlsRef<'_>,
        login: bool,
    ) -> Result<redis::Client, Error> {
        let info = client.get_connection_info().clone();
        let info = if login {
            let settings = self.login(info.redis_settings())?;
            info.set_redis_settings(settings)
        } else {
            info
        };
        match (info.addr(), tls) {
            #[cfg(feature = "tls-rustls")]
            (redis::ConnectionAddr::TcpTls { .. }, Some(tls)) => {
                redis::Client::build_with_tls(info, tls.certificates())
                    .map_err(|e| Error::InvalidArgument(format!("TLS: {e}")))
            }
            _ => redis::Client::open(info)
                .map_err(|e| Error::InvalidArgument(format!("cannot use the Redis URL: {e}"))),
        }
    }

    /// The client's TLS: made when a URL is `rediss://` or a TLS setting
    /// was given, and refused when the settings cannot apply.
    #[cfg(feature = "tls-rustls")]
    fn tls(&self, clients: &[redis::Client]) -> Result<Option<Tls>, Error> {
        let secure = clients.iter().any(|c| {
            matches!(
                c.get_connection_info().addr(),
                redis::ConnectionAddr::TcpTls { .. }
            )
        });
        if self.tls.is_set() && !secure {
            return Err(Error::InvalidArgument(
                "TLS settings (CA, client certificate) were given but no URL is rediss://".into(),
            ));
        }
        secure.then(|| Tls::new(&self.tls)).transpose()
    }

    #[cfg(not(feature = "tls-rustls"))]
    fn tls(&self, _clients: &[redis::Client]) -> Result<Option<std::convert::Infallible>, Error> {
        if self.tls.is_set() {
            return Err(Error::InvalidArgument(
                "TLS settings need redmutex's `tls-rustls` cargo feature".into(),
            ));
        }
        Ok(None)
    }

    /// Makes the client. Nothing is sent to Redis.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when no deployment was given, a URL does
    /// not parse, the list of servers is empty, the Sentinel primary's name
    /// is empty, the timeout is out of range, the pool size is 0, the key
    /// prefix holds a brace, or the label is empty, longer than 64 bytes or
    /// holds `|`, whitespace or a control character; for TLS, when a CA,
    /// certificate or key file cannot be read or holds no usable PEM, when
    /// TLS settings are given without a `rediss://` URL, or when the
    /// `tls-rustls` feature is off and TLS is asked for.
    pub fn build(self) -> Result<LockClient, Error> {
        check_timeout(self.timeout)?;
        let identity = Identity::new(
            self.holder_metadata,
            self.program.as_deref(),
            self.label.as_deref(),
        )?;
        let names = Namespace::new(&self.key_prefix).map_err(Error::InvalidArgument)?;
        if self.pool_size == 0 {
            return Err(Error::InvalidArgument(
                "the pool size must be at least 1".into(),
            ));
        }
        let (timeout, size) = (self.timeout, self.pool_size);
        let notify = |source: Option<Source>| source.filter(|_| self.notify);
        let client = match &self.servers {
            Servers::None => {
                return Err(Error::InvalidArgument(
                    "no deployment given: call url, cluster or sentinel on the builder".into(),
                ));
            }
            Servers::Single(url) => {
                let parsed = parse_url(url)?;
                let tls = self.tls(std::slice::from_ref(&parsed))?;
                let client = self.prepare(&parsed, tls.as_ref(), true)?;
                let info = client
                    .get_connection_info()
                    .clone()
                    .set_tcp_settings(tcp_settings(timeout));
                let backend = Backend::own(Target::Single(info), timeout, size);
                LockClient::build(
                    backend,
                    notify(Source::servers([&client], tls.as_ref())),
                    Some(client),
                    names,
                )
            }
            Servers::Cluster(urls) => {
                let parsed = parse_urls(urls)?;
                let tls = self.tls(&parsed)?;
                let seeds = parsed
                    .iter()
                    .map(|seed| self.prepare(seed, tls.as_ref(), true))
                    .collect::<Result<Vec<_>, _>>()?;
                // One client per seed, listing the seeds from that one on:
                // a new connection starts from the seed that answered last.
                let build = |infos: Vec<redis::ConnectionInfo>| {
                    let builder = ClusterClient::builder(infos);
                    // Nodes found through `CLUSTER SLOTS` get the same
                    // certificates as the seeds.
                    // `certs` alone would make them verified even for an
                    // `#insecure` seed: say which mode the seeds asked for.
                    #[cfg(feature = "tls-rustls")]
                    let builder = match &tls {
                        Some(tls) => {
                            let insecure = seeds.first().is_some_and(|seed| {
                                matches!(
                                    seed.get_connection_info().addr(),
                                    redis::ConnectionAddr::TcpTls { insecure: true, .. }
                                )
                            });
                            builder
                                .tls(if insecure {
                                    redis::TlsMode::Insecure
                                } else {
                                    redis::TlsMode::Secure
                                })
                                .certs(tls.certificates())
                        }
                        None => builder,
                    };
                    builder
                        .connection_timeout(timeout)
                        .response_timeout(timeout)
                        .tcp_settings(tcp_settings(timeout))
                        // redis-rs waits at least 1.28 s per retry by default, up
                        // to 16 times: a lock call must fail sooner than that.
                        .retries(CLUSTER_RETRIES)
                        .min_retry_wait(10)
                        .max_retry_wait(500)
                        .build()
                        .map_err(|e| {
                            Error::InvalidArgument(format!("cannot use the cluster URLs: {e}"))
                        })
                };
                let infos = seeds
                    .iter()
                    .map(redis::Client::get_connection_info)
                    .cloned()
                    .collect::<Vec<_>>();
                let cluster = ClusterTarget::new(infos, build)?;
                let backend = Backend::own(Target::Cluster(cluster), timeout, size);
                LockClient::build(
                    backend,
                    notify(Source::cluster(&seeds, tls.as_ref())),
                    None,
                    names,
                )
            }
            Servers::Sentinel { sentinels, master } => {
                let parsed = parse_urls(sentinels)?;
                let tls = self.tls(&parsed)?;
                let seeds = parsed
                    .iter()
                    .map(|seed| self.prepare(seed, tls.as_ref(), false))
                    .collect::<Result<Vec<_>, _>>()?;
                let primary = self.login(&self.primary)?;
                if master.is_empty() {
                    return Err(Error::InvalidArgument(
                        "the name of the primary must not be empty".into(),
                    ));
                }
                let infos: Vec<redis::ConnectionInfo> = seeds
                    .iter()
                    .map(|client| {
                        client
                            .get_connection_info()
                            .clone()
                            .set_tcp_settings(tcp_settings(timeout))
                    })
                    .collect();
                let target = SentinelTarget::new(infos, master.clone(), primary.clone());
                let backend = Backend::own(Target::Sentinel(target), timeout, size);
                LockClient::build(
                    backend,
                    notify(Source::sentinel(&seeds, master, &primary, tls.as_ref())),
                    None,
                    names,
                )
            }
        };
        Ok(client.with_defaults(self.defaults).with_identity(identity))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_builder_shows_no_password_of_its_urls() {
        let secret = "s3cr3t-pw";
        let builders = [
            LockClient::builder().url(format!("redis://app:{secret}@127.0.0.1:1/0")),
            LockClient::builder().url(format!("rediss://:{secret}@127.0.0.1:1")),
            LockClient::builder().url(format!("redis+unix:///tmp/redis.sock?pass={secret}")),
            LockClient::builder().cluster([format!("redis://u:{secret}@127.0.0.1:1")]),
            LockClient::builder().sentinel([format!("redis://:{secret}@127.0.0.1:1")], "m"),
            LockClient::builder()
                .url("redis://127.0.0.1:1")
                .password(secret),
        ];
        for builder in builders {
            let shown = format!("{builder:?}");
            assert!(!shown.contains(secret), "{shown}");
            assert!(
                shown.contains("127.0.0.1:1") || shown.contains("redis.sock"),
                "{shown}"
            );
        }
        assert_eq!(
            redact_url("redis://user:pw@host:6379/2"),
            "redis://<redacted>@host:6379/2"
        );
        assert_eq!(redact_url("redis://host:6379/2"), "redis://host:6379/2");
        assert_eq!(
            redact_url("redis://host/0?x=@y"),
            "redis://host/0?<redacted>"
        );
        assert_eq!(redact_url("not a url"), "not a url");
    }

    #[test]
    fn bad_settings_are_refused_before_anything_is_sent() {
        let single = || LockClient::builder().url("redis://127.0.0.1:1/");
        assert!(LockClient::builder().build().is_err(), "no deployment");
        assert!(single().timeout(Duration::ZERO).build().is_err());
        assert!(single().timeout(Duration::MAX).build().is_err());
        assert!(single().pool_size(0).build().is_err());
        assert!(LockClient::builder().url("nonsense").build().is_err());
        let none: [&str; 0] = [];
        assert!(LockClient::builder().cluster(none).build().is_err());
        assert!(
            LockClient::builder()
                .sentinel(["redis://127.0.0.1:1"], "")
                .build()
                .is_err()
        );
        assert!(single().key_prefix("{team}:").build().is_err());
        assert!(single().pool_size(1).notify(false).build().is_ok());
        assert!(single().label("two words").build().is_err());
        assert!(single().label("nightly").program("reindex").build().is_ok());
        let client = single().key_prefix("team:").build().expect("a prefix");
        assert_eq!(client.key_prefix(), "team:");
    }
}
