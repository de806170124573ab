//! The process's configuration: what `-c`, `-q`, `-t`, `-C config/sidekiq.yml` and the environment say.
//!
//! Defaults are Sidekiq 6.4's (`sidekiq.rb@v6.4.1 DEFAULTS`): concurrency 10, queue `default`, timeout 25 s.
//!
//! A `sidekiq.yml` is read the way Sidekiq 6.4 reads it (`cli.rb@v6.4.1 parse_config`), so the file a
//! Rails app already has works unchanged:
//!
//! 1. ERB first. Only environment lookups are evaluated (`<%= ENV["X"] %>`, `ENV.fetch("X", 5)`,
//!    `ENV.fetch("X") { 5 }`, `ENV["X"] || 5`, optionally followed by `.to_i`, `.to_f` or `.to_s`);
//!    anything else, such as `<%= Rails.env %>` or `<% if ... %>`, is an error naming its line, since
//!    there is no Ruby here to run it. Unlike Ruby, which prints a missing variable as an empty string,
//!    a variable that is not set and has no default is an error naming it: an empty value almost always
//!    means a forgotten variable.
//! 2. YAML, with keys written either way (`:concurrency: 5` or `concurrency: 5`), anchors, aliases and
//!    `<<` merge keys, as Psych accepts them.
//! 3. The section named after the environment (`production:`, picked by `-e`, else `APP_ENV`,
//!    `RAILS_ENV`, `RACK_ENV`, else `development`) is merged over the top level, key by key and
//!    shallowly: a `queues` list in the section replaces the top-level one.
//! 4. Known keys are applied: `concurrency`, `timeout`, `queues`, `tag`, `labels`, `verbose`,
//!    `average_scheduled_poll_interval`. Any other key is ignored with a debug-level note, as Ruby ignores
//!    options no code reads.
//!
//! 5. The Redis URL: `redis_url: URL` or Sidekiq's `:redis: { :url: URL }`. `--redis-url` and then
//!    `REDIS_URL` win over the file; other `:redis:` keys are ignored with a warning naming them (put
//!    the password, database and TLS in the URL). Values read through ERB are never echoed by an
//!    error: a mistake such as `concurrency: <%= ENV["REDIS_URL"] %>` says which key is wrong, not
//!    what the variable holds.
//!
//! # Limits
//!
//! What a flag or a file can make the process spend is bounded, with a clear error past the bound:
//! concurrency at most [`MAX_CONCURRENCY`], a queue weight at most [`MAX_QUEUE_WEIGHT`], a number
//! of seconds at most [`MAX_SECONDS`], a config file at most [`MAX_CONFIG_FILE_BYTES`] (before and
//! after ERB), and its YAML at most [`MAX_YAML_NODES`] values once anchors and aliases are expanded
//! and [`MAX_YAML_DEPTH`] levels deep (a few hundred bytes of nested aliases, a "YAML bomb", would
//! otherwise expand to gigabytes). The expansion is counted on the parser's events, before any tree
//! is built.
//!
//! Queue weights follow `cli.rb@v6.4.1 parse_queue`: a queue is listed `max(weight, 1)` times and any
//! weight above 0 turns strict ordering off. So in `[[critical, 2], default]` the queue without a weight
//! counts as weight 1 (critical is tried first two times in three); [`normalize_weights`] writes that
//! down in [`QueueWeight::weight`], so that every weight is 0 (strict order) or every weight is at
//! least 1 (weighted random). A queue given twice is an error, as in Ruby.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use yaml_rust2::{Yaml, YamlLoader};

use crate::error::Error;
use crate::redis_conn::redact_url;

/// The most jobs one process may run at once. Each slot is a task, a working-list entry and a share
/// of every fetch; Sidekiq advises 5 to 50 per process, and past a few thousand one process is better
/// split in several. 10 000 is far beyond any real setting and still cheap.
pub const MAX_CONCURRENCY: usize = 10_000;

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
    /// Sidekiq weight; all 0 = strict order, otherwise weighted random.
    pub weight: u32,
}

