//! The two error kinds: the runtime's [`Error`] and a job's failure, [`JobError`].
//!
//! [`Error`] is what the runtime itself can meet (Redis, configuration, a payload it could not decode).
//! [`JobError`] is a worker's failure and carries what the retry machinery should do with the job:
//! Sidekiq's default backoff, "retry in N" and `:discard`/`:kill` (the answers of `sidekiq_retry_in`,
//! `job_retry.rb`). Workers use `?` on any `std::error::Error`, as with `anyhow`.

use std::fmt;

/// An error of the runtime (not of a job): what [`Client`](crate::Client) and
/// [`Launcher`](crate::Launcher) calls return.
///
/// ```
/// use oxidekiq::Error;
///
/// fn explain(e: &Error) -> &'static str {
///     match e {
///         e if e.is_connection_error() => "Redis is unreachable: try again later",
///         Error::Config(_) => "fix the flags or sidekiq.yml",
///         _ => "see the message",
///     }
/// }
/// assert_eq!(explain(&Error::Config("-c must be at least 1".into())), "fix the flags or sidekiq.yml");
/// ```
#[derive(Debug)]
pub enum Error {
    /// Redis answered with an error or the connection failed.
    Redis(redis::RedisError),
    /// The configuration (flags, `sidekiq.yml`, environment) is not usable; the message says why.
    Config(String),
    /// A payload could not be decoded; the job goes to the dead or retry set with this message.
    Payload(String),
    /// A lock could not be acquired before its deadline.
    LockNotAcquired(String),
    /// An I/O error (signals, files).
    Io(std::io::Error),
}

impl Error {
    /// True when the error is a dropped or refused connection: retrying later is the cure.
    pub fn is_connection_error(&self) -> bool {
        match self {
            Error::Redis(e) => {
                e.is_connection_dropped()
                    || e.is_connection_refusal()
                    || e.is_timeout()
                    || e.is_io_error()
            }
            Error::Io(_) => true,
            _ => false,
        }
    }

    /// What kind of fault a Redis error that will not mend by itself is, for a log line: an ACL's
    /// refusal (Redis's text names the refused command), a key of the wrong type, out of memory, or a
    /// failure of another kind. An ACL refusal read "a key of the wrong type?" before (issue 43).
    pub(crate) fn fault(&self) -> &'static str {
        let Error::Redis(e) = self else {
            return "not a Redis error";
        };
        let text = e.to_string();
        match e.code() {
            Some("NOPERM") => "refused by an ACL (the error names the command)",
            Some("WRONGTYPE") => "a key of the wrong type",
            Some("OOM") => "Redis is out of memory",
            _ if text.contains("NOPERM") => "refused by an ACL (the error names the command)",
            _ if text.contains("WRONGTYPE") || text.contains(" is a ") => "a key of the wrong type",
            _ if self.is_outage() => "Redis is away or busy",
            _ => "an error that will not mend by itself",
        }
    }

    /// True when the error says Redis is away or busy for now (a dropped or refused connection, a
    /// timeout, a server still loading, a failover under way, a busy script): waiting and trying again
    /// is the cure. False for an error that stays until someone acts (a key of the wrong type, out of
    /// memory, a script error): retrying it in a loop only hides it.
    pub fn is_outage(&self) -> bool {
        if self.is_connection_error() {
            return true;
        }
        let Error::Redis(e) = self else {
            return false;
        };
        e.code().is_some_and(|code| OUTAGE_CODES.contains(&code))
    }
}

/// The error codes of a Redis that cannot serve or take writes for now and mends by itself: loading
/// its data, a busy script, a failover under way (`READONLY` from a server demoted to replica,
/// `MASTERDOWN`, `TRYAGAIN`, `CLUSTERDOWN`), or too few replicas for `min-replicas-to-write`
/// (`NOREPLICAS`, which a replica's link blip causes).
pub(crate) const OUTAGE_CODES: &[&str] = &[
    "LOADING",
    "BUSY",
    "TRYAGAIN",
    "MASTERDOWN",
    "CLUSTERDOWN",
    "READONLY",
    "NOREPLICAS",
];

