//! The sidekiq-unique-jobs recordings (`fixtures/unique-jobs-7.1`, `-8.0`, `-8.x`, made by
//! `fixtures/unique-jobs/record.sh` from the real gem) hold what `docs/unique-jobs-protocol.md`
//! says they hold: every file the recorder writes and no other, each with its steps, and in each
//! step the keys, changelog entries and release rules the protocol page states per version. A bad
//! re-recording (a step missing, a key the gem no longer writes, a rule that changed) fails here.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// The gem versions recorded, as the rules below tell them apart.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Gem {
    /// 7.1.33 on Sidekiq 6.4.1.
    V71,
    /// 8.0.13 on Sidekiq 7.3.9.
    V80,
    /// 8.1.0 on Sidekiq 7.3.9.
    V81,
}

const FOLDERS: [(&str, Gem, &str, &str); 3] = [
    (
        "unique-jobs-7.1",
        Gem::V71,
        "sidekiq-unique-jobs 7.1.33",
        "6.4.1",
    ),
    (
        "unique-jobs-8.0",
        Gem::V80,
        "sidekiq-unique-jobs 8.0.13",
        "7.3.9",
    ),
    (
        "unique-jobs-8.x",
        Gem::V81,
        "sidekiq-unique-jobs 8.1.0",
        "7.3.9",
    ),
];

const LOCKS: [&str; 5] = [
    "until_executing",
    "until_executed",
    "while_executing",
    "until_and_while_executing",
    "until_expired",
];
const CLIENT_LOCKS: [&str; 4] = [
    "until_executing",
    "until_executed",
    "until_and_while_executing",
    "until_expired",
];
const SERVER_LOCKS: [&str; 2] = ["while_executing", "until_and_while_executing"];
const CLIENT_STRATEGIES: [&str; 4] = ["log", "reject", "replace", "raise"];
const SERVER_STRATEGIES: [&str; 4] = ["log", "reject", "reschedule", "raise"];

const JID1: &str = "00000000000000000abc0001";
const JID2: &str = "00000000000000000abc0002";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// Every file the recorder writes into a version's folder.
fn expected_files() -> BTreeSet<String> {
    let mut files = BTreeSet::new();
    for lock in LOCKS.iter().chain(&["until_executed_ttl"]) {
        for step in ["push", "success", "failure"] {
            files.insert(format!("{lock}.{step}.json"));
        }
    }
    for lock in CLIENT_LOCKS {
        for s in CLIENT_STRATEGIES {
            files.insert(format!("{lock}.conflict_client_{s}.json"));
        }
    }
    for lock in SERVER_LOCKS {
        for s in SERVER_STRATEGIES {
            files.insert(format!("{lock}.conflict_server_{s}.json"));
        }
    }
    files.insert("reaper.ruby.json".into());
    files.insert("reaper.lua.json".into());
    files
}

/// The phases a step records, in order.
fn expected_phases(step: &str) -> &'static [&'static str] {
    match step {
        "push" => &["push"],
        "success" | "failure" => &["push", "run"],
        "ruby" | "lua" => &["setup", "reap"],
        s if s.starts_with("conflict_client_") => &["push", "push"],
        s if s.starts_with("conflict_server_") => &[
            "push",
            "first_running",
            "push",
            "second_run",
            "first_finishes",
        ],
        other => panic!("no phases known for step {other}"),
    }
}

/// One recorded file.
struct Rec {
    name: String,
    gem: Gem,
    doc: Value,
}

impl Rec {
    fn phase(&self, i: usize) -> &Value {
        &self.doc["phases"][i]
    }

    fn phase_named(&self, name: &str) -> &Value {
        self.doc["phases"]
            .as_array()
            .and_then(|p| p.iter().rev().find(|p| p["name"] == name))
            .unwrap_or_else(|| panic!("{}: no phase {name}", self.name))
    }

    /// The digest of the first job, from the payload the first push wrote.
    fn digest(&self) -> String {
        let queued = &self.phase(0)["keys_after"]["queue:default"]["value"][0]["json"];
        let digest = queued["lock_digest"].as_str();
        digest
            .unwrap_or_else(|| panic!("{}: no lock_digest in the pushed payload", self.name))
            .to_string()
    }
}

fn load(folder: &str, gem: Gem, file: &str) -> Rec {
    let path = root().join(folder).join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let doc: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: not JSON: {e}", path.display()));
    Rec {
        name: format!("{folder}/{file}"),
        gem,
        doc,
    }
}

