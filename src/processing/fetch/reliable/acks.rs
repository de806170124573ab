//! Acks of reliable fetch: the batch lists' acks sets and deletes, riding on the next fetch's pipeline
//! or sent alone.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::super::UnitOfWork;
use super::{Reliable, poisoned};
use crate::error::Result;

/// One ack's commands, built by [`Reliable::ack`].
#[derive(Debug)]
pub(super) enum AckCmd {
    /// `DEL` a batch list and its acks set: every job of the batch is done.
    Del(String, String),
    /// `SADD` places to an acks set.
    Sadd(String, Vec<u64>),
}

/// Adds `cmds` to `pipe` ([`AckCmd::replies`] replies each); a batch list deleted leaves `index`, the
/// process's index of held lists, in the same pipeline.
pub(super) fn add_acks(pipe: &mut redis::Pipeline, cmds: &[AckCmd], index: &str) {
    for c in cmds {
        match c {
            AckCmd::Del(key, acks) => pipe.del(&[key, acks]).srem(index, key),
            AckCmd::Sadd(acks, places) => pipe.sadd(acks, places),
        };
    }
}

/// [`add_acks`]'s commands written as RESP into `out` (the bytes the pipeline would get); returns how
/// many commands (replies) it wrote.
pub(super) fn pack_acks(out: &mut Vec<u8>, cmds: &[AckCmd], index: &str) -> usize {
    use crate::redis_conn::resp;
    let mut n = 0;
    for c in cmds {
        match c {
            AckCmd::Del(key, acks) => {
                out.extend_from_slice(b"*3\r\n$3\r\nDEL\r\n");
                resp::arg(out, key.as_bytes());
                resp::arg(out, acks.as_bytes());
                out.extend_from_slice(b"*3\r\n$4\r\nSREM\r\n");
                resp::arg(out, index.as_bytes());
                resp::arg(out, key.as_bytes());
                n += 2;
            }
            AckCmd::Sadd(acks, places) => {
                resp::command(out, 2 + places.len());
                out.extend_from_slice(b"$4\r\nSADD\r\n");
                resp::arg(out, acks.as_bytes());
                for &p in places {
                    resp::arg_u64(out, p);
                }
                n += 1;
            }
        }
    }
    n
}

impl AckCmd {
    /// How many replies [`add_acks`] adds for it.
    pub(super) fn replies(&self) -> usize {
        match self {
            AckCmd::Del(..) => 2,
            AckCmd::Sadd(..) => 1,
        }
    }
}

/// An ack piggybacked on a fetch, as TCP piggybacks an ACK on data: its commands wait for the next
/// fetch's pipeline to carry them (they "ride" on it: [`Reliable::ride`]). The fetch that takes it
/// answers through `sent`: true once Redis answered its pipeline, false when it failed; a fetch dropped
/// midway drops `sent`. In both latter cases the ack sends its commands itself (they are idempotent: an
/// `SADD` of places again, a `DEL` of keys already gone).
#[derive(Debug)]
pub(super) struct PiggybackAck {
    pub(super) id: u64,
    pub(super) cmds: Arc<Vec<AckCmd>>,
    pub(super) sent: tokio::sync::oneshot::Sender<bool>,
}

/// How long an ack waits for a fetch to carry it before it goes out alone: a fetch loop under load
/// fetches far more often than this; the wait only delays the ack (at least once: a job acknowledged
/// late may run again if its process dies meanwhile, as one whose ack was in flight).
pub(super) const RIDE_WAIT: Duration = Duration::from_millis(2);

/// Answers the acks that rode on a fetch's pipeline (their replies follow the fetch's first `skip`):
/// each true once Redis took every command of it.
pub(super) fn answer_riders(
    riders: Vec<PiggybackAck>,
    replies: &redis::RedisResult<Vec<redis::RedisResult<redis::Value>>>,
    skip: usize,
) {
    let mut acked = match replies {
        Ok(v) => v.get(skip..).unwrap_or_default().iter(),
        Err(_) => [].iter(),
    };
    for r in riders {
        // Every reply of this rider read (not `all`, which stops at the first error and would leave
        // the rest to be read as the next rider's).
        let mut ok = replies.is_ok();
        for reply in acked
            .by_ref()
            .take(r.cmds.iter().map(AckCmd::replies).sum())
        {
            ok &= reply.is_ok();
        }
        let _ = r.sent.send(ok);
    }
}

impl Reliable {
    /// The acks waiting for a fetch to carry them, taken for this one.
    pub(super) fn take_riders(&self) -> Vec<PiggybackAck> {
        self.riders
            .lock()
            .map(|mut r| std::mem::take(&mut *r))
            .unwrap_or_default()
    }

