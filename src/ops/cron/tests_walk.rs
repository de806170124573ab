//! The fleet's walk of the keyspace for sidekiq-cron 2.x namespaces, against a real `redis-server`
//! (issue 43): pollers sharing a Redis walk it once between them per interval, a namespace created
//! later is found by every process, and a damaged key of ours stops no schedule.
use std::time::Duration;

use redis::Commands;

use super::{CronConfig, store};
use crate::keys;
use crate::redis_conn::{self, Conn};
use crate::test_support as support;
use crate::testing::TestShutdown;

async fn conn(redis: &support::RedisServer) -> Conn {
    redis_conn::connect(&redis::Client::open(redis.url()).unwrap())
        .await
        .unwrap()
}

/// A schedule ticking every second in the namespace `ns` (found only by walking), pushing to
/// `queue:<ns>`, and `extra` unrelated keys.
fn populate(c: &mut redis::Connection, ns: &str, extra: usize) {
    let key = format!("cron_job:{ns}:tick");
    let message = format!(r#"{{"queue":"{ns}","class":"Tick","args":[]}}"#);
    let _: () = c
        .hset_multiple(
            &key,
            &[
                ("name", "tick"),
                ("namespace", ns),
                ("cron", "* * * * * *"),
                ("klass", "Tick"),
                ("message", &message),
            ],
        )
        .unwrap();
    let _: () = c.sadd(format!("cron_jobs:{ns}"), &key).unwrap();
    let mut p = redis::pipe();
    for i in 0..extra {
        p.set(format!("cache:{i}"), i).ignore();
    }
    if extra > 0 {
        let _: () = p.query(c).unwrap();
    }
}

fn cfg() -> CronConfig {
    CronConfig {
        poll_interval: Duration::from_secs(1),
        schedule_file: "/nonexistent/schedule.yml".into(),
        ..CronConfig::default()
    }
}

/// Namespace walks a monitor saw: each starts with `SCAN 0 MATCH cron_jobs:*`.
fn walks(m: &support::Monitor) -> usize {
    m.commands()
        .iter()
        .filter(|s| {
            s.words
                .first()
                .is_some_and(|w| w.eq_ignore_ascii_case("scan"))
                && s.words.get(1).map(String::as_str) == Some("0")
                && s.words.iter().any(|w| w == keys::CRON_JOBS_NAMESPACED)
        })
        .count()
}

async fn wait_for(c: &mut redis::Connection, queue: &str, within: Duration) -> bool {
    let until = std::time::Instant::now() + within;
    while std::time::Instant::now() < until {
        if c.llen::<_, usize>(queue).unwrap() > 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Four pollers started together on one Redis (as a fleet's processes are) walk the keyspace once
/// between them, not once each: the others read what the walker found, and still run the namespaced
/// schedule only a walk finds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pollers_sharing_a_redis_walk_the_keyspace_once_between_them() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    populate(&mut c, "ns", 20_000);
    let monitor = support::Monitor::start(&redis);
    let shutdown = TestShutdown::new();
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let conn = conn(&redis).await;
        tasks.push(tokio::spawn(super::run(
            conn,
            None,
            cfg(),
            shutdown.signal(),
        )));
    }
    assert!(
        wait_for(&mut c, "queue:ns", Duration::from_secs(20)).await,
        "the namespaced schedule did not run"
    );
    // Every poller has looked by now (they started together); give stragglers a few rounds.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let n = walks(&monitor);
    shutdown.quiet();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(n, 1, "four pollers walked the keyspace {n} times");
}

/// A namespace created after the fleet's walk is found by every process within about one interval:
/// each looks again when the stored walk expires, and one of them walks again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_created_later_is_found_by_every_process() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    populate(&mut c, "ns", 100);
    let conn = conn(&redis).await;
    let every = Duration::from_secs(2);
    let ids = ["a", "b", "c"];
    let mut next = Vec::new();
    for id in ids {
        let s = store::shared_schedule_sets(&conn, id, every).await.unwrap();
        assert!(s.sets.contains(&"cron_jobs:ns".to_string()), "{s:?}");
        assert!(!s.sets.contains(&"cron_jobs:late".to_string()), "{s:?}");
        next.push(std::time::Instant::now() + s.fresh_for);
    }
    let created = std::time::Instant::now();
    populate(&mut c, "late", 0);
    for (id, at) in ids.iter().zip(next) {
        tokio::time::sleep(at.saturating_duration_since(std::time::Instant::now())).await;
        let s = store::shared_schedule_sets(&conn, id, every).await.unwrap();
        assert!(
            s.sets.contains(&"cron_jobs:late".to_string()),
            "process {id} looked again after {:?} and did not find the new namespace: {s:?}",
            created.elapsed()
        );
    }
    assert!(created.elapsed() < every * 2, "{:?}", created.elapsed());
}

/// A damaged key of ours (the stored walk a hash or without a TTL, the turn a string without a TTL
/// or a hash with a long one) is reported and makes the process walk by itself, so the namespaced
/// schedule still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_stored_walk_does_not_stop_schedules() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    populate(&mut c, "ns", 100);
    let _: () = c.hset(keys::CRON_NAMESPACES, "f", "v").unwrap();
    let conn = conn(&redis).await;
    let s = store::shared_schedule_sets(&conn, "a", Duration::from_secs(600))
        .await
        .unwrap();
    assert!(s.sets.contains(&"cron_jobs:ns".to_string()), "{s:?}");
    let (key, why) = s.damaged.expect("the damaged key is not reported");
    assert_eq!(key, keys::CRON_NAMESPACES);
    assert!(why.contains("hash"), "{why}");
    // Review (issue 43): the message said "its cron schedules are not run" while every one ran.
    assert!(why.contains("walks by itself"), "{why}");

    // The turn damaged too (no walk stored, a turn that never expires).
    let _: () = c.del(keys::CRON_NAMESPACES).unwrap();
    let _: () = c.set(keys::CRON_WALK, "someone").unwrap();
    let s = store::shared_schedule_sets(&conn, "a", Duration::from_secs(600))
        .await
        .unwrap();
    assert!(s.sets.contains(&"cron_jobs:ns".to_string()), "{s:?}");
    assert_eq!(s.damaged.map(|d| d.0), Some(keys::CRON_WALK));

    // A turn of another type with a long TTL, and a stored walk that would never expire.
    let _: () = c.del(keys::CRON_WALK).unwrap();
    let _: () = c.hset(keys::CRON_WALK, "f", "v").unwrap();
    let _: () = c.expire(keys::CRON_WALK, 86_400).unwrap();
    let s = store::shared_schedule_sets(&conn, "a", Duration::from_secs(600))
        .await
        .unwrap();
    assert!(s.sets.contains(&"cron_jobs:ns".to_string()), "{s:?}");
    assert_eq!(s.damaged.map(|d| d.0), Some(keys::CRON_WALK));
    let _: () = c.set(keys::CRON_NAMESPACES, r#"["cron_jobs"]"#).unwrap();
    let s = store::shared_schedule_sets(&conn, "a", Duration::from_secs(600))
        .await
        .unwrap();
    assert!(s.sets.contains(&"cron_jobs:ns".to_string()), "{s:?}");
    assert_eq!(s.damaged.map(|d| d.0), Some(keys::CRON_NAMESPACES));
    let _: () = c.del(keys::CRON_NAMESPACES).unwrap();

    // A poller on that Redis still runs the namespaced schedule.
    let _: () = c.hset(keys::CRON_NAMESPACES, "f", "v").unwrap();
    let shutdown = TestShutdown::new();
    let task = tokio::spawn(super::run(conn.clone(), None, cfg(), shutdown.signal()));
    let ran = wait_for(&mut c, "queue:ns", Duration::from_secs(20)).await;
    shutdown.quiet();
    task.await.unwrap();
    assert!(
        ran,
        "the namespaced schedule did not run beside a damaged key"
    );
}

/// Review (issue 43): a key named `cron_jobs:` and bytes that are not UTF-8 (anyone with Redis access
/// can make one) failed the whole walk, which was stored as finding nothing for the fleet: every
/// namespaced schedule but `default`'s stopped, at every walk. The walk skips that name now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_name_that_is_not_utf8_hides_no_other_namespace() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    populate(&mut c, "ns", 100);
    let _: () = c.sadd(&b"cron_jobs:\xff\xfe"[..], "x").unwrap();
    let conn = conn(&redis).await;
    let s = store::shared_schedule_sets(&conn, "a", Duration::from_secs(600))
        .await
        .unwrap();
    assert!(s.sets.contains(&"cron_jobs:ns".to_string()), "{s:?}");
    // The others read what the walker stored: the namespace too.
    let s = store::shared_schedule_sets(&conn, "b", Duration::from_secs(600))
        .await
        .unwrap();
    assert!(s.sets.contains(&"cron_jobs:ns".to_string()), "{s:?}");
    // A stored walk that is not UTF-8 is named, and the process walks by itself.
    let _: () = c
        .set(keys::CRON_NAMESPACES, &b"\xff[\"cron_jobs\"]"[..])
        .unwrap();
    let s = store::shared_schedule_sets(&conn, "b", Duration::from_secs(600))
        .await
        .unwrap();
    assert!(s.sets.contains(&"cron_jobs:ns".to_string()), "{s:?}");
    let (key, why) = s.damaged.expect("the damaged key is not reported");
    assert_eq!(key, keys::CRON_NAMESPACES);
    assert!(why.contains("walks by itself"), "{why}");
}

