//! `oxidekiq::testing`, used as a user crate uses it (the public API only): each helper gives the
//! outcome production would, and each assertion fails, with a message naming what it saw, when it
//! should. Redis only where a test asks for it (`TestRedis`, a `redis-server` of the test's own).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use oxidekiq::iterable::{Enumerator, IterableWorker};
use oxidekiq::job::WorkerOptions;
use oxidekiq::testing::{
    self, Expected, FakeClient, Fate, Iteration, TestJob, TestRedis, TestShutdown,
};
use oxidekiq::{
    BoxFuture, Client, JobContext, JobError, JobResult, NewJob, Next, OnConflict, Registry,
    ServerMiddleware, UniqueJob, Worker,
};

/// `HardWorker` of the README: fails on a negative count, sleeps `count` ms, stops at the deadline.
#[derive(Debug, Default)]
struct HardWorker;

impl Worker for HardWorker {
    const CLASS: &'static str = "HardWorker";
    type Args = (String, i64);

    async fn perform(&self, ctx: &JobContext, (name, count): Self::Args) -> JobResult {
        if count < 0 {
            return Err(JobError::new(
                "ArgumentError",
                format!("count must not be negative, got {count} for {name}"),
            ));
        }
        let mut shutdown = ctx.shutdown();
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(count as u64)) => Ok(()),
            _ = shutdown.cancelled() => Err(JobError::msg("interrupted by shutdown")),
        }
    }
}

/// Answers as its argument says: Sidekiq's `sidekiq_retry_in` answers and the panics of a bug.
#[derive(Debug)]
struct Answer;

impl Worker for Answer {
    const CLASS: &'static str = "Answer";
    type Args = (String,);

    fn options(&self) -> WorkerOptions {
        WorkerOptions {
            timeout: Some(Duration::from_millis(50)),
            ..WorkerOptions::default()
        }
    }

    async fn perform(&self, ctx: &JobContext, (what,): Self::Args) -> JobResult {
        match what.as_str() {
            "ok" => Ok(()),
            "kill" => Err(JobError::msg("bad").kill()),
            "discard" => Err(JobError::msg("gone").discard()),
            "in" => Err(JobError::msg("later").retry_in(100)),
            "reschedule" => Err(JobError::reschedule(30.0, "not yet")),
            "panic" => panic!("a bug in the worker"),
            "hang" => {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok(())
            }
            "redis" => {
                redis::cmd("PING")
                    .query_async::<String>(&mut ctx.redis())
                    .await?;
                Ok(())
            }
            other => Err(JobError::msg(format!("unknown answer {other}"))),
        }
    }
}

#[tokio::test]
async fn a_job_that_succeeds_is_done_and_one_that_fails_gets_sidekiqs_first_retry_window() {
    testing::perform(&HardWorker, ("bob", 5))
        .await
        .assert_done();
    let failed = testing::perform(&HardWorker, ("eve", -1)).await;
    let error = failed.assert_retry(0);
    assert_eq!(error.class, "ArgumentError");
    let Fate::Retry { count, at, delay } = &failed.fate else {
        panic!("{:?}", failed.fate)
    };
    // Sidekiq 8's `count**4 + 15 + rand(10 * (count + 1))`.
    assert_eq!((*count, delay.clone()), (0, 15.0..=24.0));
    let written = failed.written().unwrap();
    assert_eq!(written["error_class"], "ArgumentError");
    assert_eq!(written["retry_count"], 0);
    let in_secs = at - written["failed_at"].as_f64().unwrap();
    assert!(delay.contains(&in_secs.round()), "{in_secs}");
}

#[tokio::test]
async fn a_retried_job_counts_on_and_dies_when_its_retries_are_spent() {
    let third = TestJob::of::<HardWorker>(("eve", -1)).retry_count(2);
    let outcome = third.perform(&HardWorker).await;
    outcome.assert_retry(3);
    let Fate::Retry { delay, .. } = &outcome.fate else {
        unreachable!()
    };
    // 3**4 + 15, plus up to 10 * 4 - 1.
    assert_eq!(delay.clone(), 96.0..=135.0);
    // The retry's payload runs next: its failure is retry 4.
    outcome
        .next_run()
        .perform(&HardWorker)
        .await
        .assert_retry(4);
    let last = TestJob::new(NewJob::new("HardWorker", ("eve", -1)).retry(2)).retry_count(1);
    last.perform(&HardWorker).await.assert_dead();
    let once = TestJob::new(NewJob::new("HardWorker", ("eve", -1)).no_retry());
    once.perform(&HardWorker).await.assert_discarded();
}

