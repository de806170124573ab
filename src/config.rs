//! The process's configuration: what `-c`, `-q`, `-t`, `-C config/sidekiq.yml` and the environment say.
//!
//! Defaults are Sidekiq 6.4's (`sidekiq.rb@v6.4.1 DEFAULTS`): concurrency 10, queue `default`, timeout 25 s.

use std::time::Duration;

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
#[derive(Debug, Clone)]
pub struct Config {
    /// `redis://` or `rediss://` URL; `None` means `REDIS_URL` or `redis://127.0.0.1:6379`.
    pub redis_url: Option<String>,
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
}

impl Default for Config {
    fn default() -> Self {
        Config {
            redis_url: None,
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
        }
    }
}

impl Config {
    /// The Redis URL to use: the configured one, else `REDIS_URL`, else the local default.
    pub fn redis_url(&self) -> String {
        self.redis_url
            .clone()
            .or_else(|| std::env::var("REDIS_URL").ok())
            .unwrap_or_else(|| "redis://127.0.0.1:6379".to_string())
    }

    /// True when the queues are fetched in strict order (every weight is 0).
    pub fn strict_queues(&self) -> bool {
        self.queues.iter().all(|q| q.weight == 0)
    }
}
