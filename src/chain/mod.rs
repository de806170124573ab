//! The job chain: the `Worker` trait and its context, blocking, iterable and continuable workers, the server middleware, the registry and the client. Uses layers 1-6.
//!
//! One layer of the ladder in docs/layout.md; `tests/offline/layers.rs` checks that every module here uses
//! only this folder's modules left of it and the folders below.

pub(crate) mod blocking;
pub mod client;
pub mod continuable;
pub mod iterable;
pub mod middleware;
pub mod registry;
pub mod worker;
