//! Job locks taken and released in batches: the `SET NX PX` of every job that starts while a batch is
//! on the wire go out together, after one `EVALSHA` that compare-and-deletes the locks of every job
//! that ended meanwhile, all in one pipeline.
//!
//! # Why
//!
//! Measured on the lock benchmark (issue 15: `UniqueNoopJob`, 20 000 jobs at `-c 200`, callgrind):
//! a locked no-op job cost 51 900 instructions against 20 600 without a lock. Most of the difference
//! was the two commands themselves, one at a time on the shared connection: redis-rs's per-command
//! path (a channel hop to the connection's driver task, a response-timeout timer, a reply parsed into
//! a `Value`) about 19 000 instructions a job, and in Redis one read, one command and one write per
//! request (7 µs of Redis CPU a job against 2). Batched, what was left was latency: a job waited one
//! batch round trip for its acquire and as long again for its release, and its slot was idle meanwhile.
//!
//! # How
//!
//! A [`Batcher`] is one task per [`Locks`] handle (spawned on first use; the launcher builds one over the
//! process's shared connection) fed by one FIFO queue. It waits for a request, takes
//! every other request already queued (up to [`MAX_BATCH`]), and sends them as one pipeline: the
//! releases first, as one `EVALSHA` of [`RELEASE_MANY_SCRIPT`], then one `SET NX PX` per acquire.
//! Batches come from concurrency only, never from a delay: a lone request is sent as soon as the task
//! runs, and requests that arrive while a batch is on the wire go out together after it.
//!
//! **A release is not waited for** ([`Batcher::release_detached`], what the job middleware use): the
//! job's work is over, so its slot goes on to the next job while the release is queued; the batch task
//! logs its outcome (in the job's span, so the line names the job) when the reply comes. Two things keep
//! that from being seen:
//! - Order. One queue and one pipeline, releases before acquires: an acquire queued after a release in
//!   this process is sent after it, so a job that follows its duplicate on one slot (or anywhere in the
//!   process) never finds that duplicate's lock still held. A waiting [`RedisLock::lock`] sees a
//!   release within one batch round trip.
//! - A stop. [`Batcher::flush`] (called by the launcher after the jobs have ended, before the process
//!   leaves) waits until every release queued before it has had its reply: a graceful stop leaves no
//!   lock behind to make a later duplicate be skipped until its TTL.
//!
//! The wire contract is the one of [`crate::lock`]: acquire is `SET oxidekiq:lock:<key> <token>:<jid>
//! NX PX <ttl>`, so a pipeline of them behaves exactly as the same commands sent one by one (two
//! acquires of one key in a batch: the first wins). A release deletes a key only while it holds the
//! holder's token.
//!
//! # Failures
//!
//! A batch that fails (connection lost, a Redis error in the script) answers **every** caller in its
//! group with that error: nobody is told "released" or "acquired" without Redis's own answer. A `SET`
//! refused by Redis (a TTL it cannot take, OOM) fails that acquire alone: the others of its pipeline
//! get their own replies, so one class's bad option cannot fail every locked job beside it. A job whose acquire fails fails as before; a
//! release that fails is logged with its key, and the key expires by its TTL. On `NOSCRIPT` (Redis
//! restarted, `SCRIPT FLUSH`) the releases are sent again with `EVAL`, then the acquires that found
//! their key taken are tried once more, so the order above holds there too. When the batch task is
//! gone (its runtime shut down while a `Conn` lives on), callers send their command directly.
//!
//! [`RedisLock::lock`]: crate::lock::RedisLock::lock

use std::sync::{Arc, OnceLock};

use redis::{ErrorKind, Value};
use tokio::sync::{mpsc, oneshot};

use crate::error::{Error, Result};
use crate::lua::script_sha1;
use crate::redis_conn::Conn;

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

/// The most requests one batch carries: bounds a pipeline's and a script call's size (and the Lua
/// `unpack` of the script's keys, far below its stack limit).
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

/// Where the answer of one request goes.
type Answer = oneshot::Sender<Result<bool>>;

/// Where an acquire's answer goes, with the request itself: its key and value go back to the caller,
/// who keeps them in the guard, instead of being copied for the batch (once per locked job).
type AcquireAnswer = oneshot::Sender<(Result<bool>, Acquire)>;

/// Who learns how a release went: its caller, or the log (in the span of the job that released).
#[derive(Debug)]
enum Outcome {
    /// A caller waiting for the answer.
    Caller(Answer),
    /// Nobody waits: the batch task logs a failure or a lock found gone, in this span.
    Log(tracing::Span),
}

