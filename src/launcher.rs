//! The launcher: builds every part, starts the loops, routes controls, and stops in order. Wiring only:
//! the loops live with their owners (fetch loops and processors in `manager`, the heartbeat in
//! `heartbeat`, orphan recovery in `fetch::recovery`, the poller in
//! `scheduled`).
//!
//! Capsules (Sidekiq 7's, `Config::capsules`): one manager per capsule, the default one first, each
//! with its own fetch (its own queues and order, its own blocking connection, its own range of batch
//! numbers: `fetch::CAPSULE_SHIFT`), work table and acker; they share the identity, the heartbeat, the
//! liveness key, recovery, the quiet and the stop. A process of one capsule builds exactly what it
//! built before capsules.
//!
//! Mirrors `launcher.rb`. Control arrives from OS signals (TSTP quiet; TERM/INT stop; TTIN dump: class,
//! jid, queue and start time of each running job, never its arguments), from the Web UI through
//! `<identity>-signals`, or from a [`Handle`] in tests.
//!
//! Quiet: stop fetching (a fetch under way ends, within the block time, and what it got goes back), then
//! push back what this process holds but never handed out (a landing list, the reply of a lost fetch).
//!
//! Shutdown, in order: quiet, give running jobs until the deadline (`-t`), then cancel them; flush acks of
//! jobs whose fate is in Redis; push every unfinished job back, byte for byte, to the end of its queue that
//! is served next (`RPUSH`); push back anything left in our working lists; leave `processes`. A second
//! TERM/INT cancels running jobs at once. The clean-up after the jobs ends by the deadline, or
//! [`CLEANUP_MIN`] after the jobs ended if that is later; a TERM/INT during it ends it at once. Whatever it
//! could not push back (Redis down) stays in this process's working keys, where another process's
//! recovery finds it: the stop never hangs on Redis, and no job is lost.
//!
//! # Two runtimes: the control plane and the jobs
//!
//! Jobs run on a runtime of their own (`JobRuntime`, `--threads` worker threads), built here. The
//! runtime [`Launcher::start`] is called on keeps everything else: signals, this loop and the stop
//! deadline, the heartbeat and liveness key, the fetch loops, the acker, the push-back, the scheduled
//! poller, recovery and `--http`, with the Redis connections they use (a connection's driver task lives
//! on the runtime that made it). A job that holds its thread (a synchronous driver, `std::thread::sleep`,
//! a CPU-bound loop) can then starve other jobs of its runtime, never the process: it beats, quiets and
//! stops on time, as Sidekiq's heartbeat thread does beside stuck job threads. At the deadline such a
//! job is pushed back like any unfinished one and its thread abandoned: `JobRuntime` is shut down
//! without waiting for it, and the process exits with the thread still stuck. Jobs get a connection of
//! their own, so a reconnect one of them triggers (which spawns the new driver where it runs) never
//! moves the control plane's connection onto the job runtime.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::config::{Capsule, Config};
use crate::error::Result;
pub use crate::events::{Event, Listener};
use crate::fetch::{self, Fetch};
use crate::fleet::Fleet;
use crate::heartbeat::{self, CapsuleInfo, Heartbeat, ProcessInfo};
use crate::lock_batch::Locks;
use crate::manager::{Manager, with_retries};
use crate::metrics::Metrics;
use crate::processor::{Processor, Stats};
use crate::redis_conn::{self, Conn};
use crate::registry::Registry;
use crate::scheduled;
pub use crate::shutdown::{Control, Phase};
use crate::shutdown::{Shutdown, ShutdownSignal};
use crate::time::TimeFormat;
use crate::work_table::WorkTable;

/// A handle on a running launcher: send it controls, wait for it to end.
#[derive(Debug)]
pub struct Handle {
    /// Where controls go.
    control: mpsc::UnboundedSender<Control>,
    /// The launcher's task.
    task: tokio::task::JoinHandle<Result<()>>,
    /// This process's identity (`host:pid:hex`).
    identity: String,
    /// The process's phase.
    signal: ShutdownSignal,
}

/// A cloneable sender of controls to a running launcher (for a caller that also waits on its handle).
#[derive(Debug, Clone)]
pub struct Controls(mpsc::UnboundedSender<Control>);

impl Controls {
    /// Sends a control.
    pub fn send(&self, c: Control) {
        let _ = self.0.send(c);
    }
}

