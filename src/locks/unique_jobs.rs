//! sidekiq-unique-jobs on the server side: a job whose payload carries the gem's fields (`lock`,
//! `lock_digest`, ...) runs under the gem's own lock rules, leaving the gem's keys as a Ruby run
//! would (docs/unique-jobs-protocol.md, proven against the recordings in `fixtures/unique-jobs-*`).
//!
//! Layer 6 (locks), after `lock`: it uses the connection, the retry set's dead writer and the fleet
//! survey below it; the job chain calls `execute` around the rest of a job's chain.
//!
//! # Steps
//!
//! Each step of the gem is one call of a script of ours (never the gem's): `QUEUE_LUA` (the gem's
//! `queue`), `LOCK_LUA` (`lock`), `UNLOCK_LUA` (`unlock`, with the wake-up push `LPUSH
//! <d>:QUEUED 1`, `PEXPIRE 5000`), each writing the gem's changelog entry and `PUBLISH`. Between
//! `queue` and `lock` the gem moves a token from `:QUEUED` to `:PRIMED` with `BLMOVE`; a blocking
//! command would stall every job sharing the connection, so the move is an `LMOVE` tried again every
//! 50 ms until the gem's wait (`lock_timeout`, 0 → 1 s, 8.1 caps it at 5 s) is over. Scripts go by
//! `EVALSHA` with `EVAL` on `NOSCRIPT` ([`redis::Script`]). `lock_digest` is taken from the payload,
//! never recomputed.
//!
//! # Per lock type (§3 of the protocol page)
//!
//! - `until_executing`: unlock, perform; a failure (or panic) re-locks for the same jid.
//! - `until_executed`: the lock taken at push is checked; released after success; after a failure
//!   7.1 and 8.0 release it, 8.1 keeps it for the retry.
//! - `while_executing`: perform under `<d>:RUN`; released after the run, whatever its end. A job that
//!   cannot take `:RUN` meets the `on_conflict` server strategy (`Strategy`).
//! - `until_and_while_executing`: unlock `<d>`, then as `while_executing`; a failure re-locks `<d>`.
//! - `until_expired`: checked, never released (the keys expire).
//!
//! A job whose lock another jid holds (lost, reaped, expired and retaken) is not performed, as the gem
//! does; unlike the gem it is never silent: a warning names the class, jid, digest and what happened,
//! and `oxidekiq_unique_conflicts_total{class, strategy}` counts it.
//!
//! A Redis error in a step before the perform fails the job (retry path, nothing lost); one after it
//! (the release) is logged at error level naming the key, and the job stays done.

use std::future::Future;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use serde_json::{Map, Value};

use crate::config::UniqueJobsGem;
// A perform's panic is caught so the lock's clean-up runs before it goes on unwinding.
use crate::error::catch_unwind as guarded;
use crate::error::{JobError, JobResult, Result};
use crate::job::Job;
use crate::keys;
use crate::redis_conn::Conn;
use crate::time;

/// The payload field that makes a job the gem's.
pub(crate) const LOCK_DIGEST_FIELD: &str = "lock_digest";
/// The error class of the `raise` strategy, as the gem raises it.
pub(crate) const CONFLICT_CLASS: &str = "SidekiqUniqueJobs::Conflict";
/// The changelog's length (`max_history`, the gem's default).
const MAX_HISTORY: i64 = 1000;
/// How often the move from `:QUEUED` to `:PRIMED` is tried again while the gem's wait runs.
const MOVE_POLL: Duration = Duration::from_millis(50);
/// The longest wait for a lock in seconds (a day): a payload's `lock_timeout` can be any number
/// (1e300 reads as `i64::MAX`), and a deadline that far overflows `Instant` (a panic after the
/// queue step, which left the job's token in `:QUEUED` and the digest locked for good).
const MAX_WAIT_SECS: i64 = 86_400;

/// The longest `lock_ttl` honoured, in ms (100 years). A larger one (`1e300` reads as `i64::MAX`
/// seconds) would make PEXPIRE fail halfway through a script, after the lock's keys were written
/// without a TTL; Lua would also turn it into a float Redis refuses. The gem's client refuses such a
/// push, so only a hand-written payload gets here.
const MAX_TTL_MS: i64 = 100 * 365 * 86_400 * 1000;

/// The gem's lock types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LockType {
    /// Released before perform.
    UntilExecuting,
    /// Released after a successful perform.
    UntilExecuted,
    /// Held only while performing (`<d>:RUN`).
    WhileExecuting,
    /// Until executing, then while executing.
    UntilAndWhileExecuting,
    /// Never released by the server.
    UntilExpired,
}

impl LockType {
    fn named(name: &str) -> Option<LockType> {
        Some(match name {
            "until_executing" => LockType::UntilExecuting,
            "until_executed" => LockType::UntilExecuted,
            "while_executing" => LockType::WhileExecuting,
            "until_and_while_executing" => LockType::UntilAndWhileExecuting,
            "until_expired" => LockType::UntilExpired,
            _ => return None,
        })
    }
}

/// The gem's `on_conflict` server strategies (`on_conflict.rb`); `None` is the gem's default (no
/// strategy: the job is dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Strategy {
    /// No strategy given: dropped.
    None,
    /// `log`: dropped (the gem logs it).
    Log,
    /// `reject`: the payload goes to the dead set (`DeadSet#kill`).
    Reject,
    /// `reschedule`: a new job (new jid) of the same args `schedule_in` (5) seconds ahead.
    Reschedule,
    /// `raise`: the job fails with `SidekiqUniqueJobs::Conflict` (the retry path).
    Raise,
    /// `replace`: a queued job of the digest is deleted, then its lock, then this job runs.
    Replace,
}

impl Strategy {
    fn named(name: &str) -> Strategy {
        match name {
            "log" => Strategy::Log,
            "reject" => Strategy::Reject,
            "reschedule" => Strategy::Reschedule,
            "raise" => Strategy::Raise,
            "replace" => Strategy::Replace,
            _ => Strategy::None,
        }
    }

