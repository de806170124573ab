//! Hostile and careless input, round two (issue 27, and issue 26 item 6), driven from outside as a
//! user or an attacker would: the real `oxidekiq` binary against a real `redis-server`.
//!
//! - A `/metrics` scrape costs Redis a bounded, small amount whatever the payload sizes and the
//!   scrape rate (measured with Redis's own `total_net_output_bytes`).
//! - A flood of idle HTTP clients under a low `ulimit -n` cannot take the descriptors the job side
//!   needs to reconnect to Redis.
//!
//! No test asserts a duration: each waits for its outcome with a generous timeout.
mod support;

use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use redis::Commands;

/// Generous: a loaded 2-core machine may be slow, and nothing here is timed.
const PATIENCE: Duration = Duration::from_secs(60);

/// A field of `INFO <section>` as a number.
fn info_field(conn: &mut redis::Connection, section: &str, field: &str) -> u64 {
    let info: String = redis::cmd("INFO").arg(section).query(conn).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in INFO {section}"))
}

/// The value of the sample `name{...label...}` in a text exposition.
fn sample(body: &str, name: &str, label: &str) -> Option<f64> {
    body.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .find_map(|l| l.rsplit_once(' ')?.1.parse().ok())
}

/// Starts the binary with `--http` on a free port; returns it and the port once `/health` answers.
fn start_with_http(redis_url: &str, args: &[&str]) -> (support::Oxidekiq, u16) {
    let port = support::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut all = vec!["--http", &addr];
    all.extend_from_slice(args);
    let ox = support::Oxidekiq::start(redis_url, &all);
    assert!(
        support::wait_until(PATIENCE, || support::http_get(port, "/health")
            .is_some_and(|r| r.0 == 200)),
        "the endpoint never answered:\n{}",
        ox.log()
    );
    (ox, port)
}

#[test]
fn metrics_scrapes_cost_redis_a_bounded_amount_whatever_the_payload_sizes() {
    const QUEUES: usize = 4;
    const PAYLOAD: usize = 1 << 20;
    let redis = support::RedisServer::start();
    let mut conn = redis.conn();
    let names: Vec<String> = (0..QUEUES).map(|i| format!("big{i}")).collect();
    let mut args = vec!["--beat-interval", "0.5"];
    for n in &names {
        args.extend(["-q", n.as_str()]);
    }
    let (ox, port) = start_with_http(&redis.url(), &args);
    // Quiet first, so the jobs stay queued (only the endpoint reads them).
    ox.signal("TSTP");
    assert!(
        ox.wait_for_log("quieting", PATIENCE),
        "never quiet:\n{}",
        ox.log()
    );
    let enqueued_at = support::now() - 100.0;
    for (i, n) in names.iter().enumerate() {
        // A nested `enqueued_at` inside args must not be taken for the job's own (serde_json writes
        // the keys in order: `args` first); the last queue's job has its own first, far from its tail.
        let payload = if i + 1 < names.len() {
            serde_json::json!({
                "class": "NoopJob",
                "args": [{"enqueued_at": 1.0}, "x".repeat(PAYLOAD)],
                "queue": n,
                "jid": format!("{n}jid"),
                "created_at": enqueued_at,
                "enqueued_at": enqueued_at,
            })
            .to_string()
        } else {
            format!(
                r#"{{"enqueued_at":{enqueued_at},"class":"NoopJob","queue":"{n}","args":["{}"]}}"#,
                "x".repeat(PAYLOAD)
            )
        };
        let _: () = conn.lpush(format!("queue:{n}"), payload).unwrap();
    }
    let mut body = String::new();
    assert!(
        support::wait_until(PATIENCE, || {
            body = support::http_get(port, "/metrics").map_or(String::new(), |r| r.2);
            sample(&body, "oxidekiq_queue_size", "queue=\"big3\"") == Some(1.0)
        }),
        "the queue size never showed:\n{body}"
    );
    for n in &names {
        let label = format!("queue=\"{n}\"");
        let latency = sample(&body, "oxidekiq_queue_latency_seconds", &label).unwrap();
        assert!((90.0..1000.0).contains(&latency), "{n}: {latency}\n{body}");
    }

    let before = info_field(&mut conn, "stats", "total_net_output_bytes");
    let scrapers: Vec<_> = (0..8)
        .map(|_| {
            std::thread::spawn(move || {
                for _ in 0..10 {
                    assert!(support::http_get(port, "/metrics").is_some_and(|r| r.0 == 200));
                }
            })
        })
        .collect();
    for s in scrapers {
        s.join().unwrap();
    }
    let sent = info_field(&mut conn, "stats", "total_net_output_bytes") - before;
    // 80 scrapes used to send every queue's oldest payload each: 80 × 4 MiB. The bound is less
    // than what one such scrape sent, whatever the time the scrapes took (beats included).
    assert!(
        sent < PAYLOAD as u64,
        "80 scrapes made Redis send {sent} bytes"
    );
}

