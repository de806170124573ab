//! Iterable jobs, cancellation and timeouts (issue 31), live against a real Redis, and compared with
//! the recordings of real Sidekiq 8.1.7 server processes (`fixtures/sidekiq-8.1.7-iterable/`).
//!
//! [`Walk`] is the Rust twin of the recordings' `WalkJob` (`jobs.rb`): `array_enumerator((0...n))`,
//! each item noted in `rec-seen-<jid>` as `ex<run>:<item>` and each hook in `rec-hooks-<jid>`, so the
//! same checks read both. The commands a Rust run sends are taken with `MONITOR` and reduced to the
//! recordings' shape: the commands on `it-*`, `queues` and `queue:default` (reads by the fetch and the
//! gauges left out, as the recorder leaves out fetches), each flush `MULTI`..`EXEC` checked word for
//! word and then named by its `ex` and whether its `rt` is zero (the cursor, the `rt` value and the
//! number of periodic flushes vary with timing, as the fixtures' README says).

use crate::support;

use std::time::Duration;

use oxidekiq::iterable::{Enumerator, Iterable, IterableWorker};
use oxidekiq::launcher::Control;
use oxidekiq::{
    Blocking, BlockingWorker, Client, JobContext, JobError, JobResult, Registry, Worker,
    WorkerOptions,
};
use redis::Commands;
use serde_json::{Value, json};
use support::{Monitor, RedisServer, Seen, config, fixture_json, launch, wait_for};

/// The recordings' folder under `fixtures/`.
const REC: &str = "sidekiq-8.1.7-iterable";

/// `WalkJob`: `args` = `[n, {"sleep": seconds, "fail_at": item}]`, walked as Sidekiq's
/// `array_enumerator`, with Sidekiq's `max_iteration_runtime` when given.
#[derive(Debug, Default)]
struct Walk {
    max_runtime: Option<Duration>,
}

/// The run number (`@_executions`): counted by the start hooks, which run once per run.
async fn run_number(ctx: &JobContext) -> Result<i64, JobError> {
    let mut c = ctx.redis();
    Ok(redis::AsyncCommands::get(&mut c, format!("rec-ex-{}", ctx.jid())).await?)
}

async fn note(ctx: &JobContext, list: &str, value: String) -> JobResult {
    let mut c = ctx.redis();
    let _: i64 =
        redis::AsyncCommands::rpush(&mut c, format!("rec-{list}-{}", ctx.jid()), value).await?;
    Ok(())
}

async fn started(ctx: &JobContext, hook: &str) -> JobResult {
    let mut c = ctx.redis();
    let _: i64 = redis::AsyncCommands::incr(&mut c, format!("rec-ex-{}", ctx.jid()), 1).await?;
    note(ctx, "hooks", hook.to_string()).await
}

impl IterableWorker for Walk {
    const CLASS: &'static str = "WalkJob";
    type Args = Vec<Value>;
    type Item = usize;
    type Cursor = usize;

    fn max_iteration_runtime(&self) -> Option<Duration> {
        self.max_runtime
    }

    fn build_enumerator<'a>(
        &'a self,
        _ctx: &'a JobContext,
        args: &'a Vec<Value>,
        cursor: Option<usize>,
    ) -> Result<Enumerator<'a, usize, usize>, JobError> {
        let n = args.first().and_then(Value::as_u64).unwrap_or(0) as usize;
        Ok(Enumerator::array((0..n).collect(), cursor))
    }

    async fn each_iteration(&self, ctx: &JobContext, item: usize, args: &Vec<Value>) -> JobResult {
        let ex = run_number(ctx).await?;
        note(ctx, "seen", format!("ex{ex}:{item}")).await?;
        let opts = args.get(1).cloned().unwrap_or(json!({}));
        if opts["fail_at"].as_u64() == Some(item as u64) && ex == 1 {
            return Err(JobError::new(
                "ArgumentError",
                format!("failing at item {item}"),
            ));
        }
        let secs = opts["sleep"].as_f64().unwrap_or(0.5);
        tokio::time::sleep(Duration::from_secs_f64(secs)).await;
        Ok(())
    }

    async fn on_start(&self, ctx: &JobContext) -> JobResult {
        started(ctx, "on_start").await
    }
    async fn on_resume(&self, ctx: &JobContext) -> JobResult {
        started(ctx, "on_resume").await
    }
    async fn on_cancel(&self, ctx: &JobContext) -> JobResult {
        note(ctx, "hooks", "on_cancel".into()).await
    }
    async fn on_stop(&self, ctx: &JobContext) -> JobResult {
        note(ctx, "hooks", "on_stop".into()).await
    }
    async fn on_complete(&self, ctx: &JobContext) -> JobResult {
        note(ctx, "hooks", "on_complete".into()).await
    }
}

fn registry(walk: Walk) -> Registry {
    let mut r = Registry::new();
    r.register(Iterable::new(walk))
        .register(Sleeper)
        .register(Napper)
        .register(Blocking::new(BlockingSleeper));
    r
}

/// The payload Ruby 8 pushes for `WalkJob.perform_async(*args)` with a fixed jid (millisecond times).
fn walk_payload(jid: &str, args: Value) -> String {
    let now = (support::now() * 1000.0) as i64;
    serde_json::to_string(&json!({
        "retry": true, "queue": "default", "class": "WalkJob", "args": args, "jid": jid,
        "created_at": now, "enqueued_at": now,
    }))
    .unwrap()
}

fn push(c: &mut redis::Connection, payload: &str) {
    let _: () = redis::pipe()
        .sadd("queues", "default")
        .lpush("queue:default", payload)
        .query(c)
        .unwrap();
}

