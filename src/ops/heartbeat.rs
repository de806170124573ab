//! The heartbeat that puts this process on the Web UI's Busy page, flushes stats and reads remote signals.
//!
//! Mirrors `launcher.rb` (PROTOCOL §6, §7.1). Every beat first surveys the live processes' versions
//! ([`crate::fleet`]: timestamp format, retry rules, which readers are alive), then writes in one `MULTI`:
//! the stats counters (`INCRBY stat:processed n` and the daily key with its 5-year TTL; skipped when both
//! counts are zero, as 7.x and 8.x do), the execution metrics of the jobs run since the last beat
//! ([`crate::metrics`], the keys of the 7.x/8.x versions alive), the in-progress jobs hash
//! (`<identity>:work` for Sidekiq ≥ 6.5, and `<identity>:workers` only while a 6.4 reader may be alive,
//! TTL 60 s), `SADD processes`, the identity hash (`info` JSON that every 6.x–8.x UI renders, `busy`,
//! `beat`, `quiet`, `rss`, `rtt_us`, `concurrency`), its 60 s TTL, and `RPOP <identity>-signals`, whose
//! answer is acted on like the OS signal of that name.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;

use crate::error::Result;
use crate::fleet::{self, Fleet};
use crate::keys;
use crate::metrics::Metrics;
use crate::processor::Stats;
use crate::redis_conn::Conn;
use crate::time;
use crate::work_table::WorkTable;

/// Seconds the identity and work hashes live without a new beat (`launcher.rb`).
pub(crate) const TTL_SECS: i64 = 60;
/// Lifetime of the daily stats keys (`STATS_TTL`, five years).
pub(crate) const STATS_TTL_SECS: i64 = 5 * 365 * 24 * 3600;

/// One capsule as the Busy page shows it (`info.capsules`, Sidekiq 8.0.9+).
#[derive(Debug, Clone)]
pub(crate) struct CapsuleInfo {
    /// Its name (`default` for `-c`/`-q`'s).
    pub name: String,
    /// Its slots.
    pub concurrency: usize,
    /// Its queue names and weights, in configured order.
    pub queues: Vec<(String, u32)>,
}

impl CapsuleInfo {
    /// `Capsule#mode` (`capsule.rb queues=`): strict when every weight is 0, random when every weight
    /// is 1, else weighted.
    fn mode(&self) -> &'static str {
        if self.queues.iter().all(|(_, w)| *w == 0) {
            "strict"
        } else if self.queues.iter().all(|(_, w)| *w == 1) {
            "random"
        } else {
            "weighted"
        }
    }

    /// `Capsule#weights`: queue → weight.
    fn weights(&self) -> serde_json::Map<String, Value> {
        self.queues
            .iter()
            .map(|(n, w)| (n.clone(), json!(w)))
            .collect()
    }
}

/// What this process tells the Busy page about itself.
#[derive(Debug, Clone)]
pub(crate) struct ProcessInfo {
    /// `host:pid:hex12`, with any ':' of the host name made '-' ([`identity_for`]).
    pub identity: String,
    /// Host name (`DYNO` wins, as in Ruby).
    pub hostname: String,
    /// OS process id.
    pub pid: u32,
    /// Epoch seconds at start.
    pub started_at: f64,
    /// `-g`, or the working directory's name.
    pub tag: String,
    /// Busy-page labels; always includes `oxidekiq`.
    pub labels: Vec<String>,
    /// The capsules, the default one first.
    pub capsules: Vec<CapsuleInfo>,
}

