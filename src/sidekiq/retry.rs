//! What happens to a job that failed: the retry set, the dead set, or nothing, exactly as Ruby does it.
//!
//! Mirrors `job_retry.rb` (PROTOCOL §4). Retry wraps the middleware chain from outside: the processor
//! hands every failure here, with the worker's options. The retry entry is the original payload with every
//! key kept (order and number text too, thanks to `preserve_order` + `arbitrary_precision`), plus the
//! fields Ruby adds: `queue` (from `retry_queue`), `error_message` (10 000 characters at most),
//! `error_class`, `failed_at` or `retried_at`, `retry_count`, and `error_backtrace` when asked for.
//!
//! Where Sidekiq versions differ, the rules of the version the fleet runs ([`RetryRules`], chosen from the
//! live processes by [`crate::fleet`]):
//! - jitter: `rand(10) * (count + 1)` before 8.0, `rand(10 * (count + 1))` from 8.0 (`job_retry.rb`);
//! - `retry_for`: before 8.1 the count is checked first, then the time budget (`retry: 3, retry_for:
//!   1.week` dies after 3 retries); from 8.1 a `retry_for` job is judged by time alone (#6880).
//!
//! Always: `error_backtrace` is written in the strict Base64 form (Sidekiq 7.2.1+), which every version
//! reads, and not at all for an error without backtrace lines (Ruby would store a compressed `[]`, which
//! the UI shows as an empty box).

use std::io::Write;

use base64::Engine;
use rand::Rng;
use serde_json::{Map, Value};

use crate::error::{JobError, Result, RetryAction};
use crate::job::{
    Job, MAX_TIMESTAMP, RetrySetting, WorkerOptions, saturating_count, valid_timestamp,
};
use crate::keys;
use crate::redis_conn::Conn;
use crate::time::{TimeFormat, score};

/// Sidekiq's default maximum number of retries (`DEFAULT_MAX_RETRY_ATTEMPTS`).
pub(crate) const DEFAULT_MAX_RETRIES: i64 = 25;
/// Longest `error_message` stored (`exception.message.to_s[0, 10_000]`).
pub(crate) const MAX_ERROR_MESSAGE: usize = 10_000;
// Where a failed job ended: defined with the error kinds (the support layer), so that the
// Prometheus counters below this layer can count fates; kept at this path.
pub use crate::error::Fate;

/// The backoff before retry number `count` (0-based): `count**4 + 15 + jitter`.
pub(crate) fn backoff(count: i64, rules: RetryRules, rng: &mut impl Rng) -> f64 {
    backoff_base(count) + jitter(count, rules, rng)
}

/// `count**4 + 15`: Sidekiq's backoff before its jitter.
fn backoff_base(count: i64) -> f64 {
    (count.max(0) as f64).powi(4) + 15.0
}

/// The Sidekiq version whose retry rules apply (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RetryRules {
    /// 8.0+: jitter `rand(10 * (count + 1))`; before: `rand(10) * (count + 1)`.
    pub jitter_8: bool,
    /// 8.1+: a `retry_for` job is judged by its time budget alone; before: count first, then time.
    pub retry_for_only: bool,
}

impl RetryRules {
    /// The rules of Sidekiq `version` (`job_retry.rb@v7.3.9`, `@v8.0.0`, `@v8.1.0`).
    pub(crate) fn for_version(version: (u32, u32, u32)) -> Self {
        RetryRules {
            jitter_8: version.0 >= 8,
            retry_for_only: version >= (8, 1, 0),
        }
    }
}

impl Default for RetryRules {
    /// The newest rules (8.1), for a fleet without Ruby processes.
    fn default() -> Self {
        RetryRules::for_version((8, 1, 0))
    }
}

/// The jitter Ruby adds to every delay, a `sidekiq_retry_in` answer's included (`job_retry.rb
/// process_retry`): `rand(10) * (count + 1)` before 8.0 (multiples of `count + 1` up to `9 * (count + 1)`),
/// `rand(10 * (count + 1))` from 8.0 (any whole second below `10 * (count + 1)`).
fn jitter(count: i64, rules: RetryRules, rng: &mut impl Rng) -> f64 {
    let n = count.max(0).saturating_add(1);
    if rules.jitter_8 {
        rng.random_range(0..n.saturating_mul(10)) as f64
    } else {
        f64::from(rng.random_range(0..10u32)) * n as f64
    }
}

/// The largest jitter [`jitter`] adds before retry number `count`.
#[cfg(feature = "testing")]
fn jitter_max(count: i64, rules: RetryRules) -> f64 {
    let n = count.max(0).saturating_add(1);
    if rules.jitter_8 {
        n.saturating_mul(10).saturating_sub(1) as f64
    } else {
        9.0 * n as f64
    }
}

/// The earliest and the latest time [`plan`] may choose for retry number `count` of a job that
/// failed at `now` with `action` (the ends of the jitter's range): what a test can check, since the
/// jitter is random (`oxidekiq::testing`).
#[cfg(feature = "testing")]
pub(crate) fn retry_window(
    now: f64,
    count: i64,
    action: RetryAction,
    rules: RetryRules,
) -> (f64, f64) {
    let base = match action {
        RetryAction::In(secs) if secs > 0 => secs as f64,
        _ => backoff_base(count),
    };
    (
        bounded_at(now, base),
        bounded_at(now, base + jitter_max(count, rules)),
    )
}

/// Whether a job with `retry_count` now `count` has used up its retries (`job_retry.rb process_retry`):
/// before 8.1 `count >= max`, then `failed_at + retry_for < now`; from 8.1 only the latter when
/// `retry_for` is set, otherwise only the former.
fn exhausted_by_rules(
    rules: RetryRules,
    msg: &Map<String, Value>,
    count: i64,
    max: i64,
    now: f64,
) -> bool {
    let out_of_time = msg
        .get("retry_for")
        .and_then(Value::as_f64)
        // An infinite `retry_for` (a float text beyond f64) is no time budget at all: the count decides.
        .filter(|s| s.is_finite())
        .map(|retry_for| {
            let failed_at = msg
                .get("failed_at")
                .and_then(valid_timestamp)
                .unwrap_or(now);
            failed_at + retry_for < now
        });
    match (rules.retry_for_only, out_of_time) {
        (true, Some(t)) => t,
        (_, t) => count >= max || t.unwrap_or(false),
    }
}

/// `Base64(zlib(JSON.generate(lines)))`, the compressed form every Sidekiq reads as `error_backtrace`.
pub(crate) fn compress_backtrace(lines: &[String]) -> String {
    let json = serde_json::to_vec(lines).unwrap_or_else(|_| b"[]".to_vec());
    let mut enc = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    // Writing into a Vec cannot fail.
    let _ = enc.write_all(&json);
    let bytes = enc.finish().unwrap_or_default();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Reads an `error_backtrace` in any form Sidekiq wrote: strict or line-wrapped Base64 of zlib JSON,
/// or a raw JSON array (very old versions).
#[cfg(test)]
pub(crate) fn decompress_backtrace(v: &Value) -> Option<Vec<String>> {
    use std::io::Read;
    match v {
        Value::Array(_) => serde_json::from_value(v.clone()).ok(),
        Value::String(s) => {
            let clean: String = s.chars().filter(|c| !c.is_whitespace()).collect();
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(clean)
                .ok()?;
            let mut out = Vec::new();
            flate2::read::ZlibDecoder::new(&bytes[..])
                .read_to_end(&mut out)
                .ok()?;
            serde_json::from_slice(&out).ok()
        }
        _ => None,
    }
}

/// Everything that decides a failed job's fate, apart from Redis.
#[derive(Debug)]
pub(crate) struct Failure<'a> {
    /// The job as fetched.
    pub job: &'a Job,
    /// The queue it was fetched from.
    pub queue: &'a str,
    /// What went wrong.
    pub error: &'a JobError,
    /// The worker's options (`None` when no worker is registered for the class).
    pub options: Option<&'a WorkerOptions>,
    /// Now, in epoch seconds.
    pub now: f64,
    /// How to write `failed_at`/`retried_at`.
    pub time_format: TimeFormat,
    /// The retry rules of the version the fleet runs.
    pub rules: RetryRules,
}

