//! Each cron tick enqueued exactly once, under chaos (issue 30): a seeded randomized test against the
//! real binary and Debian's sidekiq-cron 1.8.0.
//!
//! Each seed draws a fleet (1–3 `oxidekiq` processes, with or without the gem's own poller run from
//! Ruby beside them), 2–4 schedules at once (every second or every other second; some created from
//! Ruby, some declared in a `config/schedule.yml` every process loads), one of them disabled and enabled
//! again from Ruby mid-run (`disable!`/`enable!`, what the Cron tab's buttons do), and faults at random
//! times: SIGKILL or SIGTERM of a process (restarted later, sometimes), a Redis `CLIENT PAUSE` of 1–3 s
//! across ticks, and quiet (TSTP). Every schedule has `date_as_argument`, so each job carries the
//! instant it was enqueued. At the end, from the claim sets (`cron_job:<name>:enqueued`) and the queues:
//!
//! - **two jobs for one tick**: each job belongs to a claimed tick: an oxidekiq job to the tick that
//!   was the latest at its date (oxidekiq dates a job with the instant it chose the tick at, and
//!   claims and pushes in one script); a job of the gem's (which claims, then pushes with a new
//!   `Time.now`, seconds later if Redis pauses between the two) to a claimed tick without a job (the
//!   tick that was the latest at the job's date, if free, else the latest free one) whose window it
//!   can follow (by at most [`CLAIM_TO_PUSH`] plus the time Redis was paused); a tick with two jobs
//!   was enqueued twice;
//! - **claim without job** / **job without claim**: every tick claimed during the run has its job, and
//!   every job a claimed tick;
//! - **enqueued while disabled**: a job whose claim was surely made more than [`ROUND_SLACK`] after
//!   `disable!` returned and before `enable!` started;
//! - **missed tick**: a tick nobody claimed although, over its whole claim window (a tick `T` of a
//!   schedule of period `p` is the latest, so claimable, from `T + 1 s` to `T + 1 s + p`, see
//!   `src/ops/cron/mod.rs`), widened by [`WINDOW_SLACK`] on each side: some process was polling (an
//!   `oxidekiq` from [`START_SLACK`] after it registered until the instant it was killed, TERMed or
//!   quieted; the gem's poller only for 2-second schedules, as it cannot win consecutive 1-second
//!   ticks: its `not_enqueued_after?` guard), Redis was not paused, and the schedule was enabled (from
//!   [`ROUND_SLACK`] after `enable!` returned; not from the start of `disable!`). The gem's 60 s grace
//!   rule does not widen this: a missed tick is never caught up once a later one is the latest, so a
//!   tick whose window is cut by a fault is simply not required.
//!
//! Run:
//!
//! - `cargo test --test ruby cron_chaos::` — [`DEFAULT_SEEDS`] seeds from a random start (printed), the CI
//!   default (about 25 s a seed);
//! - `CRON_CHAOS_SEED=17 cargo test --test ruby cron_chaos:: -- --nocapture` — one seed;
//! - `CRON_CHAOS_SEEDS=40 CRON_CHAOS_FIRST_SEED=1 cargo test --test ruby cron_chaos:: -- --nocapture` — seeds
//!   1..=40;
//! - `CRON_CHAOS_BUDGET_SECS=N` — start no seed after N seconds (default [`DEFAULT_BUDGET_SECS`]).
//!
//! The seed fixes the fleet, the schedules and the timeline, not the interleaving of the processes, so
//! a failing seed is a strong hint, not a replay. `cargo build --workspace` first: the test runs
//! `target/debug/oxidekiq`.

use crate::support;

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redis::Commands;
use support::{LoggedProcess, Oxidekiq, RedisServer, ruby, temp_dir, wait_until};

/// Loads the gem's job model on top of the Sidekiq client preamble.
const CRON: &str = "require \"sidekiq/cron/job\"\n";

/// Each oxidekiq fetches only a queue nobody pushes to (the cron jobs stay in their queues to be
/// counted) and looks at the schedules every second; `-t 2` keeps a TERM short.
const OXIDEKIQ_ARGS: &[&str] = &["-q", "idle", "--cron-poll-interval", "1", "-t", "2"];

