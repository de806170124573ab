//! One sidekiq-cron schedule as Redis holds it (the `cron_job:...` hash), and what the poller decides
//! from it: whether a tick is due, the claim that guards it, and the job it enqueues.
//!
//! Mirrors sidekiq-cron 1.8.0 `job.rb`: `initialize` (how each field is read), `should_enque?` (status,
//! the 60-second grace rule, `last_enqueue_time`), `formated_enqueue_time`/`formated_last_time` (the
//! claim's score and member), `sidekiq_worker_message` and `active_job_message` (the payloads a process
//! without the job's Ruby class pushes). sidekiq-cron 2.x reads and writes the same fields.

use std::collections::HashMap;

use chrono::{DateTime, NaiveDateTime, SecondsFormat, Utc};
use serde_json::{Map, Value, json};

use super::Schedule;
use crate::client::{Claim, NewJob};
use crate::config::truthy_text;
use crate::keys;

/// The namespace sidekiq-cron 2.x writes to unless told otherwise (`default_namespace`).
pub(crate) const DEFAULT_NAMESPACE: &str = "default";

/// How late a tick may still be enqueued: `not_past_scheduled_time?` (1.8.0) and
/// `reschedule_grace_period`'s default (2.x), in seconds.
pub(crate) const GRACE_SECS: i64 = 60;

/// `LAST_ENQUEUE_TIME_FORMAT`.
pub(crate) const LAST_ENQUEUE_TIME_FORMAT: &str = "%Y-%m-%d %H:%M:%S %z";

/// A schedule read from its hash.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    /// The hash's key (the member of `cron_jobs`): the claim and history keys are built from it.
    pub(crate) key: String,
    /// `name`.
    pub(crate) name: String,
    /// `cron`, parsed.
    pub(crate) schedule: Schedule,
    /// `klass`.
    class: String,
    /// `args`, as `parse_args` reads them.
    args: Vec<Value>,
    /// `message` (the payload template): `queue`, `class`, `retry`, the class's other options.
    message: Map<String, Value>,
    /// `status == "enabled"` (a hash without `status` is enabled; an empty one is not).
    pub(crate) enabled: bool,
    /// `active_job`.
    active_job: bool,
    /// `date_as_argument`.
    date_as_argument: bool,
    /// `queue_name_prefix` (ActiveJob), when not empty.
    queue_name_prefix: Option<String>,
    /// `queue_name_delimiter` (ActiveJob), when not empty.
    queue_name_delimiter: Option<String>,
    /// `description` (`null` when absent, as the gem's ActiveJob payload writes it).
    description: Value,
    /// `last_enqueue_time`, when set and readable.
    last_enqueue: Option<DateTime<Utc>>,
    /// The same schedule's hash in the other key layout, when Redis holds both ([`link_twins`]).
    pub(crate) twin: Option<String>,
    /// The latest tick this poller enqueued or found claimed by another process, set on the poller's
    /// cached copy (never read from Redis): that tick is not due again, so the rounds between whole
    /// reads do not read the schedule again until its next tick.
    pub(crate) settled: Option<DateTime<Utc>>,
}

impl Entry {
    /// Reads a schedule's hash, its `cron` through `parse` (the poller's cache of
    /// [`Schedule::parse`]); the error says what the gem's `valid?` would refuse.
    pub(crate) fn from_hash(
        key: &str,
        mut h: HashMap<String, String>,
        parse: &mut dyn FnMut(&str) -> Result<Schedule, String>,
    ) -> Result<Entry, String> {
        // Read as is: the gem's `status == "enabled"` makes an empty status disabled (only a hash
        // without the field is enabled), and the Cron tab shows it so.
        let status = h.remove("status");
        let mut take = |f: &str| h.remove(f).filter(|v| !v.is_empty());
        let name = take("name").ok_or("`name` is not set")?;
        let cron = take("cron").ok_or("`cron` is not set")?;
        let schedule = parse(&cron)?;
        let class = take("klass").ok_or("`klass` is not set")?;
        let args = take("args").map(|a| parse_args(&a)).unwrap_or_default();
        let mut message = match take("message").map(|m| serde_json::from_str::<Value>(&m)) {
            Some(Ok(Value::Object(m))) => m,
            Some(_) => return Err("`message` is not a JSON object".into()),
            None => Map::new(),
        };
        if !message.contains_key("queue") {
            message.insert("queue".into(), "default".into());
        }
        let flag = |v: Option<String>| v.as_deref().is_some_and(truthy_text);
        Ok(Entry {
            key: key.to_string(),
            name,
            schedule,
            class,
            args,
            message,
            enabled: status.is_none_or(|s| s == "enabled"),
            active_job: flag(take("active_job")),
            date_as_argument: flag(take("date_as_argument")),
            queue_name_prefix: take("queue_name_prefix"),
            queue_name_delimiter: take("queue_name_delimiter"),
            description: take("description").map_or(Value::Null, Value::String),
            last_enqueue: take("last_enqueue_time").and_then(|t| parse_enqueue_time(&t)),
            twin: None,
            settled: None,
        })
    }

