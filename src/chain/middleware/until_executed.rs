//! Until-executed uniqueness for jobs the Rust client enqueues: a duplicate is refused at enqueue
//! while the first is queued, waiting for a retry, or running.
//!
//! # The life of the lock
//!
//! - **Push** ([`NewJob::unique_for`](crate::client::NewJob::unique_for), [`UntilExecuted`] in the
//!   client's middleware chain): one Lua script sets `oxidekiq:lock:unique:<class>:<sha1 of the
//!   canonical args>` to the job's jid with `NX PX <ttl>` and pushes the job only if that `SET` succeeded, so "check, then push" cannot race with another client. The
//!   payload carries the key (`unique_key`) and the TTL in seconds (`unique_ttl`) for the server side. A
//!   scheduled job's TTL counts from its run time, not from the push.
//! - **Run** ([`UntilExecuted`], first in every worker's server chain): the run takes the lock over with
//!   a value of its own, `<token>:<jid>` (a fresh token per run, see [`RunLock`]), then extends it every
//!   `ttl / 3` while the job runs. A `unique_ttl` that is not a sane number of seconds fails the job
//!   (`Oxidekiq::InvalidPayload`) before it runs.
//! - **Fate**: done, discarded or dead → compare-and-delete on the run's value; back to the retry or
//!   schedule set → the TTL is renewed (the job is still pending). A failed run learns its fate from
//!   [`JobContext::after_fate`], once the fate is in Redis. An interrupted Continuable job's next run
//!   (a new jid) gets the lock in the fate write that schedules it, set to its jid as a push sets it,
//!   its TTL counted from the time the next run is due; that run claims it as its own (or, from the
//!   value its predecessor's run left, through `provider_job_id`).
//!
//! Every step compares the stored value before it deletes or extends, so a job never frees a lock a later
//! job took, and a stale run of a job never frees the lock of a newer run of the same job. A lock never outlives its job by more than its TTL: a process that dies mid-job, or a
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

use std::sync::LazyLock;
use std::time::Duration;

use serde_json::Value;

use super::lock_key::args_digest;
use super::{BoxFuture, Next, ServerMiddleware};
use crate::error::{INVALID_PAYLOAD, JobError, JobResult, LockHandOver, Result, RetryAction};
use crate::job::{Job, checked_seconds};
use crate::keys;
use crate::lock::{self, LockGuard, ttl_ms};
use crate::redis_conn::Conn;
use crate::retry::Fate;
use crate::time::score;
use crate::worker::JobContext;

// The payload reader below looks for it too ([`Job::may_name_unique_key`]): it lives in `job`.
pub use crate::job::UNIQUE_KEY_FIELD;
/// The payload key holding the lock's TTL in seconds.
pub const UNIQUE_TTL_FIELD: &str = "unique_ttl";

/// `SET KEYS[1] ARGV[1] NX PX ARGV[2]`, then only if it was set: the one queue push of [`crate::lua`]
/// (`SADD KEYS[3] ARGV[3]`, `LPUSH KEYS[2] ARGV[4]`) when there is no `ARGV[5]`, else `ZADD KEYS[2]
/// ARGV[5] ARGV[4]` (scheduled). Returns 1 if pushed, 0 if the lock was held. A write that fails (a key
/// of the wrong type) deletes the lock it just took and returns the error, so no lock is left without
/// its job.
const PUSH_SCRIPT: &str = concat!(
    crate::lua::lua_common!(),
    r"
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 0
end
local err = nil
if ARGV[5] == nil or ARGV[5] == '' then
  err = push_job(KEYS[3], KEYS[2], ARGV[3], ARGV[4])
else
  local r = redis.pcall('ZADD', KEYS[2], ARGV[5], ARGV[4])
  if failed(r) then err = KEYS[2] .. ' is a ' .. kind(KEYS[2]) .. ', not a sorted set: ' .. r.err end
end
if err then
  redis.call('DEL', KEYS[1])
  return redis.error_reply(err)
end
return 1
"
);

/// The script, sent by SHA1 (computed locally), with the body as fallback on `NOSCRIPT`.
static PUSH: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(PUSH_SCRIPT));

/// The full Redis key of a job's until-executed lock:
/// `oxidekiq:lock:unique:<class>:<sha1 of canonical args>`.
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

/// The longest `unique_ttl` accepted from a payload: 10 years. A larger value (or one that is not a
/// finite, positive number) is a corrupt payload, not a TTL: the job fails with an error instead of the
/// duration arithmetic overflowing.
pub const MAX_UNIQUE_TTL_SECS: f64 = 10.0 * 365.0 * 24.0 * 3600.0;