/// Seeds run when neither `CRON_CHAOS_SEED` nor `CRON_CHAOS_SEEDS` is set.
const DEFAULT_SEEDS: u64 = 2;

/// No seed starts after this many seconds (`CRON_CHAOS_BUDGET_SECS` overrides).
const DEFAULT_BUDGET_SECS: u64 = 50;

/// A process counts as polling this long after it registered in `processes`: its first cron round
/// waits for the namespace `SCAN` and writes the declared schedules, on a loaded machine.
const START_SLACK: f64 = 2.0;

/// A tick is required only if its claim window, widened by this much on each side, is covered: the
/// poller wakes 20 ms past the claimable second, and a loaded 2-core machine delays a round, a signal
/// or a `CLIENT PAUSE` by some hundreds of milliseconds.
const WINDOW_SLACK: f64 = 1.0;

/// A round that read a schedule just before `disable!`/`enable!` may still act on what it read: this
/// long after the Ruby call returned.
const ROUND_SLACK: f64 = 1.0;

/// The longest a job of the gem's may be dated after its tick stopped being the latest, Redis pauses
/// aside: the gem's `enque!` takes a new `Time.now` a few milliseconds after its `ZADD` (oxidekiq
/// dates a job with the instant it chose the tick at).
const CLAIM_TO_PUSH: f64 = 0.5;

/// A schedule of the plan.
#[derive(Debug, Clone)]
struct Sched {
    name: String,
    /// 1 or 2 seconds.
    period: u32,
    /// Declared in `config/schedule.yml` (else created from Ruby).
    from_file: bool,
}

impl Sched {
    fn cron(&self) -> &'static str {
        if self.period == 1 {
            "* * * * * *"
        } else {
            "*/2 * * * * *"
        }
    }
    fn queue(&self) -> String {
        format!("q_{}", self.name)
    }
    fn key(&self) -> String {
        format!("cron_job:{}", self.name)
    }
}

/// Something that happens during the run, at a second of the plan.
#[derive(Debug, Clone)]
enum Event {
    /// SIGKILL the process in this slot; restart it this many seconds later, if some.
    Kill(usize, Option<f64>),
    /// SIGTERM the process in this slot; restart it this many seconds later, if some.
    Term(usize, Option<f64>),
    /// Start a process in this (empty) slot.
    Restart(usize),
    /// TSTP the process in this slot.
    Quiet(usize),
    /// `CLIENT PAUSE` Redis for this many milliseconds.
    Pause(u64),
    /// `disable!` the toggled schedule from Ruby.
    Disable,
    /// `enable!` it again.
    Enable,
}

/// What a seed draws.
#[derive(Debug)]
struct Plan {
    processes: usize,
    gem: bool,
    schedules: Vec<Sched>,
    /// Index of the schedule disabled and enabled again.
    toggled: usize,
    /// Seconds of the run, after everything started.
    secs: f64,
    events: Vec<(f64, Event)>,
}

impl Plan {
    fn draw(seed: u64) -> Plan {
        let mut rng = StdRng::seed_from_u64(seed);
        let processes = rng.random_range(1..=3);
        let gem = rng.random_bool(0.5);
        let count = rng.random_range(2..=4);
        let schedules: Vec<Sched> = (0..count)
            .map(|i| Sched {
                name: format!("s{i}"),
                period: rng.random_range(1..=2),
                // At least one of each source.
                from_file: match i {
                    0 => false,
                    1 => true,
                    _ => rng.random_bool(0.5),
                },
            })
            .collect();
        let toggled = rng.random_range(0..count);
        let secs: f64 = rng.random_range(14.0..18.0);
        let mut events = Vec::new();
        let disable_at = rng.random_range(3.0..secs - 9.0);
        events.push((disable_at, Event::Disable));
        events.push((disable_at + rng.random_range(3.0..5.0), Event::Enable));
        for _ in 0..rng.random_range(1..=3) {
            let at = rng.random_range(2.0..secs - 3.0);
            let slot = rng.random_range(0..processes);
            let restart = rng.random_bool(0.6).then(|| rng.random_range(1.0..4.0_f64));
            let event = match rng.random_range(0..4) {
                0 => Event::Kill(slot, restart),
                1 => Event::Term(slot, restart),
                2 => Event::Pause(rng.random_range(1_000..=3_000)),
                _ => Event::Quiet(slot),
            };
            if let Event::Kill(_, Some(after)) | Event::Term(_, Some(after)) = event {
                events.push((at + after, Event::Restart(slot)));
            }
            events.push((at, event));
        }
        events.sort_by(|a, b| a.0.total_cmp(&b.0));
        Plan {
            processes,
            gem,
            schedules,
            toggled,
            secs,
            events,
        }
    }

