//! Jobs that block their runtime thread (issue 26, item 1), driven through the binary: `ChaosJob` in
//! mode `block` (`workers/src/lib.rs`) holds its thread with `std::thread::sleep`, far longer than the
//! test, as a ported synchronous call would. While such jobs hold every runtime thread the process must
//! go on beating (its `processes` entry and its liveness key refreshed), quiet on TSTP, stop on TERM
//! within its deadline plus a beat, and push the blocked jobs back to their queue exactly once.
//! `SyncSleepJob`, declared blocking with [`oxidekiq::Blocking`], runs on the blocking pool: a
//! runtime of one thread still runs other jobs meanwhile.
//!
//! `cargo build --workspace` first: the tests run `target/debug/oxidekiq`.
use crate::support;

use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicUsize, Ordering};

use oxidekiq::config::FetchMode;
use oxidekiq::{JobContext, JobError, JobResult, Registry, Worker};
use redis::Commands;
use support::{Oxidekiq, RedisServer, config, identity_of, launch, now, wait_for, wait_until};

/// `--beat-interval` of every process here: the bound a stop or a quiet may be late by.
const BEAT: Duration = Duration::from_secs(1);

/// `-t` of every process here.
const STOP_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a blocked job holds its thread: past the end of every test, so only the process's own
/// deadline can end its run.
const BLOCK_MS: u64 = 120_000;

/// A `ChaosJob` payload for the `default` queue.
fn chaos_payload(mode: &str, sleep_ms: u64, jid: &str) -> String {
    let t = now();
    format!(
        r#"{{"retry":true,"queue":"default","class":"ChaosJob","args":["{mode}",{sleep_ms},"{jid}"],"jid":"{jid}","created_at":{t},"enqueued_at":{t}}}"#
    )
}

/// The `beat` field of the process's `processes` entry.
fn beat(conn: &mut redis::Connection, identity: &str) -> f64 {
    let b: Option<String> = conn.hget(identity, "beat").unwrap();
    b.and_then(|b| b.parse().ok()).unwrap_or(0.0)
}

/// How many distinct jobs counted themselves into `hash`.
fn counted(conn: &mut redis::Connection, hash: &str) -> usize {
    conn.hlen(hash).unwrap()
}

/// `oxidekiq -q default -c 5 -t 2 --beat-interval 1`, with `--threads` when given.
fn start(redis: &RedisServer, threads: Option<&str>) -> Oxidekiq {
    let mut args = vec![
        "-q",
        "default",
        "-c",
        "5",
        "-t",
        "2",
        "--beat-interval",
        "1",
    ];
    if let Some(n) = threads {
        args.extend(["--threads", n]);
    }
    Oxidekiq::start(&redis.url(), &args)
}

/// `queue:default` holds exactly `payloads`, byte for byte, each once (in any order).
#[track_caller]
fn assert_back_once(conn: &mut redis::Connection, payloads: &[String]) {
    let mut queued: Vec<String> = conn.lrange("queue:default", 0, -1).unwrap();
    queued.sort();
    let mut expected = payloads.to_vec();
    expected.sort();
    assert_eq!(
        queued, expected,
        "the jobs are not back on their queue, once each"
    );
}

