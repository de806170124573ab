//! The fast path of reliable fetch: one transaction (`SORT .. STORE`, the guard, `LRANGE`) for a round
//! whose first queue is expected to fill the batch.

use std::sync::atomic::Ordering;
use std::sync::{Arc, LazyLock};

use super::super::{MAX_BATCH, UnitOfWork};
use super::acks::{add_acks, answer_riders, pack_acks};
use super::batch::Reservation;
use super::script::reply_bytes;
use super::{Reliable, describe};
use crate::error::Result;
use crate::keys;
use crate::redis_conn::resp;

/// The guard of the fast path, run inside its transaction (`MULTI`; `SORT` of up to n jobs of queue
/// KEYS[1] into batch list KEYS[2]; this; `LRANGE` of the batch list; `EXEC`): it trims the queue of the
/// jobs the copy holds, and only when the copy is there and holds no job over ARGV[1] bytes (the payload
/// limit or the batch budget, whichever is lower, over [`COMPRESSED_RATIO`] when the server may compress
/// the list's nodes: every job in it is at most `MEMORY USAGE` of it, times that ratio).
/// Returns that size (0 when the `SORT` copied nothing, or failed: then nothing is trimmed). Otherwise
/// the copy is deleted and the queue left as it was, so the `LRANGE` reads nothing: `{'over', size}`,
/// `{'refused', error}` (`MEMORY`, `LLEN` or `LTRIM` refused, an ACL) or `{'type', type}` (the queue is
/// no list: `SORT` copies a set or a sorted set, which `LTRIM` refuses). The trim is here, not a command
/// of the transaction: a command of a transaction that fails when it runs (a `SORT` refused by an ACL
/// changed after it was queued) does not stop the others, and an `LTRIM` beside it would remove jobs
/// no list holds. Sent whole with `EVAL` (a few hundred bytes), never `EVALSHA`: inside a transaction a
/// `NOSCRIPT` would come after the `SORT` ran, and the `LRANGE` would read an unguarded list of jobs still
/// queued. Every call goes through `pcall`, and no value is used before its type is checked: an error
/// this script raised would leave that read unguarded too. A copy kept (trimmed off the queue) is added
/// to the process's index of held lists KEYS[3] ([`keys::held_index`]).
///
/// [`COMPRESSED_RATIO`]: super::size_bound::COMPRESSED_RATIO
pub(super) const GUARD_LUA: &str = include_str!("guard.lua");

/// What a fast-path fetch did.
#[derive(Debug)]
pub(super) enum Fast {
    /// Jobs taken from the queue, in the order it served them (none: it was empty).
    Took(Vec<UnitOfWork>),
    /// The queue's key is no list: paused, nothing taken.
    Stalled,
    /// Nothing taken, the queue as it was: this fetch goes through the script (the batch could hold a
    /// payload over the limit, or Redis refused a command of the fast path).
    Script,
}

/// About how many bytes one fast-path batch copies, unless that is fewer than [`FAST_BATCH_JOBS`] jobs:
/// `SORT .. STORE` holds a copy of every job of the batch at once before it builds the list, and Redis's
/// cost per job of it grows with the batch (4 KB payloads: 2 µs a job in batches of 50, 4 µs in batches of
/// 200; 16 KB: 5-6 µs in batches of 50, 10-20 µs in batches of 200), while a batch's fixed cost (the
/// guard, the `LTRIM`, a round trip) is spread over fewer jobs the smaller it is
/// (bench/results/redis-per-job.md).
pub(super) const FAST_BATCH_BYTES: usize = 256 * 1024;

/// Jobs a fast-path batch may hold past [`FAST_BATCH_BYTES`], within [`FAST_BATCH_MAX_BYTES`].
pub(super) const FAST_BATCH_JOBS: usize = 64;

/// The most bytes a fast-path batch copies, whatever its count (it holds at least 8 jobs).
pub(super) const FAST_BATCH_MAX_BYTES: usize = 1024 * 1024;