fn list(c: &mut redis::Connection, key: &str) -> Vec<String> {
    c.lrange(key, 0, -1).unwrap()
}

/// `(run, item)` of each `ex<run>:<item>` noted.
fn seen(c: &mut redis::Connection, jid: &str) -> Vec<(u64, u64)> {
    list(c, &format!("rec-seen-{jid}"))
        .iter()
        .map(|s| {
            let (ex, item) = s.trim_start_matches("ex").split_once(':').unwrap();
            (ex.parse().unwrap(), item.parse().unwrap())
        })
        .collect()
}

/// The reads and writes of a command stream that the recordings keep: commands on `it-*`, `queues`,
/// `queue:default`, `retry` (and the `MULTI`/`EXEC` around them), minus the fetch's and the queue
/// gauges' reads; each flush transaction checked word for word and reduced to
/// `flush ex=<n> rt=<0|run>`; consecutive equal names collapsed into one.
fn shape(commands: &[(bool, Vec<String>)], jid: &str) -> Vec<String> {
    let key = format!("it-{jid}");
    let kept = |w: &[String]| {
        let name = w[0].to_lowercase();
        let k = w.get(1).map_or("", String::as_str);
        let ours = k == key || k == "queues" || k == "queue:default" || k == "retry";
        let read = [
            "brpop",
            "rpop",
            "lmove",
            "blmove",
            "rpoplpush",
            "brpoplpush",
            "llen",
            "lindex",
            "lrange",
            "smembers",
            "sscan",
            "scard",
            "exists",
            "type",
            "zrangebyscore",
            "zrange",
            "zcard",
            "ttl",
            // The fetch's own moves (a job taken, or one fetched at the stop handed back); `sort
            // ... STORE` is the reliable fetch's copy of a batch into its working list.
            "sort",
            "ltrim",
            "rpush",
        ]
        .contains(&name.as_str());
        (ours && !read) || name == "multi" || name == "exec"
    };
    let words: Vec<Vec<String>> = commands
        .iter()
        .map(|(_, w)| w.clone())
        .filter(|w| !w.is_empty() && kept(w))
        .collect();
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let w = &words[i];
        let name = w[0].to_lowercase();
        let token = if name == "multi" {
            let block: Vec<&Vec<String>> = words[i + 1..]
                .iter()
                .take_while(|w| w[0].to_lowercase() != "exec")
                .collect();
            i += block.len() + 1;
            if block.is_empty() {
                i += 1;
                continue;
            }
            flush_token(&block, &key)
        } else {
            match name.as_str() {
                "hset" | "hsetnx" | "hget" | "hgetall" | "unlink" | "expire" => {
                    format!("{name} {}", w[2..].first().map_or("", |f| f.as_str()))
                        .trim()
                        .to_string()
                }
                "lpush" => {
                    // The payload itself is checked apart; its key is what the shape keeps.
                    format!("lpush {}", w[1])
                }
                "zadd" => format!("zadd {}", w[1]),
                _ => format!("{name} {}", w[1..].join(" ")),
            }
        };
        i += 1;
        if out.last() != Some(&token) {
            out.push(token);
        }
    }
    out
}

/// A flush's `MULTI` block, checked against `flush_state`'s three commands.
fn flush_token(block: &[&Vec<String>], key: &str) -> String {
    let lower: Vec<Vec<String>> = block
        .iter()
        .map(|w| {
            let mut w = (*w).clone();
            w[0] = w[0].to_lowercase();
            w
        })
        .collect();
    assert_eq!(lower.len(), 3, "a flush is HSET, EXPIRE, HGET: {lower:?}");
    let hset = &lower[0];
    assert_eq!(hset[0], "hset", "{lower:?}");
    assert_eq!(hset[1], key);
    assert_eq!(
        [&hset[2], &hset[4], &hset[6]],
        ["ex", "c", "rt"],
        "{lower:?}"
    );
    serde_json::from_str::<Value>(&hset[5]).unwrap_or_else(|e| panic!("c is JSON: {e}: {hset:?}"));
    let rt: f64 = hset[7].parse().unwrap();
    let expire: Vec<String> = lower[1].iter().map(|w| w.to_lowercase()).collect();
    assert_eq!(expire, ["expire", key, "2592000", "nx"], "{lower:?}");
    assert_eq!(lower[2], ["hget", key, "cancelled"], "{lower:?}");
    format!(
        "flush ex={} rt={}",
        hset[3],
        if rt == 0.0 { "0" } else { "run" }
    )
}

/// The shape of a recorded step range (`server` commands only).
fn recorded_shape(file: &str, steps: &[&str]) -> Vec<String> {
    let rec = fixture_json(&format!("{REC}/{file}.json"));
    let jid = rec["jid"].as_str().unwrap().to_string();
    let mut commands = Vec::new();
    for step in rec["steps"].as_array().unwrap() {
        if !steps.contains(&step["step"].as_str().unwrap()) {
            continue;
        }
        for c in step["commands"].as_array().unwrap() {
            if c[0] == "server" {
                let words = c[1]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|w| w.as_str().unwrap().to_string())
                    .collect();
                commands.push((false, words));
            }
        }
    }
    shape(&commands, &jid)
}

fn live_shape(seen: &[Seen], jid: &str) -> Vec<String> {
    // Commands a Lua script ran count (the push-back and the retry write are scripts); the EVALSHA
    // lines themselves do not.
    let commands: Vec<(bool, Vec<String>)> = seen
        .iter()
        .filter(|s| {
            !s.words.is_empty()
                && !["evalsha", "eval"].contains(&s.words[0].to_lowercase().as_str())
        })
        .map(|s| (s.lua, s.words.clone()))
        .collect();
    shape(&commands, jid)
}

