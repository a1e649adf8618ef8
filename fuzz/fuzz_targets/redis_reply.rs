#![no_main]
//! See `vigil::harness::fuzzing::redis_reply`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| vigil::harness::fuzzing::redis_reply(data));
