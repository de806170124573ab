//! Hostile payloads (issue #7): each one ends in the dead or retry set with an error that says what was
//! wrong and with its original bytes; the process never panics and keeps running other jobs.
use crate::support;

use std::time::Duration;

use oxidekiq::config::Config;
use oxidekiq::error::JobResult;
use oxidekiq::launcher::Launcher;
use oxidekiq::{JobContext, Registry, Worker};
use redis::Commands;
use serde_json::Value;

#[derive(Debug)]
struct Typed;
impl Worker for Typed {
    const CLASS: &'static str = "TypedJob";
    type Args = (u64, String);
    async fn perform(&self, ctx: &JobContext, (n, s): Self::Args) -> JobResult {
        let mut c = ctx.redis();
        let _: () = redis::AsyncCommands::rpush(&mut c, "ran", format!("{n}:{s}")).await?;
        Ok(())
    }
}

#[derive(Debug)]
struct Anything;
impl Worker for Anything {
    const CLASS: &'static str = "AnyJob";
    type Args = Vec<Value>;
    async fn perform(&self, ctx: &JobContext, args: Self::Args) -> JobResult {
        let mut c = ctx.redis();
        let _: () =
            redis::AsyncCommands::rpush(&mut c, "ran", serde_json::to_string(&args).unwrap())
                .await?;
        Ok(())
    }
}

fn config(url: &str, max_payload_bytes: usize) -> Config {
    Config {
        max_payload_bytes,
        timeout: Config::default().timeout,
        poll_interval_average: Duration::from_secs(3600),
        ..support::config(url, &["default"], 4)
    }
}

/// Pushes `payloads`, then one good job behind them, runs until the good job ran, and returns the
/// dead-set and retry-set members.
async fn run(payloads: &[Vec<u8>], limit: usize) -> (Vec<Vec<u8>>, Vec<String>, Vec<String>) {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    for p in payloads {
        let _: () = c.lpush("queue:default", p.as_slice()).unwrap();
    }
    let good =
        r#"{"class":"TypedJob","args":[1,"ok"],"jid":"good","queue":"default","retry":true}"#;
    let _: () = c.lpush("queue:default", good).unwrap();
    let mut reg = Registry::new();
    reg.register(Typed).register(Anything);
    let handle = Launcher::new(config(&redis.url(), limit), reg)
        .start()
        .await
        .unwrap();
    let n = payloads.len();
    assert!(
        support::wait_until(Duration::from_secs(10), || {
            let ran: Vec<String> = c.lrange("ran", 0, -1).unwrap();
            let dead: usize = c.zcard("dead").unwrap();
            let retry: usize = c.zcard("retry").unwrap();
            ran.contains(&"1:ok".to_string()) && dead + retry + ran.len() > n
        }),
        "jobs did not all reach a fate"
    );
    handle.stop().await.unwrap();
    let dead: Vec<Vec<u8>> = c.zrange("dead", 0, -1).unwrap();
    let retry: Vec<String> = c.zrange("retry", 0, -1).unwrap();
    let ran: Vec<String> = c.lrange("ran", 0, -1).unwrap();
    assert_eq!(c.llen::<_, usize>("queue:default").unwrap(), 0);
    (dead, retry, ran)
}

