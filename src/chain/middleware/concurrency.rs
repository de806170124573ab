//! Concurrency limits: at most N jobs holding a named limit at once across every process on the Redis
//! ([`ConcurrencyLimit`]), and at most K jobs of one class at once inside this process
//! ([`LocalConcurrencyLimit`], what [`WorkerOptions::local_concurrency`](crate::WorkerOptions) turns on).
//!
//! Sidekiq itself has no such thing (Sidekiq Enterprise's `Sidekiq::Limiter.concurrent` is the
//! closest); the design answers the two weak points of the usual Redis wait group, a global lock taken
//! with `SETNX` and polled in a busy loop, and slots leaked by crashed holders.
//!
//! # How the distributed limit works
//!
//! - The holders of limit `name` are **leases** in the sorted set `oxidekiq:concurrency:<name>` (see
//!   `keys::concurrency`): member = a holder id (`<jid>:<random>`, fresh for every run), score = the
//!   lease's expiry in epoch milliseconds, **read from Redis's own clock** (`TIME` inside the script), so
//!   the clocks of the worker machines never matter.
//! - **Acquire** is one Lua script: drop every expired lease (`ZREMRANGEBYSCORE -inf now`), then grant
//!   if this holder already has a lease or `ZCARD < N`. No lock, no read-then-write across round trips.
//!   Because expired leases are removed right there, a holder that died (SIGKILL, lost machine) frees its
//!   slot at the latest one lease after its last renewal.
//! - While the job runs, its lease is **renewed** every `lease / 3` by the same script, run from a loop
//!   that lives inside the middleware's own future beside the job (`select!`): it ends when the job ends
//!   and is dropped with it, so no task outlives the job. If a renewal finds the lease gone (Redis was
//!   out of reach for a whole lease), the script takes a slot again only if one is free; otherwise a
//!   warning says the limit may be exceeded by this job, which cannot be stopped once started.
//! - **Release** is `ZREM` of the holder id: one atomic command, and it cannot remove another holder's
//!   lease. A job that ends in any way (success, error) releases. A job aborted at the shutdown deadline
//!   cannot await a release: its lease expires by itself within one lease.
//!
//! # Over the limit
//!
//! A job that finds the limit full polls the acquire script with exponential backoff and jitter
//! (`poll`, doubling up to `8 × poll`, each pause drawn from ½–1× of it, so waiters across processes do
//! not hit Redis in lockstep) for at most `wait`. While it waits it holds its worker slot, so the wait is
//! short by default (5 s). Then, or at once when the process goes quiet, it gives up with
//! [`JobError::reschedule`]: the original payload goes back to the `schedule` set, which is not a failure
//! and does not use a retry, and the worker slot is free for other work.
//!
//! The reschedule delay cannot grow per job (a rescheduled payload is put back byte for byte, so it
//! cannot carry an attempt counter); it is taken from the limit instead: the job just saw every slot
//! stay taken for `wait`, and a slot frees when a holder ends or, for a crashed holder, at most one lease
//! later, so the delay is drawn from `reschedule_in ..= 2 × reschedule_in`, with `reschedule_in =
//! lease / 2` unless set (15–30 s with the default lease). The random part spreads the rescheduled jobs
//! so they do not all come back at once.
//! Waiters are not served in order: whoever polls first after a release wins.
//!
//! # The local cap
//!
//! [`LocalConcurrencyLimit`] is a Tokio semaphore: no Redis round trip. The registry puts it first in a
//! worker's chain when [`WorkerOptions::local_concurrency`](crate::WorkerOptions) is set, so a job
//! waiting for it holds no lease, lock or rate-limit start of the middleware after it. It too waits a
//! bounded time (holding its worker slot, which is cheap and keeps the job's place), then reschedules.
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use oxidekiq::middleware::concurrency::ConcurrencyLimit;
//! use oxidekiq::{JobContext, Registry, Worker, error::JobResult};
//!
//! #[derive(Debug)]
//! struct ChargeJob;
//!
//! impl Worker for ChargeJob {
//!     const CLASS: &'static str = "Billing::ChargeJob";
//!     type Args = (u64, f64);
//!     async fn perform(&self, _ctx: &JobContext, (_customer, _amount): Self::Args) -> JobResult {
//!         Ok(())
//!     }
//! }
//!
//! let mut registry = Registry::new();
//! // At most 3 charges per customer at once, across every process.
//! registry.register(ChargeJob).with_key(
//!     ConcurrencyLimit::new(3).lease(Duration::from_secs(30)),
//!     |(customer, _)| format!("stripe-{customer}"),
//! );
//! ```

