//! The fast path of reliable fetch against a real `redis-server`: one transaction (`SORT .. DESC ..
//! STORE` into a batch list, a guard that trims the queue, `LRANGE` of the list) instead of the batch
//! script, and every way it can end (a short queue, a queue key of the wrong type, a command refused, a
//! batch over the payload limit, a reply lost).
//!
//! Every test accounts for every job it put in, as in `tests_scripts`: fetched, or in a queue, a batch
//! list or the dead set, never in two of them. Which path a fetch took is read from Redis's own
//! counts (`INFO commandstats`: `MULTI` for the fast path, `EVALSHA` for the batch script).
use crate::test_support as support;

use std::time::Duration;

use oxidekiq::fetch::{Fetch, Reliable, UnitOfWork};
use oxidekiq::time::TimeFormat;
use redis::Commands;

use super::tests_scripts::{
    ME, ReplyTrap, conns, dialer, fetcher, fetcher_via, fill, held_jids, jid_of, job, landing,
    limited_fetcher, list_jids, lose_a_fetch, queues, stored,
};

/// How many times Redis ran `command` without an error (`INFO commandstats`: calls less failed calls,
/// so an `EVALSHA` answered `NOSCRIPT` before its script was loaded does not count), from scripts too.
fn calls(c: &mut redis::Connection, command: &str) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(c).unwrap();
    let prefix = format!("cmdstat_{command}:");
    let Some(stats) = info.lines().find_map(|l| l.strip_prefix(prefix.as_str())) else {
        return 0;
    };
    let field = |name: &str| -> u64 {
        stats
            .split(',')
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    field("calls") - field("failed_calls")
}

fn jids(units: &[UnitOfWork]) -> Vec<String> {
    units.iter().map(|u| jid_of(u.raw())).collect()
}

/// Every job of queue `q` in the order it serves them (`RPOP`), emptying it.
fn drain(c: &mut redis::Connection, q: &str) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(raw) = c
        .rpop::<_, Option<Vec<u8>>>(format!("queue:{q}"), None)
        .unwrap()
    {
        out.push(jid_of(&raw));
    }
    out
}

/// `a0`..`a<n-1>` (`a<from>` first).
fn named(from: usize, to: usize) -> Vec<String> {
    (from..to).map(|i| format!("a{i}")).collect()
}

/// A queue with a backlog goes out through the fast path, in the order it serves its jobs, each batch
/// list holding its jobs in that order (a unit's place is its index); a stop that pushes back what was
/// not done (in whatever order it gets the jobs) leaves the queue serving them in that order again. The
/// same for the shutdown's last sweep, which pushes back whole lists.
#[tokio::test]
async fn the_fast_path_hands_out_a_queue_in_order_and_a_stop_pushes_it_back_in_that_order() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    fill(&mut c, "a", 10);
    let f = fetcher(&redis, &["a"], ME).await;
    let first = f.retrieve_work(4).await.unwrap();
    let second = f.retrieve_work(4).await.unwrap();
    assert_eq!(
        (calls(&mut c, "multi"), calls(&mut c, "evalsha")),
        (2, 0),
        "two fetches through the fast path, none through the batch script"
    );
    assert_eq!(jids(&first), named(0, 4));
    assert_eq!(jids(&second), named(4, 8));
    for u in first.iter().chain(&second) {
        assert_eq!(stored(&mut c, u), u.raw(), "a unit's place is its index");
    }
    let lists: Vec<String> = c.keys(format!("oxidekiq:batch:{ME}:a:@*")).unwrap();
    assert_eq!(lists.len(), 2, "{lists:?}");
    // A stop: one job done, the rest (running or never started) pushed back, given in any order.
    f.acknowledge(&first[..1]).await.unwrap();
    let mut unfinished: Vec<UnitOfWork> = first[1..].iter().chain(&second).cloned().collect();
    unfinished.reverse();
    unfinished.swap(0, 3);
    assert_eq!(f.bulk_requeue(&unfinished).await.unwrap(), 7);
    assert_eq!(f.requeue_leftovers(true).await.unwrap(), 0);
    assert_eq!(drain(&mut c, "a"), named(1, 10), "served again in order");
    let keys: Vec<String> = c.keys("oxidekiq:*").unwrap();
    assert!(keys.is_empty(), "{keys:?}");

    // The last sweep of a stop: every list of this process not marked done, newest batch first.
    fill(&mut c, "a", 10);
    let first = f.retrieve_work(3).await.unwrap();
    let second = f.retrieve_work(3).await.unwrap();
    assert_eq!(jids(&second), named(3, 6));
    f.acknowledge(&first[1..2]).await.unwrap();
    assert_eq!(f.requeue_leftovers(true).await.unwrap(), 5);
    assert_eq!(
        drain(&mut c, "a"),
        ["a0", "a2", "a3", "a4", "a5", "a6", "a7", "a8", "a9"]
    );
    let keys: Vec<String> = c.keys("oxidekiq:*").unwrap();
    assert!(keys.is_empty(), "{keys:?}");
}

