//! Local deployments beyond one server, built with the tools Redis ships:
//! a Redis Cluster made by `redis-cli --cluster create`, and a primary with a
//! replica watched by three sentinels. Every process is a [`RedisServer`] on
//! free loopback ports, killed on drop.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use super::{RedisServer, wait_until};

/// How long a deployment may take to settle (cluster state ok, sentinels
/// that know each other and the replica).
const SETTLE_WITHIN: Duration = Duration::from_secs(30);

/// The redis-cli binary: `$REDIS_CLI`, `redis-cli` beside redis-server, or
/// on the PATH.
pub fn redis_cli_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("REDIS_CLI") {
        return PathBuf::from(path);
    }
    let beside = super::redis_server_binary().with_file_name("redis-cli");
    if beside.is_file() {
        return beside;
    }
    PathBuf::from("redis-cli")
}

/// A Redis Cluster on loopback.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

/// One line of `CLUSTER NODES`.
#[derive(Clone, Debug)]
pub struct ClusterNode {
    pub id: String,
    pub port: u16,
    pub primary: bool,
    /// For a replica, the id of its primary.
    pub primary_id: Option<String>,
    /// Slot ranges served (primaries).
    pub slots: Vec<(u16, u16)>,
}

impl RedisCluster {
    /// `masters` primaries sharing the 16384 slots, each with
    /// `replicas_per_master` replicas, created by `redis-cli --cluster
    /// create`; returns once every node reports `cluster_state:ok`, agrees
    /// on the slot owners and every replica is in sync.
    pub fn start(masters: usize, replicas_per_master: usize) -> RedisCluster {
        let count = masters * (1 + replicas_per_master);
        let nodes: Vec<RedisServer> = (0..count)
            .map(|_| {
                RedisServer::start_cluster_node(&[
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                ])
            })
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let output = Command::new(redis_cli_binary())
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", &replicas_per_master.to_string()])
            .arg("--cluster-yes")
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {:?} ({e}); it comes with redis-server \
                     (Debian: apt-get install redis-tools)",
                    redis_cli_binary()
                )
            });
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let cluster = RedisCluster { nodes };
        assert!(
            cluster.wait_settled(SETTLE_WITHIN),
            "the cluster did not settle: {:?}",
            cluster.topology()
        );
        cluster
    }

    /// Waits until every node says `cluster_state:ok`, all see the same
    /// primaries with all slots covered, and every replica's link is up.
    pub fn wait_settled(&self, within: Duration) -> bool {
        wait_until(within, || {
            let views: Vec<Option<Vec<ClusterNode>>> =
                self.nodes.iter().map(|n| self.nodes_seen_by(n)).collect();
            let Some(Some(first)) = views.first() else {
                return false;
            };
            let primaries = |view: &[ClusterNode]| {
                let mut owners: Vec<(u16, Vec<(u16, u16)>)> = view
                    .iter()
                    .filter(|n| n.primary && !n.slots.is_empty())
                    .map(|n| (n.port, n.slots.clone()))
                    .collect();
                owners.sort();
                owners
            };
            let expected = primaries(first);
            let covered: u32 = expected
                .iter()
                .flat_map(|(_, ranges)| ranges)
                .map(|(a, b)| u32::from(b - a) + 1)
                .sum();
            covered == 16384
                && views
                    .iter()
                    .all(|v| v.as_deref().map(primaries).as_ref() == Some(&expected))
                && self.nodes.iter().all(|n| {
                    let info: String = n
                        .try_query(redis::cmd("CLUSTER").arg("INFO"))
                        .unwrap_or_default();
                    let replication: String = n
                        .try_query(redis::cmd("INFO").arg("replication"))
                        .unwrap_or_default();
                    info.contains("cluster_state:ok")
                        && (replication.contains("role:master")
                            || replication.contains("master_link_status:up"))
                })
        })
    }

    /// `redis://` URLs of every node (seeds for a cluster client).
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    pub fn node(&self, port: u16) -> &RedisServer {
        self.nodes
            .iter()
            .find(|n| n.port() == port)
            .expect("a node of this cluster")
    }

    /// A lock client over the whole cluster.
    pub fn lock_client(&self) -> redmutex::LockClient {
        redmutex::LockClient::open_cluster(self.urls()).expect("open a cluster LockClient")
    }

    /// The cluster as one node sees it (`CLUSTER NODES`).
    pub fn nodes_seen_by(&self, node: &RedisServer) -> Option<Vec<ClusterNode>> {
        let text: String = node.try_query(redis::cmd("CLUSTER").arg("NODES"))?;
        Some(text.lines().filter_map(parse_node_line).collect())
    }

    /// The topology seen by the first node that answers.
    pub fn topology(&self) -> Vec<ClusterNode> {
        self.nodes
            .iter()
            .find_map(|n| self.nodes_seen_by(n))
            .unwrap_or_default()
    }

    /// `CLUSTER KEYSLOT name`.
    pub fn slot(&self, name: &str) -> u16 {
        self.nodes
            .iter()
            .find_map(|n| n.try_query(redis::cmd("CLUSTER").arg("KEYSLOT").arg(name)))
            .expect("CLUSTER KEYSLOT")
    }

    /// The primary serving `slot`.
    pub fn primary_for_slot(&self, slot: u16) -> ClusterNode {
        self.try_primary_for_slot(slot)
            .expect("a primary for every slot")
    }

    /// The primary serving `slot`, if the first node that answers knows
    /// one now (during a failover it may know none for a moment).
    pub fn try_primary_for_slot(&self, slot: u16) -> Option<ClusterNode> {
        self.topology()
            .into_iter()
            .find(|n| n.primary && n.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot)))
    }

    /// The primary serving `key`.
    pub fn primary_for(&self, key: &str) -> &RedisServer {
        let port = self.primary_for_slot(self.slot(key)).port;
        self.node(port)
    }

    /// The replicas of the primary with id `primary_id`.
    pub fn replicas_of(&self, primary_id: &str) -> Vec<ClusterNode> {
        self.topology()
            .into_iter()
            .filter(|n| n.primary_id.as_deref() == Some(primary_id))
            .collect()
    }

    /// For each primary, in slot order, a key it serves (`{prefix-N}`
    /// style names, found by asking `CLUSTER KEYSLOT`).
    pub fn key_per_primary(&self, prefix: &str) -> Vec<String> {
        let mut primaries: Vec<ClusterNode> =
            self.topology().into_iter().filter(|n| n.primary).collect();
        primaries.sort_by_key(|n| n.slots.first().copied());
        let mut keys = Vec::new();
        for primary in &primaries {
            let key = (0..10_000)
                .map(|i| format!("{prefix}-{i}"))
                .find(|key| {
                    let slot = self.slot(key);
                    primary.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot))
                })
                .expect("a key for every primary");
            keys.push(key);
        }
        keys
    }

    /// Total keys on all primaries.
    pub fn total_keys(&self) -> u64 {
        self.topology()
            .iter()
            .filter(|n| n.primary)
            .map(|n| {
                self.node(n.port)
                    .try_query::<u64>(&mut redis::cmd("DBSIZE"))
                    .unwrap_or(0)
            })
            .sum()
    }
}

