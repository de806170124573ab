//! Running one fetched job from start to fate: decode, dispatch, retry, stats, acknowledge.
//!
//! Mirrors `processor.rb`. The outer order is fixed here: job span → retry → stats → the worker's
//! middleware chain → the worker. "It is worse to lose a job than to run it twice": a job is acknowledged
//! only once its fate (done, retry, schedule, dead) is in Redis; while that write fails it is retried, and
//! until it succeeds the job stays in the work table, which the shutdown pushes back. The
//! [`crate::manager`] feeds the processor units of work and owns the work table and the acker that
//! `RunState` settles a job into.
//!
//! A fate write that fails for a reason other than an outage (a key of the wrong type, out of memory,
//! a script error) is not retried in a loop that pins the processor: it is logged at error level with
//! the error (which names the key and its type), counted (`oxidekiq_fate_write_failures_total`), makes
//! `/ready` answer 503, and the job gives up its slot ([`Park`]) so a fresh processor serves the other
//! jobs, while it stays in the work table and in its working copy in Redis and its write is retried
//! every few seconds; it lands once the key is repaired, or the stop pushes it back.
//!
//! Under reliable fetch a fate write (retry, dead, schedule, hand-off) also removes the job's entry from
//! the working hash, in the same script, and writes nothing when that entry is gone ([`retry::Token`]).
//! So a retry after a lost reply writes nothing twice, and a write cut off by the shutdown deadline after
//! Redis ran it leaves nothing for the push-back, which moves only entries still there.

use crate::redact::{NAME_CHARS, clip};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio::time::Instant;
use tracing::Instrument;

use crate::config::UnknownClass;
use crate::error::{JobError, JobResult, Result};
use crate::fetch::UnitOfWork;
use crate::job::{Job, PayloadError};
use crate::middleware::Next;
use crate::redis_conn::Conn;
use crate::registry::Registry;
use crate::retry::{self, Failure, Fate};
use crate::shutdown::ShutdownSignal;
use crate::time;
use crate::work_table::WorkTable;
use crate::worker::{ActiveJobInfo, AfterFate, JobContext};

/// Most jobs that give up their slot while their fate write is stuck ([`Park`]).
const MAX_PARKED: i64 = 1000;

/// Processed and failed counts since the last heartbeat flush (`Processor::PROCESSED`/`FAILURE`).
#[derive(Debug, Default)]
pub(crate) struct Stats {
    /// Jobs run, successful or not.
    pub processed: AtomicU64,
    /// Jobs that raised.
    pub failed: AtomicU64,
}

impl Stats {
    /// Takes the counts, leaving zeros (the heartbeat adds them back if its write fails).
    pub(crate) fn take(&self) -> (u64, u64) {
        (
            self.processed.swap(0, Ordering::Relaxed),
            self.failed.swap(0, Ordering::Relaxed),
        )
    }

    /// Adds counts back after a failed flush.
    pub(crate) fn restore(&self, processed: u64, failed: u64) {
        self.processed.fetch_add(processed, Ordering::Relaxed);
        self.failed.fetch_add(failed, Ordering::Relaxed);
    }
}

/// Everything a job's run needs, shared by all running jobs.
#[derive(Debug)]
pub(crate) struct Processor {
    /// Workers by class.
    pub registry: Arc<Registry>,
    /// The jobs' Redis connection (fate writes, [`JobContext::redis`], job locks), apart from the
    /// control plane's (see the launcher's module docs).
    pub conn: Conn,
    /// Counters flushed by the heartbeat.
    pub stats: Arc<Stats>,
    /// In-flight jobs.
    pub work: Arc<WorkTable>,
    /// Settled jobs, for the manager's acker to acknowledge in batches.
    pub acks: mpsc::UnboundedSender<UnitOfWork>,
    /// The process's phase.
    pub shutdown: ShutdownSignal,
    /// Largest payload decoded.
    pub max_payload_bytes: usize,
    /// What to do with unknown classes.
    pub unknown_class: UnknownClass,
    /// The live fleet view: how new timestamps are written and which retry rules apply, now.
    pub fleet: Arc<crate::fleet::Fleet>,
    /// Execution metrics for the Web UI's Metrics tab, flushed by the heartbeat.
    pub metrics: Arc<crate::metrics::Metrics>,
    /// `--handoff QUEUE`: jobs oxidekiq should not run go to a queue Ruby serves.
    pub handoff: Option<Arc<crate::migrate::handoff::Handoff>>,
    /// The job locks' batch task, handed to each job's context for the lock middleware.
    pub locks: crate::lock_batch::Locks,
    /// Which sidekiq-unique-jobs release the gem's jobs follow, handed to each job's context.
    pub unique_jobs: Arc<crate::unique_jobs::FleetGemRelease>,
    /// The classes rolled back (`route CLASS 0`): their jobs fetched from `<queue>_rust` go to
    /// `<queue>` instead of running.
    pub routes: Arc<crate::route_table::RolledBack>,
    /// This process's batch-list prefix ([`crate::keys::batch_prefix`]) under reliable fetch, `None`
    /// with basic fetch: a job's entry there is its [`retry::Token`], consumed by its fate write.
    pub working_prefix: Option<String>,
}

