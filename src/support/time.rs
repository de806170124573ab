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

/// Seconds with three decimals, as `{:.3}` writes them, for the `elapsed` of every job's log line:
/// rounded to whole milliseconds and written as two integers. `{:.3}` of an `f64` takes the exact
/// decimal expansion (`float_to_decimal_common_exact`), 600 to 1 400 instructions a job under
/// callgrind; this takes about 240. The two differ only on a value within rounding error of a half millisecond,
/// where this rounds half up, as Ruby's `Float#round(3)` does. Out of range (negative, NaN, over
/// 10^12 s): `{:.3}` itself.
pub(crate) struct Secs3(pub(crate) f64);

impl Secs3 {
    /// The text, without `core::fmt` in range (a log line's field takes it as a `&str`: see
    /// [`Secs3Text`]).
    pub(crate) fn text(&self) -> Secs3Text {
        let ms = (self.0 * 1000.0).round();
        if !(0.0..1e15).contains(&ms) {
            return Secs3Text::Wide(format!("{:.3}", self.0));
        }
        // In range: a whole number of milliseconds below 10^15, exact in both types.
        let ms = ms as u64;
        let (mut secs, frac) = (ms / 1000, ms % 1000);
        // Written from the end: the three decimals, the dot, then the seconds' digits.
        let mut buf = [b'0'; 24];
        let mut at = buf.len();
        for d in [frac % 10, frac / 10 % 10, frac / 100, u64::MAX, secs % 10] {
            at -= 1;
            if let Some(slot) = buf.get_mut(at) {
                *slot = if d == u64::MAX { b'.' } else { b'0' + d as u8 };
            }
        }
        secs /= 10;
        while secs > 0 && at > 0 {
            at -= 1;
            if let Some(slot) = buf.get_mut(at) {
                *slot = b'0' + (secs % 10) as u8;
            }
            secs /= 10;
        }
        Secs3Text::Short(buf, at as u8)
    }
}

/// [`Secs3`]'s text: on the stack for any duration a job can take, formatted by `{:.3}` otherwise.
pub(crate) enum Secs3Text {
    /// The digits from the index onwards.
    Short([u8; 24], u8),
    /// Out of range (negative, NaN, over 10^12 s).
    Wide(String),
}

impl Secs3Text {
    /// The text.
    pub(crate) fn as_str(&self) -> &str {
        match self {
            // Digits and a dot: ASCII, so this never fails.
            Secs3Text::Short(buf, at) => {
                std::str::from_utf8(buf.get(usize::from(*at)..).unwrap_or_default())
                    .unwrap_or_default()
            }
            Secs3Text::Wide(s) => s,
        }
    }
}

impl std::fmt::Display for Secs3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.text().as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Secs3` writes what `{:.3}` writes: every whole millisecond up to 100 s and around large
    /// values, and random durations away from a half-millisecond tie (where the two may differ).
    #[test]
    fn secs3_writes_what_three_decimals_write() {
        let same = |x: f64| assert_eq!(Secs3(x).to_string(), format!("{x:.3}"), "{x}");
        for k in (0..100_000u64).chain(999_999_000_000..999_999_100_000) {
            same(k as f64 / 1000.0);
        }
        let seed = rand::random::<u64>();
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
        for _ in 0..100_000 {
            let nanos = rand::Rng::random_range(&mut rng, 0..2_000_000_000_000u64);
            let x = std::time::Duration::from_nanos(nanos).as_secs_f64();
            let off_tie = ((x * 1000.0).fract() - 0.5).abs() > 1e-6;
            if off_tie {
                assert_eq!(Secs3(x).to_string(), format!("{x:.3}"), "seed {seed}: {x}");
            }
        }
        for x in [-1.0, f64::NAN, f64::INFINITY, 1e13] {
            same(x);
        }
    }

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