    /// The `strategy` label of the conflicts counter.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Strategy::None => "none",
            Strategy::Log => "log",
            Strategy::Reject => "reject",
            Strategy::Reschedule => "reschedule",
            Strategy::Raise => "raise",
            Strategy::Replace => "replace",
        }
    }
}

/// What the gem's fields of one payload ask for.
#[derive(Debug, Clone)]
pub(crate) struct Spec {
    /// The lock type.
    pub lock: LockType,
    /// The payload's `lock` text (the `type` the gem writes).
    lock_name: String,
    /// The digest without a `:RUN` suffix.
    pub digest: String,
    /// `lock_ttl` in milliseconds (0: none).
    pttl: i64,
    /// `lock_timeout` in seconds.
    timeout: i64,
    /// `lock_limit` (1 unless given).
    limit: i64,
    /// The server strategy.
    pub strategy: Strategy,
    /// `lock_info`: write `<d>:INFO`.
    info: bool,
    /// The job's `at` as the gem passes it (`lock_score`), or empty.
    score: String,
    /// The payload, to write `:INFO` and the payloads of the conflict strategies.
    map: Map<String, Value>,
}

/// An integer the way Ruby's `to_i` reads a JSON value (a float is cut, anything else is 0).
fn to_i(v: Option<&Value>) -> i64 {
    match v {
        Some(Value::Number(n)) => n
            .as_i64()
            .or_else(|| n.as_f64().filter(|f| f.is_finite()).map(|f| f as i64))
            .unwrap_or(0),
        Some(Value::String(s)) => s.trim().parse::<f64>().map_or(0, |f| f as i64),
        _ => 0,
    }
}

/// The cheap test before [`Spec::read`] parses the payload: false when it names neither
/// `lock_digest` nor a `lock` option at all, as for most jobs.
pub(crate) fn may_be_gems(job: &Job) -> bool {
    let raw = job.raw();
    raw.contains("\"lock_digest\"") || raw.contains("\"lock\":")
}

/// Whether a payload names one of the gem's lock types in `lock` without a usable `lock_digest` (none,
/// empty, not a string): the gem's server computes such a job's digest from the class (8.1's
/// `on_conflict: reschedule`, a client without the gem), which oxidekiq cannot.
pub(crate) fn lacks_digest(map: &Map<String, Value>) -> bool {
    let named = map
        .get("lock")
        .and_then(Value::as_str)
        .is_some_and(|l| LockType::named(l).is_some());
    named
        && map
            .get(LOCK_DIGEST_FIELD)
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
}

impl Spec {
    /// The gem's fields of `job`: `Ok(None)` for a job that is not the gem's (no `lock_digest`);
    /// `Err` when it is, but names a lock type the gem does not know (the gem raises too).
    pub(crate) fn read(job: &Job) -> std::result::Result<Option<Spec>, JobError> {
        if !may_be_gems(job) {
            return Ok(None);
        }
        let Ok(map) = job.to_map() else {
            return Ok(None);
        };
        let lock_name = map.get("lock").and_then(Value::as_str).unwrap_or_default();
        // Running a job that lacks its digest without the lock would break the lock's promise: it
        // fails instead, for Ruby to run (the hand-off gives it to Ruby before this).
        if lacks_digest(&map) {
            return Err(JobError::new(
                crate::error::INVALID_PAYLOAD,
                format!(
                    "sidekiq-unique-jobs lock `{lock_name}` without a {LOCK_DIGEST_FIELD}: the gem's \
                     server computes the digest from the class, which oxidekiq cannot; route this \
                     class to Ruby"
                ),
            ));
        }
        let Some(digest) = map.get(LOCK_DIGEST_FIELD).and_then(Value::as_str) else {
            return Ok(None);
        };
        let digest = digest
            .strip_suffix(keys::UNIQUE_RUN_SUFFIX)
            .unwrap_or(digest)
            .to_string();
        let Some(lock) = LockType::named(lock_name) else {
            return Err(JobError::new(
                crate::error::INVALID_PAYLOAD,
                format!(
                    "sidekiq-unique-jobs lock `{}` of digest {digest} is not a lock type oxidekiq knows \
                     (until_executing, until_executed, while_executing, until_and_while_executing, \
                     until_expired)",
                    crate::redact::clip(lock_name, 64)
                ),
            ));
        };
        let strategy = match map.get("on_conflict") {
            Some(Value::String(s)) => Strategy::named(s),
            Some(Value::Object(o)) => o
                .get("server")
                .and_then(Value::as_str)
                .map_or(Strategy::None, Strategy::named),
            _ => Strategy::None,
        };
        let limit = match to_i(map.get("lock_limit")) {
            n if n >= 1 => n,
            _ => 1,
        };
        let score = match map.get("at") {
            Some(Value::Number(n)) => n.to_string(),
            Some(Value::String(s)) => s.clone(),
            _ => String::new(),
        };
        Ok(Some(Spec {
            lock,
            lock_name: lock_name.to_string(),
            digest,
            pttl: to_i(map.get("lock_ttl"))
                .saturating_mul(1000)
                .clamp(0, MAX_TTL_MS),
            timeout: to_i(map.get("lock_timeout")).max(0),
            limit,
            strategy,
            info: map
                .get("lock_info")
                .is_some_and(|v| v.as_bool() == Some(true)),
            score,
            map,
        }))
    }

    /// The runtime lock's digest, `<d>:RUN`.
    pub(crate) fn run_digest(&self) -> String {
        format!("{}{}", self.digest, keys::UNIQUE_RUN_SUFFIX)
    }

    /// `<d>:INFO` as the gem writes it (`locksmith.rb lock_info`; 8.x adds `at`).
    fn info_json(&self, gem: UniqueJobsGem, now: f64) -> String {
        let field = |k: &str| self.map.get(k).cloned().unwrap_or(Value::Null);
        let mut info = Map::new();
        info.insert("worker".into(), field("class"));
        info.insert("queue".into(), field("queue"));
        info.insert("limit".into(), field("lock_limit"));
        info.insert("timeout".into(), field("lock_timeout"));
        info.insert("ttl".into(), field("lock_ttl"));
        info.insert("type".into(), Value::String(self.lock_name.clone()));
        info.insert("lock_args".into(), field("lock_args"));
        info.insert("time".into(), time::float_value(now));
        if gem != UniqueJobsGem::V7_1 {
            info.insert("at".into(), field("at"));
        }
        Value::Object(info).to_string()
    }

