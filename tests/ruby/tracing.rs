//! OpenTelemetry traces across Ruby and Rust (docs/tracing.md), seen in a real OTLP receiver: a small
//! HTTP server in this test that decodes what the `oxidekiq` binary exports (OTLP http/protobuf) with the
//! OpenTelemetry project's own message types.
//!
//! The producer side is Ruby Sidekiq 6.4's client with a client middleware that writes the context
//! where `opentelemetry-instrumentation-sidekiq`'s does (`OpenTelemetry.propagation.inject(job)`: top-level
//! `traceparent`, no `tracestate` when empty), its ids drawn by Ruby in the same run; the ActiveJob case
//! writes `__otel_headers` into the job hash as `opentelemetry-instrumentation-active_job`'s
//! `serialize` does. The gems themselves are not installed (not Debian packages): the payload shapes
//! are built from their source, as docs/tracing.md records.
use crate::support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use redis::Commands;
use support::Oxidekiq;
use support::{RedisServer, wait_until};
use support::{ruby, ruby_activejob, ruby_with_env};

/// Span kinds, as OTLP numbers them.
const INTERNAL: i32 = 1;
const PRODUCER: i32 = 4;
const CONSUMER: i32 = 5;
/// `STATUS_CODE_ERROR`.
const ERROR: i32 = 2;

/// An OTLP/HTTP receiver on a free loopback port, keeping every span it is sent; stops with the test.
struct Receiver {
    port: u16,
    spans: Arc<Mutex<Vec<Span>>>,
    stop: Arc<AtomicBool>,
}

