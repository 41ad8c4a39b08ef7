//! Fuzzes judging another trainer's record: the input is the `ckpt-record/1` record of a suite's
//! trial (as the Python recorder writes one from a PyTorch loop or the Hugging Face Trainer),
//! judged as `ckpt-harness judge` judges it: read, every check run over it, the summary, JUnit
//! and HTML report written. A record that is not one must be reported as such, and any record
//! judged; never a panic.
#![no_main]

use ckpt_harness::cli::judge::{judge, JudgeOptions};
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;

/// A suite of a plain PyTorch loop judged through its record, every check on (the golden one
/// with no snapshot kept).
const SUITE: &str = "name: pytorch-plain-loop
devices: [cpu]
model: {vocab_size: 32, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 2, max_position_embeddings: 16}
data: {kind: synthetic, seed: 1, samples: 10}
batch_size: 4
seq_len: 8
optimizer: {lr: 0.01}
training: {max_steps: 6, extra_steps: 2, resume_from: 3}
engine:
  command: python3 train.py --phase {phase} --record {record}
";

struct Fixture {
    dir: tempfile::TempDir,
    suite: PathBuf,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let suite = dir.path().join("pytorch-plain-loop.yaml");
        std::fs::write(&suite, SUITE).unwrap();
        Fixture { dir, suite }
    })
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    let work = tempfile::tempdir_in(f.dir.path()).unwrap();
    let records = work.path().join("records");
    std::fs::create_dir(&records).unwrap();
    std::fs::write(records.join("cpu.pytorch-plain-loop.jsonl"), data).unwrap();
    let opts = JudgeOptions {
        paths: vec![f.suite.clone()],
        records,
        report: work.path().join("report"),
        junit: Some(work.path().join("junit.xml")),
        golden: Some(work.path().join("golden")),
        baseline: None,
    };
    let _ = judge(&opts, &mut std::io::sink());
});