impl ProcessInfo {
    /// Identity and host for this OS process.
    pub(crate) fn new(
        tag: Option<String>,
        labels: Vec<String>,
        capsules: Vec<CapsuleInfo>,
    ) -> Self {
        let hostname = std::env::var("DYNO").ok().unwrap_or_else(hostname);
        let pid = std::process::id();
        let mut nonce = [0u8; 6];
        rand::RngCore::fill_bytes(&mut rand::rng(), &mut nonce);
        let identity = identity_for(&hostname, pid, &crate::job::hex(&nonce));
        let tag = tag.unwrap_or_else(|| {
            std::env::current_dir()
                .ok()
                .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_default()
        });
        let mut all_labels = vec!["oxidekiq".to_string()];
        for l in labels {
            if !all_labels.contains(&l) {
                all_labels.push(l);
            }
        }
        ProcessInfo {
            identity,
            hostname,
            pid,
            started_at: time::now(),
            tag,
            labels: all_labels,
            capsules,
        }
    }

    /// Every capsule's slots (`concurrency`, as Sidekiq 7+ sums them).
    pub(crate) fn concurrency(&self) -> usize {
        self.capsules.iter().map(|c| c.concurrency).sum()
    }

    /// Every queue fetched, once each, in the capsules' order (`info.queues`, Sidekiq's `uniq`).
    pub(crate) fn queues(&self) -> Vec<&str> {
        let mut names: Vec<&str> = Vec::new();
        for (q, _) in self.capsules.iter().flat_map(|c| &c.queues) {
            if !names.contains(&q.as_str()) {
                names.push(q);
            }
        }
        names
    }

    /// The `info` JSON: a superset every Sidekiq 6.x, 7.x and 8.x Web UI renders (PROTOCOL §6.3), as
    /// Sidekiq 8 writes it for a process with capsules: `concurrency` their sum, `queues` the union,
    /// `weights` one hash per capsule (7.0.2+), `capsules` one entry per capsule (8.0.9+).
    pub(crate) fn info_json(&self) -> String {
        let weights: Vec<Value> = self
            .capsules
            .iter()
            .map(|c| Value::Object(c.weights()))
            .collect();
        let capsules: serde_json::Map<String, Value> = self
            .capsules
            .iter()
            .map(|c| {
                (
                    c.name.clone(),
                    json!({"concurrency": c.concurrency, "mode": c.mode(), "weights": c.weights()}),
                )
            })
            .collect();
        json!({
            "hostname": self.hostname,
            "started_at": time::float_value(self.started_at),
            "pid": self.pid,
            "tag": self.tag,
            "concurrency": self.concurrency(),
            "queues": self.queues(),
            "weights": weights,
            "capsules": capsules,
            "labels": self.labels,
            "identity": self.identity,
            // A plain version, so tools that parse it (`Gem::Version.new`) can; the `oxidekiq` label and
            // field say what runs it.
            "version": env!("CARGO_PKG_VERSION"),
            "oxidekiq": env!("CARGO_PKG_VERSION"),
            "embedded": false,
        })
        .to_string()
    }
}

/// The identity `host:pid:hex12` of `launcher.rb` (PROTOCOL §6.1), except that a ':' in the host name
/// becomes '-': recovery splits `oxidekiq:batch:<identity>:<queue>:@<n>` (and older releases' keys) at the colons, and a host name such
/// as `node:a` would otherwise make the process's keys read as another identity and queue (whose
/// liveness key never exists). Nothing reads the host out of the identity: the Web UIs show
/// `info.hostname`, which keeps the real name; Ruby only compares identities whole.
pub(crate) fn identity_for(hostname: &str, pid: u32, nonce_hex: &str) -> String {
    let host = hostname.replace(':', "-");
    format!("{host}:{pid}:{nonce_hex}")
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".to_string())
}

/// Resident set size in KB (`VmRSS`), as Ruby reports it.
pub(crate) fn rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|n| n.parse().ok()))
        })
        .unwrap_or(0)
}

/// The in-progress jobs hash entry Ruby writes (`processor.rb`): the payload as a JSON *string*.
pub(crate) fn work_entry(queue: &str, payload: &[u8], run_at: i64) -> String {
    json!({
        "queue": queue,
        "payload": String::from_utf8_lossy(payload),
        "run_at": run_at,
    })
    .to_string()
}

