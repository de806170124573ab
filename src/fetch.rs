//! Taking jobs off the queues: reliable fetch (the default) and Sidekiq's basic `BRPOP` fetch.
//!
//! Mirrors `fetch.rb` (PROTOCOL §3). Queue order is Sidekiq's: strict when no queue has a weight, else a
//! weighted shuffle (`shuffle.uniq` over the list with each queue repeated `weight` times) on every fetch.
//!
//! **Reliable fetch** keeps the invariant "a fetched job is always somewhere in Redis". One Lua script
//! copies up to the number of free slots (at most [`MAX_BATCH`], and about [`BATCH_BYTES`] of payload)
//! from the queues into a working hash owned by this process (`oxidekiq:working:<identity>:<queue>`,
//! field = an id unique in the process, value = the exact bytes) and only then trims them from their
//! queue; a job leaves the working hash only once its fate is in Redis: the ack is an `HDEL` of short ids,
//! batched, so it costs Redis the same whatever the payload or the concurrency. The ids are a base and a
//! count, so no argument grows with `-c`. A payload over the size limit never leaves Redis: the script
//! moves it to the dead set with the error appended. When every queue is empty the fetcher blocks on
//! `BLMOVE` into a landing list (`oxidekiq:landing:<identity>:<queue>`, atomic too), which the next batch
//! script empties into the working hash first; an idle process costs Redis almost nothing and a new job
//! starts at once.
//!
//! The fetcher remembers every id it handed out and has not acknowledged or pushed back ("outstanding",
//! including the ids reserved by a fetch whose reply is on its way): [`Fetcher::reconcile`] and the
//! quiet/shutdown sweeps push back only entries outside that set, which are surely stranded (a fetch
//! whose reply was lost), never a job about to run or already acknowledged.
//!
//! A queue whose key has the wrong type (or whose working hash has) is skipped with an error naming the
//! key and its type, retried with backoff, while the other queues are served.
//!
//! Working hashes and landing lists of processes that are dead are pushed back by [`recover_orphans`];
//! whether a process is dead is decided inside the script, by Redis's clock, with a grace that lets a
//! process which merely could not beat (a Redis stall) reclaim its liveness key and keep its jobs. A count
//! per payload sends a job that kills every process it touches to the dead set instead of looping.
//!
//! **Basic fetch** is `BRPOP queue:a queue:b 2`: a killed process loses its in-flight jobs, as Sidekiq's
//! open-source fetch does; acks are no-ops.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::seq::SliceRandom;
use redis::{AsyncCommands, Script};
use tokio::time::Instant;

use crate::config::{FetchMode, QueueWeight};
use crate::error::Result;
pub use crate::keys::SUSPECTS;
use crate::keys::{self, RECOVERED};
use crate::redis_conn::Conn;
use crate::time::{self, TimeFormat, score};

/// One fetched job: the queue it came from, its id in the working hash, and its exact bytes.
#[derive(Debug, Clone)]
pub struct UnitOfWork {
    /// Queue name, without `queue:`.
    pub queue: Arc<str>,
    /// Field of the job in this process's working hash (0 with basic fetch).
    pub id: u64,
    /// The payload exactly as stored.
    pub raw: Vec<u8>,
}

/// A fetched job still held in Redis by this process: what an ack, a requeue or a reconcile needs.
#[derive(Debug, Clone)]
pub struct Held {
    /// Queue name.
    pub queue: Arc<str>,
    /// Field in the working hash.
    pub id: u64,
    /// The exact bytes.
    pub raw: Arc<[u8]>,
}

/// Most jobs one fetch takes, whatever `-c` is: one script's work stays bounded.
pub const MAX_BATCH: usize = 1000;

/// One fetch stops adding jobs once it holds this many payload bytes (it always takes at least one).
pub const BATCH_BYTES: usize = 32 * 1024 * 1024;

/// Longest pause of a queue whose key has the wrong type.
const MAX_STALL: Duration = Duration::from_secs(30);

/// Lua helpers shared by every script here. `failed` tells a `redis.pcall` error reply; `kind` names a
/// key's type for an error message; `annotate` appends `error_class`/`error_message` (and `failed_at`
/// when absent) to a payload that is a JSON object, without decoding it, as `processor.rs`
/// `annotate_undecoded` does (Ruby's `JSON.parse` keeps the last of duplicate keys, so these win; a
/// payload that is not an object keeps its bytes); `to_dead` is `DeadSet#kill` (`ZADD dead` + trim by
/// age and size, `job_retry.rb send_to_morgue`); `move_back` pushes every job of a working hash (newest
/// id first, so the oldest is served first) or landing list to the served end of a queue (`RPUSH`, as
/// Sidekiq's `bulk_requeue`), counting recoveries when `limit` >= 0. Every write comes before the matching
/// removal and goes through `pcall`: a write that fails (a key of the wrong type, OOM) stops the move and
/// removes only what was already written elsewhere, so no job is ever in no key.
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
local function to_dead(member, score, trim_before, dead_max)
  local r = redis.pcall('ZADD', 'dead', score, member)
  if failed(r) then return 'dead is a ' .. kind('dead') .. ', not a sorted set: ' .. r.err end
  redis.pcall('ZREMRANGEBYSCORE', 'dead', '-inf', trim_before)
  redis.pcall('ZREMRANGEBYRANK', 'dead', 0, -dead_max)
  return nil
