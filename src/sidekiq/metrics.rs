//! Execution metrics for the Web UI's Metrics tab: per job class, how many ran, how many failed, how long
//! the successful ones took, and a histogram of those times.
//!
//! Mirrors `metrics/tracking.rb` and `metrics/shared.rb` of Sidekiq 7.3.9 and 8.1.7 (PROTOCOL §7.3), and
//! writes what `metrics/query.rb` of each reads. Jobs are counted in memory ([`Metrics::track`], one
//! short lock per job, as Ruby's `ExecutionTracker`), and the heartbeat appends the whole minute to its
//! one pipeline per beat ([`Snapshot::write`]); nothing is written per job.
//!
//! Per class (`wrapped || class`, as `Metrics::Middleware`), at the flush time `now` (UTC):
//! - 7.x: `HINCRBY j|%Y%m%d|%-H:%-M` fields `<Class>|ms` (sum of successful jobs' whole milliseconds),
//!   `<Class>|p` (every job), `<Class>|f` (failures), `EXPIRE` 8 h; histogram
//!   `BITFIELD <Class>-%d-%H:%-M OVERFLOW SAT INCRBY u16 #<bucket> <n>…`, `EXPIRE` 8 h.
//! - 8.x: the same fields into `j|%y%m%d|%-H:%M` (8 h) and its 10-minute rollup, that key minus its last
//!   character (3 days); histogram `h|<Class>-%-d-%-H:%-M` (8 h).
//!
//! As in Ruby, a field exists only once counted: `|ms` only for a class with a success, `|f` only with a
//! failure, and only successful jobs enter the histogram (failure times say little about performance).

use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::error::{JobError, RetryAction};
use crate::keys;

/// Upper bounds (exclusive, in ms) of the first 25 histogram buckets; the 26th holds everything slower
/// (`Histogram::BUCKET_INTERVALS`, `metrics/shared.rb`, identical in 7.3.9 and 8.1.7).
pub(crate) const BUCKET_BOUNDS_MS: [u64; 25] = [
    20, 30, 45, 65, 100, 150, 225, 335, 500, 750, 1100, 1700, 2500, 3800, 5750, 8500, 13000, 20000,
    30000, 45000, 65000, 100000, 150000, 225000, 335000,
];
/// Number of histogram buckets.
pub(crate) const BUCKETS: usize = BUCKET_BOUNDS_MS.len() + 1;
/// TTL of the 1-minute hashes and the histograms (`SHORT_TERM`, `HISTOGRAM_TTL`: 8 h).
pub(crate) const SHORT_TERM_SECS: i64 = 8 * 60 * 60;
/// TTL of Sidekiq 8's 10-minute hashes (`MID_TERM`, `tracking.rb@v8.1.7`: 3 days).
pub(crate) const MID_TERM_SECS: i64 = 3 * 24 * 60 * 60;

/// The histogram bucket of a job that took `ms` milliseconds (`Histogram#record_time`).
pub(crate) fn bucket(ms: u64) -> usize {
    BUCKET_BOUNDS_MS
        .iter()
        .position(|b| ms < *b)
        .unwrap_or(BUCKETS - 1)
}

/// Which Sidekiq versions' metrics keys to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Formats {
    /// Sidekiq 7.x keys.
    pub v7: bool,
    /// Sidekiq 8.x keys.
    pub v8: bool,
}

/// The counts of one class since the last flush.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ClassCounts {
    /// Jobs run (`|p`).
    pub processed: u64,
    /// Jobs that failed (`|f`).
    pub failed: u64,
    /// Whole milliseconds of the successful ones (`|ms`), `None` until one succeeded.
    pub ms: Option<u64>,
    /// Successful jobs per bucket.
    pub histogram: [u64; BUCKETS],
}