    /// The tick to enqueue at `now`, if one is due: the schedule is enabled, its latest tick
    /// ([`Schedule::previous_time`]) is at most [`GRACE_SECS`] old (whole seconds, as Ruby's `to_i`),
    /// and nothing was enqueued after that tick's second. The claim then decides who enqueues it.
    ///
    /// The gem's own guard (`not_enqueued_after?`) skips a tick when the last enqueue happened in the
    /// tick's second or later; since enqueues happen a second or more after their tick, it skips every
    /// other tick of a 1-second schedule. oxidekiq skips only when the last enqueue is in a later
    /// second than the tick's: a manual "Enqueue Now" after the tick still stops it, a late enqueue of
    /// the tick before does not. Duplicates are prevented by the claim, not by this guard.
    pub(crate) fn due(&self, now: DateTime<Utc>) -> Result<Option<DateTime<Utc>>, String> {
        if !self.enabled {
            return Ok(None);
        }
        let tick = self.schedule.previous_time(now)?;
        if now.timestamp() - tick.timestamp() > GRACE_SECS {
            return Ok(None);
        }
        if self
            .last_enqueue
            .is_some_and(|last| last.timestamp() > tick.timestamp())
            || self.settled.is_some_and(|settled| settled >= tick)
        {
            return Ok(None);
        }
        Ok(Some(tick))
    }

    /// The claim on `tick`: `ZADD cron_job:<name>:enqueued <tick.to_f.to_s> <tick.iso8601>`, byte for
    /// byte as the gem writes it, so a Ruby poller and oxidekiq contend for the same member.
    /// With a [`twin`](Entry::twin), the tick must be unclaimed in its claim set too, and is claimed
    /// in both.
    pub(crate) fn claim(&self, tick: DateTime<Utc>) -> Claim {
        Claim {
            twin: self.twin.as_deref().map(keys::cron_enqueued),
            ..claim_of(&self.key, tick)
        }
    }

    /// The job to push at `now` (epoch seconds), as a process without the job's Ruby class pushes it:
    /// the `message` with `args` replaced (`sidekiq_worker_message`), or, for an ActiveJob schedule,
    /// `active_job_message` (the `JobWrapper` around `job_class`, `job_id`, `queue_name`,
    /// `arguments`). With `date_as_argument`, `now` is appended to the arguments.
    pub(crate) fn job(&self, now: f64) -> NewJob {
        let mut args = self.args.clone();
        if self.date_as_argument {
            args.push(json!(now));
        }
        let queue = match self.message.get("queue") {
            Some(Value::String(q)) if !q.is_empty() => q.clone(),
            _ => "default".to_string(),
        };
        if self.active_job {
            let queue = self.queue_name_with_prefix(&queue);
            let data = json!({
                "job_class": self.class,
                "job_id": crate::activejob::new_job_id(),
                "queue_name": queue,
                "arguments": args,
            });
            return NewJob::new(crate::activejob::WRAPPER_CLASS, vec![data])
                .queue(queue)
                .option("wrapped", Value::String(self.class.clone()))
                .option("description", self.description.clone());
        }
        let class = match self.message.get("class") {
            Some(Value::String(c)) if !c.is_empty() => c.clone(),
            _ => self.class.clone(),
        };
        let mut job = NewJob::new(class, args).queue(queue);
        for (k, v) in &self.message {
            match (k.as_str(), v) {
                ("class" | "args" | "queue" | "jid", _) => {}
                ("retry", Value::Bool(false)) => job = job.no_retry(),
                ("retry", Value::Number(n)) => {
                    if let Some(n) = n.as_i64() {
                        job = job.retry(n);
                    }
                }
                ("retry", _) => {}
                _ => job = job.option(k.clone(), v.clone()),
            }
        }
        job
    }

