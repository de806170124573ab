//! The operations endpoint (`--http ADDR`, off by default): `GET /metrics`, `GET /health`, `GET /ready`.
//!
//! - `/metrics`: every metric of [`crate::prom`] in the text format Prometheus scrapes
//!   (OpenMetrics 1.0). Busy slots and the concurrency are read at the scrape; queue sizes and
//!   latencies are read from Redis once per beat interval by one task ([`crate::queue_gauges`]) and
//!   served from memory, so a scrape costs Redis nothing whatever the scrape rate and job sizes.
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
//! header timeout, so an idle or slow client holds nothing for long, and at most
//! [`MAX_CONNECTIONS`] are open at once, plus [`SPARE_CONNECTIONS`] that serve one request each and wait
//! at most a second for it (so probes answer while idle clients hold every slot): past that, new ones
//! wait in the kernel's backlog, so
//! clients of the endpoint can never take the descriptors the job side needs for Redis. Nothing in these answers is
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
use crate::prom::{self, Gauges};
use crate::queue_gauges::QueueGauges;
use crate::redis_conn::Conn;
use crate::shutdown::ShutdownSignal;
use crate::work_table::WorkTable;

/// How long `/ready` and `/metrics` wait for Redis.
pub(crate) const REDIS_CHECK: Duration = Duration::from_secs(2);

/// Connections served at once. Scrapers and probes need a handful; the cap keeps a flood of idle
/// clients (2 000 of them took every descriptor under `ulimit -n 1024`) from starving the Redis
/// connections of descriptors.
pub(crate) const MAX_CONNECTIONS: usize = 64;

/// Connections served past [`MAX_CONNECTIONS`], one request each, whose headers must come within
/// [`SPARE_HEADER_TIMEOUT`]: probes stay answerable while idle clients hold every ordinary slot.
pub(crate) const SPARE_CONNECTIONS: usize = 8;

/// How long a spare connection waits for its request's headers.
const SPARE_HEADER_TIMEOUT: Duration = Duration::from_secs(1);

/// What the endpoints read.
#[derive(Debug, Clone)]
pub(crate) struct State {
    /// The shared Redis connection.
    pub conn: Conn,
    /// Each capsule's name, slots and jobs in flight (busy slots), the default capsule first.
    pub capsules: Vec<(String, usize, Arc<WorkTable>)>,
    /// The queues this process serves.
    pub queues: Vec<String>,
    /// The process's phase.
    pub signal: ShutdownSignal,
    /// The heartbeat interval; a beat older than three of them is stale.
    pub beat_interval: Duration,
    /// The queues' sizes and latencies, refreshed once per beat interval.
    pub queue_gauges: Arc<QueueGauges>,
}

/// The running server; dropping it stops accepting and closes the connections it serves.
#[derive(Debug)]
pub(crate) struct Server {
    /// Accepts and serves connections.
    task: tokio::task::JoinHandle<()>,
    /// Refreshes the queue gauges.
    refresh: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
        self.refresh.abort();
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
    let refresh = state.queue_gauges.spawn(
        state.conn.clone(),
        state.queues.clone(),
        state.beat_interval,
        REDIS_CHECK,
    );
    let state = Arc::new(state);
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let spare = Arc::new(tokio::sync::Semaphore::new(SPARE_CONNECTIONS));
    let task = tokio::spawn(async move {
        let mut connections = tokio::task::JoinSet::new();
        loop {
            // A slot before the accept: at the cap, new clients wait in the backlog and hold no
            // descriptor of ours. Past the cap a spare slot serves one request at most, whose
            // headers must come within a second: idle clients holding every slot kept `/health`
            // and `/ready` from answering for 10 s at a time (issue 43).
            let (slot, spare_slot) = match slots.clone().try_acquire_owned() {
                Ok(slot) => (slot, false),
                Err(_) => tokio::select! {
                    s = slots.clone().acquire_owned() => match s {
                        Ok(slot) => (slot, false),
                        Err(_) => return,
                    },
                    s = spare.clone().acquire_owned() => match s {
                        Ok(slot) => (slot, true),
                        Err(_) => return,
                    },
                },
            };
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
                let _slot = slot;
                let service = service_fn(move |req| answer(state.clone(), req));
                let (timeout, keep_alive) = if spare_slot {
                    (SPARE_HEADER_TIMEOUT, false)
                } else {
                    (Duration::from_secs(10), true)
                };
                let _ = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(timeout)
                    .keep_alive(keep_alive)
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(Server { task, refresh })
}

/// Starts the server when the configuration asks for one (`--http ADDR`).
pub(crate) async fn start_if(
    cfg: &crate::config::Config,
    conn: &Conn,
    capsules: Vec<(String, usize, Arc<WorkTable>)>,
    signal: &ShutdownSignal,
) -> Result<Option<Server>> {
    let Some(addr) = cfg.http.as_deref() else {
        return Ok(None);
    };
    let state = State {
        conn: conn.clone(),
        capsules,
        queues: cfg.served_queues().map(str::to_string).collect(),
        signal: signal.clone(),
        beat_interval: cfg.beat_interval,
        queue_gauges: Arc::default(),
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
            let gauges = gauges(&state);
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

/// Busy slots and concurrency now, and the queues' figures of the last refresh.
fn gauges(state: &State) -> Gauges {
    let capsules: Vec<(String, usize, usize)> = state
        .capsules
        .iter()
        .map(|(name, concurrency, work)| (name.clone(), work.len(), *concurrency))
        .collect();
    Gauges {
        busy: capsules.iter().map(|c| c.1).sum(),
        concurrency: capsules.iter().map(|c| c.2).sum(),
        capsules,
        queues: state.queue_gauges.snapshot(),
    }
}
