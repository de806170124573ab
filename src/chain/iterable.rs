//! Iterable workers: Sidekiq's `Sidekiq::IterableJob` in Rust ([`IterableWorker`], registered as
//! [`Iterable`]).
//!
//! Layer: job chain (after `blocking`; it uses `worker`, `error`, `keys` and the connection only).
//!
//! A long job walks items from a cursor, one `each_iteration` per item, and keeps its progress in
//! Sidekiq 8's own `it-<jid>` hash, written exactly as 8.1.7 writes it (`docs/iterable-protocol.md`):
//! `ex` (runs started), `c` (the JSON cursor of the item about to run), `rt` (seconds of the finished
//! runs), flushed in one `MULTI` (`HSET`, `EXPIRE .. 2592000 NX`, `HGET cancelled`) at most every 5 s,
//! before an item. So Sidekiq 8's Busy page and `IterableJobQuery` show a Rust iteration's progress,
//! and Ruby resumes a Rust-started iteration (and the reverse): the cursor JSON is the contract.
//!
//! Stopping between two items (the process going quiet or stopping, or the worker's
//! [`IterableWorker::max_iteration_runtime`] spent) flushes twice as Ruby does and returns the
//! [`JobError::requeue`] error: the processor pushes the payload back to its queue with a new
//! `enqueued_at` as a fate write (in one script with the job's working entry, so no crash between two
//! steps can lose it), without a retry. A `cancelled` field (Ruby's `cancel!`, or
//! [`Client::cancel`](crate::client::Client::cancel)) seen at the start or at a flush ends the job as done: `UNLINK`, no
//! retry, no failure.
//!
//! Unlike 8.1.7, a hash holding `cancelled` but no `c` (a job cancelled before its first flush) is
//! read as a first run that is cancelled: 8.1.7 fails it with `TypeError` (`JSON.parse(nil)`) on every
//! retry until it dies, which is plainly not what its code means.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::time::Instant;

use crate::error::{JobError, JobResult};
use crate::worker::{BoxFuture, JobContext, Worker, WorkerOptions};

/// `STATE_FLUSH_INTERVAL` (`job/iterable.rb` 193): the state is flushed at most this often.
pub const STATE_FLUSH_INTERVAL: Duration = Duration::from_secs(5);
/// `STATE_TTL` (`job/iterable.rb` 196): 30 days, set once by `EXPIRE .. NX`, never extended.
pub const STATE_TTL_SECS: u64 = 30 * 24 * 60 * 60;
/// `error_class` of the requeue an interrupted iteration asks for: Ruby's exception of the same name.
pub const INTERRUPTED: &str = "Sidekiq::Job::Interrupted";

/// The `it-<jid>` hash of an iterable job's state (`iteration_key`, `job/iterable.rb` 136-138).
pub fn state_key(jid: &str) -> String {
    crate::keys::iteration(jid)
}

/// What an iterable worker's items come from: each step yields the next item and its cursor, or
/// `None` at the end. Built from an iterator ([`Enumerator::iter`], [`Enumerator::array`]) or an
/// async step ([`Enumerator::from_fn`], for a database read page by page).
pub struct Enumerator<'a, I, C> {
    /// Yields the next `(item, cursor)` pair.
    step: Box<dyn FnMut() -> Step<'a, I, C> + Send + 'a>,
}

/// One step of an [`Enumerator`]: the next `(item, cursor)` pair, `None` at the end.
pub type Step<'a, I, C> = BoxFuture<'a, Result<Option<(I, C)>, JobError>>;

impl<I, C> std::fmt::Debug for Enumerator<'_, I, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Enumerator")
    }
}

impl<'a, I: Send + 'a, C: Send + 'a> Enumerator<'a, I, C> {
    /// Items from an iterator of `(item, cursor)` pairs.
    pub fn iter<T>(iter: T) -> Self
    where
        T: IntoIterator<Item = (I, C)>,
        T::IntoIter: Send + 'a,
    {
        let mut iter = iter.into_iter();
        Enumerator {
            step: Box::new(move || {
                let next = iter.next();
                Box::pin(async move { Ok(next) })
            }),
        }
    }

