//! Retries and the dead set against real Ruby Sidekiq 6.4 (PROTOCOL §4): what oxidekiq writes when a
//! job fails is read back through Ruby's own API (`Sidekiq::RetrySet`, `DeadSet`, `SortedEntry`) and
//! the Web UI, and compared with what a real Ruby `sidekiq` process or `DeadSet#kill` writes.
//! No test waits for a backoff: due retries are moved with `scheduled::enqueue_due` at an injected time.
use crate::test_support as support;

use std::time::Duration;

use oxidekiq::error::JobResult;
use oxidekiq::job::RetrySetting;
use oxidekiq::launcher::Handle;
use oxidekiq::time::{TimeFormat, now};
use oxidekiq::{JobContext, JobError, Registry, Worker, WorkerOptions};
use redis::Commands;
use serde_json::{Value, json};
use support::{
    RedisServer, RubySidekiq, config, launch, ruby_api as rb, ruby_api_json as rb_json, wait_for,
    wait_until,
};

/// The backtrace every scripted failure carries.
fn backtrace() -> Vec<String> {
    (1..=6)
        .map(|i| format!("workers/src/scripted.rs:{i}:in `perform'"))
        .collect()
}

/// Fails (or not) as its first argument says; records each run's jid in the `ran` list.
#[derive(Debug)]
struct Scripted;
impl Worker for Scripted {
    const CLASS: &'static str = "ScriptedJob";
    type Args = (String, Value);
    async fn perform(&self, ctx: &JobContext, (action, param): Self::Args) -> JobResult {
        let mut c = ctx.redis();
        let _: () = redis::AsyncCommands::rpush(&mut c, "ran", ctx.jid()).await?;
        let p = match &param {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        Err(match action.as_str() {
            "fail" => JobError::new("ArgumentError", format!("boom {p}")),
            "long" => JobError::msg("é".repeat(20_000) + "tail"),
            "retry_in" => JobError::msg("later").retry_in(param.as_u64().unwrap_or(1)),
            "discard" => JobError::msg("unwanted").discard(),
            "kill" => JobError::new("Fatal", "cannot ever work").kill(),
            other => JobError::msg(format!("unknown action {other}")),
        }
        .with_backtrace(backtrace()))
    }
}

/// Fails always; its options (not the payload) give retry count, retry queue and backtrace.
#[derive(Debug)]
struct Optioned;
impl Worker for Optioned {
    const CLASS: &'static str = "OptionedJob";
    type Args = Vec<Value>;
    fn options(&self) -> WorkerOptions {
        WorkerOptions {
            retry: Some(RetrySetting::Count(1)),
            retry_queue: Some("low".into()),
            backtrace: Some(2),
            ..WorkerOptions::default()
        }
    }
    async fn perform(&self, ctx: &JobContext, _: Self::Args) -> JobResult {
        let mut c = ctx.redis();
        let _: () = redis::AsyncCommands::rpush(&mut c, "ran", ctx.jid()).await?;
        Err(JobError::msg("optioned failure").with_backtrace(backtrace()))
    }
}

/// Fails always; `sidekiq_options retry: 0, dead: false`.
#[derive(Debug)]
struct Deadless;
impl Worker for Deadless {
    const CLASS: &'static str = "DeadlessJob";
    type Args = Vec<Value>;
    fn options(&self) -> WorkerOptions {
        WorkerOptions {
            retry: Some(RetrySetting::Count(0)),
            dead: Some(false),
            ..WorkerOptions::default()
        }
    }
    async fn perform(&self, ctx: &JobContext, _: Self::Args) -> JobResult {
        let mut c = ctx.redis();
        let _: () = redis::AsyncCommands::rpush(&mut c, "ran", ctx.jid()).await?;
        Err(JobError::msg("nobody wants me"))
    }
}

async fn start(url: &str) -> Handle {
    let mut r = Registry::new();
    r.register(Scripted).register(Optioned).register(Deadless);
    launch(config(url, &["default", "low"], 4), r).await
}

/// Ruby that prints the JSON of what `SortedEntry` says about each entry of `set` (`RetrySet`,
/// `DeadSet`): accessors, the timestamps as Ruby's `Time`, and the backtrace Ruby decodes itself.
fn entries_script(set: &str) -> String {
    format!(
        r#"
set = Sidekiq::{set}.new
out = set.map do |e|
  {{
    "jid" => e.jid, "klass" => e.klass, "display_class" => e.display_class, "args" => e.args,
    "queue" => e.queue, "score" => e.score, "at" => e.at.to_f,
    "error_class" => e["error_class"], "error_message" => e["error_message"],
    "error_message_length" => e["error_message"] && e["error_message"].length,
    "error_message_encoding" => e["error_message"] && e["error_message"].encoding.to_s,
    "retry_count" => e["retry_count"],
    "failed_at_class" => e["failed_at"].class.name,
    "failed_at" => e["failed_at"] && Time.at(e["failed_at"]).utc.to_f,
    "retried_at_class" => e["retried_at"].class.name,
    "retried_at" => e["retried_at"] && Time.at(e["retried_at"]).utc.to_f,
    "created_at" => e.created_at.to_f,
    "error_backtrace" => e.error_backtrace,
    "item" => e.item,
    "error" => e.error?,
  }}
end
puts JSON.generate({{"size" => set.size, "entries" => out}})
"#
    )
}

fn entries(set: &str, url: &str) -> Vec<Value> {
    let v = rb_json(&entries_script(set), url);
    let list = v["entries"].as_array().unwrap().clone();
    assert_eq!(v["size"].as_u64().unwrap() as usize, list.len());
    list
}

fn entry_by_jid<'a>(list: &'a [Value], jid: &str) -> &'a Value {
    list.iter()
        .find(|e| e["jid"] == jid)
        .unwrap_or_else(|| panic!("{jid} not in {list:#?}"))
}

