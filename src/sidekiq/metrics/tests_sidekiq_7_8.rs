//! A first-class citizen of Sidekiq 7 and 8 installations: execution metrics in both versions' keys,
//! the timestamp format and the work hashes following the live fleet on every beat, and the per-version
//! retry rules — each compared with what real Sidekiq 7.3.9 and 8.1.7 wrote
//! (`fixtures/sidekiq-7-8/`, recorded by `fixtures/sidekiq-7-8/record.sh`).
//!
//! CI has only Debian's Sidekiq 6.4.1: these tests compare our writes with the recordings and read them
//! back with 6.4's Ruby and redis-rb. The one `#[ignore]`d test renders the real 7.3.9 and 8.1.7 Metrics
//! tabs and runs only locally (`fixtures/sidekiq-7-8/live_check.sh`).
use crate::test_support as support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use oxidekiq::error::JobResult;
use oxidekiq::fleet::Survey;
use oxidekiq::launcher::Handle;
use oxidekiq::metrics::{self, Metrics};
use oxidekiq::retry::{self, Failure, Plan};
use oxidekiq::{Job, JobContext, JobError, NoArgs, Registry, Worker};
use redis::Commands;
use serde_json::{Value, json};
use support::{config, fixture, fixture_json, launch};

const VERSIONS: [&str; 2] = ["7.3.9", "8.1.7"];

/// The `info` JSON of a real Sidekiq 7.3.9 server (recorded), with `version` set to `version` and a
/// new identity.
fn ruby_info(version: &str, identity: &str) -> String {
    let mut v = fixture_json("shared/sidekiq-7.3.9-server/heartbeat_info.json");
    v["version"] = json!(version);
    v["identity"] = json!(identity);
    v.to_string()
}

/// Every key in Redis as the recording script dumps it: type, TTL, hash fields or 26 u16 counters.
fn dump(c: &mut redis::Connection) -> BTreeMap<String, Value> {
    let keys: Vec<String> = c.keys("*").unwrap();
    keys.into_iter()
        .map(|k| {
            let ty: String = redis::cmd("TYPE").arg(&k).query(c).unwrap();
            let ttl: i64 = c.ttl(&k).unwrap();
            let mut e = json!({"type": ty, "ttl": ttl});
            if ty == "hash" {
                let h: BTreeMap<String, String> = c.hgetall(&k).unwrap();
                e["fields"] = json!(h);
            } else if ty == "string" {
                e["u16"] = json!(u16s(c, &k));
            }
            (k, e)
        })
        .collect()
}

/// `BITFIELD key GET u16 #0 … GET u16 #25`.
fn u16s(c: &mut redis::Connection, key: &str) -> Vec<u64> {
    let mut cmd = redis::cmd("BITFIELD");
    cmd.arg(key);
    for i in 0..metrics::BUCKETS {
        cmd.arg("GET").arg("u16").arg(format!("#{i}"));
    }
    cmd.query(c).unwrap()
}

