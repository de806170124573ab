//! Taking jobs off the queues: reliable fetch (the default) and Sidekiq's basic `BRPOP` fetch.
//!
//! Mirrors `fetch.rb` (PROTOCOL §3). Queue order is Sidekiq's: strict when no queue has a weight, else a
//! weighted shuffle (`shuffle.uniq` over the list with each queue repeated `weight` times) on every fetch.
//!
//! **Reliable fetch** keeps the invariant "a fetched job is always somewhere in Redis": one Lua script moves
//! up to the number of free slots from the queues into working lists owned by this process
//! (`oxidekiq:working:<identity>:<queue>`), and a job leaves its working list only once its fate is in
//! Redis (acks are batched `LREM`s of the exact bytes). When every queue is empty the fetcher blocks on
//! `BLMOVE` (atomic too) on the first queue of the round, so an idle process costs Redis almost nothing and
//! a new job starts at once. Working lists of processes whose liveness key expired are pushed back by
//! [`recover_orphans`], with a count per payload so a job that kills every process it touches ends in the
//! dead set instead of looping.
//!
//! **Basic fetch** is `BRPOP queue:a queue:b 2`: a killed process loses its in-flight jobs, as Sidekiq's
//! open-source fetch does; acks are no-ops.

use std::sync::Arc;
use std::time::Duration;

use rand::seq::SliceRandom;
use redis::{AsyncCommands, Script};

use crate::config::{FetchMode, QueueWeight};
use crate::error::Result;
use crate::keys;
use crate::redis_conn::Conn;
use crate::time::score;

/// One fetched job: the queue it came from and its exact bytes.
#[derive(Debug, Clone)]
pub struct UnitOfWork {
    /// Queue name, without `queue:`.
    pub queue: Arc<str>,
    /// The payload exactly as stored.
    pub raw: Vec<u8>,
}

