#![no_main]
//! See `vigil::harness::fuzzing::decode_event`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| vigil::harness::fuzzing::decode_event(data));
