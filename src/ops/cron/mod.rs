//! sidekiq-cron without Ruby: the poller that runs the gem's schedules from oxidekiq, so a fleet with
//! no Ruby process keeps every periodic job, and a mixed fleet still enqueues each tick once.
//!
//! Layer: migration and operations (beside `migrate`, `http`, `metrics`): it uses the [`Client`]
//! (job chain) and the Redis layer, and the launcher wires it as one more background task.
//!
//! Mirrors sidekiq-cron 1.8.0's `poller.rb` and `job.rb` (and reads 2.x's namespaced layout, see
//! `store`). Each round reads every schedule from Redis (`Job.all`) and, for each one whose latest
//! tick is due (`Entry::due`: enabled, within the 60-second grace, not enqueued since),
//! claims the tick with the gem's own `ZADD cron_job:<name>:enqueued <score> <tick>`; only the process
//! whose `ZADD` added the member pushes the job. Ruby pollers with the gem and oxidekiq processes
//! contend for the same members, so any mix of them enqueues a tick once. Unlike the gem, the claim and
//! the push are one script ([`Client`]'s claimed push): a process killed between the two cannot leave
//! a claimed tick without its job.
//!
//! The gem polls every `cron_poll_interval` (30 s, with jitter); this poller sleeps until the next tick
//! of any enabled schedule is claimable (a tick `T` is the latest from `T + 1 s` on, as fugit computes
//! it), and looks at Redis at least every [`CronConfig::poll_interval`] for schedules created or
//! enabled elsewhere; between those whole reads a round reads again only the schedules its cached copy
//! finds due, and the cached copy keeps each tick the round enqueued or found claimed, so a schedule is
//! read once per tick, not every round until the next whole read. Missed ticks (Redis down, every process stopped) are not caught up: only the
//! latest one, if at most 60 s old, as in the gem. A quiet process stops polling, as Ruby's
//! `Launcher#quiet` stops the cron poller. With no schedule in Redis, a round is two `SMEMBERS`
//! (`cron_jobs`, `cron_jobs:default`) per interval, and a `SCAN` for other namespaces every 10 minutes
//! by one process of the fleet (`store::shared_schedule_sets`; the others read what it found), run
//! beside the rounds so that a large keyspace delays no tick.
//!
//! Schedules are also declared here: `config/schedule.yml` (as the gem's `schedule_loader.rb` reads
//! it), `sidekiq.yml`'s `:schedule:`, and [`CronJob`]s given in Rust are written at start in the gem's
//! format, so the Web UI's Cron tab lists them and enables or disables them.

mod entry;
mod schedule;
mod store;
#[cfg(test)]
mod tests_walk;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};

use self::entry::Entry;
pub use self::schedule::Schedule;
use crate::client::{Client, TimeMode};
pub use crate::config::{CronConfig, CronJob};
use crate::error::Result;
use crate::redis_conn::Conn;
use crate::shutdown::ShutdownSignal;

/// How long after its claimable second the poller wakes for a tick: the tick `T` is claimable from
/// `T + 1 s`, and a little margin keeps the wake-up on the right side of that second.
const WAKE_MARGIN: Duration = Duration::from_millis(20);

/// How often the fleet scans the keyspace for sidekiq-cron 2.x namespaces other than `default` (a `SCAN`
/// walks every key: on a large Redis, every 30 s from every process would cost more than the polls).
/// One process walks per interval; the others read what it stored (issue 43: 20 processes each
/// walking 5 M keys every ten minutes cost Redis about 14 s of CPU a minute).
/// `cron_jobs` and `cron_jobs:default` are read every round.
const NAMESPACE_SCAN_INTERVAL: Duration = Duration::from_secs(600);

/// The shortest [`CronConfig::poll_interval`] used.
const MIN_POLL_INTERVAL: Duration = Duration::from_millis(100);

