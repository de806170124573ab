//! Which Sidekiq versions share this Redis, surveyed on every heartbeat, and what that means for what we
//! write.
//!
//! Sidekiq versions read different things: ≤ 7.x reads payload timestamps as float seconds and 8.x writes
//! (and reads) integer milliseconds (PROTOCOL §1.2); 6.4 shows running jobs from `<identity>:workers`,
//! 6.5+ from `<identity>:work` (§0); 7.x and 8.x read different metrics keys (§7.3); 7.x and 8.x retry by
//! different rules (`job_retry.rb@v7.3.9` / `@v8.1.7`). The only readers we can see are the live
//! processes: each beat reads the `info` JSON of every member of `processes` (the `version` field exists
//! since 7.0.2, `launcher.rb@v7.0.2`) and [`Fleet`] holds the verdict until the next beat, so a 7.x
//! process joining an 8.x fleet turns our new timestamps back to float seconds within one beat.
//!
//! With no Ruby process alive we cannot see which Web UI reads our data, so we write for every reader:
//! float seconds, both work hashes, both metrics formats. Other oxidekiq processes are not readers and
//! do not count.

use std::sync::Mutex;

use serde_json::Value;

use crate::error::Result;
use crate::keys;
use crate::redis_conn::Conn;
use crate::retry::RetryRules;
use crate::time::TimeFormat;

/// A Sidekiq version as `major.minor.patch` (missing parts are 0).
pub(crate) type Version = (u32, u32, u32);

/// Parses `"7.3.9"`, `"8.1"`, `"8.0.0.beta1"` the way `Gem::Version` orders them for our purpose (the
/// first three numeric segments). `None` for anything that does not start with a number.
pub(crate) fn parse_version(s: &str) -> Option<Version> {
    let mut parts = s.trim().split('.').map(|p| p.parse::<u32>().ok());
    let major = parts.next().flatten()?;
    let minor = parts.next().flatten().unwrap_or(0);
    let patch = parts.next().flatten().unwrap_or(0);
    Some((major, minor, patch))
}

/// True for an `info` JSON written by an oxidekiq process (this one or another): the `oxidekiq` field,
/// the `oxidekiq` label, or the `oxidekiq/x.y.z` version string older oxidekiq builds wrote.
fn is_oxidekiq(info: &Value) -> bool {
    info.get("oxidekiq").is_some()
        || info
            .get("version")
            .and_then(Value::as_str)
            .is_some_and(|v| v.starts_with("oxidekiq"))
        || info
            .get("labels")
            .and_then(Value::as_array)
            .is_some_and(|l| l.iter().any(|x| x.as_str() == Some("oxidekiq")))
}

/// What one survey of `processes` found. Only live Ruby processes count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Survey {
    /// Live Ruby Sidekiq processes.
    pub ruby: usize,
    /// A Ruby process without a parseable `version` (Sidekiq ≤ 7.0.1, hence possibly 6.x).
    pub unversioned: bool,
    /// A 6.x process older than 6.5 (reads `<identity>:workers`).
    pub before_6_5: bool,
    /// A 7.x process (reads the 7.x metrics keys).
    pub v7: bool,
    /// An 8.x (or later) process (reads the 8.x metrics keys).
    pub v8: bool,
    /// The oldest parseable version among them.
    pub oldest: Option<Version>,
}

