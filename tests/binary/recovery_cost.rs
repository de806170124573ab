//! What orphan recovery costs Redis (issue 43 item 3), through the real binary (`cargo build --workspace`
//! first): every process walked the whole keyspace (`SCAN MATCH oxidekiq:[blw]...`) every two beats, so
//! an idle fleet beside a Rails cache paid for every key of the cache. Recovery now reads the index of
//! each process's held lists, written by the writes that fill them, and walks the keyspace only at its
//! first pass and about every five minutes after; a killed process is still recovered within its grace.
use crate::support;

use std::time::{Duration, Instant};

use redis::Commands;
use support::{Oxidekiq, RedisServer, identity_of, wait_beats, wait_until};

/// A generous bound for anything the tests wait for (a loaded shared machine).
const WAIT: Duration = Duration::from_secs(60);

/// A `ChaosJob` payload (`workers/src/lib.rs`) that sleeps `ms`.
fn sleeping(jid: &str, ms: u64) -> String {
    format!(
        r#"{{"retry":true,"queue":"default","class":"ChaosJob","args":["sleep",{ms},"{jid}"],"jid":"{jid}","created_at":1700000000.0,"enqueued_at":1700000000.0}}"#
    )
}

/// How many `SCAN` calls Redis has served (`INFO commandstats`).
fn scans(c: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(c).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_scan:calls="))
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn start(redis: &RedisServer) -> Oxidekiq {
    Oxidekiq::start(
        &redis.url(),
        &[
            "-q",
            "default",
            "-c",
            "2",
            "--beat-interval",
            "1",
            "-t",
            "3",
        ],
    )
}

/// Two processes beat for a while (recovery passes every two beats in each), then one is killed with
/// two jobs running: the other recovers them within the grace, and meanwhile Redis served only the
/// first pass's keyspace walk of each process (before: one walk every two beats in each process).
#[test]
fn idle_recovery_walks_the_keyspace_only_at_its_first_pass_and_still_recovers_a_killed_process() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    for i in 0..2 {
        let _: () = c
            .lpush("queue:default", sleeping(&format!("s{i}"), 120_000))
            .unwrap();
    }
    let mut victim = start(&redis);
    assert!(
        wait_until(WAIT, || c.hlen::<_, usize>("chaos:runs").unwrap() == 2),
        "the jobs never started:\n{}",
        victim.log()
    );
    let mut rescuer = start(&redis);
    assert!(
        wait_until(WAIT, || c.scard::<_, usize>("processes").unwrap() == 2),
        "the second process never showed up:\n{}",
        rescuer.log()
    );
    // Past the starts' walks (recovery's first pass, the cron poller's look for namespaces, which
    // runs every ten minutes), ten beats of both: five recovery passes each, none walking. Counted in
    // beats each process writes, not in seconds a loaded machine may stretch.
    let ids = [
        identity_of(&mut c, victim.pid(), WAIT),
        identity_of(&mut c, rescuer.pid(), WAIT),
    ];
    for id in &ids {
        assert!(wait_beats(&mut c, id, 3, WAIT), "{id} stopped beating");
    }
    let before = scans(&mut c);
    for id in &ids {
        assert!(wait_beats(&mut c, id, 10, WAIT), "{id} stopped beating");
    }
    let walked = scans(&mut c);
    assert_eq!(
        walked, before,
        "keyspace walks in ten beats of two idle processes"
    );
    victim.kill_9();
    let killed = Instant::now();
    let rerun = wait_until(WAIT, || {
        let runs: Vec<(String, u64)> = c.hgetall("chaos:runs").unwrap();
        runs.len() == 2 && runs.iter().all(|(_, n)| *n >= 2)
    });
    assert!(
        rerun,
        "the killed process's jobs were not recovered:\n{}",
        rescuer.log()
    );
    // The liveness TTL is 3 s at a 1 s beat, the grace as long, and a pass runs every two beats (±25%).
    let took = killed.elapsed();
    assert!(
        took < Duration::from_secs(15),
        "recovered {took:?} after the kill"
    );
    assert_eq!(scans(&mut c), walked, "recovered without a keyspace walk");
    // The recovered process left the holders, and its index is gone.
    let holders: Vec<String> = c.smembers("oxidekiq:holders").unwrap();
    assert_eq!(holders.len(), 1, "{holders:?}");
    let indexes: Vec<String> = c.keys("oxidekiq:held:*").unwrap();
    assert!(
        indexes.iter().all(|k| k.ends_with(&holders[0])),
        "{indexes:?}"
    );
    rescuer.signal("TERM");
    assert!(rescuer.wait_exit(WAIT).is_some());
    let left: Vec<String> = c.keys("oxidekiq:h*").unwrap();
    assert!(
        left.is_empty(),
        "a clean stop leaves neither its index nor its place among the holders: {left:?}"
    );
}

