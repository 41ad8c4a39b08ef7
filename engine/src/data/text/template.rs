//! A tokenizer's chat template, rendered as transformers' `apply_chat_template` renders it: a
//! Jinja environment with `trim_blocks` and `lstrip_blocks`, loop controls, Python's string and
//! dict methods (`minijinja-contrib`'s pycompat), `raise_exception`, and the special tokens as
//! variables. A `{% generation %}` block marks what the assistant says: the rendering returns
//! the byte range of each such block's output (transformers' `AssistantTracker`).

use crate::error::{EngineError, Result};
use minijinja::{Environment, Error, ErrorKind, Value};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Written where a `{% generation %}` block starts and ends, then cut out of the text.
const START: char = '\u{10FFFD}';
const END: char = '\u{10FFFC}';

/// A chat template, compiled.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where it was read from, for messages.
    origin: PathBuf,
    /// Whether it marks the assistant's output with `{% generation %}` blocks.
    marks_generation: bool,
}

/// A template's output: the text, and the byte ranges of its `{% generation %}` blocks' output.
#[derive(Debug, PartialEq)]
pub struct Rendered {
    /// The text the tokenizer reads.
    pub text: String,
    /// What the assistant says, as byte ranges of `text`, in order.
    pub generation: Vec<Range<usize>>,
}

impl ChatTemplate {
    /// Compiles `source`, read from `origin`.
    pub fn new(source: &str, origin: &Path) -> Result<Self> {
        let (source, marks_generation) = generation_as_filters(source);
        let mut env = Environment::new();
        let mut syntax = minijinja::syntax::SyntaxConfig::builder();
        syntax.trim_blocks(true).lstrip_blocks(true);
        env.set_syntax(
            syntax
                .build()
                .map_err(|e| EngineError::bad_file(origin, e.to_string()))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("ckpt_generation_start", |_: Value| START.to_string());
        env.add_filter("ckpt_generation_end", |_: Value| END.to_string());
        env.add_template_owned("chat_template", source)
            .map_err(|e| EngineError::bad_file(origin, describe(&e)))?;
        Ok(ChatTemplate {
            env,
            origin: origin.to_path_buf(),
            marks_generation,
        })
    }

    /// Whether the template marks the assistant's output (`{% generation %}`).
    pub fn marks_generation(&self) -> bool {
        self.marks_generation
    }

    /// Renders `messages` with the special tokens in `vars`; `add_generation_prompt` as
    /// transformers passes it. A text that holds one of the markers is refused.
    pub fn render(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        vars: &[(String, String)],
    ) -> std::result::Result<Rendered, String> {
        let template = self
            .env
            .get_template("chat_template")
            .map_err(|e| describe(&e))?;
        let mut ctx: std::collections::BTreeMap<String, Value> = vars
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        ctx.insert(
            "messages".into(),
            Value::from(minijinja::value::Serde(messages)),
        );
        ctx.insert("tools".into(), Value::from(()));
        ctx.insert("documents".into(), Value::from(()));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        let out = template.render(ctx).map_err(|e| {
            format!(
                "the chat template of {} refused the conversation: {}",
                self.origin.display(),
                describe(&e)
            )
        })?;
        split_marks(&out)
    }

    /// Where the template was read from.
    pub fn origin(&self) -> &Path {
        &self.origin
    }
}

/// `raise_exception(message)`: the template refuses its input.
fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// A template error with the template's line where it has one.
fn describe(e: &Error) -> String {
    let detail = e
        .detail()
        .map_or_else(|| e.kind().to_string(), str::to_string);
    match e.line() {
        Some(line) => format!("{detail} (chat template line {line})"),
        None => detail,
    }
}

/// `source` with every `{% generation %}` and `{% endgeneration %}` tag turned into an empty
/// filter block that prints a marker: two block tags where there was one, so the whitespace
/// control and trimming around them stay those of the original. Also whether there was one.
fn generation_as_filters(source: &str) -> (String, bool) {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    let mut found = false;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(close) = tag.find("%}") else {
            out.push_str(tag);
            return (out, found);
        };
        let inner = &tag[2..close];
        let left = inner.starts_with(['-', '+']).then(|| &inner[..1]);
        let right = inner
            .ends_with(['-', '+'])
            .then(|| &inner[inner.len() - 1..]);
        let word = inner.trim_matches(['-', '+']).trim();
        let filter = match word {
            "generation" => Some("ckpt_generation_start"),
            "endgeneration" => Some("ckpt_generation_end"),
            _ => None,
        };
        match filter {
            Some(filter) => {
                found = true;
                let (l, r) = (left.unwrap_or(""), right.unwrap_or(""));
                out.push_str(&format!("{{%{l} filter {filter} %}}{{% endfilter {r}%}}"));
            }
            None => out.push_str(&tag[..close + 2]),
        }
        rest = &tag[close + 2..];
    }
    out.push_str(rest);
    (out, found)
}