    /// The gem's wait for the lock in seconds: `lock_timeout`, 0 → 1, 8.1 caps it at 5 (and
    /// oxidekiq at [`MAX_WAIT_SECS`]).
    fn wait(&self, gem: UniqueJobsGem) -> Duration {
        let mut s = if self.timeout == 0 {
            1
        } else {
            self.timeout.min(MAX_WAIT_SECS)
        };
        if gem == UniqueJobsGem::V8_1 {
            s = s.min(5);
        }
        Duration::from_secs(u64::try_from(s).unwrap_or(1))
    }
}

/// Shared head of the scripts: the keys (the gem's order, [`keys::unique_family`]), the arguments
/// (jid, pttl, type, limit, lock score, now, max_history, gem release `71`/`80`/`81`, the script's
/// name in the changelog) and `note`, the changelog entry (`ZADD`, trim to `max_history`, `PUBLISH`).
macro_rules! uniq_head {
    () => {
        r"
local D, Q, P, L, I, CL, DG, EX = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local jid, pttl, ltype, limit, lscore = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4]), ARGV[5]
local now, history, gem, script = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8], ARGV[9]
local function note(message, prev)
  if not history or history <= 0 then return end
  local entry = cjson.encode({digest = D, job_id = jid, script = script, message = message, time = now, prev_jid = prev})
  redis.call('ZADD', CL, now, entry)
  redis.call('ZREMRANGEBYRANK', CL, 0, -history)
  redis.call('PUBLISH', CL, entry)
end
"
    };
}

/// The gem's `queue` step: the digest key names the jid that queues, and the jid joins `:QUEUED`;
/// returns the jid, or the holder's jid when the limit is reached (`Limit exceeded`). One deviation:
/// a jid the digest already names whose token is not in `:QUEUED` (gone, or left in `:PRIMED`) gets
/// it back there (see the script), so a run recovered after a crash between its queue and lock steps
/// is not dropped.
const QUEUE_LUA: &str = concat!(
    uniq_head!(),
    r"
if redis.call('HEXISTS', L, jid) == 1 then note('Duplicate') return jid end
local prev = redis.call('GET', D)
if not prev then
  redis.call('SET', D, jid)
elseif prev == jid then
  note('Duplicate')
  -- Unlike the gem: the digest names this jid, which holds no lock (a run cut short between its
  -- queue and lock steps, recovered). Its token in :QUEUED may be gone (a wake-up push's 5 s TTL
  -- took the list) or already moved to :PRIMED (cut after the move), and without it in :QUEUED the
  -- move finds nothing and the job would be dropped: it goes back to :QUEUED.
  if not redis.call('LPOS', Q, jid) then
    redis.call('LREM', P, 0, jid)
    redis.call('LPUSH', Q, jid)
  end
  return jid
elseif limit > redis.call('HLEN', L) and redis.call('LLEN', Q) < limit then
  redis.call('SET', D, jid)
else
  note('Limit exceeded', prev) return prev
end
redis.call('LPUSH', Q, jid)
if pttl and pttl > 0 then
  redis.call('PEXPIRE', D, pttl)
  redis.call('PEXPIRE', Q, pttl)
end
note('Queued')
return jid
"
);

/// The gem's `lock` step: the jid joins `:LOCKED` and the digests set (the expiring set for
/// `until_expired` with a TTL); the waiting lists are cleared (8.1: deleted; 7.1/8.0: this jid removed
/// and a 1 s TTL). Returns the jid, or nil when the limit is reached (`Limited`).
const LOCK_LUA: &str = concat!(
    uniq_head!(),
    r"
local single = gem == '81' and limit <= 1
local function clear_waits()
  if single then
    redis.call('UNLINK', Q, P)
  else
    redis.call('LREM', Q, -1, jid)
    redis.call('LREM', P, 1, jid)
  end
end
if redis.call('HEXISTS', L, jid) == 1 then note('Duplicate') clear_waits() return jid end
if redis.call('HLEN', L) >= limit then note('Limited') return false end
if ltype == 'until_expired' and pttl and pttl > 0 then
  redis.call('ZADD', EX, now + pttl, D)
else
  local score = now
  if gem ~= '71' and #lscore > 0 then score = lscore end
  redis.call('ZADD', DG, score, D)
end
redis.call('HSET', L, jid, now)
clear_waits()
if pttl and pttl > 0 then
  redis.call('PEXPIRE', D, pttl)
  redis.call('PEXPIRE', L, pttl)
  redis.call('PEXPIRE', I, pttl)
end
if gem ~= '81' then
  redis.call('PEXPIRE', Q, 1000)
  redis.call('PEXPIRE', P, 1000)
end
note('Locked')
return jid
"
);

/// The gem's `unlock` step. A jid that does not hold the lock while others wait or hold it yields
/// (nil; 8.0 answers the jid). Otherwise the lock's keys go (`until_expired` keeps `:LOCKED`), the
/// digest leaves the digests set, and the wake-up token is pushed: `LPUSH :QUEUED 1`, `PEXPIRE 5000`.
const UNLOCK_LUA: &str = concat!(
    uniq_head!(),
    r"
local holds = redis.call('HEXISTS', L, jid) == 1
local function busy()
  return redis.call('LLEN', Q) > 0 or redis.call('LLEN', P) > 0 or redis.call('HLEN', L) > 0
end
local function holders()
  return L .. ' (' .. table.concat(redis.call('HKEYS', L), ',') .. ',)'
end
if gem == '71' then
  if not holds and busy() then note('Yielding to: ' .. holders()) return false end
  redis.call('LREM', Q, -1, jid)
  redis.call('LREM', P, -1, jid)
else
  if gem == '80' or not holds then
    redis.call('LREM', Q, -1, jid)
    redis.call('LREM', P, -1, jid)
  end
  if not holds and busy() then
    if gem == '80' then note('Yielding to: ' .. holders()) return jid end
    note('Yielding to other lock holders') return false
  end
end
if gem == '81' then
  if ltype == 'until_expired' then
    redis.call('ZREM', DG, D)
  elseif limit > 1 then
    redis.call('HDEL', L, jid)
    local left = redis.call('HLEN', L)
    redis.call('UNLINK', D, I)
    if left < 1 then
      redis.call('UNLINK', L, P)
      redis.call('ZREM', DG, D)
    elseif redis.call('LLEN', P) == 0 then
      redis.call('UNLINK', P)
    end
  else
    redis.call('HDEL', L, jid)
    redis.call('UNLINK', D, I, L, P)
    redis.call('ZREM', DG, D)
  end
else
  if ltype ~= 'until_expired' then
    redis.call('UNLINK', D, I)
    redis.call('HDEL', L, jid)
  end
  local left = redis.call('HLEN', L)
  if left < 1 then redis.call('UNLINK', L) end
  if redis.call('LLEN', P) == 0 then redis.call('UNLINK', P) end
  if limit <= 1 and left <= 1 then redis.call('ZREM', DG, D) end
end
redis.call('LPUSH', Q, '1')
redis.call('PEXPIRE', Q, 5000)
note('Unlocked')
return jid
"
);