/// The payload the push-back wrote: the original, key for key and byte for byte, but `enqueued_at`.
fn assert_same_but_enqueued_at(original: &str, pushed: &str) {
    let a: serde_json::Map<String, Value> = serde_json::from_str(original).unwrap();
    let b: serde_json::Map<String, Value> = serde_json::from_str(pushed).unwrap();
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "{pushed}"
    );
    for (k, v) in &a {
        if k != "enqueued_at" {
            assert_eq!(&b[k], v, "{k} in {pushed}");
        }
    }
    let before = oxidekiq::job::timestamp_seconds(&a["enqueued_at"]).unwrap();
    let after = oxidekiq::job::timestamp_seconds(&b["enqueued_at"]).unwrap();
    assert!(after >= before, "{pushed}");
}

/// TERM mid-iteration: the job flushes twice and is pushed back with the same jid and payload, not
/// retried, counted as processed and failed; another process resumes at the cursor and completes,
/// with no item run twice; the commands match real 8.1.7's (`interrupt_resume.json`), and what
/// Sidekiq's `IterableJobQuery` reads from the hash (computed here with Ruby, as api.rb does) has the
/// recorded types.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn term_mid_iteration_pushes_back_and_another_process_resumes_at_the_cursor() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let jid = "0000000000000000000b0001";
    let n = 30;
    let original = walk_payload(jid, json!([n, {"sleep": 0.25}]));
    push(&mut c, &original);
    let monitor = Monitor::start(&redis);
    let first = launch(
        config(&redis.url(), &["default"], 2),
        registry(Walk::default()),
    )
    .await;
    // The first flush comes 5 s into the run.
    wait_for("the first flush", Duration::from_secs(30), || {
        c.exists::<_, bool>(format!("it-{jid}")).unwrap()
    })
    .await;
    first.send(Control::Stop);
    wait_for("the push-back", Duration::from_secs(30), || {
        c.llen::<_, i64>("queue:default").unwrap() == 1
    })
    .await;
    first.stop().await.unwrap();
    let interrupted = monitor.commands();
    let pushed: Vec<String> = list(&mut c, "queue:default");
    assert_same_but_enqueued_at(&original, &pushed[0]);
    let zcard = |c: &mut redis::Connection, k: &str| c.zcard::<_, i64>(k).unwrap();
    assert_eq!(zcard(&mut c, "retry"), 0, "an interrupt is no retry");
    let state: std::collections::HashMap<String, String> = c.hgetall(format!("it-{jid}")).unwrap();
    let cursor: u64 = state["c"].parse().unwrap();
    let rt: f64 = state["rt"].parse().unwrap();
    assert_eq!(state["ex"], "1");
    assert!(
        rt > 0.0,
        "the interrupt's flush carries the run's time: {state:?}"
    );
    let ttl: i64 = c.ttl(format!("it-{jid}")).unwrap();
    assert!(
        (2_591_900..=2_592_000).contains(&ttl),
        "EXPIRE 2592000 NX: {ttl}"
    );
    let ex1: Vec<u64> = seen(&mut c, jid).iter().map(|s| s.1).collect();
    assert_eq!(
        ex1,
        (0..cursor).collect::<Vec<_>>(),
        "the cursor is the next item"
    );

    // What Sidekiq 8's IterableJobQuery (api.rb 1406-1464) makes of the hash, computed in Ruby.
    let query = support::ruby(
        &format!(
            r#"h = Sidekiq.redis {{ |c| c.hgetall("it-{jid}") }}
puts JSON.generate({{"executions" => h["ex"].to_i, "runtime" => h["rt"].to_f,
  "cursor" => (JSON.parse(h["c"]) rescue h["c"]), "cancelled" => h["cancelled"]&.to_i}})"#
        ),
        &redis.url(),
    );
    let query: Value = serde_json::from_str(query.trimmed()).unwrap();
    let recorded = fixture_json(&format!("{REC}/interrupt_resume.json"))["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["step"] == "interrupted_by_term")
        .unwrap()["iterable_job_query"]
        .clone();
    assert_eq!(query["executions"], 1);
    assert_eq!(query["cursor"], json!(cursor));
    assert_eq!(query["runtime"].as_f64(), Some(rt));
    assert_eq!(query["cancelled"], Value::Null);
    for k in ["executions", "runtime", "cursor", "cancelled"] {
        assert_eq!(
            std::mem::discriminant(&query[k]),
            std::mem::discriminant(&recorded[k]),
            "{k}: {query} vs {recorded}"
        );
    }

    // Another process resumes at the cursor.
    let second = launch(
        config(&redis.url(), &["default"], 2),
        registry(Walk::default()),
    )
    .await;
    wait_for(
        "the resumed run to complete",
        Duration::from_secs(30),
        || {
            list(&mut c, &format!("rec-hooks-{jid}"))
                .last()
                .map(String::as_str)
                == Some("on_complete")
        },
    )
    .await;
    wait_for("the state hash removed", Duration::from_secs(10), || {
        !c.exists::<_, bool>(format!("it-{jid}")).unwrap()
    })
    .await;
    second.stop().await.unwrap();
    let all = monitor.commands();
    drop(monitor);

    let walked = seen(&mut c, jid);
    let items: Vec<u64> = walked.iter().map(|s| s.1).collect();
    assert_eq!(
        items,
        (0..n).collect::<Vec<_>>(),
        "each item once: {walked:?}"
    );
    assert!(
        walked.iter().all(|&(ex, i)| (ex == 1) == (i < cursor)),
        "{walked:?}"
    );
    assert_eq!(
        list(&mut c, &format!("rec-hooks-{jid}")),
        ["on_start", "on_stop", "on_resume", "on_stop", "on_complete"]
    );
    assert_eq!(c.llen::<_, i64>("queue:default").unwrap(), 0);
    assert_eq!(zcard(&mut c, "retry") + zcard(&mut c, "dead"), 0);
    wait_for("the stats flushed", Duration::from_secs(10), || {
        let p: Option<i64> = c.get("stat:processed").unwrap();
        let f: Option<i64> = c.get("stat:failed").unwrap();
        (p, f) == (Some(2), Some(1))
    })
    .await;

    // The commands, against 8.1.7's.
    let ours_first = live_shape(&interrupted, jid);
    let theirs_first = recorded_shape(
        "interrupt_resume",
        &[
            "first_flush",
            "progress",
            "next_flush",
            "interrupted_by_term",
        ],
    );
    assert_eq!(
        ours_first, theirs_first,
        "the first run, until the push-back"
    );
    let ours_all = live_shape(&all, jid);
    let theirs_all = recorded_shape(
        "interrupt_resume",
        &[
            "first_flush",
            "progress",
            "next_flush",
            "interrupted_by_term",
            "resumed_and_completed",
        ],
    );
    // The resumed run is 8.1.7's but for the flushes a longer rest may bring (its items take as
    // long as the first run's, and 8.1.7's resumed run happened to finish within 5 s).
    let without_resume_flushes = |s: &[String]| -> Vec<String> {
        s.iter()
            .filter(|t| !t.starts_with("flush ex=2"))
            .cloned()
            .collect()
    };
    assert_eq!(
        without_resume_flushes(&ours_all),
        without_resume_flushes(&theirs_all),
        "both runs"
    );
}

