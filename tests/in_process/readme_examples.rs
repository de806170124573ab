//! The registrations and client calls of docs/workers.md, run against a real Redis: the doctests
//! (`src/doc_snippets.rs`) compile them, this checks that they do what the page says.
use crate::support;

use std::process::ExitCode;
use std::time::Duration;

use oxidekiq::{
    Client, ConcurrencyLimit, JobContext, JobError, JobResult, NewJob, OnConflict, RateLimit,
    Registry, SequentialJob, UniqueJob, Worker,
};

#[derive(Debug)]
struct ChargeJob;
impl Worker for ChargeJob {
    const CLASS: &'static str = "Billing::ChargeJob";
    type Args = (u64, f64, String);
    async fn perform(
        &self,
        _ctx: &JobContext,
        (_customer, amount, _currency): Self::Args,
    ) -> JobResult {
        if amount <= 0.0 {
            return Err(JobError::new("ArgumentError", "amount must be positive").kill());
        }
        Ok(())
    }
}

#[derive(Debug)]
struct SyncJob;
impl Worker for SyncJob {
    const CLASS: &'static str = "SyncJob";
    type Args = (u64,);
    async fn perform(&self, _ctx: &JobContext, _args: Self::Args) -> JobResult {
        Ok(())
    }
}

#[derive(Debug)]
struct ReportJob;
impl Worker for ReportJob {
    const CLASS: &'static str = "ReportJob";
    type Args = (u64,);
    async fn perform(&self, _ctx: &JobContext, _args: Self::Args) -> JobResult {
        Ok(())
    }
}

/// "Writing a worker": the registry function and the one-line `main` of a worker binary.
pub fn registry() -> oxidekiq::Registry {
    let mut registry = oxidekiq::Registry::new();
    registry.register(ChargeJob);
    registry
}

fn main_of_a_worker_binary() -> ExitCode {
    oxidekiq::run(registry)
}

#[test]
fn the_readme_main_compiles_and_its_registry_holds_the_worker() {
    let _main: fn() -> ExitCode = main_of_a_worker_binary;
    assert_eq!(registry().classes(), ["Billing::ChargeJob"]);
}

#[test]
fn the_readme_registrations_build_a_registry() {
    let mut registry = Registry::new();
    registry.register(SyncJob).with(UniqueJob::new());
    registry
        .register(ChargeJob)
        .with_key(
            UniqueJob::new().on_conflict(OnConflict::Reschedule(Duration::from_secs(30))),
            |(customer, ..)| format!("stripe-{customer}"),
        )
        .with_key(ConcurrencyLimit::new(3), |(customer, ..)| {
            format!("stripe-{customer}")
        })
        .with(RateLimit::new("payment-api", 100, Duration::from_secs(60)));
    registry
        .register(ReportJob)
        .with(SequentialJob::new().timeout(Duration::from_secs(120)));
    let frozen = registry.freeze().unwrap();
    assert_eq!(
        frozen.classes(),
        ["Billing::ChargeJob", "ReportJob", "SyncJob"]
    );
    assert_eq!(frozen.get("Billing::ChargeJob").unwrap().chain.len(), 3);
}

#[tokio::test]
async fn the_readme_client_calls_enqueue_what_they_say() {
    let redis = support::RedisServer::start();
    let client = Client::connect(&redis.url()).await.unwrap();
    client
        .perform_async("HardWorker", ("bob", 5))
        .await
        .unwrap();
    client
        .perform_in(60.0, "HardWorker", ("later", 1))
        .await
        .unwrap();
    client
        .push(
            NewJob::new("HardWorker", ("x", 1))
                .queue("critical")
                .retry(3)
                .tags(["a"]),
        )
        .await
        .unwrap();
    client
        .perform_later("WelcomeEmailJob", "mailers", vec![serde_json::json!(42)])
        .await
        .unwrap();
    let first = client
        .push(NewJob::new("SyncJob", (42,)).unique_for(Duration::from_secs(600)))
        .await;
    let second = client
        .push(NewJob::new("SyncJob", (42,)).unique_for(Duration::from_secs(600)))
        .await;
    assert!(first.is_ok());
    assert!(
        second.is_err(),
        "a duplicate is refused while the first is queued"
    );
    let mut c = redis.conn();
    let q: usize = redis::Commands::llen(&mut c, "queue:default").unwrap();
    let critical: usize = redis::Commands::llen(&mut c, "queue:critical").unwrap();
    let mailers: usize = redis::Commands::llen(&mut c, "queue:mailers").unwrap();
    let scheduled: usize = redis::Commands::zcard(&mut c, "schedule").unwrap();
    assert_eq!((q, critical, mailers, scheduled), (2, 1, 1, 1));
}
