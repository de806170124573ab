//! oxidekiq: a Sidekiq-compatible background job worker written in Rust.
//!
//! A Rails app enqueues jobs into Redis with Sidekiq; oxidekiq drains the same queues and runs the jobs
//! whose class has a registered Rust [`Worker`], side by side with Ruby Sidekiq processes.
//! Everything it writes back (retries, dead set, requeues, heartbeats, stats, new jobs) is what Ruby would
//! write, so the Web UI and `Sidekiq::API` see nothing odd.
//!
//! An application implements [`Worker`] for each Ruby class it moves to Rust, lists them in a
//! [`Registry`], and hands the registry to [`run`], which is a whole worker binary: Sidekiq's flags
//! and `sidekiq.yml`, logging, the migration subcommands, and the [`Launcher`] until `TERM`.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use oxidekiq::{JobContext, JobError, JobResult, Registry, UniqueJob, Worker};
//!
//! /// `HardWorker.perform_async("bob", 5)` in Ruby runs this.
//! #[derive(Debug)]
//! struct HardWorker;
//!
//! impl Worker for HardWorker {
//!     const CLASS: &'static str = "HardWorker";
//!     type Args = (String, u64);
//!
//!     async fn perform(&self, _ctx: &JobContext, (name, count): Self::Args) -> JobResult {
//!         if name.is_empty() {
//!             return Err(JobError::new("ArgumentError", "no name").kill()); // straight to dead
//!         }
//!         tokio::time::sleep(Duration::from_millis(count)).await; // an error here would be a retry
//!         Ok(())
//!     }
//! }
//!
//! fn registry() -> Registry {
//!     let mut registry = Registry::new();
//!     // At most one HardWorker runs at a time across every process; a duplicate is skipped.
//!     registry.register(HardWorker).with(UniqueJob::new());
//!     registry
//! }
//!
//! // `oxidekiq -q default -c 10`, `oxidekiq -C config/sidekiq.yml check`, ...: exit code 0, 1 or 2.
//! fn main() -> std::process::ExitCode {
//!     oxidekiq::run(registry)
//! }
//! ```
//!
//! Everything an application needs is re-exported here: the worker side ([`Worker`], [`JobContext`],
//! [`JobError`], [`WorkerOptions`], and [`BlockingWorker`] with [`Blocking`] for synchronous code), registration with locks and limits ([`Registry`],
//! [`Registration`], [`UniqueJob`], [`SequentialJob`], [`ConcurrencyLimit`], [`RateLimit`]), custom
//! middleware ([`ServerMiddleware`], [`ClientMiddleware`]), enqueuing from Rust ([`Client`],
//! [`NewJob`]), sidekiq-cron schedules declared in Rust ([`CronJob`]) and running without [`run`]
//! ([`Config`], [`Launcher`]). With the `testing` cargo feature, `testing` holds the helpers to
//! unit-test workers, middleware and producers (docs/testing.md). The public modules ([`cli`],
//! [`client`], [`config`], [`cron`],
//! [`error`], [`job`], [`launcher`], [`lock`], [`middleware`], [`registry`], [`worker`]) hold the rest
//! of their API; the others are the runtime's own.
//!
//! The modules are split by concept and named after Sidekiq's own files, so `fetch/` reads next to
//! `fetch.rb`. `src/` shows the ladder of docs/layout.md: one folder a layer, each using only the
//! folders below it (`support/`, `payload/`, `connection/`, `config/`, `sidekiq/`, `locks/`, `chain/`,
//! `processing/`, `ops/`), and the wiring at the root ([`launcher`], [`cli`]); the `mod` block below is
//! that list, and `tests/offline/layers.rs` checks it against every `crate::` path. A lower layer that needs
//! something from above takes a value or a trait object (the connection is built from a URL, the lock
//! middleware get the lock batcher from the job's context); only the [`launcher`] knows everything.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

// The ladder of docs/layout.md, bottom to top: one folder a layer (`config` is a layer and a module),// the wiring (`launcher`, `cli`) at the root. Each module keeps its old path: the crate's own code and
// applications name `crate::keys`, `oxidekiq::client`, through the re-exports below.
mod chain;
pub mod cli;
pub mod config;
mod connection;
pub mod launcher;
mod locks;
mod ops;
mod payload;
mod processing;
mod sidekiq;
mod support;
#[cfg(feature = "testing")]
pub mod testing;

pub(crate) use chain::blocking;
pub use chain::{client, continuable, iterable, middleware, registry, worker};
pub(crate) use connection::{lua, redis_conn, sentinel};
pub(crate) use locks::lock_batch;
pub use locks::{lock, unique_jobs};
pub use ops::cron;
pub(crate) use ops::{heartbeat, http, queue_gauges};
pub(crate) use payload::activejob;
pub use payload::job;
pub(crate) use processing::{fetch, manager, migrate, processor, work_table};
pub(crate) use sidekiq::{fleet, metrics, retry, route_table, scheduled};
pub use support::error;
pub(crate) use support::{encoding, events, keys, logging, otel, prom, redact, shutdown, time};

// Tests moved in from tests/ (they need crate-internal items) start their own redis-server and Ruby
// through the integration tests' own harness, and keep their `oxidekiq::` paths.
#[cfg(test)]
extern crate self as oxidekiq;
#[cfg(test)]
#[path = "../tests/support/mod.rs"]
mod test_support;
// README.md and docs/*.md, so `cargo test --doc` compiles their Rust snippets.
#[cfg(doctest)]
mod doc_snippets;

#[doc(inline)]
pub use blocking::{Blocking, BlockingWorker};
#[doc(inline)]
pub use cli::run;
#[doc(inline)]
pub use client::{Client, ClientMiddleware, ClientNext, NewActiveJob, NewJob, Push};
#[doc(inline)]
pub use config::Config;
/// A sidekiq-cron schedule declared in Rust.
pub use config::CronJob;
#[doc(inline)]
pub use continuable::{Continuable, ContinuableWorker, ContinuationOptions, Step, StepDef};
#[doc(inline)]
pub use error::{Error, JobError, JobResult, Result, RetryAction};
#[doc(inline)]
pub use job::{Job, RetrySetting};
#[doc(inline)]
pub use launcher::Launcher;
#[doc(inline)]
pub use middleware::concurrency::ConcurrencyLimit;
#[doc(inline)]
pub use middleware::rate_limit::RateLimit;
#[doc(inline)]
pub use middleware::sequential::SequentialJob;
#[doc(inline)]
pub use middleware::unique::{OnConflict, UniqueJob};
#[doc(inline)]
pub use middleware::{BoxFuture, Keyed, LockKey, Next, ServerMiddleware};
#[doc(inline)]
pub use registry::{Registration, Registry};
#[doc(inline)]
pub use worker::{
    ActiveJobInfo, AjValue, Continuation, HashKind, InterruptReason, JobContext, NoArgs, Worker,
    WorkerOptions,
};

// The fuzz target's body, built only by `cargo fuzz` (`--cfg fuzzing`): it reaches internal modules.
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzzing;
