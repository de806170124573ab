//! Panics and hostile numbers through the real process path (issue #11): a job whose run panics, in
//! its worker or in a middleware, and a payload whose numbers are out of every sane range, each ends
//! as a job failure in the retry or dead set with an error saying why. None is stranded in the working
//! hash or on the Busy page, and the process goes on running other jobs.
use crate::support;

use std::time::Duration;

use oxidekiq::config::Config;
use oxidekiq::error::JobResult;
use oxidekiq::launcher::Launcher;
use oxidekiq::middleware::{BoxFuture, Next, ServerMiddleware};
use oxidekiq::{JobContext, JobError, NoArgs, Registry, Worker};
use redis::Commands;
use serde_json::Value;

/// Records its jid in `ran`.
#[derive(Debug)]
struct Noop;
impl Worker for Noop {
    const CLASS: &'static str = "NoopJob";
    type Args = Vec<Value>;
    async fn perform(&self, ctx: &JobContext, _: Self::Args) -> JobResult {
        let mut c = ctx.redis();
        let _: () = redis::AsyncCommands::rpush(&mut c, "ran", ctx.jid()).await?;
        Ok(())
    }
}

/// Panics, after an await (so the panic happens on a later poll of the job's task).
#[derive(Debug)]
struct Panics;
impl Worker for Panics {
    const CLASS: &'static str = "PanicJob";
    type Args = NoArgs;
    async fn perform(&self, _ctx: &JobContext, _: NoArgs) -> JobResult {
        tokio::task::yield_now().await;
        let v: Vec<u8> = Vec::new();
        let i = v.len() + 3;
        // An out-of-bounds index, as a bug would write it.
        let _ = v[i];
        Ok(())
    }
}

/// Always fails, as a Ruby `raise`.
#[derive(Debug)]
struct Fails;
impl Worker for Fails {
    const CLASS: &'static str = "FailJob";
    type Args = NoArgs;
    async fn perform(&self, _ctx: &JobContext, _: NoArgs) -> JobResult {
        Err(JobError::new("ArgumentError", "always fails"))
    }
}

/// A middleware that panics before the worker runs.
#[derive(Debug)]
struct PanickyMiddleware;
impl ServerMiddleware for PanickyMiddleware {
    fn call<'a>(&'a self, _ctx: &'a JobContext, _next: Next<'a>) -> BoxFuture<'a, JobResult> {
        Box::pin(async move { panic!("middleware bug: boom") })
    }
}

#[derive(Debug)]
struct GuardedNoop;
impl Worker for GuardedNoop {
    const CLASS: &'static str = "GuardedJob";
    type Args = NoArgs;
    async fn perform(&self, _ctx: &JobContext, _: NoArgs) -> JobResult {
        Ok(())
    }
}

fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(Noop).register(Panics).register(Fails);
    r.register(GuardedNoop).with(PanickyMiddleware);
    r
}

fn config(url: &str) -> Config {
    Config {
        timeout: Config::default().timeout,
        poll_interval_average: Duration::from_secs(3600),
        ..support::config(url, &["default"], 4)
    }
}

/// Where each job ended.
#[derive(Debug, Default)]
struct Fates {
    /// Retry-set members with their scores.
    retry: Vec<(Value, f64)>,
    /// Dead-set members.
    dead: Vec<Value>,
    /// Jids that ran to completion.
    ran: Vec<String>,
    /// `stat:processed` and `stat:failed` after the stop (which flushes them).
    processed: u64,
    failed: u64,
    /// The execution metrics' `<Class>|p` and `<Class>|f` fields, their value in each `j|` key that
    /// has them (the minute's key of each Sidekiq version's format, and 8.x's rollup).
    metrics: std::collections::BTreeMap<String, Vec<u64>>,
}

impl Fates {
    fn retry_of(&self, jid: &str) -> Option<&(Value, f64)> {
        self.retry.iter().find(|(v, _)| v["jid"] == jid)
    }
    fn dead_of(&self, jid: &str) -> Option<&Value> {
        self.dead.iter().find(|v| v["jid"] == jid)
    }
    /// How many places the jid is in (exactly 1 for a job with one fate).
    fn places(&self, jid: &str) -> usize {
        usize::from(self.retry_of(jid).is_some())
            + usize::from(self.dead_of(jid).is_some())
            + self.ran.iter().filter(|j| *j == jid).count()
    }
}

