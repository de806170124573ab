//! The served queues' sizes and latencies for `/metrics`, read from Redis once per heartbeat interval
//! by one task and served from memory.
//!
//! Layer: migration and operations (beside [`crate::http`], its only user); it reads Redis through
//! [`crate::redis_conn`] and names keys through [`crate::keys`].
//!
//! Why not at the scrape: `/metrics` is an open port (the README's Kubernetes example binds
//! `0.0.0.0`), so what a scrape costs Redis must not depend on who scrapes how often, nor on how big
//! the jobs are. `LINDEX queue:<q> -1` sends the whole oldest payload: ten queues holding one 15 MB
//! job each, scraped in a loop, grew Redis's client output buffer to gigabytes. Here:
//!
//! - one task refreshes the figures every beat interval, whatever the scrape rate; scrapes read the
//!   last figures (concurrent scrapes cost Redis nothing at all);
//! - the refresh is one script ([`GAUGES_LUA`]) that returns, per queue, `LLEN` and only the text of
//!   the oldest job's `enqueued_at`: the payload stays inside Redis, and the reply is a few bytes
//!   per queue whatever the payloads weigh.
//!
//! `Queue#size` and `Queue#latency` of `api.rb@v6.4.1`: the latency is now minus the oldest job's
//! `enqueued_at`, 0 for an empty queue.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::redis_conn::Conn;

/// `KEYS` = the queues' lists. Returns `LLEN, enqueued_at` per key: the size (0 for a key that is not
/// a list), and the text of the oldest job's `enqueued_at` number, or `false`.
///
/// The field is found without decoding the payload (decoding a 15 MB job would block Redis). A
/// key inside a JSON string has its quotes escaped (`\"enqueued_at\":`), so only object keys match;
/// the last match is taken, because the client appends `enqueued_at` after `args` (`client.rb
/// atomic_push`, Sidekiq 6.4–8.1), and a nested one can only be inside `args`. ActiveJob's own
/// `enqueued_at` (inside `args`) is a string, which the number pattern skips. The last 16 KiB are
/// searched first (where the key is, even after a retry's error fields): the last match there is the
/// last of the payload, and a big payload is scanned whole only when its tail has none.
pub(crate) const GAUGES_LUA: &str = r#"
local function last_at(j, from)
  local pos, at = from, false
  while true do
    local s, e, v = string.find(j, '"enqueued_at"%s*:%s*(%-?[%d%.eE+]+)', pos)
    if not s then return at end
    at = v
    pos = e + 1
  end
end
local out = {}
for _, key in ipairs(KEYS) do
  local n = redis.pcall('LLEN', key)
  if type(n) ~= 'number' then n = 0 end
  local at = false
  if n > 0 then
    local j = redis.pcall('LINDEX', key, -1)
    if type(j) == 'string' then
      at = last_at(j, math.max(1, #j - 16384))
      if not at and #j > 16384 then at = last_at(j, 1) end
    end
  end
  out[#out + 1] = n
  out[#out + 1] = at
end
return out
"#;

/// One queue's figures: name, size, latency in seconds.
pub(crate) type QueueFigures = (String, i64, f64);

/// The last figures read, shared by the refresh task and the scrapes.
#[derive(Debug, Default)]
pub(crate) struct QueueGauges {
    /// The figures of the last refresh that reached Redis; empty before the first one.
    last: Mutex<Vec<QueueFigures>>,
}

impl QueueGauges {
    /// The last figures read (none yet, or Redis never answered: the queues are left out of the
    /// scrape, the counters are still worth it).
    pub(crate) fn snapshot(&self) -> Vec<QueueFigures> {
        self.last.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Reads every queue's figures once (one script call), and keeps them when Redis answered
    /// within `timeout`.
    pub(crate) async fn refresh(&self, conn: &Conn, queues: &[String], timeout: Duration) {
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(GAUGES_LUA));
        let mut inv = SCRIPT.prepare_invoke();
        for q in queues {
            inv.key(crate::keys::queue(q));
        }
        let mut conn = conn.clone();
        let read = inv.invoke_async::<Vec<redis::Value>>(&mut conn);
        let values = match tokio::time::timeout(timeout, read).await {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "cannot read the queue sizes for /metrics");
                return;
            }
            Err(_) => return,
        };
        let now = crate::time::now();
        let figures = queues
            .iter()
            .zip(values.chunks(2))
            .map(|(q, pair)| {
                let size = match pair.first() {
                    Some(redis::Value::Int(n)) => *n,
                    _ => 0,
                };
                let oldest = match pair.get(1) {
                    Some(redis::Value::BulkString(b)) => epoch_seconds(b),
                    _ => None,
                };
                let latency = oldest.map_or(0.0, |t| (now - t).max(0.0));
                (q.clone(), size, latency)
            })
            .collect();
        if let Ok(mut last) = self.last.lock() {
            *last = figures;
        }
    }

    /// Refreshes every `interval` until dropped (aborted with the server that owns it).
    pub(crate) fn spawn(
        self: &Arc<Self>,
        conn: Conn,
        queues: Vec<String>,
        interval: Duration,
        timeout: Duration,
    ) -> tokio::task::JoinHandle<()> {
        let gauges = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval.max(Duration::from_millis(100)));
            // A slow Redis delays the next read instead of bunching reads up.
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                gauges.refresh(&conn, &queues, timeout).await;
            }
        })
    }
}

/// An `enqueued_at` in epoch seconds: float seconds (Sidekiq ≤ 7) or integer milliseconds (Sidekiq 8,
/// `client.rb@v8.1.7` writes `now_in_millis`).
fn epoch_seconds(text: &[u8]) -> Option<f64> {
    let v: f64 = std::str::from_utf8(text).ok()?.parse().ok()?;
    if !v.is_finite() {
        return None;
    }
    if v > 100_000_000_000.0 && v.fract() == 0.0 {
        return Some(v / 1000.0);
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    #[test]
    fn enqueued_at_reads_seconds_and_milliseconds() {
        assert_eq!(super::epoch_seconds(b"1700000000.5"), Some(1_700_000_000.5));
        assert_eq!(
            super::epoch_seconds(b"1700000000500"),
            Some(1_700_000_000.5)
        );
        assert_eq!(super::epoch_seconds(b"1e999"), None);
        assert_eq!(super::epoch_seconds(b"x"), None);
    }
}