    /// Items from an async step, called once per item: `Ok(None)` ends the iteration, an error fails
    /// the run (the state is flushed first, and the retry resumes at the last item's cursor).
    pub fn from_fn<F>(step: F) -> Self
    where
        F: FnMut() -> Step<'a, I, C> + Send + 'a,
    {
        Enumerator {
            step: Box::new(step),
        }
    }

    /// The next `(item, cursor)` pair.
    pub async fn next(&mut self) -> Result<Option<(I, C)>, JobError> {
        (self.step)().await
    }
}

impl<'a, T: Send + 'a> Enumerator<'a, T, usize> {
    /// Sidekiq's `array_enumerator(array, cursor:)` (`job/iterable/enumerators.rb` 20-25): the items
    /// from index `cursor` on, each with its index as cursor, so a Ruby job built on
    /// `array_enumerator` and this one resume each other.
    pub fn array(items: Vec<T>, cursor: Option<usize>) -> Self {
        Enumerator::iter(
            items
                .into_iter()
                .enumerate()
                .skip(cursor.unwrap_or(0))
                .map(|(i, t)| (t, i)),
        )
    }
}

/// A worker that walks items from a cursor, as `Sidekiq::IterableJob`; register it wrapped in
/// [`Iterable`]. The hooks are Sidekiq's (`on_start` on the first run, `on_resume` on the others,
/// `on_cancel`, `on_stop` when iteration stops for any reason but an error, `on_complete` when the
/// items are exhausted or the job was cancelled).
///
/// ```
/// use oxidekiq::iterable::{Enumerator, Iterable, IterableWorker};
/// use oxidekiq::{JobContext, JobResult, Registry};
///
/// /// Ruby: `class WalkJob; include Sidekiq::IterableJob` with
/// /// `build_enumerator(n, cursor:) = array_enumerator((0...n).to_a, cursor:)`.
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
///     async fn each_iteration(&self, _ctx: &JobContext, item: usize, _args: &Self::Args) -> JobResult {
///         tracing::info!(item, "walked");
///         Ok(())
///     }
/// }
///
/// let mut registry = Registry::new();
/// registry.register(Iterable::new(WalkJob));
/// assert_eq!(registry.classes(), ["WalkJob"]);
/// ```
pub trait IterableWorker: Send + Sync + 'static {
    /// The Ruby class name the jobs carry.
    const CLASS: &'static str;
    /// The positional arguments, deserialized from the whole `args` array.
    type Args: DeserializeOwned + Send + Sync + 'static;
    /// One item of the iteration.
    type Item: Send + 'static;
    /// Where an item stands: stored as JSON in the hash's `c`, and handed back to
    /// [`IterableWorker::build_enumerator`] on resume, which must start *with* the item at it (as
    /// every enumerator Sidekiq ships does).
    type Cursor: Serialize + DeserializeOwned + Send + Sync + 'static;

    /// Per-worker options, like Ruby's `sidekiq_options`.
    fn options(&self) -> WorkerOptions {
        WorkerOptions::default()
    }

    /// Sidekiq's `max_iteration_runtime`: a run is interrupted at the first item boundary past this
    /// long, and pushed back to its queue to resume at its cursor (`None`: no limit).
    fn max_iteration_runtime(&self) -> Option<Duration> {
        None
    }

    /// The items from `cursor` on (`None`: from the start), the item at `cursor` first.
    fn build_enumerator<'a>(
        &'a self,
        ctx: &'a JobContext,
        args: &'a Self::Args,
        cursor: Option<Self::Cursor>,
    ) -> Result<Enumerator<'a, Self::Item, Self::Cursor>, JobError>;

    /// Handles one item. An error flushes the state (the cursor at this item) and fails the run
    /// through the ordinary retry path; the retry starts with this item.
    fn each_iteration(
        &self,
        ctx: &JobContext,
        item: Self::Item,
        args: &Self::Args,
    ) -> impl Future<Output = JobResult> + Send;

    /// The first run starts.
    fn on_start(&self, _ctx: &JobContext) -> impl Future<Output = JobResult> + Send {
        async { Ok(()) }
    }
    /// A later run (a resume or a retry) starts.
    fn on_resume(&self, _ctx: &JobContext) -> impl Future<Output = JobResult> + Send {
        async { Ok(()) }
    }
    /// The job saw its cancellation.
    fn on_cancel(&self, _ctx: &JobContext) -> impl Future<Output = JobResult> + Send {
        async { Ok(()) }
    }
    /// Iteration stopped: completed, cancelled or interrupted (not on an error).
    fn on_stop(&self, _ctx: &JobContext) -> impl Future<Output = JobResult> + Send {
        async { Ok(()) }
    }
    /// Iteration completed or was cancelled; the state hash is removed next.
    fn on_complete(&self, _ctx: &JobContext) -> impl Future<Output = JobResult> + Send {
        async { Ok(()) }
    }
}

