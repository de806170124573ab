//! sidekiq-unique-jobs on the server side: a job whose payload carries the gem's fields (`lock`,
//! `lock_digest`, ...) runs under the gem's own lock rules, leaving the gem's keys as a Ruby run
//! would (docs/unique-jobs-protocol.md, proven against the recordings in `fixtures/unique-jobs-*`).
//!
//! Layer 6 (locks), after `lock`: it uses the connection, the retry set's dead writer and the fleet
//! survey below it; the job chain calls `execute` around the rest of a job's chain.
//!
//! # Steps
//!
//! Each step of the gem is one call of a script of ours (never the gem's): `QUEUE_LUA` (the gem's
//! `queue`), `LOCK_LUA` (`lock`), `UNLOCK_LUA` (`unlock`, with the wake-up push `LPUSH
//! <d>:QUEUED 1`, `PEXPIRE 5000`), each writing the gem's changelog entry and `PUBLISH`. Between
//! `queue` and `lock` the gem moves a token from `:QUEUED` to `:PRIMED` with `BLMOVE`; a blocking
//! command would stall every job sharing the connection, so the move is an `LMOVE` tried again every
//! 50 ms until the gem's wait (`lock_timeout`, 0 → 1 s, 8.1 caps it at 5 s) is over. Scripts go by
//! `EVALSHA` with `EVAL` on `NOSCRIPT` ([`redis::Script`]). `lock_digest` is taken from the payload,
//! never recomputed.
//!
//! # Per lock type (§3 of the protocol page)
//!
//! - `until_executing`: unlock, perform; a failure (or panic) re-locks for the same jid.
//! - `until_executed`: the lock taken at push is checked; released after success; after a failure
//!   7.1 and 8.0 release it, 8.1 keeps it for the retry.
//! - `while_executing`: perform under `<d>:RUN`; released after the run, whatever its end. A job that
//!   cannot take `:RUN` meets the `on_conflict` server strategy (`Strategy`).
//! - `until_and_while_executing`: unlock `<d>`, then as `while_executing`; a failure re-locks `<d>`.
//! - `until_expired`: checked, never released (the keys expire).
//!
//! A job whose lock another jid holds (lost, reaped, expired and retaken) is not performed, as the gem
//! does; unlike the gem it is never silent: a warning names the class, jid, digest and what happened,
//! and `oxidekiq_unique_conflicts_total{class, strategy}` counts it. One deviation: an
//! `until_and_while_executing` job so skipped releases the `<d>:RUN` lock its own jid holds, left by an
//! earlier run of the job that a crash cut (the job came back by orphan recovery). The gem leaves that
//! lock to its reaper (`Orphans::Reaper`), which a fleet of oxidekiq only does not run: held without a
//! TTL, it turned away every later job of the digest.
//!
//! A Redis error in a step before the perform fails the job (retry path, nothing lost); one after it
//! (the release) is logged at error level naming the key, and the job stays done.

use std::future::Future;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use serde_json::{Map, Value};

use crate::config::UniqueJobsGem;
// A perform's panic is caught so the lock's clean-up runs before it goes on unwinding.
use crate::error::catch_unwind as guarded;
use crate::error::{JobError, JobResult, Result};
use crate::job::Job;
use crate::keys;
use crate::redis_conn::Conn;
use crate::time;

/// The payload field that makes a job the gem's.
pub(crate) const LOCK_DIGEST_FIELD: &str = "lock_digest";
/// The error class of the `raise` strategy, as the gem raises it.
pub(crate) const CONFLICT_CLASS: &str = "SidekiqUniqueJobs::Conflict";
/// The changelog's length (`max_history`, the gem's default).
const MAX_HISTORY: i64 = 1000;
/// How often the move from `:QUEUED` to `:PRIMED` is tried again while the gem's wait runs.
const MOVE_POLL: Duration = Duration::from_millis(50);
/// The longest wait for a lock in seconds (a day): a payload's `lock_timeout` can be any number
/// (1e300 reads as `i64::MAX`), and a deadline that far overflows `Instant` (a panic after the
/// queue step, which left the job's token in `:QUEUED` and the digest locked for good).
const MAX_WAIT_SECS: i64 = 86_400;

/// The longest `lock_ttl` honoured, in ms (100 years). A larger one (`1e300` reads as `i64::MAX`
/// seconds) would make PEXPIRE fail halfway through a script, after the lock's keys were written
/// without a TTL; Lua would also turn it into a float Redis refuses. The gem's client refuses such a
/// push, so only a hand-written payload gets here.
const MAX_TTL_MS: i64 = 100 * 365 * 86_400 * 1000;

mod conflict;
mod fields;
mod release;
mod steps;
#[cfg(test)]
mod tests;

use conflict::{Strategy, conflict};
pub(crate) use fields::{LockConfig, LockType, lacks_digest};
pub use release::FleetGemRelease;
use steps::{DELETE, GemLock, REPLACE, step_failure};

