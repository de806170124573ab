//! Conflict strategies: what a job meets when another jid holds its lock (`on_conflict`).

use super::*;

/// The gem's `on_conflict` server strategies (`on_conflict.rb`); `None` is the gem's default (no
/// strategy: the job is dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Strategy {
    /// No strategy given: dropped.
    None,
    /// `log`: dropped (the gem logs it).
    Log,
    /// `reject`: the payload goes to the dead set (`DeadSet#kill`).
    Reject,
    /// `reschedule`: a new job (new jid) of the same args `schedule_in` (5) seconds ahead.
    Reschedule,
    /// `raise`: the job fails with `SidekiqUniqueJobs::Conflict` (the retry path).
    Raise,
    /// `replace`: a queued job of the digest is deleted, then its lock, then this job runs.
    Replace,
}

impl Strategy {
    pub(super) fn named(name: &str) -> Strategy {
        match name {
            "log" => Strategy::Log,
            "reject" => Strategy::Reject,
            "reschedule" => Strategy::Reschedule,
            "raise" => Strategy::Raise,
            "replace" => Strategy::Replace,
            _ => Strategy::None,
        }
    }

    /// The `strategy` label of the conflicts counter.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Strategy::None => "none",
            Strategy::Log => "log",
            Strategy::Reject => "reject",
            Strategy::Reschedule => "reschedule",
            Strategy::Raise => "raise",
            Strategy::Replace => "replace",
        }
    }
}

/// A job that cannot take its `:RUN` lock: counted, logged, then the `on_conflict` server strategy.
pub(super) async fn conflict<F>(
    conn: &Conn,
    job: &Job,
    spec: &LockConfig,
    run: &GemLock<'_>,
    perform: F,
) -> JobResult
where
    F: Future<Output = JobResult>,
{
    let strategy = spec.strategy;
    crate::prom::metrics().unique_conflict(job.worker_class(), strategy.label());
    let class = crate::redact::clip(job.worker_class(), crate::redact::NAME_CHARS);
    let jid = crate::redact::clip(job.jid(), crate::redact::NAME_CHARS);
    let what = match strategy {
        Strategy::None | Strategy::Log => {
            "the job is dropped, as the gem drops it (counted as processed)"
        }
        Strategy::Reject => "the job goes to the dead set",
        Strategy::Reschedule => "a new job of the same arguments is scheduled",
        Strategy::Raise => "the job fails with SidekiqUniqueJobs::Conflict (retry)",
        Strategy::Replace => "a queued job of the digest is deleted and this one runs",
    };
    // Every value from the payload clipped (a digest can be megabytes), and named once.
    tracing::warn!(class = %class, jid = %jid, digest = %crate::redact::clip(&run.digest, crate::redact::NAME_CHARS), strategy = strategy.label(),
        "sidekiq-unique-jobs conflict: the job cannot take its lock (digest; another job runs); on_conflict {}: {what}",
        strategy.label());
    let now = time::now();
    let mut c = conn.clone();
    match strategy {
        Strategy::None | Strategy::Log => Ok(()),
        Strategy::Raise => Err(JobError::new(
            CONFLICT_CLASS,
            format!(
                "{class} {jid}: the lock {} is held by another job",
                run.digest
            ),
        )),
        Strategy::Reject => {
            let mut map = spec.map.clone();
            map.insert(LOCK_DIGEST_FIELD.into(), Value::String(run.digest.clone()));
            let payload = Value::Object(map).to_string();
            crate::retry::kill(&mut c, payload.as_bytes(), now, None)
                .await
                .map_err(|e| step_failure(&run.digest, &e))?;
            Ok(())
        }
        Strategy::Reschedule => reschedule(conn, spec, run.gem, now)
            .await
            .map_err(|e| step_failure(&run.digest, &e)),
        Strategy::Replace => {
            let mut inv = REPLACE.prepare_invoke();
            let queue = spec
                .map
                .get("queue")
                .and_then(Value::as_str)
                .unwrap_or("default");
            inv.key(keys::queue(queue))
                .key(keys::SCHEDULE)
                .key(keys::RETRY)
                .key(keys::UNIQUE_DIGESTS)
                .arg(&run.digest);
            let deleted: Option<String> = inv
                .invoke_async(&mut c)
                .await
                .map_err(|e| step_failure(&run.digest, &e.into()))?;
            match deleted {
                Some(_) => {
                    tracing::warn!(digest = %crate::redact::clip(&run.digest, crate::redact::NAME_CHARS),
                        class = %class, jid = %jid,
                        "on_conflict replace: deleted a job of the digest and its lock; the job runs");
                    perform.await
                }
                None => Ok(()),
            }
        }
    }
}

/// The `reschedule` strategy (`on_conflict/reschedule.rb`): `perform_in(schedule_in || 5)` with the
/// same args and a new jid. 7.1 and 8.0 push it through the gem's client middleware: an
/// `until_and_while_executing` job takes the client lock for the new jid; 8.1 marks it rescheduled,
/// so its client middleware adds no lock and no lock fields. Unlike 8.1, the new job keeps the lock
/// fields: 8.1's server middleware computes the digest again when the job runs, which oxidekiq never
/// does, so without `lock_digest` the new job would run in Rust without its runtime lock (a Ruby
/// server overwrites the fields, so they change nothing there).
pub(super) async fn reschedule(
    conn: &Conn,
    spec: &LockConfig,
    gem: UniqueJobsGem,
    now: f64,
) -> Result<()> {
    let mut map = spec.map.clone();
    for k in [
        "enqueued_at",
        "error_message",
        "error_class",
        "error_backtrace",
        "failed_at",
        "retried_at",
        "retry_count",
        "at",
    ] {
        map.remove(k);
    }
    let jid = crate::job::new_jid();
    map.insert("jid".into(), Value::String(jid.clone()));
    let millis = map
        .get("created_at")
        .is_some_and(|v| v.as_i64().is_some() || v.as_u64().is_some());
    let tf = if millis {
        time::TimeFormat::Millis
    } else {
        time::TimeFormat::Seconds
    };
    map.insert("created_at".into(), tf.value(now));
    let delay = map
        .get("schedule_in")
        .and_then(Value::as_f64)
        .filter(|s| s.is_finite() && *s >= 0.0)
        .unwrap_or(5.0);
    // The gem's client sees the new job with its `at` (in `:INFO`, and 8.0's digests score).
    let at = now + delay;
    let mut client_map = map.clone();
    client_map.insert("at".into(), time::float_value(at));
    let rescheduled = LockConfig {
        map: client_map,
        score: time::score(at),
        ..spec.clone()
    };
    if gem != UniqueJobsGem::V8_1 && spec.lock == LockType::UntilAndWhileExecuting {
        let client = GemLock {
            spec: &rescheduled,
            digest: spec.digest.clone(),
            gem,
        };
        if !client.take(conn, &jid, None).await? {
            tracing::warn!(digest = %crate::redact::clip(&spec.digest, crate::redact::NAME_CHARS),
                "on_conflict reschedule: the new job's client lock on the digest is held by another job: \
                 not scheduled, as the gem's client refuses the push");
            return Ok(());
        }
    }
    let payload = Value::Object(map).to_string();
    let mut c = conn.clone();
    redis::cmd("ZADD")
        .arg(keys::SCHEDULE)
        .arg(time::score(at))
        .arg(payload)
        .query_async::<()>(&mut c)
        .await?;
    Ok(())
}
