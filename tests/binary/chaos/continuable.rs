//! Rails 8.1 Continuable jobs under chaos (issue 39), drawn from a generator of their own (so every
//! other draw of a seed is what it was), beside the iterable ones: a few `ChaosStepsJob`s
//! (`workers/src/lib.rs`: steps `start`, `walk` over `0..n` with a cursor, `finish`), pushed as
//! ActiveJob 8.1 payloads at drawn times of the chaos phase (and one 2 s before its end, 6 s long,
//! which the stop's TERM usually meets mid-walk), so the kills, the quiet process, the Redis stalls
//! and the final TERM meet them mid-step. Each interrupt pushes a new jid; the checks read what each
//! run noted, in order:
//!
//! - **continuable step skipped**: an item of `walk` never run, or `walk` run before `start`, or
//!   `finish` before the last item;
//! - **continuable item repeated**: a run that began after a run interrupted cleanly (`stop`) began
//!   at another item than the one after that run's last (a run cut off without an interrupt, by a
//!   kill or the stop's deadline, may repeat the items since its last recorded checkpoint);
//! - **continuable run after completion**: anything run after `finish`, or `finish` run twice;
//! - **continuable not completed**: a job whose progress is in no queue, retry, schedule or dead set,
//!   and that did not finish.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redis::Commands;

/// One Continuable job of the plan: `ChaosStepsJob.perform_later(n, sleep_ms, id)`.
#[derive(Debug, Clone)]
pub struct StepsJob {
    pub id: String,
    pub queue: String,
    pub n: u64,
    pub sleep_ms: u64,
    /// Pushed this many seconds into the chaos phase.
    pub at: f64,
    /// Whether it was pushed yet.
    pub pushed: bool,
}

impl StepsJob {
    /// The payload Sidekiq 8.1's `Sidekiq::ActiveJob::Wrapper` pushes for ActiveJob 8.1
    /// (`fixtures/activejob-8.1/continuable_enqueued.json`'s shape).
    fn payload(&self, now: f64) -> String {
        let ms = (now * 1000.0) as u64;
        let iso = chrono::DateTime::from_timestamp_millis(ms as i64)
            .unwrap()
            .to_rfc3339_opts(chrono::SecondsFormat::Nanos, true);
        format!(
            r#"{{"retry":true,"queue":"{q}","wrapped":"ChaosStepsJob","args":[{{"job_class":"ChaosStepsJob","job_id":"{id}-aj","provider_job_id":null,"queue_name":"{q}","priority":null,"arguments":[{n},{s},"{id}"],"executions":0,"exception_executions":{{}},"locale":"en","timezone":"UTC","enqueued_at":"{iso}","scheduled_at":null,"continuation":{{"completed":[]}},"resumptions":0}}],"class":"Sidekiq::ActiveJob::Wrapper","jid":"{id}","created_at":{ms},"enqueued_at":{ms}}}"#,
            q = self.queue,
            n = self.n,
            s = self.sleep_ms,
            id = self.id,
        )
    }
}

/// The seed's Continuable jobs, on `queues`, each due at a time of the chaos phase's first
/// `chaos_secs`.
pub fn draw(seed: u64, queues: &[String], chaos_secs: f64) -> Vec<StepsJob> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xc0_7139);
    if queues.is_empty() {
        return Vec::new();
    }
    let count = rng.random_range(1..=3);
    let mut jobs: Vec<StepsJob> = (0..count)
        .map(|i| StepsJob {
            id: format!("steps{seed:x}n{i}"),
            queue: queues[rng.random_range(0..queues.len())].clone(),
            n: rng.random_range(20..=60),
            sleep_ms: rng.random_range(30..=100),
            at: rng.random_range(0.0..chaos_secs.max(0.1)),
            pushed: false,
        })
        .collect();
    jobs.push(StepsJob {
        id: format!("steps{seed:x}tail"),
        queue: queues[rng.random_range(0..queues.len())].clone(),
        n: 60,
        sleep_ms: 100,
        // Two seconds before the end: mid-walk (6 s long) when the stop's TERM comes.
        at: (chaos_secs - 2.0).max(0.0),
        pushed: false,
    });
    jobs
}

/// Pushes the jobs due `elapsed` seconds into the chaos phase and not pushed yet.
pub fn push_due(c: &mut redis::Connection, jobs: &mut [StepsJob], elapsed: f64, now: f64) {
    for j in jobs.iter_mut().filter(|j| !j.pushed && j.at <= elapsed) {
        j.pushed = true;
        let _: () = redis::pipe()
            .sadd("queues", &j.queue)
            .lpush(format!("queue:{}", j.queue), j.payload(now))
            .query(c)
            .unwrap();
    }
}

