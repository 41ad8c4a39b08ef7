//! `model:` of a suite: a Hugging Face `config.json` path relative to the suite, or the shape
//! written inline.

use ckpt_engine::LlamaConfig;
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use std::fmt;
use std::path::PathBuf;

/// The model: written inline, or a Hugging Face `config.json` path relative to the suite.
#[derive(Clone, Debug)]
pub enum ModelSpec {
    /// A path to a Hugging Face `config.json`.
    Path(PathBuf),
    /// The shape written out.
    Inline(LlamaConfig),
}

/// A path is a string, an inline model a mapping: each read as what it is, so that a mistyped
/// key inside an inline model is named at its place.
impl<'de> Deserialize<'de> for ModelSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ModelSpec;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("the path of a Hugging Face config.json relative to the suite, or the model's keys such as {vocab_size: 64, hidden_size: 32, ...}")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ModelSpec, E> {
                Ok(ModelSpec::Path(PathBuf::from(v)))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ModelSpec, A::Error> {
                LlamaConfig::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(ModelSpec::Inline)
            }
        }
        d.deserialize_any(V)
    }
}