/// Which fetch strategy drains the queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FetchMode {
    /// Jobs move atomically into a working list owned by this process and leave it only once their
    /// fate is in Redis; a crashed process's jobs are recovered (the default).
    #[default]
    Reliable,
    /// Sidekiq's open-source `BRPOP` fetch: a killed process loses its in-flight jobs.
    Basic,
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
    /// The queues to fetch from, in configured order (`-q`).
    pub queues: Vec<QueueWeight>,
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
    /// [`crate::migrate::handoff`]) is pushed unchanged to this queue, which Ruby serves.
    pub handoff: Option<String>,
    /// `--run-flagged CLASS`: classes whose jobs run in Rust even when they carry a Ruby-side contract.
    pub run_flagged: Vec<String>,
    /// Address of the `/metrics`, `/health`, `/ready` endpoint (`--http`); `None`: off.
    pub http: Option<String>,
    /// Log line format (`--log-format`).
    pub log_format: crate::logging::LogFormat,
    /// Redis through Sentinel (`--sentinel`, `:redis: { :sentinels: ... }`); `None`: the URL's server.
    pub sentinel: Option<crate::sentinel::SentinelConfig>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            redis_url: None,
            redis_ca_file: None,
            concurrency: 10,
            queues: vec![QueueWeight {
                name: "default".into(),
                weight: 0,
            }],
            timeout: Duration::from_secs(25),
            tag: None,
            labels: Vec::new(),
            verbose: false,
            fetch: FetchMode::Reliable,
            unknown_class: UnknownClass::Retry,
            max_payload_bytes: 16 * 1024 * 1024,
            beat_interval: Duration::from_secs(5),
            poll_interval_average: Duration::from_secs(5),
            millisecond_timestamps: None,
            handoff: None,
            run_flagged: Vec::new(),
            http: None,
            log_format: crate::logging::LogFormat::Text,
            sentinel: None,
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
            .field("queues", &self.queues)
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
            .field("sentinel", &self.sentinel)
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

    /// Applies a `sidekiq.yml` text over this config, ERB lookups reading the process environment.
    ///
    /// `environment` names the section merged over the top level; `None` picks it as Sidekiq does
    /// (`APP_ENV`, `RAILS_ENV`, `RACK_ENV`, else `development`). Keys the file does not set keep
    /// their current value.
    pub fn apply_yaml(&mut self, text: &str, environment: Option<&str>) -> Result<(), Error> {
        self.apply_yaml_with_env(text, environment, &process_env)
    }

    /// [`Config::apply_yaml`] with the environment read through `env` (tests pass a map).
    pub fn apply_yaml_with_env(
        &mut self,
        text: &str,
        environment: Option<&str>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), Error> {
        let environment = sidekiq_environment(environment, env);
        FileOptions::parse(text, &environment, env)?.apply_to(self);
        Ok(())
    }

    /// Reads and applies a `sidekiq.yml` file (see [`Config::apply_yaml`]); errors name the file.
    pub fn load_file(
        &mut self,
        path: impl AsRef<Path>,
        environment: Option<&str>,
    ) -> Result<(), Error> {
        self.load_file_with_env(path, environment, &process_env)
    }

    /// [`Config::load_file`] with the environment read through `env`.
    pub fn load_file_with_env(
        &mut self,
        path: impl AsRef<Path>,
        environment: Option<&str>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), Error> {
        let environment = sidekiq_environment(environment, env);
        FileOptions::read(path.as_ref(), &environment, env)?.apply_to(self);
        Ok(())
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
        if let Some(q) = self.queues.iter().find(|q| q.weight > MAX_QUEUE_WEIGHT) {
            return Err(Error::Config(format!(
                "queue {}: weight {} is too large, it must be at most {MAX_QUEUE_WEIGHT}",
                q.name, q.weight
            )));
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
        for q in &self.queues {
            if !web_ui_routable(&q.name) {
                tracing::warn!(
                    queue = %q.name,
                    "queue name has characters the Sidekiq Web UI cannot route; its page will not open"
                );
            }
        }
        Ok(())
    }
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

/// Evaluates the ERB of a `sidekiq.yml`: environment lookups only (see the module docs); any other tag
/// is an error naming its line.
pub fn render_erb(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<String, Error> {
    erb::render(text, env).map_err(Error::Config)
}

/// What a `sidekiq.yml` sets; `None` is "not in the file".
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct FileOptions {
    /// `concurrency`.
    pub(crate) concurrency: Option<usize>,
    /// `timeout`, seconds.
    pub(crate) timeout: Option<Duration>,
    /// `queues`, already checked and weight-normalized.
    pub(crate) queues: Option<Vec<QueueWeight>>,
    /// `tag`.
    pub(crate) tag: Option<String>,
    /// `labels`.
    pub(crate) labels: Option<Vec<String>>,
    /// `verbose`.
    pub(crate) verbose: Option<bool>,
    /// `average_scheduled_poll_interval`, seconds.
    pub(crate) poll_interval_average: Option<Duration>,
    /// `redis_url`, or `url` in the `redis` mapping; `None` when `REDIS_URL` is set (it wins).
    pub(crate) redis_url: Option<String>,
    /// `sentinels`, `name`, `role`, `sentinel_username`, `sentinel_password` of the `redis` mapping.
    pub(crate) sentinel: Option<crate::sentinel::SentinelConfig>,
}

impl FileOptions {
    /// Reads a file; every error message starts with its path.
    pub(crate) fn read(
        path: &Path,
        environment: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<FileOptions, Error> {
        let text = read_bounded(path)?;
        FileOptions::parse(&text, environment, env).map_err(|e| match e {
            Error::Config(m) => Error::Config(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// ERB, YAML, environment section, known keys (`cli.rb@v6.4.1 parse_config`).
    pub(crate) fn parse(
        text: &str,
        environment: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<FileOptions, Error> {
        if text.len() > MAX_CONFIG_FILE_BYTES {
            return Err(too_large(text.len()));
        }
        let mut from_env = Vec::new();
        let rendered = erb::render_collecting(text, env, &mut from_env).map_err(Error::Config)?;
        FileOptions::parse_rendered(&rendered, environment, env)
            .map_err(|e| hide_env_values(e, &from_env))
    }

    /// [`FileOptions::parse`] after ERB.
    fn parse_rendered(
        rendered: &str,
        environment: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<FileOptions, Error> {
        if rendered.len() > MAX_CONFIG_FILE_BYTES {
            return Err(Error::Config(format!(
                "{} once ERB is rendered; a config file may be at most {MAX_CONFIG_FILE_BYTES} bytes",
                size_in_bytes(rendered.len())
            )));
        }
        check_yaml_budget(rendered)?;
        let docs = YamlLoader::load_from_str(rendered)
            .map_err(|e| Error::Config(format!("invalid YAML: {e}")))?;
        let root = match docs.into_iter().next() {
            None | Some(Yaml::Null) => return Ok(FileOptions::default()),
            Some(doc) => resolve_merge_keys(doc),
        };
        let Yaml::Hash(root) = root else {
            return Err(Error::Config(
                "the file must be a mapping of options (`concurrency: 5`, `queues: [...]`)".into(),
            ));
        };
        let mut top = symbolize(root);
        // Sidekiq merges the current environment's section over the top level, shallowly.
        if let Some(pos) = top.iter().position(|(k, _)| k == environment) {
            let (_, section) = top.remove(pos);
            match section {
                Yaml::Null => {}
                Yaml::Hash(h) => {
                    for (k, v) in symbolize(h) {
                        upsert(&mut top, k, v);
                    }
                }
                _ => {
                    return Err(Error::Config(format!(
                        "the `{environment}` section must be a mapping of options"
                    )));
                }
            }
        }
        let mut opts = FileOptions::default();
        for (key, value) in top {
            if value == Yaml::Null {
                tracing::debug!(key = %key, "sidekiq.yml key has no value; ignored");
                continue;
            }
            match key.as_str() {
                "concurrency" => opts.concurrency = Some(positive_int(&key, &value)?),
                "timeout" => opts.timeout = Some(seconds(&key, &value)?),
                "average_scheduled_poll_interval" => {
                    opts.poll_interval_average = Some(seconds(&key, &value)?)
                }
                "queues" => opts.queues = Some(queues(&value)?),
                "tag" => opts.tag = Some(scalar(&key, &value)?),
                "labels" => opts.labels = Some(labels(&value)?),
                "verbose" => match value {
                    Yaml::Boolean(b) => opts.verbose = Some(b),
                    _ => {
                        return Err(Error::Config("verbose: must be true or false".to_string()));
                    }
                },
                "redis_url" => opts.redis_url = Some(redis_url("redis_url", &value)?),
                "redis" => match value {
                    Yaml::Hash(h) => {
                        let mut sentinel = crate::sentinel::SentinelConfig::default();
                        let mut sentinel_keys = false;
                        for (k, v) in symbolize(h) {
                            match k.as_str() {
                                "url" => opts.redis_url = Some(redis_url("redis: url", &v)?),
                                "sentinels" => {
                                    sentinel.sentinels = sentinels(&v)?;
                                    sentinel_keys = true;
                                }
                                "name" | "master_name" => {
                                    sentinel.master = Some(scalar("redis: name", &v)?);
                                }
                                "role" => {
                                    let role = scalar("redis: role", &v)?;
                                    if role.trim_start_matches(':') != "master" {
                                        return Err(Error::Config(format!(
                                            "redis: role: {}: oxidekiq writes, so only `master` \
                                             is supported",
                                            crate::logging::escape(&role)
                                        )));
                                    }
                                }
                                "sentinel_username" => {
                                    sentinel.username =
                                        Some(scalar("redis: sentinel_username", &v)?)
                                }
                                "sentinel_password" => {
                                    sentinel.password =
                                        Some(secret("redis: sentinel_password", &v)?)
                                }
                                _ => tracing::warn!(
                                    key = %crate::logging::escape(&k),
                                    "sidekiq.yml `redis:` key not used by oxidekiq (give the \
                                     password, database and TLS in the URL); ignored"
                                ),
                            }
                        }
                        if sentinel_keys {
                            opts.sentinel = Some(sentinel);
                        } else if sentinel.master.is_some() {
                            return Err(Error::Config(
                                "redis: name: needs `sentinels:` (a list of { host:, port: })"
                                    .into(),
                            ));
                        }
                    }
                    Yaml::String(_) => opts.redis_url = Some(redis_url("redis", &value)?),
                    _ => {
                        return Err(Error::Config(
                            "redis: must be a mapping such as `{ url: redis://host:6379/0 }`"
                                .into(),
                        ));
                    }
                },
                // Sidekiq 6.4 drops it from the file too: strictness follows the weights.
                "strict" => tracing::debug!("sidekiq.yml `strict` ignored, as Sidekiq 6.4 does"),
                _ => tracing::debug!(key = %key, "sidekiq.yml key not used by oxidekiq; ignored"),
            }
        }
        if opts.redis_url.is_some() && env("REDIS_URL").is_some_and(|u| !u.is_empty()) {
            tracing::debug!("sidekiq.yml Redis URL ignored: REDIS_URL is set and wins");
            opts.redis_url = None;
        }
        Ok(opts)
    }

    /// Sets what the file set; everything else keeps its value.
    pub(crate) fn apply_to(self, config: &mut Config) {
        if let Some(c) = self.concurrency {
            config.concurrency = c;
        }
        if let Some(t) = self.timeout {
            config.timeout = t;
        }
        if let Some(q) = self.queues {
            config.queues = q;
        }
        if let Some(t) = self.tag {
            config.tag = Some(t);
        }
        if let Some(l) = self.labels {
            config.labels = l;
        }
        if let Some(v) = self.verbose {
            config.verbose = v;
        }
        if let Some(p) = self.poll_interval_average {
            config.poll_interval_average = p;
        }
        if let Some(u) = self.redis_url {
            config.redis_url = Some(u);
        }
        if let Some(s) = self.sentinel {
            config.sentinel = Some(s);
        }
    }
}

/// `sentinels:` as redis-rb and redis-client take it: a list of `{ host:, port: }` mappings
/// (`password:`/`username:` optional, port 26379 by default), or of `host:port` / `redis://` strings.
fn sentinels(value: &Yaml) -> Result<Vec<crate::sentinel::SentinelNode>, Error> {
    let bad = |why: &str| Error::Config(format!("redis: sentinels: {why}"));
    let Yaml::Array(items) = value else {
        return Err(bad("must be a list such as [{ host: s1, port: 26379 }]"));
    };
    if items.is_empty() {
        return Err(bad("the list is empty"));
    }
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let node = match item {
            Yaml::String(s) => crate::sentinel::SentinelNode::parse(s).map_err(|e| bad(&e))?,
            Yaml::Hash(h) => {
                let mut node = crate::sentinel::SentinelNode {
                    host: String::new(),
                    port: crate::sentinel::DEFAULT_PORT,
                    username: None,
                    password: None,
                };
                for (k, v) in symbolize(h.clone()) {
                    match (k.as_str(), &v) {
                        ("host", _) => node.host = scalar("redis: sentinels: host", &v)?,
                        ("port", Yaml::Integer(p)) => {
                            node.port = u16::try_from(*p)
                                .ok()
                                .filter(|p| *p > 0)
                                .ok_or_else(|| bad("port must be 1 to 65535"))?
                        }
                        ("port", Yaml::String(p)) => {
                            node.port = p
                                .trim()
                                .parse()
                                .ok()
                                .filter(|p| *p > 0)
                                .ok_or_else(|| bad("port must be 1 to 65535"))?
                        }
                        ("port", _) => return Err(bad("port must be 1 to 65535")),
                        ("username", _) => {
                            node.username = Some(scalar("redis: sentinels: username", &v)?)
                        }
                        ("password", _) => {
                            node.password = Some(secret("redis: sentinels: password", &v)?)
                        }
                        _ => tracing::warn!(
                            key = %crate::logging::escape(&k),
                            "sidekiq.yml sentinel key not used by oxidekiq; ignored"
                        ),
                    }
                }
                if node.host.trim().is_empty() {
                    return Err(bad("each entry needs a host"));
                }
                node
            }
            _ => return Err(bad("each entry must be { host:, port: } or \"host:port\"")),
        };
        out.push(node);
    }
    Ok(out)
}

/// A secret from the file: a non-empty string, never echoed in an error.
fn secret(key: &str, value: &Yaml) -> Result<String, Error> {
    match value {
        Yaml::String(s) if !s.is_empty() => Ok(s.clone()),
        _ => Err(Error::Config(format!("{key}: must be a non-empty string"))),
    }
}

/// Psych turns `:name` into a Symbol and `deep_symbolize_keys!` makes `"name"` one too, so both
/// spellings are the same key; the later one wins, as in Ruby's hash.
fn symbolize(hash: yaml_rust2::yaml::Hash) -> Vec<(String, Yaml)> {
    let mut out = Vec::new();
    for (k, v) in hash {
        match ruby_key(&k) {
            Some(k) => upsert(&mut out, k, v),
            None => tracing::debug!(key = ?k, "sidekiq.yml key is not a scalar; ignored"),
        }
    }
    out
}

fn ruby_key(k: &Yaml) -> Option<String> {
    match k {
        Yaml::String(s) => Some(strip_symbol(s).to_string()),
        Yaml::Integer(i) => Some(i.to_string()),
        Yaml::Real(r) => Some(r.clone()),
        Yaml::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

/// An unquoted `:name` is a Ruby Symbol whose `to_s` is `name`.
fn strip_symbol(s: &str) -> &str {
    match s.strip_prefix(':') {
        Some(rest) if !rest.is_empty() => rest,
        _ => s,
    }
}

fn upsert(list: &mut Vec<(String, Yaml)>, key: String, value: Yaml) {
    match list.iter_mut().find(|(k, _)| *k == key) {
        Some(slot) => slot.1 = value,
        None => list.push((key, value)),
    }
}

/// Applies YAML `<<` merge keys, which Psych honours and YAML 1.2 parsers leave as plain keys: the
/// merged mappings' entries are added unless the mapping sets them itself (the first merged mapping
/// wins among several).
fn resolve_merge_keys(node: Yaml) -> Yaml {
    match node {
        Yaml::Array(items) => Yaml::Array(items.into_iter().map(resolve_merge_keys).collect()),
        Yaml::Hash(hash) => {
            let merge_key = Yaml::String("<<".into());
            let mut sources = Vec::new();
            let mut own = yaml_rust2::yaml::Hash::new();
            for (k, v) in hash {
                let v = resolve_merge_keys(v);
                if k == merge_key {
                    match v {
                        Yaml::Hash(h) => sources.push(h),
                        Yaml::Array(list) => {
                            for item in list {
                                if let Yaml::Hash(h) = item {
                                    sources.push(h);
                                }
                            }
                        }
                        _ => {}
                    }
                } else {
                    own.insert(k, v);
                }
            }
            let mut out = yaml_rust2::yaml::Hash::new();
            for source in sources {
                for (k, v) in source {
                    if !own.contains_key(&k) && !out.contains_key(&k) {
                        out.insert(k, v);
                    }
                }
            }
            for (k, v) in own {
                out.insert(k, v);
            }
            Yaml::Hash(out)
        }
        other => other,
    }
}

fn describe(value: &Yaml) -> String {
    match value {
        Yaml::String(s) => format!("`{s}`"),
        Yaml::Integer(i) => i.to_string(),
        Yaml::Real(r) => r.clone(),
        Yaml::Boolean(b) => b.to_string(),
        Yaml::Array(_) => "a list".into(),
        Yaml::Hash(_) => "a mapping".into(),
        _ => "nothing".into(),
    }
}

fn positive_int(key: &str, value: &Yaml) -> Result<usize, Error> {
    let n = match value {
        Yaml::Integer(i) => Some(*i),
        Yaml::String(s) => s.trim().parse::<i64>().ok(),
        _ => None,
    };
    match n.and_then(|n| usize::try_from(n).ok()) {
        Some(n) if n > MAX_CONCURRENCY && key == "concurrency" => Err(Error::Config(format!(
            "{key}: {n} is too large, it must be at most {MAX_CONCURRENCY}"
        ))),
        Some(n) if n >= 1 => Ok(n),
        _ => Err(Error::Config(format!(
            "{key}: {} is not a valid value, it must be a whole number of at least 1",
            describe(value)
        ))),
    }
}

fn seconds(key: &str, value: &Yaml) -> Result<Duration, Error> {
    let n = match value {
        Yaml::Integer(i) => Some(*i as f64),
        Yaml::Real(r) => r.parse::<f64>().ok(),
        Yaml::String(s) => s.trim().parse::<f64>().ok(),
        _ => None,
    };
    n.and_then(positive_duration).ok_or_else(|| {
        Error::Config(format!(
            "{key}: {} is not a valid value, it must be a number of seconds above 0",
            describe(value)
        ))
    })
}

/// A positive, finite number of seconds as a duration.
pub(crate) fn positive_duration(secs: f64) -> Option<Duration> {
    if secs.is_finite() && secs > 0.0 {
        Duration::try_from_secs_f64(secs).ok()
    } else {
        None
    }
}

fn scalar(key: &str, value: &Yaml) -> Result<String, Error> {
    match value {
        Yaml::String(s) => Ok(strip_symbol(s).to_string()),
        Yaml::Integer(i) => Ok(i.to_string()),
        Yaml::Real(r) => Ok(r.clone()),
        Yaml::Boolean(b) => Ok(b.to_string()),
        _ => Err(Error::Config(format!(
            "{key}: {} is not a valid value, it must be a single word or number",
            describe(value)
        ))),
    }
}

fn labels(value: &Yaml) -> Result<Vec<String>, Error> {
    match value {
        Yaml::Array(items) => items.iter().map(|l| scalar("labels", l)).collect(),
        other => Ok(vec![scalar("labels", other)?]),
    }
}

/// `queues:` as `parse_queues` reads it: each item a name or a `[name, weight]` pair. A mapping
/// (`{critical: 2, default: 1}`) iterates as pairs in Ruby, so it is accepted too.
fn queues(value: &Yaml) -> Result<Vec<QueueWeight>, Error> {
    let mut out = Vec::new();
    match value {
        Yaml::Array(items) => {
            for item in items {
                out.push(queue_item(item)?);
            }
        }
        Yaml::Hash(h) => {
            for (k, v) in h {
                out.push(QueueWeight {
                    name: queue_name(k)?,
                    weight: queue_weight(k, v)?,
                });
            }
        }
        other => {
            return Err(Error::Config(format!(
                "queues: {} is not a valid value, it must be a list such as [critical, [default, 2]]",
                describe(other)
            )));
        }
    }
    check_queue_list(&out).map_err(|e| match e {
        Error::Config(m) => Error::Config(format!("queues: {m}")),
        other => other,
    })?;
    normalize_weights(&mut out);
    Ok(out)
}

fn queue_item(item: &Yaml) -> Result<QueueWeight, Error> {
    match item {
        Yaml::Array(pair) => match pair.as_slice() {
            [name] => Ok(QueueWeight {
                name: queue_name(name)?,
                weight: 0,
            }),
            [name, weight] => Ok(QueueWeight {
                name: queue_name(name)?,
                weight: queue_weight(name, weight)?,
            }),
            _ => Err(Error::Config(format!(
                "queues: an item with {} elements; write a queue as `name` or `[name, weight]`",
                pair.len()
            ))),
        },
        Yaml::Hash(_) => Err(Error::Config(
            "queues: write a weighted queue as `[critical, 2]`, not `critical: 2`".into(),
        )),
        other => Ok(QueueWeight {
            name: queue_name(other)?,
            weight: 0,
        }),
    }
}

fn queue_name(value: &Yaml) -> Result<String, Error> {
    let name = match value {
        Yaml::String(s) => strip_symbol(s).trim().to_string(),
        Yaml::Integer(i) => i.to_string(),
        Yaml::Real(r) => r.clone(),
        _ => String::new(),
    };
    if name.is_empty() {
        return Err(Error::Config(format!(
            "queues: {} is not a queue name",
            describe(value)
        )));
    }
    Ok(name)
}

fn queue_weight(name: &Yaml, value: &Yaml) -> Result<u32, Error> {
    let w = match value {
        Yaml::Null => Some(0),
        Yaml::Integer(i) => u32::try_from(*i).ok(),
        Yaml::String(s) => s.trim().parse::<u32>().ok(),
        _ => None,
    };
    match w {
        Some(w) if w > MAX_QUEUE_WEIGHT => Err(Error::Config(format!(
            "queues: weight {w} of queue {} is too large, it must be at most {MAX_QUEUE_WEIGHT}",
            describe(name)
        ))),
        Some(w) => Ok(w),
        None => Err(Error::Config(format!(
            "queues: weight {} of queue {} is not a whole number of 0 or more",
            describe(value),
            describe(name)
        ))),
    }
}

/// A Redis URL from the file: a string (never echoed in an error: it may hold a password).
fn redis_url(key: &str, value: &Yaml) -> Result<String, Error> {
    match value {
        Yaml::String(s) if !s.trim().is_empty() => Ok(s.trim().to_string()),
        _ => Err(Error::Config(format!(
            "{key}: must be a Redis URL such as redis://host:6379/0"
        ))),
    }
}

/// Reads a config file of at most [`MAX_CONFIG_FILE_BYTES`], without reading more than that.
fn read_bounded(path: &Path) -> Result<String, Error> {
    use std::io::Read as _;
    let cannot = |e: std::io::Error| Error::Config(format!("cannot read {}: {e}", path.display()));
    let file = std::fs::File::open(path).map_err(cannot)?;
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_FILE_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(cannot)?;
    if bytes.len() > MAX_CONFIG_FILE_BYTES {
        let len = std::fs::metadata(path).map_or(bytes.len(), |m| {
            usize::try_from(m.len()).unwrap_or(usize::MAX)
        });
        return Err(Error::Config(format!(
            "{}: {}",
            path.display(),
            too_large(len)
        )));
    }
    String::from_utf8(bytes).map_err(|_| {
        Error::Config(format!(
            "cannot read {}: the file is not UTF-8 text",
            path.display()
        ))
    })
}

fn size_in_bytes(n: usize) -> String {
    if n > MAX_CONFIG_FILE_BYTES {
        format!("the file is over {MAX_CONFIG_FILE_BYTES} bytes ({n} bytes)")
    } else {
        format!("the file is {n} bytes")
    }
}

fn too_large(len: usize) -> Error {
    Error::Config(format!(
        "{}; a config file may be at most {MAX_CONFIG_FILE_BYTES} bytes",
        size_in_bytes(len)
    ))
}

/// Counts what the YAML holds once anchors and aliases are expanded, and how deep it nests, on the
/// parser's events, before any tree is built: past [`MAX_YAML_NODES`] or [`MAX_YAML_DEPTH`] it is an
/// error, so an alias bomb fails after one linear pass over the text instead of expanding.
fn check_yaml_budget(text: &str) -> Result<(), Error> {
    use yaml_rust2::Event;
    let mut parser = yaml_rust2::parser::Parser::new_from_str(text);
    // Expanded size of each anchored node, by anchor id.
    let mut anchored: HashMap<usize, u64> = HashMap::new();
    // Open lists and mappings: (anchor id, expanded size so far, itself included).
    let mut open: Vec<(usize, u64)> = Vec::new();
    let mut total: u64 = 0;
    loop {
        let (event, _) = parser
            .next_token()
            .map_err(|e| Error::Config(format!("invalid YAML: {e}")))?;
        let size = match event {
            Event::StreamEnd => return Ok(()),
            Event::Scalar(_, _, anchor, _) => {
                if anchor > 0 {
                    anchored.insert(anchor, 1);
                }
                1
            }
            // An alias of an unknown anchor is the loader's error to report.
            Event::Alias(anchor) => anchored.get(&anchor).copied().unwrap_or(1),
            Event::SequenceStart(anchor, _) | Event::MappingStart(anchor, _) => {
                if open.len() >= MAX_YAML_DEPTH {
                    return Err(Error::Config(format!(
                        "the YAML nests lists and mappings more than {MAX_YAML_DEPTH} levels deep"
                    )));
                }
                open.push((anchor, 1));
                total = total.saturating_add(1);
                check_total(total)?;
                continue;
            }
            Event::SequenceEnd | Event::MappingEnd => {
                let Some((anchor, size)) = open.pop() else {
                    continue;
                };
                if anchor > 0 {
                    anchored.insert(anchor, size);
                }
                if let Some(parent) = open.last_mut() {
                    parent.1 = parent.1.saturating_add(size);
                }
                continue;
            }
            _ => continue,
        };
        total = total.saturating_add(size);
        check_total(total)?;
        if let Some(parent) = open.last_mut() {
            parent.1 = parent.1.saturating_add(size);
        }
    }
}

fn check_total(total: u64) -> Result<(), Error> {
    if total > MAX_YAML_NODES {
        return Err(Error::Config(format!(
            "the YAML holds more than {MAX_YAML_NODES} values once its aliases (`*name`) are \
             expanded; a config file this large is refused (an alias bomb?)"
        )));
    }
    Ok(())
}

/// Hides, in a config error, every value ERB read from the environment (and every word of 4 or more
/// characters in it, since YAML may show a part of a value): a variable may hold a secret, and a
/// value in the wrong place (`concurrency: <%= ENV["REDIS_URL"] %>`) must not print it. Shorter
/// values (`5`, `25`) stay, so a wrong number is still shown.
fn hide_env_values(e: Error, from_env: &[String]) -> Error {
    let Error::Config(mut message) = e else {
        return e;
    };
    let mut hidden: Vec<&str> = Vec::new();
    for value in from_env {
        hidden.push(value.as_str());
        hidden.extend(value.split(|c: char| c.is_whitespace() || ",[]{}#:\"'`&*!|>%@".contains(c)));
    }
    hidden.retain(|v| v.trim().chars().count() >= 4);
    hidden.sort_by_key(|v| std::cmp::Reverse(v.len()));
    for v in hidden {
        message = message.replace(v, "(value from ENV)");
    }
    Error::Config(message)
}

/// The ERB subset of a `sidekiq.yml`: `<%= %>` tags whose Ruby is an environment lookup.
///
/// Expressions are parsed into a tree first and evaluated after, so `ENV["A"] || ENV.fetch("B")`
/// short-circuits as Ruby does and never complains about `B` when `A` is set. Messages name variables,
/// never their values, which may be secrets.
mod erb {
    /// A Ruby value the subset can produce.
    #[derive(Debug, Clone, PartialEq)]
    enum Val {
        Str(String),
        Int(i64),
        Float(f64),
        /// `nil`; `Some(name)` when it is the value of an unset `ENV[name]`, so using it can say which.
        Nil(Option<String>),
    }

    /// A method call the subset knows.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Method {
        ToI,
        ToF,
        ToS,
    }

    #[derive(Debug, Clone, PartialEq)]
    enum Expr {
        Lit(Val),
        /// `ENV["X"]`: `nil` when unset.
        Env(String),
        /// `ENV.fetch("X", default)` or `ENV.fetch("X") { default }`: an error when unset without one.
        Fetch(String, Option<Box<Expr>>),
        Or(Box<Expr>, Box<Expr>),
        Call(Box<Expr>, Method),
    }

    type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

    /// Renders the template; errors start with `line N:`.
    pub(super) fn render(text: &str, env: Env<'_>) -> Result<String, String> {
        render_collecting(text, env, &mut Vec::new())
    }

    /// [`render`], pushing every value a tag printed onto `printed` (to keep them out of errors).
    pub(super) fn render_collecting(
        text: &str,
        env: Env<'_>,
        printed: &mut Vec<String>,
    ) -> Result<String, String> {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        let mut line = 1usize;
        while let Some(start) = rest.find("<%") {
            let before = &rest[..start];
            out.push_str(before);
            line += before.matches('\n').count();
            let after = &rest[start + 2..];
            // `<%%` is ERB's escape for a literal `<%`.
            if let Some(r) = after.strip_prefix('%') {
                out.push_str("<%");
                rest = r;
                continue;
            }
            let Some(end) = after.find("%>") else {
                return Err(format!(
                    "line {line}: ERB tag opened here is never closed with %>"
                ));
            };
            let inner = &after[..end];
            let tag_line = line;
            line += inner.matches('\n').count();
            rest = &after[end + 2..];
            if inner.starts_with('#') {
                continue; // an ERB comment
            }
            let Some(code) = inner.strip_prefix('=') else {
                return Err(format!(
                    "line {tag_line}: unsupported ERB tag `<%{}%>`: only `<%= ENV[...] %>` lookups are evaluated",
                    shorten(inner)
                ));
            };
            let value = parse(code)
                .and_then(|e| eval(&e, env))
                .and_then(output)
                .map_err(|m| format!("line {tag_line}: {m} in `<%={}%>`", shorten(code)))?;
            out.push_str(&value);
            printed.push(value);
        }
        out.push_str(rest);
        Ok(out)
    }

    fn shorten(s: &str) -> String {
        let s = s.trim_end();
        if s.chars().count() > 60 {
            let cut: String = s.chars().take(57).collect();
            format!("{cut}...")
        } else {
            s.to_string()
        }
    }

    fn unset(name: &str) -> String {
        format!(
            "environment variable {name} is not set and has no default (ENV.fetch(\"{name}\", default) gives one)"
        )
    }

    /// What `<%= %>` prints: `to_s` of the value.
    fn output(v: Val) -> Result<String, String> {
        match call(v, Method::ToS)? {
            Val::Str(s) => Ok(s),
            _ => Ok(String::new()),
        }
    }

    fn eval(e: &Expr, env: Env<'_>) -> Result<Val, String> {
        match e {
            Expr::Lit(v) => Ok(v.clone()),
            Expr::Env(name) => Ok(match env(name) {
                Some(v) => Val::Str(v),
                None => Val::Nil(Some(name.clone())),
            }),
            Expr::Fetch(name, default) => match (env(name), default) {
                (Some(v), _) => Ok(Val::Str(v)),
                (None, Some(d)) => eval(d, env),
                (None, None) => Err(format!(
                    "environment variable {name} is not set (ENV.fetch without a default)"
                )),
            },
            Expr::Or(a, b) => match eval(a, env)? {
                Val::Nil(_) => eval(b, env),
                v => Ok(v),
            },
            Expr::Call(target, m) => call(eval(target, env)?, *m),
        }
    }

    fn call(v: Val, m: Method) -> Result<Val, String> {
        if let Val::Nil(Some(name)) = &v {
            return Err(unset(name));
        }
        Ok(match (m, v) {
            (Method::ToI, Val::Str(s)) => Val::Int(ruby_to_i(&s)?),
            (Method::ToI, Val::Int(i)) => Val::Int(i),
            (Method::ToI, Val::Float(f)) => {
                if !f.is_finite() || f.abs() >= 9.2e18 {
                    return Err(format!("{f} cannot be turned into an integer"));
                }
                Val::Int(f.trunc() as i64)
            }
            (Method::ToI, Val::Nil(_)) => Val::Int(0),
            (Method::ToF, Val::Str(s)) => Val::Float(ruby_to_f(&s)),
            (Method::ToF, Val::Int(i)) => Val::Float(i as f64),
            (Method::ToF, Val::Float(f)) => Val::Float(f),
            (Method::ToF, Val::Nil(_)) => Val::Float(0.0),
            (Method::ToS, Val::Str(s)) => Val::Str(s),
            (Method::ToS, Val::Int(i)) => Val::Str(i.to_string()),
            (Method::ToS, Val::Float(f)) => Val::Str(ruby_float(f)),
            (Method::ToS, Val::Nil(_)) => Val::Str(String::new()),
        })
    }

    /// Ruby's `String#to_i`: leading blanks, a sign, digits (single `_` between them); else 0.
    fn ruby_to_i(s: &str) -> Result<i64, String> {
        let t = s.trim_start();
        let (neg, t) = match t.as_bytes().first() {
            Some(b'-') => (true, &t[1..]),
            Some(b'+') => (false, &t[1..]),
            _ => (false, t),
        };
        let mut digits = String::new();
        let mut prev_digit = false;
        for c in t.chars() {
            if c.is_ascii_digit() {
                digits.push(c);
                prev_digit = true;
            } else if c == '_' && prev_digit {
                prev_digit = false;
            } else {
                break;
            }
        }
        if digits.is_empty() {
            return Ok(0);
        }
        let n: i64 = digits
            .parse()
            .map_err(|_| "a number too large for an integer".to_string())?;
        Ok(if neg { -n } else { n })
    }

    /// Ruby's `String#to_f`: the longest leading decimal number, else 0.0.
    fn ruby_to_f(s: &str) -> f64 {
        let t = s.trim_start().as_bytes();
        let mut end = 0;
        if matches!(t.first(), Some(b'-' | b'+')) {
            end = 1;
        }
        let int_start = end;
        while t.get(end).is_some_and(u8::is_ascii_digit) {
            end += 1;
        }
        if end == int_start {
            return 0.0;
        }
        if t.get(end) == Some(&b'.') && t.get(end + 1).is_some_and(u8::is_ascii_digit) {
            end += 1;
            while t.get(end).is_some_and(u8::is_ascii_digit) {
                end += 1;
            }
        }
        if matches!(t.get(end), Some(b'e' | b'E')) {
            let mut e = end + 1;
            if matches!(t.get(e), Some(b'-' | b'+')) {
                e += 1;
            }
            if t.get(e).is_some_and(u8::is_ascii_digit) {
                while t.get(e).is_some_and(u8::is_ascii_digit) {
                    e += 1;
                }
                end = e;
            }
        }
        std::str::from_utf8(&t[..end])
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(0.0)
    }

    /// Ruby's `Float#to_s` for ordinary values: `5.0`, `2.5`.
    fn ruby_float(f: f64) -> String {
        if f.is_nan() {
            "NaN".into()
        } else if f.is_infinite() {
            if f > 0.0 {
                "Infinity".into()
            } else {
                "-Infinity".into()
            }
        } else if f == f.trunc() && f.abs() < 1e16 {
            format!("{f:.1}")
        } else {
            format!("{f}")
        }
    }

    fn parse(code: &str) -> Result<Expr, String> {
        let mut p = Parser { s: code, pos: 0 };
        let e = p.or_expr()?;
        p.ws();
        if p.pos < p.s.len() {
            return Err(format!("unexpected `{}`", p.s[p.pos..].trim()));
        }
        Ok(e)
    }

    const SUPPORTED: &str = "only ENV[\"NAME\"], ENV.fetch(\"NAME\", default), literals, `||` and .to_i/.to_f/.to_s are evaluated";

    struct Parser<'a> {
        s: &'a str,
        pos: usize,
    }

    impl Parser<'_> {
        fn rest(&self) -> &str {
            &self.s[self.pos..]
        }

        fn ws(&mut self) {
            while self.rest().starts_with(|c: char| c.is_ascii_whitespace()) {
                self.pos += 1;
            }
        }

        fn eat(&mut self, token: &str) -> bool {
            self.ws();
            if self.rest().starts_with(token) {
                self.pos += token.len();
                true
            } else {
                false
            }
        }

        fn expect(&mut self, token: &str) -> Result<(), String> {
            if self.eat(token) {
                Ok(())
            } else {
                Err(format!("expected `{token}`"))
            }
        }

        fn ident(&mut self) -> &str {
            self.ws();
            let start = self.pos;
            while self.rest().starts_with(|c: char| {
                c.is_ascii_alphanumeric() || c == '_' || c == '?' || c == '!'
            }) {
                self.pos += 1;
            }
            &self.s[start..self.pos]
        }

        fn or_expr(&mut self) -> Result<Expr, String> {
            let mut left = self.postfix()?;
            while self.eat("||") {
                let right = self.postfix()?;
                left = Expr::Or(Box::new(left), Box::new(right));
            }
            Ok(left)
        }

        fn postfix(&mut self) -> Result<Expr, String> {
            let mut e = self.primary()?;
            while self.eat(".") {
                let m = match self.ident() {
                    "to_i" => Method::ToI,
                    "to_f" => Method::ToF,
                    "to_s" => Method::ToS,
                    other => return Err(format!("unsupported method `.{other}`: {SUPPORTED}")),
                };
                if self.eat("(") {
                    self.expect(")")?;
                }
                e = Expr::Call(Box::new(e), m);
            }
            Ok(e)
        }

        fn primary(&mut self) -> Result<Expr, String> {
            self.ws();
            if self.eat("(") {
                let e = self.or_expr()?;
                self.expect(")")?;
                return Ok(e);
            }
            let rest = self.rest();
            if rest.starts_with('"') || rest.starts_with('\'') {
                return Ok(Expr::Lit(Val::Str(self.string()?)));
            }
            if rest.starts_with(|c: char| c.is_ascii_digit())
                || (rest.starts_with('-') && rest[1..].starts_with(|c: char| c.is_ascii_digit()))
            {
                return self.number();
            }
            let word = self.ident().to_string();
            match word.as_str() {
                "nil" => Ok(Expr::Lit(Val::Nil(None))),
                "ENV" => self.env(),
                "" => Err(format!("unsupported expression: {SUPPORTED}")),
                other => Err(format!("unsupported expression `{other}`: {SUPPORTED}")),
            }
        }

        /// After `ENV`: `["X"]` or `.fetch("X"[, default]) [{ default }]`.
        fn env(&mut self) -> Result<Expr, String> {
            if self.eat("[") {
                let name = self.string()?;
                self.expect("]")?;
                return Ok(Expr::Env(name));
            }
            let at = self.pos;
            if self.eat(".") && self.ident() == "fetch" {
                self.expect("(")?;
                let name = self.string()?;
                let mut default = None;
                if self.eat(",") {
                    default = Some(Box::new(self.or_expr()?));
                }
                self.expect(")")?;
                // A block supersedes the default argument in Ruby.
                if self.eat("{") {
                    if self.rest().trim_start().starts_with('|') {
                        return Err(format!("block parameters are not supported: {SUPPORTED}"));
                    }
                    default = Some(Box::new(self.or_expr()?));
                    self.expect("}")?;
                }
                return Ok(Expr::Fetch(name, default));
            }
            self.pos = at;
            Err(format!("unsupported use of ENV: {SUPPORTED}"))
        }

        fn string(&mut self) -> Result<String, String> {
            self.ws();
            let quote = match self.rest().chars().next() {
                Some(q @ ('"' | '\'')) => q,
                _ => return Err("expected a quoted string".into()),
            };
            self.pos += 1;
            let mut out = String::new();
            let mut chars = self.rest().char_indices();
            while let Some((i, c)) = chars.next() {
                match c {
                    c if c == quote => {
                        self.pos += i + 1;
                        return Ok(out);
                    }
                    '\\' => {
                        let Some((_, next)) = chars.next() else { break };
                        match (quote, next) {
                            ('\'', '\'' | '\\') => out.push(next),
                            ('\'', other) => {
                                out.push('\\');
                                out.push(other);
                            }
                            ('"', 'n') => out.push('\n'),
                            ('"', 't') => out.push('\t'),
                            ('"', 'r') => out.push('\r'),
                            ('"', 's') => out.push(' '),
                            ('"', '0') => out.push('\0'),
                            (_, other) => out.push(other),
                        }
                    }
                    '#' if quote == '"' && self.s[self.pos + i..].starts_with("#{") => {
                        return Err("string interpolation is not supported".into());
                    }
                    c => out.push(c),
                }
            }
            Err("a string is never closed".into())
        }

        fn number(&mut self) -> Result<Expr, String> {
            let start = self.pos;
            let b = self.s.as_bytes();
            let mut end = self.pos;
            if b.get(end) == Some(&b'-') {
                end += 1;
            }
            while b.get(end).is_some_and(|c| c.is_ascii_digit() || *c == b'_') {
                end += 1;
            }
            let mut float = false;
            if b.get(end) == Some(&b'.') && b.get(end + 1).is_some_and(u8::is_ascii_digit) {
                float = true;
                end += 1;
                while b.get(end).is_some_and(|c| c.is_ascii_digit() || *c == b'_') {
                    end += 1;
                }
            }
            if matches!(b.get(end), Some(b'e' | b'E')) {
                float = true;
                end += 1;
                if matches!(b.get(end), Some(b'-' | b'+')) {
                    end += 1;
                }
                while b.get(end).is_some_and(u8::is_ascii_digit) {
                    end += 1;
                }
            }
            self.pos = end;
            let text: String = self.s[start..end].chars().filter(|c| *c != '_').collect();
            if float {
                text.parse::<f64>()
                    .map(|f| Expr::Lit(Val::Float(f)))
                    .map_err(|_| format!("bad number `{text}`"))
            } else {
                text.parse::<i64>()
                    .map(|i| Expr::Lit(Val::Int(i)))
                    .map_err(|_| format!("bad number `{text}`"))
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use std::collections::HashMap;

        use super::*;

        fn with(vars: &[(&str, &str)], text: &str) -> Result<String, String> {
            let map: HashMap<String, String> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            render(text, &move |k| map.get(k).cloned())
        }

        #[test]
        fn every_supported_lookup_form_reads_the_environment() {
            let v = [("X", "7")];
            for code in [
                r#"ENV["X"]"#,
                "ENV['X']",
                r#"ENV.fetch("X", 5)"#,
                r#"ENV.fetch("X") { 5 }"#,
                r#"ENV["X"] || 5"#,
                r#"ENV["X"].to_i"#,
                r#"ENV.fetch("X", "3").to_i"#,
                r#"(ENV["X"] || 5).to_i"#,
            ] {
                assert_eq!(
                    with(&v, &format!("c: <%= {code} %>")).unwrap(),
                    "c: 7",
                    "{code}"
                );
            }
        }

        #[test]
        fn defaults_apply_when_the_variable_is_unset() {
            assert_eq!(with(&[], r#"<%= ENV.fetch("X", 5) %>"#).unwrap(), "5");
            assert_eq!(with(&[], r#"<%= ENV.fetch("X") { 6 } %>"#).unwrap(), "6");
            assert_eq!(with(&[], r#"<%= ENV.fetch("X", "str") %>"#).unwrap(), "str");
            assert_eq!(with(&[], r#"<%= ENV["X"] || 5 %>"#).unwrap(), "5");
            assert_eq!(
                with(&[], r#"<%= ENV["X"] || ENV["Y"] || 'z' %>"#).unwrap(),
                "z"
            );
            assert_eq!(with(&[], r#"<%= ENV.fetch("X", 2.5) %>"#).unwrap(), "2.5");
            assert_eq!(
                with(&[], r#"<%= ENV.fetch("X", "2.0").to_f %>"#).unwrap(),
                "2.0"
            );
        }

        #[test]
        fn or_short_circuits_so_an_unneeded_fetch_is_not_an_error() {
            assert_eq!(
                with(&[("A", "a")], r#"<%= ENV["A"] || ENV.fetch("B") %>"#).unwrap(),
                "a"
            );
        }

        #[test]
        fn to_i_reads_a_leading_integer_like_ruby() {
            assert_eq!(
                with(&[("X", " 12abc")], r#"<%= ENV["X"].to_i %>"#).unwrap(),
                "12"
            );
            assert_eq!(
                with(&[("X", "abc")], r#"<%= ENV["X"].to_i %>"#).unwrap(),
                "0"
            );
            assert_eq!(
                with(&[("X", "-1_000")], r#"<%= ENV["X"].to_i %>"#).unwrap(),
                "-1000"
            );
        }

        #[test]
        fn an_unset_variable_without_default_is_an_error_naming_it_and_its_line() {
            for code in [
                r#"ENV["MISSING_X"]"#,
                r#"ENV.fetch("MISSING_X")"#,
                r#"ENV["MISSING_X"].to_i"#,
            ] {
                let e = with(&[], &format!("a: 1\nb: <%= {code} %>\n")).unwrap_err();
                assert!(e.starts_with("line 2:"), "{e}");
                assert!(e.contains("MISSING_X"), "{e}");
            }
        }

        #[test]
        fn other_ruby_is_an_error_naming_its_line() {
            for tag in [
                "<%= Rails.env %>",
                "<% if true %>",
                "<%= ENV.keys %>",
                "<%= `id` %>",
                "<%= 1 + 1 %>",
            ] {
                let e = with(&[], &format!("a: 1\n\nb: {tag}\n")).unwrap_err();
                assert!(e.starts_with("line 3:"), "{tag}: {e}");
            }
        }

        #[test]
        fn comments_and_escapes_are_plain_erb() {
            assert_eq!(with(&[], "a<%# note %>b <%% c").unwrap(), "ab <% c");
        }

        #[test]
        fn an_unclosed_tag_is_an_error() {
            assert!(
                with(&[], "\n<%= ENV['X']")
                    .unwrap_err()
                    .starts_with("line 2:")
            );
        }

        #[test]
        fn errors_never_contain_variable_values() {
            let e = with(&[("S", "hunter2")], r#"<%= ENV["S"].upcase %>"#).unwrap_err();
            assert!(!e.contains("hunter2"), "{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    fn q(name: &str, weight: u32) -> QueueWeight {
        QueueWeight {
            name: name.into(),
            weight,
        }
    }

    #[test]
    fn a_queue_without_weight_counts_as_one_once_another_has_a_weight() {
        let mut c = Config::default();
        c.apply_yaml_with_env(
            ":queues:\n  - [critical, 2]\n  - default\n",
            Some("x"),
            &env_of(&[]),
        )
        .unwrap();
        assert_eq!(c.queues, vec![q("critical", 2), q("default", 1)]);
        assert!(!c.strict_queues());
    }

    #[test]
    fn queues_without_weights_stay_strict() {
        let mut c = Config::default();
        c.apply_yaml_with_env("queues: [a, b, [c]]", Some("x"), &env_of(&[]))
            .unwrap();
        assert_eq!(c.queues, vec![q("a", 0), q("b", 0), q("c", 0)]);
        assert!(c.strict_queues());
    }

    #[test]
    fn a_queue_listed_twice_is_an_error() {
        let e = Config::default()
            .apply_yaml_with_env("queues: [a, [a, 2]]", Some("x"), &env_of(&[]))
            .unwrap_err();
        assert!(e.to_string().contains("a cannot be defined twice"), "{e}");
    }

    #[test]
    fn merge_keys_and_aliases_work_as_in_psych() {
        let text =
            "base: &base\n  concurrency: 3\n  timeout: 8\nproduction:\n  <<: *base\n  timeout: 9\n";
        let mut c = Config::default();
        c.apply_yaml_with_env(text, Some("production"), &env_of(&[]))
            .unwrap();
        assert_eq!(c.concurrency, 3);
        assert_eq!(c.timeout, Duration::from_secs(9));
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
    fn an_alias_bomb_is_refused_before_it_expands_and_ordinary_aliases_pass() {
        let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for (prev, name) in ["a", "b", "c", "d", "e", "f", "g", "h"]
            .iter()
            .zip(["b", "c", "d", "e", "f", "g", "h", "i"])
        {
            bomb.push_str(&format!(
                "{name}: &{name} [{}]\n",
                vec![format!("*{prev}"); 10].join(", ")
            ));
        }
        let e = Config::default()
            .apply_yaml_with_env(&bomb, Some("x"), &env_of(&[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("aliases"), "{e}");
        let ok = "default: &default\n  concurrency: 3\nproduction:\n  <<: *default\nstaging:\n  <<: *default\n";
        let mut c = Config::default();
        c.apply_yaml_with_env(ok, Some("staging"), &env_of(&[]))
            .unwrap();
        assert_eq!(c.concurrency, 3);
    }

    #[test]
    fn erb_values_never_appear_in_an_error() {
        let secret = "redis://app:hunter2-pw@h:1/0";
        for text in [
            "concurrency: <%= ENV['U'] %>\n",
            "timeout: <%= ENV['U'] %>\n",
            "queues: [[a, <%= ENV['U'] %>]]\n",
            "concurrency: x <%= ENV['U'] %> #y\n",
            "verbose: <%= ENV['U'] %>\n",
        ] {
            let e = Config::default()
                .apply_yaml_with_env(text, Some("x"), &env_of(&[("U", secret)]))
                .unwrap_err()
                .to_string();
            assert!(!e.contains("hunter2"), "{text}: {e}");
        }
        // A short value (a number) is still shown.
        let e = Config::default()
            .apply_yaml_with_env(
                "concurrency: <%= ENV['N'] %>\n",
                Some("x"),
                &env_of(&[("N", "0")]),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("concurrency: 0 is not"), "{e}");
    }

    #[test]
    fn sentinels_are_read_in_the_forms_sidekiq_users_write() {
        for text in [
            ":redis:\n  :url: redis://mymaster\n  :sentinels:\n    - { :host: s1, :port: 26380 }\n    - { host: s2 }\n  :role: master\n",
            "redis:\n  name: mymaster\n  sentinels: [\"s1:26380\", \"redis://s2\"]\n",
        ] {
            let mut c = Config::default();
            c.apply_yaml_with_env(text, Some("x"), &env_of(&[]))
                .unwrap();
            let s = c.sentinel.clone().unwrap_or_else(|| panic!("{text}"));
            assert_eq!(
                s.sentinels
                    .iter()
                    .map(|n| (n.host.as_str(), n.port))
                    .collect::<Vec<_>>(),
                vec![("s1", 26380), ("s2", 26379)],
                "{text}"
            );
            if text.contains("name:") {
                assert_eq!(s.master.as_deref(), Some("mymaster"));
            } else {
                assert_eq!(c.redis_url.as_deref(), Some("redis://mymaster"));
            }
        }
        for bad in [
            "redis: { sentinels: [{ host: s1 }], role: replica }\n",
            "redis: { sentinels: [] }\n",
            "redis: { sentinels: [{ port: 1 }] }\n",
            "redis: { name: mymaster }\n",
        ] {
            let mut c = Config::default();
            assert!(
                c.apply_yaml_with_env(bad, Some("x"), &env_of(&[])).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_redis_url_comes_from_the_file_unless_redis_url_is_set() {
        for text in [
            ":redis:\n  :url: redis://h:1/2\n",
            "redis: { url: 'redis://h:1/2' }\n",
            "redis_url: redis://h:1/2\n",
        ] {
            let mut c = Config::default();
            c.apply_yaml_with_env(text, Some("x"), &env_of(&[]))
                .unwrap();
            assert_eq!(c.redis_url.as_deref(), Some("redis://h:1/2"), "{text}");
            let mut c = Config::default();
            c.apply_yaml_with_env(text, Some("x"), &env_of(&[("REDIS_URL", "redis://e:3")]))
                .unwrap();
            assert_eq!(c.redis_url, None, "{text}");
        }
    }

    #[test]
    fn weights_and_concurrency_past_their_bounds_are_refused() {
        for text in [
            "concurrency: 10001\n",
            "queues: [[a, 1001]]\n",
            "queues: {a: 4294967295}\n",
            "timeout: 86401\n",
        ] {
            let mut c = Config::default();
            let e = c
                .apply_yaml_with_env(text, Some("x"), &env_of(&[]))
                .and_then(|()| c.validate())
                .unwrap_err()
                .to_string();
            assert!(e.contains("at most"), "{text}: {e}");
        }
        let mut c = Config::default();
        c.apply_yaml_with_env(
            "concurrency: 10000\nqueues: [[a, 1000], b]\ntimeout: 86400\n",
            Some("x"),
            &env_of(&[]),
        )
        .unwrap();
        c.validate().unwrap();
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
