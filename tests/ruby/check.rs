//! `oxidekiq check` and `oxidekiq report`, run as the binary against payloads real Ruby Sidekiq 6.4 and
//! ActiveJob 6.1 enqueue, planted misfits, and the Sidekiq 7.3.9 / 8.1.7 metrics recordings
//! (`fixtures/sidekiq-7-8/`).

use crate::support;

use std::process::Command;

use serde_json::Value;
use support::{Oxidekiq, RedisServer, fixture_json, ruby, ruby_activejob};

/// Runs `oxidekiq args...` to completion; (exit code, stdout, stderr).
fn oxidekiq(url: &str, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(Oxidekiq::binary())
        .args(args)
        .env("REDIS_URL", url)
        .output()
        .expect("the oxidekiq binary (cargo build --workspace)");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The numeric columns of a class's row in a table printed by `check` or `report`.
fn row<'a>(out: &'a str, class: &str) -> Option<Vec<&'a str>> {
    out.lines()
        .find(|l| l.split_whitespace().next() == Some(class))
        .map(|l| l.split_whitespace().skip(1).collect())
}

const PUSH_GOOD: &str = r#"
5.times { |i| Sidekiq::Client.push("class" => "HardWorker", "args" => ["user-#{i}", i]) }
"#;

#[test]
fn check_finds_a_planted_payload_whose_args_do_not_fit_and_flags_ruby_side_contracts() {
    let redis = RedisServer::start();
    let url = redis.url();
    ruby(PUSH_GOOD, &url);
    // A count that Rails sent as a string, planted in the retry set; a sidekiq-unique-jobs lock and a
    // Pro batch id on otherwise fitting jobs.
    ruby(
        r#"
        bad = { "class" => "HardWorker", "args" => ["user-x", "SECRET-VALUE-42"], "queue" => "default",
                "jid" => "aaaaaaaaaaaaaaaaaaaaaaaa", "retry" => true, "retry_count" => 0,
                "error_class" => "X", "error_message" => "y", "failed_at" => Time.now.to_f }
        Sidekiq.redis { |c| c.zadd("retry", Time.now.to_f + 3600, JSON.generate(bad)) }
        Sidekiq::Client.push("class" => "HardWorker", "args" => ["u", 1], "lock_digest" => "uniquejobs:0f0f")
        Sidekiq::Client.push("class" => "HardWorker", "args" => ["u", 2], "bid" => "b-123", "queue" => "low")
        "#,
        &url,
    );
    let (code, out, err) = oxidekiq(&url, &["check"]);
    assert_eq!(code, 1, "a misfit must fail the check:\n{out}\n{err}");
    let cols = row(&out, "HardWorker").unwrap_or_else(|| panic!("no HardWorker row:\n{out}"));
    // 5 good + 1 planted + 2 flagged, all read without taking them.
    assert_eq!(cols[..3], ["8", "7", "1"], "{out}");
    assert!(
        out.contains("args[1]: JSON string"),
        "path and JSON type of the misfit:\n{out}"
    );
    assert!(out.contains("first in retry"), "{out}");
    assert!(
        !out.contains("SECRET-VALUE-42"),
        "values never shown:\n{out}"
    );
    assert!(!out.contains("user-x"), "values never shown:\n{out}");
    assert!(
        out.contains("honoured: 1 job(s) of HardWorker carry `lock_digest`"),
        "{out}"
    );
    assert!(
        out.contains("flagged: 1 job(s) of HardWorker carry `bid`"),
        "{out}"
    );
    assert!(out.contains("FAILED"), "{out}");
    // Nothing was taken.
    let mut c = redis.conn();
    let default: usize = redis::cmd("LLEN")
        .arg("queue:default")
        .query(&mut c)
        .unwrap();
    let retry: usize = redis::cmd("ZCARD").arg("retry").query(&mut c).unwrap();
    assert_eq!((default, retry), (6, 1));
}

