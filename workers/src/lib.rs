//! This application's Rust workers, written against oxidekiq's public API only, as a Rails team's own
//! crate would be. Each one's Ruby twin is shown in its doc comment: same class name, same arguments.

use std::time::Duration;

use oxidekiq::continuable::{Continuable, ContinuableWorker, ContinuationOptions, Step, StepDef};
use oxidekiq::error::JobResult;
use oxidekiq::iterable::{Enumerator, Iterable, IterableWorker};
use oxidekiq::middleware::Keyed;
use oxidekiq::middleware::sequential::SequentialJob;
use oxidekiq::middleware::unique::UniqueJob;
use oxidekiq::{Blocking, BlockingWorker, JobContext, JobError, Registry, Worker};
use serde::Deserialize;

/// ```ruby
/// class HardWorker
///   include Sidekiq::Worker
///   def perform(name, count)
///     raise ArgumentError, "count must not be negative" if count < 0
///     sleep(count / 1000.0)
///   end
/// end
/// ```
#[derive(Debug, Default)]
pub struct HardWorker;

impl Worker for HardWorker {
    const CLASS: &'static str = "HardWorker";
    type Args = (String, i64);

    async fn perform(&self, ctx: &JobContext, (name, count): Self::Args) -> JobResult {
        if count < 0 {
            return Err(JobError::new(
                "ArgumentError",
                format!("count must not be negative, got {count} for {name}"),
            ));
        }
        let mut shutdown = ctx.shutdown();
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(count as u64)) => {}
            // The process is past its shutdown deadline: stop; the job is pushed back to its queue.
            _ = shutdown.cancelled() => return Err(JobError::msg("interrupted by shutdown")),
        }
        tracing::debug!(name, count, "hard work done");
        Ok(())
    }
}

/// A job that does its work in a `tracing` span of its own, and may enqueue a follow-up job or fail: what
/// an OpenTelemetry trace through a Rust run looks like (docs/tracing.md).
///
/// ```ruby
/// class TracedJob
///   include Sidekiq::Job
///   def perform(step, enqueue_to, fail)
///     tracer.in_span(step) do
///       if enqueue_to&.start_with?("activejob:")
///         TracedChild.set(queue: enqueue_to.delete_prefix("activejob:")).perform_later(step)
///       elsif enqueue_to
///         Sidekiq::Client.push("class" => "TracedChild", "queue" => enqueue_to, "args" => [step])
///       end
///       raise "asked to fail" if fail
///     end
///   end
/// end
/// ```
#[derive(Debug, Default)]
pub struct TracedJob;

impl Worker for TracedJob {
    const CLASS: &'static str = "TracedJob";
    type Args = (String, Option<String>, bool);

    async fn perform(&self, ctx: &JobContext, (step, enqueue_to, fail): Self::Args) -> JobResult {
        use tracing::Instrument as _;
        let span = tracing::info_span!("step", name = %step);
        async {
            tracing::info!(step = %step, "step ran");
            let client = oxidekiq::Client::new(ctx.redis());
            let pushed = match enqueue_to.as_deref().map(|q| q.split_once("activejob:")) {
                None => Ok(String::new()),
                // `activejob:<queue>`: an ActiveJob job, `TracedChild.perform_later(step)`.
                Some(Some(("", queue))) => {
                    let args = vec![serde_json::Value::String(step.clone())];
                    client.perform_later("TracedChild", queue, args).await
                }
                Some(_) => {
                    let queue = enqueue_to.unwrap_or_default();
                    let job = oxidekiq::NewJob::new("TracedChild", (step.clone(),)).queue(queue);
                    client.push(job).await
                }
            };
            pushed.map_err(|e| JobError::msg(e.to_string()))?;
            if fail {
                return Err(JobError::new("RuntimeError", "asked to fail"));
            }
            Ok(())
        }
        .instrument(span)
        .await
    }
}

/// ```ruby
/// class NoopJob
///   include Sidekiq::Worker
///   def perform(*args); end
/// end
/// ```
#[derive(Debug, Default)]
pub struct NoopJob;