/// The gem's death handler (`delete_by_digest`), for the dead job's own locks only: each of the
/// digest `KEYS[1]` and its `:RUN` lock whose digest key or `:LOCKED` hash names the jid `ARGV[1]`
/// loses its keys and its entries in the digests sets (`KEYS[2]`, `KEYS[3]`). The gem deletes both
/// whoever holds them, so a job dying after another job of its digest took the `:RUN` lock frees that
/// running job's lock and lets a third run beside it: oxidekiq keeps a lock another jid holds.
/// Returns how many keys went.
const DELETE_LUA: &str = r"
local n = 0
for _, d in ipairs({KEYS[1], KEYS[1] .. ':RUN'}) do
  if redis.call('GET', d) == ARGV[1] or redis.call('HEXISTS', d .. ':LOCKED', ARGV[1]) == 1 then
    n = n + redis.call('UNLINK', d, d .. ':QUEUED', d .. ':PRIMED', d .. ':LOCKED', d .. ':INFO')
    redis.call('ZREM', KEYS[2], d)
    redis.call('ZREM', KEYS[3], d)
  end
end
return n
";

/// The `replace` strategy's first half (`delete_job_by_digest`): the first job naming the digest
/// `ARGV[1]` in the queue `KEYS[1]` (read 50 at a time), else in `schedule` (`KEYS[2]`), else in
/// `retry` (`KEYS[3]`), is removed and returned; then, if one was, the digest's lock keys are deleted
/// and its digests entry removed (`KEYS[4]`). Nil when no job names it.
const REPLACE_LUA: &str = r"
local d = ARGV[1]
local found = nil
local len = redis.call('LLEN', KEYS[1])
local i = 0
while i < len and not found do
  for _, item in ipairs(redis.call('LRANGE', KEYS[1], i, i + 49)) do
    if string.find(item, d, 1, true) then
      redis.call('LREM', KEYS[1], 1, item)
      found = item
      break
    end
  end
  i = i + 50
end
for _, set in ipairs({KEYS[2], KEYS[3]}) do
  if found then break end
  local cursor = '0'
  -- The digest matched as it is: its glob characters escaped (a '?' or '*' in it matched other jobs).
  local pattern = '*' .. string.gsub(d, '([%*%?%[%]\\])', '\\%1') .. '*'
  repeat
    local r = redis.call('ZSCAN', set, cursor, 'MATCH', pattern, 'COUNT', 100)
    cursor = r[1]
    if #r[2] > 0 then
      redis.call('ZREM', set, r[2][1])
      found = r[2][1]
    end
  until found or cursor == '0'
end
if not found then return false end
redis.call('UNLINK', d, d .. ':QUEUED', d .. ':PRIMED', d .. ':LOCKED')
redis.call('ZREM', KEYS[4], d)
return found
";

static QUEUE: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(QUEUE_LUA));
static LOCK: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(LOCK_LUA));
static UNLOCK: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(UNLOCK_LUA));
static DELETE: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(DELETE_LUA));
static REPLACE: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(REPLACE_LUA));

/// The release code the scripts branch on.
fn gem_code(gem: UniqueJobsGem) -> &'static str {
    match gem {
        UniqueJobsGem::V7_1 => "71",
        UniqueJobsGem::V8_0 => "80",
        UniqueJobsGem::V8_1 => "81",
    }
}

/// One of the gem's locks of a job: the digest (`<d>` or `<d>:RUN`) and the job's fields.
struct GemLock<'a> {
    spec: &'a Spec,
    digest: String,
    gem: UniqueJobsGem,
}

