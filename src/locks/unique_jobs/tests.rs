use super::release::release_named;
use super::*;

/// Issue 43 item 10: `replace` found a digest's job in `schedule`/`retry` with `ZSCAN MATCH *<d>*`,
/// so a digest holding a glob character (`?`, `*`, `[`) matched, and deleted, another digest's job.
#[test]
fn replace_matches_a_digest_with_glob_characters_literally() {
    use redis::Commands;
    let redis = crate::test_support::RedisServer::start();
    let mut c = redis.conn();
    let other = r#"{"class":"X","jid":"other","lock_digest":"uniquejobs:abc[1]"}"#;
    let _: () = c.zadd("schedule", other, 1).unwrap();
    let replace = |c: &mut redis::Connection, d: &str| -> Option<String> {
        REPLACE
            .key("queue:default")
            .key("schedule")
            .key("retry")
            .key("uniquejobs:digests")
            .arg(d)
            .invoke(c)
            .unwrap()
    };
    for d in ["uniquejobs:a?c", "uniquejobs:a*", "uniquejobs:abc[1-9]"] {
        assert_eq!(replace(&mut c, d), None, "{d} matched another digest's job");
    }
    assert_eq!(c.zcard::<_, usize>("schedule").unwrap(), 1);
    let mine = r#"{"class":"X","jid":"mine","lock_digest":"uniquejobs:a?c\\*"}"#;
    let _: () = c.zadd("schedule", mine, 2).unwrap();
    assert_eq!(
        replace(&mut c, r"uniquejobs:a?c\\*").as_deref(),
        Some(mine),
        "its own job is found"
    );
    assert_eq!(c.zcard::<_, usize>("schedule").unwrap(), 1);
}

fn spec(json: &str) -> std::result::Result<Option<LockConfig>, JobError> {
    LockConfig::read(&Job::from_str(json).unwrap())
}

