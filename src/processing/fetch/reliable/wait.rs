//! The blocking wait of reliable fetch when every queue is empty, and the landing lists it marks.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::{QueueState, Reliable, describe};
use crate::error::Result;
use crate::keys;

/// Counts a fetch loop in a blocking wait for as long as it lives.
pub(super) struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    pub(super) fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::Relaxed);
        Waiting(n)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Marks a queue's landing list as possibly holding a job from the start of a blocking wait on the queue
/// to its end, however it ends (a job, a timeout, an error, the wait dropped).
pub(super) struct LandingWait<'a> {
    pub(super) fetcher: &'a Reliable,
    pub(super) queue: &'a str,
}

impl<'a> LandingWait<'a> {
    pub(super) fn new(fetcher: &'a Reliable, queue: &'a str) -> Self {
        fetcher.with_queue(queue, QueueState::wait);
        LandingWait { fetcher, queue }
    }
}

impl Drop for LandingWait<'_> {
    fn drop(&mut self) {
        self.fetcher.with_queue(self.queue, QueueState::wait);
    }
}

impl QueueState {
    /// A blocking wait on the queue starts or ends: its landing list may hold a job.
    pub(super) fn wait(&mut self) {
        self.landing = true;
        self.waits += 1;
    }
}

impl Reliable {
    /// Blocks until a job arrives on the first queue of the round (moving it into its landing list) or
    /// the block time passes. True when a job landed. The landing list is swept by name
    /// ([`Fetch::requeue_leftovers`]), so a wait cut short, or one that Redis served after its reply
    /// was no longer awaited, strands nothing; and the fast path keeps off the queue until the script
    /// has looked at its landing list since.
    ///
    /// [`Fetch::requeue_leftovers`]: super::super::Fetch::requeue_leftovers
    pub(super) async fn wait_for_work(&self, order: &[Arc<str>]) -> Result<bool> {
        let Some(first) = order.first() else {
            tokio::time::sleep(self.block.min(Duration::from_millis(500))).await;
            return Ok(false);
        };
        // With several queues, block briefly on the first so the others are looked at again soon.
        let block = if order.len() == 1 {
            self.block
        } else {
            self.block.min(Duration::from_millis(50))
        };
        let (queue, landing) = (
            keys::queue(first),
            format!("{}{first}", self.landing_prefix),
        );
        // The landing list goes into this process's index of held lists before the first wait that
        // may fill it: one `SADD` per queue for the process's life (its recovery passes add it again
        // after a recovery that took the process for dead dropped its index: `tidy_index`). A refusal
        // (a damaged index) is left to the pass, which names it.
        if self.with_queue(first, |q| !q.indexed) == Some(true) {
            let added: redis::RedisResult<()> =
                redis::AsyncCommands::sadd(&mut self.conn.clone(), &self.index, &landing).await;
            if added.is_ok() {
                self.with_queue(first, |q| q.indexed = true);
            }
        }
        let _waiting = Waiting::new(&self.waiting);
        let _landing = LandingWait::new(self, first);
        // The payload comes back in the reply; the batch script copies it out of the landing list (an
        // oversized one goes to the dead set there).
        let moved: redis::RedisResult<Option<Vec<u8>>> = redis::cmd("BLMOVE")
            .arg(&queue)
            .arg(&landing)
            .arg("RIGHT")
            .arg("LEFT")
            .arg(block.as_secs_f64())
            .query_async(&mut self.blocking.clone())
            .await;
        match moved {
            Ok(raw) => Ok(raw.is_some()),
            Err(e) if e.code() == Some("WRONGTYPE") => {
                let msg = describe(&self.conn, &[queue, landing], &e).await;
                self.stalls.stall(first, &msg);
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }
}