/// Two jobs block their threads under `threads` (`None`: the default, one per CPU less one); the process keeps
/// beating and keeps its liveness key, goes quiet on TSTP, and TERM with `-t 2` ends it within the
/// deadline and a beat (bounded generously: the unfixed process waited for the jobs, minutes), with
/// both payloads back on the queue, byte for byte, once each, and nothing written for their fate.
fn blocked_jobs_do_not_hold_up_the_control_plane(threads: Option<&str>) {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let payloads: Vec<String> = (0..2)
        .map(|i| chaos_payload("block", BLOCK_MS, &format!("block{i}")))
        .collect();
    for p in &payloads {
        let _: () = conn.rpush("queue:default", p).unwrap();
    }
    let mut ox = start(&redis, threads);
    let identity = identity_of(&mut conn, ox.pid(), Duration::from_secs(20));
    // With one runtime thread only one of them can start: the other waits behind it, and is pushed back
    // at the stop like any job fetched but not finished. The default is one per CPU less one (the
    // control plane's), at least one: 1 on a 2-CPU box.
    let default =
        std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1));
    let runtime_threads = threads.map_or(default, |n| n.parse().unwrap());
    let starts = runtime_threads.min(2);
    assert!(
        wait_until(Duration::from_secs(20), || counted(&mut conn, "chaos:runs")
            >= starts),
        "the blocking jobs did not start"
    );
    // The heartbeat goes on: three more beats land while the jobs hold their threads.
    let first = beat(&mut conn, &identity);
    let mut beats = 0;
    let mut last = first;
    let ok = wait_until(Duration::from_secs(15), || {
        let b = beat(&mut conn, &identity);
        if b > last {
            beats += 1;
            last = b;
        }
        beats >= 3
    });
    assert!(
        ok,
        "the heartbeat stopped while jobs blocked their threads (beats seen: {beats})"
    );
    let alive_ttl: i64 = conn.pttl(format!("oxidekiq:alive:{identity}")).unwrap();
    assert!(
        alive_ttl > 0,
        "the liveness key lapsed while jobs blocked (pttl {alive_ttl})"
    );
    // Quiet takes effect within a beat or two.
    ox.signal("TSTP");
    assert!(
        wait_until(Duration::from_secs(10), || {
            let q: Option<String> = conn.hget(&identity, "quiet").unwrap();
            q.as_deref() == Some("true")
        }),
        "TSTP did not quiet the process while jobs blocked"
    );
    let term = Instant::now();
    ox.signal("TERM");
    // The deadline, the cancelled jobs' 2 s bound and the clean-up: a few seconds; the unfixed process
    // waited for the blocked jobs (minutes). A generous bound, not a timing.
    let bound = STOP_TIMEOUT + BEAT + Duration::from_secs(12);
    let status = ox.wait_exit(bound);
    let took = term.elapsed();
    eprintln!("threads {threads:?}: exited {took:?} after TERM (-t 2)");
    assert!(
        status.is_some(),
        "TERM with -t 2 did not end the process within {bound:?} while jobs blocked"
    );
    assert!(
        status.unwrap().success(),
        "the process exited with {status:?}"
    );
    assert!(
        took >= STOP_TIMEOUT,
        "stopped before its deadline ({took:?}): the blocked jobs were not given their time"
    );
    // Both payloads are back on their queue, each once, byte for byte; no fate was written for them.
    assert_back_once(&mut conn, &payloads);
    assert_eq!(
        counted(&mut conn, "chaos:done"),
        0,
        "a blocked job finished"
    );
    let retries: usize = conn.zcard("retry").unwrap();
    let dead: usize = conn.zcard("dead").unwrap();
    assert_eq!((retries, dead), (0, 0), "a blocked job got a fate as well");
    let held: Vec<String> = conn.keys("oxidekiq:batch:*").unwrap();
    assert!(held.is_empty(), "jobs stranded in {held:?}");
    let log = ox.log();
    assert!(log.contains("Bye!"), "no clean end in the log:\n{log}");
}

#[test]
fn blocked_jobs_do_not_hold_up_the_control_plane_with_default_threads() {
    blocked_jobs_do_not_hold_up_the_control_plane(None);
}

#[test]
fn blocked_jobs_do_not_hold_up_the_control_plane_with_one_thread() {
    blocked_jobs_do_not_hold_up_the_control_plane(Some("1"));
}

#[test]
fn blocked_jobs_do_not_hold_up_the_control_plane_with_two_threads() {
    blocked_jobs_do_not_hold_up_the_control_plane(Some("2"));
}

/// A `SyncSleepJob` payload (declared blocking: it runs on the blocking pool).
fn sync_sleep_payload(sleep_ms: u64, jid: &str) -> String {
    let t = now();
    format!(
        r#"{{"retry":true,"queue":"default","class":"SyncSleepJob","args":[{sleep_ms},"{jid}"],"jid":"{jid}","created_at":{t},"enqueued_at":{t}}}"#
    )
}

