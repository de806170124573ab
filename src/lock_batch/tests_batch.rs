//! The lock batcher against a real redis-server: many concurrent acquires and releases, contention on
//! one key, `NOSCRIPT` after `SCRIPT FLUSH`, and a Redis error in the middle of a batch.
use std::sync::Arc;

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
    let n = 300;
    let acquires = concurrently(n, |i| {
        let conn = conn.clone();
        async move {
            let key = format!("oxidekiq:lock:many:{i}");
            conn.lock_batcher()
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
        let conn = conn.clone();
        async move {
            let key = format!("oxidekiq:lock:many:{i}");
            let token = if i % 2 == 0 {
                format!("tok{i}:jid{i}")
            } else {
                "someone-else".to_string()
            };
            conn.lock_batcher().release(&conn, rel(&key, &token)).await
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
    let key = "oxidekiq:lock:contended";
    let n = 100;
    let tries = concurrently(n, |i| {
        let conn = conn.clone();
        async move {
            let req = acq(key, &format!("tok{i}"));
            conn.lock_batcher().acquire(&conn, req).await
        }
    })
    .await;
    let winners: Vec<usize> = (0..n).filter(|&i| *tries[i].as_ref().unwrap()).collect();
    assert_eq!(winners.len(), 1, "winners {winners:?}");
    let winner = winners[0];
    let mut c = server.conn();
    assert_eq!(get(&mut c, key), Some(format!("tok{winner}")));

    let releases = concurrently(n, |i| {
        let conn = conn.clone();
        async move {
            let req = rel(key, &format!("tok{i}"));
            conn.lock_batcher().release(&conn, req).await
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
    let got = acquire_batch(&mut conn, &[acq(key, "a"), acq(key, "b")])
        .await
        .unwrap();
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
    let batcher = conn.lock_batcher();
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
async fn one_batch<R, F>(conn: Conn, reqs: Vec<R>, exec: F) -> Vec<Result<bool>>
where
    R: Send + 'static,
    F: for<'a> AsyncBatch<'a, R>,
{
    let (tx, rx) = mpsc::unbounded_channel();
    let mut answers = Vec::new();
    for req in reqs {
        let (reply, answer) = oneshot::channel();
        tx.send((req, reply)).unwrap();
        answers.push(answer);
    }
    drop(tx);
    run(conn, rx, exec).await;
    let mut out = Vec::new();
    for a in answers {
        out.push(a.await.unwrap());
    }
    out
}

#[tokio::test]
async fn a_release_script_that_fails_halfway_answers_every_caller_with_the_error() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let mut c = server.conn();
    for k in ["oxidekiq:lock:a", "oxidekiq:lock:c"] {
        let _: () = redis::cmd("SET").arg(k).arg("t").query(&mut c).unwrap();
    }
    // A key of another type: the script's GET fails there, after it deleted the first key.
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
    let answers = one_batch(conn, reqs, release_batch).await;
    assert_eq!(answers.len(), 3);
    for (i, a) in answers.iter().enumerate() {
        let e = a
            .as_ref()
            .expect_err("no caller of a failed batch is told released");
        assert!(e.to_string().contains("WRONGTYPE"), "caller {i}: {e}");
    }
    // The script did stop halfway: the key before the bad one is gone, the one after is not.
    assert_eq!(get(&mut c, "oxidekiq:lock:a"), None);
    assert_eq!(get(&mut c, "oxidekiq:lock:c").as_deref(), Some("t"));
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
    let answers = one_batch(conn, reqs, acquire_batch).await;
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
async fn without_its_tasks_a_batcher_sends_each_command_itself() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let (acquire, _) = mpsc::unbounded_channel();
    let (release, _) = mpsc::unbounded_channel();
    // Both receivers dropped: as after the runtime that ran the tasks shut down.
    let batcher = Arc::new(Batcher { acquire, release });
    assert!(
        batcher
            .acquire(&conn, acq("oxidekiq:lock:solo", "t"))
            .await
            .unwrap()
    );
    assert!(
        !batcher
            .acquire(&conn, acq("oxidekiq:lock:solo", "u"))
            .await
            .unwrap()
    );
    assert!(
        !batcher
            .release(&conn, rel("oxidekiq:lock:solo", "u"))
            .await
            .unwrap()
    );
    assert!(
        batcher
            .release(&conn, rel("oxidekiq:lock:solo", "t"))
            .await
            .unwrap()
    );
    assert_eq!(get(&mut server.conn(), "oxidekiq:lock:solo"), None);
}
