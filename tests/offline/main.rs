//! Integration tests that need no server and no other process: configuration, the recorded fixtures,
//! the fetch protocol's model, `oxidekiq::testing`, and the checks on the source tree and the docs'
//! layout page.
//!
//! One binary per need (in_process, binary, ruby, offline), not one per file: each links the crate and
//! compiles tests/support once. A file goes to the group of the most it needs (Ruby, then the
//! `oxidekiq` binary, then a Redis in this process, then nothing). `cargo test --test offline
//! layers::` runs one file's tests.

mod config;
mod fetch_model;
mod fixtures;
mod layers;
mod testing;
mod unique_jobs_fixtures;
