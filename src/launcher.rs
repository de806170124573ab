//! The launcher: starts every part, routes control signals, and runs the shutdown in order.
//!
//! Mirrors `launcher.rb` + `manager.rb`. Parts: the fetch loop (bounded by `-c`: it never holds more
//! fetched jobs than it has free slots), the job tasks, the acker (batched acks), the heartbeat, the
//! scheduled-set poller and orphan recovery. Control arrives from OS signals (TSTP quiet; TERM/INT stop;
//! TTIN dump: class, jid, queue and start time of each running job, never its arguments), from the Web
//! UI through `<identity>-signals`, or from a [`Handle`] in tests.
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

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::config::{Config, FetchMode};
use crate::error::Result;
use crate::fetch::{self, Fetcher, Held};
use crate::fleet::Fleet;
use crate::heartbeat::{Heartbeat, ProcessInfo};
use crate::job::Job;
use crate::metrics::Metrics;
use crate::processor::{Ack, Processor, Stats, WorkTable};
use crate::redis_conn::{self, Conn};
use crate::registry::Registry;
use crate::scheduled;
use crate::shutdown::{Phase, Shutdown, ShutdownSignal};
use crate::time::{self, TimeFormat};

/// A control request, whatever its source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Stop fetching; finish running jobs (TSTP, Web UI Quiet).
    Quiet,
    /// Stop: quiet, then running jobs get until the deadline (TERM, INT, Web UI Stop).
    Stop,
    /// Log the running jobs (TTIN).
    Dump,
}

impl Control {
    /// The control a signal name stands for (`TSTP`, `TERM`, `INT`, `TTIN`), as the Web UI sends them.
    pub fn from_signal(name: &str) -> Option<Control> {
        match name.trim_start_matches("SIG") {
            "TSTP" | "USR1" => Some(Control::Quiet),
            "TERM" | "INT" => Some(Control::Stop),
            "TTIN" | "INFO" => Some(Control::Dump),
            _ => None,
        }
    }
}

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

