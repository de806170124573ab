//! Damaged keys (issue 26): a key of ours or of Sidekiq's with the wrong type is reported loudly and
//! strands no job, through the real binary (`cargo build --workspace` first).
//!
//! - the heartbeat's transaction with one failing command counts stats once and loses no Web UI
//!   signal;
//! - orphan recovery with a wrong-typed `oxidekiq:recovered` or `oxidekiq:suspects` still recovers a
//!   killed process's jobs;
//! - a fate write (retry, dead, schedule, `queues`) that fails for a reason other than an outage does
//!   not pin its processor: good jobs finish, and the failing ones stay in Redis and land once the key
//!   is repaired (or are pushed back at stop).
mod support;

use std::time::Duration;

use redis::Commands;
use support::{Oxidekiq, RedisServer, wait_until};

/// A generous bound for anything the tests wait for (a loaded shared machine).
const WAIT: Duration = Duration::from_secs(30);

/// A `ChaosJob` payload (`workers/src/lib.rs`): `mode` ok, sleep or fail.
fn chaos(queue: &str, mode: &str, sleep_ms: u64, jid: &str) -> String {
    format!(
        r#"{{"retry":true,"queue":"{queue}","class":"ChaosJob","args":["{mode}",{sleep_ms},"{jid}"],"jid":"{jid}","created_at":1700000000.0,"enqueued_at":1700000000.0}}"#
    )
}

fn push(c: &mut redis::Connection, queue: &str, payloads: &[String]) {
    for p in payloads {
        let _: () = c.lpush(format!("queue:{queue}"), p).unwrap();
    }
    let _: () = c.sadd("queues", queue).unwrap();
}

fn start(redis: &RedisServer, args: &[&str]) -> Oxidekiq {
    let mut all = vec!["--beat-interval", "1", "--poll-interval", "0.5", "-t", "3"];
    all.extend_from_slice(args);
    Oxidekiq::start(&redis.url(), &all)
}

fn stop(ox: &mut Oxidekiq) {
    ox.signal("TERM");
    assert!(
        ox.wait_exit(WAIT).is_some(),
        "oxidekiq did not stop:\n{}",
        ox.log()
    );
}

fn done_count(c: &mut redis::Connection) -> usize {
    c.hlen("chaos:done").unwrap()
}

#[test]
fn a_failing_command_in_the_beat_counts_stats_once_and_keeps_a_web_ui_signal() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    // Today's daily counter (and tomorrow's, should the test straddle midnight UTC) is a list: its
    // INCRBY fails inside the beat's MULTI, the other commands run.
    let today = chrono::Utc::now().date_naive();
    for day in [today, today.succ_opt().unwrap()] {
        let key = format!("stat:processed:{}", day.format("%Y-%m-%d"));
        let _: () = c.rpush(&key, "damaged").unwrap();
    }
    let jobs: Vec<String> = (0..30)
        .map(|i| chaos("default", "ok", 0, &format!("s{i}")))
        .collect();
    push(&mut c, "default", &jobs);
    let mut ox = start(&redis, &["-q", "default", "-c", "4"]);
    let id = support::identity_of(&mut c, ox.pid(), WAIT);
    assert!(wait_until(WAIT, || done_count(&mut c) == 30));
    assert!(
        wait_until(WAIT, || c
            .get::<_, Option<u64>>("stat:processed")
            .unwrap()
            .is_some_and(|n| n >= 30)),
        "stat:processed never reached 30:\n{}",
        ox.log()
    );
    // Several more beats: a count restored after a partly failed MULTI would be added again on each.
    std::thread::sleep(Duration::from_secs(4));
    let processed: u64 = c.get("stat:processed").unwrap();
    assert_eq!(processed, 30, "stat:processed counts each job once");
    // The Web UI's quiet: popped inside the same partly failing MULTI, it must still be acted on.
    let _: () = c.lpush(format!("{id}-signals"), "TSTP").unwrap();
    assert!(
        wait_until(WAIT, || c
            .hget::<_, _, Option<String>>(&id, "quiet")
            .unwrap()
            .as_deref()
            == Some("true")),
        "the TSTP from the Web UI was lost:\n{}",
        ox.log()
    );
    let log = ox.log();
    assert!(
        log.contains("ERROR") && log.contains("stat:processed:") && log.contains("list"),
        "the damaged key is reported at error level with its type:\n{log}"
    );
    stop(&mut ox);
}

/// Four sleeping jobs on a process that is then killed; `damage` runs before a second process starts,
/// which must recover and run them again, and report the damage at error level naming `reported`.
fn killed_process_jobs_are_recovered_despite(
    damage: impl FnOnce(&mut redis::Connection),
    reported: &str,
) {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let jobs: Vec<String> = (0..4)
        .map(|i| chaos("default", "sleep", 120_000, &format!("r{i}")))
        .collect();
    push(&mut c, "default", &jobs);
    let mut first = start(&redis, &["-q", "default", "-c", "4"]);
    assert!(
        wait_until(WAIT, || c.hlen::<_, usize>("chaos:runs").unwrap() == 4),
        "the first process never ran the jobs:\n{}",
        first.log()
    );
    first.kill_9();
    damage(&mut c);
    let mut second = start(&redis, &["-q", "default", "-c", "4"]);
    let reran = wait_until(Duration::from_secs(60), || {
        let runs: Vec<(String, u64)> = c.hgetall("chaos:runs").unwrap();
        runs.len() == 4 && runs.iter().all(|(_, n)| *n >= 2)
    });
    let log = second.log();
    assert!(
        reran,
        "the killed process's jobs were not recovered:\n{log}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("ERROR") && l.contains(reported)),
        "the damaged key {reported} is not reported at error level:\n{log}"
    );
    stop(&mut second);
    let held: Vec<String> = c.keys("oxidekiq:working:*").unwrap();
    assert!(held.is_empty(), "jobs still held: {held:?}");
    assert_eq!(c.llen::<_, usize>("queue:default").unwrap(), 4);
}

#[test]
fn orphan_recovery_goes_on_when_its_bookkeeping_keys_have_the_wrong_type() {
    killed_process_jobs_are_recovered_despite(
        |c| {
            let _: () = c.set("oxidekiq:recovered", "x").unwrap();
            let _: () = c.set("oxidekiq:suspects", "x").unwrap();
        },
        "oxidekiq:suspects",
    );
}

#[test]
fn orphan_recovery_goes_on_when_its_lock_key_is_not_a_lock() {
    killed_process_jobs_are_recovered_despite(
        |c| {
            let _: () = c.rpush("oxidekiq:recovery-lock", "x").unwrap();
            let _: () = c.set("oxidekiq:recovered", "x").unwrap();
        },
        "oxidekiq:recovery-lock",
    );
}