    fn describe(&self) -> String {
        let mut s = format!(
            "{} oxidekiq{}; schedules",
            self.processes,
            if self.gem { " + the gem's poller" } else { "" }
        );
        for (i, sc) in self.schedules.iter().enumerate() {
            let _ = write!(
                s,
                " {}:{}s/{}{}",
                sc.name,
                sc.period,
                if sc.from_file { "file" } else { "ruby" },
                if i == self.toggled { "/toggled" } else { "" }
            );
        }
        let _ = write!(s, "; {:.1}s:", self.secs);
        for (at, e) in &self.events {
            let _ = write!(s, " {at:.1}:{e:?}");
        }
        s
    }

    fn schedule_yml(&self) -> String {
        let mut yml = String::new();
        for s in self.schedules.iter().filter(|s| s.from_file) {
            let _ = write!(
                yml,
                "{}:\n  cron: '{}'\n  class: Tick\n  queue: {}\n  date_as_argument: true\n",
                s.name,
                s.cron(),
                s.queue()
            );
        }
        yml
    }
}

/// When something held, in epoch seconds (`to` is `f64::INFINITY` while it still holds).
#[derive(Debug, Clone, Copy)]
struct Span {
    from: f64,
    to: f64,
}

impl Span {
    fn covers(&self, from: f64, to: f64) -> bool {
        self.from <= from && to <= self.to
    }
    fn overlaps(&self, from: f64, to: f64) -> bool {
        self.from < to && from < self.to
    }
}

/// One oxidekiq slot: the running process, if any.
struct Slot {
    proc: Option<Oxidekiq>,
    /// Index in [`Run::polling`] of the span of the running process (open while it polls).
    span: Option<usize>,
}

struct Run<'a> {
    plan: &'a Plan,
    redis: &'a RedisServer,
    slots: Vec<Slot>,
    /// When each oxidekiq process polled.
    polling: Vec<Span>,
    /// When the gem's poller polled.
    gem: Option<Span>,
    pauses: Vec<Span>,
    /// When the toggled schedule was disabled: from the start of `disable!` to the return of `enable!`.
    disabled: Option<Span>,
    /// The return of `disable!` and the start of `enable!`: no claim may be made between them (with
    /// [`ROUND_SLACK`] after the first).
    strictly_disabled: Option<Span>,
    /// Logs of the processes that ended (to explain a finding).
    logs: Vec<String>,
}

