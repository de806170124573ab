//! Testing your workers: run one job and see its fate, build a [`JobContext`], record what a producer
//! pushes, run a class's chain or one middleware on a Redis of the test's own, and walk an iterable
//! job item by item. Behind the `testing` cargo feature (as tokio's `test-util`); docs/testing.md
//! shows each.
//!
//! Layer: wiring (it uses the job chain and the processing layer's own steps, so the outcome of a run
//! here is the one the processor would reach). Nothing here is used by the runtime.
//!
//! What "the same code" means, step by step:
//! - a job is built by [`NewJob::payload`], the bytes [`Client::push`] writes ([`TestJob`]);
//! - it is decoded by [`Job::parse`] and, for ActiveJob, the processor's own unwrapping; its
//!   arguments by the registry's decoder, so an `Args` type that does not fit fails with the
//!   `ArgumentError` it would get in production;
//! - a failure's fate is `retry::plan`, the function whose result the processor writes, with the
//!   newest Sidekiq rules and float-second timestamps (a fleet without Ruby 8 processes), and
//!   written nowhere ([`Outcome`]); the after-fate hooks middleware asked for run with it;
//! - a worker's `timeout` and the payload's `oxidekiq_timeout` cut an async run as the processor
//!   does; a panic becomes the job's `Oxidekiq::Panic` failure.
//!
//! Sidekiq's `Sidekiq::Testing.fake!` is [`FakeClient`], River's `rivertest.Worker` and Oban's
//! `perform_job` are [`perform`], `assert_enqueued` is [`FakeClient::assert_enqueued`] (and
//! [`TestRedis::assert_enqueued`] against a real Redis).

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use crate::client::{Client, NewJob, Recorded, Recorder};
use crate::error::{JobError, JobResult};
use crate::iterable::{Enumerator, Iterable, IterableWorker};
use crate::job::{Job, WorkerOptions};
use crate::middleware::{Handler, Next, ServerMiddleware};
use crate::redis_conn::Conn;
use crate::registry::Registry;
use crate::retry::{self, Failure, Plan, RetryRules};
use crate::shutdown::{Phase, Shutdown};
use crate::time::TimeFormat;
use crate::worker::{AfterFate, BoxFuture, JobContext, ShutdownSignal, Worker};

/// The largest payload decoded, as the processor's default (`--max-payload-bytes`).
const MAX_PAYLOAD_BYTES: usize = 16 * 1024 * 1024;

/// What a context without Redis answers every command with.
const NO_REDIS: &str = "this test context has no Redis: give it one with TestJob::redis \
    (testing::TestRedis::start() runs a redis-server of the test's own)";

/// The most jobs [`FakeClient::drain`] runs: a job that pushes itself again would loop forever.
const MAX_DRAINED: usize = 100_000;

/// The process's shutdown phase, driven by the test: hand it to a [`TestJob`] and move it forward
/// to see what a worker does when the process goes quiet, stops, or passes its deadline.
///
/// ```
/// use oxidekiq::testing::TestShutdown;
///
/// let shutdown = TestShutdown::new();
/// let signal = shutdown.signal();
/// assert!(!signal.is_quiet());
/// shutdown.cancel(); // the deadline passed: `ctx.shutdown().cancelled()` returns
/// assert!(signal.is_cancelled());
/// ```
#[derive(Debug, Clone, Default)]
pub struct TestShutdown {
    /// The launcher's own handle, shared by the clones.
    inner: Arc<Shutdown>,
}

impl TestShutdown {
    /// A shutdown still running.
    pub fn new() -> Self {
        Self::default()
    }

    /// The signal a job's context hands out ([`JobContext::shutdown`]).
    pub fn signal(&self) -> ShutdownSignal {
        self.inner.signal()
    }

    /// The process goes quiet (TSTP): an iterable job stops at its next item.
    pub fn quiet(&self) {
        self.inner.advance(Phase::Quiet);
    }

    /// TERM arrived: running jobs have until the deadline.
    pub fn stop(&self) {
        self.inner.advance(Phase::Stopping);
    }

    /// The deadline passed: running jobs should stop now. A run that fails from here on has no
    /// fate of its own: it is pushed back ([`Fate::PushedBack`]).
    pub fn cancel(&self) {
        self.inner.advance(Phase::Cancelled);
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        self.inner.phase()
    }
}

/// One job as a test runs it: its payload (built as the [`Client`] builds it, or as Rails wrote it),
/// the queue it is fetched from, its Redis (none by default: a command fails with a message saying
/// so) and its shutdown.
///
/// ```
/// use oxidekiq::NewJob;
/// use oxidekiq::testing::TestJob;
///
/// let job = TestJob::new(NewJob::new("HardWorker", ("bob", 5)).queue("critical").jid("abc"))
///     .retry_count(2); // as if it had failed three times already
/// let ctx = job.context();
/// assert_eq!((ctx.jid(), ctx.queue(), ctx.class()), ("abc", "critical", "HardWorker"));
/// assert_eq!(ctx.job().to_map().unwrap()["retry_count"], 2);
/// ```
#[derive(Debug, Clone)]
pub struct TestJob {
    /// The payload's bytes.
    payload: Vec<u8>,
    /// The queue it is fetched from (`None`: its own `queue`, else `default`).
    queue: Option<String>,
    /// Its Redis ([`Conn::absent`] when the test gave none).
    redis: Conn,
    /// The shutdown the test drives.
    shutdown: TestShutdown,
}

impl TestJob {
    /// `job` as [`Client::push`] would write it now (float-second timestamps, a fresh jid unless
    /// `job` has one, and a [`NewJob::unique_for`] job's lock fields, which the client's default
    /// chain writes; no lock is taken). For what a client with middleware of its own pushes, record
    /// it with a [`FakeClient`] and run [`Enqueued::job`].
    pub fn new(mut job: NewJob) -> TestJob {
        let _lock = crate::client::until_executed_fields(&mut job);
        let jid = job
            .given_jid()
            .map_or_else(crate::job::new_jid, str::to_string);
        let payload = job.payload(&jid, crate::time::now(), TimeFormat::Seconds);
        TestJob::payload(payload)
    }

    /// A job of worker `W` with `args`, as `W.perform_async(*args)` pushes it.
    pub fn of<W: Worker>(args: impl Serialize) -> TestJob {
        TestJob::new(NewJob::new(W::CLASS, args))
    }

    /// A payload as Rails or Sidekiq wrote it (a fixture, a line copied from Redis), byte for byte.
    pub fn payload(bytes: impl Into<Vec<u8>>) -> TestJob {
        TestJob {
            payload: bytes.into(),
            queue: None,
            redis: Conn::absent(NO_REDIS),
            shutdown: TestShutdown::new(),
        }
    }

    /// The payload with `retry_count` set to `n`, as Sidekiq leaves a job after its `n + 1`th
    /// failure: its next failure is retry `n + 1` (or its death).
    ///
    /// # Panics
    /// When the payload is not a JSON object.
    pub fn retry_count(mut self, n: i64) -> TestJob {
        let mut map = self.decoded().to_map().unwrap_or_else(|e| {
            panic!("TestJob::retry_count: the payload is not a JSON object: {e}")
        });
        map.insert("retry_count".into(), Value::from(n));
        if !map.contains_key("failed_at") {
            map.insert(
                "failed_at".into(),
                TimeFormat::Seconds.value(crate::time::now()),
            );
        }
        self.payload = retry::to_json(&map).into_bytes();
        self
    }

