//! The span table: a slot per open span, reused through a free list.

use super::*;

/// The span table: slots reused through a free list, so a job's span allocates nothing once the table
/// has grown to the number of jobs in flight.
#[derive(Default)]
pub(super) struct Spans {
    pub(super) slots: Vec<Slot>,
    pub(super) free: Vec<usize>,
}

#[derive(Default)]
pub(super) struct Slot {
    /// Handles alive (`clone_span` / `try_close`), children included: 0 = free.
    pub(super) refs: usize,
    /// The parent span's index, if any (held by one reference while this one lives).
    pub(super) parent: Option<usize>,
    pub(super) metadata: Option<&'static Metadata<'static>>,
    /// Text format: the fields as ` name=value` each (tracing_subscriber's `DefaultFields` shape).
    pub(super) text: String,
    /// `text` is printable ASCII: a line copies it as is, without the escape test
    /// ([`super::write_escaped`]) every line would otherwise make of it.
    pub(super) printable: bool,
    /// JSON format: the fields in order, a later record of the same name replacing the value.
    pub(super) json: Vec<(&'static str, Value)>,
    /// While tracing ([`crate::otel`]): the OpenTelemetry context of this span, set for a job's span by
    /// [`attach_otel`] and made for each span opened inside one; `None` otherwise.
    pub(super) otel: Option<opentelemetry::Context>,
    /// The OpenTelemetry span in `otel` is this span's own, ended when this span closes (a job's
    /// consumer span is ended by the processor, which sets its status first).
    pub(super) otel_owned: bool,
}

pub(super) static INSTANCES: AtomicUsize = AtomicUsize::new(0);

pub(super) fn index_of(id: &Id) -> usize {
    (id.into_u64() as usize).wrapping_sub(1)
}