impl Run<'_> {
    fn start(&mut self, slot: usize) {
        let dir = temp_dir("oxidekiq-cron-chaos");
        std::fs::create_dir_all(dir.join("config")).unwrap();
        std::fs::write(dir.join("config/schedule.yml"), self.plan.schedule_yml()).unwrap();
        let proc = Oxidekiq::start_in(dir, &self.redis.url(), OXIDEKIQ_ARGS, &[]);
        let mut c = self.redis.conn();
        let needle = format!(":{}:", proc.pid());
        let up = wait_until(Duration::from_secs(30), || {
            let members: Vec<String> = c.smembers("processes").unwrap_or_default();
            members.iter().any(|m| m.contains(&needle))
        });
        assert!(up, "oxidekiq never registered:\n{}", proc.log());
        self.polling.push(Span {
            from: support::now() + START_SLACK,
            to: f64::INFINITY,
        });
        self.slots[slot] = Slot {
            proc: Some(proc),
            span: Some(self.polling.len() - 1),
        };
    }

    /// Ends the polling span of the process in `slot` now (it was killed, TERMed or quieted).
    fn stop_polling(&mut self, slot: usize) {
        if let Some(i) = self.slots[slot].span.take() {
            let now = support::now();
            self.polling[i].to = self.polling[i].to.min(now);
        }
    }

    fn signal(&mut self, slot: usize, sig: &str) {
        self.stop_polling(slot);
        if let Some(p) = &self.slots[slot].proc {
            p.signal(sig);
        }
    }

    fn end_process(&mut self, slot: usize, kill: bool) {
        self.stop_polling(slot);
        if let Some(mut p) = self.slots[slot].proc.take() {
            if kill {
                p.kill_9();
            } else {
                p.signal("TERM");
                let exited = p.wait_exit(Duration::from_secs(30));
                assert!(exited.is_some(), "no exit 30 s after TERM:\n{}", p.log());
            }
            self.logs.push(p.log());
        }
    }

    fn pause(&mut self, ms: u64) {
        let from = support::now();
        let _: () = redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(ms)
            .query(&mut self.redis.conn())
            .unwrap();
        self.pauses.push(Span {
            from,
            to: support::now() + ms as f64 / 1000.0,
        });
    }

    fn toggle(&mut self, enable: bool) {
        let name = &self.plan.schedules[self.plan.toggled].name;
        let verb = if enable { "enable!" } else { "disable!" };
        let before = support::now();
        ruby(
            &format!("{CRON}Sidekiq::Cron::Job.find('{name}').{verb}"),
            &self.redis.url(),
        );
        let after = support::now();
        if enable {
            if let Some(d) = &mut self.disabled {
                d.to = after + ROUND_SLACK;
            }
            if let Some(s) = &mut self.strictly_disabled {
                s.to = before;
            }
        } else {
            self.disabled = Some(Span {
                from: before,
                to: f64::INFINITY,
            });
            self.strictly_disabled = Some(Span {
                from: after + ROUND_SLACK,
                to: f64::INFINITY,
            });
        }
    }

    /// How long Redis was paused within `from..to`.
    fn paused(&self, from: f64, to: f64) -> f64 {
        self.pauses
            .iter()
            .map(|p| (p.to.min(to) - p.from.max(from)).max(0.0))
            .sum()
    }

    /// Whether some poller that can take the ticks of a `period`-second schedule polled over all of
    /// `from..to`.
    fn polled(&self, period: u32, from: f64, to: f64) -> bool {
        self.polling.iter().any(|s| s.covers(from, to))
            || (period == 2 && self.gem.is_some_and(|g| g.covers(from, to)))
    }
}

/// A tick's instant (epoch seconds) from its claim member (`Time#iso8601`, UTC).
fn tick_of(member: &str) -> Option<f64> {
    chrono::DateTime::parse_from_rfc3339(member)
        .ok()
        .map(|t| t.timestamp() as f64)
}

/// The date a job carries (`date_as_argument`: the last argument).
fn date_of(payload: &str) -> Option<f64> {
    let v: serde_json::Value = serde_json::from_str(payload).ok()?;
    v.get("args")?.as_array()?.last()?.as_f64()
}

