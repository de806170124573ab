//! A job payload as Ruby wrote it: the original bytes, plus the few fields the runtime needs.
//!
//! Mirrors `job_util.rb` / `processor.rb` (PROTOCOL §1). The stored string is an identity: Ruby deletes
//! jobs with `LREM`/`ZREM` of the exact string, so [`Job`] keeps the original bytes for ack, requeue and
//! removal and never re-serializes them on the hot path. Only the fields dispatch needs are decoded; the
//! retry path decodes the whole object into an order-keeping map ([`Job::to_map`]) and keeps every key it
//! does not know. Numbers beyond 64 bits survive because `serde_json` runs with `arbitrary_precision`.

use std::ops::Range;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::{Map, Value};

use header::Header;

// Its home is the support layer (`encoding`); kept at this public path.
pub use crate::encoding::hex;

/// The payload key holding the until-executed lock's full Redis key
/// ([`crate::middleware::until_executed`]): named here, below the header reader that notes whether a
/// payload carries it (`Job::may_name_unique_key`).
pub const UNIQUE_KEY_FIELD: &str = "unique_key";
pub(crate) use header::{JobDataText, Markers};

pub(crate) mod activejob_keys;
pub(crate) mod header;

/// The two class names ActiveJob jobs carry (Rails' adapter ≤ Sidekiq 7, Sidekiq's own from 8.0).
pub const ACTIVEJOB_WRAPPERS: [&str; 2] = [
    "ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper",
    "Sidekiq::ActiveJob::Wrapper",
];

/// Why a payload could not become a [`Job`]; each kind ends in the dead set with this text.
#[derive(Debug, Clone, PartialEq)]
pub enum PayloadError {
    /// Bigger than the configured limit.
    TooLarge {
        /// The payload's size in bytes.
        size: usize,
        /// The configured limit.
        limit: usize,
    },
    /// Not UTF-8 text.
    InvalidUtf8(String),
    /// Not JSON (Sidekiq sends such a payload to the dead set as is, `processor.rb`).
    InvalidJson(String),
    /// JSON, but not an object, or without a string `class`, or `args` not an array.
    Invalid(String),
}

impl std::fmt::Display for PayloadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PayloadError::TooLarge { size, limit } => {
                write!(f, "payload of {size} bytes is over the {limit}-byte limit")
            }
            PayloadError::InvalidUtf8(m) => write!(f, "payload is not valid UTF-8: {m}"),
            PayloadError::InvalidJson(m) => write!(f, "payload is not valid JSON: {m}"),
            PayloadError::Invalid(m) => write!(f, "payload is not a Sidekiq job: {m}"),
        }
    }
}

impl std::error::Error for PayloadError {}

/// The `retry` field as Ruby reads it (`job_retry.rb retry_attempts_from`), and a worker's default
/// for it ([`WorkerOptions::retry`](crate::WorkerOptions::retry)).
///
/// ```
/// use oxidekiq::{Job, RetrySetting};
///
/// let job = |retry: &str| Job::from_str(&format!(r#"{{"class":"A","args":[],"retry":{retry}}}"#)).unwrap();
/// assert_eq!(job("true").retry(), Some(RetrySetting::Default));
/// assert_eq!(job("3").retry(), Some(RetrySetting::Count(3)));
/// assert_eq!(job("false").retry(), Some(RetrySetting::Disabled));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetrySetting {
    /// `true`, or any truthy non-Integer: the default maximum (25).
    Default,
    /// An Integer: that many retries (`0` = straight to the dead set; Ruby's 0 is truthy).
    Count(i64),
    /// `false` or `null`: no retry and no dead-set entry.
    Disabled,
}

/// Name of the payload field that sets a job's timeout in seconds, over its worker's `timeout`
/// option: namespaced, since Sidekiq, ActiveJob and common gems use `timeout`-like names of their own
/// (sidekiq-unique-jobs' `lock_timeout`, Sidekiq Enterprise's limiter `wait_timeout`).
pub const TIMEOUT_FIELD: &str = "oxidekiq_timeout";