impl ClassCounts {
    fn merge(&mut self, o: &ClassCounts) {
        self.processed += o.processed;
        self.failed += o.failed;
        if let Some(ms) = o.ms {
            self.ms = Some(self.ms.unwrap_or(0) + ms);
        }
        for (a, b) in self.histogram.iter_mut().zip(o.histogram.iter()) {
            *a += b;
        }
    }
}

/// The in-memory counters, shared by every running job and the heartbeat.
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    /// Counts by class.
    classes: Mutex<foldhash::HashMap<Box<str>, ClassCounts>>,
}

impl Metrics {
    /// Counts one finished job of `class` (its `wrapped || class`) that ran for `elapsed`; `error` is its
    /// failure, if any. A `reschedule` answer is not a failure (as Ruby's iterable-job `Skip`, whose time
    /// counts); every other error is, and its time is not recorded.
    pub(crate) fn track(&self, class: &str, elapsed: Duration, error: Option<&JobError>) {
        // An interrupted iterable job's push-back is a success with its time, as Ruby's `Skip`.
        let failed = error.is_some_and(|e| {
            !matches!(
                e.action,
                RetryAction::Reschedule(_) | RetryAction::Requeue | RetryAction::Continue(_)
            )
        });
        let ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
        let mut map = self.classes.lock().unwrap_or_else(|e| e.into_inner());
        let counts = match map.get_mut(class) {
            Some(c) => c,
            None => map.entry(class.into()).or_default(),
        };
        counts.processed += 1;
        if failed {
            counts.failed += 1;
        } else {
            counts.ms = Some(counts.ms.unwrap_or(0).saturating_add(ms));
            counts.histogram[bucket(ms)] += 1;
        }
    }

    /// Takes every count, leaving none (the flush gives them back with [`Metrics::restore`] if its
    /// write fails).
    pub(crate) fn take(&self) -> Snapshot {
        let mut map = self.classes.lock().unwrap_or_else(|e| e.into_inner());
        Snapshot(std::mem::take(&mut *map))
    }

    /// Adds back counts whose write failed.
    pub(crate) fn restore(&self, s: Snapshot) {
        let mut map = self.classes.lock().unwrap_or_else(|e| e.into_inner());
        for (class, c) in s.0 {
            map.entry(class).or_default().merge(&c);
        }
    }
}

/// Counts taken for one flush.
#[derive(Debug, Default)]
pub(crate) struct Snapshot(foldhash::HashMap<Box<str>, ClassCounts>);

impl Snapshot {
    /// True when no job ran (Ruby's flush writes nothing then).
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The counts of one class.
    pub(crate) fn get(&self, class: &str) -> Option<&ClassCounts> {
        self.0.get(class)
    }

    /// Appends the writes of this flush, at `now`, to `pipe` (every command's reply ignored).
    pub(crate) fn write(&self, pipe: &mut redis::Pipeline, now: DateTime<Utc>, formats: Formats) {
        if self.is_empty() {
            return;
        }
        if formats.v7 {
            // tracking.rb@v7.3.9 and shared.rb@v7.3.9 (the key shapes are in `keys`).
            self.histograms(pipe, |class| keys::histogram_v7(class, now));
            self.hash(pipe, &keys::metrics_minute_v7(now), SHORT_TERM_SECS);
        }
        if formats.v8 {
            // tracking.rb@v8.1.7 and shared.rb@v8.1.7: the minute hash and its 10-minute rollup.
            self.histograms(pipe, |class| keys::histogram_v8(class, now));
            self.hash(pipe, &keys::metrics_ten_minutes_v8(now), MID_TERM_SECS);
            self.hash(pipe, &keys::metrics_minute_v8(now), SHORT_TERM_SECS);
        }
    }

