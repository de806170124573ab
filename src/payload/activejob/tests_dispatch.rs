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
