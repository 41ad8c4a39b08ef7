//! A Hugging Face tokenizer directory: `tokenizer.json` read by the `tokenizers` crate, the
//! special tokens and the chat template of `tokenizer_config.json` (or `chat_template.jinja`
//! beside it, where transformers 5 saves it).

use super::template::{ChatTemplate, Rendered};
use crate::error::{EngineError, Result};
use crate::regular_file;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// The tokenizer file of a directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// The file of its special tokens and chat template.
pub const CONFIG_FILE: &str = "tokenizer_config.json";
/// The chat template's own file, which transformers 5 writes beside the configuration.
pub const TEMPLATE_FILE: &str = "chat_template.jinja";

/// The special tokens transformers passes to a chat template, by their configuration keys.
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A tokenizer, its chat template and its special tokens.
pub struct HfTokenizer {
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    /// The template's source, as read (its identity).
    template_source: Option<String>,
    /// The special tokens by name, as the template sees them.
    special: Vec<(String, String)>,
    /// The id rows are padded with: the pad token's, else the end-of-sequence token's, else 0.
    pad_id: u32,
    dir: PathBuf,
}

/// Token ids and, for each, whether the model learns to predict it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tokens {
    /// The ids.
    pub ids: Vec<u32>,
    /// `true` where the token is a target of the loss.
    pub learned: Vec<bool>,
}

impl HfTokenizer {
    /// Reads the tokenizer in `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let file = dir.join(TOKENIZER_FILE);
        let bytes = regular_file::read(&file, "a Hugging Face tokenizer.json")?;
        let mut tokenizer = Tokenizer::from_bytes(&bytes).map_err(|e| {
            EngineError::bad_file(
                &file,
                format!("is not a tokenizer the tokenizers library reads: {e}; save it again with transformers' save_pretrained or tokenizers' Tokenizer.save"),
            )
        })?;
        tokenizer
            .with_truncation(None)
            .map_err(|e| EngineError::bad_file(&file, e.to_string()))?;
        tokenizer.with_padding(None);
        let config = read_config(dir)?;
        let special: Vec<(String, String)> = SPECIAL_TOKENS
            .iter()
            .filter_map(|&key| {
                let token = match &config[key] {
                    serde_json::Value::String(s) => s.clone(),
                    other => other["content"].as_str()?.to_string(),
                };
                Some((key.to_string(), token))
            })
            .collect();
        let id_of = |key: &str| {
            let (_, token) = special.iter().find(|(k, _)| k == key)?;
            tokenizer.token_to_id(token)
        };
        let pad_id = id_of("pad_token")
            .or_else(|| id_of("eos_token"))
            .unwrap_or(0);
        let (template_source, origin) = template_source(dir, &config)?;
        let template = match &template_source {
            Some(source) => Some(ChatTemplate::new(source, &origin)?),
            None => None,
        };
        Ok(HfTokenizer {
            tokenizer,
            template,
            template_source,
            special,
            pad_id,
            dir: dir.to_path_buf(),
        })
    }

    /// Tokens in the vocabulary, its added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The id short rows are padded with.
    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// The text of `ids`, special tokens written out.
    pub fn decode(&self, ids: &[u32]) -> std::result::Result<String, String> {
        self.tokenizer
            .decode(ids, false)
            .map_err(|e| format!("the tokenizer cannot decode {ids:?}: {e}"))
    }

    /// The chat template's source, where the tokenizer has one.
    pub fn template_source(&self) -> Option<&str> {
        self.template_source.as_deref()
    }

    /// The chat template, or what to do without one.
    pub fn template(&self) -> std::result::Result<&ChatTemplate, String> {
        self.template.as_ref().ok_or_else(|| {
            format!(
                "the tokenizer in {} has no chat template (no {TEMPLATE_FILE}, no chat_template in {CONFIG_FILE}); map a text column instead, or use the model's own tokenizer directory",
                self.dir.display()
            )
        })
    }

    /// `text` tokenized with the post-processor's special tokens (BOS, EOS) where
    /// `special_tokens`, every token learned: what `tokenizer(text)` gives.
    pub fn text(&self, text: &str, special_tokens: bool) -> std::result::Result<Tokens, String> {
        let ids = self.encode(text, special_tokens)?.get_ids().to_vec();
        let learned = vec![true; ids.len()];
        Ok(Tokens { ids, learned })
    }

    /// `messages` rendered by the chat template and tokenized as transformers'
    /// `apply_chat_template` does (no special tokens added: the template writes them). The
    /// learned tokens are the assistant's: its `{% generation %}` blocks
    /// (`return_assistant_tokens_mask`), or, for a template without them, everything after the
    /// conversation up to its last assistant message rendered with `add_generation_prompt`.
    /// Every token is learned where `all`.
    pub fn chat(
        &self,
        messages: &serde_json::Value,
        all: bool,
    ) -> std::result::Result<Tokens, String> {
        let template = self.template()?;
        let rendered = template.render(messages, false, &self.special)?;
        let encoding = self.encode(&rendered.text, false)?;
        let ids = encoding.get_ids().to_vec();
        let learned = if all {
            vec![true; ids.len()]
        } else if template.marks_generation() {
            assistant_mask(&encoding, &rendered)
        } else {
            self.after_prompt(messages, &ids)?
        };
        Ok(Tokens { ids, learned })
    }

    /// The tokens after the prompt of the last assistant message, learned.
    fn after_prompt(
        &self,
        messages: &serde_json::Value,
        ids: &[u32],
    ) -> std::result::Result<Vec<bool>, String> {
        let list = messages.as_array().map(Vec::as_slice).unwrap_or_default();
        let last = list
            .iter()
            .rposition(|m| m["role"] == "assistant")
            .ok_or("the conversation has no assistant message to learn from")?;
        let prompt = serde_json::Value::Array(list[..last].to_vec());
        let rendered = self.template()?.render(&prompt, true, &self.special)?;
        let prefix = self.encode(&rendered.text, false)?;
        let prefix = prefix.get_ids();
        if !ids.starts_with(prefix) {
            return Err("the chat template renders the conversation before its last assistant message (with add_generation_prompt) as other tokens than the start of the whole conversation, so the answer cannot be told apart; use a template with {% generation %} blocks".into());
        }
        Ok((0..ids.len()).map(|i| i >= prefix.len()).collect())
    }

    fn encode(
        &self,
        text: &str,
        special_tokens: bool,
    ) -> std::result::Result<tokenizers::Encoding, String> {
        self.tokenizer
            .encode(text, special_tokens)
            .map_err(|e| format!("the tokenizer refused the text: {e}"))
    }
}

