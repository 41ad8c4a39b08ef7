//! Where things are in a suite file, for errors: `file:line:column` of every key and its value,
//! recorded when the suite is parsed, for what is validated after parsing (the engine's
//! refusals included, which name their key); and the YAML library's own errors, worded for a
//! suite's author.

use serde::de::{MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_saphyr::{
    DefaultMessageFormatter, Location, MessageFormatter, NonFiniteFloatPolicy, Spanned,
};
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

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

/// Where every key of a suite file is written, read once when the suite is parsed: each key by
/// its path (`training.keep_last`; a list's item as `optimizer.betas[1]`), with the place of
/// the key and of its value. Errors found after parsing, the engine's included, are placed by
/// looking their key up here, never by searching the text.
#[derive(Clone, Debug, Default)]
pub struct Places {
    file: PathBuf,
    keys: BTreeMap<String, Spot>,
}

/// Where a key and its value are written; a list's item has no key of its own.
#[derive(Clone, Copy, Debug)]
struct Spot {
    key: Option<Location>,
    value: Location,
}

impl Places {
    /// The places of the keys in `text`, read from `file`; none where `text` cannot be read so
    /// (the suite's own parse says why).
    pub fn of(file: &Path, text: &str) -> Self {
        let mut keys = BTreeMap::new();
        // A NaN or an infinity is a value like any other here; the suite's own parse reads it.
        let options = serde_saphyr::options! {
            non_finite_float_policy: NonFiniteFloatPolicy::PassThrough,
        };
        if let Ok(root) = serde_saphyr::from_str_with_options::<Node>(text, options) {
            root.flatten("", &mut keys);
        }
        Places {
            file: file.to_path_buf(),
            keys,
        }
    }

    /// `file:line:column` of the value of `key`, or of the nearest key above it that is
    /// written (`optimizer.betas[1]`, `optimizer.betas`, then `optimizer`); the file alone
    /// when none is.
    pub fn value(&self, key: &str) -> String {
        self.nearest(key, |spot| Some(spot.value))
    }

    /// `file:line:column` of `key` itself, or of the nearest key above it that is written (a
    /// list's item is placed at its list's key); the file alone when none is.
    pub fn key(&self, key: &str) -> String {
        self.nearest(key, |spot| spot.key)
    }

    fn nearest(&self, key: &str, at: impl Fn(&Spot) -> Option<Location>) -> String {
        let mut path = key;
        loop {
            if let Some(loc) = self.keys.get(path).and_then(&at) {
                return place(&self.file, loc);
            }
            match path.rfind(['.', '[']) {
                Some(end) => path = &path[..end],
                None => return self.file.display().to_string(),
            }
        }
    }
}

/// A YAML node's keys (or a list's items), each with where it is written, for [`Places`].
#[derive(Default)]
struct Node(Vec<(String, Option<Location>, Spanned<Node>)>);

impl Node {
    /// Every key below this node, by its path after `prefix`, into `keys`.
    fn flatten(self, prefix: &str, keys: &mut BTreeMap<String, Spot>) {
        for (part, key, value) in self.0 {
            let path = match (prefix.is_empty(), part.starts_with('[')) {
                (true, _) | (false, true) => format!("{prefix}{part}"),
                (false, false) => format!("{prefix}.{part}"),
            };
            let spot = Spot {
                key,
                value: value.referenced,
            };
            keys.insert(path.clone(), spot);
            value.value.flatten(&path, keys);
        }
    }
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct NodeVisitor;
        impl<'de> Visitor<'de> for NodeVisitor {
            type Value = Node;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any YAML value")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
                let mut parts = Vec::new();
                while let Some(key) = map.next_key::<Spanned<String>>()? {
                    let value = map.next_value::<Spanned<Node>>()?;
                    parts.push((key.value, Some(key.referenced), value));
                }
                Ok(Node(parts))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
                let mut parts = Vec::new();
                while let Some(item) = seq.next_element::<Spanned<Node>>()? {
                    parts.push((format!("[{}]", parts.len()), None, item));
                }
                Ok(Node(parts))
            }

            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Node, D::Error> {
                Node::deserialize(d)
            }

            fn visit_bool<E>(self, _: bool) -> Result<Node, E> {
                Ok(Node::default())
            }

            fn visit_i64<E>(self, _: i64) -> Result<Node, E> {
                Ok(Node::default())
            }

            fn visit_i128<E>(self, _: i128) -> Result<Node, E> {
                Ok(Node::default())
            }

            fn visit_u64<E>(self, _: u64) -> Result<Node, E> {
                Ok(Node::default())
            }

            fn visit_u128<E>(self, _: u128) -> Result<Node, E> {
                Ok(Node::default())
            }

            fn visit_f64<E>(self, _: f64) -> Result<Node, E> {
                Ok(Node::default())
            }

            fn visit_str<E>(self, _: &str) -> Result<Node, E> {
                Ok(Node::default())
            }

            fn visit_bytes<E>(self, _: &[u8]) -> Result<Node, E> {
                Ok(Node::default())
            }

            fn visit_none<E>(self) -> Result<Node, E> {
                Ok(Node::default())
            }

            fn visit_unit<E>(self) -> Result<Node, E> {
                Ok(Node::default())
            }
        }
        d.deserialize_any(NodeVisitor)
    }
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