/// The prefixes a payload's `unique_key` may start with: oxidekiq's lock prefix, and the `lock:` of
/// the versions before it (a job enqueued then keeps the key its payload carries).
const LOCK_KEY_PREFIXES: [&str; 2] = [keys::LOCK_PREFIX, keys::OLD_LOCK_PREFIX];

/// The cheap test before [`unique_lock`] parses the payload: false when the payload has no top-level
/// field of the lock, as for most jobs (noted while the payload was decoded: no second walk of its
/// bytes).
pub(crate) fn may_hold_lock(job: &Job) -> bool {
    job.may_name_unique_key()
}

/// The until-executed lock of a job: its key and TTL, when the payload has them. The TTL is validated
/// (the payload is never trusted): an error names what is wrong, and the job fails with it. An absent
/// `unique_ttl` is the 30 s default.
pub fn unique_lock(job: &Job) -> std::result::Result<Option<(String, Duration)>, JobError> {
    if !may_hold_lock(job) {
        return Ok(None);
    }
    let Ok(map) = job.to_map() else {
        return Ok(None);
    };
    let Some(key) = map.get(UNIQUE_KEY_FIELD).and_then(Value::as_str) else {
        return Ok(None);
    };
    let ttl = match map.get(UNIQUE_TTL_FIELD) {
        None => Duration::from_secs(30),
        Some(v) => {
            let secs = checked_seconds(UNIQUE_TTL_FIELD, v, 0.001, MAX_UNIQUE_TTL_SECS)
                .map_err(|m| JobError::new(INVALID_PAYLOAD, m))?;
            // In range, so the conversion cannot fail; the default covers the impossible case.
            Duration::try_from_secs_f64(secs).unwrap_or(Duration::from_secs(30))
        }
    };
    // Only a lock key: a run sets a key it finds empty, and one of Sidekiq's (`schedule` while
    // empty) set as a string would refuse every write to it until the TTL.
    if !LOCK_KEY_PREFIXES.iter().any(|p| key.starts_with(p)) {
        let m = format!(
            "{UNIQUE_KEY_FIELD} is not a lock key (it starts with none of {LOCK_KEY_PREFIXES:?})"
        );
        return Err(JobError::new(INVALID_PAYLOAD, m));
    }
    Ok(Some((key.to_string(), ttl)))
}

/// Hands the lock from the push (or from an earlier run of the same job) to this run: if `KEYS[1]` holds
/// the jid `ARGV[1]` itself (set at push) or a `<token>:<jid>` of an earlier run, or nothing (it
/// expired), it becomes `ARGV[2]` (`<token>:<jid>`) with `PX ARGV[3]`; returns 1. So it does if it
/// holds the same of `ARGV[4]`, when given: the jid of the run this job continues (an interrupted
/// Continuable job's, whose lock its fate write passes on; a run of an older version left it
/// unpassed). Another job's value is left alone; returns 0.
const CLAIM_SCRIPT: &str = r"
local v = redis.call('GET', KEYS[1])
local function held_by(jid)
  local suffix = ':' .. jid
  return v == jid or (#v > #suffix and string.sub(v, -#suffix) == suffix)
end
if v == false or held_by(ARGV[1]) or (ARGV[4] ~= '' and held_by(ARGV[4])) then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
";

/// The claim script, sent by SHA1 with the body as fallback on `NOSCRIPT`.
static CLAIM: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(CLAIM_SCRIPT));

/// The until-executed lock as one run of a job holds it: `<token>:<jid>`, a fresh token per run.
///
/// The jid alone would not do: the same jid runs more than once (a retry; a job recovered from a process
/// presumed dead while that process still runs it). With the jid as the value, a stale run finishing
/// late would release the lock a newer run of the same job holds, and a duplicate push would then be
/// accepted while the job still runs. With a token per run, each run extends and releases only its
/// own value; the newest run takes the lock over from older ones.
#[derive(Debug, Clone)]
pub struct RunLock {
    /// The full Redis key.
    key: String,
    /// This run's value, `<token>:<jid>`.
    value: String,
    /// The TTL from the payload.
    ttl: Duration,
}

impl RunLock {
    /// This run's value in Redis, `<token>:<jid>`.
    pub fn value(&self) -> &str {
        &self.value
    }
}

