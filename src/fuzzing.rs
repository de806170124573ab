//! The fuzz target's body (`fuzz/fuzz_targets/payload.rs`), inside the crate so the target reaches
//! the internal readers it exercises without making them public. Built only under `--cfg fuzzing`,
//! which `cargo fuzz` passes; hidden from the docs.

use rand::SeedableRng;

use crate::error::JobError;
use crate::job::Job;
use crate::retry::{Failure, RetryRules, plan, undecodable_payload};
use crate::time::TimeFormat;

/// Feeds `data` to everything that reads a payload Ruby (or anyone) left in Redis: the job decoder,
/// the full re-encoding the retry path does, ActiveJob unwrapping, the scheduled poller's re-push and
/// the dead-set annotations. None of them may panic, whatever the bytes; the assertions are the
/// fuzzer's oracle (a panic is how libFuzzer reports a finding), so they are meant to panic. One holds
/// the hand-written header reader (`job/header/reader.rs`) to serde_json's reading of the same text.
pub fn payload(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data)
        && let Err(diff) = crate::job::header::both_ways(text)
    {
        panic!("the header reader and serde_json disagree: {diff}");
    }
    let _ = crate::processor::annotate_undecoded(data, "fuzz");
    let _ = undecodable_payload(data, "fuzz", 1.0, TimeFormat::Seconds);
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = crate::scheduled::requeued_payload(text, 1.0, TimeFormat::Millis);
    }
    match Job::parse(data.to_vec(), 1 << 20) {
        Ok(job) => {
            assert_eq!(job.raw().as_bytes(), data, "the original bytes are kept");
            let _ = serde_json::from_str::<serde_json::Value>(job.args_json());
            let _ = serde_json::from_str::<(String, i64)>(job.args_json());
            if job.is_activejob()
                && let Err(diff) = crate::activejob::every_path_agrees(&job)
            {
                panic!("the ActiveJob decoders disagree: {diff}");
            }
            let error = JobError::msg("fuzz").with_backtrace(vec!["a".into(); 3]);
            let mut rng = rand::rngs::StdRng::seed_from_u64(1);
            let _ = plan(
                &Failure {
                    job: &job,
                    queue: "default",
                    error: &error,
                    options: None,
                    now: 1_700_000_000.0,
                    time_format: TimeFormat::Seconds,
                    // Both rule sets (7.x count first; 8.1 time budget only), chosen by the input.
                    rules: RetryRules::for_version(if data.len() % 2 == 0 {
                        (7, 3, 9)
                    } else {
                        (8, 1, 7)
                    }),
                },
                &mut rng,
            );
        }
        Err((back, _)) => assert_eq!(back, data, "rejected bytes are handed back unchanged"),
    }
}
