//! Fuzzes everything that reads a payload Ruby (or anyone) left in Redis; the body is
//! `oxidekiq::fuzzing::payload` (src/fuzzing.rs), inside the crate so it reaches the internal readers.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| oxidekiq::fuzzing::payload(data));
