//! The flags and the `Config` they fill: defaults, the queue list and the bounds on what a setting may
//! cost, checked the same for flags, `sidekiq.yml` and a `Config` built in Rust.

use std::collections::HashSet;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::Error;
use crate::redact::redact_url;

/// The most jobs one process may run at once. Each slot is a task, a working-list entry and a share
/// of every fetch; Sidekiq advises 5 to 50 per process, and past a few thousand one process is better
/// split in several. 10 000 is far beyond any real setting and still cheap.
pub const MAX_CONCURRENCY: usize = 10_000;

/// The most capsules one process runs, the default one included (each capsule numbers its reliable
/// fetch's batches in a range of its own: `fetch::MAX_CAPSULES`).
pub const MAX_CAPSULES: usize = 256;

/// The most runtime threads `--threads` takes: far more than any machine's cores, and each thread is a
/// stack of its own.
pub const MAX_THREADS: usize = 1024;

/// The largest queue weight. A weighted fetch lists each queue `weight` times and shuffles the list
/// on every fetch (`fetch.rb`), so the cost of a fetch grows with the weights; 1 000 already gives a
/// 1:1000 ratio, finer than any priority scheme needs (Sidekiq's docs use 1 to 7).
pub const MAX_QUEUE_WEIGHT: u32 = 1_000;

/// The most seconds a timeout or interval may be: one day. Larger values are typos, and far larger
/// ones overflow when added to the clock.
pub const MAX_SECONDS: f64 = 86_400.0;

/// The largest config file, before and after ERB: 1 MiB. A Rails app's `sidekiq.yml` is a few hundred
/// bytes.
pub const MAX_CONFIG_FILE_BYTES: usize = 1 << 20;

/// The most values (scalars, lists, mappings) a config file's YAML may hold once anchors and aliases
/// are expanded. A `sidekiq.yml` holds a few dozen; several environments sharing a `<<: *default`
/// stay far below.
pub const MAX_YAML_NODES: u64 = 10_000;

/// The deepest nesting of lists and mappings in a config file (a `sidekiq.yml` nests 3 deep).
pub const MAX_YAML_DEPTH: usize = 64;

/// One queue to fetch from and its weight (`-q name,weight`; weight 0 means strict order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueWeight {
    /// Queue name, without the `queue:` prefix.
    pub name: String,
    /// Sidekiq weight as given (0 for none); all 0 = strict order, otherwise weighted random, where
    /// a 0 counts as 1 (`cli.rb@v6.4.1 parse_queue`).
    pub weight: u32,
}

/// A named capsule beside the default one (Sidekiq 7's `config.capsule(name)`, `:capsules:` in
/// `sidekiq.yml`, `--capsule`): its own slots and its own fetch, which takes only its own queues, in its
/// own order (strict when every weight is 0, else weighted, as `-q`). Its concurrency is a cap (at most
/// that many of its jobs run at once) and a reservation (that many slots are always there for its
/// queues, whatever the default capsule's queues hold).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capsule {
    /// Its name, shown on the Busy page (`info.capsules`) and in `/metrics`; never `default`.
    pub name: String,
    /// How many of its jobs run at once.
    pub concurrency: usize,
    /// Its queues and weights as given (0 for a queue given none), as `-q`'s.
    pub queues: Vec<QueueWeight>,
}

/// Which fetch strategy drains the queues, by its name in `crate::fetch`'s table of strategies (`--fetch
/// NAME`). A new strategy needs no change here: it is a file in `src/processing/fetch/` and a line in that table.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct FetchMode(&'static str);

impl std::fmt::Debug for FetchMode {
    /// Its name (`reliable`), as the start-up line and `Config`'s `Debug` show it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl FetchMode {
    /// Jobs move atomically into a working list owned by this process and leave it only once their
    /// fate is in Redis; a crashed process's jobs are recovered (the default).
    pub const RELIABLE: FetchMode = FetchMode("reliable");
    /// Sidekiq's open-source `BRPOP` fetch: a killed process loses its in-flight jobs.
    pub const BASIC: FetchMode = FetchMode("basic");
    /// The names `--fetch` takes, in the order of the strategy table of `src/processing/fetch/` (its test checks
    /// that they are the same): named here, below the fetch, so that the config checks a name without
    /// reaching up to the strategies themselves.
    pub(crate) const NAMES: [&'static str; 2] = ["reliable", "basic"];

    /// The strategy registered under `name`, if there is one.
    pub fn named(name: &str) -> Option<FetchMode> {
        Self::NAMES
            .iter()
            .find(|n| **n == name)
            .map(|n| FetchMode(n))
    }

    /// Its name, as `--fetch` takes it.
    pub fn name(self) -> &'static str {
        self.0
    }
}

