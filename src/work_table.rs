//! The work table: the jobs in flight in this process (running, or whose fate is not yet in Redis), for
//! the Busy page (the heartbeat's work hash), TTIN, `/metrics` and the push-back at shutdown.
//!
//! Its own room in the processing layer (docs/layout.md), below the processor that fills and empties
//! it and the manager that drains it at shutdown, so that the processor needs no path to the manager.

use std::sync::{Arc, Mutex};

use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::Notify;

use crate::fetch::UnitOfWork;
use crate::keys;
use crate::redis_conn::Conn;
use crate::text::to_base36;
use crate::time;

/// A job that is running or whose fate is not yet in Redis: a row of the work table.
#[derive(Debug, Clone)]
pub(crate) struct Running {
    /// The job.
    pub unit: UnitOfWork,
    /// Epoch seconds when it started (`run_at` of the work hash).
    pub run_at: i64,
    /// Sequence number of the row; its base-36 form is the Busy page's thread id.
    pub seq: u64,
}

impl Running {
    /// The Busy-page thread id (Ruby's `tid` is base 36 too).
    pub(crate) fn tid(&self) -> String {
        to_base36(self.seq)
    }
}

/// The jobs currently in flight, for the Busy page and the shutdown.
#[derive(Debug, Default)]
pub(crate) struct WorkTable {
    /// In-flight jobs by sequence number.
    map: Mutex<foldhash::HashMap<u64, Running>>,
    /// Next sequence number.
    next: AtomicU64,
    /// Running jobs that Sidekiq's `cancel!` can reach (plain async jobs), by row: their jid and the
    /// signal the heartbeat's check fires ([`WorkTable::check_cancels`]).
    cancels: Mutex<foldhash::HashMap<u64, (String, Arc<Notify>)>>,
}

/// A running job's hold on its cancellation signal; leaves the table when dropped.
#[derive(Debug)]
pub(crate) struct CancelGuard<'t> {
    table: &'t WorkTable,
    seq: u64,
    /// Fired once the job's `it-<jid>` hash holds `cancelled`.
    pub signal: Arc<Notify>,
}

impl Drop for CancelGuard<'_> {
    fn drop(&mut self) {
        if let Ok(mut c) = self.table.cancels.lock() {
            c.remove(&self.seq);
        }
    }
}

impl WorkTable {
    /// Adds a job that starts now; returns its row's sequence number.
    pub(crate) fn insert(&self, unit: UnitOfWork) -> u64 {
        let seq = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let row = Running {
            unit,
            run_at: time::now() as i64,
            seq,
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

    /// Makes the running job of row `seq` reachable by Sidekiq's `cancel!` until the guard drops.
    pub(crate) fn cancellable(&self, seq: u64, jid: &str) -> CancelGuard<'_> {
        let signal = Arc::new(Notify::new());
        if let Ok(mut c) = self.cancels.lock() {
            c.insert(seq, (jid.to_string(), signal.clone()));
        }
        CancelGuard {
            table: self,
            seq,
            signal,
        }
    }

    /// Sidekiq's `cancel!` for plain jobs: one pipelined `HGET it-<jid> cancelled` per cancellable
    /// running job (none sent when there is none), firing the signal of each job whose hash holds the
    /// mark; the job is dropped at its next await point. The heartbeat calls it once per beat.
    pub(crate) async fn check_cancels(&self, conn: &mut Conn) -> crate::error::Result<()> {
        let rows: Vec<(u64, String)> = match self.cancels.lock() {
            Ok(c) => c.iter().map(|(s, (j, _))| (*s, j.clone())).collect(),
            Err(_) => return Ok(()),
        };
        if rows.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for (_, jid) in &rows {
            pipe.cmd("HGET").arg(keys::iteration(jid)).arg("cancelled");
        }
        // Each read on its own: an `it-<jid>` key of another type (a key of another app, a damaged
        // one) fails its own `HGET` only, not the check of every other running job.
        let marks: Vec<redis::RedisResult<Option<String>>> =
            pipe.ignore_errors().query_async(conn).await?;
        if let Ok(c) = self.cancels.lock() {
            for ((seq, jid), mark) in rows.iter().zip(marks) {
                let mark = match mark {
                    Ok(mark) => mark,
                    Err(e) => {
                        // Loud, naming the key: a beat's line per such job while it runs (rare).
                        tracing::warn!(key = %keys::iteration(jid), error = %e,
                            "cannot read Sidekiq's cancel mark (the key is not a hash): this running \
                             job cannot be cancelled");
                        None
                    }
                };
                if let (Some(_), Some((_, signal))) = (mark, c.get(seq)) {
                    signal.notify_one();
                }
            }
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
