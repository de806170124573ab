//! The contract every fetch strategy keeps, run over every entry of `STRATEGIES` (as River runs one
//! suite over every driver, and Oban one over every engine): a strategy added to the table is tested
//! here without a line of its own.
//!
//! - `retrieve_work(max)` hands out at most `max` jobs, each with its exact bytes, in Sidekiq's order (a
//!   strict queue list serves its first queue first, and a queue its oldest job first), and returns
//!   empty-handed within its block time when every queue is empty.
//! - Between its fetch and its acknowledgement or push-back a job is in one place only: handed out (and,
//!   for a strategy that holds jobs in Redis, under its `working_prefix`), never also in its queue.
//! - `acknowledge` forgets a job everywhere; `bulk_requeue` puts its bytes back at the end of its queue
//!   that is served next and says how many moved; `outstanding` counts what is handed out and not yet
//!   given back, for a strategy that holds jobs in Redis.
//! - Once every job is acknowledged or pushed back, `requeue_leftovers(true)` finds nothing, and the
//!   strategy leaves no key of its own behind.
use crate::test_support as support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::Commands;

use super::tests_scripts::{conns, dialer, fill, jid_of, job, queues};
use super::{Fetch, STRATEGIES, Setup, UnitOfWork};

const ME: &str = "contract:1:cccc";

/// Every strategy of the table, each built on `redis` over `names` (strict order), blocking 200 ms.
async fn every_strategy(
    redis: &support::RedisServer,
    names: &[&str],
) -> Vec<(&'static str, Arc<dyn Fetch>)> {
    every_strategy_of(redis, names, 0).await
}

/// [`every_strategy`] for capsule `capsule` of the process.
async fn every_strategy_of(
    redis: &support::RedisServer,
    names: &[&str],
    capsule: u64,
) -> Vec<(&'static str, Arc<dyn Fetch>)> {
    let mut out = Vec::new();
    for (name, build) in STRATEGIES {
        let (conn, blocking) = conns(redis).await;
        let qs = queues(names);
        let fetch = build(Setup {
            queues: &qs,
            identity: ME,
            conn,
            blocking,
            block: Duration::from_millis(200),
            max_payload_bytes: 0,
            fleet: Arc::new(crate::fleet::Fleet::new(None)),
            capsule,
            dialer: dialer(&redis.url()),
        });
        out.push((*name, fetch));
    }
    assert!(
        out.len() >= 2,
        "the table lists reliable and basic at least"
    );
    out
}

fn jids(units: &[UnitOfWork]) -> Vec<String> {
    units.iter().map(|u| jid_of(u.raw())).collect()
}

