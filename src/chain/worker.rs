//! The [`Worker`] trait an application implements, and the [`JobContext`] each run receives.
//!
//! Static dispatch for the user: `perform(&self, ctx, args: Self::Args)` with `Args` deserialized by
//! serde from the whole positional `args` array (a tuple, a one-field tuple, [`NoArgs`], or
//! `Vec<serde_json::Value>` for `perform(*args)`). Type erasure happens once, in the
//! [`Registry`](crate::registry::Registry). The Ruby class name is explicit and greppable: [`Worker::CLASS`].

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use serde::Deserialize;
use serde::de::{DeserializeOwned, Deserializer, IgnoredAny, SeqAccess, Visitor};

use crate::error::JobResult;
use crate::job::Job;
use crate::lock_batch::Locks;
// Plain data the retry machinery below reads too: defined in `job`, kept at this public path.
pub use crate::job::WorkerOptions;
// Defined with the decoder that fills it, below the job chain; kept at this public path.
pub use crate::activejob::{ActiveJobInfo, AjValue, Continuation, HashKind, InterruptReason};
// Types a job context hands out, defined in internal modules.
pub use crate::redis_conn::Conn;
pub use crate::retry::Fate;
pub use crate::shutdown::ShutdownSignal;

/// A Rust worker for one Ruby class name.
///
/// ```
/// use oxidekiq::{JobContext, Worker, error::JobResult};
///
/// #[derive(Debug)]
/// struct ChargeJob;
///
/// impl Worker for ChargeJob {
///     const CLASS: &'static str = "Billing::ChargeJob";
///     type Args = (u64, f64, String);
///
///     async fn perform(&self, _ctx: &JobContext, (id, amount, currency): Self::Args) -> JobResult {
///         tracing::info!(id, amount, currency, "charged");
///         Ok(())
///     }
/// }
/// ```
pub trait Worker: Send + Sync + 'static {
    /// The Ruby class name the jobs carry (`class`, or `wrapped` for ActiveJob jobs).
    const CLASS: &'static str;
    /// The positional arguments, deserialized from the whole `args` array.
    type Args: DeserializeOwned + Send + 'static;

    /// True for a worker whose `perform` runs synchronous code to its end ([`crate::Blocking`]): a
    /// timeout cannot cancel it, so it is only reported (a log line and
    /// `oxidekiq_jobs_past_timeout_total`) and its run ends when its code returns.
    const SYNCHRONOUS: bool = false;

    /// True for a worker that reads Sidekiq's `cancel!` mark itself ([`crate::iterable::Iterable`],
    /// at its flushes). Any other async worker's running job is checked once per heartbeat and, once
    /// cancelled, dropped at its next await point: acknowledged, not retried, not counted as failed.
    const CHECKS_CANCEL: bool = false;

    /// Per-worker options, like Ruby's `sidekiq_options`.
    fn options(&self) -> WorkerOptions {
        WorkerOptions::default()
    }

    /// Runs one job.
    fn perform(&self, ctx: &JobContext, args: Self::Args)
    -> impl Future<Output = JobResult> + Send;
}

/// A worker whose `perform` takes no arguments: deserializes from any array, ignoring its items.
///
/// ```
/// use oxidekiq::{JobContext, JobResult, NoArgs, Worker};
///
/// /// `CleanupJob.perform_async` (Ruby: `def perform; end`)
/// #[derive(Debug)]
/// struct CleanupJob;
///
/// impl Worker for CleanupJob {
///     const CLASS: &'static str = "CleanupJob";
///     type Args = NoArgs;
///
///     async fn perform(&self, _ctx: &JobContext, NoArgs: NoArgs) -> JobResult {
///         Ok(())
///     }
/// }
/// # assert_eq!(serde_json::from_str::<NoArgs>("[1, \"extra\"]").unwrap(), NoArgs);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoArgs;

impl<'de> Deserialize<'de> for NoArgs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = NoArgs;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an args array")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<NoArgs, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(NoArgs)
            }
            fn visit_unit<E>(self) -> Result<NoArgs, E> {
                Ok(NoArgs)
            }
        }
        d.deserialize_any(V)
    }
}

/// A boxed, sendable future: what middleware and handlers return (`Box::pin(async move { .. })`).
///
/// ```
/// use oxidekiq::{BoxFuture, JobResult};
///
/// fn done<'a>() -> BoxFuture<'a, JobResult> {
///     Box::pin(async { Ok(()) })
/// }
/// # let _ = done();
/// ```
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Work a middleware leaves for after a failed job's fate is in Redis.
type FateHook = Box<dyn FnOnce(&Fate) -> BoxFuture<'static, ()> + Send>;