impl Default for FetchMode {
    fn default() -> Self {
        FetchMode::RELIABLE
    }
}

/// What happens to a job whose class has no Rust worker registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UnknownClass {
    /// Sidekiq's path: a `NameError` failure into the retry set (then dead), naming the class.
    #[default]
    Retry,
    /// Straight to the dead set.
    Dead,
}

/// Which sidekiq-unique-jobs release a fleet runs (`--unique-jobs-version`): the server-side rules of
/// [`crate::unique_jobs`] differ between them (docs/unique-jobs-protocol.md §3, §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UniqueJobsGem {
    /// 7.1 (Sidekiq 6, and 7 for 7.1.7-7.1.28).
    V7_1,
    /// 8.0 (Sidekiq 7/8).
    V8_0,
    /// 8.1 (Sidekiq 7/8).
    V8_1,
}

impl UniqueJobsGem {
    /// The names `--unique-jobs-version` takes.
    pub const NAMES: [&'static str; 3] = ["7.1", "8.0", "8.1"];

    /// The release named `name` (`7.1`, `8.0`, `8.1`).
    pub fn named(name: &str) -> Option<UniqueJobsGem> {
        match name {
            "7.1" => Some(UniqueJobsGem::V7_1),
            "8.0" => Some(UniqueJobsGem::V8_0),
            "8.1" => Some(UniqueJobsGem::V8_1),
            _ => None,
        }
    }

    /// Its name, as `--unique-jobs-version` takes it.
    pub fn name(self) -> &'static str {
        match self {
            UniqueJobsGem::V7_1 => "7.1",
            UniqueJobsGem::V8_0 => "8.0",
            UniqueJobsGem::V8_1 => "8.1",
        }
    }
}

