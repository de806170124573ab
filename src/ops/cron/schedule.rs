//! A sidekiq-cron `cron` string, read as the gem reads it, and the one question the poller asks of it:
//! which tick is the latest one due.
//!
//! sidekiq-cron 1.8.0 parses with `Fugit.parse` (`job.rb` `valid?`/`parsed_cron`): a cron line of 5
//! fields, or 6 with seconds first, optionally followed by a time zone (`0 9 * * * Europe/Paris`); the
//! `@hourly`-style specials; and fugit's natural-language forms (`every 5 minutes`, `every day at
//! noon`). The fields are parsed by the `croner` crate (5 or 6 fields, `L`, `#`, names, day-of-month
//! OR day-of-week as vixie cron and fugit do); the zone by `chrono-tz`. Of the natural forms, the
//! common ones are rewritten into a cron line here ([`natural`]); the rest are refused with an error
//! naming the string, so a Ruby process with the gem keeps running such a schedule.

use std::str::FromStr;

use chrono::{DateTime, Duration, Timelike, Utc};
use chrono_tz::Tz;
use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};

/// A parsed `cron` string: when its ticks fall, in which zone.
#[derive(Debug, Clone)]
pub struct Schedule {
    /// The fields, as croner reads them.
    cron: Cron,
    /// The zone the fields are read in (UTC unless the string names one).
    zone: Tz,
    /// The string as written, for messages.
    source: String,
}

impl Schedule {
    /// Parses a `cron` string as sidekiq-cron 1.8.0 accepts it (see the module docs for what is
    /// supported); the error names the string and says what is wrong.
    ///
    /// ```
    /// use chrono::{TimeZone, Utc};
    /// use oxidekiq::cron::Schedule;
    ///
    /// let s = Schedule::parse("*/5 * * * *").unwrap();
    /// let now = Utc.with_ymd_and_hms(2026, 1, 1, 12, 7, 30).unwrap();
    /// assert_eq!(s.previous_time(now).unwrap(), Utc.with_ymd_and_hms(2026, 1, 1, 12, 5, 0).unwrap());
    /// assert!(Schedule::parse("every 5 minutes").is_ok());
    /// assert!(Schedule::parse("0 9 * * * Europe/Paris").is_ok());
    /// ```
    pub fn parse(source: &str) -> Result<Schedule, String> {
        let trimmed = source.trim();
        let (line, zone) = match natural(trimmed) {
            Some(line) => split_zone(&line)?,
            None => split_zone(trimmed)?,
        };
        let line = special(&line).unwrap_or(&line);
        let fields = line.split_whitespace().count();
        if !(5..=6).contains(&fields) {
            return Err(format!(
                "{source:?} is not a cron line of 5 or 6 fields (nor a form oxidekiq reads, see \
                 the cron docs)"
            ));
        }
        let parser = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build();
        let cron = parser
            .parse(line)
            .map_err(|e| format!("{source:?} is not a valid cron line: {e}"))?;
        Ok(Schedule {
            cron,
            zone,
            source: source.to_string(),
        })
    }

    /// The latest tick at or before `now`'s whole second minus one, as fugit's `Cron#previous_time`
    /// (fugit 1.5 starts its search at `from - 1` and drops the fraction): the tick at `T` is the
    /// "previous" one from `T + 1 s` until one second after the next tick. The poller claims that tick.
    pub fn previous_time(&self, now: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
        let mut from = floor_second(now) - Duration::seconds(1);
        for _ in 0..MAX_GAP_SKIPS {
            let t = self
                .cron
                .find_previous_occurrence(&from.with_timezone(&self.zone), true)
                .map_err(|e| format!("{:?}: no previous tick before {now}: {e}", self.source))?;
            if self.on_the_clock(&t) {
                return Ok(t.with_timezone(&Utc));
            }
            from = t.with_timezone(&Utc) - Duration::seconds(1);
        }
        Err(format!("{:?}: no previous tick before {now}", self.source))
    }

    /// Whether `t` reads as a tick on the zone's wall clock. croner moves a tick that falls into a
    /// daylight-saving gap (02:30 on the night clocks jump from 02:00 to 03:00) to the end of the gap;
    /// fugit has no such tick, and skips to the one before or after.
    fn on_the_clock(&self, t: &DateTime<Tz>) -> bool {
        self.cron.is_time_matching(t).unwrap_or(false)
    }

