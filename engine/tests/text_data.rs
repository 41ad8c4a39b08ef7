//! Training on fine-tuning text: rows as long as each micro-batch's longest sample, and a run's
//! identity that holds the dataset's, the tokenizer's and the chat template's content, so that a
//! resume on any of them changed is refused, naming which.

mod common;

use ckpt_engine::config::{Precision, TrainConfig};
use ckpt_engine::data::text::{Columns, Labels, Overlong, Padding, TextData};
use ckpt_engine::data::DataConfig;
use ckpt_engine::{CpuDevice, Trainer};
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../suites/data")
}

/// A copy of the fixture dataset's first 30 rows and of its tokenizer under `dir`, and a run
/// of 2 rows a micro-batch on them.
fn run_on_copies(dir: &Path) -> TrainConfig {
    let rows: Vec<String> = std::fs::read_to_string(fixtures().join("squad-sft.jsonl"))
        .unwrap()
        .lines()
        .take(30)
        .map(str::to_string)
        .collect();
    std::fs::write(dir.join("d.jsonl"), rows.join("\n")).unwrap();
    let tokenizer = dir.join("tokenizer");
    std::fs::create_dir(&tokenizer).unwrap();
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        std::fs::copy(
            fixtures().join("tokenizer").join(file),
            tokenizer.join(file),
        )
        .unwrap();
    }
    let mut model = common::llama(512, 32, 2);
    model.max_position_embeddings = 1024;
    let mut run = common::train_config(model, Precision::Fp32, 2, 1024, 10);
    run.data = DataConfig::Text(TextData {
        path: dir.join("d.jsonl"),
        columns: Columns {
            messages: Some("messages".into()),
            ..Columns::default()
        },
        tokenizer,
        labels: Labels::Answer,
        padding: Padding::Longest,
        overlong: Overlong::Refuse,
        group_by_length: false,
    });
    run
}

fn device() -> CpuDevice {
    CpuDevice::new(2, u64::MAX).unwrap()
}

#[test]
fn rows_are_as_long_as_each_micro_batchs_longest_sample() {
    let dir = tempfile::tempdir().unwrap();
    let run = run_on_copies(dir.path());
    let mut trainer = Trainer::new(run, device()).unwrap();
    let mut lengths = Vec::new();
    for _ in 0..6 {
        let s = trainer.step().unwrap();
        assert!(s.loss.is_finite());
        lengths.extend(s.seq_lens);
    }
    lengths.sort_unstable();
    lengths.dedup();
    assert!(lengths.len() >= 4, "{lengths:?}");
    assert!(lengths.iter().all(|&l| l < 1024), "{lengths:?}");
}

#[test]
fn a_resume_on_changed_data_tokenizer_or_template_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let run = run_on_copies(dir.path());
    let mut trainer = Trainer::new(run.clone(), device()).unwrap();
    trainer.step().unwrap();
    let saved = trainer.save(&dir.path().join("run"), None).unwrap();
    Trainer::resume(run.clone(), device(), &saved).unwrap();
    let tokenizer = dir.path().join("tokenizer");
    let changes: [(PathBuf, &str); 3] = [
        (dir.path().join("d.jsonl"), "data.dataset"),
        (tokenizer.join("tokenizer.json"), "data.tokenizer"),
        (tokenizer.join("chat_template.jinja"), "data.template"),
    ];
    for (file, key) in changes {
        let original = std::fs::read(&file).unwrap();
        let mut changed = original.clone();
        changed.extend_from_slice(b"\n");
        std::fs::write(&file, changed).unwrap();
        let e = match Trainer::resume(run.clone(), device(), &saved) {
            Ok(_) => panic!("{key}: resumed"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains(&format!("checkpoint belongs to another run configuration ({key}: "))
                && e.ends_with("resume on the data, tokenizer and chat template it was trained on (each is recorded by its size and sha256, not its path)"),
            "{key}: {e}"
        );
        std::fs::write(&file, original).unwrap();
    }
}