/// `id ip:port@bus flags primary ping pong epoch state slots...`
fn parse_node_line(line: &str) -> Option<ClusterNode> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    if fields.len() < 8 {
        return None;
    }
    let port = fields[1]
        .split('@')
        .next()?
        .rsplit(':')
        .next()?
        .parse()
        .ok()?;
    let flags = fields[2];
    if flags.contains("fail") && !flags.contains("fail?") {
        return None;
    }
    let primary = flags.contains("master");
    let primary_id = (fields[3] != "-").then(|| fields[3].to_owned());
    let slots = fields[8..]
        .iter()
        .filter(|s| !s.starts_with('['))
        .filter_map(|range| match range.split_once('-') {
            Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
            None => range.parse().ok().map(|s| (s, s)),
        })
        .collect();
    Some(ClusterNode {
        id: fields[0].to_owned(),
        port,
        primary,
        primary_id,
        slots,
    })
}

/// A primary, one replica, and three sentinels watching them under
/// [`SentinelSet::MASTER`].
pub struct SentinelSet {
    pub primary: RedisServer,
    pub replica: RedisServer,
    pub sentinels: Vec<RedisServer>,
}

impl SentinelSet {
    pub const MASTER: &'static str = "redmutex-primary";

    /// Starts the set and waits until every sentinel knows the replica and
    /// the two other sentinels (so a failover can be agreed on).
    pub fn start() -> SentinelSet {
        let primary = RedisServer::start();
        let replica = RedisServer::start_replica_of(&primary);
        SentinelSet::watching(primary, replica)
    }