    /// The first tick after `t` (for the poller's sleep).
    pub fn next_time(&self, t: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
        let mut from = floor_second(t);
        for _ in 0..MAX_GAP_SKIPS {
            let next = self
                .cron
                .find_next_occurrence(&from.with_timezone(&self.zone), false)
                .map_err(|e| format!("{:?}: no tick after {t}: {e}", self.source))?;
            if self.on_the_clock(&next) {
                return Ok(next.with_timezone(&Utc));
            }
            from = next.with_timezone(&Utc);
        }
        Err(format!("{:?}: no tick after {t}", self.source))
    }

    /// The string as written.
    pub fn source(&self) -> &str {
        &self.source
    }
}

/// How many ticks moved out of a daylight-saving gap a search passes over before giving up (a gap
/// holds at most an hour of ticks of a 1-second schedule).
const MAX_GAP_SKIPS: usize = 4000;

/// `t` without its fraction of a second.
fn floor_second(t: DateTime<Utc>) -> DateTime<Utc> {
    t.with_nanosecond(0).unwrap_or(t)
}

/// fugit's `Cron::SPECIALS` (`@reboot` has no tick, so it is not one of them here).
fn special(line: &str) -> Option<&'static str> {
    Some(match line {
        "@yearly" | "@annually" => "0 0 1 1 *",
        "@monthly" => "0 0 1 * *",
        "@weekly" => "0 0 * * 0",
        "@daily" | "@midnight" => "0 0 * * *",
        "@noon" => "0 12 * * *",
        "@hourly" => "0 * * * *",
        _ => return None,
    })
}

/// Splits a trailing time zone off a cron line: fugit reads `<fields> <zone>` with an IANA name
/// (`Europe/Paris`, `America/New_York`) or `UTC`/`GMT`; `Z` is read too, though fugit 1.5 refuses it.
fn split_zone(line: &str) -> Result<(String, Tz), String> {
    let mut words: Vec<&str> = line.split_whitespace().collect();
    let Some(last) = words.last().copied() else {
        return Err("an empty cron string".into());
    };
    let looks_like_zone = last.contains('/') || matches!(last, "UTC" | "GMT" | "Z" | "Etc/UTC");
    if !looks_like_zone || words.len() < 2 {
        return Ok((line.to_string(), Tz::UTC));
    }
    let zone = if last == "Z" {
        Tz::UTC
    } else {
        Tz::from_str(last).map_err(|_| format!("{line:?}: unknown time zone {last:?}"))?
    };
    words.pop();
    Ok((words.join(" "), zone))
}

/// The common natural-language forms of fugit's `Nat` (what `Fugit.parse` falls back to for a string
/// that is not a cron line), as the cron line fugit makes of them: `every N seconds|minutes|hours`,
/// `every second|minute|hour|day|week|month|year`, `every day at 5pm`, `every monday at 9:30`,
/// `every weekday at noon`, each optionally followed by a time zone. `None` for anything else.
pub(crate) fn natural(s: &str) -> Option<String> {
    let lower = s.to_ascii_lowercase();
    let rest = lower.strip_prefix("every ")?.trim();
    // A trailing zone keeps its spelling (zone names are case-sensitive).
    let (rest, zone) = match s.split_whitespace().last() {
        Some(z) if z.contains('/') || z == "UTC" => {
            (rest[..rest.len() - z.len()].trim().to_string(), Some(z))
        }
        _ => (rest.to_string(), None),
    };
    let with_zone = |line: String| match zone {
        Some(z) => format!("{line} {z}"),
        None => line,
    };
    let words: Vec<&str> = rest.split_whitespace().collect();
    let line = match words.as_slice() {
        ["second"] => "* * * * * *".to_string(),
        ["minute"] => "* * * * *".to_string(),
        ["hour"] => "0 * * * *".to_string(),
        ["day"] => "0 0 * * *".to_string(),
        ["week"] => "0 0 * * 0".to_string(),
        ["month"] => "0 0 1 * *".to_string(),
        ["year"] => "0 0 1 1 *".to_string(),
        [n, unit] => {
            let n: u32 = n.parse().ok().filter(|n| *n > 0)?;
            match unit.trim_end_matches('s') {
                "second" if n < 60 => format!("*/{n} * * * * *"),
                "minute" if n < 60 => format!("*/{n} * * * *"),
                "hour" if n < 24 => format!("0 */{n} * * *"),
                _ => return None,
            }
        }
        [day, "at", time @ ..] => {
            let (hour, minute) = clock(&time.join(" "))?;
            let dow = match day.trim_end_matches('s') {
                "day" => "*",
                "weekday" => "1-5",
                d => weekday(d)?,
            };
            format!("{minute} {hour} * * {dow}")
        }
        _ => return None,
    };
    Some(with_zone(line))
}