/// What to write: computed without Redis so tests can check every rule.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Plan {
    /// `ZADD retry <at> <payload>`.
    Retry {
        /// The retry-set member.
        payload: String,
        /// Its score.
        at: f64,
        /// The new `retry_count`.
        count: i64,
    },
    /// The dead-set `MULTI`.
    Dead {
        /// The dead-set member.
        payload: String,
    },
    /// Nothing stored.
    Discard,
    /// `ZADD schedule <at> <original bytes>`.
    Reschedule {
        /// Its score.
        at: f64,
    },
    /// `ZADD schedule <at> <payload>`: the next run of an interrupted Continuable job (a new jid),
    /// and its until-executed lock passed to that jid in the same script.
    Continue {
        /// The schedule-set member.
        payload: String,
        /// Its score.
        at: f64,
        /// Its jid.
        jid: String,
        /// The lock the interrupted run holds, if any.
        lock: Option<crate::error::LockHandOver>,
    },
    /// `SADD queues <queue>`, `LPUSH queue:<queue> <payload>`: the payload with a new `enqueued_at`.
    Requeue {
        /// The queue's name.
        queue: String,
        /// The pushed payload.
        payload: String,
    },
}

impl Plan {
    /// The fate [`apply`] reports once this plan is written.
    pub(crate) fn fate(&self) -> Fate {
        match self {
            Plan::Retry { at, count, .. } => Fate::Retry {
                at: *at,
                count: *count,
            },
            Plan::Dead { .. } => Fate::Dead,
            Plan::Discard => Fate::Discarded,
            Plan::Reschedule { at } => Fate::Rescheduled { at: *at },
            Plan::Requeue { .. } => Fate::Requeued,
            Plan::Continue { at, jid, .. } => Fate::Continued {
                at: *at,
                jid: jid.clone(),
            },
        }
    }
}

/// Decides what Ruby's `JobRetry` would write for this failure.
pub(crate) fn plan(f: &Failure<'_>, rng: &mut impl Rng) -> Plan {
    match f.error.action {
        RetryAction::Reschedule(secs) => {
            return Plan::Reschedule {
                at: bounded_at(f.now, secs),
            };
        }
        RetryAction::Discard => return Plan::Discard,
        RetryAction::Requeue => return requeue_plan(f),
        RetryAction::Continue(at) => return continue_plan(f, at),
        _ => {}
    }
    let mut msg = match f.job.to_map() {
        Ok(m) => m,
        // A job that parsed once parses again; if not, the dead set keeps it whole.
        Err(_) => {
            return Plan::Dead {
                payload: f.job.raw().to_string(),
            };
        }
    };
    let setting = f
        .job
        .retry()
        .or_else(|| f.options.and_then(|o| o.retry))
        // Ruby counts an absent `retry` as false when the class cannot be loaded; we keep the job
        // instead (never lose a job we cannot run), with the default count.
        .unwrap_or(RetrySetting::Default);
    let max = match setting {
        RetrySetting::Disabled => return Plan::Discard,
        RetrySetting::Count(n) => n,
        RetrySetting::Default => DEFAULT_MAX_RETRIES,
    };

    let retry_queue = msg
        .get("retry_queue")
        .and_then(Value::as_str)
        .map(str::to_string)
        .or_else(|| f.options.and_then(|o| o.retry_queue.clone()))
        .unwrap_or_else(|| f.queue.to_string());
    msg.insert("queue".into(), Value::String(retry_queue));
    msg.insert(
        "error_message".into(),
        // The Web UI shows it: a Redis URL's password in a message is hidden, as in every log line.
        Value::String(cut_chars(
            &crate::redact::redact_urls_in(&f.error.message),
            MAX_ERROR_MESSAGE,
        )),
    );
    msg.insert("error_class".into(), Value::String(f.error.class.clone()));
    let now_v = f.time_format.value(f.now);
    // The payload's count is not trusted: a number beyond i64 (or near its end) saturates instead of
    // overflowing, and exhausts the retries as Ruby's Bignum arithmetic would.
    let count = match msg.get("retry_count").and_then(saturating_count) {
        Some(c) => {
            msg.insert("retried_at".into(), now_v);
            c.saturating_add(1)
        }
        None => {
            msg.insert("failed_at".into(), now_v);
            0
        }
    };
    msg.insert("retry_count".into(), Value::Number(count.into()));
    if let Some(lines) = backtrace_lines(&msg, f.options, &f.error.backtrace) {
        msg.insert(
            "error_backtrace".into(),
            Value::String(compress_backtrace(lines)),
        );
    }

    let exhausted = match f.error.action {
        RetryAction::Kill => true,
        _ => exhausted_by_rules(f.rules, &msg, count, max, f.now),
    };
    let payload = to_json(&msg);
    if exhausted {
        let dead_allowed = match msg.get("dead") {
            Some(Value::Bool(false)) => false,
            Some(_) => true,
            None => f.options.and_then(|o| o.dead).unwrap_or(true),
        };
        return if dead_allowed {
            Plan::Dead { payload }
        } else {
            Plan::Discard
        };
    }
    // A positive `sidekiq_retry_in` answer replaces `count**4 + 15`; zero falls back to it, as in Ruby.
    let delay = match f.error.action {
        RetryAction::In(secs) if secs > 0 => secs as f64 + jitter(count, f.rules, rng),
        _ => backoff(count, f.rules, rng),
    };
    Plan::Retry {
        payload,
        at: bounded_at(f.now, delay),
        count,
    }
}

/// `now + delay` as a score Redis accepts and Ruby's `Time.at` reads: a delay that is not a finite,
/// non-negative number (a worker's `reschedule(f64::NAN)`, a backoff from a huge `retry_count`) is cut
/// to 0 or to the year 9999, never left as `inf`/`NaN`, which `ZADD` refuses forever.
fn bounded_at(now: f64, delay: f64) -> f64 {
    let delay = if delay.is_nan() { 0.0 } else { delay.max(0.0) };
    (now + delay).min(MAX_TIMESTAMP.max(now))
}

/// The lines to store, or `None` when the `backtrace` option does not ask for them.
fn backtrace_lines<'e>(
    msg: &Map<String, Value>,
    options: Option<&WorkerOptions>,
    lines: &'e [String],
) -> Option<&'e [String]> {
    let limit = match msg.get("backtrace") {
        Some(Value::Bool(true)) => usize::MAX,
        Some(Value::Number(n)) => n.as_u64().map_or(0, |n| n as usize),
        Some(_) => 0,
        None => options.and_then(|o| o.backtrace).unwrap_or(0),
    };
    if limit == 0 || lines.is_empty() {
        // No lines: nothing to store (Ruby would store a compressed `[]`).
        return None;
    }
    Some(&lines[..lines.len().min(limit)])
}

fn cut_chars(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => s[..i].to_string(),
        None => s.to_string(),
    }
}

/// Serializes a payload map; a map of JSON values always serializes.
pub(crate) fn to_json(msg: &Map<String, Value>) -> String {
    serde_json::to_string(msg).unwrap_or_else(|_| "{}".to_string())
}

/// A fetched job's entry in this process's batch list under reliable fetch (`fetch/reliable.rs`): the job's
/// token. Every write that ends the job's stay in Redis consumes it in the same script (`FATE_LUA`),
/// so the fate is written at most once and a shutdown push-back, which moves only entries still there,
/// never duplicates a job whose fate landed. Basic fetch has no batch list, hence no token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Token {
    /// The batch list, `oxidekiq:batch:<identity>:<queue>:@<batch>` ([`keys::batch_list`]).
    pub working: String,
    /// The job's place in it (from its head).
    pub id: u64,
}

impl Token {
    /// The token of the unit fetched from `queue` under `id` by a process whose batch lists start with
    /// `working_prefix` (a unit id is the batch number above [`keys::PLACE_BITS`] bits of place).
    pub(crate) fn of(working_prefix: &str, queue: &str, id: u64) -> Token {
        Token {
            working: keys::batch_list(working_prefix, queue, id >> keys::PLACE_BITS),
            id: id & ((1 << keys::PLACE_BITS) - 1),
        }
    }
}

