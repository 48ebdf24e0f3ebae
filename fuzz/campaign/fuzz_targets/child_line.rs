//! libFuzzer entry point of carve-fuzz's `child_line` target.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| carve_fuzz::child_line::fuzz_child_line(data));