/// A queue shorter than the batch gives what it has through the fast path, and is left empty (its key
/// gone); its next fetch goes through the batch script, which also looks at the landing lists and the
/// other queues; a look that finds a queue fuller than the batch sends the next fetch the fast way
/// again.
#[tokio::test]
async fn a_short_queue_gives_what_it_has_and_its_next_fetch_goes_through_the_script() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    fill(&mut c, "a", 3);
    let f = fetcher(&redis, &["a"], ME).await;
    let got = f.retrieve_work(10).await.unwrap();
    assert_eq!(jids(&got), named(0, 3));
    assert!(
        !c.exists::<_, bool>("queue:a").unwrap(),
        "the queue emptied"
    );
    assert_eq!((calls(&mut c, "multi"), calls(&mut c, "evalsha")), (1, 0));
    assert_eq!(held_jids(&mut c, ME), named(0, 3));
    // Short last time: the script.
    let _: () = c.lpush("queue:a", job("b0", "a")).unwrap();
    let got = f.retrieve_work(10).await.unwrap();
    assert_eq!(jids(&got), ["b0"]);
    assert_eq!((calls(&mut c, "multi"), calls(&mut c, "evalsha")), (1, 1));
    // The script finds more than the batch: the fast path again, and the rest stays queued.
    for i in 0..12 {
        let _: () = c.lpush("queue:a", job(&format!("c{i}"), "a")).unwrap();
    }
    let got = f.retrieve_work(5).await.unwrap();
    assert_eq!(jids(&got), ["c0", "c1", "c2", "c3", "c4"]);
    assert_eq!((calls(&mut c, "multi"), calls(&mut c, "evalsha")), (1, 2));
    let got = f.retrieve_work(5).await.unwrap();
    assert_eq!(jids(&got), ["c5", "c6", "c7", "c8", "c9"]);
    assert_eq!((calls(&mut c, "multi"), calls(&mut c, "evalsha")), (2, 2));
    assert_eq!(list_jids(&mut c, "queue:a"), ["c11", "c10"]);
}

/// A queue key of the wrong type met by the fast path (a set or a sorted set, whose members `SORT`
/// copies; a hash, which `SORT` refuses): the key is untouched, no copy of its members stays in a
/// batch list or is handed out, the queue is paused, and the same fetch serves the other queues.
#[tokio::test]
async fn a_wrong_type_queue_key_met_by_the_fast_path_is_untouched_and_stalls_alone() {
    for kind in ["set", "zset", "hash"] {
        let redis = support::RedisServer::start();
        let mut c = redis.conn();
        match kind {
            "set" => c.sadd::<_, _, ()>("queue:a", job("s0", "a")).unwrap(),
            "zset" => c.zadd::<_, _, _, ()>("queue:a", job("z0", "a"), 1).unwrap(),
            _ => c
                .hset::<_, _, _, ()>("queue:a", "f", job("h0", "a"))
                .unwrap(),
        }
        fill(&mut c, "b", 2);
        let f = fetcher(&redis, &["a", "b"], ME).await;
        let got = f.retrieve_work(10).await.unwrap();
        assert_eq!(jids(&got), ["b0", "b1"], "{kind}");
        assert_eq!(calls(&mut c, "multi"), 1, "{kind}: the fast path was tried");
        let t: String = redis::cmd("TYPE").arg("queue:a").query(&mut c).unwrap();
        assert_eq!(t, kind, "untouched");
        assert_eq!(held_jids(&mut c, ME), ["b0", "b1"], "{kind}: no copy held");
        let lists: Vec<String> = c.keys(format!("oxidekiq:batch:{ME}:a:*")).unwrap();
        assert!(lists.is_empty(), "{kind}: {lists:?}");
        // Paused: the next round does not try it.
        fill(&mut c, "b", 1);
        let got = f.retrieve_work(10).await.unwrap();
        assert_eq!(jids(&got), ["b0"], "{kind}");
        assert_eq!(calls(&mut c, "multi"), 1, "{kind}: paused");
    }
}

