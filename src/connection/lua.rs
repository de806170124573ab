//! The Lua shared by every script that writes a job somewhere: one writer for "add to the dead set" and
//! one for "push to a queue", so every path trims the dead set and registers a queue the same way.
//!
//! Every script takes the keys it touches as `KEYS[]` (built in Rust by [`crate::keys`]); these helpers
//! receive them as arguments and never spell a key name themselves.
//!
//! - `failed(r)` tells a `redis.pcall` error reply; `kind(key)` names a key's type for an error message.
//! - `annotate(j, class, msg, failed_at)` appends `error_class`/`error_message` (and `failed_at` when
//!   absent) to a payload that is a JSON object, without decoding it, as `processor.rs`
//!   `annotate_undecoded` does (Ruby's `JSON.parse` keeps the last of duplicate keys, so these win); a
//!   payload that is not an object keeps its bytes.
//! - `to_dead(dead, member, score, trim_before, dead_max)` is `DeadSet#kill` (`job_retry.rb
//!   send_to_morgue`, Sidekiq 6.4–8.1): `ZADD dead`, then trim by age (`dead_timeout_in_seconds`) and by
//!   size (`dead_max_jobs`). Returns an error text when the `ZADD` failed (nothing written), else nil.
//! - `push_job(queues, qkey, name, payload)` is `client.rb raw_push`: `SADD queues <name>`, then `LPUSH
//!   queue:<name>`. Returns an error text when a write failed, else nil.
//!
//! Every write goes through `pcall`, and the callers remove a job from where it was only after the write
//! succeeded: a failing write (a key of the wrong type, OOM) never leaves a job in no key.

use sha1::{Digest, Sha1};

use crate::encoding::hex;

/// The shared helpers, as a literal for `concat!` (scripts are `&'static str` sent by SHA1).
macro_rules! lua_common {
    () => {
        r#"
local function failed(r) return type(r) == 'table' and r.err ~= nil end
local function kind(key) return redis.call('TYPE', key).ok end
local function ws(b) return b == 32 or b == 9 or b == 10 or b == 13 end
local function annotate(j, class, msg, failed_at)
  local first, last = 1, #j
  while last > 0 and ws(string.byte(j, last)) do last = last - 1 end
  while first <= last and ws(string.byte(j, first)) do first = first + 1 end
  if last - first < 1 or string.byte(j, first) ~= 123 or string.byte(j, last) ~= 125 then return j end
  local inner = first + 1
  while inner < last and ws(string.byte(j, inner)) do inner = inner + 1 end
  local sep = ','
  if inner == last then sep = '' end
  local extra = sep .. '"error_class":' .. cjson.encode(class) .. ',"error_message":' .. cjson.encode(msg)
  if failed_at ~= '' and not string.find(j, '"failed_at"', 1, true) then
    extra = extra .. ',"failed_at":' .. failed_at
  end
  return string.sub(j, first, last - 1) .. extra .. '}'
end
local function to_dead(dead, member, score, trim_before, dead_max)
  local r = redis.pcall('ZADD', dead, score, member)
  if failed(r) then return dead .. ' is a ' .. kind(dead) .. ', not a sorted set: ' .. r.err end
  redis.pcall('ZREMRANGEBYSCORE', dead, '-inf', trim_before)
  redis.pcall('ZREMRANGEBYRANK', dead, 0, -dead_max)
  return nil
end
local function push_job(queues, qkey, name, payload)
  local r = redis.pcall('SADD', queues, name)
  if failed(r) then return queues .. ' is a ' .. kind(queues) .. ', not a set: ' .. r.err end
  r = redis.pcall('LPUSH', qkey, payload)
  if failed(r) then return qkey .. ' is a ' .. kind(qkey) .. ', not a list: ' .. r.err end
  return nil
end
"#
    };
}
pub(crate) use lua_common;

/// The SHA1 of a script's source in lowercase hex: the name `EVALSHA` and `SCRIPT LOAD` use for it.
pub fn script_sha1(source: &str) -> String {
    hex(&Sha1::digest(source.as_bytes()))
}

/// Dead jobs older than this are trimmed (`dead_timeout_in_seconds`, 180 days).
pub(crate) const DEAD_TIMEOUT_SECS: f64 = 180.0 * 24.0 * 3600.0;
/// The dead set keeps at most this many members (`dead_max_jobs`).
pub(crate) const DEAD_MAX_JOBS: i64 = 10_000;

/// The trim arguments every `to_dead` call takes after the member's score: the score below which members
/// are trimmed (`now - dead_timeout_in_seconds`) and the size limit (`dead_max_jobs`), as
/// `DeadSet#kill` computes them.
pub(crate) fn dead_trim(now: f64) -> (String, i64) {
    (crate::time::score(now - DEAD_TIMEOUT_SECS), DEAD_MAX_JOBS)
}

/// A Redis error carrying a script's own message (a key of the wrong type, named with its type).
///
/// A write the script's `pcall` saw refused for an outage (`READONLY` from a server demoted to replica by
/// a failover, `NOREPLICAS`, ...) keeps that code, so [`crate::Error::is_outage`] tells it apart from a
/// damaged key: it is retried quietly, where a damaged key parks its job and makes `/ready` fail.
pub(crate) fn script_error(msg: String) -> crate::Error {
    if let Some(code) = crate::error::outage_code_in(&msg) {
        // Parsed as Redis's own error line would be, so `code()` answers the code. One line: no CR/LF.
        let line = format!("-{code} {}\r\n", msg.replace(['\r', '\n'], " "));
        if let Ok(redis::Value::ServerError(e)) = redis::parse_redis_value(line.as_bytes()) {
            return crate::Error::Redis(e.into());
        }
    }
    crate::Error::Redis(redis::RedisError::from((
        redis::ErrorKind::UnexpectedReturnType,
        "a key has the wrong type",
        msg,
    )))
}
