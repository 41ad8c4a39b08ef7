//! Fine-tuning data as users keep it: the rows of a JSONL or Parquet file, each mapped by the suite's
//! columns to a conversation, a prompt and its completion, or a text; rendered by the
//! tokenizer's chat template, tokenized, with the loss on the answer only. Every sample is
//! tokenized when the loader is built; rows are cut from the samples by [`super::DataLoader`].

pub mod cache;
pub mod rows;
pub mod template;
pub mod tokenizer;

use crate::error::{EngineError, Result, Setting};
use rayon::prelude::*;
use rows::{Row, DATASET};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
pub use tokenizer::{HfTokenizer, Tokens};

/// Text data: where it is, how its columns are read and how its samples become rows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextData {
    /// The dataset: a JSONL file (one JSON object a line) or a Parquet file.
    pub path: PathBuf,
    /// Which columns hold the sample.
    pub columns: Columns,
    /// The Hugging Face tokenizer directory (`tokenizer.json`, `tokenizer_config.json`).
    pub tokenizer: PathBuf,
    /// Which tokens the loss learns.
    #[serde(default)]
    pub labels: Labels,
    /// How long a micro-batch's rows are.
    #[serde(default)]
    pub padding: Padding,
    /// What becomes of a sample longer than the run's `seq_len`.
    #[serde(default)]
    pub overlong: Overlong,
    /// Each epoch's shuffled order grouped by length, as transformers' `group_by_length`
    /// groups it: micro-batches of samples of like lengths, the longest first.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub group_by_length: bool,
}

/// The columns a sample is read from: `messages` (a list of `{role, content}`), or `prompt`
/// and `completion` (strings, or lists of messages), or `text`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Columns {
    /// A conversation, rendered by the chat template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages: Option<String>,
    /// The user's turn, rendered with `completion` as a conversation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// The assistant's answer to `prompt`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion: Option<String>,
    /// A plain text, tokenized with the tokenizer's special tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// Which tokens the loss learns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Labels {
    /// The assistant's (or completion's) tokens; every token of a plain text.
    #[default]
    Answer,
    /// Every token.
    All,
}

/// How long a micro-batch's rows are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Padding {
    /// As long as the micro-batch's longest sample: the shape changes from step to step.
    #[default]
    Longest,
    /// Always the run's `seq_len`.
    MaxLength,
    /// Whole samples one after another in rows of the run's `seq_len` tokens (Automodel's
    /// packed sequences, transformers' padding-free collation): a sample that does not fit in
    /// what is left of a row begins the next one (the pack in flight, kept in the loader's
    /// state), positions restart at each sample and a token attends only to its own sample's
    /// tokens. Evaluations pad each micro-batch to its longest sample instead.
    Packed,
}

/// What becomes of a sample longer than the run's `seq_len`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlong {
    /// The run is refused, naming the sample.
    #[default]
    Refuse,
    /// Its first `seq_len` tokens are kept.
    Truncate,
}

/// How a row's columns become tokens.
enum Form<'a> {
    Messages(&'a str),
    PromptCompletion(&'a str, &'a str),
    Text(&'a str),
}

impl Columns {
    fn form(&self) -> Result<Form<'_>> {
        match (&self.messages, &self.prompt, &self.completion, &self.text) {
            (Some(m), None, None, None) => Ok(Form::Messages(m)),
            (None, Some(p), Some(c), None) => Ok(Form::PromptCompletion(p, c)),
            (None, None, None, Some(t)) => Ok(Form::Text(t)),
            _ => Err(Setting::new(
                "data.columns",
                "data.columns names the columns of one form of sample: {messages: COLUMN}, {prompt: COLUMN, completion: COLUMN} or {text: COLUMN}",
            )
            .into()),
        }
    }
}

/// The version of the way rows become tokens, part of every cache key: raised with any change
/// to it, so that no run reads samples an earlier way made.
const TOKENIZATION_VERSION: u32 = 1;

