//! The benchmarks' figures a run carries: what `scripts/bench.sh --json FILE` measured (training
//! tokens/s per configuration and its ratio to PyTorch, checkpoint save and load GB/s and their
//! ratios to plain file input/output), read by `run --bench FILE` and `report merge --bench
//! FILE` into `summary.json`, where the trends compare them with the baseline's. Every figure is
//! one where more is better.

use anyhow::Result;
use ckpt_engine::regular_file;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::Path;

/// What a figures file that cannot be read should be replaced with.
const FIX: &str = "give the file `scripts/bench.sh --json FILE` wrote";

/// One measured figure.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Figure {
    /// What was measured, with its configuration: `engine tokens/s (fp32, 2 threads)`.
    pub name: String,
    /// Its unit: `tokens/s`, `GB/s`, or `x` for a ratio.
    pub unit: String,
    /// The figure: more is better.
    pub value: f64,
    /// A figure the engine's are held to rather than one of the engine's (PyTorch's tokens/s, a
    /// plain write's GB/s): shown beside them, not compared with the baseline's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reference: bool,
}

impl Figure {
    /// The value with its unit, to three significant figures or more (three decimals at most):
    /// `4506 tokens/s`, `1.37 GB/s`, `0.934x`.
    pub fn shown(&self) -> String {
        let v = self.value;
        let digits = match v.abs() {
            a if a >= 100.0 => 0,
            a if a >= 10.0 => 1,
            a if a >= 1.0 => 2,
            _ => 3,
        };
        if self.unit == "x" {
            format!("{v:.digits$}x")
        } else {
            format!("{v:.digits$} {}", self.unit)
        }
    }
}

/// The figures of one benchmark run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Bench {
    /// The command that measured them: `scripts/bench.sh --rounds 3`.
    #[serde(default)]
    pub command: String,
    /// The machine they were measured on: its CPU and cores.
    #[serde(default)]
    pub machine: String,
    /// Every figure, in the order measured.
    pub figures: Vec<Figure>,
}

/// Why a figures file (or a summary's `bench`) cannot be used: the place, and what is wrong.
#[derive(Debug, PartialEq)]
pub struct Invalid {
    /// Where: `figures[3] ("checkpoint load")`.
    pub place: String,
    /// What is wrong there.
    pub why: String,
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.place, self.why)
    }
}

impl Bench {
    /// Reads and checks the figures file `scripts/bench.sh --json FILE` wrote.
    pub fn read(file: &Path) -> Result<Self> {
        let text = regular_file::read(file, "the file `scripts/bench.sh --json FILE` wrote")?;
        let bench: Bench = serde_json::from_slice(&text).map_err(|e| {
            anyhow::anyhow!(
                "{}:{}:{}: not a benchmark figures file: {e}; {FIX}",
                file.display(),
                e.line(),
                e.column()
            )
        })?;
        bench
            .check()
            .map_err(|e| anyhow::anyhow!("{}: {e}; {FIX}", file.display()))?;
        Ok(bench)
    }

    /// Whether the figures can be compared: at least one, each named once, each value above 0.
    pub fn check(&self) -> Result<(), Invalid> {
        if self.figures.is_empty() {
            return Err(Invalid {
                place: "figures".into(),
                why: "no figure".into(),
            });
        }
        for (i, f) in self.figures.iter().enumerate() {
            let place = format!("figures[{i}] ({:?})", f.name);
            let bad = |why: String| {
                Err(Invalid {
                    place: place.clone(),
                    why,
                })
            };
            if f.name.trim().is_empty() {
                return bad("the name is empty".into());
            }
            if !(f.value.is_finite() && f.value > 0.0) {
                return bad(format!("value {} is not a number above 0", f.value));
            }
            if self.figures[..i].iter().any(|g| g.name == f.name) {
                return bad("named twice".into());
            }
        }
        Ok(())
    }

    /// The engine's figures, the ones compared with a baseline's.
    pub fn judged(&self) -> impl Iterator<Item = &Figure> {
        self.figures.iter().filter(|f| !f.reference)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figure(name: &str, value: f64) -> Figure {
        Figure {
            name: name.into(),
            unit: "GB/s".into(),
            value,
            reference: false,
        }
    }

    #[test]
    fn a_figures_file_reads_back_as_written() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("bench.json");
        std::fs::write(
            &file,
            r#"{"command": "scripts/bench.sh", "machine": "m, 2 cores", "figures": [
                {"name": "checkpoint load", "unit": "GB/s", "value": 1.37},
                {"name": "streaming read", "unit": "GB/s", "value": 17.6, "reference": true}]}"#,
        )
        .unwrap();
        let b = Bench::read(&file).unwrap();
        assert_eq!(b.machine, "m, 2 cores");
        let judged: Vec<&str> = b.judged().map(|f| f.name.as_str()).collect();
        assert_eq!(judged, ["checkpoint load"]);
        assert_eq!(b.figures[1].shown(), "17.6 GB/s");
    }

    #[test]
    fn bad_figures_are_refused_with_their_place() {
        let bench = |figures| Bench {
            command: String::new(),
            machine: String::new(),
            figures,
        };
        let cases = [
            (vec![], "figures: no figure"),
            (
                vec![figure("load", 0.0)],
                "figures[0] (\"load\"): value 0 is not a number above 0",
            ),
            (
                vec![figure("load", 1.0), figure("load", 2.0)],
                "figures[1] (\"load\"): named twice",
            ),
            (
                vec![figure(" ", 1.0)],
                "figures[0] (\" \"): the name is empty",
            ),
        ];
        for (figures, want) in cases {
            assert_eq!(bench(figures).check().unwrap_err().to_string(), want);
        }
    }

    #[test]
    fn a_file_that_is_not_figures_is_named_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("bench.json");
        std::fs::write(&file, "{\"figures\": [{\"name\": \"load\"}]}").unwrap();
        let e = format!("{:#}", Bench::read(&file).unwrap_err());
        assert!(e.contains("bench.json:1:"), "{e}");
        assert!(e.contains("missing field `unit`"), "{e}");
        assert!(e.ends_with(FIX), "{e}");
        std::fs::write(
            &file,
            r#"{"figures": [{"name": "load", "unit": "GB/s", "value": -1}]}"#,
        )
        .unwrap();
        let e = format!("{:#}", Bench::read(&file).unwrap_err());
        assert!(
            e.contains("bench.json: figures[0] (\"load\"): value -1 is not a number above 0; give"),
            "{e}"
        );
    }

    #[test]
    fn figures_are_shown_with_their_unit() {
        let mut f = figure("x", 4506.12);
        f.unit = "tokens/s".into();
        assert_eq!(f.shown(), "4506 tokens/s");
        f.unit = "x".into();
        f.value = 0.9345;
        assert_eq!(f.shown(), "0.934x");
        f.value = 12.34;
        assert_eq!(f.shown(), "12.3x");
    }
}