/// An item fails: the state is flushed with the failing item as the cursor, the job goes to the
/// retry set as any failure (`retry_count` 0, the hash kept), and the retry starts with that item
/// (`error_retry.json`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_item_flushes_and_the_retry_starts_with_it() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let jid = "0000000000000000000b0002";
    let n = 8;
    push(
        &mut c,
        &walk_payload(jid, json!([n, {"sleep": 0.05, "fail_at": 5}])),
    );
    let monitor = Monitor::start(&redis);
    let h = launch(
        config(&redis.url(), &["default"], 2),
        registry(Walk::default()),
    )
    .await;
    wait_for("the retry entry", Duration::from_secs(20), || {
        c.zcard::<_, i64>("retry").unwrap() == 1
    })
    .await;
    let failed = monitor.commands();
    let state: std::collections::HashMap<String, String> = c.hgetall(format!("it-{jid}")).unwrap();
    assert_eq!(
        (
            state["ex"].as_str(),
            state["c"].as_str(),
            state["rt"].as_str()
        ),
        ("1", "5", "0"),
        "the error's flush: this item, rt of earlier runs"
    );
    let entry: Vec<String> = c.zrange("retry", 0, -1).unwrap();
    let entry: Value = serde_json::from_str(&entry[0]).unwrap();
    assert_eq!(entry["jid"], jid);
    assert_eq!(entry["error_class"], "ArgumentError");
    assert_eq!(entry["retry_count"], 0);
    // The retry, now (as `RetrySet#find_job(jid).retry` does).
    let member: Vec<String> = c.zrange("retry", 0, -1).unwrap();
    let _: () = c.zrem("retry", &member[0]).unwrap();
    push(&mut c, &member[0]);
    wait_for("the retry to complete", Duration::from_secs(20), || {
        list(&mut c, &format!("rec-hooks-{jid}"))
            .last()
            .map(String::as_str)
            == Some("on_complete")
    })
    .await;
    h.stop().await.unwrap();
    let walked = seen(&mut c, jid);
    let expected: Vec<(u64, u64)> = (0..=5)
        .map(|i| (1, i))
        .chain((5..n).map(|i| (2, i)))
        .collect();
    assert_eq!(walked, expected);
    assert!(!c.exists::<_, bool>(format!("it-{jid}")).unwrap());
    // Up to the retry entry, 8.1.7's commands (its periodic flush and the error's both carry rt 0,
    // and fold into one; here no item took 5 s, so the error's is the only one).
    assert_eq!(
        live_shape(&failed, jid),
        recorded_shape("error_retry", &["failed"])
    );
}

