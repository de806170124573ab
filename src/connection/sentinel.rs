//! Redis behind Sentinel: find the master through the sentinels, and follow it when it fails over.
//!
//! Configured with `--sentinel HOST:PORT` (repeatable) and `--sentinel-master NAME`, or in
//! `sidekiq.yml` the way Sidekiq users write it for redis-rb 4.x (Sidekiq 6) and redis-client
//! (Sidekiq 7/8):
//!
//! ```yaml
//! :redis:
//!   :url: redis://:password@mymaster/0     # the host is the master's name (or give :name:)
//!   :sentinels:
//!     - { host: sentinel-1, port: 26379 }
//!     - redis://sentinel-2:26379            # strings too, as redis-client takes them
//!   :role: master
//! ```
//!
//! The password, user and database of the URL are the master's; the sentinels' own credentials are
//! `sentinel_username` / `sentinel_password` (redis-client's names), or `password` in an entry.
//!
//! # How a failover is followed
//!
//! The lookup is redis-rs's (`redis::sentinel::Sentinel`, feature `sentinel`): it asks the
//! sentinels in order for `SENTINEL MASTERS`, and checks with `ROLE` that the server named is a
//! master. One [`Master`] per process holds the current master's client and a generation number.
//! Every connection ([`Follower`], behind [`crate::redis_conn::Conn`]: the shared one, the blocking
//! one of the fetch, the heartbeat's) compares its generation with the master's before each command
//! (an atomic load) and reconnects to the new master when it moved. Any connection whose command
//! fails the way a failover makes it fail (`READONLY` from a demoted master, `UNBLOCKED` for a
//! blocking command cut by the demotion, `MASTERDOWN`, a refused, dropped or timed-out connection)
//! asks the sentinels again (at most every [`LOOKUP_EVERY`]), and a watcher asks them every
//! [`WATCH_EVERY`] anyway (after a `SENTINEL FAILOVER` the old master goes on taking writes until
//! the sentinels demote it, so no error would tell); if they name another server, the generation
//! moves, and every connection follows at its next command. This is what redis-client
//! does for Sidekiq 7 (`SentinelConfig`: re-resolve on connection and `READONLY` errors).
//!
//! The failed command itself returns its error: the callers already retry (the fetch loop with
//! backoff, a job's fate until written, the acker, the heartbeat), so nothing is retried blindly here,
//! where a write might already have applied.
//!
//! # What a failover loses
//!
//! Redis replicates asynchronously: a write the old master acknowledged but had not yet sent to the
//! replica that gets promoted is gone. For oxidekiq that means: a fetch move not replicated (the job
//! is back in its queue on the new master, and runs a second time); an acknowledgement not replicated
//! (the job stays in our working list, is recovered and runs again); a job's fate (retry, dead) and its
//! acknowledgement go in that order on one connection, so the replica never has the acknowledgement
//! without the fate. Jobs that other clients pushed to the old master in that window (a Rails app's
//! `perform_async`) are lost by the failover itself, whoever reads the queue; Sentinel's
//! `min-replicas-to-write` narrows that window. At least once still holds for every job the new
//! master has.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::sentinel::{Sentinel, SentinelNodeConnectionInfo};
use redis::{Cmd, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisResult, Value};
use tokio::time::Instant;

use crate::error::{Error, Result};

/// Sentinel's default port.
pub(crate) const DEFAULT_PORT: u16 = 26379;

/// At most one sentinel lookup per this long, per process.
pub(crate) const LOOKUP_EVERY: Duration = Duration::from_millis(250);

/// How often the sentinels are asked, errors or not. A `SENTINEL FAILOVER` promotes the replica
/// first and demotes the old master only when the sentinels next look at it (up to ~10 s later):
/// until then the old master still takes writes, which its resync then throws away. Asking every
/// second keeps that window short without waiting for an error.
pub(crate) const WATCH_EVERY: Duration = Duration::from_secs(1);

/// How long one lookup may take before it counts as failed.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(3);

/// One sentinel.
#[derive(Clone, PartialEq, Eq)]
pub struct SentinelNode {
    /// Host name or address.
    pub host: String,
    /// Port (26379 by default).
    pub port: u16,
    /// The sentinel's ACL user, if any.
    pub username: Option<String>,
    /// The sentinel's password, if any.
    pub password: Option<String>,
}

impl fmt::Debug for SentinelNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The password is never shown.
        write!(f, "{}:{}", self.host, self.port)?;
        if self.password.is_some() {
            f.write_str(" (password REDACTED)")?;
        }
        Ok(())
    }
}