impl Handle {
    /// A sender of controls that outlives [`Handle::join`].
    pub fn controls(&self) -> Controls {
        Controls(self.control.clone())
    }

    /// The identity shown on the Busy page.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Sends a control.
    pub fn send(&self, c: Control) {
        let _ = self.control.send(c);
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        self.signal.phase()
    }

    /// A listener to what this launcher's loops announce (a beat written, a poller pass, a recovery
    /// pass, a cron round), for tests that wait for "two beats later" rather than for a time window.
    pub fn events(&self) -> Listener {
        self.signal.events().subscribe()
    }

    /// Stops and waits for the shutdown to finish.
    pub async fn stop(self) -> Result<()> {
        self.send(Control::Stop);
        self.join().await
    }

    /// Waits until the launcher ends.
    pub async fn join(self) -> Result<()> {
        match self.task.await {
            Ok(r) => r,
            Err(e) => Err(crate::Error::Config(format!("launcher task failed: {e}"))),
        }
    }
}

/// Builds and runs a process: what [`run`](crate::run) does after reading the command line, for a
/// binary that builds its [`Config`] itself.
///
/// ```no_run
/// use oxidekiq::{Config, JobContext, JobResult, Launcher, Registry, Worker};
///
/// #[derive(Debug)]
/// struct HardWorker;
/// impl Worker for HardWorker {
///     const CLASS: &'static str = "HardWorker";
///     type Args = (String, i64);
///     async fn perform(&self, _ctx: &JobContext, _args: Self::Args) -> JobResult { Ok(()) }
/// }
///
/// // The control plane runs here; the jobs on a runtime the launcher builds (`config.threads`).
/// #[tokio::main(flavor = "current_thread")]
/// async fn main() -> oxidekiq::Result<()> {
///     let mut registry = Registry::new();
///     registry.register(HardWorker);
///     let config = Config {
///         redis_url: Some("redis://127.0.0.1:6379/0".into()),
///         concurrency: 25,
///         ..Config::default()
///     };
///     Launcher::new(config, registry).run().await // until TERM, INT or the Web UI's Stop
/// }
/// ```
#[derive(Debug)]
pub struct Launcher {
    /// The configuration.
    config: Config,
    /// The workers.
    registry: Registry,
}

impl Launcher {
    /// A launcher for these workers.
    pub fn new(config: Config, registry: Registry) -> Self {
        Launcher { config, registry }
    }

    /// Runs until TERM/INT (or the Web UI's Stop) and the shutdown is done. OS signals are wired here.
    pub async fn run(self) -> Result<()> {
        // Handlers go in before the process registers: a TSTP or TERM sent as soon as the process shows
        // up in `processes` must not meet the default action (stop or kill the process).
        let os_signals = OsSignals::install();
        let handle = self.start().await?;
        let control = handle.control.clone();
        let signals = tokio::spawn(forward_os_signals(os_signals, control));
        let result = handle.join().await;
        signals.abort();
        result
    }