/// Everything the launcher needs to run.
///
/// Its `Debug` output shows the Redis URL with the password replaced by `REDACTED`, so a config can be
/// logged.
#[derive(Clone)]
pub struct Config {
    /// `redis://` or `rediss://` URL; `None` means `REDIS_URL` or `redis://127.0.0.1:6379`.
    pub redis_url: Option<String>,
    /// PEM CA bundle a `rediss://` server's certificate must chain to, instead of the system's trust
    /// store (`--redis-ca-file`); `None` means `REDIS_CA_FILE` or the system's trust store.
    pub redis_ca_file: Option<PathBuf>,
    /// How many jobs run at once (`-c`).
    pub concurrency: usize,
    /// Threads of the runtime that runs the jobs (`--threads`); `None`: one per CPU less the control
    /// plane's thread, at least one.
    pub threads: Option<usize>,
    /// The queues to fetch from, in configured order (`-q`): the default capsule's.
    pub queues: Vec<QueueWeight>,
    /// Named capsules beside the default one (`:capsules:`, `--capsule`), each with its own slots and
    /// queues; empty: the default capsule (`concurrency`, `queues`) alone.
    pub capsules: Vec<Capsule>,
    /// How long running jobs get after TERM before they are pushed back (`-t`).
    pub timeout: Duration,
    /// Shown on the Busy page (`-g`); defaults to the working directory's name, as Ruby does.
    pub tag: Option<String>,
    /// Extra labels for the Busy page; `oxidekiq` is always added.
    pub labels: Vec<String>,
    /// Debug logging (`-v`).
    pub verbose: bool,
    /// Fetch strategy (`--fetch reliable|basic`).
    pub fetch: FetchMode,
    /// What to do with a job whose class has no Rust worker.
    pub unknown_class: UnknownClass,
    /// Payloads larger than this go to the dead set undecoded.
    pub max_payload_bytes: usize,
    /// Heartbeat interval (Sidekiq 6.x: 5 s).
    pub beat_interval: Duration,
    /// Scheduled-set poll interval average (Sidekiq's `average_scheduled_poll_interval`, 5 s);
    /// the real interval is scaled by the number of live processes.
    pub poll_interval_average: Duration,
    /// Write Sidekiq 8 integer-millisecond timestamps instead of float seconds; `None` = detect
    /// from the live processes' `info.version`.
    pub millisecond_timestamps: Option<bool>,
    /// `--handoff QUEUE`: a job of a class with no Rust worker (or carrying a Ruby-side contract, see
    /// `crate::migrate::handoff`) is pushed unchanged to this queue, which Ruby serves.
    pub handoff: Option<String>,
    /// `--run-flagged CLASS`: classes whose jobs run in Rust even when they carry a Ruby-side contract.
    pub run_flagged: Vec<String>,
    /// Address of the `/metrics`, `/health`, `/ready` endpoint (`--http`); `None`: off.
    pub http: Option<String>,
    /// Log line format (`--log-format`).
    pub log_format: crate::logging::LogFormat,
    /// The least severe lines written (`--log-level`; `-v` and `verbose: true` are `Debug`).
    pub log_level: crate::logging::LogLevel,
    /// Redis through Sentinel (`--sentinel`, `:redis: { :sentinels: ... }`); `None`: the URL's server.
    pub sentinel: Option<crate::sentinel::SentinelConfig>,
    /// sidekiq-cron's schedules: on or off (`--no-cron`), how often Redis is looked at, and the
    /// schedules declared here (`sidekiq.yml`, `config/schedule.yml`, Rust).
    pub cron: super::CronConfig,
    /// The sidekiq-unique-jobs release whose server-side rules gem-locked jobs follow
    /// (`--unique-jobs-version`); `None`: read from what the fleet writes ([`crate::unique_jobs`]).
    pub unique_jobs_gem: Option<UniqueJobsGem>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            redis_url: None,
            redis_ca_file: None,
            concurrency: 10,
            threads: None,
            queues: vec![QueueWeight {
                name: "default".into(),
                weight: 0,
            }],
            capsules: Vec::new(),
            timeout: Duration::from_secs(25),
            tag: None,
            labels: Vec::new(),
            verbose: false,
            fetch: FetchMode::RELIABLE,
            unknown_class: UnknownClass::Retry,
            max_payload_bytes: 16 * 1024 * 1024,
            beat_interval: Duration::from_secs(5),
            poll_interval_average: Duration::from_secs(5),
            millisecond_timestamps: None,
            handoff: None,
            run_flagged: Vec::new(),
            http: None,
            log_format: crate::logging::LogFormat::Text,
            log_level: crate::logging::LogLevel::Info,
            sentinel: None,
            cron: super::CronConfig::default(),
            unique_jobs_gem: None,
        }
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Written out by hand so the Redis password never reaches a log line.
        f.debug_struct("Config")
            .field("redis_url", &self.redis_url.as_deref().map(redact_url))
            .field("redis_ca_file", &self.redis_ca_file)
            .field("concurrency", &self.concurrency)
            .field("threads", &self.threads)
            .field("queues", &self.queues)
            .field("capsules", &self.capsules)
            .field("timeout", &self.timeout)
            .field("tag", &self.tag)
            .field("labels", &self.labels)
            .field("verbose", &self.verbose)
            .field("fetch", &self.fetch)
            .field("unknown_class", &self.unknown_class)
            .field("max_payload_bytes", &self.max_payload_bytes)
            .field("beat_interval", &self.beat_interval)
            .field("poll_interval_average", &self.poll_interval_average)
            .field("millisecond_timestamps", &self.millisecond_timestamps)
            .field("handoff", &self.handoff)
            .field("run_flagged", &self.run_flagged)
            .field("http", &self.http)
            .field("log_format", &self.log_format)
            .field("log_level", &self.log_level)
            .field("sentinel", &self.sentinel)
            .field("cron", &self.cron)
            .field("unique_jobs_gem", &self.unique_jobs_gem)
            .finish()
    }
}

impl Config {
    /// The Redis URL to use: the configured one, else `REDIS_URL`, else the local default.
    pub fn redis_url(&self) -> String {
        // An empty value counts as unset, as with every variable read here.
        self.redis_url
            .clone()
            .filter(|u| !u.is_empty())
            .or_else(|| std::env::var("REDIS_URL").ok().filter(|u| !u.is_empty()))
            .unwrap_or_else(|| "redis://127.0.0.1:6379".to_string())
    }