impl GemLock<'_> {
    /// Runs one step's script for `jid`: its answer (a jid), or `None`.
    async fn step(
        &self,
        conn: &Conn,
        script: &redis::Script,
        name: &str,
        jid: &str,
    ) -> Result<Option<String>> {
        let mut inv = script.prepare_invoke();
        for k in keys::unique_family(&self.digest) {
            inv.key(k);
        }
        inv.arg(jid)
            .arg(self.spec.pttl)
            .arg(&self.spec.lock_name)
            .arg(self.spec.limit)
            .arg(&self.spec.score)
            .arg(time::now().to_string())
            .arg(MAX_HISTORY)
            .arg(gem_code(self.gem))
            .arg(name);
        Ok(inv.invoke_async(&mut conn.clone()).await?)
    }

    /// The gem's `lock!` (`locksmith.rb`): held already by `jid` → true; else `queue`, `:INFO`, the
    /// move from `:QUEUED` to `:PRIMED` (tried for `wait`, once when `None`), `lock`. False when
    /// another jid holds it.
    async fn take(&self, conn: &Conn, jid: &str, wait: Option<Duration>) -> Result<bool> {
        let family = keys::unique_family(&self.digest);
        let [_, queued, primed, locked, info, ..] = &family;
        let mut c = conn.clone();
        let held: bool = redis::cmd("HEXISTS")
            .arg(locked)
            .arg(jid)
            .query_async(&mut c)
            .await?;
        if held {
            return Ok(true);
        }
        let queued_jid = self.step(conn, &QUEUE, "queue.lua", jid).await?;
        if !matches!(queued_jid.as_deref(), Some(j) if j == jid || j == "1") {
            return Ok(false);
        }
        if self.spec.info {
            let json = self.spec.info_json(self.gem, time::now());
            redis::cmd("SET")
                .arg(info)
                .arg(json)
                .query_async::<()>(&mut c)
                .await?;
        }
        let deadline = wait.map(|w| tokio::time::Instant::now() + w);
        let primed_jid = loop {
            let moved: Option<String> = redis::cmd("LMOVE")
                .arg(queued)
                .arg(primed)
                .arg("RIGHT")
                .arg("LEFT")
                .query_async(&mut c)
                .await?;
            match (moved, deadline) {
                (Some(m), _) => break m,
                (None, Some(d)) if tokio::time::Instant::now() < d => {
                    tokio::time::sleep(MOVE_POLL).await
                }
                (None, _) => return Ok(false),
            }
        };
        if primed_jid != jid && primed_jid != "1" {
            return Ok(false);
        }
        Ok(self.step(conn, &LOCK, "lock.lua", jid).await?.is_some())
    }

    /// The gem's `unlock`: the jid it answers (`None`: it yielded to other holders).
    async fn unlock(&self, conn: &Conn, jid: &str) -> Result<Option<String>> {
        self.step(conn, &UNLOCK, "unlock.lua", jid).await
    }

    /// [`GemLock::unlock`] after the perform: an error is logged (the job stays done or failed as it
    /// ended), naming the key.
    async fn release(&self, conn: &Conn, jid: &str) {
        if let Err(e) = self.unlock(conn, jid).await {
            tracing::error!(digest = %crate::redact::clip(&self.digest, crate::redact::NAME_CHARS), error = %e,
                "cannot release the sidekiq-unique-jobs lock {}: it stays until the gem's reaper frees it",
                self.digest);
        }
    }

    /// Takes the lock back for `jid` after a failed perform (`until_executing`,
    /// `until_and_while_executing`, as the gem's `lock(wait: …)`); an error is logged.
    async fn relock(&self, conn: &Conn, jid: &str) {
        match self.take(conn, jid, Some(Duration::from_secs(1))).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(digest = %crate::redact::clip(&self.digest, crate::redact::NAME_CHARS), jid,
                "sidekiq-unique-jobs lock (digest) not taken back after the failure: another job holds it")
            }
            Err(e) => {
                tracing::error!(digest = %crate::redact::clip(&self.digest, crate::redact::NAME_CHARS), error = %e,
                "cannot take the sidekiq-unique-jobs lock (digest) back after the failure")
            }
        }
    }
}

/// A Redis error in a step before the perform: the job fails with it (retry path, nothing lost).
fn step_failure(digest: &str, e: &crate::Error) -> JobError {
    JobError::new(
        "Oxidekiq::UniqueJobsError",
        format!("sidekiq-unique-jobs lock {digest}: {e}"),
    )
}

/// Which release of the gem a process follows: the configured one, or read once from Redis.
#[derive(Debug, Default)]
pub struct GemVersion {
    /// `--unique-jobs-version`.
    forced: Option<UniqueJobsGem>,
    /// The detected release (0: not yet).
    found: AtomicU8,
}

impl GemVersion {
    /// Follows `forced` if given, else what `detect` reads at the first gem job.
    pub fn new(forced: Option<UniqueJobsGem>) -> Self {
        GemVersion {
            forced,
            found: AtomicU8::new(0),
        }
    }

    /// The release to follow now; detected (and logged) at the first call without a forced one. A
    /// detection that fails follows 8.1 for this job and tries again at the next.
    pub(crate) async fn current(&self, conn: &Conn) -> UniqueJobsGem {
        if let Some(g) = self.forced {
            return g;
        }
        match self.found.load(Ordering::Relaxed) {
            71 => return UniqueJobsGem::V7_1,
            80 => return UniqueJobsGem::V8_0,
            81 => return UniqueJobsGem::V8_1,
            _ => {}
        }
        match detect(conn).await {
            Ok((g, why)) => {
                let code = match g {
                    UniqueJobsGem::V7_1 => 71,
                    UniqueJobsGem::V8_0 => 80,
                    UniqueJobsGem::V8_1 => 81,
                };
                if self.found.swap(code, Ordering::Relaxed) == 0 {
                    if why == LIVE_READ {
                        tracing::info!(
                            "sidekiq-unique-jobs: following the rules of gem {} ({why}; \
                             --unique-jobs-version sets it)",
                            g.name()
                        );
                    } else {
                        // A guess: a wrong one changes what a failure does to the lock (7.1 and
                        // 8.0 release it, 8.1 keeps it), so it is said where operators look.
                        tracing::warn!(
                            "sidekiq-unique-jobs: following the rules of gem {} as a guess ({why}; \
                             no {} in Redis): set --unique-jobs-version to the fleet's release",
                            g.name(),
                            keys::UNIQUE_LIVE_VERSION
                        );
                    }
                }
                g
            }
            Err(e) => {
                tracing::warn!(error = %e,
                    "cannot tell which sidekiq-unique-jobs release the fleet runs: 8.1's rules for now");
                UniqueJobsGem::V8_1
            }
        }
    }
}

