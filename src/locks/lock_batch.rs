//! Job locks taken and released in batches: the `SET NX PX` of every job that starts while a batch is
//! on the wire go out together, after one `EVALSHA` that compare-and-deletes the locks of every job
//! that ended meanwhile, all in one round trip.
//!
//! # Why
//!
//! A lock costs a job two commands, one at its start and one at its end. Sent one at a time on the
//! shared connection, each paid redis-rs's per-command path (a `Cmd`, a channel hop to the
//! connection's driver task, a response-timeout timer, a reply parsed into a `Value`) and, in Redis,
//! one read, one command and one write per request. Batched, what is left per job is its share of a
//! round trip. `bench/results/redis-per-job.md` has the measurements.
//!
//! # How
//!
//! A [`Batcher`] is one task per [`Locks`] handle (spawned on first use; the launcher builds one for the
//! process) and a queue of batches it sends oldest first. A caller puts its request into the newest
//! batch (a new one once that holds [`MAX_BATCH`]) and wakes the task if it was waiting; the task takes
//! the oldest batch and sends it as one round trip: the releases first, as one `EVALSHA` of
//! [`RELEASE_MANY_SCRIPT`], then one `SET NX PX` per acquire. Batches come from concurrency only, never
//! from a delay: a lone request is sent as soon as the task runs, and requests that arrive while a
//! batch is on the wire go out together after it. The answers of a batch come back together: the task
//! writes them into the batch's [`Answers`] and wakes its callers, each of which takes its own (no
//! channel per request, one allocation per batch).
//!
//! Where the process's Redis URL is plain text (`redis://`, `redis+unix://`), the task sends over a
//! connection of its own and reads the replies itself (`redis_conn::resp`): the lock commands then skip
//! redis-rs's command building and reply parsing, most of what a batch cost in the process. With TLS or
//! Sentinel (and in tests that ask for it) they go over the shared connection through redis-rs: the
//! same commands, in the same order, with the same answers.
//!
//! **A release is not waited for** ([`Batcher::release_detached`], what the job middleware use): the
//! job's work is over, so its slot goes on to the next job while the release is queued; the batch task
//! logs its outcome (in the job's span, so the line names the job) when the reply comes. Two things keep
//! that from being seen:
//! - Order. One queue of batches, sent one after another, releases before acquires in each: an acquire
//!   queued after a release in this process is sent after it, so a job that follows its duplicate on
//!   one slot (or anywhere in the process) never finds that duplicate's lock still held. A waiting
//!   [`RedisLock::lock`] sees a release within one batch round trip.
//! - A stop. [`Batcher::flush`] (called by the launcher after the jobs have ended, before the process
//!   leaves) waits until every release queued before it has had its reply: a graceful stop leaves no
//!   lock behind to make a later duplicate be skipped until its TTL.
//!
//! The wire contract is the one of [`crate::lock`]: acquire is `SET oxidekiq:lock:<key> <token>:<jid>
//! NX PX <ttl>`, so a batch of them behaves exactly as the same commands sent one by one (two acquires
//! of one key in a batch: the first wins). A release deletes a key only while it holds the holder's
//! token.
//!
//! # Failures
//!
//! A batch that fails (connection lost, no reply in time, a Redis error in the script) answers **every**
//! caller in its group with that error: nobody is told "released" or "acquired" without Redis's own
//! answer. A `SET` refused by Redis (a TTL it cannot take, OOM) fails that acquire alone: the others of
//! its batch get their own replies, so one class's bad option cannot fail every locked job beside it. A
//! job whose acquire fails fails as before; a release that fails is logged with its key, and the key
//! expires by its TTL. On `NOSCRIPT` (Redis restarted, `SCRIPT FLUSH`) the releases are sent again with
//! `EVAL`, then the acquires that found their key taken are tried once more, so the order above holds
//! there too. When the batch task is gone (its runtime shut down while a `Conn` lives on), the batches
//! it had not answered fail (their detached releases are logged as failed) and callers send their
//! command directly over the shared connection.
//!
//! [`RedisLock::lock`]: crate::lock::RedisLock::lock

use std::collections::VecDeque;
use std::future::{Future, poll_fn};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::task::{Context, Poll, Waker};

use redis::{ErrorKind, Value};

use crate::error::{Error, Result};
use crate::lua::script_sha1;
use crate::redis_conn::Conn;
use crate::redis_conn::resp::{self, Dialer, RespConn};