fn error_of(member: &[u8]) -> (String, String) {
    let v: Value = serde_json::from_slice(member).unwrap();
    (
        v["error_class"].as_str().unwrap_or_default().to_string(),
        v["error_message"].as_str().unwrap_or_default().to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_json_and_invalid_utf8_go_to_the_dead_set_byte_for_byte() {
    let bad: Vec<Vec<u8>> = vec![
        b"{\"class\":".to_vec(),
        b"{\"class\":\"AnyJob\",\"args\":[\"\xff\xfe\"]}".to_vec(),
    ];
    let (dead, retry, _) = run(&bad, 1 << 20).await;
    assert!(retry.is_empty());
    assert_eq!(dead.len(), 2);
    for b in &bad {
        assert!(
            dead.contains(b),
            "{:?} not in the dead set as is",
            String::from_utf8_lossy(b)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_that_is_not_a_job_goes_to_the_dead_set_with_an_error_saying_why() {
    let cases: Vec<(&str, &str)> = vec![
        (r#"[1,2,3]"#, "not an object"),
        (r#"{"args":[1],"jid":"noclass"}"#, "`class` is missing"),
        (
            r#"{"class":42,"args":[1],"jid":"numclass"}"#,
            "`class` is not a string",
        ),
        (
            r#"{"class":"AnyJob","args":{"a":1},"jid":"objargs"}"#,
            "`args` is not an array",
        ),
    ];
    let payloads: Vec<Vec<u8>> = cases.iter().map(|(p, _)| p.as_bytes().to_vec()).collect();
    let (dead, retry, _) = run(&payloads, 1 << 20).await;
    assert!(retry.is_empty());
    assert_eq!(dead.len(), cases.len());
    // A non-object stays as it was; objects keep every key and gain the error.
    assert!(dead.contains(&b"[1,2,3]".to_vec()));
    for (payload, want) in &cases[1..] {
        let original: serde_json::Map<String, Value> = serde_json::from_str(payload).unwrap();
        let member = dead
            .iter()
            .find(|m| {
                serde_json::from_slice::<Value>(m)
                    .ok()
                    .and_then(|v| v.get("jid").cloned())
                    == original.get("jid").cloned()
            })
            .unwrap_or_else(|| panic!("{payload} not in the dead set"));
        let (class, message) = error_of(member);
        assert_eq!(class, "Oxidekiq::InvalidPayload");
        assert!(message.contains(want), "{message:?} should say {want:?}");
        let v: serde_json::Map<String, Value> = serde_json::from_slice(member).unwrap();
        for (k, val) in original {
            assert_eq!(v[&k], val, "key {k} kept");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn args_that_do_not_fit_the_workers_type_are_an_argument_error_in_the_retry_set() {
    let p = br#"{"class":"TypedJob","args":["not a number",5],"jid":"badargs","queue":"default","retry":true}"#;
    let (dead, retry, _) = run(&[p.to_vec()], 1 << 20).await;
    assert!(dead.is_empty());
    assert_eq!(retry.len(), 1);
    let (class, message) = error_of(retry[0].as_bytes());
    assert_eq!(class, "ArgumentError");
    assert!(message.contains("TypedJob"), "{message}");
    assert!(message.contains("invalid type"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_thousand_levels_of_nesting_end_in_the_dead_set_without_a_crash() {
    let n = 100_000;
    let deep = format!(
        r#"{{"class":"AnyJob","jid":"deep","queue":"default","retry":true,"args":{}{}}}"#,
        "[".repeat(n),
        "]".repeat(n)
    );
    let (dead, retry, ran) = run(&[deep.clone().into_bytes()], 1 << 30).await;
    assert!(ran.iter().all(|r| r == "1:ok"), "the deep job must not run");
    // Its arguments cannot be decoded (recursion limit): the retry path cannot re-encode such a
    // payload either, so it goes to the dead set whole.
    assert!(retry.is_empty());
    assert_eq!(dead, vec![deep.into_bytes()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_over_the_size_limit_goes_to_the_dead_set_undecoded() {
    let big = format!(
        r#"{{"class":"AnyJob","jid":"big","queue":"default","retry":true,"args":["{}"]}}"#,
        "x".repeat(10 * 1024 * 1024)
    );
    let (dead, retry, ran) = run(&[big.clone().into_bytes()], 4 * 1024 * 1024).await;
    assert!(retry.is_empty());
    assert_eq!(ran, vec!["1:ok".to_string()]);
    assert_eq!(dead.len(), 1);
    assert!(
        dead[0].starts_with(&big.as_bytes()[..big.len() - 1]),
        "every original byte kept"
    );
    let (class, message) = error_of(&dead[0]);
    assert_eq!(class, "Oxidekiq::InvalidPayload");
    assert!(message.contains("limit"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numbers_beyond_64_bits_reach_the_worker_exactly_and_survive_a_retry() {
    let ok = br#"{"class":"AnyJob","jid":"bigint","queue":"default","retry":true,"args":[123456789012345678901234567890,1.0e+400]}"#;
    let typed = br#"{"class":"TypedJob","jid":"toobig","queue":"default","retry":true,"args":[123456789012345678901234567890,"x"],"extra":98765432109876543210987654321}"#;
    let (dead, retry, ran) = run(&[ok.to_vec(), typed.to_vec()], 1 << 20).await;
    assert!(dead.is_empty());
    assert!(
        ran.contains(&"[123456789012345678901234567890,1.0e+400]".to_string()),
        "{ran:?}"
    );
    assert_eq!(retry.len(), 1, "a u64 argument cannot hold it: retry");
    assert!(retry[0].contains("[123456789012345678901234567890,\"x\"]"));
    assert!(retry[0].contains("\"extra\":98765432109876543210987654321"));
}