#[tokio::test]
async fn each_answer_of_a_worker_gets_the_fate_the_processor_gives_it() {
    assert_eq!(testing::perform(&Answer, ("kill",)).await.fate, Fate::Dead);
    assert_eq!(
        testing::perform(&Answer, ("discard",)).await.fate,
        Fate::Discarded
    );
    let later = testing::perform(&Answer, ("in",)).await;
    let Fate::Retry { delay, .. } = &later.fate else {
        panic!("{:?}", later.fate)
    };
    assert_eq!(delay.clone(), 100.0..=109.0);
    let rescheduled = testing::perform(&Answer, ("reschedule",)).await;
    assert!(
        matches!(rescheduled.fate, Fate::Rescheduled { .. }),
        "{:?}",
        rescheduled.fate
    );
    assert!(
        rescheduled
            .written_text()
            .unwrap()
            .contains(r#""args":["reschedule"]"#)
    );
    let panicked = testing::perform(&Answer, ("panic",)).await;
    let error = panicked.assert_retry(0);
    assert_eq!(error.class, "Oxidekiq::Panic");
    assert!(error.message.contains("a bug in the worker"), "{error}");
    let hung = testing::perform(&Answer, ("hang",)).await;
    assert_eq!(hung.assert_retry(0).class, "Oxidekiq::JobTimeout");
}

#[tokio::test]
async fn arguments_that_do_not_fit_the_args_type_fail_as_in_production() {
    let wrong = testing::perform(&HardWorker, ("bob", "five")).await;
    let error = wrong.assert_retry(0);
    assert_eq!(error.class, "ArgumentError");
    assert!(
        error.message.contains("arguments do not fit HardWorker"),
        "{error}"
    );
    let short = testing::perform(&HardWorker, ("bob",)).await;
    assert_eq!(short.assert_retry(0).class, "ArgumentError");
}

#[tokio::test]
async fn a_payload_of_another_class_is_a_name_error_and_one_that_does_not_decode_is_dead() {
    let other =
        testing::perform_payload(&HardWorker, r#"{"class":"Other","args":[],"jid":"j"}"#).await;
    assert_eq!(other.assert_retry(0).class, "NameError");
    let broken = testing::perform_payload(&HardWorker, "{not json").await;
    assert_eq!(broken.assert_dead().class, "Oxidekiq::InvalidPayload");
    assert_eq!(broken.written_text(), Some("{not json"));
}

/// ActiveJob's `WelcomeEmailJob.perform_later(42, locale: "fr")`: `perform(user_id, options = {})`.
#[derive(Debug)]
struct WelcomeEmailJob(Arc<std::sync::Mutex<Vec<(u64, String, String)>>>);

#[derive(Debug, serde::Deserialize)]
struct Locale {
    locale: String,
}

impl Worker for WelcomeEmailJob {
    const CLASS: &'static str = "WelcomeEmailJob";
    type Args = (u64, Locale);

    async fn perform(&self, ctx: &JobContext, (id, options): Self::Args) -> JobResult {
        let job_id = ctx
            .activejob()
            .map(|a| a.job_id.clone())
            .unwrap_or_default();
        self.0.lock().unwrap().push((id, options.locale, job_id));
        Ok(())
    }
}

#[tokio::test]
async fn payloads_as_rails_wrote_them_run_plain_and_activejob() {
    let plain = include_str!("../../fixtures/sidekiq-6.4.1/enqueued_plain.json");
    testing::perform_payload(&HardWorker, plain)
        .await
        .assert_done();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mail = include_str!("../../fixtures/activejob-6.1/mailers_queue.json");
    testing::perform_payload(&WelcomeEmailJob(seen.clone()), mail)
        .await
        .assert_done();
    assert_eq!(
        *seen.lock().unwrap(),
        [(
            42,
            "fr".to_string(),
            "2af3c78c-4ade-4482-8616-466695b9d11b".to_string()
        )]
    );
    // The same job enqueued from Rust, as `Client::perform_later` pushes it.
    let job = NewJob::activejob(
        "WelcomeEmailJob",
        "mailers",
        vec![serde_json::json!(7), serde_json::json!({"locale": "de"})],
    );
    let ctx = TestJob::new(job.clone()).context();
    assert_eq!(ctx.queue(), "mailers");
    TestJob::new(job)
        .perform(&WelcomeEmailJob(seen.clone()))
        .await
        .assert_done();
    assert_eq!(seen.lock().unwrap()[1].1, "de");
}

#[tokio::test]
async fn a_context_has_the_jobs_ids_and_no_redis_unless_given_one_which_it_says() {
    let job =
        TestJob::new(NewJob::new("Answer", ("redis",)).jid("abc").queue("low")).retry_count(4);
    let ctx = job.context();
    assert_eq!(
        (ctx.jid(), ctx.queue(), ctx.class()),
        ("abc", "low", "Answer")
    );
    assert_eq!(ctx.job().to_map().unwrap()["retry_count"], 4);
    assert_eq!(ctx.args::<(String,)>().unwrap().0, "redis");
    let without = job.perform(&Answer).await;
    let error = without.assert_retry(5);
    assert!(error.message.contains("no Redis"), "{error}");
    assert!(error.message.contains("TestJob::redis"), "{error}");
    let redis = TestRedis::start();
    job.redis(&redis).perform(&Answer).await.assert_done();
}

#[tokio::test]
async fn a_worker_stopped_by_the_shutdown_deadline_is_pushed_back_without_a_fate() {
    let shutdown = TestShutdown::new();
    let job = TestJob::of::<HardWorker>(("bob", 60_000)).shutdown(&shutdown);
    let ctx = job.context();
    assert!(!ctx.shutdown().is_stopping());
    shutdown.stop();
    assert!(ctx.shutdown().is_stopping() && !ctx.shutdown().is_cancelled());
    let (outcome, ()) = tokio::join!(job.perform(&HardWorker), async {
        tokio::task::yield_now().await;
        shutdown.cancel();
    });
    assert_eq!(outcome.fate, Fate::PushedBack);
    assert_eq!(outcome.error().message, "interrupted by shutdown");
}

#[test]
#[should_panic(
    expected = "expected the job to succeed, but it failed with ArgumentError: count must not be negative"
)]
fn assert_done_fails_on_a_failed_job() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(testing::perform(&HardWorker, ("eve", -1)))
        .assert_done();
}

