//! Every ActiveJob shape Rails 6.1 writes reaches the Rust worker registered under the ActiveJob class,
//! with its arguments decoded into plain values and its `job_id`/`executions`; and a real Ruby
//! `perform_later` reaches a worker with typed arguments.
use crate::test_support as support;

use std::time::Duration;

use oxidekiq::config::Config;
use oxidekiq::error::JobResult;
use oxidekiq::launcher::Launcher;
use oxidekiq::{JobContext, Registry, Worker};
use redis::Commands;
use serde::Deserialize;
use serde_json::{Value, json};

/// Records what it received as JSON: decoded arguments, ActiveJob id and executions.
#[derive(Debug)]
struct AnyArgs;
impl Worker for AnyArgs {
    const CLASS: &'static str = "WelcomeEmailJob";
    type Args = Vec<Value>;
    async fn perform(&self, ctx: &JobContext, args: Self::Args) -> JobResult {
        let aj = ctx.activejob().expect("an ActiveJob job");
        let line = json!({"jid": ctx.jid(), "queue": ctx.queue(), "args": args,
            "job_id": aj.job_id, "executions": aj.executions});
        let mut c = ctx.redis();
        let _: () = redis::AsyncCommands::rpush(&mut c, "seen", line.to_string()).await?;
        Ok(())
    }
}

#[derive(Debug, Deserialize, PartialEq)]
struct Options {
    locale: String,
    #[serde(default)]
    count: u32,
}

/// A typed twin of `perform(user_id, options)`.
#[derive(Debug)]
struct Typed;
impl Worker for Typed {
    const CLASS: &'static str = "TypedMailJob";
    type Args = (u64, Options);
    async fn perform(&self, ctx: &JobContext, (user, opts): Self::Args) -> JobResult {
        let mut c = ctx.redis();
        let _: () = redis::AsyncCommands::rpush(
            &mut c,
            "typed",
            format!("{user}:{}:{}", opts.locale, opts.count),
        )
        .await?;
        Ok(())
    }
}

