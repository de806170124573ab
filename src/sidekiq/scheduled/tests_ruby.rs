//! The scheduled-set poller against real Ruby Sidekiq 6.4 (PROTOCOL §5): jobs Ruby schedules run in
//! Rust on time; a round moves everything due, retries first, in batches, and what it pushes is what
//! `Sidekiq::Queue` reads; members that are not jobs reach the dead set; racing pollers never push a
//! job twice; the sleep between rounds follows Ruby's formula. Times are injected into
//! `scheduled::enqueue_due` wherever the test is not about real waiting.
use crate::test_support as support;

use std::time::Duration;

use oxidekiq::error::JobResult;
use oxidekiq::launcher::Handle;
use oxidekiq::scheduled::{enqueue_due, live_process_count, poll_interval};
use oxidekiq::time::{TimeFormat, now};
use oxidekiq::{JobContext, Registry, Worker};
use redis::Commands;
use serde_json::{Value, json};
use support::{RedisServer, config, launch, ruby_api as rb, ruby_api_json as rb_json, wait_for};

/// Records when it started and what it got, in the `started` list.
#[derive(Debug)]
struct HardWorker;
impl Worker for HardWorker {
    const CLASS: &'static str = "HardWorker";
    type Args = Vec<Value>;
    async fn perform(&self, ctx: &JobContext, args: Self::Args) -> JobResult {
        let line = json!({"at": now(), "jid": ctx.jid(), "args": args}).to_string();
        let mut c = ctx.redis();
        let _: () = redis::AsyncCommands::rpush(&mut c, "started", line).await?;
        Ok(())
    }
}