/// The fixture dataset's chat samples read from `file` under suites/data.
fn fixture_samples(file: &str, column: &str) -> ckpt_engine::Result<Vec<Vec<u32>>> {
    let data = TextData {
        path: fixtures().join(file),
        columns: Columns {
            messages: Some(column.into()),
            ..Columns::default()
        },
        tokenizer: fixtures().join("tokenizer"),
        labels: Labels::Answer,
        padding: Padding::Longest,
        overlong: Overlong::Refuse,
        group_by_length: false,
    };
    let samples = data.load(512, 4096)?;
    Ok(samples.tokens.into_iter().map(|t| t.ids).collect())
}

#[test]
fn a_parquet_dataset_gives_the_samples_of_the_same_rows_in_jsonl() {
    let parquet = fixture_samples("squad-sft.parquet", "messages").unwrap();
    assert_eq!(parquet.len(), 144);
    assert_eq!(
        parquet,
        fixture_samples("squad-sft.jsonl", "messages").unwrap()
    );
}

#[test]
fn a_parquet_row_without_the_column_is_named_by_row_group_and_row() {
    let e = fixture_samples("squad-sft.parquet", "conversation")
        .unwrap_err()
        .to_string();
    assert!(
        e.ends_with("squad-sft.parquet: row group 0, row 0: no column `conversation` (the row has answer, completion, context, id, messages, prompt, question, text, title); name one of them in data.columns"),
        "{e}"
    );
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("d.parquet");
    std::fs::write(&fake, "{\"messages\": []}\n").unwrap();
    let mut run = run_on_copies(dir.path());
    if let DataConfig::Text(text) = &mut run.data {
        text.path = fake.clone();
    }
    let e = match Trainer::new(run, device()) {
        Ok(_) => panic!("trained on a JSONL file named .parquet"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.starts_with(&format!(
            "{}: is not a Parquet file this build reads: ",
            fake.display()
        )),
        "{e}"
    );
}

#[test]
fn tokens_are_kept_by_content_and_a_changed_or_damaged_entry_is_never_used() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let run = run_on_copies(dir.path());
    let DataConfig::Text(data) = &run.data else {
        unreachable!()
    };
    let fresh = data.load_cached(512, 1024, None).unwrap().tokens;
    let first = data.load_cached(512, 1024, Some(&cache)).unwrap().tokens;
    assert_eq!(first, fresh);
    let entries = || -> Vec<PathBuf> {
        let mut e: Vec<PathBuf> = std::fs::read_dir(&cache)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        e.sort();
        e
    };
    let [entry] = entries().try_into().unwrap();
    // An entry is read, not made again: one planted in its place (valid, other samples) is
    // what the next load gives.
    let planted = &fresh[..3];
    ckpt_engine::data::text::cache::write(&entry, planted, 4);
    let read = data.load_cached(512, 1024, Some(&cache)).unwrap().tokens;
    assert_eq!(read, planted);
    // A damaged entry is tokenized again, and kept anew.
    let mut bytes = std::fs::read(&entry).unwrap();
    bytes[40] ^= 0xff;
    std::fs::write(&entry, bytes).unwrap();
    assert_eq!(
        data.load_cached(512, 1024, Some(&cache)).unwrap().tokens,
        fresh
    );
    assert_eq!(
        data.load_cached(512, 1024, Some(&cache)).unwrap().tokens,
        fresh
    );
    // Another dataset is another key.
    let mut rows = std::fs::read_to_string(&data.path).unwrap();
    rows.push_str("\n{\"messages\": [{\"role\": \"user\", \"content\": \"?\"}, {\"role\": \"assistant\", \"content\": \"!\"}]}");
    std::fs::write(&data.path, rows).unwrap();
    let more = data.load_cached(512, 1024, Some(&cache)).unwrap().tokens;
    assert_eq!((more.len(), &more[..30]), (31, &fresh[..]));
    assert_eq!(entries().len(), 2);
}