/// One heartbeat writer.
#[derive(Debug)]
pub(crate) struct Heartbeat {
    /// Who we are.
    pub info: ProcessInfo,
    /// Cached `info` JSON.
    info_json: String,
    /// Shared Redis connection.
    conn: Conn,
    /// Counters to flush.
    stats: Arc<Stats>,
    /// In-flight jobs, one table per capsule.
    work: Vec<Arc<WorkTable>>,
    /// Who else is alive, updated every beat.
    fleet: Arc<Fleet>,
    /// Execution metrics to flush.
    metrics: Arc<Metrics>,
    /// The registered worker classes (for oxidekiq's own run counters).
    classes: Vec<String>,
    /// [`keys::serving`] of every (`_rust` queue fetched, registered class): what the Ruby routing
    /// middleware asks before sending a job to Rust.
    serving_keys: Vec<String>,
    /// How long a serving registration outlives the last beat.
    serving_ttl: Duration,
}

impl Heartbeat {
    /// A heartbeat for `info`.
    pub(crate) fn new(
        info: ProcessInfo,
        conn: Conn,
        stats: Arc<Stats>,
        work: Vec<Arc<WorkTable>>,
        fleet: Arc<Fleet>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let info_json = info.info_json();
        Heartbeat {
            info,
            info_json,
            conn,
            stats,
            work,
            fleet,
            metrics,
            classes: Vec::new(),
            serving_keys: Vec::new(),
            serving_ttl: Duration::from_secs(TTL_SECS as u64),
        }
    }

    /// Registers `classes` as served by this process on each of its `_rust` queues, for `ttl` past each
    /// beat (a few beats: once every serving process is gone, Ruby clients stop routing within it).
    pub(crate) fn serving(mut self, classes: &[&str], ttl: Duration) -> Self {
        self.classes = classes.iter().map(|c| c.to_string()).collect();
        self.serving_keys = self
            .info
            .queues()
            .into_iter()
            .filter(|q| q.ends_with(keys::RUST_QUEUE_SUFFIX))
            .flat_map(|q| classes.iter().map(move |c| keys::serving(q, c)))
            .collect();
        self.serving_ttl = ttl;
        self
    }

    /// Appends the serving registrations and oxidekiq's own run counters (`oxidekiq:ran|<minute>`).
    /// A quiet (or stopping) process fetches no more: it leaves the serving keys instead.
    fn add_migration(
        &self,
        pipe: &mut redis::Pipeline,
        now: f64,
        metrics: &crate::metrics::Snapshot,
        serving: bool,
    ) {
        let ttl = self.serving_ttl.as_secs_f64();
        for key in &self.serving_keys {
            if !serving {
                pipe.cmd("ZREM").arg(key).arg(&self.info.identity).ignore();
                continue;
            }
            pipe.cmd("ZADD")
                .arg(key)
                .arg(time::score(now + ttl))
                .arg(&self.info.identity)
                .ignore();
            pipe.cmd("ZREMRANGEBYSCORE")
                .arg(key)
                .arg("-inf")
                .arg(time::score(now))
                .ignore();
            pipe.cmd("PEXPIRE")
                .arg(key)
                .arg(self.serving_ttl.as_millis().max(1) as u64)
                .ignore();
        }
        let minute = keys::ran(&crate::migrate::route::ran_minute(chrono::Utc::now()));
        let mut any = false;
        for class in &self.classes {
            let Some(c) = metrics.get(class) else {
                continue;
            };
            any = true;
            pipe.cmd("HINCRBY")
                .arg(&minute)
                .arg(format!("{class}|p"))
                .arg(c.processed)
                .ignore();
            if c.failed > 0 {
                pipe.cmd("HINCRBY")
                    .arg(&minute)
                    .arg(format!("{class}|f"))
                    .arg(c.failed)
                    .ignore();
            }
        }
        if any {
            pipe.cmd("EXPIRE").arg(&minute).arg(2 * 3600).ignore();
        }
    }

