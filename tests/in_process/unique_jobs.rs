//! sidekiq-unique-jobs jobs run by oxidekiq leave the gem's keys as the real gem's server does
//! (issue 29). Each case seeds a real redis-server with a recording's state before a server step
//! (`fixtures/unique-jobs-7.1`, `-8.0`, `-8.x`, made from the real gem by
//! `fixtures/unique-jobs/record.sh`), runs the job through an in-process launcher following that
//! release's rules, and compares the keys after with the recording's: every `uniquejobs:*` key, and
//! the `dead` and `schedule` sets (type, TTL to the second, value), with only what the recordings mask
//! normalised (times, drawn jids). Cases: each lock type × success, failure; `while_executing` and
//! `until_and_while_executing` × the server conflict strategies; the keys seen during the perform.
use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use oxidekiq::config::UniqueJobsGem;
use oxidekiq::{JobContext, JobError, JobResult, Registry, Worker};
use redis::AsyncCommands;
use serde_json::{Map, Value, json};
use support::RedisServer;

const VERSIONS: [(&str, UniqueJobsGem); 3] = [
    ("unique-jobs-7.1", UniqueJobsGem::V7_1),
    ("unique-jobs-8.0", UniqueJobsGem::V8_0),
    ("unique-jobs-8.x", UniqueJobsGem::V8_1),
];

/// The recorded job classes: args `[1, "a"]`; a case that must fail rewrites the first arg to 2 (the
/// digest comes from the payload's `lock_digest`, never from the args). Each perform notes its jid in
/// `test:performed` and the gem's key names it sees in `test:during:<jid>`.
macro_rules! recorded_worker {
    ($name:ident, $class:literal) => {
        #[derive(Debug)]
        struct $name;
        impl Worker for $name {
            const CLASS: &'static str = $class;
            type Args = (i64, String);
            async fn perform(&self, ctx: &JobContext, (n, _): Self::Args) -> JobResult {
                let mut c = ctx.redis();
                let keys: Vec<String> = c.keys("uniquejobs:*").await?;
                let during = format!("test:during:{}", ctx.jid());
                for k in keys {
                    let _: () = c.sadd(&during, k).await?;
                }
                let _: () = c.rpush("test:performed", ctx.jid()).await?;
                if n == 2 {
                    return Err(JobError::new("ArgumentError", "perform failed"));
                }
                // Runs until the test lets it go (`test:release`), at most 20 s.
                for _ in 0..if n == 3 { 400 } else { 0 } {
                    if c.exists("test:release").await? {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Ok(())
            }
        }
    };
}
recorded_worker!(UntilExecuting, "UntilExecutingJob");
recorded_worker!(UntilExecuted, "UntilExecutedJob");
recorded_worker!(WhileExecuting, "WhileExecutingJob");
recorded_worker!(UntilAndWhileExecuting, "UntilAndWhileExecutingJob");
recorded_worker!(UntilExpired, "UntilExpiredJob");
recorded_worker!(UntilExecutedTtl, "UntilExecutedTtlJob");

fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(UntilExecuting);
    r.register(UntilExecuted);
    r.register(WhileExecuting);
    r.register(UntilAndWhileExecuting);
    r.register(UntilExpired);
    r.register(UntilExecutedTtl);
    r
}

/// A recording: `fixtures/<path>`, or `$UNIQUE_JOBS_FIXTURES/<path>` when set (fresh recordings of the
/// real gem made in the same run by `fixtures/unique-jobs/compare.sh`, the side-by-side check).
fn recording(path: &str) -> Value {
    match std::env::var("UNIQUE_JOBS_FIXTURES") {
        Ok(dir) => {
            let p = format!("{dir}/{path}");
            let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p}: {e}"));
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{p}: {e}"))
        }
        Err(_) => support::fixture_json(path),
    }
}

// ------------------------------------------------------------------ masking, as record.rb masks

fn is_epoch(v: f64) -> bool {
    (1_577_836_800.0..4_102_444_800.0).contains(&v)
}

fn mask_scalar(v: &Value) -> Value {
    match v {
        Value::Number(n) => {
            if let Some(i) = n.as_i64()
                && (1_577_836_800_000..4_102_444_800_000).contains(&i)
            {
                return json!("<epoch_ms>");
            }
            match n.as_f64() {
                Some(f) if is_epoch(f) => json!("<epoch>"),
                _ => v.clone(),
            }
        }
        Value::String(s) => {
            let digits = s.split('.').next().unwrap_or("");
            if digits.len() == 10
                && digits.bytes().all(|b| b.is_ascii_digit())
                && s.parse::<f64>().is_ok_and(is_epoch)
            {
                return json!("<epoch>");
            }
            if digits.len() == 13
                && s.parse::<f64>().is_ok()
                && s.bytes().all(|b| b.is_ascii_digit() || b == b'.')
            {
                return json!("<epoch_ms>");
            }
            if s.len() == 24
                && s.bytes().all(|b| b.is_ascii_hexdigit())
                && !s.starts_with("00000000000000000abc")
            {
                return json!("<jid>");
            }
            v.clone()
        }
        _ => v.clone(),
    }
}

