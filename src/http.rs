//! The operations endpoint (`--http ADDR`, off by default): `GET /metrics`, `GET /health`, `GET /ready`.
//!
//! - `/metrics`: every metric of [`crate::prom`] in the text format Prometheus scrapes
//!   (OpenMetrics 1.0). Queue sizes and latencies, busy slots and the concurrency are read now, at
//!   the scrape, not counted per job.
//! - `/health` (liveness): `200 ok` whenever the runtime answers. A process that cannot answer this
//!   is wedged and should be restarted; a Redis outage is no reason to restart it.
//! - `/ready` (readiness): `200 ready` when Redis answers `PING` within [`REDIS_CHECK`], the last
//!   heartbeat reached Redis recently (within three beat intervals, as the reliable fetch's alive
//!   key), the process is neither quiet nor stopping, and no job waits for a fate write that fails
//!   for a reason other than an outage (a key of the wrong type); else `503` with the reason in the
//!   body (`redis unreachable: ...`, `heartbeat stale: ...`, `quiet`, `stopping`, `... job(s) whose
//!   fate cannot be written ...`).
//!
//! HTTP/1.1 by hyper (with hyper-util's tokio glue): no parsing here. Requests are read with a
//! header timeout, so an idle or slow client holds nothing for long. Nothing in these answers is
//! secret: class and queue names, counts, and a Redis error that names the server without its
//! password.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};

use crate::error::{Error, Result};
use crate::manager::WorkTable;
use crate::prom::{self, Gauges};
use crate::redis_conn::Conn;
use crate::shutdown::ShutdownSignal;

/// How long `/ready` and `/metrics` wait for Redis.
pub(crate) const REDIS_CHECK: Duration = Duration::from_secs(2);

/// What the endpoints read.
#[derive(Debug, Clone)]
pub(crate) struct State {
    /// The shared Redis connection.
    pub conn: Conn,
    /// The jobs in flight (busy slots).
    pub work: Arc<WorkTable>,
    /// `-c`.
    pub concurrency: usize,
    /// The queues this process serves.
    pub queues: Vec<String>,
    /// The process's phase.
    pub signal: ShutdownSignal,
    /// The heartbeat interval; a beat older than three of them is stale.
    pub beat_interval: Duration,
}

/// The running server; dropping it stops accepting and closes the connections it serves.
#[derive(Debug)]
pub(crate) struct Server {
    task: tokio::task::JoinHandle<()>,
}

impl Server {}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Binds `addr` (`host:port`) and serves the endpoints until the [`Server`] is dropped. A bind
/// failure (address in use, bad address) is an [`Error::Config`] naming the address.
pub(crate) async fn start(addr: &str, state: State) -> Result<Server> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Error::Config(format!("--http {addr}: cannot listen: {e}")))?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::Config(format!("--http {addr}: {e}")))?;
    tracing::info!(addr = %local, "serving /metrics, /health and /ready");
    let state = Arc::new(state);
    let task = tokio::spawn(async move {
        let mut connections = tokio::task::JoinSet::new();
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    // Out of descriptors and the like: wait a little rather than spin.
                    tracing::debug!(error = %e, "http accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            while connections.try_join_next().is_some() {}
            let state = state.clone();
            connections.spawn(async move {
                let service = service_fn(move |req| answer(state.clone(), req));
                let _ = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(10))
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(Server { task })
}

/// Starts the server when the configuration asks for one (`--http ADDR`).
pub(crate) async fn start_if(
    cfg: &crate::config::Config,
    conn: &Conn,
    work: &Arc<WorkTable>,
    signal: &ShutdownSignal,
) -> Result<Option<Server>> {
    let Some(addr) = cfg.http.as_deref() else {
        return Ok(None);
    };
    let state = State {
        conn: conn.clone(),
        work: work.clone(),
        concurrency: cfg.concurrency,
        queues: cfg.queues.iter().map(|q| q.name.clone()).collect(),
        signal: signal.clone(),
        beat_interval: cfg.beat_interval,
    };
    start(addr, state).await.map(Some)
}

fn text(status: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    r
}

const PLAIN: &str = "text/plain; charset=utf-8";
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

async fn answer(
    state: Arc<State>,
    req: Request<Incoming>,
) -> std::result::Result<Response<Full<Bytes>>, Infallible> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return Ok(text(
            StatusCode::METHOD_NOT_ALLOWED,
            PLAIN,
            "GET only\n".into(),
        ));
    }
    Ok(match req.uri().path() {
        "/health" => text(StatusCode::OK, PLAIN, "ok\n".into()),
        "/ready" => match readiness(&state).await {
            Ok(()) => text(StatusCode::OK, PLAIN, "ready\n".into()),
            Err(reason) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                PLAIN,
                format!("not ready: {reason}\n"),
            ),
        },
        "/metrics" => {
            let gauges = gauges(&state).await;
            match prom::metrics().encode(&gauges) {
                Ok(body) => text(StatusCode::OK, OPENMETRICS, body),
                Err(_) => text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    PLAIN,
                    "cannot encode the metrics\n".into(),
                ),
            }
        }
        _ => text(
            StatusCode::NOT_FOUND,
            PLAIN,
            "try /metrics, /health or /ready\n".into(),
        ),
    })
}