/// At the start of a run: validates the job's lock fields and takes the lock over for this run (from
/// the push, an earlier run of its jid, or the run it continues: `continues`, the jid of an interrupted
/// Continuable job's run that pushed this one). One `EVALSHA` for a job with a lock; nothing for a job
/// without one. `Ok(None)` when the job has no lock, when another job holds it (this job still runs: it
/// was already pushed), or when Redis cannot be reached (logged; the lock then expires by its TTL).
/// `Err` when the payload's lock fields are invalid: the job fails with that error.
pub(crate) async fn claim(
    conn: &Conn,
    job: &Job,
    continues: Option<&str>,
) -> std::result::Result<Option<RunLock>, JobError> {
    let Some((key, ttl)) = unique_lock(job)? else {
        return Ok(None);
    };
    let value = lock::job_value(job.jid());
    let mut inv = CLAIM.prepare_invoke();
    inv.key(&key)
        .arg(job.jid())
        .arg(&value)
        .arg(ttl_ms(ttl))
        .arg(continues.unwrap_or(""));
    match inv.invoke_async::<i64>(&mut conn.clone()).await {
        Ok(1) => Ok(Some(RunLock { key, value, ttl })),
        Ok(_) => {
            tracing::debug!(lock = %key, "unique lock held by another job: this run leaves it alone");
            Ok(None)
        }
        Err(e) => {
            tracing::warn!(lock = %key, error = %e, "cannot claim unique lock; it expires by its ttl");
            Ok(None)
        }
    }
}

/// Sets `KEYS[1]` to `ARGV[2]` with `PX ARGV[3]` if it holds `ARGV[1]` or nothing; returns 1 if it
/// did. What the fate write of an interrupted job ([`crate::retry`]'s `FATE_LUA`) does with its lock.
#[cfg(feature = "testing")]
const HAND_OVER_SCRIPT: &str = r"
local v = redis.call('GET', KEYS[1])
if v == false or v == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
";

/// The hand-over script, sent by SHA1 with the body as fallback on `NOSCRIPT`.
#[cfg(feature = "testing")]
static HAND_OVER: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(HAND_OVER_SCRIPT));

/// The lock hand-over of an interrupted job's fate write, alone: what `oxidekiq::testing`, which
/// writes no fate, does once a run is continued, so a test sees the lock where production leaves it.
#[cfg(feature = "testing")]
pub(crate) async fn hand_over(conn: &Conn, lock: &crate::error::LockHandOver, jid: &str, px: u64) {
    let key = &lock.key;
    let mut inv = HAND_OVER.prepare_invoke();
    inv.key(key).arg(&lock.value).arg(jid).arg(px);
    match inv.invoke_async::<i64>(&mut conn.clone()).await {
        Ok(1) => {
            tracing::debug!(lock = %key, next_jid = %jid, "unique lock handed to the next run")
        }
        Ok(_) => tracing::debug!(lock = %key, "unique lock taken by another run: left alone"),
        Err(e) => {
            tracing::warn!(lock = %key, error = %e, "cannot hand the unique lock over; it expires by its ttl")
        }
    }
}

/// The jid of the run a continued Continuable job's run continues (`job_data`'s `provider_job_id`,
/// which Rails' `retry_job` and the Rust interrupt write; only for a payload with a `continuation`).
fn continues(ctx: &JobContext) -> Option<&str> {
    let data = ctx.activejob()?.job_data();
    data.contains_key("continuation").then_some(())?;
    data.get("provider_job_id").and_then(Value::as_str)
}

/// After the job's fate is in Redis: `finished` (done, discarded, dead) releases this run's lock;
/// otherwise (retry, reschedule) renews its TTL. Both compare this run's value, so a stale run never
/// touches a newer run's lock. Errors are logged: the key then expires by its TTL.
async fn settle(conn: Conn, lock: RunLock, finished: bool) {
    let RunLock { key, value, ttl } = lock;
    let mut c = conn;
    let outcome = if finished {
        lock::release(&mut c, &key, &value).await
    } else {
        lock::extend(&mut c, &key, &value, ttl).await
    };
    match outcome {
        Ok(true) => tracing::debug!(lock = %key, released = finished, "unique lock settled"),
        Ok(false) => {
            tracing::debug!(lock = %key, "unique lock already expired or taken by another run")
        }
        Err(e) => {
            tracing::warn!(lock = %key, error = %e, "cannot settle unique lock; it expires by its ttl")
        }
    }
}

/// Until-executed as a middleware on both chains. On the client chain (there by default) it writes the
/// lock's key and TTL into the payload and has the push take the lock in the same script (that half is
/// implemented in [`crate::client`], which sits above the middleware). On the server chain ([`Next::new`] runs it first, a no-op for a payload without `unique_key`) it claims the
/// lock for this run (one `EVALSHA`), keeps it while the job runs, and settles it: released when the
/// job is done; on a failure, once its fate is written ([`JobContext::after_fate`]): released when the
/// job is dead or discarded, renewed while it waits for a retry or its rescheduled run. When a
/// Continuable job is interrupted, the fate write that schedules its next run passes the lock to that
/// run's jid in the same script (the middleware puts the lock in the interrupt's error), so no crash,
/// Redis error or fast pick-up of the next run can come between them.
#[derive(Debug, Clone, Copy, Default)]
pub struct UntilExecuted;

