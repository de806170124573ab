//! The [`Worker`] trait an application implements, and the [`JobContext`] each run receives.
//!
//! Static dispatch for the user: `perform(&self, ctx, args: Self::Args)` with `Args` deserialized by
//! serde from the whole positional `args` array (a tuple, a one-field tuple, [`NoArgs`], or
//! `Vec<serde_json::Value>` for `perform(*args)`). Type erasure happens once, in the
//! [`Registry`](crate::registry::Registry). The Ruby class name is explicit and greppable: [`Worker::CLASS`].

use std::future::Future;
use std::sync::{Arc, Mutex};

use serde::Deserialize;
use serde::de::{DeserializeOwned, Deserializer, IgnoredAny, SeqAccess, Visitor};

use crate::error::JobResult;
use crate::job::{Job, RetrySetting};
use crate::middleware::BoxFuture;
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

    /// Per-worker options, like Ruby's `sidekiq_options`.
    fn options(&self) -> WorkerOptions {
        WorkerOptions::default()
    }

    /// Runs one job.
    fn perform(&self, ctx: &JobContext, args: Self::Args)
    -> impl Future<Output = JobResult> + Send;
}

/// Per-worker options (Ruby's `sidekiq_options`); each applies when the payload does not say otherwise.
///
/// ```
/// use oxidekiq::{JobContext, JobResult, NoArgs, RetrySetting, Worker, WorkerOptions};
///
/// /// `sidekiq_options retry: 5, retry_queue: "low", backtrace: 10`
/// #[derive(Debug)]
/// struct NightlyJob;
///
/// impl Worker for NightlyJob {
///     const CLASS: &'static str = "NightlyJob";
///     type Args = NoArgs;
///
///     fn options(&self) -> WorkerOptions {
///         WorkerOptions {
///             retry: Some(RetrySetting::Count(5)),
///             retry_queue: Some("low".into()),
///             backtrace: Some(10),
///             local_concurrency: Some(2), // at most 2 at once in this process
///             ..WorkerOptions::default()
///         }
///     }
///
///     async fn perform(&self, _ctx: &JobContext, _args: NoArgs) -> JobResult {
///         Ok(())
///     }
/// }
/// # assert_eq!(NightlyJob.options().retry, Some(RetrySetting::Count(5)));
/// ```
#[derive(Debug, Clone, Default)]
pub struct WorkerOptions {
    /// Retries when the payload has no `retry` key (default: Sidekiq's 25).
    pub retry: Option<RetrySetting>,
    /// Queue that retries go to (the payload's `retry_queue` wins).
    pub retry_queue: Option<String>,
    /// `false`: exhausted jobs are dropped instead of going to the dead set.
    pub dead: Option<bool>,
    /// How many backtrace lines to store in `error_backtrace` (`None`: the payload's `backtrace`).
    pub backtrace: Option<usize>,
    /// At most this many jobs of this class run at once inside this process (no Redis round trip).
    pub local_concurrency: Option<usize>,
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

/// What an ActiveJob job carries besides its arguments ([`JobContext::activejob`]).
///
/// ```
/// use oxidekiq::{JobContext, JobResult, Worker};
///
/// /// `WelcomeEmailJob.perform_later(42)`, an ActiveJob job: dispatched on its own class name.
/// #[derive(Debug)]
/// struct WelcomeEmailJob;
///
/// impl Worker for WelcomeEmailJob {
///     const CLASS: &'static str = "WelcomeEmailJob";
///     type Args = (u64,);
///
///     async fn perform(&self, ctx: &JobContext, (user_id,): Self::Args) -> JobResult {
///         if let Some(aj) = ctx.activejob() {
///             tracing::info!(user_id, job_id = aj.job_id, executions = aj.executions, "welcome");
///         }
///         Ok(())
///     }
/// }
/// ```
#[derive(Debug, Clone)]
pub struct ActiveJobInfo {
    /// ActiveJob's own id (a UUID), not Sidekiq's `jid`.
    pub job_id: String,
    /// How many times ActiveJob already ran it (`executions`).
    pub executions: u64,
    /// The arguments: JSON text the worker's type reads directly, or the full decoder's value
    /// ([`crate::activejob::Arguments`]).
    pub(crate) arguments: crate::activejob::Arguments,
}

impl ActiveJobInfo {
    /// The arguments, decoded from ActiveJob's serialization into plain JSON values (built on first
    /// use when the job took the direct path: the worker itself never needs it).
    pub fn arguments(&self) -> &serde_json::Value {
        self.arguments.value()
    }

    /// The decoded arguments, owned.
    pub fn into_arguments(self) -> serde_json::Value {
        self.arguments.into_value()
    }

    /// Deserializes the arguments as `T`: straight from their JSON text when they need no decoding
    /// beyond dropping hash markers, otherwise from the full decoder's value. Both give the same `T`.
    pub fn args<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        self.arguments.deserialize()
    }
}

impl PartialEq for ActiveJobInfo {
    /// Equal when the id, the execution count and the decoded arguments are, whichever path decoded them.
    fn eq(&self, other: &Self) -> bool {
        self.job_id == other.job_id
            && self.executions == other.executions
            && self.arguments() == other.arguments()
    }
}

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
        }
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
