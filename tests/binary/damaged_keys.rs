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
use crate::support;

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
    // A damaged `queues` (a test of its own) refuses this; the jobs are pushed all the same.
    let _: redis::RedisResult<()> = c.sadd("queues", queue);
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

/// Leaves a Web UI quiet (`TSTP`) for process `id` and waits for its beat to say it is quiet (a beat
/// that fails, or loses the signal, never does); then checks the log reports the damage at error level
/// with every text of `named`, and stops the process.
fn quiets_on_web_ui_and_reports(
    c: &mut redis::Connection,
    ox: &mut Oxidekiq,
    id: &str,
    named: &[&str],
) {
    let _: () = c.lpush(format!("{id}-signals"), "TSTP").unwrap();
    assert!(
        wait_until(WAIT, || {
            c.hget::<_, _, Option<String>>(id, "quiet")
                .unwrap()
                .as_deref()
                == Some("true")
        }),
        "the TSTP from the Web UI was lost:\n{}",
        ox.log()
    );
    let log = ox.log();
    assert!(
        log.contains("ERROR") && named.iter().all(|n| log.contains(n)),
        "the damaged key is reported at error level ({named:?}):\n{log}"
    );
    stop(ox);
}

/// Starts a process on `default` with five jobs waiting there, and waits for all five to be done.
fn runs_five_jobs(redis: &RedisServer, c: &mut redis::Connection) -> Oxidekiq {
    let jobs: Vec<String> = (0..5)
        .map(|i| chaos("default", "ok", 0, &format!("five{i}")))
        .collect();
    push(c, "default", &jobs);
    let ox = start(redis, &["-q", "default", "-c", "2"]);
    assert!(
        wait_until(WAIT, || done_count(c) == 5),
        "the jobs never ran:\n{}",
        ox.log()
    );
    ox
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
    assert!(
        support::wait_beats(&mut c, &id, 4, WAIT),
        "no four more beats:\n{}",
        ox.log()
    );
    let processed: u64 = c.get("stat:processed").unwrap();
    assert_eq!(processed, 30, "stat:processed counts each job once");
    // The Web UI's quiet: popped inside the same partly failing MULTI, it must still be acted on.
    quiets_on_web_ui_and_reports(&mut c, &mut ox, &id, &["stat:processed:", "list"]);
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
    let held: Vec<String> = c.keys("oxidekiq:batch:*").unwrap();
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

/// The suspect marks of processes holding batch lists have a hash of their own (an older release's
/// pass deletes them from `oxidekiq:suspects`): damaged, it is reported and worked around as that one.
#[test]
fn orphan_recovery_goes_on_when_its_batch_suspects_hash_has_the_wrong_type() {
    killed_process_jobs_are_recovered_despite(
        |c| {
            let _: () = c.set("oxidekiq:suspects:batch", "x").unwrap();
        },
        "oxidekiq:suspects:batch",
    );
}

#[test]
fn orphan_recovery_goes_on_when_its_lock_key_is_not_a_lock() {
    killed_process_jobs_are_recovered_despite(
        |c| {
            // The killed process may have held the lock (a string with a TTL) when it died: replaced,
            // not pushed onto.
            let _: () = c.del("oxidekiq:recovery-lock").unwrap();
            let _: () = c.rpush("oxidekiq:recovery-lock", "x").unwrap();
            let _: () = c.set("oxidekiq:recovered", "x").unwrap();
        },
        "oxidekiq:recovery-lock",
    );
}

/// Review of issue 43: a recovery lock that is no lock (a list here) is named at error level once, not
/// at every pass of every process (one every two beats: a line a second per process at the default
/// beat), as every other damaged key of recovery is.
#[test]
fn a_recovery_lock_that_is_not_a_lock_is_named_once() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let _: () = c.rpush("oxidekiq:recovery-lock", "x").unwrap();
    let mut ox = Oxidekiq::start(
        &redis.url(),
        &["-q", "default", "--beat-interval", "0.3", "-t", "3"],
    );
    let id = support::identity_of(&mut c, ox.pid(), WAIT);
    // Twelve beats: about six recovery passes.
    assert!(
        support::wait_beats(&mut c, &id, 12, WAIT),
        "{id} stopped beating:\n{}",
        ox.log()
    );
    let log = ox.log();
    let named = log
        .lines()
        .filter(|l| l.contains("ERROR") && l.contains("oxidekiq:recovery-lock"))
        .count();
    stop(&mut ox);
    assert_eq!(named, 1, "named {named} times:\n{log}");
}

