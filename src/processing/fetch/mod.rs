//! Taking jobs off the queues, as Sidekiq's `fetch_class`: the [`Fetch`] trait, the unit of work it hands
//! out, and what its strategies share (queue order, paused queues, the push-back Lua).
//!
//! Mirrors `fetch.rb` (PROTOCOL §3). Queue order is Sidekiq's: strict when no queue has a weight, else a
//! weighted shuffle (`shuffle.uniq` over the list with each queue repeated `weight` times) on every fetch.
//! A queue whose key has the wrong type is skipped with an error naming the key and its type, retried
//! with backoff, while the other queues are served.
//!
//! Strategies, each in its own file:
//! - [`reliable`] (the default): a fetched job is always somewhere in Redis, in a batch list of this
//!   process until its fate is written; [`recovery`] pushes back the jobs of processes that died.
//! - [`basic`]: Sidekiq's open-source `BRPOP`; a killed process loses its running jobs.
//!
//! **Adding a strategy** is one new file and one line: implement [`Fetch`] for a type in
//! `src/processing/fetch/<name>.rs` (`retrieve_work`, `acknowledge`, `bulk_requeue`, and whichever of the other
//! methods differ from their defaults), declare the file with `mod`, and add `("<name>", |s| ...)` to
//! `STRATEGIES` below; `--fetch <name>` then selects it (the flag checks names against that table). Nothing
//! outside this module branches on the mode: the launcher and the manager ask the
//! trait (how many fetch loops, whether a fetch may be cut short, whether held jobs need recovery).

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::seq::SliceRandom;
use tokio::time::Instant;

use crate::config::{FetchMode, QueueWeight};
use crate::error::Result;
use crate::redis_conn::Conn;

pub(crate) mod basic;
pub(crate) mod recovery;
pub(crate) mod reliable;

pub(crate) use basic::Basic;
pub(crate) use recovery::{RecoveryPolicy, mark_alive, recover_orphans, recovery_loop};
pub(crate) use reliable::Reliable;

/// A boxed future, for the trait's async methods (called once per batch, never per job).
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// Most jobs one fetch takes, whatever `-c` is: one script's work stays bounded.
pub(crate) const MAX_BATCH: usize = 1000;

// A batch's places fit the place bits of a unit id.
const _: () = assert!(MAX_BATCH <= 1 << crate::keys::PLACE_BITS);

/// One fetch stops adding jobs once it holds this many payload bytes (it always takes at least one).
pub(crate) const BATCH_BYTES: usize = 32 * 1024 * 1024;

/// Longest pause of a queue whose key has the wrong type.
const MAX_STALL: Duration = Duration::from_secs(30);

/// One fetched job, from its fetch to its acknowledgement or push-back (Ruby's `UnitOfWork`): the queue
/// it came from, its id in this process's batch lists (0 with basic fetch), and its exact bytes. The
/// bytes arrive owned (the reply's buffer) and are shared once decoded ([`UnitOfWork::share_raw`]), so
/// the same value goes to the job, the work table and the acker without a copy.
#[derive(Debug, Clone)]
pub(crate) struct UnitOfWork {
    /// Queue name, without `queue:`.
    pub queue: Arc<str>,
    /// The job's batch number and place in its batch list (`keys::PLACE_BITS`; 0 with basic fetch).
    pub id: u64,
    /// The payload exactly as stored.
    raw: Raw,
}

/// A payload as fetched, or shared once decoded.
#[derive(Debug, Clone)]
enum Raw {
    /// The reply's own buffer, before decoding.
    Owned(Vec<u8>),
    /// Shared with the decoded job.
    Shared(Arc<[u8]>),
}

impl UnitOfWork {
    /// A unit of `raw` fetched from `queue`, held under `id`.
    pub(crate) fn new(queue: Arc<str>, id: u64, raw: Vec<u8>) -> Self {
        UnitOfWork {
            queue,
            id,
            raw: Raw::Owned(raw),
        }
    }

    /// The payload, byte for byte.
    pub(crate) fn raw(&self) -> &[u8] {
        match &self.raw {
            Raw::Owned(v) => v,
            Raw::Shared(a) => a,
        }
    }