/// Awaits the future `$work` polled inside `$span` (a `&Span`), as `.instrument(span)` does, without
/// entering the span once more to drop a future that has finished (`Instrumented` does on every drop:
/// an enter and an exit of the job's span). A macro, not a function: the future is built in the
/// caller's own state, where a function taking it would copy the job's whole run state once more (a
/// no-op job's run: about 260 instructions of `memcpy`, more than the enter and exit it saves). A future
/// dropped before it finished (the shutdown deadline, a panic) is dropped inside the span, as
/// `Instrumented` drops it: whatever its drop logs carries the job's fields.
macro_rules! in_span {
    ($span:expr, $work:expr) => {{
        let span: &tracing::Span = $span;
        let pending = AtomicBool::new(true);
        // Dropped last: exits the span `_enter` entered once the future is dropped.
        let _exit = SpanBracket {
            span,
            pending: &pending,
            enter: false,
        };
        let mut work = std::pin::pin!($work);
        // Dropped first: enters the span before the future is dropped.
        let _enter = SpanBracket {
            span,
            pending: &pending,
            enter: true,
        };
        let out = std::future::poll_fn(|cx| {
            let _in = span.enter();
            work.as_mut().poll(cx)
        })
        .await;
        pending.store(false, Ordering::Relaxed);
        out
    }};
}
/// Enters (`enter: true`) or exits `span` when dropped while `pending` is set: [`in_span!`] declares
/// one on each side of the pinned future, so that they bracket the drop of a future that never
/// finished.
struct SpanBracket<'a> {
    span: &'a tracing::Span,
    pending: &'a AtomicBool,
    enter: bool,
}

impl Drop for SpanBracket<'_> {
    fn drop(&mut self) {
        if self.pending.load(Ordering::Relaxed) {
            self.span.with_subscriber(|(id, dispatch)| {
                if self.enter {
                    dispatch.enter(id)
                } else {
                    dispatch.exit(id)
                }
            });
        }
    }
}

impl Processor {
    /// Runs one fetched job to its fate and queues its ack. A panic anywhere on the way (the worker, a
    /// middleware, oxidekiq's own code) is caught here and becomes the job's failure
    /// ([`Processor::after_panic`]): the job never stays stranded in the working hash and the Busy page.
    ///
    /// `park` holds the processor's slot: a job whose fate write is stuck gives it up (see [`Park`]).
    pub(crate) async fn process(self: Arc<Self>, unit: UnitOfWork, park: &Park, after: AfterFate) {
        let run = RunState::new(unit.queue.clone(), unit.id, park, after);
        let unit_run = std::pin::pin!(self.clone().process_unit(unit, &run));
        if let Err(panic) = catch_unwind(unit_run).await {
            self.after_panic(run.queue.clone(), &run, panic_message(panic.as_ref()))
                .await;
        }
    }

    /// [`Processor::process`] without the panic guard; `run` records what a panic recovery needs.
    async fn process_unit(self: Arc<Self>, mut unit: UnitOfWork, run: &RunState<'_>) {
        let queue = unit.queue.clone();
        match Job::parse(unit.take_raw(), self.max_payload_bytes) {
            Err((bytes, error)) => {
                let raw: Arc<[u8]> = Arc::from(bytes);
                unit.share_raw(raw.clone());
                let entry = self.work.insert(unit, None);
                run.entered(entry, &raw);
                tracing::warn!(queue = %queue, error = %error, "undecodable job sent to the dead set");
                let now = time::now();
                let member = match error {
                    // Too large to decode safely: the error is appended as text, every byte kept.
                    PayloadError::TooLarge { .. } => annotate_undecoded(&raw, &error.to_string()),
                    _ => {
                        let tf = self.fleet.time_format();
                        retry::undecodable_payload(&raw, &error.to_string(), now, tf)
                    }
                };
                let token = run.token(&self);
                let written = self
                    .persist(run.park, |mut conn| {
                        let (member, token) = (member.clone(), token.clone());
                        async move { retry::kill(&mut conn, &member, now, token.as_ref()).await }
                    })
                    .await;
                if written.is_none() {
                    // Given up at the stop: it stays in flight and is pushed back.
                    return;
                }
                run.settle(&self);
                self.stats.processed.fetch_add(1, Ordering::Relaxed);
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
            }
            Ok(job) => {
                let job = Arc::new(job);
                let raw: Arc<[u8]> = job.shared_raw();
                unit.share_raw(raw.clone());
                // Sidekiq's `cancel!` reaches a plain async job through the heartbeat's check, which
                // reads the job from its row; a worker that reads it itself, a synchronous one (its
                // thread would run on) and a job without a worker are left alone.
                // The class is looked up once, here, and its entry handed to the run.
                let worker = self.registry.get(job.worker_class());
                let cancellable = worker.is_some_and(|e| !e.synchronous && !e.checks_cancel);
                let entry = self.work.insert(unit, cancellable.then(|| job.clone()));
                run.entered(entry, &raw);
                // Clipped: a made-up class or jid can be megabytes, and it is on every line of the job.
                let (class, jid) = (
                    clip(job.worker_class(), NAME_CHARS),
                    clip(job.jid(), NAME_CHARS),
                );
                // Plain strings under the job target: the logger writes them bare, without `core::fmt`.
                let span = tracing::info_span!(
                    target: crate::logging::JOB_TARGET,
                    "job",
                    class = &*class,
                    jid = &*jid,
                    queue = &*queue,
                );
                // The consumer span, while tracing (docs/tracing.md): the job's own spans nest in it.
                let traced = crate::otel::JobSpan::start(job.raw().as_bytes(), &queue);
                if let Some(t) = &traced {
                    crate::logging::attach_otel(&span, t.context().clone());
                }
                let finished = in_span!(
                    &span,
                    self.run(
                        job,
                        worker,
                        queue.clone(),
                        run,
                        cancellable.then_some(entry),
                    )
                );
                drop(span);
                if let Some(t) = traced {
                    t.end();
                }
                if !finished {
                    // Interrupted at the shutdown deadline: it stays in flight, unacknowledged, and the
                    // manager pushes it back to its queue.
                    return;
                }
                run.settle(&self);
            }
        }
    }

