//! The [`Logger`]'s `tracing` side: spans opened, entered, closed, and events sent to the format.

use super::escape::printable_ascii;
use super::*;

impl Logger {
    /// A subscriber writing `format` lines up to `max` into `out`.
    pub(super) fn new(max: LevelFilter, format: LogFormat, out: Arc<Sink>) -> Logger {
        Logger {
            max,
            format,
            out,
            spans: Mutex::new(Spans::default()),
            instance: INSTANCES.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// The innermost span this thread has entered, as an index.
    pub(super) fn current(&self) -> Option<usize> {
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
    pub(super) fn otel_of(&self, index: usize) -> Option<opentelemetry::Context> {
        self.spans.lock().ok()?.slots.get(index)?.otel.clone()
    }

    /// While tracing: an OpenTelemetry span for a span opened inside a traced one (a job's own spans
    /// nest in its consumer span), its fields as attributes; `None` outside a traced span.
    pub(super) fn otel_child(
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
    pub(super) fn otel_event(&self, event: &Event<'_>) {
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

    /// Runs `write` on the shared buffer; past [`FLUSH_AT`] bytes this thread writes them out itself
    /// (back-pressure: no line is ever dropped).
    /// The first line into an empty buffer wakes the writer if it sleeps ([`Sink::appended`]).
    pub(super) fn append(&self, write: impl FnOnce(&mut Vec<u8>)) {
        let (full, idle) = match self.out.lines.lock() {
            Ok(mut b) => {
                write(&mut b);
                (
                    b.len() > FLUSH_AT,
                    self.out.idle.load(std::sync::atomic::Ordering::Relaxed),
                )
            }
            Err(_) => (false, false),
        };
        self.out.appended(idle);
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
            // Whether `text` is printable ASCII: a job's span finds it as it writes its values.
            let printable = match self.format {
                // A job's span (one per job) has its three values as plain strings, written bare.
                LogFormat::Text if attrs.metadata().target() == JOB_TARGET => {
                    let mut job = JobText {
                        out: text,
                        printable: true,
                    };
                    attrs.record(&mut job);
                    job.printable
                }
                LogFormat::Text => {
                    attrs.record(&mut SpanText(text));
                    printable_ascii(text.as_bytes())
                }
                LogFormat::Json => {
                    attrs.record(&mut JsonFieldList(&mut json));
                    printable_ascii(text.as_bytes())
                }
            };
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
                slot.printable = printable;
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
                slot.printable &= printable_ascii(text.as_bytes());
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