/// `cancel!` as Ruby writes it (the three pipelined commands of `cancel_running.json`, sent here by
/// Ruby 6.4's redis client, which has no `cancel!`) ends a running Rust iteration at its next flush:
/// `on_cancel`, `on_stop`, `on_complete`, the hash removed, no retry, no failure counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_from_ruby_ends_a_running_iteration_as_done() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let jid = "0000000000000000000b0003";
    let n = 200;
    let h = launch(
        config(&redis.url(), &["default"], 2),
        registry(Walk::default()),
    )
    .await;
    push(&mut c, &walk_payload(jid, json!([n, {"sleep": 0.1}])));
    wait_for("two items", Duration::from_secs(20), || {
        seen(&mut c, jid).len() >= 2
    })
    .await;
    // The commands of `cancel_running.json`'s `cancel` step, in its order.
    let rec = fixture_json(&format!("{REC}/cancel_running.json"));
    let step = rec["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["step"] == "cancel")
        .unwrap();
    let names: Vec<String> = step["commands"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c[0] == "client" && c[1][1].as_str().unwrap().starts_with("it-"))
        .map(|c| c[1][0].as_str().unwrap().to_lowercase())
        // The recorder's own read of the result (IterableJobQuery) is no part of `cancel!`.
        .filter(|name| name != "hgetall")
        .collect();
    assert_eq!(names, ["hsetnx", "hget", "expire"]);
    let out = support::ruby(
        &format!(
            r#"key = "it-{jid}"
r = Sidekiq.redis do |c|
  c.pipelined do |p|
    p.hsetnx(key, "cancelled", Time.now.to_i)
    p.hget(key, "cancelled")
    p.call("expire", key, 2592000, "nx")
  end
end
puts r[1].to_i"#
        ),
        &redis.url(),
    );
    let at: i64 = out.trimmed().parse().unwrap();
    assert!((at - support::now() as i64).abs() < 60, "{at}");
    wait_for("the job to see the cancel", Duration::from_secs(20), || {
        list(&mut c, &format!("rec-hooks-{jid}"))
            .last()
            .map(String::as_str)
            == Some("on_complete")
    })
    .await;
    wait_for("the state hash removed", Duration::from_secs(10), || {
        !c.exists::<_, bool>(format!("it-{jid}")).unwrap()
    })
    .await;
    h.stop().await.unwrap();
    assert_eq!(
        list(&mut c, &format!("rec-hooks-{jid}")),
        ["on_start", "on_cancel", "on_stop", "on_complete"]
    );
    assert!(seen(&mut c, jid).len() < n, "it stopped early");
    assert_eq!(c.zcard::<_, i64>("retry").unwrap(), 0);
    assert_eq!(c.zcard::<_, i64>("dead").unwrap(), 0);
    assert_eq!(c.llen::<_, i64>("queue:default").unwrap(), 0);
    wait_for("the stats flushed", Duration::from_secs(10), || {
        c.get::<_, Option<i64>>("stat:processed").unwrap() == Some(1)
    })
    .await;
    assert_eq!(
        c.get::<_, Option<i64>>("stat:failed").unwrap().unwrap_or(0),
        0
    );
}

/// The Rust client's `cancel` writes what Ruby's `cancel!` writes and returns the first cancel's
/// time however often it is called; a job cancelled before it ran completes at once (8.1.7 fails it
/// with `TypeError` instead: `cancel_before_run.json`, a fault not reproduced).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_client_cancels_as_ruby_does_and_a_job_cancelled_before_it_ran_completes() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let jid = "0000000000000000000b0004";
    let client = Client::new(redis.async_conn().await);
    let first = client.cancel(jid).await.unwrap();
    let again = client.cancel(jid).await.unwrap();
    assert_eq!(first, again);
    let state: std::collections::HashMap<String, String> = c.hgetall(format!("it-{jid}")).unwrap();
    assert_eq!(state.keys().collect::<Vec<_>>(), ["cancelled"]);
    assert_eq!(state["cancelled"], first.to_string());
    let ttl: i64 = c.ttl(format!("it-{jid}")).unwrap();
    assert!((2_591_900..=2_592_000).contains(&ttl), "{ttl}");
    // What 8.1.7 left after its own cancel! of a job never run: the same field, the same TTL.
    let rec = fixture_json(&format!("{REC}/cancel_before_run.json"));
    let cancelled = rec["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|s| s["keys"].get(format!("it-{}", rec["jid"].as_str().unwrap())))
        .unwrap()
        .clone();
    assert_eq!(
        cancelled["fields"]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        ["cancelled"]
    );

    let h = launch(
        config(&redis.url(), &["default"], 2),
        registry(Walk::default()),
    )
    .await;
    push(&mut c, &walk_payload(jid, json!([5, {"sleep": 0.01}])));
    wait_for("the job to complete", Duration::from_secs(20), || {
        list(&mut c, &format!("rec-hooks-{jid}"))
            .last()
            .map(String::as_str)
            == Some("on_complete")
    })
    .await;
    h.stop().await.unwrap();
    assert!(seen(&mut c, jid).is_empty(), "no item ran");
    assert!(!c.exists::<_, bool>(format!("it-{jid}")).unwrap());
    assert_eq!(c.zcard::<_, i64>("retry").unwrap(), 0);
}

/// `max_iteration_runtime`: each run is interrupted at the first item boundary past it and pushed
/// back with the same jid, `ex` counting the runs; every item runs once (`max_iteration_runtime.json`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_iteration_runtime_splits_the_job_into_runs_without_repeating_an_item() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let jid = "0000000000000000000b0005";
    let n = 12;
    let walk = Walk {
        max_runtime: Some(Duration::from_millis(600)),
    };
    let h = launch(config(&redis.url(), &["default"], 2), registry(walk)).await;
    push(&mut c, &walk_payload(jid, json!([n, {"sleep": 0.2}])));
    wait_for("the job to complete", Duration::from_secs(30), || {
        list(&mut c, &format!("rec-hooks-{jid}"))
            .last()
            .map(String::as_str)
            == Some("on_complete")
    })
    .await;
    h.stop().await.unwrap();
    let walked = seen(&mut c, jid);
    let items: Vec<u64> = walked.iter().map(|s| s.1).collect();
    assert_eq!(items, (0..n).collect::<Vec<_>>(), "{walked:?}");
    let runs = walked.last().unwrap().0;
    assert!(runs >= 2, "{walked:?}");
    assert!(walked.windows(2).all(|w| w[0].0 <= w[1].0), "{walked:?}");
    // 8.1.7 walked its items the same way: each once, the runs in order.
    let rec = fixture_json(&format!("{REC}/max_iteration_runtime.json"));
    let theirs: Vec<(u64, u64)> = rec["steps"].as_array().unwrap().last().unwrap()["seen"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let (ex, item) = s
                .as_str()
                .unwrap()
                .trim_start_matches("ex")
                .split_once(':')
                .unwrap();
            (ex.parse().unwrap(), item.parse().unwrap())
        })
        .collect();
    let their_items: Vec<u64> = theirs.iter().map(|s| s.1).collect();
    assert_eq!(
        their_items,
        (0..their_items.len() as u64).collect::<Vec<_>>()
    );
    assert!(theirs.windows(2).all(|w| w[0].0 <= w[1].0) && theirs.last().unwrap().0 >= 2);
    assert_eq!(c.zcard::<_, i64>("retry").unwrap(), 0);
    assert!(!c.exists::<_, bool>(format!("it-{jid}")).unwrap());
}