/// Runs one seed; returns its findings (empty: every tick once).
fn run_seed(seed: u64, plan: &Plan) -> Vec<String> {
    let redis = RedisServer::start();
    let created: Vec<String> = plan
        .schedules
        .iter()
        .filter(|s| !s.from_file)
        .map(|s| {
            format!(
                "Sidekiq::Cron::Job.create(name: '{}', cron: '{}', class: 'Tick', queue: '{}', \
                 date_as_argument: true) or raise 'not created'",
                s.name,
                s.cron(),
                s.queue()
            )
        })
        .collect();
    ruby(&format!("{CRON}{}", created.join("\n")), &redis.url());
    let mut run = Run {
        plan,
        redis: &redis,
        slots: (0..plan.processes)
            .map(|_| Slot {
                proc: None,
                span: None,
            })
            .collect(),
        polling: Vec::new(),
        gem: None,
        pauses: Vec::new(),
        disabled: None,
        strictly_disabled: None,
        logs: Vec::new(),
    };
    let gem = plan.gem.then(|| {
        let p = LoggedProcess::spawn(
            "ruby-cron",
            Path::new("ruby"),
            &["-e", support::CRON_RUBY_POLLER],
            &[("REDIS_URL", &redis.url())],
        );
        assert!(p.wait_for_log("ruby cron poller up", Duration::from_secs(30)));
        run.gem = Some(Span {
            from: support::now(),
            to: f64::INFINITY,
        });
        p
    });
    for slot in 0..plan.processes {
        run.start(slot);
    }
    // The declared schedules written (with the tick before their first save claimed, as the gem's
    // `save` does): the claims before this instant are not the run's.
    let mut c = redis.conn();
    let declared = wait_until(Duration::from_secs(30), || {
        plan.schedules
            .iter()
            .all(|s| c.exists::<_, bool>(s.key()).unwrap_or(false))
    });
    assert!(declared, "the declared schedules were not written");
    // The claims and jobs before the run (the first save's claim of the tick before it, and the ticks
    // of the seconds everything took to start) are read in one `MULTI` and left out of the checks.
    let started = support::now();
    let before = read_claims_and_jobs(&mut c, &plan.schedules);

    let t0 = Instant::now();
    for (at, event) in &plan.events {
        let target = t0 + Duration::from_secs_f64(*at);
        if let Some(wait) = target.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        match *event {
            Event::Kill(slot, _) => run.end_process(slot, true),
            Event::Term(slot, _) => run.end_process(slot, false),
            Event::Restart(slot) => {
                if run.slots[slot].proc.is_none() {
                    run.start(slot);
                }
            }
            Event::Quiet(slot) => run.signal(slot, "TSTP"),
            Event::Pause(ms) => run.pause(ms),
            Event::Disable => run.toggle(false),
            Event::Enable => run.toggle(true),
        }
    }
    let end = t0 + Duration::from_secs_f64(plan.secs);
    if let Some(wait) = end.checked_duration_since(Instant::now()) {
        std::thread::sleep(wait);
    }
    // The gem claims, then pushes: stop it first, so that no claim of its waits for its job when the
    // claims and the queues are read (oxidekiq claims and pushes in one script).
    // Killed half a second past a whole second: its poll, just after the second, is over by then
    // (a kill between its claim and its push would leave a claim without a job: the gem's own gap).
    if gem.is_some() {
        let now = support::now();
        std::thread::sleep(Duration::from_secs_f64((1.6 - now.fract()) % 1.0));
    }
    let gem_end = support::now();
    drop(gem);
    if let Some(g) = &mut run.gem {
        g.to = gem_end;
    }
    let finished = support::now();
    let after = read_claims_and_jobs(&mut c, &plan.schedules);
    let mut findings = Vec::new();
    for (i, s) in plan.schedules.iter().enumerate() {
        let old_claims: HashSet<&str> = before[i].0.iter().map(|(m, _)| m.as_str()).collect();
        let old_jobs: HashSet<&String> = before[i].1.iter().collect();
        let jobs: Vec<&String> = after[i]
            .1
            .iter()
            .filter(|j| !old_jobs.contains(j))
            .collect();
        let check = Check {
            run: &run,
            s,
            toggled: i == plan.toggled,
            started,
            finished,
        };
        check.schedule(&after[i].0, &old_claims, &jobs, &mut findings);
    }
    for slot in 0..plan.processes {
        run.end_process(slot, true);
    }
    if !findings.is_empty() {
        for (i, log) in run.logs.iter().enumerate() {
            eprintln!("--- log of oxidekiq #{i} (seed {seed}) ---\n{log}--- end ---");
        }
        let mut spans = String::new();
        let _ = write!(
            spans,
            "started {started:.3}, finished {finished:.3}, polling {:?}, gem {:?}, pauses {:?}, disabled {:?}",
            run.polling, run.gem, run.pauses, run.disabled
        );
        findings.push(spans);
    }
    findings
}

/// A schedule's claims (member, score) and the jobs in its queue.
type ClaimsAndJobs = (Vec<(String, f64)>, Vec<String>);

