//! Logs through `tracing`, printed in Sidekiq's own line shape so tooling that reads Sidekiq logs works:
//!
//! ```text
//! 2026-11-21T20:02:30.411Z pid=4242 tid=2c8 class=HardWorker jid=ecf8fc8053b3a18fd1a94b54 elapsed=0.007 INFO: done
//! ```
//!
//! Mirrors `logger.rb` (`Sidekiq::Logger::Formatters::Pretty` without colour): UTC time with
//! milliseconds, `pid`, `tid`, the job's context (`class`, `jid` from the job span), the event's own
//! fields, then `LEVEL: message`. Lines are appended to a shared buffer ([`Sink`]) that a background thread writes
//! out every 20 ms, so a job never waits on the terminal and a busy process does not wake a writer
//! thread per line; past 1 MiB the logging thread writes the buffer itself (back-pressure, no line is
//! ever dropped). The subscriber is this module's own [`Logger`], built for the two lines every job
//! logs: see there for why not `tracing_subscriber`'s.
//!
//! Every line is escaped as a whole before it is written ([`write_escaped`]): a newline, a carriage
//! return, an ANSI escape or a bidirectional override from a payload or from Redis (a class, a jid, a
//! queue name, an error message, an ActiveJob wrapped class) is written as `\n`, `\u{1b}`, ..., so a
//! crafted payload cannot print a fake line or recolour the terminal. Panic messages are logged
//! through the same path, with any Redis URL in them redacted.
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

/// Flushes what is buffered when dropped (at exit).
#[derive(Debug)]
pub(crate) struct LogGuard {
    /// The shared buffer.
    sink: Arc<Sink>,
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        self.sink.flush();
    }
}

/// Buffered bytes past which the logging thread writes them out itself.
const FLUSH_AT: usize = 1 << 20;

/// Where finished lines wait to be written: the buffer they are appended to, and a second one that the
/// writer swaps in for it and writes out. Both keep their capacity: a fresh buffer per flush (every 20
/// ms, growing to a megabyte at full speed) faulted in fresh pages each time, and the kernel zeroing
/// them (`clear_page_erms`) was 8-13% of a no-op job's CPU.
#[derive(Debug, Default)]
pub(crate) struct Sink {
    /// Lines not yet written.
    lines: Mutex<Vec<u8>>,
    /// The writer's buffer; its lock also keeps two writers' batches in order.
    spare: Mutex<Vec<u8>>,
}

