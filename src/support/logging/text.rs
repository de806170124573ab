//! The text format: Sidekiq's line shape, `name=value` fields, quoting.

use super::escape::printable_ascii;
use super::*;

impl Logger {
    /// Appends the fields of `index`'s span and its ancestors, root first, to `line` (text).
    pub(super) fn write_context(spans: &Spans, index: usize, line: &mut String, depth: usize) {
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

    pub(super) fn text_event(&self, event: &Event<'_>) {
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
}

/// A job's `start` or `done` line (`elapsed` the done line's one field) written by the caller straight
/// into the text logger: true when it was handled here (written, or hidden by the level), false when the
/// caller must log it through `tracing` (`tracing::info!(elapsed = .., message = ..)`), which it does
/// whenever the current subscriber is not this module's [`Logger`] in the text format, or while
/// OpenTelemetry is on (the line is an event of the job's trace then).
///
/// The line is byte for byte the one [`Logger::text_event`] writes for that event (the
/// `job_lines_written_directly_are_the_lines_tracing_writes` test compares them): what it skips is
/// tracing's event machinery (the callsite, the value set, the dispatch and its field visitors) and
/// the second copy of the fields through [`Fields`]: about a tenth of a no-op job's instructions went
/// to the two lines every job logs. `message` is one of the processor's own constants.
pub(crate) fn job_line(message: &'static str, elapsed: Option<&str>) -> bool {
    if crate::otel::enabled() {
        return false;
    }
    tracing::dispatcher::get_default(|dispatch| {
        let Some(logger) = dispatch.downcast_ref::<Logger>() else {
            return false;
        };
        if logger.format != LogFormat::Text {
            return false;
        }
        // Below the level (or compiled out): `tracing::info!` would write nothing either.
        if tracing::level_enabled!(Level::INFO) && Level::INFO <= logger.max {
            logger.text_job_line(message, elapsed);
        }
        true
    })
}

impl Logger {
    /// [`job_line`]'s line: [`Logger::text_event`]'s steps for an INFO event whose fields are
    /// `elapsed` (if any) and `message`, without the event.
    ///
    /// When `message` and `elapsed` are short printable ASCII and `elapsed` needs no quotes (the
    /// processor's `start`, `done` and `0.007` always are), the line is written straight into the
    /// shared buffer, piece by piece, with no line buffer in between: the time, ` pid= tid=` and the
    /// level are ASCII already, and the spans' texts were tested for escapes once, when they were
    /// recorded ([`Slot::printable`]); a span whose text needs escapes is escaped as it is copied.
    /// Escaping is a character-by-character map, so escaping the pieces writes the bytes that escaping
    /// the whole line wrote.
    fn text_job_line(&self, message: &str, elapsed: Option<&str>) {
        // An elapsed time of digits and a point needs no quotes and no escape.
        let plain = message.len() <= MAX_VALUE_CHARS && printable_ascii(message.as_bytes());
        let seconds = |e: &str| e.len() <= 32 && e.bytes().all(|b| b.is_ascii_digit() || b == b'.');
        if !plain || !elapsed.is_none_or(seconds) {
            return self.text_job_line_general(message, elapsed);
        }
        let Some(stamp) = stamp_now() else {
            return self.text_job_line_general(message, elapsed);
        };
        let current = self.current();
        // The table stays locked while the line is copied (the buffer's lock is taken inside it;
        // nothing takes them the other way round): the context goes straight into the line.
        let spans = current.and_then(|_| self.spans.lock().ok());
        let (full, idle) = match self.out.lines.lock() {
            Ok(mut out) => {
                out.extend_from_slice(&stamp);
                PID_TID.with(|p| out.extend_from_slice(p.as_bytes()));
                if let (Some(current), Some(spans)) = (current, spans.as_deref()) {
                    Self::write_context_bytes(spans, current, &mut out, 0);
                }
                if let Some(value) = elapsed {
                    out.extend_from_slice(b" elapsed=");
                    out.extend_from_slice(value.as_bytes());
                }
                out.push(b' ');
                out.extend_from_slice(level_name(&Level::INFO).as_bytes());
                out.extend_from_slice(b": ");
                out.extend_from_slice(message.as_bytes());
                out.push(b'\n');
                (
                    out.len() > FLUSH_AT,
                    self.out.idle.load(std::sync::atomic::Ordering::Relaxed),
                )
            }
            Err(_) => (false, false),
        };
        drop(spans);
        // As `append`: the first line into the empty buffer of a sleeping writer wakes it.
        self.out.appended(idle);
        if full {
            self.out.flush();
        }
    }

    /// [`Logger::write_context`] straight into the shared buffer, each span's text escaped unless it
    /// is known to be printable ASCII.
    fn write_context_bytes(spans: &Spans, index: usize, out: &mut Vec<u8>, depth: usize) {
        let Some(slot) = spans.slots.get(index) else {
            return;
        };
        if let Some(parent) = slot.parent
            && depth < 64
        {
            Self::write_context_bytes(spans, parent, out, depth + 1);
        }
        if slot.printable {
            out.extend_from_slice(slot.text.as_bytes());
        } else {
            let _ = write_escaped(&mut Bytes(out), &slot.text);
        }
    }

    /// [`Logger::text_job_line`] for any `message` and `elapsed`: the line built whole, quoted,
    /// clipped and escaped as [`Logger::text_event`] does.
    fn text_job_line_general(&self, message: &str, elapsed: Option<&str>) {
        with_reused(&LINE, |line| {
            line.clear();
            write_time(line);
            PID_TID.with(|p| line.push_str(p));
            if let Some(current) = self.current()
                && let Ok(spans) = self.spans.lock()
            {
                Self::write_context(&spans, current, line, 0);
            }
            // As `Fields::record_str` writes a field other than the message.
            if let Some(value) = elapsed {
                line.push_str(" elapsed=");
                let start = line.len();
                line.push_str(&crate::redact::clip(value, MAX_VALUE_CHARS));
                quote_tail(line, start);
            }
            line.push(' ');
            line.push_str(level_name(&Level::INFO));
            line.push_str(": ");
            line.push_str(&crate::redact::clip(message, MAX_VALUE_CHARS));
            self.append(|out| {
                let _ = write_escaped(&mut Bytes(out), line);
                out.push(b'\n');
            });
        });
    }
}

/// `fmt::Write` into bytes.
pub(super) struct Bytes<'a>(pub(super) &'a mut Vec<u8>);

impl fmt::Write for Bytes<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

/// A span's fields as text, in the shape `tracing_subscriber`'s `DefaultFields` wrote them (which the
/// line format kept): ` name=value` each, values by `Debug` (so a `%` field prints its `Display`, a
/// plain string is quoted), a `r#` prefix dropped, `message` without its name.
pub(super) struct SpanText<'a>(pub(super) &'a mut String);

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
/// [`SpanText`] writes it. `printable` ends true when all it wrote is printable ASCII (the span slot's
/// `printable`, found here value by value rather than by a second scan of the whole text).
pub(super) struct JobText<'a> {
    pub(super) out: &'a mut String,
    pub(super) printable: bool,
}

