//! Continuable workers: Rails 8.1's `ActiveJob::Continuable` jobs in Rust ([`ContinuableWorker`],
//! registered as [`Continuable`]).
//!
//! Layer: job chain (after `iterable`; it uses `worker`, `error` and the ActiveJob decoder only).
//!
//! The job runs the Ruby class's steps, in its order and under its names ([`ContinuableWorker::STEPS`]),
//! skipping those its `continuation` lists as completed and handing the current one its cursor. A
//! checkpoint (before each step once the job advanced in this run, and each [`Step::set`],
//! [`Step::advance`], [`Step::checkpoint`]) sees the process quieting or stopping as Rails'
//! `queue_adapter.stopping?` does; the job is then interrupted: the `job_data` Rails 8.1 writes at an
//! interrupt ([`Continuation::resumed_job_data`]) goes to the `schedule` set as a new Sidekiq job (new
//! jid, `provider_job_id` the jid that ran) in the same script that ends the running job's stay
//! ([`RetryAction::Continue`](crate::RetryAction::Continue)), so a crash leaves it in one place or the
//! other. The run counts as a success, as Rails acks it. docs/continuations.md.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::activejob::{Continuation, InterruptReason};
use crate::error::{JobError, JobResult, RetryAction};
use crate::worker::{JobContext, ShutdownSignal, Worker, WorkerOptions};

/// `error_class` of an interrupt (Rails' `ActiveJob::Continuation::Interrupt`).
pub const INTERRUPT: &str = "ActiveJob::Continuation::Interrupt";
/// `error_class` of a payload whose progress does not fit the worker's steps.
pub const INVALID_STEP: &str = "ActiveJob::Continuation::InvalidStepError";
/// `error_class` of an interrupt past [`ContinuationOptions::max_resumptions`].
pub const RESUME_LIMIT: &str = "ActiveJob::Continuation::ResumeLimitError";
/// `error_class` of [`Step::advance`] on a cursor that is not an integer.
pub const UNADVANCEABLE: &str = "ActiveJob::Continuation::UnadvanceableCursorError";

/// One step of a Continuable job: its name (the Ruby `step :name`'s) and whether it is `isolated:`
/// (run in a job run of its own: a job that advanced in this run is interrupted before it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepDef {
    /// The step's name, as the Ruby job names it.
    pub name: &'static str,
    /// `isolated: true`.
    pub isolated: bool,
}

impl StepDef {
    /// A step named `name`.
    pub const fn new(name: &'static str) -> StepDef {
        StepDef {
            name,
            isolated: false,
        }
    }

    /// The same step, `isolated: true`.
    pub const fn isolated(mut self) -> StepDef {
        self.isolated = true;
        self
    }
}

/// The class settings Rails keeps in Ruby (`class_attribute`s of `ActiveJob::Continuable`), here
/// options of the Rust worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContinuationOptions {
    /// `max_resumptions` (default none): an interrupt of a job resumed this many times fails with
    /// `ResumeLimitError` instead (the Sidekiq retry of the run, as Ruby raises).
    pub max_resumptions: Option<u64>,
    /// `resume_options[:wait]` (default 5 s): how far ahead the next run is scheduled.
    pub resume_wait: Duration,
    /// `resume_errors_after_advancing` (default true): an error after the job advanced in this run
    /// resumes it as an interrupt does, instead of failing.
    pub resume_errors_after_advancing: bool,
}

impl Default for ContinuationOptions {
    fn default() -> Self {
        ContinuationOptions {
            max_resumptions: None,
            resume_wait: Duration::from_secs(5),
            resume_errors_after_advancing: true,
        }
    }
}

/// A Rails 8.1 `ActiveJob::Continuable` job in Rust: the Ruby class's steps, run by
/// [`ContinuableWorker::step`] one at a time.
pub trait ContinuableWorker: Send + Sync + 'static {
    /// The ActiveJob class (`wrapped`).
    const CLASS: &'static str;
    /// The decoded ActiveJob arguments.
    type Args: DeserializeOwned + Send + Sync + 'static;
    /// The steps, in the Ruby job's order, under its names.
    const STEPS: &'static [StepDef];

    /// Per-worker Sidekiq options.
    fn options(&self) -> WorkerOptions {
        WorkerOptions::default()
    }

    /// `max_resumptions`, `resume_options`, `resume_errors_after_advancing`.
    fn continuation_options(&self) -> ContinuationOptions {
        ContinuationOptions::default()
    }

    /// Runs the step `step.name()` from `step.cursor()`. Return the error of a checkpoint
    /// ([`Step::set`], [`Step::advance`], [`Step::checkpoint`]) with `?`: the job is interrupted there.
    fn step(
        &self,
        ctx: &JobContext,
        args: &Self::Args,
        step: &mut Step,
    ) -> impl Future<Output = JobResult> + Send;
}