/// What middleware asked to run once a failed job's fate (retry, dead, discarded, rescheduled) is
/// written ([`JobContext::after_fate`]). The processor runs it after the write; the middleware itself
/// has returned by then, since retry wraps the chain from outside.
#[derive(Clone, Default)]
pub struct AfterFate(Arc<Mutex<Vec<FateHook>>>);

impl std::fmt::Debug for AfterFate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map(|h| h.len()).unwrap_or(0);
        f.debug_tuple("AfterFate").field(&n).finish()
    }
}

impl AfterFate {
    /// Ready for the next run of the same processor, without a new allocation when it can: the hooks
    /// the last run left (a run that did not fail never runs its hooks) are dropped, as they were when
    /// its list was dropped, and the list is kept when nobody else holds it; when a clone of it outlived
    /// the run (a context cloned into a task of the worker's own), that clone keeps the old list and a
    /// new one starts. One allocation and its free less a job (about 150 instructions).
    pub(crate) fn reuse(&mut self) {
        match Arc::get_mut(&mut self.0).map(Mutex::get_mut) {
            Some(Ok(hooks)) => hooks.clear(),
            _ => *self = AfterFate::default(),
        }
    }

    /// Runs every hook once with the fate written, in the order they were added.
    pub async fn run(&self, fate: &Fate) {
        let hooks = match self.0.lock() {
            Ok(mut h) => std::mem::take(&mut *h),
            Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
        };
        for hook in hooks {
            hook(fate).await;
        }
    }
}

/// Everything one run of a job can see: the payload, where it came from, Redis, and the shutdown.
///
/// ```
/// use std::time::Duration;
///
/// use oxidekiq::{JobContext, JobError, JobResult, Worker};
///
/// #[derive(Debug)]
/// struct ExportJob;
///
/// impl Worker for ExportJob {
///     const CLASS: &'static str = "ExportJob";
///     type Args = (String,);
///
///     async fn perform(&self, ctx: &JobContext, (path,): Self::Args) -> JobResult {
///         tracing::info!(jid = ctx.jid(), queue = ctx.queue(), path, "export");
///         // Any Redis command, on the connection the jobs share.
///         let mut redis = ctx.redis();
///         redis::cmd("INCR").arg("exports").query_async::<i64>(&mut redis).await?;
///         // A long job stops at the shutdown deadline; it is pushed back to its queue either way.
///         let mut shutdown = ctx.shutdown();
///         tokio::select! {
///             _ = tokio::time::sleep(Duration::from_secs(60)) => Ok(()),
///             _ = shutdown.cancelled() => Err(JobError::msg("interrupted by shutdown")),
///         }
///     }
/// }
/// ```
#[derive(Debug, Clone)]
pub struct JobContext {
    /// The decoded payload (with its original bytes).
    pub(crate) job: Arc<Job>,
    /// The queue it was fetched from.
    pub(crate) queue: Arc<str>,
    /// The Redis connection the jobs share (for middleware such as locks).
    pub(crate) redis: Conn,
    /// The process's shutdown phase.
    pub(crate) shutdown: ShutdownSignal,
    /// Present for ActiveJob jobs.
    pub(crate) activejob: Option<Arc<ActiveJobInfo>>,
    /// Hooks for after a failed run's fate is written.
    pub(crate) after_fate: AfterFate,
    /// The job locks' batch task the lock middleware send through (`None`: each lock command alone).
    pub(crate) locks: Option<Locks>,
    /// Which sidekiq-unique-jobs release the gem's jobs follow (`None`: detected per job).
    pub(crate) unique_jobs: Option<Arc<crate::unique_jobs::FleetGemRelease>>,
    /// Where Sidekiq's `cancel!` reaches this job from, when it can (a plain async job): the worker's
    /// own handler honours it ([`run_cancellable`]).
    pub(crate) cancel: Option<CancelCut>,
}

/// Where Sidekiq's `cancel!` reaches a running job from (the processor's work table, whose rows the
/// heartbeat's check marks): a wait that ends once the job of row `row` is cancelled.
pub(crate) trait CancelSource: Send + Sync + std::fmt::Debug {
    /// Resolves once the job of row `row` is cancelled.
    fn wait_cancel(&self, row: u64) -> BoxFuture<'_, ()>;
}