async fn start(url: &str, queues: &[&str]) -> Handle {
    let mut r = Registry::new();
    r.register(HardWorker);
    launch(config(url, queues, 2), r).await
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hard_worker_perform_in_2_from_ruby_runs_in_rust_after_about_2_seconds() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let handle = start(&url, &["default"]).await;
    let sent = rb_json(
        r#"
class HardWorker
  include Sidekiq::Worker
  def perform(name, count); end
end
t = Time.now.to_f
jid = HardWorker.perform_in(2, "x", 1)
at = Sidekiq::ScheduledSet.new.find_job(jid).at.to_f
puts JSON.generate({"t" => t, "jid" => jid, "at" => at})
"#,
        &url,
    );
    wait_for("HardWorker to run", Duration::from_secs(10), || {
        c.llen::<_, usize>("started").unwrap() == 1
    })
    .await;
    handle.stop().await.unwrap();
    let line: String = c.lindex("started", 0).unwrap();
    let run: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(run["jid"], sent["jid"]);
    assert_eq!(run["args"], json!(["x", 1]));
    let (t, at, ran) = (f(&sent["t"]), f(&sent["at"]), f(&run["at"]));
    assert!((at - t - 2.0).abs() < 0.5, "Ruby scheduled it 2 s ahead");
    assert!(ran >= at, "not before its time: ran {ran}, due {at}");
    assert!(ran >= t + 2.0, "ran {} s after the enqueue", ran - t);
    assert!(ran < at + 2.0, "on time: {} s late", ran - at);
    let left = rb("puts Sidekiq::ScheduledSet.new.size", &url);
    assert_eq!(left.trim(), "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_round_moves_2500_due_jobs_in_batches_and_ruby_reads_them_in_the_queue() {
    let redis = RedisServer::start();
    let url = redis.url();
    let sent = rb_json(
        r#"
at = Time.now.to_f + 3600
jids = Sidekiq::Client.push_bulk("class" => "HardWorker", "args" => (0...2500).map { |i| [i] }, "at" => at)
later = Sidekiq::Client.push_bulk("class" => "HardWorker", "args" => [["later"], ["later"], ["later"]], "at" => at + 3600)
first = Sidekiq::ScheduledSet.new.find_job(jids.first)
puts JSON.generate({"at" => at, "count" => jids.size, "first" => jids.first, "created_at" => first["created_at"]})
"#,
        &url,
    );
    assert_eq!(sent["count"], 2500);
    let at = f(&sent["at"]);
    let mut conn = redis.async_conn().await;
    // An hour later: everything but the three later jobs is due.
    let moved = enqueue_due(&mut conn, "schedule", at + 1.0, TimeFormat::Seconds)
        .await
        .unwrap();
    // More than one batch.
    const { assert!(2500 > oxidekiq::scheduled::BATCH) };
    assert_eq!(moved, 2500, "one call drains everything due");
    let seen = rb_json(
        &format!(
            r#"
q = Sidekiq::Queue.new
job = q.find_job("{}")
puts JSON.generate({{
  "size" => q.size, "scheduled" => Sidekiq::ScheduledSet.new.size, "queues" => Sidekiq::Queue.all.map(&:name),
  "uniq" => q.map(&:jid).uniq.size, "enqueued_at" => job.enqueued_at.to_f, "created_at" => job["created_at"],
  "keys" => job.item.keys, "args" => job.args, "latency" => q.latency
}})
"#,
            sent["first"].as_str().unwrap()
        ),
        &url,
    );
    assert_eq!(seen["size"], 2500);
    assert_eq!(seen["uniq"], 2500);
    assert_eq!(seen["scheduled"], 3, "jobs not yet due stay");
    assert_eq!(seen["queues"], json!(["default"]));
    assert_eq!(seen["args"], json!([0]));
    assert_eq!(seen["created_at"], sent["created_at"], "created_at is kept");
    assert!(
        (f(&seen["enqueued_at"]) - (at + 1.0)).abs() < 1e-3,
        "enqueued_at is the poller's now"
    );
    let keys: Vec<&str> = seen["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap())
        .collect();
    assert!(!keys.contains(&"at"), "{keys:?}");
    assert_eq!(
        keys,
        [
            "retry",
            "queue",
            "class",
            "args",
            "jid",
            "created_at",
            "enqueued_at"
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_moves_due_retries_before_due_scheduled_jobs() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let t = now();
    let r = r#"{"retry":true,"queue":"default","class":"HardWorker","args":["r"],"jid":"00000000000000000000000r","retry_count":0,"failed_at":1.5,"error_class":"X","error_message":"m"}"#;
    let s = r#"{"retry":true,"queue":"default","class":"HardWorker","args":["s"],"jid":"00000000000000000000000s","created_at":1.5}"#;
    let _: () = c.zadd("retry", r, t - 1.0).unwrap();
    // Due earlier than the retry, yet moved after it: Ruby polls `retry`, then `schedule`.
    let _: () = c.zadd("schedule", s, t - 100.0).unwrap();
    // The launcher's own poller, at real time; it reads another queue so the jobs stay put.
    let handle = start(&url, &["elsewhere"]).await;
    wait_for("both moved", Duration::from_secs(10), || {
        c.llen::<_, usize>("queue:default").unwrap() == 2
    })
    .await;
    handle.stop().await.unwrap();
    let order = rb("puts Sidekiq::Queue.new.map(&:jid)", &url);
    // Queue#each reads from the head; the first job pushed is at the tail, served first.
    assert_eq!(
        order.lines().collect::<Vec<_>>(),
        ["00000000000000000000000s", "00000000000000000000000r"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_member_that_is_not_a_job_goes_to_the_dead_set_not_lost() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let t = now();
    let bad: Vec<&[u8]> = vec![
        b"not json",
        br#"{"class":"NoArgs"}"#,
        br#"{"args":[1]}"#,
        br#"{"class":"EmptyQueue","args":[],"queue":""}"#,
        b"\xff\xfe binary \x00",
    ];
    for (i, m) in bad.iter().enumerate() {
        let _: () = c.zadd("schedule", *m, t - 10.0 + i as f64).unwrap();
    }
    let good = r#"{"retry":true,"queue":"default","class":"HardWorker","args":[1],"jid":"0123456789abcdef01234567","created_at":1.5}"#;
    let _: () = c.zadd("schedule", good, t + 10.0).unwrap();
    let mut conn = redis.async_conn().await;
    // The first round loads the script; a flushed script cache (a Redis restart or failover) is
    // loaded again on the next, as Ruby does on NOSCRIPT.
    let first = enqueue_due(&mut conn, "schedule", t - 9.5, TimeFormat::Seconds)
        .await
        .unwrap();
    assert_eq!(first, 1);
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut c).unwrap();
    let moved = first
        + enqueue_due(&mut conn, "schedule", t + 20.0, TimeFormat::Seconds)
            .await
            .unwrap();
    assert_eq!(moved, 6);
    let seen = rb_json(
        r#"puts JSON.generate({"dead" => Sidekiq::DeadSet.new.size, "queue" => Sidekiq::Queue.new.map(&:jid), "scheduled" => Sidekiq::ScheduledSet.new.size})"#,
        &url,
    );
    assert_eq!(seen["dead"], 5);
    assert_eq!(seen["queue"], json!(["0123456789abcdef01234567"]));
    assert_eq!(seen["scheduled"], 0);
    let mut dead: Vec<Vec<u8>> = c.zrange("dead", 0, -1).unwrap();
    let mut expected: Vec<Vec<u8>> = bad.iter().map(|m| m.to_vec()).collect();
    dead.sort();
    expected.sort();
    assert_eq!(dead, expected, "kept byte for byte");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_pollers_racing_never_push_a_job_twice() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let t = now();
    let mut a = redis.async_conn().await;
    let mut b = redis.async_conn().await;
    for round in 0..3 {
        let mut pipe = redis::pipe();
        for i in 0..1000 {
            let jid = format!("{round:04}{i:020}");
            pipe.zadd(
                "schedule",
                format!(r#"{{"retry":true,"queue":"default","class":"HardWorker","args":[{i}],"jid":"{jid}"}}"#),
                t - 1.0,
            )
            .ignore();
        }
        let _: () = pipe.query(&mut c).unwrap();
        let (x, y) = tokio::join!(
            enqueue_due(&mut a, "schedule", t, TimeFormat::Seconds),
            enqueue_due(&mut b, "schedule", t, TimeFormat::Seconds)
        );
        assert_eq!(x.unwrap() + y.unwrap(), 1000, "round {round}");
    }
    let seen = rb_json(
        r#"q = Sidekiq::Queue.new; puts JSON.generate({"size" => q.size, "uniq" => q.map(&:jid).uniq.size, "scheduled" => Sidekiq::ScheduledSet.new.size})"#,
        &url,
    );
    assert_eq!(seen["size"], 3000);
    assert_eq!(seen["uniq"], 3000);
    assert_eq!(seen["scheduled"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sleep_between_rounds_follows_rubys_formula_for_the_live_process_count() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let mut registered = 0;
    for n in [3u64, 12] {
        // Live processes as Ruby's ProcessSet counts them: a member of `processes` with an `info`.
        while registered < n {
            let id = format!("host:{registered}:0123456789ab");
            let _: () = c.sadd("processes", &id).unwrap();
            let _: () = c
                .hset(
                    &id,
                    "info",
                    json!({"hostname": "host", "identity": id}).to_string(),
                )
                .unwrap();
            registered += 1;
        }
        let ruby = rb_json(
            r#"
require "sidekiq/scheduled"
p = Sidekiq::Scheduled::Poller.new
s = (0...4000).map { p.send(:random_poll_interval) }
puts JSON.generate({"average" => p.send(:poll_interval_average), "min" => s.min, "max" => s.max, "mean" => s.sum / s.size})
"#,
            &url,
        );
        let processes = live_process_count(&mut redis.async_conn().await)
            .await
            .unwrap();
        assert_eq!(processes, n);
        let mut rng = rand::rng();
        let s: Vec<f64> = (0..4000)
            .map(|_| poll_interval(Duration::from_secs(5), processes, &mut rng).as_secs_f64())
            .collect();
        let (min, max) = s
            .iter()
            .fold((f64::MAX, 0.0f64), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
        let mean = s.iter().sum::<f64>() / s.len() as f64;
        let average = f(&ruby["average"]);
        assert_eq!(average, 5.0 * n as f64, "Ruby scales by {n} processes");
        if n < 10 {
            // ½…1½ × average.
            for v in [min, f(&ruby["min"])] {
                assert!(
                    v >= average / 2.0 && v < average / 2.0 + 0.05 * average,
                    "{v}"
                );
            }
            for v in [max, f(&ruby["max"])] {
                assert!(v <= average * 1.5 && v > 1.45 * average, "{v}");
            }
        } else {
            // 0…1 × average.
            for v in [min, f(&ruby["min"])] {
                assert!(v < 0.05 * average, "{v}");
            }
            for v in [max, f(&ruby["max"])] {
                assert!(v <= average && v > 0.95 * average, "{v}");
            }
        }
        let ruby_mean = f(&ruby["mean"]);
        assert!(
            (mean - ruby_mean).abs() < 0.05 * average,
            "means {mean} vs {ruby_mean}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_poll_interval_counts_only_live_processes_as_ruby_does() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let mut conn = redis.async_conn().await;
    assert_eq!(live_process_count(&mut conn).await.unwrap(), 1, "never 0");
    for i in 0..3 {
        let id = format!("host:{i}:live");
        let _: () = c.sadd("processes", &id).unwrap();
        let _: () = c
            .hset(
                &id,
                "info",
                json!({"hostname": "host", "identity": id}).to_string(),
            )
            .unwrap();
    }
    // Killed with SIGKILL: still in `processes`, heartbeat hash expired.
    for i in 0..5 {
        let _: () = c.sadd("processes", format!("host:{i}:gone")).unwrap();
    }
    let ours = live_process_count(&mut conn).await.unwrap();
    let ruby = rb(
        "require \"sidekiq/scheduled\"\nputs Sidekiq::Scheduled::Poller.new.send(:process_count)",
        &url,
    );
    assert_eq!(ruby.trim(), "3");
    assert_eq!(ours, 3);
}