/// Deletes each `KEYS[i]` that holds the token `ARGV[i]`. Answers the number of keys when every one
/// of them was deleted (the common case, one integer), else a string with one `1` (deleted) or `0`
/// per key, in order; a key named twice is deleted once, by its first mention.
///
/// [`crate::lock::RELEASE_SCRIPT`] for many keys, in two calls instead of two per key: one `MGET`
/// (a key of another type reads as nil: it holds no token of ours), one `DEL` of the matching ones.
/// Measured with `INFO commandstats` on Redis 7.0 (64 keys a call): 0.75 µs of Redis CPU per key,
/// against 1.18 µs for a `GET` and a `DEL` per key.
pub(crate) const RELEASE_MANY_SCRIPT: &str = "local vals = redis.call('MGET', unpack(KEYS)) \
     local del, n = {}, 0 \
     for i = 1, #KEYS do if vals[i] == ARGV[i] then n = n + 1 del[n] = KEYS[i] end end \
     local gone = 0 \
     if n > 0 then gone = redis.call('DEL', unpack(del)) end \
     if gone == #KEYS then return gone end \
     local out, seen = {}, {} \
     for i = 1, #KEYS do local k = KEYS[i] \
     if vals[i] == ARGV[i] and not seen[k] then seen[k] = true out[i] = '1' else out[i] = '0' end \
     end \
     return table.concat(out)";

static RELEASE_MANY_SHA: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| script_sha1(RELEASE_MANY_SCRIPT));

/// The most requests one batch carries: bounds a round trip's size (and the Lua `unpack` of the
/// script's keys, far below its stack limit).
pub(crate) const MAX_BATCH: usize = 512;

/// One `SET <key> <value> NX PX <ttl>`.
#[derive(Debug, Default)]
pub(crate) struct Acquire {
    /// The full Redis key.
    pub(crate) key: String,
    /// The value to store: the holder's token.
    pub(crate) value: String,
    /// The TTL in milliseconds (at least 1).
    pub(crate) ttl_ms: u64,
}

/// One compare-and-delete of `key` if it holds `token`.
#[derive(Debug)]
pub(crate) struct Release {
    /// The full Redis key.
    pub(crate) key: String,
    /// The holder's token.
    pub(crate) token: String,
}

/// The work of a detached release left to await, when it could not be queued: boxed, so the futures
/// of the jobs that never take that path stay small.
pub(crate) type Detached = std::pin::Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// Who learns how a release went: its caller, or the log (in the span of the job that released).
#[derive(Debug)]
enum Outcome {
    /// A caller waiting for the answer, which it takes from the batch's [`Answers`].
    Caller,
    /// Nobody waits: the batch task logs a failure or a lock found gone, in this span.
    Log(tracing::Span),
}

/// Locks `m`, whatever a panic elsewhere left in it (nothing here panics while holding one, and the
/// data stays consistent at every unlock).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The answers of one batch, written by the batch task once Redis replied (or the batch failed) and
/// taken by each caller, by the index its request had in the batch.
#[derive(Debug, Default)]
struct Answers {
    /// Set (under the lock) once the answers are in.
    done: AtomicBool,
    /// The answers, and the callers waiting for them.
    inner: Mutex<AnswersInner>,
}

#[derive(Debug, Default)]
struct AnswersInner {
    /// Who to wake when the answers are in.
    waiters: Vec<Waker>,
    /// Each acquire's answer with its request (its key and value go back to the caller, who keeps
    /// them in the guard); `None` once taken.
    acquired: Vec<Option<(Result<bool>, Acquire)>>,
    /// Each release's answer (`None` for a detached one, or once taken).
    released: Vec<Option<Result<bool>>>,
}

impl Answers {
    /// Writes the answers and wakes every caller waiting for them.
    fn complete(
        &self,
        acquired: Vec<Option<(Result<bool>, Acquire)>>,
        released: Vec<Option<Result<bool>>>,
    ) {
        let waiters = {
            let mut inner = lock(&self.inner);
            inner.acquired = acquired;
            inner.released = released;
            self.done.store(true, Ordering::Release);
            std::mem::take(&mut inner.waiters)
        };
        for w in waiters {
            w.wake();
        }
    }

    /// Waits until the answers are in, then takes what `take` picks from them.
    async fn wait<T>(&self, take: impl Fn(&mut AnswersInner) -> T) -> T {
        // The caller's place in `waiters`, once it has one.
        let mut registered: Option<usize> = None;
        poll_fn(|cx: &mut Context<'_>| self.poll_take(cx, &mut registered, &take)).await
    }

    /// What `take` picks from the answers once they are in; until then, the caller's waker is kept
    /// (at `registered` in `waiters`, once it has a place).
    fn poll_take<T>(
        &self,
        cx: &mut Context<'_>,
        registered: &mut Option<usize>,
        take: impl FnOnce(&mut AnswersInner) -> T,
    ) -> Poll<T> {
        let mut inner = lock(&self.inner);
        if self.done.load(Ordering::Acquire) {
            return Poll::Ready(take(&mut inner));
        }
        match *registered {
            Some(i) if inner.waiters[i].will_wake(cx.waker()) => {}
            Some(i) => inner.waiters[i] = cx.waker().clone(),
            None => {
                *registered = Some(inner.waiters.len());
                inner.waiters.push(cx.waker().clone());
            }
        }
        Poll::Pending
    }

    /// True once the answers are in.
    fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }
}

