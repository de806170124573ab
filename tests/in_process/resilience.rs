//! Nothing lost (issue #7): Redis outages mid-drain, and SIGKILL of the worker process at random moments.
//!
//! The chaos test runs its worker process as a child: this same test binary, re-executed with the
//! ignored test `chaos_worker_process`, which runs a launcher with a worker that records every run in
//! Redis. A SIGKILL ends it exactly as it would end the real binary.
use crate::support;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use oxidekiq::config::Config;
use oxidekiq::error::JobResult;
use oxidekiq::launcher::{Event, Launcher};
use oxidekiq::{JobContext, Registry, Worker};
use rand::Rng;
use redis::Commands;

/// Records each run: `HINCRBY runs <jid> 1`.
#[derive(Debug)]
struct RecordJob;
impl Worker for RecordJob {
    const CLASS: &'static str = "RecordJob";
    type Args = (u64,);
    async fn perform(&self, ctx: &JobContext, (ms,): Self::Args) -> JobResult {
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        let mut c = ctx.redis();
        let _: i64 = redis::AsyncCommands::hincr(&mut c, "runs", ctx.jid(), 1).await?;
        Ok(())
    }
}

fn config(url: &str, concurrency: usize) -> Config {
    Config {
        poll_interval_average: Duration::from_secs(3600),
        timeout: Duration::from_secs(5),
        ..support::config(url, &["default"], concurrency)
    }
}

fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(RecordJob);
    r
}

fn push_jobs(c: &mut redis::Connection, n: usize, ms: u64) {
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let payloads: Vec<String> = chunk
            .iter()
            .map(|i| format!(r#"{{"class":"RecordJob","args":[{ms}],"jid":"job{i}","queue":"default","retry":true}}"#))
            .collect();
        let _: () = c.lpush("queue:default", payloads).unwrap();
    }
}

fn runs(c: &mut redis::Connection) -> (usize, u64) {
    let all: Vec<(String, u64)> = c.hgetall("runs").unwrap();
    (all.len(), all.iter().map(|(_, n)| n).sum())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_connections_and_a_stopped_redis_lose_no_job() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let n = 3000;
    push_jobs(&mut c, n, 2);
    let handle = Launcher::new(config(&redis.url(), 20), registry())
        .start()
        .await
        .unwrap();

    // Kill every client connection but ours, several times, while the drain runs.
    for _ in 0..5 {
        // The chaos's own rhythm: kills spread over the drain (no event to wait for).
        tokio::time::sleep(Duration::from_millis(150)).await;
        let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("normal")
            .arg("SKIPME")
            .arg("yes")
            .query(&mut c);
    }
    // Then freeze Redis for 3 s mid-drain.
    assert!(
        runs(&mut c).0 < n,
        "the drain must still be running when Redis stops"
    );
    let pid = redis.pid().to_string();
    Command::new("kill").args(["-STOP", &pid]).status().unwrap();
    // The outage's own length: what the test puts the drain through.
    tokio::time::sleep(Duration::from_secs(3)).await;
    Command::new("kill").args(["-CONT", &pid]).status().unwrap();

    // A job whose own Redis call failed during the outage failed like any job: it is in the retry set.
    let accounted = |c: &mut redis::Connection| {
        let ran: Vec<String> = c.hkeys("runs").unwrap();
        let retry: Vec<String> = c.zrange("retry", 0, -1).unwrap();
        let mut jids: std::collections::HashSet<String> = ran.into_iter().collect();
        for m in retry {
            let v: serde_json::Value = serde_json::from_str(&m).unwrap();
            jids.insert(v["jid"].as_str().unwrap().to_string());
        }
        jids.len()
    };
    let done = support::wait_until(Duration::from_secs(60), || accounted(&mut c) == n);
    assert_eq!(
        handle.phase(),
        oxidekiq::launcher::Phase::Running,
        "the process stays up"
    );
    handle.stop().await.unwrap();
    let (unique, total) = runs(&mut c);
    let in_retry: usize = c.zcard("retry").unwrap();
    assert!(done, "{unique} ran and {in_retry} in retry, of {n}");
    assert_eq!(c.llen::<_, usize>("queue:default").unwrap(), 0);
    let working = working_keys(&mut c);
    assert!(working.is_empty(), "{working:?}");
    eprintln!("outage: {n} jobs, {total} runs of {unique} jobs, {in_retry} in the retry set");
}

/// The worker process of the chaos test; does nothing unless run by it.
#[test]
#[ignore]
fn chaos_worker_process() {
    let Ok(url) = std::env::var("OXIDEKIQ_CHAOS_REDIS") else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let handle = Launcher::new(config(&url, 20), registry())
            .start()
            .await
            .unwrap();
        handle.join().await.unwrap();
    });
}

