//! rusty-sidekiq 0.15 draining `queue:default` with the same workers oxidekiq's benchmark uses:
//! `NoopJob` (does nothing), `HardWorker` (sleeps `count` ms) and `LatencyJob` (appends
//! `now - sent_at` in seconds to the list `bench:latency`). Usage: `rusty-sidekiq-bench CONCURRENCY`
//! with `REDIS_URL` set. Runs until killed.
use async_trait::async_trait;
use sidekiq::{Processor, ProcessorConfig, RedisConnectionManager, RedisPool, Result, Worker};

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

/// `perform(sent_at)`: `sent_at` is the producer's clock (epoch seconds) when it pushed the job.
#[derive(Clone)]
struct LatencyJob {
    redis: RedisPool,
}

#[async_trait]
impl Worker<f64> for LatencyJob {
    async fn perform(&self, sent_at: f64) -> Result<()> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let delay = now - sent_at;
        let mut conn = self.redis.get().await?;
        conn.lpush("bench:latency".to_string(), delay.to_string())
            .await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let concurrency: usize = std::env::args()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(10);
    let manager = RedisConnectionManager::new(url)?;
    let redis = bb8::Pool::builder()
        .max_size(concurrency as u32 + 10)
        .build(manager)
        .await?;
    let latency = LatencyJob {
        redis: redis.clone(),
    };
    let mut p = Processor::new(redis, vec!["default".to_string()])
        .with_config(ProcessorConfig::default().num_workers(concurrency));
    p.register(NoopJob);
    p.register(HardWorker);
    p.register(latency);
    p.run().await;
    Ok(())
}