/// The outage code a script's own error text carries, if any: a script reports a write that `pcall`
/// refused as `<key> is a <type>, not a <type>: <Redis's error>`, and Redis's error starts with its code.
/// Only the last part is read: a key name (a queue's, from a payload) may hold `: READONLY` itself.
pub(crate) fn outage_code_in(text: &str) -> Option<&'static str> {
    let (_, last) = text.rsplit_once(": ")?;
    let code = last.split(' ').next()?;
    OUTAGE_CODES.iter().find(|c| **c == code).copied()
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Redis(e) => write!(f, "redis: {e}"),
            Error::Config(m) => write!(f, "configuration: {m}"),
            Error::Payload(m) => write!(f, "payload: {m}"),
            Error::LockNotAcquired(m) => write!(f, "lock not acquired: {m}"),
            Error::Io(e) => write!(f, "io: {e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Redis(e) => Some(e),
            Error::Io(e) => Some(e),
            _ => None,
        }
    }
}

impl From<redis::RedisError> for Error {
    fn from(e: redis::RedisError) -> Self {
        Error::Redis(e)
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e)
    }
}

/// Result alias of the runtime: [`Error`] unless said otherwise.
///
/// ```no_run
/// async fn enqueue() -> oxidekiq::Result<String> {
///     let client = oxidekiq::Client::connect("redis://127.0.0.1:6379").await?;
///     client.perform_async("HardWorker", ("bob", 5)).await
/// }
/// ```
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `error_class` of a job whose payload holds a field the runtime cannot use (a `unique_ttl` out of
/// range, ...): a job failure like any other, so the job is kept in the retry set, then the dead set.
pub const INVALID_PAYLOAD: &str = "Oxidekiq::InvalidPayload";

/// `error_class` of a job cancelled at its timeout (the worker's `timeout` option or the payload's
/// `oxidekiq_timeout`): a job failure, with Sidekiq's backoff.
pub const JOB_TIMEOUT: &str = "Oxidekiq::JobTimeout";

/// `error_class` of a job whose run panicked (in the worker, a middleware or oxidekiq itself): a job
/// failure like a raised exception, with the panic's message as `error_message`.
pub const PANIC: &str = "Oxidekiq::Panic";

/// What the retry machinery does with a failed job (Sidekiq's `sidekiq_retry_in` answers, plus
/// `Reschedule`, which is not a failure at all). [`JobError`]'s builders set it.
///
/// ```
/// use oxidekiq::{JobError, RetryAction};
///
/// assert_eq!(JobError::msg("busy").action, RetryAction::Default);
/// assert_eq!(JobError::msg("rate limited").retry_in(60).action, RetryAction::In(60));
/// assert_eq!(JobError::msg("gone").discard().action, RetryAction::Discard);
/// assert_eq!(JobError::msg("bad input").kill().action, RetryAction::Kill);
/// assert_eq!(JobError::reschedule(5.0, "not yet").action, RetryAction::Reschedule(5.0));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RetryAction {
    /// Sidekiq's backoff: `count**4 + 15 + jitter` seconds.
    Default,
    /// Retry in this many seconds plus Sidekiq's jitter (a positive Integer from `sidekiq_retry_in`;
    /// 0 means the default backoff, as in Ruby).
    In(u64),
    /// Drop the job: no retry, no dead set (`:discard`).
    Discard,
    /// Send it to the dead set at once (`:kill`).
    Kill,
    /// Not a failure: put the original payload in the `schedule` set to run in this many seconds,
    /// without touching `retry_count` or the failed counter (limits and unique "reschedule" use it).
    Reschedule(f64),
    /// Not a failure of the job's own: push the payload back to the end of its queue with a new
    /// `enqueued_at`, nothing else changed, no retry (an iterable job interrupted between two items,
    /// as Sidekiq 8's `InterruptHandler` does). Counted as processed and failed in `stat:*`, as 8.1.7
    /// counts it.
    Requeue,
    /// Not a failure: a Rails 8.1 Continuable job interrupted at a checkpoint
    /// ([`crate::continuable`]). The payload Rails' `retry_job` would push (a new jid, the updated
    /// `job_data`) goes to the `schedule` set at this epoch time, in the same script that ends the
    /// running job's stay, which counts as a success. Only the continuable wrapper builds it (the new
    /// `job_data` rides on the error); set by hand, without one, it reschedules the payload as it is.
    Continue(f64),
}

