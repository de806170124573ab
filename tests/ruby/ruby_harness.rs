//! The harness's Ruby side works: scripts run against the test's Redis, the Sidekiq 6.4 Web UI
//! renders, a real Ruby `sidekiq` server runs jobs and stops on TERM, and child processes are driven
//! by signal.
use crate::support;

use std::path::Path;
use std::time::Duration;

use oxidekiq::Job;
use support::{
    LoggedProcess, Oxidekiq, RedisServer, RubySidekiq, ruby, ruby_activejob, wait_until,
};

fn rpop(redis: &RedisServer, key: &str) -> Option<String> {
    redis::cmd("RPOP")
        .arg(key)
        .query(&mut redis.conn())
        .unwrap()
}

#[test]
fn a_ruby_script_enqueues_into_the_tests_own_redis() {
    let redis = RedisServer::start();
    let out = ruby(
        r#"puts Sidekiq::Client.push("class" => "HardWorker", "args" => ["bob", 5])"#,
        &redis.url(),
    );
    let jid = out.trimmed().to_string();
    let raw = rpop(&redis, "queue:default").expect("the job is in queue:default");
    let job = Job::from_str(&raw).unwrap();
    assert_eq!(job.jid(), jid);
    assert_eq!(job.class(), "HardWorker");
    assert_eq!(job.args_json(), r#"["bob",5]"#);
    assert!(
        !out.stderr.contains("sadd"),
        "the preamble silences redis-rb's deprecation noise: {}",
        out.stderr
    );
}

#[test]
fn an_activejob_script_enqueues_through_rails_sidekiq_adapter() {
    let redis = RedisServer::start();
    let out = ruby_activejob(
        r#"
        class WelcomeEmailJob < ActiveJob::Base
          queue_as :mailers
          def perform(*); end
        end
        puts WelcomeEmailJob.perform_later(42, { "locale" => "fr" }).provider_job_id
        "#,
        &redis.url(),
    );
    let raw = rpop(&redis, "queue:mailers").expect("the job is in queue:mailers");
    let job = Job::from_str(&raw).unwrap();
    assert_eq!(job.jid(), out.trimmed());
    assert_eq!(
        job.class(),
        "ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper"
    );
    assert_eq!(job.worker_class(), "WelcomeEmailJob");
    let args: serde_json::Value = serde_json::from_str(job.args_json()).unwrap();
    assert_eq!(
        args[0]["arguments"],
        serde_json::json!([42, {"locale": "fr", "_aj_symbol_keys": []}])
    );
}

#[test]
#[should_panic(expected = "boom from ruby")]
fn a_failing_ruby_script_panics_with_its_error() {
    let redis = RedisServer::start();
    ruby(r#"raise "boom from ruby""#, &redis.url());
}

#[test]
fn the_web_ui_renders_every_page_on_an_empty_redis() {
    let redis = RedisServer::start();
    for path in ["/", "/busy", "/queues", "/retries", "/scheduled", "/morgue"] {
        let (status, body) = support::web_ui_get(&redis.url(), path);
        assert_eq!(status, 200, "{path}: {body}");
        assert!(
            body.contains("Sidekiq"),
            "{path} renders the Sidekiq layout"
        );
    }
    // Sidekiq 6.x calls the dead set "morgue"; there is no /dead page.
    assert_eq!(support::web_ui_get(&redis.url(), "/dead").0, 404);
}

#[test]
fn the_web_ui_shows_jobs_written_straight_into_redis() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let enqueued = r#"{"retry":true,"queue":"default","args":["harness-arg-1"],"class":"HarnessEnqueuedJob","jid":"0123456789abcdef01234567","created_at":1795291648.4,"enqueued_at":1795291648.4}"#;
    let retried = r#"{"retry":true,"queue":"default","args":[7],"class":"HarnessRetriedJob","jid":"abcdefabcdefabcdefabcdef","created_at":1795291648.4,"enqueued_at":1795291648.4,"error_message":"harness failure","error_class":"RuntimeError","failed_at":1795291648.5,"retry_count":0}"#;
    let _: () = redis::pipe()
        .cmd("SADD")
        .arg("queues")
        .arg("default")
        .cmd("LPUSH")
        .arg("queue:default")
        .arg(enqueued)
        .cmd("ZADD")
        .arg("retry")
        .arg(1795291670.5)
        .arg(retried)
        .query(&mut c)
        .unwrap();

    let (status, body) = support::web_ui_get(&redis.url(), "/queues/default");
    assert_eq!(status, 200);
    assert!(body.contains("HarnessEnqueuedJob"), "{body}");
    assert!(body.contains("harness-arg-1"), "{body}");

    let (status, body) = support::web_ui_get(&redis.url(), "/retries");
    assert_eq!(status, 200);
    assert!(body.contains("HarnessRetriedJob"), "{body}");
    assert!(body.contains("harness failure"), "{body}");
}

#[test]
fn a_real_ruby_sidekiq_runs_a_job_and_leaves_processes_on_term() {
    let redis = RedisServer::start();
    let mut sidekiq = RubySidekiq::start(
        &redis.url(),
        r#"
        class HarnessJob
          include Sidekiq::Worker
          def perform(value)
            Sidekiq.redis { |c| c.set("harness:ran:#{jid}", value) }
          end
        end
        "#,
        &["default"],
        2,
    );
    let mut conn = redis.conn();
    let identity = sidekiq
        .wait_for_identity(&mut conn, Duration::from_secs(20))
        .expect("sidekiq registers in `processes`");

    let jid = ruby(
        r#"puts Sidekiq::Client.push("class" => "HarnessJob", "args" => ["from ruby"])"#,
        &redis.url(),
    )
    .trimmed()
    .to_string();
    let key = format!("harness:ran:{jid}");
    assert!(
        wait_until(Duration::from_secs(15), || {
            redis::cmd("EXISTS")
                .arg(&key)
                .query::<bool>(&mut conn)
                .unwrap()
        }),
        "the Ruby job ran"
    );
    let value: String = redis::cmd("GET").arg(&key).query(&mut conn).unwrap();
    assert_eq!(value, "from ruby");

    sidekiq.signal("TERM");
    let status = sidekiq
        .wait_exit(Duration::from_secs(15))
        .expect("sidekiq exits on TERM");
    assert!(status.success(), "{status}");
    let members: Vec<String> = redis::cmd("SMEMBERS")
        .arg("processes")
        .query(&mut conn)
        .unwrap();
    assert!(!members.contains(&identity), "{members:?}");
    assert!(sidekiq.log().contains("Bye!"), "{}", sidekiq.log());
}

#[test]
fn a_logged_process_captures_output_and_takes_signals_by_name() {
    let mut p = LoggedProcess::spawn(
        "sh",
        Path::new("/bin/sh"),
        &[
            "-c",
            r#"trap 'echo "got TERM"; exit 3' TERM; echo "started $GREETING"; while :; do sleep 0.05; done"#,
        ],
        &[("GREETING", "hello")],
    );
    assert!(p.wait_for_log("started hello", Duration::from_secs(5)));
    assert_eq!(
        p.wait_exit(Duration::from_millis(100)),
        None,
        "still running"
    );
    p.signal("TERM");
    let status = p.wait_exit(Duration::from_secs(5)).expect("exits on TERM");
    assert_eq!(status.code(), Some(3));
    assert!(p.log().contains("got TERM"), "{}", p.log());
}

#[test]
fn kill_9_stops_a_process_that_ignores_term() {
    let mut p = LoggedProcess::spawn(
        "sh",
        Path::new("/bin/sh"),
        &[
            "-c",
            "trap '' TERM; echo ready; while :; do sleep 0.05; done",
        ],
        &[],
    );
    assert!(p.wait_for_log("ready", Duration::from_secs(5)));
    p.signal("TERM");
    assert_eq!(
        p.wait_exit(Duration::from_millis(300)),
        None,
        "TERM ignored"
    );
    let status = p.kill_9();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
}

#[test]
fn the_oxidekiq_binary_is_looked_up_in_the_workspace_target_dir() {
    let bin = Oxidekiq::binary();
    assert_eq!(bin.file_name().unwrap(), "oxidekiq");
    if std::env::var_os("OXIDEKIQ_BIN").is_none() {
        assert_eq!(bin.parent().unwrap().file_name().unwrap(), "debug");
    }
}