/// One fate write, then the end of the job's stay in its batch list, atomically. KEYS[1] is the batch
/// list and KEYS[5] its acks set (both ignored when ARGV[1], the job's place, is empty: basic fetch),
/// KEYS[2] the key written. A `zadd` with a KEYS[3] (an interrupted job's next run) also passes that
/// until-executed lock to the next run: if it holds ARGV[5] (the interrupted run's value) or nothing,
/// it becomes ARGV[6] (the next run's jid, as a push sets it) with `PX` ARGV[7]. An `ack` (a
/// discarded job) writes nothing but the end of the stay. Returns `{1, ''}` when it wrote; `{2, ''}` when the place was settled
/// already and the member is where this write puts it (an earlier try of this write, whose reply was
/// lost); `{0, ''}` when the place was settled already and the member is not there (a recovery or the
/// stop's push-back took the job back: nothing of this write is anywhere); `{0, error}` when refused.
/// An acks set of another type (a damaged key) can neither say the place is done nor take it: the
/// fate is written and the place left unmarked, as the acker drops that batch's ack (the damaged set
/// costs its batch's ack, not its jobs' fates; the list stays for the operator).
const FATE_LUA: &str = concat!(
    crate::lua::lua_common!(),
    r#"
local id = ARGV[1]
local op, member = ARGV[2], ARGV[3]
local marks = id ~= ''
if marks then
  local t = kind(KEYS[5])
  marks = t == 'set' or t == 'none'
end
if id ~= '' and (redis.call('LLEN', KEYS[1]) <= tonumber(id) or (marks and redis.call('SISMEMBER', KEYS[5], id) == 1)) then
  local found = false
  if op == 'zadd' or op == 'kill' then
    found = type(redis.pcall('ZSCORE', KEYS[2], member)) == 'string'
  elseif op == 'push' then
    found = type(redis.pcall('LPOS', KEYS[2], member, 'MAXLEN', 1000)) == 'number'
  end
  if found then return {2, ''} end
  return {0, ''}
end
if op == 'zadd' then
  local r = redis.pcall('ZADD', KEYS[2], ARGV[4], member)
  if failed(r) then return {0, KEYS[2] .. ' is a ' .. kind(KEYS[2]) .. ', not a sorted set: ' .. r.err} end
  if KEYS[3] ~= '' then
    local v = redis.pcall('GET', KEYS[3])
    if v == false or v == ARGV[5] then redis.call('SET', KEYS[3], ARGV[6], 'PX', ARGV[7]) end
  end
elseif op == 'kill' then
  local err = to_dead(KEYS[2], member, ARGV[4], ARGV[5], tonumber(ARGV[6]))
  if err then return {0, err} end
elseif op == 'push' then
  local err = push_job(KEYS[3], KEYS[2], ARGV[4], member)
  if err then return {0, err} end
  if ARGV[5] ~= '' then redis.pcall('HINCRBY', KEYS[4], ARGV[5], 1) end
elseif op ~= 'ack' then
  return {0, 'unknown fate write ' .. op}
end
if marks then redis.call('SADD', KEYS[5], id) end
return {1, ''}
"#
);

/// The script, sent by SHA1 (computed locally), with the body as fallback on `NOSCRIPT`.
static FATE: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(FATE_LUA));

/// What [`write_fate`] writes.
enum FateWrite<'a> {
    /// `ZADD key at member` (retry or schedule set), passing `lock` to the member's jid if given.
    Zadd {
        key: &'a str,
        at: f64,
        lock: Option<HandOver<'a>>,
    },
    /// `DeadSet#kill` at `now`.
    Dead { now: f64 },
    /// `SADD queues`, `LPUSH queue:<queue>`, and a count for `class` in [`keys::HANDOFF`] if given.
    Push {
        queue: &'a str,
        class: Option<&'a str>,
    },
    /// Nothing but the end of the job's stay (a discarded job).
    Ack,
}

/// An until-executed lock passed to the next run in its fate write ([`FATE_LUA`]).
struct HandOver<'a> {
    /// The lock and the interrupted run's value.
    lock: &'a crate::error::LockHandOver,
    /// The next run's jid.
    jid: &'a str,
    /// Its `PX`.
    px: u64,
}

/// The `PX` of a lock passed to a next run due at `at`, at `now`: the lock's TTL counted from the
/// time the run is due, as a push of a scheduled job sets it (`until_executed::push`), so the lock
/// outlives the wait before the run claims it.
pub(crate) fn hand_over_px(lock: &crate::error::LockHandOver, at: f64, now: f64) -> u64 {
    let wait = (at - now) * 1000.0;
    // `as` saturates (NaN is 0): a run already due waits nothing.
    lock.ttl_ms.saturating_add(wait.max(0.0).ceil() as u64)
}

/// What [`write_fate`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Written {
    /// Written now, and the token consumed.
    Now,
    /// The token was gone and the member is where this write puts it: an earlier try of the same
    /// write landed (its reply was lost).
    Before,
    /// The token was gone and the member is nowhere: a recovery or the stop's push-back took the job
    /// back before its fate was written. Nothing written. (A member an earlier try wrote that a poller
    /// or a fetch already moved on, or pushed more than 1000 places deep, reads so too: only the
    /// report differs, the write itself landed once. A discard's ack retried after a lost reply
    /// reads so always, having no member: its until-executed lock then lapses by its TTL.)
    TakenBack,
}

/// Runs [`FATE_LUA`]: whether `member` was written now, by an earlier try, or not at all (the job was
/// taken back). Without a token it always writes.
async fn write_fate(
    conn: &mut Conn,
    token: Option<&Token>,
    write: FateWrite<'_>,
    member: &[u8],
) -> Result<Written> {
    let mut inv = FATE.prepare_invoke();
    inv.key(token.map_or("", |t| t.working.as_str()));
    let acks = token.map(|t| keys::acks_of(&t.working)).unwrap_or_default();
    let id = token.map(|t| t.id.to_string()).unwrap_or_default();
    match write {
        FateWrite::Zadd { key, at, lock } => {
            inv.key(key)
                .key(lock.as_ref().map_or("", |h| h.lock.key.as_str()))
                .key("")
                .key(&acks);
            inv.arg(id).arg("zadd").arg(member).arg(score(at));
            if let Some(h) = lock {
                inv.arg(&h.lock.value).arg(h.jid).arg(h.px);
            }
        }
        FateWrite::Dead { now } => {
            let (trim_before, dead_max) = crate::lua::dead_trim(now);
            inv.key(keys::DEAD).key("").key("").key(&acks);
            inv.arg(id)
                .arg("kill")
                .arg(member)
                .arg(score(now))
                .arg(trim_before)
                .arg(dead_max);
        }
        FateWrite::Push { queue, class } => {
            inv.key(keys::queue(queue))
                .key(keys::QUEUES)
                .key(keys::HANDOFF)
                .key(&acks)
                .arg(id)
                .arg("push")
                .arg(member)
                .arg(queue)
                .arg(class.unwrap_or(""));
        }
        FateWrite::Ack => {
            inv.key("").key("").key("").key(&acks);
            inv.arg(id).arg("ack").arg("");
        }
    }
    let (written, err): (u8, String) = inv.invoke_async(conn).await?;
    if !err.is_empty() {
        return Err(crate::lua::script_error(err));
    }
    Ok(match written {
        1 => Written::Now,
        2 => {
            tracing::info!(
                "the job's fate was written by an earlier try whose reply was lost; nothing written again"
            );
            Written::Before
        }
        _ => {
            tracing::info!(
                "the job's working entry was taken back (a recovery or the stop's push-back returned \
                it) before its fate was written; nothing written"
            );
            Written::TakenBack
        }
    })
}

