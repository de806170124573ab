//! The Redis lock against a real redis-server: exclusion, token checks, script fallback, waiting,
//! expiry of a dead holder, and the keeper.
use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::time::Duration;

use oxidekiq::Error;
use oxidekiq::lock::{self, LockOptions, RedisLock};
use tokio::time::Instant;

fn opts(ttl_ms: u64, poll_ms: u64, timeout_ms: u64) -> LockOptions {
    LockOptions {
        ttl: Duration::from_millis(ttl_ms),
        poll: Duration::from_millis(poll_ms),
        timeout: Duration::from_millis(timeout_ms),
    }
}

fn get(c: &mut redis::Connection, key: &str) -> Option<String> {
    redis::cmd("GET").arg(key).query(c).unwrap()
}

#[test]
fn local_script_sha1_equals_what_redis_script_load_returns() {
    let server = support::RedisServer::start();
    let mut c = server.conn();
    for script in [lock::RELEASE_SCRIPT, lock::EXTEND_SCRIPT] {
        let sha: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(script)
            .query(&mut c)
            .unwrap();
        assert_eq!(lock::script_sha1(script), sha);
    }
}

#[tokio::test]
async fn try_lock_succeeds_then_a_second_try_lock_fails_at_once() {
    let server = support::RedisServer::start();
    let lock = RedisLock::new(server.async_conn().await, "k", LockOptions::default());
    assert_eq!(lock.key(), "oxidekiq:lock:k");

    let guard = lock.try_lock().await.unwrap().expect("the lock was free");
    let mut c = server.conn();
    assert_eq!(
        get(&mut c, "oxidekiq:lock:k").as_deref(),
        Some(guard.token())
    );
    let pttl: i64 = redis::cmd("PTTL")
        .arg("oxidekiq:lock:k")
        .query(&mut c)
        .unwrap();
    assert!(pttl > 29_000 && pttl <= 30_000, "pttl {pttl}");

    let started = Instant::now();
    assert!(lock.try_lock().await.unwrap().is_none());
    assert!(started.elapsed() < Duration::from_millis(500));

    assert_eq!(lock.holder().await.unwrap().as_deref(), Some(guard.token()));
    assert!(guard.release().await.unwrap());
    assert_eq!(lock.holder().await.unwrap(), None);
    assert!(lock.try_lock().await.unwrap().is_some());
}

#[tokio::test]
async fn release_with_a_stale_token_deletes_nothing() {
    let server = support::RedisServer::start();
    let mut conn = server.async_conn().await;
    let lock = RedisLock::new(conn.clone(), "k", opts(200, 10, 1000));

    // A holder whose lock expired and was taken by someone else.
    let old = lock.try_lock().await.unwrap().unwrap();
    let mut c = server.conn();
    support::wait_for("the lock's TTL to end", Duration::from_secs(10), || {
        get(&mut c, "oxidekiq:lock:k").is_none()
    })
    .await;
    let new = lock
        .try_lock()
        .await
        .unwrap()
        .expect("expired lock is free");
    let stale = old.token().to_string();
    assert!(!old.release().await.unwrap());

    // The free function with a stale token, too.
    assert!(
        !lock::release(&mut conn, "oxidekiq:lock:k", &stale)
            .await
            .unwrap()
    );

    let mut c = server.conn();
    assert_eq!(get(&mut c, "oxidekiq:lock:k").as_deref(), Some(new.token()));
    assert!(new.release().await.unwrap());
}

#[tokio::test]
async fn release_falls_back_to_eval_after_script_flush_and_evalsha_works_again() {
    let server = support::RedisServer::start();
    let lock = RedisLock::new(server.async_conn().await, "k", LockOptions::default());
    let mut c = server.conn();
    let sha = lock::script_sha1(lock::RELEASE_SCRIPT);
    let exists = |c: &mut redis::Connection| -> Vec<i64> {
        redis::cmd("SCRIPT")
            .arg("EXISTS")
            .arg(&sha)
            .query(c)
            .unwrap()
    };

    let first = lock.try_lock().await.unwrap().unwrap();
    assert!(first.release().await.unwrap());
    assert_eq!(exists(&mut c), vec![1]);

    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut c).unwrap();
    assert_eq!(exists(&mut c), vec![0]);

    let second = lock.try_lock().await.unwrap().unwrap();
    assert!(second.release().await.unwrap());
    assert_eq!(get(&mut c, "oxidekiq:lock:k"), None);
    // EVAL cached the script, so the next EVALSHA finds it.
    assert_eq!(exists(&mut c), vec![1]);

    let third = lock.try_lock().await.unwrap().unwrap();
    assert!(third.release().await.unwrap());
    assert_eq!(get(&mut c, "oxidekiq:lock:k"), None);
}