    /// Takes the fetched bytes to decode them (no copy before [`UnitOfWork::share_raw`]); give them back
    /// with `share_raw` before the unit goes anywhere else.
    pub(crate) fn take_raw(&mut self) -> Vec<u8> {
        match &mut self.raw {
            Raw::Owned(v) => std::mem::take(v),
            Raw::Shared(a) => a.to_vec(),
        }
    }

    /// The bytes, now shared with the decoded job.
    pub(crate) fn share_raw(&mut self, raw: Arc<[u8]>) {
        self.raw = Raw::Shared(raw);
    }

    /// Ruby's `UnitOfWork#acknowledge`: the job's fate is in Redis. The manager batches these through
    /// [`Fetch::acknowledge`]; this is the single-job form.
    #[allow(
        dead_code,
        reason = "Ruby's UnitOfWork interface; the manager batches through Fetch"
    )]
    pub(crate) async fn acknowledge(self, fetch: &dyn Fetch) -> Result<()> {
        fetch.acknowledge(std::slice::from_ref(&self)).await
    }

    /// Ruby's `UnitOfWork#requeue`: back to the end of its queue served next.
    #[allow(
        dead_code,
        reason = "Ruby's UnitOfWork interface; the manager batches through Fetch"
    )]
    pub(crate) async fn requeue(self, fetch: &dyn Fetch) -> Result<u64> {
        fetch.bulk_requeue(std::slice::from_ref(&self)).await
    }
}

/// A fetch strategy (`Sidekiq::BasicFetch`'s interface, plus what the manager must know about it).
pub(crate) trait Fetch: Send + Sync + std::fmt::Debug {
    /// Fetches up to `max` jobs (at most [`MAX_BATCH`]); waits up to the block time when every queue is
    /// empty and then returns what it has (possibly nothing).
    fn retrieve_work(&self, max: usize) -> BoxFuture<'_, Result<Vec<UnitOfWork>>>;

    /// Acknowledges jobs whose fate is in Redis (batched by the manager's acker).
    fn acknowledge<'a>(&'a self, done: &'a [UnitOfWork]) -> BoxFuture<'a, Result<()>>;

    /// Pushes unfinished jobs back to the end of their queue that is served next (`RPUSH`, as Sidekiq's
    /// `bulk_requeue`). Returns how many moved.
    fn bulk_requeue<'a>(&'a self, units: &'a [UnitOfWork]) -> BoxFuture<'a, Result<u64>>;

    /// How many fetch loops run side by side for `concurrency` slots.
    fn fetch_loops(&self, concurrency: usize) -> usize {
        let _ = concurrency;
        1
    }

    /// Whether a fetch under way may be dropped at the shutdown deadline without losing what it took.
    fn cancel_safe(&self) -> bool {
        false
    }

    /// Whether held jobs stay in Redis (so a process of this kind takes part in orphan recovery, keeps
    /// a liveness key, and a failed push-back is not a loss).
    fn holds_in_redis(&self) -> bool {
        false
    }

    /// The prefix of this process's batch lists (`oxidekiq:batch:<identity>:`), whose entries are the
    /// jobs' fate tokens ([`crate::retry::Token`]); `None` when jobs are not held in Redis.
    fn working_prefix(&self) -> Option<String> {
        None
    }

    /// Jobs the fetch itself sent to the dead set since the last call (for the processed/failed stats).
    fn take_dead(&self) -> u64 {
        0
    }

    /// How many jobs are handed out and not yet acknowledged or pushed back.
    fn outstanding(&self) -> usize {
        0
    }

    /// After a failed fetch, pushes back what a fetch whose reply was lost left held. Returns how many.
    fn reconcile(&self) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async { Ok(0) })
    }

    /// Keeps the index of held lists that orphan recovery reads true (`keys::held_index`), at each of
    /// this process's recovery passes; nothing to do when jobs are not held in Redis.
    fn tidy_index(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async { Ok(()) })
    }

    /// Pushes back whatever this process holds but never handed out; with `everything`, every held job
    /// (the shutdown's last sweep, once no job runs and every ack is flushed). Returns how many.
    fn requeue_leftovers(&self, everything: bool) -> BoxFuture<'_, Result<u64>> {
        let _ = everything;
        Box::pin(async { Ok(0) })
    }
}

