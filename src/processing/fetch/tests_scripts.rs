//! The Redis scripts of reliable fetch, recovery, push-back and the scheduled poller, at their edges,
//! against a real `redis-server` (issue 11 items 1, 4, 5 and 7; issue 17's wrong-type key, argument
//! size and oversized payloads).
//!
//! Every test accounts for every job it put in: a job is returned by a fetch, or still in a queue, a
//! batch list (or, for a process of an older version, a landing list or a working hash), the dead set or
//! the schedule, and never in two of them unless the test says why.
use crate::test_support as support;

use std::collections::HashSet;
use std::time::Duration;

use oxidekiq::config::QueueWeight;
use oxidekiq::fetch::{self, Basic, Fetch, RecoveryPolicy, Reliable};
use oxidekiq::redis_conn::resp::Dialer;
use oxidekiq::redis_conn::{self, Conn};
use oxidekiq::time::TimeFormat;
use redis::Commands;
use serde_json::Value;

/// An identity in the `host:pid:hex` shape recovery parses.
pub(super) const ME: &str = "testhost:1:aaaa";

/// A fetcher of queue `a` connected as a user whose ACL refuses `command` and allows everything else.
pub(super) async fn limited_fetcher(
    redis: &support::RedisServer,
    c: &mut redis::Connection,
    command: &str,
) -> Reliable {
    limited_fetcher_via(redis, c, command, None).await
}

/// [`limited_fetcher`], its own connections (the fetch pipelines') through `trap` when given.
pub(super) async fn limited_fetcher_via(
    redis: &support::RedisServer,
    c: &mut redis::Connection,
    command: &str,
    trap: Option<&ReplyTrap>,
) -> Reliable {
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("limited")
        .arg("on")
        .arg(">pw")
        .arg("~*")
        .arg("&*")
        .arg("+@all")
        .arg(format!("-{command}"))
        .query(c)
        .unwrap();
    let url = redis.url().replacen("redis://", "redis://limited:pw@", 1);
    let client = redis::Client::open(url).unwrap();
    let conn = redis_conn::connect(&client).await.unwrap();
    let blocking = redis_conn::connect_blocking(&client, Duration::from_millis(200))
        .await
        .unwrap();
    let own = match trap {
        Some(trap) => dialer(&trap.url("limited:pw@")),
        None => Dialer::of(&client),
    };
    Reliable::new(
        &queues(&["a"]),
        ME,
        conn,
        blocking,
        Duration::from_millis(200),
    )
    .dialing(own)
}

/// The dialer of the fetcher's own connections to the server at `url`, as the launcher gives it for a
/// plain-text server: the fetch pipelines of a fetcher given it go over them (its other commands over
/// the shared connection).
pub(super) fn dialer(url: &str) -> Option<Dialer> {
    Dialer::of(&redis::Client::open(url).unwrap())
}

/// A proxy in front of a Redis that passes every command on and, while `swallow` is set, drops every
/// reply: a fetch sent through it then runs in Redis and its reply never comes (a connection cut after
/// Redis answered, a fetch cancelled while its reply was on the way).
pub(super) struct ReplyTrap {
    port: u16,
    swallow: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Every reply byte passed on, in order, over every connection.
    pub(super) passed: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
}

impl ReplyTrap {
    pub(super) async fn start(redis: &support::RedisServer) -> ReplyTrap {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = redis.url().trim_start_matches("redis://").to_string();
        let swallow = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let dropping = swallow.clone();
        let passed = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = passed.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(&target).await.unwrap();
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                tokio::spawn(async move { tokio::io::copy(&mut cr, &mut sw).await });
                let dropping = dropping.clone();
                let record = record.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        if dropping.load(std::sync::atomic::Ordering::SeqCst) {
                            continue;
                        }
                        record.lock().unwrap().extend_from_slice(&buf[..n]);
                        if cw.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        ReplyTrap {
            port,
            swallow,
            passed,
        }
    }

    /// The server's URL through the trap, `auth` (`user:password@`, or empty) before its host.
    pub(super) fn url(&self, auth: &str) -> String {
        format!("redis://{auth}127.0.0.1:{}", self.port)
    }

