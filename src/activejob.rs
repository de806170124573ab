//! TODO(#2): replaced by the ActiveJob decoder.
use crate::worker::ActiveJobInfo;

/// Placeholder until the decoder lands.
pub fn unwrap(args_json: &str) -> Result<ActiveJobInfo, String> {
    let v: serde_json::Value = serde_json::from_str(args_json).map_err(|e| e.to_string())?;
    let data = v.get(0).ok_or("no job data")?;
    Ok(ActiveJobInfo {
        job_id: data["job_id"].as_str().unwrap_or_default().to_string(),
        executions: data["executions"].as_u64().unwrap_or(0),
        arguments: data["arguments"].clone(),
    })
}

/// The wrapper class Rails' Sidekiq adapter writes (valid on Sidekiq 6.x–8.x).
pub const WRAPPER_CLASS: &str = "ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper";

/// Placeholder until the encoder lands.
pub fn job_data(
    job_class: &str,
    queue: &str,
    arguments: Vec<serde_json::Value>,
    now: chrono::DateTime<chrono::Utc>,
) -> serde_json::Value {
    serde_json::json!({"job_class": job_class, "queue_name": queue, "arguments": arguments, "enqueued_at": now.to_rfc3339()})
}
