//! Push-back of reliable fetch: requeues, the sweeps of lost and held lists, and the held lists' index.

use redis::Script;

use super::super::UnitOfWork;
use super::batch::HeldList;
use super::{Reliable, poisoned};
use crate::error::Result;
use crate::keys;
use crate::lua::{lua_common, script_error};
use crate::redis_conn::Conn;

/// Pushes every job of this process's own batch list KEYS[1] (in serve order, as every list of this
/// release) not in its acks set KEYS[2] (or of its landing list KEYS[1], given as KEYS[2] too) back to
/// queue KEYS[3], so that it serves them again in the order it served them, without counting it as a
/// recovery (so no counts hash and no dead set: KEYS[1] stands in for both, never touched with a limit
/// of -1). Returns {moved, error}.
pub(super) const MOVE_BACK_LUA: &str = concat!(
    lua_common!(),
    super::super::lua_move_back!(),
    r#"
local m, _, err = move_back(KEYS[1], KEYS[2], KEYS[3], KEYS[3], true, -1, KEYS[1], KEYS[1], '0', '0', 0, '', '')
return {m, err or ''}
"#
);

/// Pushes back the jobs at places ARGV of batch list KEYS[1] to the served end of queue KEYS[3], in the
/// order given (the caller gives the last served first, so the first served is served first again),
/// each only if it is still there (the list reaches its place and acks set KEYS[2] does not hold it),
/// the push before the place is added to the acks set. Returns {moved, error}.
pub(super) const PUSH_BACK_LUA: &str = concat!(lua_common!(), include_str!("push_back.lua"));

/// Orders batch lists the newest batch first: pushed back in this order, each to the served end of its
/// queue, the oldest batch's jobs are served first again.
pub(super) fn newest_first(lists: &mut [HeldList]) {
    let batch = |key: &str| {
        key.rsplit_once(":@")
            .and_then(|(_, n)| n.parse::<u64>().ok())
            .unwrap_or(0)
    };
    lists.sort_by_key(|l| std::cmp::Reverse(batch(&l.key)));
}

/// A sweep's outcome: `moved` when nothing failed; else the first outage among `errors` (so the sweep
/// is retried), or all of them as one error.
pub(super) fn sweep_result(moved: u64, errors: Vec<crate::Error>) -> Result<u64> {
    if errors.is_empty() {
        return Ok(moved);
    }
    let joined = errors
        .iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("; ");
    match errors.into_iter().find(|e| e.is_outage()) {
        Some(outage) => Err(outage),
        None => Err(script_error(joined)),
    }
}

/// Runs [`PUSH_BACK_LUA`] for `places` of batch list `key` (acks set `acks`) into `queue`: (moved, error
/// or empty).
pub(super) async fn push_back(
    conn: &mut Conn,
    key: &str,
    acks: &str,
    queue: &str,
    places: &[u64],
) -> Result<(u64, String)> {
    let script = Script::new(PUSH_BACK_LUA);
    let mut moved = 0;
    // Bounded argument lists, whatever the number of jobs.
    for chunk in places.chunks(1000) {
        let mut inv = script.key(key);
        inv.key(acks).key(keys::queue(queue));
        for p in chunk {
            inv.arg(p);
        }
        let (n, err): (u64, String) = inv.invoke_async(conn).await?;
        moved += n;
        if !err.is_empty() {
            return Ok((moved, err));
        }
    }
    Ok((moved, String::new()))
}

impl Reliable {
    /// Each job moves from its batch list in a script, the push before it is marked done, and only if it
    /// is still there (a recovery may have pushed it back already); a queue key of the wrong type leaves
    /// its jobs in the list and is an error naming it.
    pub(super) async fn requeue(&self, units: &[UnitOfWork]) -> Result<u64> {
        let mut conn = self.conn.clone();
        let mut moved = 0;
        let mut errors = Vec::new();
        let mut emptied = Vec::new();
        for (batch, places) in Self::by_batch(units) {
            let found = self.held.lock().ok().and_then(|h| {
                h.open
                    .get(&batch)
                    .map(|b| (b.key.clone(), b.acks.clone(), b.queue.clone()))
            });
            let Some((key, acks, queue)) = found else {
                continue;
            };
            let (n, err) = push_back(&mut conn, &key, &acks, &queue, &places).await?;
            moved += n;
            if err.is_empty() {
                if let Some(keys) = self.settle(batch, &places) {
                    emptied.push(keys);
                }
            } else {
                errors.push(err);
            }
        }
        self.delete_emptied(emptied).await?;
        if errors.is_empty() {
            Ok(moved)
        } else {
            Err(script_error(errors.join("; ")))
        }
    }

    /// Pushes back every job of `lists` not marked done, each list by one script; the lists that could
    /// not be moved are returned with the errors.
    pub(super) async fn move_back(
        &self,
        lists: Vec<HeldList>,
    ) -> (u64, Vec<HeldList>, Vec<crate::Error>) {
        let mut conn = self.conn.clone();
        let script = Script::new(MOVE_BACK_LUA);
        let (mut moved, mut kept, mut errors) = (0, Vec::new(), Vec::new());
        // Batch lists moved whole (deleted): their entries leave the index.
        let mut gone: Vec<String> = Vec::new();
        for list in lists {
            let r: redis::RedisResult<(u64, String)> = script
                .key(&list.key)
                .key(&list.acks)
                .key(keys::queue(&list.queue))
                .invoke_async(&mut conn)
                .await;
            match r {
                Ok((m, err)) => {
                    moved += m;
                    if !err.is_empty() {
                        errors.push(script_error(err));
                        kept.push(list);
                    } else if list.key.starts_with(&self.batch_prefix) {
                        gone.push(list.key);
                    }
                }
                Err(e) => {
                    // Kept as Redis's error: a lost connection must stay an outage, which the sweeps
                    // retry (flattened into a message it read as a wrong-type key, and the quiet sweep
                    // gave up at once).
                    tracing::warn!(key = %list.key, error = %e, "could not push back a list");
                    errors.push(e.into());
                    kept.push(list);
                }
            }
        }
        if !gone.is_empty() {
            let _: redis::RedisResult<()> =
                redis::AsyncCommands::srem(&mut conn, &self.index, gone).await;
        }
        (moved, kept, errors)
    }

