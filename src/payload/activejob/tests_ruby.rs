//! ActiveJob against real Ruby: Rails 6.1's adapter with Sidekiq 6.4 enqueues, Rust unwraps; Rust
//! enqueues, Rails' `JobWrapper` performs.
use crate::test_support as support;

use std::process::Command;

use chrono::Utc;
use oxidekiq::activejob::{self, WRAPPER_CLASS};
use serde_json::{Value, json};

/// Loads Sidekiq 6.4 and ActiveJob 6.1 as a Rails app would, pointed at `REDIS_URL`.
const RUBY_SETUP: &str = r#"
require "sidekiq"
require "active_job"
require "active_support/time"
require "active_job/queue_adapters/sidekiq_adapter"
require "bigdecimal"
require "json"
ActiveJob::Base.logger = Logger.new(nil)
Sidekiq.logger = Logger.new(nil)
ActiveJob::Base.queue_adapter = :sidekiq
Sidekiq.configure_client { |c| c.redis = { url: ENV.fetch("REDIS_URL") } }
$stderr.sync = true
"#;

/// Runs a Ruby script with `REDIS_URL` set; returns its stdout, failing the test with stderr otherwise.
fn ruby(redis: &support::RedisServer, script: &str) -> String {
    let out = Command::new("ruby")
        .arg("-e")
        .arg(format!("{RUBY_SETUP}\n{script}"))
        .env("REDIS_URL", redis.url())
        .output()
        .expect("ruby must be installed (with ruby-sidekiq and ruby-activejob)");
    assert!(
        out.status.success(),
        "ruby failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn is_uuid_v4(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.iter().map(|g| g.len()).collect::<Vec<_>>() == [8, 4, 4, 4, 12]
        && groups[2].starts_with('4')
        && s.chars()
            .all(|c| c == '-' || c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
}

/// Pops the oldest job from `queue:<queue>`.
fn rpop(redis: &support::RedisServer, queue: &str) -> Option<String> {
    redis::cmd("RPOP")
        .arg(format!("queue:{queue}"))
        .query(&mut redis.conn())
        .unwrap()
}

#[test]
fn rails_6_1_arguments_of_every_kind_decode_to_plain_values() {
    let redis = support::RedisServer::start();
    let out = ruby(
        &redis,
        r#"
require "globalid"
GlobalID.app = "myapp"
Time.zone = "Europe/Berlin"
class Person
  include GlobalID::Identification
  attr_reader :id
  def initialize(id); @id = id; end
  def self.find(id); new(id.to_i); end
end
class ReportJob < ActiveJob::Base
  queue_as :reports
  def perform(*a, **kw); end
end
jobs = []
jobs << ReportJob.perform_later(1, "s", :sym, {"a" => 1, b: 2}, [1.5, nil, true, [2, [:deep]]],
  Person.new(42), Time.utc(2024, 1, 2, 3, 4, 5), Date.new(2024, 1, 2), DateTime.new(2024, 1, 2, 3, 4, 5),
  5.minutes, 1.5.seconds, BigDecimal("1.25"), Time.zone.local(2024, 1, 2, 3, 4, 5), Comparable,
  {"x" => 1}.with_indifferent_access, 12345678901234567890123)
jobs << ReportJob.perform_later("only", kw1: "x", kw2: :y, when: Date.new(2024, 1, 3))
jobs << ReportJob.perform_later
jobs.each { |j| puts j.job_id }
# What each argument must decode to, computed by this Ruby (not copied from one machine's output):
# the text its serializer or JSON wrote (BigDecimal#to_s differs between installs: "1.25" when
# ActiveSupport's BigDecimal extension is loaded, "0.125e1" when not), as plain JSON values.
plain = ->(v) { JSON.parse(JSON.generate([v]))[0] }
expected = [
  [1, "s", "sym", {"a" => 1, "b" => 2}, [1.5, nil, true, [2, ["deep"]]],
   Person.new(42).to_global_id.to_s,
   Time.utc(2024, 1, 2, 3, 4, 5).iso8601(ActiveJob::Serializers::TimeObjectSerializer::NANO_PRECISION),
   Date.new(2024, 1, 2).iso8601,
   DateTime.new(2024, 1, 2, 3, 4, 5).iso8601(ActiveJob::Serializers::TimeObjectSerializer::NANO_PRECISION),
   5.minutes.value, 1.5.seconds.value, plain.(BigDecimal("1.25")),
   Time.zone.local(2024, 1, 2, 3, 4, 5).iso8601(ActiveJob::Serializers::TimeObjectSerializer::NANO_PRECISION),
   Comparable.name, {"x" => 1}, 12345678901234567890123],
  ["only", {"kw1" => "x", "kw2" => "y", "when" => Date.new(2024, 1, 3).iso8601}],
  [],
]
expected.each { |e| puts JSON.generate(e) }
"#,
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 6, "{out}");
    let (job_ids, expected) = lines.split_at(3);
    let expected: Vec<Value> = expected
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The decoded form of a BigDecimal is the string Ruby wrote for it, whatever this install writes.
    assert!(expected[0][11].is_string(), "{}", expected[0]);

    for (job_id, want) in job_ids.iter().zip(expected) {
        let raw = rpop(&redis, "reports").expect("ruby enqueued a job on queue:reports");
        let job = oxidekiq::Job::from_str(&raw).unwrap();
        assert!(job.is_activejob(), "{raw}");
        assert_eq!(job.class(), WRAPPER_CLASS);
        assert_eq!(job.worker_class(), "ReportJob");
        let info = activejob::unwrap(job.args_json()).unwrap();
        assert!(is_uuid_v4(&info.job_id), "{}", info.job_id);
        assert_eq!(&info.job_id, job_id);
        assert_eq!(info.executions, 0);
        assert_eq!(info.arguments(), &want, "{raw}");
    }
    assert_eq!(rpop(&redis, "reports"), None);
}

#[test]
fn the_big_integer_argument_keeps_every_digit() {
    let redis = support::RedisServer::start();
    ruby(
        &redis,
        r#"
class ReportJob < ActiveJob::Base
  queue_as :reports
  def perform(*a); end
end
ReportJob.perform_later(123456789012345678901234567890, 0.1)
"#,
    );
    let raw = rpop(&redis, "reports").unwrap();
    let job = oxidekiq::Job::from_str(&raw).unwrap();
    let info = activejob::unwrap(job.args_json()).unwrap();
    assert_eq!(
        info.arguments().to_string(),
        "[123456789012345678901234567890,0.1]"
    );
}

#[test]
fn a_job_enqueued_from_rust_is_performed_by_rails_job_wrapper() {
    let redis = support::RedisServer::start();
    let arguments = vec![
        json!(42),
        json!("text"),
        json!(2.5),
        json!(null),
        json!(true),
        json!([1, [2, "three"]]),
        json!({"name": "bob", "tags": ["a", "b"], "nested": {"n": 1}}),
    ];
    activejob::check_arguments(&arguments).unwrap();
    let payload = activejob::wrap("EchoJob", "default", arguments.clone(), Utc::now());
    let job_id = payload["args"][0]["job_id"].as_str().unwrap().to_string();
    let _: () = redis::cmd("LPUSH")
        .arg("queue:default")
        .arg(payload.to_string())
        .query(&mut redis.conn())
        .unwrap();

    ruby(
        &redis,
        r#"
class EchoJob < ActiveJob::Base
  def perform(*args)
    seen = {
      "args" => args,
      "classes" => args.map { |a| a.class.name },
      "job_id" => job_id,
      "executions" => executions,
      "queue_name" => queue_name,
      "provider_job_id" => provider_job_id,
      "timezone" => timezone,
      "locale" => locale,
      "enqueued_at" => enqueued_at,
    }
    Sidekiq.redis { |r| r.set("echo:result", JSON.generate(seen)) }
  end
end
job = Sidekiq.load_json(Sidekiq.redis { |r| r.rpop("queue:default") })
raise "expected the wrapper class, got #{job["class"]}" unless job["class"].constantize == ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper
w = ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper.new
w.jid = job["jid"]
w.perform(job["args"][0])
"#,
    );

    let seen: Option<String> = redis::cmd("GET")
        .arg("echo:result")
        .query(&mut redis.conn())
        .unwrap();
    let seen: Value = serde_json::from_str(&seen.expect("EchoJob#perform ran")).unwrap();
    assert_eq!(seen["args"], Value::Array(arguments));
    assert_eq!(
        seen["classes"],
        json!([
            "Integer",
            "String",
            "Float",
            "NilClass",
            "TrueClass",
            "Array",
            "Hash"
        ])
    );
    assert_eq!(seen["job_id"], json!(job_id));
    assert_eq!(seen["executions"], json!(1));
    assert_eq!(seen["queue_name"], json!("default"));
    assert_eq!(seen["provider_job_id"], payload["jid"]);
    assert_eq!(seen["timezone"], json!("UTC"));
    assert_eq!(seen["locale"], json!("en"));
    assert_eq!(seen["enqueued_at"], payload["args"][0]["enqueued_at"]);
}

/// `enqueue_activejob` writes Rails 7.1+'s shape with the caller's locale, time zone, priority and
/// queue, and a `wait` into `schedule`; Debian's Rails 6.1 (Sidekiq 6.4's `JobWrapper`) runs both in
/// the same run, under that locale and zone. A reserved key is refused and nothing is pushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rails_6_1_runs_what_rust_enqueues_in_todays_shape_with_its_locale_zone_and_schedule() {
    use oxidekiq::client::{Client, NewActiveJob};
    use std::time::Duration;

    let redis = support::RedisServer::start();
    let client = Client::connect(&redis.url()).await.unwrap();
    let arguments = vec![json!(7), json!({"name": "bob", "tags": ["a"]})];
    let now = Utc::now();
    let jid = client
        .enqueue_activejob(
            NewActiveJob::new("EchoJob", arguments.clone())
                .queue("critical")
                .priority(3)
                .locale("fr")
                .timezone("Europe/Paris"),
        )
        .await
        .unwrap();
    let later = client
        .enqueue_activejob(
            NewActiveJob::new("EchoJob", vec![json!("later")]).wait(Duration::from_secs(600)),
        )
        .await
        .unwrap();
    for bad in [
        json!({"a": {"_aj_globalid": "gid://x/Y/1"}}),
        json!([{"_aj_symbol_keys": []}]),
    ] {
        let err = client
            .enqueue_activejob(NewActiveJob::new("EchoJob", vec![bad.clone()]))
            .await
            .expect_err("a reserved key is refused");
        assert!(err.to_string().contains("reserved"), "{bad}: {err}");
    }
    let queued: Vec<String> = redis::cmd("LRANGE")
        .arg("queue:critical")
        .arg(0)
        .arg(-1)
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(queued.len(), 1, "one job queued");
    let pushed: Value = serde_json::from_str(&queued[0]).unwrap();
    let data = &pushed["args"][0];
    // Rails 7.1+'s keys, in its order (the recordings of 7.1-8.1 hold the same list).
    let keys: Vec<&str> = data
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        [
            "job_class",
            "job_id",
            "provider_job_id",
            "queue_name",
            "priority",
            "arguments",
            "executions",
            "exception_executions",
            "locale",
            "timezone",
            "enqueued_at",
            "scheduled_at"
        ]
    );
    assert_eq!(data["scheduled_at"], Value::Null);
    let default_len: u64 = redis::cmd("LLEN")
        .arg("queue:default")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(default_len, 0, "the refused jobs pushed nothing");

    let out = ruby(
        &redis,
        r#"
I18n.available_locales = [:en, :fr]
class EchoJob < ActiveJob::Base
  def perform(*args)
    $seen << { "args" => args, "job_id" => job_id, "queue_name" => queue_name, "priority" => priority,
               "locale" => I18n.locale.to_s, "zone" => Time.zone.name, "provider_job_id" => provider_job_id,
               "enqueued_ns" => (Time.iso8601(enqueued_at).to_r * 1_000_000_000).to_i, "executions" => executions }
  end
end
$seen = []
run = lambda do |raw|
  job = Sidekiq.load_json(raw)
  w = job["class"].constantize.new
  w.jid = job["jid"]
  w.perform(*job["args"])
end
run.call(Sidekiq.redis { |r| r.rpop("queue:critical") })
require "sidekiq/api"
entry = Sidekiq::ScheduledSet.new.to_a
raise "expected one scheduled job, got #{entry.size}" unless entry.size == 1
run.call(entry.first.value)
puts JSON.generate("seen" => $seen, "scheduled" => { "jid" => entry.first.jid, "at" => entry.first.at.to_f })
"#,
    );
    let out: Value = serde_json::from_str(out.trim()).unwrap();
    let first = &out["seen"][0];
    assert_eq!(first["args"], Value::Array(arguments));
    assert_eq!(first["job_id"], data["job_id"]);
    assert_eq!(first["queue_name"], "critical");
    assert_eq!(first["priority"], 3);
    assert_eq!(first["locale"], "fr", "performed under the caller's locale");
    assert_eq!(
        first["zone"], "Europe/Paris",
        "performed in the caller's zone"
    );
    assert_eq!(first["provider_job_id"], json!(jid));
    assert_eq!(first["executions"], 1);
    // Ruby reads the nanosecond `enqueued_at` to the nanosecond (a Rational's text).
    let enqueued =
        chrono::DateTime::parse_from_rfc3339(data["enqueued_at"].as_str().unwrap()).unwrap();
    let nanos = enqueued.timestamp_nanos_opt().unwrap();
    assert_eq!(
        first["enqueued_ns"],
        json!(nanos),
        "{}",
        data["enqueued_at"]
    );
    let second = &out["seen"][1];
    assert_eq!(second["args"], json!(["later"]));
    assert_eq!(second["locale"], "en");
    assert_eq!(second["zone"], "UTC");
    assert_eq!(out["scheduled"]["jid"], json!(later));
    let at = out["scheduled"]["at"].as_f64().unwrap();
    let want = now.timestamp() as f64 + 600.0;
    assert!(
        (want - 1.0..want + 5.0).contains(&at),
        "scheduled at {at}, pushed at {now}"
    );
}