    /// The job span's body: run, then write the fate (retry wraps the chain from outside). False when the
    /// job ended with an error after the shutdown deadline: it has no fate of its own and is pushed back.
    /// `entry` is the class's worker, `cancel_row` the job's work-table row when `cancel!` can reach it.
    async fn run(
        &self,
        job: Arc<Job>,
        entry: Option<&crate::registry::Entry>,
        queue: Arc<str>,
        state: &RunState<'_>,
        cancel_row: Option<u64>,
    ) -> bool {
        if let Some(handed) = self.roll_back(&job, &queue, state).await {
            return handed;
        }
        // The token is only built when a hand-off is configured: most processes have none.
        let token = self.handoff.as_ref().and_then(|_| state.token(self));
        if let Some(handed) = self.hand_off(&job, token.as_ref(), state.park).await {
            if handed {
                // Its fate is the hand-off queue: a shutdown must not push it back as well.
                state.settle(self);
            }
            return handed;
        }
        let start = Instant::now();
        state.started(start);
        // Straight into the text logger when it is the subscriber (the same bytes, without tracing's
        // event machinery), else as an event.
        if !crate::logging::job_line("start", None) {
            tracing::info!(message = "start");
        }
        // What the chain's middleware ask to run once a failure's fate is written (`fail`); kept in
        // the run state so that a panic's fate runs the hooks registered before it, too.
        let after = state.after.clone();
        let timeout = job_timeout(&job, entry.map(|e| &e.options));
        // Sidekiq's `cancel!` reaches a plain async job (its row says which, see `process_unit`); a
        // job refused before its worker runs is left alone.
        let cancel = cancel_row.map(|row| crate::worker::CancelCut {
            source: self.work.clone(),
            row,
        });
        // The cut (timeout, cancel) stops the worker only, inside the chain: every middleware sees its
        // outcome and settles (locks released or renewed, limits freed) as Ruby's `ensure` would.
        let cut = WorkerCutoffs {
            timeout: timeout.filter(|_| !entry.is_some_and(|e| e.synchronous)),
            cancel,
        };
        let result = match timeout {
            None => self.invoke(&job, &queue, entry, &after, cut).await,
            Some(limit) => {
                self.invoke_with_timeout(&job, &queue, entry, &after, limit, cut)
                    .await
            }
        };
        if let Err(e) = &result
            && crate::otel::enabled()
            && let Some(cx) = crate::logging::current_otel()
        {
            crate::otel::job_failed(&cx, &e.class, &e.message);
        }
        // One clock read for the log line and both metrics (each read is a vDSO call).
        let took = start.elapsed();
        let elapsed = took.as_secs_f64();
        self.count_run(state, &job, &queue, took, result.as_ref().err());
        let error = match result {
            Ok(()) => {
                // Done: from here a panic must not turn the job into a failure (it would run twice).
                state.settle(self);
                let text = crate::time::Secs3(elapsed).text();
                if !crate::logging::job_line("done", Some(text.as_str())) {
                    tracing::info!(elapsed = text.as_str(), message = "done");
                }
                return true;
            }
            Err(e) => e,
        };
        // The failure path is boxed: it is rare, and its state would otherwise make every job's task
        // (copied in at spawn) larger.
        Box::pin(self.fail(job, queue, entry, error, elapsed, after, state)).await
    }

    /// A job of a rolled-back class fetched from `<queue>_rust` goes to `<queue>`, byte for byte,
    /// instead of starting (a roll back means no new Rust run of the class): `None` when it runs here;
    /// `Some(true)` when it was handed to Ruby's queue (settled); `Some(false)` when the push was given
    /// up at the stop (it stays in flight and is pushed back). The push consumes the job's working
    /// entry in the same script, so a retry after a lost reply pushes nothing twice.
    async fn roll_back(&self, job: &Job, queue: &str, state: &RunState<'_>) -> Option<bool> {
        let base = self.routes.redirect(queue, job.worker_class()).await?;
        let token = state.token(self);
        let pushed = self
            .persist(state.park, |mut conn| {
                let (base, token) = (&base, token.as_ref());
                async move {
                    retry::push_to_queue(&mut conn, base, job.raw().as_bytes(), None, token).await
                }
            })
            .await;
        if pushed.is_none() {
            return Some(false);
        }
        tracing::info!(to = %base, "class rolled back (route 0): handed to its Ruby queue, not run");
        state.settle(self);
        Some(true)
    }

    /// Counts a run that ended (with `error` when it failed), once per job whatever the path: in the
    /// processed stat, in the per-class metrics (the one hook; `Metrics::Middleware` wraps the job in
    /// Ruby) and in the Prometheus counters. A run that panicked is counted by
    /// [`Processor::after_panic`] unless it was already, as Sidekiq counts a raised job (`stats`'s
    /// `ensure`, `ExecutionTracker#track`'s `ensure`). The failed stat is the fate's ([`Processor::fail`]).
    fn count_run(
        &self,
        state: &RunState<'_>,
        job: &Job,
        queue: &str,
        took: Duration,
        error: Option<&JobError>,
    ) {
        if state.counted.swap(true, Ordering::AcqRel) {
            return;
        }
        self.stats.processed.fetch_add(1, Ordering::Relaxed);
        let class = job.wrapped().unwrap_or(job.class());
        self.metrics.track(class, took, error);
        crate::prom::metrics().job_ran(class, queue, took, error);
    }

