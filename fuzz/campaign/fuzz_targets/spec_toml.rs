//! libFuzzer entry point of carve-fuzz's `spec_toml` target.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| carve_fuzz::spec::fuzz_spec_toml(data));