impl Sink {
    /// Writes out what is buffered.
    fn flush(&self) {
        let Ok(mut spare) = self.spare.lock() else {
            return;
        };
        match self.lines.lock() {
            Ok(mut b) if !b.is_empty() => std::mem::swap(&mut *b, &mut *spare),
            _ => return,
        }
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(&spare);
        let _ = out.flush();
        spare.clear();
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

/// The span table: slots reused through a free list, so a job's span allocates nothing once the table
/// has grown to the number of jobs in flight.
#[derive(Default)]
struct Spans {
    slots: Vec<Slot>,
    free: Vec<usize>,
}

#[derive(Default)]
struct Slot {
    /// Handles alive (`clone_span` / `try_close`), children included: 0 = free.
    refs: usize,
    /// The parent span's index, if any (held by one reference while this one lives).
    parent: Option<usize>,
    metadata: Option<&'static Metadata<'static>>,
    /// Text format: the fields as ` name=value` each (tracing_subscriber's `DefaultFields` shape).
    text: String,
    /// JSON format: the fields in order, a later record of the same name replacing the value.
    json: Vec<(&'static str, Value)>,
    /// While tracing ([`crate::otel`]): the OpenTelemetry context of this span, set for a job's span by
    /// [`attach_otel`] and made for each span opened inside one; `None` otherwise.
    otel: Option<opentelemetry::Context>,
    /// The OpenTelemetry span in `otel` is this span's own, ended when this span closes (a job's
    /// consumer span is ended by the processor, which sets its status first).
    otel_owned: bool,
}

static INSTANCES: AtomicUsize = AtomicUsize::new(0);

fn index_of(id: &Id) -> usize {
    (id.into_u64() as usize).wrapping_sub(1)
}

impl Logger {
    /// A subscriber writing `format` lines up to `max` into `out`.
    fn new(max: LevelFilter, format: LogFormat, out: Arc<Sink>) -> Logger {
        Logger {
            max,
            format,
            out,
            spans: Mutex::new(Spans::default()),
            instance: INSTANCES.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// The innermost span this thread has entered, as an index.
    fn current(&self) -> Option<usize> {
        STACK
            .try_with(|s| {
                s.try_borrow().ok().and_then(|s| {
                    s.iter()
                        .rev()
                        .find(|(i, _)| *i == self.instance)
                        .map(|(_, id)| *id)
                })
            })
            .ok()
            .flatten()
    }

    /// The OpenTelemetry context of the span at `index`, if it has one.
    fn otel_of(&self, index: usize) -> Option<opentelemetry::Context> {
        self.spans.lock().ok()?.slots.get(index)?.otel.clone()
    }

    /// While tracing: an OpenTelemetry span for a span opened inside a traced one (a job's own spans
    /// nest in its consumer span), its fields as attributes; `None` outside a traced span.
    fn otel_child(
        &self,
        parent: Option<usize>,
        attrs: &Attributes<'_>,
    ) -> Option<opentelemetry::Context> {
        let parent = self.otel_of(parent?)?;
        let mut fields = OtelFields::default();
        attrs.record(&mut fields);
        crate::otel::child(&parent, attrs.metadata().name(), fields.attributes)
    }

    /// While tracing: an event inside a traced span is an event of its OpenTelemetry span, named by its
    /// message, with its other fields as attributes.
    fn otel_event(&self, event: &Event<'_>) {
        use opentelemetry::trace::TraceContextExt as _;
        let Some(cx) = self.current().and_then(|i| self.otel_of(i)) else {
            return;
        };
        let mut fields = OtelFields::default();
        event.record(&mut fields);
        fields.attributes.push(opentelemetry::KeyValue::new(
            "level",
            event.metadata().level().as_str(),
        ));
        cx.span().add_event(fields.message, fields.attributes);
    }

    /// Appends the fields of `index`'s span and its ancestors, root first, to `line` (text).
    fn write_context(spans: &Spans, index: usize, line: &mut String, depth: usize) {
        let Some(slot) = spans.slots.get(index) else {
            return;
        };
        if let Some(parent) = slot.parent
            && depth < 64
        {
            Self::write_context(spans, parent, line, depth + 1);
        }
        line.push_str(&slot.text);
    }

    /// As [`Logger::write_context`], into a JSON object.
    fn json_context(spans: &Spans, index: usize, line: &mut Map<String, Value>, depth: usize) {
        let Some(slot) = spans.slots.get(index) else {
            return;
        };
        if let Some(parent) = slot.parent
            && depth < 64
        {
            Self::json_context(spans, parent, line, depth + 1);
        }
        for (k, v) in &slot.json {
            line.insert((*k).to_string(), v.clone());
        }
    }

    fn text_event(&self, event: &Event<'_>) {
        with_reused(&LINE, |line| {
            line.clear();
            write_time(line);
            PID_TID.with(|p| line.push_str(p));
            with_reused(&FIELDS, |f| {
                // The event's own fields first: their `Debug` may run user code, which must not run
                // while the span table is locked.
                f.clear();
                event.record(f);
                if let Some(current) = self.current()
                    && let Ok(spans) = self.spans.lock()
                {
                    Self::write_context(&spans, current, line, 0);
                }
                line.push_str(&f.rest);
                line.push(' ');
                line.push_str(level_name(event.metadata().level()));
                line.push_str(": ");
                line.push_str(&f.message);
            });
            // Escaped as a whole: classes, jids, queues and error messages come from payloads and
            // Redis, and escaping the finished line covers every field, span or event, in one place.
            self.append(|out| {
                let _ = write_escaped(&mut Bytes(out), line);
                out.push(b'\n');
            });
        });
    }

    fn json_event(&self, event: &Event<'_>) {
        let mut line = Map::new();
        let mut time = String::with_capacity(24);
        write_time(&mut time);
        line.insert("time".into(), time.into());
        line.insert("pid".into(), pid().into());
        let tid = PID_TID.with(|p| {
            p.rsplit_once("tid=")
                .map_or_else(String::new, |(_, t)| t.to_string())
        });
        line.insert("tid".into(), tid.into());
        line.insert("level".into(), event.metadata().level().as_str().into());
        let mut own = Map::new();
        event.record(&mut JsonVisitor(&mut own));
        if let Some(current) = self.current()
            && let Ok(spans) = self.spans.lock()
        {
            Self::json_context(&spans, current, &mut line, 0);
        }
        let message = own.remove("message").unwrap_or_else(|| "".into());
        line.extend(own);
        line.insert("message".into(), message);
        self.append(|out| {
            let start = out.len();
            if serde_json::to_writer(&mut *out, &line).is_ok() {
                escape_json_tail(out, start);
                out.push(b'\n');
            }
        });
    }

    /// Runs `write` on the shared buffer; past [`FLUSH_AT`] bytes this thread writes them out itself
    /// (back-pressure: no line is ever dropped).
    fn append(&self, write: impl FnOnce(&mut Vec<u8>)) {
        let full = match self.out.lines.lock() {
            Ok(mut b) => {
                write(&mut b);
                b.len() > FLUSH_AT
            }
            Err(_) => false,
        };
        if full {
            self.out.flush();
        }
    }
}

impl Subscriber for Logger {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        if self.enabled(metadata) {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        *metadata.level() <= self.max
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(self.max)
    }

    fn new_span(&self, attrs: &Attributes<'_>) -> Id {
        let parent = if let Some(p) = attrs.parent() {
            Some(index_of(p))
        } else if attrs.is_contextual() {
            self.current()
        } else {
            None
        };
        // One atomic load while tracing is off.
        let mut otel = if crate::otel::enabled() {
            self.otel_child(parent, attrs)
        } else {
            None
        };
        // The fields are formatted before the table is locked (their `Display` may run user code),
        // into a per-thread buffer, then copied into the slot's own string.
        let mut json = Vec::new();
        with_reused(&SCRATCH, |text| {
            text.clear();
            match self.format {
                // A job's span (one per job) has its three values as plain strings, written bare.
                LogFormat::Text if attrs.metadata().target() == JOB_TARGET => {
                    attrs.record(&mut JobText(text))
                }
                LogFormat::Text => attrs.record(&mut SpanText(text)),
                LogFormat::Json => attrs.record(&mut JsonFieldList(&mut json)),
            }
            let Ok(mut spans) = self.spans.lock() else {
                return None;
            };
            let index = match spans.free.pop() {
                Some(i) => i,
                None => {
                    spans.slots.push(Slot::default());
                    spans.slots.len() - 1
                }
            };
            let parent = parent.filter(|&p| {
                spans
                    .slots
                    .get_mut(p)
                    .filter(|s| s.refs > 0)
                    .map(|s| s.refs += 1)
                    .is_some()
            });
            if let Some(slot) = spans.slots.get_mut(index) {
                slot.refs = 1;
                slot.parent = parent;
                slot.metadata = Some(attrs.metadata());
                slot.text.clear();
                slot.text.push_str(text);
                slot.json = std::mem::take(&mut json);
                slot.otel_owned = otel.is_some();
                slot.otel = otel.take();
            }
            Some(index as u64 + 1)
        })
        // A poisoned table (a panic while it was held): the span is not recorded, and an id no slot
        // has makes its later calls no-ops.
        .map_or_else(|| Id::from_u64(u64::MAX), Id::from_u64)
    }

    fn record(&self, span: &Id, values: &Record<'_>) {
        let mut json = Vec::new();
        with_reused(&SCRATCH, |text| {
            text.clear();
            match self.format {
                LogFormat::Text => values.record(&mut SpanText(text)),
                LogFormat::Json => values.record(&mut JsonFieldList(&mut json)),
            }
            if let Ok(mut spans) = self.spans.lock()
                && let Some(slot) = spans.slots.get_mut(index_of(span))
            {
                slot.text.push_str(text);
                for (k, v) in json {
                    set_field(&mut slot.json, k, v);
                }
            }
        });
    }

    fn record_follows_from(&self, _span: &Id, _follows: &Id) {}

    fn event(&self, event: &Event<'_>) {
        if crate::otel::enabled() {
            self.otel_event(event);
        }
        match self.format {
            LogFormat::Text => self.text_event(event),
            LogFormat::Json => self.json_event(event),
        }
    }

    fn enter(&self, span: &Id) {
        let _ = STACK.try_with(|s| {
            if let Ok(mut s) = s.try_borrow_mut() {
                s.push((self.instance, index_of(span)));
            }
        });
    }

    fn exit(&self, span: &Id) {
        let index = index_of(span);
        let _ = STACK.try_with(|s| {
            if let Ok(mut s) = s.try_borrow_mut()
                && let Some(at) = s.iter().rposition(|&e| e == (self.instance, index))
            {
                s.remove(at);
            }
        });
    }

    fn clone_span(&self, id: &Id) -> Id {
        if let Ok(mut spans) = self.spans.lock()
            && let Some(slot) = spans.slots.get_mut(index_of(id))
        {
            slot.refs += 1;
        }
        id.clone()
    }

    fn try_close(&self, id: Id) -> bool {
        let Ok(mut spans) = self.spans.lock() else {
            return false;
        };
        let mut index = index_of(&id);
        let mut first = true;
        let mut closed = false;
        // OpenTelemetry spans to end, once the table is unlocked (no allocation while tracing is off).
        let mut ended = Vec::new();
        // A closed span releases its parent's reference, which may close the parent in turn.
        while let Some(slot) = spans.slots.get_mut(index) {
            if slot.refs == 0 {
                break;
            }
            slot.refs -= 1;
            if slot.refs > 0 {
                break;
            }
            let parent = slot.parent.take();
            slot.metadata = None;
            slot.json.clear();
            if let Some(cx) = slot.otel.take()
                && std::mem::take(&mut slot.otel_owned)
            {
                ended.push(cx);
            }
            spans.free.push(index);
            closed |= first;
            first = false;
            match parent {
                Some(p) => index = p,
                None => break,
            }
        }
        drop(spans);
        for cx in ended {
            use opentelemetry::trace::TraceContextExt as _;
            cx.span().end();
        }
        closed
    }

    fn current_span(&self) -> Current {
        let metadata = self.current().and_then(|i| {
            let spans = self.spans.lock().ok()?;
            spans.slots.get(i)?.metadata.map(|m| (i, m))
        });
        match metadata {
            Some((i, m)) => Current::new(Id::from_u64(i as u64 + 1), m),
            None => Current::none(),
        }
    }
}

/// A span's or an event's fields as OpenTelemetry attributes (the message apart, an event's name).
#[derive(Default)]
struct OtelFields {
    /// `message`, for an event.
    message: String,
    /// The other fields.
    attributes: Vec<opentelemetry::KeyValue>,
}

impl Visit for OtelFields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, clipped(value).into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(
            field,
            i64::try_from(value).map_or_else(|_| value.to_string().into(), Into::into),
        );
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, value.into());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.put(field, clipped(&format!("{value:?}")).into());
    }
}

impl OtelFields {
    fn put(&mut self, field: &Field, value: opentelemetry::Value) {
        if field.name() == "message" {
            self.message = value.as_str().into_owned();
        } else {
            self.attributes
                .push(opentelemetry::KeyValue::new(field.name(), value));
        }
    }
}

/// While tracing: makes `cx` (a job's consumer span, [`crate::otel::JobSpan`]) the OpenTelemetry context
/// of the `tracing` span `span`, so the spans and events of the job's code nest in it. The span in `cx`
/// stays its owner's to end.
pub(crate) fn attach_otel(span: &tracing::Span, cx: opentelemetry::Context) {
    span.with_subscriber(|(id, dispatch)| {
        if let Some(logger) = dispatch.downcast_ref::<Logger>()
            && let Ok(mut spans) = logger.spans.lock()
            && let Some(slot) = spans.slots.get_mut(index_of(id))
        {
            slot.otel = Some(cx);
            slot.otel_owned = false;
        }
    });
}

/// While tracing: the OpenTelemetry context of the current `tracing` span (a job's, or one opened inside
/// it), for a push to propagate; `None` outside a traced span.
pub(crate) fn current_otel() -> Option<opentelemetry::Context> {
    tracing::dispatcher::get_default(|dispatch| {
        let logger = dispatch.downcast_ref::<Logger>()?;
        logger.otel_of(logger.current()?)
    })
}

/// Replaces the value of `name`, or appends it.
fn set_field(fields: &mut Vec<(&'static str, Value)>, name: &'static str, value: Value) {
    match fields.iter_mut().find(|(k, _)| *k == name) {
        Some(slot) => slot.1 = value,
        None => fields.push((name, value)),
    }
}

/// `fmt::Write` into bytes.
struct Bytes<'a>(&'a mut Vec<u8>);

impl fmt::Write for Bytes<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

/// A span's fields as text, in the shape `tracing_subscriber`'s `DefaultFields` wrote them (which the
/// line format kept): ` name=value` each, values by `Debug` (so a `%` field prints its `Display`, a
/// plain string is quoted), a `r#` prefix dropped, `message` without its name.
struct SpanText<'a>(&'a mut String);

impl Visit for SpanText<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.push(' ');
            self.0
                .push_str(&crate::redact::clip(value, MAX_VALUE_CHARS));
        } else {
            // `Debug` quotes it and escapes `"` and `\` inside: already one value.
            self.0.push(' ');
            let name = field.name();
            self.0.push_str(name.strip_prefix("r#").unwrap_or(name));
            self.0.push('=');
            let _ = write!(self.0, "{:?}", crate::redact::clip(value, MAX_VALUE_CHARS));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.push(' ');
        let name = field.name();
        if name != "message" {
            self.0.push_str(name.strip_prefix("r#").unwrap_or(name));
            self.0.push('=');
        }
        let start = self.0.len();
        let _ = write!(self.0, "{value:?}");
        clip_tail(self.0, start);
        if name != "message" {
            quote_tail(self.0, start);
        }
    }
}

