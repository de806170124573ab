//! Reliable fetch (the default): a fetched job is always somewhere in Redis.
//!
//! A fetch copies up to the number of free slots (at most [`MAX_BATCH`], and about [`BATCH_BYTES`] of
//! payload) from a queue's served end into a batch list of this process (one per queue and fetch:
//! `oxidekiq:batch:<identity>:<queue>:@<batch>`), and only then trims them from the queue; the same
//! round trip reads the list back. `SORT <queue> BY nosort DESC LIMIT 0 <n> STORE <list>` does the copy
//! inside Redis: no payload goes through Lua (where Redis would copy and hash every byte), so Redis's
//! cost per job barely grows with the payload (bench/results/redis-per-job.md), and the list holds the
//! jobs in serve order, the one the queue served first at its head. A job's id is its batch number and
//! its place (its index) in the list. It stays there until its fate is in Redis: the ack adds its place
//! to the list's acks set (`oxidekiq:acks:...`), or, once every job of the batch is done, deletes the list
//! and the set with one `DEL`, whatever the payloads. Every push-back of such a list goes from its tail,
//! so the queue serves the jobs again in the order it served them.
//!
//! Two paths, the same lists:
//! - **The fast path**, when the round's first queue is expected to fill the batch (its last look took
//!   every job asked) and its landing list is known empty: one transaction, `MULTI; SORT ..; EVAL
//!   <guard>; LRANGE <list> 0 -1; EXEC`. The `SORT`'s count is how many it took (a queue shorter than n
//!   gives what it has). The guard ([`GUARD_LUA`], three calls) trims those jobs off the queue
//!   (`LTRIM <queue> 0 -(c+1)`, c the copy's length) only when the copy is there and `MEMORY USAGE` of it
//!   is within the payload limit (over [`COMPRESSED_RATIO`] when the server may compress lists: see
//!   [`Reliable::read_list_config`]), so the `LRANGE` never reads a payload over the limit, and a copy that
//!   failed (a `SORT` refused when the transaction runs) removes nothing; otherwise the copy is deleted,
//!   the queue left as it was, and the fetch takes the script path. It costs Redis less than the script
//!   (no landing lists looked at; bench/results/redis-per-job.md measured it with the `LTRIM` a command
//!   of the transaction, beside a guard of two calls, before the `LLEN` and the trim moved in). A queue
//!   of big payloads gets smaller batches ([`fast_batch`]): the copy's cost per job grows with its size.
//! - **The script path** ([`FETCH_LUA`]), otherwise: after a short look, over several queues in the
//!   round's order (each queue's landing list first), when a queue's batch could hold a payload over the
//!   limit, and for good once Redis refused a command of the fast path (an ACL). Its batches are sized as
//!   the fast path's; a copy that could still hold a payload over the limit is undone and that queue read
//!   job by job, such a payload moved to the dead set, the error appended, without it leaving Redis.
//!
//! When every queue is empty the fetcher blocks on `BLMOVE` into a landing list of its own (atomic
//! too); an idle process costs Redis almost nothing and a new job starts at once. A queue key of the
//! wrong type pauses that queue alone (see [`super::Stalls`]), on either path.
//!
//! The fetcher keeps the batch lists whose jobs it handed out and, apart, the lists of fetches whose
//! reply never came (an error, a cancelled fetch): [`Fetch::reconcile`] and the quiet/shutdown sweeps
//! push back the latter whole (nothing in them was handed out), and the shutdown's last sweep every job
//! of the former not marked done.
//!
//! The batch lists of processes that died (and the working keys and landing lists of older releases)
//! are pushed back by [`super::recovery`]. The lists live under `oxidekiq:batch:`, a prefix no older
//! release scans (see `keys::BATCH`).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::Script;

use super::{BATCH_BYTES, BoxFuture, Fetch, MAX_BATCH, QueueOrder, Setup, Stalls, UnitOfWork};
use crate::config::QueueWeight;
use crate::error::Result;
use crate::keys;
use crate::lua::{dead_trim, lua_common, script_error};
use crate::redis_conn::Conn;
use crate::time::{self, score};

