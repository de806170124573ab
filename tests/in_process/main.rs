//! Integration tests that run oxidekiq inside the test process, against a `redis-server` of each
//! test's own (tests/support): launchers, the lock, the harness. They need `redis-server` and nothing
//! built beside this binary.
//!
//! One binary per need (in_process, binary, ruby, offline), not one per file: each links the crate and
//! compiles tests/support once. A file goes to the group of the most it needs (Ruby, then the
//! `oxidekiq` binary, then a Redis in this process, then nothing). `cargo test --test in_process
//! stop_races::` runs one file's tests.

#[path = "../support/mod.rs"]
mod support;

mod lock;
mod processing;
mod readme_examples;
mod resilience;
mod smoke;
mod stop_races;
mod undecodable_payloads;
mod unique_jobs;
mod unique_jobs_chaos;