/// The key `key` after a phase, or `None`.
fn key<'a>(phase: &'a Value, key: &str) -> Option<&'a Value> {
    phase["keys_after"].get(key)
}

/// The fields of a hash key, empty if absent.
fn hash_fields(phase: &Value, k: &str) -> BTreeSet<String> {
    key(phase, k)
        .and_then(|v| v["value"].as_object())
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

/// The gem's keys (prefix `uniquejobs:`) after a phase, without the changelog.
fn lock_keys(phase: &Value) -> BTreeSet<String> {
    phase["keys_after"]
        .as_object()
        .map(|m| {
            m.keys()
                .filter(|k| k.starts_with("uniquejobs:") && *k != "uniquejobs:changelog")
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

/// The members of a zset key (their JSON if they are JSON).
fn zset_members(phase: &Value, k: &str) -> Vec<Value> {
    key(phase, k)
        .and_then(|v| v["value"].as_array())
        .map(|pairs| pairs.iter().map(|p| p[0].clone()).collect())
        .unwrap_or_default()
}

/// Asserts that the hash `locked` (a `:LOCKED` key) holds exactly `jid` after `phase`.
fn assert_locked_by(rec: &Rec, phase: &Value, locked: &str, jid: &str, what: &str) {
    let holders = hash_fields(phase, locked);
    assert_eq!(
        holders,
        [jid.to_string()].into(),
        "{}: {locked} {what}",
        rec.name
    );
}

/// The jids of recorded job payloads (`{"json": {...}}`).
fn jids(jobs: &[Value]) -> Vec<&str> {
    jobs.iter()
        .filter_map(|j| j["json"]["jid"].as_str())
        .collect()
}

/// The changelog after a phase as (message, jid, script) triples.
fn changelog(phase: &Value) -> Vec<(String, String, String)> {
    zset_members(phase, "uniquejobs:changelog")
        .iter()
        .map(|m| {
            let e = &m["json"];
            let s = |f: &str| e[f].as_str().unwrap_or("").to_string();
            (s("message"), s("job_id"), s("script"))
        })
        .collect()
}

/// The set of key names a `:QUEUED` wake-up leaves: the list `["1"]` with a TTL of 5 s.
fn assert_wake_up(rec: &Rec, phase: &Value, queued: &str) {
    let k = key(phase, queued).unwrap_or_else(|| panic!("{}: no wake-up list {queued}", rec.name));
    assert_eq!(k["type"], "list", "{}: {queued}", rec.name);
    assert_eq!(
        k["value"],
        serde_json::json!(["1"]),
        "{}: {queued}",
        rec.name
    );
    assert_eq!(k["ttl"], "has TTL", "{}: {queued}", rec.name);
    assert_eq!(k["ttl_seconds_ceil"], 5, "{}: {queued}", rec.name);
    // The unlock script pushed it: LPUSH "1" then PEXPIRE 5000, both from Lua.
    let trace = phase["trace"].as_array().cloned().unwrap_or_default();
    let at = trace.iter().position(|t| {
        t["from"] == "lua" && t["cmd"] == "LPUSH" && t["args"] == serde_json::json!([queued, "1"])
    });
    let at = at.unwrap_or_else(|| panic!("{}: no LPUSH {queued} \"1\" in the trace", rec.name));
    assert_eq!(
        trace[at + 1]["args"],
        serde_json::json!([queued, "5000"]),
        "{}: PEXPIRE 5000 follows the wake-up push",
        rec.name
    );
}

/// The shape every file has, whatever its step.
fn check_shape(rec: &Rec, folder_gem: &str, sidekiq: &str, lock: &str, step: &str) {
    let d = &rec.doc;
    assert_eq!(d["gem"], folder_gem, "{}", rec.name);
    assert_eq!(d["sidekiq"], sidekiq, "{}", rec.name);
    let recorded_lock = if lock == "reaper" { "reaper" } else { lock };
    assert_eq!(d["lock"], recorded_lock, "{}", rec.name);
    assert_eq!(d["step"], step, "{}", rec.name);
    let phases = d["phases"]
        .as_array()
        .unwrap_or_else(|| panic!("{}: no phases", rec.name));
    let names: Vec<&str> = phases
        .iter()
        .map(|p| p["name"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(names, expected_phases(step), "{}: phases", rec.name);
    // The scripts each version runs, with the number of KEYS each takes: the lock scripts the eight
    // keys of a digest (key.rb's to_a), replace's lookup the three job sets, its lock deletion the
    // digest's and :RUN's lists and hashes plus the digests zset, 7.1's lua reaper its five sets.
    let scripts: &[(&str, usize)] = match rec.gem {
        Gem::V71 => &[
            ("queue", 8),
            ("lock", 8),
            ("unlock", 8),
            ("delete_job_by_digest", 3),
            ("delete_by_digest", 9),
            ("reap_orphans", 5),
        ],
        Gem::V80 => &[
            ("queue", 8),
            ("lock", 8),
            ("unlock", 8),
            ("delete_job_by_digest", 3),
            ("delete_by_digest", 9),
        ],
        Gem::V81 => &[
            ("queue_and_lock", 8),
            ("queue", 8),
            ("lock", 8),
            ("unlock", 8),
            ("delete_job_by_digest", 3),
            ("delete_by_digest", 9),
        ],
    };
    for p in phases {
        let keys = p["keys_after"]
            .as_object()
            .unwrap_or_else(|| panic!("{}: a phase without keys_after", rec.name));
        for (k, v) in keys {
            let ty = v["type"].as_str().unwrap_or("");
            assert!(
                ["string", "list", "set", "zset", "hash"].contains(&ty),
                "{}: {k} has type {ty}",
                rec.name
            );
            match v["ttl"].as_str() {
                Some("none") => assert!(v.get("ttl_seconds_ceil").is_none(), "{}: {k}", rec.name),
                Some("has TTL") => assert!(
                    v["ttl_seconds_ceil"].as_u64().is_some(),
                    "{}: {k}",
                    rec.name
                ),
                other => panic!("{}: {k} has ttl {other:?}", rec.name),
            }
            assert!(v.get("value").is_some(), "{}: {k} has no value", rec.name);
        }
        for t in p
            .get("trace")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let cmd = t["cmd"]
                .as_str()
                .unwrap_or_else(|| panic!("{}: {t}", rec.name));
            if cmd == "EVALSHA" || cmd == "EVAL" {
                let script = t["script"].as_str().unwrap_or("");
                let known = scripts.iter().find(|(name, _)| *name == script);
                let (_, nkeys) = known
                    .unwrap_or_else(|| panic!("{}: script {script:?} for {:?}", rec.name, rec.gem));
                let sha = t["sha"].as_str().unwrap_or("");
                assert!(
                    sha.len() == 40 && sha.bytes().all(|b| b.is_ascii_hexdigit()),
                    "{}: sha {sha}",
                    rec.name
                );
                let n = t["keys"].as_array().map_or(0, Vec::len);
                assert_eq!(n, *nkeys, "{}: {script} keys", rec.name);
            }
        }
    }
}

fn check_push(rec: &Rec, lock: &str) {
    let push = rec.phase(0);
    assert_eq!(push["returned"], JID1, "{}", rec.name);
    let payload = &push["keys_after"]["queue:default"]["value"][0]["json"];
    for field in [
        "lock",
        "lock_digest",
        "lock_args",
        "lock_prefix",
        "lock_timeout",
        "lock_ttl",
    ] {
        assert!(
            payload.get(field).is_some(),
            "{}: payload without {field}",
            rec.name
        );
    }
    assert_eq!(payload["lock_prefix"], "uniquejobs", "{}", rec.name);
    assert_eq!(payload["lock_args"], payload["args"], "{}", rec.name);
    let digest = rec.digest();
    let hex = digest.strip_prefix("uniquejobs:").unwrap_or("");
    let hex = hex.strip_suffix(":RUN").unwrap_or(hex);
    assert!(
        hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
        "{}: {digest}",
        rec.name
    );
    if lock == "while_executing" {
        // No client lock: the push writes nothing of the gem, but the digest already carries :RUN.
        assert!(digest.ends_with(":RUN"), "{}: {digest}", rec.name);
        assert!(
            lock_keys(push).is_empty(),
            "{}: {:?}",
            rec.name,
            lock_keys(push)
        );
        return;
    }
    assert_eq!(
        key(push, &digest).map(|k| &k["value"]),
        Some(&Value::from(JID1)),
        "{}",
        rec.name
    );
    assert_locked_by(rec, push, &format!("{digest}:LOCKED"), JID1, "{}");
    assert!(
        key(push, &format!("{digest}:INFO")).is_some(),
        "{}: :INFO (lock_info is on)",
        rec.name
    );
    let zset = if lock == "until_expired" {
        "uniquejobs:expiring_digests"
    } else {
        "uniquejobs:digests"
    };
    assert_eq!(
        zset_members(push, zset),
        vec![Value::from(digest.clone())],
        "{}: {zset}",
        rec.name
    );
    let has_ttl = lock == "until_expired" || rec.name.contains("_ttl.");
    assert_eq!(
        key(push, &digest).map(|k| k["ttl"] == "has TTL"),
        Some(has_ttl),
        "{}: TTL on {digest}",
        rec.name
    );
    // 8.1.0 SETs :INFO after its script PEXPIREd it, so :INFO never keeps a TTL there.
    assert_eq!(
        key(push, &format!("{digest}:INFO")).map(|k| k["ttl"] == "has TTL"),
        Some(has_ttl && rec.gem != Gem::V81),
        "{}: TTL on :INFO",
        rec.name
    );
    // The changelog tells the versions apart (protocol §6).
    let log = changelog(push);
    let expect: Vec<(String, String, String)> = match rec.gem {
        Gem::V81 => vec![("Locked".into(), JID1.into(), "queue_and_lock.lua".into())],
        Gem::V71 | Gem::V80 => vec![
            ("Queued".into(), JID1.into(), "queue.lua".into()),
            ("Locked".into(), JID1.into(), "lock.lua".into()),
        ],
    };
    assert_eq!(log, expect, "{}: changelog after push", rec.name);
    let info = &key(push, &format!("{digest}:INFO"))
        .map(|k| k["value"]["json"].clone())
        .unwrap_or_default();
    assert_eq!(
        info.get("at").is_some(),
        rec.gem != Gem::V71,
        "{}: :INFO's at field",
        rec.name
    );
}

fn check_run(rec: &Rec, lock: &str, failed: bool) {
    let digest = rec.digest();
    let base = digest.strip_suffix(":RUN").unwrap_or(&digest).to_string();
    let run_digest = format!("{base}:RUN");
    let run = rec.phase_named("run");
    if failed {
        assert_eq!(run["raised"], "ArgumentError", "{}", rec.name);
    } else {
        assert!(
            run.get("raised").is_none(),
            "{}: {}",
            rec.name,
            run["raised"]
        );
    }
    let during = &run["keys_during_perform"];
    assert!(during.is_object(), "{}: perform did not run", rec.name);
    let during_has = |k: &str| during.get(k).is_some();
    let keys = lock_keys(run);
    let set = |ks: &[&str]| ks.iter().map(|k| k.to_string()).collect::<BTreeSet<_>>();
    let locked = format!("{base}:LOCKED");
    match lock {
        "until_executing" => {
            assert!(!during_has(&base), "{}: released before perform", rec.name);
            if failed {
                // Re-locked for the same jid so the retry holds it.
                assert_locked_by(rec, run, &locked, JID1, "{}");
            } else {
                assert_eq!(keys, set(&[&format!("{base}:QUEUED")]), "{}", rec.name);
                assert_wake_up(rec, run, &format!("{base}:QUEUED"));
            }
        }
        "until_executed" | "until_executed_ttl" => {
            assert!(during_has(&base), "{}: held during perform", rec.name);
            if failed && rec.gem == Gem::V81 {
                // 8.1.0 keeps the lock when perform raises.
                assert_locked_by(rec, run, &locked, JID1, "{}");
                assert!(key(run, &base).is_some(), "{}", rec.name);
            } else {
                // Released on success, and on failure by 7.1 and 8.0 (`ensure`).
                assert_eq!(keys, set(&[&format!("{base}:QUEUED")]), "{}", rec.name);
                assert_wake_up(rec, run, &format!("{base}:QUEUED"));
            }
        }
        "while_executing" => {
            assert_eq!(
                during
                    .get(format!("{run_digest}:LOCKED"))
                    .and_then(|v| v["value"].as_object())
                    .map(|m| m.len()),
                Some(1),
                "{}: :RUN held during perform",
                rec.name
            );
            assert_eq!(
                keys,
                set(&[&format!("{run_digest}:QUEUED")]),
                "{}",
                rec.name
            );
            assert_wake_up(rec, run, &format!("{run_digest}:QUEUED"));
        }
        "until_and_while_executing" => {
            assert!(
                !during_has(&base),
                "{}: client lock released before perform",
                rec.name
            );
            assert!(
                during_has(&format!("{run_digest}:LOCKED")),
                "{}: :RUN held",
                rec.name
            );
            assert!(
                hash_fields(run, &format!("{run_digest}:LOCKED")).is_empty(),
                "{}",
                rec.name
            );
            assert_wake_up(rec, run, &format!("{run_digest}:QUEUED"));
            if failed {
                assert_locked_by(rec, run, &locked, JID1, "{}: re-locked");
            } else {
                assert_eq!(
                    keys,
                    set(&[&format!("{base}:QUEUED"), &format!("{run_digest}:QUEUED")]),
                    "{}",
                    rec.name
                );
            }
        }
        "until_expired" => {
            // Never released by the server: the keys keep their TTL.
            assert_locked_by(rec, run, &locked, JID1, "{}");
            assert_eq!(
                key(run, &base).map(|k| &k["ttl"]),
                Some(&Value::from("has TTL")),
                "{}",
                rec.name
            );
        }
        other => panic!("{other}"),
    }
}

fn check_client_conflict(rec: &Rec, strategy: &str) {
    let digest = rec.digest();
    let second = rec.phase(1);
    let queue: Vec<Value> = key(second, "queue:default")
        .and_then(|k| k["value"].as_array().cloned())
        .unwrap_or_default();
    // `replace` deletes the queued job and its lock and pushes the new one; every other strategy
    // leaves the first job queued and holding the lock.
    let holder = if strategy == "replace" { JID2 } else { JID1 };
    assert_eq!(jids(&queue), [holder], "{}: queued", rec.name);
    assert_locked_by(rec, second, &format!("{digest}:LOCKED"), holder, "{}");
    match strategy {
        "replace" => assert_eq!(second["returned"], JID2, "{}", rec.name),
        "raise" => assert_eq!(
            second["raised"], "SidekiqUniqueJobs::Conflict",
            "{}",
            rec.name
        ),
        _ => assert_eq!(second["returned"], Value::Null, "{}", rec.name),
    }
    let want: &[&str] = if strategy == "reject" { &[JID2] } else { &[] };
    assert_eq!(
        jids(&zset_members(second, "dead")),
        want,
        "{}: dead set",
        rec.name
    );
    let conflict = match rec.gem {
        Gem::V81 => "Limited",
        Gem::V71 | Gem::V80 => "Limit exceeded",
    };
    assert!(
        changelog(second)
            .iter()
            .any(|(m, j, _)| m == conflict && j == JID2),
        "{}: changelog {conflict} for the second jid",
        rec.name
    );
}

fn check_server_conflict(rec: &Rec, strategy: &str) {
    let digest = rec.digest();
    let base = digest.strip_suffix(":RUN").unwrap_or(&digest);
    let run_locked = format!("{base}:RUN:LOCKED");
    let first_running = rec.phase_named("first_running");
    assert_locked_by(rec, first_running, &run_locked, JID1, "{}");
    let second = rec.phase_named("second_run");
    // The gem does not perform a job whose runtime lock it could not take.
    assert!(
        second["keys_during_perform"].is_null(),
        "{}: the second job performed",
        rec.name
    );
    assert_locked_by(rec, second, &run_locked, JID1, "{}: the first keeps :RUN");
    assert!(
        changelog(second)
            .iter()
            .any(|(m, j, _)| m == "Limit exceeded" && j == JID2),
        "{}: the second run's conflict is logged",
        rec.name
    );
    let dead = zset_members(second, "dead");
    let scheduled = zset_members(second, "schedule");
    match strategy {
        "raise" => assert_eq!(
            second["raised"], "SidekiqUniqueJobs::Conflict",
            "{}",
            rec.name
        ),
        _ => assert!(second.get("raised").is_none(), "{}", rec.name),
    }
    let want: &[&str] = if strategy == "reject" { &[JID2] } else { &[] };
    assert_eq!(jids(&dead), want, "{}: dead", rec.name);
    if strategy == "reject" {
        assert_eq!(
            dead[0]["json"]["lock_digest"],
            format!("{base}:RUN"),
            "{}",
            rec.name
        );
    }
    assert_eq!(
        scheduled.len(),
        usize::from(strategy == "reschedule"),
        "{}: schedule",
        rec.name
    );
    if let Some(job) = scheduled.first() {
        // A new jid; 8.1 pushes it without the client middleware's lock fields.
        assert_eq!(job["json"]["jid"], "<jid>", "{}", rec.name);
        assert_eq!(
            job["json"].get("lock_digest").is_some(),
            rec.gem != Gem::V81,
            "{}",
            rec.name
        );
    }
    let last = rec.phase_named("first_finishes");
    assert!(
        hash_fields(last, &run_locked).is_empty(),
        "{}: :RUN released",
        rec.name
    );
    assert_wake_up(rec, last, &format!("{base}:RUN:QUEUED"));
}

fn check_reaper(rec: &Rec, reaper: &str) {
    let setup = rec.phase_named("setup");
    let digests = setup["digests"]
        .as_object()
        .unwrap_or_else(|| panic!("{}: no digests", rec.name));
    let of = |jid_end: &str| -> String {
        let jid = format!("00000000000000000abc000{jid_end}");
        digests[&jid].as_str().unwrap_or_default().to_string()
    };
    let (queued, in_work, in_workers, orphan) = (of("b"), of("c"), of("d"), of("e"));
    let reap = rec.phase_named("reap");
    let left: BTreeSet<String> = zset_members(reap, "uniquejobs:digests")
        .iter()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect();
    if rec.gem == Gem::V71 && reaper == "lua" {
        // 7.1's reap_orphans.lua fails on a :work entry whose payload is a JSON string: nothing reaped.
        assert_eq!(reap["raised"], "Redis::CommandError", "{}", rec.name);
        assert_eq!(left.len(), 4, "{}", rec.name);
        return;
    }
    assert!(
        reap.get("raised").is_none(),
        "{}: {}",
        rec.name,
        reap["raised"]
    );
    // Kept: the queued job's and the one running in `<identity>:work`; reaped: the one only in
    // Sidekiq 6's `:workers` (the reaper never reads it) and the orphan, with all their keys.
    assert_eq!(
        left,
        [queued.clone(), in_work.clone()].into(),
        "{}",
        rec.name
    );
    for gone in [&in_workers, &orphan] {
        assert!(key(reap, gone).is_none(), "{}: {gone} left", rec.name);
        assert!(
            key(reap, &format!("{gone}:LOCKED")).is_none(),
            "{}: {gone}:LOCKED left",
            rec.name
        );
    }
    for kept in [&queued, &in_work] {
        assert!(
            key(reap, &format!("{kept}:LOCKED")).is_some(),
            "{}: {kept}:LOCKED reaped",
            rec.name
        );
    }
}

fn check_file(folder: &str, gem: Gem, gem_name: &str, sidekiq: &str, file: &str) {
    let rec = load(folder, gem, file);
    let stem = file.strip_suffix(".json").unwrap_or(file);
    let (lock, step) = stem
        .split_once('.')
        .unwrap_or_else(|| panic!("{folder}/{file}"));
    check_shape(&rec, gem_name, sidekiq, lock, step);
    if lock == "reaper" {
        check_reaper(&rec, step);
        return;
    }
    check_push(&rec, lock);
    match step {
        "push" => {}
        "success" => check_run(&rec, lock, false),
        "failure" => check_run(&rec, lock, true),
        s => {
            if let Some(strategy) = s.strip_prefix("conflict_client_") {
                check_client_conflict(&rec, strategy);
            } else if let Some(strategy) = s.strip_prefix("conflict_server_") {
                check_server_conflict(&rec, strategy);
            } else {
                panic!("{folder}/{file}: unknown step");
            }
        }
    }
}

#[test]
fn every_unique_jobs_recording_holds_what_the_protocol_page_says() {
    let expected = expected_files();
    assert_eq!(expected.len(), 44);
    for (folder, gem, gem_name, sidekiq) in FOLDERS {
        let dir = root().join(folder);
        let found: BTreeSet<String> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        let unknown: Vec<_> = found.difference(&expected).collect();
        assert!(
            unknown.is_empty(),
            "{folder}: files without an expectation: {unknown:?}"
        );
        let missing: Vec<_> = expected.difference(&found).collect();
        assert!(
            missing.is_empty(),
            "{folder}: missing recordings: {missing:?}"
        );
        for file in &expected {
            check_file(folder, gem, gem_name, sidekiq, file);
        }
    }
}

#[test]
fn the_unique_jobs_folders_are_the_known_ones() {
    // A new gem version's folder needs its rules above before it is accepted.
    let mut seen: Vec<String> = std::fs::read_dir(root())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("unique-jobs"))
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            "unique-jobs",
            "unique-jobs-7.1",
            "unique-jobs-8.0",
            "unique-jobs-8.x"
        ]
    );
    let mut recorder: Vec<String> = std::fs::read_dir(root().join("unique-jobs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    recorder.sort();
    assert_eq!(
        recorder,
        [
            "README.md",
            "compare.sh",
            "reaper_check.rb",
            "reaper_check.sh",
            "record.rb",
            "record.sh"
        ]
    );
}
