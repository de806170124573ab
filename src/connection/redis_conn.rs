//! Redis connections: one shared, multiplexed connection for ordinary commands, and dedicated ones for
//! blocking commands; and how a URL becomes a client, TLS and credentials included.
//!
//! Both are [`ConnectionManager`]s, which reconnect by themselves after an outage. Blocking commands
//! (`BRPOP`, `BLMOVE`) get their own connection with a response timeout longer than the block: on the
//! shared connection they would hold up every other command, and a short response timeout would cut them.
//!
//! # URLs, credentials and TLS
//!
//! - `redis://[user[:password]@]host[:port][/db]`: a password alone is sent as `AUTH password`, a user and
//!   a password as `AUTH user password` (a Redis 6+ ACL user). Percent-encode reserved characters.
//! - `rediss://...`: the same over TLS (rustls with the `ring` provider). The server certificate is checked
//!   against the system's trust store, or only against the CA bundle given to [`client_with_ca`]
//!   (`--redis-ca-file` / `REDIS_CA_FILE` for the binary), and must name the host of the URL.
//! - `rediss://...#insecure`: TLS **without any certificate or host name check**. It still encrypts, but
//!   anyone on the path can pretend to be the server and read the password. For a test setup only.
//!
//! The password never leaves this module in a readable form: errors and logs show [`redact_url`]'s
//! form of the URL, with the password replaced by `REDACTED`.

use std::path::Path;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use crate::error::{Error, Result};
use crate::prom::count_error;
use crate::redact::redact_url;

pub(crate) mod resp;
pub(crate) mod resp_pool;

/// The handle every part of oxidekiq talks to Redis through; cheap to clone.
///
/// A [`ConnectionManager`] to the configured server, or, with Sentinel, a
/// `sentinel::Follower` that moves to the new master after a failover. Either way it is a
/// [`redis::aio::ConnectionLike`], so every command and pipeline works on it as on a manager, and
/// each failed command is counted for `/metrics` on the way out.
#[derive(Clone)]
pub struct Conn {
    inner: ConnInner,
}

#[derive(Clone)]
enum ConnInner {
    Direct(ConnectionManager),
    Sentinel(std::sync::Arc<crate::sentinel::Follower>),
    /// No Redis at all (`oxidekiq::testing`'s contexts and fake client): every command fails with
    /// [`Conn::absent`]'s message, so a test that reaches Redis without giving it one says so.
    #[cfg(feature = "testing")]
    Absent(&'static str),
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            ConnInner::Direct(_) => f.write_str("Conn(direct)"),
            ConnInner::Sentinel(s) => write!(f, "Conn({s:?})"),
            #[cfg(feature = "testing")]
            ConnInner::Absent(_) => f.write_str("Conn(absent)"),
        }
    }
}

impl From<ConnectionManager> for Conn {
    fn from(m: ConnectionManager) -> Self {
        Conn {
            inner: ConnInner::Direct(m),
        }
    }
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match &mut self.inner {
            ConnInner::Direct(m) => Box::pin(async move {
                let r = m.req_packed_command(cmd).await;
                if let Err(e) = &r {
                    count_error(e);
                }
                r
            }),
            ConnInner::Sentinel(f) => Box::pin(f.command(cmd)),
            #[cfg(feature = "testing")]
            ConnInner::Absent(why) => Box::pin(std::future::ready(Err(absent_error(why)))),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match &mut self.inner {
            ConnInner::Direct(m) => Box::pin(async move {
                let r = m.req_packed_commands(pipeline, offset, count).await;
                if let Err(e) = &r {
                    count_error(e);
                }
                r
            }),
            ConnInner::Sentinel(f) => Box::pin(f.pipeline(pipeline, offset, count)),
            #[cfg(feature = "testing")]
            ConnInner::Absent(why) => Box::pin(std::future::ready(Err(absent_error(why)))),
        }
    }

    fn get_db(&self) -> i64 {
        match &self.inner {
            ConnInner::Direct(m) => m.get_db(),
            ConnInner::Sentinel(f) => f.db(),
            #[cfg(feature = "testing")]
            ConnInner::Absent(_) => 0,
        }
    }
}

