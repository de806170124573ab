//! Ruby Sidekiq 6.4 and oxidekiq on one shared queue (issue #11).
//!
//! Both processes run `ChaosJob` (`workers/src/lib.rs` in Rust, the same class in Ruby below); each run
//! counts itself in `chaos:runs` and, at its successful end, `chaos:done`; the Ruby one also in
//! `chaos:ruby`, so a test knows who ran what. Jobs are pushed by Ruby's own client (`push_bulk`).
//!
//! - A plain drain: every job runs exactly once, both processes take part, failures land once in the
//!   dead set (whoever wrote them), and nothing is left in oxidekiq's keys.
//! - oxidekiq is SIGKILLed mid-drain: Ruby's own clean-up of dead processes (`ProcessSet#cleanup`,
//!   which the Ruby server's poller runs too) removes the dead identity from `processes` and leaves
//!   oxidekiq's working hash alone; a new oxidekiq process recovers that hash and touches nothing of
//!   Ruby's; every job ends done, and only the jobs in flight at the kill may run twice.
use crate::support;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use redis::Commands;
use support::{Oxidekiq, RedisServer, RubySidekiq, ruby, wait_until};

/// The Ruby twin of the Rust `ChaosJob`, plus a marker of who ran it.
const JOBS_RB: &str = r#"
class ChaosError < StandardError; end
class ChaosJob
  include Sidekiq::Worker
  def perform(mode, sleep_ms, id)
    Sidekiq.redis { |c| c.hincrby("chaos:runs", id, 1); c.hincrby("chaos:ruby", id, 1) }
    sleep(sleep_ms / 1000.0) if mode == "sleep"
    raise ChaosError, "chaos failure #{id}" if mode == "fail"
    Sidekiq.redis { |c| c.hincrby("chaos:done", id, 1) }
  end
end
"#;

/// oxidekiq's heartbeat in these tests; its liveness key lives `max(3 beats, 3 s)` (`launcher.rs`).
const BEAT: &str = "1";

fn start_oxidekiq(redis: &RedisServer, concurrency: usize) -> (Oxidekiq, String) {
    let c = concurrency.to_string();
    let ox = Oxidekiq::start(
        &redis.url(),
        &[
            "-q",
            "shared",
            "-c",
            &c,
            "-t",
            "5",
            "--beat-interval",
            BEAT,
            "--poll-interval",
            "0.5",
        ],
    );
    let identity = identity_of(&mut redis.conn(), ox.pid());
    (ox, identity)
}

#[track_caller]
fn identity_of(conn: &mut redis::Connection, pid: u32) -> String {
    support::identity_of(conn, pid, Duration::from_secs(30))
}

/// Pushes `ids.len()` ChaosJobs with Ruby's client (`push_bulk`), `mode`/`sleep_ms` each, `retry`
/// as given (Ruby literal).
fn push_bulk(redis: &RedisServer, ids: &[String], mode: &str, sleep_ms: u64, retry: &str) {
    let list = ids
        .iter()
        .map(|i| format!("{i:?}"))
        .collect::<Vec<_>>()
        .join(",");
    let out = ruby(
        &format!(
            r#"ids = [{list}]
jids = Sidekiq::Client.push_bulk("class" => "ChaosJob", "queue" => "shared", "retry" => {retry},
  "args" => ids.map {{ |i| ["{mode}", {sleep_ms}, i] }})
puts jids.compact.size"#
        ),
        &redis.url(),
    );
    assert_eq!(
        out.trimmed(),
        ids.len().to_string(),
        "Ruby pushed every job"
    );
}

fn counts(c: &mut redis::Connection, key: &str) -> HashMap<String, u64> {
    c.hgetall(key).unwrap()
}

/// Every non-empty `oxidekiq:batch:*` or `oxidekiq:landing:*` key.
fn own_keys(c: &mut redis::Connection) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for k in c.keys::<_, Vec<String>>("oxidekiq:batch:*").unwrap() {
        if !support::held_in(c, &k).is_empty() {
            out.push(k);
        }
    }
    for k in c.keys::<_, Vec<String>>("oxidekiq:landing:*").unwrap() {
        if c.llen::<_, usize>(&k).unwrap() > 0 {
            out.push(k);
        }
    }
    out
}

/// The ids (third argument) of the jobs held in working keys (batch lists).
fn ids_in_working(c: &mut redis::Connection, pattern: &str) -> HashSet<String> {
    let mut ids = HashSet::new();
    for k in c.keys::<_, Vec<String>>(pattern).unwrap() {
        for v in support::held_in(c, &k) {
            let job: serde_json::Value = serde_json::from_str(&v).unwrap();
            ids.insert(job["args"][2].as_str().unwrap().to_string());
        }
    }
    ids
}