/// Moves up to ARGV[1] jobs from the queues ARGV[3..] into working lists named ARGV[2]..queue.
/// Returns a flat array: queue, job, queue, job, ...
const FETCH_LUA: &str = r#"
local max = tonumber(ARGV[1])
local out = {}
local n = 0
for i = 3, #ARGV do
  local q = ARGV[i]
  -- ARGV[1] as given while nothing was taken (a Lua number would be printed with printf).
  local count = ARGV[1]
  if n > 0 then count = tostring(max - n) end
  local jobs = redis.call('RPOP', 'queue:' .. q, count)
  if jobs then
    local wk = ARGV[2] .. q
    for s = 1, #jobs, 500 do
      redis.call('LPUSH', wk, unpack(jobs, s, math.min(s + 499, #jobs)))
    end
    for _, j in ipairs(jobs) do
      out[#out + 1] = q
      out[#out + 1] = j
    end
    n = n + #jobs
    if n >= max then break end
  end
end
return out
"#;

/// Pushes every job of working list KEYS[1] back to the tail of queue KEYS[2] (the end served next),
/// counting recoveries per payload in hash KEYS[3]; a payload recovered more than ARGV[1] times goes to
/// the dead set KEYS[4] (score ARGV[2], trimmed by ARGV[3] and ARGV[4]) instead. Returns {moved, killed}.
const RECOVER_LUA: &str = r#"
local moved, killed = 0, 0
local limit = tonumber(ARGV[1])
while true do
  local j = redis.call('RPOP', KEYS[1])
  if not j then break end
  local h = redis.sha1hex(j)
  local c = 1
  if limit >= 0 then c = redis.call('HINCRBY', KEYS[3], h, 1) end
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
if limit >= 0 and (moved + killed) > 0 then redis.call('EXPIRE', KEYS[3], 604800) end
return {moved, killed}
"#;

/// Pushes back the members ARGV of working list KEYS[1] to the served end of queue KEYS[2], each only if
/// this call removed it from the working list. Returns how many moved.
const RECONCILE_LUA: &str = r#"
local n = 0
for i = 1, #ARGV do
  if redis.call('LREM', KEYS[1], 1, ARGV[i]) == 1 then
    redis.call('RPUSH', KEYS[2], ARGV[i])
    n = n + 1
  end
end
return n
"#;

/// Removes each (queue, job) pair of ARGV[2..] from working list ARGV[1]..queue, scanning from the tail,
/// where the oldest fetched jobs (the ones that finish first) are.
const ACK_LUA: &str = r#"
local prefix = ARGV[1]
for i = 2, #ARGV, 2 do
  redis.call('LREM', prefix .. ARGV[i], -1, ARGV[i + 1])
end
return 0
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
    /// Connection for the batch script, acks and requeues.
    conn: Conn,
    /// Dedicated connection for `BRPOP`/`BLMOVE`.
    blocking: Conn,
    /// The batch script (EVALSHA, loaded again on NOSCRIPT).
    script: Script,
    /// The ack script.
    ack_script: Script,
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
        Fetcher {
            mode,
            order: QueueOrder::new(queues),
            working_prefix: keys::working_prefix(identity),
            conn,
            blocking,
            script: Script::new(FETCH_LUA),
            ack_script: Script::new(ACK_LUA),
            block,
        }
    }

    /// The fetch mode.
    pub fn mode(&self) -> FetchMode {
        self.mode
    }

    /// Fetches up to `max` jobs; waits up to the block time when every queue is empty and then returns
    /// what it has (possibly nothing). Never cancel this future: a fetched job would be stranded (in a
    /// working list, recovered later; with basic fetch, lost).
    pub async fn fetch(&self, max: usize) -> Result<Vec<UnitOfWork>> {
        let order = self.order.next();
        match self.mode {
            FetchMode::Basic => self.fetch_basic(&order).await,
            FetchMode::Reliable => {
                let got = self.fetch_batch(&order, max).await?;
                if !got.is_empty() {
                    return Ok(got);
                }
                self.fetch_blocking(&order).await
            }
        }
    }

    async fn fetch_batch(&self, order: &[Arc<str>], max: usize) -> Result<Vec<UnitOfWork>> {
        let mut inv = self.script.prepare_invoke();
        inv.arg(max.max(1)).arg(&self.working_prefix);
        for q in order {
            inv.arg(&**q);
        }
        let flat: Vec<Vec<u8>> = inv.invoke_async(&mut self.conn.clone()).await?;
        let mut out = Vec::with_capacity(flat.len() / 2);
        let mut it = flat.into_iter();
        while let (Some(q), Some(raw)) = (it.next(), it.next()) {
            let name = order
                .iter()
                .find(|n| n.as_bytes() == q.as_slice())
                .cloned()
                .unwrap_or_else(|| Arc::from(String::from_utf8_lossy(&q).as_ref()));
            out.push(UnitOfWork { queue: name, raw });
        }
        Ok(out)
    }

    async fn fetch_blocking(&self, order: &[Arc<str>]) -> Result<Vec<UnitOfWork>> {
        let Some(first) = order.first() else {
            tokio::time::sleep(self.block).await;
            return Ok(Vec::new());
        };
        // With several queues, block briefly on the first so the others are looked at again soon.
        let block = if order.len() == 1 {
            self.block
        } else {
            self.block.min(Duration::from_millis(50))
        };
        let raw: Option<Vec<u8>> = redis::cmd("BLMOVE")
            .arg(keys::queue(first))
            .arg(format!("{}{}", self.working_prefix, first))
            .arg("RIGHT")
            .arg("LEFT")
            .arg(block.as_secs_f64())
            .query_async(&mut self.blocking.clone())
            .await?;
        Ok(raw
            .map(|raw| UnitOfWork {
                queue: first.clone(),
                raw,
            })
            .into_iter()
            .collect())
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
                UnitOfWork { queue, raw }
            })
            .into_iter()
            .collect())
    }

    /// Acknowledges jobs whose fate is in Redis: one script call removes each from its working list
    /// (reliable fetch only; basic fetch has nothing to acknowledge).
    pub async fn ack(&self, done: &[(Arc<str>, Arc<[u8]>)]) -> Result<()> {
        if self.mode == FetchMode::Basic || done.is_empty() {
            return Ok(());
        }
        let mut inv = self.ack_script.prepare_invoke();
        inv.arg(&self.working_prefix);
        for (queue, raw) in done {
            inv.arg(&**queue).arg(&raw[..]);
        }
        inv.invoke_async::<()>(&mut self.conn.clone()).await?;
        Ok(())
    }

    /// Pushes unfinished jobs back to the end of their queue that is served next (`RPUSH`, as Sidekiq's
    /// `bulk_requeue`), removing them from the working list in the same `MULTI`.
    pub async fn requeue(&self, units: &[(Arc<str>, Arc<[u8]>)]) -> Result<()> {
        if units.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        pipe.atomic();
        for (queue, raw) in units {
            pipe.rpush(keys::queue(queue), &raw[..]).ignore();
            if self.mode == FetchMode::Reliable {
                pipe.lrem(format!("{}{}", self.working_prefix, queue), 1, &raw[..])
                    .ignore();
            }
        }
        pipe.query_async::<()>(&mut self.conn.clone()).await?;
        Ok(())
    }

    /// After a failed fetch the batch script may have run without its reply reaching us: those jobs sit
    /// in our working lists while nobody runs them. This pushes back every working-list entry that is not
    /// in `running` (a job whose ack is still on its way may be pushed back too and run twice: at least
    /// once). Returns how many moved.
    pub async fn reconcile(&self, running: &[(Arc<str>, Arc<[u8]>)]) -> Result<u64> {
        if self.mode == FetchMode::Basic {
            return Ok(0);
        }
        let mut conn = self.conn.clone();
        let script = Script::new(RECONCILE_LUA);
        let mut moved = 0;
        for q in self.order.names() {
            let key = format!("{}{}", self.working_prefix, q);
            let members: Vec<Vec<u8>> = conn.lrange(&key, 0, -1).await?;
            let mut mine: Vec<&[u8]> = running
                .iter()
                .filter(|(rq, _)| rq == q)
                .map(|(_, raw)| &raw[..])
                .collect();
            let mut stranded = Vec::new();
            for m in members {
                match mine.iter().position(|r| *r == m.as_slice()) {
                    Some(i) => {
                        mine.swap_remove(i);
                    }
                    None => stranded.push(m),
                }
            }
            if stranded.is_empty() {
                continue;
            }
            let mut inv = script.key(&key);
            inv.key(keys::queue(q));
            for m in &stranded {
                inv.arg(&m[..]);
            }
            let n: u64 = inv.invoke_async(&mut conn).await?;
            moved += n;
        }
        Ok(moved)
    }

    /// Pushes back whatever is left in this process's working lists (jobs fetched but never started).
    /// Called last at shutdown; these are not counted as recoveries.
    pub async fn requeue_leftovers(&self) -> Result<u64> {
        if self.mode == FetchMode::Basic {
            return Ok(0);
        }
        let mut moved = 0;
        for q in self.order.names().to_vec() {
            let (m, _): (u64, u64) = Script::new(RECOVER_LUA)
                .key(format!("{}{}", self.working_prefix, q))
                .key(keys::queue(&q))
                .key(RECOVERED)
                .key(keys::DEAD)
                .arg(-1)
                .arg("0")
                .arg("0")
                .arg(0)
                .invoke_async(&mut self.conn.clone())
                .await?;
            moved += m;
        }
        Ok(moved)
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
    let mut working: Vec<String> = Vec::new();
    {
        let mut iter: redis::AsyncIter<'_, String> = conn.scan_match(keys::WORKING_PATTERN).await?;
        while let Some(item) = iter.next_item().await {
            working.push(item?);
        }
    }
    let prefix = "oxidekiq:working:";
    let mut total = Recovered::default();
    let script = Script::new(RECOVER_LUA);
    for key in working {
        let Some(rest) = key.strip_prefix(prefix) else {
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