#[tokio::test]
async fn blocking_lock_waits_until_the_holder_releases() {
    let server = support::RedisServer::start();
    let lock = RedisLock::new(server.async_conn().await, "k", opts(30_000, 20, 5_000));
    let held = lock.try_lock().await.unwrap().unwrap();

    let releaser = tokio::spawn(async move {
        // The holder's own work: the waiter must wait it out (no event; the wait is the point).
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(held.release().await.unwrap());
    });
    let started = Instant::now();
    let guard = lock.lock().await.unwrap();
    let waited = started.elapsed();
    releaser.await.unwrap();

    assert!(waited >= Duration::from_millis(280), "waited {waited:?}");
    assert!(waited < Duration::from_secs(2), "waited {waited:?}");
    assert_eq!(lock.holder().await.unwrap().as_deref(), Some(guard.token()));
}

#[tokio::test]
async fn blocking_lock_times_out_with_lock_not_acquired_naming_the_key() {
    let server = support::RedisServer::start();
    let conn = server.async_conn().await;
    let holder = RedisLock::new(conn.clone(), "busy", LockOptions::default());
    let held = holder.try_lock().await.unwrap().unwrap();

    let waiter = RedisLock::new(conn, "busy", opts(30_000, 20, 300));
    let started = Instant::now();
    let err = waiter.lock().await.unwrap_err();
    let waited = started.elapsed();

    match &err {
        Error::LockNotAcquired(msg) => assert!(msg.contains("oxidekiq:lock:busy"), "{msg}"),
        other => panic!("expected LockNotAcquired, got {other:?}"),
    }
    assert!(err.to_string().starts_with("lock not acquired: "));
    assert!(waited >= Duration::from_millis(300), "waited {waited:?}");
    assert!(waited < Duration::from_secs(2), "waited {waited:?}");
    assert_eq!(
        holder.holder().await.unwrap().as_deref(),
        Some(held.token())
    );
}

#[tokio::test]
async fn a_lock_told_to_wait_without_limit_waits_for_its_holder_instead_of_panicking() {
    let server = support::RedisServer::start();
    let conn = server.async_conn().await;
    let held = RedisLock::new(conn.clone(), "forever", LockOptions::default())
        .try_lock()
        .await
        .unwrap()
        .unwrap();
    // `Duration::MAX`: "as long as it takes" (`SequentialJob::timeout` takes the same value).
    let waiter = RedisLock::new(
        conn,
        "forever",
        LockOptions {
            timeout: Duration::MAX,
            ..opts(30_000, 20, 0)
        },
    );
    let waiting = tokio::spawn(async move { waiter.lock().await.map(|g| g.token().to_string()) });
    // Time passes to prove the waiter does NOT give up: there is no event for "still waiting".
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "still waiting for the holder");
    assert!(held.release().await.unwrap());
    let token = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("taken once released")
        .expect("no panic")
        .unwrap();
    assert_eq!(token.len(), 32);
}

#[tokio::test]
async fn a_holder_that_never_releases_blocks_others_no_longer_than_the_ttl() {
    let server = support::RedisServer::start();
    let conn = server.async_conn().await;
    let dead = RedisLock::new(conn.clone(), "k", opts(300, 10, 5_000));
    let acquired_at = Instant::now();
    let guard = dead.try_lock().await.unwrap().unwrap();
    // A killed process: the guard disappears without a release.
    std::mem::forget(guard);

    let other = RedisLock::new(conn, "k", opts(30_000, 10, 5_000));
    let got = other.lock().await.unwrap();
    let blocked = acquired_at.elapsed();
    assert!(blocked >= Duration::from_millis(280), "blocked {blocked:?}");
    assert!(blocked < Duration::from_millis(900), "blocked {blocked:?}");
    assert_eq!(other.holder().await.unwrap().as_deref(), Some(got.token()));
}

// Two runtime threads: the loop's blocking GETs must not hold the keeper off its 100 ms renewals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_keeper_holds_a_short_ttl_lock_through_long_work_and_release_deletes_it() {
    let server = support::RedisServer::start();
    let lock = RedisLock::new(server.async_conn().await, "k", opts(300, 10, 1_000));
    let mut guard = lock.try_lock().await.unwrap().unwrap();
    guard.keep_alive();
    guard.keep_alive(); // a second call is harmless

    let mut c = server.conn();
    let started = Instant::now();
    // Four TTLs pass to prove the lock does NOT expire while the keeper runs: time is the point.
    while started.elapsed() < Duration::from_millis(1_200) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            get(&mut c, "oxidekiq:lock:k").as_deref(),
            Some(guard.token())
        );
        assert!(lock.try_lock().await.unwrap().is_none());
    }
    assert!(!guard.is_lost());

    assert!(guard.release().await.unwrap());
    assert_eq!(get(&mut c, "oxidekiq:lock:k"), None);
    // Nothing re-creates or extends the key after release.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let exists: i64 = redis::cmd("EXISTS")
        .arg("oxidekiq:lock:k")
        .query(&mut c)
        .unwrap();
    assert_eq!(exists, 0);
}