fn spawn_worker(url: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            // The test's path in this binary (`resilience::chaos_worker_process`).
            concat!(module_path!(), "::chaos_worker_process")
                .split_once("::")
                .unwrap()
                .1,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("OXIDEKIQ_CHAOS_REDIS", url)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Every key where a process holds fetched jobs: working hashes and landing lists.
fn working_keys(c: &mut redis::Connection) -> Vec<String> {
    let mut keys: Vec<String> = c.keys("oxidekiq:batch:*").unwrap();
    keys.extend(c.keys::<_, Vec<String>>("oxidekiq:landing:*").unwrap());
    keys
}

/// Jobs held in one such key (a batch list's jobs not marked done).
fn held_in(c: &mut redis::Connection, key: &str) -> usize {
    support::held_in(c, key).len()
}

fn working_len(c: &mut redis::Connection) -> usize {
    working_keys(c).iter().map(|k| held_in(c, k)).sum()
}

#[test]
fn sigkill_at_random_moments_loses_no_job_and_duplicates_only_what_was_in_flight() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let n = 20_000;
    push_jobs(&mut c, n, 0);
    let mut rng = rand::rng();
    let mut in_flight_at_kills = 0;
    for kill in 0..5 {
        let existing = working_keys(&mut c);
        let mut child = spawn_worker(&redis.url());
        let before = runs(&mut c).0;
        // A random moment to kill at: the chaos itself.
        std::thread::sleep(Duration::from_millis(rng.random_range(300..1200)));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        // Everything it fetched and did not acknowledge is still in its working lists.
        let held: usize = working_keys(&mut c)
            .iter()
            .filter(|k| !existing.contains(k))
            .map(|k| held_in(&mut c, k))
            .sum();
        in_flight_at_kills += held;
        eprintln!(
            "kill {kill}: ran {} more, {held} in flight",
            runs(&mut c).0 - before
        );
    }
    // A last process drains the queue, recovers the dead processes' working lists once their
    // liveness keys expire, and runs those too.
    let mut last = spawn_worker(&redis.url());
    let start = Instant::now();
    let done = support::wait_until(Duration::from_secs(90), || {
        runs(&mut c).0 == n && working_len(&mut c) == 0
    });
    let _ = Command::new("kill")
        .args(["-TERM", &last.id().to_string()])
        .status();
    let _ = last.wait();
    let (unique, total) = runs(&mut c);
    assert!(
        done,
        "only {unique} of {n} jobs ran; {} still queued",
        c.llen::<_, usize>("queue:default").unwrap()
    );
    let duplicates = total as usize - n;
    eprintln!(
        "chaos: {n} jobs, 5 kills, {in_flight_at_kills} in flight at the kills, {duplicates} duplicates, final drain {:.1}s",
        start.elapsed().as_secs_f64()
    );
    assert!(
        duplicates <= in_flight_at_kills,
        "{duplicates} duplicates > {in_flight_at_kills} in flight"
    );
    assert_eq!(c.zcard::<_, usize>("dead").unwrap(), 0);
}

/// Jids of the nap jobs that finished (in this test binary).
static NAPPED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Sleeps, touching nothing (so it finishes while Redis is stopped), then notes its jid in memory.
#[derive(Debug)]
struct NapJob;
impl Worker for NapJob {
    const CLASS: &'static str = "NapJob";
    type Args = (u64,);
    async fn perform(&self, ctx: &JobContext, (ms,): Self::Args) -> JobResult {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        NAPPED.lock().unwrap().push(ctx.jid().to_string());
        Ok(())
    }
}

/// The nap job `jid` finished, or it is still in Redis (held or queued), and not both held and queued.
fn nap_accounted(c: &mut redis::Connection, jid: &str) {
    let queued: Vec<String> = c.lrange("queue:default", 0, -1).unwrap();
    let held = held_jids(c);
    let in_redis = held.len() + queued.len();
    let ran = NAPPED.lock().unwrap().iter().any(|j| j == jid);
    assert!(in_redis <= 1, "held {held:?}, queued {queued:?}");
    assert!(
        ran || in_redis == 1,
        "lost: not run, held {held:?}, queued {queued:?}"
    );
}

