//! TLS servers for tests: certificates made at test time with `rcgen` (a CA,
//! a server certificate for 127.0.0.1 and localhost, a client certificate,
//! a second CA that signed none of them, and the faulty certificates each
//! TLS refusal needs: expired, not yet valid, for another name, for the
//! wrong purpose, from the other CA), and a redis-server with a TLS port
//! beside its plain one (the plain port is for setting up and inspecting,
//! as in every other test).

use std::path::PathBuf;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, date_time_ymd,
};

use super::{RedisServer, free_port_other_than, temp_dir};

/// Certificate and key files in a temporary directory.
pub struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    /// Makes every file; panics only on a broken test setup.
    pub fn new() -> Pki {
        let dir = temp_dir();
        let write = |name: &str, pem: &str| {
            std::fs::write(dir.path().join(name), pem).expect("write a PEM file");
        };
        let ca = authority("redmutex test CA");
        write("ca.pem", &ca.pem());
        let other = authority("some other CA");
        write("other-ca.pem", &other.pem());

        let issue = |name: &str, params: CertificateParams, by: &CertifiedIssuer<'_, KeyPair>| {
            let key = KeyPair::generate().expect("a key");
            let cert = params.signed_by(&key, by).expect("sign");
            write(&format!("{name}.pem"), &cert.pem());
            write(&format!("{name}.key"), &key.serialize_pem());
        };
        let loopback = || vec!["127.0.0.1".to_owned(), "localhost".to_owned()];
        issue("server", server_params(loopback()), &ca);
        issue("client", client_params(), &ca);

        // Each faulty certificate differs from the good one in one thing.
        issue(
            "expired-server",
            valid(server_params(loopback()), 2000, 2001),
            &ca,
        );
        issue(
            "future-server",
            valid(server_params(loopback()), 2090, 2099),
            &ca,
        );
        issue(
            "wrong-name-server",
            server_params(vec!["redis.example.com".into(), "192.0.2.7".into()]),
            &ca,
        );
        let mut client_only = server_params(loopback());
        client_only.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        issue("client-only-server", client_only, &ca);
        issue("other-ca-client", client_params(), &other);
        issue("expired-client", valid(client_params(), 2000, 2001), &ca);
        issue("future-client", valid(client_params(), 2090, 2099), &ca);
        let mut server_only = client_params();
        server_only.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        issue("server-only-client", server_only, &ca);

        // What `openssl req -x509 -newkey rsa -subj /CN=... -addext
        // subjectAltName=IP:127.0.0.1` makes: a self-signed certificate
        // marked CA:TRUE, used as the server's own.
        let mut own = CertificateParams::new(vec!["127.0.0.1".into(), "localhost".into()])
            .expect("self-signed names");
        own.distinguished_name
            .push(DnType::CommonName, "redis-server");
        own.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let own_key = KeyPair::generate().expect("self-signed key");
        let own_cert = own.self_signed(&own_key).expect("self-sign");
        write("self-signed-ca.pem", &own_cert.pem());
        write("self-signed-ca.key", &own_key.serialize_pem());
        Pki { dir }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The CA that signed the server's and the client's certificates.
    pub fn ca(&self) -> PathBuf {
        self.path("ca.pem")
    }

    /// A CA that signed neither.
    pub fn other_ca(&self) -> PathBuf {
        self.path("other-ca.pem")
    }

    pub fn client_cert(&self) -> PathBuf {
        self.path("client.pem")
    }

    pub fn client_key(&self) -> PathBuf {
        self.path("client.key")
    }

    /// The certificate and key of `NAME.pem` and `NAME.key`, for
    /// `tls_client_cert_files`: `client`, or one of the faulty client
    /// certificates (`other-ca-client`, `expired-client`, `future-client`,
    /// `server-only-client`).
    pub fn client_pair(&self, name: &str) -> (PathBuf, PathBuf) {
        (
            self.path(&format!("{name}.pem")),
            self.path(&format!("{name}.key")),
        )
    }

    /// A self-signed server certificate marked `CA:TRUE`, as `openssl req
    /// -x509` makes one ([`TlsServer::start_self_signed_ca`]).
    pub fn self_signed_ca(&self) -> PathBuf {
        self.path("self-signed-ca.pem")
    }

    /// The redis-server arguments for a TLS port with these files.
    pub fn server_args(&self, tls_port: u16, require_client_cert: bool) -> Vec<String> {
        self.server_args_with(tls_port, require_client_cert, "server")
    }

    /// As [`Pki::server_args`], with `NAME.pem` and `NAME.key` as the
    /// server's certificate and key.
    fn server_args_with(&self, tls_port: u16, require_client_cert: bool, own: &str) -> Vec<String> {
        let path = |name: &str| self.path(name).display().to_string();
        vec![
            "--tls-port".into(),
            tls_port.to_string(),
            "--tls-cert-file".into(),
            path(&format!("{own}.pem")),
            "--tls-key-file".into(),
            path(&format!("{own}.key")),
            "--tls-ca-cert-file".into(),
            path("ca.pem"),
            "--tls-auth-clients".into(),
            if require_client_cert { "yes" } else { "no" }.into(),
        ]
    }
}

