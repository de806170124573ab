//! `oxidekiq report`: the hottest classes by total execution time over the last hour, the list a team
//! reads to choose what to migrate next.
//!
//! Reads what Sidekiq 7.x/8.x's `Metrics::Query#top_jobs` reads (`metrics/query.rb@v7.3.9`,
//! `@v8.1.7`): the per-minute hashes `j|%Y%m%d|%-H:%-M` (7.x) or `j|%y%m%d|%-H:%M` (8.x) with fields
//! `<Class>|ms`, `|p`, `|f`, and, for p50/p95, the per-minute histograms (`metrics/shared.rb`:
//! `<Class>-%d-%H:%-M` in 7.x, `h|<Class>-%-d-%-H:%-M` in 8.x; 26 unsigned 16-bit counters read
//! with a plain `GET`, counter `i` at bytes `2i..2i+2`, big-endian, as `BITFIELD GET u16 #i` reads).
//! Sidekiq 6.x records no execution metrics: then the report counts the jobs waiting in a sample of
//! each queue instead, and says so.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use chrono::{DateTime, Utc};

use super::route::{Totals, read_metrics, serving, shares};
use crate::error::Result;
use crate::job::Job;
use crate::keys;
use crate::metrics::BUCKET_BOUNDS_MS;
use crate::redis_conn::Conn;
use crate::registry::Registry;

fn bound(b: Option<Option<u64>>) -> String {
    match b {
        None => "-".into(),
        Some(Some(ms)) => format!("<{ms}ms"),
        Some(None) => format!(">={}ms", BUCKET_BOUNDS_MS[BUCKET_BOUNDS_MS.len() - 1]),
    }
}

/// The report, as printed.
pub(crate) async fn report(
    conn: &mut Conn,
    registry: &Registry,
    now: DateTime<Utc>,
    limit: usize,
    sample: usize,
) -> Result<String> {
    let shares = shares(conn).await?;
    let live = serving(conn).await?;
    let metrics = read_metrics(conn, now, 60).await?;
    let rust_of = |class: &str| -> String {
        let registered = registry.get(class).is_some();
        let serving = live
            .iter()
            .any(|((_, c), ids)| c == class && !ids.is_empty());
        match (registered, serving) {
            (_, true) => "live".into(),
            (true, false) => "yes".into(),
            (false, false) => "no".into(),
        }
    };
    let share_of = |class: &str| -> String {
        shares
            .get(class)
            .map(|s| format!("{s}%"))
            .unwrap_or_else(|| "-".into())
    };
    let mut out = String::new();
    // When both formats hold data (oxidekiq writes both while no 7.x/8.x Ruby process is alive), the
    // busier one is the one the fleet's Ruby processes write.
    let sum = |m: &BTreeMap<String, Totals>| m.values().map(|t| t.processed).sum::<u64>();
    let (chosen, version) = if sum(&metrics.v8) >= sum(&metrics.v7) && sum(&metrics.v8) > 0 {
        (&metrics.v8, "8.x")
    } else if sum(&metrics.v7) > 0 {
        (&metrics.v7, "7.x")
    } else {
        let lead =
            "no Sidekiq 7.x/8.x execution metrics in the last hour (Sidekiq 6.x records none): ";
        return sample_queues(conn, registry, &shares, &rust_of, sample, limit, lead).await;
    };
    // Who wrote these figures: oxidekiq writes this format too, so while the live Ruby processes
    // are of a version that records none (6.x), the figures are oxidekiq's own runs only.
    let survey = crate::fleet::survey(conn).await?;
    let ruby_writes = if version == "8.x" {
        survey.v8
    } else {
        survey.v7
    };
    let partial = survey.ruby > 0 && !ruby_writes;
    let source = if partial {
        format!(
            "Sidekiq {version} execution metrics written by oxidekiq: its Rust runs only. The live Ruby \
             processes record none (Sidekiq 6.x), so Ruby runs are not in these counts; see the jobs \
             waiting below"
        )
    } else if survey.ruby == 0 {
        format!(
            "Sidekiq {version} execution metrics, written by oxidekiq and by Ruby Sidekiq {version} \
             processes (none is alive now)"
        )
    } else {
        format!(
            "Sidekiq {version} execution metrics, written by the live Ruby processes and by oxidekiq"
        )
    };
    let _ = writeln!(
        out,
        "hottest classes by total execution time, last hour to {} ({source})",
        now.format("%Y-%m-%d %H:%M UTC")
    );
    let _ = writeln!(
        out,
        "{:<40} {:>8} {:>10} {:>9} {:>9} {:>10} {:>6}",
        "CLASS", "JOBS", "TOTAL S", "P50", "P95", "RUST", "ROUTE"
    );
    let mut rows: Vec<(&String, &Totals)> = chosen.iter().collect();
    rows.sort_by(|a, b| {
        b.1.ms
            .cmp(&a.1.ms)
            .then(b.1.processed.cmp(&a.1.processed))
            .then(a.0.cmp(b.0))
    });
    for (class, t) in rows.into_iter().take(limit) {
        let _ = writeln!(
            out,
            "{:<40} {:>8} {:>10.3} {:>9} {:>9} {:>10} {:>6}",
            crate::logging::escape(class),
            t.processed,
            t.ms as f64 / 1000.0,
            bound(t.quantile_bound(0.5)),
            bound(t.quantile_bound(0.95)),
            rust_of(class),
            share_of(class)
        );
    }
    let _ = writeln!(
        out,
        "p50/p95: upper bound of Sidekiq's histogram bucket (successful jobs only); TOTAL S: successful jobs"
    );
    if partial {
        let _ = writeln!(out);
        let waiting = sample_queues(conn, registry, &shares, &rust_of, sample, limit, "").await?;
        out.push_str(&waiting);
    }
    Ok(out)
}

