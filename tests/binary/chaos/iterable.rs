//! Interrupts mid-iteration (issue 31), drawn into the chaos test from a generator of their own (so
//! every other draw of a seed is what it was): a few `ChaosIterJob`s (`workers/src/lib.rs`), iterable
//! jobs of a few seconds (at most 6 s of sleep, within the final drain's bound for a held job),
//! pushed at drawn times of the chaos phase (and one at its end, which the stop's TERM always meets),
//! so the kills, the quiet process, the
//! Redis stalls and the final TERM meet them mid-iteration. Checked at the end, from what each noted:
//!
//! - **iterable item skipped**: an item never started;
//! - **iterable item repeated**: a run started before the item after the last one of the run before,
//!   though that run stopped cleanly (`on_stop`: an interrupt between two items repeats nothing); a run
//!   cut off without a stop (a kill, the stop's deadline, an error) may repeat the items since its last
//!   flush, no more is checked for it than no gap;
//! - **iterable not completed once**: a job not in the retry or dead set at the end that did not
//!   complete exactly once, or whose `it-<jid>` hash is left.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redis::Commands;

/// One iterable job of the plan: `ChaosIterJob(n, sleep_ms, jid)`.
#[derive(Debug, Clone)]
pub struct IterJob {
    pub jid: String,
    pub queue: String,
    pub n: u64,
    pub sleep_ms: u64,
    /// Pushed this many seconds into the chaos phase (just before the first event due then).
    pub at: f64,
    /// Whether it was pushed yet.
    pub pushed: bool,
}

impl IterJob {
    fn payload(&self, now: f64) -> String {
        format!(
            r#"{{"retry":true,"queue":"{q}","class":"ChaosIterJob","args":[{n},{s},"{j}"],"jid":"{j}","created_at":{now},"enqueued_at":{now}}}"#,
            q = self.queue,
            n = self.n,
            s = self.sleep_ms,
            j = self.jid,
        )
    }
}

/// The seed's iterable jobs, on `queues` (the rolled-back `_rust` queue left out by the caller), each
/// due at a time of the chaos phase's first `chaos_secs`.
pub fn draw(seed: u64, queues: &[String], chaos_secs: f64) -> Vec<IterJob> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x17e2_ab1e);
    if queues.is_empty() {
        return Vec::new();
    }
    let count = rng.random_range(2..=5);
    let mut jobs: Vec<IterJob> = (0..count)
        .map(|i| IterJob {
            jid: format!("iter{seed:x}n{i}"),
            queue: queues[rng.random_range(0..queues.len())].clone(),
            // At most 6 s of sleep: a whole run stays within the final drain's `DRAIN_STUCK`.
            n: rng.random_range(20..=60),
            sleep_ms: rng.random_range(30..=100),
            at: rng.random_range(0.0..chaos_secs.max(0.1)),
            pushed: false,
        })
        .collect();
    // One more at the end of the chaos phase, 6 s long: the stop's TERM always meets it mid-iteration,
    // so every seed has a clean interrupt, its push-back and a resume in the final drain.
    jobs.push(IterJob {
        jid: format!("iter{seed:x}tail"),
        queue: queues[rng.random_range(0..queues.len())].clone(),
        n: 60,
        sleep_ms: 100,
        at: chaos_secs,
        pushed: false,
    });
    jobs
}

/// Pushes the jobs due `elapsed` seconds into the chaos phase and not pushed yet, as Sidekiq's client
/// does (`f64::INFINITY`: every one left).
pub fn push_due(c: &mut redis::Connection, jobs: &mut [IterJob], elapsed: f64, now: f64) {
    for j in jobs.iter_mut().filter(|j| !j.pushed && j.at <= elapsed) {
        j.pushed = true;
        let _: () = redis::pipe()
            .sadd("queues", &j.queue)
            .lpush(format!("queue:{}", j.queue), j.payload(now))
            .query(c)
            .unwrap();
    }
}

