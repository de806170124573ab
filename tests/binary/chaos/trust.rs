//! Issue 43: trust at fleet scale. Drawn from a generator of its own (so every other draw of a seed is
//! what it was before): damaged acks sets (the acks set of a batch a live process is running made a
//! string, hash, sorted set or list) and foreign keys under the held prefixes (`oxidekiq:batch:`,
//! `oxidekiq:held:`, `oxidekiq:landing:`, `oxidekiq:acks:`, and ghost members of `oxidekiq:holders`
//! whose index is damaged or names keys of the wrong type), left so until the end; and the seed's
//! server: a share of the seeds runs on Valkey. Checked:
//!
//! - **recovery late**: a process killed (or stopped while Redis was stopped) still holds jobs in its
//!   keys [`RECOVERY_BOUND`] after the kill (more when the dead process held the recovery lock, when a
//!   pass still holds it at the bound, or
//!   Redis was stopped since): a damaged key elsewhere must cost only its own jobs;
//! - **damaged key unnamed**: a damaged acks set whose batch list a stop or a recovery left in Redis is
//!   named at ERROR by some process.
//!
//! A dead process's jobs are judged only while some live process runs recovery passes: the time every
//! live process is quiet (a quiet process runs none) is not held against a recovery, and a death still
//! unjudged when the fleet stops (every process quiet) is left to the final drain's accounting.
//!
//! A damaged acks set legitimately holds its batch in its list until an operator deletes the key
//! (docs/guarantees.md, "Damaged keys"): those lists are left out of the recovery check, and after the
//! fleet's stop the test deletes each damaged acks key as an operator would, so the final drain pushes
//! their jobs back; the jobs of such a list count as in flight at a fault (those done before the damage
//! may run again: the damaged set no longer tells which).

use super::*;

/// A seed's issue-43 fault.
#[derive(Debug, Clone, Copy)]
pub(super) enum Trust {
    /// The acks set of a running batch of the live process in this slot (modulo the slots) becomes a
    /// key of type `kind` (0 string, 1 hash, 2 sorted set, 3 list).
    Acks { slot: usize, kind: u8 },
    /// Foreign keys under the held prefixes; `mask` chooses which of [`foreign_keys`]'s.
    Foreign { mask: u8 },
}

/// Draws a seed's issue-43 faults, from a generator of its own.
pub(super) fn draw(seed: u64, procs: usize, chaos_secs: f64, events: &mut Vec<(f64, Event)>) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x0069_7373_7565_3433);
    if rng.random_bool(0.45) {
        for _ in 0..rng.random_range(1..=2) {
            events.push((
                rng.random_range(0.5..chaos_secs - 1.5),
                Event::Trust(Trust::Acks {
                    slot: rng.random_range(0..procs),
                    kind: rng.random_range(0..4),
                }),
            ));
        }
    }
    if rng.random_bool(0.45) {
        let mask = rng.random_range(1..64u8);
        events.push((
            rng.random_range(0.2..chaos_secs - 1.0),
            Event::Trust(Trust::Foreign { mask }),
        ));
    }
}

/// Whether a seed runs on Valkey: the server `OXIDEKIQ_TEST_SERVER` names when it is set, else about a
/// quarter of the seeds (from a generator of their own) on `valkey-server`, the rest on `redis-server`.
pub(super) fn server(seed: u64) -> String {
    if std::env::var(support::SERVER_VAR).is_ok_and(|v| !v.is_empty()) {
        return support::server_binary();
    }
    if StdRng::seed_from_u64(seed ^ 0x0076_616c_6b65_7933).random_bool(0.25) {
        let found = Command::new("valkey-server")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if found {
            return "valkey-server".into();
        }
        eprintln!(
            "chaos: seed {seed} draws Valkey, but valkey-server is not installed: it runs on Redis"
        );
    }
    "redis-server".into()
}

/// How long after a kill a dead process's jobs may still be in its keys: its liveness key's TTL, the
/// recovery grace (the same TTL: a pass marks it suspect, a pass a grace later pushes its jobs back),
/// two recovery intervals (two beats each, jittered up to 25% longer), and a margin for a loaded
/// 2-core machine and the reconnects after a client kill.
pub(super) fn recovery_bound() -> Duration {
    liveness_ttl() * 2 + Duration::from_secs_f64(2.0 * 2.0 * BEAT_SECS * 1.25) + RECOVERY_MARGIN
}

/// See [`recovery_bound`].
const RECOVERY_MARGIN: Duration = Duration::from_secs(6);