/// With `--threads 1`, two jobs of a worker declared blocking hold blocking-pool threads, not the
/// runtime's one: a third job runs to its end meanwhile. At the stop's deadline the two are pushed
/// back, once each, with no fate written (their threads see the deadline and end). (The same jobs as `ChaosJob`s in
/// mode `block`, an async worker holding its thread, leave the third waiting: that is what declaring a
/// worker blocking changes.)
#[test]
fn a_worker_declared_blocking_leaves_the_runtime_thread_to_other_jobs() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let blocking: Vec<String> = (0..2)
        .map(|i| sync_sleep_payload(BLOCK_MS, &format!("sync{i}")))
        .collect();
    for p in &blocking {
        let _: () = conn.rpush("queue:default", p).unwrap();
    }
    let mut ox = start(&redis, Some("1"));
    assert!(
        wait_until(Duration::from_secs(20), || counted(&mut conn, "chaos:runs")
            >= 2),
        "the blocking jobs did not start"
    );
    let _: () = conn
        .rpush("queue:default", chaos_payload("ok", 0, "after"))
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(15), || {
            let done: Option<i64> = conn.hget("chaos:done", "after").unwrap();
            done == Some(1)
        }),
        "a job did not run while two blocking jobs held blocking-pool threads"
    );
    ox.signal("TERM");
    let status = ox.wait_exit(STOP_TIMEOUT + BEAT + Duration::from_secs(12));
    assert!(
        status.is_some_and(|s| s.success()),
        "TERM did not end the process cleanly: {status:?}"
    );
    assert_back_once(&mut conn, &blocking);
    let retries: usize = conn.zcard("retry").unwrap();
    assert_eq!(
        retries, 0,
        "an interrupted blocking job got a retry as well"
    );
    let done: Vec<String> = conn.hkeys("chaos:done").unwrap();
    assert_eq!(done, ["after"], "only the third job ends");
}

/// With every runtime thread held by a blocking job (`--threads 1`), the jobs fetched after it wait in
/// the process for a thread. A quiet gives them back: they are on their queue again within a few beats,
/// for another process to run, while the process lives on with its one blocked job.
#[test]
fn quiet_pushes_back_jobs_waiting_behind_a_blocked_runtime() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let _: () = conn
        .rpush("queue:default", chaos_payload("block", BLOCK_MS, "blocker"))
        .unwrap();
    let mut ox = start(&redis, Some("1"));
    assert!(
        wait_until(Duration::from_secs(20), || counted(&mut conn, "chaos:runs")
            >= 1),
        "the blocking job did not start"
    );
    let waiting: Vec<String> = (0..3)
        .map(|i| chaos_payload("ok", 0, &format!("waiting{i}")))
        .collect();
    for p in &waiting {
        let _: () = conn.rpush("queue:default", p).unwrap();
    }
    // Fetched (the control plane fetches up to -c), not started (the one thread is blocked).
    assert!(
        wait_until(Duration::from_secs(15), || {
            let queued: usize = conn.llen("queue:default").unwrap();
            queued == 0
        }),
        "the waiting jobs were not fetched"
    );
    ox.signal("TSTP");
    assert!(
        wait_until(Duration::from_secs(10), || {
            let queued: usize = conn.llen("queue:default").unwrap();
            queued == waiting.len()
        }),
        "a quiet process kept jobs it cannot start"
    );
    assert_back_once(&mut conn, &waiting);
    assert!(ox.try_exit().is_none(), "the quiet process exited");
    assert_eq!(counted(&mut conn, "chaos:done"), 0, "a waiting job ran");
}

/// Runs of [`LateJob`] that began, and that returned (after the process gave up on them).
static LATE_STARTED: AtomicUsize = AtomicUsize::new(0);
static LATE_ENDED: AtomicUsize = AtomicUsize::new(0);

