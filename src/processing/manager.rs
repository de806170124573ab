//! A fetched job's life inside the process: slots, the work table, the acker, push-back at shutdown.
//!
//! Mirrors `manager.rb`: `concurrency` long-lived processors take units of work from the fetch loops
//! through one channel, each holding a slot (a semaphore permit, taken by the fetch loop before it
//! fetches, so the process never holds more fetched jobs than it has free slots). The processor runs one
//! job ([`crate::processor`]: decode, middleware, perform, fate); the manager feeds it, keeps the work
//! table (what is running, for the Busy page, TTIN and the push-back), and settles it: a job whose fate is
//! in Redis leaves the table and goes to the acker, which acknowledges in batches ([`Fetch::acknowledge`]).
//! Long-lived processors rather than a task per job: no spawn, teardown or copy of a job's future per job.
//!
//! Quiet: the fetch loops stop (a fetch under way ends within the block time, and what it got goes back),
//! then what this process holds but never handed out goes back. At the shutdown deadline the processors
//! are told to stop and, after a short grace, dropped; [`Manager::push_back`] then flushes the acks, and
//! pushes every unfinished job back, byte for byte, to the end of its queue that is served next.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use crate::error::Result;
use crate::fetch::{self, Fetch, UnitOfWork};
use crate::job::Job;
use crate::processor::{Park, Processor};
use crate::shutdown::{Phase, ShutdownSignal};
use crate::work_table::WorkTable;

/// A unit of work on its way to a processor, with the permit of the manager's slot it holds (given
/// back when its job ends, or when a stuck fate write parks it: [`Park`]).
type SlottedUnit = (UnitOfWork, OwnedSemaphorePermit);

/// The queue from the fetch loops to the processors: a FIFO under a short lock, and one wake-up of one
/// waiting processor per unit. It replaces an mpsc receiver behind an async mutex, which cost two
/// wake-ups per job (the channel's, then the mutex's for the next processor in line) and a semaphore
/// round in the mutex.
///
/// With one job thread ([`Feed::chained`]), a fetch's units are queued under one lock and wake one
/// processor; each processor that takes a unit and leaves more behind wakes the next one. The fetch
/// loops run on the control plane's thread: one wake-up per unit from there was a cross-thread wake
/// (an eventfd write) each time the job thread had gone back to sleep between two of them, which it
/// did after every unit it ran while the control plane was preempted (2.2 sleeps of the job thread
/// per fetch of 10 at -c 10; `SYSCALLS=1 ruby bench/callgrind.rb`). A wake from a processor is a local
/// one (no syscall). Not with several job threads: tokio runs a task woken by a running task in that
/// worker's LIFO slot, which no other worker steals, so a processor woken behind a job that holds its
/// thread would wait for it while other threads idle.
#[derive(Debug, Default)]
struct Feed {
    /// Units not yet taken, oldest first.
    queue: Mutex<VecDeque<SlottedUnit>>,
    /// One notification per unit queued (or per batch, chained); every waiter when the last sender is
    /// gone.
    ready: Notify,
    /// Live [`FeedSender`]s; none left means nothing more comes.
    senders: AtomicUsize,
    /// A batch wakes one processor, which wakes the next (one job thread).
    chained: bool,
}

impl Feed {
    /// The feed and its first sender; `chained` with one job thread.
    fn new(chained: bool) -> (Arc<Feed>, FeedSender) {
        let feed = Arc::new(Feed {
            chained,
            ..Feed::default()
        });
        (feed.clone(), FeedSender::new(feed))
    }

    /// The oldest unit, if any, for a processor: chained, it wakes the next processor when more are
    /// left.
    fn take(&self) -> Option<SlottedUnit> {
        let (unit, more) = {
            let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            (q.pop_front(), !q.is_empty())
        };
        if self.chained && unit.is_some() && more {
            self.ready.notify_one();
        }
        unit
    }

    /// The oldest unit, if any.
    fn try_recv(&self) -> Option<SlottedUnit> {
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front()
    }

    /// The oldest unit, waiting for one; `None` once every sender is gone and nothing is queued.
    /// Cancel-safe: a unit is only taken in `try_recv`, and a notification a cancelled wait received is
    /// passed on to another waiter by `Notified`'s drop.
    async fn recv(&self) -> Option<SlottedUnit> {
        loop {
            // Registered before the checks, so a unit queued (or the last sender gone) after them wakes
            // this wait.
            let notified = self.ready.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            // Senders are counted before the queue is read: a sender pushes before it leaves, so a
            // count of 0 read first means nothing more can arrive and the read below sees the last
            // unit. Read the other way round, a unit sent between the two reads by the last sender
            // would be left in the feed.
            let closed = self.senders.load(Ordering::Acquire) == 0;
            if let Some(task) = self.take() {
                return Some(task);
            }
            if closed {
                return None;
            }
            notified.await;
        }
    }
}

