//! The Rust client: enqueue jobs that Ruby Sidekiq (or oxidekiq) runs unchanged.
//!
//! Mirrors `client.rb` + `job_util.rb` (PROTOCOL §2). A push is one pipeline `SADD queues <q>` +
//! `LPUSH queue:<q> <json...>`; a scheduled job is `ZADD schedule <at> <json>` without `enqueued_at`; an
//! interval under 1e9 seconds is relative, and a time already past is pushed at once (`job.rb`). Payloads
//! have Ruby's key order (`retry`, `queue`, options, `args`, `class`, `jid`, `created_at`, `enqueued_at`).
//!
//! Every push goes through the client's middleware chain ([`ClientMiddleware`], as Sidekiq's client
//! middleware): a middleware may change the job's options, refuse the push, or ask the push to take a
//! lock in the same script. The default chain holds [`UntilExecuted`](until_executed::UntilExecuted),
//! which acts only on jobs with [`NewJob::unique_for`]; [`Client::middleware`] appends more.
//!
//! Timestamps are float seconds by default (every Sidekiq reads them); integer milliseconds when told, or,
//! in [`TimeMode::Auto`], when every live Ruby process reports Sidekiq 8 in its `info.version`.
//!
//! ```no_run
//! # async fn demo() -> oxidekiq::error::Result<()> {
//! use oxidekiq::client::{Client, NewJob};
//! let client = Client::connect("redis://127.0.0.1:6379").await?;
//! client.perform_async("HardWorker", ("bob", 5)).await?;
//! client.push(NewJob::new("HardWorker", ("later", 1)).queue("critical").retry(3).run_in(60.0)).await?;
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde_json::{Map, Value, json};

pub use crate::activejob::NewActiveJob;
use crate::error::{Error, Result};
use crate::job::new_jid;
use crate::keys;
use crate::middleware::{BoxFuture, until_executed};
use crate::redis_conn::{self, Conn};
use crate::retry::to_json;
pub use crate::time::TimeFormat;
use crate::time::{self, score};

/// How the client writes timestamps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TimeMode {
    /// Float seconds (readable by every Sidekiq).
    #[default]
    Seconds,
    /// Integer milliseconds (Sidekiq 8).
    Millis,
    /// Milliseconds when every live Ruby process reports Sidekiq 8, else seconds.
    Auto,
}

/// A job to push, with Sidekiq's options (`Worker.set(queue: ...).perform_async`).
///
/// ```
/// use std::time::Duration;
///
/// use oxidekiq::NewJob;
///
/// let job = NewJob::new("HardWorker", ("bob", 5))
///     .queue("critical")
///     .retry(3)
///     .tags(["billing"])
///     .run_in(60.0) // into the schedule set, as `perform_in(60, ...)`
///     .unique_for(Duration::from_secs(600)); // refused while an equal job is pending
/// assert_eq!(job.class(), "HardWorker");
/// assert_eq!(job.args(), &serde_json::json!(["bob", 5]));
/// ```
#[derive(Debug, Clone)]
pub struct NewJob {
    /// Ruby class name.
    class: String,
    /// The positional arguments (a JSON array).
    args: Value,
    /// Queue name.
    queue: String,
    /// `retry`: `true`, `false` or a count.
    retry: Value,
    /// Run at this epoch time, or now.
    at: Option<f64>,
    /// A given jid, or a fresh one.
    jid: Option<String>,
    /// Other options, written as is (`tags`, `backtrace`, `retry_queue`, `dead`, custom keys, ...).
    options: Map<String, Value>,
    /// Until-executed uniqueness: the lock's TTL ([`NewJob::unique_for`]).
    unique_for: Option<Duration>,
}

impl NewJob {
    /// An ActiveJob job that the ActiveJob class `job_class` runs, as [`Client::perform_later`] pushes
    /// it: Rails' Sidekiq adapter's wrapper class, `wrapped`, and the job's data as its one argument.
    ///
    /// ```
    /// use oxidekiq::NewJob;
    ///
    /// let job = NewJob::activejob("WelcomeEmailJob", "mailers", vec![serde_json::json!(42)]);
    /// assert_eq!(job.class(), "ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper");
    /// assert_eq!(job.args()[0]["arguments"], serde_json::json!([42]));
    /// ```
    pub fn activejob(job_class: &str, queue: &str, arguments: Vec<Value>) -> NewJob {
        NewJob::from_activejob(
            &NewActiveJob::new(job_class, arguments).queue(queue),
            chrono::Utc::now(),
        )
    }

