//! Unique jobs (non-blocking): while one job holds the lock, a duplicate does not run.
//!
//! [`UniqueJob`] takes the job's lock with one `SET NX PX` before the worker runs. If it is free the job
//! runs holding it: the lock is extended every `ttl / 3` while the job runs longer than its TTL and
//! released (compare-and-delete on our own value) when the job ends, successfully or not. If another job
//! holds it, [`OnConflict`] decides: by default the duplicate is **skipped**: acknowledged as done and
//! logged with the lock key and the holder's jid:
//!
//! ```text
//! 2026-11-21T20:02:30.411Z pid=4242 tid=2c8 class=UniqueReportJob jid=ecf8fc8053b3a18fd1a94b54 lock=oxidekiq:lock:UniqueReportJob holder=0d5a34f6c1b2e3a4b5c6d7e8 INFO: skipped duplicate
//! ```
//!
//! This is "until executed" *while running* (`lock: :while_executing` in sidekiq-unique-jobs terms): the
//! lock covers the run, not the time in the queue. To refuse duplicates already at enqueue, push with
//! [`NewJob::unique_for`](crate::client::NewJob::unique_for).
//!
//! A process that dies while holding a lock blocks its duplicates for at most the TTL (default 30 s).
//! If the holder is the same jid (a run of this very job that crashed, now recovered), the job is not
//! skipped: it is rescheduled for when that lock will have expired.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use oxidekiq::middleware::unique::{OnConflict, UniqueJob};
//! use oxidekiq::{JobContext, Registry, Worker, error::JobResult};
//!
//! #[derive(Debug)]
//! struct SyncCustomer;
//!
//! impl Worker for SyncCustomer {
//!     const CLASS: &'static str = "SyncCustomerJob";
//!     type Args = (u64,);
//!     async fn perform(&self, _ctx: &JobContext, (_customer_id,): Self::Args) -> JobResult {
//!         Ok(()) // call the Stripe API once
//!     }
//! }
//!
//! let mut registry = Registry::new();
//! registry.register(SyncCustomer).with_key(
//!     UniqueJob::new()
//!         .ttl(Duration::from_secs(60))
//!         .on_conflict(OnConflict::Reschedule(Duration::from_secs(30))),
//!     |(customer_id,)| format!("stripe-{customer_id}"),
//! );
//! ```

use std::time::Duration;

use super::lock_key::{Keyed, LockKey};
use super::{BoxFuture, Next, ServerMiddleware};
use crate::error::{JobError, JobResult};
use crate::lock::{LockOptions, RedisLock};
use crate::worker::JobContext;

/// The `error_class` of a duplicate failed with [`OnConflict::Fail`].
pub const DUPLICATE_ERROR_CLASS: &str = "Oxidekiq::DuplicateJob";

/// What happens to a job whose lock someone else holds.
///
/// ```
/// use std::time::Duration;
///
/// use oxidekiq::{OnConflict, Registry, UniqueJob};
/// # use oxidekiq::{JobContext, JobResult, Worker};
/// # #[derive(Debug)]
/// # struct SyncJob;
/// # impl Worker for SyncJob {
/// #     const CLASS: &'static str = "SyncJob";
/// #     type Args = (u64,);
/// #     async fn perform(&self, _: &JobContext, _: Self::Args) -> JobResult { Ok(()) }
/// # }
///
/// let mut registry = Registry::new();
/// // A duplicate tries again in 30 s instead of being skipped.
/// registry
///     .register(SyncJob)
///     .with(UniqueJob::new().on_conflict(OnConflict::Reschedule(Duration::from_secs(30))));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnConflict {
    /// Do not run it; acknowledge it as done and log `skipped duplicate` with the key and the holder.
    #[default]
    Skip,
    /// Put it back in the schedule set to try again after this delay (not counted as a failure).
    Reschedule(Duration),
    /// Fail it with [`DUPLICATE_ERROR_CLASS`] into the normal retry path (backoff, retry count, dead set).
    Fail,
}