/// An [`IterableWorker`] as a [`Worker`]: `Registry::register(Iterable::new(worker))`; locks and
/// limits are added to its registration as to any worker's.
#[derive(Debug)]
pub struct Iterable<W>(Arc<W>);

impl<W: IterableWorker> Iterable<W> {
    /// Wraps `worker` for [`Registry::register`](crate::Registry::register).
    pub fn new(worker: W) -> Self {
        Iterable(Arc::new(worker))
    }
}

impl<W: IterableWorker> Worker for Iterable<W> {
    const CLASS: &'static str = W::CLASS;
    type Args = W::Args;
    // It sees `cancelled` at its flushes and ends cleanly (hooks, `UNLINK`): never dropped mid-item.
    const CHECKS_CANCEL: bool = true;

    fn options(&self) -> WorkerOptions {
        self.0.options()
    }

    async fn perform(&self, ctx: &JobContext, args: Self::Args) -> JobResult {
        run(self.0.as_ref(), ctx, &args).await
    }
}

/// The state of earlier runs, as `fetch_previous_iteration_state` reads it.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct State {
    /// `ex`: runs started before this one.
    pub executions: u64,
    /// `c`: the cursor as JSON text (`None`: absent, as after a `cancel!` of a job never flushed).
    pub cursor: Option<String>,
    /// `rt`: seconds of the finished runs (`None`: no state yet, which Ruby writes as `0`).
    pub runtime: Option<f64>,
    /// `cancelled`: set by `cancel!`.
    pub cancelled: Option<String>,
}

impl State {
    /// Reads an `HGETALL` reply. `ex` and `rt` are read as Ruby's `to_i`/`to_f` read them (leading
    /// digits, else 0), so a hash Ruby wrote or damaged reads the same here.
    pub fn from_fields(fields: &HashMap<String, String>) -> State {
        if fields.is_empty() {
            return State::default();
        }
        State {
            executions: ruby_to_i(fields.get("ex").map(String::as_str).unwrap_or("")),
            cursor: fields.get("c").cloned(),
            runtime: Some(ruby_to_f(
                fields.get("rt").map(String::as_str).unwrap_or(""),
            )),
            cancelled: fields.get("cancelled").cloned(),
        }
    }
}

/// Ruby's `String#to_i` for a count: the leading decimal digits, 0 when none (or negative).
fn ruby_to_i(s: &str) -> u64 {
    let digits: String = s
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().unwrap_or(0)
}

/// Ruby's `String#to_f`: the longest leading float (`[+-]digits[.digits][e[+-]digits]`), 0.0 when
/// none, found in one pass: the field comes from Redis, and may be megabytes of a damaged hash.
fn ruby_to_f(s: &str) -> f64 {
    let b = s.trim_start().as_bytes();
    let digits = |from: usize| from + b[from..].iter().take_while(|c| c.is_ascii_digit()).count();
    let mut i = usize::from(matches!(b.first(), Some(b'+' | b'-')));
    let int_end = digits(i);
    let mut end = if int_end > i { int_end } else { 0 };
    i = int_end;
    if b.get(i) == Some(&b'.') {
        let frac_end = digits(i + 1);
        if frac_end > i + 1 || end > 0 {
            end = frac_end;
        }
        i = frac_end;
    }
    if end > 0 && matches!(b.get(i), Some(b'e' | b'E')) {
        let sign = usize::from(matches!(b.get(i + 1), Some(b'+' | b'-')));
        let exp_end = digits(i + 1 + sign);
        if exp_end > i + 1 + sign {
            end = exp_end;
        }
    }
    std::str::from_utf8(&b[..end])
        .ok()
        .and_then(|t| t.parse::<f64>().ok())
        .filter(|f| f.is_finite())
        .unwrap_or(0.0)
}