/// The sending end of a [`Feed`], one per fetch loop.
#[derive(Debug)]
struct FeedSender(Arc<Feed>);

impl FeedSender {
    fn new(feed: Arc<Feed>) -> FeedSender {
        feed.senders.fetch_add(1, Ordering::AcqRel);
        FeedSender(feed)
    }

    /// Queues a unit and wakes one waiting processor (or leaves the wake for the next one to wait).
    fn send(&self, task: SlottedUnit) {
        self.0
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(task);
        self.0.ready.notify_one();
    }

    /// Queues a fetch's units: one by one with a wake-up each, or, chained, all under one lock with one
    /// wake-up (the processor that takes the first wakes the next: [`Feed::take`]).
    fn send_all(&self, tasks: impl Iterator<Item = SlottedUnit>) {
        if !self.0.chained {
            tasks.for_each(|t| self.send(t));
            return;
        }
        let queued = {
            let mut q = self.0.queue.lock().unwrap_or_else(|e| e.into_inner());
            let before = q.len();
            q.extend(tasks);
            q.len() > before
        };
        if queued {
            self.0.ready.notify_one();
        }
    }
}

impl Clone for FeedSender {
    fn clone(&self) -> FeedSender {
        FeedSender::new(self.0.clone())
    }
}

impl Drop for FeedSender {
    fn drop(&mut self) {
        if self.0.senders.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.ready.notify_waiters();
        }
    }
}

/// When the Redis outage under way began (`None`: Redis answers), shared by a manager's fetch loops so
/// that an outage is logged once when it begins ([`outage_began`]) and once when it ends
/// ([`outage_ended`]), however many loops meet it.
type OutageStart = Arc<Mutex<Option<Instant>>>;

/// The running manager of one process.
#[derive(Debug)]
pub(crate) struct Manager {
    /// The fetch strategy.
    fetch: Arc<dyn Fetch>,
    /// In-flight jobs.
    work: Arc<WorkTable>,
    /// The fetch loops and processors; ends with the units fetched but never started.
    jobs: JoinHandle<Vec<UnitOfWork>>,
    /// Batched acks; ends once every processor is gone and its queue is empty, or once told to by
    /// `drain_acks` and its queue is empty.
    acker: JoinHandle<()>,
    /// Tells the acker to flush what is queued and end, even if a processor stuck in a job (given up on at
    /// the deadline) still holds a sender.
    drain_acks: Arc<tokio::sync::Notify>,
    /// Set once `jobs` ended: what it handed back.
    ended: Option<Vec<UnitOfWork>>,
    /// How many unfinished jobs the push-back took out of the work table but could not push back.
    not_pushed_back: usize,
    /// Where the push-back sends jobs of a rolled-back class.
    to_ruby: ToRuby,
}

/// The push-back of jobs of a class rolled back (`route CLASS 0`) that were fetched from
/// `<queue>_rust`: they go to `<queue>`, since no oxidekiq may serve the Rust queue any more (the one
/// stopping may have been the last).
#[derive(Debug)]
struct ToRuby {
    /// The classes rolled back.
    routes: Arc<crate::route_table::RolledBack>,
    /// Connection for the pushes.
    conn: crate::redis_conn::Conn,
    /// This process's working-hash prefix (reliable fetch): each push consumes the job's entry.
    working_prefix: Option<String>,
}

impl ToRuby {
    /// The push-back of `processor`'s jobs.
    fn of(processor: &Processor) -> ToRuby {
        ToRuby {
            routes: processor.routes.clone(),
            conn: processor.conn.clone(),
            working_prefix: processor.working_prefix.clone(),
        }
    }

    /// Pushes the units of rolled-back classes to their Ruby queue; returns the others (and any whose
    /// push failed), for the ordinary push-back.
    async fn hand_back(&self, units: Vec<UnitOfWork>) -> Vec<UnitOfWork> {
        let suffix = crate::keys::RUST_QUEUE_SUFFIX;
        if !units.iter().any(|u| u.queue.ends_with(suffix)) {
            return units;
        }
        // Read now, not from the cache: a stop right after `route CLASS 0` must see the 0.
        let rolled_back = self.routes.classes(Duration::ZERO).await;
        if rolled_back.is_empty() {
            return units;
        }
        let mut rest = Vec::new();
        let mut moved = 0;
        for unit in units {
            let job = std::str::from_utf8(unit.raw())
                .ok()
                .and_then(|s| Job::from_str(s).ok());
            let base = job.and_then(|j| {
                crate::route_table::redirect(&rolled_back, &unit.queue, j.worker_class())
            });
            let Some(base) = base else {
                rest.push(unit);
                continue;
            };
            let token = self
                .working_prefix
                .as_ref()
                .map(|p| crate::retry::Token::of(p, &unit.queue, unit.id));
            let (base_ref, raw, token) = (&base, unit.raw(), token.as_ref());
            let pushed =
                with_retries(|| {
                    let mut conn = self.conn.clone();
                    async move {
                        crate::retry::push_to_queue(&mut conn, base_ref, raw, None, token).await
                    }
                })
                .await;
            match pushed {
                Ok(_) => moved += 1,
                Err(e) => {
                    tracing::error!(error = %e, to = %base,
                        "could not hand a job of a rolled-back class to its Ruby queue; it goes back to its Rust queue");
                    rest.push(unit);
                }
            }
        }
        if moved > 0 {
            crate::prom::metrics().pushed_back(moved);
            tracing::info!(
                count = moved,
                "pushed unfinished jobs of rolled-back classes (route 0) to their Ruby queues"
            );
        }
        rest
    }
}

