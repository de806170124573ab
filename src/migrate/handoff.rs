//! `--handoff QUEUE`: on a queue shared with Ruby, a job oxidekiq should not run goes to a queue Ruby
//! serves, unchanged, instead of through the retry set as a `NameError`.
//!
//! Two kinds of job are handed off: those of a class with no Rust worker, and those carrying a
//! Ruby-side contract ([`Contract`]) unless the class was opted in with `--run-flagged CLASS`. The
//! hand-off is one script (`SADD queues`, `LPUSH queue:<QUEUE> <exact bytes>`, a per-class count in
//! [`keys::HANDOFF`], [`retry::push_to_queue`]) that, under reliable fetch, also removes the job from
//! this process's working hash, and pushes nothing when it is already gone: a retry after a lost reply
//! or the shutdown's push-back never makes a second copy. With basic fetch a crash or a lost reply may
//! still run it twice (Ruby, and the hand-off again), never lose it. Each class is logged once.
//! Without `--handoff`, unknown classes keep Sidekiq's path (the retry set).

use crate::config::Config;
use crate::job::Job;
use crate::keys;
use crate::migrate::check::Contract;
use crate::processor::{Park, Processor};
use crate::registry::Entry;
use crate::retry::{self, Token};
use std::collections::HashSet;
use std::sync::Mutex;

/// The hand-off settings and which classes were already logged.
#[derive(Debug)]
pub(crate) struct Handoff {
    /// The queue Ruby serves.
    pub queue: String,
    /// Classes whose flagged jobs still run in Rust.
    pub run_flagged: HashSet<String>,
    /// Classes logged once already.
    logged: Mutex<HashSet<String>>,
}

impl Handoff {
    /// The hand-off a config asks for, if any.
    pub(crate) fn from_config(config: &Config) -> Option<std::sync::Arc<Handoff>> {
        let queue = config.handoff.clone()?;
        Some(std::sync::Arc::new(Handoff {
            queue,
            run_flagged: config.run_flagged.iter().cloned().collect(),
            logged: Mutex::new(HashSet::new()),
        }))
    }

    /// Why `job` should go to Ruby, if it should.
    pub(crate) fn reason(&self, job: &Job, entry: Option<&Entry>) -> Option<String> {
        if entry.is_none() {
            return Some("no Rust worker is registered for it".into());
        }
        if self.run_flagged.contains(job.worker_class()) {
            return None;
        }
        let found = Contract::found_in(job);
        let first = found.first()?;
        Some(format!(
            "it carries `{}` ({}); pass --run-flagged {} to run such jobs in Rust",
            first.key(),
            first.consequence(),
            job.worker_class()
        ))
    }

    fn log_once(&self, class: &str, reason: &str) {
        let first = self
            .logged
            .lock()
            .map(|mut s| s.insert(class.to_string()))
            .unwrap_or(false);
        if first {
            tracing::warn!(
                class,
                queue = %self.queue,
                "handing off jobs of {class} to queue {} unchanged: {reason} (logged once per class; counted in {})",
                self.queue,
                keys::HANDOFF
            );
        }
    }
}

/// The processor's hand-off step: `None` when the job runs here; `Some(true)` when it was pushed to
/// the hand-off queue (acknowledge it); `Some(false)` when no push reached Redis before the process
/// gave up on it (the deadline, or a stop while the push kept failing for a reason other than an
/// outage: leave it in flight, the shutdown pushes it back). The push goes through the processor's
/// fate write ([`Processor::persist`]), so a push that fails because of a damaged key (`queues`, the
/// hand-off queue) gives up the job's slot instead of pinning it. It consumes the job's `token` (its
/// working-hash entry, reliable fetch) in the same script, so a retry after a lost reply pushes nothing
/// twice.
pub(crate) async fn divert(
    p: &Processor,
    job: &Job,
    token: Option<&Token>,
    park: &Park,
) -> Option<bool> {
    let h = p.handoff.as_ref()?;
    let reason = h.reason(job, p.registry.get(job.worker_class()))?;
    let class = job.worker_class();
    let pushed = p
        .persist(park, |mut conn| async move {
            retry::push_to_queue(
                &mut conn,
                &h.queue,
                job.raw().as_bytes(),
                Some(class),
                token,
            )
            .await
        })
        .await;
    let Some(written) = pushed else {
        return Some(false);
    };
    // Not written: the token was gone, so an earlier try whose reply was lost pushed it (or a
    // recovery took it back); either way it is not pushed twice.
    if written {
        crate::prom::metrics().handed_off(class);
    }
    h.log_once(class, &reason);
    Some(true)
}

/// At start: warns when no live Ruby process serves the hand-off queue (its jobs would wait there).
pub(crate) async fn warn_if_unserved(config: &Config) {
    let Some(queue) = &config.handoff else {
        return;
    };
    let served = async {
        let client = crate::redis_conn::client_with_ca(
            &config.redis_url(),
            config.redis_ca_file().as_deref(),
        )?;
        let mut conn = crate::redis_conn::connect(&client).await?;
        live_ruby_serves(&mut conn, queue).await
    }
    .await;
    match served {
        Ok(true) => {
            tracing::info!(queue = %queue, "hand-off queue is served by a live Ruby process")
        }
        Ok(false) => tracing::warn!(
            queue = %queue,
            "--handoff {queue}: no live Sidekiq process serves this queue; handed-off jobs wait there until one does"
        ),
        Err(e) => tracing::warn!(error = %e, "cannot check who serves the hand-off queue"),
    }
}

/// True when a live process that is not oxidekiq lists `queue` in its `info` (PROTOCOL §6.3).
pub(crate) async fn live_ruby_serves(
    conn: &mut crate::redis_conn::Conn,
    queue: &str,
) -> crate::error::Result<bool> {
    let ids: Vec<String> = redis::cmd("SMEMBERS")
        .arg(keys::PROCESSES)
        .query_async(conn)
        .await?;
    for id in ids {
        let info: Option<String> = redis::cmd("HGET")
            .arg(&id)
            .arg("info")
            .query_async(conn)
            .await?;
        let Some(info) = info.and_then(|i| serde_json::from_str::<serde_json::Value>(&i).ok())
        else {
            continue;
        };
        if info.get("oxidekiq").is_some() {
            continue;
        }
        let listed = info
            .get("queues")
            .and_then(|q| q.as_array())
            .is_some_and(|qs| qs.iter().any(|q| q.as_str() == Some(queue)));
        if listed {
            return Ok(true);
        }
    }
    Ok(false)
}