/// How long to wait after a round that failed (Redis unreachable) before the next.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The poller's memory between rounds.
#[derive(Debug, Default)]
struct Poller {
    /// The schedule sets found by the fleet's last walk (and `cron_jobs`), and when to look again.
    sets: Option<(Vec<String>, tokio::time::Instant)>,
    /// How often the fleet walks the keyspace for namespaces ([`NAMESPACE_SCAN_INTERVAL`]).
    namespace_interval: Duration,
    /// Schedules reported as unreadable (key and message), so each is reported once, not each round.
    reported: HashSet<(String, String)>,
    /// Whether the last round saw any schedule (for the one log line when that changes).
    running: bool,
    /// Declared schedules not yet written (Redis was unreachable at start).
    pending: Vec<CronJob>,
    /// Whether `sidekiq.yml`'s schedules were looked at (they join `pending` in the first round).
    sidekiq_yml_checked: bool,
    /// Each `cron` string seen, parsed and checked to tick at all: a schedule is read every round,
    /// and the search for a tick that never comes (Feb 31st) is slow.
    schedules: HashMap<String, Result<Schedule, String>>,
    /// The schedules the last whole read found, and when: until `poll_interval` later a round reads
    /// again only those due (the gem itself reads every schedule once per poll interval).
    read: Option<(Vec<Entry>, tokio::time::Instant)>,
}

/// Past this many distinct `cron` strings (or reported problems) the cache starts over: schedules
/// rewritten with ever new strings would otherwise grow it without bound.
const MAX_CACHED_SCHEDULES: usize = 10_000;

/// Runs the cron poller until the process goes quiet: writes the declared schedules, then a round at
/// each tick. Errors are logged and the round retried. Jobs are pushed by a [`Client`] writing the
/// timestamps `millisecond_timestamps` says (`None`: as the live processes read them).
pub(crate) async fn run(
    conn: Conn,
    millisecond_timestamps: Option<bool>,
    cfg: CronConfig,
    shutdown: ShutdownSignal,
) {
    run_every(
        conn,
        millisecond_timestamps,
        cfg,
        shutdown,
        NAMESPACE_SCAN_INTERVAL,
    )
    .await
}

/// [`run`], the fleet walking the keyspace for namespaces every `namespace_interval`.
async fn run_every(
    conn: Conn,
    millisecond_timestamps: Option<bool>,
    cfg: CronConfig,
    mut shutdown: ShutdownSignal,
    namespace_interval: Duration,
) {
    let mode = match millisecond_timestamps {
        Some(true) => TimeMode::Millis,
        Some(false) => TimeMode::Seconds,
        None => TimeMode::Auto,
    };
    let client = Client::new(conn.clone()).with_time_mode(mode);
    // A zero interval (possible from Rust) would make an idle poller spin.
    let cfg = CronConfig {
        poll_interval: cfg.poll_interval.max(MIN_POLL_INTERVAL),
        ..cfg
    };
    let mut poller = Poller {
        pending: declared(&cfg),
        namespace_interval: namespace_interval.max(cfg.poll_interval),
        ..Poller::default()
    };
    // The keyspace SCAN for namespaces runs beside the rounds, not inside one: it walks every key
    // (about 0.8 s per million keys), and a round waiting for it enqueues no tick meanwhile. One
    // process of the fleet walks per interval; the others read what it found.
    let identity = crate::job::new_jid();
    let mut scan: Option<Scan> = None;
    loop {
        if scan.is_none() && poller.scan_due() {
            let (conn, started) = (conn.clone(), tokio::time::Instant::now());
            let (identity, every) = (identity.clone(), poller.namespace_interval);
            scan = Some(Box::pin(async move {
                (
                    store::shared_schedule_sets(&conn, &identity, every).await,
                    started,
                )
            }));
        }
        let wait = match poller.round(&conn, &client, &cfg).await {
            Ok(wait) => wait,
            Err(e) => {
                tracing::error!(error = %e, "cron poller: round failed; trying again");
                RETRY_AFTER
            }
        };
        shutdown.events().announce(crate::events::Event::CronRound);
        let until = tokio::time::Instant::now() + wait;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(until) => break,
                (found, started) = running(&mut scan) => {
                    scan = None;
                    poller.scanned(found, started);
                    // Declared schedules waited for this scan: write them now, not a poll later.
                    if !poller.pending.is_empty() {
                        break;
                    }
                }
                _ = shutdown.quiet() => return,
            }
        }
    }
}