/// Holds its thread for `ms` (deaf to the shutdown), then succeeds or fails as `mode` says: a job the
/// stop gives up on, which ends after its payload was pushed back.
#[derive(Debug)]
struct LateJob;

impl Worker for LateJob {
    const CLASS: &'static str = "LateJob";
    type Args = (String, u64);

    async fn perform(&self, _ctx: &JobContext, (mode, ms): Self::Args) -> JobResult {
        LATE_STARTED.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(ms));
        LATE_ENDED.fetch_add(1, Ordering::SeqCst);
        match mode.as_str() {
            "fail" => Err(JobError::msg("failed after the push-back")),
            _ => Ok(()),
        }
    }
}

/// The fate of a job the stop gave up on is the push-back's alone: a blocked job that ends after it
/// (failing or succeeding) writes no retry and no ack, so its payload is on its queue once, nothing
/// in the retry or dead set, nothing held, with either fetch. In process, so the late end is seen
/// (the binary exits first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_job_that_ends_after_the_push_back_writes_no_fate() {
    for fetch in [FetchMode::RELIABLE, FetchMode::BASIC] {
        let redis = RedisServer::start();
        let mut conn = redis.conn();
        let t = now();
        let payloads: Vec<String> = ["fail", "ok"]
            .iter()
            .map(|mode| {
                format!(
                    r#"{{"retry":true,"queue":"default","class":"LateJob","args":["{mode}",8000],"jid":"late{mode}","created_at":{t},"enqueued_at":{t}}}"#
                )
            })
            .collect();
        for p in &payloads {
            let _: () = conn.rpush("queue:default", p).unwrap();
        }
        let (started, ended) = (
            LATE_STARTED.load(Ordering::SeqCst),
            LATE_ENDED.load(Ordering::SeqCst),
        );
        let mut registry = Registry::new();
        registry.register(LateJob);
        let cfg = oxidekiq::Config {
            fetch,
            threads: Some(2),
            timeout: Duration::from_secs(1),
            ..config(&redis.url(), &["default"], 2)
        };
        let handle = launch(cfg, registry).await;
        wait_for("both jobs to start", Duration::from_secs(10), || {
            LATE_STARTED.load(Ordering::SeqCst) >= started + 2
        })
        .await;
        handle.stop().await.unwrap();
        assert!(
            LATE_ENDED.load(Ordering::SeqCst) < ended + 2,
            "the stop waited for the blocked jobs ({fetch:?})"
        );
        assert_back_once(&mut conn, &payloads);
        wait_for("the blocked jobs to end", Duration::from_secs(20), || {
            LATE_ENDED.load(Ordering::SeqCst) >= ended + 2
        })
        .await;
        // Give a late write time to land, were there one (it must NOT happen: no event to wait for).
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_back_once(&mut conn, &payloads);
        let retries: usize = conn.zcard("retry").unwrap();
        let dead: usize = conn.zcard("dead").unwrap();
        assert_eq!(
            (retries, dead),
            (0, 0),
            "a late end wrote a fate ({fetch:?})"
        );
        let held: Vec<String> = conn.keys("oxidekiq:batch:*").unwrap();
        assert!(held.is_empty(), "held after the stop: {held:?} ({fetch:?})");
    }
}