impl Worker for NoopJob {
    const CLASS: &'static str = "NoopJob";
    type Args = Vec<serde_json::Value>;

    async fn perform(&self, _ctx: &JobContext, _args: Self::Args) -> JobResult {
        Ok(())
    }
}

/// The options hash of [`WelcomeEmailJob`]: `perform(user_id, options = {})`.
#[derive(Debug, Default, Deserialize, PartialEq)]
pub struct WelcomeOptions {
    /// The mail's locale.
    #[serde(default)]
    pub locale: Option<String>,
}

/// An ActiveJob job:
///
/// ```ruby
/// class WelcomeEmailJob < ApplicationJob
///   queue_as :mailers
///   def perform(user_id, options = {}); end
/// end
/// ```
#[derive(Debug, Default)]
pub struct WelcomeEmailJob;

impl Worker for WelcomeEmailJob {
    const CLASS: &'static str = "WelcomeEmailJob";
    type Args = WelcomeArgs;

    async fn perform(&self, ctx: &JobContext, args: Self::Args) -> JobResult {
        let aj = ctx.activejob();
        tracing::info!(
            user_id = args.0,
            locale = args.1.locale.as_deref().unwrap_or("en"),
            job_id = aj.map(|a| a.job_id.as_str()).unwrap_or(""),
            "welcome email sent"
        );
        Ok(())
    }
}

/// `(user_id, options = {})`: the options hash may be left out, as in Ruby.
#[derive(Debug, PartialEq)]
pub struct WelcomeArgs(pub u64, pub WelcomeOptions);

impl<'de> Deserialize<'de> for WelcomeArgs {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Shape {
            Both(u64, WelcomeOptions),
            One((u64,)),
        }
        Ok(match Shape::deserialize(d)? {
            Shape::Both(id, o) => WelcomeArgs(id, o),
            Shape::One((id,)) => WelcomeArgs(id, WelcomeOptions::default()),
        })
    }
}

/// The lock TTL of the two report jobs: short, so a crashed process blocks the others for at most
/// 5 s; the lock is extended every `ttl / 3` while a report runs longer.
pub const REPORT_LOCK_TTL: Duration = Duration::from_secs(5);

/// Sleeps `seconds` (stopping early at the shutdown deadline), logging `report started` first and a
/// line with `result` at the end.
async fn report(ctx: &JobContext, seconds: f64) -> JobResult {
    let pause = Duration::try_from_secs_f64(seconds).map_err(|e| {
        JobError::new(
            "ArgumentError",
            format!("seconds must be a non-negative number, got {seconds}: {e}"),
        )
    })?;
    tracing::info!(seconds, "report started");
    let mut shutdown = ctx.shutdown();
    tokio::select! {
        _ = tokio::time::sleep(pause) => {}
        _ = shutdown.cancelled() => return Err(JobError::msg("interrupted by shutdown")),
    }
    tracing::info!(seconds, result = "generated", "report finished");
    Ok(())
}

/// A report that must not be generated twice at once: a duplicate arriving while one runs is skipped
/// (logged as `skipped duplicate` with the holder's jid).
///
/// ```ruby
/// class UniqueReportJob
///   include Sidekiq::Worker
///   def perform(seconds)
///     sleep(seconds)
///     logger.info "result"
///   end
/// end
/// ```
#[derive(Debug, Default)]
pub struct UniqueReportJob;

impl Worker for UniqueReportJob {
    const CLASS: &'static str = "UniqueReportJob";
    type Args = (f64,);

    async fn perform(&self, ctx: &JobContext, (seconds,): Self::Args) -> JobResult {
        report(ctx, seconds).await
    }
}

/// A report whose runs must never overlap: each waits for the one before (up to 60 s, then the retry
/// path), across every process.
///
/// ```ruby
/// class SequentialReportJob
///   include Sidekiq::Worker
///   def perform(seconds)
///     sleep(seconds)
///     logger.info "result"
///   end
/// end
/// ```
#[derive(Debug, Default)]
pub struct SequentialReportJob;