    /// `queue_name_with_prefix` for an ActiveJob schedule: `<prefix><delimiter><queue>` when a prefix
    /// is set (delimiter `_` unless set), else the queue.
    fn queue_name_with_prefix(&self, queue: &str) -> String {
        match &self.queue_name_prefix {
            Some(prefix) => {
                let delimiter = self.queue_name_delimiter.as_deref().unwrap_or("_");
                format!("{prefix}{delimiter}{queue}")
            }
            None => queue.to_string(),
        }
    }
}

/// The claim on `tick` of the schedule whose hash is `job_key` (see [`Entry::claim`]).
pub(crate) fn claim_of(job_key: &str, tick: DateTime<Utc>) -> Claim {
    Claim {
        key: keys::cron_enqueued(job_key),
        score: format!("{}.0", tick.timestamp()),
        member: tick.to_rfc3339_opts(SecondsFormat::Secs, true),
        twin: None,
    }
}

/// Pairs the hashes of one schedule held in both key layouts: `cron_job:<name>` (a member of 1.x's
/// `cron_jobs`) and `cron_job:default:<name>` (2.x's default namespace), both with `name` `<name>`.
/// That happens when one side wrote the schedule before the other: oxidekiq loading
/// `config/schedule.yml` into an empty Redis (1.x layout), then a sidekiq-cron 2.x process loading the
/// same file (2.x never reads `cron_jobs`, and its `migrate_old_jobs_if_needed!` copies such a hash to
/// the default namespace without deleting it). Run as two schedules, each tick would be enqueued twice;
/// paired, each claims in both claim sets ([`Entry::claim`]), so a tick is enqueued once whichever
/// layout's poller (Ruby 1.x, Ruby 2.x, oxidekiq) takes it.
///
/// A pair runs only while both are enabled: the Cron tab shows one of the two (1.x's or 2.x's, by the
/// gem's version), and disabling it there must stop the schedule.
pub(crate) fn link_twins(entries: &mut [Entry]) {
    let named: HashMap<String, (String, bool)> = entries
        .iter()
        .map(|e| (e.key.clone(), (e.name.clone(), e.enabled)))
        .collect();
    for e in entries.iter_mut() {
        let plain = keys::cron_job(None, &e.name);
        let namespaced = keys::cron_job(Some(DEFAULT_NAMESPACE), &e.name);
        let other = if e.key == plain {
            namespaced
        } else if e.key == namespaced {
            plain
        } else {
            continue;
        };
        if let Some((name, enabled)) = named.get(&other)
            && *name == e.name
        {
            e.enabled &= *enabled;
            e.twin = Some(other);
        }
    }
}

/// `parse_args` for the text Redis holds: JSON (an array is the arguments, another value the only
/// one); text that is not JSON is the only argument, as Ruby's `[*args]`.
fn parse_args(text: &str) -> Vec<Value> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Array(a)) => a,
        Ok(other) => vec![other],
        Err(_) => vec![Value::String(text.to_string())],
    }
}