    /// Drops Redis's replies from now on (`true`), or passes them on again.
    pub(super) fn swallow(&self, on: bool) {
        self.swallow.store(on, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A fetch of queue `a` whose reply never comes: `f`'s own connections go through `trap`, which drops
/// Redis's replies while the fetch runs; once Redis ran it (queue `a` empty) the fetch is dropped
/// unanswered, so its jobs sit in a batch list recorded as lost.
pub(super) async fn lose_a_fetch(c: &mut redis::Connection, f: &Reliable, trap: &ReplyTrap) {
    trap.swallow(true);
    let fetch = f.retrieve_work(10);
    let ran = async {
        for _ in 0..1000 {
            if c.llen::<_, usize>("queue:a").unwrap() == 0 {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    };
    tokio::select! {
        got = fetch => panic!("the fetch was answered: {got:?}"),
        ran = ran => assert!(ran, "the fetch ran"),
    }
    trap.swallow(false);
}

/// [`fetcher`], its own connections (the fetch pipelines') through `trap`.
pub(super) async fn fetcher_via(
    redis: &support::RedisServer,
    names: &[&str],
    identity: &str,
    trap: &ReplyTrap,
) -> Reliable {
    let (conn, blocking) = conns(redis).await;
    Reliable::new(
        &queues(names),
        identity,
        conn,
        blocking,
        Duration::from_millis(200),
    )
    .dialing(dialer(&trap.url("")))
}

pub(super) fn queues(names: &[&str]) -> Vec<QueueWeight> {
    names
        .iter()
        .map(|n| QueueWeight {
            name: (*n).into(),
            weight: 0,
        })
        .collect()
}

pub(super) async fn conns(redis: &support::RedisServer) -> (Conn, Conn) {
    let client = redis::Client::open(redis.url()).unwrap();
    let conn = redis_conn::connect(&client).await.unwrap();
    let blocking = redis_conn::connect_blocking(&client, Duration::from_millis(200))
        .await
        .unwrap();
    (conn, blocking)
}

pub(super) async fn fetcher(
    redis: &support::RedisServer,
    names: &[&str],
    identity: &str,
) -> Reliable {
    let (conn, blocking) = conns(redis).await;
    Reliable::new(
        &queues(names),
        identity,
        conn,
        blocking,
        Duration::from_millis(200),
    )
    .dialing(dialer(&redis.url()))
}

/// Pushes `n` jobs to `queue:<q>`, with jids `<q>0`, `<q>1`, ... (`<q>0` served first).
pub(super) fn fill(c: &mut redis::Connection, q: &str, n: usize) {
    for i in 0..n {
        let _: () = c
            .lpush(format!("queue:{q}"), job(&format!("{q}{i}"), q))
            .unwrap();
    }
}

/// A basic fetcher over `names`, blocking 200 ms at most.
async fn basic(redis: &support::RedisServer, names: &[&str]) -> Basic {
    let (conn, blocking) = conns(redis).await;
    Basic::new(&queues(names), conn, blocking, Duration::from_millis(200))
}

pub(super) fn job(jid: &str, queue: &str) -> String {
    format!(r#"{{"class":"A","args":[1],"jid":"{jid}","queue":"{queue}","retry":true}}"#)
}

pub(super) fn jid_of(raw: &[u8]) -> String {
    let v: Value = serde_json::from_slice(raw).unwrap();
    v["jid"].as_str().unwrap().to_string()
}

pub(super) fn landing(identity: &str, q: &str) -> String {
    format!("oxidekiq:landing:{identity}:{q}")
}

fn working(identity: &str, q: &str) -> String {
    format!("oxidekiq:working:{identity}:{q}")
}

pub(super) fn list_jids(c: &mut redis::Connection, key: &str) -> Vec<String> {
    let items: Vec<Vec<u8>> = c.lrange(key, 0, -1).unwrap();
    items.iter().map(|r| jid_of(r)).collect()
}

/// The jids in `identity`'s batch lists not marked done in their acks sets (what a recovery or a
/// shutdown sweep would push back).
pub(super) fn held_jids(c: &mut redis::Connection, identity: &str) -> Vec<String> {
    let mut out = Vec::new();
    let lists: Vec<String> = c.keys(format!("oxidekiq:batch:{identity}:*")).unwrap();
    for k in lists {
        let items: Vec<Vec<u8>> = c.lrange(&k, 0, -1).unwrap();
        let done: HashSet<String> = c.smembers(oxidekiq::keys::acks_of(&k)).unwrap();
        for (i, raw) in items.iter().enumerate() {
            if !done.contains(&i.to_string()) {
                out.push(jid_of(raw));
            }
        }
    }
    out.sort();
    out
}

/// The bytes stored for a unit fetched by `ME`: its batch list at its place.
pub(super) fn stored(c: &mut redis::Connection, u: &oxidekiq::fetch::UnitOfWork) -> Vec<u8> {
    let t = oxidekiq::retry::Token::of(&oxidekiq::keys::batch_prefix(ME), &u.queue, u.id);
    c.lindex(&t.working, t.id as isize).unwrap()
}

fn hash_jids(c: &mut redis::Connection, key: &str) -> Vec<String> {
    let items: Vec<Vec<u8>> = c.hvals(key).unwrap();
    items.iter().map(|r| jid_of(r)).collect()
}

/// A full queue that is not first, when the first queue already filled part of the batch: exactly `max`
/// are taken by the batch script, each under its own id and stored byte for byte at its place, and the
/// rest stay in their queue.
#[tokio::test]
async fn a_full_later_queue_fills_only_the_rest_of_the_batch() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    fill(&mut c, "a", 3);
    fill(&mut c, "b", 5);
    let f = fetcher(&redis, &["a", "b"], ME).await.script_only();
    let got = f.retrieve_work(4).await.unwrap();
    assert_eq!(got.len(), 4, "a batch of 4");
    let ids: HashSet<u64> = got.iter().map(|u| u.id).collect();
    assert_eq!(ids.len(), 4, "every job has its own id");
    for u in &got {
        assert_eq!(stored(&mut c, u), u.raw());
    }
    let fetched: Vec<String> = got.iter().map(|u| jid_of(u.raw())).collect();
    assert_eq!(
        &fetched[..3],
        ["a0", "a1", "a2"],
        "queue a first, oldest first"
    );
    assert_eq!(fetched[3], "b0", "then the oldest of b");
    let left = list_jids(&mut c, "queue:b");
    assert_eq!(
        left,
        ["b4", "b3", "b2", "b1"],
        "the rest stays in its queue"
    );
    assert_eq!(held_jids(&mut c, ME), ["a0", "a1", "a2", "b0"]);
    // The next fetch takes the rest: all eight accounted for, none twice.
    let more = f.retrieve_work(10).await.unwrap();
    let mut all: Vec<String> = fetched;
    all.extend(more.iter().map(|u| jid_of(u.raw())));
    all.sort();
    assert_eq!(all, ["a0", "a1", "a2", "b0", "b1", "b2", "b3", "b4"]);
    // Acknowledged in parts: the first part is marked done, the last one deletes the lists.
    f.acknowledge(&got[..2]).await.unwrap();
    assert_eq!(held_jids(&mut c, ME), ["a2", "b0", "b1", "b2", "b3", "b4"]);
    f.acknowledge(&got[2..]).await.unwrap();
    f.acknowledge(&more).await.unwrap();
    assert_eq!(f.outstanding(), 0);
    let keys: Vec<String> = c.keys("oxidekiq:*").unwrap();
    assert!(keys.is_empty(), "{keys:?}");
}

/// `max` smaller than the queue: only `max` leave it, from its served end.
#[tokio::test]
async fn max_smaller_than_the_queue_takes_max_from_its_served_end() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    for i in 0..10 {
        let _: () = c
            .lpush("queue:default", job(&format!("j{i}"), "default"))
            .unwrap();
    }
    let f = fetcher(&redis, &["default"], ME).await;
    let got = f.retrieve_work(3).await.unwrap();
    let jids: Vec<String> = got.iter().map(|u| jid_of(u.raw())).collect();
    assert_eq!(jids, ["j0", "j1", "j2"]);
    assert_eq!(list_jids(&mut c, "queue:default").len(), 7);
    assert_eq!(held_jids(&mut c, ME), ["j0", "j1", "j2"]);
}

/// `-c` must not grow a fetch's arguments: a huge `max` is one bounded batch, and the script receives
/// a constant number of arguments (checked with Redis's own `SLOWLOG`, which records every command's
/// arguments when the threshold is 0).
#[tokio::test]
async fn a_huge_max_sends_a_constant_number_of_arguments_and_takes_a_bounded_batch() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let payloads: Vec<String> = (0..1500)
        .map(|i| job(&format!("j{i}"), "default"))
        .collect();
    let _: () = c.lpush("queue:default", payloads).unwrap();
    let f = fetcher(&redis, &["default"], ME).await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(0)
        .query(&mut c)
        .unwrap();
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query(&mut c).unwrap();
    let got = f.retrieve_work(100_000_000).await.unwrap();
    assert!(
        !got.is_empty() && got.len() <= fetch::MAX_BATCH,
        "{}",
        got.len()
    );
    let log: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(100)
        .query(&mut c)
        .unwrap();
    let mut evals = 0;
    for entry in log {
        let redis::Value::Array(fields) = entry else {
            continue;
        };
        let Some(redis::Value::Array(args)) = fields.get(3) else {
            continue;
        };
        let name = match args.first() {
            Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).to_uppercase(),
            _ => continue,
        };
        if name.starts_with("EVAL") {
            evals += 1;
            // EVALSHA sha numkeys + 12 arguments + one per queue; SLOWLOG caps at 32 anyway.
            assert!(args.len() <= 20, "{} arguments", args.len());
        }
    }
    assert!(evals >= 1, "the fetch script ran");
    let queued: usize = c.llen("queue:default").unwrap();
    assert_eq!(queued + got.len(), 1500, "nothing lost");
}

/// A `queue:<q>` key of the wrong type: the fetch serves the other queues (the old script failed as a
/// whole, stalling every queue, reported as "redis unavailable") and the bad key is untouched.
#[tokio::test]
async fn a_wrong_type_queue_key_stalls_only_its_queue() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let _: () = c.set("queue:a", "not a list").unwrap();
    let _: () = c.lpush("queue:b", job("b0", "b")).unwrap();
    let _: () = c.lpush("queue:b", job("b1", "b")).unwrap();
    let f = fetcher(&redis, &["a", "b"], ME).await;
    let got = f
        .retrieve_work(10)
        .await
        .expect("one bad key must not fail the fetch");
    let mut jids: Vec<String> = got.iter().map(|u| jid_of(u.raw())).collect();
    jids.sort();
    assert_eq!(jids, ["b0", "b1"]);
    let v: String = c.get("queue:a").unwrap();
    assert_eq!(v, "not a list");
    // While queue a is paused, b keeps flowing.
    let _: () = c.lpush("queue:b", job("b2", "b")).unwrap();
    let got = f.retrieve_work(10).await.unwrap();
    assert_eq!(
        got.iter().map(|u| jid_of(u.raw())).collect::<Vec<_>>(),
        ["b2"]
    );
    // Fixed, it is served again after its backoff.
    let _: () = c.del("queue:a").unwrap();
    let _: () = c.lpush("queue:a", job("a0", "a")).unwrap();
    let mut seen = Vec::new();
    for _ in 0..100 {
        seen.extend(
            f.retrieve_work(10)
                .await
                .unwrap()
                .iter()
                .map(|u| jid_of(u.raw())),
        );
        if !seen.is_empty() {
            break;
        }
    }
    assert_eq!(seen, ["a0"]);
}

/// The same with basic fetch: `BRPOP` over every queue fails as a whole on one bad key; the fetcher
/// pauses that queue and serves the others.
#[tokio::test]
async fn basic_fetch_serves_the_other_queues_past_a_wrong_type_key() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let _: () = c.set("queue:a", "not a list").unwrap();
    let _: () = c.lpush("queue:b", job("b0", "b")).unwrap();
    let f = basic(&redis, &["a", "b"]).await;
    let mut got = Vec::new();
    for _ in 0..10 {
        got.extend(f.retrieve_work(1).await.expect("not a fetch failure"));
        if !got.is_empty() {
            break;
        }
    }
    assert_eq!(
        got.iter().map(|u| jid_of(u.raw())).collect::<Vec<_>>(),
        ["b0"]
    );
}

