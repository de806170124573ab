use crate::job::Job;

/// The literals [`super::fields::named_bit`] matches are the names the runtime reads.
#[test]
fn named_keys_are_the_runtime_s_names() {
    use super::fields::named_bit;
    use super::{GEM_LOCK, GEM_LOCK_KEYS, TIMEOUT, UNIQUE_KEY};
    assert_eq!(
        named_bit(crate::job::UNIQUE_KEY_FIELD.as_bytes()),
        UNIQUE_KEY
    );
    assert_eq!(named_bit(crate::job::TIMEOUT_FIELD.as_bytes()), TIMEOUT);
    assert!(GEM_LOCK_KEYS.contains(&crate::unique_jobs::LOCK_DIGEST_FIELD));
    for key in GEM_LOCK_KEYS {
        assert_eq!(named_bit(key.as_bytes()), GEM_LOCK, "{key}");
    }
    assert_eq!(named_bit(b"locks"), 0);
    assert_eq!(named_bit(b"unique_ke"), 0);
}

/// A payload names a timeout or the gem's lock fields only at its top level: the same names in
/// the arguments (an ActiveJob `job_data`'s keys are arguments too) are not the runtime's, and
/// an escaped spelling is read by serde_json and keeps each test on.
#[test]
fn top_level_names_are_noted_where_they_are() {
    let job = |raw: &str| match Job::parse(raw.as_bytes().to_vec(), 1 << 20) {
        Ok(job) => (job.may_name_timeout(), job.may_name_gem_lock()),
        Err((_, e)) => panic!("{raw}: {e}"),
    };
    let cases = [
        (
            r#"{"class":"X","args":[],"oxidekiq_timeout":2}"#,
            (true, false),
        ),
        (
            r#"{"class":"X","args":[],"lock":"until_executed"}"#,
            (false, true),
        ),
        (
            r#"{"class":"X","args":[],"lock_digest":"uniquejobs:d"}"#,
            (false, true),
        ),
        (
            r#"{"class":"X","args":[{"oxidekiq_timeout":2,"lock":"x","lock_digest":"d"}]}"#,
            (false, false),
        ),
        (
            r#"{"class":"ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper","wrapped":"J","args":[{"job_class":"J","job_id":"i","arguments":[{"lock":1}],"executions":0,"oxidekiq_timeout":1}]}"#,
            (false, false),
        ),
        (
            r#"{"class":"X","args":[],"oxidekiq\u005ftimeout":2}"#,
            (true, true),
        ),
        (
            r#"{"class":"X","args":[],"\u006cock":"until_executed"}"#,
            (true, true),
        ),
    ];
    for (raw, want) in cases {
        assert_eq!(job(raw), want, "{raw}");
    }
}

fn names_unique_key(raw: &str) -> bool {
    match Job::parse(raw.as_bytes().to_vec(), 1 << 20) {
        Ok(job) => job.may_name_unique_key(),
        Err((_, e)) => panic!("{raw}: {e}"),
    }
}

/// The lock test may only be skipped when the payload surely has no top-level `unique_key`; an
/// escaped spelling of the key (read by serde_json, not the hand-written reader) keeps it on
/// (review R1: `unique\u005fkey` used to skip its lock).
#[test]
fn a_unique_key_spelled_any_way_keeps_the_lock_test_on() {
    let plain = r#"{"class":"X","args":[],"jid":"j1","unique_key":"k","unique_ttl":60}"#;
    let escaped = r#"{"class":"X","args":[],"jid":"j1","unique\u005fkey":"k","unique_ttl":60}"#;
    let first = r#"{"class":"X","args":[],"jid":"j1","\u0075nique_key":"k","unique_ttl":60}"#;
    let none = r#"{"class":"X","args":["unique"],"jid":"j1"}"#;
    assert!(names_unique_key(plain));
    assert!(names_unique_key(escaped));
    assert!(names_unique_key(first));
    assert!(!names_unique_key(none));
}