/// Builds and runs a process.
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
        let url = cfg.redis_url();
        let target = redis_conn::Target::from_config(&cfg).await?;
        let conn = target.connect().await?;
        let block = Duration::from_secs(1);
        let blocking = target.connect_blocking(block).await?;
        // The timestamp format follows the fleet, re-decided on every beat (the first one below runs
        // before any job), unless configured.
        let fleet = Arc::new(Fleet::new(cfg.millisecond_timestamps.map(|ms| {
            if ms {
                TimeFormat::Millis
            } else {
                TimeFormat::Seconds
            }
        })));
        let metrics = Arc::new(Metrics::default());
        let info = ProcessInfo::new(
            cfg.tag.clone(),
            cfg.labels.clone(),
            cfg.concurrency,
            cfg.queues
                .iter()
                .map(|q| (q.name.clone(), q.weight))
                .collect(),
        );
        let identity = info.identity.clone();
        let shutdown = Shutdown::new();
        let signal = shutdown.signal();
        let stats = Arc::new(Stats::default());
        let work = Arc::new(WorkTable::default());
        let fetcher = Arc::new(
            Fetcher::new(
                cfg.fetch,
                &cfg.queues,
                &identity,
                conn.clone(),
                blocking,
                block,
            )
            .with_payload_limit(cfg.max_payload_bytes, fleet.clone()),
        );
        let (ack_tx, ack_rx) = mpsc::unbounded_channel();
        let processor = Arc::new(Processor {
            registry: self.registry.freeze(),
            conn: conn.clone(),
            stats: stats.clone(),
            work: work.clone(),
            acks: ack_tx,
            shutdown: signal.clone(),
            max_payload_bytes: cfg.max_payload_bytes,
            unknown_class: cfg.unknown_class,
            fleet: fleet.clone(),
            metrics: metrics.clone(),
            handoff: crate::migrate::handoff::Handoff::from_config(&cfg),
            working_prefix: (cfg.fetch == FetchMode::Reliable)
                .then(|| crate::keys::working_prefix(&identity)),
        });
        let alive_ttl = alive_ttl(cfg.beat_interval);
        let heartbeat = Arc::new(
            Heartbeat::new(
                info,
                conn.clone(),
                stats,
                work.clone(),
                fleet.clone(),
                metrics,
            )
            .serving(&processor.registry.classes(), alive_ttl),
        );
        let recovery = fetch::RecoveryPolicy {
            grace: alive_ttl,
            time_format: fleet.time_format(),
        };

        // Listening first: a taken address ends the start before the process shows up in Redis.
        let http = crate::http::start_if(&cfg, &conn, &work, &signal).await?;
        // Be visible and alive before the first fetch, so no recovery takes our working lists.
        {
            let mut c = conn.clone();
            if cfg.fetch == FetchMode::Reliable {
                let _ = fetch::mark_alive(&mut c, &identity, alive_ttl).await?;
            }
            heartbeat.beat(false).await?;
            crate::prom::metrics().beat();
            // The first orphan recovery runs at once in the background loop: a pass walks the whole
            // keyspace, and the start should not wait for it.
        }
        tracing::info!(
            identity = %identity,
            concurrency = cfg.concurrency,
            queues = %cfg.queues.iter().map(|q| q.name.as_str()).collect::<Vec<_>>().join(","),
            redis = %target.describe(&url),
            fetch = ?cfg.fetch,
            "oxidekiq {} starting", env!("CARGO_PKG_VERSION")
        );

        let (control_tx, control_rx) = mpsc::unbounded_channel();
        let parts = Parts {
            http,
            cfg,
            conn,
            identity: identity.clone(),
            shutdown,
            fetcher,
            processor,
            heartbeat,
            work,
            ack_rx,
            control_tx: control_tx.clone(),
            control_rx,
            alive_ttl,
            fleet,
            recovery,
        };
        let task = tokio::spawn(parts.run());
        Ok(Handle {
            control: control_tx,
            task,
            identity,
            signal,
        })
    }
}

/// Everything the running launcher owns.
struct Parts {
    /// The `--http` endpoint, served until the launcher ends.
    http: Option<crate::http::Server>,
    cfg: Config,
    conn: Conn,
    identity: String,
    shutdown: Shutdown,
    fetcher: Arc<Fetcher>,
    processor: Arc<Processor>,
    heartbeat: Arc<Heartbeat>,
    work: Arc<WorkTable>,
    ack_rx: mpsc::UnboundedReceiver<Ack>,
    control_tx: mpsc::UnboundedSender<Control>,
    control_rx: mpsc::UnboundedReceiver<Control>,
    alive_ttl: Duration,
    fleet: Arc<Fleet>,
    recovery: fetch::RecoveryPolicy,
}

