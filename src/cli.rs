//! The command line: Sidekiq's own flags where they apply (`cli.rb@v6.4.1 option_parser`), plus
//! oxidekiq's, and how they combine with `sidekiq.yml` into a [`Config`].
//!
//! Precedence is Sidekiq's: defaults, then the config file (`-C PATH`, else `config/sidekiq.yml` or
//! `config/sidekiq.yml.erb` when present), then flags. As in Ruby (`parse_config(file).merge(opts)`)
//! each flag replaces the file's value whole: one `-q` replaces the file's whole queue list, one
//! `--label` its whole label list. When neither sets the concurrency, `RAILS_MAX_THREADS` does, as in
//! Sidekiq 6.4 (`cli.rb@v6.4.1 setup_options`).
//!
//! The Redis URL can hold a password: `--help` never shows the `REDIS_URL` value, and neither
//! [`Cli`]'s nor [`Config`]'s `Debug` shows the password. The URL comes from `--redis-url`, else
//! `REDIS_URL`, else the config file; an empty `REDIS_URL=` or `REDIS_CA_FILE=` counts as unset.
//!
//! Sentinel: `--sentinel HOST:PORT` (repeatable) replaces the file's `:redis: :sentinels:` whole;
//! `--sentinel-master NAME` and `REDIS_SENTINEL_PASSWORD` apply to either, and the Redis URL still gives
//! the master's password and database (see `sentinel`).
//!
//! `-c` and the queue weights of `-q` are bounded ([`config::MAX_CONCURRENCY`],
//! [`config::MAX_QUEUE_WEIGHT`]), as are `-t` and the intervals ([`config::MAX_SECONDS`]): a value
//! past the bound is a usage error naming it.

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, Parser, ValueEnum};

use crate::config::{
    self, Config, FetchMode, FileOptions, QueueWeight, UnknownClass, check_queue_list, process_env,
    sidekiq_environment,
};
use crate::error::Error;
use crate::redact::redact_url;

const EXAMPLES: &str = "\
Examples:
  oxidekiq -q rust
      one queue, 10 jobs at a time, Redis from REDIS_URL or 127.0.0.1:6379
  oxidekiq -q critical,3 -q rust,1 -c 20 -t 30
      weighted queues (critical is tried first 3 times in 4), 20 jobs at once, 30 s to finish on TERM
  oxidekiq -C config/oxidekiq.yml -e production
      settings from a sidekiq.yml-style file and its production section; flags still override it
  oxidekiq --redis-url redis://redis.internal:6379/0 -q rust --fetch basic -g billing
      plain BRPOP fetch as Sidekiq does it, tagged `billing` on the Busy page
  oxidekiq -q rust --http 0.0.0.0:9394 --log-format json
      Prometheus metrics at /metrics, probes at /health and /ready, JSON log lines
  oxidekiq -q rust --sentinel s1:26379 --sentinel s2:26379 --sentinel-master mymaster
      the Redis master named by Sentinel, followed across failovers";

/// The parsed command line; [`config_from`] turns it into a [`Config`].
#[derive(Parser, Clone)]
#[command(
    name = "oxidekiq",
    version,
    about = "Runs Sidekiq jobs with Rust workers, side by side with Ruby Sidekiq",
    after_help = EXAMPLES
)]
pub struct Cli {
    /// Queue to process, with an optional weight; repeat for several (replaces the file's queues)
    #[arg(global = true, short = 'q', long = "queue", value_name = "QUEUE[,WEIGHT]", value_parser = queue_value)]
    pub queues: Vec<QueueWeight>,

    /// A capsule beside the default one: its own CONCURRENCY slots for its own QUEUEs (as -q takes them, apart by spaces); repeat for several, or with the same NAME to add queues (replaces the file's capsules)
    #[arg(global = true, long = "capsule", value_name = "NAME:CONCURRENCY:QUEUE[,WEIGHT]", value_parser = capsule_value)]
    pub capsules: Vec<config::Capsule>,

    /// How many jobs run at once, 1 to 10000 [default: 10, or RAILS_MAX_THREADS]
    #[arg(global = true, short = 'c', long, value_name = "INT", value_parser = concurrency_value)]
    pub concurrency: Option<usize>,

    /// Threads that run jobs, 1 to 1024 [default: one per CPU less one, at least 1]. The heartbeat,
    /// signals, fetching and the stop run on a thread of their own: a job that blocks its thread delays
    /// other jobs, never them
    #[arg(global = true, long, value_name = "INT", value_parser = threads_value)]
    pub threads: Option<usize>,