/// A job's way to be cancelled: its row in a [`CancelSource`].
#[derive(Debug, Clone)]
pub(crate) struct CancelCut {
    pub(crate) source: Arc<dyn CancelSource>,
    pub(crate) row: u64,
}

/// Runs `work` (a worker's perform) under the context's [`CancelCut`], if any: the worker first, and the
/// cancel wait built and polled only once the worker awaits, so a job that ends at its first poll (most)
/// pays for no more than a branch. Done inside the worker's handler future, which is boxed anyway: a
/// layer of its own around the worker cost every cancellable job a boxed future and a call more (about
/// 300 instructions). A cancelled worker is dropped at its await point and the job ends as done
/// (acknowledged, not retried, not a failure); its mark is removed, as an iterable job removes its hash
/// once it has honoured it.
pub(crate) async fn run_cancellable<F>(ctx: &JobContext, work: F) -> JobResult
where
    F: Future<Output = JobResult>,
{
    let Some(cut) = &ctx.cancel else {
        return work.await;
    };
    // Both end with this block: a cancelled worker is dropped before its mark is removed.
    let finished = {
        let mut work = std::pin::pin!(work);
        let mut wait: Option<BoxFuture<'_, ()>> = None;
        std::future::poll_fn(|cx| match work.as_mut().poll(cx) {
            std::task::Poll::Ready(result) => std::task::Poll::Ready(Some(result)),
            std::task::Poll::Pending => wait
                .get_or_insert_with(|| cut.source.wait_cancel(cut.row))
                .as_mut()
                .poll(cx)
                .map(|()| None),
        })
        .await
    };
    if let Some(result) = finished {
        return result;
    }
    tracing::info!("cancelled (Sidekiq's cancel!): stopped at its await point, not retried");
    let key = crate::keys::iteration(ctx.jid());
    if let Err(e) = redis::cmd("UNLINK")
        .arg(&key)
        .query_async::<i64>(&mut ctx.redis())
        .await
    {
        tracing::warn!(error = %e, key = %key, "cannot remove the cancel mark; it expires in 30 days");
    }
    Ok(())
}

impl JobContext {
    /// Builds a context; the processor does this for every job.
    pub fn new(
        job: Arc<Job>,
        queue: Arc<str>,
        redis: Conn,
        shutdown: ShutdownSignal,
        activejob: Option<Arc<ActiveJobInfo>>,
    ) -> Self {
        JobContext {
            job,
            queue,
            redis,
            shutdown,
            activejob,
            after_fate: AfterFate::default(),
            locks: None,
            unique_jobs: None,
            cancel: None,
        }
    }

    /// [`JobContext::new`] with the run's [`AfterFate`], without building a default one first (an
    /// allocation a job otherwise made and dropped).
    pub(crate) fn with_fate_hooks(
        job: Arc<Job>,
        queue: Arc<str>,
        redis: Conn,
        shutdown: ShutdownSignal,
        activejob: Option<Arc<ActiveJobInfo>>,
        after_fate: AfterFate,
    ) -> Self {
        JobContext {
            job,
            queue,
            redis,
            shutdown,
            activejob,
            after_fate,
            locks: None,
            unique_jobs: None,
            cancel: None,
        }
    }

    /// The same context, whose worker Sidekiq's `cancel!` reaches through `cut`.
    pub(crate) fn with_cancel(mut self, cut: Option<CancelCut>) -> Self {
        self.cancel = cut;
        self
    }

    /// The same context, whose lock middleware batch their lock commands through `locks` (the
    /// processor hands each job the process's handle, built where the launcher wires the parts).
    pub(crate) fn with_locks(mut self, locks: Locks) -> Self {
        self.locks = Some(locks);
        self
    }

    /// The same context, whose sidekiq-unique-jobs jobs follow the release `gem` tells.
    pub(crate) fn with_unique_jobs(
        mut self,
        gem: Arc<crate::unique_jobs::FleetGemRelease>,
    ) -> Self {
        self.unique_jobs = Some(gem);
        self
    }

    /// The sidekiq-unique-jobs release this job's lock follows.
    pub(crate) async fn unique_jobs_gem(&self) -> crate::config::UniqueJobsGem {
        match &self.unique_jobs {
            Some(g) => g.current(&self.redis).await,
            None => {
                crate::unique_jobs::FleetGemRelease::default()
                    .current(&self.redis)
                    .await
            }
        }
    }

    /// The job locks' batch task, for the lock middleware ([`crate::lock::RedisLock`]).
    pub(crate) fn locks(&self) -> Option<&Locks> {
        self.locks.as_ref()
    }

