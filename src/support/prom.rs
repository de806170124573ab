//! Prometheus metrics of the process, served by [`crate::http`] at `GET /metrics`.
//!
//! The exposition format is written by `prometheus-client` (the Prometheus project's Rust client, in
//! its OpenMetrics text form, which Prometheus scrapes natively). Names follow Prometheus' conventions:
//! an `oxidekiq_` prefix, `_total` on counters, base units (`_seconds`).
//!
//! The counters live in one process-wide registry, as the default registries of the Go and Ruby
//! clients do: a process runs one launcher, and a hook is then a one-line call from the code path
//! that already exists (the job's end, its fate, a fetch, a lock attempt) with no handle to thread
//! through. Cost per job: one read of the per-(class, queue) handle cache (a read lock and a hash
//! lookup, what one labelled-counter lookup costs; the entry is made on a class's first job), then
//! atomic adds for the processed and failed counters and the duration histogram, whose buckets are
//! atomics too (prometheus-client's own histogram takes a mutex per observation).
//!
//! Queue sizes and latency, busy slots and the concurrency are not counted per job ([`Gauges`]):
//! busy slots and the concurrency are read at the scrape, the queues once per beat interval (by the
//! queue gauges task of the operations layer, which stores them here).
//!
//! The registry sits in the support layer at the bottom of the ladder (docs/layout.md): it uses only
//! [`crate::error`], so every layer that counts something reaches down to it, never up.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, RwLock};
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::{Registry, Unit};

use crate::error::{Fate, JobError};

/// Upper bounds, in seconds, of the job duration histogram: 5 ms to 5 min, roughly the span of
/// Sidekiq's own Metrics-tab histogram (`histogram.rb`, 20 ms .. 335 s).
const DURATION_BOUNDS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Upper bounds of the fetch batch-size histogram (jobs per fetch round).
const BATCH_BOUNDS: [f64; 9] = [0.0, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0];

/// At most this many classes get series of their own; the jobs of any further class are counted
/// under [`OTHER_CLASS`]. Class names come from payloads, so a stream of made-up classes must not
/// grow the process (or the Prometheus server) without bound.
pub(crate) const MAX_CLASSES: usize = 1000;

/// A class name longer than this is counted under [`OTHER_CLASS`] too.
pub(crate) const MAX_CLASS_LEN: usize = 200;

/// The `class` label of jobs past [`MAX_CLASSES`] or [`MAX_CLASS_LEN`].
pub(crate) const OTHER_CLASS: &str = "(other)";

/// Label set `{class, queue}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ClassQueue {
    /// The job's class (the wrapped class for ActiveJob, as on Sidekiq's Metrics tab).
    pub class: String,
    /// The queue it was fetched from.
    pub queue: String,
}

/// Label set `{class}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ClassLabel {
    /// The job's class.
    pub class: String,
}

/// Label set `{class, strategy}` (sidekiq-unique-jobs conflicts).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ClassStrategy {
    /// The job's class.
    pub class: String,
    /// The gem's `on_conflict` server strategy (`none`, `log`, `reject`, `reschedule`, `raise`,
    /// `replace`), or `lost` for a job whose lock another job holds.
    pub strategy: String,
}

/// Label set `{queue}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct QueueLabel {
    /// The queue.
    pub queue: String,
}

/// Label set `{capsule}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct CapsuleLabel {
    /// The capsule's name (`default` for `-c`/`-q`'s).
    pub capsule: String,
}

/// A histogram with fixed bounds whose observation is a few atomic adds (no lock).
#[derive(Debug, Clone)]
pub(crate) struct AtomicHistogram {
    inner: Arc<HistogramInner>,
}

#[derive(Debug)]
struct HistogramInner {
    bounds: &'static [f64],
    /// One count per bound, plus +Inf.
    counts: Vec<AtomicU64>,
    /// Sum of observations, in millionths of the unit.
    sum_micros: AtomicU64,
}

impl AtomicHistogram {
    /// A histogram with these upper bounds (ascending); +Inf is added.
    pub(crate) fn new(bounds: &'static [f64]) -> Self {
        AtomicHistogram {
            inner: Arc::new(HistogramInner {
                bounds,
                counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
                sum_micros: AtomicU64::new(0),
            }),
        }
    }

    /// Counts one observation.
    pub(crate) fn observe(&self, v: f64) {
        let i = self
            .inner
            .bounds
            .iter()
            .position(|b| v <= *b)
            .unwrap_or(self.inner.bounds.len());
        if let Some(c) = self.inner.counts.get(i) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        let micros = (v.max(0.0) * 1e6) as u64;
        self.inner.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }
}