/// The recovery lock's TTL (`RECOVERY_LOCK_TTL` in src/processing/fetch/recovery.rs): a pass that
/// holds it ends, or the lock lapses, within this.
const RECOVERY_LOCK_TTL_SECS: f64 = 30.0;

/// A killed process whose jobs recovery must push back in time.
#[derive(Debug)]
pub(super) struct Watch {
    what: String,
    pid: u32,
    /// When it died (epoch seconds): the kill, or Redis's resumption after a stop in a stall.
    at: f64,
    /// Jobs its keys held then.
    held: usize,
    /// Seconds until they were all gone, once they were.
    took: Option<f64>,
}

/// A damaged acks set and the batch list it belonged to.
#[derive(Debug)]
pub(super) struct DamagedAcks {
    pub(super) list: String,
    acks: String,
}

/// The foreign keys a [`Trust::Foreign`] may write, by bit of its mask: none holds a job, so the
/// accounting sees none of them as held. `live` is a live process's identity.
fn foreign_keys(live: &str) -> Vec<(u8, &'static str, String)> {
    let ghost = |n: u32| format!("chaos-ghost:{n}:0123456789ab");
    vec![
        // Under the batch prefix, without a batch number; and one under a live process's prefix.
        (0, "string", "oxidekiq:batch:foreign".to_string()),
        (1, "string", format!("oxidekiq:batch:{live}:chaos0:junk")),
        // A "batch list" of a process that never lived, of the wrong type (found by the walk).
        (2, "zset", format!("oxidekiq:batch:{}:chaos0:@7", ghost(1))),
        // A ghost holder whose index is a string; another whose index names a key of the wrong type.
        (3, "holder-string-index", ghost(2)),
        (4, "holder-set-index", ghost(3)),
        // A landing list of the wrong type, an acks set of no batch.
        (5, "zset", format!("oxidekiq:landing:{}:chaos0", ghost(4))),
    ]
}

