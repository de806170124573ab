//! The Rust snippets of `README.md` and `docs/*.md`, compiled by `cargo test --doc`.
//!
//! Each page is the doc comment of one item below, so rustdoc tests its ```` ```rust ```` blocks as it
//! tests any doc example: they are compiled, and run unless marked `no_run` (those that connect to
//! Redis or call [`crate::run`]). Warnings are errors here, but for types a snippet only defines, so a
//! snippet with an unused variable or import fails too. `ignore` would compile nothing: `tests/binary/docs.rs`
//! refuses it, and checks that every page holding a Rust block is listed here.
//!
//! Only built under `cfg(doctest)`: it is outside the module ladder (it imports nothing and nothing
//! imports it).
#![doc(test(attr(deny(warnings), allow(dead_code))))]

/// README.md
#[doc = include_str!("../README.md")]
struct Readme;

/// docs/benchmark.md
#[doc = include_str!("../docs/benchmark.md")]
struct Benchmark;

/// docs/compatibility.md
#[doc = include_str!("../docs/compatibility.md")]
struct Compatibility;

/// docs/configuration.md
#[doc = include_str!("../docs/configuration.md")]
struct Configuration;

/// docs/continuations.md
#[doc = include_str!("../docs/continuations.md")]
struct Continuations;

/// docs/cron.md
#[doc = include_str!("../docs/cron.md")]
struct Cron;

/// docs/guarantees.md
#[doc = include_str!("../docs/guarantees.md")]
struct Guarantees;

/// docs/migration.md
#[doc = include_str!("../docs/migration.md")]
struct Migration;

/// docs/running.md
#[doc = include_str!("../docs/running.md")]
struct Running;

/// docs/security.md
#[doc = include_str!("../docs/security.md")]
struct Security;

/// docs/testing.md
#[doc = include_str!("../docs/testing.md")]
struct Testing;

/// docs/workers.md
#[doc = include_str!("../docs/workers.md")]
struct Workers;