    /// The queue it is fetched from (by default its payload's `queue`).
    pub fn queue(mut self, queue: impl Into<String>) -> TestJob {
        self.queue = Some(queue.into());
        self
    }

    /// Runs it with `redis`'s connection: what the worker, its middleware and an iterable job's
    /// state use.
    pub fn redis(mut self, redis: &TestRedis) -> TestJob {
        self.redis = redis.conn();
        self
    }

    /// Runs it with a connection of the test's own.
    pub fn conn(mut self, conn: Conn) -> TestJob {
        self.redis = conn;
        self
    }

    /// Runs it under `shutdown`, which the test moves forward.
    pub fn shutdown(mut self, shutdown: &TestShutdown) -> TestJob {
        self.shutdown = shutdown.clone();
        self
    }

    /// The payload's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.payload
    }

    /// The payload decoded.
    ///
    /// # Panics
    /// When it does not decode (the processor would send it to the dead set: [`TestJob::perform`]
    /// shows that).
    pub fn decoded(&self) -> Job {
        Job::parse(self.payload.clone(), MAX_PAYLOAD_BYTES)
            .unwrap_or_else(|(_, e)| panic!("the test job's payload does not decode: {e}"))
    }

    /// The context its run receives, to call a worker's `perform` or a middleware directly. An
    /// ActiveJob payload's arguments are unwrapped as the processor unwraps them.
    ///
    /// # Panics
    /// When the payload does not decode, or its ActiveJob arguments do not.
    pub fn context(&self) -> TestContext {
        let job = Arc::new(self.decoded());
        let activejob = crate::processor::activejob_of(&job)
            .unwrap_or_else(|e| panic!("the test job's ActiveJob arguments do not decode: {e}"));
        self.context_of(job, activejob)
    }

    /// The queue the job is fetched from.
    fn fetched_from(&self, job: &Job) -> Arc<str> {
        Arc::from(self.queue.as_deref().or(job.queue()).unwrap_or("default"))
    }

    fn context_of(
        &self,
        job: Arc<Job>,
        activejob: Option<Arc<crate::worker::ActiveJobInfo>>,
    ) -> TestContext {
        let after = AfterFate::default();
        let queue = self.fetched_from(&job);
        let ctx = JobContext::new(
            job,
            queue,
            self.redis.clone(),
            self.shutdown.signal(),
            activejob,
        )
        .with_after_fate(after.clone());
        TestContext {
            ctx,
            after,
            shutdown: self.shutdown.clone(),
        }
    }

    /// Runs `worker` on this job as the processor would, without its middleware, and returns the
    /// result and the fate Sidekiq's rules give it (written nowhere). A payload that does not decode
    /// is [`Fate::Dead`], as the processor sends it to the dead set; one of another class than
    /// `W::CLASS` fails with the `NameError` of a class no worker is registered for.
    pub async fn perform<W: Worker>(&self, worker: &W) -> Outcome {
        let run = match self.prepare(W::CLASS) {
            Ok(run) => run,
            Err(refused) => return *refused,
        };
        let options = worker.options();
        let work = crate::registry::perform_decoded(worker, &run.tc.ctx);
        let result = guarded(&run.job, &options, W::SYNCHRONOUS, work).await;
        self.finish(&run, Some(&options), result).await
    }

    /// Runs the job through the chain `registry` holds for its class (its locks, limits and the
    /// middleware of every worker), then its worker, as the processor does. Locks and limits keep
    /// their state in Redis: give the job one ([`TestJob::redis`]). A class the registry does not
    /// hold fails with `NameError`, as in production. The registry must be frozen
    /// ([`Registry::freeze`] builds the chains).
    pub async fn perform_chain(&self, registry: &Arc<Registry>) -> Outcome {
        self.run_entry(registry, true).await
    }

    /// Runs the job with the worker `registry` holds for its class, through its chain or not.
    async fn run_entry(&self, registry: &Registry, chain: bool) -> Outcome {
        let job = match Job::parse(self.payload.clone(), MAX_PAYLOAD_BYTES) {
            Ok(job) => job,
            Err((bytes, e)) => return undecodable(&bytes, &e),
        };
        let class = job.worker_class().to_string();
        let Some(entry) = registry.get(&class) else {
            return self.refused(&job, crate::processor::unknown_class(&class));
        };
        let run = match self.prepare(&class) {
            Ok(run) => run,
            Err(refused) => return *refused,
        };
        let ctx = &run.tc.ctx;
        let work = if chain {
            Next::new(&entry.chain, entry.handler.as_ref()).run(ctx)
        } else {
            entry.handler.call(ctx)
        };
        let result = guarded(&run.job, &entry.options, entry.synchronous, work).await;
        self.finish(&run, Some(&entry.options), result).await
    }

    /// Decodes the job and builds its context as the processor does before a run: `Err` holds the
    /// outcome of a job refused before any worker runs (a payload that does not decode, a class
    /// other than `class`, ActiveJob arguments that do not decode).
    fn prepare(&self, class: &str) -> Result<Prepared, Box<Outcome>> {
        let job = match Job::parse(self.payload.clone(), MAX_PAYLOAD_BYTES) {
            Ok(job) => Arc::new(job),
            Err((bytes, e)) => return Err(Box::new(undecodable(&bytes, &e))),
        };
        if job.worker_class() != class {
            let name = crate::processor::unknown_class(job.worker_class());
            return Err(Box::new(self.refused(&job, name)));
        }
        let activejob =
            crate::processor::activejob_of(&job).map_err(|e| Box::new(self.refused(&job, e)))?;
        let tc = self.context_of(job.clone(), activejob);
        Ok(Prepared { job, tc })
    }

    /// The outcome of a job refused with `error` before any worker runs.
    fn refused(&self, job: &Job, error: JobError) -> Outcome {
        let queue = self.fetched_from(job);
        settle_now(job, &queue, None, Err(error), &self.shutdown).0
    }

    /// The outcome of a run that ended with `result`; the after-fate hooks its middleware
    /// registered run with the fate, as the processor runs them once the fate is written, and an
    /// interrupted run's until-executed lock goes to its next run, as the fate write passes it.
    async fn finish(
        &self,
        run: &Prepared,
        options: Option<&WorkerOptions>,
        result: JobResult,
    ) -> Outcome {
        let (outcome, lock) = settle_now(&run.job, run.tc.queue(), options, result, &self.shutdown);
        if let (Some(lock), Fate::Continued { jid, at }) = (lock, &outcome.fate) {
            let px = retry::hand_over_px(&lock, *at, crate::time::now());
            crate::middleware::until_executed::hand_over(&self.redis, &lock, jid, px).await;
        }
        if let Some(fate) = outcome.fate.written() {
            run.tc.after.run(&fate).await;
        }
        outcome
    }
}

