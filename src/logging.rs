//! Logs through `tracing`, printed in Sidekiq's own line shape so tooling that reads Sidekiq logs works:
//!
//! ```text
//! 2026-11-21T20:02:30.411Z pid=4242 tid=2c8 class=HardWorker jid=ecf8fc8053b3a18fd1a94b54 elapsed=0.007 INFO: done
//! ```
//!
//! Mirrors `logger.rb` (`Sidekiq::Logger::Formatters::Pretty` without colour): UTC time with
//! milliseconds, `pid`, `tid`, the job's context (`class`, `jid` from the job span), the event's own
//! fields, then `LEVEL: message`. Lines are appended to a shared buffer that a background thread writes
//! out every 20 ms, so a job never waits on the terminal and a busy process does not wake a writer
//! thread per line; past 1 MiB the logging thread writes the buffer itself (back-pressure, no line is
//! ever dropped).
//!
//! Every line is escaped as a whole before it is written ([`write_escaped`]): a newline, a carriage
//! return, an ANSI escape or a bidirectional override from a payload or from Redis (a class, a jid, a
//! queue name, an error message, an ActiveJob wrapped class) is written as `\n`, `\u{1b}`, ..., so a
//! crafted payload cannot print a fake line or recolour the terminal. Panic messages are logged
//! through the same path, with any Redis URL in them redacted.
//!
//! `--log-format json` ([`LogFormat::Json`], [`JsonFormat`]) writes one JSON object per line instead,
//! for log shippers, with the same fields: `time`, `pid`, `tid`, `level`, `message`, the job's
//! `class`, `jid`, `queue`, then the event's own fields (`elapsed` as a number):
//!
//! ```text
//! {"time":"2026-11-21T20:02:30.411Z","pid":4242,"tid":"2c8","level":"INFO","class":"HardWorker","jid":"ecf8fc8053b3a18fd1a94b54","queue":"default","elapsed":0.007,"message":"done"}
//! ```
//!
//! serde_json does the escaping there: a control character in a value is written `\n`, `\u001b`, so
//! a payload cannot break a line in this format either.

use std::fmt::{self, Write as _};
use std::io::Write as _;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// Flushes what is buffered when dropped (at exit).
#[derive(Debug)]
pub struct LogGuard {
    /// The shared buffer.
    buffer: Arc<Mutex<Vec<u8>>>,
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        flush(&self.buffer);
    }
}

/// Buffered bytes past which the logging thread writes them out itself.
const FLUSH_AT: usize = 1 << 20;

fn flush(buffer: &Mutex<Vec<u8>>) {
    let bytes = match buffer.lock() {
        Ok(mut b) => std::mem::replace(&mut *b, Vec::with_capacity(64 * 1024)),
        Err(_) => return,
    };
    if !bytes.is_empty() {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(&bytes);
        let _ = out.flush();
    }
}

