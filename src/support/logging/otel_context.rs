//! OpenTelemetry: a span's fields as attributes, and a job's context carried by its `tracing` span.

use super::*;

/// A span's or an event's fields as OpenTelemetry attributes (the message apart, an event's name).
#[derive(Default)]
pub(super) struct OtelFields {
    /// `message`, for an event.
    pub(super) message: String,
    /// The other fields.
    pub(super) attributes: Vec<opentelemetry::KeyValue>,
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
    pub(super) fn put(&mut self, field: &Field, value: opentelemetry::Value) {
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