/// A decoded job and the context its run receives.
struct Prepared {
    /// The decoded payload.
    job: Arc<Job>,
    /// Its context, with the hooks its middleware register.
    tc: TestContext,
}

/// `work` under the job's timeout (the payload's `oxidekiq_timeout` over the worker's option; not
/// for a synchronous worker, which the processor only reports), a panic becoming the job's
/// `Oxidekiq::Panic` failure, as in the processor.
async fn guarded(
    job: &Job,
    options: &WorkerOptions,
    synchronous: bool,
    work: impl std::future::Future<Output = JobResult>,
) -> JobResult {
    let timeout = crate::processor::job_timeout(job, Some(options)).filter(|_| !synchronous);
    let run = async {
        match timeout {
            None => work.await,
            Some(limit) => tokio::time::timeout(limit, work)
                .await
                .unwrap_or_else(|_| Err(crate::processor::timed_out(job, limit))),
        }
    };
    match crate::error::catch_unwind(std::pin::pin!(run)).await {
        Ok(result) => result,
        Err(panic) => Err(JobError::new(
            crate::error::PANIC,
            format!(
                "panicked: {}",
                crate::processor::panic_message(panic.as_ref())
            ),
        )),
    }
}

/// The outcome of a payload that does not decode: the processor sends it to the dead set.
fn undecodable(bytes: &[u8], e: &crate::job::PayloadError) -> Outcome {
    let now = crate::time::now();
    let member = retry::undecodable_payload(bytes, &e.to_string(), now, TimeFormat::Seconds);
    Outcome {
        result: Err(JobError::new(crate::error::INVALID_PAYLOAD, e.to_string())),
        fate: Fate::Dead,
        written: Some(String::from_utf8_lossy(&member).into_owned()),
    }
}

/// The outcome of a run that ended with `result`: done, or the fate the retry rules give its
/// failure, as the processor's `fail` computes it before writing it; with the until-executed lock a
/// continued run's fate write passes to its next run.
fn settle_now(
    job: &Job,
    queue: &str,
    options: Option<&WorkerOptions>,
    result: JobResult,
    shutdown: &TestShutdown,
) -> (Outcome, Option<crate::error::LockHandOver>) {
    let mut error = match result {
        Ok(()) => {
            let done = Outcome {
                result: Ok(()),
                fate: Fate::Done,
                written: None,
            };
            return (done, None);
        }
        Err(e) => e,
    };
    crate::processor::redact_error(&mut error);
    if crate::processor::interrupted(&shutdown.signal()) {
        let pushed_back = Outcome {
            result: Err(error),
            fate: Fate::PushedBack,
            written: None,
        };
        return (pushed_back, None);
    }
    let now = crate::time::now();
    let rules = RetryRules::default();
    let plan = retry::plan(
        &Failure {
            job,
            queue,
            error: &error,
            options,
            now,
            time_format: TimeFormat::Seconds,
            rules,
        },
        &mut rand::rng(),
    );
    let fate = match &plan {
        Plan::Retry { at, count, .. } => {
            let (earliest, latest) = retry::retry_window(now, *count, error.action, rules);
            Fate::Retry {
                count: *count,
                at: *at,
                delay: (earliest - now)..=(latest - now),
            }
        }
        Plan::Dead { .. } => Fate::Dead,
        Plan::Discard => Fate::Discarded,
        Plan::Reschedule { at } => Fate::Rescheduled { at: *at },
        Plan::Requeue { .. } => Fate::Requeued,
        Plan::Continue { at, jid, .. } => Fate::Continued {
            at: *at,
            jid: jid.clone(),
        },
    };
    let (written, lock) = match plan {
        Plan::Continue { payload, lock, .. } => (Some(payload), lock),
        Plan::Retry { payload, .. } | Plan::Dead { payload } | Plan::Requeue { payload, .. } => {
            (Some(payload), None)
        }
        Plan::Reschedule { .. } => (Some(job.raw().to_string()), None),
        Plan::Discard => (None, None),
    };
    let outcome = Outcome {
        result: Err(error),
        fate,
        written,
    };
    (outcome, lock)
}

/// A job's context built for a test ([`TestJob::context`]); derefs to the [`JobContext`].
#[derive(Debug, Clone)]
pub struct TestContext {
    /// The context a run receives.
    ctx: JobContext,
    /// The hooks middleware registered with [`JobContext::after_fate`].
    after: AfterFate,
    /// The shutdown the test drives.
    shutdown: TestShutdown,
}

impl std::ops::Deref for TestContext {
    type Target = JobContext;

    fn deref(&self) -> &JobContext {
        &self.ctx
    }
}

impl TestContext {
    /// The shutdown this context's [`JobContext::shutdown`] follows.
    pub fn test_shutdown(&self) -> &TestShutdown {
        &self.shutdown
    }

    /// Runs the hooks middleware registered with [`JobContext::after_fate`], as the processor does
    /// once a failed run's `fate` is written.
    pub async fn run_after_fate(&self, fate: &crate::worker::Fate) {
        self.after.run(fate).await;
    }
}

/// Runs `middleware` alone around `handler`, which stands for the worker: what the middleware does
/// before, whether it calls the rest of the chain, and what it makes of the result. The handler
/// gets a clone of the context. The middleware is shared (`Arc`), so a test can run it around
/// several jobs at once, as a limit sees them. (Before it, the built-in until-executed stages run as at the head of
/// every chain; they act only on payloads that carry their lock fields.)
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicBool, Ordering};
///
/// use oxidekiq::testing::{self, TestJob};
/// use oxidekiq::{BoxFuture, JobContext, JobResult, Next, ServerMiddleware};
///
/// /// Skips every job while set.
/// #[derive(Debug)]
/// struct Maintenance(bool);
///
/// impl ServerMiddleware for Maintenance {
///     fn call<'a>(&'a self, ctx: &'a JobContext, next: Next<'a>) -> BoxFuture<'a, JobResult> {
///         if self.0 {
///             return Box::pin(async { Ok(()) });
///         }
///         next.run(ctx)
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let ctx = TestJob::new(oxidekiq::NewJob::new("HardWorker", ("bob", 5))).context();
/// let ran = Arc::new(AtomicBool::new(false));
/// let seen = ran.clone();
/// let result = testing::run_middleware(&Arc::new(Maintenance(true)), &ctx, move |_ctx| {
///     let seen = seen.clone();
///     async move {
///         seen.store(true, Ordering::SeqCst);
///         Ok(())
///     }
/// })
/// .await;
/// assert!(result.is_ok());
/// assert!(!ran.load(Ordering::SeqCst), "maintenance skips the job");
/// # }
/// ```
pub async fn run_middleware<M, F, Fut>(
    middleware: &Arc<M>,
    ctx: &JobContext,
    handler: F,
) -> JobResult
where
    M: ServerMiddleware,
    F: Fn(JobContext) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = JobResult> + Send + 'static,
{
    let chain: [Arc<dyn ServerMiddleware>; 1] = [middleware.clone()];
    let handler = FnHandler(handler);
    Next::new(&chain, &handler).run(ctx).await
}

