//! The lock batcher against a real redis-server: many concurrent acquires and releases, contention on
//! one key, `NOSCRIPT` after `SCRIPT FLUSH`, Redis refusing a batch, releases not waited for (their
//! order before later acquires, and the flush a stop waits on). Each runs over both wires: the shared
//! connection (redis-rs) and a connection of the task's own (`redis_conn::resp`).
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::test_support::RedisServer;

/// The two ways a batch reaches Redis, by name: over the shared connection, and over one of its own.
const WIRES: [&str; 2] = ["shared", "own"];

/// The dialer of the test's server.
fn dialer(server: &RedisServer) -> Dialer {
    Dialer::of(&redis::Client::open(server.url()).unwrap()).unwrap()
}

/// A locks handle whose batch task sends over the wire named `kind`.
fn locks_over(kind: &str, conn: &Conn, server: &RedisServer) -> Locks {
    match kind {
        "own" => Locks::dialing(conn.clone(), Some(dialer(server))),
        _ => Locks::new(conn.clone()),
    }
}

/// The wire named `kind`.
fn wire(kind: &str, conn: &Conn, server: &RedisServer) -> Wire {
    match kind {
        "own" => Wire::own(dialer(server)),
        _ => Wire::Shared(conn.clone()),
    }
}

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

/// A detached release, and the work left of it when it could not be queued.
async fn detach(batcher: &Batcher, conn: &Conn, req: Release) {
    if let Some(rest) = batcher.release_detached(conn, req) {
        rest.await;
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
    for kind in WIRES {
        many_concurrent_acquires_and_releases(kind, &server, &conn).await;
    }
}

async fn many_concurrent_acquires_and_releases(kind: &str, server: &RedisServer, conn: &Conn) {
    let locks = locks_over(kind, conn, server);
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
        assert!(a.unwrap(), "{kind}: every key was free");
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
        assert_eq!(r.unwrap(), i % 2 == 0, "{kind}: release {i}");
    }
    for i in 0..n {
        let key = format!("oxidekiq:lock:many:{i}");
        let expected = (i % 2 == 1).then(|| format!("tok{i}:jid{i}"));
        assert_eq!(get(&mut c, &key), expected, "{kind}: key {i}");
    }
    let _: () = redis::cmd("FLUSHDB").query(&mut c).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contention_on_one_key_has_exactly_one_winner_and_only_it_releases() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    for kind in WIRES {
        contention_on_one_key(kind, &server, &conn).await;
    }
}

async fn contention_on_one_key(kind: &str, server: &RedisServer, conn: &Conn) {
    let locks = locks_over(kind, conn, server);
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
    assert_eq!(winners.len(), 1, "{kind}: winners {winners:?}");
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
    assert_eq!(released, vec![winner], "{kind}");
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
    for (round, kind) in (0..6).zip(WIRES.iter().cycle()) {
        let locks = locks_over(kind, &conn, &server);
        let batcher = locks.batcher();
        let key = format!("oxidekiq:lock:flush:{round}");
        assert!(batcher.acquire(&conn, acq(&key, "t")).await.unwrap());
        if round == 2 || round == 3 {
            let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut c).unwrap();
            assert_eq!(exists(&mut c), vec![0]);
        }
        assert!(batcher.release(&conn, rel(&key, "t")).await.unwrap());
        assert_eq!(get(&mut c, &key), None, "{kind}: round {round}");
        // EVAL cached the script again, so the next EVALSHA finds it.
        assert_eq!(exists(&mut c), vec![1], "{kind}: round {round}");
    }
}