    /// A failed run: write its fate (retry, dead, discard, reschedule) and say whether it has one.
    #[allow(clippy::too_many_arguments)] // one call site; a struct would only rename the list
    async fn fail(
        &self,
        job: Arc<Job>,
        queue: Arc<str>,
        entry: Option<&crate::registry::Entry>,
        mut error: JobError,
        elapsed: f64,
        after: AfterFate,
        state: &RunState<'_>,
    ) -> bool {
        redact_error(&mut error);
        if interrupted(&self.shutdown) {
            // As Sidekiq::Shutdown: no retry, no ack; counted as failed, as Ruby's `stats` does.
            self.stats.failed.fetch_add(1, Ordering::Relaxed);
            tracing::info!(elapsed = %crate::time::Secs3(elapsed), reason = %error.message,
                "interrupted by shutdown: pushed back to its queue");
            return false;
        }
        match error.action {
            crate::RetryAction::Reschedule(_) | crate::RetryAction::Continue(_) => {}
            crate::RetryAction::Requeue => {
                // As 8.1.7 counts an interrupted iteration (`Skip` in `stats`): processed and failed.
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                tracing::info!(elapsed = %crate::time::Secs3(elapsed), reason = %error.message,
                    "interrupted: pushing it back to its queue");
            }
            _ => {
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                tracing::info!(elapsed = %crate::time::Secs3(elapsed), "fail");
                tracing::warn!(error_class = %error.class, error_message = %error.message, "job failed");
            }
        }
        let now = time::now();
        let plan = retry::plan(
            &Failure {
                job: &job,
                queue: &queue,
                error: &error,
                options: entry.map(|e| &e.options),
                now,
                time_format: self.fleet.time_format(),
                rules: self.fleet.retry_rules(),
            },
            &mut rand::rng(),
        );
        let token = state.token(self);
        let fate = self
            .persist(state.park, |mut conn| {
                let (job, plan, token) = (job.clone(), plan.clone(), token.clone());
                async move { retry::apply(&mut conn, &job, &plan, now, token.as_ref()).await }
            })
            .await;
        let Some(written) = fate else {
            // Given up at the stop (its write kept failing): no fate, so it is pushed back.
            return false;
        };
        state.settle(self);
        let Some(fate) = written else {
            // Its entry was taken back before the write (a recovery or the stop's push-back returned
            // it to its queue): this run has no fate of its own, so no hook acts on the plan's (a
            // lock handed to a next run that is nowhere, one released while the job waits again).
            tracing::info!(reason = %error.message,
                "taken back before its fate was written (a recovery or the stop's push-back): nothing written");
            return true;
        };
        after.run(&fate).await;
        crate::prom::metrics().fate(job.wrapped().unwrap_or(job.class()), &fate);
        match fate {
            Fate::Retry { at, count } => {
                tracing::debug!(retry_at = at, retry_count = count, "scheduled for retry")
            }
            Fate::Dead => tracing::warn!("retries exhausted: moved to the dead set"),
            Fate::Discarded => tracing::info!("discarded"),
            Fate::Rescheduled { at } => {
                tracing::info!(run_at = at, reason = %error.message, "rescheduled")
            }
            Fate::Requeued => tracing::info!("pushed back to its queue"),
            Fate::Continued { at, jid } => {
                tracing::info!(run_at = at, next_jid = %jid, reason = %error.message, "continued")
            }
        }
        true
    }

    /// A run panicked. Whatever state it was in, the job ends with a fate, as a raised exception would:
    ///
    /// - the fate was already written (the job was done, or its retry/dead entry is in Redis): the panic
    ///   came after it, so the job is only acknowledged (failing it now would run it twice);
    /// - otherwise it fails through the ordinary retry path with `error_class` `Oxidekiq::Panic` and the
    ///   panic's message, Sidekiq's backoff included;
    /// - if that path panics too (a bug in the retry path itself), the payload goes to the dead set with
    ///   the error appended to its original bytes, so it is kept for a human to look at.
    ///
    /// A panic before the job entered the work table (while decoding its bytes, which the fuzz target
    /// covers) leaves it in this process's working hash, unacknowledged: the shutdown's last sweep pushes
    /// it back to its queue (or, if the process dies, recovery does, and a job recovered too often goes to
    /// the dead set). It is not lost; it waits there until then.
    async fn after_panic(&self, queue: Arc<str>, run: &RunState<'_>, message: String) {
        let Some((_, raw)) = run.held() else {
            tracing::error!(queue = %queue, panic = %message,
                "panic while decoding a job: it stays in this process's working hash until the shutdown pushes it back");
            return;
        };
        // Decoded again (it was before the panic, unless the panic came from the undecodable path) for
        // the retry path and the log line's class and jid.
        let job = Job::parse(raw.to_vec(), self.max_payload_bytes)
            .ok()
            .map(Arc::new);
        let span = match &job {
            Some(j) => {
                tracing::error_span!("job", class = %clip(j.worker_class(), NAME_CHARS),
                    jid = %clip(j.jid(), NAME_CHARS), queue = %queue)
            }
            None => tracing::error_span!("job", queue = %queue),
        };
        let done = async {
            if run.is_fate_written() {
                tracing::error!(panic = %message, "panic after the job's fate was written: acknowledged");
                return true;
            }
            tracing::error!(panic = %message, "job panicked: failing it");
            let retried = match job {
                Some(job) => {
                    let error = JobError::new(crate::error::PANIC, format!("panicked: {message}"));
                    // The run ended here: counted as a failure, as a raised job is.
                    let took = run.took();
                    self.count_run(run, &job, &queue, took, Some(&error));
                    let entry = self.registry.get(job.worker_class());
                    let failing =
                        self.fail(job, queue.clone(), entry, error, 0.0, run.after.clone(), run);
                    catch_unwind(std::pin::pin!(failing)).await.ok()
                }
                None => None,
            };
            match retried {
                Some(has_fate) => has_fate,
                // The retry path panicked after writing the fate: nothing more to write.
                None if run.is_fate_written() => true,
                None => {
                    let text = format!("panicked: {message} (and its retry entry could not be written)");
                    let member = annotate_error(&raw, crate::error::PANIC, &text);
                    let now = time::now();
                    let token = run.token(self);
                    let written = self
                        .persist(run.park, |mut conn| {
                            let (member, token) = (member.clone(), token.clone());
                            async move { retry::kill(&mut conn, &member, now, token.as_ref()).await }
                        })
                        .await;
                    if written.is_some() {
                        tracing::error!("sent to the dead set");
                    }
                    written.is_some()
                }
            }
        }
        .instrument(span)
        .await;
        if done {
            run.settle(self);
        }
    }