fn dead_ids(c: &mut redis::Connection) -> Vec<String> {
    let members: Vec<String> = c.zrange("dead", 0, -1).unwrap();
    members
        .iter()
        .map(|m| {
            let job: serde_json::Value = serde_json::from_str(m).unwrap();
            assert!(
                job["error_class"].is_string() && job["error_message"].is_string(),
                "a dead entry says why: {m}"
            );
            job["args"][2].as_str().unwrap().to_string()
        })
        .collect()
}

#[test]
fn ruby_and_oxidekiq_drain_one_queue_and_every_job_runs_exactly_once() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let mut rb = RubySidekiq::start(&redis.url(), JOBS_RB, &["shared"], 5);
    let rb_id = rb
        .wait_for_identity(&mut c, Duration::from_secs(30))
        .expect("the Ruby process registers");
    let (mut ox, ox_id) = start_oxidekiq(&redis, 10);

    // Both are up before the first job: each gets its share from the start.
    let ok: Vec<String> = (0..1200).map(|i| format!("ok{i}")).collect();
    let sleepy: Vec<String> = (0..300).map(|i| format!("sl{i}")).collect();
    let failing: Vec<String> = (0..60).map(|i| format!("f{i}")).collect();
    push_bulk(&redis, &ok, "ok", 0, "true");
    push_bulk(&redis, &sleepy, "sleep", 20, "true");
    push_bulk(&redis, &failing, "fail", 0, "0");

    let succeeding: Vec<&String> = ok.iter().chain(&sleepy).collect();
    assert!(
        wait_until(Duration::from_secs(180), || {
            let done: usize = c.hlen("chaos:done").unwrap();
            let dead: usize = c.zcard("dead").unwrap();
            done >= succeeding.len() && dead >= failing.len()
        }),
        "every job ran: done {:?} of {}, dead {:?} of {}",
        c.hlen::<_, usize>("chaos:done"),
        succeeding.len(),
        c.zcard::<_, usize>("dead"),
        failing.len()
    );
    // Anything still running or written late shows up in the counts below: a second for a late write
    // that must NOT come (no event marks its absence).
    std::thread::sleep(Duration::from_secs(1));

    let done = counts(&mut c, "chaos:done");
    let runs = counts(&mut c, "chaos:runs");
    let by_ruby = counts(&mut c, "chaos:ruby");
    for id in &succeeding {
        assert_eq!(done.get(*id), Some(&1), "{id} ran to its end exactly once");
        assert_eq!(runs.get(*id), Some(&1), "{id} started exactly once");
    }
    let mut dead = dead_ids(&mut c);
    dead.sort();
    let mut want = failing.clone();
    want.sort();
    assert_eq!(dead, want, "each failing job is in the dead set once");
    for id in &failing {
        assert_eq!(runs.get(id), Some(&1), "{id} ran once (retry 0)");
        assert_eq!(done.get(id), None);
    }
    let total = succeeding.len() + failing.len();
    let ruby_ran = by_ruby.values().sum::<u64>() as usize;
    assert!(
        ruby_ran > 0 && ruby_ran < total,
        "both processes took part: Ruby ran {ruby_ran} of {total}"
    );
    assert_eq!(c.llen::<_, usize>("queue:shared").unwrap(), 0);
    assert_eq!(c.zcard::<_, usize>("retry").unwrap(), 0);
    assert_eq!(
        own_keys(&mut c),
        Vec::<String>::new(),
        "oxidekiq holds nothing"
    );

    // Each one's Busy entry is its own; both leave `processes` on TERM.
    let members: HashSet<String> = c.smembers("processes").unwrap();
    assert_eq!(members, HashSet::from([rb_id.clone(), ox_id.clone()]));
    ox.signal("TERM");
    rb.signal("TERM");
    assert!(ox.wait_exit(Duration::from_secs(20)).unwrap().success());
    assert!(rb.wait_exit(Duration::from_secs(30)).is_some());
    let members: Vec<String> = c.smembers("processes").unwrap();
    assert!(members.is_empty(), "{members:?}");
}