/// Per-worker options (Ruby's `sidekiq_options`); each applies when the payload does not say otherwise.
///
/// ```
/// use oxidekiq::{JobContext, JobResult, NoArgs, RetrySetting, Worker, WorkerOptions};
///
/// /// `sidekiq_options retry: 5, retry_queue: "low", backtrace: 10`
/// #[derive(Debug)]
/// struct NightlyJob;
///
/// impl Worker for NightlyJob {
///     const CLASS: &'static str = "NightlyJob";
///     type Args = NoArgs;
///
///     fn options(&self) -> WorkerOptions {
///         WorkerOptions {
///             retry: Some(RetrySetting::Count(5)),
///             retry_queue: Some("low".into()),
///             backtrace: Some(10),
///             local_concurrency: Some(2), // at most 2 at once in this process
///             ..WorkerOptions::default()
///         }
///     }
///
///     async fn perform(&self, _ctx: &JobContext, _args: NoArgs) -> JobResult {
///         Ok(())
///     }
/// }
/// # assert_eq!(NightlyJob.options().retry, Some(RetrySetting::Count(5)));
/// ```
#[derive(Debug, Clone, Default)]
pub struct WorkerOptions {
    /// Retries when the payload has no `retry` key (default: Sidekiq's 25).
    pub retry: Option<RetrySetting>,
    /// Queue that retries go to (the payload's `retry_queue` wins).
    pub retry_queue: Option<String>,
    /// `false`: exhausted jobs are dropped instead of going to the dead set.
    pub dead: Option<bool>,
    /// How many backtrace lines to store in `error_backtrace` (`None`: the payload's `backtrace`).
    pub backtrace: Option<usize>,
    /// At most this many jobs of this class run at once inside this process (no Redis round trip).
    pub local_concurrency: Option<usize>,
    /// A job of this class still running after this long is cancelled at its next await point and
    /// fails with `Oxidekiq::JobTimeout` into the retry set (the payload's `oxidekiq_timeout`, in
    /// seconds, wins). A synchronous worker cannot be cancelled: it is reported instead.
    pub timeout: Option<std::time::Duration>,
}

/// A timestamp field as any Sidekiq version writes it (PROTOCOL §1.4): a JSON float is epoch
/// seconds (≤ 7.x); a JSON integer is epoch milliseconds (8.x), except that an integer below 1e11 is
/// taken as seconds (no real millisecond timestamp is that small).
pub fn timestamp_seconds(v: &Value) -> Option<f64> {
    let n = match v {
        Value::Number(n) => n,
        _ => return None,
    };
    if n.is_f64() {
        return n.as_f64();
    }
    let i = n
        .as_i64()
        .map(|i| i as f64)
        .or_else(|| n.as_u64().map(|u| u as f64))?;
    if i.abs() < 1e11 {
        Some(i)
    } else {
        Some(i / 1000.0)
    }
}

/// `jid` and `queue` as the decoder read them before it borrowed: strings or absent, anything else an
/// error. Only parsed when one of them is not a plain string, to give serde's own message.
#[derive(Deserialize)]
struct Strict {
    #[serde(default)]
    #[allow(dead_code)] // read for its type check only
    jid: Option<String>,
    #[serde(default)]
    #[allow(dead_code)] // read for its type check only
    queue: Option<String>,
}

/// A string field of the payload: where its characters sit in the raw payload when it holds no escape
/// (nearly always: no copy, no allocation), else its decoded text.
#[derive(Debug, Clone)]
enum Text {
    /// A byte range of `raw`.
    At(usize, usize),
    /// Decoded from a string with escapes.
    Owned(Box<str>),
}

impl Text {
    /// The text of a JSON string value `value` (raw JSON text, a slice of `raw`); `None` when it is not
    /// a string. `plain`: the payload reader saw it to be a string without an escape.
    fn of(raw: &str, value: &str, plain: bool) -> Option<Text> {
        let inner = value.strip_prefix('"')?.strip_suffix('"')?;
        if plain || !inner.as_bytes().contains(&b'\\') {
            let start = inner.as_ptr() as usize - raw.as_ptr() as usize;
            return Some(Text::At(start, start + inner.len()));
        }
        serde_json::from_str::<String>(value)
            .ok()
            .map(|s| Text::Owned(s.into_boxed_str()))
    }