impl Run<'_> {
    /// Runs a [`Trust`] fault now (a damaged acks set needs a running batch: it is tried again at each
    /// look of the wait loop for up to three seconds, see [`Run::retry_trust`]).
    pub(super) fn trust(&mut self, t: Trust) {
        match t {
            Trust::Acks { .. } => {
                if !self.damage_acks(t) {
                    self.trust_pending
                        .push((Instant::now() + Duration::from_secs(3), t));
                }
            }
            Trust::Foreign { mask } => self.foreign(mask),
        }
    }

    /// Tries the damaged acks sets that found no running batch yet; gives up on each after its time.
    pub(super) fn retry_trust(&mut self) {
        let pending = std::mem::take(&mut self.trust_pending);
        for (until, t) in pending {
            if self.damage_acks(t) {
                continue;
            }
            if Instant::now() < until {
                self.trust_pending.push((until, t));
            } else {
                self.trust_notes.push("acks:no-batch".into());
            }
        }
    }

    /// Makes the acks set of a batch list the slot's process holds (read from its index) a key of
    /// another type, in one script that first checks the list holds jobs. False when none did.
    fn damage_acks(&mut self, t: Trust) -> bool {
        let Trust::Acks { slot, kind } = t else {
            return true;
        };
        let slot = slot % self.procs.len();
        let Some(identity) = self.procs[slot].as_ref().map(|p| p.identity.clone()) else {
            return false;
        };
        let index: Vec<String> = self
            .c
            .smembers(format!("oxidekiq:held:{identity}"))
            .unwrap_or_default();
        let lists: Vec<String> = index
            .into_iter()
            .filter(|k| k.starts_with("oxidekiq:batch:"))
            .filter(|k| !self.damaged_acks.iter().any(|d| d.list == *k))
            .collect();
        if lists.is_empty() {
            return false;
        }
        let script = redis::Script::new(
            r"
for i = 1, #KEYS, 2 do
  local list, acks = KEYS[i], KEYS[i + 1]
  if redis.call('TYPE', list).ok == 'list' and redis.call('LLEN', list) > 0 then
    redis.call('DEL', acks)
    if ARGV[1] == '0' then redis.call('SET', acks, 'chaos-damaged')
    elseif ARGV[1] == '1' then redis.call('HSET', acks, 'chaos', 'damaged')
    elseif ARGV[1] == '2' then redis.call('ZADD', acks, 1, 'chaos-damaged')
    else redis.call('RPUSH', acks, 'chaos-damaged') end
    return {list, acks}
  end
end
return {}",
        );
        let mut inv = script.prepare_invoke();
        for l in &lists {
            inv.key(l)
                .key(l.replacen("oxidekiq:batch:", "oxidekiq:acks:", 1));
        }
        let hit: Vec<String> = inv.arg(kind).invoke(&mut self.c).unwrap_or_default();
        let [list, acks] = <[String; 2]>::try_from(hit).unwrap_or_default();
        if list.is_empty() {
            return false;
        }
        self.trust_notes.push(format!(
            "acks:{}",
            ["string", "hash", "zset", "list"][kind as usize % 4]
        ));
        self.damaged_acks.push(DamagedAcks { list, acks });
        true
    }

    /// Writes the foreign keys `mask` chooses (see [`foreign_keys`]).
    fn foreign(&mut self, mask: u8) {
        let live = self
            .procs
            .iter()
            .flatten()
            .next()
            .map_or("chaos-none:1:0".to_string(), |p| p.identity.clone());
        let mut pipe = redis::pipe();
        for (bit, kind, key) in foreign_keys(&live) {
            if mask & (1 << bit) == 0 {
                continue;
            }
            match kind {
                "string" => {
                    pipe.set(&key, "chaos-foreign").ignore();
                }
                "zset" => {
                    pipe.zadd(&key, "chaos-foreign", 1).ignore();
                }
                "holder-string-index" => {
                    pipe.sadd("oxidekiq:holders", &key).ignore();
                    pipe.set(format!("oxidekiq:held:{key}"), "chaos-foreign")
                        .ignore();
                }
                _ => {
                    // The index names a batch list that is a string, and an acks set of no batch.
                    let list = format!("oxidekiq:batch:{key}:chaos0:@3");
                    pipe.sadd("oxidekiq:holders", &key).ignore();
                    pipe.sadd(format!("oxidekiq:held:{key}"), &list).ignore();
                    pipe.set(&list, "chaos-foreign").ignore();
                    pipe.set(format!("oxidekiq:acks:{key}:chaos0:@4"), "chaos-foreign")
                        .ignore();
                }
            }
            self.trust_notes.push(format!("foreign:{bit}"));
        }
        let _: () = pipe.query(&mut self.c).unwrap();
    }

    /// Starts watching a process that just died (`at`: when, epoch seconds): its jobs must leave its
    /// keys within [`recovery_bound`]. If it held the recovery lock, nobody recovers until that lapses.
    pub(super) fn watch_recovery(&mut self, what: String, pid: u32, identity: &str, at: f64) {
        let held = self.recoverable(pid).len();
        let holder: Option<String> = redis::cmd("GET")
            .arg("oxidekiq:recovery-lock")
            .query(&mut self.c)
            .unwrap_or(None);
        if holder.as_deref() == Some(identity) {
            let ttl: i64 = self.c.pttl("oxidekiq:recovery-lock").unwrap_or(0);
            self.lock_free_at = self.lock_free_at.max(now() + ttl.max(0) as f64 / 1000.0);
        }
        self.watches.push(Watch {
            what,
            pid,
            at,
            held,
            took: None,
        });
    }

    /// The jobs a dead process's keys hold that recovery must push back: all but those of a list whose
    /// acks set is damaged (held until an operator deletes the key).
    fn recoverable(&mut self, pid: u32) -> Vec<HeldJob> {
        let jobs = held_jobs(&mut self.c, Some(pid));
        jobs.into_iter()
            .filter(|j| !self.damaged_acks.iter().any(|d| d.list == j.key))
            .collect()
    }

    /// When the jobs of a process that died at `at` must be back: [`recovery_bound`] after its death or
    /// after the recovery lock a dead process held lapsed, plus every Redis stop since (no pass runs
    /// while Redis is stopped, and the fleet's liveness keys lapse with it) and every while no live
    /// process ran recovery passes (all of them quiet: a quiet process runs none).
    fn recovery_deadline(&self, at: f64) -> f64 {
        let paused: f64 = self
            .paused
            .iter()
            .filter(|(end, _)| *end > at)
            .map(|(end, len)| len.min(end - at))
            .sum();
        let unattended = self
            .unattended_from
            .map_or(0.0, |from| now() - from.max(at));
        at.max(self.lock_free_at) + recovery_bound().as_secs_f64() + paused + unattended
    }

    /// Notes whether some live process runs recovery passes (one that is not quiet), after a quiet,
    /// a kill or a stop: the time none does is not held against a recovery.
    pub(super) fn note_recoverers(&mut self) {
        let any = self.procs.iter().flatten().any(|p| !p.quiet);
        match (any, self.unattended_from) {
            (false, None) => self.unattended_from = Some(now()),
            (true, Some(from)) => {
                let t = now();
                self.paused.push((t, t - from));
                self.unattended_from = None;
            }
            _ => {}
        }
    }

    /// Looks at every dead process not yet judged: recovered (its keys hold nothing recovery must move),
    /// or late (past its deadline, a finding).
    pub(super) fn check_recoveries(&mut self) {
        for i in 0..self.watches.len() {
            if self.watches[i].took.is_some() {
                continue;
            }
            let (pid, at) = (self.watches[i].pid, self.watches[i].at);
            let left = self.recoverable(pid);
            let t = now();
            if left.is_empty() {
                self.watches[i].took = Some(t - at);
                continue;
            }
            let deadline = self.recovery_deadline(at);
            if t > deadline {
                let keys: HashSet<&str> = left.iter().map(|j| j.key.as_str()).collect();
                let lock: Option<String> = redis::cmd("GET")
                    .arg("oxidekiq:recovery-lock")
                    .query(&mut self.c)
                    .unwrap_or(None);
                // A pass holds the recovery lock: it is under way (a walk, or a pass slowed by a
                // loaded machine: CI saw one 0.2 s past the bound), and either ends or its lock lapses
                // within the lock's TTL. Judged after that, not during it.
                if lock.is_some() && t <= deadline + RECOVERY_LOCK_TTL_SECS {
                    continue;
                }
                self.findings.push(format!(
                    "RECOVERY LATE: {} ({} job(s) held at its death): {} job(s) still in its keys \
                     {:.1}s after it (bound {:.1}s): {:?}, recovery lock {lock:?}",
                    self.watches[i].what,
                    self.watches[i].held,
                    left.len(),
                    t - at,
                    deadline - at,
                    keys.iter().take(4).collect::<Vec<_>>(),
                ));
                // Judged: a late recovery is one finding, not one per look.
                self.watches[i].took = Some(f64::INFINITY);
            }
        }
    }

    /// Waits (looking every quarter second) until every dead process is judged by
    /// [`Run::check_recoveries`]: before the fleet's stop, which ends the recovery passes. Not while
    /// every live process is quiet: nothing recovers then until the final drain (those stay unjudged).
    pub(super) fn wait_recoveries(&mut self) {
        while self.unattended_from.is_none() && self.watches.iter().any(|w| w.took.is_none()) {
            self.check_recoveries();
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// After the fleet stopped: every damaged acks set whose list is still in Redis was named at ERROR
    /// by some process; then the operator deletes it, and the jobs of its list (done or not: the
    /// damaged set no longer tells) count as in flight, as the final drain pushes them back.
    pub(super) fn repair_acks(&mut self) {
        for d in std::mem::take(&mut self.damaged_acks) {
            let kind: String = redis::cmd("TYPE")
                .arg(&d.list)
                .query(&mut self.c)
                .unwrap_or_default();
            if kind != "list" {
                // The process finished the batch: its last ack deleted the list and the damaged key.
                let _: () = self.c.del(&d.acks).unwrap_or(());
                self.trust_notes.push("acks:finished".into());
                continue;
            }
            let named = self.logs.iter().any(|(_, log)| {
                log.lines()
                    .any(|l| l.contains("ERROR") && l.contains(&d.acks))
            });
            if !named {
                self.findings.push(format!(
                    "DAMAGED KEY UNNAMED: {} (the acks set of {}, left in Redis) was never named at ERROR",
                    d.acks, d.list
                ));
            }
            let jobs: Vec<String> = self.c.lrange(&d.list, 0, -1).unwrap_or_default();
            let jids: HashSet<String> = jobs.iter().filter_map(|j| jid_of(j)).collect();
            self.trust_notes.push(format!("acks:held{}", jids.len()));
            let _: () = self.c.del(&d.acks).unwrap();
            self.faults.push(Fault {
                what: format!("operator-del {}", d.acks),
                inflight: jids.len(),
                jids,
            });
        }
    }

    /// `recovered=N/M(max Xs)`, and the issue-43 faults the seed ran, for its summary line.
    pub(super) fn trust_summary(&self) -> String {
        let judged: Vec<f64> = self
            .watches
            .iter()
            .filter_map(|w| w.took)
            .filter(|t| t.is_finite())
            .collect();
        let max = judged.iter().copied().fold(0.0, f64::max);
        format!(
            "recovered-in-time={}/{} (slowest {max:.1}s, bound {:.0}s{}) trust={:?}",
            judged.len(),
            self.watches.len(),
            recovery_bound().as_secs_f64(),
            if self.unattended_from.is_some() {
                ", every live process quiet at the end"
            } else {
                ""
            },
            self.trust_notes
        )
    }
}