/// transformers' assistant mask: every token that overlaps a generation block's output (one
/// that straddles a block's edge included, an empty block marking none). Offsets and blocks
/// are both in bytes of the rendered text, and both in order.
fn assistant_mask(encoding: &tokenizers::Encoding, rendered: &Rendered) -> Vec<bool> {
    let spans = &rendered.generation;
    let mut at = 0;
    let mut learned = vec![false; encoding.get_ids().len()];
    for (l, &(start, end)) in learned.iter_mut().zip(encoding.get_offsets()) {
        while at < spans.len() && start >= spans[at].end {
            at += 1;
        }
        let Some(span) = spans.get(at) else {
            break;
        };
        *l = end > span.start;
    }
    learned
}

/// `tokenizer_config.json` of `dir`, or an empty object where there is none.
fn read_config(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join(CONFIG_FILE);
    if !path.exists() {
        return Ok(serde_json::json!({}));
    }
    let bytes = regular_file::read(&path, "a tokenizer_config.json")?;
    serde_json::from_slice(&bytes)
        .map_err(|e| EngineError::bad_file(&path, format!("is not JSON: {e}")))
}

/// The source of the chat template in the tokenizer directory `dir`, where it has one, read
/// without reading the tokenizer itself (a run's identity records it).
pub fn chat_template_source(dir: &Path) -> Result<Option<String>> {
    Ok(template_source(dir, &read_config(dir)?)?.0)
}

/// The chat template's source and the file it is in: `chat_template.jinja`, else
/// `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates of which
/// the one named `default`).
fn template_source(dir: &Path, config: &serde_json::Value) -> Result<(Option<String>, PathBuf)> {
    let file = dir.join(TEMPLATE_FILE);
    if file.exists() {
        let bytes = regular_file::read(&file, "a chat template")?;
        let source = String::from_utf8(bytes)
            .map_err(|e| EngineError::bad_file(&file, format!("is not UTF-8: {e}")))?;
        return Ok((Some(source), file));
    }
    let source = match &config["chat_template"] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(named) => named
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(str::to_string),
        _ => None,
    };
    Ok((source, dir.join(CONFIG_FILE)))
}