#[test]
#[should_panic(expected = "expected retry number 1, but the fate is Retry { count: 0")]
fn assert_retry_fails_on_another_count() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(testing::perform(&HardWorker, ("eve", -1)))
        .assert_retry(1);
}

#[test]
#[should_panic(expected = "expected the fate Dead, but it is Done (the run succeeded)")]
fn assert_dead_fails_on_a_done_job() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(testing::perform(&HardWorker, ("bob", 1)))
        .assert_dead();
}

/// A producer under test: signs up a user and enqueues the welcome mail and a report for later.
async fn sign_up(client: &Client, user: u64) -> oxidekiq::Result<()> {
    client
        .perform_later(
            "WelcomeEmailJob",
            "mailers",
            vec![serde_json::json!(user), serde_json::json!({"locale": "en"})],
        )
        .await?;
    client
        .push(
            NewJob::new("ReportJob", (user,))
                .queue("low")
                .run_in(3600.0),
        )
        .await?;
    Ok(())
}

#[tokio::test]
async fn the_fake_client_records_pushes_and_checks_class_args_queue_and_time() {
    let fake = FakeClient::new();
    sign_up(&fake.client(), 42).await.unwrap();
    let mails = fake.jobs("WelcomeEmailJob");
    assert_eq!(mails.len(), 1);
    assert_eq!(mails[0].args, serde_json::json!([42, {"locale": "en"}]));
    fake.assert_enqueued(
        &Expected::new("WelcomeEmailJob")
            .args((42, serde_json::json!({"locale": "en"})))
            .queue("mailers")
            .now(),
    );
    let report = fake.assert_enqueued(
        &Expected::new("ReportJob")
            .args((42,))
            .queue("low")
            .in_secs(3600.0),
    );
    assert!(
        !report.payload.contains("enqueued_at"),
        "{}",
        report.payload
    );
    fake.refute_enqueued(&Expected::new("ReportJob").now());
    fake.refute_enqueued(&Expected::new("ReportJob").in_secs(60.0));
    fake.refute_enqueued(&Expected::new("HardWorker"));
    // Until-executed pushes are recorded too, without Redis; cancel needs Redis and says so.
    fake.client()
        .push(NewJob::new("HardWorker", ("a", 1)).unique_for(Duration::from_secs(60)))
        .await
        .unwrap();
    let pushed = &fake.jobs("HardWorker")[0];
    assert!(pushed.payload.contains("unique_key"), "{}", pushed.payload);
    // TestJob writes the same lock fields the client's default chain writes.
    let built =
        TestJob::new(NewJob::new("HardWorker", ("a", 1)).unique_for(Duration::from_secs(60)));
    let built = built.context().job().to_map().unwrap();
    let recorded = pushed.job().context().job().to_map().unwrap();
    assert_eq!(built["unique_key"], recorded["unique_key"]);
    assert_eq!(built["unique_ttl"], recorded["unique_ttl"]);
    // A recorded push runs as it is.
    pushed.job().perform(&HardWorker).await.assert_done();
    let e = fake.client().cancel("jid").await.unwrap_err();
    assert!(e.to_string().contains("fake client"), "{e}");
    fake.clear();
    assert!(fake.all_jobs().is_empty());
}

