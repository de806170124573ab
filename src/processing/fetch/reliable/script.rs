//! The script path of reliable fetch: the batch script over several queues and the reading of its
//! records.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::super::{MAX_BATCH, UnitOfWork};
use super::Reliable;
use super::acks::{add_acks, answer_riders};
use super::batch::Reservation;
use crate::error::Result;
use crate::keys;
use crate::lua::{dead_trim, lua_common};
use crate::time::{self, score};

/// The batch fetch of the script path (see the module docs for when it runs). KEYS[1] is the dead set,
/// then four keys per queue, in the round's order: its landing list (where a blocking wait put a job) and
/// the batch list this fetch fills from it, then its queue and the batch list this fetch fills from that
/// (`oxidekiq:batch:<identity>:<queue>:@<batch>`, new for every fetch). Takes up to ARGV[1] jobs, each
/// queue's landing list first, from the sources' served ends into their batch lists, in serve order
/// (the job its source served first at the list's head), and only then trims them from their source;
/// the caller reads the lists in the same pipeline. No payload enters Lua (Lua hashes every byte of every
/// string it is handed): `SORT <source> BY nosort DESC LIMIT 0 <n> STORE <batch list>` copies the
/// source's last n jobs (fewer if it has fewer) inside Redis without asking its length, and `MEMORY
/// USAGE` of the copy, times ARGV[9] (1, or [`COMPRESSED_RATIO`] when the server may compress the
/// list's nodes), bounds their sizes. Only when that copy could hold a job longer than ARGV[2] bytes
/// (0: no limit), or pass the batch budget ARGV[3] (or when an ACL refuses `SORT` or `MEMORY`), is it
/// undone and the source read job by job: such a job goes straight to the dead set, annotated with an
/// error naming this fetch (ARGV[4], the process's identity and the batch number) and the job's place
/// in it, so identical payloads stay distinct members (score ARGV[5], `failed_at` text ARGV[6], trimmed
/// by ARGV[7] and ARGV[8]), and the batch stops once it holds ARGV[3] bytes. A queue whose key has the
/// wrong type is skipped with an error; the others are served. Returns records: source number
/// (1-based: queue i's landing list is 2i-1, its queue 2i), tag, value: "n" (the copy took every job
/// asked: the source may hold more), "p" (the copy took fewer: the source is empty now) or "s" (read
/// job by job), each with the count in its batch list; "dead", size; "err", message; and last 0,
/// "seen", how many sources were looked at (the fetch stops once it holds ARGV[1] jobs). The last key
/// is the process's index of held lists ([`keys::held_index`]): a batch list left holding jobs is added
/// to it in the same script (an index that refuses it, a damaged key, leaves the list to recovery's
/// keyspace scan).
/// Numbers go back as integer replies and constant arguments as strings: every number Lua turns into a
/// string is a `printf` of a double, a few thousand instructions each, at a fixed cost per fetch.
///
/// [`COMPRESSED_RATIO`]: super::size_bound::COMPRESSED_RATIO
pub(super) const FETCH_LUA: &str = concat!(lua_common!(), include_str!("fetch.lua"));

/// What one run of the batch script reported, by source (its place in the round's sources).
#[derive(Debug, Default)]
pub(super) struct ScriptReport {
    /// Jobs in each source's batch list.
    pub(super) counts: Vec<usize>,
    /// How each source's jobs were taken: `n` a copy of every job asked, `p` a copy of fewer, `s`
    /// job by job; none when it gave none.
    pub(super) tags: Vec<Option<u8>>,
    /// The queues that failed (paused now).
    pub(super) failed: Vec<Arc<str>>,
    /// The sources that failed.
    pub(super) failed_sources: Vec<usize>,
    /// How many sources the script looked at, from the first.
    pub(super) seen: usize,
    /// Whether anything happened: jobs, an oversized one sent to the dead set, an error.
    pub(super) busy: bool,
}

/// One field of the batch script's records as bytes: its numbers come back as integer replies, its
/// messages and tags as bulk strings.
pub(super) fn reply_bytes(v: redis::Value) -> Vec<u8> {
    match v {
        redis::Value::Int(n) => n.to_string().into_bytes(),
        redis::Value::BulkString(b) => b,
        redis::Value::SimpleString(s) => s.into_bytes(),
        _ => Vec::new(),
    }
}