/// What one batch carries, split by kind, and where its answers go.
#[derive(Debug, Default)]
struct Batch {
    releases: Vec<Release>,
    outcomes: Vec<Outcome>,
    acquires: Vec<Acquire>,
    answers: Arc<Answers>,
}

impl Batch {
    /// Requests that go to Redis.
    fn len(&self) -> usize {
        self.releases.len() + self.acquires.len()
    }

    /// A new batch with this one's lists (emptied by [`Batch::send`]), for their capacity.
    fn emptied(&mut self) -> Batch {
        let mut next = Batch {
            releases: std::mem::take(&mut self.releases),
            outcomes: std::mem::take(&mut self.outcomes),
            acquires: std::mem::take(&mut self.acquires),
            answers: Arc::default(),
        };
        next.releases.clear();
        next.outcomes.clear();
        next.acquires.clear();
        next
    }

    /// Sends the batch over `wire` and answers every caller (logging every detached release that
    /// failed); leaves the batch empty.
    async fn send(&mut self, wire: &mut Wire) {
        let (released, acquired) = exchange(wire, &self.releases, &self.acquires).await;
        self.settle(released, acquired);
    }

    /// Answers every caller with the results of the batch (or with its error) and logs the outcome of
    /// every detached release that did not delete its key.
    fn settle(&mut self, released: Result<Vec<bool>>, acquired: Acquired) {
        let n = self.releases.len();
        let released = released.and_then(|v| same_count(v, n));
        let mut answers = Vec::with_capacity(n);
        for (i, (req, outcome)) in self
            .releases
            .drain(..)
            .zip(self.outcomes.drain(..))
            .enumerate()
        {
            let this = match &released {
                Ok(v) => Ok(v[i]),
                Err(e) => Err(copy_error(e)),
            };
            answers.push(match outcome {
                Outcome::Caller => Some(this),
                Outcome::Log(span) => {
                    log_release(&span, &req.key, this);
                    None
                }
            });
        }
        let reqs = self.acquires.drain(..);
        let acquired = match acquired.and_then(|v| same_count(v, reqs.len())) {
            Ok(each) => each.into_iter().zip(reqs).map(Some).collect(),
            Err(e) => reqs.map(|req| Some((Err(copy_error(&e)), req))).collect(),
        };
        self.answers.complete(acquired, answers);
    }
}

impl Drop for Batch {
    /// A batch dropped unanswered (its task went away with it): every caller gets [`task_gone`], every
    /// detached release is logged as failed.
    fn drop(&mut self) {
        if !self.answers.is_done() {
            self.settle(Err(task_gone()), Err(task_gone()));
        }
    }
}

/// What the callers and the batch task share.
#[derive(Debug, Default)]
struct Queue {
    /// Batches waiting for the task, oldest first; requests go into the last one.
    batches: VecDeque<Batch>,
    /// The answers of the batch on the wire (what a flush waits for when nothing is queued).
    in_flight: Option<Arc<Answers>>,
    /// The task, while it waits for a batch.
    task: Option<Waker>,
    /// No task will send anything more: its handle was dropped (it sends what is queued, then ends),
    /// or it is gone (callers then send their commands themselves).
    closed: bool,
    /// The lists of the last batch sent, emptied, for the next one to fill without growing them
    /// again.
    spare: Option<Batch>,
}

impl Queue {
    /// The batch new requests go into: the newest, or a new one when that one is full.
    fn open(&mut self) -> &mut Batch {
        if self.batches.back().is_none_or(|b| b.len() >= MAX_BATCH) {
            let batch = self.spare.take().unwrap_or_default();
            self.batches.push_back(batch);
        }
        // Just made sure there is one.
        let last = self.batches.len() - 1;
        &mut self.batches[last]
    }
}

/// The answer of an acquire ([`Batcher::acquire_owned`]): whether the lock was taken, with the
/// request back. A small future of its own: every locked job's future holds one.
#[derive(Debug)]
pub(crate) struct Acquiring(Asked);