#[tokio::test]
async fn the_fake_clients_pushes_pass_its_client_middleware() {
    #[derive(Debug)]
    struct Stamp;
    impl oxidekiq::ClientMiddleware for Stamp {
        fn call<'a>(
            &'a self,
            push: &'a mut oxidekiq::Push,
            next: oxidekiq::ClientNext<'a>,
        ) -> BoxFuture<'a, oxidekiq::client::Pushed> {
            push.job.set_option("stamped", serde_json::json!(true));
            next.run(push)
        }
    }
    let fake = FakeClient::new();
    fake.client()
        .middleware(Stamp)
        .perform_async("HardWorker", ("a", 1))
        .await
        .unwrap();
    assert!(
        fake.jobs("HardWorker")[0]
            .payload
            .contains(r#""stamped":true"#)
    );
}

#[test]
#[should_panic(
    expected = "expected a HardWorker job with args [\"bob\",5], but the fake client holds 1 job(s):\n  HardWorker [\"bob\",4] on \"default\", now"
)]
fn assert_enqueued_fails_listing_what_was_pushed() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let fake = FakeClient::new();
    rt.block_on(fake.client().perform_async("HardWorker", ("bob", 4)))
        .unwrap();
    fake.assert_enqueued(&Expected::new("HardWorker").args(("bob", 5)));
}

#[test]
#[should_panic(
    expected = "expected a ReportJob job on \"low\" in 60 s, but the fake client holds 1 job(s):\n  ReportJob [1] on \"low\", at "
)]
fn assert_enqueued_fails_on_another_schedule_time() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let fake = FakeClient::new();
    rt.block_on(
        fake.client()
            .push(NewJob::new("ReportJob", (1,)).queue("low").run_in(3600.0)),
    )
    .unwrap();
    fake.assert_enqueued(&Expected::new("ReportJob").queue("low").in_secs(60.0));
}

#[test]
#[should_panic(expected = "expected no HardWorker job, but the fake client holds 1 job(s):")]
fn refute_enqueued_fails_when_one_was_pushed() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let fake = FakeClient::new();
    rt.block_on(fake.client().perform_async("HardWorker", ("bob", 4)))
        .unwrap();
    fake.refute_enqueued(&Expected::new("HardWorker"));
}

/// Pushes `n - 1` to its client until `n` is 0: a job whose pushes the drain runs too.
#[derive(Debug)]
struct Countdown(Client, Arc<AtomicUsize>);

impl Worker for Countdown {
    const CLASS: &'static str = "Countdown";
    type Args = (u64,);

    async fn perform(&self, _ctx: &JobContext, (n,): Self::Args) -> JobResult {
        self.1.fetch_add(1, Ordering::SeqCst);
        if n > 0 {
            self.0
                .perform_async("Countdown", (n - 1,))
                .await
                .map_err(|e| JobError::msg(e.to_string()))?;
        }
        Ok(())
    }
}

