//! Rolling upgrades under faults with real older binaries (issue 44, item 3).
//!
//! A fleet of three `oxidekiq` processes where an older release and this one run side by side, as a
//! rolling deploy leaves them: the first release's three processes run under load, then each in turn is
//! stopped (TERM) or killed (SIGKILL) and replaced by a process of the second release, with, now and
//! then, a crash of another process (SIGKILL, restarted with the release it ran). `upgrade` deploys this
//! release over the older one; `rollback` deploys the older one over this one. Jobs keep coming the
//! whole time (`ChaosJob`s, whose class both older releases' `workers/src/lib.rs` have too: succeed,
//! sleep up to 2.5 s, fail with retries or without, panic). Then every process is stopped with TERM, a
//! process of this release drains what is left and recovers what the dead left behind (batch lists,
//! the older releases' `oxidekiq:working:*` keys, landing lists), and every jid is accounted for from
//! what the job itself recorded (`chaos:runs`, `chaos:done`) and where Redis holds it:
//!
//! - **lost**: it never ran to its end and is in no queue, retry, schedule or dead set;
//! - **stranded**: anything left in oxidekiq's keys (`oxidekiq:batch:*` entries not marked done,
//!   `oxidekiq:working:*`, `oxidekiq:landing:*`) after the final drain stopped, or a job in a queue
//!   no process serves (`queue:<q>:@<n>`, the stranding docs/guarantees.md describes);
//! - **duplicate outside faults**: a job that ran to its end twice is allowed only as
//!   docs/guarantees.md's case (a) allows it: it was held by a process (in its keys, or its run count
//!   rose) around that process's SIGKILL, or while that process stopped (a job cut off at the `-t`
//!   deadline after its last write, before its ack reached Redis). Any other duplicate is a finding;
//! - **stop hang**: a TERMed process that does not exit within its deadline plus a margin;
//! - **failure not kept**: a `fail`/`panic` job that ran but is in neither the retry nor the dead set
//!   (nor back in a queue with its error, nor pushed back after an interrupted run).
//!
//! The older binary is a build of an older commit (`scripts/rolling_upgrade.sh` builds e9935e1, the
//! release before the batch lists, and 3d24d66, the first with them, each in a worktree of its own):
//!
//! - `OXIDEKIQ_OLD_BINARY=/path/to/oxidekiq` (required);
//! - `ROLLING_DIRECTION=upgrade|rollback|both` (default `both`);
//! - `ROLLING_SEED=N`, or `ROLLING_SEEDS=K ROLLING_FIRST_SEED=N` (default: one seed from the clock);
//! - `ROLLING_OLD_LABEL=e9935e1`: how the summary names the older release;
//! - `ROLLING_KEEP_LOGS=DIR`: every process's log kept in DIR.
//!
//! `cargo build --workspace` first (this release's `target/debug/oxidekiq`), then
//! `OXIDEKIQ_OLD_BINARY=... cargo test --test binary rolling_upgrade:: -- --ignored --nocapture`.
//! A seed fixes the deploy (the order of the slots, each kill or stop, the crashes, the waits) and the
//! jobs' draws, not how many bursts fit in a wait nor the interleaving of the processes: a failing
//! seed is a strong hint, not a replay. Its `faults=[...]` trace says what happened: `K<slot>` a
//! SIGKILL, `T<slot>` a TERM (each followed by the other release's process in that slot),
//! `C<slot><release>` a crash of another process restarted with its release, `T` the final stops.
//! Each seed prints one `ROLLING` line (the figures `bench/results/rolling-upgrade.md` collects).
use crate::support;

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redis::Commands;
use support::{LoggedProcess, Oxidekiq, RedisServer, wait_until};

/// `--beat-interval` of every process: liveness keys live 3 s, so a dead process is recovered within
/// seconds.
const BEAT_SECS: &str = "1";

/// `-t` of every process.
const STOP_TIMEOUT_SECS: u64 = 3;

/// How long past its deadline a TERMed process may take to exit.
const STOP_MARGIN: Duration = Duration::from_secs(20);