fn config(url: &str) -> Config {
    Config {
        timeout: Config::default().timeout,
        ..support::config(url, &["default", "mailers"], 4)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_recorded_activejob_shape_reaches_its_worker_with_decoded_arguments() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut expected = Vec::new();
    for (path, raw) in support::fixture_files("activejob-6.1") {
        let raw = raw.trim_end().to_string();
        let job: Value = serde_json::from_str(&raw).unwrap();
        let queue = job["queue"].as_str().unwrap().to_string();
        // Scheduled members go in the schedule set, due now; the poller moves them.
        if path.file_stem().unwrap() == "scheduled" {
            let _: () = c.zadd("schedule", &raw, support::now() - 1.0).unwrap();
        } else {
            let _: () = c.lpush(format!("queue:{queue}"), &raw).unwrap();
        }
        let decoded =
            oxidekiq::activejob::unwrap(oxidekiq::Job::from_str(&raw).unwrap().args_json())
                .unwrap();
        expected.push((job["jid"].as_str().unwrap().to_string(), queue, decoded));
    }
    assert!(
        expected.len() >= 9,
        "the recorded ActiveJob fixtures are missing"
    );
    let mut reg = Registry::new();
    reg.register(AnyArgs);
    let handle = Launcher::new(config(&redis.url()), reg)
        .start()
        .await
        .unwrap();
    let n = expected.len();
    assert!(support::wait_until(Duration::from_secs(10), || c
        .llen::<_, usize>("seen")
        .unwrap()
        == n));
    handle.stop().await.unwrap();
    let seen: Vec<Value> = c
        .lrange::<_, Vec<String>>("seen", 0, -1)
        .unwrap()
        .iter()
        .map(|s| serde_json::from_str(s).unwrap())
        .collect();
    for (jid, queue, decoded) in expected {
        let got = seen
            .iter()
            .find(|v| v["jid"] == jid.as_str())
            .unwrap_or_else(|| panic!("{jid} did not run"));
        assert_eq!(got["queue"], queue.as_str());
        assert_eq!(&got["args"], decoded.arguments(), "{jid}");
        assert_eq!(got["job_id"], decoded.job_id.as_str());
        assert_eq!(got["executions"], 0);
        assert!(
            !got["args"].to_string().contains("_aj_"),
            "markers removed: {}",
            got["args"]
        );
    }
    assert_eq!(c.zcard::<_, usize>("retry").unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ruby_perform_later_reaches_a_worker_with_typed_arguments() {
    let redis = support::RedisServer::start();
    support::ruby_activejob(
        r#"
        class TypedMailJob < ActiveJob::Base
          queue_as :mailers
          def perform(user_id, options); end
        end
        TypedMailJob.perform_later(42, { "locale" => "fr" })
        TypedMailJob.perform_later(7, { locale: "de", count: 3 })
        "#,
        &redis.url(),
    );
    let mut reg = Registry::new();
    reg.register(Typed);
    let handle = Launcher::new(config(&redis.url()), reg)
        .start()
        .await
        .unwrap();
    let mut c = redis.conn();
    assert!(support::wait_until(Duration::from_secs(10), || c
        .llen::<_, usize>("typed")
        .unwrap()
        == 2));
    handle.stop().await.unwrap();
    let mut got: Vec<String> = c.lrange("typed", 0, -1).unwrap();
    got.sort();
    assert_eq!(got, ["42:fr:0", "7:de:3"]);
}

/// Writes everything `ctx.activejob()` gives besides the arguments, keyed by jid.
#[derive(Debug)]
struct Fields<const IMPORT: bool>;
impl<const IMPORT: bool> Worker for Fields<IMPORT> {
    const CLASS: &'static str = if IMPORT {
        "ImportRecordsJob"
    } else {
        "WelcomeEmailJob"
    };
    type Args = Vec<Value>;
    async fn perform(&self, ctx: &JobContext, _args: Self::Args) -> JobResult {
        let aj = ctx.activejob().expect("an ActiveJob job");
        let ns = |t: Option<chrono::DateTime<chrono::FixedOffset>>| {
            t.and_then(|t| t.timestamp_nanos_opt())
        };
        let line = json!({
            "jid": ctx.jid(), "provider_job_id": aj.provider_job_id(), "queue_name": aj.queue_name(),
            "priority": aj.priority(), "locale": aj.locale(), "timezone": aj.timezone(),
            "enqueued_ns": ns(aj.enqueued_at()), "scheduled_ns": ns(aj.scheduled_at()),
            "exception_executions": aj.exception_executions(),
            "continuation": aj.continuation().map(|c| c.unwrap().to_value()),
            "resumptions": aj.resumptions(), "typed": aj.typed_arguments().is_ok(),
        });
        let mut c = ctx.redis();
        let _: () = redis::AsyncCommands::rpush(&mut c, "fields", line.to_string()).await?;
        Ok(())
    }
}

/// Through a running launcher, the Rails 7.2 (Rails' wrapper) and 8.1 (Sidekiq's wrapper, Continuable
/// jobs among them) recordings give the worker every `job_data` field as that ActiveJob read it back
/// (`ruby.json`), and the jid the job runs under as `provider_job_id`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_worker_gets_every_job_data_field_as_rails_read_it() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut expected = Vec::new();
    for version in ["activejob-7.2", "activejob-8.1"] {
        let facts: Value = serde_json::from_str(
            &std::fs::read_to_string(format!(
                "{}/fixtures/{version}/ruby.json",
                env!("CARGO_MANIFEST_DIR")
            ))
            .unwrap(),
        )
        .unwrap();
        for (path, raw) in support::fixture_files(version) {
            let file = path.file_name().unwrap().to_str().unwrap().to_string();
            if file == "ruby.json" {
                continue;
            }
            let raw = raw.trim_end().to_string();
            let job: Value = serde_json::from_str(&raw).unwrap();
            if job.get("enqueued_at").is_none() {
                let _: () = c.zadd("schedule", &raw, support::now() - 1.0).unwrap();
            } else {
                let queue = job["queue"].as_str().unwrap();
                let _: () = c.lpush(format!("queue:{queue}"), &raw).unwrap();
            }
            expected.push((
                job["jid"].as_str().unwrap().to_string(),
                facts["files"][&file].clone(),
            ));
        }
    }
    assert_eq!(expected.len(), 11 + 16);
    let mut reg = Registry::new();
    reg.register(Fields::<false>);
    reg.register(Fields::<true>);
    let config = Config {
        timeout: Config::default().timeout,
        ..support::config(&redis.url(), &["default", "mailers", "critical"], 4)
    };
    let handle = Launcher::new(config, reg).start().await.unwrap();
    let n = expected.len();
    assert!(support::wait_until(Duration::from_secs(15), || c
        .llen::<_, usize>("fields")
        .unwrap()
        == n));
    handle.stop().await.unwrap();
    let seen: Vec<Value> = c
        .lrange::<_, Vec<String>>("fields", 0, -1)
        .unwrap()
        .iter()
        .map(|s| serde_json::from_str(s).unwrap())
        .collect();
    for (jid, want) in expected {
        let got = seen
            .iter()
            .find(|v| v["jid"] == jid.as_str())
            .unwrap_or_else(|| panic!("{jid} did not run"));
        assert_eq!(got["provider_job_id"], want["provider_job_id"], "{jid}");
        assert_eq!(got["provider_job_id"], jid.as_str(), "{jid}");
        for key in [
            "queue_name",
            "priority",
            "locale",
            "timezone",
            "exception_executions",
        ] {
            assert_eq!(got[key], want[key], "{jid}: {key}");
        }
        assert_eq!(got["enqueued_ns"], want["enqueued_at"]["epoch_ns"], "{jid}");
        assert_eq!(
            got["scheduled_ns"],
            want["scheduled_at"]
                .get("epoch_ns")
                .cloned()
                .unwrap_or(Value::Null),
            "{jid}"
        );
        assert_eq!(
            got["continuation"],
            want.get("continuation").cloned().unwrap_or(Value::Null),
            "{jid}"
        );
        assert_eq!(
            got["resumptions"],
            want.get("resumptions").cloned().unwrap_or(Value::Null),
            "{jid}"
        );
        assert_eq!(got["typed"], true, "{jid}");
    }
    assert_eq!(c.zcard::<_, usize>("retry").unwrap(), 0);
}