    /// The CA bundle for a `rediss://` server: the configured one, else `REDIS_CA_FILE`, else `None`
    /// (the system's trust store).
    pub fn redis_ca_file(&self) -> Option<PathBuf> {
        // `REDIS_CA_FILE=` (empty) means unset: the system's trust store.
        self.redis_ca_file
            .clone()
            .filter(|p| !p.as_os_str().is_empty())
            .or_else(|| {
                std::env::var_os("REDIS_CA_FILE")
                    .filter(|v| !v.is_empty())
                    .map(PathBuf::from)
            })
    }

    /// True when the queues are fetched in strict order (every weight is 0).
    pub fn strict_queues(&self) -> bool {
        self.queues.iter().all(|q| q.weight == 0)
    }

    /// The upper bounds on what a setting may cost (concurrency, queue weights, durations): checked by
    /// [`Config::validate`] for flags and sidekiq.yml, and by the launcher for a `Config` built in Rust.
    pub fn check_bounds(&self) -> Result<(), Error> {
        if self.concurrency > MAX_CONCURRENCY {
            return Err(Error::Config(format!(
                "concurrency: {} is too large, it must be at most {MAX_CONCURRENCY}",
                self.concurrency
            )));
        }
        for (what, d) in [
            ("timeout", self.timeout),
            ("beat interval", self.beat_interval),
            ("poll interval", self.poll_interval_average),
        ] {
            if d.as_secs_f64() > MAX_SECONDS {
                return Err(Error::Config(format!(
                    "{what}: {} seconds is too long, it must be at most {MAX_SECONDS} (one day)",
                    d.as_secs_f64()
                )));
            }
        }
        // The launcher builds the job runtime from it: 0 threads panics in Tokio's builder, and each
        // thread is a stack of its own.
        if let Some(n) = self.threads
            && !(1..=MAX_THREADS).contains(&n)
        {
            return Err(Error::Config(format!(
                "threads: {n} is not a valid value, it must be 1 to {MAX_THREADS}"
            )));
        }
        if let Some(q) = self.queues.iter().find(|q| q.weight > MAX_QUEUE_WEIGHT) {
            return Err(Error::Config(format!(
                "queue {}: weight {} is too large, it must be at most {MAX_QUEUE_WEIGHT}",
                q.name, q.weight
            )));
        }
        if self.capsules.len() >= MAX_CAPSULES {
            return Err(Error::Config(format!(
                "capsules: {} named capsules, there may be at most {}",
                self.capsules.len(),
                MAX_CAPSULES - 1
            )));
        }
        let total = self
            .capsules
            .iter()
            .fold(self.concurrency, |n, c| n.saturating_add(c.concurrency));
        if total > MAX_CONCURRENCY {
            return Err(Error::Config(format!(
                "concurrency: {total} over every capsule is too large, it must be at most {MAX_CONCURRENCY}"
            )));
        }
        self.check_capsules()?;
        for c in &self.capsules {
            if let Some(q) = c.queues.iter().find(|q| q.weight > MAX_QUEUE_WEIGHT) {
                return Err(Error::Config(format!(
                    "capsule {}: queue {}: weight {} is too large, it must be at most {MAX_QUEUE_WEIGHT}",
                    c.name, q.name, q.weight
                )));
            }
        }
        Ok(())
    }

    /// Checks what no later stage could recover from; queue names the Web UI cannot route are only a
    /// warning, since Redis and Ruby clients accept them.
    pub fn validate(&self) -> Result<(), Error> {
        // Sidekiq 6.4 rejects these the same way (`cli.rb@v6.4.1 validate!`).
        if self.concurrency == 0 {
            return Err(Error::Config(
                "concurrency: 0 is not a valid value, it must be at least 1".into(),
            ));
        }
        self.check_bounds()?;
        if self.timeout.is_zero() {
            return Err(Error::Config(
                "timeout: 0 is not a valid value, it must be more than 0 seconds".into(),
            ));
        }
        if self.queues.is_empty() {
            return Err(Error::Config("no queue to fetch from".into()));
        }
        check_queue_list(&self.queues)?;
        self.warn_idle_capsules();
        if let Some(q) = &self.handoff
            && self.served_queues().any(|served| served == q)
        {
            // Each hand-off would be fetched back by this very process and handed off again, forever.
            return Err(Error::Config(format!(
                "--handoff {q}: this process serves `{q}` itself; hand off to a queue only Ruby serves"
            )));
        }
        if self.max_payload_bytes == 0 {
            return Err(Error::Config(
                "max payload bytes: 0 is not a valid value, it must be at least 1".into(),
            ));
        }
        if self.beat_interval.is_zero() {
            return Err(Error::Config(
                "beat interval must be more than 0 seconds".into(),
            ));
        }
        if self.poll_interval_average.is_zero() {
            return Err(Error::Config(
                "poll interval must be more than 0 seconds".into(),
            ));
        }
        for q in self
            .capsules
            .iter()
            .flat_map(|c| &c.queues)
            .chain(&self.queues)
        {
            if !web_ui_routable(&q.name) {
                crate::logging::warn_early(format!(
                    "queue name `{}` has characters the Sidekiq Web UI cannot route; its page will not open",
                    crate::logging::escape(&q.name)
                ));
            }
        }
        Ok(())
    }
}

