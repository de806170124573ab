//! The payload: a job's bytes as Ruby wrote them, and the ActiveJob wire format. Uses `support` only.
//!
//! One layer of the ladder in docs/layout.md; `tests/offline/layers.rs` checks that every module here uses
//! only this folder's modules left of it and the folders below.

pub(crate) mod activejob;
pub mod job;
