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
//!
//! Class names come from payloads, so what is remembered and counted per class is bounded as the
//! Prometheus labels are ([`crate::prom::MAX_CLASSES`] classes of up to
//! [`crate::prom::MAX_CLASS_LEN`] bytes): further classes, and longer names, are logged once and
//! counted together under `(other)`, and a name is clipped in every log line.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Mutex;

use crate::config::Config;
use crate::job::Job;
use crate::keys;
use crate::migrate::check::Contract;
use crate::prom::{MAX_CLASS_LEN, MAX_CLASSES, OTHER_CLASS};
use crate::registry::{Entry, Registry};

/// The hand-off settings and which classes were already logged.
#[derive(Debug)]
pub(crate) struct Handoff {
    /// The queue Ruby serves.
    pub queue: String,
    /// Classes whose flagged jobs still run in Rust.
    pub run_flagged: HashSet<String>,
    /// Classes logged and counted under their own name, at most [`MAX_CLASSES`].
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
        let first = found.iter().find(|c| !c.honoured())?;
        Some(format!(
            "it carries `{}` ({}); pass --run-flagged {} to run such jobs in Rust",
            first.key(),
            first.consequence(),
            job.worker_class()
        ))
    }

    /// The name `class` is counted under in [`keys::HANDOFF`], and whether this is its first job
    /// here (to be logged): the class itself while fewer than [`MAX_CLASSES`] have been seen and it
    /// is at most [`MAX_CLASS_LEN`] bytes long, else [`OTHER_CLASS`].
    fn label<'a>(&self, class: &'a str) -> (&'a str, bool) {
        let Ok(mut logged) = self.logged.lock() else {
            return (OTHER_CLASS, false);
        };
        let own =
            class.len() <= MAX_CLASS_LEN && (logged.contains(class) || logged.len() < MAX_CLASSES);
        let label = if own { class } else { OTHER_CLASS };
        let first = !logged.contains(label) && logged.insert(label.to_string());
        (label, first)
    }

    fn log_first(&self, class: &str, label: &str, reason: &str) {
        let class = crate::redact::clip(class, MAX_CLASS_LEN);
        let counted = if label == OTHER_CLASS {
            "logged once for every such class; counted under `(other)`"
        } else {
            "logged once per class"
        };
        tracing::warn!(
            queue = %self.queue,
            "handing off jobs of {class} to queue {} unchanged: {reason} ({counted} in {})",
            self.queue,
            keys::HANDOFF
        );
    }
}

/// The processor's hand-off step: `None` when the job runs here; `Some(true)` when it was pushed to
/// the hand-off queue (acknowledge it); `Some(false)` when no push reached Redis before the process
/// gave up on it (the deadline, or a stop while the push kept failing for a reason other than an
/// outage: leave it in flight, the shutdown pushes it back).
///
/// The push itself is the caller's `push(queue, label)`: the processor sends it through its fate write
/// (`Processor::persist`), so a push that fails because of a damaged key (`queues`, the hand-off queue)
/// gives up the job's slot instead of pinning it, and it consumes the job's token (its working-hash
/// entry, reliable fetch) in the same script, so a retry after a lost reply pushes nothing twice. It
/// answers whether the push wrote the job (`Some(false)`: the token was gone), or `None` when it gave
/// up. Taking the push as a value keeps this module below the processor.
pub(crate) async fn divert<'a, F, Fut>(
    handoff: Option<&'a Handoff>,
    registry: &Registry,
    job: &'a Job,
    push: F,
) -> Option<bool>
where
    F: FnOnce(&'a str, &'a str) -> Fut,
    Fut: Future<Output = Option<bool>>,
{
    let h = handoff?;
    let reason = h.reason(job, registry.get(job.worker_class()))?;
    let class = job.worker_class();
    let (label, first) = h.label(class);
    let Some(written) = push(&h.queue, label).await else {
        return Some(false);
    };
    // Not written: the token was gone, so an earlier try whose reply was lost pushed it (or a
    // recovery took it back); either way it is not pushed twice.
    if written {
        crate::prom::metrics().handed_off(class);
    }
    if first {
        h.log_first(class, label, &reason);
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_max_classes_are_remembered_and_long_names_are_counted_as_other() {
        let h = Handoff {
            queue: "ruby".into(),
            run_flagged: HashSet::new(),
            logged: Mutex::new(HashSet::new()),
        };
        for i in 0..MAX_CLASSES + 50 {
            let class = format!("C{i}");
            let (label, first) = h.label(&class);
            assert!(first || label == OTHER_CLASS);
            assert_eq!(h.label(&class), (label, false), "logged once");
        }
        assert_eq!(h.label("C1"), ("C1", false));
        assert_eq!(
            h.label(&"L".repeat(MAX_CLASS_LEN + 1)),
            (OTHER_CLASS, false)
        );
        assert!(h.logged.lock().unwrap().len() <= MAX_CLASSES + 1);
    }
}