/// Local only (`bash fixtures/activejob-7-8/live_check.sh`, which unpacks the rails/rails sources and
/// sets `OXIDEKIQ_AJ_LIVE`): each ActiveJob 7.0-8.1 runs what `enqueue_activejob` wrote, as Sidekiq's
/// wrappers do (`ActiveJob::Base.execute(job_data.merge("provider_job_id" => jid))`), under the
/// caller's locale and zone, and 7.1+ read the `scheduled_at` Rust wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the rails/rails sources: fixtures/activejob-7-8/live_check.sh"]
async fn rails_7_and_8_run_what_rust_enqueues() {
    use oxidekiq::client::{Client, NewActiveJob};
    use std::time::Duration;

    // `tag=ruby args` entries separated by `;`.
    let live = std::env::var("OXIDEKIQ_AJ_LIVE").expect("OXIDEKIQ_AJ_LIVE (see live_check.sh)");
    let mut versions = 0;
    for entry in live.split(';').filter(|e| !e.trim().is_empty()) {
        let (tag, args) = entry.split_once('=').unwrap();
        let redis = support::RedisServer::start();
        let client = Client::connect(&redis.url()).await.unwrap();
        let arguments = vec![
            json!(7),
            json!({"name": "bob", "tags": ["a"]}),
            json!([1.5, null]),
        ];
        let jid = client
            .enqueue_activejob(
                NewActiveJob::new("EchoJob", arguments.clone())
                    .queue("critical")
                    .priority(3)
                    .locale("fr")
                    .timezone("Europe/Paris"),
            )
            .await
            .unwrap();
        let later = client
            .enqueue_activejob(
                NewActiveJob::new("EchoJob", vec![json!("later")]).wait(Duration::from_secs(600)),
            )
            .await
            .unwrap();
        let raw: Vec<String> = redis::cmd("ZRANGE")
            .arg("schedule")
            .arg(0)
            .arg(-1)
            .query(&mut redis.conn())
            .unwrap();
        let written: Value = serde_json::from_str(&raw[0]).unwrap();
        let script = r#"
require "json"
require "redis"
require "active_job"
require "active_support/core_ext/time"
ActiveJob::Base.logger = Logger.new(nil)
I18n.available_locales = [:en, :fr]
class EchoJob < ActiveJob::Base
  def perform(*args)
    $seen << { "args" => args, "job_id" => job_id, "queue_name" => queue_name, "priority" => priority,
               "locale" => I18n.locale.to_s, "zone" => Time.zone.name, "provider_job_id" => provider_job_id,
               "executions" => executions,
               "scheduled_at" => (respond_to?(:scheduled_at) && scheduled_at ? (scheduled_at.to_r * 1_000_000_000).to_i : nil) }
  end
end
$seen = []
redis = Redis.new(url: ENV.fetch("REDIS_URL"))
run = ->(raw) { job = JSON.parse(raw); ActiveJob::Base.execute(job["args"][0].merge("provider_job_id" => job["jid"])) }
run.(redis.rpop("queue:critical"))
run.(redis.zrange("schedule", 0, -1).first)
puts JSON.generate("version" => ActiveJob.version.to_s, "seen" => $seen)
"#;
        let out = Command::new("ruby")
            .args(args.split_whitespace())
            .arg("-e")
            .arg(script)
            .env("REDIS_URL", redis.url())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{tag}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out: Value = serde_json::from_slice(&out.stdout).unwrap();
        let version = out["version"].as_str().unwrap();
        assert!(
            tag.trim().trim_start_matches('v').starts_with(version),
            "{tag}: ran {version}"
        );
        let first = &out["seen"][0];
        assert_eq!(first["args"], Value::Array(arguments), "{tag}");
        assert_eq!(first["queue_name"], "critical", "{tag}");
        assert_eq!(first["priority"], 3, "{tag}");
        assert_eq!(first["locale"], "fr", "{tag}");
        assert_eq!(first["zone"], "Europe/Paris", "{tag}");
        assert_eq!(first["provider_job_id"], json!(jid), "{tag}");
        assert_eq!(first["executions"], 1, "{tag}");
        assert_eq!(first["scheduled_at"], Value::Null, "{tag}");
        let second = &out["seen"][1];
        assert_eq!(second["args"], json!(["later"]), "{tag}");
        assert_eq!(second["provider_job_id"], json!(later), "{tag}");
        // 7.1+ read `scheduled_at` back to the nanosecond; 7.0 does not read it.
        let wrote = chrono::DateTime::parse_from_rfc3339(
            written["args"][0]["scheduled_at"].as_str().unwrap(),
        )
        .unwrap()
        .timestamp_nanos_opt()
        .unwrap();
        if version.starts_with("7.0") {
            assert_eq!(second["scheduled_at"], Value::Null, "{tag}");
        } else {
            assert_eq!(second["scheduled_at"], json!(wrote), "{tag}");
        }
        versions += 1;
        eprintln!("{tag}: ActiveJob {version} ran both jobs as Rust wrote them");
    }
    assert!(versions > 0, "no version in OXIDEKIQ_AJ_LIVE");
}
