//! Rails 8.1's job continuations on the wire: the `continuation` and `resumptions` keys an
//! `ActiveJob::Continuable` job carries in its `job_data` (`activejob/lib/active_job/continuable.rb`,
//! `continuation.rb`, `continuation/step.rb`), read and written as Rails does. What each looks like is
//! recorded in `fixtures/activejob-8.1/continuation_*.json`; docs/continuations.md is the design of the
//! Rust worker API built on these.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::{iso8601_9, kind};

/// A Continuable job's progress: the steps it completed, in order, and the step it was in with that
/// step's cursor (`{"completed": [...], "current": [step, cursor]}`; `current` absent between steps).
///
/// ```
/// use oxidekiq::Continuation;
///
/// let c = Continuation::from_value(&serde_json::json!({
///     "completed": ["prepare"], "current": ["process_records", 4]
/// })).unwrap();
/// assert!(c.is_completed("prepare"));
/// assert_eq!(c.cursor::<u64>("process_records").unwrap(), Some(4));
/// assert_eq!(c.description(), "at 'process_records', cursor '4'");
/// ```
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Continuation {
    /// The completed steps' names, in the order they completed.
    pub completed: Vec<String>,
    /// The step that was running and its cursor (`null` until the step sets one).
    pub current: Option<(String, Value)>,
}

impl Continuation {
    /// Reads `job_data["continuation"]` as `Continuation#initialize` does.
    pub fn from_value(v: &Value) -> Result<Continuation, String> {
        let map = match v {
            Value::Object(map) => map,
            other => {
                return Err(format!(
                    "`continuation` must be a hash, found {}",
                    kind(other)
                ));
            }
        };
        let completed = match map.get("completed") {
            None => Vec::new(),
            Some(Value::Array(names)) => names
                .iter()
                .map(|n| n.as_str().map(str::to_owned))
                .collect::<Option<_>>()
                .ok_or("`continuation.completed` must hold step names")?,
            Some(other) => {
                return Err(format!(
                    "`continuation.completed` must be an array, found {}",
                    kind(other)
                ));
            }
        };
        let current = match map.get("current") {
            None => None,
            // `new_step(*current)`: a step name, then an optional cursor.
            Some(Value::Array(parts)) => match parts.as_slice() {
                [Value::String(name)] => Some((name.clone(), Value::Null)),
                [Value::String(name), cursor] => Some((name.clone(), cursor.clone())),
                _ => return Err("`continuation.current` must be [step, cursor]".into()),
            },
            Some(other) => {
                return Err(format!(
                    "`continuation.current` must be an array, found {}",
                    kind(other)
                ));
            }
        };
        Ok(Continuation { completed, current })
    }

    /// `Continuation#to_h`: `completed`, then `current` when there is one.
    pub fn to_value(&self) -> Value {
        let mut m = Map::new();
        m.insert(
            "completed".into(),
            Value::Array(self.completed.iter().cloned().map(Value::String).collect()),
        );
        if let Some((name, cursor)) = &self.current {
            m.insert(
                "current".into(),
                Value::Array(vec![Value::String(name.clone()), cursor.clone()]),
            );
        }
        Value::Object(m)
    }

    /// `started?`: a step completed or one under way (a run of such a job is a resumption).
    pub fn is_started(&self) -> bool {
        !self.completed.is_empty() || self.current.is_some()
    }

    /// Whether `step` completed (a resumed job skips it).
    pub fn is_completed(&self, step: &str) -> bool {
        self.completed.iter().any(|c| c == step)
    }