#[test]
fn sigkill_of_oxidekiq_on_a_shared_queue_ruby_cleanup_and_our_recovery_keep_to_their_own_keys() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let mut rb = RubySidekiq::start(&redis.url(), JOBS_RB, &["shared"], 3);
    let rb_id = rb
        .wait_for_identity(&mut c, Duration::from_secs(30))
        .expect("the Ruby process registers");
    let (mut ox, ox_id) = start_oxidekiq(&redis, 20);

    let ids: Vec<String> = (0..400).map(|i| format!("k{i}")).collect();
    push_bulk(&redis, &ids, "sleep", 300, "true");
    let working = format!("oxidekiq:batch:{ox_id}:*");
    assert!(
        wait_until(Duration::from_secs(60), || {
            ids_in_working(&mut c, &working).len() >= 5
                && c.hlen::<_, usize>("chaos:done").unwrap() >= 20
        }),
        "oxidekiq is mid-drain"
    );
    ox.kill_9();
    let inflight = ids_in_working(&mut c, &working);
    assert!(!inflight.is_empty());
    let landing: Vec<String> = c.keys(format!("oxidekiq:landing:{ox_id}:*")).unwrap();
    let mut landed: Vec<String> = Vec::new();
    for k in &landing {
        landed.extend(c.lrange::<_, Vec<String>>(k, 0, -1).unwrap());
    }

    // Sidekiq prunes a process from `processes` once its identity hash has expired (60 s after its
    // last beat). Expire ours now instead of waiting, then let Ruby's own clean-up run.
    let _: () = redis::cmd("PEXPIRE")
        .arg(&ox_id)
        .arg(1)
        .query(&mut c)
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || !c
            .exists::<_, bool>(&ox_id)
            .unwrap()),
        "{ox_id} never expired"
    );
    let out = ruby(
        r#"require "sidekiq/api"
cleaned = Sidekiq::ProcessSet.new(false).cleanup
puts cleaned
puts Sidekiq::ProcessSet.new(false).map(&:identity).sort.join(",")"#,
        &redis.url(),
    );
    let lines = out.lines();
    // The Ruby server's poller may have pruned it first (it runs the same clean-up): then 0 here.
    assert!(matches!(lines[0], "0" | "1"), "{lines:?}");
    assert_eq!(
        lines.get(1).copied(),
        Some(rb_id.as_str()),
        "only Ruby is left"
    );
    // Ruby's clean-up left oxidekiq's working hash and landing lists as they were.
    assert_eq!(ids_in_working(&mut c, &working), inflight);
    let mut landed_now: Vec<String> = Vec::new();
    for k in &landing {
        landed_now.extend(c.lrange::<_, Vec<String>>(k, 0, -1).unwrap());
    }
    assert_eq!(landed_now, landed);

    // A new oxidekiq process recovers the dead one's jobs once its liveness key is gone; Ruby keeps
    // draining meanwhile and its own keys stay its own.
    let (mut ox2, ox2_id) = start_oxidekiq(&redis, 20);
    assert!(
        wait_until(Duration::from_secs(60), || c
            .keys::<_, Vec<String>>(&working)
            .unwrap()
            .is_empty()),
        "the dead process's working hash was recovered:\n{}",
        ox2.log()
    );
    assert!(
        wait_until(Duration::from_secs(120), || c
            .hlen::<_, usize>("chaos:done")
            .unwrap()
            >= ids.len()),
        "every job ran to its end: {} of {}",
        c.hlen::<_, usize>("chaos:done").unwrap(),
        ids.len()
    );
    // A second for a late second run that must NOT come (no event marks its absence).
    std::thread::sleep(Duration::from_secs(1));
    let done = counts(&mut c, "chaos:done");
    for id in &ids {
        let n = done.get(id).copied().unwrap_or(0);
        assert!(n >= 1, "{id} ran");
        assert!(
            n == 1 || inflight.contains(id),
            "{id} ran {n} times but was not in flight at the kill"
        );
    }
    let recovered: Vec<String> = ox2
        .log()
        .lines()
        .filter(|l| l.contains("recovered jobs of a process that died"))
        .map(str::to_string)
        .collect();
    assert!(
        recovered
            .iter()
            .all(|l| l.contains(&format!("process={ox_id}"))),
        "recovery touched only the dead oxidekiq: {recovered:?}"
    );
    assert!(!recovered.is_empty(), "the recovery was logged");
    let members: HashSet<String> = c.smembers("processes").unwrap();
    assert_eq!(members, HashSet::from([rb_id.clone(), ox2_id.clone()]));
    assert!(
        c.exists::<_, bool>(&rb_id).unwrap(),
        "Ruby's heartbeat hash is intact"
    );
    assert_eq!(c.llen::<_, usize>("queue:shared").unwrap(), 0);
    assert_eq!(c.zcard::<_, usize>("retry").unwrap(), 0);
    assert_eq!(c.zcard::<_, usize>("dead").unwrap(), 0);
    assert_eq!(
        own_keys(&mut c),
        Vec::<String>::new(),
        "oxidekiq holds nothing"
    );

    ox2.signal("TERM");
    rb.signal("TERM");
    assert!(ox2.wait_exit(Duration::from_secs(20)).unwrap().success());
    assert!(rb.wait_exit(Duration::from_secs(30)).is_some());
}