#[cfg(feature = "testing")]
impl Conn {
    /// A connection to no Redis: every command fails at once with an error whose text is `why` (what
    /// the test should do to give it one). For `oxidekiq::testing`, whose unit tests run without Redis.
    pub(crate) fn absent(why: &'static str) -> Conn {
        Conn {
            inner: ConnInner::Absent(why),
        }
    }
}

/// The error every command on an absent connection answers.
#[cfg(feature = "testing")]
fn absent_error(why: &'static str) -> redis::RedisError {
    redis::RedisError::from((redis::ErrorKind::Client, "no Redis", why.to_string()))
}

/// Where the process's connections go: the URL's server, or the master Sentinel names.
#[derive(Debug, Clone)]
pub(crate) enum Target {
    /// The server of the Redis URL.
    Url(Box<redis::Client>),
    /// The master the sentinels name, followed across failovers.
    Sentinel(std::sync::Arc<crate::sentinel::Master>),
}

impl Target {
    /// The target of the Redis URL `url` (checked against the CA bundle `ca_file`, if given), or with
    /// `sentinel` the master it names (looked up now). Values, not the config: a connection knows
    /// nothing of the layers above it.
    pub(crate) async fn new(
        url: &str,
        ca_file: Option<&Path>,
        sentinel: Option<&crate::sentinel::SentinelConfig>,
    ) -> Result<Target> {
        match sentinel {
            None => Ok(Target::Url(Box::new(client_with_ca(url, ca_file)?))),
            Some(s) => {
                if ca_file.is_some() {
                    return Err(Error::Config(
                        "a Redis CA file is not supported with Sentinel yet: the masters' \
                         certificates are checked against the system's trust store"
                            .into(),
                    ));
                }
                install_crypto_provider();
                Ok(Target::Sentinel(
                    crate::sentinel::Master::discover(s, url).await?,
                ))
            }
        }
    }

    /// The shared connection (see [`connect`]).
    pub(crate) async fn connect(&self) -> Result<Conn> {
        self.connect_with(config(Some(RESPONSE_TIMEOUT))).await
    }

    /// A connection for blocking commands that block at most `block` (see [`connect_blocking`]).
    pub(crate) async fn connect_blocking(&self, block: Duration) -> Result<Conn> {
        self.connect_with(config(Some(block + Duration::from_secs(5))))
            .await
    }

    async fn connect_with(&self, cfg: ConnectionManagerConfig) -> Result<Conn> {
        match self {
            Target::Url(client) => connect_with(client, cfg).await,
            Target::Sentinel(master) => Ok(Conn {
                inner: ConnInner::Sentinel(std::sync::Arc::new(
                    crate::sentinel::Follower::connect(master.clone(), cfg).await?,
                )),
            }),
        }
    }

    /// How a task that speaks RESP itself connects (the job locks' batch task, [`resp`]): to the
    /// plain-text server of the URL; `None` for TLS and Sentinel, whose commands stay on the shared
    /// connection.
    pub(crate) fn dialer(&self) -> Option<resp::Dialer> {
        match self {
            Target::Url(client) => resp::Dialer::of(client),
            Target::Sentinel(_) => None,
        }
    }

    /// The server for logs, without the password.
    pub(crate) fn describe(&self, url: &str) -> String {
        match self {
            Target::Url(_) => redact_url(url),
            Target::Sentinel(m) => format!("sentinel master {} at {}", m.name(), m.addr()),
        }
    }
}

/// Response timeout of the shared connection: a command that takes longer means Redis is in trouble.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Builds a client from a URL, naming the problem without printing the password.
///
/// A `rediss://` URL checks the server's certificate against the system's trust store; use
/// [`client_with_ca`] for a private CA.
pub(crate) fn client(url: &str) -> Result<redis::Client> {
    client_with_ca(url, None)
}