impl Worker for SequentialReportJob {
    const CLASS: &'static str = "SequentialReportJob";
    type Args = (f64,);

    async fn perform(&self, ctx: &JobContext, (seconds,): Self::Args) -> JobResult {
        report(ctx, seconds).await
    }
}

/// An ActiveJob job that does nothing (for benchmarks: the cost of ActiveJob's wrapping):
///
/// ```ruby
/// class NoopActiveJob < ApplicationJob
///   def perform(*args); end
/// end
/// ```
#[derive(Debug, Default)]
pub struct NoopActiveJob;

impl Worker for NoopActiveJob {
    const CLASS: &'static str = "NoopActiveJob";
    type Args = Vec<serde_json::Value>;

    async fn perform(&self, _ctx: &JobContext, _args: Self::Args) -> JobResult {
        Ok(())
    }
}

/// Benchmark probe: records how long the job waited between its `enqueued_at` and its start, in
/// seconds, by `RPUSH bench:latency <seconds>` (float-second and integer-millisecond `enqueued_at`
/// both read).
///
/// ```ruby
/// class LatencyJob
///   include Sidekiq::Worker
///   def perform(*args)
///     Sidekiq.redis { |r| r.rpush("bench:latency", Time.now.to_f - enqueued_at) }
///   end
/// end
/// ```
#[derive(Debug, Default)]
pub struct LatencyJob;

impl Worker for LatencyJob {
    const CLASS: &'static str = "LatencyJob";
    type Args = Vec<serde_json::Value>;

    async fn perform(&self, ctx: &JobContext, _args: Self::Args) -> JobResult {
        // Ruby's `Time.now.to_f`, as the enqueuer wrote `enqueued_at`.
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let enqueued = ctx.job().to_map().ok().and_then(|m| {
            m.get("enqueued_at")
                .and_then(oxidekiq::job::timestamp_seconds)
        });
        if let Some(enqueued) = enqueued {
            let mut c = ctx.redis();
            redis::cmd("RPUSH")
                .arg("bench:latency")
                .arg(started - enqueued)
                .query_async::<()>(&mut c)
                .await?;
        }
        Ok(())
    }
}

/// Benchmark probe: a no-op behind a unique lock keyed by its arguments (so distinct jobs all run).
#[derive(Debug, Default)]
pub struct UniqueNoopJob;

impl Worker for UniqueNoopJob {
    const CLASS: &'static str = "UniqueNoopJob";
    type Args = Vec<serde_json::Value>;

    async fn perform(&self, _ctx: &JobContext, _args: Self::Args) -> JobResult {
        Ok(())
    }
}

/// Benchmark probe: a no-op behind a sequential lock keyed by its arguments.
#[derive(Debug, Default)]
pub struct SequentialNoopJob;

impl Worker for SequentialNoopJob {
    const CLASS: &'static str = "SequentialNoopJob";
    type Args = Vec<serde_json::Value>;

    async fn perform(&self, _ctx: &JobContext, _args: Self::Args) -> JobResult {
        Ok(())
    }
}

/// What a [`ChaosJob`] does when it runs.
pub const CHAOS_MODES: [&str; 4] = ["ok", "sleep", "fail", "panic"];

/// The Redis hash where [`ChaosJob`] counts every start, field = its id (`HINCRBY chaos:runs <id> 1`).
pub const CHAOS_RUNS: &str = "chaos:runs";

/// The Redis hash where [`ChaosJob`] counts every successful end, field = its id.
pub const CHAOS_DONE: &str = "chaos:done";

