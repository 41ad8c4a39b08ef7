//! Fuzzes the suite parser: any text must parse or give an error, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = ckpt_harness::suite::Suite::parse(std::path::Path::new("fuzz.yaml"), text);
    }
});