    /// [`Processor::invoke`] under a timeout: an async job still running after `limit` is dropped at
    /// its next await point and fails with [`crate::error::JOB_TIMEOUT`] (the retry path, Sidekiq's
    /// backoff); the cut is [`WorkerWithTimeout`]'s, around the worker inside the chain. A synchronous worker ([`crate::Worker::SYNCHRONOUS`]) is not cut off (its thread
    /// would run on while its retry is written); it and an async job stuck in a busy loop (whose
    /// future never yields, so never sees its timeout) are reported once past the limit: one error
    /// line naming the class and jid, and `oxidekiq_jobs_past_timeout_total{class}`.
    async fn invoke_with_timeout(
        &self,
        job: &Arc<Job>,
        queue: &Arc<str>,
        entry: Option<&crate::registry::Entry>,
        after: &AfterFate,
        limit: Duration,
        cut: WorkerCutoffs,
    ) -> JobResult {
        let report_after = watchdog_delay(limit, entry.is_some_and(|e| e.synchronous));
        let class = job.wrapped().unwrap_or(job.class()).to_string();
        let watchdog = tokio::spawn(
            async move {
                tokio::time::sleep(report_after).await;
                tracing::error!(class = %clip(&class, NAME_CHARS),
                    timeout = format_args!("{:.3}", limit.as_secs_f64()),
                    "job still running past its timeout: it runs synchronous code (a blocking worker or \
                     a loop that never awaits), which cannot be cancelled; its run ends when that code returns");
                crate::prom::metrics().past_timeout(&class);
            }
            .in_current_span(),
        );
        let _watchdog = AbortOnDrop(watchdog);
        self.invoke(job, queue, entry, after, cut).await
    }

    /// Finds and runs the worker through its chain.
    async fn invoke(
        &self,
        job: &Arc<Job>,
        queue: &Arc<str>,
        entry: Option<&crate::registry::Entry>,
        after: &AfterFate,
        cut: WorkerCutoffs,
    ) -> JobResult {
        // A job refused before its worker runs (no worker for its class, ActiveJob arguments that do not
        // decode) still passes the built-in until-executed stage, so its lock is settled with its fate
        // (released when it dies, kept for a retry) as for any other failure.
        let mut refused = None;
        let activejob = match entry {
            None => {
                let e = unknown_class(job.worker_class());
                refused = Some(match self.unknown_class {
                    UnknownClass::Retry => e,
                    UnknownClass::Dead => e.kill(),
                });
                None
            }
            Some(_) => activejob_of(job).unwrap_or_else(|e| {
                refused = Some(e);
                None
            }),
        };
        let ctx = JobContext::with_fate_hooks(
            job.clone(),
            queue.clone(),
            self.conn.clone(),
            self.shutdown.clone(),
            activejob,
            after.clone(),
        )
        .with_cancel(cut.cancel)
        .with_locks(self.locks.clone())
        .with_unique_jobs(self.unique_jobs.clone());
        match (entry, refused) {
            (Some(entry), None) if cut.timeout.is_none() => {
                Next::new(&entry.chain, entry.handler.as_ref())
                    .run(&ctx)
                    .await
            }
            (Some(entry), None) => {
                let bounded = WorkerWithTimeout {
                    worker: entry.handler.clone(),
                    timeout: cut.timeout,
                };
                Next::new(&entry.chain, &bounded).run(&ctx).await
            }
            (_, refused) => {
                let refuse = RefusedJobHandler(std::sync::Mutex::new(refused));
                Next::new(&[], &refuse).run(&ctx).await
            }
        }
    }

    /// The hand-off step (`--handoff`, [`crate::migrate::handoff::divert`]): `None` when the job runs
    /// here, else whether it reached the hand-off queue. The push is a fate write ([`Self::persist`]):
    /// it consumes the job's `token` in the same script, and a damaged key parks the job, not its slot.
    pub(crate) async fn hand_off(
        &self,
        job: &Job,
        token: Option<&retry::Token>,
        park: &Park,
    ) -> Option<bool> {
        crate::migrate::handoff::divert(
            self.handoff.as_deref(),
            &self.registry,
            job,
            |queue, label| {
                let raw = job.raw().as_bytes();
                self.persist(park, move |mut conn| async move {
                    retry::push_to_queue(&mut conn, queue, raw, Some(label), token).await
                })
            },
        )
        .await
    }

    /// Runs a fate write until it succeeds: a job's fate must reach Redis before its ack. `None` when it
    /// gave up (the job then has no fate: it stays in flight and the stop pushes it back):
    ///
    /// - an outage (Redis unreachable, loading, failing over) is retried every 50 ms to 2 s, and given
    ///   up on only at the shutdown deadline, as every job then is;
    /// - any other failure (a key of the wrong type, out of memory, a script error) will not mend by
    ///   itself: it is logged at error level, counted, shown by `/ready`, and the job gives up its slot
    ///   ([`Park::park`]) so the other jobs keep moving, then is retried every 1 to 10 s until it
    ///   lands, or given up on once the process is stopping.
    pub(crate) async fn persist<T, F, Fut>(&self, park: &Park, mut write: F) -> Option<T>
    where
        F: FnMut(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut delay = Duration::from_millis(50);
        let mut logged = false;
        let mut stuck: Option<crate::prom::StuckFate> = None;
        let mut signal = self.shutdown.clone();
        loop {
            if signal.phase() >= crate::shutdown::Phase::Cancelled {
                return None;
            }
            match write(self.conn.clone()).await {
                Ok(v) => {
                    if stuck.take().is_some() {
                        tracing::warn!(
                            "job fate written at last: the key that refused it was repaired"
                        );
                    } else if logged {
                        tracing::info!("redis reachable again: job fate written");
                    }
                    return Some(v);
                }
                Err(e) if e.is_outage() => {
                    if !logged {
                        tracing::warn!(error = %e, "cannot write job fate to redis; retrying");
                        logged = true;
                    }
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
                Err(e) => {
                    if stuck.is_none() {
                        tracing::error!(error = %e,
                            "cannot write the job's fate, and not for an outage: repair the key named; the \
                             job stays held (its working copy in redis), its write is retried every few \
                             seconds, and its slot goes to other jobs");
                        let m = crate::prom::metrics();
                        stuck = Some(m.fate_stuck(&e.to_string()));
                        // Bounded: each parked job holds its payload and a task. Past the bound a
                        // job keeps its slot (as an outage would), which slows the process, loudly,
                        // rather than grow it without end.
                        if m.stuck_fates().is_some_and(|(n, _)| n <= MAX_PARKED) {
                            park.park();
                        }
                        delay = Duration::from_secs(1);
                    }
                    if signal.is_stopping() {
                        tracing::warn!(error = %e,
                            "stopping: the job whose fate cannot be written is pushed back to its queue");
                        return None;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = signal.reached(crate::shutdown::Phase::Stopping) => {}
                    }
                    delay = (delay * 2).min(Duration::from_secs(10));
                }
            }
        }
    }
}

/// A processor's slot while it runs one job. A job whose fate write fails for a reason other than an
/// outage gives the slot up ([`Park::park`]) and asks for a fresh processor, so the other jobs keep
/// moving while it waits for the key to be repaired; its processor ends once the job does.
#[derive(Debug, Default)]
pub(crate) struct Park {
    /// The slot, until given up.
    slot: Mutex<Option<OwnedSemaphorePermit>>,
    /// Asks the manager for a processor to take this one's place.
    respawn: Option<mpsc::UnboundedSender<()>>,
    /// Set once the slot was given up.
    parked: AtomicBool,
}

impl Park {
    /// A job's hold on `slot`; `respawn` asks for a replacement processor.
    pub(crate) fn new(slot: OwnedSemaphorePermit, respawn: mpsc::UnboundedSender<()>) -> Park {
        Park {
            slot: Mutex::new(Some(slot)),
            respawn: Some(respawn),
            parked: AtomicBool::new(false),
        }
    }