impl Reliable {
    /// One run of the batch script, with the batch lists read in the same pipeline: the jobs it handed
    /// out, and whether it did anything at all.
    pub(super) async fn fetch_batch(
        &self,
        order: &[Arc<str>],
        max: usize,
    ) -> Result<(Vec<UnitOfWork>, bool)> {
        if order.is_empty() {
            return Ok((Vec::new(), false));
        }
        let max = max.clamp(1, MAX_BATCH);
        // Two sources per queue of the round, its landing list and the queue itself, each copied into a
        // batch list of its own with a batch number of its own, so a unit id (batch and place) names one
        // list.
        let sources: Vec<(Arc<str>, String)> = order
            .iter()
            .flat_map(|q| {
                [
                    (q.clone(), format!("{}{q}", self.landing_prefix)),
                    (q.clone(), keys::queue(q)),
                ]
            })
            .collect();
        let first = self.reserve_numbers(sources.len() as u64);
        let lists: Vec<_> = sources
            .iter()
            .zip(first..)
            .map(|((q, _), batch)| self.lists(q, batch))
            .collect();
        let range = (first, first + lists.len() as u64);
        let mut reservation = Reservation::new(self, lists.clone(), range);
        // Blocking waits counted before the script looks at the landing lists: one that starts or ends
        // after this may put a job there that the script did not see.
        let waits: Vec<u64> = order
            .iter()
            .map(|q| self.with_queue(q, |s| s.waits).unwrap_or(0))
            .collect();
        let now = time::now();
        let (trim_before, dead_max) = dead_trim(now);
        let mut pipe = redis::pipe();
        let eval = pipe.cmd("EVALSHA").arg(self.script.get_hash());
        eval.arg(2 + 2 * lists.len()).arg(keys::DEAD);
        for ((_, src), dest) in sources.iter().zip(&lists) {
            eval.arg(src).arg(&dest.key);
        }
        eval.arg(&self.index);
        eval.arg(max)
            .arg(self.max_payload_bytes)
            .arg(self.budget())
            .arg(format!("{}/{first}", self.identity))
            .arg(score(now))
            .arg(self.fleet.time_format().value(now).to_string())
            .arg(trim_before)
            .arg(dead_max)
            .arg(self.mem_ratio.load(Ordering::Relaxed));
        for list in &lists {
            pipe.cmd("LRANGE").arg(&list.key).arg(0).arg(-1);
        }
        // Acks waiting for a fetch ride along (one round trip fewer each); they are answered below,
        // and if this fetch fails or is dropped they go out on their own (`Reliable::ack`). Each reply
        // is read on its own (`ignore_errors`), so an ack refused (its acks set damaged) fails only
        // that ack, never the fetch, and a fetch that fails fails no ack that Redis took.
        let riders = self.take_riders();
        for r in &riders {
            add_acks(&mut pipe, &r.cmds, &self.index);
        }
        pipe.ignore_errors();
        let noscript = |r: &redis::RedisResult<Vec<redis::RedisResult<redis::Value>>>| matches!(r, Ok(v) if matches!(v.first(), Some(Err(e)) if e.code() == Some("NOSCRIPT")));
        let mut replies = self.query_fetch(&pipe).await;
        if noscript(&replies) {
            // The script ran nowhere: load it (on the shared connection: a script is the server's,
            // whichever connection loaded it) and send the pipeline again (the acks in it too:
            // sending them twice is harmless).
            replies = match self
                .script
                .prepare_invoke()
                .load_async(&mut self.conn.clone())
                .await
            {
                Ok(_) => self.query_fetch(&pipe).await,
                Err(e) => Err(e),
            };
        }
        let fetch_replies = 1 + lists.len();
        answer_riders(riders, &replies, fetch_replies);
        let replies = replies?;
        let mut replies = replies.into_iter().take(fetch_replies);
        let flat: Vec<Vec<u8>> = match replies.next().transpose()? {
            Some(v) => redis::from_redis_value::<Vec<redis::Value>>(v)
                .map_err(redis::RedisError::from)?
                .into_iter()
                .map(reply_bytes)
                .collect(),
            None => Vec::new(),
        };
        let mut read: Vec<Vec<Vec<u8>>> = Vec::with_capacity(lists.len());
        for v in replies {
            read.push(redis::from_redis_value(v?).map_err(redis::RedisError::from)?);
        }
        let report = self.read_reply(flat, &sources);
        let busy = report.busy;
        self.note_looks(order, &report, &waits);
        let mut out = Vec::new();
        for (i, jobs) in read.into_iter().enumerate() {
            let (Some((q, _)), Some(list)) = (sources.get(i), lists.get(i)) else {
                continue;
            };
            let expected = report.counts.get(i).copied().unwrap_or(0);
            if expected != jobs.len() {
                // Only a recovery that judged this process dead touches its lists in between.
                tracing::warn!(queue = %q, expected, read = jobs.len(),
                    "a batch list changed between the fetch and its read");
            }
            let batch = first + i as u64;
            self.open(batch, list.clone(), jobs.len());
            // The list's head is the job its source served first: handed out in that order.
            let base = batch << keys::PLACE_BITS;
            for (place, raw) in jobs.into_iter().enumerate() {
                out.push(UnitOfWork::new(q.clone(), base | place as u64, raw));
            }
        }
        reservation.answered = true;
        // With fewer than `max` taken, the script looked at every queue of the round.
        if out.len() < max {
            self.stalls.unstall(order, &report.failed);
        }
        Ok((out, busy))
    }

