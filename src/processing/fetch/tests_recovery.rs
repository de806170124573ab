//! Orphan recovery and the scheduled poller at the edges an adversarial review found, against a real
//! `redis-server`: an identity whose host name holds ':', a suspect mark left from an earlier absence,
//! the recovery lock's release, and due members too large to read a thousand at a time.
use crate::test_support as support;

use std::time::Duration;

use oxidekiq::fetch::{self, RecoveryPolicy};
use oxidekiq::redis_conn::{self, Conn};
use oxidekiq::time::{self, TimeFormat};
use redis::Commands;

/// This test's own identity, as the recovering process.
const ME: &str = "me:1:aaaaaaaaaaaa";

const JOB: &str = r#"{"class":"A","args":[],"jid":"0123456789abcdef01234567","queue":"default"}"#;

async fn conn(redis: &support::RedisServer) -> Conn {
    redis_conn::connect(&redis::Client::open(redis.url()).unwrap())
        .await
        .unwrap()
}

fn policy(grace: Duration) -> RecoveryPolicy {
    RecoveryPolicy {
        grace,
        time_format: TimeFormat::Seconds,
    }
}

async fn pass(conn: &mut Conn, grace: Duration) -> fetch::recovery::Recovered {
    fetch::recover_orphans(conn, ME, time::now(), policy(grace))
        .await
        .unwrap()
        .expect("no other process holds the recovery lock")
}

/// A process whose host name holds ':' (here `node:a`, as an older oxidekiq wrote it) keeps its jobs
/// while it is alive, and once it is dead they go back to their own queue, not to a queue named after
/// part of its identity.
#[tokio::test]
async fn a_colon_in_the_host_name_neither_strands_nor_steals_jobs() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut conn = conn(&redis).await;
    let live = "node:a:42:0123456789ab";
    let dead = "node:b:43:ba9876543210";
    let live_key = format!("oxidekiq:working:{live}:default");
    let dead_key = format!("oxidekiq:working:{dead}:low:prio");
    let _: () = c.hset(&live_key, "1", JOB).unwrap();
    let _: () = c.hset(&dead_key, "2", JOB).unwrap();
    let grace = Duration::from_millis(300);
    // Passes over more than a grace: the live one beats before each, the dead one never does.
    let mut requeued = 0;
    for _ in 0..4 {
        fetch::mark_alive(&mut conn, live, Duration::from_secs(10))
            .await
            .unwrap();
        requeued += pass(&mut conn, grace).await.requeued;
        tokio::time::sleep(grace + Duration::from_millis(100)).await;
    }
    let still: usize = c.hlen(&live_key).unwrap();
    assert_eq!(still, 1, "the live process's job was taken");
    assert_eq!(requeued, 1, "only the dead process's job goes back");
    let queues: Vec<String> = c.keys("queue:*").unwrap();
    assert_eq!(queues, vec!["queue:low:prio".to_string()]);
    let back: Vec<String> = c.lrange("queue:low:prio", 0, -1).unwrap();
    assert_eq!(back, vec![JOB.to_string()]);
    let gone: bool = c.exists(&dead_key).unwrap();
    assert!(!gone);
}

/// This version's own identity never holds a ':' in its host part, so its keys split at the right place.
#[test]
fn an_identity_built_from_a_colon_host_name_splits_back_whole() {
    let id = oxidekiq::heartbeat::identity_for("node:a", 42, "0123456789ab");
    let key = format!("{id}:ffff:default");
    assert_eq!(
        oxidekiq::keys::split_held(&key),
        Some((id.as_str(), "ffff:default"))
    );
}