/// The target of a job's span (`class`, `jid`, `queue`, made by the processor for every job): its
/// values come as `&str` and are written as a `%` value would be, bare unless [`quote_tail`] quotes
/// them, without going through `core::fmt` (about a tenth of a no-op job's instructions went to
/// formatting its span and its two lines).
pub(crate) const JOB_TARGET: &str = concat!(env!("CARGO_CRATE_NAME"), "::job");

/// A job span's fields as text: ` name=value`, a string bare (as `%` writes it), anything else as
/// [`SpanText`] writes it.
struct JobText<'a>(&'a mut String);

impl Visit for JobText<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push(' ');
        self.0.push_str(field.name());
        self.0.push('=');
        let start = self.0.len();
        self.0
            .push_str(&crate::redact::clip(value, MAX_VALUE_CHARS));
        quote_tail(self.0, start);
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        SpanText(self.0).record_debug(field, value);
    }
}

/// Quotes the value `out` holds from `start` when it has a space, `=` or `"` in it, with `"` and `\`
/// escaped inside: a class named `X jid=1 INFO: done` would otherwise read as fields of its own.
/// Plain values (`HardWorker`, `0.007`) stay bare, as Sidekiq prints them.
fn quote_tail(out: &mut String, start: usize) {
    let Some(value) = out.get(start..) else {
        return;
    };
    if !needs_quotes(value.as_bytes()) {
        return;
    }
    let value = value.to_string();
    out.truncate(start);
    out.push('"');
    for c in value.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
}

