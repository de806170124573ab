//! Integration tests that run the `oxidekiq` binary as a child process (`target/debug/oxidekiq`:
//! `cargo build --workspace` first), with a `redis-server` of each test's own (tests/support), and no
//! Ruby.
//!
//! One binary per need (in_process, binary, ruby, offline), not one per file: each links the crate and
//! compiles tests/support once. A file goes to the group of the most it needs (Ruby, then the
//! `oxidekiq` binary, then a Redis in this process, then nothing). `cargo test --test binary chaos::`
//! runs one file's tests.

#[path = "../support/mod.rs"]
mod support;

mod blocking;
mod chaos;
mod damaged_keys;
mod docs;
mod input_limits_and_redaction;
mod lock_release;
mod locks_middleware;
mod older_releases;
mod panics;
mod probes;
mod recovery_cost;
mod resource_bounds;
mod rolling_upgrade;