/// A job's failure: what Ruby would store as `error_class` and `error_message`, and what to do next.
///
/// Any `std::error::Error` converts with `?` (its type name as the class, the chain of sources in
/// the message), as with `anyhow`; the builders pick the class and what happens next.
///
/// ```
/// use oxidekiq::{JobContext, JobError, JobResult, Worker};
///
/// #[derive(Debug)]
/// struct ImportJob;
///
/// impl Worker for ImportJob {
///     const CLASS: &'static str = "ImportJob";
///     type Args = (String,);
///
///     async fn perform(&self, _ctx: &JobContext, (count,): Self::Args) -> JobResult {
///         let n: u32 = count.parse()?; // ParseIntError: the retry set, with Sidekiq's backoff
///         if n == 0 {
///             // Like `raise ArgumentError` with `sidekiq_retry_in { :kill }`: straight to the dead set.
///             return Err(JobError::new("ArgumentError", "nothing to import").kill());
///         }
///         if n > 1000 {
///             return Err(JobError::msg("too many at once").retry_in(300)); // retry in 5 minutes
///         }
///         Ok(())
///     }
/// }
/// ```
#[derive(Debug)]
pub struct JobError {
    /// Shown as `error_class` in the retry and dead sets.
    pub class: String,
    /// Shown as `error_message` (cut to 10 000 characters when written).
    pub message: String,
    /// The lines stored as `error_backtrace` when the `backtrace` option asks for them.
    pub backtrace: Vec<String>,
    /// What the retry machinery does next.
    pub action: RetryAction,
    /// For [`RetryAction::Continue`]: the next run to push (set by the continuable wrapper).
    pub(crate) resume: Option<Box<Resume>>,
}

/// What an interrupted Continuable job's fate write pushes besides the job itself.
#[derive(Debug)]
pub(crate) struct Resume {
    /// The next run's `job_data` (set by the continuable wrapper).
    pub job_data: serde_json::Map<String, serde_json::Value>,
    /// The until-executed lock the interrupted run holds, passed to the next run's jid by the same
    /// script that schedules it (set by the until-executed middleware).
    pub lock: Option<LockHandOver>,
}

/// An until-executed lock to pass to an interrupted job's next run, in its fate write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LockHandOver {
    /// The lock's key.
    pub key: String,
    /// The value the interrupted run holds it under (`<token>:<jid>`): only that value (or no value,
    /// the lock expired) is replaced.
    pub value: String,
    /// The lock's TTL, in milliseconds.
    pub ttl_ms: u64,
}

impl JobError {
    /// A failure with an explicit error class (as Ruby would print it, e.g. `"ArgumentError"`).
    pub fn new(class: impl Into<String>, message: impl Into<String>) -> Self {
        JobError {
            class: class.into(),
            message: message.into(),
            backtrace: Vec::new(),
            action: RetryAction::Default,
            resume: None,
        }
    }

    /// A failure with class `RuntimeError`, like Ruby's `raise "message"`.
    pub fn msg(message: impl Into<String>) -> Self {
        JobError::new("RuntimeError", message)
    }

    /// Retry in `seconds` (plus Sidekiq's jitter, `rand(10) * (count + 1)`) instead of the default backoff.
    pub fn retry_in(mut self, seconds: u64) -> Self {
        self.action = RetryAction::In(seconds);
        self
    }

    /// Drop the job without retrying it and without a dead-set entry.
    pub fn discard(mut self) -> Self {
        self.action = RetryAction::Discard;
        self
    }

    /// Send the job straight to the dead set.
    pub fn kill(mut self) -> Self {
        self.action = RetryAction::Kill;
        self
    }

    /// Put the job back in the schedule set in `seconds`, not counted as a failure.
    pub fn reschedule(seconds: f64, reason: impl Into<String>) -> Self {
        JobError {
            class: "Oxidekiq::Rescheduled".into(),
            message: reason.into(),
            backtrace: Vec::new(),
            action: RetryAction::Reschedule(seconds),
            resume: None,
        }
    }

    /// Push the job back to its queue, unchanged but for `enqueued_at`, without a retry
    /// ([`RetryAction::Requeue`]).
    pub fn requeue(mut self) -> Self {
        self.action = RetryAction::Requeue;
        self
    }

    /// Attach backtrace lines (stored when the worker's `backtrace` option asks for them).
    pub fn with_backtrace(mut self, lines: Vec<String>) -> Self {
        self.backtrace = lines;
        self
    }
}

impl fmt::Display for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.class, self.message)
    }
}