    /// The Sidekiq job that carries `job` as Rails' adapter wraps it, enqueued at `now`: its queue, or
    /// `schedule` for a wait in the future. The one place both [`NewJob::activejob`] and
    /// [`Client::enqueue_activejob`] build the payload (the latter checks the reserved keys first).
    pub(crate) fn from_activejob(job: &NewActiveJob, now: chrono::DateTime<chrono::Utc>) -> NewJob {
        let mut new = NewJob::new(crate::activejob::WRAPPER_CLASS, vec![job.job_data(now)])
            .queue(job.queue_name())
            .option("wrapped", Value::String(job.job_class().to_string()));
        if let Some(at) = job.scheduled_at(now).filter(|at| *at > now) {
            new = new.run_at(at.timestamp() as f64 + f64::from(at.timestamp_subsec_nanos()) / 1e9);
        }
        new
    }

    /// A job of `class` with `args` (anything serializing to a JSON array: a tuple, a `Vec`, `()`).
    pub fn new(class: impl Into<String>, args: impl Serialize) -> NewJob {
        let args = match serde_json::to_value(args) {
            Ok(Value::Array(a)) => Value::Array(a),
            Ok(Value::Null) => Value::Array(Vec::new()),
            Ok(other) => Value::Array(vec![other]),
            Err(_) => Value::Array(Vec::new()),
        };
        NewJob {
            class: class.into(),
            args,
            queue: "default".into(),
            retry: Value::Bool(true),
            at: None,
            jid: None,
            options: Map::new(),
            unique_for: None,
        }
    }

    /// Sets the queue.
    pub fn queue(mut self, q: impl Into<String>) -> Self {
        self.queue = q.into();
        self
    }

    /// `retry: n`.
    pub fn retry(mut self, n: i64) -> Self {
        self.retry = json!(n);
        self
    }

    /// `retry: false`.
    pub fn no_retry(mut self) -> Self {
        self.retry = Value::Bool(false);
        self
    }

    /// Runs at an epoch time (seconds).
    pub fn run_at(mut self, at: f64) -> Self {
        self.at = Some(at);
        self
    }

    /// Runs in `secs` seconds.
    pub fn run_in(mut self, secs: f64) -> Self {
        self.at = Some(if secs < 1e9 { time::now() + secs } else { secs });
        self
    }

    /// Uses this jid.
    pub fn jid(mut self, jid: impl Into<String>) -> Self {
        self.jid = Some(jid.into());
        self
    }

    /// `tags`.
    pub fn tags<S: Into<String>>(self, tags: impl IntoIterator<Item = S>) -> Self {
        let t: Vec<Value> = tags.into_iter().map(|s| Value::String(s.into())).collect();
        self.option("tags", Value::Array(t))
    }

    /// Any other `sidekiq_options` key, written as is.
    pub fn option(mut self, key: impl Into<String>, value: Value) -> Self {
        self.options.insert(key.into(), value);
        self
    }

    /// Until-executed uniqueness: while a job of this class with these arguments is queued, scheduled,
    /// waiting for a retry or running, an identical push is refused ([`Client::push_unique`] answers
    /// `None`, [`Client::push`] an [`Error::LockNotAcquired`]). The lock is released when the job
    /// finishes, is discarded or dies, and expires `ttl` after its last renewal in any case (see
    /// [`crate::middleware::until_executed`]). Not for [`Client::push_bulk`].
    pub fn unique_for(mut self, ttl: Duration) -> Self {
        self.unique_for = Some(ttl);
        self
    }

    /// The Ruby class name.
    pub fn class(&self) -> &str {
        &self.class
    }

    /// The positional arguments (a JSON array).
    pub fn args(&self) -> &Value {
        &self.args
    }

    /// The until-executed TTL, when [`NewJob::unique_for`] was set.
    pub fn unique_ttl(&self) -> Option<Duration> {
        self.unique_for
    }

    /// The jid given with [`NewJob::jid`].
    #[cfg(feature = "testing")]
    pub(crate) fn given_jid(&self) -> Option<&str> {
        self.jid.as_deref()
    }

    /// The epoch time it runs at, when scheduled.
    pub fn at(&self) -> Option<f64> {
        self.at
    }

    /// Sets an option in place (for client middleware, which hold the job by reference).
    pub fn set_option(&mut self, key: impl Into<String>, value: Value) {
        self.options.insert(key.into(), value);
    }

