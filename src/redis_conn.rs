//! Redis connections: one shared, multiplexed connection for ordinary commands, and dedicated ones for
//! blocking commands.
//!
//! Both are [`ConnectionManager`]s, which reconnect by themselves after an outage. Blocking commands
//! (`BRPOP`, `BLMOVE`) get their own connection with a response timeout longer than the block: on the
//! shared connection they would hold up every other command, and a short response timeout would cut them.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use crate::error::Result;

/// The handle every part of oxidekiq talks to Redis through; cheap to clone.
pub type Conn = ConnectionManager;

/// Response timeout of the shared connection: a command that takes longer means Redis is in trouble.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Builds a client from a URL, naming the problem without printing the password.
pub fn client(url: &str) -> Result<redis::Client> {
    redis::Client::open(url).map_err(|e| {
        crate::error::Error::Config(format!(
            "invalid Redis URL {}: {}",
            redact_url(url),
            e.detail().unwrap_or("cannot parse")
        ))
    })
}

fn config(response_timeout: Option<Duration>) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(5)))
        .set_response_timeout(response_timeout)
        .set_number_of_retries(3)
        .set_max_delay(Duration::from_secs(2))
}

/// The shared connection.
pub async fn connect(client: &redis::Client) -> Result<Conn> {
    Ok(ConnectionManager::new_with_config(client.clone(), config(Some(RESPONSE_TIMEOUT))).await?)
}

/// A connection for blocking commands that block at most `block`.
pub async fn connect_blocking(client: &redis::Client, block: Duration) -> Result<Conn> {
    let timeout = block + Duration::from_secs(5);
    Ok(ConnectionManager::new_with_config(client.clone(), config(Some(timeout))).await?)
}

/// The URL with any password replaced by `REDACTED`, for logs and errors.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_string();
    };
    let rest = &url[scheme_end + 3..];
    let host_start = rest.find('/').unwrap_or(rest.len());
    let authority = &rest[..host_start];
    match authority.rfind('@') {
        Some(at) => {
            let userinfo = &authority[..at];
            let user = match userinfo.find(':') {
                Some(c) => &userinfo[..c],
                None => "",
            };
            let shown = if userinfo.contains(':') {
                format!("{user}:REDACTED")
            } else {
                "REDACTED".to_string()
            };
            format!(
                "{}://{}@{}{}",
                &url[..scheme_end],
                shown,
                &authority[at + 1..],
                &rest[host_start..]
            )
        }
        None => url.to_string(),
    }
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
    }
}