/// The writer tracing formats into: appends to the shared buffer.
#[derive(Debug, Clone)]
struct SharedBuffer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for SharedBuffer {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let full = match self.0.lock() {
            Ok(mut b) => {
                b.extend_from_slice(data);
                b.len() > FLUSH_AT
            }
            Err(_) => false,
        };
        if full {
            flush(&self.0);
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for SharedBuffer {
    type Writer = SharedBuffer;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// How log lines are written (`--log-format`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Sidekiq's line (the default).
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Formats events as Sidekiq lines.
#[derive(Debug, Default, Clone, Copy)]
pub struct SidekiqFormat;

/// Collects an event's message and its other fields as `key=value`; reused per thread, so a log line
/// allocates nothing once the buffers have grown.
#[derive(Default)]
struct Fields {
    message: String,
    rest: String,
}

impl Fields {
    fn clear(&mut self) {
        self.message.clear();
        self.rest.clear();
    }
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
        format!(" pid={} tid={}", pid(), crate::processor::to_base36(n ^ u64::from(pid())))
    };
    /// This thread's reusable line buffer (the line before escaping).
    static LINE: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
    /// This thread's reusable field buffers.
    static FIELDS: std::cell::RefCell<Fields> = std::cell::RefCell::new(Fields::default());
    /// The formatted `YYYY-MM-DDTHH:MM:SS` of the last second seen on this thread.
    static SECOND: std::cell::RefCell<(i64, String)> = const { std::cell::RefCell::new((i64::MIN, String::new())) };
}

/// `2026-11-21T20:02:30.411Z`: the date part is formatted once per second per thread.
fn write_time(w: &mut Writer<'_>) -> fmt::Result {
    let now = chrono::Utc::now();
    let secs = now.timestamp();
    let millis = now.timestamp_subsec_millis();
    SECOND.with(|cell| {
        let mut c = cell.borrow_mut();
        if c.0 != secs {
            c.0 = secs;
            c.1 = now.format("%Y-%m-%dT%H:%M:%S").to_string();
        }
        write!(w, "{}.{millis:03}Z", c.1)
    })
}

impl<S, N> FormatEvent<S, N> for SidekiqFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut out: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        // The line is built whole, then written with its control characters escaped: queue names,
        // classes, jids and error messages come from payloads and Redis, and escaping the finished
        // line covers every field, span or event, in this one place.
        LINE.with(|cell| {
            let mut fresh = String::new();
            let mut borrowed = cell.try_borrow_mut();
            let line = match borrowed.as_deref_mut() {
                Ok(l) => l,
                Err(_) => &mut fresh,
            };
            line.clear();
            self.format_line(ctx, Writer::new(line), event)?;
            write_escaped(&mut out, line)?;
            out.write_char('\n')
        })
    }
}

impl SidekiqFormat {
    /// The line, unescaped and without its newline.
    fn format_line<S, N>(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result
    where
        S: Subscriber + for<'a> LookupSpan<'a>,
        N: for<'a> FormatFields<'a> + 'static,
    {
        write_time(&mut writer)?;
        PID_TID.with(|p| writer.write_str(p))?;
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                if let Some(fields) = span.extensions().get::<FormattedFields<N>>()
                    && !fields.is_empty()
                {
                    write!(writer, " {fields}")?;
                }
            }
        }
        let level = match *event.metadata().level() {
            Level::ERROR => "ERROR",
            Level::WARN => "WARN",
            Level::INFO => "INFO",
            Level::DEBUG => "DEBUG",
            Level::TRACE => "TRACE",
        };
        FIELDS.with(|cell| {
            // A log line written while formatting another (never in practice) gets fresh buffers.
            let mut fresh = Fields::default();
            let mut borrowed = cell.try_borrow_mut();
            let f = match borrowed.as_deref_mut() {
                Ok(f) => f,
                Err(_) => &mut fresh,
            };
            f.clear();
            event.record(f);
            writer.write_str(&f.rest)?;
            writer.write_char(' ')?;
            writer.write_str(level)?;
            writer.write_str(": ")?;
            writer.write_str(&f.message)
        })
    }
}

/// True for a character that must not reach a log line raw: C0 and C1 controls (newline, carriage
/// return, the ESC of ANSI sequences, ...), DEL, the Unicode line and paragraph separators (some
/// viewers break lines there) and the bidirectional overrides that reorder what a reader sees.
pub fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{200f}')
        || ('\u{202a}'..='\u{202e}').contains(&c)
        || ('\u{2066}'..='\u{2069}').contains(&c)
}

/// Writes `s` with every character of [`needs_escape`] written as an escape: `\n`, `\r`, `\t`, else
/// `\u{..}` (as Rust's `escape_debug` does). Anything else, backslashes included, is written as is.
pub fn write_escaped(out: &mut impl fmt::Write, s: &str) -> fmt::Result {
    // Most lines are printable ASCII: one scan, one write.
    if s.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return out.write_str(s);
    }
    let mut start = 0;
    for (i, c) in s.char_indices() {
        if needs_escape(c) {
            out.write_str(&s[start..i])?;
            match c {
                '\n' => out.write_str("\\n")?,
                '\r' => out.write_str("\\r")?,
                '\t' => out.write_str("\\t")?,
                c => write!(out, "\\u{{{:x}}}", u32::from(c))?,
            }
            start = i + c.len_utf8();
        }
    }
    out.write_str(&s[start..])
}

