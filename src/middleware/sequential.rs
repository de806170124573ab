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
//! registry.register_with(
//!     RebuildIndex,
//!     vec![SequentialJob::<RebuildIndex>::new()
//!         .key(|(index,): &(String,)| format!("rebuild-{index}"))
//!         .timeout(Duration::from_secs(120))
//!         .into()],
//! );
//! ```

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::job_lock;
use super::lock_key::LockKey;
use super::{BoxFuture, Next, ServerMiddleware};
use crate::error::{JobError, JobResult};
use crate::keys;
use crate::worker::{JobContext, Worker};

/// The `error_class` of a job that waited for its lock until the timeout.
pub const LOCK_NOT_ACQUIRED: &str = "LockNotAcquired";

/// The sequential-job middleware for worker `W`; see the [module documentation](self).
pub struct SequentialJob<W: Worker> {
    /// How the lock is named.
    key: LockKey<W::Args>,
    /// How long the lock lives without extension: bounds how long a crashed holder blocks the others.
    ttl: Duration,
    /// Average pause between attempts.
    poll: Duration,
    /// How long a job waits before going to the retry path.
    timeout: Duration,
    /// The worker whose arguments the key reads.
    _worker: PhantomData<fn() -> W>,
}

impl<W: Worker> SequentialJob<W> {
    /// Keyed by class name, TTL 30 s, poll 100 ms, timeout 60 s.
    pub fn new() -> Self {
        SequentialJob {
            key: LockKey::Class,
            ttl: Duration::from_secs(30),
            poll: Duration::from_millis(100),
            timeout: Duration::from_secs(60),
            _worker: PhantomData,
        }
    }

    super::lock_key::lock_key_builders!();

    /// The average pause between attempts (default 100 ms).
    pub fn poll(mut self, poll: Duration) -> Self {
        self.poll = poll;
        self
    }

    /// How long a job waits for the lock before it goes to the retry path (default 60 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

impl<W: Worker> Default for SequentialJob<W> {
    fn default() -> Self {
        Self::new()
    }
}

impl<W: Worker> fmt::Debug for SequentialJob<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SequentialJob")
            .field("worker", &W::CLASS)
            .field("key", &self.key)
            .field("ttl", &self.ttl)
            .field("poll", &self.poll)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl<W: Worker> From<SequentialJob<W>> for Arc<dyn ServerMiddleware> {
    fn from(m: SequentialJob<W>) -> Self {
        Arc::new(m)
    }
}

impl<W: Worker> ServerMiddleware for SequentialJob<W> {
    fn call<'a>(&'a self, ctx: &'a JobContext, next: Next<'a>) -> BoxFuture<'a, JobResult> {
        Box::pin(async move {
            let Some(name) = self.key.resolve(ctx) else {
                return next.run(ctx).await;
            };
            let key = keys::lock(&name);
            let started = Instant::now();
            let attempt = job_lock::acquire(
                &ctx.redis(),
                &key,
                ctx.jid(),
                self.ttl,
                self.poll,
                self.timeout,
            )
            .await
            .map_err(JobError::from)?;
            match attempt {
                Ok(lock) => {
                    let waited = started.elapsed();
                    if waited >= self.poll {
                        tracing::info!(lock = %lock.key(), waited = format_args!("{:.3}", waited.as_secs_f64()), "lock acquired");
                    }
                    let result = lock.hold_while(next.run(ctx)).await;
                    lock.release().await;
                    result
                }
                Err(holder) => Err(JobError::new(
                    LOCK_NOT_ACQUIRED,
                    format!(
                        "{key} still held by {} after waiting {:.3}s",
                        holder.as_deref().unwrap_or("another job"),
                        started.elapsed().as_secs_f64()
                    ),
                )),
            }
        })
    }
}

// The middleware must stay usable as a trait object in a chain.
fn _obj_safe(_: Box<dyn ServerMiddleware>) {}
fn _is_middleware<W: Worker>(m: SequentialJob<W>) -> Arc<dyn ServerMiddleware> {
    m.into()
}