/// `Ok` when ready, else why not.
async fn readiness(state: &State) -> std::result::Result<(), String> {
    if state.signal.is_stopping() {
        return Err("stopping".into());
    }
    if state.signal.is_quiet() {
        return Err("quiet".into());
    }
    if let Some((n, why)) = prom::metrics().stuck_fates() {
        return Err(format!(
            "{n} job(s) whose fate cannot be written to redis (not an outage): {why}"
        ));
    }
    let mut conn = state.conn.clone();
    let cmd = redis::cmd("PING");
    let ping = cmd.query_async::<String>(&mut conn);
    match tokio::time::timeout(REDIS_CHECK, ping).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(format!("redis unreachable: {e}")),
        Err(_) => {
            return Err(format!(
                "redis unreachable: no answer to PING within {}s",
                REDIS_CHECK.as_secs()
            ));
        }
    }
    let stale_after = (state.beat_interval * 3).max(Duration::from_secs(3));
    match prom::metrics().since_last_beat() {
        None => Err("no heartbeat has reached redis yet".into()),
        Some(age) if age > stale_after => Err(format!(
            "heartbeat stale: the last one reached redis {:.1}s ago",
            age.as_secs_f64()
        )),
        Some(_) => Ok(()),
    }
}

/// Busy slots, concurrency, and each served queue's size and latency (`Queue#size`, `Queue#latency`
/// of `api.rb@v6.4.1`: now minus the oldest job's `enqueued_at`, 0 for an empty queue). Queues are
/// left out when Redis does not answer in time: the counters are still worth scraping.
async fn gauges(state: &State) -> Gauges {
    let mut g = Gauges {
        busy: state.work.len(),
        concurrency: state.concurrency,
        queues: Vec::new(),
    };
    let mut pipe = redis::pipe();
    for q in &state.queues {
        let key = crate::keys::queue(q);
        pipe.cmd("LLEN").arg(&key).cmd("LINDEX").arg(&key).arg(-1);
    }
    let mut conn = state.conn.clone();
    let read = pipe.query_async::<Vec<redis::Value>>(&mut conn);
    let Ok(Ok(values)) = tokio::time::timeout(REDIS_CHECK, read).await else {
        return g;
    };
    let now = crate::time::now();
    for (q, pair) in state.queues.iter().zip(values.chunks(2)) {
        let size = match pair.first() {
            Some(redis::Value::Int(n)) => *n,
            _ => 0,
        };
        let oldest = match pair.get(1) {
            Some(redis::Value::BulkString(b)) => enqueued_at(b),
            _ => None,
        };
        let latency = oldest.map_or(0.0, |t| (now - t).max(0.0));
        g.queues.push((q.clone(), size, latency));
    }
    g
}

/// A payload's `enqueued_at` in epoch seconds: float seconds (Sidekiq ≤ 7) or integer milliseconds
/// (Sidekiq 8, `Sidekiq::Job::Setter`/`client.rb@v8.1.7` write `now_in_millis`).
fn enqueued_at(payload: &[u8]) -> Option<f64> {
    #[derive(serde::Deserialize)]
    struct At {
        enqueued_at: Option<serde_json::Value>,
    }
    let at: At = serde_json::from_slice(payload).ok()?;
    let v = at.enqueued_at?;
    if let Some(ms) = v.as_u64().filter(|ms| *ms > 100_000_000_000) {
        return Some(ms as f64 / 1000.0);
    }
    v.as_f64()
}

#[cfg(test)]
mod tests {
    #[test]
    fn enqueued_at_reads_seconds_and_milliseconds() {
        assert_eq!(
            super::enqueued_at(br#"{"enqueued_at":1700000000.5}"#),
            Some(1_700_000_000.5)
        );
        assert_eq!(
            super::enqueued_at(br#"{"enqueued_at":1700000000500}"#),
            Some(1_700_000_000.5)
        );
        assert_eq!(super::enqueued_at(br#"{"x":1}"#), None);
        assert_eq!(super::enqueued_at(b"not json"), None);
    }
}