impl Manager {
    /// Starts `concurrency` processors, the fetch loops that feed them, and the acker that acknowledges
    /// what `processor` settles (it sends to the other end of `acks`).
    ///
    /// The processors run on `jobs` (the job runtime); everything else here (the fetch loops, the
    /// acker, the push-back) runs on the caller's runtime, the control plane's, so a job that blocks
    /// its thread holds up neither a fetch loop's quiet nor an ack nor the shutdown.
    pub(crate) fn start(
        fetch: Arc<dyn Fetch>,
        processor: Processor,
        acks: mpsc::UnboundedReceiver<UnitOfWork>,
        concurrency: usize,
        signal: ShutdownSignal,
        jobs: tokio::runtime::Handle,
    ) -> Manager {
        let work = processor.work.clone();
        let to_ruby = ToRuby::of(&processor);
        let drain_acks = Arc::new(tokio::sync::Notify::new());
        let acker = tokio::spawn(ack_loop(fetch.clone(), acks, drain_acks.clone()));
        let jobs = tokio::spawn(run(
            fetch.clone(),
            Arc::new(processor),
            concurrency.max(1),
            signal,
            jobs,
        ));
        Manager {
            fetch,
            work,
            jobs,
            acker,
            drain_acks,
            ended: None,
            not_pushed_back: 0,
            to_ruby,
        }
    }

    /// Waits until every job ended (quiet and done, or cancelled at the deadline). Cancel-safe.
    pub(crate) async fn jobs_done(&mut self) {
        if self.ended.is_none() {
            self.ended = Some((&mut self.jobs).await.unwrap_or_default());
        }
    }

    /// True once [`Manager::jobs_done`] returned.
    pub(crate) fn jobs_ended(&self) -> bool {
        self.ended.is_some()
    }

    /// Logs who is running (TTIN), never the payload: arguments can hold personal data or secrets, and
    /// TTIN output goes to the same logs as everything else.
    pub(crate) fn dump(&self) {
        for j in self.work.snapshot() {
            let job = std::str::from_utf8(j.unit.raw())
                .ok()
                .and_then(|s| Job::from_str(s).ok());
            tracing::info!(queue = %j.unit.queue, tid = %j.tid(), run_at = j.run_at,
                class = job.as_ref().map_or("?", |job| job.worker_class()),
                jid = job.as_ref().map_or("?", |job| job.jid()), "running");
        }
    }

    /// After the jobs: flush acks, push back what never finished and anything left in this process's
    /// working keys. True when all of it reached Redis.
    pub(crate) async fn push_back(&mut self) -> bool {
        self.jobs_done().await;
        // Acks of jobs whose fate is in Redis: every processor has ended or was given up on, so what is
        // queued now is all there is to flush.
        self.drain_acks.notify_one();
        let _ = (&mut self.acker).await;
        let fetch = &*self.fetch;
        let mut ok = true;
        // Jobs fetched but never started go back first, then the ones that were running: each RPUSH goes
        // to the end served next, so the running (older) ones are served first.
        let mut unfinished = self.ended.take().unwrap_or_default();
        // Taken out of the table, not copied: a job stuck in synchronous code that the shutdown gave
        // up on may still end after this point, and its settling then finds no row, so it queues no
        // ack for a job that is pushed back (its failure writes no fate either: the phase is
        // Cancelled). The row is the one claim on the job's fate, and it is the push-back's now.
        unfinished.extend(self.work.drain().into_iter().map(|r| r.unit));
        let unfinished = self.to_ruby.hand_back(unfinished).await;
        match with_retries(|| fetch.requeue_leftovers(false)).await {
            Ok(0) => {}
            Ok(n) => {
                crate::prom::metrics().pushed_back(n as usize);
                tracing::info!(count = n, "pushed fetched but unstarted jobs back")
            }
            Err(e) => {
                ok = false;
                tracing::error!(error = %e, "could not empty this process's working lists")
            }
        }
        if !unfinished.is_empty() {
            // Counted until the push-back succeeds: a clean-up cut short mid-write (the stop's bound, a
            // second stop) says how many jobs it left behind.
            self.not_pushed_back = unfinished.len();
            match with_retries(|| fetch.bulk_requeue(&unfinished)).await {
                Ok(n) => {
                    self.not_pushed_back = 0;
                    crate::prom::metrics().pushed_back(n as usize);
                    tracing::info!(
                        count = unfinished.len(),
                        "pushed unfinished jobs back to their queues"
                    )
                }
                Err(e) => {
                    ok = false;
                    if fetch.holds_in_redis() {
                        tracing::error!(error = %e, count = unfinished.len(),
                            "could not push unfinished jobs back; they stay in this process's working lists for recovery")
                    } else {
                        tracing::error!(error = %e, count = unfinished.len(),
                            "could not push unfinished jobs back; this fetch keeps no copy in redis, so they are lost")
                    }
                }
            }
        }
        // Anything still held goes back too: a push-back above that failed half way, and jobs handed out
        // that never reached a processor (no job runs now, and every ack is flushed).
        match with_retries(|| fetch.requeue_leftovers(true)).await {
            Ok(n) => crate::prom::metrics().pushed_back(n as usize),
            Err(e) => {
                ok = false;
                tracing::error!(error = %e, "could not empty this process's working lists");
            }
        }
        ok
    }

