#![no_main]
//! See `vigil::fuzzing::redis_reply`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| vigil::fuzzing::redis_reply(data));
