//! `oxidekiq check`: does what Rails really enqueues fit each Rust worker's `Args` type?
//!
//! Samples payloads of every registered class from the queues (every name in `queues`, plus the
//! configured ones), the `retry`, `schedule` and `dead` sets, reading with `LRANGE`/`ZRANGE` only
//! (through [`super::read_window`], a bounded number of bytes at a time), so nothing is taken. Each sampled payload is decoded as the worker would decode it (ActiveJob
//! arguments unwrapped first, as the processor does) and a failure is reported by its field path and
//! the JSON type found there, never by value: check output ends up in CI logs and tickets.
//!
//! It also flags payloads carrying a Ruby-side contract oxidekiq cannot honour ([`Contract`]): the
//! job would run, but the contract's bookkeeping (lock release, batch callbacks) lives in a Ruby
//! server middleware that Rust does not run. sidekiq-unique-jobs locks (`lock_digest`) are reported
//! as honoured: [`crate::unique_jobs`] runs the gem's server side.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::config::Config;
use crate::error::Result;
use crate::job::Job;
use crate::keys;
use crate::logging::escape;
use crate::redis_conn::Conn;
use crate::registry::Registry;
use crate::registry::args_check::Mismatch;

/// A Ruby-side contract in a payload that a job run by oxidekiq would break.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Contract {
    /// `lock_digest`: sidekiq-unique-jobs (PROTOCOL §11.1), honoured ([`crate::unique_jobs`]).
    UniqueJobsLock,
    /// A sidekiq-unique-jobs `lock` without `lock_digest`: the gem's server computes the digest
    /// from the class, oxidekiq cannot ([`crate::unique_jobs::lacks_digest`]); not honoured.
    UniqueJobsNoDigest,
    /// `bid`: a Sidekiq Pro batch (PROTOCOL §1.2).
    ProBatch,
    /// `unique_for`: Sidekiq Enterprise unique jobs (PROTOCOL §11.3).
    EnterpriseUnique,
}

impl Contract {
    /// Every contract, in report order.
    pub(crate) const ALL: [Contract; 4] = [
        Contract::UniqueJobsLock,
        Contract::UniqueJobsNoDigest,
        Contract::ProBatch,
        Contract::EnterpriseUnique,
    ];

    /// Whether oxidekiq runs the contract's server side itself (the job is movable): only
    /// sidekiq-unique-jobs locks.
    pub(crate) fn honoured(self) -> bool {
        matches!(self, Contract::UniqueJobsLock)
    }

    /// The payload key that carries it.
    pub(crate) fn key(self) -> &'static str {
        match self {
            Contract::UniqueJobsLock => "lock_digest",
            Contract::UniqueJobsNoDigest => "lock",
            Contract::ProBatch => "bid",
            Contract::EnterpriseUnique => "unique_for",
        }
    }

    /// The key as it appears in payload text, quoted (a cheap first test).
    fn quoted_key(self) -> &'static str {
        match self {
            Contract::UniqueJobsLock => "\"lock_digest\"",
            Contract::UniqueJobsNoDigest => "\"lock\"",
            Contract::ProBatch => "\"bid\"",
            Contract::EnterpriseUnique => "\"unique_for\"",
        }
    }

    /// What goes wrong when oxidekiq runs such a job.
    pub(crate) fn consequence(self) -> &'static str {
        match self {
            Contract::UniqueJobsLock => {
                "sidekiq-unique-jobs lock: honoured, oxidekiq runs the gem's server side (its keys and \
                 release steps, per lock type; see docs/migration.md)"
            }
            Contract::UniqueJobsNoDigest => {
                "sidekiq-unique-jobs lock without lock_digest (rescheduled by 8.1's on_conflict, or \
                 pushed without the gem's client): the gem's server computes the digest from the \
                 class, oxidekiq cannot; run in Rust it fails (never runs unlocked)"
            }
            Contract::ProBatch => {
                "Sidekiq Pro batch: only Pro's server middleware reports a job's success or failure to \
                 its batch; run in Rust the batch never completes and its callbacks never fire"
            }
            Contract::EnterpriseUnique => {
                "Sidekiq Enterprise unique job: Enterprise releases the lock when the job succeeds; run \
                 in Rust it is held until unique_for expires, and identical jobs are dropped meanwhile"
            }
        }
    }

    /// The contracts `raw` carries: a substring test first (the hot path of the hand-off sees every
    /// job), then a real look at the top-level keys.
    pub(crate) fn found_in(job: &Job) -> Vec<Contract> {
        let raw = job.raw();
        if !Contract::ALL.iter().any(|c| raw.contains(c.quoted_key())) {
            return Vec::new();
        }
        let Ok(map) = job.to_map() else {
            return Vec::new();
        };
        Contract::ALL
            .into_iter()
            .filter(|c| match c {
                Contract::UniqueJobsNoDigest => crate::unique_jobs::lacks_digest(&map),
                _ => map.get(c.key()).is_some_and(|v| !v.is_null()),
            })
            .collect()
    }
}

