//! The batch lists a reliable fetcher holds: their numbers, the jobs handed out of each and the places
//! settled, the fetches in flight and those whose reply never came, and the process's strays.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::super::UnitOfWork;
use super::{Reliable, poisoned};
use crate::error::Result;
use crate::keys;

/// The mask of a unit id's place in its batch list.
pub(super) const PLACE_MASK: u64 = (1 << keys::PLACE_BITS) - 1;

/// A list of this process holding jobs fetched from `queue`, with what pushes them back: a batch list
/// and its acks set (the places of its jobs already done), or a landing list, given as its own acks set
/// (it has none; the push-back script reads it so).
#[derive(Debug, Clone)]
pub(super) struct HeldList {
    /// The list.
    pub(super) key: String,
    /// Its acks set.
    pub(super) acks: String,
    /// The queue its jobs came from, and go back to.
    pub(super) queue: Arc<str>,
}

/// One batch list holding jobs handed out.
#[derive(Debug)]
pub(super) struct Batch {
    /// The list.
    pub(super) key: String,
    /// Its acks set.
    pub(super) acks: String,
    /// Its queue.
    pub(super) queue: Arc<str>,
    /// Jobs handed out from it and not yet acknowledged or pushed back; at 0 the list and its acks set
    /// are deleted.
    pub(super) left: usize,
    /// By place: whether the job was counted done. A place is counted once however often it is settled
    /// (a push-back retried whole after a later batch failed, an ack sent twice): counting it again
    /// would delete the list under a job still running.
    pub(super) settled: Vec<bool>,
}

impl Batch {
    /// How many of `places` are not yet counted done.
    pub(super) fn unsettled(&self, places: &[u64]) -> usize {
        places
            .iter()
            .filter(|p| self.settled.get(**p as usize) == Some(&false))
            .count()
    }
}

/// The batch lists a reliable fetcher (one capsule's) holds, under one lock: those with jobs handed out
/// (`open`), those a fetch may have filled without its reply reaching us (`lost`: nothing in them was
/// handed out, so all of it goes back at the next sweep), and the numbers of fetches in flight
/// (`pending`), which no sweep may take as strays.
#[derive(Debug, Default)]
pub(super) struct HeldBatches {
    /// By batch number.
    pub(super) open: foldhash::HashMap<u64, Batch>,
    /// Lists of fetches whose reply never came.
    pub(super) lost: Vec<HeldList>,
    /// `[start, end)` batch numbers of fetches in flight: lists a sweep must leave alone.
    pub(super) pending: Vec<(u64, u64)>,
}

impl HeldBatches {
    /// Whether batch `n` is one this process knows: handed out, or its fetch in flight.
    pub(super) fn knows(&self, n: u64) -> bool {
        self.open.contains_key(&n) || self.pending.iter().any(|(a, b)| (*a..*b).contains(&n))
    }
}

/// Records a fetch's lists as lost however the fetch ends without its reply being read (a cancelled
/// fetch's jobs were never handed out: the next sweep pushes them back).
pub(super) struct Reservation<'a> {
    pub(super) fetcher: &'a Reliable,
    pub(super) lists: Vec<HeldList>,
    /// Its batch numbers, `[start, end)`.
    pub(super) range: (u64, u64),
    pub(super) answered: bool,
}

impl<'a> Reservation<'a> {
    /// Reserves `lists`, numbered from `range.0`, while the fetch is in flight.
    pub(super) fn new(fetcher: &'a Reliable, lists: Vec<HeldList>, range: (u64, u64)) -> Self {
        if let Ok(mut h) = fetcher.held.lock() {
            h.pending.push(range);
        }
        Reservation {
            fetcher,
            lists,
            range,
            answered: false,
        }
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if let Ok(mut h) = self.fetcher.held.lock() {
            h.pending.retain(|r| *r != self.range);
            if !self.answered {
                h.lost.append(&mut self.lists);
            }
        }
    }
}

impl Reliable {
    /// The first of `len` consecutive batch numbers for a fetch, all inside this capsule's range
    /// ([`super::super::CAPSULE_SHIFT`]): a block that would pass the range's end starts again at its
    /// beginning, after 2^46 numbers (centuries at any fetch rate, so no list of that number still
    /// exists), and never names a list of the next capsule, whose sweeps would take it.
    pub(super) fn reserve_numbers(&self, len: u64) -> u64 {
        let len = len.max(1);
        let base = self.capsule << super::super::CAPSULE_SHIFT;
        let mut last = self.next_batch.load(Ordering::Relaxed);
        loop {
            let mut first = last.wrapping_add(1);
            let end = first.wrapping_add(len - 1);
            if super::super::capsule_of(first) != self.capsule
                || super::super::capsule_of(end) != self.capsule
                || end < first
            {
                first = base + 1;
            }
            match self.next_batch.compare_exchange_weak(
                last,
                first + len - 1,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return first,
                Err(now) => last = now,
            }
        }
    }