/// Reads which release of the gem a fleet runs from what it writes (protocol §6): 8.1's client writes
/// `queue_and_lock.lua` changelog entries; a Ruby process older than Sidekiq 7 (or without a version)
/// means 7.1 (8.x needs Sidekiq ≥ 7); `queue.lua` client entries beside Sidekiq ≥ 7 mean 8.0 (or a
/// 7.1 release that allowed Sidekiq 7, whose server rules are the same); nothing to go on: 8.1.
///
/// Before all that, the release each Ruby server of the gem writes to `uniquejobs:live` at start
/// wins: the changelog alone cannot tell 8.1 from 8.0 when the fleet's locks are all runtime ones
/// (8.1's server writes `queue.lua` entries too, and so does oxidekiq).
pub(crate) async fn detect(conn: &Conn) -> Result<(UniqueJobsGem, &'static str)> {
    let mut c = conn.clone();
    let live: Option<String> = match redis::cmd("GET")
        .arg(keys::UNIQUE_LIVE_VERSION)
        .query_async(&mut c)
        .await
    {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(key = keys::UNIQUE_LIVE_VERSION, error = %e,
                "cannot read the sidekiq-unique-jobs release at {} (a string): guessing from the changelog",
                keys::UNIQUE_LIVE_VERSION);
            None
        }
    };
    if let Some(g) = live.as_deref().and_then(release_named) {
        return Ok((g, LIVE_READ));
    }
    let entries: Vec<String> = redis::cmd("ZREVRANGE")
        .arg(keys::UNIQUE_CHANGELOG)
        .arg(0)
        .arg(199)
        .query_async(&mut c)
        .await
        .unwrap_or_default();
    let script_of = |e: &String| {
        serde_json::from_str::<Value>(e)
            .ok()
            .and_then(|v| v.get("script").and_then(Value::as_str).map(str::to_string))
    };
    let scripts: Vec<String> = entries.iter().filter_map(script_of).collect();
    if scripts.iter().any(|s| s == "queue_and_lock.lua") {
        return Ok((
            UniqueJobsGem::V8_1,
            "the changelog holds 8.1's queue_and_lock entries",
        ));
    }
    let survey = crate::fleet::survey(&mut c).await?;
    if survey.unversioned || survey.oldest.is_some_and(|v| v.0 < 7) {
        return Ok((UniqueJobsGem::V7_1, "a Sidekiq older than 7 is alive"));
    }
    if scripts.iter().any(|s| s == "queue.lua") {
        return Ok((
            UniqueJobsGem::V8_0,
            "the changelog holds queue.lua entries beside Sidekiq 7 or later",
        ));
    }
    Ok((
        UniqueJobsGem::V8_1,
        "nothing in Redis tells the release apart: the newest",
    ))
}

/// [`detect`]'s reason when it read the release itself, not a guess from the changelog.
const LIVE_READ: &str = "uniquejobs:live, written by the gem's Ruby servers at start";

/// The rules a release of the gem (`7.1.33`, `8.0.13`, `8.1.0`) follows: 8.1 or later → 8.1, 8.0 →
/// 8.0, 7.x → 7.1 (the oldest oxidekiq knows); anything else is not a release.
fn release_named(v: &str) -> Option<UniqueJobsGem> {
    let mut parts = v.trim().split('.').map(str::parse::<u32>);
    match (
        parts.next()?.ok()?,
        parts.next().and_then(|m| m.ok()).unwrap_or(0),
    ) {
        (7, _) => Some(UniqueJobsGem::V7_1),
        (8, 0) => Some(UniqueJobsGem::V8_0),
        (m, _) if m >= 8 => Some(UniqueJobsGem::V8_1),
        _ => None,
    }
}

/// Runs `perform` under the gem's rules for `job`'s lock (a job without `lock_digest` just runs).
/// A panic in `perform` releases or takes back what the gem's `ensure`/`rescue` would, then goes on
/// unwinding (the processor makes it the job's failure).
pub(crate) async fn execute<F>(conn: &Conn, job: &Job, gem: UniqueJobsGem, perform: F) -> JobResult
where
    F: Future<Output = JobResult>,
{
    let spec = match Spec::read(job) {
        Ok(Some(spec)) => spec,
        Ok(None) => return perform.await,
        Err(e) => return Err(e),
    };
    let jid = job.jid();
    let main = GemLock {
        spec: &spec,
        digest: spec.digest.clone(),
        gem,
    };
    let run = GemLock {
        spec: &spec,
        digest: spec.run_digest(),
        gem,
    };
    match spec.lock {
        LockType::UntilExecuting => {
            main.unlock(conn, jid)
                .await
                .map_err(|e| step_failure(&main.digest, &e))?;
            let ended = guarded(std::pin::pin!(perform)).await;
            if !matches!(ended, Ok(Ok(()))) {
                main.relock(conn, jid).await;
            }
            resume(ended)
        }
        LockType::UntilExecuted | LockType::UntilExpired => {
            let taken = main
                .take(conn, jid, Some(spec.wait(gem)))
                .await
                .map_err(|e| step_failure(&main.digest, &e))?;
            if !taken {
                lost(job, &main.digest, "another job holds its lock");
                return Ok(());
            }
            if spec.lock == LockType::UntilExpired {
                return perform.await;
            }
            let ended = guarded(std::pin::pin!(perform)).await;
            if matches!(ended, Ok(Ok(()))) || gem != UniqueJobsGem::V8_1 {
                main.release(conn, jid).await;
            }
            resume(ended)
        }
        LockType::WhileExecuting => run_locked(conn, job, &spec, &run, perform).await,
        LockType::UntilAndWhileExecuting => {
            let unlocked = main
                .unlock(conn, jid)
                .await
                .map_err(|e| step_failure(&main.digest, &e))?;
            if unlocked.is_none() {
                lost(job, &main.digest, "another job holds its lock");
                return Ok(());
            }
            let ended = guarded(std::pin::pin!(run_locked(conn, job, &spec, &run, perform))).await;
            if !matches!(ended, Ok(Ok(()))) {
                main.relock(conn, jid).await;
            }
            resume(ended)
        }
    }
}

/// The `while_executing` part: perform under `<d>:RUN` and release it whatever the end; a job that
/// cannot take it meets the server strategy.
async fn run_locked<F>(
    conn: &Conn,
    job: &Job,
    spec: &Spec,
    run: &GemLock<'_>,
    perform: F,
) -> JobResult
where
    F: Future<Output = JobResult>,
{
    let jid = job.jid();
    let taken = run
        .take(conn, jid, Some(spec.wait(run.gem)))
        .await
        .map_err(|e| step_failure(&run.digest, &e))?;
    if !taken {
        return conflict(conn, job, spec, run, perform).await;
    }
    let ended = guarded(std::pin::pin!(perform)).await;
    run.release(conn, jid).await;
    resume(ended)
}