    /// The cursor `step` resumes at: `None` unless `step` is the current step and its cursor is set.
    pub fn cursor<T: DeserializeOwned>(&self, step: &str) -> Result<Option<T>, serde_json::Error> {
        match &self.current {
            Some((name, cursor)) if name == step && !cursor.is_null() => {
                T::deserialize(cursor).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// Marks the current step (or `step`, when none is current) completed, as a step block's end does.
    pub fn complete(&mut self, step: &str) {
        self.current = None;
        self.completed.push(step.to_owned());
    }

    /// Sets `step`'s cursor (`step.set!`), making it the current step.
    pub fn set_cursor<T: Serialize>(&mut self, step: &str, cursor: &T) -> Result<(), String> {
        let cursor = serde_json::to_value(cursor).map_err(|e| e.to_string())?;
        self.current = Some((step.to_owned(), cursor));
        Ok(())
    }

    /// `Continuation#description`, which Rails puts in the interrupt's message (and so in
    /// `exception_executions`): `at 'step', cursor '4'`, `after 'step'`, or `not started`.
    pub fn description(&self) -> String {
        match (&self.current, self.completed.last()) {
            (Some((name, cursor)), _) => format!("at '{name}', cursor '{}'", inspect(cursor)),
            (None, Some(last)) => format!("after '{last}'"),
            (None, None) => "not started".into(),
        }
    }
}

/// Ruby's `inspect` of a JSON value as a cursor is (`Integer`, `Float`, `String`, `nil`, `true`,
/// `Array`, `Hash` in Ruby 3.1-3.3's `{"k"=>v}` form).
fn inspect(v: &Value) -> String {
    match v {
        Value::Null => "nil".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => match (n.is_f64(), n.as_f64()) {
            (true, Some(f)) if f.fract() == 0.0 && f.abs() < 1e16 => format!("{f:.1}"),
            _ => n.to_string(),
        },
        Value::String(s) => ruby_string(s),
        Value::Array(items) => format!(
            "[{}]",
            items.iter().map(inspect).collect::<Vec<_>>().join(", ")
        ),
        Value::Object(map) => format!(
            "{{{}}}",
            map.iter()
                .map(|(k, v)| format!("{}=>{}", ruby_string(k), inspect(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// `String#inspect` for the common characters.
fn ruby_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\x{:02X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Why a Continuable job stopped at a checkpoint (`interrupt!(reason:)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum InterruptReason {
    /// The process is quieting or stopping (`queue_adapter.stopping?`).
    Stopping,
    /// An `isolated: true` step is next and the job has already advanced in this run.
    Isolating,
}

impl InterruptReason {
    fn as_str(self) -> &'static str {
        match self {
            InterruptReason::Stopping => "stopping",
            InterruptReason::Isolating => "isolating",
        }
    }
}

impl Continuation {
    /// The `job_data` Rails 8.1 pushes back when a Continuable job is interrupted at a checkpoint
    /// (`Continuable#resume_job` → `retry_job(**resume_options)` → `serialize`): `job_data` of the run
    /// that was interrupted (as it was pushed), with `provider_job_id` the jid that ran it, `executions`
    /// one more, `exception_executions` counting the interrupt under its message (`Interrupted <description>
    /// (<reason>)`), `enqueued_at` now, `scheduled_at` now + `wait` (Rails' `resume_options` default is 5 s),
    /// `continuation` the progress, and `resumptions` as the run counted it (one more than the pushed job's
    /// when that job had started).
    pub fn interrupted_job_data(
        &self,
        job_data: &Map<String, Value>,
        running_jid: &str,
        reason: InterruptReason,
        now: DateTime<Utc>,
        wait: std::time::Duration,
    ) -> Result<Map<String, Value>, String> {
        let message = format!("Interrupted {} ({})", self.description(), reason.as_str());
        self.resumed_job_data(job_data, running_jid, &message, now, wait)
    }

    /// [`Continuation::interrupted_job_data`] for any reason Rails resumes a job (`resume_job`): the
    /// interrupt, or an error after the job advanced (`resume_errors_after_advancing`), counted in
    /// `exception_executions` under `counted_as` (`executions_for(exception)`'s `exception.to_s`).
    pub fn resumed_job_data(
        &self,
        job_data: &Map<String, Value>,
        running_jid: &str,
        counted_as: &str,
        now: DateTime<Utc>,
        wait: std::time::Duration,
    ) -> Result<Map<String, Value>, String> {
        let progress = self;
        let mut out = job_data.clone();
        let executions = match job_data.get("executions") {
            None | Some(Value::Null) => 0,
            Some(v) => v.as_u64().ok_or("`executions` must be a count")?,
        };
        let resumptions = match job_data.get("resumptions") {
            None | Some(Value::Null) => 0,
            Some(v) => v.as_u64().ok_or("`resumptions` must be a count")?,
        };
        let before = match job_data.get("continuation") {
            Some(v) => Continuation::from_value(v)?,
            None => Continuation::default(),
        };
        let mut counts = match job_data.get("exception_executions") {
            Some(Value::Object(m)) => m.clone(),
            _ => Map::new(),
        };
        let n = counts.get(counted_as).and_then(Value::as_u64).unwrap_or(0);
        // Saturating: a payload's count of u64::MAX must not overflow (a panic in a debug build).
        counts.insert(counted_as.to_owned(), n.saturating_add(1).into());
        let scheduled = chrono::Duration::from_std(wait)
            .ok()
            .and_then(|d| now.checked_add_signed(d))
            .ok_or("the resume wait is out of range")?;
        let set = |out: &mut Map<String, Value>, k: &str, v: Value| {
            out.insert(k.into(), v);
        };
        set(&mut out, "provider_job_id", running_jid.into());
        set(&mut out, "executions", executions.saturating_add(1).into());
        set(&mut out, "exception_executions", Value::Object(counts));
        set(&mut out, "enqueued_at", iso8601_9(now).into());
        set(&mut out, "scheduled_at", iso8601_9(scheduled).into());
        set(&mut out, "continuation", progress.to_value());
        let resumed = resumptions.saturating_add(u64::from(before.is_started()));
        set(&mut out, "resumptions", resumed.into());
        Ok(out)
    }
}

/// Keys of a Sidekiq payload that belong to the run that failed or was enqueued, not to a new push:
/// `retry_job` pushes a new job through Sidekiq's client, which writes none of them (a scheduled
/// push has no `enqueued_at`; a new job has no retry state).
const RUN_KEYS: &[&str] = &[
    "enqueued_at",
    "at",
    "retry_count",
    "retried_at",
    "failed_at",
    "error_message",
    "error_class",
    "error_backtrace",
];

/// The Sidekiq payload Rails 8.1's `retry_job` pushes through Sidekiq's adapter at a resume: the
/// running job's payload (its `class`, `wrapped`, `retry` and the other options its class pushes
/// with, in their order) without the keys of the run ([`RUN_KEYS`]), with `args` `[job_data]`, `queue`
/// the job's `queue_name`, a new `jid` and `created_at`. Recorded as
/// `fixtures/activejob-8.1/continuation_*.json`.
///
/// A job the migration router sent to `<queue_name>_rust` (its `queue` rewritten, `queue_name` not)
/// resumes there, where the Rust processes drain it, as a retry does: Ruby's `retry_job` would pass
/// through the router again, which keeps a job on `_rust` while its class is routed and a live Rust
/// process serves it, and no Rust poller routes a job toward `_rust`. A class rolled back meanwhile
/// (`oxidekiq route CLASS 0`) is sent to `<queue_name>` when the next run comes due (both pollers).
pub(crate) fn resumed_payload(
    running: &Map<String, Value>,
    job_data: Map<String, Value>,
    jid: &str,
    created_at: Value,
) -> Map<String, Value> {
    let queue = job_data.get("queue_name").cloned();
    let mut args = Some(job_data);
    let mut out = Map::new();
    for (k, v) in running {
        if RUN_KEYS.contains(&k.as_str()) {
            continue;
        }
        let v = match k.as_str() {
            "args" => Value::Array(vec![Value::Object(args.take().unwrap_or_default())]),
            "jid" => jid.into(),
            "created_at" => created_at.clone(),
            "queue" => match &queue {
                Some(Value::String(q)) if !routed_to_rust(v, q) => Value::String(q.clone()),
                _ => v.clone(),
            },
            _ => v.clone(),
        };
        out.insert(k.clone(), v);
    }
    if let Some(data) = args {
        out.insert("args".into(), Value::Array(vec![Value::Object(data)]));
    }
    out.entry("jid").or_insert_with(|| jid.into());
    out.entry("created_at").or_insert(created_at);
    out
}

/// Whether `queue` (the running payload's) is the `_rust` twin of `queue_name`.
fn routed_to_rust(queue: &Value, queue_name: &str) -> bool {
    queue
        .as_str()
        .and_then(|q| q.strip_suffix(crate::keys::RUST_QUEUE_SUFFIX))
        == Some(queue_name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The interrupt's message names the cursor as Ruby's `inspect` does (Rails puts it in
    /// `exception_executions`): checked against this machine's Ruby in the same run.
    #[test]
    fn the_description_inspects_a_cursor_as_ruby_does() {
        let cursors = [
            json!(4),
            json!(-12345678901234567_i64),
            json!(2.5),
            json!(3.0),
            json!("abc"),
            json!("q\"uo\\te\nline\ttab"),
            json!(null),
            json!(true),
            json!([1, "two", [3.5, null]]),
            json!({"id": 7, "page": [1, 2]}),
            json!([]),
        ];
        let text = serde_json::to_string(&cursors).unwrap();
        let out = std::process::Command::new("ruby")
            .args([
                "-rjson",
                "-e",
                "JSON.parse(ARGV[0]).each { |c| puts JSON.generate(c.inspect) }",
                &text,
            ])
            .output()
            .expect("ruby is installed");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let ruby: Vec<String> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(ruby.len(), cursors.len());
        for (cursor, want) in cursors.iter().zip(ruby) {
            assert_eq!(inspect(cursor), want, "{cursor}");
        }
        let mut c = Continuation::default();
        assert_eq!(c.description(), "not started");
        assert!(!c.is_started());
        c.complete("prepare");
        assert_eq!(c.description(), "after 'prepare'");
        c.set_cursor("records", &"k1").unwrap();
        assert_eq!(c.description(), "at 'records', cursor '\"k1\"'");
        assert_eq!(
            c.to_value(),
            json!({"completed": ["prepare"], "current": ["records", "k1"]})
        );
    }

    /// Review (issue 39): counts from a payload at `u64::MAX` (`executions`, `resumptions`, an
    /// `exception_executions` entry) stay there instead of overflowing (a panic in a debug build, a
    /// wrap to 0 in release, which would restart `max_resumptions`' count).
    #[test]
    fn counts_at_their_largest_do_not_overflow() {
        let max = u64::MAX;
        let c = Continuation {
            completed: vec![],
            current: Some(("s".into(), json!(1))),
        };
        let message = format!("Interrupted {} (stopping)", c.description());
        let data = json!({
            "executions": max,
            "resumptions": max,
            "continuation": {"completed": [], "current": ["s", 0]},
            "exception_executions": {message.clone(): max},
        });
        let out = c
            .interrupted_job_data(
                data.as_object().unwrap(),
                "j",
                InterruptReason::Stopping,
                Utc::now(),
                std::time::Duration::from_secs(5),
            )
            .unwrap();
        assert_eq!(out["executions"], json!(max));
        assert_eq!(out["resumptions"], json!(max));
        assert_eq!(out["exception_executions"][&message], json!(max));
    }

    #[test]
    fn a_malformed_continuation_is_an_error() {
        for bad in [
            json!([]),
            json!({"completed": "prepare"}),
            json!({"completed": [1]}),
            json!({"current": "step"}),
            json!({"current": [1, 2]}),
            json!({"current": ["a", 1, 2]}),
        ] {
            assert!(Continuation::from_value(&bad).is_err(), "{bad}");
        }
        assert_eq!(
            Continuation::from_value(&json!({"current": ["a"]})).unwrap(),
            Continuation {
                completed: vec![],
                current: Some(("a".into(), Value::Null))
            }
        );
    }
}
