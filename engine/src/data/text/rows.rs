//! A dataset's rows as JSON objects, each with its place in the file: the lines of a JSONL file,
//! or the rows of a Parquet file's row groups (as the Hugging Face Hub serves datasets, read by
//! arrow-rs's `parquet`). Which by the file's extension.

use crate::error::{EngineError, Result};
use crate::regular_file;
use parquet::file::reader::{FileReader, SerializedFileReader};
use std::path::Path;

/// A row's columns by name.
pub type Row = serde_json::Map<String, serde_json::Value>;

/// What a dataset is, for messages.
pub const DATASET: &str = "a JSONL or Parquet dataset";

/// Every row of the dataset at `path` and where it is (`line 3`, `row group 0, row 5`), or what
/// is wrong with it there; a file that cannot be read at all is an error.
pub fn read(path: &Path) -> Result<Vec<(String, std::result::Result<Row, String>)>> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("parquet") => parquet_rows(path),
        Some("jsonl" | "json") => jsonl_rows(path),
        _ => Err(EngineError::bad_file(
            path,
            "is neither .jsonl nor .parquet; name a JSONL file (one JSON object a line) or a Parquet file, with its extension",
        )),
    }
}

/// The lines of a JSONL file that hold anything but white space, each a JSON object.
fn jsonl_rows(path: &Path) -> Result<Vec<(String, std::result::Result<Row, String>)>> {
    let bytes = regular_file::read(path, DATASET)?;
    Ok(bytes
        .split(|&b| b == b'\n')
        .enumerate()
        .filter(|(_, line)| !line.iter().all(u8::is_ascii_whitespace))
        .map(|(at, line)| (format!("line {}", at + 1), jsonl_row(line)))
        .collect())
}

fn jsonl_row(line: &[u8]) -> std::result::Result<Row, String> {
    let line = std::str::from_utf8(line).map_err(|e| {
        format!(
            "is not UTF-8 (byte {} of the line); write the file as UTF-8",
            e.valid_up_to() + 1
        )
    })?;
    serde_json::from_str(line)
        .map_err(|e| format!("is not a JSON object ({e}); a JSONL dataset holds one object a line"))
}

/// The rows of a Parquet file, row group by row group.
fn parquet_rows(path: &Path) -> Result<Vec<(String, std::result::Result<Row, String>)>> {
    let (file, _) = regular_file::open(path, DATASET)?;
    let unreadable = |e: parquet::errors::ParquetError| {
        EngineError::bad_file(
            path,
            format!("is not a Parquet file this build reads: {e}; write it with pyarrow or Hugging Face datasets (snappy, zstd, lz4 or gzip compression)"),
        )
    };
    let reader = SerializedFileReader::new(file).map_err(unreadable)?;
    let mut rows = Vec::new();
    for group in 0..reader.num_row_groups() {
        let group_reader = reader.get_row_group(group).map_err(unreadable)?;
        let rows_of_group = group_reader.get_row_iter(None).map_err(unreadable)?;
        for (at, row) in rows_of_group.enumerate() {
            let place = format!("row group {group}, row {at}");
            let row = row
                .map_err(|e| format!("cannot be read: {e}"))
                .and_then(|row| match row.to_json_value() {
                    serde_json::Value::Object(map) => Ok(map),
                    _ => Err("is not a row of named columns".to_string()),
                });
            rows.push((place, row));
        }
    }
    Ok(rows)
}