#[tokio::test]
async fn dropping_a_guard_stops_its_keeper_and_the_lock_expires_by_ttl() {
    let server = support::RedisServer::start();
    let lock = RedisLock::new(server.async_conn().await, "k", opts(300, 10, 1_000));
    let mut guard = lock.try_lock().await.unwrap().unwrap();
    guard.keep_alive();
    // Half a TTL, so the keeper is running (it first waits `ttl / 3`) when the guard drops.
    tokio::time::sleep(Duration::from_millis(150)).await;
    drop(guard);

    // The key expires by its TTL once nobody extends it (a keeper left running would hold it forever).
    let mut c = server.conn();
    support::wait_for(
        "the lock to expire by its TTL",
        Duration::from_secs(10),
        || get(&mut c, "oxidekiq:lock:k").is_none(),
    )
    .await;
}

#[tokio::test]
async fn the_keeper_marks_the_guard_lost_when_someone_else_owns_the_key() {
    let server = support::RedisServer::start();
    let lock = RedisLock::new(server.async_conn().await, "k", opts(300, 10, 1_000));
    let mut guard = lock.try_lock().await.unwrap().unwrap();
    guard.keep_alive();
    assert!(!guard.is_lost());

    let mut c = server.conn();
    let _: () = redis::cmd("SET")
        .arg("oxidekiq:lock:k")
        .arg("someone-else")
        .query(&mut c)
        .unwrap();
    // The keeper's next pass (every `ttl / 3`) sees the key is someone else's.
    support::wait_for(
        "the keeper to see the lock lost",
        Duration::from_secs(10),
        || guard.is_lost(),
    )
    .await;
    assert!(!guard.release().await.unwrap());
    assert_eq!(
        get(&mut c, "oxidekiq:lock:k").as_deref(),
        Some("someone-else")
    );
}

#[tokio::test]
async fn tokens_are_at_least_32_hex_chars_and_differ_between_holders() {
    let server = support::RedisServer::start();
    let conn = server.async_conn().await;
    let a = RedisLock::new(conn.clone(), "a", LockOptions::default());
    let b = RedisLock::new(conn.clone(), "b", LockOptions::default());
    let ga = a.try_lock().await.unwrap().unwrap();
    let gb = b.try_lock().await.unwrap().unwrap();
    assert!(ga.release().await.unwrap());
    let ga2 = a.try_lock().await.unwrap().unwrap();

    let tokens = [ga2.token(), gb.token()];
    for t in tokens {
        assert!(t.len() >= 32, "{t}");
        assert!(
            t.chars()
                .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)),
            "{t}"
        );
    }
    assert_ne!(ga2.token(), gb.token());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_contending_tasks_hold_the_lock_one_at_a_time_and_all_finish() {
    let server = support::RedisServer::start();
    let conn = server.async_conn().await;
    let max_holders = Arc::new(AtomicI64::new(0));
    let done = Arc::new(AtomicUsize::new(0));

    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..20 {
        let mut conn = conn.clone();
        let lock = RedisLock::new(conn.clone(), "shared", opts(5_000, 5, 30_000));
        let max_holders = Arc::clone(&max_holders);
        let done = Arc::clone(&done);
        tasks.spawn(async move {
            let guard = lock.lock().await.unwrap();
            let holders: i64 = redis::cmd("INCR")
                .arg("holders")
                .query_async(&mut conn)
                .await
                .unwrap();
            max_holders.fetch_max(holders, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(5)).await;
            let _: i64 = redis::cmd("DECR")
                .arg("holders")
                .query_async(&mut conn)
                .await
                .unwrap();
            assert!(guard.release().await.unwrap());
            done.fetch_add(1, Ordering::SeqCst);
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }

    assert_eq!(max_holders.load(Ordering::SeqCst), 1);
    assert_eq!(done.load(Ordering::SeqCst), 20);
    let mut c = server.conn();
    assert_eq!(get(&mut c, "holders").as_deref(), Some("0"));
    assert_eq!(get(&mut c, "oxidekiq:lock:shared"), None);
}