/// A write inside the fetch script that fails (here an oversized job's move to a dead set that is not a
/// sorted set): the jobs before it are fetched, it and the rest stay in their queue, and the error names
/// the key.
#[tokio::test]
async fn a_write_failing_inside_the_fetch_script_leaves_the_jobs_in_their_queue() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let big = format!(
        r#"{{"class":"A","args":["{}"],"jid":"big","queue":"a"}}"#,
        "x".repeat(5000)
    );
    let _: () = c.lpush("queue:a", job("a0", "a")).unwrap();
    let _: () = c.lpush("queue:a", &big).unwrap();
    let _: () = c.lpush("queue:a", job("a1", "a")).unwrap();
    let _: () = c.set("dead", "in the way").unwrap();
    let f = fetcher(&redis, &["a"], ME).await.with_payload_limit(
        1000,
        std::sync::Arc::new(oxidekiq::fleet::Fleet::new(Some(TimeFormat::Seconds))),
    );
    let got = f
        .retrieve_work(10)
        .await
        .expect("a per-queue error, not a fetch failure");
    assert_eq!(
        got.iter().map(|u| jid_of(u.raw())).collect::<Vec<_>>(),
        ["a0"]
    );
    assert_eq!(list_jids(&mut c, "queue:a"), ["a1", "big"]);
    assert_eq!(held_jids(&mut c, ME), ["a0"]);
    assert_eq!(f.take_dead(), 0);
}

/// Shutdown push-back into a queue key of the wrong type: the old `MULTI` ran the `HDEL` after the failed
/// `RPUSH` and the job was gone. Now it stays in its batch list, and the error names the key.
#[tokio::test]
async fn a_push_back_into_a_wrong_type_queue_keeps_the_job_in_the_working_hash() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let _: () = c.lpush("queue:a", job("a0", "a")).unwrap();
    let _: () = c.lpush("queue:a", job("a1", "a")).unwrap();
    let f = fetcher(&redis, &["a"], ME).await;
    let got = f.retrieve_work(10).await.unwrap();
    assert_eq!(got.len(), 2);
    let _: () = c.set("queue:a", "not a list").unwrap();
    let held = got;
    let err = f
        .bulk_requeue(&held)
        .await
        .expect_err("the push-back cannot succeed");
    assert!(err.to_string().contains("queue:a is a string"), "{err}");
    assert_eq!(held_jids(&mut c, ME), ["a0", "a1"]);
    // Fixed, it goes through, in the order the queue served them.
    let _: () = c.del("queue:a").unwrap();
    assert_eq!(f.bulk_requeue(&held).await.unwrap(), 2);
    assert_eq!(list_jids(&mut c, "queue:a"), ["a1", "a0"]);
    let keys: Vec<String> = c.keys("oxidekiq:*").unwrap();
    assert!(keys.is_empty(), "nothing left held: {keys:?}");
}

