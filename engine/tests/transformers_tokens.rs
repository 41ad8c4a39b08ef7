//! The engine's fine-tuning samples equal transformers': for every case of
//! `golden/sft/transformers.json` (written by `scripts/sft_reference.py` with transformers'
//! `apply_chat_template` and tokenizer calls, and checked against transformers again in CI),
//! the token ids and which of them the loss learns, read through the same JSONL path a run
//! reads its dataset by.

use ckpt_engine::data::text::{Columns, Labels, Overlong, Padding, TextData};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The columns a case's kind is written in.
fn columns(kind: &str) -> Columns {
    let name = |n: &str| Some(n.to_string());
    match kind {
        "messages" => Columns {
            messages: name("messages"),
            ..Columns::default()
        },
        "prompt_completion" => Columns {
            prompt: name("prompt"),
            completion: name("completion"),
            ..Columns::default()
        },
        "text" => Columns {
            text: name("text"),
            ..Columns::default()
        },
        other => panic!("unknown kind {other}"),
    }
}

/// A case's input as the row of a dataset of its kind.
fn row(kind: &str, input: &serde_json::Value) -> serde_json::Value {
    match kind {
        "messages" => serde_json::json!({"messages": input}),
        "prompt_completion" => input.clone(),
        _ => serde_json::json!({"text": input}),
    }
}

#[test]
fn tokens_and_learned_tokens_equal_transformers() {
    let golden: serde_json::Value = serde_json::from_slice(
        &std::fs::read(repo().join("golden/sft/transformers.json")).unwrap(),
    )
    .unwrap();
    let cases = golden["cases"].as_array().unwrap();
    let mut groups: Vec<(&str, &str)> = cases
        .iter()
        .map(|c| {
            (
                c["tokenizer"].as_str().unwrap(),
                c["kind"].as_str().unwrap(),
            )
        })
        .collect();
    groups.sort_unstable();
    groups.dedup();
    assert_eq!(groups.len(), 5, "{groups:?}");
    let dir = tempfile::tempdir().unwrap();
    let mut compared = 0;
    for (tokenizer, kind) in groups {
        let group: Vec<&serde_json::Value> = cases
            .iter()
            .filter(|c| c["tokenizer"] == tokenizer && c["kind"] == kind)
            .collect();
        let path = dir.path().join(format!("{tokenizer}-{kind}.jsonl"));
        let lines: Vec<String> = group
            .iter()
            .map(|c| row(kind, &c["input"]).to_string())
            .collect();
        std::fs::write(&path, lines.join("\n")).unwrap();
        let data = TextData {
            path,
            columns: columns(kind),
            tokenizer: repo().join("suites/data").join(tokenizer),
            labels: Labels::Answer,
            padding: Padding::Longest,
            overlong: Overlong::Refuse,
            group_by_length: false,
        };
        let samples = data.load(512, 1 << 20).unwrap();
        assert_eq!(samples.tokens.len(), group.len());
        assert_eq!(samples.pad_id, 4, "<|pad|>");
        for (case, got) in group.iter().zip(&samples.tokens) {
            let name = format!("{} ({tokenizer}, {kind})", case["name"]);
            let want_ids: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).unwrap();
            let want_mask: Vec<u8> = serde_json::from_value(case["labels_mask"].clone()).unwrap();
            assert_eq!(got.ids, want_ids, "{name}: token ids");
            let mask: Vec<u8> = got.learned.iter().map(|&l| u8::from(l)).collect();
            assert_eq!(mask, want_mask, "{name}: learned tokens");
            compared += 1;
        }
    }
    assert_eq!(compared, cases.len());
}