/// The rendered text without its markers, and the byte ranges between each start and end.
fn split_marks(out: &str) -> std::result::Result<Rendered, String> {
    let mut text = String::with_capacity(out.len());
    let mut generation = Vec::new();
    let mut open = None;
    for c in out.chars() {
        match c {
            START if open.is_none() => open = Some(text.len()),
            END => match open.take() {
                Some(start) => generation.push(start..text.len()),
                None => return Err(unexpected_mark()),
            },
            START => return Err(unexpected_mark()),
            c => text.push(c),
        }
    }
    if open.is_some() {
        return Err(unexpected_mark());
    }
    Ok(Rendered { text, generation })
}

fn unexpected_mark() -> String {
    format!(
        "the text holds U+{:X} or U+{:X}, the characters that mark a generation block, or the template nests generation blocks; remove them from the data",
        START as u32, END as u32
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(source: &str) -> ChatTemplate {
        ChatTemplate::new(source, Path::new("t.jinja")).unwrap()
    }

    #[test]
    fn generation_blocks_give_the_byte_ranges_of_their_output() {
        let t = chat(
            "{%- for m in messages %}<{{ m.role }}>\n{%- if m.role == 'assistant' %}\n{% generation %}{{ m.content }}!{% endgeneration %}\n{%- else %}{{ m.content }}{% endif %}\n{% endfor %}",
        );
        assert!(t.marks_generation());
        let messages = serde_json::json!([
            {"role": "user", "content": "hé"},
            {"role": "assistant", "content": "ça"},
        ]);
        let r = t.render(&messages, false, &[]).unwrap();
        // What jinja2 with trim_blocks and lstrip_blocks renders.
        assert_eq!(r.text, "<user>hé<assistant>ça!");
        assert_eq!(&r.text[r.generation[0].clone()], "ça!");
        assert_eq!(r.generation.len(), 1);
    }

    #[test]
    fn whitespace_control_on_generation_tags_is_kept() {
        let t = chat("a  {%- generation -%}  b  {%- endgeneration -%}  c");
        let r = t.render(&serde_json::json!([]), false, &[]).unwrap();
        assert_eq!(r.text, "abc");
        assert_eq!(r.generation, vec![std::ops::Range { start: 1, end: 2 }]);
        let plain = chat("a  {%- if true -%}  b  {%- endif -%}  c");
        assert!(!plain.marks_generation());
        assert_eq!(
            plain
                .render(&serde_json::json!([]), false, &[])
                .unwrap()
                .text,
            "abc"
        );
    }

    #[test]
    fn raise_exception_refuses_with_the_template_line() {
        let t = chat("{% for m in messages %}\n{% if m.role == 'tool' %}\n{{ raise_exception('no tools here') }}\n{% endif %}{% endfor %}");
        let e = t
            .render(&serde_json::json!([{"role": "tool"}]), false, &[])
            .unwrap_err();
        assert_eq!(
            e,
            "the chat template of t.jinja refused the conversation: no tools here (chat template line 3)"
        );
    }

    #[test]
    fn python_methods_and_special_tokens_are_there() {
        let t = chat("{{ bos_token }}{{ messages[0].content.strip() }}{{ eos_token }}");
        let vars = [
            ("bos_token".to_string(), "<s>".to_string()),
            ("eos_token".to_string(), "</s>".to_string()),
        ];
        let r = t
            .render(&serde_json::json!([{"content": " x "}]), false, &vars)
            .unwrap();
        assert_eq!(r.text, "<s>x</s>");
    }

    #[test]
    fn a_marker_in_the_data_is_refused() {
        let t = chat("{{ messages[0] }}");
        let e = t
            .render(&serde_json::json!(["\u{10FFFD}"]), false, &[])
            .unwrap_err();
        assert!(e.contains("U+10FFFD"), "{e}");
    }
}
