//! OpenTelemetry traces, as Ruby's `opentelemetry-instrumentation-sidekiq` makes them (docs/tracing.md).
//!
//! Layer 1 (support), left of `logging`: the logger asks this module for spans, and everything here takes
//! plain values (bytes, strings), never a crate type from above. Off unless the standard `OTEL_*`
//! environment configures an exporter ([`init_from_env`]); while off, [`enabled`] is one atomic load and no
//! span machinery runs.
//!
//! What it holds: the tracer and the gem's two options (`span_naming`, `propagation_style`, read from the
//! gem's own `OTEL_RUBY_INSTRUMENTATION_SIDEKIQ_CONFIG_OPTS` so a fleet configures both sides once); the
//! consumer span of a job ([`JobSpan`], `<queue> process`, linked to, child of or unrelated to the
//! producer); the producer span of a Rust push ([`publish`], `<queue> publish`, whose W3C context goes
//! into the payload); and the export: OTLP over http/protobuf in the SDK's batch processor, on its own
//! thread with a bounded queue, so exporting never blocks a job. A down collector is reported once
//! ([`Reporting`]), and the spans the full queue dropped are counted and reported at the stop.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::propagation::{
    Extractor, Injector, TextMapCompositePropagator, TextMapPropagator,
};
use opentelemetry::trace::{
    Link, Span as _, SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};
use opentelemetry_sdk::trace::{
    BatchSpanProcessor, SdkTracer, SdkTracerProvider, SpanData, SpanExporter, SpanProcessor,
};
use serde::Deserialize;
use serde_json::value::RawValue;

/// How a job's span relates to the span that enqueued it: the gem's `propagation_style`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Style {
    /// A new trace whose root links to the producer (the gem's default).
    Link,
    /// The producer's trace, as its child.
    Child,
    /// A new trace, unrelated.
    None,
}

/// What a running process traces with.
struct State {
    /// The SDK's tracer (scope `oxidekiq`).
    tracer: SdkTracer,
    /// The gem's `propagation_style`.
    style: Style,
    /// The gem's `span_naming: :job_class` (else `:queue`).
    job_class_names: bool,
    /// W3C trace context and baggage, the Ruby SDK's default propagators.
    propagator: TextMapCompositePropagator,
}

/// Set once, by [`init_from_env`]; unset means tracing is off.
static STATE: OnceLock<State> = OnceLock::new();

/// True once an exporter is configured: the one check the hot path pays while tracing is off.
#[inline]
pub(crate) fn enabled() -> bool {
    STATE.get().is_some()
}

/// The bound on the flush at the stop: spans not out by then are dropped, the stop is not held up.
const FLUSH_BOUND: Duration = Duration::from_secs(1);

/// Keeps the provider; dropping it flushes what is queued, within [`FLUSH_BOUND`], and reports the
/// spans dropped while the process ran.
#[derive(Debug)]
pub(crate) struct OtelGuard {
    /// The provider the tracer came from.
    provider: SdkTracerProvider,
    /// Counts shared with the processor and the exporter.
    counts: Arc<Counts>,
}

impl Drop for OtelGuard {
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown_with_timeout(FLUSH_BOUND) {
            tracing::warn!(error = %e, bound = ?FLUSH_BOUND, "OpenTelemetry: the last spans were not flushed in time");
        }
        let ended = self.counts.ended.load(Ordering::Relaxed);
        let handed = self.counts.handed.load(Ordering::Relaxed);
        let failed = self.counts.failed_spans.load(Ordering::Relaxed);
        let dropped = ended.saturating_sub(handed);
        if dropped > 0 || failed > 0 {
            tracing::warn!(
                dropped_queue_full = dropped,
                failed_to_export = failed,
                "OpenTelemetry: spans lost while this process ran (the collector was slow or down)"
            );
        }
    }
}

/// What the processor and the exporter count, for the report at the stop.
#[derive(Debug, Default)]
struct Counts {
    /// Sampled spans that ended (handed to the batch queue, or dropped by it when full).
    ended: AtomicU64,
    /// Spans the batch thread handed to the exporter.
    handed: AtomicU64,
    /// Of those, spans in batches the collector did not take.
    failed_spans: AtomicU64,
    /// Set at the first failed export: the warning is written once.
    warned: AtomicBool,
}

/// The SDK's batch processor, counting the spans that end (the difference with those exported is what
/// its bounded queue dropped).
#[derive(Debug)]
struct Counting {
    /// The batch processor.
    inner: BatchSpanProcessor,
    /// Shared counts.
    counts: Arc<Counts>,
}