/// Due scheduled jobs whose queue key has the wrong type stay in the schedule (the old script `ZREM`ed
/// first, then failed on the `LPUSH`); the other due jobs move.
#[tokio::test]
async fn the_scheduled_poller_keeps_a_job_whose_queue_cannot_take_it() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let _: () = c.set("queue:broken", "not a list").unwrap();
    let _: () = c.zadd("schedule", job("s-broken", "broken"), 1.0).unwrap();
    let _: () = c.zadd("schedule", job("s-ok", "fine"), 2.0).unwrap();
    let mut conn = redis.async_conn().await;
    let moved = oxidekiq::scheduled::enqueue_due(
        &mut conn,
        "schedule",
        oxidekiq::time::now(),
        TimeFormat::Seconds,
    )
    .await
    .expect("one bad queue must not fail the round");
    assert_eq!(moved, 1);
    assert_eq!(list_jids(&mut c, "queue:fine"), ["s-ok"]);
    let left: Vec<String> = c.zrange("schedule", 0, -1).unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(jid_of(left[0].as_bytes()), "s-broken");
}

/// `reconcile` pushes back only what was never handed out (a fetch whose reply was lost), never a job
/// handed out and not yet acknowledged (about to run, running, or its ack on the way). The lost reply:
/// a proxy drops Redis's replies, and the fetch is dropped unanswered once Redis ran it.
#[tokio::test]
async fn reconcile_pushes_back_only_entries_never_handed_out() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    for i in 0..3 {
        let _: () = c.lpush("queue:a", job(&format!("a{i}"), "a")).unwrap();
    }
    let trap = ReplyTrap::start(&redis).await;
    let f = fetcher_via(&redis, &["a"], ME, &trap).await;
    let got = f.retrieve_work(2).await.unwrap();
    assert_eq!(got.len(), 2);
    lose_a_fetch(&mut c, &f, &trap).await;
    assert_eq!(held_jids(&mut c, ME), ["a0", "a1", "a2"]);
    assert_eq!(f.reconcile().await.unwrap(), 1);
    assert_eq!(list_jids(&mut c, "queue:a"), ["a2"]);
    assert_eq!(held_jids(&mut c, ME), ["a0", "a1"]);
    // Acknowledged jobs leave their list and the outstanding count.
    f.acknowledge(&got).await.unwrap();
    assert_eq!(f.outstanding(), 0);
    let keys: Vec<String> = c.keys("oxidekiq:*").unwrap();
    assert!(keys.is_empty(), "{keys:?}");
}

/// Payloads over the limit never reach oxidekiq: the fetch script moves them to the dead set with the
/// original bytes and the error appended; two identical payloads stay two members.
#[tokio::test]
async fn oversized_payloads_go_to_the_dead_set_inside_redis_each_as_its_own_member() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let big = format!(
        r#"{{"class":"A","args":["{}"],"jid":"big","queue":"a"}}"#,
        "x".repeat(5000)
    );
    let _: () = c.lpush("queue:a", &big).unwrap();
    let _: () = c.lpush("queue:a", &big).unwrap();
    let _: () = c.lpush("queue:a", job("small", "a")).unwrap();
    let f = fetcher(&redis, &["a"], ME).await.with_payload_limit(
        1000,
        std::sync::Arc::new(oxidekiq::fleet::Fleet::new(Some(TimeFormat::Seconds))),
    );
    let got = f.retrieve_work(10).await.unwrap();
    assert_eq!(
        got.iter().map(|u| jid_of(u.raw())).collect::<Vec<_>>(),
        ["small"]
    );
    assert_eq!(f.take_dead(), 2);
    let dead: Vec<String> = c.zrange("dead", 0, -1).unwrap();
    assert_eq!(dead.len(), 2, "identical payloads stay distinct members");
    for m in &dead {
        assert!(
            m.starts_with(&big[..big.len() - 1]),
            "original bytes kept: {}",
            &m[..80]
        );
        let v: Value = serde_json::from_str(m).unwrap();
        assert_eq!(v["error_class"], "Oxidekiq::InvalidPayload");
        let msg = v["error_message"].as_str().unwrap();
        assert!(
            msg.contains("5") && msg.contains("1000-byte limit"),
            "{msg}"
        );
        assert!(v["failed_at"].is_f64(), "{v:?}");
    }
    assert_eq!(c.llen::<_, usize>("queue:a").unwrap(), 0);
}

fn policy(grace_ms: u64) -> RecoveryPolicy {
    RecoveryPolicy {
        grace: Duration::from_millis(grace_ms),
        time_format: TimeFormat::Seconds,
    }
}

/// A process whose liveness key is gone is not robbed at once: the script (which reads the key itself,
/// at the moment it runs) only marks it; if the process re-sets its key (its next beat after a Redis
/// stall) it keeps its jobs; only a process still without a key a grace later loses them.
#[tokio::test]
async fn recovery_spares_a_process_that_reclaims_its_liveness_key() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let other = "otherhost:2:bbbb";
    let _: () = c.hset(working(other, "a"), 1, job("w1", "a")).unwrap();
    let _: () = c.lpush(landing(other, "a"), job("l1", "a")).unwrap();
    let mut conn = redis.async_conn().await;
    let grace = 1500;
    // No alive key (a stall outlived its TTL): marked, not recovered, however often recovery runs.
    for _ in 0..3 {
        let r = fetch::recover_orphans(&mut conn, ME, oxidekiq::time::now(), policy(grace))
            .await
            .unwrap()
            .unwrap();
        assert_eq!((r.requeued, r.suspects), (0, 1));
    }
    // It beats again: alive, and it keeps its jobs even past the grace.
    assert!(
        !fetch::mark_alive(&mut conn, other, Duration::from_secs(10))
            .await
            .unwrap()
    );
    tokio::time::sleep(Duration::from_millis(grace + 300)).await;
    let r = fetch::recover_orphans(&mut conn, ME, oxidekiq::time::now(), policy(grace))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((r.requeued, r.suspects), (0, 0));
    assert_eq!(hash_jids(&mut c, &working(other, "a")), ["w1"]);
    // Gone for good: marked, and after the grace its jobs go back.
    let _: () = c.del(oxidekiq::keys::alive(other)).unwrap();
    let r = fetch::recover_orphans(&mut conn, ME, oxidekiq::time::now(), policy(grace))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(r.requeued, 0);
    tokio::time::sleep(Duration::from_millis(grace + 300)).await;
    let r = fetch::recover_orphans(&mut conn, ME, oxidekiq::time::now(), policy(grace))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(r.requeued, 2);
    let mut back = list_jids(&mut c, "queue:a");
    back.sort();
    assert_eq!(back, ["l1", "w1"]);
    assert!(!c.exists::<_, bool>(working(other, "a")).unwrap());
    assert!(!c.exists::<_, bool>(landing(other, "a")).unwrap());
    assert!(
        !c.hexists::<_, _, bool>(oxidekiq::keys::SUSPECTS, other)
            .unwrap()
    );
}

