//! A lock held by one running job: acquired with the holder's jid readable, kept alive while the job
//! runs, released by compare-and-delete when it ends. Shared by the unique and sequential middleware.
//!
//! The value stored under `lock:<key>` is `<token>:<jid>`: a fresh 128-bit random token (hex) per
//! acquisition, then the holder's jid. The whole value is what release and extension compare
//! ([`lock::release`], [`lock::extend`]: Lua compare-and-delete / compare-and-pexpire), so it stays
//! unique per holder even when the same jid runs twice (a retry, or a job recovered after a crash);
//! the jid after the first `:` is only read, to name the holder in logs.
//!
//! Acquire is one `MULTI` of `SET lock:<key> <value> NX PX <ttl>` and `GET lock:<key>`: the `SET` says
//! whether we got it, the `GET` who has it, in the same round trip and the same instant. (`SET ... NX
//! GET` would do in one command, but only from Redis 7.0.)
//!
//! The keeper is not a spawned task: [`HeldLock::hold_while`] polls the job's future and a timer in
//! the same task, so it cannot outlive the job, and a job that is cancelled (dropped) stops extending
//! its lock, which then expires by its TTL.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::Result;
use crate::lock;
use crate::redis_conn::Conn;

/// The outcome of one attempt.
#[derive(Debug)]
pub(crate) enum Attempt {
    /// We hold it.
    Held(HeldLock),
    /// Someone else does; their jid when the value has our shape (and the key had not just expired).
    Busy {
        /// The holder's jid.
        holder: Option<String>,
    },
}

/// A lock this process holds for one job.
#[derive(Debug)]
pub(crate) struct HeldLock {
    /// Connection for extension and release.
    conn: Conn,
    /// The full Redis key, `lock:<key>`.
    key: String,
    /// Our value, `<token>:<jid>`.
    value: String,
    /// The TTL set on acquisition and on every extension.
    ttl: Duration,
}

/// A fresh 128-bit token in lowercase hex.
fn new_token() -> String {
    let bytes: [u8; 16] = rand::random();
    crate::job::hex(&bytes)
}

/// The jid part of a lock value, if it has our `<token>:<jid>` shape.
pub(crate) fn holder_jid(value: &str) -> Option<&str> {
    value.split_once(':').map(|(_, jid)| jid)
}

/// TTL in whole milliseconds, at least 1 (`PX 0` is an error).
pub(crate) fn ttl_ms(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// One non-blocking attempt at `full_key` for the job `jid`.
pub(crate) async fn try_acquire(
    conn: &Conn,
    full_key: &str,
    jid: &str,
    ttl: Duration,
) -> Result<Attempt> {
    let value = format!("{}:{jid}", new_token());
    let mut c = conn.clone();
    let (set, current): (Option<String>, Option<String>) = redis::pipe()
        .atomic()
        .cmd("SET")
        .arg(full_key)
        .arg(&value)
        .arg("NX")
        .arg("PX")
        .arg(ttl_ms(ttl))
        .cmd("GET")
        .arg(full_key)
        .query_async(&mut c)
        .await?;
    crate::prom::metrics().lock_attempt(set.is_some());
    Ok(match set {
        Some(_) => Attempt::Held(HeldLock {
            conn: c,
            key: full_key.to_string(),
            value,
            ttl,
        }),
        None => Attempt::Busy {
            holder: current.as_deref().and_then(holder_jid).map(str::to_string),
        },
    })
}

/// Retries [`try_acquire`] every `poll` (jittered to `poll/2 ..= poll*3/2`) until it succeeds or
/// `timeout` has passed; `Err(holder)` names the last holder seen.
pub(crate) async fn acquire(
    conn: &Conn,
    full_key: &str,
    jid: &str,
    ttl: Duration,
    poll: Duration,
    timeout: Duration,
) -> Result<std::result::Result<HeldLock, Option<String>>> {
    let deadline = Instant::now() + timeout;
    loop {
        let holder = match try_acquire(conn, full_key, jid, ttl).await? {
            Attempt::Held(h) => return Ok(Ok(h)),
            Attempt::Busy { holder } => holder,
        };
        let now = Instant::now();
        if now >= deadline {
            return Ok(Err(holder));
        }
        tokio::time::sleep(jittered(poll).min(deadline - now)).await;
    }
}

/// A pause drawn from `poll/2 ..= poll*3/2`, so waiters do not retry in lockstep.
fn jittered(poll: Duration) -> Duration {
    let micros = u64::try_from(poll.as_micros()).unwrap_or(u64::MAX / 2);
    let lo = micros / 2;
    Duration::from_micros(rand::random_range(lo..=micros.saturating_add(lo)))
}

impl HeldLock {
    /// The full Redis key.
    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    /// Runs `fut` while extending the lock every `ttl / 3`.
    pub(crate) async fn hold_while<F: Future>(&self, fut: F) -> F::Output {
        keep_alive_while(&self.conn, &self.key, &self.value, self.ttl, fut).await
    }

    /// Compare-and-delete; a failure is logged, not returned: the key then expires by its TTL, and the
    /// job's own result matters more than its lock's clean-up.
    pub(crate) async fn release(self) {
        let mut c = self.conn;
        match lock::release(&mut c, &self.key, &self.value).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(lock = %self.key, "lock had expired or changed hands before release")
            }
            Err(e) => {
                tracing::warn!(lock = %self.key, error = %e, "cannot release lock; it expires by its ttl")
            }
        }
    }
}

/// Runs `fut` while re-`PEXPIRE`ing `key` every `ttl / 3` as long as it holds `value`. If the lock is
/// found lost, the job goes on (it cannot be stopped safely) and a warning says so.
pub(crate) async fn keep_alive_while<F: Future>(
    conn: &Conn,
    key: &str,
    value: &str,
    ttl: Duration,
    fut: F,
) -> F::Output {
    let keeper = async {
        let every = (ttl / 3).max(Duration::from_millis(1));
        let mut c = conn.clone();
        loop {
            tokio::time::sleep(every).await;
            match lock::extend(&mut c, key, value, ttl).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!(lock = %key, "lock lost while the job runs: it expired or changed hands");
                    crate::prom::metrics().lock_lost();
                    return;
                }
                Err(e) => tracing::warn!(lock = %key, error = %e, "cannot extend lock; retrying"),
            }
        }
    };
    tokio::pin!(fut);
    tokio::select! {
        out = &mut fut => out,
        () = keeper => fut.await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_holder_jid_follows_the_token() {
        assert_eq!(holder_jid("0123abcd:deadbeef"), Some("deadbeef"));
        assert_eq!(holder_jid("plain-token"), None);
    }

    #[test]
    fn jitter_stays_within_half_to_one_and_a_half_poll() {
        for _ in 0..1000 {
            let p = jittered(Duration::from_millis(100));
            assert!(p >= Duration::from_millis(50) && p <= Duration::from_millis(150));
        }
    }
}