    /// Checks what Ruby's `validate` checks.
    fn validate(&self) -> Result<()> {
        if self.class.is_empty() {
            return Err(Error::Config("job class must not be empty".into()));
        }
        if self.queue.is_empty() {
            return Err(Error::Config("queue name must not be empty".into()));
        }
        if let Some(t) = self.options.get("tags")
            && !t.is_array()
        {
            return Err(Error::Config("tags must be an array".into()));
        }
        // The server fails a job whose `unique_ttl` is out of this range: refuse it at the push.
        if let Some(ttl) = self.unique_for
            && !(0.001..=until_executed::MAX_UNIQUE_TTL_SECS).contains(&ttl.as_secs_f64())
        {
            return Err(Error::Config(format!(
                "unique_for must be from 1 ms to 10 years, got {ttl:?}"
            )));
        }
        Ok(())
    }

    /// The payload as Ruby's client builds it.
    pub fn payload(&self, jid: &str, now: f64, tf: TimeFormat) -> String {
        let mut m = Map::new();
        m.insert("retry".into(), self.retry.clone());
        m.insert("queue".into(), Value::String(self.queue.clone()));
        for (k, v) in &self.options {
            if !matches!(
                k.as_str(),
                "at" | "class" | "args" | "jid" | "queue" | "retry"
            ) {
                m.insert(k.clone(), v.clone());
            }
        }
        m.insert("args".into(), self.args.clone());
        m.insert("class".into(), Value::String(self.class.clone()));
        m.insert("jid".into(), Value::String(jid.to_string()));
        m.insert("created_at".into(), tf.value(now));
        if self.at.is_none_or(|at| at <= now) {
            m.insert("enqueued_at".into(), tf.value(now));
        }
        to_json(&m)
    }
}

/// One job on its way through the client chain to Redis (see [`ClientMiddleware`]).
///
/// ```
/// use oxidekiq::{NewJob, Push};
///
/// fn stamp(push: &mut Push) {
///     push.job.set_option("pushed_by", serde_json::json!("billing"));
/// }
/// # let _ = (stamp, NewJob::new("A", ()));
/// ```
#[derive(Debug)]
pub struct Push {
    /// The job; a middleware may change its options ([`NewJob::set_option`]).
    pub job: NewJob,
    /// Its jid.
    pub jid: String,
    /// A lock the push takes in the same script as the push itself: `(full key, ttl)`. The push is
    /// refused (`None`) when someone holds it. Set by [`until_executed::UntilExecuted`].
    pub(crate) guard: Option<(String, Duration)>,
    /// Part of a [`Client::push_bulk`]: the end of the chain accepts it, and the bulk writes it.
    pub(crate) bulk: bool,
    /// A claim the push takes in the same script as the push itself; the push is refused (`None`)
    /// when the claim was taken already. Set by [`Client::push_claimed`].
    pub(crate) claim: Option<Claim>,
}

/// A claim on a sorted set: `ZADD key score member` must add `member` (not find it there) for the push
/// to happen, and both happen in one script, so of several processes pushing under the same claim
/// exactly one pushes, and no claim is left without its job. sidekiq-cron's per-tick claim
/// (`cron_job:<name>:enqueued`) is one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Claim {
    /// The sorted set.
    pub(crate) key: String,
    /// The member's score, as written.
    pub(crate) score: String,
    /// The member whose absence is the claim.
    pub(crate) member: String,
    /// A second sorted set that must not hold `member` either, and gets it too: the claim set of the
    /// same sidekiq-cron schedule in the other key layout (1.x's `cron_job:<name>` beside 2.x's
    /// `cron_job:default:<name>`), so a poller of either layout sees the tick taken.
    pub(crate) twin: Option<String>,
}

/// While tracing, inside a traced span: starts the producer span of `push` and puts its context at the
/// top of the payload (`traceparent`, and `tracestate`, `baggage` when there are any).
fn publish(push: &mut Push) -> Option<opentelemetry::Context> {
    let parent = crate::logging::current_otel()?;
    let job = &push.job;
    let class = match job.options.get("wrapped") {
        Some(Value::String(w)) => w.as_str(),
        _ => job.class.as_str(),
    };
    let (cx, carrier) = crate::otel::publish(&parent, class, &push.jid, &job.queue)?;
    // Ruby's propagators write no empty `tracestate` or `baggage`.
    let headers: Vec<(String, String)> = carrier
        .0
        .into_iter()
        .filter(|(_, v)| !v.is_empty())
        .collect();
    // An ActiveJob job also carries them where ActiveJob's instrumentation reads them: its job hash's
    // `__otel_headers`, as `serialize_arguments` writes a hash (a list of pairs).
    if push.job.class == crate::activejob::WRAPPER_CLASS
        && let Some(Value::Object(data)) = push.job.args.get_mut(0)
    {
        let pairs = headers
            .iter()
            .map(|(k, v)| serde_json::json!([k, v]))
            .collect();
        data.insert("__otel_headers".into(), Value::Array(pairs));
    }
    for (k, v) in headers {
        push.job.set_option(k, Value::String(v));
    }
    Some(cx)
}