/// The unique-job middleware: while one job holds the lock, a duplicate is skipped (or rescheduled,
/// or failed: [`OnConflict`]); see the [module documentation](self).
///
/// ```
/// use std::time::Duration;
///
/// use oxidekiq::{Keyed, Registry, UniqueJob};
/// # use oxidekiq::{JobContext, JobResult, Worker};
/// # #[derive(Debug)]
/// # struct SyncJob;
/// # impl Worker for SyncJob {
/// #     const CLASS: &'static str = "SyncJob";
/// #     type Args = (u64,);
/// #     async fn perform(&self, _: &JobContext, _: Self::Args) -> JobResult { Ok(()) }
/// # }
/// # #[derive(Debug)]
/// # struct ChargeJob;
/// # impl Worker for ChargeJob {
/// #     const CLASS: &'static str = "ChargeJob";
/// #     type Args = (u64, f64);
/// #     async fn perform(&self, _: &JobContext, _: Self::Args) -> JobResult { Ok(()) }
/// # }
///
/// let mut registry = Registry::new();
/// // One SyncJob per argument list at a time; the lock lives 60 s unless the job extends it.
/// registry.register(SyncJob).with(UniqueJob::new().key_by_args().ttl(Duration::from_secs(60)));
/// // One ChargeJob per customer at a time, named from the typed arguments.
/// registry.register(ChargeJob).with_key(UniqueJob::new(), |(customer, _)| format!("charge-{customer}"));
/// ```
#[derive(Debug, Clone)]
pub struct UniqueJob {
    /// How the lock is named.
    key: LockKey,
    /// How long the lock lives without extension: bounds how long a crashed holder blocks duplicates.
    ttl: Duration,
    /// What a duplicate does.
    on_conflict: OnConflict,
}

impl UniqueJob {
    /// Keyed by class name, TTL 30 s, duplicates skipped.
    pub fn new() -> Self {
        UniqueJob {
            key: LockKey::Class,
            ttl: Duration::from_secs(30),
            on_conflict: OnConflict::Skip,
        }
    }

    /// The lock's TTL (default 30 s); the lock is extended while the job runs longer.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// What a duplicate does (default [`OnConflict::Skip`]).
    pub fn on_conflict(mut self, on_conflict: OnConflict) -> Self {
        self.on_conflict = on_conflict;
        self
    }
}

impl Default for UniqueJob {
    fn default() -> Self {
        Self::new()
    }
}

impl Keyed for UniqueJob {
    fn keyed(mut self, key: LockKey) -> Self {
        self.key = key;
        self
    }
}

impl ServerMiddleware for UniqueJob {
    fn call<'a>(&'a self, ctx: &'a JobContext, next: Next<'a>) -> BoxFuture<'a, JobResult> {
        Box::pin(async move {
            let Ok(key) = self.key.lock_key(ctx) else {
                return next.run(ctx).await;
            };
            let opts = LockOptions {
                ttl: self.ttl,
                ..LockOptions::default()
            };
            let lock = RedisLock::at(ctx.redis(), key, opts)
                .held_by(ctx.jid())
                .batched(ctx.locks());
            // One `SET NX PX` on the way in, one `EVALSHA` on the way out, each sent in a batch with
            // the other jobs' (`lock_batch`); the release is queued, not waited for (the job is over).
            match lock.try_lock_owned().await.map_err(JobError::from)? {
                Ok(guard) => {
                    let result = guard.hold_while(next.run(ctx)).await;
                    guard.release_detached().await;
                    result
                }
                // Boxed: a duplicate's path is not every job's (see `RedisLock::try_lock`).
                Err(lock) => Box::pin(self.duplicate(ctx, lock)).await,
            }
        })
    }
}

impl UniqueJob {
    /// A job whose lock someone holds: the holder is read, then [`OnConflict`] decides.
    async fn duplicate(&self, ctx: &JobContext, lock: RedisLock) -> JobResult {
        let key = lock.key();
        let holder = lock.holder_jid().await.map_err(JobError::from)?;
        let holder_shown = holder.as_deref().unwrap_or("unknown");
        if holder.as_deref() == Some(ctx.jid()) {
            // An earlier run of this same job died holding the lock; skipping would lose the job.
            tracing::info!(lock = %key, "lock still held by an earlier run of this job: rescheduled");
            return Err(JobError::reschedule(
                self.ttl.as_secs_f64(),
                format!("{key} still held by an earlier run of this job"),
            ));
        }
        match self.on_conflict {
            OnConflict::Skip => {
                tracing::info!(lock = %key, holder = %holder_shown, "skipped duplicate");
                Ok(())
            }
            OnConflict::Reschedule(delay) => Err(JobError::reschedule(
                delay.as_secs_f64(),
                format!("duplicate: {key} is held by {holder_shown}"),
            )),
            OnConflict::Fail => Err(JobError::new(
                DUPLICATE_ERROR_CLASS,
                format!("duplicate: {key} is held by {holder_shown}"),
            )),
        }
    }
}

// The middleware must stay usable as a trait object in a chain.
fn _obj_safe(_: Box<dyn ServerMiddleware>) {}
const _: fn() = || {
    fn is_middleware<T: ServerMiddleware>() {}
    is_middleware::<UniqueJob>();
};
