//! Capsules as Sidekiq 7/8 runs them, through the binary: `:capsules:` in `sidekiq.yml` and
//! `--capsule` on the command line. Each capsule has its own slots and fetches only its own queues, so
//! its concurrency is a cap and a reservation; the heartbeat and `/metrics` show every capsule; quiet
//! and stop push back every capsule's jobs, a queue served by two capsules included.
//!
//! The jobs are `PeakJob`s (workers/src/lib.rs): Redis itself counts how many of a group run at once
//! and keeps the high mark, so a cap is checked by what Redis saw, not by a clock.
//!
//! Needs the binary: `cargo build --workspace` first.
use crate::support;

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use std::sync::atomic::{AtomicU64, Ordering};

use redis::Commands;
use serde_json::{Value, json};

/// Where `PeakJob` counts its starts and its ends (workers/src/lib.rs `PEAK_RUNS`, `PEAK_DONE`).
const PEAK_RUNS: &str = "peak:runs";
const PEAK_DONE: &str = "peak:done";

/// Pushes `n` `PeakJob`s of `group` sleeping `ms` onto `queue`; returns their ids.
fn enqueue(c: &mut redis::Connection, queue: &str, group: &str, ms: u64, n: usize) -> Vec<String> {
    let now = support::now();
    let mut ids = Vec::new();
    for i in 0..n {
        let id = format!("{group}-{queue}-{i}");
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let jid = format!("{:024x}", NEXT.fetch_add(1, Ordering::Relaxed));
        let job = json!({
            "class": "PeakJob", "args": [group, ms, id], "queue": queue, "jid": jid,
            "retry": true, "created_at": now, "enqueued_at": now,
        });
        let _: () = c.lpush(format!("queue:{queue}"), job.to_string()).unwrap();
        ids.push(id);
    }
    let _: () = c.sadd("queues", queue).unwrap();
    ids
}

fn count(c: &mut redis::Connection, hash: &str) -> usize {
    c.hlen(hash).unwrap()
}

fn high_mark(c: &mut redis::Connection, group: &str) -> i64 {
    let v: Option<i64> = c.get(format!("peak:max:{group}")).unwrap();
    v.unwrap_or(0)
}

/// A working directory with `config/sidekiq.yml` holding `yml`.
fn with_yml(yml: &str) -> PathBuf {
    let dir = support::temp_dir("capsules");
    std::fs::create_dir_all(dir.join("config")).unwrap();
    std::fs::write(dir.join("config/sidekiq.yml"), yml).unwrap();
    dir
}

/// The ids of the jobs a queue holds, in its order.
fn ids_in(c: &mut redis::Connection, queue: &str) -> Vec<String> {
    let jobs: Vec<String> = c.lrange(format!("queue:{queue}"), 0, -1).unwrap();
    jobs.iter()
        .map(|j| {
            let v: Value = serde_json::from_str(j).unwrap();
            v["args"][2].as_str().unwrap().to_string()
        })
        .collect()
}

/// The issue's `sidekiq.yml`: the capsule's queue drains, one job at a time, while the default capsule
/// is saturated with slow jobs (its 5 slots busy for ~2 s): the capsule's slot is reserved for it.
#[test]
fn the_issues_yml_drains_the_capsules_queue_one_job_at_a_time_beside_a_saturated_default() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let slow = enqueue(&mut c, "default", "default", 500, 20);
    let single = enqueue(&mut c, "single", "single", 100, 6);
    let dir = with_yml(
        ":concurrency: 5\n:queues: [default]\n:capsules:\n  :single:\n    :concurrency: 1\n    :queues: [single]\n",
    );
    let ox = support::Oxidekiq::start_in(dir, &redis.url(), &["--beat-interval", "0.3"], &[]);
    assert!(
        support::wait_until(Duration::from_secs(20), || {
            count(&mut c, PEAK_DONE) >= single.len()
                && single
                    .iter()
                    .all(|id| c.hexists::<_, _, bool>(PEAK_DONE, id).unwrap())
        }),
        "the single queue did not drain: {}",
        ox.log()
    );
    let default_done = slow
        .iter()
        .filter(|id| c.hexists::<_, _, bool>(PEAK_DONE, *id).unwrap())
        .count();
    assert!(
        default_done < slow.len(),
        "the default capsule was not saturated while `single` drained ({default_done} done)"
    );
    assert!(
        support::wait_until(Duration::from_secs(30), || count(&mut c, PEAK_DONE)
            == slow.len() + single.len()),
        "not everything ran: {}",
        ox.log()
    );
    assert_eq!(
        high_mark(&mut c, "single"),
        1,
        "the capsule of 1 ran two at once"
    );
    assert_eq!(
        high_mark(&mut c, "default"),
        5,
        "the default capsule's 5 slots"
    );
    let runs: Vec<i64> = c.hvals(PEAK_RUNS).unwrap();
    assert!(runs.iter().all(|r| *r == 1), "a job ran twice: {runs:?}");
}