/// What every strategy is built from.
#[derive(Debug)]
pub(crate) struct Setup<'a> {
    /// The queues and their weights.
    pub queues: &'a [QueueWeight],
    /// This process's identity (`host:pid:hex`), which names its working keys.
    pub identity: &'a str,
    /// Connection for scripts, acks and requeues.
    pub conn: Conn,
    /// Dedicated connection for blocking waits (`BRPOP`/`BLMOVE`).
    pub blocking: Conn,
    /// How long one blocking wait may last.
    pub block: Duration,
    /// Payloads longer than this are not handed out (0: no limit).
    pub max_payload_bytes: usize,
    /// The live fleet, which decides how `failed_at` is written on a job the fetch sends to the dead set.
    pub fleet: Arc<crate::fleet::Fleet>,
    /// The capsule served (0 the default one, then the named ones in order, below [`MAX_CAPSULES`]).
    pub capsule: u64,
    /// How the reliable fetch makes connections of its own for its fetch pipelines (a plain-text
    /// server; `None` for TLS and Sentinel, whose fetches go over `conn`).
    pub dialer: Option<crate::redis_conn::resp::Dialer>,
}

/// Where a batch number's capsule starts: every capsule of a process shares its batch-list prefix
/// (`oxidekiq:batch:<identity>:`, which recovery reads as the process's), and numbers its batches
/// from `capsule << CAPSULE_SHIFT`, so two capsules fetching the same queue never name the same list,
/// and each one's sweep for lists it does not know ([`Fetch::reconcile`], the quiet and stop sweeps)
/// leaves the others' alone: pushed back while another capsule runs them, their jobs would run twice
/// (Sidekiq's sidekiq#6379, fixed in 8.1.3). The default capsule is 0: its numbers are what a process
/// without capsules writes. 2^46 batch numbers per capsule (a script fetch uses two per queue of
/// its round: decades of fetches at any rate, and a capsule that reaches its range's end starts it
/// again rather than run into the next one's), and a unit id (`batch << keys::PLACE_BITS`) still fits
/// in 64 bits below [`MAX_CAPSULES`].
pub(crate) const CAPSULE_SHIFT: u32 = 46;

/// The most capsules one process runs (the default one included).
pub(crate) const MAX_CAPSULES: usize = 1 << (64 - CAPSULE_SHIFT - crate::keys::PLACE_BITS);

/// The capsule whose fetcher numbered batch `n`.
pub(crate) fn capsule_of(n: u64) -> u64 {
    n >> CAPSULE_SHIFT
}

/// How a strategy is built from what the launcher gives it.
type Build = fn(Setup<'_>) -> Arc<dyn Fetch>;

/// Every fetch strategy, by the name `--fetch` takes: the one place that maps a mode to its
/// implementation. A new strategy is a file in `src/processing/fetch/` implementing [`Fetch`], one line here, and
/// its name in [`FetchMode::NAMES`] (the config, below, checks `--fetch` against it).
const STRATEGIES: &[(&str, Build)] = &[
    ("reliable", |s| Arc::new(Reliable::from_setup(s))),
    ("basic", |s| Arc::new(Basic::from_setup(s))),
];

/// The names of the registered strategies, in the table's order.
pub(crate) fn strategy_names() -> impl Iterator<Item = &'static str> {
    STRATEGIES.iter().map(|(name, _)| *name)
}

/// The strategy `mode` names. Every [`FetchMode`] names a registered strategy ([`FetchMode::named`]
/// checks); should one not, reliable fetch is used, the safe one.
pub(crate) fn new(mode: FetchMode, setup: Setup<'_>) -> Arc<dyn Fetch> {
    let build = STRATEGIES
        .iter()
        .find(|(name, _)| *name == mode.name())
        .map_or(STRATEGIES[0].1, |(_, build)| *build);
    build(setup)
}