/// A summary (`iter=<jobs>/<items seen>/<runs>/<clean stops>`) and the findings.
pub fn check(c: &mut redis::Connection, jobs: &[IterJob]) -> (String, Vec<String>) {
    let done: HashMap<String, u64> = c.hgetall("chaos:iter-done").unwrap();
    let mut failed_jids = Vec::new();
    for set in ["retry", "dead"] {
        let members: Vec<String> = c.zrange(set, 0, -1).unwrap();
        for m in members {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&m)
                && v["class"] == "ChaosIterJob"
            {
                failed_jids.push(v["jid"].as_str().unwrap_or("?").to_string());
            }
        }
    }
    let mut findings = Vec::new();
    let (mut items, mut runs_total, mut stops_total, mut resting) = (0, 0, 0, 0);
    for j in jobs {
        let seen: Vec<(u64, u64)> = c
            .lrange::<_, Vec<String>>(format!("chaos:iter-seen:{}", j.jid), 0, -1)
            .unwrap()
            .iter()
            .filter_map(|s| {
                let (run, item) = s.split_once(':')?;
                Some((run.parse().ok()?, item.parse().ok()?))
            })
            .collect();
        let stops: Vec<u64> = c
            .lrange::<_, Vec<String>>(format!("chaos:iter-stops:{}", j.jid), 0, -1)
            .unwrap()
            .iter()
            .filter_map(|s| s.parse().ok())
            .collect();
        items += seen.len();
        stops_total += stops.len();
        // The runs that started an item, in order, each with its first and last item.
        let mut runs: Vec<(u64, u64, u64)> = Vec::new();
        for &(run, item) in &seen {
            match runs.last_mut() {
                Some((r, _, last)) if *r == run => {
                    if item != *last + 1 {
                        findings.push(format!(
                            "ITERABLE ITEMS OUT OF ORDER: {} run {run}: {item} after {last}",
                            j.jid
                        ));
                    }
                    *last = item;
                }
                _ => runs.push((run, item, item)),
            }
        }
        runs_total += runs.len();
        for w in runs.windows(2) {
            let ((prev, _, last), (run, first, _)) = (w[0], w[1]);
            if first > last + 1 {
                findings.push(format!(
                    "ITERABLE ITEM SKIPPED: {} run {run} started at {first}, run {prev} ended at {last}",
                    j.jid
                ));
            }
            if first <= last && stops.contains(&prev) {
                findings.push(format!(
                    "ITERABLE ITEM REPEATED: {} run {run} started at {first}, though run {prev} stopped \
                     cleanly after {last}",
                    j.jid
                ));
            }
        }
        if failed_jids.contains(&j.jid) {
            continue;
        }
        // A run that failed puts the job in the retry set, which the final drain does not wait for
        // (a chaos job may end there); the last process's poller can then move it to its queue and
        // start it, and its stop pushes it back (seed 619874). Resting in a queue, the retry set or
        // the schedule, never completed, it is not lost: the walk is checked once it completes.
        if !done.contains_key(&j.jid) {
            let places = places_of(c, &j.jid);
            if !places.is_empty()
                && places
                    .iter()
                    .all(|p| p.starts_with("queue:") || p == "retry" || p == "schedule")
            {
                resting += 1;
                continue;
            }
        }
        let mut all: Vec<u64> = seen.iter().map(|s| s.1).collect();
        all.sort_unstable();
        all.dedup();
        if all != (0..j.n).collect::<Vec<_>>() {
            findings.push(format!(
                "ITERABLE ITEM SKIPPED: {} walked {} distinct items of {}",
                j.jid,
                all.len(),
                j.n
            ));
        }
        let completions = done.get(&j.jid).copied().unwrap_or(0);
        let left: bool = c.exists(format!("it-{}", j.jid)).unwrap();
        if completions != 1 || left {
            let state: HashMap<String, String> = c.hgetall(format!("it-{}", j.jid)).unwrap();
            findings.push(format!(
                "ITERABLE NOT COMPLETED ONCE: {} completed {completions} time(s), it- hash left: {left} \
                 {state:?}, runs {runs:?}, stops {stops:?}, found in: {:?}",
                j.jid,
                places_of(c, &j.jid)
            ));
        }
    }
    (
        format!(
            "iter={}/{items}/{runs_total}/{stops_total}/resting {resting}",
            jobs.len()
        ),
        findings,
    )
}

/// Every key holding a member, element or field that names `jid` (queues of any name, the sorted
/// sets, oxidekiq's working hashes and landing lists): where a job not completed is, so that a
/// failure tells a lost job from one left where the drain did not look.
fn places_of(c: &mut redis::Connection, jid: &str) -> Vec<String> {
    let needle = format!("\"jid\":\"{jid}\"");
    let mut places = Vec::new();
    let keys: Vec<String> = c.keys("*").unwrap();
    for k in keys {
        let kind: String = redis::cmd("TYPE").arg(&k).query(c).unwrap();
        let items: Vec<String> = match kind.as_str() {
            "list" => c.lrange(&k, 0, -1).unwrap(),
            "zset" => c.zrange(&k, 0, -1).unwrap(),
            "hash" if k.starts_with("oxidekiq:") => c.hvals(&k).unwrap(),
            _ => Vec::new(),
        };
        if items.iter().any(|m| m.contains(&needle)) {
            places.push(k);
        }
    }
    places
}
