//! The payload size bound of a batch list's copy: the budget and limit, and the server's list
//! compression, which `MEMORY USAGE` under-counts.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::super::BATCH_BYTES;
use super::Reliable;

/// How many bytes one list element may hold for each byte that `MEMORY USAGE` counts of its list, when
/// the server compresses list nodes (`list-compress-depth` > 0; Valkey 9.1's `SORT .. STORE` builds its
/// list so, Redis 7.0's does not). A compressed node counts its compressed bytes, and LZF, the
/// compressor of Redis's and Valkey's lists, writes at least 3 bytes for each 264 it reads (its longest
/// back reference), so an element holds at most 88 bytes per byte counted: a 100 MB payload of one
/// repeated character counts about 1.2 MB.
pub(super) const COMPRESSED_RATIO: usize = 88;

/// How often the fetcher reads the server's `list-compress-depth` again ([`Reliable::read_list_config`]).
pub(super) const LIST_CONFIG_EVERY: Duration = Duration::from_secs(10);

impl Reliable {
    /// The most payload bytes one fetch takes (it always takes one job).
    pub(super) fn budget(&self) -> usize {
        BATCH_BYTES.max(self.max_payload_bytes)
    }

    /// The most bytes a batch list's copy may hold for the fast path to read it: the payload limit, or
    /// the budget when there is no limit.
    pub(super) fn cap(&self) -> usize {
        match self.max_payload_bytes {
            0 => self.budget(),
            limit => limit.min(self.budget()),
        }
    }

    /// The most `MEMORY USAGE` a fast-path copy may have for the guard to pass it: [`Reliable::cap`] over
    /// the bytes an element may hold per byte counted (1, or [`COMPRESSED_RATIO`]).
    pub(super) fn room(&self) -> usize {
        self.cap() / self.mem_ratio.load(Ordering::Relaxed).max(1)
    }

    /// The `room` that sizes batches ([`fast_batch`]): [`Reliable::room`] while the server may compress
    /// lists, so a batch of jobs within the limit is copied whole rather than read job by job through Lua
    /// at every fetch; no bound otherwise (a batch that could hold a payload over the limit is read job
    /// by job, as it was before compressed lists were accounted for).
    ///
    /// [`fast_batch`]: super::fast::fast_batch
    pub(super) fn batch_room(&self) -> usize {
        match self.mem_ratio.load(Ordering::Relaxed) {
            0 | 1 => usize::MAX,
            _ => self.room(),
        }
    }

    /// Reads the server's `list-compress-depth` (at the first fetch, then every [`LIST_CONFIG_EVERY`]):
    /// the size guards judge a batch list by `MEMORY USAGE`, which counts a compressed node's compressed
    /// bytes, so a copy of a 100 MB payload of one repeated character would pass a 16 MB limit by 80
    /// times. While the server says 0 (no list compressed: the default of Redis and Valkey), every job
    /// of a copy is at most its `MEMORY USAGE`; otherwise, and when the server refuses `CONFIG GET` (an
    /// ACL without `+config|get`, a managed service; logged once at WARN) or answers no such setting,
    /// at most [`COMPRESSED_RATIO`] times that, so copies are held to 1/88 of the limit (smaller
    /// batches; a batch over that is read job by job by the batch script, where every payload is
    /// measured). A server changed with `CONFIG SET` is seen within [`LIST_CONFIG_EVERY`].
    pub(super) async fn read_list_config(&self) {
        let due = self.list_config_read.lock().is_ok_and(|mut read| {
            let due = read.is_none_or(|t| t.elapsed() >= LIST_CONFIG_EVERY);
            if due {
                *read = Some(Instant::now());
            }
            due
        });
        if !due {
            return;
        }
        let reply: redis::RedisResult<std::collections::HashMap<String, String>> =
            redis::cmd("CONFIG")
                .arg("GET")
                .arg("list-compress-depth")
                .query_async(&mut self.conn.clone())
                .await;
        let ratio = match reply {
            Ok(config) => match config
                .get("list-compress-depth")
                .and_then(|v| v.trim().parse::<i64>().ok())
            {
                Some(0) => 1,
                _ => COMPRESSED_RATIO,
            },
            Err(e) if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() => {
                // The connection failed: read again at the next fetch, judging as if compressed meanwhile.
                if let Ok(mut read) = self.list_config_read.lock() {
                    *read = None;
                }
                COMPRESSED_RATIO
            }
            Err(e) => {
                if !self.list_config_warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, ratio = COMPRESSED_RATIO,
                        "redis refused CONFIG GET list-compress-depth: the payload size guard assumes lists may be compressed, so a batch is copied whole only up to 1/ratio of the payload limit (allow +config|get to lift this)");
                }
                COMPRESSED_RATIO
            }
        };
        self.mem_ratio.store(ratio, Ordering::Relaxed);
    }
}