/// A user whose ACL refuses `SCAN` (managed Redis often does): the refused walk is named as an ACL's
/// refusal of the command (it read "a key of the wrong type?" before), and the passes by index, which
/// need no `SCAN`, still recover a killed process's jobs.
#[test]
fn a_refused_keyspace_walk_is_named_and_recovery_by_index_goes_on() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let _: () = redis::cmd("ACL")
        .arg(&[
            "SETUSER", "limited", "on", ">pw", "~*", "&*", "+@all", "-scan",
        ])
        .query(&mut c)
        .unwrap();
    for i in 0..2 {
        let _: () = c
            .lpush("queue:default", sleeping(&format!("a{i}"), 120_000))
            .unwrap();
    }
    let mut victim = start(&redis);
    assert!(
        wait_until(WAIT, || c.hlen::<_, usize>("chaos:runs").unwrap() == 2),
        "the jobs never started:\n{}",
        victim.log()
    );
    let limited_url = redis.url().replacen("redis://", "redis://limited:pw@", 1);
    let mut rescuer = Oxidekiq::start(
        &limited_url,
        &[
            "-q",
            "default",
            "-c",
            "2",
            "--beat-interval",
            "1",
            "-t",
            "3",
        ],
    );
    assert!(
        wait_until(WAIT, || c.scard::<_, usize>("processes").unwrap() == 2),
        "the second process never showed up:\n{}",
        rescuer.log()
    );
    victim.kill_9();
    let rerun = wait_until(WAIT, || {
        let runs: Vec<(String, u64)> = c.hgetall("chaos:runs").unwrap();
        runs.len() == 2 && runs.iter().all(|(_, n)| *n >= 2)
    });
    let log = rescuer.log();
    assert!(
        rerun,
        "the killed process's jobs were not recovered:\n{log}"
    );
    assert!(
        log.lines().any(|l| l.contains("ERROR")
            && l.contains("refused by an ACL")
            && l.to_lowercase().contains("scan")),
        "the refused walk is not named as an ACL refusal of SCAN:\n{log}"
    );
    assert!(!log.contains("wrong type?"), "{log}");
    rescuer.signal("TERM");
    assert!(rescuer.wait_exit(WAIT).is_some());
}

/// Review of issue 43: a recovery that took a live process for dead (a pause past its liveness TTL and
/// the grace) deletes its index of held lists; each landing list was indexed once, before its first
/// blocking wait, and is added again only by the process's own recovery passes (`tidy_index`). But the
/// recovery loop is given the first capsule's fetch alone (`launcher.rs`: `self.fetch`), so another
/// capsule's landing lists never went back into the index: a job caught there by a later kill was found
/// only by the fleet's walk, minutes later, not within the recovery bound.
#[test]
fn every_capsules_landing_list_goes_back_into_an_index_a_recovery_dropped() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let mut ox = Oxidekiq::start(
        &redis.url(),
        &[
            "-q",
            "default",
            "-c",
            "1",
            "--capsule",
            "other:1:b",
            "--beat-interval",
            "0.5",
        ],
    );
    let id = identity_of(&mut c, ox.pid(), WAIT);
    let index = format!("oxidekiq:held:{id}");
    let landing_default = format!("oxidekiq:landing:{id}:default");
    let landing_b = format!("oxidekiq:landing:{id}:b");
    assert!(
        wait_until(WAIT, || {
            let m: Vec<String> = c.smembers(&index).unwrap();
            m.contains(&landing_default) && m.contains(&landing_b)
        }),
        "both capsules' landing lists indexed before their first waits:\n{}",
        ox.log()
    );
    // What a recovery that took this process for dead does to its index.
    let _: () = c.del(&index).unwrap();
    assert!(
        wait_until(WAIT, || c
            .sismember::<_, _, bool>(&index, &landing_default)
            .unwrap()),
        "the process's own pass never indexed its landing list again:\n{}",
        ox.log()
    );
    // Two more passes (one every two beats).
    assert!(wait_beats(&mut c, &id, 5, WAIT), "{id} stopped beating");
    let members: Vec<String> = c.smembers(&index).unwrap();
    assert!(
        members.contains(&landing_b),
        "the second capsule's landing list is in no index after the process's passes: {members:?}"
    );
    ox.signal("TERM");
    assert!(ox.wait_exit(WAIT).is_some());
}