/// Where an acquire's answer comes from.
enum Asked {
    /// Queued in a batch: its answer will be at `index` of the batch's answers.
    Queued {
        answers: Arc<Answers>,
        index: usize,
        /// The caller's place among the batch's waiters, once it has one.
        registered: Option<usize>,
    },
    /// Sent alone, the task being gone.
    Alone(std::pin::Pin<Box<dyn Future<Output = (Result<bool>, Acquire)> + Send>>),
}

impl std::fmt::Debug for Asked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Asked::Queued { index, .. } => write!(f, "Queued({index})"),
            Asked::Alone(_) => f.write_str("Alone"),
        }
    }
}

impl Future for Acquiring {
    type Output = (Result<bool>, Acquire);

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().0 {
            Asked::Queued {
                answers,
                index,
                registered,
            } => {
                let i = *index;
                answers
                    .poll_take(cx, registered, |a| {
                        a.acquired.get_mut(i).and_then(Option::take)
                    })
                    .map(|got| got.unwrap_or_else(|| (Err(task_gone()), Acquire::default())))
            }
            Asked::Alone(alone) => alone.as_mut().poll(cx),
        }
    }
}

/// The handle of a batch task; one per [`Locks`]. Dropping it ends the task once it has sent what was
/// queued.
#[derive(Debug)]
pub(crate) struct Batcher {
    /// The queue the task takes its batches from.
    queue: Arc<Mutex<Queue>>,
}

impl Batcher {
    /// Spawns the task on the current runtime, sending over `wire`. Outside a runtime nothing is
    /// spawned and every request goes straight to Redis.
    fn spawn(wire: Wire) -> Batcher {
        let queue = Arc::new(Mutex::new(Queue::default()));
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(run(Arc::clone(&queue), wire));
            }
            Err(_) => lock(&queue).closed = true,
        }
        Batcher { queue }
    }

    /// Queues `req` with `add` (which gives its index in the batch) and wakes the task; the batch's
    /// answers and that index, or `req` back (`add` not called) when the task is gone.
    fn enqueue<R>(
        &self,
        req: R,
        add: impl FnOnce(&mut Batch, R) -> usize,
    ) -> std::result::Result<(Arc<Answers>, usize), R> {
        let (answers, index, task) = {
            let mut q = lock(&self.queue);
            if q.closed {
                return Err(req);
            }
            let batch = q.open();
            let index = add(batch, req);
            let answers = Arc::clone(&batch.answers);
            (answers, index, q.task.take())
        };
        if let Some(task) = task {
            task.wake();
        }
        Ok((answers, index))
    }

    /// `SET key value NX PX ttl` in the next batch; true if the lock was free and is now ours.
    #[cfg(test)]
    pub(crate) async fn acquire(&self, conn: &Conn, req: Acquire) -> Result<bool> {
        self.acquire_owned(conn, req).await.0
    }

    /// [`Batcher::acquire`] that hands the request back with its answer (its key and value, which a
    /// guard keeps), so they are not copied.
    pub(crate) fn acquire_owned(&self, conn: &Conn, req: Acquire) -> Acquiring {
        let queued = self.enqueue(req, |b, req| {
            b.acquires.push(req);
            b.acquires.len() - 1
        });
        let req = match queued {
            Ok((answers, index)) => {
                return Acquiring(Asked::Queued {
                    answers,
                    index,
                    registered: None,
                });
            }
            Err(req) => req,
        };
        let mut conn = conn.clone();
        // Boxed, as every path a job's lock takes only once the task is gone: the futures of
        // redis-rs's commands would otherwise make every locked job's future larger.
        Acquiring(Asked::Alone(Box::pin(async move {
            let answer = match acquire_batch(&mut conn, std::slice::from_ref(&req)).await {
                Ok(mut one) => one.pop().unwrap_or(Ok(false)),
                Err(e) => Err(e),
            };
            (answer, req)
        })))
    }

    /// Deletes `key` in the next batch if it still holds `token`; true if it did.
    pub(crate) async fn release(&self, conn: &Conn, req: Release) -> Result<bool> {
        let queued = self.enqueue(req, |b, req| {
            b.releases.push(req);
            b.outcomes.push(Outcome::Caller);
            b.releases.len() - 1
        });
        let (answers, i) = match queued {
            Ok(queued) => queued,
            Err(req) => {
                // Boxed (see `acquire_owned`).
                let mut conn = conn.clone();
                let alone = Box::pin(release_batch(&mut conn, std::slice::from_ref(&req)));
                return Ok(alone.await? == [true]);
            }
        };
        answers
            .wait(|a| a.released.get_mut(i).and_then(Option::take))
            .await
            .unwrap_or_else(|| Err(task_gone()))
    }

    /// Queues the release for the next batch and returns without waiting for Redis; the batch task
    /// logs a failure (or a lock found expired or taken) with the key, in the caller's span. With the
    /// task gone, gives back the work of sending it alone and logging the same way, to await.
    pub(crate) fn release_detached(&self, conn: &Conn, req: Release) -> Option<Detached> {
        // The caller's span, taken before the queue's lock: the line about a failed release names
        // the job.
        let span = tracing::Span::current();
        let queued = self.enqueue((req, span), |b, (req, span)| {
            b.releases.push(req);
            b.outcomes.push(Outcome::Log(span));
            0
        });
        let Err((req, span)) = queued else {
            return None;
        };
        let mut conn = conn.clone();
        Some(Box::pin(async move {
            let r = release_batch(&mut conn, std::slice::from_ref(&req)).await;
            log_release(&span, &req.key, r.map(|v| v == [true]));
        }))
    }

    /// Waits until every request queued before this call has been sent and answered (or its failure
    /// logged); at once when the task is gone.
    pub(crate) async fn flush(&self) {
        let last = {
            let q = lock(&self.queue);
            if q.closed {
                return;
            }
            // Batches go out one after another: once the newest is answered, every older one is.
            match q.batches.back() {
                Some(b) => Some(Arc::clone(&b.answers)),
                None => q.in_flight.clone(),
            }
        };
        if let Some(answers) = last {
            answers.wait(|_| ()).await;
        }
    }
}