impl SpanProcessor for Counting {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }
    fn on_end(&self, span: SpanData) {
        self.counts.ended.fetch_add(1, Ordering::Relaxed);
        self.inner.on_end(span);
    }
    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }
    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }
    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter, reporting the first failed export with one warning line (a down collector fails
/// every batch: one line per batch would flood the log) and counting the spans lost.
#[derive(Debug)]
struct Reporting<E> {
    /// The OTLP exporter.
    inner: E,
    /// Where it sends, for the warning.
    endpoint: String,
    /// Shared counts.
    counts: Arc<Counts>,
}

impl<E: SpanExporter> SpanExporter for Reporting<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len() as u64;
        self.counts.handed.fetch_add(n, Ordering::Relaxed);
        let result = self.inner.export(batch).await;
        if let Err(e) = &result {
            self.counts.failed_spans.fetch_add(n, Ordering::Relaxed);
            if !self.counts.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(endpoint = %self.endpoint, error = %e,
                    "OpenTelemetry: exporting spans failed; jobs go on, their spans are dropped while the collector is unreachable (reported once; the count is logged at the stop)");
            }
        }
        result
    }
    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }
    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }
    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// The environment, as a function so tests can give their own.
type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// A value of `name`, empty counted as unset (the spec's rule).
fn var(env: Env<'_>, name: &str) -> Option<String> {
    env(name)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// Where spans go, or `None` when the environment configures no export: `OTEL_SDK_DISABLED=true` or
/// `OTEL_TRACES_EXPORTER=none` turn it off; an OTLP endpoint (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
/// `OTEL_EXPORTER_OTLP_ENDPOINT`) or `OTEL_TRACES_EXPORTER=otlp` turn it on. What this build cannot do
/// (grpc, http/json, TLS, another exporter) is an error, so a misconfiguration is seen at start, not in
/// an empty tracing backend.
pub(crate) fn configured(env: Env<'_>) -> Result<Option<String>, String> {
    if var(env, "OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    let exporter = var(env, "OTEL_TRACES_EXPORTER");
    let traces = var(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    let base = var(env, "OTEL_EXPORTER_OTLP_ENDPOINT");
    match exporter.as_deref() {
        Some("none") => return Ok(None),
        Some("otlp") => {}
        Some(other) => {
            return Err(format!(
                "OTEL_TRACES_EXPORTER={other} is not supported: oxidekiq exports traces with OTLP only (otlp or none)"
            ));
        }
        None if traces.is_none() && base.is_none() => return Ok(None),
        None => {}
    }
    let protocol = var(env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| var(env, "OTEL_EXPORTER_OTLP_PROTOCOL"))
        .unwrap_or_else(|| "http/protobuf".into());
    if protocol != "http/protobuf" {
        return Err(format!(
            "OTEL_EXPORTER_OTLP_PROTOCOL={protocol} is not supported: this build exports OTLP over http/protobuf only (the collector's port 4318); set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"
        ));
    }
    // The SDK's own rule: the signal's endpoint is used as is, the base one gets `/v1/traces`.
    let endpoint = match (traces, base) {
        (Some(t), _) => t,
        (None, Some(b)) => format!("{}/v1/traces", b.trim_end_matches('/')),
        (None, None) => "http://localhost:4318/v1/traces".into(),
    };
    if !endpoint.starts_with("http://") {
        return Err(format!(
            "the OTLP endpoint {endpoint} is not supported: this build sends plain http (a local collector or agent); TLS is not built in"
        ));
    }
    Ok(Some(endpoint))
}

/// The gem's two options from `OTEL_RUBY_INSTRUMENTATION_SIDEKIQ_CONFIG_OPTS`
/// (`propagation_style=child;span_naming=job_class`), the variable the Ruby side reads.
pub(crate) fn options(env: Env<'_>) -> Result<(Style, bool), String> {
    let mut style = Style::Link;
    let mut job_class = false;
    let Some(opts) = var(env, "OTEL_RUBY_INSTRUMENTATION_SIDEKIQ_CONFIG_OPTS") else {
        return Ok((style, job_class));
    };
    for part in opts.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('=').map(|(k, v)| (k.trim(), v.trim())) {
            Some(("propagation_style", v)) => {
                style = match v.trim_start_matches(':') {
                    "link" => Style::Link,
                    "child" => Style::Child,
                    "none" => Style::None,
                    _ => {
                        return Err(format!(
                            "propagation_style={v}: expected link, child or none"
                        ));
                    }
                }
            }
            Some(("span_naming", v)) => {
                job_class = match v.trim_start_matches(':') {
                    "queue" => false,
                    "job_class" => true,
                    _ => return Err(format!("span_naming={v}: expected queue or job_class")),
                }
            }
            // The gem's other options (peer_service, the poller and heartbeat spans) do not apply here.
            _ => {}
        }
    }
    Ok((style, job_class))
}

/// Turns tracing on when the process environment configures it; `Ok(None)` when it does not. Call once,
/// from the launcher, after the logger (the warnings go through it), and keep the guard until exit.
pub(crate) fn init_from_env() -> Result<Option<OtelGuard>, String> {
    let env = |k: &str| std::env::var(k).ok();
    let Some(endpoint) = configured(&env)? else {
        return Ok(None);
    };
    let (style, job_class_names) = options(&env)?;
    use opentelemetry_otlp::WithExportConfig as _;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_endpoint(endpoint.clone())
        .build()
        .map_err(|e| {
            format!("OpenTelemetry: cannot build the OTLP exporter for {endpoint}: {e}")
        })?;
    let counts = Arc::new(Counts::default());
    let reporting = Reporting {
        inner: exporter,
        endpoint: endpoint.clone(),
        counts: counts.clone(),
    };
    // The SDK's batch processor: its own thread, a bounded queue (OTEL_BSP_MAX_QUEUE_SIZE, 2048), spans
    // past it dropped, never a job waiting.
    let processor = Counting {
        inner: BatchSpanProcessor::builder(reporting).build(),
        counts: counts.clone(),
    };
    // The sampler (OTEL_TRACES_SAMPLER/_ARG) and the resource (OTEL_SERVICE_NAME,
    // OTEL_RESOURCE_ATTRIBUTES) are the SDK's defaults, read from the environment.
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .build();
    let tracer = provider.tracer("oxidekiq");
    let propagator = TextMapCompositePropagator::new(vec![
        Box::new(TraceContextPropagator::new()),
        Box::new(BaggagePropagator::new()),
    ]);
    let state = State {
        tracer,
        style,
        job_class_names,
        propagator,
    };
    if STATE.set(state).is_err() {
        // A second init (tests starting several launchers) keeps the first.
        let _ = provider.shutdown_with_timeout(Duration::ZERO);
        return Ok(None);
    }
    tracing::info!(endpoint = %endpoint, propagation_style = ?style, "OpenTelemetry traces exported with OTLP");
    Ok(Some(OtelGuard { provider, counts }))
}

/// The fields of a payload the consumer span reads, in one pass over its bytes (only while tracing).
#[derive(Deserialize, Default)]
#[serde(default)]
struct Head<'a> {
    /// The class, or ActiveJob's wrapper.
    #[serde(borrow)]
    class: Option<Cow<'a, str>>,
    /// ActiveJob's job class.
    #[serde(borrow)]
    wrapped: Option<Cow<'a, str>>,
    /// The jid.
    #[serde(borrow)]
    jid: Option<Cow<'a, str>>,
    /// The queue the payload names.
    #[serde(borrow)]
    queue: Option<Cow<'a, str>>,
    /// Seconds (a float, Sidekiq 6/7) or milliseconds (an integer, Sidekiq 8).
    created_at: Option<serde_json::Number>,
    /// As `created_at`.
    enqueued_at: Option<serde_json::Number>,
    /// W3C `traceparent`, as the gem's client middleware injects it (top level).
    #[serde(borrow)]
    traceparent: Option<Cow<'a, str>>,
    /// W3C `tracestate`.
    #[serde(borrow)]
    tracestate: Option<Cow<'a, str>>,
    /// W3C `baggage`.
    #[serde(borrow)]
    baggage: Option<Cow<'a, str>>,
    /// The arguments, kept raw: ActiveJob's instrumentation carries the context in the first one.
    #[serde(borrow)]
    args: Option<Vec<&'a RawValue>>,
}

/// ActiveJob's serialized job hash (`args[0]`), for `__otel_headers`: `[[key, value], ...]`, what
/// `serialize_arguments` makes of the headers hash.
#[derive(Deserialize, Default)]
#[serde(default)]
struct ActiveJobHead {
    /// The propagated headers.
    __otel_headers: Vec<(String, String)>,
}

/// A text map over header pairs.
struct Pairs<'a>(&'a [(String, String)]);

