//! Logs through `tracing`, printed in Sidekiq's own line shape so tooling that reads Sidekiq logs works:
//!
//! ```text
//! 2026-11-21T20:02:30.411Z pid=4242 tid=2c8 class=HardWorker jid=ecf8fc8053b3a18fd1a94b54 elapsed=0.007 INFO: done
//! ```
//!
//! Mirrors `logger.rb` (`Sidekiq::Logger::Formatters::Pretty` without colour): UTC time with
//! milliseconds, `pid`, `tid`, the job's context (`class`, `jid` from the job span), the event's own
//! fields, then `LEVEL: message`. Lines are appended to a shared buffer ([`Sink`]) that a background thread writes
//! out at most every 20 ms (asleep while no line comes; the first line into the empty buffer wakes it),
//! so a job never waits on the terminal and a busy process does not wake a writer thread per line; past 1 MiB the logging thread writes the buffer itself (back-pressure, no line is
//! ever dropped). The subscriber is this module's own [`Logger`], built for the two lines every job
//! logs: see there for why not `tracing_subscriber`'s. Those two lines ([`job_line`]) the processor
//! writes straight into it when it is the subscriber, in the text format, with OpenTelemetry off: the
//! same bytes as the `tracing` events would make, without the event's dispatch and field visitors.
//!
//! Every line is escaped before it is written ([`write_escaped`]; as a whole, or, for the two job
//! lines written directly, span by span, each span's text tested once when it is recorded): a
//! newline, a carriage return, an ANSI escape or a bidirectional override from a payload or from
//! Redis (a class, a jid, a queue name, an error message, an ActiveJob wrapped class) is written as
//! `\n`, `\u{1b}`, ..., so a crafted payload cannot print a fake line or recolour the terminal.
//! Panic messages are logged through the same path, with any Redis URL in them redacted.
//!
//! `--log-format json` ([`LogFormat::Json`]) writes one JSON object per line instead,
//! for log shippers, with the same fields: `time`, `pid`, `tid`, `level`, `message`, the job's
//! `class`, `jid`, `queue`, then the event's own fields (`elapsed` as a number):
//!
//! ```text
//! {"time":"2026-11-21T20:02:30.411Z","pid":4242,"tid":"2c8","level":"INFO","class":"HardWorker","jid":"ecf8fc8053b3a18fd1a94b54","queue":"default","elapsed":0.007,"message":"done"}
//! ```
//!
//! serde_json does the escaping there: a control character in a value is written `\n`, `\u001b`, so
//! a payload cannot break a line in this format either.

use std::cell::RefCell;
use std::fmt::{self, Write as _};
use std::io::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_core::span::Current;

mod escape;
mod json;
mod otel_context;
mod panic_hook;
mod spans;
mod subscriber;
#[cfg(test)]
mod tests;
mod text;
mod writer;

pub(crate) use escape::{MAX_VALUE_CHARS, escape, needs_escape, write_escaped};
use escape::{clip_tail, clipped};
use json::{JsonFieldList, set_field};
use otel_context::OtelFields;
pub(crate) use otel_context::{attach_otel, current_otel};
use panic_hook::install_panic_hook;
use spans::{INSTANCES, Slot, Spans, index_of};
use text::{Fields, JobText, SpanText, write_time};
pub(crate) use text::{JOB_TARGET, job_line};
use writer::FLUSH_AT;
pub(crate) use writer::{Sink, init_with, warn_early};

/// How log lines are written (`--log-format`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Sidekiq's line (the default).
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// The least severe lines written (`--log-level`; `-v` is `debug`). Sidekiq's `logger.level`: at `warn` a
/// job's start and done lines (INFO) are not written, as a Ruby app that sets
/// `Sidekiq.logger.level = Logger::WARN` stops them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    /// Everything, debug lines included (`-v`).
    Debug,
    /// Sidekiq's default: a start and a done line per job, and what the process does.
    #[default]
    Info,
    /// Warnings and errors only: no per-job lines.
    Warn,
    /// Errors only.
    Error,
}

