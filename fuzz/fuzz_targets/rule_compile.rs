#![no_main]
//! See `vigil::fuzzing::compile_rules`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| vigil::fuzzing::compile_rules(data));