impl Config {
    /// Every queue some capsule fetches (the default capsule's first), once each, in order.
    pub fn served_queues(&self) -> impl Iterator<Item = &str> {
        let mut seen = HashSet::new();
        self.queues
            .iter()
            .chain(
                self.capsules
                    .iter()
                    .filter(|c| c.concurrency > 0)
                    .flat_map(|c| &c.queues),
            )
            .map(|q| q.name.as_str())
            .filter(move |q| seen.insert(*q))
    }

    /// The capsules as the launcher runs them: `default` (`concurrency`, `queues`) first, then the named
    /// ones with a concurrency above 0 (one of 0 runs nothing: [`Config::validate`] warned of its queues).
    pub fn all_capsules(&self) -> Vec<Capsule> {
        let mut out = vec![Capsule {
            name: DEFAULT_CAPSULE.into(),
            concurrency: self.concurrency,
            queues: self.queues.clone(),
        }];
        out.extend(self.capsules.iter().filter(|c| c.concurrency > 0).cloned());
        out
    }

    /// The named capsules' rules, for flags, `sidekiq.yml` and a `Config` built in Rust alike: a name of
    /// its own (not `default`, not twice; letters, digits, `_`, `-`, `.` and `:` only, as it reaches the
    /// logs, the Busy page and a metric label), a queue list of its own (not empty, no queue twice).
    fn check_capsules(&self) -> Result<(), Error> {
        let mut names = HashSet::new();
        for c in &self.capsules {
            let name = c.name.as_str();
            if name.is_empty() {
                return Err(Error::Config("a capsule name is empty".into()));
            }
            if !web_ui_routable(name) {
                return Err(Error::Config(format!(
                    "capsule name `{}` may hold only letters, digits, `_`, `-`, `.` and `:`",
                    crate::logging::escape(name)
                )));
            }
            if name == DEFAULT_CAPSULE {
                return Err(Error::Config(format!(
                    "capsule `{DEFAULT_CAPSULE}` is the one -c/:concurrency: and -q/:queues: set; name the others differently"
                )));
            }
            if !names.insert(name) {
                return Err(Error::Config(format!(
                    "capsule {name} cannot be defined twice"
                )));
            }
            if c.queues.is_empty() {
                return Err(Error::Config(format!(
                    "capsule {name}: no queue to fetch from; give it :queues:"
                )));
            }
            check_queue_list(&c.queues)
                .map_err(|e| Error::Config(format!("capsule {name}: {}", message(e))))?;
        }
        Ok(())
    }

    /// A capsule of concurrency 0 runs nothing (Sidekiq starts it with no thread: its jobs wait for
    /// good): a WARN naming the queues no other capsule serves.
    fn warn_idle_capsules(&self) {
        for c in self.capsules.iter().filter(|c| c.concurrency == 0) {
            let served: HashSet<&str> = self.served_queues().collect();
            let unserved: Vec<&str> = c
                .queues
                .iter()
                .map(|q| q.name.as_str())
                .filter(|q| !served.contains(q))
                .collect();
            let what = if unserved.is_empty() {
                "every one of its queues is served by another capsule".to_string()
            } else {
                format!(
                    "queues served by no capsule, whose jobs wait in Redis: {}",
                    crate::logging::escape(&unserved.join(", "))
                )
            };
            crate::logging::warn_early(format!(
                "capsule {}: concurrency 0 runs no job; it is not started ({what})",
                crate::logging::escape(&c.name)
            ));
        }
    }
}