/// KEYS[1] the claim's sorted set, KEYS[2] `queues`, KEYS[3] the queue's list, KEYS[4] (optional) the
/// twin claim set; ARGV[1] score, ARGV[2] member, ARGV[3] queue name, ARGV[4] payload. Returns 1 if
/// claimed and pushed, 0 if the member was there already (in either set). A push that fails (a key of
/// the wrong type) removes the member again and returns the error, so the claim is free for the next
/// try. The twin gets the member only after the push: nothing was written if it cannot be read.
const CLAIM_PUSH_SCRIPT: &str = concat!(
    crate::lua::lua_common!(),
    r"
local twin = KEYS[4]
if twin then
  local t = redis.pcall('ZSCORE', twin, ARGV[2])
  if failed(t) then
    return redis.error_reply(twin .. ' is a ' .. kind(twin) .. ', not a sorted set: ' .. t.err)
  end
  if t then return 0 end
end
local r = redis.pcall('ZADD', KEYS[1], ARGV[1], ARGV[2])
if failed(r) then
  return redis.error_reply(KEYS[1] .. ' is a ' .. kind(KEYS[1]) .. ', not a sorted set: ' .. r.err)
end
if r == 0 then return 0 end
local err = push_job(KEYS[2], KEYS[3], ARGV[3], ARGV[4])
if err then
  redis.call('ZREM', KEYS[1], ARGV[2])
  return redis.error_reply(err)
end
if twin then redis.pcall('ZADD', twin, ARGV[1], ARGV[2]) end
return 1
"
);

/// The script, sent by SHA1 with the body as fallback on `NOSCRIPT`.
static CLAIM_PUSH: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(CLAIM_PUSH_SCRIPT));

/// What a push through the chain answers: `Some(jid)` if the job is in Redis, `None` if a middleware
/// (or the push's lock) refused it.
pub type Pushed = Result<Option<String>>;

/// One link of the client chain (Sidekiq's client middleware): called with the push and the rest of
/// the chain; return without calling `next` to refuse the push.
///
/// ```no_run
/// use oxidekiq::client::Pushed;
/// use oxidekiq::{BoxFuture, Client, ClientMiddleware, ClientNext, Push};
///
/// /// Adds a `tenant` key to every payload, as a Ruby client middleware would.
/// #[derive(Debug)]
/// struct Tenant(&'static str);
///
/// impl ClientMiddleware for Tenant {
///     fn call<'a>(&'a self, push: &'a mut Push, next: ClientNext<'a>) -> BoxFuture<'a, Pushed> {
///         push.job.set_option("tenant", serde_json::json!(self.0));
///         next.run(push)
///     }
/// }
///
/// # async fn demo() -> oxidekiq::Result<()> {
/// let client = Client::connect("redis://127.0.0.1:6379").await?.middleware(Tenant("acme"));
/// client.perform_async("HardWorker", ("bob", 5)).await?;
/// # Ok(()) }
/// ```
pub trait ClientMiddleware: Send + Sync + std::fmt::Debug + 'static {
    /// Runs around the rest of the chain and the push.
    fn call<'a>(&'a self, push: &'a mut Push, next: ClientNext<'a>) -> BoxFuture<'a, Pushed>;
}

/// The rest of the client chain, ending in the write to Redis: a [`ClientMiddleware`] calls
/// `next.run(push)` to go on.
///
/// ```
/// use oxidekiq::client::Pushed;
/// use oxidekiq::{BoxFuture, ClientMiddleware, ClientNext, Push};
///
/// /// Refuses every push of a retired class (the caller sees `Ok(None)` from `push_unique`).
/// #[derive(Debug)]
/// struct Retired;
///
/// impl ClientMiddleware for Retired {
///     fn call<'a>(&'a self, push: &'a mut Push, next: ClientNext<'a>) -> BoxFuture<'a, Pushed> {
///         if push.job.class() == "LegacyExportJob" {
///             return Box::pin(async { Ok(None) });
///         }
///         next.run(push)
///     }
/// }
/// ```
#[derive(Debug)]
pub struct ClientNext<'a> {
    /// Middleware still to run.
    rest: &'a [Arc<dyn ClientMiddleware>],
    /// The client that writes at the end.
    client: &'a Client,
}