/// Called at every checkpoint before the shutdown check, with the step (`None`: between steps):
/// what the testing helpers use to quiet a run at a chosen checkpoint.
pub(crate) type CheckpointHook = Arc<dyn Fn(Option<&str>) + Send + Sync>;

/// The step a [`ContinuableWorker::step`] runs: its name, its cursor, and its checkpoints.
pub struct Step {
    name: &'static str,
    cursor: Value,
    initial: Value,
    resumed: bool,
    shutdown: ShutdownSignal,
    hook: Option<CheckpointHook>,
    interrupted: Option<InterruptReason>,
}

impl std::fmt::Debug for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Step")
            .field("name", &self.name)
            .field("cursor", &self.cursor)
            .field("resumed", &self.resumed)
            .finish()
    }
}

impl Step {
    /// The step's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The cursor (`None` until set: a fresh step, or one interrupted before its first set).
    pub fn cursor<T: DeserializeOwned>(&self) -> Result<Option<T>, JobError> {
        if self.cursor.is_null() {
            return Ok(None);
        }
        T::deserialize(&self.cursor).map(Some).map_err(|e| {
            JobError::new(
                "ArgumentError",
                format!(
                    "the cursor of step '{}' ({}) does not read as the worker's cursor: {e}",
                    self.name, self.cursor
                ),
            )
        })
    }

    /// True when this run resumed the step at a recorded cursor (`resumed?`).
    pub fn is_resumed(&self) -> bool {
        self.resumed
    }

    /// `step.set!(cursor)`: records the cursor, then a checkpoint.
    pub fn set<T: Serialize>(&mut self, cursor: T) -> JobResult {
        self.cursor = serde_json::to_value(cursor).map_err(|e| {
            JobError::new("TypeError", format!("the cursor does not serialize: {e}"))
        })?;
        self.checkpoint()
    }

    /// `step.advance!`: the integer cursor plus one (from 0 when unset is an error, as Ruby's
    /// `nil.succ`), then a checkpoint.
    pub fn advance(&mut self) -> JobResult {
        let next = match &self.cursor {
            Value::Number(n) => n
                .as_i64()
                .and_then(|i| i.checked_add(1))
                .map(Value::from)
                .or_else(|| n.as_u64().and_then(|u| u.checked_add(1)).map(Value::from)),
            _ => None,
        };
        let Some(next) = next else {
            let class = match &self.cursor {
                Value::Null => "NilClass",
                Value::Number(_) => "Float",
                Value::String(_) => "String",
                Value::Bool(_) => "TrueClass",
                Value::Array(_) => "Array",
                Value::Object(_) => "Hash",
            };
            return Err(JobError::new(
                UNADVANCEABLE,
                format!("Cursor class '{class}' does not implement 'succ'"),
            ));
        };
        self.cursor = next;
        self.checkpoint()
    }

    /// `step.checkpoint!`: interrupted (an error to return with `?`) when the process is quieting
    /// or stopping.
    pub fn checkpoint(&mut self) -> JobResult {
        if let Some(hook) = &self.hook {
            hook(Some(self.name));
        }
        if self.shutdown.is_quiet() {
            self.interrupted = Some(InterruptReason::Stopping);
            let c = Continuation {
                completed: Vec::new(),
                current: Some((self.name.to_owned(), self.cursor.clone())),
            };
            return Err(JobError::new(
                INTERRUPT,
                format!("Interrupted {} (stopping)", c.description()),
            ));
        }
        Ok(())
    }
}

/// Registers a [`ContinuableWorker`] as a [`Worker`].
pub struct Continuable<W> {
    worker: Arc<W>,
    hook: Option<CheckpointHook>,
}

impl<W> std::fmt::Debug for Continuable<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Continuable")
    }
}

impl<W: ContinuableWorker> Continuable<W> {
    /// Wraps `worker`.
    pub fn new(worker: W) -> Self {
        Continuable {
            worker: Arc::new(worker),
            hook: None,
        }
    }

    /// The same wrapper over a shared worker, calling `hook` at each checkpoint.
    #[cfg(feature = "testing")]
    pub(crate) fn with_hook(worker: Arc<W>, hook: CheckpointHook) -> Self {
        Continuable {
            worker,
            hook: Some(hook),
        }
    }
}

impl<W: ContinuableWorker> Worker for Continuable<W> {
    const CLASS: &'static str = W::CLASS;
    type Args = W::Args;

    fn options(&self) -> WorkerOptions {
        self.worker.options()
    }

    async fn perform(&self, ctx: &JobContext, args: Self::Args) -> JobResult {
        run(self.worker.as_ref(), self.hook.as_ref(), ctx, &args).await
    }
}

