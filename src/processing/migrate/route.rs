//! `oxidekiq route CLASS PERCENT` and `oxidekiq routes`: the canary's control.
//!
//! The route table is one small hash, [`keys::ROUTES`] (class → percent), that `ruby/oxidekiq.rb`
//! reads every few seconds; each Ruby client then sends that share of the class's new jobs to
//! `<queue>_rust`, but only while a live oxidekiq process serves that queue with a worker for the class
//! ([`keys::serving`], refreshed by every beat with a short TTL: see [`crate::heartbeat`]).
//!
//! Roll back (`route CLASS 0`): the share is set to 0 first (no new routing once the Ruby clients'
//! cache turns over), then every job of the class waiting in a `<queue>_rust` list is moved back to
//! `<queue>`, one job per script call: the script checks the job is still there, pushes the exact
//! bytes onto the Ruby queue, then removes them from the Rust queue, all atomically, so a job being
//! fetched by oxidekiq at that moment is either moved or run, never both and never neither. A second
//! pass after the Ruby clients' cache window catches jobs routed just before they saw the 0.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::Duration;

use chrono::{DateTime, Utc};
use redis::{AsyncCommands, Script};

use crate::error::{Error, Result};
use crate::job::Job;
use crate::keys;
use crate::logging::escape;
use crate::metrics::{BUCKET_BOUNDS_MS, BUCKETS};
use crate::redis_conn::Conn;

/// Seconds a Ruby client keeps the route table before reading it again (`ruby/oxidekiq.rb` `REFRESH`).
pub(crate) const RUBY_REFRESH_SECS: f64 = 3.0;

/// Moves one job from a `_rust` queue back to its Ruby queue, atomically, write before remove.
/// KEYS: `queue:<q>_rust`, `queue:<q>`, `queues`; ARGV: the exact job bytes, `<q>`.
/// `RPUSH`: the job had been waiting already, so it goes to the end Ruby's `BRPOP` reads next, as
/// Sidekiq's own requeue does (`fetch.rb bulk_requeue`).
const MOVE_BACK_LUA: &str = r#"
if not redis.call('LPOS', KEYS[1], ARGV[1]) then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[2])
redis.call('LREM', KEYS[1], -1, ARGV[1])
return 1
"#;

/// Jobs read per `LRANGE` while rolling back.
const MOVE_CHUNK: usize = 1000;

/// Sets a class's share (0–100).
pub(crate) async fn set_share(conn: &mut Conn, class: &str, percent: u8) -> Result<()> {
    if percent > 100 {
        return Err(Error::Config(format!(
            "route share must be 0–100, got {percent}"
        )));
    }
    let _: () = redis::cmd("HSET")
        .arg(keys::ROUTES)
        .arg(class)
        .arg(percent)
        .query_async(conn)
        .await?;
    Ok(())
}

/// Every route: class → share, the share read as the Ruby router reads it ([`super::ruby_share`]).
/// A field that is not UTF-8 (no Ruby class name is) is listed by its lossy text.
pub(crate) async fn shares(conn: &mut Conn) -> Result<BTreeMap<String, u8>> {
    let m: BTreeMap<Vec<u8>, Vec<u8>> = redis::cmd("HGETALL")
        .arg(keys::ROUTES)
        .query_async(conn)
        .await?;
    Ok(m.into_iter()
        .map(|(k, v)| {
            let class = String::from_utf8(k)
                .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
            (class, super::ruby_share(&v))
        })
        .collect())
}

/// The `_rust` queues Redis knows: every name in `queues` with the suffix, and every queue a live
/// oxidekiq serves.
async fn rust_queues(conn: &mut Conn) -> Result<BTreeSet<String>> {
    // A name that is not UTF-8 is no queue oxidekiq serves (its queue names are text).
    let (all, _) = super::utf8_members(conn, keys::QUEUES).await?;
    let mut out: BTreeSet<String> = all
        .into_iter()
        .filter(|q| q.ends_with(keys::RUST_QUEUE_SUFFIX) && q.len() > keys::RUST_QUEUE_SUFFIX.len())
        .collect();
    for (rq, _) in serving(conn).await?.keys() {
        out.insert(rq.clone());
    }
    Ok(out)
}