impl Drop for Batcher {
    fn drop(&mut self) {
        let task = {
            let mut q = lock(&self.queue);
            q.closed = true;
            q.task.take()
        };
        if let Some(task) = task {
            task.wake();
        }
    }
}

/// The job locks' batch task: built where the launcher wires the parts (one per process) and handed
/// down to each job's context, where the lock middleware take it
/// ([`RedisLock::batched`](crate::lock::RedisLock::batched)). The connection does not own it: a
/// connection knows nothing of locks. The task is spawned on first use, on the caller's runtime, and
/// ends once every clone of this handle is gone. A clone is one reference count: every job's context
/// gets one.
#[derive(Debug, Clone)]
pub(crate) struct Locks {
    inner: Arc<LocksInner>,
}

#[derive(Debug)]
struct LocksInner {
    /// The shared connection: the batch task's, without a dialer.
    conn: Conn,
    /// How the batch task connects on its own (a plain-text server), if it does.
    dialer: Option<Dialer>,
    /// The task's handle, once spawned.
    batcher: OnceLock<Batcher>,
}

impl Locks {
    /// A handle whose batch task sends over the shared connection `conn` (nothing is spawned yet).
    #[cfg(test)]
    pub(crate) fn new(conn: Conn) -> Locks {
        Self::dialing(conn, None)
    }

    /// A handle whose batch task sends over a connection of its own made by `dialer`
    /// (`redis_conn::resp`) when there is one, else over the shared connection `conn`.
    pub(crate) fn dialing(conn: Conn, dialer: Option<Dialer>) -> Locks {
        Locks {
            inner: Arc::new(LocksInner {
                conn,
                dialer,
                batcher: OnceLock::new(),
            }),
        }
    }

    /// The batch task, spawned on first use.
    pub(crate) fn batcher(&self) -> &Batcher {
        let inner = &*self.inner;
        inner.batcher.get_or_init(|| {
            Batcher::spawn(match &inner.dialer {
                Some(d) => Wire::own(d.clone()),
                None => Wire::Shared(inner.conn.clone()),
            })
        })
    }

    /// Waits until every job-lock release queued on the batch task has reached Redis (or its failure
    /// was logged); at once if no lock was ever taken through it. The launcher's stop calls it after
    /// the jobs have ended, so no released lock outlives the process.
    pub(crate) async fn flush(&self) {
        if let Some(batcher) = self.inner.batcher.get() {
            batcher.flush().await;
        }
    }
}

/// Closes the queue when the task ends, however it ends (its runtime shutting down drops it midway):
/// callers then send their commands themselves, and the batches left unsent fail (see [`Batch`]'s
/// `Drop`).
struct Closer(Arc<Mutex<Queue>>);

impl Drop for Closer {
    fn drop(&mut self) {
        let left = {
            let mut q = lock(&self.0);
            q.closed = true;
            q.in_flight = None;
            std::mem::take(&mut q.batches)
        };
        drop(left);
    }
}