    /// The push-back was cut short (Redis down, or a second stop): stop the acker and say what stays.
    pub(crate) fn abandon(&mut self) {
        self.acker.abort();
        let left = (self.work.drain().len() + self.not_pushed_back).max(self.fetch.outstanding());
        tracing::error!(
            jobs = left,
            "unfinished jobs stay in this process's working keys; another oxidekiq process pushes them \
             back once this one's liveness key expires"
        );
    }
}

/// The fetch loops and the processors. Once every loop has stopped fetching (quiet), whatever this
/// process holds but never handed out goes back to its queue. Returns the units that were fetched but
/// never reached a processor (cancelled at the deadline, or fetched after quiet and not pushed back).
async fn run(
    fetch: Arc<dyn Fetch>,
    processor: Arc<Processor>,
    concurrency: usize,
    signal: ShutdownSignal,
    jobs: tokio::runtime::Handle,
) -> Vec<UnitOfWork> {
    let slots = Arc::new(Semaphore::new(concurrency));
    let (feed, tasks) = Feed::new(jobs.metrics().num_workers() == 1);
    let mut processors = JoinSet::new();
    // A job whose fate write is stuck gives up its slot and asks here for a processor in its place.
    let (respawn, respawn_rx) = mpsc::unbounded_channel();
    let spawner = Spawner {
        jobs: jobs.clone(),
        processor: processor.clone(),
        feed: feed.clone(),
        signal: signal.clone(),
        respawn,
    };
    for _ in 0..concurrency {
        spawner.spawn(&mut processors);
    }
    let outage: OutageStart = Arc::default();
    let mut loops = JoinSet::new();
    let (fetching_tx, fetching_rx) = mpsc::channel::<()>(1);
    let loop_count = fetch.fetch_loops(concurrency).max(1);
    // Each loop fetches at most its share of the slots. Without a bound, the loop that woke first took
    // every slot freed in that turn: one batch of the whole concurrency went round while the other loops
    // fetched a job or two, so with one runtime thread oxidekiq and Redis took turns (a 100k no-op drain
    // at -c 200 spent 40% of its time parked with all four fetches in flight; batch sizes were 190-200 or
    // 1-9). With shares, Redis fills one loop's batch while the processors run another's.
    let share = concurrency.div_ceil(loop_count).clamp(1, fetch::MAX_BATCH);
    for _ in 0..loop_count {
        loops.spawn(fetch_loop(
            fetch.clone(),
            processor.clone(),
            tasks.clone(),
            FetchLoopSlots {
                slots: slots.clone(),
                max: share,
            },
            outage.clone(),
            signal.clone(),
            fetching_tx.clone(),
        ));
    }
    drop((tasks, fetching_tx, processor));
    let join = async {
        let mut stranded = Vec::new();
        while let Some(r) = loops.join_next().await {
            stranded.extend(r.unwrap_or_default());
        }
        stranded
    };
    let (unhanded, stranded, mut left) = tokio::join!(
        quiet_sweep(&*fetch, &feed, fetching_rx, signal.clone()),
        join,
        wait_for(&mut processors, signal, spawner, respawn_rx)
    );
    left.extend(unhanded);
    left.extend(stranded);
    // Units still queued were fetched but never started: the shutdown pushes them back.
    while let Some((unit, _)) = feed.try_recv() {
        left.push(unit);
    }
    left
}