end
local function move_back(src, qkey, limit, counts, score, trim_before, dead_max, failed_at, why)
  local t = kind(src)
  local fields, jobs = nil, {}
  if t == 'hash' then
    local all = redis.call('HGETALL', src)
    local pairs_ = {}
    for i = 1, #all, 2 do pairs_[#pairs_ + 1] = {tonumber(all[i]) or 0, all[i], all[i + 1]} end
    table.sort(pairs_, function(a, b) return a[1] > b[1] end)
    fields = {}
    for i, p in ipairs(pairs_) do fields[i] = p[2]; jobs[i] = p[3] end
  elseif t == 'list' then
    jobs = redis.call('LRANGE', src, 0, -1)
  elseif t == 'none' then
    return 0, 0, nil
  else
    return 0, 0, src .. ' is a ' .. t .. ', not a hash or a list'
  end
  local moved, killed, done, err = 0, 0, 0, nil
  for i = 1, #jobs do
    local j = jobs[i]
    local c, h = 1, nil
    if limit >= 0 then
      h = redis.sha1hex(j)
      c = (tonumber(redis.call('HGET', counts, h)) or 0) + 1
    end
    if limit >= 0 and c > limit then
      local msg = 'recovered ' .. (c - 1) .. ' times from processes that died while running it; ' .. why
      err = to_dead(annotate(j, 'Oxidekiq::TooManyRecoveries', msg, failed_at), score, trim_before, dead_max)
      if err then break end
      redis.pcall('HDEL', counts, h)
      killed = killed + 1
    else
      local r = redis.pcall('RPUSH', qkey, j)
      if failed(r) then err = qkey .. ' is a ' .. kind(qkey) .. ', not a list: ' .. r.err; break end
      if h then redis.pcall('HINCRBY', counts, h, 1) end
      moved = moved + 1
    end
    done = i
  end
  if done == #jobs then
    redis.call('DEL', src)
  elseif done > 0 then
    if fields then
      for s = 1, done, 1000 do redis.call('HDEL', src, unpack(fields, s, math.min(s + 999, done))) end
    else
      redis.call('LTRIM', src, done, -1)
    end
  end
  if limit >= 0 and done > 0 then redis.pcall('EXPIRE', counts, 604800) end
  return moved, killed, err
end
"#
    };
}
// The fate script (`retry.rs`) is built on the same helpers: one `to_dead`, one `failed`.
pub(crate) use lua_common;