/// `SleepJob(seconds)`: sleeps, then notes its jid in `slept`; a 1 s timeout.
#[derive(Debug)]
struct Sleeper;

impl Worker for Sleeper {
    const CLASS: &'static str = "SleepJob";
    type Args = (f64,);
    fn options(&self) -> WorkerOptions {
        WorkerOptions {
            timeout: Some(Duration::from_secs(1)),
            ..WorkerOptions::default()
        }
    }
    async fn perform(&self, ctx: &JobContext, (secs,): Self::Args) -> JobResult {
        tokio::time::sleep(Duration::from_secs_f64(secs)).await;
        note(ctx, "slept", ctx.jid().to_string()).await
    }
}

/// `BlockingSleepJob(seconds)`: sleeps on its thread; a 0.5 s timeout it cannot honour.
#[derive(Debug)]
struct BlockingSleeper;

impl BlockingWorker for BlockingSleeper {
    const CLASS: &'static str = "BlockingSleepJob";
    type Args = (f64,);
    fn options(&self) -> WorkerOptions {
        WorkerOptions {
            timeout: Some(Duration::from_millis(500)),
            ..WorkerOptions::default()
        }
    }
    fn perform(&self, ctx: &JobContext, (secs,): Self::Args) -> JobResult {
        std::thread::sleep(Duration::from_secs_f64(secs));
        let mut c = ctx.redis();
        tokio::runtime::Handle::current().block_on(async {
            redis::AsyncCommands::rpush::<_, _, i64>(&mut c, "blocking-done", ctx.jid()).await
        })?;
        Ok(())
    }
}

fn plain(class: &str, jid: &str, args: Value, extra: Value) -> String {
    let mut m = json!({"retry": true, "queue": "default", "class": class, "args": args, "jid": jid,
        "created_at": support::now(), "enqueued_at": support::now()});
    for (k, v) in extra.as_object().unwrap() {
        m[k] = v.clone();
    }
    m.to_string()
}

/// A job past its timeout (the worker's option, or the payload's `oxidekiq_timeout` over it) is
/// cancelled and lands in the retry set with `Oxidekiq::JobTimeout` while another job of the same
/// process completes; a blocking job past its timeout cannot be cancelled: it runs to its end and is
/// reported in `oxidekiq_jobs_past_timeout_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_past_their_timeout_are_retried_and_blocking_ones_reported() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let port = support::free_port();
    let cfg = oxidekiq::Config {
        http: Some(format!("127.0.0.1:{port}")),
        ..config(&redis.url(), &["default"], 4)
    };
    let h = launch(cfg, registry(Walk::default())).await;
    push(&mut c, &plain("SleepJob", "long", json!([60]), json!({})));
    // The payload's field is shorter than the worker's 1 s, and wins.
    push(
        &mut c,
        &plain(
            "SleepJob",
            "short-limit",
            json!([60]),
            json!({"oxidekiq_timeout": 0.3}),
        ),
    );
    // Past the worker's 1 s, within the payload's 5 s, which wins: it completes.
    push(
        &mut c,
        &plain(
            "SleepJob",
            "longer-limit",
            json!([1.5]),
            json!({"oxidekiq_timeout": 5}),
        ),
    );
    push(&mut c, &plain("SleepJob", "quick", json!([0.1]), json!({})));
    push(
        &mut c,
        &plain("BlockingSleepJob", "stuck", json!([2.0]), json!({})),
    );
    wait_for(
        "two timeouts in the retry set",
        Duration::from_secs(30),
        || c.zcard::<_, i64>("retry").unwrap() == 2,
    )
    .await;
    wait_for("the others done", Duration::from_secs(30), || {
        list(&mut c, "rec-slept-quick").len() == 1
            && list(&mut c, "rec-slept-longer-limit").len() == 1
            && list(&mut c, "blocking-done").len() == 1
    })
    .await;
    let (_, _, metrics) = support::http_get(port, "/metrics").unwrap();
    h.stop().await.unwrap();
    let retries: Vec<String> = c.zrange("retry", 0, -1).unwrap();
    let mut jids = Vec::new();
    for r in &retries {
        let v: Value = serde_json::from_str(r).unwrap();
        assert_eq!(v["error_class"], "Oxidekiq::JobTimeout", "{v}");
        assert_eq!(v["retry_count"], 0);
        jids.push(v["jid"].as_str().unwrap().to_string());
    }
    jids.sort();
    assert_eq!(jids, ["long", "short-limit"]);
    assert!(list(&mut c, "rec-slept-long").is_empty());
    let line = metrics
        .lines()
        .find(|l| l.starts_with("oxidekiq_jobs_past_timeout_total{"))
        .unwrap_or_else(|| panic!("{metrics}"));
    assert!(
        line.contains("BlockingSleepJob") && line.ends_with(" 1"),
        "{line}"
    );
    assert!(
        !metrics.contains("oxidekiq_jobs_past_timeout_total{class=\"SleepJob\"}"),
        "a cancelled job is not reported as stuck"
    );
}

