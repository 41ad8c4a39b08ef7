//! `trainer_state.json`: where training stood when a checkpoint was written, which run it belongs
//! to, and the size and checksums of every other file.

use crate::data::LoaderState;
use crate::environment::ExecutionEnv;
use crate::optim::Schedule;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The layout of a checkpoint this build writes; it reads it and every older version. Version 2
/// added `trainer_state.json.sha256` (see [`super::state_file`]), [`SHARDED_FORMAT_VERSION`]
/// the sharded layout, version 4 records each file by its XXH3-128 alone: sha256 is
/// computed on demand (`verify`) instead of on every save, and version 5 records each file by
/// the XXH3-128 of each of its segments ([`Segments`]), so that a load checks the segments on
/// every core at once, each while it is in cache, and hashes a sharded checkpoint's whole
/// tensors over fixed blocks of the tensor ([`super::tensor_hash`]), so that ranks hash their
/// own rows while they read them.
pub const FORMAT_VERSION: u32 = 5;

/// The version of a checkpoint saved by several ranks without gathering: its tensors are in a
/// file per rank and [`super::shards::SHARDS_FILE`] (see [`super::shards`]). Builds before it
/// refuse it as written by a newer build instead of finding no `model.safetensors`.
pub const SHARDED_FORMAT_VERSION: u32 = 3;

/// One file of a checkpoint, as written.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    /// Size in bytes.
    pub bytes: u64,
    /// Hex sha256 of the content, as `sha256sum` prints it (recorded up to format version 3:
    /// later checkpoints leave it to `verify`, which computes it on demand).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Hex XXH3-128 of the content, which loading verifies (recorded by format version 4;
    /// absent in checkpoints written before it, whose sha256 loading verifies, and after it,
    /// which record `segments` instead).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xxh3_128: Option<String>,
    /// The XXH3-128 of each segment of the content, which loading verifies (recorded from
    /// format version 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub segments: Option<Segments>,
}

/// A file's content cut into consecutive segments of `bytes` bytes (the last one shorter when
/// the size is not a multiple), each recorded by its XXH3-128: every segment can be checked on
/// its own, on any core, in any order, and a damaged one names its byte range.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Segments {
    /// Bytes of each segment but the last.
    pub bytes: u64,
    /// Hex XXH3-128 of each segment, in file order.
    pub xxh3_128: Vec<String>,
}

/// The learning-rate schedule and where it stands.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScheduleState {
    /// The schedule (its horizon included).
    pub schedule: Schedule,
    /// The peak learning rate.
    pub peak_lr: f64,
    /// The rate the next step will use.
    pub next_lr: f64,
}

/// The state of the trainer's random generator (it draws the dropout masks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {
    /// Seed of the run's generator.
    pub seed: u64,
    /// Where the generator stands: one per micro-batch taken (one per step without gradient
    /// accumulation); a micro-batch's masks are keyed by it.
    pub offset: u64,
}

/// Everything in `trainer_state.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Layout version.
    pub format_version: u32,
    /// Steps completed.
    pub global_step: u64,
    /// AdamW updates applied (its bias-correction step).
    pub optimizer_step: u64,
    /// Learning-rate schedule.
    pub schedule: ScheduleState,
    /// Data-loader position.
    pub loader: LoaderState,
    /// Random generator.
    pub rng: RngState,
    /// sha256 of `identity`'s canonical JSON.
    pub fingerprint: String,
    /// The configuration that must match for a resume: model, precision, optimizer, schedule,
    /// data and batch shape.
    pub identity: serde_json::Value,
    /// What bitwise resume depends on, as the device that saved the checkpoint reported it
    /// (absent in checkpoints written before it was recorded; see [`crate::environment`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<ExecutionEnv>,
    /// Every other file of the checkpoint.
    pub files: BTreeMap<String, FileRecord>,
}

/// Only the version, read first so that a newer layout gets a version error, not a parse error.
#[derive(Deserialize)]
pub(crate) struct VersionProbe {
    pub format_version: u32,
}

/// The first place two JSON values differ, as `path: a vs b`.
pub fn first_difference(
    a: &serde_json::Value,
    b: &serde_json::Value,
    path: &str,
) -> Option<String> {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| {
                let sub = child_path(path, k);
                match (x.get(k), y.get(k)) {
                    (Some(p), Some(q)) => first_difference(p, q, &sub),
                    (p, q) => Some(format!("{sub}: {} vs {}", show(p), show(q))),
                }
            })
        }
        _ if a == b => None,
        _ => Some(format!("{path}: {a} vs {b}")),
    }
}

/// A checkpoint's identity (`recorded`) and a run's (`current`) as they are compared. A token
/// file's identity written before its content was recorded names its path as spelled instead
/// (see [`crate::data::DataConfig::identity`]): such a checkpoint's token file is compared by its
/// dtype alone, since a path spelled from another directory says nothing of what the file was,
/// and its content was never recorded.
pub(crate) fn comparable(
    recorded: &serde_json::Value,
    current: &serde_json::Value,
) -> (serde_json::Value, serde_json::Value) {
    let (mut recorded, mut current) = (recorded.clone(), current.clone());
    let token_file = |v: &serde_json::Value| v["data"]["kind"] == "token_file";
    if token_file(&recorded) && token_file(&current) && recorded["data"].get("content").is_none() {
        for (data, key) in [(&mut recorded, "path"), (&mut current, "content")] {
            if let Some(data) = data["data"].as_object_mut() {
                data.remove(key);
            }
        }
    }
    (recorded, current)
}

/// The path of key `key` inside the value at `path`, as `a.b.key`.
pub(crate) fn child_path(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn show(v: Option<&serde_json::Value>) -> String {
    v.map_or_else(|| "absent".to_string(), |v| v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_token_file_recorded_by_its_path_is_compared_by_its_dtype() {
        let old = json!({"data": {"kind": "token_file", "path": "a/tok.bin", "dtype": "u16"}});
        let content =
            |c: &str| json!({"data": {"kind": "token_file", "dtype": "u16", "content": c}});
        let (r, c) = comparable(&old, &content("4 bytes, sha256 ab"));
        assert_eq!(first_difference(&r, &c, ""), None);
        let wide = json!({"data": {"kind": "token_file", "path": "a/tok.bin", "dtype": "u32"}});
        let (r, c) = comparable(&wide, &content("4 bytes, sha256 ab"));
        assert_eq!(
            first_difference(&r, &c, "").as_deref(),
            Some("data.dtype: \"u32\" vs \"u16\"")
        );
        let (r, c) = comparable(
            &content("4 bytes, sha256 ab"),
            &content("6 bytes, sha256 cd"),
        );
        assert_eq!(
            first_difference(&r, &c, "").as_deref(),
            Some("data.content: \"4 bytes, sha256 ab\" vs \"6 bytes, sha256 cd\"")
        );
    }

    #[test]
    fn the_first_difference_names_its_path_and_both_values() {
        let a = json!({"model": {"layers": 2, "tie": true}, "seed": 1});
        assert_eq!(first_difference(&a, &a, ""), None);
        let b = json!({"model": {"layers": 3, "tie": true}, "seed": 1});
        assert_eq!(
            first_difference(&a, &b, "").as_deref(),
            Some("model.layers: 2 vs 3")
        );
        let c = json!({"model": {"layers": 2}, "seed": 1, "extra": "x"});
        assert_eq!(
            first_difference(&a, &c, "").as_deref(),
            Some("extra: absent vs \"x\"")
        );
        assert_eq!(
            first_difference(&c, &a, "").as_deref(),
            Some("extra: \"x\" vs absent")
        );
    }
}