    /// `BITFIELD <key> OVERFLOW SAT INCRBY u16 #i n …` + `EXPIRE` for each class with a timed job
    /// (`Histogram#persist`).
    fn histograms(&self, pipe: &mut redis::Pipeline, key: impl Fn(&str) -> String) {
        for (class, c) in &self.0 {
            if c.histogram.iter().all(|n| *n == 0) {
                continue;
            }
            let key = key(class);
            let mut cmd = redis::cmd("BITFIELD");
            cmd.arg(&key).arg("OVERFLOW").arg("SAT");
            for (i, n) in c.histogram.iter().enumerate() {
                if *n > 0 {
                    cmd.arg("INCRBY").arg("u16").arg(format!("#{i}")).arg(*n);
                }
            }
            pipe.add_command(cmd).ignore();
            pipe.cmd("EXPIRE").arg(&key).arg(SHORT_TERM_SECS).ignore();
        }
    }

    /// `HINCRBY <key> <Class>|ms|p|f n` for each counted field, then `EXPIRE <key> <ttl>`.
    fn hash(&self, pipe: &mut redis::Pipeline, key: &str, ttl: i64) {
        for (class, c) in &self.0 {
            if let Some(ms) = c.ms {
                pipe.cmd("HINCRBY")
                    .arg(key)
                    .arg(format!("{class}|ms"))
                    .arg(ms)
                    .ignore();
            }
            if c.failed > 0 {
                pipe.cmd("HINCRBY")
                    .arg(key)
                    .arg(format!("{class}|f"))
                    .arg(c.failed)
                    .ignore();
            }
            pipe.cmd("HINCRBY")
                .arg(key)
                .arg(format!("{class}|p"))
                .arg(c.processed)
                .ignore();
        }
        pipe.cmd("EXPIRE").arg(key).arg(ttl).ignore();
    }
}

// Moved from tests/sidekiq_7_8.rs: Sidekiq 7 and 8 metrics, timestamps and retry rules against recordings (needs crate-internal items).
#[cfg(test)]
mod tests_sidekiq_7_8;

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn buckets_follow_sidekiqs_bounds() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(19), 0);
        assert_eq!(bucket(20), 1);
        assert_eq!(bucket(280), 7);
        assert_eq!(bucket(334_999), 24);
        assert_eq!(bucket(335_000), 25);
        assert_eq!(bucket(u64::MAX), 25);
    }

    #[test]
    fn failures_count_but_are_not_timed_and_reschedules_are_not_failures() {
        let m = Metrics::default();
        m.track("A", Duration::from_millis(25), None);
        m.track("A", Duration::from_millis(5), Some(&JobError::msg("x")));
        m.track("B", Duration::from_millis(5), Some(&JobError::msg("x")));
        m.track(
            "C",
            Duration::from_millis(7),
            Some(&JobError::reschedule(5.0, "later")),
        );
        let s = m.take();
        let a = s.get("A").unwrap();
        assert_eq!((a.processed, a.failed, a.ms), (2, 1, Some(25)));
        assert_eq!(a.histogram[1], 1);
        let b = s.get("B").unwrap();
        assert_eq!((b.processed, b.failed, b.ms), (1, 1, None));
        assert_eq!(s.get("C").unwrap().failed, 0);
        assert!(m.take().is_empty());
        m.restore(s);
        assert_eq!(m.take().get("A").unwrap().processed, 2);
    }

    #[test]
    fn key_names_follow_each_version() {
        let m = Metrics::default();
        m.track("A", Duration::from_millis(3), None);
        let now = Utc.with_ymd_and_hms(2026, 11, 3, 8, 4, 30).unwrap();
        let mut pipe = redis::pipe();
        m.take()
            .write(&mut pipe, now, Formats { v7: true, v8: true });
        let text = String::from_utf8_lossy(&pipe.get_packed_pipeline()).into_owned();
        for key in [
            "A-03-08:4",
            "j|20261103|8:4",
            "h|A-3-8:4",
            "j|261103|8:0",
            "j|261103|8:04",
        ] {
            assert!(
                text.contains(&format!("${}\r\n{key}\r\n", key.len())),
                "{key}"
            );
        }
    }
}