use std::convert::Infallible;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::Script;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use super::limits;
use super::lock_key::{Keyed, LockKey};
use super::{BoxFuture, Next, ServerMiddleware};
use crate::error::{JobError, JobResult};
use crate::keys;
use crate::lock::ttl_ms;
use crate::redis_conn::Conn;
use crate::worker::JobContext;

/// KEYS[1] = the lease set; ARGV = holder id, limit, lease ms. Drops expired leases, then grants (and
/// sets this holder's lease to now + lease) if the holder already has a lease or fewer than `limit`
/// are held. Returns 1 if granted, else 0. The key expires one lease after the last grant or renewal,
/// so names nobody uses leave nothing behind.
const ACQUIRE_LUA: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit = tonumber(ARGV[2])
local lease = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now))
if redis.call('ZSCORE', KEYS[1], ARGV[1]) or redis.call('ZCARD', KEYS[1]) < limit then
  redis.call('ZADD', KEYS[1], string.format('%.0f', now + lease), ARGV[1])
  if redis.call('PTTL', KEYS[1]) < lease then
    redis.call('PEXPIRE', KEYS[1], lease)
  end
  return 1
end
return 0
"#;

/// KEYS[1] = the lease set. Drops expired leases; returns how many remain.
const HOLDERS_LUA: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now))
return redis.call('ZCARD', KEYS[1])
"#;

static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE_LUA));
static HOLDERS: LazyLock<Script> = LazyLock::new(|| Script::new(HOLDERS_LUA));

/// One attempt to take a slot of the limit `name` (at most `limit` holders) as `holder`, with a lease
/// of `lease`. Also renews: a holder that already has a lease gets it extended. True if granted.
pub async fn try_acquire(
    conn: &mut Conn,
    name: &str,
    holder: &str,
    limit: u32,
    lease: Duration,
) -> redis::RedisResult<bool> {
    acquire_key(conn, &keys::concurrency(name), holder, limit, lease).await
}

async fn acquire_key(
    conn: &mut Conn,
    key: &str,
    holder: &str,
    limit: u32,
    lease: Duration,
) -> redis::RedisResult<bool> {
    let granted: i64 = ACQUIRE
        .key(key)
        .arg(holder)
        .arg(limit)
        .arg(ttl_ms(lease))
        .invoke_async(conn)
        .await?;
    Ok(granted == 1)
}

/// Gives `holder`'s slot of the limit `name` back (`ZREM`); true if it still held one.
pub async fn release(conn: &mut Conn, name: &str, holder: &str) -> redis::RedisResult<bool> {
    release_key(conn, &keys::concurrency(name), holder).await
}

async fn release_key(conn: &mut Conn, key: &str, holder: &str) -> redis::RedisResult<bool> {
    let removed: i64 = redis::cmd("ZREM")
        .arg(key)
        .arg(holder)
        .query_async(conn)
        .await?;
    Ok(removed == 1)
}

/// How many unexpired leases the limit `name` has now (expired ones are dropped on the way).
pub async fn holders(conn: &mut Conn, name: &str) -> redis::RedisResult<u64> {
    HOLDERS
        .key(keys::concurrency(name))
        .invoke_async(conn)
        .await
}

