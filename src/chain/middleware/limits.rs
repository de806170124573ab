//! What the limit middleware share: how a job waiting for a slot sleeps, and how a Redis error met
//! while limiting is answered. (A limit's name is a [`LockKey`](super::lock_key::LockKey), as a lock's.)
//!
//! Used by [`concurrency`](super::concurrency) and [`rate_limit`](super::rate_limit); nothing here is
//! public API.

use std::time::Duration;

use tokio::time::Instant;

use crate::error::JobError;
use crate::worker::JobContext;

/// When a job that started waiting for its limit at `start` stops waiting: `start + wait`, or a century
/// on for a wait no clock can add (`wait(Duration::MAX)`: "as long as it takes"), which would panic.
pub(crate) fn deadline(start: Instant, wait: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 86_400);
    start
        .checked_add(wait)
        .or_else(|| start.checked_add(CENTURY))
        .unwrap_or(start)
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