/// A closure as the end of a chain.
struct FnHandler<F>(F);

impl<F> std::fmt::Debug for FnHandler<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FnHandler")
    }
}

impl<F, Fut> Handler for FnHandler<F>
where
    F: Fn(JobContext) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = JobResult> + Send + 'static,
{
    fn call<'a>(&'a self, ctx: &'a JobContext) -> BoxFuture<'a, JobResult> {
        Box::pin((self.0)(ctx.clone()))
    }
}

/// Where a run left the job: what the processor would write (it writes nothing here).
#[derive(Debug, Clone, PartialEq)]
pub enum Fate {
    /// The run succeeded: acknowledged, nothing written.
    Done,
    /// Into the retry set: retry number `count` (0 for the first), at epoch time `at`, which Sidekiq's
    /// jitter picks within `delay` seconds after the failure (`count**4 + 15` plus the jitter, or a
    /// `retry_in` answer plus the jitter).
    Retry {
        /// The new `retry_count`.
        count: i64,
        /// The retry set's score.
        at: f64,
        /// The seconds from the failure the retry may be due in: the jitter's whole range.
        delay: std::ops::RangeInclusive<f64>,
    },
    /// Into the dead set: retries exhausted, `retry: 0`, or a `kill` answer.
    Dead,
    /// Dropped on purpose: `retry: false`, `dead: false`, or a `discard` answer.
    Discarded,
    /// Back into the schedule set, unchanged, to run at `at` (not a failure).
    Rescheduled {
        /// The schedule set's score.
        at: f64,
    },
    /// Pushed back to the end of its queue with a new `enqueued_at`: an iterable job interrupted
    /// between two items.
    Requeued,
    /// A Rails 8.1 Continuable job interrupted at a checkpoint: its next run (the payload
    /// [`Outcome::written`]) is in the schedule set at `at` under a new `jid`.
    Continued {
        /// The schedule-set score.
        at: f64,
        /// The next run's jid.
        jid: String,
    },
    /// No fate of its own: it failed after the shutdown deadline, and the process pushes it back
    /// to its queue as it was.
    PushedBack,
}

impl Fate {
    /// The fate the processor reports to after-fate hooks, when one is written.
    fn written(&self) -> Option<crate::worker::Fate> {
        use crate::worker::Fate as F;
        Some(match self {
            Fate::Done | Fate::PushedBack => return None,
            Fate::Retry { count, at, .. } => F::Retry {
                at: *at,
                count: *count,
            },
            Fate::Dead => F::Dead,
            Fate::Discarded => F::Discarded,
            Fate::Rescheduled { at } => F::Rescheduled { at: *at },
            Fate::Requeued => F::Requeued,
            Fate::Continued { at, jid } => F::Continued {
                at: *at,
                jid: jid.clone(),
            },
        })
    }
}

/// What one run of a job came to: the worker's result and the job's [`Fate`].
#[derive(Debug)]
pub struct Outcome {
    /// What the run returned (through its middleware, for [`TestJob::perform_chain`]).
    pub result: JobResult,
    /// Where Sidekiq's rules put the job.
    pub fate: Fate,
    /// The payload the processor would write: the retry or dead set's member, the requeued job, or
    /// the original bytes for a reschedule.
    written: Option<String>,
}

impl Outcome {
    /// The failure.
    ///
    /// # Panics
    /// When the run succeeded.
    pub fn error(&self) -> &JobError {
        match &self.result {
            Err(e) => e,
            Ok(()) => panic!(
                "expected the job to fail, but it succeeded ({:?})",
                self.fate
            ),
        }
    }

    /// Asserts the job succeeded.
    ///
    /// # Panics
    /// With the failure and its fate, when it did not.
    #[track_caller]
    pub fn assert_done(&self) {
        if let Err(e) = &self.result {
            panic!(
                "expected the job to succeed, but it failed with {e} ({:?})",
                self.fate
            );
        }
    }

    /// Asserts the job failed and goes to the retry set as retry number `count`; returns the
    /// failure.
    ///
    /// # Panics
    /// When it succeeded or has another fate.
    #[track_caller]
    pub fn assert_retry(&self, count: i64) -> &JobError {
        match &self.fate {
            Fate::Retry { count: c, .. } if *c == count => self.error(),
            other => panic!(
                "expected retry number {count}, but the fate is {other:?} ({})",
                self.describe_result()
            ),
        }
    }

    /// Asserts the job goes to the dead set; returns the failure.
    ///
    /// # Panics
    /// When it does not.
    #[track_caller]
    pub fn assert_dead(&self) -> &JobError {
        self.assert_fate(&Fate::Dead);
        self.error()
    }

    /// Asserts the job is dropped without a dead-set entry; returns the failure.
    ///
    /// # Panics
    /// When it is not.
    #[track_caller]
    pub fn assert_discarded(&self) -> &JobError {
        self.assert_fate(&Fate::Discarded);
        self.error()
    }

    /// Asserts the fate is `fate` (for [`Fate::Retry`] and [`Fate::Rescheduled`], whose times vary,
    /// use [`Outcome::assert_retry`] or a `matches!`).
    ///
    /// # Panics
    /// When it is not.
    #[track_caller]
    pub fn assert_fate(&self, fate: &Fate) {
        if &self.fate != fate {
            panic!(
                "expected the fate {fate:?}, but it is {:?} ({})",
                self.fate,
                self.describe_result()
            );
        }
    }

    /// The payload the processor would write (retry or dead set member, requeued job), decoded: its
    /// `error_class`, `error_message`, `retry_count`, `queue`.
    pub fn written(&self) -> Option<serde_json::Map<String, Value>> {
        self.written
            .as_deref()
            .and_then(|p| serde_json::from_str(p).ok())
    }

    /// The payload the processor would write, as text.
    pub fn written_text(&self) -> Option<&str> {
        self.written.as_deref()
    }

    /// The job as the retry would run it: the retry set's member, fetched from its retry queue (a
    /// second run of a [`Fate::Retry`] sees `retry_count`), or the requeued payload of an
    /// interrupted iteration.
    ///
    /// # Panics
    /// When the fate is neither.
    pub fn next_run(&self) -> TestJob {
        match (&self.fate, &self.written) {
            (Fate::Retry { .. } | Fate::Requeued | Fate::Continued { .. }, Some(payload)) => {
                TestJob::payload(payload.clone().into_bytes())
            }
            _ => panic!(
                "the job runs again only after a retry or a requeue; its fate is {:?}",
                self.fate
            ),
        }
    }

    fn describe_result(&self) -> String {
        match &self.result {
            Ok(()) => "the run succeeded".into(),
            Err(e) => format!("the run failed with {e}"),
        }
    }
}