/// A job that cannot take its `:RUN` lock: counted, logged, then the `on_conflict` server strategy.
async fn conflict<F>(
    conn: &Conn,
    job: &Job,
    spec: &Spec,
    run: &GemLock<'_>,
    perform: F,
) -> JobResult
where
    F: Future<Output = JobResult>,
{
    let strategy = spec.strategy;
    crate::prom::metrics().unique_conflict(job.worker_class(), strategy.label());
    let class = crate::redact::clip(job.worker_class(), crate::redact::NAME_CHARS);
    let jid = crate::redact::clip(job.jid(), crate::redact::NAME_CHARS);
    let what = match strategy {
        Strategy::None | Strategy::Log => {
            "the job is dropped, as the gem drops it (counted as processed)"
        }
        Strategy::Reject => "the job goes to the dead set",
        Strategy::Reschedule => "a new job of the same arguments is scheduled",
        Strategy::Raise => "the job fails with SidekiqUniqueJobs::Conflict (retry)",
        Strategy::Replace => "a queued job of the digest is deleted and this one runs",
    };
    // Every value from the payload clipped (a digest can be megabytes), and named once.
    tracing::warn!(class = %class, jid = %jid, digest = %crate::redact::clip(&run.digest, crate::redact::NAME_CHARS), strategy = strategy.label(),
        "sidekiq-unique-jobs conflict: the job cannot take its lock (digest; another job runs); on_conflict {}: {what}",
        strategy.label());
    let now = time::now();
    let mut c = conn.clone();
    match strategy {
        Strategy::None | Strategy::Log => Ok(()),
        Strategy::Raise => Err(JobError::new(
            CONFLICT_CLASS,
            format!(
                "{class} {jid}: the lock {} is held by another job",
                run.digest
            ),
        )),
        Strategy::Reject => {
            let mut map = spec.map.clone();
            map.insert(LOCK_DIGEST_FIELD.into(), Value::String(run.digest.clone()));
            let payload = Value::Object(map).to_string();
            crate::retry::kill(&mut c, payload.as_bytes(), now, None)
                .await
                .map_err(|e| step_failure(&run.digest, &e))?;
            Ok(())
        }
        Strategy::Reschedule => reschedule(conn, spec, run.gem, now)
            .await
            .map_err(|e| step_failure(&run.digest, &e)),
        Strategy::Replace => {
            let mut inv = REPLACE.prepare_invoke();
            let queue = spec
                .map
                .get("queue")
                .and_then(Value::as_str)
                .unwrap_or("default");
            inv.key(keys::queue(queue))
                .key(keys::SCHEDULE)
                .key(keys::RETRY)
                .key(keys::UNIQUE_DIGESTS)
                .arg(&run.digest);
            let deleted: Option<String> = inv
                .invoke_async(&mut c)
                .await
                .map_err(|e| step_failure(&run.digest, &e.into()))?;
            match deleted {
                Some(_) => {
                    tracing::warn!(digest = %crate::redact::clip(&run.digest, crate::redact::NAME_CHARS),
                        class = %class, jid = %jid,
                        "on_conflict replace: deleted a job of the digest and its lock; the job runs");
                    perform.await
                }
                None => Ok(()),
            }
        }
    }
}

/// The `reschedule` strategy (`on_conflict/reschedule.rb`): `perform_in(schedule_in || 5)` with the
/// same args and a new jid. 7.1 and 8.0 push it through the gem's client middleware: an
/// `until_and_while_executing` job takes the client lock for the new jid; 8.1 marks it rescheduled,
/// so its client middleware adds no lock and no lock fields. Unlike 8.1, the new job keeps the lock
/// fields: 8.1's server middleware computes the digest again when the job runs, which oxidekiq never
/// does, so without `lock_digest` the new job would run in Rust without its runtime lock (a Ruby
/// server overwrites the fields, so they change nothing there).
async fn reschedule(conn: &Conn, spec: &Spec, gem: UniqueJobsGem, now: f64) -> Result<()> {
    let mut map = spec.map.clone();
    for k in [
        "enqueued_at",
        "error_message",
        "error_class",
        "error_backtrace",
        "failed_at",
        "retried_at",
        "retry_count",
        "at",
    ] {
        map.remove(k);
    }
    let jid = crate::job::new_jid();
    map.insert("jid".into(), Value::String(jid.clone()));
    let millis = map
        .get("created_at")
        .is_some_and(|v| v.as_i64().is_some() || v.as_u64().is_some());
    let tf = if millis {
        time::TimeFormat::Millis
    } else {
        time::TimeFormat::Seconds
    };
    map.insert("created_at".into(), tf.value(now));
    let delay = map
        .get("schedule_in")
        .and_then(Value::as_f64)
        .filter(|s| s.is_finite() && *s >= 0.0)
        .unwrap_or(5.0);
    // The gem's client sees the new job with its `at` (in `:INFO`, and 8.0's digests score).
    let at = now + delay;
    let mut client_map = map.clone();
    client_map.insert("at".into(), time::float_value(at));
    let rescheduled = Spec {
        map: client_map,
        score: time::score(at),
        ..spec.clone()
    };
    if gem != UniqueJobsGem::V8_1 && spec.lock == LockType::UntilAndWhileExecuting {
        let client = GemLock {
            spec: &rescheduled,
            digest: spec.digest.clone(),
            gem,
        };
        if !client.take(conn, &jid, None).await? {
            tracing::warn!(digest = %crate::redact::clip(&spec.digest, crate::redact::NAME_CHARS),
                "on_conflict reschedule: the new job's client lock on the digest is held by another job: \
                 not scheduled, as the gem's client refuses the push");
            return Ok(());
        }
    }
    let payload = Value::Object(map).to_string();
    let mut c = conn.clone();
    redis::cmd("ZADD")
        .arg(keys::SCHEDULE)
        .arg(time::score(at))
        .arg(payload)
        .query_async::<()>(&mut c)
        .await?;
    Ok(())
}