/// The command-line form: `--capsule NAME:CONCURRENCY:QUEUE[,WEIGHT]`, repeated to add a queue. The
/// capsule of 2 reaches 2 and never 3; the heartbeat says what Sidekiq 8 says of such a process, and
/// `/metrics` each capsule's busy slots and capacity.
#[test]
fn a_capsule_of_two_reaches_two_and_the_heartbeat_and_metrics_list_every_capsule() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let pair = enqueue(&mut c, "pair", "pair", 300, 8);
    let port = support::free_port();
    let http = format!("127.0.0.1:{port}");
    let ox = support::Oxidekiq::start(
        &redis.url(),
        &[
            "-c",
            "3",
            "-q",
            "default",
            "--capsule",
            "pair:2:pair",
            "--capsule",
            "pair:2:other,2",
            "--beat-interval",
            "0.3",
            "--http",
            &http,
        ],
    );
    let id = support::identity_of(&mut c, ox.pid(), Duration::from_secs(10));
    // Two of the pair's jobs running: /metrics says so for its capsule alone.
    assert!(
        support::wait_until(Duration::from_secs(10), || {
            let now: Option<i64> = c.get("peak:now:pair").unwrap();
            now == Some(2)
        }),
        "{}",
        ox.log()
    );
    let (_, _, metrics) = support::http_get(port, "/metrics").expect("/metrics answers");
    for line in [
        "oxidekiq_capsule_concurrency{capsule=\"default\"} 3",
        "oxidekiq_capsule_concurrency{capsule=\"pair\"} 2",
        "oxidekiq_capsule_busy{capsule=\"pair\"} 2",
        "oxidekiq_capsule_busy{capsule=\"default\"} 0",
        "oxidekiq_concurrency 5",
    ] {
        assert!(metrics.contains(line), "{line} missing from\n{metrics}");
    }
    assert!(
        support::wait_until(Duration::from_secs(20), || count(&mut c, PEAK_DONE)
            == pair.len()),
        "{}",
        ox.log()
    );
    assert_eq!(high_mark(&mut c, "pair"), 2);

    let info: String = c.hget(&id, "info").unwrap();
    let info: Value = serde_json::from_str(&info).unwrap();
    assert_eq!(info["concurrency"], 5, "the sum over the capsules");
    let field: String = c.hget(&id, "concurrency").unwrap();
    assert_eq!(field, "5", "the hash field Sidekiq 8.1.2+ reads");
    assert_eq!(info["queues"], json!(["default", "pair", "other"]));
    assert_eq!(
        info["weights"],
        // Each weight as given, as Sidekiq 7+ writes it (`pair` has none: 0; the fetch counts it as 1).
        json!([{"default": 0}, {"pair": 0, "other": 2}])
    );
    assert_eq!(
        info["capsules"],
        json!({
            "default": {"concurrency": 3, "mode": "strict", "weights": {"default": 0}},
            "pair": {"concurrency": 2, "mode": "weighted", "weights": {"pair": 0, "other": 2}},
        })
    );
    // Sidekiq's own API reads it as a process like any other.
    let seen = support::ruby(
        "require 'sidekiq/api'\np = Sidekiq::ProcessSet.new.first; puts [p['concurrency'], p['queues'].join(',')].join(' ')",
        &redis.url(),
    );
    assert_eq!(seen.trimmed(), "5 default,pair,other", "{seen:?}");
}

/// Quiet, then stop with jobs running in every capsule, one queue served by two of them (Sidekiq's
/// sidekiq#6379 ran such jobs twice at a stop): every job is back in its queue exactly once, none ran
/// twice, and no batch list of the process is left.
#[test]
fn quiet_and_stop_push_back_every_capsules_jobs_once() {
    stop_pushes_back_every_capsules_jobs_once(&[]);
}