/// A Redis whose ACL refuses a command of the fast path (`SORT`, `EVAL` or `EXEC`: the transaction is refused
/// before it runs; `MEMORY`, inside the guard: the copy is deleted, the queue untouched) serves each
/// job once, in order, through the batch script, and the process does not try the fast path again.
#[tokio::test]
async fn a_refused_command_of_the_fast_path_switches_the_process_to_the_script_for_good() {
    for command in ["sort", "eval", "memory", "exec"] {
        let redis = support::RedisServer::start();
        let mut c = redis.conn();
        fill(&mut c, "a", 7);
        let f = limited_fetcher(&redis, &mut c, command).await;
        let mut got = f.retrieve_work(3).await.unwrap();
        got.extend(f.retrieve_work(3).await.unwrap());
        got.extend(f.retrieve_work(3).await.unwrap());
        assert_eq!(jids(&got), named(0, 7), "{command}: each once, in order");
        assert_eq!(calls(&mut c, "multi"), 1, "{command}: tried once");
        assert!(calls(&mut c, "evalsha") >= 3, "{command}: then the script");
        assert_eq!(held_jids(&mut c, ME), named(0, 7), "{command}");
        assert!(!c.exists::<_, bool>("queue:a").unwrap(), "{command}");
    }
}

/// Payloads over the limit in a batch the fast path copied: the guard sees the copy is too big, puts
/// the batch back in its queue unread, and the batch script reads that queue job by job: the small
/// jobs go out in order, the big ones to the dead set, and Redis never sends a big one to oxidekiq
/// (its count of bytes sent stays far below one of them). The queue's next fetches skip the fast path.
#[tokio::test]
async fn payloads_over_the_limit_in_a_fast_batch_go_to_the_dead_set_unread() {
    const MB: usize = 1 << 20;
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let big = |jid: &str| {
        format!(
            r#"{{"class":"A","args":["{}"],"jid":"{jid}","queue":"a"}}"#,
            "x".repeat(4 * MB)
        )
    };
    for jid in ["s0", "big0", "s1", "big1", "s2"] {
        let payload = if jid.starts_with("big") {
            big(jid)
        } else {
            job(jid, "a")
        };
        let _: () = c.lpush("queue:a", payload).unwrap();
    }
    let f = fetcher(&redis, &["a"], ME).await.with_payload_limit(
        MB,
        std::sync::Arc::new(oxidekiq::fleet::Fleet::new(Some(TimeFormat::Seconds))),
    );
    let before = sent_bytes(&mut c);
    let got = f.retrieve_work(10).await.unwrap();
    let sent = sent_bytes(&mut c) - before;
    assert_eq!(jids(&got), ["s0", "s1", "s2"]);
    assert_eq!(calls(&mut c, "multi"), 1, "the fast path was tried");
    assert!(sent < MB as u64 / 2, "redis sent {sent} bytes");
    assert_eq!(f.take_dead(), 2);
    let dead: Vec<String> = c.zrange("dead", 0, -1).unwrap();
    let mut dead_jids: Vec<String> = dead.iter().map(|m| jid_of(m.as_bytes())).collect();
    dead_jids.sort();
    assert_eq!(dead_jids, ["big0", "big1"]);
    assert_eq!(held_jids(&mut c, ME), ["s0", "s1", "s2"]);
    assert!(!c.exists::<_, bool>("queue:a").unwrap());
    // Read job by job last time: the script again, not a transaction whose copy the guard would only delete.
    fill(&mut c, "a", 3);
    let got = f.retrieve_work(10).await.unwrap();
    assert_eq!(jids(&got), named(0, 3));
    assert_eq!(calls(&mut c, "multi"), 1);
}