impl Default for Pki {
    fn default() -> Self {
        Pki::new()
    }
}

/// A server certificate for `names`. Both purposes: servers also dial each
/// other (replication, the cluster bus) with it as their client
/// certificate.
fn server_params(names: Vec<String>) -> CertificateParams {
    let mut params = CertificateParams::new(names).expect("server names");
    params
        .distinguished_name
        .push(DnType::CommonName, "redis-server");
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params
}

fn client_params() -> CertificateParams {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("client params");
    params
        .distinguished_name
        .push(DnType::CommonName, "redmutex client");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    params
}

/// `params` valid from January 1st of `from` to January 1st of `to`:
/// years well away from today, so "expired" and "not yet valid" hold
/// whatever the date.
fn valid(mut params: CertificateParams, from: i32, to: i32) -> CertificateParams {
    params.not_before = date_time_ymd(from, 1, 1);
    params.not_after = date_time_ymd(to, 1, 1);
    params
}

fn authority(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    CertifiedIssuer::self_signed(params, KeyPair::generate().expect("CA key")).expect("self-sign")
}

/// A redis-server with a plain port and a TLS port.
pub struct TlsServer {
    pub server: RedisServer,
    pub tls_port: u16,
    pub pki: Pki,
}

impl TlsServer {
    /// Starts one; `require_client_cert` makes it refuse clients without a
    /// certificate its CA signed (mutual TLS).
    pub fn start(require_client_cert: bool) -> TlsServer {
        TlsServer::start_with("server", require_client_cert, &[])
    }

    /// One whose certificate is self-signed and marked `CA:TRUE`
    /// ([`Pki::self_signed_ca`]).
    pub fn start_self_signed_ca() -> TlsServer {
        TlsServer::start_with("self-signed-ca", false, &[])
    }

    /// One with `NAME.pem` and `NAME.key` of its [`Pki`] as its own
    /// certificate and key (`server`, or one of the faulty ones:
    /// `expired-server`, `future-server`, `wrong-name-server`,
    /// `client-only-server`), and `extra` redis-server arguments (say
    /// `--tls-protocols TLSv1.2`).
    pub fn start_with(own: &str, require_client_cert: bool, extra: &[&str]) -> TlsServer {
        let pki = Pki::new();
        let mut tls_port = 0;
        let server = RedisServer::start_tries(temp_dir(), None, |port| {
            tls_port = free_port_other_than(port);
            let mut args = pki.server_args_with(tls_port, require_client_cert, own);
            args.extend(extra.iter().map(|arg| arg.to_string()));
            args
        });
        TlsServer {
            server,
            tls_port,
            pki,
        }
    }

