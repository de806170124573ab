//! Until-executed uniqueness for jobs the Rust client enqueues: a duplicate is refused at enqueue
//! while the first is queued, waiting for a retry, or running.
//!
//! # The life of the lock
//!
//! - **Push** ([`NewJob::unique_for`](crate::client::NewJob::unique_for)): one Lua script sets
//!   `lock:unique:<class>:<sha1 of the canonical args>` to the job's jid with `NX PX <ttl>` and pushes
//!   the job only if that `SET` succeeded, so "check, then push" cannot race with another client. The
//!   payload carries the key (`unique_key`) and the TTL in seconds (`unique_ttl`) for the server side. A
//!   scheduled job's TTL counts from its run time, not from the push.
//! - **Run** ([`while_running`]): the processor extends the lock every `ttl / 3` while the job runs.
//! - **Fate** ([`settle`]): done, discarded or dead → compare-and-delete on the jid; back to the retry
//!   or schedule set → the TTL is renewed (the job is still pending).
//!
//! Every step compares the stored jid before it deletes or extends, so a job never frees a lock a later
//! job took. A lock never outlives its job by more than its TTL: a process that dies mid-job, or a
//! payload deleted by hand, leaves a key that simply expires. Choose a TTL longer than the job waits in
//! its queue plus its longest retry wait; past it, a duplicate is accepted.
//!
//! ```no_run
//! # async fn demo() -> oxidekiq::error::Result<()> {
//! use std::time::Duration;
//! use oxidekiq::client::{Client, NewJob};
//! let client = Client::connect("redis://127.0.0.1:6379").await?;
//! let job = NewJob::new("UniqueReportJob", (5.0,)).queue("reports").unique_for(Duration::from_secs(600));
//! assert!(client.push_unique(job.clone()).await?.is_some()); // pushed, jid returned
//! assert!(client.push_unique(job).await?.is_none()); // refused: the first is still pending
//! # Ok(()) }
//! ```

use std::future::Future;
use std::sync::LazyLock;
use std::time::Duration;

use serde_json::Value;

use super::job_lock::{self, ttl_ms};
use super::lock_key::args_digest;
use crate::error::Result;
use crate::job::Job;
use crate::keys;
use crate::lock;
use crate::redis_conn::Conn;
use crate::time::score;

/// The payload key holding the lock's full Redis key.
pub const UNIQUE_KEY_FIELD: &str = "unique_key";
/// The payload key holding the lock's TTL in seconds.
pub const UNIQUE_TTL_FIELD: &str = "unique_ttl";

/// `SET KEYS[1] ARGV[1] NX PX ARGV[2]`, then only if it was set: `SADD queues ARGV[3]` and `LPUSH
/// KEYS[2] ARGV[4]` (no `ARGV[5]`) or `ZADD KEYS[2] ARGV[5] ARGV[4]` (scheduled). Returns 1 if pushed.
const PUSH_SCRIPT: &str = r"
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 0
end
if ARGV[5] == nil or ARGV[5] == '' then
  redis.call('SADD', KEYS[3], ARGV[3])
  redis.call('LPUSH', KEYS[2], ARGV[4])
else
  redis.call('ZADD', KEYS[2], ARGV[5], ARGV[4])
end
return 1
";

/// The script, sent by SHA1 (computed locally), with the body as fallback on `NOSCRIPT`.
static PUSH: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(PUSH_SCRIPT));

/// The full Redis key of a job's until-executed lock: `lock:unique:<class>:<sha1 of canonical args>`.
pub fn lock_key(class: &str, args: &Value) -> String {
    keys::lock(&format!("unique:{class}:{}", args_digest(args)))
}

/// Pushes `payload` only if the lock `key` is free, taking it for `jid`; true if pushed. `at` is the
/// score for the schedule set, or `None` to push to `queue` now.
pub(crate) async fn push(
    conn: &Conn,
    key: &str,
    jid: &str,
    ttl: Duration,
    queue: &str,
    payload: &str,
    at: Option<f64>,
) -> Result<bool> {
    let mut inv = PUSH.prepare_invoke();
    inv.key(key);
    match at {
        Some(_) => inv.key(keys::SCHEDULE),
        None => inv.key(keys::queue(queue)),
    };
    inv.key(keys::QUEUES)
        .arg(jid)
        .arg(ttl_ms(ttl))
        .arg(queue)
        .arg(payload);
    if let Some(at) = at {
        inv.arg(score(at));
    }
    let pushed: i64 = inv.invoke_async(&mut conn.clone()).await?;
    Ok(pushed == 1)
}

/// The until-executed lock of a job: its key and TTL, when the payload has them.
pub fn unique_lock(job: &Job) -> Option<(String, Duration)> {
    // Cheap test first: most payloads have no lock, and parsing the whole payload costs more.
    if !job.raw().contains(UNIQUE_KEY_FIELD) {
        return None;
    }
    let map = job.to_map().ok()?;
    let key = map.get(UNIQUE_KEY_FIELD)?.as_str()?.to_string();
    let ttl = map
        .get(UNIQUE_TTL_FIELD)
        .and_then(Value::as_f64)
        .filter(|s| s.is_finite() && *s > 0.0)
        .map_or(Duration::from_secs(30), Duration::from_secs_f64);
    Some((key, ttl))
}

/// Runs `fut` (the job) while extending its until-executed lock, if it has one.
pub async fn while_running<F: Future>(conn: &Conn, job: &Job, fut: F) -> F::Output {
    match unique_lock(job) {
        Some((key, ttl)) => job_lock::keep_alive_while(conn, &key, job.jid(), ttl, fut).await,
        None => fut.await,
    }
}

/// After the job's fate is in Redis: `finished` (done, discarded, dead) releases its lock; otherwise
/// (retry, reschedule) renews its TTL. Errors are logged: the key then expires by its TTL.
pub async fn settle(conn: &Conn, job: &Job, finished: bool) {
    let Some((key, ttl)) = unique_lock(job) else {
        return;
    };
    let mut c = conn.clone();
    let outcome = if finished {
        lock::release(&mut c, &key, job.jid()).await
    } else {
        lock::extend(&mut c, &key, job.jid(), ttl).await
    };
    match outcome {
        Ok(true) => tracing::debug!(lock = %key, released = finished, "unique lock settled"),
        Ok(false) => {
            tracing::debug!(lock = %key, "unique lock already expired or taken by another job")
        }
        Err(e) => {
            tracing::warn!(lock = %key, error = %e, "cannot settle unique lock; it expires by its ttl")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_lock_key_names_the_class_and_digests_the_args() {
        let k = lock_key("UniqueReportJob", &json!([{"b": 2, "a": 1}]));
        assert!(k.starts_with("lock:unique:UniqueReportJob:"), "{k}");
        assert_eq!(k, lock_key("UniqueReportJob", &json!([{"a": 1, "b": 2}])));
        assert_ne!(k, lock_key("OtherJob", &json!([{"a": 1, "b": 2}])));
    }

    #[test]
    fn the_lock_is_read_from_the_payload() {
        let j = Job::from_str(
            r#"{"class":"X","args":[],"jid":"j1","unique_key":"lock:unique:X:ab","unique_ttl":1.5}"#,
        )
        .unwrap();
        assert_eq!(
            unique_lock(&j),
            Some(("lock:unique:X:ab".into(), Duration::from_millis(1500)))
        );
        let plain = Job::from_str(r#"{"class":"X","args":["unique_key"],"jid":"j1"}"#).unwrap();
        assert_eq!(unique_lock(&plain), None);
    }
}