/// `s` with control characters escaped (see [`write_escaped`]), for text written outside the logger.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let _ = write_escaped(&mut out, s);
    out
}

/// Installs the Sidekiq-shaped logger on stdout; `verbose` turns on debug lines. Keep the guard alive
/// until exit: dropping it writes out what is still buffered.
pub fn init(verbose: bool) -> LogGuard {
    init_with(verbose, LogFormat::Text)
}

/// As [`init`], in the given format.
pub fn init_with(verbose: bool, format: LogFormat) -> LogGuard {
    let buffer = Arc::new(Mutex::new(Vec::with_capacity(64 * 1024)));
    let flusher = Arc::downgrade(&buffer);
    // The flusher ends by itself once the guard and the subscriber's writer are gone.
    let _ = std::thread::Builder::new()
        .name("oxidekiq-log".into())
        .spawn(move || {
            while let Some(buffer) = flusher.upgrade() {
                flush(&buffer);
                drop(buffer);
                std::thread::sleep(Duration::from_millis(20));
            }
        });
    let level = if verbose {
        tracing::level_filters::LevelFilter::DEBUG
    } else {
        tracing::level_filters::LevelFilter::INFO
    };
    let builder = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(SharedBuffer(buffer.clone()));
    // A second init (tests) keeps the first subscriber.
    let installed = match format {
        LogFormat::Text => {
            tracing::subscriber::set_global_default(builder.event_format(SidekiqFormat).finish())
        }
        LogFormat::Json => tracing::subscriber::set_global_default(
            builder
                .fmt_fields(JsonFields)
                .event_format(JsonFormat)
                .finish(),
        ),
    };
    if installed.is_ok() {
        install_panic_hook();
    }
    LogGuard { buffer }
}

/// Routes panic messages through the logger instead of the default hook's raw `eprintln`: a panic
/// message may quote a payload (escaped like every line) or a Redis URL (redacted). The previous
/// hook still runs if this one is re-entered (a panic while logging a panic).
fn install_panic_hook() {
    thread_local! {
        static IN_HOOK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if IN_HOOK.with(|h| h.replace(true)) {
            previous(info);
            return;
        }
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(a panic without a message)");
        let message = crate::redis_conn::redact_urls_in(message);
        let location = info
            .location()
            .map(|l| format!("{}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let thread = std::thread::current();
        tracing::error!(
            thread = thread.name().unwrap_or("unnamed"),
            location = %location,
            "panicked: {message}"
        );
        IN_HOOK.with(|h| h.set(false));
    }));
}

/// Formats a span's fields as one JSON object (kept in the span's `FormattedFields`), so
/// [`JsonFormat`] can merge the job's context into each line without parsing `key=value` text.
#[derive(Debug, Default, Clone, Copy)]
pub struct JsonFields;

/// Collects fields into a JSON map: strings and numbers as themselves, anything else as its
/// `Debug` text; `elapsed` (written as `"0.007"`) as a number.
struct JsonVisitor<'a>(&'a mut serde_json::Map<String, serde_json::Value>);

impl Visit for JsonVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(
            field.name().into(),
            serde_json::Number::from_f64(value).map_or(serde_json::Value::Null, Into::into),
        );
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let text = format!("{value:?}");
        let v = if field.name() == "elapsed" {
            text.parse::<f64>()
                .ok()
                .and_then(serde_json::Number::from_f64)
                .map_or_else(|| text.clone().into(), Into::into)
        } else {
            text.into()
        };
        self.0.insert(field.name().into(), v);
    }
}