/// Sidekiq 6.x: no execution metrics; classes by jobs waiting in a sample of every queue.
async fn sample_queues(
    conn: &mut Conn,
    _registry: &Registry,
    shares: &BTreeMap<String, u8>,
    rust_of: &dyn Fn(&str) -> String,
    sample: usize,
    limit: usize,
    lead: &str,
) -> Result<String> {
    let mut damaged: Vec<String> = Vec::new();
    let (queues, _) = match super::utf8_members(conn, keys::QUEUES).await {
        Ok(found) => found,
        Err(e) => match super::damaged(conn, keys::QUEUES, &e).await {
            Some(why) => {
                damaged.push(why);
                (Vec::new(), 0)
            }
            None => return Err(e),
        },
    };
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    let mut read = 0usize;
    let mut too_large = 0usize;
    for q in &queues {
        // A bounded number of bytes per round trip; a job over WINDOW_BYTES is counted, not read.
        let mut start = 0;
        while start < sample {
            let key = keys::queue(q);
            let items = match super::read_window(
                conn,
                &key,
                true,
                start,
                sample - start,
                super::WINDOW_BYTES,
            )
            .await
            {
                Ok(items) => items,
                Err(e) => match super::damaged(conn, &key, &e).await {
                    Some(why) => {
                        damaged.push(why);
                        break;
                    }
                    None => return Err(e),
                },
            };
            if items.is_empty() {
                break;
            }
            start += items.len();
            for member in items {
                read += 1;
                let super::Member::Bytes(raw) = member else {
                    too_large += 1;
                    continue;
                };
                if let Ok(job) = Job::parse(raw, usize::MAX) {
                    *counts.entry(job.worker_class().to_string()).or_default() += 1;
                }
            }
        }
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{lead}classes by jobs waiting (Ruby's and Rust's alike) in a sample of up to {sample} per queue \
         ({read} jobs in {} queues{}); no times",
        queues.len(),
        if too_large > 0 {
            format!(", {too_large} of them too large to read")
        } else {
            String::new()
        }
    );
    let _ = writeln!(
        out,
        "{:<40} {:>8} {:>10} {:>9} {:>9} {:>10} {:>6}",
        "CLASS", "JOBS", "TOTAL S", "P50", "P95", "RUST", "ROUTE"
    );
    let mut rows: Vec<(String, u64)> = counts.into_iter().collect();
    rows.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    for (class, n) in rows.into_iter().take(limit) {
        let share = shares
            .get(&class)
            .map(|s| format!("{s}%"))
            .unwrap_or_else(|| "-".into());
        let _ = writeln!(
            out,
            "{:<40} {:>8} {:>10} {:>9} {:>9} {:>10} {:>6}",
            crate::logging::escape(&class),
            n,
            "-",
            "-",
            "-",
            rust_of(&class),
            share
        );
    }
    for why in damaged {
        let _ = writeln!(
            out,
            "{lead}skipped a damaged key: {} (the other queues were read)",
            crate::logging::escape(&why)
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::route::decode_histogram;
    use super::*;

    #[test]
    fn quantiles_come_from_bucket_bounds() {
        let mut t = Totals::default();
        assert_eq!(t.quantile_bound(0.5), None);
        t.histogram[0] = 90;
        t.histogram[5] = 10;
        assert_eq!(t.quantile_bound(0.5), Some(Some(20)));
        assert_eq!(t.quantile_bound(0.95), Some(Some(150)));
        t.histogram[25] = 1000;
        assert_eq!(t.quantile_bound(0.95), Some(None));
        let h = decode_histogram(&[0, 3, 1, 0]);
        assert_eq!((h[0], h[1], h[2]), (3, 256, 0));
    }
}