/// One queued request.
#[derive(Debug)]
enum Request {
    Acquire(Acquire, AcquireAnswer),
    Release(Release, Outcome),
    /// Answered once every request queued before it has had its reply.
    Flush(oneshot::Sender<()>),
}

/// The handle of a batch task; cheap to keep, one per [`Locks`].
#[derive(Debug)]
pub(crate) struct Batcher {
    /// The task's queue, in the order requests were made.
    queue: mpsc::UnboundedSender<Request>,
}

impl Batcher {
    /// Spawns the task on the current runtime with its own clone of `conn`. Outside a runtime nothing
    /// is spawned and every request goes straight to Redis. The task ends when the batcher is dropped
    /// (its queue closes), after answering what was queued.
    pub(crate) fn spawn(conn: Conn) -> Batcher {
        let (queue, rx) = mpsc::unbounded_channel();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(run(conn, rx));
        }
        Batcher { queue }
    }

    /// `SET key value NX PX ttl` in the next batch; true if the lock was free and is now ours.
    #[cfg(test)]
    pub(crate) async fn acquire(&self, conn: &Conn, req: Acquire) -> Result<bool> {
        self.acquire_owned(conn, req).await.0
    }

    /// [`Batcher::acquire`] that hands the request back with its answer (its key and value, which a
    /// guard keeps), so they are not copied; if the task went away before answering, the request is
    /// lost with it and an empty one comes back beside the error.
    pub(crate) async fn acquire_owned(&self, conn: &Conn, req: Acquire) -> (Result<bool>, Acquire) {
        let (tx, rx) = oneshot::channel();
        match self.queue.send(Request::Acquire(req, tx)) {
            Ok(()) => rx
                .await
                .unwrap_or_else(|_| (Err(task_gone()), Acquire::default())),
            Err(mpsc::error::SendError(Request::Acquire(req, _))) => {
                let got = acquire_batch(&mut conn.clone(), std::slice::from_ref(&req)).await;
                let answer = match got {
                    Ok(mut one) => one.pop().unwrap_or(Ok(false)),
                    Err(e) => Err(e),
                };
                (answer, req)
            }
            // Only an acquire was sent.
            Err(mpsc::error::SendError(_)) => (Err(task_gone()), Acquire::default()),
        }
    }

    /// Deletes `key` in the next batch if it still holds `token`; true if it did.
    pub(crate) async fn release(&self, conn: &Conn, req: Release) -> Result<bool> {
        let (tx, rx) = oneshot::channel();
        match self.queue.send(Request::Release(req, Outcome::Caller(tx))) {
            Ok(()) => answer(rx).await,
            Err(mpsc::error::SendError(req)) => alone(conn, req).await,
        }
    }

    /// Queues the release for the next batch and returns without waiting for Redis; the batch task
    /// logs a failure (or a lock found expired or taken) with the key, in the caller's span. With the
    /// task gone, sends it alone and logs the same way.
    pub(crate) async fn release_detached(&self, conn: &Conn, req: Release) {
        let sent = self.queue.send(Request::Release(
            req,
            Outcome::Log(tracing::Span::current()),
        ));
        if let Err(mpsc::error::SendError(Request::Release(req, Outcome::Log(span)))) = sent {
            let r = release_batch(&mut conn.clone(), std::slice::from_ref(&req)).await;
            log_release(&span, &req.key, r.map(|v| v == [true]));
        }
    }

    /// Waits until every request queued before this call has been sent and answered (or its failure
    /// logged); at once when the task is gone.
    pub(crate) async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.queue.send(Request::Flush(tx)).is_ok() {
            // An error means the task ended: nothing of it is left to wait for.
            let _ = rx.await;
        }
    }
}

/// The job locks' batch task: built where the launcher wires the parts (one per process, over its
/// shared connection) and handed down to each job's context, where the lock middleware take it
/// ([`RedisLock::batched`](crate::lock::RedisLock::batched)). The connection does not own it: a
/// connection knows nothing of locks. The task is spawned on first use, on the caller's runtime, and
/// ends once every clone of this handle is gone (its own connection holds none).
#[derive(Debug, Clone)]
pub(crate) struct Locks {
    /// The connection the batch task sends over.
    conn: Conn,
    /// The task's handle, once spawned.
    batcher: Arc<OnceLock<Batcher>>,
}

