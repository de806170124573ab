//! Locks: the batch task of job locks, the one lock primitive, and sidekiq-unique-jobs' server side. Uses layers 1-5.
//!
//! One layer of the ladder in docs/layout.md; `tests/offline/layers.rs` checks that every module here uses
//! only this folder's modules left of it and the folders below.

pub mod lock;
pub(crate) mod lock_batch;
pub mod unique_jobs;