impl<'a> ClientNext<'a> {
    /// Runs the next middleware, or the write when none is left.
    pub fn run(self, push: &'a mut Push) -> BoxFuture<'a, Pushed> {
        match self.rest.split_first() {
            Some((first, rest)) => first.call(
                push,
                ClientNext {
                    rest,
                    client: self.client,
                },
            ),
            None => Box::pin(self.client.write(push)),
        }
    }
}

/// A connection that pushes jobs, as Ruby's `Sidekiq::Client`: the payloads are Sidekiq's own, so
/// Ruby or Rust workers run them.
///
/// ```no_run
/// # async fn demo() -> oxidekiq::Result<()> {
/// use oxidekiq::{Client, NewJob};
///
/// let client = Client::connect("redis://127.0.0.1:6379").await?;
/// let jid = client.perform_async("HardWorker", ("bob", 5)).await?;
/// client.perform_in(60.0, "HardWorker", ("later", 1)).await?;
/// client.push(NewJob::new("HardWorker", ("x", 1)).queue("critical").retry(3)).await?;
/// client.perform_later("WelcomeEmailJob", "mailers", vec![serde_json::json!(42)]).await?; // ActiveJob
/// # let _ = jid; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Client {
    /// Shared connection.
    conn: Conn,
    /// Timestamp mode.
    mode: TimeMode,
    /// The client middleware every single push goes through, in order.
    chain: Arc<[Arc<dyn ClientMiddleware>]>,
    /// `Some` for `oxidekiq::testing`'s fake client: the payloads are recorded there, not written
    /// (the connection is [`Conn::absent`]). A field only with the `testing` feature.
    #[cfg(feature = "testing")]
    fake: Option<Recorder>,
}

/// A push the fake client recorded instead of writing it (Sidekiq's `Sidekiq::Testing.fake!`).
#[cfg(feature = "testing")]
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Recorded {
    /// The queue it would have been pushed to.
    pub(crate) queue: String,
    /// The payload, byte for byte as the real client writes it.
    pub(crate) payload: String,
    /// The score it would have in the schedule set; `None` for a push to the queue.
    pub(crate) at: Option<f64>,
}

/// Where a fake client records its pushes, in order; shared by its clones.
#[cfg(feature = "testing")]
pub(crate) type Recorder = Arc<std::sync::Mutex<Vec<Recorded>>>;

/// Records `payloads` (of `template`'s queue and time) in a fake client's `recorder`.
#[cfg(feature = "testing")]
fn record(recorder: &Recorder, template: &NewJob, payloads: Vec<String>, now: f64) {
    let at = template.at.filter(|at| *at > now);
    let mut jobs = recorder.lock().unwrap_or_else(|p| p.into_inner());
    jobs.extend(payloads.into_iter().map(|payload| Recorded {
        queue: template.queue.clone(),
        payload,
        at,
    }));
}

impl Client {
    /// Connects to `url`.
    pub async fn connect(url: &str) -> Result<Client> {
        let client = redis_conn::client(url)?;
        Ok(Client::new(redis_conn::connect(&client).await?))
    }

    /// A client on an existing connection, writing float seconds.
    pub fn new(conn: Conn) -> Client {
        Client {
            conn,
            mode: TimeMode::Seconds,
            chain: Arc::new([Arc::new(until_executed::UntilExecuted) as Arc<dyn ClientMiddleware>]),
            #[cfg(feature = "testing")]
            fake: None,
        }
    }

    /// A client that records its pushes in `recorder` instead of writing them: every push passes the
    /// client chain and builds its payload as [`Client::push`] does; no lock or claim is taken, and
    /// what needs Redis ([`Client::cancel`], [`TimeMode::Auto`]'s survey) fails with a message.
    #[cfg(feature = "testing")]
    pub(crate) fn recording(recorder: Recorder) -> Client {
        let mut client = Client::new(Conn::absent(
            "a fake client (oxidekiq::testing::FakeClient) records pushes and has no Redis:              use a real Client on testing::TestRedis for this",
        ));
        client.fake = Some(recorder);
        client
    }

    /// Appends a client middleware: it runs for every job pushed ([`Client::push`], `perform_*`, each
    /// job of [`Client::push_bulk`]) after the ones already there.
    pub fn middleware(mut self, m: impl ClientMiddleware) -> Client {
        let mut chain = self.chain.to_vec();
        chain.push(Arc::new(m));
        self.chain = Arc::from(chain);
        self
    }

    /// Chooses the timestamp mode.
    pub fn with_time_mode(mut self, mode: TimeMode) -> Client {
        self.mode = mode;
        self
    }

    /// The format the next push writes.
    pub async fn time_format(&self) -> Result<TimeFormat> {
        #[cfg(feature = "testing")]
        if self.fake.is_some() && self.mode == TimeMode::Auto {
            return Ok(TimeFormat::Seconds);
        }
        Ok(match self.mode {
            TimeMode::Seconds => TimeFormat::Seconds,
            TimeMode::Millis => TimeFormat::Millis,
            TimeMode::Auto => detect_time_format(&mut self.conn.clone()).await?,
        })
    }

