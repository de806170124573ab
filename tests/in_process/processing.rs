//! The runtime against a real Redis: dispatch of every payload shape Ruby writes to typed Rust workers,
//! bounded concurrency, the retry and dead paths for bad input, scheduled jobs, and the push-back on stop.
use crate::support;

use std::time::Duration;

use oxidekiq::error::JobResult;
use oxidekiq::launcher::{Handle, Launcher};
use oxidekiq::{JobContext, JobError, NoArgs, Registry, Worker};
use redis::Commands;
use serde_json::Value;
use support::{config, launch, wait_for};

/// Records `class`, `jid` and the typed args it received into the `seen` list.
async fn record(ctx: &JobContext, what: String) {
    let mut c = ctx.redis();
    let line = serde_json::json!({"class": ctx.class(), "jid": ctx.jid(), "queue": ctx.queue(), "args": what}).to_string();
    let _: () = redis::AsyncCommands::rpush(&mut c, "seen", line)
        .await
        .unwrap();
}

#[derive(Debug)]
struct HardWorker;
impl Worker for HardWorker {
    const CLASS: &'static str = "HardWorker";
    type Args = Vec<Value>;
    async fn perform(&self, ctx: &JobContext, args: Self::Args) -> JobResult {
        record(ctx, serde_json::to_string(&args).unwrap()).await;
        Ok(())
    }
}

#[derive(Debug)]
struct ChargeJob;
impl Worker for ChargeJob {
    const CLASS: &'static str = "Billing::ChargeJob";
    type Args = (u64, f64, String);
    async fn perform(&self, ctx: &JobContext, (id, amount, cur): Self::Args) -> JobResult {
        record(ctx, format!("{id}|{amount}|{cur}")).await;
        Ok(())
    }
}

#[derive(Debug)]
struct Failing;
impl Worker for Failing {
    const CLASS: &'static str = "FailingJob";
    type Args = NoArgs;
    async fn perform(&self, _ctx: &JobContext, _: NoArgs) -> JobResult {
        Err(JobError::new("ArgumentError", "always fails"))
    }
}

/// Sleeps `ms` while counting concurrent runs in Redis (`running`, `max_running`).
#[derive(Debug)]
struct Sleepy;
impl Worker for Sleepy {
    const CLASS: &'static str = "SleepyJob";
    type Args = (u64,);
    async fn perform(&self, ctx: &JobContext, (ms,): Self::Args) -> JobResult {
        let mut c = ctx.redis();
        support::count_in(&mut c, "running", "max_running").await?;
        tokio::time::sleep(Duration::from_millis(ms)).await;
        let _: i64 = redis::AsyncCommands::decr(&mut c, "running", 1).await?;
        let _: () = redis::AsyncCommands::rpush(&mut c, "finished", ctx.jid()).await?;
        Ok(())
    }
}

/// Counts itself as running (`running`, `max_running`), then waits until the key `go` exists: no run
/// can end before the test says so.
#[derive(Debug)]
struct Gated;
impl Worker for Gated {
    const CLASS: &'static str = "GatedJob";
    type Args = NoArgs;
    async fn perform(&self, ctx: &JobContext, _: NoArgs) -> JobResult {
        let mut c = ctx.redis();
        support::count_in(&mut c, "running", "max_running").await?;
        while !redis::AsyncCommands::exists::<_, bool>(&mut c, "go").await? {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _: i64 = redis::AsyncCommands::decr(&mut c, "running", 1).await?;
        let _: () = redis::AsyncCommands::rpush(&mut c, "finished", ctx.jid()).await?;
        Ok(())
    }
}

fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(HardWorker)
        .register(ChargeJob)
        .register(Failing)
        .register(Sleepy)
        .register(Gated);
    r
}

async fn start(url: &str, queues: &[&str], concurrency: usize) -> Handle {
    launch(config(url, queues, concurrency), registry()).await
}