impl TypedMetric for AtomicHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for AtomicHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), fmt::Error> {
        // prometheus-client takes per-bucket counts and writes them cumulatively; the last bound is +Inf.
        let buckets: Vec<(f64, u64)> = self
            .inner
            .bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(self.inner.counts.iter().map(|c| c.load(Ordering::Relaxed)))
            .collect();
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = self.inner.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// The per-class cache: class → the handles of each queue its jobs came from.
type HandleCache = foldhash::HashMap<Box<str>, Vec<(Box<str>, JobHandles)>>;

type HistogramFamily<L> = Family<L, AtomicHistogram, fn() -> AtomicHistogram>;

/// The handles one (class, queue) pair's jobs update.
#[derive(Debug, Clone)]
struct JobHandles {
    processed: Counter,
    failed: Counter,
    duration: AtomicHistogram,
}

/// Every metric of the process.
#[derive(Debug)]
pub(crate) struct Metrics {
    registry: Registry,
    processed: Family<ClassQueue, Counter>,
    failed: Family<ClassQueue, Counter>,
    duration: HistogramFamily<ClassLabel>,
    retried: Family<ClassLabel, Counter>,
    dead: Family<ClassLabel, Counter>,
    discarded: Family<ClassLabel, Counter>,
    rescheduled: Family<ClassLabel, Counter>,
    requeued: Family<ClassLabel, Counter>,
    past_timeout: Family<ClassLabel, Counter>,
    handed_off: Family<ClassLabel, Counter>,
    unique_conflicts: Family<ClassStrategy, Counter>,
    pushed_back: Counter,
    fate_write_failures: Counter,
    fates_stuck: Gauge,
    fetches: Counter,
    fetch_batch: AtomicHistogram,
    redis_errors: Counter,
    redis_reconnects: Counter,
    master_switches: Counter,
    locks_acquired: Counter,
    locks_contended: Counter,
    locks_lost: Counter,
    busy: Gauge,
    concurrency: Gauge,
    capsule_busy: Family<CapsuleLabel, Gauge>,
    capsule_concurrency: Family<CapsuleLabel, Gauge>,
    queue_size: Family<QueueLabel, Gauge>,
    queue_latency: Family<QueueLabel, Gauge<f64, AtomicU64>>,
    last_beat_age: Gauge<f64, AtomicU64>,
    /// Handles by class, then queue: a class's jobs come from a handful of queues.
    cache: RwLock<HandleCache>,
    /// Epoch milliseconds of the last heartbeat that reached Redis (0: none yet).
    last_beat_ms: AtomicU64,
    /// Why the latest job whose fate write is stuck could not write it (for `/ready`).
    stuck_reason: std::sync::Mutex<String>,
}

/// One job whose fate write fails for a reason other than an outage, while it waits: counted in
/// `oxidekiq_fates_stuck` (and so in `/ready`) until dropped.
#[derive(Debug)]
pub(crate) struct StuckFate(());

impl Drop for StuckFate {
    fn drop(&mut self) {
        metrics().fates_stuck.dec();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn duration_histogram() -> AtomicHistogram {
    AtomicHistogram::new(&DURATION_BOUNDS)
}

impl Metrics {
    /// A fresh set of metrics, registered under their names.
    pub(crate) fn new() -> Self {
        let mut registry = Registry::with_prefix("oxidekiq");
        let processed = Family::<ClassQueue, Counter>::default();
        let failed = Family::<ClassQueue, Counter>::default();
        let duration: HistogramFamily<ClassLabel> =
            Family::new_with_constructor(duration_histogram as fn() -> AtomicHistogram);
        let retried = Family::<ClassLabel, Counter>::default();
        let dead = Family::<ClassLabel, Counter>::default();
        let discarded = Family::<ClassLabel, Counter>::default();
        let rescheduled = Family::<ClassLabel, Counter>::default();
        let m = Metrics {
            processed,
            failed,
            duration,
            retried,
            dead,
            discarded,
            rescheduled,
            requeued: Family::default(),
            past_timeout: Family::default(),
            handed_off: Family::default(),
            unique_conflicts: Family::default(),
            pushed_back: Counter::default(),
            fate_write_failures: Counter::default(),
            fates_stuck: Gauge::default(),
            fetches: Counter::default(),
            fetch_batch: AtomicHistogram::new(&BATCH_BOUNDS),
            redis_errors: Counter::default(),
            redis_reconnects: Counter::default(),
            master_switches: Counter::default(),
            locks_acquired: Counter::default(),
            locks_contended: Counter::default(),
            locks_lost: Counter::default(),
            busy: Gauge::default(),
            concurrency: Gauge::default(),
            capsule_busy: Family::default(),
            capsule_concurrency: Family::default(),
            queue_size: Family::default(),
            queue_latency: Family::default(),
            last_beat_age: Gauge::default(),
            cache: RwLock::default(),
            last_beat_ms: AtomicU64::new(0),
            stuck_reason: std::sync::Mutex::default(),
            registry: Registry::default(),
        };
        let r = &mut registry;
        r.register(
            "jobs_processed",
            "Jobs run (successful or not), by class and queue, as Sidekiq's processed count",
            m.processed.clone(),
        );
        r.register(
            "jobs_failed",
            "Jobs that raised, by class and queue (a reschedule by a limit is no failure)",
            m.failed.clone(),
        );
        r.register_with_unit(
            "job_duration",
            "Time jobs took, by class",
            Unit::Seconds,
            m.duration.clone(),
        );
        r.register(
            "jobs_retried",
            "Failed jobs put in the retry set",
            m.retried.clone(),
        );
        r.register("jobs_dead", "Jobs moved to the dead set", m.dead.clone());
        r.register(
            "jobs_discarded",
            "Failed jobs dropped on purpose (retry: false, dead: false, discard)",
            m.discarded.clone(),
        );
        r.register(
            "jobs_rescheduled",
            "Jobs put back in the schedule set by a limit (rate, concurrency, lock)",
            m.rescheduled.clone(),
        );
        r.register(
            "jobs_requeued",
            "Iterable jobs interrupted between two items and pushed back to their queue to resume",
            m.requeued.clone(),
        );
        r.register(
            "jobs_past_timeout",
            "Jobs still running past their timeout: stuck in synchronous code, which cannot be cancelled",
            m.past_timeout.clone(),
        );
        r.register(
            "jobs_handed_off",
            "Jobs pushed unchanged to the --handoff queue (no Rust worker, or a Ruby-side contract)",
            m.handed_off.clone(),
        );
        r.register(
            "unique_conflicts",
            "sidekiq-unique-jobs jobs not performed as they came: a conflict on the runtime lock (by \
             on_conflict strategy) or a lock held by another job (`lost`)",
            m.unique_conflicts.clone(),
        );
        r.register(
            "jobs_pushed_back",
            "Jobs handed back to their queue unfinished (shutdown, quiet, leftovers)",
            m.pushed_back.clone(),
        );
        r.register(
            "fate_write_failures",
            "Jobs whose fate (retry, dead, schedule, hand-off) could not be written for a reason other \
             than an outage (a key of the wrong type, out of memory): the job stays held and its write is \
             retried",
            m.fate_write_failures.clone(),
        );
        r.register(
            "fates_stuck",
            "Jobs waiting now for a fate write that fails for a reason other than an outage",
            m.fates_stuck.clone(),
        );
        r.register(
            "fetch_round_trips",
            "Fetch rounds sent to Redis",
            m.fetches.clone(),
        );
        r.register(
            "fetch_batch_size",
            "Jobs brought back by one fetch round",
            m.fetch_batch.clone(),
        );
        r.register(
            "redis_errors",
            "Redis commands that failed",
            m.redis_errors.clone(),
        );
        r.register(
            "redis_reconnects",
            "Connection losses after which a connection reconnects",
            m.redis_reconnects.clone(),
        );
        r.register(
            "redis_master_switches",
            "Times the connections moved to a new master named by Sentinel",
            m.master_switches.clone(),
        );
        r.register(
            "locks_acquired",
            "Lock attempts that got the lock",
            m.locks_acquired.clone(),
        );
        r.register(
            "locks_contended",
            "Lock attempts that found the lock held",
            m.locks_contended.clone(),
        );
        r.register(
            "locks_lost",
            "Held locks lost (expired or taken) before their release",
            m.locks_lost.clone(),
        );
        r.register(
            "busy",
            "Jobs running or waiting for their fate to reach Redis",
            m.busy.clone(),
        );
        r.register(
            "concurrency",
            "How many jobs may run at once, over every capsule",
            m.concurrency.clone(),
        );
        r.register(
            "capsule_busy",
            "Jobs of each capsule running or waiting for their fate to reach Redis",
            m.capsule_busy.clone(),
        );
        r.register(
            "capsule_concurrency",
            "How many jobs each capsule may run at once (its slots: a cap and a reservation)",
            m.capsule_concurrency.clone(),
        );
        r.register(
            "queue_size",
            "Jobs waiting in each queue this process serves (read at scrape)",
            m.queue_size.clone(),
        );
        r.register_with_unit(
            "queue_latency",
            "Age of the oldest job in each queue this process serves (read at scrape)",
            Unit::Seconds,
            m.queue_latency.clone(),
        );
        r.register_with_unit(
            "heartbeat_age",
            "Time since the last heartbeat reached Redis",
            Unit::Seconds,
            m.last_beat_age.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Runs `f` on the handles of (class, queue): under the cache's read lock when they exist,
    /// else after making them (a class's first job from a queue).
    fn with_handles(&self, class: &str, queue: &str, f: impl Fn(&JobHandles)) {
        if let Ok(cache) = self.cache.read()
            && let Some(by_queue) = cache.get(class)
            && let Some((_, h)) = by_queue.iter().find(|(q, _)| &**q == queue)
        {
            f(h);
            return;
        }
        let label = self.class_label(class);
        if label != class
            && let Ok(cache) = self.cache.read()
            && let Some(by_queue) = cache.get(label)
            && let Some((_, h)) = by_queue.iter().find(|(q, _)| &**q == queue)
        {
            f(h);
            return;
        }
        f(&self.make_handles(label, queue));
    }

    /// `class` itself, or [`OTHER_CLASS`] once [`MAX_CLASSES`] classes have series, or for a name
    /// longer than [`MAX_CLASS_LEN`].
    fn class_label<'a>(&self, class: &'a str) -> &'a str {
        if class.len() > MAX_CLASS_LEN {
            return OTHER_CLASS;
        }
        match self.cache.read() {
            Ok(c) if c.contains_key(class) || c.len() < MAX_CLASSES => class,
            _ => OTHER_CLASS,
        }
    }

    fn make_handles(&self, class: &str, queue: &str) -> JobHandles {
        let labels = ClassQueue {
            class: class.to_string(),
            queue: queue.to_string(),
        };
        let h = JobHandles {
            processed: self.processed.get_or_create(&labels).clone(),
            failed: self.failed.get_or_create(&labels).clone(),
            duration: self
                .duration
                .get_or_create(&ClassLabel {
                    class: class.to_string(),
                })
                .clone(),
        };
        if let Ok(mut cache) = self.cache.write() {
            let by_queue = cache.entry(class.into()).or_default();
            if !by_queue.iter().any(|(q, _)| &**q == queue) {
                by_queue.push((queue.into(), h.clone()));
            }
        }
        h
    }

    /// A job ran: counts it, and its failure unless it was rescheduled by a limit.
    pub(crate) fn job_ran(
        &self,
        class: &str,
        queue: &str,
        took: Duration,
        error: Option<&JobError>,
    ) {
        let rescheduled = error.is_some_and(|e| {
            matches!(
                e.action,
                crate::RetryAction::Reschedule(_)
                    | crate::RetryAction::Requeue
                    | crate::RetryAction::Continue(_)
            )
        });
        let failed = error.is_some() && !rescheduled;
        let secs = took.as_secs_f64();
        self.with_handles(class, queue, |h| {
            h.processed.inc();
            if failed {
                h.failed.inc();
            }
            h.duration.observe(secs);
        });
    }

    /// A failed job's fate reached Redis.
    pub(crate) fn fate(&self, class: &str, fate: &Fate) {
        let family = match fate {
            Fate::Retry { .. } => &self.retried,
            Fate::Dead => &self.dead,
            Fate::Discarded => &self.discarded,
            Fate::Rescheduled { .. } | Fate::Continued { .. } => &self.rescheduled,
            Fate::Requeued => &self.requeued,
        };
        family
            .get_or_create(&ClassLabel {
                class: self.class_label(class).to_string(),
            })
            .inc();
    }

    /// A job of `class` is still running past its timeout (its cancellation could not stop it).
    pub(crate) fn past_timeout(&self, class: &str) {
        self.past_timeout
            .get_or_create(&ClassLabel {
                class: self.class_label(class).to_string(),
            })
            .inc();
    }

    /// A job was pushed unchanged to the `--handoff` queue.
    pub(crate) fn handed_off(&self, class: &str) {
        self.handed_off
            .get_or_create(&ClassLabel {
                class: self.class_label(class).to_string(),
            })
            .inc();
    }

    /// A sidekiq-unique-jobs job met a conflict handled by `strategy`.
    pub(crate) fn unique_conflict(&self, class: &str, strategy: &str) {
        self.unique_conflicts
            .get_or_create(&ClassStrategy {
                class: self.class_label(class).to_string(),
                strategy: strategy.to_string(),
            })
            .inc();
    }

    /// A job's fate write failed for a reason other than an outage (`reason`): counted, and the job
    /// counts as stuck (`/ready` says so) until the returned guard is dropped.
    pub(crate) fn fate_stuck(&self, reason: &str) -> StuckFate {
        self.fate_write_failures.inc();
        self.fates_stuck.inc();
        if let Ok(mut r) = self.stuck_reason.lock() {
            *r = reason.to_string();
        }
        StuckFate(())
    }

    /// How many jobs wait for a fate write that fails for a reason other than an outage, and why the
    /// latest one failed; `None` when there are none.
    pub(crate) fn stuck_fates(&self) -> Option<(i64, String)> {
        let n = self.fates_stuck.get();
        (n > 0).then(|| {
            let why = self
                .stuck_reason
                .lock()
                .map(|r| r.clone())
                .unwrap_or_default();
            (n, why)
        })
    }

    /// A fetch round brought back `jobs` jobs.
    pub(crate) fn fetched(&self, jobs: usize) {
        self.fetches.inc();
        self.fetch_batch.observe(jobs as f64);
    }

    /// `n` unfinished jobs went back to their queues.
    pub(crate) fn pushed_back(&self, n: usize) {
        self.pushed_back.inc_by(n as u64);
    }

    /// A Redis command failed; `reconnects` when the connection was lost with it.
    pub(crate) fn redis_error(&self, reconnects: bool) {
        self.redis_errors.inc();
        if reconnects {
            self.redis_reconnects.inc();
        }
    }

    /// Failed Redis commands counted so far (for tests).
    #[cfg(test)]
    pub(crate) fn redis_errors_counted(&self) -> u64 {
        self.redis_errors.get()
    }

    /// A connection was replaced by a new one (a Sentinel master switch).
    pub(crate) fn reconnected(&self) {
        self.redis_reconnects.inc();
    }

    /// The connections moved to a new master.
    pub(crate) fn master_switched(&self) {
        self.master_switches.inc();
    }

    /// A lock attempt: acquired or found held.
    pub(crate) fn lock_attempt(&self, acquired: bool) {
        if acquired {
            self.locks_acquired.inc();
        } else {
            self.locks_contended.inc();
        }
    }

    /// A held lock was lost.
    pub(crate) fn lock_lost(&self) {
        self.locks_lost.inc();
    }

    /// A heartbeat reached Redis now.
    pub(crate) fn beat(&self) {
        self.last_beat_ms.store(
            chrono::Utc::now().timestamp_millis().max(1) as u64,
            Ordering::Relaxed,
        );
    }

    /// Time since the last heartbeat reached Redis; `None` before the first.
    pub(crate) fn since_last_beat(&self) -> Option<Duration> {
        match self.last_beat_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => {
                let now = chrono::Utc::now().timestamp_millis().max(0) as u64;
                Some(Duration::from_millis(now.saturating_sub(ms)))
            }
        }
    }

    /// Sets the gauges read at scrape time, then writes every metric in the text format.
    pub(crate) fn encode(&self, gauges: &Gauges) -> Result<String, fmt::Error> {
        self.busy.set(gauges.busy as i64);
        self.concurrency.set(gauges.concurrency as i64);
        for (capsule, busy, concurrency) in &gauges.capsules {
            let l = CapsuleLabel {
                capsule: capsule.clone(),
            };
            self.capsule_busy.get_or_create(&l).set(*busy as i64);
            self.capsule_concurrency
                .get_or_create(&l)
                .set(*concurrency as i64);
        }
        for (queue, size, latency) in &gauges.queues {
            let l = QueueLabel {
                queue: queue.clone(),
            };
            self.queue_size.get_or_create(&l).set(*size);
            self.queue_latency.get_or_create(&l).set(*latency);
        }
        if let Some(age) = self.since_last_beat() {
            self.last_beat_age.set(age.as_secs_f64());
        }
        let mut out = String::with_capacity(8 * 1024);
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// What `/metrics` reads when scraped rather than counting per job.
#[derive(Debug, Default, Clone)]
pub(crate) struct Gauges {
    /// Jobs in flight.
    pub busy: usize,
    /// Every capsule's slots.
    pub concurrency: usize,
    /// `(capsule, busy, concurrency)` of each capsule.
    pub capsules: Vec<(String, usize, usize)>,
    /// `(queue, size, latency seconds)` of each queue served.
    pub queues: Vec<(String, i64, f64)>,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

/// The process's metrics.
pub(crate) fn metrics() -> &'static Metrics {
    &METRICS
}

/// Counts a failed command for `/metrics`; a lost connection also counts as a reconnect (the
/// manager reconnects after it).
pub(crate) fn count_error(e: &redis::RedisError) {
    let reconnects = e.is_connection_dropped() || e.is_io_error() || e.is_connection_refusal();
    metrics().redis_error(reconnects);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn made_up_classes_beyond_the_bound_share_one_series() {
        let m = Metrics::new();
        for i in 0..MAX_CLASSES + 50 {
            m.job_ran(&format!("C{i}"), "q", Duration::from_millis(1), None);
        }
        m.job_ran(&"L".repeat(MAX_CLASS_LEN + 1), "q", Duration::ZERO, None);
        m.fate(&format!("C{}", MAX_CLASSES + 10), &Fate::Dead);
        let text = m.encode(&Gauges::default()).unwrap();
        let series = text
            .lines()
            .filter(|l| l.starts_with("oxidekiq_jobs_processed_total{"))
            .count();
        assert_eq!(series, MAX_CLASSES + 1, "{series}");
        assert!(text.contains("oxidekiq_jobs_processed_total{class=\"(other)\",queue=\"q\"} 51"));
        assert!(text.contains("oxidekiq_jobs_dead_total{class=\"(other)\"} 1"));
        assert!(text.contains("oxidekiq_jobs_processed_total{class=\"C0\",queue=\"q\"} 1"));
    }

    #[test]
    fn hand_offs_are_counted_by_class() {
        let m = Metrics::new();
        m.handed_off("Legacy::Mailer");
        m.handed_off("Legacy::Mailer");
        let text = m.encode(&Gauges::default()).unwrap();
        assert!(
            text.contains("oxidekiq_jobs_handed_off_total{class=\"Legacy::Mailer\"} 2"),
            "{text}"
        );
    }

    #[test]
    fn counts_and_histograms_are_written_in_the_text_format() {
        let m = Metrics::new();
        m.job_ran("HardWorker", "default", Duration::from_millis(30), None);
        m.job_ran(
            "HardWorker",
            "default",
            Duration::from_millis(3),
            Some(&JobError::msg("x")),
        );
        m.job_ran(
            "Limited",
            "low",
            Duration::from_millis(1),
            Some(&JobError::reschedule(5.0, "later")),
        );
        m.fate("HardWorker", &Fate::Dead);
        m.fetched(3);
        let text = m
            .encode(&Gauges {
                busy: 2,
                concurrency: 5,
                capsules: vec![("default".into(), 1, 4), ("single".into(), 1, 1)],
                queues: vec![("default".into(), 7, 1.5)],
            })
            .unwrap();
        for line in [
            "oxidekiq_jobs_processed_total{class=\"HardWorker\",queue=\"default\"} 2",
            "oxidekiq_jobs_failed_total{class=\"HardWorker\",queue=\"default\"} 1",
            "oxidekiq_jobs_processed_total{class=\"Limited\",queue=\"low\"} 1",
            "oxidekiq_job_duration_seconds_count{class=\"HardWorker\"} 2",
            "oxidekiq_job_duration_seconds_bucket{le=\"0.005\",class=\"HardWorker\"} 1",
            "oxidekiq_job_duration_seconds_bucket{le=\"0.05\",class=\"HardWorker\"} 2",
            "oxidekiq_jobs_dead_total{class=\"HardWorker\"} 1",
            "oxidekiq_fetch_round_trips_total 1",
            "oxidekiq_busy 2",
            "oxidekiq_concurrency 5",
            "oxidekiq_capsule_busy{capsule=\"default\"} 1",
            "oxidekiq_capsule_concurrency{capsule=\"default\"} 4",
            "oxidekiq_capsule_concurrency{capsule=\"single\"} 1",
            "oxidekiq_queue_size{queue=\"default\"} 7",
            "oxidekiq_queue_latency_seconds{queue=\"default\"} 1.5",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        // A reschedule is no failure; the series exists from the class's first job, at 0.
        assert!(
            text.contains("oxidekiq_jobs_failed_total{class=\"Limited\",queue=\"low\"} 0\n"),
            "{text}"
        );
    }
}
