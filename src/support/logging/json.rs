//! The JSON format (`--log-format json`): one object per line, escaped past what serde_json escapes.

use super::*;

impl Logger {
    /// As [`Logger::write_context`], into a JSON object.
    pub(super) fn json_context(
        spans: &Spans,
        index: usize,
        line: &mut Map<String, Value>,
        depth: usize,
    ) {
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

    pub(super) fn json_event(&self, event: &Event<'_>) {
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
}

/// Replaces the value of `name`, or appends it.
pub(super) fn set_field(fields: &mut Vec<(&'static str, Value)>, name: &'static str, value: Value) {
    match fields.iter_mut().find(|(k, _)| *k == name) {
        Some(slot) => slot.1 = value,
        None => fields.push((name, value)),
    }
}

/// A span's fields for JSON lines (see [`JsonVisitor`] for the values).
pub(super) struct JsonFieldList<'a>(pub(super) &'a mut Vec<(&'static str, Value)>);

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

/// Rewrites the JSON that `out` holds from `start` with every character of [`needs_escape`] that
/// serde_json leaves raw (DEL, the C1 controls such as U+0085, the line and paragraph separators,
/// the bidirectional overrides) as a `\uXXXX` escape. serde_json escapes only what JSON requires,
/// and a viewer may break a line at U+2028 or reorder it at U+202E. Such a character can only be
/// inside a string of the line (everything else serde_json writes is ASCII), so the escape is valid
/// JSON for the same text. Lines of printable ASCII are left as they are after one scan.
pub(super) fn escape_json_tail(out: &mut Vec<u8>, start: usize) {
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

/// Collects an event's fields into a JSON map: strings and numbers as themselves, anything else as its
/// `Debug` text; `elapsed` (written as `"0.007"`) as a number.
pub(super) struct JsonVisitor<'a>(pub(super) &'a mut Map<String, Value>);

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
pub(super) fn json_f64(value: f64) -> Value {
    serde_json::Number::from_f64(value).map_or(Value::Null, Into::into)
}

/// A `Debug` value as its text, except `elapsed`, which is a number.
pub(super) fn json_debug(field: &Field, value: &dyn fmt::Debug) -> Value {
    json_text(field, &format!("{value:?}"))
}

/// A value's text as a JSON string, except `elapsed`, which is a number.
pub(super) fn json_text(field: &Field, text: &str) -> Value {
    if field.name() == "elapsed" {
        text.parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
            .map_or_else(|| clipped(text).into(), Into::into)
    } else {
        clipped(text).into()
    }
}