impl Extractor for Pairs<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| k.as_str()).collect()
    }
}

/// Header pairs collected by an injection.
#[derive(Default)]
pub(crate) struct Carrier(pub(crate) Vec<(String, String)>);

impl Injector for Carrier {
    fn set(&mut self, key: &str, value: String) {
        self.0.push((key.to_string(), value));
    }
}

/// The producer's context a payload carries: the top-level keys the Sidekiq gem writes, else the
/// `__otel_headers` of ActiveJob's instrumentation in `args[0]`.
fn extract(state: &State, head: &Head<'_>) -> Context {
    let mut pairs = Vec::new();
    for (k, v) in [
        ("traceparent", &head.traceparent),
        ("tracestate", &head.tracestate),
        ("baggage", &head.baggage),
    ] {
        if let Some(v) = v {
            pairs.push((k.to_string(), v.to_string()));
        }
    }
    if head.traceparent.is_none()
        && let Some(first) = head.args.as_ref().and_then(|a| a.first())
        && let Ok(aj) = serde_json::from_str::<ActiveJobHead>(first.get())
    {
        pairs = aj.__otel_headers;
    }
    if pairs.is_empty() {
        return Context::new();
    }
    state.propagator.extract(&Pairs(&pairs))
}

/// A Sidekiq timestamp as a time: a float is seconds, an integer milliseconds (the gem's rule).
fn timestamp(n: &serde_json::Number) -> Option<SystemTime> {
    let secs = if n.is_f64() {
        n.as_f64()?
    } else {
        n.as_f64()? / 1000.0
    };
    (secs.is_finite() && secs >= 0.0)
        .then(|| UNIX_EPOCH.checked_add(Duration::from_secs_f64(secs)))
        .flatten()
}