impl SentinelNode {
    /// `host:port`, `host` (port 26379), `[::1]:26379`, or `redis://[user:pass@]host[:port]`.
    pub fn parse(s: &str) -> std::result::Result<SentinelNode, String> {
        let s = s.trim();
        if s.contains("://") {
            let info = s.into_connection_info().map_err(|e| {
                format!(
                    "sentinel {}: {}",
                    crate::redact::redact_url(s),
                    e.detail().unwrap_or("not a Redis URL")
                )
            })?;
            let ConnectionAddr::Tcp(host, port) = info.addr().clone() else {
                return Err(format!(
                    "sentinel {}: only plain TCP sentinels are supported",
                    crate::redact::redact_url(s)
                ));
            };
            // redis-rs fills in 6379 when the URL has no port; a sentinel's default is 26379.
            let port = if has_port(s) { port } else { DEFAULT_PORT };
            let settings = info.redis_settings();
            return Ok(SentinelNode {
                host,
                port,
                username: settings.username().map(str::to_string),
                password: settings.password().map(str::to_string),
            });
        }
        let (host, port) = match s.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(':') && !p.contains(']') => {
                let port = p
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p > 0)
                    // Named without the text: `user:pw@host` without a scheme ends in `pw@host`.
                    .ok_or_else(|| {
                        format!(
                            "sentinel {}: what follows the last `:` is not a port",
                            crate::redact::redact_url(s)
                        )
                    })?;
                (h, port)
            }
            _ => (s, DEFAULT_PORT),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(format!(
                "sentinel `{}`: no host",
                crate::redact::redact_url(s)
            ));
        }
        Ok(SentinelNode {
            host: host.to_string(),
            port,
            username: None,
            password: None,
        })
    }
}

/// True when the authority of `url` names a port.
fn has_port(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let host = host.rsplit_once(']').map_or(host, |(_, p)| p);
    host.contains(':')
}

/// The Sentinel setup: which sentinels, which master.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SentinelConfig {
    /// The sentinels, asked in this order.
    pub sentinels: Vec<SentinelNode>,
    /// The master's name (`sentinel monitor <name> ...`); `None`: the host of the Redis URL.
    pub master: Option<String>,
    /// The sentinels' ACL user, for entries without one.
    pub username: Option<String>,
    /// The sentinels' password, for entries without one.
    pub password: Option<String>,
}

/// The current master, shared by every connection of the process.
pub(crate) struct Master {
    /// The master's name.
    name: String,
    /// The sentinels (redis-rs keeps a connection to each).
    sentinel: tokio::sync::Mutex<Sentinel>,
    /// Credentials, database and TLS of the master (from the Redis URL).
    node: SentinelNodeConnectionInfo,
    /// The current master's client and its generation.
    current: RwLock<(u64, redis::Client)>,
    /// Bumped each time the master moves.
    generation: AtomicU64,
    /// When the last lookup started.
    last_lookup: Mutex<Option<Instant>>,
}

impl fmt::Debug for Master {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Master")
            .field("name", &self.name)
            .field("generation", &self.generation.load(Ordering::Relaxed))
            .field("addr", &self.addr())
            .finish()
    }
}