/// A batch already queued in full before its task first runs, sent over `wire`: the test knows
/// exactly what one batch holds. The answers of the releases, then of the acquires.
async fn one_batch(
    wire: Wire,
    releases: Vec<Release>,
    acquires: Vec<Acquire>,
) -> Vec<Result<bool>> {
    let mut batch = Batch::default();
    let (n_rel, n_acq) = (releases.len(), acquires.len());
    for r in releases {
        batch.releases.push(r);
        batch.outcomes.push(Outcome::Caller);
    }
    batch.acquires = acquires;
    let answers = Arc::clone(&batch.answers);
    // Closed: the task sends what is queued, then ends.
    let queue = Arc::new(Mutex::new(Queue {
        batches: [batch].into(),
        closed: true,
        ..Queue::default()
    }));
    run(queue, wire).await;
    let mut out = Vec::new();
    for i in 0..n_rel {
        out.push(answers.wait(|a| a.released[i].take()).await.unwrap());
    }
    for i in 0..n_acq {
        out.push(answers.wait(|a| a.acquired[i].take()).await.unwrap().0);
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
    for kind in WIRES {
        for k in ["oxidekiq:lock:a", "oxidekiq:lock:b"] {
            let _: () = redis::cmd("SET").arg(k).arg("t").query(&mut c).unwrap();
        }
        let new = format!("oxidekiq:lock:new:{kind}");
        acl_del(&mut c, "-del");
        let answers = one_batch(
            wire(kind, &conn, &server),
            vec![rel("oxidekiq:lock:a", "t"), rel("oxidekiq:lock:b", "t")],
            vec![acq(&new, "n")],
        )
        .await;
        acl_del(&mut c, "+del");
        assert_eq!(answers.len(), 3);
        for (i, a) in answers[..2].iter().enumerate() {
            let e = a
                .as_ref()
                .expect_err("no caller of a failed release is told released");
            // Redis 7.0: "The user executing the script can't run this command"; Valkey 9.1: "ACL
            // failure in script: User default has no permissions to run the 'del' command".
            let e = e.to_string();
            assert!(
                e.contains("can't run this command") || e.contains("no permissions to run"),
                "{kind}: caller {i}: {e}"
            );
        }
        // The acquire in the same round trip is its own command: it ran and says so.
        assert!(*answers[2].as_ref().unwrap(), "{kind}");
        assert_eq!(get(&mut c, "oxidekiq:lock:a").as_deref(), Some("t"));
        assert_eq!(get(&mut c, "oxidekiq:lock:b").as_deref(), Some("t"));
        assert_eq!(get(&mut c, &new).as_deref(), Some("n"));
    }
}

#[tokio::test]
async fn a_key_of_another_type_holds_no_token_so_it_is_not_released_and_the_others_are() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let mut c = server.conn();
    for kind in WIRES {
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
        let answers = one_batch(wire(kind, &conn, &server), reqs, Vec::new()).await;
        let answers: Vec<bool> = answers.into_iter().map(|a| a.unwrap()).collect();
        assert_eq!(answers, [true, false, true], "{kind}");
        assert_eq!(get(&mut c, "oxidekiq:lock:a"), None);
        assert_eq!(get(&mut c, "oxidekiq:lock:c"), None);
        let type_of: String = redis::cmd("TYPE")
            .arg("oxidekiq:lock:b")
            .query(&mut c)
            .unwrap();
        assert_eq!(type_of, "hash");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detached_release_is_in_redis_once_flush_returns() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let mut c = server.conn();
    let n = 300;
    for kind in WIRES {
        let locks = locks_over(kind, &conn, &server);
        let batcher = locks.batcher();
        for i in 0..n {
            let key = format!("oxidekiq:lock:flush:{i}");
            assert!(batcher.acquire(&conn, acq(&key, "t")).await.unwrap());
        }
        for i in 0..n {
            let key = format!("oxidekiq:lock:flush:{i}");
            detach(batcher, &conn, rel(&key, "t")).await;
        }
        locks.flush().await;
        // Read at once, not waited for: flush returned only after every queued release had its
        // reply.
        let left: Vec<String> = redis::cmd("KEYS")
            .arg("oxidekiq:lock:flush:*")
            .query(&mut c)
            .unwrap();
        assert_eq!(left, Vec::<String>::new(), "{kind}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_queued_after_a_detached_release_of_its_key_finds_it_free_even_after_script_flush()
 {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let mut c = server.conn();
    for kind in WIRES {
        let locks = locks_over(kind, &conn, &server);
        let batcher = locks.batcher();
        for round in 0..200 {
            let key = format!("oxidekiq:lock:order:{}", round % 7);
            if round % 50 == 25 {
                // Redis forgets the script: the release goes again with EVAL, after this batch's
                // SETs.
                let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut c).unwrap();
            }
            let held = format!("held{round}");
            assert!(
                batcher.acquire(&conn, acq(&key, &held)).await.unwrap(),
                "{kind}: round {round}"
            );
            // One job ends and the next of its key starts at once, in the order a slot does it.
            detach(batcher, &conn, rel(&key, &held)).await;
            let next = format!("next{round}");
            assert!(
                batcher.acquire(&conn, acq(&key, &next)).await.unwrap(),
                "{kind}: round {round}: the release queued first was sent after the acquire"
            );
            detach(batcher, &conn, rel(&key, &next)).await;
        }
        locks.flush().await;
        let left: Vec<String> = redis::cmd("KEYS")
            .arg("oxidekiq:lock:order:*")
            .query(&mut c)
            .unwrap();
        assert_eq!(left, Vec::<String>::new(), "{kind}");
    }
}

#[tokio::test]
async fn a_release_and_an_acquire_of_one_key_in_one_batch_release_first_even_on_noscript() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let mut c = server.conn();
    for kind in WIRES {
        for (round, flush) in [(0, false), (1, true)] {
            let key = format!("oxidekiq:lock:same:{kind}:{round}");
            let _: () = redis::cmd("SET")
                .arg(&key)
                .arg("old")
                .query(&mut c)
                .unwrap();
            if flush {
                let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut c).unwrap();
            }
            let answers = one_batch(
                wire(kind, &conn, &server),
                vec![rel(&key, "old")],
                vec![acq(&key, "new")],
            )
            .await;
            let answers: Vec<bool> = answers.into_iter().map(|a| a.unwrap()).collect();
            assert_eq!(answers, [true, true], "{kind}: round {round}");
            assert_eq!(
                get(&mut c, &key).as_deref(),
                Some("new"),
                "{kind}: round {round}"
            );
        }
    }
}

#[tokio::test]
async fn an_acquire_batch_that_redis_refuses_answers_every_caller_with_the_error() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let mut c = server.conn();
    let maxmemory = |c: &mut redis::Connection, bytes: &str| {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg(bytes)
            .query(c)
            .unwrap();
    };
    // Out of memory and no eviction: Redis refuses every write.
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("noeviction")
        .query(&mut c)
        .unwrap();
    for kind in WIRES {
        // Connected first: a connection made while Redis is out of memory still works, but this
        // test is about the commands.
        let mut w = wire(kind, &conn, &server);
        let _ = w.query(&[], true, std::iter::empty()).await;
        maxmemory(&mut c, "1");
        let reqs = (0..5)
            .map(|i| acq(&format!("oxidekiq:lock:oom:{i}"), "t"))
            .collect();
        let answers = one_batch(w, Vec::new(), reqs).await;
        maxmemory(&mut c, "0");
        assert_eq!(answers.len(), 5);
        for (i, a) in answers.iter().enumerate() {
            let e = a
                .as_ref()
                .expect_err("no caller of a refused batch is told acquired");
            assert!(e.to_string().contains("OOM"), "{kind}: caller {i}: {e}");
        }
        for i in 0..5 {
            assert_eq!(get(&mut c, &format!("oxidekiq:lock:oom:{i}")), None);
        }
    }
}