    /// A clone of the heartbeat's connection.
    pub(crate) fn conn(&self) -> Conn {
        self.conn.clone()
    }

    /// One beat. Returns the remote signal popped from `<identity>-signals`, if any.
    pub(crate) async fn beat(&self, quiet: bool) -> Result<Option<String>> {
        let id = &self.info.identity;
        let mut conn = self.conn.clone();
        let rtt_start = Instant::now();
        let _: String = redis::cmd("PING").query_async(&mut conn).await?;
        let rtt_us = rtt_start.elapsed().as_micros() as u64;
        // Re-decided on every beat: a 7.x process that joined since the last one turns our new
        // timestamps back to float seconds from here on.
        let survey = fleet::survey(&mut conn).await?;
        self.fleet.update(survey);

        let (processed, failed) = self.stats.take();
        let metrics = self.metrics.take();
        let jobs: Vec<_> = self.work.iter().flat_map(|w| w.snapshot()).collect();
        let now = time::now();
        let utc = chrono::Utc::now();
        let work_key = keys::work(id);
        let legacy_key = keys::workers_legacy(id);

        let mut pipe = redis::pipe();
        pipe.atomic();
        add_stats(&mut pipe, processed, failed, utc);
        metrics.write(&mut pipe, utc, survey.metrics_formats());
        self.add_migration(&mut pipe, now, &metrics, !quiet);
        pipe.cmd("UNLINK").arg(&work_key).arg(&legacy_key).ignore();
        if !jobs.is_empty() {
            let legacy = survey.writes_legacy_workers();
            let mut hset = redis::cmd("HSET");
            hset.arg(&work_key);
            let mut hset_legacy = redis::cmd("HSET");
            hset_legacy.arg(&legacy_key);
            for j in &jobs {
                let entry = work_entry(&j.unit.queue, j.unit.raw(), j.run_at);
                let tid = j.tid();
                hset.arg(&tid).arg(&entry);
                hset_legacy.arg(&tid).arg(&entry);
            }
            pipe.add_command(hset).ignore();
            pipe.cmd("EXPIRE").arg(&work_key).arg(TTL_SECS).ignore();
            if legacy {
                pipe.add_command(hset_legacy).ignore();
                pipe.cmd("EXPIRE").arg(&legacy_key).arg(TTL_SECS).ignore();
            }
        }
        pipe.cmd("SADD").arg(keys::PROCESSES).arg(id).ignore();
        pipe.cmd("HSET")
            .arg(id)
            .arg("info")
            .arg(&self.info_json)
            .arg("concurrency")
            .arg(self.info.concurrency())
            .arg("busy")
            .arg(jobs.len())
            .arg("beat")
            .arg(time::score(now))
            .arg("rtt_us")
            .arg(rtt_us)
            .arg("quiet")
            .arg(if quiet { "true" } else { "false" })
            .arg("rss")
            .arg(rss_kb())
            .ignore();
        pipe.cmd("EXPIRE").arg(id).arg(TTL_SECS).ignore();
        pipe.cmd("RPOP").arg(keys::signals(id));
        match exec_all(&mut conn, &pipe).await {
            // The transaction ran, even if some of its commands failed: the counts are in, and the
            // signal it popped is acted on (restoring either would count twice or lose the signal).
            Ok(mut replies) => match replies.pop() {
                Some(v @ redis::Value::BulkString(_)) => {
                    Ok(redis::from_redis_value::<Option<String>>(v).unwrap_or(None))
                }
                _ => Ok(None),
            },
            Err(e) => {
                self.stats.restore(processed, failed);
                self.metrics.restore(metrics);
                Err(e)
            }
        }
    }