/// Moves every job of `class` waiting in a `_rust` queue back to its Ruby queue; returns how many,
/// by Ruby queue.
pub(crate) async fn move_back(conn: &mut Conn, class: &str) -> Result<BTreeMap<String, u64>> {
    let script = Script::new(MOVE_BACK_LUA);
    let mut moved = BTreeMap::new();
    for rq in rust_queues(conn).await? {
        let Some(base) = rq.strip_suffix(keys::RUST_QUEUE_SUFFIX) else {
            continue;
        };
        // In chunks from the head (newest first; each is appended at the end Ruby's BRPOP reads, so the
        // oldest ends up served first), so a long queue is never read whole: a moved job
        // leaves the list, so the next chunk starts that many places earlier. Jobs pushed meanwhile
        // shift it the other way, which at worst reads a job twice (the script skips what is gone).
        let mut start = 0usize;
        loop {
            // Every member is read (a job of the class must not be stranded whatever its size),
            // but a bounded number of bytes per round trip: one payload, or WINDOW_BYTES of them.
            let items =
                super::read_window(conn, &keys::queue(&rq), true, start, MOVE_CHUNK, usize::MAX)
                    .await?;
            let read = items.len();
            let mut moved_here = 0usize;
            for member in items {
                let super::Member::Bytes(raw) = member else {
                    continue;
                };
                let Ok(job) = Job::parse(raw, usize::MAX) else {
                    continue;
                };
                if job.worker_class() != class {
                    continue;
                }
                let n: u64 = script
                    .key(keys::queue(&rq))
                    .key(keys::queue(base))
                    .key(keys::QUEUES)
                    .arg(job.raw().as_bytes())
                    .arg(base)
                    .invoke_async(conn)
                    .await?;
                if n > 0 {
                    moved_here += 1;
                    *moved.entry(base.to_string()).or_insert(0) += n;
                }
            }
            if read == 0 {
                break;
            }
            start += read - moved_here;
        }
    }
    Ok(moved)
}