/// Test probe for the chaos tests (`tests/binary/chaos.rs`, `tests/ruby/shared_queue.rs`): its arguments say what
/// to do, and each run is counted in Redis so a test can account for every job.
///
/// `mode` is `ok` (succeed at once), `sleep` (succeed after `sleep_ms`, or stop early at the shutdown
/// deadline and be pushed back), `block` (hold its runtime thread for `sleep_ms` with
/// `std::thread::sleep`, as a ported synchronous call would: deaf to the shutdown, so at the deadline it
/// is pushed back and its thread abandoned; `CHAOS_BLOCK_CAP_MS` caps it), `fail` (raise `ChaosError`: the retry path) or `panic`
/// (panic inside the job's task: a failure the process must turn into a retry, never strand). Every run first counts
/// itself in [`CHAOS_RUNS`]; a successful one counts itself in [`CHAOS_DONE`] last, so a job whose
/// `done` count is above one ran to its end twice.
///
/// ```ruby
/// class ChaosJob
///   include Sidekiq::Worker
///   def perform(mode, sleep_ms, id)
///     Sidekiq.redis { |c| c.hincrby("chaos:runs", id, 1) }
///     sleep(sleep_ms / 1000.0) if mode == "sleep" || mode == "block"
///     raise ChaosError, "chaos failure #{id}" if mode == "fail"
///     raise "chaos panic #{id}" if mode == "panic"
///     Sidekiq.redis { |c| c.hincrby("chaos:done", id, 1) }
///   end
/// end
/// ```
#[derive(Debug, Default)]
pub struct ChaosJob;

impl Worker for ChaosJob {
    const CLASS: &'static str = "ChaosJob";
    type Args = (String, u64, String);

    async fn perform(&self, ctx: &JobContext, (mode, sleep_ms, id): Self::Args) -> JobResult {
        let mut c = ctx.redis();
        let _: i64 = redis::cmd("HINCRBY")
            .arg(CHAOS_RUNS)
            .arg(&id)
            .arg(1)
            .query_async(&mut c)
            .await?;
        match mode.as_str() {
            "ok" => {}
            "sleep" => {
                let mut shutdown = ctx.shutdown();
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(sleep_ms)) => {}
                    _ = shutdown.cancelled() => return Err(JobError::msg("interrupted by shutdown")),
                }
            }
            // Blocks the runtime thread on purpose (no await): the control plane must not care.
            "block" => std::thread::sleep(Duration::from_millis(sleep_ms.min(block_cap_ms()))),
            "fail" => return Err(JobError::new("ChaosError", format!("chaos failure {id}"))),
            // A worker bug, on purpose: the process must treat it as this job's failure.
            "panic" => panic!("chaos panic {id}"),
            other => {
                return Err(JobError::new(
                    "ArgumentError",
                    format!("unknown chaos mode {other:?}"),
                ));
            }
        }
        let _: i64 = redis::cmd("HINCRBY")
            .arg(CHAOS_DONE)
            .arg(&id)
            .arg(1)
            .query_async(&mut c)
            .await?;
        Ok(())
    }
}

/// Test probe for synchronous work (`tests/binary/blocking.rs`), declared blocking so it runs on the blocking
/// pool: counts its run in [`CHAOS_RUNS`], holds its thread for `sleep_ms` with `std::thread::sleep`
/// (ending early once the stop's deadline passed: it is pushed back), then counts its end in
/// [`CHAOS_DONE`].
///
/// ```ruby
/// class SyncSleepJob
///   include Sidekiq::Worker
///   def perform(sleep_ms, id)
///     Sidekiq.redis { |c| c.hincrby("chaos:runs", id, 1) }
///     sleep(sleep_ms / 1000.0)
///     Sidekiq.redis { |c| c.hincrby("chaos:done", id, 1) }
///   end
/// end
/// ```
#[derive(Debug, Default)]
pub struct SyncSleepJob;

impl BlockingWorker for SyncSleepJob {
    const CLASS: &'static str = "SyncSleepJob";
    type Args = (u64, String);