/// The batch task: takes the oldest batch, sends it, answers its callers; ends once its handle is gone
/// and nothing is left to send. The queue is closed when the future is dropped, even before its first
/// poll (a runtime that shuts down first).
fn run(queue: Arc<Mutex<Queue>>, mut wire: Wire) -> impl Future<Output = ()> + Send + 'static {
    let closer = Closer(Arc::clone(&queue));
    async move {
        let _closer = closer;
        loop {
            let next = poll_fn(|cx: &mut Context<'_>| {
                let mut q = lock(&queue);
                if let Some(batch) = q.batches.pop_front() {
                    q.in_flight = Some(Arc::clone(&batch.answers));
                    return Poll::Ready(Some(batch));
                }
                if q.closed {
                    return Poll::Ready(None);
                }
                if !q.task.as_ref().is_some_and(|t| t.will_wake(cx.waker())) {
                    q.task = Some(cx.waker().clone());
                }
                Poll::Pending
            })
            .await;
            let Some(mut batch) = next else {
                return;
            };
            batch.send(&mut wire).await;
            let mut q = lock(&queue);
            q.in_flight = None;
            q.spare = Some(batch.emptied());
        }
    }
}

/// How a batch reaches Redis.
#[derive(Debug)]
enum Wire {
    /// The shared connection, through redis-rs (TLS, Sentinel).
    Shared(Conn),
    /// A connection of the task's own (`redis_conn::resp`).
    Own(Box<OwnWire>),
}

/// The batch task's own connection, made by `dialer` on first use and after a failure.
#[derive(Debug)]
struct OwnWire {
    dialer: Dialer,
    conn: Option<RespConn>,
    /// The batch's commands as RESP, kept between batches for its capacity.
    buf: Vec<u8>,
    /// The last TTL argument written.
    ttl: TtlArg,
}

impl Wire {
    fn own(dialer: Dialer) -> Wire {
        Wire::Own(Box::new(OwnWire {
            dialer,
            conn: None,
            buf: Vec::with_capacity(4096),
            ttl: TtlArg::default(),
        }))
    }

    /// One round trip: the releases (one `EVALSHA`, or `EVAL` with the body when `by_sha` is false),
    /// then one `SET NX PX` per acquire; one reply per command, in order.
    async fn query<'a>(
        &mut self,
        releases: &[Release],
        by_sha: bool,
        acquires: impl ExactSizeIterator<Item = &'a Acquire>,
    ) -> Result<Vec<Value>> {
        match self {
            Wire::Shared(conn) => {
                let mut pipe = redis::pipe();
                pipe.ignore_errors();
                if !releases.is_empty() {
                    pipe.add_command(release_cmd(releases, by_sha));
                }
                add_sets(&mut pipe, acquires);
                Ok(pipe.query_async(conn).await?)
            }
            Wire::Own(own) => {
                let OwnWire {
                    dialer,
                    conn,
                    buf,
                    ttl,
                } = &mut **own;
                buf.clear();
                let replies = usize::from(!releases.is_empty()) + acquires.len();
                if !releases.is_empty() {
                    write_release(buf, releases, by_sha);
                }
                for a in acquires {
                    write_set(buf, a, ttl);
                }
                if replies == 0 {
                    return Ok(Vec::new());
                }
                // A connection the server closed while it sat idle is replaced before anything is
                // written on it: the batch then fails only when Redis cannot be reached.
                let mut c = match conn.take() {
                    Some(c) if c.is_open() => c,
                    _ => dialer.connect().await?,
                };
                let got = c.exchange(buf, replies).await;
                // After a failure, whatever was on the wire must not be read as the next batch's
                // replies: the connection is dropped.
                if got.is_ok() {
                    *conn = Some(c);
                }
                got
            }
        }
    }
}

/// The compare-and-delete of `reqs` as RESP: `EVALSHA` (`by_sha`) or `EVAL` with the body.
fn write_release(out: &mut Vec<u8>, reqs: &[Release], by_sha: bool) {
    let data: usize = reqs.iter().map(|r| r.key.len() + r.token.len() + 16).sum();
    out.reserve(data + RELEASE_MANY_SCRIPT.len() + 64);
    resp::command(out, 3 + 2 * reqs.len());
    if by_sha {
        resp::arg(out, b"EVALSHA");
        resp::arg(out, RELEASE_MANY_SHA.as_bytes());
    } else {
        resp::arg(out, b"EVAL");
        resp::arg(out, RELEASE_MANY_SCRIPT.as_bytes());
    }
    resp::arg_u64(out, reqs.len() as u64);
    for r in reqs {
        resp::arg(out, r.key.as_bytes());
    }
    for r in reqs {
        resp::arg(out, r.token.as_bytes());
    }
}