    fn get<'a>(&'a self, raw: &'a str) -> &'a str {
        match self {
            Text::At(start, end) => raw.get(*start..*end).unwrap_or_default(),
            Text::Owned(s) => s,
        }
    }
}

/// A decoded job: the original bytes and its dispatch fields ([`JobContext::job`](crate::JobContext::job)).
///
/// ```
/// use oxidekiq::Job;
///
/// let raw = r#"{"class":"HardWorker","args":["bob",5],"retry":true,"queue":"default","jid":"b4a577edbccf1d805744efa9"}"#;
/// let job = Job::from_str(raw).unwrap();
/// assert_eq!(job.class(), "HardWorker");
/// assert_eq!(job.jid(), "b4a577edbccf1d805744efa9");
/// assert_eq!(job.args_json(), r#"["bob",5]"#);
/// assert_eq!(job.raw(), raw); // the exact bytes Ruby stored, never re-serialized
/// ```
#[derive(Debug, Clone)]
pub struct Job {
    /// The exact string Ruby stored; acks, requeues and removals use it as is. Shared, so the in-flight
    /// table and the panic recovery hold the same bytes without a copy.
    raw: Arc<str>,
    /// `class`, as written.
    class: Text,
    /// `wrapped`, when it is a string (ActiveJob's real class).
    wrapped: Option<Text>,
    /// `jid`, or empty when absent (Ruby tolerates a missing jid).
    jid: Text,
    /// `queue` field of the payload (may differ from the list it was fetched from).
    queue: Option<Text>,
    /// Byte range of the `args` array inside `raw`.
    args: Range<usize>,
    /// The `retry` field; `None` when absent (the worker's option decides).
    retry: Option<RetrySetting>,
    /// `class` is one of [`ACTIVEJOB_WRAPPERS`] (asked several times per job: the log span, the
    /// registry, metrics).
    activejob: bool,
    /// For an ActiveJob wrapper holding one `job_data` hash: where its fields sit, found while the
    /// payload was decoded ([`header`]), so that unwrapping it does not walk it again.
    job_data: Option<JobDataRanges>,
    /// The top-level keys the payload may carry ([`Job::may_name_unique_key`],
    /// [`Job::may_name_timeout`], [`Job::may_name_gem_lock`]): bits of `header::named`.
    named: u8,
}

/// Byte ranges of `raw`: the raw JSON text of each `job_data` field [`crate::activejob`] reads.
#[derive(Debug, Clone)]
struct JobDataRanges {
    job_class: Option<Range<usize>>,
    job_id: Option<Range<usize>>,
    executions: Option<Range<usize>>,
    arguments: Option<Range<usize>>,
    plain: u8,
    markers: Markers,
}

