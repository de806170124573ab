//! The cron settings and the declaration of a sidekiq-cron schedule, as plain data: where schedules
//! come from (`config/schedule.yml`, `sidekiq.yml`'s `:schedule:`, Rust) and how often the poller looks
//! at Redis. The poller that runs them is [`crate::cron`]; nothing here touches Redis.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Map, Value};
use yaml_rust2::{Yaml, YamlLoader};

/// The cron poller's settings ([`Config::cron`](super::Config::cron)).
#[derive(Debug, Clone, PartialEq)]
pub struct CronConfig {
    /// Run sidekiq-cron's schedules (`--no-cron` turns it off). On, the poller does nothing until Redis
    /// holds a schedule (a `cron_jobs` set); off, schedules are neither run nor declared.
    pub enabled: bool,
    /// The longest time between two looks at the schedules in Redis (sidekiq-cron's
    /// `cron_poll_interval`, 30 s): a schedule created or enabled elsewhere is seen within it. Ticks
    /// themselves are not polled for: the poller wakes at each tick.
    pub poll_interval: Duration,
    /// The schedule file sidekiq-cron's loader reads (`cron_schedule_file`, `config/schedule.yml`
    /// relative to the working directory); read at start when it exists.
    pub schedule_file: PathBuf,
    /// Schedules declared in Rust, written to Redis at start in the gem's format, as the gem's loader
    /// writes `schedule.yml`.
    pub jobs: Vec<CronJob>,
    /// Schedules read from `sidekiq.yml` (`:schedule:` or `:scheduler: :schedule:`), written as
    /// [`CronConfig::jobs`] are, unless Redis shows that sidekiq-scheduler (whose section this also
    /// is) runs them from a Ruby process: writing them as sidekiq-cron schedules would then enqueue
    /// each tick twice.
    pub sidekiq_yml_jobs: Vec<CronJob>,
}

impl Default for CronConfig {
    fn default() -> Self {
        CronConfig {
            enabled: true,
            poll_interval: Duration::from_secs(30),
            schedule_file: PathBuf::from("config/schedule.yml"),
            jobs: Vec::new(),
            sidekiq_yml_jobs: Vec::new(),
        }
    }
}

/// One sidekiq-cron schedule, declared in Rust or read from a schedule file: what
/// `Sidekiq::Cron::Job.create(name:, cron:, class:, ...)` takes.
///
/// ```
/// use oxidekiq::{Config, CronJob};
///
/// let mut config = Config::default();
/// config.cron.jobs.push(
///     CronJob::new("nightly report", "0 3 * * * Europe/Paris", "NightlyReportWorker")
///         .args(("pdf", 7))
///         .queue("reports")
///         .description("the PDF for the board"),
/// );
/// config.cron.jobs.push(CronJob::new("cleanup", "every 5 minutes", "CleanupJob").active_job());
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct CronJob {
    /// The schedule's name (`cron_job:<name>`), unique in its namespace.
    pub name: String,
    /// When it runs: a cron line (5 fields, or 6 with seconds first), optionally with a time zone, or
    /// a natural form (see [`crate::cron::Schedule`]).
    pub cron: String,
    /// The job class (Ruby or Rust worker, or an ActiveJob class with [`CronJob::active_job`]).
    pub class: String,
    /// The positional arguments (a JSON array).
    pub args: Vec<Value>,
    /// The queue; `None`: `default`.
    pub queue: Option<String>,
    /// Shown on the Cron tab.
    pub description: Option<String>,
    /// Enqueue it wrapped for ActiveJob (`active_job: true`).
    pub active_job: bool,
    /// Append the enqueue time (float epoch seconds) to the arguments (`date_as_argument: true`).
    pub date_as_argument: bool,
    /// ActiveJob queue name prefix and delimiter (`queue_name_prefix`, `queue_name_delimiter`).
    pub queue_name_prefix: Option<String>,
    /// See [`CronJob::queue_name_prefix`]; `_` when unset.
    pub queue_name_delimiter: Option<String>,
    /// `Some(false)` declares it disabled. `None` keeps the status Redis has (so a schedule disabled on
    /// the Cron tab stays disabled across restarts, as the gem's loader keeps it), else enabled.
    pub enabled: Option<bool>,
    /// Other keys of the Sidekiq payload (`retry`, `backtrace`, `tags`, ...), written into the
    /// schedule's `message` as a Ruby class's `sidekiq_options` would be.
    pub options: Map<String, Value>,
}

impl CronJob {
    /// A schedule `name` running `class` at `cron`, with no arguments, on the `default` queue.
    pub fn new(name: impl Into<String>, cron: impl Into<String>, class: impl Into<String>) -> Self {
        CronJob {
            name: name.into(),
            cron: cron.into(),
            class: class.into(),
            args: Vec::new(),
            queue: None,
            description: None,
            active_job: false,
            date_as_argument: false,
            queue_name_prefix: None,
            queue_name_delimiter: None,
            enabled: None,
            options: Map::new(),
        }
    }

