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
//!    there is no Ruby here to run it. As in Ruby, an unset `ENV["X"]` is `nil` (printed as an empty
//!    string, `0` with `.to_i`); `ENV.fetch("X")` without a default is an error naming it.
//! 2. YAML, with keys written either way (`:concurrency: 5` or `concurrency: 5`), anchors, aliases and
//!    `<<` merge keys, as Psych accepts them.
//! 3. The section named after the environment (`production:`, picked by `-e`, else `APP_ENV`,
//!    `RAILS_ENV`, `RACK_ENV`, else `development`) is merged over the top level, key by key and
//!    shallowly: a `queues` list in the section replaces the top-level one.
//! 4. Known keys are applied: `concurrency`, `timeout`, `queues`, `capsules` (Sidekiq 7+, see
//!    [`Capsule`]), `tag`, `labels`, `verbose`, `average_scheduled_poll_interval`. Any other key is
//!    ignored with a WARN naming it, except the keys only a Ruby process uses (`require`,
//!    `environment`, ...: docs/configuration.md lists them), which stay quiet.
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
//! counts as weight 1 (critical is tried first two times in three). [`QueueWeight::weight`] keeps the
//! weight as given (0 for none), as Sidekiq 7+'s `Capsule#queues=` keeps it for the Busy page
//! (`info.weights`, the capsule's mode); the fetch applies the `max(weight, 1)` rule itself
//! ([`normalize_weights`] writes it down for a caller that wants the list as 6.4 expands it). A queue
//! given twice is an error, as in Ruby.

// The flags and the `Config` they fill, with the bounds every source of settings is held to.
mod settings;
// The `sidekiq.yml` loader (`cli.rb@v6.4.1 parse_config`): YAML, environment sections, known keys.
mod file;
// The ERB subset a `sidekiq.yml` may use: environment lookups only.
mod erb;
// sidekiq-cron's settings and schedule declarations (plain data; the poller is `crate::cron`).
mod cron;

pub use cron::{CronConfig, CronJob};
pub(crate) use cron::{read_schedule_file, truthy_text};
pub use erb::render_erb;
pub(crate) use file::FileOptions;
// Types of `Config` fields, defined beside the code that uses them.
pub use crate::logging::LogFormat;
pub use crate::sentinel::{SentinelConfig, SentinelNode};
/// Everything the launcher needs to run; [`run`](crate::run) fills it from the flags, `sidekiq.yml`
/// and the environment ([`cli::load`](crate::cli::load)), and a binary of its own can build it.
///
/// ```
/// use oxidekiq::Config;
///
/// // As `oxidekiq -q critical,2 -q default -c 25` reads it (with `config/sidekiq.yml`, if any):
/// let config = oxidekiq::cli::load(["oxidekiq", "-q", "critical,2", "-q", "default", "-c", "25"])?;
/// assert_eq!(config.concurrency, 25);
/// assert_eq!(config.queues[0].name, "critical");
///
/// // Or by hand, starting from Sidekiq's defaults:
/// let config = Config { concurrency: 25, ..Config::default() };
/// config.validate()?;
/// # Ok::<(), oxidekiq::Error>(())
/// ```
#[doc(inline)]
pub use settings::Config;
pub use settings::{
    Capsule, DEFAULT_CAPSULE, FetchMode, MAX_CAPSULES, MAX_CONCURRENCY, MAX_CONFIG_FILE_BYTES,
    MAX_QUEUE_WEIGHT, MAX_SECONDS, MAX_THREADS, MAX_YAML_DEPTH, MAX_YAML_NODES, QueueWeight,
    UniqueJobsGem, UnknownClass, normalize_weights, parse_capsule_arg, parse_queue_arg,
    process_env, sidekiq_environment, web_ui_routable,
};
pub(crate) use settings::{
    check_queue_list, merge_capsule, parse_capsule_spec, parse_queue_spec, positive_duration,
};