#[test]
fn the_gems_fields_are_read_from_the_payload_and_the_digest_is_never_recomputed() {
    let s = spec(
        r#"{"class":"X","args":[1],"jid":"j","lock":"while_executing","lock_digest":"uniquejobs:ab:RUN",
           "lock_ttl":600,"lock_timeout":2,"on_conflict":{"client":"log","server":"reject"},"lock_info":true}"#,
    )
    .unwrap()
    .unwrap();
    assert_eq!(s.lock, LockType::WhileExecuting);
    assert_eq!(s.digest, "uniquejobs:ab");
    assert_eq!(s.run_digest(), "uniquejobs:ab:RUN");
    assert_eq!((s.pttl, s.timeout, s.limit), (600_000, 2, 1));
    assert_eq!(s.strategy, Strategy::Reject);
    assert!(s.info);
    assert!(
        spec(r#"{"class":"X","args":["lock_digest"],"jid":"j"}"#)
            .unwrap()
            .is_none()
    );
    let e = spec(r#"{"class":"X","args":[],"jid":"j","lock":"sometimes","lock_digest":"u:1"}"#)
        .unwrap_err();
    assert!(e.message.contains("sometimes"), "{}", e.message);
    for digest in [
        "",
        r#","lock_digest":null"#,
        r#","lock_digest":"""#,
        r#","lock_digest":7"#,
    ] {
        let e = spec(&format!(
            r#"{{"class":"X","args":[],"jid":"j","lock":"while_executing"{digest}}}"#
        ))
        .unwrap_err();
        assert!(e.message.contains("without a lock_digest"), "{}", e.message);
    }
    assert!(
        spec(r#"{"class":"X","args":[],"jid":"j","lock":"mine"}"#)
            .unwrap()
            .is_none()
    );
}

#[test]
fn the_release_the_gem_writes_names_its_rules() {
    assert_eq!(release_named("7.1.33"), Some(UniqueJobsGem::V7_1));
    assert_eq!(release_named("8.0.13"), Some(UniqueJobsGem::V8_0));
    assert_eq!(release_named("8.1.0"), Some(UniqueJobsGem::V8_1));
    assert_eq!(release_named("9"), Some(UniqueJobsGem::V8_1));
    for v in ["", "6.0.0", "x", "-1.0"] {
        assert_eq!(release_named(v), None, "{v}");
    }
}

#[test]
fn the_wait_follows_each_release() {
    let s = spec(r#"{"class":"X","args":[],"jid":"j","lock":"until_executed","lock_digest":"u:1","lock_timeout":30}"#)
        .unwrap()
        .unwrap();
    assert_eq!(s.wait(UniqueJobsGem::V8_1), Duration::from_secs(5));
    assert_eq!(s.wait(UniqueJobsGem::V7_1), Duration::from_secs(30));
    let s =
        spec(r#"{"class":"X","args":[],"jid":"j","lock":"until_executed","lock_digest":"u:1"}"#)
            .unwrap()
            .unwrap();
    assert_eq!(s.wait(UniqueJobsGem::V8_0), Duration::from_secs(1));
}

/// The unique-jobs chaos test's seed 61312 (1 run in 3 to 6): an `until_and_while_executing` job
/// SIGKILLed after it unlocked its digest and took `<d>:RUN` comes back by orphan recovery; meanwhile
/// a newer job of the digest took its client lock, so the rerun's unlock yields (7.1, 8.1) and the job
/// is skipped, as the gem skips it. The `:RUN` lock its own cut run left must not stay behind: without
/// a TTL, and with no reaper in a fleet of oxidekiq only, it turned away every later job of the digest
/// (`Limit exceeded`) for good. 8.0's unlock answers the jid when it yields, so its rerun runs and
/// releases the lock as any run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skipped_rerun_releases_the_run_lock_its_cut_run_left() {
    use redis::AsyncCommands;
    let redis = crate::test_support::RedisServer::start();
    for gem in [
        UniqueJobsGem::V7_1,
        UniqueJobsGem::V8_0,
        UniqueJobsGem::V8_1,
    ] {
        let conn: Conn = redis.async_conn().await;
        let mut c = conn.clone();
        let _: () = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();
        let payload = |jid: &str| {
            format!(
                r#"{{"class":"X","args":[],"jid":"{jid}","queue":"default","lock":"until_and_while_executing","lock_digest":"uniquejobs:d"}}"#
            )
        };
        let cut = Job::from_str(&payload("cut")).unwrap();
        let config = LockConfig::read(&cut).unwrap().unwrap();
        let main = GemLock {
            spec: &config,
            digest: config.digest.clone(),
            gem,
        };
        let run = GemLock {
            spec: &config,
            digest: config.run_digest(),
            gem,
        };
        // The client lock at push, then the run the SIGKILL cut: unlocked, `:RUN` taken.
        assert!(main.take(&conn, "cut", None).await.unwrap());
        assert!(main.unlock(&conn, "cut").await.unwrap().is_some());
        assert!(run.take(&conn, "cut", None).await.unwrap());
        // A newer job of the digest pushed meanwhile: its client lock.
        assert!(main.take(&conn, "newer", None).await.unwrap());
        // The recovered rerun.
        let performed = std::sync::atomic::AtomicBool::new(false);
        execute(&conn, &cut, gem, async {
            performed.store(true, Ordering::Relaxed);
            Ok(())
        })
        .await
        .unwrap();
        let held: Vec<String> = c.hkeys("uniquejobs:d:RUN:LOCKED").await.unwrap();
        assert!(
            held.is_empty(),
            "gem {}: uniquejobs:d:RUN still held by {held:?} after the rerun",
            gem.name()
        );
        let digests: Vec<String> = c.zrange("uniquejobs:digests", 0, -1).await.unwrap();
        assert_eq!(digests, ["uniquejobs:d"], "gem {}", gem.name());
        let main_held: Vec<String> = c.hkeys("uniquejobs:d:LOCKED").await.unwrap();
        assert_eq!(
            main_held,
            ["newer"],
            "gem {}: the newer job's lock",
            gem.name()
        );
        assert_eq!(
            performed.load(Ordering::Relaxed),
            gem == UniqueJobsGem::V8_0,
            "gem {}: performed as the gem would",
            gem.name()
        );
    }
}