/// A queue on a server that compresses lists (`list-compress-depth 1`: every node but the first and last
/// is LZF-compressed): small jobs of 9 KB each (a node each), and between them one of 4 MiB of one
/// repeated character, whose node counts about 48 KB in `MEMORY USAGE`. Returns the queue's `MEMORY
/// USAGE`, which proves the server compresses it (far below the big payload's own length).
fn push_compressible(c: &mut redis::Connection) -> usize {
    const MB: usize = 1 << 20;
    for jid in ["s0", "s1", "big0", "s2", "s3"] {
        let pad = if jid.starts_with("big") {
            4 * MB
        } else {
            9_000
        };
        let payload = format!(
            r#"{{"class":"A","args":["{}"],"jid":"{jid}","queue":"a"}}"#,
            "x".repeat(pad)
        );
        let _: () = c.lpush("queue:a", payload).unwrap();
    }
    redis::cmd("MEMORY")
        .arg("USAGE")
        .arg("queue:a")
        .arg("SAMPLES")
        .arg(0)
        .query(c)
        .unwrap()
}

/// Issue 43 item 4: with lists compressed (`list-compress-depth` > 0), `MEMORY USAGE` of a batch copy
/// counts its compressed bytes: on Valkey 9.1, whose `SORT .. STORE` builds a compressed list, a 4 MiB
/// payload passed a 1 MiB limit and went out. The fetcher reads `list-compress-depth` and holds a copy
/// to the limit over the LZF ratio, so the big payload goes to the dead set unread, on the fast path's
/// fetch and on the batch script's alike (`script`), and when the server refuses `CONFIG GET`
/// (`refused`: the fetcher assumes compression). Redis sends far less than the big payload.
async fn a_compressed_list_holds_no_payload_over_the_limit(script: bool, refused: bool) {
    const MB: usize = 1 << 20;
    let redis = support::RedisServer::start_with(&["--list-compress-depth", "1"]);
    let mut c = redis.conn();
    let mem = push_compressible(&mut c);
    assert!(mem < 2 * MB, "the server compresses lists: {mem} bytes");
    let f = if refused {
        limited_fetcher(&redis, &mut c, "config").await
    } else {
        fetcher(&redis, &["a"], ME).await
    };
    let f = if script { f.script_only() } else { f };
    let f = f.with_payload_limit(
        MB,
        std::sync::Arc::new(oxidekiq::fleet::Fleet::new(Some(TimeFormat::Seconds))),
    );
    let before = sent_bytes(&mut c);
    // Batches held to 1 MiB / 88 of `MEMORY USAGE` take these 9 KB jobs one or two at a time.
    let mut got = Vec::new();
    for _ in 0..20 {
        got.extend(jids(&f.retrieve_work(10).await.unwrap()));
        if got.len() == 4 {
            break;
        }
    }
    let sent = sent_bytes(&mut c) - before;
    assert_eq!(got, ["s0", "s1", "s2", "s3"]);
    assert!(sent < MB as u64 / 2, "redis sent {sent} bytes");
    assert_eq!(f.take_dead(), 1);
    let dead: Vec<String> = c.zrange("dead", 0, -1).unwrap();
    let dead_jids: Vec<String> = dead.iter().map(|m| jid_of(m.as_bytes())).collect();
    assert_eq!(dead_jids, ["big0"]);
    assert_eq!(held_jids(&mut c, ME), ["s0", "s1", "s2", "s3"]);
    assert!(!c.exists::<_, bool>("queue:a").unwrap());
}

#[tokio::test]
async fn a_compressed_list_sends_no_payload_over_the_limit_through_the_fast_path() {
    a_compressed_list_holds_no_payload_over_the_limit(false, false).await;
}

#[tokio::test]
async fn a_compressed_list_sends_no_payload_over_the_limit_through_the_batch_script() {
    a_compressed_list_holds_no_payload_over_the_limit(true, false).await;
}

