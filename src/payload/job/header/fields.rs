//! The field names the reader matches by their bytes: Sidekiq's top-level keys ([`named_bit`],
//! the wrapper classes of [`wrapper_at`]) and the `job_data` keys of ActiveJob ([`Field`],
//! [`rails_key_at`]).

use super::{GEM_LOCK, TIMEOUT, UNIQUE_KEY};

/// The length of the `class` value at `b[i..]` when it is one of the ActiveJob wrappers' names,
/// quoted, with no escape (else 0): one comparison of bytes with each literal instead of reading the
/// 54-byte string and comparing it twice more (`args` and the decoder ask whether it is a wrapper).
/// The test `wrapper_literals_are_the_wrappers` holds the literals to `ACTIVEJOB_WRAPPERS`.
#[inline(always)]
pub(super) fn wrapper_at(b: &[u8], i: usize) -> usize {
    #[inline(always)]
    fn at<const N: usize>(b: &[u8], i: usize, lit: &[u8; N]) -> usize {
        match b.get(i..i + N) {
            Some(here) if here == lit => N,
            _ => 0,
        }
    }
    // The first letter tells the two apart, and a plain job's class from both with no call to
    // compare the bytes (a slice compared with a long literal is a `bcmp` call).
    match b.get(i + 1) {
        Some(b'A') => at(
            b,
            i,
            b"\"ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper\"",
        ),
        Some(b'S') => at(b, i, b"\"Sidekiq::ActiveJob::Wrapper\""),
        _ => 0,
    }
}

/// The [`Header::named`] bit of a top-level key. Literal patterns (a length test, then a word
/// compare) as this runs for every top-level key of every job; the test
/// `named_keys_are_the_runtime_s_names` holds them to the constants.
#[inline(always)]
pub(super) fn named_bit(key: &[u8]) -> u8 {
    match key {
        b"unique_key" => UNIQUE_KEY,
        b"oxidekiq_timeout" => TIMEOUT,
        b"lock" | b"lock_digest" => GEM_LOCK,
        _ => 0,
    }
}

/// Which of the `job_data` fields [`JobDataText`] holds a key names.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Field {
    JobClass,
    JobId,
    Executions,
    Arguments,
    Other,
}

impl Field {
    pub(super) fn of(key: &[u8]) -> Field {
        match key {
            b"job_class" => Field::JobClass,
            b"job_id" => Field::JobId,
            b"executions" => Field::Executions,
            b"arguments" => Field::Arguments,
            _ => Field::Other,
        }
    }

    /// The field of `RAILS_KEYS[at]`.
    pub(super) fn rails(at: usize) -> Field {
        match at {
            0 => Field::JobClass,
            1 => Field::JobId,
            5 => Field::Arguments,
            6 => Field::Executions,
            _ => Field::Other,
        }
    }
}

/// The `job_data` keys in the order ActiveJob's `serialize` writes them (Rails 6.1 `core.rb`; Rails
/// 7.1+ adds `scheduled_at` last), each quoted with its colon as compact JSON writes it: the reader
/// compares the next key's bytes with the one expected instead of reading a string and matching it
/// against every name. Any other key, or the same ones in another order or spacing, is read as any key.
pub(super) const RAILS_KEYS: [&[u8]; 12] = [
    b"\"job_class\":",
    b"\"job_id\":",
    b"\"provider_job_id\":",
    b"\"queue_name\":",
    b"\"priority\":",
    b"\"arguments\":",
    b"\"executions\":",
    b"\"exception_executions\":",
    b"\"locale\":",
    b"\"timezone\":",
    b"\"enqueued_at\":",
    b"\"scheduled_at\":",
];

/// The length of `RAILS_KEYS[next]` when `b` holds it at `i`, else 0. Each arm compares with a literal
/// of known length, which the compiler turns into a few word compares with constants (the generic
/// comparison of slices from the table calls `memcmp`): this runs for every key of every ActiveJob
/// job.
#[inline(always)]
pub(super) fn rails_key_at(b: &[u8], i: usize, next: usize) -> usize {
    #[inline(always)]
    fn at<const N: usize>(b: &[u8], i: usize, lit: &[u8; N]) -> usize {
        match b.get(i..i + N) {
            Some(here) if here == lit => N,
            _ => 0,
        }
    }
    match next {
        0 => at(b, i, b"\"job_class\":"),
        1 => at(b, i, b"\"job_id\":"),
        2 => at(b, i, b"\"provider_job_id\":"),
        3 => at(b, i, b"\"queue_name\":"),
        4 => at(b, i, b"\"priority\":"),
        5 => at(b, i, b"\"arguments\":"),
        6 => at(b, i, b"\"executions\":"),
        7 => at(b, i, b"\"exception_executions\":"),
        8 => at(b, i, b"\"locale\":"),
        9 => at(b, i, b"\"timezone\":"),
        10 => at(b, i, b"\"enqueued_at\":"),
        11 => at(b, i, b"\"scheduled_at\":"),
        _ => 0,
    }
}
