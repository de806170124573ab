//! An in-process launcher for tests: a [`config`] on the test's own Redis with fast beats and polls,
//! [`launch`] to start it, [`wait_for`] to wait on a condition from async code, and the repository's
//! [`fixture`] files.

use std::time::Duration;

use oxidekiq::Registry;
use oxidekiq::config::{Config, QueueWeight};
use oxidekiq::launcher::{Handle, Launcher};
use serde_json::Value;

/// Queues fetched in strict order (every weight 0), as `-q a -q b` gives them.
pub fn strict_queues(names: &[&str]) -> Vec<QueueWeight> {
    names
        .iter()
        .map(|q| QueueWeight {
            name: q.to_string(),
            weight: 0,
        })
        .collect()
}

/// A launcher config on `url` fetching `queues` in strict order, `concurrency` jobs at once, with a
/// 2 s shutdown timeout, a beat every 200 ms and the scheduled/retry sets polled about every 100 ms,
/// so a test sees beats and rescheduled jobs quickly. A test needing other values overrides them:
/// `Config { timeout: .., ..config(url, &["default"], 2) }`.
pub fn config(url: &str, queues: &[&str], concurrency: usize) -> Config {
    Config {
        redis_url: Some(url.to_string()),
        concurrency,
        queues: strict_queues(queues),
        timeout: Duration::from_secs(2),
        beat_interval: Duration::from_millis(200),
        poll_interval_average: Duration::from_millis(100),
        ..Config::default()
    }
}

/// Starts a launcher in this process with `config` and `registry`; panics when it cannot start.
pub async fn launch(config: Config, registry: Registry) -> Handle {
    Launcher::new(config, registry).start().await.unwrap()
}

/// Polls `f` every 20 ms from async code until it holds; panics naming `what` once `timeout` passes.
pub async fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + timeout;
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The text of `fixtures/<path>` in this repository (a worktree has no `../shared` beside it).
pub fn fixture(path: &str) -> String {
    let p = format!("{}/fixtures/{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p}: {e}"))
}

/// Every `.json` file under `fixtures/<dir>` (`""`: all of them), sub-directories included, sorted by
/// path: each path with its text.
pub fn fixture_files(dir: &str) -> Vec<(std::path::PathBuf, String)> {
    fn walk(dir: &std::path::Path, out: &mut Vec<(std::path::PathBuf, String)>) {
        let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{dir:?}: {e}"));
        for entry in entries {
            let path = entry.unwrap_or_else(|e| panic!("{dir:?}: {e}")).path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().and_then(|e| e.to_str()) == Some("json") {
                let text =
                    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
                out.push((path, text));
            }
        }
    }
    let mut out = Vec::new();
    walk(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures")
            .join(dir),
        &mut out,
    );
    out.sort();
    out
}

/// `fixtures/<path>` parsed as JSON.
pub fn fixture_json(path: &str) -> Value {
    let text = fixture(path);
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("fixtures/{path}: {e}"))
}

/// Counts a job in from inside its `perform`: `INCR counter`, then raises `max` to the new count if it
/// is higher (the test reads the most jobs that ever ran at once). The job `DECR`s `counter` when it
/// ends.
pub async fn count_in(
    c: &mut oxidekiq::worker::Conn,
    counter: &str,
    max: &str,
) -> redis::RedisResult<()> {
    let n: i64 = redis::AsyncCommands::incr(c, counter, 1).await?;
    redis::Script::new(
        "if tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[1]) then \
         redis.call('SET', KEYS[1], ARGV[1]) end",
    )
    .key(max)
    .arg(n)
    .invoke_async(c)
    .await
}