impl Receiver {
    fn start() -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        listener.set_nonblocking(true).unwrap();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (spans.clone(), stop.clone());
        std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let s = s.clone();
                        std::thread::spawn(move || serve(conn, &s));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        Receiver { port, spans, stop }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits (generously) until a span named `name` has arrived.
    fn wait_span(&self, name: &str) -> Span {
        let found = wait_until(Duration::from_secs(30), || {
            self.spans().iter().any(|s| s.name == name)
        });
        assert!(
            found,
            "no span {name:?} received; got {:?}",
            names(&self.spans())
        );
        self.spans().into_iter().find(|s| s.name == name).unwrap()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn names(spans: &[Span]) -> Vec<String> {
    spans.iter().map(|s| s.name.clone()).collect()
}

/// One keep-alive connection: each request's protobuf body decoded, answered `200` with an empty
/// `ExportTraceServiceResponse`.
fn serve(conn: TcpStream, spans: &Mutex<Vec<Span>>) {
    conn.set_read_timeout(Some(Duration::from_secs(60))).ok();
    let mut write = conn.try_clone().unwrap();
    let mut read = BufReader::new(conn);
    loop {
        let mut length = 0usize;
        let mut line = String::new();
        let mut first = true;
        loop {
            line.clear();
            if read.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            if first {
                assert!(
                    line.starts_with("POST /v1/traces "),
                    "unexpected request {line:?}"
                );
                first = false;
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                length = v.trim().parse().unwrap();
            }
        }
        let mut body = vec![0u8; length];
        if read.read_exact(&mut body).is_err() {
            return;
        }
        let request = ExportTraceServiceRequest::decode(body.as_slice()).unwrap();
        let mut all = spans.lock().unwrap();
        for r in request.resource_spans {
            for s in r.scope_spans {
                all.extend(s.spans);
            }
        }
        drop(all);
        let reply =
            "HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n";
        if write.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn attr(span: &Span, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
            Any::StringValue(s) => Some(s.clone()),
            Any::IntValue(i) => Some(i.to_string()),
            Any::BoolValue(b) => Some(b.to_string()),
            Any::DoubleValue(d) => Some(d.to_string()),
            _ => None,
        })
}

/// The environment that turns tracing on, with a short batch delay so spans arrive soon.
fn otel_env(receiver: &Receiver) -> Vec<(&'static str, String)> {
    vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".into()),
        ("OTEL_SERVICE_NAME", "oxidekiq-test".into()),
    ]
}

/// As [`otel_env`], with the Ruby gem's options (`OTEL_RUBY_INSTRUMENTATION_SIDEKIQ_CONFIG_OPTS`).
fn otel_env_with(receiver: &Receiver, opts: &str) -> Vec<(&'static str, String)> {
    let mut env = otel_env(receiver);
    env.push(("OTEL_RUBY_INSTRUMENTATION_SIDEKIQ_CONFIG_OPTS", opts.into()));
    env
}

fn start(redis: &RedisServer, env: &[(&'static str, String)], queues: &[&str]) -> Oxidekiq {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut args = vec!["-c", "5"];
    for q in queues {
        args.push("-q");
        args.push(q);
    }
    // Jobs pushed before it is up wait in their queue: no need to wait for the start.
    Oxidekiq::start_with_env(&redis.url(), &args, &env)
}

/// Ruby enqueues `TracedJob(step, enqueue_to, fail)` with a context where the Sidekiq gem's client
/// middleware writes it; prints `trace_id span_id jid`.
const RUBY_PRODUCER: &str = r##"
require "securerandom"
class OtelLikeClientMiddleware
  def call(_worker_class, job, _queue, _redis_pool)
    $trace_id = SecureRandom.hex(16)
    $span_id = SecureRandom.hex(8)
    job["traceparent"] = "00-#{$trace_id}-#{$span_id}-01"
    yield
  end
end
Sidekiq.configure_client { |c| c.client_middleware { |ch| ch.add OtelLikeClientMiddleware } }
args = JSON.parse(ENV.fetch("JOB_ARGS"))
jid = Sidekiq::Client.push("class" => ENV.fetch("JOB_CLASS", "TracedJob"), "queue" => "default", "args" => args)
puts "#{$trace_id} #{$span_id} #{jid}"
"##;

fn ruby_push(redis: &RedisServer, args: &str) -> (String, String, String) {
    ruby_push_class(redis, "TracedJob", args)
}

fn ruby_push_class(redis: &RedisServer, class: &str, args: &str) -> (String, String, String) {
    let env = [("JOB_ARGS", args), ("JOB_CLASS", class)];
    let out = ruby_with_env(RUBY_PRODUCER, &redis.url(), &env);
    let parts: Vec<String> = out.trimmed().split(' ').map(str::to_string).collect();
    assert_eq!(parts.len(), 3, "{}", out.trimmed());
    (parts[0].clone(), parts[1].clone(), parts[2].clone())
}

/// Waits (generously) until the job that failed is in the retry set: its fate is as without tracing.
fn wait_in_retry_set(redis: &RedisServer) {
    let mut conn = redis.conn();
    let retried = wait_until(Duration::from_secs(20), || {
        conn.zcard::<_, i64>("retry").unwrap() == 1
    });
    assert!(retried, "the failed job is not in the retry set");
}

fn stop(mut ox: Oxidekiq) -> String {
    ox.signal("TERM");
    assert!(
        ox.wait_exit(Duration::from_secs(30)).is_some(),
        "did not stop: {}",
        ox.log()
    );
    ox.log()
}

#[test]
fn a_ruby_traced_job_gets_a_linked_consumer_span_with_its_own_spans_nested() {
    let redis = RedisServer::start();
    let receiver = Receiver::start();
    let ox = start(&redis, &otel_env(&receiver), &["default"]);
    let (trace_id, span_id, jid) = ruby_push(&redis, r#"["render", null, false]"#);

    let consumer = receiver.wait_span("default process");
    assert_eq!(consumer.kind, CONSUMER);
    for (key, want) in [
        ("messaging.system", "sidekiq"),
        ("messaging.sidekiq.job_class", "TracedJob"),
        ("messaging.message_id", jid.as_str()),
        ("messaging.destination", "default"),
        ("messaging.destination_kind", "queue"),
        ("messaging.operation", "process"),
    ] {
        assert_eq!(attr(&consumer, key).as_deref(), Some(want), "{key}");
    }
    // The gem's default style: a new trace, linked to the producer's span.
    assert!(consumer.parent_span_id.is_empty(), "a root span");
    assert_ne!(hex(&consumer.trace_id), trace_id);
    assert_eq!(consumer.links.len(), 1);
    assert_eq!(hex(&consumer.links[0].trace_id), trace_id);
    assert_eq!(hex(&consumer.links[0].span_id), span_id);
    // The gem's two timestamps first; the job's log lines ("start", "done") follow as events.
    let events: Vec<&str> = consumer.events.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(events[..2], ["created_at", "enqueued_at"], "{events:?}");

    // The worker's own `tracing` span is the consumer span's child, its event inside.
    let step = receiver.wait_span("step");
    assert_eq!(step.kind, INTERNAL);
    assert_eq!(step.trace_id, consumer.trace_id);
    assert_eq!(step.parent_span_id, consumer.span_id);
    assert_eq!(attr(&step, "name").as_deref(), Some("render"));
    assert!(
        step.events.iter().any(|e| e.name == "step ran"),
        "{:?}",
        step.events
    );
    stop(ox);
}

#[test]
fn propagation_style_child_continues_the_producers_trace_and_a_failure_is_an_error_status() {
    let redis = RedisServer::start();
    let receiver = Receiver::start();
    let env = otel_env_with(&receiver, "propagation_style=child;span_naming=job_class");
    let ox = start(&redis, &env, &["default"]);
    let (trace_id, span_id, _) = ruby_push(&redis, r#"["boom", null, true]"#);

    let consumer = receiver.wait_span("TracedJob process");
    assert_eq!(hex(&consumer.trace_id), trace_id);
    assert_eq!(hex(&consumer.parent_span_id), span_id);
    assert!(consumer.links.is_empty());
    let status = consumer.status.clone().unwrap_or_default();
    assert_eq!(status.code, ERROR);
    assert_eq!(status.message, "Unhandled exception of type: RuntimeError");
    let exception = consumer
        .events
        .iter()
        .find(|e| e.name == "exception")
        .expect("exception event");
    let ty = exception
        .attributes
        .iter()
        .find(|kv| kv.key == "exception.type")
        .unwrap();
    assert!(
        matches!(ty.value.as_ref().unwrap().value.as_ref().unwrap(), Any::StringValue(s) if s == "RuntimeError")
    );
    // The job failed as usual: it is in the retry set.
    wait_in_retry_set(&redis);
    stop(ox);
}

#[test]
fn a_job_that_panics_ends_its_span_as_failed() {
    let redis = RedisServer::start();
    let receiver = Receiver::start();
    let ox = start(&redis, &otel_env(&receiver), &["default"]);
    ruby_push_class(&redis, "ChaosJob", r#"["panic", 0, "p7"]"#);
    let consumer = receiver.wait_span("default process");
    let status = consumer.status.clone().unwrap_or_default();
    assert_eq!(status.code, ERROR);
    assert_eq!(
        status.message,
        "Unhandled exception of type: Oxidekiq::Panic"
    );
    // The job itself failed as usual: it is in the retry set.
    wait_in_retry_set(&redis);
    stop(ox);
}

#[test]
fn activejobs_otel_headers_are_the_context_when_the_sidekiq_gem_wrote_none() {
    let redis = RedisServer::start();
    let receiver = Receiver::start();
    let env = otel_env_with(&receiver, "propagation_style=child");
    let ox = start(&redis, &env, &["default"]);
    // What opentelemetry-instrumentation-active_job's `Patches::Base#serialize` adds to the job hash.
    let out = ruby_activejob(
        r##"
require "securerandom"
module OtelHeaders
  def serialize
    message = super
    message.merge!("__otel_headers" => serialize_arguments(@__otel_headers))
  end
end
ActiveJob::Base.prepend(OtelHeaders)
class NoopActiveJob < ActiveJob::Base
  def perform(*); end
end
trace_id = SecureRandom.hex(16)
span_id = SecureRandom.hex(8)
job = NoopActiveJob.new
job.instance_variable_set(:@__otel_headers, { "traceparent" => "00-#{trace_id}-#{span_id}-01" })
job.enqueue
puts "#{trace_id} #{span_id}"
"##,
        &redis.url(),
    );
    let (trace_id, span_id) = out.trimmed().split_once(' ').unwrap();
    let consumer = receiver.wait_span("default process");
    assert_eq!(
        attr(&consumer, "messaging.sidekiq.job_class").as_deref(),
        Some("NoopActiveJob")
    );
    assert_eq!(hex(&consumer.trace_id), trace_id);
    assert_eq!(hex(&consumer.parent_span_id), span_id);
    stop(ox);
}

#[test]
fn a_push_from_a_traced_rust_job_carries_a_traceparent_ruby_continues() {
    let redis = RedisServer::start();
    let receiver = Receiver::start();
    let ox = start(&redis, &otel_env(&receiver), &["default"]);
    ruby_push(&redis, r#"["fan-out", "ruby_side", false]"#);
    let consumer = receiver.wait_span("default process");
    let publish = receiver.wait_span("ruby_side publish");
    let step = receiver.wait_span("step");
    assert_eq!(publish.kind, PRODUCER);
    assert_eq!(publish.trace_id, consumer.trace_id);
    assert_eq!(
        publish.parent_span_id, step.span_id,
        "the push was made inside the job's span"
    );
    assert_eq!(
        attr(&publish, "messaging.sidekiq.job_class").as_deref(),
        Some("TracedChild")
    );

    // Ruby reads the pushed payload's traceparent as the W3C format (and the Ruby SDK's
    // `TraceParent.from_string`) does.
    let out = ruby(
        r##"
require "sidekiq/api"
job = Sidekiq::Queue.new("ruby_side").first or abort("no job")
m = /\A00-(\h{32})-(\h{16})-(\h{2})\z/.match(job["traceparent"]) or abort("bad traceparent #{job["traceparent"].inspect}")
abort("all-zero ids") if m[1] == "0" * 32 || m[2] == "0" * 16
puts "#{m[1]} #{m[2]} #{m[3]} #{job.item.key?("tracestate")}"
"##,
        &redis.url(),
    );
    let parts: Vec<&str> = out.trimmed().split(' ').collect();
    assert_eq!(
        parts[0],
        hex(&consumer.trace_id),
        "Ruby continues the Rust trace"
    );
    assert_eq!(
        parts[1],
        hex(&publish.span_id),
        "its parent is the publish span"
    );
    assert_eq!(parts[2], "01", "sampled");
    assert_eq!(
        parts[3], "false",
        "no empty tracestate, as Ruby writes none"
    );
    stop(ox);
}

#[test]
fn a_perform_later_from_a_traced_rust_job_carries_the_context_where_activejob_reads_it_too() {
    let redis = RedisServer::start();
    let receiver = Receiver::start();
    let ox = start(&redis, &otel_env(&receiver), &["default"]);
    ruby_push(&redis, r#"["aj", "activejob:aj_side", false]"#);
    let publish = receiver.wait_span("aj_side publish");
    assert_eq!(
        attr(&publish, "messaging.sidekiq.job_class").as_deref(),
        Some("TracedChild")
    );
    // ActiveJob's instrumentation reads `__otel_headers` back with `deserialize_arguments(...).to_h`:
    // done here by ActiveJob itself, on the job hash the Rust client wrote.
    let out = ruby_activejob(
        r##"
require "sidekiq/api"
job = Sidekiq::Queue.new("aj_side").first or abort("no job")
data = job.args.first
headers = ActiveJob::Arguments.deserialize(data.fetch("__otel_headers")).to_h
puts [headers.fetch("traceparent"), job["traceparent"]].join(" ")
"##,
        &redis.url(),
    );
    let (from_activejob, top_level) = out.trimmed().split_once(' ').unwrap();
    assert_eq!(from_activejob, top_level);
    let want = format!("00-{}-{}-01", hex(&publish.trace_id), hex(&publish.span_id));
    assert_eq!(top_level, want);
    stop(ox);
}

#[test]
fn without_otel_configuration_nothing_is_traced_or_injected() {
    let redis = RedisServer::start();
    let receiver = Receiver::start();
    // OTEL_SDK_DISABLED wins over an endpoint; a service name alone configures no export.
    for env in [
        vec![("OTEL_SERVICE_NAME", "x".to_string())],
        vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()),
            ("OTEL_SDK_DISABLED", "true".to_string()),
        ],
    ] {
        let ox = start(&redis, &env, &["default"]);
        ruby_push(&redis, r#"["quiet", "untraced", false]"#);
        let mut conn = redis.conn();
        assert!(wait_until(Duration::from_secs(20), || conn
            .llen::<_, i64>("queue:untraced")
            .unwrap()
            == 1));
        let payload: String = conn.rpop("queue:untraced", None).unwrap();
        assert!(!payload.contains("traceparent"), "{payload}");
        let log = stop(ox);
        assert!(!log.contains("OpenTelemetry"), "{log}");
    }
    // Spans that must NOT arrive: time for a late export to reach the receiver, were there one.
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        receiver.spans().is_empty(),
        "{:?}",
        names(&receiver.spans())
    );
}

#[test]
fn a_down_collector_costs_no_job_and_is_reported_once() {
    let redis = RedisServer::start();
    // A port nothing listens on.
    let port = support::free_port();
    let env = vec![
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://127.0.0.1:{port}"),
        ),
        ("OTEL_BSP_SCHEDULE_DELAY", "50".to_string()),
    ];
    let ox = start(&redis, &env, &["default"]);
    let out = ruby(
        r##"
200.times { |i| Sidekiq::Client.push("class" => "TracedJob", "queue" => "default", "args" => ["n#{i}", nil, false], "traceparent" => "00-#{"ab" * 16}-#{"cd" * 8}-01") }
puts "ok"
"##,
        &redis.url(),
    );
    assert_eq!(out.trimmed(), "ok");
    let mut conn = redis.conn();
    let done = wait_until(Duration::from_secs(60), || {
        conn.get::<_, Option<i64>>("stat:processed")
            .unwrap()
            .unwrap_or(0)
            >= 200
    });
    assert!(done, "jobs not all done: {}", ox.log());
    assert_eq!(
        conn.get::<_, Option<i64>>("stat:failed")
            .unwrap()
            .unwrap_or(0),
        0
    );
    // Several batches failed by now; the warning is written once.
    assert!(
        ox.wait_for_log("exporting spans failed", Duration::from_secs(20)),
        "{}",
        ox.log()
    );
    // A second warning must NOT come: time for more batches to fail, were it written per batch.
    std::thread::sleep(Duration::from_millis(500));
    let log = stop(ox);
    assert_eq!(log.matches("exporting spans failed").count(), 1, "{log}");
    // At the stop, the spans lost are counted once more, in one line.
    assert_eq!(
        log.matches("spans lost while this process ran").count(),
        1,
        "{log}"
    );
    eprintln!("{log}");
}

#[test]
fn a_protocol_this_build_cannot_export_is_refused_at_start() {
    let redis = RedisServer::start();
    let (code, _out, err) = {
        let mut ox = Oxidekiq::start_with_env(
            &redis.url(),
            &[],
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ],
        );
        let status = ox.wait_exit(Duration::from_secs(30)).expect("exits");
        (status.code(), (), ox.log())
    };
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("http/protobuf"), "{err}");
}