/// A day name as a cron day-of-week.
fn weekday(d: &str) -> Option<&'static str> {
    Some(match d {
        "sunday" | "sun" => "0",
        "monday" | "mon" => "1",
        "tuesday" | "tue" => "2",
        "wednesday" | "wed" => "3",
        "thursday" | "thu" => "4",
        "friday" | "fri" => "5",
        "saturday" | "sat" => "6",
        _ => return None,
    })
}

/// `noon`, `midnight`, `17`, `17:30`, `5pm`, `5:30 pm`, `9am` as (hour, minute).
fn clock(t: &str) -> Option<(u32, u32)> {
    match t {
        "noon" => return Some((12, 0)),
        "midnight" => return Some((0, 0)),
        _ => {}
    }
    let t = t.replace(' ', "");
    let (t, shift) = if let Some(x) = t.strip_suffix("pm") {
        (x.to_string(), Some(12))
    } else if let Some(x) = t.strip_suffix("am") {
        (x.to_string(), Some(0))
    } else {
        (t, None)
    };
    let (h, m) = match t.split_once(':') {
        Some((h, m)) => (h.parse::<u32>().ok()?, m.parse::<u32>().ok()?),
        None => (t.parse::<u32>().ok()?, 0),
    };
    let h = match shift {
        Some(s) if (1..=12).contains(&h) => h % 12 + s,
        Some(_) => return None,
        None => h,
    };
    (h < 24 && m < 60).then_some((h, m))
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn at(h: u32, m: u32, s: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 25, h, m, s).unwrap()
    }

    #[test]
    fn the_previous_tick_is_fugits_one_second_before_the_whole_second() {
        let every_second = Schedule::parse("* * * * * *").unwrap();
        let t = at(10, 0, 1) + Duration::milliseconds(300);
        assert_eq!(every_second.previous_time(t).unwrap(), at(10, 0, 0));
        assert_eq!(
            every_second.previous_time(at(10, 0, 1)).unwrap(),
            at(10, 0, 0)
        );
        let every_minute = Schedule::parse("* * * * *").unwrap();
        // At 10:01:00.5 fugit still answers 10:00:00; from 10:01:01 on, 10:01:00.
        let t = at(10, 1, 0) + Duration::milliseconds(500);
        assert_eq!(every_minute.previous_time(t).unwrap(), at(10, 0, 0));
        assert_eq!(
            every_minute.previous_time(at(10, 1, 1)).unwrap(),
            at(10, 1, 0)
        );
        assert_eq!(every_minute.next_time(at(10, 1, 0)).unwrap(), at(10, 2, 0));
    }

    #[test]
    fn a_schedule_that_never_ticks_is_an_error_not_a_hang() {
        let feb_31 = Schedule::parse("0 0 31 2 *").unwrap();
        let started = std::time::Instant::now();
        assert!(feb_31.previous_time(at(10, 0, 0)).is_err());
        assert!(feb_31.next_time(at(10, 0, 0)).is_err());
        eprintln!("never-ticking schedule answered in {:?}", started.elapsed());
    }

    #[test]
    fn zones_specials_and_natural_forms_parse() {
        let paris = Schedule::parse("0 9 * * * Europe/Paris").unwrap();
        // 09:00 in Paris is 08:00 UTC in November.
        assert_eq!(paris.previous_time(at(8, 30, 0)).unwrap(), at(8, 0, 0));
        assert_eq!(natural("every 5 minutes").as_deref(), Some("*/5 * * * *"));
        assert_eq!(
            natural("every day at 5:30 pm").as_deref(),
            Some("30 17 * * *")
        );
        assert_eq!(natural("every monday at 9am").as_deref(), Some("0 9 * * 1"));
        assert_eq!(
            natural("every weekday at noon").as_deref(),
            Some("0 12 * * 1-5")
        );
        assert_eq!(
            natural("every day at 9 Asia/Tokyo").as_deref(),
            Some("0 9 * * * Asia/Tokyo")
        );
        assert!(Schedule::parse("@hourly").is_ok());
        for bad in [
            "",
            "* * * *",
            "* * * * * * *",
            "every blue moon",
            "0 9 * * * Mars/Base",
        ] {
            assert!(Schedule::parse(bad).is_err(), "{bad:?}");
        }
    }
}