fn nap_registry() -> Registry {
    let mut r = registry();
    r.register(NapJob);
    r
}

fn push(c: &mut redis::Connection, class: &str, jid: &str, ms: u64) {
    let payload = format!(
        r#"{{"class":"{class}","args":[{ms}],"jid":"{jid}","queue":"default","retry":true}}"#
    );
    let _: () = c.lpush("queue:default", payload).unwrap();
}

/// Jobs this process holds in Redis (its working hashes and landing lists), by jid.
fn held_jids(c: &mut redis::Connection) -> Vec<String> {
    let mut out = Vec::new();
    for key in working_keys(c) {
        let raws: Vec<String> = support::held_in(c, &key);
        for r in raws {
            let v: serde_json::Value = serde_json::from_str(&r).unwrap();
            out.push(v["jid"].as_str().unwrap().to_string());
        }
    }
    out
}

/// Starts a process with one nap job that finishes while Redis is stopped (so its ack cannot be sent),
/// and returns with Redis stopped.
async fn running_then_redis_stopped(
    redis: &support::RedisServer,
    timeout: Duration,
    jid: &str,
) -> oxidekiq::launcher::Handle {
    let mut c = redis.conn();
    let mut cfg = config(&redis.url(), 2);
    cfg.timeout = timeout;
    let handle = Launcher::new(cfg, nap_registry()).start().await.unwrap();
    push(&mut c, "NapJob", jid, 1000);
    assert!(
        support::wait_until(Duration::from_secs(20), || held_jids(&mut c) == [jid]),
        "the job is fetched"
    );
    let pid = redis.pid().to_string();
    Command::new("kill").args(["-STOP", &pid]).status().unwrap();
    // The job ends during the outage; its ack waits on Redis.
    support::wait_for("the job to end", Duration::from_secs(30), || {
        NAPPED.lock().unwrap().iter().any(|j| j == jid)
    })
    .await;
    handle
}

/// Issue 11 item 3: a stop while Redis is down ended never (the ack batch retried forever). It ends by
/// its deadline now, and the job it could not acknowledge stays in the working hash for recovery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_while_redis_is_down_ends_and_leaves_the_job_in_its_working_hash() {
    let redis = support::RedisServer::start();
    let handle = running_then_redis_stopped(&redis, Duration::from_secs(1), "nap-a").await;
    let stopped = tokio::time::timeout(Duration::from_secs(90), handle.stop()).await;
    let pid = redis.pid().to_string();
    Command::new("kill").args(["-CONT", &pid]).status().unwrap();
    assert!(stopped.is_ok(), "the stop hung while redis was down");
    // Its ack may still reach Redis once it resumes (it sat in the socket): done, or kept, never lost.
    nap_accounted(&mut redis.conn(), "nap-a");
}

/// A second TERM during a clean-up that waits on Redis ends it at once (it was ignored), however long
/// the deadline; the job stays in Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_stop_ends_a_clean_up_waiting_on_redis() {
    let redis = support::RedisServer::start();
    let handle = running_then_redis_stopped(&redis, Duration::from_secs(600), "nap-b").await;
    let controls = handle.controls();
    controls.send(oxidekiq::launcher::Control::Stop);
    let mut join = tokio::spawn(handle.join());
    // Stop again every 2 s: the first ones may land before the clean-up starts (they cancel jobs).
    let start = Instant::now();
    let ended = loop {
        tokio::select! {
            _ = &mut join => break true,
            _ = tokio::time::sleep(Duration::from_secs(2)) => {
                if start.elapsed() > Duration::from_secs(90) {
                    break false;
                }
                controls.send(oxidekiq::launcher::Control::Stop);
            }
        }
    };
    let pid = redis.pid().to_string();
    Command::new("kill").args(["-CONT", &pid]).status().unwrap();
    assert!(ended, "a second stop did not end the clean-up");
    nap_accounted(&mut redis.conn(), "nap-b");
}