impl Locks {
    /// A handle whose batch task sends over `conn` (nothing is spawned yet).
    pub(crate) fn new(conn: Conn) -> Locks {
        Locks {
            conn,
            batcher: Arc::default(),
        }
    }

    /// The batch task, spawned on first use.
    pub(crate) fn batcher(&self) -> &Batcher {
        self.batcher
            .get_or_init(|| Batcher::spawn(self.conn.clone()))
    }

    /// Waits until every job-lock release queued on the batch task has reached Redis (or its failure
    /// was logged); at once if no lock was ever taken through it. The launcher's stop calls it after
    /// the jobs have ended, so no released lock outlives the process.
    pub(crate) async fn flush(&self) {
        if let Some(batcher) = self.batcher.get() {
            batcher.flush().await;
        }
    }
}

/// A release sent alone, its batch task gone (its runtime shut down); a flush has nothing to wait for.
async fn alone(conn: &Conn, req: Request) -> Result<bool> {
    let mut conn = conn.clone();
    match req {
        // Sent alone by `Batcher::acquire_owned`, which keeps the request.
        Request::Acquire(..) | Request::Flush(_) => Ok(true),
        Request::Release(r, _) => {
            Ok(release_batch(&mut conn, std::slice::from_ref(&r)).await? == [true])
        }
    }
}

/// The error of a caller whose batch task went away before answering (its runtime shutting down): the
/// command may or may not have run.
fn task_gone() -> Error {
    Error::Redis(redis::RedisError::from((
        ErrorKind::Io,
        "the lock batch task ended before answering",
    )))
}

/// A batch task's answer ([`task_gone`] if it went away first).
async fn answer(rx: oneshot::Receiver<Result<bool>>) -> Result<bool> {
    rx.await.unwrap_or_else(|_| Err(task_gone()))
}

/// What one batch carries, split by kind; kept between batches for its capacity.
#[derive(Debug, Default)]
struct Batch {
    releases: Vec<Release>,
    outcomes: Vec<Outcome>,
    acquires: Vec<Acquire>,
    answers: Vec<AcquireAnswer>,
    flushes: Vec<oneshot::Sender<()>>,
}

impl Batch {
    fn push(&mut self, req: Request) {
        match req {
            Request::Acquire(a, tx) => {
                self.acquires.push(a);
                self.answers.push(tx);
            }
            Request::Release(r, o) => {
                self.releases.push(r);
                self.outcomes.push(o);
            }
            Request::Flush(tx) => self.flushes.push(tx),
        }
    }

    /// Requests that go to Redis (a flush does not).
    fn len(&self) -> usize {
        self.releases.len() + self.acquires.len()
    }

    /// Sends the batch, answers every caller, logs every detached release that failed, then answers
    /// the flushes; leaves the batch empty.
    async fn send(&mut self, conn: &mut Conn) {
        if self.len() > 0 {
            let (released, acquired) = exchange(conn, &self.releases, &self.acquires).await;
            settle_releases(&self.releases, &mut self.outcomes, released);
            answer_all(&mut self.answers, &mut self.acquires, acquired);
            self.releases.clear();
        }
        for tx in self.flushes.drain(..) {
            let _ = tx.send(());
        }
    }
}

/// The batch task: gathers whatever is queued, sends it, answers each caller; ends when every sender
/// is gone.
async fn run(mut conn: Conn, mut rx: mpsc::UnboundedReceiver<Request>) {
    let mut batch = Batch::default();
    while let Some(req) = rx.recv().await {
        batch.push(req);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(req) => batch.push(req),
                Err(_) => break,
            }
        }
        batch.send(&mut conn).await;
    }
}

