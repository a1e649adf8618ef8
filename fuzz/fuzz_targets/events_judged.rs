#![no_main]
//! See `vigil::harness::fuzzing::events`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| vigil::harness::fuzzing::events(data));
