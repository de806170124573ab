//! Taking jobs off the queues: reliable fetch (the default) and Sidekiq's basic `BRPOP` fetch.
//!
//! Mirrors `fetch.rb` (PROTOCOL §3). Queue order is Sidekiq's: strict when no queue has a weight, else a
//! weighted shuffle (`shuffle.uniq` over the list with each queue repeated `weight` times) on every fetch.
//!
//! **Reliable fetch** keeps the invariant "a fetched job is always somewhere in Redis". One Lua script
//! moves up to the number of free slots from the queues into a working hash owned by this process
//! (`oxidekiq:working:<identity>:<queue>`, field = an id unique in the process, value = the exact bytes),
//! and a job leaves it only once its fate is in Redis: the ack is an `HDEL` of short ids, batched, so it
//! costs Redis the same whatever the payload or the concurrency. When every queue is empty the fetcher
//! blocks on `BLMOVE` into a landing list (`oxidekiq:landing:<identity>:<queue>`, atomic too), which the
//! next batch script empties into the working hash first; an idle process costs Redis almost nothing and
//! a new job starts at once. Working hashes and landing lists of processes whose liveness key expired are
//! pushed back by [`recover_orphans`], with a count per payload so a job that kills every process it
//! touches ends in the dead set instead of looping.
//!
//! **Basic fetch** is `BRPOP queue:a queue:b 2`: a killed process loses its in-flight jobs, as Sidekiq's
//! open-source fetch does; acks are no-ops.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rand::seq::SliceRandom;
use redis::{AsyncCommands, Script};

use crate::config::{FetchMode, QueueWeight};
use crate::error::Result;
use crate::keys;
use crate::redis_conn::Conn;
use crate::time::score;

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