impl Visit for JobText<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        let name = field.name();
        let out = &mut *self.out;
        // A job's three values are short, printable and unquoted: one scan decides, one reserve, no
        // clip and no second look at what was written.
        if value.len() <= MAX_VALUE_CHARS && plain_value(value.as_bytes()) {
            self.printable &= plain_value(name.as_bytes());
            out.reserve(name.len() + value.len() + 2);
            out.push(' ');
            out.push_str(name);
            out.push('=');
            out.push_str(value);
            return;
        }
        let piece = out.len();
        out.push(' ');
        out.push_str(name);
        out.push('=');
        let start = out.len();
        out.push_str(&crate::redact::clip(value, MAX_VALUE_CHARS));
        quote_tail(out, start);
        self.printable &= out
            .get(piece..)
            .is_some_and(|p| printable_ascii(p.as_bytes()));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let piece = self.out.len();
        SpanText(self.out).record_debug(field, value);
        self.printable &= self
            .out
            .get(piece..)
            .is_some_and(|p| printable_ascii(p.as_bytes()));
    }
}

/// True when every byte of `value` is printable ASCII and none is a space, `=` or `"`: a value a line
/// shows bare and copies without escapes ([`needs_quotes`] and [`printable_ascii`] in one scan). Eight
/// bytes at a time, the last partial word read as the whole word ending the value (its bytes overlap
/// ones already tested, which changes nothing for a test of every byte), a value of 4 to 7 bytes as
/// its first and last four: no byte loop for a class, a jid or a queue.
pub(super) fn plain_value(value: &[u8]) -> bool {
    let n = value.len();
    if n >= 8 {
        let mut words = value.chunks_exact(8);
        for w in &mut words {
            if !plain_word(w) {
                return false;
            }
        }
        words.remainder().is_empty() || value.get(n - 8..).is_some_and(plain_word)
    } else if n >= 4 {
        let half = |b: Option<&[u8]>| {
            b.and_then(|b| <[u8; 4]>::try_from(b).ok())
                .map_or(0, u32::from_ne_bytes)
        };
        let (lo, hi) = (half(value.get(..4)), half(value.get(n - 4..)));
        plain_bits(u64::from(lo) | (u64::from(hi) << 32))
    } else {
        value
            .iter()
            .all(|&b| (0x21..0x7f).contains(&b) && b != b'=' && b != b'"')
    }
}

