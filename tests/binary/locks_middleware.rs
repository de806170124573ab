//! The unique and sequential lock middleware, and the client's until-executed locks, against a real
//! Redis with several oxidekiq processes on it: the `oxidekiq` binary (whose registry has
//! `UniqueReportJob` and `SequentialReportJob`) when the example workers will do, in-process launchers
//! when a test needs a worker of its own. Build the binary first: `cargo build --workspace`.
use crate::support;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, FixedOffset};
use oxidekiq::client::{Client, NewJob};
use oxidekiq::error::JobResult;
use oxidekiq::launcher::Handle;
use oxidekiq::middleware::Keyed;
use oxidekiq::middleware::lock_key::args_digest;
use oxidekiq::middleware::sequential::SequentialJob;
use oxidekiq::middleware::unique::{OnConflict, UniqueJob};
use oxidekiq::middleware::until_executed;
use oxidekiq::{Error, JobContext, JobError, NoArgs, Registry, Worker};
use redis::Commands;
use serde_json::{Value, json};
use support::{Monitor, Oxidekiq, RedisServer, wait_for, wait_until};

// ---------------------------------------------------------------------------------------------------
// Helpers

/// Starts an `oxidekiq` binary on the `reports` queue with `concurrency` slots.
fn oxidekiq(redis: &RedisServer, concurrency: &str) -> Oxidekiq {
    Oxidekiq::start(&redis.url(), &["-q", "reports", "-c", concurrency])
}

/// Waits until `n` processes have sent a heartbeat.
#[track_caller]
fn wait_for_processes(c: &mut redis::Connection, n: usize) {
    assert!(
        wait_until(Duration::from_secs(15), || {
            c.scard::<_, usize>("processes").unwrap() >= n
        }),
        "{n} processes did not start"
    );
}

/// One log line of a job: when, which jid, what was said.
#[derive(Debug, Clone)]
struct Line {
    at: DateTime<FixedOffset>,
    jid: String,
    text: String,
}

/// Every line of `class`'s jobs whose message is `message`, from all the logs given.
fn lines(logs: &[String], class: &str, message: &str) -> Vec<Line> {
    let class_field = format!(" class={class} ");
    let suffix = format!(": {message}");
    let mut out = Vec::new();
    for log in logs {
        for l in log.lines() {
            if !l.contains(&class_field) || !l.ends_with(&suffix) {
                continue;
            }
            let at = DateTime::parse_from_rfc3339(l.split(' ').next().unwrap()).unwrap();
            let jid = field(l, "jid").unwrap().to_string();
            out.push(Line {
                at,
                jid,
                text: l.to_string(),
            });
        }
    }
    out
}

/// The value of ` name=value` in a log line.
fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let needle = format!(" {name}=");
    let start = line.find(&needle)? + needle.len();
    line[start..].split(' ').next()
}

fn logs(procs: &[&Oxidekiq]) -> Vec<String> {
    procs.iter().map(|p| p.log()).collect()
}

async fn launch(url: &str, concurrency: usize, registry: Registry) -> Handle {
    support::launch(support::config(url, &["default"], concurrency), registry).await
}

fn push_raw(c: &mut redis::Connection, class: &str, args: &str, jid: &str) {
    let raw = format!(
        r#"{{"retry":true,"queue":"default","class":"{class}","args":{args},"jid":"{jid}","created_at":1795291260.8,"enqueued_at":1795291260.9}}"#
    );
    let _: () = c.lpush("queue:default", raw).unwrap();
}

/// Records each run in the `ran` list as `<class>:<jid>`.
async fn record_run(ctx: &JobContext) {
    let mut c = ctx.redis();
    let _: () =
        redis::AsyncCommands::rpush(&mut c, "ran", format!("{}:{}", ctx.class(), ctx.jid()))
            .await
            .unwrap();
}

fn ran(c: &mut redis::Connection) -> Vec<String> {
    c.lrange("ran", 0, -1).unwrap()
}