    /// Seconds running jobs get to finish after TERM before they are pushed back, at most 86400 [default: 25]
    #[arg(global = true, short = 't', long, value_name = "SECONDS", value_parser = seconds_value)]
    pub timeout: Option<Duration>,

    /// Tag shown on the Web UI's Busy page (default: the working directory's name)
    #[arg(global = true, short = 'g', long, value_name = "TAG")]
    pub tag: Option<String>,

    /// YAML config file, Sidekiq's format (default: config/sidekiq.yml if it exists)
    #[arg(global = true, short = 'C', long = "config", value_name = "PATH")]
    pub config: Option<PathBuf>,

    /// Environment whose section of the config file applies (default: APP_ENV, RAILS_ENV, RACK_ENV or development)
    #[arg(global = true, short = 'e', long, value_name = "ENV")]
    pub environment: Option<String>,

    /// Redis to use (default: the config file's redis_url, else redis://127.0.0.1:6379). Prefer REDIS_URL: a flag shows the password in `ps`
    #[arg(
        global = true,
        long,
        value_name = "URL",
        env = "REDIS_URL",
        hide_env_values = true
    )]
    pub redis_url: Option<String>,

    /// PEM CA bundle that a rediss:// server's certificate must chain to (default: the system's trust store)
    #[arg(global = true, long, value_name = "PATH", env = "REDIS_CA_FILE", value_parser = path_value)]
    pub redis_ca_file: Option<PathBuf>,

    /// Print more verbose output (debug logging)
    #[arg(global = true, short = 'v', long)]
    pub verbose: bool,

    /// Least severe log lines written: debug, info (Sidekiq's default: a start and a done line per job), warn (no per-job lines) or error; -v is debug
    #[arg(
        global = true,
        long,
        value_enum,
        value_name = "LEVEL",
        env = "OXIDEKIQ_LOG_LEVEL"
    )]
    pub log_level: Option<LogLevelArg>,

    /// Fetch strategy: reliable keeps in-flight jobs in Redis so a crash loses none; basic is Sidekiq's BRPOP
    #[arg(global = true, long, value_name = "MODE", value_parser = fetch_value)]
    pub fetch: Option<FetchMode>,

    /// What happens to a job whose class has no Rust worker: retry (as Sidekiq does) or dead
    #[arg(global = true, long, value_enum, value_name = "WHAT")]
    pub unknown_class: Option<UnknownClassArg>,

    /// Label shown on the Busy page; repeat for several (replaces the file's labels)
    #[arg(global = true, long = "label", value_name = "LABEL")]
    pub labels: Vec<String>,

    /// Payloads larger than this many bytes go to the dead set undecoded
    #[arg(global = true, long, value_name = "N")]
    pub max_payload_bytes: Option<usize>,

    /// Heartbeat interval in seconds (tests only)
    #[arg(global = true, long, value_name = "SECONDS", hide = true, value_parser = seconds_value)]
    pub beat_interval: Option<Duration>,

    /// Average scheduled-set poll interval in seconds (tests only)
    #[arg(global = true, long, value_name = "SECONDS", hide = true, value_parser = seconds_value)]
    pub poll_interval: Option<Duration>,

    /// Don't run sidekiq-cron's schedules (by default they run whenever Redis holds some, as a Ruby process with the gem runs them)
    #[arg(long)]
    pub no_cron: bool,

    /// Longest time between two looks at the cron schedules in Redis, seconds [default: 30, sidekiq-cron's cron_poll_interval]
    #[arg(long, value_name = "SECONDS", value_parser = seconds_value)]
    pub cron_poll_interval: Option<Duration>,

    /// Timestamp format written to Redis: seconds (Sidekiq ≤7), milliseconds (Sidekiq 8), or auto (follow the live processes)
    #[arg(global = true, long, value_enum, value_name = "FORMAT")]
    pub timestamps: Option<TimestampsArg>,

    /// Push a job whose class has no Rust worker (or that carries a Ruby-side contract) unchanged to QUEUE, which Ruby serves
    #[arg(global = true, long, value_name = "QUEUE")]
    pub handoff: Option<String>,

    /// With --handoff: run this class's jobs in Rust even when they carry a Ruby-side contract; repeat for several
    #[arg(global = true, long = "run-flagged", value_name = "CLASS")]
    pub run_flagged: Vec<String>,

    /// sidekiq-unique-jobs release whose server rules the gem's jobs follow: 7.1, 8.0 or 8.1 (default: read from what the fleet writes)
    #[arg(global = true, long = "unique-jobs-version", value_name = "VERSION", value_parser = ["7.1", "8.0", "8.1"])]
    pub unique_jobs_version: Option<String>,

    /// Migration commands (check, route, routes, report); without one, oxidekiq runs the workers
    #[command(subcommand)]
    pub command: Option<crate::migrate::Command>,
    /// Serve GET /metrics (Prometheus), /health and /ready on this address, e.g. 127.0.0.1:9394 [default: off]
    #[arg(global = true, long, value_name = "ADDR")]
    pub http: Option<String>,

    /// Log line format: text (Sidekiq's line) or json (one object per line)
    #[arg(global = true, long, value_enum, value_name = "FORMAT")]
    pub log_format: Option<LogFormatArg>,

    /// A Redis Sentinel, HOST:PORT (port 26379 by default); repeat for several (replaces the file's sentinels)
    #[arg(global = true, long = "sentinel", value_name = "HOST:PORT", value_parser = SentinelValue)]
    pub sentinels: Vec<crate::sentinel::SentinelNode>,

    /// Name of the master the sentinels monitor [default: the host of the Redis URL, as redis-rb reads it]
    #[arg(global = true, long, value_name = "NAME")]
    pub sentinel_master: Option<String>,

    /// Password of the sentinels themselves (the master's is in the Redis URL). Prefer REDIS_SENTINEL_PASSWORD: a flag shows in `ps`
    #[arg(
        global = true,
        long,
        value_name = "PASSWORD",
        env = "REDIS_SENTINEL_PASSWORD",
        hide_env_values = true
    )]
    pub sentinel_password: Option<String>,
}