    fn perform(&self, ctx: &JobContext, (sleep_ms, id): Self::Args) -> JobResult {
        let count = |hash: &'static str| {
            let mut c = ctx.redis();
            // A blocking-pool thread of the job runtime: async calls are a `block_on` away.
            tokio::runtime::Handle::current().block_on(async {
                redis::cmd("HINCRBY")
                    .arg(hash)
                    .arg(&id)
                    .arg(1)
                    .query_async::<i64>(&mut c)
                    .await
            })
        };
        count(CHAOS_RUNS)?;
        let until = std::time::Instant::now() + Duration::from_millis(sleep_ms);
        while std::time::Instant::now() < until {
            if ctx.shutdown().is_cancelled() {
                return Err(JobError::msg("interrupted by shutdown"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        count(CHAOS_DONE)?;
        Ok(())
    }
}

/// The Redis hash where [`ChaosIterJob`] counts its runs (`on_start`/`on_resume`), field = its id.
pub const CHAOS_ITER_RUNS: &str = "chaos:iter-runs";
/// The Redis hash where [`ChaosIterJob`] counts its completions (`on_complete`), field = its id.
pub const CHAOS_ITER_DONE: &str = "chaos:iter-done";

/// The list of every item a [`ChaosIterJob`] started, as `<run>:<item>`, in order.
pub fn chaos_iter_seen(id: &str) -> String {
    format!("chaos:iter-seen:{id}")
}

/// The list of the runs of a [`ChaosIterJob`] that ended cleanly (`on_stop`: completed, cancelled or
/// interrupted between two items), by run number.
pub fn chaos_iter_stops(id: &str) -> String {
    format!("chaos:iter-stops:{id}")
}

/// Test probe for the chaos test's interrupts mid-iteration: an iterable job over `0..n` (Sidekiq's
/// `array_enumerator`), each item noted in [`chaos_iter_seen`] with its run number and then slept on
/// for `sleep_ms`; its runs, clean stops and completions are counted (see the constants above).
///
/// ```ruby
/// class ChaosIterJob
///   include Sidekiq::IterableJob
///   def build_enumerator(n, sleep_ms, id, cursor:) = array_enumerator((0...n).to_a, cursor: cursor)
///   def each_iteration(item, n, sleep_ms, id)
///     Sidekiq.redis { |c| c.rpush("chaos:iter-seen:#{id}", "#{@_executions}:#{item}") }
///     sleep(sleep_ms / 1000.0)
///   end
/// end
/// ```
#[derive(Debug, Default)]
pub struct ChaosIterJob;

impl IterableWorker for ChaosIterJob {
    const CLASS: &'static str = "ChaosIterJob";
    type Args = (usize, u64, String);
    type Item = usize;
    type Cursor = usize;

    fn build_enumerator<'a>(
        &'a self,
        _ctx: &'a JobContext,
        (n, _, _): &'a Self::Args,
        cursor: Option<usize>,
    ) -> Result<Enumerator<'a, usize, usize>, JobError> {
        Ok(Enumerator::array((0..*n).collect(), cursor))
    }

    async fn each_iteration(
        &self,
        ctx: &JobContext,
        item: usize,
        (_, sleep_ms, id): &Self::Args,
    ) -> JobResult {
        let mut c = ctx.redis();
        let run: Option<i64> = redis::cmd("HGET")
            .arg(CHAOS_ITER_RUNS)
            .arg(id)
            .query_async(&mut c)
            .await?;
        let _: i64 = redis::cmd("RPUSH")
            .arg(chaos_iter_seen(id))
            .arg(format!("{}:{item}", run.unwrap_or(0)))
            .query_async(&mut c)
            .await?;
        tokio::time::sleep(Duration::from_millis(*sleep_ms)).await;
        Ok(())
    }

    async fn on_start(&self, ctx: &JobContext) -> JobResult {
        chaos_iter_count(ctx, CHAOS_ITER_RUNS).await
    }
    async fn on_resume(&self, ctx: &JobContext) -> JobResult {
        chaos_iter_count(ctx, CHAOS_ITER_RUNS).await
    }
    async fn on_stop(&self, ctx: &JobContext) -> JobResult {
        let (_, _, id): (usize, u64, String) = ctx.args()?;
        let mut c = ctx.redis();
        let run: Option<i64> = redis::cmd("HGET")
            .arg(CHAOS_ITER_RUNS)
            .arg(&id)
            .query_async(&mut c)
            .await?;
        let _: i64 = redis::cmd("RPUSH")
            .arg(chaos_iter_stops(&id))
            .arg(run.unwrap_or(0))
            .query_async(&mut c)
            .await?;
        Ok(())
    }
    async fn on_complete(&self, ctx: &JobContext) -> JobResult {
        chaos_iter_count(ctx, CHAOS_ITER_DONE).await
    }
}

/// `HINCRBY <hash> <id> 1` for a [`ChaosIterJob`].
async fn chaos_iter_count(ctx: &JobContext, hash: &str) -> JobResult {
    let (_, _, id): (usize, u64, String) = ctx.args()?;
    let mut c = ctx.redis();
    let _: i64 = redis::cmd("HINCRBY")
        .arg(hash)
        .arg(&id)
        .arg(1)
        .query_async(&mut c)
        .await?;
    Ok(())
}

/// The Redis hash where [`ChaosStepsJob`] counts its completions (its `finish` step), field = its id.
pub const CHAOS_STEPS_DONE: &str = "chaos:steps-done";

/// The list of what a [`ChaosStepsJob`] ran, in order: `<jid>:start`, `<jid>:<item>` (each item of
/// its `walk` step), `<jid>:stop` (interrupted at a checkpoint), `<jid>:finish`.
pub fn chaos_steps_seen(id: &str) -> String {
    format!("chaos:steps-seen:{id}")
}

/// Test probe for the chaos test's Rails 8.1 Continuable jobs: steps `start`, `walk` (items `0..n`,
/// cursor: the next item, each noted in [`chaos_steps_seen`] and slept on for `sleep_ms`) and
/// `finish`; resumed 1 s after an interrupt.
///
/// ```ruby
/// class ChaosStepsJob < ApplicationJob
///   include ActiveJob::Continuable
///   self.resume_options = { wait: 1.second }
///   def perform(n, sleep_ms, id)
///     step(:start) { note(id, "start") }
///     step :walk do |step|
///       (step.cursor || 0).upto(n - 1) { |i| note(id, i); sleep(sleep_ms / 1000.0); step.set!(i + 1) }
///     end
///     step(:finish) { Sidekiq.redis { |c| c.hincrby("chaos:steps-done", id, 1) }; note(id, "finish") }
///   end
/// end
/// ```
#[derive(Debug, Default)]
pub struct ChaosStepsJob;

impl ChaosStepsJob {
    async fn note(ctx: &JobContext, id: &str, what: impl std::fmt::Display) -> JobResult {
        let mut c = ctx.redis();
        let _: i64 = redis::cmd("RPUSH")
            .arg(chaos_steps_seen(id))
            .arg(format!("{}:{what}", ctx.jid()))
            .query_async(&mut c)
            .await?;
        Ok(())
    }
}

impl ContinuableWorker for ChaosStepsJob {
    const CLASS: &'static str = "ChaosStepsJob";
    type Args = (u64, u64, String);
    const STEPS: &'static [StepDef] = &[
        StepDef::new("start"),
        StepDef::new("walk"),
        StepDef::new("finish"),
    ];