    /// Leaves the Busy page at shutdown: flush stats, `SREM processes`, `UNLINK` the work hashes. The
    /// identity hash is left to expire, as Ruby leaves it.
    pub(crate) async fn clear(&self) -> Result<()> {
        let id = &self.info.identity;
        let (processed, failed) = self.stats.take();
        let metrics = self.metrics.take();
        let utc = chrono::Utc::now();
        let mut pipe = redis::pipe();
        pipe.atomic();
        add_stats(&mut pipe, processed, failed, utc);
        // As 8.x at exit (`tracking.rb@v8.1.7 config.on(:exit)`), with the formats of the last survey.
        metrics.write(&mut pipe, utc, self.fleet.current().metrics_formats());
        // Leaving: no Ruby client routes to us from here on (the last server's ZREM deletes the key).
        self.add_migration(&mut pipe, time::now(), &metrics, false);
        pipe.cmd("SREM").arg(keys::PROCESSES).arg(id).ignore();
        pipe.cmd("UNLINK")
            .arg(keys::work(id))
            .arg(keys::workers_legacy(id))
            .ignore();
        let mut conn = self.conn.clone();
        if let Err(e) = exec_all(&mut conn, &pipe).await {
            self.stats.restore(processed, failed);
            self.metrics.restore(metrics);
            return Err(e);
        }
        Ok(())
    }
}

/// Runs `pipe` (atomic) as one `MULTI`/`EXEC` and returns every reply, in order, whatever `pipe`
/// marked as ignored. Redis runs every other command of a transaction when one fails at run time (a
/// key of the wrong type): its effects are in, so a caller must not write them again, and what it
/// popped must be used. Each failed command is logged at error level with its key and the key's type.
/// `Err` only when the transaction did not run (a connection error, `EXECABORT`).
///
/// The raw `EXEC` reply is read with the pipeline's own request (what `query_async` sends), before
/// redis-rs turns one failed command into an error for the whole pipeline; nothing is copied.
async fn exec_all(conn: &mut Conn, pipe: &redis::Pipeline) -> Result<Vec<redis::Value>> {
    use redis::aio::ConnectionLike;
    let mut reply = conn.req_packed_commands(pipe, pipe.len() + 1, 1).await?;
    let replies = match reply.pop() {
        Some(redis::Value::Array(items)) => items,
        Some(redis::Value::ServerError(e)) => return Err(redis::RedisError::from(e).into()),
        other => {
            return Err(crate::Error::Redis(redis::RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "unexpected reply to the beat's EXEC",
                format!("{other:?}"),
            ))));
        }
    };
    for (cmd, reply) in pipe.cmd_iter().zip(&replies) {
        let redis::Value::ServerError(e) = reply else {
            continue;
        };
        let mut args = cmd.args_iter().filter_map(|a| match a {
            redis::Arg::Simple(b) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        });
        let (name, key) = (
            args.next().unwrap_or_default(),
            args.next().unwrap_or_default(),
        );
        let kind: String = redis::cmd("TYPE")
            .arg(&key)
            .query_async(conn)
            .await
            .unwrap_or_else(|_| "unknown".into());
        let cause = crate::Error::from(redis::RedisError::from(e.clone())).fault();
        tracing::error!(command = %name, key = %key, key_type = %kind, error = ?e, cause,
            "heartbeat: one command of the beat failed; the others ran and are not repeated: repair or \
             delete the key, or allow the command");
    }
    Ok(replies)
}

/// `INCRBY stat:processed|failed n` and the daily keys with their 5-year TTL (`launcher.rb flush_stats`),
/// nothing when both counts are zero (7.x and 8.x skip the write then).
fn add_stats(
    pipe: &mut redis::Pipeline,
    processed: u64,
    failed: u64,
    now: chrono::DateTime<chrono::Utc>,
) {
    if processed == 0 && failed == 0 {
        return;
    }
    let date = now.format("%Y-%m-%d").to_string();
    for (base, n) in [
        (keys::STAT_PROCESSED, processed),
        (keys::STAT_FAILED, failed),
    ] {
        let daily = keys::stat_daily(base, &date);
        pipe.cmd("INCRBY").arg(base).arg(n).ignore();
        pipe.cmd("INCRBY").arg(&daily).arg(n).ignore();
        pipe.cmd("EXPIRE").arg(&daily).arg(STATS_TTL_SECS).ignore();
    }
}

