//! The summary of a run: its table, `summary.json` (written, and read back for trends and
//! merges) and JUnit XML.

use crate::checks::{golden, Check, Status};
use crate::report::bench::Bench;
use crate::report::changes::Trends;
use crate::run::trial::TrialResult;
use anyhow::Result;
use ckpt_engine::{regular_file, EngineError};
use serde::{Deserialize, Serialize};
use std::fmt::Write;
use std::path::Path;

/// The most failures of one check the table and JUnit show; `summary.json` keeps every one.
pub const FAILURES_SHOWN: usize = 10;

/// A trial that did not run, and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Skipped {
    /// The trial's name.
    pub name: String,
    /// Why it did not run.
    pub reason: String,
}

/// Everything a run produced.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Summary {
    /// Trials that passed.
    pub passed: usize,
    /// Trials that failed.
    pub failed: usize,
    /// Every trial that ran, with every check's verdict and figures, and every phase and step
    /// recorded.
    pub trials: Vec<TrialResult>,
    /// Trials that did not run.
    #[serde(default)]
    pub skipped: Vec<Skipped>,
    /// What changed against a baseline run, when one was given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trends: Option<Trends>,
    /// The benchmarks' figures measured with the run (`run --bench`); absent when none were.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bench: Option<Bench>,
}

impl Summary {
    /// The summary of these trials.
    pub fn new(trials: Vec<TrialResult>, skipped: Vec<Skipped>) -> Self {
        let passed = trials.iter().filter(|t| t.passed).count();
        Summary {
            passed,
            failed: trials.len() - passed,
            trials,
            skipped,
            trends: None,
            bench: None,
        }
    }

    /// Reads a `summary.json` that `run` or `report merge` wrote.
    pub fn read(file: &Path) -> Result<Self> {
        const WANTED: &str = "the summary.json a run wrote, or its directory";
        let text = regular_file::read(file, WANTED).map_err(|e| match e {
            EngineError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                anyhow::anyhow!("{}: does not exist; give {WANTED}", file.display())
            }
            e => e.into(),
        })?;
        let summary: Summary = serde_json::from_slice(&text).map_err(|e| {
            anyhow::anyhow!(
                "{}:{}:{}: not a summary ckpt-harness wrote: {e}; give the summary.json a run wrote",
                file.display(),
                e.line(),
                e.column()
            )
        })?;
        if let Some(Err(e)) = summary.bench.as_ref().map(Bench::check) {
            anyhow::bail!(
                "{}: bench.{e}; give the summary.json a run wrote",
                file.display()
            );
        }
        Ok(summary)
    }

    /// The table printed at the end of a run: one row per trial, its failed checks, then its
    /// failures (at most [`FAILURES_SHOWN`] per check).
    pub fn table(&self) -> String {
        let mut out = String::new();
        let w = self
            .trials
            .iter()
            .map(|t| t.name.len())
            .chain(self.skipped.iter().map(|s| s.name.len()))
            .fold(5, usize::max);
        let _ = writeln!(
            out,
            "{:<w$} {:<6} {:>7}  failed checks",
            "trial", "result", "seconds"
        );
        for t in &self.trials {
            let failed: Vec<&str> = t.failed_checks().iter().map(|c| c.name()).collect();
            let not_run: Vec<&str> = t.not_run_checks().iter().map(|c| c.name()).collect();
            let result = if t.passed { "PASS" } else { "FAIL" };
            let mut note = String::new();
            if !not_run.is_empty() {
                note = format!("  not run: {}", not_run.join(", "));
            }
            let not_applicable: Vec<&str> = t
                .checks
                .iter()
                .filter(|o| o.status == Status::NotApplicable)
                .map(|o| o.check.name())
                .collect();
            if !not_applicable.is_empty() {
                note.push_str(&format!("  not applicable: {}", not_applicable.join(", ")));
            }
            if !t.expect_fail.is_empty() {
                note.push_str(" (negative control)");
            }
            let _ = writeln!(
                out,
                "{:<w$} {result:<6} {:>7.2}  {}{note}",
                t.name,
                t.seconds,
                failed.join(", ")
            );
            if let Some(note) = t
                .checks
                .iter()
                .filter(|o| o.check == Check::Golden)
                .find_map(|o| o.figures.get(golden::LOSSES_NOT_COMPARED))
                .and_then(|v| v.as_str())
            {
                let _ = writeln!(out, "    golden: {note}");
            }
            if let Some(spread) = &t.repeat {
                let _ = writeln!(out, "    repeated: {}", spread.line());
            }
            if !t.passed {
                let _ = writeln!(out, "    {}", t.verdict);
                for line in t.failure_lines(FAILURES_SHOWN) {
                    let _ = writeln!(out, "    {line}");
                }
            }
        }
        for s in &self.skipped {
            let _ = writeln!(out, "{:<w$} {:<6} {:>7}  {}", s.name, "SKIP", "-", s.reason);
        }
        let _ = writeln!(
            out,
            "\n{} passed, {} failed, {} skipped",
            self.passed,
            self.failed,
            self.skipped.len()
        );
        out
    }

    /// Writes `summary.json` under `dir`.
    pub fn write_json(&self, dir: &Path) -> Result<()> {
        self.write_json_as(&dir.join("summary.json"))
    }

    /// Writes the summary to `file`, creating its directory; a failure leaves the previous
    /// file whole ([`crate::atomic_file`]).
    pub fn write_json_as(&self, file: &Path) -> Result<()> {
        crate::atomic_file::write(file, &serde_json::to_vec_pretty(self)?)
    }

    /// The run as JUnit XML: one test case per trial, with at most [`FAILURES_SHOWN`] failures
    /// per check.
    pub fn junit(&self) -> String {
        let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
        let seconds: f64 = self.trials.iter().map(|t| t.seconds).sum();
        let _ = writeln!(
            out,
            "<testsuites name=\"ckpt-harness\" tests=\"{}\" failures=\"{}\" skipped=\"{}\" time=\"{seconds:.3}\">",
            self.trials.len() + self.skipped.len(),
            self.failed,
            self.skipped.len()
        );
        let _ = writeln!(
            out,
            "  <testsuite name=\"suites\" tests=\"{}\" failures=\"{}\" skipped=\"{}\" time=\"{seconds:.3}\">",
            self.trials.len() + self.skipped.len(),
            self.failed,
            self.skipped.len()
        );
        for t in &self.trials {
            let _ = write!(
                out,
                "    <testcase classname=\"{}\" name=\"{}\" time=\"{:.3}\"",
                xml_escape(t.device.name()),
                xml_escape(&t.name),
                t.seconds
            );
            if t.passed {
                out.push_str("/>\n");
                continue;
            }
            out.push_str(">\n");
            let _ = writeln!(
                out,
                "      <failure message=\"{}\">{}</failure>",
                xml_escape(&t.verdict),
                xml_escape(&t.failure_lines(FAILURES_SHOWN).join("\n"))
            );
            out.push_str("    </testcase>\n");
        }
        for s in &self.skipped {
            let _ = writeln!(
                out,
                "    <testcase classname=\"{}\" name=\"{}\"><skipped message=\"{}\"/></testcase>",
                xml_escape(s.name.split("::").next().unwrap_or("")),
                xml_escape(&s.name),
                xml_escape(&s.reason)
            );
        }
        out.push_str("  </testsuite>\n</testsuites>\n");
        out
    }
}