/// The claims and the jobs of each schedule, read in one `MULTI`.
fn read_claims_and_jobs(c: &mut redis::Connection, schedules: &[Sched]) -> Vec<ClaimsAndJobs> {
    let mut pipe = redis::pipe();
    pipe.atomic();
    for s in schedules {
        pipe.zrange_withscores(format!("{}:enqueued", s.key()), 0, -1)
            .lrange(format!("queue:{}", s.queue()), 0, -1);
    }
    let read: Vec<redis::Value> = pipe.query(c).unwrap();
    read.chunks(2)
        .map(|pair| {
            (
                redis::from_redis_value(pair[0].clone()).unwrap(),
                redis::from_redis_value(pair[1].clone()).unwrap(),
            )
        })
        .collect()
}

/// What one schedule is checked against.
struct Check<'r, 'a> {
    run: &'r Run<'a>,
    s: &'r Sched,
    toggled: bool,
    /// When the run's claims start (epoch seconds).
    started: f64,
    /// When the claims were read at the end.
    finished: f64,
}

impl Check<'_, '_> {
    /// The checks of the module documentation, for one schedule: `claims` all its claims, `old` those
    /// made before the run, `jobs` the jobs pushed since.
    fn schedule(
        &self,
        claims: &[(String, f64)],
        old: &HashSet<&str>,
        jobs: &[&String],
        findings: &mut Vec<String>,
    ) {
        let Check {
            run,
            s,
            toggled,
            started,
            finished,
        } = *self;
        let name = &s.name;
        let period = f64::from(s.period);
        // Every claimed tick (a job pushed in the run may belong to one claimed just before it). The
        // gem scores a claim with the tick itself, so the tick is what links a job to its claim.
        let mut ticks: BTreeMap<i64, &str> = BTreeMap::new();
        for (member, _) in claims {
            match tick_of(member) {
                Some(t) => {
                    ticks.insert(t as i64, member);
                }
                None => findings.push(format!("{name}: claim member {member:?} is not an instant")),
            }
        }
        // Each job to its tick. oxidekiq dates a job with the instant it chose the tick at (the claim
        // and the push are one script), so its tick is the latest then. The gem claims, then takes a
        // new `Time.now` for the job and pushes it: a Redis pause between the two dates the job
        // seconds after its claim, so a job of the gem's (Sidekiq's client writes `class` before
        // `args`, oxidekiq after) goes to a claimed tick still without a job that it can
        // be the job of: claimable before its date, and its window ended at most CLAIM_TO_PUSH plus
        // the time Redis was paused before the date.
        let mut jobs_of: BTreeMap<i64, Vec<f64>> = BTreeMap::new();
        let mut gems = Vec::new();
        // (when its claim was made at the earliest, the job's date)
        let mut pushes = Vec::new();
        for job in jobs {
            let Some(date) = date_of(job) else {
                findings.push(format!("{name}: a job without its date: {job}"));
                continue;
            };
            if job.contains(r#""class":"Tick","args""#) {
                gems.push(date);
                continue;
            }
            let tick = (((date - 1.0) / period).floor() * period) as i64;
            if ticks.contains_key(&tick) {
                jobs_of.entry(tick).or_default().push(date);
            } else {
                findings.push(format!(
                    "JOB WITHOUT CLAIM {name}: oxidekiq's job dated {date:.3}: its tick is not claimed"
                ));
            }
            pushes.push((date, date));
        }
        gems.sort_by(f64::total_cmp);
        for date in gems {
            let feasible: Vec<i64> = ticks
                .keys()
                .copied()
                .filter(|&t| {
                    let claimable = t as f64 + 1.0;
                    claimable <= date + 1e-3
                        && date <= claimable + period + CLAIM_TO_PUSH + run.paused(claimable, date)
                })
                .collect();
            // Without a pause the claim is milliseconds before the date: the nominal tick, as for
            // oxidekiq's jobs; else the latest tick it can belong to still without a job.
            let nominal = (((date - 1.0) / period).floor() * period) as i64;
            let free = feasible
                .iter()
                .rev()
                .find(|t| **t == nominal && !jobs_of.contains_key(t))
                .or_else(|| feasible.iter().rev().find(|t| !jobs_of.contains_key(t)));
            match free.or(feasible.last()) {
                Some(&t) => {
                    jobs_of.entry(t).or_default().push(date);
                    pushes.push((t as f64 + 1.0, date));
                }
                None => findings.push(format!(
                    "JOB WITHOUT CLAIM {name}: the gem's job dated {date:.3}: no claimed tick fits"
                )),
            }
        }
        for (claimed_from, date) in pushes {
            if toggled
                && run
                    .strictly_disabled
                    .is_some_and(|d| d.covers(claimed_from, date))
            {
                findings.push(format!(
                    "ENQUEUED WHILE DISABLED {name}: job dated {date:.3}"
                ));
            }
        }
        for (tick, member) in &ticks {
            match jobs_of.get(tick).map_or(0, Vec::len) {
                1 => {}
                // A claim before the run may have its job before the run too.
                0 if old.contains(member) => {}
                0 => findings.push(format!("CLAIM WITHOUT JOB {name}: tick {member}")),
                n => findings.push(format!(
                    "TWO JOBS FOR ONE TICK {name}: tick {member} has {n} jobs dated {:?}",
                    jobs_of[tick]
                )),
            }
        }
        let new_claims = ticks.len() - old.len();
        // Every tick whose window was covered, claimed.
        let mut tick = (started / period).ceil() * period;
        let mut required = 0;
        while tick + 1.0 + period + WINDOW_SLACK <= finished {
            let (from, to) = (
                tick + 1.0 - WINDOW_SLACK,
                tick + 1.0 + period + WINDOW_SLACK,
            );
            let covered = from >= started
                && run.polled(s.period, from, to)
                && !run.pauses.iter().any(|p| p.overlaps(from, to))
                && !(toggled && run.disabled.is_some_and(|d| d.overlaps(from, to)));
            if covered {
                required += 1;
                if !ticks.contains_key(&(tick as i64)) {
                    findings.push(format!(
                        "MISSED TICK {name}: {} (window {from:.3}..{to:.3}) covered, not claimed",
                        chrono::DateTime::from_timestamp(tick as i64, 0)
                            .map_or_else(|| tick.to_string(), |t| t.to_rfc3339())
                    ));
                }
            }
            tick += period;
        }
        eprintln!(
            "    {name} ({}s{}): {} ticks claimed in the run, {} jobs, {required} required",
            s.period,
            if toggled { ", toggled" } else { "" },
            new_claims,
            jobs.len()
        );
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

#[test]
fn each_cron_tick_is_enqueued_once_under_random_chaos() {
    let seeds: Vec<u64> = match (env_u64("CRON_CHAOS_SEED"), env_u64("CRON_CHAOS_SEEDS")) {
        (Some(seed), _) => vec![seed],
        (None, count) => {
            let count = count.unwrap_or(DEFAULT_SEEDS);
            let first = env_u64("CRON_CHAOS_FIRST_SEED")
                .unwrap_or_else(|| support::now() as u64 % 1_000_000);
            (first..first + count).collect()
        }
    };
    eprintln!(
        "cron chaos: seeds {seeds:?} (one: CRON_CHAOS_SEED=N; many: CRON_CHAOS_SEEDS=K \
         CRON_CHAOS_FIRST_SEED=N; add -- --nocapture to see each seed's line)"
    );
    let budget =
        Duration::from_secs(env_u64("CRON_CHAOS_BUDGET_SECS").unwrap_or(DEFAULT_BUDGET_SECS));
    let started = Instant::now();
    let mut failed = Vec::new();
    for seed in seeds {
        if started.elapsed() > budget {
            eprintln!(
                "cron chaos: time budget of {}s spent; seed {seed} and later not run",
                budget.as_secs()
            );
            break;
        }
        let plan = Plan::draw(seed);
        let t = Instant::now();
        let findings = run_seed(seed, &plan);
        let status = if findings.is_empty() { "ok" } else { "FAIL" };
        eprintln!(
            "cron chaos {status} seed={seed} {} | {:.0}s",
            plan.describe(),
            t.elapsed().as_secs_f64()
        );
        for f in &findings {
            eprintln!("    seed={seed} {f}");
        }
        if !findings.is_empty() {
            failed.push(format!(
                "seed {seed} ({}):\n  {}",
                plan.describe(),
                findings.join("\n  ")
            ));
        }
    }
    assert!(
        failed.is_empty(),
        "cron chaos found defects in {} seed(s) (rerun one with CRON_CHAOS_SEED=N):\n{}",
        failed.len(),
        failed.join("\n")
    );
}
