//! The lock batcher against a real redis-server: many concurrent acquires and releases, contention on
//! one key, `NOSCRIPT` after `SCRIPT FLUSH`, Redis refusing a batch, releases not waited for (their
//! order before later acquires, and the flush a stop waits on).
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::test_support::RedisServer;

fn get(c: &mut redis::Connection, key: &str) -> Option<String> {
    redis::cmd("GET").arg(key).query(c).unwrap()
}

fn acq(key: &str, value: &str) -> Acquire {
    acquire_req(key, value, Duration::from_secs(30))
}

fn rel(key: &str, token: &str) -> Release {
    Release {
        key: key.to_string(),
        token: token.to_string(),
    }
}

/// Runs `f(i)` for every `i` in `0..n`, each as its own task, all at once; their results in order.
async fn concurrently<T, F, Fut>(n: usize, f: F) -> Vec<T>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let tasks: Vec<_> = (0..n).map(|i| tokio::spawn(f(i))).collect();
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_acquires_and_releases_each_get_their_own_answer() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let locks = Locks::new(conn.clone());
    let n = 300;
    let acquires = concurrently(n, |i| {
        let (conn, locks) = (conn.clone(), locks.clone());
        async move {
            let key = format!("oxidekiq:lock:many:{i}");
            locks
                .batcher()
                .acquire(&conn, acq(&key, &format!("tok{i}:jid{i}")))
                .await
        }
    })
    .await;
    for a in acquires {
        assert!(a.unwrap(), "every key was free");
    }
    let mut c = server.conn();
    for i in 0..n {
        let key = format!("oxidekiq:lock:many:{i}");
        assert_eq!(get(&mut c, &key), Some(format!("tok{i}:jid{i}")));
        let pttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut c).unwrap();
        assert!(pttl > 0 && pttl <= 30_000, "pttl {pttl}");
    }
    // Every other release carries a wrong token: those delete nothing and say so.
    let releases = concurrently(n, |i| {
        let (conn, locks) = (conn.clone(), locks.clone());
        async move {
            let key = format!("oxidekiq:lock:many:{i}");
            let token = if i % 2 == 0 {
                format!("tok{i}:jid{i}")
            } else {
                "someone-else".to_string()
            };
            locks.batcher().release(&conn, rel(&key, &token)).await
        }
    })
    .await;
    for (i, r) in releases.into_iter().enumerate() {
        assert_eq!(r.unwrap(), i % 2 == 0, "release {i}");
    }
    for i in 0..n {
        let key = format!("oxidekiq:lock:many:{i}");
        let expected = (i % 2 == 1).then(|| format!("tok{i}:jid{i}"));
        assert_eq!(get(&mut c, &key), expected, "key {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contention_on_one_key_has_exactly_one_winner_and_only_it_releases() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let locks = Locks::new(conn.clone());
    let key = "oxidekiq:lock:contended";
    let n = 100;
    let tries = concurrently(n, |i| {
        let (conn, locks) = (conn.clone(), locks.clone());
        async move {
            let req = acq(key, &format!("tok{i}"));
            locks.batcher().acquire(&conn, req).await
        }
    })
    .await;
    let winners: Vec<usize> = (0..n).filter(|&i| *tries[i].as_ref().unwrap()).collect();
    assert_eq!(winners.len(), 1, "winners {winners:?}");
    let winner = winners[0];
    let mut c = server.conn();
    assert_eq!(get(&mut c, key), Some(format!("tok{winner}")));

    let releases = concurrently(n, |i| {
        let (conn, locks) = (conn.clone(), locks.clone());
        async move {
            let req = rel(key, &format!("tok{i}"));
            locks.batcher().release(&conn, req).await
        }
    })
    .await;
    let released: Vec<usize> = (0..n).filter(|&i| *releases[i].as_ref().unwrap()).collect();
    assert_eq!(released, vec![winner]);
    assert_eq!(get(&mut c, key), None);
}

#[tokio::test]
async fn two_acquires_and_two_releases_of_one_key_in_one_batch_behave_as_one_at_a_time() {
    let server = RedisServer::start();
    let mut conn = server.async_conn().await;
    let key = "oxidekiq:lock:twice";
    let got: Vec<bool> = acquire_batch(&mut conn, &[acq(key, "a"), acq(key, "b")])
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert_eq!(got, vec![true, false]);
    let gone = release_batch(&mut conn, &[rel(key, "b"), rel(key, "a"), rel(key, "a")])
        .await
        .unwrap();
    assert_eq!(gone, vec![false, true, false]);
    assert_eq!(get(&mut server.conn(), key), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_falls_back_to_eval_after_script_flush() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let mut c = server.conn();
    let exists = |c: &mut redis::Connection| -> Vec<i64> {
        redis::cmd("SCRIPT")
            .arg("EXISTS")
            .arg(&*RELEASE_MANY_SHA)
            .query(c)
            .unwrap()
    };
    let locks = Locks::new(conn.clone());
    let batcher = locks.batcher();
    for round in 0..3 {
        let key = format!("oxidekiq:lock:flush:{round}");
        assert!(batcher.acquire(&conn, acq(&key, "t")).await.unwrap());
        if round == 1 {
            let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut c).unwrap();
            assert_eq!(exists(&mut c), vec![0]);
        }
        assert!(batcher.release(&conn, rel(&key, "t")).await.unwrap());
        assert_eq!(get(&mut c, &key), None, "round {round}");
        // EVAL cached the script again, so the next EVALSHA finds it.
        assert_eq!(exists(&mut c), vec![1], "round {round}");
    }
}

/// A batch already queued in full before its task first runs: the test knows exactly what one batch
/// holds.
async fn one_batch(
    conn: Conn,
    releases: Vec<Release>,
    acquires: Vec<Acquire>,
) -> Vec<Result<bool>> {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut answers = Vec::new();
    for r in releases {
        let (reply, answer) = oneshot::channel();
        tx.send(Request::Release(r, Outcome::Caller(reply)))
            .unwrap();
        answers.push(answer);
    }
    let mut acquired = Vec::new();
    for a in acquires {
        let (reply, answer) = oneshot::channel();
        tx.send(Request::Acquire(a, reply)).unwrap();
        acquired.push(answer);
    }
    drop(tx);
    run(conn, rx).await;
    let mut out = Vec::new();
    for a in answers {
        out.push(a.await.unwrap());
    }
    for a in acquired {
        out.push(a.await.unwrap().0);
    }
    out
}

/// `ACL SETUSER default <rule>`: `-del` makes the release script fail in Redis (its `DEL` is refused),
/// `+del` undoes it.
fn acl_del(c: &mut redis::Connection, rule: &str) {
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg(rule)
        .query(c)
        .unwrap();
}

#[tokio::test]
async fn a_release_script_that_fails_answers_every_caller_with_the_error_and_acquires_still_run() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let mut c = server.conn();
    for k in ["oxidekiq:lock:a", "oxidekiq:lock:b"] {
        let _: () = redis::cmd("SET").arg(k).arg("t").query(&mut c).unwrap();
    }
    acl_del(&mut c, "-del");
    let answers = one_batch(
        conn,
        vec![rel("oxidekiq:lock:a", "t"), rel("oxidekiq:lock:b", "t")],
        vec![acq("oxidekiq:lock:new", "n")],
    )
    .await;
    acl_del(&mut c, "+del");
    assert_eq!(answers.len(), 3);
    for (i, a) in answers[..2].iter().enumerate() {
        let e = a
            .as_ref()
            .expect_err("no caller of a failed release is told released");
        assert!(
            e.to_string().contains("can't run this command"),
            "caller {i}: {e}"
        );
    }
    // The acquire in the same pipeline is its own command: it ran and says so.
    assert!(*answers[2].as_ref().unwrap());
    assert_eq!(get(&mut c, "oxidekiq:lock:a").as_deref(), Some("t"));
    assert_eq!(get(&mut c, "oxidekiq:lock:b").as_deref(), Some("t"));
    assert_eq!(get(&mut c, "oxidekiq:lock:new").as_deref(), Some("n"));
}