impl Survey {
    /// Classifies the `info` JSON of each member of `processes` (`None`: the hash has expired).
    pub(crate) fn classify<'a>(infos: impl IntoIterator<Item = Option<&'a str>>) -> Survey {
        let mut s = Survey::default();
        for info in infos.into_iter().flatten() {
            let Ok(v) = serde_json::from_str::<Value>(info) else {
                continue;
            };
            if is_oxidekiq(&v) {
                continue;
            }
            s.ruby += 1;
            match v
                .get("version")
                .and_then(Value::as_str)
                .and_then(parse_version)
            {
                None => s.unversioned = true,
                Some(ver) => {
                    match ver.0 {
                        0..=6 => s.before_6_5 |= ver < (6, 5, 0),
                        7 => s.v7 = true,
                        _ => s.v8 = true,
                    }
                    s.oldest = Some(s.oldest.map_or(ver, |o| o.min(ver)));
                }
            }
        }
        s
    }

    /// Integer milliseconds only when there is at least one Ruby process and every one is 8.0 or later;
    /// float seconds whenever any reader older than 8.0 is (or may be) alive.
    pub(crate) fn time_format(&self) -> TimeFormat {
        let all_8 = self.ruby > 0 && !self.unversioned && self.oldest.is_some_and(|o| o.0 >= 8);
        if all_8 {
            TimeFormat::Millis
        } else {
            TimeFormat::Seconds
        }
    }

    /// The retry rules of the oldest live Ruby version (the one whose rules the fleet still runs);
    /// 7.x rules for a process without a version; the newest (8.1) rules when no Ruby process is alive.
    pub(crate) fn retry_rules(&self) -> RetryRules {
        if self.unversioned {
            return RetryRules::for_version((7, 0, 0));
        }
        match self.oldest {
            Some(v) => RetryRules::for_version(v),
            None => RetryRules::default(),
        }
    }

    /// Write the 6.4 `<identity>:workers` hash: only while a reader of it may be alive (a Ruby process
    /// older than 6.5, or one without a version), or when no Ruby process tells us who reads.
    pub(crate) fn writes_legacy_workers(&self) -> bool {
        self.ruby == 0 || self.unversioned || self.before_6_5
    }

    /// Which metrics formats to write: those of the 7.x/8.x processes alive; both when none is.
    pub(crate) fn metrics_formats(&self) -> crate::metrics::Formats {
        if self.v7 || self.v8 {
            crate::metrics::Formats {
                v7: self.v7,
                v8: self.v8,
            }
        } else {
            crate::metrics::Formats { v7: true, v8: true }
        }
    }
}

/// Reads `processes` and the `info` of each member: `SMEMBERS`, then one pipeline of `HGET`s.
pub(crate) async fn survey(conn: &mut Conn) -> Result<Survey> {
    // Bytes: a member or an `info` that is not UTF-8 counts as no process, never as an error.
    let ids: Vec<Vec<u8>> = match redis::cmd("SMEMBERS")
        .arg(keys::PROCESSES)
        .query_async(conn)
        .await
    {
        Ok(ids) => ids,
        Err(e) if crate::Error::from(e.clone()).is_outage() => return Err(e.into()),
        Err(e) => {
            // Sidekiq's own key, damaged: no process is seen (as if none ran) rather than the beat,
            // and with it the start, failing for good.
            let kind: String = redis::cmd("TYPE")
                .arg(keys::PROCESSES)
                .query_async(conn)
                .await
                .unwrap_or_else(|_| "unknown".into());
            tracing::error!(key = keys::PROCESSES, key_type = %kind, error = %e,
                "the process set is not a set: no process counts as alive for the fleet survey; \
                 repair or delete the key");
            return Ok(Survey::default());
        }
    };
    if ids.is_empty() {
        return Ok(Survey::default());
    }
    let mut pipe = redis::pipe();
    for id in &ids {
        pipe.cmd("HGET").arg(id).arg("info");
    }
    // The raw replies, one per member: `query_async` would turn one member whose key is not a hash
    // (WRONGTYPE) into an error for the whole survey, and with it fail every beat and the start.
    let replies = {
        use redis::aio::ConnectionLike;
        conn.req_packed_commands(&pipe, 0, pipe.len()).await?
    };
    let infos: Vec<Option<Vec<u8>>> = ids
        .iter()
        .zip(replies)
        .map(|(id, reply)| match reply {
            redis::Value::BulkString(b) => Some(b),
            redis::Value::ServerError(e) => {
                tracing::error!(key = %String::from_utf8_lossy(id), error = ?e,
                    "a member of `processes` names a key that is not a process's hash: counted as no \
                     process; repair or delete the key, or SREM the member");
                None
            }
            _ => None,
        })
        .collect();
    Ok(Survey::classify(infos.iter().map(|i| {
        i.as_deref().and_then(|b| std::str::from_utf8(b).ok())
    })))
}

