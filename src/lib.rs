//! oxidekiq: a Sidekiq-compatible background job worker written in Rust.
//!
//! A Rails app enqueues jobs into Redis with Sidekiq; oxidekiq drains the same queues and runs the jobs
//! whose class has a registered Rust [`Worker`], side by side with Ruby Sidekiq processes.
//! Everything it writes back (retries, dead set, requeues, heartbeats, stats, new jobs) is what Ruby would
//! write, so the Web UI and `Sidekiq::API` see nothing odd.
//!
//! The modules are split by concept and named after Sidekiq's own files, so `fetch/` reads next to
//! `fetch.rb`. `job`, `keys` and `error` depend on nothing internal; only the [`launcher`] knows everything.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub(crate) mod activejob;
pub mod cli;
pub mod client;
pub mod config;
pub mod error;
pub(crate) mod fetch;
pub(crate) mod fleet;
pub(crate) mod heartbeat;
pub(crate) mod http;
pub mod job;
pub(crate) mod keys;
pub mod launcher;
pub mod lock;
// Until `cli::run` lands (helper api-docs), the binary (workers/src/main.rs) calls
// `logging::init_with`, `migrate::run` and `migrate::handoff::warn_if_unserved` itself: those stay `pub`,
// everything else in the two modules is `pub(crate)`. Make both `pub(crate) mod` once main.rs calls `cli::run`.
#[doc(hidden)]
#[allow(rustdoc::private_intra_doc_links)]
pub mod logging;
pub(crate) mod lua;
pub(crate) mod manager;
pub(crate) mod metrics;
pub mod middleware;
#[doc(hidden)]
#[allow(rustdoc::private_intra_doc_links)]
pub mod migrate;
pub(crate) mod processor;
pub(crate) mod prom;
pub(crate) mod redis_conn;
pub mod registry;
pub(crate) mod retry;
pub(crate) mod scheduled;
pub(crate) mod sentinel;
pub(crate) mod shutdown;
pub(crate) mod time;
pub mod worker;

// Tests moved in from tests/ (they need crate-internal items) start their own redis-server and Ruby
// through the integration tests' own harness, and keep their `oxidekiq::` paths.
#[cfg(test)]
extern crate self as oxidekiq;
#[cfg(test)]
#[path = "../tests/support/mod.rs"]
mod test_support;

pub use error::{Error, JobError, RetryAction};
pub use job::Job;
pub use registry::Registry;
pub use worker::{JobContext, NoArgs, Worker, WorkerOptions};
