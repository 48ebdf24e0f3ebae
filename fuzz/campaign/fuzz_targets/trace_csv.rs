//! libFuzzer entry point of carve-fuzz's `trace_csv` target.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| carve_fuzz::trace::fuzz_trace_csv(data));