    /// As [`SentinelSet::start`], but the replica replicates through the
    /// returned proxy, so a test can cut replication (blackhole, then
    /// reset: what was held is never delivered) and lose the last writes
    /// in a failover.
    pub fn start_with_replication_proxy() -> (SentinelSet, super::FaultProxy) {
        let primary = RedisServer::start();
        let proxy = super::FaultProxy::to(&primary);
        let link = proxy.port().to_string();
        let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &link]);
        assert!(
            replica.synced(),
            "the replica did not sync through the proxy"
        );
        (SentinelSet::watching(primary, replica), proxy)
    }

    /// Three sentinels on `primary`, once they know `replica` and each other.
    fn watching(primary: RedisServer, replica: RedisServer) -> SentinelSet {
        let sentinels: Vec<RedisServer> = (0..3).map(|_| start_sentinel(&primary)).collect();
        let set = SentinelSet {
            primary,
            replica,
            sentinels,
        };
        let ready = wait_until(SETTLE_WITHIN, || {
            sentinels_know_each_other(&set.sentinels, Self::MASTER)
        });
        assert!(
            ready,
            "the sentinels did not find the replica and each other"
        );
        set
    }

    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(RedisServer::url).collect()
    }

    /// A lock client that finds the primary through the sentinels.
    pub fn lock_client(&self) -> redmutex::LockClient {
        redmutex::LockClient::open_sentinel(self.sentinel_urls(), Self::MASTER)
            .expect("open a sentinel LockClient")
    }

    /// The primary's port as the first answering sentinel names it.
    pub fn primary_port(&self) -> Option<u16> {
        self.sentinels.iter().find_map(|s| {
            let (_host, port): (String, u16) = s.try_query(
                redis::cmd("SENTINEL")
                    .arg("GET-MASTER-ADDR-BY-NAME")
                    .arg(Self::MASTER),
            )?;
            Some(port)
        })
    }
}

/// Whether every sentinel knows `master`'s one replica and the other two
/// sentinels (so a failover can be agreed on).
pub(crate) fn sentinels_know_each_other(sentinels: &[RedisServer], master: &str) -> bool {
    sentinels.iter().all(|s| {
        let replicas: Vec<redis::Value> = s
            .try_query(redis::cmd("SENTINEL").arg("REPLICAS").arg(master))
            .unwrap_or_default();
        let peers: Vec<redis::Value> = s
            .try_query(redis::cmd("SENTINEL").arg("SENTINELS").arg(master))
            .unwrap_or_default();
        replicas.len() == 1 && peers.len() == 2
    })
}

fn start_sentinel(primary: &RedisServer) -> RedisServer {
    let (dir, config) = sentinel_config(SentinelSet::MASTER, primary.port());
    RedisServer::start_in(dir, Some(config), &["--sentinel"])
}

/// A temporary directory with a `sentinel.conf` that monitors `master` at
/// 127.0.0.1:`port` (quorum 2, down after 1 s), for a sentinel to rewrite.
pub(crate) fn sentinel_config(master: &str, port: u16) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = super::temp_dir();
    let config = dir.path().join("sentinel.conf");
    std::fs::write(
        &config,
        format!(
            "sentinel monitor {master} 127.0.0.1 {port} 2\n\
             sentinel down-after-milliseconds {master} 1000\n\
             sentinel failover-timeout {master} 5000\n\
             sentinel parallel-syncs {master} 1\n"
        ),
    )
    .expect("write sentinel.conf");
    (dir, config)
}
