//! The reliable fetcher's own connections (`redis_conn::resp_pool`) against a real `redis-server`:
//! the fetch pipelines (the fast path's transaction, the batch script's call, the acks riding on
//! them) go over them, their replies read by our RESP reader as redis-rs reads them, and a connection
//! the server closed, between fetches or in the middle of one, loses no job and strands none.
//!
//! Every test accounts for every job it put in, as in `tests_scripts`: handed out exactly once, or in
//! a queue, never stranded in a batch list.
use crate::test_support as support;

use std::time::Duration;

use oxidekiq::fetch::{Fetch, Reliable, UnitOfWork};
use oxidekiq::redis_conn::resp::{Dialer, Reader};
use redis::Commands;

use super::tests_scripts::{ME, ReplyTrap, fetcher, fetcher_via, fill, held_jids, jid_of, job};

fn jids(units: &[UnitOfWork]) -> Vec<String> {
    units.iter().map(|u| jid_of(u.raw())).collect()
}

/// `a<from>`..`a<to-1>`.
fn named(from: usize, to: usize) -> Vec<String> {
    (from..to).map(|i| format!("a{i}")).collect()
}

/// The commands only the fetch pipelines send: a client whose last command is one of them is the
/// fetcher's own connection (the shared one and the test's never send them here).
const FETCH_COMMANDS: [&str; 6] = ["multi", "sort", "eval", "lrange", "exec", "evalsha"];

/// Redis's id of the fetcher's own connection (`CLIENT LIST`), if it has one open.
fn own_client(c: &mut redis::Connection) -> Option<u64> {
    let list: String = redis::cmd("CLIENT").arg("LIST").query(c).unwrap();
    list.lines()
        .find(|l| {
            l.split(' ').any(|f| {
                f.strip_prefix("cmd=")
                    .is_some_and(|cmd| FETCH_COMMANDS.contains(&cmd))
            })
        })
        .and_then(|l| l.split(' ').find_map(|f| f.strip_prefix("id=")))
        .and_then(|id| id.parse().ok())
}

/// Kills the fetcher's own connection on the server's side.
fn kill_own(c: &mut redis::Connection) -> u64 {
    let id = own_client(c).expect("the fetcher's own connection is open");
    let killed: u64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(id)
        .query(c)
        .unwrap();
    assert_eq!(killed, 1);
    id
}

/// Fetches and acknowledges until a fetch finds nothing: every jid handed out, in order.
async fn drain_all(f: &Reliable) -> Vec<String> {
    let mut out = Vec::new();
    loop {
        let got = f.retrieve_work(4).await.unwrap();
        if got.is_empty() {
            return out;
        }
        out.extend(jids(&got));
        f.acknowledge(&got).await.unwrap();
    }
}

