//! The three deployments a `LockClient` can talk to, behind one connection
//! type: a single node, Redis Cluster, or a primary found through Sentinel.

use redis::cluster::{ClusterClient, ClusterConnection};
use redis::sentinel::LockedSentinelClient;
use redis::{Cmd, ConnectionLike, RedisResult, Value};

/// Which kind of Redis deployment a [`LockClient`](crate::LockClient) talks to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Deployment {
    /// One Redis server (possibly with replicas it does not follow).
    Single,
    /// A Redis Cluster: commands are routed by the key's hash slot.
    Cluster,
    /// A primary found through Redis Sentinel, followed across failovers.
    Sentinel,
}

/// The pool behind a client.
#[derive(Clone)]
pub(crate) enum Backend {
    Single(r2d2::Pool<redis::Client>),
    Cluster(r2d2::Pool<ClusterClient>),
    Sentinel(r2d2::Pool<LockedSentinelClient>),
}

impl Backend {
    pub(crate) fn deployment(&self) -> Deployment {
        match self {
            Backend::Single(_) => Deployment::Single,
            Backend::Cluster(_) => Deployment::Cluster,
            Backend::Sentinel(_) => Deployment::Sentinel,
        }
    }

    /// A pooled connection, within the pool's connection timeout.
    pub(crate) fn get(&self) -> Result<Connection, r2d2::Error> {
        Ok(Connection(match self {
            Backend::Single(pool) => Pooled::Single(pool.get()?),
            Backend::Cluster(pool) => Pooled::Cluster(Box::new(pool.get()?)),
            Backend::Sentinel(pool) => Pooled::Sentinel(pool.get()?),
        }))
    }

    pub(crate) fn max_size(&self) -> u32 {
        match self {
            Backend::Single(pool) => pool.max_size(),
            Backend::Cluster(pool) => pool.max_size(),
            Backend::Sentinel(pool) => pool.max_size(),
        }
    }

    pub(crate) fn state(&self) -> r2d2::State {
        match self {
            Backend::Single(pool) => pool.state(),
            Backend::Cluster(pool) => pool.state(),
            Backend::Sentinel(pool) => pool.state(),
        }
    }
}

/// A connection checked out of a [`LockClient`](crate::LockClient)'s pool,
/// whatever the deployment; it goes back to the pool when dropped.
///
/// It implements [`redis::ConnectionLike`], so commands, pipelines and
/// scripts run on it as on a plain connection. On a cluster, each command
/// is routed by its first key (a pipeline by its first command's key) and
/// `MOVED`/`ASK` redirections are followed; commands without a key go to
/// any node.
pub struct Connection(Pooled);

enum Pooled {
    Single(r2d2::PooledConnection<redis::Client>),
    // Boxed: a cluster connection is much larger than the others.
    Cluster(Box<r2d2::PooledConnection<ClusterClient>>),
    Sentinel(r2d2::PooledConnection<LockedSentinelClient>),
}

impl Connection {
    fn inner(&mut self) -> &mut dyn ConnectionLike {
        match &mut self.0 {
            Pooled::Single(con) => &mut **con,
            Pooled::Cluster(con) => &mut ***con,
            Pooled::Sentinel(con) => &mut **con,
        }
    }

    fn inner_ref(&self) -> &dyn ConnectionLike {
        match &self.0 {
            Pooled::Single(con) => &**con,
            Pooled::Cluster(con) => &***con,
            Pooled::Sentinel(con) => &**con,
        }
    }

    /// The cluster connection, when this is one (for cluster pipelines).
    pub(crate) fn as_cluster(&mut self) -> Option<&mut ClusterConnection> {
        match &mut self.0 {
            Pooled::Cluster(con) => Some(&mut ***con),
            _ => None,
        }
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        self.inner().req_packed_command(cmd)
    }

    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        self.inner().req_packed_commands(cmd, offset, count)
    }

    fn req_command(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        // The cluster connection routes by the parsed command here.
        self.inner().req_command(cmd)
    }

    fn get_db(&self) -> i64 {
        self.inner_ref().get_db()
    }

    fn supports_pipelining(&self) -> bool {
        self.inner_ref().supports_pipelining()
    }

    fn check_connection(&mut self) -> bool {
        self.inner().check_connection()
    }

    fn is_open(&self) -> bool {
        self.inner_ref().is_open()
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.0 {
            Pooled::Single(_) => Deployment::Single,
            Pooled::Cluster(_) => Deployment::Cluster,
            Pooled::Sentinel(_) => Deployment::Sentinel,
        };
        f.debug_tuple("Connection").field(&kind).finish()
    }
}
