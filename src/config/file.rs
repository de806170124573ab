//! The `sidekiq.yml` loader, read the way Sidekiq 6.4 reads it (`cli.rb@v6.4.1 parse_config`): ERB,
//! YAML with Psych's anchors and merge keys, the environment's section over the top level, then the
//! known keys (see the [`crate::config`] docs for the whole list and the limits).

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use yaml_rust2::{Yaml, YamlLoader};

use super::erb;
use super::settings::{
    Capsule, Config, MAX_CONCURRENCY, MAX_CONFIG_FILE_BYTES, MAX_QUEUE_WEIGHT, MAX_YAML_DEPTH,
    MAX_YAML_NODES, QueueWeight, check_queue_list, positive_duration, process_env,
    sidekiq_environment,
};
use crate::error::Error;

impl Config {
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
    /// `capsules`: the named capsules, each's queues checked and weight-normalized.
    pub(crate) capsules: Option<Vec<Capsule>>,
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
    /// sidekiq-cron's `cron_poll_interval`, seconds; 0 turns the poller off, as in the gem.
    pub(crate) cron_poll_interval: Option<Duration>,
    /// sidekiq-cron's `cron_schedule_file`.
    pub(crate) cron_schedule_file: Option<std::path::PathBuf>,
    /// `:schedule:` (top level or under `:scheduler:`): schedules declared in the file.
    pub(crate) cron_jobs: Option<Vec<super::CronJob>>,
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
                "capsules" => opts.capsules = Some(capsules(&value)?),
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
                                _ => crate::logging::warn_early(format!(
                                    "sidekiq.yml `redis:` key `{}` not used by oxidekiq (give the \
                                     password, database and TLS in the URL); ignored",
                                    crate::logging::escape(&k)
                                )),
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
                "cron_poll_interval" => {
                    opts.cron_poll_interval = Some(match value {
                        Yaml::Integer(0) => Duration::ZERO,
                        _ => seconds(&key, &value)?,
                    })
                }
                "cron_schedule_file" => {
                    opts.cron_schedule_file = Some(scalar(&key, &value)?.into());
                }
                "schedule" => opts.cron_jobs = Some(cron_schedule(&value)),
                "scheduler" => {
                    if let Yaml::Hash(h) = value {
                        for (k, v) in symbolize(h) {
                            if k == "schedule" {
                                opts.cron_jobs = Some(cron_schedule(&v));
                            } else {
                                crate::logging::warn_early(format!(
                                    "sidekiq.yml `scheduler:` key `{}` not used by oxidekiq (only \
                                     `schedule:` is read, for sidekiq-cron); ignored",
                                    crate::logging::escape(&k)
                                ));
                            }
                        }
                    }
                }
                // Sidekiq drops it from the file too: strictness follows the weights.
                "strict" => crate::logging::warn_early(
                    "sidekiq.yml `strict` ignored, as Sidekiq does: the queue order is strict when \
                     no queue has a weight, else weighted"
                        .to_string(),
                ),
                k if RUBY_ONLY_KEYS.contains(&k) => {
                    tracing::debug!(key = %key, "sidekiq.yml key only Ruby uses; ignored")
                }
                // An unknown key holding a mapping is another environment's section (`staging:`
                // beside `production:`): Sidekiq reads it only when running as that environment, and
                // passes over it without a word otherwise, as we do.
                _ if matches!(value, Yaml::Hash(_)) => tracing::debug!(
                    key = %key,
                    "sidekiq.yml section of another environment; ignored"
                ),
                _ => crate::logging::warn_early(format!(
                    "sidekiq.yml key `{}` not used by oxidekiq; ignored (docs/configuration.md lists \
                     the keys it reads)",
                    crate::logging::escape(&key)
                )),
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
        if let Some(c) = self.capsules {
            config.capsules = c;
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
        if let Some(p) = self.cron_poll_interval {
            if p.is_zero() {
                config.cron.enabled = false;
            } else {
                config.cron.poll_interval = p;
            }
        }
        if let Some(f) = self.cron_schedule_file {
            config.cron.schedule_file = f;
        }
        if let Some(jobs) = self.cron_jobs {
            config.cron.sidekiq_yml_jobs = jobs;
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
                        _ => crate::logging::warn_early(format!(
                            "sidekiq.yml sentinel key `{}` not used by oxidekiq; ignored",
                            crate::logging::escape(&k)
                        )),
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
/// A `:schedule:` section: the schedules of [`super::cron::schedules_from_yaml`]. An entry that is not a
/// sidekiq-cron schedule (sidekiq-scheduler's `every:`/`at:`/`in:` forms share the section) is left
/// out with a warning naming it, not an error that would stop the process.
fn cron_schedule(value: &Yaml) -> Vec<super::CronJob> {
    let (jobs, errors) = super::cron::schedules_from_yaml(value);
    for e in errors {
        tracing::warn!(
            "sidekiq.yml schedule entry not run by oxidekiq: {}",
            crate::logging::escape(&e)
        );
    }
    jobs
}

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
        // A value in the wrong place may be a Redis URL with its password: redacted. Not cut or
        // escaped here: `hide_env_values` must still find every value ERB read in the message.
        Yaml::String(s) => format!("`{}`", crate::redact::redact_urls_in(s)),
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

/// The keys of a `sidekiq.yml` that only a Ruby process uses (what to load, where to log, Ruby
/// callbacks), read without a word: they change nothing a Rust worker does. docs/configuration.md
/// lists them.
const RUBY_ONLY_KEYS: &[&str] = &[
    "require",
    "environment",
    "logfile",
    "pidfile",
    "daemon",
    "index",
    "boot_grace",
    "reloader",
    "on_complex_arguments",
    "error_handlers",
    "death_handlers",
    "lifecycle_events",
    "backtrace_cleaner",
    "strict_args",
];

/// `capsules:` as Sidekiq 7+ reads it (`cli.rb`): a mapping of capsule name to `{ concurrency:,
/// queues: }`, the queues written as `queues:` (names, `[name, weight]` pairs, or `"name,weight"` as
/// `Capsule#queues=` splits them).
fn capsules(value: &Yaml) -> Result<Vec<Capsule>, Error> {
    let Yaml::Hash(h) = value else {
        return Err(Error::Config(format!(
            "capsules: {} is not a valid value, it must be a mapping such as \
             {{ single: {{ concurrency: 1, queues: [single] }} }}",
            describe(value)
        )));
    };
    let mut out: Vec<Capsule> = Vec::new();
    for (name, spec) in symbolize(h.clone()) {
        let bad = |m: String| Error::Config(format!("capsules: {name}: {m}"));
        let Yaml::Hash(spec) = spec else {
            return Err(bad(
                "must be a mapping such as { concurrency: 1, queues: [single] }".into(),
            ));
        };
        let (mut concurrency, mut list) = (None, None);
        for (k, v) in symbolize(spec) {
            match k.as_str() {
                "concurrency" => {
                    concurrency = Some(match v {
                        Yaml::Integer(0) => 0,
                        _ => positive_int("concurrency", &v).map_err(|e| bad(message(e)))?,
                    })
                }
                "queues" => {
                    let split = match v {
                        Yaml::Array(items) => Yaml::Array(
                            items
                                .into_iter()
                                .map(|i| match i {
                                    Yaml::String(s) if s.contains(',') => {
                                        let (n, w) = s.split_once(',').unwrap_or((&s, ""));
                                        Yaml::Array(vec![
                                            Yaml::String(n.trim().into()),
                                            Yaml::String(w.trim().into()),
                                        ])
                                    }
                                    other => other,
                                })
                                .collect(),
                        ),
                        other => other,
                    };
                    list = Some(queues(&split).map_err(|e| bad(message(e)))?);
                }
                other => crate::logging::warn_early(format!(
                    "sidekiq.yml capsule {} key `{}` not used by oxidekiq; ignored",
                    crate::logging::escape(&name),
                    crate::logging::escape(other)
                )),
            }
        }
        // Both given: a capsule's defaults differ between Sidekiq releases (its concurrency has been
        // 10 and the process's), and a guess would size the reservation wrong.
        out.push(Capsule {
            name: name.clone(),
            concurrency: concurrency.ok_or_else(|| {
                bad("no `concurrency:`; give it the number of jobs it runs at once".into())
            })?,
            queues: list.ok_or_else(|| bad("no `queues:`; list the queues it fetches".into()))?,
        });
    }
    Ok(out)
}

/// A config error's message alone.
fn message(e: Error) -> String {
    match e {
        Error::Config(m) => m,
        other => other.to_string(),
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::settings::tests::{env_of, q};

    #[test]
    /// The weight as given is kept (0), as Sidekiq 7+ keeps it for the Busy page; the list is
    /// weighted, and the fetch counts the 0 as 1 (`fetch::tests`).
    fn a_queue_without_weight_keeps_0_in_a_weighted_list() {
        let mut c = Config::default();
        c.apply_yaml_with_env(
            ":queues:\n  - [critical, 2]\n  - default\n",
            Some("x"),
            &env_of(&[]),
        )
        .unwrap();
        assert_eq!(c.queues, vec![q("critical", 2), q("default", 0)]);
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
    fn cron_schedules_and_the_poll_interval_are_read_from_the_file() {
        let mut c = Config::default();
        c.apply_yaml(
            ":cron_poll_interval: 10\n:scheduler:\n  :schedule:\n    nightly:\n      :cron: '0 3 * * *'\n      :class: Nightly\n",
            None,
        )
        .unwrap();
        assert_eq!(c.cron.poll_interval, Duration::from_secs(10));
        let jobs = &c.cron.sidekiq_yml_jobs;
        assert_eq!(jobs.len(), 1);
        assert_eq!(
            (jobs[0].name.as_str(), jobs[0].class.as_str()),
            ("nightly", "Nightly")
        );
        let mut c = Config::default();
        c.apply_yaml(
            "cron_poll_interval: 0\nschedule:\n  - name: a\n    cron: '@hourly'\n    class: A\n",
            None,
        )
        .unwrap();
        assert!(!c.cron.enabled, "0 turns the poller off, as in the gem");
        assert_eq!(c.cron.sidekiq_yml_jobs[0].cron, "@hourly");
        // sidekiq-scheduler's forms in the same section are left out, not an error.
        let mut c = Config::default();
        c.apply_yaml(":schedule:\n  a:\n    every: '1h'\n    class: A\n", None)
            .unwrap();
        assert!(c.cron.sidekiq_yml_jobs.is_empty());
    }
}