#[test]
fn check_passes_when_what_ruby_and_activejob_enqueue_fits() {
    let redis = RedisServer::start();
    let url = redis.url();
    ruby(PUSH_GOOD, &url);
    ruby_activejob(
        r#"
        class WelcomeEmailJob < ActiveJob::Base
          queue_as :mailers
          def perform(user_id, options = {}); end
        end
        WelcomeEmailJob.perform_later(42, { "locale" => "de" })
        WelcomeEmailJob.perform_later(7)
        WelcomeEmailJob.set(wait: 3600).perform_later(8, { locale: "fr" })
        "#,
        &url,
    );
    let (code, out, err) = oxidekiq(&url, &["check"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(
        row(&out, "HardWorker").unwrap()[..3],
        ["5", "5", "0"],
        "{out}"
    );
    assert_eq!(
        row(&out, "WelcomeEmailJob").unwrap()[..3],
        ["3", "3", "0"],
        "ActiveJob payloads from the queue and the schedule:\n{out}"
    );
    // An ActiveJob argument of the wrong type is found inside `arguments`.
    ruby_activejob(
        r#"
        class WelcomeEmailJob < ActiveJob::Base
          def perform(*); end
        end
        WelcomeEmailJob.perform_later("not-an-id")
        "#,
        &url,
    );
    let (code, out, _) = oxidekiq(&url, &["check", "--sample", "50"]);
    assert_eq!(code, 1, "{out}");
    assert_eq!(
        row(&out, "WelcomeEmailJob").unwrap()[..3],
        ["4", "3", "1"],
        "{out}"
    );
    assert!(!out.contains("not-an-id"), "{out}");
}

/// Loads a metrics recording's keys as the real Sidekiq left them: hashes, and histograms written
/// with the same `BITFIELD` calls Sidekiq makes.
fn load_recording(c: &mut redis::Connection, rec: &Value) {
    for (key, v) in rec["keys"].as_object().unwrap() {
        if let Some(fields) = v.get("fields").and_then(Value::as_object) {
            for (f, n) in fields {
                let _: () = redis::cmd("HSET")
                    .arg(key)
                    .arg(f)
                    .arg(n.as_str().unwrap())
                    .query(c)
                    .unwrap();
            }
        }
        if let Some(counters) = v.get("u16").and_then(Value::as_array) {
            let mut cmd = redis::cmd("BITFIELD");
            cmd.arg(key).arg("OVERFLOW").arg("SAT");
            for (i, n) in counters.iter().enumerate() {
                cmd.arg("INCRBY")
                    .arg("u16")
                    .arg(format!("#{i}"))
                    .arg(n.as_u64().unwrap());
            }
            let _: Vec<i64> = cmd.query(c).unwrap();
        }
    }
}

#[test]
fn report_lists_classes_by_time_from_the_7x_and_8x_metrics_recordings() {
    // Sidekiq's histogram bounds (metrics/shared.rb), to read the recorded counters independently.
    const BOUNDS: [u64; 25] = [
        20, 30, 45, 65, 100, 150, 225, 335, 500, 750, 1100, 1700, 2500, 3800, 5750, 8500, 13000,
        20000, 30000, 45000, 65000, 100000, 150000, 225000, 335000,
    ];
    for version in ["7.3.9", "8.1.7"] {
        let redis = RedisServer::start();
        let url = redis.url();
        let rec = fixture_json(&format!(
            "sidekiq-7-8/sidekiq-{version}-metrics/metrics.json"
        ));
        load_recording(&mut redis.conn(), &rec);
        let at = rec["flushed_at"].as_str().unwrap();
        let (code, out, err) = oxidekiq(&url, &["report", "--at", at]);
        assert_eq!(code, 0, "{out}\n{err}");
        let major = &version[..1];
        assert!(
            out.contains(&format!("Sidekiq {major}.x execution metrics")),
            "{version}:\n{out}"
        );
        // What that version's own Metrics::Query read back, ordered by time.
        let top = rec["query_top_jobs"].as_object().unwrap();
        let mut expected: Vec<(&String, u64, u64)> = top
            .iter()
            .map(|(k, v)| (k, v["ms"].as_u64().unwrap_or(0), v["p"].as_u64().unwrap()))
            .collect();
        expected.sort_by(|a, b| b.1.cmp(&a.1).then(b.2.cmp(&a.2)).then(a.0.cmp(b.0)));
        let listed: Vec<&str> = out
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|w| top.contains_key(*w))
            .collect();
        let expected_names: Vec<&str> = expected.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(listed, expected_names, "{version}:\n{out}");
        for (class, ms, p) in &expected {
            let cols = row(&out, class).unwrap();
            assert_eq!(cols[0], p.to_string(), "{class} jobs ({version}):\n{out}");
            assert_eq!(
                cols[1],
                format!("{:.3}", *ms as f64 / 1000.0),
                "{class} seconds ({version}):\n{out}"
            );
            assert_eq!(cols[4], "no", "no Rust worker for {class}:\n{out}");
        }
        // SlowJob's p50: the bucket its recorded histogram counts fall in.
        let hist_key = rec["keys"]
            .as_object()
            .unwrap()
            .keys()
            .find(|k| k.contains("SlowJob-"))
            .unwrap()
            .clone();
        let counters: Vec<u64> = rec["keys"][&hist_key]["u16"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_u64().unwrap())
            .collect();
        let bucket = counters.iter().position(|n| *n > 0).unwrap();
        assert_eq!(
            row(&out, "SlowJob").unwrap()[2],
            format!("<{}ms", BOUNDS[bucket]),
            "{out}"
        );
    }
}

#[test]
fn report_on_sidekiq_6_counts_waiting_jobs_and_shows_rust_and_route() {
    let redis = RedisServer::start();
    let url = redis.url();
    ruby(
        r#"
        3.times { Sidekiq::Client.push("class" => "HardWorker", "args" => ["a", 1]) }
        Sidekiq::Client.push("class" => "Legacy::Mailer", "args" => [], "queue" => "mail")
        "#,
        &url,
    );
    let (code, out, _) = oxidekiq(&url, &["route", "HardWorker", "25"]);
    assert_eq!(code, 0, "{out}");
    let (code, out, err) = oxidekiq(&url, &["report"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("Sidekiq 6.x records none"), "{out}");
    let hard = row(&out, "HardWorker").unwrap();
    assert_eq!(
        (hard[0], hard[4], hard[5]),
        ("3", "yes", "25%"),
        "registered, not live, routed 25%:\n{out}"
    );
    let legacy = row(&out, "Legacy::Mailer").unwrap();
    assert_eq!((legacy[0], legacy[4], legacy[5]), ("1", "no", "-"), "{out}");
}

/// Issue 43 item 8: one key of the wrong type (`SET retry x`, a queue that is a string) made `check`
/// and `report` abort with a script error naming no key, and check nothing else. Each now names the
/// key and its type and reads the others.
#[test]
fn check_and_report_name_a_wrong_typed_key_and_read_the_others() {
    use redis::Commands;
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let good = r#"{"class":"HardWorker","args":["user-1",1],"queue":"default","jid":"bbbbbbbbbbbbbbbbbbbbbbbb","retry":true,"created_at":1700000000.0,"enqueued_at":1700000000.0}"#;
    let _: () = c.lpush("queue:default", good).unwrap();
    let _: () = c.sadd("queues", &["default", "low"]).unwrap();
    let _: () = c.set("queue:low", "x").unwrap();
    let _: () = c.set("retry", "x").unwrap();
    let (code, out, err) = oxidekiq(&url, &["check"]);
    assert_eq!(code, 1, "a damaged key fails the check:\n{out}\n{err}");
    assert!(out.contains("queue:low is a string"), "{out}\n{err}");
    assert!(out.contains("retry is a string"), "{out}\n{err}");
    let cols =
        row(&out, "HardWorker").unwrap_or_else(|| panic!("no HardWorker row:\n{out}\n{err}"));
    assert_eq!(
        cols[..3],
        ["1", "1", "0"],
        "the good queue was read:\n{out}"
    );
    let (code, out, err) = oxidekiq(&url, &["report"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("queue:low is a string"), "{out}\n{err}");
    let hard =
        row(&out, "HardWorker").unwrap_or_else(|| panic!("no HardWorker row:\n{out}\n{err}"));
    assert_eq!(hard[0], "1", "{out}");
}