/// Jobs one fast-path batch asks for: the free slots (at most [`MAX_BATCH`]), and, for jobs of
/// `job_bytes` each (the last batch's `MEMORY USAGE` per job; 0: not known yet), about
/// [`FAST_BATCH_BYTES`] of them or [`FAST_BATCH_JOBS`], whichever is more, within
/// [`FAST_BATCH_MAX_BYTES`] and no fewer than 8, and within `room` (the most `MEMORY USAGE` a copy may
/// have for the guard to pass it, while lists may be compressed; at least one job), so a copy is not
/// made only to be deleted.
pub(super) fn fast_batch(max: usize, job_bytes: usize, room: usize) -> usize {
    let max = max.clamp(1, MAX_BATCH);
    if job_bytes == 0 {
        return max;
    }
    let n = (FAST_BATCH_BYTES / job_bytes)
        .max(FAST_BATCH_JOBS)
        .min(FAST_BATCH_MAX_BYTES / job_bytes)
        .max(8)
        .min((room / job_bytes).max(1));
    max.min(n)
}

/// The fast path's transaction as a pipeline (the shared connection's way: TLS, Sentinel):
/// `MULTI; SORT <qkey> BY nosort DESC LIMIT 0 <n> STORE <list>; EVAL <guard> 3 <qkey> <list> <index>
/// <room>; LRANGE <list> 0 -1; EXEC`.
pub(super) fn fast_pipe(
    qkey: &str,
    n: usize,
    list: &str,
    index: &str,
    room: usize,
) -> redis::Pipeline {
    let mut pipe = redis::pipe();
    pipe.cmd("MULTI")
        .cmd("SORT")
        .arg(qkey)
        .arg("BY")
        .arg("nosort")
        .arg("DESC")
        .arg("LIMIT")
        .arg(0)
        .arg(n)
        .arg("STORE")
        .arg(list)
        .cmd("EVAL")
        .arg(GUARD_LUA)
        .arg(3)
        .arg(qkey)
        .arg(list)
        .arg(index)
        .arg(room)
        .cmd("LRANGE")
        .arg(list)
        .arg(0)
        .arg(-1)
        .cmd("EXEC");
    pipe
}

/// `MULTI` and the head of the `SORT`, up to its key.
const SORT_HEAD: &[u8] = b"*1\r\n$5\r\nMULTI\r\n*10\r\n$4\r\nSORT\r\n";
/// The `SORT`'s arguments from `BY` to its count.
const SORT_MID: &[u8] = b"$2\r\nBY\r\n$6\r\nnosort\r\n$4\r\nDESC\r\n$5\r\nLIMIT\r\n$1\r\n0\r\n";
/// The head of the `EVAL`: the command, the guard's text and its key count, made once (the guard is
/// sent whole on every fetch: see [`GUARD_LUA`]).
static EVAL_HEAD: LazyLock<Vec<u8>> = LazyLock::new(|| {
    let mut out = b"*7\r\n$4\r\nEVAL\r\n".to_vec();
    resp::arg(&mut out, GUARD_LUA.as_bytes());
    resp::arg(&mut out, b"3");
    out
});

/// [`fast_pipe`]'s commands written as RESP into `out`: the bytes `get_packed_pipeline` writes for it
/// (the tests compare them), without the pipeline's per-argument vectors and the guard's copy into
/// them on every fetch.
pub(super) fn pack_fast(
    out: &mut Vec<u8>,
    qkey: &str,
    n: usize,
    list: &str,
    index: &str,
    room: usize,
) {
    out.extend_from_slice(SORT_HEAD);
    resp::arg(out, qkey.as_bytes());
    out.extend_from_slice(SORT_MID);
    resp::arg_u64(out, n as u64);
    out.extend_from_slice(b"$5\r\nSTORE\r\n");
    resp::arg(out, list.as_bytes());
    out.extend_from_slice(&EVAL_HEAD);
    resp::arg(out, qkey.as_bytes());
    resp::arg(out, list.as_bytes());
    resp::arg(out, index.as_bytes());
    resp::arg_u64(out, room as u64);
    out.extend_from_slice(b"*4\r\n$6\r\nLRANGE\r\n");
    resp::arg(out, list.as_bytes());
    out.extend_from_slice(b"$1\r\n0\r\n$2\r\n-1\r\n*1\r\n$4\r\nEXEC\r\n");
}