#[tokio::test]
async fn a_key_of_another_type_holds_no_token_so_it_is_not_released_and_the_others_are() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let mut c = server.conn();
    for k in ["oxidekiq:lock:a", "oxidekiq:lock:c"] {
        let _: () = redis::cmd("SET").arg(k).arg("t").query(&mut c).unwrap();
    }
    let _: () = redis::cmd("HSET")
        .arg("oxidekiq:lock:b")
        .arg("f")
        .arg("v")
        .query(&mut c)
        .unwrap();
    let reqs = vec![
        rel("oxidekiq:lock:a", "t"),
        rel("oxidekiq:lock:b", "t"),
        rel("oxidekiq:lock:c", "t"),
    ];
    let answers = one_batch(conn, reqs, Vec::new()).await;
    let answers: Vec<bool> = answers.into_iter().map(|a| a.unwrap()).collect();
    assert_eq!(answers, [true, false, true]);
    assert_eq!(get(&mut c, "oxidekiq:lock:a"), None);
    assert_eq!(get(&mut c, "oxidekiq:lock:c"), None);
    let kind: String = redis::cmd("TYPE")
        .arg("oxidekiq:lock:b")
        .query(&mut c)
        .unwrap();
    assert_eq!(kind, "hash");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detached_release_is_in_redis_once_flush_returns() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let mut c = server.conn();
    let n = 300;
    let locks = Locks::new(conn.clone());
    let batcher = locks.batcher();
    for i in 0..n {
        let key = format!("oxidekiq:lock:flush:{i}");
        assert!(batcher.acquire(&conn, acq(&key, "t")).await.unwrap());
    }
    for i in 0..n {
        let key = format!("oxidekiq:lock:flush:{i}");
        batcher.release_detached(&conn, rel(&key, "t")).await;
    }
    locks.flush().await;
    // Read at once, not waited for: flush returned only after every queued release had its reply.
    let left: Vec<String> = redis::cmd("KEYS")
        .arg("oxidekiq:lock:flush:*")
        .query(&mut c)
        .unwrap();
    assert_eq!(left, Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_queued_after_a_detached_release_of_its_key_finds_it_free_even_after_script_flush()
 {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let mut c = server.conn();
    let locks = Locks::new(conn.clone());
    let batcher = locks.batcher();
    for round in 0..200 {
        let key = format!("oxidekiq:lock:order:{}", round % 7);
        if round % 50 == 25 {
            // Redis forgets the script: the release goes again with EVAL, after this batch's SETs.
            let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut c).unwrap();
        }
        let held = format!("held{round}");
        assert!(
            batcher.acquire(&conn, acq(&key, &held)).await.unwrap(),
            "round {round}"
        );
        // One job ends and the next of its key starts at once, in the order a slot does it.
        batcher.release_detached(&conn, rel(&key, &held)).await;
        let next = format!("next{round}");
        assert!(
            batcher.acquire(&conn, acq(&key, &next)).await.unwrap(),
            "round {round}: the release queued first was sent after the acquire"
        );
        batcher.release_detached(&conn, rel(&key, &next)).await;
    }
    locks.flush().await;
    let left: Vec<String> = redis::cmd("KEYS")
        .arg("oxidekiq:lock:order:*")
        .query(&mut c)
        .unwrap();
    assert_eq!(left, Vec::<String>::new());
}