/// Waits until queue `a` holds `n` jobs.
async fn queue_holds(c: &mut redis::Connection, n: usize) -> bool {
    for _ in 0..1000 {
        if c.llen::<_, usize>("queue:a").unwrap() == n {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// Redis's replies to a fast fetch, to one with an ack riding on it, and to the batch script's call
/// with two lists read, as recorded on the wire, read by our reader into the values redis-rs's own
/// parser reads from the same bytes, however the bytes are cut.
#[tokio::test]
async fn the_fetch_replies_on_the_wire_read_as_redis_rs_reads_them() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    fill(&mut c, "a", 9);
    let trap = ReplyTrap::start(&redis).await;
    let f = fetcher_via(&redis, &["a"], ME, &trap)
        .await
        .with_ride_wait(Duration::from_secs(10));
    let first = f.retrieve_work(3).await.unwrap();
    assert_eq!(jids(&first), named(0, 3));
    let f = std::sync::Arc::new(f);
    let ack = tokio::spawn({
        let (f, done) = (f.clone(), first[..1].to_vec());
        async move { f.acknowledge(&done).await }
    });
    let mut waited = 0;
    while f.riders() == 0 && waited < 1000 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        waited += 1;
    }
    assert_eq!(f.riders(), 1, "the ack waits for a fetch");
    let second = f.retrieve_work(3).await.unwrap();
    assert_eq!(jids(&second), named(3, 6));
    ack.await.unwrap().unwrap();
    // The queue's last jobs, fewer than asked: the fast path's last take.
    let third = f.retrieve_work(10).await.unwrap();
    assert_eq!(jids(&third), named(6, 9));
    // The queue found short, the next fetch goes through the batch script (loaded first: NOSCRIPT).
    for jid in ["s0", "s1"] {
        let _: () = c.lpush("queue:a", job(jid, "a")).unwrap();
    }
    let fourth = f.retrieve_work(10).await.unwrap();
    assert_eq!(jids(&fourth), ["s0", "s1"]);
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut c)
        .unwrap();
    for cmd in ["cmdstat_exec:", "cmdstat_evalsha:", "cmdstat_sadd:"] {
        assert!(info.contains(cmd), "{cmd} ran: {info}");
    }

    let wire = trap.passed.lock().unwrap().clone();
    let mut parser = redis::Parser::new();
    let mut cursor = std::io::Cursor::new(&wire[..]);
    let mut want = Vec::new();
    while let Ok(v) = parser.parse_value(&mut cursor) {
        want.push(v);
    }
    // 5 replies a fast fetch, 1 more for the riding ack, 3 for the script's call and its two lists
    // (twice: NOSCRIPT first).
    assert_eq!(want.len(), 5 + 6 + 5 + 3 + 3, "{want:?}");
    let exec = want
        .iter()
        .find_map(|v| match v {
            redis::Value::Array(a) if a.len() == 3 => Some(a),
            _ => None,
        })
        .expect("an EXEC reply");
    assert!(
        matches!(&exec[2], redis::Value::Array(jobs) if jobs.len() == 3),
        "{exec:?}"
    );
    for cut in 0..=wire.len() {
        let mut reader = Reader::default();
        let (mut buf, mut got) = (wire[..cut].to_vec(), Vec::new());
        let mut at = 0;
        while let Some(v) = reader.next(&buf, &mut at).unwrap() {
            got.push(v);
        }
        buf.drain(..at);
        buf.extend_from_slice(&wire[cut..]);
        at = 0;
        while let Some(v) = reader.next(&buf, &mut at).unwrap() {
            got.push(v);
        }
        assert_eq!(at, buf.len(), "cut at {cut}: every byte read");
        assert_eq!(got, want, "cut at {cut}");
    }
}

/// The fetcher's own connection killed by the server between two fetches (`CLIENT KILL`, as Redis's
/// `timeout` or a restart would close it): the next fetch sees it closed before it writes anything,
/// makes a new one, and takes the next jobs; nothing fails, nothing is lost.
#[tokio::test]
async fn an_own_connection_closed_between_fetches_is_made_again_and_the_fetch_does_not_fail() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    fill(&mut c, "a", 12);
    let f = fetcher(&redis, &["a"], ME).await;
    let first = f.retrieve_work(4).await.unwrap();
    assert_eq!(jids(&first), named(0, 4));
    assert_eq!(
        f.own_idle(),
        Some(1),
        "the connection went back to the pool"
    );
    let killed = kill_own(&mut c);
    let second = f.retrieve_work(4).await.unwrap();
    assert_eq!(jids(&second), named(4, 8));
    let now = own_client(&mut c).expect("a new connection");
    assert_ne!(now, killed);
    assert_eq!(f.own_idle(), Some(1));
    f.acknowledge(&first).await.unwrap();
    f.acknowledge(&second).await.unwrap();
    assert_eq!(drain_all(&f).await, named(8, 12));
    let keys: Vec<String> = c.keys("oxidekiq:batch:*").unwrap();
    assert!(keys.is_empty(), "nothing stranded: {keys:?}");
}