/// `route CLASS PERCENT`: sets the share; at 0 also rolls back (see the module documentation). The
/// `settle` wait is how long the second pass waits for the Ruby clients' caches.
pub(crate) async fn route(
    conn: &mut Conn,
    class: &str,
    percent: u8,
    settle: Duration,
) -> Result<String> {
    set_share(conn, class, percent).await?;
    let mut out = String::new();
    let live = serving(conn).await?;
    let serving_class: Vec<&String> = live
        .iter()
        .filter(|((_, c), ids)| c == class && !ids.is_empty())
        .map(|((q, _), _)| q)
        .collect();
    if percent > 0 {
        let _ = writeln!(
            out,
            "route {}: {percent}% of new jobs go to <queue>_rust (Ruby clients pick it up within {RUBY_REFRESH_SECS} s)",
            escape(class)
        );
        if serving_class.is_empty() {
            let _ = writeln!(
                out,
                "warning: no live oxidekiq process serves {} on a `_rust` queue: its jobs stay on Ruby until one does",
                escape(class)
            );
        } else {
            let names: Vec<String> = serving_class.iter().map(|s| escape(s)).collect();
            let _ = writeln!(out, "served by live oxidekiq on: {}", names.join(", "));
        }
        return Ok(out);
    }
    // Jobs that a dead oxidekiq process had taken go back to their `_rust` queue first, so the
    // move below takes them too (a live process's jobs are its own: they finish or are pushed back).
    recover_dead(conn, &mut out).await;
    let mut total: BTreeMap<String, u64> = move_back(conn, class).await?;
    if !settle.is_zero() {
        tokio::time::sleep(settle).await;
        recover_dead(conn, &mut out).await;
        for (q, n) in move_back(conn, class).await? {
            *total.entry(q).or_insert(0) += n;
        }
    }
    let moved: u64 = total.values().sum();
    let _ = writeln!(
        out,
        "route {}: 0%, routing stopped; moved {moved} waiting job(s) back to Ruby{}",
        escape(class),
        if total.is_empty() {
            String::new()
        } else {
            format!(
                " ({})",
                total
                    .iter()
                    .map(|(q, n)| format!("{n} to {}", escape(q)))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    );
    Ok(out)
}

/// Pushes back to their queues the jobs that oxidekiq processes held when they died, so the move back
/// takes them too. Recovery takes a process's jobs only once its liveness key (3 beats) has stayed
/// gone for the recovery's grace (a process that was merely stalled reclaims its key meanwhile), so
/// while the recovery reports suspects this waits for them, one grace and a little more at most.
/// Dead entries it may write (a job recovered too often) carry float-second timestamps, which every
/// Sidekiq version reads.
async fn recover_dead(conn: &mut Conn, out: &mut String) {
    let policy = crate::fetch::RecoveryPolicy::default();
    let give_up = tokio::time::Instant::now() + policy.grace + Duration::from_secs(5);
    loop {
        match crate::fetch::recover_orphans(conn, "oxidekiq-route", crate::time::now(), policy)
            .await
        {
            Ok(Some(r)) => {
                if r.requeued > 0 {
                    let _ = writeln!(
                        out,
                        "recovered {} job(s) held by oxidekiq processes that died",
                        r.requeued
                    );
                }
                if r.suspects == 0 {
                    return;
                }
            }
            // Another process holds the recovery lock: it is recovering now.
            Ok(None) => {}
            Err(e) => {
                let _ = writeln!(out, "warning: cannot recover jobs of dead processes: {e}");
                return;
            }
        }
        if tokio::time::Instant::now() >= give_up {
            let _ = writeln!(
                out,
                "warning: oxidekiq processes without a liveness key still hold jobs; a live oxidekiq \
                 process recovers them"
            );
            return;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Live oxidekiq processes by (`_rust` queue, class), read from the serving keys.
pub(crate) async fn serving(
    conn: &mut Conn,
) -> Result<BTreeMap<(String, String), BTreeSet<String>>> {
    let mut names: Vec<String> = Vec::new();
    {
        // Bytes: a key that is not UTF-8 is skipped, never an error.
        let mut iter: redis::AsyncIter<'_, Vec<u8>> =
            conn.scan_match(keys::SERVING_PATTERN).await?;
        while let Some(k) = iter.next_item().await {
            if let Ok(name) = String::from_utf8(k?) {
                names.push(name);
            }
        }
    }
    let now = crate::time::now();
    let mut out = BTreeMap::new();
    for name in names {
        let Some((rq, class)) = keys::split_serving(&name) else {
            continue;
        };
        let ids: Vec<Vec<u8>> = redis::cmd("ZRANGEBYSCORE")
            .arg(&name)
            .arg(crate::time::score(now))
            .arg("+inf")
            .query_async(conn)
            .await?;
        out.insert(
            (rq.to_string(), class.to_string()),
            ids.iter()
                .map(|id| String::from_utf8_lossy(id).into_owned())
                .collect(),
        );
    }
    Ok(out)
}

/// Jobs run and failed per class in the 60 minutes up to `now`, from oxidekiq's own counters.
pub(crate) async fn rust_counts(
    conn: &mut Conn,
    now: DateTime<Utc>,
) -> Result<BTreeMap<String, (u64, u64)>> {
    let mut pipe = redis::pipe();
    for m in 0..60 {
        let t = now - chrono::Duration::minutes(m);
        pipe.cmd("HGETALL").arg(keys::ran(&ran_minute(t)));
    }
    let hashes: Vec<BTreeMap<String, u64>> = pipe.query_async(conn).await?;
    Ok(sum_fields(hashes.iter()))
}

/// The minute field of [`keys::ran`].
pub(crate) fn ran_minute(t: DateTime<Utc>) -> String {
    t.format("%Y%m%d|%H:%M").to_string()
}

/// Sums `<Class>|p` and `<Class>|f` fields over hashes: class → (p, f).
pub(crate) fn sum_fields<'a>(
    hashes: impl Iterator<Item = &'a BTreeMap<String, u64>>,
) -> BTreeMap<String, (u64, u64)> {
    let mut out: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for h in hashes {
        for (field, n) in h {
            let Some((class, metric)) = field.rsplit_once('|') else {
                continue;
            };
            let e = out.entry(class.to_string()).or_default();
            match metric {
                "p" => e.0 += n,
                "f" => e.1 += n,
                _ => {}
            }
        }
    }
    out
}

/// `routes`: one line per route.
pub(crate) async fn list(conn: &mut Conn, now: DateTime<Utc>) -> Result<String> {
    let shares = shares(conn).await?;
    let live = serving(conn).await?;
    let rust = rust_counts(conn, now).await?;
    let survey = crate::fleet::survey(conn).await?;
    let sidekiq = read_metrics(conn, now, 60).await?;
    // Oxidekiq writes Sidekiq's metrics in the format of each live 7.x/8.x version (crate::fleet), so
    // its own runs are inside each format's totals: the Ruby share is the rest.
    let mut formats = Vec::new();
    if survey.v7 {
        formats.push((&sidekiq.v7, "7.x"));
    }
    if survey.v8 {
        formats.push((&sidekiq.v8, "8.x"));
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<32} {:>6} {:>5} {:>9} {:>9} {:>9} {:>9}   (last hour)",
        "CLASS", "SHARE", "LIVE", "RUST RUN", "RUST FAIL", "RUBY RUN", "RUBY FAIL"
    );
    for (class, share) in &shares {
        let procs: BTreeSet<&String> = live
            .iter()
            .filter(|((_, c), _)| c == class)
            .flat_map(|(_, ids)| ids.iter())
            .collect();
        let (rp, rf) = rust.get(class).copied().unwrap_or((0, 0));
        let (ruby_p, ruby_f) = if formats.is_empty() {
            ("n/a".to_string(), "n/a".to_string())
        } else {
            let mut p = 0u64;
            let mut f = 0u64;
            for (m, _) in &formats {
                if let Some(c) = m.get(class) {
                    p += c.processed.saturating_sub(rp);
                    f += c.failed.saturating_sub(rf);
                }
            }
            (p.to_string(), f.to_string())
        };
        let _ = writeln!(
            out,
            "{:<32} {:>5}% {:>5} {:>9} {:>9} {:>9} {:>9}",
            escape(class),
            share,
            procs.len(),
            rp,
            rf,
            ruby_p,
            ruby_f
        );
    }
    if shares.is_empty() {
        let _ = writeln!(
            out,
            "(no routes: set one with `oxidekiq route CLASS PERCENT`)"
        );
    }
    let note = if !formats.is_empty() {
        let names: Vec<&str> = formats.iter().map(|(_, n)| *n).collect();
        format!(
            "Ruby counts: Sidekiq {} execution metrics minus oxidekiq's own counts",
            names.join(" + ")
        )
    } else if survey.ruby > 0 {
        "Ruby counts: n/a — the live Ruby processes are Sidekiq 6.x, which records no per-class \
         execution metrics; Rust counts are oxidekiq's own"
            .to_string()
    } else {
        "Ruby counts: n/a — no live Ruby Sidekiq process; Rust counts are oxidekiq's own"
            .to_string()
    };
    let _ = writeln!(out, "{note}");
    Ok(out)
}

/// One class's totals over the window.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Totals {
    /// Jobs run (`|p`).
    pub processed: u64,
    /// Jobs failed (`|f`).
    pub failed: u64,
    /// Milliseconds of the successful ones (`|ms`).
    pub ms: u64,
    /// Successful jobs per histogram bucket.
    pub histogram: [u64; BUCKETS],
}

impl Totals {
    /// The upper bound (ms, exclusive) of the bucket holding the `q`-quantile job; `None` for the
    /// last, open-ended bucket or an empty histogram.
    pub(crate) fn quantile_bound(&self, q: f64) -> Option<Option<u64>> {
        let total: u64 = self.histogram.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, n) in self.histogram.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Some(BUCKET_BOUNDS_MS.get(i).copied());
            }
        }
        Some(None)
    }
}

