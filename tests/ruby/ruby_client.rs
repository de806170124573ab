//! The Rust client against real Ruby Sidekiq 6.4 (PROTOCOL §2): jobs it pushes are run by a real
//! Ruby `sidekiq` process (plain and ActiveJob), read by `Sidekiq::Queue` / `ScheduledSet` with every
//! option, bulk pushes keep order and jids, and the millisecond format is chosen only when every live
//! Ruby process reports Sidekiq 8.
use crate::support;

use std::time::Duration;

use oxidekiq::client::{Client, NewJob, TimeFormat, TimeMode, detect_time_format};
use redis::Commands;
use serde_json::{Map, Value, json};
use support::{RedisServer, RubySidekiq, now, ruby_api_json as rb_json, wait_until};

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

fn get(c: &mut redis::Connection, key: &str) -> Option<String> {
    c.get(key).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_pushed_by_the_rust_client_are_run_by_a_real_ruby_sidekiq_with_their_options() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let client = Client::connect(&url).await.unwrap();
    let plain = client
        .perform_async("RustPushedJob", ("bob", 5, json!({"k": [1, 2.5, null]})))
        .await
        .unwrap();
    let critical = client
        .push(NewJob::new("RustPushedJob", ("urgent",)).queue("critical"))
        .await
        .unwrap();
    let past = client
        .perform_at(now() - 60.0, "RustPushedJob", ("past",))
        .await
        .unwrap();
    let failing = client
        .push(
            NewJob::new("RustPushedFailingJob", ("x",))
                .retry(3)
                .option("retry_queue", json!("low"))
                .option("backtrace", json!(2)),
        )
        .await
        .unwrap();

    let sidekiq = RubySidekiq::start(
        &url,
        r#"
        class RustPushedJob
          include Sidekiq::Worker
          def perform(*args)
            Sidekiq.redis { |c| c.set("ran:#{jid}", JSON.generate(args)) }
          end
        end
        class RustPushedFailingJob
          include Sidekiq::Worker
          def perform(arg)
            raise ArgumentError, "ruby says no to #{arg}"
          end
        end
        "#,
        &["critical", "default"],
        2,
    );
    let ran = wait_until(Duration::from_secs(30), || {
        [&plain, &critical, &past]
            .iter()
            .all(|j| get(&mut c, &format!("ran:{j}")).is_some())
            && c.zcard::<_, usize>("retry").unwrap() == 1
    });
    assert!(ran, "the Ruby jobs ran: {}", sidekiq.log());
    let args: Value = serde_json::from_str(&get(&mut c, &format!("ran:{plain}")).unwrap()).unwrap();
    assert_eq!(args, json!(["bob", 5, {"k": [1, 2.5, null]}]));
    let args: Value =
        serde_json::from_str(&get(&mut c, &format!("ran:{critical}")).unwrap()).unwrap();
    assert_eq!(args, json!(["urgent"]));

    // Ruby's retry machinery read our options: retry count, retry queue, backtrace lines.
    let e = rb_json(
        r#"e = Sidekiq::RetrySet.new.first; puts JSON.generate({"jid" => e.jid, "queue" => e.queue, "retry" => e["retry"], "count" => e["retry_count"], "bt" => e.error_backtrace.size, "msg" => e["error_message"]})"#,
        &url,
    );
    assert_eq!(e["jid"], failing.as_str());
    assert_eq!(e["queue"], "low");
    assert_eq!(e["retry"], 3);
    assert_eq!(e["count"], 0);
    assert_eq!(e["bt"], 2);
    assert_eq!(e["msg"], "ruby says no to x");

    // A real Sidekiq 6.4 reports no `info.version`: the automatic mode stays with float seconds.
    let identity = sidekiq.wait_for_identity(&mut c, Duration::from_secs(10));
    assert!(identity.is_some());
    let mut conn = redis.async_conn().await;
    assert_eq!(
        detect_time_format(&mut conn).await.unwrap(),
        TimeFormat::Seconds
    );
    drop(sidekiq);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn perform_later_enqueues_an_activejob_job_that_ruby_activejob_performs() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let client = Client::connect(&url).await.unwrap();
    let jid = client
        .perform_later(
            "GreetJob",
            "mailers",
            vec![json!("bob"), json!({"lang": "fr", "n": [1, 2]})],
        )
        .await
        .unwrap();
    // What the Web UI shows for it, before it runs.
    let shown = rb_json(
        r#"j = Sidekiq::Queue.new("mailers").first; puts JSON.generate({"class" => j.display_class, "args" => j.display_args, "jid" => j.jid, "latency" => Sidekiq::Queue.new("mailers").latency})"#,
        &url,
    );
    assert_eq!(shown["class"], "GreetJob");
    assert_eq!(shown["args"], json!(["bob", {"lang": "fr", "n": [1, 2]}]));
    assert_eq!(shown["jid"], jid.as_str());
    assert!((0.0..30.0).contains(&f(&shown["latency"])));

    let sidekiq = RubySidekiq::start(
        &url,
        r#"
        require "active_job"
        require "active_support/core_ext/time"
        require "active_job/queue_adapters/sidekiq_adapter"
        ActiveJob::Base.queue_adapter = :sidekiq
        ActiveJob::Base.logger = Logger.new(nil)
        class GreetJob < ActiveJob::Base
          def perform(name, opts)
            seen = {"name" => name, "opts" => opts, "job_id" => job_id, "provider_job_id" => provider_job_id,
                    "queue" => queue_name, "executions" => executions}
            Sidekiq.redis { |c| c.set("greeted", JSON.generate(seen)) }
          end
        end
        "#,
        &["mailers"],
        1,
    );
    assert!(
        wait_until(Duration::from_secs(30), || get(&mut c, "greeted").is_some()),
        "GreetJob ran: {}",
        sidekiq.log()
    );
    let seen: Value = serde_json::from_str(&get(&mut c, "greeted").unwrap()).unwrap();
    assert_eq!(seen["name"], "bob");
    assert_eq!(seen["opts"], json!({"lang": "fr", "n": [1, 2]}));
    assert_eq!(seen["provider_job_id"], jid.as_str());
    assert_eq!(seen["queue"], "mailers");
    assert_eq!(seen["executions"], 1);
    assert_eq!(seen["job_id"].as_str().unwrap().len(), 36);
    let retries: usize = c.zcard("retry").unwrap();
    assert_eq!(retries, 0, "{}", sidekiq.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn perform_in_and_perform_at_land_in_rubys_scheduled_set_at_the_right_time() {
    let redis = RedisServer::start();
    let url = redis.url();
    let client = Client::connect(&url).await.unwrap();
    let t0 = now();
    let in_60 = client
        .perform_in(60.0, "LaterJob", ("in", 60))
        .await
        .unwrap();
    let t1 = now();
    let exact = 1_900_000_000.123_456;
    let at = client.perform_at(exact, "LaterJob", ("at",)).await.unwrap();
    let absolute = client
        .push(NewJob::new("LaterJob", ("absolute",)).run_in(exact + 5.0))
        .await
        .unwrap();
    let now_job = client.perform_in(-5.0, "LaterJob", ("now",)).await.unwrap();
    let bulk = client
        .push_bulk(
            NewJob::new("LaterJob", ()).run_in(120.0),
            (0..10).map(|i| (i,)),
        )
        .await
        .unwrap();
    let seen = rb_json(
        r#"
s = Sidekiq::ScheduledSet.new
jobs = s.map { |e| {"jid" => e.jid, "at" => e.at.to_f, "score" => e.score, "keys" => e.item.keys, "args" => e.args, "created_at" => e.created_at.to_f, "queue" => e.queue} }
puts JSON.generate({"size" => s.size, "jobs" => jobs, "queue" => Sidekiq::Queue.new.map(&:jid)})
"#,
        &url,
    );
    assert_eq!(seen["size"], 13);
    assert_eq!(
        seen["queue"],
        json!([now_job]),
        "a past time is pushed at once"
    );
    let jobs = seen["jobs"].as_array().unwrap();
    let by = |jid: &str| jobs.iter().find(|j| j["jid"] == jid).unwrap().clone();
    let j = by(&in_60);
    assert!(f(&j["at"]) >= t0 + 60.0 && f(&j["at"]) <= t1 + 60.0);
    assert_eq!(j["args"], json!(["in", 60]));
    assert_eq!(j["queue"], "default");
    assert_eq!(
        j["keys"],
        json!(["retry", "queue", "args", "class", "jid", "created_at"]),
        "no enqueued_at and no at in a scheduled payload"
    );
    assert!(f(&j["created_at"]) >= t0 && f(&j["created_at"]) <= t1);
    assert_eq!(f(&by(&at)["score"]), exact, "the score is the exact time");
    assert_eq!(
        f(&by(&absolute)["score"]),
        exact + 5.0,
        "≥ 1e9 is a time, not an interval"
    );
    let bulk_at: Vec<f64> = bulk.iter().map(|j| f(&by(j)["at"])).collect();
    assert!(bulk_at.iter().all(|a| *a == bulk_at[0] && *a > t0 + 119.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_bulk_of_2500_reaches_rubys_queue_in_order_with_distinct_jids() {
    let redis = RedisServer::start();
    let url = redis.url();
    let client = Client::connect(&url).await.unwrap();
    let jids = client
        .push_bulk(
            NewJob::new("BulkJob", ()).queue("bulk"),
            (0..2500).map(|i| (i,)),
        )
        .await
        .unwrap();
    assert_eq!(jids.len(), 2500);
    let seen = rb_json(
        r#"
q = Sidekiq::Queue.new("bulk")
all = q.to_a
puts JSON.generate({"size" => q.size, "jids" => all.map(&:jid), "args" => all.map { |j| j.args[0] }, "queues" => Sidekiq::Queue.all.map(&:name)})
"#,
        &url,
    );
    assert_eq!(seen["size"], 2500);
    assert_eq!(seen["queues"], json!(["bulk"]));
    let mut ruby_jids: Vec<String> = serde_json::from_value(seen["jids"].clone()).unwrap();
    // Queue#each reads from the head; the first job pushed sits at the tail and is served first.
    ruby_jids.reverse();
    assert_eq!(ruby_jids, jids);
    let args: Vec<i64> = serde_json::from_value(seen["args"].clone()).unwrap();
    assert_eq!(args, (0..2500).rev().collect::<Vec<_>>());
    let mut unique = jids.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), 2500);
    assert!(
        jids.iter()
            .all(|j| j.len() == 24 && j.bytes().all(|b| b.is_ascii_hexdigit()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_option_is_visible_to_ruby_in_the_queued_job() {
    let redis = RedisServer::start();
    let url = redis.url();
    let client = Client::connect(&url).await.unwrap();
    let t0 = now();
    let jid = client
        .push(
            NewJob::new("Billing::ChargeJob", (42, 19.99, "USD"))
                .queue("q")
                .retry(3)
                .tags(["billing", "eu"])
                .option("backtrace", json!(5))
                .option("retry_queue", json!("low"))
                .option("dead", json!(false))
                .option("custom", json!({"tenant": 7}))
                .jid("0123456789abcdef01234567"),
        )
        .await
        .unwrap();
    let no_retry = client
        .push(NewJob::new("NoRetryJob", ()).queue("q").no_retry())
        .await
        .unwrap();
    let seen = rb_json(
        r#"
q = Sidekiq::Queue.new("q")
j = q.to_a.last
n = q.to_a.first
puts JSON.generate({"item" => j.item, "display_class" => j.display_class, "tags" => j.tags, "enqueued_at" => j.enqueued_at.to_f,
  "created_at" => j.created_at.to_f, "queues" => Sidekiq::Queue.all.map(&:name), "no_retry" => n.item, "size" => q.size})
"#,
        &url,
    );
    assert_eq!(jid, "0123456789abcdef01234567");
    let item = &seen["item"];
    assert_eq!(item["jid"], jid.as_str());
    assert_eq!(item["class"], "Billing::ChargeJob");
    assert_eq!(item["args"], json!([42, 19.99, "USD"]));
    assert_eq!(item["queue"], "q");
    assert_eq!(item["retry"], 3);
    assert_eq!(item["tags"], json!(["billing", "eu"]));
    assert_eq!(item["backtrace"], 5);
    assert_eq!(item["retry_queue"], "low");
    assert_eq!(item["dead"], false);
    assert_eq!(item["custom"], json!({"tenant": 7}));
    assert!(item["created_at"].is_f64() && item["enqueued_at"].is_f64());
    assert_eq!(seen["display_class"], "Billing::ChargeJob");
    assert_eq!(seen["tags"], json!(["billing", "eu"]));
    for k in ["enqueued_at", "created_at"] {
        assert!(f(&seen[k]) >= t0 && f(&seen[k]) <= now(), "{k}");
    }
    assert_eq!(seen["queues"], json!(["q"]));
    assert_eq!(seen["size"], 2);
    assert_eq!(seen["no_retry"]["jid"], no_retry.as_str());
    assert_eq!(seen["no_retry"]["retry"], false);

    // What Ruby's `validate` rejects is rejected before anything reaches Redis.
    assert!(client.push(NewJob::new("X", ()).queue("")).await.is_err());
    assert!(
        client
            .push(NewJob::new("X", ()).option("tags", json!("not an array")))
            .await
            .is_err()
    );
    assert!(client.push(NewJob::new("", ())).await.is_err());
    let total = rb_json(
        r#"puts JSON.generate(Sidekiq::Queue.all.map(&:size).sum)"#,
        &url,
    );
    assert_eq!(total, 2);
}

fn fixture(path: &str) -> Map<String, Value> {
    serde_json::from_value(support::fixture_json(&format!("shared/{path}"))).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn millisecond_mode_writes_sidekiq_8_payloads_with_scores_still_in_seconds() {
    // The same job as Sidekiq 8.1.7 wrote it, at the same instant: identical JSON.
    let s8 = fixture("sidekiq-8.1.7/enqueued_plain.json");
    let created = s8["created_at"].as_i64().unwrap() as f64 / 1000.0;
    let ours = NewJob::new("HardWorker", ("bob", 5)).payload(
        s8["jid"].as_str().unwrap(),
        created,
        TimeFormat::Millis,
    );
    let ours: Map<String, Value> = serde_json::from_str(&ours).unwrap();
    assert_eq!(ours, s8);
    let s8 = fixture("sidekiq-8.1.7/scheduled.json");
    let created = s8["created_at"].as_i64().unwrap() as f64 / 1000.0;
    let ours = NewJob::new("HardWorker", ("later",))
        .run_at(created + 3600.0)
        .payload(s8["jid"].as_str().unwrap(), created, TimeFormat::Millis);
    let ours: Map<String, Value> = serde_json::from_str(&ours).unwrap();
    assert_eq!(ours, s8);

    // Pushed for real.
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let client = Client::connect(&redis.url())
        .await
        .unwrap()
        .with_time_mode(TimeMode::Millis);
    let t0 = now();
    client
        .perform_async("HardWorker", ("bob", 5))
        .await
        .unwrap();
    client
        .perform_in(60.0, "HardWorker", ("later",))
        .await
        .unwrap();
    let t1 = now();
    let raw: String = c.lindex("queue:default", 0).unwrap();
    let job: Map<String, Value> = serde_json::from_str(&raw).unwrap();
    for k in ["created_at", "enqueued_at"] {
        let ms = job[k]
            .as_i64()
            .unwrap_or_else(|| panic!("{k} is an integer: {raw}"));
        assert!(
            ms >= (t0 * 1000.0) as i64 - 1 && ms <= (t1 * 1000.0) as i64 + 1,
            "{k}"
        );
    }
    let scheduled: Vec<(String, f64)> = c.zrange_withscores("schedule", 0, -1).unwrap();
    let (member, score) = &scheduled[0];
    let job: Map<String, Value> = serde_json::from_str(member).unwrap();
    assert!(job["created_at"].is_i64() && !job.contains_key("enqueued_at"));
    assert!(
        *score >= t0 + 60.0 && *score <= t1 + 60.0,
        "score in seconds: {score}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn milliseconds_are_picked_only_when_every_live_ruby_process_reports_sidekiq_8() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let mut conn = redis.async_conn().await;
    let register = |c: &mut redis::Connection, id: &str, version: Option<&str>| {
        let mut info =
            json!({"hostname": "h", "identity": id, "concurrency": 5, "queues": ["default"]});
        if let Some(v) = version {
            info["version"] = json!(v);
        }
        let _: () = c.sadd("processes", id).unwrap();
        let _: () = c.hset(id, "info", info.to_string()).unwrap();
    };
    let unregister = |c: &mut redis::Connection, id: &str| {
        let _: () = c.srem("processes", id).unwrap();
        let _: () = c.del(id).unwrap();
    };
    let mut check = async |expected: TimeFormat, why: &str| {
        assert_eq!(
            detect_time_format(&mut conn).await.unwrap(),
            expected,
            "{why}"
        );
    };
    check(TimeFormat::Seconds, "no process at all").await;
    register(&mut c, "h:1:s8", Some("8.0.1"));
    check(TimeFormat::Millis, "only a Sidekiq 8").await;
    register(&mut c, "h:2:s7", Some("7.3.9"));
    check(TimeFormat::Seconds, "a Sidekiq 7 is live").await;
    unregister(&mut c, "h:2:s7");
    register(&mut c, "h:3:ox", Some("oxidekiq/0.1.0"));
    check(TimeFormat::Millis, "oxidekiq reads both forms").await;
    register(&mut c, "h:4:s64", None);
    check(TimeFormat::Seconds, "Sidekiq 6.4 reports no version").await;
    unregister(&mut c, "h:4:s64");
    // In `processes` but its heartbeat hash expired: not live.
    let _: () = c.sadd("processes", "h:5:gone").unwrap();
    check(TimeFormat::Millis, "a dead member does not count").await;
    register(&mut c, "h:6:s10", Some("10.2.0"));
    check(TimeFormat::Millis, "a later major").await;
    unregister(&mut c, "h:1:s8");
    unregister(&mut c, "h:6:s10");
    check(TimeFormat::Seconds, "only oxidekiq: no Ruby to please").await;

    // What Ruby's ProcessSet reads from the fake hashes is the version the detection used.
    register(&mut c, "h:7:s8", Some("8.1.7"));
    let versions = rb_json(
        r#"puts JSON.generate(Sidekiq::ProcessSet.new(false).map { |p| p["version"] }.compact.sort)"#,
        &redis.url(),
    );
    assert_eq!(versions, json!(["8.1.7", "oxidekiq/0.1.0"]));
    // The automatic mode follows it on the next push.
    let client = Client::connect(&redis.url())
        .await
        .unwrap()
        .with_time_mode(TimeMode::Auto);
    client.perform_async("HardWorker", ()).await.unwrap();
    let raw: String = c.lindex("queue:default", 0).unwrap();
    let job: Value = serde_json::from_str(&raw).unwrap();
    assert!(job["created_at"].is_i64(), "{raw}");
    register(&mut c, "h:8:s7", Some("7.3.9"));
    client.perform_async("HardWorker", ()).await.unwrap();
    let raw: String = c.lindex("queue:default", 0).unwrap();
    let job: Value = serde_json::from_str(&raw).unwrap();
    assert!(job["created_at"].is_f64(), "{raw}");
}