/// The same with `--fetch basic`: each capsule pushes back its own jobs through its own fetch.
#[test]
fn quiet_and_stop_push_back_every_capsules_jobs_once_with_basic_fetch() {
    stop_pushes_back_every_capsules_jobs_once(&["--fetch", "basic"]);
}

fn stop_pushes_back_every_capsules_jobs_once(extra: &[&str]) {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut all = enqueue(&mut c, "default", "default", 60_000, 5);
    all.extend(enqueue(&mut c, "single", "single", 60_000, 4));
    let dir = with_yml(concat!(
        ":concurrency: 2\n:queues: [default]\n:capsules:\n",
        "  :single:\n    :concurrency: 1\n    :queues: [single]\n",
        "  both:\n    concurrency: 2\n    queues: [[single, 2], default]\n",
    ));
    let mut args = vec!["--beat-interval", "0.3", "-t", "1"];
    args.extend_from_slice(extra);
    let mut ox = support::Oxidekiq::start_in(dir, &redis.url(), &args, &[]);
    // 2 + 1 + 2 slots, all busy.
    assert!(
        support::wait_until(Duration::from_secs(10), || count(&mut c, PEAK_RUNS) == 5),
        "{}",
        ox.log()
    );
    ox.signal("TSTP");
    assert!(
        ox.wait_for_log("quieting", Duration::from_secs(5)),
        "{}",
        ox.log()
    );
    ox.signal("TERM");
    let status = ox.wait_exit(Duration::from_secs(20)).expect("stopped");
    assert!(status.success(), "{}", ox.log());
    let mut back = ids_in(&mut c, "default");
    back.extend(ids_in(&mut c, "single"));
    let distinct: HashSet<&String> = back.iter().collect();
    assert_eq!(
        distinct.len(),
        back.len(),
        "a job pushed back twice: {back:?}"
    );
    assert_eq!(
        distinct,
        all.iter().collect::<HashSet<_>>(),
        "every job back in its queue"
    );
    let runs: Vec<i64> = c.hvals(PEAK_RUNS).unwrap();
    assert!(runs.iter().all(|r| *r == 1), "a job ran twice: {runs:?}");
    assert_eq!(count(&mut c, PEAK_DONE), 0);
    let held: Vec<String> = c.keys("oxidekiq:batch:*").unwrap();
    assert!(held.is_empty(), "left held: {held:?}");
}

/// What oxidekiq reads but does not do is said at WARN, naming it: an unknown key, a capsule of
/// concurrency 0 (its queue then waits for good), a key of a capsule it does not read, flags that
/// change nothing in their combination.
#[test]
fn settings_not_honoured_are_warned_of_by_name() {
    let redis = support::RedisServer::start();
    let dir = with_yml(concat!(
        ":concurrency: 2\n:queues: [default]\n:max_retries: 3\n:require: ./app.rb\n",
        ":capsules:\n  idle:\n    concurrency: 0\n    queues: [parked, default]\n",
        "  busy:\n    concurrency: 1\n    queues: [busy]\n    fetch_class: Foo\n",
    ));
    let mut ox = support::Oxidekiq::start_in(
        dir,
        &redis.url(),
        &[
            "--beat-interval",
            "0.3",
            "--run-flagged",
            "Billing",
            "--no-cron",
            "--cron-poll-interval",
            "5",
        ],
        &[("REDIS_SENTINEL_PASSWORD", "s3cr3t-sentinel")],
    );
    assert!(
        ox.wait_for_log("starting", Duration::from_secs(10)),
        "{}",
        ox.log()
    );
    ox.signal("TERM");
    ox.wait_exit(Duration::from_secs(10)).expect("stopped");
    let log = ox.log();
    let warned = |needle: &str| {
        log.lines()
            .any(|l| l.contains(" WARN: ") && l.contains(needle))
    };
    assert!(warned("`max_retries` not used by oxidekiq"), "{log}");
    assert!(
        warned("capsule idle: concurrency 0 runs no job") && warned("parked"),
        "{log}"
    );
    assert!(warned("capsule busy key `fetch_class`"), "{log}");
    assert!(warned("--run-flagged Billing without --handoff"), "{log}");
    assert!(
        warned("--cron-poll-interval is set with --no-cron"),
        "{log}"
    );
    assert!(warned("no sentinel is configured"), "{log}");
    assert!(!log.contains("s3cr3t"), "{log}");
    assert!(!warned("`require`"), "a Ruby-only key stays quiet: {log}");
}

