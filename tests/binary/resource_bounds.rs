//! What the binary's outside costs at most, whatever comes in (issue 27, and issue 26 item 6), driven
//! from outside as a user or an attacker would: the real `oxidekiq` binary against a real
//! `redis-server`.
//!
//! - A `/metrics` scrape costs Redis a bounded, small amount whatever the payload sizes and the
//!   scrape rate (measured with Redis's own `total_net_output_bytes`).
//! - A flood of idle HTTP clients under a low `ulimit -n` cannot take the descriptors the job side
//!   needs to reconnect to Redis.
//! - Hand-off remembers and logs a bounded amount per made-up class.
//! - Payloads over the size limit are never read: not by `check`, not by `route 0`, not by the fetch
//!   of a backlog (peak RSS and Redis's own output bytes stay below one payload).
//!
//! No test asserts a duration: each waits for its outcome with a generous timeout.
use crate::support;

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
    // Time for the server to take the flood in: a connect completes in the kernel's backlog, before
    // the server accepts it, so nothing outside the server marks the moment it holds them.
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
    // Log lines that must NOT come (one per job, before): a window on purpose.
    std::thread::sleep(Duration::from_millis(300));
    let log = ox.log();
    // Each made-up name was written three times per line, once per job: 9 MB before.
    assert!(log.len() < 64 * 1024, "{} bytes of log", log.len());
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