/// Runs `worker` on a job with `args`, as `W.perform_async(*args)` pushes it and the processor
/// runs it (see [`TestJob::perform`]): Oban's `perform_job`, River's `rivertest.Worker.Work`.
///
/// ```
/// use oxidekiq::testing::{self, Fate};
/// use oxidekiq::{JobContext, JobError, JobResult, Worker};
///
/// #[derive(Debug)]
/// struct ChargeJob;
///
/// impl Worker for ChargeJob {
///     const CLASS: &'static str = "ChargeJob";
///     type Args = (u64, f64);
///
///     async fn perform(&self, _ctx: &JobContext, (_id, amount): Self::Args) -> JobResult {
///         if amount <= 0.0 {
///             return Err(JobError::new("ArgumentError", "amount must be positive").kill());
///         }
///         Ok(())
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// testing::perform(&ChargeJob, (1, 9.99)).await.assert_done();
/// assert_eq!(testing::perform(&ChargeJob, (1, -1.0)).await.fate, Fate::Dead);
/// // What Ruby could send and the Args type refuses fails as in production.
/// let wrong = testing::perform(&ChargeJob, ("1", "9.99")).await;
/// assert_eq!(wrong.assert_retry(0).class, "ArgumentError");
/// # }
/// ```
pub async fn perform<W: Worker>(worker: &W, args: impl Serialize) -> Outcome {
    TestJob::of::<W>(args).perform(worker).await
}

/// Runs `worker` on a payload as Rails or Sidekiq wrote it (a plain job or an ActiveJob one); see
/// [`TestJob::perform`].
pub async fn perform_payload<W: Worker>(worker: &W, payload: impl Into<Vec<u8>>) -> Outcome {
    TestJob::payload(payload).perform(worker).await
}

/// A job the [`FakeClient`] recorded.
#[derive(Debug, Clone, PartialEq)]
pub struct Enqueued {
    /// The class its worker is registered under (`wrapped` for an ActiveJob job).
    pub class: String,
    /// Its arguments (for an ActiveJob job, ActiveJob's `arguments`, as the worker receives them).
    pub args: Value,
    /// The queue it was pushed to.
    pub queue: String,
    /// Its jid.
    pub jid: String,
    /// When it runs (epoch seconds) when it was scheduled; `None` when pushed to its queue.
    pub at: Option<f64>,
    /// Its `created_at` (epoch seconds).
    pub created_at: f64,
    /// The payload, byte for byte as the real client writes it.
    pub payload: String,
}

impl Enqueued {
    fn of(r: &Recorded) -> Enqueued {
        let job = Job::from_str(&r.payload).ok();
        let (class, args) = match &job {
            Some(j) => {
                let args = match crate::processor::activejob_of(j) {
                    Ok(Some(aj)) => aj.arguments().clone(),
                    _ => serde_json::from_str(j.args_json()).unwrap_or(Value::Null),
                };
                (j.worker_class().to_string(), args)
            }
            None => (String::new(), Value::Null),
        };
        let created_at = job
            .as_ref()
            .and_then(|j| j.to_map().ok())
            .and_then(|m| m.get("created_at").and_then(crate::job::timestamp_seconds))
            .unwrap_or(0.0);
        Enqueued {
            class,
            args,
            queue: r.queue.clone(),
            jid: job
                .as_ref()
                .map(|j| j.jid().to_string())
                .unwrap_or_default(),
            at: r.at,
            created_at,
            payload: r.payload.clone(),
        }
    }

    /// The job as a test runs it, fetched from the queue it was pushed to.
    pub fn job(&self) -> TestJob {
        TestJob::payload(self.payload.clone().into_bytes()).queue(self.queue.clone())
    }

    /// One line for a failed assertion's list.
    fn line(&self) -> String {
        let when = match self.at {
            Some(at) => format!("at {at:.3} (in {:.1} s)", at - self.created_at),
            None => "now".to_string(),
        };
        format!(
            "{} {} on {:?}, {when} (jid {})",
            self.class, self.args, self.queue, self.jid
        )
    }
}

/// What a pushed job is expected to be: its class, and optionally its arguments, queue and time
/// (in the spirit of Oban's `assert_enqueued worker: ..., args: ...`).
///
/// ```
/// use oxidekiq::testing::Expected;
///
/// let expected = Expected::new("HardWorker").args(("bob", 5)).queue("critical").in_secs(60.0);
/// assert_eq!(expected.to_string(), r#"a HardWorker job with args ["bob",5] on "critical" in 60 s"#);
/// ```
#[derive(Debug, Clone)]
pub struct Expected {
    /// The class.
    class: String,
    /// The arguments, when checked.
    args: Option<Value>,
    /// The queue, when checked.
    queue: Option<String>,
    /// The time, when checked.
    when: Option<When>,
}

/// When an [`Expected`] job runs.
#[derive(Debug, Clone, Copy)]
enum When {
    /// Pushed to its queue.
    Now,
    /// Scheduled at this epoch time (within [`TIME_SLACK`]).
    At(f64),
    /// Scheduled this many seconds after its `created_at` (within [`TIME_SLACK`]).
    In(f64),
}

/// How far a scheduled time may be from the expected one: the push reads the clock after the test.
const TIME_SLACK: f64 = 1.0;

impl Expected {
    /// A job of `class` (for ActiveJob, the job's class, not the wrapper).
    pub fn new(class: impl Into<String>) -> Expected {
        Expected {
            class: class.into(),
            args: None,
            queue: None,
            when: None,
        }
    }

    /// With these arguments (anything serializing to its `args` array, as [`NewJob::new`] takes).
    pub fn args(mut self, args: impl Serialize) -> Expected {
        self.args = Some(NewJob::new("", args).args().clone());
        self
    }

    /// On this queue.
    pub fn queue(mut self, queue: impl Into<String>) -> Expected {
        self.queue = Some(queue.into());
        self
    }

    /// Pushed to its queue, not scheduled.
    pub fn now(mut self) -> Expected {
        self.when = Some(When::Now);
        self
    }

    /// Scheduled at the epoch time `at` (within a second).
    pub fn at(mut self, at: f64) -> Expected {
        self.when = Some(When::At(at));
        self
    }

    /// Scheduled `secs` seconds after it was pushed (within a second), as `perform_in(secs, ..)`.
    pub fn in_secs(mut self, secs: f64) -> Expected {
        self.when = Some(When::In(secs));
        self
    }

    /// True when `job` is one.
    pub fn matches(&self, job: &Enqueued) -> bool {
        job.class == self.class
            && self.args.as_ref().is_none_or(|a| *a == job.args)
            && self.queue.as_ref().is_none_or(|q| *q == job.queue)
            && match self.when {
                None => true,
                Some(When::Now) => job.at.is_none(),
                Some(When::At(at)) => job.at.is_some_and(|t| (t - at).abs() <= TIME_SLACK),
                Some(When::In(secs)) => job
                    .at
                    .is_some_and(|t| (t - job.created_at - secs).abs() <= TIME_SLACK),
            }
    }
}

impl std::fmt::Display for Expected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a {} job", self.class)?;
        if let Some(a) = &self.args {
            write!(f, " with args {a}")?;
        }
        if let Some(q) = &self.queue {
            write!(f, " on {q:?}")?;
        }
        match self.when {
            None => Ok(()),
            Some(When::Now) => write!(f, " pushed now"),
            Some(When::At(at)) => write!(f, " at {at:.3}"),
            Some(When::In(secs)) => write!(f, " in {secs} s"),
        }
    }
}