    /// The same context, whose [`JobContext::after_fate`] hooks go to `after` (the processor keeps a
    /// clone and runs them once the fate of a failed run is written).
    pub fn with_after_fate(mut self, after: AfterFate) -> Self {
        self.after_fate = after;
        self
    }

    /// Asks for `hook` to run if this run fails, once its fate (retry, dead, discarded, rescheduled) is
    /// in Redis: what a middleware that must know the fate needs (the until-executed lock is kept while
    /// the job waits for a retry and released when it dies). A run interrupted by the shutdown has no
    /// fate of its own (it is pushed back): its hooks do not run.
    pub fn after_fate<F>(&self, hook: F)
    where
        F: FnOnce(&Fate) -> BoxFuture<'static, ()> + Send + 'static,
    {
        match self.after_fate.0.lock() {
            Ok(mut h) => h.push(Box::new(hook)),
            Err(poisoned) => poisoned.into_inner().push(Box::new(hook)),
        }
    }

    /// The payload.
    pub fn job(&self) -> &Job {
        &self.job
    }

    /// Sidekiq's job id.
    pub fn jid(&self) -> &str {
        self.job.jid()
    }

    /// The class the worker is registered under.
    pub fn class(&self) -> &str {
        self.job.worker_class()
    }

    /// The queue the job was fetched from.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The `args` array as JSON text (for ActiveJob: the wrapper's single hash).
    pub fn args_json(&self) -> &str {
        self.job.args_json()
    }

    /// A clone of the Redis connection the jobs share (not the heartbeat's: a job cannot hold up the beat).
    pub fn redis(&self) -> Conn {
        self.redis.clone()
    }

    /// ActiveJob's `job_id`, `executions` and decoded arguments, for ActiveJob jobs.
    pub fn activejob(&self) -> Option<&ActiveJobInfo> {
        self.activejob.as_deref()
    }

    /// The process's shutdown phase: a long job can check [`ShutdownSignal::is_stopping`] or await
    /// [`ShutdownSignal::cancelled`] and stop early (its payload is pushed back either way).
    pub fn shutdown(&self) -> ShutdownSignal {
        self.shutdown.clone()
    }

    /// Deserializes the job's arguments as `T` (what the worker's `perform` receives).
    pub fn args<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        match &self.activejob {
            Some(aj) => aj.args(),
            None => serde_json::from_str(self.job.args_json()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Adds a hook to `after` that counts its runs in `ran`.
    fn counting_hook(after: &AfterFate, ran: &Arc<std::sync::atomic::AtomicUsize>) {
        let ran = ran.clone();
        after.0.lock().unwrap().push(Box::new(move |_: &Fate| {
            ran.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Box::pin(async {})
        }));
    }

    /// A processor's list of hooks serves its next job only once its last run let go of it, and never
    /// hands that job the hooks of the run before (which did not fail, so never ran them); a clone that
    /// outlived its run keeps its own list.
    #[tokio::test]
    async fn a_reused_hook_list_holds_none_of_the_last_runs_hooks() {
        let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut after = AfterFate::default();
        let first = Arc::as_ptr(&after.0);
        // A run that did not fail: its hook is left behind, then the run's clone is gone.
        let run = after.clone();
        counting_hook(&run, &ran);
        drop(run);
        after.reuse();
        assert_eq!(Arc::as_ptr(&after.0), first, "the list is kept");
        after.run(&Fate::Dead).await;
        assert_eq!(
            ran.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "the last run's hook ran"
        );
        // A clone that outlived its run: the next run gets a list of its own.
        let escaped = after.clone();
        after.reuse();
        assert_ne!(Arc::as_ptr(&after.0), first, "a list still held was reused");
        counting_hook(&escaped, &ran);
        after.run(&Fate::Dead).await;
        assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), 0);
        escaped.run(&Fate::Dead).await;
        assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[test]
    fn no_args_takes_any_array() {
        let _: NoArgs = serde_json::from_str("[]").unwrap();
        let _: NoArgs = serde_json::from_str("[1,[2],{\"a\":3}]").unwrap();
        assert!(serde_json::from_str::<NoArgs>("{}").is_err());
    }

    #[test]
    fn tuples_take_positional_args() {
        let (name, count): (String, i64) = serde_json::from_str(r#"["bob",5]"#).unwrap();
        assert_eq!((name.as_str(), count), ("bob", 5));
        assert!(serde_json::from_str::<(String, i64)>(r#"["bob"]"#).is_err());
    }
}
