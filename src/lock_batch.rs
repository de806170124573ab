//! Job locks taken and released in batches: the `SET NX PX` of every job that starts while a batch is
//! on the wire go out together as one pipeline, and the releases of every job that ends meanwhile go
//! out as one `EVALSHA` of a script that compare-and-deletes each key.
//!
//! # Why
//!
//! Measured on the lock benchmark (issue 15: `UniqueNoopJob`, 20 000 jobs at `-c 200`, callgrind):
//! a locked no-op job cost 51 900 instructions against 20 600 without a lock. Most of the difference
//! was the two commands themselves, one at a time on the shared connection: redis-rs's per-command
//! path (a channel hop to the connection's driver task, a response-timeout timer, a reply parsed into
//! a `Value`) about 19 000 instructions a job, and in Redis one read, one command and one write per
//! request (7 µs of Redis CPU a job against 2).
//!
//! # How
//!
//! A [`Batcher`] is one task per connection for acquires and one for releases (spawned on first use,
//! [`crate::redis_conn::Conn::lock_batcher`]). Each waits for a request, takes every other request
//! already queued (up to [`MAX_BATCH`]), sends them as one round trip and answers each caller through
//! its own oneshot. Batches come from concurrency only, never from a delay: a lone request is sent as
//! soon as the task runs, and requests that arrive while a batch is on the wire wait for that one round
//! trip, then go out together.
//!
//! The wire contract is the one of [`crate::lock`]: acquire is `SET oxidekiq:lock:<key> <token>:<jid>
//! NX PX <ttl>`, so a pipeline of them behaves exactly as the same commands sent one by one (two
//! acquires of one key in a batch: the first wins). Release compares each key's value with its holder's
//! token in Lua ([`RELEASE_MANY_SCRIPT`], `EVALSHA`, `EVAL` on `NOSCRIPT`), key by key in order.
//!
//! # Failures
//!
//! A batch that fails (connection lost, a Redis error anywhere in the pipeline or halfway through the
//! script) answers **every** caller in it with that error: a release whose script stopped halfway may
//! have deleted some keys, but nobody is told "released" without the script's own answer. A job whose
//! acquire fails fails as before; a release that fails is logged and the key expires by its TTL.
//! When the batch task is gone (its runtime shut down while a `Conn` lives on), callers send their
//! command directly, one at a time.

use std::time::Duration;

use redis::{ErrorKind, ServerErrorKind};
use tokio::sync::{mpsc, oneshot};

use crate::error::{Error, Result};
use crate::lock::{script_sha1, ttl_ms};
use crate::redis_conn::Conn;

/// Deletes each `KEYS[i]` that holds the token `ARGV[i]`; returns, per key, 1 if it deleted it, else
/// 0. [`crate::lock::RELEASE_SCRIPT`] for many keys, checked in order.
pub(crate) const RELEASE_MANY_SCRIPT: &str = "local out = {} \
     for i = 1, #KEYS do \
     if redis.call('GET', KEYS[i]) == ARGV[i] then out[i] = redis.call('DEL', KEYS[i]) \
     else out[i] = 0 end \
     end \
     return out";

static RELEASE_MANY_SHA: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| script_sha1(RELEASE_MANY_SCRIPT));

/// The most requests one batch carries: bounds a pipeline's and a script call's size.
pub(crate) const MAX_BATCH: usize = 512;

/// One `SET <key> <value> NX PX <ttl>`.
#[derive(Debug)]
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

/// A request and where its answer goes.
type Pending<R> = (R, oneshot::Sender<Result<bool>>);

/// The handles of a connection's two batch tasks; cheap to keep, one per [`Conn`].
#[derive(Debug)]
pub(crate) struct Batcher {
    /// Acquires for the acquire task.
    acquire: mpsc::UnboundedSender<Pending<Acquire>>,
    /// Releases for the release task.
    release: mpsc::UnboundedSender<Pending<Release>>,
}

impl Batcher {
    /// Spawns the two tasks on the current runtime, each with its own clone of `conn`. Outside a
    /// runtime nothing is spawned and every request goes straight to Redis. The tasks end when the
    /// batcher is dropped (their queue closes).
    pub(crate) fn spawn(conn: Conn) -> Batcher {
        let (acquire, acquire_rx) = mpsc::unbounded_channel();
        let (release, release_rx) = mpsc::unbounded_channel();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(run(conn.clone(), acquire_rx, acquire_batch));
            rt.spawn(run(conn, release_rx, release_batch));
        }
        Batcher { acquire, release }
    }

    /// `SET key value NX PX ttl` in the next batch; true if the lock was free and is now ours.
    pub(crate) async fn acquire(&self, conn: &Conn, req: Acquire) -> Result<bool> {
        submit(&self.acquire, conn, req, acquire_batch).await
    }

    /// Deletes `key` in the next batch if it still holds `token`; true if it did.
    pub(crate) async fn release(&self, conn: &Conn, req: Release) -> Result<bool> {
        submit(&self.release, conn, req, release_batch).await
    }
}

/// Queues `req` for its batch task and waits for the answer; with the task gone, runs it alone.
async fn submit<R, F>(
    queue: &mpsc::UnboundedSender<Pending<R>>,
    conn: &Conn,
    req: R,
    exec: F,
) -> Result<bool>
where
    F: for<'a> AsyncBatch<'a, R>,
{
    let (tx, rx) = oneshot::channel();
    match queue.send((req, tx)) {
        Ok(()) => answer(rx).await,
        Err(mpsc::error::SendError((req, _))) => {
            let mut conn = conn.clone();
            Ok(exec.call(&mut conn, std::slice::from_ref(&req)).await? == [true])
        }
    }
}