/// Ruby-style class name from a Rust type name: generics dropped, `std::io::error::Error` kept as a
/// path so the UI shows where the error came from.
fn class_of<E: ?Sized>() -> String {
    let name = std::any::type_name::<E>();
    let base = name.split('<').next().unwrap_or(name);
    base.to_string()
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for JobError {
    fn from(e: E) -> Self {
        let mut message = e.to_string();
        let mut source = e.source();
        while let Some(s) = source {
            message.push_str(": ");
            message.push_str(&s.to_string());
            source = s.source();
        }
        JobError::new(class_of::<E>(), message)
    }
}

/// What a job's run returns: `Ok(())` when done, or the [`JobError`] that decides its retry.
///
/// ```
/// use oxidekiq::{JobError, JobResult};
///
/// fn check(amount: f64) -> JobResult {
///     if amount <= 0.0 {
///         return Err(JobError::new("ArgumentError", "amount must be positive"));
///     }
///     Ok(())
/// }
/// assert_eq!(check(-1.0).unwrap_err().class, "ArgumentError");
/// ```
pub type JobResult = std::result::Result<(), JobError>;

/// Where a failed job ended: what the retry machinery (`retry::plan`) decided and wrote. Defined here,
/// at the bottom, so that the Prometheus counters can count it.
#[derive(Debug, Clone, PartialEq)]
pub enum Fate {
    /// In the retry set, to run at this epoch time.
    Retry {
        /// Score of the retry-set entry.
        at: f64,
        /// The new `retry_count`.
        count: i64,
    },
    /// In the dead set.
    Dead,
    /// Dropped on purpose (`retry: false`, `dead: false`, or a `discard` answer), as Ruby drops it.
    Discarded,
    /// Back in the schedule set, unchanged, not counted as a failure.
    Rescheduled {
        /// Score of the schedule-set entry.
        at: f64,
    },
    /// Pushed back to the end of its queue, unchanged but for `enqueued_at` ([`RetryAction::Requeue`]).
    Requeued,
    /// A Continuable job interrupted at a checkpoint: its next run, under a new jid, is in the
    /// schedule set ([`RetryAction::Continue`]).
    Continued {
        /// Score of the schedule-set entry.
        at: f64,
        /// The new jid.
        jid: String,
    },
}

/// Polls `fut`, turning a panic inside it into `Err` with the panic's payload.
///
/// Why here and not `JoinError::is_panic` on the task: the manager's processors are long-lived tasks
/// that know nothing of the job; catching in the processor keeps the job, its in-flight entry and whether its
/// fate was written, so the failure is written like any other. Why not `futures`' `catch_unwind`: these
/// dozen lines (pin on the stack, `poll_fn`, no `unsafe`, no allocation) are all of it.
/// `AssertUnwindSafe` is sound here: after a panic the future is dropped, never polled again, and the
/// state it shares (the processor's run state, the work table) is only read under locks a panic cannot poison
/// mid-update.
///
/// It takes the future pinned where the caller built it (`std::pin::pin!(...)`): taken by value, a
/// job's future (the whole run's state machine, several KB) was copied into this future's state and
/// again into the pinned slot, at each of the two nested guards, for every job.
pub(crate) async fn catch_unwind<F: std::future::Future>(
    mut fut: std::pin::Pin<&mut F>,
) -> std::result::Result<F::Output, Box<dyn std::any::Any + Send>> {
    std::future::poll_fn(move |cx| {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fut.as_mut().poll(cx))) {
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Ok(std::task::Poll::Ready(v)) => std::task::Poll::Ready(Ok(v)),
            Err(panic) => std::task::Poll::Ready(Err(panic)),
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn question_mark_turns_any_error_into_a_job_error_with_its_type_as_class() {
        fn parse() -> JobResult {
            let _n: i32 = "x".parse()?;
            Ok(())
        }
        let e = parse().unwrap_err();
        assert_eq!(e.class, "core::num::error::ParseIntError");
        assert_eq!(e.message, "invalid digit found in string");
        assert_eq!(e.action, RetryAction::Default);
    }

    #[test]
    fn an_outage_is_told_apart_from_a_damaged_key() {
        let io: Error =
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
                .into();
        assert!(io.is_outage());
        let wrong: Error = redis::RedisError::from((
            redis::ErrorKind::UnexpectedReturnType,
            "a key has the wrong type",
            "retry is a string, not a sorted set".to_string(),
        ))
        .into();
        assert!(!wrong.is_outage());
        assert!(!Error::Config("x".into()).is_outage());
        let refused =
            "queue:a is a none, not a list: READONLY You can't write against a read only replica.";
        assert_eq!(outage_code_in(refused), Some("READONLY"));
        let named =
            "queue:x: READONLY y is a string, not a list: WRONGTYPE Operation against a key";
        assert_eq!(outage_code_in(named), None, "a key's name is not the error");
    }

    #[test]
    fn builders_set_the_retry_action() {
        assert_eq!(JobError::msg("x").retry_in(7).action, RetryAction::In(7));
        assert_eq!(JobError::msg("x").kill().action, RetryAction::Kill);
        assert_eq!(JobError::msg("x").discard().action, RetryAction::Discard);
    }
}
