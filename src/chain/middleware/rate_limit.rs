//! Rate limits: at most N job starts per period under a name, across every process on the Redis.
//!
//! Sidekiq itself has none (Sidekiq Enterprise's `Sidekiq::Limiter.window` is the closest).
//!
//! # Sliding window log, not a token bucket
//!
//! The starts of limit `name` are a sorted set `oxidekiq:rate:<name>` (see `keys::rate`): member = a
//! fresh id per start (`<jid>:<random>`), score = the start time in epoch microseconds **from Redis's clock**
//! (`TIME` inside the script, so worker clocks never matter). One Lua script trims the starts older than
//! the period, counts what is left and, if fewer than N, records this start; otherwise it answers how long
//! until the oldest start leaves the window. The guarantee is the strong one: **in every window of one
//! period, at most N starts**, wherever the window is put. A token bucket would take O(1) memory instead
//! of O(N) per name, but lets up to 2N starts through around a refill boundary (a full bucket drained at
//! the end of one period, refilled at the start of the next); for "at most 100 calls per minute" to a
//! partner API that counts the same way, the log is the safe choice, and N members per name is small.
//! The key expires one period after the last start.
//!
//! A start is counted when the job is let through, whatever the job then does (fails, is retried): it is
//! the calls to the protected service that are limited.
//!
//! # Over the limit
//!
//! The script's answer says exactly when the next start can be granted, so a waiting job does not poll:
//! it sleeps until then, plus a jitter of up to a twentieth of the period (at most 50 ms) so the waiters
//! of every process do not all retry at the same millisecond, and tries again. It waits so for at most
//! `wait` (default 5 s), holding its worker slot. When the next free start is beyond that, or the
//! process goes quiet, it gives up at once with [`JobError::reschedule`] (the original payload goes to
//! the `schedule` set: not a failure, no retry used, worker slot freed). The delay comes from the
//! contention, since a rescheduled payload cannot carry an attempt counter: the time until the oldest
//! start leaves the window, plus a random part of up to one period, which spreads the rescheduled jobs
//! over the next window instead of bringing them all back at the same instant. With a backlog far larger
//! than N per `wait`, jobs go round through the schedule set several times; raise `wait` for such limits.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use oxidekiq::middleware::rate_limit::RateLimit;
//! use oxidekiq::{JobContext, Registry, Worker, error::JobResult};
//!
//! #[derive(Debug)]
//! struct SyncContact;
//!
//! impl Worker for SyncContact {
//!     const CLASS: &'static str = "Crm::SyncContact";
//!     type Args = (u64,);
//!     async fn perform(&self, _ctx: &JobContext, (_id,): Self::Args) -> JobResult {
//!         Ok(())
//!     }
//! }
//!
//! let mut registry = Registry::new();
//! // At most 100 calls to the CRM per minute, across every process.
//! registry.register(SyncContact).with(RateLimit::new("crm-api", 100, Duration::from_secs(60)));
//! ```

use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;
use tokio::time::Instant;

use super::limits;
use super::lock_key::{Keyed, LockKey};
use super::{BoxFuture, Next, ServerMiddleware};
use crate::error::{JobError, JobResult};
use crate::keys;
use crate::lock::ttl_ms;
use crate::redis_conn::Conn;
use crate::worker::JobContext;