/// Review (issue 43): a stored walk whose TTL outlasts the interval (written by hand, or by a process
/// walking less often) was read until it expired, so a namespace created meanwhile was not found for
/// that long (a year, for a key written with `EX 31536000`): it is reported and the process walks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_walk_outlasting_the_interval_hides_no_new_namespace() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    populate(&mut c, "ns", 100);
    let _: () = redis::cmd("SET")
        .arg(keys::CRON_NAMESPACES)
        .arg(r#"["cron_jobs"]"#)
        .arg("EX")
        .arg(31_536_000)
        .query(&mut c)
        .unwrap();
    let conn = conn(&redis).await;
    let s = store::shared_schedule_sets(&conn, "a", Duration::from_secs(600))
        .await
        .unwrap();
    assert!(s.sets.contains(&"cron_jobs:ns".to_string()), "{s:?}");
    assert_eq!(s.damaged.map(|d| d.0), Some(keys::CRON_NAMESPACES));
}

/// Review (issue 43): an ACL that lets the poller at the gem's keys but not at oxidekiq's (a user
/// limited to `~cron_* ~queue:*`, as set up before the shared walk) stops no namespaced schedule: the
/// refused turn and stored walk leave the process to walk by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_refusing_our_keys_stops_no_namespaced_schedule() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    populate(&mut c, "ns", 100);
    let _: () = redis::cmd("ACL")
        .arg(&[
            "SETUSER", "cron", "on", ">pw", "~cron_*", "~queue:*", "~queues", "+@all",
        ])
        .query(&mut c)
        .unwrap();
    let url = redis.url().replacen("redis://", "redis://cron:pw@", 1);
    let conn = redis_conn::connect(&redis::Client::open(url).unwrap())
        .await
        .unwrap();
    let s = store::shared_schedule_sets(&conn, "a", Duration::from_secs(600))
        .await
        .unwrap();
    assert!(s.sets.contains(&"cron_jobs:ns".to_string()), "{s:?}");
    assert!(s.damaged.is_some(), "{s:?}");
}