/// The namespace scan under way: the sets found, and when it started.
type Scan =
    std::pin::Pin<Box<dyn Future<Output = (Result<store::Shared>, tokio::time::Instant)> + Send>>;

/// Waits for the scan under way; never ends when there is none.
async fn running(scan: &mut Option<Scan>) -> (Result<store::Shared>, tokio::time::Instant) {
    match scan {
        Some(s) => s.await,
        None => std::future::pending().await,
    }
}

/// The schedules declared in Rust and in the schedule file (when the file exists); an entry that
/// cannot be read is logged at error level and left out. `sidekiq.yml`'s are added by the first round,
/// once it knows whether sidekiq-scheduler runs them.
fn declared(cfg: &CronConfig) -> Vec<CronJob> {
    let mut jobs = cfg.jobs.clone();
    if cfg.schedule_file.is_file() {
        match crate::config::read_schedule_file(&cfg.schedule_file) {
            Ok((from_file, errors)) => {
                jobs.extend(from_file);
                for e in errors {
                    let e = crate::logging::escape(&e);
                    tracing::error!("cron schedule not loaded: {e}");
                }
            }
            Err(e) => {
                let e = crate::logging::escape(&e);
                tracing::error!("cron schedule file not loaded: {e}");
            }
        }
    }
    jobs
}

/// `sidekiq.yml`'s schedules, unless sidekiq-scheduler runs them from a Ruby process (its
/// `sidekiq-scheduler:next_times` hash exists): then they are left to it, with a warning, since
/// writing them as sidekiq-cron schedules would enqueue each tick twice.
async fn sidekiq_yml_schedules(conn: &Conn, cfg: &CronConfig) -> Result<Vec<CronJob>> {
    if cfg.sidekiq_yml_jobs.is_empty() {
        return Ok(Vec::new());
    }
    let scheduler: bool = redis::cmd("EXISTS")
        .arg(crate::keys::SIDEKIQ_SCHEDULER_NEXT_TIMES)
        .query_async(&mut conn.clone())
        .await?;
    if scheduler {
        tracing::warn!(
            "sidekiq.yml's :schedule: is left to sidekiq-scheduler, which runs it from a Ruby \
             process ({} exists); move it to config/schedule.yml to run it as sidekiq-cron schedules",
            crate::keys::SIDEKIQ_SCHEDULER_NEXT_TIMES
        );
        return Ok(Vec::new());
    }
    Ok(cfg.sidekiq_yml_jobs.clone())
}