/// Issue 11 item 5: a fetch under way when the process goes quiet (blocked on an empty queue) used to
/// be abandoned, and a job that arrived then sat in the landing list until Stop. Now it goes back to its
/// queue while the process stays quiet, and does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quiet_hands_back_a_job_that_a_pending_fetch_took() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let handle = Launcher::new(config(&redis.url(), 2), registry())
        .start()
        .await
        .unwrap();
    // One slot busy; the loop then waits on the empty queue with the other.
    push(&mut c, "RecordJob", "slow", 3000);
    assert!(support::wait_until(Duration::from_secs(20), || held_jids(
        &mut c
    ) == [
        "slow"
    ]));
    assert!(
        support::wait_blocked(&mut c, 1, Duration::from_secs(20)),
        "the free slot's fetch never reached its blocking wait"
    );
    handle.send(oxidekiq::launcher::Control::Quiet);
    support::wait_for("quiet", Duration::from_secs(20), || {
        handle.phase() == oxidekiq::launcher::Phase::Quiet
    })
    .await;
    push(&mut c, "RecordJob", "late", 0);
    let back = support::wait_until(Duration::from_secs(20), || {
        let queued: Vec<String> = c.lrange("queue:default", 0, -1).unwrap();
        queued.len() == 1 && !held_jids(&mut c).contains(&"late".to_string())
    });
    let phase = handle.phase();
    let held = held_jids(&mut c);
    handle.stop().await.unwrap();
    assert_eq!(phase, oxidekiq::launcher::Phase::Quiet, "still quiet");
    assert!(
        back,
        "the late job was not handed back while quiet: held {held:?}"
    );
    let ran: Vec<String> = c.hkeys("runs").unwrap();
    assert!(!ran.contains(&"late".to_string()), "a quiet process ran it");
}

/// Issue 11 item 4: a Redis stall longer than the liveness TTL let the first process to recover take
/// every other live process's in-flight jobs (run twice). Two processes, each running slow jobs; Redis
/// stops past the TTL; every job still runs exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_stall_past_the_liveness_ttl_takes_no_live_process_jobs() {
    let redis = support::RedisServer::start();
    let mut c = redis.conn();
    let a = Launcher::new(config(&redis.url(), 2), registry())
        .start()
        .await
        .unwrap();
    let b = Launcher::new(config(&redis.url(), 2), registry())
        .start()
        .await
        .unwrap();
    for i in 0..4 {
        push(&mut c, "RecordJob", &format!("s{i}"), 12_000);
    }
    // Both processes hold two jobs each.
    assert!(support::wait_until(Duration::from_secs(20), || {
        // Held jobs by process (a process's batch lists share its identity, `host:pid:nonce`).
        let mut by_process: std::collections::HashMap<String, usize> = Default::default();
        for k in c.keys::<_, Vec<String>>("oxidekiq:batch:*").unwrap() {
            let rest = k.trim_start_matches("oxidekiq:batch:");
            let owner: Vec<&str> = rest.splitn(4, ':').take(3).collect();
            *by_process.entry(owner.join(":")).or_default() += support::held_in(&mut c, &k).len();
        }
        by_process.len() == 2 && by_process.values().all(|n| *n == 2)
    }));
    let ttl = oxidekiq::launcher::alive_ttl(Duration::from_millis(200));
    let pid = redis.pid().to_string();
    Command::new("kill").args(["-STOP", &pid]).status().unwrap();
    // Past the TTL and past the 5 s response timeout, so the processes' connections give up too: the
    // outage's own length.
    std::thread::sleep(ttl.max(Duration::from_secs(5)) + Duration::from_secs(2));
    Command::new("kill").args(["-CONT", &pid]).status().unwrap();
    let done = support::wait_until(Duration::from_secs(60), || runs(&mut c).0 == 4);
    // Some more recovery rounds after the jobs ended must not bring any back either.
    let mut passes = a.events();
    assert!(
        passes
            .wait_for(Event::RecoveryPass, 2, Duration::from_secs(60))
            .await,
        "no recovery pass after the jobs ended"
    );
    a.stop().await.unwrap();
    b.stop().await.unwrap();
    let all: Vec<(String, u64)> = c.hgetall("runs").unwrap();
    assert!(done, "ran: {all:?}");
    assert!(all.iter().all(|(_, n)| *n == 1), "a job ran twice: {all:?}");
    assert_eq!(c.llen::<_, usize>("queue:default").unwrap(), 0);
}
