//! The keys real older releases leave behind, recovered by this one (issue 44): CI's cheap guard of a
//! rolling deploy (the full deploy under faults, with the older binaries running, is
//! `tests/binary/rolling_upgrade.rs`, run by `scripts/rolling_upgrade.sh`).
//!
//! `fixtures/older-releases/<commit>.json` holds what a real binary of that commit left in Redis when it
//! was SIGKILLed mid-batch (`fixtures/older-releases/record.sh` recorded it): e9935e1, the release before
//! the batch lists (a working hash `oxidekiq:working:<identity>:default`, its done jobs already
//! removed), and 3d24d66, the first with batch lists (a list `oxidekiq:working:<identity>:default:@<n>`
//! in its queue's order with an acks set naming the places of the jobs done). This release's binary
//! starts on those keys (the dead process's liveness key long gone), must find them with its keyspace
//! walk and push back every job still held exactly once, and never a job the old process had done.
use crate::support;

use std::collections::HashMap;
use std::time::Duration;

use redis::Commands;
use serde_json::Value;
use support::{Oxidekiq, RedisServer, wait_until};

/// Writes the recorded keys back, each in its recorded order.
fn restore(c: &mut redis::Connection, keys: &serde_json::Map<String, Value>) {
    for (k, v) in keys {
        let strings = |v: &Value| -> Vec<String> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_string())
                .collect()
        };
        match v["type"].as_str().unwrap() {
            "list" => {
                let _: () = c.rpush(k, strings(&v["value"])).unwrap();
            }
            "set" => {
                let _: () = c.sadd(k, strings(&v["value"])).unwrap();
            }
            "hash" => {
                for (f, x) in v["value"].as_object().unwrap() {
                    let _: () = c.hset(k, f, x.as_str().unwrap()).unwrap();
                }
            }
            other => panic!("{k}: unexpected type {other}"),
        }
    }
}

fn jid_of(payload: &str) -> String {
    let v: Value = serde_json::from_str(payload).unwrap();
    v["jid"].as_str().unwrap().to_string()
}

/// Recovers one recording with this release's binary and checks every job's fate.
fn recover(name: &str) {
    let rec = support::fixture_json(&format!("older-releases/{name}.json"));
    let keys = rec["keys"].as_object().unwrap();
    let identity = rec["identity"].as_str().unwrap();
    // What the recording says: the held jobs (in the old process's keys, not marked done) and the
    // jobs that had run to their end.
    let redis = RedisServer::start();
    let mut c = redis.conn();
    restore(&mut c, keys);
    let mut held: Vec<String> = Vec::new();
    let old_keys: Vec<String> = c.keys("oxidekiq:working:*").unwrap();
    assert!(!old_keys.is_empty(), "{name}: no working key recorded");
    for k in &old_keys {
        assert!(
            k.starts_with(&format!("oxidekiq:working:{identity}:")),
            "{name}: {k} is not the recorded process's"
        );
        held.extend(support::held_in(&mut c, k).iter().map(|p| jid_of(p)));
    }
    held.sort();
    let done_before: HashMap<String, u64> = c.hgetall("chaos:done").unwrap();
    let runs_before: HashMap<String, u64> = c.hgetall("chaos:runs").unwrap();
    assert_eq!(held.len(), 3, "{name}: three sleeping jobs held: {held:?}");
    assert_eq!(
        done_before.len(),
        2,
        "{name}: two jobs done: {done_before:?}"
    );

    let mut p = Oxidekiq::start(
        &redis.url(),
        &[
            "-c",
            "5",
            "-q",
            "default",
            "-t",
            "1",
            "--beat-interval",
            "1",
        ],
    );
    // Recovered (the working keys gone) and each held job started again by this release.
    let recovered = wait_until(Duration::from_secs(60), || {
        let left: Vec<String> = c.keys("oxidekiq:working:*").unwrap();
        let runs: HashMap<String, u64> = c.hgetall("chaos:runs").unwrap();
        left.is_empty()
            && held
                .iter()
                .all(|j| runs.get(j) > runs_before.get(j).or(Some(&0)))
    });
    assert!(recovered, "{name}: not recovered:\n{}", p.log());
    // The stop pushes the running (10-minute) jobs back.
    p.signal("TERM");
    assert!(
        p.wait_exit(Duration::from_secs(20)).is_some(),
        "{name}: no exit"
    );
    let runs: HashMap<String, u64> = c.hgetall("chaos:runs").unwrap();
    let done: HashMap<String, u64> = c.hgetall("chaos:done").unwrap();
    let mut queued: Vec<String> = c
        .lrange::<_, Vec<String>>("queue:default", 0, -1)
        .unwrap()
        .iter()
        .map(|p| jid_of(p))
        .collect();
    queued.sort();
    assert_eq!(
        queued, held,
        "{name}: every held job back in its queue once"
    );
    for j in &held {
        assert_eq!(runs.get(j), Some(&2), "{name}: {j} ran once more, no more");
    }
    // The jobs the old process had done run no more.
    assert_eq!(done, done_before, "{name}: a done job ran again");
    for j in done_before.keys() {
        assert_eq!(runs.get(j), runs_before.get(j), "{name}: {j} ran again");
    }
    for pattern in [
        "oxidekiq:working:*",
        "oxidekiq:batch:*",
        "oxidekiq:landing:*",
        "oxidekiq:acks:*",
    ] {
        let left: Vec<String> = c.keys(pattern).unwrap();
        assert!(left.is_empty(), "{name}: keys left: {left:?}");
    }
    let stray: Vec<String> = c.keys("queue:*:@*").unwrap();
    assert!(stray.is_empty(), "{name}: stranded queues: {stray:?}");
}

/// The release before the batch lists: a working hash.
#[test]
fn a_killed_process_of_the_release_before_the_batch_lists_is_recovered_once() {
    recover("e9935e1");
}

/// The first release with batch lists: a batch list under `oxidekiq:working:` with its acks set.
#[test]
fn a_killed_process_of_the_first_release_with_batch_lists_is_recovered_once() {
    recover("3d24d66");
}
