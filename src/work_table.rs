//! The work table: the jobs in flight in this process (running, or whose fate is not yet in Redis), for
//! the Busy page (the heartbeat's work hash), TTIN, `/metrics` and the push-back at shutdown.
//!
//! Its own room in the processing layer (docs/layout.md), below the processor that fills and empties
//! it and the manager that drains it at shutdown, so that the processor needs no path to the manager.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::fetch::UnitOfWork;
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

    /// Takes every in-flight job out of the table (for the push-back).
    pub(crate) fn drain(&self) -> Vec<Running> {
        self.map
            .lock()
            .map(|mut m| m.drain().map(|(_, v)| v).collect())
            .unwrap_or_default()
    }
}
