//! Operations: the heartbeat and Busy page, the queue gauges, `/metrics` and the probes, sidekiq-cron's poller. Uses layers 1-8.
//!
//! One layer of the ladder in docs/layout.md; `tests/offline/layers.rs` checks that every module here uses
//! only this folder's modules left of it and the folders below.

pub mod cron;
pub(crate) mod heartbeat;
pub(crate) mod http;
pub(crate) mod queue_gauges;
