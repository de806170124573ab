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

/// The handle every part of oxidekiq talks to Redis through; cheap to clone.
pub type Conn = ConnectionManager;

/// Response timeout of the shared connection: a command that takes longer means Redis is in trouble.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Builds a client from a URL, naming the problem without printing the password.
///
/// A `rediss://` URL checks the server's certificate against the system's trust store; use
/// [`client_with_ca`] for a private CA.
pub fn client(url: &str) -> Result<redis::Client> {
    client_with_ca(url, None)
}

/// Builds a client from a URL; with `ca_file`, a `rediss://` server's certificate must be signed by one
/// of the PEM certificates in that file (a CA bundle) instead of one in the system's trust store.
///
/// Errors are [`Error::Config`] naming the URL without its password: a URL that does not parse, a CA
/// file that cannot be read or holds no certificate, or a CA file given with a URL that is not
/// `rediss://`.
pub fn client_with_ca(url: &str, ca_file: Option<&Path>) -> Result<redis::Client> {
    install_crypto_provider();
    // redis-rs's parse errors are fixed texts: they never quote the URL.
    let invalid = |e: redis::RedisError| {
        let detail = e.detail().map_or_else(|| e.to_string(), str::to_string);
        Error::Config(format!("invalid Redis URL {}: {detail}", redact_url(url)))
    };
    let info = redis::IntoConnectionInfo::into_connection_info(url).map_err(invalid)?;
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
pub async fn connect(client: &redis::Client) -> Result<Conn> {
    ConnectionManager::new_with_config(client.clone(), config(Some(RESPONSE_TIMEOUT)))
        .await
        .map_err(|e| connect_error(client, e))
}

/// A connection for blocking commands that block at most `block`; errors as with [`connect`].
pub async fn connect_blocking(client: &redis::Client, block: Duration) -> Result<Conn> {
    let timeout = block + Duration::from_secs(5);
    ConnectionManager::new_with_config(client.clone(), config(Some(timeout)))
        .await
        .map_err(|e| connect_error(client, e))
}

/// Says what to fix when a first connection fails for a reason retrying cannot cure; other errors
/// (refused, timed out) stay [`Error::Redis`], which callers can classify.
fn connect_error(client: &redis::Client, e: redis::RedisError) -> Error {
    let info = client.get_connection_info();
    let tls = matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. });
    let server = format!("{}://{}", if tls { "rediss" } else { "redis" }, info.addr());
    if e.kind() == redis::ErrorKind::AuthenticationFailed {
        let user = info.redis_settings().username().unwrap_or("default");
        return Error::Config(format!(
            "redis at {server} refused the password of user `{user}` ({e}): check the user and \
             password in the Redis URL"
        ));
    }
    if let Some(tls_error) = rustls_error(&e) {
        let hint = if matches!(tls_error, rustls::Error::InvalidCertificate(_)) {
            ": the server's certificate is not trusted; give the CA that signed it with \
             --redis-ca-file or REDIS_CA_FILE"
        } else {
            ""
        };
        return Error::Config(format!(
            "TLS connection to redis at {server} failed: {tls_error}{hint}"
        ));
    }
    Error::Redis(e)
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

/// The URL with any password replaced by `REDACTED`, for logs and errors.
///
/// Everything before the last `@` counts as the user part, even a password with an unencoded `/`, `?`
/// or `#` in it (a URL that does not parse is shown in errors too): no `@` ever appears in the host,
/// path, query or fragment of a Redis URL, so the rule never hides more than the password.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_string();
    };
    let rest = &url[scheme_end + 3..];
    let Some(at) = rest.rfind('@') else {
        return url.to_string();
    };
    let userinfo = &rest[..at];
    let shown = match userinfo.find(':') {
        Some(c) => format!("{}:REDACTED", &userinfo[..c]),
        // `redis://secret@host`: redis-rs reads a lone user part as a user name, but people write
        // passwords there; a user name is not worth the risk.
        None => "REDACTED".to_string(),
    };
    format!("{}://{shown}{}", &url[..scheme_end], &rest[at..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_appear_in_a_redacted_url() {
        assert_eq!(
            redact_url("redis://app:s3cret@h:6380/2"),
            "redis://app:REDACTED@h:6380/2"
        );
        assert_eq!(redact_url("rediss://:s3cret@h"), "rediss://:REDACTED@h");
        assert_eq!(redact_url("redis://h:1"), "redis://h:1");
        assert_eq!(
            redact_url("rediss://app:s3cret@h:6380/0#insecure"),
            "rediss://app:REDACTED@h:6380/0#insecure"
        );
    }

    #[test]
    fn a_password_with_unencoded_delimiters_is_still_redacted() {
        for (url, shown) in [
            ("redis://app:pa/ss@h:1/0", "redis://app:REDACTED@h:1/0"),
            ("redis://app:pa#ss@h", "redis://app:REDACTED@h"),
            ("redis://app:p@ss@h", "redis://app:REDACTED@h"),
            ("redis://:pa?ss@h", "redis://:REDACTED@h"),
        ] {
            assert_eq!(redact_url(url), shown);
        }
    }

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
