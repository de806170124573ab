//! Integration tests that need Ruby: Sidekiq 6.4, ActiveJob 6.1 or sidekiq-cron enqueue, read or run
//! beside oxidekiq (scripts/setup.sh installs them), most with the `oxidekiq` binary as a child process
//! too (`cargo build --workspace` first), each with a `redis-server` of its own (tests/support).
//!
//! One binary per need (in_process, binary, ruby, offline), not one per file: each links the crate and
//! compiles tests/support once. A file goes to the group of the most it needs (Ruby, then the
//! `oxidekiq` binary, then a Redis in this process, then nothing). `cargo test --test ruby citizen::`
//! runs one file's tests.

#[path = "../support/mod.rs"]
mod support;

mod capsules;
mod check;
mod citizen;
mod cli_and_config_input;
mod continuable;
mod cron;
mod cron_chaos;
mod iterable;
mod migration;
mod ops;
mod ruby_client;
mod ruby_harness;
mod sentinel;
mod shared_queue;
mod sidekiq_yml_and_log_lines;
mod tracing;