/// Stall 1 leaves a suspect mark; the process beats again before any pass sees it back; stall 2 makes
/// its key vanish again. The next pass must start a new grace, not count from the first mark.
#[tokio::test]
async fn a_beat_clears_a_suspect_mark_so_a_later_absence_gets_a_full_grace() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut conn = conn(&redis).await;
    let other = "otherhost:2:bbbbbbbbbbbb";
    let key = format!("oxidekiq:working:{other}:a");
    let _: () = c.hset(&key, "1", JOB).unwrap();
    let grace = Duration::from_millis(1500);
    // Stall 1: no liveness key; the pass marks it.
    let r = pass(&mut conn, grace).await;
    assert_eq!(r.suspects, 1);
    let marked: bool = c.hexists(oxidekiq::keys::SUSPECTS, other).unwrap();
    assert!(marked);
    // It beats: the mark goes with it.
    fetch::mark_alive(&mut conn, other, Duration::from_secs(10))
        .await
        .unwrap();
    let marked: bool = c.hexists(oxidekiq::keys::SUSPECTS, other).unwrap();
    assert!(!marked, "a beat must clear the process's own suspect mark");
    // Longer than the grace since the first mark, still alive.
    tokio::time::sleep(grace + Duration::from_millis(300)).await;
    // Stall 2: its key is gone (as an expiry during a stall leaves it).
    let _: () = c.del(oxidekiq::keys::alive(other)).unwrap();
    let r = pass(&mut conn, grace).await;
    assert_eq!(
        r.requeued, 0,
        "taken at once: the grace counted from the first absence"
    );
    assert_eq!(r.suspects, 1);
    let held: usize = c.hlen(&key).unwrap();
    assert_eq!(held, 1);
    // It stays away a full grace: now its job goes back.
    tokio::time::sleep(grace + Duration::from_millis(300)).await;
    let r = pass(&mut conn, grace).await;
    assert_eq!(r.requeued, 1);
    let back: Vec<String> = c.lrange("queue:a", 0, -1).unwrap();
    assert_eq!(back, vec![JOB.to_string()]);
}

/// The lock is released only by its holder: a pass leaves another process's lock alone, and frees its
/// own. Keys other than working hashes and landing lists, however many, are not touched.
#[tokio::test]
async fn the_recovery_lock_is_released_only_by_its_holder() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut conn = conn(&redis).await;
    let unrelated: Vec<(String, String)> = (0..5000)
        .map(|i| (format!("cache:{i}"), i.to_string()))
        .collect();
    let _: () = c.mset(&unrelated).unwrap();
    // Near-misses of the scan pattern, which recovery must ignore.
    let _: () = c.hset("oxidekiq:lording:x:1:ab:q", "1", JOB).unwrap();
    // Held as every lock is taken: with a TTL (one without is not a lock of oxidekiq's).
    let _: () = c
        .pset_ex("oxidekiq:recovery-lock", "someone:9:cccccccccccc", 30_000)
        .unwrap();
    let r = fetch::recover_orphans(&mut conn, ME, time::now(), policy(Duration::from_secs(1)))
        .await
        .unwrap();
    assert!(r.is_none(), "another process holds the lock");
    let holder: String = c.get("oxidekiq:recovery-lock").unwrap();
    assert_eq!(holder, "someone:9:cccccccccccc");
    let _: () = c.del("oxidekiq:recovery-lock").unwrap();
    pass(&mut conn, Duration::from_secs(1)).await;
    let held: bool = c.exists("oxidekiq:recovery-lock").unwrap();
    assert!(!held, "a finished pass frees its own lock");
    let n: usize = redis::cmd("DBSIZE").query(&mut c).unwrap();
    assert_eq!(n, 5001);
}