    /// Connects, registers the process and starts every part; returns at once with a [`Handle`].
    pub async fn start(self) -> Result<Handle> {
        let cfg = self.config;
        // The same cost bounds as the flags and sidekiq.yml, for a Config built by hand in Rust (a weight
        // of u32::MAX would otherwise allocate its shuffle list per fetch).
        cfg.check_bounds()?;
        let jobs = JobRuntime::build(cfg.threads)?;
        let target = redis_conn::Target::new(
            &cfg.redis_url(),
            cfg.redis_ca_file().as_deref(),
            cfg.sentinel.as_ref(),
        )
        .await?;
        let conn = target.connect().await?;
        let job_conn = target.connect().await?;
        let block = Duration::from_secs(1);
        // The timestamp format follows the fleet, re-decided on every beat (the first one below runs
        // before any job), unless configured.
        let fleet = Arc::new(Fleet::new(cfg.millisecond_timestamps.map(|ms| {
            if ms {
                TimeFormat::Millis
            } else {
                TimeFormat::Seconds
            }
        })));
        let capsules = cfg.all_capsules();
        if capsules.len() > fetch::MAX_CAPSULES {
            return Err(crate::Error::Config(format!(
                "{} capsules, there may be at most {}",
                capsules.len(),
                fetch::MAX_CAPSULES
            )));
        }
        let info = ProcessInfo::new(
            cfg.tag.clone(),
            cfg.labels.clone(),
            capsules
                .iter()
                .map(|c| CapsuleInfo {
                    name: c.name.clone(),
                    concurrency: c.concurrency,
                    queues: c
                        .queues
                        .iter()
                        .map(|q| (q.name.clone(), q.weight))
                        .collect(),
                })
                .collect(),
        );
        let identity = info.identity.clone();
        // One fetch per capsule, over its own queues, with a blocking connection of its own (a
        // blocking wait holds its connection). The first one's is made first: a process of one capsule
        // opens the connections it always did.
        let mut fetches = Vec::with_capacity(capsules.len());
        for (index, capsule) in capsules.iter().enumerate() {
            let blocking = target.connect_blocking(block).await?;
            fetches.push(fetch::new(
                cfg.fetch,
                fetch::Setup {
                    queues: &capsule.queues,
                    identity: &identity,
                    conn: conn.clone(),
                    blocking,
                    block,
                    max_payload_bytes: cfg.max_payload_bytes,
                    fleet: fleet.clone(),
                    capsule: index as u64,
                    dialer: target.dialer(),
                },
            ));
        }
        let parts = RunningLauncher::build(
            cfg,
            self.registry,
            Conns {
                control: conn,
                jobs: job_conn,
                lock_dialer: target.dialer(),
            },
            capsules.into_iter().zip(fetches).collect(),
            fleet,
            info,
            jobs,
        )
        .await?;
        tracing::info!(
            identity = %identity,
            concurrency = parts.heartbeat.info.concurrency(),
            queues = %parts.cfg.queues.iter().map(|q| q.name.as_str()).collect::<Vec<_>>().join(","),
            capsules = %parts.heartbeat.info.capsules.iter().map(|c| format!("{}:{}:{}", c.name, c.concurrency,
                c.queues.iter().map(|(q, _)| q.as_str()).collect::<Vec<_>>().join(","))).collect::<Vec<_>>().join(" "),
            redis = %target.describe(&parts.cfg.redis_url()),
            fetch = ?parts.cfg.fetch,
            "oxidekiq {} starting", env!("CARGO_PKG_VERSION")
        );
        let (control, signal) = (parts.control_tx.clone(), parts.shutdown.signal());
        let task = tokio::spawn(parts.run());
        Ok(Handle {
            control,
            task,
            identity,
            signal,
        })
    }
}

/// The runtime that runs the jobs (`--threads` worker threads, by default one per CPU less one: see
/// [`default_job_threads`]), apart from the
/// control plane's (see the module docs). Dropping it shuts it down without waiting: a thread stuck in
/// a job is abandoned rather than waited for (a plain drop of a runtime would wait for it forever, and
/// panics inside an async context).
#[derive(Debug)]
pub(crate) struct JobRuntime(Option<tokio::runtime::Runtime>);

impl JobRuntime {
    /// A multi-thread runtime of `threads` workers ([`default_job_threads`] when `None`).
    fn build(threads: Option<usize>) -> Result<JobRuntime> {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.worker_threads(threads.unwrap_or_else(default_job_threads));
        let runtime = builder
            .thread_name("oxidekiq-job")
            .enable_all()
            .build()
            .map_err(|e| crate::Error::Config(format!("cannot start the job runtime: {e}")))?;
        Ok(JobRuntime(Some(runtime)))
    }

    /// Where the processors are spawned.
    fn handle(&self) -> Option<tokio::runtime::Handle> {
        self.0.as_ref().map(|r| r.handle().clone())
    }
}

/// The job runtime's threads when `--threads` is not given: one per CPU less the one the control plane
/// runs on (fetching, acks, logs' hand-off, the heartbeat), at least one, so the process has a thread
/// per CPU in all. With a thread per CPU for the jobs on top of the control plane's, the process had
/// more threads than cores: on 2 CPUs a no-op job cost 3.5 µs of CPU against 2.6 µs with one job thread
/// (issue 32, `bench/run.sh`), the extra spent by two job threads taking turns with the control plane
/// and Redis for two cores. CPU-bound async jobs still run on all cores but one; `--threads` sets any
/// number.
pub(crate) fn default_job_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1))
}

impl Drop for JobRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// The two Redis connections of a process.
struct Conns {
    /// The control plane's: heartbeat, fetch, acks, push-back, poller, recovery, `--http`.
    control: Conn,
    /// The jobs': fate writes, [`JobContext::redis`](crate::JobContext::redis), job locks (without a
    /// dialer).
    jobs: Conn,
    /// How the job locks' batch task connects on its own (a plain-text server, `redis_conn::resp`).
    lock_dialer: Option<redis_conn::resp::Dialer>,
}