/// The job locks' batch task must live on the control plane: a stop with every job thread blocked
/// still flushes the lock releases at once. Once a lock job has run (which makes the process's lock
/// batch task exist), two jobs block both runtime threads; TERM with `-t 2` then ends the clean-up
/// without reaching its own deadline, and the process says goodbye cleanly, with its liveness key
/// removed (the push-back succeeded: nothing is left for recovery).
#[test]
fn a_stop_flushes_job_locks_while_jobs_block_every_thread() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let t = now();
    let unique = format!(
        r#"{{"retry":true,"queue":"default","class":"UniqueNoopJob","args":[1],"jid":"uniq1","created_at":{t},"enqueued_at":{t}}}"#
    );
    let _: () = conn.rpush("queue:default", &unique).unwrap();
    let mut ox = start(&redis, Some("2"));
    let identity = identity_of(&mut conn, ox.pid(), Duration::from_secs(20));
    // The lock job ran (its lock taken and released through the batch task).
    assert!(
        wait_until(Duration::from_secs(20), || {
            let queued: usize = conn.llen("queue:default").unwrap();
            let held: Vec<String> = conn.keys("oxidekiq:batch:*").unwrap();
            queued == 0
                && held
                    .iter()
                    .all(|k| support::held_in(&mut conn, k).is_empty())
        }),
        "the lock job did not run"
    );
    let payloads: Vec<String> = (0..2)
        .map(|i| chaos_payload("block", BLOCK_MS, &format!("lockblock{i}")))
        .collect();
    for p in &payloads {
        let _: () = conn.rpush("queue:default", p).unwrap();
    }
    assert!(
        wait_until(Duration::from_secs(20), || counted(&mut conn, "chaos:runs")
            >= 2),
        "the blocking jobs did not start"
    );
    ox.signal("TERM");
    let status = ox.wait_exit(STOP_TIMEOUT + BEAT + Duration::from_secs(12));
    assert!(status.is_some(), "TERM did not end the process");
    let log = ox.log();
    assert!(
        !log.contains("before the clean-up ended"),
        "the stop's clean-up waited for the blocked job runtime:\n{log}"
    );
    assert!(
        status.unwrap().success(),
        "the process exited with {status:?}:\n{log}"
    );
    assert_back_once(&mut conn, &payloads);
    let alive: bool = conn.exists(format!("oxidekiq:alive:{identity}")).unwrap();
    assert!(!alive, "the liveness key stayed after a clean push-back");
}

/// Runs of [`DeafJob`] that began: its own count, as tests run in parallel with [`LateJob`]'s.
static DEAF_STARTED: AtomicUsize = AtomicUsize::new(0);

/// Holds its thread for `ms`, deaf to the shutdown, then succeeds.
#[derive(Debug)]
struct DeafJob;

impl Worker for DeafJob {
    const CLASS: &'static str = "DeafJob";
    type Args = (u64,);

    async fn perform(&self, _ctx: &JobContext, (ms,): Self::Args) -> JobResult {
        DEAF_STARTED.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(ms));
        Ok(())
    }
}

/// Basic fetch keeps the running jobs only in memory, and pushes them back with one pipeline of
/// `RPUSH`es at the stop. When one queue key has the wrong type, the others' pushes have run: a retry
/// of the whole pipeline must not push them again. Two jobs blocked in queues `a` and `b`, then
/// `queue:b` damaged (a string): after the stop `a`'s job is on its queue once, and `b`'s failure is
/// loud and names the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_basic_push_back_that_fails_on_one_queue_pushes_the_others_once() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let t = now();
    let payload = |q: &str| {
        format!(
            r#"{{"retry":true,"queue":"{q}","class":"DeafJob","args":[8000],"jid":"basic{q}","created_at":{t},"enqueued_at":{t}}}"#
        )
    };
    let (a, b) = (payload("a"), payload("b"));
    let _: () = conn.rpush("queue:a", &a).unwrap();
    let _: () = conn.rpush("queue:b", &b).unwrap();
    let started = DEAF_STARTED.load(Ordering::SeqCst);
    let mut registry = Registry::new();
    registry.register(DeafJob);
    let cfg = oxidekiq::Config {
        fetch: FetchMode::BASIC,
        threads: Some(2),
        timeout: Duration::from_secs(1),
        ..config(&redis.url(), &["a", "b"], 2)
    };
    let handle = launch(cfg, registry).await;
    wait_for("both jobs to start", Duration::from_secs(10), || {
        DEAF_STARTED.load(Ordering::SeqCst) >= started + 2
    })
    .await;
    let _: () = conn.set("queue:b", "damaged").unwrap();
    let _ = handle.stop().await;
    let queued: Vec<String> = conn.lrange("queue:a", 0, -1).unwrap();
    assert_eq!(
        queued.iter().filter(|p| **p == a).count(),
        1,
        "queue:a's job pushed back {} times",
        queued.len()
    );
}