/// Slots of each process of the deploy.
const CONCURRENCY: usize = 8;

/// The queues, served in strict order.
const QUEUES: [&str; 2] = ["default", "low"];

/// Slots of the process of this release that drains at the end.
const FINAL_CONCURRENCY: usize = 25;

/// The final drain gives up after this long (a dead process's recovery lock lives 30 s).
const DRAIN_BOUND: Duration = Duration::from_secs(120);

/// Which release goes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// The older release first, this one replaces it process by process.
    Upgrade,
    /// This release first, the older one replaces it.
    Rollback,
}

impl Direction {
    fn name(self) -> &'static str {
        match self {
            Direction::Upgrade => "upgrade",
            Direction::Rollback => "rollback",
        }
    }
}

/// Which binary a process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Release {
    Old,
    New,
}

/// One job pushed.
struct JobSpec {
    jid: String,
    mode: &'static str,
}

/// One live process of the fleet.
struct Proc {
    proc: LoggedProcess,
    identity: String,
    release: Release,
}

/// The outcome of one seed.
struct Outcome {
    summary: String,
    findings: Vec<String>,
}

struct Run {
    seed: u64,
    /// Draws the deploy: the order, each kill or stop, the crashes, the waits. Nothing else draws from
    /// it, so a seed fixes the deploy whatever the timing.
    rng: StdRng,
    /// Draws the load (the bursts and their jobs), which timing decides the length of.
    load: StdRng,
    redis: RedisServer,
    c: redis::Connection,
    old_binary: PathBuf,
    pushed: Vec<JobSpec>,
    next_jid: u64,
    /// Jids a duplicate run of which docs/guarantees.md allows (held around a kill or a stop), with
    /// what happened.
    allowed_dups: HashMap<String, String>,
    findings: Vec<String>,
    /// Every ended process's log, by identity.
    logs: Vec<(String, String)>,
    /// Faults, in order, for the summary: `K` kill, `T` stop, `C` crash of another process.
    trace: Vec<String>,
    keep_logs: Option<PathBuf>,
    /// The release of every identity that ran.
    releases: HashMap<String, Release>,
}

fn now() -> f64 {
    support::now()
}

fn jid_of(payload: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(payload).ok()?;
    v.get("jid")?.as_str().map(str::to_string)
}

impl Run {
    fn binary(&self, release: Release) -> PathBuf {
        match release {
            Release::Old => self.old_binary.clone(),
            Release::New => Oxidekiq::binary(),
        }
    }

    fn start(&mut self, release: Release) -> Proc {
        self.start_with(release, CONCURRENCY)
    }