/// `--log-format` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormatArg {
    /// Sidekiq's line.
    Text,
    /// One JSON object per line.
    Json,
}

/// `--sentinel` values. A parser of its own rather than a function: clap quotes a value a function
/// refuses in its error (`invalid value 'redis://:pw@h:x'`), and a sentinel URL may hold a password;
/// this error shows only [`crate::sentinel::SentinelNode::parse`]'s message, which redacts it.
#[derive(Debug, Clone, Copy)]
struct SentinelValue;

impl clap::builder::TypedValueParser for SentinelValue {
    type Value = crate::sentinel::SentinelNode;

    fn parse_ref(
        &self,
        _cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<Self::Value, clap::Error> {
        let refuse = |why: String| {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!("invalid value for '--sentinel <HOST:PORT>': {why}\n"),
            )
        };
        let text = value.to_str().ok_or_else(|| refuse("not UTF-8".into()))?;
        crate::sentinel::SentinelNode::parse(text).map_err(refuse)
    }
}

/// `--fetch` values: the names of the strategies `src/processing/fetch/` registers.
fn fetch_value(arg: &str) -> Result<FetchMode, String> {
    FetchMode::named(arg).ok_or_else(|| {
        let names: Vec<&str> = crate::fetch::strategy_names().collect();
        format!(
            "unknown fetch strategy '{arg}' (one of: {})",
            names.join(", ")
        )
    })
}

/// `--unknown-class` values (`UnknownClass::Retry` and `UnknownClass::Dead`). The variants' own
/// docs are `--help` text: plain words, no rustdoc links.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum UnknownClassArg {
    /// To the retry set, as Sidekiq does with a class it cannot find
    Retry,
    /// Straight to the dead set
    Dead,
}

/// `--log-level` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogLevelArg {
    /// Everything, debug lines included (as -v)
    Debug,
    /// A start and a done line per job, and what the process does (the default)
    Info,
    /// Warnings and errors only: no per-job lines
    Warn,
    /// Errors only
    Error,
}

/// `--timestamps` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TimestampsArg {
    /// Float seconds, as Sidekiq 7 and older write them.
    Seconds,
    /// Integer milliseconds, as Sidekiq 8 writes them.
    Milliseconds,
    /// Follow the versions of the live processes.
    Auto,
}

