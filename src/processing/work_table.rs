//! The work table: the jobs in flight in this process (running, or whose fate is not yet in Redis), for
//! the Busy page (the heartbeat's work hash), TTIN, `/metrics` and the push-back at shutdown.
//!
//! Its own room in the processing layer (docs/layout.md), below the processor that fills and empties
//! it and the manager that drains it at shutdown, so that the processor needs no path to the manager.

use std::sync::{Arc, Mutex};

use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::Notify;

use crate::encoding::to_base36;
use crate::fetch::UnitOfWork;
use crate::job::Job;
use crate::keys;
use crate::redis_conn::Conn;

/// A job that is running or whose fate is not yet in Redis: a row of the work table.
#[derive(Debug, Clone)]
pub(crate) struct Running {
    /// The job.
    pub unit: UnitOfWork,
    /// Epoch seconds when it started (`run_at` of the work hash).
    pub run_at: i64,
    /// Sequence number of the row; its base-36 form is the Busy page's thread id.
    pub seq: u64,
    /// Set for a job Sidekiq's `cancel!` can reach (a plain async job): the heartbeat's check reads its
    /// jid here ([`WorkTable::check_cancels`]). Shared with the run, so a row costs no copy of the jid.
    cancel: Option<Arc<Job>>,
    /// Set by the heartbeat's check once the job's `it-<jid>` hash holds `cancelled`.
    cancelled: bool,
}

impl Running {
    /// The Busy-page thread id (Ruby's `tid` is base 36 too).
    pub(crate) fn tid(&self) -> String {
        to_base36(self.seq)
    }
}

/// The jobs currently in flight, for the Busy page and the shutdown.
#[derive(Debug)]
pub(crate) struct WorkTable {
    /// In-flight jobs by sequence number.
    map: Mutex<foldhash::HashMap<u64, Running>>,
    /// Next sequence number.
    next: AtomicU64,
    /// How many tables share the process's thread ids, and this one's place among them: row `k` of
    /// this table is number `k * stride + offset`, so the capsules' tables never give two running
    /// jobs the same Busy-page thread id (the work hash's field). `(1, 0)` for a process of one capsule.
    stride: u64,
    offset: u64,
    /// Rung by the heartbeat's check when it marks a row cancelled: every job waiting for a cancel
    /// ([`WorkTable::cancelled`]) looks at its own row then. One bell for the table, not a signal per
    /// job: a job that ends before its first await point (most) never touches it.
    bell: Notify,
}

impl Default for WorkTable {
    fn default() -> Self {
        WorkTable::striped(0, 1)
    }
}

impl WorkTable {
    /// The table of capsule `index` of `count`: its thread ids are distinct from the others'.
    pub(crate) fn striped(index: usize, count: usize) -> Self {
        WorkTable {
            map: Mutex::default(),
            next: AtomicU64::new(0),
            stride: count.max(1) as u64,
            offset: index as u64,
            bell: Notify::new(),
        }
    }

    /// Adds a job that starts now; returns its row's sequence number. `cancel` is the job when
    /// Sidekiq's `cancel!` can reach it (a plain async job).
    pub(crate) fn insert(&self, unit: UnitOfWork, cancel: Option<Arc<Job>>) -> u64 {
        let seq = self.next.fetch_add(1, Ordering::Relaxed) * self.stride + self.offset + 1;
        let row = Running {
            unit,
            // Whole seconds straight from the system clock: `time::now()` goes through chrono's
            // calendar (about 200 instructions a job against about 60), for a value truncated anyway.
            run_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64),
            seq,
            cancel,
            cancelled: false,
        };
        if let Ok(mut m) = self.map.lock() {
            m.insert(seq, row);
        }
        seq
    }

    /// Takes a row out: the job, once (a second call finds nothing).
    pub(crate) fn remove(&self, seq: u64) -> Option<UnitOfWork> {
        self.map
            .lock()
            .ok()
            .and_then(|mut m| m.remove(&seq))
            .map(|r| r.unit)
    }

    /// A copy of every in-flight job.
    pub(crate) fn snapshot(&self) -> Vec<Running> {
        self.map
            .lock()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }

    /// How many jobs are in flight.
    pub(crate) fn len(&self) -> usize {
        self.map.lock().map(|m| m.len()).unwrap_or(0)
    }

    /// Whether the heartbeat's check found row `seq`'s cancel mark.
    fn is_cancelled(&self, seq: u64) -> bool {
        self.map
            .lock()
            .map(|m| m.get(&seq).is_some_and(|r| r.cancelled))
            .unwrap_or(false)
    }

    /// Resolves once Sidekiq's `cancel!` reached the job of row `seq` (a mark found before this is
    /// first polled counts too). Polled only once the job's worker awaits: a job that returns at its
    /// first poll pays nothing for being cancellable.
    pub(crate) async fn cancelled(&self, seq: u64) {
        loop {
            let rung = self.bell.notified();
            let mut rung = std::pin::pin!(rung);
            // Listening before looking: a mark set between the look and the wait still wakes it.
            rung.as_mut().enable();
            if self.is_cancelled(seq) {
                return;
            }
            rung.await;
        }
    }

    /// Sidekiq's `cancel!` for plain jobs: one pipelined `HGET it-<jid> cancelled` per cancellable
    /// running job (none sent when there is none), marking the row of each job whose hash holds the
    /// mark and ringing the bell; the job is dropped at its next await point. The heartbeat calls it
    /// once per beat.
    pub(crate) async fn check_cancels(&self, conn: &mut Conn) -> crate::error::Result<()> {
        let rows: Vec<(u64, Arc<Job>)> = match self.map.lock() {
            Ok(m) => m
                .values()
                .filter(|r| !r.cancelled)
                .filter_map(|r| r.cancel.clone().map(|j| (r.seq, j)))
                .collect(),
            Err(_) => return Ok(()),
        };
        if rows.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for (_, job) in &rows {
            pipe.cmd("HGET")
                .arg(keys::iteration(job.jid()))
                .arg("cancelled");
        }
        // Each read on its own: an `it-<jid>` key of another type (a key of another app, a damaged
        // one) fails its own `HGET` only, not the check of every other running job.
        let marks: Vec<redis::RedisResult<Option<String>>> =
            pipe.ignore_errors().query_async(conn).await?;
        let mut rang = false;
        if let Ok(mut m) = self.map.lock() {
            for ((seq, job), mark) in rows.iter().zip(marks) {
                let mark = match mark {
                    Ok(mark) => mark,
                    Err(e) => {
                        // Loud, naming the key: a beat's line per such job while it runs (rare).
                        tracing::warn!(key = %keys::iteration(job.jid()), error = %e,
                            "cannot read Sidekiq's cancel mark (the key is not a hash): this running \
                             job cannot be cancelled");
                        None
                    }
                };
                if let (Some(_), Some(row)) = (mark, m.get_mut(seq)) {
                    row.cancelled = true;
                    rang = true;
                }
            }
        }
        if rang {
            self.bell.notify_waiters();
        }
        Ok(())
    }

    /// Takes every in-flight job out of the table (for the push-back).
    pub(crate) fn drain(&self) -> Vec<Running> {
        self.map
            .lock()
            .map(|mut m| m.drain().map(|(_, v)| v).collect())
            .unwrap_or_default()
    }
}

impl crate::worker::CancelSource for WorkTable {
    fn wait_cancel(&self, row: u64) -> crate::worker::BoxFuture<'_, ()> {
        Box::pin(self.cancelled(row))
    }
}