/// A float as Ruby's `Float#to_s` prints it (`15.54943187400022`, `2.0`, `8.0e-05`): the shortest
/// text that reads back, with `.0` on whole numbers, in exponent form (`<mantissa>e<sign><2+ digits>`)
/// below 1e-4 and from 1e15 on, as Ruby switches (a run interrupted within 0.1 ms has such an `rt`).
pub fn ruby_float(f: f64) -> String {
    if !f.is_finite() {
        return format!("{f}");
    }
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if f == 0.0 || (-4..15).contains(&exp) {
        return if f.fract() == 0.0 {
            format!("{f:.1}")
        } else {
            format!("{f}")
        };
    }
    let dot = if mantissa.contains('.') { "" } else { ".0" };
    let sign = if exp < 0 { '-' } else { '+' };
    format!("{mantissa}{dot}e{sign}{:02}", exp.unsigned_abs())
}

/// `cancel!` (`client.rb` 61-75), the commands Ruby sends, pipelined (not a transaction).
pub(crate) async fn cancel(conn: &mut crate::worker::Conn, jid: &str) -> crate::Result<i64> {
    let key = state_key(jid);
    let now = chrono::Utc::now().timestamp();
    let (first,): (Option<String>,) = redis::pipe()
        .cmd("HSETNX")
        .arg(&key)
        .arg("cancelled")
        .arg(now)
        .ignore()
        .cmd("HGET")
        .arg(&key)
        .arg("cancelled")
        .cmd("EXPIRE")
        .arg(&key)
        .arg(STATE_TTL_SECS)
        .arg("NX")
        .ignore()
        .query_async(conn)
        .await?;
    // Ruby's `result.to_i`.
    Ok(first.map_or(0, |t| ruby_to_i(&t) as i64))
}

/// How a run's loop ended.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Outcome {
    Completed,
    Cancelled,
    Interrupted,
}

/// One run of an iterable job (`Iterable#perform`, `job/iterable.rb` 141-242).
async fn run<W: IterableWorker>(w: &W, ctx: &JobContext, args: &W::Args) -> JobResult {
    let key = state_key(ctx.jid());
    let mut conn = ctx.redis();
    let fields: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .map_err(|e| state_error(&key, "read", e))?;
    let state = State::from_fields(&fields);
    let executions = state.executions.saturating_add(1);
    let start = Instant::now();
    let resume_at: Option<W::Cursor> = match state.cursor.as_deref() {
        None => None,
        Some(text) => serde_json::from_str(text).map_err(|e| {
            JobError::new(
                "JSON::ParserError",
                format!(
                    "the cursor in {key} (c = {text:?}) does not read as the worker's cursor: {e}"
                ),
            )
        })?,
    };
    let mut flusher = Flusher {
        key: &key,
        conn,
        executions,
        runtime: state.runtime,
    };
    let mut items = w.build_enumerator(ctx, args, resume_at)?;
    // The cursor of the item about to run: set by each item, flushed as `c`.
    let mut cursor: Option<W::Cursor> = None;
    if executions == 1 {
        w.on_start(ctx).await?;
    } else {
        w.on_resume(ctx).await?;
    }
    let outcome = iterate(w, ctx, args, &mut items, &mut cursor, &mut flusher, start).await;
    // Ruby's `ensure`: the run's time counts on every way out of the loop.
    let elapsed = start.elapsed().as_secs_f64();
    flusher.runtime = Some(flusher.runtime.unwrap_or(0.0) + elapsed);
    let outcome = outcome?;
    w.on_stop(ctx).await?;
    match outcome {
        Outcome::Completed | Outcome::Cancelled => {
            w.on_complete(ctx).await?;
            redis::cmd("UNLINK")
                .arg(&key)
                .query_async::<i64>(&mut flusher.conn)
                .await
                .map_err(|e| state_error(&key, "remove", e))?;
            tracing::debug!(
                executions,
                runtime = format_args!("{:.3}", flusher.runtime.unwrap_or(0.0)),
                cancelled = outcome == Outcome::Cancelled,
                "iteration completed"
            );
            Ok(())
        }
        Outcome::Interrupted => {
            flusher.flush(&cursor).await?;
            Err(JobError::new(
                INTERRUPTED,
                format!(
                    "iteration interrupted at cursor {}: pushed back to its queue to resume there",
                    cursor_json(&cursor)
                ),
            )
            .requeue())
        }
    }
}

