//! Snapshot files, the project's own reader and writer of the `.snap` layout insta introduced: a
//! header between two `---` lines (`source:` the code that renders the text, `expression:` what
//! the text shows, and where it was made in `environment:` when its numbers hold only there:
//! one execution environment, or several, comma-separated, that each gave the same text), then
//! the text. Texts compare after [`normalise`], so a trailing newline or
//! Windows line endings do not count.

/// A snapshot file's content.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// The code that renders the text.
    pub source: String,
    /// What the text shows.
    pub expression: String,
    /// The execution environments the text's numbers were made in, each giving the same text,
    /// where they hold only there (on the CPU its matrix kernels, `x86_64 fma`); empty in a
    /// snapshot that holds in every environment it runs in.
    pub environments: Vec<String>,
    /// The snapshot text, normalised.
    pub text: String,
}

/// The fix for a file that is not a snapshot.
const REWRITE: &str = "rewrite it with `ckpt-harness run --bless`";

/// `text` as snapshots compare it: Windows line endings as `\n`, trailing white space removed.
pub fn normalise(text: &str) -> String {
    text.replace("\r\n", "\n").trim_end().to_string()
}

impl Snapshot {
    /// Parses a snapshot file's content; the error says which line is wrong and how to fix it.
    pub fn parse(file: &str) -> Result<Snapshot, String> {
        let mut lines = file.split_inclusive('\n').enumerate();
        let fence = |line: &str| line.trim_end() == "---";
        if !lines.next().is_some_and(|(_, l)| fence(l)) {
            return Err(format!(
                "line 1: expected `---`, the start of the header; {REWRITE}"
            ));
        }
        let (mut source, mut expression, mut environments) = (None, None, Vec::new());
        let mut closed = false;
        for (i, line) in lines.by_ref() {
            if fence(line) {
                closed = true;
                break;
            }
            match line.trim_end().split_once(": ") {
                Some(("source", v)) => source = Some(v.to_string()),
                Some(("expression", v)) => expression = Some(v.to_string()),
                Some(("environment", v)) => {
                    environments = v.split(", ").map(str::to_string).collect()
                }
                Some(("snapshot_kind", "text")) => {}
                _ => {
                    return Err(format!(
                        "line {}: expected `source: ...`, `expression: ...` or `environment: ...` in the header, got {:?}; {REWRITE}",
                        i + 1,
                        line.trim_end()
                    ))
                }
            }
        }
        if !closed {
            return Err(format!("the header has no closing `---` line; {REWRITE}"));
        }
        let (Some(source), Some(expression)) = (source, expression) else {
            return Err(format!(
                "the header lacks `source:` or `expression:`; {REWRITE}"
            ));
        };
        let text: String = lines.map(|(_, l)| l).collect();
        Ok(Snapshot {
            source,
            expression,
            environments,
            text: normalise(&text),
        })
    }

    /// The file's content.
    pub fn to_file(&self) -> String {
        let environment = match self.environments.is_empty() {
            true => String::new(),
            false => format!("environment: {}\n", self.environments.join(", ")),
        };
        format!(
            "---\nsource: {}\nexpression: {}\n{environment}---\n{}\n",
            self.source,
            self.expression,
            normalise(&self.text)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn the_committed_snapshots_read_back_to_the_same_bytes() {
        let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden");
        let mut seen = 0;
        for device in ["cpu", "cuda"] {
            for entry in std::fs::read_dir(golden.join(device)).unwrap() {
                let file = entry.unwrap().path();
                let content = std::fs::read_to_string(&file).unwrap();
                let snap = Snapshot::parse(&content).unwrap();
                assert!(
                    snap.text.starts_with("reference trajectory of "),
                    "{file:?}"
                );
                assert_eq!(snap.to_file(), content, "{file:?}");
                seen += 1;
            }
        }
        assert!(seen >= 8, "{seen} snapshots");
    }

    #[test]
    fn line_endings_and_trailing_space_do_not_count() {
        let snap =
            Snapshot::parse("---\r\nsource: s\r\nexpression: e\r\n---\r\na\r\nb\r\n\r\n").unwrap();
        assert_eq!(snap.text, "a\nb");
        assert_eq!(snap.expression, "e");
        assert!(snap.environments.is_empty());
    }

    #[test]
    fn the_environments_read_back_as_written() {
        let file = "---\nsource: s\nexpression: e\nenvironment: x86_64 fma\n---\na\n";
        let snap = Snapshot::parse(file).unwrap();
        assert_eq!(snap.environments, ["x86_64 fma"]);
        assert_eq!(snap.to_file(), file);
        let both = file.replace("x86_64 fma", "x86_64 fma, NVIDIA H200");
        let snap = Snapshot::parse(&both).unwrap();
        assert_eq!(snap.environments, ["x86_64 fma", "NVIDIA H200"]);
        assert_eq!(snap.to_file(), both);
    }

    #[test]
    fn a_file_that_is_not_a_snapshot_says_the_line_and_the_fix() {
        for (file, line) in [
            ("step | loss\n0 | 1\n", "line 1: expected `---`"),
            (
                "---\nsource: s\nmodule: m\n---\nx\n",
                "line 3: expected `source: ...`",
            ),
            ("---\nsource: s\nexpression: e\n", "no closing `---`"),
            (
                "---\nsource: s\n---\nx\n",
                "lacks `source:` or `expression:`",
            ),
        ] {
            let e = Snapshot::parse(file).unwrap_err();
            assert!(e.contains(line) && e.contains("--bless"), "{e}");
        }
    }
}