/// Quiet with jobs running in every capsule, one queue served by two of them: the jobs running finish
/// and are done once, the others are back in their queue once; none is both (a sweep of one capsule
/// that took another's running jobs for its own strays would push them back while they ran).
#[test]
fn quiet_lets_every_capsules_running_jobs_finish_and_pushes_back_only_the_rest() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut all = enqueue(&mut c, "default", "default", 1_500, 6);
    all.extend(enqueue(&mut c, "single", "single", 1_500, 4));
    let dir = with_yml(concat!(
        ":concurrency: 2\n:queues: [default]\n:capsules:\n",
        "  :single:\n    :concurrency: 1\n    :queues: [single]\n",
        "  both:\n    concurrency: 2\n    queues: [[single, 2], default]\n",
    ));
    let mut ox = support::Oxidekiq::start_in(dir, &redis.url(), &["--beat-interval", "0.3"], &[]);
    assert!(
        support::wait_until(Duration::from_secs(10), || count(&mut c, PEAK_RUNS) == 5),
        "{}",
        ox.log()
    );
    ox.signal("TSTP");
    assert!(
        support::wait_until(Duration::from_secs(10), || count(&mut c, PEAK_DONE) == 5),
        "the running jobs did not finish: {}",
        ox.log()
    );
    ox.signal("TERM");
    let status = ox.wait_exit(Duration::from_secs(20)).expect("stopped");
    assert!(status.success(), "{}", ox.log());
    let done: Vec<String> = c.hkeys(PEAK_DONE).unwrap();
    let mut back = ids_in(&mut c, "default");
    back.extend(ids_in(&mut c, "single"));
    let both: Vec<&String> = back.iter().filter(|id| done.contains(id)).collect();
    assert!(both.is_empty(), "done and pushed back too: {both:?}");
    let distinct: HashSet<&String> = back.iter().chain(&done).collect();
    assert_eq!(
        distinct.len(),
        back.len() + done.len(),
        "a job twice: {back:?}"
    );
    assert_eq!(
        distinct,
        all.iter().collect::<HashSet<_>>(),
        "every job done or queued"
    );
    let runs: Vec<i64> = c.hvals(PEAK_RUNS).unwrap();
    assert!(runs.iter().all(|r| *r == 1), "a job ran twice: {runs:?}");
    let held: Vec<String> = c.keys("oxidekiq:batch:*").unwrap();
    assert!(held.is_empty(), "left held: {held:?}");
}

/// `--capsule` replaces the file's `:capsules:` (as --help says), and says so: a queue only a
/// replaced capsule served (`single` here) is then served by no capsule, and a WARN names it (found by
/// the review of issue 38).
#[test]
fn a_capsule_flag_that_leaves_a_files_capsule_queue_unserved_warns_naming_it() {
    let redis = support::RedisServer::start();
    let dir = with_yml(
        ":concurrency: 2\n:queues: [default]\n:capsules:\n  single:\n    concurrency: 1\n    queues: [single]\n",
    );
    let mut ox = support::Oxidekiq::start_in(
        dir,
        &redis.url(),
        &["--beat-interval", "0.3", "--capsule", "other:1:other"],
        &[],
    );
    assert!(
        ox.wait_for_log("starting", Duration::from_secs(10)),
        "{}",
        ox.log()
    );
    ox.signal("TERM");
    ox.wait_exit(Duration::from_secs(10)).expect("stopped");
    let log = ox.log();
    assert!(
        log.lines()
            .any(|l| l.contains(" WARN: ") && l.contains("single")),
        "no WARN names the queue `single` that no capsule serves now: {log}"
    );
}