impl fmt::Debug for Cli {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // By hand so the Redis password never reaches a log line.
        f.debug_struct("Cli")
            .field("queues", &self.queues)
            .field("capsules", &self.capsules)
            .field("concurrency", &self.concurrency)
            .field("timeout", &self.timeout)
            .field("tag", &self.tag)
            .field("config", &self.config)
            .field("environment", &self.environment)
            .field("redis_url", &self.redis_url.as_deref().map(redact_url))
            .field("redis_ca_file", &self.redis_ca_file)
            .field("verbose", &self.verbose)
            .field("fetch", &self.fetch)
            .field("unknown_class", &self.unknown_class)
            .field("labels", &self.labels)
            .field("max_payload_bytes", &self.max_payload_bytes)
            .field("beat_interval", &self.beat_interval)
            .field("poll_interval", &self.poll_interval)
            .field("no_cron", &self.no_cron)
            .field("cron_poll_interval", &self.cron_poll_interval)
            .field("timestamps", &self.timestamps)
            .field("handoff", &self.handoff)
            .field("run_flagged", &self.run_flagged)
            .field("unique_jobs_version", &self.unique_jobs_version)
            .field("command", &self.command)
            .field("http", &self.http)
            .field("log_format", &self.log_format)
            .field("log_level", &self.log_level)
            .field("sentinels", &self.sentinels)
            .field("sentinel_master", &self.sentinel_master)
            .field(
                "sentinel_password",
                &self.sentinel_password.as_ref().map(|_| "REDACTED"),
            )
            .finish()
    }
}

fn capsule_value(arg: &str) -> Result<config::Capsule, String> {
    config::parse_capsule_spec(arg)
}

fn queue_value(arg: &str) -> Result<QueueWeight, String> {
    config::parse_queue_spec(arg)
}

fn seconds_value(arg: &str) -> Result<Duration, String> {
    let secs = arg
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0)
        .ok_or_else(|| "must be a number of seconds above 0".to_string())?;
    if secs > config::MAX_SECONDS {
        return Err(format!(
            "must be at most {} seconds (one day)",
            config::MAX_SECONDS
        ));
    }
    config::positive_duration(secs).ok_or_else(|| "must be a number of seconds above 0".into())
}

fn concurrency_value(arg: &str) -> Result<usize, String> {
    let n: usize = arg
        .trim()
        .parse()
        .map_err(|_| "must be a whole number of at least 1".to_string())?;
    match n {
        0 => Err("must be at least 1".into()),
        n if n > config::MAX_CONCURRENCY => Err(format!(
            "must be at most {} (see docs/security.md)",
            config::MAX_CONCURRENCY
        )),
        n => Ok(n),
    }
}

/// `--threads` values.
fn threads_value(arg: &str) -> Result<usize, String> {
    match arg.trim().parse::<usize>() {
        Ok(n) if (1..=config::MAX_THREADS).contains(&n) => Ok(n),
        _ => Err(format!(
            "must be a whole number from 1 to {}",
            config::MAX_THREADS
        )),
    }
}

/// A path, where an empty value (`REDIS_CA_FILE=`) is accepted here and means "unset" later.
fn path_value(arg: &str) -> Result<PathBuf, String> {
    Ok(PathBuf::from(arg))
}

/// `oxidekiq <crate version>`, as `--version` prints it.
pub fn version_string() -> String {
    format!("oxidekiq {}", env!("CARGO_PKG_VERSION"))
}

/// The `--help` text.
pub fn help() -> String {
    Cli::command().render_help().to_string()
}

/// Parses the arguments, the program name first (as [`std::env::args`] gives them).
///
/// `REDIS_URL` is read from the process environment when `--redis-url` is absent. `--help`,
/// `--version` and usage mistakes come back as a [`clap::Error`], whose `exit()` prints them and
/// exits the way every clap program does.
pub fn parse_args<I, T>(args: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    Cli::try_parse_from(args)
}

/// Parses the arguments and builds the [`Config`]: defaults, then the config file, then flags.
///
/// For `--help`, `--version` and usage mistakes it prints clap's message and exits the process
/// (status 0 for help and version, 2 for mistakes), so a binary can be
/// `let config = oxidekiq::cli::load(std::env::args())?;`.
pub fn load<I, T>(args: I) -> Result<Config, Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = parse_args(args).unwrap_or_else(|e| e.exit());
    config_from(&cli, &process_env, Path::new("."))
}