impl<'w> FormatFields<'w> for JsonFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        mut writer: Writer<'w>,
        fields: R,
    ) -> fmt::Result {
        let mut map = serde_json::Map::new();
        fields.record(&mut JsonVisitor(&mut map));
        let text = serde_json::to_string(&map).map_err(|_| fmt::Error)?;
        writer.write_str(&text)
    }

    fn add_fields(
        &self,
        current: &'w mut FormattedFields<Self>,
        fields: &tracing::span::Record<'_>,
    ) -> fmt::Result {
        let mut map: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&current.fields).unwrap_or_default();
        fields.record(&mut JsonVisitor(&mut map));
        current.fields = serde_json::to_string(&map).map_err(|_| fmt::Error)?;
        Ok(())
    }
}

/// Formats events as JSON lines (see the module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct JsonFormat;

impl<S> FormatEvent<S, JsonFields> for JsonFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, JsonFields>,
        mut out: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        use serde_json::Value;
        let mut line = serde_json::Map::new();
        let now = chrono::Utc::now();
        line.insert(
            "time".into(),
            now.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string().into(),
        );
        line.insert("pid".into(), pid().into());
        let tid = PID_TID.with(|p| {
            p.rsplit_once("tid=")
                .map_or_else(String::new, |(_, t)| t.to_string())
        });
        line.insert("tid".into(), tid.into());
        line.insert("level".into(), event.metadata().level().as_str().into());
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                if let Some(fields) = span.extensions().get::<FormattedFields<JsonFields>>()
                    && let Ok(Value::Object(map)) = serde_json::from_str::<Value>(&fields.fields)
                {
                    line.extend(map);
                }
            }
        }
        let mut own = serde_json::Map::new();
        event.record(&mut JsonVisitor(&mut own));
        let message = own.remove("message").unwrap_or_else(|| "".into());
        line.extend(own);
        line.insert("message".into(), message);
        let text = serde_json::to_string(&line).map_err(|_| fmt::Error)?;
        out.write_str(&text)?;
        out.write_char('\n')
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_lines_carry_the_job_context_and_escape_what_they_hold() {
        let buffer = Arc::new(Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::fmt()
            .with_writer(SharedBuffer(buffer.clone()))
            .fmt_fields(JsonFields)
            .event_format(JsonFormat)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("job", class = %"Evil\nINFO: forged\u{1b}[31m", jid = %"abc", queue = %"q");
            let _in = span.enter();
            tracing::info!(elapsed = format_args!("{:.3}", 0.0071), "done");
            tracing::warn!(count = 3, "line\ntwo");
        });
        let text = String::from_utf8(buffer.lock().unwrap().clone()).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        let done = &lines[0];
        assert_eq!(done["class"], "Evil\nINFO: forged\u{1b}[31m");
        assert_eq!(done["jid"], "abc");
        assert_eq!(done["queue"], "q");
        assert_eq!(done["elapsed"], 0.007);
        assert_eq!(done["level"], "INFO");
        assert_eq!(done["message"], "done");
        assert!(done["pid"].is_u64() && done["tid"].is_string() && done["time"].is_string());
        assert_eq!(lines[1]["message"], "line\ntwo");
        assert_eq!(lines[1]["count"], 3);
        let keys: Vec<&str> = done
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(
            keys,
            [
                "time", "pid", "tid", "level", "class", "jid", "queue", "elapsed", "message"
            ]
        );
    }

    #[test]
    fn control_characters_are_escaped_and_the_rest_is_kept() {
        assert_eq!(escape("class=Hard jid=abc"), "class=Hard jid=abc");
        assert_eq!(escape("a\nb\r\tc"), "a\\nb\\r\\tc");
        assert_eq!(escape("\u{1b}[31mred"), "\\u{1b}[31mred");
        assert_eq!(escape("x\u{7f}\u{85}y"), "x\\u{7f}\\u{85}y");
        assert_eq!(escape("l\u{2028}r\u{202e}"), "l\\u{2028}r\\u{202e}");
        assert_eq!(escape("héllo ☃ \\n"), "héllo ☃ \\n");
    }
}