/// Server middleware: at most `limit` jobs hold the named limit at once, across every process.
///
/// See the [module docs](self) for how it works and what happens over the limit.
///
/// ```
/// use std::time::Duration;
///
/// use oxidekiq::{ConcurrencyLimit, Keyed, Registry};
/// # use oxidekiq::{JobContext, JobResult, Worker};
/// # #[derive(Debug)]
/// # struct ChargeJob;
/// # impl Worker for ChargeJob {
/// #     const CLASS: &'static str = "ChargeJob";
/// #     type Args = (u64, f64);
/// #     async fn perform(&self, _: &JobContext, _: Self::Args) -> JobResult { Ok(()) }
/// # }
/// # #[derive(Debug)]
/// # struct ExportJob;
/// # impl Worker for ExportJob {
/// #     const CLASS: &'static str = "ExportJob";
/// #     type Args = (String,);
/// #     async fn perform(&self, _: &JobContext, _: Self::Args) -> JobResult { Ok(()) }
/// # }
///
/// let mut registry = Registry::new();
/// // At most 3 ChargeJobs per customer at once, across every process.
/// registry
///     .register(ChargeJob)
///     .with_key(ConcurrencyLimit::new(3), |(customer, _)| format!("stripe-{customer}"));
/// // At most 2 exports at once, sharing the name "warehouse" with any other class that uses it.
/// registry
///     .register(ExportJob)
///     .with(ConcurrencyLimit::new(2).key("warehouse").wait(Duration::from_secs(10)));
/// ```
#[derive(Debug, Clone)]
pub struct ConcurrencyLimit {
    /// Where the limit's name comes from.
    name: LockKey,
    /// How many holders at once.
    limit: u32,
    /// How long a lease lives without renewal: bounds how long a crashed holder keeps its slot.
    lease: Duration,
    /// How long a job waits for a slot before it is rescheduled.
    wait: Duration,
    /// The first pause between attempts while waiting (then doubling, up to 8×).
    poll: Duration,
    /// The base of the reschedule delay; `None`: half the lease.
    reschedule_in: Option<Duration>,
}

impl ConcurrencyLimit {
    /// A limit of `limit` holders at once, counted per worker class unless [`Keyed::key`]
    /// names it otherwise. Defaults: lease 30 s, wait 5 s, poll 100 ms. A `limit` of 0 never grants:
    /// every job is rescheduled.
    pub fn new(limit: u32) -> Self {
        ConcurrencyLimit {
            name: LockKey::Class,
            limit,
            lease: Duration::from_secs(30),
            wait: Duration::from_secs(5),
            poll: Duration::from_millis(100),
            reschedule_in: None,
        }
    }

    /// How long a lease lives without renewal (renewed every third of it while the job runs); a
    /// crashed holder frees its slot within this time. Default 30 s.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_millis(3));
        self
    }

    /// How long a job waits for a slot, holding its worker slot, before it is rescheduled. Default 5 s;
    /// zero: one attempt, then reschedule.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// The first pause between attempts while waiting; it doubles up to 8× and is jittered. Default
    /// 100 ms.
    pub fn poll(mut self, poll: Duration) -> Self {
        self.poll = poll.max(Duration::from_millis(1));
        self
    }

    /// The base of the reschedule delay: a rescheduled job comes back after `d ..= 2d`. Default: half
    /// the lease.
    pub fn reschedule_in(mut self, d: Duration) -> Self {
        self.reschedule_in = Some(d);
        self
    }

    /// The delay of a job that gave up waiting.
    fn reschedule_delay(&self) -> Duration {
        let base = self.reschedule_in.unwrap_or(self.lease / 2);
        limits::uniform(base, base * 2)
    }

    /// Renews `holder`'s lease every `lease / 3`, forever: the caller drops it when the job ends.
    async fn renew(&self, mut conn: Conn, key: &str, holder: &str) -> Infallible {
        let period = (self.lease / 3).max(Duration::from_millis(1));
        let mut warned = false;
        loop {
            tokio::time::sleep(period).await;
            match acquire_key(&mut conn, key, holder, self.limit, self.lease).await {
                Ok(true) => warned = false,
                Ok(false) => {
                    if !warned {
                        tracing::warn!(
                            limit = key,
                            holder,
                            "concurrency lease lost and the limit is full: \
                            this job keeps running, so the limit may be exceeded until it ends"
                        );
                        warned = true;
                    }
                }
                Err(e) => {
                    tracing::warn!(limit = key, error = %e, "concurrency lease renewal failed; retrying")
                }
            }
        }
    }
}

impl Keyed for ConcurrencyLimit {
    fn keyed(mut self, key: LockKey) -> Self {
        self.name = key;
        self
    }
}

