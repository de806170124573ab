//! The route table as a worker process reads it: which classes are rolled back (`oxidekiq route CLASS
//! 0`), so that no new Rust run of them starts and none of their jobs is left on a `_rust` queue.
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
}

impl RolledBack {
    /// A view read through `conn`.
    pub(crate) fn new(conn: Conn) -> Arc<RolledBack> {
        Arc::new(RolledBack {
            conn,
            cache: Mutex::new((None, Arc::default())),
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
                let fresh = Arc::new(fresh);
                if let Ok(mut c) = self.cache.lock() {
                    *c = (Some(Instant::now()), fresh.clone());
                }
                fresh
            }
            Err(e) => {
                tracing::debug!(error = %e, key = keys::ROUTES, "cannot read the route table; using the last answer");
                last
            }
        }
    }

    /// Where a job of `class` headed for `queue` goes instead: the Ruby twin of a `_rust` queue when
    /// the class is rolled back; `None` when it goes where it was headed. Costs nothing (no read) for
    /// a queue that is not a `_rust` one.
    pub(crate) async fn redirect(&self, queue: &str, class: &str) -> Option<String> {
        base_of(queue)?;
        redirect(&*self.classes(REFRESH).await, queue, class)
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

/// `HGETALL oxidekiq:routes`, keeping the classes whose share is 0.
async fn read(conn: &mut Conn) -> Result<HashSet<String>> {
    let all: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(keys::ROUTES)
        .query_async(conn)
        .await?;
    Ok(all
        .into_iter()
        // As the Ruby router reads a share (`to_i.clamp(0, 100)`): anything not above 0 routes nothing.
        .filter(|(_, share)| share.trim().parse::<i64>().map_or(true, |n| n <= 0))
        .map(|(class, _)| class)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

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