impl Job {
    /// Decodes a payload, checking what the runtime relies on: UTF-8, a JSON object, a string
    /// `class` and an array `args`. `limit` is the largest payload accepted, in bytes.
    pub fn parse(bytes: Vec<u8>, limit: usize) -> Result<Job, (Vec<u8>, PayloadError)> {
        if bytes.len() > limit {
            let size = bytes.len();
            return Err((bytes, PayloadError::TooLarge { size, limit }));
        }
        let raw = match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => {
                let msg = e.utf8_error().to_string();
                return Err((e.into_bytes(), PayloadError::InvalidUtf8(msg)));
            }
        };
        match Self::decode(&raw) {
            Ok(fields) => Ok(fields.into_job(Arc::from(raw))),
            Err(e) => Err((raw.into_bytes(), e)),
        }
    }

    /// Decodes from a string (the bytes must already be UTF-8).
    #[allow(clippy::should_implement_trait)] // a fallible constructor with its own error type, not parsing
    pub fn from_str(raw: &str) -> Result<Job, PayloadError> {
        Self::decode(raw).map(|f| f.into_job(Arc::from(raw)))
    }

    fn decode(raw: &str) -> Result<Fields, PayloadError> {
        let trimmed = raw.trim_start();
        if !trimmed.starts_with('{') {
            return Err(match serde_json::from_str::<serde::de::IgnoredAny>(raw) {
                Ok(_) => PayloadError::Invalid("the JSON value is not an object".into()),
                Err(e) => PayloadError::InvalidJson(e.to_string()),
            });
        }
        let mut header = Header::default();
        Header::read_into(raw, &mut header).map_err(header_error)?;
        let text = |v: Option<&str>, bit: u8| v.map(|v| Text::of(raw, v, header.plain & bit != 0));
        let (jid, queue) = match (
            text(header.jid, header::JID),
            text(header.queue, header::QUEUE),
        ) {
            (Some(None), _) | (_, Some(None)) => return Err(Self::strict_error(raw)),
            (jid, queue) => (jid.flatten(), queue.flatten()),
        };
        let class = match header.class {
            None => return Err(PayloadError::Invalid("`class` is missing".into())),
            Some(c) => match Text::of(raw, c, header.plain & header::CLASS != 0) {
                Some(t) if !t.get(raw).is_empty() => t,
                Some(_) => return Err(PayloadError::Invalid("`class` is empty".into())),
                None => {
                    return Err(PayloadError::Invalid(format!(
                        "`class` is not a string (it is {})",
                        json_kind(c)
                    )));
                }
            },
        };
        let at = |s: &str| {
            let start = s.as_ptr() as usize - raw.as_ptr() as usize;
            start..start + s.len()
        };
        let args = match header.args {
            None => return Err(PayloadError::Invalid("`args` is missing".into())),
            Some(a) if a.starts_with('[') => at(a),
            Some(a) => {
                return Err(PayloadError::Invalid(format!(
                    "`args` is not an array (it is {})",
                    json_kind(a)
                )));
            }
        };
        let job_data = header.job_data.map(|d| JobDataRanges {
            job_class: d.job_class.map(at),
            job_id: d.job_id.map(at),
            executions: d.executions.map(at),
            arguments: d.arguments.map(at),
            plain: d.plain,
            markers: d.markers,
        });
        // The reader compared a plain `class` with the wrappers' names already; an escaped one (or
        // serde_json's reading) is compared here.
        let activejob = header.activejob
            || (header.plain & header::CLASS == 0 && ACTIVEJOB_WRAPPERS.contains(&class.get(raw)));
        let wrapped = text(header.wrapped, header::WRAPPED).flatten();
        let retry = header.retry.map(retry_setting);
        Ok(Fields {
            class,
            wrapped,
            jid: jid.unwrap_or(Text::At(0, 0)),
            queue,
            args,
            retry,
            activejob,
            job_data,
            named: header.named,
        })
    }

    /// serde's error for a `jid` or `queue` that is not a string, or a string that does not decode (a
    /// lone surrogate escape): what reading them as `String`s said before they were borrowed.
    #[cold]
    fn strict_error(raw: &str) -> PayloadError {
        match serde_json::from_str::<Strict>(raw) {
            Err(e) => header_error(e),
            Ok(_) => PayloadError::Invalid("`jid` or `queue` is not a string".into()),
        }
    }

    /// The exact bytes Ruby stored.
    pub fn raw(&self) -> &str {
        &self.raw
    }

    /// Consumes the job, giving back its original bytes.
    pub fn into_raw(self) -> String {
        self.raw.to_string()
    }

    /// The original bytes, shared (no copy).
    pub fn shared_raw(&self) -> Arc<[u8]> {
        Arc::from(self.raw.clone())
    }

    /// The payload's text, shared (no copy).
    pub(crate) fn shared_text(&self) -> &Arc<str> {
        &self.raw
    }

    /// The `class` field as written (for ActiveJob jobs, the wrapper's name).
    pub fn class(&self) -> &str {
        self.class.get(&self.raw)
    }

    /// The `wrapped` field, when present.
    pub fn wrapped(&self) -> Option<&str> {
        self.wrapped.as_ref().map(|w| w.get(&self.raw))
    }

    /// True when the job is an ActiveJob wrapper.
    pub fn is_activejob(&self) -> bool {
        self.activejob
    }

    /// The class a worker is registered under: `wrapped` for ActiveJob jobs, else `class`.
    pub fn worker_class(&self) -> &str {
        if self.is_activejob() {
            self.wrapped().unwrap_or(self.class())
        } else {
            self.class()
        }
    }

    /// The job id (empty if the payload had none).
    pub fn jid(&self) -> &str {
        self.jid.get(&self.raw)
    }

    /// The `queue` field of the payload.
    pub fn queue(&self) -> Option<&str> {
        self.queue.as_ref().map(|q| q.get(&self.raw))
    }

    /// The `args` array, as JSON text.
    pub fn args_json(&self) -> &str {
        &self.raw[self.args.clone()]
    }

    /// The `retry` field, `None` when absent.
    pub fn retry(&self) -> Option<RetrySetting> {
        self.retry
    }

    /// For an ActiveJob wrapper whose `args` is one `job_data` hash (read while the payload was
    /// decoded, when `class` came before `args`): the raw JSON text of its fields. `None` otherwise, and
    /// [`crate::activejob::unwrap`] reads [`Job::args_json`] itself.
    pub(crate) fn job_data(&self) -> Option<JobDataText<'_>> {
        let text = |r: &Option<Range<usize>>| r.clone().and_then(|r| self.raw.get(r));
        self.job_data.as_ref().map(|d| JobDataText {
            job_class: text(&d.job_class),
            job_id: text(&d.job_id),
            executions: text(&d.executions),
            arguments: text(&d.arguments),
            plain: d.plain,
            markers: d.markers,
        })
    }

    /// False when the payload has no top-level `unique_key` (the until-executed lock's field), as for
    /// most jobs: known from the decoding, which read every top-level key (or, when serde_json read
    /// the header, whether the text names it at all).
    pub(crate) fn may_name_unique_key(&self) -> bool {
        self.named & header::UNIQUE_KEY != 0
    }

    /// False when the payload has no top-level [`TIMEOUT_FIELD`], as for most jobs (known as
    /// [`Job::may_name_unique_key`] is): its timeout is then its worker's.
    pub(crate) fn may_name_timeout(&self) -> bool {
        self.named & header::TIMEOUT != 0
    }

    /// False when the payload has neither a top-level `lock` nor `lock_digest`, the fields
    /// sidekiq-unique-jobs' server reads, as for most jobs (known as [`Job::may_name_unique_key`]
    /// is): its run then has nothing of the gem's to do.
    pub(crate) fn may_name_gem_lock(&self) -> bool {
        self.named & header::GEM_LOCK != 0
    }

    /// The whole payload as an order-keeping map, every key kept (numbers exactly).
    pub fn to_map(&self) -> Result<Map<String, Value>, PayloadError> {
        serde_json::from_str(&self.raw).map_err(|e| PayloadError::InvalidJson(e.to_string()))
    }
}