/// What was found for one class.
#[derive(Debug, Default, Clone)]
pub(crate) struct ClassReport {
    /// Payloads decoded.
    pub sampled: usize,
    /// Payloads that fit.
    pub decoded: usize,
    /// Distinct mismatches with how often each was seen and where (first source).
    pub failures: BTreeMap<Mismatch, (usize, String)>,
    /// Payloads carrying each contract.
    pub contracts: BTreeMap<Contract, usize>,
}

impl ClassReport {
    /// Payloads that did not fit.
    pub(crate) fn failed(&self) -> usize {
        self.sampled - self.decoded
    }
}

/// The whole check.
#[derive(Debug, Default, Clone)]
pub(crate) struct CheckReport {
    /// By registered class (every one, sampled or not).
    pub classes: BTreeMap<String, ClassReport>,
    /// Payloads read, of every class.
    pub scanned: usize,
    /// Where they were read from.
    pub sources: Vec<String>,
    /// Members of `queues` skipped because they are not UTF-8 (no queue oxidekiq could serve).
    pub skipped_names: usize,
    /// Keys that could not be read, each with why (a key of the wrong type), skipped: the check goes on
    /// with the others.
    pub damaged: Vec<String>,
}

impl CheckReport {
    /// True when any sampled payload did not fit.
    pub(crate) fn any_failed(&self) -> bool {
        self.classes.values().any(|c| c.failed() > 0) || !self.damaged.is_empty()
    }

    /// The printed report.
    pub(crate) fn render(&self) -> String {
        let mut out = String::new();
        // Names and mismatches come from Redis and payloads: escaped as log lines are.
        let sources: Vec<String> = self.sources.iter().map(|s| escape(s)).collect();
        let _ = writeln!(
            out,
            "oxidekiq check: {} payloads read from {}",
            self.scanned,
            sources.join(", ")
        );
        if self.skipped_names > 0 {
            let _ = writeln!(
                out,
                "skipped {} member(s) of `queues` that are not UTF-8",
                self.skipped_names
            );
        }
        for why in &self.damaged {
            let _ = writeln!(
                out,
                "skipped a damaged key: {} (the others were checked)",
                escape(why)
            );
        }
        let _ = writeln!(
            out,
            "{:<40} {:>8} {:>8} {:>8}",
            "CLASS", "SAMPLED", "DECODED", "FAILED"
        );
        for (class, c) in &self.classes {
            let _ = writeln!(
                out,
                "{:<40} {:>8} {:>8} {:>8}",
                escape(class),
                c.sampled,
                c.decoded,
                c.failed()
            );
            for (m, (n, source)) in c.failures.iter().take(3) {
                let _ = writeln!(
                    out,
                    "    does not fit ({n}x, first in {}): {}",
                    escape(source),
                    escape(&m.to_string())
                );
            }
            if c.failures.len() > 3 {
                let _ = writeln!(out, "    … {} more kinds of mismatch", c.failures.len() - 3);
            }
            for (contract, n) in &c.contracts {
                let _ = writeln!(
                    out,
                    "    {}: {n} job(s) of {} carry `{}`: {}",
                    if contract.honoured() {
                        "honoured"
                    } else {
                        "flagged"
                    },
                    escape(class),
                    contract.key(),
                    contract.consequence()
                );
            }
        }
        if self
            .classes
            .values()
            .any(|c| c.contracts.keys().any(|k| !k.honoured()))
        {
            let _ = writeln!(
                out,
                "flagged jobs are handed off to Ruby by `--handoff QUEUE` (unless `--run-flagged CLASS`)"
            );
        }
        let _ = writeln!(
            out,
            "{}",
            if self.any_failed() {
                "FAILED: some payloads do not fit their worker's Args type"
            } else {
                "OK: every sampled payload fits its worker's Args type"
            }
        );
        out
    }
}

/// How much to read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Payloads decoded per class at most.
    pub sample: usize,
    /// Payloads read per queue or set at most.
    pub scan: usize,
}

const CHUNK: usize = 500;