/// The batch fetch of the script path (see the module docs for when it runs). KEYS[1] is the dead set,
/// then four keys per queue, in the round's order: its landing list (where a blocking wait put a job) and
/// the batch list this fetch fills from it, then its queue and the batch list this fetch fills from that
/// (`oxidekiq:batch:<identity>:<queue>:@<batch>`, new for every fetch). Takes up to ARGV[1] jobs, each
/// queue's landing list first, from the sources' served ends into their batch lists, in serve order
/// (the job its source served first at the list's head), and only then trims them from their source;
/// the caller reads the lists in the same pipeline. No payload enters Lua (Lua hashes every byte of every
/// string it is handed): `SORT <source> BY nosort DESC LIMIT 0 <n> STORE <batch list>` copies the
/// source's last n jobs (fewer if it has fewer) inside Redis without asking its length, and `MEMORY
/// USAGE` of the copy, times ARGV[9] (1, or [`COMPRESSED_RATIO`] when the server may compress the
/// list's nodes), bounds their sizes. Only when that copy could hold a job longer than ARGV[2] bytes
/// (0: no limit), or pass the batch budget ARGV[3] (or when an ACL refuses `SORT` or `MEMORY`), is it
/// undone and the source read job by job: such a job goes straight to the dead set, annotated with an
/// error naming this fetch (ARGV[4], the process's identity and the batch number) and the job's place
/// in it, so identical payloads stay distinct members (score ARGV[5], `failed_at` text ARGV[6], trimmed
/// by ARGV[7] and ARGV[8]), and the batch stops once it holds ARGV[3] bytes. A queue whose key has the
/// wrong type is skipped with an error; the others are served. Returns records: source number
/// (1-based: queue i's landing list is 2i-1, its queue 2i), tag, value: "n" (the copy took every job
/// asked: the source may hold more), "p" (the copy took fewer: the source is empty now) or "s" (read
/// job by job), each with the count in its batch list; "dead", size; "err", message; and last 0,
/// "seen", how many sources were looked at (the fetch stops once it holds ARGV[1] jobs). The last key
/// is the process's index of held lists ([`keys::held_index`]): a batch list left holding jobs is added
/// to it in the same script (an index that refuses it, a damaged key, leaves the list to recovery's
/// keyspace scan).
/// Numbers go back as integer replies and constant arguments as strings: every number Lua turns into a
/// string is a `printf` of a double, a few thousand instructions each, at a fixed cost per fetch.
const FETCH_LUA: &str = concat!(
    lua_common!(),
    r#"
-- MEMORY USAGE before a write needs effects replication (the only mode from Redis 7; the default
-- from 5, opt-in before).
if redis.replicate_commands then redis.replicate_commands() end
local max = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
local budget = tonumber(ARGV[3])
local nonce = ARGV[4]
local score, failed_at, trim_before, dead_max = ARGV[5], ARGV[6], ARGV[7], tonumber(ARGV[8])
local ratio = tonumber(ARGV[9])
local dead = KEYS[1]
local index = KEYS[#KEYS]
local ns = (#KEYS - 2) / 2
local out = {}
local taken, bytes = 0, 0
local cap = budget
if limit > 0 and limit < cap then cap = limit end
local skip, seen = 0, 0
for i = 1, ns do
  if taken >= max or bytes >= budget then break end
  seen = i
  if i ~= skip then
  local src, dest = KEYS[2 * i], KEYS[2 * i + 1]
  local want = max - taken
  local err, kept, tag, slow = nil, 0, 's', false
  -- The copy, then its size: every job in it is at most the copy's size, so a copy within the limit
  -- (and the budget) holds no job over the limit. A SORT or MEMORY refused (an ACL: SORT is
  -- @dangerous) must neither stop the fetch nor abort the script with the copy made and the source
  -- untrimmed (a push-back of that copy would queue every job twice): the copy is undone and the
  -- source read job by job below, sizes measured in Lua.
  local c = redis.pcall('SORT', src, 'BY', 'nosort', 'DESC', 'LIMIT', '0', want, 'STORE', dest)
  if failed(c) then
    -- A hash or a string (SORT refuses them), else a refusal.
    local t = kind(src)
    if t == 'list' then slow = true elseif t ~= 'none' then err = src .. ' is a ' .. t .. ', not a list: ' .. c.err end
  elseif c > 0 then
    local mem = redis.pcall('MEMORY', 'USAGE', dest, 'SAMPLES', '0')
    -- A compressed node counts its compressed bytes: the bound of what it holds is ratio times that.
    if type(mem) == 'number' then mem = mem * ratio end
    if type(mem) == 'number' and mem <= cap and bytes + mem <= budget then
      local r = redis.pcall('LTRIM', src, '0', -(c + 1))
      if failed(r) then
        -- A set or a sorted set: SORT copied its members, which are no jobs of ours.
        redis.call('DEL', dest)
        err = src .. ' is a ' .. kind(src) .. ', not a list: ' .. r.err
      else
        kept, taken, bytes = c, taken + c, bytes + mem
        if c == want then tag = 'n' else tag = 'p' end
      end
    else
      redis.call('DEL', dest)
      local t = kind(src)
      if t == 'list' then slow = true else err = src .. ' is a ' .. t .. ', not a list' end
    end
  end
  -- The rare way: read from the tail (RPOP's end, served first) in chunks sized by the largest job seen
  -- so far, so a run of huge payloads is read one at a time, never all at once.
  local read, biggest, more, done = 0, 0, slow, 0
  while more and not err and taken < max and bytes < budget do
    local chunk = max - taken
    if biggest == 0 then chunk = 1
    else chunk = math.max(1, math.min(chunk, math.floor((budget - bytes) / biggest))) end
    local jobs = redis.call('LRANGE', src, -(read + chunk), -(read + 1))
    if #jobs < chunk then more = false end
    read = read + #jobs
    for j = #jobs, 1, -1 do
      local job = jobs[j]
      local size = #job
      if size > biggest then biggest = size end
      taken = taken + 1
      bytes = bytes + size
      if limit > 0 and size > limit then
        local msg = 'payload of ' .. size .. ' bytes is over the ' .. limit .. '-byte limit (fetch ' .. nonce .. '.' .. taken .. ')'
        err = to_dead(dead, annotate(job, 'Oxidekiq::InvalidPayload', msg, failed_at), score, trim_before, dead_max)
        if err then break end
        out[#out + 1] = i; out[#out + 1] = 'dead'; out[#out + 1] = size
      else
        local r = redis.pcall('RPUSH', dest, job)
        if failed(r) then err = dest .. ' is a ' .. kind(dest) .. ', not a list: ' .. r.err; break end
        kept = kept + 1
      end
      done = done + 1
      if bytes >= budget then break end
    end
  end
  if done > 0 then redis.call('LTRIM', src, '0', -(done + 1)) end
  if kept > 0 then
    redis.pcall('SADD', index, dest)
    out[#out + 1] = i; out[#out + 1] = tag; out[#out + 1] = kept
  end
  if err then
    out[#out + 1] = i; out[#out + 1] = 'err'; out[#out + 1] = err
    -- A landing list that fails skips its queue too (as one error of the queue).
    if i % 2 == 1 then skip = i + 1 end
  end
  end
end
out[#out + 1] = 0; out[#out + 1] = 'seen'; out[#out + 1] = seen
return out
"#
);

/// The guard of the fast path, run inside its transaction (`MULTI`; `SORT` of up to n jobs of queue
/// KEYS[1] into batch list KEYS[2]; this; `LRANGE` of the batch list; `EXEC`): it trims the queue of the
/// jobs the copy holds, and only when the copy is there and holds no job over ARGV[1] bytes (the payload
/// limit or the batch budget, whichever is lower, over [`COMPRESSED_RATIO`] when the server may compress
/// the list's nodes: every job in it is at most `MEMORY USAGE` of it, times that ratio).
/// Returns that size (0 when the `SORT` copied nothing, or failed: then nothing is trimmed). Otherwise
/// the copy is deleted and the queue left as it was, so the `LRANGE` reads nothing: `{'over', size}`,
/// `{'refused', error}` (`MEMORY`, `LLEN` or `LTRIM` refused, an ACL) or `{'type', type}` (the queue is
/// no list: `SORT` copies a set or a sorted set, which `LTRIM` refuses). The trim is here, not a command
/// of the transaction: a command of a transaction that fails when it runs (a `SORT` refused by an ACL
/// changed after it was queued) does not stop the others, and an `LTRIM` beside it would remove jobs
/// no list holds. Sent whole with `EVAL` (a few hundred bytes), never `EVALSHA`: inside a transaction a
/// `NOSCRIPT` would come after the `SORT` ran, and the `LRANGE` would read an unguarded list of jobs still
/// queued. Every call goes through `pcall`, and no value is used before its type is checked: an error
/// this script raised would leave that read unguarded too. A copy kept (trimmed off the queue) is added
/// to the process's index of held lists KEYS[3] ([`keys::held_index`]).
const GUARD_LUA: &str = r#"
local q, b = KEYS[1], KEYS[2]
local mem = redis.pcall('MEMORY', 'USAGE', b, 'SAMPLES', '0')
if not mem then return 0 end
local why = nil
if type(mem) == 'number' and mem <= tonumber(ARGV[1]) then
  local n = redis.pcall('LLEN', b)
  if type(n) == 'number' then
    local r = redis.pcall('LTRIM', q, '0', -(n + 1))
    if type(r) ~= 'table' or not r.err then
      if n > 0 then redis.pcall('SADD', KEYS[3], b) end
      return mem
    end
    why = r.err
  else
    why = n.err
  end
elseif type(mem) == 'table' then
  why = mem.err
end
redis.pcall('DEL', b)
if not why then return {'over', mem} end
local t = redis.pcall('TYPE', q)
t = type(t) == 'table' and t.ok
if t and t ~= 'list' and t ~= 'none' then return {'type', t} end
return {'refused', tostring(why)}
"#;

/// Pushes every job of this process's own batch list KEYS[1] (in serve order, as every list of this
/// release) not in its acks set KEYS[2] (or of its landing list KEYS[1], given as KEYS[2] too) back to
/// queue KEYS[3], so that it serves them again in the order it served them, without counting it as a
/// recovery (so no counts hash and no dead set: KEYS[1] stands in for both, never touched with a limit
/// of -1). Returns {moved, error}.
const MOVE_BACK_LUA: &str = concat!(
    lua_common!(),
    super::lua_move_back!(),
    r#"
local m, _, err = move_back(KEYS[1], KEYS[2], KEYS[3], KEYS[3], true, -1, KEYS[1], KEYS[1], '0', '0', 0, '', '')
return {m, err or ''}
"#
);

/// Pushes back the jobs at places ARGV of batch list KEYS[1] to the served end of queue KEYS[3], in the
/// order given (the caller gives the last served first, so the first served is served first again),
/// each only if it is still there (the list reaches its place and acks set KEYS[2] does not hold it),
/// the push before the place is added to the acks set. Returns {moved, error}.
const PUSH_BACK_LUA: &str = concat!(
    lua_common!(),
    r#"
local n = 0
local at = kind(KEYS[2])
if KEYS[2] ~= KEYS[1] and at ~= 'set' and at ~= 'none' then
  return {0, KEYS[2] .. ' is a ' .. at .. ', not a set (the acks set of ' .. KEYS[1] .. '; its jobs stay there until it is repaired)'}
end
local len = redis.call('LLEN', KEYS[1])
for i = 1, #ARGV do
  if tonumber(ARGV[i]) < len and redis.call('SISMEMBER', KEYS[2], ARGV[i]) == 0 then
    local j = redis.call('LINDEX', KEYS[1], ARGV[i])
    local r = redis.pcall('RPUSH', KEYS[3], j)
    if failed(r) then return {n, KEYS[3] .. ' is a ' .. kind(KEYS[3]) .. ', not a list: ' .. r.err} end
    redis.call('SADD', KEYS[2], ARGV[i])
    n = n + 1
  end
end
return {n, ''}
"#
);

/// The mask of a unit id's place in its batch list.
const PLACE_MASK: u64 = (1 << keys::PLACE_BITS) - 1;

/// One batch list holding jobs handed out.
#[derive(Debug)]
struct Batch {
    /// The list.
    key: String,
    /// Its acks set.
    acks: String,
    /// Its queue.
    queue: Arc<str>,
    /// Jobs handed out from it and not yet acknowledged or pushed back; at 0 the list and its acks set
    /// are deleted.
    left: usize,
    /// By place: whether the job was counted done. A place is counted once however often it is settled
    /// (a push-back retried whole after a later batch failed, an ack sent twice): counting it again
    /// would delete the list under a job still running.
    settled: Vec<bool>,
}

impl Batch {
    /// How many of `places` are not yet counted done.
    fn unsettled(&self, places: &[u64]) -> usize {
        places
            .iter()
            .filter(|p| self.settled.get(**p as usize) == Some(&false))
            .count()
    }
}

/// The batch lists this process holds: those with jobs handed out, and those a fetch may have filled
/// without its reply reaching us ("lost": nothing in them was handed out, so all of it goes back).
#[derive(Debug, Default)]
struct Held {
    /// By batch number.
    open: foldhash::HashMap<u64, Batch>,
    /// Lists (key, acks set, queue) of fetches whose reply never came.
    lost: Vec<(String, String, Arc<str>)>,
    /// `[start, end)` batch numbers of fetches in flight: lists a sweep must leave alone.
    pending: Vec<(u64, u64)>,
}

impl Held {
    /// Whether batch `n` is one this process knows: handed out, or its fetch in flight.
    fn knows(&self, n: u64) -> bool {
        self.open.contains_key(&n) || self.pending.iter().any(|(a, b)| (*a..*b).contains(&n))
    }
}

/// Records a fetch's lists as lost however the fetch ends without its reply being read (a cancelled
/// fetch's jobs were never handed out: the next sweep pushes them back).
struct Reservation<'a> {
    fetcher: &'a Reliable,
    lists: Vec<(String, String, Arc<str>)>,
    /// Its batch numbers, `[start, end)`.
    range: (u64, u64),
    answered: bool,
}

impl<'a> Reservation<'a> {
    /// Reserves `lists`, numbered from `range.0`, while the fetch is in flight.
    fn new(
        fetcher: &'a Reliable,
        lists: Vec<(String, String, Arc<str>)>,
        range: (u64, u64),
    ) -> Self {
        if let Ok(mut h) = fetcher.held.lock() {
            h.pending.push(range);
        }
        Reservation {
            fetcher,
            lists,
            range,
            answered: false,
        }
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if let Ok(mut h) = self.fetcher.held.lock() {
            h.pending.retain(|r| *r != self.range);
            if !self.answered {
                h.lost.append(&mut self.lists);
            }
        }
    }
}

/// The reliable fetcher of one process.
#[derive(Debug)]
pub(crate) struct Reliable {
    /// Queue order.
    order: QueueOrder,
    /// This process's identity, part of the note on an oversized job.
    identity: String,
    /// `oxidekiq:batch:<identity>:`.
    batch_prefix: String,
    /// `oxidekiq:landing:<identity>:`.
    landing_prefix: String,
    /// `oxidekiq:held:<identity>`, the index of its held lists that recovery reads ([`keys::held_index`]).
    index: String,
    /// Every queue name, for the landing lists' sweep.
    names: Vec<Arc<str>>,
    /// Connection for the batch script, acks and requeues.
    conn: Conn,
    /// Dedicated connection for `BLMOVE`.
    blocking: Conn,
    /// The batch script (EVALSHA in a pipeline, loaded again on NOSCRIPT).
    script: Script,
    /// Next batch number; its bits from [`super::CAPSULE_SHIFT`] up are the capsule's.
    next_batch: AtomicU64,
    /// The capsule this fetcher serves ([`super::capsule_of`] of its batch numbers): the batch lists of
    /// the process's other capsules share its prefix and are never its strays.
    capsule: u64,
    /// How long one blocking wait may last.
    block: Duration,
    /// Payloads longer than this go to the dead set inside Redis (0: no limit).
    max_payload_bytes: usize,
    /// The live fleet, which decides how `failed_at` is written on such a payload (issue 13).
    fleet: Arc<crate::fleet::Fleet>,
    /// The batch lists held.
    held: Mutex<Held>,
    /// Queues paused after an error of their own.
    stalls: Stalls,
    /// Oversized jobs sent to the dead set since the last [`Fetch::take_dead`].
    dead: AtomicU64,
    /// Acks waiting to ride on the next fetch's pipeline ([`Reliable::ack`]).
    riders: Mutex<Vec<Rider>>,
    /// Keys whose ack Redis refused (a damaged acks set), each logged once ([`Reliable::send_acks`]).
    refused_acks: Mutex<foldhash::HashSet<String>>,
    /// Ids of riders.
    next_rider: AtomicU64,
    /// How long an ack waits for a fetch to carry it ([`RIDE_WAIT`]; tests lengthen it).
    ride_wait: Duration,
    /// Fetch loops in a blocking wait now: while one is, the queues were empty and no fetch is due soon,
    /// so an ack goes out at once.
    waiting: AtomicUsize,
    /// What the fetcher knows of each queue, to choose a fetch's path.
    queues: foldhash::HashMap<Arc<str>, Mutex<QueueState>>,
    /// The fast path may be used: false for good once Redis refused one of its commands (an ACL, a
    /// command renamed away), which would refuse it again.
    fast: AtomicBool,
    /// How many bytes a list element may hold per byte `MEMORY USAGE` counts of its list: 1 while the
    /// server says it compresses no list, else [`COMPRESSED_RATIO`] (also before it said, and when it
    /// refuses `CONFIG GET`). See [`Reliable::read_list_config`].
    mem_ratio: AtomicUsize,
    /// When `list-compress-depth` was last read (none: never, or the read failed on the connection).
    list_config_read: Mutex<Option<Instant>>,
    /// Whether the refusal of `CONFIG GET` was logged (once a process).
    list_config_warned: AtomicBool,
}

/// What the fetcher knows of one queue, to choose the path of a fetch that starts with it.
#[derive(Debug)]
struct QueueState {
    /// The last look at it took every job asked for, by a copy within the limits: the fast path is
    /// expected to fill its batch, with no payload over the limit. True at first.
    full: bool,
    /// Its landing list may hold a job: a blocking wait on the queue ran since the script path last
    /// looked at the list. The fast path does not look at landing lists.
    landing: bool,
    /// Counts the starts and ends of blocking waits on the queue: a look at the landing list sent
    /// before one of them does not clear `landing`.
    waits: u64,
    /// Bytes a job of the last fast-path batch took in Redis (`MEMORY USAGE` of the batch over its
    /// count; 0 before one): sizes the next batch ([`fast_batch`]).
    job_bytes: usize,
}

impl Default for QueueState {
    fn default() -> Self {
        QueueState {
            full: true,
            landing: false,
            waits: 0,
            job_bytes: 0,
        }
    }
}

/// One ack's commands, built by [`Reliable::ack`].
#[derive(Debug)]
enum AckCmd {
    /// `DEL` a batch list and its acks set: every job of the batch is done.
    Del(String, String),
    /// `SADD` places to an acks set.
    Sadd(String, Vec<u64>),
}

/// Adds `cmds` to `pipe` ([`AckCmd::replies`] replies each); a batch list deleted leaves `index`, the
/// process's index of held lists, in the same pipeline.
fn add_acks(pipe: &mut redis::Pipeline, cmds: &[AckCmd], index: &str) {
    for c in cmds {
        match c {
            AckCmd::Del(key, acks) => pipe.del(&[key, acks]).srem(index, key),
            AckCmd::Sadd(acks, places) => pipe.sadd(acks, places),
        };
    }
}

impl AckCmd {
    /// How many replies [`add_acks`] adds for it.
    fn replies(&self) -> usize {
        match self {
            AckCmd::Del(..) => 2,
            AckCmd::Sadd(..) => 1,
        }
    }
}

/// An ack waiting for a fetch to carry its commands. The fetch that takes it answers through `sent`:
/// true once Redis answered its pipeline, false when it failed; a fetch dropped midway drops `sent`. In
/// both latter cases the ack sends its commands itself (they are idempotent: an `SADD` of places again,
/// a `DEL` of keys already gone).
#[derive(Debug)]
struct Rider {
    id: u64,
    cmds: Arc<Vec<AckCmd>>,
    sent: tokio::sync::oneshot::Sender<bool>,
}

/// How long an ack waits for a fetch to carry it before it goes out alone: a fetch loop under load
/// fetches far more often than this; the wait only delays the ack (at least once: a job acknowledged
/// late may run again if its process dies meanwhile, as one whose ack was in flight).
const RIDE_WAIT: Duration = Duration::from_millis(2);

/// Counts a fetch loop in a blocking wait for as long as it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::Relaxed);
        Waiting(n)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Marks a queue's landing list as possibly holding a job from the start of a blocking wait on the queue
/// to its end, however it ends (a job, a timeout, an error, the wait dropped).
struct LandingWait<'a> {
    fetcher: &'a Reliable,
    queue: &'a str,
}

impl<'a> LandingWait<'a> {
    fn new(fetcher: &'a Reliable, queue: &'a str) -> Self {
        fetcher.with_queue(queue, QueueState::wait);
        LandingWait { fetcher, queue }
    }
}

impl Drop for LandingWait<'_> {
    fn drop(&mut self) {
        self.fetcher.with_queue(self.queue, QueueState::wait);
    }
}

impl QueueState {
    /// A blocking wait on the queue starts or ends: its landing list may hold a job.
    fn wait(&mut self) {
        self.landing = true;
        self.waits += 1;
    }
}

/// What a fast-path fetch did.
#[derive(Debug)]
enum Fast {
    /// Jobs taken from the queue, in the order it served them (none: it was empty).
    Took(Vec<UnitOfWork>),
    /// The queue's key is no list: paused, nothing taken.
    Stalled,
    /// Nothing taken, the queue as it was: this fetch goes through the script (the batch could hold a
    /// payload over the limit, or Redis refused a command of the fast path).
    Script,
}

/// About how many bytes one fast-path batch copies, unless that is fewer than [`FAST_BATCH_JOBS`] jobs:
/// `SORT .. STORE` holds a copy of every job of the batch at once before it builds the list, and Redis's
/// cost per job of it grows with the batch (4 KB payloads: 2 µs a job in batches of 50, 4 µs in batches of
/// 200; 16 KB: 5-6 µs in batches of 50, 10-20 µs in batches of 200), while a batch's fixed cost (the
/// guard, the `LTRIM`, a round trip) is spread over fewer jobs the smaller it is
/// (bench/results/redis-per-job.md).
const FAST_BATCH_BYTES: usize = 256 * 1024;

/// Jobs a fast-path batch may hold past [`FAST_BATCH_BYTES`], within [`FAST_BATCH_MAX_BYTES`].
const FAST_BATCH_JOBS: usize = 64;

/// The most bytes a fast-path batch copies, whatever its count (it holds at least 8 jobs).
const FAST_BATCH_MAX_BYTES: usize = 1024 * 1024;

/// Jobs one fast-path batch asks for: the free slots (at most [`MAX_BATCH`]), and, for jobs of
/// `job_bytes` each (the last batch's `MEMORY USAGE` per job; 0: not known yet), about
/// [`FAST_BATCH_BYTES`] of them or [`FAST_BATCH_JOBS`], whichever is more, within
/// [`FAST_BATCH_MAX_BYTES`] and no fewer than 8, and within `room` (the most `MEMORY USAGE` a copy may
/// have for the guard to pass it, while lists may be compressed; at least one job), so a copy is not
/// made only to be deleted.
fn fast_batch(max: usize, job_bytes: usize, room: usize) -> usize {
    let max = max.clamp(1, MAX_BATCH);
    if job_bytes == 0 {
        return max;
    }
    let n = (FAST_BATCH_BYTES / job_bytes)
        .max(FAST_BATCH_JOBS)
        .min(FAST_BATCH_MAX_BYTES / job_bytes)
        .max(8)
        .min((room / job_bytes).max(1));
    max.min(n)
}

/// How many bytes one list element may hold for each byte that `MEMORY USAGE` counts of its list, when
/// the server compresses list nodes (`list-compress-depth` > 0; Valkey 9.1's `SORT .. STORE` builds its
/// list so, Redis 7.0's does not). A compressed node counts its compressed bytes, and LZF, the
/// compressor of Redis's and Valkey's lists, writes at least 3 bytes for each 264 it reads (its longest
/// back reference), so an element holds at most 88 bytes per byte counted: a 100 MB payload of one
/// repeated character counts about 1.2 MB.
const COMPRESSED_RATIO: usize = 88;

/// How often the fetcher reads the server's `list-compress-depth` again ([`Reliable::read_list_config`]).
const LIST_CONFIG_EVERY: Duration = Duration::from_secs(10);

/// Replies of the fast path's transaction before the riding acks': `MULTI`, three `QUEUED`, `EXEC`.
const FAST_REPLIES: usize = 5;

/// What one run of the batch script reported, by source (its place in the round's sources).
#[derive(Debug, Default)]
struct ScriptReport {
    /// Jobs in each source's batch list.
    counts: Vec<usize>,
    /// How each source's jobs were taken: `n` a copy of every job asked, `p` a copy of fewer, `s`
    /// job by job; none when it gave none.
    tags: Vec<Option<u8>>,
    /// The queues that failed (paused now).
    failed: Vec<Arc<str>>,
    /// The sources that failed.
    failed_sources: Vec<usize>,
    /// How many sources the script looked at, from the first.
    seen: usize,
    /// Whether anything happened: jobs, an oversized one sent to the dead set, an error.
    busy: bool,
}

/// Answers the acks that rode on a fetch's pipeline (their replies follow the fetch's first `skip`):
/// each true once Redis took every command of it.
fn answer_riders(
    riders: Vec<Rider>,
    replies: &redis::RedisResult<Vec<redis::RedisResult<redis::Value>>>,
    skip: usize,
) {
    let mut acked = match replies {
        Ok(v) => v.get(skip..).unwrap_or_default().iter(),
        Err(_) => [].iter(),
    };
    for r in riders {
        // Every reply of this rider read (not `all`, which stops at the first error and would leave
        // the rest to be read as the next rider's).
        let mut ok = replies.is_ok();
        for reply in acked
            .by_ref()
            .take(r.cmds.iter().map(AckCmd::replies).sum())
        {
            ok &= reply.is_ok();
        }
        let _ = r.sent.send(ok);
    }
}

impl Reliable {
    /// A fetcher for `identity`'s process.
    pub(crate) fn new(
        queues: &[QueueWeight],
        identity: &str,
        conn: Conn,
        blocking: Conn,
        block: Duration,
    ) -> Self {
        let order = QueueOrder::new(queues);
        let states = order
            .names()
            .iter()
            .map(|q| (q.clone(), Mutex::new(QueueState::default())))
            .collect();
        Reliable {
            names: order.names().to_vec(),
            order,
            identity: identity.to_string(),
            batch_prefix: keys::batch_prefix(identity),
            landing_prefix: keys::landing_prefix(identity),
            index: keys::held_index(identity),
            conn,
            blocking,
            script: Script::new(FETCH_LUA),
            next_batch: AtomicU64::new(0),
            capsule: 0,
            block,
            max_payload_bytes: 16 * 1024 * 1024,
            fleet: Arc::new(crate::fleet::Fleet::new(None)),
            held: Mutex::new(Held::default()),
            stalls: Stalls::default(),
            dead: AtomicU64::new(0),
            riders: Mutex::new(Vec::new()),
            refused_acks: Mutex::new(foldhash::HashSet::default()),
            next_rider: AtomicU64::new(0),
            ride_wait: RIDE_WAIT,
            waiting: AtomicUsize::new(0),
            queues: states,
            fast: AtomicBool::new(true),
            mem_ratio: AtomicUsize::new(COMPRESSED_RATIO),
            list_config_read: Mutex::new(None),
            list_config_warned: AtomicBool::new(false),
        }
    }

    /// Built from the launcher's [`Setup`].
    pub(crate) fn from_setup(s: Setup<'_>) -> Self {
        let capsule = s.capsule;
        Reliable::new(s.queues, s.identity, s.conn, s.blocking, s.block)
            .with_payload_limit(s.max_payload_bytes, s.fleet)
            .in_capsule(capsule)
    }

    /// Numbers this fetcher's batches in capsule `capsule`'s range (see [`super::CAPSULE_SHIFT`]).
    pub(crate) fn in_capsule(mut self, capsule: u64) -> Self {
        self.capsule = capsule;
        self.next_batch = AtomicU64::new(capsule << super::CAPSULE_SHIFT);
        self
    }

    /// Sets the payload size limit (0: none) and the fleet whose readers decide how `failed_at` is
    /// written on a payload over it.
    pub(crate) fn with_payload_limit(
        mut self,
        max_payload_bytes: usize,
        fleet: Arc<crate::fleet::Fleet>,
    ) -> Self {
        self.max_payload_bytes = max_payload_bytes;
        self.fleet = fleet;
        self
    }

    /// For tests: acks wait up to `wait` for a fetch to carry them.
    #[cfg(test)]
    pub(crate) fn with_ride_wait(mut self, wait: Duration) -> Self {
        self.ride_wait = wait;
        self
    }

    /// The first of `len` consecutive batch numbers for a fetch, all inside this capsule's range
    /// ([`super::CAPSULE_SHIFT`]): a block that would pass the range's end starts again at its
    /// beginning, after 2^46 numbers (centuries at any fetch rate, so no list of that number still
    /// exists), and never names a list of the next capsule, whose sweeps would take it.
    fn reserve_numbers(&self, len: u64) -> u64 {
        let len = len.max(1);
        let base = self.capsule << super::CAPSULE_SHIFT;
        let mut last = self.next_batch.load(Ordering::Relaxed);
        loop {
            let mut first = last.wrapping_add(1);
            let end = first.wrapping_add(len - 1);
            if super::capsule_of(first) != self.capsule
                || super::capsule_of(end) != self.capsule
                || end < first
            {
                first = base + 1;
            }
            match self.next_batch.compare_exchange_weak(
                last,
                first + len - 1,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return first,
                Err(now) => last = now,
            }
        }
    }

    /// For tests: the next batch number is `n + 1`, as after `n` batch numbers were used (a process
    /// that ran for weeks: each script fetch uses two numbers per queue of its round).
    #[cfg(test)]
    pub(crate) fn numbered_after(self, n: u64) -> Self {
        self.next_batch.store(n, Ordering::Relaxed);
        self
    }

    /// For tests: every fetch goes through the batch script (as after Redis refused the fast path).
    #[cfg(test)]
    pub(crate) fn script_only(self) -> Self {
        self.fast.store(false, Ordering::Relaxed);
        self
    }

    /// For tests: `queue` is expected to fill a batch, as after another fetch loop's look found it full.
    #[cfg(test)]
    pub(crate) fn expect_full(&self, queue: &str) {
        self.with_queue(queue, |s| s.full = true);
    }

    /// For tests: how many acks wait for a fetch to carry them.
    #[cfg(test)]
    pub(crate) fn riders(&self) -> usize {
        self.riders.lock().map_or(0, |r| r.len())
    }

    /// Batch `batch`'s list for `queue` and its acks set.
    fn lists(&self, queue: &Arc<str>, batch: u64) -> (String, String, Arc<str>) {
        let key = keys::batch_list(&self.batch_prefix, queue, batch);
        let acks = keys::acks_of(&key);
        (key, acks, queue.clone())
    }

    /// Records the jobs of one batch list as handed out.
    fn open(&self, batch: u64, (key, acks, queue): (String, String, Arc<str>), count: usize) {
        if count == 0 {
            return;
        }
        if let Ok(mut h) = self.held.lock() {
            h.open.insert(
                batch,
                Batch {
                    key,
                    acks,
                    queue,
                    left: count,
                    settled: vec![false; count],
                },
            );
        }
    }

    async fn fetch(&self, max: usize) -> Result<Vec<UnitOfWork>> {
        self.read_list_config().await;
        let order = self.stalls.usable(self.order.next());
        let (got, busy) = self.fetch_round(&order, max).await?;
        // Something happened (jobs, an oversized one sent to the dead set, a queue error): come back at
        // once rather than block. Blocking would pull the next job through `BLMOVE`, whose reply carries
        // the payload: an oversized one would be read into memory.
        if busy {
            return Ok(got);
        }
        // A queue the batch found broken is not waited on.
        let order = self.stalls.usable(order);
        if self.wait_for_work(&order).await? {
            // The job waits in its landing list; the batch script takes it (and any others).
            return Ok(self.fetch_batch(&order, max).await?.0);
        }
        Ok(Vec::new())
    }

    /// One fetch over the round's queues: the fast path when the first queue is expected to fill the
    /// batch, else (or when the fast path took nothing) the script. The jobs, and whether anything
    /// happened at all.
    async fn fetch_round(&self, order: &[Arc<str>], max: usize) -> Result<(Vec<UnitOfWork>, bool)> {
        if let Some(first) = order.first()
            && self.fast_fits(first)
        {
            match self.fetch_fast(first, max).await? {
                Fast::Took(units) if !units.is_empty() => return Ok((units, true)),
                // The first queue is paused now: the others are served as if it had been before.
                Fast::Stalled => {
                    let rest = self.stalls.usable(order.to_vec());
                    return Ok((self.fetch_batch(&rest, max).await?.0, true));
                }
                // The first queue was empty (the others, and the landing lists, may not be), or the
                // batch could hold a payload over the limit, or the fast path was refused.
                Fast::Took(_) | Fast::Script => {}
            }
        }
        // Batches of the first queue's jobs sized as the fast path sizes them: a queue of big payloads,
        // whose batch of every free slot could pass the payload limit, is then copied whole by the
        // script (and found full, the fast path's again) rather than read job by job through Lua.
        let max = match order.first() {
            Some(first) => fast_batch(
                max,
                self.with_queue(first, |s| s.job_bytes).unwrap_or(0),
                self.batch_room(),
            ),
            None => max,
        };
        self.fetch_batch(order, max).await
    }

    /// Runs `f` on `queue`'s state (none for a queue not configured).
    fn with_queue<T>(&self, queue: &str, f: impl FnOnce(&mut QueueState) -> T) -> Option<T> {
        let state = self.queues.get(queue)?;
        let mut state = state.lock().ok()?;
        Some(f(&mut state))
    }

    /// Whether a fetch whose round starts with `queue` takes the fast path.
    fn fast_fits(&self, queue: &str) -> bool {
        self.fast.load(Ordering::Relaxed)
            && self
                .with_queue(queue, |s| s.full && !s.landing)
                .unwrap_or(false)
    }

    /// The most payload bytes one fetch takes (it always takes one job).
    fn budget(&self) -> usize {
        BATCH_BYTES.max(self.max_payload_bytes)
    }

    /// The most bytes a batch list's copy may hold for the fast path to read it: the payload limit, or
    /// the budget when there is no limit.
    fn cap(&self) -> usize {
        match self.max_payload_bytes {
            0 => self.budget(),
            limit => limit.min(self.budget()),
        }
    }

    /// The most `MEMORY USAGE` a fast-path copy may have for the guard to pass it: [`Reliable::cap`] over
    /// the bytes an element may hold per byte counted (1, or [`COMPRESSED_RATIO`]).
    fn room(&self) -> usize {
        self.cap() / self.mem_ratio.load(Ordering::Relaxed).max(1)
    }

    /// The `room` that sizes batches ([`fast_batch`]): [`Reliable::room`] while the server may compress
    /// lists, so a batch of jobs within the limit is copied whole rather than read job by job through Lua
    /// at every fetch; no bound otherwise (a batch that could hold a payload over the limit is read job
    /// by job, as it was before compressed lists were accounted for).
    fn batch_room(&self) -> usize {
        match self.mem_ratio.load(Ordering::Relaxed) {
            0 | 1 => usize::MAX,
            _ => self.room(),
        }
    }

    /// Reads the server's `list-compress-depth` (at the first fetch, then every [`LIST_CONFIG_EVERY`]):
    /// the size guards judge a batch list by `MEMORY USAGE`, which counts a compressed node's compressed
    /// bytes, so a copy of a 100 MB payload of one repeated character would pass a 16 MB limit by 80
    /// times. While the server says 0 (no list compressed: the default of Redis and Valkey), every job
    /// of a copy is at most its `MEMORY USAGE`; otherwise, and when the server refuses `CONFIG GET` (an
    /// ACL without `+config|get`, a managed service; logged once at WARN) or answers no such setting,
    /// at most [`COMPRESSED_RATIO`] times that, so copies are held to 1/88 of the limit (smaller
    /// batches; a batch over that is read job by job by the batch script, where every payload is
    /// measured). A server changed with `CONFIG SET` is seen within [`LIST_CONFIG_EVERY`].
    async fn read_list_config(&self) {
        let due = self.list_config_read.lock().is_ok_and(|mut read| {
            let due = read.is_none_or(|t| t.elapsed() >= LIST_CONFIG_EVERY);
            if due {
                *read = Some(Instant::now());
            }
            due
        });
        if !due {
            return;
        }
        let reply: redis::RedisResult<std::collections::HashMap<String, String>> =
            redis::cmd("CONFIG")
                .arg("GET")
                .arg("list-compress-depth")
                .query_async(&mut self.conn.clone())
                .await;
        let ratio = match reply {
            Ok(config) => match config
                .get("list-compress-depth")
                .and_then(|v| v.trim().parse::<i64>().ok())
            {
                Some(0) => 1,
                _ => COMPRESSED_RATIO,
            },
            Err(e) if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() => {
                // The connection failed: read again at the next fetch, judging as if compressed meanwhile.
                if let Ok(mut read) = self.list_config_read.lock() {
                    *read = None;
                }
                COMPRESSED_RATIO
            }
            Err(e) => {
                if !self.list_config_warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, ratio = COMPRESSED_RATIO,
                        "redis refused CONFIG GET list-compress-depth: the payload size guard assumes lists may be compressed, so a batch is copied whole only up to 1/ratio of the payload limit (allow +config|get to lift this)");
                }
                COMPRESSED_RATIO
            }
        };
        self.mem_ratio.store(ratio, Ordering::Relaxed);
    }

    /// Turns the fast path off for good, once: Redis refused one of its commands.
    fn refuse_fast(&self, why: &str) {
        if self.fast.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                error = why,
                "redis refused a command of the fast fetch path; this process fetches through the batch script from now on"
            );
        }
    }

    /// The fast path: one transaction takes up to `max` jobs of `queue` into a new batch list and reads
    /// them, no script between them but a guard of a few calls ([`GUARD_LUA`]):
    /// `MULTI; SORT queue:<q> BY nosort DESC LIMIT 0 <n> STORE <list>; EVAL <guard>; LRANGE <list> 0 -1;
    /// EXEC`, with the acks waiting for a fetch after it. The `SORT`'s count is how many it took (a queue
    /// shorter than n gives what it has); the guard trims exactly the jobs the list holds off the queue,
    /// only once the copy is there and within the limit. Nothing runs between the copy and the trim, so
    /// the list holds exactly the jobs the queue lost, and a copy that failed removes nothing.
    async fn fetch_fast(&self, queue: &Arc<str>, max: usize) -> Result<Fast> {
        let job_bytes = self.with_queue(queue, |s| s.job_bytes).unwrap_or(0);
        let n = fast_batch(max, job_bytes, self.batch_room());
        let batch = self.reserve_numbers(1);
        let list = self.lists(queue, batch);
        let mut reservation = Reservation::new(self, vec![list.clone()], (batch, batch + 1));
        let qkey = keys::queue(queue);
        let mut pipe = redis::pipe();
        pipe.cmd("MULTI")
            .cmd("SORT")
            .arg(&qkey)
            .arg("BY")
            .arg("nosort")
            .arg("DESC")
            .arg("LIMIT")
            .arg(0)
            .arg(n)
            .arg("STORE")
            .arg(&list.0)
            .cmd("EVAL")
            .arg(GUARD_LUA)
            .arg(3)
            .arg(&qkey)
            .arg(&list.0)
            .arg(&self.index)
            .arg(self.room())
            .cmd("LRANGE")
            .arg(&list.0)
            .arg(0)
            .arg(-1)
            .cmd("EXEC");
        let riders = self.take_riders();
        for r in &riders {
            add_acks(&mut pipe, &r.cmds, &self.index);
        }
        pipe.ignore_errors();
        let replies: redis::RedisResult<Vec<redis::RedisResult<redis::Value>>> =
            pipe.query_async(&mut self.conn.clone()).await;
        answer_riders(riders, &replies, FAST_REPLIES);
        let mut replies = replies?;
        replies.truncate(FAST_REPLIES);
        let exec = match replies.pop() {
            Some(Ok(redis::Value::Array(items))) => items,
            Some(Err(e)) if e.code() == Some("EXECABORT") => {
                // Refused before it ran (nothing happened): by an ACL or a command renamed away for
                // good, or for now (a replica after a failover, out of memory).
                reservation.answered = true;
                let first = replies
                    .into_iter()
                    .skip(1)
                    .find_map(|r| r.err())
                    .unwrap_or(e);
                if matches!(first.code(), Some("NOPERM") | Some("ERR")) {
                    self.refuse_fast(&first.to_string());
                    return Ok(Fast::Script);
                }
                return Err(first.into());
            }
            Some(Err(e)) => return Err(e.into()),
            _ => {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::UnexpectedReturnType,
                    "the fast fetch's transaction answered no array",
                ))
                .into());
            }
        };
        reservation.answered = true;
        let mut exec = exec.into_iter();
        let (sorted, guard, read) = (exec.next(), exec.next(), exec.next());
        if let Some(redis::Value::ServerError(e)) = sorted {
            // The copy failed, so the guard trimmed nothing: the queue is as it was. Its key is a hash
            // or a string (`WRONGTYPE`), or Redis refused the `SORT` when the transaction ran (an ACL
            // changed after it was queued).
            let e = redis::RedisError::from(e);
            if e.code() == Some("WRONGTYPE") {
                let msg = describe(&self.conn, std::slice::from_ref(&qkey), &e).await;
                self.stalls.stall(queue, &msg);
                return Ok(Fast::Stalled);
            }
            self.refuse_fast(&e.to_string());
            return Ok(Fast::Script);
        }
        let taken = match sorted {
            Some(redis::Value::Int(c)) => usize::try_from(c).unwrap_or(0),
            _ => 0,
        };
        let copied = match guard {
            Some(redis::Value::Int(mem)) => usize::try_from(mem).unwrap_or(0),
            Some(redis::Value::Array(parts)) => {
                // The copy is deleted and the queue as it was: nothing taken.
                let mut parts = parts.into_iter().map(reply_bytes);
                let tag = parts.next().unwrap_or_default();
                let what = String::from_utf8_lossy(&parts.next().unwrap_or_default()).into_owned();
                match tag.as_slice() {
                    // The script reads the queue job by job. Its size per job sizes the next batches
                    // (the script's too).
                    b"over" => {
                        let per_job = what
                            .parse::<usize>()
                            .ok()
                            .and_then(|m| m.checked_div(taken));
                        self.with_queue(queue, |s| {
                            s.full = false;
                            s.job_bytes = per_job.unwrap_or(s.job_bytes);
                        });
                        return Ok(Fast::Script);
                    }
                    b"type" => {
                        self.stalls
                            .stall(queue, &format!("{qkey} is a {what}, not a list"));
                        return Ok(Fast::Stalled);
                    }
                    _ => {
                        self.refuse_fast(&what);
                        return Ok(Fast::Script);
                    }
                }
            }
            other => {
                // The guard failed (never seen: every call in it is a `pcall`, every value checked),
                // so nothing was trimmed; what the list held was read, and is a copy of jobs still
                // queued: deleted, never handed out (it would run them twice).
                let what = match other {
                    Some(redis::Value::ServerError(e)) => redis::RedisError::from(e).to_string(),
                    _ => "no reply".into(),
                };
                self.refuse_fast(&what);
                let _ = redis::cmd("DEL")
                    .arg(&list.0)
                    .query_async::<()>(&mut self.conn.clone())
                    .await;
                return Ok(Fast::Script);
            }
        };
        let jobs: Vec<Vec<u8>> = match read {
            Some(v @ redis::Value::Array(_)) => match redis::from_redis_value(v) {
                Ok(jobs) => jobs,
                Err(e) => {
                    // Trimmed off the queue, never handed out: the list goes back with the next sweep.
                    if let Ok(mut h) = self.held.lock() {
                        h.lost.push(list.clone());
                    }
                    return Err(redis::RedisError::from(e).into());
                }
            },
            _ => {
                // Not read (an ACL changed after the transaction was queued): whatever the list holds
                // goes back with the next sweep.
                if let Ok(mut h) = self.held.lock() {
                    h.lost.push(list.clone());
                }
                Vec::new()
            }
        };
        if taken != jobs.len() {
            // Only a recovery that judged this process dead touches its lists in between.
            tracing::warn!(queue = %queue, expected = taken, read = jobs.len(),
                "a batch list changed between the fetch and its read");
        }
        self.with_queue(queue, |s| {
            s.full = taken >= n;
            if let Some(per_job) = copied.checked_div(taken) {
                s.job_bytes = per_job;
            }
        });
        self.stalls.unstall(std::slice::from_ref(queue), &[]);
        self.open(batch, list, jobs.len());
        let base = batch << keys::PLACE_BITS;
        Ok(Fast::Took(
            jobs.into_iter()
                .enumerate()
                .map(|(place, raw)| UnitOfWork::new(queue.clone(), base | place as u64, raw))
                .collect(),
        ))
    }

    /// The acks waiting for a fetch to carry them, taken for this one.
    fn take_riders(&self) -> Vec<Rider> {
        self.riders
            .lock()
            .map(|mut r| std::mem::take(&mut *r))
            .unwrap_or_default()
    }

    /// One run of the batch script, with the batch lists read in the same pipeline: the jobs it handed
    /// out, and whether it did anything at all.
    async fn fetch_batch(&self, order: &[Arc<str>], max: usize) -> Result<(Vec<UnitOfWork>, bool)> {
        if order.is_empty() {
            return Ok((Vec::new(), false));
        }
        let max = max.clamp(1, MAX_BATCH);
        // Two sources per queue of the round, its landing list and the queue itself, each copied into a
        // batch list of its own with a batch number of its own, so a unit id (batch and place) names one
        // list.
        let sources: Vec<(Arc<str>, String)> = order
            .iter()
            .flat_map(|q| {
                [
                    (q.clone(), format!("{}{q}", self.landing_prefix)),
                    (q.clone(), keys::queue(q)),
                ]
            })
            .collect();
        let first = self.reserve_numbers(sources.len() as u64);
        let lists: Vec<_> = sources
            .iter()
            .zip(first..)
            .map(|((q, _), batch)| self.lists(q, batch))
            .collect();
        let range = (first, first + lists.len() as u64);
        let mut reservation = Reservation::new(self, lists.clone(), range);
        // Blocking waits counted before the script looks at the landing lists: one that starts or ends
        // after this may put a job there that the script did not see.
        let waits: Vec<u64> = order
            .iter()
            .map(|q| self.with_queue(q, |s| s.waits).unwrap_or(0))
            .collect();
        let now = time::now();
        let (trim_before, dead_max) = dead_trim(now);
        let mut pipe = redis::pipe();
        let eval = pipe.cmd("EVALSHA").arg(self.script.get_hash());
        eval.arg(2 + 2 * lists.len()).arg(keys::DEAD);
        for ((_, src), (dest, _, _)) in sources.iter().zip(&lists) {
            eval.arg(src).arg(dest);
        }
        eval.arg(&self.index);
        eval.arg(max)
            .arg(self.max_payload_bytes)
            .arg(self.budget())
            .arg(format!("{}/{first}", self.identity))
            .arg(score(now))
            .arg(self.fleet.time_format().value(now).to_string())
            .arg(trim_before)
            .arg(dead_max)
            .arg(self.mem_ratio.load(Ordering::Relaxed));
        for (key, _, _) in &lists {
            pipe.cmd("LRANGE").arg(key).arg(0).arg(-1);
        }
        // Acks waiting for a fetch ride along (one round trip fewer each); they are answered below,
        // and if this fetch fails or is dropped they go out on their own (`Reliable::ack`). Each reply
        // is read on its own (`ignore_errors`), so an ack refused (its acks set damaged) fails only
        // that ack, never the fetch, and a fetch that fails fails no ack that Redis took.
        let riders = self.take_riders();
        for r in &riders {
            add_acks(&mut pipe, &r.cmds, &self.index);
        }
        pipe.ignore_errors();
        let mut conn = self.conn.clone();
        let noscript = |r: &redis::RedisResult<Vec<redis::RedisResult<redis::Value>>>| matches!(r, Ok(v) if matches!(v.first(), Some(Err(e)) if e.code() == Some("NOSCRIPT")));
        let mut replies: redis::RedisResult<Vec<redis::RedisResult<redis::Value>>> =
            pipe.query_async(&mut conn).await;
        if noscript(&replies) {
            // The script ran nowhere: load it and send the pipeline again (the acks in it too:
            // sending them twice is harmless).
            replies = match self.script.prepare_invoke().load_async(&mut conn).await {
                Ok(_) => pipe.query_async(&mut conn).await,
                Err(e) => Err(e),
            };
        }
        let fetch_replies = 1 + lists.len();
        answer_riders(riders, &replies, fetch_replies);
        let replies = replies?;
        let mut replies = replies.into_iter().take(fetch_replies);
        let flat: Vec<Vec<u8>> = match replies.next().transpose()? {
            Some(v) => redis::from_redis_value::<Vec<redis::Value>>(v)
                .map_err(redis::RedisError::from)?
                .into_iter()
                .map(reply_bytes)
                .collect(),
            None => Vec::new(),
        };
        let mut read: Vec<Vec<Vec<u8>>> = Vec::with_capacity(lists.len());
        for v in replies {
            read.push(redis::from_redis_value(v?).map_err(redis::RedisError::from)?);
        }
        let report = self.read_reply(flat, &sources);
        let busy = report.busy;
        self.note_looks(order, &report, &waits);
        let mut out = Vec::new();
        for (i, jobs) in read.into_iter().enumerate() {
            let (Some((q, _)), Some(list)) = (sources.get(i), lists.get(i)) else {
                continue;
            };
            let expected = report.counts.get(i).copied().unwrap_or(0);
            if expected != jobs.len() {
                // Only a recovery that judged this process dead touches its lists in between.
                tracing::warn!(queue = %q, expected, read = jobs.len(),
                    "a batch list changed between the fetch and its read");
            }
            let batch = first + i as u64;
            self.open(batch, list.clone(), jobs.len());
            // The list's head is the job its source served first: handed out in that order.
            let base = batch << keys::PLACE_BITS;
            for (place, raw) in jobs.into_iter().enumerate() {
                out.push(UnitOfWork::new(q.clone(), base | place as u64, raw));
            }
        }
        reservation.answered = true;
        // With fewer than `max` taken, the script looked at every queue of the round.
        if out.len() < max {
            self.stalls.unstall(order, &report.failed);
        }
        Ok((out, busy))
    }

    /// What the batch script's look at the round's queues says of them: a queue whose copy took every
    /// job asked is expected to fill the next batch (the fast path's), one it found short, empty, or
    /// read job by job is not; a landing list it looked at without an error is empty, unless a
    /// blocking wait began or ended since `waits` were counted.
    fn note_looks(&self, order: &[Arc<str>], report: &ScriptReport, waits: &[u64]) {
        for (j, q) in order.iter().enumerate() {
            let (landing, queue) = (2 * j, 2 * j + 1);
            let looked =
                |source: usize| source < report.seen && !report.failed_sources.contains(&source);
            let before = waits.get(j).copied().unwrap_or(0);
            self.with_queue(q, |s| {
                if looked(landing) && s.waits == before {
                    s.landing = false;
                }
                if looked(queue) {
                    s.full = report.tags.get(queue).copied().flatten() == Some(b'n');
                }
            });
        }
    }

    /// Reads the batch script's records: how many jobs each source's batch list holds (by its place in
    /// the round's sources), how it took them, the queues that failed (paused here), and how many
    /// sources it looked at.
    fn read_reply(&self, flat: Vec<Vec<u8>>, sources: &[(Arc<str>, String)]) -> ScriptReport {
        let index = |q: &[u8]| {
            std::str::from_utf8(q)
                .ok()
                .and_then(|s| s.parse::<usize>().ok())
                .unwrap_or(0)
                .wrapping_sub(1)
        };
        let name_of = |q: &[u8]| {
            sources
                .get(index(q))
                .map(|(name, _)| name.clone())
                .unwrap_or_else(|| Arc::from(String::from_utf8_lossy(q).as_ref()))
        };
        let number = |b: &[u8]| {
            std::str::from_utf8(b)
                .ok()
                .and_then(|s| s.parse::<usize>().ok())
                .unwrap_or(0)
        };
        let mut report = ScriptReport {
            counts: vec![0; sources.len()],
            tags: vec![None; sources.len()],
            busy: false,
            ..ScriptReport::default()
        };
        let mut it = flat.into_iter();
        while let (Some(q), Some(tag), Some(body)) = (it.next(), it.next(), it.next()) {
            match tag.as_slice() {
                b"seen" => {
                    report.seen = number(&body);
                    continue;
                }
                b"err" => {
                    let queue = name_of(&q);
                    self.stalls.stall(&queue, &String::from_utf8_lossy(&body));
                    report.failed.push(queue);
                    report.failed_sources.push(index(&q));
                }
                b"dead" => {
                    self.dead.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(queue = %name_of(&q), size = %String::from_utf8_lossy(&body),
                        limit = self.max_payload_bytes,
                        "payload over the size limit sent to the dead set without being read");
                }
                _ => {
                    let i = index(&q);
                    if let Some(c) = report.counts.get_mut(i) {
                        *c += number(&body);
                    }
                    if let Some(t) = report.tags.get_mut(i) {
                        *t = tag.first().copied();
                    }
                }
            }
            report.busy = true;
        }
        report
    }

    /// Blocks until a job arrives on the first queue of the round (moving it into its landing list) or
    /// the block time passes. True when a job landed. The landing list is swept by name
    /// ([`Fetch::requeue_leftovers`]), so a wait cut short, or one that Redis served after its reply
    /// was no longer awaited, strands nothing; and the fast path keeps off the queue until the script
    /// has looked at its landing list since.
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
        let (queue, landing) = (
            keys::queue(first),
            format!("{}{first}", self.landing_prefix),
        );
        let _waiting = Waiting::new(&self.waiting);
        let _landing = LandingWait::new(self, first);
        // The payload comes back in the reply; the batch script copies it out of the landing list (an
        // oversized one goes to the dead set there).
        let moved: redis::RedisResult<Option<Vec<u8>>> = redis::cmd("BLMOVE")
            .arg(&queue)
            .arg(&landing)
            .arg("RIGHT")
            .arg("LEFT")
            .arg(block.as_secs_f64())
            .query_async(&mut self.blocking.clone())
            .await;
        match moved {
            Ok(raw) => Ok(raw.is_some()),
            Err(e) if e.code() == Some("WRONGTYPE") => {
                let msg = describe(&self.conn, &[queue, landing], &e).await;
                self.stalls.stall(first, &msg);
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The jobs by batch, the newest batch first, each batch's places from its list's tail (a list holds
    /// its jobs in serve order): pushed back in this order, each to the served end of its queue, they
    /// are served again in the order their queue served them.
    fn by_batch(done: &[UnitOfWork]) -> Vec<(u64, Vec<u64>)> {
        let mut out: Vec<(u64, Vec<u64>)> = Vec::new();
        for u in done {
            let (batch, place) = (u.id >> keys::PLACE_BITS, u.id & PLACE_MASK);
            match out.iter_mut().find(|(b, _)| *b == batch) {
                Some((_, places)) => places.push(place),
                None => out.push((batch, vec![place])),
            }
        }
        for (_, places) in &mut out {
            places.sort_unstable_by_key(|p| std::cmp::Reverse(*p));
            places.dedup();
        }
        out.sort_unstable_by_key(|b| std::cmp::Reverse(b.0));
        out
    }

    /// Counts `places` of `batch` as done once Redis has them; a batch with nothing left is forgotten,
    /// its keys returned for deletion.
    fn settle(&self, batch: u64, places: &[u64]) -> Option<(String, String)> {
        let mut h = self.held.lock().ok()?;
        let b = h.open.get_mut(&batch)?;
        for p in places {
            if let Some(s) = b.settled.get_mut(*p as usize)
                && !*s
            {
                *s = true;
                b.left = b.left.saturating_sub(1);
            }
        }
        if b.left > 0 {
            return None;
        }
        h.open.remove(&batch).map(|b| (b.key, b.acks))
    }

    /// One pipeline: a batch whose every job is now done is deleted (its list and acks set: one `DEL`,
    /// whatever the payloads); the places of the others are added to their acks sets (one `SADD` per
    /// batch). The counts change only once Redis answered, so an ack retried after an error counts once.
    async fn ack(&self, done: &[UnitOfWork]) -> Result<()> {
        if done.is_empty() {
            return Ok(());
        }
        let groups = Self::by_batch(done);
        let mut cmds = Vec::new();
        let mut deleted = Vec::new();
        {
            let h = self.held.lock().map_err(|_| poisoned())?;
            for (batch, places) in &groups {
                let Some(b) = h.open.get(batch) else {
                    continue;
                };
                if b.left <= b.unsettled(places) {
                    cmds.push(AckCmd::Del(b.key.clone(), b.acks.clone()));
                    deleted.push(*batch);
                } else {
                    cmds.push(AckCmd::Sadd(b.acks.clone(), places.clone()));
                }
            }
        }
        let cmds = Arc::new(cmds);
        if !cmds.is_empty() && !self.ride(&cmds).await {
            self.send_acks(&cmds).await?;
        }
        // Counted only now that Redis has the commands (sent by a fetch or above).
        let mut emptied = Vec::new();
        for (batch, places) in &groups {
            if let Some(keys) = self.settle(*batch, places)
                && !deleted.contains(batch)
            {
                emptied.push(keys);
            }
        }
        self.delete_emptied(emptied).await
    }

    /// Sends `cmds` in one pipeline, each reply read on its own. An outage (Redis away or busy) is an
    /// error: the acker sends them again (they are idempotent). A command refused for a reason that will
    /// not mend by itself (its acks set is a key of the wrong type, Redis out of memory) costs only its
    /// own batch: it is logged at error level once, naming the key and its type, and that batch's ack is
    /// dropped, never retried: its jobs count as done here, their places stay unmarked in Redis (the
    /// batch's last ack deletes its list and that key with one `DEL`, whatever the key holds; should the
    /// process stop or die first, they stay in the list for recovery, as any job whose acknowledgement
    /// never reached Redis). The other batches' acks are in Redis all the same: one damaged key stopped
    /// every later ack of the process before (the acker retried the failed pipeline forever).
    async fn send_acks(&self, cmds: &[AckCmd]) -> Result<()> {
        let mut pipe = redis::pipe();
        add_acks(&mut pipe, cmds, &self.index);
        pipe.ignore_errors();
        let replies: Vec<redis::RedisResult<redis::Value>> =
            pipe.query_async(&mut self.conn.clone()).await?;
        let mut refused = Vec::new();
        let mut replies = replies.into_iter();
        for cmd in cmds {
            // The index's SREM after a DEL counts with it: an index that refuses it (damaged) only
            // leaves an entry whose key is gone.
            let mut first = replies.next();
            for _ in 1..cmd.replies() {
                replies.next();
            }
            if let Some(Err(e)) = first.take() {
                let e = crate::Error::from(e);
                if e.is_outage() {
                    return Err(e);
                }
                refused.push((cmd, e));
            }
        }
        for (cmd, e) in refused {
            let key = match cmd {
                AckCmd::Del(key, _) => key,
                AckCmd::Sadd(acks, _) => acks,
            };
            let first = self
                .refused_acks
                .lock()
                .is_ok_and(|mut seen| seen.insert(key.clone()));
            if !first {
                continue;
            }
            let kind: String = redis::cmd("TYPE")
                .arg(key)
                .query_async(&mut self.conn.clone())
                .await
                .unwrap_or_else(|_| "unknown".into());
            tracing::error!(key = %key, r#type = %kind, error = %e,
                "cannot mark finished jobs done in their batch's acks set (a damaged key?): that batch's \
                 ack is dropped, not retried; its jobs stay in its list until its last job is done, or for \
                 recovery should this process stop or die first (the other batches are acknowledged)");
        }
        Ok(())
    }

    /// Hands `cmds` to the next fetch's pipeline and waits up to [`RIDE_WAIT`] for one to take them; true
    /// once a fetch's pipeline carried them and Redis answered it. False (the caller sends them itself)
    /// when no fetch took them in time, when the one that took them failed or was dropped, or when a fetch
    /// loop is in a blocking wait (the queues are empty: no fetch is due soon).
    async fn ride(&self, cmds: &Arc<Vec<AckCmd>>) -> bool {
        if self.waiting.load(Ordering::Relaxed) > 0 {
            return false;
        }
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let id = self.next_rider.fetch_add(1, Ordering::Relaxed);
        match self.riders.lock() {
            Ok(mut r) => r.push(Rider {
                id,
                cmds: cmds.clone(),
                sent: tx,
            }),
            Err(_) => return false,
        }
        if let Ok(answer) = tokio::time::timeout(self.ride_wait, &mut rx).await {
            return answer.unwrap_or(false);
        }
        // No fetch took it in time: take it back, unless one took it just now (then its answer).
        let taken_back = self.riders.lock().is_ok_and(|mut r| {
            let before = r.len();
            r.retain(|x| x.id != id);
            r.len() < before
        });
        if taken_back {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// Deletes the lists of batches found done after the commands that acknowledged them were built (an
    /// ack and a push-back of the same batch at once).
    async fn delete_emptied(&self, emptied: Vec<(String, String)>) -> Result<()> {
        if emptied.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for (key, acks) in &emptied {
            pipe.del(&[key, acks]).srem(&self.index, key);
        }
        pipe.ignore_errors();
        let replies: Vec<redis::RedisResult<redis::Value>> =
            pipe.query_async(&mut self.conn.clone()).await?;
        // A `DEL` is never refused for a key's type; an index that refuses its `SREM` (damaged) only
        // keeps an entry whose key is gone.
        for r in replies {
            if let Err(e) = r {
                let e = crate::Error::from(e);
                if e.is_outage() {
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Each job moves from its batch list in a script, the push before it is marked done, and only if it
    /// is still there (a recovery may have pushed it back already); a queue key of the wrong type leaves
    /// its jobs in the list and is an error naming it.
    async fn requeue(&self, units: &[UnitOfWork]) -> Result<u64> {
        let mut conn = self.conn.clone();
        let mut moved = 0;
        let mut errors = Vec::new();
        let mut emptied = Vec::new();
        for (batch, places) in Self::by_batch(units) {
            let found = self.held.lock().ok().and_then(|h| {
                h.open
                    .get(&batch)
                    .map(|b| (b.key.clone(), b.acks.clone(), b.queue.clone()))
            });
            let Some((key, acks, queue)) = found else {
                continue;
            };
            let (n, err) = push_back(&mut conn, &key, &acks, &queue, &places).await?;
            moved += n;
            if err.is_empty() {
                if let Some(keys) = self.settle(batch, &places) {
                    emptied.push(keys);
                }
            } else {
                errors.push(err);
            }
        }
        self.delete_emptied(emptied).await?;
        if errors.is_empty() {
            Ok(moved)
        } else {
            Err(script_error(errors.join("; ")))
        }
    }

    /// Pushes back every job of `lists` not marked done, each list by one script; the lists that could
    /// not be moved are returned with the errors.
    async fn move_back(
        &self,
        lists: Vec<(String, String, Arc<str>)>,
    ) -> (u64, Vec<(String, String, Arc<str>)>, Vec<crate::Error>) {
        let mut conn = self.conn.clone();
        let script = Script::new(MOVE_BACK_LUA);
        let (mut moved, mut kept, mut errors) = (0, Vec::new(), Vec::new());
        // Batch lists moved whole (deleted): their entries leave the index.
        let mut gone: Vec<String> = Vec::new();
        for list in lists {
            let r: redis::RedisResult<(u64, String)> = script
                .key(&list.0)
                .key(&list.1)
                .key(keys::queue(&list.2))
                .invoke_async(&mut conn)
                .await;
            match r {
                Ok((m, err)) => {
                    moved += m;
                    if !err.is_empty() {
                        errors.push(script_error(err));
                        kept.push(list);
                    } else if list.0.starts_with(&self.batch_prefix) {
                        gone.push(list.0);
                    }
                }
                Err(e) => {
                    // Kept as Redis's error: a lost connection must stay an outage, which the sweeps
                    // retry (flattened into a message it read as a wrong-type key, and the quiet sweep
                    // gave up at once).
                    tracing::warn!(key = %list.0, error = %e, "could not push back a list");
                    errors.push(e.into());
                    kept.push(list);
                }
            }
        }
        if !gone.is_empty() {
            let _: redis::RedisResult<()> =
                redis::AsyncCommands::srem(&mut conn, &self.index, gone).await;
        }
        (moved, kept, errors)
    }

    /// This process's batch lists in Redis that it does not know (neither handed out nor being fetched):
    /// left by a fetch whose reply never came but was not seen to fail, or brought back by a failover
    /// to a replica that had not seen their deletion. Read from its index of held lists
    /// ([`keys::held_index`]), which the write that fills a batch list fills in the same script or
    /// transaction (so a replica that has the list has its entry): what it costs follows what the
    /// process holds, not the keyspace (the stop's two sweeps each walked the whole keyspace before).
    async fn strays(&self) -> Result<Vec<(String, String, Arc<str>)>> {
        let mut conn = self.conn.clone();
        let found: Vec<String> = redis::cmd("SMEMBERS")
            .arg(&self.index)
            .query_async(&mut conn)
            .await?;
        let unknown: Vec<(String, String, Arc<str>)> = {
            let h = self.held.lock().map_err(|_| poisoned())?;
            found
                .into_iter()
                .filter_map(|key| {
                    let rest = key.strip_prefix(&self.batch_prefix)?;
                    let (queue, n) = rest.rsplit_once(":@")?;
                    let n: u64 = n.parse().ok()?;
                    // Another capsule's list is that capsule's to know, never this one's stray.
                    (super::capsule_of(n) == self.capsule && !h.knows(n)).then(|| {
                        let acks = keys::acks_of(&key);
                        (key.clone(), acks, Arc::from(queue))
                    })
                })
                .collect()
        };
        Ok(unknown)
    }

    /// Pushes back the lists of fetches whose reply never came (nothing in them was handed out), and
    /// any other list of this process that it does not know ([`Reliable::strays`]).
    async fn reconcile_now(&self) -> Result<u64> {
        // A read of the index that fails (a damaged key, an ACL refusing it) must not keep the lists this
        // process knows are lost from going back, nor fail the sweep it is part of (the quiet sweep would
        // then leave its unstarted jobs held, and every stop would call itself cut short): the look for
        // strays is an extra, its failure logged here.
        let strays = match self.strays().await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, key = %self.index,
                    "cannot read this process's index of held lists for stray batch lists; only the ones it knows are pushed back");
                Vec::new()
            }
        };
        let mut lost = match self.held.lock() {
            Ok(mut h) => std::mem::take(&mut h.lost),
            Err(_) => return Err(poisoned()),
        };
        for s in strays {
            if !lost.iter().any(|l| l.0 == s.0) {
                lost.push(s);
            }
        }
        newest_first(&mut lost);
        let (moved, kept, errors) = self.move_back(lost).await;
        if let Ok(mut h) = self.held.lock() {
            h.lost.extend(kept);
        }
        sweep_result(moved, errors)
    }

    /// The landing lists, the lists of fetches whose reply never came, then (with `everything`) every job
    /// of every batch list not marked done. Not counted as recoveries.
    /// Keeps this process's index of held lists ([`keys::held_index`]) true enough for recovery, at each
    /// of its own recovery passes: it adds its landing lists to the index (again: a recovery that took
    /// the process for dead removed it; [`super::mark_alive`] adds it to [`keys::HOLDERS`] at each beat),
    /// and drops the entries of batch lists
    /// it no longer holds whose key is gone (a push-back's `DEL` leaves its entry). An entry of a list it
    /// does not know but that still exists (a fetch whose reply was lost) stays. Costs what the index
    /// holds, whatever else Redis holds.
    async fn tidy_index(&self) -> Result<()> {
        let mut conn = self.conn.clone();
        let mut pipe = redis::pipe();
        let landing: Vec<String> = self
            .names
            .iter()
            .map(|q| format!("{}{q}", self.landing_prefix))
            .collect();
        pipe.sadd(&self.index, &landing).ignore();
        pipe.smembers(&self.index);
        let (members,): (Vec<String>,) = pipe.query_async(&mut conn).await?;
        let unknown: Vec<String> = {
            let h = self.held.lock().map_err(|_| poisoned())?;
            members
                .into_iter()
                .filter(|key| {
                    let Some(rest) = key.strip_prefix(&self.batch_prefix) else {
                        return false;
                    };
                    let n = rest
                        .rsplit_once(":@")
                        .and_then(|(_, n)| n.parse::<u64>().ok());
                    n.is_none_or(|n| !h.knows(n) && !h.lost.iter().any(|l| l.0 == *key))
                })
                .collect()
        };
        if unknown.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for key in &unknown {
            pipe.exists(key);
        }
        let exist: Vec<bool> = pipe.query_async(&mut conn).await?;
        let gone: Vec<&String> = unknown
            .iter()
            .zip(exist)
            .filter(|(_, e)| !e)
            .map(|(k, _)| k)
            .collect();
        if !gone.is_empty() {
            let _: () = redis::AsyncCommands::srem(&mut conn, &self.index, gone).await?;
        }
        Ok(())
    }

    async fn leftovers(&self, everything: bool) -> Result<u64> {
        let landing: Vec<_> = self
            .names
            .iter()
            .map(|q| {
                let key = format!("{}{q}", self.landing_prefix);
                (key.clone(), key, q.clone())
            })
            .collect();
        let (mut moved, _, mut errors) = self.move_back(landing).await;
        match self.reconcile_now().await {
            Ok(n) => moved += n,
            Err(e) => errors.push(e),
        }
        if everything {
            let mut open: Vec<_> = match self.held.lock() {
                Ok(mut h) => h
                    .open
                    .drain()
                    .map(|(_, b)| (b.key, b.acks, b.queue))
                    .collect(),
                Err(_) => return Err(poisoned()),
            };
            newest_first(&mut open);
            let (m, kept, errs) = self.move_back(open).await;
            moved += m;
            errors.extend(errs);
            // What could not move stays a known list: a later sweep tries again.
            if let Ok(mut h) = self.held.lock() {
                h.lost.extend(kept);
            }
        }
        sweep_result(moved, errors)
    }
}

/// Orders batch lists the newest batch first: pushed back in this order, each to the served end of its
/// queue, the oldest batch's jobs are served first again.
fn newest_first(lists: &mut [(String, String, Arc<str>)]) {
    let batch = |key: &str| {
        key.rsplit_once(":@")
            .and_then(|(_, n)| n.parse::<u64>().ok())
            .unwrap_or(0)
    };
    lists.sort_by_key(|l| std::cmp::Reverse(batch(&l.0)));
}

/// A sweep's outcome: `moved` when nothing failed; else the first outage among `errors` (so the sweep
/// is retried), or all of them as one error.
fn sweep_result(moved: u64, errors: Vec<crate::Error>) -> Result<u64> {
    if errors.is_empty() {
        return Ok(moved);
    }
    let joined = errors
        .iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("; ");
    match errors.into_iter().find(|e| e.is_outage()) {
        Some(outage) => Err(outage),
        None => Err(script_error(joined)),
    }
}

/// A lock poisoned by a panic elsewhere: an error, never a panic here.
fn poisoned() -> crate::Error {
    script_error("the reliable fetcher's table of batch lists is poisoned".into())
}

impl Fetch for Reliable {
    /// Cancelling it leaves what it moved in a batch list of this process, recorded as lost, where
    /// [`Fetch::requeue_leftovers`] and [`Fetch::reconcile`] find it.
    fn retrieve_work(&self, max: usize) -> BoxFuture<'_, Result<Vec<UnitOfWork>>> {
        Box::pin(self.fetch(max))
    }

    fn acknowledge<'a>(&'a self, done: &'a [UnitOfWork]) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.ack(done))
    }

    fn bulk_requeue<'a>(&'a self, units: &'a [UnitOfWork]) -> BoxFuture<'a, Result<u64>> {
        Box::pin(self.requeue(units))
    }

    /// Each loop holds the slots it fetches for, so together they never hold more fetched jobs than
    /// there are free slots, while their round trips overlap. A loop per 200 slots (at most 4): a
    /// fetch's fixed cost (a round trip, a transaction or a script) is most of Redis's cost per job at
    /// small payloads, so one batch of 200 at -c 200 costs Redis less per job than two of 100, and the
    /// processors' throughput does not depend on the overlap at that size (bench/results/fetch-loops.md).
    fn fetch_loops(&self, concurrency: usize) -> usize {
        (concurrency / 200).clamp(1, 4)
    }

    fn cancel_safe(&self) -> bool {
        true
    }

    fn holds_in_redis(&self) -> bool {
        true
    }

    fn working_prefix(&self) -> Option<String> {
        Some(self.batch_prefix.clone())
    }

    fn take_dead(&self) -> u64 {
        self.dead.swap(0, Ordering::Relaxed)
    }

    fn outstanding(&self) -> usize {
        self.held
            .lock()
            .map(|h| h.open.values().map(|b| b.left).sum())
            .unwrap_or(0)
    }

    /// After a failed fetch the batch script may have run without its reply reaching us: those jobs sit
    /// in our batch lists while nobody runs them.
    fn reconcile(&self) -> BoxFuture<'_, Result<u64>> {
        Box::pin(self.reconcile_now())
    }

    /// Run when the process goes quiet (a fetch cut short there leaves its jobs in these keys) and at
    /// shutdown, before and after the running jobs are pushed back.
    fn requeue_leftovers(&self, everything: bool) -> BoxFuture<'_, Result<u64>> {
        Box::pin(self.leftovers(everything))
    }

    fn tidy_index(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(Reliable::tidy_index(self))
    }
}

/// Runs [`PUSH_BACK_LUA`] for `places` of batch list `key` (acks set `acks`) into `queue`: (moved, error
/// or empty).
async fn push_back(
    conn: &mut Conn,
    key: &str,
    acks: &str,
    queue: &str,
    places: &[u64],
) -> Result<(u64, String)> {
    let script = Script::new(PUSH_BACK_LUA);
    let mut moved = 0;
    // Bounded argument lists, whatever the number of jobs.
    for chunk in places.chunks(1000) {
        let mut inv = script.key(key);
        inv.key(acks).key(keys::queue(queue));
        for p in chunk {
            inv.arg(p);
        }
        let (n, err): (u64, String) = inv.invoke_async(conn).await?;
        moved += n;
        if !err.is_empty() {
            return Ok((moved, err));
        }
    }
    Ok((moved, String::new()))
}

/// One field of the batch script's records as bytes: its numbers come back as integer replies, its
/// messages and tags as bulk strings.
fn reply_bytes(v: redis::Value) -> Vec<u8> {
    match v {
        redis::Value::Int(n) => n.to_string().into_bytes(),
        redis::Value::BulkString(b) => b,
        redis::Value::SimpleString(s) => s.into_bytes(),
        _ => Vec::new(),
    }
}

/// Names the keys among `keys` that are neither lists nor absent, with their types.
pub(super) async fn describe(conn: &Conn, keys: &[String], e: &redis::RedisError) -> String {
    let mut conn = conn.clone();
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
