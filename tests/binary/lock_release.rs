//! A job's lock is released after the job, without its slot waiting for Redis (`lock_batch`): what a
//! user must still see. A graceful stop in the middle of a burst of locked jobs leaves no lock behind
//! (a lingering one would make a later duplicate be skipped until its TTL) and loses no job; a release
//! that Redis refuses is logged with the job and its key, and the job still counts as done. Against a
//! real redis-server and the `oxidekiq` binary (`UniqueNoopJob`: a no-op behind a unique lock keyed by
//! its arguments). Build the binary first: `cargo build --workspace`.
use crate::support;

use std::time::Duration;

use oxidekiq::client::{Client, NewJob};
use redis::Commands;
use support::{Oxidekiq, RedisServer, wait_until};

/// Every lock key in Redis.
fn lock_keys(c: &mut redis::Connection) -> Vec<String> {
    c.keys("oxidekiq:lock:*").unwrap()
}

fn processed(c: &mut redis::Connection) -> usize {
    c.get::<_, Option<usize>>("stat:processed")
        .unwrap()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_in_a_burst_of_locked_jobs_leaves_no_lock_behind_and_loses_no_job() {
    const JOBS: usize = 20_000;
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let client = Client::connect(&redis.url()).await.unwrap();
    let template = NewJob::new("UniqueNoopJob", ()).queue("locked");
    let pushed = client
        .push_bulk(template, (0..JOBS).map(|i| (i,)))
        .await
        .unwrap();
    assert_eq!(pushed.len(), JOBS);

    let mut p = Oxidekiq::start(&redis.url(), &["-q", "locked", "-c", "50"]);
    // Stop while the burst is draining: jobs end (and queue their releases) up to the stop itself.
    assert!(
        wait_until(Duration::from_secs(60), || {
            c.llen::<_, usize>("queue:locked").unwrap() <= JOBS - 1000
        }),
        "the burst did not start: {}",
        p.log()
    );
    p.signal("TERM");
    assert!(
        p.wait_exit(Duration::from_secs(30)).is_some(),
        "{}",
        p.log()
    );

    // Checked at once, not waited for: the process is gone, so nothing of it can still arrive.
    assert_eq!(lock_keys(&mut c), Vec::<String>::new(), "{}", p.log());
    let done = processed(&mut c);
    let left: usize = c.llen("queue:locked").unwrap();
    assert!(
        done < JOBS,
        "the stop came after the burst: nothing was tested"
    );
    assert_eq!(done + left, JOBS, "every job is done or back in its queue");
    let log = p.log();
    assert!(!log.contains("cannot release lock"), "{log}");
    assert!(!log.contains("changed hands before release"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_redis_refuses_is_logged_with_the_job_and_its_key_and_the_job_is_done() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let p = Oxidekiq::start(&redis.url(), &["-q", "locked", "-c", "2"]);
    assert!(
        wait_until(Duration::from_secs(15), || {
            c.scard::<_, usize>("processes").unwrap() >= 1
        }),
        "{}",
        p.log()
    );
    // The release script's `DEL` is refused (NOPERM) from now on; nothing else a no-op job needs is.
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg("-del")
        .query(&mut c)
        .unwrap();
    let client = Client::connect(&redis.url()).await.unwrap();
    let jid = client
        .push(NewJob::new("UniqueNoopJob", ("refused",)).queue("locked"))
        .await
        .unwrap();
    let logged = wait_until(Duration::from_secs(15), || {
        p.log().lines().any(|l| l.contains("cannot release lock"))
    });
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg("+del")
        .query(&mut c)
        .unwrap();
    assert!(logged, "{}", p.log());

    let log = p.log();
    let line = log
        .lines()
        .find(|l| l.contains("cannot release lock"))
        .unwrap();
    // The job's own context (as on every line the job logs), the key, Redis's error.
    assert!(line.contains(&format!(" jid={jid} ")), "{line}");
    assert!(line.contains(" class=UniqueNoopJob "), "{line}");
    let keys = lock_keys(&mut c);
    assert_eq!(keys.len(), 1, "the refused lock stays until its TTL");
    assert!(line.contains(&format!(" lock={} ", keys[0])), "{line}");
    // Quoted: the error text has spaces.
    assert!(line.contains(" error=\"redis: "), "{line}");
    assert!(line.contains(" WARN: "), "{line}");
    // The job is done, not failed: no retry, no failure counted.
    assert!(
        wait_until(Duration::from_secs(10), || processed(&mut c) == 1),
        "{log}"
    );
    assert_eq!(c.zcard::<_, usize>("retry").unwrap(), 0);
    assert_eq!(
        c.get::<_, Option<usize>>("stat:failed")
            .unwrap()
            .unwrap_or(0),
        0
    );
}