/// A batch task's answer; a task that went away before answering (its runtime shutting down) is an
/// error: the command may or may not have run.
async fn answer(rx: oneshot::Receiver<Result<bool>>) -> Result<bool> {
    rx.await.unwrap_or_else(|_| {
        Err(Error::Redis(redis::RedisError::from((
            ErrorKind::Io,
            "the lock batch task ended before answering",
        ))))
    })
}

/// A batch task: gathers whatever is queued, sends it with `exec`, answers each caller; ends when every
/// sender is gone.
async fn run<R, F>(mut conn: Conn, mut rx: mpsc::UnboundedReceiver<Pending<R>>, exec: F)
where
    R: Send + 'static,
    F: for<'a> AsyncBatch<'a, R>,
{
    let mut reqs: Vec<R> = Vec::with_capacity(64);
    let mut replies: Vec<oneshot::Sender<Result<bool>>> = Vec::with_capacity(64);
    while let Some((req, reply)) = rx.recv().await {
        reqs.push(req);
        replies.push(reply);
        while reqs.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok((req, reply)) => {
                    reqs.push(req);
                    replies.push(reply);
                }
                Err(_) => break,
            }
        }
        let answers = exec.call(&mut conn, &reqs).await;
        answer_all(&mut replies, answers);
        reqs.clear();
    }
}

/// Answers each caller of a batch with its own reply, or every caller with the batch's error.
fn answer_all(replies: &mut Vec<oneshot::Sender<Result<bool>>>, r: Result<Vec<bool>>) {
    match r {
        Ok(answers) if answers.len() == replies.len() => {
            for (reply, ok) in replies.drain(..).zip(answers) {
                // A caller that stopped waiting (its job was cancelled) needs no answer.
                let _ = reply.send(Ok(ok));
            }
        }
        Ok(answers) => {
            let e = Error::Redis(redis::RedisError::from((
                ErrorKind::Parse,
                "lock batch: Redis answered a different number of replies",
                format!("{} for {} requests", answers.len(), replies.len()),
            )));
            fail_all(replies, &e);
        }
        Err(e) => fail_all(replies, &e),
    }
}

/// Answers every caller of a failed batch with its error (never a silent "released").
fn fail_all(replies: &mut Vec<oneshot::Sender<Result<bool>>>, e: &Error) {
    for reply in replies.drain(..) {
        let _ = reply.send(Err(copy_error(e)));
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

/// A batch executor borrowed for one call (the two below): a named trait because an `async fn`'s
/// future borrows its arguments.
trait AsyncBatch<'a, R: 'a>: Send + Sync + 'static {
    /// The future of one batch.
    type Fut: std::future::Future<Output = Result<Vec<bool>>> + Send + 'a;
    /// Runs one batch.
    fn call(&self, conn: &'a mut Conn, reqs: &'a [R]) -> Self::Fut;
}

impl<'a, R: 'a, F, Fut> AsyncBatch<'a, R> for F
where
    F: Fn(&'a mut Conn, &'a [R]) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Vec<bool>>> + Send + 'a,
{
    type Fut = Fut;
    fn call(&self, conn: &'a mut Conn, reqs: &'a [R]) -> Fut {
        self(conn, reqs)
    }
}

/// One pipeline of `SET <key> <value> NX PX <ttl>`, one per request, in order; true where the key
/// was set. A Redis error on any of them fails the whole batch.
pub(crate) async fn acquire_batch(conn: &mut Conn, reqs: &[Acquire]) -> Result<Vec<bool>> {
    let mut pipe = redis::pipe();
    for r in reqs {
        pipe.cmd("SET")
            .arg(&r.key)
            .arg(&r.value)
            .arg("NX")
            .arg("PX")
            .arg(r.ttl_ms.max(1));
    }
    let set: Vec<Option<redis::Value>> = pipe.query_async(conn).await?;
    Ok(set.into_iter().map(|v| v.is_some()).collect())
}

/// One `EVALSHA` of [`RELEASE_MANY_SCRIPT`] over every request's key and token (`EVAL` with the body
/// on `NOSCRIPT`, which also caches it); true where the key held the token and was deleted.
pub(crate) async fn release_batch(conn: &mut Conn, reqs: &[Release]) -> Result<Vec<bool>> {
    let script = |name: &str, body: &str| {
        let mut c = redis::cmd(name);
        c.arg(body).arg(reqs.len());
        for r in reqs {
            c.arg(&r.key);
        }
        for r in reqs {
            c.arg(&r.token);
        }
        c
    };
    let deleted: Vec<i64> = match script("EVALSHA", &RELEASE_MANY_SHA).query_async(conn).await {
        Ok(d) => d,
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            script("EVAL", RELEASE_MANY_SCRIPT)
                .query_async(conn)
                .await?
        }
        Err(e) => return Err(e.into()),
    };
    Ok(deleted.into_iter().map(|n| n == 1).collect())
}

/// The acquire request of a lock with this TTL.
pub(crate) fn acquire_req(key: &str, value: &str, ttl: Duration) -> Acquire {
    Acquire {
        key: key.to_string(),
        value: value.to_string(),
        ttl_ms: ttl_ms(ttl),
    }
}

#[cfg(test)]
mod tests_batch;
