#![no_main]
//! See `vigil::fuzzing::decode_event`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| vigil::fuzzing::decode_event(data));