/// A job recovered from dead processes too often goes to the dead set saying why, with the fields every
/// dead entry has; and recovery into a queue key of the wrong type leaves the jobs where they are.
#[tokio::test]
async fn a_job_recovered_too_often_dies_with_its_error_and_a_bad_queue_keeps_its_jobs() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let other = "otherhost:3:cccc";
    let poison = r#"{"class":"A","args":[12345678901234567890123],"jid":"poison","queue":"a"}"#;
    let _: () = c.hset(working(other, "a"), 1, poison).unwrap();
    let _: () = c
        .hset(working(other, "bad"), 1, job("stuck", "bad"))
        .unwrap();
    let _: () = c.set("queue:bad", "not a list").unwrap();
    // Recovered MAX_RECOVERIES times already (the count is per payload, by SHA1).
    fetch::recovery::mark_recovered(&mut c, poison, fetch::recovery::MAX_RECOVERIES);
    let mut conn = redis.async_conn().await;
    let now = oxidekiq::time::now();
    let first = fetch::recover_orphans(&mut conn, ME, now, policy(1))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.suspects, 1);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let r = fetch::recover_orphans(&mut conn, ME, now, policy(1))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((r.requeued, r.killed), (0, 1));
    let dead: Vec<String> = c.zrange("dead", 0, -1).unwrap();
    assert_eq!(dead.len(), 1);
    assert!(
        dead[0].starts_with(&poison[..poison.len() - 1]),
        "original bytes kept"
    );
    let v: Value = serde_json::from_str(&dead[0]).unwrap();
    assert_eq!(v["error_class"], "Oxidekiq::TooManyRecoveries");
    assert!(
        v["error_message"].as_str().unwrap().contains("recovered"),
        "{v}"
    );
    assert!(v["failed_at"].is_f64());
    // The Ruby API reads it as any dead entry (`DeadSet`, `SortedEntry#[]`).
    let out = support::ruby(
        r#"require "sidekiq/api"
e = Sidekiq::DeadSet.new.first
puts [e.jid, e["error_class"], e.item["args"][0].to_s, e.at.to_i > 0].join("|")"#,
        &redis.url(),
    );
    assert_eq!(
        out.stdout.trim(),
        "poison|Oxidekiq::TooManyRecoveries|12345678901234567890123|true",
        "{}",
        out.stderr
    );
    // The job bound for the wrong-type queue is still in its working hash.
    assert_eq!(hash_jids(&mut c, &working(other, "bad")), ["stuck"]);
}

/// A process killed mid-batch (its batch lists hold done and unfinished jobs, one list filled by a fetch
/// whose reply never came) beside a process of an older version killed too (its working hash and
/// landing list) and one of the last release (its batch list under `oxidekiq:working:`, with its acks
/// set): one pass, a grace after the first, pushes back exactly the unfinished jobs of the three
/// layouts, each once, in the order their queue served them, and leaves no key of theirs behind. While
/// this release's process holds jobs, no key of it matches `oxidekiq:working:*` (what the recovery of a
/// release before the batch lists scans).
#[tokio::test]
async fn recovery_takes_back_the_unfinished_jobs_of_batch_lists_and_of_the_old_layout() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let dead = "deadhost:4:dddd";
    for i in 0..6 {
        let _: () = c.lpush("queue:a", job(&format!("n{i}"), "a")).unwrap();
    }
    let killed = fetcher(&redis, &["a"], dead).await;
    let got = killed.retrieve_work(4).await.unwrap();
    assert_eq!(got.len(), 4);
    // Two of them done (one by its ack, one by a fate write), two still running when the kill came.
    killed.acknowledge(&got[..1]).await.unwrap();
    let mut conn = redis.async_conn().await;
    let token = oxidekiq::retry::Token::of(
        &oxidekiq::keys::batch_prefix(dead),
        &got[1].queue,
        got[1].id,
    );
    assert!(
        oxidekiq::retry::kill(&mut conn, b"dead-n1", oxidekiq::time::now(), Some(&token))
            .await
            .unwrap()
    );
    // A second fetch's list whose reply never reached it: all of it unfinished.
    let _: () = c.lpush("queue:a", job("n6", "a")).unwrap();
    let more = killed.retrieve_work(10).await.unwrap();
    drop(killed);
    assert_eq!(more.len(), 3);
    assert_eq!(held_jids(&mut c, dead), ["n2", "n3", "n4", "n5", "n6"]);
    // Nothing of this release under the prefix the recovery of a release before the batch lists scans
    // (it would read a batch list as the working hash of a queue `a:@<n>` and strand its jobs there).
    let old_scan: Vec<String> = c.keys("oxidekiq:working:*").unwrap();
    assert!(old_scan.is_empty(), "{old_scan:?}");
    // The older version's process: a working hash and a landing list.
    let old = "oldhost:5:eeee";
    let _: () = c.hset(working(old, "a"), 7, job("w7", "a")).unwrap();
    let _: () = c.lpush(landing(old, "a"), job("l1", "a")).unwrap();
    // A process of the last release killed mid-batch: its batch list under `oxidekiq:working:` as that
    // release's fetch script wrote it (SORT .. STORE: the queue's order, its tail served first), the
    // middle job done (its place in the acks set, as that release's ack wrote it).
    let last = "lasthost:6:ffff";
    let last_list = format!("oxidekiq:working:{last}:a:@3");
    let _: () = c
        .rpush(
            &last_list,
            vec![job("p2", "a"), job("p1", "a"), job("p0", "a")],
        )
        .unwrap();
    let _: () = c.sadd(format!("oxidekiq:acks:{last}:a:@3"), 1).unwrap();

    let first = fetch::recover_orphans(&mut conn, ME, oxidekiq::time::now(), policy(1))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((first.requeued, first.suspects), (0, 3));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let r = fetch::recover_orphans(&mut conn, ME, oxidekiq::time::now(), policy(1))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((r.requeued, r.killed), (9, 0));
    let mut back = list_jids(&mut c, "queue:a");
    back.sort();
    assert_eq!(back, ["l1", "n2", "n3", "n4", "n5", "n6", "p0", "p2", "w7"]);
    let last_served: Vec<String> = list_jids(&mut c, "queue:a")
        .into_iter()
        .filter(|j| j.starts_with('p'))
        .rev()
        .collect();
    assert_eq!(
        last_served,
        ["p0", "p2"],
        "the last release's list in its order"
    );
    // The batch lists go back in the order the queue served them: served first again.
    let served: Vec<String> = list_jids(&mut c, "queue:a")
        .into_iter()
        .filter(|j| j.starts_with('n'))
        .rev()
        .collect();
    assert_eq!(served, ["n2", "n3", "n4", "n5", "n6"]);
    let keys: Vec<String> = c.keys("oxidekiq:[wabl]*").unwrap();
    assert!(keys.is_empty(), "{keys:?}");
    let dead_set: Vec<String> = c.zrange("dead", 0, -1).unwrap();
    assert_eq!(dead_set, ["dead-n1"], "the fate written is not undone");
}