#[tokio::test]
async fn a_compressed_list_sends_no_payload_over_the_limit_when_config_get_is_refused() {
    a_compressed_list_holds_no_payload_over_the_limit(false, true).await;
}

/// Bytes Redis has sent to its clients (`INFO stats` `total_net_output_bytes`).
fn sent_bytes(c: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("stats").query(c).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("total_net_output_bytes:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

/// A fast fetch whose reply is lost after Redis ran it (a proxy drops Redis's replies, the fetch is
/// dropped unanswered once Redis ran it): its list goes back whole at the reconcile, once, and the
/// queue serves its jobs in their order again.
#[tokio::test]
async fn a_fast_fetch_whose_reply_is_lost_goes_back_once_in_order() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    fill(&mut c, "a", 6);
    let trap = ReplyTrap::start(&redis).await;
    let f = fetcher_via(&redis, &["a"], ME, &trap).await;
    lose_a_fetch(&mut c, &f, &trap).await;
    assert_eq!(calls(&mut c, "multi"), 1, "through the fast path");
    assert_eq!(held_jids(&mut c, ME), named(0, 6));
    assert_eq!(f.outstanding(), 0, "nothing handed out");
    assert_eq!(f.reconcile().await.unwrap(), 6);
    assert_eq!(f.reconcile().await.unwrap(), 0, "once");
    let keys: Vec<String> = c.keys("oxidekiq:*").unwrap();
    assert!(keys.is_empty(), "{keys:?}");
    let got = f.retrieve_work(10).await.unwrap();
    assert_eq!(jids(&got), named(0, 6));
}

/// A job left in this process's landing list by a blocking wait whose fetch was dropped (the job
/// landed after the wait was no longer awaited) is fetched first, by the batch script, before the fast
/// path (which does not look at landing lists) takes the queue's backlog, even when the queue is
/// expected to fill the batch.
#[tokio::test]
async fn a_job_left_in_a_landing_list_is_served_before_the_fast_path_resumes() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let (conn, blocking) = conns(&redis).await;
    let f = Reliable::new(&queues(&["a"]), ME, conn, blocking, Duration::from_secs(3))
        .dialing(dialer(&redis.url()));
    // The queue is empty: the fetch finds nothing (the fast path, then the script) and blocks on
    // `BLMOVE`, and is dropped while Redis still waits.
    let waited = tokio::time::timeout(Duration::from_millis(300), f.retrieve_work(5)).await;
    assert!(waited.is_err(), "the fetch blocked");
    assert_eq!((calls(&mut c, "multi"), calls(&mut c, "evalsha")), (1, 1));
    let _: () = c.lpush("queue:a", job("landed", "a")).unwrap();
    let moved = support::wait_until(Duration::from_secs(5), || {
        c.llen::<_, usize>(landing(ME, "a")).unwrap() == 1
    });
    assert!(moved, "the dropped wait's BLMOVE ran");
    fill(&mut c, "a", 8);
    // Another fetch loop's look (which did not see the landing list yet) found the queue full.
    f.expect_full("a");
    let got = f.retrieve_work(5).await.unwrap();
    assert_eq!(jids(&got), ["landed", "a0", "a1", "a2", "a3"]);
    assert_eq!(
        (calls(&mut c, "multi"), calls(&mut c, "evalsha")),
        (1, 2),
        "the script, which looks at the landing list"
    );
    let got = f.retrieve_work(3).await.unwrap();
    assert_eq!(jids(&got), named(4, 7));
    assert_eq!(calls(&mut c, "multi"), 2, "then the fast path");
}

/// Pushes `n` jobs `a0`, `a1`, ... to queue `a`, each padded by an argument of `pad` bytes.
fn push_padded(c: &mut redis::Connection, n: usize, pad: usize) {
    for i in 0..n {
        let payload = format!(
            r#"{{"class":"A","args":["{}"],"jid":"a{i}","queue":"a"}}"#,
            "x".repeat(pad)
        );
        let _: () = c.lpush("queue:a", payload).unwrap();
    }
}