impl Poller {
    /// One round: declared schedules written (once), schedules read, due ticks claimed and pushed.
    /// Returns how long to sleep before the next round.
    async fn round(&mut self, conn: &Conn, client: &Client, cfg: &CronConfig) -> Result<Duration> {
        let found = self
            .sets
            .as_ref()
            .map(|(s, _)| s.clone())
            .unwrap_or_default();
        if !self.sidekiq_yml_checked {
            self.pending.extend(sidekiq_yml_schedules(conn, cfg).await?);
            self.sidekiq_yml_checked = true;
        }
        // Declared schedules wait for the first scan: the layout they are written in depends on
        // which namespaced sets exist.
        if !self.pending.is_empty() && self.sets.is_some() {
            let layout = store::layout_of(&found);
            for job in std::mem::take(&mut self.pending) {
                if let Err(e) = store::save(conn, &job, layout, Utc::now()).await {
                    if e.is_connection_error() {
                        self.pending.push(job);
                        return Err(e);
                    }
                    let name = crate::logging::escape(&job.name);
                    tracing::error!(schedule = %name, error = %e, "cron schedule not written");
                }
            }
        }
        if let Some((cached, at)) = &self.read
            && at.elapsed() < cfg.poll_interval
        {
            let now = Utc::now();
            let due: Vec<(String, Option<String>)> = cached
                .iter()
                .filter(|e| matches!(e.due(now), Ok(Some(_))))
                .map(|e| (e.key.clone(), e.twin.clone()))
                .collect();
            let left = cfg.poll_interval.saturating_sub(at.elapsed());
            let wake = next_wake(cached, now, left.max(Duration::from_millis(100)));
            if !due.is_empty() {
                let loaded =
                    store::load_keys(conn, due.iter().map(|(k, _)| k.clone()).collect()).await?;
                for (key, why) in loaded.problems {
                    self.report(&key, &why);
                }
                for (key, fields) in loaded.hashes {
                    let schedules = &mut self.schedules;
                    let Ok(mut entry) =
                        Entry::from_hash(&key, fields, &mut |c| parse_cached(schedules, c))
                    else {
                        continue;
                    };
                    entry.twin = due
                        .iter()
                        .find(|(k, _)| *k == key)
                        .and_then(|(_, t)| t.clone());
                    entry.settled = self.enqueue_if_due(conn, client, &entry).await?;
                    // The fresh copy (with the tick just settled) replaces the cached one, so the
                    // next rounds find it due only at its next tick.
                    if let Some((cached, _)) = &mut self.read
                        && let Some(slot) = cached.iter_mut().find(|e| e.key == key)
                    {
                        *slot = entry;
                    }
                }
            }
            return Ok(wake);
        }
        let loaded = store::load(conn, &store::sets_to_read(found)).await?;
        for (key, why) in loaded.problems {
            self.report(&key, &why);
        }
        let mut entries = Vec::new();
        for (key, fields) in loaded.hashes {
            let schedules = &mut self.schedules;
            match Entry::from_hash(&key, fields, &mut |c| parse_cached(schedules, c)) {
                Ok(e) => entries.push(e),
                Err(msg) => self.report(
                    &key,
                    &format!("is not a valid sidekiq-cron schedule: {msg}"),
                ),
            }
        }
        entry::link_twins(&mut entries);
        let running = !entries.is_empty();
        if running != self.running {
            self.running = running;
            tracing::info!(
                schedules = entries.len(),
                "cron poller: {} sidekiq-cron schedules",
                if self.running { "running" } else { "no" }
            );
        }
        for entry in &mut entries {
            entry.settled = self.enqueue_if_due(conn, client, entry).await?;
        }
        let wake = next_wake(&entries, Utc::now(), cfg.poll_interval);
        self.read = Some((entries, tokio::time::Instant::now()));
        Ok(wake)
    }

    /// Claims and pushes `entry`'s due tick, if it has one and no process claimed it yet. Returns the
    /// tick when it is settled (enqueued here, or claimed by another process): the cached copy keeps
    /// it so the rounds between whole reads do not read the schedule again for that tick.
    async fn enqueue_if_due(
        &mut self,
        conn: &Conn,
        client: &Client,
        entry: &Entry,
    ) -> Result<Option<DateTime<Utc>>> {
        let now = Utc::now();
        let tick = match entry.due(now) {
            Ok(Some(tick)) => tick,
            Ok(None) => return Ok(None),
            Err(msg) => {
                self.report(&entry.key, &msg);
                return Ok(None);
            }
        };
        match client
            .push_claimed(entry.job(crate::time::epoch_secs(now)), entry.claim(tick))
            .await
        {
            Ok(Some(jid)) => {
                // Debug, as the gem logs it: a 1-second schedule would fill the log at info.
                let name = crate::logging::escape(&entry.name);
                tracing::debug!(schedule = %name, tick = %tick, jid = %jid, "cron job enqueued");
                let twin = entry.twin.as_deref();
                if let Err(e) = store::after_enqueue(conn, &entry.key, twin, &jid, now).await {
                    let key = crate::logging::escape(&entry.key);
                    tracing::error!(key = %key, error = %e, "cron job enqueued, but its last_enqueue_time and jid_history were not written");
                }
                Ok(Some(tick))
            }
            // Another process claimed the tick first: it enqueued it.
            Ok(None) => Ok(Some(tick)),
            Err(e) if e.is_connection_error() => Err(e),
            Err(e) => {
                self.report(&entry.key, &format!("its job was not enqueued (the tick is left unclaimed, tried again each round): {e}"));
                Ok(None)
            }
        }
    }

