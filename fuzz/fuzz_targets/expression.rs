#![no_main]
//! See `vigil::harness::fuzzing::expression`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| vigil::harness::fuzzing::expression(data));
