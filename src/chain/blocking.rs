//! Workers whose `perform` is synchronous: [`BlockingWorker`], registered as [`Blocking`].
//!
//! Layer: job chain (beside `worker` and `registry`; it uses `worker` and `error` only).
//!
//! What Rust users expect for synchronous work (a blocking database driver, `std::thread::sleep`, a
//! CPU-bound loop): it runs on the job runtime's blocking pool (`spawn_blocking`), so it holds a pool
//! thread, not one of the runtime's `--threads`, and other jobs go on running meanwhile. Type erasure
//! stays in one place: [`Blocking`] is an ordinary [`Worker`] whose future awaits the pool thread, so the
//! registry, the middleware chain and the retry path see no difference.
//!
//! At the shutdown deadline the job's future is dropped like any other job's and the payload pushed
//! back to its queue; the pool thread cannot be stopped from outside, so it is abandoned: it runs on
//! until `perform` returns (or the process exits), and what it returns is thrown away, so no fate is
//! written for a job that was pushed back. A long `perform` can free its thread by checking
//! [`ShutdownSignal::is_cancelled`](crate::worker::ShutdownSignal::is_cancelled) between steps.

use std::sync::Arc;

use serde::de::DeserializeOwned;

use crate::error::{JobError, JobResult};
use crate::worker::{JobContext, Worker, WorkerOptions};

/// A worker for one Ruby class name whose `perform` is synchronous and may block its thread; register
/// it wrapped in [`Blocking`].
///
/// ```
/// use std::time::Duration;
///
/// use oxidekiq::{Blocking, BlockingWorker, JobContext, JobError, JobResult, Registry};
///
/// /// `ReportJob.perform_async(account_id)`: a synchronous export, ported as it was.
/// #[derive(Debug)]
/// struct ReportJob;
///
/// impl BlockingWorker for ReportJob {
///     const CLASS: &'static str = "ReportJob";
///     type Args = (u64,);
///
///     fn perform(&self, ctx: &JobContext, (account_id,): Self::Args) -> JobResult {
///         for _chunk in 0..3 {
///             if ctx.shutdown().is_cancelled() {
///                 // Past the stop's deadline: the job is pushed back to its queue; stop early.
///                 return Err(JobError::msg("interrupted by shutdown"));
///             }
///             std::thread::sleep(Duration::from_millis(10)); // a blocking driver's call
///         }
///         // Async APIs are one `block_on` away: this thread belongs to the job runtime's blocking pool.
///         let mut redis = ctx.redis();
///         tokio::runtime::Handle::current().block_on(async {
///             redis::cmd("INCR").arg(format!("reports:{account_id}")).query_async::<i64>(&mut redis).await
///         })?;
///         Ok(())
///     }
/// }
///
/// let mut registry = Registry::new();
/// registry.register(Blocking::new(ReportJob));
/// assert_eq!(registry.classes(), ["ReportJob"]);
/// ```
pub trait BlockingWorker: Send + Sync + 'static {
    /// The Ruby class name the jobs carry (`class`, or `wrapped` for ActiveJob jobs).
    const CLASS: &'static str;
    /// The positional arguments, deserialized from the whole `args` array.
    type Args: DeserializeOwned + Send + 'static;

    /// Per-worker options, like Ruby's `sidekiq_options`.
    fn options(&self) -> WorkerOptions {
        WorkerOptions::default()
    }

    /// Runs one job on a blocking-pool thread.
    fn perform(&self, ctx: &JobContext, args: Self::Args) -> JobResult;
}

/// A [`BlockingWorker`] as a [`Worker`]: each run goes to the blocking pool. `Registry::register(
/// Blocking::new(worker))`; locks and limits are added to its registration as to any worker's.
#[derive(Debug)]
pub struct Blocking<W>(Arc<W>);

impl<W: BlockingWorker> Blocking<W> {
    /// Wraps `worker` for [`Registry::register`](crate::Registry::register).
    pub fn new(worker: W) -> Self {
        Blocking(Arc::new(worker))
    }
}

impl<W: BlockingWorker> Worker for Blocking<W> {
    const CLASS: &'static str = W::CLASS;
    type Args = W::Args;
    // Its thread cannot be stopped from outside: a timeout would fail a job whose code runs on.
    const SYNCHRONOUS: bool = true;

    fn options(&self) -> WorkerOptions {
        self.0.options()
    }

    async fn perform(&self, ctx: &JobContext, args: Self::Args) -> JobResult {
        let (worker, ctx) = (self.0.clone(), ctx.clone());
        match tokio::task::spawn_blocking(move || worker.perform(&ctx, args)).await {
            Ok(result) => result,
            // The job's own panic, raised again in its task: the processor turns it into the job's
            // failure exactly as it does an async worker's (`Oxidekiq::Panic`, Sidekiq's backoff).
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // Only a runtime shutting down cancels a blocking task before it starts; the job was not
            // run, and the shutdown pushes it back (its failure is not written once cancelled).
            Err(e) => Err(JobError::msg(format!("blocking job not run: {e}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Sync;
    impl BlockingWorker for Sync {
        const CLASS: &'static str = "SyncJob";
        type Args = (u64,);
        fn options(&self) -> WorkerOptions {
            WorkerOptions {
                backtrace: Some(3),
                ..WorkerOptions::default()
            }
        }
        fn perform(&self, _ctx: &JobContext, (n,): Self::Args) -> JobResult {
            match n {
                0 => Err(JobError::msg("zero")),
                1 => panic!("one"),
                _ => Ok(()),
            }
        }
    }

    #[test]
    fn a_blocking_worker_keeps_its_class_and_options() {
        let w = Blocking::new(Sync);
        assert_eq!(<Blocking<Sync> as Worker>::CLASS, "SyncJob");
        assert_eq!(Worker::options(&w).backtrace, Some(3));
    }
}