/// True when `value` has a space, `=` or `"`, tested eight bytes at a time (a job's span has three
/// values, its done line one: byte by byte this test cost a no-op job about 350 instructions). The three
/// are ASCII, so no byte of a multi-byte character matches.
fn needs_quotes(value: &[u8]) -> bool {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    // Whether any byte of `x` is zero (exact as to whether, not as to where).
    let zero = |x: u64| x.wrapping_sub(ONES) & !x & HIGH != 0;
    let mut words = value.chunks_exact(8);
    for w in &mut words {
        let mut word = [0u8; 8];
        word.copy_from_slice(w);
        let x = u64::from_ne_bytes(word);
        if zero(x ^ (ONES * u64::from(b' ')))
            || zero(x ^ (ONES * u64::from(b'=')))
            || zero(x ^ (ONES * u64::from(b'"')))
        {
            return true;
        }
    }
    words
        .remainder()
        .iter()
        .any(|b| matches!(b, b' ' | b'=' | b'"'))
}

/// A span's fields for JSON lines (see [`JsonVisitor`] for the values).
struct JsonFieldList<'a>(&'a mut Vec<(&'static str, Value)>);

impl Visit for JsonFieldList<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        set_field(self.0, field.name(), clipped(value).into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        set_field(self.0, field.name(), value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        set_field(self.0, field.name(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        set_field(self.0, field.name(), value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        set_field(self.0, field.name(), json_f64(value));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        set_field(self.0, field.name(), json_debug(field, value));
    }
}

/// Collects an event's message and its other fields as ` key=value`; reused per thread, so a log line
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
            self.message
                .push_str(&crate::redact::clip(value, MAX_VALUE_CHARS));
        } else {
            self.rest.push(' ');
            self.rest.push_str(field.name());
            self.rest.push('=');
            let start = self.rest.len();
            self.rest
                .push_str(&crate::redact::clip(value, MAX_VALUE_CHARS));
            quote_tail(&mut self.rest, start);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            let start = self.message.len();
            let _ = write!(self.message, "{value:?}");
            clip_tail(&mut self.message, start);
        } else {
            self.rest.push(' ');
            self.rest.push_str(field.name());
            self.rest.push('=');
            let start = self.rest.len();
            let _ = write!(self.rest, "{value:?}");
            clip_tail(&mut self.rest, start);
            quote_tail(&mut self.rest, start);
        }
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
        format!(" pid={} tid={}", pid(), crate::text::to_base36(n ^ u64::from(pid())))
    };
    /// This thread's reusable line buffer (the line before escaping).
    static LINE: RefCell<String> = const { RefCell::new(String::new()) };
    /// This thread's reusable buffer for a new span's fields.
    static SCRATCH: RefCell<String> = const { RefCell::new(String::new()) };
    /// This thread's reusable field buffers.
    static FIELDS: RefCell<Fields> = RefCell::new(Fields::default());
    /// The formatted `YYYY-MM-DDTHH:MM:SS` of the last second seen on this thread.
    static SECOND: RefCell<(i64, String)> = const { RefCell::new((i64::MIN, String::new())) };
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

/// `2026-11-21T20:02:30.411Z`: the date part is formatted once per second per thread, the
/// milliseconds written as three digits (no `core::fmt`, no calendar arithmetic per line).
fn write_time(out: &mut String) {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = i64::try_from(since_epoch.as_secs()).unwrap_or(i64::MAX);
    let millis = since_epoch.subsec_millis().min(999);
    SECOND.with(|cell| {
        let mut c = cell.borrow_mut();
        if c.0 != secs {
            c.0 = secs;
            c.1 = chrono::DateTime::from_timestamp(secs, 0)
                .unwrap_or_default()
                .format("%Y-%m-%dT%H:%M:%S")
                .to_string();
        }
        out.push_str(&c.1);
    });
    out.push('.');
    for d in [millis / 100, millis / 10 % 10, millis % 10] {
        out.push(char::from(b'0' + d as u8));
    }
    out.push('Z');
}

/// True for a character that must not reach a log line raw: C0 and C1 controls (newline, carriage
/// return, the ESC of ANSI sequences, ...), DEL, the Unicode line and paragraph separators (some
/// viewers break lines there) and the bidirectional overrides that reorder what a reader sees.
pub(crate) fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{200f}')
        || ('\u{202a}'..='\u{202e}').contains(&c)
        || ('\u{2066}'..='\u{2069}').contains(&c)
}

/// Writes `s` with every character of [`needs_escape`] written as an escape: `\n`, `\r`, `\t`, else
/// `\u{..}` (as Rust's `escape_debug` does). Anything else, backslashes included, is written as is.
pub(crate) fn write_escaped(out: &mut impl fmt::Write, s: &str) -> fmt::Result {
    // Most lines are printable ASCII: one scan, one write.
    if printable_ascii(s.as_bytes()) {
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

/// True when every byte is printable ASCII (0x20..0x7f), tested eight bytes at a time: a log line is
/// about a hundred bytes, and a byte at a time this test cost more than the rest of the line.
fn printable_ascii(bytes: &[u8]) -> bool {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    const SPACE: u64 = u64::from_ne_bytes([0x20; 8]);
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let mut word = [0u8; 8];
        word.copy_from_slice(w);
        let x = u64::from_ne_bytes(word);
        // A byte below 0x20 (the classic "has a byte less than n" test), or at or above 0x7f
        // (adding 1 sets its top bit; a byte at or above 0x80 has it already).
        if (x.wrapping_sub(SPACE) & !x & HIGH) != 0 || ((x.wrapping_add(ONES) | x) & HIGH) != 0 {
            return false;
        }
    }
    words.remainder().iter().all(|b| (0x20..0x7f).contains(b))
}

/// Rewrites the JSON that `out` holds from `start` with every character of [`needs_escape`] that
/// serde_json leaves raw (DEL, the C1 controls such as U+0085, the line and paragraph separators,
/// the bidirectional overrides) as a `\uXXXX` escape. serde_json escapes only what JSON requires,
/// and a viewer may break a line at U+2028 or reorder it at U+202E. Such a character can only be
/// inside a string of the line (everything else serde_json writes is ASCII), so the escape is valid
/// JSON for the same text. Lines of printable ASCII are left as they are after one scan.
fn escape_json_tail(out: &mut Vec<u8>, start: usize) {
    let Some(tail) = out.get(start..) else {
        return;
    };
    if !tail.iter().any(|b| *b >= 0x7f) {
        return;
    }
    let Ok(text) = std::str::from_utf8(tail).map(str::to_owned) else {
        return;
    };
    out.truncate(start);
    let mut buf = [0u16; 2];
    for c in text.chars() {
        if needs_escape(c) {
            for unit in c.encode_utf16(&mut buf) {
                let _ = write!(out, "\\u{unit:04x}");
            }
        } else {
            let mut b = [0u8; 4];
            out.extend_from_slice(c.encode_utf8(&mut b).as_bytes());
        }
    }
}

/// `s` with control characters escaped (see [`write_escaped`]), for text written outside the logger.
pub(crate) fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let _ = write_escaped(&mut out, s);
    out
}

/// Installs the Sidekiq-shaped logger on stdout, in `format`; `verbose` turns on debug lines. Keep the
/// guard alive until exit: dropping it writes out what is still buffered.
pub(crate) fn init_with(verbose: bool, format: LogFormat) -> LogGuard {
    let sink = Arc::new(Sink::default());
    let flusher = Arc::downgrade(&sink);
    // The flusher ends by itself once the guard and the subscriber's writer are gone.
    let _ = std::thread::Builder::new()
        .name("oxidekiq-log".into())
        .spawn(move || {
            while let Some(sink) = flusher.upgrade() {
                sink.flush();
                drop(sink);
                std::thread::sleep(Duration::from_millis(20));
            }
        });
    let level = if verbose {
        LevelFilter::DEBUG
    } else {
        LevelFilter::INFO
    };
    // A second init (tests) keeps the first subscriber.
    let installed =
        tracing::subscriber::set_global_default(Logger::new(level, format, sink.clone()));
    if installed.is_ok() {
        install_panic_hook();
        let early = EARLY.lock().map(|mut e| std::mem::take(&mut *e));
        for message in early.unwrap_or_default() {
            tracing::warn!("{message}");
        }
    }
    LogGuard { sink }
}

/// Warnings raised before the logger is installed (reading flags and `sidekiq.yml` comes first, since
/// they choose the log format), written as the first lines once it is: a warning about an ignored key
/// must not vanish. At most [`EARLY_MAX`] are kept.
static EARLY: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Warnings kept for the logger at most.
const EARLY_MAX: usize = 100;

/// Logs `message` at warning level now if a logger is installed, else as soon as one is
/// ([`init_with`]).
pub(crate) fn warn_early(message: String) {
    if tracing::dispatcher::has_been_set() {
        tracing::warn!("{message}");
        return;
    }
    if let Ok(mut early) = EARLY.lock()
        && early.len() < EARLY_MAX
    {
        early.push(message);
    }
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
        let message = crate::redact::redact_urls_in(message);
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

/// Collects an event's fields into a JSON map: strings and numbers as themselves, anything else as its
/// `Debug` text; `elapsed` (written as `"0.007"`) as a number.
struct JsonVisitor<'a>(&'a mut Map<String, Value>);

impl Visit for JsonVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), json_text(field, value));
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
        self.0.insert(field.name().into(), json_f64(value));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().into(), json_debug(field, value));
    }
}