impl Parts {
    async fn run(self) -> Result<()> {
        let Parts {
            http,
            cfg,
            conn,
            identity,
            shutdown,
            fetcher,
            processor,
            heartbeat,
            work,
            ack_rx,
            control_tx,
            mut control_rx,
            alive_ttl,
            fleet,
            recovery,
        } = self;
        let signal = shutdown.signal();
        let mut background = JoinSet::new();
        let (hb_stop_tx, hb_stop_rx) = tokio::sync::watch::channel(false);
        background.spawn(heartbeat_loop(
            heartbeat.clone(),
            cfg.beat_interval,
            cfg.fetch == FetchMode::Reliable,
            alive_ttl,
            signal.clone(),
            control_tx,
            hb_stop_rx,
        ));
        background.spawn(scheduled::run(
            conn.clone(),
            cfg.poll_interval_average,
            fleet.clone(),
            signal.clone(),
        ));
        if cfg.fetch == FetchMode::Reliable {
            background.spawn(recovery_loop(
                conn.clone(),
                identity.clone(),
                cfg.beat_interval * 2,
                recovery,
                fleet.clone(),
                signal.clone(),
            ));
        }
        let mut acker = tokio::spawn(ack_loop(fetcher.clone(), ack_rx));
        let mut manager = tokio::spawn(manage(
            fetcher.clone(),
            processor.clone(),
            cfg.concurrency,
            signal.clone(),
        ));
        drop(processor);

        let mut deadline: Option<Instant> = None;
        // When the stop's deadline falls (kept after `deadline` fires, for the clean-up's bound).
        let mut stop_deadline: Option<Instant> = None;
        // A quiet process's manager ends once its jobs are done, but the process lives on (beating, with
        // `quiet` "true") until it is told to stop, as Sidekiq does.
        let mut manager_done = false;
        loop {
            tokio::select! {
                c = control_rx.recv() => match c {
                    Some(Control::Quiet) => {
                        tracing::info!("quieting: no new jobs will be fetched");
                        shutdown.advance(Phase::Quiet);
                    }
                    Some(Control::Stop) => {
                        if shutdown.phase() >= Phase::Stopping {
                            tracing::info!("second stop: cancelling running jobs now (they will be pushed back)");
                            shutdown.advance(Phase::Cancelled);
                        } else {
                            tracing::info!(timeout = cfg.timeout.as_secs_f64(), "shutting down");
                            shutdown.advance(Phase::Stopping);
                            deadline = Some(Instant::now() + cfg.timeout);
                            stop_deadline = deadline;
                        }
                        if manager_done {
                            break;
                        }
                    }
                    Some(Control::Dump) => {
                        // Who is running, never the payload: arguments can hold personal data or
                        // secrets, and TTIN output goes to the same logs as everything else.
                        for j in work.snapshot() {
                            let job = std::str::from_utf8(&j.raw)
                                .ok()
                                .and_then(|s| Job::from_str(s).ok());
                            tracing::info!(queue = %j.queue, tid = %j.tid(), run_at = j.run_at,
                                class = job.as_ref().map_or("?", |job| job.worker_class()),
                                jid = job.as_ref().map_or("?", |job| job.jid()), "running");
                        }
                    }
                    None => {}
                },
                _ = async { match deadline { Some(d) => tokio::time::sleep_until(d).await, None => std::future::pending().await } } => {
                    tracing::info!("deadline reached: cancelling running jobs");
                    shutdown.advance(Phase::Cancelled);
                    deadline = None;
                }
                _ = &mut manager, if !manager_done => {
                    if shutdown.phase() >= Phase::Stopping {
                        break;
                    }
                    manager_done = true;
                }
            }
        }
        // The manager has ended: every job task finished or was cancelled. The clean-up is bounded: by the
        // stop's deadline, or CLEANUP_MIN from now if that is later; a stop request during it ends it.
        let now = Instant::now();
        let end_by = stop_deadline.unwrap_or(now).max(now + CLEANUP_MIN);
        let cleaned = tokio::select! {
            r = cleanup(&fetcher, &work, &mut acker, cfg.fetch) => r,
            _ = tokio::time::sleep_until(end_by) => {
                tracing::error!("shutdown deadline reached before the clean-up ended (is redis reachable?)");
                false
            }
            _ = next_stop(&mut control_rx) => {
                tracing::warn!("stop requested again: ending the clean-up now");
                false
            }
        };
        if !cleaned {
            acker.abort();
            let left = work.drain().len().max(fetcher.outstanding());
            tracing::error!(
                jobs = left,
                "unfinished jobs stay in this process's working keys; another oxidekiq process pushes them \
                 back once this one's liveness key expires"
            );
        } else if cfg.fetch == FetchMode::Reliable {
            let mut c = conn.clone();
            let _: redis::RedisResult<()> =
                redis::AsyncCommands::del(&mut c, fetch::alive_key(&identity)).await;
        }
        let _ = hb_stop_tx.send(true);
        shutdown.advance(Phase::Cancelled);
        // The rest (stopping the background loops, leaving `processes`) gets what is left of the bound,
        // at least 1 s; after an abandoned clean-up (Redis down, or a second stop) just that second.
        let second = Instant::now() + Duration::from_secs(1);
        let last = if cleaned { end_by.max(second) } else { second };
        let _ = tokio::time::timeout_at(last, async {
            while background.join_next().await.is_some() {}
        })
        .await;
        background.abort_all();
        match tokio::time::timeout_at(last, with_retries(|| heartbeat.clear())).await {
            Ok(Ok(())) => {}
            _ => tracing::warn!("could not leave the process set; the entry expires in 60 s"),
        }
        drop(http);
        tracing::info!("Bye!");
        Ok(())
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

/// After the jobs: flush acks, push back what never finished and anything left in our working keys.
/// True when all of it reached Redis.
async fn cleanup(
    fetcher: &Fetcher,
    work: &WorkTable,
    acker: &mut tokio::task::JoinHandle<()>,
    mode: FetchMode,
) -> bool {
    // Acks of jobs whose fate is in Redis (the acker ends once every sender is gone).
    let _ = acker.await;
    let mut ok = true;
    // Jobs fetched but never started go back first, then the ones that were running: each RPUSH
    // goes to the end served next, so the running (older) ones are served first, as before.
    let unfinished: Vec<Ack> = work.snapshot().iter().map(|j| j.held()).collect();
    match with_retries(|| fetcher.requeue_leftovers(false)).await {
        Ok(0) => {}
        Ok(n) => {
            crate::prom::metrics().pushed_back(n as usize);
            tracing::info!(count = n, "pushed fetched but unstarted jobs back")
        }
        Err(e) => {
            ok = false;
            tracing::error!(error = %e, "could not empty this process's working lists")
        }
    }
    if !unfinished.is_empty() {
        match with_retries(|| fetcher.requeue(&unfinished)).await {
            Ok(n) => {
                work.drain();
                crate::prom::metrics().pushed_back(n as usize);
                tracing::info!(
                    count = unfinished.len(),
                    "pushed unfinished jobs back to their queues"
                )
            }
            Err(e) => {
                ok = false;
                if mode == FetchMode::Reliable {
                    tracing::error!(error = %e, count = unfinished.len(),
                        "could not push unfinished jobs back; they stay in this process's working lists for recovery")
                } else {
                    // Basic fetch keeps no copy in Redis: say so instead of promising a recovery.
                    tracing::error!(error = %e, count = unfinished.len(),
                        "could not push unfinished jobs back; basic fetch keeps no copy in redis, so they are lost")
                }
            }
        }
    }
    // Anything still held goes back too: a push-back above that failed half way, and jobs handed out
    // whose task was cancelled before it started (no job runs now, and every ack is flushed).
    match with_retries(|| fetcher.requeue_leftovers(true)).await {
        Ok(n) => crate::prom::metrics().pushed_back(n as usize),
        Err(e) => {
            ok = false;
            tracing::error!(error = %e, "could not empty this process's working lists");
        }
    }
    ok
}

/// Tries a shutdown write a few times over about five seconds.
async fn with_retries<T, F, Fut>(mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut delay = Duration::from_millis(100);
    let mut last = None;
    for _ in 0..6 {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(delay).await;
        delay *= 2;
    }
    Err(last.unwrap_or_else(|| crate::Error::Config("no attempt made".into())))
}

/// When the last Redis outage began, shared by the fetch loops so an outage is logged once.
type Outage = Arc<std::sync::Mutex<Option<Instant>>>;

/// How many fetch loops run side by side: each holds the slots it fetches for, so together they never
/// hold more fetched jobs than there are free slots, while their round trips overlap. Basic fetch keeps
/// one (its `BRPOP`s would queue on one blocking connection anyway).
fn fetch_loops(mode: FetchMode, concurrency: usize) -> usize {
    match mode {
        FetchMode::Basic => 1,
        FetchMode::Reliable => (concurrency / 25).clamp(1, 4),
    }
}

/// The fetch loops and their job tasks (`manager.rb` + `processor.rb`'s loop). Once every loop has
/// stopped fetching (quiet), whatever this process holds but never handed out goes back to its queue.
async fn manage(
    fetcher: Arc<Fetcher>,
    processor: Arc<Processor>,
    concurrency: usize,
    signal: ShutdownSignal,
) {
    let slots = Arc::new(Semaphore::new(concurrency.max(1)));
    let outage: Outage = Arc::default();
    let mut loops = JoinSet::new();
    let (fetching_tx, mut fetching_rx) = mpsc::channel::<()>(1);
    for _ in 0..fetch_loops(fetcher.mode(), concurrency) {
        loops.spawn(fetch_loop(
            fetcher.clone(),
            processor.clone(),
            slots.clone(),
            outage.clone(),
            signal.clone(),
            fetching_tx.clone(),
        ));
    }
    drop(fetching_tx);
    drop(processor);
    let sweep = async {
        // `None` once every loop dropped its sender: no fetch is under way any more.
        let _ = fetching_rx.recv().await;
        if fetcher.mode() != FetchMode::Reliable {
            return;
        }
        let mut cancelled = signal.clone();
        tokio::select! {
            r = with_retries(|| fetcher.requeue_leftovers(false)) => match r {
                Ok(0) => {}
                Ok(n) => tracing::info!(count = n, "quiet: pushed back jobs fetched but never started"),
                Err(e) => tracing::warn!(error = %e, "quiet: could not push back jobs fetched but never started; the shutdown tries again"),
            },
            _ = cancelled.cancelled() => {}
        }
    };
    let join = async { while loops.join_next().await.is_some() {} };
    tokio::join!(sweep, join);
}

/// One fetch loop: take free slots, fetch that many jobs, run them; at the end wait for its jobs.
async fn fetch_loop(
    fetcher: Arc<Fetcher>,
    processor: Arc<Processor>,
    slots: Arc<Semaphore>,
    outage: Outage,
    mut signal: ShutdownSignal,
    fetching: mpsc::Sender<()>,
) {
    let mut jobs = JoinSet::new();
    let mut backoff = Duration::from_millis(100);
    loop {
        while jobs.try_join_next().is_some() {}
        if signal.is_quiet() {
            break;
        }
        let first = tokio::select! {
            p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
            _ = signal.quiet() => break,
            Some(_) = jobs.join_next(), if !jobs.is_empty() => continue,
        };
        let mut permits = vec![first];
        while permits.len() < fetch::MAX_BATCH {
            match slots.clone().try_acquire_owned() {
                Ok(p) => permits.push(p),
                Err(_) => break,
            }
        }
        // A fetch is not cut short by quiet: it ends within the block time, and what it got goes back
        // below. Only the shutdown deadline cuts it (what it moved then stays in this process's working
        // keys, which the shutdown sweeps). A basic fetch is never cut: a BRPOPped job would be lost.
        let fetched = if fetcher.mode() == FetchMode::Reliable {
            let mut cancelled = signal.clone();
            tokio::select! {
                r = fetcher.fetch(permits.len()) => r,
                _ = cancelled.cancelled() => break,
            }
        } else {
            fetcher.fetch(permits.len()).await
        };
        let dead = fetcher.take_dead();
        if dead > 0 {
            // Oversized payloads the fetch script sent to the dead set count as failed runs, as the
            // processor counts an undecodable one.
            processor
                .stats
                .processed
                .fetch_add(dead, std::sync::atomic::Ordering::Relaxed);
            processor
                .stats
                .failed
                .fetch_add(dead, std::sync::atomic::Ordering::Relaxed);
        }
        let units = match fetched {
            Ok(u) => {
                crate::prom::metrics().fetched(u.len());
                let ended = outage.lock().ok().and_then(|mut o| o.take());
                if let Some(since) = ended {
                    tracing::info!(
                        after = format_args!("{:.1}s", since.elapsed().as_secs_f64()),
                        "redis reachable again: fetching resumed"
                    );
                    backoff = Duration::from_millis(100);
                    // Cut by the shutdown deadline like the fetch above: a Redis that hangs again
                    // would hold the stop up to the response timeout per queue. What it did not
                    // check stays in this process's working keys, which the shutdown sweeps.
                    let mut cancelled = signal.clone();
                    tokio::select! {
                        _ = reconcile(&fetcher) => {}
                        _ = cancelled.cancelled() => {}
                    }
                }
                u
            }
            Err(e) => {
                if let Ok(mut o) = outage.lock()
                    && o.is_none()
                {
                    tracing::warn!(error = %e, "redis unavailable: fetch paused, retrying with backoff");
                    *o = Some(Instant::now());
                }
                drop(permits);
                let jitter = rand::random::<f64>() * 0.5 + 0.75;
                tokio::select! {
                    _ = tokio::time::sleep(backoff.mul_f64(jitter)) => {}
                    _ = signal.quiet() => break,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        // Fetched after the shutdown began: straight back to the queue, as Sidekiq does. More jobs than
        // slots (never, with the batch script's own bound) go back too rather than run unbounded.
        let keep = if signal.is_quiet() { 0 } else { permits.len() };
        let mut units = units;
        let back: Vec<Ack> = if units.len() > keep {
            units
                .drain(keep..)
                .map(|u| Held {
                    queue: u.queue,
                    id: u.id,
                    raw: Arc::from(u.raw),
                })
                .collect()
        } else {
            Vec::new()
        };
        if !back.is_empty() {
            let mut cancelled = signal.clone();
            tokio::select! {
                r = with_retries(|| fetcher.requeue(&back)) => if let Err(e) = r {
                    tracing::error!(error = %e, count = back.len(), "could not push back fetched jobs; they stay in the working list for recovery");
                },
                _ = cancelled.cancelled() => {}
            }
        }
        if signal.is_quiet() {
            break;
        }
        let mut permits = permits.into_iter();
        for unit in units {
            let Some(permit) = permits.next() else { break };
            let p = processor.clone();
            jobs.spawn(async move {
                p.process(unit).await;
                drop(permit);
            });
        }
    }
    drop(fetching);
    drop(processor);
    // Wait for running jobs; at the deadline (Cancelled) stop them. Their payloads are still in the
    // in-flight table, which the launcher pushes back.
    let mut cancelled = signal.clone();
    loop {
        tokio::select! {
            next = jobs.join_next() => if next.is_none() { break },
            _ = cancelled.cancelled() => {
                // Give jobs that watch the signal a moment to end by themselves.
                let grace = tokio::time::sleep(Duration::from_millis(200));
                tokio::pin!(grace);
                loop {
                    tokio::select! {
                        next = jobs.join_next() => if next.is_none() { break },
                        _ = &mut grace => { jobs.abort_all(); while jobs.join_next().await.is_some() {} break }
                    }
                }
                break;
            }
        }
    }
}

/// A fetch whose reply was lost during an outage may have left jobs in our working list that nobody
/// runs: push back every entry that was never handed out (the fetcher tracks every id it handed out and
/// has not acknowledged, so a job about to run or already acknowledged is never pushed back).
async fn reconcile(fetcher: &Fetcher) {
    match fetcher.reconcile().await {
        Ok(0) => {}
        Ok(n) => tracing::info!(count = n, "pushed back jobs stranded by a lost fetch reply"),
        Err(e) => tracing::warn!(error = %e, "could not check the working list after an outage"),
    }
}

/// Sends batched acks; ends when every sender is gone and the queue is empty. A failing ack is retried
/// until it succeeds: at shutdown the launcher's clean-up bound ends it (the job then stays in the working
/// hash, and a recovery may run it again: at least once).
async fn ack_loop(fetcher: Arc<Fetcher>, mut rx: mpsc::UnboundedReceiver<Ack>) {
    let mut batch: Vec<Ack> = Vec::with_capacity(1024);
    loop {
        if batch.is_empty() {
            match rx.recv().await {
                Some(a) => batch.push(a),
                None => return,
            }
        }
        while batch.len() < 4096 {
            match rx.try_recv() {
                Ok(a) => batch.push(a),
                Err(_) => break,
            }
        }
        let mut delay = Duration::from_millis(50);
        let mut attempts = 0;
        loop {
            match fetcher.ack(&batch).await {
                Ok(()) => break,
                Err(e) => {
                    attempts += 1;
                    if attempts == 1 {
                        tracing::warn!(error = %e, "cannot acknowledge finished jobs; retrying");
                    }
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
            }
        }
        batch.clear();
    }
}

async fn heartbeat_loop(
    heartbeat: Arc<Heartbeat>,
    interval: Duration,
    reliable: bool,
    alive_ttl: Duration,
    signal: ShutdownSignal,
    control: mpsc::UnboundedSender<Control>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut failing = false;
    let mut conn = heartbeat_conn(&heartbeat);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let mut ok = true;
        if reliable {
            match fetch::mark_alive(&mut conn, &heartbeat.info.identity, alive_ttl).await {
                Ok(true) => {}
                Ok(false) => tracing::warn!(
                    "this process's liveness key had expired (a redis stall or a long pause): reclaimed; \
                     its jobs were taken only if it stayed away past the recovery grace"
                ),
                Err(e) => {
                    ok = false;
                    if !failing {
                        tracing::warn!(error = %e, "heartbeat cannot reach redis; retrying");
                    }
                }
            }
        }
        match heartbeat.beat(signal.is_quiet()).await {
            Ok(Some(name)) => match Control::from_signal(&name) {
                Some(c) => {
                    tracing::info!(signal = %name, "received signal from the Web UI");
                    let _ = control.send(c);
                }
                None => tracing::warn!(signal = %name, "ignoring unknown remote signal"),
            },
            Ok(None) => {}
            Err(e) => {
                ok = false;
                if !failing {
                    tracing::warn!(error = %e, "heartbeat cannot reach redis; retrying");
                }
            }
        }
        if ok {
            crate::prom::metrics().beat();
        }
        if ok && failing {
            tracing::info!("heartbeat reaches redis again");
        }
        failing = !ok;
    }
}

fn heartbeat_conn(h: &Heartbeat) -> Conn {
    h.conn()
}

async fn recover(conn: &mut Conn, identity: &str, policy: fetch::RecoveryPolicy) {
    match fetch::recover_orphans(conn, identity, time::now(), policy).await {
        Ok(Some(r)) if r.requeued + r.killed > 0 => {
            tracing::info!(
                requeued = r.requeued,
                dead = r.killed,
                "orphan recovery done"
            )
        }
        Ok(_) => {}
        Err(e) => tracing::debug!(error = %e, "orphan recovery failed; will try again"),
    }
}

async fn recovery_loop(
    mut conn: Conn,
    identity: String,
    every: Duration,
    policy: fetch::RecoveryPolicy,
    fleet: Arc<Fleet>,
    mut signal: ShutdownSignal,
) {
    loop {
        // The dead entries it may write take the format the live fleet reads now.
        let policy = fetch::RecoveryPolicy {
            time_format: fleet.time_format(),
            ..policy
        };
        recover(&mut conn, &identity, policy).await;
        if signal.is_quiet() {
            return;
        }
        let jitter = rand::random::<f64>() * 0.5 + 0.75;
        tokio::select! {
            _ = tokio::time::sleep(every.mul_f64(jitter)) => {}
            _ = signal.quiet() => return,
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
