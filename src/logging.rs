//! Logs through `tracing`, printed in Sidekiq's own line shape so tooling that reads Sidekiq logs works:
//!
//! ```text
//! 2026-11-21T20:02:30.411Z pid=4242 tid=2c8 class=HardWorker jid=ecf8fc8053b3a18fd1a94b54 elapsed=0.007 INFO: done
//! ```
//!
//! Mirrors `logger.rb` (`Sidekiq::Logger::Formatters::Pretty` without colour): UTC time with
//! milliseconds, `pid`, `tid`, the job's context (`class`, `jid` from the job span), the event's own
//! fields, then `LEVEL: message`. Lines go through a non-blocking writer (a dedicated thread), so a job
//! never waits on the terminal; it applies back-pressure instead of dropping lines.

use std::fmt::{self, Write as _};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// Keeps the log writer thread alive; dropping it flushes what is buffered.
pub type LogGuard = tracing_appender::non_blocking::WorkerGuard;

/// Formats events as Sidekiq lines.
#[derive(Debug, Default, Clone, Copy)]
pub struct SidekiqFormat;

/// Collects an event's message and its other fields as `key=value`.
#[derive(Default)]
struct Fields {
    message: String,
    rest: String,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.rest, " {}={}", field.name(), value);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.rest, " {}={:?}", field.name(), value);
        }
    }
}

fn thread_tid() -> String {
    // Ruby's tid is `(Thread.object_id ^ pid).to_s(36)`; ours is the OS thread's id, likewise.
    let name = format!("{:?}", std::thread::current().id());
    let n: u64 = name
        .chars()
        .filter(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .unwrap_or(0);
    crate::processor::to_base36(n ^ u64::from(std::process::id()))
}

impl<S, N> FormatEvent<S, N> for SidekiqFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let now = chrono::Utc::now().format("%Y-%m-%dT%H:%M:%S%.3fZ");
        write!(
            writer,
            "{now} pid={} tid={}",
            std::process::id(),
            thread_tid()
        )?;
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                if let Some(fields) = span.extensions().get::<FormattedFields<N>>()
                    && !fields.is_empty()
                {
                    write!(writer, " {fields}")?;
                }
            }
        }
        let mut f = Fields::default();
        event.record(&mut f);
        let level = match *event.metadata().level() {
            Level::ERROR => "ERROR",
            Level::WARN => "WARN",
            Level::INFO => "INFO",
            Level::DEBUG => "DEBUG",
            Level::TRACE => "TRACE",
        };
        writeln!(writer, "{} {level}: {}", f.rest, f.message)
    }
}

/// Installs the Sidekiq-shaped logger on stdout; `verbose` turns on debug lines.
pub fn init(verbose: bool) -> LogGuard {
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(false)
        .buffered_lines_limit(64 * 1024)
        // Buffered: the writer thread flushes whenever its queue is empty, so a burst of lines costs one
        // write instead of one per line (stdout alone is line-buffered).
        .finish(std::io::BufWriter::with_capacity(64 * 1024, std::io::stdout()));
    let level = if verbose {
        tracing::level_filters::LevelFilter::DEBUG
    } else {
        tracing::level_filters::LevelFilter::INFO
    };
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(writer)
        .event_format(SidekiqFormat)
        .finish();
    // A second init (tests) keeps the first subscriber.
    let _ = tracing::subscriber::set_global_default(subscriber);
    guard
}