    /// `rediss://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}/", self.tls_port)
    }

    /// A builder for this server with its CA (and nothing else).
    pub fn builder(&self) -> redmutex::LockClientBuilder {
        redmutex::LockClient::builder()
            .url(self.url())
            .tls_ca_file(self.pki.ca())
    }

    /// As [`TlsServer::builder`], with the client certificate.
    pub fn builder_with_cert(&self) -> redmutex::LockClientBuilder {
        self.builder()
            .tls_client_cert_files(self.pki.client_cert(), self.pki.client_key())
    }
}

/// A primary, a replica and three sentinels, all speaking TLS to each
/// other and on their TLS ports (`tls-replication yes`), so the sentinels
/// name the primary's TLS port. Each also keeps its plain port for the
/// test's own inspection.
pub struct TlsSentinelSet {
    pub primary: RedisServer,
    pub replica: RedisServer,
    pub sentinels: Vec<RedisServer>,
    /// The TLS ports of the primary, the replica and each sentinel.
    pub primary_tls: u16,
    pub sentinel_tls: Vec<u16>,
    pub pki: Pki,
}

impl TlsSentinelSet {
    pub const MASTER: &'static str = "redmutex-tls-primary";

    pub fn start() -> TlsSentinelSet {
        let pki = Pki::new();
        let mut primary_tls = 0;
        let primary = RedisServer::start_tries(temp_dir(), None, |port| {
            primary_tls = free_port_other_than(port);
            let mut args = pki.server_args(primary_tls, false);
            args.extend(["--tls-replication".into(), "yes".into()]);
            args
        });
        let replica = RedisServer::start_tries(temp_dir(), None, |port| {
            let tls = free_port_other_than(port);
            let mut args = pki.server_args(tls, false);
            args.extend([
                "--tls-replication".into(),
                "yes".into(),
                "--replicaof".into(),
                "127.0.0.1".into(),
                primary_tls.to_string(),
            ]);
            args
        });
        let mut sentinel_tls = Vec::new();
        let sentinels: Vec<RedisServer> = (0..3)
            .map(|_| {
                let (dir, config) = super::deploy::sentinel_config(Self::MASTER, primary_tls);
                let mut tls = 0;
                let server = RedisServer::start_tries(dir, Some(config), |port| {
                    tls = free_port_other_than(port);
                    let mut args: Vec<String> = vec!["--sentinel".into()];
                    args.extend(pki.server_args(tls, false));
                    args.extend(["--tls-replication".into(), "yes".into()]);
                    args
                });
                sentinel_tls.push(tls);
                server
            })
            .collect();
        let set = TlsSentinelSet {
            primary,
            replica,
            sentinels,
            primary_tls,
            sentinel_tls,
            pki,
        };
        let ready = super::wait_until(Duration::from_secs(30), || {
            super::deploy::sentinels_know_each_other(&set.sentinels, Self::MASTER)
                && set.replica.synced()
        });
        assert!(
            ready,
            "the TLS sentinels did not find the replica and each other"
        );
        set
    }

    /// `rediss://` URLs of the sentinels' TLS ports.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinel_tls
            .iter()
            .map(|port| format!("rediss://127.0.0.1:{port}/"))
            .collect()
    }

    /// A builder over the sentinels with the CA.
    pub fn builder(&self) -> redmutex::LockClientBuilder {
        redmutex::LockClient::builder()
            .sentinel(self.sentinel_urls(), Self::MASTER)
            .tls_ca_file(self.pki.ca())
    }

    /// The primary's port as the first answering sentinel names it.
    pub fn named_port(&self) -> Option<u16> {
        self.sentinels
            .iter()
            .find_map(|s| super::deploy::named_primary(s, Self::MASTER))
    }
}

/// A Redis Cluster of three primaries speaking TLS on their TLS ports and
/// on the cluster bus (`tls-cluster yes`): `CLUSTER SLOTS` asked over TLS
/// names the TLS ports.
pub struct TlsCluster {
    pub nodes: Vec<RedisServer>,
    pub tls_ports: Vec<u16>,
    pub pki: Pki,
}