    /// Batch `batch`'s list for `queue` and its acks set.
    pub(super) fn lists(&self, queue: &Arc<str>, batch: u64) -> HeldList {
        let key = keys::batch_list(&self.batch_prefix, queue, batch);
        let acks = keys::acks_of(&key);
        HeldList {
            key,
            acks,
            queue: queue.clone(),
        }
    }

    /// Records the jobs of one batch list as handed out.
    pub(super) fn open(&self, batch: u64, HeldList { key, acks, queue }: HeldList, count: usize) {
        if count == 0 {
            return;
        }
        if let Ok(mut h) = self.held.lock() {
            h.open.insert(
                batch,
                Batch {
                    key,
                    acks,
                    queue,
                    left: count,
                    settled: vec![false; count],
                },
            );
        }
    }

    /// The jobs by batch, the newest batch first, each batch's places from its list's tail (a list holds
    /// its jobs in serve order): pushed back in this order, each to the served end of its queue, they
    /// are served again in the order their queue served them.
    pub(super) fn by_batch(done: &[UnitOfWork]) -> Vec<(u64, Vec<u64>)> {
        let mut out: Vec<(u64, Vec<u64>)> = Vec::new();
        for u in done {
            let (batch, place) = (u.id >> keys::PLACE_BITS, u.id & PLACE_MASK);
            match out.iter_mut().find(|(b, _)| *b == batch) {
                Some((_, places)) => places.push(place),
                None => out.push((batch, vec![place])),
            }
        }
        for (_, places) in &mut out {
            places.sort_unstable_by_key(|p| std::cmp::Reverse(*p));
            places.dedup();
        }
        out.sort_unstable_by_key(|b| std::cmp::Reverse(b.0));
        out
    }

    /// Counts `places` of `batch` as done once Redis has them; a batch with nothing left is forgotten,
    /// its keys returned for deletion.
    pub(super) fn settle(&self, batch: u64, places: &[u64]) -> Option<(String, String)> {
        let mut h = self.held.lock().ok()?;
        let b = h.open.get_mut(&batch)?;
        for p in places {
            if let Some(s) = b.settled.get_mut(*p as usize)
                && !*s
            {
                *s = true;
                b.left = b.left.saturating_sub(1);
            }
        }
        if b.left > 0 {
            return None;
        }
        h.open.remove(&batch).map(|b| (b.key, b.acks))
    }

    /// This process's batch lists in Redis that it does not know (neither handed out nor being fetched):
    /// left by a fetch whose reply never came but was not seen to fail, or brought back by a failover
    /// to a replica that had not seen their deletion. Read from its index of held lists
    /// ([`keys::held_index`]), which the write that fills a batch list fills in the same script or
    /// transaction (so a replica that has the list has its entry): what it costs follows what the
    /// process holds, not the keyspace (the stop's two sweeps each walked the whole keyspace before).
    pub(super) async fn strays(&self) -> Result<Vec<HeldList>> {
        let mut conn = self.conn.clone();
        // As bytes: a member that is not UTF-8 (no list of ours) must not make the whole index
        // unreadable as text, and the stray lists with it (review of issue 43).
        let found: Vec<Vec<u8>> = redis::cmd("SMEMBERS")
            .arg(&self.index)
            .query_async(&mut conn)
            .await?;
        let unknown: Vec<HeldList> = {
            let h = self.held.lock().map_err(|_| poisoned())?;
            found
                .into_iter()
                .filter_map(|key| String::from_utf8(key).ok())
                .filter_map(|key| {
                    let rest = key.strip_prefix(&self.batch_prefix)?;
                    let (queue, n) = rest.rsplit_once(":@")?;
                    let n: u64 = n.parse().ok()?;
                    // Another capsule's list is that capsule's to know, never this one's stray.
                    (super::super::capsule_of(n) == self.capsule && !h.knows(n)).then(|| {
                        let acks = keys::acks_of(&key);
                        HeldList {
                            key: key.clone(),
                            acks,
                            queue: Arc::from(queue),
                        }
                    })
                })
                .collect()
        };
        Ok(unknown)
    }
}
