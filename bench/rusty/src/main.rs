//! rusty-sidekiq 0.15 draining `queue:default` with the same two workers oxidekiq's benchmark uses:
//! `NoopJob` (does nothing) and `HardWorker` (sleeps `count` ms). Usage: `rusty-sidekiq-bench CONCURRENCY`
//! with `REDIS_URL` set. Runs until killed.
use async_trait::async_trait;
use sidekiq::{Processor, ProcessorConfig, RedisConnectionManager, Result, Worker};

#[derive(Clone)]
struct NoopJob;

#[async_trait]
impl Worker<serde_json::Value> for NoopJob {
    async fn perform(&self, _args: serde_json::Value) -> Result<()> {
        Ok(())
    }
}

#[derive(Clone)]
struct HardWorker;

#[async_trait]
impl Worker<(String, u64)> for HardWorker {
    async fn perform(&self, (_name, ms): (String, u64)) -> Result<()> {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let concurrency: usize = std::env::args().nth(1).and_then(|c| c.parse().ok()).unwrap_or(10);
    let manager = RedisConnectionManager::new(url)?;
    let redis = bb8::Pool::builder()
        .max_size(concurrency as u32 + 10)
        .build(manager)
        .await?;
    let mut p = Processor::new(redis, vec!["default".to_string()])
        .with_config(ProcessorConfig::default().num_workers(concurrency));
    p.register(NoopJob);
    p.register(HardWorker);
    p.run().await;
    Ok(())
}