/// The push-back of an interrupted iterable job, as Sidekiq 8's `InterruptHandler` does it
/// (`Sidekiq::Client#push` of the job hash it was given): the same payload, every key and byte kept
/// but `enqueued_at`, set to now, to the end of the queue it was fetched from (where the processes of
/// this fleet read it; for a plain Sidekiq job that is its `queue`). A payload that no longer parses
/// (it parsed once) goes back byte for byte.
fn requeue_plan(f: &Failure<'_>) -> Plan {
    let payload = match f.job.to_map() {
        Ok(mut msg) => {
            msg.insert("enqueued_at".into(), f.time_format.value(f.now));
            to_json(&msg)
        }
        Err(_) => f.job.raw().to_string(),
    };
    Plan::Requeue {
        queue: f.queue.to_string(),
        payload,
    }
}

/// The push of a Continuable job's next run (`retry_job` at an interrupt): a new Sidekiq job (new
/// jid, `created_at` now) carrying the `job_data` the wrapper built, for the schedule set at `at`.
/// Without that `job_data` (an action set by hand) or a payload that no longer parses, the payload
/// is rescheduled as it is.
fn continue_plan(f: &Failure<'_>, at: f64) -> Plan {
    let at = bounded_at(at, 0.0);
    match (&f.error.resume, f.job.to_map()) {
        (Some(resume), Ok(msg)) => {
            let jid = crate::job::new_jid();
            let created_at = f.time_format.value(f.now);
            let msg =
                crate::activejob::resumed_payload(&msg, resume.job_data.clone(), &jid, created_at);
            Plan::Continue {
                payload: to_json(&msg),
                at,
                jid,
                lock: resume.lock.clone(),
            }
        }
        _ => Plan::Reschedule { at },
    }
}

/// Writes the plan to Redis, consuming the job's `token` in the same script (see [`Token`]). The ack of
/// the fetched job must come after this returns. The fate written (now, or by an earlier try of the
/// same write whose reply was lost), or `None` when nothing of it was written because the job was taken
/// back first (a recovery or the stop's push-back returned it to its queue): the run then has no fate
/// of its own, and nothing may act on the plan's (a Continuable job's next run is nowhere).
pub(crate) async fn apply(
    conn: &mut Conn,
    job: &Job,
    plan: &Plan,
    now: f64,
    token: Option<&Token>,
) -> Result<Option<Fate>> {
    let written = match plan {
        Plan::Retry { payload, at, .. } => {
            let write = FateWrite::Zadd {
                key: keys::RETRY,
                at: *at,
                lock: None,
            };
            write_fate(conn, token, write, payload.as_bytes()).await?
        }
        Plan::Dead { payload } => {
            let write = FateWrite::Dead { now };
            write_fate(conn, token, write, payload.as_bytes()).await?
        }
        // Nothing written: the end of the stay (the token's place added to its acks set) is all
        // there is to do, and only it tells a job taken back meanwhile (its until-executed lock then
        // stays, for the run of the job in its queue again). Without a token there is nothing to ask.
        Plan::Discard => match token {
            Some(_) => write_fate(conn, token, FateWrite::Ack, b"").await?,
            None => Written::Now,
        },
        Plan::Reschedule { at } => {
            let write = FateWrite::Zadd {
                key: keys::SCHEDULE,
                at: *at,
                lock: None,
            };
            write_fate(conn, token, write, job.raw().as_bytes()).await?
        }
        // The next run in `schedule`, its lock, and the end of the running job's stay, in one script.
        Plan::Continue {
            payload,
            at,
            jid,
            lock,
        } => {
            let write = FateWrite::Zadd {
                key: keys::SCHEDULE,
                at: *at,
                lock: lock.as_ref().map(|lock| HandOver {
                    lock,
                    jid,
                    px: hand_over_px(lock, *at, crate::time::now()),
                }),
            };
            write_fate(conn, token, write, payload.as_bytes()).await?
        }
        Plan::Requeue { queue, payload } => {
            let write = FateWrite::Push { queue, class: None };
            write_fate(conn, token, write, payload.as_bytes()).await?
        }
    };
    Ok((written != Written::TakenBack).then(|| plan.fate()))
}

/// `DeadSet#kill` (`job_retry.rb send_to_morgue`): adds the member and trims the set by age and size, in
/// one script (the one `to_dead` of [`crate::lua`], as the fetch, recovery and poller scripts). The one
/// Rust entry point for a dead-set write.
#[cfg(test)]
pub(crate) async fn send_to_morgue(conn: &mut Conn, payload: &[u8], now: f64) -> Result<()> {
    kill(conn, payload, now, None).await.map(|_| ())
}

/// [`send_to_morgue`] for a fetched job, consuming its `token` in the same script: false when the token
/// was already gone (nothing written).
pub(crate) async fn kill(
    conn: &mut Conn,
    payload: &[u8],
    now: f64,
    token: Option<&Token>,
) -> Result<bool> {
    let written = write_fate(conn, token, FateWrite::Dead { now }, payload).await?;
    Ok(written == Written::Now)
}

/// Pushes `payload` to `queue` as Ruby's client does (`SADD queues`, `LPUSH queue:<queue>`, the one
/// `push_job` of [`crate::lua`]), counting it
/// for `class` in [`keys::HANDOFF`] when given, and consuming the job's `token` in the same script: false
/// when the token was already gone (nothing pushed), so a retry after a lost reply never pushes twice.
pub(crate) async fn push_to_queue(
    conn: &mut Conn,
    queue: &str,
    payload: &[u8],
    class: Option<&str>,
    token: Option<&Token>,
) -> Result<bool> {
    let written = write_fate(conn, token, FateWrite::Push { queue, class }, payload).await?;
    Ok(written == Written::Now)
}

/// The dead-set member for a payload the runtime could not decode: the original bytes when they are not
/// a JSON object; otherwise the object with `error_class`, `error_message` and `failed_at` added.
pub(crate) fn undecodable_payload(raw: &[u8], error: &str, now: f64, tf: TimeFormat) -> Vec<u8> {
    let Ok(text) = std::str::from_utf8(raw) else {
        return raw.to_vec();
    };
    match serde_json::from_str::<Map<String, Value>>(text) {
        Ok(mut msg) => {
            msg.insert(
                "error_message".into(),
                Value::String(cut_chars(error, MAX_ERROR_MESSAGE)),
            );
            msg.insert(
                "error_class".into(),
                Value::String("Oxidekiq::InvalidPayload".into()),
            );
            msg.entry("failed_at").or_insert_with(|| tf.value(now));
            to_json(&msg).into_bytes()
        }
        Err(_) => raw.to_vec(),
    }
}

/// The window `oxidekiq::testing` reports is the jitter's whole range: every delay `plan` picks falls
/// in it, and both ends are reached, under both rule sets and for a `retry_in` answer.
#[cfg(test)]
mod tests_window {
    use super::*;

    #[test]
    fn every_retry_plan_falls_in_its_window_and_reaches_both_ends() {
        let job = Job::from_str(r#"{"class":"A","args":[],"jid":"j","retry_count":2}"#).unwrap();
        for rules in [RetryRules::for_version((7, 3, 9)), RetryRules::default()] {
            for action in [RetryAction::Default, RetryAction::In(100)] {
                let mut error = JobError::msg("x");
                error.action = action;
                let (earliest, latest) = retry_window(1000.0, 3, action, rules);
                let (mut low, mut high) = (f64::MAX, f64::MIN);
                let mut rng = rand::rng();
                for _ in 0..5000 {
                    let failure = Failure {
                        job: &job,
                        queue: "default",
                        error: &error,
                        options: None,
                        now: 1000.0,
                        time_format: TimeFormat::Seconds,
                        rules,
                    };
                    let Plan::Retry { at, count, .. } = plan(&failure, &mut rng) else {
                        panic!("not a retry")
                    };
                    assert_eq!(count, 3);
                    assert!(
                        (earliest..=latest).contains(&at),
                        "{at} outside {earliest}..={latest}"
                    );
                    (low, high) = (low.min(at), high.max(at));
                }
                assert_eq!((low, high), (earliest, latest), "{rules:?} {action:?}");
            }
        }
    }
}

// Moved from tests/dead_set.rs: the dead set's one writer, checked against Ruby's DeadSet (needs crate-internal items).
#[cfg(test)]
mod tests_dead_set;

// Moved from tests/ruby_retry.rs: retries and deaths as Ruby Sidekiq's API and Web UI read them (needs crate-internal items).
#[cfg(test)]
mod tests_ruby;

/// A fate write refused because Redis takes no writes for now is an outage (retried quietly), not a
/// damaged key (which parks the job, logs at error level and fails `/ready`): a server demoted to
/// replica by a failover answers `READONLY`, one short of `min-replicas-to-write` `NOREPLICAS`, and
/// the fate script's `pcall` sees both.
#[cfg(test)]
mod tests_outage {
    use super::*;
    use crate::test_support::RedisServer;
    use redis::Commands;