#[tokio::test]
async fn drain_runs_every_recorded_job_and_the_jobs_they_push() {
    let fake = FakeClient::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let mut registry = Registry::new();
    registry
        .register(Countdown(fake.client(), runs.clone()))
        .register(HardWorker);
    fake.client()
        .perform_async("Countdown", (3,))
        .await
        .unwrap();
    fake.client()
        .perform_async("HardWorker", ("eve", -1))
        .await
        .unwrap();
    fake.client().perform_async("Nobody", ()).await.unwrap();
    let outcomes = fake.drain(&registry).await;
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    assert_eq!(outcomes.len(), 6);
    outcomes[0].assert_done();
    outcomes[1].assert_retry(0);
    assert_eq!(outcomes[2].assert_retry(0).class, "NameError");
    assert!(fake.all_jobs().is_empty());
    assert!(fake.perform_one(&registry).await.is_none());
}

#[tokio::test]
async fn a_real_client_on_a_test_redis_is_checked_with_the_same_assertions() {
    let redis = TestRedis::start();
    sign_up(&redis.client(), 7).await.unwrap();
    redis
        .assert_enqueued(
            &Expected::new("WelcomeEmailJob")
                .args((7, serde_json::json!({"locale": "en"})))
                .queue("mailers")
                .now(),
        )
        .await;
    redis
        .assert_enqueued(&Expected::new("ReportJob").queue("low").in_secs(3600.0))
        .await;
    redis
        .refute_enqueued(&Expected::new("ReportJob").now())
        .await;
}

#[test]
#[should_panic(expected = "expected a ReportJob job with args [8], but Redis holds 2 job(s):")]
fn assert_enqueued_on_a_test_redis_fails_listing_what_redis_holds() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let redis = TestRedis::start();
    rt.block_on(async {
        sign_up(&redis.client(), 7).await.unwrap();
        redis
            .assert_enqueued(&Expected::new("ReportJob").args((8,)))
            .await;
    });
}

/// Waits until `released`, counting its runs: a job that holds its lock while the test looks.
#[derive(Debug)]
struct Slow(Arc<tokio::sync::Notify>, Arc<AtomicUsize>);

impl Worker for Slow {
    const CLASS: &'static str = "SlowReportJob";
    type Args = (u64,);

    async fn perform(&self, _ctx: &JobContext, _args: Self::Args) -> JobResult {
        self.1.fetch_add(1, Ordering::SeqCst);
        self.0.notified().await;
        Ok(())
    }
}

/// Tags every failure with `[tagged]`: a user's middleware in the chain.
#[derive(Debug)]
struct Tag(Arc<AtomicUsize>);

impl ServerMiddleware for Tag {
    fn call<'a>(&'a self, ctx: &'a JobContext, next: Next<'a>) -> BoxFuture<'a, JobResult> {
        Box::pin(async move {
            self.0.fetch_add(1, Ordering::SeqCst);
            next.run(ctx).await.map_err(|mut e| {
                e.message = format!("[tagged] {}", e.message);
                e
            })
        })
    }
}