/// Big payloads make smaller fast-path batches: a batch's copy costs Redis more per job the bigger it
/// is, so once a batch shows the queue's jobs are 20 KB each, the next asks for about 1 MiB of them (64
/// jobs would be more), not every free slot; the jobs still go out in order, none twice.
#[tokio::test]
async fn a_queue_of_big_payloads_is_fetched_in_batches_of_about_a_megabyte() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    push_padded(&mut c, 300, 20_000);
    let f = fetcher(&redis, &["a"], ME).await;
    let first = f.retrieve_work(100).await.unwrap();
    assert_eq!(jids(&first), named(0, 100), "no size known yet: every slot");
    let second = f.retrieve_work(100).await.unwrap();
    assert!(
        (40..=52).contains(&second.len()),
        "{} jobs of 20 KB",
        second.len()
    );
    assert_eq!(jids(&second), named(100, 100 + second.len()));
    assert_eq!(calls(&mut c, "multi"), 2, "both through the fast path");
}

/// A queue whose batch of every free slot would pass the payload limit though no job does (200 jobs of
/// 100 KB: 20 MB against a 16 MiB limit): the first copy is deleted (the queue untouched), and from then on the queue goes
/// out in batches of about 1 MiB, copied whole (the script's, then the fast path's), not read job by
/// job through Lua; in order, none to the dead set.
#[tokio::test]
async fn a_queue_whose_full_batch_passes_the_limit_goes_out_in_smaller_batches_copied_whole() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    push_padded(&mut c, 220, 100_000);
    let f = fetcher(&redis, &["a"], ME).await.with_payload_limit(
        16 * 1024 * 1024,
        std::sync::Arc::new(oxidekiq::fleet::Fleet::new(Some(TimeFormat::Seconds))),
    );
    let first = f.retrieve_work(200).await.unwrap();
    assert!((8..=12).contains(&first.len()), "{}", first.len());
    assert_eq!(jids(&first), named(0, first.len()));
    assert_eq!(
        calls(&mut c, "multi"),
        1,
        "tried; the copy deleted, the queue untouched"
    );
    let second = f.retrieve_work(200).await.unwrap();
    assert_eq!(
        jids(&second),
        named(first.len(), first.len() + second.len())
    );
    // The script found the queue full by a whole copy (read job by job, it would not have).
    assert_eq!(calls(&mut c, "multi"), 2, "the fast path again");
    assert_eq!(f.take_dead(), 0);
}

/// A TCP proxy in front of `redis` that, once armed, holds back the bytes of the first `EXEC` it sees
/// from the client (everything before it goes on): the transaction is queued in Redis and waits for
/// its `EXEC` until the test releases it, so a change made meanwhile (an ACL) lands between the
/// queueing and the run of the transaction, as it may when a pipeline reaches Redis in two reads.
struct ExecGate {
    url: String,
    /// Sends the "held" signal's sender and the release's receiver to the proxy.
    arm: tokio::sync::mpsc::UnboundedSender<Gate>,
}

/// The proxy's signal that it holds an `EXEC`, and the test's release of it.
type Gate = (
    tokio::sync::oneshot::Sender<()>,
    tokio::sync::oneshot::Receiver<()>,
);

impl ExecGate {
    async fn start(redis: &support::RedisServer) -> ExecGate {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("redis://{}", listener.local_addr().unwrap());
        let target = redis.url().trim_start_matches("redis://").to_string();
        let (arm, armed) = tokio::sync::mpsc::unbounded_channel::<Gate>();
        let armed = std::sync::Arc::new(tokio::sync::Mutex::new(armed));
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(&target).await.unwrap();
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                tokio::spawn(async move { tokio::io::copy(&mut sr, &mut cw).await });
                let armed = armed.clone();
                tokio::spawn(async move {
                    const EXEC: &[u8] = b"*1\r\n$4\r\nEXEC\r\n";
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match cr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        let chunk = &buf[..n];
                        let at = chunk.windows(EXEC.len()).position(|w| w == EXEC);
                        let gate = match at {
                            Some(_) => armed.lock().await.try_recv().ok(),
                            None => None,
                        };
                        match (at, gate) {
                            (Some(at), Some((held, release))) => {
                                sw.write_all(&chunk[..at]).await.unwrap();
                                sw.flush().await.unwrap();
                                let _ = held.send(());
                                let _ = release.await;
                                sw.write_all(&chunk[at..]).await.unwrap();
                            }
                            _ => sw.write_all(chunk).await.unwrap(),
                        }
                    }
                });
            }
        });
        ExecGate { url, arm }
    }
}