/// Basic fetch takes the free slots' worth of jobs in one pass over the queues, in Sidekiq's strict
/// order (the first queue first, the next one for the rest), each queue from its served end; it blocks
/// (one job, `BRPOP`) only when every queue is empty. Before, every fetch was one `BRPOP` for one job
/// whatever the free slots.
#[tokio::test]
async fn basic_fetch_takes_the_free_slots_in_queue_order_and_blocks_only_when_empty() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    fill(&mut c, "a", 3);
    fill(&mut c, "b", 5);
    let f = basic(&redis, &["a", "b"]).await;
    let got = f.retrieve_work(4).await.unwrap();
    let jids: Vec<String> = got.iter().map(|u| jid_of(u.raw())).collect();
    assert_eq!(jids, ["a0", "a1", "a2", "b0"]);
    assert_eq!(got[3].queue.as_ref(), "b");
    let got = f.retrieve_work(10).await.unwrap();
    let jids: Vec<String> = got.iter().map(|u| jid_of(u.raw())).collect();
    assert_eq!(jids, ["b1", "b2", "b3", "b4"]);
    // Empty: the blocking wait, which a job pushed meanwhile ends.
    let url = redis.url();
    let pusher = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        let mut c = redis::Client::open(url).unwrap().get_connection().unwrap();
        let _: () = c.lpush("queue:b", job("late", "b")).unwrap();
    });
    let mut late = Vec::new();
    for _ in 0..50 {
        late.extend(f.retrieve_work(10).await.unwrap());
        if !late.is_empty() {
            break;
        }
    }
    pusher.join().unwrap();
    assert_eq!(
        late.iter().map(|u| jid_of(u.raw())).collect::<Vec<_>>(),
        ["late"]
    );
    assert_eq!(c.llen::<_, usize>("queue:a").unwrap(), 0);
    assert_eq!(c.llen::<_, usize>("queue:b").unwrap(), 0);
}

/// A batch list of this process that it does not know (a failover to a replica that had not seen its
/// deletion brings it back, or a fetch whose reply was lost without an error) goes back at the next
/// reconcile, except the places marked done; the lists it handed out stay. Such a list has its entry in
/// the process's index of held lists, written with it by the fetch (issue 43: the reconcile reads the
/// index instead of walking the keyspace).
#[tokio::test]
async fn reconcile_pushes_back_a_batch_list_the_process_does_not_know() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    fill(&mut c, "a", 2);
    let f = fetcher(&redis, &["a"], ME).await;
    let got = f.retrieve_work(10).await.unwrap();
    assert_eq!(got.len(), 2);
    let stray = oxidekiq::keys::batch_list(&oxidekiq::keys::batch_prefix(ME), "a", 999);
    let _: () = c
        .rpush(&stray, vec![job("s0", "a"), job("s1", "a")])
        .unwrap();
    let _: () = c.sadd(oxidekiq::keys::acks_of(&stray), 0).unwrap();
    let _: () = c.sadd(oxidekiq::keys::held_index(ME), &stray).unwrap();
    assert_eq!(f.reconcile().await.unwrap(), 1);
    assert_eq!(list_jids(&mut c, "queue:a"), ["s1"]);
    assert!(!c.exists::<_, bool>(&stray).unwrap());
    assert_eq!(held_jids(&mut c, ME), ["a0", "a1"]);
}

/// A push-back retried whole (`with_retries` after a later batch's call failed) and an ack sent twice
/// count each job once: a batch list is deleted only when every job it handed out is done, never while
/// one is still running (whose fate write would then find it gone and write nothing, and whose process
/// dying would leave nothing to recover).
#[tokio::test]
async fn a_retried_push_back_or_a_repeated_ack_never_deletes_a_list_with_a_running_job() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    fill(&mut c, "a", 3);
    let f = fetcher(&redis, &["a"], ME).await;
    let got = f.retrieve_work(3).await.unwrap();
    assert_eq!(got.len(), 3);
    // got[0] runs; the two others go back, and the push-back is sent again.
    assert_eq!(f.bulk_requeue(&got[1..]).await.unwrap(), 2);
    assert_eq!(f.bulk_requeue(&got[1..]).await.unwrap(), 0);
    assert_eq!(f.outstanding(), 1);
    assert_eq!(held_jids(&mut c, ME), ["a0"], "the running job stays held");
    f.acknowledge(&got[..1]).await.unwrap();
    assert_eq!(f.outstanding(), 0);
    assert!(held_jids(&mut c, ME).is_empty());

    fill(&mut c, "b", 3);
    let f = fetcher(&redis, &["b"], ME).await;
    let got = f.retrieve_work(3).await.unwrap();
    assert_eq!(got.len(), 3);
    for _ in 0..3 {
        f.acknowledge(&got[..1]).await.unwrap();
    }
    assert_eq!(f.outstanding(), 2);
    assert_eq!(held_jids(&mut c, ME), ["b1", "b2"]);
}

/// A Redis whose ACL refuses `SCAN` (managed Redis often does) still gets back the jobs of a fetch whose
/// reply was lost: the look for stray lists fails (logged at error level), and the lists this process
/// knows are lost go back all the same, the sweep not failed by it.
#[tokio::test]
async fn a_refused_scan_does_not_keep_a_lost_fetch_from_being_pushed_back() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let trap = ReplyTrap::start(&redis).await;
    let f = limited_fetcher_via(&redis, &mut c, "scan", Some(&trap)).await;
    // Loads the fetch script (the lost fetch below must find it).
    assert!(f.retrieve_work(10).await.unwrap().is_empty());
    fill(&mut c, "a", 2);
    lose_a_fetch(&mut c, &f, &trap).await;
    assert_eq!(held_jids(&mut c, ME), ["a0", "a1"]);
    assert_eq!(
        f.reconcile().await.unwrap(),
        2,
        "the sweep is not failed by the SCAN"
    );
    assert!(
        held_jids(&mut c, ME).is_empty(),
        "the lost fetch's jobs went back"
    );
    assert_eq!(list_jids(&mut c, "queue:a"), ["a1", "a0"]);
}