#[tokio::test]
async fn the_registered_chain_runs_with_its_lock_on_a_test_redis() {
    let redis = TestRedis::start();
    let (release, runs, tagged) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    let mut registry = Registry::new();
    registry.middleware(Tag(tagged.clone()));
    registry
        .register(Slow(release.clone(), runs.clone()))
        .with(UniqueJob::new().on_conflict(OnConflict::Reschedule(Duration::from_secs(30))))
        .register(HardWorker);
    let registry = registry.freeze().unwrap();
    let first = TestJob::of::<Slow>((1,)).redis(&redis);
    let duplicate = TestJob::of::<Slow>((1,)).redis(&redis);
    let (held, dup) = tokio::join!(first.perform_chain(&registry), async {
        while runs.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        let dup = duplicate.perform_chain(&registry).await;
        release.notify_one();
        dup
    });
    held.assert_done();
    assert!(
        matches!(dup.fate, Fate::Rescheduled { .. }),
        "{:?}",
        dup.fate
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the duplicate did not run");
    // The lock is released: the next one runs.
    let next_job = TestJob::of::<Slow>((1,)).redis(&redis);
    let (next, ()) = tokio::join!(next_job.perform_chain(&registry), async {
        while runs.load(Ordering::SeqCst) == 1 {
            tokio::task::yield_now().await;
        }
        release.notify_one();
    });
    next.assert_done();
    let failed = TestJob::of::<HardWorker>(("eve", -1))
        .redis(&redis)
        .perform_chain(&registry)
        .await;
    assert!(
        failed
            .assert_retry(0)
            .message
            .starts_with("[tagged] count must not be negative")
    );
    assert_eq!(tagged.load(Ordering::SeqCst), 4);
    // Without the chain, the middleware does not run.
    TestJob::of::<HardWorker>(("eve", -1))
        .perform(&HardWorker)
        .await
        .assert_retry(0);
    assert_eq!(tagged.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn one_middleware_runs_alone_around_a_test_handler() {
    let tagged = Arc::new(AtomicUsize::new(0));
    let ctx = TestJob::of::<HardWorker>(("bob", 1)).context();
    let result = testing::run_middleware(&Arc::new(Tag(tagged.clone())), &ctx, |ctx| async move {
        Err(JobError::msg(format!("failed in {}", ctx.queue())))
    })
    .await;
    assert_eq!(result.unwrap_err().message, "[tagged] failed in default");
    assert_eq!(tagged.load(Ordering::SeqCst), 1);
}

/// Walks `0..n`, failing at item `fail_at` while it is set.
#[derive(Debug)]
struct WalkJob(Arc<AtomicUsize>);

impl IterableWorker for WalkJob {
    const CLASS: &'static str = "WalkJob";
    type Args = (usize,);
    type Item = usize;
    type Cursor = usize;

    fn build_enumerator<'a>(
        &'a self,
        _ctx: &'a JobContext,
        (n,): &'a Self::Args,
        cursor: Option<usize>,
    ) -> Result<Enumerator<'a, usize, usize>, JobError> {
        Ok(Enumerator::array((0..*n).collect(), cursor))
    }

    async fn each_iteration(
        &self,
        _ctx: &JobContext,
        item: usize,
        _args: &Self::Args,
    ) -> JobResult {
        if item == self.0.load(Ordering::SeqCst) {
            return Err(JobError::msg(format!("item {item} failed")));
        }
        Ok(())
    }
}

#[tokio::test]
async fn an_iterable_job_stops_at_an_item_and_resumes_there() {
    let redis = TestRedis::start();
    let fail_at = Arc::new(AtomicUsize::new(usize::MAX));
    let walk = Iteration::new(WalkJob(fail_at.clone()), &redis);
    let job = TestJob::new(NewJob::new("WalkJob", (5,)));
    let first = walk.run_until(&job, 2).await;
    assert_eq!(first.fate, Fate::Requeued);
    assert_eq!(first.error().class, "Sidekiq::Job::Interrupted");
    assert_eq!(walk.cursor(&job).await.as_deref(), Some("2"));
    // An item fails: the retry resumes at it.
    fail_at.store(3, Ordering::SeqCst);
    let second = walk.run(&first.next_run()).await;
    second.assert_retry(0);
    assert_eq!(walk.cursor(&job).await.as_deref(), Some("3"));
    fail_at.store(usize::MAX, Ordering::SeqCst);
    walk.run(&second.next_run()).await.assert_done();
    assert_eq!(walk.items_run(), [0, 1, 2, 3, 3, 4]);
    assert_eq!(
        walk.cursor(&job).await,
        None,
        "the state is removed once done"
    );
    // Run to completion in one go.
    let whole = TestJob::new(NewJob::new("WalkJob", (3,)));
    walk.run(&whole).await.assert_done();
}

/// A synchronous worker, run on the blocking pool as in production.
#[derive(Debug)]
struct Checksum;

impl oxidekiq::BlockingWorker for Checksum {
    const CLASS: &'static str = "Checksum";
    type Args = (String,);

    fn perform(&self, _ctx: &JobContext, (text,): Self::Args) -> JobResult {
        if text.is_empty() {
            return Err(JobError::new("ArgumentError", "nothing to sum"));
        }
        Ok(())
    }
}

#[tokio::test]
async fn a_blocking_worker_runs_on_the_blocking_pool_with_the_same_fates() {
    let worker = oxidekiq::Blocking::new(Checksum);
    testing::perform(&worker, ("abc",)).await.assert_done();
    let empty = testing::perform(&worker, ("",)).await;
    assert_eq!(empty.assert_retry(0).message, "nothing to sum");
}
