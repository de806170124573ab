//! Every payload real ActiveJob 7.0, 7.1, 7.2, 8.0 and 8.1 pushed (`fixtures/activejob-<version>/`,
//! recorded by `fixtures/activejob-7-8/record.sh`) decodes to what that same ActiveJob read back from
//! the bytes (`ruby.json`, written by the recorder from `ActiveJob::Base.deserialize`): every
//! `job_data` field a worker is given, and every argument as a typed value.
use std::path::PathBuf;

use serde::Deserialize;
use serde_json::{Map, Value};

use super::{ActiveJobInfo, AjValue, HashKind, unwrap_job};
use crate::job::Job;

const VERSIONS: [&str; 5] = ["7.0", "7.1", "7.2", "8.0", "8.1"];

fn folder(version: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("fixtures/activejob-{version}"))
}

/// `ruby.json` of a version: file name → what Ruby read back.
fn facts(version: &str) -> Map<String, Value> {
    facts_in(&folder(version))
}

fn facts_in(dir: &std::path::Path) -> Map<String, Value> {
    let version = dir.display();
    let text = std::fs::read_to_string(dir.join("ruby.json")).unwrap();
    let mut all: Map<String, Value> = serde_json::from_str(&text).unwrap();
    match all.remove("files") {
        Some(Value::Object(files)) => files,
        other => panic!("{version}: ruby.json files: {other:?}"),
    }
}

fn info(version: &str, file: &str) -> ActiveJobInfo {
    info_in(&folder(version), file)
}

fn info_in(dir: &std::path::Path, file: &str) -> ActiveJobInfo {
    let version = dir.display();
    let raw = std::fs::read_to_string(dir.join(file)).unwrap();
    let job = Job::from_str(&raw).unwrap_or_else(|e| panic!("{version}/{file}: {e}"));
    assert!(job.is_activejob(), "{version}/{file}: an ActiveJob job");
    unwrap_job(&job).unwrap_or_else(|e| panic!("{version}/{file}: {e}"))
}

fn epoch_ns(fact: &Value) -> Option<i64> {
    fact.get("epoch_ns").map(|n| n.as_i64().unwrap())
}