    /// The positional arguments: anything serializing to a JSON array (a tuple, a `Vec`); another
    /// value becomes the only argument.
    pub fn args(mut self, args: impl serde::Serialize) -> Self {
        self.args = match serde_json::to_value(args) {
            Ok(Value::Array(a)) => a,
            Ok(Value::Null) | Err(_) => Vec::new(),
            Ok(other) => vec![other],
        };
        self
    }

    /// The queue.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }

    /// The description the Cron tab shows.
    pub fn description(mut self, text: impl Into<String>) -> Self {
        self.description = Some(text.into());
        self
    }

    /// Enqueue it as an ActiveJob job (wrapped in `JobWrapper`, as the gem does).
    pub fn active_job(mut self) -> Self {
        self.active_job = true;
        self
    }

    /// Append the enqueue time to the arguments.
    pub fn date_as_argument(mut self) -> Self {
        self.date_as_argument = true;
        self
    }

    /// Declares it disabled (`false`) or enabled (`true`), overriding the status in Redis.
    pub fn enabled(mut self, enabled: bool) -> Self {
        self.enabled = Some(enabled);
        self
    }

    /// Another payload key (`retry`, `backtrace`, ...).
    pub fn option(mut self, key: impl Into<String>, value: Value) -> Self {
        self.options.insert(key.into(), value);
        self
    }

    /// A schedule as a schedule file writes it: `name` and a mapping with `cron`, `class` (or
    /// `klass`), and optionally `args` (an array, or one value), `queue`, `description`,
    /// `active_job`, `date_as_argument`, `queue_name_prefix`, `queue_name_delimiter`, `status`
    /// (`enabled`/`disabled`). Booleans may be written as the gem reads them (`true`, `"yes"`,
    /// `"1"`...). The error names the schedule and the field.
    pub fn from_fields(name: &str, fields: &Map<String, Value>) -> Result<CronJob, String> {
        let text = |key: &str| -> Result<Option<String>, String> {
            match fields.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(Value::Number(n)) => Ok(Some(n.to_string())),
                Some(other) => Err(format!(
                    "cron schedule {name:?}: `{key}` must be text, got {other}"
                )),
            }
        };
        let cron = text("cron")?.filter(|c| !c.is_empty());
        let class = match text("class")? {
            Some(c) => Some(c),
            None => text("klass")?,
        }
        .filter(|c| !c.is_empty());
        let (Some(cron), Some(class)) = (cron, class) else {
            return Err(format!(
                "cron schedule {name:?}: `cron` and `class` must be set"
            ));
        };
        let mut job = CronJob::new(name, cron, class);
        job.args = match fields.get("args") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a.clone(),
            Some(other) => vec![other.clone()],
        };
        job.queue = text("queue")?;
        job.description = text("description")?;
        job.active_job = fields.get("active_job").is_some_and(truthy);
        job.date_as_argument = fields.get("date_as_argument").is_some_and(truthy);
        job.queue_name_prefix = text("queue_name_prefix")?;
        job.queue_name_delimiter = text("queue_name_delimiter")?;
        job.enabled = text("status")?.map(|s| s == "enabled");
        Ok(job)
    }
}

/// The schedules of a schedule file's root (or of `sidekiq.yml`'s `:schedule:`), as the gem's
/// `schedule_loader.rb` takes them: a mapping of name to fields (`load_from_hash`), or a list of
/// mappings each with a `name` (`load_from_array`). Keys may be written `:cron:` or `cron:`. As the
/// gem's loader, an entry that is not a valid schedule is left out and the others kept: the second
/// list says why each was left out.
pub(crate) fn schedules_from_yaml(root: &Yaml) -> (Vec<CronJob>, Vec<String>) {
    let entry = |v: &Yaml, name: Option<String>| -> Result<CronJob, String> {
        let fields = match yaml_to_json(v) {
            Value::Object(m) => m,
            other => {
                return Err(format!(
                    "cron schedule {:?} must be a mapping of fields, got {other}",
                    name.unwrap_or_default()
                ));
            }
        };
        let name = match (name, fields.get("name")) {
            (Some(n), _) => n,
            (None, Some(Value::String(s))) if !s.is_empty() => s.clone(),
            (None, _) => return Err("a cron schedule in a list needs a `name`".to_string()),
        };
        CronJob::from_fields(&name, &fields)
    };
    let results: Vec<Result<CronJob, String>> = match root {
        Yaml::Null => Vec::new(),
        Yaml::Hash(h) => h
            .iter()
            .map(|(k, v)| {
                let name = match yaml_to_json(k) {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                entry(v, Some(name))
            })
            .collect(),
        Yaml::Array(items) => items.iter().map(|v| entry(v, None)).collect(),
        _ => vec![Err(
            "a cron schedule must be a mapping of name to fields, or a list".into(),
        )],
    };
    let mut jobs = Vec::new();
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok(j) => jobs.push(j),
            Err(e) => errors.push(e),
        }
    }
    (jobs, errors)
}