/// The fetcher's own connection killed in the middle of a fetch: once while Redis holds it unrun
/// (`CLIENT PAUSE WRITE`: the transaction is discarded with the connection, every job stays queued),
/// once after Redis ran it while its reply was on the way (a proxy drops the reply: the jobs sit in a
/// batch list nobody was handed). Each fetch fails at once (not at the response timeout), the error
/// is counted for `/metrics`, the connection is not used again, and the lost list goes back at the
/// reconcile: every job is handed out exactly once, none stranded.
#[tokio::test]
async fn an_own_connection_killed_mid_fetch_loses_no_job_and_runs_none_twice() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    fill(&mut c, "a", 12);
    let trap = ReplyTrap::start(&redis).await;
    let f = fetcher_via(&redis, &["a"], ME, &trap).await;
    let first = f.retrieve_work(4).await.unwrap();
    let mut handed = jids(&first);
    assert_eq!(handed, named(0, 4));

    // Killed while Redis holds the transaction unrun.
    let errors = oxidekiq::prom::metrics().redis_errors_counted();
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(10_000)
        .arg("WRITE")
        .query(&mut c)
        .unwrap();
    let fetch = f.retrieve_work(4);
    tokio::pin!(fetch);
    // The transaction held by the pause (Redis 7.0 holds it at its `SORT`: a client in a transaction,
    // blocked, `flags=xb`; later versions at its `EXEC`): the rest of it waits in its query buffer.
    let blocked = async {
        for _ in 0..1000 {
            let list: String = redis::cmd("CLIENT").arg("LIST").query(&mut c).unwrap();
            let held = |f: &str| {
                f.strip_prefix("flags=")
                    .is_some_and(|f| f.contains('x') && f.contains('b'))
            };
            if list.lines().any(|l| l.split(' ').any(held)) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    };
    tokio::select! {
        got = &mut fetch => panic!("the fetch was answered during the pause: {got:?}"),
        found = blocked => assert!(found, "the fetch reached Redis"),
    }
    kill_own(&mut c);
    let _: () = redis::cmd("CLIENT").arg("UNPAUSE").query(&mut c).unwrap();
    let failed = tokio::time::timeout(Duration::from_secs(3), &mut fetch)
        .await
        .expect("the fetch fails at once");
    assert!(failed.is_err(), "{failed:?}");
    assert!(oxidekiq::prom::metrics().redis_errors_counted() > errors);
    assert_eq!(
        f.own_idle(),
        Some(0),
        "a failed connection is not used again"
    );
    assert_eq!(
        c.llen::<_, usize>("queue:a").unwrap(),
        8,
        "the transaction did not run"
    );
    assert_eq!(f.reconcile().await.unwrap(), 0, "its list was never filled");

    // Killed after Redis ran it, its reply on the way.
    let errors = oxidekiq::prom::metrics().redis_errors_counted();
    trap.swallow(true);
    let fetch = f.retrieve_work(4);
    tokio::pin!(fetch);
    tokio::select! {
        got = &mut fetch => panic!("the fetch was answered: {got:?}"),
        ran = queue_holds(&mut c, 4) => assert!(ran, "the fetch ran"),
    }
    kill_own(&mut c);
    let failed = tokio::time::timeout(Duration::from_secs(3), &mut fetch)
        .await
        .expect("the fetch fails at once");
    assert!(failed.is_err(), "{failed:?}");
    trap.swallow(false);
    assert!(oxidekiq::prom::metrics().redis_errors_counted() > errors);
    let mut held = held_jids(&mut c, ME);
    held.sort();
    assert_eq!(held, named(0, 8), "the batch handed out, and the lost one");
    assert_eq!(f.reconcile().await.unwrap(), 4, "the lost list goes back");

    // The next fetches make a new connection and take every job left, in order, once.
    handed.extend(drain_all(&f).await);
    handed.sort();
    let mut all = named(0, 12);
    all.sort();
    assert_eq!(handed, all, "each job handed out once");
    f.acknowledge(&first).await.unwrap();
    let keys: Vec<String> = c.keys("oxidekiq:batch:*").unwrap();
    assert!(keys.is_empty(), "nothing stranded: {keys:?}");
    assert_eq!(c.llen::<_, usize>("queue:a").unwrap(), 0);
}