/// `iterate_with_enumerator` (`job/iterable.rb` 198-239), without the `ensure` (the caller's).
async fn iterate<W: IterableWorker>(
    w: &W,
    ctx: &JobContext,
    args: &W::Args,
    items: &mut Enumerator<'_, W::Item, W::Cursor>,
    cursor: &mut Option<W::Cursor>,
    flusher: &mut Flusher<'_>,
    start: Instant,
) -> Result<Outcome, JobError> {
    let cancelled: Option<String> = redis::cmd("HGET")
        .arg(flusher.key)
        .arg("cancelled")
        .query_async(&mut flusher.conn)
        .await
        .map_err(|e| state_error(flusher.key, "read", e))?;
    if cancelled.is_some() {
        w.on_cancel(ctx).await?;
        tracing::info!("job cancelled");
        return Ok(Outcome::Cancelled);
    }
    let max_runtime = w.max_iteration_runtime();
    let shutdown = ctx.shutdown();
    let mut flushed_at = Instant::now();
    while let Some((item, at)) = items.next().await? {
        *cursor = Some(at);
        // Ruby's `@done` is set when the process goes quiet (TSTP, or TERM before its wait).
        let interrupt = shutdown.is_quiet() || max_runtime.is_some_and(|m| start.elapsed() > m);
        if interrupt || flushed_at.elapsed() >= STATE_FLUSH_INTERVAL {
            let cancelled = flusher.flush(cursor).await?;
            flushed_at = Instant::now();
            if cancelled {
                w.on_cancel(ctx).await?;
                tracing::info!("job cancelled");
                return Ok(Outcome::Cancelled);
            }
        }
        if interrupt {
            return Ok(Outcome::Interrupted);
        }
        if let Err(e) = w.each_iteration(ctx, item, args).await {
            // Ruby's `rescue Exception; flush_state; raise`: the retry starts at this item. A failed
            // flush is logged; the item's own error is the one the retry records.
            if let Err(flush) = flusher.flush(cursor).await {
                tracing::error!(error = %flush, "cannot flush the iteration state after a failed item");
            }
            return Err(e);
        }
    }
    Ok(Outcome::Completed)
}

/// Writes the state as `flush_state` does (`job/iterable.rb` 281-296).
struct Flusher<'k> {
    /// `it-<jid>`.
    key: &'k str,
    /// The jobs' connection.
    conn: crate::worker::Conn,
    /// `ex`, this run counted.
    executions: u64,
    /// `rt` as the next flush writes it.
    runtime: Option<f64>,
}

impl Flusher<'_> {
    /// `MULTI; HSET ex c rt; EXPIRE 2592000 NX; HGET cancelled; EXEC`: true when `cancelled` is set.
    async fn flush<C: Serialize>(&mut self, cursor: &Option<C>) -> Result<bool, JobError> {
        let rt = match self.runtime {
            // Ruby's `@_runtime` starts as the Integer 0 and turns Float once a run's time is added.
            None => "0".to_string(),
            Some(f) => ruby_float(f),
        };
        let (cancelled,): (Option<String>,) = redis::pipe()
            .atomic()
            .cmd("HSET")
            .arg(self.key)
            .arg("ex")
            .arg(self.executions)
            .arg("c")
            .arg(cursor_json(cursor))
            .arg("rt")
            .arg(rt)
            .ignore()
            .cmd("EXPIRE")
            .arg(self.key)
            .arg(STATE_TTL_SECS)
            .arg("NX")
            .ignore()
            .cmd("HGET")
            .arg(self.key)
            .arg("cancelled")
            .query_async(&mut self.conn)
            .await
            .map_err(|e| state_error(self.key, "write", e))?;
        Ok(cancelled.is_some())
    }
}

