//! Basic fetch: Sidekiq's open-source `BasicFetch` semantics, at a fraction of its Redis cost: one fetch
//! loop per process pops the free slots' worth of jobs without blocking (`RPOP queue:a <n>`, then the
//! next queue of the round for the rest), and blocks (`BRPOP queue:a queue:b 2`, as Sidekiq) only when
//! every queue was empty. Sidekiq's queue order and weights hold: strict queues are served in order,
//! weighted ones in a fresh weighted shuffle per fetch.
//!
//! A job leaves Redis when it is fetched: a process killed while running it loses it, as Sidekiq's
//! open-source fetch does; acknowledging is a no-op, and the shutdown pushes unfinished jobs back with
//! `RPUSH`. A `BRPOP` cut short could lose the job its reply carries, so a fetch is never cancelled.

use std::sync::Arc;
use std::time::Duration;

use super::{BoxFuture, Fetch, MAX_BATCH, QueueOrder, Setup, Stalls, UnitOfWork};
use crate::config::QueueWeight;
use crate::error::Result;
use crate::keys;
use crate::redis_conn::Conn;

/// The basic fetcher of one process.
#[derive(Debug)]
pub(crate) struct Basic {
    /// Queue order.
    order: QueueOrder,
    /// Connection for requeues and key-type checks.
    conn: Conn,
    /// Dedicated connection for `BRPOP`.
    blocking: Conn,
    /// How long one `BRPOP` may block.
    block: Duration,
    /// Queues paused after an error of their own.
    stalls: Stalls,
}

impl Basic {
    /// A basic fetcher over `queues`.
    pub(crate) fn new(queues: &[QueueWeight], conn: Conn, blocking: Conn, block: Duration) -> Self {
        Basic {
            order: QueueOrder::new(queues),
            conn,
            blocking,
            block,
            stalls: Stalls::default(),
        }
    }

    /// Built from the launcher's [`Setup`].
    pub(crate) fn from_setup(s: Setup<'_>) -> Self {
        Basic::new(s.queues, s.conn, s.blocking, s.block)
    }

    /// Up to `max` jobs, popped without blocking from the queues in the round's order (`RPOP <queue>
    /// <n>`, one command for a whole batch: Redis neither blocks nor wakes a client per job); only when
    /// every queue was empty, one blocking `BRPOP` over all of them, as Sidekiq's.
    async fn fetch(&self, max: usize) -> Result<Vec<UnitOfWork>> {
        let order = self.stalls.usable(self.order.next());
        if order.is_empty() {
            tokio::time::sleep(self.block.min(Duration::from_millis(500))).await;
            return Ok(Vec::new());
        }
        let max = max.clamp(1, MAX_BATCH);
        let mut out = Vec::new();
        let mut conn = self.conn.clone();
        for q in &order {
            let key = keys::queue(q);
            let popped: redis::RedisResult<Option<Vec<Vec<u8>>>> = redis::cmd("RPOP")
                .arg(&key)
                .arg(max - out.len())
                .query_async(&mut conn)
                .await;
            match popped {
                Ok(jobs) => out.extend(
                    jobs.unwrap_or_default()
                        .into_iter()
                        .map(|raw| UnitOfWork::new(q.clone(), 0, raw)),
                ),
                Err(e) if e.code() == Some("WRONGTYPE") => {
                    let t: String = redis::cmd("TYPE").arg(&key).query_async(&mut conn).await?;
                    self.stalls
                        .stall(q, &format!("{key} is a {t}, not a list: {e}"));
                }
                // Jobs popped from the queues before are handed out: an error here must not drop them.
                Err(e) if out.is_empty() => return Err(e.into()),
                Err(_) => break,
            }
            if out.len() >= max {
                break;
            }
        }
        if out.is_empty() {
            return self.wait(&self.stalls.usable(order)).await;
        }
        Ok(out)
    }