/// The name of the capsule `-c`/`:concurrency:` and `-q`/`:queues:` configure (Sidekiq's
/// `default_capsule`).
pub const DEFAULT_CAPSULE: &str = "default";

/// A config error's message alone.
fn message(e: Error) -> String {
    match e {
        Error::Config(m) => m,
        other => other.to_string(),
    }
}

/// Parses a `--capsule` argument, `NAME:CONCURRENCY:QUEUE[,WEIGHT][ QUEUE[,WEIGHT]]...`: the name and
/// the concurrency end at the first two colons, the rest is the queue list (a queue name may hold
/// colons), its queues apart by spaces, each as `-q` takes it. A flag repeated with the same name adds
/// its queues to that capsule.
pub fn parse_capsule_arg(arg: &str) -> Result<Capsule, Error> {
    parse_capsule_spec(arg).map_err(Error::Config)
}

/// [`parse_capsule_arg`] with a plain message, for clap's value parser.
pub(crate) fn parse_capsule_spec(arg: &str) -> Result<Capsule, String> {
    let usage = "write NAME:CONCURRENCY:QUEUE[,WEIGHT], e.g. --capsule single:1:single";
    let mut parts = arg.splitn(3, ':');
    let (Some(name), Some(concurrency), Some(queues)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(format!("capsule `{arg}`: {usage}"));
    };
    let name = name.trim();
    if name.is_empty() {
        return Err(format!("capsule `{arg}` has an empty name; {usage}"));
    }
    let concurrency = match concurrency.trim().parse::<usize>() {
        Ok(n) if n <= MAX_CONCURRENCY => n,
        Ok(_) => {
            return Err(format!(
                "capsule `{arg}`: concurrency must be at most {MAX_CONCURRENCY}"
            ));
        }
        Err(_) => {
            return Err(format!(
                "capsule `{arg}`: concurrency `{concurrency}` is not a whole number; {usage}"
            ));
        }
    };
    let queues = queues
        .split_whitespace()
        .map(parse_queue_spec)
        .collect::<Result<Vec<_>, _>>()?;
    if queues.is_empty() {
        return Err(format!("capsule `{arg}` names no queue; {usage}"));
    }
    Ok(Capsule {
        name: name.to_string(),
        concurrency,
        queues,
    })
}

/// Adds `capsule` to `list`: a new name is a new capsule; a name already there adds its queues to that
/// capsule, whose concurrency must be the same.
pub(crate) fn merge_capsule(list: &mut Vec<Capsule>, capsule: Capsule) -> Result<(), Error> {
    match list.iter_mut().find(|c| c.name == capsule.name) {
        None => list.push(capsule),
        Some(c) if c.concurrency != capsule.concurrency => {
            return Err(Error::Config(format!(
                "capsule {}: given with concurrency {} and {}; give it one",
                c.name, c.concurrency, capsule.concurrency
            )));
        }
        Some(c) => c.queues.extend(capsule.queues),
    }
    Ok(())
}

/// Reads one variable of the process environment; the lookup every non-test path uses.
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// The environment whose `sidekiq.yml` section applies: `-e`, else `APP_ENV`, `RAILS_ENV`, `RACK_ENV`,
/// else `development` (`cli.rb@v6.4.1 set_environment`).
pub fn sidekiq_environment(flag: Option<&str>, env: &dyn Fn(&str) -> Option<String>) -> String {
    flag.map(str::to_string)
        .or_else(|| env("APP_ENV"))
        .or_else(|| env("RAILS_ENV"))
        .or_else(|| env("RACK_ENV"))
        .unwrap_or_else(|| "development".to_string())
}

/// True when the Sidekiq Web UI can route the queue's page (`web.rb` matches `/\A[a-z_:.\-0-9]+\z/i`).
pub fn web_ui_routable(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b':' | b'.' | b'-'))
}

/// Parses a `-q` argument, `QUEUE` or `QUEUE,WEIGHT`, as Sidekiq's CLI does.
///
/// Stricter than Ruby's `to_i`: a weight that is not a whole number is an error, not 0.
pub fn parse_queue_arg(arg: &str) -> Result<QueueWeight, Error> {
    parse_queue_spec(arg).map_err(Error::Config)
}