/// Builds a client from a URL; with `ca_file`, a `rediss://` server's certificate must be signed by one
/// of the PEM certificates in that file (a CA bundle) instead of one in the system's trust store.
///
/// Errors are [`Error::Config`] naming the URL without its password: a URL that does not parse, a CA
/// file that cannot be read or holds no certificate, or a CA file given with a URL that is not
/// `rediss://`.
pub(crate) fn client_with_ca(url: &str, ca_file: Option<&Path>) -> Result<redis::Client> {
    install_crypto_provider();
    // redis-rs's parse errors are fixed texts: they never quote the URL.
    let invalid = |e: redis::RedisError| {
        let detail = e.detail().map_or_else(|| e.to_string(), str::to_string);
        Error::Config(format!("invalid Redis URL {}: {detail}", redact_url(url)))
    };
    let info = redis::IntoConnectionInfo::into_connection_info(url).map_err(invalid)?;
    if let redis::ConnectionAddr::TcpTls {
        insecure: true,
        host,
        port,
        ..
    } = info.addr()
    {
        warn_insecure_once(host, *port);
    }
    let Some(path) = ca_file else {
        return redis::Client::open(info).map_err(invalid);
    };
    if !matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. }) {
        return Err(Error::Config(format!(
            "a Redis CA file ({}) needs a rediss:// URL, not {}",
            path.display(),
            redact_url(url)
        )));
    }
    let pem = std::fs::read(path).map_err(|e| {
        Error::Config(format!(
            "cannot read the Redis CA file {}: {e}",
            path.display()
        ))
    })?;
    let certificates = count_pem_certificates(&pem).map_err(|e| {
        Error::Config(format!(
            "the Redis CA file {} is not valid PEM: {e}",
            path.display()
        ))
    })?;
    if certificates == 0 {
        return Err(Error::Config(format!(
            "the Redis CA file {} holds no PEM certificate",
            path.display()
        )));
    }
    let tls = redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(pem),
    };
    redis::Client::build_with_tls(info, tls).map_err(|e| {
        Error::Config(format!(
            "cannot use the Redis CA file {} for {}: {e}",
            path.display(),
            redact_url(url)
        ))
    })
}

/// Says once per process that `#insecure` turned certificate checks off: the connection is encrypted
/// but not authenticated, so anyone on the path can read the password.
fn warn_insecure_once(host: &str, port: u16) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        tracing::warn!(
            server = %format_args!("{host}:{port}"),
            "rediss://...#insecure: the server's certificate and host name are NOT checked; anyone \
             on the network path can pose as the server and read the password. Give the CA with \
             --redis-ca-file instead"
        );
    });
}

/// Makes `ring` rustls's process-wide crypto provider, once, before the first TLS connection.
///
/// rustls needs one chosen before a TLS config is built, and the `#insecure` mode reads the process
/// default. If the application installed a provider of its own first, that one stays.
fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Err means a provider is already installed: the application chose, which is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// How many PEM certificates `pem` holds.
fn count_pem_certificates(pem: &[u8]) -> std::result::Result<usize, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut n = 0;
    for cert in CertificateDer::pem_slice_iter(pem) {
        cert.map_err(|e| e.to_string())?;
        n += 1;
    }
    Ok(n)
}

fn config(response_timeout: Option<Duration>) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(5)))
        .set_response_timeout(response_timeout)
        .set_number_of_retries(3)
        .set_max_delay(Duration::from_secs(2))
}

/// The shared connection.
///
/// Credentials refused and a TLS handshake that fails (an untrusted certificate, most often) come back
/// as [`Error::Config`] naming the server and the user, never the password: retrying will not help.
/// Other failures stay [`Error::Redis`] (callers classify them) with a message naming the server.
pub(crate) async fn connect(client: &redis::Client) -> Result<Conn> {
    connect_with(client, config(Some(RESPONSE_TIMEOUT))).await
}

/// A connection for blocking commands that block at most `block`; errors as with [`connect`].
#[cfg(test)]
pub(crate) async fn connect_blocking(client: &redis::Client, block: Duration) -> Result<Conn> {
    let timeout = block + Duration::from_secs(5);
    connect_with(client, config(Some(timeout))).await
}

/// How long a `rediss://` connection may take before the port is asked, in plain text, whether it is
/// a plain Redis port (see [`answers_in_plain_text`]).
const TLS_PROBE_AFTER: Duration = Duration::from_secs(2);