fn read_fates(c: &mut redis::Connection) -> Fates {
    let retry: Vec<(String, f64)> = c.zrange_withscores("retry", 0, -1).unwrap();
    let dead: Vec<String> = c.zrange("dead", 0, -1).unwrap();
    Fates {
        retry: retry
            .into_iter()
            .map(|(m, s)| (serde_json::from_str(&m).unwrap(), s))
            .collect(),
        dead: dead
            .iter()
            .map(|m| serde_json::from_str(m).unwrap())
            .collect(),
        ran: c.lrange("ran", 0, -1).unwrap(),
        processed: c
            .get::<_, Option<u64>>("stat:processed")
            .unwrap()
            .unwrap_or(0),
        failed: c.get::<_, Option<u64>>("stat:failed").unwrap().unwrap_or(0),
        metrics: {
            let mut m = std::collections::BTreeMap::new();
            let keys: Vec<String> = c.keys("j|*").unwrap();
            for k in keys {
                let fields: std::collections::HashMap<String, u64> = c.hgetall(&k).unwrap();
                for (f, n) in fields {
                    if f.ends_with("|p") || f.ends_with("|f") {
                        m.entry(f).or_insert_with(Vec::new).push(n);
                    }
                }
            }
            m
        },
    }
}

/// Pushes the payloads (each with a distinct `jid`), runs one in-process oxidekiq until every jid has
/// a fate, checks that nothing is left in the queue, the working hashes or the Busy page, stops it,
/// and returns the fates.
async fn run(payloads: &[String]) -> Fates {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let jids: Vec<String> = payloads
        .iter()
        .map(|p| {
            let v: Value = serde_json::from_str(p).unwrap();
            v["jid"].as_str().unwrap().to_string()
        })
        .collect();
    for p in payloads {
        let _: () = c.lpush("queue:default", p).unwrap();
    }
    let handle = Launcher::new(config(&redis.url()), registry())
        .start()
        .await
        .unwrap();
    let identity = handle.identity().to_string();
    let all_placed = support::wait_until(Duration::from_secs(20), || {
        let f = read_fates(&mut c);
        jids.iter().all(|j| f.places(j) >= 1)
    });
    let fates = read_fates(&mut c);
    assert!(all_placed, "not every job reached a fate: {fates:?}");
    // Nothing stays in flight: the working hash is empty and the Busy page (refreshed every beat) too.
    let working_empty = support::wait_until(Duration::from_secs(10), || {
        let keys: Vec<String> = c.keys("oxidekiq:batch:*").unwrap();
        keys.iter().all(|k| support::held_in(&mut c, k).is_empty())
    });
    assert!(working_empty, "a job stayed in a working hash");
    assert!(
        c.exists::<_, bool>("processes").unwrap(),
        "the process is registered"
    );
    let busy_empty = support::wait_until(Duration::from_secs(10), || {
        c.hlen::<_, usize>(format!("{identity}:work")).unwrap() == 0
            && c.hget::<_, _, Option<String>>(&identity, "busy")
                .unwrap()
                .as_deref()
                == Some("0")
    });
    assert!(busy_empty, "a job stayed on the Busy page");
    assert_eq!(c.llen::<_, usize>("queue:default").unwrap(), 0);
    handle.stop().await.unwrap();
    let fates = read_fates(&mut c);
    for j in &jids {
        assert_eq!(fates.places(j), 1, "{j} has exactly one fate: {fates:?}");
    }
    let keys: Vec<String> = c.keys("oxidekiq:batch:*").unwrap();
    for k in keys {
        assert_eq!(
            support::held_in(&mut c, &k).len(),
            0,
            "{k} is empty after stop"
        );
    }
    fates
}

fn error_of(v: &Value) -> (&str, &str) {
    (
        v["error_class"].as_str().unwrap_or_default(),
        v["error_message"].as_str().unwrap_or_default(),
    )
}

