//! Support: the layer every other one builds on. It knows nothing else of the crate.
//!
//! One layer of the ladder in docs/layout.md; `tests/offline/layers.rs` checks that every module here uses
//! only this folder's modules left of it and the folders below.

pub(crate) mod encoding;
pub mod error;
pub(crate) mod events;
pub(crate) mod keys;
pub(crate) mod logging;
pub(crate) mod otel;
pub(crate) mod prom;
pub(crate) mod redact;
pub(crate) mod shutdown;
pub(crate) mod time;