    /// What the batch script's look at the round's queues says of them: a queue whose copy took every
    /// job asked is expected to fill the next batch (the fast path's), one it found short, empty, or
    /// read job by job is not; a landing list it looked at without an error is empty, unless a
    /// blocking wait began or ended since `waits` were counted.
    pub(super) fn note_looks(&self, order: &[Arc<str>], report: &ScriptReport, waits: &[u64]) {
        for (j, q) in order.iter().enumerate() {
            let (landing, queue) = (2 * j, 2 * j + 1);
            let looked =
                |source: usize| source < report.seen && !report.failed_sources.contains(&source);
            let before = waits.get(j).copied().unwrap_or(0);
            self.with_queue(q, |s| {
                if looked(landing) && s.waits == before {
                    s.landing = false;
                }
                if looked(queue) {
                    s.full = report.tags.get(queue).copied().flatten() == Some(b'n');
                }
            });
        }
    }

    /// Reads the batch script's records: how many jobs each source's batch list holds (by its place in
    /// the round's sources), how it took them, the queues that failed (paused here), and how many
    /// sources it looked at.
    pub(super) fn read_reply(
        &self,
        flat: Vec<Vec<u8>>,
        sources: &[(Arc<str>, String)],
    ) -> ScriptReport {
        let index = |q: &[u8]| {
            std::str::from_utf8(q)
                .ok()
                .and_then(|s| s.parse::<usize>().ok())
                .unwrap_or(0)
                .wrapping_sub(1)
        };
        let name_of = |q: &[u8]| {
            sources
                .get(index(q))
                .map(|(name, _)| name.clone())
                .unwrap_or_else(|| Arc::from(String::from_utf8_lossy(q).as_ref()))
        };
        let number = |b: &[u8]| {
            std::str::from_utf8(b)
                .ok()
                .and_then(|s| s.parse::<usize>().ok())
                .unwrap_or(0)
        };
        let mut report = ScriptReport {
            counts: vec![0; sources.len()],
            tags: vec![None; sources.len()],
            busy: false,
            ..ScriptReport::default()
        };
        let mut it = flat.into_iter();
        while let (Some(q), Some(tag), Some(body)) = (it.next(), it.next(), it.next()) {
            match tag.as_slice() {
                b"seen" => {
                    report.seen = number(&body);
                    continue;
                }
                b"err" => {
                    let queue = name_of(&q);
                    self.stalls.stall(&queue, &String::from_utf8_lossy(&body));
                    report.failed.push(queue);
                    report.failed_sources.push(index(&q));
                }
                b"dead" => {
                    self.dead.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(queue = %name_of(&q), size = %String::from_utf8_lossy(&body),
                        limit = self.max_payload_bytes,
                        "payload over the size limit sent to the dead set without being read");
                }
                _ => {
                    let i = index(&q);
                    if let Some(c) = report.counts.get_mut(i) {
                        *c += number(&body);
                    }
                    if let Some(t) = report.tags.get_mut(i) {
                        *t = tag.first().copied();
                    }
                }
            }
            report.busy = true;
        }
        report
    }
}