/// The WARN for keys oxidekiq does not read passes over the sections of the other environments
/// (`staging:` when running `-e production`), which Sidekiq reads for their own environment only and
/// passes over without a word (found by the review of issue 38: nearly every Rails `sidekiq.yml` has
/// such sections).
#[test]
fn the_sections_of_other_environments_are_not_warned_of() {
    let redis = support::RedisServer::start();
    let dir = with_yml(concat!(
        ":concurrency: 2\n:queues: [default]\n",
        "production:\n  :concurrency: 3\n",
        "staging:\n  :concurrency: 1\n",
    ));
    let mut ox = support::Oxidekiq::start_in(
        dir,
        &redis.url(),
        &["--beat-interval", "0.3", "-e", "production"],
        &[],
    );
    assert!(
        ox.wait_for_log("starting", Duration::from_secs(10)),
        "{}",
        ox.log()
    );
    ox.signal("TERM");
    ox.wait_exit(Duration::from_secs(10)).expect("stopped");
    let log = ox.log();
    assert!(
        log.contains("concurrency=3"),
        "production's section applies: {log}"
    );
    assert!(
        !log.lines()
            .any(|l| l.contains(" WARN: ") && l.contains("`staging`")),
        "staging's section is warned of as a key oxidekiq does not read: {log}"
    );
}

/// The `SCAN`s Redis served from a stop of a process of `capsules` capsules (the default one and
/// `capsules - 1` named ones, each over a queue of its own, all idle) beside 100 000 unrelated keys, from
/// `TERM` to its exit: each one's `MATCH` pattern.
fn scans_for_a_stop(capsules: usize) -> Vec<String> {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let _: () = redis::cmd("EVAL")
        .arg("for i = 1, 100000 do redis.call('SET', 'unrelated:' .. i, 'x') end")
        .arg(0)
        .query(&mut c)
        .unwrap();
    let mut args: Vec<String> = ["-c", "1", "-q", "q1", "--beat-interval", "0.3"]
        .map(String::from)
        .to_vec();
    for i in 2..=capsules {
        args.push("--capsule".into());
        args.push(format!("c{i}:1:q{i}"));
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut ox = support::Oxidekiq::start(&redis.url(), &args);
    let _ = support::identity_of(&mut c, ox.pid(), Duration::from_secs(10));
    let monitor = support::Monitor::start(&redis);
    ox.signal("TERM");
    let status = ox.wait_exit(Duration::from_secs(60)).expect("stopped");
    assert!(status.success(), "{}", ox.log());
    // Everything Redis served before this marker has reached the monitor once the marker has.
    let _: String = redis::cmd("ECHO").arg("stop-seen").query(&mut c).unwrap();
    let seen = support::wait_until(Duration::from_secs(10), || {
        monitor.lines().iter().any(|l| l.contains("stop-seen"))
    });
    assert!(seen, "the monitor saw the marker");
    monitor
        .commands()
        .into_iter()
        .filter(|s| {
            !s.lua
                && s.words
                    .first()
                    .is_some_and(|w| w.eq_ignore_ascii_case("SCAN"))
        })
        .map(|s| {
            s.words
                .iter()
                .position(|w| w.eq_ignore_ascii_case("MATCH"))
                .and_then(|i| s.words.get(i + 1).cloned())
                .unwrap_or_default()
        })
        .collect()
}

/// A stop does not walk the keyspace for stray batch lists (review of issue 38, issue 43): each
/// capsule's fetch reads its process's index of held lists (`oxidekiq:held:<identity>`) at the quiet
/// sweep and in the stop's push-back (`Reliable::strays`), where it used to run one
/// `SCAN ... MATCH oxidekiq:batch:<identity>:*` of the whole keyspace each time (beside 1 000 000
/// unrelated keys: 1 capsule 3 000 SCAN calls and 7.3 s from TERM to exit, 16 capsules 48 000 and 21.0 s).
/// The only walks left in the window are the start's own (its first recovery pass and cron's look for
/// namespaces, which may still run when the stop begins): none matches the batch lists' prefix.
#[test]
fn a_stops_keyspace_walks_do_not_grow_with_the_capsules() {
    for capsules in [1, 4] {
        let scans = scans_for_a_stop(capsules);
        let batch: Vec<&String> = scans
            .iter()
            .filter(|m| m.starts_with("oxidekiq:batch:"))
            .collect();
        assert!(
            batch.is_empty(),
            "{capsules} capsule(s): the stop walked the keyspace for batch lists {} time(s): {:?}",
            batch.len(),
            batch.iter().take(3).collect::<Vec<_>>()
        );
    }
}