/// A started launcher: everything it owns while it runs (its connection, job runtime, managers,
/// heartbeat, control channel, lock batch task, `--http` endpoint). [`RunningLauncher::build`] starts
/// the managers; [`RunningLauncher::run`] serves until the stop and cleans up.
struct RunningLauncher {
    /// The `--http` endpoint, served until the launcher ends.
    http: Option<crate::http::Server>,
    cfg: Config,
    /// The control plane's connection.
    conn: Conn,
    /// The runtime the jobs run on; shut down, without waiting for stuck threads, when the launcher ends.
    jobs: JobRuntime,
    shutdown: Shutdown,
    /// The first capsule's fetch: every capsule's is of the same kind, which the liveness key and
    /// recovery ask about.
    fetch: Arc<dyn Fetch>,
    /// Every capsule's fetch, the default one first: recovery keeps each one's part of the process's
    /// index of held lists true (`Fetch::tidy_index`: each capsule's landing lists).
    fetches: Vec<Arc<dyn Fetch>>,
    /// One manager per capsule, the default one first: each its own slots, fetch, work table and acker.
    managers: Managers,
    heartbeat: Arc<Heartbeat>,
    control_tx: mpsc::UnboundedSender<Control>,
    control_rx: mpsc::UnboundedReceiver<Control>,
    fleet: Arc<Fleet>,
    /// The job locks' batch task, flushed at the stop.
    locks: Locks,
}

impl RunningLauncher {
    /// Builds the processor, the heartbeat and the `--http` endpoint, registers the process, and starts
    /// the manager.
    #[allow(clippy::too_many_arguments)] // one call site; a struct would only rename the list
    async fn build(
        cfg: Config,
        registry: Registry,
        conns: Conns,
        capsules: Vec<(Capsule, Arc<dyn Fetch>)>,
        fleet: Arc<Fleet>,
        info: ProcessInfo,
        jobs: JobRuntime,
    ) -> Result<RunningLauncher> {
        let Conns {
            control: conn,
            jobs: job_conn,
            lock_dialer,
        } = conns;
        let shutdown = Shutdown::new();
        let signal = shutdown.signal();
        let stats = Arc::new(Stats::default());
        let metrics = Arc::new(Metrics::default());
        // One batch task for every job's lock commands, over the jobs' connection. Spawned here, on the
        // control plane's runtime, so the stop's flush of lock releases never waits on a blocked job
        // runtime: left to its first use, it would start on the job runtime (a lock job's thread).
        let locks = Locks::dialing(job_conn.clone(), lock_dialer);
        locks.batcher();
        let registry = registry.freeze()?;
        let handoff = crate::migrate::handoff::Handoff::from_config(&cfg);
        let unique_jobs = Arc::new(crate::unique_jobs::FleetGemRelease::new(
            cfg.unique_jobs_gem,
        ));
        let routes = crate::route_table::RolledBack::new(conn.clone());
        let fetch = capsules[0].1.clone();
        let fetches: Vec<Arc<dyn Fetch>> = capsules.iter().map(|(_, f)| f.clone()).collect();
        // Each capsule's processor: the same parts, but its own work table (its push-back drains only
        // its own jobs, through its own fetch) and its own acker (an ack goes to the fetch that holds
        // the job). The tables' thread ids are distinct (`WorkTable::striped`).
        let count = capsules.len();
        let mut built = Vec::with_capacity(count);
        for (index, (capsule, fetch)) in capsules.into_iter().enumerate() {
            let work = Arc::new(WorkTable::striped(index, count));
            let (acks, acks_rx) = mpsc::unbounded_channel();
            let processor = Processor {
                registry: registry.clone(),
                conn: job_conn.clone(),
                stats: stats.clone(),
                work: work.clone(),
                acks,
                shutdown: signal.clone(),
                max_payload_bytes: cfg.max_payload_bytes,
                unknown_class: cfg.unknown_class,
                fleet: fleet.clone(),
                metrics: metrics.clone(),
                handoff: handoff.clone(),
                locks: locks.clone(),
                unique_jobs: unique_jobs.clone(),
                routes: routes.clone(),
                working_prefix: fetch.working_prefix(),
            };
            built.push((capsule, fetch, processor, acks_rx));
        }
        let works: Vec<(String, usize, Arc<WorkTable>)> = built
            .iter()
            .map(|(c, _, p, _)| (c.name.clone(), c.concurrency, p.work.clone()))
            .collect();
        let alive_ttl = alive_ttl(cfg.beat_interval);
        let heartbeat = Heartbeat::new(
            info,
            conn.clone(),
            stats,
            works.iter().map(|(_, _, w)| w.clone()).collect(),
            fleet.clone(),
            metrics,
        )
        .serving(&registry.classes(), alive_ttl);
        // Listening first: a taken address ends the start before the process shows up in Redis.
        let http = crate::http::start_if(&cfg, &conn, works, &signal).await?;
        // Be visible and alive before the first fetch, so no recovery takes our working lists. The first
        // orphan recovery runs at once in the background loop: its first pass walks the whole keyspace, and the
        // start should not wait for it.
        if fetch.holds_in_redis() {
            fetch::mark_alive(&mut conn.clone(), &heartbeat.info.identity, alive_ttl).await?;
        }
        heartbeat.beat(false).await?;
        crate::prom::metrics().beat();
        let Some(on) = jobs.handle() else {
            return Err(crate::Error::Config("the job runtime is gone".into()));
        };
        let managers = Managers(
            built
                .into_iter()
                .map(|(capsule, fetch, processor, acks_rx)| {
                    Manager::start(
                        fetch,
                        processor,
                        acks_rx,
                        capsule.concurrency,
                        signal.clone(),
                        on.clone(),
                    )
                })
                .collect(),
        );
        let (control_tx, control_rx) = mpsc::unbounded_channel();
        Ok(RunningLauncher {
            http,
            cfg,
            conn,
            jobs,
            shutdown,
            fetch,
            fetches,
            managers,
            heartbeat: Arc::new(heartbeat),
            control_tx,
            control_rx,
            fleet,
            locks,
        })
    }