/// Builds the [`Config`] from parsed flags: defaults, then the config file (`-C`, else
/// `config/sidekiq.yml` or `config/sidekiq.yml.erb` under `base_dir`), then the flags, then
/// validation. `env` reads the environment (ERB lookups, `APP_ENV`/`RAILS_ENV`/`RACK_ENV`,
/// `RAILS_MAX_THREADS`); a relative `-C` path is taken from `base_dir`.
pub fn config_from(
    cli: &Cli,
    env: &dyn Fn(&str) -> Option<String>,
    base_dir: &Path,
) -> Result<Config, Error> {
    let environment = sidekiq_environment(cli.environment.as_deref(), env);
    let mut config = Config::default();

    let file = match &cli.config {
        Some(path) => {
            let path = base_dir.join(path);
            if !path.is_file() {
                return Err(Error::Config(format!(
                    "no such config file {}",
                    path.display()
                )));
            }
            Some(path)
        }
        None => ["config/sidekiq.yml", "config/sidekiq.yml.erb"]
            .iter()
            .map(|p| base_dir.join(p))
            .find(|p| p.is_file()),
    };
    let mut concurrency_given = cli.concurrency.is_some();
    if let Some(path) = &file {
        let opts = FileOptions::read(path, &environment, env)?;
        concurrency_given |= opts.concurrency.is_some();
        opts.apply_to(&mut config);
        tracing::debug!(file = %path.display(), environment = %environment, "config file read");
    }

    if cli.threads.is_some() {
        config.threads = cli.threads;
    }
    if let Some(c) = cli.concurrency {
        config.concurrency = c;
    } else if !concurrency_given && let Some(threads) = env("RAILS_MAX_THREADS") {
        config.concurrency = threads.trim().parse().map_err(|_| {
            Error::Config(format!(
                "RAILS_MAX_THREADS: `{threads}` is not a valid concurrency"
            ))
        })?;
    }
    if let Some(t) = cli.timeout {
        config.timeout = t;
    }
    if !cli.queues.is_empty() {
        let queues = cli.queues.clone();
        check_queue_list(&queues)?;
        config.queues = queues;
    }
    if !cli.capsules.is_empty() {
        let mut capsules = Vec::new();
        for c in &cli.capsules {
            config::merge_capsule(&mut capsules, c.clone())?;
        }
        for c in &mut capsules {
            check_queue_list(&c.queues).map_err(|e| match e {
                Error::Config(m) => Error::Config(format!("--capsule {}: {m}", c.name)),
                other => other,
            })?;
        }
        // The flag replaces the file's capsules: a queue only those served is now served by none.
        let served: std::collections::HashSet<&str> = config
            .queues
            .iter()
            .chain(capsules.iter().flat_map(|c| c.queues.iter()))
            .map(|q| q.name.as_str())
            .collect();
        for dropped in &config.capsules {
            let unserved: Vec<&str> = dropped
                .queues
                .iter()
                .map(|q| q.name.as_str())
                .filter(|q| !served.contains(q))
                .collect();
            if !unserved.is_empty() {
                crate::logging::warn_early(format!(
                    "--capsule replaces sidekiq.yml's capsules: capsule `{}` is not started, and no \
                     capsule serves its queue(s) {}",
                    crate::logging::escape(&dropped.name),
                    unserved
                        .iter()
                        .map(|q| format!("`{}`", crate::logging::escape(q)))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
        config.capsules = capsules;
    }
    if let Some(tag) = &cli.tag {
        config.tag = Some(tag.clone());
    }
    if !cli.labels.is_empty() {
        config.labels = cli.labels.clone();
    }
    if cli.verbose {
        config.verbose = true;
    }
    // The flag beats the file's `verbose:`; beside -v it must say the same.
    match (cli.log_level, config.verbose) {
        (Some(level), _) => {
            if cli.verbose && level != LogLevelArg::Debug {
                return Err(Error::Config(
                    "-v (verbose: debug lines) and --log-level name different levels: give one"
                        .into(),
                ));
            }
            config.log_level = match level {
                LogLevelArg::Debug => crate::logging::LogLevel::Debug,
                LogLevelArg::Info => crate::logging::LogLevel::Info,
                LogLevelArg::Warn => crate::logging::LogLevel::Warn,
                LogLevelArg::Error => crate::logging::LogLevel::Error,
            };
        }
        (None, true) => config.log_level = crate::logging::LogLevel::Debug,
        (None, false) => {}
    }
    // Flag, then REDIS_URL (clap reads both into `redis_url`), then the file; empty means unset.
    if let Some(url) = cli.redis_url.as_ref().filter(|u| !u.is_empty()) {
        config.redis_url = Some(url.clone());
    }
    if let Some(path) = cli
        .redis_ca_file
        .as_ref()
        .filter(|p| !p.as_os_str().is_empty())
    {
        config.redis_ca_file = Some(path.clone());
    }
    if let Some(f) = cli.fetch {
        config.fetch = f;
    }
    if let Some(u) = cli.unknown_class {
        config.unknown_class = match u {
            UnknownClassArg::Retry => UnknownClass::Retry,
            UnknownClassArg::Dead => UnknownClass::Dead,
        };
    }
    if let Some(n) = cli.max_payload_bytes {
        config.max_payload_bytes = n;
    }
    if let Some(b) = cli.beat_interval {
        config.beat_interval = b;
    }
    if cli.no_cron {
        config.cron.enabled = false;
    }
    if let Some(p) = cli.cron_poll_interval {
        config.cron.poll_interval = p;
    }
    if let Some(p) = cli.poll_interval {
        config.poll_interval_average = p;
    }
    if let Some(t) = cli.timestamps {
        config.millisecond_timestamps = match t {
            TimestampsArg::Seconds => Some(false),
            TimestampsArg::Milliseconds => Some(true),
            TimestampsArg::Auto => None,
        };
    }
    if let Some(q) = &cli.handoff {
        if !config::web_ui_routable(q) {
            return Err(Error::Config(format!(
                "--handoff: `{q}` is not a queue name Sidekiq can serve"
            )));
        }
        config.handoff = Some(q.clone());
    }
    if !cli.run_flagged.is_empty() {
        config.run_flagged = cli.run_flagged.clone();
    }
    if let Some(v) = &cli.unique_jobs_version {
        config.unique_jobs_gem = Some(config::UniqueJobsGem::named(v).ok_or_else(|| {
            Error::Config(format!(
                "--unique-jobs-version: `{v}` is not one of {}",
                config::UniqueJobsGem::NAMES.join(", ")
            ))
        })?);
    }

    if let Some(addr) = &cli.http {
        config.http = Some(addr.clone());
    }
    if let Some(f) = cli.log_format {
        config.log_format = match f {
            LogFormatArg::Text => crate::logging::LogFormat::Text,
            LogFormatArg::Json => crate::logging::LogFormat::Json,
        };
    }
    // `--sentinel` replaces the file's sentinels whole; the master name and password add to either.
    if !cli.sentinels.is_empty() {
        let s = config.sentinel.get_or_insert_with(Default::default);
        s.sentinels = cli.sentinels.clone();
    }
    if let Some(s) = config.sentinel.as_mut() {
        if let Some(name) = &cli.sentinel_master {
            s.master = Some(name.clone());
        }
        if let Some(pw) = cli.sentinel_password.as_ref().filter(|p| !p.is_empty()) {
            s.password = Some(pw.clone());
        }
    } else if cli.sentinel_master.is_some() {
        return Err(Error::Config(
            "--sentinel-master needs at least one --sentinel HOST:PORT".into(),
        ));
    } else if cli
        .sentinel_password
        .as_ref()
        .is_some_and(|p| !p.is_empty())
    {
        crate::logging::warn_early(
            "--sentinel-password / REDIS_SENTINEL_PASSWORD is set but no sentinel is configured: \
             ignored (Redis is reached at the URL)"
                .into(),
        );
    }
    warn_unused_flags(cli, &config);

    config.validate()?;
    Ok(config)
}

/// Settings read that change nothing in this combination, each a WARN naming it and what happens
/// instead (docs/configuration.md, "Settings not honoured").
fn warn_unused_flags(cli: &Cli, config: &Config) {
    if !config.cron.enabled && cli.no_cron && cli.cron_poll_interval.is_some() {
        crate::logging::warn_early(
            "--cron-poll-interval is set with --no-cron: ignored, no cron schedule runs".into(),
        );
    }
    if !config.run_flagged.is_empty() && config.handoff.is_none() {
        crate::logging::warn_early(format!(
            "--run-flagged {} without --handoff: ignored, no job is handed off, flagged or not",
            crate::logging::escape(&config.run_flagged.join(","))
        ));
    }
}

/// As [`load`], also giving the migration subcommand, if one was given (`oxidekiq [flags] check`).
pub fn load_command<I, T>(args: I) -> Result<(Config, Option<crate::migrate::Command>), Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = parse_args(args).unwrap_or_else(|e| e.exit());
    let config = config_from(&cli, &process_env, Path::new("."))?;
    Ok((config, cli.command))
}

/// Runs an application's workers as the `oxidekiq` binary does: the whole `main` of a worker binary.
///
/// Reads the command line ([`std::env::args`]) and the config file as [`load_command`] does, starts
/// logging and the Tokio runtime, then either runs a migration subcommand (`check`, `route`, `routes`,
/// `report`: its report on stdout) or the [`Launcher`](crate::launcher::Launcher) until `TERM`/`INT`
/// or the Web UI's Stop. `registry` is called once, after the flags are read, so `--help` and a usage
/// mistake build no worker.
///
/// The exit code: 0 when the launcher stopped cleanly or a subcommand passed; 1 when it could not
/// start, Redis failed for good, or a subcommand found a problem; 2 for a bad config file or value
/// (clap's own usage mistakes also exit with 2, and `--help`/`--version` with 0, before anything runs).
///
/// ```no_run
/// use oxidekiq::{JobContext, JobResult, Registry, Worker};
///
/// #[derive(Debug)]
/// struct HardWorker;
///
/// impl Worker for HardWorker {
///     const CLASS: &'static str = "HardWorker";
///     type Args = (String, i64);
///     async fn perform(&self, _ctx: &JobContext, (_name, _count): Self::Args) -> JobResult {
///         Ok(())
///     }
/// }
///
/// fn registry() -> Registry {
///     let mut r = Registry::new();
///     r.register(HardWorker);
///     r
/// }
///
/// fn main() -> std::process::ExitCode {
///     oxidekiq::run(registry)
/// }
/// ```
pub fn run(registry: impl FnOnce() -> crate::registry::Registry) -> ExitCode {
    // Every error line starts with the program's name, as clap's own do.
    const PROGRAM: &str = "oxidekiq";
    let (config, command) = match load_command(std::env::args()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{PROGRAM}: {e}");
            return ExitCode::from(2);
        }
    };
    let _log = crate::logging::init_with(config.log_level, config.log_format);
    // The control plane's runtime, on this thread: the launcher runs the jobs on a runtime of its own
    // (`--threads`), so no job can starve what runs here (the heartbeat, signals, the stop).
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{PROGRAM}: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let registry = registry();
    if let Some(command) = command {
        return match runtime.block_on(crate::migrate::run(command, &config, &registry)) {
            Ok((out, ok)) => {
                print!("{out}");
                if ok {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(1)
                }
            }
            Err(e) => {
                eprintln!("{PROGRAM}: {e}");
                ExitCode::from(1)
            }
        };
    }
    runtime.block_on(crate::migrate::handoff::warn_if_unserved(&config));
    // OpenTelemetry, off unless `OTEL_*` configures it (docs/tracing.md). A setting this build cannot
    // honour stops the start: traces that silently go nowhere are found too late. Dropped before the
    // log guard: the flush is bounded and its report is logged.
    let _otel = match crate::otel::init_from_env() {
        Ok(guard) => guard,
        Err(e) => {
            tracing::error!(error = %e, "OpenTelemetry configuration refused");
            eprintln!("{PROGRAM}: {e}");
            return ExitCode::from(2);
        }
    };
    let launcher = crate::launcher::Launcher::new(config, registry);
    let code = match runtime.block_on(launcher.run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "oxidekiq stopped");
            eprintln!("{PROGRAM}: {e}");
            ExitCode::from(1)
        }
    };
    // Bounded, as a task still running here must not keep the process alive. A job stuck outside an
    // await, which the shutdown gave up on and pushed back, is on the job runtime, which the launcher
    // already shut down without waiting; returning from `main` ends its thread with the process.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    code
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn parse(args: &[&str]) -> Cli {
        parse_args(std::iter::once("oxidekiq").chain(args.iter().copied())).unwrap()
    }

    #[test]
    fn the_clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn sidekiq_short_flags_set_the_config() {
        let cli = parse(&[
            "-c", "3", "-t", "7", "-g", "app", "-v", "-q", "a,2", "-q", "b",
        ]);
        let c = config_from(&cli, &no_env, Path::new("/nonexistent-dir")).unwrap();
        assert_eq!(c.concurrency, 3);
        assert_eq!(c.timeout, Duration::from_secs(7));
        assert_eq!(c.tag.as_deref(), Some("app"));
        assert!(c.verbose);
        assert_eq!(
            c.queues
                .iter()
                .map(|q| (q.name.as_str(), q.weight))
                .collect::<Vec<_>>(),
            vec![("a", 2), ("b", 0)]
        );
    }

    #[test]
    fn bad_flag_values_are_usage_errors() {
        for args in [
            &["oxidekiq", "-q", "a,x"][..],
            &["oxidekiq", "-t", "0"],
            &["oxidekiq", "--fetch", "fast"],
            &["oxidekiq", "-c", "many"],
            &["oxidekiq", "--threads", "0"],
            &["oxidekiq", "--threads", "1025"],
        ] {
            assert!(parse_args(args.iter().copied()).is_err(), "{args:?}");
        }
    }

    #[test]
    fn the_log_level_flag_reaches_the_config_and_v_means_debug() {
        use crate::logging::LogLevel;
        let level = |args: &[&str]| {
            config_from(&parse(args), &no_env, Path::new("/nonexistent-dir")).map(|c| c.log_level)
        };
        assert_eq!(level(&[]).unwrap(), LogLevel::Info, "Sidekiq's default");
        assert_eq!(level(&["--log-level", "warn"]).unwrap(), LogLevel::Warn);
        assert_eq!(level(&["--log-level", "error"]).unwrap(), LogLevel::Error);
        assert_eq!(level(&["-v"]).unwrap(), LogLevel::Debug);
        assert_eq!(
            level(&["-v", "--log-level", "debug"]).unwrap(),
            LogLevel::Debug
        );
        let both = level(&["-v", "--log-level", "warn"])
            .unwrap_err()
            .to_string();
        assert!(both.contains("--log-level"), "{both}");
        assert!(parse_args(["oxidekiq", "--log-level", "loud"]).is_err());
    }

    #[test]
    fn the_threads_flag_reaches_the_config() {
        let c = config_from(&parse(&[]), &no_env, Path::new("/nonexistent-dir")).unwrap();
        assert_eq!(c.threads, None, "the default thread count unless asked");
        let cli = parse(&["--threads", "1"]);
        let c = config_from(&cli, &no_env, Path::new("/nonexistent-dir")).unwrap();
        assert_eq!(c.threads, Some(1));
    }

    #[test]
    fn the_redis_url_env_value_is_hidden_in_help() {
        let cmd = Cli::command();
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_id() == "redis_url")
            .unwrap();
        assert!(arg.is_hide_env_values_set());
        assert_eq!(arg.get_env(), Some(std::ffi::OsStr::new("REDIS_URL")));
    }

    #[test]
    fn the_redis_ca_file_flag_reaches_the_config() {
        let cli = parse(&["--redis-ca-file", "certs/ca.pem"]);
        let c = config_from(&cli, &no_env, Path::new("/nonexistent-dir")).unwrap();
        assert_eq!(c.redis_ca_file, Some(PathBuf::from("certs/ca.pem")));
    }

    #[test]
    fn ops_flags_reach_the_config() {
        let cli = parse(&[
            "--http",
            "127.0.0.1:0",
            "--log-format",
            "json",
            "--sentinel",
            "s1:26380",
            "--sentinel",
            "s2",
            "--sentinel-master",
            "mymaster",
        ]);
        let c = config_from(&cli, &no_env, Path::new("/nonexistent-dir")).unwrap();
        assert_eq!(c.http.as_deref(), Some("127.0.0.1:0"));
        assert_eq!(c.log_format, crate::logging::LogFormat::Json);
        let s = c.sentinel.unwrap();
        assert_eq!(s.master.as_deref(), Some("mymaster"));
        assert_eq!(
            s.sentinels
                .iter()
                .map(|n| (n.host.as_str(), n.port))
                .collect::<Vec<_>>(),
            vec![("s1", 26380), ("s2", 26379)]
        );
        let lone = parse(&["--sentinel-master", "mymaster"]);
        assert!(config_from(&lone, &no_env, Path::new("/nonexistent-dir")).is_err());
    }

    #[test]
    fn cli_debug_redacts_the_password() {
        let cli = parse(&["--redis-url", "redis://:s3cr3t-pw@h:1/0"]);
        let shown = format!("{cli:?}");
        assert!(!shown.contains("s3cr3t-pw"), "{shown}");
        assert!(shown.contains("REDACTED"), "{shown}");
    }
}