/// A Redis whose ACL refuses `MEMORY` or `SORT` (the fetch script copies a batch with `SORT .. STORE`
/// and then asks `MEMORY USAGE` of the copy; `SORT` is in `@dangerous`, which managed Redis often
/// refuses) still serves each job once: the fetch reads the queue job by job instead, and no fetch leaves
/// a copy behind that a push-back would add to the queue again.
#[tokio::test]
async fn a_refused_memory_usage_or_sort_neither_stops_the_fetch_nor_copies_jobs() {
    for refused in ["memory", "sort"] {
        let redis = support::RedisServer::start();
        let mut c = redis.conn();
        fill(&mut c, "a", 3);
        let f = limited_fetcher(&redis, &mut c, refused).await;
        let first = f.retrieve_work(10).await;
        // Whatever the first fetch answered, the sweep that follows a failed fetch runs, as in
        // production.
        let _ = f.reconcile().await;
        let got = match first {
            Ok(got) => got,
            Err(_) => f.retrieve_work(10).await.unwrap_or_default(),
        };
        let mut jids: Vec<String> = got.iter().map(|u| jid_of(u.raw())).collect();
        jids.extend(list_jids(&mut c, "queue:a"));
        jids.sort();
        assert_eq!(jids, ["a0", "a1", "a2"], "{refused} refused: each job once");
        assert_eq!(
            got.len(),
            3,
            "{refused} refused: the fetch serves the queue"
        );
    }
}

/// A sweep that loses its connection (Redis gone, a `CLIENT KILL`) reports an outage, which the quiet
/// and stop sweeps retry, never a failure that will not mend: the quiet sweep gave up at once on a broken
/// pipe and left the jobs it took from the feed held until the stop (chaos seed 312: QUIET STRAND).
#[tokio::test]
async fn a_sweep_cut_off_from_redis_reports_an_outage() {
    let redis = support::RedisServer::start();
    let f = fetcher(&redis, &["a", "b"], ME).await;
    let killed = std::process::Command::new("kill")
        .arg("-9")
        .arg(redis.pid().to_string())
        .status()
        .unwrap();
    assert!(killed.success());
    std::thread::sleep(Duration::from_millis(200));
    for everything in [false, true] {
        let e = f.requeue_leftovers(everything).await.unwrap_err();
        assert!(e.is_outage(), "everything={everything}: {e}");
    }
}

/// Redis's count of read events (`INFO stats` `total_reads_processed`): one per round trip of a small
/// pipeline.
fn reads(c: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("stats").query(c).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("total_reads_processed:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

/// A fetcher of queue `a` whose acks wait up to 30 s for a fetch to carry them.
async fn patient_fetcher(redis: &support::RedisServer) -> std::sync::Arc<Reliable> {
    std::sync::Arc::new(
        fetcher(redis, &["a"], ME)
            .await
            .with_ride_wait(Duration::from_secs(30)),
    )
}

/// `queued` jobs in queue `a`, of which a patient fetcher ([`patient_fetcher`]) takes `taken` in one
/// batch: the fetcher, the jobs, and the one batch list in Redis.
async fn one_batch_out(
    redis: &support::RedisServer,
    c: &mut redis::Connection,
    queued: usize,
    taken: usize,
) -> (
    std::sync::Arc<Reliable>,
    Vec<oxidekiq::fetch::UnitOfWork>,
    Vec<String>,
) {
    fill(c, "a", queued);
    let f = patient_fetcher(redis).await;
    let got = f.retrieve_work(taken).await.unwrap();
    assert_eq!(got.len(), taken);
    let lists: Vec<String> = c.keys(format!("oxidekiq:batch:{ME}:*")).unwrap();
    assert_eq!(lists.len(), 1);
    (f, got, lists)
}

/// Acknowledges `units` in a task of its own, returned once the ack waits for a fetch to carry it.
async fn ack_waiting(
    f: &std::sync::Arc<Reliable>,
    units: Vec<oxidekiq::fetch::UnitOfWork>,
) -> tokio::task::JoinHandle<oxidekiq::error::Result<()>> {
    let acker = {
        let f = f.clone();
        tokio::spawn(async move { f.acknowledge(&units).await })
    };
    for _ in 0..3000 {
        if f.riders() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(f.riders(), 1, "the ack waits for a fetch");
    acker
}

/// An ack waiting when a fetch is built rides in the fetch's pipeline (issue 32: one round trip fewer
/// per fetch under load): Redis sees one round trip for both, and once `acknowledge` returns the places
/// are in the acks set (or the finished batch is gone). Before, the ack was a round trip of its own.
#[tokio::test]
async fn an_ack_rides_on_the_next_fetch_and_is_in_redis_when_it_returns() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    fill(&mut c, "a", 4);
    let f = patient_fetcher(&redis).await;
    let got = f.retrieve_work(2).await.unwrap();
    assert_eq!(got.len(), 2);
    let acker = ack_waiting(&f, got[..1].to_vec()).await;
    let before = reads(&mut c);
    let more = f.retrieve_work(2).await.unwrap();
    assert_eq!(more.len(), 2);
    tokio::time::timeout(Duration::from_secs(10), acker)
        .await
        .expect("the ack ended with the fetch")
        .unwrap()
        .unwrap();
    // The INFO itself is one read more.
    assert_eq!(
        reads(&mut c) - before,
        2,
        "the fetch and the ack in one round trip"
    );
    assert_eq!(held_jids(&mut c, ME), ["a1", "a2", "a3"]);
    assert_eq!(f.outstanding(), 3);
}

/// An ack that no fetch carries (the queues are empty, or none comes in time) goes out on its own.
#[tokio::test]
async fn an_ack_no_fetch_carries_goes_out_alone() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    fill(&mut c, "a", 2);
    let f = fetcher(&redis, &["a"], ME).await;
    let got = f.retrieve_work(2).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), f.acknowledge(&got[..1]))
        .await
        .expect("the ack went out alone")
        .unwrap();
    assert_eq!(held_jids(&mut c, ME), ["a1"]);
    assert_eq!(f.riders(), 0);
}