/// [`plain_value`] of exactly eight bytes.
fn plain_word(w: &[u8]) -> bool {
    <[u8; 8]>::try_from(w).is_ok_and(|w| plain_bits(u64::from_ne_bytes(w)))
}

/// No byte of `x` below 0x21 (controls and the space: "has a byte less than n", exact for n <= 128),
/// at or above 0x7f (adding 1 sets its top bit; a byte at or above 0x80 has it already), `=` or `"`.
fn plain_bits(x: u64) -> bool {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    const BANG: u64 = u64::from_ne_bytes([0x21; 8]);
    // Whether any byte of `x` is zero (exact as to whether, not as to where).
    let zero = |x: u64| x.wrapping_sub(ONES) & !x & HIGH != 0;
    (x.wrapping_sub(BANG) & !x & HIGH) == 0
        && ((x.wrapping_add(ONES) | x) & HIGH) == 0
        && !zero(x ^ (ONES * u64::from(b'=')))
        && !zero(x ^ (ONES * u64::from(b'"')))
}

/// Quotes the value `out` holds from `start` when it has a space, `=` or `"` in it, with `"` and `\`
/// escaped inside: a class named `X jid=1 INFO: done` would otherwise read as fields of its own.
/// Plain values (`HardWorker`, `0.007`) stay bare, as Sidekiq prints them.
pub(super) fn quote_tail(out: &mut String, start: usize) {
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
pub(super) fn needs_quotes(value: &[u8]) -> bool {
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

/// Collects an event's message and its other fields as ` key=value`; reused per thread, so a log line
/// allocates nothing once the buffers have grown.
#[derive(Default)]
pub(super) struct Fields {
    pub(super) message: String,
    pub(super) rest: String,
}

impl Fields {
    pub(super) fn clear(&mut self) {
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

/// `2026-11-21T20:02:30.411Z`: the date part is formatted once per second per thread, the
/// milliseconds written as three digits (no `core::fmt`, no calendar arithmetic per line).
pub(super) fn write_time(out: &mut String) {
    let (secs, millis) = clock();
    with_second(secs, |prefix| out.push_str(prefix));
    out.push('.');
    for d in millis_digits(millis) {
        out.push(char::from(d));
    }
    out.push('Z');
}

/// The time [`write_time`] writes, as bytes on the stack: one copy into the line. `None` past year
/// 9999, whose date is longer.
pub(super) fn stamp_now() -> Option<[u8; 24]> {
    let (secs, millis) = clock();
    stamp_at(secs, millis)
}

/// The stamp of `secs` (since the epoch) and `millis`, the date part from this thread's cache.
pub(super) fn stamp_at(secs: i64, millis: u32) -> Option<[u8; 24]> {
    let (cached, date) = DATE.get();
    let date = if cached == secs {
        date
    } else {
        let date: [u8; 19] = with_second(secs, |prefix| prefix.as_bytes().try_into().ok())?;
        DATE.set((secs, date));
        date
    };
    let [a, b, c] = millis_digits(millis);
    let mut stamp = *b"0000-00-00T00:00:00.000Z";
    let (head, tail) = stamp.split_at_mut(19);
    head.copy_from_slice(&date);
    tail.copy_from_slice(&[b'.', a, b, c, b'Z']);
    Some(stamp)
}

/// The system clock: whole seconds since the epoch and the milliseconds (0 before the epoch).
fn clock() -> (i64, u32) {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = i64::try_from(since_epoch.as_secs()).unwrap_or(i64::MAX);
    (secs, since_epoch.subsec_millis().min(999))
}

/// `millis` (at most 999) as three ASCII digits.
fn millis_digits(millis: u32) -> [u8; 3] {
    let m = millis.min(999);
    [m / 100, m / 10 % 10, m % 10].map(|d| b'0' + d as u8)
}

/// Runs `f` on `YYYY-MM-DDTHH:MM:SS` of `secs`, formatted when the second differs from this thread's
/// last one. A date chrono cannot hold (past year 262 143) is written as the epoch, as before.
fn with_second<R>(secs: i64, f: impl FnOnce(&str) -> R) -> R {
    SECOND.with(|cell| {
        let mut c = cell.borrow_mut();
        if c.0 != secs {
            c.0 = secs;
            c.1 = chrono::DateTime::from_timestamp(secs, 0)
                .unwrap_or_default()
                .format("%Y-%m-%dT%H:%M:%S")
                .to_string();
        }
        f(&c.1)
    })
}