/// The batch fetch. Takes up to ARGV[1] jobs from the queues ARGV[13 ..] (ARGV[12] of them, in order),
/// each queue's landing list (ARGV[3]..queue) first, into working hashes ARGV[2]..queue under the ids
/// ARGV[4], ARGV[4]+1, ... (so the arguments do not grow with `-c`). A job longer than ARGV[5] bytes (0:
/// no limit) goes straight to the dead set, annotated with an error naming this fetch (ARGV[7]/id) so
/// identical payloads stay distinct members (score ARGV[8], `failed_at` text ARGV[9], trimmed by ARGV[10]
/// and ARGV[11]); the batch stops once it holds ARGV[6] bytes. Jobs are read with `LRANGE`, written, and
/// only then trimmed from their list. A queue whose key (or working hash) has the wrong type is skipped
/// with an error; the others are served. Returns records: queue, first id, count, then that many jobs
/// (under consecutive ids) | queue, "dead", size | queue, "err", message.
const FETCH_LUA: &str = concat!(
    lua_common!(),
    r#"
local max = tonumber(ARGV[1])
local wprefix, lprefix = ARGV[2], ARGV[3]
local base = tonumber(ARGV[4])
local limit = tonumber(ARGV[5])
local budget = tonumber(ARGV[6])
local nonce = ARGV[7]
local score, failed_at, trim_before, dead_max = ARGV[8], ARGV[9], ARGV[10], tonumber(ARGV[11])
local nq = tonumber(ARGV[12])
local out = {}
local taken, bytes = 0, 0
local full = false
for i = 1, nq do
  if full or taken >= max then break end
  local q = ARGV[12 + i]
  if q == nil then break end
  local wk = wprefix .. q
  local sources = {lprefix .. q, 'queue:' .. q}
  for s = 1, 2 do
    if full or taken >= max then break end
    local src = sources[s]
    local done, pend, err = 0, {}, nil
    -- Writes the pending run (consecutive ids) and reports it as one record: queue, first id, count,
    -- then the jobs.
    local function flush()
      for c = 1, #pend, 1000 do
        local e = math.min(c + 999, #pend)
        local r = redis.pcall('HSET', wk, unpack(pend, c, e))
        if failed(r) then err = wk .. ' is a ' .. kind(wk) .. ', not a hash: ' .. r.err; return false end
        local n = (e - c + 1) / 2
        out[#out + 1] = q; out[#out + 1] = pend[c]; out[#out + 1] = tostring(n)
        for k = c + 1, e, 2 do out[#out + 1] = pend[k] end
        done = done + n
      end
      pend = {}
      return true
    end
    -- Read from the tail (RPOP's end, served first) in chunks sized by the largest job seen so far, so
    -- a run of huge payloads is read one at a time, never all at once.
    local read, biggest, more = 0, 0, true
    while more and not err and not full and taken < max do
      local chunk = max - taken
      if biggest == 0 then chunk = 1
      else chunk = math.max(1, math.min(chunk, math.floor((budget - bytes) / biggest))) end
      local jobs = redis.pcall('LRANGE', src, -(read + chunk), -(read + 1))
      if failed(jobs) then
        err = src .. ' is a ' .. kind(src) .. ', not a list: ' .. jobs.err
        break
      end
      if #jobs < chunk then more = false end
      read = read + #jobs
      for k = #jobs, 1, -1 do
        local job = jobs[k]
        local size = #job
        if size > biggest then biggest = size end
        local id = string.format('%d', base + taken)
        taken = taken + 1
        bytes = bytes + size
        if limit > 0 and size > limit then
          if not flush() then break end
          local msg = 'payload of ' .. size .. ' bytes is over the ' .. limit .. '-byte limit (fetch ' .. nonce .. '/' .. id .. ')'
          err = to_dead(annotate(job, 'Oxidekiq::InvalidPayload', msg, failed_at), score, trim_before, dead_max)
          if err then break end
          done = done + 1
          out[#out + 1] = q; out[#out + 1] = 'dead'; out[#out + 1] = tostring(size)
        else
          pend[#pend + 1] = id; pend[#pend + 1] = job
        end
        if bytes >= budget then full = true; break end
      end
    end
    if not err then flush() end
    if done > 0 then redis.call('LTRIM', src, 0, -(done + 1)) end
    if err then
      out[#out + 1] = q; out[#out + 1] = 'err'; out[#out + 1] = err
      break
    end
  end
end
return out
"#
);

/// Orphan recovery of one process, deciding inside the script whether it is dead. KEYS[1] is its liveness
/// key, KEYS[2] the hash of suspects (identity → Redis time in ms when first seen without a liveness key),
/// KEYS[3] the recovery counts, then pairs (working hash or landing list, its queue). ARGV: grace in ms,
/// recovery limit, dead score, `failed_at` text, dead trim score, dead max size, identity. A process
/// whose key exists is alive (its suspect mark goes); one first seen without it is only marked; only one
/// still without it a grace later (measured by Redis's own clock) has its jobs pushed back. So a process
/// that merely could not beat (a Redis stall longer than the TTL) re-sets its key on its next beat and
/// keeps its jobs. Returns {state (0 alive, 1 suspect, 2 recovered), moved, killed, error}.
const ORPHAN_LUA: &str = concat!(
    lua_common!(),
    r#"
-- TIME before writes needs effects replication (the only mode from Redis 7; opt-in before 5).
if redis.replicate_commands then redis.replicate_commands() end
local who = ARGV[7]
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HDEL', KEYS[2], who)
  return {0, 0, 0, ''}
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local since = tonumber(redis.call('HGET', KEYS[2], who))
if not since then
  redis.call('HSET', KEYS[2], who, string.format('%d', now_ms))
  return {1, 0, 0, ''}
end
if now_ms - since < tonumber(ARGV[1]) then return {1, 0, 0, ''} end
local limit = tonumber(ARGV[2])
local moved, killed, errs = 0, 0, {}
for i = 4, #KEYS, 2 do
  local m, k, err = move_back(KEYS[i], KEYS[i + 1], limit, KEYS[3], ARGV[3], ARGV[5], tonumber(ARGV[6]), ARGV[4],
    'sent to the dead set so it does not take down another process (last owner ' .. who .. ')')
  moved = moved + m
  killed = killed + k
  if err then errs[#errs + 1] = err end
end
if #errs == 0 then redis.call('HDEL', KEYS[2], who) end
return {2, moved, killed, table.concat(errs, '; ')}
"#
);

/// Pushes every job of this process's own KEYS[1] (landing list or working hash) back to queue KEYS[2],
/// without counting it as a recovery. Returns {moved, error}.
const MOVE_BACK_LUA: &str = concat!(
    lua_common!(),
    r#"
local m, _, err = move_back(KEYS[1], KEYS[2], -1, '', '0', '0', 0, '', '')
return {m, err or ''}
"#
);

/// Pushes back the fields ARGV of working hash KEYS[1] to the served end of queue KEYS[2], each only if
/// it is still there, the push before the removal. Returns {moved, error}.
const PUSH_BACK_LUA: &str = concat!(
    lua_common!(),
    r#"
local n = 0
for i = 1, #ARGV do
  local j = redis.call('HGET', KEYS[1], ARGV[i])
  if j then
    local r = redis.pcall('RPUSH', KEYS[2], j)
    if failed(r) then return {n, KEYS[2] .. ' is a ' .. kind(KEYS[2]) .. ', not a list: ' .. r.err} end
    redis.call('HDEL', KEYS[1], ARGV[i])
    n = n + 1
  end
end
return {n, ''}
"#
);

/// How often one payload may be recovered from a dead process before it goes to the dead set.
pub const MAX_RECOVERIES: i64 = 3;

/// A Redis error carrying a script's own message (a key of the wrong type, named with its type).
pub(crate) fn script_error(msg: String) -> crate::Error {
    crate::Error::Redis(redis::RedisError::from((
        redis::ErrorKind::UnexpectedReturnType,
        "a key has the wrong type",
        msg,
    )))
}

/// The queue order of one fetch, Sidekiq's way.
#[derive(Debug, Clone)]
pub struct QueueOrder {
    /// Distinct queue names, in configured order.
    names: Vec<Arc<str>>,
    /// Each queue repeated `max(weight, 1)` times, for the weighted shuffle; empty when strict.
    weighted: Vec<Arc<str>>,
}

impl QueueOrder {
    /// Builds the order from the configured queues.
    pub fn new(queues: &[QueueWeight]) -> Self {
        let mut names: Vec<Arc<str>> = Vec::new();
        for q in queues {
            if !names.iter().any(|n| **n == *q.name) {
                names.push(Arc::from(q.name.as_str()));
            }
        }
        let strict = queues.iter().all(|q| q.weight == 0);
        let weighted = if strict {
            Vec::new()
        } else {
            queues
                .iter()
                .flat_map(|q| {
                    std::iter::repeat_n(Arc::from(q.name.as_str()), q.weight.max(1) as usize)
                })
                .collect()
        };
        QueueOrder { names, weighted }
    }

    /// The queues to try, in order, for the next fetch.
    pub fn next(&self) -> Vec<Arc<str>> {
        if self.weighted.is_empty() {
            return self.names.clone();
        }
        let mut list = self.weighted.clone();
        list.shuffle(&mut rand::rng());
        let mut out: Vec<Arc<str>> = Vec::with_capacity(self.names.len());
        for q in list {
            if !out.contains(&q) {
                out.push(q);
            }
        }
        out
    }

    /// Every queue name.
    pub fn names(&self) -> &[Arc<str>] {
        &self.names
    }
}

/// Ids handed out and not yet acknowledged or pushed back, plus the id ranges reserved by fetches whose
/// reply has not arrived: what a sweep must never push back.
#[derive(Debug, Default)]
struct Outstanding {
    /// Ids of jobs handed out.
    ids: HashSet<u64>,
    /// `[start, end)` ranges of fetches in flight.
    pending: Vec<(u64, u64)>,
}

impl Outstanding {
    fn contains(&self, id: u64) -> bool {
        self.ids.contains(&id) || self.pending.iter().any(|(a, b)| (*a..*b).contains(&id))
    }
}

/// A queue paused after an error of its own (a key of the wrong type).
#[derive(Debug, Clone)]
struct Stall {
    /// Not fetched from before this.
    until: Instant,
    /// The next pause.
    backoff: Duration,
}

/// Drops a fetch's id reservation however the fetch ends (a cancelled fetch's ids count as never
/// handed out: whatever it moved is stranded and the next sweep pushes it back).
struct Reservation<'a> {
    fetcher: &'a Fetcher,
    range: (u64, u64),
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if let Ok(mut o) = self.fetcher.outstanding.lock() {
            o.pending.retain(|r| *r != self.range);
        }
    }
}

/// The fetcher of one process.
#[derive(Debug)]
pub struct Fetcher {
    /// Reliable or basic.
    mode: FetchMode,
    /// Queue order.
    order: QueueOrder,
    /// This process's identity, part of the note on an oversized job.
    identity: String,
    /// `oxidekiq:working:<identity>:`.
    working_prefix: String,
    /// `oxidekiq:landing:<identity>:`.
    landing_prefix: String,
    /// Each queue's working hash and landing list.
    keys: HashMap<Arc<str>, (String, String)>,
    /// Connection for the batch script, acks and requeues.
    conn: Conn,
    /// Dedicated connection for `BRPOP`/`BLMOVE`.
    blocking: Conn,
    /// The batch script (EVALSHA, loaded again on NOSCRIPT).
    script: Script,
    /// Next working-hash id to reserve.
    next_id: AtomicU64,
    /// How long one blocking wait may last.
    block: Duration,
    /// Payloads longer than this go to the dead set inside Redis (0: no limit).
    max_payload_bytes: usize,
    /// The live fleet, which decides how `failed_at` is written on such a payload (issue 13).
    fleet: Arc<crate::fleet::Fleet>,
    /// Ids that sweeps leave alone.
    outstanding: Mutex<Outstanding>,
    /// Queues paused after an error of their own.
    stalls: Mutex<HashMap<Arc<str>, Stall>>,
    /// Oversized jobs sent to the dead set since the last [`Fetcher::take_dead`].
    dead: AtomicU64,
}

impl Fetcher {
    /// A fetcher for `identity`'s process.
    pub fn new(
        mode: FetchMode,
        queues: &[QueueWeight],
        identity: &str,
        conn: Conn,
        blocking: Conn,
        block: Duration,
    ) -> Self {
        let order = QueueOrder::new(queues);
        let working_prefix = keys::working_prefix(identity);
        let landing_prefix = keys::landing_prefix(identity);
        let keys = order
            .names()
            .iter()
            .map(|q| {
                (
                    q.clone(),
                    (
                        format!("{working_prefix}{q}"),
                        format!("{landing_prefix}{q}"),
                    ),
                )
            })
            .collect();
        Fetcher {
            mode,
            order,
            identity: identity.to_string(),
            working_prefix,
            landing_prefix,
            keys,
            conn,
            blocking,
            script: Script::new(FETCH_LUA),
            next_id: AtomicU64::new(0),
            block,
            max_payload_bytes: 16 * 1024 * 1024,
            fleet: Arc::new(crate::fleet::Fleet::new(None)),
            outstanding: Mutex::new(Outstanding::default()),
            stalls: Mutex::new(HashMap::new()),
            dead: AtomicU64::new(0),
        }
    }

    /// Sets the payload size limit (0: none) and the fleet whose readers decide how `failed_at` is
    /// written on a payload over it.
    pub fn with_payload_limit(
        mut self,
        max_payload_bytes: usize,
        fleet: Arc<crate::fleet::Fleet>,
    ) -> Self {
        self.max_payload_bytes = max_payload_bytes;
        self.fleet = fleet;
        self
    }

    /// The fetch mode.
    pub fn mode(&self) -> FetchMode {
        self.mode
    }

    /// How many oversized jobs went to the dead set since the last call (for the processed/failed stats).
    pub fn take_dead(&self) -> u64 {
        self.dead.swap(0, Ordering::Relaxed)
    }

    /// How many ids are handed out and not yet acknowledged or pushed back.
    pub fn outstanding(&self) -> usize {
        self.outstanding.lock().map(|o| o.ids.len()).unwrap_or(0)
    }

    fn working_key(&self, queue: &str) -> String {
        match self.keys.get(queue) {
            Some((w, _)) => w.clone(),
            None => format!("{}{queue}", self.working_prefix),
        }
    }

    fn landing_key(&self, queue: &str) -> String {
        match self.keys.get(queue) {
            Some((_, l)) => l.clone(),
            None => format!("{}{queue}", self.landing_prefix),
        }
    }

    fn forget(&self, held: &[Held]) {
        if self.mode == FetchMode::Basic {
            return;
        }
        if let Ok(mut o) = self.outstanding.lock() {
            for h in held {
                o.ids.remove(&h.id);
            }
        }
    }

    /// The round's order without the queues that are paused.
    fn usable(&self, order: Vec<Arc<str>>) -> Vec<Arc<str>> {
        let Ok(stalls) = self.stalls.lock() else {
            return order;
        };
        if stalls.is_empty() {
            return order;
        }
        let now = Instant::now();
        order
            .into_iter()
            .filter(|q| stalls.get(q).is_none_or(|s| s.until <= now))
            .collect()
    }

    /// Pauses `queue` after an error of its own, with a backoff that doubles up to [`MAX_STALL`].
    fn stall(&self, queue: &Arc<str>, error: &str) {
        let Ok(mut stalls) = self.stalls.lock() else {
            return;
        };
        let backoff = match stalls.get(queue) {
            Some(s) => (s.backoff * 2).min(MAX_STALL),
            None => {
                tracing::warn!(queue = %queue, error,
                    "cannot fetch from this queue: paused and retried with backoff; the other queues go on");
                Duration::from_secs(1)
            }
        };
        stalls.insert(
            queue.clone(),
            Stall {
                until: Instant::now() + backoff,
                backoff,
            },
        );
    }

    /// Ends the pause of queues that were looked at without an error.
    fn unstall(&self, looked_at: &[Arc<str>], failed: &[Arc<str>]) {
        let Ok(mut stalls) = self.stalls.lock() else {
            return;
        };
        if stalls.is_empty() {
            return;
        }
        for q in looked_at {
            if !failed.contains(q) && stalls.remove(q).is_some() {
                tracing::info!(queue = %q, "queue fetches again");
            }
        }
    }

    /// Fetches up to `max` jobs (at most [`MAX_BATCH`]); waits up to the block time when every queue is
    /// empty and then returns what it has (possibly nothing). Cancelling it strands what it moved in this
    /// process's working hash or landing list, where [`Fetcher::requeue_leftovers`] finds it (with basic
    /// fetch a `BRPOP`ped job would be lost: never cancel that one).
    pub async fn fetch(&self, max: usize) -> Result<Vec<UnitOfWork>> {
        let order = self.usable(self.order.next());
        match self.mode {
            FetchMode::Basic => self.fetch_basic(&order).await,
            FetchMode::Reliable => {
                let (got, busy) = self.fetch_batch(&order, max).await?;
                // Something happened (jobs, an oversized one sent to the dead set, a queue error): come
                // back at once rather than block. Blocking would pull the next job through `BLMOVE`,
                // whose reply carries the payload: an oversized one would be read into memory.
                if busy {
                    return Ok(got);
                }
                // A queue the batch found broken is not waited on.
                let order = self.usable(order);
                if self.wait_for_work(&order).await? {
                    // The job waits in its landing list; the batch script takes it (and any others).
                    return Ok(self.fetch_batch(&order, max).await?.0);
                }
                Ok(Vec::new())
            }
        }
    }

    /// One run of the batch script: the jobs it handed out, and whether it did anything at all.
    async fn fetch_batch(&self, order: &[Arc<str>], max: usize) -> Result<(Vec<UnitOfWork>, bool)> {
        if order.is_empty() {
            return Ok((Vec::new(), false));
        }
        let max = max.clamp(1, MAX_BATCH);
        let base = self.next_id.fetch_add(max as u64, Ordering::Relaxed) + 1;
        let range = (base, base + max as u64);
        if let Ok(mut o) = self.outstanding.lock() {
            o.pending.push(range);
        }
        let _reservation = Reservation {
            fetcher: self,
            range,
        };
        let now = time::now();
        let mut inv = self.script.prepare_invoke();
        inv.arg(max)
            .arg(&self.working_prefix)
            .arg(&self.landing_prefix)
            .arg(base)
            .arg(self.max_payload_bytes)
            .arg(BATCH_BYTES.max(self.max_payload_bytes))
            .arg(&self.identity)
            .arg(score(now))
            .arg(self.fleet.time_format().value(now).to_string())
            .arg(score(now - crate::retry::DEAD_TIMEOUT_SECS))
            .arg(crate::retry::DEAD_MAX_JOBS)
            .arg(order.len());
        for q in order {
            inv.arg(&**q);
        }
        let flat: Vec<Vec<u8>> = inv.invoke_async(&mut self.conn.clone()).await?;
        let busy = !flat.is_empty();
        let name_of = |q: &[u8]| {
            order
                .iter()
                .find(|n| n.as_bytes() == q)
                .cloned()
                .unwrap_or_else(|| Arc::from(String::from_utf8_lossy(q).as_ref()))
        };
        let mut out = Vec::with_capacity(flat.len() / 3);
        let mut failed: Vec<Arc<str>> = Vec::new();
        let mut it = flat.into_iter();
        while let (Some(q), Some(tag), Some(body)) = (it.next(), it.next(), it.next()) {
            match tag.as_slice() {
                b"err" => {
                    let queue = name_of(&q);
                    self.stall(&queue, &String::from_utf8_lossy(&body));
                    failed.push(queue);
                }
                b"dead" => {
                    self.dead.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(queue = %name_of(&q), size = %String::from_utf8_lossy(&body),
                        limit = self.max_payload_bytes,
                        "payload over the size limit sent to the dead set without being read");
                }
                first => {
                    let number = |b: &[u8]| {
                        std::str::from_utf8(b)
                            .ok()
                            .and_then(|s| s.parse::<u64>().ok())
                            .unwrap_or(0)
                    };
                    let (first, count) = (number(first), number(&body));
                    let queue = name_of(&q);
                    for (i, raw) in it.by_ref().take(count as usize).enumerate() {
                        out.push(UnitOfWork {
                            queue: queue.clone(),
                            id: first + i as u64,
                            raw,
                        });
                    }
                }
            }
        }
        if let Ok(mut o) = self.outstanding.lock() {
            o.ids.extend(out.iter().map(|u| u.id));
        }
        // With fewer than `max` taken, the script looked at every queue of the round.
        if out.len() < max {
            self.unstall(order, &failed);
        }
        Ok((out, busy))
    }

    /// Blocks until a job arrives on the first queue of the round (moving it into its landing list) or
    /// the block time passes. True when a job landed.
    async fn wait_for_work(&self, order: &[Arc<str>]) -> Result<bool> {
        let Some(first) = order.first() else {
            tokio::time::sleep(self.block.min(Duration::from_millis(500))).await;
            return Ok(false);
        };
        // With several queues, block briefly on the first so the others are looked at again soon.
        let block = if order.len() == 1 {
            self.block
        } else {
            self.block.min(Duration::from_millis(50))
        };
        let landing = self.landing_key(first);
        let moved: redis::RedisResult<Option<Vec<u8>>> = redis::cmd("BLMOVE")
            .arg(keys::queue(first))
            .arg(&landing)
            .arg("RIGHT")
            .arg("LEFT")
            .arg(block.as_secs_f64())
            .query_async(&mut self.blocking.clone())
            .await;
        match moved {
            Ok(raw) => Ok(raw.is_some()),
            Err(e) if e.code() == Some("WRONGTYPE") => {
                let msg = self.describe(&[keys::queue(first), landing], &e).await;
                self.stall(first, &msg);
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Names the keys among `keys` that are neither lists nor absent, with their types.
    async fn describe(&self, keys: &[String], e: &redis::RedisError) -> String {
        let mut conn = self.conn.clone();
        let mut parts = Vec::new();
        for k in keys {
            let t: String = redis::cmd("TYPE")
                .arg(k)
                .query_async(&mut conn)
                .await
                .unwrap_or_else(|_| "?".into());
            if t != "list" && t != "none" {
                parts.push(format!("{k} is a {t}, not a list"));
            }
        }
        if parts.is_empty() {
            e.to_string()
        } else {
            format!("{}: {e}", parts.join(", "))
        }
    }

    async fn fetch_basic(&self, order: &[Arc<str>]) -> Result<Vec<UnitOfWork>> {
        if order.is_empty() {
            tokio::time::sleep(self.block.min(Duration::from_millis(500))).await;
            return Ok(Vec::new());
        }
        let keys: Vec<String> = order.iter().map(|q| keys::queue(q)).collect();
        let got: redis::RedisResult<Option<(String, Vec<u8>)>> = redis::cmd("BRPOP")
            .arg(&keys)
            .arg(self.block.as_secs_f64())
            .query_async(&mut self.blocking.clone())
            .await;
        let got = match got {
            Ok(g) => g,
            Err(e) if e.code() == Some("WRONGTYPE") => {
                // BRPOP fails as a whole: find the culprits, pause them, serve the others next round.
                let mut conn = self.conn.clone();
                for (q, k) in order.iter().zip(&keys) {
                    let t: String = redis::cmd("TYPE").arg(k).query_async(&mut conn).await?;
                    if t != "list" && t != "none" {
                        self.stall(q, &format!("{k} is a {t}, not a list: {e}"));
                    }
                }
                return Ok(Vec::new());
            }
            Err(e) => return Err(e.into()),
        };
        Ok(got
            .map(|(key, raw)| {
                let name = key.strip_prefix("queue:").unwrap_or(&key);
                let queue = order
                    .iter()
                    .find(|n| ***n == *name)
                    .cloned()
                    .unwrap_or_else(|| Arc::from(name));
                UnitOfWork { queue, id: 0, raw }
            })
            .into_iter()
            .collect())
    }

    /// Acknowledges jobs whose fate is in Redis: one `HDEL` of their ids per queue, pipelined
    /// (reliable fetch only; basic fetch has nothing to acknowledge).
    pub async fn ack(&self, done: &[Held]) -> Result<()> {
        if self.mode == FetchMode::Basic || done.is_empty() {
            return Ok(());
        }
        let mut by_queue: Vec<(&Arc<str>, redis::Cmd)> = Vec::new();
        for h in done {
            match by_queue.iter_mut().find(|(q, _)| **q == h.queue) {
                Some((_, cmd)) => {
                    cmd.arg(h.id);
                }
                None => {
                    let mut cmd = redis::cmd("HDEL");
                    cmd.arg(self.working_key(&h.queue)).arg(h.id);
                    by_queue.push((&h.queue, cmd));
                }
            }
        }
        let mut pipe = redis::pipe();
        for (_, cmd) in by_queue {
            pipe.add_command(cmd).ignore();
        }
        pipe.query_async::<()>(&mut self.conn.clone()).await?;
        self.forget(done);
        Ok(())
    }

    /// Pushes unfinished jobs back to the end of their queue that is served next (`RPUSH`, as Sidekiq's
    /// `bulk_requeue`). With reliable fetch each moves from the working hash in a script, the push before
    /// the removal, and only if it is still there (a recovery may have pushed it back already); a queue
    /// key of the wrong type leaves its jobs in the working hash and is an error naming it. Returns how
    /// many moved.
    pub async fn requeue(&self, units: &[Held]) -> Result<u64> {
        if units.is_empty() {
            return Ok(0);
        }
        let mut conn = self.conn.clone();
        if self.mode == FetchMode::Basic {
            let mut pipe = redis::pipe();
            for h in units {
                pipe.rpush(keys::queue(&h.queue), &h.raw[..]).ignore();
            }
            pipe.query_async::<()>(&mut conn).await?;
            return Ok(units.len() as u64);
        }
        let mut by_queue: Vec<(&Arc<str>, Vec<u64>)> = Vec::new();
        for h in units {
            match by_queue.iter_mut().find(|(q, _)| **q == h.queue) {
                Some((_, ids)) => ids.push(h.id),
                None => by_queue.push((&h.queue, vec![h.id])),
            }
        }
        let mut moved = 0;
        let mut errors = Vec::new();
        for (q, ids) in by_queue {
            let (n, err) = push_back(&mut conn, &self.working_key(q), q, &ids).await?;
            moved += n;
            if err.is_empty() {
                if let Ok(mut o) = self.outstanding.lock() {
                    for id in &ids {
                        o.ids.remove(id);
                    }
                }
            } else {
                errors.push(err);
            }
        }
        if errors.is_empty() {
            Ok(moved)
        } else {
            Err(script_error(errors.join("; ")))
        }
    }

    /// After a failed fetch the batch script may have run without its reply reaching us: those jobs sit
    /// in our working hash while nobody runs them. This pushes back every entry that was never handed
    /// out (not outstanding): a job about to run, running, or whose ack is on its way is left alone.
    /// Returns how many moved.
    pub async fn reconcile(&self) -> Result<u64> {
        if self.mode == FetchMode::Basic {
            return Ok(0);
        }
        let mut conn = self.conn.clone();
        let mut moved = 0;
        let mut errors = Vec::new();
        for (q, (working, _)) in &self.keys {
            let ids: Vec<u64> = match conn.hkeys(working).await {
                Ok(ids) => ids,
                Err(e) if e.code() == Some("WRONGTYPE") => {
                    errors.push(format!("{working}: {e}"));
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            let stranded: Vec<u64> = match self.outstanding.lock() {
                Ok(o) => ids.into_iter().filter(|id| !o.contains(*id)).collect(),
                Err(_) => Vec::new(),
            };
            if stranded.is_empty() {
                continue;
            }
            let (n, err) = push_back(&mut conn, working, q, &stranded).await?;
            moved += n;
            if !err.is_empty() {
                errors.push(err);
            }
        }
        if errors.is_empty() {
            Ok(moved)
        } else {
            Err(script_error(errors.join("; ")))
        }
    }

    /// Pushes back whatever this process holds in Redis that was never handed out: its landing lists
    /// and the working-hash entries outside the outstanding set (see [`Fetcher::reconcile`]); with
    /// `everything`, every entry (the shutdown's last sweep, once no job runs and every ack is flushed:
    /// what is still outstanding then was handed out but never started). Run when the process goes quiet
    /// (a fetch cut short there leaves its jobs in these keys) and at shutdown, before and after the
    /// running jobs are pushed back. Not counted as recoveries.
    pub async fn requeue_leftovers(&self, everything: bool) -> Result<u64> {
        if self.mode == FetchMode::Basic {
            return Ok(0);
        }
        let mut conn = self.conn.clone();
        let script = Script::new(MOVE_BACK_LUA);
        let mut moved = 0;
        let mut errors = Vec::new();
        for (q, (_, landing)) in &self.keys {
            let (m, err): (u64, String) = script
                .key(landing)
                .key(keys::queue(q))
                .invoke_async(&mut conn)
                .await?;
            moved += m;
            if !err.is_empty() {
                errors.push(err);
            }
        }
        if everything && let Ok(mut o) = self.outstanding.lock() {
            o.ids.clear();
        }
        match self.reconcile().await {
            Ok(n) => moved += n,
            Err(e) => errors.push(e.to_string()),
        }
        if errors.is_empty() {
            Ok(moved)
        } else {
            Err(script_error(errors.join("; ")))
        }
    }
}

/// Runs [`PUSH_BACK_LUA`] for `ids` of `working` into `queue`: (moved, error or empty).
async fn push_back(
    conn: &mut Conn,
    working: &str,
    queue: &str,
    ids: &[u64],
) -> Result<(u64, String)> {
    let script = Script::new(PUSH_BACK_LUA);
    let mut moved = 0;
    // Bounded argument lists, whatever the number of ids.
    for chunk in ids.chunks(1000) {
        let mut inv = script.key(working);
        inv.key(keys::queue(queue));
        for id in chunk {
            inv.arg(id);
        }
        let (n, err): (u64, String) = inv.invoke_async(conn).await?;
        moved += n;
        if !err.is_empty() {
            return Ok((moved, err));
        }
    }
    Ok((moved, String::new()))
}

/// The key whose presence says a reliable-fetch process is alive; refreshed by its heartbeat.
pub fn alive_key(identity: &str) -> String {
    format!("oxidekiq:alive:{identity}")
}

/// Marks `identity` alive for `ttl`. False when the key had expired (a Redis stall or a pause longer
/// than the TTL): this reclaims it, and the process keeps its jobs unless it stayed away past the grace
/// of [`recover_orphans`]. It also clears its own suspect mark: a mark left from an earlier absence that
/// no recovery pass saw end would otherwise date a later absence from the first one, and take the jobs
/// of a process that is away again only briefly without any grace.
pub async fn mark_alive(conn: &mut Conn, identity: &str, ttl: Duration) -> Result<bool> {
    let ms = ttl.as_millis().max(1000) as u64;
    let key = alive_key(identity);
    let (existed, (), _): (bool, (), u64) = redis::pipe()
        .exists(&key)
        .pset_ex(&key, 1, ms)
        .hdel(SUSPECTS, identity)
        .query_async(conn)
        .await?;
    Ok(existed)
}

/// Lifetime of the recovery lock, renewed once after the key scan.
const RECOVERY_LOCK_TTL: Duration = Duration::from_secs(30);

/// Keys asked of each SCAN step of a recovery pass.
const SCAN_COUNT: usize = 1000;

/// What [`recover_orphans`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Recovered {
    /// Jobs pushed back to their queues.
    pub requeued: u64,
    /// Jobs sent to the dead set after too many recoveries.
    pub killed: u64,
    /// Processes seen without a liveness key, not yet past the grace.
    pub suspects: u64,
}

/// How orphan recovery judges and annotates.
#[derive(Debug, Clone, Copy)]
pub struct RecoveryPolicy {
    /// How long a process must stay without its liveness key (by Redis's clock) before its jobs are
    /// taken; at least the liveness TTL, so a process that could only not beat reclaims its key first.
    pub grace: Duration,
    /// How `failed_at` is written on a job sent to the dead set.
    pub time_format: TimeFormat,
}

impl Default for RecoveryPolicy {
    fn default() -> Self {
        RecoveryPolicy {
            grace: Duration::from_secs(15),
            time_format: TimeFormat::Seconds,
        }
    }
}

/// Pushes back the jobs of every process found dead inside the recovery script (see [`ORPHAN_LUA`]).
/// One process at a time does it (`SET oxidekiq:recovery-lock <identity> NX PX 30000`, renewed after the
/// key scan, released by compare-and-delete); returns `None` when another
/// process holds that lock.
pub async fn recover_orphans(
    conn: &mut Conn,
    own_identity: &str,
    now: f64,
    policy: RecoveryPolicy,
) -> Result<Option<Recovered>> {
    let got: Option<String> = redis::cmd("SET")
        .arg(keys::RECOVERY_LOCK)
        .arg(own_identity)
        .arg("NX")
        .arg("PX")
        .arg(RECOVERY_LOCK_TTL.as_millis() as u64)
        .query_async(conn)
        .await?;
    if got.is_none() {
        return Ok(None);
    }
    let result = recover_locked(conn, own_identity, now, policy).await;
    // Compare-and-delete: a pass that outlasted the lock's 30 s must not free another process's lock.
    let _ = crate::lock::release(conn, keys::RECOVERY_LOCK, own_identity).await;
    result.map(Some)
}

async fn recover_locked(
    conn: &mut Conn,
    own_identity: &str,
    now: f64,
    policy: RecoveryPolicy,
) -> Result<Recovered> {
    let mut held: Vec<String> = Vec::new();
    {
        // COUNT 1000, not the default 10: a pass walks the whole keyspace, which may hold millions of
        // unrelated keys (a million took 190 000 round trips at 10, about a thousand at 1000), and each
        // SCAN step stays short for Redis.
        let opts = redis::ScanOptions::default()
            .with_pattern(keys::HELD_PATTERN)
            .with_count(SCAN_COUNT);
        let mut iter: redis::AsyncIter<'_, String> = conn.scan_options(opts).await?;
        while let Some(item) = iter.next_item().await {
            held.push(item?);
        }
    }
    // A walk of a huge keyspace may have taken a while: go on only while the lock is still ours (and
    // for another 30 s), so two passes never judge the same processes at once.
    if !crate::lock::extend(conn, keys::RECOVERY_LOCK, own_identity, RECOVERY_LOCK_TTL).await? {
        tracing::warn!("orphan recovery lock expired during the key scan; this pass stops");
        return Ok(Recovered::default());
    }
    // Every key of one process goes to one script call, so one decision covers all of them.
    let mut by_process: Vec<(String, Vec<(String, String)>)> = Vec::new();
    for key in held {
        let Some(rest) = key
            .strip_prefix("oxidekiq:working:")
            .or_else(|| key.strip_prefix("oxidekiq:landing:"))
        else {
            continue;
        };
        // identity = host:pid:hex12; the queue name is the rest (both may hold ':').
        let Some((identity, queue)) = keys::split_held(rest) else {
            continue;
        };
        let identity = identity.to_string();
        if identity == own_identity {
            continue;
        }
        let queue = keys::queue(queue);
        match by_process.iter_mut().find(|(i, _)| *i == identity) {
            Some((_, keys)) => keys.push((key, queue)),
            None => by_process.push((identity, vec![(key, queue)])),
        }
    }
    let holders: Vec<String> = by_process.iter().map(|(i, _)| i.clone()).collect();
    let mut total = Recovered::default();
    let script = Script::new(ORPHAN_LUA);
    let grace_ms = policy.grace.as_millis().max(1) as u64;
    for (identity, held) in by_process {
        let mut inv = script.key(alive_key(&identity));
        inv.key(SUSPECTS).key(RECOVERED);
        for (key, queue) in &held {
            inv.key(key).key(queue);
        }
        inv.arg(grace_ms)
            .arg(MAX_RECOVERIES)
            .arg(score(now))
            .arg(policy.time_format.value(now).to_string())
            .arg(score(now - crate::retry::DEAD_TIMEOUT_SECS))
            .arg(crate::retry::DEAD_MAX_JOBS)
            .arg(&identity);
        let (state, moved, killed, err): (u8, u64, u64, String) = inv.invoke_async(conn).await?;
        match state {
            1 => total.suspects += 1,
            2 => {
                if moved + killed > 0 {
                    tracing::warn!(
                        process = %identity,
                        requeued = moved,
                        dead = killed,
                        "recovered jobs of a process that died"
                    );
                }
                if !err.is_empty() {
                    tracing::error!(process = %identity, error = %err,
                        "could not push back every job of a dead process; the rest stay in its working keys");
                }
            }
            _ => {}
        }
        total.requeued += moved;
        total.killed += killed;
    }
    // A suspect that has no key left (it stopped cleanly, or was recovered) needs no mark.
    let suspects: Vec<String> = conn.hkeys(SUSPECTS).await?;
    let gone: Vec<&String> = suspects
        .iter()
        .filter(|s| !holders.iter().any(|i| i == *s))
        .collect();
    if !gone.is_empty() {
        let _: () = conn.hdel(SUSPECTS, gone).await?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qw(name: &str, weight: u32) -> QueueWeight {
        QueueWeight {
            name: name.into(),
            weight,
        }
    }

    #[test]
    fn strict_order_is_the_configured_order_every_time() {
        let o = QueueOrder::new(&[qw("critical", 0), qw("default", 0), qw("low", 0)]);
        for _ in 0..10 {
            let v: Vec<String> = o.next().iter().map(|s| s.to_string()).collect();
            assert_eq!(v, ["critical", "default", "low"]);
        }
    }

    #[test]
    fn weighted_order_puts_a_queue_first_in_proportion_to_its_weight() {
        let o = QueueOrder::new(&[qw("a", 3), qw("b", 1)]);
        let n = 4000;
        let firsts = (0..n).filter(|_| &*o.next()[0] == "a").count();
        let share = firsts as f64 / n as f64;
        assert!((0.70..0.80).contains(&share), "a first {share}");
        assert_eq!(o.next().len(), 2);
    }
}