/// Review (issue 43): an ACL refusing `PTTL` (or `TYPE`), which the poller did not need before the
/// shared walk, failed every reader's look, which the poller took for a refused scan: only
/// `cron_jobs` and `cron_jobs:default` were read, so a namespaced schedule ran only in the process
/// that walked. Now the reader walks by itself, as for other refusals. Failed before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_refusing_pttl_hides_no_namespace_from_readers() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    populate(&mut c, "ns", 100);
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "cron", "on", ">pw", "~*", "+@all", "-pttl"])
        .query(&mut c)
        .unwrap();
    let url = redis.url().replacen("redis://", "redis://cron:pw@", 1);
    let conn = redis_conn::connect(&redis::Client::open(url).unwrap())
        .await
        .unwrap();
    let walker = store::shared_schedule_sets(&conn, "a", Duration::from_secs(600))
        .await
        .unwrap();
    assert!(
        walker.sets.contains(&"cron_jobs:ns".to_string()),
        "{walker:?}"
    );
    let reader = store::shared_schedule_sets(&conn, "b", Duration::from_secs(600)).await;
    assert!(
        reader
            .as_ref()
            .is_ok_and(|s| s.sets.contains(&"cron_jobs:ns".to_string())),
        "{reader:?}"
    );
}

/// A process whose poll interval is above the default 600 s walks at its own pace, but stores what it
/// found for at most 600 s: a longer TTL is what the others take for a damaged key (review of issue
/// 43), so a fleet of mixed poll intervals would log an ERROR and walk alone. The others then read
/// the stored walk as any other.
#[tokio::test]
async fn a_walk_stored_by_a_slow_poller_is_no_damage_to_the_others() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    populate(&mut c, "ns", 0);
    let conn = conn(&redis).await;
    let slow = store::shared_schedule_sets(&conn, "slow", Duration::from_secs(900))
        .await
        .unwrap();
    assert!(slow.damaged.is_none(), "{:?}", slow.damaged);
    let ttl: i64 = c.pttl(keys::CRON_NAMESPACES).unwrap();
    assert!(
        (1..=600_000).contains(&ttl),
        "stored for {ttl} ms, more than the default interval"
    );
    let other = store::shared_schedule_sets(&conn, "other", Duration::from_secs(600))
        .await
        .unwrap();
    assert!(other.damaged.is_none(), "{:?}", other.damaged);
    assert!(
        other.sets.iter().any(|s| s == "cron_jobs:ns"),
        "{:?}",
        other.sets
    );
}