    /// Gives the slot up and asks for a replacement processor, once.
    pub(crate) fn park(&self) {
        if self.parked.swap(true, Ordering::AcqRel) {
            return;
        }
        let slot = match self.slot.lock() {
            Ok(mut s) => s.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        drop(slot);
        if let Some(r) = &self.respawn {
            let _ = r.send(());
        }
    }

    /// True once the slot was given up (a replacement processor took this one's place).
    pub(crate) fn parked(&self) -> bool {
        self.parked.load(Ordering::Acquire)
    }
}

/// One job's run, from fetch to ack: its in-flight entry and bytes once it has them (what
/// [`Processor::after_panic`] needs), and whether its fate is already in Redis.
///
/// A job whose fate is written (done, or its failure in Redis) leaves the work table and is queued
/// for acknowledgement at once, by [`RunState::settle`], before any further await: a shutdown
/// cancellation after that point (issue 11, item 7) must not push it back to its queue as well, and a
/// panic after it must not fail it a second time.
#[derive(Debug)]
struct RunState<'p> {
    /// The processor's slot, given up when the fate write is stuck.
    park: &'p Park,
    /// The queue it was fetched from.
    queue: Arc<str>,
    /// Its id in the working hash.
    id: u64,
    /// The work table entry and the job's bytes, set once the job is in the table.
    held: Mutex<Option<(u64, Arc<[u8]>)>>,
    /// Set once the job's fate (done, or its retry/dead/schedule entry) is written.
    fate_written: AtomicBool,
    /// Set once it left the work table and its ack was queued.
    acked: AtomicBool,
    /// When its worker's chain started (a lock, not a `OnceLock`: cheaper to set, on every job).
    started: Mutex<Option<Instant>>,
    /// Set once the run is counted ([`Processor::count_run`]).
    counted: AtomicBool,
    /// The hooks the chain registered for after a failure's fate ([`JobContext::after_fate`]), also
    /// run after a panic's.
    after: AfterFate,
}

impl<'p> RunState<'p> {
    fn new(queue: Arc<str>, id: u64, park: &'p Park, after: AfterFate) -> Self {
        RunState {
            park,
            queue,
            id,
            held: Mutex::new(None),
            fate_written: AtomicBool::new(false),
            acked: AtomicBool::new(false),
            started: Mutex::new(None),
            counted: AtomicBool::new(false),
            after,
        }
    }

    /// The fate is in Redis: out of the work table and into the acker's queue, once.
    fn settle(&self, p: &Processor) {
        self.fate_written.store(true, Ordering::Release);
        if let Some((entry, _)) = self.held()
            && !self.acked.swap(true, Ordering::AcqRel)
            && let Some(unit) = p.work.remove(entry)
        {
            let _ = p.acks.send(unit);
        }
    }

    /// The job's working-hash entry, which its fate write consumes (reliable fetch only).
    fn token(&self, p: &Processor) -> Option<retry::Token> {
        p.working_prefix
            .as_ref()
            .map(|prefix| retry::Token::of(prefix, &self.queue, self.id))
    }

    fn entered(&self, entry: u64, raw: &Arc<[u8]>) {
        if let Ok(mut h) = self.held.lock() {
            *h = Some((entry, raw.clone()));
        }
    }