struct Fields {
    class: Text,
    wrapped: Option<Text>,
    jid: Text,
    queue: Option<Text>,
    args: Range<usize>,
    retry: Option<RetrySetting>,
    activejob: bool,
    job_data: Option<JobDataRanges>,
    named: u8,
}

impl Fields {
    fn into_job(self, raw: Arc<str>) -> Job {
        Job {
            raw,
            class: self.class,
            wrapped: self.wrapped,
            jid: self.jid,
            queue: self.queue,
            args: self.args,
            retry: self.retry,
            activejob: self.activejob,
            job_data: self.job_data,
            named: self.named,
        }
    }
}

/// A type error in the header is a payload that is not a job; anything else is not JSON.
fn header_error(e: serde_json::Error) -> PayloadError {
    if e.is_data() {
        PayloadError::Invalid(e.to_string())
    } else {
        PayloadError::InvalidJson(e.to_string())
    }
}

/// `retry_attempts_from`: an Integer is a count, `false`/`null` disable, anything else is the default.
/// An Integer beyond 64 bits is Ruby's Bignum: it saturates (a huge positive count never exhausts in
/// practice, a huge negative one exhausts at once), so the payload can neither overflow nor be misread
/// as the default.
fn retry_setting(text: &str) -> RetrySetting {
    match text {
        "false" | "null" => RetrySetting::Disabled,
        "true" => RetrySetting::Default,
        other => match other.parse::<i64>() {
            Ok(n) => RetrySetting::Count(n),
            Err(_) if is_integer_literal(other) => RetrySetting::Count(if other.starts_with('-') {
                i64::MIN
            } else {
                i64::MAX
            }),
            Err(_) => RetrySetting::Default,
        },
    }
}