    fn start_with(&mut self, release: Release, concurrency: usize) -> Proc {
        let mut args: Vec<String> = vec![
            "-c".into(),
            concurrency.to_string(),
            "-t".into(),
            STOP_TIMEOUT_SECS.to_string(),
            "--beat-interval".into(),
            BEAT_SECS.into(),
            "--poll-interval".into(),
            "0.5".into(),
        ];
        for q in QUEUES {
            args.extend(["-q".into(), q.to_string()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let name = match release {
            Release::Old => "oxidekiq-old",
            Release::New => "oxidekiq-new",
        };
        let bin = self.binary(release);
        assert!(bin.is_file(), "missing binary {}", bin.display());
        let url = self.redis.url();
        let proc = LoggedProcess::spawn(name, &bin, &args, &[("REDIS_URL", &url)]);
        let needle = format!(":{}:", proc.pid());
        let mut identity = None;
        let c = &mut self.c;
        let up = wait_until(Duration::from_secs(30), || {
            let members: Vec<String> = c.smembers("processes").unwrap_or_default();
            identity = members.into_iter().find(|m| m.contains(&needle));
            identity.is_some()
        });
        assert!(up, "{name} never registered:\n{}", proc.log());
        let identity = identity.unwrap();
        self.releases.insert(identity.clone(), release);
        Proc {
            proc,
            identity,
            release,
        }
    }

    /// Pushes a burst of 5 to 30 jobs spread over the queues.
    fn burst(&mut self) {
        let n = self.load.random_range(5..=30);
        let mut pipe = redis::pipe();
        for _ in 0..n {
            let jid = format!("{:08x}{:016x}", self.seed as u32, self.next_jid);
            self.next_jid += 1;
            let roll = self.load.random_range(0..100);
            let (mode, sleep_ms) = match roll {
                0..40 => ("ok", 0),
                40..85 => ("sleep", self.load.random_range(50..2500)),
                85..93 => ("fail", 0),
                _ => ("panic", 0),
            };
            let retry = if self.load.random_bool(0.5) {
                "true"
            } else {
                "0"
            };
            let q = QUEUES[self.load.random_range(0..QUEUES.len())];
            let t = now();
            let payload = format!(
                r#"{{"retry":{retry},"queue":"{q}","class":"ChaosJob","args":["{mode}",{sleep_ms},"{jid}"],"jid":"{jid}","created_at":{t},"enqueued_at":{t}}}"#
            );
            pipe.sadd("queues", q).ignore();
            pipe.lpush(format!("queue:{q}"), payload).ignore();
            self.pushed.push(JobSpec { jid, mode });
        }
        let _: () = pipe.query(&mut self.c).unwrap();
    }

    /// Keeps pushing bursts for `d`.
    fn pump(&mut self, d: Duration) {
        let end = Instant::now() + d;
        while Instant::now() < end {
            self.burst();
            let pause = self.load.random_range(150..600);
            std::thread::sleep(Duration::from_millis(pause));
        }
    }

    /// The jids held in oxidekiq's keys, by `identity` only when given.
    fn held(&mut self, identity: Option<&str>) -> Vec<(String, String)> {
        let prefixes = ["oxidekiq:batch:", "oxidekiq:working:", "oxidekiq:landing:"];
        let mut out = Vec::new();
        for p in prefixes {
            let pattern = match identity {
                Some(id) => format!("{p}{id}:*"),
                None => format!("{p}*"),
            };
            let keys: Vec<String> = self.c.keys(&pattern).unwrap_or_default();
            for k in keys {
                for payload in support::held_in(&mut self.c, &k) {
                    let jid =
                        jid_of(&payload).unwrap_or_else(|| format!("undecodable:{payload:.40}"));
                    out.push((k.clone(), jid));
                }
            }
        }
        out
    }

    fn runs(&mut self) -> HashMap<String, u64> {
        self.c.hgetall("chaos:runs").unwrap_or_default()
    }

    /// Allows a duplicate of every jid held by `identity` now, or whose run count rose since `before`.
    fn allow_held(&mut self, identity: &str, why: &str, before: &HashMap<String, u64>) {
        for (_, jid) in self.held(Some(identity)) {
            self.allowed_dups.entry(jid).or_insert_with(|| why.into());
        }
        let after = self.runs();
        for (jid, n) in after {
            if before.get(&jid).copied().unwrap_or(0) < n {
                self.allowed_dups.entry(jid).or_insert_with(|| why.into());
            }
        }
    }

    fn retire(&mut self, p: Proc) {
        let log = p.proc.log();
        if let Some(dir) = &self.keep_logs {
            let _ = std::fs::create_dir_all(dir);
            let _ = std::fs::write(
                dir.join(format!(
                    "{}-{}.log",
                    self.seed,
                    p.identity.replace(':', "_")
                )),
                &log,
            );
        }
        for line in log.lines().filter(|l| l.contains("panicked at")) {
            if !line.contains("chaos panic") {
                self.findings
                    .push(format!("OWN PANIC in {}: {line:.300}", p.identity));
            }
        }
        self.logs.push((p.identity.clone(), log));
    }

    /// SIGKILLs a process, allowing a duplicate of what it held.
    fn kill(&mut self, mut p: Proc, why: &str) {
        let before = self.runs();
        let held_before = self.held(Some(&p.identity));
        for (_, jid) in held_before {
            self.allowed_dups.entry(jid).or_insert_with(|| why.into());
        }
        p.proc.kill_9();
        let id = p.identity.clone();
        self.allow_held(&id, why, &before);
        self.retire(p);
    }

    /// TERMs a process and waits for it to exit while jobs keep coming, allowing a duplicate of what
    /// it held on the way (a job cut off at the deadline after its last write, before its ack): its
    /// keys are read every 50 ms until it exits.
    fn stop(&mut self, mut p: Proc, why: &str) {
        let id = p.identity.clone();
        let note = |run: &mut Run| {
            for (_, jid) in run.held(Some(&id)) {
                run.allowed_dups.entry(jid).or_insert_with(|| why.into());
            }
        };
        note(self);
        p.proc.signal("TERM");
        let t0 = Instant::now();
        let bound = Duration::from_secs(STOP_TIMEOUT_SECS) + STOP_MARGIN;
        loop {
            note(self);
            if p.proc.try_exit().is_some() {
                break;
            }
            if t0.elapsed() > bound {
                self.findings.push(format!(
                    "STOP HANG: {id} ({:?}) still running {}s after TERM",
                    p.release,
                    bound.as_secs()
                ));
                p.proc.kill_9();
                break;
            }
            if self.load.random_bool(0.2) {
                self.burst();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.retire(p);
    }

    /// The rolling deploy: `first` runs three processes, each replaced by `second` in turn.
    fn deploy(&mut self, first: Release, second: Release) -> Vec<Proc> {
        let mut fleet: Vec<Option<Proc>> = Vec::new();
        for _ in 0..3 {
            let p = self.start(first);
            fleet.push(Some(p));
        }
        let d = Duration::from_millis(self.rng.random_range(2000..4000));
        self.pump(d);
        let mut order = vec![0usize, 1, 2];
        for i in (1..order.len()).rev() {
            let j = self.rng.random_range(0..=i);
            order.swap(i, j);
        }
        for slot in order {
            let p = fleet[slot].take().unwrap();
            let what = format!("{:?}->{:?} slot {slot}", p.release, second);
            if self.rng.random_bool(0.5) {
                self.trace.push(format!("K{slot}"));
                self.kill(p, &format!("SIGKILL at deploy ({what})"));
            } else {
                self.trace.push(format!("T{slot}"));
                self.stop(p, &format!("TERM at deploy ({what})"));
            }
            let replacement = self.start(second);
            fleet[slot] = Some(replacement);
            let d = Duration::from_millis(self.rng.random_range(1000..4000));
            self.pump(d);
            // A crash of another process mid-deploy, restarted with the release it ran.
            if self.rng.random_bool(0.4) {
                let other = (slot + self.rng.random_range(1..3)) % 3;
                let p = fleet[other].take().unwrap();
                let release = p.release;
                self.trace.push(format!("C{other}{:?}", release));
                self.kill(
                    p,
                    &format!("SIGKILL mid-deploy of slot {other} ({release:?})"),
                );
                let d = Duration::from_millis(self.rng.random_range(0..1500));
                self.pump(d);
                let p = self.start(release);
                fleet[other] = Some(p);
                let d = Duration::from_millis(self.rng.random_range(500..2500));
                self.pump(d);
            }
        }
        let d = Duration::from_millis(self.rng.random_range(1000..3000));
        self.pump(d);
        fleet.into_iter().flatten().collect()
    }

    /// Stops the fleet one by one, then a process of this release drains and recovers everything.
    fn final_drain(&mut self, fleet: Vec<Proc>) {
        for p in fleet {
            self.trace.push("T".into());
            self.stop(p, "TERM at the end of the deploy");
        }
        let last = self.start_with(Release::New, FINAL_CONCURRENCY);
        let start = Instant::now();
        loop {
            let queued: usize = QUEUES
                .iter()
                .map(|q| self.c.llen::<_, usize>(format!("queue:{q}")).unwrap_or(0))
                .sum();
            let held = self.held(None).len();
            if queued + held == 0 {
                std::thread::sleep(Duration::from_millis(300));
                let queued: usize = QUEUES
                    .iter()
                    .map(|q| self.c.llen::<_, usize>(format!("queue:{q}")).unwrap_or(0))
                    .sum();
                if queued + self.held(None).len() == 0 {
                    break;
                }
                continue;
            }
            if start.elapsed() > DRAIN_BOUND {
                let keys: Vec<String> = self.held(None).into_iter().map(|(k, _)| k).collect();
                let keys: HashSet<String> = keys.into_iter().collect();
                self.findings.push(format!(
                    "DRAIN BOUND: after {}s still queued={queued} held={held} in {keys:?}",
                    DRAIN_BOUND.as_secs()
                ));
                break;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        self.trace.push("T".into());
        self.stop(last, "TERM of the final process");
    }

    fn account(&mut self, secs: f64) -> String {
        let done: HashMap<String, u64> = self.c.hgetall("chaos:done").unwrap();
        let runs: HashMap<String, u64> = self.c.hgetall("chaos:runs").unwrap();
        let mut places: HashMap<String, Vec<(&'static str, bool)>> = HashMap::new();
        for set in ["retry", "dead", "schedule"] {
            let members: Vec<String> = self.c.zrange(set, 0, -1).unwrap();
            for m in members {
                let v: serde_json::Value = serde_json::from_str(&m).unwrap_or_default();
                let err = v.get("error_class").is_some_and(|e| e.is_string());
                if let Some(j) = v["jid"].as_str() {
                    let name = match set {
                        "retry" => "retry",
                        "dead" => "dead",
                        _ => "schedule",
                    };
                    places.entry(j.to_string()).or_default().push((name, err));
                }
            }
        }
        let queue_keys: Vec<String> = self.c.keys("queue:*").unwrap();
        let mut unserved: Vec<(String, usize)> = Vec::new();
        for k in queue_keys {
            let known = QUEUES.iter().any(|q| k == format!("queue:{q}"));
            let members: Vec<String> = self.c.lrange(&k, 0, -1).unwrap();
            if !known && !members.is_empty() {
                unserved.push((k.clone(), members.len()));
            }
            for m in members {
                let v: serde_json::Value = serde_json::from_str(&m).unwrap_or_default();
                let err = v.get("error_class").is_some();
                if let Some(j) = v["jid"].as_str() {
                    places
                        .entry(j.to_string())
                        .or_default()
                        .push(("queue", err));
                }
            }
        }
        if !unserved.is_empty() {
            unserved.sort();
            self.findings.push(format!(
                "STRANDED in queues nobody serves: {} job(s) in {} queue(s): {:?}",
                unserved.iter().map(|(_, n)| n).sum::<usize>(),
                unserved.len(),
                unserved.iter().take(5).collect::<Vec<_>>()
            ));
        }
        let stranded = self.held(None);
        if !stranded.is_empty() {
            let keys: HashSet<&String> = stranded.iter().map(|(k, _)| k).collect();
            self.findings.push(format!(
                "STRANDED after the final drain: {} job(s) in {keys:?}",
                stranded.len()
            ));
            for (_, j) in &stranded {
                places.entry(j.clone()).or_default().push(("held", false));
            }
        }
        let mut interrupted: HashSet<String> = HashSet::new();
        for (_, log) in &self.logs {
            for line in log
                .lines()
                .filter(|l| l.contains("interrupted by shutdown"))
            {
                if let Some(rest) = line.split("jid=").nth(1) {
                    interrupted.insert(rest.split(' ').next().unwrap_or("").to_string());
                }
            }
        }
        let mut lost = Vec::new();
        let mut not_failed = Vec::new();
        let mut dups = 0u64;
        let mut dup_allowed = Vec::new();
        let mut dup_outside = Vec::new();
        let (mut n_done, mut n_retry, mut n_dead, mut n_queued) = (0, 0, 0, 0);
        for job in &self.pushed {
            let d = done.get(&job.jid).copied().unwrap_or(0);
            let r = runs.get(&job.jid).copied().unwrap_or(0);
            let at = places.get(&job.jid).map(Vec::as_slice).unwrap_or(&[]);
            if d > 0 {
                n_done += 1;
            }
            if d > 1 {
                dups += d - 1;
                match self.allowed_dups.get(&job.jid) {
                    Some(why) => dup_allowed.push(format!("{} ({why})", job.jid)),
                    None => dup_outside.push(job.jid.clone()),
                }
            }
            for (p, _) in at {
                match *p {
                    "retry" => n_retry += 1,
                    "dead" => n_dead += 1,
                    "queue" => n_queued += 1,
                    _ => {}
                }
            }
            if d == 0 && at.is_empty() {
                lost.push(job.jid.clone());
                continue;
            }
            let failed_properly = at
                .iter()
                .any(|(p, err)| matches!(*p, "retry" | "dead") || (*p == "queue" && *err))
                || (at.iter().any(|(p, _)| *p == "queue") && interrupted.contains(&job.jid));
            if r > 0 && matches!(job.mode, "fail" | "panic") && !failed_properly {
                not_failed.push(format!("{}@{at:?}", job.jid));
            }
        }
        let explain = |jids: &[String], logs: &[(String, String)]| {
            let mut detail = String::new();
            for j in jids.iter().take(3) {
                let _ = write!(detail, "\n      {j}:");
                for (identity, log) in logs {
                    for line in log.lines().filter(|l| l.contains(&format!("jid={j} "))) {
                        let _ = write!(detail, "\n        [{identity}] {line:.300}");
                    }
                }
            }
            detail
        };
        if !lost.is_empty() {
            let detail = explain(&lost, &self.logs);
            self.findings.push(format!(
                "LOST: {} job(s) never ran to their end and are nowhere in Redis: {:?}{detail}",
                lost.len(),
                lost.iter().take(5).collect::<Vec<_>>()
            ));
        }
        if !dup_outside.is_empty() {
            let detail = explain(&dup_outside, &self.logs);
            self.findings.push(format!(
                "DUPLICATES OUTSIDE FAULTS: {} job(s) ran to their end twice but were held at no kill \
                 or stop: {:?}{detail}",
                dup_outside.len(),
                dup_outside.iter().take(5).collect::<Vec<_>>()
            ));
        }
        if !not_failed.is_empty() {
            self.findings.push(format!(
                "FAILURE NOT KEPT: {} failing job(s) ran but are in no retry/dead set: {:?}",
                not_failed.len(),
                not_failed.iter().take(3).collect::<Vec<_>>()
            ));
        }
        if !dup_allowed.is_empty() {
            eprintln!(
                "seed {}: duplicates allowed by case (a): {:?}",
                self.seed,
                dup_allowed.iter().take(10).collect::<Vec<_>>()
            );
        }
        format!(
            "jobs={} done={n_done} retry={n_retry} dead={n_dead} queued={n_queued} dups={dups} \
             (at faults {}, outside {}) lost={} stranded={} secs={secs:.1} faults=[{}] \
             recovered[{}]",
            self.pushed.len(),
            dup_allowed.len(),
            dup_outside.len(),
            lost.len(),
            stranded.len(),
            self.trace.join(" "),
            self.recoveries()
        )
    }
}

impl Run {
    /// Jobs pushed back from dead processes, by the recovering process's release and the dead one's
    /// (`new<old:16` = processes of this release recovered 16 jobs of dead processes of the older
    /// one), from every process's `recovered jobs of a process that died` lines.
    fn recoveries(&self) -> String {
        let name = |r: Option<&Release>| match r {
            Some(Release::Old) => "old",
            Some(Release::New) => "new",
            None => "?",
        };
        let mut by: std::collections::BTreeMap<String, u64> = Default::default();
        for (identity, log) in &self.logs {
            for line in log
                .lines()
                .filter(|l| l.contains("recovered jobs of a process that died"))
            {
                let field = |k: &str| {
                    line.split(' ')
                        .find_map(|w| w.strip_prefix(k))
                        .map(str::to_string)
                };
                let dead = field("process=").unwrap_or_default();
                let n: u64 = field("requeued=").and_then(|n| n.parse().ok()).unwrap_or(0);
                let key = format!(
                    "{}<{}",
                    name(self.releases.get(identity)),
                    name(self.releases.get(&dead))
                );
                *by.entry(key).or_default() += n;
            }
        }
        by.iter()
            .map(|(k, n)| format!("{k}:{n}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

fn run_seed(seed: u64, direction: Direction, old_binary: &Path) -> Outcome {
    let started = Instant::now();
    let redis = RedisServer::start();
    let c = redis.conn();
    // The direction is part of the seed, so `upgrade` and `rollback` of one seed draw apart.
    let salt = match direction {
        Direction::Upgrade => 0,
        Direction::Rollback => 0x5eed,
    };
    let mut run = Run {
        seed,
        rng: StdRng::seed_from_u64(seed ^ salt),
        load: StdRng::seed_from_u64(seed ^ salt ^ 0x10ad),
        redis,
        c,
        old_binary: old_binary.to_path_buf(),
        pushed: Vec::new(),
        next_jid: 0,
        allowed_dups: HashMap::new(),
        findings: Vec::new(),
        logs: Vec::new(),
        trace: Vec::new(),
        keep_logs: std::env::var_os("ROLLING_KEEP_LOGS").map(PathBuf::from),
        releases: HashMap::new(),
    };
    let (first, second) = match direction {
        Direction::Upgrade => (Release::Old, Release::New),
        Direction::Rollback => (Release::New, Release::Old),
    };
    let fleet = run.deploy(first, second);
    run.final_drain(fleet);
    let summary = run.account(started.elapsed().as_secs_f64());
    Outcome {
        summary,
        findings: run.findings,
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// See the module documentation: `OXIDEKIQ_OLD_BINARY` names the older release's binary.
#[test]
#[ignore = "needs an older release's binary (OXIDEKIQ_OLD_BINARY): scripts/rolling_upgrade.sh"]
fn a_rolling_deploy_under_faults_accounts_for_every_job() {
    let old = std::env::var_os("OXIDEKIQ_OLD_BINARY")
        .map(PathBuf::from)
        .expect("OXIDEKIQ_OLD_BINARY: the older release's oxidekiq binary (scripts/rolling_upgrade.sh builds it)");
    assert!(
        old.is_file(),
        "OXIDEKIQ_OLD_BINARY={} is no file",
        old.display()
    );
    let label = std::env::var("ROLLING_OLD_LABEL").unwrap_or_else(|_| old.display().to_string());
    let directions = match std::env::var("ROLLING_DIRECTION").as_deref() {
        Ok("upgrade") => vec![Direction::Upgrade],
        Ok("rollback") => vec![Direction::Rollback],
        Ok("both") | Err(_) => vec![Direction::Upgrade, Direction::Rollback],
        Ok(other) => panic!("ROLLING_DIRECTION={other}: upgrade, rollback or both"),
    };
    let seeds: Vec<u64> = if let Some(s) = env_u64("ROLLING_SEED") {
        vec![s]
    } else {
        let first = env_u64("ROLLING_FIRST_SEED").unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs()
                % 1_000_000
        });
        let n = env_u64("ROLLING_SEEDS").unwrap_or(1);
        (first..first + n).collect()
    };
    let mut failed = Vec::new();
    for seed in seeds {
        for &direction in &directions {
            let out = run_seed(seed, direction, &old);
            println!(
                "ROLLING old={label} direction={} seed={seed} {} findings={}",
                direction.name(),
                out.summary,
                out.findings.len()
            );
            for f in &out.findings {
                println!("  FINDING seed={seed} {}: {f}", direction.name());
            }
            if !out.findings.is_empty() {
                failed.push(format!("{} seed {seed}", direction.name()));
            }
        }
    }
    assert!(failed.is_empty(), "findings in: {failed:?}");
}