/// `Continuation::Validation`: the completed steps are the first of the worker's, in its order, and
/// the current step (if any) is the next one.
fn validate(c: &Continuation, steps: &[StepDef]) -> Result<(), JobError> {
    let invalid = |m: String| JobError::new(INVALID_STEP, m);
    let mut names = steps.iter().map(|s| s.name);
    let mut seen = std::collections::HashSet::new();
    for s in steps {
        if !seen.insert(s.name) {
            return Err(invalid(format!(
                "Step '{}' has already been encountered",
                s.name
            )));
        }
    }
    for done in &c.completed {
        match names.next() {
            Some(name) if name == done => {}
            Some(name) => {
                return Err(invalid(format!(
                    "Step '{name}' found, expected to see '{done}'"
                )));
            }
            // Rails runs out of steps and ends: nothing to check.
            None => return Ok(()),
        }
    }
    if let Some((current, _)) = &c.current {
        match names.next() {
            Some(name) if name == current => {}
            Some(name) => {
                return Err(invalid(format!(
                    "Step '{name}' found, expected to resume from '{current}'"
                )));
            }
            None => {}
        }
    }
    Ok(())
}

/// One run: `Continuable#continue` around the steps.
async fn run<W: ContinuableWorker>(
    w: &W,
    hook: Option<&CheckpointHook>,
    ctx: &JobContext,
    args: &W::Args,
) -> JobResult {
    let Some(info) = ctx.activejob() else {
        return Err(JobError::new(
            "ArgumentError",
            format!(
                "{} is a Continuable worker: the job must be an ActiveJob payload",
                W::CLASS
            ),
        ));
    };
    let mut c = match info.continuation() {
        None => Continuation::default(),
        Some(Ok(c)) => c,
        Some(Err(e)) => return Err(JobError::new(INVALID_STEP, e)),
    };
    validate(&c, W::STEPS)?;
    let opts = w.continuation_options();
    // `self.resumptions += 1 if continuation.started?`.
    let resumptions = info
        .resumptions()
        .unwrap_or(0)
        .saturating_add(u64::from(c.is_started()));
    let shutdown = ctx.shutdown();
    let mut advanced = false;
    for def in W::STEPS {
        // `checkpoint! if continuation.advanced?`, before each step.
        if advanced {
            if let Some(hook) = hook {
                hook(None);
            }
            if shutdown.is_quiet() {
                let key = format!("Interrupted {} (stopping)", c.description());
                return Err(resume(ctx, &c, key, &opts, resumptions));
            }
        }
        if c.is_completed(def.name) {
            continue;
        }
        if def.isolated && advanced {
            let key = format!("Interrupted {} (isolating)", c.description());
            return Err(resume(ctx, &c, key, &opts, resumptions));
        }
        let (cursor, resumed) = match &c.current {
            Some((name, cursor)) if name == def.name => (cursor.clone(), true),
            _ => (Value::Null, false),
        };
        let mut step = Step {
            name: def.name,
            initial: cursor.clone(),
            cursor,
            resumed,
            shutdown: shutdown.clone(),
            hook: hook.cloned(),
            interrupted: None,
        };
        // `@current ||= new_step(...)`: the step is current from its start.
        c.current = Some((def.name.to_owned(), step.cursor.clone()));
        let result = w.step(ctx, args, &mut step).await;
        c.current = Some((def.name.to_owned(), step.cursor.clone()));
        match result {
            Ok(()) => {
                c.complete(def.name);
                advanced = true;
            }
            Err(e) => {
                advanced |= step.cursor != step.initial;
                if step.interrupted.is_some() && e.class == INTERRUPT {
                    return Err(resume(ctx, &c, e.message, &opts, resumptions));
                }
                if opts.resume_errors_after_advancing && advanced {
                    // `resume_job(exception: e)`: counted under that hash's `to_s` (Ruby 3.1-3.3).
                    let key = format!("{{:exception=>#<{}: {}>}}", e.class, e.message);
                    return Err(resume(ctx, &c, key, &opts, resumptions));
                }
                return Err(e);
            }
        }
    }
    Ok(())
}

/// `resume_job`: the interrupt's fate (the next run, built by the retry machinery from the
/// `job_data` here), or `ResumeLimitError` past `max_resumptions`.
fn resume(
    ctx: &JobContext,
    c: &Continuation,
    counted_as: String,
    opts: &ContinuationOptions,
    resumptions: u64,
) -> JobError {
    if let Some(max) = opts.max_resumptions
        && resumptions >= max
    {
        return JobError::new(
            RESUME_LIMIT,
            format!("Job was resumed a maximum of {max} times"),
        );
    }
    let Some(info) = ctx.activejob() else {
        return JobError::msg("not an ActiveJob payload");
    };
    let now = chrono::Utc::now();
    match c.resumed_job_data(
        info.job_data(),
        ctx.jid(),
        &counted_as,
        now,
        opts.resume_wait,
    ) {
        Ok(job_data) => {
            let at = (now.timestamp_micros() as f64) / 1e6 + opts.resume_wait.as_secs_f64();
            let mut e = JobError::new(INTERRUPT, counted_as);
            e.action = RetryAction::Continue(at);
            e.resume = Some(Box::new(crate::error::Resume {
                job_data,
                lock: None,
            }));
            e
        }
        Err(m) => JobError::new(INVALID_STEP, m),
    }
}
