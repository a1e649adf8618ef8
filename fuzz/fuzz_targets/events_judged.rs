#![no_main]
//! See `vigil::fuzzing::events`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| vigil::fuzzing::events(data));