/// The latest survey, shared by the heartbeat (which writes it every beat) and everything that writes
/// timestamps or retries (which read it at the moment they write).
#[derive(Debug, Default)]
pub(crate) struct Fleet {
    /// The latest survey.
    latest: Mutex<Survey>,
    /// A configured timestamp format (`millisecond_timestamps`), which wins over the survey.
    forced: Option<TimeFormat>,
}

impl Fleet {
    /// A fleet view; `forced` pins the timestamp format regardless of the survey.
    pub(crate) fn new(forced: Option<TimeFormat>) -> Self {
        Fleet {
            latest: Mutex::new(Survey::default()),
            forced,
        }
    }

    /// Stores a new survey.
    pub(crate) fn update(&self, s: Survey) {
        *self.latest.lock().unwrap_or_else(|e| e.into_inner()) = s;
    }

    /// The latest survey.
    pub(crate) fn current(&self) -> Survey {
        *self.latest.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How to write new payload timestamps now.
    pub(crate) fn time_format(&self) -> TimeFormat {
        self.forced.unwrap_or_else(|| self.current().time_format())
    }

    /// The retry rules to follow now.
    pub(crate) fn retry_rules(&self) -> RetryRules {
        self.current().retry_rules()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S739: &str =
        include_str!("../../fixtures/shared/sidekiq-7.3.9-server/heartbeat_info.json");

    fn info(version: Option<&str>) -> String {
        match version {
            Some(v) => format!(r#"{{"hostname":"h","labels":[],"version":"{v}"}}"#),
            None => r#"{"hostname":"h","labels":[]}"#.to_string(),
        }
    }

    #[test]
    fn versions_parse_like_gem_versions_for_the_first_three_segments() {
        assert_eq!(parse_version("7.3.9"), Some((7, 3, 9)));
        assert_eq!(parse_version("8.1"), Some((8, 1, 0)));
        assert_eq!(parse_version("8.0.0.beta1"), Some((8, 0, 0)));
        assert_eq!(parse_version("oxidekiq/0.1.0"), None);
    }

    #[test]
    fn one_reader_older_than_8_means_float_seconds() {
        let v8 = info(Some("8.1.7"));
        let all8 = Survey::classify([Some(v8.as_str()), Some(v8.as_str())]);
        assert_eq!(all8.time_format(), TimeFormat::Millis);
        assert!(!all8.writes_legacy_workers());
        let mixed = Survey::classify([Some(v8.as_str()), Some(S739.trim())]);
        assert_eq!(mixed.time_format(), TimeFormat::Seconds);
        assert_eq!(mixed.oldest, Some((7, 3, 9)));
        assert!(mixed.metrics_formats().v7 && mixed.metrics_formats().v8);
        let unversioned = info(None);
        let old = Survey::classify([Some(v8.as_str()), Some(unversioned.as_str())]);
        assert_eq!(old.time_format(), TimeFormat::Seconds);
        assert!(old.writes_legacy_workers());
        // Nobody to ask: write what everyone reads.
        let none = Survey::classify([None]);
        assert_eq!(none.time_format(), TimeFormat::Seconds);
        assert!(none.writes_legacy_workers());
        assert!(none.metrics_formats().v7 && none.metrics_formats().v8);
    }

    #[test]
    fn oxidekiq_processes_are_not_readers() {
        let ours = r#"{"labels":["oxidekiq"],"version":"0.1.0","oxidekiq":"0.1.0"}"#;
        let old_ours = r#"{"labels":[],"version":"oxidekiq/0.0.9"}"#;
        let v8 = info(Some("8.0.2"));
        let s = Survey::classify([Some(ours), Some(old_ours), Some(v8.as_str())]);
        assert_eq!(s.ruby, 1);
        assert_eq!(s.time_format(), TimeFormat::Millis);
        assert!(!s.metrics_formats().v7);
    }

    #[test]
    fn a_forced_format_wins_over_the_survey() {
        let f = Fleet::new(Some(TimeFormat::Millis));
        f.update(Survey::classify([Some(S739.trim())]));
        assert_eq!(f.time_format(), TimeFormat::Millis);
        let g = Fleet::new(None);
        g.update(Survey::classify([Some(S739.trim())]));
        assert_eq!(g.time_format(), TimeFormat::Seconds);
    }
}