fn mask(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(m.iter().map(|(k, x)| (k.clone(), mask(x))).collect()),
        Value::Array(a) => Value::Array(a.iter().map(mask).collect()),
        Value::String(s) if s.starts_with('{') || s.starts_with('[') => {
            match serde_json::from_str::<Value>(s) {
                Ok(parsed) => json!({ "json": mask(&parsed) }),
                Err(_) => mask_scalar(v),
            }
        }
        _ => mask_scalar(v),
    }
}

/// The inverse for seeding: masked times become `now`, `{"json": …}` becomes its text.
fn unmask(v: &Value, now: f64) -> Value {
    match v {
        Value::String(s) if s == "<epoch>" => json!(now),
        Value::String(s) if s == "<epoch_ms>" => json!((now * 1000.0) as i64),
        Value::String(s) if s == "<jid>" => json!("feedfacefeedfacefeedface"),
        Value::Object(m) if m.len() == 1 && m.contains_key("json") => {
            Value::String(unmask(&m["json"], now).to_string())
        }
        Value::Object(m) => {
            Value::Object(m.iter().map(|(k, x)| (k.clone(), unmask(x, now))).collect())
        }
        Value::Array(a) => Value::Array(a.iter().map(|x| unmask(x, now)).collect()),
        _ => v.clone(),
    }
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

// ------------------------------------------------------------------ seeding and snapshots

/// Writes a recording's `keys_after` into an empty Redis, times set to now. `args` replaces the args
/// of the payloads in `queue:default` (a failing case).
async fn seed(c: &mut oxidekiq::worker::Conn, keys: &Map<String, Value>, args: Option<Value>) {
    let now = support::now();
    // The queue last: the running launcher takes the job at once, and the lock keys must be there.
    let mut ordered: Vec<(&String, &Value)> =
        keys.iter().filter(|(k, _)| *k != "queue:default").collect();
    ordered.extend(keys.iter().filter(|(k, _)| *k == "queue:default"));
    for (key, entry) in ordered {
        let value = unmask(&entry["value"], now);
        match entry["type"].as_str().unwrap() {
            "string" => {
                let _: () = c.set(key, text(&value)).await.unwrap();
            }
            "list" => {
                for item in value.as_array().unwrap() {
                    let mut item = text(item);
                    if key == "queue:default"
                        && let Some(args) = &args
                    {
                        let mut m: Map<String, Value> = serde_json::from_str(&item).unwrap();
                        m.insert("args".into(), args.clone());
                        item = Value::Object(m).to_string();
                    }
                    let _: () = c.rpush(key, item).await.unwrap();
                }
            }
            "set" => {
                for item in value.as_array().unwrap() {
                    let _: () = c.sadd(key, text(item)).await.unwrap();
                }
            }
            "zset" => {
                for pair in value.as_array().unwrap() {
                    let score = pair[1].as_f64().unwrap();
                    let _: () = c.zadd(key, text(&pair[0]), score).await.unwrap();
                }
            }
            "hash" => {
                for (f, x) in value.as_object().unwrap() {
                    let _: () = c.hset(key, f, text(x)).await.unwrap();
                }
            }
            other => panic!("{key}: type {other}"),
        }
        if let Some(ttl) = entry.get("ttl_seconds_ceil").and_then(Value::as_i64) {
            let _: () = c.pexpire(key, ttl * 1000).await.unwrap();
        }
    }
}

/// The `reschedule` strategy's new job carries the class's `sidekiq_options`, which Ruby reads from
/// the class and oxidekiq cannot see: it copies the job's own (`on_conflict` included, as a class
/// declaring `on_conflict: :reschedule` has it). The recorder set `on_conflict` on the pushed job
/// only, so the recorded new job lacks it: the one field left out of a scheduled job's comparison.
///
/// And 8.1's new job has no lock fields (its client skips a rescheduled job; its server computes the
/// digest again at the run): oxidekiq keeps them, as it never computes a digest and the new job must
/// still run under its lock. Left out of the comparison where the recording has none.
fn without_per_push_options(keys: &mut Map<String, Value>, want: &Map<String, Value>) {
    let recorded_lock_fields = want
        .get("schedule")
        .and_then(|e| e["value"].as_array())
        .is_none_or(|pairs| {
            pairs
                .iter()
                .any(|p| p[0]["json"].get("lock_digest").is_some())
        });
    if let Some(pairs) = keys
        .get_mut("schedule")
        .and_then(|e| e["value"].as_array_mut())
    {
        for pair in pairs {
            if let Some(job) = pair[0]["json"].as_object_mut() {
                job.remove("on_conflict");
                if !recorded_lock_fields {
                    for k in [
                        "lock_timeout",
                        "lock_ttl",
                        "lock_prefix",
                        "lock_args",
                        "lock_digest",
                    ] {
                        job.remove(k);
                    }
                }
            }
        }
    }
}

/// Whether a key is compared: the gem's keys and the sets its strategies write.
fn compared(key: &str) -> bool {
    key.starts_with("uniquejobs:") || key == "dead" || key == "schedule"
}

/// The compared keys as record.rb renders them; sorted sets by member (equal times would otherwise
/// order by the member's text, which differs run to run).
/// `v` as text with every object's keys sorted: the order a sorted set's entries are compared in. A
/// changelog entry's keys come in the order the server's Lua `cjson.encode` walks its table, which is
/// not the same on Valkey 9.1 as on Redis 7.0 (the recordings'), though the entries are equal.
fn canonical(v: &Value) -> String {
    fn sorted(v: &Value) -> Value {
        match v {
            Value::Object(m) => {
                let keys: BTreeMap<&String, Value> =
                    m.iter().map(|(k, x)| (k, sorted(x))).collect();
                Value::Object(keys.into_iter().map(|(k, x)| (k.clone(), x)).collect())
            }
            Value::Array(a) => Value::Array(a.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    sorted(v).to_string()
}

async fn snapshot(c: &mut oxidekiq::worker::Conn) -> Map<String, Value> {
    let mut names: Vec<String> = c.keys("*").await.unwrap();
    names.retain(|k| compared(k));
    names.sort();
    let mut out = Map::new();
    for key in names {
        let kind: String = redis::cmd("TYPE").arg(&key).query_async(c).await.unwrap();
        let value = match kind.as_str() {
            // Gone since KEYS (a TTL ran out, the job moved on): as if it was never listed.
            "none" => continue,
            "string" => match c.get::<_, Option<String>>(&key).await.unwrap() {
                Some(v) => mask(&json!(v)),
                None => continue,
            },
            "list" => json!(
                c.lrange::<_, Vec<String>>(&key, 0, -1)
                    .await
                    .unwrap()
                    .iter()
                    .map(|x| mask(&json!(x)))
                    .collect::<Vec<_>>()
            ),
            "set" => {
                let mut m: Vec<String> = c.smembers(&key).await.unwrap();
                m.sort();
                json!(m.iter().map(|x| mask(&json!(x))).collect::<Vec<_>>())
            }
            "zset" => {
                let pairs: Vec<(String, f64)> = c.zrange_withscores(&key, 0, -1).await.unwrap();
                let mut v: Vec<Value> = pairs
                    .iter()
                    .map(|(m, s)| json!([mask(&json!(m)), mask(&json!(s))]))
                    .collect();
                v.sort_by_key(canonical);
                json!(v)
            }
            "hash" => {
                let h: std::collections::BTreeMap<String, String> = c.hgetall(&key).await.unwrap();
                Value::Object(
                    h.iter()
                        .map(|(f, x)| (text(&mask_scalar(&json!(f))), mask(&json!(x))))
                        .collect(),
                )
            }
            other => json!(format!("<{other}>")),
        };
        let pttl: i64 = c.pttl(&key).await.unwrap();
        let mut entry = Map::new();
        entry.insert("type".into(), json!(kind));
        if pttl == -1 {
            entry.insert("ttl".into(), json!("none"));
        } else {
            entry.insert("ttl".into(), json!("has TTL"));
            entry.insert("ttl_seconds_ceil".into(), json!((pttl + 999) / 1000));
        }
        entry.insert("value".into(), value);
        out.insert(key, Value::Object(entry));
    }
    out
}

/// A recording's `keys_after`, restricted and ordered as [`snapshot`] renders.
fn expected(keys: &Map<String, Value>) -> Map<String, Value> {
    keys.iter()
        .filter(|(k, _)| compared(k))
        .map(|(k, v)| {
            let mut v = v.clone();
            if v["type"] == "zset" {
                let mut pairs = v["value"].as_array().unwrap().clone();
                pairs.sort_by_key(canonical);
                v["value"] = json!(pairs);
            }
            (k.clone(), v)
        })
        .collect()
}

/// Differences between the expected and the actual keys (TTLs may be a second lower here: the
/// snapshot comes a moment after the step).
fn differences(want: &Map<String, Value>, got: &Map<String, Value>) -> Vec<String> {
    let mut out = Vec::new();
    let names: BTreeSet<&String> = want.keys().chain(got.keys()).collect();
    for k in names {
        match (want.get(k), got.get(k)) {
            (Some(w), Some(g)) => {
                let (mut w, mut g) = (w.clone(), g.clone());
                let (wt, gt) = (
                    w["ttl_seconds_ceil"].as_i64(),
                    g["ttl_seconds_ceil"].as_i64(),
                );
                if let (Some(wt), Some(gt)) = (wt, gt)
                    && gt <= wt
                    && gt >= wt - 1
                {
                    w["ttl_seconds_ceil"] = json!(0);
                    g["ttl_seconds_ceil"] = json!(0);
                }
                if w != g {
                    out.push(format!("{k}:\n  recorded {w}\n  oxidekiq {g}"));
                }
            }
            (Some(w), None) => out.push(format!("{k}: recorded {w}, missing here")),
            (None, Some(g)) => out.push(format!("{k}: not recorded, here {g}")),
            (None, None) => {}
        }
    }
    out
}

fn phase<'a>(doc: &'a Value, name: &str, nth: usize) -> &'a Value {
    doc["phases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["name"] == name)
        .nth(nth)
        .unwrap_or_else(|| panic!("no phase {name} #{nth}"))
}

/// One case: seed `before`, run oxidekiq following `gem` until the keys equal `after` (or 15 s),
/// and answer the differences left, and the jids performed.
async fn replay(
    redis: &RedisServer,
    gem: UniqueJobsGem,
    before: &Value,
    after: &Value,
    args: Option<Value>,
) -> (Vec<String>, Vec<String>, Vec<String>) {
    replay_with(redis, Some(gem), &[], before, after, args).await
}

/// [`replay`] with the release left to detection (`None`) and Ruby processes of the given Sidekiq
/// versions in `processes`.
async fn replay_with(
    redis: &RedisServer,
    gem: Option<UniqueJobsGem>,
    ruby_versions: &[&str],
    before: &Value,
    after: &Value,
    args: Option<Value>,
) -> (Vec<String>, Vec<String>, Vec<String>) {
    let mut c = redis.async_conn().await;
    let _: () = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();
    for (i, v) in ruby_versions.iter().enumerate() {
        let id = format!("ruby-host:{i}:abc");
        let _: () = c.sadd("processes", &id).await.unwrap();
        let info = json!({"hostname": "ruby-host", "version": v}).to_string();
        let _: () = c.hset(&id, "info", info).await.unwrap();
    }
    let want = expected(after["keys_after"].as_object().unwrap());
    let config = oxidekiq::config::Config {
        unique_jobs_gem: gem,
        ..support::config(&redis.url(), &["default"], 2)
    };
    // Started first, so the job runs as soon as it is seeded: the recordings hold keys with a 1 s TTL
    // (`:PRIMED` after a 7.1/8.0 lock) that the gem's next step found still there.
    let handle = support::launch(config, registry()).await;
    seed(&mut c, before["keys_after"].as_object().unwrap(), args).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let mut diff;
    loop {
        // The job is done when it is in no list: not queued, not in a landing list (a blocking fetch
        // takes a job there the moment it is pushed, before a batch list holds it), not in a batch
        // list; one MULTI, so it cannot be read between two of them. The queue alone read as done a
        // job still in a landing list, and in the cases whose keys end as they began the stop then
        // pushed it back unrun.
        let idle = support::nothing_in_flight(&mut c, "default").await;
        let mut got = snapshot(&mut c).await;
        without_per_push_options(&mut got, &want);
        diff = differences(&want, &got);
        if (idle && diff.is_empty()) || tokio::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    handle.stop().await.unwrap();
    let performed: Vec<String> = c.lrange("test:performed", 0, -1).await.unwrap();
    let mut during = Vec::new();
    if let Some(jid) = performed.first() {
        during = c.smembers(format!("test:during:{jid}")).await.unwrap();
        during.sort();
    }
    (diff, performed, during)
}

/// The names of the gem's keys a recording saw during the perform.
fn during_names(run: &Value) -> Vec<String> {
    let mut v: Vec<String> = run["keys_during_perform"]
        .as_object()
        .map(|m| {
            m.keys()
                .filter(|k| k.starts_with("uniquejobs:"))
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

const RUN_CASES: [&str; 6] = [
    "until_executing",
    "until_executed",
    "while_executing",
    "until_and_while_executing",
    "until_expired",
    "until_executed_ttl",
];

async fn success_and_failure(folder: &str, gem: UniqueJobsGem) {
    let redis = RedisServer::start();
    let mut failures = Vec::new();
    for lock in RUN_CASES {
        for step in ["success", "failure"] {
            let doc = recording(&format!("{folder}/{lock}.{step}.json"));
            let (push, run) = (phase(&doc, "push", 0), phase(&doc, "run", 0));
            let args = (step == "failure").then(|| json!([2, "a"]));
            let (diff, performed, during) = replay(&redis, gem, push, run, args).await;
            if !diff.is_empty() {
                failures.push(format!("{folder}/{lock}.{step}:\n{}", diff.join("\n")));
            }
            if performed.len() != 1 {
                failures.push(format!(
                    "{folder}/{lock}.{step}: performed {performed:?}, want once"
                ));
            }
            if during != during_names(run) {
                failures.push(format!(
                    "{folder}/{lock}.{step}: keys during perform {during:?}, recorded {:?}",
                    during_names(run)
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

async fn server_conflicts(folder: &str, gem: UniqueJobsGem) {
    let redis = RedisServer::start();
    let mut failures = Vec::new();
    for lock in ["while_executing", "until_and_while_executing"] {
        for strategy in ["log", "reject", "reschedule", "raise"] {
            let doc = recording(&format!("{folder}/{lock}.conflict_server_{strategy}.json"));
            // The second push: the first job holds the runtime lock, the second waits in its queue.
            let (push, second) = (phase(&doc, "push", 1), phase(&doc, "second_run", 0));
            let (diff, performed, _) = replay(&redis, gem, push, second, None).await;
            if !diff.is_empty() {
                failures.push(format!(
                    "{folder}/{lock}.conflict_server_{strategy}:\n{}",
                    diff.join("\n")
                ));
            }
            if !performed.is_empty() {
                failures.push(format!(
                    "{folder}/{lock}.conflict_server_{strategy}: performed {performed:?}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_lock_type_leaves_the_keys_of_gem_7_1_after_success_and_failure() {
    success_and_failure(VERSIONS[0].0, VERSIONS[0].1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_lock_type_leaves_the_keys_of_gem_8_0_after_success_and_failure() {
    success_and_failure(VERSIONS[1].0, VERSIONS[1].1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_lock_type_leaves_the_keys_of_gem_8_1_after_success_and_failure() {
    success_and_failure(VERSIONS[2].0, VERSIONS[2].1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_lock_conflicts_follow_on_conflict_as_gem_7_1_does() {
    server_conflicts(VERSIONS[0].0, VERSIONS[0].1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_lock_conflicts_follow_on_conflict_as_gem_8_0_does() {
    server_conflicts(VERSIONS[1].0, VERSIONS[1].1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_lock_conflicts_follow_on_conflict_as_gem_8_1_does() {
    server_conflicts(VERSIONS[2].0, VERSIONS[2].1).await;
}

/// The gem's reaper (`reaper.ruby.json`, every release) keeps a digest that a running job names: it
/// reads each member of `processes` that EXISTS, then `HGETALL <identity>:work`, and each entry's
/// `payload` (a JSON string) `lock_digest`. A Rust job running beside Sidekiq 6 (gem 7.1, whose Ruby
/// processes write `:workers` instead) must be found by exactly those reads, from the first beat on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_rust_job_is_found_by_the_reads_the_gems_reaper_makes() {
    for (folder, _) in VERSIONS {
        let doc = recording(&format!("{folder}/reaper.ruby.json"));
        let reads: Vec<String> = phase(&doc, "reap", 0)["trace"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t.get("from").is_none())
            .map(|t| {
                let a = t["args"]
                    .as_array()
                    .map(|a| a.iter().map(text).collect::<Vec<_>>());
                format!(
                    "{} {}",
                    t["cmd"].as_str().unwrap_or(""),
                    a.unwrap_or_default().join(" ")
                )
            })
            .collect();
        for want in [
            "SSCAN processes 0",
            "EXISTS fixture-host:1:0123456789ab",
            "HGETALL fixture-host:1:0123456789ab:work",
        ] {
            assert!(
                reads.iter().any(|r| r == want),
                "{folder}: the reaper no longer reads `{want}`: {reads:?}"
            );
        }
    }
    let redis = RedisServer::start();
    let mut c = redis.async_conn().await;
    // A Ruby Sidekiq 6.4 process in the fleet (gem 7.1's), whose busy jobs go to `:workers`.
    let _: () = c.sadd("processes", "ruby-host:1:abc").await.unwrap();
    let _: () = c
        .hset(
            "ruby-host:1:abc",
            "info",
            json!({"hostname": "ruby-host", "version": "6.4.1"}).to_string(),
        )
        .await
        .unwrap();
    let doc = recording("unique-jobs-7.1/until_executed.success.json");
    let push = phase(&doc, "push", 0);
    let digest = "uniquejobs:24c93bd251e6317d3a824680b876b58f";
    let handle = support::launch(support::config(&redis.url(), &["default"], 2), registry()).await;
    seed(
        &mut c,
        push["keys_after"].as_object().unwrap(),
        Some(json!([3, "a"])),
    )
    .await;
    let found = async |c: &mut oxidekiq::worker::Conn| -> bool {
        let members: Vec<String> = c.smembers("processes").await.unwrap();
        for id in members {
            if !c.exists::<_, bool>(&id).await.unwrap() {
                continue;
            }
            let work: std::collections::HashMap<String, String> =
                c.hgetall(format!("{id}:work")).await.unwrap();
            for entry in work.values() {
                let entry: Value = serde_json::from_str(entry).unwrap();
                let payload: Value =
                    serde_json::from_str(entry["payload"].as_str().unwrap()).unwrap();
                if payload["lock_digest"]
                    .as_str()
                    .map(|d| d.trim_end_matches(":RUN"))
                    == Some(digest)
                {
                    return true;
                }
            }
        }
        false
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !found(&mut c).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the running job's digest is in no process's :work"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Still locked while it runs; released once it ends.
    let held: bool = c
        .hexists(format!("{digest}:LOCKED"), "00000000000000000abc0001")
        .await
        .unwrap();
    assert!(held);
    let _: () = c.set("test:release", 1).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while c
        .exists::<_, bool>(format!("{digest}:LOCKED"))
        .await
        .unwrap()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lock is not released after the run"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    handle.stop().await.unwrap();
}

/// Without `--unique-jobs-version` the release is read from what the fleet writes: 8.1's client
/// changelog (`queue_and_lock.lua`) means 8.1 (an `until_executed` failure keeps the lock); a Sidekiq
/// 6.4 process means 7.1 (an `until_executing` failure re-locks with an `:INFO` without `at`); `queue.lua`
/// entries beside Sidekiq 7 mean 8.0 (its `:INFO` has `at`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gem_release_is_read_from_what_the_fleet_writes() {
    let redis = RedisServer::start();
    let cases = [
        (
            "unique-jobs-8.x/until_executed.failure.json",
            &["7.3.9"][..],
        ),
        (
            "unique-jobs-7.1/until_executing.failure.json",
            &["6.4.1"][..],
        ),
        (
            "unique-jobs-8.0/until_executing.failure.json",
            &["7.3.9"][..],
        ),
    ];
    let mut failures = Vec::new();
    for (file, versions) in cases {
        let doc = recording(file);
        let (push, run) = (phase(&doc, "push", 0), phase(&doc, "run", 0));
        let (diff, _, _) =
            replay_with(&redis, None, versions, push, run, Some(json!([2, "a"]))).await;
        if !diff.is_empty() {
            failures.push(format!(
                "{file} beside Sidekiq {versions:?}:\n{}",
                diff.join("\n")
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// `on_conflict: replace` on the server (not recorded; `on_conflict/replace.rb`): a job of the
/// digest waiting in `schedule` is deleted with the lock's keys, then the conflicting job runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replace_deletes_the_waiting_job_and_its_lock_then_runs() {
    let redis = RedisServer::start();
    let mut c = redis.async_conn().await;
    let run = "uniquejobs:dc125fd0702f23b32c76e1baf7e1b130:RUN";
    let payload = |jid: &str| {
        json!({"class": "WhileExecutingJob", "args": [1, "a"], "jid": jid, "queue": "default",
               "retry": true, "lock": "while_executing", "lock_digest": run, "on_conflict": "replace",
               "lock_args": [1, "a"], "lock_prefix": "uniquejobs", "lock_timeout": 0, "lock_ttl": null})
        .to_string()
    };
    // The first job holds :RUN (its perform is elsewhere); a third waits in `schedule`.
    hold(&mut c, run, "00000000000000000abc0001").await;
    let _: () = c
        .zadd(
            "schedule",
            payload("00000000000000000abc0003"),
            support::now() + 3600.0,
        )
        .await
        .unwrap();
    let handle = launched(&redis, Some(UniqueJobsGem::V8_1)).await;
    let _: () = c
        .lpush("queue:default", payload("00000000000000000abc0002"))
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let performed: Vec<String> = c.lrange("test:performed", 0, -1).await.unwrap();
        if performed == ["00000000000000000abc0002"] {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not performed: {performed:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    handle.stop().await.unwrap();
    let scheduled: usize = c.zcard("schedule").await.unwrap();
    assert_eq!(scheduled, 0, "the waiting job of the digest is deleted");
    let locked: bool = c.exists(format!("{run}:LOCKED")).await.unwrap();
    assert!(!locked, "its lock is deleted");
    let listed: Option<f64> = c.zscore("uniquejobs:digests", run).await.unwrap();
    assert_eq!(listed, None);
}

/// Pushes `payload` to `queue:default` of a launcher following `gem` (`None`: detected) and waits
/// (at most 10 s) until `test:performed` names `jid`; true when it did.
async fn performs(
    redis: &RedisServer,
    gem: Option<UniqueJobsGem>,
    payload: &Value,
    jid: &str,
) -> bool {
    let mut c = redis.async_conn().await;
    let handle = launched(redis, gem).await;
    let _: () = c.lpush("queue:default", payload.to_string()).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut done = false;
    while !done && tokio::time::Instant::now() < deadline {
        let performed: Vec<String> = c.lrange("test:performed", 0, -1).await.unwrap();
        done = performed.iter().any(|p| p == jid);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    handle.stop().await.unwrap();
    done
}

/// A `lock_timeout` far past any real wait (1e300, read as `i64::MAX` seconds) once made the wait's
/// deadline overflow `Instant` under 7.1's and 8.0's rules (8.1 caps the wait): a panic after the
/// queue step, the job failed every time and its token stayed in `<d>:RUN:QUEUED`, so no job of the
/// digest ran again. A free lock must be taken and the job performed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_timeout_past_any_instant_still_takes_a_free_lock() {
    let redis = RedisServer::start();
    for (n, gem) in [UniqueJobsGem::V7_1, UniqueJobsGem::V8_0]
        .into_iter()
        .enumerate()
    {
        let mut c = redis.async_conn().await;
        let _: () = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();
        let jid = format!("00000000000000000abc000{n}");
        let job = while_job(&jid, "uniquejobs:timeout", json!(1e300));
        assert!(
            performs(&redis, Some(gem), &job, &jid).await,
            "{gem:?}: not performed"
        );
        // Only the unlock's wake-up token (`1`) may wait in `:QUEUED`, never the job's jid.
        let queued: Vec<String> = c
            .lrange("uniquejobs:timeout:RUN:QUEUED", 0, -1)
            .await
            .unwrap();
        let held: bool = c.exists("uniquejobs:timeout:RUN:LOCKED").await.unwrap();
        assert!(
            !queued.contains(&jid) && !held,
            "{gem:?}: the lock is left behind: {queued:?}"
        );
    }
}

/// A `lock_ttl` far past any real TTL (1e300, read as `i64::MAX` seconds) made PEXPIRE fail halfway
/// through the lock script, after the lock's keys were written without a TTL: the job failed instead of
/// running. It runs, and leaves no lock behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_ttl_past_any_expiry_still_runs_and_releases() {
    let redis = RedisServer::start();
    for (n, gem) in [
        UniqueJobsGem::V7_1,
        UniqueJobsGem::V8_0,
        UniqueJobsGem::V8_1,
    ]
    .into_iter()
    .enumerate()
    {
        let mut c = redis.async_conn().await;
        let _: () = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();
        let jid = format!("00000000000000000abd000{n}");
        let mut job = while_job(&jid, "uniquejobs:ttl", json!(0));
        job["lock_ttl"] = json!(1e300);
        assert!(
            performs(&redis, Some(gem), &job, &jid).await,
            "{gem:?}: not performed"
        );
        let held: bool = c.exists("uniquejobs:ttl:RUN:LOCKED").await.unwrap();
        assert!(!held, "{gem:?}: the lock is left behind");
    }
}

/// An 8.1 fleet whose gem jobs take only runtime locks (`while_executing`: its client writes
/// nothing) leaves only `queue.lua`/`lock.lua`/`unlock.lua` entries in the changelog, as 8.0 does (the
/// real 8.1 server's own, from the recording): the changelog guess said 8.0, and a failed
/// `until_executed` job then released the lock 8.1 keeps for its retry. Each Ruby server of the gem
/// writes its release to `uniquejobs:live` at start (`update_version.lua`); it must win.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_release_the_gem_writes_at_start_wins_over_the_changelog_guess() {
    let redis = RedisServer::start();
    let mut c = redis.async_conn().await;
    let _: () = c.sadd("processes", "ruby-host:0:abc").await.unwrap();
    let info = json!({"hostname": "ruby-host", "version": "7.3.9"}).to_string();
    let _: () = c.hset("ruby-host:0:abc", "info", info).await.unwrap();
    let doc = recording("unique-jobs-8.x/while_executing.success.json");
    let mut after_run = phase(&doc, "run", 0)["keys_after"]
        .as_object()
        .unwrap()
        .clone();
    after_run.retain(|k, _| k == "uniquejobs:changelog");
    assert!(!after_run.is_empty(), "the recording's changelog");
    seed(&mut c, &after_run, None).await;
    // `sidekiq-unique-jobs 8.1.0`: the recorded gem's release, as its `VERSION` writes it.
    let live = doc["gem"]
        .as_str()
        .unwrap()
        .rsplit(' ')
        .next()
        .unwrap()
        .to_string();
    let _: () = c.set("uniquejobs:live", &live).await.unwrap();
    let (jid, digest) = ("00000000000000000abc0002", "uniquejobs:second");
    hold(&mut c, digest, jid).await;
    let job = json!({"class": "UntilExecutedJob", "args": [2, "a"], "jid": jid, "queue": "default",
           "retry": true, "lock": "until_executed", "lock_digest": digest, "lock_timeout": 0,
           "lock_ttl": null});
    let handle = launched(&redis, None).await;
    let _: () = c.lpush("queue:default", job.to_string()).await.unwrap();
    ran(&redis, jid, 1).await;
    handle.stop().await.unwrap();
    let held: bool = c.exists(format!("{digest}:LOCKED")).await.unwrap();
    assert!(
        held,
        "gem {live}: the failure released the lock 8.1 keeps (followed 8.0's rules)"
    );
}

/// Waits (at most 10 s) until `test:performed` names `jid` and `retry` holds `retries` jobs.
async fn ran(redis: &RedisServer, jid: &str, retries: usize) {
    let mut c = redis.async_conn().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let performed: Vec<String> = c.lrange("test:performed", 0, -1).await.unwrap();
        let in_retry: usize = c.zcard("retry").await.unwrap();
        if performed.iter().any(|p| p == jid) && in_retry == retries {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{jid} not run");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A launcher on `redis`'s `queue:default` with this file's workers, following `gem` (`None`: detected).
async fn launched(redis: &RedisServer, gem: Option<UniqueJobsGem>) -> oxidekiq::launcher::Handle {
    let config = oxidekiq::config::Config {
        unique_jobs_gem: gem,
        ..support::config(&redis.url(), &["default"], 2)
    };
    support::launch(config, registry()).await
}

/// The keys of `digest`'s lock held by `jid`, as the gem's `lock` step leaves them.
async fn hold(c: &mut oxidekiq::worker::Conn, digest: &str, jid: &str) {
    let _: () = c.set(digest, jid).await.unwrap();
    let _: () = c
        .hset(format!("{digest}:LOCKED"), jid, support::now())
        .await
        .unwrap();
    let _: () = c
        .zadd("uniquejobs:digests", digest, support::now())
        .await
        .unwrap();
}

/// A job of a class with `lock:` but no `lock_digest` (rescheduled by 8.1's `on_conflict:
/// reschedule`, which skips the client's `Job.prepare`; or pushed by a client without the gem): the
/// gem's server computes its digest and runs it under the lock. oxidekiq cannot compute it, and once
/// ran such a job with no lock at all, beside the job that holds `:RUN`. It must not be performed
/// here: it fails loudly (retry path, nothing lost) for a Ruby process to run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gem_job_without_its_digest_is_not_run_unlocked() {
    let redis = RedisServer::start();
    let mut c = redis.async_conn().await;
    let run = "uniquejobs:dc125fd0702f23b32c76e1baf7e1b130:RUN";
    hold(&mut c, run, "00000000000000000abc0001").await;
    let jid = "00000000000000000abc0002";
    // As 8.1's reschedule pushes it: the class's options (`lock`, `on_conflict`), no lock fields.
    let job = json!({"class": "WhileExecutingJob", "args": [1, "a"], "jid": jid, "queue": "default",
                     "retry": true, "lock": "while_executing", "on_conflict": "reschedule"});
    let performed = performs(&redis, Some(UniqueJobsGem::V8_1), &job, jid).await;
    assert!(!performed, "performed without the lock another job holds");
    let retries: Vec<String> = c.zrange("retry", 0, -1).await.unwrap();
    assert!(
        retries.len() == 1 && retries[0].contains("lock_digest"),
        "the job is not in the retry set with a clear error: {retries:?}"
    );
}

/// A run cut short after the gem's move from `:QUEUED` to `:PRIMED` and before its `lock` step (a
/// SIGKILL there, or the move's reply lost) leaves its jid in `<d>:PRIMED` and the digest naming it.
/// The recovered run's `queue` step found the token in `:PRIMED`, gave none back to `:QUEUED`, its
/// move found nothing and the job was dropped as a conflict. It must take the lock and run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_cut_between_its_move_and_its_lock_runs_when_recovered() {
    let redis = RedisServer::start();
    for (n, (_, gem)) in VERSIONS.into_iter().enumerate() {
        let mut c = redis.async_conn().await;
        let _: () = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();
        let run = "uniquejobs:primed:RUN";
        let jid = format!("00000000000000000abc010{n}");
        let _: () = c.set(run, &jid).await.unwrap();
        let _: () = c.lpush(format!("{run}:PRIMED"), &jid).await.unwrap();
        let job = while_job(&jid, "uniquejobs:primed", json!(0));
        assert!(
            performs(&redis, Some(gem), &job, &jid).await,
            "{gem:?}: dropped"
        );
        let held: bool = c.exists(format!("{run}:LOCKED")).await.unwrap();
        assert!(!held, "{gem:?}: the lock is left behind");
    }
}

/// A `while_executing` job of `digest` as the gem's client pushes it, with `lock_timeout`.
fn while_job(jid: &str, digest: &str, lock_timeout: Value) -> Value {
    json!({"class": "WhileExecutingJob", "args": [1, "a"], "jid": jid, "queue": "default",
           "retry": true, "lock": "while_executing", "lock_digest": digest,
           "lock_timeout": lock_timeout, "lock_ttl": null})
}

/// A job cancelled by Sidekiq's `cancel!` while it runs is done, so an `until_executed` job leaves the
/// gem's keys as after a success, for each gem version (issue 31 review): before the cancel stopped the
/// worker inside the chain, the gem's stage was dropped with it and its lock stayed until expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_until_executed_job_leaves_the_keys_of_a_success() {
    let redis = RedisServer::start();
    let mut failures = Vec::new();
    for (folder, gem) in VERSIONS {
        let doc = recording(&format!("{folder}/until_executed.success.json"));
        let (push, run) = (phase(&doc, "push", 0), phase(&doc, "run", 0));
        let mut c = redis.async_conn().await;
        let _: () = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();
        let want = expected(run["keys_after"].as_object().unwrap());
        let config = oxidekiq::config::Config {
            unique_jobs_gem: Some(gem),
            ..support::config(&redis.url(), &["default"], 2)
        };
        let handle = support::launch(config, registry()).await;
        // `[3, ..]`: the job runs until `test:release` (never set here), at most 20 s.
        seed(
            &mut c,
            push["keys_after"].as_object().unwrap(),
            Some(json!([3, "a"])),
        )
        .await;
        let started = tokio::time::Instant::now();
        let jid = loop {
            let performed: Vec<String> = c.lrange("test:performed", 0, -1).await.unwrap();
            if let Some(jid) = performed.first() {
                break jid.clone();
            }
            assert!(started.elapsed() < Duration::from_secs(15), "never ran");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let client = oxidekiq::Client::new(redis.async_conn().await);
        client.cancel(&jid).await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut diff;
        loop {
            let mut got = snapshot(&mut c).await;
            without_per_push_options(&mut got, &want);
            diff = differences(&want, &got);
            if diff.is_empty() || tokio::time::Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        handle.stop().await.unwrap();
        if !diff.is_empty() {
            failures.push(format!("{folder} (gem {gem:?}):\n{}", diff.join("\n")));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