// ---------------------------------------------------------------------------------------------------
// The example workers in two oxidekiq processes

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_unique_reports_enqueued_during_one_run_run_once_and_four_are_logged_as_duplicates() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let a = oxidekiq(&redis, "5");
    let b = oxidekiq(&redis, "5");
    wait_for_processes(&mut c, 2);
    let client = Client::connect(&redis.url()).await.unwrap();
    let report = || NewJob::new("UniqueReportJob", (2.0,)).queue("reports");
    let short = NewJob::new("UniqueReportJob", (0.1,)).queue("reports");

    let first = client.push(report()).await.unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || {
            !lines(&logs(&[&a, &b]), "UniqueReportJob", "report started").is_empty()
        }),
        "the first report did not start"
    );
    let mut dups = HashSet::new();
    for _ in 0..4 {
        dups.insert(client.push(report()).await.unwrap());
    }
    assert!(
        wait_until(Duration::from_secs(10), || {
            lines(&logs(&[&a, &b]), "UniqueReportJob", "report finished").len() == 1
        }),
        "the first report did not finish"
    );

    let all = logs(&[&a, &b]);
    let started = lines(&all, "UniqueReportJob", "report started");
    let finished = lines(&all, "UniqueReportJob", "report finished");
    assert_eq!(started.len(), 1, "{started:?}");
    assert_eq!(started[0].jid, first);
    assert_eq!(finished[0].jid, first);
    assert!(finished[0].text.contains(" result=generated "));
    let skipped = lines(&all, "UniqueReportJob", "skipped duplicate");
    assert_eq!(skipped.len(), 4, "{skipped:?}");
    for s in &skipped {
        assert!(dups.contains(&s.jid), "{s:?}");
        assert_eq!(
            field(&s.text, "lock"),
            Some("oxidekiq:lock:UniqueReportJob")
        );
        assert_eq!(field(&s.text, "holder"), Some(first.as_str()));
    }
    // The lock is released when the job ends, and duplicates are acknowledged, not retried.
    assert!(wait_until(Duration::from_secs(5), || {
        !c.exists::<_, bool>("oxidekiq:lock:UniqueReportJob")
            .unwrap()
    }));
    assert_eq!(c.zcard::<_, usize>("retry").unwrap(), 0);
    assert_eq!(c.zcard::<_, usize>("schedule").unwrap(), 0);
    assert_eq!(c.llen::<_, usize>("queue:reports").unwrap(), 0);

    // Once it is done, the next one runs.
    let again = client.push(short).await.unwrap();
    assert!(wait_until(Duration::from_secs(10), || {
        lines(&logs(&[&a, &b]), "UniqueReportJob", "report finished")
            .iter()
            .any(|l| l.jid == again)
    }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_sequential_reports_all_run_one_after_another_never_overlapping() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    // One slot in the first process: the second must take the other jobs and wait in its slots. The
    // first is blocked in its fetch before the second starts, so Redis hands it the first job (the
    // longest-blocked client is served first): both processes take jobs whatever the timing.
    let a = oxidekiq(&redis, "1");
    wait_for_processes(&mut c, 1);
    assert!(
        support::wait_blocked(&mut c, 1, Duration::from_secs(15)),
        "the first process did not reach its blocking fetch: {}",
        a.log()
    );
    let b = oxidekiq(&redis, "5");
    wait_for_processes(&mut c, 2);
    let client = Client::connect(&redis.url()).await.unwrap();
    let mut jids = HashSet::new();
    for _ in 0..3 {
        let job = NewJob::new("SequentialReportJob", (0.5,)).queue("reports");
        jids.insert(client.push(job).await.unwrap());
    }
    assert!(
        wait_until(Duration::from_secs(20), || {
            lines(&logs(&[&a, &b]), "SequentialReportJob", "report finished").len() == 3
        }),
        "three reports did not finish"
    );
    let all = logs(&[&a, &b]);
    let starts: HashMap<String, DateTime<FixedOffset>> =
        lines(&all, "SequentialReportJob", "report started")
            .into_iter()
            .map(|l| (l.jid, l.at))
            .collect();
    let ends: HashMap<String, DateTime<FixedOffset>> =
        lines(&all, "SequentialReportJob", "report finished")
            .into_iter()
            .map(|l| (l.jid, l.at))
            .collect();
    assert_eq!(starts.keys().cloned().collect::<HashSet<_>>(), jids);
    assert_eq!(ends.keys().cloned().collect::<HashSet<_>>(), jids);
    let mut runs: Vec<(DateTime<FixedOffset>, DateTime<FixedOffset>)> =
        jids.iter().map(|j| (starts[j], ends[j])).collect();
    runs.sort();
    for w in runs.windows(2) {
        assert!(
            w[0].1 <= w[1].0,
            "two reports overlapped: {:?} then {:?}",
            w[0],
            w[1]
        );
    }
    for (s, e) in &runs {
        assert!(*e - *s >= chrono::Duration::milliseconds(490), "{s} {e}");
    }
    // Both processes took jobs: the waiting happened across processes, not just in a queue.
    let took = |p: &Oxidekiq| {
        let log = p.log();
        log.contains("class=SequentialReportJob")
    };
    assert!(took(&a) && took(&b), "one process took every job");
    // The last release is sent by the lock batch task after the job's end was logged: waited for.
    assert!(
        wait_until(Duration::from_secs(5), || {
            !c.exists::<_, bool>("oxidekiq:lock:SequentialReportJob")
                .unwrap()
        }),
        "the lock stayed after the last report"
    );
    assert_eq!(c.zcard::<_, usize>("retry").unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_killed_while_holding_a_lock_blocks_others_no_longer_than_the_ttl() {
    // `oxidekiq_workers::REPORT_LOCK_TTL`, the lock TTL the binary's report jobs use.
    let ttl = Duration::from_secs(5);
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let mut holder = oxidekiq(&redis, "1");
    wait_for_processes(&mut c, 1);
    let client = Client::connect(&redis.url()).await.unwrap();
    let long = client
        .push(NewJob::new("SequentialReportJob", (30.0,)).queue("reports"))
        .await
        .unwrap();
    assert!(holder.wait_for_log("report started", Duration::from_secs(10)));
    let waiter = oxidekiq(&redis, "5");
    wait_for_processes(&mut c, 2);
    let next = client
        .push(NewJob::new("SequentialReportJob", (0.1,)).queue("reports"))
        .await
        .unwrap();
    // The holder runs longer than the TTL: its keeper extends the lock, so the waiter keeps waiting.
    // Time past the TTL is the point (the lock must NOT expire), so no event replaces this wait.
    tokio::time::sleep(ttl + ttl / 2).await;
    let value: String = c.get("oxidekiq:lock:SequentialReportJob").unwrap();
    assert!(value.ends_with(&format!(":{long}")), "{value}");
    assert!(lines(&[waiter.log()], "SequentialReportJob", "report started").is_empty());

    holder.kill_9();
    let killed_at = std::time::Instant::now();
    assert!(
        wait_until(ttl + Duration::from_secs(3), || {
            lines(&[waiter.log()], "SequentialReportJob", "report started")
                .iter()
                .any(|l| l.jid == next)
        }),
        "the waiter did not get the lock within the ttl of the crash"
    );
    let blocked = killed_at.elapsed();
    // The TTL, the waiter's poll and this test's log poll, with room for a loaded machine.
    assert!(
        blocked <= ttl + Duration::from_secs(3),
        "blocked {blocked:?} after the crash, ttl {ttl:?}"
    );
    // The keeper renews every ttl/3, so at least 2/3 of the TTL was left at the crash (less a keeper
    // running late on a loaded machine): a lock freed by the crash itself would let the waiter in at
    // once.
    assert!(
        blocked >= ttl / 3,
        "the lock was free too soon: {blocked:?}"
    );
}

// ---------------------------------------------------------------------------------------------------
// Contention across in-process launchers

/// Counts concurrent holders in Redis (`holders`, `max_holders`), runs 20 ms, records its jid in `done`.
#[derive(Debug)]
struct Contended;

impl Worker for Contended {
    const CLASS: &'static str = "ContendedJob";
    type Args = (u64,);

    async fn perform(&self, ctx: &JobContext, _: Self::Args) -> JobResult {
        let mut c = ctx.redis();
        support::count_in(&mut c, "holders", "max_holders").await?;
        tokio::time::sleep(Duration::from_millis(20)).await;
        let _: i64 = redis::AsyncCommands::decr(&mut c, "holders", 1).await?;
        let _: () = redis::AsyncCommands::rpush(&mut c, "done", ctx.jid()).await?;
        Ok(())
    }
}

fn contended_registry() -> Registry {
    let mut r = Registry::new();
    r.register(Contended).with(
        SequentialJob::new()
            .key("one-key")
            .poll(Duration::from_millis(50))
            .timeout(Duration::from_secs(60)),
    );
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_jobs_on_one_sequential_key_across_three_processes_never_run_two_at_once_and_all_run()
{
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let n = 40;
    for i in 0..n {
        push_raw(
            &mut c,
            "ContendedJob",
            &format!("[{i}]"),
            &format!("c{i:02}"),
        );
    }
    let mut handles = Vec::new();
    for _ in 0..3 {
        handles.push(launch(&redis.url(), 5, contended_registry()).await);
    }
    wait_for("every job", Duration::from_secs(60), || {
        c.llen::<_, usize>("done").unwrap() == n
    })
    .await;
    for h in handles {
        h.stop().await.unwrap();
    }
    let done: HashSet<String> = c
        .lrange::<_, Vec<String>>("done", 0, -1)
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(done.len(), n, "each job ran exactly once");
    let max: i64 = c.get("max_holders").unwrap();
    assert_eq!(max, 1, "two jobs held the lock at once");
    assert_eq!(c.zcard::<_, usize>("retry").unwrap(), 0, "none timed out");
    assert!(!c.exists::<_, bool>("oxidekiq:lock:one-key").unwrap());
}

// ---------------------------------------------------------------------------------------------------
// Conflict strategies and keys

#[derive(Debug)]
struct RescheduledDup;
impl Worker for RescheduledDup {
    const CLASS: &'static str = "RescheduledDup";
    type Args = NoArgs;
    async fn perform(&self, ctx: &JobContext, _: NoArgs) -> JobResult {
        record_run(ctx).await;
        Ok(())
    }
}

#[derive(Debug)]
struct FailedDup;
impl Worker for FailedDup {
    const CLASS: &'static str = "FailedDup";
    type Args = NoArgs;
    async fn perform(&self, ctx: &JobContext, _: NoArgs) -> JobResult {
        record_run(ctx).await;
        Ok(())
    }
}

/// Unique per customer id, whatever the other arguments.
#[derive(Debug)]
struct ChargeCustomer;
impl Worker for ChargeCustomer {
    const CLASS: &'static str = "ChargeCustomer";
    type Args = (u64, Value);
    async fn perform(&self, ctx: &JobContext, _: Self::Args) -> JobResult {
        record_run(ctx).await;
        Ok(())
    }
}

/// Unique per argument list.
#[derive(Debug)]
struct ByArgsJob;
impl Worker for ByArgsJob {
    const CLASS: &'static str = "ByArgsJob";
    type Args = Vec<Value>;
    async fn perform(&self, ctx: &JobContext, _: Self::Args) -> JobResult {
        record_run(ctx).await;
        Ok(())
    }
}

fn conflict_registry() -> Registry {
    let mut r = Registry::new();
    r.register(RescheduledDup)
        .with(UniqueJob::new().on_conflict(OnConflict::Reschedule(Duration::from_secs(30))))
        .register(FailedDup)
        .with(UniqueJob::new().on_conflict(OnConflict::Fail))
        .register(ChargeCustomer)
        .with_key(UniqueJob::new(), |(customer_id, _)| {
            format!("stripe-{customer_id}")
        })
        .register(ByArgsJob)
        .with(UniqueJob::new().key_by_args());
    r
}

/// Holds `oxidekiq:lock:<name>` as another job `holder` would.
fn hold(c: &mut redis::Connection, name: &str, holder: &str) {
    let _: () = redis::cmd("SET")
        .arg(format!("oxidekiq:lock:{name}"))
        .arg(format!("0123456789abcdef0123456789abcdef:{holder}"))
        .arg("PX")
        .arg(60_000)
        .query(c)
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_is_rescheduled_or_failed_into_the_retry_path_when_configured() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    hold(&mut c, "RescheduledDup", "holderaaaaaaaaaaaaaaaaaa");
    hold(&mut c, "FailedDup", "holderbbbbbbbbbbbbbbbbbb");
    push_raw(&mut c, "RescheduledDup", "[]", "resched000000000000000000");
    push_raw(&mut c, "FailedDup", "[]", "failed000000000000000000");
    let before = support::now();
    let h = launch(&redis.url(), 2, conflict_registry()).await;
    wait_for("both fates", Duration::from_secs(10), || {
        c.zcard::<_, usize>("schedule").unwrap() == 1 && c.zcard::<_, usize>("retry").unwrap() == 1
    })
    .await;
    h.stop().await.unwrap();
    assert!(ran(&mut c).is_empty(), "a duplicate ran");

    let scheduled: Vec<(String, f64)> = c.zrange_withscores("schedule", 0, -1).unwrap();
    let (member, at) = &scheduled[0];
    assert!(member.contains("resched000000000000000000"));
    assert!(
        !member.contains("error_class"),
        "a reschedule is not a failure"
    );
    assert!(*at >= before + 29.0 && *at <= support::now() + 31.0, "{at}");

    let retried: Vec<String> = c.zrange("retry", 0, -1).unwrap();
    let m: Value = serde_json::from_str(&retried[0]).unwrap();
    assert_eq!(m["jid"], "failed000000000000000000");
    assert_eq!(m["error_class"], "Oxidekiq::DuplicateJob");
    let msg = m["error_message"].as_str().unwrap();
    assert!(
        msg.contains("oxidekiq:lock:FailedDup") && msg.contains("holderbbbbbbbbbbbbbbbbbb"),
        "{msg}"
    );
    assert_eq!(m["retry_count"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_and_args_keys_lock_per_customer_and_per_canonical_argument_list() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    hold(&mut c, "stripe-7", "holderaaaaaaaaaaaaaaaaaa");
    let digest = args_digest(&json!([{"a": 1, "b": 2}]));
    hold(
        &mut c,
        &format!("ByArgsJob:{digest}"),
        "holderbbbbbbbbbbbbbbbbbb",
    );
    // Duplicates first (one slot: they are served in order), then jobs with other keys.
    push_raw(&mut c, "ChargeCustomer", r#"[7,{"amount":5}]"#, "cust7");
    push_raw(&mut c, "ByArgsJob", r#"[{"b":2,"a":1}]"#, "args12");
    push_raw(&mut c, "ChargeCustomer", r#"[8,{"amount":5}]"#, "cust8");
    push_raw(&mut c, "ByArgsJob", r#"[{"a":1,"b":3}]"#, "args13");
    let h = launch(&redis.url(), 1, conflict_registry()).await;
    wait_for("the jobs with free keys", Duration::from_secs(10), || {
        ran(&mut c).len() == 2
    })
    .await;
    h.stop().await.unwrap();
    assert_eq!(ran(&mut c), ["ChargeCustomer:cust8", "ByArgsJob:args13"]);
    // The duplicates were acknowledged (skipped), not retried or requeued.
    assert_eq!(c.llen::<_, usize>("queue:default").unwrap(), 0);
    assert_eq!(c.zcard::<_, usize>("retry").unwrap(), 0);
    assert_eq!(c.zcard::<_, usize>("schedule").unwrap(), 0);
    // Their own locks were released; the held ones were not touched.
    assert!(!c.exists::<_, bool>("oxidekiq:lock:stripe-8").unwrap());
    let held: String = c.get("oxidekiq:lock:stripe-7").unwrap();
    assert!(held.ends_with(":holderaaaaaaaaaaaaaaaaaa"));
}

// ---------------------------------------------------------------------------------------------------
// Until-executed locks taken by the Rust client

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_until_executed_duplicate_is_refused_while_queued_or_running_and_accepted_after() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let client = Client::connect(&redis.url()).await.unwrap();
    let job = || {
        NewJob::new("UniqueReportJob", (1.5,))
            .queue("reports")
            .unique_for(Duration::from_secs(60))
    };
    let key = until_executed::lock_key("UniqueReportJob", &json!([1.5]));

    let first = client
        .push_unique(job())
        .await
        .unwrap()
        .expect("the first push is accepted");
    assert_eq!(
        client.push_unique(job()).await.unwrap(),
        None,
        "refused while queued"
    );
    match client.push(job()).await {
        Err(Error::LockNotAcquired(msg)) => assert!(msg.contains("UniqueReportJob"), "{msg}"),
        other => panic!("push of a duplicate: {other:?}"),
    }
    assert_eq!(c.llen::<_, usize>("queue:reports").unwrap(), 1);
    assert_eq!(c.get::<_, String>(&key).unwrap(), first);
    let payload: String = c.lindex("queue:reports", 0).unwrap();
    let m: Value = serde_json::from_str(&payload).unwrap();
    assert_eq!(m["unique_key"], key.as_str());
    assert_eq!(m["unique_ttl"], 60.0);
    // Another argument list is another job (pushed where no process reads: the class's own unique
    // middleware would skip whichever of the two ran second).
    let other = NewJob::new("UniqueReportJob", (0.1,))
        .queue("elsewhere")
        .unique_for(Duration::from_secs(60));
    assert!(client.push_unique(other).await.unwrap().is_some());

    let a = oxidekiq(&redis, "5");
    let b = oxidekiq(&redis, "5");
    assert!(wait_until(Duration::from_secs(15), || {
        lines(&logs(&[&a, &b]), "UniqueReportJob", "report started")
            .iter()
            .any(|l| l.jid == first)
    }));
    assert_eq!(
        client.push_unique(job()).await.unwrap(),
        None,
        "refused while running"
    );

    assert!(
        wait_until(Duration::from_secs(10), || {
            !c.exists::<_, bool>(&key).unwrap()
        }),
        "the lock was not released when the job finished"
    );
    // Log lines reach the file within a flush interval of the lock's release.
    assert!(wait_until(Duration::from_secs(5), || {
        lines(&logs(&[&a, &b]), "UniqueReportJob", "report finished")
            .iter()
            .any(|l| l.jid == first)
    }));
    let again = client.push_unique(job()).await.unwrap();
    assert!(again.is_some(), "accepted once the first finished");
    assert_ne!(again.as_deref(), Some(first.as_str()));
}

/// Fails every time, asking for a retry in 1 s.
#[derive(Debug)]
struct AlwaysFails;
impl Worker for AlwaysFails {
    const CLASS: &'static str = "AlwaysFails";
    type Args = (u64,);
    async fn perform(&self, ctx: &JobContext, _: Self::Args) -> JobResult {
        record_run(ctx).await;
        Err(JobError::msg("boom").retry_in(1))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_until_executed_lock_is_kept_during_retries_and_released_when_the_job_dies_or_is_discarded()
 {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let client = Client::connect(&redis.url()).await.unwrap();
    let dying = || {
        NewJob::new("AlwaysFails", (1,))
            .retry(1)
            .unique_for(Duration::from_secs(60))
    };
    let discarded = || {
        NewJob::new("AlwaysFails", (2,))
            .no_retry()
            .unique_for(Duration::from_secs(60))
    };
    let dying_key = until_executed::lock_key("AlwaysFails", &json!([1]));
    let discarded_key = until_executed::lock_key("AlwaysFails", &json!([2]));
    assert!(client.push_unique(dying()).await.unwrap().is_some());
    assert!(client.push_unique(discarded()).await.unwrap().is_some());

    let mut r = Registry::new();
    r.register(AlwaysFails);
    let h = launch(&redis.url(), 2, r).await;
    wait_for("the first failure", Duration::from_secs(10), || {
        c.zcard::<_, usize>("retry").unwrap() == 1
    })
    .await;
    // Waiting for its retry, the job is still pending: a duplicate is refused.
    assert_eq!(client.push_unique(dying()).await.unwrap(), None);
    assert!(c.exists::<_, bool>(&dying_key).unwrap());
    // The job without retries was discarded: its lock is gone.
    wait_for(
        "the discarded job's lock to go",
        Duration::from_secs(5),
        || !c.exists::<_, bool>(&discarded_key).unwrap(),
    )
    .await;

    wait_for("the dead job", Duration::from_secs(15), || {
        c.zcard::<_, usize>("dead").unwrap() == 1
    })
    .await;
    wait_for("the dead job's lock to go", Duration::from_secs(5), || {
        !c.exists::<_, bool>(&dying_key).unwrap()
    })
    .await;
    h.stop().await.unwrap();
    assert_eq!(
        ran(&mut c).len(),
        3,
        "two runs of the dying job, one of the discarded one"
    );
    assert!(client.push_unique(dying()).await.unwrap().is_some());
    assert!(client.push_unique(discarded()).await.unwrap().is_some());
}

/// Numbers its runs (`runs`), records each start in `started` as its run number, then waits until
/// the key `finish:<run>` exists and records the end in `finished`.
#[derive(Debug)]
struct TwoRuns;
impl Worker for TwoRuns {
    const CLASS: &'static str = "TwoRunsJob";
    type Args = (u64,);
    async fn perform(&self, ctx: &JobContext, _: Self::Args) -> JobResult {
        let mut c = ctx.redis();
        let n: i64 = redis::AsyncCommands::incr(&mut c, "runs", 1).await?;
        let _: () = redis::AsyncCommands::rpush(&mut c, "started", n).await?;
        while !redis::AsyncCommands::exists::<_, bool>(&mut c, format!("finish:{n}")).await? {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _: () = redis::AsyncCommands::rpush(&mut c, "finished", n).await?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_run_of_an_until_executed_job_cannot_release_the_lock_of_a_newer_run() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let client = Client::connect(&redis.url()).await.unwrap();
    let job = || NewJob::new("TwoRunsJob", (7,)).unique_for(Duration::from_secs(60));
    let key = until_executed::lock_key("TwoRunsJob", &json!([7]));
    let jid = client.push_unique(job()).await.unwrap().expect("pushed");
    let payload: String = c.lindex("queue:default", 0).unwrap();
    assert_eq!(
        c.get::<_, String>(&key).unwrap(),
        jid,
        "the push holds the lock by jid"
    );

    let mut r = Registry::new();
    r.register(TwoRuns);
    let h = launch(&redis.url(), 2, r).await;
    wait_for("run 1", Duration::from_secs(10), || {
        c.llen::<_, usize>("started").unwrap() == 1
    })
    .await;
    let first: String = c.get(&key).unwrap();
    // The same payload again, as the recovery of a process presumed dead pushes it back while that
    // process still runs it: a second run of the same jid takes the lock over with its own token.
    let _: () = c.lpush("queue:default", &payload).unwrap();
    wait_for("run 2", Duration::from_secs(10), || {
        c.llen::<_, usize>("started").unwrap() == 2
    })
    .await;
    let second: String = c.get(&key).unwrap();

    // Run 1 (the stale one) ends first: it must not free the lock run 2 holds.
    let _: () = c.set("finish:1", 1).unwrap();
    wait_for("run 1's end", Duration::from_secs(10), || {
        c.llen::<_, usize>("finished").unwrap() == 1
    })
    .await;
    // Its fate is settled right after the worker returns; wait for its ack to be sure it was.
    wait_for("run 1's ack", Duration::from_secs(10), || {
        let keys: Vec<String> = c.keys("oxidekiq:batch:*").unwrap();
        keys.iter()
            .map(|k| support::held_in(&mut c, k).len())
            .sum::<usize>()
            == 1
    })
    .await;
    assert_eq!(
        c.get::<_, Option<String>>(&key).unwrap().as_deref(),
        Some(second.as_str()),
        "the stale run released the newer run's lock"
    );
    // Each run held the lock as `<token>:<jid>`, a token of its own.
    for value in [&first, &second] {
        let (token, holder) = value.split_once(':').expect("<token>:<jid>");
        assert_eq!(holder, jid);
        assert_eq!(token.len(), 32, "{value}");
    }
    assert_ne!(
        second, first,
        "run 2 holds the lock with a token of its own"
    );
    assert_eq!(
        client.push_unique(job()).await.unwrap(),
        None,
        "refused while run 2 runs"
    );

    let _: () = c.set("finish:2", 1).unwrap();
    wait_for("run 2's release", Duration::from_secs(10), || {
        !c.exists::<_, bool>(&key).unwrap()
    })
    .await;
    h.stop().await.unwrap();
    assert!(client.push_unique(job()).await.unwrap().is_some());
}

// ---------------------------------------------------------------------------------------------------
// Round trips: what a lock costs in Redis commands (issue 15), counted with MONITOR, never timed

/// The lock commands a [`Monitor`] saw.
trait LockCommands {
    fn lock_commands(&self) -> Vec<(String, String)>;
}

impl LockCommands for Monitor {
    /// `(command, lock key)` for every `oxidekiq:lock:` key each command a client sent names (once per
    /// key and command: a batched release names many keys in one `EVALSHA`).
    fn lock_commands(&self) -> Vec<(String, String)> {
        self.lines()
            .iter()
            .filter(|l| !l.contains(" lua]"))
            .flat_map(|l| {
                let quoted: Vec<&str> = l.split('"').skip(1).step_by(2).collect();
                let mut keys: Vec<&str> = quoted
                    .iter()
                    .copied()
                    .filter(|t| t.starts_with("oxidekiq:lock:"))
                    .collect();
                keys.dedup();
                let command = quoted.first().map(|c| c.to_uppercase()).unwrap_or_default();
                keys.into_iter()
                    .map(move |k| (command.clone(), k.to_string()))
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

/// A no-op behind a unique lock keyed by its arguments.
#[derive(Debug)]
struct UniqueNoop;
impl Worker for UniqueNoop {
    const CLASS: &'static str = "UniqueNoop";
    type Args = (u64,);
    async fn perform(&self, ctx: &JobContext, _: Self::Args) -> JobResult {
        record_run(ctx).await;
        Ok(())
    }
}

/// A no-op behind a sequential lock keyed by its arguments.
#[derive(Debug)]
struct SequentialNoop;
impl Worker for SequentialNoop {
    const CLASS: &'static str = "SequentialNoop";
    type Args = (u64,);
    async fn perform(&self, ctx: &JobContext, _: Self::Args) -> JobResult {
        record_run(ctx).await;
        Ok(())
    }
}

/// A no-op without a lock of its own, pushed with `unique_for` (until-executed).
#[derive(Debug)]
struct PlainNoop;
impl Worker for PlainNoop {
    const CLASS: &'static str = "PlainNoop";
    type Args = (u64,);
    async fn perform(&self, ctx: &JobContext, _: Self::Args) -> JobResult {
        record_run(ctx).await;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_costs_one_command_at_the_start_of_a_job_and_one_at_its_end() {
    const JOBS: u64 = 4;
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let client = Client::connect(&redis.url()).await.unwrap();
    let push_all = |c: &mut redis::Connection, from: u64, to: u64| {
        let mut jobs = Vec::new();
        for i in from..to {
            push_raw(c, "UniqueNoop", &format!("[{i}]"), &format!("u{i}"));
            push_raw(c, "SequentialNoop", &format!("[{i}]"), &format!("s{i}"));
            jobs.push(NewJob::new("PlainNoop", (i,)).unique_for(Duration::from_secs(60)));
        }
        jobs
    };
    let mut r = Registry::new();
    r.register(UniqueNoop)
        .with(UniqueJob::new().key_by_args())
        .register(SequentialNoop)
        .with(SequentialJob::new().key_by_args())
        .register(PlainNoop);
    let h = launch(&redis.url(), 4, r).await;
    let mut total = 0;
    let mut monitor = None;
    // A first round teaches Redis the scripts (one NOSCRIPT each, then EVAL or SCRIPT LOAD); the
    // second round, under MONITOR, is the steady state every later job sees.
    for (from, to) in [(100, 101), (0, JOBS)] {
        if from == 0 {
            monitor = Some(Monitor::start(&redis));
        }
        for job in push_all(&mut c, from, to) {
            assert!(client.push_unique(job).await.unwrap().is_some());
        }
        total += 3 * (to - from) as usize;
        wait_for("every job", Duration::from_secs(20), || {
            ran(&mut c).len() == total
        })
        .await;
        wait_for("every lock released", Duration::from_secs(10), || {
            c.keys::<_, Vec<String>>("oxidekiq:lock:*")
                .unwrap()
                .is_empty()
        })
        .await;
    }
    h.stop().await.unwrap();
    let commands = monitor.expect("started").lock_commands();

    let mut by_key: HashMap<String, Vec<String>> = HashMap::new();
    for (command, key) in commands {
        if command != "KEYS" {
            by_key.entry(key).or_default().push(command);
        }
    }
    assert_eq!(by_key.len(), 3 * JOBS as usize, "{by_key:?}");
    for (key, commands) in &by_key {
        let expected: &[&str] = if key.starts_with("oxidekiq:lock:unique:") {
            // The push (lock and job in one script), the run's claim, the release at its end.
            &["EVALSHA", "EVALSHA", "EVALSHA"]
        } else {
            // One SET NX PX at the start, one compare-and-delete at the end.
            &["SET", "EVALSHA"]
        };
        assert_eq!(commands, expected, "{key}");
    }
}

// ---------------------------------------------------------------------------------------------------
// The client chain

/// Marks every job it lets through and refuses those whose first argument is 13.
#[derive(Debug)]
struct Superstitious;
impl oxidekiq::client::ClientMiddleware for Superstitious {
    fn call<'a>(
        &'a self,
        push: &'a mut oxidekiq::client::Push,
        next: oxidekiq::client::ClientNext<'a>,
    ) -> oxidekiq::middleware::BoxFuture<'a, oxidekiq::client::Pushed> {
        Box::pin(async move {
            if push.job.args()[0] == json!(13) {
                return Ok(None);
            }
            push.job.set_option("checked_by", json!("superstitious"));
            next.run(push).await
        })
    }
}

#[tokio::test]
async fn a_client_middleware_sees_every_push_single_or_bulk_and_may_refuse_it() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let client = Client::connect(&redis.url())
        .await
        .unwrap()
        .middleware(Superstitious);
    let jids = client
        .push_bulk(NewJob::new("HardWorker", ()), [(1,), (13,), (2,)])
        .await
        .unwrap();
    assert_eq!(jids.len(), 2, "the bulk's 13 was refused");
    assert!(client.push(NewJob::new("HardWorker", (3,))).await.is_ok());
    assert!(matches!(
        client.push(NewJob::new("HardWorker", (13,))).await,
        Err(Error::LockNotAcquired(_))
    ));
    assert_eq!(
        client
            .push_unique(NewJob::new("HardWorker", (13,)))
            .await
            .unwrap(),
        None
    );
    let queued: Vec<String> = c.lrange("queue:default", 0, -1).unwrap();
    let mut args: Vec<i64> = queued
        .iter()
        .map(|p| {
            let m: Value = serde_json::from_str(p).unwrap();
            assert_eq!(m["checked_by"], "superstitious", "{p}");
            m["args"][0].as_i64().unwrap()
        })
        .collect();
    args.sort_unstable();
    assert_eq!(args, [1, 2, 3]);
    for jid in &jids {
        assert!(queued.iter().any(|p| p.contains(jid.as_str())), "{jid}");
    }
}

/// A job refused before any worker runs (no worker for its class here) still settles its until-executed
/// lock with its fate: kept while it waits for a retry, released once it is dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_until_executed_job_of_an_unregistered_class_keeps_its_lock_for_a_retry_and_frees_it_dead()
 {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let client = Client::connect(&redis.url()).await.unwrap();
    let job = |n: u64| NewJob::new("NobodyHere", (n,)).unique_for(Duration::from_secs(60));
    let retried_key = until_executed::lock_key("NobodyHere", &json!([1]));
    let dead_key = until_executed::lock_key("NobodyHere", &json!([2]));
    assert!(client.push_unique(job(1)).await.unwrap().is_some());

    // Unknown classes go to the retry set: the job is still pending, so is its lock.
    let mut config = support::config(&redis.url(), &["default"], 2);
    config.unknown_class = oxidekiq::config::UnknownClass::Retry;
    let h = support::launch(config.clone(), Registry::new()).await;
    wait_for("the retry entry", Duration::from_secs(10), || {
        c.zcard::<_, usize>("retry").unwrap() == 1
    })
    .await;
    h.stop().await.unwrap();
    assert!(c.exists::<_, bool>(&retried_key).unwrap());
    assert_eq!(client.push_unique(job(1)).await.unwrap(), None);

    // Unknown classes go to the dead set: the job is finished, its lock is released.
    assert!(client.push_unique(job(2)).await.unwrap().is_some());
    config.unknown_class = oxidekiq::config::UnknownClass::Dead;
    let h = support::launch(config, Registry::new()).await;
    wait_for("the dead job", Duration::from_secs(10), || {
        c.zcard::<_, usize>("dead").unwrap() == 1
    })
    .await;
    wait_for("the dead job's lock to go", Duration::from_secs(5), || {
        !c.exists::<_, bool>(&dead_key).unwrap()
    })
    .await;
    h.stop().await.unwrap();
    assert!(client.push_unique(job(2)).await.unwrap().is_some());
}

/// An until-executed push whose queue write fails (the queue key holds a string) returns the error and
/// leaves no lock behind: a later push, once the key is fixed, is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_until_executed_push_that_cannot_write_its_job_leaves_no_lock() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let client = Client::connect(&redis.url()).await.unwrap();
    let job = || NewJob::new("PlainNoop", (9,)).unique_for(Duration::from_secs(60));
    let key = until_executed::lock_key("PlainNoop", &json!([9]));
    let _: () = c.set("queue:default", "not a list").unwrap();
    let err = client.push_unique(job()).await.unwrap_err().to_string();
    assert!(
        err.contains("queue:default") && err.contains("is a string, not a list"),
        "{err}"
    );
    assert!(
        !c.exists::<_, bool>(&key).unwrap(),
        "no lock without its job"
    );
    let _: () = c.del("queue:default").unwrap();
    assert!(client.push_unique(job()).await.unwrap().is_some());
    assert!(c.exists::<_, bool>(&key).unwrap());
    assert_eq!(c.llen::<_, usize>("queue:default").unwrap(), 1);
}