#[tokio::test]
async fn a_set_redis_refuses_fails_only_its_own_acquire() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let mut c = server.conn();
    for kind in WIRES {
        // A TTL Redis cannot take (`PX` past its range): that one `SET` is refused, the others
        // beside it in the same round trip succeed and must be told so, or their jobs fail holding
        // a lock.
        let key = |name: &str| format!("oxidekiq:lock:{kind}:{name}");
        let bad = Acquire {
            ttl_ms: u64::MAX,
            ..acq(&key("refused"), "t")
        };
        let reqs = vec![acq(&key("before"), "t"), bad, acq(&key("after"), "t")];
        let answers = one_batch(wire(kind, &conn, &server), Vec::new(), reqs).await;
        assert!(matches!(answers[0], Ok(true)), "{kind}: {:?}", answers[0]);
        // Redis's own words for it vary by version ("out of range", "invalid expire time").
        assert!(answers[1].is_err(), "{kind}: the refused SET is an error");
        assert!(matches!(answers[2], Ok(true)), "{kind}: {:?}", answers[2]);
        assert_eq!(get(&mut c, &key("before")).as_deref(), Some("t"));
        assert_eq!(get(&mut c, &key("after")).as_deref(), Some("t"));
        assert_eq!(get(&mut c, &key("refused")), None);
    }
}

#[tokio::test]
async fn without_its_task_a_batcher_sends_each_command_itself() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    // Closed with nothing to send: as after the runtime that ran the task shut down.
    let queue = Arc::new(Mutex::new(Queue {
        closed: true,
        ..Queue::default()
    }));
    let batcher = Batcher { queue };
    let solo = "oxidekiq:lock:solo";
    assert!(batcher.acquire(&conn, acq(solo, "t")).await.unwrap());
    assert!(!batcher.acquire(&conn, acq(solo, "u")).await.unwrap());
    assert!(!batcher.release(&conn, rel(solo, "u")).await.unwrap());
    assert!(batcher.release(&conn, rel(solo, "t")).await.unwrap());
    assert_eq!(get(&mut server.conn(), solo), None);
    assert!(batcher.acquire(&conn, acq(solo, "v")).await.unwrap());
    // Detached, with nobody to queue it for: sent before returning.
    detach(&batcher, &conn, rel(solo, "v")).await;
    assert_eq!(get(&mut server.conn(), solo), None);
    batcher.flush().await;
}