/// Replies of the fast path's transaction before the riding acks': `MULTI`, three `QUEUED`, `EXEC`.
pub(super) const FAST_REPLIES: usize = 5;

impl Reliable {
    /// Whether a fetch whose round starts with `queue` takes the fast path.
    pub(super) fn fast_fits(&self, queue: &str) -> bool {
        self.fast.load(Ordering::Relaxed)
            && self
                .with_queue(queue, |s| s.full && !s.landing)
                .unwrap_or(false)
    }

    /// Turns the fast path off for good, once: Redis refused one of its commands.
    pub(super) fn refuse_fast(&self, why: &str) {
        if self.fast.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                error = why,
                "redis refused a command of the fast fetch path; this process fetches through the batch script from now on"
            );
        }
    }

    /// The fast path: one transaction takes up to `max` jobs of `queue` into a new batch list and reads
    /// them, no script between them but a guard of a few calls ([`GUARD_LUA`]):
    /// `MULTI; SORT queue:<q> BY nosort DESC LIMIT 0 <n> STORE <list>; EVAL <guard>; LRANGE <list> 0 -1;
    /// EXEC`, with the acks waiting for a fetch after it. The `SORT`'s count is how many it took (a queue
    /// shorter than n gives what it has); the guard trims exactly the jobs the list holds off the queue,
    /// only once the copy is there and within the limit. Nothing runs between the copy and the trim, so
    /// the list holds exactly the jobs the queue lost, and a copy that failed removes nothing.
    pub(super) async fn fetch_fast(&self, queue: &Arc<str>, max: usize) -> Result<Fast> {
        let job_bytes = self.with_queue(queue, |s| s.job_bytes).unwrap_or(0);
        let n = fast_batch(max, job_bytes, self.batch_room());
        let batch = self.reserve_numbers(1);
        let list = self.lists(queue, batch);
        let mut reservation = Reservation::new(self, vec![list.clone()], (batch, batch + 1));
        let qkey = keys::queue(queue);
        let riders = self.take_riders();
        let room = self.room();
        let replies = match &self.own {
            // The fetcher's own connections: the bytes written here, the fixed parts once.
            Some(own) => {
                let mut out = Vec::with_capacity(GUARD_LUA.len() + 512);
                pack_fast(&mut out, &qkey, n, &list.key, &self.index, room);
                let mut count = FAST_REPLIES;
                for r in &riders {
                    count += pack_acks(&mut out, &r.cmds, &self.index);
                }
                own.query_each_packed(&out, count).await
            }
            None => {
                let mut pipe = fast_pipe(&qkey, n, &list.key, &self.index, room);
                for r in &riders {
                    add_acks(&mut pipe, &r.cmds, &self.index);
                }
                pipe.ignore_errors();
                self.query_fetch(&pipe).await
            }
        };
        answer_riders(riders, &replies, FAST_REPLIES);
        let mut replies = replies?;
        if let Some(Err(multi)) = replies.first() {
            // `MULTI` refused (an ACL without it, a command renamed away): the commands after it ran
            // one by one, outside any transaction, and `EXEC` answers "without MULTI". The copy the
            // guard trimmed off the queue goes back now: left for the next reconcile (which only an
            // outage or a stop brings), its jobs would wait in a list nobody runs, and every later
            // fetch would move more of the queue there.
            let multi = multi.clone();
            let (_, kept, _) = self.move_back(vec![list.clone()]).await;
            // Not moved back (an outage): recorded as lost, for the next sweep.
            reservation.answered = kept.is_empty();
            if matches!(multi.code(), Some("NOPERM") | Some("ERR")) {
                self.refuse_fast(&multi.to_string());
                return Ok(Fast::Script);
            }
            return Err(multi.into());
        }
        replies.truncate(FAST_REPLIES);
        let exec = match replies.pop() {
            Some(Ok(redis::Value::Array(items))) => items,
            Some(Err(e)) if e.code() == Some("EXECABORT") => {
                // Refused before it ran (nothing happened): by an ACL or a command renamed away for
                // good, or for now (a replica after a failover, out of memory).
                reservation.answered = true;
                let first = replies
                    .into_iter()
                    .skip(1)
                    .find_map(|r| r.err())
                    .unwrap_or(e);
                // `EXEC` itself refused (an ACL without it) answers only `EXECABORT`, naming the
                // refusal in its text ("discarded because of: NOPERM ..."): as refused as the others.
                let exec_refused = first.code() == Some("EXECABORT")
                    && first.detail().is_some_and(|d| d.contains("NOPERM"));
                if exec_refused || matches!(first.code(), Some("NOPERM") | Some("ERR")) {
                    self.refuse_fast(&first.to_string());
                    return Ok(Fast::Script);
                }
                return Err(first.into());
            }
            Some(Err(e)) => return Err(e.into()),
            _ => {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::UnexpectedReturnType,
                    "the fast fetch's transaction answered no array",
                ))
                .into());
            }
        };
        reservation.answered = true;
        let mut exec = exec.into_iter();
        let (sorted, guard, read) = (exec.next(), exec.next(), exec.next());
        if let Some(redis::Value::ServerError(e)) = sorted {
            // The copy failed, so the guard trimmed nothing: the queue is as it was. Its key is a hash
            // or a string (`WRONGTYPE`), or Redis refused the `SORT` when the transaction ran (an ACL
            // changed after it was queued).
            let e = redis::RedisError::from(e);
            if e.code() == Some("WRONGTYPE") {
                let msg = describe(&self.conn, std::slice::from_ref(&qkey), &e).await;
                self.stalls.stall(queue, &msg);
                return Ok(Fast::Stalled);
            }
            self.refuse_fast(&e.to_string());
            return Ok(Fast::Script);
        }
        let taken = match sorted {
            Some(redis::Value::Int(c)) => usize::try_from(c).unwrap_or(0),
            _ => 0,
        };
        let copied = match guard {
            Some(redis::Value::Int(mem)) => usize::try_from(mem).unwrap_or(0),
            Some(redis::Value::Array(parts)) => {
                // The copy is deleted and the queue as it was: nothing taken.
                let mut parts = parts.into_iter().map(reply_bytes);
                let tag = parts.next().unwrap_or_default();
                let what = String::from_utf8_lossy(&parts.next().unwrap_or_default()).into_owned();
                match tag.as_slice() {
                    // The script reads the queue job by job. Its size per job sizes the next batches
                    // (the script's too).
                    b"over" => {
                        let per_job = what
                            .parse::<usize>()
                            .ok()
                            .and_then(|m| m.checked_div(taken));
                        self.with_queue(queue, |s| {
                            s.full = false;
                            s.job_bytes = per_job.unwrap_or(s.job_bytes);
                        });
                        return Ok(Fast::Script);
                    }
                    b"type" => {
                        self.stalls
                            .stall(queue, &format!("{qkey} is a {what}, not a list"));
                        return Ok(Fast::Stalled);
                    }
                    _ => {
                        self.refuse_fast(&what);
                        return Ok(Fast::Script);
                    }
                }
            }
            other => {
                // The guard failed (never seen: every call in it is a `pcall`, every value checked),
                // so nothing was trimmed; what the list held was read, and is a copy of jobs still
                // queued: deleted, never handed out (it would run them twice).
                let what = match other {
                    Some(redis::Value::ServerError(e)) => redis::RedisError::from(e).to_string(),
                    _ => "no reply".into(),
                };
                self.refuse_fast(&what);
                let _ = redis::cmd("DEL")
                    .arg(&list.key)
                    .query_async::<()>(&mut self.conn.clone())
                    .await;
                return Ok(Fast::Script);
            }
        };
        let jobs: Vec<Vec<u8>> = match read {
            Some(v @ redis::Value::Array(_)) => match redis::from_redis_value(v) {
                Ok(jobs) => jobs,
                Err(e) => {
                    // Trimmed off the queue, never handed out: the list goes back with the next sweep.
                    if let Ok(mut h) = self.held.lock() {
                        h.lost.push(list.clone());
                    }
                    return Err(redis::RedisError::from(e).into());
                }
            },
            _ => {
                // Not read (an ACL changed after the transaction was queued): whatever the list holds
                // goes back with the next sweep.
                if let Ok(mut h) = self.held.lock() {
                    h.lost.push(list.clone());
                }
                Vec::new()
            }
        };
        if taken != jobs.len() {
            // Only a recovery that judged this process dead touches its lists in between.
            tracing::warn!(queue = %queue, expected = taken, read = jobs.len(),
                "a batch list changed between the fetch and its read");
        }
        self.with_queue(queue, |s| {
            s.full = taken >= n;
            if let Some(per_job) = copied.checked_div(taken) {
                s.job_bytes = per_job;
            }
        });
        self.stalls.unstall(std::slice::from_ref(queue), &[]);
        self.open(batch, list, jobs.len());
        let base = batch << keys::PLACE_BITS;
        Ok(Fast::Took(
            jobs.into_iter()
                .enumerate()
                .map(|(place, raw)| UnitOfWork::new(queue.clone(), base | place as u64, raw))
                .collect(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::super::acks::{AckCmd, add_acks, pack_acks};
    use super::*;

    /// The fast path's bytes for its own connections are the ones redis-rs packs for its pipeline:
    /// counts and room of every length class (one digit, two, many, the largest), keys of every
    /// length class and with multi-byte characters, and riders of both kinds (a `SADD` of no place,
    /// of one, of many places; a `DEL` with its `SREM`), alone and mixed.
    #[test]
    fn packed_fast_fetch_is_the_pipeline_redis_rs_packs() {
        let long = "q".repeat(150);
        let queues = [
            "queue:default".to_string(),
            "queue:é ü".to_string(),
            format!("queue:{long}"),
        ];
        let lists = [
            "oxidekiq:batch:host:1:2:3".to_string(),
            format!("oxidekiq:batch:{long}:9"),
        ];
        let riders: Vec<Vec<AckCmd>> = vec![
            vec![],
            vec![AckCmd::Sadd("acks:1".into(), vec![])],
            vec![AckCmd::Sadd("acks:1".into(), vec![7])],
            vec![AckCmd::Sadd(
                "acks:ü".into(),
                (0..120).map(|i| ((i * 977) << 20) | i).collect(),
            )],
            vec![AckCmd::Del("oxidekiq:batch:x:1".into(), "acks:x:1".into())],
            vec![
                AckCmd::Del("b:1".into(), "a:1".into()),
                AckCmd::Sadd("a:2".into(), vec![u64::MAX, 0, 10, 99, 100]),
                AckCmd::Del(long.clone(), format!("{long}:acks")),
            ],
        ];
        let mut checked = 0;
        for qkey in &queues {
            for list in &lists {
                for (n, room) in [
                    (1, 0),
                    (9, 10),
                    (10, 99),
                    (200, 123_456),
                    (usize::MAX, usize::MAX),
                ] {
                    for index in ["oxidekiq:held:host", "idx:ü"] {
                        for cmds in &riders {
                            let mut pipe = fast_pipe(qkey, n, list, index, room);
                            add_acks(&mut pipe, cmds, index);
                            pipe.ignore_errors();
                            let mut out = Vec::new();
                            pack_fast(&mut out, qkey, n, list, index, room);
                            let count = FAST_REPLIES + pack_acks(&mut out, cmds, index);
                            assert_eq!(
                                String::from_utf8_lossy(&out),
                                String::from_utf8_lossy(&pipe.get_packed_pipeline()),
                                "{qkey} {list} {n} {room} {index} {cmds:?}"
                            );
                            assert_eq!(out, pipe.get_packed_pipeline());
                            assert_eq!(count, pipe.len());
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(checked, 3 * 2 * 5 * 2 * 6);
    }
}