/// `SET <key> <value> NX PX <ttl>` as RESP; `ttl` keeps the last TTL argument written (the acquires
/// of a batch mostly share one).
fn write_set(out: &mut Vec<u8>, r: &Acquire, ttl: &mut TtlArg) {
    let ms = r.ttl_ms.max(1);
    if ttl.ms != Some(ms) {
        ttl.bytes.clear();
        resp::arg_u64(&mut ttl.bytes, ms);
        ttl.ms = Some(ms);
    }
    out.reserve(32 + r.key.len() + r.value.len() + ttl.bytes.len());
    out.extend_from_slice(b"*6\r\n$3\r\nSET\r\n");
    resp::arg(out, r.key.as_bytes());
    resp::arg(out, r.value.as_bytes());
    out.extend_from_slice(b"$2\r\nNX\r\n$2\r\nPX\r\n");
    out.extend_from_slice(&ttl.bytes);
}

/// A TTL as a RESP argument, kept from one `SET` to the next.
#[derive(Debug, Default)]
struct TtlArg {
    /// The TTL it holds, in ms.
    ms: Option<u64>,
    /// `$<len>\r\n<digits>\r\n`.
    bytes: Vec<u8>,
}

/// The error of a caller whose batch task went away before answering (its runtime shutting down): the
/// command may or may not have run.
fn task_gone() -> Error {
    Error::Redis(redis::RedisError::from((
        ErrorKind::Io,
        "the lock batch task ended before answering",
    )))
}

/// The log line of a detached release, as [`crate::lock::LockGuard::release_logged`] writes it.
pub(crate) fn log_release(span: &tracing::Span, key: &str, r: Result<bool>) {
    // The span is entered only for a line to write: a clean release (nearly all) writes none.
    match r {
        Ok(true) => {}
        Ok(false) => {
            let _in_job = span.enter();
            tracing::warn!(lock = %key, "lock had expired or changed hands before release")
        }
        Err(e) => {
            let _in_job = span.enter();
            tracing::warn!(lock = %key, error = %e, "cannot release lock; it expires by its ttl")
        }
    }
}

/// `answers` when Redis gave one per request, else an error.
fn same_count<T>(answers: Vec<T>, requests: usize) -> Result<Vec<T>> {
    if answers.len() == requests {
        return Ok(answers);
    }
    Err(count_error(answers.len(), requests))
}

/// Redis answered `got` replies to `requests` commands.
fn count_error(got: usize, requests: usize) -> Error {
    Error::Redis(redis::RedisError::from((
        ErrorKind::Parse,
        "lock batch: Redis answered a different number of replies",
        format!("{got} for {requests} requests"),
    )))
}

/// A copy of a batch's error for each of its callers.
fn copy_error(e: &Error) -> Error {
    match e {
        Error::Redis(r) => Error::Redis(r.clone()),
        other => Error::Redis(redis::RedisError::from((
            ErrorKind::Io,
            "lock batch failed",
            other.to_string(),
        ))),
    }
}

/// The compare-and-delete of `reqs` with `EVALSHA` (`by_sha`) or `EVAL` with the body.
fn release_cmd(reqs: &[Release], by_sha: bool) -> redis::Cmd {
    // Sized up front, as `add_sets` does: one buffer for every key and token of the batch.
    let data: usize = reqs.iter().map(|r| r.key.len() + r.token.len()).sum();
    let mut c = redis::Cmd::with_capacity(3 + 2 * reqs.len(), data + 64);
    if by_sha {
        c.arg("EVALSHA").arg(RELEASE_MANY_SHA.as_str());
    } else {
        c.arg("EVAL").arg(RELEASE_MANY_SCRIPT);
    }
    c.arg(reqs.len());
    for r in reqs {
        c.arg(&r.key);
    }
    for r in reqs {
        c.arg(&r.token);
    }
    c
}

/// Adds one `SET <key> <value> NX PX <ttl>` per request to `pipe`.
fn add_sets<'a>(pipe: &mut redis::Pipeline, reqs: impl IntoIterator<Item = &'a Acquire>) {
    for r in reqs {
        // Sized up front (a TTL has at most 20 digits): a `Cmd` grown one argument at a time
        // reallocates its buffers several times.
        let mut set = redis::Cmd::with_capacity(6, 3 + r.key.len() + r.value.len() + 4 + 20);
        set.arg("SET")
            .arg(&r.key)
            .arg(&r.value)
            .arg("NX")
            .arg("PX")
            .arg(r.ttl_ms.max(1));
        pipe.add_command(set);
    }
}

/// The script's answer, per key: true where it deleted the key.
fn parse_released(v: Value, n: usize) -> Result<Vec<bool>> {
    match v.extract_error()? {
        // Every key deleted.
        Value::Int(k) if usize::try_from(k).ok() == Some(n) => Ok(vec![true; n]),
        Value::BulkString(b) => Ok(b.iter().map(|&c| c == b'1').collect()),
        Value::SimpleString(s) => Ok(s.bytes().map(|c| c == b'1').collect()),
        other => Err(Error::Redis(redis::RedisError::from((
            ErrorKind::Parse,
            "lock batch: unexpected release reply",
            format!("{other:?}"),
        )))),
    }
}

