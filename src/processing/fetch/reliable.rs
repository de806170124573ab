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
//! The fetch pipelines (the fast path's transaction, the batch script's call, and the acks riding on
//! them) go over connections of the fetcher's own when the server is plain TCP or a Unix socket
//! ([`RespPool`]: one per fetch loop fetching at once), their replies read by our own RESP reader
//! rather than redis-rs's parser, which cost about 1 500 instructions a job reading a batch's bulk
//! strings (bench/results/instructions.md, session 3). Redis gets the same bytes; the fetch the same
//! replies. A fetch whose connection fails (a write, a read, the response timeout, the server closing
//! it) fails as one on the shared connection does, its lists recorded as lost, and that connection is
//! never used again; a connection the server closed while idle is replaced before anything is written
//! on it. A fetch dropped midway closes its connection: Redis then runs what it had read of the
//! pipeline (a transaction whole or not at all) and the lists are recorded as lost either way. With
//! TLS or Sentinel the pipelines go over the shared connection, as everything else.
//!
//! The batch lists of processes that died (and the working keys and landing lists of older releases)
//! are pushed back by [`super::recovery`]. The lists live under `oxidekiq:batch:`, a prefix no older
//! release scans (see `keys::BATCH`).
//!
//! [`MAX_BATCH`]: super::MAX_BATCH
//! [`BATCH_BYTES`]: super::BATCH_BYTES
//! [`GUARD_LUA`]: fast::GUARD_LUA

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::Script;

use super::{BoxFuture, Fetch, QueueOrder, Setup, Stalls, UnitOfWork};
use crate::config::QueueWeight;
use crate::error::Result;
use crate::keys;
use crate::lua::script_error;
use crate::redis_conn::Conn;
use crate::redis_conn::resp::Dialer;
use crate::redis_conn::resp_pool::RespPool;

mod acks;
mod batch;
mod fast;
mod script;
mod size_bound;
mod sweeps;
mod wait;

use self::acks::{PiggybackAck, RIDE_WAIT};
use self::batch::HeldBatches;
use self::fast::{Fast, fast_batch};
use self::script::FETCH_LUA;
use self::size_bound::COMPRESSED_RATIO;

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
    /// Connection for acks, requeues and sweeps, and for the fetch pipelines when `own` is `None`.
    conn: Conn,
    /// Connections of the fetcher's own for its fetch pipelines (the fast path's transaction, the
    /// batch script's call, the acks riding on them), made by the target's dialer: a plain-text
    /// server's replies read by our own RESP reader, not redis-rs's parser (the job's bytes sliced from
    /// the read buffer; bench/results/instructions.md, session 3). `None` for TLS and Sentinel: their
    /// fetches go over `conn`, unchanged.
    own: Option<RespPool>,
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
    held: Mutex<HeldBatches>,
    /// Queues paused after an error of their own.
    stalls: Stalls,
    /// Oversized jobs sent to the dead set since the last [`Fetch::take_dead`].
    dead: AtomicU64,
    /// Acks waiting to ride on the next fetch's pipeline ([`Reliable::ack`]).
    riders: Mutex<Vec<PiggybackAck>>,
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
    /// Its landing list was added to this process's index of held lists ([`keys::held_index`]) before
    /// its first blocking wait (`wait_for_work`): recovery by index finds it from the first job that
    /// lands there, not from the process's first recovery pass on.
    indexed: bool,
}

impl Default for QueueState {
    fn default() -> Self {
        QueueState {
            full: true,
            landing: false,
            waits: 0,
            job_bytes: 0,
            indexed: false,
        }
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
            own: None,
            blocking,
            script: Script::new(FETCH_LUA),
            next_batch: AtomicU64::new(0),
            capsule: 0,
            block,
            max_payload_bytes: 16 * 1024 * 1024,
            fleet: Arc::new(crate::fleet::Fleet::new(None)),
            held: Mutex::new(HeldBatches::default()),
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
            .dialing(s.dialer)
    }

    /// Sends the fetch pipelines over connections of the fetcher's own made by `dialer` (a plain-text
    /// server), or, with none, over the shared connection.
    pub(crate) fn dialing(mut self, dialer: Option<Dialer>) -> Self {
        self.own = dialer.map(|d| RespPool::new(d.named("fetch")));
        self
    }

    /// Sends a fetch pipeline (the fast path's transaction or the batch script's call, with the acks
    /// riding on it; `ignore_errors`) over the fetcher's own connections when it has them, else over
    /// the shared one: one reply per command either way, the same values and errors.
    async fn query_fetch(
        &self,
        pipe: &redis::Pipeline,
    ) -> redis::RedisResult<Vec<redis::RedisResult<redis::Value>>> {
        match &self.own {
            Some(own) => own.query_each(pipe).await,
            None => pipe.query_async(&mut self.conn.clone()).await,
        }
    }

    /// For tests: how many of the fetcher's own connections are idle (`None`: it has none).
    #[cfg(test)]
    pub(crate) fn own_idle(&self) -> Option<usize> {
        self.own.as_ref().map(RespPool::idle)
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