/// The tokenized samples of a dataset, in file order, and the id rows are padded with.
pub struct Samples {
    /// Each row's tokens.
    pub tokens: Vec<Tokens>,
    /// The padding id.
    pub pad_id: u32,
}

impl TextData {
    /// Reads and tokenizes every row, for a model of `vocab` tokens and rows of at most
    /// `seq_len`, keeping the tokens in the cache directory ([`cache::dir`]) for the next run.
    pub fn load(&self, vocab: usize, seq_len: usize) -> Result<Samples> {
        self.load_cached(vocab, seq_len, cache::dir().as_deref())
    }

    /// [`TextData::load`] with the tokens kept in `cache` (none where `None`).
    pub fn load_cached(
        &self,
        vocab: usize,
        seq_len: usize,
        cache: Option<&Path>,
    ) -> Result<Samples> {
        let form = self.columns.form()?;
        let tokenizer = HfTokenizer::open(&self.tokenizer)?;
        if tokenizer.vocab_size() > vocab {
            return Err(Setting::new(
                "model.vocab_size",
                format!(
                    "the tokenizer in {} has {} tokens, more than model.vocab_size ({vocab}); write a vocab_size of at least {}",
                    self.tokenizer.display(),
                    tokenizer.vocab_size(),
                    tokenizer.vocab_size()
                ),
            )
            .into());
        }
        let (mut tokens, pad_id) = self.tokenized(&form, &tokenizer, cache)?;
        if let Some(at) = (tokens.iter()).position(|t| t.ids.len() > seq_len) {
            if self.overlong == Overlong::Refuse {
                let (place, _) = rows::read(&self.path)?.swap_remove(at);
                return Err(EngineError::bad_file(
                    &self.path,
                    format!(
                        "{place}: the sample is {} tokens, longer than seq_len ({seq_len}); write a longer seq_len, or data.overlong: truncate to keep its first {seq_len} tokens",
                        tokens[at].ids.len()
                    ),
                ));
            }
            for sample in &mut tokens {
                sample.ids.truncate(seq_len);
                sample.learned.truncate(seq_len);
            }
        }
        Ok(Samples { tokens, pad_id })
    }