/// The attributes both the producer and the consumer span carry (the gem's, with its semantic
/// conventions' keys).
fn messaging_attributes(class: &str, jid: &str, queue: &str) -> Vec<KeyValue> {
    vec![
        KeyValue::new("messaging.system", "sidekiq"),
        KeyValue::new("messaging.sidekiq.job_class", class.to_string()),
        KeyValue::new("messaging.message_id", jid.to_string()),
        KeyValue::new("messaging.destination", queue.to_string()),
        KeyValue::new("messaging.destination_kind", "queue"),
    ]
}

/// A job's consumer span (`<queue> process`), from its payload; its context is what the job's own
/// `tracing` spans nest in ([`JobSpan::context`]). Ends when [`JobSpan::end`] is called or, on a path
/// that never gets there (a panic: the processor drops the job's future), when dropped, as failed.
#[derive(Debug)]
pub(crate) struct JobSpan {
    /// The span, active in this context, with the producer's baggage.
    cx: Context,
    /// Set by [`JobSpan::end`]: a drop without it is a run that never finished.
    ended: bool,
}

impl Drop for JobSpan {
    fn drop(&mut self) {
        if !self.ended {
            job_failed(
                &self.cx,
                crate::error::PANIC,
                "the job's run ended without finishing (a panic)",
            );
            self.cx.span().end();
        }
    }
}

impl JobSpan {
    /// The consumer span of the job whose bytes are `raw`, fetched from `queue`; `None` while tracing is
    /// off. A payload that does not parse still gets a span (named from `queue`).
    pub(crate) fn start(raw: &[u8], queue: &str) -> Option<JobSpan> {
        let state = STATE.get()?;
        let head: Head<'_> = serde_json::from_slice(raw).unwrap_or_default();
        let class = head
            .wrapped
            .as_deref()
            .or(head.class.as_deref())
            .unwrap_or_default();
        let queue = head.queue.as_deref().unwrap_or(queue);
        let jid = head.jid.as_deref().unwrap_or_default();
        let name = if state.job_class_names {
            format!("{class} process")
        } else {
            format!("{queue} process")
        };
        let mut attributes = messaging_attributes(class, jid, queue);
        attributes.push(KeyValue::new("messaging.operation", "process"));
        let parent = extract(state, &head);
        let builder = state
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Consumer)
            .with_attributes(attributes);
        let mut span = match state.style {
            Style::Child => builder.start_with_context(&state.tracer, &parent),
            Style::Link | Style::None => {
                let remote = parent.span().span_context().clone();
                let links = if state.style == Style::Link && remote.is_valid() {
                    vec![Link::with_context(remote)]
                } else {
                    Vec::new()
                };
                // A root: the producer's span is not its parent (the baggage still comes along).
                builder
                    .with_links(links)
                    .start_with_context(&state.tracer, &Context::new())
            }
        };
        for (event, at) in [
            ("created_at", &head.created_at),
            ("enqueued_at", &head.enqueued_at),
        ] {
            if let Some(at) = at.as_ref().and_then(timestamp) {
                span.add_event_with_timestamp(event, at, Vec::new());
            }
        }
        Some(JobSpan {
            cx: parent.with_span(span),
            ended: false,
        })
    }

    /// The context the job's own spans nest in.
    pub(crate) fn context(&self) -> &Context {
        &self.cx
    }

    /// Ends the span.
    pub(crate) fn end(mut self) {
        self.ended = true;
        self.cx.span().end();
    }
}