    fn continuation_options(&self) -> ContinuationOptions {
        ContinuationOptions {
            resume_wait: Duration::from_secs(1),
            ..ContinuationOptions::default()
        }
    }

    async fn step(
        &self,
        ctx: &JobContext,
        (n, sleep_ms, id): &Self::Args,
        step: &mut Step,
    ) -> JobResult {
        match step.name() {
            "start" => Self::note(ctx, id, "start").await,
            "walk" => {
                for i in step.cursor()?.unwrap_or(0)..*n {
                    Self::note(ctx, id, i).await?;
                    tokio::time::sleep(Duration::from_millis(*sleep_ms)).await;
                    if let Err(e) = step.set(i + 1) {
                        Self::note(ctx, id, "stop").await?;
                        return Err(e);
                    }
                }
                Ok(())
            }
            _ => {
                let mut c = ctx.redis();
                let _: i64 = redis::cmd("HINCRBY")
                    .arg(CHAOS_STEPS_DONE)
                    .arg(id)
                    .arg(1)
                    .query_async(&mut c)
                    .await?;
                Self::note(ctx, id, "finish").await
            }
        }
    }
}

/// The longest a `block` [`ChaosJob`] holds its thread in this process: `CHAOS_BLOCK_CAP_MS` if set (the
/// chaos test's last process, which drains what is left, must not wait out long blocks), else no cap.
fn block_cap_ms() -> u64 {
    static CAP: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| {
        std::env::var("CHAOS_BLOCK_CAP_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(u64::MAX)
    })
}