    /// `Sidekiq::Client#cancel!(jid)`: marks the job cancelled exactly as Ruby does (pipelined
    /// `HSETNX it-<jid> cancelled <now>`, `HGET`, `EXPIRE .. 2592000 NX`) and returns the time of the
    /// first cancel (epoch seconds), however often it is called. A running iterable job, Ruby's or
    /// Rust's, sees it at its next state flush (at most 5 s, or one item, later) or, still queued, when
    /// it starts; a plain async job running in oxidekiq at its next heartbeat (a plain job cancelled
    /// while queued is not skipped: it starts and is dropped at the first beat of its run).
    pub async fn cancel(&self, jid: &str) -> Result<i64> {
        crate::iterable::cancel(&mut self.conn.clone(), jid).await
    }

    /// `Worker.perform_async(*args)`; returns the jid.
    pub async fn perform_async(&self, class: &str, args: impl Serialize) -> Result<String> {
        self.push(NewJob::new(class, args)).await
    }

    /// `Worker.perform_in(secs, *args)`.
    pub async fn perform_in(&self, secs: f64, class: &str, args: impl Serialize) -> Result<String> {
        self.push(NewJob::new(class, args).run_in(secs)).await
    }

    /// `Worker.perform_at(epoch_secs, *args)`.
    pub async fn perform_at(&self, at: f64, class: &str, args: impl Serialize) -> Result<String> {
        self.push(NewJob::new(class, args).run_at(at)).await
    }

    /// Pushes one job through the client chain; returns its jid. A push refused by a middleware (a
    /// [`NewJob::unique_for`] job whose duplicate is pending) is [`Error::LockNotAcquired`].
    pub async fn push(&self, job: NewJob) -> Result<String> {
        let class = job.class.clone();
        let unique = job.unique_for.is_some();
        self.push_unique(job).await?.ok_or_else(|| {
            Error::LockNotAcquired(if unique {
                format!("a {class} job with the same arguments is already pending (unique_for)")
            } else {
                format!("the push of a {class} job was refused by a client middleware")
            })
        })
    }

    /// Pushes one job through the client chain: `Some(jid)` if pushed, `None` if refused (a
    /// [`NewJob::unique_for`] job whose duplicate is pending: the lock is taken and the job pushed in
    /// one script, one round trip).
    pub async fn push_unique(&self, job: NewJob) -> Result<Option<String>> {
        self.push_one(job, None).await
    }

    /// Pushes one job through the client chain, now, under `claim`: `Some(jid)` if this call took the
    /// claim and pushed, `None` if the claim was taken already (or a middleware refused the push).
    pub(crate) async fn push_claimed(&self, job: NewJob, claim: Claim) -> Pushed {
        if job.at.is_some() || job.unique_for.is_some() {
            return Err(Error::Config(
                "a claimed push is pushed now, without unique_for".into(),
            ));
        }
        self.push_one(job, Some(claim)).await
    }

    /// One job, checked, given its jid, through the client chain (under `claim`, if any).
    async fn push_one(&self, job: NewJob, claim: Option<Claim>) -> Pushed {
        job.validate()?;
        let jid = job.jid.clone().unwrap_or_else(new_jid);
        let mut push = Push {
            job,
            jid,
            guard: None,
            bulk: false,
            claim,
        };
        self.run_chain(&mut push).await
    }

    /// Runs `push` through the client chain; a push made inside a traced span (a job's, while tracing)
    /// gets a `<queue> publish` span and carries its W3C context, as the Ruby gem's client middleware
    /// does (docs/tracing.md).
    async fn run_chain(&self, push: &mut Push) -> Pushed {
        let published = if crate::otel::enabled() {
            publish(push)
        } else {
            None
        };
        let next = ClientNext {
            rest: &self.chain,
            client: self,
        };
        let pushed = next.run(push).await;
        if let Some(cx) = published {
            use opentelemetry::trace::TraceContextExt as _;
            if let Err(e) = &pushed {
                cx.span()
                    .set_status(opentelemetry::trace::Status::error(e.to_string()));
            }
            cx.span().end();
        }
        pushed
    }