/// `NapJob(seconds)`: notes its start in `napping`, sleeps (no timeout), then notes its jid in `slept`.
#[derive(Debug)]
struct Napper;

impl Worker for Napper {
    const CLASS: &'static str = "NapJob";
    type Args = (f64,);
    async fn perform(&self, ctx: &JobContext, (secs,): Self::Args) -> JobResult {
        note(ctx, "napping", ctx.jid().to_string()).await?;
        tokio::time::sleep(Duration::from_secs_f64(secs)).await;
        note(ctx, "slept", ctx.jid().to_string()).await
    }
}

/// A plain async job running in oxidekiq is reached by Sidekiq's `cancel!` (here the Rust client's,
/// which writes the same): the heartbeat's check sees the mark, the job is dropped at its await point,
/// acknowledged, not retried, not counted as failed, and the mark removed; another job runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_reaches_a_plain_running_job_at_its_next_beat() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let h = launch(
        config(&redis.url(), &["default"], 2),
        registry(Walk::default()),
    )
    .await;
    push(&mut c, &plain("NapJob", "nap", json!([60]), json!({})));
    push(
        &mut c,
        &plain("NapJob", "short-nap", json!([1.0]), json!({})),
    );
    wait_for("both running", Duration::from_secs(20), || {
        list(&mut c, "rec-napping-nap").len() == 1
            && list(&mut c, "rec-napping-short-nap").len() == 1
    })
    .await;
    let client = Client::new(redis.async_conn().await);
    client.cancel("nap").await.unwrap();
    wait_for(
        "the cancelled job acknowledged",
        Duration::from_secs(20),
        || !c.exists::<_, bool>("it-nap").unwrap(),
    )
    .await;
    wait_for("the other job done", Duration::from_secs(20), || {
        list(&mut c, "rec-slept-short-nap").len() == 1
    })
    .await;
    wait_for("the stats flushed", Duration::from_secs(10), || {
        c.get::<_, Option<i64>>("stat:processed").unwrap() == Some(2)
    })
    .await;
    h.stop().await.unwrap();
    assert!(list(&mut c, "rec-slept-nap").is_empty(), "it was stopped");
    assert_eq!(
        c.get::<_, Option<i64>>("stat:failed").unwrap().unwrap_or(0),
        0
    );
    assert_eq!(c.zcard::<_, i64>("retry").unwrap(), 0);
    assert_eq!(c.zcard::<_, i64>("dead").unwrap(), 0);
    assert_eq!(
        c.llen::<_, i64>("queue:default").unwrap(),
        0,
        "not pushed back either"
    );
}

/// A Rust process resumes what a real Sidekiq 8.1.7 process interrupted: the hash and the pushed-back
/// payload exactly as `interrupt_resume.json` recorded them after TERM; the Rust run counts itself as
/// run 2, starts with the recorded cursor's item, walks the rest once and removes the hash, as the
/// recorded 8.1.7 resume did (`resumed_and_completed`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_process_resumes_an_iteration_sidekiq_8_interrupted() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let rec = fixture_json(&format!("{REC}/interrupt_resume.json"));
    let jid = rec["jid"].as_str().unwrap();
    let steps = rec["steps"].as_array().unwrap();
    let at_term = &steps
        .iter()
        .find(|s| s["step"] == "interrupted_by_term")
        .unwrap()["keys"];
    let fields = at_term[format!("it-{jid}")]["fields"].as_object().unwrap();
    for (k, v) in fields {
        let _: () = c.hset(format!("it-{jid}"), k, v.as_str().unwrap()).unwrap();
    }
    let cursor: u64 = fields["c"].as_str().unwrap().parse().unwrap();
    let payload = at_term["queue:default"]["items"][0].as_str().unwrap();
    // The recording's jobs sleep 0.5 s an item; this run keeps the args (the job's own contract).
    push(&mut c, payload);
    // Ruby's `on_resume` counted run 2: the Rust twin's counter starts where 8.1.7's run 1 left it.
    let _: () = c.set(format!("rec-ex-{jid}"), 1).unwrap();
    let h = launch(
        config(&redis.url(), &["default"], 2),
        registry(Walk::default()),
    )
    .await;
    wait_for(
        "the resumed run to complete",
        Duration::from_secs(30),
        || {
            list(&mut c, &format!("rec-hooks-{jid}"))
                .last()
                .map(String::as_str)
                == Some("on_complete")
        },
    )
    .await;
    h.stop().await.unwrap();
    let n = rec["job_args"][0].as_u64().unwrap();
    let expected: Vec<(u64, u64)> = (cursor..n).map(|i| (2, i)).collect();
    assert_eq!(seen(&mut c, jid), expected);
    let recorded: Vec<String> = steps.last().unwrap()["seen"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .filter(|s| s.starts_with("ex2:"))
        .collect();
    assert_eq!(
        recorded,
        expected
            .iter()
            .map(|(ex, i)| format!("ex{ex}:{i}"))
            .collect::<Vec<_>>(),
        "8.1.7's own resume walked the same items"
    );
    assert_eq!(
        list(&mut c, &format!("rec-hooks-{jid}")),
        ["on_resume", "on_stop", "on_complete"]
    );
    assert!(!c.exists::<_, bool>(format!("it-{jid}")).unwrap());
    assert_eq!(c.llen::<_, i64>("queue:default").unwrap(), 0);
}