/// `parse_enqueue_time`: the gem's own format, else what Ruby's `DateTime.parse` reads of the forms a
/// `Time` takes when written as is (`2026-11-25 10:00:00 UTC`) or as ISO 8601.
pub(crate) fn parse_enqueue_time(text: &str) -> Option<DateTime<Utc>> {
    if let Ok(t) = DateTime::parse_from_str(text, LAST_ENQUEUE_TIME_FORMAT) {
        return Some(t.with_timezone(&Utc));
    }
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Some(t.with_timezone(&Utc));
    }
    let plain = text.strip_suffix(" UTC").unwrap_or(text);
    NaiveDateTime::parse_from_str(plain, "%Y-%m-%d %H:%M:%S")
        .ok()
        .map(|t| t.and_utc())
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn hash(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn at(h: u32, m: u32, s: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 25, h, m, s).unwrap()
    }

    fn minutely(last: &str, status: &str) -> Entry {
        Entry::from_hash(
            "cron_job:n",
            hash(&[
                ("name", "n"),
                ("cron", "* * * * *"),
                ("klass", "K"),
                ("args", "[1]"),
                (
                    "message",
                    r#"{"queue":"q","class":"K","args":[1],"retry":3}"#,
                ),
                ("status", status),
                ("last_enqueue_time", last),
            ]),
            &mut |c| Schedule::parse(c),
        )
        .unwrap()
    }

    #[test]
    fn a_settled_tick_is_not_due_again_but_the_next_one_is() {
        let mut e = minutely("", "enabled");
        e.settled = Some(at(10, 0, 0));
        assert_eq!(e.due(at(10, 0, 1)).unwrap(), None);
        assert_eq!(e.due(at(10, 0, 30)).unwrap(), None);
        assert_eq!(e.due(at(10, 1, 1)).unwrap(), Some(at(10, 1, 0)));
    }

    #[test]
    fn a_tick_is_due_within_the_grace_and_until_enqueued_after_it() {
        let e = minutely("", "enabled");
        assert_eq!(e.due(at(10, 0, 30)).unwrap(), Some(at(10, 0, 0)));
        assert_eq!(e.due(at(10, 1, 0)).unwrap(), Some(at(10, 0, 0)));
        // Later than 60 s after its tick, a tick is skipped.
        let hourly = Entry::from_hash(
            "cron_job:h",
            hash(&[("name", "h"), ("cron", "0 * * * *"), ("klass", "K")]),
            &mut |c| Schedule::parse(c),
        )
        .unwrap();
        assert_eq!(hourly.due(at(10, 1, 0)).unwrap(), Some(at(10, 0, 0)));
        assert_eq!(hourly.due(at(10, 1, 2)).unwrap(), None);
        assert_eq!(minutely("", "disabled").due(at(10, 0, 30)).unwrap(), None);
        // Enqueued in the tick's own second (the previous tick, late) does not stop it; later does.
        assert!(
            minutely("2026-11-25 10:00:00 +0000", "enabled")
                .due(at(10, 0, 30))
                .unwrap()
                .is_some()
        );
        assert_eq!(
            minutely("2026-11-25 10:00:05 +0000", "enabled")
                .due(at(10, 0, 30))
                .unwrap(),
            None
        );
        assert!(
            minutely("2026-11-25 10:00:05 UTC", "enabled")
                .due(at(10, 0, 30))
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn one_schedule_in_both_layouts_is_paired_and_claims_in_both() {
        let entry = |key: &str, name: &str| {
            Entry::from_hash(
                key,
                hash(&[("name", name), ("cron", "* * * * *"), ("klass", "K")]),
                &mut |c| Schedule::parse(c),
            )
            .unwrap()
        };
        let mut entries = vec![
            entry("cron_job:r", "r"),
            entry("cron_job:default:r", "r"),
            // sidekiq-cron 1.x's schedule named `default:x` has the key 2.x gives `x`: not a twin of
            // 1.x's `x`.
            entry("cron_job:x", "x"),
            entry("cron_job:default:x", "default:x"),
            entry("cron_job:alone", "alone"),
        ];
        link_twins(&mut entries);
        let twins: Vec<Option<&str>> = entries.iter().map(|e| e.twin.as_deref()).collect();
        assert_eq!(
            twins,
            [
                Some("cron_job:default:r"),
                Some("cron_job:r"),
                None,
                None,
                None
            ]
        );
        assert!(entries.iter().all(|e| e.enabled));
        // Disabled on the Cron tab, which shows one of the two: the pair stops.
        let mut pair = vec![entry("cron_job:r", "r"), entry("cron_job:default:r", "r")];
        pair[1].enabled = false;
        link_twins(&mut pair);
        assert!(!pair[0].enabled && !pair[1].enabled);
        let c = entries[0].claim(at(10, 0, 0));
        assert_eq!(
            (c.key.as_str(), c.twin.as_deref()),
            ("cron_job:r:enqueued", Some("cron_job:default:r:enqueued"))
        );
    }

    #[test]
    fn the_claim_and_the_payload_are_the_gems() {
        let e = minutely("", "enabled");
        let c = e.claim(at(10, 0, 0));
        assert_eq!(c.key, "cron_job:n:enqueued");
        assert_eq!(c.member, "2026-11-25T10:00:00Z");
        assert_eq!(c.score, format!("{}.0", at(10, 0, 0).timestamp()));
        let p: Value = serde_json::from_str(&e.job(1.5).payload(
            "j",
            2.0,
            crate::time::TimeFormat::Seconds,
        ))
        .unwrap();
        assert_eq!(
            (p["class"].as_str(), p["queue"].as_str(), &p["retry"]),
            (Some("K"), Some("q"), &json!(3))
        );
        assert_eq!(p["args"], json!([1]));
    }
}
