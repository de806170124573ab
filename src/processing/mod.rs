//! Processing: the fetch strategies, the jobs in flight, the migration tools, one job's run, and the slots, acker and push-back. Uses layers 1-7.
//!
//! One layer of the ladder in docs/layout.md; `tests/offline/layers.rs` checks that every module here uses
//! only this folder's modules left of it and the folders below.

pub(crate) mod fetch;
pub(crate) mod manager;
pub(crate) mod migrate;
pub(crate) mod processor;
pub(crate) mod work_table;
