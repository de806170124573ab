//! Reliable fetch (the default): a fetched job is always somewhere in Redis.
//!
//! One Lua script copies up to the number of free slots (at most [`MAX_BATCH`], and about
//! [`BATCH_BYTES`] of payload) from the queues into a working hash owned by this process
//! (`oxidekiq:working:<identity>:<queue>`, field = an id unique in the process, value = the exact bytes)
//! and only then trims them from their queue; a job leaves the working hash only once its fate is in
//! Redis: the ack is an `HDEL` of short ids, batched, so it costs Redis the same whatever the payload or
//! the concurrency. The ids are a base and a count, so no argument grows with `-c`. A payload over the
//! size limit never leaves Redis: the script moves it to the dead set with the error appended. When every
//! queue is empty the fetcher blocks on `BLMOVE` into a landing list (`oxidekiq:landing:<identity>:<queue>`,
//! atomic too), which the next batch script empties into the working hash first; an idle process costs
//! Redis almost nothing and a new job starts at once.
//!
//! The fetcher remembers every id it handed out and has not acknowledged or pushed back ("outstanding",
//! including the ids reserved by a fetch whose reply is on its way): [`Fetch::reconcile`] and the
//! quiet/shutdown sweeps push back only entries outside that set, which are surely stranded (a fetch
//! whose reply was lost), never a job about to run or already acknowledged.
//!
//! The working hashes and landing lists of processes that died are pushed back by
//! [`super::recovery`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::{AsyncCommands, Script};

use super::{BATCH_BYTES, BoxFuture, Fetch, MAX_BATCH, QueueOrder, Setup, Stalls, UnitOfWork};
use crate::config::QueueWeight;
use crate::error::Result;
use crate::keys;
use crate::lua::{dead_trim, lua_common, script_error};
use crate::redis_conn::Conn;
use crate::time::{self, score};

