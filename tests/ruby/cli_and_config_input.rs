//! What the binary's subcommands, `--help`, config reading and logs make of careless or hostile input
//! (issue 27, and issue 26 item 6), driven from outside as a user or an attacker would: the real
//! `oxidekiq` binary against a real `redis-server`, and Ruby where it sets the expectation (ERB, the
//! Ruby router, a Sidekiq 6.4 process).
//!
//! - Names read from Redis (queues, classes, shares, not UTF-8, control and bidi characters) never make
//!   `route`, `routes`, `check` or `report` fail, and are escaped in their output and in log lines.
//! - A password is stored and logged redacted, and never echoed from flags or `sidekiq.yml`.
//! - Misconfiguration is refused at start (a hand-off to a served queue), an error (`route` of an
//!   unknown class), or warned (ignored `:redis:` keys); an unset ERB variable is empty, as in Ruby.
//!
//! No test asserts a duration: each waits for its outcome with a generous timeout.
use crate::support;

use std::time::Duration;

use redis::Commands;

/// Generous: a loaded 2-core machine may be slow, and nothing here is timed.
const PATIENCE: Duration = Duration::from_secs(60);

/// A HardWorker payload of about `size` bytes.
fn big_job(queue: &str, jid: &str, size: usize) -> String {
    serde_json::json!({
        "class": "HardWorker", "args": ["x".repeat(size), 1], "queue": queue, "jid": jid,
        "created_at": support::now(), "enqueued_at": support::now(),
    })
    .to_string()
}

#[test]
fn a_redis_password_in_a_panic_or_error_message_is_stored_and_logged_redacted() {
    let redis = support::RedisServer::start();
    let mut conn = redis.conn();
    // Passwords with a space: the redaction must not stop at it.
    for (mode, id) in [
        ("panic", "redis://:my PANIC3@cache.internal:6379/0"),
        ("fail", "rediss://app:fail PW4@cache.internal"),
    ] {
        let payload = serde_json::json!({
            "class": "ChaosJob", "args": [mode, 0, id], "queue": "default",
            "jid": format!("{mode}jid"), "retry": true,
            "created_at": support::now(), "enqueued_at": support::now(),
        });
        let _: () = conn.lpush("queue:default", payload.to_string()).unwrap();
    }
    let ox = support::Oxidekiq::start(&redis.url(), &["-q", "default"]);
    assert!(
        support::wait_until(PATIENCE, || conn.zcard::<_, usize>("retry").unwrap() == 2),
        "the jobs never reached the retry set:\n{}",
        ox.log()
    );
    // Both jobs' log lines, the ones a password would be in.
    assert!(ox.wait_for_log("job failed", PATIENCE));
    assert!(ox.wait_for_log("job panicked", PATIENCE), "{}", ox.log());
    let retries: Vec<String> = conn.zrange("retry", 0, -1).unwrap();
    for r in &retries {
        let v: serde_json::Value = serde_json::from_str(r).unwrap();
        let message = v["error_message"].as_str().unwrap();
        assert!(message.contains("REDACTED"), "{message}");
        assert!(
            !message.contains("PANIC3") && !message.contains("PW4"),
            "{message}"
        );
    }
    let log = ox.log();
    assert!(log.contains("job panicked"), "{log}");
    assert!(!log.contains("PANIC3") && !log.contains("PW4"), "{log}");
}

#[test]
fn handoff_to_a_queue_the_process_serves_is_refused_at_start() {
    let redis = support::RedisServer::start();
    let mut ox = support::Oxidekiq::start(&redis.url(), &["-q", "default", "--handoff", "default"]);
    let status = ox.wait_exit(PATIENCE);
    let log = ox.log();
    assert_eq!(status.and_then(|s| s.code()), Some(2), "{log}");
    assert!(
        log.contains("--handoff default") && log.contains("serves"),
        "{log}"
    );
}