/// Due members far larger than the poller's byte budget, and many small ones behind them: every one
/// is promoted to its queue, in one round, none lost or doubled.
#[tokio::test]
async fn large_due_members_are_all_promoted() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut conn = conn(&redis).await;
    let big = oxidekiq::scheduled::BATCH_BYTES * 3 / 2;
    let pad = "x".repeat(big);
    let n_big = 6;
    let n_small = 1500;
    for i in 0..n_big {
        let m = format!(r#"{{"class":"A","args":["{pad}"],"jid":"big{i}","queue":"q"}}"#);
        let _: () = c.zadd("schedule", m, 1.0 + i as f64).unwrap();
    }
    let small: Vec<(f64, String)> = (0..n_small)
        .map(|i| {
            (
                100.0 + i as f64,
                format!(r#"{{"class":"A","args":[{i}],"jid":"small{i}","queue":"q"}}"#),
            )
        })
        .collect();
    let _: () = c.zadd_multiple("schedule", &small).unwrap();
    // One not yet due, which stays.
    let _: () = c
        .zadd(
            "schedule",
            r#"{"class":"A","args":[],"jid":"later","queue":"q"}"#,
            time::now() + 3600.0,
        )
        .unwrap();
    drop(pad);
    let moved =
        oxidekiq::scheduled::enqueue_due(&mut conn, "schedule", time::now(), TimeFormat::Seconds)
            .await
            .unwrap();
    assert_eq!(moved, (n_big + n_small) as u64);
    let left: usize = c.zcard("schedule").unwrap();
    assert_eq!(left, 1);
    let queued: Vec<Vec<u8>> = c.lrange("queue:q", 0, -1).unwrap();
    assert_eq!(queued.len(), n_big + n_small);
    let mut jids: Vec<String> = queued
        .iter()
        .map(|p| {
            let v: serde_json::Value = serde_json::from_slice(p).unwrap();
            if let Some(s) = v["args"][0].as_str() {
                assert_eq!(s.len(), big, "a large payload kept every byte");
            }
            v["jid"].as_str().unwrap().to_string()
        })
        .collect();
    jids.sort();
    jids.dedup();
    assert_eq!(jids.len(), n_big + n_small, "a job pushed twice or lost");
}

/// What a recovery pass of the last release (and of the one before it) does to the suspects hash at
/// its end, as written in its `recover_locked` (3d24d66, src/fetch/recovery.rs:429-435): it SCANs only
/// `oxidekiq:[lw][ao][nr][dk]ing:*`, counts as holders the identities of the keys found there, and
/// deletes the mark of every other suspect from `oxidekiq:suspects`.
fn last_release_pass_end(c: &mut redis::Connection) {
    let found: Vec<String> = c
        .scan_match::<_, String>("oxidekiq:[lw][ao][nr][dk]ing:*")
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let holders: Vec<String> = found
        .iter()
        .filter_map(|k| {
            let rest = k
                .strip_prefix("oxidekiq:working:")
                .or_else(|| k.strip_prefix("oxidekiq:landing:"))?;
            oxidekiq::keys::split_held(rest).map(|(id, _)| id.to_string())
        })
        .collect();
    let suspects: Vec<String> = c.hkeys("oxidekiq:suspects").unwrap();
    let gone: Vec<&String> = suspects.iter().filter(|s| !holders.contains(s)).collect();
    if !gone.is_empty() {
        let _: () = c.hdel("oxidekiq:suspects", gone).unwrap();
    }
}

/// A mixed fleet: a process of this release is killed with jobs in its batch lists, and a process of
/// the last release runs its recovery passes in between this release's. The last release never sees
/// `oxidekiq:batch:` keys, so it took the dead process for no holder and deleted its suspect mark at
/// every pass: this release's passes found it unmarked each time, marked it anew, and never reached
/// the grace. Its jobs stayed in its batch list for as long as any process of the last release ran.
#[tokio::test]
async fn a_killed_process_of_this_release_is_recovered_while_the_last_release_runs_passes() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut conn = conn(&redis).await;
    let dead = "deadhost:7:dddddddddddd";
    let list = oxidekiq::keys::batch_list(&oxidekiq::keys::batch_prefix(dead), "default", 3);
    let _: () = c.rpush(&list, JOB).unwrap();
    let grace = Duration::from_millis(400);
    // Its mark is one no older release deletes, and a beat of its own clears it.
    pass(&mut conn, grace).await;
    let batch_suspects = oxidekiq::keys::BATCH_SUSPECTS;
    assert!(c.hexists::<_, _, bool>(batch_suspects, dead).unwrap());
    fetch::mark_alive(&mut conn, dead, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(!c.hexists::<_, _, bool>(batch_suspects, dead).unwrap());
    let _: () = c.del(oxidekiq::keys::alive(dead)).unwrap();
    // Passes of both releases alternate (as their recovery loops do, each every two beats), over more
    // than four graces.
    for _ in 0..6 {
        pass(&mut conn, grace).await;
        let back: usize = c.llen("queue:default").unwrap();
        if back > 0 {
            break;
        }
        tokio::time::sleep(grace / 2 + Duration::from_millis(50)).await;
        last_release_pass_end(&mut c);
        tokio::time::sleep(grace / 2 + Duration::from_millis(50)).await;
    }
    let back: Vec<String> = c.lrange("queue:default", 0, -1).unwrap();
    assert_eq!(
        back,
        vec![JOB.to_string()],
        "the dead process's job is still stranded in its batch list"
    );
    assert!(!c.exists::<_, bool>(&list).unwrap());
}

/// Issue 43: a batch list's acks set of the wrong type raised inside the recovery script, and the error
/// ended the whole pass, so no dead process was recovered again, not even those whose keys were intact.
/// Now that list alone stays (named in the pass's error), and the pass recovers the rest: the other
/// lists of the same process, and the other dead processes.
#[tokio::test]
async fn a_damaged_acks_set_stops_only_its_own_list_in_a_recovery_pass() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut conn = conn(&redis).await;
    let (one, two) = ("deadhost:7:aaaaaaaaaaab", "deadhost:8:bbbbbbbbbbbc");
    let damaged = format!("oxidekiq:batch:{one}:default:@1");
    let intact = format!("oxidekiq:batch:{one}:default:@2");
    let other = format!("oxidekiq:batch:{two}:default:@1");
    // Distinct payloads: recovery counts each payload's recoveries.
    for (i, key) in [&damaged, &intact, &other].into_iter().enumerate() {
        for j in 0..2 {
            let _: () = c
                .rpush(key, JOB.replace("[]", &format!("[{i},{j}]")))
                .unwrap();
        }
    }
    let _: () = c.set(oxidekiq::keys::acks_of(&damaged), "x").unwrap();
    let grace = Duration::from_millis(300);
    let r = pass(&mut conn, grace).await;
    assert_eq!(r.suspects, 2);
    tokio::time::sleep(grace + Duration::from_millis(100)).await;
    let r = pass(&mut conn, grace).await;
    assert_eq!(r.requeued, 4, "the intact lists of both processes go back");
    let back: usize = c.llen("queue:default").unwrap();
    assert_eq!(back, 4);
    assert!(!c.exists::<_, bool>(&intact).unwrap());
    assert!(!c.exists::<_, bool>(&other).unwrap());
    let kept: usize = c.llen(&damaged).unwrap();
    assert_eq!(kept, 2, "the damaged list's jobs wait in it for a repair");
    // Repaired: the next pass takes them.
    let _: () = c.del(oxidekiq::keys::acks_of(&damaged)).unwrap();
    let r = pass(&mut conn, grace).await;
    assert_eq!(r.requeued, 2);
    let back: usize = c.llen("queue:default").unwrap();
    assert_eq!(back, 6);
}

