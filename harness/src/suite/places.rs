//! Where things are in a suite file, for errors: `file:line:column` of the keys validated after
//! parsing, of an inline model's keys, and of the YAML library's own errors, worded for a
//! suite's author.

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_saphyr::{DefaultMessageFormatter, Location, MessageFormatter, Spanned};
use std::collections::BTreeMap;
use std::path::Path;

/// A key's value and where it is written.
type Place = Option<Spanned<IgnoredAny>>;

/// `file:line:column`, or the file alone when the place is unknown.
pub fn place(path: &Path, loc: Location) -> String {
    if loc == Location::UNKNOWN {
        path.display().to_string()
    } else {
        format!("{}:{}:{}", path.display(), loc.line(), loc.column())
    }
}

/// The text of the suite file `path` whose bytes are `bytes`; where they are not UTF-8, the
/// error gives the first invalid byte's `file:line:column` (the column counted in characters)
/// and offset.
pub fn utf8_text(path: &Path, bytes: Vec<u8>) -> Result<String, String> {
    String::from_utf8(bytes).map_err(|e| {
        let valid = &e.as_bytes()[..e.utf8_error().valid_up_to()];
        let text = std::str::from_utf8(valid).expect("the prefix before the error is UTF-8");
        let line = text.matches('\n').count() + 1;
        let column = text.rsplit('\n').next().unwrap_or("").chars().count() + 1;
        let byte = e.as_bytes()[valid.len()];
        format!(
            "{}:{line}:{column}: byte 0x{byte:02x} (offset {}) is not UTF-8; a suite file is UTF-8 text: save it as UTF-8 or remove that byte",
            path.display(),
            valid.len()
        )
    })
}

/// Where `key` is, or the file alone when it is not written.
pub fn place_of(path: &Path, key: &Place) -> String {
    place(path, location(key))
}

/// Where `key` is, if it is written.
pub fn location(key: &Place) -> Location {
    key.as_ref().map_or(Location::UNKNOWN, |k| k.referenced)
}

/// Where keys validated after parsing are written: a second, lenient pass over the text.
#[derive(Default, Deserialize)]
pub struct Places {
    /// `name`.
    #[serde(default)]
    pub name: Place,
    /// `model`.
    #[serde(default)]
    pub model: Place,
    /// `seq_len`.
    #[serde(default)]
    pub seq_len: Place,
    /// `dropout`.
    #[serde(default)]
    pub dropout: Place,
    /// `faults`.
    #[serde(default)]
    pub faults: Place,
    /// `engine`.
    #[serde(default)]
    pub engine: Place,
    /// `checks`.
    #[serde(default)]
    pub checks: Place,
    /// `threads`.
    #[serde(default)]
    pub threads: Place,
    /// Keys under `long_batch`.
    #[serde(default)]
    pub long_batch: LongBatchPlaces,
    /// Keys under `training`.
    #[serde(default)]
    pub training: TrainingPlaces,
    /// Keys under `parallel`.
    #[serde(default)]
    pub parallel: ParallelPlaces,
}

/// Where keys under `parallel:` are written.
#[derive(Default, Deserialize)]
pub struct ParallelPlaces {
    /// `parallel.world_size`.
    #[serde(default)]
    pub world_size: Place,
}

/// Where keys under `long_batch:` are written.
#[derive(Default, Deserialize)]
pub struct LongBatchPlaces {
    /// `long_batch.seq_len`.
    #[serde(default)]
    pub seq_len: Place,
    /// `long_batch.from_step`.
    #[serde(default)]
    pub from_step: Place,
}

/// Where keys under `training:` are written.
#[derive(Default, Deserialize)]
pub struct TrainingPlaces {
    /// `training.keep_last`.
    #[serde(default)]
    pub keep_last: Place,
    /// `training.extra_steps`.
    #[serde(default)]
    pub extra_steps: Place,
}

impl Places {
    /// The places in `text`; none when it cannot be read so.
    pub fn of(text: &str) -> Self {
        serde_saphyr::from_str(text).unwrap_or_default()
    }
}

/// Where the inline model's keys are, to point model errors at the key they name.
#[derive(Deserialize)]
struct ModelKeys {
    model: BTreeMap<String, Spanned<IgnoredAny>>,
}

/// Where a model error about `message` belongs: the inline model key it names first, else the
/// `model` key.
pub fn model_error_place(path: &Path, text: &str, message: &str) -> String {
    if let Ok(keys) = serde_saphyr::from_str::<ModelKeys>(text) {
        let named = keys
            .model
            .iter()
            .filter_map(|(k, v)| message.find(k.as_str()).map(|at| (at, v.referenced)))
            .min_by_key(|(at, _)| *at);
        if let Some((_, loc)) = named {
            return place(path, loc);
        }
    }
    place_of(path, &Places::of(text).model)
}