/// A summary (`steps=<jobs>/<runs>/<clean interrupts>/resting <n>`) and the findings.
pub fn check(c: &mut redis::Connection, jobs: &[StepsJob]) -> (String, Vec<String>) {
    let done: HashMap<String, u64> = c.hgetall("chaos:steps-done").unwrap();
    let mut findings = Vec::new();
    let (mut runs_total, mut stops_total, mut resting) = (0, 0, 0);
    for j in jobs {
        let notes: Vec<(String, String)> = c
            .lrange::<_, Vec<String>>(format!("chaos:steps-seen:{}", j.id), 0, -1)
            .unwrap()
            .iter()
            .filter_map(|s| {
                s.split_once(':')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
            })
            .collect();
        // Runs in order: (jid, notes), a new run at each change of jid.
        let mut runs: Vec<(String, Vec<String>)> = Vec::new();
        for (jid, what) in &notes {
            match runs.last_mut() {
                Some((r, w)) if r == jid => w.push(what.clone()),
                _ => runs.push((jid.clone(), vec![what.clone()])),
            }
        }
        runs_total += runs.len();
        let mut started = false;
        let mut finished = false;
        let mut seen_items = vec![false; j.n as usize];
        let mut next_after_stop: Option<u64> = None;
        for (jid, whats) in &runs {
            let first_item = whats.iter().find_map(|w| w.parse::<u64>().ok());
            if let (Some(want), Some(first)) = (next_after_stop.take(), first_item)
                && first != want
            {
                findings.push(format!(
                    "CONTINUABLE ITEM REPEATED: {} run {jid} began at {first}, the run before \
                     was interrupted cleanly before {want}",
                    j.id
                ));
            }
            let mut last = None;
            for w in whats {
                if finished {
                    findings.push(format!(
                        "CONTINUABLE RUN AFTER COMPLETION: {} run {jid} ran {w} after finish",
                        j.id
                    ));
                }
                match w.as_str() {
                    "start" => started = true,
                    "stop" => {
                        stops_total += 1;
                        next_after_stop = last.map(|l: u64| l + 1);
                    }
                    "finish" => {
                        if seen_items.iter().any(|s| !s) {
                            findings.push(format!(
                                "CONTINUABLE STEP SKIPPED: {} finished with items never run",
                                j.id
                            ));
                        }
                        finished = true;
                    }
                    item => {
                        let Ok(i) = item.parse::<u64>() else {
                            findings.push(format!("CONTINUABLE NOTE UNKNOWN: {} {item}", j.id));
                            continue;
                        };
                        if !started {
                            findings.push(format!(
                                "CONTINUABLE STEP SKIPPED: {} walked {i} before start",
                                j.id
                            ));
                        }
                        if let Some(s) = seen_items.get_mut(i as usize) {
                            *s = true;
                        }
                        last = Some(i);
                    }
                }
            }
        }
        let completions = done.get(&j.id).copied().unwrap_or(0);
        if completions == 1 && finished {
            continue;
        }
        if completions > 1 {
            findings.push(format!(
                "CONTINUABLE RUN AFTER COMPLETION: {} finished {completions} times",
                j.id
            ));
            continue;
        }
        // Not finished: its progress must rest somewhere (a queue, retry, schedule or dead).
        let places = places_of(c, &j.id);
        if !places.is_empty() {
            resting += 1;
            continue;
        }
        findings.push(format!(
            "CONTINUABLE NOT COMPLETED: {} completed {completions} time(s), in no set; runs {:?}",
            j.id,
            runs.iter()
                .map(|(jid, w)| format!("{jid}:{}", w.join(",")))
                .collect::<Vec<_>>()
        ));
    }
    (
        format!(
            "steps={}/{runs_total}/{stops_total}/resting {resting}",
            jobs.len()
        ),
        findings,
    )
}

/// Every queue or sorted set holding a run of the job `id` (its `arguments` name it).
fn places_of(c: &mut redis::Connection, id: &str) -> Vec<String> {
    let needle = format!("\"{id}\"]");
    let mut places = Vec::new();
    let keys: Vec<String> = c.keys("*").unwrap();
    for k in keys {
        let kind: String = redis::cmd("TYPE").arg(&k).query(c).unwrap();
        let items: Vec<String> = match kind.as_str() {
            "list" if !k.starts_with("chaos:") => c.lrange(&k, 0, -1).unwrap(),
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