/// A float as a JSON number (`null` when not finite).
fn json_f64(value: f64) -> Value {
    serde_json::Number::from_f64(value).map_or(Value::Null, Into::into)
}

/// A `Debug` value as its text, except `elapsed`, which is a number.
fn json_debug(field: &Field, value: &dyn fmt::Debug) -> Value {
    json_text(field, &format!("{value:?}"))
}

/// Most characters of one field's value a log line shows, as much as Sidekiq stores of an error
/// message (issue 43: a 1 MB iteration cursor in an error made a 2 MB line at every retry; a value from
/// Redis or a payload is clipped in logs as it is where it is stored). Past it, `…(N bytes)`.
pub(crate) const MAX_VALUE_CHARS: usize = 10_000;

/// `value` clipped to [`MAX_VALUE_CHARS`], owned.
fn clipped(value: &str) -> String {
    crate::redact::clip(value, MAX_VALUE_CHARS).into_owned()
}

/// Clips what `out` holds from `start` (one value just written) to [`MAX_VALUE_CHARS`].
fn clip_tail(out: &mut String, start: usize) {
    let Some(value) = out.get(start..) else {
        return;
    };
    if value.len() <= MAX_VALUE_CHARS {
        return;
    }
    if let Some((i, _)) = value.char_indices().nth(MAX_VALUE_CHARS) {
        let total = value.len();
        out.truncate(start + i);
        let _ = write!(out, "…({total} bytes)");
    }
}