/// A job stopped by Sidekiq's `cancel!` or by its timeout still settles its until-executed lock, as
/// Ruby's `ensure` would: the cancelled job is done (lock released), the timed-out one with
/// `retry: false` is discarded (lock released). Before the cut moved inside the chain, both locks
/// stayed until their 600 s TTL (the middleware's settling code was dropped with the run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_or_timed_out_job_releases_its_until_executed_lock() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let h = launch(
        config(&redis.url(), &["default"], 2),
        registry(Walk::default()),
    )
    .await;
    let (cancel_key, timeout_key) = (
        "oxidekiq:lock:unique:NapJob:cancelled",
        "oxidekiq:lock:unique:NapJob:timed-out",
    );
    // As the Rust client's `push_unique` leaves them: the lock holds the jid.
    let _: () = c.set(cancel_key, "locked-nap").unwrap();
    let _: () = c.set(timeout_key, "locked-timeout").unwrap();
    push(
        &mut c,
        &plain(
            "NapJob",
            "locked-nap",
            json!([60]),
            json!({"unique_key": cancel_key, "unique_ttl": 600}),
        ),
    );
    push(
        &mut c,
        &plain(
            "NapJob",
            "locked-timeout",
            json!([60]),
            json!({"unique_key": timeout_key, "unique_ttl": 600, "oxidekiq_timeout": 0.5,
                "retry": false}),
        ),
    );
    wait_for("the cancelled job running", Duration::from_secs(20), || {
        list(&mut c, "rec-napping-locked-nap").len() == 1
    })
    .await;
    // Run by the job, not by the test: the run's lock value ends with the jid.
    let held: String = c.get(cancel_key).unwrap();
    assert!(held.ends_with(":locked-nap"), "{held}");
    let client = Client::new(redis.async_conn().await);
    client.cancel("locked-nap").await.unwrap();
    wait_for(
        "the cancelled job's lock released",
        Duration::from_secs(20),
        || !c.exists::<_, bool>(cancel_key).unwrap(),
    )
    .await;
    wait_for(
        "the timed-out job's lock released",
        Duration::from_secs(20),
        || !c.exists::<_, bool>(timeout_key).unwrap(),
    )
    .await;
    h.stop().await.unwrap();
    assert!(list(&mut c, "rec-slept-locked-nap").is_empty());
    assert!(list(&mut c, "rec-slept-locked-timeout").is_empty());
    assert_eq!(c.zcard::<_, i64>("retry").unwrap(), 0);
    assert_eq!(c.zcard::<_, i64>("dead").unwrap(), 0);
}

/// An `it-<jid>` key of the wrong type (a key of another app named so, or damaged) for one running
/// plain job must not blind the heartbeat's cancel check for the others: before, the pipelined
/// `HGET`s failed as a whole on its `WRONGTYPE`, every beat, and no running job could be cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_cancel_key_of_one_job_does_not_hide_the_cancel_of_another() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let _: () = c.set("it-damaged", "not a hash").unwrap();
    let h = launch(
        config(&redis.url(), &["default"], 2),
        registry(Walk::default()),
    )
    .await;
    push(&mut c, &plain("NapJob", "damaged", json!([60]), json!({})));
    push(
        &mut c,
        &plain("NapJob", "cancelled", json!([60]), json!({})),
    );
    wait_for("both running", Duration::from_secs(20), || {
        list(&mut c, "rec-napping-damaged").len() == 1
            && list(&mut c, "rec-napping-cancelled").len() == 1
    })
    .await;
    let client = Client::new(redis.async_conn().await);
    client.cancel("cancelled").await.unwrap();
    wait_for(
        "the cancelled job acknowledged",
        Duration::from_secs(20),
        || !c.exists::<_, bool>("it-cancelled").unwrap(),
    )
    .await;
    h.stop().await.unwrap();
    assert!(
        list(&mut c, "rec-slept-cancelled").is_empty(),
        "it was stopped"
    );
    let kind: String = redis::cmd("TYPE").arg("it-damaged").query(&mut c).unwrap();
    assert_eq!(kind, "string", "the key we do not own is left alone");
}

/// Under basic fetch (no working copy) a stop mid-iteration pushes the job back once, at its cursor, and
/// the next process resumes it there: the requeue is at least once there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_basic_fetch_a_stop_mid_iteration_pushes_back_and_the_next_run_resumes() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let jid = "0000000000000000000b0002";
    let n = 12;
    push(&mut c, &walk_payload(jid, json!([n, {"sleep": 0.2}])));
    let basic = |url: &str| oxidekiq::Config {
        fetch: oxidekiq::config::FetchMode::BASIC,
        ..config(url, &["default"], 2)
    };
    let first = launch(basic(&redis.url()), registry(Walk::default())).await;
    wait_for("three items", Duration::from_secs(30), || {
        seen(&mut c, jid).len() >= 3
    })
    .await;
    first.stop().await.unwrap();
    let queued: Vec<String> = c.lrange("queue:default", 0, -1).unwrap();
    assert_eq!(queued.len(), 1, "pushed back once: {queued:?}");
    let cursor: String = c.hget(format!("it-{jid}"), "c").unwrap();
    let walked = seen(&mut c, jid).len();
    let second = launch(basic(&redis.url()), registry(Walk::default())).await;
    wait_for("completed", Duration::from_secs(30), || {
        !c.exists::<_, bool>(format!("it-{jid}")).unwrap()
    })
    .await;
    second.stop().await.unwrap();
    let all = seen(&mut c, jid);
    let items: Vec<u64> = all.iter().map(|s| s.1).collect();
    let mut distinct = items.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct, (0..n).collect::<Vec<u64>>(), "{all:?}");
    // The second run starts at the flushed cursor: at most the item in progress repeats.
    assert_eq!(all[walked].1.to_string(), cursor, "{all:?}");
    assert!(items.len() <= n as usize + 1, "{all:?}");
    assert_eq!(c.llen::<_, i64>("queue:default").unwrap(), 0);
}