/// Pushes with Ruby's client; returns the jids, one line per `push` expression.
fn ruby_push(url: &str, pushes: &[&str]) -> Vec<String> {
    let script: String = pushes
        .iter()
        .map(|p| format!("puts Sidekiq::Client.push({p})\n"))
        .collect();
    rb(&script, url).lines().map(str::to_string).collect()
}

fn runs(c: &mut redis::Connection) -> usize {
    c.llen("ran").unwrap()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_rust_job_reads_in_rubys_retry_set_like_a_failed_ruby_job() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let jids = ruby_push(
        &url,
        &[
            r#""class" => "ScriptedJob", "args" => ["fail", "x"], "retry_queue" => "low", "backtrace" => true, "custom" => {"tenant" => 7, "big" => 12345678901234567890123}, "tags" => ["billing"]"#,
        ],
    );
    let jid = &jids[0];
    let before = now();
    let handle = start(&url).await;
    wait_for("retry entry", Duration::from_secs(10), || {
        c.zcard::<_, usize>("retry").unwrap() == 1
    })
    .await;
    let after = now();
    handle.stop().await.unwrap();

    let list = entries("RetrySet", &url);
    let e = entry_by_jid(&list, jid);
    assert_eq!(e["klass"], "ScriptedJob");
    assert_eq!(e["display_class"], "ScriptedJob");
    assert_eq!(e["args"], json!(["fail", "x"]));
    assert_eq!(e["queue"], "low", "retry_queue is where the retry goes");
    assert_eq!(e["error_class"], "ArgumentError");
    assert_eq!(e["error_message"], "boom x");
    assert_eq!(e["retry_count"], 0);
    assert_eq!(e["error"], true);
    assert_eq!(e["failed_at_class"], "Float");
    assert_eq!(e["retried_at_class"], "NilClass");
    let failed_at = f(&e["failed_at"]);
    assert!(
        failed_at >= before && failed_at <= after,
        "{before} <= {failed_at} <= {after}"
    );
    // count 0: 0**4 + 15 + rand(10) * 1, so 15..=24 seconds after the failure.
    let delay = f(&e["at"]) - failed_at;
    assert!((15.0..=24.01).contains(&delay), "backoff {delay}");
    assert_eq!(e["error_backtrace"], json!(backtrace()));
    assert_eq!(e["item"]["custom"]["tenant"], 7);
    assert_eq!(e["item"]["tags"], json!(["billing"]));
    assert_eq!(e["item"]["retry_queue"], "low");
    // Keys Ruby does not know survive byte for byte, big numbers included.
    let raw: Vec<String> = c.zrange("retry", 0, -1).unwrap();
    assert!(
        raw[0].contains(r#""big":12345678901234567890123"#),
        "{}",
        raw[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_messages_are_cut_to_ten_thousand_characters_and_backtraces_to_the_asked_lines() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let jids = ruby_push(
        &url,
        &[
            r#""class" => "ScriptedJob", "args" => ["long", 0]"#,
            r#""class" => "ScriptedJob", "args" => ["fail", "all"], "backtrace" => true"#,
            r#""class" => "ScriptedJob", "args" => ["fail", "three"], "backtrace" => 3"#,
            r#""class" => "ScriptedJob", "args" => ["fail", "none"], "backtrace" => false"#,
        ],
    );
    let handle = start(&url).await;
    wait_for("4 retry entries", Duration::from_secs(10), || {
        c.zcard::<_, usize>("retry").unwrap() == 4
    })
    .await;
    handle.stop().await.unwrap();
    let list = entries("RetrySet", &url);

    let long = entry_by_jid(&list, &jids[0]);
    assert_eq!(
        long["error_message_length"], 10_000,
        "Ruby counts characters"
    );
    assert_eq!(long["error_message_encoding"], "UTF-8");
    assert!(
        long["error_message"]
            .as_str()
            .unwrap()
            .chars()
            .all(|c| c == 'é')
    );
    assert_eq!(long["error_backtrace"], Value::Null, "no backtrace option");

    assert_eq!(
        entry_by_jid(&list, &jids[1])["error_backtrace"],
        json!(backtrace())
    );
    assert_eq!(
        entry_by_jid(&list, &jids[2])["error_backtrace"],
        json!(backtrace()[..3])
    );
    assert_eq!(
        entry_by_jid(&list, &jids[3])["error_backtrace"],
        Value::Null
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_options_give_the_retry_count_retry_queue_backtrace_and_dead_false() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    // Raw payloads without `retry`, `retry_queue` or `backtrace`: the worker's options decide.
    let optioned = r#"{"queue":"default","class":"OptionedJob","args":[1],"jid":"0000000000000000000000a1","created_at":1795291260.5,"enqueued_at":1795291260.5}"#;
    let deadless = r#"{"queue":"default","class":"DeadlessJob","args":[],"jid":"0000000000000000000000a2","created_at":1795291260.5,"enqueued_at":1795291260.5}"#;
    let _: () = c.lpush("queue:default", &[optioned, deadless]).unwrap();
    let handle = start(&url).await;
    wait_for("first runs", Duration::from_secs(10), || {
        runs(&mut c) == 2 && c.zcard::<_, usize>("retry").unwrap() == 1
    })
    .await;
    let list = entries("RetrySet", &url);
    let e = entry_by_jid(&list, "0000000000000000000000a1");
    assert_eq!(e["queue"], "low");
    assert_eq!(e["retry_count"], 0);
    assert_eq!(e["error_backtrace"], json!(backtrace()[..2]));
    // Move the retry now (injected clock): its second failure exhausts `retry: 1`.
    let mut conn = redis.async_conn().await;
    let moved =
        oxidekiq::scheduled::enqueue_due(&mut conn, "retry", now() + 1000.0, TimeFormat::Seconds)
            .await
            .unwrap();
    assert_eq!(moved, 1);
    wait_for("second run", Duration::from_secs(10), || {
        c.zcard::<_, usize>("dead").unwrap() == 1
    })
    .await;
    handle.stop().await.unwrap();
    assert_eq!(runs(&mut c), 3);
    let dead = entries("DeadSet", &url);
    assert_eq!(dead.len(), 1, "DeadlessJob (dead: false) is not stored");
    assert_eq!(dead[0]["jid"], "0000000000000000000000a1");
    assert_eq!(dead[0]["retry_count"], 1);
    assert_eq!(dead[0]["queue"], "low");
    assert!(entries("RetrySet", &url).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_now_from_ruby_runs_again_in_rust_with_the_retry_count_real_sidekiq_writes() {
    // oxidekiq's side.
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let jid = ruby_push(
        &url,
        &[r#""class" => "ScriptedJob", "args" => ["fail", "again"]"#],
    )
    .remove(0);
    let handle = start(&url).await;
    wait_for("first failure", Duration::from_secs(10), || {
        c.zcard::<_, usize>("retry").unwrap() == 1
    })
    .await;
    let first = entries("RetrySet", &url).remove(0);
    rb("Sidekiq::RetrySet.new.first.retry", &url);
    wait_for("second failure", Duration::from_secs(10), || {
        runs(&mut c) == 2 && c.zcard::<_, usize>("retry").unwrap() == 1
    })
    .await;
    handle.stop().await.unwrap();
    let rust = entries("RetrySet", &url).remove(0);
    assert_eq!(rust["jid"], jid.as_str());
    assert_eq!(rust["failed_at"], first["failed_at"], "failed_at is kept");
    assert_eq!(rust["retried_at_class"], "Float");
    let retried_at = f(&rust["retried_at"]);
    assert!(retried_at > f(&first["failed_at"]));
    let delay = f(&rust["at"]) - retried_at;

    // The same story with a real Ruby Sidekiq 6.4 process and a Ruby job that raises.
    let ruby_redis = RedisServer::start();
    let rurl = ruby_redis.url();
    let mut rc = ruby_redis.conn();
    let sidekiq = RubySidekiq::start(
        &rurl,
        r#"
        class ScriptedJob
          include Sidekiq::Worker
          def perform(action, param)
            Sidekiq.redis { |c| c.rpush("ran", jid) }
            raise ArgumentError, "boom #{param}"
          end
        end
        "#,
        &["default"],
        2,
    );
    ruby_push(
        &rurl,
        &[r#""class" => "ScriptedJob", "args" => ["fail", "again"]"#],
    );
    assert!(
        wait_until(Duration::from_secs(30), || rc
            .zcard::<_, usize>("retry")
            .unwrap()
            == 1),
        "ruby's first failure: {}",
        sidekiq.log()
    );
    let ruby_first = entries("RetrySet", &rurl).remove(0);
    rb("Sidekiq::RetrySet.new.first.retry", &rurl);
    assert!(
        wait_until(Duration::from_secs(30), || {
            runs(&mut rc) == 2 && rc.zcard::<_, usize>("retry").unwrap() == 1
        }),
        "ruby's second failure"
    );
    let ruby = entries("RetrySet", &rurl).remove(0);
    drop(sidekiq);

    assert_eq!(ruby_first["retry_count"], 0);
    assert_eq!(first["retry_count"], ruby_first["retry_count"]);
    assert_eq!(
        ruby["retry_count"], 0,
        "real Sidekiq 6.4 writes 0 after Retry now"
    );
    assert_eq!(rust["retry_count"], ruby["retry_count"]);
    assert_eq!(rust["retried_at_class"], ruby["retried_at_class"]);
    assert_eq!(rust["failed_at_class"], ruby["failed_at_class"]);
    assert_eq!(rust["error_class"], ruby["error_class"]);
    assert_eq!(rust["error_message"], ruby["error_message"]);
    assert_eq!(rust["queue"], ruby["queue"]);
    let ruby_delay = f(&ruby["at"]) - f(&ruby["retried_at"]);
    assert!((15.0..=24.01).contains(&delay), "count 0 backoff: {delay}");
    // Sidekiq 6.4 reads the clock twice, for `retried_at` and then for the retry's time: a pause
    // between the two on a loaded machine adds to its delay, up to half a second allowed here.
    assert!(
        (15.0..=24.5).contains(&ruby_delay),
        "Ruby's count 0 backoff: {ruby_delay}"
    );
    let mut rust_keys: Vec<&String> = rust["item"].as_object().unwrap().keys().collect();
    let mut ruby_keys: Vec<&String> = ruby["item"].as_object().unwrap().keys().collect();
    rust_keys.sort();
    ruby_keys.sort();
    assert_eq!(rust_keys, ruby_keys, "the same fields");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_zero_goes_to_rubys_dead_set_while_dead_false_and_retry_false_store_nothing() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let jids = ruby_push(
        &url,
        &[
            r#""class" => "ScriptedJob", "args" => ["fail", "zero"], "retry" => 0"#,
            r#""class" => "ScriptedJob", "args" => ["fail", "nodead"], "retry" => 0, "dead" => false"#,
            r#""class" => "ScriptedJob", "args" => ["fail", "noretry"], "retry" => false"#,
            r#""class" => "DeadlessJob", "args" => [], "retry" => 0"#,
        ],
    );
    let before = now();
    let handle = start(&url).await;
    wait_for("4 runs", Duration::from_secs(10), || runs(&mut c) == 4).await;
    handle.stop().await.unwrap();
    let dead = entries("DeadSet", &url);
    assert_eq!(dead.len(), 1, "{dead:#?}");
    let e = &dead[0];
    assert_eq!(e["jid"], jids[0].as_str());
    assert_eq!(e["error_class"], "ArgumentError");
    assert_eq!(e["error_message"], "boom zero");
    assert_eq!(e["retry_count"], 0);
    assert_eq!(e["failed_at_class"], "Float");
    assert!(f(&e["score"]) >= before && f(&e["score"]) <= now());
    assert!(entries("RetrySet", &url).is_empty());
    let failed = rb("puts Sidekiq::Stats.new.failed", &url);
    assert_eq!(failed.trim(), "4", "every failure is counted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_n_is_exhausted_after_n_retries_and_the_job_dies() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let jid = ruby_push(
        &url,
        &[r#""class" => "ScriptedJob", "args" => ["fail", "n"], "retry" => 2"#],
    )
    .remove(0);
    let handle = start(&url).await;
    let mut conn = redis.async_conn().await;
    for (run, count) in [(1, 0), (2, 1)] {
        wait_for("a retry entry", Duration::from_secs(10), || {
            runs(&mut c) == run && c.zcard::<_, usize>("retry").unwrap() == 1
        })
        .await;
        let e = entries("RetrySet", &url).remove(0);
        assert_eq!(e["retry_count"], count);
        // The backoff grows with the count: count**4 + 15 + jitter. No Ruby process is live, so the
        // newest rules apply (Sidekiq 8.0+: jitter `rand(10 * (count + 1))`, up to 19 s at count 1;
        // the bound of the older `rand(10) * (count + 1)`, 18 s, failed one run in twenty).
        let base = e["failed_at"].clone();
        let t = if count == 0 {
            base
        } else {
            e["retried_at"].clone()
        };
        let delay = f(&e["at"]) - f(&t);
        let lo = (count as f64).powi(4) + 15.0;
        let hi = lo + 10.0 * (count as f64 + 1.0) - 1.0 + 0.01;
        assert!((lo..=hi).contains(&delay), "count {count}: {delay}");
        // Make this entry due now rather than asking for everything due in the next 1000 s: the job it
        // moves fails again at once, and its next entry (16 s or more ahead) must not be moved in the
        // same call.
        let member: Vec<Vec<u8>> = c.zrange("retry", 0, 0).unwrap();
        let _: () = redis::cmd("ZADD")
            .arg("retry")
            .arg("XX")
            .arg(now() - 1.0)
            .arg(&member[0])
            .query(&mut c)
            .unwrap();
        let moved =
            oxidekiq::scheduled::enqueue_due(&mut conn, "retry", now(), TimeFormat::Seconds)
                .await
                .unwrap();
        // The process's own scheduled poller may have moved the entry, due now, first (0); never
        // more than this one. The next wait (a run more, a new entry, or death) sees it moved.
        assert!(moved <= 1, "moved {moved}");
    }
    wait_for("death", Duration::from_secs(10), || {
        c.zcard::<_, usize>("dead").unwrap() == 1
    })
    .await;
    handle.stop().await.unwrap();
    assert_eq!(runs(&mut c), 3, "retry: 2 = 3 executions");
    let dead = entries("DeadSet", &url);
    assert_eq!(dead[0]["jid"], jid.as_str());
    assert_eq!(dead[0]["retry_count"], 2);
    assert_eq!(dead[0]["retried_at_class"], "Float");
    assert!(entries("RetrySet", &url).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_retry_in_discard_and_kill_answers_are_what_ruby_sees() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let mut pushes = vec![
        r#""class" => "ScriptedJob", "args" => ["discard", 0]"#,
        r#""class" => "ScriptedJob", "args" => ["kill", 0]"#,
    ];
    pushes.extend([r#""class" => "ScriptedJob", "args" => ["retry_in", 300]"#; 8]);
    let jids = ruby_push(&url, &pushes);
    let handle = start(&url).await;
    wait_for("10 runs", Duration::from_secs(10), || runs(&mut c) == 10).await;
    handle.stop().await.unwrap();
    let retries = entries("RetrySet", &url);
    assert_eq!(retries.len(), 8);
    // sidekiq_retry_in's answer replaces count**4 + 15, and Ruby still adds rand(10) * (count + 1).
    let jitters: Vec<f64> = retries
        .iter()
        .map(|r| f(&r["at"]) - f(&r["failed_at"]) - 300.0)
        .collect();
    for j in &jitters {
        assert!(
            (-0.01..=9.01).contains(j) && (j - j.round()).abs() < 0.01,
            "{jitters:?}"
        );
    }
    assert!(
        jitters.iter().any(|j| *j > 0.5),
        "8 retries without any jitter: {jitters:?}"
    );
    let dead = entries("DeadSet", &url);
    assert_eq!(
        dead.len(),
        1,
        "discard stores nothing; kill goes to the dead set"
    );
    assert_eq!(dead[0]["jid"], jids[1].as_str());
    assert_eq!(dead[0]["error_class"], "Fatal");
    assert_eq!(dead[0]["retry_count"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_for_decides_by_the_time_since_the_first_failure() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let t = now();
    let pushes = [
        format!(
            r#""class" => "ScriptedJob", "args" => ["fail", "expired"], "retry_for" => 60, "retry_count" => 0, "failed_at" => {}"#,
            t - 120.0
        ),
        format!(
            r#""class" => "ScriptedJob", "args" => ["fail", "in time"], "retry_for" => 60, "retry_count" => 0, "failed_at" => {}"#,
            t - 10.0
        ),
    ];
    let jids = ruby_push(&url, &[&pushes[0], &pushes[1]]);
    let handle = start(&url).await;
    wait_for("2 runs", Duration::from_secs(10), || runs(&mut c) == 2).await;
    handle.stop().await.unwrap();
    let dead = entries("DeadSet", &url);
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0]["jid"], jids[0].as_str());
    let retries = entries("RetrySet", &url);
    assert_eq!(retries.len(), 1);
    assert_eq!(retries[0]["jid"], jids[1].as_str());
    assert_eq!(retries[0]["retry_count"], 1);
}

/// A dead-set member as Ruby would have written it, `i` making it unique.
fn dead_member(i: usize) -> String {
    format!(
        r#"{{"retry":0,"queue":"default","class":"OldJob","args":[{i}],"jid":"{i:024x}","error_class":"X","error_message":"m","failed_at":1.5,"retry_count":0}}"#
    )
}

/// Fills `dead` with `old` members older than 180 days and `recent` members of the last hours.
fn fill_dead(c: &mut redis::Connection, t: f64, old: usize, recent: usize) {
    let mut pipe = redis::pipe();
    for i in 0..old {
        pipe.zadd("dead", dead_member(i), t - 181.0 * 86_400.0 + i as f64)
            .ignore();
    }
    for i in 0..recent {
        pipe.zadd("dead", dead_member(old + i), t - 20_000.0 + i as f64)
            .ignore();
    }
    let _: () = pipe.query(c).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dead_set_is_trimmed_by_age_and_count_exactly_as_dead_set_kill_trims_it() {
    let t = now();
    // oxidekiq kills a job (retry: 0) into a full dead set with some members past 180 days.
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    fill_dead(&mut c, t, 5, 10_002);
    let jid = ruby_push(
        &url,
        &[r#""class" => "ScriptedJob", "args" => ["fail", "last"], "retry" => 0"#],
    )
    .remove(0);
    let handle = start(&url).await;
    wait_for("1 run", Duration::from_secs(10), || runs(&mut c) == 1).await;
    handle.stop().await.unwrap();

    // Ruby's own DeadSet#kill on the same starting set.
    let ruby_redis = RedisServer::start();
    let rurl = ruby_redis.url();
    let mut rc = ruby_redis.conn();
    fill_dead(&mut rc, t, 5, 10_002);
    rb(
        r#"Sidekiq::DeadSet.new.kill(JSON.generate({"class" => "RubyKilled", "args" => [], "jid" => "f" * 24}), notify_failure: false)"#,
        &rurl,
    );

    let script = r#"
set = Sidekiq::DeadSet.new
newest = set.first
puts JSON.generate({"size" => set.size, "newest" => newest.jid, "max" => Sidekiq::DeadSet.max_jobs, "oldest_age_days" => (Time.now.to_f - set.to_a.last.score) / 86400.0})
"#;
    let ours = rb_json(script, &url);
    let theirs = rb_json(script, &rurl);
    assert_eq!(ours["size"], 9_999, "ZREMRANGEBYRANK 0 -10000 keeps 9 999");
    assert_eq!(ours["size"], theirs["size"]);
    assert_eq!(ours["newest"], jid.as_str());
    assert_eq!(theirs["newest"], "f".repeat(24));
    assert!(f(&ours["oldest_age_days"]) < 180.0);
    let ours_members: Vec<String> = c.zrange("dead", 0, -1).unwrap();
    let theirs_members: Vec<String> = rc.zrange("dead", 0, -1).unwrap();
    let (ours_old, _) = ours_members.split_at(ours_members.len() - 1);
    let (theirs_old, _) = theirs_members.split_at(theirs_members.len() - 1);
    assert_eq!(ours_old, theirs_old, "the same members survive");

    // The age limit follows the clock passed in: 200 days on, only the new member is left.
    let mut conn = redis.async_conn().await;
    oxidekiq::retry::send_to_morgue(
        &mut conn,
        dead_member(99_999).as_bytes(),
        t + 200.0 * 86_400.0,
    )
    .await
    .unwrap();
    let size = rb("puts Sidekiq::DeadSet.new.size", &url);
    assert_eq!(size.trim(), "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_web_ui_renders_our_retry_dead_and_scheduled_entries() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let jids = ruby_push(
        &url,
        &[
            r#""class" => "ScriptedJob", "args" => ["fail", "for the ui"], "backtrace" => true"#,
            r#""class" => "ScriptedJob", "args" => ["kill", 0]"#,
        ],
    );
    let handle = start(&url).await;
    wait_for("2 runs", Duration::from_secs(10), || {
        runs(&mut c) == 2
            && c.zcard::<_, usize>("retry").unwrap() == 1
            && c.zcard::<_, usize>("dead").unwrap() == 1
    })
    .await;
    handle.stop().await.unwrap();
    let client = oxidekiq::client::Client::connect(&url).await.unwrap();
    let scheduled = client
        .perform_in(3600.0, "ScheduledRustJob", ("later", 1))
        .await
        .unwrap();

    let keys = rb(
        r##"
[Sidekiq::RetrySet, Sidekiq::DeadSet].each { |s| e = s.new.first; puts "#{e.score}-#{e.jid}" }
"##,
        &url,
    );
    let keys: Vec<&str> = keys.lines().collect();
    let pages = [
        ("/retries".to_string(), jids[0].as_str()),
        ("/morgue".to_string(), jids[1].as_str()),
        ("/scheduled".to_string(), "ScheduledRustJob"),
        (format!("/retries/{}", keys[0]), jids[0].as_str()),
        (format!("/morgue/{}", keys[1]), jids[1].as_str()),
    ];
    for (path, needle) in pages {
        let (status, body) = tokio::task::block_in_place(|| support::web_ui_get(&url, &path));
        assert_eq!(status, 200, "{path}: {body}");
        assert!(body.contains(needle), "{path} shows {needle}: {body}");
        assert!(
            body.contains("ScriptedJob") || path == "/scheduled",
            "{path}"
        );
    }
    let (_, retry_page) =
        tokio::task::block_in_place(|| support::web_ui_get(&url, &format!("/retries/{}", keys[0])));
    assert!(retry_page.contains("boom for the ui"));
    assert!(
        retry_page.contains("workers/src/scripted.rs:1:in"),
        "the decoded backtrace is shown"
    );
    let (_, sched_page) = tokio::task::block_in_place(|| support::web_ui_get(&url, "/scheduled"));
    assert!(
        sched_page.contains(&scheduled),
        "the scheduled jid is listed"
    );
}