/// A retry entry scored by Sidekiq's first backoff: `failed_at + 0**4 + 15 + rand(10) * 1`.
fn assert_first_backoff(v: &Value, score: f64) {
    assert_eq!(v["retry_count"], 0, "{v}");
    let failed_at = v["failed_at"].as_f64().unwrap();
    let delay = score - failed_at;
    assert!((14.9..=24.1).contains(&delay), "backoff {delay} s: {v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_a_worker_or_a_middleware_is_a_failure_in_the_retry_set_with_sidekiqs_backoff() {
    let fates = run(&[
        r#"{"class":"PanicJob","args":[],"jid":"panic-worker","queue":"default","retry":true}"#
            .into(),
        r#"{"class":"GuardedJob","args":[],"jid":"panic-mw","queue":"default","retry":true}"#
            .into(),
        r#"{"class":"NoopJob","args":[],"jid":"after","queue":"default","retry":true}"#.into(),
    ])
    .await;
    let (v, score) = fates
        .retry_of("panic-worker")
        .expect("the worker's panic is retried");
    let (class, message) = error_of(v);
    assert_eq!(class, "Oxidekiq::Panic");
    assert!(message.contains("index out of bounds"), "{message}");
    assert_first_backoff(v, *score);
    let (v, score) = fates
        .retry_of("panic-mw")
        .expect("the middleware's panic is retried");
    let (class, message) = error_of(v);
    assert_eq!(class, "Oxidekiq::Panic");
    assert!(message.contains("middleware bug: boom"), "{message}");
    assert_first_backoff(v, *score);
    // The process went on.
    assert!(fates.ran.contains(&"after".to_string()));
    // Counted as Sidekiq counts a raised job: processed and failed, in the stats and the metrics.
    assert_eq!((fates.processed, fates.failed), (3, 2), "{fates:?}");
    let once = |field: &str| {
        let v = fates.metrics.get(field);
        assert!(
            v.is_some_and(|v| !v.is_empty() && v.iter().all(|&n| n == 1)),
            "{field} counted once in every metrics key: {fates:?}"
        );
    };
    for class in ["PanicJob", "GuardedJob"] {
        once(&format!("{class}|p"));
        once(&format!("{class}|f"));
    }
    once("NoopJob|p");
    assert!(!fates.metrics.contains_key("NoopJob|f"), "{fates:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unique_ttl_out_of_range_is_an_invalid_payload_in_the_retry_set() {
    // The first is issue #11's payload, which panicked in `Duration::from_secs_f64`.
    let ttls = ["1e300", "1e400", "-1", "0", "\"30\"", "1e10"];
    let payloads: Vec<String> = ttls
        .iter()
        .enumerate()
        .map(|(i, ttl)| {
            format!(
                r#"{{"class":"NoopJob","args":[],"jid":"ttl{i}","queue":"default","unique_key":"x","unique_ttl":{ttl}}}"#
            )
        })
        .collect();
    let fates = run(&payloads).await;
    for (i, ttl) in ttls.iter().enumerate() {
        let (v, score) = fates
            .retry_of(&format!("ttl{i}"))
            .unwrap_or_else(|| panic!("unique_ttl {ttl} is in the retry set: {fates:?}"));
        let (class, message) = error_of(v);
        assert_eq!(class, "Oxidekiq::InvalidPayload", "{ttl}");
        assert!(message.contains("unique_ttl"), "{ttl}: {message}");
        assert_first_backoff(v, *score);
    }
    assert!(
        fates.ran.is_empty(),
        "no job with a bad lock ran: {fates:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_counts_and_limits_at_the_end_of_64_bits_neither_overflow_nor_loop() {
    let fates = run(&[
        // A count at (or past) the end of i64: exhausted, as Ruby's Bignum arithmetic says.
        r#"{"class":"FailJob","args":[],"jid":"max","queue":"default","retry":true,"retry_count":9223372036854775807}"#.into(),
        r#"{"class":"FailJob","args":[],"jid":"bignum","queue":"default","retry":true,"retry_count":123456789012345678901234567890}"#.into(),
        r#"{"class":"FailJob","args":[],"jid":"inf","queue":"default","retry":true,"retry_count":1e400}"#.into(),
        // A limit past i64 too: retried, at a score Redis takes (capped at the year 9999).
        r#"{"class":"FailJob","args":[],"jid":"huge-limit","queue":"default","retry":99999999999999999999999,"retry_count":4000000000000000000}"#.into(),
        // A negative count and a negative limit.
        r#"{"class":"FailJob","args":[],"jid":"neg-count","queue":"default","retry":3,"retry_count":-5}"#.into(),
        r#"{"class":"FailJob","args":[],"jid":"neg-limit","queue":"default","retry":-99999999999999999999}"#.into(),
    ])
    .await;
    for jid in ["max", "bignum", "inf", "neg-limit"] {
        let v = fates
            .dead_of(jid)
            .unwrap_or_else(|| panic!("{jid} is in the dead set: {fates:?}"));
        assert_eq!(error_of(v), ("ArgumentError", "always fails"), "{jid}");
    }
    assert_eq!(fates.dead_of("max").unwrap()["retry_count"], i64::MAX);
    let (v, score) = fates.retry_of("huge-limit").expect("huge-limit is retried");
    assert_eq!(v["retry_count"], 4_000_000_000_000_000_001i64);
    assert_eq!(*score, oxidekiq::job::MAX_TIMESTAMP);
    let (v, score) = fates.retry_of("neg-count").expect("neg-count is retried");
    assert_eq!(v["retry_count"], -4);
    assert!(score.is_finite());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timestamps_time_budgets_and_counts_out_of_range_are_not_trusted() {
    let fates = run(&[
        // Timestamps the run does not need: the job runs.
        r#"{"class":"NoopJob","args":[],"jid":"stamps","queue":"default","enqueued_at":1e400,"created_at":-1,"at":1e400}"#.into(),
        r#"{"class":"NoopJob","args":[],"jid":"stamps-ms","queue":"default","enqueued_at":-99999999999999999999999,"created_at":"soon","at":"x"}"#.into(),
        // An infinite time budget, an infinite or negative first failure: the count decides.
        r#"{"class":"FailJob","args":[],"jid":"retry-for-inf","queue":"default","retry":3,"retry_for":1e400,"retry_count":0,"failed_at":1.0}"#.into(),
        r#"{"class":"FailJob","args":[],"jid":"failed-at-inf","queue":"default","retry":3,"retry_for":60,"retry_count":0,"failed_at":1e400}"#.into(),
        r#"{"class":"FailJob","args":[],"jid":"failed-at-neg","queue":"default","retry":3,"retry_for":60,"retry_count":0,"failed_at":-1e400}"#.into(),
        // A backtrace length beyond every integer type.
        r#"{"class":"FailJob","args":[],"jid":"backtrace","queue":"default","retry":true,"backtrace":1e400}"#.into(),
        // ActiveJob's `executions` out of range: the arguments cannot be decoded, an ArgumentError.
        r#"{"class":"ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper","wrapped":"NoopJob","args":[{"job_class":"NoopJob","job_id":"a","arguments":[],"executions":1e400}],"jid":"aj-inf","queue":"default","retry":true}"#.into(),
        r#"{"class":"ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper","wrapped":"NoopJob","args":[{"job_class":"NoopJob","job_id":"b","arguments":[],"executions":-1}],"jid":"aj-neg","queue":"default","retry":true}"#.into(),
    ])
    .await;
    assert!(fates.ran.contains(&"stamps".to_string()), "{fates:?}");
    assert!(fates.ran.contains(&"stamps-ms".to_string()), "{fates:?}");
    // retry_for 1e400 is no budget: retried by count. failed_at ±1e400 is not a time: `now` is used,
    // so the 60 s budget is not spent yet.
    for jid in ["retry-for-inf", "failed-at-inf", "failed-at-neg"] {
        let (v, score) = fates
            .retry_of(jid)
            .unwrap_or_else(|| panic!("{jid} is retried: {fates:?}"));
        assert_eq!(v["retry_count"], 1, "{jid}");
        assert!(score.is_finite(), "{jid}");
    }
    let (v, score) = fates.retry_of("backtrace").expect("backtrace is retried");
    assert!(v.get("error_backtrace").is_none(), "{v}");
    assert_first_backoff(v, *score);
    for jid in ["aj-inf", "aj-neg"] {
        let (v, _) = fates
            .retry_of(jid)
            .unwrap_or_else(|| panic!("{jid} is retried: {fates:?}"));
        let (class, message) = error_of(v);
        assert_eq!(class, "ArgumentError", "{jid}");
        assert!(message.contains("executions"), "{jid}: {message}");
    }
}

/// Issue #11's payload through the `oxidekiq` binary (the `workers` crate's `NoopJob`): it lands in the
/// retry set with an error, and the process keeps running and stops cleanly.
#[test]
fn the_issue_payload_lands_in_the_retry_set_when_run_by_the_binary() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let payload = r#"{"class":"NoopJob","args":[],"jid":"p1","queue":"default","unique_key":"x","unique_ttl":1e300}"#;
    let _: () = c.lpush("queue:default", payload).unwrap();
    let mut ox = support::Oxidekiq::start(&redis.url(), &["-q", "default", "-c", "2"]);
    let retried = support::wait_until(Duration::from_secs(30), || {
        c.zcard::<_, usize>("retry").unwrap() == 1
    });
    assert!(retried, "p1 is not in the retry set:\n{}", ox.log());
    let members: Vec<String> = c.zrange("retry", 0, -1).unwrap();
    let v: Value = serde_json::from_str(&members[0]).unwrap();
    assert_eq!(v["jid"], "p1");
    assert_eq!(v["error_class"], "Oxidekiq::InvalidPayload");
    assert!(
        v["error_message"].as_str().unwrap().contains("unique_ttl"),
        "{v}"
    );
    // The process is still up, and nothing of p1 stays in flight.
    assert!(ox.try_exit().is_none(), "oxidekiq exited:\n{}", ox.log());
    let working_empty = support::wait_until(Duration::from_secs(10), || {
        let keys: Vec<String> = c.keys("oxidekiq:batch:*").unwrap();
        keys.iter().all(|k| support::held_in(&mut c, k).is_empty())
    });
    assert!(working_empty, "p1 stayed in a working hash");
    ox.signal("TERM");
    let status = ox.wait_exit(Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.success()),
        "clean stop: {status:?}\n{}",
        ox.log()
    );
    assert!(!ox.log().contains("panicked"), "{}", ox.log());
}
