//! Wall-clock time as Sidekiq writes it, behind one function tests can bypass.
//!
//! Two clocks: this one (chrono, UTC) only for values written to Redis; `tokio::time::Instant` for
//! deadlines and elapsed time. Functions that write timestamps take `now` as an argument so tests can
//! pass any time they like.

use std::time::Duration;

use serde_json::{Number, Value};

/// Epoch seconds, as a float (`Time.now.to_f`).
pub(crate) fn now() -> f64 {
    epoch_secs(chrono::Utc::now())
}

/// `t` as epoch seconds, a float to the microsecond (`Time#to_f`).
pub(crate) fn epoch_secs(t: chrono::DateTime<chrono::Utc>) -> f64 {
    t.timestamp() as f64 + f64::from(t.timestamp_subsec_micros()) / 1e6
}

/// How timestamps inside payloads are written (PROTOCOL §1.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TimeFormat {
    /// Float epoch seconds, always with a decimal point: readable by every Sidekiq (≤ 7.x writes these).
    #[default]
    Seconds,
    /// Integer epoch milliseconds, as Sidekiq 8 writes them.
    Millis,
}

impl TimeFormat {
    /// A payload timestamp value for `secs`.
    pub fn value(self, secs: f64) -> Value {
        match self {
            TimeFormat::Seconds => float_value(secs),
            TimeFormat::Millis => Value::Number(Number::from((secs * 1000.0).round() as i64)),
        }
    }
}

/// A JSON float that always prints with a decimal point (`1700000000.0`, never `1700000000`, which a
/// Sidekiq 8 reader would take for milliseconds).
pub(crate) fn float_value(secs: f64) -> Value {
    let mut s = format!("{secs}");
    if !s.contains(['.', 'e', 'E']) {
        s.push_str(".0");
    }
    // Parsing our own float text cannot fail; fall back to the lossy constructor all the same.
    serde_json::from_str::<Number>(&s)
        .map(Value::Number)
        .unwrap_or_else(|_| Number::from_f64(secs).map_or(Value::Null, Value::Number))
}

/// A score for a sorted set, as Ruby's `Float#to_s` would print it.
pub(crate) fn score(secs: f64) -> String {
    let s = format!("{secs}");
    if s.contains('.') { s } else { format!("{s}.0") }
}

/// A TTL in whole milliseconds, at least 1 (`PX 0` is an error in Redis).
pub(crate) fn ttl_ms(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_always_have_a_decimal_point_and_millis_are_integers() {
        assert_eq!(
            TimeFormat::Seconds.value(1700000000.0).to_string(),
            "1700000000.0"
        );
        assert_eq!(
            TimeFormat::Seconds.value(1795291264.474496).to_string(),
            "1795291264.474496"
        );
        assert_eq!(
            TimeFormat::Millis.value(1795291264.4745).to_string(),
            "1795291264475"
        );
        assert_eq!(score(1795291285.0), "1795291285.0");
    }
}