/// Asserts one of `jobs` (held by `holder`) matches `expected`, listing them all when none does.
#[track_caller]
fn assert_in(jobs: Vec<Enqueued>, expected: &Expected, holder: &str) -> Enqueued {
    if let Some(j) = jobs.iter().find(|j| expected.matches(j)) {
        return j.clone();
    }
    panic!("expected {expected}, but {}", listing(&jobs, holder));
}

/// Asserts none of `jobs` matches `expected`.
#[track_caller]
fn refute_in(jobs: Vec<Enqueued>, expected: &Expected, holder: &str) {
    let found: Vec<Enqueued> = jobs.into_iter().filter(|j| expected.matches(j)).collect();
    if !found.is_empty() {
        panic!(
            "expected no {}, but {}",
            expected.to_string().trim_start_matches("a "),
            listing(&found, holder)
        );
    }
}

fn listing(jobs: &[Enqueued], holder: &str) -> String {
    if jobs.is_empty() {
        return format!("{holder} holds no job");
    }
    let lines: Vec<String> = jobs.iter().map(|j| format!("\n  {}", j.line())).collect();
    format!("{holder} holds {} job(s):{}", jobs.len(), lines.concat())
}

/// A [`Client`] that records its pushes instead of sending them: Sidekiq's `Sidekiq::Testing.fake!`.
/// Hand [`FakeClient::client`] to the code under test; every push passes the client's middleware and
/// builds the payload the real client would write. Nothing needs Redis, and nothing that needs it
/// works ([`Client::cancel`] fails saying so); an until-executed push takes no lock.
///
/// ```
/// use oxidekiq::NewJob;
/// use oxidekiq::testing::{Expected, FakeClient};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> oxidekiq::Result<()> {
/// let fake = FakeClient::new();
/// let client = fake.client();
/// client.perform_async("HardWorker", ("bob", 5)).await?;
/// client.push(NewJob::new("ReportJob", (7,)).queue("low").run_in(300.0)).await?;
///
/// assert_eq!(fake.jobs("HardWorker").len(), 1);
/// fake.assert_enqueued(&Expected::new("HardWorker").args(("bob", 5)).queue("default").now());
/// fake.assert_enqueued(&Expected::new("ReportJob").queue("low").in_secs(300.0));
/// fake.refute_enqueued(&Expected::new("HardWorker").args(("eve", 1)));
/// fake.clear();
/// assert!(fake.all_jobs().is_empty());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default)]
pub struct FakeClient {
    /// The recorded pushes, shared with every client this hands out.
    recorder: Recorder,
}

impl FakeClient {
    /// A fake with nothing recorded.
    pub fn new() -> FakeClient {
        FakeClient::default()
    }

    /// A client whose pushes land here (clones of it, and other calls, share the same record).
    pub fn client(&self) -> Client {
        Client::recording(self.recorder.clone())
    }

    fn recorded(&self) -> Vec<Recorded> {
        self.recorder
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Every recorded job, in push order.
    pub fn all_jobs(&self) -> Vec<Enqueued> {
        self.recorded().iter().map(Enqueued::of).collect()
    }

    /// The recorded jobs of `class` (`HardWorker.jobs` in Ruby), in push order.
    pub fn jobs(&self, class: &str) -> Vec<Enqueued> {
        self.all_jobs()
            .into_iter()
            .filter(|j| j.class == class)
            .collect()
    }

    /// Forgets every recorded job (`Sidekiq::Worker.clear_all`).
    pub fn clear(&self) {
        self.recorder
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// Asserts a recorded job matches `expected`, and returns it.
    ///
    /// # Panics
    /// When none does, listing what was recorded.
    #[track_caller]
    pub fn assert_enqueued(&self, expected: &Expected) -> Enqueued {
        assert_in(self.all_jobs(), expected, "the fake client")
    }

    /// Asserts no recorded job matches `expected`.
    ///
    /// # Panics
    /// When one does, listing the ones that do.
    #[track_caller]
    pub fn refute_enqueued(&self, expected: &Expected) {
        refute_in(self.all_jobs(), expected, "the fake client");
    }

    /// Runs the oldest recorded job with the worker `registry` holds for its class, and removes it
    /// (`HardWorker.perform_one`); `None` when nothing is recorded.
    pub async fn perform_one(&self, registry: &Registry) -> Option<Outcome> {
        let next = {
            let mut jobs = self.recorder.lock().unwrap_or_else(|p| p.into_inner());
            (!jobs.is_empty()).then(|| jobs.remove(0))
        }?;
        let job = TestJob::payload(next.payload.into_bytes()).queue(next.queue);
        Some(job.run_entry(registry, false).await)
    }

    /// Runs recorded jobs, oldest first, until none is left, jobs they push included (`drain` in
    /// Ruby): each with its worker from `registry`, without middleware, as Sidekiq's fake mode runs
    /// them. Returns each run's outcome, in order; a failure does not stop the drain.
    ///
    /// # Panics
    /// After 100 000 jobs: a job that pushes itself again never drains.
    pub async fn drain(&self, registry: &Registry) -> Vec<Outcome> {
        let mut outcomes = Vec::new();
        while let Some(outcome) = self.perform_one(registry).await {
            outcomes.push(outcome);
            assert!(
                outcomes.len() < MAX_DRAINED,
                "FakeClient::drain ran {MAX_DRAINED} jobs and more keep coming: a job pushes itself again"
            );
        }
        outcomes
    }
}

/// A `redis-server` of the test's own on a free port of 127.0.0.1 (never 6379), without
/// persistence, stopped when dropped: for the middleware that keep their locks and limits in Redis,
/// iterable jobs' state, and integration tests of producers with a real [`Client`].
#[derive(Debug)]
pub struct TestRedis {
    /// The server.
    child: Child,
    /// Its port.
    port: u16,
    /// Its working directory, removed when dropped.
    dir: PathBuf,
}

impl TestRedis {
    /// Starts `redis-server` (or `valkey-server` when there is no `redis-server`) and waits until it
    /// answers.
    ///
    /// # Panics
    /// When neither is installed, or the server does not answer within 10 s.
    pub fn start() -> TestRedis {
        let mut last = String::new();
        for _attempt in 0..5 {
            let port = free_port();
            let dir = std::env::temp_dir()
                .join(format!("oxidekiq-testing-{port}-{}", std::process::id()));
            if let Err(e) = std::fs::create_dir_all(&dir) {
                panic!("TestRedis: cannot create {}: {e}", dir.display());
            }
            let child = ["redis-server", "valkey-server"].iter().find_map(|bin| {
                Command::new(bin)
                    .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                    .args(["--save", "", "--appendonly", "no"])
                    .arg("--dir")
                    .arg(&dir)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .ok()
            });
            let Some(child) = child else {
                let _ = std::fs::remove_dir_all(&dir);
                panic!(
                    "TestRedis needs redis-server (or valkey-server) on PATH: install Redis \
                     (apt-get install redis-server, brew install redis) to run this test"
                );
            };
            let mut server = TestRedis { child, port, dir };
            match server.wait_ready() {
                Ok(()) => return server,
                Err(e) => last = e,
            }
        }
        panic!("TestRedis: redis-server did not start: {last}");
    }

    /// Waits until the server answers `PING` (false when it exited).
    fn wait_ready(&mut self) -> Result<(), String> {
        use std::io::{Read, Write};
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("it exited with {status} (its port taken?)"));
            }
            if let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) {
                let mut reply = [0u8; 5];
                if s.write_all(b"PING\r\n").is_ok()
                    && s.read_exact(&mut reply).is_ok()
                    && &reply == b"+PONG"
                {
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err("it did not answer PING within 10 s".into())
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A new connection to it, as the runtime holds one (reconnecting, shared by its clones); it
    /// connects at its first command.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub fn conn(&self) -> Conn {
        let client = redis::Client::open(self.url()).unwrap_or_else(|e| panic!("TestRedis: {e}"));
        // The runtime's own timeouts: a loaded test machine is not an outage.
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(5)))
            .set_response_timeout(Some(Duration::from_secs(5)));
        let manager = redis::aio::ConnectionManager::new_lazy_with_config(client, config)
            .unwrap_or_else(|e| panic!("TestRedis: {e}"));
        Conn::from(manager)
    }

    /// A real [`Client`] pushing to it.
    pub fn client(&self) -> Client {
        Client::new(self.conn())
    }

    /// Every job waiting in a queue (`queue:<name>`, oldest first) or in the schedule set.
    ///
    /// # Panics
    /// When Redis does not answer.
    pub async fn enqueued(&self) -> Vec<Enqueued> {
        let mut conn = self.conn();
        let queues: Vec<String> = redis::cmd("SMEMBERS")
            .arg(crate::keys::QUEUES)
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("TestRedis: SMEMBERS queues: {e}"));
        let mut out = Vec::new();
        for queue in queues {
            let payloads: Vec<String> = redis::cmd("LRANGE")
                .arg(crate::keys::queue(&queue))
                .arg(0)
                .arg(-1)
                .query_async(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("TestRedis: LRANGE queue:{queue}: {e}"));
            // LPUSH puts the newest first.
            for payload in payloads.into_iter().rev() {
                out.push(Enqueued::of(&Recorded {
                    queue: queue.clone(),
                    payload,
                    at: None,
                }));
            }
        }
        let scheduled: Vec<(String, f64)> = redis::cmd("ZRANGE")
            .arg(crate::keys::SCHEDULE)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("TestRedis: ZRANGE schedule: {e}"));
        for (payload, at) in scheduled {
            let queue = Job::from_str(&payload)
                .ok()
                .and_then(|j| j.queue().map(str::to_string))
                .unwrap_or_default();
            out.push(Enqueued::of(&Recorded {
                queue,
                payload,
                at: Some(at),
            }));
        }
        out
    }

    /// Asserts a job waiting in a queue or the schedule set matches `expected`, and returns it.
    ///
    /// # Panics
    /// When none does, listing what Redis holds.
    pub async fn assert_enqueued(&self, expected: &Expected) -> Enqueued {
        let jobs = self.enqueued().await;
        assert_in(jobs, expected, "Redis")
    }

    /// Asserts no job waiting in a queue or the schedule set matches `expected`.
    ///
    /// # Panics
    /// When one does.
    pub async fn refute_enqueued(&self, expected: &Expected) {
        let jobs = self.enqueued().await;
        refute_in(jobs, expected, "Redis");
    }
}