/// True for a JSON integer literal (an optional `-`, then digits only).
fn is_integer_literal(text: &str) -> bool {
    let digits = text.strip_prefix('-').unwrap_or(text);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

/// A payload number that must be a count: an Integer saturated to `i64` (Ruby's Bignum), a Float
/// truncated toward zero (saturating, `Infinity` included); `None` for anything that is not a number.
/// Never panics and never overflows, whatever the payload holds.
pub fn saturating_count(v: &Value) -> Option<i64> {
    let Value::Number(n) = v else { return None };
    if let Some(i) = n.as_i64() {
        return Some(i);
    }
    if n.as_u64().is_some() {
        return Some(i64::MAX);
    }
    let text = n.to_string();
    if is_integer_literal(&text) {
        return Some(if text.starts_with('-') {
            i64::MIN
        } else {
            i64::MAX
        });
    }
    // `f64 as i64` saturates and maps NaN to 0 (JSON has no NaN). The text is parsed here rather than
    // with `as_f64`, which answers `None` for a float beyond f64 (`1e400`): that is infinity, saturated.
    text.parse::<f64>().ok().map(|f| f.trunc() as i64)
}

/// A payload number of seconds that must be a duration: finite, and within `min..=max`. The error
/// says what was wrong without echoing more than the number itself.
pub fn checked_seconds(field: &str, v: &Value, min: f64, max: f64) -> Result<f64, String> {
    let Value::Number(n) = v else {
        return Err(format!(
            "`{field}` must be a number of seconds, found {}",
            json_kind(&v.to_string())
        ));
    };
    match n.as_f64() {
        Some(s) if s.is_finite() && s >= min && s <= max => Ok(s),
        _ => Err(format!(
            "`{field}` is {}: it must be a number of seconds from {min} to {max}",
            truncate(&n.to_string(), 40)
        )),
    }
}

/// A payload timestamp (`failed_at`, `enqueued_at`, `created_at`, `at`) as finite epoch seconds
/// within years 1970..=9999 (what Ruby's `Time.at` and every Sidekiq reader handle); `None` when absent,
/// not a number, infinite, negative or beyond that range. Callers use `now` in its place, as Sidekiq
/// does for a missing timestamp.
pub fn valid_timestamp(v: &Value) -> Option<f64> {
    timestamp_seconds(v).filter(|t| t.is_finite() && (0.0..=MAX_TIMESTAMP).contains(t))
}

/// 9999-12-31T23:59:59Z in epoch seconds: the latest timestamp a payload may carry.
pub const MAX_TIMESTAMP: f64 = 253_402_300_799.0;

/// What kind of JSON value a raw value is, for error messages that must not echo job data.
fn json_kind(raw: &str) -> &'static str {
    match raw.as_bytes().first() {
        Some(b'{') => "an object",
        Some(b'[') => "an array",
        Some(b'"') => "a string",
        Some(b't' | b'f') => "a boolean",
        Some(b'n') => "null",
        _ => "a number",
    }
}