/// A value's text as a JSON string, except `elapsed`, which is a number.
fn json_text(field: &Field, text: &str) -> Value {
    if field.name() == "elapsed" {
        text.parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
            .map_or_else(|| clipped(text).into(), Into::into)
    } else {
        clipped(text).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 43 item 6: every field's value, the message too, is clipped to [`MAX_VALUE_CHARS`] in
    /// both formats and in the job span (a 1 MB value made a 1 MB line); short values are untouched.
    #[test]
    fn every_value_of_a_log_line_is_clipped_as_it_is_where_stored() {
        let huge = "x".repeat(1_000_000);
        for format in [LogFormat::Text, LogFormat::Json] {
            let out = captured(format, || {
                let span = tracing::info_span!(target: JOB_TARGET, "job", class = huge.as_str(), jid = "j", queue = "q");
                let _in = span.enter();
                tracing::warn!(error_message = %huge, cursor = huge.as_str(), short = "kept", "failed: {huge}");
            });
            assert!(
                out.len() < 5 * (MAX_VALUE_CHARS + 100),
                "{format:?}: a {} byte line",
                out.len()
            );
            assert!(out.contains("…(1000000 bytes)"), "{format:?}");
            assert!(out.contains("kept"), "{format:?}");
            if format == LogFormat::Json {
                serde_json::from_str::<serde_json::Value>(out.trim()).expect("one JSON line");
            }
        }
    }

    /// The eight-at-a-time test agrees with a byte-by-byte one for each of the three bytes at every
    /// position of values of every length up to three words, beside multi-byte characters and bytes
    /// one off from the three.
    #[test]
    fn needs_quotes_finds_a_space_an_equals_sign_or_a_quote_anywhere() {
        let slow = |v: &[u8]| v.iter().any(|b| matches!(b, b' ' | b'=' | b'"'));
        for len in 0..=24 {
            for fill in ["a", "é", "!", "<", "#", "\u{7f}", "\u{a0}"] {
                let base: Vec<u8> = fill.as_bytes().iter().copied().cycle().take(len).collect();
                assert_eq!(needs_quotes(&base), slow(&base), "{base:?}");
                for at in 0..len {
                    for c in [b' ', b'=', b'"', b'!', b'<', b'#', b'\x1f'] {
                        let mut v = base.clone();
                        v[at] = c;
                        assert_eq!(needs_quotes(&v), slow(&v), "{v:?}");
                    }
                }
            }
        }
    }

    /// What `log` writes through a `format` [`Logger`] at INFO.
    fn captured(format: LogFormat, log: impl FnOnce()) -> String {
        let sink = Arc::new(Sink::default());
        let subscriber = Logger::new(LevelFilter::INFO, format, sink.clone());
        tracing::subscriber::with_default(subscriber, log);
        String::from_utf8(sink.lines.lock().unwrap().clone()).unwrap()
    }

    /// The processor's job span and lines (plain strings under [`JOB_TARGET`], `elapsed` as text)
    /// print exactly what the same span and lines with `%` values print, in both formats: bare values,
    /// quoted when they hold a space, `=` or `"`, escaped when they hold a control character.
    #[test]
    fn a_job_span_of_plain_strings_prints_as_its_display_values_would() {
        for format in [LogFormat::Text, LogFormat::Json] {
            for (class, jid) in [
                ("HardWorker", "abc123"),
                ("X jid=1 INFO: done", "j\"q"),
                ("Evil\nINFO: forged\u{1b}[31m", "é☃"),
            ] {
                let elapsed = crate::time::Secs3(0.0071);
                let fast = captured(format, || {
                    let span = tracing::info_span!(target: JOB_TARGET, "job", class = class, jid = jid, queue = "q");
                    let _in = span.enter();
                    tracing::info!(message = "start");
                    tracing::info!(elapsed = elapsed.text().as_str(), message = "done");
                    tracing::info!(user = "a b", "user line");
                });
                let display = captured(format, || {
                    let span = tracing::info_span!("job", class = %class, jid = %jid, queue = %"q");
                    let _in = span.enter();
                    tracing::info!("start");
                    tracing::info!(elapsed = %elapsed, "done");
                    tracing::info!(user = "a b", "user line");
                });
                let strip = |t: &str| {
                    t.lines()
                        .map(|l| match format {
                            // The time differs from one line to the next: compared from the pid on.
                            LogFormat::Text => l.split_once(" pid=").unwrap().1.to_string(),
                            LogFormat::Json => {
                                let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
                                v.as_object_mut().unwrap().remove("time");
                                v.to_string()
                            }
                        })
                        .collect::<Vec<_>>()
                };
                assert_eq!(strip(&fast), strip(&display), "{format:?} {class:?}");
                assert_eq!(strip(&fast).len(), 3);
            }
        }
    }

    #[test]
    fn json_lines_carry_the_job_context_and_escape_what_they_hold() {
        let text = captured(LogFormat::Json, || {
            let span = tracing::info_span!("job", class = %"Evil\nINFO: forged\u{1b}[31m", jid = %"abc", queue = %"q");
            let _in = span.enter();
            tracing::info!(elapsed = format_args!("{:.3}", 0.0071), "done");
            tracing::warn!(count = 3, "line\ntwo");
        });
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
    fn text_lines_carry_the_job_context_and_are_escaped_whole() {
        let text = captured(LogFormat::Text, || {
            let span = tracing::info_span!("job", class = %"Evil\nINFO: forged", jid = %"abc", queue = %"q");
            {
                let _in = span.enter();
                tracing::info!("start");
                tracing::info!(elapsed = format_args!("{:.3}", 0.0071), "done");
            }
            tracing::debug!("below the level: not written");
            tracing::warn!(count = 3, name = "x", "outside\u{1b}[31m");
            drop(span);
            // The closed span's slot is reused: nothing of the first job's context is left in it.
            let again = tracing::info_span!("job", class = %"B", jid = %"j2", queue = %"q");
            again.in_scope(|| tracing::info!("start"));
        });
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        let prefix = format!(" pid={} tid=", std::process::id());
        for line in &lines {
            let (time, rest) = line.split_at(24);
            assert!(
                time.ends_with('Z') && time.as_bytes()[10] == b'T' && time.as_bytes()[19] == b'.'
            );
            assert!(time[20..23].bytes().all(|b| b.is_ascii_digit()), "{line}");
            assert!(rest.starts_with(&prefix), "{line}");
        }
        let after_tid = |l: &str| l.splitn(4, ' ').nth(3).unwrap().to_string();
        // A value with a space, `=` or `"` is quoted: it cannot read as fields of its own.
        assert_eq!(
            after_tid(lines[0]),
            "class=\"Evil\\nINFO: forged\" jid=abc queue=q INFO: start"
        );
        assert_eq!(
            after_tid(lines[1]),
            "class=\"Evil\\nINFO: forged\" jid=abc queue=q elapsed=0.007 INFO: done"
        );
        assert_eq!(
            after_tid(lines[2]),
            "count=3 name=x WARN: outside\\u{1b}[31m"
        );
        assert_eq!(after_tid(lines[3]), "class=B jid=j2 queue=q INFO: start");
    }

    #[test]
    fn values_with_spaces_or_equals_are_quoted_and_json_escapes_separators() {
        let text = captured(LogFormat::Text, || {
            let span = tracing::info_span!("job", class = %"X jid=1 INFO: done", jid = %"j", queue = %"q", tag = "s p");
            span.in_scope(|| tracing::warn!(error = %"a \"b\" c", plain = "p", "failed"));
        });
        assert!(
            text.contains(
                r#"class="X jid=1 INFO: done" jid=j queue=q tag="s p" error="a \"b\" c" plain=p WARN: failed"#
            ),
            "{text}"
        );
        let class = "L\u{2028}N\u{85}B\u{202e}R\u{7f}";
        let json = captured(LogFormat::Json, || {
            let span = tracing::info_span!("job", class = %class, jid = %"j", queue = %"q");
            span.in_scope(|| tracing::info!("start"));
        });
        for c in ['\u{2028}', '\u{85}', '\u{202e}', '\u{7f}'] {
            assert!(!json.contains(c), "{json}");
        }
        let line: Value = serde_json::from_str(json.trim()).unwrap();
        assert_eq!(line["class"], class, "the same text, escaped");
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

    #[test]
    fn the_word_at_a_time_test_agrees_with_a_byte_at_a_time_one() {
        let slow = |b: &[u8]| b.iter().all(|c| (0x20..0x7f).contains(c));
        let mut line =
            b"2026-11-21T20:02:30.411Z pid=4242 tid=2c8 class=HardWorker INFO: done".to_vec();
        assert!(printable_ascii(&line));
        for at in 0..line.len() {
            for bad in [0x00, 0x0a, 0x1b, 0x1f, 0x7f, 0x80, 0xc3, 0xe2, 0xff] {
                let keep = line[at];
                line[at] = bad;
                assert_eq!(printable_ascii(&line), slow(&line), "byte {bad:#x} at {at}");
                line[at] = keep;
            }
        }
        for b in 0..=255u8 {
            let word = [b'a', b'b', b, b' ', b'~', b'!', b'0', b'Z', b'q'];
            assert_eq!(printable_ascii(&word), slow(&word), "{b:#x}");
            assert_eq!(printable_ascii(&word[1..]), slow(&word[1..]), "{b:#x}");
        }
    }
}