/// Every key of Redis but the queues and `queues`: what a strategy wrote of its own.
fn own_keys(c: &mut redis::Connection) -> Vec<String> {
    let mut keys: Vec<String> = c.keys("*").unwrap();
    keys.retain(|k| !k.starts_with("queue:") && k != "queues");
    keys.sort();
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_strategy_hands_out_at_most_max_in_sidekiqs_order_with_exact_bytes() {
    for (name, _) in STRATEGIES {
        let redis = support::RedisServer::start();
        let mut c = redis.conn();
        fill(&mut c, "a", 3);
        fill(&mut c, "b", 3);
        let all = every_strategy(&redis, &["a", "b"]).await;
        let (_, f) = all.into_iter().find(|(n, _)| n == name).unwrap();
        let first = f.retrieve_work(2).await.unwrap();
        assert_eq!(
            jids(&first),
            ["a0", "a1"],
            "{name}: at most max, oldest of the first queue first"
        );
        for u in &first {
            assert_eq!(
                u.raw(),
                job(&jid_of(u.raw()), "a").as_bytes(),
                "{name}: exact bytes"
            );
            assert_eq!(&*u.queue, "a", "{name}");
        }
        let rest = f.retrieve_work(10).await.unwrap();
        let mut seen = jids(&first);
        seen.extend(jids(&rest));
        let mut more = f.retrieve_work(10).await.unwrap();
        while !more.is_empty() {
            seen.extend(jids(&more));
            more = f.retrieve_work(10).await.unwrap();
        }
        seen.sort();
        assert_eq!(
            seen,
            ["a0", "a1", "a2", "b0", "b1", "b2"],
            "{name}: each job once"
        );
        assert_eq!(c.llen::<_, usize>("queue:a").unwrap(), 0, "{name}");
        assert_eq!(c.llen::<_, usize>("queue:b").unwrap(), 0, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_strategy_returns_empty_handed_within_its_block_time_when_queues_are_empty() {
    let redis = support::RedisServer::start();
    for (name, f) in every_strategy(&redis, &["a"]).await {
        let began = Instant::now();
        let got = tokio::time::timeout(Duration::from_secs(30), f.retrieve_work(5))
            .await
            .unwrap_or_else(|_| panic!("{name}: a fetch of empty queues never returned"))
            .unwrap();
        assert!(got.is_empty(), "{name}: nothing to hand out");
        assert!(
            began.elapsed() >= Duration::from_millis(100),
            "{name}: an empty fetch waits (blocks) rather than spinning"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_strategy_keeps_a_job_in_one_place_until_its_ack_or_push_back() {
    for (name, _) in STRATEGIES {
        let redis = support::RedisServer::start();
        let mut c = redis.conn();
        fill(&mut c, "a", 4);
        let all = every_strategy(&redis, &["a"]).await;
        let (_, f) = all.into_iter().find(|(n, _)| n == name).unwrap();
        let units = f.retrieve_work(4).await.unwrap();
        assert_eq!(units.len(), 4, "{name}");
        assert_eq!(
            c.llen::<_, usize>("queue:a").unwrap(),
            0,
            "{name}: not also in the queue"
        );
        if f.holds_in_redis() {
            let prefix = f
                .working_prefix()
                .expect("a strategy holding jobs in Redis names its prefix");
            let held: Vec<String> = c.keys(format!("{prefix}*")).unwrap();
            assert!(!held.is_empty(), "{name}: held under {prefix}");
            assert_eq!(f.outstanding(), 4, "{name}: four handed out");
        }
        // Two done, two pushed back.
        f.acknowledge(&units[..2]).await.unwrap();
        let moved = f.bulk_requeue(&units[2..]).await.unwrap();
        assert_eq!(moved, 2, "{name}: both pushed back");
        if f.holds_in_redis() {
            assert_eq!(f.outstanding(), 0, "{name}: nothing outstanding");
        }
        // Pushed back to the end that is served next: the oldest of them first.
        let back: Vec<String> = c
            .lrange::<_, Vec<Vec<u8>>>("queue:a", 0, -1)
            .unwrap()
            .iter()
            .rev()
            .map(|r| jid_of(r))
            .collect();
        let mut want = jids(&units[2..]);
        want.sort();
        let mut got = back.clone();
        got.sort();
        assert_eq!(
            got, want,
            "{name}: the pushed-back jobs, and only those, are in the queue"
        );
        let stored: Vec<Vec<u8>> = c.lrange("queue:a", 0, -1).unwrap();
        for u in &units[2..] {
            assert!(stored.iter().any(|s| s == u.raw()), "{name}: byte for byte");
        }
        assert_eq!(
            f.requeue_leftovers(true).await.unwrap(),
            0,
            "{name}: nothing left over once every job is given back"
        );
        assert!(
            own_keys(&mut c).is_empty(),
            "{name}: left {:?}",
            own_keys(&mut c)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_contract_suite_runs_every_registered_strategy() {
    // A strategy added to STRATEGIES is built by every_strategy, so each test above runs it.
    let redis = support::RedisServer::start();
    let built: Vec<&str> = every_strategy(&redis, &["a"])
        .await
        .iter()
        .map(|(n, _)| *n)
        .collect();
    let names: Vec<&str> = super::strategy_names().collect();
    assert_eq!(built, names);
    for n in &names {
        assert!(
            crate::config::FetchMode::named(n).is_some(),
            "--fetch {n} is accepted"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capsules_sweep_never_takes_the_jobs_another_capsule_of_the_process_runs() {
    // Two capsules of one process on one queue (sidekiq#6379): the second's sweeps, at quiet and at
    // stop, push back what it holds and never what the first handed out.
    for (name, _) in STRATEGIES {
        let redis = support::RedisServer::start();
        let mut c = redis.conn();
        fill(&mut c, "a", 4);
        let first = every_strategy_of(&redis, &["a"], 0).await;
        let second = every_strategy_of(&redis, &["a"], 1).await;
        let (_, f0) = first.into_iter().find(|(n, _)| n == name).unwrap();
        let (_, f1) = second.into_iter().find(|(n, _)| n == name).unwrap();
        let running = f0.retrieve_work(2).await.unwrap();
        assert_eq!(running.len(), 2, "{name}");
        let theirs = f1.retrieve_work(2).await.unwrap();
        assert_eq!(theirs.len(), 2, "{name}");
        f1.acknowledge(&theirs).await.unwrap();
        assert_eq!(
            f1.requeue_leftovers(false).await.unwrap(),
            0,
            "{name}: quiet sweep"
        );
        assert_eq!(
            f1.requeue_leftovers(true).await.unwrap(),
            0,
            "{name}: stop sweep"
        );
        assert_eq!(
            c.llen::<_, usize>("queue:a").unwrap(),
            0,
            "{name}: the other capsule's running jobs were pushed back"
        );
        f0.acknowledge(&running).await.unwrap();
        assert!(
            own_keys(&mut c).is_empty(),
            "{name}: left {:?}",
            own_keys(&mut c)
        );
    }
}

/// A capsule's batch numbers stay in its range (found by the review of issue 38): capsule k numbers
/// from k << CAPSULE_SHIFT, and a counter that ran past (k + 1) << CAPSULE_SHIFT named lists that
/// capsule k + 1's sweeps (quiet, the stop, the reconcile after an outage) took for its own strays,
/// pushing back jobs capsule k was running, which then ran twice (sidekiq#6379 again). A script fetch
/// uses two numbers per queue of its round: with 2^36 numbers a capsule of 20 queues reached the end in
/// days to weeks. Now the range is 2^46 and a capsule that reaches its end starts it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capsule_past_the_end_of_its_numbers_keeps_its_running_jobs_from_the_next_capsules_sweep()
{
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    fill(&mut c, "a", 4);
    let build = |capsule: u64| {
        let redis = &redis;
        async move {
            let (conn, blocking) = conns(redis).await;
            let qs = queues(&["a"]);
            super::Reliable::from_setup(Setup {
                queues: &qs,
                identity: ME,
                conn,
                blocking,
                block: Duration::from_millis(200),
                max_payload_bytes: 0,
                fleet: Arc::new(crate::fleet::Fleet::new(None)),
                capsule,
                dialer: dialer(&redis.url()),
            })
        }
    };
    // Capsule 0 at the end of its range: its next list would be numbered in capsule 1's.
    let first = build(0).await.numbered_after(1 << super::CAPSULE_SHIFT);
    let second = build(1).await;
    let running = first.retrieve_work(2).await.unwrap();
    assert_eq!(running.len(), 2);
    // Capsule 1 goes quiet (every capsule does at once): its sweep must leave capsule 0's jobs alone.
    let swept = second.requeue_leftovers(false).await.unwrap();
    assert_eq!(
        (swept, c.llen::<_, usize>("queue:a").unwrap()),
        (0, 2),
        "capsule 1's quiet sweep pushed back the jobs capsule 0 runs: they would run twice"
    );
    first.acknowledge(&running).await.unwrap();
}