/// How many `SCAN` calls Redis has served since the last `CONFIG RESETSTAT`.
fn scans(c: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(c).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_scan:calls="))
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Issue 43 item 3: a pass by index finds a dead process's batch lists through the index the fetch wrote
/// beside them, and an older release's keys (which no index names) through the list the last keyspace
/// walk left, without walking the keyspace again; the recovered process leaves the holders and its
/// index goes.
#[tokio::test]
async fn a_pass_by_index_recovers_without_walking_the_keyspace() {
    use fetch::Fetch;
    use fetch::recovery::Find;
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut conn = conn(&redis).await;
    let other = "other:9:cccccccccccc";
    super::tests_scripts::fill(&mut c, "a", 4);
    let f = super::tests_scripts::fetcher(&redis, &["a"], other).await;
    // Two fetches: the fast path's transaction, then the batch script.
    assert_eq!(f.retrieve_work(2).await.unwrap().len(), 2);
    assert_eq!(f.retrieve_work(2).await.unwrap().len(), 2);
    let index: Vec<String> = c.smembers(oxidekiq::keys::held_index(other)).unwrap();
    assert_eq!(
        index.len(),
        2,
        "each batch list indexed by the fetch that filled it: {index:?}"
    );
    fetch::mark_alive(&mut conn, other, Duration::from_secs(10))
        .await
        .unwrap();
    let _: () = c.del(oxidekiq::keys::alive(other)).unwrap();
    let old = "oldhost:5:dddddddddddd";
    let _: () = c
        .hset(format!("oxidekiq:working:{old}:a"), "1", JOB)
        .unwrap();
    let grace = Duration::from_millis(300);
    let mut watch = Vec::new();
    let r = fetch::recovery::recover_found(
        &mut conn,
        ME,
        time::now(),
        policy(grace),
        Find::Scan(&mut watch),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(r.suspects, 2);
    assert_eq!(
        watch.len(),
        1,
        "the older release's process is watched: {watch:?}"
    );
    let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query(&mut c).unwrap();
    tokio::time::sleep(grace + Duration::from_millis(100)).await;
    let r = fetch::recovery::recover_found(
        &mut conn,
        ME,
        time::now(),
        policy(grace),
        Find::Index(&mut watch),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(r.requeued, 5);
    assert_eq!(scans(&mut c), 0, "no keyspace walk");
    assert!(watch.is_empty(), "recovered, no longer watched");
    let holders: Vec<String> = c.smembers(oxidekiq::keys::HOLDERS).unwrap();
    assert!(holders.is_empty(), "{holders:?}");
    let left: Vec<String> = c.keys("oxidekiq:*").unwrap();
    assert!(
        left.iter().all(|k| k.starts_with("oxidekiq:recovered")),
        "{left:?}"
    );
}

/// Review of issue 43 (fixed): a keyspace walk that Redis refuses for good (an ACL without
/// `SCAN`, as managed Redis often has) ends the whole pass, the reading of the index with it
/// (`recover_locked`: `held_by_others(conn).await?`). `recovery_loop` then gives the fleet's walk back
/// and set `next_scan` to now, so every later pass of that process was again a walk, refused again: about
/// five minutes after its start (`SCAN_EVERY`) a process whose ACL refuses `SCAN` never recovered a dead
/// process again (measured: a killed process's list still held 60 s after the kill, 3 s grace).
/// Now such a walk pass reads the indexes as any other pass: the dead holder's indexed lists go back.
#[tokio::test]
async fn a_refused_walk_still_recovers_by_index() {
    use fetch::Fetch;
    use fetch::recovery::Find;
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let _: () = redis::cmd("ACL")
        .arg(&[
            "SETUSER", "limited", "on", ">pw", "~*", "&*", "+@all", "-scan",
        ])
        .query(&mut c)
        .unwrap();
    let limited = redis.url().replacen("redis://", "redis://limited:pw@", 1);
    let mut conn = redis_conn::connect(&redis::Client::open(limited).unwrap())
        .await
        .unwrap();
    let other = "other:9:cccccccccccd";
    super::tests_scripts::fill(&mut c, "a", 2);
    let f = super::tests_scripts::fetcher(&redis, &["a"], other).await;
    assert_eq!(f.retrieve_work(2).await.unwrap().len(), 2);
    fetch::mark_alive(&mut conn, other, Duration::from_secs(10))
        .await
        .unwrap();
    let _: () = c.del(oxidekiq::keys::alive(other)).unwrap();
    let grace = Duration::from_millis(300);
    let mut requeued = 0;
    let mut errors = Vec::new();
    for _ in 0..3 {
        let mut watch = Vec::new();
        match fetch::recovery::recover_found(
            &mut conn,
            ME,
            time::now(),
            policy(grace),
            Find::Scan(&mut watch),
        )
        .await
        {
            Ok(r) => requeued += r.map_or(0, |r| r.requeued),
            Err(e) => errors.push(e.to_string()),
        }
        tokio::time::sleep(grace + Duration::from_millis(100)).await;
    }
    assert_eq!(
        requeued, 2,
        "the dead holder's indexed jobs were not recovered by walk passes whose SCAN is refused: {errors:?}"
    );
}

/// Review of issue 43 (fixed): a process that no index names (an older release's, or one
/// whose index is damaged or that left the holders) is found only by a keyspace walk, then watched by
/// the walker's passes until one a grace later recovers it. But every pass ends by deleting the suspect
/// marks of the processes it did not judge (`recover_locked`, the `HDEL` of `gone`), and another
/// process's pass by index judges only the dead holders and its own watch: in a fleet of two, the other
/// process's pass between the walker's wipes the mark, the walker's next pass marks it again as if first
/// seen, and so on: its jobs were never recovered (not "one grace after the walk"). Now only a walk,
/// which judges every process holding keys, drops the marks of the processes it did not judge.
#[tokio::test]
async fn a_process_found_by_a_walk_is_recovered_while_another_process_runs_passes_by_index() {
    use fetch::recovery::Find;
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut conn = conn(&redis).await;
    let other_pass = "me2:2:bbbbbbbbbbbb";
    // An older release's process (no index, not among the holders), dead, holding one batch list.
    let old = "oldhost:6:eeeeeeeeeeee";
    let list = format!("oxidekiq:batch:{old}:default:@1");
    let _: () = c.rpush(&list, JOB).unwrap();
    let grace = Duration::from_millis(300);
    let mut watch = Vec::new();
    let r = fetch::recovery::recover_found(
        &mut conn,
        ME,
        time::now(),
        policy(grace),
        Find::Scan(&mut watch),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(r.suspects, 1);
    assert_eq!(watch.len(), 1, "{watch:?}");
    // Passes alternate between the walker and another live process of the fleet (each runs one every
    // two beats; the recovery lock only keeps them from overlapping), over ten graces.
    let mut requeued = 0;
    for _ in 0..10 {
        let mut none = Vec::new();
        fetch::recovery::recover_found(
            &mut conn,
            other_pass,
            time::now(),
            policy(grace),
            Find::Index(&mut none),
        )
        .await
        .unwrap()
        .unwrap();
        tokio::time::sleep(grace + Duration::from_millis(50)).await;
        requeued += fetch::recovery::recover_found(
            &mut conn,
            ME,
            time::now(),
            policy(grace),
            Find::Index(&mut watch),
        )
        .await
        .unwrap()
        .unwrap()
        .requeued;
    }
    assert_eq!(
        requeued,
        1,
        "the walked-only process's job was never recovered over ten graces ({} still in {list})",
        c.llen::<_, usize>(&list).unwrap()
    );
}

/// Review of issue 43 (fixed): the fleet's walk, recovery's safety net, is taken with `SET
/// oxidekiq:recovery-walk <id> NX PX 300000`, which answers nil for a key of any type or one without a
/// TTL: such a key (damaged, or left by hand) stopped every periodic walk of the fleet for good, silently.
/// Now only a turn of ours (a string with a TTL) keeps a process from walking.
#[tokio::test]
async fn a_damaged_walk_key_does_not_stop_the_fleets_walks() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut conn = conn(&redis).await;
    let walk = oxidekiq::keys::RECOVERY_WALK;
    assert!(super::recovery::take_walk(&mut conn, ME).await, "free");
    assert!(
        !super::recovery::take_walk(&mut conn, "other:1:aaaaaaaaaaaa").await,
        "another process's turn"
    );
    let _: () = c.del(walk).unwrap();
    let _: () = c.hset(walk, "f", "v").unwrap();
    assert!(
        super::recovery::take_walk(&mut conn, ME).await,
        "a hash there stops no walk"
    );
    let _: () = c.del(walk).unwrap();
    let _: () = c.set(walk, "by hand").unwrap();
    assert!(
        super::recovery::take_walk(&mut conn, ME).await,
        "a string without a TTL stops no walk"
    );
}

/// A dead holder (`other`) with two jobs in an indexed batch list; its liveness key gone.
async fn dead_holder(redis: &support::RedisServer, conn: &mut Conn, other: &str) {
    use fetch::Fetch;
    let mut c = redis.conn();
    super::tests_scripts::fill(&mut c, "a", 2);
    let f = super::tests_scripts::fetcher(redis, &["a"], other).await;
    assert_eq!(f.retrieve_work(2).await.unwrap().len(), 2);
    fetch::mark_alive(conn, other, Duration::from_secs(10))
        .await
        .unwrap();
    let _: () = c.del(oxidekiq::keys::alive(other)).unwrap();
}

/// Two passes a grace apart (the first marks, the second recovers); what they pushed back.
async fn two_passes(conn: &mut Conn, walk: bool) -> u64 {
    use fetch::recovery::Find;
    let grace = Duration::from_millis(300);
    let mut watch = Vec::new();
    let mut requeued = 0;
    for _ in 0..2 {
        let find = if walk {
            Find::Scan(&mut watch)
        } else {
            Find::Index(&mut watch)
        };
        requeued += fetch::recovery::recover_found(conn, ME, time::now(), policy(grace), find)
            .await
            .unwrap()
            .unwrap()
            .requeued;
        tokio::time::sleep(grace + Duration::from_millis(100)).await;
    }
    requeued
}

/// Review of issue 43: one member of `oxidekiq:holders` that is not UTF-8 (written by anything but
/// oxidekiq) made the whole `SMEMBERS` fail to read as text, so every pass by index read no holder at
/// all: no dead process of the fleet was recovered by index, only by the fleet's walk minutes later.
#[tokio::test]
async fn a_holder_that_is_not_utf8_stops_no_recovery_by_index() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut conn = conn(&redis).await;
    dead_holder(&redis, &mut conn, "other:9:ccccccccccce").await;
    let _: () = c.sadd(oxidekiq::keys::HOLDERS, &b"ghost\xff"[..]).unwrap();
    assert_eq!(
        two_passes(&mut conn, false).await,
        2,
        "the dead holder's indexed jobs were not recovered by index beside a holder that is not UTF-8"
    );
}

/// Review of issue 43: one member of a dead process's index that is not UTF-8 made the whole index
/// unreadable, so the pass judged the process with no keys, found nothing to push back, and deleted
/// its index and its place among the holders: its real batch lists were left to the fleet's next walk.
#[tokio::test]
async fn an_index_member_that_is_not_utf8_costs_only_itself() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut conn = conn(&redis).await;
    let other = "other:9:cccccccccccf";
    dead_holder(&redis, &mut conn, other).await;
    let _: () = c
        .sadd(oxidekiq::keys::held_index(other), &b"junk\xff"[..])
        .unwrap();
    assert_eq!(
        two_passes(&mut conn, false).await,
        2,
        "the dead holder's indexed jobs were not recovered beside an index member that is not UTF-8"
    );
}

/// Review of issue 43: one key under a held-list prefix whose name is not UTF-8 failed the keyspace
/// walk's iterator, which the pass took for a walk refused for good (the ACL message, once): every walk
/// of the fleet then found nothing, so no list outside the indexes (an older release's) was recovered.
#[tokio::test]
async fn a_key_name_that_is_not_utf8_stops_no_walk() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut conn = conn(&redis).await;
    let _: () = c.rpush(&b"oxidekiq:landing:\xff"[..], "x").unwrap();
    let old = "oldhost:5:dddddddddddf";
    let _: () = c
        .hset(format!("oxidekiq:working:{old}:a"), "1", JOB)
        .unwrap();
    assert_eq!(
        two_passes(&mut conn, true).await,
        1,
        "the older release's working hash was not recovered by walks beside a key name that is not UTF-8"
    );
}

/// Review of issue 43: `oxidekiq:holders` of the wrong type was reported once, and then every pass by
/// index of the fleet read no holder, so no dead process was recovered by index: each waited for the
/// fleet's next walk (about five minutes, jittered), past the recovery bound the chaos test holds.
/// Now a pass that cannot read the holders walks the keyspace instead (the cost before the index,
/// only while the key is damaged). Failed before: recovered 0.
#[tokio::test]
async fn a_holders_set_of_the_wrong_type_stops_no_recovery_by_index() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut conn = conn(&redis).await;
    dead_holder(&redis, &mut conn, "other:9:cccccccccccb").await;
    let _: () = c.del(oxidekiq::keys::HOLDERS).unwrap();
    let _: () = c.set(oxidekiq::keys::HOLDERS, "damaged").unwrap();
    assert_eq!(
        two_passes(&mut conn, false).await,
        2,
        "the dead process's indexed jobs were not recovered by index beside a damaged holders set"
    );
}
