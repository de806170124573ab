//! Sidekiq's own data: the Metrics tab, the retry and dead sets, which versions are alive, the rolled-back classes, the schedule poller. Uses layers 1-4.
//!
//! One layer of the ladder in docs/layout.md; `tests/offline/layers.rs` checks that every module here uses
//! only this folder's modules left of it and the folders below.

pub(crate) mod fleet;
pub(crate) mod metrics;
pub(crate) mod retry;
pub(crate) mod route_table;
pub(crate) mod scheduled;