/// The Redis hash where [`PeakJob`] counts its starts, field = its id.
pub const PEAK_RUNS: &str = "peak:runs";
/// The Redis hash where [`PeakJob`] counts its ends, field = its id.
pub const PEAK_DONE: &str = "peak:done";

/// The key holding how many [`PeakJob`]s of `group` run now.
pub fn peak_now(group: &str) -> String {
    format!("peak:now:{group}")
}

/// The key holding the most [`PeakJob`]s of `group` that ever ran at once.
pub fn peak_max(group: &str) -> String {
    format!("peak:max:{group}")
}

/// Test probe for capsules (`tests/ruby/capsules.rs`): counts itself running in its `group` (an atomic
/// `INCR` that also raises the group's high mark), sleeps `sleep_ms` (ending early, uncounted as done,
/// once the stop's deadline passed), then counts itself out. The high mark is what the process let run
/// at once, measured by Redis, not by a clock.
///
/// ```ruby
/// class PeakJob
///   include Sidekiq::Worker
///   def perform(group, sleep_ms, id)
///     Sidekiq.redis do |c|
///       n = c.incr("peak:now:#{group}")
///       c.set("peak:max:#{group}", n) if n > c.get("peak:max:#{group}").to_i
///       c.hincrby("peak:runs", id, 1)
///     end
///     sleep(sleep_ms / 1000.0)
///     Sidekiq.redis { |c| c.decr("peak:now:#{group}"); c.hincrby("peak:done", id, 1) }
///   end
/// end
/// ```
#[derive(Debug, Default)]
pub struct PeakJob;

/// The start of a [`PeakJob`], atomically: the count up, the high mark, the run.
const PEAK_START: &str = "local n = redis.call('INCR', KEYS[1]) \
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end \
redis.call('HINCRBY', KEYS[3], ARGV[1], 1) return n";

impl Worker for PeakJob {
    const CLASS: &'static str = "PeakJob";
    type Args = (String, u64, String);

    async fn perform(&self, ctx: &JobContext, (group, sleep_ms, id): Self::Args) -> JobResult {
        let mut c = ctx.redis();
        let _: i64 = redis::cmd("EVAL")
            .arg(PEAK_START)
            .arg(3)
            .arg(peak_now(&group))
            .arg(peak_max(&group))
            .arg(PEAK_RUNS)
            .arg(&id)
            .query_async(&mut c)
            .await?;
        let mut shutdown = ctx.shutdown();
        let interrupted = tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(sleep_ms)) => false,
            _ = shutdown.cancelled() => true,
        };
        let mut pipe = redis::pipe();
        pipe.cmd("DECR").arg(peak_now(&group)).ignore();
        if !interrupted {
            pipe.cmd("HINCRBY").arg(PEAK_DONE).arg(&id).arg(1).ignore();
        }
        pipe.query_async::<()>(&mut c).await?;
        if interrupted {
            return Err(JobError::msg("interrupted by shutdown"));
        }
        Ok(())
    }
}