/// One long-lived processor: takes the next unit, runs it, frees its slot. Ends when the fetch loops are
/// gone and nothing is queued, or once the shutdown deadline passed: a unit taken then is not started but
/// returned (the shutdown pushes it back untouched rather than cancel it a moment later).
async fn process_loop(
    processor: Arc<Processor>,
    feed: Arc<Feed>,
    signal: ShutdownSignal,
    respawn: mpsc::UnboundedSender<()>,
) -> Option<UnitOfWork> {
    // The list of the jobs' `after_fate` hooks, reused from one job to the next (see `AfterFate::reuse`).
    let mut after = crate::worker::AfterFate::default();
    loop {
        let next = feed.recv().await;
        // `None`: the fetch loops are gone and nothing is queued.
        let (unit, slot) = next?;
        if signal.phase() >= Phase::Cancelled {
            return Some(unit);
        }
        // `process` catches a job's panic itself; this guard only keeps the processor alive should its
        // own recovery panic as well (the job then stays held, and the shutdown pushes it back).
        let park = Park::new(slot, respawn.clone());
        let job = std::pin::pin!(processor.clone().process(unit, &park, after.clone()));
        if crate::processor::catch_unwind(job).await.is_err() {
            tracing::error!(
                "a job's panic recovery panicked; the job stays held until the shutdown"
            );
        }
        after.reuse();
        if park.parked() {
            // Its job gave up the slot while its fate write was stuck, and a fresh processor took
            // this one's place: end, so the count stays `concurrency`.
            return None;
        }
    }
}

/// Starts processors: `concurrency` at first, and one in the place of each whose job's fate write is
/// stuck ([`Park`]).
struct Spawner {
    /// The job runtime the processors run on (never the control plane's).
    jobs: tokio::runtime::Handle,
    processor: Arc<Processor>,
    feed: Arc<Feed>,
    signal: ShutdownSignal,
    respawn: mpsc::UnboundedSender<()>,
}

impl Spawner {
    fn spawn(&self, processors: &mut JoinSet<Option<UnitOfWork>>) {
        processors.spawn_on(
            process_loop(
                self.processor.clone(),
                self.feed.clone(),
                self.signal.clone(),
                self.respawn.clone(),
            ),
            &self.jobs,
        );
    }
}

/// Waits for the processors; at the deadline (Cancelled) stops them, after a moment's grace for jobs
/// that watch the signal. Their jobs stay in the work table, which the shutdown pushes back. Returns the
/// units processors took but did not start.
async fn wait_for(
    processors: &mut JoinSet<Option<UnitOfWork>>,
    mut signal: ShutdownSignal,
    spawner: Spawner,
    mut respawn: mpsc::UnboundedReceiver<()>,
) -> Vec<UnitOfWork> {
    let mut left = Vec::new();
    let mut collect = |next: Option<std::result::Result<Option<UnitOfWork>, _>>| match next {
        Some(r) => {
            left.extend(r.ok().flatten());
            true
        }
        None => false,
    };
    loop {
        tokio::select! {
            next = processors.join_next() => if !collect(next) { return left },
            Some(()) = respawn.recv() => spawner.spawn(processors),
            _ = signal.cancelled() => break,
        }
    }
    // Its processor holds the last reference to the processor state the acker waits on.
    drop(spawner);
    let grace = tokio::time::sleep(Duration::from_millis(200));
    tokio::pin!(grace);
    loop {
        tokio::select! {
            next = processors.join_next() => if !collect(next) { return left },
            _ = &mut grace => break,
        }
    }
    processors.abort_all();
    // An aborted task ends at its next await; a job stuck in synchronous code never gets there. Its unit
    // stays in the work table (only settling removes it), so after a bound the shutdown goes on and pushes
    // it back rather than wait for it forever.
    let bounded = tokio::time::timeout(ABORT_BOUND, async {
        while collect(processors.join_next().await) {}
    });
    if bounded.await.is_err() {
        tracing::error!(
            still_running = processors.len(),
            "jobs did not stop when cancelled (stuck outside an await?): pushing them back anyway"
        );
    }
    left
}

/// How long cancelled processors get to end before the shutdown goes on without them.
const ABORT_BOUND: Duration = Duration::from_secs(2);

/// Once no fetch is under way any more (every loop dropped its sender), pushes back what this process
/// holds but never handed out, and what waits in the feed for a processor. The feed holds a unit only
/// while every processor that could take it is held up (jobs blocking all of the job runtime's
/// threads): a quiet process gives those back for other processes to run rather than keep them
/// until the blocking ends. Returns the units taken from the feed that could not be pushed back (the
/// shutdown's push-back takes them).
async fn quiet_sweep(
    fetch: &dyn Fetch,
    feed: &Feed,
    mut fetching: mpsc::Receiver<()>,
    mut signal: ShutdownSignal,
) -> Vec<UnitOfWork> {
    let _ = fetching.recv().await;
    // Taken under the feed's lock, one at a time: a unit a processor took first runs as usual.
    let mut waiting = Vec::new();
    while let Some((unit, _slot)) = feed.try_recv() {
        waiting.push(unit);
    }
    tokio::select! {
        r = with_retries(|| async {
            let n = fetch.requeue_leftovers(false).await?;
            if !waiting.is_empty() {
                fetch.bulk_requeue(&waiting).await?;
            }
            Ok(n + waiting.len() as u64)
        }) => match r {
            Ok(0) => {}
            Ok(n) => {
                waiting.clear();
                tracing::info!(count = n, "quiet: pushed back jobs fetched but never started")
            }
            Err(e) => tracing::warn!(error = %e, "quiet: could not push back jobs fetched but never started; the shutdown tries again"),
        },
        _ = signal.cancelled() => {}
    }
    waiting
}

