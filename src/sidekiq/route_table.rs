//! The route table (`oxidekiq:routes`) as a worker process reads it: which classes are rolled back
//! (`oxidekiq route CLASS 0`), so that no new Rust run of them starts and none of their jobs is left on
//! a `_rust` queue.
//!
//! Layer: Sidekiq data (beside `retry`, `scheduled`, `fleet`); it reads [`keys::ROUTES`] through a
//! connection and depends only on `keys`, `redis_conn` and `error`. The processor (a job fetched from
//! `<queue>_rust`), the manager (the push-back at stop) and the poller (a retry or scheduled job coming
//! due toward `<queue>_rust`) ask it where such a job goes; `migrate::route` writes the table.
//!
//! A class is rolled back when its share is 0 (or anything the Ruby router reads as 0: a negative or
//! unreadable value); a class with no route was never routed, and a job on a `_rust` queue without a
//! route was put there on purpose. The table is read at most every
//! [`REFRESH`], as the Ruby router reads it (`ruby/oxidekiq.rb` `REFRESH`), and only by processes that
//! meet a `_rust` queue; a failed read keeps the last answer.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::error::Result;
use crate::keys;
use crate::redis_conn::Conn;

/// How long an answer is used before the table is read again: the Ruby clients' own cache.
pub(crate) const REFRESH: Duration = Duration::from_secs(3);

/// The classes rolled back, read lazily from [`keys::ROUTES`].
#[derive(Debug)]
pub(crate) struct RolledBack {
    /// Connection for the reads.
    conn: Conn,
    /// The last answer and when it was read (`None`: never).
    cache: Mutex<(Option<Instant>, Arc<HashSet<String>>)>,
    /// Whether the last read failed for an outage (Redis unreachable), not for a damaged table.
    unreachable: std::sync::atomic::AtomicBool,
}