impl Master {
    /// Asks the sentinels for `cfg`'s master (and goes on asking every [`WATCH_EVERY`] while the
    /// returned `Arc` lives); `url` gives the master's credentials, database and
    /// TLS mode, and its host is the master's name unless `cfg` names it.
    pub(crate) async fn discover(cfg: &SentinelConfig, url: &str) -> Result<Arc<Master>> {
        let redacted = crate::redact::redact_url(url);
        let info = url.into_connection_info().map_err(|e| {
            Error::Config(format!(
                "invalid Redis URL {redacted}: {}",
                e.detail().unwrap_or("does not parse")
            ))
        })?;
        let (host, tls) = match info.addr() {
            ConnectionAddr::Tcp(h, _) => (h.clone(), None),
            ConnectionAddr::TcpTls { host, insecure, .. } => (
                host.clone(),
                Some(if *insecure {
                    redis::TlsMode::Insecure
                } else {
                    redis::TlsMode::Secure
                }),
            ),
            _ => {
                return Err(Error::Config(
                    "with Sentinel, the Redis URL must be redis:// or rediss://".into(),
                ));
            }
        };
        let name = cfg.master.clone().unwrap_or(host);
        if cfg.sentinels.is_empty() {
            return Err(Error::Config("Sentinel needs at least one sentinel".into()));
        }
        let nodes: Vec<ConnectionInfo> = cfg
            .sentinels
            .iter()
            .map(|n| {
                let mut settings = redis::RedisConnectionInfo::default();
                if let Some(u) = n.username.as_ref().or(cfg.username.as_ref()) {
                    settings = settings.set_username(u);
                }
                if let Some(p) = n.password.as_ref().or(cfg.password.as_ref()) {
                    settings = settings.set_password(p);
                }
                ConnectionAddr::Tcp(n.host.clone(), n.port)
                    .into_connection_info()
                    .map(|i| i.set_redis_settings(settings))
            })
            .collect::<RedisResult<_>>()
            .map_err(|e| Error::Config(format!("sentinel addresses: {e}")))?;
        let sentinel = Sentinel::build(nodes)
            .map_err(|e| Error::Config(format!("sentinel addresses: {e}")))?;
        let mut node = SentinelNodeConnectionInfo::default()
            .set_redis_connection_info(info.redis_settings().clone());
        if let Some(mode) = tls {
            node = node.set_tls_mode(mode);
        }
        let mut sentinel = sentinel;
        let client = lookup(&mut sentinel, &name, &node).await.map_err(|e| {
            Error::Redis(redis::RedisError::from((
                redis::ErrorKind::Io,
                "no master from the sentinels",
                format!("master `{name}` via {:?}: {e}", cfg.sentinels),
            )))
        })?;
        let master = Master {
            name,
            sentinel: tokio::sync::Mutex::new(sentinel),
            node,
            current: RwLock::new((1, client)),
            generation: AtomicU64::new(1),
            last_lookup: Mutex::new(None),
        };
        tracing::info!(master = %master.name, addr = %master.addr(), "redis master found through sentinel");
        let master = Arc::new(master);
        let watched = Arc::downgrade(&master);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(WATCH_EVERY).await;
                let Some(master) = watched.upgrade() else {
                    return;
                };
                master.recheck().await;
            }
        });
        Ok(master)
    }

    /// The master's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// `host:port` of the current master.
    pub(crate) fn addr(&self) -> String {
        self.current
            .read()
            .map(|c| addr_of(&c.1))
            .unwrap_or_default()
    }

    /// The current generation: it moves each time the master does.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    fn client(&self) -> (u64, Option<redis::Client>) {
        match self.current.read() {
            Ok(c) => (c.0, Some(c.1.clone())),
            Err(_) => (0, None),
        }
    }

    /// One lookup through the sentinels.
    async fn ask(&self) -> RedisResult<redis::Client> {
        let mut sentinel = self.sentinel.lock().await;
        lookup(&mut sentinel, &self.name, &self.node).await
    }

    /// Asks the sentinels again (unless another lookup ran within [`LOOKUP_EVERY`] or is running);
    /// when they name another server, every connection moves there.
    pub(crate) async fn recheck(&self) {
        {
            let Ok(mut last) = self.last_lookup.lock() else {
                return;
            };
            if last.is_some_and(|t| t.elapsed() < LOOKUP_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        let client = match self.ask().await {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(master = %self.name, error = %e, "sentinel lookup failed");
                return;
            }
        };
        let new = addr_of(&client);
        let old = self.addr();
        if new == old {
            return;
        }
        if let Ok(mut c) = self.current.write() {
            let generation = c.0 + 1;
            *c = (generation, client);
            self.generation.store(generation, Ordering::Release);
        }
        crate::prom::metrics().master_switched();
        tracing::warn!(master = %self.name, from = %old, to = %new,
            "redis master moved (sentinel failover): reconnecting every connection");
    }
}

/// The master named `name`, as the sentinels say and its `ROLE` confirms, within [`LOOKUP_TIMEOUT`].
async fn lookup(
    sentinel: &mut Sentinel,
    name: &str,
    node: &SentinelNodeConnectionInfo,
) -> RedisResult<redis::Client> {
    match tokio::time::timeout(LOOKUP_TIMEOUT, sentinel.async_master_for(name, Some(node))).await {
        Ok(r) => r,
        Err(_) => Err(redis::RedisError::from((
            redis::ErrorKind::Io,
            "sentinel lookup timed out",
        ))),
    }
}

fn addr_of(client: &redis::Client) -> String {
    match client.get_connection_info().addr() {
        ConnectionAddr::Tcp(h, p)
        | ConnectionAddr::TcpTls {
            host: h, port: p, ..
        } => {
            if h.contains(':') {
                format!("[{h}]:{p}")
            } else {
                format!("{h}:{p}")
            }
        }
        other => other.to_string(),
    }
}