    async fn run(mut self) -> Result<()> {
        let (stop_beats, background) = self.spawn_background();
        let stop_deadline = self.serve().await;
        // Every job has ended or was cancelled. The clean-up is bounded: by the stop's deadline, or
        // CLEANUP_MIN from now if that is later; a stop request during it ends it.
        let now = Instant::now();
        let end_by = stop_deadline.unwrap_or(now).max(now + CLEANUP_MIN);
        let cleaned = self.push_back(end_by).await;
        let _ = stop_beats.send(true);
        self.shutdown.advance(Phase::Cancelled);
        // The rest (stopping the background loops, leaving `processes`) gets what is left of the bound,
        // at least 1 s; after an abandoned clean-up (Redis down, or a second stop) just that second.
        let second = Instant::now() + Duration::from_secs(1);
        let last = if cleaned { end_by.max(second) } else { second };
        self.leave(background, last).await;
        Ok(())
    }

    /// Starts the heartbeat, the scheduled poller and (for a fetch that holds jobs in Redis) orphan
    /// recovery. The sender stops the heartbeat, which beats on until the clean-up is done.
    fn spawn_background(&self) -> (watch::Sender<bool>, JoinSet<()>) {
        let (cfg, signal) = (&self.cfg, self.shutdown.signal());
        let alive_ttl = alive_ttl(cfg.beat_interval);
        let keeps_alive = self.fetch.holds_in_redis().then_some(alive_ttl);
        let mut background = JoinSet::new();
        let (stop_tx, stop_rx) = watch::channel(false);
        background.spawn(heartbeat::run(
            self.heartbeat.clone(),
            cfg.beat_interval,
            keeps_alive,
            signal.clone(),
            self.control_tx.clone(),
            stop_rx,
        ));
        background.spawn(scheduled::run(
            self.conn.clone(),
            cfg.poll_interval_average,
            self.fleet.clone(),
            signal.clone(),
        ));
        if cfg.cron.enabled {
            let ms = cfg.millisecond_timestamps;
            background.spawn(crate::cron::run(
                self.conn.clone(),
                ms,
                cfg.cron.clone(),
                signal.clone(),
            ));
        }
        if self.fetch.holds_in_redis() {
            let policy = fetch::RecoveryPolicy {
                grace: alive_ttl,
                time_format: self.fleet.time_format(),
            };
            background.spawn(fetch::recovery_loop(
                self.conn.clone(),
                self.heartbeat.info.identity.clone(),
                cfg.beat_interval * 2,
                policy,
                self.fleet.clone(),
                self.fetches.clone(),
                signal,
            ));
        }
        (stop_tx, background)
    }