    /// Whether the namespace look is due: none has finished yet, or the fleet's next walk is due
    /// (the stored result expired).
    fn scan_due(&self) -> bool {
        self.sets
            .as_ref()
            .is_none_or(|(_, at)| tokio::time::Instant::now() >= *at)
    }

    /// Keeps what the scan that began at `started` found. A scan the server refuses (an ACL without
    /// `SCAN`) is reported once and counts as finding no namespace, so declared schedules are still
    /// written and the usual sets read; it is tried again after the interval. Any other failure
    /// (Redis unreachable) is logged and tried again from the next round.
    fn scanned(&mut self, found: Result<store::Shared>, started: tokio::time::Instant) {
        match found {
            Ok(shared) => {
                if let Some((key, why)) = &shared.damaged {
                    self.report(key, why);
                }
                // At least a second apart: a process whose stored walk is about to expire looks
                // again after it, not in a loop.
                let next = tokio::time::Instant::now() + shared.fresh_for;
                self.sets = Some((shared.sets, next.max(started + Duration::from_secs(1))));
            }
            Err(e) if !e.is_connection_error() => {
                self.report(
                    crate::keys::CRON_JOBS_NAMESPACED,
                    &format!(
                        "could not be scanned for ({e}); only {} and {} are read",
                        crate::keys::CRON_JOBS,
                        crate::keys::cron_jobs_in(store::DEFAULT_NAMESPACE)
                    ),
                );
                self.sets = Some((
                    vec![crate::keys::CRON_JOBS.to_string()],
                    started + self.namespace_interval,
                ));
            }
            Err(e) => {
                tracing::error!(error = %e, "cron poller: the scan for sidekiq-cron namespaces failed; trying again")
            }
        }
    }

    /// Logs a problem with a key at error level, once per key and message: a bad key is tried again
    /// every round (it may be fixed), and would otherwise log every second.
    fn report(&mut self, key: &str, why: &str) {
        if self.reported.len() >= MAX_CACHED_SCHEDULES {
            self.reported.clear();
        }
        if self.reported.insert((key.to_string(), why.to_string())) {
            let (key, why) = (crate::logging::escape(key), crate::logging::escape(why));
            tracing::error!(key = %key, "cron: {key} {why}");
        }
    }
}

/// [`Schedule::parse`] through `cache`, refusing a schedule with no tick ahead.
fn parse_cached(
    cache: &mut HashMap<String, Result<Schedule, String>>,
    cron: &str,
) -> Result<Schedule, String> {
    if let Some(known) = cache.get(cron) {
        return known.clone();
    }
    if cache.len() >= MAX_CACHED_SCHEDULES {
        cache.clear();
    }
    let parsed = Schedule::parse(cron).and_then(|s| {
        s.next_time(Utc::now())
            .map(|_| s)
            .map_err(|_| format!("{cron:?} never ticks"))
    });
    cache.insert(cron.to_string(), parsed.clone());
    parsed
}

/// How long until the next tick of an enabled schedule is claimable (its second plus one, plus
/// [`WAKE_MARGIN`]), at most `interval`.
fn next_wake(entries: &[Entry], now: DateTime<Utc>, interval: Duration) -> Duration {
    let one = chrono::Duration::seconds(1);
    entries
        .iter()
        .filter(|e| e.enabled)
        .filter_map(|e| e.schedule.next_time(now - one).ok())
        .map(|tick| (tick + one - now).to_std().unwrap_or(Duration::ZERO) + WAKE_MARGIN)
        .fold(interval, Duration::min)
}
