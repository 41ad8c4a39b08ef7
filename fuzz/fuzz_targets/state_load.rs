//! Fuzzes reading `trainer_state.json`: the input becomes a checkpoint's state file, with its
//! checksum recorded beside it when the first byte is even (so the parser sees every input) and
//! without when odd (the path of checkpoints written before the checksum existed). Reading the
//! state, and verifying the checkpoint it describes, must return a value or an error, never
//! panic.
#![no_main]

use ckpt_engine::checkpoint::{self, state_file, STATE_FILE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, content)) = data.split_first() else { return };
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(STATE_FILE), content).unwrap();
    if mode % 2 == 0 {
        state_file::reseal(dir.path()).unwrap();
    }
    let _ = state_file::read(dir.path());
    let _ = checkpoint::verify(dir.path());
});