async fn connect_with(client: &redis::Client, cfg: ConnectionManagerConfig) -> Result<Conn> {
    let attempt = async {
        ConnectionManager::new_with_config(client.clone(), cfg)
            .await
            .map(Conn::from)
    };
    let info = client.get_connection_info();
    let redis::ConnectionAddr::TcpTls { host, port, .. } = info.addr() else {
        return attempt.await.map_err(|e| connect_error(client, e));
    };
    // A plain Redis port does not answer a TLS ClientHello (it waits for the end of a line that never
    // comes), so the attempt would only fail after every retry has timed out. Asking the port in
    // plain text tells that case apart in a couple of seconds; a TLS port never answers `PING\r\n`
    // with a RESP reply, so a slow TLS server is never mistaken for a plain one.
    let (host, port) = (host.clone(), *port);
    let probe = async {
        tokio::time::sleep(TLS_PROBE_AFTER).await;
        if answers_in_plain_text(&host, port).await {
            return;
        }
        std::future::pending::<()>().await
    };
    let plain_port = || {
        Error::Config(format!(
            "TLS connection to redis at {} failed: the server answers in plain text; is this a TLS \
             port? Use a redis:// URL for a plain-text port",
            server_name(client)
        ))
    };
    tokio::select! {
        result = attempt => match result {
            Ok(conn) => Ok(conn),
            // The probe may not have had its turn (a fast failure, or a probe slowed down by a
            // loaded machine): ask once more before naming the error.
            Err(e) if e.kind() != redis::ErrorKind::AuthenticationFailed
                && rustls_error(&e).is_none_or(|t| !matches!(t, rustls::Error::InvalidCertificate(_)))
                && answers_in_plain_text(&host, port).await => Err(plain_port()),
            Err(e) => Err(connect_error(client, e)),
        },
        () = probe => Err(plain_port()),
    }
}

/// True when `host:port` answers `PING` with a RESP reply (`+PONG`, `-NOAUTH ...`): a plain-text
/// Redis port. Sends nothing secret.
async fn answers_in_plain_text(host: &str, port: u16) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let probe = async {
        let mut stream = tokio::net::TcpStream::connect((host, port)).await.ok()?;
        stream.write_all(b"PING\r\n").await.ok()?;
        let mut first = [0u8; 1];
        let n = stream.read(&mut first).await.ok()?;
        Some(n == 1 && matches!(first[0], b'+' | b'-'))
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(3), probe).await,
        Ok(Some(true))
    )
}

/// `redis://host:port` or `rediss://host:port` (a socket's path for Unix sockets): the server a
/// client talks to, without user or password.
fn server_name(client: &redis::Client) -> String {
    // An IPv6 address is written in brackets, as in a URL.
    let host = |h: &str| {
        if h.contains(':') {
            format!("[{h}]")
        } else {
            h.to_string()
        }
    };
    match client.get_connection_info().addr() {
        redis::ConnectionAddr::TcpTls { host: h, port, .. } => {
            format!("rediss://{}:{port}", host(h))
        }
        redis::ConnectionAddr::Tcp(h, port) => format!("redis://{}:{port}", host(h)),
        other => format!("the socket {other}"),
    }
}

/// Says what to fix when a first connection fails for a reason retrying cannot cure; other errors
/// (refused, timed out) stay [`Error::Redis`], which callers can classify, with the server named.
fn connect_error(client: &redis::Client, e: redis::RedisError) -> Error {
    let info = client.get_connection_info();
    let tls = matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. });
    let server = server_name(client);
    if e.kind() == redis::ErrorKind::AuthenticationFailed {
        // A user part without a password may well be a password (see `redact_url`): not shown.
        let settings = info.redis_settings();
        let user = match (settings.username(), settings.password()) {
            (Some(user), Some(_)) => user,
            (Some(_), None) => "REDACTED",
            (None, _) => "default",
        };
        return Error::Config(format!(
            "redis at {server} refused the password of user `{user}` ({e}): check the user and \
             password in the Redis URL"
        ));
    }
    if let Some(tls_error) = rustls_error(&e) {
        let hint = match tls_error {
            rustls::Error::InvalidCertificate(_) => {
                ": the server's certificate is not trusted; give the CA that signed it with \
                 --redis-ca-file or REDIS_CA_FILE"
            }
            // What a plain-text Redis sends back (an error line) is no TLS record.
            rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateMessage { .. } => {
                ": the server did not answer in TLS; is this a TLS port? Use a redis:// URL for a \
                 plain-text port"
            }
            _ => "",
        };
        return Error::Config(format!(
            "TLS connection to redis at {server} failed: {tls_error}{hint}"
        ));
    }
    if let Some(io) = io_error(&e) {
        use std::io::ErrorKind as K;
        // A TLS port closes a connection that does not start with a handshake.
        let hint = if !tls
            && matches!(
                io.kind(),
                K::ConnectionReset | K::UnexpectedEof | K::ConnectionAborted | K::BrokenPipe
            ) {
            " (the server closed the connection: if this port serves TLS, use a rediss:// URL)"
        } else {
            ""
        };
        // Same I/O kind, so `is_connection_refusal`, `is_timeout` and the like still classify it.
        let named = std::io::Error::new(
            io.kind(),
            format!("cannot connect to redis at {server}: {io}{hint}"),
        );
        return Error::Redis(redis::RedisError::from(named));
    }
    Error::Redis(redis::RedisError::from((
        e.kind(),
        "cannot connect to redis",
        format!("{server}: {e}"),
    )))
}

