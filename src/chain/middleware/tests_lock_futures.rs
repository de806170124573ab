//! The futures a locked job allocates and moves: the lock middleware's (one `Box` per job) and the lock
//! calls it awaits. Every path a job's lock does not take (a command sent alone, the keeper's Redis
//! calls, a busy lock's holder read) is boxed where it is taken, so these stay within mimalloc's small
//! size classes (up to 1 KiB): a larger future takes the allocator's slow path and is copied whole into
//! its box, for every locked job.
use std::sync::Arc;
use std::time::Duration;

use crate::error::JobResult;
use crate::job::Job;
use crate::lock::{LockGuard, LockOptions, RedisLock};
use crate::lock_batch::Locks;
use crate::middleware::sequential::SequentialJob;
use crate::middleware::unique::UniqueJob;
use crate::middleware::{Handler, Keyed, Next, ServerMiddleware};
use crate::test_support::RedisServer;
use crate::worker::{BoxFuture, JobContext};

/// The most a lock future may take.
const SMALL: usize = 1024;

#[derive(Debug)]
struct Noop;

impl Handler for Noop {
    fn call<'a>(&'a self, _: &'a JobContext) -> BoxFuture<'a, JobResult> {
        Box::pin(async { Ok(()) })
    }
}

fn size<F: std::future::Future>(_: &F) -> usize {
    std::mem::size_of::<F>()
}

#[tokio::test]
async fn a_locked_job_s_futures_fit_a_small_allocation() {
    let server = RedisServer::start();
    let conn = server.async_conn().await;
    let payload = br#"{"class":"K","args":[1],"jid":"0123456789abcdef01234567","queue":"q"}"#;
    let job = Job::parse(payload.to_vec(), 1 << 20).unwrap();
    let ctx = JobContext::new(
        Arc::new(job),
        Arc::from("q"),
        conn.clone(),
        crate::shutdown::Shutdown::new().signal(),
        None,
    )
    .with_locks(Locks::new(conn.clone()));
    let lock = RedisLock::new(conn.clone(), "k", LockOptions::default());
    let guard = || LockGuard::taken(conn.clone(), "k".into(), "t".into(), Duration::from_secs(1));
    let held = guard();
    let sizes = [
        ("try_lock", size(&lock.try_lock())),
        ("lock", size(&lock.lock())),
        ("hold_while", size(&held.hold_while(async {}))),
        ("release_detached", size(&guard().release_detached())),
        ("try_lock_owned", size(&lock.clone().try_lock_owned())),
        ("next.run", size(&Next::new(&[], &Noop).run(&ctx))),
        (
            "acquire_owned",
            size(
                &Locks::new(conn.clone())
                    .batcher()
                    .acquire_owned(&conn, Default::default()),
            ),
        ),
    ];
    let unique = UniqueJob::new().key_by_args();
    let sequential = SequentialJob::new().key_by_args();
    // The middleware box their futures: what each allocates is the size of its async block, which
    // `size_of_val` on the box's contents gives.
    let boxed = [
        (
            "UniqueJob",
            std::mem::size_of_val(&*unique.call(&ctx, Next::new(&[], &Noop))),
        ),
        (
            "SequentialJob",
            std::mem::size_of_val(&*sequential.call(&ctx, Next::new(&[], &Noop))),
        ),
    ];
    for (what, n) in sizes.iter().chain(&boxed) {
        eprintln!("{what}: {n} bytes");
        assert!(*n <= SMALL, "{what}: {n} bytes");
    }
}