impl Drop for TestRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A free TCP port on 127.0.0.1 other than 6379.
fn free_port() -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or_else(|e| panic!("TestRedis: no free port on 127.0.0.1: {e}"));
        if port != 6379 {
            return port;
        }
    }
}

/// An iterable job under test: run to completion, or stop after some items and resume, on a
/// [`TestRedis`] (the iteration's state, `it-<jid>`, is Sidekiq 8's hash there).
///
/// ```
/// use oxidekiq::iterable::{Enumerator, IterableWorker};
/// use oxidekiq::testing::{Fate, Iteration, TestJob, TestRedis};
/// use oxidekiq::{JobContext, JobResult, NewJob};
///
/// #[derive(Debug)]
/// struct WalkJob;
///
/// impl IterableWorker for WalkJob {
///     const CLASS: &'static str = "WalkJob";
///     type Args = (usize,);
///     type Item = usize;
///     type Cursor = usize;
///
///     fn build_enumerator<'a>(
///         &'a self,
///         _ctx: &'a JobContext,
///         (n,): &'a Self::Args,
///         cursor: Option<usize>,
///     ) -> Result<Enumerator<'a, usize, usize>, oxidekiq::JobError> {
///         Ok(Enumerator::array((0..*n).collect(), cursor))
///     }
///
///     async fn each_iteration(&self, _ctx: &JobContext, _item: usize, _args: &Self::Args) -> JobResult {
///         Ok(())
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let redis = TestRedis::start();
/// let walk = Iteration::new(WalkJob, &redis);
/// let job = TestJob::new(NewJob::new("WalkJob", (5,)));
/// let first = walk.run_until(&job, 2).await; // interrupted after items 0 and 1
/// assert_eq!(first.fate, Fate::Requeued);
/// assert_eq!(walk.cursor(&job).await.as_deref(), Some("2"));
/// walk.run(&first.next_run()).await.assert_done(); // resumes at item 2
/// assert_eq!(walk.items_run(), vec![0, 1, 2, 3, 4]);
/// # }
/// ```
#[derive(Debug)]
pub struct Iteration<W> {
    /// The worker, shared with the wrapper each run registers.
    worker: Arc<W>,
    /// Where the iteration keeps its state.
    conn: Conn,
    /// The cursor of every item run so far, as JSON, in order, across runs.
    seen: Arc<std::sync::Mutex<Vec<String>>>,
}

impl<W: IterableWorker> Iteration<W> {
    /// `worker`'s jobs, with their state in `redis`.
    pub fn new(worker: W, redis: &TestRedis) -> Iteration<W> {
        Iteration {
            worker: Arc::new(worker),
            conn: redis.conn(),
            seen: Arc::default(),
        }
    }

    /// Runs `job` (a start or a resume) until its items are exhausted, it is cancelled, or it fails.
    pub async fn run(&self, job: &TestJob) -> Outcome {
        self.run_with(job, None).await
    }

    /// Runs `job` and has the process go quiet once `items` items have run: the job stops before
    /// the next one, flushes its cursor (the next item's) and is requeued ([`Fate::Requeued`];
    /// [`Outcome::next_run`] is its resume). Runs to its end if it has no more items.
    pub async fn run_until(&self, job: &TestJob, items: usize) -> Outcome {
        self.run_with(job, Some(items)).await
    }

    /// The cursor flushed for `job` (the JSON of `c` in `it-<jid>`), `None` once the iteration
    /// completed (the hash is removed) or before its first flush.
    ///
    /// # Panics
    /// When Redis does not answer.
    pub async fn cursor(&self, job: &TestJob) -> Option<String> {
        let key = crate::iterable::state_key(job.decoded().jid());
        redis::cmd("HGET")
            .arg(&key)
            .arg("c")
            .query_async(&mut self.conn.clone())
            .await
            .unwrap_or_else(|e| panic!("Iteration::cursor: HGET {key} c: {e}"))
    }