#[test]
fn our_metrics_writes_have_the_keys_fields_ttls_and_buckets_sidekiq_7_and_8_wrote() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    for version in VERSIONS {
        let rec = fixture_json(&format!(
            "sidekiq-7-8/sidekiq-{version}-metrics/metrics.json"
        ));
        let _: () = redis::cmd("FLUSHDB").query(&mut c).unwrap();
        // The recorded jobs, timed as they slept, counted under `wrapped || class`.
        let m = Metrics::default();
        for j in rec["jobs"].as_array().unwrap() {
            let class = j["job"]["wrapped"]
                .as_str()
                .or(j["job"]["class"].as_str())
                .unwrap();
            let err = JobError::msg("boom");
            let ms = j["sleep_ms"].as_u64().unwrap();
            m.track(
                class,
                Duration::from_millis(ms),
                j["raises"].as_bool().unwrap().then_some(&err),
            );
        }
        let at: DateTime<Utc> = rec["flushed_at"].as_str().unwrap().parse().unwrap();
        let formats = metrics::Formats {
            v7: version.starts_with('7'),
            v8: version.starts_with('8'),
        };
        let mut pipe = redis::pipe();
        m.take().write(&mut pipe, at, formats);
        let _: () = pipe.query(&mut c).unwrap();

        let ours = dump(&mut c);
        let theirs = rec["keys"].as_object().unwrap();
        let names = |it: Vec<&String>| it.into_iter().cloned().collect::<BTreeSet<_>>();
        assert_eq!(
            names(ours.keys().collect()),
            names(theirs.keys().collect()),
            "{version}: key names"
        );
        for (key, want) in theirs {
            let got = &ours[key];
            assert_eq!(got["type"], want["type"], "{version} {key}: type");
            let ttl = |v: &Value| v["ttl"].as_i64().unwrap();
            assert!(
                (ttl(got) - ttl(want)).abs() <= 5,
                "{version} {key}: TTL {got} vs {want}"
            );
            if want["type"] == "hash" {
                let fields = |v: &Value| -> BTreeMap<String, i64> {
                    v["fields"]
                        .as_object()
                        .unwrap()
                        .iter()
                        .map(|(k, v)| (k.clone(), v.as_str().unwrap().parse().unwrap()))
                        .collect()
                };
                let (g, w) = (fields(got), fields(want));
                assert_eq!(
                    g.keys().collect::<Vec<_>>(),
                    w.keys().collect::<Vec<_>>(),
                    "{version} {key}: field names"
                );
                for (f, n) in &w {
                    if f.ends_with("|ms") {
                        // Ruby measured its sleeps; we were given them: a few ms apart at most.
                        assert!(
                            (g[f] - n).abs() <= 10,
                            "{version} {key} {f}: {} vs {n}",
                            g[f]
                        );
                    } else {
                        assert_eq!(g[f], *n, "{version} {key} {f}");
                    }
                }
            } else {
                // The same jobs fall into the same buckets of the same 26-bucket layout.
                assert_eq!(got["u16"], want["u16"], "{version} {key}: histogram");
            }
        }
    }
}