/// The I/O error behind a redis error, looking through the `Arc` redis-rs keeps it in.
fn io_error(e: &redis::RedisError) -> Option<&std::io::Error> {
    type Shared = std::sync::Arc<dyn std::error::Error + Send + Sync>;
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = next {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return Some(io);
        }
        if let Some(shared) = err.downcast_ref::<Shared>() {
            let inner: &(dyn std::error::Error + 'static) = shared.as_ref();
            if let Some(io) = inner.downcast_ref::<std::io::Error>() {
                return Some(io);
            }
        }
        next = err.source();
    }
    None
}

/// The rustls error behind a connection error, if there is one. It travels inside an I/O error, which
/// redis-rs keeps behind an `Arc<dyn Error>`; `source()` skips over the I/O error's payload, hence
/// the downcasts.
fn rustls_error(e: &redis::RedisError) -> Option<&rustls::Error> {
    type Shared = std::sync::Arc<dyn std::error::Error + Send + Sync>;
    fn in_io<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
        err.downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    }
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = next {
        if let Some(tls) = err.downcast_ref::<rustls::Error>().or_else(|| in_io(err)) {
            return Some(tls);
        }
        if let Some(shared) = err.downcast_ref::<Shared>() {
            let inner: &(dyn std::error::Error + 'static) = shared.as_ref();
            if let Some(tls) = inner
                .downcast_ref::<rustls::Error>()
                .or_else(|| in_io(inner))
            {
                return Some(tls);
            }
        }
        next = err.source();
    }
    None
}

// Moved from tests/security.rs: TLS, ACL users and secrets kept out of every output (needs crate-internal items).
#[cfg(test)]
mod tests_security;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_that_does_not_parse_is_named_without_its_password() {
        let e = client("redis://app:s3cret@h:notaport")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("s3cret"), "{e}");
        assert!(e.contains("redis://app:REDACTED@h:notaport"), "{e}");
    }

    #[test]
    fn a_ca_file_needs_a_tls_url() {
        let e = client_with_ca("redis://:s3cret@h", Some(Path::new("/nonexistent")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("rediss://"), "{e}");
        assert!(!e.contains("s3cret"), "{e}");
    }

    #[test]
    fn a_ca_file_without_certificates_is_refused_when_the_client_is_built() {
        let dir = std::env::temp_dir().join(format!("oxidekiq-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("empty.pem");
        std::fs::write(&path, "not a certificate\n").unwrap();
        let e = client_with_ca("rediss://:s3cret@h", Some(&path))
            .unwrap_err()
            .to_string();
        let missing = client_with_ca("rediss://:s3cret@h", Some(&dir.join("missing.pem")))
            .unwrap_err()
            .to_string();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(e.contains("holds no PEM certificate"), "{e}");
        assert!(
            missing.contains("cannot read the Redis CA file"),
            "{missing}"
        );
    }

    #[test]
    fn tls_urls_build_clients() {
        assert!(client("rediss://app:s3cret@h:6380/0").is_ok());
        assert!(client("rediss://h:6380/#insecure").is_ok());
        let e = client("rediss://app:s3cret@h:6380/#other")
            .unwrap_err()
            .to_string();
        assert!(e.contains("#insecure"), "{e}");
        assert!(!e.contains("s3cret"), "{e}");
    }
}