impl ServerMiddleware for ConcurrencyLimit {
    fn call<'a>(&'a self, ctx: &'a JobContext, next: Next<'a>) -> BoxFuture<'a, JobResult> {
        Box::pin(async move {
            let name = self.name.resolve(ctx)?;
            let key = keys::concurrency(&name);
            let holder = limits::holder_id(ctx.jid());
            let mut conn = ctx.redis();
            let start = Instant::now();
            let deadline = limits::deadline(start, self.wait);
            let max_poll = self.poll.saturating_mul(8);
            let mut attempt = 0;
            loop {
                match acquire_key(&mut conn, &key, &holder, self.limit, self.lease).await {
                    Ok(true) => break,
                    Ok(false) => {}
                    Err(e) => {
                        return Err(limits::redis_failure(
                            &format!("concurrency limit {name}"),
                            e,
                        ));
                    }
                }
                let now = Instant::now();
                let slept = now < deadline
                    && limits::pause(
                        ctx,
                        limits::backoff(self.poll, max_poll, attempt).min(deadline - now),
                    )
                    .await;
                if !slept {
                    let delay = self.reschedule_delay();
                    return Err(JobError::reschedule(
                        delay.as_secs_f64(),
                        format!(
                            "concurrency limit {name} ({} at once) full after waiting {:.1}s: \
                             rescheduled in {:.1}s",
                            self.limit,
                            start.elapsed().as_secs_f64(),
                            delay.as_secs_f64()
                        ),
                    ));
                }
                attempt += 1;
            }
            if attempt > 0 {
                tracing::debug!(limit = %name, waited = ?start.elapsed(), "concurrency slot acquired");
            }
            let result = tokio::select! {
                biased;
                result = next.run(ctx) => result,
                never = self.renew(conn.clone(), &key, &holder) => match never {},
            };
            if let Err(e) = release_key(&mut conn, &key, &holder).await {
                tracing::warn!(limit = %name, error = %e,
                    "could not release a concurrency slot; it frees itself when its lease expires");
            }
            result
        })
    }
}

/// Server middleware: at most `limit` jobs through it at once inside this process; no Redis round trip.
///
/// [`WorkerOptions::local_concurrency`](crate::WorkerOptions) puts one first in the worker's chain; it
/// may also be used directly (one value shared by several workers caps them together).
#[derive(Debug, Clone)]
pub struct LocalConcurrencyLimit {
    /// The permits: one per job running through this middleware.
    permits: Arc<Semaphore>,
    /// How many permits there are (for messages).
    limit: usize,
    /// How long a job waits for a permit, holding its worker slot, before it is rescheduled.
    wait: Duration,
}

impl LocalConcurrencyLimit {
    /// At most `limit` at once (0 is taken as 1); a job waits up to 5 s for a permit, then is
    /// rescheduled in 5–10 s.
    pub fn new(limit: usize) -> Self {
        let limit = limit.clamp(1, Semaphore::MAX_PERMITS);
        LocalConcurrencyLimit {
            permits: Arc::new(Semaphore::new(limit)),
            limit,
            wait: Duration::from_secs(5),
        }
    }

    /// How long a job waits for a permit before it is rescheduled (in `wait ..= 2 × wait`, at least
    /// 1 s). Default 5 s.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Permits free right now.
    pub fn available(&self) -> usize {
        self.permits.available_permits()
    }
}

impl ServerMiddleware for LocalConcurrencyLimit {
    fn call<'a>(&'a self, ctx: &'a JobContext, next: Next<'a>) -> BoxFuture<'a, JobResult> {
        Box::pin(async move {
            let mut signal = ctx.shutdown();
            let permit = tokio::select! {
                biased;
                permit = self.permits.clone().acquire_owned() => permit.ok(),
                _ = tokio::time::sleep(self.wait) => None,
                _ = signal.quiet() => None,
            };
            let Some(_permit) = permit else {
                let base = self.wait.max(Duration::from_secs(1));
                let delay = limits::uniform(base, base * 2);
                return Err(JobError::reschedule(
                    delay.as_secs_f64(),
                    format!(
                        "local concurrency cap of {} for {} full after waiting {:.1}s: rescheduled in {:.1}s",
                        self.limit,
                        ctx.class(),
                        self.wait.as_secs_f64(),
                        delay.as_secs_f64()
                    ),
                ));
            };
            next.run(ctx).await
        })
    }
}

// Both must stay usable as chain entries.
fn _obj_safe(_: Box<dyn ServerMiddleware>) {}
const _: fn() = || {
    fn is_middleware<T: ServerMiddleware>() {}
    is_middleware::<ConcurrencyLimit>();
    is_middleware::<LocalConcurrencyLimit>();
};