#[tokio::test]
async fn a_batch_whose_task_is_dropped_unanswered_fails_its_callers_instead_of_hanging() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let queue = Arc::new(Mutex::new(Queue::default()));
    // A task that never runs: its future is built and dropped, as a runtime shutting down drops it.
    let task = run(Arc::clone(&queue), Wire::Shared(conn.clone()));
    let batcher = Batcher {
        queue: Arc::clone(&queue),
    };
    let waiting = tokio::spawn(async move {
        let got = batcher
            .acquire(&conn, acq("oxidekiq:lock:never", "t"))
            .await;
        (got, batcher)
    });
    // The request is queued before the task goes away.
    while lock(&queue).batches.is_empty() {
        tokio::task::yield_now().await;
    }
    drop(task);
    let (got, batcher) = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the caller is answered, not left waiting")
        .unwrap();
    let e = got.expect_err("nobody is told acquired without Redis's answer");
    assert!(e.to_string().contains("ended before answering"), "{e}");
    // Closed: what comes next goes to Redis directly.
    assert!(
        batcher
            .acquire(&server.async_conn().await, acq("oxidekiq:lock:after", "t"))
            .await
            .unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn its_own_connection_killed_by_the_server_fails_one_batch_then_reconnects() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let mut c = server.conn();
    let locks = locks_over("own", &conn, &server);
    assert!(
        locks
            .batcher()
            .acquire(&conn, acq("oxidekiq:lock:before", "t"))
            .await
            .unwrap()
    );
    let redis = |c: &mut redis::Connection, args: &[&str]| {
        let _: redis::Value = redis::cmd(args[0]).arg(&args[1..]).query(c).unwrap();
    };
    // Writes wait in Redis, so the batch is on the wire when its connection is killed (killed while
    // idle, it would be replaced before the batch, see below).
    redis(&mut c, &["CLIENT", "PAUSE", "10000", "WRITE"]);
    let on_the_wire = tokio::spawn({
        let (locks, conn) = (locks.clone(), conn.clone());
        async move {
            locks
                .batcher()
                .acquire(&conn, acq("oxidekiq:lock:after", "t"))
                .await
        }
    });
    let waited = std::time::Instant::now();
    loop {
        let list: String = redis::cmd("CLIENT").arg("LIST").query(&mut c).unwrap();
        if list.contains("cmd=set") {
            break;
        }
        assert!(waited.elapsed() < Duration::from_secs(5), "{list}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    redis(
        &mut c,
        &["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"],
    );
    // The batch on the dead connection fails: nobody is told acquired without Redis's answer.
    let e = on_the_wire
        .await
        .unwrap()
        .expect_err("a killed connection answers nothing");
    redis(&mut c, &["CLIENT", "UNPAUSE"]);
    assert!(
        e.to_string()
            .contains(&format!("lock connection to 127.0.0.1:{}", server.port)),
        "{e}"
    );
    assert_eq!(get(&mut c, "oxidekiq:lock:after"), None);
    // The next batch connects again.
    assert!(
        locks
            .batcher()
            .acquire(&conn, acq("oxidekiq:lock:after", "t"))
            .await
            .unwrap()
    );
    assert_eq!(get(&mut c, "oxidekiq:lock:after").as_deref(), Some("t"));
    // Killed while idle: nothing was on the wire, so nothing fails; the batch goes over a new
    // connection.
    redis(
        &mut c,
        &["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"],
    );
    assert!(
        locks
            .batcher()
            .acquire(&conn, acq("oxidekiq:lock:idle-kill", "t"))
            .await
            .unwrap()
    );
}

#[tokio::test]
async fn its_own_connection_logs_in_as_the_url_s_user_and_selects_its_database() {
    const PASSWORD: &str = "lock-conn-s3cret";
    let args = crate::test_support::acl_args(PASSWORD);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = RedisServer::start_with(&args);
    let url = format!("redis://app:{PASSWORD}@127.0.0.1:{}/3", server.port);
    let client = redis::Client::open(url.as_str()).unwrap();
    let conn: Conn = redis::aio::ConnectionManager::new(client.clone())
        .await
        .unwrap()
        .into();
    let locks = Locks::dialing(conn.clone(), Dialer::of(&client));
    assert!(
        locks
            .batcher()
            .acquire(&conn, acq("oxidekiq:lock:db3", "t"))
            .await
            .unwrap()
    );
    let mut c = client.get_connection().unwrap();
    assert_eq!(get(&mut c, "oxidekiq:lock:db3").as_deref(), Some("t"));
    let _: () = redis::cmd("SELECT").arg(0).query(&mut c).unwrap();
    assert_eq!(get(&mut c, "oxidekiq:lock:db3"), None);

    // A wrong password: every batch fails, naming the server and never the password.
    let wrong = format!("redis://app:not-{PASSWORD}@127.0.0.1:{}/3", server.port);
    let wrong = Dialer::of(&redis::Client::open(wrong.as_str()).unwrap());
    let locks = Locks::dialing(conn.clone(), wrong);
    let e = locks
        .batcher()
        .acquire(&conn, acq("oxidekiq:lock:refused", "t"))
        .await
        .expect_err("refused credentials acquire nothing");
    let text = format!("{e} {e:?}");
    assert!(
        text.contains(&format!("127.0.0.1:{}", server.port)),
        "{text}"
    );
    assert!(!text.contains(PASSWORD), "{text}");
}

#[tokio::test]
async fn its_own_connection_to_a_closed_port_fails_each_batch_at_once() {
    let port = crate::test_support::free_port();
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let locks = Locks::dialing(conn.clone(), Dialer::of(&client));
    for _ in 0..2 {
        let started = std::time::Instant::now();
        let e = locks
            .batcher()
            .acquire(&conn, acq("oxidekiq:lock:nowhere", "t"))
            .await
            .expect_err("nothing listens there");
        assert!(
            e.to_string()
                .contains(&format!("lock connection to 127.0.0.1:{port}")),
            "{e}"
        );
        assert!(started.elapsed() < Duration::from_secs(2));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_that_comes_after_the_timeout_is_never_read_as_the_next_batch_s() {
    let server = RedisServer::start_with(&["--enable-debug-command", "yes"]);
    let conn = server.async_conn().await;
    let mut c = server.conn();
    let locks = locks_over("own", &conn, &server);
    let batcher = locks.batcher();
    // Connected before the stall.
    assert!(
        batcher
            .acquire(&conn, acq("oxidekiq:lock:warm", "t"))
            .await
            .unwrap()
    );
    // Returns once Redis is seen stalled (not after a guessed delay); long enough that the acquire
    // below is sent well inside it.
    let stall = crate::test_support::stall(&server.url(), resp::RESPONSE_TIMEOUT.as_secs() + 2);
    let late = batcher
        .acquire(&conn, acq("oxidekiq:lock:late", "late"))
        .await;
    assert!(late.is_err(), "no answer within the timeout: {late:?}");
    stall.join().unwrap();
    // Redis may still have run the first SET once awake, its reply going nowhere. Whatever it did,
    // the next answer is Redis's answer to the next command.
    let next = batcher
        .acquire(&conn, acq("oxidekiq:lock:late", "next"))
        .await
        .unwrap();
    let held = get(&mut c, "oxidekiq:lock:late");
    assert_eq!(next, held.as_deref() == Some("next"), "{held:?}");
    assert!(held.is_some());
}

#[tokio::test]
async fn its_own_connection_goes_through_a_unix_socket_when_the_url_names_one() {
    let dir = crate::test_support::temp_dir("lock-unix");
    let socket = dir.join("redis.sock");
    let server = RedisServer::start_with(&["--unixsocket", socket.to_str().unwrap()]);
    let conn = server.async_conn().await;
    let url = format!("redis+unix://{}", socket.display());
    let dialer = Dialer::of(&redis::Client::open(url.as_str()).unwrap());
    assert!(
        dialer.is_some(),
        "a unix socket is dialed, not left to redis-rs"
    );
    let locks = Locks::dialing(conn.clone(), dialer);
    assert!(
        locks
            .batcher()
            .acquire(&conn, acq("oxidekiq:lock:unix", "t"))
            .await
            .unwrap()
    );
    let mut c = server.conn();
    assert_eq!(get(&mut c, "oxidekiq:lock:unix").as_deref(), Some("t"));
    // The connection the batch used is the socket's (CLIENT LIST shows its peer as the path: Redis 7.0
    // `addr=/dir/redis.sock:0`, Valkey 9.1 `addr=[/dir/redis.sock:0]:0`).
    let clients: String = redis::cmd("CLIENT").arg("LIST").query(&mut c).unwrap();
    assert!(
        clients
            .lines()
            .any(|l| l.contains("addr=/") || l.contains("addr=[/")),
        "{clients}"
    );
}

/// The `id=` of the one client whose line in `CLIENT LIST` contains `addr`.
fn client_id(c: &mut redis::Connection, addr: &str) -> String {
    let clients: String = redis::cmd("CLIENT").arg("LIST").query(c).unwrap();
    let ours: Vec<&str> = clients.lines().filter(|l| l.contains(addr)).collect();
    assert_eq!(ours.len(), 1, "{clients}");
    ours[0].split(' ').next().unwrap().to_string()
}

#[tokio::test]
async fn its_own_connection_found_open_before_a_batch_is_kept_over_tcp_and_unix_sockets() {
    let dir = crate::test_support::temp_dir("lock-reuse");
    let socket = dir.join("redis.sock");
    let server = RedisServer::start_with(&["--unixsocket", socket.to_str().unwrap()]);
    let conn = server.async_conn().await;
    let mut c = server.conn();
    for (url, addr) in [
        (
            format!("redis+unix://{}", socket.display()),
            // The socket's path, in its client's `addr=` (Redis 7.0 `addr=/dir/redis.sock:0`, Valkey
            // 9.1 `addr=[/dir/redis.sock:0]:0`).
            "redis.sock:0".to_string(),
        ),
        // Named by its database: the shared connection and this test's are in 0.
        (format!("{}/5", server.url()), "db=5".to_string()),
    ] {
        let dialer = Dialer::of(&redis::Client::open(url.as_str()).unwrap());
        let locks = Locks::dialing(conn.clone(), dialer);
        let mut ids = Vec::new();
        for i in 0..3 {
            let key = format!("oxidekiq:lock:reuse:{i}");
            assert!(
                locks
                    .batcher()
                    .acquire(&conn, acq(&key, "t"))
                    .await
                    .unwrap()
            );
            ids.push(client_id(&mut c, &addr));
        }
        // The look before each batch (`RespConn::is_open`) finds an open socket open: one
        // connection for every batch, not one each.
        assert!(ids.iter().all(|id| *id == ids[0]), "{url}: {ids:?}");
        drop(locks);
    }
}

#[tokio::test]
async fn its_own_connection_to_a_database_redis_lacks_fails_each_batch_naming_the_select() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    // Redis has 16 databases by default: 99 is refused.
    let url = format!("redis://127.0.0.1:{}/99", server.port);
    let locks = Locks::dialing(conn.clone(), Dialer::of(&redis::Client::open(url).unwrap()));
    let e = locks
        .batcher()
        .acquire(&conn, acq("oxidekiq:lock:db99", "t"))
        .await
        .expect_err("no database, no lock");
    assert!(e.to_string().contains("cannot select its database"), "{e}");
    assert_eq!(get(&mut server.conn(), "oxidekiq:lock:db99"), None);
}

#[tokio::test]
async fn its_own_connection_closed_by_redis_while_idle_is_replaced_before_the_next_batch() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let locks = locks_over("own", &conn, &server);
    let batcher = locks.batcher();
    assert!(
        batcher
            .acquire(&conn, acq("oxidekiq:lock:idle:before", "t"))
            .await
            .unwrap()
    );
    // Redis's `timeout` (common on hosted Redis) closes a connection idle that long: the lock
    // connection is idle whenever no locked job runs.
    let config_timeout = |secs: &str| {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("timeout")
            .arg(secs)
            .query(&mut server.conn())
            .unwrap();
    };
    config_timeout("1");
    let clients = || -> usize {
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query(&mut server.conn())
            .unwrap();
        list.lines().count()
    };
    // Until Redis has closed it (and the shared connection, idle too): only the asking one is left.
    let waited = std::time::Instant::now();
    while clients() > 1 {
        assert!(
            waited.elapsed() < Duration::from_secs(10),
            "redis closes idle clients"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    config_timeout("0");
    // Nothing was sent on the closed connection: the batch goes over a new one and gets Redis's
    // answer, rather than failing every locked job that starts after a quiet spell.
    let after = batcher
        .acquire(&conn, acq("oxidekiq:lock:idle:after", "t"))
        .await;
    assert!(matches!(after, Ok(true)), "{after:?}");
    assert_eq!(
        get(&mut server.conn(), "oxidekiq:lock:idle:after").as_deref(),
        Some("t")
    );
}