#[test]
fn idle_http_clients_cannot_take_the_descriptors_redis_needs() {
    let redis = support::RedisServer::start();
    let mut conn = redis.conn();
    let port = support::free_port();
    let addr = format!("127.0.0.1:{port}");
    let bin = support::Oxidekiq::binary();
    let bin = bin.to_str().unwrap();
    let redis_url = redis.url();
    let ox = support::LoggedProcess::spawn(
        "oxidekiq",
        std::path::Path::new("/bin/sh"),
        &[
            "-c",
            "ulimit -n 128 && exec \"$@\"",
            "sh",
            bin,
            "--http",
            &addr,
            "-q",
            "default",
        ],
        &[("REDIS_URL", &redis_url)],
    );
    assert!(
        support::wait_until(PATIENCE, || support::http_get(port, "/health")
            .is_some_and(|r| r.0 == 200)),
        "the endpoint never answered:\n{}",
        ox.log()
    );

    // 300 idle clients, kept at 300 for as long as the test runs (the server drops each after its
    // header timeout; a closed one is opened again).
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut held: Vec<TcpStream> = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                held.retain(|s| {
                    let mut b = [0u8; 1];
                    s.set_nonblocking(true).unwrap();
                    !matches!(std::io::Read::read(&mut &*s, &mut b), Ok(0))
                });
                while held.len() < 300 {
                    match TcpStream::connect(("127.0.0.1", port)) {
                        Ok(s) => held.push(s),
                        Err(_) => break,
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    std::thread::sleep(Duration::from_secs(2));
    // Every connection of the process is cut: it must open new ones while the flood lasts.
    let _: redis::Value = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .query(&mut conn)
        .unwrap();
    let payload = serde_json::json!({
        "class": "NoopJob", "args": [], "queue": "default", "jid": "floodjid",
        "created_at": support::now(), "enqueued_at": support::now(),
    });
    let _: () = conn.lpush("queue:default", payload.to_string()).unwrap();
    let done = support::wait_until(PATIENCE, || {
        let processed: Option<u64> = conn.get("stat:processed").unwrap();
        processed == Some(1)
    });
    stop.store(true, Ordering::Relaxed);
    flood.join().unwrap();
    let log = ox.log();
    assert!(done, "the job never ran during the flood:\n{log}");
    assert!(!log.contains("Too many open files"), "{log}");
}

#[test]
fn handoff_remembers_and_logs_a_bounded_amount_per_made_up_class() {
    const LONG: usize = 30;
    const NAME: usize = 100_000;
    let redis = support::RedisServer::start();
    let mut conn = redis.conn();
    let mut pushed = Vec::new();
    for i in 0..LONG {
        let class = format!("{i:03}{}", "C".repeat(NAME));
        pushed.push(serde_json::json!({
            "class": class, "args": [i], "queue": "shared", "jid": format!("long{i}"),
            "created_at": support::now(), "enqueued_at": support::now(),
        }));
    }
    pushed.push(serde_json::json!({
        "class": "Legacy::Mailer", "args": [1], "queue": "shared", "jid": "short",
        "created_at": support::now(), "enqueued_at": support::now(),
    }));
    for p in &pushed {
        let _: () = conn.lpush("queue:shared", p.to_string()).unwrap();
    }
    let ox = support::Oxidekiq::start(&redis.url(), &["-q", "shared", "--handoff", "ruby"]);
    assert!(
        support::wait_until(PATIENCE, || conn.llen::<_, usize>("queue:ruby").unwrap()
            == pushed.len()),
        "not every job was handed off:\n{}",
        &ox.log()[..4000.min(ox.log().len())]
    );
    let handed: Vec<String> = conn.lrange("queue:ruby", 0, -1).unwrap();
    for p in &pushed {
        assert!(handed.contains(&p.to_string()), "a job was changed");
    }
    let counts: std::collections::BTreeMap<Vec<u8>, u64> =
        conn.hgetall("oxidekiq:handoff").unwrap();
    assert_eq!(
        counts.get(&b"(other)"[..]),
        Some(&(LONG as u64)),
        "{:?}",
        counts.keys()
    );
    assert_eq!(counts.get(&b"Legacy::Mailer"[..]), Some(&1));
    assert_eq!(counts.len(), 2);
    assert!(ox.wait_for_log("handing off jobs of Legacy::Mailer", PATIENCE));
    std::thread::sleep(Duration::from_millis(300));
    let log = ox.log();
    // Each made-up name was written three times per line, once per job: 9 MB before.
    assert!(log.len() < 64 * 1024, "{} bytes of log", log.len());
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
    assert!(ox.wait_for_log("job failed", PATIENCE));
    std::thread::sleep(Duration::from_millis(300));
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

/// A HardWorker payload of about `size` bytes.
fn big_job(queue: &str, jid: &str, size: usize) -> String {
    serde_json::json!({
        "class": "HardWorker", "args": ["x".repeat(size), 1], "queue": queue, "jid": jid,
        "created_at": support::now(), "enqueued_at": support::now(),
    })
    .to_string()
}

#[test]
fn check_never_reads_payloads_over_the_limit_and_route_0_reads_a_bounded_amount_at_once() {
    const MB: usize = 1 << 20;
    let redis = support::RedisServer::start();
    let mut conn = redis.conn();
    // check: three payloads over the default 16 MiB --max-payload-bytes, and a small one.
    for i in 0..3 {
        let _: () = conn
            .lpush(
                "queue:default",
                big_job("default", &format!("big{i}"), 20 * MB),
            )
            .unwrap();
    }
    let _: () = conn
        .lpush("queue:default", big_job("default", "small", 10))
        .unwrap();
    let before = info_field(&mut conn, "stats", "total_net_output_bytes");
    let (code, out, err) = support::run_cli(&redis.url(), &["-q", "default", "check"]);
    let sent = info_field(&mut conn, "stats", "total_net_output_bytes") - before;
    assert!(out.contains("4 payloads read"), "{out}{err}");
    assert_eq!(code, 0, "{out}{err}");
    assert!(sent < 16 * MB as u64, "check made Redis send {sent} bytes");

    // route 0: 24 jobs of 6 MiB on the Rust queue are all moved back, a few at a time.
    let _: () = conn.del("queue:default").unwrap();
    for i in 0..24 {
        let _: () = conn
            .lpush(
                "queue:default_rust",
                big_job("default_rust", &format!("r{i}"), 6 * MB),
            )
            .unwrap();
    }
    let _: () = conn.sadd("queues", "default_rust").unwrap();
    let out = std::process::Command::new("/usr/bin/time")
        .args(["-f", "maxrss_kb=%M"])
        .arg(support::Oxidekiq::binary())
        .args(["route", "HardWorker", "0", "--settle", "0"])
        .env("REDIS_URL", redis.url())
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("moved 24 waiting job(s)"), "{text}");
    let rss_kb: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("maxrss_kb="))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    eprintln!("route 0 peak RSS: {rss_kb} kB");
    // Read all at once (one LRANGE of up to 1 000), the 144 MiB of jobs were all in memory.
    assert!(rss_kb < 144 * 1024, "route 0 peaked at {rss_kb} kB");
    assert_eq!(conn.llen::<_, usize>("queue:default").unwrap(), 24);
}

/// The peak resident memory of process `pid` in kB (`VmHWM`).
fn peak_rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Payloads over the limit (the default 16 MiB) among a backlog of small jobs, so that the batches the
/// worker fetches through its fast path (one transaction while a queue holds a backlog) hold them: they
/// reach the dead set without the worker ever reading one (its peak RSS stays below one payload, and
/// Redis sends it less than one in all), every small job runs once, and nothing stays held.
#[test]
fn payloads_over_the_limit_in_a_backlog_reach_the_dead_set_unread() {
    const MB: usize = 1 << 20;
    let redis = support::RedisServer::start();
    let mut conn = redis.conn();
    let mut bigs = 0;
    for i in 0..600 {
        let job = if i % 300 == 120 {
            bigs += 1;
            big_job("default", &format!("big{i}"), 64 * MB)
        } else {
            big_job("default", &format!("small{i}"), 10)
        };
        let _: () = conn.lpush("queue:default", job).unwrap();
    }
    let before = info_field(&mut conn, "stats", "total_net_output_bytes");
    let mut ox = support::Oxidekiq::start(&redis.url(), &["-q", "default", "-c", "200"]);
    let drained = support::wait_until(PATIENCE, || {
        let processed: u64 = conn.get("stat:processed").unwrap_or(0);
        conn.llen::<_, usize>("queue:default").unwrap() == 0 && processed >= 600
    });
    let peak_kb = peak_rss_kb(ox.pid());
    ox.signal("TERM");
    assert!(ox.wait_exit(PATIENCE).is_some(), "the worker stopped");
    let sent = info_field(&mut conn, "stats", "total_net_output_bytes") - before;
    assert!(drained, "{}", ox.log());
    let dead: Vec<Vec<u8>> = conn.zrange("dead", 0, -1).unwrap();
    assert_eq!(dead.len(), bigs, "every big payload in the dead set");
    let failed: u64 = conn.get("stat:failed").unwrap();
    assert_eq!(failed, bigs as u64, "and only those failed");
    let held: Vec<String> = conn.keys("oxidekiq:batch:*").unwrap();
    assert!(held.is_empty(), "{held:?}");
    eprintln!("peak RSS {peak_kb} kB, redis sent {sent} bytes");
    // One of them read would have sent 64 MiB and grown the worker by as much.
    assert!(sent < 16 * MB as u64, "redis sent {sent} bytes");
    assert!(peak_kb < 64 * 1024, "the worker peaked at {peak_kb} kB");
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
    assert!(ox.wait_for_log("\"message\":\"fail\"", PATIENCE));
    std::thread::sleep(Duration::from_millis(300));
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
    assert!(ox.wait_for_log("INFO: fail", PATIENCE), "{}", ox.log());
    std::thread::sleep(Duration::from_millis(300));
    let log = ox.log();
    assert!(
        log.contains(r#"class="X jid=forged INFO: done" jid=j2 "#),
        "{log}"
    );
    assert!(!log.contains(" class=X jid=forged"), "{log}");
}