/// [`parse_queue_arg`] with a plain message, for clap's value parser.
pub(crate) fn parse_queue_spec(arg: &str) -> Result<QueueWeight, String> {
    let mut parts = arg.split(',');
    let name = parts.next().unwrap_or("").trim();
    let weight = parts.next();
    if parts.next().is_some() {
        return Err(format!(
            "queue `{arg}` has more than one comma; write QUEUE or QUEUE,WEIGHT"
        ));
    }
    if name.is_empty() {
        return Err(format!("queue `{arg}` has an empty name"));
    }
    let weight = match weight {
        None => 0,
        Some(w) => match w.trim().parse::<u32>() {
            Ok(w) if w <= MAX_QUEUE_WEIGHT => w,
            Ok(_) => {
                return Err(format!(
                    "queue `{arg}`: weight `{w}` is too large, it must be at most {MAX_QUEUE_WEIGHT}"
                ));
            }
            Err(_) => {
                return Err(format!(
                    "queue `{arg}`: weight `{w}` is not a whole number of 0 or more"
                ));
            }
        },
    };
    Ok(QueueWeight {
        name: name.to_string(),
        weight,
    })
}

/// Writes down Sidekiq 6.4's weighting: once any queue has a weight above 0, a queue without one counts
/// as weight 1 (`cli.rb@v6.4.1 parse_queue` lists each queue `max(weight, 1)` times and turns strict
/// order off). A list of only zeros stays strict.
pub fn normalize_weights(queues: &mut [QueueWeight]) {
    if queues.iter().any(|q| q.weight > 0) {
        for q in queues.iter_mut().filter(|q| q.weight == 0) {
            q.weight = 1;
        }
    }
}

/// Rejects empty names and a queue given twice (`cli.rb@v6.4.1`: "cannot be defined twice").
pub(crate) fn check_queue_list(queues: &[QueueWeight]) -> Result<(), Error> {
    let mut seen = HashSet::new();
    for q in queues {
        if q.name.trim().is_empty() {
            return Err(Error::Config("a queue name is empty".into()));
        }
        if !seen.insert(q.name.as_str()) {
            return Err(Error::Config(format!(
                "queue {} cannot be defined twice",
                q.name
            )));
        }
    }
    Ok(())
}

/// A positive, finite number of seconds as a duration.
pub(crate) fn positive_duration(secs: f64) -> Option<Duration> {
    if secs.is_finite() && secs > 0.0 {
        Duration::try_from_secs_f64(secs).ok()
    } else {
        None
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::collections::HashMap;

    use super::*;

    pub(crate) fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    pub(crate) fn q(name: &str, weight: u32) -> QueueWeight {
        QueueWeight {
            name: name.into(),
            weight,
        }
    }

    #[test]
    fn the_environment_comes_from_the_flag_then_app_rails_rack_env() {
        let env = env_of(&[("RAILS_ENV", "staging"), ("RACK_ENV", "other")]);
        assert_eq!(sidekiq_environment(Some("production"), &env), "production");
        assert_eq!(sidekiq_environment(None, &env), "staging");
        assert_eq!(sidekiq_environment(None, &env_of(&[])), "development");
    }

    #[test]
    fn queue_args_parse_like_sidekiq_and_reject_bad_weights() {
        assert_eq!(parse_queue_arg("a,2").unwrap(), q("a", 2));
        assert_eq!(parse_queue_arg("b").unwrap(), q("b", 0));
        assert!(parse_queue_arg("a,x").is_err());
        assert!(parse_queue_arg("a,-1").is_err());
        assert!(parse_queue_arg(",2").is_err());
        assert!(parse_queue_arg("a,1,2").is_err());
    }

    #[test]
    fn web_ui_routing_matches_sidekiqs_pattern() {
        assert!(web_ui_routable("low-priority.v2:x_y"));
        assert!(!web_ui_routable("with space"));
        assert!(!web_ui_routable("a/b"));
    }

    #[test]
    fn validate_rejects_zero_concurrency_and_timeout() {
        let c = Config {
            concurrency: 0,
            ..Config::default()
        };
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("concurrency")
        );
        let c = Config {
            timeout: Duration::ZERO,
            ..Config::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("timeout"));
        assert!(Config::default().validate().is_ok());
    }
}