/// The first `max` characters of `s`, for error messages.
pub(crate) fn truncate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// A new job id: 24 lowercase hex characters, as `SecureRandom.hex(12)`.
pub fn new_jid() -> String {
    use rand::RngCore;
    let mut b = [0u8; 12];
    rand::rng().fill_bytes(&mut b);
    hex(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: usize = 1 << 20;

    #[test]
    fn parses_a_sidekiq_6_payload_and_keeps_its_bytes() {
        let raw = r#"{"retry":true,"queue":"default","args":[1,"two",{"three":3.5},null,true],"class":"PlainJob","jid":"c11dc1da31a9b6169afbabbe","created_at":1795291260.8776562,"enqueued_at":1795291260.877818}"#;
        let job = Job::parse(raw.as_bytes().to_vec(), LIMIT).unwrap();
        assert_eq!(job.raw(), raw);
        assert_eq!(job.class(), "PlainJob");
        assert_eq!(job.jid(), "c11dc1da31a9b6169afbabbe");
        assert_eq!(job.args_json(), r#"[1,"two",{"three":3.5},null,true]"#);
        assert_eq!(job.retry(), Some(RetrySetting::Default));
    }

    #[test]
    fn retry_is_read_as_ruby_reads_it() {
        let p = |r: &str| {
            Job::from_str(&format!(r#"{{"class":"A","args":[],"retry":{r}}}"#))
                .unwrap()
                .retry()
        };
        assert_eq!(p("false"), Some(RetrySetting::Disabled));
        assert_eq!(p("0"), Some(RetrySetting::Count(0)));
        assert_eq!(p("3"), Some(RetrySetting::Count(3)));
        assert_eq!(p("\"5\""), Some(RetrySetting::Default));
        // Ruby's Bignum counts saturate; a Float is not an Integer (the default).
        assert_eq!(
            p("99999999999999999999"),
            Some(RetrySetting::Count(i64::MAX))
        );
        assert_eq!(
            p("-99999999999999999999"),
            Some(RetrySetting::Count(i64::MIN))
        );
        assert_eq!(p("3.0"), Some(RetrySetting::Default));
        assert_eq!(
            Job::from_str(r#"{"class":"A","args":[]}"#).unwrap().retry(),
            None
        );
    }

    #[test]
    fn timestamps_read_floats_as_seconds_and_integers_as_milliseconds() {
        let v: Value = serde_json::from_str("1795291260.8776562").unwrap();
        assert!((timestamp_seconds(&v).unwrap() - 1795291260.8776562).abs() < 1e-6);
        let v: Value = serde_json::from_str("1795291260878").unwrap();
        assert!((timestamp_seconds(&v).unwrap() - 1795291260.878).abs() < 1e-6);
        let v: Value = serde_json::from_str("1795291260").unwrap();
        assert_eq!(timestamp_seconds(&v), Some(1795291260.0));
    }

    #[test]
    fn payload_numbers_are_read_without_overflow() {
        let v = |s: &str| serde_json::from_str::<Value>(s).unwrap();
        assert_eq!(saturating_count(&v("7")), Some(7));
        assert_eq!(saturating_count(&v("18446744073709551615")), Some(i64::MAX));
        assert_eq!(
            saturating_count(&v("-99999999999999999999")),
            Some(i64::MIN)
        );
        assert_eq!(saturating_count(&v("1e400")), Some(i64::MAX));
        assert_eq!(saturating_count(&v("2.9")), Some(2));
        assert_eq!(saturating_count(&v("\"3\"")), None);
        assert!(checked_seconds("t", &v("1e300"), 0.001, 10.0).is_err());
        assert!(checked_seconds("t", &v("-1"), 0.001, 10.0).is_err());
        assert!(checked_seconds("t", &v("1e400"), 0.001, 10.0).is_err());
        assert_eq!(checked_seconds("t", &v("2.5"), 0.001, 10.0), Ok(2.5));
        assert_eq!(valid_timestamp(&v("1e400")), None);
        assert_eq!(valid_timestamp(&v("-3.5")), None);
        assert_eq!(valid_timestamp(&v("1795291260.5")), Some(1795291260.5));
    }

    #[test]
    fn hostile_payloads_are_errors_not_panics() {
        let cases: &[(&[u8], &str)] = &[
            (b"not json", "not valid JSON"),
            (b"[1,2]", "not an object"),
            (b"{\"args\":[]}", "`class` is missing"),
            (b"{\"class\":5,\"args\":[]}", "not a string"),
            (b"{\"class\":\"A\",\"args\":{}}", "not an array"),
            (b"{\"class\":\"A\"}", "`args` is missing"),
            (b"{\"class\":\"A\",\"args\":[\xff]}", "UTF-8"),
        ];
        for (raw, want) in cases {
            let (back, e) = Job::parse(raw.to_vec(), LIMIT).unwrap_err();
            assert_eq!(&back, raw);
            assert!(e.to_string().contains(want), "{e} should say {want}");
        }
        let (_, e) = Job::parse(vec![b' '; 100], 10).unwrap_err();
        assert!(matches!(
            e,
            PayloadError::TooLarge {
                size: 100,
                limit: 10
            }
        ));
    }

    /// A wrapper's class is known as such however it is written: compared as bytes by the reader, or
    /// decoded first when escaped, or read by serde_json (a key the reader refuses: an escaped one).
    #[test]
    fn activejob_wrappers_are_known_however_the_class_is_written() {
        let job = |class: &str, more: &str| {
            let raw = format!(
                r#"{{"class":{class},"wrapped":"ReportJob","args":[{{"job_class":"ReportJob","job_id":"i","arguments":[],"executions":0}}]{more}}}"#
            );
            let job = Job::from_str(&raw).unwrap();
            (
                job.is_activejob(),
                job.worker_class().to_string(),
                job.job_data().is_some(),
            )
        };
        let wrapper = |found| (true, "ReportJob".to_string(), found);
        for name in ACTIVEJOB_WRAPPERS {
            assert_eq!(job(&format!(r#""{name}""#), ""), wrapper(true), "{name}");
            assert_eq!(job(&format!(r#" "{name}""#), ""), wrapper(true), "{name}");
            let escaped = format!(r#""{}""#, name.replacen('A', r"\u0041", 1));
            assert_eq!(job(&escaped, ""), wrapper(false), "{escaped}");
            let serde = format!(r#""{name}","\u0078":1"#);
            assert_eq!(job(&serde, ""), wrapper(false), "{serde}");
        }
        let plain = (false, "NoopJob".to_string(), false);
        assert_eq!(job(r#""NoopJob""#, ""), plain);
        assert!(!job(r#""Sidekiq::ActiveJob::WrapperX""#, "").0);
    }

    #[test]
    fn string_fields_are_read_in_place_or_decoded_when_escaped() {
        let job = Job::from_str(
            r#"{"class":"A\u0042","args":[],"jid":"j\"x","queue":"q\n","wrapped":"W"}"#,
        )
        .unwrap();
        assert_eq!(job.class(), "AB");
        assert_eq!(job.jid(), "j\"x");
        assert_eq!(job.queue(), Some("q\n"));
        assert_eq!(job.wrapped(), Some("W"));
        let plain =
            Job::from_str(r#"{"class":"C","args":[1],"jid":"abc","queue":"default"}"#).unwrap();
        assert_eq!(
            (plain.class(), plain.jid(), plain.queue()),
            ("C", "abc", Some("default"))
        );
        let bare = Job::from_str(r#"{"class":"C","args":[]}"#).unwrap();
        assert_eq!((bare.jid(), bare.queue(), bare.wrapped()), ("", None, None));
        for bad in [
            r#"{"class":"A","args":[],"jid":5}"#,
            r#"{"class":"A","args":[],"queue":["q"]}"#,
        ] {
            let e = Job::from_str(bad).unwrap_err();
            assert!(
                matches!(&e, PayloadError::Invalid(m) if m.contains("invalid type")),
                "{e}"
            );
        }
        assert!(matches!(
            Job::from_str(r#"{"class":"A","args":[],"jid":"\ud800"}"#),
            Err(PayloadError::InvalidJson(_))
        ));
    }

    #[test]
    fn to_map_keeps_unknown_keys_order_and_big_numbers() {
        let raw =
            r#"{"zeta":1,"class":"A","args":[12345678901234567890123],"alpha":{"x":1.0e+20}}"#;
        let job = Job::from_str(raw).unwrap();
        let map = job.to_map().unwrap();
        assert_eq!(serde_json::to_string(&map).unwrap(), raw);
    }

    #[test]
    fn jids_are_24_hex() {
        let j = new_jid();
        assert_eq!(j.len(), 24);
        assert!(
            j.chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
    }
}