    /// One blocking `BRPOP` over the queues: at most one job.
    async fn wait(&self, order: &[Arc<str>]) -> Result<Vec<UnitOfWork>> {
        if order.is_empty() {
            tokio::time::sleep(self.block.min(Duration::from_millis(500))).await;
            return Ok(Vec::new());
        }
        let keys: Vec<String> = order.iter().map(|q| keys::queue(q)).collect();
        let got: redis::RedisResult<Option<(String, Vec<u8>)>> = redis::cmd("BRPOP")
            .arg(&keys)
            .arg(self.block.as_secs_f64())
            .query_async(&mut self.blocking.clone())
            .await;
        let got = match got {
            Ok(g) => g,
            Err(e) if e.code() == Some("WRONGTYPE") => {
                // BRPOP fails as a whole: find the culprits, pause them, serve the others next round.
                let mut conn = self.conn.clone();
                for (q, k) in order.iter().zip(&keys) {
                    let t: String = redis::cmd("TYPE").arg(k).query_async(&mut conn).await?;
                    if t != "list" && t != "none" {
                        self.stalls
                            .stall(q, &format!("{k} is a {t}, not a list: {e}"));
                    }
                }
                return Ok(Vec::new());
            }
            Err(e) => return Err(e.into()),
        };
        Ok(got
            .map(|(key, raw)| {
                let queue = keys
                    .iter()
                    .position(|k| *k == key)
                    .and_then(|i| order.get(i).cloned())
                    .unwrap_or_else(|| Arc::from(key.as_str()));
                UnitOfWork::new(queue, 0, raw)
            })
            .into_iter()
            .collect())
    }

    /// `RPUSH`es `units` back to their queues, pipelined; how many went back.
    ///
    /// The pipeline is not atomic: a queue key of the wrong type fails only its own `RPUSH`es, and the
    /// others have run. That failure is reported here, naming the key and its type, and not returned:
    /// the caller's retry of the whole list would push every other job again (once per attempt), and a
    /// key of the wrong type does not heal within a stop. Those jobs have no copy in Redis (basic fetch),
    /// as after any failed push-back. Only a failure of the whole call (Redis unreachable) is an error.
    async fn requeue(&self, units: &[UnitOfWork]) -> Result<u64> {
        if units.is_empty() {
            return Ok(0);
        }
        let mut pipe = redis::pipe();
        for h in units {
            pipe.rpush(keys::queue(&h.queue), h.raw());
        }
        let replies: Vec<redis::RedisResult<redis::Value>> = pipe
            .ignore_errors()
            .query_async(&mut self.conn.clone())
            .await?;
        let mut pushed = 0;
        let mut failed: Vec<(&str, usize, String)> = Vec::new();
        for (h, reply) in units.iter().zip(&replies) {
            match reply {
                Ok(_) => pushed += 1,
                Err(e) => match failed.iter_mut().find(|(q, _, _)| *q == &*h.queue) {
                    Some((_, n, _)) => *n += 1,
                    None => failed.push((&h.queue, 1, e.to_string())),
                },
            }
        }
        for (queue, count, error) in failed {
            let key = keys::queue(queue);
            let kind: String = redis::cmd("TYPE")
                .arg(&key)
                .query_async(&mut self.conn.clone())
                .await
                .unwrap_or_else(|_| "unknown type".into());
            tracing::error!(key = %key, key_type = %kind, count, error = %error,
                "could not push unfinished jobs back: the queue key is not a list; this fetch keeps no copy in redis, so they are lost");
        }
        Ok(pushed)
    }
}

impl Fetch for Basic {
    /// Up to `max` jobs per call (one when it had to block).
    fn retrieve_work(&self, max: usize) -> BoxFuture<'_, Result<Vec<UnitOfWork>>> {
        Box::pin(self.fetch(max))
    }

    /// Nothing to acknowledge: the job left Redis when it was fetched.
    fn acknowledge<'a>(&'a self, _done: &'a [UnitOfWork]) -> BoxFuture<'a, Result<()>> {
        Box::pin(async { Ok(()) })
    }

    /// `RPUSH queue:<name>` of each job, pipelined.
    fn bulk_requeue<'a>(&'a self, units: &'a [UnitOfWork]) -> BoxFuture<'a, Result<u64>> {
        Box::pin(self.requeue(units))
    }

    /// One loop: its `BRPOP`s would queue on one blocking connection anyway.
    fn fetch_loops(&self, _concurrency: usize) -> usize {
        1
    }
}
