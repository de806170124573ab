//! Redis access: the shared Lua writers, Sentinel discovery and the connection. Uses the layers below (`support`, `payload`). Not named `redis`, which would shadow the crate.
//!
//! One layer of the ladder in docs/layout.md; `tests/offline/layers.rs` checks that every module here uses
//! only this folder's modules left of it and the folders below.

pub(crate) mod lua;
pub(crate) mod redis_conn;
pub(crate) mod sentinel;