impl RolledBack {
    /// A view read through `conn`.
    pub(crate) fn new(conn: Conn) -> Arc<RolledBack> {
        Arc::new(RolledBack {
            conn,
            cache: Mutex::new((None, Arc::default())),
            unreachable: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The rolled-back classes, read again when the last read is older than `max_age`.
    pub(crate) async fn classes(&self, max_age: Duration) -> Arc<HashSet<String>> {
        let (read_at, last) = match self.cache.lock() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        if read_at.is_some_and(|t| t.elapsed() < max_age) {
            return last;
        }
        match read(&mut self.conn.clone()).await {
            Ok(fresh) => {
                self.unreachable
                    .store(false, std::sync::atomic::Ordering::Relaxed);
                let fresh = Arc::new(fresh);
                if let Ok(mut c) = self.cache.lock() {
                    *c = (Some(Instant::now()), fresh.clone());
                }
                fresh
            }
            Err(e) if e.is_outage() => {
                self.unreachable
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                tracing::debug!(error = %e, key = keys::ROUTES, "cannot read the route table; using the last answer");
                last
            }
            Err(e) => {
                self.unreachable
                    .store(false, std::sync::atomic::Ordering::Relaxed);
                // A damaged table hides every roll back: loud, as any damaged key of ours.
                tracing::error!(error = %e, key = keys::ROUTES,
                    "cannot read the route table (not a hash?): no class counts as rolled back until it is \
                     repaired; using the last answer");
                last
            }
        }
    }

    /// Where a job of `class` headed for `queue` goes instead: the Ruby twin of a `_rust` queue when
    /// the class is rolled back; `None` when it goes where it was headed. Costs nothing (no read) for
    /// a queue that is not a `_rust` one.
    ///
    /// While Redis cannot be reached and the last answer is older than [`REFRESH`], it waits for a
    /// fresh one instead of trusting the stale one: a `route CLASS 0` made since must stop every new
    /// Rust run of the class (the chaos test saw a job fetched before a Redis pause start after the
    /// roll back, its process's read timing out). The job waits in flight, where the stop's push-back
    /// finds it; without Redis it could not write its fate anyway.
    pub(crate) async fn redirect(&self, queue: &str, class: &str) -> Option<String> {
        base_of(queue)?;
        let mut pause = Duration::from_millis(100);
        loop {
            let classes = self.classes(REFRESH).await;
            let fresh = match self.cache.lock() {
                Ok(c) => c.0.is_some_and(|t| t.elapsed() < REFRESH),
                Err(poisoned) => poisoned
                    .into_inner()
                    .0
                    .is_some_and(|t| t.elapsed() < REFRESH),
            };
            if fresh || !self.unreachable.load(std::sync::atomic::Ordering::Relaxed) {
                return redirect(&classes, queue, class);
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
        }
    }
}

/// The Ruby queue of a `_rust` queue (`default_rust` → `default`).
fn base_of(queue: &str) -> Option<&str> {
    queue
        .strip_suffix(keys::RUST_QUEUE_SUFFIX)
        .filter(|b| !b.is_empty())
}

/// [`RolledBack::redirect`] against a set read already.
pub(crate) fn redirect(rolled_back: &HashSet<String>, queue: &str, class: &str) -> Option<String> {
    let base = base_of(queue)?;
    rolled_back.contains(class).then(|| base.to_string())
}

/// `HGETALL oxidekiq:routes`, keeping the classes whose share is 0. Read as bytes: one field that is not
/// UTF-8 (no class of ours, a job's class is JSON text) must not fail the read of every other route.
async fn read(conn: &mut Conn) -> Result<HashSet<String>> {
    let all: Vec<(Vec<u8>, Vec<u8>)> = redis::cmd("HGETALL")
        .arg(keys::ROUTES)
        .query_async(conn)
        .await?;
    Ok(all
        .into_iter()
        // As the Ruby router reads a share (`to_i.clamp(0, 100)`): anything not above 0 routes nothing.
        .filter(|(_, share)| !ruby_to_i_is_positive(share))
        .filter_map(|(class, _)| String::from_utf8(class).ok())
        .collect())
}

/// Whether Ruby's `String#to_i` reads `s` as above 0: leading whitespace, an optional sign, then the
/// leading digits (`"50%"` is 50, `"abc"` 0, a number too long for an `i64` still its sign).
fn ruby_to_i_is_positive(s: &[u8]) -> bool {
    let s = s.trim_ascii_start();
    let (negative, digits) = match s.split_first() {
        Some((b'-', rest)) => (true, rest),
        Some((b'+', rest)) => (false, rest),
        _ => (false, s),
    };
    // `to_i` stops at the first byte that is not a digit; one `_` between two digits is read through.
    let mut nonzero = false;
    let mut after_digit = false;
    for (i, b) in digits.iter().enumerate() {
        if b.is_ascii_digit() {
            nonzero |= *b != b'0';
            after_digit = true;
        } else if *b == b'_' && after_digit && digits.get(i + 1).is_some_and(u8::is_ascii_digit) {
            after_digit = false;
        } else {
            break;
        }
    }
    !negative && nonzero
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shares as the Ruby router reads them and as a worker process reads them agree (Ruby computes
    /// its side in the same run, through `ruby/oxidekiq.rb`), and a field that is not UTF-8 hides no
    /// roll back of another class.
    #[tokio::test]
    async fn every_share_reads_as_the_ruby_router_reads_it_and_a_binary_field_hides_nothing() {
        let redis = crate::test_support::RedisServer::start();
        let shares: &[(&str, &str)] = &[
            ("Gone", "0"),
            ("Pct", "50%"),
            ("Big", "99999999999999999999"),
            ("Neg", "-3"),
            ("Junk", "abc"),
            ("Plus", "+7"),
            ("Spaced", " 12 "),
            ("Under", "1_0"),
            ("Double", "0__5"),
            ("Lead", "_5"),
            ("Zeros", "000"),
            ("Frac", "0.9"),
            ("Empty", ""),
        ];
        let mut hset = redis::cmd("HSET");
        hset.arg(keys::ROUTES).arg(b"\xff\xfe".as_slice()).arg("0");
        for (class, share) in shares {
            hset.arg(class).arg(share);
        }
        let _: () = hset.query(&mut redis.conn()).unwrap();
        let router = concat!(env!("CARGO_MANIFEST_DIR"), "/ruby/oxidekiq.rb");
        let out = crate::test_support::ruby(
            &format!(
                "require {router:?}\n\
                 Oxidekiq.cache(Sidekiq.redis_pool).routes(Sidekiq.redis_pool).each {{ |k, v| puts \"#{{k}} #{{v}}\" if v <= 0 && k.valid_encoding? }}"
            ),
            &redis.url(),
        );
        let ruby: HashSet<String> = out
            .lines()
            .iter()
            .map(|l| l.split(' ').next().unwrap_or_default().to_string())
            .collect();
        assert!(
            ruby.contains("Gone"),
            "the test must see a roll back: {ruby:?}"
        );
        let rolled_back = RolledBack::new(redis.async_conn().await);
        let rust = rolled_back.classes(Duration::ZERO).await;
        assert_eq!(*rust, ruby, "rolled back in Rust vs in the Ruby router");
    }

    /// A roll back made while this process's answer was fresh, then Redis unreachable when the answer
    /// is stale (a `CLIENT PAUSE` longer than the connection's 5 s response timeout): the job must wait
    /// for a fresh answer, not start on the stale one. It failed before: the stale answer (no roll
    /// back) came back after the timeout, and the class ran in Rust after `route CLASS 0`.
    #[tokio::test]
    async fn a_stale_answer_is_not_trusted_while_redis_is_unreachable() {
        let redis = crate::test_support::RedisServer::start();
        let rolled_back = RolledBack::new(redis.async_conn().await);
        assert!(rolled_back.redirect("default_rust", "Gone").await.is_none());
        let _: () = redis::cmd("HSET")
            .arg(keys::ROUTES)
            .arg("Gone")
            .arg("0")
            .query(&mut redis.conn())
            .unwrap();
        if let Ok(mut c) = rolled_back.cache.lock() {
            c.0 = Instant::now().checked_sub(REFRESH * 2);
        }
        let _: () = redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(7000)
            .arg("ALL")
            .query(&mut redis.conn())
            .unwrap();
        assert_eq!(
            rolled_back
                .redirect("default_rust", "Gone")
                .await
                .as_deref(),
            Some("default"),
            "a job of a class rolled back started on a stale answer"
        );
    }

    #[test]
    fn only_a_rolled_back_class_on_a_rust_queue_is_redirected() {
        let set: HashSet<String> = ["Gone".to_string()].into();
        assert_eq!(
            redirect(&set, "default_rust", "Gone").as_deref(),
            Some("default")
        );
        assert_eq!(redirect(&set, "default_rust", "Kept"), None);
        assert_eq!(redirect(&set, "default", "Gone"), None);
        assert_eq!(redirect(&set, "_rust", "Gone"), None);
    }
}
