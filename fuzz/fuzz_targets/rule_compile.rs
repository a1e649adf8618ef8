#![no_main]
//! See `vigil::harness::fuzzing::compile_rules`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| vigil::harness::fuzzing::compile_rules(data));