/// `Sidekiq.dump_json(@_cursor)`: `null` before the first item.
fn cursor_json<C: Serialize>(cursor: &Option<C>) -> String {
    serde_json::to_string(cursor).unwrap_or_else(|_| "null".to_string())
}

/// A failed read or write of the state hash, naming the key: a job failure (the retry path).
fn state_error(key: &str, what: &str, e: redis::RedisError) -> JobError {
    JobError::new(
        "Redis::CommandError",
        format!("cannot {what} the iteration state {key} (a hash): {e}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtimes_print_as_ruby_floats() {
        assert_eq!(ruby_float(0.0), "0.0");
        assert_eq!(ruby_float(2.0), "2.0");
        assert_eq!(ruby_float(15.54943187400022), "15.54943187400022");
        assert_eq!(ruby_to_f("15.5abc"), 15.5);
        assert_eq!(ruby_to_f(""), 0.0);
        assert_eq!(ruby_to_i("3"), 3);
        assert_eq!(ruby_to_i("x"), 0);
    }

    /// `rt` byte for byte as Ruby's `Float#to_s` writes it, computed by Ruby in the same run: a run
    /// of under 0.1 ms is `8.0e-05` in Ruby, not `0.00008`.
    #[test]
    fn runtimes_print_as_ruby_prints_them_at_every_magnitude() {
        let values = [
            0.0,
            2.0,
            0.5,
            15.54943187400022,
            0.0001,
            0.00012345,
            0.00008,
            1.0e-5,
            3.3e-7,
            1e15,
            1e16,
            1.2345678901234568e17,
        ];
        let list: Vec<String> = values.iter().map(|v| format!("{v:e}")).collect();
        let out = std::process::Command::new("ruby")
            .arg("-e")
            .arg(format!("puts [{}].map(&:to_s)", list.join(",")))
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let ruby: Vec<String> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect();
        let ours: Vec<String> = values.iter().map(|v| ruby_float(*v)).collect();
        assert_eq!(ours, ruby);
    }

    /// `rt` comes from Redis: a damaged one of 2 MB of digits must read in one pass (the reader tried
    /// every prefix, from the longest, each parse reading it whole: hours on a runtime thread).
    #[test]
    fn a_huge_runtime_field_reads_in_one_pass() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let huge = format!("{}x", "1".repeat(2_000_000));
            let _ = tx.send(ruby_to_f(&huge));
        });
        let v = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("ruby_to_f of 2 MB did not return within 60 s");
        assert!(v == 0.0 || v.is_finite(), "{v}");
    }

    /// Ruby's `String#to_f` on what an `rt` field may hold, computed by Ruby in the same run.
    #[test]
    fn runtimes_read_as_ruby_reads_them() {
        let inputs = [
            "15.5abc",
            "",
            "  2.5",
            "-3e2x",
            ".5",
            "5.",
            "1e",
            "abc",
            "+4.25e-1z",
            "8.0e-05",
            "7",
        ];
        let quoted: Vec<String> = inputs.iter().map(|s| format!("{s:?}")).collect();
        let out = std::process::Command::new("ruby")
            .arg("-e")
            .arg(format!("puts [{}].map(&:to_f)", quoted.join(",")))
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let ruby: Vec<f64> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        let ours: Vec<f64> = inputs.iter().map(|s| ruby_to_f(s)).collect();
        assert_eq!(ours, ruby, "{inputs:?}");
    }

    #[test]
    fn a_hash_with_only_cancelled_reads_as_a_cancelled_first_run() {
        let mut f = HashMap::new();
        f.insert("cancelled".to_string(), "1795606678".to_string());
        let s = State::from_fields(&f);
        assert_eq!(s.executions, 0);
        assert_eq!(s.cursor, None);
        assert!(s.cancelled.is_some());
    }

    #[tokio::test]
    async fn the_array_enumerator_resumes_with_the_item_at_its_cursor() {
        let mut e = Enumerator::array(vec!['a', 'b', 'c'], Some(1));
        assert_eq!(e.next().await.unwrap(), Some(('b', 1)));
        assert_eq!(e.next().await.unwrap(), Some(('c', 2)));
        assert_eq!(e.next().await.unwrap(), None);
    }
}
