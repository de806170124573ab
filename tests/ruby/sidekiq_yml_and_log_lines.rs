//! The `oxidekiq` binary as a user runs it: Sidekiq-shaped log lines, and `-C config/sidekiq.yml`
//! (with an ERB ENV lookup) deciding queues, weights, concurrency and tag, as the Busy page shows them.
use crate::support;

use std::time::Duration;

use redis::Commands;
use serde_json::Value;

fn is_sidekiq_done_line(line: &str) -> bool {
    // 2026-11-21T20:46:50.801Z pid=9429 tid=79y class=HardWorker jid=<24 hex> queue=default elapsed=0.021 INFO: done
    let parts: Vec<&str> = line.split(' ').collect();
    if parts.len() != 9 {
        return false;
    }
    let time = parts[0];
    let time_ok = time.len() == 24
        && time.ends_with('Z')
        && time.as_bytes()[10] == b'T'
        && time.as_bytes()[19] == b'.'
        && time[..4].chars().all(|c| c.is_ascii_digit());
    let num = |p: &str, k: &str| {
        p.strip_prefix(k)
            .is_some_and(|v| !v.is_empty() && v.chars().all(|c| c.is_ascii_alphanumeric()))
    };
    let jid_ok = parts[4]
        .strip_prefix("jid=")
        .is_some_and(|j| j.len() == 24 && j.chars().all(|c| c.is_ascii_hexdigit()));
    let elapsed_ok = parts[6].strip_prefix("elapsed=").is_some_and(|e| {
        e.len() >= 5 && e.parse::<f64>().is_ok() && e.split('.').nth(1).map(str::len) == Some(3)
    });
    time_ok
        && num(parts[1], "pid=")
        && num(parts[2], "tid=")
        && parts[3] == "class=HardWorker"
        && jid_ok
        && parts[5] == "queue=critical"
        && elapsed_ok
        && parts[7] == "INFO:"
        && parts[8] == "done"
}

#[test]
fn the_binary_reads_sidekiq_yml_with_erb_and_logs_in_sidekiqs_line_shape() {
    let redis = support::RedisServer::start();
    let dir = support::temp_dir("binary-config");
    std::fs::create_dir_all(dir.join("config")).unwrap();
    std::fs::write(
        dir.join("config/sidekiq.yml"),
        "---\n:concurrency: <%= ENV.fetch(\"OXQ_TEST_THREADS\", 3) %>\n:tag: billing\n:queues:\n  - [critical, 3]\n  - default\n",
    )
    .unwrap();
    support::ruby(
        r#"
        class HardWorker; include Sidekiq::Worker; end
        HardWorker.set(queue: "critical").perform_async("bob", 5)
        "#,
        &redis.url(),
    );
    let ox = support::Oxidekiq::start_in(
        dir,
        &redis.url(),
        &["--beat-interval", "0.3"],
        &[("OXQ_TEST_THREADS", "7")],
    );
    assert!(
        ox.wait_for_log("INFO: done", Duration::from_secs(10)),
        "{}",
        ox.log()
    );
    let log = ox.log();
    let done: Vec<&str> = log.lines().filter(|l| l.ends_with("INFO: done")).collect();
    assert_eq!(done.len(), 1, "{log}");
    assert!(
        is_sidekiq_done_line(done[0]),
        "not Sidekiq's shape: {}",
        done[0]
    );
    assert!(
        !log.contains("bob"),
        "arguments are not logged at the default level"
    );

    let mut c = redis.conn();
    let ids: Vec<String> = c.smembers("processes").unwrap();
    assert_eq!(ids.len(), 1);
    let info: String = c.hget(&ids[0], "info").unwrap();
    let info: Value = serde_json::from_str(&info).unwrap();
    assert_eq!(
        info["concurrency"], 7,
        "ENV.fetch in the ERB wins over its default"
    );
    assert_eq!(info["tag"], "billing");
    assert_eq!(info["queues"], serde_json::json!(["critical", "default"]));
    assert_eq!(info["weights"][0]["critical"], 3);
    // As given, as Sidekiq 7+ writes it: `default` has no weight (0); the fetch counts it as 1.
    assert_eq!(info["weights"][0]["default"], 0);
}

/// `--log-level warn` is Ruby's `Sidekiq.logger.level = Logger::WARN`: the jobs run, no start or done
/// line is written, and a warning still is (here the one naming a `sidekiq.yml` key oxidekiq does not
/// read).
#[test]
fn log_level_warn_writes_no_per_job_lines_but_still_warns() {
    let redis = support::RedisServer::start();
    let dir = support::temp_dir("binary-log-level");
    std::fs::create_dir_all(dir.join("config")).unwrap();
    std::fs::write(
        dir.join("config/sidekiq.yml"),
        "---\n:concurrency: 2\n:not_a_sidekiq_key: 1\n:queues:\n  - default\n",
    )
    .unwrap();
    support::ruby(
        r#"
        class HardWorker; include Sidekiq::Worker; end
        3.times { |i| HardWorker.perform_async("bob", i) }
        "#,
        &redis.url(),
    );
    let ox = support::Oxidekiq::start_in(dir, &redis.url(), &["--log-level", "warn"], &[]);
    let mut c = redis.conn();
    assert!(
        support::wait_until(Duration::from_secs(20), || {
            c.get::<_, Option<u64>>("stat:processed")
                .ok()
                .flatten()
                .unwrap_or(0)
                >= 3
        }),
        "the three jobs run: {}",
        ox.log()
    );
    assert!(
        ox.wait_for_log("not_a_sidekiq_key", Duration::from_secs(5)),
        "a warning is still written: {}",
        ox.log()
    );
    let log = ox.log();
    assert!(
        !log.contains("INFO: start") && !log.contains("INFO: done"),
        "no per-job line at warn: {log}"
    );
}