fn fixture(path: &str) -> String {
    support::fixture(&format!("shared/{path}"))
        .trim_end_matches('\n')
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_client_version_payload_reaches_its_worker_with_typed_args() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut expected = Vec::new();
    for v in ["sidekiq-6.4.1", "sidekiq-7.3.9", "sidekiq-8.1.7"] {
        for f in [
            "enqueued_plain",
            "enqueued_options_unicode",
            "enqueued_retry_false_no_args",
            "enqueued_retry_queue",
            "enqueued_namespaced_class",
            "bulk_first",
        ] {
            let raw = fixture(&format!("{v}/{f}.json"));
            let job: Value = serde_json::from_str(&raw).unwrap();
            let q = job["queue"].as_str().unwrap().to_string();
            let _: () = c.lpush(format!("queue:{q}"), &raw).unwrap();
            expected.push((
                job["jid"].as_str().unwrap().to_string(),
                job["class"].as_str().unwrap().to_string(),
                job["args"].clone(),
            ));
        }
    }
    let handle = start(&redis.url(), &["critical", "default", "low"], 5).await;
    let n = expected.len();
    wait_for("all fixtures", Duration::from_secs(10), || {
        c.llen::<_, usize>("seen").unwrap() == n
    })
    .await;
    handle.stop().await.unwrap();
    let seen: Vec<String> = c.lrange("seen", 0, -1).unwrap();
    for (jid, class, args) in expected {
        let line = seen
            .iter()
            .map(|s| serde_json::from_str::<Value>(s).unwrap())
            .find(|v| v["jid"] == jid.as_str())
            .unwrap_or_else(|| panic!("{jid} did not run"));
        assert_eq!(line["class"], class.as_str());
        let got = line["args"].as_str().unwrap();
        if class == "Billing::ChargeJob" {
            assert_eq!(got, "42|19.99|USD");
        } else {
            // Numbers beyond 64 bits arrive exactly.
            assert_eq!(got, serde_json::to_string(&args).unwrap());
        }
    }
    assert!(seen.iter().any(|s| s.contains("12345678901234567890")));
    // Every job's fate is in Redis: the working lists are empty.
    let working: Vec<String> = c.keys("oxidekiq:batch:*").unwrap();
    for k in working {
        assert_eq!(support::held_in(&mut c, &k).len(), 0, "{k}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_class_is_retried_with_an_error_naming_it_not_dropped() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let raw = r#"{"retry":true,"queue":"default","class":"Reports::Nightly","args":[1],"jid":"aaaaaaaaaaaaaaaaaaaaaaaa","created_at":1795291260.8,"enqueued_at":1795291260.9}"#;
    let _: () = c.lpush("queue:default", raw).unwrap();
    let handle = start(&redis.url(), &["default"], 2).await;
    wait_for("retry entry", Duration::from_secs(5), || {
        c.zcard::<_, usize>("retry").unwrap() == 1
    })
    .await;
    handle.stop().await.unwrap();
    let entries: Vec<String> = c.zrange("retry", 0, -1).unwrap();
    let m: Value = serde_json::from_str(&entries[0]).unwrap();
    assert_eq!(m["error_class"], "NameError");
    assert!(
        m["error_message"]
            .as_str()
            .unwrap()
            .contains("Reports::Nightly")
    );
    assert!(m["error_message"].as_str().unwrap().contains("queue"));
    assert_eq!(m["retry_count"], 0);
    assert_eq!(
        c.llen::<_, usize>("queue:default").unwrap(),
        0,
        "it does not spin back into the queue"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_json_goes_to_the_dead_set_with_its_original_bytes() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let _: () = c
        .lpush("queue:default", b"{not json\xff".as_slice())
        .unwrap();
    let handle = start(&redis.url(), &["default"], 2).await;
    wait_for("dead entry", Duration::from_secs(5), || {
        c.zcard::<_, usize>("dead").unwrap() == 1
    })
    .await;
    handle.stop().await.unwrap();
    let entries: Vec<Vec<u8>> = c.zrange("dead", 0, -1).unwrap();
    assert_eq!(entries[0], b"{not json\xff");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_job_lands_in_the_retry_set_with_ruby_fields_and_keeps_unknown_keys() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let raw = r#"{"retry":true,"queue":"default","class":"FailingJob","args":[],"jid":"bbbbbbbbbbbbbbbbbbbbbbbb","created_at":1795291260.8,"enqueued_at":1795291260.9,"cattr":{"tenant":7},"locale":"fr"}"#;
    let _: () = c.lpush("queue:default", raw).unwrap();
    let before = support::now();
    let handle = start(&redis.url(), &["default"], 2).await;
    wait_for("retry entry", Duration::from_secs(5), || {
        c.zcard::<_, usize>("retry").unwrap() == 1
    })
    .await;
    handle.stop().await.unwrap();
    let entries: Vec<(String, f64)> = c.zrange_withscores("retry", 0, -1).unwrap();
    let (member, score) = &entries[0];
    let m: Value = serde_json::from_str(member).unwrap();
    assert_eq!(m["error_class"], "ArgumentError");
    assert_eq!(m["error_message"], "always fails");
    assert_eq!(m["retry_count"], 0);
    assert_eq!(m["cattr"]["tenant"], 7);
    assert_eq!(m["locale"], "fr");
    assert!(m["failed_at"].as_f64().unwrap() >= before);
    assert!(
        *score >= before + 15.0 && *score <= support::now() + 24.0,
        "{score}"
    );
    let failed: i64 = c.get("stat:failed").unwrap_or(0);
    let processed: i64 = c.get("stat:processed").unwrap_or(0);
    assert_eq!((processed, failed), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_bounds_running_jobs_and_fetches_no_more_than_free_slots() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    for i in 0..12 {
        let _: () = c
            .lpush("queue:default", format!(r#"{{"class":"GatedJob","args":[],"jid":"j{i}","queue":"default","retry":true}}"#))
            .unwrap();
    }
    let handle = start(&redis.url(), &["default"], 3).await;
    // Every slot busy, and no job can end before `go`: the process has fetched what it runs.
    wait_for("3 jobs running", Duration::from_secs(10), || {
        c.get::<_, Option<i64>>("running").unwrap() == Some(3)
    })
    .await;
    // Give a fetch loop that ignored its free slots the time to fetch more (it polls every few ms): a
    // fetch that must NOT happen has no event to wait for.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let working: Vec<String> = c.keys("oxidekiq:batch:*").unwrap();
    let held: usize = working
        .iter()
        .map(|k| support::held_in(&mut c, k).len())
        .sum();
    assert_eq!(held, 3, "3 slots: exactly the 3 running jobs are fetched");
    assert_eq!(c.llen::<_, usize>("queue:default").unwrap(), 9);
    assert_eq!(c.get::<_, i64>("running").unwrap(), 3);
    let _: () = c.set("go", 1).unwrap();
    wait_for("all jobs", Duration::from_secs(20), || {
        c.llen::<_, usize>("finished").unwrap() == 12
    })
    .await;
    handle.stop().await.unwrap();
    let max: i64 = c.get("max_running").unwrap();
    assert_eq!(max, 3, "at most 3 at once, and it reached 3");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_pushes_unfinished_jobs_back_byte_identical_to_the_served_end() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let long = r#"{"class":"SleepyJob","args":[30000],"jid":"long","queue":"default","retry":true,"big":12345678901234567890123,"x":1.0e+20}"#;
    let _: () = c.lpush("queue:default", long).unwrap();
    let mut cfg = config(&redis.url(), &["default"], 2);
    cfg.timeout = Duration::from_millis(500);
    let handle = Launcher::new(cfg, registry()).start().await.unwrap();
    wait_for("job started", Duration::from_secs(5), || {
        c.get::<_, Option<i64>>("running").unwrap() == Some(1)
    })
    .await;
    let other = r#"{"class":"SleepyJob","args":[1],"jid":"next","queue":"default","retry":true}"#;
    let _: () = c.lpush("queue:default", other).unwrap();
    let identity = handle.identity().to_string();
    handle.stop().await.unwrap();
    // The unfinished job is at the tail (served next by BRPOP/RPOP), byte for byte.
    let tail: Vec<u8> = c.lindex("queue:default", -1).unwrap();
    assert_eq!(tail, long.as_bytes());
    let working: Vec<String> = c.keys("oxidekiq:batch:*").unwrap();
    assert!(working.is_empty(), "{working:?}");
    let members: Vec<String> = c.smembers("processes").unwrap();
    assert!(!members.contains(&identity));
    assert_eq!(
        c.zcard::<_, usize>("retry").unwrap(),
        0,
        "an interrupted job is not a failure"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn due_scheduled_and_retry_jobs_are_moved_to_their_queues_and_run() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let now = support::now();
    for i in 0..50 {
        let m = format!(
            r#"{{"class":"HardWorker","args":[{i}],"jid":"s{i}","queue":"default","retry":true,"created_at":{now}}}"#
        );
        let _: () = c.zadd("schedule", m, now - 1.0).unwrap();
    }
    let r = r#"{"class":"HardWorker","args":["r"],"jid":"r1","queue":"default","retry":true,"retry_count":3,"error_class":"X"}"#;
    let _: () = c.zadd("retry", r, now - 1.0).unwrap();
    let later =
        r#"{"class":"HardWorker","args":["later"],"jid":"l1","queue":"default","retry":true}"#;
    let _: () = c.zadd("schedule", later, now + 3600.0).unwrap();
    let handle = start(&redis.url(), &["default"], 5).await;
    wait_for("scheduled jobs", Duration::from_secs(10), || {
        c.llen::<_, usize>("seen").unwrap() == 51
    })
    .await;
    handle.stop().await.unwrap();
    assert_eq!(
        c.zcard::<_, usize>("schedule").unwrap(),
        1,
        "the future job stays"
    );
    assert_eq!(c.zcard::<_, usize>("retry").unwrap(), 0);
}