#[test]
fn route_finds_the_live_process_of_a_queue_with_a_bar_in_its_name() {
    let redis = support::RedisServer::start();
    let ox = support::Oxidekiq::start(&redis.url(), &["-q", "a|b_rust", "--beat-interval", "0.5"]);
    let mut conn = redis.conn();
    assert!(
        support::wait_until(PATIENCE, || {
            let keys: Vec<String> = conn.keys("oxidekiq:serving:*").unwrap();
            keys.iter().any(|k| k.ends_with("|HardWorker"))
        }),
        "never wrote its serving keys:\n{}",
        ox.log()
    );
    let (code, out, err) = support::run_cli(&redis.url(), &["route", "HardWorker", "10"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("served by live oxidekiq on: a|b_rust"),
        "{out}"
    );
    let (code, out, err) = support::run_cli(&redis.url(), &["routes"]);
    assert_eq!(code, 0, "{out}{err}");
    let row = out.lines().find(|l| l.starts_with("HardWorker")).unwrap();
    assert_eq!(
        row.split_whitespace().nth(2),
        Some("1"),
        "one live process: {out}"
    );
}

#[test]
fn subcommand_flags_are_taken_after_the_subcommand_name_too() {
    let redis = support::RedisServer::start();
    let (code, out, err) = support::run_cli(&redis.url(), &["check", "-q", "onlyhere", "-c", "3"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("queue:onlyhere"),
        "the -q after `check` is used: {out}"
    );
    let (code, out, err) = support::run_cli(&redis.url(), &["-q", "before", "check"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("queue:before"), "{out}");
}

#[test]
fn route_of_a_class_no_worker_knows_is_an_error_unless_forced() {
    let redis = support::RedisServer::start();
    let mut conn = redis.conn();
    let (code, out, err) = support::run_cli(&redis.url(), &["route", "NoSuchClass", "10"]);
    assert_ne!(code, 0, "{out}{err}");
    assert!(
        err.contains("NoSuchClass") && err.contains("--force"),
        "{err}"
    );
    let share: Option<String> = conn.hget("oxidekiq:routes", "NoSuchClass").unwrap();
    assert_eq!(share, None, "nothing routed");
    let (code, out, err) =
        support::run_cli(&redis.url(), &["route", "NoSuchClass", "10", "--force"]);
    assert_eq!(code, 0, "{out}{err}");
    let share: Option<String> = conn.hget("oxidekiq:routes", "NoSuchClass").unwrap();
    assert_eq!(share.as_deref(), Some("10"));
    // A roll back needs no worker.
    let (code, out, err) = support::run_cli(
        &redis.url(),
        &["route", "NoSuchClass", "0", "--settle", "0"],
    );
    assert_eq!(code, 0, "{out}{err}");
}

#[test]
fn help_shows_no_rustdoc_link_syntax() {
    let redis = support::RedisServer::start();
    for args in [&["--help"][..], &["route", "--help"], &["check", "--help"]] {
        let (code, out, err) = support::run_cli(&redis.url(), args);
        assert_eq!(code, 0, "{args:?}: {err}");
        assert!(
            !out.contains("[`") && !out.contains("`]"),
            "{args:?}:\n{out}"
        );
    }
}

#[test]
fn an_unset_variable_in_sidekiq_yml_is_an_empty_string_as_ruby_erb_makes_it() {
    let redis = support::RedisServer::start();
    let template = "---\n:queues:\n  - \"erb<%= ENV[\"OXIDEKIQ_UNSET_FOR_TEST\"] %>q\"\n:concurrency: <%= ENV[\"OXIDEKIQ_UNSET_FOR_TEST\"] || 3 %>\n";
    // What Ruby's ERB makes of it, in this run.
    let ruby = support::ruby(
        &format!(
            "require 'erb'; require 'yaml'; ENV.delete('OXIDEKIQ_UNSET_FOR_TEST'); \
             puts YAML.safe_load(ERB.new({template:?}).result, permitted_classes: [Symbol])[:queues].first"
        ),
        &redis.url(),
    );
    let queue = ruby.trimmed().to_string();
    assert!(!queue.is_empty(), "{}", ruby.stderr);
    let dir = support::temp_dir("erb");
    std::fs::write(dir.join("sidekiq.yml"), template).unwrap();
    let config = dir.join("sidekiq.yml");
    let (code, out, err) =
        support::run_cli(&redis.url(), &["-C", config.to_str().unwrap(), "check"]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(&format!("queue:{queue},")), "{queue}: {out}");
}

#[test]
fn routes_reads_each_stored_share_as_the_ruby_router_does() {
    let redis = support::RedisServer::start();
    let mut conn = redis.conn();
    let stored = [
        ("Share300", "300"),
        ("ShareNeg", "-5"),
        ("ShareLead", " 42abc"),
        ("ShareUnderscore", "1_0"),
        ("ShareWord", "abc"),
        ("ShareHuge", "99999999999999999999999"),
        ("SharePlus", "+7"),
        ("ShareFloat", "4.9"),
        ("ShareTab", "\t12"),
    ];
    for (class, v) in stored {
        let _: () = conn.hset("oxidekiq:routes", class, v).unwrap();
    }
    let router = format!("{}/ruby/oxidekiq.rb", env!("CARGO_MANIFEST_DIR"));
    let ruby = support::ruby(
        &format!(
            "require {router:?}; require 'json'; \
             puts JSON.generate(Oxidekiq::Cache.new(3).routes(Sidekiq.redis_pool))"
        ),
        &redis.url(),
    );
    let want: std::collections::BTreeMap<String, u64> =
        serde_json::from_str(ruby.trimmed()).unwrap_or_else(|e| panic!("{e}: {ruby:?}"));
    assert_eq!(want.len(), stored.len(), "{want:?}");
    let (code, out, err) = support::run_cli(&redis.url(), &["routes"]);
    assert_eq!(code, 0, "{out}{err}");
    for (class, share) in &want {
        let row = out
            .lines()
            .find(|l| l.split_whitespace().next() == Some(class))
            .unwrap_or_else(|| panic!("no row for {class}:\n{out}"));
        assert_eq!(
            row.split_whitespace().nth(1),
            Some(format!("{share}%").as_str()),
            "{class}: Ruby reads {share}:\n{out}"
        );
    }
}

#[test]
fn names_that_are_not_utf8_never_make_route_check_or_routes_fail() {
    let redis = support::RedisServer::start();
    let mut conn = redis.conn();
    let _: () = conn.sadd("queues", &b"\xff\xfe_rust"[..]).unwrap();
    let _: () = conn.hset("oxidekiq:routes", &b"\xffBad"[..], "5").unwrap();
    let _: () = conn.sadd("queues", "default_rust").unwrap();
    for i in 0..3 {
        let _: () = conn
            .lpush(
                "queue:default_rust",
                big_job("default_rust", &format!("u{i}"), 10),
            )
            .unwrap();
    }
    let (code, out, err) =
        support::run_cli(&redis.url(), &["route", "HardWorker", "0", "--settle", "0"]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(conn.llen::<_, usize>("queue:default").unwrap(), 3, "{out}");
    assert_eq!(conn.llen::<_, usize>("queue:default_rust").unwrap(), 0);
    let (code, out, err) = support::run_cli(&redis.url(), &["check"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("not UTF-8"), "{out}");
    let (code, out, err) = support::run_cli(&redis.url(), &["routes"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("HardWorker"), "{out}");
}

#[test]
fn cli_output_escapes_control_and_bidi_characters_from_redis() {
    const EVIL: &str = "Evil\nFAKE LINE\u{1b}[31m\u{202e}";
    let redis = support::RedisServer::start();
    let mut conn = redis.conn();
    let _: () = conn.hset("oxidekiq:routes", EVIL, "5").unwrap();
    let _: () = conn.sadd("queues", EVIL).unwrap();
    let payload = serde_json::json!({
        "class": "HardWorker", "args": [{ EVIL: 1 }, 2], "queue": "default", "jid": "e",
    });
    let _: () = conn.lpush("queue:default", payload.to_string()).unwrap();
    // Sidekiq 8's metrics of 10:00 on 2026-01-01 (`j|%y%m%d|%-H:%M`).
    let field = format!("{EVIL}|p");
    let _: () = conn.hset("j|260101|10:00", &field, 5).unwrap();
    let _: () = conn
        .hset("j|260101|10:00", format!("{EVIL}|ms"), 100)
        .unwrap();
    for args in [
        &["routes"][..],
        &["check"],
        &["report", "--at", "2026-01-01T10:00:30Z"],
    ] {
        let (_, out, err) = support::run_cli(&redis.url(), args);
        assert!(out.contains("Evil"), "{args:?} lists it:\n{out}{err}");
        assert!(
            !out.contains('\u{1b}') && !out.contains('\u{202e}'),
            "{args:?}:\n{out}"
        );
        assert!(
            !out.lines().any(|l| l.starts_with("FAKE")),
            "{args:?} printed a line from Redis:\n{out}"
        );
    }
}

#[test]
fn report_with_only_sidekiq_6_alive_says_its_counts_are_rust_runs_only() {
    let redis = support::RedisServer::start();
    let mut conn = redis.conn();
    let jobs_rb = "class LegacyJob\n  include Sidekiq::Worker\n  def perform; end\nend\n";
    let rb = support::RubySidekiq::start(&redis.url(), jobs_rb, &["default"], 2);
    assert!(
        rb.wait_for_identity(&mut conn, PATIENCE).is_some(),
        "{}",
        rb.log()
    );
    let ox = support::Oxidekiq::start(&redis.url(), &["-q", "rust", "--beat-interval", "0.5"]);
    support::ruby(
        "3.times { |i| Sidekiq::Client.push('class' => 'HardWorker', 'args' => ['a', 1], 'queue' => 'rust') }\n\
         2.times { Sidekiq::Client.push('class' => 'LegacyJob', 'args' => []) }",
        &redis.url(),
    );
    let mut out = String::new();
    assert!(
        support::wait_until(PATIENCE, || {
            out = support::run_cli(&redis.url(), &["report"]).1;
            out.lines()
                .any(|l| l.starts_with("HardWorker") && l.split_whitespace().nth(1) == Some("3"))
        }),
        "the Rust runs never showed:\n{out}\n{}",
        ox.log()
    );
    let first = out.lines().next().unwrap();
    assert!(
        first.contains("Rust runs only") && first.contains("Ruby runs are not in these counts"),
        "the headline says where the counts come from: {out}"
    );
    assert!(out.contains("jobs waiting"), "{out}");
}

#[test]
fn sentinel_flags_and_sidekiq_yml_values_never_echo_a_password() {
    let redis = support::RedisServer::start();
    for sentinel in [
        "redis://:S3NTPW@h:notaport",
        "u:S3NTPW@h",
        "rediss://u:S3NTPW@h:1/x?y",
    ] {
        let (code, out, err) = support::run_cli(&redis.url(), &["--sentinel", sentinel, "check"]);
        assert_eq!(code, 2, "{sentinel}: {out}{err}");
        assert!(!err.contains("S3NTPW") && !out.contains("S3NTPW"), "{err}");
    }
    let dir = support::temp_dir("yml-secret");
    let config = dir.join("sidekiq.yml");
    std::fs::write(&config, ":concurrency: \"redis://:YMLPW@cache:6379\"\n").unwrap();
    let (code, out, err) =
        support::run_cli(&redis.url(), &["-C", config.to_str().unwrap(), "check"]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("concurrency"), "{err}");
    assert!(!err.contains("YMLPW") && !out.contains("YMLPW"), "{err}");
}

#[test]
fn ignored_redis_keys_of_sidekiq_yml_are_warned_in_the_log() {
    let redis = support::RedisServer::start();
    let dir = support::temp_dir("yml-keys");
    let config = dir.join("sidekiq.yml");
    std::fs::write(
        &config,
        format!(":redis:\n  :url: {}\n  :driver: hiredis\n", redis.url()),
    )
    .unwrap();
    let (code, out, err) =
        support::run_cli(&redis.url(), &["-C", config.to_str().unwrap(), "check"]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("WARN: sidekiq.yml `redis:` key `driver` not used by oxidekiq"),
        "{out}{err}"
    );
}

#[test]
fn a_class_name_cannot_split_a_json_line_or_fake_fields_in_a_text_line() {
    let redis = support::RedisServer::start();
    let mut conn = redis.conn();
    let classes = [
        "Sep\u{2028}Next\u{85}Bidi\u{202e}Del\u{7f}",
        "X jid=forged INFO: done",
    ];
    for (i, class) in classes.iter().enumerate() {
        let payload = serde_json::json!({
            "class": class, "args": [], "queue": "default", "jid": format!("j{i}"), "retry": 0,
            "created_at": support::now(), "enqueued_at": support::now(),
        });
        let _: () = conn.lpush("queue:default", payload.to_string()).unwrap();
    }
    // JSON: the separators are escaped, and the line parses back to the same class.
    let ox = support::Oxidekiq::start(&redis.url(), &["-q", "default", "--log-format", "json"]);
    assert!(
        support::wait_until(PATIENCE, || conn.zcard::<_, usize>("dead").unwrap() == 2),
        "{}",
        ox.log()
    );
    // Both jobs' `fail` lines.
    assert!(
        support::wait_until(PATIENCE, || ox
            .log()
            .matches("\"message\":\"fail\"")
            .count()
            >= 2),
        "{}",
        ox.log()
    );
    let log = ox.log();
    for c in ['\u{2028}', '\u{85}', '\u{202e}', '\u{7f}'] {
        assert!(!log.contains(c), "{c:?} raw in:\n{log}");
    }
    let parsed: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(parsed.iter().any(|l| l["class"] == classes[0]), "{log}");
    drop(ox);

    // Text: the class with spaces and `=` is one quoted value.
    let _: () = conn.del("dead").unwrap();
    let payload = serde_json::json!({
        "class": classes[1], "args": [], "queue": "default", "jid": "j2", "retry": 0,
    });
    let _: () = conn.lpush("queue:default", payload.to_string()).unwrap();
    let ox = support::Oxidekiq::start(&redis.url(), &["-q", "default"]);
    // The job's one `fail` line, the line read below.
    assert!(ox.wait_for_log("INFO: fail", PATIENCE), "{}", ox.log());
    let log = ox.log();
    assert!(
        log.contains(r#"class="X jid=forged INFO: done" jid=j2 "#),
        "{log}"
    );
    assert!(!log.contains(" class=X jid=forged"), "{log}");
}