    /// Routes controls until the jobs have ended and a stop was asked for. A quiet process's jobs end
    /// while it lives on (beating, with `quiet` "true") until it is told to stop, as Sidekiq does.
    /// Returns the stop's deadline, which bounds the clean-up.
    async fn serve(&mut self) -> Option<Instant> {
        let mut deadline: Option<Instant> = None;
        // When the stop's deadline falls (kept after `deadline` fires, for the clean-up's bound).
        let mut stop_deadline: Option<Instant> = None;
        loop {
            tokio::select! {
                c = self.control_rx.recv() => if let Some(c) = c && self.on_control(c, &mut deadline) {
                    stop_deadline = stop_deadline.or(deadline);
                    if self.managers.jobs_ended() {
                        return stop_deadline;
                    }
                },
                _ = sleep_until(deadline) => {
                    tracing::info!("deadline reached: cancelling running jobs");
                    self.shutdown.advance(Phase::Cancelled);
                    deadline = None;
                }
                _ = self.managers.jobs_done(), if !self.managers.jobs_ended() => {
                    if self.shutdown.phase() >= Phase::Stopping {
                        return stop_deadline;
                    }
                }
            }
        }
    }

    /// Acts on one control; true for a stop (which sets `deadline` the first time).
    fn on_control(&mut self, c: Control, deadline: &mut Option<Instant>) -> bool {
        match c {
            Control::Quiet => {
                tracing::info!("quieting: no new jobs will be fetched");
                self.shutdown.advance(Phase::Quiet);
                false
            }
            Control::Stop => {
                if self.shutdown.phase() >= Phase::Stopping {
                    tracing::info!(
                        "second stop: cancelling running jobs now (they will be pushed back)"
                    );
                    self.shutdown.advance(Phase::Cancelled);
                } else {
                    tracing::info!(timeout = self.cfg.timeout.as_secs_f64(), "shutting down");
                    self.shutdown.advance(Phase::Stopping);
                    *deadline = Some(Instant::now() + self.cfg.timeout);
                }
                true
            }
            Control::Dump => {
                self.managers.dump();
                false
            }
        }
    }

    /// The manager's push-back, bounded by `end_by` and by a second stop. True when all of it reached
    /// Redis; then a fetch that holds jobs in Redis drops its liveness key, its index of held lists and its
    /// place among the holders (nothing is left to recover).
    async fn push_back(&mut self, end_by: Instant) -> bool {
        let (managers, locks) = (&mut self.managers, &self.locks);
        let cleaned = tokio::select! {
            r = async {
                let r = managers.push_back().await;
                // Job locks whose release was queued, not awaited, as their jobs ended (`lock_batch`).
                locks.flush().await;
                r
            } => r,
            _ = tokio::time::sleep_until(end_by) => {
                tracing::error!("shutdown deadline reached before the clean-up ended (is redis reachable?)");
                false
            }
            _ = next_stop(&mut self.control_rx) => {
                tracing::warn!("stop requested again: ending the clean-up now");
                false
            }
        };
        if !cleaned {
            self.managers.abandon();
        } else if self.fetch.holds_in_redis() {
            // With it go the index of its held lists and its place among the holders (issue 43).
            let id = &self.heartbeat.info.identity;
            let _: redis::RedisResult<()> = redis::pipe()
                .del(&[crate::keys::alive(id), crate::keys::held_index(id)])
                .ignore()
                .srem(crate::keys::HOLDERS, id)
                .ignore()
                .query_async(&mut self.conn.clone())
                .await;
        }
        cleaned
    }

    /// Stops the background loops and leaves `processes`, by `last`.
    async fn leave(self, mut background: JoinSet<()>, last: Instant) {
        let _ = tokio::time::timeout_at(last, async {
            while background.join_next().await.is_some() {}
        })
        .await;
        background.abort_all();
        match tokio::time::timeout_at(last, with_retries(|| self.heartbeat.clear())).await {
            Ok(Ok(())) => {}
            _ => tracing::warn!("could not leave the process set; the entry expires in 60 s"),
        }
        drop(self.http);
        // No job runs any more, or one is stuck in synchronous code and was pushed back: the job
        // runtime's threads are let go without waiting for it.
        drop(self.jobs);
        tracing::info!("Bye!");
    }
}

