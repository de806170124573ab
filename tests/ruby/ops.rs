//! Running in production (issue 16), from outside, against the real binary: `/metrics` scraped during a
//! drain agrees with what the jobs' own log lines say ran; `/ready` follows Redis through a SIGSTOP;
//! `--log-format json` lines parse one by one; `--version`.
use crate::support;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use redis::Commands;
use serde_json::Value;

use support::http_get as get;

/// The samples of a text exposition: `(name, labels, value)`.
fn samples(text: &str) -> Vec<(String, String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            Some((name.to_string(), labels.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// The sum of a metric's samples whose labels contain `label` (`""` for all).
fn total(text: &str, name: &str, label: &str) -> f64 {
    samples(text)
        .iter()
        .filter(|(n, l, _)| n == name && l.contains(label))
        .map(|(_, _, v)| v)
        .sum()
}

/// Every line of the log, each parsed as a JSON object (panics naming a line that is not one).
fn json_lines(log: &str) -> Vec<serde_json::Map<String, Value>> {
    log.lines()
        .filter(|l| !l.is_empty())
        .map(|l| match serde_json::from_str::<Value>(l) {
            Ok(Value::Object(m)) => m,
            other => panic!("not a JSON object line: {l:?} ({other:?})"),
        })
        .collect()
}

#[test]
fn metrics_scraped_during_a_drain_match_what_ran_and_json_logs_parse_line_by_line() {
    let redis = support::RedisServer::start();
    // Ruby enqueues, as a Rails app would: 150 jobs that succeed, 10 that raise (→ retry set), and one
    // of a class with no Rust worker whose name tries to forge a log line.
    let out = support::ruby(
        r#"
        class HardWorker; include Sidekiq::Worker; end
        good = Sidekiq::Client.push_bulk("class" => HardWorker, "args" => Array.new(150) { |i| ["w#{i}", 30] })
        bad = Sidekiq::Client.push_bulk("class" => HardWorker, "args" => Array.new(10) { |i| ["b#{i}", -1] })
        evil = Sidekiq::Client.push("class" => "Evil\nINFO: forged", "args" => [])
        puts JSON.generate("good" => good, "bad" => bad, "evil" => evil)
        "#,
        &redis.url(),
    );
    let ids: Value = serde_json::from_str(out.trimmed()).unwrap();
    let good: HashSet<String> = ids["good"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j.as_str().unwrap().to_string())
        .collect();
    let bad: HashSet<String> = ids["bad"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j.as_str().unwrap().to_string())
        .collect();
    let all = good.len() + bad.len() + 1;

    let port = support::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut ox = support::Oxidekiq::start(
        &redis.url(),
        &[
            "-c",
            "3",
            "--http",
            &addr,
            "--log-format",
            "json",
            "--beat-interval",
            "0.5",
            // No retry comes back during the test: the retry set is compared below.
            "--poll-interval",
            "86400",
        ],
    );

    // Scrape while the queue drains: counts only grow, and at least one scrape sees jobs still queued
    // and some already processed.
    let mut scrapes = Vec::new();
    let mut mid_drain = false;
    let drained = support::wait_until(Duration::from_secs(120), || {
        if let Some((200, _, body)) = get(port, "/metrics") {
            let processed = total(&body, "oxidekiq_jobs_processed_total", "");
            let queued = total(&body, "oxidekiq_queue_size", "queue=\"default\"");
            mid_drain |= processed > 0.0 && queued > 0.0;
            scrapes.push(processed);
        }
        let log = ox.log();
        let finished = log
            .lines()
            .filter(|l| l.contains("\"message\":\"done\"") || l.contains("\"message\":\"fail\""))
            .count();
        finished >= all
    });
    assert!(drained, "the drain did not finish:\n{}", ox.log());
    assert!(
        mid_drain,
        "no scrape saw the drain in progress: {scrapes:?}"
    );
    assert!(
        scrapes.windows(2).all(|w| w[0] <= w[1]),
        "processed counts went down between scrapes: {scrapes:?}"
    );

    // The jobs' own record: one JSON line per run, with Sidekiq's fields.
    let lines = json_lines(&ox.log());
    let mut runs: HashMap<(String, String), u64> = HashMap::new();
    let mut done_jids = Vec::new();
    let mut fail_jids = Vec::new();
    for l in &lines {
        for key in ["time", "pid", "tid", "level", "message"] {
            assert!(l.contains_key(key), "{key} missing in {l:?}");
        }
        let message = l["message"].as_str().unwrap();
        if message != "done" && message != "fail" {
            continue;
        }
        let class = l["class"].as_str().unwrap().to_string();
        let queue = l["queue"].as_str().unwrap().to_string();
        assert!(l["elapsed"].is_number(), "{l:?}");
        assert!(l["pid"].is_number(), "{l:?}");
        *runs.entry((class, queue)).or_default() += 1;
        let jid = l["jid"].as_str().unwrap().to_string();
        if message == "done" {
            done_jids.push(jid);
        } else {
            fail_jids.push(jid);
        }
    }
    assert_eq!(done_jids.iter().cloned().collect::<HashSet<_>>(), good);
    assert_eq!(done_jids.len(), good.len(), "a job ran twice");
    let failed: HashSet<String> = fail_jids.iter().cloned().collect();
    assert!(failed.is_superset(&bad), "{failed:?}");
    assert!(failed.contains(ids["evil"].as_str().unwrap()));
    assert!(
        lines
            .iter()
            .any(|l| l.get("class").and_then(Value::as_str) == Some("Evil\nINFO: forged")),
        "the class name with a newline is one JSON string"
    );

    // After the drain, /metrics says the same.
    let (status, content_type, body) = get(port, "/metrics").unwrap();
    assert_eq!(status, 200);
    assert!(content_type.contains("openmetrics-text"), "{content_type}");
    let hard = runs
        .get(&("HardWorker".to_string(), "default".to_string()))
        .copied()
        .unwrap_or(0) as f64;
    assert_eq!(
        total(
            &body,
            "oxidekiq_jobs_processed_total",
            "class=\"HardWorker\",queue=\"default\""
        ),
        hard,
        "{body}"
    );
    assert_eq!(
        total(&body, "oxidekiq_jobs_processed_total", ""),
        runs.values().sum::<u64>() as f64,
        "{body}"
    );
    assert_eq!(
        total(&body, "oxidekiq_jobs_failed_total", ""),
        fail_jids.len() as f64,
        "{body}"
    );
    assert_eq!(
        total(
            &body,
            "oxidekiq_job_duration_seconds_count",
            "class=\"HardWorker\""
        ),
        hard,
        "{body}"
    );
    let mut c = redis.conn();
    let retries: u64 = c.zcard("retry").unwrap();
    assert_eq!(
        total(&body, "oxidekiq_jobs_retried_total", ""),
        retries as f64,
        "{body}"
    );
    let rounds = total(&body, "oxidekiq_fetch_round_trips_total", "");
    assert!(rounds >= 1.0, "{body}");
    assert_eq!(total(&body, "oxidekiq_fetch_batch_size_count", ""), rounds);
    assert_eq!(
        total(&body, "oxidekiq_fetch_batch_size_sum", ""),
        all as f64,
        "every fetched job counted in the batch sizes: {body}"
    );
    assert_eq!(total(&body, "oxidekiq_concurrency", ""), 3.0);
    // Queue figures are read once per beat interval: the empty queue shows within a beat or so.
    assert!(
        support::wait_until(Duration::from_secs(30), || get(port, "/metrics")
            .is_some_and(|(_, _, b)| total(
                &b,
                "oxidekiq_queue_size",
                "queue=\"default\""
            ) == 0.0)),
        "the drained queue never showed empty"
    );
    assert_eq!(get(port, "/nope").map(|r| r.0), Some(404));

    ox.signal("TERM");
    assert!(ox.wait_exit(Duration::from_secs(30)).is_some());
    for l in json_lines(&ox.log()) {
        assert!(l.contains_key("message"));
    }
}

#[test]
fn ready_is_503_while_redis_is_stopped_and_200_after_and_health_stays_200() {
    let redis = support::RedisServer::start();
    let port = support::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut ox =
        support::Oxidekiq::start(&redis.url(), &["--http", &addr, "--beat-interval", "0.5"]);
    let ready = |want: u16| {
        support::wait_until(Duration::from_secs(60), || {
            get(port, "/ready").is_some_and(|(s, _, _)| s == want)
        })
    };
    assert!(ready(200), "never ready:\n{}", ox.log());

    let stop = std::process::Command::new("kill")
        .args(["-STOP", &redis.pid().to_string()])
        .status()
        .unwrap();
    assert!(stop.success());
    let mut reason = String::new();
    let unready = support::wait_until(Duration::from_secs(60), || match get(port, "/ready") {
        Some((503, _, body)) => {
            reason = body;
            true
        }
        _ => false,
    });
    // Liveness is not readiness: the process answers while Redis does not.
    let health = get(port, "/health");
    let cont = std::process::Command::new("kill")
        .args(["-CONT", &redis.pid().to_string()])
        .status()
        .unwrap();
    assert!(cont.success());
    assert!(unready, "/ready stayed 200 with Redis stopped");
    assert!(
        reason.contains("redis") || reason.contains("heartbeat"),
        "{reason}"
    );
    assert_eq!(health.map(|h| h.0), Some(200));
    assert!(ready(200), "not ready again after SIGCONT:\n{}", ox.log());

    // Quiet (TSTP): alive, but not ready for work.
    ox.signal("TSTP");
    let mut quiet = String::new();
    assert!(support::wait_until(Duration::from_secs(30), || {
        match get(port, "/ready") {
            Some((503, _, body)) => {
                quiet = body;
                true
            }
            _ => false,
        }
    }));
    assert!(quiet.contains("quiet"), "{quiet}");
    ox.signal("TERM");
    assert!(ox.wait_exit(Duration::from_secs(30)).is_some());
}

#[test]
fn version_prints_the_crate_version() {
    let out = std::process::Command::new(support::Oxidekiq::binary())
        .arg("--version")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("oxidekiq {}", env!("CARGO_PKG_VERSION"))
    );
}