#[tokio::test]
async fn a_release_and_an_acquire_of_one_key_in_one_batch_release_first_even_on_noscript() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let mut c = server.conn();
    for (round, flush) in [(0, false), (1, true)] {
        let key = format!("oxidekiq:lock:same:{round}");
        let _: () = redis::cmd("SET")
            .arg(&key)
            .arg("old")
            .query(&mut c)
            .unwrap();
        if flush {
            let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut c).unwrap();
        }
        let answers = one_batch(conn.clone(), vec![rel(&key, "old")], vec![acq(&key, "new")]).await;
        let answers: Vec<bool> = answers.into_iter().map(|a| a.unwrap()).collect();
        assert_eq!(answers, [true, true], "round {round}");
        assert_eq!(get(&mut c, &key).as_deref(), Some("new"), "round {round}");
    }
}

#[tokio::test]
async fn an_acquire_batch_that_redis_refuses_answers_every_caller_with_the_error() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let mut c = server.conn();
    // Out of memory and no eviction: Redis refuses every write.
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("noeviction")
        .query(&mut c)
        .unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("1")
        .query(&mut c)
        .unwrap();
    let reqs = (0..5)
        .map(|i| acq(&format!("oxidekiq:lock:oom:{i}"), "t"))
        .collect();
    let answers = one_batch(conn, Vec::new(), reqs).await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("0")
        .query(&mut c)
        .unwrap();
    assert_eq!(answers.len(), 5);
    for (i, a) in answers.iter().enumerate() {
        let e = a
            .as_ref()
            .expect_err("no caller of a refused batch is told acquired");
        assert!(e.to_string().contains("OOM"), "caller {i}: {e}");
    }
    for i in 0..5 {
        assert_eq!(get(&mut c, &format!("oxidekiq:lock:oom:{i}")), None);
    }
}