/// The gem's death handler: a job of the gem that dies (its retries exhausted) takes its locks
/// with it (`server.rb death_handler`, `delete_by_digest`), only those it holds itself
/// ([`DELETE_LUA`]). Errors are logged.
pub(crate) async fn delete_by_digest(conn: Conn, digest: String, jid: String) {
    let mut inv = DELETE.prepare_invoke();
    inv.key(&digest)
        .key(keys::UNIQUE_DIGESTS)
        .key(keys::UNIQUE_EXPIRING_DIGESTS)
        .arg(&jid);
    if let Err(e) = inv.invoke_async::<i64>(&mut conn.clone()).await {
        tracing::error!(digest = %crate::redact::clip(&digest, crate::redact::NAME_CHARS), error = %e,
            "cannot delete the sidekiq-unique-jobs lock {digest} of a dead job");
    }
}

/// A job not performed because its lock is held by another jid (the gem skips it silently): logged
/// and counted under the `lost` strategy.
fn lost(job: &Job, digest: &str, why: &str) {
    crate::prom::metrics().unique_conflict(job.worker_class(), "lost");
    let class = crate::redact::clip(job.worker_class(), crate::redact::NAME_CHARS);
    let jid = crate::redact::clip(job.jid(), crate::redact::NAME_CHARS);
    tracing::warn!(class = %class, jid = %jid, digest = %crate::redact::clip(digest, crate::redact::NAME_CHARS), strategy = "lost",
        "sidekiq-unique-jobs: {class} {jid} not performed: {why} ({digest}); the gem skips such a job too");
}

type Panic = Box<dyn std::any::Any + Send>;

/// The result of a [`guarded`] perform, a panic unwinding on.
fn resume(ended: std::result::Result<JobResult, Panic>) -> JobResult {
    match ended {
        Ok(r) => r,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 43 item 10: `replace` found a digest's job in `schedule`/`retry` with `ZSCAN MATCH *<d>*`,
    /// so a digest holding a glob character (`?`, `*`, `[`) matched, and deleted, another digest's job.
    #[test]
    fn replace_matches_a_digest_with_glob_characters_literally() {
        use redis::Commands;
        let redis = crate::test_support::RedisServer::start();
        let mut c = redis.conn();
        let other = r#"{"class":"X","jid":"other","lock_digest":"uniquejobs:abc[1]"}"#;
        let _: () = c.zadd("schedule", other, 1).unwrap();
        let replace = |c: &mut redis::Connection, d: &str| -> Option<String> {
            REPLACE
                .key("queue:default")
                .key("schedule")
                .key("retry")
                .key("uniquejobs:digests")
                .arg(d)
                .invoke(c)
                .unwrap()
        };
        for d in ["uniquejobs:a?c", "uniquejobs:a*", "uniquejobs:abc[1-9]"] {
            assert_eq!(replace(&mut c, d), None, "{d} matched another digest's job");
        }
        assert_eq!(c.zcard::<_, usize>("schedule").unwrap(), 1);
        let mine = r#"{"class":"X","jid":"mine","lock_digest":"uniquejobs:a?c\\*"}"#;
        let _: () = c.zadd("schedule", mine, 2).unwrap();
        assert_eq!(
            replace(&mut c, r"uniquejobs:a?c\\*").as_deref(),
            Some(mine),
            "its own job is found"
        );
        assert_eq!(c.zcard::<_, usize>("schedule").unwrap(), 1);
    }

    fn spec(json: &str) -> std::result::Result<Option<Spec>, JobError> {
        Spec::read(&Job::from_str(json).unwrap())
    }

    #[test]
    fn the_gems_fields_are_read_from_the_payload_and_the_digest_is_never_recomputed() {
        let s = spec(
            r#"{"class":"X","args":[1],"jid":"j","lock":"while_executing","lock_digest":"uniquejobs:ab:RUN",
               "lock_ttl":600,"lock_timeout":2,"on_conflict":{"client":"log","server":"reject"},"lock_info":true}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(s.lock, LockType::WhileExecuting);
        assert_eq!(s.digest, "uniquejobs:ab");
        assert_eq!(s.run_digest(), "uniquejobs:ab:RUN");
        assert_eq!((s.pttl, s.timeout, s.limit), (600_000, 2, 1));
        assert_eq!(s.strategy, Strategy::Reject);
        assert!(s.info);
        assert!(
            spec(r#"{"class":"X","args":["lock_digest"],"jid":"j"}"#)
                .unwrap()
                .is_none()
        );
        let e = spec(r#"{"class":"X","args":[],"jid":"j","lock":"sometimes","lock_digest":"u:1"}"#)
            .unwrap_err();
        assert!(e.message.contains("sometimes"), "{}", e.message);
        for digest in [
            "",
            r#","lock_digest":null"#,
            r#","lock_digest":"""#,
            r#","lock_digest":7"#,
        ] {
            let e = spec(&format!(
                r#"{{"class":"X","args":[],"jid":"j","lock":"while_executing"{digest}}}"#
            ))
            .unwrap_err();
            assert!(e.message.contains("without a lock_digest"), "{}", e.message);
        }
        assert!(
            spec(r#"{"class":"X","args":[],"jid":"j","lock":"mine"}"#)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn the_release_the_gem_writes_names_its_rules() {
        assert_eq!(release_named("7.1.33"), Some(UniqueJobsGem::V7_1));
        assert_eq!(release_named("8.0.13"), Some(UniqueJobsGem::V8_0));
        assert_eq!(release_named("8.1.0"), Some(UniqueJobsGem::V8_1));
        assert_eq!(release_named("9"), Some(UniqueJobsGem::V8_1));
        for v in ["", "6.0.0", "x", "-1.0"] {
            assert_eq!(release_named(v), None, "{v}");
        }
    }

    #[test]
    fn the_wait_follows_each_release() {
        let s = spec(r#"{"class":"X","args":[],"jid":"j","lock":"until_executed","lock_digest":"u:1","lock_timeout":30}"#)
            .unwrap()
            .unwrap();
        assert_eq!(s.wait(UniqueJobsGem::V8_1), Duration::from_secs(5));
        assert_eq!(s.wait(UniqueJobsGem::V7_1), Duration::from_secs(30));
        let s = spec(
            r#"{"class":"X","args":[],"jid":"j","lock":"until_executed","lock_digest":"u:1"}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(s.wait(UniqueJobsGem::V8_0), Duration::from_secs(1));
    }
}