    /// The end of the chain: the job to Redis, with its lock when the chain asked for one.
    async fn write(&self, push: &mut Push) -> Pushed {
        // A fake client records the job; its lock or claim, which only Redis could hold, is not taken.
        #[cfg(feature = "testing")]
        if self.fake.is_some() {
            if !push.bulk {
                self.write_many(&push.job, std::slice::from_ref(push))
                    .await?;
            }
            return Ok(Some(push.jid.clone()));
        }
        if let Some(claim) = push.claim.clone() {
            return self.write_claimed(push, &claim).await;
        }
        let Some((key, ttl)) = push.guard.clone() else {
            if !push.bulk {
                self.write_many(&push.job, std::slice::from_ref(push))
                    .await?;
            }
            // In bulk the caller writes every job the chain let through in one pipeline.
            return Ok(Some(push.jid.clone()));
        };
        if push.bulk {
            return Err(Error::Config(
                "a push that takes a lock is pushed one by one, not in bulk".into(),
            ));
        }
        let job = &push.job;
        let tf = self.time_format().await?;
        let now = time::now();
        let payload = job.payload(&push.jid, now, tf);
        let at = job.at.filter(|at| *at > now);
        let pushed =
            until_executed::push(&self.conn, &key, &push.jid, ttl, &job.queue, &payload, at)
                .await?;
        Ok(pushed.then(|| push.jid.clone()))
    }

    /// The end of the chain for a [`Client::push_claimed`]: claim and push in one script.
    async fn write_claimed(&self, push: &mut Push, claim: &Claim) -> Pushed {
        if push.guard.is_some() || push.bulk {
            return Err(Error::Config(
                "a claimed push takes no lock and is not part of a bulk".into(),
            ));
        }
        let payload = push
            .job
            .payload(&push.jid, time::now(), self.time_format().await?);
        let queue = &push.job.queue;
        let mut inv = CLAIM_PUSH.prepare_invoke();
        inv.key(&claim.key)
            .key(keys::QUEUES)
            .key(keys::queue(queue));
        if let Some(twin) = &claim.twin {
            inv.key(twin);
        }
        let pushed: i64 = inv
            .arg(&claim.score)
            .arg(&claim.member)
            .arg(queue)
            .arg(payload)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok((pushed == 1).then(|| push.jid.clone()))
    }

    /// `Sidekiq::Client.push_bulk`: one job per element of `args`, all sharing `template`'s options;
    /// each gets its own jid and goes through the client chain, as in Ruby; the jobs it let through
    /// are pushed in chunks of 1000 (`batch_size`), and their jids returned.
    pub async fn push_bulk<A: Serialize>(
        &self,
        template: NewJob,
        args: impl IntoIterator<Item = A>,
    ) -> Result<Vec<String>> {
        template.validate()?;
        if template.unique_for.is_some() {
            return Err(Error::Config(
                "unique_for jobs are pushed one by one with push_unique, not in bulk".into(),
            ));
        }
        let mut accepted = Vec::new();
        for a in args {
            let mut job = template.clone();
            job.args = NewJob::new("", a).args;
            let mut push = Push {
                job,
                jid: new_jid(),
                guard: None,
                bulk: true,
                claim: None,
            };
            if self.run_chain(&mut push).await?.is_some() {
                accepted.push(push);
            }
        }
        for chunk in accepted.chunks(1000) {
            self.write_many(&template, chunk).await?;
        }
        Ok(accepted.into_iter().map(|p| p.jid).collect())
    }

    /// Writes `pushes` (of `template`'s queue and time) in one pipeline: `ZADD schedule` for a job
    /// that runs later, else `SADD queues` + `LPUSH queue:<q>`.
    async fn write_many(&self, template: &NewJob, pushes: &[Push]) -> Result<()> {
        let tf = self.time_format().await?;
        let now = time::now();
        let payloads: Vec<String> = pushes
            .iter()
            .map(|p| p.job.payload(&p.jid, now, tf))
            .collect();
        #[cfg(feature = "testing")]
        if let Some(fake) = &self.fake {
            record(fake, template, payloads, now);
            return Ok(());
        }
        let mut pipe = redis::pipe();
        match template.at {
            Some(at) if at > now => {
                let mut z = redis::cmd("ZADD");
                z.arg(keys::SCHEDULE);
                for p in &payloads {
                    z.arg(score(at)).arg(p);
                }
                pipe.add_command(z).ignore();
            }
            _ => {
                pipe.cmd("SADD")
                    .arg(keys::QUEUES)
                    .arg(&template.queue)
                    .ignore();
                pipe.cmd("LPUSH")
                    .arg(keys::queue(&template.queue))
                    .arg(&payloads)
                    .ignore();
            }
        }
        pipe.query_async::<()>(&mut self.conn.clone()).await?;
        Ok(())
    }

    /// Enqueues an ActiveJob job that a Ruby ActiveJob class runs (`perform_later`): the `default`
    /// locale and time zone (`en`, `UTC`); [`Client::enqueue_activejob`] sets the rest.
    pub async fn perform_later(
        &self,
        job_class: &str,
        queue: &str,
        arguments: Vec<Value>,
    ) -> Result<String> {
        self.enqueue_activejob(NewActiveJob::new(job_class, arguments).queue(queue))
            .await
    }