/// The heartbeat loop: a beat every `interval` until `stop` says so. With `alive` (the liveness TTL of a
/// fetch that holds jobs in Redis) each beat first re-sets this process's liveness key, which orphan
/// recovery reads. A signal the Web UI left for this process goes to `control`.
pub(crate) async fn run(
    heartbeat: Arc<Heartbeat>,
    interval: Duration,
    alive: Option<Duration>,
    signal: crate::shutdown::ShutdownSignal,
    control: tokio::sync::mpsc::UnboundedSender<crate::shutdown::Control>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut failing = false;
    let mut conn = heartbeat.conn();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let mut errors = Vec::new();
        if let Some(ttl) = alive {
            match crate::fetch::mark_alive(&mut conn, &heartbeat.info.identity, ttl).await {
                Ok(true) => {}
                Ok(false) => tracing::warn!(
                    "this process's liveness key had expired (a redis stall or a long pause): reclaimed; \
                     its jobs were taken only if it stayed away past the recovery grace"
                ),
                Err(e) => errors.push(e),
            }
        }
        match heartbeat.beat(signal.is_quiet()).await {
            Ok(Some(name)) => match crate::shutdown::Control::from_signal(&name) {
                Some(c) => {
                    tracing::info!(signal = %name, "received signal from the Web UI");
                    let _ = control.send(c);
                }
                None => tracing::warn!(signal = %name, "ignoring unknown remote signal"),
            },
            Ok(None) => {}
            Err(e) => errors.push(e),
        }
        // Sidekiq's `cancel!` reaching plain running jobs: one pipelined read per beat, sent only
        // while such jobs run.
        for work in &heartbeat.work {
            if let Err(e) = work.check_cancels(&mut conn).await {
                errors.push(e);
            }
        }
        if let Some(e) = errors.first()
            && !failing
        {
            tracing::warn!(error = %e, "heartbeat cannot reach redis; retrying");
        }
        let ok = errors.is_empty();
        if ok {
            crate::prom::metrics().beat();
        }
        if ok && failing {
            tracing::info!("heartbeat reaches redis again");
        }
        failing = !ok;
        signal.events().announce(crate::events::Event::Beat);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sidekiq 7+/8 keep the weight a queue was given (`capsule.rb queues=`: `@weights[name] =
    /// weight.to_i`, 0 for a queue given none) and derive the mode from those, so `-q critical,2 -q
    /// default` is `{"critical"=>2, "default"=>0}`, weighted, and `-q a,1 -q b` is `{"a"=>1, "b"=>0}`,
    /// weighted (Sidekiq 8.1.7's method run under Ruby). Found by the review of issue 38: the weights
    /// were written after `normalize_weights`, so the 7.x Busy page showed `default: 1` where a Ruby
    /// process shows `default`, and the second process was called `random`.
    #[test]
    fn the_weights_and_mode_are_sidekiqs_for_the_same_queue_flags() {
        let info = |args: &[&str]| {
            let mut argv = vec!["oxidekiq"];
            argv.extend_from_slice(args);
            let cfg = crate::cli::load(argv).unwrap();
            let capsules = cfg
                .all_capsules()
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
                .collect();
            let p = ProcessInfo::new(None, vec![], capsules);
            serde_json::from_str::<Value>(&p.info_json()).unwrap()
        };
        let v = info(&["-q", "critical,2", "-q", "default"]);
        assert_eq!(v["weights"], json!([{"critical": 2, "default": 0}]));
        let v = info(&["-q", "a,1", "-q", "b"]);
        assert_eq!(v["capsules"]["default"]["weights"], json!({"a": 1, "b": 0}));
        assert_eq!(v["capsules"]["default"]["mode"], "weighted");
    }

    #[test]
    fn info_has_every_field_the_web_uis_read() {
        let p = ProcessInfo::new(
            Some("myapp".into()),
            vec!["rust".into()],
            vec![CapsuleInfo {
                name: "default".into(),
                concurrency: 10,
                queues: vec![("critical".into(), 2), ("default".into(), 1)],
            }],
        );
        let v: Value = serde_json::from_str(&p.info_json()).unwrap();
        assert!(v["started_at"].is_f64());
        assert_eq!(v["queues"], json!(["critical", "default"]));
        assert_eq!(v["weights"], json!([{"critical": 2, "default": 1}]));
        assert_eq!(v["capsules"]["default"]["mode"], "weighted");
        assert_eq!(v["concurrency"], 10);
        assert_eq!(v["labels"], json!(["oxidekiq", "rust"]));
        assert_eq!(v["tag"], "myapp");
        assert_eq!(v["embedded"], false);
        assert_eq!(
            crate::fleet::parse_version(v["version"].as_str().unwrap()),
            crate::fleet::parse_version(env!("CARGO_PKG_VERSION"))
        );
        let parts: Vec<&str> = p.identity.split(':').collect();
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[2].len(), 12);
    }

    /// Sidekiq 8's `to_data` for a process with capsules: `concurrency` their sum, `queues` the union
    /// in order, `weights` one hash per capsule, `capsules` each's concurrency, mode and weights.
    #[test]
    fn info_lists_every_capsule_as_sidekiq_8_does() {
        let cap = |name: &str, concurrency, queues: &[(&str, u32)]| CapsuleInfo {
            name: name.into(),
            concurrency,
            queues: queues.iter().map(|(q, w)| (q.to_string(), *w)).collect(),
        };
        let p = ProcessInfo::new(
            None,
            vec![],
            vec![
                cap("default", 5, &[("default", 0)]),
                cap("single", 1, &[("single", 0), ("default", 0)]),
                cap("heavy", 2, &[("a", 3), ("b", 1)]),
                cap("shuffled", 3, &[("c", 1), ("d", 1)]),
            ],
        );
        let v: Value = serde_json::from_str(&p.info_json()).unwrap();
        assert_eq!(v["concurrency"], 11);
        assert_eq!(
            v["queues"],
            json!(["default", "single", "a", "b", "c", "d"])
        );
        assert_eq!(
            v["weights"],
            json!([{"default": 0}, {"single": 0, "default": 0}, {"a": 3, "b": 1}, {"c": 1, "d": 1}])
        );
        assert_eq!(
            v["capsules"],
            json!({
                "default": {"concurrency": 5, "mode": "strict", "weights": {"default": 0}},
                "single": {"concurrency": 1, "mode": "strict", "weights": {"single": 0, "default": 0}},
                "heavy": {"concurrency": 2, "mode": "weighted", "weights": {"a": 3, "b": 1}},
                "shuffled": {"concurrency": 3, "mode": "random", "weights": {"c": 1, "d": 1}},
            })
        );
    }

    #[test]
    fn a_colon_in_the_host_name_does_not_reach_the_identity() {
        let id = identity_for("node:a", 42, "0123456789ab");
        assert_eq!(id.split(':').count(), 3, "{id}");
        assert!(id.starts_with("node-a:42:"), "{id}");
        assert_eq!(
            crate::keys::split_held(&format!("{id}:ffff:default")),
            Some((id.as_str(), "ffff:default"))
        );
    }

    #[test]
    fn work_entries_carry_the_payload_as_a_string() {
        let e = work_entry("default", br#"{"class":"A","args":[]}"#, 1795291264);
        assert_eq!(
            e,
            r#"{"queue":"default","payload":"{\"class\":\"A\",\"args\":[]}","run_at":1795291264}"#
        );
    }
}
