#![no_main]
//! See `vigil::fuzzing::expression`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| vigil::fuzzing::expression(data));