/// A `ChaosJob` that fails straight into the dead set (`retry: 0`).
fn dying(queue: &str, jid: &str) -> String {
    chaos(queue, "fail", 0, jid).replace(r#""retry":true"#, r#""retry":0"#)
}

/// The jids held in oxidekiq's working keys (batch lists: the jobs not marked done).
fn held_jids(c: &mut redis::Connection) -> Vec<String> {
    let keys: Vec<String> = c.keys("oxidekiq:batch:*").unwrap();
    let mut out = Vec::new();
    for k in keys {
        let values: Vec<String> = support::held_in(c, &k);
        for v in values {
            let job: serde_json::Value = serde_json::from_str(&v).unwrap();
            out.push(job["jid"].as_str().unwrap().to_string());
        }
    }
    out.sort();
    out
}

/// The jids in a list or sorted set.
fn jids_in(c: &mut redis::Connection, key: &str) -> Vec<String> {
    let kind: String = redis::cmd("TYPE").arg(key).query(c).unwrap();
    let members: Vec<String> = match kind.as_str() {
        "list" => c.lrange(key, 0, -1).unwrap(),
        "zset" => c.zrange(key, 0, -1).unwrap(),
        _ => Vec::new(),
    };
    let mut out: Vec<String> = members
        .iter()
        .map(|m| {
            serde_json::from_str::<serde_json::Value>(m).unwrap()["jid"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    out.sort();
    out
}

/// `key` (which the fates of four "bad" jobs need) is damaged with `SET key notazset`; four bad jobs
/// and five good ones at `-c 4`: the good ones finish, the bad ones are held and reported (error log
/// with the key and its type, `/ready` 503, the counter), and land in `landing` once the key is
/// repaired; damaged again, a stop pushes the bad ones back to their queue.
fn stuck_fates_do_not_pin_their_processors(
    key: &str,
    landing: &str,
    bad_job: fn(&str, &str) -> String,
    args: &[&str],
) {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let _: () = c.set(key, "notazset").unwrap();
    let bad: Vec<String> = (0..4)
        .map(|i| bad_job("default", &format!("bad{i}")))
        .collect();
    push(&mut c, "default", &bad);
    let port = support::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut all = vec!["-q", "default", "-c", "4", "--http", &addr];
    all.extend_from_slice(args);
    let mut ox = start(&redis, &all);
    let want: Vec<String> = (0..4).map(|i| format!("bad{i}")).collect();
    // Every bad job's fate write failed once (one error line each) before the good jobs come.
    let failed_writes = |ox: &Oxidekiq| {
        ox.log()
            .lines()
            .filter(|l| l.contains("ERROR") && l.contains("cannot write the job's fate"))
            .count()
    };
    let pinned = wait_until(WAIT, || {
        held_jids(&mut c) == want
            && (failed_writes(&ox) == 4 || c.hlen::<_, usize>("chaos:runs").unwrap() == 4)
    });
    assert!(pinned, "the bad jobs were never held:\n{}", ox.log());
    // Time for the held fates to retry and, were the bug back, pin every slot: nothing marks a slot
    // that is NOT freed, so this is a window on purpose.
    std::thread::sleep(Duration::from_millis(500));
    // Pushed once every processor has a failing job: before the fix, all four were pinned.
    let good: Vec<String> = (0..5)
        .map(|i| chaos("default", "ok", 0, &format!("good{i}")))
        .collect();
    push(&mut c, "default", &good);
    assert!(
        wait_until(WAIT, || done_count(&mut c) == 5),
        "good jobs did not finish while the failing ones' fate could not be written:\n{}",
        ox.log()
    );
    // A good job counted done may still be in its batch list for a moment: its ack rides on the next
    // fetch (at most `RIDE_WAIT`, 2 ms, late; docs/guarantees.md).
    wait_until(Duration::from_secs(2), || held_jids(&mut c) == want);
    assert_eq!(held_jids(&mut c), want, "the bad jobs stay held");
    let log = ox.log();
    assert!(
        log.lines()
            .any(|l| l.contains("ERROR") && l.contains(key) && l.contains("string")),
        "no error naming {key} and its type:\n{log}"
    );
    let (status, _, body) = support::http_get(port, "/ready").unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains(key), "{body}");
    let (_, _, metrics) = support::http_get(port, "/metrics").unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("oxidekiq_fate_write_failures_total ") && l.ends_with(" 4")),
        "{metrics}"
    );
    // Repaired: the stuck writes land, nothing stays held, and the process is ready again.
    let _: () = c.del(key).unwrap();
    assert!(
        wait_until(Duration::from_secs(60), || jids_in(&mut c, landing) == want),
        "the stuck fates did not land in {landing} once {key} was repaired:\n{}",
        ox.log()
    );
    assert!(held_jids(&mut c).is_empty());
    assert!(wait_until(WAIT, || support::http_get(port, "/ready")
        .is_some_and(|(s, _, _)| s == 200)));
    // Damaged again, then a stop: the failing jobs go back to their queue, none lost or doubled.
    let _: () = c.set(key, "notazset").unwrap();
    let more: Vec<String> = (4..6)
        .map(|i| bad_job("default", &format!("bad{i}")))
        .collect();
    push(&mut c, "default", &more);
    assert!(wait_until(WAIT, || held_jids(&mut c) == ["bad4", "bad5"]
        && failed_writes(&ox) == 6));
    stop(&mut ox);
    assert!(held_jids(&mut c).is_empty());
    assert_eq!(jids_in(&mut c, "queue:default"), ["bad4", "bad5"]);
}

#[test]
fn a_wrong_typed_retry_set_pins_no_processor_and_loses_no_job() {
    stuck_fates_do_not_pin_their_processors(
        "retry",
        "retry",
        |q, jid| chaos(q, "fail", 0, jid),
        &[],
    );
}

#[test]
fn a_wrong_typed_dead_set_pins_no_processor_and_loses_no_job() {
    stuck_fates_do_not_pin_their_processors("dead", "dead", dying, &[]);
}

#[test]
fn a_wrong_typed_queues_set_pins_no_hand_off_and_loses_no_job() {
    // A class with no Rust worker, handed off to `ruby`: the push writes `queues`.
    let ruby_only = |q: &str, jid: &str| chaos(q, "ok", 0, jid).replace("ChaosJob", "RubyOnlyJob");
    stuck_fates_do_not_pin_their_processors(
        "queues",
        "queue:ruby",
        ruby_only,
        &["--handoff", "ruby"],
    );
}

/// A worker whose every run asks to run again later (as a limit does): its fate is the `schedule` set.
#[derive(Debug)]
struct Later;
impl oxidekiq::Worker for Later {
    const CLASS: &'static str = "LaterJob";
    type Args = oxidekiq::NoArgs;
    async fn perform(&self, _: &oxidekiq::JobContext, _: oxidekiq::NoArgs) -> oxidekiq::JobResult {
        Err(oxidekiq::JobError::reschedule(3600.0, "not yet"))
    }
}

/// A worker that records each run in the list `good:ran`.
#[derive(Debug)]
struct Good;
impl oxidekiq::Worker for Good {
    const CLASS: &'static str = "GoodJob";
    type Args = oxidekiq::NoArgs;
    async fn perform(
        &self,
        ctx: &oxidekiq::JobContext,
        _: oxidekiq::NoArgs,
    ) -> oxidekiq::JobResult {
        let mut c = ctx.redis();
        let _: () = redis::AsyncCommands::rpush(&mut c, "good:ran", 1).await?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_typed_schedule_set_pins_no_processor_and_loses_no_job() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let _: () = c.set("schedule", "notazset").unwrap();
    let later: Vec<String> = (0..2)
        .map(|i| format!(r#"{{"class":"LaterJob","args":[],"jid":"later{i}","queue":"default","retry":true}}"#))
        .collect();
    push(&mut c, "default", &later);
    let mut registry = oxidekiq::Registry::new();
    registry.register(Later).register(Good);
    let handle = support::launch(support::config(&redis.url(), &["default"], 2), registry).await;
    let want = ["later0".to_string(), "later1".to_string()];
    support::wait_for("the rescheduled jobs held", WAIT, || {
        held_jids(&mut c) == want
    })
    .await;
    // Time for the held fates to retry and, were the bug back, pin both slots: nothing marks a slot
    // that is NOT freed, so this is a window on purpose.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let good: Vec<String> = (0..3)
        .map(|i| format!(r#"{{"class":"GoodJob","args":[],"jid":"good{i}","queue":"default"}}"#))
        .collect();
    push(&mut c, "default", &good);
    support::wait_for("the good jobs done", WAIT, || {
        c.llen::<_, usize>("good:ran").unwrap() == 3
    })
    .await;
    assert_eq!(held_jids(&mut c), want);
    let _: () = c.del("schedule").unwrap();
    support::wait_for("the reschedules written", Duration::from_secs(60), || {
        jids_in(&mut c, "schedule") == want
    })
    .await;
    // The write marks each job done in its batch list in the same script: nothing is held after it.
    assert!(held_jids(&mut c).is_empty());
    handle.stop().await.unwrap();
}

#[test]
fn orphan_recovery_goes_on_when_a_dead_process_liveness_key_is_not_one() {
    killed_process_jobs_are_recovered_despite(
        |c| {
            // The killed process's liveness key becomes a list without a TTL: no sign of life.
            let alive: Vec<String> = c.keys("oxidekiq:alive:*").unwrap();
            assert_eq!(alive.len(), 1, "{alive:?}");
            let _: () = c.del(&alive[0]).unwrap();
            let _: () = c.rpush(&alive[0], "x").unwrap();
        },
        "oxidekiq:alive:",
    );
}

/// A member of Sidekiq's `processes` whose key is not a process's hash (a stray member, a key
/// overwritten) made the heartbeat's fleet survey fail: oxidekiq refused to start ("Pipeline failure:
/// WRONGTYPE"), and a running one lost every beat (the Busy page, stats, Web UI signals). It now counts
/// as no process and is reported; the process starts, beats and runs jobs.
#[test]
fn a_member_of_processes_that_is_no_process_hash_stops_neither_the_start_nor_the_beat() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let stray = "stray-host:1:0123456789ab";
    let _: () = c.sadd("processes", stray).unwrap();
    let _: () = c.set(stray, "damaged").unwrap();
    let mut ox = runs_five_jobs(&redis, &mut c);
    let id = support::identity_of(&mut c, ox.pid(), WAIT);
    // A Web UI signal is read by a beat: the process goes quiet.
    quiets_on_web_ui_and_reports(&mut c, &mut ox, &id, &[stray]);
}

/// A rolled-back class's jobs held when the stop comes go to `<queue>`; when that push fails for a
/// damaged key (`queues` of the wrong type) they must go back to `<queue>_rust`. The push-back retried
/// each such job for 6 s, ran past the stop's clean-up and, with basic fetch (nothing in Redis while a
/// job is held), lost every one of them.
#[test]
fn a_rolled_back_class_pushed_back_past_a_damaged_queues_set_is_not_lost_with_basic_fetch() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let _: () = c.set("queues", "damaged").unwrap();
    let _: () = c.hset("oxidekiq:routes", "ChaosJob", 0).unwrap();
    let jids: Vec<String> = (0..4).map(|i| format!("rb{i}")).collect();
    let jobs: Vec<String> = jids
        .iter()
        .map(|j| chaos("default_rust", "ok", 0, j))
        .collect();
    push(&mut c, "default_rust", &jobs);
    let mut ox = start(
        &redis,
        &["-q", "default_rust", "-c", "4", "--fetch", "basic"],
    );
    // Each job is fetched, its hand-off to `default` refused by the damaged `queues`: it waits held.
    assert!(
        wait_until(WAIT, || ox.log().matches("queues is a string").count() >= 4),
        "the jobs were never fetched and held:\n{}",
        ox.log()
    );
    stop(&mut ox);
    let mut held = jids_in(&mut c, "queue:default_rust");
    held.extend(jids_in(&mut c, "queue:default"));
    held.sort();
    assert_eq!(
        held,
        jids,
        "every job is in Redis after the stop:\n{}",
        ox.log()
    );
}

/// Sidekiq's `processes` of the wrong type made the heartbeat's fleet survey fail: oxidekiq refused to
/// start, naming no key. It now starts, runs jobs and reads Web UI signals; the key is named.
#[test]
fn a_process_set_of_the_wrong_type_stops_neither_the_start_nor_the_beat() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let _: () = c.set("processes", "damaged").unwrap();
    let mut ox = runs_five_jobs(&redis, &mut c);
    // Not in `processes` (it cannot be): found by its identity hash, `host:pid:hex`.
    let needle = format!(":{}:", ox.pid());
    let mut id = None;
    assert!(wait_until(WAIT, || {
        let keys: Vec<String> = c.keys(format!("*{needle}*")).unwrap();
        id = keys.into_iter().find(|k| k.matches(':').count() == 2);
        id.is_some()
    }));
    let id = id.unwrap();
    quiets_on_web_ui_and_reports(&mut c, &mut ox, &id, &["key=processes", "string"]);
}

/// Issue 43 item 1: a batch's acks set made a string while its batch runs stopped every later ack of the
/// process (one pipeline failed whole on its `WRONGTYPE`, retried forever): finished jobs piled up in
/// batch lists, to run again after a stop. Now the damaged batch alone loses its ack, named once at
/// error level with the key and its type, and every later job is acknowledged.
#[test]
fn a_damaged_acks_set_stops_no_later_ack() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    // One batch of two: one job ends soon, the other runs on (its list stays, with the damaged key).
    push(
        &mut c,
        "default",
        &[
            chaos("default", "sleep", 2_000, "short"),
            chaos("default", "sleep", 120_000, "long"),
        ],
    );
    let mut ox = start(&redis, &["-q", "default", "-c", "2"]);
    assert!(
        wait_until(WAIT, || c.hlen::<_, usize>("chaos:runs").unwrap() == 2),
        "the jobs never started:\n{}",
        ox.log()
    );
    let lists: Vec<String> = c.keys("oxidekiq:batch:*").unwrap();
    assert_eq!(lists.len(), 1, "one batch: {lists:?}");
    let acks = lists[0].replacen("oxidekiq:batch:", "oxidekiq:acks:", 1);
    let _: () = c.set(&acks, "damaged").unwrap();
    assert!(
        wait_until(WAIT, || done_count(&mut c) == 1),
        "the short job never ended:\n{}",
        ox.log()
    );
    let jobs: Vec<String> = (0..200)
        .map(|i| chaos("default", "ok", 0, &format!("ok{i}")))
        .collect();
    push(&mut c, "default", &jobs);
    assert!(
        wait_until(WAIT, || done_count(&mut c) == 201),
        "the later jobs did not run:\n{}",
        ox.log()
    );
    // Every later job acknowledged: only the damaged batch is left (its acks set unreadable, both of
    // its jobs count as held).
    let settled = wait_until(WAIT, || held_jids(&mut c) == ["long", "short"]);
    let left: Vec<String> = c.keys("oxidekiq:batch:*").unwrap();
    assert!(
        settled,
        "later acks were held up: {} batch lists, {:?} held\n{}",
        left.len(),
        held_jids(&mut c).len(),
        ox.log()
    );
    let log = ox.log();
    let named = log
        .lines()
        .filter(|l| l.contains("ERROR") && l.contains(&acks) && l.contains("string"))
        .count();
    assert_eq!(
        named, 1,
        "the damaged key is named once, with its type:\n{log}"
    );
    // The stop cannot push the long job back through the damaged list: it stays there for recovery,
    // with the short one (whose ack never reached Redis), and no other job is pushed back.
    stop(&mut ox);
    assert_eq!(held_jids(&mut c), ["long", "short"]);
    assert_eq!(c.llen::<_, usize>("queue:default").unwrap(), 0);
}