/// The batch fetch. KEYS[1] is the dead set, then three keys per queue, in the round's order: its working
/// hash, its landing list, its queue. Takes up to ARGV[1] jobs, each queue's landing list first, into
/// its working hash under the ids ARGV[2], ARGV[2]+1, ... (so the arguments do not grow with `-c`). A job
/// longer than ARGV[3] bytes (0: no limit) goes straight to the dead set, annotated with an error naming
/// this fetch (ARGV[5]/id) so identical payloads stay distinct members (score ARGV[6], `failed_at` text
/// ARGV[7], trimmed by ARGV[8] and ARGV[9]); the batch stops once it holds ARGV[4] bytes. Jobs are read
/// with `LRANGE`, written, and only then trimmed from their list. A queue whose key (or working hash) has
/// the wrong type is skipped with an error; the others are served. Returns records: queue number (1-based
/// in the round), first id, count, then that many jobs (under consecutive ids) | number, "dead", size |
/// number, "err", message.
const FETCH_LUA: &str = concat!(
    lua_common!(),
    r#"
local max = tonumber(ARGV[1])
local base = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
local budget = tonumber(ARGV[4])
local nonce = ARGV[5]
local score, failed_at, trim_before, dead_max = ARGV[6], ARGV[7], ARGV[8], tonumber(ARGV[9])
local dead = KEYS[1]
local nq = (#KEYS - 1) / 3
local out = {}
local taken, bytes = 0, 0
local full = false
for i = 1, nq do
  if full or taken >= max then break end
  local q = tostring(i)
  local wk = KEYS[3 * i - 1]
  local sources = {KEYS[3 * i], KEYS[3 * i + 1]}
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
          err = to_dead(dead, annotate(job, 'Oxidekiq::InvalidPayload', msg, failed_at), score, trim_before, dead_max)
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

/// Pushes every job of this process's own KEYS[1] (landing list or working hash) back to queue KEYS[2],
/// without counting it as a recovery (so no counts hash and no dead set: KEYS[1] stands in for both,
/// never touched with a limit of -1). Returns {moved, error}.
const MOVE_BACK_LUA: &str = concat!(
    lua_common!(),
    super::lua_move_back!(),
    r#"
local m, _, err = move_back(KEYS[1], KEYS[2], -1, KEYS[1], KEYS[1], '0', '0', 0, '', '')
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

/// Ids handed out and not yet acknowledged or pushed back, plus the id ranges reserved by fetches whose
/// reply has not arrived: what a sweep must never push back.
#[derive(Debug, Default)]
struct Outstanding {
    /// Ids of jobs handed out.
    ids: foldhash::HashSet<u64>,
    /// `[start, end)` ranges of fetches in flight.
    pending: Vec<(u64, u64)>,
}

impl Outstanding {
    fn contains(&self, id: u64) -> bool {
        self.ids.contains(&id) || self.pending.iter().any(|(a, b)| (*a..*b).contains(&id))
    }
}

/// Drops a fetch's id reservation however the fetch ends (a cancelled fetch's ids count as never
/// handed out: whatever it moved is stranded and the next sweep pushes it back).
struct Reservation<'a> {
    fetcher: &'a Reliable,
    range: (u64, u64),
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if let Ok(mut o) = self.fetcher.outstanding.lock() {
            o.pending.retain(|r| *r != self.range);
        }
    }
}

/// One queue's keys.
#[derive(Debug)]
struct QueueKeys {
    /// `oxidekiq:working:<identity>:<queue>`.
    working: String,
    /// `oxidekiq:landing:<identity>:<queue>`.
    landing: String,
    /// `queue:<queue>`.
    queue: String,
}

/// The reliable fetcher of one process.
#[derive(Debug)]
pub(crate) struct Reliable {
    /// Queue order.
    order: QueueOrder,
    /// This process's identity, part of the note on an oversized job.
    identity: String,
    /// `oxidekiq:working:<identity>:`.
    working_prefix: String,
    /// Each queue's keys.
    keys: foldhash::HashMap<Arc<str>, QueueKeys>,
    /// Connection for the batch script, acks and requeues.
    conn: Conn,
    /// Dedicated connection for `BLMOVE`.
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
    stalls: Stalls,
    /// Oversized jobs sent to the dead set since the last [`Fetch::take_dead`].
    dead: AtomicU64,
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
        let working_prefix = keys::working_prefix(identity);
        let landing_prefix = keys::landing_prefix(identity);
        let keys = order
            .names()
            .iter()
            .map(|q| {
                let k = QueueKeys {
                    working: format!("{working_prefix}{q}"),
                    landing: format!("{landing_prefix}{q}"),
                    queue: keys::queue(q),
                };
                (q.clone(), k)
            })
            .collect();
        Reliable {
            order,
            identity: identity.to_string(),
            working_prefix,
            keys,
            conn,
            blocking,
            script: Script::new(FETCH_LUA),
            next_id: AtomicU64::new(0),
            block,
            max_payload_bytes: 16 * 1024 * 1024,
            fleet: Arc::new(crate::fleet::Fleet::new(None)),
            outstanding: Mutex::new(Outstanding::default()),
            stalls: Stalls::default(),
            dead: AtomicU64::new(0),
        }
    }

    /// Built from the launcher's [`Setup`].
    pub(crate) fn from_setup(s: Setup<'_>) -> Self {
        Reliable::new(s.queues, s.identity, s.conn, s.blocking, s.block)
            .with_payload_limit(s.max_payload_bytes, s.fleet)
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

    fn working_key(&self, queue: &str) -> String {
        match self.keys.get(queue) {
            Some(k) => k.working.clone(),
            None => format!("{}{queue}", self.working_prefix),
        }
    }

    fn forget(&self, held: &[UnitOfWork]) {
        if let Ok(mut o) = self.outstanding.lock() {
            for h in held {
                o.ids.remove(&h.id);
            }
        }
    }

    async fn fetch(&self, max: usize) -> Result<Vec<UnitOfWork>> {
        let order = self.stalls.usable(self.order.next());
        let (got, busy) = self.fetch_batch(&order, max).await?;
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
        let (trim_before, dead_max) = dead_trim(now);
        let mut inv = self.script.prepare_invoke();
        inv.key(keys::DEAD);
        for q in order {
            match self.keys.get(q) {
                Some(k) => inv.key(&k.working).key(&k.landing).key(&k.queue),
                None => inv
                    .key(self.working_key(q))
                    .key(format!("{}{q}", keys::landing_prefix(&self.identity)))
                    .key(keys::queue(q)),
            };
        }
        inv.arg(max)
            .arg(base)
            .arg(self.max_payload_bytes)
            .arg(BATCH_BYTES.max(self.max_payload_bytes))
            .arg(&self.identity)
            .arg(score(now))
            .arg(self.fleet.time_format().value(now).to_string())
            .arg(trim_before)
            .arg(dead_max);
        let flat: Vec<Vec<u8>> = inv.invoke_async(&mut self.conn.clone()).await?;
        let busy = !flat.is_empty();
        let (out, failed) = self.read_reply(flat, order);
        if let Ok(mut o) = self.outstanding.lock() {
            o.ids.extend(out.iter().map(|u| u.id));
        }
        // With fewer than `max` taken, the script looked at every queue of the round.
        if out.len() < max {
            self.stalls.unstall(order, &failed);
        }
        Ok((out, busy))
    }

    /// Reads the batch script's records: the units handed out, and the queues that failed (paused here).
    fn read_reply(
        &self,
        flat: Vec<Vec<u8>>,
        order: &[Arc<str>],
    ) -> (Vec<UnitOfWork>, Vec<Arc<str>>) {
        let name_of = |q: &[u8]| {
            let i = std::str::from_utf8(q)
                .ok()
                .and_then(|s| s.parse::<usize>().ok())
                .unwrap_or(0);
            order
                .get(i.wrapping_sub(1))
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
                    self.stalls.stall(&queue, &String::from_utf8_lossy(&body));
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
                        out.push(UnitOfWork::new(queue.clone(), first + i as u64, raw));
                    }
                }
            }
        }
        (out, failed)
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
        let (queue, landing) = match self.keys.get(first) {
            Some(k) => (k.queue.clone(), k.landing.clone()),
            None => (
                keys::queue(first),
                format!("{}{first}", keys::landing_prefix(&self.identity)),
            ),
        };
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

    /// One `HDEL` of the acknowledged ids per queue, pipelined.
    async fn ack(&self, done: &[UnitOfWork]) -> Result<()> {
        if done.is_empty() {
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

    /// Each job moves from the working hash in a script, the push before the removal, and only if it is
    /// still there (a recovery may have pushed it back already); a queue key of the wrong type leaves its
    /// jobs in the working hash and is an error naming it.
    async fn requeue(&self, units: &[UnitOfWork]) -> Result<u64> {
        let mut conn = self.conn.clone();
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

    /// Pushes back every working-hash entry that was never handed out (not outstanding): a job about to
    /// run, running, or whose ack is on its way is left alone.
    async fn reconcile_now(&self) -> Result<u64> {
        let mut conn = self.conn.clone();
        let mut moved = 0;
        let mut errors = Vec::new();
        for (q, k) in &self.keys {
            let ids: Vec<u64> = match conn.hkeys(&k.working).await {
                Ok(ids) => ids,
                Err(e) if e.code() == Some("WRONGTYPE") => {
                    errors.push(format!("{}: {e}", k.working));
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
            let (n, err) = push_back(&mut conn, &k.working, q, &stranded).await?;
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

    /// The landing lists, then the working-hash entries outside the outstanding set (all of them with
    /// `everything`). Not counted as recoveries.
    async fn leftovers(&self, everything: bool) -> Result<u64> {
        let mut conn = self.conn.clone();
        let script = Script::new(MOVE_BACK_LUA);
        let mut moved = 0;
        let mut errors = Vec::new();
        for k in self.keys.values() {
            let (m, err): (u64, String) = script
                .key(&k.landing)
                .key(&k.queue)
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
        match self.reconcile_now().await {
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

impl Fetch for Reliable {
    /// Cancelling it strands what it moved in this process's working hash or landing list, where
    /// [`Fetch::requeue_leftovers`] finds it.
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
    /// there are free slots, while their round trips overlap.
    fn fetch_loops(&self, concurrency: usize) -> usize {
        (concurrency / 25).clamp(1, 4)
    }

    fn cancel_safe(&self) -> bool {
        true
    }

    fn holds_in_redis(&self) -> bool {
        true
    }

    fn working_prefix(&self) -> Option<String> {
        Some(self.working_prefix.clone())
    }

    fn take_dead(&self) -> u64 {
        self.dead.swap(0, Ordering::Relaxed)
    }

    fn outstanding(&self) -> usize {
        self.outstanding.lock().map(|o| o.ids.len()).unwrap_or(0)
    }

    /// After a failed fetch the batch script may have run without its reply reaching us: those jobs sit
    /// in our working hash while nobody runs them.
    fn reconcile(&self) -> BoxFuture<'_, Result<u64>> {
        Box::pin(self.reconcile_now())
    }

    /// Run when the process goes quiet (a fetch cut short there leaves its jobs in these keys) and at
    /// shutdown, before and after the running jobs are pushed back.
    fn requeue_leftovers(&self, everything: bool) -> BoxFuture<'_, Result<u64>> {
        Box::pin(self.leftovers(everything))
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