/// An ACL that comes to refuse `SORT` while a fast fetch's transaction is queued (an operator applying
/// `-@dangerous` to a running worker's user; a pipeline that reaches Redis in two reads leaves that
/// window): Redis runs the transaction's other commands and answers the `SORT` with `NOPERM`. No job
/// may leave the queue without its copy in a batch list: every job is fetched once, or still queued.
#[tokio::test]
async fn a_sort_refused_when_the_fast_transaction_runs_removes_no_job_from_its_queue() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    fill(&mut c, "a", 5);
    let gate = ExecGate::start(&redis).await;
    let client = redis::Client::open(gate.url.as_str()).unwrap();
    let conn = oxidekiq::redis_conn::connect(&client).await.unwrap();
    let (_, blocking) = conns(&redis).await;
    let f = std::sync::Arc::new(
        Reliable::new(
            &queues(&["a"]),
            ME,
            conn,
            blocking,
            Duration::from_millis(200),
        )
        .dialing(dialer(&gate.url)),
    );
    let (held_tx, held_rx) = tokio::sync::oneshot::channel();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel();
    gate.arm.send((held_tx, release_rx)).unwrap();
    let fetch = tokio::spawn({
        let f = f.clone();
        async move { f.retrieve_work(5).await }
    });
    tokio::time::timeout(Duration::from_secs(10), held_rx)
        .await
        .expect("the fast fetch's EXEC reached the proxy")
        .unwrap();
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg("-sort")
        .query(&mut c)
        .unwrap();
    release_tx.send(()).unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), fetch)
        .await
        .unwrap()
        .unwrap();
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg("+@all")
        .query(&mut c)
        .unwrap();
    assert_eq!(calls(&mut c, "multi"), 1, "through the fast path");
    let mut all = got.map(|u| jids(&u)).unwrap_or_default();
    let held = held_jids(&mut c, ME);
    assert_eq!(all, held, "every job fetched is held");
    all.extend(drain(&mut c, "a"));
    all.sort();
    assert_eq!(all, named(0, 5), "each job fetched or queued, once");
}

/// How many times Redis refused `command` before running it (`INFO commandstats`' `rejected_calls`:
/// an ACL's refusal).
fn rejected(c: &mut redis::Connection, command: &str) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(c).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:")))
        .and_then(|l| {
            l.split(',')
                .find_map(|f| f.strip_prefix("rejected_calls="))
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0)
}

/// Review of issue 42: a Redis whose ACL refuses `MULTI` itself runs the fast path's other commands
/// one by one, outside any transaction (the copy made, the queue trimmed, the copy read) and answers
/// its `EXEC` "without MULTI". Before, that fetch failed with its jobs in a list nobody ran, and so did
/// every later one, until the whole queue sat in this process's lists and no job ran. Now the copy goes
/// back at once, the process switches to the batch script for good, and each job is served once, in
/// order.
#[tokio::test]
async fn a_refused_multi_puts_the_copy_back_and_switches_to_the_script_for_good() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    fill(&mut c, "a", 7);
    let f = limited_fetcher(&redis, &mut c, "multi").await;
    let mut got = f.retrieve_work(3).await.unwrap();
    got.extend(f.retrieve_work(3).await.unwrap());
    got.extend(f.retrieve_work(3).await.unwrap());
    assert_eq!(jids(&got), named(0, 7), "each once, in order");
    assert_eq!(rejected(&mut c, "multi"), 1, "the fast path tried once");
    assert!(calls(&mut c, "evalsha") >= 3, "then the script");
    assert_eq!(
        held_jids(&mut c, ME),
        named(0, 7),
        "only the jobs handed out are held"
    );
    assert!(!c.exists::<_, bool>("queue:a").unwrap());
    f.acknowledge(&got).await.unwrap();
    let keys: Vec<String> = c.keys("oxidekiq:batch:*").unwrap();
    assert!(keys.is_empty(), "nothing stranded: {keys:?}");
}