/// KEYS[1] = the start log; ARGV = limit, period ms, start id. Scores are microseconds (whole
/// milliseconds would let two starts 999.x ms apart count as a full period apart). Trims starts at or
/// before now - period, then records this start if fewer than `limit` remain. Returns 0 if granted, else
/// the milliseconds, rounded up and at least 1, until the oldest start leaves the window.
const START_LUA: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local limit = tonumber(ARGV[1])
local period = tonumber(ARGV[2]) * 1000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now - period))
if redis.call('ZCARD', KEYS[1]) < limit then
  redis.call('ZADD', KEYS[1], string.format('%.0f', now), ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 0
end
local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if oldest[2] == nil then
  return tonumber(ARGV[2])
end
return math.floor((tonumber(oldest[2]) + period - now) / 1000) + 1
"#;

static START: LazyLock<Script> = LazyLock::new(|| Script::new(START_LUA));

/// One attempt to record a start of the limit `name` (at most `limit` per `period`) under the id
/// `start_id`. `None` if granted, else how long until the next start can be.
pub async fn try_start(
    conn: &mut Conn,
    name: &str,
    start_id: &str,
    limit: u32,
    period: Duration,
) -> redis::RedisResult<Option<Duration>> {
    start_key(conn, &keys::rate(name), start_id, limit, period).await
}

async fn start_key(
    conn: &mut Conn,
    key: &str,
    start_id: &str,
    limit: u32,
    period: Duration,
) -> redis::RedisResult<Option<Duration>> {
    let left: u64 = START
        .key(key)
        .arg(limit)
        .arg(ttl_ms(period))
        .arg(start_id)
        .invoke_async(conn)
        .await?;
    Ok((left > 0).then(|| Duration::from_millis(left)))
}

/// Server middleware: at most `limit` jobs start per `period` under the named limit, across every
/// process.
///
/// See the [module docs](self) for the algorithm and what happens over the limit.
///
/// ```
/// use std::time::Duration;
///
/// use oxidekiq::{RateLimit, Registry};
/// # use oxidekiq::{JobContext, JobResult, Worker};
/// # #[derive(Debug)]
/// # struct ChargeJob;
/// # impl Worker for ChargeJob {
/// #     const CLASS: &'static str = "ChargeJob";
/// #     type Args = (u64, f64);
/// #     async fn perform(&self, _: &JobContext, _: Self::Args) -> JobResult { Ok(()) }
/// # }
/// # #[derive(Debug)]
/// # struct RefundJob;
/// # impl Worker for RefundJob {
/// #     const CLASS: &'static str = "RefundJob";
/// #     type Args = (u64,);
/// #     async fn perform(&self, _: &JobContext, _: Self::Args) -> JobResult { Ok(()) }
/// # }
///
/// // 100 calls a minute to the payment API, shared by both classes (a sliding window).
/// let payment_api = RateLimit::new("payment-api", 100, Duration::from_secs(60));
/// let mut registry = Registry::new();
/// registry
///     .register(ChargeJob)
///     .with(payment_api.clone())
///     .register(RefundJob)
///     .with(payment_api);
/// ```
#[derive(Debug, Clone)]
pub struct RateLimit {
    /// Where the limit's name comes from.
    name: LockKey,
    /// How many starts per period.
    limit: u32,
    /// The window.
    period: Duration,
    /// How long a job waits for a start before it is rescheduled.
    wait: Duration,
}

impl RateLimit {
    /// At most `limit` starts per `period` under one fixed name (`"crm-api"`, shared by every class
    /// that uses it). Over the limit, a job waits only if the next free start comes within 5 s
    /// ([`RateLimit::wait`]); otherwise it is rescheduled at once. A `limit` of 0 never grants: every
    /// job is rescheduled.
    pub fn new(name: impl Into<String>, limit: u32, period: Duration) -> Self {
        RateLimit {
            name: LockKey::Fixed(name.into()),
            limit,
            period: period.max(Duration::from_millis(1)),
            wait: Duration::from_secs(5),
        }
    }

    /// A job waits for a free start, holding its worker slot, only while that start comes within
    /// `wait` of its first attempt; otherwise it is rescheduled at once, without waiting. Default
    /// 5 s; zero: one attempt, then reschedule.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// The jitter added to each wake-up: up to a twentieth of the period, at most 50 ms.
    fn jitter(&self) -> Duration {
        limits::uniform(
            Duration::ZERO,
            (self.period / 20).min(Duration::from_millis(50)),
        )
    }
}

impl Keyed for RateLimit {
    fn keyed(mut self, key: LockKey) -> Self {
        self.name = key;
        self
    }
}

impl ServerMiddleware for RateLimit {
    fn call<'a>(&'a self, ctx: &'a JobContext, next: Next<'a>) -> BoxFuture<'a, JobResult> {
        Box::pin(async move {
            let name = self.name.resolve(ctx)?;
            let key = keys::rate(&name);
            let start_id = limits::holder_id(ctx.jid());
            let mut conn = ctx.redis();
            let start = Instant::now();
            let deadline = limits::deadline(start, self.wait);
            loop {
                let left =
                    match start_key(&mut conn, &key, &start_id, self.limit, self.period).await {
                        Ok(None) => break,
                        Ok(Some(left)) => left,
                        Err(e) => {
                            return Err(limits::redis_failure(&format!("rate limit {name}"), e));
                        }
                    };
                let wake = Instant::now() + left + self.jitter();
                if wake > deadline
                    || !limits::pause(ctx, wake.saturating_duration_since(Instant::now())).await
                {
                    let delay = left + limits::uniform(Duration::ZERO, self.period);
                    return Err(JobError::reschedule(
                        delay.as_secs_f64(),
                        format!(
                            "rate limit {name} ({} per {:?}) reached after waiting {:.1}s: \
                             rescheduled in {:.1}s",
                            self.limit,
                            self.period,
                            start.elapsed().as_secs_f64(),
                            delay.as_secs_f64()
                        ),
                    ));
                }
            }
            next.run(ctx).await
        })
    }
}

const _: fn() = || {
    fn is_middleware<T: ServerMiddleware>() {}
    is_middleware::<RateLimit>();
};
