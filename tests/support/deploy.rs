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
        RedisCluster::start_with_node_timeout(masters, replicas_per_master, 1000)
    }

    /// [`RedisCluster::start`] with `cluster-node-timeout` in milliseconds:
    /// how long a node may stall before the others call it failed (and,
    /// with no replica to take over, the whole cluster down).
    pub fn start_with_node_timeout(
        masters: usize,
        replicas_per_master: usize,
        node_timeout_ms: u32,
    ) -> RedisCluster {
        let count = masters * (1 + replicas_per_master);
        let node_timeout = node_timeout_ms.to_string();
        let nodes: Vec<RedisServer> = (0..count)
            .map(|_| {
                RedisServer::start_cluster_node(&[
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    &node_timeout,
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
        redmutex::LockClient::builder()
            .cluster(self.urls())
            .build()
            .expect("open a cluster LockClient")
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

    /// Moves `slot` from the primary `from` to the primary `to` the way
    /// `redis-cli --cluster reshard` does: IMPORTING, MIGRATING, MIGRATE of
    /// its keys in batches of 50 with a short pause (a script's keys are
    /// split between the nodes for a while: TRYAGAIN), then the new owner
    /// announced to every node.
    pub fn migrate_slot(
        &self,
        slot: u16,
        from: &ClusterNode,
        to: &ClusterNode,
    ) -> Result<(), String> {
        let source = self.node(from.port);
        let target = self.node(to.port);
        let setslot = |node: &RedisServer, state: &str, id: Option<&str>| -> Result<(), String> {
            let mut con = connect(node)?;
            redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg(state)
                .arg(id)
                .exec(&mut con)
                .map_err(|e| format!("CLUSTER SETSLOT {slot} {state} on {}: {e}", node.port()))
        };
        let attempt = || -> Result<(), String> {
            setslot(target, "IMPORTING", Some(&from.id))?;
            setslot(source, "MIGRATING", Some(&to.id))?;
            std::thread::sleep(Duration::from_millis(20));
            let mut con = connect(source)?;
            for _ in 0..1000 {
                let keys: Vec<String> = redis::cmd("CLUSTER")
                    .arg("GETKEYSINSLOT")
                    .arg(slot)
                    .arg(50)
                    .query(&mut con)
                    .map_err(|e| format!("GETKEYSINSLOT: {e}"))?;
                if keys.is_empty() {
                    break;
                }
                let _: redis::Value = redis::cmd("MIGRATE")
                    .arg("127.0.0.1")
                    .arg(to.port)
                    .arg("")
                    .arg(0)
                    .arg(5000)
                    .arg("REPLACE")
                    .arg("KEYS")
                    .arg(&keys)
                    .query(&mut con)
                    .map_err(|e| format!("MIGRATE: {e}"))?;
                std::thread::sleep(Duration::from_millis(5));
            }
            setslot(target, "NODE", Some(&to.id))?;
            setslot(source, "NODE", Some(&to.id))
        };
        // Once more if a step failed: some keys may be on the target
        // already, and only finishing keeps them reachable.
        if let Err(e) = attempt().or_else(|_| attempt()) {
            // Not left half-way either: a node with the slot IMPORTING
            // ignores what the bus says of it from then on.
            let _ = setslot(target, "STABLE", None);
            let _ = setslot(source, "STABLE", None);
            return Err(e);
        }
        for node in &self.nodes {
            if node.port() != from.port && node.port() != to.port {
                // Replicas refuse SETSLOT (they learn the owner through
                // the bus), as may a node that is busy failing over.
                let _ = setslot(node, "NODE", Some(&to.id));
            }
        }
        Ok(())
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

/// A connection to `node` with short timeouts, or why not.
fn connect(node: &RedisServer) -> Result<redis::Connection, String> {
    let client = redis::Client::open(node.url()).map_err(|e| e.to_string())?;
    let con = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .map_err(|e| format!("connect to {}: {e}", node.port()))?;
    con.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    Ok(con)
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
        let sentinels = three_sentinels(primary.port());
        SentinelSet {
            primary,
            replica,
            sentinels,
        }
    }

    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(RedisServer::url).collect()
    }

    /// A lock client that finds the primary through the sentinels.
    pub fn lock_client(&self) -> redmutex::LockClient {
        redmutex::LockClient::builder()
            .sentinel(self.sentinel_urls(), Self::MASTER)
            .build()
            .expect("open a sentinel LockClient")
    }

    /// The primary's port as the first answering sentinel names it.
    pub fn primary_port(&self) -> Option<u16> {
        self.sentinels
            .iter()
            .find_map(|s| named_primary(s, Self::MASTER))
    }
}

/// Two redis-servers, each behind its own [`FaultProxy`](super::FaultProxy)
/// that is the address everyone uses (the sentinels monitor it, replicas
/// announce it with `replica-announce-port`, clients are given it), watched
/// by three sentinels under [`SentinelSet::MASTER`]. The replica replicates
/// through the primary's proxy, so [`ProxiedSentinelSet::fail_over_losing_writes`]
/// can cut replication, let clients write, kill the primary and make the
/// sentinels promote a replica that misses those writes, as often as
/// wanted: the killed server comes back as a replica of the new primary,
/// through its proxy again.
pub struct ProxiedSentinelSet {
    pub nodes: [RedisServer; 2],
    pub proxies: [super::FaultProxy; 2],
    pub sentinels: Vec<RedisServer>,
}

impl ProxiedSentinelSet {
    pub fn start() -> ProxiedSentinelSet {
        let nodes = [RedisServer::start(), RedisServer::start()];
        let proxies = [
            super::FaultProxy::to(&nodes[0]),
            super::FaultProxy::to(&nodes[1]),
        ];
        let mut set = ProxiedSentinelSet {
            nodes,
            proxies,
            sentinels: Vec::new(),
        };
        // Node 0 says where it is as a replica too, for after a failover,
        // and syncs a replica at once (not after Redis 7's 5 s wait).
        let announce = set.proxies[0].port().to_string();
        for (name, value) in [
            ("replica-announce-port", announce.as_str()),
            ("repl-diskless-sync-delay", "0"),
        ] {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg(name)
                .arg(value)
                .query(&mut set.nodes[0].conn())
                .expect("CONFIG SET");
        }
        assert!(
            set.make_replica(1, 0),
            "the replica did not sync through the proxy"
        );
        set.sentinels = three_sentinels(set.proxies[0].port());
        set
    }

    /// Restarts node `i` empty as a replica of node `of`, through `of`'s
    /// proxy, and waits until it is in sync.
    fn make_replica(&mut self, i: usize, of: usize) -> bool {
        self.restart(i, Some(of));
        self.nodes[i].synced()
    }

    /// Restarts node `i` empty, announcing its proxy, as a replica of node
    /// `of` through `of`'s proxy, or as a primary.
    fn restart(&mut self, i: usize, of: Option<usize>) {
        let announce = self.proxies[i].port().to_string();
        let link = of.map(|of| self.proxies[of].port().to_string());
        let mut args = vec![
            "--replica-announce-ip",
            "127.0.0.1",
            "--replica-announce-port",
            &announce,
            // Redis 7 waits 5 s for more replicas before a diskless sync.
            "--repl-diskless-sync-delay",
            "0",
        ];
        if let Some(link) = &link {
            args.extend(["--replicaof", "127.0.0.1", link]);
        }
        self.nodes[i].restart_with(&args);
    }

    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(RedisServer::url).collect()
    }

    /// Which node the sentinels name as the primary (the first that
    /// answers), if one.
    pub fn primary(&self) -> Option<usize> {
        let port = self
            .sentinels
            .iter()
            .find_map(|s| named_primary(s, SentinelSet::MASTER))?;
        self.proxies.iter().position(|p| p.port() == port)
    }

    /// Cuts replication from the primary, waits `cut` (clients' writes in
    /// that time reach the primary only), kills the primary, drops what
    /// the cut held, and waits until every sentinel names the replica; then
    /// restarts the killed server as a replica of the new primary. Returns
    /// what the promoted server missed: replication bytes, and whether the
    /// integer at `counter` was behind the old primary's, or what went
    /// wrong.
    pub fn fail_over_losing_writes(
        &mut self,
        cut: Duration,
        counter: &str,
    ) -> Result<Lost, String> {
        let old = self.primary().ok_or("no sentinel names a primary")?;
        let new = 1 - old;
        self.proxies[old].cut_replication(true);
        std::thread::sleep(cut);
        let value = |node: &RedisServer| -> Option<i64> {
            node.try_query::<Option<i64>>(redis::cmd("GET").arg(counter))
                .flatten()
        };
        let offset = |node: &RedisServer| -> Option<u64> {
            let info: String = node.try_query(redis::cmd("INFO").arg("replication"))?;
            info.lines()
                .find_map(|l| l.strip_prefix("master_repl_offset:"))
                .and_then(|n| n.trim().parse().ok())
        };
        // Read last, just before the kill: what was written after is lost
        // too, so these are lower bounds.
        let (last, written) = (value(&self.nodes[old]), offset(&self.nodes[old]));
        self.nodes[old].kill();
        self.proxies[old].reset_replication();
        self.proxies[old].cut_replication(false);
        // What the replica has is what it will have when promoted: nothing
        // reaches it any more.
        let (kept, received) = (value(&self.nodes[new]), offset(&self.nodes[new]));
        let port = self.proxies[new].port();
        let promoted = wait_until(SETTLE_WITHIN, || {
            self.sentinels
                .iter()
                .all(|s| named_primary(s, SentinelSet::MASTER) == Some(port))
        });
        if !promoted {
            // Back as the primary it was (empty), not as a replica of its
            // own replica: the sentinels may still promote either.
            self.restart(old, None);
            return Err(format!(
                "the sentinels did not promote the replica within {SETTLE_WITHIN:?}"
            ));
        }
        if !self.make_replica(old, new) {
            return Err("the old primary did not sync as a replica".into());
        }
        Ok(Lost {
            replication: match (written, received) {
                (Some(w), Some(r)) => w.saturating_sub(r),
                _ => 0,
            },
            counter: matches!((last, kept), (Some(l), k) if k.is_none_or(|k| k < l)),
        })
    }
}

/// What a failover lost ([`ProxiedSentinelSet::fail_over_losing_writes`]).
#[derive(Clone, Copy, Debug)]
pub struct Lost {
    /// Replication bytes the promoted replica never got (at least).
    pub replication: u64,
    /// Whether the watched counter on the promoted replica was behind.
    pub counter: bool,
}

/// Whether every sentinel knows `master`'s one replica and the other two
/// sentinels (so a failover can be agreed on).
pub fn sentinels_know_each_other(sentinels: &[RedisServer], master: &str) -> bool {
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

/// The port `sentinel` names for `master`'s primary, if it answers.
pub fn named_primary(sentinel: &RedisServer, master: &str) -> Option<u16> {
    let (_host, port): (String, u16) = sentinel.try_query(
        redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(master),
    )?;
    Some(port)
}

/// Three sentinels watching [`SentinelSet::MASTER`] at 127.0.0.1:`port`,
/// once they know its replica and each other.
fn three_sentinels(port: u16) -> Vec<RedisServer> {
    let sentinels: Vec<RedisServer> = (0..3)
        .map(|_| {
            let (dir, config) = sentinel_config(SentinelSet::MASTER, port);
            RedisServer::start_in(dir, Some(config), &["--sentinel"])
        })
        .collect();
    let ready = wait_until(SETTLE_WITHIN, || {
        sentinels_know_each_other(&sentinels, SentinelSet::MASTER)
    });
    assert!(
        ready,
        "the sentinels did not find the replica and each other"
    );
    sentinels
}

/// A temporary directory with a `sentinel.conf` that monitors `master` at
/// 127.0.0.1:`port` (quorum 2, down after 3 s), for a sentinel to rewrite.
///
/// Down-after is well above one second on purpose. After a failover each
/// sentinel starts the new primary's clock afresh (its last reply "now")
/// and drops its link to it, but reconnects at most once a second counted
/// from its last attempt at the dead primary, so its first `PING` can go
/// out about a second after the switch. With down-after 1 s that races the
/// down-after check: a sentinel found the healthy new primary down, the
/// "down" answers the other sentinels gave about the dead one (kept 5 s)
/// made the quorum at once, and the sentinels failed over again, promoting
/// the old primary just restarted as a replica while the new primary stayed
/// a writable primary (Sentinel demotes such a one only seconds later):
/// two primaries, clients on each taking the lock (the chaos run's split
/// brain, not the crate's).
pub fn sentinel_config(master: &str, port: u16) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = super::temp_dir();
    let config = dir.path().join("sentinel.conf");
    std::fs::write(
        &config,
        format!(
            "sentinel monitor {master} 127.0.0.1 {port} 2\n\
             sentinel down-after-milliseconds {master} 3000\n\
             sentinel failover-timeout {master} 5000\n\
             sentinel parallel-syncs {master} 1\n"
        ),
    )
    .expect("write sentinel.conf");
    (dir, config)
}