/// Review of issue 42: a backlog of 200 jobs of 16 KB each (a batch's reply many socket reads long),
/// each payload ending in CRLFs and holding RESP-looking text, fetched through the fetcher's own
/// connections (the fast path, then the batch script after a `SCRIPT FLUSH`): every job handed out
/// once, byte for byte, nothing stranded.
#[tokio::test]
async fn big_payloads_read_whole_over_the_own_connections() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let pad = format!("$-1 *3 :1 -ERR +OK {}", "x".repeat(16 * 1024));
    let payload = |jid: &str| {
        format!(r#"{{"class":"A","args":["{pad}"],"jid":"{jid}","queue":"a","retry":true}}"#)
            + "\r\n\r\n"
    };
    for i in 0..200 {
        let _: () = c.lpush("queue:a", payload(&format!("a{i}"))).unwrap();
    }
    let f = fetcher(&redis, &["a"], ME).await;
    let mut handed = Vec::new();
    let mut flushed = false;
    loop {
        let got = f.retrieve_work(200).await.unwrap();
        if got.is_empty() {
            break;
        }
        for u in &got {
            let jid = jid_of(u.raw());
            assert_eq!(u.raw(), payload(&jid).as_bytes(), "{jid} byte for byte");
            handed.push(jid);
        }
        f.acknowledge(&got).await.unwrap();
        if !flushed {
            let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut c).unwrap();
            flushed = true;
        }
    }
    assert_eq!(handed, named(0, 200), "each once, in order");
    assert_eq!(f.own_idle(), Some(1));
    let keys: Vec<String> = c.keys("oxidekiq:batch:*").unwrap();
    assert!(keys.is_empty(), "nothing stranded: {keys:?}");
}

/// Review of issue 42: a URL naming an ACL user and database 3: the fetcher's own connections log in
/// as that user and fetch from database 3, never from database 0.
#[tokio::test]
async fn the_own_connections_fetch_from_the_url_s_database_as_its_user() {
    const PASSWORD: &str = "f3tch-s3cret";
    let args = support::acl_args(PASSWORD);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let redis = support::RedisServer::start_with(&args);
    let url = format!("redis://app:{PASSWORD}@127.0.0.1:{}/3", redis.port);
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut c3 = client.get_connection().unwrap();
    let mut c0 = redis::Client::open(format!("redis://app:{PASSWORD}@127.0.0.1:{}/0", redis.port))
        .unwrap()
        .get_connection()
        .unwrap();
    for i in 0..6 {
        let _: () = c3.lpush("queue:a", job(&format!("a{i}"), "a")).unwrap();
        let _: () = c0.lpush("queue:a", job(&format!("z{i}"), "a")).unwrap();
    }
    let conn = oxidekiq::redis_conn::connect(&client).await.unwrap();
    let blocking = oxidekiq::redis_conn::connect_blocking(&client, Duration::from_millis(200))
        .await
        .unwrap();
    let f = Reliable::new(
        &super::tests_scripts::queues(&["a"]),
        ME,
        conn,
        blocking,
        Duration::from_millis(200),
    )
    .dialing(Dialer::of(&client));
    // The fast path, then the batch script (the queue found short).
    let first = f.retrieve_work(4).await.unwrap();
    let _: () = c3.lpush("queue:a", job("s0", "a")).unwrap();
    let mut handed = jids(&first);
    f.acknowledge(&first).await.unwrap();
    handed.extend(drain_all(&f).await);
    assert_eq!(handed, ["a0", "a1", "a2", "a3", "a4", "a5", "s0"]);
    assert_eq!(
        f.own_idle(),
        Some(1),
        "the fetches went over an own connection"
    );
    assert_eq!(
        c0.llen::<_, usize>("queue:a").unwrap(),
        6,
        "database 0 untouched"
    );
}
