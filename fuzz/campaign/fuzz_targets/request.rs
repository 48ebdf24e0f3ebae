//! libFuzzer entry point of carve-fuzz's `request` target.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| carve_fuzz::requests::fuzz_request(data));