/// `got` is the value Ruby described as `fact` (the recorder's `fact`).
fn check(fact: &Value, got: &AjValue, at: &str) {
    let class = fact.get("class").and_then(Value::as_str);
    let time = |t: &chrono::DateTime<chrono::FixedOffset>| {
        assert_eq!(t.timestamp_nanos_opt(), epoch_ns(fact), "{at}: the instant");
        assert_eq!(
            i64::from(t.offset().local_minus_utc()),
            fact["utc_offset"].as_i64().unwrap(),
            "{at}: the UTC offset"
        );
    };
    match (fact, class, got) {
        (Value::Array(items), _, AjValue::Array(got)) => {
            assert_eq!(items.len(), got.len(), "{at}: length");
            for (i, (f, g)) in items.iter().zip(got).enumerate() {
                check(f, g, &format!("{at}[{i}]"));
            }
        }
        (_, Some("Float"), AjValue::Plain(Value::Number(n))) => {
            assert_eq!(n.as_f64(), fact["value"].as_f64(), "{at}");
        }
        (_, Some("Symbol"), AjValue::Symbol(name)) => assert_eq!(name, &fact["name"], "{at}"),
        (_, Some("Module"), AjValue::Module(name)) => assert_eq!(name, &fact["name"], "{at}"),
        (_, Some("BigDecimal"), AjValue::BigDecimal(text)) => {
            assert_eq!(text, &fact["text"], "{at}")
        }
        (_, Some("GlobalID"), AjValue::GlobalId(gid)) => assert_eq!(gid, &fact["gid"], "{at}"),
        (_, Some("Date"), AjValue::Date(d)) => assert_eq!(d.to_string(), fact["iso"], "{at}"),
        (_, Some("Time"), AjValue::Time(t)) => time(t),
        (_, Some("DateTime"), AjValue::DateTime(t)) => time(t),
        (_, Some("ActiveSupport::TimeWithZone"), AjValue::TimeWithZone { time: t, zone }) => {
            match zone {
                Some(zone) => {
                    time(t);
                    assert_eq!(Some(zone.as_str()), fact["zone"].as_str(), "{at}: the zone");
                }
                // Rails 6.1 writes no zone and reads the time back in `Time.zone` (the recorder's
                // "UTC"): the same instant.
                None => {
                    assert_eq!(t.timestamp_nanos_opt(), epoch_ns(fact), "{at}: the instant");
                    assert_eq!(fact["zone"], "UTC", "{at}: read in Time.zone");
                }
            }
        }
        (_, Some("ActiveSupport::Duration"), AjValue::Duration { seconds, parts }) => {
            assert_eq!(seconds.as_f64(), fact["seconds"].as_f64(), "{at}: seconds");
            let want: Vec<(String, f64)> = fact["parts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| (p[0].as_str().unwrap().into(), p[1].as_f64().unwrap()))
                .collect();
            let got: Vec<(String, f64)> = parts
                .iter()
                .map(|(unit, n)| (unit.clone(), n.as_f64().unwrap()))
                .collect();
            assert_eq!(got, want, "{at}: parts");
        }
        (
            _,
            Some("Range"),
            AjValue::Range {
                begin,
                end,
                exclude_end,
            },
        ) => {
            check(&fact["begin"], begin, &format!("{at}.begin"));
            check(&fact["end"], end, &format!("{at}.end"));
            assert_eq!(Some(*exclude_end), fact["exclude_end"].as_bool(), "{at}");
        }
        (_, Some("Money"), AjValue::Custom { serializer, data }) => {
            assert_eq!(serializer, "MoneySerializer", "{at}");
            assert_eq!(data["cents"], fact["cents"], "{at}");
            assert_eq!(data["currency"], fact["currency"], "{at}");
        }
        (
            _,
            Some(kind @ ("Hash" | "keywords" | "HashWithIndifferentAccess")),
            AjValue::Hash {
                entries,
                symbol_keys,
                kind: got_kind,
            },
        ) => {
            let want_kind = match kind {
                "keywords" => HashKind::Keywords,
                "HashWithIndifferentAccess" => HashKind::Indifferent,
                _ => HashKind::Hash,
            };
            assert_eq!(*got_kind, want_kind, "{at}: kind");
            let want = fact["entries"].as_array().unwrap();
            assert_eq!(want.len(), entries.len(), "{at}: entries");
            for (w, (key, value)) in want.iter().zip(entries) {
                assert_eq!(w[0], *key, "{at}: key");
                check(&w[1], value, &format!("{at}.{key}"));
                assert_eq!(
                    w[2].as_bool().unwrap(),
                    symbol_keys.contains(key),
                    "{at}.{key}: a Symbol key"
                );
            }
        }
        (scalar, None, AjValue::Plain(v)) if !scalar.is_object() => assert_eq!(v, scalar, "{at}"),
        _ => panic!("{at}: Ruby had {fact}, decoded {got:?}"),
    }
}

/// Checks every job file of a recorded folder against its `ruby.json`; returns how many.
fn check_folder(dir: &std::path::Path) -> usize {
    let mut checked = 0;
    {
        for (file, want) in facts_in(dir) {
            let at = format!("{}/{file}", dir.display());
            let info = info_in(dir, &file);
            assert_eq!(info.job_id, want["job_id"], "{at}: job_id");
            assert_eq!(info.executions, want["executions"], "{at}: executions");
            assert_eq!(info.queue_name(), want["queue_name"].as_str(), "{at}");
            assert_eq!(info.priority(), want["priority"].as_i64(), "{at}: priority");
            assert_eq!(info.locale(), want["locale"].as_str(), "{at}: locale");
            assert_eq!(info.timezone(), want["timezone"].as_str(), "{at}: timezone");
            assert_eq!(
                info.provider_job_id(),
                want["provider_job_id"].as_str(),
                "{at}: provider_job_id"
            );
            let counts: Map<String, Value> = info
                .exception_executions()
                .iter()
                .map(|(k, n)| (k.clone(), (*n).into()))
                .collect();
            assert_eq!(
                Value::Object(counts),
                want["exception_executions"],
                "{at}: exception_executions"
            );
            assert_eq!(
                info.enqueued_at().and_then(|t| t.timestamp_nanos_opt()),
                epoch_ns(&want["enqueued_at"]),
                "{at}: enqueued_at"
            );
            assert_eq!(
                info.scheduled_at().and_then(|t| t.timestamp_nanos_opt()),
                epoch_ns(&want["scheduled_at"]),
                "{at}: scheduled_at"
            );
            let typed = info.typed_arguments().unwrap();
            check(&want["arguments"], &AjValue::Array(typed), &at);
            checked += 1;
        }
    }
    checked
}

#[test]
fn every_recorded_job_gives_the_worker_what_activejob_read_back() {
    let checked: usize = VERSIONS.iter().map(|v| check_folder(&folder(v))).sum();
    // 11 calls a version, and 5 continuation recordings of 8.1.
    assert_eq!(checked, 11 * 5 + 5);
}

/// The same recorder run now with Debian's Rails 6.1 and Sidekiq 6.4 (CI's Ruby): what the worker
/// gets equals what Ruby read back in this run.
#[test]
fn rails_6_1_recorded_in_this_run_gives_the_worker_what_it_read_back() {
    let redis = crate::test_support::RedisServer::start();
    let out = std::env::temp_dir().join(format!("oxidekiq-aj61-{}", crate::job::new_jid()));
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/activejob-7-8/record.rb");
    let run = std::process::Command::new("ruby")
        .arg(&script)
        .arg(&out)
        .env("REDIS_URL", redis.url())
        .env("AJ_SOURCE", "Debian's ruby-activejob")
        .output()
        .expect("ruby is installed");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let dir = out.join("activejob-6.1");
    let checked = check_folder(&dir);
    let _ = std::fs::remove_dir_all(&out);
    assert_eq!(checked, 11, "the 11 calls");
}

/// The recordings' scheduled jobs carry `scheduled_at` from 7.1 on; 7.0 wrote none.
#[test]
fn scheduled_at_is_read_where_rails_wrote_it() {
    for version in VERSIONS {
        let info = info(version, "scheduled_wait_until.json");
        let facts = facts(version);
        let want = epoch_ns(&facts["scheduled_wait_until.json"]["scheduled_at"]);
        assert_eq!(want.is_some(), version != "7.0", "{version}");
        assert_eq!(
            info.scheduled_at().and_then(|t| t.timestamp_nanos_opt()),
            want
        );
        assert_eq!(info.priority(), Some(10), "{version}");
    }
}

/// An app-defined serializer's object reaches the worker as data its own type reads (the Money of
/// docs/workers.md): from the plain arguments with serde, or as [`AjValue::Custom`].
#[test]
fn an_app_defined_serializer_reaches_the_worker_as_data() {
    #[derive(Debug, Deserialize, PartialEq)]
    struct Money {
        cents: i64,
        currency: String,
    }
    for version in VERSIONS {
        let info = info(version, "serializers.json");
        let facts = facts(version);
        let want = facts["serializers.json"]["arguments"]
            .as_array()
            .unwrap()
            .last()
            .unwrap()
            .clone();
        let plain = info.arguments().as_array().unwrap().last().unwrap().clone();
        let money: Money = serde_json::from_value(plain).unwrap();
        assert_eq!(money.cents, want["cents"].as_i64().unwrap(), "{version}");
        assert_eq!(
            money.currency,
            want["currency"].as_str().unwrap(),
            "{version}"
        );
        match info.typed_arguments().unwrap().last().unwrap() {
            AjValue::Custom { serializer, data } => {
                assert_eq!(serializer, "MoneySerializer");
                let typed: Money = serde_json::from_value(Value::Object(data.clone())).unwrap();
                assert_eq!(typed, money);
            }
            other => panic!("{version}: {other:?}"),
        }
    }
}

/// The `job_data` of a recording and its Sidekiq jid.
fn job_data(version: &str, file: &str) -> (Map<String, Value>, String) {
    let raw = std::fs::read_to_string(folder(version).join(file)).unwrap();
    let mut payload: Map<String, Value> = serde_json::from_str(&raw).unwrap();
    let jid = payload["jid"].as_str().unwrap().to_owned();
    match payload.remove("args") {
        Some(Value::Array(mut args)) => match args.remove(0) {
            Value::Object(data) => (data, jid),
            other => panic!("{file}: {other}"),
        },
        other => panic!("{file}: {other:?}"),
    }
}

const CONTINUATIONS: [&str; 5] = [
    "continuable_enqueued.json",
    "continuation_between_steps.json",
    "continuation_mid_step.json",
    "continuation_resumed_again.json",
    "continuation_before_last_step.json",
];

/// Rails 8.1's `continuation` reads as the progress Ruby read back, and writes back as the same text.
#[test]
fn every_recorded_continuation_reads_and_writes_as_rails_8_1() {
    let facts = facts("8.1");
    for file in CONTINUATIONS {
        let info = info("8.1", file);
        let c = info.continuation().expect("a Continuable job").unwrap();
        let (data, _) = job_data("8.1", file);
        assert_eq!(
            serde_json::to_string(&c.to_value()).unwrap(),
            serde_json::to_string(&data["continuation"]).unwrap(),
            "{file}: written back byte for byte"
        );
        assert_eq!(c.to_value(), facts[file]["continuation"], "{file}");
        assert_eq!(
            info.resumptions(),
            facts[file]["resumptions"].as_u64(),
            "{file}"
        );
    }
    let mid = info("8.1", "continuation_mid_step.json")
        .continuation()
        .unwrap()
        .unwrap();
    assert!(mid.is_completed("prepare") && !mid.is_completed("process_records"));
    assert_eq!(mid.cursor::<u64>("process_records").unwrap(), Some(4));
    assert_eq!(mid.cursor::<u64>("prepare").unwrap(), None);
    // A job that is not Continuable has none.
    assert!(info("8.1", "no_args.json").continuation().is_none());
    assert_eq!(info("8.1", "no_args.json").resumptions(), None);
}

/// Each interrupt Rails 8.1 recorded, rebuilt from the job that ran and the progress it had:
/// `provider_job_id`, `executions`, `exception_executions` (the interrupt's message, with Ruby's
/// `inspect` of the cursor), `continuation`, `resumptions` and every other key as Rails wrote them, and
/// `scheduled_at` 5 s (`resume_options`) after `enqueued_at`.
#[test]
fn an_interrupt_writes_the_job_data_rails_8_1_wrote() {
    use super::{Continuation, InterruptReason};
    let chain = [
        (
            "continuable_enqueued.json",
            "continuation_between_steps.json",
        ),
        ("continuable_enqueued.json", "continuation_mid_step.json"),
        (
            "continuation_mid_step.json",
            "continuation_resumed_again.json",
        ),
        (
            "continuation_resumed_again.json",
            "continuation_before_last_step.json",
        ),
    ];
    for (ran, pushed) in chain {
        let (before, jid) = job_data("8.1", ran);
        let (mut want, _) = job_data("8.1", pushed);
        let progress = Continuation::from_value(&want["continuation"]).unwrap();
        let now = chrono::DateTime::parse_from_rfc3339(want["enqueued_at"].as_str().unwrap())
            .unwrap()
            .with_timezone(&chrono::Utc);
        let mut got = progress
            .interrupted_job_data(
                &before,
                &jid,
                InterruptReason::Stopping,
                now,
                std::time::Duration::from_secs(5),
            )
            .unwrap();
        // Rails takes `scheduled_at` (5.seconds.from_now) a few microseconds before `enqueued_at`.
        let at = |m: &Map<String, Value>| {
            chrono::DateTime::parse_from_rfc3339(m["scheduled_at"].as_str().unwrap()).unwrap()
        };
        let drift = (at(&got) - at(&want)).num_microseconds().unwrap();
        assert!(
            (0..1000).contains(&drift),
            "{pushed}: scheduled_at {drift} µs apart"
        );
        got.remove("scheduled_at");
        want.remove("scheduled_at");
        assert_eq!(
            serde_json::to_string(&got).unwrap(),
            serde_json::to_string(&want).unwrap(),
            "{ran} interrupted as {pushed}"
        );
    }
}