/// Both versions' metrics over a window: class → totals.
#[derive(Debug, Clone, Default)]
pub(crate) struct SidekiqMetrics {
    /// From the 7.x keys.
    pub v7: BTreeMap<String, Totals>,
    /// From the 8.x keys.
    pub v8: BTreeMap<String, Totals>,
}

/// Decodes a histogram string: 26 big-endian u16 counters (missing bytes are zero).
pub(crate) fn decode_histogram(bytes: &[u8]) -> [u64; BUCKETS] {
    let mut out = [0u64; BUCKETS];
    for (i, slot) in out.iter_mut().enumerate() {
        let hi = bytes.get(2 * i).copied().unwrap_or(0) as u64;
        let lo = bytes.get(2 * i + 1).copied().unwrap_or(0) as u64;
        *slot = (hi << 8) | lo;
    }
    out
}

/// Reads both versions' metrics for the `minutes` minutes up to `now`.
pub(crate) async fn read_metrics(
    conn: &mut Conn,
    now: DateTime<Utc>,
    minutes: i64,
) -> Result<SidekiqMetrics> {
    let times: Vec<DateTime<Utc>> = (0..minutes)
        .map(|m| now - chrono::Duration::minutes(m))
        .collect();
    let mut out = SidekiqMetrics::default();
    for v8 in [false, true] {
        let mut pipe = redis::pipe();
        for t in &times {
            pipe.cmd("HGETALL").arg(if v8 {
                keys::metrics_minute_v8(*t)
            } else {
                keys::metrics_minute_v7(*t)
            });
        }
        // Bytes: a field that is not UTF-8, or a count that is not a number, is skipped.
        let hashes: Vec<BTreeMap<Vec<u8>, Vec<u8>>> = pipe.query_async(conn).await?;
        let mut totals: BTreeMap<String, Totals> = BTreeMap::new();
        for h in &hashes {
            for (field, n) in h {
                let (Ok(field), Some(n)) = (
                    std::str::from_utf8(field),
                    std::str::from_utf8(n)
                        .ok()
                        .and_then(|n| n.parse::<u64>().ok()),
                ) else {
                    continue;
                };
                let Some((class, metric)) = field.rsplit_once('|') else {
                    continue;
                };
                let e = totals.entry(class.to_string()).or_default();
                match metric {
                    "p" => e.processed += n,
                    "f" => e.failed += n,
                    "ms" => e.ms += n,
                    _ => {}
                }
            }
        }
        for (class, e) in totals.iter_mut() {
            let mut pipe = redis::pipe();
            for t in &times {
                pipe.cmd("GET").arg(if v8 {
                    keys::histogram_v8(class, *t)
                } else {
                    keys::histogram_v7(class, *t)
                });
            }
            let hists: Vec<Option<Vec<u8>>> = pipe.query_async(conn).await?;
            for h in hists.into_iter().flatten() {
                for (a, b) in e.histogram.iter_mut().zip(decode_histogram(&h)) {
                    *a += b;
                }
            }
        }
        if v8 {
            out.v8 = totals;
        } else {
            out.v7 = totals;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_summed_by_class_and_metric() {
        let a: BTreeMap<String, u64> = [("A::B|p", 3), ("A::B|f", 1), ("C|p", 2)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let b: BTreeMap<String, u64> = [("A::B|p", 4)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let s = sum_fields([a, b].iter());
        assert_eq!(s["A::B"], (7, 1));
        assert_eq!(s["C"], (2, 0));
    }
}