    #[tokio::test]
    async fn a_write_refused_by_a_replica_or_for_want_of_replicas_is_an_outage_a_damaged_key_is_not()
     {
        let master = RedisServer::start();
        let replica = RedisServer::start();
        let port = master.url().rsplit(':').next().unwrap().to_string();
        let _: () = redis::cmd("REPLICAOF")
            .arg("127.0.0.1")
            .arg(&port)
            .query(&mut replica.conn())
            .unwrap();
        let mut on_replica = replica.async_conn().await;
        let e = push_to_queue(&mut on_replica, "default", b"{}", None, None)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("READONLY"), "{e}");
        assert!(
            e.is_outage(),
            "a demoted server's refusal must be an outage: {e}"
        );

        let mut m = master.conn();
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("min-replicas-to-write")
            .arg("2")
            .query(&mut m)
            .unwrap();
        let mut on_master = master.async_conn().await;
        let e = kill(&mut on_master, b"{}", crate::time::now(), None)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("NOREPLICAS"), "{e}");
        assert!(e.is_outage(), "too few replicas must be an outage: {e}");

        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("min-replicas-to-write")
            .arg("0")
            .query(&mut m)
            .unwrap();
        let _: () = m.set(keys::QUEUES, "damaged").unwrap();
        let e = push_to_queue(&mut on_master, "default", b"{}", None, None)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("WRONGTYPE"), "{e}");
        assert!(!e.is_outage(), "a damaged key is no outage: {e}");
        let len: usize = m.llen("queue:default").unwrap();
        assert_eq!(len, 0, "nothing pushed past the damaged key");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn job(raw: &str) -> Job {
        Job::from_str(raw).unwrap()
    }

    fn run(raw: &str, err: JobError, opts: Option<&WorkerOptions>, now: f64) -> Plan {
        let j = job(raw);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        plan(
            &Failure {
                job: &j,
                queue: "default",
                error: &err,
                options: opts,
                now,
                time_format: TimeFormat::Seconds,
                rules: RetryRules::default(),
            },
            &mut rng,
        )
    }

    fn payload_of(p: &Plan) -> Map<String, Value> {
        match p {
            Plan::Retry { payload, .. } | Plan::Dead { payload } => {
                serde_json::from_str(payload).unwrap()
            }
            other => panic!("no payload in {other:?}"),
        }
    }

    #[test]
    fn first_failure_sets_failed_at_and_count_zero_and_keeps_unknown_keys() {
        let p = run(
            r#"{"retry":true,"queue":"default","args":[1],"class":"A","jid":"j","cattr":{"x":12345678901234567890123}}"#,
            JobError::new("ArgumentError", "boom"),
            None,
            1_700_000_000.5,
        );
        let Plan::Retry { at, count, payload } = &p else {
            panic!("{p:?}")
        };
        assert_eq!(*count, 0);
        assert!(*at >= 1_700_000_000.5 + 15.0 && *at < 1_700_000_000.5 + 25.0);
        assert!(payload.contains(r#""cattr":{"x":12345678901234567890123}"#));
        let m = payload_of(&p);
        assert_eq!(m["failed_at"].to_string(), "1700000000.5");
        assert_eq!(m["error_class"], "ArgumentError");
        assert!(m.get("retried_at").is_none());
    }

    #[test]
    fn later_failures_set_retried_at_and_increment() {
        let p = run(
            r#"{"retry":5,"queue":"q","args":[],"class":"A","retry_count":2,"failed_at":1.5}"#,
            JobError::msg("x"),
            None,
            100.0,
        );
        let m = payload_of(&p);
        assert_eq!(m["retry_count"], 3);
        assert_eq!(m["retried_at"].to_string(), "100.0");
        assert_eq!(m["failed_at"].to_string(), "1.5");
        let Plan::Retry { at, .. } = p else { panic!() };
        // 3**4 + 15 = 96, jitter below 10*4 (8.x rules, the default)
        assert!((196.0..=235.0).contains(&at), "{at}");
    }

    #[test]
    fn retry_zero_goes_straight_to_dead_and_false_is_dropped() {
        assert!(matches!(
            run(
                r#"{"retry":0,"args":[],"class":"A"}"#,
                JobError::msg("x"),
                None,
                1.0
            ),
            Plan::Dead { .. }
        ));
        assert_eq!(
            run(
                r#"{"retry":false,"args":[],"class":"A"}"#,
                JobError::msg("x"),
                None,
                1.0
            ),
            Plan::Discard
        );
        assert_eq!(
            run(
                r#"{"retry":0,"dead":false,"args":[],"class":"A"}"#,
                JobError::msg("x"),
                None,
                1.0
            ),
            Plan::Discard
        );
    }

    #[test]
    fn exhaustion_after_max_retries() {
        let raw = r#"{"retry":2,"args":[],"class":"A","retry_count":1}"#;
        assert!(matches!(
            run(raw, JobError::msg("x"), None, 1.0),
            Plan::Dead { .. }
        ));
        let raw = r#"{"retry":2,"args":[],"class":"A","retry_count":0}"#;
        assert!(matches!(
            run(raw, JobError::msg("x"), None, 1.0),
            Plan::Retry { count: 1, .. }
        ));
    }

    #[test]
    fn retry_queue_and_messages_are_cut_to_ten_thousand_chars() {
        let p = run(
            r#"{"retry":true,"retry_queue":"low","args":[],"class":"A","queue":"default"}"#,
            JobError::msg("é".repeat(20_000)),
            None,
            1.0,
        );
        let m = payload_of(&p);
        assert_eq!(m["queue"], "low");
        assert_eq!(m["error_message"].as_str().unwrap().chars().count(), 10_000);
    }

    #[test]
    fn worker_answers_retry_in_kill_and_discard() {
        let raw = r#"{"retry":true,"args":[],"class":"A"}"#;
        let Plan::Retry { at, .. } = run(raw, JobError::msg("x").retry_in(300), None, 10.0) else {
            panic!()
        };
        // 300 + rand(10) * (count + 1), count 0.
        assert!((310.0..=319.0).contains(&at) && at.fract() == 0.0, "{at}");
        let Plan::Retry { at, .. } = run(raw, JobError::msg("x").retry_in(0), None, 10.0) else {
            panic!()
        };
        assert!(
            (25.0..=34.0).contains(&at),
            "zero means the default backoff: {at}"
        );
        assert!(matches!(
            run(raw, JobError::msg("x").kill(), None, 1.0),
            Plan::Dead { .. }
        ));
        assert_eq!(
            run(raw, JobError::msg("x").discard(), None, 1.0),
            Plan::Discard
        );
    }

    #[test]
    fn retry_for_alone_decides_exhaustion() {
        let raw = r#"{"retry":true,"retry_for":60,"args":[],"class":"A","retry_count":0,"failed_at":1000.0}"#;
        assert!(matches!(
            run(raw, JobError::msg("x"), None, 1059.0),
            Plan::Retry { .. }
        ));
        assert!(matches!(
            run(raw, JobError::msg("x"), None, 1061.0),
            Plan::Dead { .. }
        ));
    }

    #[test]
    fn backtrace_option_stores_compressed_lines_ruby_can_read() {
        let lines: Vec<String> = (0..10).map(|i| format!("src/x.rs:{i}")).collect();
        let p = run(
            r#"{"retry":true,"backtrace":3,"args":[],"class":"A"}"#,
            JobError::msg("x").with_backtrace(lines.clone()),
            None,
            1.0,
        );
        let m = payload_of(&p);
        let back = decompress_backtrace(&m["error_backtrace"]).unwrap();
        assert_eq!(back, lines[..3].to_vec());
        // Sidekiq 7.3.9 wrote this one (line-wrapped Base64); we read it too.
        let fixture = include_str!(
            "../../fixtures/shared/sidekiq-7.3.9-server/retry_after_first_failure.json"
        );
        let m: Map<String, Value> = serde_json::from_str(fixture.trim()).unwrap();
        let lines = decompress_backtrace(&m["error_backtrace"]).unwrap();
        assert!(!lines.is_empty() && lines.len() <= 5, "{lines:?}");
    }

    #[test]
    fn payload_numbers_at_their_limits_neither_overflow_nor_stall_the_score() {
        // A count at the end of i64 (or beyond it) exhausts the retries, as Ruby's Bignum would.
        for count in [
            "9223372036854775807",
            "9223372036854775806",
            "1e400",
            "123456789012345678901234567890",
        ] {
            let raw = format!(r#"{{"retry":true,"args":[],"class":"A","retry_count":{count}}}"#);
            let p = run(&raw, JobError::msg("x"), None, 1.0);
            assert!(matches!(p, Plan::Dead { .. }), "{count}: {p:?}");
        }
        // With a retry limit at the end of i64 too, the job is retried at a finite score Redis accepts.
        let raw = r#"{"retry":99999999999999999999999,"args":[],"class":"A","retry_count":4000000000000000000}"#;
        let Plan::Retry { at, count, .. } = run(raw, JobError::msg("x"), None, 1.0) else {
            panic!()
        };
        assert_eq!(count, 4_000_000_000_000_000_001);
        assert_eq!(at, MAX_TIMESTAMP);
        // An infinite `retry_for` or `failed_at` is no time budget: the count decides.
        let raw = r#"{"retry":3,"retry_for":1e400,"failed_at":-1e400,"args":[],"class":"A","retry_count":0}"#;
        assert!(matches!(
            run(raw, JobError::msg("x"), None, 1e9),
            Plan::Retry { count: 1, .. }
        ));
        // A reschedule by NaN or infinity seconds still gets a score Redis accepts.
        let raw = r#"{"args":[],"class":"A"}"#;
        for (secs, want) in [
            (f64::NAN, 10.0),
            (f64::INFINITY, MAX_TIMESTAMP),
            (-5.0, 10.0),
        ] {
            let p = run(raw, JobError::reschedule(secs, "r"), None, 10.0);
            assert_eq!(p, Plan::Reschedule { at: want }, "{secs}");
        }
    }

    #[test]
    fn undecodable_objects_get_an_error_and_other_bytes_stay_as_they_are() {
        let out = undecodable_payload(
            b"{\"class\":5,\"args\":[]}",
            "class is not a string",
            1.0,
            TimeFormat::Seconds,
        );
        let m: Map<String, Value> = serde_json::from_slice(&out).unwrap();
        assert_eq!(m["error_message"], "class is not a string");
        assert_eq!(
            undecodable_payload(b"nope", "x", 1.0, TimeFormat::Seconds),
            b"nope"
        );
    }

    fn run_with(raw: &str, err: JobError, rules: RetryRules, now: f64, seed: u64) -> Plan {
        let j = job(raw);
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        plan(
            &Failure {
                job: &j,
                queue: "default",
                error: &err,
                options: None,
                now,
                time_format: TimeFormat::Seconds,
                rules,
            },
            &mut rng,
        )
    }

    #[test]
    fn retry_count_comes_first_before_8_1_and_retry_for_alone_from_8_1() {
        // `retry: 3, retry_for: 1.week`, third retry failing an hour after the first failure.
        let raw = r#"{"retry":3,"retry_for":604800,"args":[],"class":"A","retry_count":2,"failed_at":1000.0}"#;
        let v7 = RetryRules::for_version((7, 3, 9));
        let v80 = RetryRules::for_version((8, 0, 5));
        let v81 = RetryRules::for_version((8, 1, 7));
        assert!(matches!(
            run_with(raw, JobError::msg("x"), v7, 4600.0, 1),
            Plan::Dead { .. }
        ));
        assert!(matches!(
            run_with(raw, JobError::msg("x"), v80, 4600.0, 1),
            Plan::Dead { .. }
        ));
        assert!(matches!(
            run_with(raw, JobError::msg("x"), v81, 4600.0, 1),
            Plan::Retry { count: 3, .. }
        ));
        // Past the time budget every version gives up.
        for r in [v7, v80, v81] {
            assert!(matches!(
                run_with(raw, JobError::msg("x"), r, 1000.0 + 604801.0, 1),
                Plan::Dead { .. }
            ));
        }
    }

    #[test]
    fn jitter_follows_the_version() {
        let raw = r#"{"retry":true,"args":[],"class":"A","retry_count":2,"failed_at":1.0}"#;
        // count 3 after this failure: 3**4 + 15 = 96, then jitter.
        let jitters = |rules| -> Vec<i64> {
            (0..400)
                .map(
                    |seed| match run_with(raw, JobError::msg("x"), rules, 0.0, seed) {
                        Plan::Retry { at, .. } => at as i64 - 96,
                        p => panic!("{p:?}"),
                    },
                )
                .collect()
        };
        let v7 = jitters(RetryRules::for_version((7, 3, 9)));
        assert!(
            v7.iter().all(|j| j % 4 == 0 && (0..=36).contains(j)),
            "{v7:?}"
        );
        let v8 = jitters(RetryRules::for_version((8, 0, 0)));
        assert!(v8.iter().all(|j| (0..40).contains(j)), "{v8:?}");
        assert!(v8.iter().any(|j| j % 4 != 0), "{v8:?}");
    }

    #[test]
    fn an_error_without_backtrace_lines_stores_no_backtrace() {
        let p = run(
            r#"{"retry":true,"backtrace":true,"args":[],"class":"A"}"#,
            JobError::msg("x").with_backtrace(vec![]),
            None,
            1.0,
        );
        assert!(payload_of(&p).get("error_backtrace").is_none());
    }
}

/// Review (issue 39): what [`apply`] writes and reports for an interrupt, retried or taken back.
#[cfg(test)]
mod tests_review_continue {
    use super::*;
    use crate::test_support::RedisServer;
    use redis::Commands;

    /// The interrupt's write retried after a lost reply (the same plan, the same token) writes the
    /// next run once and reports it each time; a write refused (`schedule` of the wrong type) leaves
    /// the job held in its batch list and writes nothing, and the retry once the key is repaired
    /// writes it once.
    #[tokio::test]
    async fn the_interrupt_is_written_once_and_a_refused_write_keeps_the_job_held() {
        let redis = RedisServer::start();
        let mut c = redis.conn();
        let mut conn = redis.async_conn().await;
        let working = "oxidekiq:batch:testhost:1:abcdef:default:@1";
        let raw = r#"{"class":"A","args":[],"jid":"dddddddddddddddddddddddd","queue":"default"}"#;
        let _: () = c.rpush(working, vec![raw; 3]).unwrap();
        let job = Job::from_str(raw).unwrap();
        let token = Token {
            working: working.into(),
            id: 1,
        };
        let plan = Plan::Continue {
            payload: r#"{"class":"A","args":[],"jid":"eeeeeeeeeeeeeeeeeeeeeeee"}"#.into(),
            at: 2e9,
            jid: "eeeeeeeeeeeeeeeeeeeeeeee".into(),
            lock: None,
        };
        let acks = keys::acks_of(working);
        // `schedule` damaged: refused, nothing written, the place not acked.
        let _: () = c.set(keys::SCHEDULE, "oops").unwrap();
        assert!(
            apply(&mut conn, &job, &plan, 1e9, Some(&token))
                .await
                .is_err()
        );
        let acked: Vec<u64> = c.smembers(&acks).unwrap();
        assert!(acked.is_empty(), "{acked:?}");
        let _: () = c.del(keys::SCHEDULE).unwrap();
        // Repaired: written; then the retry after a "lost reply" writes nothing more, and reports
        // the fate its first try wrote.
        for _ in 0..2 {
            let fate = apply(&mut conn, &job, &plan, 1e9, Some(&token))
                .await
                .unwrap();
            assert_eq!(fate, Some(plan.fate()));
        }
        let scheduled: Vec<String> = c.zrange(keys::SCHEDULE, 0, -1).unwrap();
        assert_eq!(scheduled.len(), 1, "{scheduled:?}");
        let acked: Vec<u64> = c.smembers(&acks).unwrap();
        assert_eq!(acked, vec![1]);
    }

    /// An interrupted run's until-executed lock goes to the next run's jid in the script that
    /// schedules it: the lock is the next run's exactly when the next run is in `schedule`. A write
    /// refused, or a job taken back (the recovered job, the old jid, claims the lock it left), leaves
    /// the lock as it was; a lock another job holds is left alone; one that expired is set again.
    #[tokio::test]
    async fn the_lock_goes_to_the_next_run_in_the_fate_write_and_nowhere_else() {
        let redis = RedisServer::start();
        let mut c = redis.conn();
        let mut conn = redis.async_conn().await;
        let working = "oxidekiq:batch:testhost:1:abcdef:default:@1";
        let raw = r#"{"class":"A","args":[],"jid":"dddddddddddddddddddddddd","queue":"default"}"#;
        let _: () = c.rpush(working, vec![raw; 6]).unwrap();
        let job = Job::from_str(raw).unwrap();
        let key = "oxidekiq:lock:unique:A:x";
        let ran = "0123456789abcdef0123456789abcdef:dddddddddddddddddddddddd";
        let at = crate::time::now() + 60.0;
        let plan = |n: u8| {
            let jid = format!("{:0>24}", n);
            Plan::Continue {
                payload: format!(r#"{{"class":"A","args":[],"jid":"{jid}"}}"#),
                at,
                jid,
                lock: Some(crate::error::LockHandOver {
                    key: key.into(),
                    value: ran.into(),
                    ttl_ms: 600_000,
                }),
            }
        };
        let token = |id| Token {
            working: working.into(),
            id,
        };
        let held = |c: &mut redis::Connection| -> Option<String> { c.get(key).unwrap() };
        let _: () = c.set(key, ran).unwrap();

        // Refused (`schedule` damaged): the lock stays the interrupted run's.
        let _: () = c.set(keys::SCHEDULE, "oops").unwrap();
        assert!(
            apply(&mut conn, &job, &plan(1), 1e9, Some(&token(1)))
                .await
                .is_err()
        );
        assert_eq!(held(&mut c).as_deref(), Some(ran));
        let _: () = c.del(keys::SCHEDULE).unwrap();

        // Taken back (its place acked by the push-back): the lock stays the interrupted run's.
        let _: () = c.sadd(keys::acks_of(working), 2).unwrap();
        let fate = apply(&mut conn, &job, &plan(2), 1e9, Some(&token(2)))
            .await
            .unwrap();
        assert_eq!(fate, None);
        assert_eq!(held(&mut c).as_deref(), Some(ran));

        // Written: the next run is in `schedule` and the lock is its jid's, its TTL counted from the
        // time the next run is due (60 s from now).
        let fate = apply(&mut conn, &job, &plan(3), 1e9, Some(&token(3)))
            .await
            .unwrap();
        assert_eq!(fate, Some(plan(3).fate()));
        let next = format!("{:0>24}", 3);
        assert_eq!(held(&mut c), Some(next.clone()));
        let ttl: i64 = c.pttl(key).unwrap();
        assert!((655_000..=660_000).contains(&ttl), "{ttl}");
        let scheduled: Vec<String> = c.zrange(keys::SCHEDULE, 0, -1).unwrap();
        assert_eq!(scheduled.len(), 1, "{scheduled:?}");

        // Another job's lock is left alone (the next run is still written).
        let _: () = c.set(key, "ffffffffffffffffffffffff").unwrap();
        apply(&mut conn, &job, &plan(4), 1e9, Some(&token(4)))
            .await
            .unwrap();
        assert_eq!(held(&mut c).as_deref(), Some("ffffffffffffffffffffffff"));

        // An expired lock is set again for the next run, which is still pending.
        let _: () = c.del(key).unwrap();
        apply(&mut conn, &job, &plan(5), 1e9, Some(&token(5)))
            .await
            .unwrap();
        assert_eq!(held(&mut c), Some(format!("{:0>24}", 5)));
        let scheduled: usize = c.zcard(keys::SCHEDULE).unwrap();
        assert_eq!(scheduled, 3);
    }

    /// A fate written beside an acks set of the wrong type (issue 43, found by the chaos test): the
    /// script read the set with `SISMEMBER`, which raised, so the fate of every job of that batch that
    /// failed, was killed or handed off could never be written (retried until the stop pushed the
    /// job back to run again, its slot given up but its row left on the Busy page, `/ready` at 503).
    /// A damaged set costs only its batch's ack (docs/guarantees.md): the fate is written, the place
    /// not marked (the set cannot hold it), and the batch list stays for the operator.
    #[tokio::test]
    async fn a_fate_is_written_beside_a_damaged_acks_set() {
        let redis = RedisServer::start();
        let mut c = redis.conn();
        let mut conn = redis.async_conn().await;
        let working = "oxidekiq:batch:testhost:1:abcdef:default:@1";
        let raw = r#"{"class":"A","args":[],"jid":"dddddddddddddddddddddddd","queue":"default"}"#;
        let _: () = c.rpush(working, vec![raw; 3]).unwrap();
        let token = Token {
            working: working.into(),
            id: 1,
        };
        let acks = keys::acks_of(working);
        for (i, damage) in ["SET", "HSET", "ZADD", "RPUSH"].into_iter().enumerate() {
            let _: () = c.del(&acks).unwrap();
            let mut cmd = redis::cmd(damage);
            cmd.arg(&acks);
            match damage {
                "SET" => cmd.arg("damaged"),
                "HSET" => cmd.arg("f").arg("v"),
                "ZADD" => cmd.arg(1).arg("m"),
                _ => cmd.arg("x"),
            };
            let _: () = cmd.query(&mut c).unwrap();
            // A member of its own each time (the dead set would count one payload once).
            let payload = raw.replace("dddd", &format!("{i:04}"));
            let written = kill(&mut conn, payload.as_bytes(), 1e9, Some(&token)).await;
            assert!(
                matches!(written, Ok(true)),
                "acks set damaged with {damage}: {written:?}"
            );
            let dead: usize = c.zcard(keys::DEAD).unwrap();
            assert_eq!(dead, i + 1, "written to the dead set");
            let kind: String = redis::cmd("TYPE").arg(&acks).query(&mut c).unwrap();
            assert_ne!(kind, "set", "the damaged key is left as it is");
        }
        let held: usize = c.llen(working).unwrap();
        assert_eq!(held, 3, "the batch list stays for the operator");
    }

    /// REVIEW defect (fixed): `write_fate` answered false both when an earlier try had written the
    /// fate and when the job's working entry was taken back (a recovery or the stop's push-back
    /// returned it to its queue while the interrupt ran), and [`apply`] reported [`Fate::Continued`]
    /// with the plan's new jid either way. The processor then ran the `after_fate` hooks with a fate
    /// that was never written (the until-executed lock handed to a jid that exists nowhere; a
    /// continuation logged and counted). The script now says which: the place is settled and the
    /// member is where the write puts it (an earlier try), or it is not (taken back: `None`, no
    /// hooks). Failed before the fix: reported `Continued`.
    #[tokio::test]
    async fn an_interrupt_whose_job_was_taken_back_is_not_reported_as_continued() {
        let redis = RedisServer::start();
        let mut c = redis.conn();
        let mut conn = redis.async_conn().await;
        let raw = r#"{"class":"A","args":[],"jid":"dddddddddddddddddddddddd","queue":"default"}"#;
        let job = Job::from_str(raw).unwrap();
        // The batch list is gone: a recovery pushed the job back to its queue.
        let token = Token {
            working: "oxidekiq:batch:testhost:1:abcdef:default:@1".into(),
            id: 0,
        };
        let plan = Plan::Continue {
            payload: r#"{"class":"A","args":[],"jid":"eeeeeeeeeeeeeeeeeeeeeeee"}"#.into(),
            at: 2e9,
            jid: "eeeeeeeeeeeeeeeeeeeeeeee".into(),
            lock: None,
        };
        let fate = apply(&mut conn, &job, &plan, 1e9, Some(&token))
            .await
            .unwrap();
        let scheduled: Vec<String> = c.zrange(keys::SCHEDULE, 0, -1).unwrap();
        assert!(scheduled.is_empty(), "nothing written: {scheduled:?}");
        assert_eq!(
            fate, None,
            "reported {fate:?}, a next run that is nowhere (its jid gets the lock)"
        );
        // Its place acked by the stop's push-back (the list still there, the job back in its queue):
        // nothing written either.
        let working = "oxidekiq:batch:testhost:1:abcdef:default:@2";
        let _: () = c.rpush(working, vec![raw; 2]).unwrap();
        let _: () = c.sadd(keys::acks_of(working), 1).unwrap();
        let token = Token {
            working: working.into(),
            id: 1,
        };
        let fate = apply(&mut conn, &job, &plan, 1e9, Some(&token))
            .await
            .unwrap();
        assert_eq!(fate, None);
        let scheduled: Vec<String> = c.zrange(keys::SCHEDULE, 0, -1).unwrap();
        assert!(scheduled.is_empty(), "nothing written: {scheduled:?}");
        // A retry set, a dead set and a queue push taken back the same way are not reported either.
        let plans = [
            Plan::Retry {
                payload: raw.into(),
                at: 2e9,
                count: 0,
            },
            Plan::Dead {
                payload: raw.into(),
            },
            Plan::Requeue {
                queue: "default".into(),
                payload: raw.into(),
            },
        ];
        for plan in plans {
            let fate = apply(&mut conn, &job, &plan, 1e9, Some(&token))
                .await
                .unwrap();
            assert_eq!(fate, None, "{plan:?}");
        }
    }

    /// REVIEW defect (issue 39, fixed): a discard wrote nothing and [`apply`] reported
    /// [`Fate::Discarded`] without asking Redis, so a job taken back while it ran (a recovery or the
    /// stop's push-back returned it to its queue) was reported discarded and its until-executed hook
    /// released the lock while the job waited in its queue again (a duplicate push then accepted).
    /// The discard now ends the stay in the fate script: `None` when the place was settled already,
    /// and the place acked when it was not. Failed before the fix: reported `Some(Discarded)`.
    #[tokio::test]
    async fn a_discard_whose_job_was_taken_back_is_not_reported_as_discarded() {
        let redis = RedisServer::start();
        let mut c = redis.conn();
        let mut conn = redis.async_conn().await;
        let raw = r#"{"class":"A","args":[],"jid":"dddddddddddddddddddddddd","queue":"default"}"#;
        let job = Job::from_str(raw).unwrap();
        let working = "oxidekiq:batch:testhost:1:abcdef:default:@1";
        let token = |id| Token {
            working: working.into(),
            id,
        };
        // The batch list is gone: a recovery pushed the job back to its queue.
        let fate = apply(&mut conn, &job, &Plan::Discard, 1e9, Some(&token(0)))
            .await
            .unwrap();
        assert_eq!(
            fate, None,
            "a discard of a job that waits in its queue again"
        );
        // Its place acked by the stop's push-back: not reported either.
        let _: () = c.rpush(working, vec![raw; 3]).unwrap();
        let _: () = c.sadd(keys::acks_of(working), 1).unwrap();
        let fate = apply(&mut conn, &job, &Plan::Discard, 1e9, Some(&token(1)))
            .await
            .unwrap();
        assert_eq!(fate, None);
        // Still held: discarded, and its place acked in the same script.
        let fate = apply(&mut conn, &job, &Plan::Discard, 1e9, Some(&token(2)))
            .await
            .unwrap();
        assert_eq!(fate, Some(Fate::Discarded));
        let mut acked: Vec<u64> = c.smembers(keys::acks_of(working)).unwrap();
        acked.sort();
        assert_eq!(acked, vec![1, 2]);
        // Basic fetch (no token): discarded, nothing to ask.
        let fate = apply(&mut conn, &job, &Plan::Discard, 1e9, None)
            .await
            .unwrap();
        assert_eq!(fate, Some(Fate::Discarded));
    }

    /// Review (issue 39): a push-back (`Requeue`) retried after a lost reply, once more than 1000
    /// other jobs were pushed in front of it (`LPOS ... MAXLEN 1000` no longer sees it), is not
    /// written again: the place settled decides, the look-up only picks the report (then `None`,
    /// as for a job taken back; see [`Written::TakenBack`]).
    #[tokio::test]
    async fn a_retried_push_behind_a_thousand_others_is_written_once() {
        let redis = RedisServer::start();
        let mut c = redis.conn();
        let mut conn = redis.async_conn().await;
        let raw = r#"{"class":"A","args":[],"jid":"dddddddddddddddddddddddd","queue":"default"}"#;
        let job = Job::from_str(raw).unwrap();
        let working = "oxidekiq:batch:testhost:1:abcdef:default:@1";
        let _: () = c.rpush(working, vec![raw; 2]).unwrap();
        let token = Token {
            working: working.into(),
            id: 1,
        };
        let payload = r#"{"class":"A","args":[],"jid":"dddddddddddddddddddddddd","queue":"default","enqueued_at":1.5}"#;
        let plan = Plan::Requeue {
            queue: "default".into(),
            payload: payload.into(),
        };
        let first = apply(&mut conn, &job, &plan, 1e9, Some(&token))
            .await
            .unwrap();
        assert_eq!(first, Some(Fate::Requeued));
        let others: Vec<String> = (0..1001).map(|i| format!(r#"{{"jid":"{i}"}}"#)).collect();
        let _: () = c.lpush(keys::queue("default"), others).unwrap();
        let again = apply(&mut conn, &job, &plan, 1e9, Some(&token))
            .await
            .unwrap();
        let queued: Vec<String> = c.lrange(keys::queue("default"), 0, -1).unwrap();
        let copies = queued.iter().filter(|m| m.as_str() == payload).count();
        assert_eq!(copies, 1, "written {copies} times (reported {again:?})");
        assert_eq!(queued.len(), 1002);
    }

    /// Review (issue 39): an interrupted run's lock key holding another type (a hash) does not
    /// stop the fate write halfway: the next run is written and the place acked, the key left as it
    /// was.
    #[tokio::test]
    async fn a_lock_key_of_the_wrong_type_does_not_stop_the_interrupt_halfway() {
        let redis = RedisServer::start();
        let mut c = redis.conn();
        let mut conn = redis.async_conn().await;
        let working = "oxidekiq:batch:testhost:1:abcdef:default:@1";
        let raw = r#"{"class":"A","args":[],"jid":"dddddddddddddddddddddddd","queue":"default"}"#;
        let _: () = c.rpush(working, vec![raw; 2]).unwrap();
        let job = Job::from_str(raw).unwrap();
        let key = "oxidekiq:lock:unique:A:x";
        let _: () = c.hset(key, "f", "v").unwrap();
        let plan = Plan::Continue {
            payload: r#"{"class":"A","args":[],"jid":"eeeeeeeeeeeeeeeeeeeeeeee"}"#.into(),
            at: crate::time::now() + 5.0,
            jid: "eeeeeeeeeeeeeeeeeeeeeeee".into(),
            lock: Some(crate::error::LockHandOver {
                key: key.into(),
                value: "0123:dddddddddddddddddddddddd".into(),
                ttl_ms: 600_000,
            }),
        };
        let token = Token {
            working: working.into(),
            id: 1,
        };
        let fate = apply(&mut conn, &job, &plan, 1e9, Some(&token))
            .await
            .unwrap();
        assert_eq!(fate, Some(plan.fate()));
        let scheduled: usize = c.zcard(keys::SCHEDULE).unwrap();
        assert_eq!(scheduled, 1);
        let acked: Vec<u64> = c.smembers(keys::acks_of(working)).unwrap();
        assert_eq!(acked, vec![1]);
        let kind: String = redis::cmd("TYPE").arg(key).query(&mut c).unwrap();
        assert_eq!(kind, "hash");
    }
}