/// Runs `perform` under the gem's rules for `job`'s lock (a job without `lock_digest` just runs).
/// A panic in `perform` releases or takes back what the gem's `ensure`/`rescue` would, then goes on
/// unwinding (the processor makes it the job's failure).
pub(crate) async fn execute<F>(conn: &Conn, job: &Job, gem: UniqueJobsGem, perform: F) -> JobResult
where
    F: Future<Output = JobResult>,
{
    let spec = match LockConfig::read(job) {
        Ok(Some(spec)) => spec,
        Ok(None) => return perform.await,
        Err(e) => return Err(e),
    };
    let jid = job.jid();
    let main = GemLock {
        spec: &spec,
        digest: spec.digest.clone(),
        gem,
    };
    let run = GemLock {
        spec: &spec,
        digest: spec.run_digest(),
        gem,
    };
    match spec.lock {
        LockType::UntilExecuting => {
            main.unlock(conn, jid)
                .await
                .map_err(|e| step_failure(&main.digest, &e))?;
            let ended = guarded(std::pin::pin!(perform)).await;
            if !matches!(ended, Ok(Ok(()))) {
                main.relock(conn, jid).await;
            }
            resume(ended)
        }
        LockType::UntilExecuted | LockType::UntilExpired => {
            let taken = main
                .take(conn, jid, Some(spec.wait(gem)))
                .await
                .map_err(|e| step_failure(&main.digest, &e))?;
            if !taken {
                lost(job, &main.digest, "another job holds its lock");
                return Ok(());
            }
            if spec.lock == LockType::UntilExpired {
                return perform.await;
            }
            let ended = guarded(std::pin::pin!(perform)).await;
            if matches!(ended, Ok(Ok(()))) || gem != UniqueJobsGem::V8_1 {
                main.release(conn, jid).await;
            }
            resume(ended)
        }
        LockType::WhileExecuting => run_locked(conn, job, &spec, &run, perform).await,
        LockType::UntilAndWhileExecuting => {
            let unlocked = main
                .unlock(conn, jid)
                .await
                .map_err(|e| step_failure(&main.digest, &e))?;
            if unlocked.is_none() {
                // A rerun whose earlier run a crash cut after it took `<d>:RUN` (orphan recovery
                // brought the job back): skipped as the gem skips it, but the runtime lock that run
                // left goes. The gem leaves it to its reaper, which a fleet of oxidekiq only does not
                // run; held without a TTL it would turn away every later job of the digest.
                run.release_if_held(conn, jid).await;
                lost(job, &main.digest, "another job holds its lock");
                return Ok(());
            }
            let ended = guarded(std::pin::pin!(run_locked(conn, job, &spec, &run, perform))).await;
            if !matches!(ended, Ok(Ok(()))) {
                main.relock(conn, jid).await;
            }
            resume(ended)
        }
    }
}

/// The `while_executing` part: perform under `<d>:RUN` and release it whatever the end; a job that
/// cannot take it meets the server strategy.
async fn run_locked<F>(
    conn: &Conn,
    job: &Job,
    spec: &LockConfig,
    run: &GemLock<'_>,
    perform: F,
) -> JobResult
where
    F: Future<Output = JobResult>,
{
    let jid = job.jid();
    let taken = run
        .take(conn, jid, Some(spec.wait(run.gem)))
        .await
        .map_err(|e| step_failure(&run.digest, &e))?;
    if !taken {
        return conflict(conn, job, spec, run, perform).await;
    }
    let ended = guarded(std::pin::pin!(perform)).await;
    run.release(conn, jid).await;
    resume(ended)
}

/// The gem's death handler: a job of the gem that dies (its retries exhausted) takes its locks
/// with it (`server.rb death_handler`, `delete_by_digest`), only those it holds itself
/// ([`DELETE_LUA`]). Errors are logged.
pub(crate) async fn delete_by_digest(conn: Conn, digest: String, jid: String) {
    let mut inv = DELETE.prepare_invoke();
    inv.key(&digest)
        .key(keys::UNIQUE_DIGESTS)
        .key(keys::UNIQUE_EXPIRING_DIGESTS)
        .arg(&jid);
    if let Err(e) = inv.invoke_async::<i64>(&mut conn.clone()).await {
        tracing::error!(digest = %crate::redact::clip(&digest, crate::redact::NAME_CHARS), error = %e,
            "cannot delete the sidekiq-unique-jobs lock {digest} of a dead job");
    }
}

/// A job not performed because its lock is held by another jid (the gem skips it silently): logged
/// and counted under the `lost` strategy.
fn lost(job: &Job, digest: &str, why: &str) {
    crate::prom::metrics().unique_conflict(job.worker_class(), "lost");
    let class = crate::redact::clip(job.worker_class(), crate::redact::NAME_CHARS);
    let jid = crate::redact::clip(job.jid(), crate::redact::NAME_CHARS);
    tracing::warn!(class = %class, jid = %jid, digest = %crate::redact::clip(digest, crate::redact::NAME_CHARS), strategy = "lost",
        "sidekiq-unique-jobs: {class} {jid} not performed: {why} ({digest}); the gem skips such a job too");
}

type Panic = Box<dyn std::any::Any + Send>;

/// The result of a [`guarded`] perform, a panic unwinding on.
fn resume(ended: std::result::Result<JobResult, Panic>) -> JobResult {
    match ended {
        Ok(r) => r,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}