    /// One pipeline: a batch whose every job is now done is deleted (its list and acks set: one `DEL`,
    /// whatever the payloads); the places of the others are added to their acks sets (one `SADD` per
    /// batch). The counts change only once Redis answered, so an ack retried after an error counts once.
    pub(super) async fn ack(&self, done: &[UnitOfWork]) -> Result<()> {
        if done.is_empty() {
            return Ok(());
        }
        let groups = Self::by_batch(done);
        let mut cmds = Vec::new();
        let mut deleted = Vec::new();
        {
            let h = self.held.lock().map_err(|_| poisoned())?;
            for (batch, places) in &groups {
                let Some(b) = h.open.get(batch) else {
                    continue;
                };
                if b.left <= b.unsettled(places) {
                    cmds.push(AckCmd::Del(b.key.clone(), b.acks.clone()));
                    deleted.push(*batch);
                } else {
                    cmds.push(AckCmd::Sadd(b.acks.clone(), places.clone()));
                }
            }
        }
        let cmds = Arc::new(cmds);
        if !cmds.is_empty() && !self.ride(&cmds).await {
            self.send_acks(&cmds).await?;
        }
        // Counted only now that Redis has the commands (sent by a fetch or above).
        let mut emptied = Vec::new();
        for (batch, places) in &groups {
            if let Some(keys) = self.settle(*batch, places)
                && !deleted.contains(batch)
            {
                emptied.push(keys);
            }
        }
        self.delete_emptied(emptied).await
    }

    /// Sends `cmds` in one pipeline, each reply read on its own. An outage (Redis away or busy) is an
    /// error: the acker sends them again (they are idempotent). A command refused for a reason that will
    /// not mend by itself (its acks set is a key of the wrong type, Redis out of memory) costs only its
    /// own batch: it is logged at error level once, naming the key and its type, and that batch's ack is
    /// dropped, never retried: its jobs count as done here, their places stay unmarked in Redis (the
    /// batch's last ack deletes its list and that key with one `DEL`, whatever the key holds; should the
    /// process stop or die first, they stay in the list for recovery, as any job whose acknowledgement
    /// never reached Redis). The other batches' acks are in Redis all the same: one damaged key stopped
    /// every later ack of the process before (the acker retried the failed pipeline forever).
    pub(super) async fn send_acks(&self, cmds: &[AckCmd]) -> Result<()> {
        let mut pipe = redis::pipe();
        add_acks(&mut pipe, cmds, &self.index);
        pipe.ignore_errors();
        let replies: Vec<redis::RedisResult<redis::Value>> =
            pipe.query_async(&mut self.conn.clone()).await?;
        let mut refused = Vec::new();
        let mut replies = replies.into_iter();
        for cmd in cmds {
            // The index's SREM after a DEL counts with it: an index that refuses it (damaged) only
            // leaves an entry whose key is gone.
            let mut first = replies.next();
            for _ in 1..cmd.replies() {
                replies.next();
            }
            if let Some(Err(e)) = first.take() {
                let e = crate::Error::from(e);
                if e.is_outage() {
                    return Err(e);
                }
                refused.push((cmd, e));
            }
        }
        for (cmd, e) in refused {
            let key = match cmd {
                AckCmd::Del(key, _) => key,
                AckCmd::Sadd(acks, _) => acks,
            };
            let first = self
                .refused_acks
                .lock()
                .is_ok_and(|mut seen| seen.insert(key.clone()));
            if !first {
                continue;
            }
            let kind: String = redis::cmd("TYPE")
                .arg(key)
                .query_async(&mut self.conn.clone())
                .await
                .unwrap_or_else(|_| "unknown".into());
            tracing::error!(key = %key, r#type = %kind, error = %e,
                "cannot mark finished jobs done in their batch's acks set (a damaged key?): that batch's \
                 ack is dropped, not retried; its jobs stay in its list until its last job is done, or for \
                 recovery should this process stop or die first (the other batches are acknowledged)");
        }
        Ok(())
    }

    /// Hands `cmds` to the next fetch's pipeline and waits up to [`RIDE_WAIT`] for one to take them; true
    /// once a fetch's pipeline carried them and Redis answered it. False (the caller sends them itself)
    /// when no fetch took them in time, when the one that took them failed or was dropped, or when a fetch
    /// loop is in a blocking wait (the queues are empty: no fetch is due soon).
    pub(super) async fn ride(&self, cmds: &Arc<Vec<AckCmd>>) -> bool {
        if self.waiting.load(Ordering::Relaxed) > 0 {
            return false;
        }
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let id = self.next_rider.fetch_add(1, Ordering::Relaxed);
        match self.riders.lock() {
            Ok(mut r) => r.push(PiggybackAck {
                id,
                cmds: cmds.clone(),
                sent: tx,
            }),
            Err(_) => return false,
        }
        if let Ok(answer) = tokio::time::timeout(self.ride_wait, &mut rx).await {
            return answer.unwrap_or(false);
        }
        // No fetch took it in time: take it back, unless one took it just now (then its answer).
        let taken_back = self.riders.lock().is_ok_and(|mut r| {
            let before = r.len();
            r.retain(|x| x.id != id);
            r.len() < before
        });
        if taken_back {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// Deletes the lists of batches found done after the commands that acknowledged them were built (an
    /// ack and a push-back of the same batch at once).
    pub(super) async fn delete_emptied(&self, emptied: Vec<(String, String)>) -> Result<()> {
        if emptied.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for (key, acks) in &emptied {
            pipe.del(&[key, acks]).srem(&self.index, key);
        }
        pipe.ignore_errors();
        let replies: Vec<redis::RedisResult<redis::Value>> =
            pipe.query_async(&mut self.conn.clone()).await?;
        // A `DEL` is never refused for a key's type; an index that refuses its `SREM` (damaged) only
        // keeps an entry whose key is gone.
        for r in replies {
            if let Err(e) = r {
                let e = crate::Error::from(e);
                if e.is_outage() {
                    return Err(e);
                }
            }
        }
        Ok(())
    }
}