/// The manager's slots as one fetch loop takes them: the semaphore its fetch loops and processors
/// share, and the most slots this loop takes for one fetch (its share of the concurrency).
struct FetchLoopSlots {
    slots: Arc<Semaphore>,
    max: usize,
}

/// How long a fetch loop whose last fetch found a backlog waits for its whole share of slots to free
/// before it fetches fewer (tokio's timer rounds this up to its next millisecond tick).
const GATHER: Duration = Duration::from_micros(500);

/// Takes the free slots, at most the loop's share; waits for the first. `None` once quiet.
///
/// `backlog`: the loop's last fetch got every job it asked for, so the queues hold more. Then a loop that
/// finds less than its share free waits up to [`GATHER`] for it (the jobs of its last batch, and of the
/// other loops' batches, run meanwhile). The fetch loops run on the control plane's own thread, beside
/// the job runtime: without the wait, each loop took a slot the moment it freed and fetched it alone
/// (20 000 no-op jobs at -c 200 went out in ~5 700 fetches, 3.5 a fetch), and a fetch's fixed cost, a
/// Redis round trip and a script, was most of what a job cost oxidekiq and Redis. An idle process (slots
/// free, queues empty) never waits: an enqueued job starts at once.
async fn take_slots(
    share: &FetchLoopSlots,
    signal: &mut ShutdownSignal,
    backlog: bool,
) -> Option<Vec<OwnedSemaphorePermit>> {
    let first = tokio::select! {
        p = share.slots.clone().acquire_owned() => p.ok()?,
        _ = signal.quiet() => return None,
    };
    // No yield here: the processors run on the job runtime, never on this one, so a yield let none of
    // them free a slot, and on the control plane's current-thread runtime it cost three syscalls per
    // fetch (a poll of the driver, a write to its own eventfd to wake the deferred task, a second
    // poll). The wait below gathers the slots.
    let mut permits = vec![first];
    grab_free(share, &mut permits);
    let want = share.max;
    if backlog && permits.len() < want {
        // One wake-up when enough slots have freed (the semaphore hands them to this waiter as they
        // free), not one per slot. Given back at once: `grab_free` takes them one by one, with any
        // freed meanwhile. Timed out or quiet: the partial grant goes back to the semaphore.
        let more = u32::try_from(want - permits.len()).unwrap_or(u32::MAX);
        tokio::select! {
            r = tokio::time::timeout(GATHER, share.slots.clone().acquire_many_owned(more)) => drop(r),
            _ = signal.quiet() => {}
        }
        grab_free(share, &mut permits);
    }
    // Quiet during the gather: no fetch after it (it would move jobs only to push them
    // back, or block a quiet process for the block time). The slots go back with the permits.
    if signal.is_quiet() {
        return None;
    }
    Some(permits)
}

/// Adds the free slots to `permits`, up to the loop's share.
fn grab_free(share: &FetchLoopSlots, permits: &mut Vec<OwnedSemaphorePermit>) {
    while permits.len() < share.max {
        match share.slots.clone().try_acquire_owned() {
            Ok(p) => permits.push(p),
            Err(_) => break,
        }
    }
}

