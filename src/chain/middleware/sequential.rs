//! Sequential jobs (blocking): jobs sharing a lock wait for each other and run one at a time.
//!
//! [`SequentialJob`] waits for the job's lock before the worker runs: it retries `SET NX PX` every
//! `poll` (jittered to `poll/2 ..= poll*3/2`, default 100 ms) until the lock is free or `timeout` has
//! passed (default 60 s). Then the job runs holding the lock, extended every `ttl / 3` while it runs
//! longer than the TTL, and released (compare-and-delete) when it ends, successfully or not.
//!
//! When the wait times out the job is **not** lost and **not** run: it fails with `error_class`
//! [`LOCK_NOT_ACQUIRED`] into the normal retry path (Sidekiq's backoff, retry count, dead set at the end).
//!
//! **A waiting job holds a worker slot** (one of `-c`), as a sleeping Ruby thread would: with many jobs
//! queued on one key, most of a process's slots may be waiting. Give such jobs their own queue or
//! process, keep `timeout` short enough for that to be acceptable, or use
//! [`UniqueJob`](super::unique::UniqueJob) with [`OnConflict::Reschedule`](super::unique::OnConflict)
//! to wait in the schedule set instead.
//!
//! A process that dies while holding a lock blocks the others for at most the TTL (default 30 s).
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use oxidekiq::middleware::sequential::SequentialJob;
//! use oxidekiq::{JobContext, Registry, Worker, error::JobResult};
//!
//! #[derive(Debug)]
//! struct RebuildIndex;
//!
//! impl Worker for RebuildIndex {
//!     const CLASS: &'static str = "RebuildIndexJob";
//!     type Args = (String,);
//!     async fn perform(&self, _ctx: &JobContext, (_index,): Self::Args) -> JobResult {
//!         Ok(()) // expensive: never twice at once for one index
//!     }
//! }
//!
//! let mut registry = Registry::new();
//! registry.register(RebuildIndex).with_key(
//!     SequentialJob::new().timeout(Duration::from_secs(120)),
//!     |(index,)| format!("rebuild-{index}"),
//! );
//! ```

use std::time::Duration;

use tokio::time::Instant;

use super::lock_key::{Keyed, LockKey};
use super::{BoxFuture, Next, ServerMiddleware};
use crate::error::{Error, JobError, JobResult};
use crate::lock::{LockGuard, LockOptions, RedisLock};
use crate::worker::JobContext;

/// The `error_class` of a job that waited for its lock until the timeout.
pub const LOCK_NOT_ACQUIRED: &str = "LockNotAcquired";

/// The sequential-job middleware: jobs under one key run one at a time, each waiting its turn (up
/// to the timeout, then the retry path); see the [module documentation](self).
///
/// ```
/// use std::time::Duration;
///
/// use oxidekiq::{Registry, SequentialJob};
/// # use oxidekiq::{JobContext, JobResult, Worker};
/// # #[derive(Debug)]
/// # struct ReportJob;
/// # impl Worker for ReportJob {
/// #     const CLASS: &'static str = "ReportJob";
/// #     type Args = (u64,);
/// #     async fn perform(&self, _: &JobContext, _: Self::Args) -> JobResult { Ok(()) }
/// # }
///
/// let mut registry = Registry::new();
/// registry
///     .register(ReportJob)
///     .with(SequentialJob::new().timeout(Duration::from_secs(120)));
/// ```
#[derive(Debug, Clone)]
pub struct SequentialJob {
    /// How the lock is named.
    key: LockKey,
    /// TTL (bounds how long a crashed holder blocks the others), poll and timeout of the wait.
    opts: LockOptions,
}

impl SequentialJob {
    /// Keyed by class name, TTL 30 s, poll 100 ms, timeout 60 s.
    pub fn new() -> Self {
        SequentialJob {
            key: LockKey::Class,
            opts: LockOptions {
                ttl: Duration::from_secs(30),
                poll: Duration::from_millis(100),
                timeout: Duration::from_secs(60),
            },
        }
    }

    /// The lock's TTL (default 30 s); the lock is extended while the job runs longer.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.opts.ttl = ttl;
        self
    }

    /// The average pause between attempts (default 100 ms).
    pub fn poll(mut self, poll: Duration) -> Self {
        self.opts.poll = poll;
        self
    }

    /// How long a job waits for the lock before it goes to the retry path (default 60 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.opts.timeout = timeout;
        self
    }
}

impl Default for SequentialJob {
    fn default() -> Self {
        Self::new()
    }
}

impl Keyed for SequentialJob {
    fn keyed(mut self, key: LockKey) -> Self {
        self.key = key;
        self
    }
}

impl ServerMiddleware for SequentialJob {
    fn call<'a>(&'a self, ctx: &'a JobContext, next: Next<'a>) -> BoxFuture<'a, JobResult> {
        Box::pin(async move {
            let Ok(key) = self.key.lock_key(ctx) else {
                return next.run(ctx).await;
            };
            let lock = RedisLock::at(ctx.redis(), key, self.opts)
                .held_by(ctx.jid())
                .batched(ctx.locks());
            let guard = match lock.try_lock_owned().await.map_err(JobError::from)? {
                Ok(guard) => guard,
                // Boxed: only a job whose lock is busy waits (see `RedisLock::try_lock`).
                Err(lock) => Box::pin(self.wait(lock)).await?,
            };
            let result = guard.hold_while(next.run(ctx)).await;
            guard.release_detached().await;
            result
        })
    }
}

impl SequentialJob {
    /// A job whose lock was busy at its first attempt: waits for it ([`RedisLock::lock`]) up to the
    /// timeout, counted from then (a round trip later than the job's start), then fails into the
    /// retry path naming the holder.
    async fn wait(&self, lock: RedisLock) -> Result<LockGuard, JobError> {
        let started = Instant::now();
        match lock.lock().await {
            Ok(guard) => {
                let waited = started.elapsed();
                if waited >= self.opts.poll {
                    let waited = format_args!("{:.3}", waited.as_secs_f64());
                    tracing::info!(lock = %guard.key(), waited, "lock acquired");
                }
                Ok(guard)
            }
            Err(Error::LockNotAcquired(_)) => {
                // Read only now, on the way to the retry path, to name the holder in the error.
                let holder = lock.holder_jid().await.ok().flatten();
                Err(JobError::new(
                    LOCK_NOT_ACQUIRED,
                    format!(
                        "{} still held by {} after waiting {:.3}s",
                        lock.key(),
                        holder.as_deref().unwrap_or("another job"),
                        started.elapsed().as_secs_f64()
                    ),
                ))
            }
            Err(e) => Err(JobError::from(e)),
        }
    }
}

// The middleware must stay usable as a trait object in a chain.
fn _obj_safe(_: Box<dyn ServerMiddleware>) {}
const _: fn() = || {
    fn is_middleware<T: ServerMiddleware>() {}
    is_middleware::<SequentialJob>();
};