    /// Pushes back the lists of fetches whose reply never came (nothing in them was handed out), and
    /// any other list of this process that it does not know ([`Reliable::strays`]).
    pub(super) async fn reconcile_now(&self) -> Result<u64> {
        // A read of the index that fails (a damaged key, an ACL refusing it) must not keep the lists this
        // process knows are lost from going back, nor fail the sweep it is part of (the quiet sweep would
        // then leave its unstarted jobs held, and every stop would call itself cut short): the look for
        // strays is an extra, its failure logged here.
        let strays = match self.strays().await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, key = %self.index,
                    "cannot read this process's index of held lists for stray batch lists; only the ones it knows are pushed back");
                Vec::new()
            }
        };
        let mut lost = match self.held.lock() {
            Ok(mut h) => std::mem::take(&mut h.lost),
            Err(_) => return Err(poisoned()),
        };
        for s in strays {
            if !lost.iter().any(|l| l.key == s.key) {
                lost.push(s);
            }
        }
        newest_first(&mut lost);
        let (moved, kept, errors) = self.move_back(lost).await;
        if let Ok(mut h) = self.held.lock() {
            h.lost.extend(kept);
        }
        sweep_result(moved, errors)
    }

    /// The landing lists, the lists of fetches whose reply never came, then (with `everything`) every job
    /// of every batch list not marked done. Not counted as recoveries.
    /// Keeps this process's index of held lists ([`keys::held_index`]) true enough for recovery, at each
    /// of its own recovery passes: it adds its landing lists to the index (again: a recovery that took
    /// the process for dead removed it; [`super::super::mark_alive`] adds it to [`keys::HOLDERS`] at each beat),
    /// and drops the entries of batch lists
    /// it no longer holds whose key is gone (a push-back's `DEL` leaves its entry). An entry of a list it
    /// does not know but that still exists (a fetch whose reply was lost) stays. Costs what the index
    /// holds, whatever else Redis holds.
    pub(super) async fn tidy_index(&self) -> Result<()> {
        let mut conn = self.conn.clone();
        let mut pipe = redis::pipe();
        let landing: Vec<String> = self
            .names
            .iter()
            .map(|q| format!("{}{q}", self.landing_prefix))
            .collect();
        pipe.sadd(&self.index, &landing).ignore();
        pipe.smembers(&self.index);
        // As bytes: a member that is not UTF-8 (no list of ours) is left alone, not a failure of every
        // pass (review of issue 43).
        let (members,): (Vec<Vec<u8>>,) = pipe.query_async(&mut conn).await?;
        let unknown: Vec<String> = {
            let h = self.held.lock().map_err(|_| poisoned())?;
            members
                .into_iter()
                .filter_map(|key| String::from_utf8(key).ok())
                .filter(|key| {
                    let Some(rest) = key.strip_prefix(&self.batch_prefix) else {
                        return false;
                    };
                    let n = rest
                        .rsplit_once(":@")
                        .and_then(|(_, n)| n.parse::<u64>().ok());
                    n.is_none_or(|n| !h.knows(n) && !h.lost.iter().any(|l| l.key == *key))
                })
                .collect()
        };
        if unknown.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for key in &unknown {
            pipe.exists(key);
        }
        let exist: Vec<bool> = pipe.query_async(&mut conn).await?;
        let gone: Vec<&String> = unknown
            .iter()
            .zip(exist)
            .filter(|(_, e)| !e)
            .map(|(k, _)| k)
            .collect();
        if !gone.is_empty() {
            let _: () = redis::AsyncCommands::srem(&mut conn, &self.index, gone).await?;
        }
        Ok(())
    }

    pub(super) async fn leftovers(&self, everything: bool) -> Result<u64> {
        let landing: Vec<_> = self
            .names
            .iter()
            .map(|q| {
                let key = format!("{}{q}", self.landing_prefix);
                HeldList {
                    key: key.clone(),
                    acks: key,
                    queue: q.clone(),
                }
            })
            .collect();
        let (mut moved, _, mut errors) = self.move_back(landing).await;
        match self.reconcile_now().await {
            Ok(n) => moved += n,
            Err(e) => errors.push(e),
        }
        if everything {
            let mut open: Vec<_> = match self.held.lock() {
                Ok(mut h) => h
                    .open
                    .drain()
                    .map(|(_, b)| HeldList {
                        key: b.key,
                        acks: b.acks,
                        queue: b.queue,
                    })
                    .collect(),
                Err(_) => return Err(poisoned()),
            };
            newest_first(&mut open);
            let (m, kept, errs) = self.move_back(open).await;
            moved += m;
            errors.extend(errs);
            // What could not move stays a known list: a later sweep tries again.
            if let Ok(mut h) = self.held.lock() {
                h.lost.extend(kept);
            }
        }
        sweep_result(moved, errors)
    }
}