/// Runs the check against Redis.
pub(crate) async fn run(
    conn: &mut Conn,
    config: &Config,
    registry: &Registry,
    limits: Limits,
) -> Result<CheckReport> {
    let mut report = CheckReport::default();
    for class in registry.classes() {
        report
            .classes
            .insert(class.to_string(), ClassReport::default());
    }
    let (mut queues, skipped) = match super::utf8_members(conn, keys::QUEUES).await {
        Ok(found) => found,
        Err(e) => match super::damaged(conn, keys::QUEUES, &e).await {
            Some(why) => {
                report.damaged.push(why);
                (Vec::new(), 0)
            }
            None => return Err(e),
        },
    };
    report.skipped_names = skipped;
    for q in config.served_queues() {
        if !queues.iter().any(|known| known == q) {
            queues.push(q.to_string());
        }
    }
    queues.sort();
    let mut sources: Vec<(String, bool)> = queues.iter().map(|q| (keys::queue(q), true)).collect();
    for set in [keys::RETRY, keys::SCHEDULE, keys::DEAD] {
        sources.push((set.to_string(), false));
    }
    for (key, is_list) in sources {
        report.sources.push(key.clone());
        let mut start = 0usize;
        while start < limits.scan {
            if report.classes.values().all(|c| c.sampled >= limits.sample) {
                break;
            }
            let want = CHUNK.min(limits.scan - start);
            let items = match super::read_window(
                conn,
                &key,
                is_list,
                start,
                want,
                config.max_payload_bytes,
            )
            .await
            {
                Ok(items) => items,
                Err(e) => match super::damaged(conn, &key, &e).await {
                    Some(why) => {
                        report.damaged.push(why);
                        break;
                    }
                    None => return Err(e),
                },
            };
            let n = items.len();
            for member in items {
                report.scanned += 1;
                // Over --max-payload-bytes (not sent): the worker would not decode it either.
                let super::Member::Bytes(raw) = member else {
                    continue;
                };
                let Ok(job) = Job::parse(raw, config.max_payload_bytes) else {
                    continue;
                };
                let Some(entry) = registry.get(job.worker_class()) else {
                    continue;
                };
                let Some(c) = report.classes.get_mut(job.worker_class()) else {
                    continue;
                };
                if c.sampled >= limits.sample {
                    continue;
                }
                c.sampled += 1;
                match (entry.check_args)(&job) {
                    Ok(()) => c.decoded += 1,
                    Err(m) => {
                        c.failures.entry(m).or_insert_with(|| (0, key.clone())).0 += 1;
                    }
                }
                for contract in Contract::found_in(&job) {
                    *c.contracts.entry(contract).or_default() += 1;
                }
            }
            if n == 0 {
                break;
            }
            start += n;
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contracts_are_found_by_key_not_by_text() {
        let j =
            Job::from_str(r#"{"class":"X","args":["bid"],"lock_digest":"uniquejobs:1"}"#).unwrap();
        assert_eq!(Contract::found_in(&j), vec![Contract::UniqueJobsLock]);
        let j = Job::from_str(r#"{"class":"X","args":[],"bid":"b1","unique_for":60}"#).unwrap();
        assert_eq!(
            Contract::found_in(&j),
            vec![Contract::ProBatch, Contract::EnterpriseUnique]
        );
    }

    #[test]
    fn unique_jobs_locks_are_honoured_and_the_others_still_flagged() {
        assert!(Contract::UniqueJobsLock.honoured());
        assert!(!Contract::ProBatch.honoured());
        assert!(!Contract::EnterpriseUnique.honoured());
        assert!(!Contract::UniqueJobsNoDigest.honoured());
        let undigested = |json: &str| Contract::found_in(&Job::from_str(json).unwrap());
        assert_eq!(
            undigested(r#"{"class":"X","args":[],"lock":"while_executing"}"#),
            [Contract::UniqueJobsNoDigest]
        );
        assert_eq!(
            undigested(r#"{"class":"X","args":[],"lock":"while_executing","lock_digest":"u:1"}"#),
            [Contract::UniqueJobsLock]
        );
        assert!(undigested(r#"{"class":"X","args":[],"lock":"mine"}"#).is_empty());
        let mut r = CheckReport::default();
        let mut c = ClassReport::default();
        c.contracts.insert(Contract::UniqueJobsLock, 2);
        r.classes.insert("X".into(), c.clone());
        let out = r.render();
        assert!(
            out.contains("honoured: 2 job(s) of X carry `lock_digest`"),
            "{out}"
        );
        assert!(!out.contains("handed off"), "{out}");
        c.contracts.insert(Contract::EnterpriseUnique, 1);
        r.classes.insert("X".into(), c);
        let out = r.render();
        assert!(
            out.contains("flagged: 1 job(s) of X carry `unique_for`"),
            "{out}"
        );
        assert!(out.contains("handed off"), "{out}");
    }
}
