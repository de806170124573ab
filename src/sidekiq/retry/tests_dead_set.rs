//! Every path that adds to the dead set trims it as Ruby's `DeadSet#kill` does (by age,
//! `dead_timeout_in_seconds`, and by size, `dead_max_jobs`): the fate write, the fetch's oversized
//! payload, orphan recovery's too-often-recovered job and the scheduled poller's non-job member all go
//! through the one `to_dead` of `src/connection/lua.rs`. Ruby trims the same seeded set in the same run, and each
//! path must leave exactly what Ruby leaves.
use crate::test_support as support;

use std::time::Duration;

use oxidekiq::config::QueueWeight;
use oxidekiq::fetch::{self, Fetch, RecoveryPolicy, Reliable};
use oxidekiq::time::{TimeFormat, now};
use redis::Commands;

/// Members written by the seed: more than `dead_max_jobs` (10 000), plus one older than 180 days.
const FILLER: usize = 10_005;
const ANCIENT: &str = "ancient";

/// Fills `dead` with an ancient member and `FILLER` recent ones, all older than any new entry.
fn seed(c: &mut redis::Connection) {
    let _: () = c.del("dead").unwrap();
    let t = now();
    let _: () = c.zadd("dead", ANCIENT, t - 200.0 * 86_400.0).unwrap();
    for chunk in (0..FILLER).collect::<Vec<_>>().chunks(1000) {
        let items: Vec<(f64, String)> = chunk
            .iter()
            .map(|i| (t - 1000.0 + *i as f64 * 0.01, format!("filler-{i}")))
            .collect();
        let _: () = c.zadd_multiple("dead", &items).unwrap();
    }
}

/// (members left, whether the ancient one is still there, whether a member containing `marker` is).
fn outcome(c: &mut redis::Connection, marker: &str) -> (usize, bool, bool) {
    let card: usize = c.zcard("dead").unwrap();
    let ancient: Option<f64> = c.zscore("dead", ANCIENT).unwrap();
    let newest: Vec<String> = c.zrange("dead", -1, -1).unwrap();
    let found = newest.iter().any(|m| m.contains(marker));
    (card, ancient.is_some(), found)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dead_set_writer_trims_by_age_and_size_as_ruby_does() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let mut conn = redis.async_conn().await;

    // Ruby's own `DeadSet#kill` on the seeded set: what every path must leave.
    seed(&mut c);
    support::ruby(
        r#"require "sidekiq/api"
Sidekiq::DeadSet.new.kill(%q({"class":"A","args":[],"jid":"ruby-kill"}), notify_failure: false)"#,
        &redis.url(),
    );
    let ruby = outcome(&mut c, "ruby-kill");
    assert!(ruby.2, "ruby's entry is there");

    // The fate write (`retry::send_to_morgue`, the same script as `kill` and `apply`).
    seed(&mut c);
    let member = br#"{"class":"A","args":[],"jid":"fate-kill"}"#;
    oxidekiq::retry::send_to_morgue(&mut conn, member, now())
        .await
        .unwrap();
    assert_eq!(outcome(&mut c, "fate-kill"), ruby, "fate write");

    // The fetch script's oversized payload.
    seed(&mut c);
    let big = format!(
        r#"{{"class":"A","args":["{}"],"jid":"oversized"}}"#,
        "x".repeat(2000)
    );
    let _: () = c.lpush("queue:big", &big).unwrap();
    let client = redis::Client::open(redis.url()).unwrap();
    let blocking = oxidekiq::redis_conn::connect_blocking(&client, Duration::from_millis(200))
        .await
        .unwrap();
    let queues = [QueueWeight {
        name: "big".into(),
        weight: 0,
    }];
    let f = Reliable::new(
        &queues,
        "testhost:1:aaaa",
        conn.clone(),
        blocking,
        Duration::from_millis(200),
    )
    .dialing(oxidekiq::redis_conn::resp::Dialer::of(&client))
    .with_payload_limit(1000, std::sync::Arc::new(oxidekiq::fleet::Fleet::new(None)));
    assert!(f.retrieve_work(10).await.unwrap().is_empty());
    assert_eq!(f.take_dead(), 1);
    assert_eq!(outcome(&mut c, "oversized"), ruby, "fetch script");

    // Orphan recovery's job recovered too often.
    seed(&mut c);
    let poison = r#"{"class":"A","args":[],"jid":"too-often"}"#;
    let _: () = c
        .hset("oxidekiq:working:otherhost:2:bbbb:default", 1, poison)
        .unwrap();
    fetch::recovery::mark_recovered(&mut c, poison, fetch::recovery::MAX_RECOVERIES);
    let policy = RecoveryPolicy {
        grace: Duration::from_millis(1),
        time_format: TimeFormat::Seconds,
    };
    let me = "testhost:1:aaaa";
    let first = fetch::recover_orphans(&mut conn, me, now(), policy)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.suspects, 1);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let r = fetch::recover_orphans(&mut conn, me, now(), policy)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(r.killed, 1);
    assert_eq!(outcome(&mut c, "too-often"), ruby, "orphan recovery");

    // The scheduled poller's member that is not a job.
    seed(&mut c);
    let _: () = c
        .zadd("schedule", "not a job: poller", now() - 1.0)
        .unwrap();
    oxidekiq::scheduled::enqueue_due(&mut conn, "schedule", now(), TimeFormat::Seconds)
        .await
        .unwrap();
    assert_eq!(outcome(&mut c, "poller"), ruby, "scheduled poller");
}