/// Every worker of this application.
pub fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(HardWorker)
        .register(NoopJob)
        .register(WelcomeEmailJob)
        .register(UniqueReportJob)
        .with(UniqueJob::new().ttl(REPORT_LOCK_TTL))
        .register(SequentialReportJob)
        .with(
            SequentialJob::new()
                .ttl(REPORT_LOCK_TTL)
                .timeout(Duration::from_secs(60)),
        )
        .register(LatencyJob)
        .register(NoopActiveJob)
        .register(ChaosJob)
        .register(PeakJob)
        .register(Iterable::new(ChaosIterJob))
        .register(Continuable::new(ChaosStepsJob))
        .register(Blocking::new(SyncSleepJob))
        .register(UniqueNoopJob)
        .with(UniqueJob::new().key_by_args())
        .register(SequentialNoopJob)
        .with(SequentialJob::new().key_by_args())
        .register(TracedJob);
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use oxidekiq::testing::{self, Fate, TestJob, TestRedis};

    #[tokio::test]
    async fn hard_worker_succeeds_and_retries_a_negative_count_with_sidekiqs_backoff() {
        testing::perform(&HardWorker, ("bob", 5))
            .await
            .assert_done();
        let failed = testing::perform(&HardWorker, ("eve", -1)).await;
        assert_eq!(
            failed.assert_retry(0).message,
            "count must not be negative, got -1 for eve"
        );
        assert!(matches!(failed.fate, Fate::Retry { count: 0, .. }));
        // What Ruby could send that `(String, i64)` refuses fails as it would in production.
        let wrong = testing::perform(&HardWorker, ("bob", "5")).await;
        assert_eq!(wrong.assert_retry(0).class, "ArgumentError");
    }

    #[tokio::test]
    async fn welcome_email_job_runs_what_rails_enqueued_with_or_without_its_options() {
        let fr = include_str!("../../fixtures/activejob-6.1/mailers_queue.json");
        testing::perform_payload(&WelcomeEmailJob, fr)
            .await
            .assert_done();
        let no_options = TestJob::new(oxidekiq::NewJob::activejob(
            "WelcomeEmailJob",
            "mailers",
            vec![serde_json::json!(7)],
        ));
        no_options.perform(&WelcomeEmailJob).await.assert_done();
        // `perform_later` without a user id: Ruby's `perform` would raise ArgumentError too.
        let none = include_str!("../../fixtures/activejob-6.1/no_args.json");
        let failed = testing::perform_payload(&WelcomeEmailJob, none).await;
        assert_eq!(failed.assert_retry(0).class, "ArgumentError");
    }

    /// How many `SET` commands `redis` has run: each lock the middleware take is one `SET .. NX PX`.
    async fn sets(redis: &TestRedis) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut redis.conn())
            .await
            .unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("cmdstat_set:calls="))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |n| n.parse().unwrap())
    }

    /// The lock benchmark's probes carry their locks, and only they: `.with` applies to the class
    /// registered just before it, so a class registered between a probe and its lock took the lock
    /// (TracedJob ran sequentially and `KIND=sequential` measured an unlocked job). Each job runs
    /// through the chain `registry()` gives its class, on a Redis of the test's own.
    #[tokio::test]
    async fn the_lock_probes_hold_their_locks_and_traced_job_none() {
        let redis = TestRedis::start();
        let registry = registry().freeze().unwrap();
        let mut locks = Vec::new();
        for job in [
            TestJob::of::<UniqueNoopJob>((1,)),
            TestJob::of::<SequentialNoopJob>((1,)),
            TestJob::of::<TracedJob>(("step", None::<String>, false)),
            TestJob::of::<UniqueReportJob>((0.0,)),
            TestJob::of::<SequentialReportJob>((0.0,)),
            TestJob::of::<NoopJob>(()),
        ] {
            let before = sets(&redis).await;
            job.redis(&redis)
                .perform_chain(&registry)
                .await
                .assert_done();
            locks.push(sets(&redis).await - before);
        }
        assert_eq!(locks, [1, 1, 0, 1, 1, 0]);
    }
}