    fn held(&self) -> Option<(u64, Arc<[u8]>)> {
        // A poisoned lock still holds the value: a panic cannot happen while it is held.
        match self.held.lock() {
            Ok(h) => h.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn started(&self, at: Instant) {
        if let Ok(mut s) = self.started.lock() {
            *s = Some(at);
        }
    }

    /// How long the run has taken since its chain started (0 if it never started).
    fn took(&self) -> Duration {
        let started = match self.started.lock() {
            Ok(s) => *s,
            Err(poisoned) => *poisoned.into_inner(),
        };
        started.map_or(Duration::ZERO, |t| t.elapsed())
    }

    fn is_fate_written(&self) -> bool {
        self.fate_written.load(Ordering::Acquire)
    }
}

// Lives in the support layer so that the locks layer catches a perform's panic the same way.
pub(crate) use crate::error::catch_unwind;

/// What may cut a job's worker off before it returns, applied inside the chain around the worker
/// alone: its timeout (async workers only: [`WorkerWithTimeout`]) and Sidekiq's `cancel!` (the
/// heartbeat's signal, honoured inside the worker's own handler: [`crate::worker::run_cancellable`]).
#[derive(Debug, Default)]
struct WorkerCutoffs {
    timeout: Option<Duration>,
    /// The work table and the job's row there, whose cancel mark the heartbeat's check sets.
    cancel: Option<crate::worker::CancelCut>,
}

/// The handler at the end of the chain in the worker's place when the job has a timeout: the worker's
/// own handler, failed with [`crate::error::JOB_TIMEOUT`] once `timeout` passes (an async worker is
/// dropped at its next await point). Cutting here, not around the whole chain,
/// lets each middleware's code after `next.run` run on a timeout (or a cancel, which the worker's
/// handler honours): an until-executed lock (ours or the gem's) is released or renewed by the fate, a
/// concurrency slot is given back.
#[derive(Debug)]
struct WorkerWithTimeout {
    worker: Arc<dyn crate::middleware::Handler>,
    timeout: Option<Duration>,
}

impl crate::middleware::Handler for WorkerWithTimeout {
    fn call<'a>(&'a self, ctx: &'a JobContext) -> crate::worker::BoxFuture<'a, JobResult> {
        Box::pin(async move {
            let Some(limit) = self.timeout else {
                return self.worker.call(ctx).await;
            };
            match tokio::time::timeout(limit, self.worker.call(ctx)).await {
                Ok(result) => result,
                Err(_) => Err(timed_out(ctx.job(), limit)),
            }
        })
    }
}

/// When the watchdog reports a job past its timeout `limit`: at the limit for a synchronous worker;
/// for an async one, whose cancellation fires at the limit, a little later (a loaded runtime may be
/// late), so that only a job its cancellation could not reach is reported. Saturating: a worker's
/// `timeout` may be as long as `Duration::MAX`.
fn watchdog_delay(limit: Duration, synchronous: bool) -> Duration {
    let grace = if synchronous {
        Duration::ZERO
    } else {
        Duration::from_secs(2)
    };
    limit.saturating_add(grace)
}

/// Aborts a task when dropped: the timeout watchdog ends with the job's run, however it ends.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The failure of a job whose worker ran past its timeout `limit`.
pub(crate) fn timed_out(job: &Job, limit: Duration) -> JobError {
    JobError::new(
        crate::error::JOB_TIMEOUT,
        format!(
            "{} ran past its timeout of {} s and was cancelled",
            clip(job.worker_class(), NAME_CHARS),
            limit.as_secs_f64()
        ),
    )
}

/// The failure of a job no worker is registered for: Ruby's `NameError` for a class it cannot load.
pub(crate) fn unknown_class(class: &str) -> JobError {
    JobError::new(
        "NameError",
        format!(
            "uninitialized constant {class}: no Rust worker is registered for {class} in \
             this oxidekiq process; register one, or route {class} to a queue only Ruby \
             processes read (sidekiq_options queue: \"...\")"
        ),
    )
}

/// An ActiveJob job's decoded `arguments` and ids (`None` for a plain job), or the `ArgumentError`
/// that fails a job whose ActiveJob arguments do not decode, before its worker runs.
pub(crate) fn activejob_of(job: &Job) -> std::result::Result<Option<Arc<ActiveJobInfo>>, JobError> {
    if !job.is_activejob() {
        return Ok(None);
    }
    match crate::activejob::unwrap_job(job) {
        Ok(info) => Ok(Some(Arc::new(info))),
        Err(msg) => Err(JobError::new(
            "ArgumentError",
            format!("cannot decode ActiveJob arguments: {msg}"),
        )),
    }
}

/// Hides a Redis URL's password in every text of a failure: each is logged or stored by the retry
/// (the Web UI shows it), by the one rule the panic hook and `retry` apply too.
pub(crate) fn redact_error(error: &mut JobError) {
    error.message = crate::redact::redact_urls_in(&error.message);
    for line in &mut error.backtrace {
        *line = crate::redact::redact_urls_in(line);
    }
}

/// True when a run that failed now has no fate of its own: the shutdown deadline passed, and the
/// job is pushed back to its queue (as `Sidekiq::Shutdown`: no retry, no ack).
pub(crate) fn interrupted(shutdown: &ShutdownSignal) -> bool {
    shutdown.phase() >= crate::shutdown::Phase::Cancelled
}

/// The job's timeout: the payload's `oxidekiq_timeout` (a positive number of seconds) over the
/// worker's `timeout` option. A field of another kind is ignored, with a warning.
pub(crate) fn job_timeout(
    job: &Job,
    options: Option<&crate::job::WorkerOptions>,
) -> Option<Duration> {
    let option = options.and_then(|o| o.timeout);
    // Most payloads have no such field: the decoding noted it, so they are not decoded again (nor
    // searched: a substring search of the payload cost more than the rest of this).
    if !job.may_name_timeout() {
        return option;
    }
    let Some(v) = job
        .to_map()
        .ok()
        .and_then(|m| m.get(crate::job::TIMEOUT_FIELD).cloned())
    else {
        return option;
    };
    match v.as_f64() {
        Some(secs) if secs > 0.0 && secs.is_finite() && secs < 1e9 => {
            Some(Duration::from_secs_f64(secs))
        }
        _ => {
            tracing::warn!(value = %clip(&v.to_string(), NAME_CHARS),
                "oxidekiq_timeout is not a positive number of seconds: ignored");
            option
        }
    }
}

/// A panic's message: the `&str` or `String` it was raised with (`panic!("...")`, `unwrap`, overflow).
/// The panic's message, with any Redis URL's password hidden: it is logged (`job panicked`) and
/// becomes the job's `error_message`.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        crate::redact::redact_urls_in(s)
    } else if let Some(s) = panic.downcast_ref::<String>() {
        crate::redact::redact_urls_in(s)
    } else {
        "a panic with a non-text payload".to_string()
    }
}

/// Appends `error_class`/`error_message` to a payload that looks like a JSON object, without decoding
/// it (Ruby's `JSON.parse` keeps the last of duplicate keys, so these win); anything else stays as is.
pub(crate) fn annotate_undecoded(raw: &[u8], error: &str) -> Vec<u8> {
    annotate_error(raw, crate::error::INVALID_PAYLOAD, error)
}

/// [`annotate_undecoded`] with any error class.
fn annotate_error(raw: &[u8], class: &str, error: &str) -> Vec<u8> {
    let trimmed = raw.trim_ascii();
    if trimmed.len() < 3 || trimmed[0] != b'{' || trimmed[trimmed.len() - 1] != b'}' {
        return raw.to_vec();
    }
    let extra = format!(
        ",\"error_class\":{},\"error_message\":{}}}",
        serde_json::Value::String(class.to_string()),
        serde_json::Value::String(error.to_string())
    );
    let mut out = Vec::with_capacity(trimmed.len() + extra.len());
    out.extend_from_slice(&trimmed[..trimmed.len() - 1]);
    out.extend_from_slice(extra.as_bytes());
    out
}

// Moved from tests/fate_writes.rs: each fate written once, with its token (needs crate-internal items).
#[cfg(test)]
mod tests_fate_writes;

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts span entries and, for each event, whether a span was entered when it was logged.
    #[derive(Default)]
    struct Entries {
        depth: AtomicU64,
        enters: AtomicU64,
        events_in_span: Mutex<Vec<bool>>,
    }