/// The managers of the capsules, the default one first: they start, quiet, stop and push back together,
/// each over its own jobs.
#[derive(Debug)]
struct Managers(Vec<Manager>);

impl Managers {
    /// Waits until every capsule's jobs ended. Cancel-safe (each manager's wait is, and one that ended
    /// stays ended).
    async fn jobs_done(&mut self) {
        for m in &mut self.0 {
            m.jobs_done().await;
        }
    }

    /// True once every capsule's jobs ended.
    fn jobs_ended(&self) -> bool {
        self.0.iter().all(Manager::jobs_ended)
    }

    /// Logs who is running, in every capsule.
    fn dump(&self) {
        for m in &self.0 {
            m.dump();
        }
    }

    /// Every capsule's push-back, side by side (each flushes its acks and pushes back its own jobs
    /// through its own fetch). True when all of it reached Redis.
    async fn push_back(&mut self) -> bool {
        use std::task::Poll;
        let mut pending: Vec<_> = self.0.iter_mut().map(|m| Box::pin(m.push_back())).collect();
        let mut results: Vec<Option<bool>> = vec![None; pending.len()];
        std::future::poll_fn(|cx| {
            for (f, r) in pending.iter_mut().zip(&mut results) {
                if r.is_none()
                    && let Poll::Ready(ok) = f.as_mut().poll(cx)
                {
                    *r = Some(ok);
                }
            }
            if results.iter().all(Option::is_some) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        results.into_iter().all(|r| r == Some(true))
    }

    /// Every capsule's push-back was cut short.
    fn abandon(&mut self) {
        for m in &mut self.0 {
            m.abandon();
        }
    }
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// The least time the clean-up after the jobs gets, even past the stop's deadline.
pub const CLEANUP_MIN: Duration = Duration::from_secs(3);

/// The liveness key's TTL: three heartbeats, at least 3 s.
pub fn alive_ttl(beat_interval: Duration) -> Duration {
    (beat_interval * 3).max(Duration::from_secs(3))
}

/// Waits for the next Stop control (a second TERM/INT during the clean-up).
async fn next_stop(control: &mut mpsc::UnboundedReceiver<Control>) {
    loop {
        match control.recv().await {
            Some(Control::Stop) => return,
            Some(_) => {}
            None => std::future::pending::<()>().await,
        }
    }
}

/// The OS signals this process handles, installed once.
struct OsSignals {
    /// SIGTERM: stop.
    term: tokio::signal::unix::Signal,
    /// SIGINT: stop.
    int: tokio::signal::unix::Signal,
    /// SIGTSTP: quiet.
    tstp: tokio::signal::unix::Signal,
    /// SIGTTIN: log the running jobs.
    ttin: tokio::signal::unix::Signal,
}

impl OsSignals {
    /// Installs the handlers for TERM, INT, TSTP and TTIN; `None` (logged) if that fails.
    fn install() -> Option<OsSignals> {
        use tokio::signal::unix::{SignalKind, signal};
        const SIGTSTP: i32 = 20;
        const SIGTTIN: i32 = 21;
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
            signal(SignalKind::from_raw(SIGTSTP)),
            signal(SignalKind::from_raw(SIGTTIN)),
        ) {
            (Ok(term), Ok(int), Ok(tstp), Ok(ttin)) => Some(OsSignals {
                term,
                int,
                tstp,
                ttin,
            }),
            _ => {
                tracing::error!("cannot install signal handlers");
                None
            }
        }
    }
}

/// Turns OS signals into controls: TSTP quiet, TERM/INT stop, TTIN dump.
async fn forward_os_signals(signals: Option<OsSignals>, control: mpsc::UnboundedSender<Control>) {
    let Some(mut s) = signals else { return };
    loop {
        let c = tokio::select! {
            _ = s.term.recv() => Control::Stop,
            _ = s.int.recv() => Control::Stop,
            _ = s.tstp.recv() => Control::Quiet,
            _ = s.ttin.recv() => Control::Dump,
        };
        if control.send(c).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_job_runtime_leaves_the_control_plane_a_cpu() {
        let cpus = std::thread::available_parallelism().unwrap().get();
        let workers = |threads| {
            let runtime = JobRuntime::build(threads).unwrap();
            runtime.handle().unwrap().metrics().num_workers()
        };
        assert_eq!(workers(None), (cpus - 1).max(1), "{cpus} CPUs");
        assert_eq!(workers(Some(3)), 3, "--threads 3");
    }
}