/// Where the key `path` (`optimizer.lr`, `optimizer.betas[1]`, as the engine's messages name
/// keys) is written: its first part at the start of a line, each next part after it; the file
/// alone when it cannot be found.
pub fn key_path_place(path: &Path, text: &str, key: &str) -> String {
    let is_key_char = |c: char| c.is_alphanumeric() || c == '_';
    let find = |from: usize, part: &str, line_start: bool| {
        text[from..]
            .match_indices(&format!("{part}:"))
            .map(|(at, _)| from + at)
            .find(|&at| {
                let before = text[..at].chars().next_back();
                match line_start {
                    true => before.is_none_or(|c| c == '\n'),
                    false => !before.is_some_and(is_key_char),
                }
            })
    };
    let mut parts = key.split('.').map(|p| p.split('[').next().unwrap_or(p));
    let mut at = parts.next().and_then(|first| find(0, first, true));
    for part in parts {
        at = at.and_then(|from| find(from, part, false));
    }
    let Some(at) = at else {
        return path.display().to_string();
    };
    let line = text[..at].matches('\n').count() + 1;
    let column = text[..at].rfind('\n').map_or(at, |nl| at - nl - 1) + 1;
    format!("{}:{line}:{column}", path.display())
}

/// The key written just before the value at `loc` on its line: `key: value`, or
/// `{a: 1, key: value}`.
fn key_before(text: &str, loc: Location) -> Option<String> {
    let line = text.lines().nth((loc.line() as usize).checked_sub(1)?)?;
    let before: String = line
        .chars()
        .take((loc.column() as usize).checked_sub(1)?)
        .collect();
    let before = before.trim_end().strip_suffix(':')?;
    let key: String = before
        .chars()
        .rev()
        .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '-')
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    (!key.is_empty()).then_some(key)
}

/// The scalar written at `loc`, up to the end of its line or flow collection.
fn value_at(text: &str, loc: Location) -> Option<String> {
    let line = text.lines().nth((loc.line() as usize).checked_sub(1)?)?;
    let value: String = line
        .chars()
        .skip((loc.column() as usize).checked_sub(1)?)
        .take_while(|c| !",}]#".contains(*c))
        .collect();
    Some(value.trim().to_string())
}

/// A value of the Rust type `ty` in words, and an example of one.
fn kind(ty: &str) -> (&str, &'static str) {
    match ty {
        "f32" | "f64" => ("a number", " such as 0.001"),
        "bool" => ("true or false", ""),
        t if t.starts_with('u') || t.starts_with('i') => ("a whole number", " such as 2"),
        t => (t, ""),
    }
}

/// The line of the `---` that starts a second document, if the text has one.
fn second_document(text: &str) -> Option<u32> {
    let mut content = false;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim_end();
        if line == "---" || line.starts_with("--- ") {
            if content {
                return u32::try_from(i + 1).ok();
            }
        } else if !line.trim_start().is_empty() && !line.trim_start().starts_with('#') {
            content = true;
        }
    }
    None
}

/// The YAML library's error `e` in `path` (whose content is `text`) at its place, with the key
/// and the fix, in words for a suite's author rather than the library's options.
pub fn yaml_error(path: &Path, text: &str, e: &serde_saphyr::Error) -> String {
    use serde_saphyr::Error;
    let e = e.without_snippet();
    let loc = e.location().unwrap_or(Location::UNKNOWN);
    let at = place(path, loc);
    let key = key_before(text, loc);
    let message = match e {
        Error::DuplicateMappingKey { key, .. } => format!(
            "{} is written twice in the same mapping; keep one of them",
            key.as_deref()
                .map_or("a key".to_string(), |k| format!("key `{k}`"))
        ),
        Error::MultipleDocuments { .. } => {
            let line = second_document(text).map_or(at, |l| format!("{}:{l}:1", path.display()));
            return format!(
                "{line}: a second YAML document starts here, but a suite file holds one document; remove this `---` line and what follows it, or move that into a suite file of its own"
            );
        }
        Error::InvalidScalar { ty, .. } => {
            let (what, example) = kind(ty);
            let value = value_at(text, loc).unwrap_or_default();
            format!("`{value}` is not {what}; write {what}{example}")
        }
        other => DefaultMessageFormatter.format_message(other).into_owned(),
    };
    match key {
        Some(k) if !message.contains(&k) => format!("{at}: {k}: {message}"),
        _ => format!("{at}: {message}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_utf8_is_placed_at_its_first_bad_byte() {
        let path = Path::new("s.yaml");
        let bytes = b"name: x\nmodel: \xc3\xa9t\xe9\n".to_vec();
        let e = utf8_text(path, bytes).unwrap_err();
        assert!(
            e.starts_with("s.yaml:2:10: byte 0xe9 (offset 18) is not UTF-8;"),
            "{e}"
        );
        let first = utf8_text(path, b"\xff".to_vec()).unwrap_err();
        assert!(
            first.starts_with("s.yaml:1:1: byte 0xff (offset 0)"),
            "{first}"
        );
        assert_eq!(utf8_text(path, b"a: b".to_vec()).unwrap(), "a: b");
    }
}
