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

pub mod activejob;
pub mod cli;
pub mod client;
pub mod config;
pub mod error;
pub mod fetch;
pub mod fleet;
pub mod heartbeat;
pub mod http;
pub mod job;
pub mod keys;
pub mod launcher;
pub mod lock;
pub mod logging;
pub(crate) mod lua;
pub mod manager;
pub mod metrics;
pub mod middleware;
pub mod migrate;
pub mod processor;
pub mod prom;
pub mod redis_conn;
pub mod registry;
pub mod retry;
pub mod scheduled;
pub mod sentinel;
pub mod shutdown;
pub mod time;
pub mod worker;

pub use error::{Error, JobError, RetryAction};
pub use job::Job;
pub use registry::Registry;
pub use worker::{JobContext, NoArgs, Worker, WorkerOptions};