impl TlsCluster {
    pub fn start() -> TlsCluster {
        let pki = Pki::new();
        let mut tls_ports = Vec::new();
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| {
                let mut tls = 0;
                let node = RedisServer::start_tries(temp_dir(), None, |port| {
                    tls = free_port_other_than(port);
                    let bus = free_port_other_than(tls);
                    let mut args: Vec<String> = [
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "1000",
                        "--tls-cluster",
                        "yes",
                        "--cluster-port",
                    ]
                    .iter()
                    .map(|s| s.to_string())
                    .collect();
                    args.push(bus.to_string());
                    args.extend(pki.server_args(tls, false));
                    args
                });
                tls_ports.push(tls);
                node
            })
            .collect();
        let path = |p: PathBuf| p.display().to_string();
        let log = pki.path("create.log");
        let mut create = std::process::Command::new(super::redis_cli_binary())
            .args(["--tls", "--cacert", &path(pki.ca())])
            .args(["--cluster", "create"])
            .args(tls_ports.iter().map(|p| format!("127.0.0.1:{p}")))
            .arg("--cluster-yes")
            .stdout(std::fs::File::create(&log).expect("create.log"))
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("run redis-cli --cluster create");
        // Bounded: a cluster whose nodes never meet (a certificate the bus
        // refuses) would keep redis-cli waiting for ever.
        let mut status = None;
        super::wait_until(Duration::from_secs(60), || {
            status = create.try_wait().ok().flatten();
            status.is_some()
        });
        if status.is_none() {
            let _ = create.kill();
            let _ = create.wait();
        }
        assert!(
            status.is_some_and(|s| s.success()),
            "redis-cli --cluster create over TLS failed ({status:?}):\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        let cluster = TlsCluster {
            nodes,
            tls_ports,
            pki,
        };
        let settled = super::wait_until(Duration::from_secs(30), || {
            cluster.nodes.iter().all(|n| {
                n.try_query::<String>(redis::cmd("CLUSTER").arg("INFO"))
                    .is_some_and(|info| info.contains("cluster_state:ok"))
            })
        });
        assert!(settled, "the TLS cluster did not settle");
        cluster
    }

    /// A builder over the first node's TLS port with the CA.
    pub fn builder(&self) -> redmutex::LockClientBuilder {
        redmutex::LockClient::builder()
            .cluster([format!("rediss://127.0.0.1:{}/", self.tls_ports[0])])
            .tls_ca_file(self.pki.ca())
    }

    /// The node (plain connection) that serves `key`'s slot.
    pub fn node_for(&self, key: &str) -> Option<&RedisServer> {
        let slot: u16 = self
            .nodes
            .first()?
            .try_query(redis::cmd("CLUSTER").arg("KEYSLOT").arg(key))?;
        self.nodes.iter().find(|n| owns(n, slot))
    }
}

/// Whether `node` serves `slot`: its `CLUSTER MYID` is the owner its
/// `CLUSTER SLOTS` names.
fn owns(node: &RedisServer, slot: u16) -> bool {
    let Some(id) = node.try_query::<String>(redis::cmd("CLUSTER").arg("MYID")) else {
        return false;
    };
    let Some(slots) = node.try_query::<Vec<redis::Value>>(redis::cmd("CLUSTER").arg("SLOTS"))
    else {
        return false;
    };
    slots.iter().any(|range| {
        let redis::Value::Array(parts) = range else {
            return false;
        };
        let bound = |i: usize| {
            parts
                .get(i)
                .and_then(|v| redis::from_redis_value::<u16>(v.clone()).ok())
        };
        let owner = parts.get(2).and_then(|p| match p {
            redis::Value::Array(fields) => fields
                .get(2)
                .and_then(|v| redis::from_redis_value::<String>(v.clone()).ok()),
            _ => None,
        });
        matches!((bound(0), bound(1)), (Some(lo), Some(hi)) if lo <= slot && slot <= hi)
            && owner.as_deref() == Some(id.as_str())
    })
}
