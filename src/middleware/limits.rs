//! What the limit middleware share: where a limit's name comes from, how a job waiting for a slot
//! sleeps, and how a Redis error met while limiting is answered.
//!
//! Used by [`concurrency`](super::concurrency) and [`rate_limit`](super::rate_limit); nothing here is
//! public API.

use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;

use crate::error::JobError;
use crate::worker::JobContext;

/// Computes a limit's name from the job.
type NameFn = dyn Fn(&JobContext) -> Result<String, JobError> + Send + Sync;

/// The name a limit is counted under: fixed, or computed from each job.
#[derive(Clone)]
pub(crate) enum LimitName {
    /// One name for every job (`"payment-api"`).
    Fixed(String),
    /// A name per job, e.g. from its arguments (`"stripe-42"`).
    Dynamic(Arc<NameFn>),
}

impl std::fmt::Debug for LimitName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LimitName::Fixed(name) => f.debug_tuple("Fixed").field(name).finish(),
            LimitName::Dynamic(_) => f.write_str("Dynamic(<fn>)"),
        }
    }
}

impl LimitName {
    /// A name computed from the job's typed arguments. Arguments that do not fit `A` fail the job as
    /// the worker itself would (`ArgumentError`, retried as usual).
    pub(crate) fn by_args<A, F>(f: F) -> Self
    where
        A: DeserializeOwned + 'static,
        F: Fn(&A) -> String + Send + Sync + 'static,
    {
        LimitName::Dynamic(Arc::new(move |ctx: &JobContext| {
            let args: A = ctx.args().map_err(|e| {
                JobError::new(
                    "ArgumentError",
                    format!(
                        "cannot name the limit of {}: arguments do not fit {}: {e}",
                        ctx.class(),
                        std::any::type_name::<A>()
                    ),
                )
            })?;
            Ok(f(&args))
        }))
    }

    /// A name computed from the whole job context.
    pub(crate) fn by_context<F>(f: F) -> Self
    where
        F: Fn(&JobContext) -> String + Send + Sync + 'static,
    {
        LimitName::Dynamic(Arc::new(move |ctx: &JobContext| Ok(f(ctx))))
    }

    /// This job's name.
    pub(crate) fn resolve(&self, ctx: &JobContext) -> Result<String, JobError> {
        match self {
            LimitName::Fixed(name) => Ok(name.clone()),
            LimitName::Dynamic(f) => f(ctx),
        }
    }
}

/// A duration in whole milliseconds, at least 1 (Redis refuses a zero `PEXPIRE`, and a zero lease or
/// period would make every limit meaningless).
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// A duration drawn uniformly from `lo..=hi` (`lo` when `hi <= lo`).
pub(crate) fn uniform(lo: Duration, hi: Duration) -> Duration {
    if hi <= lo {
        return lo;
    }
    let lo_us = u64::try_from(lo.as_micros()).unwrap_or(u64::MAX);
    let hi_us = u64::try_from(hi.as_micros()).unwrap_or(u64::MAX);
    Duration::from_micros(rand::random_range(lo_us..=hi_us))
}

/// The pause before poll number `attempt` (0-based): the base doubles from `poll` up to `max`, and the
/// pause is drawn from `base/2 ..= base` so waiters in many processes do not poll Redis in lockstep.
pub(crate) fn backoff(poll: Duration, max: Duration, attempt: u32) -> Duration {
    let base = poll
        .saturating_mul(1u32 << attempt.min(16))
        .min(max.max(poll));
    uniform(base / 2, base)
}

/// A fresh holder id for one acquisition by one run of `jid`: `<jid>:<64 random bits in hex>`.
///
/// The jid alone is not enough: the same job may run twice at once (a push-back after a crash, a
/// duplicate enqueue), and each run must hold, renew and release only its own slot.
pub(crate) fn holder_id(jid: &str) -> String {
    format!("{jid}:{:016x}", rand::random::<u64>())
}

/// Sleeps `d`, cut short when the process goes quiet; true if it slept the whole time.
///
/// A job that is only waiting for a slot has not started: once the process stops fetching it should
/// give its place back (reschedule) instead of holding up the shutdown.
pub(crate) async fn pause(ctx: &JobContext, d: Duration) -> bool {
    let mut signal = ctx.shutdown();
    if signal.is_quiet() {
        return false;
    }
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = signal.quiet() => false,
    }
}

/// What a job does when Redis failed while it was being limited.
///
/// A dropped or refused connection is an outage, not the job's fault: the job is rescheduled in 1–2 s
/// without using a retry (the processor keeps trying to write that fate until Redis is back). Any other
/// error (a wrong key type, a script error) is a bug or a misconfiguration: the job fails and is
/// retried as usual, so the problem shows in the retry set instead of looping silently.
pub(crate) fn redis_failure(what: &str, e: redis::RedisError) -> JobError {
    if e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout() || e.is_io_error() {
        let delay = uniform(Duration::from_secs(1), Duration::from_secs(2));
        JobError::reschedule(
            delay.as_secs_f64(),
            format!("{what}: redis unavailable ({e}): rescheduled"),
        )
    } else {
        JobError::new("Oxidekiq::LimitError", format!("{what}: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_maximum_and_stays_jittered() {
        let poll = Duration::from_millis(100);
        let max = Duration::from_millis(800);
        for _ in 0..200 {
            let first = backoff(poll, max, 0);
            assert!(first >= Duration::from_millis(50) && first <= poll);
            let third = backoff(poll, max, 2);
            assert!(third >= Duration::from_millis(200) && third <= Duration::from_millis(400));
            let late = backoff(poll, max, 40);
            assert!(late >= Duration::from_millis(400) && late <= max);
        }
    }

    #[test]
    fn holder_ids_start_with_the_jid_and_are_fresh() {
        let a = holder_id("abc");
        let b = holder_id("abc");
        assert!(a.starts_with("abc:"));
        assert_eq!(a.len(), "abc:".len() + 16);
        assert_ne!(a, b);
    }

    #[test]
    fn zero_durations_become_one_millisecond() {
        assert_eq!(millis(Duration::ZERO), 1);
        assert_eq!(millis(Duration::from_secs(2)), 2000);
    }

    #[test]
    fn uniform_stays_in_range() {
        let lo = Duration::from_millis(10);
        let hi = Duration::from_millis(20);
        for _ in 0..200 {
            let d = uniform(lo, hi);
            assert!(d >= lo && d <= hi);
        }
        assert_eq!(uniform(hi, lo), hi);
    }
}