    /// Every row's tokens, whole, and the padding id: from the entry in `cache` where they
    /// were kept, else tokenized and kept there.
    fn tokenized(
        &self,
        form: &Form<'_>,
        tokenizer: &HfTokenizer,
        cache: Option<&Path>,
    ) -> Result<(Vec<Tokens>, u32)> {
        let entry = match cache {
            Some(dir) => Some(cache::entry(dir, &self.cache_key(tokenizer)?)),
            None => None,
        };
        if let Some(kept) = entry.as_deref().and_then(cache::read) {
            return Ok(kept);
        }
        // Rows are tokenized on every core, each on its own; the first bad row in file order
        // is the one named.
        let tokens = (rows::read(&self.path)?.into_par_iter())
            .map(|(at, row)| {
                row.and_then(|row| self.tokenize(form, &row, tokenizer))
                    .map_err(|e| format!("{at}: {e}"))
            })
            .collect::<Vec<_>>()
            .into_iter()
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| EngineError::bad_file(&self.path, e))?;
        if tokens.is_empty() {
            return Err(EngineError::bad_file(
                &self.path,
                "holds no rows; a dataset holds a sample a row (a JSONL file one JSON object a line)",
            ));
        }
        if let Some(entry) = &entry {
            cache::write(entry, &tokens, tokenizer.pad_id());
        }
        Ok((tokens, tokenizer.pad_id()))
    }

    /// What the cache knows tokenized samples by: the content of the dataset, the tokenizer's
    /// files and the template, how rows are read and labelled, and the version of the way
    /// they are tokenized.
    fn cache_key(&self, tokenizer: &HfTokenizer) -> Result<String> {
        let config = self.tokenizer.join(tokenizer::CONFIG_FILE);
        let config = match config.exists() {
            true => super::content(&config, "a tokenizer_config.json")?,
            false => "none".into(),
        };
        let template = tokenizer
            .template_source()
            .map(|s| super::content_of(s.as_bytes()));
        Ok(serde_json::json!({
            "tokenization": TOKENIZATION_VERSION,
            "dataset": super::content(&self.path, DATASET)?,
            "tokenizer": super::content(&self.tokenizer.join(tokenizer::TOKENIZER_FILE), "a tokenizer.json")?,
            "config": config,
            "template": template,
            "columns": self.columns,
            "labels": self.labels,
        })
        .to_string())
    }

    /// One row's tokens, or what is wrong with it.
    fn tokenize(
        &self,
        form: &Form<'_>,
        row: &Row,
        tokenizer: &HfTokenizer,
    ) -> std::result::Result<Tokens, String> {
        let column = |name: &str| {
            row.get(name).ok_or_else(|| {
                let have: Vec<&str> = row.keys().map(String::as_str).collect();
                format!(
                    "no column `{name}` (the row has {}); name one of them in data.columns",
                    have.join(", ")
                )
            })
        };
        let all = self.labels == Labels::All;
        let tokens = match *form {
            Form::Messages(name) => {
                let messages = messages_of(name, column(name)?)?;
                tokenizer.chat(&serde_json::Value::Array(messages), all)
            }
            Form::PromptCompletion(prompt, completion) => {
                let mut messages = turns(prompt, column(prompt)?, "user")?;
                messages.extend(turns(completion, column(completion)?, "assistant")?);
                tokenizer.chat(&serde_json::Value::Array(messages), all)
            }
            Form::Text(name) => match column(name)? {
                serde_json::Value::String(text) => tokenizer.text(text, true),
                other => Err(format!(
                    "column `{name}` holds {}, not a string",
                    kind_of(other)
                )),
            },
        }?;
        match tokens.ids.is_empty() {
            true => Err("tokenizes to no tokens; remove the row or give it text".into()),
            false => Ok(tokens),
        }
    }

    /// What a run's identity records of its data: the dataset's, tokenizer's and chat
    /// template's content (size and sha256, not their paths), and how samples are read.
    pub fn identity(&self) -> Result<serde_json::Value> {
        let template = tokenizer::chat_template_source(&self.tokenizer)?
            .map(|s| super::content_of(s.as_bytes()));
        Ok(serde_json::json!({
            "kind": "text",
            "dataset": super::content(&self.path, DATASET)?,
            "tokenizer": super::content(&self.tokenizer.join(tokenizer::TOKENIZER_FILE), "a tokenizer.json")?,
            "template": template,
            "columns": self.columns,
            "labels": self.labels,
            "padding": self.padding,
            "overlong": self.overlong,
            "group_by_length": self.group_by_length,
        }))
    }

    /// The paths it reads, resolved against `base` (a suite's directory).
    pub fn relative_to(&self, base: &Path) -> Self {
        TextData {
            path: base.join(&self.path),
            tokenizer: base.join(&self.tokenizer),
            ..self.clone()
        }
    }
}

/// A column's list of messages, each without its keys whose value is null (as transformers
/// leaves them out of what a template sees), or what is wrong with it.
fn messages_of(
    name: &str,
    messages: &serde_json::Value,
) -> std::result::Result<Vec<serde_json::Value>, String> {
    let wrong = || {
        format!(
            "column `{name}` holds {}, not a list of messages ({{\"role\": ..., \"content\": ...}})",
            kind_of(messages)
        )
    };
    let list = messages.as_array().ok_or_else(wrong)?;
    list.iter()
        .map(|m| {
            let object = m.as_object().ok_or_else(wrong)?;
            let kept = object.iter().filter(|(_, v)| !v.is_null());
            Ok(serde_json::Value::Object(
                kept.map(|(k, v)| (k.clone(), v.clone())).collect(),
            ))
        })
        .collect()
}