/// True for an error a failover causes: the connection follows the master after it.
pub(crate) fn suggests_failover(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(
            e.code(),
            Some("READONLY" | "UNBLOCKED" | "MASTERDOWN" | "LOADING" | "EXECABORT")
        )
}

/// One connection that follows the master: a [`ConnectionManager`] to the current master, replaced
/// when the master moves.
pub(crate) struct Follower {
    master: Arc<Master>,
    config: ConnectionManagerConfig,
    current: RwLock<Option<(u64, ConnectionManager)>>,
    switching: tokio::sync::Mutex<()>,
    db: i64,
}

impl fmt::Debug for Follower {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Follower")
            .field("master", &self.master)
            .finish()
    }
}

impl Follower {
    /// A connection to `master`'s current server, made now (errors as a first connection's).
    pub(crate) async fn connect(
        master: Arc<Master>,
        config: ConnectionManagerConfig,
    ) -> Result<Follower> {
        let db = master.node_db();
        let f = Follower {
            master,
            config,
            current: RwLock::new(None),
            switching: tokio::sync::Mutex::new(()),
            db,
        };
        f.manager().await.map_err(Error::Redis)?;
        Ok(f)
    }

    /// The database of the connection.
    pub(crate) fn db(&self) -> i64 {
        self.db
    }

    /// The manager for the current master, reconnecting first if the master moved.
    async fn manager(&self) -> RedisResult<ConnectionManager> {
        let generation = self.master.generation();
        if let Ok(c) = self.current.read()
            && let Some((g, m)) = c.as_ref()
            && *g == generation
        {
            return Ok(m.clone());
        }
        let _one_at_a_time = self.switching.lock().await;
        let (generation, client) = self.master.client();
        if let Ok(c) = self.current.read()
            && let Some((g, m)) = c.as_ref()
            && *g == generation
        {
            return Ok(m.clone());
        }
        let client = client.ok_or_else(|| {
            redis::RedisError::from((redis::ErrorKind::Io, "sentinel state poisoned"))
        })?;
        let m = ConnectionManager::new_with_config(client, self.config.clone()).await?;
        let replaced = self
            .current
            .write()
            .map(|mut c| c.replace((generation, m.clone())).is_some())
            .unwrap_or(false);
        if replaced {
            crate::prom::metrics().reconnected();
        }
        Ok(m)
    }

    /// Runs one command on the current master.
    pub(crate) async fn command(&self, cmd: &Cmd) -> RedisResult<Value> {
        let result = match self.manager().await {
            Ok(mut m) => m.req_packed_command(cmd).await,
            Err(e) => Err(e),
        };
        if let Err(e) = &result {
            self.failed(e).await;
        }
        result
    }

    /// Runs a pipeline on the current master.
    pub(crate) async fn pipeline(
        &self,
        pipe: &redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        let result = match self.manager().await {
            Ok(mut m) => m.req_packed_commands(pipe, offset, count).await,
            Err(e) => Err(e),
        };
        if let Err(e) = &result {
            self.failed(e).await;
        }
        result
    }

    async fn failed(&self, e: &redis::RedisError) {
        crate::prom::count_error(e);
        if suggests_failover(e) {
            self.master.recheck().await;
        }
    }
}

impl Master {
    fn node_db(&self) -> i64 {
        self.current
            .read()
            .map(|c| c.1.get_connection_info().redis_settings().db())
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_addresses_parse_in_every_form() {
        let n = SentinelNode::parse("10.0.0.1:26380").unwrap();
        assert_eq!((n.host.as_str(), n.port), ("10.0.0.1", 26380));
        let n = SentinelNode::parse("sentinel-a").unwrap();
        assert_eq!((n.host.as_str(), n.port), ("sentinel-a", DEFAULT_PORT));
        let n = SentinelNode::parse("[::1]:26381").unwrap();
        assert_eq!((n.host.as_str(), n.port), ("::1", 26381));
        let n = SentinelNode::parse("redis://:s3cret@s1").unwrap();
        assert_eq!((n.host.as_str(), n.port), ("s1", DEFAULT_PORT));
        assert_eq!(n.password.as_deref(), Some("s3cret"));
        assert!(!format!("{n:?}").contains("s3cret"));
        let n = SentinelNode::parse("redis://s1:26390").unwrap();
        assert_eq!(n.port, 26390);
        assert!(SentinelNode::parse("h:notaport").is_err());
        assert!(SentinelNode::parse(":26379").is_err());
    }

    #[test]
    fn failover_errors_are_recognised() {
        let refused =
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(suggests_failover(&refused));
        let script = redis::RedisError::from((redis::ErrorKind::Client, "bad"));
        assert!(!suggests_failover(&script));
    }
}