/// Each release's outcome to its caller, or to the log in its job's span: a failure (the key expires
/// by its TTL) or a lock that had expired or changed hands.
fn settle_releases(reqs: &[Release], outcomes: &mut Vec<Outcome>, r: Result<Vec<bool>>) {
    let r = r.and_then(|v| same_count(v, outcomes.len()));
    for (i, (req, outcome)) in reqs.iter().zip(outcomes.drain(..)).enumerate() {
        let this = match &r {
            Ok(v) => Ok(v[i]),
            Err(e) => Err(copy_error(e)),
        };
        match outcome {
            // A caller that stopped waiting (its job was cancelled) needs no answer.
            Outcome::Caller(tx) => {
                let _ = tx.send(this);
            }
            Outcome::Log(span) => log_release(&span, &req.key, this),
        }
    }
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

/// Answers each caller of a batch with its own reply, or every caller with the batch's error, and
/// hands each its request back; leaves both lists empty.
fn answer_all(replies: &mut Vec<AcquireAnswer>, reqs: &mut Vec<Acquire>, r: Acquired) {
    let reqs = reqs.drain(..);
    match r.and_then(|v| same_count(v, replies.len())) {
        Ok(answers) => {
            for ((reply, this), req) in replies.drain(..).zip(answers).zip(reqs) {
                // A caller that stopped waiting (its job was cancelled) needs no answer.
                let _ = reply.send((this, req));
            }
        }
        Err(e) => {
            for (reply, req) in replies.drain(..).zip(reqs) {
                let _ = reply.send((Err(copy_error(&e)), req));
            }
        }
    }
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
        // reallocates its buffers several times, for every locked job.
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
/// NX PX` each), in one pipeline. Returns the releases' answers and the acquires' answers.
///
/// On `NOSCRIPT` the releases go again with `EVAL` (which also caches the script), then the acquires
/// that found their key taken are tried once more: one of them may have met a lock this very batch
/// was releasing, and a release queued before an acquire must come first.
pub(crate) async fn exchange(
    conn: &mut Conn,
    releases: &[Release],
    acquires: &[Acquire],
) -> (Result<Vec<bool>>, Acquired) {
    let mut pipe = redis::pipe();
    pipe.ignore_errors();
    if !releases.is_empty() {
        pipe.add_command(release_cmd(releases, true));
    }
    add_sets(&mut pipe, acquires);
    let replies: Vec<Value> = match pipe.query_async(conn).await {
        Ok(r) => r,
        Err(e) => {
            let e = Error::from(e);
            return (Err(copy_error(&e)), Err(e));
        }
    };
    let mut replies = replies.into_iter();
    let Some(first) = (!releases.is_empty()).then(|| replies.next()).flatten() else {
        return (Ok(Vec::new()), Ok(parse_sets(replies)));
    };
    let acquired = parse_sets(replies);
    match first {
        Value::ServerError(e) if e.kind() == Some(redis::ServerErrorKind::NoScript) => {
            let released = release_by_eval(conn, releases).await;
            (released, Ok(retry_taken(conn, acquires, acquired).await))
        }
        first => (parse_released(first, releases.len()), Ok(acquired)),
    }
}

/// The releases again with `EVAL` after `NOSCRIPT`.
async fn release_by_eval(conn: &mut Conn, releases: &[Release]) -> Result<Vec<bool>> {
    let v: Value = release_cmd(releases, false).query_async(conn).await?;
    parse_released(v, releases.len())
}

/// The acquires of a batch whose releases went after them (`NOSCRIPT`): those that found their key
/// taken try once more (if that pipeline fails, each of them gets its error).
async fn retry_taken(
    conn: &mut Conn,
    acquires: &[Acquire],
    mut got: Vec<Result<bool>>,
) -> Vec<Result<bool>> {
    let again: Vec<usize> = (0..got.len())
        .filter(|&i| matches!(got[i], Ok(false)))
        .collect();
    if again.is_empty() {
        return got;
    }
    let mut pipe = redis::pipe();
    pipe.ignore_errors();
    add_sets(&mut pipe, again.iter().map(|&i| &acquires[i]));
    match pipe.query_async::<Vec<Value>>(conn).await {
        Ok(replies) if replies.len() == again.len() => {
            for (i, r) in again.into_iter().zip(parse_sets(replies.into_iter())) {
                got[i] = r;
            }
        }
        Ok(replies) => {
            let e = count_error(replies.len(), again.len());
            for i in again {
                got[i] = Err(copy_error(&e));
            }
        }
        Err(e) => {
            let e = Error::from(e);
            for i in again {
                got[i] = Err(copy_error(&e));
            }
        }
    }
    got
}

/// One pipeline of `SET <key> <value> NX PX <ttl>`, one per request, in order; true where the key
/// was set, each with its own error where Redis refused it.
pub(crate) async fn acquire_batch(conn: &mut Conn, reqs: &[Acquire]) -> Acquired {
    exchange(conn, &[], reqs).await.1
}

/// One compare-and-delete of every request's key ([`RELEASE_MANY_SCRIPT`], `EVALSHA`, `EVAL` on
/// `NOSCRIPT`); true where the key held the token and was deleted.
pub(crate) async fn release_batch(conn: &mut Conn, reqs: &[Release]) -> Result<Vec<bool>> {
    exchange(conn, reqs, &[]).await.0
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