/// The queue order of one fetch, Sidekiq's way.
#[derive(Debug, Clone)]
pub(crate) struct QueueOrder {
    /// Distinct queue names, in configured order.
    names: Vec<Arc<str>>,
    /// Each queue repeated `max(weight, 1)` times, for the weighted shuffle; empty when strict.
    weighted: Vec<Arc<str>>,
}

impl QueueOrder {
    /// Builds the order from the configured queues.
    pub(crate) fn new(queues: &[QueueWeight]) -> Self {
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
    pub(crate) fn next(&self) -> Vec<Arc<str>> {
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
    pub(crate) fn names(&self) -> &[Arc<str>] {
        &self.names
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

/// The queues paused after an error of their own, shared by every strategy.
#[derive(Debug, Default)]
struct Stalls(Mutex<foldhash::HashMap<Arc<str>, Stall>>);

impl Stalls {
    /// The round's order without the queues that are paused.
    fn usable(&self, order: Vec<Arc<str>>) -> Vec<Arc<str>> {
        let Ok(stalls) = self.0.lock() else {
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
        let Ok(mut stalls) = self.0.lock() else {
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
        let Ok(mut stalls) = self.0.lock() else {
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
}

/// Pushes every job of a working hash (newest id first, so the oldest is served first), landing list or
/// batch list `src` to the served end of queue `qkey` (`RPUSH`, as Sidekiq's `bulk_requeue`), so that the
/// job its queue served first is served first again: a landing list and a batch list of the last release
/// (`oxidekiq:working:`) keep their queue's order (their tail was served first) and go from head to tail;
/// a batch list of this release (`oxidekiq:batch:`, `desc` true) holds its jobs in serve order (its head
/// was served first) and goes from tail to head. Counts recoveries in hash `counts` when `limit` >= 0: a
/// job recovered more than `limit` times goes to dead set `dead` instead, annotated. A batch list comes
/// with its acks set `acks` (for the other keys `acks` is `src` itself): the places in it (list
/// indexes, whatever the order) are done and skipped, and each job moved is added to it before the
/// next, so a move cut short never moves a job twice. A hash goes to `qhash` (the whole rest of its key
/// names its queue; `qkey` is the queue a batch list's name gives, which differs only for a queue named
/// like `<q>:@<digits>`). Every write comes before the matching removal and goes through `pcall`: a write
/// that fails stops the move and removes only what was already written elsewhere. Used by the shutdown
/// sweep ([`reliable`]) and orphan recovery ([`recovery`]); needs `lua_common`.
macro_rules! lua_move_back {
    () => {
        r#"
local function move_back(src, acks, qkey, qhash, desc, limit, counts, dead, score, trim_before, dead_max, failed_at, why)
  local t = kind(src)
  local fields, jobs = nil, {}
  local batch = acks ~= src
  if t == 'hash' then
    qkey = qhash
    batch = false
    local all = redis.call('HGETALL', src)
    local pairs_ = {}
    for i = 1, #all, 2 do pairs_[#pairs_ + 1] = {tonumber(all[i]) or 0, all[i], all[i + 1]} end
    table.sort(pairs_, function(a, b) return a[1] > b[1] end)
    fields = {}
    for i, p in ipairs(pairs_) do fields[i] = p[2]; jobs[i] = p[3] end
  elseif t == 'list' then
    if batch then
      -- Its places are read and marked there: any other type would raise at the first job and end the
      -- whole script (every other list and process of a recovery pass with it). This list alone waits.
      local at = kind(acks)
      if at ~= 'set' and at ~= 'none' then
        return 0, 0, acks .. ' is a ' .. at .. ', not a set (the acks set of ' .. src .. '; its jobs stay there until it is repaired)'
      end
    end
    jobs = redis.call('LRANGE', src, 0, -1)
  elseif t == 'none' then
    if batch then redis.call('DEL', acks) end
    return 0, 0, nil
  else
    return 0, 0, src .. ' is a ' .. t .. ', not a hash or a list'
  end
  local moved, killed, done, err = 0, 0, 0, nil
  local from, to, step = 1, #jobs, 1
  if batch and desc then from, to, step = #jobs, 1, -1 end
  for i = from, to, step do
    local j = jobs[i]
    local place = tostring(i - 1)
    if not (batch and redis.call('SISMEMBER', acks, place) == 1) then
      local c, h = 1, nil
      if limit >= 0 then
        h = redis.sha1hex(j)
        c = (tonumber(redis.call('HGET', counts, h)) or 0) + 1
      end
      if limit >= 0 and c > limit then
        local msg = 'recovered ' .. (c - 1) .. ' times from processes that died while running it; ' .. why
        err = to_dead(dead, annotate(j, 'Oxidekiq::TooManyRecoveries', msg, failed_at), score, trim_before, dead_max)
        if err then break end
        redis.pcall('HDEL', counts, h)
        killed = killed + 1
      else
        local r = redis.pcall('RPUSH', qkey, j)
        if failed(r) then err = qkey .. ' is a ' .. kind(qkey) .. ', not a list: ' .. r.err; break end
        if h then redis.pcall('HINCRBY', counts, h, 1) end
        moved = moved + 1
      end
      if batch and done + 1 < #jobs then redis.call('SADD', acks, place) end
    end
    done = done + 1
  end
  if done == #jobs then
    redis.call('DEL', src)
    if batch then redis.call('DEL', acks) end
  elseif done > 0 then
    if fields then
      for s = 1, done, 1000 do redis.call('HDEL', src, unpack(fields, s, math.min(s + 999, done))) end
    elseif not batch then
      redis.call('LTRIM', src, done, -1)
    end
  end
  if limit >= 0 and done > 0 then redis.pcall('EXPIRE', counts, 604800) end
  return moved, killed, err
end
"#
    };
}
use lua_move_back;

// Moved from tests/fetch_scripts.rs: the fetch, acknowledge, requeue and recovery scripts on a real Redis (needs crate-internal items).
#[cfg(test)]
mod tests_contract;
#[cfg(test)]
mod tests_scripts; // The contract every strategy of STRATEGIES keeps.

// The fast path of reliable fetch on a real Redis.
#[cfg(test)]
mod tests_fast;

// The reliable fetcher's own connections on a real Redis: replies read as redis-rs reads them, a
// connection killed between and in the middle of fetches.
#[cfg(test)]
mod tests_own_conn;

// Moved from tests/recovery.rs: recovering a dead process's jobs on a real Redis (needs crate-internal items).
#[cfg(test)]
mod tests_recovery;

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

    /// The config keeps a queue's weight as given (0 for none, as Sidekiq 7+ shows it); beside a
    /// weighted queue it counts as 1 (`cli.rb@v6.4.1 parse_queue`): `[critical, 2], default` tries
    /// critical first two times in three, not always.
    #[test]
    fn a_queue_given_no_weight_beside_a_weighted_one_counts_as_weight_1() {
        let o = QueueOrder::new(&[qw("critical", 2), qw("default", 0)]);
        let n = 3000;
        let firsts = (0..n).filter(|_| &*o.next()[0] == "default").count();
        let share = firsts as f64 / n as f64;
        assert!((0.28..0.39).contains(&share), "default first {share}");
    }

    #[test]
    fn every_strategy_is_selectable_by_its_name_and_the_named_modes_are_registered() {
        let names: Vec<&str> = strategy_names().collect();
        assert_eq!(names, ["reliable", "basic"]);
        assert_eq!(names, FetchMode::NAMES, "the config's list of names");
        for name in names {
            assert_eq!(FetchMode::named(name).map(FetchMode::name), Some(name));
        }
        assert_eq!(FetchMode::named("reliable"), Some(FetchMode::RELIABLE));
        assert_eq!(FetchMode::named("basic"), Some(FetchMode::BASIC));
        assert_eq!(FetchMode::named("super"), None);
        assert_eq!(FetchMode::default(), FetchMode::RELIABLE);
    }
}