/// An ack refused by Redis (its acks set damaged: a string) fails only itself, never the fetch that
/// carried it: the fetch hands out its jobs, and the ack, sent again on its own, is dropped for that
/// batch (issue 43: logged, not retried).
#[tokio::test]
async fn a_refused_ack_riding_on_a_fetch_does_not_fail_the_fetch() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let (f, got, lists) = one_batch_out(&redis, &mut c, 5, 3).await;
    let _: () = c
        .set(oxidekiq::keys::acks_of(&lists[0]), "damaged")
        .unwrap();
    let acker = ack_waiting(&f, got[..1].to_vec()).await;
    let more = f
        .retrieve_work(2)
        .await
        .expect("the fetch is not failed by the ack");
    assert_eq!(more.len(), 2);
    let acked = tokio::time::timeout(Duration::from_secs(10), acker)
        .await
        .unwrap()
        .unwrap();
    assert!(acked.is_ok(), "the refused ack is dropped, not retried");
    assert_eq!(f.outstanding(), 4, "the dropped ack's job counts done here");
    assert_eq!(
        c.get::<_, String>(oxidekiq::keys::acks_of(&lists[0]))
            .unwrap(),
        "damaged",
        "the damaged key is left as it is"
    );
}

/// Issue 43: one batch's acks set of the wrong type stopped every later ack of a live process (the acks
/// went in one pipeline that failed as a whole on its `WRONGTYPE`, and the acker retried it forever). An
/// ack of jobs of two batches, one of them damaged, now reaches Redis for the intact one and returns;
/// the damaged batch's ack is dropped, and once its last job is done its list and the damaged key go.
#[tokio::test]
async fn a_damaged_acks_set_costs_only_its_own_batch() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    fill(&mut c, "a", 4);
    let f = fetcher(&redis, &["a"], ME).await;
    let first = f.retrieve_work(2).await.unwrap();
    let second = f.retrieve_work(2).await.unwrap();
    assert_eq!((first.len(), second.len()), (2, 2));
    let t = |u: &oxidekiq::fetch::UnitOfWork| {
        oxidekiq::retry::Token::of(&oxidekiq::keys::batch_prefix(ME), &u.queue, u.id).working
    };
    let (damaged, intact) = (t(&first[0]), t(&second[0]));
    assert_ne!(damaged, intact);
    let _: () = c.set(oxidekiq::keys::acks_of(&damaged), "x").unwrap();
    // One job of each batch, in one ack.
    let both = [first[0].clone(), second[0].clone()];
    tokio::time::timeout(Duration::from_secs(10), f.acknowledge(&both))
        .await
        .expect("the ack returned")
        .expect("a damaged acks set fails only its own batch's ack");
    let marked: Vec<String> = c.smembers(oxidekiq::keys::acks_of(&intact)).unwrap();
    assert_eq!(
        marked.len(),
        1,
        "the intact batch's ack reached Redis: {marked:?}"
    );
    assert_eq!(f.outstanding(), 2);
    // The damaged batch's last job: one DEL takes its list and the damaged key.
    f.acknowledge(&first[1..]).await.unwrap();
    assert!(!c.exists::<_, bool>(&damaged).unwrap(), "its list is gone");
    assert!(
        !c.exists::<_, bool>(oxidekiq::keys::acks_of(&damaged))
            .unwrap(),
        "the damaged key went with its list"
    );
    assert_eq!(held_jids(&mut c, ME), [jid_of(second[1].raw())]);
}

/// A fetch that took an ack into its pipeline and is then dropped midway (the stop deadline cuts a
/// fetch under way) leaves the ack to go out on its own: it returns once Redis has it, counted once.
#[tokio::test]
async fn an_ack_riding_on_a_fetch_dropped_midway_goes_out_alone() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let (f, got, first) = one_batch_out(&redis, &mut c, 4, 2).await;
    // Both jobs of the batch: the ack deletes it.
    let acker = ack_waiting(&f, got.clone()).await;
    // Redis holds every command for a while: the fetch is cut off before its reply.
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(400)
        .arg("ALL")
        .query(&mut c)
        .unwrap();
    let cut = tokio::time::timeout(Duration::from_millis(50), f.retrieve_work(2)).await;
    assert!(cut.is_err(), "the fetch was not cut off");
    assert_eq!(f.riders(), 0, "the dropped fetch took the ack");
    tokio::time::timeout(Duration::from_secs(10), acker)
        .await
        .expect("the ack went out alone")
        .unwrap()
        .unwrap();
    assert_eq!(f.outstanding(), 0, "the ack counted");
    assert!(
        !c.exists::<_, bool>(&first[0]).unwrap(),
        "the finished batch is still in Redis"
    );
}

/// A landing list is in its process's index of held lists from the first blocking wait that may fill
/// it, not from the process's first recovery pass on (issue 43): a process that dies with a job there
/// before any pass of its own is recovered by index, not by the fleet's walk minutes later. No recovery
/// pass runs here: only the wait can have added it.
#[tokio::test]
async fn a_landing_list_is_indexed_before_its_first_blocking_wait() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let f = fetcher(&redis, &["a"], ME).await;
    let got = f.retrieve_work(10).await.unwrap();
    assert!(got.is_empty(), "the queue is empty: the fetch waited");
    let index: Vec<String> = c.smembers(oxidekiq::keys::held_index(ME)).unwrap();
    assert_eq!(
        index,
        vec![format!("oxidekiq:landing:{ME}:a")],
        "the landing list of queue a is in the index after the wait"
    );
}

/// Review of issue 43: one member of this process's own index of held lists that is not UTF-8 made the
/// whole index unreadable as text, so the reconcile (and the stop's) pushed back no stray batch list at
/// all: the stop then deleted the index and left the stray to the fleet's walk, minutes later.
#[tokio::test]
async fn a_member_that_is_not_utf8_in_the_own_index_keeps_no_stray_from_going_back() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let f = fetcher(&redis, &["a"], ME).await;
    let stray = oxidekiq::keys::batch_list(&oxidekiq::keys::batch_prefix(ME), "a", 999);
    let _: () = c.rpush(&stray, vec![job("s0", "a")]).unwrap();
    let _: () = c.sadd(oxidekiq::keys::held_index(ME), &stray).unwrap();
    let _: () = c
        .sadd(oxidekiq::keys::held_index(ME), &b"junk\xff"[..])
        .unwrap();
    assert_eq!(f.reconcile().await.unwrap(), 1, "the stray went back");
    assert_eq!(list_jids(&mut c, "queue:a"), ["s0"]);
}