/// One fetch loop: take free slots (at most `share`), fetch that many jobs, hand them to the processors.
async fn fetch_loop(
    fetch: Arc<dyn Fetch>,
    processor: Arc<Processor>,
    tasks: FeedSender,
    share: FetchLoopSlots,
    outage: OutageStart,
    mut signal: ShutdownSignal,
    fetching: mpsc::Sender<()>,
) -> Vec<UnitOfWork> {
    let mut backoff = Duration::from_millis(100);
    let mut stranded = Vec::new();
    let stats = processor.stats.clone();
    // Jobs fetched after quiet go back; those of a rolled-back class to their Ruby queue.
    let to_ruby = ToRuby::of(&processor);
    drop(processor);
    let mut backlog = false;
    while !signal.is_quiet() {
        let Some(permits) = take_slots(&share, &mut signal, backlog).await else {
            break;
        };
        let asked = permits.len();
        // A fetch is not cut short by quiet: it ends within the block time, and what it got goes back
        // below. Only the shutdown deadline cuts it, and only when that is safe (what it moved then stays
        // in this process's working keys, which the shutdown sweeps).
        let fetched = if fetch.cancel_safe() {
            let mut cancelled = signal.clone();
            tokio::select! {
                r = fetch.retrieve_work(permits.len()) => r,
                _ = cancelled.cancelled() => break,
            }
        } else {
            fetch.retrieve_work(permits.len()).await
        };
        let dead = fetch.take_dead();
        if dead > 0 {
            // Oversized payloads the fetch sent to the dead set count as failed runs, as the processor
            // counts an undecodable one.
            stats.processed.fetch_add(dead, Ordering::Relaxed);
            stats.failed.fetch_add(dead, Ordering::Relaxed);
        }
        let units = match fetched {
            Ok(u) => {
                crate::prom::metrics().fetched(u.len());
                backlog = u.len() >= asked;
                if outage_ended(&outage) {
                    backoff = Duration::from_millis(100);
                    reconcile(&*fetch, signal.clone()).await;
                }
                u
            }
            Err(e) => {
                outage_began(&outage, &e);
                backlog = false;
                drop(permits);
                let jitter = rand::random::<f64>() * 0.5 + 0.75;
                tokio::select! {
                    _ = tokio::time::sleep(backoff.mul_f64(jitter)) => {}
                    _ = signal.quiet() => break,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        stranded.extend(hand_out(&*fetch, units, permits, &tasks, signal.clone(), &to_ruby).await);
    }
    drop(fetching);
    stranded
}

/// Gives each unit a slot and queues it for a processor. Fetched after the shutdown began: straight back
/// to the queue, as Sidekiq does. More jobs than slots (never, with the batch script's own bound) go back
/// too rather than run unbounded. Returns the units it could not push back (Redis failing, or the
/// deadline): the shutdown's push-back takes them, since a fetch that keeps no copy in Redis (basic)
/// would lose them if they were dropped here.
async fn hand_out(
    fetch: &dyn Fetch,
    mut units: Vec<UnitOfWork>,
    permits: Vec<OwnedSemaphorePermit>,
    tasks: &FeedSender,
    signal: ShutdownSignal,
    to_ruby: &ToRuby,
) -> Vec<UnitOfWork> {
    let keep = if signal.is_quiet() { 0 } else { permits.len() };
    let mut stranded = Vec::new();
    if units.len() > keep {
        let back: Vec<UnitOfWork> = units.drain(keep..).collect();
        let back = to_ruby.hand_back(back).await;
        let mut cancelled = signal.clone();
        let pushed = tokio::select! {
            r = with_retries(|| fetch.bulk_requeue(&back)) => match r {
                Ok(_) => true,
                Err(e) => {
                    tracing::error!(error = %e, count = back.len(),
                        "could not push back fetched jobs; the shutdown's push-back tries again");
                    false
                }
            },
            _ = cancelled.cancelled() => false,
        };
        if !pushed {
            stranded = back;
        }
    }
    tasks.send_all(units.into_iter().zip(permits));
    stranded
}

/// Logs the start of an outage once.
fn outage_began(outage: &OutageStart, e: &crate::Error) {
    if let Ok(mut o) = outage.lock()
        && o.is_none()
    {
        tracing::warn!(error = %e, "redis unavailable: fetch paused, retrying with backoff");
        *o = Some(Instant::now());
    }
}

/// True (and logged) when a fetch succeeded after an outage.
fn outage_ended(outage: &OutageStart) -> bool {
    let Some(since) = outage.lock().ok().and_then(|mut o| o.take()) else {
        return false;
    };
    tracing::info!(
        after = format_args!("{:.1}s", since.elapsed().as_secs_f64()),
        "redis reachable again: fetching resumed"
    );
    true
}

/// A fetch whose reply was lost during an outage may have left jobs held that nobody runs: push back
/// every one that was never handed out. Cut by the shutdown deadline like a fetch: a Redis that hangs
/// again would hold the stop up to the response timeout per queue; what it did not check stays in this
/// process's working keys, which the shutdown sweeps.
async fn reconcile(fetch: &dyn Fetch, mut signal: ShutdownSignal) {
    tokio::select! {
        r = fetch.reconcile() => match r {
            Ok(0) => {}
            Ok(n) => tracing::info!(count = n, "pushed back jobs stranded by a lost fetch reply"),
            Err(e) => tracing::warn!(error = %e, "could not check the working list after an outage"),
        },
        _ = signal.cancelled() => {}
    }
}

/// Sends batched acks; ends when every sender is gone and the queue is empty. A failing ack is retried
/// until it succeeds: at shutdown the launcher's clean-up bound ends it (the job then stays held, and a
/// recovery may run it again: at least once).
async fn ack_loop(
    fetch: Arc<dyn Fetch>,
    mut rx: mpsc::UnboundedReceiver<UnitOfWork>,
    drain: Arc<tokio::sync::Notify>,
) {
    let mut batch: Vec<UnitOfWork> = Vec::with_capacity(1024);
    let mut draining = false;
    loop {
        if batch.is_empty() {
            if draining {
                match rx.try_recv() {
                    Ok(a) => batch.push(a),
                    Err(_) => return,
                }
            } else {
                tokio::select! {
                    a = rx.recv() => match a {
                        Some(a) => batch.push(a),
                        None => return,
                    },
                    _ = drain.notified() => {
                        draining = true;
                        continue;
                    }
                }
            }
        }
        while batch.len() < 4096 {
            match rx.try_recv() {
                Ok(a) => batch.push(a),
                Err(_) => break,
            }
        }
        let mut delay = Duration::from_millis(50);
        let mut attempts = 0;
        while let Err(e) = fetch.acknowledge(&batch).await {
            // Only an outage mends by itself: anything else retried would hold every later ack behind
            // it for good. Given up, the jobs stay held in Redis (pushed back at stop, or recovered).
            if !e.is_outage() {
                tracing::error!(error = %e, jobs = batch.len(),
                    "cannot acknowledge finished jobs; given up (they stay held: pushed back at stop, or recovered)");
                break;
            }
            attempts += 1;
            if attempts == 1 {
                tracing::warn!(error = %e, "cannot acknowledge finished jobs; retrying");
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(2));
        }
        batch.clear();
    }
}

/// Tries a shutdown write a few times over about five seconds while Redis is away
/// ([`crate::Error::is_outage`]); a failure that will not mend (a key of the wrong type) is answered at
/// once. Retrying one would only spend the stop's time: the push-back of a rolled-back class's jobs
/// waited 6 s per job on a damaged `queues`, ran past the deadline, and a basic fetch lost them.
pub(crate) async fn with_retries<T, F, Fut>(mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut delay = Duration::from_millis(100);
    let mut last = None;
    for _ in 0..6 {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if !e.is_outage() => return Err(e),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(delay).await;
        delay *= 2;
    }
    Err(last.unwrap_or_else(|| crate::Error::Config("no attempt made".into())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shutdown::Shutdown;

    /// Waiting processors of a chained feed and a fetch of as many units, queued with one wake-up: every
    /// processor gets a unit (each taker wakes the next), and a unit left alone is taken too.
    #[tokio::test(start_paused = true)]
    async fn a_chained_batch_wakes_every_waiting_processor() {
        let (feed, sender) = Feed::new(true);
        let slots = Arc::new(Semaphore::new(4));
        let mut takers = JoinSet::new();
        for _ in 0..3 {
            let feed = feed.clone();
            takers.spawn(async move { feed.recv().await.map(|(u, _)| u.id) });
        }
        // Every taker waits on the feed before the batch comes.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let unit = |id| {
            let slot = slots.clone().try_acquire_owned().unwrap();
            (UnitOfWork::new("default".into(), id, b"{}".to_vec()), slot)
        };
        sender.send_all((1..=3).map(unit));
        // Paused time: a processor left asleep would let the timeout fire at once instead of hanging.
        let mut got = tokio::time::timeout(Duration::from_secs(5), takers.join_all())
            .await
            .expect("a processor of the batch was never woken");
        got.sort();
        assert_eq!(got, vec![Some(1), Some(2), Some(3)]);
        // One more unit, one waiting processor.
        let taker = tokio::spawn({
            let feed = feed.clone();
            async move { feed.recv().await.map(|(u, _)| u.id) }
        });
        tokio::task::yield_now().await;
        sender.send_all(std::iter::once(unit(4)));
        assert_eq!(taker.await.unwrap(), Some(4));
    }

    /// Quiet comes while a loop with a backlog waits for slots to gather: it takes none and fetches
    /// nothing more (it fetched once more after quiet, then pushed what it got back).
    #[tokio::test(start_paused = true)]
    async fn quiet_during_the_gather_ends_the_loop_without_a_fetch() {
        let shutdown = Shutdown::new();
        let mut signal = shutdown.signal();
        let slots = Arc::new(Semaphore::new(10));
        // Nine slots busy with running jobs: one free, fewer than half the share.
        let busy = slots.clone().acquire_many_owned(9).await.unwrap();
        let share = FetchLoopSlots {
            slots: slots.clone(),
            max: 10,
        };
        let taker =
            tokio::spawn(
                async move { take_slots(&share, &mut signal, true).await.map(|p| p.len()) },
            );
        // Time is paused and these yields keep the runtime busy: the gather's timer cannot fire.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        shutdown.advance(Phase::Quiet);
        assert_eq!(
            taker.await.unwrap(),
            None,
            "slots taken for a fetch after quiet"
        );
        drop(busy);
        assert_eq!(slots.available_permits(), 10, "a slot kept");
    }
}