#[tokio::test]
async fn a_set_redis_refuses_fails_only_its_own_acquire() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let mut c = server.conn();
    // A TTL Redis cannot take (`PX` past its range): that one `SET` is refused, the others beside it
    // in the same pipeline succeed and must be told so, or their jobs fail holding a lock.
    let bad = Acquire {
        ttl_ms: u64::MAX,
        ..acq("oxidekiq:lock:refused", "t")
    };
    let reqs = vec![
        acq("oxidekiq:lock:before", "t"),
        bad,
        acq("oxidekiq:lock:after", "t"),
    ];
    let answers = one_batch(conn, Vec::new(), reqs).await;
    assert!(matches!(answers[0], Ok(true)), "{:?}", answers[0]);
    // Redis's own words for it vary by version ("out of range", "invalid expire time").
    assert!(answers[1].is_err(), "the refused SET is an error");
    assert!(matches!(answers[2], Ok(true)), "{:?}", answers[2]);
    assert_eq!(get(&mut c, "oxidekiq:lock:before").as_deref(), Some("t"));
    assert_eq!(get(&mut c, "oxidekiq:lock:after").as_deref(), Some("t"));
    assert_eq!(get(&mut c, "oxidekiq:lock:refused"), None);
}

#[tokio::test]
async fn without_its_task_a_batcher_sends_each_command_itself() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let (queue, _) = mpsc::unbounded_channel();
    // The receiver dropped: as after the runtime that ran the task shut down.
    let batcher = Arc::new(Batcher { queue });
    let solo = "oxidekiq:lock:solo";
    assert!(batcher.acquire(&conn, acq(solo, "t")).await.unwrap());
    assert!(!batcher.acquire(&conn, acq(solo, "u")).await.unwrap());
    assert!(!batcher.release(&conn, rel(solo, "u")).await.unwrap());
    assert!(batcher.release(&conn, rel(solo, "t")).await.unwrap());
    assert_eq!(get(&mut server.conn(), solo), None);
    assert!(batcher.acquire(&conn, acq(solo, "v")).await.unwrap());
    // Detached, with nobody to queue it for: sent before returning.
    batcher.release_detached(&conn, rel(solo, "v")).await;
    assert_eq!(get(&mut server.conn(), solo), None);
    batcher.flush().await;
}