/// A prompt or completion column as messages: a string is one message of `role`.
fn turns(
    name: &str,
    value: &serde_json::Value,
    role: &str,
) -> std::result::Result<Vec<serde_json::Value>, String> {
    match value {
        serde_json::Value::String(content) => {
            Ok(vec![serde_json::json!({"role": role, "content": content})])
        }
        serde_json::Value::Array(_) => messages_of(name, value),
        other => Err(format!(
            "column `{name}` holds {}, not a string or a list of messages",
            kind_of(other)
        )),
    }
}

fn kind_of(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(dir: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../suites/data")
            .join(dir)
    }

    /// Chat data of `lines` in a temporary directory, read with the fixture tokenizer.
    fn chat(lines: &str) -> (tempfile::TempDir, TextData) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        std::fs::write(&path, lines).unwrap();
        let data = TextData {
            path,
            columns: Columns {
                messages: Some("messages".into()),
                ..Columns::default()
            },
            tokenizer: fixture("tokenizer"),
            labels: Labels::Answer,
            padding: Padding::Longest,
            overlong: Overlong::Refuse,
            group_by_length: false,
        };
        (dir, data)
    }

    const ROW: &str = r#"{"messages": [{"role": "user", "content": "Where?"}, {"role": "assistant", "content": "Zürich"}]}"#;

    fn refusal(data: &TextData, seq_len: usize) -> String {
        match data.load(512, seq_len) {
            Ok(_) => panic!("loaded"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn the_answer_alone_is_learned() {
        let (_dir, data) = chat(ROW);
        let tokens = &data.load(512, 512).unwrap().tokens[0];
        let tokenizer = HfTokenizer::open(&data.tokenizer).unwrap();
        let learned: Vec<u32> = (tokens.ids.iter().zip(&tokens.learned))
            .filter(|(_, &l)| l)
            .map(|(&t, _)| t)
            .collect();
        let answer = tokenizer.text("Zürich<|im_end|>", false).unwrap().ids;
        assert_eq!(learned, answer);
        let all = TextData {
            labels: Labels::All,
            ..data
        };
        let every = &all.load(512, 512).unwrap().tokens[0];
        assert!(every.learned.iter().all(|&l| l));
    }

    #[test]
    fn keys_whose_value_is_null_are_left_out_as_transformers_leaves_them() {
        let with_nulls = ROW.replace(
            r#""content": "Zürich"}"#,
            r#""content": "Zürich", "tool_calls": null}"#,
        );
        assert_ne!(with_nulls, ROW);
        let (_dir, data) = chat(&format!("{ROW}\n{with_nulls}"));
        let tokens = data.load(512, 512).unwrap().tokens;
        assert_eq!(tokens[0], tokens[1]);
        let (_dir, data) = chat(&ROW.replace("\"Where?\"", "null"));
        let e = refusal(&data, 512);
        assert!(e.contains("line 1: the chat template of "), "{e}");
    }

    #[test]
    fn bad_rows_are_refused_naming_the_line_and_the_fix() {
        let cases = [
            (format!("{ROW}\n{{\"messages\": [1,"), "d.jsonl: line 2: is not a JSON object (EOF while parsing a value at line 1 column 16); a JSONL dataset holds one object a line".to_string()),
            (r#"{"prompt": "a", "id": 3}"#.to_string(), "d.jsonl: line 1: no column `messages` (the row has id, prompt); name one of them in data.columns".to_string()),
            (r#"{"messages": "hi"}"#.to_string(), "d.jsonl: line 1: column `messages` holds a string, not a list of messages ({\"role\": ..., \"content\": ...})".to_string()),
            (format!("\n\n{}", ROW.replace("\"user\"", "\"tool\"")), format!("d.jsonl: line 3: the chat template of {} refused the conversation: Only system, user and assistant roles are supported, not tool. (chat template line 11)", fixture("tokenizer/chat_template.jinja").display())),
            ("\n  \n".to_string(), "d.jsonl: holds no rows; a dataset holds a sample a row (a JSONL file one JSON object a line)".to_string()),
        ];
        for (lines, want) in cases {
            let (_dir, data) = chat(&lines);
            let e = refusal(&data, 512);
            assert!(e.ends_with(&want), "{e}\nwanted it to end with\n{want}");
        }
        let (dir, data) = chat(ROW);
        std::fs::write(&data.path, b"{\"messages\": \"caf\xe9\"}\n").unwrap();
        let e = refusal(&data, 512);
        assert!(
            e.ends_with(
                "d.jsonl: line 1: is not UTF-8 (byte 18 of the line); write the file as UTF-8"
            ),
            "{e}"
        );
        drop(dir);
    }

    #[test]
    fn a_sample_over_seq_len_is_refused_or_cut_as_the_suite_says() {
        let (_dir, data) = chat(&format!("{ROW}\n{ROW}"));
        let len = data.load(512, 512).unwrap().tokens[0].ids.len();
        let e = refusal(&data, len - 1);
        assert!(
            e.ends_with(&format!("d.jsonl: line 1: the sample is {len} tokens, longer than seq_len ({}); write a longer seq_len, or data.overlong: truncate to keep its first {} tokens", len - 1, len - 1)),
            "{e}"
        );
        let cut = TextData {
            overlong: Overlong::Truncate,
            ..data.clone()
        };
        let whole = &data.load(512, 512).unwrap().tokens[0];
        let short = &cut.load(512, len - 3).unwrap().tokens[0];
        assert_eq!(short.ids, whole.ids[..len - 3]);
        assert_eq!(short.learned, whole.learned[..len - 3]);
    }

    #[test]
    fn a_tokenizer_or_columns_that_cannot_be_read_are_refused() {
        let (dir, data) = chat(ROW);
        let broken = dir.path().join("broken");
        std::fs::create_dir(&broken).unwrap();
        std::fs::write(broken.join("tokenizer.json"), "{\"model\": 3}").unwrap();
        let bad = TextData {
            tokenizer: broken.clone(),
            ..data.clone()
        };
        let e = refusal(&bad, 512);
        assert!(
            e.starts_with(&format!(
                "{}: is not a tokenizer the tokenizers library reads: ",
                broken.join("tokenizer.json").display()
            )),
            "{e}"
        );
        assert!(
            e.ends_with(
                "; save it again with transformers' save_pretrained or tokenizers' Tokenizer.save"
            ),
            "{e}"
        );
        let mixed = TextData {
            columns: Columns {
                messages: Some("messages".into()),
                text: Some("text".into()),
                ..Columns::default()
            },
            ..data.clone()
        };
        match mixed.load(512, 512) {
            Err(EngineError::Setting(s)) => assert_eq!(s.key, "data.columns"),
            other => panic!("{:?}", other.err()),
        }
        match data.load(300, 512) {
            Err(EngineError::Setting(s)) => {
                assert_eq!(s.key, "model.vocab_size");
                assert!(s.message.ends_with("has 512 tokens, more than model.vocab_size (300); write a vocab_size of at least 512"), "{}", s.message);
            }
            other => panic!("{:?}", other.err()),
        }
        let no_template = dir.path().join("no-template");
        std::fs::create_dir(&no_template).unwrap();
        std::fs::copy(
            fixture("tokenizer/tokenizer.json"),
            no_template.join("tokenizer.json"),
        )
        .unwrap();
        let plain = TextData {
            tokenizer: no_template,
            ..data
        };
        let e = refusal(&plain, 512);
        assert!(e.contains("line 1: the tokenizer in ") && e.ends_with("has no chat template (no chat_template.jinja, no chat_template in tokenizer_config.json); map a text column instead, or use the model's own tokenizer directory"), "{e}");
    }
}