/// Marks the job span in `cx` failed as the gem does: the exception recorded (an `exception` event with
/// its type and message), the status an error naming its class.
pub(crate) fn job_failed(cx: &Context, class: &str, message: &str) {
    let span = cx.span();
    span.add_event(
        "exception",
        vec![
            KeyValue::new("exception.type", class.to_string()),
            KeyValue::new("exception.message", message.to_string()),
        ],
    );
    span.set_status(Status::error(format!(
        "Unhandled exception of type: {class}"
    )));
}

/// A span for a `tracing` span opened inside a traced one (a job's own spans): a child of `parent`,
/// named after the `tracing` span, its fields as attributes.
pub(crate) fn child(
    parent: &Context,
    name: &'static str,
    attributes: Vec<KeyValue>,
) -> Option<Context> {
    let state = STATE.get()?;
    let span = state
        .tracer
        .span_builder(name)
        .with_kind(SpanKind::Internal)
        .with_attributes(attributes)
        .start_with_context(&state.tracer, parent);
    Some(parent.with_span(span))
}

/// A producer span (`<queue> publish`) for a push made inside the traced `parent`, and the headers to
/// put at the top of its payload (`traceparent`, `tracestate`, `baggage`), as the gem's client
/// middleware does. End the span once the push is done.
pub(crate) fn publish(
    parent: &Context,
    class: &str,
    jid: &str,
    queue: &str,
) -> Option<(Context, Carrier)> {
    let state = STATE.get()?;
    let name = if state.job_class_names {
        format!("{class} publish")
    } else {
        format!("{queue} publish")
    };
    let span = state
        .tracer
        .span_builder(name)
        .with_kind(SpanKind::Producer)
        .with_attributes(messaging_attributes(class, jid, queue))
        .start_with_context(&state.tracer, parent);
    let cx = parent.with_span(span);
    let mut carrier = Carrier::default();
    state.propagator.inject_context(&cx, &mut carrier);
    Some((cx, carrier))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn off_unless_an_exporter_is_configured() {
        assert_eq!(configured(&env(&[])), Ok(None));
        assert_eq!(configured(&env(&[("OTEL_SERVICE_NAME", "a")])), Ok(None));
        let on = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318/")];
        assert_eq!(
            configured(&env(&on)),
            Ok(Some("http://c:4318/v1/traces".into()))
        );
        let traces = [("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:1/x")];
        assert_eq!(configured(&env(&traces)), Ok(Some("http://c:1/x".into())));
        let otlp = [("OTEL_TRACES_EXPORTER", "otlp")];
        assert_eq!(
            configured(&env(&otlp)),
            Ok(Some("http://localhost:4318/v1/traces".into()))
        );
        for off in [
            ("OTEL_SDK_DISABLED", "true"),
            ("OTEL_TRACES_EXPORTER", "none"),
        ] {
            assert_eq!(configured(&env(&[on[0], off])), Ok(None));
        }
    }

    #[test]
    fn what_this_build_cannot_export_is_refused() {
        for bad in [
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"),
            ("OTEL_TRACES_EXPORTER", "zipkin"),
        ] {
            let e = configured(&env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                bad,
            ]));
            assert!(e.is_err(), "{bad:?}");
        }
        let tls = [("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c:4318")];
        assert!(configured(&env(&tls)).unwrap_err().contains("TLS"));
    }

    #[test]
    fn the_gems_options_are_read_from_its_own_variable() {
        assert_eq!(options(&env(&[])), Ok((Style::Link, false)));
        let v = "OTEL_RUBY_INSTRUMENTATION_SIDEKIQ_CONFIG_OPTS";
        let both = [(
            v,
            "propagation_style=child; span_naming=job_class;peer_service=x",
        )];
        assert_eq!(options(&env(&both)), Ok((Style::Child, true)));
        assert_eq!(
            options(&env(&[(v, "propagation_style=:none")])),
            Ok((Style::None, false))
        );
        assert!(options(&env(&[(v, "propagation_style=sibling")])).is_err());
    }

    #[test]
    fn sidekiq_timestamps_are_seconds_as_floats_and_milliseconds_as_integers() {
        let secs: serde_json::Number = serde_json::from_str("1795291648.5").unwrap();
        let millis: serde_json::Number = serde_json::from_str("1795291648500").unwrap();
        assert_eq!(timestamp(&secs), timestamp(&millis));
        assert!(timestamp(&secs).is_some());
    }
}
