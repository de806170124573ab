//! Nothing lost (issue #7): Redis outages mid-drain, and SIGKILL of the worker process at random moments.
//!
//! The chaos test runs its worker process as a child: this same test binary, re-executed with the
//! ignored test `chaos_worker_process`, which runs a launcher with a worker that records every run in
//! Redis. A SIGKILL ends it exactly as it would end the real binary.
mod support;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use oxidekiq::config::{Config, QueueWeight};
use oxidekiq::error::JobResult;
use oxidekiq::launcher::Launcher;
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
        redis_url: Some(url.to_string()),
        concurrency,
        queues: vec![QueueWeight {
            name: "default".into(),
            weight: 0,
        }],
        beat_interval: Duration::from_millis(200),
        poll_interval_average: Duration::from_secs(3600),
        timeout: Duration::from_secs(5),
        ..Config::default()
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
        oxidekiq::shutdown::Phase::Running,
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
            "chaos_worker_process",
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
    let mut keys: Vec<String> = c.keys("oxidekiq:working:*").unwrap();
    keys.extend(c.keys::<_, Vec<String>>("oxidekiq:landing:*").unwrap());
    keys
}

/// Jobs held in one such key.
fn held_in(c: &mut redis::Connection, key: &str) -> usize {
    if key.starts_with("oxidekiq:landing:") {
        c.llen(key).unwrap()
    } else {
        c.hlen(key).unwrap()
    }
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