/// Escapes text for XML content and attribute values; drops characters XML 1.0 forbids.
pub fn xml_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\n' => out.push_str("&#10;"),
            '\t' | '\r' => {
                let _ = write!(out, "&#{};", c as u32);
            }
            c if (c as u32) < 0x20 || c == '\u{FFFE}' || c == '\u{FFFF}' => {}
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_summary_that_is_not_there_is_named_with_what_to_give() {
        let tmp = tempfile::tempdir().unwrap();
        let gone = tmp.path().join("summary.json");
        assert_eq!(
            Summary::read(&gone).unwrap_err().to_string(),
            format!(
                "{}: does not exist; give the summary.json a run wrote, or its directory",
                gone.display()
            )
        );
    }

    #[test]
    fn escapes_markup_and_drops_forbidden_characters() {
        assert_eq!(
            xml_escape("a<b>&\"c\" 'd'\u{1}\n"),
            "a&lt;b&gt;&amp;&quot;c&quot; &apos;d&apos;&#10;"
        );
    }

    #[test]
    fn skipped_trials_are_junit_skips() {
        let s = Summary::new(
            Vec::new(),
            vec![Skipped {
                name: "cuda::t".into(),
                reason: "no <device>".into(),
            }],
        );
        let x = s.junit();
        assert!(x.contains("<testcase classname=\"cuda\" name=\"cuda::t\"><skipped message=\"no &lt;device&gt;\"/></testcase>"), "{x}");
        assert!(
            x.contains("tests=\"1\" failures=\"0\" skipped=\"1\""),
            "{x}"
        );
    }

    proptest! {
        /// Escaped text holds no markup character and no control character.
        #[test]
        fn escaped_text_is_inert(text in ".*") {
            let e = xml_escape(&text);
            prop_assert!(!e.contains(['<', '>', '"', '\'']));
            prop_assert!(e.chars().all(|c| c as u32 >= 0x20));
        }
    }
}