    struct Counting(Arc<Entries>);

    impl tracing::Subscriber for Counting {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, _: &tracing::Event<'_>) {
            let entered = self.0.depth.load(Ordering::Relaxed) > 0;
            self.0.events_in_span.lock().unwrap().push(entered);
        }
        fn enter(&self, _: &tracing::span::Id) {
            self.0.depth.fetch_add(1, Ordering::Relaxed);
            self.0.enters.fetch_add(1, Ordering::Relaxed);
        }
        fn exit(&self, _: &tracing::span::Id) {
            self.0.depth.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Logs from its drop (as a worker's guard may when the shutdown drops the job).
    struct LogsOnDrop;

    impl Drop for LogsOnDrop {
        fn drop(&mut self) {
            tracing::info!("dropped");
        }
    }

    /// The job's span is entered for each poll of its run (its lines carry the job's fields), and for
    /// the drop of a run that never finished (its drop's lines too), but not once more to drop a run
    /// that finished, as `Instrumented` did for every job.
    #[test]
    fn a_run_is_polled_in_its_span_and_a_finished_one_is_not_entered_again() {
        let entries = Arc::new(Entries::default());
        tracing::subscriber::with_default(Counting(entries.clone()), || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            let span = tracing::info_span!("job");
            // Two polls: it yields once.
            rt.block_on(async {
                in_span!(&span, async {
                    tracing::info!("start");
                    tokio::task::yield_now().await;
                    tracing::info!("done");
                })
            });
            assert_eq!(
                entries.enters.load(Ordering::Relaxed),
                2,
                "one entry a poll"
            );
            assert_eq!(entries.depth.load(Ordering::Relaxed), 0);
            // Dropped while pending: its drop runs in the span.
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let span_ref = &span;
            let pending = async move {
                in_span!(span_ref, async move {
                    let _guard = LogsOnDrop;
                    let _ = rx.await;
                })
            };
            rt.block_on(async {
                let mut pending = std::pin::pin!(pending);
                assert!(futures_poll_once(pending.as_mut()).await.is_pending());
            });
            drop(tx);
            assert_eq!(entries.depth.load(Ordering::Relaxed), 0);
            assert_eq!(*entries.events_in_span.lock().unwrap(), [true, true, true]);
        });
    }

    /// Polls `f` once.
    async fn futures_poll_once<F: std::future::Future>(
        mut f: std::pin::Pin<&mut F>,
    ) -> std::task::Poll<F::Output> {
        std::future::poll_fn(|cx| std::task::Poll::Ready(f.as_mut().poll(cx))).await
    }

    /// A worker's `timeout` of `Duration::MAX` (no practical limit) must not overflow the watchdog's
    /// delay: the overflow panicked in the watchdog task.
    #[test]
    fn the_watchdog_delay_of_the_longest_timeout_does_not_overflow() {
        assert_eq!(watchdog_delay(Duration::MAX, false), Duration::MAX);
        assert_eq!(watchdog_delay(Duration::MAX, true), Duration::MAX);
        assert_eq!(
            watchdog_delay(Duration::from_secs(1), false),
            Duration::from_secs(3)
        );
    }

    #[test]
    fn oversized_objects_get_the_error_appended_and_keep_their_bytes() {
        let out = annotate_undecoded(br#"{"class":"A","args":[1]}"#, "too big");
        assert_eq!(
            out,
            br#"{"class":"A","args":[1],"error_class":"Oxidekiq::InvalidPayload","error_message":"too big"}"#
        );
        assert_eq!(annotate_undecoded(b"[1]", "x"), b"[1]");
    }
}

/// The handler in the worker's place for a job refused before its worker runs (no worker for its
/// class, ActiveJob arguments that do not decode), run behind the built-in until-executed stage only:
/// it fails with the refusal (a second call, which nothing makes, with a `RuntimeError`), so the
/// job's lock is settled with its fate as for any failure.
#[derive(Debug)]
struct RefusedJobHandler(std::sync::Mutex<Option<JobError>>);

impl crate::middleware::Handler for RefusedJobHandler {
    fn call<'a>(&'a self, _: &'a JobContext) -> crate::middleware::BoxFuture<'a, JobResult> {
        let refused = match self.0.lock() {
            Ok(mut r) => r.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        Box::pin(async move {
            Err(refused.unwrap_or_else(|| JobError::new("RuntimeError", "job refused twice")))
        })
    }
}