impl ServerMiddleware for UntilExecuted {
    fn call<'a>(&'a self, ctx: &'a JobContext, next: Next<'a>) -> BoxFuture<'a, JobResult> {
        Box::pin(async move {
            let conn = ctx.redis();
            let Some(run) = claim(&conn, ctx.job(), continues(ctx)).await? else {
                return next.run(ctx).await;
            };
            let guard = LockGuard::taken(conn.clone(), run.key.clone(), run.value.clone(), run.ttl);
            let mut result = guard.hold_while(next.run(ctx)).await;
            match &mut result {
                Ok(()) => settle(conn, run, true).await,
                Err(e) => {
                    // An interrupted Continuable job: its next run (a new jid) gets the lock in the
                    // fate write that schedules it.
                    if let (RetryAction::Continue(_), Some(resume)) = (e.action, e.resume.as_mut())
                    {
                        resume.lock = Some(LockHandOver {
                            key: run.key.clone(),
                            value: run.value.clone(),
                            ttl_ms: ttl_ms(run.ttl),
                        });
                    }
                    ctx.after_fate(move |fate: &Fate| match fate {
                        // Passed on by the fate write itself.
                        Fate::Continued { .. } => Box::pin(std::future::ready(())),
                        _ => {
                            let finished = matches!(fate, Fate::Dead | Fate::Discarded);
                            Box::pin(settle(conn, run, finished))
                        }
                    })
                }
            }
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_lock_key_names_the_class_and_digests_the_args() {
        let k = lock_key("UniqueReportJob", &json!([{"b": 2, "a": 1}]));
        assert!(
            k.starts_with("oxidekiq:lock:unique:UniqueReportJob:"),
            "{k}"
        );
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
            unique_lock(&j).unwrap(),
            Some(("lock:unique:X:ab".into(), Duration::from_millis(1500)))
        );
        let plain = Job::from_str(r#"{"class":"X","args":["unique_key"],"jid":"j1"}"#).unwrap();
        assert_eq!(unique_lock(&plain).unwrap(), None);
    }

    #[test]
    fn a_ttl_that_is_not_a_sane_number_of_seconds_is_an_error_not_a_panic() {
        for ttl in [
            "1e300",
            "1e400",
            "-1e400",
            "-5",
            "0",
            "\"10\"",
            "null",
            "315360001",
        ] {
            let j = Job::from_str(&format!(
                r#"{{"class":"X","args":[],"jid":"j1","unique_key":"k","unique_ttl":{ttl}}}"#
            ))
            .unwrap();
            let e = unique_lock(&j).unwrap_err();
            assert_eq!(e.class, INVALID_PAYLOAD, "{ttl}");
            assert!(e.message.contains("unique_ttl"), "{ttl}: {}", e.message);
        }
    }

    /// REVIEW defect (issue 39, fixed): `unique_key` was taken from the payload as any Redis key. A payload
    /// naming one of Sidekiq's keys that does not exist at the moment (`schedule` or `retry` while
    /// empty, `queue:<name>` while drained) has its run `SET` that key as a string (the claim of a
    /// lock that expired), renewed while it runs and after a retry: every `ZADD schedule` (Ruby's
    /// and ours, the interrupt's fate write among them) or `LPUSH` fails with WRONGTYPE for up to
    /// `unique_ttl` (10 years at most). A lock key outside the lock prefixes (`oxidekiq:lock:`, the
    /// older `lock:`) now fails the job as an invalid payload. Failed before the fix: `schedule` was
    /// a string.
    #[tokio::test]
    async fn a_unique_key_naming_a_sidekiq_key_is_not_claimed() {
        let redis = crate::test_support::RedisServer::start();
        let mut c = redis.conn();
        let conn = redis.async_conn().await;
        let job = Job::from_str(
            r#"{"class":"X","args":[],"jid":"j1","unique_key":"schedule","unique_ttl":600}"#,
        )
        .unwrap();
        let claimed = claim(&conn, &job, None).await;
        let kind: String = redis::cmd("TYPE").arg("schedule").query(&mut c).unwrap();
        assert_eq!(
            kind, "none",
            "claimed {claimed:?}: schedule is now a {kind}"
        );
        assert!(claimed.is_err(), "{claimed:?}");
    }
}
