//! Shared by the report tests: two summaries compared but for what differs between two runs of
//! the same trials.

use serde_json::Value;

/// `v` without what differs between two runs of the same trials: times, and the host's memory
/// (the CPU device's capacity is the memory available when it opens).
pub fn without_timings(v: &mut Value) {
    match v {
        Value::Object(map) => {
            map.retain(|k, _| {
                !matches!(
                    k.as_str(),
                    "seconds" | "setup_seconds" | "host" | "capacity" | "max_rss"
                )
            });
            map.values_mut().for_each(without_timings);
        }
        Value::Array(items) => items.iter_mut().for_each(without_timings),
        _ => {}
    }
}

/// Where `a` and `b` first differ, as a JSON path.
pub fn first_difference(a: &Value, b: &Value, at: String) -> String {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => x
            .iter()
            .find(|(k, v)| y.get(*k) != Some(v))
            .map_or(format!("{at}: keys differ"), |(k, v)| {
                first_difference(v, y.get(k).unwrap_or(&Value::Null), format!("{at}.{k}"))
            }),
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find(|(_, (v, w))| v != w)
            .map_or(at.clone(), |(i, (v, w))| {
                first_difference(v, w, format!("{at}[{i}]"))
            }),
        _ => format!("{at}: {a} against {b}"),
    }
}