    /// The cursor of every item run so far, read back as `W::Cursor`, in order, across runs.
    pub fn items_run(&self) -> Vec<W::Cursor> {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.iter()
            .filter_map(|c| serde_json::from_str(c).ok())
            .collect()
    }

    async fn run_with(&self, job: &TestJob, items: Option<usize>) -> Outcome {
        let shutdown = TestShutdown::new();
        if items == Some(0) {
            shutdown.quiet();
        }
        let stopper = Stopper {
            worker: self.worker.clone(),
            left: AtomicUsize::new(items.unwrap_or(usize::MAX)),
            stop: items.is_some(),
            shutdown: shutdown.clone(),
            seen: self.seen.clone(),
        };
        job.clone()
            .conn(self.conn.clone())
            .shutdown(&shutdown)
            .perform(&Iterable::new(stopper))
            .await
    }
}

/// An iterable worker that notes each item's cursor and quiets the test's shutdown after a number
/// of items: the worker under test, otherwise untouched.
#[derive(Debug)]
struct Stopper<W> {
    /// The worker under test.
    worker: Arc<W>,
    /// Items still to run before going quiet.
    left: AtomicUsize,
    /// Whether to go quiet at all.
    stop: bool,
    /// The run's shutdown, made quiet after the last item.
    shutdown: TestShutdown,
    /// The [`Iteration`]'s record of the cursors run.
    seen: Arc<std::sync::Mutex<Vec<String>>>,
}

impl<W: IterableWorker> IterableWorker for Stopper<W> {
    const CLASS: &'static str = W::CLASS;
    type Args = W::Args;
    type Item = (W::Item, String);
    type Cursor = W::Cursor;

    fn options(&self) -> WorkerOptions {
        self.worker.options()
    }

    fn max_iteration_runtime(&self) -> Option<Duration> {
        self.worker.max_iteration_runtime()
    }

    fn build_enumerator<'a>(
        &'a self,
        ctx: &'a JobContext,
        args: &'a Self::Args,
        cursor: Option<Self::Cursor>,
    ) -> Result<Enumerator<'a, Self::Item, Self::Cursor>, JobError> {
        // Behind a lock only to be moved into each step's future; one step runs at a time.
        let inner = Arc::new(tokio::sync::Mutex::new(
            self.worker.build_enumerator(ctx, args, cursor)?,
        ));
        Ok(Enumerator::from_fn(move || {
            let inner = inner.clone();
            Box::pin(async move {
                let next = inner.lock().await.next().await?;
                Ok(next.map(|(item, cursor)| {
                    let json = serde_json::to_string(&cursor).unwrap_or_default();
                    ((item, json), cursor)
                }))
            })
        }))
    }

    async fn each_iteration(
        &self,
        ctx: &JobContext,
        (item, cursor): Self::Item,
        args: &Self::Args,
    ) -> JobResult {
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(cursor);
        let result = self.worker.each_iteration(ctx, item, args).await;
        if self.stop && self.left.fetch_sub(1, Ordering::SeqCst) <= 1 {
            self.shutdown.quiet();
        }
        result
    }

    async fn on_start(&self, ctx: &JobContext) -> JobResult {
        self.worker.on_start(ctx).await
    }

    async fn on_resume(&self, ctx: &JobContext) -> JobResult {
        self.worker.on_resume(ctx).await
    }

    async fn on_cancel(&self, ctx: &JobContext) -> JobResult {
        self.worker.on_cancel(ctx).await
    }

    async fn on_stop(&self, ctx: &JobContext) -> JobResult {
        self.worker.on_stop(ctx).await
    }

    async fn on_complete(&self, ctx: &JobContext) -> JobResult {
        self.worker.on_complete(ctx).await
    }
}

/// Runs a Rails 8.1 Continuable worker ([`ContinuableWorker`](crate::continuable::ContinuableWorker))
/// on test jobs, and has the process go quiet at a chosen checkpoint: the job is interrupted there
/// ([`Fate::Continued`]) and [`Outcome::next_run`] is the job Rails would resume.
///
/// ```
/// use oxidekiq::continuable::{ContinuableWorker, Step, StepDef};
/// use oxidekiq::testing::{Fate, Steps, TestJob};
/// use oxidekiq::{JobContext, JobResult, NewJob};
///
/// #[derive(Debug)]
/// struct CountJob;
///
/// impl ContinuableWorker for CountJob {
///     const CLASS: &'static str = "CountJob";
///     type Args = (u64,);
///     const STEPS: &'static [StepDef] = &[StepDef::new("count")];
///
///     async fn step(&self, _ctx: &JobContext, (n,): &(u64,), step: &mut Step) -> JobResult {
///         let from: u64 = step.cursor()?.unwrap_or(0);
///         for i in from..*n {
///             step.set(i + 1)?; // record `i` done: a checkpoint
///         }
///         Ok(())
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let steps = Steps::new(CountJob);
/// let job = TestJob::new(NewJob::activejob("CountJob", "default", vec![5.into()]));
/// let first = steps.run_until(&job, 2).await; // quiet at the second checkpoint: cursor 2
/// assert!(matches!(first.fate, Fate::Continued { .. }));
/// let next = first.written().unwrap();
/// assert_eq!(next["args"][0]["continuation"], serde_json::json!({"completed": [], "current": ["count", 2]}));
/// steps.run(&first.next_run()).await.assert_done();
/// # }
/// ```
#[derive(Debug)]
pub struct Steps<W> {
    /// The worker, shared with the wrapper each run registers.
    worker: Arc<W>,
}

impl<W: crate::continuable::ContinuableWorker> Steps<W> {
    /// `worker`'s jobs.
    pub fn new(worker: W) -> Steps<W> {
        Steps {
            worker: Arc::new(worker),
        }
    }

    /// Runs `job` (a first run or a resume) to its end, or until it fails.
    pub async fn run(&self, job: &TestJob) -> Outcome {
        self.run_with(job, None).await
    }

    /// Runs `job` and has the process go quiet at its `checkpoint`-th checkpoint (1 for the first;
    /// both the boundaries between steps and each cursor update count): the job is interrupted there.
    pub async fn run_until(&self, job: &TestJob, checkpoint: usize) -> Outcome {
        self.run_with(job, Some(checkpoint)).await
    }

    async fn run_with(&self, job: &TestJob, checkpoint: Option<usize>) -> Outcome {
        let shutdown = TestShutdown::new();
        if checkpoint == Some(0) {
            shutdown.quiet();
        }
        let left = Arc::new(AtomicUsize::new(checkpoint.unwrap_or(usize::MAX)));
        let quiet = shutdown.clone();
        let hook: crate::continuable::CheckpointHook = Arc::new(move |_step: Option<&str>| {
            if checkpoint.is_some() && left.fetch_sub(1, Ordering::SeqCst) == 1 {
                quiet.quiet();
            }
        });
        let worker = crate::continuable::Continuable::with_hook(self.worker.clone(), hook);
        job.clone().shutdown(&shutdown).perform(&worker).await
    }
}