    /// Enqueues an ActiveJob job in the shape Rails 7.1+ writes (which Rails 6.1 and 7.0 read too),
    /// through Rails' Sidekiq adapter's wrapper: to its queue, or into `schedule` for a
    /// [`wait`](NewActiveJob::wait)/[`wait_until`](NewActiveJob::wait_until) in the future (as
    /// `enqueue_at` does). Returns the Sidekiq jid (ActiveJob's `provider_job_id`). A reserved
    /// ActiveJob key in an argument hash is an error, as Rails raises `SerializationError`.
    pub async fn enqueue_activejob(&self, job: NewActiveJob) -> Result<String> {
        job.validate().map_err(Error::Config)?;
        self.push(NewJob::from_activejob(&job, chrono::Utc::now()))
            .await
    }
}

/// Integer milliseconds when every live Ruby process reports Sidekiq ≥ 8 (`info.version`); oxidekiq
/// processes are left out (they read both forms); no Ruby process means seconds.
pub async fn detect_time_format(conn: &mut Conn) -> Result<TimeFormat> {
    // One rule for the client and the worker's heartbeat (`fleet.rs`): oxidekiq processes are not
    // readers, and one Ruby reader older than 8.0 means float seconds.
    Ok(crate::fleet::survey(conn).await?.time_format())
}

/// The client half of [`until_executed`] (the server half is a [`ServerMiddleware`](crate::ServerMiddleware)
/// in that module): here, because the client sits above the middleware and the middleware know
/// nothing of the client.
impl ClientMiddleware for until_executed::UntilExecuted {
    /// For a [`NewJob::unique_for`](crate::client::NewJob::unique_for) job: writes the lock's key and
    /// TTL into the payload and has the push take the lock in the same script; other jobs pass as they
    /// are.
    fn call<'a>(&'a self, push: &'a mut Push, next: ClientNext<'a>) -> BoxFuture<'a, Pushed> {
        push.guard = until_executed_fields(&mut push.job);
        next.run(push)
    }
}

/// For a [`NewJob::unique_for`] job: writes the lock's key and TTL into its options, and returns the
/// lock the push takes (its key and TTL, counted from now); `None` for any other job.
pub(crate) fn until_executed_fields(job: &mut NewJob) -> Option<(String, Duration)> {
    let ttl = job.unique_ttl()?;
    let key = until_executed::lock_key(job.class(), job.args());
    job.set_option(until_executed::UNIQUE_KEY_FIELD, Value::String(key.clone()));
    job.set_option(
        until_executed::UNIQUE_TTL_FIELD,
        crate::time::float_value(ttl.as_secs_f64()),
    );
    // A scheduled job is pending from now until it runs: its lock lives that long too.
    let wait = job.at().map_or(0.0, |at| at - crate::time::now());
    Some((
        key,
        ttl + Duration::try_from_secs_f64(wait).unwrap_or(Duration::ZERO),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_has_rubys_keys_and_order() {
        let j = NewJob::new("HardWorker", ("bob", 5)).tags(["a"]);
        let p = j.payload(
            "0123456789abcdef01234567",
            1795291648.5,
            TimeFormat::Seconds,
        );
        assert_eq!(
            p,
            r#"{"retry":true,"queue":"default","tags":["a"],"args":["bob",5],"class":"HardWorker","jid":"0123456789abcdef01234567","created_at":1795291648.5,"enqueued_at":1795291648.5}"#
        );
        let s = NewJob::new("X", ()).run_at(1795291700.0).payload(
            "j",
            1795291648.0,
            TimeFormat::Millis,
        );
        assert_eq!(
            s,
            r#"{"retry":true,"queue":"default","args":[],"class":"X","jid":"j","created_at":1795291648000}"#
        );
    }

    #[test]
    fn a_unique_ttl_the_server_would_refuse_is_refused_at_the_push() {
        for ttl in [
            Duration::ZERO,
            Duration::MAX,
            Duration::from_secs(400_000_000),
        ] {
            let job = NewJob::new("A", (1,)).unique_for(ttl);
            assert!(job.validate().is_err(), "{ttl:?}");
        }
        assert!(
            NewJob::new("A", (1,))
                .unique_for(Duration::from_secs(600))
                .validate()
                .is_ok()
        );
    }

    #[test]
    fn a_single_non_array_argument_becomes_a_one_element_array() {
        assert_eq!(NewJob::new("X", 5).args, json!([5]));
        assert_eq!(NewJob::new("X", (5,)).args, json!([5]));
    }
}