/// Moves up to ARGV[1] jobs from the queues ARGV[4 .. 3+ARGV[3]] into working hashes named
/// ARGV[2]..queue, under the field ids that follow the queue names (one per job, in order); each
/// queue's landing list (ARGV[2] with `working` → `landing`, ..queue) is emptied first.
/// Returns a flat array: queue, job, queue, job, ...
const FETCH_LUA: &str = r#"
local max = tonumber(ARGV[1])
local prefix = ARGV[2]
local nq = tonumber(ARGV[3])
local landing_prefix = string.gsub(prefix, '^oxidekiq:working:', 'oxidekiq:landing:')
local out = {}
local n = 0
for i = 4, 3 + nq do
  local q = ARGV[i]
  local jobs = {}
  local landed = redis.call('RPOP', landing_prefix .. q, ARGV[1])
  if landed then for _, j in ipairs(landed) do jobs[#jobs + 1] = j end end
  if #jobs < max - n then
    local count = tostring(max - n - #jobs)
    if n == 0 and #jobs == 0 then count = ARGV[1] end
    local popped = redis.call('RPOP', 'queue:' .. q, count)
    if popped then for _, j in ipairs(popped) do jobs[#jobs + 1] = j end end
  end
  if #jobs > 0 then
    local fields = {}
    for j, job in ipairs(jobs) do
      fields[#fields + 1] = ARGV[3 + nq + n + j]
      fields[#fields + 1] = job
      out[#out + 1] = q
      out[#out + 1] = job
    end
    local wk = prefix .. q
    for s = 1, #fields, 1000 do
      redis.call('HSET', wk, unpack(fields, s, math.min(s + 999, #fields)))
    end
    n = n + #jobs
    if n >= max then break end
  end
end
return out
"#;

/// Pushes every job held in KEYS[1] (a working hash or a landing list) back to the tail of queue
/// KEYS[2] (the end served next), counting recoveries per payload in hash KEYS[3] when ARGV[1] >= 0; a
/// payload recovered more than ARGV[1] times goes to the dead set KEYS[4] (score ARGV[2], trimmed by
/// ARGV[3] and ARGV[4]) instead. Returns {moved, killed}.
const RECOVER_LUA: &str = r#"
local moved, killed = 0, 0
local limit = tonumber(ARGV[1])
local jobs
if redis.call('TYPE', KEYS[1]).ok == 'hash' then
  jobs = redis.call('HVALS', KEYS[1])
else
  jobs = redis.call('LRANGE', KEYS[1], 0, -1)
end
for i = #jobs, 1, -1 do
  local j = jobs[i]
  local c = 1
  local h
  if limit >= 0 then
    h = redis.sha1hex(j)
    c = redis.call('HINCRBY', KEYS[3], h, 1)
  end
  if limit >= 0 and c > limit then
    redis.call('HDEL', KEYS[3], h)
    redis.call('ZADD', KEYS[4], ARGV[2], j)
    redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[3])
    redis.call('ZREMRANGEBYRANK', KEYS[4], 0, -tonumber(ARGV[4]))
    killed = killed + 1
  else
    redis.call('RPUSH', KEYS[2], j)
    moved = moved + 1
  end
end
redis.call('DEL', KEYS[1])
if limit >= 0 and (moved + killed) > 0 then redis.call('EXPIRE', KEYS[3], 604800) end
return {moved, killed}
"#;

/// Pushes back the fields ARGV of working hash KEYS[1] to the served end of queue KEYS[2], each only if
/// it is still there. Returns how many moved.
const PUSH_BACK_LUA: &str = r#"
local n = 0
for i = 1, #ARGV do
  local j = redis.call('HGET', KEYS[1], ARGV[i])
  if j then
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('RPUSH', KEYS[2], j)
    n = n + 1
  end
end
return n
"#;

/// Hash of per-payload recovery counts.
const RECOVERED: &str = "oxidekiq:recovered";

/// How often one payload may be recovered from a dead process before it goes to the dead set.
pub const MAX_RECOVERIES: i64 = 3;

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

/// The fetcher of one process.
#[derive(Debug)]
pub struct Fetcher {
    /// Reliable or basic.
    mode: FetchMode,
    /// Queue order.
    order: QueueOrder,
    /// `oxidekiq:working:<identity>:`.
    working_prefix: String,
    /// Each queue's working hash and landing list.
    keys: HashMap<Arc<str>, (String, String)>,
    /// Connection for the batch script, acks and requeues.
    conn: Conn,
    /// Dedicated connection for `BRPOP`/`BLMOVE`.
    blocking: Conn,
    /// The batch script (EVALSHA, loaded again on NOSCRIPT).
    script: Script,
    /// Last working-hash id handed out.
    next_id: AtomicU64,
    /// How long one blocking wait may last.
    block: Duration,
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
        let keys = order
            .names()
            .iter()
            .map(|q| {
                (
                    q.clone(),
                    (
                        format!("{working_prefix}{q}"),
                        format!("{}{q}", keys::landing_prefix(identity)),
                    ),
                )
            })
            .collect();
        Fetcher {
            mode,
            order,
            working_prefix,
            keys,
            conn,
            blocking,
            script: Script::new(FETCH_LUA),
            next_id: AtomicU64::new(0),
            block,
        }
    }

    /// The fetch mode.
    pub fn mode(&self) -> FetchMode {
        self.mode
    }

    fn working_key(&self, queue: &str) -> String {
        match self.keys.get(queue) {
            Some((w, _)) => w.clone(),
            None => format!("{}{queue}", self.working_prefix),
        }
    }

    /// Fetches up to `max` jobs; waits up to the block time when every queue is empty and then returns
    /// what it has (possibly nothing). Never cancel this future: a fetched job would be stranded (in the
    /// working hash, recovered later; with basic fetch, lost).
    pub async fn fetch(&self, max: usize) -> Result<Vec<UnitOfWork>> {
        let order = self.order.next();
        match self.mode {
            FetchMode::Basic => self.fetch_basic(&order).await,
            FetchMode::Reliable => {
                let got = self.fetch_batch(&order, max).await?;
                if !got.is_empty() {
                    return Ok(got);
                }
                if self.wait_for_work(&order).await? {
                    // The job waits in its landing list; the batch script takes it (and any others).
                    return self.fetch_batch(&order, max).await;
                }
                Ok(Vec::new())
            }
        }
    }

    async fn fetch_batch(&self, order: &[Arc<str>], max: usize) -> Result<Vec<UnitOfWork>> {
        let max = max.max(1);
        let base = self.next_id.fetch_add(max as u64, Ordering::Relaxed) + 1;
        let mut inv = self.script.prepare_invoke();
        inv.arg(max).arg(&self.working_prefix).arg(order.len());
        for q in order {
            inv.arg(&**q);
        }
        for id in base..base + max as u64 {
            inv.arg(id);
        }
        let flat: Vec<Vec<u8>> = inv.invoke_async(&mut self.conn.clone()).await?;
        let mut out = Vec::with_capacity(flat.len() / 2);
        let mut it = flat.into_iter();
        let mut id = base;
        while let (Some(q), Some(raw)) = (it.next(), it.next()) {
            let name = order
                .iter()
                .find(|n| n.as_bytes() == q.as_slice())
                .cloned()
                .unwrap_or_else(|| Arc::from(String::from_utf8_lossy(&q).as_ref()));
            out.push(UnitOfWork {
                queue: name,
                id,
                raw,
            });
            id += 1;
        }
        Ok(out)
    }

    /// Blocks until a job arrives on the first queue of the round (moving it into its landing list) or
    /// the block time passes. True when a job landed.
    async fn wait_for_work(&self, order: &[Arc<str>]) -> Result<bool> {
        let Some(first) = order.first() else {
            tokio::time::sleep(self.block).await;
            return Ok(false);
        };
        // With several queues, block briefly on the first so the others are looked at again soon.
        let block = if order.len() == 1 {
            self.block
        } else {
            self.block.min(Duration::from_millis(50))
        };
        let landing = match self.keys.get(first) {
            Some((_, l)) => l.clone(),
            None => return Ok(false),
        };
        let raw: Option<Vec<u8>> = redis::cmd("BLMOVE")
            .arg(keys::queue(first))
            .arg(landing)
            .arg("RIGHT")
            .arg("LEFT")
            .arg(block.as_secs_f64())
            .query_async(&mut self.blocking.clone())
            .await?;
        Ok(raw.is_some())
    }

    async fn fetch_basic(&self, order: &[Arc<str>]) -> Result<Vec<UnitOfWork>> {
        if order.is_empty() {
            tokio::time::sleep(self.block).await;
            return Ok(Vec::new());
        }
        let keys: Vec<String> = order.iter().map(|q| keys::queue(q)).collect();
        let got: Option<(String, Vec<u8>)> = redis::cmd("BRPOP")
            .arg(&keys)
            .arg(self.block.as_secs_f64())
            .query_async(&mut self.blocking.clone())
            .await?;
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
        Ok(())
    }

    /// Pushes unfinished jobs back to the end of their queue that is served next (`RPUSH`, as Sidekiq's
    /// `bulk_requeue`), removing them from the working hash in the same `MULTI`.
    pub async fn requeue(&self, units: &[Held]) -> Result<()> {
        if units.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        pipe.atomic();
        for h in units {
            pipe.rpush(keys::queue(&h.queue), &h.raw[..]).ignore();
            if self.mode == FetchMode::Reliable {
                pipe.hdel(self.working_key(&h.queue), h.id).ignore();
            }
        }
        pipe.query_async::<()>(&mut self.conn.clone()).await?;
        Ok(())
    }

    /// After a failed fetch the batch script may have run without its reply reaching us: those jobs sit
    /// in our working hash while nobody runs them. This pushes back every entry whose id is not in
    /// `running` (a job whose ack is still on its way may be pushed back too and run twice: at least
    /// once). Returns how many moved.
    pub async fn reconcile(&self, running: &[Held]) -> Result<u64> {
        if self.mode == FetchMode::Basic {
            return Ok(0);
        }
        let mut conn = self.conn.clone();
        let script = Script::new(PUSH_BACK_LUA);
        let mut moved = 0;
        for (q, (working, _)) in &self.keys {
            let ids: Vec<u64> = conn.hkeys(working).await?;
            let stranded: Vec<u64> = ids
                .into_iter()
                .filter(|id| !running.iter().any(|h| h.queue == *q && h.id == *id))
                .collect();
            if stranded.is_empty() {
                continue;
            }
            let mut inv = script.key(working);
            inv.key(keys::queue(q));
            for id in &stranded {
                inv.arg(id);
            }
            let n: u64 = inv.invoke_async(&mut conn).await?;
            moved += n;
        }
        Ok(moved)
    }

    /// Pushes back whatever this process holds in Redis but is not in `running`: its landing lists and
    /// the working-hash entries of jobs fetched but never started. At shutdown this goes first, then the
    /// running jobs (their own push-back), then a last sweep with nothing running. Not counted as
    /// recoveries.
    pub async fn requeue_leftovers(&self, running: &[Held]) -> Result<u64> {
        if self.mode == FetchMode::Basic {
            return Ok(0);
        }
        let mut conn = self.conn.clone();
        let script = Script::new(RECOVER_LUA);
        let mut moved = 0;
        for (q, (_, landing)) in &self.keys {
            let (m, _): (u64, u64) = script
                .key(landing)
                .key(keys::queue(q))
                .key(RECOVERED)
                .key(keys::DEAD)
                .arg(-1)
                .arg("0")
                .arg("0")
                .arg(0)
                .invoke_async(&mut conn)
                .await?;
            moved += m;
        }
        Ok(moved + self.reconcile(running).await?)
    }
}

/// The key whose presence says a reliable-fetch process is alive; refreshed by its heartbeat.
pub fn alive_key(identity: &str) -> String {
    format!("oxidekiq:alive:{identity}")
}

/// Marks `identity` alive for `ttl`.
pub async fn mark_alive(conn: &mut Conn, identity: &str, ttl: Duration) -> Result<()> {
    let ms = ttl.as_millis().max(1000) as u64;
    let _: () = conn.pset_ex(alive_key(identity), 1, ms).await?;
    Ok(())
}

/// What [`recover_orphans`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Recovered {
    /// Jobs pushed back to their queues.
    pub requeued: u64,
    /// Jobs sent to the dead set after too many recoveries.
    pub killed: u64,
}

/// Pushes back the jobs of every process whose liveness key is gone. One process at a time does it
/// (`SET oxidekiq:recovery-lock NX EX 30`); returns `None` when another process holds that lock.
pub async fn recover_orphans(
    conn: &mut Conn,
    own_identity: &str,
    now: f64,
) -> Result<Option<Recovered>> {
    let got: Option<String> = redis::cmd("SET")
        .arg(keys::RECOVERY_LOCK)
        .arg(own_identity)
        .arg("NX")
        .arg("EX")
        .arg(30)
        .query_async(conn)
        .await?;
    if got.is_none() {
        return Ok(None);
    }
    let mut held: Vec<String> = Vec::new();
    for pattern in [keys::WORKING_PATTERN, keys::LANDING_PATTERN] {
        let mut iter: redis::AsyncIter<'_, String> = conn.scan_match(pattern).await?;
        while let Some(item) = iter.next_item().await {
            held.push(item?);
        }
    }
    let mut total = Recovered::default();
    let script = Script::new(RECOVER_LUA);
    for key in held {
        let Some(rest) = key
            .strip_prefix("oxidekiq:working:")
            .or_else(|| key.strip_prefix("oxidekiq:landing:"))
        else {
            continue;
        };
        // identity = host:pid:hex (three colon-separated parts); the queue name is the rest.
        let mut parts = rest.splitn(4, ':');
        let (Some(h), Some(p), Some(x), Some(queue)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let identity = format!("{h}:{p}:{x}");
        if identity == own_identity {
            continue;
        }
        let alive: bool = conn.exists(alive_key(&identity)).await?;
        if alive {
            continue;
        }
        let (moved, killed): (u64, u64) = script
            .key(&key)
            .key(keys::queue(queue))
            .key(RECOVERED)
            .key(keys::DEAD)
            .arg(MAX_RECOVERIES)
            .arg(score(now))
            .arg(score(now - crate::retry::DEAD_TIMEOUT_SECS))
            .arg(crate::retry::DEAD_MAX_JOBS)
            .invoke_async(conn)
            .await?;
        if moved + killed > 0 {
            tracing::warn!(
                process = %identity,
                queue,
                requeued = moved,
                dead = killed,
                "recovered jobs of a process that died"
            );
        }
        total.requeued += moved;
        total.killed += killed;
    }
    let _: () = conn.del(keys::RECOVERY_LOCK).await?;
    Ok(Some(total))
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