#[test]
fn retry_rules_and_timestamps_follow_the_fleet_as_sidekiq_7_3_9_and_8_1_7_do() {
    for version in VERSIONS {
        let rec = fixture_json(&format!("sidekiq-7-8/sidekiq-{version}-retry/retry.json"));
        let survey = Survey::classify([Some(ruby_info(version, "h:1:abc").as_str())]);
        let rules = survey.retry_rules();
        let tf = survey.time_format();
        for (name, s) in rec["scenarios"].as_object().unwrap() {
            let (set, member) = ["retry", "dead"]
                .iter()
                .find_map(|set| {
                    s["sets"][set]
                        .as_array()
                        .unwrap()
                        .first()
                        .map(|m| (*set, m[0].as_str().unwrap().to_string()))
                })
                .unwrap_or_else(|| panic!("{version} {name}: nothing recorded"));
            let ruby: serde_json::Map<String, Value> = serde_json::from_str(&member).unwrap();
            // Fail the same payload at the moment Ruby did (its `retried_at` or `failed_at`).
            let stamp = ruby.get("retried_at").unwrap_or(&ruby["failed_at"]);
            let now = oxidekiq::job::timestamp_seconds(stamp).unwrap();
            let job = Job::from_str(&s["payload"].to_string()).unwrap();
            let err = JobError::new("ArgumentError", "boom").with_backtrace(vec![]);
            let plan = retry::plan(
                &Failure {
                    job: &job,
                    queue: "default",
                    error: &err,
                    options: None,
                    now,
                    time_format: tf,
                    rules,
                },
                &mut rand::rng(),
            );
            let (our_set, payload) = match &plan {
                Plan::Retry { payload, .. } => ("retry", payload),
                Plan::Dead { payload } => ("dead", payload),
                p => panic!("{version} {name}: {p:?}"),
            };
            assert_eq!(our_set, set, "{version} {name}: where the job went");
            let ours: serde_json::Map<String, Value> = serde_json::from_str(payload).unwrap();
            let mut want: BTreeSet<&String> = ruby.keys().collect();
            if name == "empty_backtrace" {
                // Ruby stores a compressed `[]`; we store nothing (the UI would show an empty box).
                let lines = retry::decompress_backtrace(&ruby["error_backtrace"]).unwrap();
                assert!(lines.is_empty(), "{version}: {lines:?}");
                want.retain(|k| *k != "error_backtrace");
            }
            assert_eq!(
                ours.keys().collect::<BTreeSet<_>>(),
                want,
                "{version} {name}: fields"
            );
            for f in ["failed_at", "retried_at"] {
                if let (Some(a), Some(b)) = (ours.get(f), ruby.get(f)) {
                    // Float seconds for 7.x, integer milliseconds for 8.x, in the same shape as Ruby's.
                    assert_eq!(
                        a.is_u64() || a.is_i64(),
                        b.is_u64() || b.is_i64(),
                        "{version} {name} {f}: {a} vs {b}"
                    );
                }
            }
        }

        // Jitter: the values Ruby drew (retry_count 2 -> 3) and ours have the same step and range.
        let theirs: Vec<i64> = rec["jitter_retry_count_3"]
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.parse().unwrap())
            .collect();
        let job = Job::from_str(
            r#"{"class":"HardJob","args":[],"retry":true,"retry_count":2,"failed_at":1.0}"#,
        )
        .unwrap();
        let err = JobError::msg("boom");
        let ours: BTreeSet<i64> = (0..400)
            .map(|_| {
                match retry::plan(
                    &Failure {
                        job: &job,
                        queue: "default",
                        error: &err,
                        options: None,
                        now: 0.0,
                        time_format: tf,
                        rules,
                    },
                    &mut rand::rng(),
                ) {
                    Plan::Retry { at, .. } => at as i64 - 96,
                    p => panic!("{p:?}"),
                }
            })
            .collect();
        let gcd = |v: &mut dyn Iterator<Item = i64>| {
            v.fold(0, |a, b| {
                let (mut x, mut y) = (a, b);
                while y != 0 {
                    (x, y) = (y, x % y);
                }
                x
            })
        };
        let their_step = gcd(&mut theirs.iter().copied());
        let their_max = *theirs.iter().max().unwrap();
        assert_eq!(
            gcd(&mut ours.iter().copied()),
            their_step,
            "{version}: jitter step"
        );
        assert!(
            ours.iter().all(|j| (0..=their_max).contains(j)),
            "{version}: {ours:?} vs up to {their_max}"
        );
    }
}

// --- against a running launcher ------------------------------------------------------------------

/// Sleeps 5 ms; fails when told to.
#[derive(Debug)]
struct FastJob;
impl Worker for FastJob {
    const CLASS: &'static str = "FastJob";
    type Args = (bool,);
    async fn perform(&self, _ctx: &JobContext, (fail,): Self::Args) -> JobResult {
        tokio::time::sleep(Duration::from_millis(5)).await;
        if fail {
            return Err(JobError::new("ArgumentError", "asked to fail"));
        }
        Ok(())
    }
}

/// Sleeps 120 ms and records how long it took by its own clock (`slow_ms`).
#[derive(Debug)]
struct SlowJob;
impl Worker for SlowJob {
    const CLASS: &'static str = "SlowJob";
    type Args = NoArgs;
    async fn perform(&self, ctx: &JobContext, _: NoArgs) -> JobResult {
        let start = std::time::Instant::now();
        tokio::time::sleep(Duration::from_millis(120)).await;
        let ms = start.elapsed().as_millis() as u64;
        let _: () = redis::AsyncCommands::rpush(&mut ctx.redis(), "slow_ms", ms).await?;
        Ok(())
    }
}

/// Always fails.
#[derive(Debug)]
struct FailJob;
impl Worker for FailJob {
    const CLASS: &'static str = "FailJob";
    type Args = NoArgs;
    async fn perform(&self, _ctx: &JobContext, _: NoArgs) -> JobResult {
        Err(JobError::new("ArgumentError", "always fails"))
    }
}