impl LogLevel {
    /// The `tracing` filter of this level.
    pub(crate) fn filter(self) -> LevelFilter {
        match self {
            LogLevel::Debug => LevelFilter::DEBUG,
            LogLevel::Info => LevelFilter::INFO,
            LogLevel::Warn => LevelFilter::WARN,
            LogLevel::Error => LevelFilter::ERROR,
        }
    }
}

/// The subscriber: spans and events straight into Sidekiq-shaped lines.
///
/// It replaces `tracing_subscriber`'s fmt subscriber, whose registry gave every span (one per job) a
/// `sharded_slab` slot, a type map of extensions and a boxed `String` of formatted fields, and whose
/// formatter went through `core::fmt` for every piece of a line: a third of a no-op job's instructions.
/// Here a span is a slot in a small table whose strings keep their capacity from one job to the next,
/// the current span is a per-thread stack of ids, and a line is built with direct writes into a buffer
/// reused per thread, then escaped into the shared buffer under one lock.
pub(crate) struct Logger {
    /// The most verbose level written.
    max: LevelFilter,
    /// Text or JSON lines.
    format: LogFormat,
    /// Where finished lines go (written out by the flusher thread).
    out: Arc<Sink>,
    /// Live spans, by id - 1.
    spans: Mutex<Spans>,
    /// Tells this subscriber's entries on the per-thread span stack from another's (tests install a
    /// second one with `with_default` on threads that the global one also logs from).
    instance: usize,
}

impl fmt::Debug for Logger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Logger")
            .field("max", &self.max)
            .field("format", &self.format)
            .finish_non_exhaustive()
    }
}

fn level_name(level: &Level) -> &'static str {
    match *level {
        Level::ERROR => "ERROR",
        Level::WARN => "WARN",
        Level::INFO => "INFO",
        Level::DEBUG => "DEBUG",
        Level::TRACE => "TRACE",
    }
}

fn pid() -> u32 {
    static PID: OnceLock<u32> = OnceLock::new();
    *PID.get_or_init(std::process::id)
}

thread_local! {
    /// ` pid=<pid> tid=<tid>`: Ruby's tid is `(Thread.object_id ^ pid).to_s(36)`; ours is the OS
    /// thread's id, likewise.
    static PID_TID: String = {
        let name = format!("{:?}", std::thread::current().id());
        let n: u64 = name.chars().filter(char::is_ascii_digit).collect::<String>().parse().unwrap_or(0);
        format!(" pid={} tid={}", pid(), crate::encoding::to_base36(n ^ u64::from(pid())))
    };
    /// This thread's reusable line buffer (the line before escaping).
    static LINE: RefCell<String> = const { RefCell::new(String::new()) };
    /// This thread's reusable buffer for a new span's fields.
    static SCRATCH: RefCell<String> = const { RefCell::new(String::new()) };
    /// This thread's reusable field buffers.
    static FIELDS: RefCell<Fields> = RefCell::new(Fields::default());
    /// The formatted `YYYY-MM-DDTHH:MM:SS` of the last second seen on this thread.
    static SECOND: RefCell<(i64, String)> = const { RefCell::new((i64::MIN, String::new())) };
    /// [`SECOND`]'s text as bytes for the direct lines ([`text::stamp_at`]): a copy, no borrow.
    static DATE: std::cell::Cell<(i64, [u8; 19])> = const { std::cell::Cell::new((i64::MIN, [0; 19])) };
    /// The spans this thread is in, innermost last, tagged with their subscriber's instance.
    static STACK: RefCell<Vec<(usize, usize)>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on this thread's buffer in `key`, or on a fresh one when it is in use (a line logged while
/// another is being formatted: a `Debug` impl that logs) or gone (thread teardown).
fn with_reused<T: Default, R: Default>(
    key: &'static std::thread::LocalKey<RefCell<T>>,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    let mut f = Some(f);
    let reused = key.try_with(|cell| {
        let mut fresh = None;
        let mut borrowed = cell.try_borrow_mut();
        let buf = match borrowed.as_deref_mut() {
            Ok(b) => b,
            Err(_) => fresh.insert(T::default()),
        };
        f.take().map(|f| f(buf))
    });
    match (reused, f) {
        (Ok(Some(r)), _) => r,
        (_, Some(f)) => f(&mut T::default()),
        // Not reached: `f` is gone only once it has run.
        (_, None) => R::default(),
    }
}