/// One `SET NX` reply: true where the key was set.
fn parse_set(v: Value) -> Result<bool> {
    Ok(!matches!(v.extract_error()?, Value::Nil))
}

/// Each acquire's answer from its own `SET` reply: a refused `SET` fails only its own acquire.
fn parse_sets(replies: impl Iterator<Item = Value>) -> Vec<Result<bool>> {
    replies.map(parse_set).collect()
}

/// The acquires' answers: each its own, or one error for all when the pipeline itself failed.
type Acquired = Result<Vec<Result<bool>>>;

/// One round trip for a batch: the releases (`EVALSHA`, when there are any), then the acquires (`SET
/// NX PX` each). Returns the releases' answers and the acquires' answers.
///
/// On `NOSCRIPT` the releases go again with `EVAL` (which also caches the script), then the acquires
/// that found their key taken are tried once more: one of them may have met a lock this very batch
/// was releasing, and a release queued before an acquire must come first.
async fn exchange(
    wire: &mut Wire,
    releases: &[Release],
    acquires: &[Acquire],
) -> (Result<Vec<bool>>, Acquired) {
    let replies = match wire.query(releases, true, acquires.iter()).await {
        Ok(r) => r,
        Err(e) => return (Err(copy_error(&e)), Err(e)),
    };
    let mut replies = replies.into_iter();
    let Some(first) = (!releases.is_empty()).then(|| replies.next()).flatten() else {
        return (Ok(Vec::new()), Ok(parse_sets(replies)));
    };
    let acquired = parse_sets(replies);
    match first {
        Value::ServerError(e) if e.kind() == Some(redis::ServerErrorKind::NoScript) => {
            let released = release_by_eval(wire, releases).await;
            (released, Ok(retry_taken(wire, acquires, acquired).await))
        }
        first => (parse_released(first, releases.len()), Ok(acquired)),
    }
}

/// The releases again with `EVAL` after `NOSCRIPT`.
async fn release_by_eval(wire: &mut Wire, releases: &[Release]) -> Result<Vec<bool>> {
    let replies = wire.query(releases, false, std::iter::empty()).await?;
    let n = replies.len();
    match <[Value; 1]>::try_from(replies) {
        Ok([one]) => parse_released(one, releases.len()),
        Err(_) => Err(count_error(n, 1)),
    }
}

/// The acquires of a batch whose releases went after them (`NOSCRIPT`): those that found their key
/// taken try once more (if that round trip fails, each of them gets its error).
async fn retry_taken(
    wire: &mut Wire,
    acquires: &[Acquire],
    mut got: Vec<Result<bool>>,
) -> Vec<Result<bool>> {
    let again: Vec<usize> = (0..got.len())
        .filter(|&i| matches!(got[i], Ok(false)))
        .collect();
    if again.is_empty() {
        return got;
    }
    let retried = wire
        .query(&[], true, again.iter().map(|&i| &acquires[i]))
        .await;
    match retried.and_then(|replies| same_count(replies, again.len())) {
        Ok(replies) => {
            for (i, r) in again.into_iter().zip(parse_sets(replies.into_iter())) {
                got[i] = r;
            }
        }
        Err(e) => {
            for i in again {
                got[i] = Err(copy_error(&e));
            }
        }
    }
    got
}

/// One round trip of `SET <key> <value> NX PX <ttl>` over the shared connection, one per request, in
/// order; true where the key was set, each with its own error where Redis refused it.
pub(crate) async fn acquire_batch(conn: &mut Conn, reqs: &[Acquire]) -> Acquired {
    exchange(&mut Wire::Shared(conn.clone()), &[], reqs).await.1
}

/// One compare-and-delete of every request's key over the shared connection ([`RELEASE_MANY_SCRIPT`],
/// `EVALSHA`, `EVAL` on `NOSCRIPT`); true where the key held the token and was deleted.
pub(crate) async fn release_batch(conn: &mut Conn, reqs: &[Release]) -> Result<Vec<bool>> {
    exchange(&mut Wire::Shared(conn.clone()), reqs, &[]).await.0
}

/// The acquire request of a lock with this TTL.
#[cfg(test)]
pub(crate) fn acquire_req(key: &str, value: &str, ttl: std::time::Duration) -> Acquire {
    Acquire {
        key: key.to_string(),
        value: value.to_string(),
        ttl_ms: crate::time::ttl_ms(ttl),
    }
}

#[cfg(test)]
mod tests_batch;