/// Holds its slot until `release` is set, so it shows on the Busy page.
#[derive(Debug)]
struct HoldJob;
impl Worker for HoldJob {
    const CLASS: &'static str = "HoldJob";
    type Args = NoArgs;
    async fn perform(&self, ctx: &JobContext, _: NoArgs) -> JobResult {
        let mut c = ctx.redis();
        for _ in 0..1500 {
            let done: bool = redis::AsyncCommands::exists(&mut c, "release").await?;
            if done {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }
}

async fn start(url: &str) -> Handle {
    let mut r = Registry::new();
    r.register(FastJob)
        .register(SlowJob)
        .register(FailJob)
        .register(HoldJob);
    launch(config(url, &["default"], 5), r).await
}

async fn wait_for(what: &str, f: impl FnMut() -> bool) {
    support::wait_for(what, Duration::from_secs(30), f).await
}

/// Waits until our process has beaten twice more: at least one whole beat began after this call.
async fn one_full_beat(c: &mut redis::Connection, id: &str) {
    for _ in 0..2 {
        let before: Option<String> = c.hget(id, "beat").unwrap();
        wait_for("a heartbeat", || {
            c.hget::<_, _, Option<String>>(id, "beat").unwrap() != before
        })
        .await;
    }
}

/// Registers a Ruby process the way its heartbeat does (`SADD processes`, `HSET`, `EXPIRE 60`), with
/// the recorded 7.3.9 hash's fields and the given `info`.
fn register_ruby(c: &mut redis::Connection, identity: &str, info: &str) {
    let _: () = redis::pipe()
        .sadd("processes", identity)
        .hset_multiple(
            identity,
            &[
                ("info", info),
                ("busy", "0"),
                ("beat", &format!("{}", Utc::now().timestamp())),
                ("quiet", "false"),
                ("rss", "27232"),
                ("rtt_us", "46"),
            ],
        )
        .expire(identity, 60)
        .query(c)
        .unwrap();
}

/// The recorded heartbeat hash of a real Sidekiq 7.3.9 server (redis-cli's `HGETALL` output).
fn recorded_739_heartbeat() -> (String, Vec<(String, String)>) {
    let identity = fixture("shared/sidekiq-7.3.9-server/identity.txt")
        .trim()
        .to_string();
    let values: Vec<String> = fixture("shared/sidekiq-7.3.9-server/heartbeat_hash.txt")
        .lines()
        .filter_map(|l| l.split_once(") ").map(|(_, v)| v.trim().to_string()))
        .map(|v| {
            v.trim_matches('"')
                .replace("\\\"", "\"")
                .replace("\\\\", "\\")
        })
        .collect();
    let pairs = values
        .chunks(2)
        .map(|p| (p[0].clone(), p[1].clone()))
        .collect();
    (identity, pairs)
}

fn push(c: &mut redis::Connection, class: &str, args: Value) {
    let now = oxidekiq::time::float_value(oxidekiq::time::now());
    let payload = json!({"retry": true, "queue": "default", "class": class, "args": args,
        "jid": oxidekiq::job::new_jid(), "created_at": now, "enqueued_at": now});
    let _: () = redis::pipe()
        .sadd("queues", "default")
        .lpush("queue:default", payload.to_string())
        .query(c)
        .unwrap();
}

/// The newest retry-set member's `failed_at` text.
fn failed_at_of(c: &mut redis::Connection, class: &str) -> Option<String> {
    let members: Vec<String> = c.zrange("retry", 0, -1).unwrap();
    members.iter().find_map(|m| {
        let v: Value = serde_json::from_str(m).ok()?;
        (v["class"] == class).then(|| v["failed_at"].to_string())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_7x_process_joining_switches_new_timestamps_to_float_seconds_within_one_beat() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    // An all-8.x fleet: integer milliseconds, and no 6.4 `:workers` hash.
    register_ruby(
        &mut c,
        "web-1:100:8a8a8a8a8a8a",
        &ruby_info("8.1.7", "web-1:100:8a8a8a8a8a8a"),
    );
    let h = start(&redis.url()).await;
    let id = h.identity().to_string();
    one_full_beat(&mut c, &id).await;
    push(&mut c, "FailJob", json!([]));
    wait_for("the first retry", || {
        failed_at_of(&mut c, "FailJob").is_some()
    })
    .await;
    let ms = failed_at_of(&mut c, "FailJob").unwrap();
    assert!(
        ms.parse::<u64>().is_ok(),
        "all-8.x fleet: integer ms, got {ms}"
    );
    push(&mut c, "HoldJob", json!([]));
    wait_for("the running job on the Busy page", || {
        c.exists::<_, bool>(format!("{id}:work")).unwrap()
    })
    .await;
    assert!(
        !c.exists::<_, bool>(format!("{id}:workers")).unwrap(),
        "no 6.x reader alive"
    );

    // A real 7.3.9 server's heartbeat, exactly as recorded, joins.
    let (ruby_id, fields) = recorded_739_heartbeat();
    let _: () = redis::pipe()
        .sadd("processes", &ruby_id)
        .hset_multiple(&ruby_id, &fields)
        .expire(&ruby_id, 60)
        .query(&mut c)
        .unwrap();
    one_full_beat(&mut c, &id).await;
    let _: () = c.del("retry").unwrap();
    push(&mut c, "FailJob", json!([]));
    wait_for("the second retry", || {
        failed_at_of(&mut c, "FailJob").is_some()
    })
    .await;
    let secs = failed_at_of(&mut c, "FailJob").unwrap();
    assert!(
        secs.contains('.') && secs.parse::<f64>().unwrap() < 1e11,
        "a 7.x reader is alive: float seconds, got {secs}"
    );
    // Sidekiq 7.3.9 reads it as a time (its `Time.at(failed_at)`), not as year 58862.
    let out = support::ruby(
        r#"puts Time.at(JSON.parse(Sidekiq.redis { |c| c.zrange("retry", 0, -1) }.first)["failed_at"]).utc.year"#,
        &redis.url(),
    );
    assert_eq!(out.trimmed(), Utc::now().format("%Y").to_string());

    // A 6.4 process (no `version`, as 6.4.1 writes it) joins: the `:workers` hash comes back.
    let v64 = fixture("sidekiq-6.4.1-server/heartbeat_info.json");
    register_ruby(&mut c, "old:1:646464646464", v64.trim());
    one_full_beat(&mut c, &id).await;
    assert!(
        c.exists::<_, bool>(format!("{id}:workers")).unwrap(),
        "a 6.4 reader is alive"
    );
    let _: () = c.set("release", 1).unwrap();
    h.stop().await.unwrap();
}

/// Sums, with 6.4's Ruby and redis-rb, what each version's Metrics tab would read for the last few
/// minutes: its hash keys' fields and its histogram counters, by the key formats of `metrics/query.rb`
/// and `metrics/shared.rb` of 7.3.9 and 8.1.7.
const READ_METRICS_RB: &str = r###"
now = Time.now.utc
out = {}
Sidekiq.redis do |c|
  {
    "7" => [->(t) { "j|#{t.strftime("%Y%m%d")}|#{t.hour}:#{t.min}" }, ->(k, t) { "#{k}-#{t.strftime("%d-%H:%-M")}" }],
    "8" => [->(t) { t.strftime("j|%y%m%d|%-H:%M") }, ->(k, t) { "h|#{k}-#{t.strftime("%-d-%-H:%-M")}" }],
    "8-10min" => [->(t) { m = t.min; t.strftime("j|%y%m%d|%-H:#{m < 10 ? "0" : m.to_s[0]}") }, nil]
  }.each do |fmt, (hkey, gkey)|
    fields = Hash.new(0)
    grams = Hash.new { |h, k| h[k] = Array.new(26, 0) }
    times = fmt == "8-10min" ? [now, now - 600] : (0..5).map { |i| now - 60 * i }
    times.each do |t|
      c.hgetall(hkey.call(t)).each { |f, v| fields[f] += v.to_i }
      next unless gkey
      %w[FastJob SlowJob FailJob].each do |k|
        vals = c.bitfield(gkey.call(k, t), *(0..25).flat_map { |i| ["GET", "u16", "##{i}"] })
        vals.each_with_index { |v, i| grams[k][i] += v.to_i }
      end
    end
    out[fmt] = {"fields" => fields, "grams" => grams}
  end
end
puts JSON.generate(out)
"###;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_of_rust_jobs_read_back_with_each_versions_key_formats() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let h = start(&redis.url()).await;
    let id = h.identity().to_string();
    one_full_beat(&mut c, &id).await;
    // Nothing ran: no stats write at all (7.x and 8.x skip it; 6.4 would create the keys with 0).
    assert!(!c.exists::<_, bool>("stat:processed").unwrap());
    assert!(c.keys::<_, Vec<String>>("j|*").unwrap().is_empty());

    // Enqueued by Ruby, as a Rails app would.
    support::ruby(
        r#"
        3.times { Sidekiq::Client.push("class" => "FastJob", "args" => [false]) }
        Sidekiq::Client.push("class" => "FastJob", "args" => [true])
        2.times { Sidekiq::Client.push("class" => "SlowJob", "args" => []) }
        Sidekiq::Client.push("class" => "FailJob", "args" => [])
        "#,
        &redis.url(),
    );
    wait_for("7 jobs counted", || {
        c.get::<_, Option<i64>>("stat:processed").unwrap() == Some(7)
    })
    .await;
    h.stop().await.unwrap();
    let slow_ms: Vec<u64> = c.lrange("slow_ms", 0, -1).unwrap();

    let out = support::ruby(READ_METRICS_RB, &redis.url());
    let read: Value = serde_json::from_str(out.trimmed()).unwrap();
    for fmt in ["7", "8", "8-10min"] {
        let f = &read[fmt]["fields"];
        let n = |k: &str| f[k].as_i64().unwrap_or(0);
        assert_eq!((n("FastJob|p"), n("FastJob|f")), (4, 1), "{fmt}: {f}");
        assert_eq!((n("SlowJob|p"), n("SlowJob|f")), (2, 0), "{fmt}: {f}");
        assert_eq!((n("FailJob|p"), n("FailJob|f")), (1, 1), "{fmt}: {f}");
        assert!(
            f.get("FailJob|ms").is_none() && f.get("SlowJob|f").is_none(),
            "{fmt}: {f}"
        );
        // The time of the successful ones, at least what they measured themselves.
        assert!(
            n("SlowJob|ms") >= slow_ms.iter().sum::<u64>() as i64,
            "{fmt}: {f} {slow_ms:?}"
        );
        assert!(n("FastJob|ms") >= 15, "{fmt}: {f}");
        if fmt == "8-10min" {
            continue;
        }
        let grams = &read[fmt]["grams"];
        let gram = |k: &str| -> Vec<u64> {
            grams[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect()
        };
        // Each successful SlowJob in a bucket at least as slow as its own measurement.
        let slow = gram("SlowJob");
        assert_eq!(slow.iter().sum::<u64>(), 2, "{fmt}: {slow:?}");
        let fastest = slow_ms.iter().map(|ms| metrics::bucket(*ms)).min().unwrap();
        assert!(
            slow[..fastest].iter().all(|n| *n == 0),
            "{fmt}: {slow:?} {slow_ms:?}"
        );
        assert_eq!(gram("FastJob").iter().sum::<u64>(), 3, "{fmt}");
        assert_eq!(
            gram("FailJob").iter().sum::<u64>(),
            0,
            "{fmt}: failures are not timed"
        );
    }
}

/// Local only (`fixtures/sidekiq-7-8/live_check.sh`): the Metrics tab of real Sidekiq 7.3.9 and 8.1.7,
/// rendered in-process against a Redis where oxidekiq ran jobs, lists the Rust classes with their counts,
/// times and histogram (p50/p95 bucket).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Sidekiq 7.3.9 and 8.1.7 sources (fixtures/sidekiq-7-8/live_check.sh)"]
async fn live_metrics_tab_of_sidekiq_7_3_9_and_8_1_7_lists_the_rust_classes() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let h = start(&redis.url()).await;
    for _ in 0..3 {
        push(&mut c, "FastJob", json!([false]));
    }
    push(&mut c, "FastJob", json!([true]));
    for _ in 0..4 {
        push(&mut c, "SlowJob", json!([]));
    }
    push(&mut c, "FailJob", json!([]));
    wait_for("9 jobs counted", || {
        c.get::<_, Option<i64>>("stat:processed").unwrap() == Some(9)
    })
    .await;
    h.stop().await.unwrap();
    let mut slow_ms: Vec<u64> = c.lrange("slow_ms", 0, -1).unwrap();
    slow_ms.sort();

    let script = format!(
        "{}/fixtures/sidekiq-7-8/metrics_tab.rb",
        env!("CARGO_MANIFEST_DIR")
    );
    for (version, var) in [("7.3.9", "RUBY_739"), ("8.1.7", "RUBY_817")] {
        let args = std::env::var(var).unwrap_or_else(|_| panic!("{var}: run live_check.sh"));
        let out = std::process::Command::new("ruby")
            .args(args.split_whitespace())
            .arg(&script)
            .args(["FastJob", "SlowJob", "FailJob"])
            .env("REDIS_URL", redis.url())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let tab: Value = serde_json::from_slice(&out.stdout).unwrap();
        eprintln!("Sidekiq {version} Metrics tab: {tab}");
        assert_eq!(tab["version"], version);
        let row = |k: &str| &tab["rows"][k];
        assert_eq!(
            (
                row("FastJob")["success"].as_i64(),
                row("FastJob")["failure"].as_i64()
            ),
            (Some(3), Some(1))
        );
        assert_eq!(
            (
                row("SlowJob")["success"].as_i64(),
                row("SlowJob")["failure"].as_i64()
            ),
            (Some(4), Some(0))
        );
        assert_eq!(
            (
                row("FailJob")["success"].as_i64(),
                row("FailJob")["failure"].as_i64()
            ),
            (Some(0), Some(1))
        );
        // Total and average seconds as the UI rounds them (2 decimals), at least the jobs' own times.
        let total: f64 = slow_ms.iter().sum::<u64>() as f64 / 1000.0;
        let shown = row("SlowJob")["total_s"].as_f64().unwrap();
        assert!(
            shown >= total - 0.01 && shown < total + 0.2,
            "{shown} vs {total}"
        );
        let avg = row("SlowJob")["avg_s"].as_f64().unwrap();
        assert!(
            avg >= total / 4.0 - 0.01 && avg < total / 4.0 + 0.05,
            "{avg}"
        );
        // p50 and p95 from the job page's histogram: the buckets of the jobs' own times.
        let hist: Vec<u64> = tab["histograms"]["SlowJob"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        let pct = |p: f64| {
            let want = (p * hist.iter().sum::<u64>() as f64).ceil() as u64;
            let mut seen = 0;
            hist.iter().position(|n| {
                seen += n;
                seen >= want
            })
        };
        let ours = |p: f64| {
            metrics::bucket(slow_ms[((p * slow_ms.len() as f64).ceil() as usize).max(1) - 1])
        };
        assert_eq!(
            pct(0.5),
            Some(ours(0.5)),
            "{version} p50: {hist:?} {slow_ms:?}"
        );
        assert_eq!(
            pct(0.95),
            Some(ours(0.95)),
            "{version} p95: {hist:?} {slow_ms:?}"
        );
        // Failures are not timed: no histogram for a class that only failed.
        let fail_hist = &tab["histograms"]["FailJob"];
        assert!(
            fail_hist.is_null() || fail_hist.as_array().unwrap().iter().all(|v| v == 0),
            "{fail_hist}"
        );
    }
}

/// Local only (`fixtures/sidekiq-7-8/live_check.sh`): a real Sidekiq 7.3.9 server joins a fleet whose
/// only Ruby process is 8.x; within one beat our new timestamps are float seconds that 7.3.9 reads as
/// today; when it stops, they turn back to milliseconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Sidekiq 7.3.9 sources (fixtures/sidekiq-7-8/live_check.sh)"]
async fn live_a_real_7_3_9_server_joining_switches_timestamps_within_one_beat() {
    let args = std::env::var("RUBY_739").expect("RUBY_739: run live_check.sh");
    let sk78 = std::env::var("SK78").expect("SK78: run live_check.sh");
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    register_ruby(
        &mut c,
        "web-1:100:8a8a8a8a8a8a",
        &ruby_info("8.1.7", "web-1:100:8a8a8a8a8a8a"),
    );
    let h = start(&redis.url()).await;
    let id = h.identity().to_string();
    one_full_beat(&mut c, &id).await;
    push(&mut c, "FailJob", json!([]));
    wait_for("a retry", || failed_at_of(&mut c, "FailJob").is_some()).await;
    let before = failed_at_of(&mut c, "FailJob").unwrap();
    assert!(before.parse::<u64>().is_ok(), "8.x fleet: {before}");

    let dir = support::temp_dir("sidekiq739");
    std::fs::write(
        dir.join("jobs.rb"),
        "class RubyOnlyJob\n  include Sidekiq::Job\n  def perform; end\nend\n",
    )
    .unwrap();
    let bin = format!("{sk78}/sidekiq-7.3.9/bin/sidekiq");
    let mut sargs: Vec<&str> = args.split_whitespace().collect();
    sargs.extend([bin.as_str(), "-r", "./jobs.rb", "-q", "rubyonly", "-c", "2"]);
    let mut ruby7 = support::LoggedProcess::spawn_in(
        dir,
        "sidekiq739",
        std::path::Path::new("ruby"),
        &sargs,
        &[("REDIS_URL", redis.url().as_str())],
    );
    let ruby_version = |c: &mut redis::Connection| -> bool {
        let ids: Vec<String> = c.smembers("processes").unwrap();
        ids.iter().any(|i| {
            c.hget::<_, _, Option<String>>(i, "info")
                .unwrap()
                .is_some_and(|s| s.contains("\"version\":\"7.3.9\""))
        })
    };
    wait_for("the 7.3.9 server's heartbeat", || ruby_version(&mut c)).await;
    one_full_beat(&mut c, &id).await;
    let _: () = c.del("retry").unwrap();
    push(&mut c, "FailJob", json!([]));
    wait_for("a retry", || failed_at_of(&mut c, "FailJob").is_some()).await;
    let during = failed_at_of(&mut c, "FailJob").unwrap();
    assert!(during.contains('.'), "7.3.9 alive: {during}");
    // What 7.3.9's own API and retry page make of it.
    let script = r#"
      require "sidekiq/api"; require "sidekiq/web"; require "rack/session/cookie"
      Sidekiq.logger.level = Logger::WARN
      Sidekiq.configure_client { |c| c.redis = {url: ENV.fetch("REDIS_URL")} }
      r = Sidekiq::RetrySet.new.first
      app = Rack::Builder.new { use Rack::Session::Cookie, secret: "x" * 64; run Sidekiq::Web }
      page = Rack::MockRequest.new(app).get("/retries/#{r.score}-#{r.jid}")
      # The years of the page's <time datetime="..."> tags ("Originally Failed", "Last Retry", ...).
      years = page.body.scan(/datetime="(\d+)-/).flatten.uniq
      puts [Time.at(r["failed_at"]).utc.year, page.status, years.join(",")].join(" ")
    "#;
    let out = std::process::Command::new("ruby")
        .args(args.split_whitespace())
        .args(["-rsidekiq", "-e", script])
        .env("REDIS_URL", redis.url())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("7.3.9 reads our failed_at {during} as: {text}");
    let year = Utc::now().format("%Y");
    assert_eq!(
        text.trim(),
        format!("{year} 200 {year}"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    ruby7.signal("TERM");
    assert!(
        ruby7.wait_exit(Duration::from_secs(30)).is_some(),
        "{}",
        ruby7.log()
    );
    wait_for("7.3.9 gone", || !ruby_version(&mut c)).await;
    one_full_beat(&mut c, &id).await;
    let _: () = c.del("retry").unwrap();
    push(&mut c, "FailJob", json!([]));
    wait_for("a retry", || failed_at_of(&mut c, "FailJob").is_some()).await;
    let after = failed_at_of(&mut c, "FailJob").unwrap();
    assert!(after.parse::<u64>().is_ok(), "8.x fleet again: {after}");
    h.stop().await.unwrap();
}