/// Reads a schedule file (`config/schedule.yml`): plain YAML, as the gem's `YAML.load_file`. Returns
/// the schedules and why any entry was left out; an unreadable file is an error. Messages name the
/// file.
pub(crate) fn read_schedule_file(path: &Path) -> Result<(Vec<CronJob>, Vec<String>), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let docs = YamlLoader::load_from_str(&text)
        .map_err(|e| format!("{}: invalid YAML: {e}", path.display()))?;
    let root = docs.into_iter().next().unwrap_or(Yaml::Null);
    let (jobs, errors) = schedules_from_yaml(&root);
    let errors = errors
        .into_iter()
        .map(|e| format!("{}: {e}", path.display()))
        .collect();
    Ok((jobs, errors))
}

/// A YAML value as JSON, Ruby symbol keys (`:cron`) read as their names.
fn yaml_to_json(v: &Yaml) -> Value {
    match v {
        Yaml::String(s) => Value::String(
            s.strip_prefix(':')
                .filter(|r| !r.is_empty())
                .unwrap_or(s)
                .to_string(),
        ),
        Yaml::Integer(i) => Value::from(*i),
        Yaml::Real(r) => r
            .parse::<f64>()
            .map(Value::from)
            .unwrap_or_else(|_| Value::String(r.clone())),
        Yaml::Boolean(b) => Value::Bool(*b),
        Yaml::Array(a) => Value::Array(a.iter().map(yaml_to_json).collect()),
        Yaml::Hash(h) => Value::Object(
            h.iter()
                .map(|(k, v)| {
                    let key = match yaml_to_json(k) {
                        Value::String(s) => s,
                        other => other.to_string(),
                    };
                    (key, yaml_to_json(v))
                })
                .collect(),
        ),
        _ => Value::Null,
    }
}

/// A flag as sidekiq-cron 1.8.0 reads it (`job.rb` `initialize`): `true`, or text matching
/// `/^(true|t|yes|y|1)$/i`.
pub(crate) fn truthy(v: &Value) -> bool {
    match v {
        Value::Bool(b) => *b,
        Value::String(s) => truthy_text(s),
        Value::Number(n) => n.to_string() == "1",
        _ => false,
    }
}

/// [`truthy`] for a field read from Redis.
pub(crate) fn truthy_text(s: &str) -> bool {
    matches!(
        s.to_ascii_lowercase().as_str(),
        "true" | "t" | "yes" | "y" | "1"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_schedule_file_entry_reads_as_the_gem_reads_it() {
        let fields = json!({"cron": "*/5 * * * *", "klass": "A", "args": {"x": 1},
            "active_job": "yes", "date_as_argument": false, "status": "disabled"});
        let job = CronJob::from_fields("n", fields.as_object().unwrap()).unwrap();
        assert_eq!(job.class, "A");
        assert_eq!(job.args, vec![json!({"x": 1})]);
        assert!(job.active_job && !job.date_as_argument);
        assert_eq!(job.enabled, Some(false));
        let err = CronJob::from_fields("n", json!({"cron": "* * * * *"}).as_object().unwrap());
        assert!(err.unwrap_err().contains("`class`"));
    }

    #[test]
    fn schedule_files_are_a_mapping_or_a_list() {
        let map =
            YamlLoader::load_from_str("a:\n  :cron: '* * * * *'\n  :class: A\n  :args: [1]\n")
                .unwrap();
        let jobs = schedules_from_yaml(&map[0]).0;
        assert_eq!(
            (jobs[0].name.as_str(), jobs[0].args.clone()),
            ("a", vec![json!(1)])
        );
        let list = YamlLoader::load_from_str("- name: b\n  cron: '@hourly'\n  class: B\n").unwrap();
        assert_eq!(schedules_from_yaml(&list[0]).0[0].cron, "@hourly");
        // An entry that is not a schedule is left out, and says why; the others are kept.
        let mixed =
            YamlLoader::load_from_str("- cron: x\n- name: c\n  cron: '@daily'\n  class: C\n")
                .unwrap();
        let (jobs, errors) = schedules_from_yaml(&mixed[0]);
        assert_eq!((jobs.len(), errors.len()), (1, 1));
        assert!(errors[0].contains("needs a `name`"), "{errors:?}");
    }
}
